//! Programs (jobs written with keyshift's SDK) on the runtime, end to end on one machine: real
//! `keyshift worker` processes running a program keyshift's image carries, the real
//! coordinator, snapshots on `file://`, output through the exactly-once object-store sink.
//! Every check compares the published output with an oracle computed from the input alone
//! (`keyshift_examples`), through rescales, a killed worker, incremental checkpoints and a
//! pre-staged rescale.

mod programs_support;

use keyshift::crd::StreamJob;
use keyshift::local::LocalJob;
use keyshift::runtime::protocol::WorkerStatus;
use keyshift_examples::silence::Heartbeat;
use programs_support::{assert_alerts, fleet, partition_of, phases};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_keyshift"))
}

/// Source partition files: one per `files`, each key (a device, an event id: the number after
/// its last `-`) in one of them, so that its records keep their order, appended in phases.
struct Input {
    dir: PathBuf,
    files: u64,
}

impl Input {
    fn append<T: serde::Serialize>(&self, records: &[T], key: impl Fn(&T) -> &str) {
        let mut by_file: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
        for r in records {
            let out = by_file.entry(partition_of(key(r), self.files)).or_default();
            serde_json::to_writer(&mut *out, r).expect("record serializes");
            out.push(b'\n');
        }
        for (file, bytes) in by_file {
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.dir.join(format!("part-{file}.jsonl")))
                .expect("open partition file");
            f.write_all(&bytes).expect("append");
        }
    }

    fn beats(&self, beats: &[Heartbeat]) {
        self.append(beats, |b| &b.device);
    }
}

/// A test's directory: its input (four partition files, created as records are appended) and
/// the sink's output directory.
fn workspace() -> (tempfile::TempDir, Input, PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let input = Input {
        dir: dir.path().join("in"),
        files: 4,
    };
    std::fs::create_dir_all(&input.dir).expect("input dir");
    let out = dir.path().join("out");
    (dir, input, out)
}

fn program_job(name: &str, program: &str, input: &Path, out: &Path, replicas: u32) -> StreamJob {
    serde_yaml::from_str(&format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {{name: {name}, namespace: test}}
spec:
  replicas: {replicas}
  maxParallelism: 128
  job:
    program: {{name: {program}, maxOutOfOrderness: 2s}}
    source:
      file: {{path: '{}'}}
    sink: {{type: objectStore, url: 'file://{}'}}
  state:
    checkpointInterval: 1h
",
        input.display(),
        out.display()
    ))
    .expect("test manifest parses")
}

const SETTLE: Duration = Duration::from_millis(1500);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silence_alert_program_fires_each_alert_once_through_rescales_a_killed_worker_and_a_ceiling_change()
 {
    let (dir, input, out) = workspace();
    let storage = format!("file://{}", dir.path().join("state").display());
    let fleet = fleet();
    let (phases, records) = phases(&fleet, input.files);
    input.beats(&phases[0]);
    let spec = program_job("silence", "silence-alert", &input.dir, &out, 2);
    let mut local = LocalJob::new(&spec, storage.clone(), bin(), dir.path().join("logs"))
        .await
        .expect("job prepares");
    local.launch(2, None).await.expect("launch");
    tokio::time::sleep(SETTLE).await;
    let first = local.checkpoint().await.expect("first checkpoint");
    assert_eq!(first.manifest.state_schema, keyshift::job::PROGRAM_SCHEMA);
    assert_eq!(
        first
            .manifest
            .job
            .layout
            .as_ref()
            .and_then(|l| l.program.as_deref()),
        Some("silence-alert")
    );

    // Records after the checkpoint, then a worker killed: the job recovers from the
    // checkpoint, replays them, and publishes nothing twice.
    input.beats(&phases[1]);
    tokio::time::sleep(SETTLE).await;
    local.kill_worker(1).await;
    assert!(local.checkpoint().await.is_err(), "a worker is gone");
    let r = local.recover(2).await.expect("recover");
    assert_eq!(r.restored_from.as_deref(), Some(first.url.as_str()));
    tokio::time::sleep(SETTLE).await;
    // An incremental checkpoint, then up to 3 with the state moved by key group.
    let second = local.checkpoint().await.expect("second checkpoint");
    assert!(second.id > first.id);
    assert!(
        second
            .manifest
            .key_groups
            .iter()
            .any(|g| !g.deltas.is_empty()),
        "the checkpoint after the recovery builds on the one it recovered from"
    );
    local.rescale(3).await.expect("rescale to 3");
    input.beats(&phases[2]);
    tokio::time::sleep(SETTLE).await;
    // Down to 1, pre-staged: the new worker loads its groups before the old ones stop.
    local.checkpoint().await.expect("third checkpoint");
    let pre = local
        .rescale_prestaged(1)
        .await
        .expect("pre-staged rescale to 1");
    assert_eq!(pre.fallback, None, "the pre-stage was used");
    assert!(pre.prestage.is_some());
    // The key-group ceiling changes: stopped with a savepoint, rewritten from 128 groups to
    // 256 (every entry and timer re-hashed), restored at 2 (into its own sink directory).
    let stopped = local.shutdown().await.expect("stop with a savepoint");
    let rewritten = keyshift::snapshot::snapshot_url(
        &storage,
        "test",
        "silence",
        keyshift::snapshot::SnapshotKind::Savepoint,
        stopped.id + 1,
    );
    let report = keyshift::offline::rewrite::rewrite(
        &stopped.url,
        &rewritten,
        keyshift::offline::RewriteOptions::new(256),
    )
    .await
    .expect("rewrite to 256 key groups");
    assert!(report.keys > 150, "{} entries moved", report.keys);
    let wider_out = dir.path().join("out-256");
    let mut wider = program_job("silence", "silence-alert", &input.dir, &wider_out, 2);
    wider.spec.max_parallelism = Some(256);
    wider.spec.restore_from = Some(rewritten.clone());
    let mut local = LocalJob::new(&wider, storage.clone(), bin(), dir.path().join("logs"))
        .await
        .expect("the job prepares at 256 groups");
    local
        .launch(2, Some(rewritten))
        .await
        .expect("restore the rewritten savepoint");
    input.beats(&phases[3]);
    tokio::time::sleep(SETTLE).await;
    let sp = local.shutdown().await.expect("stop with a savepoint");
    assert_eq!(sp.manifest.max_parallelism, 256);

    // The savepoint tools check a program's blocks: every key in the group it belongs to.
    let loc = keyshift::offline::open_location(&sp.url).expect("savepoint location");
    let v = keyshift::offline::verify_keys(&loc).await.expect("verify");
    assert!(v.ok(), "{:?}", v.problems);
    assert!(v.keys_checked > 150, "{} entries checked", v.keys_checked);
    // ... inspect it (its largest keys) ...
    let report = keyshift::offline::inspect::inspect(&loc, 5)
        .await
        .expect("inspect");
    assert_eq!(report.state_schema, keyshift::job::PROGRAM_SCHEMA);
    assert_eq!(report.largest_keys.len(), 5);
    // ... and dump it entry by entry, under each state's declared name.
    let mut dumped = Vec::new();
    let summary = keyshift::offline::dump::dump(&loc, None, &mut dumped)
        .await
        .expect("dump");
    let lines: Vec<serde_json::Value> = String::from_utf8(dumped)
        .expect("UTF-8")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(summary.keys as usize, lines.len());
    let devices: std::collections::BTreeSet<&str> = lines
        .iter()
        .filter(|l| l["state"] == "last-heartbeat")
        .filter_map(|l| l["key"].as_str())
        .collect();
    assert_eq!(
        devices.len() as u64,
        fleet.devices + input.files,
        "every device's last heartbeat"
    );
    assert!(
        lines
            .iter()
            .any(|l| l["state"] == "timers" && l["kind"] == "event-time"),
        "the watches still open are timers"
    );

    let watermark = sp
        .manifest
        .watermark
        .expect("the savepoint has a watermark");
    assert!(
        watermark >= fleet.duration_ms + fleet.silence_ms,
        "event time passed every watch (watermark {watermark})"
    );
    assert_alerts(&[&out, &wider_out], &records, fleet.silence_ms, watermark);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_program_the_image_does_not_carry_is_refused_naming_the_ones_it_does() {
    let dir = tempfile::tempdir().expect("temp dir");
    let input = dir.path().join("in");
    std::fs::create_dir_all(&input).expect("input dir");
    std::fs::write(input.join("p.jsonl"), "{\"device\":\"d\",\"ts\":1}\n").expect("input");
    let out = dir.path().join("out");
    let yaml = serde_yaml::to_string(&program_job("nope", "silence-alert", &input, &out, 1))
        .expect("serializes")
        .replace("silence-alert", "sessionize");
    let spec: StreamJob = serde_yaml::from_str(&yaml).expect("parses");
    let storage = format!("file://{}", dir.path().join("state").display());
    let mut local = LocalJob::new(&spec, storage, bin(), dir.path().join("logs"))
        .await
        .expect("job prepares");
    let err = local
        .launch(1, None)
        .await
        .expect_err("no such program")
        .to_string();
    assert!(
        err.contains("sessionize")
            && err.contains("count, dedup, order-payments, page-views, sessions, silence-alert"),
        "{err}"
    );
}

/// Runs the program `program` as job `name` over `records`, appended to `input` in three phases,
/// through what every program test here lives through: launched at 2, a checkpoint, a rescale to
/// 3, a checkpoint, a worker killed and the job recovered at 3, a checkpoint, a pre-staged
/// rescale to 2 (which must use the pre-stage); then `records[tail..]` appended, and a stop with
/// a savepoint, which it returns with the last run's workers' status just before it (their
/// counts of records read, processed and combined), taken once `settled` says so of it (polled
/// for up to 60 s). `key` picks a record's partition file.
#[allow(clippy::too_many_arguments)]
async fn through_rescales_and_a_killed_worker<T: serde::Serialize>(
    dir: &Path,
    input: &Input,
    name: &str,
    program: &str,
    out: &Path,
    records: &[T],
    tail: usize,
    key: impl Fn(&T) -> &str + Copy,
    settled: impl Fn(&[WorkerStatus]) -> bool,
) -> (
    keyshift::orchestrator::coordinator::Completed,
    Vec<WorkerStatus>,
) {
    let n = tail;
    input.append(&records[..n / 3], key);
    let spec = program_job(name, program, &input.dir, out, 2);
    let storage = format!("file://{}", dir.join("state").display());
    let mut local = LocalJob::new(&spec, storage, bin(), dir.join("logs"))
        .await
        .expect("job prepares");
    local.launch(2, None).await.expect("launch");
    tokio::time::sleep(SETTLE).await;
    local.checkpoint().await.expect("checkpoint");
    local.rescale(3).await.expect("rescale to 3");
    input.append(&records[n / 3..2 * n / 3], key);
    tokio::time::sleep(SETTLE).await;
    local.checkpoint().await.expect("checkpoint at 3");
    input.append(&records[2 * n / 3..n], key);
    tokio::time::sleep(Duration::from_millis(200)).await;
    local.kill_worker(2).await;
    local.recover(3).await.expect("recover");
    tokio::time::sleep(SETTLE).await;
    local
        .checkpoint()
        .await
        .expect("checkpoint after the recovery");
    let down = local
        .rescale_prestaged(2)
        .await
        .expect("pre-staged rescale to 2");
    assert_eq!(down.fallback, None, "the pre-stage was used");
    input.append(&records[n..], key);
    tokio::time::sleep(SETTLE).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let status = loop {
        let status = local.status().await.expect("status");
        if settled(&status) {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the last run did not settle in 60 s: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    (
        local.shutdown().await.expect("stop with a savepoint"),
        status,
    )
}

/// The manifest of the snapshot at `url`, and the duplicates its operator-state sections say
/// the `dedup` program dropped (each section read back against its checksum).
async fn dropped_in(url: &str) -> (keyshift::snapshot::Manifest, u64) {
    let (store, dir, manifest) = keyshift::snapshot::open_snapshot(url)
        .await
        .expect("the snapshot opens");
    let sections = keyshift::snapshot::read_operator_state(store.as_ref(), &dir, &manifest)
        .await
        .expect("the sections read back");
    let sections: Vec<&[u8]> = sections.iter().map(|b| b.as_ref()).collect();
    let dropped =
        keyshift_examples::dedup::dropped_in_sections(&sections).expect("the sections decode");
    (manifest, dropped)
}

/// The `dedup` program (each event id's first delivery, again once its TTL of event time has run
/// out) through a rescale up, a killed worker and a pre-staged rescale down: every first
/// delivery published once, against the oracle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dedup_program_publishes_each_first_delivery_once_through_rescales_and_a_killed_worker() {
    use keyshift_examples::dedup::{self, Event, Traffic};
    let (dir, input, out) = workspace();
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
    let events: Vec<Event> = records.iter().map(|(_, _, e)| e.clone()).collect();
    let n = events.len();
    fn id(e: &Event) -> &str {
        &e.id
    }
    let (last, _) = through_rescales_and_a_killed_worker(
        dir.path(),
        &input,
        "dedup",
        "dedup",
        &out,
        &events,
        n,
        id,
        |_| true,
    )
    .await;

    let want = dedup::expected(&records, keyshift_examples::DEDUP_TTL.as_millis() as i64);
    assert!(
        want.len() > 1_500 && want.len() < n,
        "{} of {n} deliveries are first ones",
        want.len()
    );
    programs_support::assert_published::<Event>(&out, &want);

    // The subtasks' counts of dropped duplicates (operator state, split over the rescales 2 -> 3
    // and 3 -> 2, restored after the kill) in the last savepoint: one section per subtask of
    // its run, adding up to every duplicate, each once.
    let (manifest, dropped) = dropped_in(&last.url).await;
    assert_eq!(manifest.operator_state.len(), 2, "one section per subtask");
    assert_eq!(dropped, (n - want.len()) as u64);
    // `keyshift savepoint inspect` shows it by its declared name.
    let shown = std::process::Command::new(bin())
        .args(["savepoint", "inspect", &last.url])
        .output()
        .expect("keyshift savepoint inspect runs");
    let table = String::from_utf8_lossy(&shown.stdout);
    assert!(shown.status.success(), "{table}");
    assert!(
        table.contains("operator state:   1 states")
            && table.contains("dropped  operator list, redistribution split"),
        "{table}"
    );
    // `keyshift savepoint dump` lists its entries by name, beside the keys' state.
    let dumped = std::process::Command::new(bin())
        .args(["savepoint", "dump", &last.url])
        .output()
        .expect("keyshift savepoint dump runs");
    assert!(dumped.status.success());
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&dumped.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    let counts: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|v| v["operatorState"] == "dropped")
        .collect();
    assert!(
        counts.len() >= 2
            && counts
                .iter()
                .all(|v| v["kind"] == "operator list" && v["valueHex"].is_string()),
        "{counts:?}"
    );
    assert!(
        lines.iter().any(|v| v["state"] == "seen"),
        "the keyed state too"
    );
    let verified = std::process::Command::new(bin())
        .args(["savepoint", "verify", &last.url])
        .output()
        .expect("keyshift savepoint verify runs");
    assert!(
        verified.status.success(),
        "{}{}",
        String::from_utf8_lossy(&verified.stdout),
        String::from_utf8_lossy(&verified.stderr)
    );
    // A ceiling change (rewritten to 256 key groups at parallelism 3) carries the sections of
    // the run that wrote them; a restore at any parallelism splits them from there.
    let target = dir.path().join("rewritten").join("sp-9");
    let target = format!("file://{}", target.display());
    let rewrite = std::process::Command::new(bin())
        .args([
            "savepoint",
            "rewrite",
            &last.url,
            "--max-parallelism",
            "256",
        ])
        .args(["--parallelism", "3", "--to", &target])
        .output()
        .expect("keyshift savepoint rewrite runs");
    assert!(
        rewrite.status.success(),
        "{}",
        String::from_utf8_lossy(&rewrite.stderr)
    );
    let (rewritten, dropped) = dropped_in(&target).await;
    assert_eq!((rewritten.max_parallelism, rewritten.parallelism), (256, 3));
    assert_eq!(
        rewritten.operator_state.len(),
        2,
        "the sections of the run of 2"
    );
    assert_eq!(dropped, (n - want.len()) as u64);
}

/// The `sessions` program (gap-based session windows per user, merged when a click bridges two)
/// through a rescale up, a killed worker and a pre-staged rescale down: every session that
/// closed published once, against the oracle, and every one still open in the last savepoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_program_publishes_each_session_once_through_rescales_and_a_killed_worker() {
    use keyshift_examples::sessions::{self, Browsing, Click, UserSession};
    let (dir, input, out) = workspace();
    let gap_ms = keyshift_examples::SESSION_GAP.as_millis() as i64;
    let browsing = Browsing {
        users: 300,
        sessions_per_user: 4,
        max_clicks: 6,
        pages: 20,
        gap_ms,
        max_out_of_orderness: 2_000,
        seed: 17,
    };
    let mut records = browsing.records();
    let n = records.len();
    // One click per partition far in the future, from a user of its own: every partition's
    // watermark passes every real session's end.
    let end = records.iter().map(|(_, ts, _)| *ts).max().unwrap_or(0) + 10 * gap_ms;
    for p in 0..input.files {
        let user = format!("end-{}", p + 1_000 * input.files);
        let click = Click {
            user: user.clone(),
            page: "/end".into(),
            ts: end,
        };
        records.push((user, end, click));
    }
    let clicks: Vec<Click> = records.iter().map(|(_, _, c)| c.clone()).collect();
    fn user(c: &Click) -> &str {
        &c.user
    }
    let (sp, _) = through_rescales_and_a_killed_worker(
        dir.path(),
        &input,
        "sessions",
        "sessions",
        &out,
        &clicks,
        n,
        user,
        |_| true,
    )
    .await;

    let watermark = sp
        .manifest
        .watermark
        .expect("the savepoint has a watermark");
    let all = sessions::expected(&records, gap_ms);
    let (want, open): (Vec<UserSession>, Vec<UserSession>) =
        all.into_iter().partition(|s| s.end - 1 <= watermark);
    assert!(
        want.len() > 800 && open.len() == input.files as usize,
        "{} sessions closed, {} open (watermark {watermark})",
        want.len(),
        open.len()
    );
    programs_support::assert_published::<UserSession>(&out, &want);
    // The sessions still open are in the savepoint, under the state's declared name.
    let loc = keyshift::offline::open_location(&sp.url).expect("savepoint location");
    let mut dumped = Vec::new();
    keyshift::offline::dump::dump(&loc, None, &mut dumped)
        .await
        .expect("dump");
    let in_savepoint: std::collections::BTreeSet<String> = String::from_utf8(dumped)
        .expect("UTF-8")
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("a JSON line"))
        // The session windows' map state (keyshift_sdk::windows::SESSIONS_STATE).
        .filter(|l| l["state"] == "sessions")
        .filter_map(|l| l["key"].as_str().map(str::to_owned))
        .collect();
    let open_users: std::collections::BTreeSet<String> =
        open.iter().map(|s| s.key.clone()).collect();
    assert_eq!(in_savepoint, open_users);
}

/// The `order-payments` program (an interval join of orders and payments by order id) through a
/// rescale up, a killed worker and a pre-staged rescale down: every payment within the window
/// after its order published once with it, whichever arrived first, against the oracle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orders_and_payments_join_publishes_each_pair_once_through_rescales_and_a_killed_worker()
{
    use keyshift_examples::orders::{self, Event, Paid, Shop};
    let (dir, input, out) = workspace();
    let window_ms = keyshift_examples::PAYMENT_WINDOW.as_millis() as i64;
    let shop = Shop {
        orders: 2_000,
        customers: 50,
        step_ms: 400,
        window_ms,
        tier_every_ms: 40_000,
        max_out_of_orderness: 2_000,
        seed: 23,
    };
    let events: Vec<(i64, Event)> = shop
        .events()
        .into_iter()
        .filter(|(_, e)| !matches!(e, Event::Tier(_)))
        .collect();
    let lines: Vec<Event> = events.iter().map(|(_, e)| e.clone()).collect();
    let n = lines.len();
    // An order and its payments in one partition file (by the order's number), in order.
    fn order_of(e: &Event) -> &str {
        match e {
            Event::Order(o) => &o.id,
            Event::Payment(p) => &p.order,
            Event::Tier(t) => &t.customer,
        }
    }
    through_rescales_and_a_killed_worker(
        dir.path(),
        &input,
        "orders",
        "order-payments",
        &out,
        &lines,
        n,
        order_of,
        |_| true,
    )
    .await;

    let want = orders::expected_paid(&events, window_ms);
    assert!(want.len() > 1_000, "{} pairs", want.len());
    programs_support::assert_published::<Paid>(&out, &want);
}

/// The `page-views` program (views per page in tumbling windows, a window aggregate combined
/// before the shuffle; `/home` gets 30% of the views, a hot key) through a rescale up, a killed
/// worker and a pre-staged rescale down: every window that closed published once with its
/// exact count, against the oracle, while the sources combined records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_views_window_aggregate_combined_before_the_shuffle_publishes_each_window_once() {
    use keyshift_examples::page_views::{self, PageViews, Traffic, View};
    let (dir, input, out) = workspace();
    let window_ms = keyshift_examples::PAGE_VIEWS_WINDOW.as_millis() as i64;
    let mut views = Traffic {
        views: 40_000,
        users: 200,
        pages: 40,
        hot_percent: 30,
        step_ms: 25,
        seed: 29,
    }
    .records();
    // The last quarter is read by the last run (after the pre-staged rescale).
    let n = views.len() * 3 / 4;
    // One view per partition far in the future: every partition's watermark passes every real
    // window's end.
    let end = views.last().map_or(0, |v| v.ts) + 10 * window_ms;
    for p in 0..input.files {
        views.push(View {
            user: format!("end-{p}"),
            page: "/end".into(),
            ts: end,
        });
    }
    fn user(v: &View) -> &str {
        &v.user
    }
    let tail = (views.len() - n) as u64;
    let (sp, status) = through_rescales_and_a_killed_worker(
        dir.path(),
        &input,
        "page-views",
        "page-views",
        &out,
        &views,
        n,
        user,
        // Every view of the tail read, and processed: the operators counted every view a
        // partial stood for.
        |st| {
            let read: u64 = st.iter().map(|w| w.records_in).sum();
            read == tail && st.iter().map(|w| w.records_processed).sum::<u64>() == read
        },
    )
    .await;
    let combined: u64 = status.iter().map(|w| w.records_combined).sum();
    assert!(
        combined > 1_000,
        "the last run's sources combined {combined} of {tail} views"
    );
    let watermark = sp
        .manifest
        .watermark
        .expect("the savepoint has a watermark");
    let (want, open): (Vec<PageViews>, Vec<PageViews>) = page_views::expected(&views, window_ms)
        .into_iter()
        .partition(|w| w.end - 1 <= watermark);
    assert!(
        want.len() > 1_000 && open.len() == 1,
        "{} windows closed, {} open (watermark {watermark})",
        want.len(),
        open.len()
    );
    programs_support::assert_published::<PageViews>(&out, &want);
}

/// A program over the generator: `count` (a value state per key) reads each generated record as
/// `{"key","value","ts"}` through a rescale up and a pre-staged rescale down; the final
/// savepoint's counts are the built-in count's oracle for the same generator, key for key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_count_program_over_the_generator_counts_every_record_through_rescales() {
    let dir = tempfile::tempdir().expect("temp dir");
    let generator =
        "{partitions: 4, keys: 300, seed: 11, recordsPerSecond: 4000, recordsPerPartition: 12000}";
    let spec: StreamJob = serde_yaml::from_str(&format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {{name: generated, namespace: test}}
spec:
  replicas: 2
  maxParallelism: 128
  job:
    program: {{name: count}}
    source:
      generator: {generator}
    sink: {{type: objectStore, url: 'file://{}'}}
  state:
    checkpointInterval: 1h
",
        dir.path().join("out").display()
    ))
    .expect("manifest parses");
    let storage = format!("file://{}", dir.path().join("state").display());
    let mut local = LocalJob::new(&spec, storage, bin(), dir.path().join("logs"))
        .await
        .expect("job prepares");
    local.launch(2, None).await.expect("launch");
    tokio::time::sleep(SETTLE).await;
    local.rescale(3).await.expect("rescale to 3");
    tokio::time::sleep(SETTLE).await;
    let report = local
        .rescale_prestaged(2)
        .await
        .expect("pre-staged rescale to 2");
    assert!(
        report.fallback.is_none(),
        "the pre-staged rescale fell back: {:?}",
        report.fallback
    );
    // Every partition read to its end (12000 records at 4000/s: 3 s, plus the rescales).
    let mut sp = local.checkpoint().await.expect("checkpoint");
    for _ in 0..60 {
        if sp.manifest.source_positions.values().all(|p| *p == 12_000) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        sp = local.checkpoint().await.expect("checkpoint");
    }
    assert_eq!(
        sp.manifest.source_positions.values().sum::<u64>(),
        4 * 12_000,
        "every generated record was read"
    );
    let sp = local.shutdown().await.expect("stop with a savepoint");

    // The oracle: the built-in count over the same generator and positions.
    let builtin: StreamJob = serde_yaml::from_str(&format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {{name: oracle, namespace: test}}
spec:
  replicas: 1
  job:
    source:
      generator: {generator}
    key: {{field: key, type: string}}
    aggregation: {{function: count}}
    sink: {{type: log}}
"
    ))
    .expect("oracle manifest parses");
    let positions: BTreeMap<u32, u64> = (0..4).map(|p| (p, 12_000)).collect();
    let keyshift::job::Expected::Global(want) =
        keyshift::job::expected_results(&builtin.spec.job, &positions).expect("oracle")
    else {
        panic!("a count without a window is global");
    };

    // The program's counts, from the savepoint's dump (a postcard u64: LEB128).
    let loc = keyshift::offline::open_location(&sp.url).expect("savepoint location");
    let mut dumped = Vec::new();
    keyshift::offline::dump::dump(&loc, None, &mut dumped)
        .await
        .expect("dump");
    let mut got: BTreeMap<keyshift::keygroup::Key, i64> = BTreeMap::new();
    for line in String::from_utf8(dumped).expect("UTF-8").lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
        assert_eq!(v["state"], "count", "{line}");
        let hex = v["valueHex"].as_str().expect("a postcard value");
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
            .collect();
        let (mut n, mut shift) = (0i64, 0);
        for b in bytes {
            n |= i64::from(b & 0x7f) << shift;
            shift += 7;
        }
        let key = keyshift::keygroup::Key::String(v["key"].as_str().expect("a string key").into());
        assert!(got.insert(key, n).is_none(), "{line}: a key twice");
    }
    assert_eq!(got.len(), want.len(), "keys counted");
    assert_eq!(got, want, "the program's counts are the oracle's");
}

/// A program that cannot read the generator's records is refused before any worker runs,
/// naming the record and what the program said.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_program_that_cannot_read_the_generators_records_is_refused_naming_one() {
    let dir = tempfile::tempdir().expect("temp dir");
    let spec: StreamJob = serde_yaml::from_str(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {name: generated, namespace: test}
spec:
  replicas: 1
  job:
    program: {name: silence-alert}
    source:
      generator: {partitions: 1, keys: 10}
    sink: {type: log}
",
    )
    .expect("manifest parses");
    let storage = format!("file://{}", dir.path().join("state").display());
    let err = match LocalJob::new(&spec, storage, bin(), dir.path().join("logs")).await {
        Err(e) => e.to_string(),
        Ok(mut local) => local
            .launch(1, None)
            .await
            .expect_err("silence-alert reads heartbeats, not generated records")
            .to_string(),
    };
    assert!(
        err.contains("silence-alert")
            && err.contains("generator record 0 of partition 0")
            && err.contains("key-")
            && err.contains("missing field `device`"),
        "{err}"
    );
}
