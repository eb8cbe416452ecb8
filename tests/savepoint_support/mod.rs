//! Builds real snapshots for the savepoint-tool tests: the deterministic generator feeds one
//! `KeyedAggregator` per subtask (records routed to the owner of their key group, watermarks the
//! minimum over partitions), then every subtask's groups go through `SnapshotWriter`, the acks
//! through `Manifest::assemble`, and the manifest through `commit_manifest`.

#![allow(dead_code)]

use bytes::Bytes;
use jiff::Timestamp;
use keyshift::crd::{
    AggregateFunction, AggregationSpec, GeneratorSource, JobSpec, KeyDistribution, KeySpec,
    SourceSpec, WindowSpec,
};
use keyshift::job::{JobOptions, KeyedAggregator, StateValue, compile};
use keyshift::keygroup::{Assignment, Key, KeyType};
use keyshift::snapshot::*;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};

/// What job to run before snapshotting.
#[derive(Debug, Clone)]
pub struct JobShape {
    pub function: AggregateFunction,
    pub window: Option<&'static str>,
    pub key_type: KeyType,
    pub distribution: KeyDistribution,
    pub zipf_exponent: Option<f64>,
    pub keys: i64,
    pub partitions: i32,
    pub records_per_partition: u64,
    pub records_per_second: Option<i64>,
    pub payload: usize,
    pub max_parallelism: u32,
    pub parallelism: u32,
}

impl Default for JobShape {
    fn default() -> Self {
        JobShape {
            function: AggregateFunction::Count,
            window: None,
            key_type: KeyType::String,
            distribution: KeyDistribution::Uniform,
            zipf_exponent: None,
            keys: 3_000,
            partitions: 3,
            records_per_partition: 4_000,
            records_per_second: Some(200),
            payload: 16,
            max_parallelism: 128,
            parallelism: 4,
        }
    }
}

/// A committed snapshot and the state that went into it.
pub struct Built {
    pub url: String,
    pub manifest: Manifest,
    /// Every key's state, as the operators held it.
    pub state: HashMap<Key, StateValue>,
    pub shape: JobShape,
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A unique name for memory stores and directories.
pub fn unique(tag: &str) -> String {
    format!(
        "{tag}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

pub fn spec(shape: &JobShape) -> JobSpec {
    JobSpec {
        source: SourceSpec {
            generator: Some(GeneratorSource {
                partitions: shape.partitions,
                keys: shape.keys,
                seed: 11,
                distribution: shape.distribution,
                zipf_exponent: shape.zipf_exponent,
                records_per_second: shape.records_per_second,
                records_per_partition: Some(shape.records_per_partition as i64),
            }),
            file: None,
            kafka: None,
        },
        program: None,
        key: Some(KeySpec {
            field: "key".into(),
            key_type: shape.key_type,
        }),
        aggregation: Some(AggregationSpec {
            function: shape.function,
            field: Some("value".into()),
            combine: None,
        }),
        window: shape.window.map(|size| WindowSpec {
            size: size.into(),
            max_out_of_orderness: Some("1s".into()),
        }),
        sink: Default::default(),
    }
}

/// Runs the job to the end of its bounded partitions (without the final +inf watermark, so
/// windowed jobs keep open windows) and returns the operators, positions and watermark.
pub fn run_job(shape: &JobShape) -> (Vec<KeyedAggregator>, BTreeMap<u32, u64>, Option<i64>) {
    let options = JobOptions {
        state_payload_bytes: shape.payload,
    };
    let job = compile(&spec(shape), shape.max_parallelism, &options).unwrap();
    let assignment = Assignment::new(
        i64::from(shape.parallelism),
        i64::from(shape.max_parallelism),
    )
    .unwrap();
    let mut ops: Vec<KeyedAggregator> = assignment
        .ranges()
        .into_iter()
        .map(|r| job.new_aggregator(r).unwrap())
        .collect();
    let partitions = job.partitions();
    let mut positions: BTreeMap<u32, u64> = (0..partitions).map(|p| (p, 0)).collect();
    let mut wms: Vec<_> = (0..partitions).map(|_| job.partition_watermark()).collect();
    let mut buf = Vec::new();
    loop {
        let mut progressed = false;
        for p in 0..partitions {
            buf.clear();
            let pos = positions[&p];
            let batch = job.read(p, pos, &mut buf, 500).unwrap();
            positions.insert(p, batch.next_position);
            progressed |= batch.records > 0;
            for r in &buf {
                wms[p as usize].observe(r.ts);
                let owner = assignment.owner(r.key.key_group(shape.max_parallelism));
                ops[owner as usize].process(r).unwrap();
            }
        }
        let wm = wms.iter().map(|w| w.watermark()).min().unwrap();
        for op in &mut ops {
            op.advance_watermark(wm);
        }
        if !progressed {
            break;
        }
    }
    let wm = wms.iter().map(|w| w.watermark()).min().unwrap();
    let watermark = (wm != i64::MIN).then_some(wm);
    (ops, positions, watermark)
}

/// Every key's state held by the operators.
pub fn state_of(ops: &[KeyedAggregator]) -> HashMap<Key, StateValue> {
    let mut out = HashMap::new();
    for op in ops {
        for g in op.range().iter() {
            for (k, v) in op.group_entries(g) {
                assert!(out.insert(k.to_key(), v).is_none());
            }
        }
    }
    out
}

pub fn meta(kind: SnapshotKind, id: u64, completed_at: Timestamp) -> SnapshotMeta {
    SnapshotMeta {
        job: JobIdentity {
            namespace: "team-a".into(),
            name: "clicks".into(),
            job_fingerprint: "sha256:feed".into(),
            layout: None,
        },
        snapshot_id: id,
        kind,
        completed_at,
        state_schema: keyshift::job::AGG_SCHEMA.into(),
        source_positions: BTreeMap::new(),
        source_partitions: BTreeMap::new(),
        watermark: None,
    }
}

/// Writes the operators' state as a committed snapshot in `job_url`/{checkpoints,savepoints}/..
/// and returns its URL and manifest.
pub async fn write_snapshot(
    job_url: &str,
    kind: SnapshotKind,
    id: u64,
    completed_at: Timestamp,
    ops: &[KeyedAggregator],
    positions: &BTreeMap<u32, u64>,
    watermark: Option<i64>,
) -> (String, Manifest) {
    let (store, job_dir) = open_store(job_url).unwrap();
    let dir = snapshot_dir(&job_dir, kind, id);
    let p = ops.len() as u32;
    let max_p = ops[0].config().max_parallelism;
    let assignment = Assignment::new(i64::from(p), i64::from(max_p)).unwrap();
    let mut acks = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        let mut w = SnapshotWriter::new(store.clone(), &dir, assignment, i as u32).unwrap();
        for g in op.range().iter() {
            if op.group_key_count(g) == 0 {
                continue;
            }
            let (block, n) = op.encode_group(g).unwrap();
            w.write_group(g, Bytes::from(block), n).await.unwrap();
        }
        acks.push(w.finish().await.unwrap());
    }
    let mut m = meta(kind, id, completed_at);
    m.source_positions = positions.clone();
    m.watermark = watermark;
    let manifest = Manifest::assemble(m, assignment, acks).unwrap();
    commit_manifest(store.as_ref(), &dir, &manifest)
        .await
        .unwrap();
    let url = format!(
        "{}/{}/{}{id}",
        job_url.trim_end_matches('/'),
        kind.folder(),
        kind.dir_prefix()
    );
    (url, manifest)
}

/// Runs a job and commits its state as savepoint 1 under `job_url`.
pub async fn build(job_url: &str, shape: JobShape) -> Built {
    let (ops, positions, watermark) = run_job(&shape);
    let state = state_of(&ops);
    let (url, manifest) = write_snapshot(
        job_url,
        SnapshotKind::Savepoint,
        1,
        Timestamp::now(),
        &ops,
        &positions,
        watermark,
    )
    .await;
    Built {
        url,
        manifest,
        state,
        shape,
    }
}

/// A `file://` job URL in a fresh temp dir (kept alive by the returned guard).
pub fn file_job() -> (tempfile::TempDir, String) {
    let tmp = tempfile::tempdir().unwrap();
    let url = format!("file://{}/store/team-a/clicks", tmp.path().display());
    (tmp, url)
}

/// A `memory://` job URL unique to the caller.
pub fn memory_job() -> String {
    format!("memory://{}/keyshift/team-a/clicks", unique("sp-tools"))
}

/// The local path of a `file://` URL.
pub fn local(url: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(url.strip_prefix("file://").unwrap())
}
