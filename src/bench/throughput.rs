//! `keyshift bench throughput`: steady-state records/s of a keyed count through `LocalJob`, and
//! the workers' peak memory.

use super::ThroughputBench;
use super::job::*;
use super::measure::*;
use crate::local::LocalJob;
use anyhow::{Result, bail};
use std::path::Path;
use std::time::{Duration, Instant};

pub(super) struct ThroughputRow {
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
    pub(super) fn cores(&self) -> f64 {
        self.cpu.as_secs_f64() / self.wall.as_secs_f64().max(1e-9)
    }
    /// Records per second of worker CPU time: what the machine's load does not change much.
    pub(super) fn per_cpu_second(&self) -> f64 {
        self.rate / self.cores().max(1e-9)
    }
}

pub(super) async fn throughput_once(
    args: &ThroughputBench,
    run: &Path,
    keys: u64,
    p: u32,
) -> Result<ThroughputRow> {
    let partitions = args.partitions.max(p);
    let generator = format!("{{partitions: {partitions}, keys: {keys}, seed: 3}}");
    let name = format!("throughput-{keys}-{p}");
    let storage = format!("file://{}", run.join("store").display());
    let job = job_manifest(
        &name,
        p,
        128,
        &generator,
        Operator::Count {
            key_type: &args.key_type,
        },
        &storage,
    )?;
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

pub(super) async fn throughput_bench(args: ThroughputBench) -> Result<()> {
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
