//! `keyshift bench programs`: the whole worker path of a program against the built-in job's,
//! in the same run: the same JSON-lines files, the same keyed count (the built-in `count` and the
//! `count` program keyshift's worker carries), worker processes under `LocalJob`, records/s from
//! the first record to the last, and the worker CPU time each path used.

use super::ProgramsBench;
use super::job::processed;
use super::measure::*;
use crate::local::LocalJob;
use anyhow::{Context as _, Result, bail};
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

/// Which path a run measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Builtin,
    Program,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Builtin => "built-in count",
            Side::Program => "count program",
        }
    }

    /// The job's `spec.job` lines (below `job:`), over the files in `input`.
    fn job(self, input: &Path) -> String {
        let source = format!("    source:\n      file: {{path: '{}'}}\n", input.display());
        match self {
            Side::Builtin => {
                format!("{source}    key: {{field: key}}\n    aggregation: {{function: count}}\n")
            }
            Side::Program => format!("{source}    program: {{name: count}}\n"),
        }
    }
}

/// Writes `records` lines `{"key":"key-<k>","ts":<i>}` over `partitions` files, keys drawn
/// from `keys` with a fixed sequence.
fn write_input(dir: &Path, records: u64, keys: u64, partitions: u32) -> Result<()> {
    write_lines(dir, records, partitions, |f, x, i| {
        writeln!(f, "{{\"key\":\"key-{}\",\"ts\":{i}}}", x % keys)
    })
}

/// Writes `records` lines over `partitions` files (round robin): line `i` is what `line(file,
/// x, i)` writes, for a fixed sequence of uniform 64-bit numbers `x`.
pub(super) fn write_lines(
    dir: &Path,
    records: u64,
    partitions: u32,
    mut line: impl FnMut(&mut std::io::BufWriter<std::fs::File>, u64, u64) -> std::io::Result<()>,
) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut files = (0..partitions)
        .map(|p| {
            std::fs::File::create(dir.join(format!("part-{p}.jsonl")))
                .map(|f| std::io::BufWriter::with_capacity(1 << 20, f))
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for i in 0..records {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        line(&mut files[(i % u64::from(partitions)) as usize], x, i)?;
    }
    for mut f in files {
        f.flush()?;
    }
    Ok(())
}

pub(super) struct Run {
    pub(super) rate: f64,
    pub(super) cpu: Duration,
    pub(super) keys_in_state: u64,
}

async fn run_once(
    args: &ProgramsBench,
    run: &Path,
    input: &Path,
    path: Side,
    round: u32,
) -> Result<Run> {
    let name = format!(
        "programs-{}-{round}",
        if path == Side::Builtin { "b" } else { "p" }
    );
    run_job(
        run,
        &name,
        args.parallelism,
        args.records,
        &path.job(input),
        path.name(),
    )
    .await
}

/// Runs the job `name` (its `spec.job` lines `job`) at `parallelism` under `LocalJob` until it
/// processed `records`: records/s from the launch to the last, the workers' CPU time.
pub(super) async fn run_job(
    run: &Path,
    name: &str,
    parallelism: u32,
    records: u64,
    job: &str,
    what: &str,
) -> Result<Run> {
    let storage = format!("file://{}", run.join("store").display());
    let yaml = format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {{name: {name}, namespace: bench}}
spec:
  replicas: {parallelism}
  maxParallelism: 128
  state:
    storage: {storage}
    checkpointInterval: 1h
  job:
{job}"
    );
    let job = serde_yaml::from_str(&yaml).context("bench manifest")?;
    let bin = std::env::current_exe()?;
    let mut local = LocalJob::new(&job, storage, bin, run.join("logs")).await?;
    local.launch(parallelism, None).await?;
    let result = async {
        let pids = local.worker_pids();
        let cpu0: Duration = pids.iter().map(|p| cpu_time(*p)).sum();
        let t0 = Instant::now();
        let deadline = t0 + Duration::from_secs(600);
        loop {
            tokio::time::sleep(Duration::from_millis(20)).await;
            if let Some((i, status)) = local.failed_worker() {
                bail!("worker {i} exited ({status})");
            }
            let (n, _) = processed(&mut local).await?;
            if n >= records {
                let wall = t0.elapsed();
                let cpu = pids.iter().map(|p| cpu_time(*p)).sum::<Duration>() - cpu0;
                // Untimed: a checkpoint, after which a program's count of its state entries
                // is exact (it is counted at its cuts, not per record).
                local.checkpoint().await?;
                let (_, keys) = processed(&mut local).await?;
                return Ok(Run {
                    rate: n as f64 / wall.as_secs_f64(),
                    cpu,
                    keys_in_state: keys,
                });
            }
            if Instant::now() > deadline {
                bail!("{what}: {n} of {records} records in 600 s");
            }
        }
    }
    .await;
    local.stop().await;
    result
}

pub(super) async fn programs_bench(args: ProgramsBench) -> Result<()> {
    let run = prepare_dir(&args.dir, "programs")?;
    println!(
        "keyshift bench programs: keyed count over {} JSON lines in {} files at parallelism {}, built-in job against the count program, {} rounds alternating",
        args.records, args.partitions, args.parallelism, args.rounds
    );
    println!("machine: {}", context_line());
    let mut table = Vec::new();
    for &keys in &args.keys {
        let input = run.join(format!("input-{keys}"));
        write_input(&input, args.records, keys, args.partitions)?;
        for round in 0..args.rounds {
            let b = run_once(&args, &run, &input, Side::Builtin, round).await?;
            let p = run_once(&args, &run, &input, Side::Program, round).await?;
            println!(
                "  keys {keys}, round {round}: built-in {:.2} M records/s ({:.2} CPU-s, {} keys), program {:.2} M records/s ({:.2} CPU-s, {} state entries): {:.2}x",
                b.rate / 1e6,
                b.cpu.as_secs_f64(),
                b.keys_in_state,
                p.rate / 1e6,
                p.cpu.as_secs_f64(),
                p.keys_in_state,
                p.rate / b.rate
            );
            table.push((keys, round, b, p));
        }
        std::fs::remove_dir_all(&input)?;
    }
    let _ = std::fs::remove_dir_all(&run);
    println!("machine at the end: load average {}", loadavg());
    println!();
    println!(
        "| keys | round | built-in records/s | count program records/s | program / built-in | CPU-s built-in | CPU-s program | CPU ratio |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for (keys, round, b, p) in table {
        println!(
            "| {keys} | {round} | {:.2} M | {:.2} M | {:.2} | {:.2} | {:.2} | {:.2} |",
            b.rate / 1e6,
            p.rate / 1e6,
            p.rate / b.rate,
            b.cpu.as_secs_f64(),
            p.cpu.as_secs_f64(),
            p.cpu.as_secs_f64() / b.cpu.as_secs_f64().max(1e-9)
        );
    }
    Ok(())
}
