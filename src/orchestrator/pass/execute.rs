//! Executing the action [`decide::decide`] chose, and recording the outcome of each kind of
//! step (snapshots, verification, a run's start) once it ended.

use super::*;

/// The least time before a rolled-back key-group change is tried again.
const KEY_GROUP_CHANGE_RETRY: jiff::SignedDuration = jiff::SignedDuration::from_mins(5);

impl Pass<'_> {
    pub(super) async fn execute(&mut self, action: Action) -> Result<Duration, PassError> {
        let short = requeue::SOON;
        match action {
            Action::Stall { reason, message } => {
                self.stall(reason, message);
                Ok(requeue::STALLED)
            }
            Action::PinMaxParallelism { groups: g, origin } => {
                self.status.max_parallelism = Some(g as i32);
                self.status.max_parallelism_origin = Some(origin);
                self.event(
                    false,
                    Reason::KeyGroupsPinned,
                    format!("key-group count (max parallelism) pinned at {g}"),
                );
                Ok(short)
            }
            Action::BeginRescale { from, to, prestage } => self.begin_rescale(from, to, prestage),
            Action::BeginRestore {
                from,
                to,
                url,
                max_parallelism,
            } => self.begin_restore(from, to, url, max_parallelism),
            Action::BeginUpgrade {
                parallelism,
                mode,
                prestage,
            } => self.begin_upgrade(parallelism, mode, prestage),
            Action::Savepoint => self.savepoint().await,
            Action::Prestage { run, parallelism } => self.prestage(run, parallelism).await,
            Action::FallBack { message } => {
                self.fall_back(message)?;
                Ok(short)
            }
            Action::DeleteRun { run, reason } => {
                let n = self.delete_where(|p| p.run == run).await?;
                Ok(self.deleted(n, reason))
            }
            Action::DeleteAllBut { keep } => {
                // The old run ends with its workers.
                self.mem.run = None;
                let n = self.delete_where(|p| p.run != keep).await?;
                Ok(self.deleted(n, Reason::Stopping))
            }
            Action::Verify { url } => {
                let work = BackgroundWork::Verify { url: url.clone() };
                // A pre-staged rescale's stop checkpoint: the files it wrote (its delta). The
                // files it refers to are those the new workers loaded, every block checked.
                let written_only = self.rescale_mut().is_some_and(|r| r.prestaged().is_some());
                self.in_background(work, move |handle| {
                    Ended::Verify(handle.block_on(async {
                        let (store, dir) = snapshot::open_store(&url)?;
                        if written_only {
                            snapshot::verify_written(store.as_ref(), &dir).await
                        } else {
                            snapshot::verify(store.as_ref(), &dir).await
                        }
                    }))
                });
                Ok(requeue::BACKGROUND_BACKSTOP)
            }
            Action::DeletePods { reason } => {
                let n = self.delete_all().await?;
                Ok(self.deleted(n, reason))
            }
            Action::Advance(Outcome::StoppedForRewrite) => {
                // Where the rewrite goes is recorded with the step, before the step acts.
                let target = run::rewrite_target(&self.storage, &self.ns, &self.name)
                    .await
                    .map_err(PassError::FindSnapshot)?;
                self.transition(Outcome::StoppedForRewrite)?;
                if let Some(r) = self.rescale_mut() {
                    r.rewritten = Some(target);
                }
                Ok(short)
            }
            Action::Advance(outcome) => {
                self.transition(outcome)?;
                Ok(short)
            }
            Action::BeginKeyGroupChange {
                from,
                to,
                groups,
                running,
            } => self.begin_key_group_change(from, to, groups, running).await,
            Action::Rewrite {
                source,
                target,
                groups,
                parallelism,
            } => self.rewrite(source, target, groups, parallelism).await,
            Action::VerifyRewrite { source, target } => self.verify_rewrite(source, target),
            Action::RollBackRewrite { message } => {
                self.roll_back_rewrite(message)?;
                Ok(short)
            }
            Action::Abandon { message } => {
                self.abandon(message, true).await?;
                Ok(short)
            }
            Action::CreatePods {
                run,
                parallelism,
                subtasks,
            } => self.create_pods(run, parallelism, subtasks).await,
            Action::Wait { reason } => {
                self.progress.note = Some((Reason::Waiting.into(), reason));
                Ok(requeue::WORKERS_CHANGING)
            }
            Action::Start {
                run,
                parallelism,
                restore,
            } => self.start(run, parallelism, restore).await,
            Action::Adopt { run, parallelism } => self.adopt(run, parallelism).await,
            Action::Recover { message } => {
                self.delete_all().await?;
                self.progress.phase = Some(Phase::Pending);
                self.fail(
                    Reason::WorkerFailed,
                    format!("{message}; restarting from the last checkpoint"),
                );
                self.metrics
                    .restarts
                    .get_or_create(&OperatorMetrics::job(&self.ns, &self.name))
                    .inc();
                self.event(
                    true,
                    Reason::WorkerFailed,
                    format!("{message}; restarting the job from its last checkpoint"),
                );
                Ok(requeue::WORKERS_CHANGING)
            }
            Action::FinishRescale => self.finish_rescale(),
            Action::Checkpoint => Ok(self.checkpoint()),
            Action::TriggerSavepoint { nonce } => Ok(self.triggered_savepoint(nonce)),
            Action::MarkSuspended => {
                self.progress.phase = Some(Phase::Suspended);
                self.status.replicas = Some(0);
                self.status.key_groups = None;
                Ok(short)
            }
            Action::Idle { requeue } => Ok(requeue),
        }
    }

    /// Begins a rescale from `from` to `to` subtasks (0: a suspend), pre-staged by the new run
    /// `prestage` when one is named: the rescale in status with the groups it moves, and its Event.
    fn begin_rescale(
        &mut self,
        from: u32,
        to: u32,
        prestage: Option<String>,
    ) -> Result<Duration, PassError> {
        let short = requeue::SOON;
        let groups_moved = match (self.assignment(from), self.assignment(to.max(1))) {
            (Ok(a), Ok(b)) if to > 0 => keygroup::rescale_plan(a, b)
                .ok()
                .map(|p| p.moved_groups as i32),
            _ => None,
        };
        let now = Timestamp::now().to_string();
        let prestage = prestage.map(|run| crate::crd::PrestageStatus {
            run,
            since: now.clone(),
            ..Default::default()
        });
        let prestaging = prestage.is_some();
        self.begin(RescaleStatus {
            from: from as i32,
            to: to as i32,
            step: if prestaging {
                Step::Prestaging
            } else {
                Step::Savepointing
            },
            started: now,
            groups_moved,
            prestage,
            ..Default::default()
        });
        let what = if to == 0 {
            format!("suspending (parallelism {from}) with a savepoint")
        } else if prestaging {
            format!(
                "rescaling {from} -> {to}: pre-stage the new workers beside the running job, stop with a delta checkpoint, start them from it"
            )
        } else {
            format!(
                "rescaling {from} -> {to}: stop with a savepoint, verify, move key groups, restart"
            )
        };
        self.event(
            false,
            if to == 0 {
                Reason::Suspending
            } else {
                Reason::RescaleStarted
            },
            what,
        );
        Ok(short)
    }

    /// Begins an upgrade in `mode` of the job running at `parallelism` (its spec.job or spec.image
    /// changed).
    fn begin_upgrade(
        &mut self,
        parallelism: u32,
        mode: UpgradeMode,
        prestage: Option<String>,
    ) -> Result<Duration, PassError> {
        let short = requeue::SOON;
        let p = parallelism as i32;
        let now = Timestamp::now().to_string();
        let prestage = prestage.map(|run| crate::crd::PrestageStatus {
            run,
            since: now.clone(),
            ..Default::default()
        });
        let prestaging = prestage.is_some();
        self.begin(RescaleStatus {
            from: p,
            to: p,
            step: if prestaging {
                Step::Prestaging
            } else {
                Step::first_of_upgrade(mode)
            },
            started: now,
            groups_moved: Some(0),
            upgrade_mode: Some(mode),
            prestage,
            ..Default::default()
        });
        let how = match mode {
            crate::crd::UpgradeMode::Savepoint if prestaging => {
                "pre-stage workers of the new spec beside the running job (they check the state fits it), stop with a savepoint, verify, start them from it"
            }
            crate::crd::UpgradeMode::Savepoint => {
                "stop with a savepoint, verify, restart with the new spec from it"
            }
            crate::crd::UpgradeMode::LastState if prestaging => {
                "pre-stage workers of the new spec beside the running job from its latest checkpoint (they check the state fits it), stop with a checkpoint of what changed since, start them from it"
            }
            crate::crd::UpgradeMode::LastState => {
                "stop, restart with the new spec from the latest checkpoint"
            }
            crate::crd::UpgradeMode::Stateless => "stop, restart with the new spec and empty state",
        };
        self.event(
            false,
            Reason::UpgradeStarted,
            format!("spec.job or spec.image changed (parallelism {parallelism}): {how}"),
        );
        Ok(short)
    }

    /// Verifies the rewritten savepoint `target` against `source`, in the background.
    fn verify_rewrite(&mut self, source: String, target: String) -> Result<Duration, PassError> {
        let groups = self
            .status
            .rescale
            .as_ref()
            .and_then(|r| r.max_parallelism)
            .unwrap_or_default()
            .max(0) as u32;
        let parallelism = self
            .status
            .rescale
            .as_ref()
            .map_or(0, |r| r.to.max(0) as u32);
        let work = BackgroundWork::VerifyRewrite {
            source: source.clone(),
            target: target.clone(),
        };
        self.in_background(work, move |handle| {
            Ended::VerifyRewrite(handle.block_on(run::verify_rewrite(
                &source,
                &target,
                groups,
                parallelism,
            )))
        });
        Ok(requeue::BACKGROUND_BACKSTOP)
    }

    /// Takes over run `run` (at `parallelism`), already running, with a coordinator of this process
    /// (resuming workers a predecessor left stopped).
    async fn adopt(&mut self, run: String, parallelism: u32) -> Result<Duration, PassError> {
        let short = requeue::SOON;
        let Some(endpoints) = self.endpoints(parallelism) else {
            return Ok(short);
        };
        // The workers run under the key-group count they were started with.
        let assignment = match self.run_groups.get(&run) {
            Some(g) => Assignment::new(i64::from(parallelism), i64::from(*g))?,
            None => self.assignment(parallelism)?,
        };
        // Workers created for another spec.job run the logic they were started with:
        // their snapshots keep saying so (the identity of the job's newest snapshot), so
        // that an upgrade that would mix histories is still refused.
        let want = self.settings.spec_hash.clone();
        let spec_hash = self
            .pods
            .iter()
            .find(|p| p.run == run)
            .and_then(|p| p.spec_hash.clone());
        let stale = spec_hash.as_ref().is_some_and(|h| *h != want);
        let identity = match stale {
            true => self.newest_identity().await.map_err(PassError::Adopt)?,
            false => self.identity(),
        };
        let coordinator = self
            .coordinator(assignment, endpoints, identity, PassError::Adopt)
            .await?;
        if self
            .pods
            .iter()
            .any(|p| p.worker == Some(WorkerState::Stopped))
        {
            coordinator.resume().await;
        }
        self.mem.run = Some(RunHandle {
            run: run.clone(),
            parallelism,
            coordinator,
            started: Timestamp::now(),
            spec_hash,
        });
        let rescaling = self
            .status
            .rescale
            .as_ref()
            .is_some_and(|r| r.step.active());
        if !rescaling {
            self.set_running(parallelism)?;
        }
        tracing::info!(job = %self.name, run, parallelism, "adopted running workers");
        Ok(short)
    }

    /// The new run of a rescale is up: the rescale ends, and the job runs at its new parallelism
    /// (or is suspended).
    fn finish_rescale(&mut self) -> Result<Duration, PassError> {
        let short = requeue::SOON;
        let (to, rolled_back) = self.status.rescale.as_ref().map_or((0, false), |r| {
            (decide::restore_target(r), r.rolled_back.is_some())
        });
        self.finish_restoring(rolled_back)?;
        if to == 0 {
            self.status.replicas = Some(0);
            self.progress.phase = Some(Phase::Suspended);
            self.status.key_groups = None;
        } else {
            self.set_running(to)?;
        }
        let r = self.status.rescale.clone().unwrap_or_default();
        self.event(
            rolled_back,
            if to == 0 {
                Reason::Suspended
            } else if rolled_back {
                Reason::RescaleRolledBack
            } else {
                Reason::Rescaled
            },
            format!(
                "{} -> {} done: {} key groups moved, {} bytes read; {}{}",
                r.from,
                r.to,
                r.groups_moved.unwrap_or_default(),
                r.bytes_to_read.unwrap_or_default(),
                step_times(&r),
                prestage_summary(&r)
            ),
        );
        Ok(short)
    }

    /// Begins a restore from spec.restoreFrom `url` (of `max_parallelism` key groups) at `to`
    /// subtasks, keeping the current state in a savepoint first.
    fn begin_restore(
        &mut self,
        from: u32,
        to: u32,
        url: String,
        max_parallelism: u32,
    ) -> Result<Duration, PassError> {
        let short = requeue::SOON;
        self.begin(RescaleStatus {
            from: from as i32,
            to: to as i32,
            step: Step::Savepointing,
            started: Timestamp::now().to_string(),
            restore_from: Some(url.clone()),
            max_parallelism: Some(max_parallelism as i32),
            ..Default::default()
        });
        self.event(
            false,
            Reason::RestoreStarted,
            format!(
                "spec.restoreFrom changed: keeping the current state in a savepoint, then restarting at parallelism {to} from {url} ({max_parallelism} key groups)"
            ),
        );
        Ok(short)
    }

    /// Rewrites savepoint `source` into `target` at `groups` key groups (for a run at
    /// `parallelism`), in the background.
    async fn rewrite(
        &mut self,
        source: String,
        target: String,
        groups: u32,
        parallelism: u32,
    ) -> Result<Duration, PassError> {
        let short = requeue::SOON;
        let (memory, spill) = match super::super::ceiling::rewrite_settings() {
            Ok(s) => s,
            Err(e) => {
                self.roll_back_rewrite(e.to_string())?;
                return Ok(short);
            }
        };
        let fault = crate::failpoints::rewrite_fault(&self.ns, &self.name);
        let memory = match fault {
            Some(crate::failpoints::RewriteFault::MemoryBudget(m)) => m,
            _ => memory,
        };
        let work = BackgroundWork::Rewrite {
            source: source.clone(),
            target: target.clone(),
            groups,
        };
        self.in_background(work, move |handle| {
            Ended::Rewrite(handle.block_on(async {
                let done =
                    run::rewrite_savepoint(&source, &target, groups, parallelism, memory, spill)
                        .await;
                if matches!(done, Ok(Some(_)))
                    && fault == Some(crate::failpoints::RewriteFault::CorruptOutput)
                    && let Err(e) = crate::failpoints::corrupt_snapshot(&target).await
                {
                    tracing::error!(%target, "could not corrupt it: {e}");
                }
                done
            }))
        });
        Ok(requeue::BACKGROUND_BACKSTOP)
    }

    /// Creates the pods `subtasks` of run `run` at `parallelism`.
    async fn create_pods(
        &mut self,
        run: String,
        parallelism: u32,
        subtasks: Vec<u32>,
    ) -> Result<Duration, PassError> {
        let short = requeue::SOON;
        let assignment = self.assignment(parallelism)?;
        // The workers read the token from its source (the Secret): make sure it
        // (still) exists.
        if self.token_from_cache {
            let token = self.workers.token().await.map_err(PassError::Token)?;
            self.mem.token = Some(token.clone());
            self.token = token;
            self.token_from_cache = false;
        }
        let created = self
            .workers
            .create(&run, assignment, &subtasks, &self.token)
            .await;
        if let Err(e) = created {
            // A pre-staged rescale's new workers refused for good (a quota, say): the
            // rescale goes on without them at once.
            let prestaging = self.status.rescale.as_ref().is_some_and(|r| {
                r.step == Step::Prestaging && r.prestage_run() == Some(run.as_str())
            });
            if prestaging && !e.transient {
                self.fall_back(format!("creating the new workers was refused: {e}"))?;
                return Ok(short);
            }
            return Err(PassError::Create(e));
        }
        self.event(
            false,
            Reason::CreatedPods,
            format!(
                "run {run}: created {} of {}",
                subtasks.len(),
                text::count(u64::from(parallelism), "worker")
            ),
        );
        self.progress.note = Some((
            Reason::CreatingPods.into(),
            format!(
                "run {run}: {}",
                text::count(u64::from(parallelism), "worker")
            ),
        ));
        Ok(requeue::WORKERS_CHANGING)
    }

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

    /// Records a key-group change. A running job takes its savepoint first; a stopped one has its
    /// newest snapshot verified and rewritten (or, with no snapshot at all, no state to
    /// rewrite: the new count is simply pinned).
    pub(super) async fn begin_key_group_change(
        &mut self,
        from: u32,
        to: u32,
        groups: u32,
        running: bool,
    ) -> Result<Duration, PassError> {
        let old = self.status.max_parallelism.unwrap_or_default().max(1);
        let mut change = RescaleStatus {
            from: from as i32,
            to: to as i32,
            step: Step::Savepointing,
            started: Timestamp::now().to_string(),
            max_parallelism: Some(groups as i32),
            from_max_parallelism: Some(old),
            ..Default::default()
        };
        if !running {
            let found = run::latest_restorable(
                self.spec,
                &self.storage,
                &self.ns,
                &self.name,
                old as u32,
                self.status
                    .replaced_history_up_to
                    .and_then(|b| u64::try_from(b).ok()),
                &self.mem.unrestorable,
            )
            .await
            .map_err(PassError::FindSnapshot)?;
            let Some(url) = found.url else {
                self.status.max_parallelism = Some(groups as i32);
                self.status.max_parallelism_origin = Some(validation::ceiling_origin(
                    validation::CeilingSource::Spec,
                    0,
                ));
                self.event(
                    false,
                    Reason::KeyGroupsPinned,
                    format!(
                        "key-group count (max parallelism) is now {groups}: the job had no snapshot under {old}, so there was no state to rewrite"
                    ),
                );
                return Ok(requeue::SOON);
            };
            let manifest = snapshot::open_snapshot(&url)
                .await
                .map_err(|e| PassError::FindSnapshot(e.into()))?
                .2;
            change.from = manifest.parallelism as i32;
            change.step = Step::Verifying;
            change.savepoint = Some(url);
        }
        let what = format!(
            "spec.maxParallelism changed {old} -> {groups}: {}verify it, stop the old workers, rewrite it to {groups} key groups, verify every key of the rewrite, restore it at parallelism {to}; the original savepoint is kept",
            match &change.savepoint {
                Some(url) =>
                    format!("the job is stopped, so its newest snapshot {url} is rewritten: "),
                None => format!("stop the job (parallelism {from}) with a savepoint, "),
            }
        );
        self.begin(change);
        self.event(false, Reason::KeyGroupChangeStarted, what);
        Ok(requeue::SOON)
    }

    /// A run restored by a transition that changed the key-group count started: a rewrite's
    /// new run records the change (reversible until its first checkpoint), an undo of a change
    /// forgets it.
    fn record_key_group_change(&mut self, restored: Option<&str>) {
        let undone = self
            .status
            .key_group_change
            .as_ref()
            .is_some_and(|c| Some(c.original_savepoint.as_str()) == restored);
        if undone {
            if let Some(c) = self.status.key_group_change.take() {
                self.event(
                    false,
                    Reason::KeyGroupsChanged,
                    format!(
                        "the change to {} key groups was undone: the job runs from the original savepoint {} under {} key groups again",
                        c.to_max_parallelism, c.original_savepoint, c.from_max_parallelism
                    ),
                );
            }
            return;
        }
        let Some(r) = self
            .status
            .rescale
            .as_ref()
            .filter(|r| r.rewrites() && r.rolled_back.is_none())
        else {
            return;
        };
        let mut change = crate::crd::KeyGroupChangeStatus {
            from_max_parallelism: r.from_max_parallelism.unwrap_or_default(),
            to_max_parallelism: r.max_parallelism.unwrap_or_default(),
            from_replicas: r.from,
            original_savepoint: r.savepoint.clone().unwrap_or_default(),
            rewritten_savepoint: r.rewritten.clone().unwrap_or_default(),
            finished: Timestamp::now().to_string(),
            point_of_no_return: None,
            point_of_no_return_time: None,
            message: String::new(),
        };
        change.message = crate::orchestrator::ceiling::change_message(&change);
        let note = format!(
            "key-group count {} -> {} at parallelism {}: {}",
            change.from_max_parallelism, change.to_max_parallelism, r.to, change.message
        );
        self.status.key_group_change = Some(change);
        self.event(false, Reason::KeyGroupsChanged, note);
    }

    /// A snapshot of the job committed: the first one after a key-group change is its point of
    /// no return (its output becomes visible; the original savepoint no longer holds it).
    pub(super) fn pass_point_of_no_return(&mut self, c: &Completed) {
        let Some(change) = self
            .status
            .key_group_change
            .as_mut()
            .filter(|k| k.point_of_no_return.is_none())
        else {
            return;
        };
        if c.manifest.max_parallelism as i32 != change.to_max_parallelism
            || c.url == change.rewritten_savepoint
        {
            return;
        }
        change.point_of_no_return = Some(c.id as i64);
        change.point_of_no_return_time = Some(Timestamp::now().to_string());
        change.message = crate::orchestrator::ceiling::change_message(change);
        let note = change.message.clone();
        self.event(false, Reason::KeyGroupChangeIrreversible, note);
    }

    /// How the rewrite of a key-group change ended.
    pub(super) fn rewrite_done(
        &mut self,
        source: &str,
        target: &str,
        groups: u32,
        result: Result<Option<crate::offline::RewriteReport>, crate::offline::ToolError>,
    ) -> Result<(), PassError> {
        match result {
            Ok(report) => {
                let detail = match &report {
                    Some(r) => {
                        if let Some(s) = self.rescale_mut() {
                            s.rewritten_keys = Some(r.keys as i64);
                            s.rewritten_bytes = Some(r.bytes_written as i64);
                        }
                        format!(
                            "{} keys, {} bytes read and {} written ({} spilled to local disk) in {:.3} s",
                            r.keys, r.bytes_read, r.bytes_written, r.spill_bytes, r.total_secs
                        )
                    }
                    None => "it had already committed before the orchestrator restarted".into(),
                };
                self.transition(Outcome::Rewritten)?;
                self.event(
                    false,
                    Reason::SavepointRewritten,
                    format!("{source} rewritten to {groups} key groups as {target}: {detail}"),
                );
            }
            Err(e) => self.roll_back_rewrite(format!(
                "rewriting {source} to {groups} key groups failed: {e}"
            ))?,
        }
        Ok(())
    }

    /// A key-group change goes back: the original savepoint is restored at the old parallelism
    /// and key-group count (step Restoring, rolled back).
    pub(super) fn roll_back_rewrite(&mut self, message: String) -> Result<(), PassError> {
        let (from, old) = self.status.rescale.as_ref().map_or((0, 0), |r| {
            (r.from, r.from_max_parallelism.unwrap_or_default())
        });
        let why = format!(
            "{message}; rolling back: restoring the original savepoint at parallelism {from} under {old} key groups (the rewritten savepoint, if any, is left for inspection)"
        );
        self.transition(Outcome::RewriteFailed)?;
        if let Some(r) = self.rescale_mut() {
            r.rolled_back = Some(why.clone());
        }
        self.fail(Reason::KeyGroupChangeRolledBack, why.clone());
        self.event(true, Reason::KeyGroupChangeRolledBack, why);
        Ok(())
    }

    /// The coordinator of a new run `run` of `parallelism` workers at `endpoints`, and its start
    /// request restoring `restore_from` (a start, or a pre-stage without it).
    async fn new_run(
        &mut self,
        parallelism: u32,
        endpoints: Vec<WorkerEndpoint>,
        run: &str,
        restore_from: Option<String>,
    ) -> Result<(Coordinator, crate::runtime::protocol::StartRequest), PassError> {
        let assignment = self.assignment(parallelism)?;
        let identity = self.identity();
        let coordinator = self
            .coordinator(assignment, endpoints, identity, PassError::Start)
            .await?;
        let template = run::StartPlan {
            namespace: &self.ns,
            name: &self.name,
            spec: self.spec,
            assignment,
            storage: &self.storage,
            restore_from,
            run,
            state_payload_bytes: crate::failpoints::state_payload_bytes(),
        }
        .request()?;
        Ok((coordinator, template))
    }

    /// Pre-stages the new workers of run `run_id` (see [`run::prestage`]) in the background; the
    /// running job's run goes with it (for its catch-up checkpoints) and comes back.
    pub(super) async fn prestage(
        &mut self,
        run_id: String,
        parallelism: u32,
    ) -> Result<Duration, PassError> {
        let endpoints = endpoints_of(&self.prestage_endpoints, parallelism);
        let (Some(endpoints), true) = (endpoints, self.mem.run.is_some()) else {
            return Ok(requeue::SOON);
        };
        let (new, template) = self.new_run(parallelism, endpoints, &run_id, None).await?;
        let Some(mut old) = self.mem.run.take() else {
            return Ok(requeue::SOON);
        };
        let checkpoint_timeout = self.settings.timeouts.checkpoint;
        let job = (self.storage.clone(), self.ns.clone(), self.name.clone());
        let groups = self.max_parallelism();
        let replaced_up_to = self
            .status
            .replaced_history_up_to
            .and_then(|b| u64::try_from(b).ok());
        let timeout = self.settings.timeouts.prestage;
        let work = BackgroundWork::Prestage {
            run: run_id,
            parallelism,
        };
        self.in_background(work, move |handle| {
            let result = handle.block_on(run::prestage(
                checkpoint_timeout,
                (&job.0, &job.1, &job.2),
                groups,
                replaced_up_to,
                &mut old.coordinator,
                &new,
                &template,
                crate::runtime::prestage::CatchUp::default(),
                timeout,
            ));
            Ended::Prestage(Box::new((old, result)))
        });
        Ok(requeue::BACKGROUND_BACKSTOP)
    }

    /// Records how pre-staging ended: step Savepointing with what was loaded, or a fallback.
    pub(super) async fn prestage_done(
        &mut self,
        run_id: &str,
        parallelism: u32,
        old: RunHandle,
        result: Result<run::Prestaged, CoordinatorError>,
    ) -> Result<Duration, PassError> {
        let old_parallelism = old.parallelism;
        self.mem.run = Some(old);
        match result {
            Ok(done) => {
                let labels = self.kind_labels(SnapshotKind::Checkpoint);
                for c in &done.checkpoints {
                    self.record_snapshot(&labels, Some(c));
                    self.status.last_checkpoint = Some(snapshot_ref(c, old_parallelism));
                }
                let loaded = done.loaded_bytes();
                if let Some(p) = self.rescale_mut().and_then(|r| r.prestage.as_mut()) {
                    p.base = Some(done.base.clone());
                    p.loaded_bytes = Some(loaded as i64);
                    p.catch_up_rounds = Some(done.catch_up_rounds() as i32);
                }
                self.transition(Outcome::Prestaged)?;
                self.event(
                    false,
                    Reason::Prestaged,
                    format!(
                        "run {run_id}: {} loaded {loaded} bytes of state from {} ({}) while the job kept running",
                        text::count(u64::from(parallelism), "new worker"),
                        done.base,
                        text::count(u64::from(done.catch_up_rounds()), "catch-up round"),
                    ),
                );
                Ok(requeue::RECORDED)
            }
            // The new workers refused the state for good (it cannot go to that parallelism):
            // the old run has not stopped, and goes on; the rescale is not tried again until
            // the spec changes.
            Err(e @ CoordinatorError::Refused { .. }) => {
                let refusal = decide::StartRefusal {
                    reason: Reason::StartRefused,
                    message: format!(
                        "pre-staging the new workers at parallelism {parallelism} was refused: {e}"
                    ),
                    parallelism: Some(parallelism),
                };
                let message = refusal.running_message(old_parallelism);
                self.remember_refusal(refusal);
                self.abandon(message, false).await?;
                Ok(requeue::SOON)
            }
            Err(e) => {
                self.fall_back(format!("pre-staging the new workers failed: {e}"))?;
                Ok(requeue::SOON)
            }
        }
    }

    /// A pre-staged rescale goes on as a stop-and-restore: why is recorded (status, a warning
    /// Event); the next passes remove the pre-staged workers.
    pub(super) fn fall_back(&mut self, message: String) -> Result<(), PassError> {
        if let Some(r) = self.rescale_mut() {
            r.fallback = Some(message.clone());
        }
        self.transition(Outcome::FellBack)?;
        self.event(
            true,
            Reason::PrestageFellBack,
            format!(
                "{message}: the pre-staged workers are removed and the rescale goes on as a stop-and-restore"
            ),
        );
        Ok(())
    }

    /// Records that `n` workers are being deleted, for `reason`.
    fn deleted(&mut self, n: usize, reason: Reason) -> Duration {
        if n > 0 {
            self.event(
                false,
                Reason::DeletingPods,
                format!("{reason}: deleting {}", text::count(n as u64, "worker")),
            );
        }
        self.progress.note = Some((
            reason.into(),
            format!("deleting {}", text::count(n as u64, "worker")),
        ));
        requeue::WORKERS_CHANGING
    }

    /// Remembers a start refused for good, of `parallelism` (a change of the running job) or
    /// of any start (`None`), until the spec changes.
    fn remember_refusal(&mut self, refusal: decide::StartRefusal) {
        self.mem.start_refused = Some((super::refusal_key(self.spec), refusal));
    }

    /// Gives the rescale up while the old run goes on; it is retried with backoff when
    /// `retried` (else a refusal holds it until the spec changes).
    pub(super) async fn abandon(
        &mut self,
        message: String,
        retried: bool,
    ) -> Result<(), PassError> {
        self.transition(Outcome::GaveUp)?;
        if let Some(run) = &self.mem.run {
            run.coordinator.resume().await;
            // The old run goes on: the job runs (at its old parallelism), it is not rescaling.
            let parallelism = run.parallelism;
            self.set_running(parallelism)?;
        }
        if retried {
            self.fail(Reason::RescaleAbandoned, message.clone());
            self.event(true, Reason::RescaleAbandoned, format!("{message}; the job keeps running at its old parallelism and the rescale is retried with backoff"));
        } else {
            self.event(true, Reason::RescaleAbandoned, message);
        }
        Ok(())
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
    fn stop_kind(&self) -> SnapshotKind {
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

    /// A savepoint asked for with spec.savepointTriggerNonce: the job keeps running.
    pub(super) fn triggered_savepoint(&mut self, nonce: i64) -> Duration {
        let Some(run) = self.mem.run.take() else {
            return requeue::SOON;
        };
        let work = BackgroundWork::TriggeredSavepoint {
            parallelism: run.parallelism,
            nonce,
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
        nonce: i64,
        (run, result): (RunHandle, Result<Completed, CoordinatorError>),
    ) -> Duration {
        let labels = self.kind_labels(SnapshotKind::Savepoint);
        self.mem.run = Some(run);
        match result {
            Ok(c) => {
                self.record_snapshot(&labels, Some(&c));
                self.status.last_savepoint = Some(snapshot_ref(&c, parallelism));
                self.status.last_savepoint_nonce = Some(nonce);
                self.succeeded();
                self.event(
                    false,
                    Reason::SavepointTaken,
                    format!(
                        "savepoint {} ({} bytes) in {} ms for savepointTriggerNonce {nonce}; the job keeps running",
                        c.url,
                        c.manifest.stats.total_bytes,
                        c.duration.as_millis()
                    ),
                );
                requeue::SOON
            }
            Err(e) => {
                self.record_snapshot(&labels, None);
                let message = format!(
                    "savepoint for savepointTriggerNonce {nonce} failed: {e}; retrying with backoff"
                );
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
                let found = run::latest_restorable(
                    self.spec,
                    &self.storage,
                    &self.ns,
                    &self.name,
                    self.max_parallelism(),
                    self.status
                        .replaced_history_up_to
                        .and_then(|b| u64::try_from(b).ok()),
                    &self.mem.unrestorable,
                )
                .await
                .map_err(PassError::FindSnapshot)?;
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
                    self.event(
                        rolled_back,
                        match (rolled_back, r.upgrade_mode) {
                            (true, _) => Reason::RescaleRolledBack,
                            (false, None) => Reason::Rescaled,
                            (false, Some(_)) => Reason::Upgraded,
                        },
                        format!(
                            "{}{} -> {} {}: {} key groups moved, {} bytes read; {}{}",
                            r.upgrade_mode
                                .map_or(String::new(), |m| format!("upgrade ({m:?}), ")),
                            r.from,
                            r.to,
                            if rolled_back {
                                "rolled back (running at the old parallelism)"
                            } else {
                                "done"
                            },
                            r.groups_moved.unwrap_or_default(),
                            bytes,
                            step_times(&r),
                            prestage_summary(&r)
                        ),
                    );
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

/// What a finished rescale's Event says of its pre-stage, if it had one. Pure.
fn prestage_summary(r: &RescaleStatus) -> String {
    match (&r.prestage, &r.fallback) {
        (Some(_), Some(why)) => format!("; fell back to stop-and-restore ({why})"),
        (Some(p), None) if r.upgrade_mode.is_some() => format!(
            "; pre-staged: the new spec's workers loaded {} bytes of state while the job ran (it fits the new spec) and started from the savepoint",
            p.loaded_bytes.unwrap_or_default()
        ),
        (Some(p), None) => format!(
            "; pre-staged: {} bytes loaded while the job ran, {} bytes written by the stop checkpoint",
            p.loaded_bytes.unwrap_or_default(),
            p.delta_bytes.unwrap_or_default()
        ),
        (None, _) => String::new(),
    }
}
