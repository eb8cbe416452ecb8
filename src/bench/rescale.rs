//! `keyshift bench rescale`: the pause of a `LocalJob` rescale (stop-and-restore, or pre-staged
//! with the workers' memory) against a raw write and read of the state's bytes.

use super::RescaleBench;
use super::job::*;
use super::measure::*;
use crate::local::LocalJob;
use anyhow::{Context as _, Result, bail};
use std::time::{Duration, Instant};

/// What a pre-staged rescale measured besides its report.
pub(super) struct PrestageNumbers {
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

pub(super) async fn rescale_bench(args: RescaleBench) -> Result<()> {
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
        if args.program {
            Operator::Program(super::map_program::NAME)
        } else {
            Operator::Count { key_type: "string" }
        },
        &storage,
    )?;
    let state = if args.program {
        format!(
            "the program {} (map state: {} entries x {} B)",
            super::map_program::NAME,
            super::map_program::FIELDS,
            super::map_program::PAYLOAD
        )
    } else {
        format!("the built-in count ({} B payload)", args.payload)
    };
    println!(
        "keyshift bench rescale: {} MiB target, {keys} string keys, {state}, {} -> {} of {} key groups; {total_records} records ({per_key:.1} per key) over {partitions} partitions; in {}",
        args.state_mib,
        args.from,
        args.to,
        args.max_parallelism,
        run.display()
    );
    println!("machine: {ctx_start}");

    let bin = std::env::current_exe()?;
    let mut local = LocalJob::new(&job, storage, bin, run.join("logs")).await?;
    if !args.program {
        local.state_payload_bytes = args.payload;
    }
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
            recorded_at: format!("{:.0}", jiff::Timestamp::now()),
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
pub(super) fn round3(secs: f64) -> f64 {
    (secs * 1000.0).round() / 1000.0
}

pub(super) async fn rescale_steps(
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

/// The pre-staged rescale of `bench rescale --prestage`, on the built state: the job is
/// stopped with a savepoint and resumed under a steady paced load, checkpoints (a full one,
/// then an incremental one after `settle_secs`), and after `settle_secs` more rescales
/// pre-staged.
pub(super) async fn prestaged_rescale(
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
