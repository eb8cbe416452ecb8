//! Incremental checkpoints end to end on `memory://`: a job's keyed operators (the real
//! `KeyedAggregator`, cut, encoder and writer a worker uses) take full and incremental
//! checkpoints, savepoints, restarts at other parallelisms, checkpoint retention and
//! `savepoint dispose` in random order; after every step every snapshot still listed must
//! verify and restore exactly the state it was taken of (so no deletion ever removed a file a
//! kept snapshot reads).

use keyshift::crd::AggregateFunction;
use keyshift::job::{AggConfig, KeyedAggregator, Record, RecordKey};
use keyshift::keygroup::{Assignment, KeyGroupRange};
use keyshift::runtime::checkpoint::{self, Updates};
use keyshift::runtime::incremental::{Base, Chain, ChainPolicy, ChainSettings};
use keyshift::snapshot::{self, *};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::sync::Arc;

const MAX_P: u32 = 16;

fn config() -> AggConfig {
    AggConfig {
        function: AggregateFunction::Sum,
        window_size_ms: None,
        max_parallelism: MAX_P,
        state_payload_bytes: 8,
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// Records on keys `0..keys`, each adding `value`.
    Records {
        keys: i64,
        first: i64,
        value: i64,
    },
    Checkpoint,
    Savepoint,
    /// Restore every subtask from the newest snapshot at this parallelism.
    Restart(u32),
    Retain(usize),
    /// Dispose of the n-th listed snapshot (modulo), forced or not.
    Dispose(usize, bool),
}

fn arb_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1i64..40, 0i64..200, 1i64..5).prop_map(|(keys, first, value)| Op::Records { keys, first, value }),
        4 => Just(Op::Checkpoint),
        1 => Just(Op::Savepoint),
        1 => (1u32..=4).prop_map(Op::Restart),
        2 => (1usize..=3).prop_map(Op::Retain),
        2 => (0usize..8, any::<bool>()).prop_map(|(n, f)| Op::Dispose(n, f)),
    ]
}

type Model = BTreeMap<String, i64>;

struct Job {
    store: Arc<dyn ObjectStore>,
    url: String,
    job_dir: Path,
    assignment: Assignment,
    ops: Vec<KeyedAggregator>,
    chains: Vec<Chain>,
    model: Model,
    next_id: u64,
    last_committed: u64,
    /// The state each committed snapshot was taken of.
    taken: BTreeMap<u64, Model>,
    incremental_written: usize,
    failed_commits: usize,
    /// Records `(key, value)` processed by each subtask after an incremental checkpoint's cut and
    /// before its upload (records that keep flowing while the checkpoint is written); cleared by
    /// the checkpoint.
    during_upload: Vec<(i64, i64)>,
}

fn meta(id: u64, kind: SnapshotKind) -> SnapshotMeta {
    SnapshotMeta {
        job: JobIdentity {
            namespace: "ns".into(),
            name: "job".into(),
            job_fingerprint: "fp".into(),
            layout: None,
        },
        snapshot_id: id,
        kind,
        completed_at: jiff::Timestamp::now(),
        state_schema: keyshift::job::AGG_SCHEMA.into(),
        source_positions: BTreeMap::new(),
        source_partitions: BTreeMap::new(),
        watermark: None,
    }
}

fn state_of(ops: &[KeyedAggregator]) -> Model {
    ops.iter()
        .flat_map(|op| op.results())
        .map(|r| (r.key.to_string(), r.value))
        .collect()
}

/// Shorter chains than the default (a group is written whole after 5-12 deltas, staggered by
/// group), so that the short random sequences compact often.
const CHAINS: ChainSettings = ChainSettings {
    enabled: true,
    policy: ChainPolicy {
        max_deltas: 12,
        max_delta_share: 50,
    },
};

impl Job {
    fn new(name: &str, p: u32) -> Job {
        static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let url = format!("memory://incremental-{name}-{run}");
        let (store, base) = open_store(&url).unwrap();
        let job_dir = job_dir(&base, "ns", "job");
        let assignment = Assignment::new(i64::from(p), i64::from(MAX_P)).unwrap();
        let ops = assignment
            .ranges()
            .into_iter()
            .map(|r| KeyedAggregator::new(config(), r).unwrap())
            .collect();
        Job {
            store,
            url,
            job_dir,
            assignment,
            ops,
            chains: (0..p).map(|_| Chain::new(CHAINS)).collect(),
            model: Model::new(),
            next_id: 1,
            last_committed: 0,
            taken: BTreeMap::new(),
            incremental_written: 0,
            failed_commits: 0,
            during_upload: Vec::new(),
        }
    }

    fn records(&mut self, keys: i64, first: i64, value: i64) {
        for k in first..first + keys {
            let key = RecordKey::long(k);
            let g = key.key_group(MAX_P);
            let i = (g * self.assignment.parallelism() / MAX_P) as usize;
            self.ops[i]
                .process(&Record {
                    key: key.clone(),
                    value,
                    ts: 0,
                })
                .unwrap();
            *self.model.entry(key.to_string()).or_insert(0) += value;
        }
    }

    async fn snapshot(&mut self, kind: SnapshotKind) {
        let id = self.next_id;
        self.next_id += 1;
        let dir = snapshot_dir(&self.job_dir, kind, id);
        let mut acks = Vec::new();
        let mut failed = false;
        // The state at the barrier, before any record processed during an upload.
        let at_barrier = self.model.clone();
        let during = std::mem::take(&mut self.during_upload);
        for i in 0..self.ops.len() {
            let writer =
                SnapshotWriter::new(self.store.clone(), &dir, self.assignment, i as u32).unwrap();
            let base = match kind {
                SnapshotKind::Checkpoint => {
                    self.chains[i].base_for(Some(self.last_committed)).cloned()
                }
                SnapshotKind::Savepoint => None,
            };
            let op = &mut self.ops[i];
            let cut = op.cut();
            // Every snapshot is cut at its barrier and uploaded while records flow, as the
            // workers do (a checkpoint without a base, and a savepoint, in whole groups).
            let policy = self.chains[i]
                .policy
                .for_checkpoint(false, self.assignment.max_parallelism());
            // Deltas' changed keys are copied after the barrier: some by a step, the others
            // just before a record changes them, the rest when the cut is finished.
            let mut taken = checkpoint::take_cut(op, base.as_ref(), Updates::Skip, true).await;
            if base.is_some() {
                self.incremental_written += 1;
            }
            // Records keep flowing between the cut and the upload.
            for (n, (k, value)) in during.iter().enumerate() {
                if n % 3 == 1 {
                    op.capture_step(2);
                }
                let key = RecordKey::long(*k);
                let owner = key.key_group(MAX_P) * self.assignment.parallelism() / MAX_P;
                if owner as usize == i {
                    op.process(&Record {
                        key: key.clone(),
                        value: *value,
                        ts: 0,
                    })
                    .unwrap();
                    *self.model.entry(key.to_string()).or_insert(0) += value;
                }
            }
            checkpoint::finish_cut(op, &mut taken).await;
            let ack = checkpoint::upload_cut(
                taken.into_upload(),
                writer,
                base.as_ref(),
                policy,
                self.store.as_ref(),
                &dir,
            )
            .await;
            match ack {
                Ok(ack) => {
                    if kind == SnapshotKind::Checkpoint {
                        self.chains[i].written(Base::written(id, cut, &ack));
                    }
                    acks.push(ack);
                }
                // A compaction read its chain back and found a file gone (its checkpoint was
                // disposed of, forced): the checkpoint fails, and the worker starts over.
                Err(SnapshotError::MissingFile { .. }) => {
                    self.chains[i].reset();
                    failed = true;
                }
                Err(e) => panic!("snapshot {id}, subtask {i}: {e}"),
            }
        }
        if failed {
            self.failed_commits += 1;
            return;
        }
        let manifest = Manifest::assemble(meta(id, kind), self.assignment, acks).unwrap();
        if kind == SnapshotKind::Savepoint {
            assert!(
                manifest.is_self_contained(),
                "savepoints are self-contained"
            );
        }
        match commit_manifest(self.store.as_ref(), &dir, &manifest).await {
            Ok(()) => {
                self.last_committed = id;
                self.taken.insert(id, at_barrier);
            }
            // A file it builds on was disposed of (forced): the commit refuses it, and the
            // next checkpoint is written in full.
            Err(SnapshotError::MissingFile { .. }) => {
                assert!(!manifest.is_self_contained());
                self.failed_commits += 1;
            }
            Err(e) => panic!("commit {id}: {e}"),
        }
    }

    async fn restart(&mut self, p: u32) {
        let snaps = list_snapshots(self.store.as_ref(), &self.job_dir)
            .await
            .unwrap();
        let Some(newest) = snaps.iter().max_by_key(|s| s.id) else {
            return;
        };
        let manifest = read_manifest(self.store.as_ref(), &newest.dir)
            .await
            .unwrap();
        self.assignment = Assignment::new(i64::from(p), i64::from(MAX_P)).unwrap();
        self.ops.clear();
        self.chains.clear();
        for r in self.assignment.ranges() {
            let mut op = KeyedAggregator::new(config(), r).unwrap();
            keyshift::runtime::restore::restore_state(
                &mut op,
                self.store.as_ref(),
                &newest.dir,
                &manifest,
                Default::default(),
            )
            .await
            .unwrap();
            let mut chain = Chain::new(CHAINS);
            if manifest.kind == SnapshotKind::Checkpoint {
                chain.restored_from(Base::restored(&manifest, r));
            }
            self.ops.push(op);
            self.chains.push(chain);
        }
        self.model = self.taken[&newest.id].clone();
        assert_eq!(
            state_of(&self.ops),
            self.model,
            "restart from {}",
            newest.id
        );
        // Like a new coordinator: the newest committed snapshot of any kind.
        self.last_committed = newest.id;
    }

    /// Every listed snapshot verifies and restores exactly the state it was taken of.
    async fn check_all(&self) {
        let snaps = list_snapshots(self.store.as_ref(), &self.job_dir)
            .await
            .unwrap();
        for s in snaps {
            verify(self.store.as_ref(), &s.dir)
                .await
                .unwrap_or_else(|e| panic!("{} {}: {e}", s.kind, s.id));
            let manifest = read_manifest(self.store.as_ref(), &s.dir).await.unwrap();
            let mut op = KeyedAggregator::new(
                config(),
                KeyGroupRange {
                    start: 0,
                    end: MAX_P - 1,
                },
            )
            .unwrap();
            keyshift::runtime::restore::restore_state(
                &mut op,
                self.store.as_ref(),
                &s.dir,
                &manifest,
                Default::default(),
            )
            .await
            .unwrap_or_else(|e| panic!("restoring {} {}: {e}", s.kind, s.id));
            assert_eq!(
                state_of(std::slice::from_ref(&op)),
                self.taken[&s.id],
                "{} {} restores the state it was taken of",
                s.kind,
                s.id
            );
            // The savepoint tools read it too (chains merged).
            let loc = keyshift::offline::open_location(&format!("{}/{}", self.url, s.dir.as_ref()))
                .unwrap();
            let v = keyshift::offline::verify_keys(&loc).await.unwrap();
            assert!(v.problems.is_empty(), "{:?}", v.problems);
            assert_eq!(v.keys_checked, self.taken[&s.id].len() as u64);
        }
    }

    async fn apply(&mut self, op: &Op) {
        match op {
            Op::Records { keys, first, value } => self.records(*keys, *first, *value),
            Op::Checkpoint => self.snapshot(SnapshotKind::Checkpoint).await,
            Op::Savepoint => self.snapshot(SnapshotKind::Savepoint).await,
            Op::Restart(p) => self.restart(*p).await,
            Op::Retain(keep) => {
                retain(self.store.as_ref(), &self.job_dir, *keep)
                    .await
                    .unwrap();
            }
            Op::Dispose(n, force) => {
                let snaps = list_snapshots(self.store.as_ref(), &self.job_dir)
                    .await
                    .unwrap();
                if snaps.is_empty() {
                    return;
                }
                let s = &snaps[n % snaps.len()];
                let url = format!("{}/{}", self.url, s.dir.as_ref());
                let opts = keyshift::offline::retention::DisposeOptions {
                    force: *force,
                    dry_run: false,
                };
                // Refused (the newest checkpoint, the newest snapshot) unless forced.
                if keyshift::offline::retention::dispose(&url, opts)
                    .await
                    .is_ok()
                {
                    self.taken.remove(&s.id);
                }
            }
        }
    }
}

fn run(name: &str, p: u32, ops: &[Op]) -> usize {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut job = Job::new(name, p);
        for op in ops {
            job.apply(op).await;
            job.check_all().await;
        }
        job.incremental_written
    })
}

/// A fixed sequence: incremental checkpoints are written, retention deletes old checkpoints
/// whose files the newest still reads, and everything kept restores.
#[test]
fn retention_keeps_what_incremental_checkpoints_read() {
    let mut ops = vec![
        Op::Records {
            keys: 200,
            first: 0,
            value: 1,
        },
        Op::Checkpoint,
    ];
    for i in 0..6 {
        ops.push(Op::Records {
            keys: 3,
            first: i * 7,
            value: 2,
        });
        ops.push(Op::Checkpoint);
        ops.push(Op::Retain(1));
    }
    ops.push(Op::Restart(3));
    ops.push(Op::Records {
        keys: 2,
        first: 5,
        value: 1,
    });
    ops.push(Op::Checkpoint);
    ops.push(Op::Dispose(0, true));
    let incremental = run("fixed", 2, &ops);
    assert!(incremental >= 12, "{incremental} incremental subtask files");
}

/// Retention keeps a checkpoint the job's in-use marker pins (a rescale's base, a restoreFrom),
/// and the files of earlier checkpoints it reads; while the marker cannot be read it deletes no
/// committed checkpoint; once unpinned, the checkpoint goes.
#[test]
fn retention_keeps_what_the_in_use_marker_pins() {
    use object_store::ObjectStoreExt;
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut job = Job::new("pinned", 2);
        job.records(200, 0, 1);
        job.snapshot(SnapshotKind::Checkpoint).await;
        job.records(3, 0, 2);
        job.snapshot(SnapshotKind::Checkpoint).await;
        let pinned = read_manifest(
            job.store.as_ref(),
            &snapshot_dir(&job.job_dir, SnapshotKind::Checkpoint, 2),
        )
        .await
        .unwrap();
        assert!(!pinned.is_self_contained(), "chk-2 reads chk-1's files");
        let marker = keyshift::snapshot::InUseMarker::new(vec![keyshift::snapshot::InUseEntry {
            path: "checkpoints/chk-2".into(),
            holder: Some("test".into()),
            reason: Some("a rescale's base".into()),
        }]);
        keyshift::snapshot::write_in_use(job.store.as_ref(), &job.job_dir, &marker)
            .await
            .unwrap();
        for i in 0..3 {
            job.records(2, 10 + i * 5, 3);
            job.snapshot(SnapshotKind::Checkpoint).await;
        }
        let report = retain(job.store.as_ref(), &job.job_dir, 1).await.unwrap();
        assert_eq!(report.pinned_kept, vec![2]);
        assert_eq!(report.kept, vec![5]);
        assert_eq!(report.deleted, vec![1, 3, 4]);
        assert_eq!(report.marker_error, None);
        for gone in [1, 3, 4] {
            job.taken.remove(&gone);
        }
        // chk-2 still restores exactly (chk-1's files it reads stayed).
        job.check_all().await;

        // A marker that does not parse: retention cannot tell what is pinned, so it deletes no
        // committed checkpoint.
        job.store
            .put(
                &job.job_dir.clone().join(keyshift::snapshot::IN_USE_FILE),
                object_store::PutPayload::from_static(b"{not json"),
            )
            .await
            .unwrap();
        job.records(2, 40, 4);
        job.snapshot(SnapshotKind::Checkpoint).await;
        let report = retain(job.store.as_ref(), &job.job_dir, 1).await.unwrap();
        assert!(report.deleted.is_empty(), "{report:?}");
        assert!(
            report
                .marker_error
                .as_deref()
                .is_some_and(|e| e.contains("_in_use.json")),
            "{report:?}"
        );
        job.check_all().await;

        // Unpinned: chk-2 goes with the next retention (and chk-5).
        keyshift::snapshot::write_in_use(
            job.store.as_ref(),
            &job.job_dir,
            &keyshift::snapshot::InUseMarker::new(Vec::new()),
        )
        .await
        .unwrap();
        let report = retain(job.store.as_ref(), &job.job_dir, 1).await.unwrap();
        assert_eq!(report.deleted, vec![2, 5]);
        assert!(report.pinned_kept.is_empty());
        job.taken.remove(&2);
        job.taken.remove(&5);
        job.check_all().await;
    });
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Any order of records, checkpoints, savepoints, restarts, retention and disposals: every
    /// snapshot still listed verifies and restores exactly.
    #[test]
    fn retention_and_dispose_never_break_a_kept_snapshot(
        p in 1u32..=3,
        ops in proptest::collection::vec(arb_op(), 1..24),
        case in any::<u64>(),
    ) {
        run(&format!("prop-{case}"), p, &ops);
    }
}

/// Records processed while an incremental checkpoint is uploaded (after its cut) are not in it,
/// whether they change keys of its delta, keys it does not write, or new keys: it restores the
/// state at its barrier exactly, and the next checkpoint holds them.
#[test]
fn records_during_an_upload_are_in_the_next_checkpoint_not_this_one() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut job = Job::new("during-upload", 2);
        job.records(200, 0, 1);
        job.snapshot(SnapshotKind::Checkpoint).await;
        // Keys 0..6 change before the barrier (the delta).
        job.records(6, 0, 1);
        let delta = [0i64, 1, 2, 3, 4, 5];
        // Changed in the delta, unchanged since the base, new.
        job.during_upload = delta
            .iter()
            .map(|k| (*k, 10))
            .chain((100..106).map(|k| (k, 10)))
            .chain((500..506).map(|k| (k, 10)))
            .collect();
        let before = job.incremental_written;
        job.snapshot(SnapshotKind::Checkpoint).await;
        assert_eq!(
            job.incremental_written,
            before + 2,
            "both subtasks incremental"
        );
        assert_eq!(job.last_committed, 2);
        let m2 = read_manifest(
            job.store.as_ref(),
            &snapshot_dir(&job.job_dir, SnapshotKind::Checkpoint, 2),
        )
        .await
        .unwrap();
        assert!(!m2.is_self_contained());
        let at_barrier = &job.taken[&2];
        assert_eq!(at_barrier["0"], 2);
        assert_eq!(at_barrier["100"], 1);
        assert!(!at_barrier.contains_key("500"));
        assert_eq!(job.model["0"], 12, "processed during the upload");
        assert_eq!(job.model["500"], 10);
        // chk-2 restores the state at its barrier (not the live one).
        job.check_all().await;
        job.snapshot(SnapshotKind::Checkpoint).await;
        assert_eq!(job.last_committed, 3);
        assert_eq!(job.taken[&3], job.model);
        assert_eq!(job.taken[&3]["100"], 11);
        job.check_all().await;
        job.restart(3).await;
        assert_eq!(state_of(&job.ops)["500"], 10);
    });
}

/// The same for a snapshot written in whole groups (the first checkpoint, a savepoint): it is
/// cut at its barrier and uploaded while records flow too, and holds the state at its barrier.
#[test]
fn records_during_a_whole_snapshots_upload_are_not_in_it() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut job = Job::new("during-whole-upload", 2);
        job.records(200, 0, 1);
        job.during_upload = (0..6).chain(400..406).map(|k| (k, 10)).collect();
        let before = job.incremental_written;
        job.snapshot(SnapshotKind::Checkpoint).await;
        assert_eq!(
            job.incremental_written, before,
            "the first checkpoint is whole"
        );
        assert_eq!(job.taken[&1]["0"], 1);
        assert!(!job.taken[&1].contains_key("400"));
        assert_eq!((job.model["0"], job.model["400"]), (11, 10));
        job.check_all().await;
        job.records(6, 0, 1);
        job.during_upload = (0..3).chain(600..603).map(|k| (k, 5)).collect();
        job.snapshot(SnapshotKind::Savepoint).await;
        let id = job.last_committed;
        let m = read_manifest(
            job.store.as_ref(),
            &snapshot_dir(&job.job_dir, SnapshotKind::Savepoint, id),
        )
        .await
        .unwrap();
        assert!(m.is_self_contained(), "a savepoint is self-contained");
        assert_eq!(job.taken[&id]["0"], 12);
        assert!(!job.taken[&id].contains_key("600"));
        assert_eq!((job.model["0"], job.model["600"]), (17, 5));
        job.check_all().await;
        // The savepoint is no base: the next checkpoint builds on checkpoint 1 or is whole,
        // and holds what flowed during the savepoint's upload.
        job.snapshot(SnapshotKind::Checkpoint).await;
        assert_eq!(job.taken[&job.last_committed], job.model);
        job.check_all().await;
        job.restart(3).await;
        assert_eq!(state_of(&job.ops)["600"], 5);
    });
}

/// Dispose of an old checkpoint whose files a newer one reads: the files stay, the report
/// says so, and the newer checkpoint restores; retention later removes them once unreferenced.
#[test]
fn dispose_keeps_files_a_newer_checkpoint_reads() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut job = Job::new("dispose", 1);
        job.records(100, 0, 1);
        job.snapshot(SnapshotKind::Checkpoint).await;
        job.records(1, 0, 1);
        job.snapshot(SnapshotKind::Checkpoint).await;
        let m2 = read_manifest(
            job.store.as_ref(),
            &snapshot_dir(&job.job_dir, SnapshotKind::Checkpoint, 2),
        )
        .await
        .unwrap();
        assert!(!m2.is_self_contained());
        assert_eq!(m2.format_version, snapshot::FORMAT_VERSION);
        assert!(m2.stats.written_bytes.unwrap() * 5 < m2.stats.total_bytes);
        let url = format!("{}/ns/job/checkpoints/chk-1", job.url);
        let r = keyshift::offline::retention::dispose(
            &url,
            keyshift::offline::retention::DisposeOptions {
                force: false,
                dry_run: false,
            },
        )
        .await
        .unwrap();
        assert_eq!(r.kept_referenced, 1);
        job.taken.remove(&1);
        job.check_all().await;
        // A full checkpoint later: chk-2 goes with retention and the kept file with it.
        for c in &mut job.chains {
            *c = Chain::new(ChainSettings {
                enabled: false,
                ..ChainSettings::default()
            });
        }
        job.snapshot(SnapshotKind::Checkpoint).await;
        let report = retain(job.store.as_ref(), &job.job_dir, 1).await.unwrap();
        assert_eq!(report.deleted, vec![2]);
        assert_eq!(report.orphans_deleted, vec![1]);
        let left: Vec<_> = futures::TryStreamExt::try_collect::<Vec<_>>(
            job.store
                .list(Some(&job.job_dir.clone().join("checkpoints"))),
        )
        .await
        .unwrap();
        assert!(
            left.iter().all(|m| m.location.as_ref().contains("chk-3")),
            "{left:?}"
        );
        job.taken.remove(&2);
        job.check_all().await;
    });
}

/// A run restored from one of the job's own checkpoints builds its next checkpoint on it, at
/// another parallelism too; one restored from a savepoint writes its first checkpoint in full.
#[test]
fn a_checkpoint_after_a_restore_builds_on_the_restored_checkpoint() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut job = Job::new("after-restore", 2);
        job.records(300, 0, 1);
        job.snapshot(SnapshotKind::Checkpoint).await;
        job.restart(3).await;
        job.records(2, 0, 1);
        job.snapshot(SnapshotKind::Checkpoint).await;
        let newest = |job: &Job, kind, id| {
            let dir = snapshot_dir(&job.job_dir, kind, id);
            let store = job.store.clone();
            async move { read_manifest(store.as_ref(), &dir).await.unwrap() }
        };
        let m = newest(&job, SnapshotKind::Checkpoint, 2).await;
        assert!(!m.is_self_contained(), "built on the restored checkpoint");
        assert!(m.stats.written_bytes.unwrap() * 10 < m.stats.total_bytes);
        job.check_all().await;
        job.snapshot(SnapshotKind::Savepoint).await;
        job.restart(2).await;
        job.records(2, 0, 1);
        job.snapshot(SnapshotKind::Checkpoint).await;
        let m = newest(&job, SnapshotKind::Checkpoint, 4).await;
        assert!(m.is_self_contained(), "restored from a savepoint: full");
        job.check_all().await;
    });
}

/// The savepoint tools on an incremental checkpoint: `inspect` and `dump` see every key once with
/// its current value, and `rewrite` reads through the references into a self-contained savepoint
/// (another key-group count) that restores the same state.
#[test]
fn the_savepoint_tools_read_an_incremental_checkpoint() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut job = Job::new("tools", 2);
        job.records(300, 0, 1);
        job.snapshot(SnapshotKind::Checkpoint).await;
        job.records(5, 10, 3);
        job.snapshot(SnapshotKind::Checkpoint).await;
        let url = format!("{}/ns/job/checkpoints/chk-2", job.url);
        let loc = keyshift::offline::open_location(&url).unwrap();
        let m = read_manifest(loc.store.as_ref(), &loc.dir).await.unwrap();
        assert!(!m.is_self_contained());
        let report = keyshift::offline::inspect::inspect(&loc, 5).await.unwrap();
        assert_eq!(report.total_keys, 300);
        let mut out = Vec::new();
        let summary = keyshift::offline::dump::dump(&loc, None, &mut out)
            .await
            .unwrap();
        assert_eq!(summary.keys, 300);
        let text = String::from_utf8(out).unwrap();
        let dumped: Model = text
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                (v["key"].to_string(), v["value"].as_i64().unwrap())
            })
            .collect();
        assert_eq!(dumped, job.model, "dump shows every key's current value");
        // Rewrite to 32 groups: a full savepoint with the same state.
        let target = format!("{}/ns/job/savepoints/sp-9", job.url);
        let mut opts = keyshift::offline::RewriteOptions::new(32);
        opts.temp_dir = Some(std::env::temp_dir());
        keyshift::offline::rewrite::rewrite(&url, &target, opts)
            .await
            .unwrap();
        let (store, dir, sp) = open_snapshot(&target).await.unwrap();
        assert!(sp.is_self_contained());
        assert_eq!(sp.max_parallelism, 32);
        let mut config32 = config();
        config32.max_parallelism = 32;
        let mut op = KeyedAggregator::new(config32, KeyGroupRange { start: 0, end: 31 }).unwrap();
        keyshift::runtime::restore::restore_state(
            &mut op,
            store.as_ref(),
            &dir,
            &sp,
            Default::default(),
        )
        .await
        .unwrap();
        assert_eq!(state_of(std::slice::from_ref(&op)), job.model);
    });
}

/// `verify_written` checks the files an incremental checkpoint wrote and none it refers to
/// (a pre-staged rescale's stop checkpoint, whose referenced blocks the new workers checked as
/// they loaded them): damage in a referenced file is left to `verify`, damage in its own files
/// is found.
#[test]
fn verify_written_checks_the_files_a_checkpoint_wrote_and_only_those() {
    use object_store::ObjectStoreExt;
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut job = Job::new("written", 2);
        job.records(300, 0, 1);
        job.snapshot(SnapshotKind::Checkpoint).await;
        job.records(5, 10, 3);
        job.snapshot(SnapshotKind::Checkpoint).await;
        let dir = snapshot_dir(&job.job_dir, SnapshotKind::Checkpoint, 2);
        let store = job.store.clone();
        let m = read_manifest(store.as_ref(), &dir).await.unwrap();
        assert!(!m.is_self_contained());
        let own = m
            .files
            .iter()
            .filter(|f| !is_referenced_file(&f.name))
            .count();
        let whole = verify(store.as_ref(), &dir).await.unwrap();
        let written = verify_written(store.as_ref(), &dir).await.unwrap();
        assert_eq!((whole.files, written.files), (m.files.len(), own));
        assert_eq!(written.bytes_checked, m.written_bytes());
        assert!(written.bytes_checked < whole.bytes_checked);
        // One byte of a file of checkpoint 1 that checkpoint 2 refers to.
        let flip = |store: Arc<dyn ObjectStore>, path: Path| async move {
            let mut bytes = store
                .get(&path)
                .await
                .unwrap()
                .bytes()
                .await
                .unwrap()
                .to_vec();
            bytes[0] ^= 0xff;
            store.put(&path, bytes.into()).await.unwrap();
        };
        let referenced = m
            .files
            .iter()
            .find(|f| is_referenced_file(&f.name))
            .unwrap();
        let path = referenced
            .name
            .split('/')
            .fold(job.job_dir.clone(), |p, part| p.join(part));
        flip(store.clone(), path).await;
        assert!(verify(store.as_ref(), &dir).await.is_err());
        verify_written(store.as_ref(), &dir).await.unwrap();
        let mine = m
            .files
            .iter()
            .find(|f| !is_referenced_file(&f.name) && f.size > 0)
            .unwrap();
        flip(store.clone(), dir.clone().join(mine.name.as_str())).await;
        let e = verify_written(store.as_ref(), &dir).await.unwrap_err();
        assert!(e.to_string().contains(&mine.name), "{e}");
    });
}
