//! The rewrite benchmark (`keyshift savepoint bench-rewrite`, hidden): rewrite throughput as a
//! ratio to a raw copy of the same state files, measured in the same run on the same disk.
//!
//! 1. Builds a savepoint on a local `file://` store from real state: the deterministic
//!    [`Generator`] (uniform string keys) feeds one [`KeyedAggregator`] per subtask (`count`, each
//!    key carrying `payload_bytes` of ballast via `state_payload_bytes`) until the state holds about
//!    `state_mib` MiB; the blocks go through [`SnapshotWriter`], [`Manifest::assemble`] and
//!    [`commit_manifest`]. The operators are dropped before anything is timed.
//! 2. Raw copy: `std::fs::copy` of every state file, then `fsync` of each copy and of the directory.
//! 3. Rewrite of the savepoint to a new key-group count (same parallelism), `file://` to `file://`,
//!    timed end to end (manifest committed, durable).
//! 4. Raw copy again; the round's ratio uses the mean of the two copies around its rewrite.
//! 5. The rewritten savepoint is fully verified (not timed) and removed.
//!
//! Steps 2-5 repeat `runs` times; the report gives every round and the medians.

use crate::crd::{AggregateFunction, GeneratorSource, KeyDistribution};
use crate::job::{AggConfig, Generator, KeyedAggregator};
use crate::offline::rewrite::{RewriteOptions, RewriteReport, rewrite};
use crate::offline::verify_keys;
use crate::offline::{Result, ToolError};
use crate::snapshot::{
    JobIdentity, Manifest, SnapshotKind, SnapshotMeta, SnapshotWriter, commit_manifest, open_store,
    snapshot_dir,
};
use bytes::Bytes;
use jiff::Timestamp;
use keyshift_core::keygroup::{Assignment, KeyType};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path as FsPath, PathBuf};
use std::time::Instant;

/// Options of the benchmark.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// State size to build, MiB.
    pub state_mib: u64,
    /// Ballast bytes per key.
    pub payload_bytes: usize,
    /// Key-group count of the built savepoint.
    pub from_max_parallelism: u32,
    /// Key-group count to rewrite to.
    pub to_max_parallelism: u32,
    /// Parallelism (state files).
    pub parallelism: u32,
    /// Working directory (a fresh one inside the system temp directory when `None`).
    pub dir: Option<PathBuf>,
    /// Keep the files afterwards.
    pub keep: bool,
    /// The rewrite's memory budget.
    pub memory_budget: usize,
    /// Copy/rewrite/copy rounds (the medians are reported).
    pub runs: usize,
}

/// The machine the benchmark ran on.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Machine {
    /// CPU model.
    pub cpu: String,
    /// Logical CPUs available.
    pub cpus: usize,
    /// Memory, GiB.
    pub memory_gib: f64,
    /// OS and architecture.
    pub os: String,
    /// `/proc/loadavg` when the timed part started (other work on the machine skews numbers).
    pub load_before: String,
    /// `/proc/loadavg` when it ended.
    pub load_after: String,
}

/// One copy / rewrite / copy round.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BenchRun {
    /// Seconds of the raw copy before the rewrite.
    pub copy_before_secs: f64,
    /// Seconds of the raw copy after it.
    pub copy_after_secs: f64,
    /// Raw copy throughput (mean of the two copies), MB/s.
    pub copy_mb_per_sec: f64,
    /// The rewrite.
    pub rewrite: RewriteReport,
    /// Rewrite throughput, MB/s of source state.
    pub rewrite_mb_per_sec: f64,
    /// Rewrite throughput over raw copy throughput.
    pub ratio: f64,
    /// The output verified (every block decoded, every key's group checked, key count equal).
    pub verified: bool,
}

/// The benchmark's numbers.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BenchReport {
    /// The machine.
    pub machine: Machine,
    /// State bytes (sum of the state files).
    pub state_bytes: u64,
    /// Keys in the state.
    pub keys: u64,
    /// Ballast bytes per key.
    pub payload_bytes: usize,
    /// State files.
    pub files: usize,
    /// Seconds to build and write the input savepoint (not part of the comparison).
    pub build_secs: f64,
    /// Every round.
    pub runs: Vec<BenchRun>,
    /// Median raw copy throughput, MB/s.
    pub copy_mb_per_sec: f64,
    /// Median rewrite throughput, MB/s of source state.
    pub rewrite_mb_per_sec: f64,
    /// Median rewrite throughput, keys/s.
    pub rewrite_keys_per_sec: f64,
    /// Median of the rounds' rewrite / raw copy ratios.
    pub ratio: f64,
    /// Every round's output verified.
    pub verified: bool,
    /// Where the files are (when kept).
    pub dir: String,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn machine() -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map_or_else(|| "unknown".to_owned(), |(_, v)| v.trim().to_owned());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let memory_kib: f64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    Machine {
        cpu,
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        memory_gib: memory_kib / (1024.0 * 1024.0),
        os: format!("{} {}", std::env::consts::OS, std::env::consts::ARCH),
        load_before: String::new(),
        load_after: String::new(),
    }
}

/// Builds the operators' state (blocking, CPU-bound).
fn build_state(
    opts: &BenchOptions,
    assignment: Assignment,
) -> Result<(Vec<KeyedAggregator>, BTreeMap<u32, u64>)> {
    // A key's entry: tag, length, "key-NNNNNNN", the count, payload length and payload.
    let per_key = opts.payload_bytes as u64 + 22;
    let target_keys = (opts.state_mib * 1024 * 1024 / per_key).max(1);
    let spec = GeneratorSource {
        partitions: 4,
        keys: (target_keys + target_keys / 2) as i64,
        seed: 1,
        distribution: KeyDistribution::Uniform,
        zipf_exponent: None,
        records_per_second: None,
        records_per_partition: None,
    };
    let generator =
        Generator::new(&spec, KeyType::String).map_err(|e| ToolError::Bench(e.to_string()))?;
    let config = AggConfig {
        function: AggregateFunction::Count,
        window_size_ms: None,
        max_parallelism: assignment.max_parallelism(),
        state_payload_bytes: opts.payload_bytes,
    };
    let mut ops = assignment
        .ranges()
        .into_iter()
        .map(|r| KeyedAggregator::new(config, r))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| ToolError::Bench(e.to_string()))?;
    let mut positions: BTreeMap<u32, u64> = (0..generator.partitions()).map(|p| (p, 0)).collect();
    let mut batch = Vec::with_capacity(1 << 13);
    let mut keys = 0u64;
    while keys < target_keys {
        for (&p, pos) in positions.iter_mut() {
            batch.clear();
            let n = generator.fill(p, *pos, &mut batch, 1 << 13);
            *pos += n as u64;
            for r in &batch {
                let owner = assignment.owner(r.key.key_group(assignment.max_parallelism()));
                ops[owner as usize]
                    .process(r)
                    .map_err(|e| ToolError::Bench(e.to_string()))?;
            }
        }
        keys = ops.iter().map(|o| o.key_count() as u64).sum();
    }
    Ok((ops, positions))
}

/// Copies the state files of `from` into `to` (created), fsyncing each copy and the directory.
fn raw_copy(manifest: &Manifest, from: &FsPath, to: &FsPath) -> Result<f64> {
    let started = Instant::now();
    std::fs::create_dir_all(to).map_err(ToolError::spill(to))?;
    for f in &manifest.files {
        let dst = to.join(&f.name);
        std::fs::copy(from.join(&f.name), &dst).map_err(ToolError::spill(&dst))?;
        std::fs::File::open(&dst)
            .and_then(|h| h.sync_all())
            .map_err(ToolError::spill(&dst))?;
    }
    std::fs::File::open(to)
        .and_then(|h| h.sync_all())
        .map_err(ToolError::spill(to))?;
    let secs = started.elapsed().as_secs_f64();
    std::fs::remove_dir_all(to).map_err(ToolError::spill(to))?;
    Ok(secs)
}

/// Runs the benchmark (see the module docs).
pub async fn bench_rewrite(opts: BenchOptions) -> Result<BenchReport> {
    let base = match &opts.dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!(
            "keyshift-bench-rewrite-{}-{}",
            std::process::id(),
            Timestamp::now().as_microsecond()
        )),
    };
    std::fs::create_dir_all(&base).map_err(ToolError::spill(&base))?;
    let store_root = base.join("store");
    if store_root.exists() {
        return Err(ToolError::Bench(format!(
            "{} exists (a previous run kept with --keep?): pass an empty --dir",
            store_root.display()
        )));
    }
    let store_url = format!("file://{}", store_root.display());
    let (store, prefix) = open_store(&store_url)?;
    let job = crate::snapshot::job_dir(&prefix, "bench", "rewrite");
    let source_dir = snapshot_dir(&job, SnapshotKind::Savepoint, 1);
    let from = Assignment::new(
        i64::from(opts.parallelism),
        i64::from(opts.from_max_parallelism),
    )
    .map_err(|e| ToolError::Bench(e.to_string()))?;

    // 1. Build and write the input savepoint.
    let build_started = Instant::now();
    let o = opts.clone();
    let (ops, positions) = crate::offline::blocking(move || build_state(&o, from)).await??;
    let mut acks = Vec::new();
    for (s, op) in ops.iter().enumerate() {
        let mut w = SnapshotWriter::new(store.clone(), &source_dir, from, s as u32)?;
        for g in op.range().iter() {
            if op.group_key_count(g) == 0 {
                continue;
            }
            let (block, n) = op
                .encode_group(g)
                .map_err(|e| ToolError::Bench(e.to_string()))?;
            w.write_group(g, Bytes::from(block), n).await?;
        }
        acks.push(w.finish().await?);
    }
    drop(ops);
    let meta = SnapshotMeta {
        job: JobIdentity {
            namespace: "bench".into(),
            name: "rewrite".into(),
            job_fingerprint: "bench".into(),
            layout: None,
        },
        snapshot_id: 1,
        kind: SnapshotKind::Savepoint,
        completed_at: Timestamp::now(),
        state_schema: crate::job::AGG_SCHEMA.to_owned(),
        source_positions: positions,
        source_partitions: Default::default(),
        watermark: None,
    };
    let manifest = Manifest::assemble(meta, from, acks)?;
    commit_manifest(store.as_ref(), &source_dir, &manifest).await?;
    let build_secs = build_started.elapsed().as_secs_f64();

    let source_fs = store_root.join(source_dir.as_ref());
    let copy_fs = base.join("copy");
    let source_url = format!("{store_url}/bench/rewrite/savepoints/sp-1");
    let copy = |m: Manifest| {
        let (s, c) = (source_fs.clone(), copy_fs.clone());
        crate::offline::blocking(move || raw_copy(&m, &s, &c))
    };

    // 2-5. Rounds of copy, rewrite, copy; each output verified, then removed.
    let mut machine = machine();
    machine.load_before = load_average();
    let mut runs = Vec::new();
    for i in 0..opts.runs.max(1) {
        let copy_before_secs = copy(manifest.clone()).await??;
        let target_url = format!("{store_url}/bench/rewrite/savepoints/sp-{}", 2 + i);
        let mut ropts = RewriteOptions::new(opts.to_max_parallelism);
        ropts.memory_budget = opts.memory_budget;
        ropts.temp_dir = Some(base.join("tmp"));
        let rewrite = rewrite(&source_url, &target_url, ropts).await?;
        let copy_after_secs = copy(manifest.clone()).await??;
        let outcome = verify_keys(&crate::offline::open_location(&target_url)?).await?;
        let verified = outcome.ok() && outcome.keys_checked == manifest.stats.total_keys;
        if !opts.keep {
            let target_fs = store_root.join(format!("bench/rewrite/savepoints/sp-{}", 2 + i));
            std::fs::remove_dir_all(&target_fs).map_err(ToolError::spill(&target_fs))?;
        }
        let copy_mb_per_sec = manifest.stats.total_bytes as f64
            / 1e6
            / ((copy_before_secs + copy_after_secs) / 2.0).max(1e-9);
        let rewrite_mb_per_sec = rewrite.mb_per_sec();
        runs.push(BenchRun {
            copy_before_secs,
            copy_after_secs,
            copy_mb_per_sec,
            ratio: rewrite_mb_per_sec / copy_mb_per_sec.max(1e-9),
            rewrite_mb_per_sec,
            rewrite,
            verified,
        });
    }
    machine.load_after = load_average();
    let out = BenchReport {
        machine,
        state_bytes: manifest.stats.total_bytes,
        keys: manifest.stats.total_keys,
        payload_bytes: opts.payload_bytes,
        files: manifest.files.len(),
        build_secs,
        copy_mb_per_sec: median(runs.iter().map(|r| r.copy_mb_per_sec).collect()),
        rewrite_mb_per_sec: median(runs.iter().map(|r| r.rewrite_mb_per_sec).collect()),
        rewrite_keys_per_sec: median(runs.iter().map(|r| r.rewrite.keys_per_sec()).collect()),
        ratio: median(runs.iter().map(|r| r.ratio).collect()),
        verified: runs.iter().all(|r| r.verified),
        runs,
        dir: base.display().to_string(),
    };
    if !opts.keep {
        std::fs::remove_dir_all(&base).map_err(ToolError::spill(&base))?;
    }
    Ok(out)
}
