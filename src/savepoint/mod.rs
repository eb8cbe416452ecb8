//! The `keyshift savepoint` subcommands: arguments, dispatch and rendering. The operations are
//! the runtime's offline library ([`crate::offline`]); this is the command over it.

// `keyshift savepoint bench-rewrite`: only with the `bench` feature.
#[cfg(feature = "bench")]
pub mod bench;

#[cfg(feature = "bench")]
use self::bench::{BenchOptions, BenchReport, bench_rewrite};
use crate::offline::dump::{dump_with_progress, parse_key_groups};
use crate::offline::inspect::{InspectReport, inspect};
use crate::offline::open_location;
use crate::offline::retention::{DisposeOptions, DisposeReport, JobListing, dispose, list_job};
use crate::offline::rewrite::{
    DEFAULT_MEMORY_BUDGET, Phase, Progress, RewriteOptions, RewriteReport, rewrite,
};
use crate::offline::verify::{VerifyOutcome, verify_keys_with_progress};
use crate::offline::{Result, ToolError};
use crate::output::Output;
use clap::{Args, Subcommand};
use std::fmt::Write as _;
use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// `keyshift savepoint ...` (its help text is set where the subcommand is declared).
#[derive(Args, Debug)]
pub struct SavepointArgs {
    #[command(subcommand)]
    pub command: SavepointCommand,
}

/// The long help of `keyshift savepoint`.
pub const SAVEPOINT_LONG_ABOUT: &str = "Offline tools for a job's snapshots (checkpoints and savepoints) in the object store. \
                  They need no running job and no job spec: blocks describe themselves.\n\n\
                  A snapshot URL names a snapshot directory, e.g. \
                  file:///var/lib/keyshift/default/clicks/savepoints/sp-7 or \
                  s3://bucket/prefix/default/clicks/checkpoints/chk-42 (S3/GCS/Azure credentials \
                  come from the usual AWS_*, GOOGLE_*, AZURE_* environment variables).";

/// Examples under `keyshift savepoint --help`.
pub const SAVEPOINT_EXAMPLES: &str = "Examples:
  # What a local run left, newest last
  keyshift savepoint list file://$PWD/keyshift-state/default/clicks
  # Check a savepoint completely before restoring it
  keyshift savepoint verify s3://bucket/keyshift/default/clicks/savepoints/sp-7
  # Move it to 256 key groups as a new savepoint
  keyshift savepoint rewrite s3://bucket/keyshift/default/clicks/savepoints/sp-7 -g 256 \\
      --to s3://bucket/keyshift/default/clicks/savepoints/sp-1007";

const LIST_EXAMPLES: &str = "Examples:
  keyshift savepoint list file://$PWD/keyshift-state/default/clicks
  keyshift savepoint list s3://bucket/keyshift/default/clicks -o json";

const INSPECT_EXAMPLES: &str = "Examples:
  keyshift savepoint inspect file://$PWD/keyshift-state/default/clicks/savepoints/sp-3
  # The 20 largest groups and keys, and every group
  keyshift savepoint inspect s3://bucket/keyshift/default/clicks/checkpoints/chk-42 --top 20 --groups
  keyshift savepoint inspect s3://bucket/keyshift/default/clicks/checkpoints/chk-42 -o yaml";

const VERIFY_EXAMPLES: &str = "Examples:
  keyshift savepoint verify file://$PWD/keyshift-state/default/clicks/savepoints/sp-3
  # In a script: the exit code says whether it is good
  keyshift savepoint verify s3://bucket/keyshift/default/clicks/checkpoints/chk-42 -o json > report.json";

const DUMP_EXAMPLES: &str = "Examples:
  keyshift savepoint dump file://$PWD/keyshift-state/default/clicks/savepoints/sp-3 | head
  # Only key groups 0 to 15, keys with a count above 1000
  keyshift savepoint dump s3://bucket/keyshift/default/clicks/savepoints/sp-7 --key-groups 0-15 \\
      | jq -c 'select(.value > 1000)'";

const REWRITE_EXAMPLES: &str = "Examples:
  # 128 -> 256 key groups, as savepoint 1007 of the same job
  keyshift savepoint rewrite s3://bucket/keyshift/default/clicks/savepoints/sp-7 -g 256 \\
      --to s3://bucket/keyshift/default/clicks/savepoints/sp-1007
  # Laid out for parallelism 8, spilling to a big disk, within 1 GiB of memory
  keyshift savepoint rewrite file:///data/ks/default/clicks/savepoints/sp-7 -g 256 -p 8 \\
      --to file:///data/ks/default/clicks/savepoints/sp-1007 --temp-dir /data/tmp --memory-mib 1024";

const DISPOSE_EXAMPLES: &str = "Examples:
  # What would go
  keyshift savepoint dispose s3://bucket/keyshift/default/clicks/checkpoints/chk-40 --dry-run
  keyshift savepoint dispose s3://bucket/keyshift/default/clicks/checkpoints/chk-40";

#[derive(Subcommand, Debug)]
pub enum SavepointCommand {
    /// List a job's committed checkpoints and savepoints (id, kind, time, parallelism, size).
    #[command(
        long_about = "List a job's committed checkpoints and savepoints: id, kind, completion time, \
                      parallelism, max parallelism, size and keys, and whether the job still needs it \
                      (newest checkpoint, newest snapshot, or pinned by the in-use marker \
                      <job>/_in_use.json). Directories without a manifest (aborted or in-progress \
                      snapshots) are not listed."
    ,
        after_help = LIST_EXAMPLES
    )]
    List(ListArgs),
    /// Show a snapshot's layout, source positions, watermark and state distribution (largest
    /// groups and keys).
    #[command(
        long_about = "Show what a snapshot holds: job, id, kind, time, max parallelism, parallelism, \
                      each subtask's key-group range, file, keys and bytes, the source positions and the \
                      watermark; then reads every block for the state distribution: keys and bytes per \
                      key group (spread, largest groups), the largest single keys by state bytes and, for \
                      count and sum jobs, the keys with the largest aggregate (a hot key shows there)."
    ,
        after_help = INSPECT_EXAMPLES
    )]
    Inspect(InspectArgs),
    /// Check every file, checksum and block of a snapshot, down to every key's group; exit 0 only
    /// if all is good.
    #[command(
        long_about = "Fully check a snapshot: the manifest is consistent, every state file is present \
                      with the manifest's size, every block's and file's CRC-32C matches, and every block \
                      decodes with a header matching the manifest (schema, max parallelism, key group, \
                      entry count) and keys that all hash to its key group. Every problem names its file. \
                      Exit code 0 only if all is good."
    ,
        after_help = VERIFY_EXAMPLES
    )]
    Verify(VerifyArgs),
    /// Print every key's state as JSON lines.
    #[command(
        long_about = "Print every key's state as JSON lines, in key-group order: \
                      {\"key\":..,\"keyType\":..,\"keyGroup\":..,\"value\":..} for jobs without a window, \
                      {\"key\":..,\"keyType\":..,\"keyGroup\":..,\"windows\":[{\"start\":..,\"end\":..,\"value\":..}]} \
                      for windowed jobs (one accumulator per open window). Keys are typed as stored \
                      (JSON strings, or numbers for long and int keys)."
    ,
        after_help = DUMP_EXAMPLES
    )]
    Dump(DumpArgs),
    /// Re-hash a snapshot into a new key-group count (max parallelism) as a new savepoint.
    #[command(
        long_about = "Re-hash every key of a snapshot into a new number of key groups (Flink's \
                      murmur(hashCode(key)) % G) and write a new, complete savepoint at --to: state files \
                      laid out by the new groups at the source's parallelism (or --parallelism), source \
                      positions, watermark and job identity carried over, stats.rewrittenFrom naming the \
                      source; the manifest is written last, create-only. The source is never modified; a \
                      target that already holds a manifest is refused.\n\n\
                      Memory stays near --memory-mib whatever the state size: entries are spilled to local \
                      files by new key group (--temp-dir needs about the state's size), then each new \
                      group's block is built and written in order. Progress and throughput go to stderr."
    ,
        after_help = REWRITE_EXAMPLES
    )]
    Rewrite(RewriteArgs),
    /// Delete a snapshot the job no longer needs (manifest first, then its files).
    #[command(
        long_about = "Delete a snapshot: its manifest first (from then on it no longer exists), then its \
                      files, then check nothing is left. Refused, unless --force, when the job still \
                      needs it: it is the job's newest checkpoint, or its newest snapshot of any kind, or \
                      it is listed in the in-use marker STORAGE/NAMESPACE/JOB/_in_use.json \
                      ({\"formatVersion\":1,\"snapshots\":[{\"path\":\"savepoints/sp-7\",\"holder\":..,\"reason\":..}]}); \
                      also refused when that marker is unreadable, or the directory has no manifest."
    ,
        after_help = DISPOSE_EXAMPLES
    )]
    Dispose(DisposeArgs),
    /// Benchmark `rewrite` against a raw copy of the same state (builds the state first; only
    /// with the `bench` feature).
    #[cfg(feature = "bench")]
    #[command(hide = true)]
    BenchRewrite(BenchArgs),
}

#[derive(Args, Debug)]
pub struct ListArgs {
    /// The job's directory: STORAGE_URL/NAMESPACE/JOB, e.g. s3://bucket/keyshift/default/clicks.
    pub job_url: String,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// The snapshot directory URL.
    pub url: String,
    /// How many of the largest groups and keys to show.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Also print every key group's keys and bytes (always included with -o json).
    #[arg(long)]
    pub groups: bool,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// The snapshot directory URL.
    pub url: String,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

#[derive(Args, Debug)]
pub struct DumpArgs {
    /// The snapshot directory URL.
    pub url: String,
    /// Only these key groups: A-B (inclusive) or A.
    #[arg(long, value_name = "A-B")]
    pub key_groups: Option<String>,
}

#[derive(Args, Debug)]
pub struct RewriteArgs {
    /// The source snapshot directory URL.
    pub url: String,
    /// The new key-group count (max parallelism), 1..=32768.
    #[arg(long, short = 'g', allow_negative_numbers = true)]
    pub max_parallelism: i64,
    /// The target snapshot directory URL, e.g. .../savepoints/sp-<new id>.
    #[arg(long)]
    pub to: String,
    /// The parallelism to lay the state files out for (default: the source's).
    #[arg(long, short = 'p', allow_negative_numbers = true)]
    pub parallelism: Option<i64>,
    /// Memory budget in MiB.
    #[arg(long, default_value_t = (DEFAULT_MEMORY_BUDGET / (1024 * 1024)) as u64)]
    pub memory_mib: u64,
    /// Directory for the spill files (default: the system temp directory).
    #[arg(long)]
    pub temp_dir: Option<PathBuf>,
    /// No progress lines on stderr.
    #[arg(long, short = 'q')]
    pub quiet: bool,
    /// Output format of the final report.
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

#[derive(Args, Debug)]
pub struct DisposeArgs {
    /// The snapshot directory URL: STORAGE/NAMESPACE/JOB/checkpoints/chk-<id> or
    /// .../savepoints/sp-<id>.
    pub url: String,
    /// Delete even if the job still needs it.
    #[arg(long)]
    pub force: bool,
    /// Only say what would be deleted.
    #[arg(long)]
    pub dry_run: bool,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

#[cfg(feature = "bench")]
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// State to build, MiB.
    #[arg(long, default_value_t = 1024)]
    pub state_mib: u64,
    /// Ballast bytes per key (entries are about this plus 22 bytes).
    #[arg(long, default_value_t = 380)]
    pub payload_bytes: usize,
    /// Key-group count of the input savepoint.
    #[arg(long, default_value_t = 128)]
    pub from_max_parallelism: u32,
    /// Key-group count to rewrite to.
    #[arg(long, default_value_t = 256)]
    pub to_max_parallelism: u32,
    /// Parallelism (state files).
    #[arg(long, default_value_t = 4)]
    pub parallelism: u32,
    /// Working directory (needs about 4x the state on disk).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Keep the files afterwards.
    #[arg(long)]
    pub keep: bool,
    /// The rewrite's memory budget, MiB.
    #[arg(long, default_value_t = (DEFAULT_MEMORY_BUDGET / (1024 * 1024)) as u64)]
    pub memory_mib: u64,
    /// Rounds of copy / rewrite / copy (medians are reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

/// Runs a `keyshift savepoint` subcommand, writing results to `out` (progress to stderr).
pub fn run(args: SavepointArgs, out: &mut dyn Write) -> Result<()> {
    // Few threads: the tools' work is a short pipeline (a couple of reads in flight, one CPU
    // stage, one write stage), and every extra thread that allocates big buffers gets its own
    // malloc arena, which keeps freed buffers resident and inflates memory far past the budget.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(4)
        .enable_all()
        .build()
        .map_err(ToolError::Runtime)?;
    runtime.block_on(dispatch(args.command, out))
}

fn emit(out: &mut dyn Write, text: &str) -> Result<()> {
    out.write_all(text.as_bytes()).map_err(ToolError::Output)
}

/// A report as `output` asks (`crate::output::render`).
fn render<T: serde::Serialize>(
    report: &T,
    output: Output,
    table: impl FnOnce(&T) -> String,
) -> Result<String> {
    crate::output::render(report, output, table).map_err(|e| ToolError::Render(e.to_string()))
}

async fn dispatch(command: SavepointCommand, out: &mut dyn Write) -> Result<()> {
    match command {
        SavepointCommand::List(a) => {
            let listing = list_job(&a.job_url).await?;
            let text = render(&listing, a.output, list_table)?;
            emit(out, &text)
        }
        SavepointCommand::Inspect(a) => {
            let loc = open_location(&a.url)?;
            let report = inspect(&loc, a.top).await?;
            let text = render(&report, a.output, |r| inspect_table(r, a.groups))?;
            emit(out, &text)
        }
        SavepointCommand::Verify(a) => {
            let loc = open_location(&a.url)?;
            let (report, bar) = meter(Unit::Bytes, "verify");
            let outcome = verify_keys_with_progress(&loc, &report).await;
            if let Some(bar) = bar {
                bar.finish_and_clear();
            }
            let outcome = outcome?;
            let text = render(&outcome, a.output, verify_table)?;
            emit(out, &text)?;
            if outcome.ok() {
                Ok(())
            } else {
                Err(ToolError::VerifyFailed {
                    url: outcome.url,
                    problems: outcome.problems.len(),
                })
            }
        }
        SavepointCommand::Dump(a) => {
            let range = a.key_groups.as_deref().map(parse_key_groups).transpose()?;
            let loc = open_location(&a.url)?;
            let (report, bar) = meter(Unit::KeyGroups, "dump");
            let done = dump_with_progress(&loc, range, out, &report).await;
            if let Some(bar) = bar {
                bar.finish_and_clear();
            }
            done.map(|_| ())
        }
        SavepointCommand::Rewrite(a) => {
            let bound = |v: i64| u32::try_from(v).unwrap_or(if v < 0 { 0 } else { u32::MAX });
            let mut opts = RewriteOptions::new(bound(a.max_parallelism));
            opts.parallelism = a.parallelism.map(bound);
            opts.memory_budget = mib(a.memory_mib);
            opts.temp_dir = a.temp_dir;
            if !a.quiet {
                opts.progress = Some(rewrite_progress());
            }
            // Bounds checks with the user's numbers (negative, huge) before anything is read.
            keyshift_core::keygroup::Assignment::new(a.parallelism.unwrap_or(1), a.max_parallelism)
                .map_err(|source| ToolError::Bounds {
                    what: "--max-parallelism/--parallelism".to_owned(),
                    source,
                })?;
            let report = rewrite(&a.url, &a.to, opts).await?;
            let text = render(&report, a.output, rewrite_table)?;
            emit(out, &text)
        }
        SavepointCommand::Dispose(a) => {
            let report = dispose(
                &a.url,
                DisposeOptions {
                    force: a.force,
                    dry_run: a.dry_run,
                },
            )
            .await?;
            let text = render(&report, a.output, dispose_text)?;
            emit(out, &text)
        }
        #[cfg(feature = "bench")]
        SavepointCommand::BenchRewrite(a) => {
            let report = bench_rewrite(BenchOptions {
                state_mib: a.state_mib,
                payload_bytes: a.payload_bytes,
                from_max_parallelism: a.from_max_parallelism,
                to_max_parallelism: a.to_max_parallelism,
                parallelism: a.parallelism,
                dir: a.dir,
                keep: a.keep,
                memory_budget: mib(a.memory_mib),
                runs: a.runs,
            })
            .await?;
            let text = render(&report, a.output, bench_text)?;
            emit(out, &text)
        }
    }
}

fn mib(n: u64) -> usize {
    usize::try_from(n.saturating_mul(1024 * 1024)).unwrap_or(usize::MAX)
}

/// Whether progress is drawn as a bar: stderr is a terminal and escapes are allowed there
/// (no `NO_COLOR`).
fn bar_wanted() -> bool {
    crate::telemetry::color_allowed(
        std::env::var_os("NO_COLOR").as_deref(),
        std::io::IsTerminal::is_terminal(&std::io::stderr()),
    )
}

/// What a progress bar counts.
#[derive(Clone, Copy)]
enum Unit {
    Bytes,
    KeyGroups,
}

/// A progress bar on stderr for `verify`, `dump` and `rewrite` (only on a terminal: see
/// [`bar_wanted`]; stdout keeps the data).
fn progress_bar(unit: Unit, label: &str) -> indicatif::ProgressBar {
    let template = match unit {
        Unit::Bytes => "{msg} [{bar:30}] {bytes} of {total_bytes} ({bytes_per_sec}, {eta} left)",
        Unit::KeyGroups => "{msg} [{bar:30}] {pos} of {len} key groups ({eta} left)",
    };
    let style = indicatif::ProgressStyle::with_template(template)
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> ");
    let bar =
        indicatif::ProgressBar::with_draw_target(Some(0), indicatif::ProgressDrawTarget::stderr())
            .with_style(style);
    bar.set_message(label.to_owned());
    bar
}

/// Progress of `verify` or `dump` on stderr: a bar on a terminal, otherwise a plain line every
/// 5 s (a short run prints none; its result says it all). Clear the bar with
/// `finish_and_clear` when done.
fn meter(
    unit: Unit,
    label: &'static str,
) -> (
    impl Fn(crate::offline::Advance) + Sync,
    Option<indicatif::ProgressBar>,
) {
    let bar = bar_wanted().then(|| progress_bar(unit, label));
    let shown = bar.clone();
    let last = Mutex::new(Instant::now());
    let report = move |a: crate::offline::Advance| {
        if let Some(bar) = &bar {
            bar.set_length(a.total);
            bar.set_position(a.done);
            return;
        }
        let mut last = last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if last.elapsed() < Duration::from_secs(5) {
            return;
        }
        *last = Instant::now();
        let _ = writeln!(std::io::stderr(), "{}", plain_progress(label, unit, a));
    };
    (report, shown)
}

/// A plain progress line: `verify: 45.0% (1.2 GiB of 2.6 GiB)`, `dump: 45.0% (58 of 128 key
/// groups)`.
fn plain_progress(label: &str, unit: Unit, a: crate::offline::Advance) -> String {
    let pct = if a.total == 0 {
        100.0
    } else {
        a.done as f64 * 100.0 / a.total as f64
    };
    let amount = match unit {
        Unit::Bytes => format!(
            "{} of {}",
            keyshift_core::text::bytes(a.done),
            keyshift_core::text::bytes(a.total)
        ),
        Unit::KeyGroups => format!("{} of {} key groups", a.done, a.total),
    };
    format!("{label}: {pct:.1}% ({amount})")
}

/// `rewrite`'s progress on stderr: a bar per pass on a terminal ([`bar_wanted`]), else
/// [`progress_printer`]'s lines.
fn rewrite_progress() -> Arc<dyn Fn(&Progress) + Send + Sync> {
    if !bar_wanted() {
        return progress_printer();
    }
    let bar = progress_bar(Unit::Bytes, "");
    let phase: Mutex<Option<Phase>> = Mutex::new(None);
    Arc::new(move |p: &Progress| {
        let mut phase = phase
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if *phase != Some(p.phase) {
            *phase = Some(p.phase);
            bar.reset();
            bar.set_message(phase_words(p.phase));
        }
        bar.set_length(p.total);
        bar.set_position(p.done);
        if p.done >= p.total && p.phase == Phase::Assemble {
            bar.finish_and_clear();
        }
    })
}

fn phase_words(phase: Phase) -> &'static str {
    match phase {
        Phase::Scatter => "scatter (read source, spill by new group)",
        Phase::Assemble => "assemble (build new blocks, write target)",
    }
}

/// Prints a progress line to stderr at most twice a second (and at the end of each pass).
fn progress_printer() -> Arc<dyn Fn(&Progress) + Send + Sync> {
    let last: Mutex<Option<Instant>> = Mutex::new(None);
    Arc::new(move |p: &Progress| {
        let mut last = last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        let finished = p.done >= p.total;
        if !finished && last.is_some_and(|t| now.duration_since(t) < Duration::from_millis(500)) {
            return;
        }
        *last = Some(now);
        let phase = phase_words(p.phase);
        let pct = if p.total == 0 {
            100.0
        } else {
            p.done as f64 * 100.0 / p.total as f64
        };
        let secs = p.elapsed.as_secs_f64().max(1e-9);
        let _ = writeln!(
            std::io::stderr(),
            "{phase}: {pct:5.1}%  {} of {}  {}  [{:.0}s elapsed]",
            keyshift_core::text::bytes(p.done),
            keyshift_core::text::bytes(p.total),
            keyshift_core::text::count(p.keys, "key"),
            secs
        );
    })
}

fn list_table(l: &JobListing) -> String {
    let mut s = String::new();
    if l.snapshots.is_empty() {
        let _ = writeln!(s, "no committed snapshots under {}", l.url);
    } else {
        let _ = writeln!(
            s,
            "{:<10}  {:>6}  {:<24}  {:>4}  {:>5}  {:>10}  {:>10}  IN USE",
            "KIND", "ID", "COMPLETED", "P", "MAXP", "SIZE", "KEYS"
        );
        for r in &l.snapshots {
            let opt = |v: Option<u64>| v.map_or_else(|| "?".to_owned(), |v| v.to_string());
            let used: Vec<&str> = r.in_use.iter().map(|u| u.rule).collect();
            let _ = writeln!(
                s,
                "{:<10}  {:>6}  {:<24}  {:>4}  {:>5}  {:>10}  {:>10}  {}",
                r.kind.to_string(),
                r.id,
                r.completed_at
                    .map_or_else(|| "?".to_owned(), |t| format!("{t:.0}")),
                opt(r.parallelism.map(u64::from)),
                opt(r.max_parallelism.map(u64::from)),
                r.bytes
                    .map_or_else(|| "?".to_owned(), keyshift_core::text::bytes),
                opt(r.keys),
                if used.is_empty() {
                    "-".to_owned()
                } else {
                    used.join(",")
                }
            );
            if let Some(e) = &r.error {
                let _ = writeln!(s, "  ^ unreadable: {e}");
            }
        }
    }
    if let Some(e) = &l.marker_error {
        let _ = writeln!(s, "warning: {e}");
    }
    s
}

fn inspect_table(r: &InspectReport, all_groups: bool) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "snapshot:         {} {} of job {}/{}",
        r.kind, r.snapshot_id, r.job.namespace, r.job.name
    );
    let _ = writeln!(s, "url:              {}", r.url);
    let _ = writeln!(s, "completed:        {:.3}", r.completed_at);
    let _ = writeln!(s, "max parallelism:  {}", r.max_parallelism);
    let _ = writeln!(s, "parallelism:      {}", r.parallelism);
    let state = match (r.function, r.window_size_ms) {
        (None, _) => "no state".to_owned(),
        (Some(f), None) => format!("{}, no window", crate::offline::function_name(f)),
        (Some(f), Some(w)) => format!(
            "{}, tumbling {w} ms windows",
            crate::offline::function_name(f)
        ),
    };
    let _ = writeln!(s, "state:            {state} (schema {})", r.state_schema);
    let wm = r.watermark.map_or_else(
        || "none".to_owned(),
        |w| {
            jiff::Timestamp::from_millisecond(w)
                .map_or_else(|_| w.to_string(), |t| format!("{w} ({t})"))
        },
    );
    let _ = writeln!(s, "watermark:        {wm}");
    if r.source_partitions.is_empty() {
        let positions: Vec<String> = r
            .source_positions
            .iter()
            .map(|(p, o)| format!("{p}={o}"))
            .collect();
        let _ = writeln!(
            s,
            "source positions: {}",
            if positions.is_empty() {
                "none".to_owned()
            } else {
                positions.join(" ")
            }
        );
    } else {
        // File partitions: one line each, the file beside its offset (a restore matches by name).
        let _ = writeln!(
            s,
            "source positions: {} files (partition, file, byte offset)",
            r.source_positions.len()
        );
        for (p, o) in &r.source_positions {
            let name = r.source_partitions.get(p).map_or("?", String::as_str);
            let _ = writeln!(s, "  {p:>4}  {name}  {o}");
        }
    }
    let _ = writeln!(
        s,
        "total:            {} keys, {} in {} of {} key groups",
        r.total_keys,
        keyshift_core::text::bytes(r.total_bytes),
        r.non_empty_groups,
        r.max_parallelism
    );
    if !r.operator_state.is_empty() {
        let _ = writeln!(
            s,
            "operator state:   {} states (entries per subtask of the run that wrote them)",
            r.operator_state.len()
        );
        for o in &r.operator_state {
            let per: Vec<String> = o.entries.iter().map(u64::to_string).collect();
            let _ = writeln!(
                s,
                "  {}  {}, redistribution {}, {} entries [{}], {}",
                o.name,
                o.kind,
                o.redistribution,
                o.entries.iter().sum::<u64>(),
                per.join(" "),
                keyshift_core::text::bytes(o.bytes)
            );
        }
    }
    if let Some(from) = r.notes.get("rewrittenFrom") {
        let _ = writeln!(
            s,
            "rewritten from:   {} (maxParallelism {}, parallelism {})",
            from["url"].as_str().unwrap_or("?"),
            from["maxParallelism"],
            from["parallelism"]
        );
    }
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "{:>7}  {:>11}  {:>10}  {:>10}  FILE",
        "SUBTASK", "KEY GROUPS", "KEYS", "BYTES"
    );
    for t in &r.subtasks {
        let _ = writeln!(
            s,
            "{:>7}  {:>11}  {:>10}  {:>10}  {}",
            t.index,
            format!("{}-{}", t.key_groups[0], t.key_groups[1]),
            t.keys,
            keyshift_core::text::bytes(t.bytes),
            t.file
        );
    }
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "per key group: bytes min {} / median {} / max {} (max {:.2}x the mean); keys min {} / median {} / max {}",
        keyshift_core::text::bytes(r.group_bytes.min),
        keyshift_core::text::bytes(r.group_bytes.median),
        keyshift_core::text::bytes(r.group_bytes.max),
        r.group_bytes.max_over_mean,
        r.group_keys.min,
        r.group_keys.median,
        r.group_keys.max
    );
    if !r.largest_groups.is_empty() {
        let _ = writeln!(s);
        let _ = writeln!(s, "largest key groups:");
        let _ = writeln!(s, "{:>9}  {:>10}  {:>10}", "KEY GROUP", "KEYS", "BYTES");
        for g in &r.largest_groups {
            let _ = writeln!(
                s,
                "{:>9}  {:>10}  {:>10}",
                g.key_group,
                g.keys,
                keyshift_core::text::bytes(g.bytes)
            );
        }
    }
    let keys = |s: &mut String, title: &str, list: &[crate::offline::inspect::KeyStat]| {
        if list.is_empty() {
            return;
        }
        let _ = writeln!(s);
        let _ = writeln!(s, "{title}:");
        let _ = writeln!(
            s,
            "{:>9}  {:>8}  {:>20}  {:>7}  {:<6}  KEY",
            "KEY GROUP", "BYTES", "VALUE", "WINDOWS", "TYPE"
        );
        for k in list {
            let _ = writeln!(
                s,
                "{:>9}  {:>8}  {:>20}  {:>7}  {:<6}  {}",
                k.key_group,
                k.bytes,
                k.value.map_or_else(|| "-".to_owned(), |v| v.to_string()),
                k.windows,
                k.key_type.to_string(),
                k.key
            );
        }
    };
    keys(&mut s, "largest keys by state bytes", &r.largest_keys);
    let by_value = match r.function {
        Some(crate::crd::AggregateFunction::Count) => "largest keys by count",
        _ => "largest keys by sum",
    };
    keys(&mut s, by_value, &r.top_keys_by_value);
    if all_groups {
        let _ = writeln!(s);
        let _ = writeln!(s, "{:>9}  {:>10}  {:>12}", "KEY GROUP", "KEYS", "BYTES");
        for g in &r.groups {
            let _ = writeln!(s, "{:>9}  {:>10}  {:>12}", g.key_group, g.keys, g.bytes);
        }
    }
    s
}

fn verify_table(v: &VerifyOutcome) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{} {} at {} (maxParallelism {}, parallelism {})",
        v.kind, v.snapshot_id, v.url, v.max_parallelism, v.parallelism
    );
    for f in &v.files {
        match &f.problem {
            None => {
                let _ = writeln!(
                    s,
                    "  ok    {}  {}, {} blocks, {} keys",
                    f.name,
                    keyshift_core::text::bytes(f.size),
                    f.blocks_checked,
                    f.keys_checked
                );
            }
            Some(p) => {
                let _ = writeln!(s, "  FAIL  {}  {p}", f.name);
            }
        }
    }
    for p in v
        .problems
        .iter()
        .filter(|p| !v.files.iter().any(|f| f.problem.as_ref() == Some(p)))
    {
        let _ = writeln!(s, "  FAIL  {p}");
    }
    for w in &v.warnings {
        let _ = writeln!(s, "  warning: {w}");
    }
    if v.ok() {
        let _ = writeln!(
            s,
            "OK: {} files, {} and {} keys checked",
            v.files.len(),
            keyshift_core::text::bytes(v.bytes_checked),
            v.keys_checked
        );
    } else {
        let _ = writeln!(
            s,
            "FAILED: {}",
            keyshift_core::text::count(v.problems.len() as u64, "problem")
        );
    }
    s
}

fn rewrite_table(r: &RewriteReport) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "rewrote {} (maxParallelism {}, parallelism {})\n     to {} (maxParallelism {}, parallelism {}, savepoint {})",
        r.source,
        r.from_max_parallelism,
        r.from_parallelism,
        r.target,
        r.max_parallelism,
        r.parallelism,
        r.snapshot_id
    );
    let _ = writeln!(
        s,
        "{} keys, {} read, {} written, {} spilled in {} buckets (largest {})",
        r.keys,
        keyshift_core::text::bytes(r.bytes_read),
        keyshift_core::text::bytes(r.bytes_written),
        keyshift_core::text::bytes(r.spill_bytes),
        r.buckets,
        keyshift_core::text::bytes(r.largest_bucket_bytes)
    );
    let _ = writeln!(
        s,
        "{:.2}s (scatter {:.2}s, assemble {:.2}s, commit {:.2}s): {:.1} MB/s, {:.0} keys/s",
        r.total_secs,
        r.scatter_secs,
        r.assemble_secs,
        r.commit_secs,
        r.mb_per_sec(),
        r.keys_per_sec()
    );
    let t = &r.timings;
    let _ = writeln!(
        s,
        "  scatter: waiting for reads {:.2}s, decoding and spilling {:.2}s; split {:.2}s; assemble: building {:.2}s (waited {:.2}s), writing {:.2}s",
        t.read_wait, t.scatter_work, t.split, t.build, t.build_wait, t.write
    );
    s
}

fn dispose_text(r: &DisposeReport) -> String {
    let mut s = String::new();
    for reason in &r.forced_over {
        let _ = writeln!(s, "warning: --force overrides: {reason}");
    }
    let verb = if r.dry_run { "would delete" } else { "deleted" };
    let _ = writeln!(
        s,
        "{verb} {} ({}): {}, {}{}",
        r.url,
        if r.committed {
            "committed"
        } else {
            "uncommitted"
        },
        keyshift_core::text::count(r.objects as u64, "object"),
        keyshift_core::text::bytes(r.bytes),
        if r.committed { ", manifest first" } else { "" }
    );
    if r.kept_referenced > 0 {
        let _ = writeln!(
            s,
            "kept {} that other snapshots of the job still read (checkpoint retention deletes them once none does)",
            keyshift_core::text::count(r.kept_referenced as u64, "file")
        );
    }
    s
}

#[cfg(feature = "bench")]
fn bench_text(b: &BenchReport) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "machine: {} ({} CPUs), {:.1} GiB RAM, {}; load average {} before, {} after",
        b.machine.cpu,
        b.machine.cpus,
        b.machine.memory_gib,
        b.machine.os,
        b.machine.load_before,
        b.machine.load_after
    );
    let _ = writeln!(
        s,
        "state:   {} ({} bytes) in {} files, {} keys x ~{} B (payload {} B); built in {:.1}s",
        keyshift_core::text::bytes(b.state_bytes),
        b.state_bytes,
        b.files,
        b.keys,
        b.state_bytes / b.keys.max(1),
        b.payload_bytes,
        b.build_secs
    );
    for (i, run) in b.runs.iter().enumerate() {
        let r = &run.rewrite;
        let _ = writeln!(
            s,
            "run {}: raw copy (fs::copy + fsync) {:.2}s / {:.2}s -> {:.1} MB/s; rewrite {} -> {} groups at parallelism {}: {:.2}s -> {:.1} MB/s, {:.0} keys/s; ratio {:.3}; verified {}",
            i + 1,
            run.copy_before_secs,
            run.copy_after_secs,
            run.copy_mb_per_sec,
            r.from_max_parallelism,
            r.max_parallelism,
            r.parallelism,
            r.total_secs,
            run.rewrite_mb_per_sec,
            r.keys_per_sec(),
            run.ratio,
            if run.verified { "yes" } else { "NO" }
        );
        let t = &r.timings;
        let _ = writeln!(
            s,
            "       scatter {:.2}s (reads {:.2}s, decode+spill {:.2}s), split {:.2}s, assemble {:.2}s (build {:.2}s, waited {:.2}s, write {:.2}s), commit {:.2}s; {} buckets, {} spilled",
            r.scatter_secs,
            t.read_wait,
            t.scatter_work,
            t.split,
            r.assemble_secs,
            t.build,
            t.build_wait,
            t.write,
            r.commit_secs,
            r.buckets,
            keyshift_core::text::bytes(r.spill_bytes)
        );
    }
    let _ = writeln!(
        s,
        "median: raw copy {:.1} MB/s, rewrite {:.1} MB/s ({:.0} keys/s), ratio rewrite / raw copy {:.3}",
        b.copy_mb_per_sec, b.rewrite_mb_per_sec, b.rewrite_keys_per_sec, b.ratio
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_progress_reads_as_words() {
        let a = crate::offline::Advance {
            done: 58,
            total: 128,
        };
        assert_eq!(
            plain_progress("dump", Unit::KeyGroups, a),
            "dump: 45.3% (58 of 128 key groups)"
        );
        let a = crate::offline::Advance {
            done: 1536,
            total: 3072,
        };
        assert_eq!(
            plain_progress("verify", Unit::Bytes, a),
            "verify: 50.0% (1.5 KiB of 3.0 KiB)"
        );
    }

    #[test]
    fn bytes_are_human() {
        assert_eq!(keyshift_core::text::bytes(512), "512 B");
        assert_eq!(keyshift_core::text::bytes(1536), "1.5 KiB");
        assert_eq!(keyshift_core::text::bytes(1 << 30), "1.0 GiB");
    }
}
