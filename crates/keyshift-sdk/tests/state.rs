//! Every kind of keyed state and timer through an operator: reads and writes per key, TTL on
//! both clocks, snapshot and restore (also into another subtask's range), and the identity
//! checks that refuse a snapshot the job cannot read, naming what changed.

use keyshift_sdk::prelude::*;
use keyshift_sdk::state::backend::GroupMode;
use keyshift_sdk::{BlockError, KeyGroupRange};
use serde::{Deserialize, Serialize};
use std::time::Duration;

const MAX: u32 = 16;
const ALL: KeyGroupRange = KeyGroupRange { start: 0, end: 15 };

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum Op {
    /// Adds to the map under `k`, the list, the reducing sum and the aggregating average.
    Add { k: String, v: i64 },
    /// Removes `k` from the map.
    Remove { k: String },
    /// Clears every state of the key.
    Clear,
    /// Emits a summary of every state.
    Show,
    /// Registers a processing-time timer at `at`, or deletes it.
    Timer { at: i64, delete: bool },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Summary {
    map: Vec<(String, i64)>,
    list: Vec<i64>,
    sum: Option<i64>,
    avg: Option<i64>,
    last: Option<Op>,
}

struct Average;

impl AggregateFunction for Average {
    type In = i64;
    type Acc = (i64, i64);
    type Out = i64;
    fn create(&self) -> (i64, i64) {
        (0, 0)
    }
    fn add(&self, v: i64, (sum, n): (i64, i64)) -> (i64, i64) {
        (sum + v, n + 1)
    }
    fn result(&self, (sum, n): &(i64, i64)) -> i64 {
        if *n == 0 { 0 } else { sum / n }
    }
}

struct Kitchen {
    version: u32,
}

struct Handles {
    map: MapHandle<String, i64>,
    list: ListHandle<i64>,
    sum: ReducingHandle<i64>,
    avg: AggregatingHandle<Average>,
    last: ValueHandle<Op>,
}

impl KeyedProcessFunction for Kitchen {
    type Key = String;
    type In = Op;
    type Out = Summary;
    type State = Handles;

    fn declare(&self, s: &mut Declarations) -> Result<Handles, DeclarationError> {
        Ok(Handles {
            map: s.map(MapStateDescriptor::new("map"))?,
            list: s.list(ListStateDescriptor::new("list"))?,
            sum: s.reducing(ReducingStateDescriptor::new("sum", |a: i64, b| a + b))?,
            avg: s.aggregating(AggregatingStateDescriptor::new("avg", Average))?,
            last: s.value(
                ValueStateDescriptor::with_serializer("last", Json::<Op>::default())
                    .version(self.version),
            )?,
        })
    }

    fn process(
        &mut self,
        op: Op,
        h: &Handles,
        ctx: &mut Context<'_, String, Summary>,
    ) -> keyshift_sdk::Result<()> {
        match &op {
            Op::Add { k, v } => {
                let old = ctx.map(&h.map).get(k)?.unwrap_or(0);
                ctx.map(&h.map).insert(k, old + v)?;
                ctx.list(&h.list).add(*v)?;
                ctx.reducing(&h.sum).add(*v)?;
                ctx.aggregating(&h.avg).add(*v)?;
            }
            Op::Remove { k } => ctx.map(&h.map).remove(k)?,
            Op::Clear => {
                ctx.map(&h.map).clear()?;
                ctx.list(&h.list).clear()?;
                ctx.reducing(&h.sum).clear()?;
                ctx.aggregating(&h.avg).clear()?;
            }
            Op::Show => {
                let s = summary(h, ctx)?;
                ctx.emit(s);
            }
            Op::Timer { at, delete: false } => ctx.register_processing_time_timer(*at)?,
            Op::Timer { at, delete: true } => ctx.delete_processing_time_timer(*at)?,
        }
        ctx.value(&h.last).set(op.clone())?;
        Ok(())
    }

    fn on_timer(
        &mut self,
        t: Timer,
        h: &Handles,
        ctx: &mut Context<'_, String, Summary>,
    ) -> keyshift_sdk::Result<()> {
        assert_eq!(t.domain, TimeDomain::ProcessingTime);
        let s = summary(h, ctx)?;
        ctx.emit_at(s, t.timestamp);
        Ok(())
    }
}

fn summary(h: &Handles, ctx: &mut Context<'_, String, Summary>) -> keyshift_sdk::Result<Summary> {
    Ok(Summary {
        map: ctx.map(&h.map).entries()?,
        list: ctx.list(&h.list).get()?,
        sum: ctx.reducing(&h.sum).get()?,
        avg: ctx.aggregating(&h.avg).get()?,
        last: ctx.value(&h.last).get()?,
    })
}

fn add(k: &str, v: i64) -> Op {
    Op::Add { k: k.into(), v }
}

/// A `Kitchen` (version 1) over every group, on the sorted byte backend or the heap.
fn kitchen(sorted: bool) -> KeyedOperator<Kitchen> {
    if sorted {
        KeyedOperator::with_backend(
            "kitchen",
            Kitchen { version: 1 },
            MAX,
            ALL,
            Box::new(keyshift_sdk::state::backend::SortedBackend::new(
                ALL.len() as usize
            )),
        )
        .unwrap()
    } else {
        KeyedOperator::new("kitchen", Kitchen { version: 1 }, MAX, ALL).unwrap()
    }
}

fn key(s: &str) -> String {
    s.to_owned()
}

/// Every group's full block.
fn snapshot<F: KeyedProcessFunction>(op: &mut KeyedOperator<F>) -> Vec<(u32, Vec<u8>)> {
    op.cut();
    op.range()
        .iter()
        .filter_map(|g| {
            let block = op.encode_group(g, GroupMode::Full).unwrap()?;
            assert_eq!(
                Ok(block.entries),
                keyshift_sdk::block::check(&block.bytes, g, MAX),
                "group {g}: the count returned is the block's"
            );
            Some((g, block.bytes))
        })
        .collect()
}

fn show(op: &mut KeyedOperator<Kitchen>, k: &str) -> Summary {
    op.process(&key(k), 0, Op::Show).unwrap();
    op.take_output().pop().unwrap().1
}

#[test]
fn every_state_kind_reads_what_was_written_and_survives_a_restore() {
    let mut op = KeyedOperator::new("kitchen", Kitchen { version: 1 }, MAX, ALL).unwrap();
    for (k, o) in [
        ("a", add("x", 1)),
        ("a", add("y", 5)),
        ("a", add("x", 2)),
        ("b", add("x", 10)),
        ("a", Op::Remove { k: "y".into() }),
    ] {
        op.process(&key(k), 0, o).unwrap();
    }
    let a = show(&mut op, "a");
    assert_eq!(a.map, vec![("x".to_string(), 3)]);
    assert_eq!(a.list, vec![1, 5, 2]);
    assert_eq!(a.sum, Some(8));
    assert_eq!(a.avg, Some(2));
    assert_eq!(a.last, Some(Op::Remove { k: "y".into() }));
    assert_eq!(show(&mut op, "b").sum, Some(10));

    // Restored into two subtasks that split the groups: each key's state is whole in one.
    let blocks = snapshot(&mut op);
    for range in [
        KeyGroupRange { start: 0, end: 7 },
        KeyGroupRange { start: 8, end: 15 },
    ] {
        let mut part = KeyedOperator::new("kitchen", Kitchen { version: 1 }, MAX, range).unwrap();
        for (g, b) in blocks.iter().filter(|(g, _)| range.contains(*g)) {
            part.restore_group(*g, &[b]).unwrap();
        }
        for k in ["a", "b"] {
            let g = keyshift_sdk::key::key_group(&key(k), MAX);
            if range.contains(g) {
                let mut s = show(&mut part, k);
                let mut want = show(&mut op, k);
                s.last = None;
                want.last = None;
                assert_eq!(s, want, "key {k}");
            }
        }
    }

    op.process(&key("a"), 0, Op::Clear).unwrap();
    let cleared = show(&mut op, "a");
    assert!(cleared.map.is_empty() && cleared.list.is_empty());
    assert_eq!((cleared.sum, cleared.avg), (None, None));
}

#[test]
fn processing_time_timers_fire_once_in_order_and_survive_a_restore() {
    let mut op = KeyedOperator::new("kitchen", Kitchen { version: 1 }, MAX, ALL).unwrap();
    for (k, at, delete) in [
        ("a", 300, false),
        ("b", 100, false),
        ("a", 200, false),
        ("a", 200, false),
        ("b", 100, true),
        ("b", 400, false),
    ] {
        op.process(&key(k), 0, Op::Timer { at, delete }).unwrap();
    }
    op.advance_processing_time(250).unwrap();
    let fired: Vec<i64> = op.take_output().into_iter().map(|(t, _)| t).collect();
    assert_eq!(
        fired,
        vec![200],
        "b's timer at 100 was deleted, a's at 200 registered twice"
    );
    let blocks = snapshot(&mut op);
    let mut restored = KeyedOperator::new("kitchen", Kitchen { version: 1 }, MAX, ALL).unwrap();
    for (g, b) in &blocks {
        restored.restore_group(*g, &[b]).unwrap();
    }
    restored.restore_processing_time(250);
    assert_eq!(restored.timers(), (0, 2));
    restored.advance_processing_time(1_000).unwrap();
    let fired: Vec<i64> = restored.take_output().into_iter().map(|(t, _)| t).collect();
    assert_eq!(fired, vec![300, 400]);
    restored.advance_processing_time(2_000).unwrap();
    assert!(restored.take_output().is_empty(), "each timer fires once");
}

struct Remember {
    ttl: Option<Ttl>,
}

impl KeyedProcessFunction for Remember {
    type Key = i64;
    type In = i64;
    type Out = Option<i64>;
    type State = ValueHandle<i64>;
    fn declare(&self, s: &mut Declarations) -> Result<Self::State, DeclarationError> {
        let d = ValueStateDescriptor::new("v");
        s.value(match self.ttl {
            Some(t) => d.ttl(t),
            None => d,
        })
    }
    fn process(
        &mut self,
        v: i64,
        h: &Self::State,
        ctx: &mut Context<'_, i64, Option<i64>>,
    ) -> keyshift_sdk::Result<()> {
        let before = ctx.value(h).get()?;
        ctx.emit(before);
        if v >= 0 {
            ctx.value(h).set(v)?;
        }
        Ok(())
    }
}

#[test]
fn processing_time_ttl_hides_expired_values_and_drops_them_from_full_snapshots() {
    let ttl = Some(Ttl::processing_time(Duration::from_millis(100)));
    let mut op = KeyedOperator::new("remember", Remember { ttl }, MAX, ALL).unwrap();
    op.advance_processing_time(1_000).unwrap();
    op.process(&1, 0, 7).unwrap();
    op.advance_processing_time(1_099).unwrap();
    op.process(&1, 0, -1).unwrap();
    op.advance_processing_time(1_100).unwrap();
    op.process(&1, 0, -1).unwrap();
    let seen: Vec<Option<i64>> = op.take_output().into_iter().map(|(_, v)| v).collect();
    assert_eq!(seen, vec![None, Some(7), None]);
    let blocks = snapshot(&mut op);
    let mut restored = KeyedOperator::new("remember", Remember { ttl }, MAX, ALL).unwrap();
    for (g, b) in &blocks {
        restored.restore_group(*g, &[b]).unwrap();
    }
    assert_eq!(
        restored.entries(),
        0,
        "the expired value is not in the snapshot"
    );
}

#[test]
fn event_time_ttl_runs_on_the_later_of_the_watermark_and_the_record_s_own_time() {
    let ttl = Some(Ttl::event_time(Duration::from_millis(100)));
    // The watermark never moves: whether a value lived is the records' times alone, as it is
    // on every replay whatever the watermark did.
    let mut op = KeyedOperator::new("remember", Remember { ttl }, MAX, ALL).unwrap();
    op.process(&1, 1_000, 7).unwrap();
    op.process(&1, 1_099, -1).unwrap();
    op.process(&1, 1_100, -1).unwrap();
    // A record behind the watermark sees the watermark's time.
    op.process(&2, 1_000, 8).unwrap();
    op.advance_watermark(1_200).unwrap();
    op.process(&2, 1_050, -1).unwrap();
    let seen: Vec<Option<i64>> = op.take_output().into_iter().map(|(_, v)| v).collect();
    assert_eq!(seen, vec![None, Some(7), None, None, None]);
}

#[test]
fn a_restore_refuses_what_the_job_cannot_read_and_keeps_the_group() {
    let mut op = KeyedOperator::new("kitchen", Kitchen { version: 1 }, MAX, ALL).unwrap();
    op.process(&key("a"), 0, add("x", 1)).unwrap();
    let g = keyshift_sdk::key::key_group(&key("a"), MAX);
    let blocks = snapshot(&mut op);
    let block = &blocks.iter().find(|(b, _)| *b == g).unwrap().1;

    // A state's version changed: refused, naming the state.
    let mut v2 = KeyedOperator::new("kitchen", Kitchen { version: 2 }, MAX, ALL).unwrap();
    match v2.restore_group(g, &[block]) {
        Err(BlockError::StateChanged { name, .. }) => assert_eq!(name, "last"),
        other => panic!("{other:?}"),
    }
    // Another step's snapshot.
    let mut other = KeyedOperator::new("kitchen-2", Kitchen { version: 1 }, MAX, ALL).unwrap();
    assert!(matches!(
        other.restore_group(g, &[block]),
        Err(BlockError::Operator { .. })
    ));
    // A changed key type.
    let mut longs = KeyedOperator::new("kitchen", Remember { ttl: None }, MAX, ALL).unwrap();
    assert!(matches!(
        longs.restore_group(g, &[block]),
        Err(BlockError::KeyType { .. })
    ));
    // Another key-group count.
    let mut wider = KeyedOperator::new(
        "kitchen",
        Kitchen { version: 1 },
        32,
        KeyGroupRange { start: 0, end: 31 },
    )
    .unwrap();
    assert!(matches!(
        wider.restore_group(g, &[block]),
        Err(BlockError::MaxParallelism { block: 16, job: 32 })
    ));
    // The group offered to the wrong group number.
    let wrong = (g + 1) % MAX;
    let mut fresh = KeyedOperator::new("kitchen", Kitchen { version: 1 }, MAX, ALL).unwrap();
    assert!(matches!(
        fresh.restore_group(wrong, &[block]),
        Err(BlockError::WrongGroup { .. })
    ));

    // A corrupt delta after a good block: nothing of the chain is installed, the group keeps
    // what it had.
    fresh.process(&key("a"), 0, add("z", 9)).unwrap();
    let mut corrupt = block.clone();
    let n = corrupt.len();
    corrupt[n / 2] ^= 0x40;
    assert!(matches!(
        fresh.restore_group(g, &[block, &corrupt]),
        Err(BlockError::Checksum { .. })
    ));
    assert_eq!(show(&mut fresh, "a").map, vec![("z".to_string(), 9)]);
}

struct OnlyMap;

impl KeyedProcessFunction for OnlyMap {
    type Key = String;
    type In = Op;
    type Out = Summary;
    type State = MapHandle<String, i64>;
    fn declare(&self, s: &mut Declarations) -> Result<Self::State, DeclarationError> {
        s.map(MapStateDescriptor::new("map"))
    }
    fn process(
        &mut self,
        _: Op,
        _: &Self::State,
        _: &mut Context<'_, String, Summary>,
    ) -> keyshift_sdk::Result<()> {
        Ok(())
    }
}

#[test]
fn a_state_in_the_snapshot_that_the_job_no_longer_declares_is_refused_by_name() {
    let mut op = KeyedOperator::new("kitchen", Kitchen { version: 1 }, MAX, ALL).unwrap();
    op.process(&key("a"), 0, add("x", 1)).unwrap();
    let g = keyshift_sdk::key::key_group(&key("a"), MAX);
    let blocks = snapshot(&mut op);
    let block = &blocks.iter().find(|(b, _)| *b == g).unwrap().1;
    let mut fewer = KeyedOperator::new("kitchen", OnlyMap, MAX, ALL).unwrap();
    match fewer.restore_group(g, &[block]) {
        Err(e @ BlockError::UndeclaredState { .. }) => {
            assert!(e.to_string().contains("\"list\""), "{e}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn declaring_a_state_twice_is_refused() {
    struct Twice;
    impl KeyedProcessFunction for Twice {
        type Key = i64;
        type In = i64;
        type Out = i64;
        type State = ();
        fn declare(&self, s: &mut Declarations) -> Result<(), DeclarationError> {
            s.value(ValueStateDescriptor::<i64>::new("v"))?;
            s.list(ListStateDescriptor::<i64>::new("v"))?;
            Ok(())
        }
        fn process(
            &mut self,
            _: i64,
            _: &(),
            _: &mut Context<'_, i64, i64>,
        ) -> keyshift_sdk::Result<()> {
            Ok(())
        }
    }
    assert_eq!(
        KeyedOperator::new("twice", Twice, MAX, ALL).err(),
        Some(DeclarationError::Duplicate("v".into()))
    );
}

/// A heap snapshot restores into the byte-addressed backend and back: one block format, so a
/// job can switch backends across a savepoint.
#[test]
fn snapshots_move_between_the_heap_and_the_sorted_backend() {
    let sorted = || kitchen(true);
    let mut heap = kitchen(false);
    for (k, o) in [
        ("a", add("x", 1)),
        ("a", add("y", 5)),
        ("b", add("x", 10)),
        (
            "b",
            Op::Timer {
                at: 50,
                delete: false,
            },
        ),
        ("a", Op::Remove { k: "y".into() }),
    ] {
        heap.process(&key(k), 0, o).unwrap();
    }
    let blocks = snapshot(&mut heap);
    let mut bytes = sorted();
    for (g, b) in &blocks {
        bytes.restore_group(*g, &[b]).unwrap();
    }
    assert_eq!(bytes.entries(), heap.entries());
    assert_eq!(bytes.timers(), (0, 1));
    for k in ["a", "b"] {
        assert_eq!(show(&mut bytes, k), show(&mut heap, k), "key {k}");
    }
    // Changes in the byte backend, as a delta over its restore, read back by the heap.
    let since = bytes.cut();
    bytes.process(&key("a"), 0, Op::Clear).unwrap();
    bytes.process(&key("b"), 0, add("z", 3)).unwrap();
    bytes.cut();
    let mut back = KeyedOperator::new("kitchen", Kitchen { version: 1 }, MAX, ALL).unwrap();
    for (g, base) in &blocks {
        let mode = bytes.group_mode(*g, since);
        assert_ne!(mode, GroupMode::Full, "group {g}: nothing was cleared");
        let delta = bytes.encode_group(*g, mode).unwrap().map(|d| d.bytes);
        let chain = keyshift_sdk::block::chain(base, delta.as_slice());
        back.restore_group(*g, &chain).unwrap();
    }
    for k in ["a", "b"] {
        assert_eq!(show(&mut back, k), show(&mut bytes, k), "key {k}");
    }
    assert!(show(&mut back, "a").map.is_empty());
}

#[test]
fn a_batch_read_ahead_and_routed_records_change_nothing_but_speed() {
    use keyshift_sdk::key::StreamKey;
    let ops = [
        ("a", add("x", 1)),
        ("b", add("x", 10)),
        ("a", add("y", 5)),
        ("c", add("z", 7)),
        ("a", Op::Remove { k: "y".into() }),
    ];
    let mut plain = KeyedOperator::new("kitchen", Kitchen { version: 1 }, MAX, ALL).unwrap();
    let mut routed = KeyedOperator::new("kitchen", Kitchen { version: 1 }, MAX, ALL).unwrap();
    // Reading ahead a key with no state creates none, in a group owned or not.
    let d = key("d").record_key();
    routed.prefetch(d.key_group(MAX), &d);
    routed.prefetch(MAX + 3, &d);
    assert_eq!(routed.entries(), 0);
    for (k, o) in &ops {
        plain.process(&key(k), 0, o.clone()).unwrap();
    }
    let batch: Vec<_> = ops
        .iter()
        .map(|(k, o)| {
            let rk = key(k).record_key();
            (rk.key_group(MAX), rk, key(k), o.clone())
        })
        .collect();
    for (g, rk, _, _) in &batch {
        routed.prefetch(*g, rk);
    }
    for (g, rk, k, o) in batch {
        routed.process_routed(g, &rk, &k, 0, o).unwrap();
    }
    assert_eq!(routed.entries(), plain.entries());
    for k in ["a", "b", "c"] {
        assert_eq!(show(&mut routed, k), show(&mut plain, k), "key {k}");
    }
    assert_eq!(snapshot(&mut routed), snapshot(&mut plain));
}

#[test]
fn the_erased_step_takes_routed_batches_of_serialized_records_and_refuses_a_foreign_key() {
    use keyshift_sdk::key::{RecordKey, StreamKey};
    use keyshift_sdk::step::{Routed, factory};
    let make = factory("kitchen", || Kitchen { version: 1 });
    let mut step = make(MAX, ALL).unwrap();
    let mut typed = KeyedOperator::new("kitchen", Kitchen { version: 1 }, MAX, ALL).unwrap();
    let ops = [("a", add("x", 1)), ("b", add("x", 10)), ("a", add("y", 5))];
    let bytes: Vec<Vec<u8>> = ops
        .iter()
        .map(|(_, o)| {
            let mut b = Vec::new();
            Postcard::default().serialize(o, &mut b).unwrap();
            b
        })
        .collect();
    let batch: Vec<Routed<'_>> = ops
        .iter()
        .zip(&bytes)
        .map(|((k, _), b)| {
            let key = key(k).record_key();
            Routed {
                group: key.key_group(MAX),
                key,
                timestamp: 0,
                record: b,
            }
        })
        .collect();
    step.process_batch(&batch).unwrap();
    for (k, o) in &ops {
        typed.process(&key(k), 0, o.clone()).unwrap();
    }
    assert_eq!(step.entries(), typed.entries());
    for g in ALL.iter() {
        typed.cut();
        step.cut();
        assert_eq!(
            step.encode_group(g, GroupMode::Full).unwrap(),
            typed.encode_group(g, GroupMode::Full).unwrap(),
            "group {g}"
        );
    }
    // A key of another type is refused, naming the step and the key.
    let long = RecordKey::long(7);
    let err = step
        .process_batch(&[Routed {
            group: long.key_group(MAX),
            key: long,
            timestamp: 0,
            record: &bytes[0],
        }])
        .unwrap_err()
        .to_string();
    assert!(err.contains("kitchen") && err.contains('7'), "{err}");
}

#[test]
fn a_block_reads_back_entry_by_entry_under_each_state_s_declared_name() {
    let mut op = KeyedOperator::new("kitchen", Kitchen { version: 1 }, MAX, ALL).unwrap();
    op.process(&key("a"), 0, add("x", 3)).unwrap();
    op.process(
        &key("a"),
        0,
        Op::Timer {
            at: 500,
            delete: false,
        },
    )
    .unwrap();
    let g = keyshift_sdk::key::key_group(&key("a"), MAX);
    let blocks = snapshot(&mut op);
    let block = &blocks.iter().find(|(b, _)| *b == g).unwrap().1;
    let (header, entries) = keyshift_sdk::block::describe(block).unwrap();
    assert_eq!(header.operator, "kitchen");
    let by_state = |name: &str| {
        entries
            .iter()
            .filter(|e| e.state == name)
            .collect::<Vec<_>>()
    };
    assert!(
        entries
            .iter()
            .all(|e| e.key == keyshift_core::keygroup::Key::String("a".into()))
    );
    let map = by_state("map");
    assert_eq!(map.len(), 1);
    assert_eq!(map[0].kind, "map");
    assert!(map[0].user_key.is_some() && map[0].value_hex.is_some());
    let last = by_state("last");
    assert_eq!(last.len(), 1);
    assert_eq!(
        last[0].value,
        Some(
            serde_json::to_value(Op::Timer {
                at: 500,
                delete: false
            })
            .unwrap()
        ),
        "a JSON state reads as JSON"
    );
    let timers = by_state("timers");
    assert_eq!(timers.len(), 1);
    assert_eq!(
        (timers[0].kind.as_str(), timers[0].timer),
        ("processing-time", Some(500))
    );
    assert_eq!(by_state("list").len(), 1);
    assert_eq!(by_state("sum").len(), 1);
    assert_eq!(by_state("avg").len(), 1);
}

mod catch_up {
    //! A pre-staged group catches up by applying the deltas written after the state it loaded
    //! onto it ([`KeyedOperator::apply_deltas`]): the result is the state of the chain restored
    //! whole, and of the operator that wrote it, on either backend.

    use super::*;
    use keyshift_sdk::block;
    use proptest::prelude::*;

    fn op() -> impl Strategy<Value = (String, Op)> {
        let k = || prop::sample::select(vec!["a", "b", "c"]).prop_map(str::to_owned);
        (
            prop::sample::select(vec!["u", "v", "w", "x", "y", "z"]).prop_map(str::to_owned),
            prop_oneof![
                (k(), -5i64..50).prop_map(|(k, v)| Op::Add { k, v }),
                k().prop_map(|k| Op::Remove { k }),
                Just(Op::Clear),
                (0i64..4, any::<bool>()).prop_map(|(at, delete)| Op::Timer { at, delete }),
            ],
        )
    }

    /// A group's entries as a block holds them.
    type Entries = Vec<(Vec<u8>, Option<Vec<u8>>)>;

    /// Every group's entries, written whole and sorted (the heap writes in hash order).
    fn state(op: &mut KeyedOperator<Kitchen>) -> Vec<(u32, Entries)> {
        op.cut();
        op.range()
            .iter()
            .map(|g| {
                let b = op.encode_group(g, GroupMode::Full).unwrap().unwrap();
                let mut entries = block::decode(&b.bytes).unwrap().entries;
                entries.sort();
                (g, entries)
            })
            .collect()
    }

    /// Rounds of changes, each ended by a cut and caught up by a delta over the last one (the
    /// heap visits only the keys changed since), then a long run of cuts without a checkpoint
    /// (past what the heap tracks, so a delta since then visits every key): the loaded state
    /// stays the writer's.
    #[test]
    fn deltas_round_after_round_and_after_a_long_gap_stay_exact() {
        let ops: Vec<(String, Op)> = (0..60)
            .map(|i| {
                let k = ["u", "v", "w", "x", "y", "z"][i % 6].to_owned();
                let op = match i % 5 {
                    0 | 1 => add(["a", "b", "c"][i % 3], i as i64),
                    2 => Op::Remove { k: "a".into() },
                    3 => Op::Timer {
                        at: (i % 4) as i64,
                        delete: i % 2 == 0,
                    },
                    _ => Op::Clear,
                };
                (k, op)
            })
            .collect();
        for sorted in [false, true] {
            let mut source = kitchen(sorted);
            let mut loaded = kitchen(sorted);
            let mut since = source.cut();
            for g in source.range().iter() {
                let b = source.encode_group(g, GroupMode::Full).unwrap().unwrap();
                loaded.restore_group(g, &[&b.bytes]).unwrap();
            }
            let catch_up = |source: &mut KeyedOperator<Kitchen>,
                            loaded: &mut KeyedOperator<Kitchen>,
                            since: u32| {
                for g in source.range().iter() {
                    let mode = source.group_mode(g, since);
                    if let Some(d) = source.encode_group(g, mode).unwrap() {
                        match mode {
                            GroupMode::Full => loaded.restore_group(g, &[&d.bytes]).unwrap(),
                            _ => loaded.apply_deltas(g, &[&d.bytes]).unwrap(),
                        }
                    }
                    // The count a snapshot takes at its cut is the group's.
                    for op in [&*source, &*loaded] {
                        assert_eq!(
                            op.encoded_group_entries(g),
                            op.group_entries(g),
                            "group {g} ({mode:?})"
                        );
                    }
                }
            };
            for round in ops.chunks(7) {
                for (k, o) in round {
                    source.process(&key(k), 0, o.clone()).unwrap();
                }
                let cut = source.cut();
                catch_up(&mut source, &mut loaded, since);
                since = cut;
                assert_eq!(state(&mut loaded), state(&mut source), "sorted: {sorted}");
            }
            // 1500 cuts with one change each and no checkpoint between them.
            for i in 0..1500 {
                let (k, o) = &ops[i % ops.len()];
                source.process(&key(k), 0, o.clone()).unwrap();
                source.cut();
            }
            catch_up(&mut source, &mut loaded, since);
            assert_eq!(state(&mut loaded), state(&mut source), "sorted: {sorted}");
            assert_eq!(loaded.timers(), source.timers());
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn deltas_applied_onto_a_loaded_group_equal_the_chain_restored_whole(
            before in prop::collection::vec(op(), 0..40),
            after in prop::collection::vec(op(), 1..40),
            sorted in any::<bool>(),
            target_sorted in any::<bool>(),
            flip in any::<prop::sample::Index>(),
        ) {
            let mut source = kitchen(sorted);
            for (k, o) in &before {
                source.process(&key(k), 0, o.clone()).unwrap();
            }
            let since = source.cut();
            let bases: Vec<(u32, Vec<u8>)> = source
                .range()
                .iter()
                .map(|g| (g, source.encode_group(g, GroupMode::Full).unwrap().unwrap().bytes))
                .collect();
            for (k, o) in &after {
                source.process(&key(k), 0, o.clone()).unwrap();
            }
            source.cut();
            let mut loaded = kitchen(target_sorted);
            let mut whole = kitchen(target_sorted);
            let mut deltas = Vec::new();
            for (g, base) in &bases {
                loaded.restore_group(*g, &[base]).unwrap();
                let mode = source.group_mode(*g, since);
                prop_assert_ne!(mode, GroupMode::Full, "group {}: no group was cleared", g);
                let delta = source.encode_group(*g, mode).unwrap().map(|d| d.bytes);
                whole.restore_group(*g, &block::chain(base, delta.as_slice())).unwrap();
                deltas.extend(delta.map(|d| (*g, d)));
            }
            // A corrupt delta is refused and changes nothing.
            if let Some((g, d)) = deltas.first() {
                let before_apply = state(&mut loaded);
                let mut bad = d.clone();
                let i = flip.index(bad.len());
                bad[i] ^= 0x10;
                prop_assert!(loaded.apply_deltas(*g, &[&bad]).is_err());
                let full = &bases.iter().find(|(x, _)| x == g).unwrap().1;
                prop_assert!(loaded.apply_deltas(*g, &[full]).is_err(), "a full block is no delta");
                prop_assert_eq!(state(&mut loaded), before_apply);
            }
            for (g, d) in &deltas {
                loaded.apply_deltas(*g, &[d]).unwrap();
            }
            // The count a snapshot takes at its cut is the group's: after the delta's encode,
            // a restore and an apply.
            for g in ALL.iter() {
                for op in [&source, &loaded, &whole] {
                    prop_assert_eq!(op.encoded_group_entries(g), op.group_entries(g), "group {}", g);
                }
            }
            prop_assert_eq!(loaded.timers(), whole.timers());
            prop_assert_eq!(loaded.entries(), whole.entries());
            prop_assert_eq!(loaded.timers(), source.timers());
            let want = state(&mut source);
            prop_assert_eq!(state(&mut whole), want.clone());
            prop_assert_eq!(state(&mut loaded), want);
        }
    }
}

/// A profile as release 1 kept it.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct ProfileV1 {
    visits: u32,
}

/// The same state in release 2: a wider count and a field it did not have.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct ProfileV2 {
    visits: u64,
    tier: String,
}

/// Release 1: a profile per key (with an event-time TTL) and a counter it later drops.
struct Release1;

impl KeyedProcessFunction for Release1 {
    type Key = String;
    type In = u32;
    type Out = ();
    type State = (
        ValueHandle<ProfileV1>,
        ValueHandle<u32>,
        MapHandle<String, ProfileV1>,
    );
    fn declare(&self, s: &mut Declarations) -> Result<Self::State, DeclarationError> {
        Ok((
            s.value(
                ValueStateDescriptor::new("profile").ttl(Ttl::event_time(Duration::from_secs(60))),
            )?,
            s.value(ValueStateDescriptor::new("legacy"))?,
            s.map(MapStateDescriptor::new("by-page"))?,
        ))
    }
    fn process(
        &mut self,
        visits: u32,
        (profile, legacy, pages): &Self::State,
        ctx: &mut Context<'_, String, ()>,
    ) -> keyshift_sdk::Result<()> {
        ctx.value(profile).set(ProfileV1 { visits })?;
        ctx.value(legacy).set(visits)?;
        ctx.map(pages)
            .insert(&"/home".to_owned(), ProfileV1 { visits })?;
        Ok(())
    }
}

/// Release 2: the profile and the pages' values migrated from version 1 (if `migrate`), the
/// counter dropped (if `drop`).
struct Release2 {
    migrate: bool,
    drop: bool,
}

impl KeyedProcessFunction for Release2 {
    type Key = String;
    type In = ();
    type Out = (Option<ProfileV2>, Option<ProfileV2>);
    type State = (ValueHandle<ProfileV2>, MapHandle<String, ProfileV2>);
    fn declare(&self, s: &mut Declarations) -> Result<Self::State, DeclarationError> {
        let profile = s.value(
            ValueStateDescriptor::new("profile")
                .version(2)
                .ttl(Ttl::event_time(Duration::from_secs(60))),
        )?;
        let pages = s.map(MapStateDescriptor::new("by-page").version(2))?;
        if self.migrate {
            let widen = |old: ProfileV1| ProfileV2 {
                visits: u64::from(old.visits) * 1_000,
                tier: "basic".into(),
            };
            s.migrate(&profile, 1, widen)?;
            s.migrate(&pages, 1, widen)?;
        }
        if self.drop {
            s.drop_state("legacy")?;
        }
        Ok((profile, pages))
    }
    fn process(
        &mut self,
        _: (),
        (profile, pages): &Self::State,
        ctx: &mut Context<'_, String, Self::Out>,
    ) -> keyshift_sdk::Result<()> {
        let p = ctx.value(profile).get()?;
        let page = ctx.map(pages).get(&"/home".to_owned())?;
        ctx.emit((p, page));
        Ok(())
    }
}

#[test]
fn a_changed_state_restores_through_its_migration_and_a_dropped_state_is_left_behind() {
    let mut old = KeyedOperator::new("profiles", Release1, MAX, ALL).unwrap();
    old.process(&key("a"), 1_000, 7).unwrap();
    old.process(&key("b"), 1_000, 9).unwrap();
    let blocks = snapshot(&mut old);

    // Neither migrated nor dropped: refused, naming the state and both versions.
    let mut plain = KeyedOperator::new(
        "profiles",
        Release2 {
            migrate: false,
            drop: true,
        },
        MAX,
        ALL,
    )
    .unwrap();
    let (g, block) = &blocks[0];
    match plain.restore_group(*g, &[block]) {
        Err(e @ BlockError::StateChanged { .. }) => {
            let text = e.to_string();
            assert!(
                text.contains("version 1") && text.contains("version 2"),
                "{text}"
            );
        }
        other => panic!("{other:?}"),
    }
    let mut kept = KeyedOperator::new(
        "profiles",
        Release2 {
            migrate: true,
            drop: false,
        },
        MAX,
        ALL,
    )
    .unwrap();
    match kept.restore_group(*g, &[block]) {
        Err(BlockError::UndeclaredState { name }) => assert_eq!(name, "legacy"),
        other => panic!("{other:?}"),
    }

    // Migrated and dropped: every value read through the migration, the TTL's expiry kept.
    let mut new = KeyedOperator::new(
        "profiles",
        Release2 {
            migrate: true,
            drop: true,
        },
        MAX,
        ALL,
    )
    .unwrap();
    for (g, b) in &blocks {
        new.restore_group(*g, &[b]).unwrap();
    }
    new.restore_watermark(1_000);
    new.process(&key("a"), 2_000, ()).unwrap();
    new.process(&key("b"), 2_000, ()).unwrap();
    let want = |visits| ProfileV2 {
        visits,
        tier: "basic".into(),
    };
    let got: Vec<_> = new.take_output().into_iter().map(|(_, v)| v).collect();
    assert_eq!(
        got,
        vec![
            (Some(want(7_000)), Some(want(7_000))),
            (Some(want(9_000)), Some(want(9_000)))
        ]
    );
    // Two keys, a profile and a page each: the dropped counter is gone.
    assert_eq!(new.entries(), 4);
    // The expiry came along: past it, the profile is gone.
    new.advance_watermark(70_000).unwrap();
    new.process(&key("a"), 70_001, ()).unwrap();
    let got: Vec<_> = new.take_output().into_iter().map(|(_, v)| v).collect();
    assert_eq!(got, vec![(None, Some(want(7_000)))]);
    // A snapshot after the restore is of version 2, and restores without a migration.
    let again = snapshot(&mut new);
    let mut plain = KeyedOperator::new(
        "profiles",
        Release2 {
            migrate: false,
            drop: false,
        },
        MAX,
        ALL,
    )
    .unwrap();
    for (g, b) in &again {
        plain.restore_group(*g, &[b]).unwrap();
    }
    assert_eq!(plain.entries(), 2);
}

#[test]
fn a_migration_or_a_drop_that_contradicts_the_declarations_is_refused() {
    struct Bad {
        from_itself: bool,
    }
    impl KeyedProcessFunction for Bad {
        type Key = String;
        type In = ();
        type Out = ();
        type State = ValueHandle<u64>;
        fn declare(&self, s: &mut Declarations) -> Result<Self::State, DeclarationError> {
            let h = s.value(ValueStateDescriptor::new("n").version(3))?;
            if self.from_itself {
                s.migrate(&h, 3, |old: u32| u64::from(old))?;
            } else {
                s.drop_state("n")?;
            }
            Ok(h)
        }
        fn process(
            &mut self,
            _: (),
            _: &Self::State,
            _: &mut Context<'_, String, ()>,
        ) -> keyshift_sdk::Result<()> {
            Ok(())
        }
    }
    assert!(matches!(
        KeyedOperator::new("bad", Bad { from_itself: true }, MAX, ALL).map(|_| ()),
        Err(DeclarationError::MigrationFromItself { version: 3, .. })
    ));
    assert!(matches!(
        KeyedOperator::new("bad", Bad { from_itself: false }, MAX, ALL).map(|_| ()),
        Err(DeclarationError::DropDeclared(_))
    ));
}
