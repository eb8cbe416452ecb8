//! `keyshift bench snapshot` and `keyshift bench checkpoint`: writing and reading keyed state
//! against raw file I/O, and what an incremental checkpoint writes and holds up.

use super::measure::*;
use super::{CheckpointBench, SnapshotBench};
use crate::crd::AggregateFunction;
use crate::job::{AggConfig, KeyedAggregator, Record, RecordKey};
use crate::runtime::checkpoint::{self, StateWriteOptions, Updates};
use crate::runtime::restore::{self, RestoreOptions};
use crate::snapshot::{self, JobIdentity, Manifest, SnapshotKind, SnapshotMeta, SnapshotWriter};
use anyhow::{Result, bail};
use bytes::Bytes;
use keyshift_core::keygroup::Assignment;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One subtask's encoded blocks: `(group, block, entries)` in group order.
type Blocks = Arc<Vec<(u32, Bytes, u64)>>;

/// What one subtask's checkpoint took: how long it held records up (the cut), its whole write
/// (cut + upload, durable), and its acknowledgement.
pub(super) struct SubtaskCheckpoint {
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
pub(super) async fn checkpoint_subtask(
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
    let policy = crate::runtime::incremental::ChainPolicy::default()
        .for_checkpoint(false, assignment.max_parallelism());
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
        taken.into_upload(),
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

pub(super) async fn checkpoint_bench(args: CheckpointBench) -> Result<()> {
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
        let acks = done.into_iter().map(|d| d.ack).collect();
        let (manifest, written) =
            commit_checkpoint(store.as_ref(), &dir, meta(id), assignment, acks).await?;
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
// snapshot

/// Commits a checkpoint of `acks` (its manifest, create-only): the manifest, and the bytes the
/// checkpoint wrote (a delta's, or the whole state's).
pub(super) async fn commit_checkpoint(
    store: &dyn snapshot::ObjectStore,
    dir: &snapshot::Path,
    meta: SnapshotMeta,
    assignment: Assignment,
    acks: Vec<snapshot::SubtaskSnapshot>,
) -> Result<(Manifest, u64)> {
    let manifest = Manifest::assemble(meta, assignment, acks)?;
    snapshot::commit_manifest(store, dir, &manifest).await?;
    let written = manifest
        .stats
        .written_bytes
        .unwrap_or(manifest.stats.total_bytes);
    Ok((manifest, written))
}

pub(super) fn string_key(i: u64) -> RecordKey {
    RecordKey::string(format!("key-{i}"))
}

pub(super) fn meta(id: u64) -> SnapshotMeta {
    SnapshotMeta {
        job: JobIdentity {
            namespace: "bench".into(),
            name: "snapshot".into(),
            job_fingerprint: "bench".into(),
            layout: None,
        },
        snapshot_id: id,
        kind: SnapshotKind::Checkpoint,
        completed_at: jiff::Timestamp::now(),
        state_schema: crate::job::AGG_SCHEMA.into(),
        source_positions: Default::default(),
        source_partitions: Default::default(),
        watermark: None,
    }
}

/// A subtask's operator, shared with the task that snapshots it.
pub(super) type SharedAgg = Arc<tokio::sync::Mutex<KeyedAggregator>>;

/// How [`write_subtask`] writes: the worker's path (its encoder threads, draining the changed
/// keys' results or not), or blocks encoded beforehand (the snapshot layer alone).
#[derive(Clone)]
pub(super) enum WritePath {
    Worker(StateWriteOptions),
    PreEncoded(Vec<Blocks>),
}

/// The worker's snapshot path for one subtask (`checkpoint::write_state`: encode, write, finish
/// = durable), or the write alone of pre-encoded blocks.
pub(super) async fn write_subtask(
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

pub(super) async fn write_snapshot(
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
pub(super) async fn read_snapshot(
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

pub(super) fn state_files(root: &Path, dir: &snapshot::Path, manifest: &Manifest) -> Vec<PathBuf> {
    manifest
        .files
        .iter()
        .map(|f| root.join(dir.as_ref()).join(&f.name))
        .collect()
}

pub(super) async fn snapshot_bench(args: SnapshotBench) -> Result<()> {
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
