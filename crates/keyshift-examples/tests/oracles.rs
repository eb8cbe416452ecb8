//! The example jobs through everything a keyshift job lives through, in one process (the SDK's
//! harness): incremental checkpoints, a killed run restored from its last checkpoint, rescales
//! up, down and to a parallelism that does not divide the key groups, a stop and resume, and a
//! key-group ceiling change. Their committed output (what an exactly-once sink shows) must equal
//! the oracle's, with nothing missing and nothing twice.

use keyshift_examples::dedup::{self, Dedup, Traffic};
use keyshift_examples::orders::{self, Event as ShopEvent, Shop};
use keyshift_examples::page_views::{self, CountViews};
use keyshift_examples::sessions::{self, Browsing, CountVisits};
use keyshift_examples::silence::{self, Fleet, SilenceAlert};
use keyshift_sdk::KeyedProcessFunction;
use keyshift_sdk::join::JoinInput;
use keyshift_sdk::testing::{Harness, run_job};
use keyshift_sdk::windows::{EventTimeSessions, Partial, TumblingWindows, window_start};
use std::time::Duration;

/// What happens to the running job, in order, between batches of input.
#[derive(Debug, Clone, Copy)]
enum Event {
    /// Reads this many records.
    Read(usize),
    Checkpoint,
    /// Kills every subtask: the job restarts from its last checkpoint.
    Kill,
    /// Savepoint, then restart at this parallelism.
    Rescale(u32),
    /// Savepoint, rewrite to this many key groups, restart at the parallelism.
    Ceiling(u32, u32),
}

use Event::*;

/// Every path a job's state takes: checkpoints and kills (one right after a checkpoint, one
/// long after), rescales 2 -> 4 -> 3 -> 1 -> 2 (stop and resume at 2), a ceiling change from 128 to
/// 256 groups.
const SCRIPT: &[Event] = &[
    Read(400),
    Checkpoint,
    Read(300),
    Kill,
    Read(500),
    Checkpoint,
    Read(200),
    Checkpoint,
    Kill,
    Rescale(4),
    Read(700),
    Checkpoint,
    Read(350),
    Rescale(3),
    Read(600),
    Checkpoint,
    Read(250),
    Kill,
    Read(400),
    Rescale(1),
    Read(300),
    Checkpoint,
    Rescale(2),
    Rescale(2),
    Read(500),
    Ceiling(256, 3),
    Read(400),
    Checkpoint,
    Read(333),
    Kill,
];

/// Runs `script` (in batches of at most 50 records, the watermark advancing after each), then
/// the rest of the input, ends event time and takes a last checkpoint; returns the committed
/// output and the harness.
fn run<F>(mut h: Harness<F>, script: &[Event]) -> Harness<F>
where
    F: KeyedProcessFunction,
    F::In: Clone,
{
    let mut incremental_seen = false;
    for e in script {
        match *e {
            Read(n) => {
                let mut left = n;
                while left > 0 && !h.at_end() {
                    let step = left.min(50);
                    h.step(step).unwrap();
                    left -= step;
                }
            }
            Checkpoint => {
                let snap = h.checkpoint().unwrap();
                incremental_seen |= snap.bytes_written < snap.bytes_total;
            }
            Kill => h.kill().unwrap(),
            Rescale(p) => {
                h.rescale(p).unwrap();
                assert_eq!(h.subtasks().len(), p as usize);
            }
            Ceiling(max, p) => {
                let snap = h.change_ceiling(max, p).unwrap();
                assert!(snap.groups.keys().all(|g| *g < max));
            }
        }
    }
    assert!(
        incremental_seen,
        "no checkpoint of the script wrote less than its whole state: deltas are not used"
    );
    while !h.at_end() {
        h.step(50).unwrap();
    }
    h.finish().unwrap();
    h.checkpoint().unwrap();
    h
}

/// Runs `h` (in the byte-addressed backend if `sorted_backend`) through [`SCRIPT`] and checks
/// that its committed output is `expected`, nothing missing and nothing twice; returns it.
fn committed_as_expected<F>(
    mut h: Harness<F>,
    sorted_backend: bool,
    expected: &[F::Out],
) -> Harness<F>
where
    F: KeyedProcessFunction,
    F::In: Clone,
    F::Out: Ord + Clone + std::fmt::Debug,
{
    if sorted_backend {
        h = h.sorted_backend().unwrap();
    }
    let h = run(h, SCRIPT);
    let got = in_order(h.committed());
    assert_eq!(
        got.len(),
        expected.len(),
        "committed {} of {}",
        got.len(),
        expected.len()
    );
    assert_eq!(got, expected);
    h
}

fn in_order<T: Ord + Clone>(rows: &[(i64, T)]) -> Vec<T> {
    let mut v: Vec<T> = rows.iter().map(|(_, r)| r.clone()).collect();
    v.sort();
    v
}

#[test]
fn dedup_emits_each_first_delivery_exactly_once_through_every_path() {
    dedup_through_every_path(false);
}

/// The same with state in the byte-addressed backend a disk engine's layout has.
#[test]
fn dedup_in_the_sorted_backend_emits_the_same() {
    dedup_through_every_path(true);
}

fn dedup_through_every_path(sorted_backend: bool) {
    let ttl = Duration::from_secs(10);
    let traffic = Traffic {
        ids: 600,
        bursts_per_id: 3,
        burst_ms: 2_000,
        gap_ms: 25_000,
        step_ms: 10,
        max_out_of_orderness: 1_000,
        seed: 7,
    };
    let records = traffic.records();
    assert!(records.len() > 2_000, "{} records", records.len());
    let expected = dedup::expected(&records, ttl.as_millis() as i64);
    assert!(expected.len() < records.len(), "the traffic has duplicates");
    let duplicates = (records.len() - expected.len()) as u64;
    let h = Harness::new(
        "dedup",
        move || Dedup { ttl },
        2,
        128,
        records,
        traffic.max_out_of_orderness,
    )
    .unwrap();
    let h = committed_as_expected(h, sorted_backend, &expected);
    // The subtasks' counts of dropped duplicates (operator state, split at every rescale and
    // carried through the ceiling change) add up to every duplicate, each counted once.
    let dropped: u64 = h
        .subtasks()
        .iter()
        .map(|s| {
            let entries = s.operator_states().raw(dedup::DROPPED).unwrap_or_default();
            dedup::dropped_total(entries).unwrap()
        })
        .sum();
    assert_eq!(dropped, duplicates);
}

#[test]
fn dedup_state_expires_and_leaves_the_snapshots() {
    let ttl = Duration::from_secs(10);
    let traffic = Traffic {
        ids: 200,
        bursts_per_id: 1,
        burst_ms: 2_000,
        gap_ms: 25_000,
        step_ms: 10,
        max_out_of_orderness: 1_000,
        seed: 11,
    };
    let records = traffic.records();
    let mut h = Harness::new("dedup", move || Dedup { ttl }, 2, 128, records, 1_000).unwrap();
    h.finish().unwrap();
    let full = h.rescale(2).unwrap();
    // Every id expired once event time ended: the savepoint holds no entry, only empty blocks.
    assert_eq!(h.entries(), 0);
    let empty_block = full.bytes_total / full.groups.len() as u64;
    assert!(
        full.groups
            .values()
            .flatten()
            .all(|b| b.len() as u64 <= empty_block)
    );
}

#[test]
fn silence_alerts_fire_exactly_once_per_silence_through_every_path() {
    silence_through_every_path(false);
}

/// The same with state (and timers) in the byte-addressed backend.
#[test]
fn silence_alerts_in_the_sorted_backend_fire_the_same() {
    silence_through_every_path(true);
}

fn silence_through_every_path(sorted_backend: bool) {
    let fleet = Fleet {
        devices: 150,
        period_ms: 5_000,
        silence_ms: 30_000,
        duration_ms: 600_000,
        outage_every: 12,
        max_out_of_orderness: 2_000,
        seed: 3,
    };
    let records = fleet.records();
    assert!(records.len() > 5_000, "{} records", records.len());
    let expected = silence::expected(&records, fleet.silence_ms);
    assert!(
        expected.len() > 2 * fleet.devices as usize,
        "the fleet has silences besides the end: {} alerts",
        expected.len()
    );
    let silence_ms = fleet.silence_ms;
    let h = Harness::new(
        "silence",
        move || SilenceAlert { silence_ms },
        2,
        128,
        records,
        fleet.max_out_of_orderness,
    )
    .unwrap();
    let h = committed_as_expected(h, sorted_backend, &expected);
    // Every timer fired: none is left in state.
    assert_eq!(
        h.entries(),
        150,
        "one last-heartbeat value per device, no timer"
    );
    assert!(h.subtasks().iter().all(|s| s.timers() == (0, 0)));
}

#[test]
fn sessions_are_emitted_once_each_and_merged_through_every_path() {
    sessions_through_every_path(false);
}

/// The same with the sessions (map state and timers) in the byte-addressed backend.
#[test]
fn sessions_in_the_sorted_backend_are_the_same() {
    sessions_through_every_path(true);
}

const BROWSING: Browsing = Browsing {
    users: 120,
    sessions_per_user: 6,
    max_clicks: 8,
    pages: 20,
    gap_ms: 2_000,
    max_out_of_orderness: 3_000,
    seed: 13,
};

fn sessions_through_every_path(sorted_backend: bool) {
    let b = BROWSING;
    let records = b.records();
    assert!(records.len() > 2_000, "{} records", records.len());
    let expected = sessions::expected(&records, b.gap_ms);
    assert!(
        expected.len() > (b.users * b.sessions_per_user) as usize / 2,
        "{} sessions",
        expected.len()
    );
    assert!(
        expected.iter().any(|s| s.result.clicks > 3),
        "sessions of several clicks"
    );
    let gap = Duration::from_millis(b.gap_ms as u64);
    let h = Harness::new(
        "sessions",
        move || EventTimeSessions::new(gap, CountVisits),
        2,
        128,
        records,
        b.max_out_of_orderness,
    )
    .unwrap();
    let h = committed_as_expected(h, sorted_backend, &expected);
    // Every session closed and left the state with its timer.
    assert_eq!(h.entries(), 0);
    assert!(h.subtasks().iter().all(|s| s.timers() == (0, 0)));
}

/// Page views counted per page in tumbling windows ([`TumblingWindows`], map state and a timer
/// per open window), each view its own partial (as the sources send a batch they do not
/// combine; tests/programs_local.rs runs the combined path): every window's count once.
#[test]
fn page_views_are_counted_once_per_window_through_every_path() {
    let views = page_views::Traffic {
        views: 6_000,
        users: 50,
        pages: 30,
        hot_percent: 30,
        step_ms: 3,
        seed: 5,
    }
    .records();
    let window_ms = 1_000;
    let expected = page_views::expected(&views, window_ms);
    assert!(expected.len() > 400, "{} windows", expected.len());
    let records: Vec<(String, i64, Partial<u64>)> = views
        .iter()
        .map(|v| {
            let partial = Partial {
                start: window_start(v.ts, window_ms),
                acc: 1,
            };
            (v.page.clone(), v.ts, partial)
        })
        .collect();
    let size = Duration::from_millis(window_ms as u64);
    let h = Harness::new(
        "views-per-page",
        move || TumblingWindows::<String, _>::new(size, std::sync::Arc::new(CountViews)),
        2,
        128,
        records,
        0,
    )
    .unwrap();
    let h = committed_as_expected(h, false, &expected);
    assert_eq!(h.entries(), 0, "every window fired and left the state");
}

const SHOP: Shop = Shop {
    orders: 1_500,
    customers: 60,
    step_ms: 400,
    window_ms: 30_000,
    tier_every_ms: 40_000,
    max_out_of_orderness: 3_000,
    seed: 21,
};

#[test]
fn orders_and_payments_join_exactly_once_through_every_path() {
    orders_through_every_path(false);
}

/// The same with both sides' buffers in the byte-addressed backend.
#[test]
fn orders_and_payments_join_the_same_in_the_sorted_backend() {
    orders_through_every_path(true);
}

fn orders_through_every_path(sorted_backend: bool) {
    let events = SHOP.events();
    let expected = orders::expected_paid(&events, SHOP.window_ms);
    let payments = events
        .iter()
        .filter(|(_, e)| matches!(e, ShopEvent::Payment(_)))
        .count();
    assert!(
        expected.len() > 500 && expected.len() < payments,
        "{} of {payments} payments within the window",
        expected.len()
    );
    let input: Vec<_> = events
        .into_iter()
        .filter_map(|(ts, e)| match e {
            ShopEvent::Order(o) => Some((o.id.clone(), ts, JoinInput::Left(o))),
            ShopEvent::Payment(p) => Some((p.order.clone(), ts, JoinInput::Right(p))),
            ShopEvent::Tier(_) => None,
        })
        .collect();
    let window = Duration::from_millis(SHOP.window_ms as u64);
    let h = Harness::new(
        "payments",
        move || orders::payments_join(window),
        2,
        128,
        input,
        SHOP.max_out_of_orderness,
    )
    .unwrap();
    let h = committed_as_expected(h, sorted_backend, &expected);
    // Once event time ended, no buffered order or payment can match anything: all gone.
    assert_eq!(h.entries(), 0);
}

#[test]
fn orders_take_their_customers_tier_at_their_time_through_every_path() {
    let events = SHOP.events();
    let expected = orders::expected_tiered(&events);
    assert!(
        expected.iter().any(|o| o.tier.is_none()),
        "some orders precede every tier"
    );
    let tiers: std::collections::BTreeSet<_> =
        expected.iter().filter_map(|o| o.tier.clone()).collect();
    assert!(tiers.len() > 3, "tiers change: {tiers:?}");
    let input: Vec<_> = events
        .into_iter()
        .filter_map(|(ts, e)| match e {
            ShopEvent::Order(o) => Some((o.customer.clone(), ts, JoinInput::Left(o))),
            ShopEvent::Tier(t) => Some((t.customer.clone(), ts, JoinInput::Right(t))),
            ShopEvent::Payment(_) => None,
        })
        .collect();
    let h = Harness::new(
        "tiers",
        orders::tiers_join,
        2,
        128,
        input,
        SHOP.max_out_of_orderness,
    )
    .unwrap();
    let h = run(h, SCRIPT);
    let got = in_order(h.committed());
    assert_eq!(got, expected);
    // What is left: each customer's current tier, no waiting order, no timer.
    assert_eq!(h.entries(), SHOP.customers as usize);
}

/// A click that arrives after later clicks of its user, each of which began a session of its
/// own, merges them: the oracle sees one session, and so does the job.
#[test]
fn a_click_that_bridges_two_sessions_merges_them() {
    let click = |ts: i64| sessions::Click {
        user: "u".into(),
        page: format!("/p{ts}"),
        ts,
    };
    let records: Vec<_> = [0, 3_000, 1_500, 10_000]
        .into_iter()
        .map(|ts| ("u".to_owned(), ts, click(ts)))
        .collect();
    let expected = sessions::expected(&records, 2_000);
    assert_eq!(
        expected
            .iter()
            .map(|s| (s.start, s.end, s.result.clicks))
            .collect::<Vec<_>>(),
        vec![(0, 5_000, 3), (10_000, 12_000, 1)]
    );
    let gap = Duration::from_millis(2_000);
    let mut h = Harness::new(
        "sessions",
        move || EventTimeSessions::new(gap, CountVisits),
        1,
        128,
        records,
        5_000,
    )
    .unwrap();
    while !h.at_end() {
        h.step(1).unwrap();
    }
    h.finish().unwrap();
    h.checkpoint().unwrap();
    assert_eq!(in_order(h.committed()), expected);
}

/// Both jobs whole, from JSON lines to JSON lines (records serialized across the shuffle as a
/// worker sends them), at parallelism 1 and 3: the same output as the oracles'.
#[test]
fn whole_jobs_from_json_lines_match_their_oracles() {
    let fleet = Fleet {
        devices: 40,
        period_ms: 5_000,
        silence_ms: 30_000,
        duration_ms: 300_000,
        outage_every: 10,
        max_out_of_orderness: 2_000,
        seed: 5,
    };
    let beats = fleet.records();
    let mut lines: Vec<String> = beats
        .iter()
        .map(|(_, _, b)| format!(r#"{{"device":"{}","ts":{}}}"#, b.device, b.ts))
        .collect();
    // A heartbeat without a device is filtered out before the shuffle.
    lines.insert(10, r#"{"device":"","ts":1}"#.to_owned());
    let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
    let expected = silence::expected(&beats, fleet.silence_ms);
    for p in [1, 3] {
        let out = run_job(&silence::job(fleet.silence_ms), &lines, p, 128, 2_000, 40).unwrap();
        let mut got: Vec<silence::Alert> = out.iter().map(|l| serde_json_from(l)).collect();
        got.sort();
        assert_eq!(got, expected, "parallelism {p}");
    }

    let ttl = Duration::from_secs(10);
    let traffic = Traffic {
        ids: 100,
        bursts_per_id: 2,
        burst_ms: 2_000,
        gap_ms: 25_000,
        step_ms: 10,
        max_out_of_orderness: 1_000,
        seed: 9,
    };
    let events = traffic.records();
    let lines: Vec<String> = events
        .iter()
        .map(|(_, _, e)| {
            format!(
                r#"{{"id":"{}","ts":{},"delivery":{}}}"#,
                e.id, e.ts, e.delivery
            )
        })
        .collect();
    let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
    let out = run_job(&dedup::job(ttl), &lines, 2, 128, 1_000, 40).unwrap();
    let mut got: Vec<dedup::Event> = out.iter().map(|l| serde_json_from(l)).collect();
    got.sort();
    assert_eq!(got, dedup::expected(&events, ttl.as_millis() as i64));

    let shop = Shop {
        orders: 300,
        ..SHOP
    };
    let events = shop.events();
    let lines: Vec<String> = events
        .iter()
        .map(|(_, e)| serde_json::to_string(e).unwrap())
        .collect();
    let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
    let window = Duration::from_millis(shop.window_ms as u64);
    let out = run_job(
        &orders::job(window),
        &lines,
        3,
        128,
        shop.max_out_of_orderness,
        40,
    )
    .unwrap();
    let mut got: Vec<orders::Paid> = out.iter().map(|l| serde_json_from(l)).collect();
    got.sort();
    assert_eq!(got, orders::expected_paid(&events, shop.window_ms));
    let out = run_job(
        &orders::tiers_job(),
        &lines,
        2,
        128,
        shop.max_out_of_orderness,
        40,
    )
    .unwrap();
    let mut got: Vec<orders::TieredOrder> = out.iter().map(|l| serde_json_from(l)).collect();
    got.sort();
    assert_eq!(got, orders::expected_tiered(&events));

    let b = Browsing {
        users: 40,
        ..BROWSING
    };
    let clicks = b.records();
    let lines: Vec<String> = clicks
        .iter()
        .map(|(_, _, c)| serde_json::to_string(c).unwrap())
        .collect();
    let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
    let gap = Duration::from_millis(b.gap_ms as u64);
    for p in [1, 3] {
        let out = run_job(
            &sessions::job(gap),
            &lines,
            p,
            128,
            b.max_out_of_orderness,
            40,
        )
        .unwrap();
        let mut got: Vec<sessions::UserSession> = out.iter().map(|l| serde_json_from(l)).collect();
        got.sort();
        assert_eq!(
            got,
            sessions::expected(&clicks, b.gap_ms),
            "parallelism {p}"
        );
    }
}

/// A line of the sink, parsed.
fn serde_json_from<T: serde::de::DeserializeOwned>(line: &str) -> T {
    serde_json::from_str(line).unwrap_or_else(|e| panic!("sink line {line:?}: {e}"))
}
