//! Long steps that run outside the pass (snapshots, verification, a run's start), so that they
//! hold no reconcile slot, and the pass that records how they ended.

use super::*;
use keyshift_core::reason::Reason;

/// A long step that runs outside the pass, so that it holds no reconcile slot: a checkpoint
/// stuck on a storage outage (up to its timeout) then delays its own job only, not every job
/// behind it in the controller's queue. While it runs, passes of its job do nothing; the pass
/// after it ended records its outcome.
pub(super) struct Background {
    pub(super) work: BackgroundWork,
    pub(super) rx: tokio::sync::oneshot::Receiver<Ended>,
    /// Once ended: its outcome (`None`: the task panicked and the run's coordinator is lost).
    pub(super) ended: Option<Option<Ended>>,
    /// A start that restores a snapshot: what status shows of it while it runs.
    pub(super) restore: Option<RestoreView>,
}

/// What status shows of a start's restore while it runs in the background (status.restore and
/// the Reconciling condition), at most every [`RESTORE_STATUS_EVERY`].
pub(super) struct RestoreView {
    /// The coordinator's progress, as it polls the workers.
    pub(super) progress: tokio::sync::watch::Receiver<Option<coordinator::StartProgress>>,
    /// The snapshot restored.
    pub(super) snapshot: Option<String>,
    /// When the start began (RFC 3339, and as an instant).
    pub(super) started: String,
    pub(super) began: Instant,
    /// What the pass that began the start learned: the conditions show it, with the progress.
    pub(super) pass: Option<Progress>,
    /// The progress status shows, and when it was put there.
    pub(super) shown: Option<(Instant, coordinator::StartProgress)>,
}

impl RestoreView {
    /// `status` with the restore's progress, when there is news to show and the last was shown
    /// long enough ago (a start shorter than that shows nothing).
    pub(super) fn show(
        &mut self,
        spec: &StreamJobSpec,
        generation: Option<i64>,
        status: &StreamJobStatus,
    ) -> Option<StreamJobStatus> {
        let progress = (*self.progress.borrow())?;
        let pass = self.pass.as_ref()?;
        if self.began.elapsed() < RESTORE_STATUS_EVERY {
            return None;
        }
        if let Some((at, last)) = self.shown
            && (last == progress || at.elapsed() < RESTORE_STATUS_EVERY)
        {
            return None;
        }
        self.shown = Some((Instant::now(), progress));
        let mut status = status.clone();
        status.restore = Some(status::restore_status(
            &progress,
            self.snapshot.as_deref(),
            &self.started,
        ));
        status::finish(spec, generation, &mut status, None, pass, Timestamp::now());
        Some(status)
    }
}

#[derive(Debug, Clone)]
pub(super) enum BackgroundWork {
    Checkpoint {
        parallelism: u32,
    },
    /// The savepoint of a rescale, upgrade or suspend (stops the sources).
    Savepoint {
        parallelism: u32,
    },
    /// A savepoint asked for while the job runs (the job keeps running).
    TriggeredSavepoint {
        parallelism: u32,
        trigger: decide::SavepointTrigger,
    },
    Verify {
        url: String,
    },
    /// Rewriting a key-group change's savepoint to the new count.
    Rewrite {
        source: String,
        target: String,
        groups: u32,
    },
    /// Verifying the rewritten savepoint (`target`) against its source.
    VerifyRewrite {
        source: String,
        target: String,
    },
    /// Starting a run: the workers restore their key groups, then connect.
    Start(Box<StartWork>),
    /// Pre-staging the new workers of a rescale (run `run`, of `parallelism`) beside the
    /// running job, whose run moves to the background for its catch-up checkpoints.
    Prestage {
        run: String,
        parallelism: u32,
    },
}

/// A run being started, and what recording its start needs.
#[derive(Debug, Clone)]
pub(super) struct StartWork {
    pub(super) run: String,
    pub(super) parallelism: u32,
    /// The key-group count it runs under.
    pub(super) groups: u32,
    pub(super) restore_from: Option<String>,
    /// spec.restoreFrom (or a restore transition's source) when the run restores it.
    pub(super) restored_source: Option<String>,
    /// With `restored_source`: the largest id of the job's own snapshots before this run (the
    /// history the restore replaces).
    pub(super) replaced_up_to: Option<u64>,
    pub(super) run_started: Timestamp,
    pub(super) started: Instant,
    /// The spec hash its workers are created for.
    pub(super) spec_hash: String,
}

/// Why a run did not start.
#[derive(Debug, thiserror::Error)]
pub(super) enum StartError {
    #[error(transparent)]
    Workers(#[from] CoordinatorError),
    /// The job has committed snapshots (status records them) but none can be found to restore:
    /// starting empty would silently drop its state.
    #[error(
        "no committed snapshot of the job under {groups} key groups was found in {storage}, although status records {recorded}; refusing to start empty, which would drop the job's state. Restore the missing snapshot, point spec.restoreFrom at a snapshot to continue from, or set spec.upgradeMode: stateless to start empty on purpose"
    )]
    NothingToRestore {
        groups: u32,
        storage: String,
        recorded: String,
    },
    /// The job has snapshots, but none of them can be restored (each passed over: a manifest
    /// that cannot be used, a state file lost or truncated): starting empty, or from the
    /// `spec.restoreFrom` its history began with, would drop or replay its state.
    #[error(
        "none of the job's snapshots under {groups} key groups can be restored: {skipped}; refusing to start empty or from spec.restoreFrom, which would drop the job's state or publish its output again. Restore the lost files (the job resumes by itself), point spec.restoreFrom at a snapshot to continue from, or set spec.upgradeMode: stateless to start empty on purpose"
    )]
    NothingRestorable { groups: u32, skipped: String },
    /// The snapshot to restore must not be restored into this job (another job's, or state
    /// under another layout): see [`run::restore_refusal`].
    #[error("{message}")]
    Refused { reason: Reason, message: String },
    /// Test only (`test-hooks`).
    #[error("{0}")]
    Injected(String),
}

impl StartError {
    /// The reason a refusal stalls the job with: the one the refusal carries, or StartRefused.
    pub(super) fn reason(&self) -> Reason {
        match self {
            StartError::Refused { reason, .. } => *reason,
            _ => Reason::StartRefused,
        }
    }

    /// Whether no retry of the same start can succeed (a refusal by the orchestration or by the
    /// workers, [`CoordinatorError::Refused`]): only a changed spec or image can help. A job
    /// whose recorded snapshots cannot be found is retried: the fix (restoring the snapshots)
    /// may lie outside its spec.
    pub(super) fn refuses_for_good(&self) -> bool {
        match self {
            StartError::Refused { .. } => true,
            StartError::Workers(e) => matches!(e, CoordinatorError::Refused { .. }),
            StartError::NothingToRestore { .. }
            | StartError::NothingRestorable { .. }
            | StartError::Injected(_) => false,
        }
    }
}

/// How a background step ended.
pub(super) enum Ended {
    Snapshot(Box<(RunHandle, Result<Completed, CoordinatorError>)>),
    Verify(Result<snapshot::VerifyReport, snapshot::SnapshotError>),
    /// `None`: the target had already committed (the orchestrator restarted after the rewrite).
    Rewrite(Result<Option<crate::offline::rewrite::RewriteReport>, crate::offline::ToolError>),
    /// What was checked, or why the rewritten savepoint must not be restored.
    VerifyRewrite(Result<String, String>),
    Start(Box<(Coordinator, Result<Vec<StartResponse>, CoordinatorError>)>),
    /// The running job's run (back from the background) and what pre-staging did.
    Prestage(Box<(RunHandle, Result<run::Prestaged, CoordinatorError>)>),
}

impl Background {
    /// Whether it still runs; once it ended, its outcome is kept for the next pass.
    pub(super) fn running(&mut self) -> bool {
        if self.ended.is_some() {
            return false;
        }
        match self.rx.try_recv() {
            Ok(outcome) => self.ended = Some(Some(outcome)),
            Err(tokio::sync::oneshot::error::TryRecvError::Empty) => return true,
            Err(tokio::sync::oneshot::error::TryRecvError::Closed) => self.ended = Some(None),
        }
        false
    }
}

impl Pass<'_> {
    /// Runs `work` on a blocking thread (the coordinator's snapshot future is not provably
    /// `Send`: retention and manifest commits borrow inside stream closures). Its end wakes the
    /// job's controller; the pass it triggers records the outcome.
    pub(super) fn in_background(
        &mut self,
        work: BackgroundWork,
        run: impl FnOnce(&tokio::runtime::Handle) -> Ended + Send + 'static,
    ) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let waker = self.workers.waker();
        let handle = tokio::runtime::Handle::current();
        tracing::debug!(job = %self.name, ?work, "background step started");
        tokio::task::spawn_blocking(move || {
            // The outcome first: the pass the wake-up triggers must find it.
            let _ = tx.send(run(&handle));
            waker();
        });
        self.mem.background = Some(Background {
            work,
            rx,
            ended: None,
            restore: None,
        });
    }

    /// A snapshot of the coordinated run in the background (the run's coordinator moves there
    /// and back).
    pub(super) fn snapshot_in_background(
        &mut self,
        work: BackgroundWork,
        mut run: RunHandle,
        kind: SnapshotKind,
        stop: bool,
        timeout: Duration,
    ) {
        self.in_background(work, move |handle| {
            let result = handle.block_on(run.coordinator.snapshot(kind, stop, timeout));
            Ended::Snapshot(Box::new((run, result)))
        });
    }

    /// Records what a background step that ended did.
    pub(super) async fn record_background(
        &mut self,
        bg: Background,
    ) -> Result<Duration, PassError> {
        let Background { work, ended, .. } = bg;
        tracing::debug!(job = %self.name, ?work, "background step ended");
        match (work, ended.flatten()) {
            (BackgroundWork::Checkpoint { parallelism }, Some(Ended::Snapshot(done))) => {
                Ok(self.checkpoint_done(parallelism, *done))
            }
            (BackgroundWork::Savepoint { parallelism }, Some(Ended::Snapshot(done))) => {
                self.savepoint_done(parallelism, *done).await
            }
            (
                BackgroundWork::TriggeredSavepoint {
                    parallelism,
                    trigger,
                },
                Some(Ended::Snapshot(done)),
            ) => Ok(self.triggered_savepoint_done(parallelism, trigger, *done)),
            (BackgroundWork::Start(work), Some(Ended::Start(done))) => {
                let (coordinator, result) = *done;
                self.start_done(*work, coordinator, result.map_err(StartError::from))
                    .await
            }
            (BackgroundWork::Prestage { run, parallelism }, Some(Ended::Prestage(done))) => {
                let (old, result) = *done;
                self.prestage_done(&run, parallelism, old, result).await
            }
            (BackgroundWork::Verify { url }, Some(Ended::Verify(result))) => {
                match result {
                    Ok(report) => {
                        self.transition(Outcome::Verified)?;
                        self.event(
                            false,
                            Reason::SavepointVerified,
                            format!(
                                "{url}: {} files, {} key groups, {} bytes and {} keys checked",
                                report.files,
                                report.groups,
                                report.bytes_checked,
                                report.total_keys
                            ),
                        );
                    }
                    Err(e) => {
                        self.abandon(format!("savepoint {url} failed verification: {e}"), true)
                            .await?;
                    }
                }
                Ok(requeue::SOON)
            }
            (
                BackgroundWork::Rewrite {
                    source,
                    target,
                    groups,
                },
                Some(Ended::Rewrite(result)),
            ) => {
                self.rewrite_done(&source, &target, groups, result)?;
                Ok(requeue::SOON)
            }
            (
                BackgroundWork::VerifyRewrite { source, target },
                Some(Ended::VerifyRewrite(result)),
            ) => {
                match result {
                    Ok(checked) => {
                        self.transition(Outcome::RewriteVerified)?;
                        self.event(
                            false,
                            Reason::RewriteVerified,
                            format!("{target} (rewritten from {source}): {checked}"),
                        );
                    }
                    Err(why) => self.roll_back_rewrite(format!(
                        "the rewritten savepoint {target} failed verification: {why}"
                    ))?,
                }
                Ok(requeue::SOON)
            }
            (work, _) => {
                // The thread panicked: a snapshot's run (its coordinator) is lost with it. The
                // workers still run; the next pass adopts them again.
                tracing::error!(job = %self.name, ?work, "background step failed without an outcome");
                Ok(requeue::AFTER_FAILURE)
            }
        }
    }
}
