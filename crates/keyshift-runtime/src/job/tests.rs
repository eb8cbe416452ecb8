//! Cross-module tests: the operator, split over subtasks and rescaled through encoded blocks,
//! against the oracle.

use super::*;
use keyshift_core::keygroup::{Assignment, Key};
use keyshift_core::spec::{
    AggregationSpec, GeneratorSource, KeyDistribution, KeySpec, SourceSpec, WindowSpec,
};
use std::collections::BTreeMap;

const MAXP: u32 = 128;

fn spec(
    function: AggregateFunction,
    window: Option<&str>,
    key_type: KeyType,
    distribution: KeyDistribution,
) -> JobSpec {
    JobSpec {
        source: SourceSpec {
            generator: Some(GeneratorSource {
                partitions: 3,
                keys: 500,
                seed: 7,
                distribution,
                zipf_exponent: Some(1.1),
                records_per_second: Some(400),
                records_per_partition: Some(6_000),
            }),
            file: None,
            kafka: None,
        },
        program: None,
        key: Some(KeySpec {
            field: "key".into(),
            key_type,
        }),
        aggregation: Some(AggregationSpec {
            function,
            field: Some("value".into()),
            combine: None,
        }),
        window: window.map(|size| WindowSpec {
            size: size.into(),
            max_out_of_orderness: Some("1s".into()),
        }),
        sink: Default::default(),
    }
}

/// A miniature runtime: subtasks with their operators, partitions read round-robin in batches,
/// records routed to the owner of their key group, the watermark as the min over partitions.
struct MiniJob {
    job: CompiledJob,
    assignment: Assignment,
    ops: Vec<KeyedAggregator>,
    positions: BTreeMap<u32, u64>,
    partition_wms: Vec<PartitionWatermark>,
    fired: Vec<ResultRow>,
}

impl MiniJob {
    fn new(spec: &JobSpec, parallelism: u32, options: JobOptions) -> MiniJob {
        let job = compile(spec, MAXP, &options).unwrap();
        let assignment = Assignment::new(parallelism.into(), MAXP.into()).unwrap();
        let ops = assignment
            .ranges()
            .into_iter()
            .map(|r| job.new_aggregator(r).unwrap())
            .collect();
        let partitions = job.partitions();
        MiniJob {
            positions: (0..partitions).map(|p| (p, 0)).collect(),
            partition_wms: (0..partitions).map(|_| job.partition_watermark()).collect(),
            job,
            assignment,
            ops,
            fired: Vec::new(),
        }
    }

    /// Reads until every partition reaches `until` (or its end), `batch` records at a time.
    fn run_until(&mut self, until: u64, batch: usize) {
        let mut buf = Vec::new();
        loop {
            let mut progressed = false;
            for p in 0..self.job.partitions() {
                let pos = self.positions[&p];
                if pos >= until {
                    continue;
                }
                buf.clear();
                let want = batch.min((until - pos) as usize);
                let b = self.job.read(p, pos, &mut buf, want).unwrap();
                for r in &buf {
                    let owner = self.assignment.owner(r.key.key_group(MAXP));
                    self.ops[owner as usize].process(r).unwrap();
                    self.partition_wms[p as usize].observe(r.ts);
                }
                self.positions.insert(p, b.next_position);
                progressed |= b.records > 0;
                let wm = self.partition_wms.iter().map(|w| w.watermark()).min();
                if let Some(wm) = wm {
                    for op in &mut self.ops {
                        self.fired.extend(op.advance_watermark(wm));
                    }
                }
            }
            if !progressed {
                break;
            }
        }
    }

    /// Fired windows plus everything still in state.
    fn all_rows(&self) -> Vec<ResultRow> {
        let mut rows = self.fired.clone();
        for op in &self.ops {
            rows.extend(op.results());
        }
        rows
    }

    /// Snapshots every group and restores them into a job at another parallelism, as a rescale
    /// through the object store would (blocks only, no shared memory).
    fn rescale(self, spec: &JobSpec, parallelism: u32, options: JobOptions) -> MiniJob {
        let mut blocks: BTreeMap<u32, Vec<u8>> = BTreeMap::new();
        for op in &self.ops {
            for g in op.range().iter() {
                let (block, entries) = op.encode_group(g).unwrap();
                assert_eq!(entries as usize, op.group_key_count(g));
                blocks.insert(g, block);
            }
        }
        assert_eq!(blocks.len(), MAXP as usize, "every group snapshotted once");
        let watermark = self.ops.iter().map(|o| o.watermark()).min().unwrap();
        let mut next = MiniJob::new(spec, parallelism, options);
        for op in &mut next.ops {
            op.restore_watermark(watermark);
            for g in op.range().iter() {
                op.restore_group(g, &blocks[&g]).unwrap();
            }
        }
        next.positions = self.positions;
        next.partition_wms = self.partition_wms;
        next.fired = self.fired;
        next
    }
}

const FUNCTIONS: [AggregateFunction; 4] = [
    AggregateFunction::Count,
    AggregateFunction::Sum,
    AggregateFunction::Min,
    AggregateFunction::Max,
];

fn check(spec: &JobSpec, parallelism: u32) {
    let mut job = MiniJob::new(spec, parallelism, JobOptions::default());
    job.run_until(4_500, 97);
    let windowed = spec.window.is_some();
    let got = Expected::from_rows(windowed, job.all_rows()).unwrap();
    let want = expected_results(spec, &job.positions).unwrap();
    assert!(want.keys() > 100, "the test covers many keys");
    assert_eq!(
        got,
        want,
        "{:?} p={parallelism}",
        spec.aggregation.as_ref().map(|a| a.function)
    );
    assert!(job.ops.iter().all(|o| o.late_records() == 0));
    if windowed {
        assert!(!job.fired.is_empty(), "some windows fired on the way");
    }
}

#[test]
fn operator_split_over_subtasks_equals_the_oracle() {
    for f in FUNCTIONS {
        for (kt, dist) in [
            (KeyType::Long, KeyDistribution::Uniform),
            (KeyType::String, KeyDistribution::Zipf),
            (KeyType::Int, KeyDistribution::Uniform),
        ] {
            for window in [None, Some("2s")] {
                for p in [1, 3, 8] {
                    check(&spec(f, window, kt, dist), p);
                }
            }
        }
    }
}

#[test]
fn rescale_through_blocks_keeps_exact_results() {
    let options = JobOptions {
        state_payload_bytes: 24,
    };
    for f in FUNCTIONS {
        for window in [None, Some("3s")] {
            let s = spec(f, window, KeyType::String, KeyDistribution::Zipf);
            let mut job = MiniJob::new(&s, 3, options);
            job.run_until(2_000, 101);
            let mut job = job.rescale(&s, 8, options);
            job.run_until(3_500, 53);
            let mut job = job.rescale(&s, 5, options);
            // Run to the end of the bounded partitions, then finish all windows.
            job.run_until(u64::MAX, 211);
            assert!(job.positions.values().all(|p| *p == 6_000));
            for op in &mut job.ops {
                let rows = op.advance_watermark(watermark::MAX_WATERMARK);
                job.fired.extend(rows);
            }
            let got = Expected::from_rows(window.is_some(), job.all_rows()).unwrap();
            let want = expected_results(&s, &job.positions).unwrap();
            assert_eq!(got, want, "{f:?} window {window:?}");
            // Payloads travelled with the keys.
            for op in &job.ops {
                for g in op.range().iter() {
                    for (_, v) in op.group_entries(g) {
                        assert_eq!(v.payload.len(), 24);
                    }
                }
            }
            if window.is_some() {
                assert_eq!(job.ops.iter().map(|o| o.key_count()).sum::<usize>(), 0);
            }
        }
    }
}

fn rec(key: RecordKey, value: i64, ts: i64) -> Record {
    Record { key, value, ts }
}

fn all_groups(config: AggConfig) -> KeyedAggregator {
    KeyedAggregator::new(
        config,
        KeyGroupRange {
            start: 0,
            end: config.max_parallelism - 1,
        },
    )
    .unwrap()
}

fn windowed_sum() -> AggConfig {
    AggConfig {
        function: AggregateFunction::Sum,
        window_size_ms: Some(10_000),
        max_parallelism: MAXP,
        state_payload_bytes: 0,
    }
}

#[test]
fn windows_fire_at_their_end_and_late_records_are_counted() {
    let mut op = all_groups(windowed_sum());
    let k = || RecordKey::string("k");
    op.process(&rec(k(), 5, 1_000)).unwrap();
    op.process(&rec(k(), 7, 9_999)).unwrap();
    op.process(&rec(k(), 100, 10_000)).unwrap(); // next window
    op.process(&rec(RecordKey::long(1), 1, -1)).unwrap(); // window [-10000, 0)
    assert_eq!(aggregate::window_start(-1, 10_000), -10_000);
    assert_eq!(
        aggregate::window_start(i64::MIN, 10_000),
        i64::MIN,
        "clamped, no overflow"
    );
    assert!(op.advance_watermark(-1).is_empty());
    let fired = op.advance_watermark(0);
    assert_eq!(fired.len(), 1);
    assert_eq!(
        fired[0].window,
        Some(Window {
            start: -10_000,
            end: 0
        })
    );
    assert!(
        op.advance_watermark(9_999).is_empty(),
        "end 10000 not reached"
    );
    let fired = op.advance_watermark(10_000);
    assert_eq!(fired.len(), 1);
    assert_eq!((fired[0].key.clone(), fired[0].value), (k(), 12));
    // A record for the fired window is late: counted, not applied.
    op.process(&rec(k(), 1_000, 9_000)).unwrap();
    assert_eq!(op.late_records(), 1);
    // A record behind the watermark whose window is still open is applied.
    op.process(&rec(k(), 1, 10_001)).unwrap();
    assert_eq!(op.late_records(), 1);
    let fired = op.advance_watermark(25_000);
    assert_eq!(fired.len(), 1);
    assert_eq!(fired[0].value, 101);
    assert_eq!(
        op.key_count(),
        0,
        "keys without open windows leave the state"
    );
    assert!(
        op.advance_watermark(24_000).is_empty(),
        "the watermark never goes back"
    );
    assert_eq!(op.watermark(), 25_000);
}

#[test]
fn global_results_and_updates() {
    let config = AggConfig {
        function: AggregateFunction::Max,
        window_size_ms: None,
        max_parallelism: MAXP,
        state_payload_bytes: 0,
    };
    let mut op = all_groups(config);
    op.process_batch(&[
        rec(RecordKey::int(1), 5, 0),
        rec(RecordKey::int(2), -5, 0),
        rec(RecordKey::int(1), 3, 0),
    ])
    .unwrap();
    let rows = op.drain_updates();
    assert_eq!(rows.len(), 2);
    assert!(op.drain_updates().is_empty());
    op.process(&rec(RecordKey::int(2), 9, 0)).unwrap();
    let rows = op.drain_updates();
    assert_eq!(rows.len(), 1);
    assert_eq!((rows[0].key.clone(), rows[0].value), (RecordKey::int(2), 9));
    assert_eq!(op.results().len(), 2);
    assert!(op.advance_watermark(100).is_empty());
}

#[test]
fn routing_and_restore_mistakes_are_typed_errors() {
    let config = windowed_sum();
    let key = RecordKey::string("someone");
    let group = key.key_group(MAXP);
    let other = (group + 1) % MAXP;
    let mut op = KeyedAggregator::new(
        config,
        KeyGroupRange {
            start: other,
            end: other,
        },
    )
    .unwrap();
    assert!(matches!(
        op.process(&rec(key.clone(), 1, 0)),
        Err(AggregateError::NotOwned { .. })
    ));
    assert!(op.encode_group(group).is_err());
    // A block for another group.
    let mut full = all_groups(config);
    full.process(&rec(key.clone(), 1, 0)).unwrap();
    let (block, n) = full.encode_group(group).unwrap();
    assert_eq!(n, 1);
    assert!(matches!(
        op.restore_group(other, &block),
        Err(AggregateError::Incompatible {
            what: "key group",
            ..
        })
    ));
    // A block claiming this group but holding a key of another (a botched rewrite).
    let info = BlockInfo {
        function: AggregateFunction::Sum,
        window_size_ms: Some(10_000),
        max_parallelism: MAXP,
        key_group: other,
    };
    let value = StateValue {
        acc: AccValue::Windows(vec![(0, 1)]),
        payload: vec![],
    };
    let plain = key.to_key();
    let (bad, _) = encode_entries(&info, [(&plain, &value)]);
    assert!(matches!(
        op.restore_group(other, &bad),
        Err(AggregateError::KeyInWrongGroup { .. })
    ));
    // Another function or window size.
    let mut count = config;
    count.function = AggregateFunction::Count;
    let mut op2 = all_groups(count);
    assert!(matches!(
        op2.restore_group(group, &block),
        Err(AggregateError::Incompatible {
            what: "aggregate function",
            ..
        })
    ));
    // Corrupt bytes.
    let mut corrupt = block.clone();
    let i = corrupt.len() / 2;
    corrupt[i] ^= 0xff;
    assert!(matches!(
        full.restore_group(group, &corrupt),
        Err(AggregateError::Codec { .. })
    ));
    // The failed restore left the state untouched.
    assert_eq!(full.group_key_count(group), 1);
}

#[test]
fn blocks_decode_without_the_spec_and_rebucket_to_another_key_group_count() {
    let mut op = all_groups(AggConfig {
        function: AggregateFunction::Count,
        window_size_ms: None,
        max_parallelism: MAXP,
        state_payload_bytes: 3,
    });
    let keys: Vec<RecordKey> = (0..300)
        .map(|i| match i % 3 {
            0 => RecordKey::string(format!("ключ-{i}")),
            1 => RecordKey::long(i * 1_000_003),
            _ => RecordKey::int(-i as i32),
        })
        .collect();
    for k in &keys {
        op.process(&rec(k.clone(), 0, 0)).unwrap();
    }
    // An offline rewrite 128 -> 256 groups: decode every block, re-hash, re-encode.
    let mut rebucketed: BTreeMap<u32, Vec<(Key, StateValue)>> = BTreeMap::new();
    for g in 0..MAXP {
        let (block, _) = op.encode_group(g).unwrap();
        let d = decode_group(&block).unwrap();
        assert_eq!(d.header.info.key_group, g);
        assert_eq!(d.header.info.function, AggregateFunction::Count);
        for (k, v) in d.entries {
            assert_eq!(v.payload.len(), 3);
            let ng = keyshift_core::keygroup::key_group_for_key(&k, 256);
            rebucketed.entry(ng).or_default().push((k, v));
        }
    }
    let mut op256 = all_groups(AggConfig {
        function: AggregateFunction::Count,
        window_size_ms: None,
        max_parallelism: 256,
        state_payload_bytes: 3,
    });
    for (g, entries) in &rebucketed {
        let info = BlockInfo {
            function: AggregateFunction::Count,
            window_size_ms: None,
            max_parallelism: 256,
            key_group: *g,
        };
        let (block, _) = encode_entries(&info, entries.iter().map(|(k, v)| (k, v)));
        op256.restore_group(*g, &block).unwrap();
    }
    assert_eq!(op256.key_count(), keys.len());
    assert_eq!(op256.results(), op.results());
}

#[test]
fn compile_rejects_bad_specs() {
    let mut s = spec(
        AggregateFunction::Sum,
        Some("0s"),
        KeyType::Long,
        KeyDistribution::Uniform,
    );
    assert!(matches!(
        compile(&s, MAXP, &JobOptions::default()),
        Err(JobError::WindowSize(_))
    ));
    s.window = None;
    assert!(matches!(
        compile(&s, 0, &JobOptions::default()),
        Err(JobError::MaxParallelism(0))
    ));
    s.source.file = Some(keyshift_core::spec::FileSource {
        path: "/nonexistent".into(),
        timestamp_field: None,
    });
    assert!(matches!(
        compile(&s, MAXP, &JobOptions::default()),
        Err(JobError::SourceOneOf)
    ));
}

/// An operator with string, long and int keys (some with characters JSON escapes), windowed or
/// not, with payloads; some keys changed since the last drain.
fn mixed_state(window: Option<i64>, payload: usize) -> KeyedAggregator {
    let config = AggConfig {
        function: AggregateFunction::Sum,
        window_size_ms: window,
        max_parallelism: MAXP,
        state_payload_bytes: payload,
    };
    let mut op = all_groups(config);
    let keys: Vec<RecordKey> = (0..600)
        .map(|i| match i % 3 {
            0 => RecordKey::string(format!("k\"{i}\\\n€")),
            1 => RecordKey::long(i64::from(i) - 300),
            _ => RecordKey::int(i),
        })
        .collect();
    for (i, k) in keys.iter().enumerate() {
        op.process(&rec(k.clone(), i as i64, (i as i64 % 7) * 4_000))
            .unwrap();
    }
    let _ = op.drain_updates();
    for k in keys.iter().step_by(4) {
        op.process(&rec(k.clone(), 5, 9_000)).unwrap();
    }
    op
}

#[test]
fn snapshot_groups_encode_like_encode_group_and_drain_like_drain_updates() {
    for window in [None, Some(10_000)] {
        let mut reference = mixed_state(window, 9);
        let mut op = mixed_state(window, 9);
        let blocks: Vec<(u32, Vec<u8>, u64)> = op
            .range()
            .iter()
            .map(|g| {
                let (b, n) = op.encode_group(g).unwrap();
                (g, b, n)
            })
            .collect();
        let rows = reference.drain_updates();
        assert!(!rows.is_empty());
        let mut expected: Vec<Vec<u8>> = rows
            .iter()
            .map(|r| {
                let mut line = Vec::new();
                format_json_line(r, &mut line);
                line
            })
            .collect();

        // Without a buffer: same blocks, nothing drained.
        for (g, (group, block, n)) in op.snapshot_groups().into_iter().zip(&blocks) {
            assert_eq!(g.group(), *group);
            let e = g.encode(None);
            assert_eq!((&e.block, e.entries, e.rows), (block, *n, 0));
        }
        // With one: same blocks, and exactly the changed keys' rows, once.
        let mut lines = Vec::new();
        let mut drained = 0;
        for (g, (_, block, _)) in op.snapshot_groups().into_iter().zip(&blocks) {
            let e = g.encode(Some(&mut lines));
            assert_eq!(&e.block, block);
            drained += e.rows;
        }
        assert_eq!(drained as usize, rows.len());
        let mut got: Vec<Vec<u8>> = lines
            .split_inclusive(|b| *b == b'\n')
            .map(<[u8]>::to_vec)
            .collect();
        got.sort();
        expected.sort();
        assert_eq!(got, expected, "window {window:?}");
        assert!(
            op.drain_updates().is_empty(),
            "the change marks are cleared"
        );
        let mut again = Vec::new();
        for g in op.snapshot_groups() {
            assert_eq!(g.encode(Some(&mut again)).rows, 0);
        }
        assert!(again.is_empty());
        op.mark_all_changed();
        assert_eq!(op.drain_updates().len(), op.results().len());
    }
}

/// Every group of `op` encoded as `modes` says, and the result lines drained with them: what
/// a cut taken now must give.
fn encoded_at(op: &mut KeyedAggregator, modes: &[GroupMode]) -> (Vec<EncodedGroup>, Vec<u8>) {
    let mut lines = Vec::new();
    let groups = op
        .snapshot_groups_as(|g| modes[g as usize])
        .into_iter()
        .map(|g| g.encode(Some(&mut lines)))
        .collect();
    (groups, lines)
}

/// A frozen cut is the state at its barrier: after more records changed the state (the same
/// keys, new keys), its groups encode to exactly the blocks encoding at the barrier gives
/// (deltas and whole groups), and it drains the same result lines at the barrier.
#[test]
fn a_frozen_cut_encodes_the_state_at_its_barrier() {
    for (window, whole) in [None, Some(10_000)]
        .into_iter()
        .flat_map(|w| [(w, false), (w, true)])
    {
        let changed = |k: i64| RecordKey::long(k * 7 - 300);
        let prepare = || {
            let mut op = mixed_state(window, 9);
            let since = op.cut();
            for k in 0..50 {
                op.process(&rec(changed(k), 3, 5_000)).unwrap();
            }
            // The barrier.
            op.cut();
            (op, since)
        };
        let (mut reference, since) = prepare();
        let (mut op, _) = prepare();
        // Deltas over the cut before (a checkpoint building on it), or whole groups (the
        // first checkpoint, a savepoint).
        let modes: Vec<GroupMode> = reference
            .range()
            .iter()
            .map(|g| match whole {
                true => GroupMode::Full,
                false => reference.group_mode(g, since),
            })
            .collect();
        assert!(whole || modes.iter().any(|m| matches!(m, GroupMode::Delta { .. })));
        let (want, want_lines) = encoded_at(&mut reference, &modes);
        let mut lines = Vec::new();
        let frozen: Vec<FrozenGroup> = op
            .snapshot_groups_as(|g| modes[g as usize])
            .into_iter()
            .map(|g| g.freeze(Some(&mut lines)))
            .collect();
        assert!(frozen.iter().map(FrozenGroup::entries).sum::<u64>() >= 40);
        assert!(!want_lines.is_empty());
        assert_eq!(lines, want_lines, "window {window:?}, whole {whole}");
        // Records after the barrier, before the encoding.
        for k in 0..50 {
            op.process(&rec(changed(k), 100, 6_000)).unwrap();
            op.process(&rec(RecordKey::long(10_000 + k), 1, 6_000))
                .unwrap();
        }
        assert_ne!(op.results(), reference.results());
        for (f, w) in frozen.into_iter().zip(&want) {
            let e = f.encode();
            assert_eq!(
                (e.group, &e.block, e.entries, e.mode, e.keys, e.rows),
                (w.group, &w.block, w.entries, w.mode, w.keys, w.rows),
                "window {window:?}, whole {whole}"
            );
        }
    }
}

/// A cut whose deltas are copied after its barrier ([`KeyedAggregator::begin_capture`]) is the
/// state at its barrier all the same, whichever way each key is copied: by a step, just before
/// a record changes it (once, however many records follow), or when the cut is taken over;
/// new keys after the barrier are not in it, and each changed key's result is drained once,
/// with its value at the barrier. The next cut holds the changes after the barrier.
#[test]
fn a_cut_copied_after_its_barrier_is_the_state_at_its_barrier() {
    let changed = |k: i64| RecordKey::long(k * 7 - 300);
    let prepare = || {
        let mut op = mixed_state(None, 9);
        let since = op.cut();
        for k in 0..80 {
            op.process(&rec(changed(k), 3, 5_000)).unwrap();
        }
        let _ = op.drain_updates();
        for k in 0..60 {
            op.process(&rec(changed(k), 2, 5_000)).unwrap();
        }
        // The barrier.
        op.cut();
        (op, since)
    };
    let sorted = |lines: &[u8]| {
        let mut v: Vec<Vec<u8>> = lines.split(|b| *b == b'\n').map(<[u8]>::to_vec).collect();
        v.sort();
        v
    };
    for steps in [0usize, 1, 7, 1000] {
        let (mut reference, since) = prepare();
        let (mut op, _) = prepare();
        let modes: Vec<GroupMode> = reference
            .range()
            .iter()
            .map(|g| reference.group_mode(g, since))
            .collect();
        let (want, want_lines) = encoded_at(&mut reference, &modes);
        let mut deferred = Vec::new();
        let mut lines = Vec::new();
        let mut frozen = Vec::new();
        for g in op.snapshot_groups_as(|g| modes[g as usize]) {
            match g.defer() {
                Ok(d) => deferred.push(d),
                Err(g) => frozen.push(g.freeze(Some(&mut lines))),
            }
        }
        assert!(deferred.len() > 10, "{} deltas deferred", deferred.len());
        assert!(op.begin_capture(deferred, true).is_none());
        assert!(op.capturing());
        // After the barrier: keys of the cut changed (twice), new keys; steps in between.
        for k in 0..60 {
            if k % 10 == 0 {
                op.capture_step(steps);
            }
            op.process(&rec(changed(k), 100, 6_000)).unwrap();
            op.process(&rec(changed(k), 1, 6_000)).unwrap();
            op.process(&rec(RecordKey::long(10_000 + k), 1, 6_000))
                .unwrap();
        }
        assert_ne!(op.results(), reference.results());
        let captured = op.take_captured().expect("a capture ran");
        assert!(!op.capturing());
        lines.extend_from_slice(&captured.lines);
        frozen.extend(captured.groups);
        frozen.sort_by_key(FrozenGroup::group);
        assert_eq!(
            captured.rows, 60,
            "each key changed since the last drain, once (steps {steps})"
        );
        assert_eq!(sorted(&lines), sorted(&want_lines), "steps {steps}");
        assert_eq!(frozen.len(), want.len());
        for (f, w) in frozen.into_iter().zip(&want) {
            let e = f.encode();
            // Keys in another order than the map's: the same entries.
            let entries = |block: &[u8]| {
                if block.is_empty() {
                    return Vec::new();
                }
                let mut v = state_codec::decode_group(block)
                    .expect("a block the encoder wrote")
                    .entries;
                v.sort_by(|a, b| a.0.cmp(&b.0));
                v
            };
            let (got, expect) = (entries(&e.block), entries(&w.block));
            assert_eq!(
                (e.group, e.entries, e.mode, e.keys),
                (w.group, w.entries, w.mode, w.keys),
                "steps {steps}"
            );
            assert_eq!(got, expect, "group {} steps {steps}", e.group);
        }
        // The next cut: the changes after the barrier (the 60 keys, the 60 new ones).
        let next = op.cut();
        let modes: Vec<GroupMode> = op
            .range()
            .iter()
            .map(|g| op.group_mode(g, next - 1))
            .collect();
        let mut after = Vec::new();
        let n: u64 = op
            .snapshot_groups_as(|g| modes[g as usize])
            .into_iter()
            .map(|g| g.freeze(Some(&mut after)).entries())
            .sum();
        assert_eq!(n, 120, "steps {steps}");
        assert_eq!(sorted(&after).len(), 121, "120 lines and the empty tail");
    }
}

/// What a whole snapshot's cut copies per key (docs/architecture.md and docs/operations.md
/// say "about 90 bytes per key"): the key, the accumulator and a handle on the payload.
#[test]
fn a_frozen_entry_is_at_most_90_bytes() {
    let size = std::mem::size_of::<(RecordKey, state_codec::AccValue, bytes::Bytes)>();
    assert!(size <= 90, "{size} bytes per frozen entry: update the docs");
}

#[test]
fn decoded_groups_install_like_restore_group_and_share_the_block() {
    for window in [None, Some(10_000)] {
        let op = mixed_state(window, 40);
        let mut by_restore = all_groups(*op.config());
        let mut by_install = all_groups(*op.config());
        let decoder = by_install.decoder();
        let mut decoded = Vec::new();
        for g in op.range().iter() {
            let (block, n) = op.encode_group(g).unwrap();
            by_restore.restore_group(g, &block).unwrap();
            let shared = bytes::Bytes::from(block);
            let state = decoder.decode(g, &shared).unwrap();
            assert_eq!((state.group(), state.len() as u64), (g, n));
            decoded.push(state);
        }
        // Nothing is applied until installed.
        assert_eq!(by_install.key_count(), 0);
        for state in decoded {
            by_install.install_group(state).unwrap();
        }
        assert_eq!(by_install.results(), op.results());
        assert_eq!(by_restore.results(), op.results());
        for g in op.range().iter() {
            let mut a = op.group_entries(g);
            let mut b = by_install.group_entries(g);
            a.sort_by(|x, y| x.0.cmp(&y.0));
            b.sort_by(|x, y| x.0.cmp(&y.0));
            assert_eq!(a, b, "group {g}");
        }
        // Windows restored through install fire like the original's.
        let (mut a, mut b) = (op, by_install);
        assert_eq!(a.advance_watermark(i64::MAX), b.advance_watermark(i64::MAX));
    }
}

#[test]
fn decoding_checks_like_restore_group() {
    let op = mixed_state(None, 0);
    let group = op
        .range()
        .iter()
        .find(|g| op.group_key_count(*g) > 0)
        .unwrap();
    let (block, _) = op.encode_group(group).unwrap();
    let shared = bytes::Bytes::from(block.clone());
    let mut fresh = all_groups(*op.config());
    let decoder = fresh.decoder();
    assert!(matches!(
        decoder.decode(group + 1, &shared),
        Err(AggregateError::Incompatible {
            what: "key group",
            ..
        })
    ));
    let mut bad = block.clone();
    bad[block.len() / 2] ^= 1;
    assert!(matches!(
        decoder.decode(group, &bytes::Bytes::from(bad)),
        Err(AggregateError::Codec { .. })
    ));
    let mut other = *op.config();
    other.function = AggregateFunction::Count;
    assert!(matches!(
        all_groups(other).decoder().decode(group, &shared),
        Err(AggregateError::Incompatible { .. })
    ));
    let narrow = KeyedAggregator::new(
        *op.config(),
        KeyGroupRange {
            start: group + 1,
            end: group + 1,
        },
    )
    .unwrap();
    assert!(matches!(
        narrow.decoder().decode(group, &shared),
        Err(AggregateError::NotOwned { .. })
    ));
    let state = decoder.decode(group, &shared).unwrap();
    assert!(matches!(
        all_groups(*op.config())
            .decoder()
            .decode(group, &shared)
            .map(|_| ()),
        Ok(())
    ));
    let mut narrow = narrow;
    assert!(narrow.install_group(state).is_err());
    fresh.restore_group(group, &block).unwrap();
    assert_eq!(fresh.group_key_count(group), op.group_key_count(group));
}
