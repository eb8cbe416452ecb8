//! The keyed operator task: reads one input per upstream subtask, applies records to its key
//! groups, aligns barriers ([`super::barrier`]) and emits results.

use super::*;

/// Polls the inputs that are not blocked by barrier alignment, fairly.
pub(super) async fn next_input(
    inputs: &mut [mpsc::Receiver<Msg>],
    blocked: &[bool],
    start: &mut usize,
) -> Option<(usize, Option<Msg>)> {
    let n = inputs.len();
    if blocked.iter().all(|b| *b) {
        return None;
    }
    std::future::poll_fn(|cx| {
        for k in 0..n {
            let i = (*start + k) % n;
            if blocked[i] {
                continue;
            }
            if let std::task::Poll::Ready(m) = inputs[i].poll_recv(cx) {
                *start = (i + 1) % n;
                return std::task::Poll::Ready(Some((i, m)));
            }
        }
        std::task::Poll::Pending
    })
    .await
}

/// Applies one batch from input `i` to the keyed state (a program's results go out); returns how
/// many records it stood for. A batch of the other kind of job is a routing bug.
fn process_input(s: &Shared, sub: &mut Subtask, i: usize, msg: Msg) -> Result<u64, WorkerError> {
    let wrong = |what: &str| {
        WorkerError::Fatal(format!(
            "input from subtask {i}: {what} reached the wrong kind of keyed operator"
        ))
    };
    match (msg, &mut sub.keyed) {
        (Msg::Records(records), Keyed::Aggregate(agg)) => {
            agg.process_batch(&records)?;
            Ok(records.len() as u64)
        }
        (Msg::Partials(partials), Keyed::Aggregate(agg)) => {
            agg.process_partials(partials.iter())?;
            Ok(partials.inputs())
        }
        (Msg::Encoded(records), Keyed::Program(step)) => {
            step.process(&records).map_err(job::JobError::from)?;
            emit_program(s, sub)?;
            Ok(records.inputs())
        }
        (Msg::Records(_), _) => Err(wrong("records of the built-in aggregation")),
        (Msg::Partials(_), _) => Err(wrong("partial results of the built-in aggregation")),
        (Msg::Encoded(_), _) => Err(wrong("records of a program")),
        (Msg::Barrier(_) | Msg::Watermark(_), _) => Ok(0),
    }
}

pub(super) async fn operator_loop(
    s: Arc<Shared>,
    mut sub: Subtask,
    mut inputs: Vec<mpsc::Receiver<Msg>>,
    restored_watermark: i64,
) -> Result<(), WorkerError> {
    let n = inputs.len();
    let mut tracker = if restored_watermark > i64::MIN {
        WatermarkTracker::restored(n, restored_watermark)
    } else {
        WatermarkTracker::new(n)
    };
    let mut aborts = s.aborted.subscribe();
    let mut align = Alignment::new(n);
    // A program's processing time: advanced between messages, and on a tick while its inputs
    // are idle, so that its processing-time timers fire.
    let program = matches!(sub.keyed, Keyed::Program(_));
    let mut clock = tokio::time::interval(PROCESSING_TIME_TICK);
    clock.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut advanced = Instant::now();
    let mut start = 0usize;
    let mut batches = 0u64;
    // Late records of this run's keyed operator already counted in the metric.
    let mut late_seen = 0u64;
    loop {
        // A cut still being copied takes a step between two messages; once complete, its
        // upload starts.
        if sub.capturing.is_some()
            && let Keyed::Aggregate(agg) = &mut sub.keyed
            && agg.capture_step(CAPTURE_STEP_KEYS)
        {
            complete_capture(&s, &mut sub).await?;
        }
        let capturing = sub.capturing.is_some();
        // An abort of the snapshot being aligned unblocks its inputs even while the others
        // are idle; a cut still being copied goes on while they are.
        let next = tokio::select! {
            biased;
            _ = aborts.changed(), if align.aligning().is_some() => None,
            m = next_input(&mut inputs, align.blocked(), &mut start) => Some(m),
            _ = std::future::ready(()), if capturing => None,
            _ = clock.tick(), if program => None,
        };
        if program && advanced.elapsed() >= PROCESSING_TIME_TICK {
            advanced = Instant::now();
            advance_processing_time(&s, &mut sub)?;
        }
        let aborted_through = *aborts.borrow_and_update();
        if let Some(id) = align.abandon_through(aborted_through) {
            tracing::info!(id, "stopped aligning an aborted snapshot");
        }
        let Some(next) = next else {
            continue;
        };
        let Some((i, msg)) = next else {
            return Err(WorkerError::Fatal("every input is blocked".into()));
        };
        let Some(msg) = msg else {
            return Err(WorkerError::Fatal(format!(
                "input from subtask {i} closed: a peer stopped or lost its connection"
            )));
        };
        match msg {
            input @ (Msg::Records(_) | Msg::Partials(_) | Msg::Encoded(_)) => {
                let records = process_input(&s, &mut sub, i, input)?;
                s.metrics.records_processed.inc_by(records);
                batches += 1;
                if batches.is_multiple_of(64) {
                    s.metrics.keys.set(sub.keyed.key_count() as i64);
                    s.metrics
                        .count_late(sub.keyed.late_records(), &mut late_seen);
                }
            }
            Msg::Watermark(wm) => {
                if let Some(new) = tracker.update(i, wm) {
                    s.metrics.set_watermark_ms(new);
                    match &mut sub.keyed {
                        Keyed::Aggregate(agg) => {
                            let rows = agg.advance_watermark(new);
                            emit(&s, &mut sub, &rows);
                        }
                        Keyed::Program(step) => {
                            step.advance_watermark(new).map_err(job::JobError::from)?;
                            emit_program(&s, &mut sub)?;
                        }
                    }
                }
            }
            Msg::Barrier(id) => match align.barrier(i, id, aborted_through) {
                Barrier::Stale => {
                    tracing::debug!(
                        id,
                        input = i,
                        "barrier of a finished or abandoned snapshot ignored"
                    );
                }
                Barrier::Accepted {
                    superseded,
                    aligned,
                } => {
                    if let Some(old) = superseded {
                        tracing::warn!(old, id, "snapshot superseded while aligning: aborted");
                        s.abort(
                            old,
                            &format!(
                                "aborted: superseded by snapshot {id} while aligning (a barrier of {old} never arrived)"
                            ),
                        )
                        .await;
                    }
                    if !aligned {
                        continue;
                    }
                    let result = snapshot(&s, &mut sub, id, tracker.current()).await;
                    let result = match result {
                        Ok(Some(Written::Uploading(u))) => {
                            sub.uploading = Some(u);
                            continue;
                        }
                        Ok(Some(Written::Capturing)) => continue,
                        Ok(Some(Written::Done(ack))) => Ok(Some(*ack)),
                        Ok(None) => Ok(None),
                        Err(e) => Err(e),
                    };
                    settle(&s, id, result).await?;
                }
            },
        }
    }
}

/// Records the outcome of snapshot `id` in the ledger (and the status); returns what was
/// written if it completed. A failure that must stop the worker is returned as the error.
pub(super) async fn settle(
    s: &Shared,
    id: u64,
    result: Result<Option<SubtaskAck>, WorkerError>,
) -> Result<Option<snapshot::SubtaskSnapshot>, WorkerError> {
    let status = match result {
        Ok(Some(ack)) => {
            tracing::info!(
                id,
                bytes = ack.snapshot.file.size,
                ms = ack.duration_ms,
                blocked_ms = ?ack.blocked_ms,
                "snapshot written"
            );
            CheckpointStatus::Completed(Box::new(ack))
        }
        Ok(None) => {
            tracing::info!(id, "snapshot aborted before it was written");
            return Ok(None);
        }
        Err(e) if e.stops_the_worker() => {
            s.finish(
                id,
                CheckpointStatus::Failed {
                    error: e.to_string(),
                },
            )
            .await;
            return Err(e);
        }
        Err(e) => {
            tracing::error!(id, error = %e, "snapshot failed");
            CheckpointStatus::Failed {
                error: e.to_string(),
            }
        }
    };
    let written = match &status {
        CheckpointStatus::Completed(ack) => Some(ack.snapshot.clone()),
        _ => None,
    };
    if !s.finish(id, status).await {
        tracing::info!(
            id,
            "snapshot written after it was aborted: it stays aborted"
        );
        return Ok(None);
    }
    if written.is_some() {
        s.status.lock().await.last_checkpoint = Some(id);
    }
    Ok(written)
}

pub(super) fn emit(s: &Shared, sub: &mut Subtask, rows: &[job::ResultRow]) {
    if rows.is_empty() {
        return;
    }
    s.metrics.records_out.inc_by(rows.len() as u64);
    #[cfg(feature = "kafka")]
    if let Some(k) = &mut sub.kafka {
        let mut lines = Vec::with_capacity(rows.len() * 48);
        for r in rows {
            job::format_json_line(r, &mut lines);
        }
        k.send_lines(&lines);
        return;
    }
    if let Some(sink) = &mut sub.sink {
        sink.staging.emit(rows);
    } else if sub.sink_log {
        use std::io::Write;
        let mut lines = Vec::with_capacity(rows.len() * 48);
        for r in rows {
            job::format_json_line(r, &mut lines);
        }
        // One large write (stdout is line-buffered: writing row by row makes one write(2) each).
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(&lines);
        let _ = out.flush();
    }
}

/// How often a program's processing time advances (its processing-time timers fire at most
/// this late).
pub(super) const PROCESSING_TIME_TICK: Duration = Duration::from_millis(50);

/// Advances a program's processing time to the wall clock (ms since the epoch): its timers up
/// to now fire, and what they emit goes to the sink.
fn advance_processing_time(s: &Shared, sub: &mut Subtask) -> Result<(), WorkerError> {
    let Keyed::Program(step) = &mut sub.keyed else {
        return Ok(());
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    step.advance_processing_time(now)
        .map_err(job::JobError::from)?;
    emit_program(s, sub)
}

/// What a program emitted since the last call, as the sink's lines: to the sink as the
/// aggregation's rows go ([`emit`]).
pub(super) fn emit_program(s: &Shared, sub: &mut Subtask) -> Result<(), WorkerError> {
    let Keyed::Program(step) = &mut sub.keyed else {
        return Ok(());
    };
    let mut lines = Vec::new();
    let rows = step.take_lines(&mut lines).map_err(job::JobError::from)?;
    if rows == 0 {
        return Ok(());
    }
    s.metrics.records_out.inc_by(rows);
    if sub.sink_log && sub.sink.is_none() {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(&lines);
        let _ = out.flush();
        return Ok(());
    }
    emit_lines(sub, lines, rows, Lines::AtBarrier)
}

/// Where result lines drained by a cut go in the object-store sink.
#[derive(Clone, Copy, Debug)]
pub(super) enum Lines {
    /// Drained at the barrier, before the snapshot seals its output: staged with the rows
    /// since the last barrier (they are output all the same when the snapshot fails: they
    /// ride with the next one).
    AtBarrier,
    /// Drained after snapshot `id`'s barrier, while its cut was copied: sealed with that
    /// snapshot's output.
    SealedWith(u64),
}

/// Result lines drained by a cut: to the at-least-once Kafka sink, or staged in the
/// object-store sink where `to` says.
pub(super) fn emit_lines(
    sub: &mut Subtask,
    lines: Vec<u8>,
    rows: u64,
    to: Lines,
) -> Result<(), WorkerError> {
    if rows == 0 {
        return Ok(());
    }
    #[cfg(feature = "kafka")]
    if let Some(k) = &mut sub.kafka {
        k.send_lines(&lines);
        return Ok(());
    }
    if let Some(sink) = &mut sub.sink {
        match to {
            Lines::AtBarrier => sink.staging.emit_lines(lines, rows),
            Lines::SealedWith(id) => sink.staging.add_sealed(id, &lines, rows)?,
        }
    }
    Ok(())
}

/// The Kafka sink at least once: every row so far is acknowledged by the brokers before the
/// snapshot that drained it may be acknowledged. A row that could not be delivered stops the
/// worker (its snapshot must never commit past it).
pub(super) fn deliver_at_least_once(sub: &mut Subtask) -> Result<(), WorkerError> {
    #[cfg(feature = "kafka")]
    if let Some(k) = &mut sub.kafka {
        k.flush()
            .map_err(|e| WorkerError::KafkaSink(e.to_string()))?;
    }
    #[cfg(not(feature = "kafka"))]
    let _ = sub;
    Ok(())
}
