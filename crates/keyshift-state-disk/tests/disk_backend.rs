//! The disk backend against the SDK's in-memory reference (`SortedBackend`): the same operations
//! give the same reads, counts and snapshot changes; and a keyed operator on disk writes the
//! same key-group blocks as on the heap, which restore into either.

use keyshift_sdk::prelude::*;
use keyshift_sdk::state::backend::{Change, GroupMode, SortedBackend, StateBackend};
use keyshift_sdk::{KeyGroupRange, KeyedOperator};
use keyshift_state_disk::{DiskBackend, DiskConfig};
use proptest::prelude::*;
use std::collections::BTreeMap;

type Changes = BTreeMap<Vec<u8>, Option<Vec<u8>>>;
/// A block's entries: (entry key, value; `None` a deletion).
type BlockEntries = Vec<(Vec<u8>, Option<Vec<u8>>)>;

fn changes(b: &mut dyn StateBackend, group: usize, mode: GroupMode) -> Changes {
    let mut out = Changes::new();
    b.visit(group, mode, &mut |c| {
        let (k, v) = match c {
            Change::Put(k, v) => (k.to_vec(), Some(v.to_vec())),
            Change::Delete(k) => (k.to_vec(), None),
        };
        assert!(out.insert(k, v).is_none(), "a key visited twice");
    })
    .unwrap();
    out
}

fn disk(
    dir: &tempfile::TempDir,
    groups: usize,
    max_tracked_keys: usize,
    write_cache_bytes: usize,
) -> DiskBackend {
    let config = DiskConfig {
        max_tracked_keys,
        write_cache_bytes,
        ..DiskConfig::default()
    };
    DiskBackend::open(&dir.path().join("state"), groups, config).unwrap()
}

#[derive(Debug, Clone)]
enum Op {
    Put(usize, Vec<u8>, u8),
    Delete(usize, Vec<u8>),
    DeletePrefix(usize, Vec<u8>),
    /// A cut, then a snapshot of every group built on the cut this many cuts back (0: in
    /// full), as the runtime writes them.
    Snapshot(usize),
    Clear(usize),
    /// A restore: a group's full block installed, then its later deltas applied (as
    /// `restore_group` and `apply_deltas` do, on a group that has not changed since).
    Restore(usize, Vec<(Vec<u8>, u8)>, Vec<(Vec<u8>, Option<u8>)>),
}

const GROUPS: usize = 2;

fn key() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(0u8..4, 1..4)
}

fn op() -> impl Strategy<Value = Op> {
    let g = 0..GROUPS;
    prop_oneof![
        6 => (g.clone(), key(), any::<u8>()).prop_map(|(g, k, v)| Op::Put(g, k, v)),
        3 => (g.clone(), key()).prop_map(|(g, k)| Op::Delete(g, k)),
        1 => (g.clone(), prop::collection::vec(0u8..4, 0..2)).prop_map(|(g, p)| Op::DeletePrefix(g, p)),
        2 => (0usize..3).prop_map(Op::Snapshot),
        1 => g.clone().prop_map(Op::Clear),
        1 => (
            g,
            prop::collection::vec((key(), any::<u8>()), 0..5),
            prop::collection::vec((key(), prop::option::of(any::<u8>())), 0..5),
        )
            .prop_map(|(g, full, deltas)| Op::Restore(g, full, deltas)),
    ]
}

/// Applies `op` to both, checking that they agree on what it visits.
fn run(op: &Op, a: &mut dyn StateBackend, b: &mut dyn StateBackend, cuts: &mut Vec<u32>) {
    match op {
        Op::Put(g, k, v) => {
            a.put(*g, k, vec![*v]).unwrap();
            b.put(*g, k, vec![*v]).unwrap();
        }
        Op::Delete(g, k) => {
            a.delete(*g, k).unwrap();
            b.delete(*g, k).unwrap();
        }
        Op::DeletePrefix(g, p) => {
            a.delete_prefix(*g, p).unwrap();
            b.delete_prefix(*g, p).unwrap();
        }
        Op::Snapshot(back) => {
            let (ca, cb) = (a.cut(), b.cut());
            assert_eq!(ca, cb);
            let since = cuts
                .len()
                .checked_sub(*back)
                .and_then(|i| cuts.get(i))
                .copied();
            for g in 0..GROUPS {
                let mode = match since {
                    Some(since) if *back > 0 => a.group_mode(g, since),
                    _ => GroupMode::Full,
                };
                if let Some(since) = since.filter(|_| *back > 0) {
                    // The disk backend may only be more conservative (write a group in full).
                    let mb = b.group_mode(g, since);
                    assert!(
                        mb == mode || mb == GroupMode::Full,
                        "group {g} since {since}: reference {mode:?}, disk {mb:?}"
                    );
                    if mb == GroupMode::Full && mode != GroupMode::Full {
                        let full_a = changes(a, g, GroupMode::Full);
                        assert_eq!(full_a, changes(b, g, GroupMode::Full));
                        changes(a, g, mode);
                        continue;
                    }
                }
                assert_eq!(
                    changes(a, g, mode),
                    changes(b, g, mode),
                    "group {g}, {mode:?}"
                );
            }
            cuts.push(ca);
        }
        Op::Clear(g) => {
            a.clear(*g).unwrap();
            b.clear(*g).unwrap();
        }
        Op::Restore(g, full, deltas) => {
            let e: BTreeMap<Vec<u8>, Vec<u8>> =
                full.iter().map(|(k, v)| (k.clone(), vec![*v])).collect();
            a.install(*g, e.clone()).unwrap();
            b.install(*g, e).unwrap();
            let d: Changes = deltas
                .iter()
                .map(|(k, v)| (k.clone(), v.map(|v| vec![v])))
                .collect();
            a.apply(*g, d.clone()).unwrap();
            b.apply(*g, d).unwrap();
        }
    }
}

fn assert_same_reads(a: &dyn StateBackend, b: &dyn StateBackend) {
    for g in 0..GROUPS {
        assert_eq!(a.len(g), b.len(g), "group {g}: entry count");
        assert_eq!(
            a.scan(g, &[]).unwrap(),
            b.scan(g, &[]).unwrap(),
            "group {g}"
        );
        for p in [&[][..], &[0], &[1, 2], &[3]] {
            assert_eq!(a.scan(g, p).unwrap(), b.scan(g, p).unwrap());
            assert_eq!(a.last_key(g, p).unwrap(), b.last_key(g, p).unwrap());
        }
        for k in [&[0u8][..], &[1, 1], &[3, 3, 3]] {
            assert_eq!(
                a.get(g, k).unwrap().map(|v| v.to_vec()),
                b.get(g, k).unwrap().map(|v| v.to_vec())
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn the_disk_backend_reads_counts_and_snapshots_as_the_reference_does(
        ops in prop::collection::vec(op(), 1..60),
        max_tracked in prop_oneof![Just(1usize << 20), Just(3usize)],
        // A cache that holds everything, and one that flushes and empties every few writes.
        write_cache in prop_oneof![Just(64usize << 20), Just(300usize)],
    ) {
        let dir = tempfile::tempdir().unwrap();
        let mut reference = SortedBackend::new(GROUPS);
        let mut on_disk = disk(&dir, GROUPS, max_tracked, write_cache);
        let mut cuts = Vec::new();
        for op in &ops {
            run(op, &mut reference, &mut on_disk, &mut cuts);
            assert_same_reads(&reference, &on_disk);
        }
    }
}

#[test]
fn a_delta_carries_the_changes_since_its_base_and_the_store_leaves_with_the_backend() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state");
    let mut b = DiskBackend::open(&path, 1, DiskConfig::default()).unwrap();
    b.put(0, b"a", b"1".to_vec()).unwrap();
    b.put(0, b"b", b"2".to_vec()).unwrap();
    let first = b.cut();
    assert_eq!(b.group_mode(0, first), GroupMode::Unchanged);
    b.put(0, b"b", b"3".to_vec()).unwrap();
    b.delete(0, b"a").unwrap();
    b.delete(0, b"never").unwrap();
    b.put(0, b"c", b"4".to_vec()).unwrap();
    b.cut();
    assert_eq!(b.group_mode(0, first), GroupMode::Delta { since: first });
    let delta = changes(&mut b, 0, GroupMode::Delta { since: first });
    let expected: Changes = [
        (b"a".to_vec(), None),
        (b"b".to_vec(), Some(b"3".to_vec())),
        (b"c".to_vec(), Some(b"4".to_vec())),
    ]
    .into_iter()
    .collect();
    assert_eq!(delta, expected);
    assert_eq!(b.len(0), 2);
    assert_eq!(b.group_mode(0, first - 1), GroupMode::Full);
    assert!(b.get(1, b"a").is_err(), "a group it does not own");
    assert!(path.exists());
    drop(b);
    assert!(!path.exists(), "the store's directory is scratch space");
}

#[test]
fn a_group_past_its_tracking_bound_is_written_in_full() {
    let dir = tempfile::tempdir().unwrap();
    let mut b = disk(&dir, 1, 4, 64 << 20);
    let base = b.cut();
    for i in 0u8..10 {
        b.put(0, &[i], vec![i]).unwrap();
    }
    b.cut();
    assert_eq!(b.group_mode(0, base), GroupMode::Full);
    assert_eq!(changes(&mut b, 0, GroupMode::Full).len(), 10);
    assert_eq!(b.len(0), 10);
}

/// A count per key with a timer per key: value state and timers on either backend.
struct Count;

impl KeyedProcessFunction for Count {
    type Key = String;
    type In = i64;
    type Out = (String, i64);
    type State = ValueHandle<i64>;

    fn declare(&self, states: &mut Declarations) -> Result<Self::State, DeclarationError> {
        states.value(ValueStateDescriptor::new("count"))
    }

    fn process(
        &mut self,
        v: i64,
        count: &Self::State,
        ctx: &mut Context<'_, String, (String, i64)>,
    ) -> keyshift_sdk::Result<()> {
        let n = ctx.value(count).get()?.unwrap_or(0) + v;
        ctx.value(count).set(n)?;
        ctx.register_event_time_timer(1_000)?;
        Ok(())
    }

    fn on_timer(
        &mut self,
        _: Timer,
        count: &Self::State,
        ctx: &mut Context<'_, String, (String, i64)>,
    ) -> keyshift_sdk::Result<()> {
        let n = ctx.value(count).get()?.unwrap_or(0);
        let key = ctx.key().clone();
        ctx.emit((key, n));
        Ok(())
    }
}

const MAX_PARALLELISM: u32 = 8;

fn range() -> KeyGroupRange {
    KeyGroupRange {
        start: 0,
        end: MAX_PARALLELISM - 1,
    }
}

fn on_disk(dir: &tempfile::TempDir, name: &str) -> KeyedOperator<Count> {
    let backend = DiskBackend::open(
        &dir.path().join(name),
        range().len() as usize,
        DiskConfig::default(),
    )
    .unwrap();
    KeyedOperator::with_backend("count", Count, MAX_PARALLELISM, range(), Box::new(backend))
        .unwrap()
}

fn blocks(op: &mut KeyedOperator<Count>) -> Vec<(u32, Vec<u8>)> {
    op.cut();
    (0..MAX_PARALLELISM)
        .filter_map(|g| {
            op.encode_group(g, GroupMode::Full)
                .unwrap()
                .map(|b| (g, b.bytes))
        })
        .collect()
}

/// Each block's group and entries, sorted (the heap writes a group's entries in its tables'
/// order, the disk in key order: the blocks hold the same entries, not the same bytes).
fn entries(blocks: &[(u32, Vec<u8>)]) -> Vec<(u32, BlockEntries)> {
    blocks
        .iter()
        .map(|(g, bytes)| {
            let mut e = keyshift_sdk::block::decode(bytes).unwrap().entries;
            e.sort();
            (*g, e)
        })
        .collect()
}

fn sorted_output(op: &mut KeyedOperator<Count>) -> Vec<(String, i64)> {
    let mut out: Vec<_> = op.take_output().into_iter().map(|(_, o)| o).collect();
    out.sort();
    out
}

#[test]
fn a_keyed_operator_on_disk_writes_the_heap_s_blocks_and_restores_from_them() {
    let dir = tempfile::tempdir().unwrap();
    let mut disk_op = on_disk(&dir, "a");
    let mut heap_op = KeyedOperator::new("count", Count, MAX_PARALLELISM, range()).unwrap();
    for i in 0..500i64 {
        let key = format!("user-{}", i % 37);
        disk_op.process(&key, i, i % 5).unwrap();
        heap_op.process(&key, i, i % 5).unwrap();
    }
    assert_eq!(disk_op.entries(), heap_op.entries());
    let written = blocks(&mut disk_op);
    let heap_written = blocks(&mut heap_op);
    assert_eq!(
        entries(&written),
        entries(&heap_written),
        "the same entries per group"
    );

    // The disk's blocks restore into a fresh operator on disk and one on the heap: both fire
    // the same timers with the same counts.
    let mut restored = on_disk(&dir, "b");
    let mut heap_restored = KeyedOperator::new("count", Count, MAX_PARALLELISM, range()).unwrap();
    for (g, bytes) in &written {
        restored.restore_group(*g, &[bytes]).unwrap();
        heap_restored.restore_group(*g, &[bytes]).unwrap();
    }
    for op in [&mut restored, &mut heap_restored, &mut disk_op] {
        op.advance_watermark(2_000).unwrap();
    }
    let fired = sorted_output(&mut disk_op);
    assert_eq!(fired.len(), 37);
    assert_eq!(sorted_output(&mut restored), fired);
    assert_eq!(sorted_output(&mut heap_restored), fired);
    restored.clear_group(written[0].0).unwrap();
    assert_eq!(restored.group_entries(written[0].0), 0);
}
