//! Executing the action [`decide::decide`] chose: the transitions (rescale, upgrade, restore,
//! adopting and deleting workers, abandoning, falling back); each kind of step has its own
//! module for how it begins and how its outcome is recorded.

use super::*;

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
            Action::TriggerSavepoint { trigger } => Ok(self.triggered_savepoint(trigger)),
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
    pub(super) fn begin_rescale(
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
    pub(super) fn begin_upgrade(
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

    /// Takes over run `run` (at `parallelism`), already running, with a coordinator of this process
    /// (resuming workers a predecessor left stopped).
    pub(super) async fn adopt(
        &mut self,
        run: String,
        parallelism: u32,
    ) -> Result<Duration, PassError> {
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
    pub(super) fn finish_rescale(&mut self) -> Result<Duration, PassError> {
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
        let (reason, message) = transition_finished(
            &r,
            rolled_back,
            to == 0,
            r.bytes_to_read.unwrap_or_default(),
        );
        self.event(rolled_back, reason, message);
        Ok(short)
    }

    /// Begins a restore from spec.restoreFrom `url` (of `max_parallelism` key groups) at `to`
    /// subtasks, keeping the current state in a savepoint first.
    pub(super) fn begin_restore(
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

    /// Creates the pods `subtasks` of run `run` at `parallelism`.
    pub(super) async fn create_pods(
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

    /// The coordinator of a new run `run` of `parallelism` workers at `endpoints`, and its start
    /// request restoring `restore_from` (a start, or a pre-stage without it).
    pub(super) async fn new_run(
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
    pub(super) fn deleted(&mut self, n: usize, reason: Reason) -> Duration {
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
    pub(super) fn remember_refusal(&mut self, refusal: decide::StartRefusal) {
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
}
