//! `keyshift local`: a StreamJob on one machine, no cluster. Workers are local processes on
//! loopback, state lives in a local directory (or any object store URL), and the coordinator and
//! rescale steps are the same ones the operator runs.

use crate::coordinator::{self, Completed, Coordinator, CoordinatorError, WorkerEndpoint};
use crate::crd::{StreamJob, StreamJobSpec, StreamJobStatus};
use crate::keygroup::{self, Assignment};
use crate::orchestrator::run;
use crate::runtime::protocol::{StartResponse, WorkerStatus};
use crate::snapshot::{self, SnapshotKind};
use crate::validation;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

/// Failures of a local run.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a StreamJob manifest: {reason}")]
    Parse { path: PathBuf, reason: String },
    #[error("{path} is invalid:\n{errors}")]
    Invalid { path: PathBuf, errors: String },
    #[error("{0}")]
    Analysis(#[from] validation::AnalysisError),
    #[error("starting worker {index}: {reason}")]
    Spawn { index: usize, reason: String },
    #[error(transparent)]
    Coordinator(#[from] CoordinatorError),
    #[error(transparent)]
    Snapshot(#[from] snapshot::SnapshotError),
    #[error("{0}")]
    Bounds(#[from] keygroup::BoundsError),
    #[error("{0}")]
    RestoreFrom(String),
    #[error("rescale {from} -> {to} failed at step {step}: {reason}; {outcome}")]
    Rescale {
        from: u32,
        to: u32,
        step: &'static str,
        reason: String,
        outcome: String,
    },
}

/// Reads and checks a manifest file the way the API server would (same messages).
pub fn load_manifest(path: &Path) -> Result<StreamJob, LocalError> {
    let text = std::fs::read_to_string(path).map_err(|source| LocalError::Read {
        path: path.to_owned(),
        source,
    })?;
    let job: StreamJob = serde_yaml::from_str(&text).map_err(|e| LocalError::Parse {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    validation::validate(&job.spec, None, None).map_err(|e| LocalError::Invalid {
        path: path.to_owned(),
        errors: e.to_string(),
    })?;
    Ok(job)
}

/// Worker processes on this machine.
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
        tokio::fs::create_dir_all(&self.log_dir)
            .await
            .map_err(|e| LocalError::Spawn {
                index: 0,
                reason: format!("creating {}: {e}", self.log_dir.display()),
            })?;
        let mut endpoints = Vec::with_capacity(n as usize);
        for index in 0..n as usize {
            let spawn_err = |reason: String| LocalError::Spawn { index, reason };
            let log_path = self.log_dir.join(format!("run-{run}-worker-{index}.log"));
            let log = std::fs::File::create(&log_path)
                .map_err(|e| spawn_err(format!("creating {}: {e}", log_path.display())))?;
            let mut command = Command::new(&self.bin);
            command
                .args([
                    "worker",
                    "--control-addr",
                    "127.0.0.1:0",
                    "--data-addr",
                    "127.0.0.1:0",
                ])
                .env("KEYSHIFT_TOKEN", token)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(log)
                // Own process group: a Ctrl-C at the terminal reaches only `keyshift local`,
                // which then stops the workers with a savepoint.
                .process_group(0)
                .kill_on_drop(true);
            die_with_parent(&mut command);
            let mut child = command
                .spawn()
                .map_err(|e| spawn_err(format!("{}: {e}", self.bin.display())))?;
            let stdout = child
                .stdout
                .take()
                .ok_or_else(|| spawn_err("no stdout".into()))?;
            let mut lines = BufReader::with_capacity(1 << 16, stdout).lines();
            let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
                .await
                .map_err(|_| spawn_err("did not report its addresses within 30s".into()))?
                .map_err(|e| spawn_err(e.to_string()))?
                .ok_or_else(|| spawn_err(format!("exited at once; see {}", log_path.display())))?;
            let addrs: serde_json::Value =
                serde_json::from_str(&first).map_err(|e| spawn_err(format!("{first:?}: {e}")))?;
            let control = addrs["control"].as_str().unwrap_or_default().to_owned();
            let data = addrs["data"].as_str().unwrap_or_default().to_owned();
            // The rest of stdout is the log sink's output, copied as is in large writes (not a
            // write per line: a checkpoint may emit a line for every key).
            let out_path = self.log_dir.join(format!("run-{run}-worker-{index}.out"));
            tokio::spawn(async move {
                if let Ok(mut f) = tokio::fs::File::create(&out_path).await {
                    let mut rest = lines.into_inner();
                    let _ = tokio::io::copy_buf(&mut rest, &mut f).await;
                    let _ = f.flush().await;
                }
            });
            endpoints.push(WorkerEndpoint {
                control: format!("http://{control}"),
                data,
            });
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

    /// Stops every worker (SIGTERM, then SIGKILL after 5 s) and waits until they are gone.
    pub async fn stop_all(&mut self) {
        for c in &self.children {
            if let Some(pid) = c.id() {
                // SAFETY: kill(2) with a pid we spawned; no memory is shared.
                unsafe {
                    libc::kill(pid as libc::pid_t, libc::SIGTERM);
                }
            }
        }
        for mut c in self.children.drain(..) {
            if tokio::time::timeout(Duration::from_secs(5), c.wait())
                .await
                .is_err()
            {
                let _ = c.kill().await;
            }
        }
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
    pub steps: Vec<(&'static str, Duration)>,
    /// What starting the new subtasks reported (per-subtask restore times and bytes).
    pub launch: LaunchReport,
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
        let namespace = job
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let name = job.metadata.name.clone().unwrap_or_else(|| "job".into());
        let pinned = match &job.spec.restore_from {
            Some(url) => {
                let groups = coordinator::restore_from_key_groups(url)
                    .await
                    .map_err(LocalError::RestoreFrom)?;
                if let Some(g) = job.spec.max_parallelism
                    && g as u32 != groups
                {
                    return Err(LocalError::RestoreFrom(validation::restore_from_mismatch(
                        url, groups, g,
                    )));
                }
                Some(groups as i32)
            }
            None => coordinator::latest_snapshot(&storage, &namespace, &name)
                .await?
                .map(|(_, s)| s.max_parallelism as i32),
        };
        let status = StreamJobStatus {
            max_parallelism: pinned,
            ..Default::default()
        };
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
        })
    }

    /// What a (re)start restores: the newest committed snapshot under the job's key-group
    /// count, else spec.restoreFrom, else nothing.
    pub async fn latest_snapshot(&self) -> Result<Option<String>, LocalError> {
        let own = coordinator::latest_snapshot_with(
            &self.storage,
            &self.namespace,
            &self.name,
            Some(self.max_parallelism),
        )
        .await?
        .map(|(url, _)| url);
        Ok(own.or_else(|| self.restore_from.clone()))
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
        let coordinator = run::coordinator(
            &self.spec,
            &self.storage,
            run::identity(&self.namespace, &self.name, &self.spec),
            assignment,
            endpoints,
            self.token.clone(),
        )
        .await?;
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
        .request();
        let responses = match coordinator.start(&template, run::timeouts::START).await {
            Ok(r) => r,
            Err(e) => {
                self.workers.stop_all().await;
                return Err(e.into());
            }
        };
        if let Some(url) = &restore {
            // The restored snapshot's sink output must be visible (crash between commit and
            // publish); publishing is idempotent.
            let (_, _, manifest) = snapshot::open_snapshot(url).await?;
            coordinator.publish(manifest.snapshot_id).await?;
        }
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
        Ok(self
            .coordinator()?
            .snapshot(SnapshotKind::Checkpoint, false, run::timeouts::CHECKPOINT)
            .await?)
    }

    /// A savepoint; with `stop`, the sources stop at its barrier.
    pub async fn savepoint(&mut self, stop: bool) -> Result<Completed, LocalError> {
        Ok(self
            .coordinator()?
            .snapshot(SnapshotKind::Savepoint, stop, run::timeouts::SAVEPOINT)
            .await?)
    }

    /// Every worker's status.
    pub async fn status(&mut self) -> Result<Vec<WorkerStatus>, LocalError> {
        Ok(self.coordinator()?.status().await?)
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
        steps.push(("Savepointing", t0.elapsed()));

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
        steps.push(("Verifying", t.elapsed()));

        // 3. Stop the old workers.
        let t = Instant::now();
        self.stop().await;
        steps.push(("Stopping", t.elapsed()));

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
        steps.push(("Restoring", t.elapsed()));
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
        })
    }
}

/// A worker of `keyshift local` is killed when its launcher dies (killed, or crashed), so no
/// worker outlives it. Linux only; elsewhere workers are stopped on a normal exit only.
fn die_with_parent(command: &mut Command) {
    #[cfg(target_os = "linux")]
    // SAFETY: the closure runs in the forked child before exec and only makes the
    // async-signal-safe prctl(2) call.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    #[cfg(not(target_os = "linux"))]
    let _ = command;
}

/// What `keyshift local` says when an edit asks for more subtasks than the key-group ceiling:
/// nothing changes, and how to raise the ceiling (`savepoint`: the URL once stopped).
pub fn local_ceiling_guidance(
    manifest: &Path,
    running: u32,
    replicas: i32,
    ceiling: u32,
    savepoint: Option<&str>,
) -> String {
    let g = keygroup::suggested_max_parallelism(replicas.max(1) as u32);
    let sp = savepoint.unwrap_or("<the savepoint printed when it stops>");
    let stop = if savepoint.is_none() {
        "stop it with Ctrl-C (it stops with a savepoint), then "
    } else {
        ""
    };
    format!(
        "replicas {replicas} exceeds {ceiling}, the key-group ceiling of this job's state (fixed by its first snapshot); nothing was changed and the job keeps running at parallelism {running}. To run more subtasks, raise the ceiling offline: {stop}run `keyshift savepoint rewrite {sp} --max-parallelism {g} --to {sp}-mp{g}`, set `maxParallelism: {g}`, `restoreFrom: {sp}-mp{g}` and `replicas: {replicas}` in {}, and run `keyshift local {}` again",
        manifest.display(),
        manifest.display()
    )
}

/// Ctrl-C, or SIGTERM (`kill`, a service manager): both stop the job with a savepoint.
async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// The storage URL of a local run: the spec's, else `file://<state dir>`.
pub fn storage_url(spec: &StreamJobSpec, state_dir: &Path) -> Result<String, LocalError> {
    if let Some(s) = &spec.state.storage {
        return Ok(s.clone());
    }
    std::fs::create_dir_all(state_dir).map_err(|source| LocalError::Read {
        path: state_dir.to_owned(),
        source,
    })?;
    let abs = std::fs::canonicalize(state_dir).map_err(|source| LocalError::Read {
        path: state_dir.to_owned(),
        source,
    })?;
    Ok(format!("file://{}", abs.display()))
}

/// Options of `keyshift local`.
#[derive(Debug, Clone)]
pub struct LocalOptions {
    pub manifest: PathBuf,
    pub state_dir: PathBuf,
    /// The `keyshift` binary the workers run (default: this executable).
    pub bin: PathBuf,
    /// Seconds between progress lines.
    pub progress_every: Duration,
}

fn say(line: impl std::fmt::Display) {
    println!("[keyshift local] {line}");
}

fn rate(n: u64, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64().max(1e-9)
}

/// `keyshift local MANIFEST`: runs the job, checkpoints it, applies `replicas` edits of the file
/// as rescales, recovers from worker failures, and stops with a savepoint on Ctrl-C.
pub async fn run_cli(opts: LocalOptions) -> Result<(), LocalError> {
    let job = load_manifest(&opts.manifest)?;
    let storage = storage_url(&job.spec, &opts.state_dir)?;
    let log_dir = opts.state_dir.join("logs");
    let mut local = LocalJob::new(&job, storage.clone(), opts.bin.clone(), log_dir.clone()).await?;
    let restore = local.latest_snapshot().await?;
    say(format_args!(
        "job {}/{}: {} subtasks, {} key groups, state in {storage}, worker logs in {}",
        local.namespace,
        local.name,
        job.spec.replicas,
        local.max_parallelism,
        log_dir.display()
    ));
    match &restore {
        Some(url) => say(format_args!("resuming from {url}")),
        None => say("no snapshot yet: starting empty"),
    }
    let mut parallelism = job.spec.replicas as u32;
    let report = local.launch(parallelism, restore).await?;
    say(format_args!(
        "running at parallelism {parallelism} ({} ms to start, {} bytes of state read)",
        report.duration.as_millis(),
        report.bytes_read()
    ));
    print_groups(&local, parallelism);

    let interval = validation::parse_duration(&job.spec.state.checkpoint_interval)
        .filter(|d| !d.is_zero())
        .unwrap_or(Duration::from_secs(30));
    let mut checkpoint_tick =
        tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    let mut progress_tick = tokio::time::interval_at(
        tokio::time::Instant::now() + opts.progress_every,
        opts.progress_every,
    );
    let mut manifest_tick = tokio::time::interval(Duration::from_millis(500));
    let mut mtime = std::fs::metadata(&opts.manifest)
        .and_then(|m| m.modified())
        .ok();
    let mut last = (Instant::now(), 0u64);
    let mut failures = 0u32;
    // The last edit refused for exceeding the key-group ceiling: its replicas.
    let mut above_ceiling: Option<i32> = None;
    let ctrl_c = stop_signal();
    tokio::pin!(ctrl_c);
    loop {
        tokio::select! {
            _ = &mut ctrl_c => {
                say("stopping with a savepoint (Ctrl-C or SIGTERM) ...");
                let sp = local.shutdown().await?;
                say(format_args!("stopped with savepoint {} ({} bytes); run the same command again to resume", sp.url, sp.manifest.stats.total_bytes));
                if let Some(replicas) = above_ceiling {
                    say(local_ceiling_guidance(&opts.manifest, parallelism, replicas, local.max_parallelism, Some(&sp.url)));
                }
                return Ok(());
            }
            _ = checkpoint_tick.tick() => {
                match local.checkpoint().await {
                    Ok(c) => say(format_args!("checkpoint {} committed in {} ms ({} bytes, {} keys)", c.id, c.duration.as_millis(), c.manifest.stats.total_bytes, c.manifest.stats.total_keys)),
                    Err(e) => say(format_args!("checkpoint failed: {e}; the previous checkpoint stays usable")),
                }
            }
            _ = progress_tick.tick() => {
                if let Some((i, status)) = local.failed_worker() {
                    failures += 1;
                    let backoff = Duration::from_secs(1u64 << failures.min(5));
                    say(format_args!("worker {i} exited ({status}); restarting from the last checkpoint in {}s", backoff.as_secs()));
                    tokio::time::sleep(backoff).await;
                    let r = local.recover(parallelism).await?;
                    last = (Instant::now(), 0);
                    say(format_args!("recovered from {} at parallelism {parallelism}", r.restored_from.unwrap_or_else(|| "nothing (no checkpoint yet)".into())));
                    continue;
                }
                if let Ok(st) = local.status().await {
                    let total: u64 = st.iter().map(|s| s.records_processed).sum();
                    let keys: u64 = st.iter().map(|s| s.keys).sum();
                    let now = Instant::now();
                    let rps = rate(total.saturating_sub(last.1), now - last.0);
                    last = (now, total);
                    let bp: u64 = st.iter().map(|s| s.backpressure_ms).sum();
                    say(format_args!("p={parallelism} records={total} ({rps:.0}/s) keys={keys} backpressure={bp}ms last checkpoint={:?}", st.iter().filter_map(|s| s.last_checkpoint).min()));
                }
            }
            _ = manifest_tick.tick() => {
                let now = std::fs::metadata(&opts.manifest).and_then(|m| m.modified()).ok();
                if now == mtime {
                    continue;
                }
                mtime = now;
                let job = match load_manifest(&opts.manifest) {
                    Ok(j) => j,
                    Err(e) => { say(format_args!("ignoring the edit: {e}")); continue; }
                };
                let status = StreamJobStatus { max_parallelism: Some(local.max_parallelism as i32), ..Default::default() };
                if let Err(e) = validation::analyse(&job.spec, Some(&status)) {
                    if matches!(e, validation::AnalysisError::AboveCeiling { .. }) {
                        above_ceiling = Some(job.spec.replicas);
                        say(local_ceiling_guidance(&opts.manifest, parallelism, job.spec.replicas, local.max_parallelism, None));
                    } else {
                        say(format_args!("ignoring the edit: {e}"));
                    }
                    continue;
                }
                if job.spec.job != local.spec.job {
                    say("only replicas changes are applied to a running local job; stop it (Ctrl-C) and start again to change the dataflow");
                }
                let to = job.spec.replicas as u32;
                if to == parallelism {
                    continue;
                }
                say(format_args!("rescaling {parallelism} -> {to} ..."));
                match local.rescale(to).await {
                    Ok(r) => {
                        parallelism = to;
                        last = (Instant::now(), 0);
                        say(format_args!(
                            "rescaled {} -> {} in {} ms: {} key groups moved, {} of {} state bytes read ({}); savepoint {}",
                            r.from, r.to, r.pause.as_millis(), r.groups_moved, r.bytes_read, r.state_bytes,
                            r.steps.iter().map(|(s, d)| format!("{s} {} ms", d.as_millis())).collect::<Vec<_>>().join(", "),
                            r.savepoint
                        ));
                        print_groups(&local, parallelism);
                    }
                    Err(e) => {
                        say(format_args!("{e}"));
                        if let Some(p) = local.parallelism() { parallelism = p; }
                    }
                }
            }
        }
    }
}

fn print_groups(local: &LocalJob, parallelism: u32) {
    if let Ok(a) = Assignment::new(i64::from(parallelism), i64::from(local.max_parallelism)) {
        let ranges: Vec<String> = a.ranges().iter().map(|r| r.to_string()).collect();
        say(format_args!(
            "key groups per subtask: {} ({})",
            ranges.join(" "),
            a.skew().summary()
        ));
    }
}
