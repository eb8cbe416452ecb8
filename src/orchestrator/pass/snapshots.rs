//! Checkpoints and savepoints in a pass: triggering them (the periodic checkpoint, a stop's
//! savepoint, spec.savepointTriggerNonce) and recording each once it completed.

use super::*;

impl Pass<'_> {
    /// The job's newest snapshot that can be restored at `max_parallelism` key groups, passing
    /// over the history a restore replaced and the snapshots found unrestorable.
    // `&mut self` for the future's sake: a `Pass` is Send but not Sync.
    pub(super) async fn latest_restorable(
        &mut self,
        max_parallelism: u32,
    ) -> Result<run::Restorable, PassError> {
        run::latest_restorable(
            self.spec,
            &self.storage,
            &self.ns,
            &self.name,
            max_parallelism,
            self.status
                .replaced_history_up_to
                .and_then(|b| u64::try_from(b).ok()),
            &self.mem.unrestorable,
        )
        .await
        .map_err(PassError::FindSnapshot)
    }

    pub(super) fn kind_labels(&self, kind: SnapshotKind) -> SnapshotLabels {
        OperatorMetrics::snapshot(&self.ns, &self.name, kind)
    }

    /// Snapshot metrics: the duration of a committed snapshot, or one more failure (its time and
    /// size are status's, and the metrics take them from there).
    pub(super) fn record_snapshot(
        &mut self,
        labels: &SnapshotLabels,
        completed: Option<&Completed>,
    ) {
        if let Some(c) = completed {
            self.pass_point_of_no_return(c);
        }
        let m = &self.metrics;
        match completed {
            Some(c) => {
                if let Some(d) = status::state_distribution(&c.manifest) {
                    self.status.state_distribution = Some(d);
                }
                m.snapshot_seconds
                    .get_or_create(labels)
                    .observe(c.duration.as_secs_f64());
            }
            None => {
                m.snapshot_failures.get_or_create(labels).inc();
            }
        }
    }

    pub(super) async fn savepoint(&mut self) -> Result<Duration, PassError> {
        let Some(mut run) = self.mem.run.take() else {
            return Ok(requeue::SOON);
        };
        // A transition that restores one of the job's own snapshots (a restoreFrom of an older
        // one, an undone key-group change) goes back to it: the savepoint it stops with must
        // not publish what the records after that snapshot produce, which the next run
        // publishes once.
        let own = format!(
            "{}/",
            snapshot::job_url(&self.storage, &self.ns, &self.name)
        );
        if self
            .status
            .rescale
            .as_ref()
            .and_then(|r| r.restore_from.as_deref())
            .is_some_and(|u| u.starts_with(&own))
        {
            run.coordinator.hold_output_of_next_snapshot();
        }
        if self
            .pods
            .iter()
            .any(|p| p.worker == Some(WorkerState::Stopped))
        {
            // A savepoint taken by an operator that died before recording it: the sources are
            // stopped at its barrier. Take a new one (the old one stays valid in storage).
            run.coordinator.resume().await;
        }
        let work = BackgroundWork::Savepoint {
            parallelism: run.parallelism,
        };
        self.snapshot_in_background(
            work,
            run,
            self.stop_kind(),
            true,
            self.settings.timeouts.savepoint,
        );
        Ok(requeue::BACKGROUND_BACKSTOP)
    }

    /// What a transition's stop takes: a savepoint, or for a pre-staged rescale an incremental
    /// checkpoint (the delta since what the new workers loaded). A pre-staged upgrade through a
    /// savepoint stops with the savepoint it promises (its new workers checked the state and
    /// were up before the stop; they read the savepoint whole).
    pub(super) fn stop_kind(&self) -> SnapshotKind {
        match self.status.rescale.as_ref() {
            Some(r)
                if r.prestaged().is_some()
                    && r.upgrade_mode != Some(crate::crd::UpgradeMode::Savepoint) =>
            {
                SnapshotKind::Checkpoint
            }
            _ => SnapshotKind::Savepoint,
        }
    }

    pub(super) async fn savepoint_done(
        &mut self,
        parallelism: u32,
        (run, result): (RunHandle, Result<Completed, CoordinatorError>),
    ) -> Result<Duration, PassError> {
        let kind = self.stop_kind();
        let labels = self.kind_labels(kind);
        self.mem.run = Some(run);
        match result {
            Ok(c) => {
                self.record_snapshot(&labels, Some(&c));
                // `to_read`: what the new subtasks will read: the whole savepoint, or for
                // pre-staged ones only what the stop checkpoint wrote (they loaded the rest
                // beforehand).
                let (what, to_read) = match kind {
                    SnapshotKind::Checkpoint => {
                        self.status.last_checkpoint = Some(snapshot_ref(&c, parallelism));
                        let delta = c.manifest.written_bytes();
                        if let Some(p) = self.rescale_mut().and_then(|r| r.prestage.as_mut()) {
                            p.delta_bytes = Some(delta as i64);
                        }
                        let what = format!(
                            "stop checkpoint {} ({delta} bytes written, {} bytes of state)",
                            c.url, c.manifest.stats.total_bytes
                        );
                        (what, delta)
                    }
                    SnapshotKind::Savepoint => {
                        self.status.last_savepoint = Some(snapshot_ref(&c, parallelism));
                        let what = format!(
                            "savepoint {} ({} bytes)",
                            c.url, c.manifest.stats.total_bytes
                        );
                        (what, c.manifest.stats.total_bytes)
                    }
                };
                if let Some(r) = self.rescale_mut() {
                    r.savepoint = Some(c.url.clone());
                    r.bytes_to_read = Some(to_read as i64);
                }
                self.transition(Outcome::SavepointTaken)?;
                self.event(
                    false,
                    Reason::SavepointTaken,
                    format!(
                        "{what} in {} ms; sources stopped at its barrier",
                        c.duration.as_millis()
                    ),
                );
                Ok(requeue::RECORDED)
            }
            Err(e) => {
                self.record_snapshot(&labels, None);
                self.abandon(format!("savepoint failed: {e}"), true).await?;
                Ok(requeue::WORKERS_CHANGING)
            }
        }
    }

    /// A savepoint asked for while the job runs (spec.savepointTriggerNonce or a
    /// StreamJobSnapshot): the job keeps running.
    pub(super) fn triggered_savepoint(&mut self, trigger: decide::SavepointTrigger) -> Duration {
        let Some(run) = self.mem.run.take() else {
            return requeue::SOON;
        };
        let work = BackgroundWork::TriggeredSavepoint {
            parallelism: run.parallelism,
            trigger,
        };
        self.snapshot_in_background(
            work,
            run,
            SnapshotKind::Savepoint,
            false,
            self.settings.timeouts.savepoint,
        );
        requeue::BACKGROUND_BACKSTOP
    }

    pub(super) fn triggered_savepoint_done(
        &mut self,
        parallelism: u32,
        trigger: decide::SavepointTrigger,
        (run, result): (RunHandle, Result<Completed, CoordinatorError>),
    ) -> Duration {
        let labels = self.kind_labels(SnapshotKind::Savepoint);
        self.mem.run = Some(run);
        match result {
            Ok(c) => {
                self.record_snapshot(&labels, Some(&c));
                let mut taken = snapshot_ref(&c, parallelism);
                match &trigger {
                    decide::SavepointTrigger::Nonce(nonce) => {
                        self.status.last_savepoint_nonce = Some(*nonce);
                    }
                    decide::SavepointTrigger::Snapshot(name) => {
                        taken.snapshot = Some(name.clone());
                    }
                }
                self.status.last_savepoint = Some(taken);
                self.succeeded();
                self.event(
                    false,
                    Reason::SavepointTaken,
                    format!(
                        "savepoint {} ({} bytes) in {} ms for {trigger}; the job keeps running",
                        c.url,
                        c.manifest.stats.total_bytes,
                        c.duration.as_millis()
                    ),
                );
                requeue::SOON
            }
            Err(e) => {
                self.record_snapshot(&labels, None);
                let message = format!("savepoint for {trigger} failed: {e}; retrying with backoff");
                self.fail(Reason::SavepointFailed, message.clone());
                self.event(true, Reason::SavepointFailed, message);
                requeue::AFTER_FAILURE
            }
        }
    }

    pub(super) fn checkpoint(&mut self) -> Duration {
        let Some(run) = self.mem.run.take() else {
            return self.settings.checkpoint_interval;
        };
        let work = BackgroundWork::Checkpoint {
            parallelism: run.parallelism,
        };
        self.snapshot_in_background(
            work,
            run,
            SnapshotKind::Checkpoint,
            false,
            self.settings.timeouts.checkpoint,
        );
        requeue::BACKGROUND_BACKSTOP
    }

    pub(super) fn checkpoint_done(
        &mut self,
        parallelism: u32,
        (run, result): (RunHandle, Result<Completed, CoordinatorError>),
    ) -> Duration {
        let interval = self.settings.checkpoint_interval;
        let labels = self.kind_labels(SnapshotKind::Checkpoint);
        let run = self.mem.run.insert(run);
        match result {
            Ok(c) => {
                self.record_snapshot(&labels, Some(&c));
                self.status.last_checkpoint = Some(snapshot_ref(&c, parallelism));
                self.mem.checkpoint_failures = None;
                self.succeeded();
                interval
            }
            Err(e) => {
                // Try again after a fraction of the interval; a dead worker shows up as a pod
                // exit and restarts the job.
                run.started = Timestamp::now();
                self.record_snapshot(&labels, None);
                let failed = self.mem.checkpoint_failures.take().map_or(0, |(n, _)| n) + 1;
                self.mem.checkpoint_failures = Some((failed, e.to_string()));
                self.event(
                    true,
                    Reason::CheckpointFailed,
                    format!("{e}; the previous checkpoint stays usable"),
                );
                interval / 2
            }
        }
    }
}
