//! Starting a run in a pass: restoring its snapshot at its parallelism, and recording how the
//! start ended (running, a rescale done or rolled back, a refusal).

use super::*;

/// The least time before a rolled-back key-group change is tried again.
const KEY_GROUP_CHANGE_RETRY: jiff::SignedDuration = jiff::SignedDuration::from_mins(5);

impl Pass<'_> {
    /// The new run of a rescale is up: step Done, or RolledBack when it runs at the old
    /// parallelism after a failed restore (the failure, its condition and its backoff stay, so
    /// the rescale is retried later).
    pub(super) fn finish_restoring(&mut self, rolled_back: bool) -> Result<(), PassError> {
        if rolled_back {
            self.transition(Outcome::RestoredAfterRollback)?;
            // The same rescale is retried, but not at once: it just failed. A key-group change
            // costs a full rewrite of the state, and what made it fail (memory, a corrupt
            // block) rarely goes away by itself: it waits longer (other transitions, a suspend
            // say, do not).
            if self.status.rescale.as_ref().is_some_and(|r| r.rewrites()) {
                self.mem.change_retry_at = Some(Timestamp::now() + KEY_GROUP_CHANGE_RETRY);
            }
            let retry = backoff(self.mem.failures).max(jiff::SignedDuration::from_secs(10));
            self.mem.backoff_until = Some(Timestamp::now() + retry);
            if let Some((reason, message)) = self.mem.last_failure.clone() {
                self.progress.failure = Some((reason, message));
            }
        } else {
            self.transition(Outcome::Restored)?;
            self.succeeded();
        }
        Ok(())
    }

    pub(super) async fn start(
        &mut self,
        run: String,
        parallelism: u32,
        restore: Restore,
    ) -> Result<Duration, PassError> {
        let Some(endpoints) = self.endpoints(parallelism) else {
            return Ok(requeue::SOON);
        };
        // A run started empty (a `stateless` upgrade) checkpoints at once, so that a recovery
        // restores its new state rather than the job's older snapshots.
        // So does a run restored from spec.restoreFrom: the job's own storage then holds a
        // snapshot under its (possibly new) key-group count.
        let transition_source = self
            .restore_transition()
            .and_then(|r| r.restore_from.clone().or_else(|| r.rewritten.clone()));
        // A key-group change's rewritten savepoint lies in the job's own storage under the new
        // count: the job's history goes on from it (no history is replaced, and no checkpoint
        // is taken at once, so the change stays reversible until the new run's first one).
        let rewrite = self
            .restore_transition()
            .is_some_and(|r| r.rewritten.is_some() && r.restore_from.is_none());
        let restored_source = match &restore {
            Restore::Url(u)
                if self.spec.restore_from.as_ref() == Some(u)
                    || transition_source.as_ref() == Some(u) =>
            {
                Some(u.clone())
            }
            _ => None,
        };
        let from_restore_from = restored_source.is_some();
        let run_started = if restore == Restore::Empty || (from_restore_from && !rewrite) {
            Timestamp::UNIX_EPOCH
        } else {
            Timestamp::now()
        };
        let resumes_history = restore == Restore::Latest;
        // The job identity the snapshot records, when known without reading its manifest again.
        let mut restored_job = None;
        // The job's own snapshots, all passed over as unrestorable (none found to resume).
        let mut unrestorable = None;
        let restore_from = match restore {
            Restore::Url(u) => Some(u),
            Restore::Empty => None,
            // The job's newest own snapshot under its current key-group count (snapshots taken
            // before a restore from a rewritten savepoint have another count and are skipped),
            // else the snapshot it was restored from.
            Restore::Latest => {
                let found = self.latest_restorable(self.max_parallelism()).await?;
                let newest = match found.skipped.is_empty() {
                    true => Ok(()),
                    false => {
                        let message = run::skipped_message(&found.skipped, found.url.as_deref());
                        self.event(true, Reason::UnreadableSnapshotSkipped, message.clone());
                        Err(message)
                    }
                };
                self.progress.restored_newest = Some(newest);
                if found.job.is_none() && !found.skipped.is_empty() {
                    unrestorable = Some(run::skipped_names(&found.skipped));
                }
                restored_job = found.job;
                found.url
            }
        };
        // A run restored from spec.restoreFrom replaces the job's history up to its newest
        // snapshot now: recorded once the run starts, so that no later resume goes back to it.
        let replaced_up_to = match &restored_source {
            Some(_) if !rewrite => {
                let (store, base) = snapshot::open_store(&self.storage)
                    .map_err(|e| PassError::FindSnapshot(e.into()))?;
                let job_dir = snapshot::job_dir(&base, &self.ns, &self.name);
                let next = snapshot::next_snapshot_id(store.as_ref(), &job_dir)
                    .await
                    .map_err(|e| PassError::FindSnapshot(e.into()))?;
                Some(next.saturating_sub(1))
            }
            _ => None,
        };
        let (coordinator, template) = self
            .new_run(parallelism, endpoints, &run, restore_from.clone())
            .await?;
        let assignment = coordinator.assignment();
        let work = StartWork {
            run,
            parallelism,
            groups: assignment.max_parallelism(),
            restore_from,
            restored_source,
            replaced_up_to,
            run_started,
            started: Instant::now(),
            spec_hash: self.settings.spec_hash.clone(),
        };
        // A job that has committed snapshots resumes one of them, never nothing.
        let recorded = self
            .status
            .last_checkpoint
            .iter()
            .chain(&self.status.last_savepoint)
            .map(|s| s.path.clone())
            .max();
        // What the snapshot says about its job and state is compared with this job before a
        // worker reads it (an upgrade or restoreFrom that would mix histories is refused before
        // anything stops; this also covers a resume of a suspended job whose spec changed).
        if let Some(url) = &work.restore_from {
            // Known from the scan that found it, or (spec.restoreFrom) from the pass that read
            // its key-group count; else (a transition's savepoint) read here.
            let cached = self
                .mem
                .restore_source
                .as_ref()
                .filter(|(u, ..)| u == url)
                .map(|(_, _, job)| job.clone());
            let job = match restored_job.or(cached) {
                Some(job) => job,
                None => {
                    snapshot::open_snapshot(url)
                        .await
                        .map_err(|e| PassError::FindSnapshot(e.into()))?
                        .2
                        .job
                }
            };
            if let Some((reason, message)) =
                run::restore_refusal(&self.ns, &self.name, self.spec, url, &job)
            {
                let refused = StartError::Refused { reason, message };
                return self.start_done(work, coordinator, Err(refused)).await;
            }
            // One of the job's own snapshots, older than the output its sink published: the
            // job does not go back past it by itself (a resume that passed over newer
            // snapshots, a restoreFrom that the pass could not check before stopping).
            if job.is(&self.ns, &self.name) && !self.spec.allow_republishing_output {
                let refusal = match super::going_back(self.spec, url, &coordinator).await {
                    Ok(refusal) => refusal,
                    Err(e) => return self.start_done(work, coordinator, Err(e.into())).await,
                };
                if let Some((reason, message)) = refusal {
                    let refused = StartError::Refused { reason, message };
                    return self.start_done(work, coordinator, Err(refused)).await;
                }
            }
        }
        if let Some(skipped) = unrestorable {
            let refused = StartError::NothingRestorable {
                groups: work.groups,
                skipped,
            };
            return self.start_done(work, coordinator, Err(refused)).await;
        }
        if resumes_history
            && work.restore_from.is_none()
            && let Some(recorded) = recorded
        {
            let refused = StartError::NothingToRestore {
                groups: work.groups,
                storage: self.storage.clone(),
                recorded,
            };
            return self.start_done(work, coordinator, Err(refused)).await;
        }
        let restoring_rescale = self
            .status
            .rescale
            .as_ref()
            .is_some_and(|r| r.step == Step::Restoring && r.rolled_back.is_none());
        if restoring_rescale && crate::failpoints::fail_restore_at(work.parallelism) {
            let injected = StartError::Injected(format!(
                "{}={}: restore failure injected (test only)",
                crate::failpoints::FAIL_RESTORE_ENV,
                work.parallelism
            ));
            return self.start_done(work, coordinator, Err(injected)).await;
        }
        // The workers answer at once and restore their key groups; waiting for them runs in the
        // background.
        let timeout = self.settings.timeouts.start;
        let snapshot = work.restore_from.clone();
        let progress = coordinator.restore_progress();
        self.in_background(BackgroundWork::Start(Box::new(work)), move |handle| {
            let result = handle.block_on(coordinator.start(&template, timeout));
            Ended::Start(Box::new((coordinator, result)))
        });
        if let (Some(bg), Some(_)) = (self.mem.background.as_mut(), &snapshot) {
            bg.restore = Some(RestoreView {
                progress,
                snapshot,
                started: Timestamp::now().to_string(),
                began: Instant::now(),
                pass: None,
                shown: None,
            });
        }
        Ok(requeue::BACKGROUND_BACKSTOP)
    }

    /// Records how starting a run ended.
    pub(super) async fn start_done(
        &mut self,
        work: StartWork,
        coordinator: Coordinator,
        result: Result<Vec<StartResponse>, StartError>,
    ) -> Result<Duration, PassError> {
        let StartWork {
            run,
            parallelism,
            groups: key_groups,
            restore_from,
            restored_source,
            replaced_up_to,
            run_started,
            started,
            spec_hash,
        } = work;
        let from_restore_from = restored_source.is_some();
        match result {
            Ok(responses) => {
                let bytes: u64 = responses.iter().map(|r| r.bytes_read).sum();
                let groups: u32 = responses.iter().map(|r| r.groups_restored).sum();
                let expired: Vec<String> = responses
                    .iter()
                    .flat_map(|r| &r.records_expired)
                    .map(|e| {
                        format!(
                            "{} offsets {}..{} ({} records)",
                            e.partition,
                            e.from,
                            e.to,
                            e.to - e.from
                        )
                    })
                    .collect();
                if !expired.is_empty() {
                    self.event(
                        true,
                        Reason::SourceRecordsExpired,
                        format!(
                            "run {run} started from {}, but the topic's retention deleted records the job had not read: {}; the source goes on from each partition's earliest record",
                            restore_from.as_deref().unwrap_or("its snapshot"),
                            expired.join("; ")
                        ),
                    );
                }
                if from_restore_from {
                    let g = key_groups as i32;
                    let from_spec = restored_source.is_some()
                        && restored_source.as_ref() == self.spec.restore_from.as_ref();
                    if self.status.max_parallelism != Some(g) {
                        self.status.max_parallelism_origin = match from_spec {
                            true => restore_from
                                .as_deref()
                                .map(validation::ceiling_origin_snapshot),
                            false => restore_from
                                .as_deref()
                                .map(validation::ceiling_origin_change),
                        };
                        self.event(
                            false,
                            Reason::KeyGroupsPinned,
                            format!(
                                "key-group count (max parallelism) is now {g}, from {}",
                                restore_from.as_deref().unwrap_or_default()
                            ),
                        );
                    }
                    self.status.max_parallelism = Some(g);
                    // Only spec.restoreFrom is recorded as acted on (a key-group change's
                    // snapshots are the orchestrator's own choice, not a request in the spec).
                    if from_spec {
                        self.status.restored_from = restored_source.clone();
                    }
                    if let Some(b) = replaced_up_to.and_then(|b| i64::try_from(b).ok()) {
                        self.status.replaced_history_up_to = Some(b);
                    }
                    self.record_key_group_change(restored_source.as_deref());
                }
                self.mem.run = Some(RunHandle {
                    run: run.clone(),
                    parallelism,
                    coordinator,
                    started: run_started,
                    spec_hash: Some(spec_hash),
                });
                let restoring = self
                    .status
                    .rescale
                    .as_ref()
                    .is_some_and(|r| r.step == Step::Restoring);
                let rolled_back = self
                    .status
                    .rescale
                    .as_ref()
                    .is_some_and(|r| restoring && r.rolled_back.is_some());
                if restoring {
                    if let Some(r) = self.rescale_mut() {
                        r.bytes_to_read = Some(bytes as i64);
                    }
                    self.finish_restoring(rolled_back)?;
                } else {
                    self.succeeded();
                }
                self.set_running(parallelism)?;
                self.event(
                    false,
                    Reason::Started,
                    format!(
                        "run {run}: {} running in {} ms, restored {} ({}) from {}",
                        text::count(u64::from(parallelism), "worker"),
                        started.elapsed().as_millis(),
                        text::count(u64::from(groups), "key group"),
                        text::count(bytes, "byte"),
                        restore_from.as_deref().unwrap_or("nothing (empty state)")
                    ),
                );
                if restoring {
                    let r = self.status.rescale.clone().unwrap_or_default();
                    let (reason, message) = transition_finished(
                        &r,
                        rolled_back,
                        false,
                        i64::try_from(bytes).unwrap_or(i64::MAX),
                    );
                    self.event(rolled_back, reason, message);
                }
                Ok(requeue::SOON)
            }
            Err(e) => {
                self.delete_all().await?;
                let message = format!(
                    "starting run {run} at parallelism {parallelism} from {} failed: {e}",
                    restore_from.as_deref().unwrap_or("empty state")
                );
                let rollback = self
                    .status
                    .rescale
                    .as_ref()
                    .and_then(decide::rollback_on_restore_failure);
                if let Some(old) = rollback {
                    let why = format!(
                        "{message}; rolling back: restoring the old parallelism {old} from the same savepoint"
                    );
                    self.transition(Outcome::RestoreFailed)?;
                    if let Some(r) = self.rescale_mut() {
                        r.rolled_back = Some(why.clone());
                    }
                    // Refused for good (the state cannot go to that parallelism, say): the job
                    // runs on at the old one, and the change is not tried again until the spec
                    // changes.
                    if e.refuses_for_good() {
                        self.remember_refusal(decide::StartRefusal {
                            reason: e.reason(),
                            message: message.clone(),
                            parallelism: Some(parallelism),
                        });
                    }
                    self.fail(Reason::RescaleRolledBack, why.clone());
                    self.event(true, Reason::RescaleRollingBack, why);
                    return Ok(requeue::AFTER_FAILURE);
                }
                // A snapshot of the job's own history that cannot be restored: the next
                // attempt passes over it (a snapshot named by spec.restoreFrom or a transition
                // is not replaced by another by itself).
                let mut message = message;
                let mut intact = true;
                if restored_source.is_none()
                    && let StartError::Workers(CoordinatorError::Unrestorable {
                        snapshot,
                        reason,
                        ..
                    }) = &e
                {
                    self.mem
                        .unrestorable
                        .insert(snapshot.clone(), format!("restoring it failed: {reason}"));
                    message = format!(
                        "{message}; the next attempt passes over {snapshot} to the newest snapshot before it"
                    );
                    intact = false;
                }
                if e.refuses_for_good() {
                    let reason = e.reason();
                    let message = format!(
                        "{message}. No retry can change that: the job starts again once its spec changes"
                    );
                    self.remember_refusal(decide::StartRefusal {
                        reason,
                        message: message.clone(),
                        parallelism: None,
                    });
                    self.stall(reason, message);
                    return Ok(requeue::STALLED);
                }
                let reason = Reason::StartFailed;
                self.fail(reason, message.clone());
                let note = match intact {
                    true => format!("{message}; retrying with backoff (the snapshot is intact)"),
                    false => format!("{message}; retrying with backoff"),
                };
                self.event(true, reason, note);
                Ok(requeue::AFTER_FAILURE)
            }
        }
    }
}
