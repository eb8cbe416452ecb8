//! The runtime harness: a job's workers started as local processes and driven directly through
//! one [`Coordinator`] — launch, checkpoint, savepoint, kill, a raw stop-savepoint-restart —
//! for the runtime tests and the benchmarks, which measure the runtime itself. It is not an
//! orchestrator: `keyshift local` runs the shared orchestration ([`crate::orchestrator`]) over
//! [`super::processes::ProcessWorkers`], with the operator's rollback and recovery rules.

use super::LocalError;
use super::processes::{spawn_worker, stop_worker};
use crate::crd::{StreamJob, StreamJobSpec};
use crate::orchestrator::coordinator::{Completed, Coordinator, CoordinatorError, WorkerEndpoint};
use crate::orchestrator::{run, timeouts};
use crate::runtime::protocol::{StartResponse, WorkerState, WorkerStatus};
use crate::snapshot::{self, SnapshotKind};
use crate::validation;
use keyshift_core::keygroup::{self, Assignment};
use keyshift_core::step::Step;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokio::process::Child;

/// The harness's worker processes, in subtask order.
pub struct LocalWorkers {
    bin: PathBuf,
    log_dir: PathBuf,
    children: Vec<Child>,
}

impl LocalWorkers {
    pub fn new(bin: PathBuf, log_dir: PathBuf) -> Self {
        LocalWorkers {
            bin,
            log_dir,
            children: Vec::new(),
        }
    }

    /// Starts `n` workers on loopback and returns where they listen.
    pub async fn spawn(
        &mut self,
        n: u32,
        token: &str,
        run: u64,
    ) -> Result<Vec<WorkerEndpoint>, LocalError> {
        let mut endpoints = Vec::with_capacity(n as usize);
        for index in 0..n as usize {
            let stem = format!("run-{run}-worker-{index}");
            let (child, endpoint) =
                spawn_worker(&self.bin, &self.log_dir, token, &stem, index).await?;
            endpoints.push(endpoint);
            self.children.push(child);
        }
        Ok(endpoints)
    }

    /// Process ids of the running workers, in subtask order (benchmarks read their memory use).
    pub fn pids(&self) -> Vec<u32> {
        self.children.iter().filter_map(Child::id).collect()
    }

    /// Index of a worker that has exited, with its exit status.
    pub fn exited(&mut self) -> Option<(usize, String)> {
        for (i, c) in self.children.iter_mut().enumerate() {
            if let Ok(Some(status)) = c.try_wait() {
                return Some((i, status.to_string()));
            }
        }
        None
    }

    /// Kills one worker (failure tests).
    pub async fn kill(&mut self, index: usize) {
        if let Some(c) = self.children.get_mut(index) {
            let _ = c.kill().await;
        }
    }

    /// Stops every worker and waits until they are gone.
    pub async fn stop_all(&mut self) {
        futures::future::join_all(self.children.drain(..).map(stop_worker)).await;
    }
}

/// What a (re)start reported.
#[derive(Debug, Clone)]
pub struct LaunchReport {
    pub parallelism: u32,
    pub restored_from: Option<String>,
    pub responses: Vec<StartResponse>,
    pub duration: Duration,
}

impl LaunchReport {
    pub fn bytes_read(&self) -> u64 {
        self.responses.iter().map(|r| r.bytes_read).sum()
    }
}

/// What a rescale did.
#[derive(Debug, Clone)]
pub struct RescaleReport {
    pub from: u32,
    pub to: u32,
    pub savepoint: String,
    /// Key groups that change owner (one-to-one largest-overlap pairing).
    pub groups_moved: u32,
    /// Bytes the new subtasks read from the savepoint.
    pub bytes_read: u64,
    /// Bytes of state in the savepoint.
    pub state_bytes: u64,
    /// Time from the savepoint trigger until every new subtask runs.
    pub pause: Duration,
    /// Per step: savepoint, verify, stop, restore.
    pub steps: Vec<(Step, Duration)>,
    /// What starting the new subtasks reported (per-subtask restore times and bytes).
    pub launch: LaunchReport,
    /// A pre-staged rescale ([`LocalJob::rescale_prestaged`]): what the pre-stage did.
    pub prestage: Option<PrestageReport>,
    /// Why a pre-staged rescale fell back to a stop-and-restore, if it did.
    pub fallback: Option<String>,
}

/// What the pre-stage of a rescale did ([`LocalJob::prestage`]).
#[derive(Debug, Clone)]
pub struct PrestageReport {
    /// The checkpoint the new workers loaded last (the stop checkpoint's base).
    pub base: String,
    /// Bytes they read from it (and from the checkpoints before it, over every round).
    pub loaded_bytes: u64,
    /// Catch-up rounds ([`Prestage::catch_up_rounds`]).
    pub catch_up_rounds: u32,
    /// How long the first load and each catch-up round took ([`Prestage::rounds`]).
    pub rounds: Vec<Duration>,
    /// From the spawn of the new workers until all had loaded their groups.
    pub duration: Duration,
    /// Bytes of the stop checkpoint's own files (the delta since `base`, or since a checkpoint
    /// taken after it).
    pub delta_bytes: u64,
}

/// New workers pre-staged beside a running job ([`LocalJob::prestage`]): started with the new
/// assignment under a run id of their own, their key groups loaded from `base`, reading no
/// source and connected to no one. [`LocalJob::finish_prestaged`] switches the job over to
/// them.
pub struct Prestage {
    pub to: u32,
    /// The checkpoint they loaded.
    pub base: String,
    workers: LocalWorkers,
    coordinator: Coordinator,
    assignment: Assignment,
    run_id: String,
    /// What each loaded (bytes over every round).
    pub loaded: Vec<StartResponse>,
    pub duration: Duration,
    /// Catch-up rounds after the first load (each an incremental checkpoint of the old job and
    /// its delta read by the new workers).
    pub catch_up_rounds: u32,
    /// How long the first load and then each catch-up round took (what
    /// [`crate::runtime::prestage::CatchUp::again_after`] decided on).
    pub rounds: Vec<Duration>,
}

impl Prestage {
    /// Kills one of the new workers (failure tests).
    pub async fn kill_worker(&mut self, index: usize) {
        self.workers.kill(index).await;
    }

    /// Process ids of the new workers (benchmarks read their memory use).
    pub fn worker_pids(&self) -> Vec<u32> {
        self.workers.pids()
    }
}

/// A StreamJob running on this machine.
pub struct LocalJob {
    pub namespace: String,
    pub name: String,
    pub spec: StreamJobSpec,
    pub storage: String,
    pub max_parallelism: u32,
    workers: LocalWorkers,
    coordinator: Option<Coordinator>,
    token: String,
    runs: u64,
    /// spec.restoreFrom: restored while the job has no snapshot of its own under its key-group
    /// count (so a savepoint rewritten to a new count is used until the first snapshot at it).
    restore_from: Option<String>,
    /// Opaque bytes kept with each key's state (benchmarks).
    pub state_payload_bytes: usize,
    /// The old workers of a pre-staged rescale, stopping in the background (awaited by the
    /// next stop).
    retiring: Option<tokio::task::JoinHandle<()>>,
    /// When a pre-stage's catch-up ends ([`LocalJob::prestage`]; tests set a zero
    /// `short_round` to run every round).
    pub catch_up: crate::runtime::prestage::CatchUp,
}

impl LocalJob {
    /// Prepares a job; the key-group count is the one of spec.restoreFrom's snapshot if set (a
    /// savepoint rewritten to a new count raises the ceiling), else the one pinned by the job's
    /// newest snapshot, else the spec's, else Flink's default for its replicas.
    pub async fn new(
        job: &StreamJob,
        storage: String,
        bin: PathBuf,
        log_dir: PathBuf,
    ) -> Result<Self, LocalError> {
        let (namespace, name) = super::job_names(job);
        let status = super::resume_status(&job.spec, &storage, &namespace, &name).await?;
        let analysis = validation::analyse(&job.spec, Some(&status))?;
        Ok(LocalJob {
            namespace,
            name,
            spec: job.spec.clone(),
            storage,
            max_parallelism: analysis.assignment.max_parallelism(),
            workers: LocalWorkers::new(bin, log_dir),
            coordinator: None,
            token: run::new_token().map_err(|e| LocalError::Spawn {
                index: 0,
                reason: e.to_string(),
            })?,
            runs: 0,
            restore_from: job.spec.restore_from.clone(),
            state_payload_bytes: 0,
            retiring: None,
            catch_up: Default::default(),
        })
    }

    /// What a (re)start restores: the newest committed snapshot under the job's key-group
    /// count, else spec.restoreFrom, else nothing.
    pub async fn latest_snapshot(&self) -> Result<Option<String>, LocalError> {
        let own = snapshot::newest_snapshot(
            &self.storage,
            &self.namespace,
            &self.name,
            Some(self.max_parallelism),
            None,
        )
        .await?
        .found
        .map(|(url, _)| url);
        Ok(own.or_else(|| self.restore_from.clone()))
    }

    /// Where the workers write their logs (`run-<run>-worker-<index>.log`).
    pub fn log_dir(&self) -> &std::path::Path {
        &self.workers.log_dir
    }

    /// Process ids of the running workers, in subtask order.
    pub fn worker_pids(&self) -> Vec<u32> {
        self.workers.pids()
    }

    pub fn parallelism(&self) -> Option<u32> {
        self.coordinator
            .as_ref()
            .map(|c| c.assignment().parallelism())
    }

    /// Starts workers at `parallelism`, restoring from `restore` if given.
    /// The coordinator of a run of this job over `endpoints` (its sink's credentials from this
    /// process's environment).
    async fn run_coordinator(
        &self,
        assignment: Assignment,
        endpoints: Vec<crate::orchestrator::coordinator::WorkerEndpoint>,
    ) -> Result<Coordinator, LocalError> {
        Ok(run::coordinator(
            &self.spec,
            &self.storage,
            run::identity(&self.namespace, &self.name, &self.spec),
            assignment,
            endpoints,
            self.token.clone(),
            &run::sink_credentials_from_env(&self.spec)?,
        )
        .await?)
    }

    pub async fn launch(
        &mut self,
        parallelism: u32,
        restore: Option<String>,
    ) -> Result<LaunchReport, LocalError> {
        let started = Instant::now();
        let assignment = Assignment::new(i64::from(parallelism), i64::from(self.max_parallelism))?;
        self.runs += 1;
        let endpoints = self
            .workers
            .spawn(parallelism, &self.token, self.runs)
            .await?;
        let run_id = run::new_run_id().map_err(|e| LocalError::Spawn {
            index: 0,
            reason: e.to_string(),
        })?;
        let coordinator = self.run_coordinator(assignment, endpoints).await?;
        let template = run::StartPlan {
            namespace: &self.namespace,
            name: &self.name,
            spec: &self.spec,
            assignment,
            storage: &self.storage,
            restore_from: restore.clone(),
            run: &run_id,
            state_payload_bytes: self.state_payload_bytes,
        }
        .request()?;
        let responses = match coordinator
            .start(&template, timeouts::start(&self.spec))
            .await
        {
            Ok(r) => r,
            Err(e) => {
                self.workers.stop_all().await;
                return Err(e.into());
            }
        };
        self.coordinator = Some(coordinator);
        Ok(LaunchReport {
            parallelism,
            restored_from: restore,
            responses,
            duration: started.elapsed(),
        })
    }

    fn coordinator(&mut self) -> Result<&mut Coordinator, LocalError> {
        self.coordinator.as_mut().ok_or_else(|| {
            LocalError::Coordinator(CoordinatorError::NotReady(
                0,
                "the job is not running".into(),
            ))
        })
    }

    /// A periodic checkpoint.
    pub async fn checkpoint(&mut self) -> Result<Completed, LocalError> {
        let timeout = timeouts::checkpoint(&self.spec);
        Ok(self
            .coordinator()?
            .snapshot(SnapshotKind::Checkpoint, false, timeout)
            .await?)
    }

    /// A savepoint; with `stop`, the sources stop at its barrier.
    pub async fn savepoint(&mut self, stop: bool) -> Result<Completed, LocalError> {
        let timeout = timeouts::savepoint(&self.spec);
        Ok(self
            .coordinator()?
            .snapshot(SnapshotKind::Savepoint, stop, timeout)
            .await?)
    }

    /// Every worker's status.
    pub async fn status(&mut self) -> Result<Vec<WorkerStatus>, LocalError> {
        Ok(self.coordinator()?.status().await?)
    }

    /// Lets the sources read again after a savepoint that stopped them ([`Self::savepoint`]
    /// with `stop`).
    pub async fn resume(&mut self) -> Result<(), LocalError> {
        self.coordinator()?.resume().await;
        Ok(())
    }

    /// The job's Kafka clients that cannot reach their brokers now, as the KafkaReachable
    /// condition names them ([`crate::orchestrator::status::kafka_outages`]): the workers'
    /// sources (from their status) and the sink's publisher.
    pub async fn kafka_outages(&mut self) -> Result<Vec<String>, LocalError> {
        let statuses = self.status().await?;
        let lags: Vec<(u32, &crate::runtime::protocol::SourceLag)> = statuses
            .iter()
            .filter_map(|s| s.source_lag.as_ref().map(|l| (s.subtask, l)))
            .collect();
        #[cfg(feature = "kafka")]
        let publisher = self.coordinator()?.kafka_sink_error();
        #[cfg(not(feature = "kafka"))]
        let publisher: Option<String> = None;
        Ok(crate::orchestrator::status::kafka_outages(
            &lags,
            publisher.as_deref(),
        ))
    }

    /// A worker that died, if any.
    pub fn failed_worker(&mut self) -> Option<(usize, String)> {
        self.workers.exited()
    }

    /// Kills one worker process (failure tests).
    pub async fn kill_worker(&mut self, index: usize) {
        self.workers.kill(index).await;
    }

    /// Stops the workers without a snapshot.
    pub async fn stop(&mut self) {
        if let Some(old) = self.retiring.take() {
            let _ = old.await;
        }
        self.workers.stop_all().await;
        self.coordinator = None;
    }

    /// Stops with a savepoint and removes the workers.
    pub async fn shutdown(&mut self) -> Result<Completed, LocalError> {
        let sp = self.savepoint(true).await?;
        self.stop().await;
        Ok(sp)
    }

    /// Restarts from the newest committed snapshot at the current parallelism (after a worker
    /// failure).
    pub async fn recover(&mut self, parallelism: u32) -> Result<LaunchReport, LocalError> {
        self.stop().await;
        let restore = self.latest_snapshot().await?;
        self.launch(parallelism, restore).await
    }

    /// Rescale: stop-with-savepoint -> verify -> stop the old workers -> start the new ones
    /// restoring their key groups. A failure before the old workers stop leaves them running; a
    /// failure after restores the old parallelism from the savepoint.
    pub async fn rescale(&mut self, to: u32) -> Result<RescaleReport, LocalError> {
        let from = self.parallelism().unwrap_or(to);
        let new_assignment = Assignment::new(i64::from(to), i64::from(self.max_parallelism))?;
        let old_assignment = Assignment::new(i64::from(from), i64::from(self.max_parallelism))?;
        let plan = keygroup::rescale_plan(old_assignment, new_assignment).map_err(|e| {
            LocalError::Rescale {
                from,
                to,
                step: "planning",
                reason: e.to_string(),
                outcome: "nothing was stopped".into(),
            }
        })?;
        let t0 = Instant::now();
        let mut steps = Vec::new();
        let fail = |step, reason: String, outcome: &str| LocalError::Rescale {
            from,
            to,
            step,
            reason,
            outcome: outcome.to_owned(),
        };

        // 1. Savepoint, stopping the sources at the barrier.
        let sp = self.savepoint(true).await.map_err(|e| {
            fail(
                "Savepointing",
                e.to_string(),
                "the job keeps running at the old parallelism",
            )
        })?;
        steps.push((Step::Savepointing, t0.elapsed()));

        // 2. Verify every file of it before anything stops.
        let t = Instant::now();
        let (store, dir) = snapshot::open_store(&sp.url)?;
        if let Err(e) = snapshot::verify(store.as_ref(), &dir).await {
            if let Some(c) = self.coordinator.as_ref() {
                c.resume().await;
            }
            return Err(fail(
                "Verifying",
                e.to_string(),
                "the job keeps running at the old parallelism",
            ));
        }
        steps.push((Step::Verifying, t.elapsed()));

        // 3. Stop the old workers.
        let t = Instant::now();
        self.stop().await;
        steps.push((Step::Stopping, t.elapsed()));

        // 4. Start the new ones from the savepoint.
        let t = Instant::now();
        let report = match self.launch(to, Some(sp.url.clone())).await {
            Ok(r) => r,
            Err(e) => {
                let back = self.launch(from, Some(sp.url.clone())).await;
                return Err(fail(
                    "Restoring",
                    e.to_string(),
                    &match back {
                        Ok(_) => format!("restored at the old parallelism {from} from {}", sp.url),
                        Err(e2) => format!(
                            "restoring the old parallelism failed too ({e2}); the savepoint {} is intact",
                            sp.url
                        ),
                    },
                ));
            }
        };
        steps.push((Step::Restoring, t.elapsed()));
        Ok(RescaleReport {
            from,
            to,
            savepoint: sp.url,
            groups_moved: plan.moved_groups,
            bytes_read: report.bytes_read(),
            state_bytes: sp.manifest.stats.total_bytes,
            pause: t0.elapsed(),
            steps,
            launch: report,
            prestage: None,
            fallback: None,
        })
    }

    /// Starts `to` new workers beside the running ones and pre-stages them: each loads its key
    /// groups of the new assignment from the job's newest committed checkpoint (one is taken
    /// first if the newest committed snapshot is not a checkpoint), while the old workers keep
    /// running. Then, while [`LocalJob::catch_up`] says so, the old job takes an incremental
    /// checkpoint and the new workers read only its delta, so that the stop's delta covers a
    /// short time. See [`crate::runtime::prestage`]. On failure the new workers are stopped
    /// and the job runs on as it was.
    pub async fn prestage(&mut self, to: u32) -> Result<Prestage, LocalError> {
        let from = self.parallelism().unwrap_or(to);
        let fail = |reason: String| LocalError::Rescale {
            from,
            to,
            step: "Prestaging",
            reason,
            outcome: "the job keeps running at the old parallelism".into(),
        };
        let started = Instant::now();
        let assignment = Assignment::new(i64::from(to), i64::from(self.max_parallelism))?;
        self.runs += 1;
        let mut workers = LocalWorkers::new(self.workers.bin.clone(), self.workers.log_dir.clone());
        let endpoints = match workers.spawn(to, &self.token, self.runs).await {
            Ok(e) => e,
            Err(e) => {
                workers.stop_all().await;
                return Err(e);
            }
        };
        let run_id = run::new_run_id().map_err(|e| fail(e.to_string()))?;
        let result = async {
            let coordinator = self.run_coordinator(assignment, endpoints).await?;
            let template = self.plan(assignment, None, &run_id)?;
            let (spec, storage, ns, name) = (
                self.spec.clone(),
                self.storage.clone(),
                self.namespace.clone(),
                self.name.clone(),
            );
            let (groups, catch_up) = (self.max_parallelism, self.catch_up);
            let timeout = timeouts::start(&spec);
            let done = run::prestage(
                timeouts::checkpoint(&spec),
                (&storage, &ns, &name),
                groups,
                None,
                self.coordinator()?,
                &coordinator,
                &template,
                catch_up,
                timeout,
            )
            .await?;
            Ok::<_, LocalError>((coordinator, done))
        }
        .await;
        match result {
            Ok((coordinator, done)) => Ok(Prestage {
                catch_up_rounds: done.catch_up_rounds(),
                to,
                base: done.base,
                workers,
                coordinator,
                assignment,
                run_id,
                loaded: done.loaded,
                duration: started.elapsed(),
                rounds: done.rounds,
            }),
            Err(e) => {
                workers.stop_all().await;
                Err(fail(e.to_string()))
            }
        }
    }

    fn plan(
        &self,
        assignment: Assignment,
        restore_from: Option<String>,
        run_id: &str,
    ) -> Result<crate::runtime::protocol::StartRequest, LocalError> {
        run::StartPlan {
            namespace: &self.namespace,
            name: &self.name,
            spec: &self.spec,
            assignment,
            storage: &self.storage,
            restore_from,
            run: run_id,
            state_payload_bytes: self.state_payload_bytes,
        }
        .request()
        .map_err(|e| LocalError::Spawn {
            index: 0,
            reason: e.to_string(),
        })
    }

    /// A pre-staged rescale: [`LocalJob::prestage`], then [`LocalJob::finish_prestaged`].
    pub async fn rescale_prestaged(&mut self, to: u32) -> Result<RescaleReport, LocalError> {
        let p = self.prestage(to).await?;
        self.finish_prestaged(p).await
    }

    /// Switches the job over to pre-staged workers: the old workers stop with an incremental
    /// checkpoint (only what changed since the loaded one is written; it refers to the rest,
    /// and restores like any checkpoint), the new workers read only the blocks of it they do
    /// not hold, apply them and run from its source positions, and the old workers go.
    ///
    /// Falls back to a stop-and-restore, and says so in [`RescaleReport::fallback`]: when a new
    /// worker is gone or not pre-staged (the new workers are dropped, then [`LocalJob::rescale`]
    /// from the running job); when an old worker is gone or the stop checkpoint fails (the new
    /// workers are dropped, the old ones stopped, and `to` fresh workers restore the newest
    /// committed snapshot); when the pre-staged start fails (fresh workers restore the stop
    /// checkpoint in full).
    pub async fn finish_prestaged(&mut self, mut p: Prestage) -> Result<RescaleReport, LocalError> {
        let from = self.parallelism().unwrap_or(p.to);
        let to = p.to;
        // The new workers must all be there and pre-staged.
        let new_ok = match p.workers.exited() {
            Some((i, status)) => Err(format!("new subtask {i} exited ({status})")),
            None => match p.coordinator.status().await {
                Ok(st) => match st.iter().position(|w| w.state != WorkerState::Prestaged) {
                    Some(i) => Err(format!("new subtask {i} is {:?}", st[i].state)),
                    None => Ok(()),
                },
                Err(e) => Err(e.to_string()),
            },
        };
        if let Err(why) = new_ok {
            p.workers.stop_all().await;
            let reason = format!("the pre-staged workers are not ready ({why}): stop-and-restore");
            tracing::warn!(%reason, "pre-staged rescale falls back");
            let mut r = self.rescale(to).await?;
            r.fallback = Some(reason);
            return Ok(r);
        }
        let t0 = Instant::now();
        let mut steps = Vec::new();
        // The old job stops with an incremental checkpoint.
        let old_dead = self.failed_worker();
        let stop = match old_dead {
            Some((i, status)) => Err(format!("old subtask {i} exited ({status})")),
            None => {
                let timeout = timeouts::savepoint(&self.spec);
                match self.coordinator() {
                    Ok(c) => c
                        .snapshot(SnapshotKind::Checkpoint, true, timeout)
                        .await
                        .map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                }
            }
        };
        let sp = match stop {
            Ok(sp) => sp,
            Err(why) => {
                p.workers.stop_all().await;
                self.stop().await;
                let reason = format!(
                    "the old job could not stop with a checkpoint ({why}): the pre-staged workers are dropped, and the new parallelism restores the newest committed snapshot"
                );
                tracing::warn!(%reason, "pre-staged rescale falls back");
                let restore = self.latest_snapshot().await?;
                let launch = self.launch(to, restore.clone()).await?;
                let (store, dir) = match &restore {
                    Some(url) => snapshot::open_snapshot_dir(url).map(|(s, d)| (Some(s), d))?,
                    None => (None, Default::default()),
                };
                let state_bytes = match store {
                    Some(s) => {
                        snapshot::read_manifest(s.as_ref(), &dir)
                            .await?
                            .stats
                            .total_bytes
                    }
                    None => 0,
                };
                return Ok(RescaleReport {
                    from,
                    to,
                    savepoint: restore.unwrap_or_default(),
                    groups_moved: 0,
                    bytes_read: launch.bytes_read(),
                    state_bytes,
                    pause: t0.elapsed(),
                    steps,
                    launch,
                    prestage: None,
                    fallback: Some(reason),
                });
            }
        };
        steps.push((Step::Savepointing, t0.elapsed()));
        let delta_bytes = sp.manifest.written_bytes();
        // The new workers read the delta and run; the old ones go meanwhile.
        let t = Instant::now();
        let started = Instant::now();
        let old = std::mem::replace(
            &mut self.workers,
            LocalWorkers::new(p.workers.bin.clone(), p.workers.log_dir.clone()),
        );
        self.coordinator = None;
        let result = async {
            let coordinator = self
                .run_coordinator(p.assignment, p.coordinator.workers().to_vec())
                .await?;
            let template = self.plan(p.assignment, Some(sp.url.clone()), &p.run_id)?;
            let responses = coordinator
                .start(&template, timeouts::start(&self.spec))
                .await?;
            Ok::<_, LocalError>((coordinator, responses))
        };
        let result = result.await;
        steps.push((Step::Restoring, t.elapsed()));
        // The old workers stopped at the barrier: they go in the background, once the new ones
        // run (their exit frees their whole state, work that would slow the new workers' start
        // on a small machine).
        self.retiring = Some(tokio::spawn(async move {
            let mut old = old;
            old.stop_all().await
        }));
        let prestage = PrestageReport {
            base: p.base.clone(),
            loaded_bytes: p.loaded.iter().map(|r| r.bytes_read).sum(),
            catch_up_rounds: p.catch_up_rounds,
            rounds: p.rounds.clone(),
            duration: p.duration,
            delta_bytes,
        };
        let plan = keygroup::rescale_plan(
            Assignment::new(i64::from(from), i64::from(self.max_parallelism))?,
            p.assignment,
        )
        .map(|pl| pl.moved_groups)
        .unwrap_or(0);
        match result {
            Ok((coordinator, responses)) => {
                self.workers = p.workers;
                self.coordinator = Some(coordinator);
                let launch = LaunchReport {
                    parallelism: to,
                    restored_from: Some(sp.url.clone()),
                    responses,
                    duration: started.elapsed(),
                };
                Ok(RescaleReport {
                    from,
                    to,
                    savepoint: sp.url,
                    groups_moved: plan,
                    bytes_read: launch.bytes_read(),
                    state_bytes: sp.manifest.stats.total_bytes,
                    pause: t0.elapsed(),
                    steps,
                    launch,
                    prestage: Some(prestage),
                    fallback: None,
                })
            }
            Err(e) => {
                p.workers.stop_all().await;
                let reason = format!(
                    "the pre-staged start failed ({e}): fresh workers restore the stop checkpoint {} in full",
                    sp.url
                );
                tracing::warn!(%reason, "pre-staged rescale falls back");
                let launch = self.launch(to, Some(sp.url.clone())).await?;
                Ok(RescaleReport {
                    from,
                    to,
                    savepoint: sp.url,
                    groups_moved: plan,
                    bytes_read: launch.bytes_read(),
                    state_bytes: sp.manifest.stats.total_bytes,
                    pause: t0.elapsed(),
                    steps,
                    launch,
                    prestage: Some(prestage),
                    fallback: Some(reason),
                })
            }
        }
    }

    /// A key-group change as the orchestration runs it (the steps' I/O through the same
    /// functions): savepoint -> verify -> stop -> rewrite to `groups` -> verify the rewrite ->
    /// start `to` workers from it. For the benchmarks; no rollback (an error says where it
    /// stopped; the original savepoint is intact).
    pub async fn change_key_groups(
        &mut self,
        to: u32,
        groups: u32,
        memory: usize,
    ) -> Result<(RescaleReport, crate::offline::RewriteReport), LocalError> {
        let from = self.parallelism().unwrap_or(to);
        let fail = |step, reason: String| LocalError::Rescale {
            from,
            to,
            step,
            reason,
            outcome: "the original savepoint is intact".into(),
        };
        let t0 = Instant::now();
        let mut steps = Vec::new();
        let sp = self
            .savepoint(true)
            .await
            .map_err(|e| fail("Savepointing", e.to_string()))?;
        steps.push((Step::Savepointing, t0.elapsed()));
        let t = Instant::now();
        let (store, dir) = snapshot::open_store(&sp.url)?;
        snapshot::verify(store.as_ref(), &dir)
            .await
            .map_err(|e| fail("Verifying", e.to_string()))?;
        steps.push((Step::Verifying, t.elapsed()));
        let t = Instant::now();
        self.stop().await;
        steps.push((Step::Stopping, t.elapsed()));
        let t = Instant::now();
        let target = run::rewrite_target(&self.storage, &self.namespace, &self.name).await?;
        let rewrite = run::rewrite_savepoint(&sp.url, &target, groups, to, memory, None)
            .await
            .map_err(|e| fail("Rewriting", e.to_string()))?
            .ok_or_else(|| fail("Rewriting", format!("{target} already exists")))?;
        steps.push((Step::Rewriting, t.elapsed()));
        let t = Instant::now();
        run::verify_rewrite(&sp.url, &target, groups, to)
            .await
            .map_err(|e| fail("VerifyingRewrite", e))?;
        steps.push((Step::VerifyingRewrite, t.elapsed()));
        let t = Instant::now();
        self.max_parallelism = groups;
        let report = self
            .launch(to, Some(target.clone()))
            .await
            .map_err(|e| fail("Restoring", e.to_string()))?;
        steps.push((Step::Restoring, t.elapsed()));
        Ok((
            RescaleReport {
                from,
                to,
                savepoint: sp.url,
                groups_moved: groups,
                bytes_read: report.bytes_read(),
                state_bytes: sp.manifest.stats.total_bytes,
                pause: t0.elapsed(),
                steps,
                launch: report,
                prestage: None,
                fallback: None,
            },
            rewrite,
        ))
    }
}
