//! `keyshift bench ...`: benchmarks of the runtime, each reported as a ratio to a raw baseline
//! measured in the same run on the same machine, so a shared or noisy machine affects both sides.
//!
//! * `snapshot`: write and restore-read throughput of keyed state on `file://` against a raw
//!   sequential write with fsync and a raw read of the same bytes.
//! * `rescale`: the pause of a `LocalJob` rescale (worker processes) against a raw write + read of
//!   the state's bytes.
//! * `throughput`: steady-state records/s of a keyed count through `LocalJob`, and the workers'
//!   peak memory.
//! * `keyed`: records/s of the keyed operator alone (one thread, no I/O): the built-in count
//!   against the same count written on the SDK (`keyshift-sdk`), in the same run.
//! * `checkpoint`: bytes an incremental checkpoint writes after a share of the keys changed,
//!   against the full one before it, and how long its cut holds records up against its write.
//! * `programs`: a program's whole worker path (the `count` program) against the built-in
//!   count's, over the same JSON-lines files, worker processes under `LocalJob`.
//! * `hot-keys`: the built-in count over a Zipf key stream with one hot key, the sources
//!   combining before the shuffle against not combining, worker processes under `LocalJob`.
//!
//! Results and how to reproduce them: `docs/benchmarks.md`. Build with `--release`.

use anyhow::{Context as _, Result};
use clap::{Args, Subcommand};
use std::path::PathBuf;

mod hot_keys;
mod job;
#[cfg(feature = "kafka")]
pub mod kafka;
mod keyed;
mod map_program;
mod measure;
pub mod operator;
mod program_checkpoint;
mod programs;
mod rescale;
mod state;
mod throughput;

/// The programs keyshift's worker carries for the benchmarks (with the `bench` feature):
/// [`map_program`] as `bench rescale --program` runs it.
pub fn programs() -> Vec<(&'static str, keyshift_sdk::dataflow::Job)> {
    vec![(
        map_program::NAME,
        map_program::job(map_program::FIELDS, map_program::PAYLOAD),
    )]
}

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
    /// The keyed operator alone: records/s of the built-in count against the same count on
    /// the SDK, one thread, no I/O.
    Keyed(KeyedBench),
    /// Incremental checkpoints: bytes an incremental checkpoint writes after a share of the keys
    /// changed, against a full one, and how long its cut holds records up against its write.
    Checkpoint(CheckpointBench),
    /// A program's whole worker path against the built-in job's: the same keyed count over the
    /// same JSON-lines files, worker processes, records/s and worker CPU time.
    Programs(ProgramsBench),
    /// A hot key: the built-in count over a Zipf key stream whose hottest key has
    /// --hot-share of the records, combining before the shuffle against not combining, worker
    /// processes, records/s and worker CPU time.
    HotKeys(HotKeysBench),
    /// The operator on a real API server: many StreamJobs (memory, reconcile latency, idle
    /// CPU) and `kubectl scale` with large state (`operator`).
    Operator(operator::OperatorBench),
    /// Kafka -> keyed count -> Kafka (exactly once) records/s against the broker's own
    /// producer and consumer perf tools, and the rescale pause with a Kafka source
    /// (`kafka`; needs the `kafka` feature and a broker).
    #[cfg(feature = "kafka")]
    Kafka(kafka::KafkaBench),
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
    /// Run the map-state program keyshift's worker carries (`attributes`: per key, 4 map
    /// entries of 90 bytes, set by the generated records) instead of the built-in count with
    /// --payload bytes per key.
    #[arg(long)]
    pub program: bool,
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
    /// A program's checkpoints instead of the built-in job's: a keyed step with map state
    /// (per key, --fields entries sharing --payload bytes), a changed key changing one entry.
    #[arg(long)]
    pub program: bool,
    /// With --program: map entries per key.
    #[arg(long, default_value_t = 4)]
    pub fields: u32,
    /// Directory for the files (a local filesystem; created if missing, emptied afterwards).
    #[arg(long, default_value = "keyshift-bench")]
    pub dir: PathBuf,
}

#[derive(Args, Debug)]
pub struct KeyedBench {
    /// Distinct keys (comma-separated for several runs).
    #[arg(long, value_delimiter = ',', default_value = "100000,1000000")]
    pub keys: Vec<u64>,
    /// Records per measurement (after a warm-up pass that puts every key in state).
    #[arg(long, default_value_t = 4_000_000)]
    pub records: u64,
    /// Measurements per side, alternating built-in and SDK; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Also the SDK operator with its state on disk (keyshift-state-disk), its store in a
    /// new directory under this one (removed afterwards).
    #[arg(long)]
    pub disk: Option<std::path::PathBuf>,
    /// The disk backend's block cache, in MiB.
    #[arg(long, default_value_t = 64)]
    pub disk_cache_mib: u64,
    /// The disk backend's write buffer (memtable), in MiB (at least 1).
    #[arg(long, default_value_t = 64)]
    pub disk_write_buffer_mib: u64,
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

#[derive(Args, Debug)]
pub struct ProgramsBench {
    /// Records in the input files.
    #[arg(long, default_value_t = 2_000_000)]
    pub records: u64,
    /// Distinct keys (comma-separated for several runs).
    #[arg(long, value_delimiter = ',', default_value = "100000")]
    pub keys: Vec<u64>,
    /// Parallelism (worker processes).
    #[arg(long, default_value_t = 2)]
    pub parallelism: u32,
    /// Input files (source partitions).
    #[arg(long, default_value_t = 4)]
    pub partitions: u32,
    /// Rounds per key count, the two paths alternating.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Directory for the input and the workers' logs (created if missing, emptied afterwards).
    #[arg(long, default_value = "keyshift-bench")]
    pub dir: PathBuf,
}

#[derive(Args, Debug)]
pub struct HotKeysBench {
    /// Records in the input files.
    #[arg(long, default_value_t = 4_000_000)]
    pub records: u64,
    /// Distinct keys.
    #[arg(long, default_value_t = 100_000)]
    pub keys: u64,
    /// The hottest key's share of the records (the Zipf exponent is chosen for it).
    #[arg(long, default_value_t = 0.3)]
    pub hot_share: f64,
    /// Parallelism (worker processes).
    #[arg(long, default_value_t = 4)]
    pub parallelism: u32,
    /// Input files (source partitions).
    #[arg(long, default_value_t = 4)]
    pub partitions: u32,
    /// Rounds, the two jobs alternating.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Directory for the input and the workers' logs (created if missing, emptied afterwards).
    #[arg(long, default_value = "keyshift-bench")]
    pub dir: PathBuf,
    /// Run the `page-views` program (an SDK window aggregate, counting per key in 10 s windows)
    /// instead of the built-in count, `spec.job.program.combine` on against off.
    #[arg(long)]
    pub program: bool,
}

/// Runs a benchmark (blocking; starts its own async runtime).
pub fn run(args: BenchArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        match args.command {
            BenchCommand::Snapshot(a) => state::snapshot_bench(a).await,
            BenchCommand::Rescale(a) => rescale::rescale_bench(a).await,
            BenchCommand::Throughput(a) => throughput::throughput_bench(a).await,
            BenchCommand::Keyed(a) => keyed::keyed_bench(a),
            BenchCommand::Checkpoint(a) if a.program => {
                program_checkpoint::program_checkpoint_bench(a).await
            }
            BenchCommand::Checkpoint(a) => state::checkpoint_bench(a).await,
            BenchCommand::Programs(a) => programs::programs_bench(a).await,
            BenchCommand::HotKeys(a) => hot_keys::hot_keys_bench(a).await,
            BenchCommand::Operator(a) => operator::run(a).await,
            #[cfg(feature = "kafka")]
            BenchCommand::Kafka(a) => kafka::run(a).await,
        }
    })
}
