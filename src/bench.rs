//! `keyshift bench ...`: benchmarks of the runtime, each reported as a ratio to a raw baseline
//! measured in the same run on the same machine, so a shared or noisy machine affects both sides.
//!
//! * `snapshot`: write and restore-read throughput of keyed state on `file://` against a raw
//!   sequential write with fsync and a raw read of the same bytes.
//! * `rescale`: the pause of a `LocalJob` rescale (worker processes) against a raw write + read of
//!   the state's bytes.
//! * `throughput`: steady-state records/s of a keyed count through `LocalJob`, and the workers'
//!   peak memory.
//! * `checkpoint`: bytes an incremental checkpoint writes after a share of the keys changed,
//!   against the full one before it, and how long its cut holds records up against its write.
//!
//! Results and how to reproduce them: `docs/benchmarks.md`. Build with `--release`.

use crate::crd::{AggregateFunction, StreamJob};
use crate::job::{AggConfig, KeyedAggregator, Record, RecordKey};
use crate::local::LocalJob;
use crate::runtime::checkpoint::{self, StateWriteOptions, Updates};
use crate::runtime::restore::{self, RestoreOptions};
use crate::snapshot::{self, JobIdentity, Manifest, SnapshotKind, SnapshotMeta, SnapshotWriter};
use anyhow::{Context as _, Result, bail};
use bytes::Bytes;
use clap::{Args, Subcommand};
use keyshift_core::keygroup::Assignment;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One subtask's encoded blocks: `(group, block, entries)` in group order.
type Blocks = Arc<Vec<(u32, Bytes, u64)>>;

/// Bytes of state per key the benchmarks aim at (1 GiB is about 2.7M keys).
const BYTES_PER_KEY: u64 = 400;

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub command: BenchCommand,
}

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Snapshot write and restore-read throughput on file://, as ratios to a raw sequential
    /// write with fsync and a raw read of the same bytes.
    Snapshot(SnapshotBench),
    /// Rescale pause of a job with large keyed state (worker processes), as a ratio to a raw
    /// write + read of the state's bytes.
    Rescale(RescaleBench),
    /// Steady-state keyed-count throughput through worker processes, and peak memory.
    Throughput(ThroughputBench),
    /// Incremental checkpoints: bytes an incremental checkpoint writes after a share of the keys
    /// changed, against a full one, and how long its cut holds records up against its write.
    Checkpoint(CheckpointBench),
    /// The operator on a real API server: many StreamJobs (memory, reconcile latency, idle
    /// CPU) and `kubectl scale` with large state (src/bench_operator.rs).
    Operator(crate::bench_operator::OperatorBench),
    /// Kafka -> keyed count -> Kafka (exactly once) records/s against the broker's own
    /// producer and consumer perf tools, and the rescale pause with a Kafka source
    /// (src/bench_kafka.rs; needs the `kafka` feature and a broker).
    #[cfg(feature = "kafka")]
    Kafka(crate::bench_kafka::KafkaBench),
}

#[derive(Args, Debug)]
pub struct SnapshotBench {
    /// State size in MiB (about 400 bytes per key).
    #[arg(long, default_value_t = 1024)]
    pub state_mib: u64,
    /// Directory for the files (a local filesystem; created if missing, emptied afterwards).
    #[arg(long, default_value = "keyshift-bench")]
    pub dir: PathBuf,
    /// Key groups.
    #[arg(long, default_value_t = 128)]
    pub max_parallelism: u32,
    /// Subtasks writing (one state file each, written concurrently).
    #[arg(long, default_value_t = 1)]
    pub parallelism: u32,
    /// Opaque bytes of state per key besides the key and the accumulator.
    #[arg(long, default_value_t = 360)]
    pub payload: usize,
    /// Rounds; each measurement keeps its best round.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Threads encoding one subtask's groups (default: what a worker uses,
    /// KEYSHIFT_ENCODE_THREADS or 1).
    #[arg(long)]
    pub encode_threads: Option<usize>,
}

#[derive(Args, Debug)]
pub struct RescaleBench {
    /// State size in MiB (about 400 bytes per key).
    #[arg(long, default_value_t = 1024)]
    pub state_mib: u64,
    /// Parallelism the job runs at before the rescale.
    #[arg(long, default_value_t = 4)]
    pub from: u32,
    /// Parallelism after the rescale.
    #[arg(long, default_value_t = 8)]
    pub to: u32,
    /// Key groups.
    #[arg(long, default_value_t = 128)]
    pub max_parallelism: u32,
    /// Directory for snapshots and worker logs (created if missing, emptied afterwards).
    #[arg(long, default_value = "keyshift-bench")]
    pub dir: PathBuf,
    /// Opaque bytes of state per key besides the key and the accumulator.
    #[arg(long, default_value_t = 360)]
    pub payload: usize,
    /// Source partitions (default: the larger parallelism).
    #[arg(long)]
    pub partitions: Option<u32>,
    /// Records generated per key (default: ln(keys) + 2, so that every key is touched: the
    /// expected number of untouched keys is e^-2).
    #[arg(long)]
    pub records_per_key: Option<f64>,
    /// Rounds of the raw baseline (best kept).
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Keep the snapshots and worker logs.
    #[arg(long)]
    pub keep: bool,
    /// Also write the rescale's steps, their seconds and the raw baseline as JSON to this file
    /// (the data of the timeline picture, `docs/data/rescale-timeline.json`).
    #[arg(long)]
    pub record: Option<PathBuf>,
    /// Change the key-group count to this in the same transition (savepoint, verify, stop,
    /// rewrite, verify the rewrite, restore), as a change of spec.maxParallelism does.
    #[arg(long)]
    pub to_max_parallelism: Option<u32>,
    /// The rewrite's memory budget, MiB (with --to-max-parallelism).
    #[arg(long, default_value_t = 256)]
    pub rewrite_memory_mib: usize,
    /// A pre-staged rescale: once the state is built, the job runs on under a steady load
    /// (--load-percent), checkpoints, the new workers load the newest checkpoint beside the
    /// old ones, and the old ones stop with a delta checkpoint. The pause is measured from the
    /// stop checkpoint's trigger (the old job processes nothing after its barrier) to the first
    /// record processed by every new subtask.
    #[arg(long, conflicts_with = "to_max_parallelism")]
    pub prestage: bool,
    /// With --prestage: percent of the keys updated per second by the steady load.
    #[arg(long, default_value_t = 1.0)]
    pub load_percent: f64,
    /// With --prestage: seconds of steady load between the checkpoint the new workers load and
    /// the start of the pre-stage.
    #[arg(long, default_value_t = 2.0)]
    pub settle_secs: f64,
}

/// What a pre-staged rescale measured besides its report.
struct PrestageNumbers {
    /// Stop checkpoint trigger to the first record processed by every new subtask.
    pause_to_first_record: Duration,
    /// Keys updated per second by the steady load.
    load_records_per_second: u64,
    /// Resident memory of the old workers in steady state, KiB.
    steady_rss_kib: u64,
    /// Old workers' resident memory plus the new workers' peak, once pre-staged, KiB.
    prestaged_rss_kib: u64,
    /// The old workers' part of `prestaged_rss_kib` (their resident memory then), KiB.
    old_rss_kib: u64,
    /// Private memory ([`private_kib`]) of the old workers in steady state, KiB.
    steady_private_kib: u64,
    /// Peak private memory of all the workers, old and new, while pre-staged, KiB
    /// ([`ChildrenPeak`]).
    prestaged_private_kib: u64,
    /// Seconds from the loaded checkpoint's commit to the stop checkpoint's trigger.
    since_checkpoint: Duration,
}

#[derive(Args, Debug)]
pub struct CheckpointBench {
    /// State size in MiB (about 400 bytes per key).
    #[arg(long, default_value_t = 1024)]
    pub state_mib: u64,
    /// Percent of the keys changed between checkpoints (spread over every key group).
    #[arg(long, default_value_t = 1.0)]
    pub changed_percent: f64,
    /// Subtasks (one state file each, written concurrently, like a job's workers).
    #[arg(long, default_value_t = 4)]
    pub parallelism: u32,
    /// Key groups.
    #[arg(long, default_value_t = 128)]
    pub max_parallelism: u32,
    /// Opaque bytes of state per key besides the key and the accumulator.
    #[arg(long, default_value_t = 360)]
    pub payload: usize,
    /// Incremental checkpoints measured (each after its own changes).
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Drain no results at the barriers (a windowed job, or no sink): the cut only copies the
    /// state. By default the changed keys' results are drained and kept, as for the
    /// object-store sink.
    #[arg(long)]
    pub no_results: bool,
    /// Directory for the files (a local filesystem; created if missing, emptied afterwards).
    #[arg(long, default_value = "keyshift-bench")]
    pub dir: PathBuf,
}

#[derive(Args, Debug)]
pub struct ThroughputBench {
    /// Distinct keys (comma-separated for several runs).
    #[arg(long, value_delimiter = ',', default_value = "100000")]
    pub keys: Vec<u64>,
    /// Parallelism (comma-separated for several runs): 1 uses the local channel only, 2 or more
    /// the loopback TCP shuffle.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub parallelism: Vec<u32>,
    /// Source partitions (at least the parallelism).
    #[arg(long, default_value_t = 4)]
    pub partitions: u32,
    /// Key type: string ("key-<i>") or long.
    #[arg(long, default_value = "string")]
    pub key_type: String,
    /// Seconds before measuring (state fills, caches warm).
    #[arg(long, default_value_t = 5)]
    pub warmup: u64,
    /// Seconds measured.
    #[arg(long, default_value_t = 15)]
    pub seconds: u64,
    /// Directory for worker logs (created if missing, emptied afterwards).
    #[arg(long, default_value = "keyshift-bench")]
    pub dir: PathBuf,
}

/// Runs a benchmark (blocking; starts its own async runtime).
pub fn run(args: BenchArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        match args.command {
            BenchCommand::Snapshot(a) => snapshot_bench(a).await,
            BenchCommand::Rescale(a) => rescale_bench(a).await,
            BenchCommand::Throughput(a) => throughput_bench(a).await,
            BenchCommand::Checkpoint(a) => checkpoint_bench(a).await,
            BenchCommand::Operator(a) => crate::bench_operator::run(a).await,
            #[cfg(feature = "kafka")]
            BenchCommand::Kafka(a) => crate::bench_kafka::run(a).await,
        }
    })
}

// ---------------------------------------------------------------------------------------------
// checkpoint

/// What one subtask's checkpoint took: how long it held records up (the cut), its whole write
/// (cut + upload, durable), and its acknowledgement.
struct SubtaskCheckpoint {
    held: Duration,
    /// CPU time of the cut (the thread that took it).
    held_cpu: Duration,
    /// The longest step copying changed keys after the barrier (records wait for one step).
    step_max: Duration,
    /// The most CPU time of one such step.
    step_cpu_max: Duration,
    write: Duration,
    ack: snapshot::SubtaskSnapshot,
    cut: u32,
}

/// One subtask's checkpoint as a worker takes it: the cut (records held up), then the
/// upload while records could flow; in whole groups without a base, as a delta over `base`
/// with one.
async fn checkpoint_subtask(
    store: Arc<dyn snapshot::ObjectStore>,
    dir: snapshot::Path,
    assignment: Assignment,
    subtask: u32,
    agg: SharedAgg,
    base: Option<crate::runtime::incremental::Base>,
    updates: Updates,
) -> Result<SubtaskCheckpoint> {
    let writer = SnapshotWriter::new(store.clone(), &dir, assignment, subtask)?;
    let mut agg = agg.lock().await;
    let started = Instant::now();
    let cpu0 = thread_cpu();
    let cut = agg.cut();
    let policy = crate::runtime::incremental::ChainPolicy::default();
    let mut taken = checkpoint::take_cut(&mut agg, base.as_ref(), updates, true).await;
    let held = started.elapsed();
    let held_cpu = thread_cpu().saturating_sub(cpu0);
    // The changed keys still to copy, a step at a time as a worker does between batches.
    let (mut step_max, mut step_cpu_max) = (Duration::ZERO, Duration::ZERO);
    loop {
        let (t, cpu) = (Instant::now(), thread_cpu());
        let done = agg.capture_step(crate::runtime::worker::CAPTURE_STEP_KEYS);
        step_max = step_max.max(t.elapsed());
        step_cpu_max = step_cpu_max.max(thread_cpu().saturating_sub(cpu));
        if done {
            break;
        }
        tokio::task::yield_now().await;
    }
    checkpoint::finish_cut(&mut agg, &mut taken).await;
    drop(agg);
    let ack = checkpoint::upload_cut(
        taken.groups,
        writer,
        base.as_ref(),
        policy,
        store.as_ref(),
        &dir,
    )
    .await?;
    Ok(SubtaskCheckpoint {
        held,
        held_cpu,
        step_max,
        step_cpu_max,
        write: started.elapsed(),
        ack,
        cut,
    })
}

async fn checkpoint_bench(args: CheckpointBench) -> Result<()> {
    use crate::runtime::incremental::Base;
    let ctx_start = context_line();
    let run = prepare_dir(&args.dir, "checkpoint")?;
    let root = run.join("store");
    let (store, base) = snapshot::open_store(&format!("file://{}", root.display()))?;
    let job = snapshot::job_dir(&base, "bench", "checkpoint");
    let assignment = Assignment::new(i64::from(args.parallelism), i64::from(args.max_parallelism))?;
    let keys = keys_for(args.state_mib);
    // Every `stride`-th key changes, shifted each round: spread over every key group.
    let stride = (100.0 / args.changed_percent.clamp(0.001, 100.0))
        .round()
        .max(1.0) as u64;
    println!(
        "keyshift bench checkpoint: {} MiB target, {keys} string keys x {} B payload, {} key groups, {} subtasks, 1 key in {stride} changed between checkpoints, {} rounds, in {}",
        args.state_mib,
        args.payload,
        args.max_parallelism,
        args.parallelism,
        args.rounds,
        run.display()
    );
    println!("machine: {ctx_start}");
    let config = AggConfig {
        function: AggregateFunction::Count,
        window_size_ms: None,
        max_parallelism: args.max_parallelism,
        state_payload_bytes: args.payload,
    };
    let mut aggs = (0..args.parallelism)
        .map(|i| KeyedAggregator::new(config, assignment.range(i)))
        .collect::<Result<Vec<_>, _>>()?;
    let t = Instant::now();
    let touch = |aggs: &mut [KeyedAggregator], i: u64| -> Result<()> {
        let key = string_key(i);
        let owner = assignment.owner(key.key_group(args.max_parallelism)) as usize;
        aggs[owner].process(&Record {
            key,
            value: 1,
            ts: 0,
        })?;
        Ok(())
    };
    for i in 0..keys {
        touch(&mut aggs, i)?;
    }
    println!("state built in {}", secs(t.elapsed()));
    let aggs: Vec<SharedAgg> = aggs
        .into_iter()
        .map(|a| Arc::new(tokio::sync::Mutex::new(a)))
        .collect();

    let handle = tokio::runtime::Handle::current();
    let mut bases: Vec<Option<Base>> = vec![None; args.parallelism as usize];
    let mut rows = Vec::new();
    for round in 0..=args.rounds {
        let id = u64::from(round) + 1;
        if round > 0 {
            let mut locked = Vec::new();
            for a in &aggs {
                locked.push(a.lock().await);
            }
            let mut changed = 0u64;
            for i in (u64::from(round) % stride..keys).step_by(stride as usize) {
                let key = string_key(i);
                let owner = assignment.owner(key.key_group(args.max_parallelism)) as usize;
                locked[owner].process(&Record {
                    key,
                    value: 1,
                    ts: 0,
                })?;
                changed += 1;
            }
            drop(locked);
            println!("round {round}: {changed} keys changed");
        }
        let dir = snapshot::snapshot_dir(&job, SnapshotKind::Checkpoint, id);
        let started = Instant::now();
        let tasks: Vec<_> = (0..args.parallelism)
            .map(|i| {
                let task = checkpoint_subtask(
                    store.clone(),
                    dir.clone(),
                    assignment,
                    i,
                    aggs[i as usize].clone(),
                    bases[i as usize].clone(),
                    if args.no_results {
                        Updates::Skip
                    } else {
                        Updates::Keep
                    },
                );
                let handle = handle.clone();
                tokio::task::spawn_blocking(move || handle.block_on(task))
            })
            .collect();
        let mut done = Vec::new();
        for t in tasks {
            done.push(t.await??);
        }
        let wall = started.elapsed();
        let held = done.iter().map(|d| d.held).max().unwrap_or_default();
        let held_cpu = done.iter().map(|d| d.held_cpu).max().unwrap_or_default();
        let step_max = done.iter().map(|d| d.step_max).max().unwrap_or_default();
        let step_cpu_max = done
            .iter()
            .map(|d| d.step_cpu_max)
            .max()
            .unwrap_or_default();
        let write = done.iter().map(|d| d.write).max().unwrap_or_default();
        for (i, d) in done.iter().enumerate() {
            bases[i] = Some(Base::written(id, d.cut, &d.ack));
        }
        let manifest = Manifest::assemble(
            meta(id),
            assignment,
            done.into_iter().map(|d| d.ack).collect(),
        )?;
        snapshot::commit_manifest(store.as_ref(), &dir, &manifest).await?;
        let written = manifest
            .stats
            .written_bytes
            .unwrap_or(manifest.stats.total_bytes);
        println!(
            "checkpoint {id} ({}): wrote {written} of {} bytes of state ({:.2}%), records held up {:.1} ms (cut CPU {:.1} ms; then steps of up to {:.2} ms, CPU {:.2} ms) of a {:.1} ms write ({:.1}%), {:.1} ms in all",
            if round == 0 { "full" } else { "incremental" },
            manifest.stats.total_bytes,
            100.0 * written as f64 / manifest.stats.total_bytes.max(1) as f64,
            held.as_secs_f64() * 1e3,
            held_cpu.as_secs_f64() * 1e3,
            step_max.as_secs_f64() * 1e3,
            step_cpu_max.as_secs_f64() * 1e3,
            write.as_secs_f64() * 1e3,
            100.0 * held.as_secs_f64() / write.as_secs_f64().max(1e-9),
            wall.as_secs_f64() * 1e3,
        );
        rows.push((written, manifest.stats.total_bytes, held, write));
        // Every checkpoint restores the state: the last one is read back below.
        if round == args.rounds {
            let report = snapshot::verify(store.as_ref(), &dir).await?;
            let t = Instant::now();
            let manifest = Arc::new(manifest);
            let mut restored = 0u64;
            for i in 0..args.parallelism {
                let mut agg = KeyedAggregator::new(config, assignment.range(i))?;
                let r = restore::restore_state(
                    &mut agg,
                    store.as_ref(),
                    &dir,
                    &manifest,
                    RestoreOptions::default(),
                )
                .await?;
                let expect = aggs[i as usize].lock().await.results();
                if agg.results() != expect {
                    bail!("subtask {i}: the restored state differs from the state checkpointed");
                }
                restored += r.bytes_read;
            }
            println!(
                "checkpoint {id} verified ({} bytes checked) and restored exactly: {restored} bytes read in {} (state {} bytes)",
                report.bytes_checked,
                secs(t.elapsed()),
                manifest.stats.total_bytes
            );
        }
    }
    let full = rows.first().map_or(1, |r| r.0).max(1);
    let incr: Vec<_> = rows.iter().skip(1).collect();
    if let (Some(worst_bytes), Some(worst_hold)) = (
        incr.iter().map(|r| r.0).max(),
        incr.iter()
            .map(|r| r.2.as_secs_f64() / r.3.as_secs_f64().max(1e-9))
            .max_by(f64::total_cmp),
    ) {
        println!(
            "summary: incremental checkpoint writes {:.2}% of a full one (worst of {} rounds; target <= 5%); records held up {:.1}% of its write time (worst; target <= 10%); the full checkpoint held records {:.1} ms of its {:.1} ms write ({:.1}%)",
            100.0 * worst_bytes as f64 / full as f64,
            incr.len(),
            100.0 * worst_hold,
            rows[0].2.as_secs_f64() * 1e3,
            rows[0].3.as_secs_f64() * 1e3,
            100.0 * rows[0].2.as_secs_f64() / rows[0].3.as_secs_f64().max(1e-9)
        );
    }
    std::fs::remove_dir_all(&run)?;
    println!("machine after: {}", context_line());
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Machine context and raw baselines

pub(crate) fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

pub(crate) fn context_line() -> String {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "?".into());
    let build = if cfg!(debug_assertions) {
        "DEBUG build: numbers are not meaningful, use --release"
    } else {
        "release build"
    };
    format!(
        "{cpus} cpus, linux {kernel}, load average {} (1/5/15 min), {build}",
        loadavg()
    )
}

/// Bytes this process read from and wrote to storage so far (`/proc/self/io`): shows whether a
/// read came from the page cache.
fn proc_io() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/self/io").unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    (field("read_bytes:"), field("write_bytes:"))
}

/// Asks the kernel to drop a file's (clean) pages from the page cache, so the next read comes
/// from the device. Works without privileges on Linux for files already fsynced; elsewhere it
/// is a no-op and reads stay warm.
fn drop_cached(path: &Path) -> bool {
    let Ok(f) = std::fs::File::open(path) else {
        return false;
    };
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: posix_fadvise only takes a descriptor we own and plain integers.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        drop(f);
        false
    }
}

fn fsync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// CPU time of the calling thread so far (zero if the clock cannot be read).
fn thread_cpu() -> Duration {
    // SAFETY: clock_gettime fills the struct we pass; an all-zero timespec is a valid value.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// CPU time (user + system) of this process so far, all threads (the I/O threads too).
fn process_cpu() -> Duration {
    // SAFETY: getrusage fills the struct we pass; an all-zero rusage is a valid value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return Duration::ZERO;
    }
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Wall-clock and CPU time of one measurement. On a loaded machine the wall time stretches with
/// the share of the CPUs the process gets; the CPU time much less.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Sample {
    pub(crate) wall: Duration,
    pub(crate) cpu: Duration,
}

struct Meter(Instant, Duration);

impl Meter {
    fn start() -> Self {
        Meter(Instant::now(), process_cpu())
    }
    fn stop(&self) -> Sample {
        Sample {
            wall: self.0.elapsed(),
            cpu: process_cpu().saturating_sub(self.1),
        }
    }
}

/// Raw baseline write: one file, sequential writes of the given chunks, fsync of the file and
/// its directory (what a durable snapshot file needs at least).
pub(crate) fn raw_write(path: &Path, chunks: &[Bytes]) -> Result<Sample> {
    let t = Meter::start();
    let mut f = std::fs::File::create(path).with_context(|| format!("{}", path.display()))?;
    for c in chunks {
        f.write_all(c)?;
    }
    f.sync_all()?;
    drop(f);
    if let Some(dir) = path.parent() {
        fsync_dir(dir)?;
    }
    Ok(t.stop())
}

/// Raw baseline read: the whole file into one buffer (like `std::fs::read`).
pub(crate) fn raw_read(path: &Path, expect: u64) -> Result<Sample> {
    let t = Meter::start();
    let mut f = std::fs::File::open(path).with_context(|| format!("{}", path.display()))?;
    let mut buf = Vec::with_capacity(expect as usize);
    f.read_to_end(&mut buf)?;
    let took = t.stop();
    if buf.len() as u64 != expect {
        bail!(
            "{} holds {} bytes, expected {expect}",
            path.display(),
            buf.len()
        );
    }
    std::hint::black_box(&buf);
    Ok(took)
}

/// `n` bytes of incompressible filler in 8 MiB chunks (shared buffer).
pub(crate) fn filler(n: u64) -> Vec<Bytes> {
    const CHUNK: usize = 8 << 20;
    let mut s = 0x1234_5678_9abc_def0u64;
    let mut buf = Vec::with_capacity(CHUNK);
    while buf.len() < CHUNK {
        s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        buf.extend_from_slice(&crate::job::generator::splitmix64(s).to_le_bytes());
    }
    let chunk = Bytes::from(buf);
    let mut out = Vec::new();
    let mut left = n as usize;
    while left > 0 {
        let k = left.min(CHUNK);
        out.push(chunk.slice(..k));
        left -= k;
    }
    out
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 20)
}

fn mibps(bytes: u64, d: Duration) -> f64 {
    mib(bytes) / d.as_secs_f64().max(1e-9)
}

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

fn keys_for(state_mib: u64) -> u64 {
    ((state_mib << 20) / BYTES_PER_KEY).max(1)
}

fn prepare_dir(dir: &Path, name: &str) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let abs = std::fs::canonicalize(dir)?;
    let run = abs.join(format!("{name}-{}", std::process::id()));
    if run.exists() {
        std::fs::remove_dir_all(&run)?;
    }
    std::fs::create_dir_all(&run)?;
    Ok(run)
}

/// Keeps the best (shortest wall time) sample of each measurement over rounds.
#[derive(Default)]
struct Best(Option<Sample>);

impl Best {
    fn add(&mut self, s: Sample) {
        if self.0.is_none_or(|b| s.wall < b.wall) {
            self.0 = Some(s);
        }
    }
    fn get(&self) -> Duration {
        self.0.unwrap_or_default().wall
    }
    fn cpu(&self) -> Duration {
        self.0.unwrap_or_default().cpu
    }
}

// ---------------------------------------------------------------------------------------------
// snapshot

fn string_key(i: u64) -> RecordKey {
    RecordKey::string(format!("key-{i}"))
}

fn meta(id: u64) -> SnapshotMeta {
    SnapshotMeta {
        job: JobIdentity {
            namespace: "bench".into(),
            name: "snapshot".into(),
            job_fingerprint: "bench".into(),
            layout: None,
        },
        snapshot_id: id,
        kind: SnapshotKind::Checkpoint,
        completed_at: chrono::Utc::now(),
        state_schema: crate::job::AGG_SCHEMA.into(),
        source_positions: Default::default(),
        source_partitions: Default::default(),
        watermark: None,
    }
}

/// A subtask's operator, shared with the task that snapshots it.
type SharedAgg = Arc<tokio::sync::Mutex<KeyedAggregator>>;

/// How [`write_subtask`] writes: the worker's path (its encoder threads, draining the changed
/// keys' results or not), or blocks encoded beforehand (the snapshot layer alone).
#[derive(Clone)]
enum WritePath {
    Worker(StateWriteOptions),
    PreEncoded(Vec<Blocks>),
}

/// The worker's snapshot path for one subtask (`checkpoint::write_state`: encode, write, finish
/// = durable), or the write alone of pre-encoded blocks.
async fn write_subtask(
    store: Arc<dyn snapshot::ObjectStore>,
    dir: snapshot::Path,
    assignment: Assignment,
    subtask: u32,
    agg: SharedAgg,
    path: WritePath,
) -> Result<(snapshot::SubtaskSnapshot, u64)> {
    let mut w = SnapshotWriter::new(store, &dir, assignment, subtask)?;
    match path {
        WritePath::PreEncoded(blocks) => {
            for (g, b, n) in blocks[subtask as usize].iter() {
                w.write_group(*g, b.clone(), *n).await?;
            }
            Ok((w.finish().await?, 0))
        }
        WritePath::Worker(opts) => {
            let mut agg = agg.lock().await;
            let written = checkpoint::write_state(&mut agg, w, opts)
                .await
                .map_err(|f| f.error)?;
            Ok((written.snapshot, written.rows))
        }
    }
}

async fn write_snapshot(
    store: &Arc<dyn snapshot::ObjectStore>,
    job: &snapshot::Path,
    id: u64,
    assignment: Assignment,
    aggs: &[SharedAgg],
    path: WritePath,
) -> Result<(Sample, snapshot::Path, Manifest, u64)> {
    let dir = snapshot::snapshot_dir(job, SnapshotKind::Checkpoint, id);
    let started = Meter::start();
    // Each subtask writes from a thread of its own, outside the runtime's worker threads, as a
    // worker's keyed operator does (`start_subtask`): a task that the write spawns (a part
    // upload) then runs at once on a runtime thread, instead of waiting in the LIFO slot of a
    // worker thread that the encoder keeps busy.
    let handle = tokio::runtime::Handle::current();
    let tasks: Vec<_> = (0..assignment.parallelism())
        .map(|i| {
            let write = write_subtask(
                store.clone(),
                dir.clone(),
                assignment,
                i,
                aggs[i as usize].clone(),
                path.clone(),
            );
            let handle = handle.clone();
            tokio::task::spawn_blocking(move || handle.block_on(write))
        })
        .collect();
    let mut acks = Vec::new();
    let mut rows = 0;
    for task in tasks {
        let (ack, r) = task.await??;
        acks.push(ack);
        rows += r;
    }
    let manifest = Manifest::assemble(meta(id), assignment, acks)?;
    snapshot::commit_manifest(store.as_ref(), &dir, &manifest).await?;
    Ok((started.stop(), dir, manifest, rows))
}

/// Every subtask's restore read (range reads of its groups, length and checksum checks), run
/// concurrently like the subtasks of a job. Returns the time and the blocks.
async fn read_snapshot(
    store: &Arc<dyn snapshot::ObjectStore>,
    dir: &snapshot::Path,
    manifest: &Arc<Manifest>,
    assignment: Assignment,
    expect: u64,
) -> Result<(Sample, Vec<snapshot::Restore>)> {
    let started = Meter::start();
    let tasks: Vec<_> = (0..assignment.parallelism())
        .map(|i| {
            let (store, dir, manifest) = (store.clone(), dir.clone(), manifest.clone());
            tokio::spawn(async move {
                snapshot::read_groups(store.as_ref(), &dir, &manifest, assignment.range(i)).await
            })
        })
        .collect();
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await??);
    }
    let took = started.stop();
    let bytes: u64 = out.iter().map(|r| r.bytes_read).sum();
    if bytes != expect {
        bail!("restore read {bytes} bytes, expected {expect}");
    }
    Ok((took, out))
}

fn state_files(root: &Path, dir: &snapshot::Path, manifest: &Manifest) -> Vec<PathBuf> {
    manifest
        .files
        .iter()
        .map(|f| root.join(dir.as_ref()).join(&f.name))
        .collect()
}

async fn snapshot_bench(args: SnapshotBench) -> Result<()> {
    let ctx_start = context_line();
    let run = prepare_dir(&args.dir, "snapshot")?;
    let root = run.join("store");
    let (store, base) = snapshot::open_store(&format!("file://{}", root.display()))?;
    let job = snapshot::job_dir(&base, "bench", "snapshot");
    let assignment = Assignment::new(i64::from(args.parallelism), i64::from(args.max_parallelism))?;
    let keys = keys_for(args.state_mib);
    let threads = args.encode_threads.unwrap_or_else(|| {
        StateWriteOptions::threads_for((keys / u64::from(args.parallelism)) as usize)
    });
    println!(
        "keyshift bench snapshot: {} MiB target, {keys} string keys x {} B payload, {} key groups, {} subtask(s), {threads} encoder thread(s) per subtask, {} rounds, in {}",
        args.state_mib,
        args.payload,
        args.max_parallelism,
        args.parallelism,
        args.rounds,
        run.display()
    );
    println!("machine: {ctx_start}");

    // State: the real operator, every key once (count), with its per-key payload.
    let t = Instant::now();
    let config = AggConfig {
        function: AggregateFunction::Count,
        window_size_ms: None,
        max_parallelism: args.max_parallelism,
        state_payload_bytes: args.payload,
    };
    let mut aggs = (0..args.parallelism)
        .map(|i| KeyedAggregator::new(config, assignment.range(i)))
        .collect::<Result<Vec<_>, _>>()?;
    for i in 0..keys {
        let key = string_key(i);
        let owner = assignment.owner(key.key_group(args.max_parallelism)) as usize;
        aggs[owner].process(&Record {
            key,
            value: 1,
            ts: 0,
        })?;
    }
    let built = t.elapsed();
    // For reference, what a checkpoint of this (non-windowed) job did before the results were
    // drained in the encoding pass: drain every changed key's result, sort them all, format
    // them as the log sink's lines (not printed).
    let t_drain = Meter::start();
    let mut lines = 0usize;
    for agg in &mut aggs {
        let rows = agg.drain_updates();
        lines += rows
            .iter()
            .map(|r| crate::job::LogSink::format(r).len() + 1)
            .sum::<usize>();
    }
    let drain = t_drain.stop();
    let t_encode = Instant::now();
    let blocks: Vec<Blocks> = (0..args.parallelism)
        .map(|i| {
            assignment
                .range(i)
                .iter()
                .map(|g| {
                    let (b, n) = aggs[i as usize].encode_group(g)?;
                    Ok((g, Bytes::from(b), n))
                })
                .collect::<Result<Vec<_>>>()
                .map(Arc::new)
        })
        .collect::<Result<_>>()?;
    let encode_once = t_encode.elapsed();
    let aggs: Vec<SharedAgg> = aggs
        .into_iter()
        .map(|a| Arc::new(tokio::sync::Mutex::new(a)))
        .collect();
    let total: u64 = blocks
        .iter()
        .flat_map(|b| b.iter())
        .map(|(_, b, _)| b.len() as u64)
        .sum();
    let chunks: Vec<Bytes> = blocks
        .iter()
        .flat_map(|b| b.iter())
        .map(|(_, b, _)| b.clone())
        .collect();
    println!(
        "state: {keys} keys, {total} bytes ({:.0} MiB, {:.0} B/key) built in {}; encoding alone (one thread) {} ({:.0} MiB/s)",
        mib(total),
        total as f64 / keys as f64,
        secs(built),
        secs(encode_once),
        mibps(total, encode_once)
    );
    println!(
        "for reference, the previous checkpoint path's drain + global sort + format of every changed key's result: {} ({:.2} s CPU) for {keys} results, {:.0} MiB of log lines",
        secs(drain.wall),
        drain.cpu.as_secs_f64(),
        mib(lines as u64)
    );

    let worker = |threads, updates| WritePath::Worker(StateWriteOptions { threads, updates });
    // The other choice of encoder threads, measured in the same rounds.
    let alt_threads = if threads == 1 { 2 } else { 1 };
    let raw_path = run.join("raw.bin");
    let mut best_raw_w = Best::default();
    let mut best_ks_w = Best::default();
    let mut best_ks_w1 = Best::default();
    let mut best_ks_drain = Best::default();
    let mut best_ks_w_only = Best::default();
    let mut best_raw_r = Best::default();
    let mut best_ks_r = Best::default();
    let mut best_raw_cold = Best::default();
    let mut best_ks_cold = Best::default();
    let mut best_restore = Best::default();
    let mut device_bytes = (0u64, 0u64);
    let mut cold_ok = true;
    let mut id = 0u64;
    let rounds = args.rounds.max(1);
    for round in 0..rounds {
        let raw_first = round % 2 == 0;
        // Writes: raw; keyshift's worker path (its encoder threads, then one thread); the worker
        // path of a checkpoint that also drains every key's result (all marked changed first,
        // outside the timing); the write of pre-encoded blocks. Raw first in even rounds, last
        // in odd ones.
        if raw_first {
            best_raw_w.add(raw_write(&raw_path, &chunks)?);
        }
        for (path, best) in [
            (worker(threads, Updates::Skip), &mut best_ks_w),
            (worker(alt_threads, Updates::Skip), &mut best_ks_w1),
        ] {
            id += 1;
            let (d, dir, _, _) = write_snapshot(&store, &job, id, assignment, &aggs, path).await?;
            best.add(d);
            std::fs::remove_dir_all(root.join(dir.as_ref()))?;
        }
        for a in &aggs {
            a.lock().await.mark_all_changed();
        }
        id += 1;
        let (d, dir, _, rows) = write_snapshot(
            &store,
            &job,
            id,
            assignment,
            &aggs,
            worker(threads, Updates::Keep),
        )
        .await?;
        if rows != keys {
            bail!("the checkpoint drained {rows} results, expected {keys}");
        }
        best_ks_drain.add(d);
        std::fs::remove_dir_all(root.join(dir.as_ref()))?;
        id += 1;
        let (d, dir, manifest, _) = write_snapshot(
            &store,
            &job,
            id,
            assignment,
            &aggs,
            WritePath::PreEncoded(blocks.clone()),
        )
        .await?;
        best_ks_w_only.add(d);
        if !raw_first {
            best_raw_w.add(raw_write(&raw_path, &chunks)?);
        }
        if manifest.stats.total_bytes != total {
            bail!(
                "snapshot holds {} bytes, expected {total}",
                manifest.stats.total_bytes
            );
        }
        let manifest = Arc::new(manifest);
        let files = state_files(&root, &dir, &manifest);

        // Warm reads (the files were just written: page cache), alternating order.
        if raw_first {
            best_raw_r.add(raw_read(&raw_path, total)?);
        }
        let (d, restored) = read_snapshot(&store, &dir, &manifest, assignment, total).await?;
        best_ks_r.add(d);
        drop(restored);
        if !raw_first {
            best_raw_r.add(raw_read(&raw_path, total)?);
        }

        // Restore proper, the worker's path: every subtask reads its groups and decodes them
        // into a fresh operator while the next ones are read.
        let t = Meter::start();
        let tasks: Vec<_> = (0..args.parallelism)
            .map(|i| {
                let (store, dir, manifest) = (store.clone(), dir.clone(), manifest.clone());
                tokio::spawn(async move {
                    let mut agg = KeyedAggregator::new(config, assignment.range(i))?;
                    let r = restore::restore_state(
                        &mut agg,
                        store.as_ref(),
                        &dir,
                        &manifest,
                        RestoreOptions::default(),
                    )
                    .await?;
                    Ok::<_, anyhow::Error>((agg, r))
                })
            })
            .collect();
        let mut fresh = Vec::new();
        for task in tasks {
            fresh.push(task.await??);
        }
        best_restore.add(t.stop());
        let restored_keys: usize = fresh.iter().map(|(a, _)| a.key_count()).sum();
        let restored_bytes: u64 = fresh.iter().map(|(_, r)| r.bytes_read).sum();
        if restored_keys as u64 != keys || restored_bytes != total {
            bail!(
                "restored {restored_keys} keys from {restored_bytes} bytes, expected {keys} from {total}"
            );
        }
        drop(fresh);

        // Cold reads: the files' pages dropped from the page cache first; /proc/self/io tells
        // how much came from the device.
        for raw_turn in [raw_first, !raw_first] {
            if raw_turn {
                cold_ok &= drop_cached(&raw_path);
                let io = proc_io().0;
                best_raw_cold.add(raw_read(&raw_path, total)?);
                device_bytes.0 = proc_io().0 - io;
            } else {
                for f in &files {
                    cold_ok &= drop_cached(f);
                }
                let io = proc_io().0;
                let (d, restored) =
                    read_snapshot(&store, &dir, &manifest, assignment, total).await?;
                best_ks_cold.add(d);
                drop(restored);
                device_bytes.1 = proc_io().0 - io;
            }
        }
        std::fs::remove_dir_all(root.join(dir.as_ref()))?;
        println!(
            "round {}/{}: write raw {} / keyshift {} ({alt_threads} thread(s) {}, draining results {}, pre-encoded {}); read raw {} / keyshift {}; restore {}; cold read raw {} / keyshift {} (best so far)",
            round + 1,
            rounds,
            secs(best_raw_w.get()),
            secs(best_ks_w.get()),
            secs(best_ks_w1.get()),
            secs(best_ks_drain.get()),
            secs(best_ks_w_only.get()),
            secs(best_raw_r.get()),
            secs(best_ks_r.get()),
            secs(best_restore.get()),
            secs(best_raw_cold.get()),
            secs(best_ks_cold.get()),
        );
    }
    let _ = std::fs::remove_dir_all(&run);

    let ratio = |raw: &Best, ks: &Best| raw.get().as_secs_f64() / ks.get().as_secs_f64().max(1e-9);
    println!();
    println!("machine at the end: load average {}", loadavg());
    if !cold_ok {
        println!(
            "note: dropping files from the page cache is not supported here; the cold rows are warm"
        );
    }
    println!(
        "cold reads fetched {:.0} MiB (raw) and {:.0} MiB (keyshift) from the device in the last round",
        mib(device_bytes.0),
        mib(device_bytes.1)
    );
    println!();
    println!(
        "| measurement ({} MiB, {} keys, {} groups, p={}, {threads} encoder threads) | raw | keyshift | raw MiB/s | keyshift MiB/s | ratio (raw time / keyshift time) | CPU raw / keyshift |",
        mib(total).round(),
        keys,
        args.max_parallelism,
        args.parallelism
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    let row = |name: &str, raw: &Best, ks: &Best| {
        println!(
            "| {name} | {} | {} | {:.0} | {:.0} | {:.2} | {:.2} s / {:.2} s |",
            secs(raw.get()),
            secs(ks.get()),
            mibps(total, raw.get()),
            mibps(total, ks.get()),
            ratio(raw, ks),
            raw.cpu().as_secs_f64(),
            ks.cpu().as_secs_f64()
        );
    };
    row(
        "snapshot write: encode + write + fsync (worker path)",
        &best_raw_w,
        &best_ks_w,
    );
    row(
        &format!("snapshot write: encode + write + fsync, {alt_threads} encoder thread(s)"),
        &best_raw_w,
        &best_ks_w1,
    );
    row(
        "checkpoint write draining every key's result too (non-windowed job, worker path)",
        &best_raw_w,
        &best_ks_drain,
    );
    row(
        "snapshot write: pre-encoded blocks + fsync",
        &best_raw_w,
        &best_ks_w_only,
    );
    row(
        "restore read, page cache (range reads + checksums)",
        &best_raw_r,
        &best_ks_r,
    );
    row(
        "restore read, cold (pages dropped with fadvise)",
        &best_raw_cold,
        &best_ks_cold,
    );
    row(
        "restore: read + decode into the operator (page cache, worker path)",
        &best_raw_r,
        &best_restore,
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// rescale

fn job_manifest(
    name: &str,
    replicas: u32,
    max_parallelism: u32,
    generator: &str,
    key_type: &str,
    storage: &str,
) -> Result<StreamJob> {
    let yaml = format!(
        r#"apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata:
  name: {name}
  namespace: bench
spec:
  replicas: {replicas}
  maxParallelism: {max_parallelism}
  state:
    storage: {storage}
    retainedCheckpoints: 1
  job:
    source:
      generator: {generator}
    key:
      field: key
      type: {key_type}
    aggregation:
      function: count
    sink:
      type: log
"#
    );
    let job: StreamJob = serde_yaml::from_str(&yaml).context("bench job manifest")?;
    crate::validation::validate(&job.spec, None)
        .map_err(|e| anyhow::anyhow!("bench job manifest: {e}"))?;
    Ok(job)
}

async fn rescale_bench(args: RescaleBench) -> Result<()> {
    let ctx_start = context_line();
    let run = prepare_dir(&args.dir, "rescale")?;
    let storage = format!("file://{}", run.join("store").display());
    let keys = keys_for(args.state_mib);
    let partitions = args.partitions.unwrap_or(args.from.max(args.to));
    let per_key = args
        .records_per_key
        .unwrap_or_else(|| (keys as f64).ln() + 2.0);
    let per_partition = ((keys as f64 * per_key) / f64::from(partitions)).ceil() as u64;
    let total_records = per_partition * u64::from(partitions);
    let generator = format!(
        "{{partitions: {partitions}, keys: {keys}, seed: 7, recordsPerPartition: {per_partition}}}"
    );
    let job = job_manifest(
        "rescale",
        args.from,
        args.max_parallelism,
        &generator,
        "string",
        &storage,
    )?;
    println!(
        "keyshift bench rescale: {} MiB target, {keys} string keys x {} B payload, {} -> {} of {} key groups; {total_records} records ({per_key:.1} per key) over {partitions} partitions; in {}",
        args.state_mib,
        args.payload,
        args.from,
        args.to,
        args.max_parallelism,
        run.display()
    );
    println!("machine: {ctx_start}");

    let bin = std::env::current_exe()?;
    let mut local = LocalJob::new(&job, storage, bin, run.join("logs")).await?;
    local.state_payload_bytes = args.payload;
    let result = rescale_steps(&mut local, &args, total_records, keys).await;
    local.stop().await;
    let (report, build, prestaged) = result?;
    // The snapshots are not read again: freed before the baseline writes as many bytes (a 4 GiB
    // pre-staged run holds ~10 GiB of them).
    if !args.keep {
        let _ = std::fs::remove_dir_all(run.join("store"));
    }

    // Raw baseline: write (fsync) then read the same number of bytes, best of N.
    let bytes = report.state_bytes;
    let chunks = filler(bytes);
    let raw_path = run.join("raw.bin");
    let (mut best_w, mut best_r, mut best_sum) =
        (Best::default(), Best::default(), Best::default());
    for _ in 0..args.rounds.max(1) {
        let w = raw_write(&raw_path, &chunks)?;
        let r = raw_read(&raw_path, bytes)?;
        best_w.add(w);
        best_r.add(r);
        best_sum.add(Sample {
            wall: w.wall + r.wall,
            cpu: w.cpu + r.cpu,
        });
    }
    drop(chunks);
    if args.keep {
        let _ = std::fs::remove_file(&raw_path);
        println!("kept {}", run.display());
    } else {
        let _ = std::fs::remove_dir_all(&run);
    }

    let pause = report.pause;
    let raw = best_sum.get();
    let keys_restored: u64 = report
        .launch
        .responses
        .iter()
        .map(|r| r.keys_restored)
        .sum();
    let restore_ms: Vec<u64> = report
        .launch
        .responses
        .iter()
        .map(|r| r.restore_ms)
        .collect();
    println!();
    println!("state built in {} ({keys_restored} keys)", secs(build));
    println!(
        "rescale {} -> {}: pause {} = {}",
        report.from,
        report.to,
        secs(pause),
        report
            .steps
            .iter()
            .map(|(s, d)| format!("{s} {}", secs(*d)))
            .collect::<Vec<_>>()
            .join(" + ")
    );
    println!(
        "restore inside the new workers (read + checksum + decode), per subtask: {} ms",
        restore_ms
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "raw baseline (best of {}): write + fsync {} + read {} = {}",
        args.rounds.max(1),
        secs(best_w.get()),
        secs(best_r.get()),
        secs(raw)
    );
    if let Some(n) = &prestaged {
        let pre = report.prestage.as_ref();
        let loaded = pre.map_or(0, |p| p.loaded_bytes);
        let read = loaded + report.bytes_read;
        println!(
            "pre-staged: {} read up to {} in {} beside the running job ({} catch-up rounds; steady load {} records/s, about {:.2}% of the keys per second); the stop checkpoint wrote {:.1} MiB, {:.2} s of changes after the first loaded checkpoint; the new subtasks then read {:.1} MiB",
            format_args!("{:.1} MiB", mib(loaded)),
            pre.map_or("?", |p| p.base.as_str()),
            secs(pre.map_or(Duration::ZERO, |p| p.duration)),
            pre.map_or(0, |p| p.catch_up_rounds),
            n.load_records_per_second,
            n.load_records_per_second as f64 * 100.0 / keys.max(1) as f64,
            mib(pre.map_or(0, |p| p.delta_bytes)),
            n.since_checkpoint.as_secs_f64(),
            mib(report.bytes_read),
        );
        if let Some(p) = pre {
            println!(
                "pre-stage rounds: first load {}{}",
                secs(p.rounds.first().copied().unwrap_or_default()),
                p.rounds
                    .iter()
                    .skip(1)
                    .map(|d| format!(", catch-up {}", secs(*d)))
                    .collect::<String>()
            );
        }
        if let Some(why) = &report.fallback {
            println!("FELL BACK: {why}");
        }
        println!(
            "pause (stop checkpoint trigger -> first record of every new subtask): {} = {:.3}x the raw write+read {}",
            secs(n.pause_to_first_record),
            n.pause_to_first_record.as_secs_f64() / raw.as_secs_f64().max(1e-9),
            secs(raw)
        );
        println!(
            "restore bytes read / bytes the new subtasks need: ({:.1} + {:.1}) / {:.1} MiB = {:.3}",
            mib(loaded),
            mib(report.bytes_read),
            mib(bytes),
            read as f64 / bytes.max(1) as f64
        );
        println!(
            "resident memory: steady {:.0} MiB (old workers), pre-staged {:.0} MiB (old + new workers' peak: {:.0} + {:.0}) = {:.2}x",
            n.steady_rss_kib as f64 / 1024.0,
            n.prestaged_rss_kib as f64 / 1024.0,
            n.old_rss_kib as f64 / 1024.0,
            (n.prestaged_rss_kib - n.old_rss_kib) as f64 / 1024.0,
            n.prestaged_rss_kib as f64 / n.steady_rss_kib.max(1) as f64
        );
        println!(
            "private memory (resident without the binary's file pages, which every worker process shares): steady {:.0} MiB, pre-staged peak {:.0} MiB = {:.2}x",
            n.steady_private_kib as f64 / 1024.0,
            n.prestaged_private_kib as f64 / 1024.0,
            n.prestaged_private_kib as f64 / n.steady_private_kib.max(1) as f64
        );
        println!();
        println!(
            "| pre-staged rescale | state | keys | load | pause to first record | pause / raw write+read | restore read / needed | stop checkpoint written | peak RSS / steady | peak private / steady |"
        );
        println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
        println!(
            "| {} -> {} ({} groups) | {:.0} MiB | {keys_restored} | {:.2}%/s | {} | {:.3} ({}) | {:.3} | {:.1} MiB | {:.2} | {:.2} |",
            report.from,
            report.to,
            args.max_parallelism,
            mib(bytes),
            n.load_records_per_second as f64 * 100.0 / keys.max(1) as f64,
            secs(n.pause_to_first_record),
            n.pause_to_first_record.as_secs_f64() / raw.as_secs_f64().max(1e-9),
            secs(raw),
            read as f64 / bytes.max(1) as f64,
            mib(pre.map_or(0, |p| p.delta_bytes)),
            n.prestaged_rss_kib as f64 / n.steady_rss_kib.max(1) as f64,
            n.prestaged_private_kib as f64 / n.steady_private_kib.max(1) as f64
        );
    }
    println!("machine at the end: load average {}", loadavg());
    if let Some(path) = &args.record {
        let record = crate::pictures::timeline::RescaleRecord {
            command: std::env::args()
                .skip(1)
                .fold("keyshift".to_owned(), |acc, a| acc + " " + &a),
            recorded_at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            machine: format!("{ctx_start}; load average {} at the end", loadavg()),
            release_build: !cfg!(debug_assertions),
            from: report.from,
            to: report.to,
            max_parallelism: args.max_parallelism,
            groups_moved: report.groups_moved,
            state_bytes: bytes,
            bytes_read: report.bytes_read,
            keys: keys_restored,
            steps: report
                .steps
                .iter()
                .map(|(step, d)| crate::pictures::timeline::StepTime {
                    step: *step,
                    seconds: round3(d.as_secs_f64()),
                })
                .collect(),
            restore_seconds_per_subtask: restore_ms.iter().map(|ms| *ms as f64 / 1000.0).collect(),
            raw_write_seconds: round3(best_w.get().as_secs_f64()),
            raw_read_seconds: round3(best_r.get().as_secs_f64()),
        };
        let json = serde_json::to_string_pretty(&record)?;
        std::fs::write(path, json + "\n").with_context(|| format!("writing {}", path.display()))?;
        println!("recorded the rescale's steps in {}", path.display());
    }
    println!();
    println!(
        "| rescale | state | keys | pause | pause / raw write+read | bytes read / state bytes | groups moved | steps |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    println!(
        "| {} -> {} ({} groups) | {:.0} MiB | {keys_restored} | {} | {:.2} ({}) | {:.3} | {} | {} |",
        report.from,
        report.to,
        args.to_max_parallelism.map_or_else(
            || args.max_parallelism.to_string(),
            |g| format!("{} -> {g}", args.max_parallelism)
        ),
        mib(bytes),
        secs(pause),
        pause.as_secs_f64() / raw.as_secs_f64().max(1e-9),
        secs(raw),
        report.bytes_read as f64 / bytes.max(1) as f64,
        report.groups_moved,
        report
            .steps
            .iter()
            .map(|(s, d)| format!("{s} {:.2}", d.as_secs_f64()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

/// Seconds to the millisecond (what the recorded JSON keeps).
fn round3(secs: f64) -> f64 {
    (secs * 1000.0).round() / 1000.0
}

async fn processed(local: &mut LocalJob) -> Result<(u64, u64)> {
    let st = local.status().await?;
    Ok((
        st.iter().map(|s| s.records_processed).sum(),
        st.iter().map(|s| s.keys).sum(),
    ))
}

async fn rescale_steps(
    local: &mut LocalJob,
    args: &RescaleBench,
    total_records: u64,
    keys: u64,
) -> Result<(
    crate::local::RescaleReport,
    Duration,
    Option<PrestageNumbers>,
)> {
    let t = Instant::now();
    local.launch(args.from, None).await?;
    let mut last_print = Instant::now();
    loop {
        if let Some((i, status)) = local.failed_worker() {
            bail!("worker {i} exited ({status})");
        }
        let (n, keys) = processed(local).await?;
        if n >= total_records {
            break;
        }
        if last_print.elapsed() > Duration::from_secs(10) {
            last_print = Instant::now();
            println!(
                "  building state: {n} of {total_records} records, {keys} keys, {:.0} records/s",
                n as f64 / t.elapsed().as_secs_f64()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let build = t.elapsed();
    if args.prestage {
        let (report, numbers) = prestaged_rescale(local, args, keys).await?;
        return Ok((report, build, Some(numbers)));
    }
    let report = match args.to_max_parallelism {
        Some(groups) => {
            let (report, rewrite) = local
                .change_key_groups(args.to, groups, args.rewrite_memory_mib * 1024 * 1024)
                .await?;
            println!(
                "rewrite {} -> {} key groups: {} keys, {} MiB read, {} MiB written, {} MiB spilled, {} buckets (largest {} MiB): scatter {}, assemble {}, commit {}",
                args.max_parallelism,
                groups,
                rewrite.keys,
                mib(rewrite.bytes_read) as u64,
                mib(rewrite.bytes_written) as u64,
                mib(rewrite.spill_bytes) as u64,
                rewrite.buckets,
                mib(rewrite.largest_bucket_bytes) as u64,
                secs(Duration::from_secs_f64(rewrite.scatter_secs)),
                secs(Duration::from_secs_f64(rewrite.assemble_secs)),
                secs(Duration::from_secs_f64(rewrite.commit_secs)),
            );
            report
        }
        None => local.rescale(args.to).await?,
    };
    Ok((report, build, None))
}

/// Summed resident memory of processes, KiB: (peak, now).
fn rss_kib(pids: &[u32]) -> (u64, u64) {
    pids.iter()
        .map(|p| memory_kib(*p))
        .fold((0, 0), |(a, b), (p, n)| (a + p, b + n))
}

/// The pre-staged rescale of `bench rescale --prestage`, on the built state: the job is
/// stopped with a savepoint and resumed under a steady paced load, checkpoints (a full one,
/// then an incremental one after `settle_secs`), and after `settle_secs` more rescales
/// pre-staged.
async fn prestaged_rescale(
    local: &mut LocalJob,
    args: &RescaleBench,
    keys: u64,
) -> Result<(crate::local::RescaleReport, PrestageNumbers)> {
    let built = local.shutdown().await?;
    let partitions = args.partitions.unwrap_or(args.from.max(args.to));
    let per_partition = ((keys as f64 * args.load_percent / 100.0) / f64::from(partitions))
        .ceil()
        .max(1.0) as i64;
    if let Some(g) = local.spec.job.source.generator.as_mut() {
        g.records_per_partition = None;
        g.records_per_second = Some(per_partition);
    }
    let load = per_partition as u64 * u64::from(partitions);
    println!(
        "steady load: {load} records/s ({:.2}% of the keys per second), from the savepoint {}",
        load as f64 * 100.0 / keys.max(1) as f64,
        built.url
    );
    local.launch(args.from, Some(built.url.clone())).await?;
    let settle = Duration::from_secs_f64(args.settle_secs.max(0.0));
    let full = local.checkpoint().await?;
    println!(
        "checkpoint {} (full, after the restore): {}",
        full.id,
        secs(full.duration)
    );
    tokio::time::sleep(settle).await;
    let base = local.checkpoint().await?;
    let committed = Instant::now();
    println!(
        "checkpoint {} (incremental, {:.1} MiB written): {}",
        base.id,
        mib(base.manifest.stats.written_bytes.unwrap_or(0)),
        secs(base.duration)
    );
    tokio::time::sleep(settle).await;
    let (_, steady_rss_kib) = rss_kib(&local.worker_pids());
    let steady_private_kib = local.worker_pids().into_iter().map(private_kib).sum();
    let sampler = ChildrenPeak::start();
    let p = local.prestage(args.to).await?;
    let sampled = sampler.finish();
    let (_, old_now) = rss_kib(&local.worker_pids());
    let (new_peak, _) = rss_kib(&p.worker_pids());
    // A spike between two samples is not lost: each new worker's own peak (its resident peak
    // less its file pages now) beside the old workers' private memory now.
    let old_private: u64 = local.worker_pids().into_iter().map(private_kib).sum();
    let new_private_peaks: u64 = p
        .worker_pids()
        .into_iter()
        .map(|pid| {
            let [hwm, file] = status_kib(pid, ["VmHWM:", "RssFile:"]);
            hwm.saturating_sub(file)
        })
        .sum();
    let prestaged_private_kib = sampled.max(old_private + new_private_peaks);
    let since_checkpoint = committed.elapsed();
    let trigger = Instant::now();
    let report = local.finish_prestaged(p).await?;
    // The first record processed by every new subtask.
    loop {
        let st = local.status().await?;
        if st.iter().all(|w| w.records_processed > 0) {
            break;
        }
        if trigger.elapsed() > Duration::from_secs(600) {
            bail!("the new subtasks processed nothing for 10 minutes");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let pause_to_first_record = trigger.elapsed();
    Ok((
        report,
        PrestageNumbers {
            pause_to_first_record,
            load_records_per_second: load,
            steady_rss_kib,
            prestaged_rss_kib: old_now + new_peak,
            old_rss_kib: old_now,
            steady_private_kib,
            prestaged_private_kib,
            since_checkpoint,
        },
    ))
}

// ---------------------------------------------------------------------------------------------
// throughput

/// Fields of a process's `/proc/PID/status`, in KiB (0 for a field missing, or a process gone).
fn status_kib<const N: usize>(pid: u32, names: [&str; N]) -> [u64; N] {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    names.map(|name| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    })
}

/// Peak and current resident memory of a process, in KiB (`VmHWM`, `VmRSS`).
pub(crate) fn memory_kib(pid: u32) -> (u64, u64) {
    let [hwm, rss] = status_kib(pid, ["VmHWM:", "VmRSS:"]);
    (hwm, rss)
}

/// Private memory of a process, in KiB: its resident anonymous and shared-memory pages
/// (`RssAnon` + `RssShmem`), without the file pages it maps. Those are mostly the binary's
/// code (about 17 MiB resident in each worker), which every worker process on the machine
/// shares and the page cache holds once: summing resident memory over 12 workers counts it 12
/// times.
fn private_kib(pid: u32) -> u64 {
    status_kib(pid, ["RssAnon:", "RssShmem:"]).iter().sum()
}

/// Numeric fields of a process's `/proc/PID/stat`, counted from the one after the command
/// name (which may hold spaces): 0 is the state, 1 the parent's pid, 11 and 12 utime and stime
/// (fields 3, 4, 14 and 15 of the whole line). `None` for a field missing, or a process gone.
fn stat_fields<const N: usize>(pid: u32, at: [usize; N]) -> [Option<u64>; N] {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = text.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    at.map(|i| fields.get(i).and_then(|v| v.parse().ok()))
}

/// The processes whose parent is `parent`.
fn children_of(parent: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| stat_fields(*pid, [1]) == [Some(u64::from(parent))])
        .collect()
}

/// The peak of the summed private memory ([`private_kib`]) of this process's children (the
/// worker processes), sampled every 10 ms on a thread of its own until [`finish`](Self::finish).
struct ChildrenPeak {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl ChildrenPeak {
    fn start() -> Self {
        use std::sync::atomic::Ordering;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let me = std::process::id();
        let thread = std::thread::spawn(move || {
            let mut peak = 0;
            loop {
                let now = children_of(me).into_iter().map(private_kib).sum();
                peak = u64::max(peak, now);
                if flag.load(Ordering::Relaxed) {
                    return peak;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        Self { stop, thread }
    }

    /// The peak seen, KiB (one last sample included).
    fn finish(self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap_or(0)
    }
}

/// CPU time (user + system) a process has used so far.
pub(crate) fn cpu_time(pid: u32) -> Duration {
    let [utime, stime] = stat_fields(pid, [11, 12]).map(|t| t.unwrap_or(0));
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Duration::from_nanos((utime + stime) * 1_000_000_000 / hz)
}

struct ThroughputRow {
    keys: u64,
    parallelism: u32,
    rate: f64,
    min_rate: f64,
    max_rate: f64,
    keys_in_state: u64,
    peak_kib: u64,
    backpressure_ms: u64,
    /// Worker CPU time used during the measurement.
    cpu: Duration,
    wall: Duration,
}

impl ThroughputRow {
    /// Cores the workers kept busy on average.
    fn cores(&self) -> f64 {
        self.cpu.as_secs_f64() / self.wall.as_secs_f64().max(1e-9)
    }
    /// Records per second of worker CPU time: what the machine's load does not change much.
    fn per_cpu_second(&self) -> f64 {
        self.rate / self.cores().max(1e-9)
    }
}

async fn throughput_once(
    args: &ThroughputBench,
    run: &Path,
    keys: u64,
    p: u32,
) -> Result<ThroughputRow> {
    let partitions = args.partitions.max(p);
    let generator = format!("{{partitions: {partitions}, keys: {keys}, seed: 3}}");
    let name = format!("throughput-{keys}-{p}");
    let storage = format!("file://{}", run.join("store").display());
    let job = job_manifest(&name, p, 128, &generator, &args.key_type, &storage)?;
    let bin = std::env::current_exe()?;
    let mut local = LocalJob::new(&job, storage, bin, run.join("logs")).await?;
    local.launch(p, None).await?;
    let result = async {
        tokio::time::sleep(Duration::from_secs(args.warmup)).await;
        let pids = local.worker_pids();
        let cpu0: Duration = pids.iter().map(|p| cpu_time(*p)).sum();
        let (n0, _) = processed(&mut local).await?;
        let t0 = Instant::now();
        let (mut prev, mut tprev) = (n0, t0);
        let (mut min_rate, mut max_rate) = (f64::MAX, 0f64);
        for _ in 0..args.seconds {
            tokio::time::sleep(Duration::from_secs(1)).await;
            if let Some((i, status)) = local.failed_worker() {
                bail!("worker {i} exited ({status})");
            }
            let (n, _) = processed(&mut local).await?;
            let now = Instant::now();
            let r = (n - prev) as f64 / (now - tprev).as_secs_f64();
            min_rate = min_rate.min(r);
            max_rate = max_rate.max(r);
            (prev, tprev) = (n, now);
        }
        let rate = (prev - n0) as f64 / (tprev - t0).as_secs_f64();
        let cpu = pids.iter().map(|p| cpu_time(*p)).sum::<Duration>() - cpu0;
        let st = local.status().await?;
        let peak_kib = local.worker_pids().iter().map(|p| memory_kib(*p).0).sum();
        Ok(ThroughputRow {
            keys,
            parallelism: p,
            rate,
            min_rate,
            max_rate,
            keys_in_state: st.iter().map(|s| s.keys).sum(),
            peak_kib,
            backpressure_ms: st.iter().map(|s| s.backpressure_ms).sum(),
            cpu,
            wall: tprev - t0,
        })
    }
    .await;
    local.stop().await;
    result
}

async fn throughput_bench(args: ThroughputBench) -> Result<()> {
    let ctx_start = context_line();
    let run = prepare_dir(&args.dir, "throughput")?;
    println!(
        "keyshift bench throughput: keyed count, generator ({} partitions, {} keys, unpaced), {}s warm-up, {}s measured, no checkpoints",
        args.partitions, args.key_type, args.warmup, args.seconds
    );
    println!("machine: {ctx_start}");
    let mut rows = Vec::new();
    for &keys in &args.keys {
        for &p in &args.parallelism {
            let row = throughput_once(&args, &run, keys, p).await?;
            println!(
                "  keys {keys}, p={p}: {:.2} M records/s (per second {:.2}..{:.2} M), workers used {:.2} cores = {:.2} M records per CPU-second, {} keys in state, peak RSS {:.0} MiB, backpressure {} ms",
                row.rate / 1e6,
                row.min_rate / 1e6,
                row.max_rate / 1e6,
                row.cores(),
                row.per_cpu_second() / 1e6,
                row.keys_in_state,
                row.peak_kib as f64 / 1024.0,
                row.backpressure_ms
            );
            rows.push(row);
        }
    }
    let _ = std::fs::remove_dir_all(&run);
    println!("machine at the end: load average {}", loadavg());
    println!();
    println!(
        "| keys | p | shuffle | records/s | per second (min..max) | vs 5M/s | worker cores busy | records per CPU-second | keys in state | peak RSS (all workers) | peak RSS per million keys |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in rows {
        let per_million = r.peak_kib as f64 / 1024.0 / (r.keys_in_state.max(1) as f64 / 1e6);
        println!(
            "| {} | {} | {} | {:.2} M | {:.2}..{:.2} M | {:.2} | {:.2} | {:.2} M | {} | {:.0} MiB | {:.0} MiB |",
            r.keys,
            r.parallelism,
            if r.parallelism == 1 {
                "local channel"
            } else {
                "loopback TCP"
            },
            r.rate / 1e6,
            r.min_rate / 1e6,
            r.max_rate / 1e6,
            r.rate / 5e6,
            r.cores(),
            r.per_cpu_second() / 1e6,
            r.keys_in_state,
            r.peak_kib as f64 / 1024.0,
            per_million
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The memory sampler sees a child process and its private memory, and leaves out the
    /// child's file pages: its private memory is below its resident memory.
    #[test]
    fn a_child_and_its_private_memory_are_found() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .expect("sleep runs");
        let pid = child.id();
        // Read it once it sleeps: between the spawn and the exec of `sleep` (and its loader
        // mapping libc), it has no file pages yet.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|t| t.contains("(sleep) S"))
        {
            assert!(Instant::now() < deadline, "sleep {pid} never slept");
            std::thread::sleep(Duration::from_millis(1));
        }
        let found = children_of(std::process::id()).contains(&pid);
        let private = private_kib(pid);
        let (_, rss) = memory_kib(pid);
        let sampler = ChildrenPeak::start();
        std::thread::sleep(Duration::from_millis(30));
        let peak = sampler.finish();
        let _ = child.kill();
        let _ = child.wait();
        assert!(
            found,
            "child {pid} not among {:?}",
            children_of(std::process::id())
        );
        assert!(
            private > 0 && private < rss,
            "private {private} KiB, resident {rss} KiB"
        );
        assert!(
            peak >= private,
            "peak {peak} KiB below one child's {private} KiB"
        );
        assert!(
            private_kib(u32::MAX) == 0,
            "a process that is gone has none"
        );
    }

    /// A process's CPU time, read from the same `/proc/PID/stat` fields as its parent: it
    /// counts this process's own spinning, and is zero for a process that is gone.
    #[test]
    fn cpu_time_counts_a_spin() {
        let me = std::process::id();
        let before = cpu_time(me);
        let start = Instant::now();
        let mut x = 0u64;
        while start.elapsed() < Duration::from_millis(100) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        let spent = cpu_time(me) - before;
        assert!(
            spent >= Duration::from_millis(50),
            "{spent:?} of CPU for a 100 ms spin"
        );
        assert_eq!(cpu_time(u32::MAX), Duration::ZERO);
    }
}
