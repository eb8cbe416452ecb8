//! The checkpoint protocol: trigger a barrier on every worker, collect the acknowledgements,
//! commit the manifest (create-only, last), abort on failure, resume stopped sources.

use super::*;
use futures::{StreamExt, TryStreamExt};

/// The longest a long poll for a subtask's acknowledgement holds (less when the per-request
/// timeout is short).
const LONGEST_ACK_POLL: Duration = Duration::from_secs(5);
/// Requests to a run's workers in flight at once for one snapshot (its triggers, then the long
/// polls for its acknowledgements).
const ACK_POLLS_IN_FLIGHT: usize = 64;
/// The pause before asking again a worker that does not hold a long poll.
const SHORT_POLL: Duration = Duration::from_millis(20);
/// The pause before asking again after a failed request.
const RETRY_AFTER_FAILED_POLL: Duration = Duration::from_millis(200);

impl Coordinator {
    /// Takes a checkpoint or savepoint (optionally stopping the sources at the barrier) and
    /// commits it. On failure nothing is committed, the last good snapshot is untouched, the
    /// snapshot is aborted on every worker ([`Coordinator::abort`]; not when its commit is in
    /// doubt) so that none keeps aligning it, and sources stopped by this call are resumed.
    pub async fn snapshot(
        &mut self,
        kind: SnapshotKind,
        stop: bool,
        timeout: Duration,
    ) -> Result<Completed, CoordinatorError> {
        let started = Instant::now();
        let result = match self.prepare().await {
            Ok(()) => {
                let id = self.next_id;
                self.next_id += 1;
                if let Some(sink) = self.sink.as_mut()
                    && std::mem::take(&mut sink.hold_next)
                {
                    tracing::info!(
                        id,
                        "the output of this snapshot is held back: the job restores an older one next"
                    );
                    sink.abandoned
                        .get_mut()
                        .unwrap_or_else(PoisonError::into_inner)
                        .insert(id);
                }
                match self.take(id, kind, stop, timeout).await {
                    Ok(m) => Ok((id, m)),
                    // A commit in doubt may have committed: the workers' acknowledgements stand.
                    Err(e @ CoordinatorError::CommitInDoubt { .. }) => Err(e),
                    Err(e) => {
                        self.abort(id, &e).await;
                        Err(e)
                    }
                }
            }
            Err(e) => Err(e),
        };
        match result {
            Ok((id, manifest)) => {
                let duration = started.elapsed();
                self.committed(id).await;
                let backlog = self.publish_backlog();
                if kind == SnapshotKind::Checkpoint && backlog.is_behind() {
                    tracing::warn!(
                        pending = ?backlog.pending,
                        "checkpoint retention skipped while sink output of committed snapshots is not published"
                    );
                } else if kind == SnapshotKind::Checkpoint {
                    match snapshot::retain(self.store.as_ref(), &self.job_dir, self.retained).await
                    {
                        Ok(r) => {
                            if let Some(e) = &r.marker_error {
                                tracing::warn!(error = %e, "checkpoint retention deleted no committed checkpoint: the in-use marker is unreadable");
                            }
                            if !r.deleted.is_empty() || !r.pinned_kept.is_empty() {
                                tracing::debug!(deleted = ?r.deleted, pinned = ?r.pinned_kept, "checkpoint retention");
                            }
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "checkpoint retention failed; will retry next time")
                        }
                    }
                }
                Ok(Completed {
                    id,
                    kind,
                    url: snapshot_url(
                        &self.storage,
                        &self.identity.namespace,
                        &self.identity.name,
                        kind,
                        id,
                    ),
                    manifest,
                    duration,
                })
            }
            Err(e) => {
                if let CoordinatorError::CommitInDoubt { id, .. } = &e {
                    self.in_doubt.insert(*id, kind);
                }
                if stop {
                    // Leave the job running at its old parallelism.
                    self.resume().await;
                }
                Err(e)
            }
        }
    }

    /// Before a trigger: snapshot ids above the sink's and above the workers' (once each), and
    /// every commit in doubt
    /// resolved, so that the trigger names the newest committed snapshot exactly (a worker drops
    /// the output staged up to it, and carries the output staged after it).
    pub(super) async fn prepare(&mut self) -> Result<(), CoordinatorError> {
        if let Some(sink) = &mut self.sink
            && !sink.ids_checked
        {
            let max = crate::sink::max_snapshot_id(sink.store.as_ref(), &sink.base).await?;
            if max >= self.next_id {
                tracing::warn!(
                    sink_max = max,
                    next = self.next_id,
                    "the sink holds output of snapshot ids this job's storage does not know (storage removed?): ids continue above them"
                );
                self.next_id = max + 1;
            }
            sink.ids_checked = true;
        }
        #[cfg(feature = "kafka")]
        if let Some(sink) = &mut self.sink
            && let Some(k) = &sink.kafka
            && !sink.marker_checked
        {
            // Fails the trigger while the brokers cannot be reached: a snapshot id at or below
            // the marker would never be published.
            let (marker, said) = k
                .effective_marker(sink.store.as_ref(), &sink.base)
                .await
                .map_err(|e| crate::sink::SinkError::Kafka(e.to_string()))?;
            if let Some(said) = said {
                tracing::warn!("{said}");
            }
            if let Some(m) = marker
                && m.snapshot >= self.next_id
            {
                tracing::warn!(
                    marker = m.snapshot,
                    next = self.next_id,
                    "the Kafka sink's marker names snapshot ids this job's storage does not know (storage replaced?): ids continue above them"
                );
                self.next_id = m.snapshot + 1;
            }
            sink.marker_checked = true;
        }
        if !self.worker_ids_checked {
            // Workers taken over from an earlier coordinator may know ids that left nothing in
            // storage (aborted before anything was written); a worker ignores a snapshot id at
            // or below the newest it finished or abandoned.
            match self.status().await {
                Ok(statuses) => {
                    if let Some(max) = statuses.iter().filter_map(|s| s.newest_snapshot).max()
                        && max >= self.next_id
                    {
                        tracing::info!(
                            workers_newest = max,
                            next = self.next_id,
                            "the workers know snapshot ids this job's storage does not: ids continue above them"
                        );
                        self.next_id = max + 1;
                    }
                    self.worker_ids_checked = true;
                }
                // The trigger tells what is wrong with the worker; checked again next time.
                Err(e) => tracing::debug!(error = %e, "reading the workers' newest snapshot ids"),
            }
        }
        while let Some((&id, &kind)) = self.in_doubt.first_key_value() {
            if is_committed(self.store.as_ref(), &self.job_dir, kind, id).await? {
                tracing::warn!(
                    id,
                    "a manifest commit that reported a failure was written: snapshot committed"
                );
                self.committed(id).await;
            }
            self.in_doubt.remove(&id);
        }
        Ok(())
    }

    /// Snapshot `id` committed: the next trigger names it, and its sink output is published
    /// (with any still pending before it; a failure leaves them pending). At a coordinator's
    /// first commit that includes the committed output an earlier coordinator of the job left
    /// unpublished (it crashed between commit and publish, and this one took over its workers
    /// without a restore): [`Coordinator::publish_committed`] up to `id`, which is cheap when
    /// nothing was left (it stops at the newest published snapshot).
    pub(super) async fn committed(&mut self, id: u64) {
        self.last_committed = self.last_committed.max(id);
        let Some(sink) = &self.sink else {
            return;
        };
        if sink
            .abandoned
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(&id)
        {
            return;
        }
        sink.backlog
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .0
            .insert(id);
        let caught_up = sink.caught_up;
        // Failures are logged and kept in the backlog.
        if caught_up {
            let _ = self.publish_pending().await;
            return;
        }
        let result = self.publish_committed_through(id).await;
        if let Some(sink) = &mut self.sink {
            match result {
                Ok(()) => sink.caught_up = true,
                Err(e) => {
                    sink.backlog
                        .get_mut()
                        .unwrap_or_else(PoisonError::into_inner)
                        .1 = Some(e.to_string());
                }
            }
        }
    }

    pub(super) async fn take(
        &self,
        id: u64,
        kind: SnapshotKind,
        stop: bool,
        timeout: Duration,
    ) -> Result<Manifest, CoordinatorError> {
        let req = &CheckpointRequest {
            id,
            kind,
            stop,
            last_committed: Some(self.last_committed),
        };
        futures::stream::iter((0..self.workers.len()).map(|i| async move {
            self.post::<_, serde_json::Value>(i, "/v1/checkpoints", req)
                .await
        }))
        .buffer_unordered(ACK_POLLS_IN_FLIGHT)
        .try_collect::<Vec<_>>()
        .await?;
        let deadline = Instant::now() + timeout;
        // Every worker's acknowledgement, long-polled: about one request per worker and
        // snapshot, at most ACK_POLLS_IN_FLIGHT at once; the first failure ends the wait.
        let mut waits = futures::stream::iter(
            (0..self.workers.len())
                .map(|i| async move { self.await_ack(i, id, deadline).await.map(|ack| (i, ack)) }),
        )
        .buffer_unordered(ACK_POLLS_IN_FLIGHT);
        let mut acks: Vec<Option<SubtaskAck>> = vec![None; self.workers.len()];
        while let Some(answer) = waits.next().await {
            let (i, ack) = answer?;
            acks[i] = ack;
        }
        drop(waits);
        let missing: Vec<usize> = acks
            .iter()
            .enumerate()
            .filter(|(_, a)| a.is_none())
            .map(|(i, _)| i)
            .collect();
        if !missing.is_empty() {
            return Err(CoordinatorError::SnapshotTimeout {
                id,
                secs: timeout.as_secs(),
                missing,
            });
        }
        let acks: Vec<SubtaskAck> = acks.into_iter().flatten().collect();
        let mut positions = BTreeMap::new();
        let mut names = BTreeMap::new();
        for a in &acks {
            positions.extend(a.source_positions.iter().map(|(k, v)| (*k, *v)));
            names.extend(a.source_partitions.iter().map(|(k, v)| (*k, v.clone())));
        }
        let watermark = acks
            .iter()
            .map(|a| a.watermark)
            .min()
            .filter(|w| *w > i64::MIN);
        let meta = SnapshotMeta {
            job: self.identity.clone(),
            snapshot_id: id,
            kind,
            completed_at: Timestamp::now(),
            state_schema: crate::orchestrator::settings::state_schema(&self.identity).to_owned(),
            source_positions: positions,
            source_partitions: names,
            watermark,
        };
        let manifest = Manifest::assemble(
            meta,
            self.assignment,
            acks.into_iter().map(|a| a.snapshot).collect(),
        )?;
        let dir = snapshot::snapshot_dir(&self.job_dir, kind, id);
        if let Err(e) = snapshot::commit_manifest(self.store.as_ref(), &dir, &manifest).await {
            // A failed write may still have happened: what the next trigger tells the workers
            // depends on it.
            let path = snapshot::manifest_path(&dir);
            match self.store.head(&path).await {
                Ok(_) => {
                    tracing::warn!(id, error = %e, "committing the manifest reported a failure, but the manifest is there: committed");
                }
                Err(object_store::Error::NotFound { .. }) => return Err(e.into()),
                Err(check) => {
                    return Err(CoordinatorError::CommitInDoubt {
                        id,
                        error: e.to_string(),
                        check: check.to_string(),
                    });
                }
            }
        }
        Ok(manifest)
    }

    /// Subtask `subtask`'s acknowledgement of snapshot `id`, long-polled
    /// (`GET /v1/checkpoints/{id}?waitMs=N`: the worker answers when it is done, or after N ms
    /// with `pending`); `None` once `deadline` passed without one. One failed request is
    /// retried (a dropped connection, a busy worker); a second in a row fails the wait, as does
    /// the subtask's report that the snapshot failed or that it does not know it.
    pub(super) async fn await_ack(
        &self,
        subtask: usize,
        id: u64,
        deadline: Instant,
    ) -> Result<Option<SubtaskAck>, CoordinatorError> {
        let longest = (self.request_timeout / 2).min(LONGEST_ACK_POLL);
        let mut failed_before = false;
        loop {
            let now = Instant::now();
            if now > deadline {
                return Ok(None);
            }
            let wait = longest.min(deadline - now).max(Duration::from_millis(1));
            let path = format!("/v1/checkpoints/{id}?waitMs={}", wait.as_millis());
            match self.get::<CheckpointStatus>(subtask, &path).await {
                Ok(CheckpointStatus::Completed(ack)) => return Ok(Some(*ack)),
                Ok(CheckpointStatus::Failed { error }) => {
                    return Err(CoordinatorError::SnapshotFailed { id, subtask, error });
                }
                Ok(CheckpointStatus::Unknown) => {
                    return Err(CoordinatorError::SnapshotFailed {
                        id,
                        subtask,
                        error: "the worker lost the trigger (restarted?)".into(),
                    });
                }
                Ok(CheckpointStatus::Pending) => {
                    failed_before = false;
                    // A worker that answers a long poll at once (one of an older release, which
                    // does not hold it) is asked again after a short pause, as it used to be.
                    if now.elapsed() < wait / 2 {
                        tokio::time::sleep(SHORT_POLL).await;
                    }
                }
                Err(e) if failed_before => return Err(e),
                Err(e) => {
                    tracing::debug!(id, subtask, error = %e, "asking a worker for its acknowledgement failed; asking again");
                    failed_before = true;
                    tokio::time::sleep(RETRY_AFTER_FAILED_POLL).await;
                }
            }
        }
    }

    /// Abandons snapshot `id` on every worker (`POST /v1/checkpoints/{id}/abort`), because of
    /// `why`: each reports it failed (aborted), drops what its source recorded for it, does not
    /// inject its barrier if it has not yet, and its keyed operator stops aligning it, so that
    /// the inputs blocked for it flow again (a trigger that reached only some workers would
    /// otherwise leave every operator aligning it). Best effort: a worker that cannot be
    /// reached is logged; its operator drops the snapshot anyway when the next one's barrier
    /// arrives. Returns how many workers acknowledged the abort.
    pub async fn abort(&self, id: u64, why: &dyn std::fmt::Display) -> usize {
        let path = format!("/v1/checkpoints/{id}/abort");
        let results = futures::future::join_all(
            (0..self.workers.len()).map(|i| self.post::<_, CheckpointStatus>(i, &path, &())),
        )
        .await;
        let mut acknowledged = 0;
        for (i, r) in results.into_iter().enumerate() {
            match r {
                Ok(_) => acknowledged += 1,
                Err(e) => {
                    tracing::warn!(id, subtask = i, error = %e, "aborting the snapshot on a worker failed")
                }
            }
        }
        tracing::warn!(
            id,
            reason = %why,
            workers = self.workers.len(),
            acknowledged,
            "snapshot aborted on the workers"
        );
        acknowledged
    }

    /// Resumes sources stopped by a savepoint (best effort: a worker that cannot be reached will
    /// be restarted from the last checkpoint by its platform).
    pub async fn resume(&self) {
        for i in 0..self.workers.len() {
            if let Err(e) = self
                .post::<_, serde_json::Value>(i, "/v1/resume", &())
                .await
            {
                tracing::warn!(subtask = i, error = %e, "resume failed");
            }
        }
    }
}
