//! The snapshot cut at an aligned barrier: the key groups written to the object store (full,
//! incremental or captured in steps), the sink's output staged, and the snapshot acknowledged.

use super::*;

/// Writes snapshot `id` at its aligned barrier; `None` if it was aborted before it began
/// (nothing is written or drained then: this subtask's output rides with the next snapshot).
///
/// A snapshot holds records up only for its cut (the entries it writes copied out: the changed
/// keys' for a checkpoint that builds on the previous one ([`incremental`]), every key's
/// otherwise; the results drained and staged in memory): its upload runs in a task while
/// records flow, and it is acknowledged when the upload is durable. A snapshot waits for the
/// upload before it takes its own cut. Only a savepoint that stops the job, with nothing to
/// flow after it, is written on the spot.
pub(super) async fn snapshot(
    s: &Arc<Shared>,
    sub: &mut Subtask,
    id: u64,
    watermark: i64,
) -> Result<Option<Written>, WorkerError> {
    // The snapshot before: its cut completed, its upload done.
    complete_capture(s, sub).await?;
    if let Some(u) = sub.uploading.take() {
        let written = u
            .task
            .await
            .map_err(|e| WorkerError::Fatal(format!("checkpoint upload task: {e}")))??;
        match (u.kind, written) {
            (snapshot::SnapshotKind::Savepoint, _) => {}
            (_, Some(w)) => sub
                .chain
                .written(incremental::Base::written(u.id, u.cut, &w)),
            // It failed or was aborted: the next checkpoint is full.
            (_, None) => sub.chain.reset(),
        }
    }
    let cut = {
        let mut ledger = s.ledger.lock().await;
        match ledger.take_cut(id) {
            Some(cut) => cut,
            None if ledger.is_aborted(id) => return Ok(None),
            None => {
                return Err(WorkerError::Fatal(format!(
                    "barrier {id} was not injected here"
                )));
            }
        }
    };
    let BarrierCut {
        kind,
        positions,
        at: started,
        last_committed,
        stop,
    } = cut;
    // Non-windowed results go out with each checkpoint (windowed ones when windows fire): the
    // changed keys are drained in the same pass that encodes the state (on
    // KEYSHIFT_ENCODE_THREADS threads, 1 by default), and are on stdout (log sink) or in the sink
    // buffer (object-store sink) before the ack.
    let updates = if !sub.keyed.drains_updates() {
        Updates::Skip
    } else if sub.sink_log && sub.sink.is_none() {
        Updates::Log
    } else {
        Updates::Keep
    };
    crate::failpoints::slow_snapshot(&sub.job.0, &sub.job.1, sub.subtask, id).await;
    let dir = snapshot::snapshot_dir(&sub.job_dir, kind, id);
    let writer = SnapshotWriter::new(sub.store.clone(), &dir, sub.assignment, sub.subtask)?;
    let base = match kind {
        snapshot::SnapshotKind::Checkpoint => sub.chain.base_for(last_committed).cloned(),
        // Savepoints are self-contained.
        snapshot::SnapshotKind::Savepoint => None,
    };
    let cut_epoch = sub.keyed.cut();
    // Records flow while the state is written, except after a stop snapshot without a base
    // (a savepoint that stops the job): nothing flows after it, so it is encoded and written
    // on the spot, on the encoder threads, without copying the state first.
    // A program's groups are encoded at the barrier, whatever the snapshot.
    if base.is_some() || !stop || matches!(sub.keyed, Keyed::Program(_)) {
        let policy = sub
            .chain
            .policy
            .for_checkpoint(stop, sub.assignment.max_parallelism());
        // A delta's changed keys are copied after the barrier while records flow, except for
        // a stop snapshot (nothing flows after it).
        let mut taken = match &mut sub.keyed {
            Keyed::Aggregate(agg) => checkpoint::take_cut(agg, base.as_ref(), updates, !stop).await,
            Keyed::Program(step) => checkpoint::take_program_cut(
                step,
                base.as_ref(),
                (sub.subtask, sub.assignment.parallelism()),
            )
            .map_err(job::JobError::from)?,
        };
        s.metrics.records_out.inc_by(taken.rows);
        emit_lines(
            sub,
            std::mem::take(&mut taken.lines),
            taken.rows,
            Lines::AtBarrier,
        )?;
        // The rows since the last barrier are this snapshot's: sealed now, before any record
        // after the barrier can emit more (a cut still being copied adds its own later).
        if let Some(sink) = &mut sub.sink {
            sink.staging
                .seal(id, job::staging::Committed::from_wire(last_committed))?;
        }
        let cut = CutTaken {
            id,
            kind,
            cut_epoch,
            positions,
            started,
            blocked_ms: started.elapsed().as_millis() as u64,
            watermark,
            writer,
            dir,
            base,
            policy,
            taken,
        };
        tracing::debug!(
            id,
            base = cut.base.as_ref().map(|b| b.id),
            entries = cut.taken.entries(),
            capturing = cut.taken.capturing,
            blocked_ms = cut.blocked_ms,
            "snapshot cut taken"
        );
        if cut.taken.capturing {
            sub.capturing = Some(cut);
            return Ok(Some(Written::Capturing));
        }
        return complete_cut(s, sub, cut)
            .await
            .map(|u| Some(Written::Uploading(u)));
    }
    let opts = StateWriteOptions {
        threads: StateWriteOptions::threads_for(sub.keyed.key_count()),
        updates,
    };
    let Keyed::Aggregate(agg) = &mut sub.keyed else {
        return Err(WorkerError::Fatal(
            "a program's snapshot is written from its cut".into(),
        ));
    };
    let written = match checkpoint::write_state(agg, writer, opts).await {
        Ok(w) => w,
        Err(failed) => {
            // The drained rows are output all the same: they ride with the next snapshot.
            s.metrics.records_out.inc_by(failed.rows);
            emit_lines(sub, failed.lines, failed.rows, Lines::AtBarrier)?;
            return Err(failed.error.into());
        }
    };
    s.metrics.records_out.inc_by(written.rows);
    emit_lines(sub, written.lines, written.rows, Lines::AtBarrier)?;
    deliver_at_least_once(sub)?;
    // Every result since the job's last committed snapshot is staged for this one (results
    // staged for snapshots that did not commit ride along); the coordinator publishes them once
    // this snapshot is committed (exactly once). If staging fails, the snapshot fails, and they
    // ride with the next one.
    if let Some(sink) = &mut sub.sink {
        let output = sink
            .staging
            .on_barrier(id, job::staging::Committed::from_wire(last_committed))?;
        stage_output(sink.store.as_ref(), &sink.base, id, &output).await?;
    }
    let keys_per_group = written.keys_per_group;
    let snapshot = written.snapshot;
    if kind == snapshot::SnapshotKind::Checkpoint {
        sub.chain
            .written(incremental::Base::written(id, cut_epoch, &snapshot));
    }
    let duration_ms = started.elapsed().as_millis() as u64;
    s.metrics
        .checkpoint_seconds
        .set(started.elapsed().as_secs_f64());
    s.metrics.checkpoint_bytes.set(snapshot.file.size as i64);
    s.metrics.keys.set(sub.keyed.key_count() as i64);
    s.status.lock().await.keys_per_group = keys_per_group;
    Ok(Some(Written::Done(Box::new(SubtaskAck {
        snapshot,
        source_positions: positions,
        source_partitions: sub.source_partitions.clone(),
        watermark,
        duration_ms,
        blocked_ms: Some(duration_ms),
    }))))
}

/// A snapshot whose cut was taken at its barrier: what it needs to complete its cut and
/// upload it.
pub(super) struct CutTaken {
    id: u64,
    kind: snapshot::SnapshotKind,
    cut_epoch: u32,
    positions: BTreeMap<u32, u64>,
    started: Instant,
    blocked_ms: u64,
    watermark: i64,
    writer: SnapshotWriter,
    dir: StorePath,
    base: Option<incremental::Base>,
    policy: incremental::CutPolicy,
    taken: checkpoint::Cut,
}

/// Keys a step of a cut still being copied copies between two batches
/// ([`job::KeyedAggregator::capture_step`]): a fraction of a millisecond.
pub const CAPTURE_STEP_KEYS: usize = 512;

/// Completes a snapshot's cut (the deltas still being copied, and their results: sealed with
/// the snapshot's output, sent to Kafka or written to stdout), delivers an at-least-once Kafka
/// sink's rows, and starts the upload of the state and the sink output, which acknowledges
/// the snapshot once durable.
pub(super) async fn complete_cut(
    s: &Arc<Shared>,
    sub: &mut Subtask,
    mut cut: CutTaken,
) -> Result<Uploading, WorkerError> {
    let id = cut.id;
    let (late, rows) = match &mut sub.keyed {
        Keyed::Aggregate(agg) => checkpoint::finish_cut(agg, &mut cut.taken).await,
        Keyed::Program(_) => (Vec::new(), 0),
    };
    s.metrics.records_out.inc_by(rows);
    emit_lines(sub, late, rows, Lines::SealedWith(id))?;
    deliver_at_least_once(sub)?;
    let output = sub.sink.as_ref().map(|sink| {
        (
            sink.store.clone(),
            sink.base.clone(),
            sink.staging.output(id),
        )
    });
    s.metrics.keys.set(sub.keyed.key_count() as i64);
    s.status.lock().await.keys_per_group = cut.taken.keys_per_group();
    let CutTaken {
        id,
        kind,
        cut_epoch,
        positions,
        started,
        blocked_ms,
        watermark,
        writer,
        dir,
        base,
        policy,
        taken,
    } = cut;
    let upload = taken.into_upload();
    let source_partitions = sub.source_partitions.clone();
    let shared = s.clone();
    let store = sub.store.clone();
    let task = tokio::spawn(async move {
        let result: Result<Option<SubtaskAck>, WorkerError> = async {
            let snapshot =
                checkpoint::upload_cut(upload, writer, base.as_ref(), policy, store.as_ref(), &dir)
                    .await?;
            if let Some((store, sink_base, output)) = &output {
                stage_output(store.as_ref(), sink_base, id, output).await?;
            }
            let duration = started.elapsed();
            shared
                .metrics
                .checkpoint_seconds
                .set(duration.as_secs_f64());
            shared
                .metrics
                .checkpoint_bytes
                .set(snapshot.file.size as i64);
            Ok(Some(SubtaskAck {
                snapshot,
                source_positions: positions,
                source_partitions,
                watermark,
                duration_ms: duration.as_millis() as u64,
                blocked_ms: Some(blocked_ms),
            }))
        }
        .await;
        settle(&shared, id, result).await
    });
    Ok(Uploading {
        id,
        kind,
        cut: cut_epoch,
        task,
    })
}

/// Completes the cut still being copied, if any, and starts its upload; a failure settles
/// its snapshot (and is returned if it must stop the worker).
pub(super) async fn complete_capture(
    s: &Arc<Shared>,
    sub: &mut Subtask,
) -> Result<(), WorkerError> {
    let Some(cut) = sub.capturing.take() else {
        return Ok(());
    };
    let id = cut.id;
    match complete_cut(s, sub, cut).await {
        Ok(u) => sub.uploading = Some(u),
        Err(e) => {
            settle(s, id, Err(e)).await?;
        }
    }
    Ok(())
}

/// Stages a snapshot's sink output (see [`crate::sink::stage`]).
pub(super) async fn stage_output(
    store: &dyn ObjectStore,
    base: &StorePath,
    id: u64,
    output: &job::Output,
) -> Result<(), WorkerError> {
    let path = crate::sink::stage(store, base, output).await?;
    tracing::debug!(
        id,
        %path,
        rows = output.rows,
        bytes = output.len(),
        carried = ?output.carried,
        "sink output staged"
    );
    if !output.carried.is_empty() {
        tracing::info!(
            id,
            carried = ?output.carried,
            rows = output.rows,
            "sink output of snapshots that did not commit staged again with this one"
        );
    }
    Ok(())
}
