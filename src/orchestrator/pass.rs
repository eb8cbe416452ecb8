//! One pass of the orchestration, the same on every platform: observe the job's workers through
//! the [`Workers`] port, decide the one next action ([`decide::decide`], pure), execute it, and
//! return the status (phase and conditions by [`status::finish`]) and Events for the platform to
//! record. Long steps (snapshots, verification, a run's start) run in the background; the pass
//! after their end records their outcome. Every change of a transition's step goes through
//! [`Pass::transition`].

use super::decide::{self, Action, ActiveRun, ObservedPod, PodPhase, Restore};
use super::hooks;
use super::port::{PortError, Workers};
use super::run::{self, RandomError};
use super::status::{self, Progress};
use super::step::{self, Outcome, Step};
use crate::coordinator::{self, Completed, Coordinator, CoordinatorError, WorkerEndpoint};
use crate::crd::{Phase, RescaleStatus, SnapshotRef, StreamJobSpec, StreamJobStatus, UpgradeMode};
use crate::keygroup::{self, Assignment};
use crate::operator::metrics::{KindLabels, OperatorMetrics, StepLabels};
use crate::runtime::protocol::{StartResponse, WorkerState, WorkerStatus};
use crate::snapshot::{self, JobIdentity, SnapshotKind};
use crate::text;
use crate::tools::catalog::{InUseEntry, InUseMarker};
use crate::validation;
use chrono::{DateTime, Utc};
use k8s_openapi::jiff::Timestamp;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How long the next pass waits, by what the pass did. Named here so that no pass picks a
/// number of its own.
pub mod requeue {
    use std::time::Duration;

    /// A status-only step was recorded; the next one acts on it.
    pub const SOON: Duration = Duration::from_millis(200);
    /// A step's outcome was recorded right after its end.
    pub const RECORDED: Duration = Duration::from_millis(100);
    /// Workers are being created or removed, or are on their way.
    pub const WORKERS_CHANGING: Duration = Duration::from_millis(500);
    /// A background step runs: its end wakes the job at once; this only backs that up.
    pub const BACKGROUND_BACKSTOP: Duration = Duration::from_secs(1);
    /// After a failure: the backoff decides when the retry happens.
    pub const AFTER_FAILURE: Duration = Duration::from_secs(1);
    /// The spec cannot run as it is: look again now and then (an edit wakes the job anyway).
    pub const STALLED: Duration = Duration::from_secs(60);
}

/// How often, at most, status shows a new value of a running restore's progress (each is a
/// status write).
pub const RESTORE_STATUS_EVERY: Duration = Duration::from_secs(2);

/// A failed pass, named by what it was doing.
#[derive(Debug, thiserror::Error)]
pub enum PassError {
    #[error("reading the job's control token: {0}")]
    Token(#[source] PortError),
    #[error("observing the job's workers: {0}")]
    Observe(#[source] PortError),
    #[error("creating workers: {0}")]
    Create(#[source] PortError),
    #[error("removing workers: {0}")]
    Delete(#[source] PortError),
    #[error("coordinating running workers again (adopting them): {0}")]
    Adopt(#[source] CoordinatorError),
    #[error("finding the snapshot to restore: {0}")]
    FindSnapshot(#[source] CoordinatorError),
    #[error("preparing the start of a run: {0}")]
    Start(#[source] CoordinatorError),
    #[error("computing the key-group assignment: {0}")]
    Bounds(#[from] keygroup::BoundsError),
    #[error("rescale state machine: {0}")]
    Transition(String),
    #[error("making a run id: {0}")]
    Random(#[from] RandomError),
}

/// What kind of failure a pass had: the label of the reconcile-error metric, and what decides
/// how soon it is retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The platform (the Kubernetes API, process spawning) refused or was unreachable.
    Platform,
    /// Snapshot storage could not be read.
    Storage,
    /// A worker's control API failed.
    Workers,
    /// The job's settings cannot work (bounds).
    Config,
    /// A bug: an outcome the state machine does not allow.
    Bug,
}

impl ErrorKind {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            ErrorKind::Platform => "platform",
            ErrorKind::Storage => "storage",
            ErrorKind::Workers => "workers",
            ErrorKind::Config => "config",
            ErrorKind::Bug => "bug",
        }
    }

    /// How soon a pass that failed this way is tried again.
    pub fn retry_after(self) -> Duration {
        match self {
            ErrorKind::Platform | ErrorKind::Workers => Duration::from_secs(3),
            ErrorKind::Storage => Duration::from_secs(10),
            ErrorKind::Config | ErrorKind::Bug => Duration::from_secs(30),
        }
    }
}

fn coordinator_kind(e: &CoordinatorError) -> ErrorKind {
    match e {
        CoordinatorError::Snapshot(_) | CoordinatorError::Sink(_) => ErrorKind::Storage,
        _ => ErrorKind::Workers,
    }
}

impl PassError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            PassError::Token(_)
            | PassError::Observe(_)
            | PassError::Create(_)
            | PassError::Delete(_)
            | PassError::Random(_) => ErrorKind::Platform,
            PassError::Adopt(e) | PassError::FindSnapshot(e) | PassError::Start(e) => {
                coordinator_kind(e)
            }
            PassError::Bounds(_) => ErrorKind::Config,
            PassError::Transition(_) => ErrorKind::Bug,
        }
    }
}

/// The run the orchestrator coordinates for a job.
pub struct RunHandle {
    run: String,
    parallelism: u32,
    coordinator: Coordinator,
    started: DateTime<Utc>,
    /// The spec hash ([`decide::spec_hash`]) its workers were created for, when known.
    spec_hash: Option<String>,
}

/// What the orchestrator remembers about a job between passes (lost on restart by design:
/// status and the workers carry everything needed to resume).
#[derive(Default)]
pub struct JobMemory {
    run: Option<RunHandle>,
    failures: u32,
    backoff_until: Option<DateTime<Utc>>,
    last_failure: Option<(String, String)>,
    step_started: Option<(Step, Instant)>,
    /// The key-group count of a spec.restoreFrom snapshot, by URL (read once: committed
    /// manifests never change).
    restore_source: Option<(String, u32, JobIdentity)>,
    /// The control token, as read from or written to its source. Read again before workers
    /// are created, so a deleted Secret is recreated before a worker needs it.
    token: Option<String>,
    /// The step running in the background, if any.
    background: Option<Background>,
    /// The snapshots the job's in-use marker pins, as last written by this process.
    pinned: Option<Vec<InUseEntry>>,
    /// Periodic checkpoints of the current run that failed in a row, and the last error.
    checkpoint_failures: Option<(u32, String)>,
}

impl JobMemory {
    /// Whether the job's background step still runs (its end is kept for the next pass).
    pub fn background_running(&mut self) -> bool {
        self.background.as_mut().is_some_and(Background::running)
    }

    /// Whether a run is coordinated.
    pub fn coordinating(&self) -> bool {
        self.run.is_some()
    }

    /// The coordinated run's parallelism and coordinator.
    pub fn coordinator(&mut self) -> Option<&mut Coordinator> {
        self.run.as_mut().map(|r| &mut r.coordinator)
    }
}

/// A long step that runs outside the pass, so that it holds no reconcile slot: a checkpoint
/// stuck on a storage outage (up to its timeout) then delays its own job only, not every job
/// behind it in the controller's queue. While it runs, passes of its job do nothing; the pass
/// after it ended records its outcome.
struct Background {
    work: BackgroundWork,
    rx: tokio::sync::oneshot::Receiver<Ended>,
    /// Once ended: its outcome (`None`: the task panicked and the run's coordinator is lost).
    ended: Option<Option<Ended>>,
    /// A start that restores a snapshot: what status shows of it while it runs.
    restore: Option<RestoreView>,
}

/// What status shows of a start's restore while it runs in the background (status.restore and
/// the Reconciling condition), at most every [`RESTORE_STATUS_EVERY`].
struct RestoreView {
    /// The coordinator's progress, as it polls the workers.
    progress: tokio::sync::watch::Receiver<Option<coordinator::StartProgress>>,
    /// The snapshot restored.
    snapshot: Option<String>,
    /// When the start began (RFC 3339, and as an instant).
    started: String,
    began: Instant,
    /// What the pass that began the start learned: the conditions show it, with the progress.
    pass: Option<Progress>,
    /// The progress status shows, and when it was put there.
    shown: Option<(Instant, coordinator::StartProgress)>,
}

impl RestoreView {
    /// `status` with the restore's progress, when there is news to show and the last was shown
    /// long enough ago (a start shorter than that shows nothing).
    fn show(
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
enum BackgroundWork {
    Checkpoint {
        parallelism: u32,
    },
    /// The savepoint of a rescale, upgrade or suspend (stops the sources).
    Savepoint {
        parallelism: u32,
    },
    /// A savepoint for spec.savepointTriggerNonce (the job keeps running).
    TriggeredSavepoint {
        parallelism: u32,
        nonce: i64,
    },
    Verify {
        url: String,
    },
    /// Starting a run: the workers restore their key groups, then connect.
    Start(Box<StartWork>),
}

/// A run being started, and what recording its start needs.
#[derive(Debug, Clone)]
struct StartWork {
    run: String,
    parallelism: u32,
    /// The key-group count it runs under.
    groups: u32,
    restore_from: Option<String>,
    /// spec.restoreFrom (or a restore transition's source) when the run restores it.
    restored_source: Option<String>,
    /// With `restored_source`: the largest id of the job's own snapshots before this run (the
    /// history the restore replaces).
    replaced_up_to: Option<u64>,
    run_started: DateTime<Utc>,
    started: Instant,
    /// The spec hash its workers are created for.
    spec_hash: String,
}

/// Why a run did not start.
#[derive(Debug, thiserror::Error)]
enum StartError {
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
    /// The snapshot to restore must not be restored into this job (another job's, or state
    /// under another layout): see [`run::restore_refusal`].
    #[error("{message}")]
    Refused {
        reason: &'static str,
        message: String,
    },
    /// Test only (`test-hooks`).
    #[error("{0}")]
    Injected(String),
}

/// How a background step ended.
enum Ended {
    Snapshot(Box<(RunHandle, Result<Completed, CoordinatorError>)>),
    Verify(Result<snapshot::VerifyReport, snapshot::SnapshotError>),
    Start(Box<(Coordinator, Result<Vec<StartResponse>, CoordinatorError>)>),
}

impl Background {
    /// Whether it still runs; once it ended, its outcome is kept for the next pass.
    fn running(&mut self) -> bool {
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

/// An Event recorded during a pass; the platform publishes it at the pass's end, beside the
/// status write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingEvent {
    pub warning: bool,
    pub reason: String,
    pub note: String,
}

/// What a pass works on.
pub struct PassInput<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub spec: &'a StreamJobSpec,
    /// The status as last recorded.
    pub status: StreamJobStatus,
    /// The snapshot storage root URL.
    pub storage: String,
    /// metadata.generation (observedGeneration in status).
    pub generation: Option<i64>,
}

/// What a pass leaves for the platform to record.
#[derive(Debug)]
pub struct PassOutput {
    pub status: StreamJobStatus,
    pub events: Vec<PendingEvent>,
    /// When the next pass is due (unless something changes first).
    pub requeue: Duration,
}

/// Everything a pass needs besides its input.
pub struct Shell<'a> {
    pub workers: &'a mut dyn Workers,
    pub metrics: &'a OperatorMetrics,
    /// For the workers' control APIs (short timeout).
    pub http: &'a reqwest::Client,
}

/// One pass over a job: records a background step that ended, or decides and executes the next
/// action.
pub async fn run_pass(
    input: PassInput<'_>,
    mem: &mut JobMemory,
    shell: Shell<'_>,
) -> Result<PassOutput, PassError> {
    let PassInput {
        namespace,
        name,
        spec,
        status: status0,
        storage,
        generation,
    } = input;
    let Shell {
        workers,
        metrics,
        http,
    } = shell;
    if mem.background_running() {
        // A start's restore shows its progress while it runs.
        let shown = mem
            .background
            .as_mut()
            .and_then(|bg| bg.restore.as_mut())
            .and_then(|view| view.show(spec, generation, &status0));
        return Ok(PassOutput {
            status: shown.unwrap_or(status0),
            events: Vec::new(),
            requeue: requeue::BACKGROUND_BACKSTOP,
        });
    }
    hooks::pause_at_step(name, &status0);
    // A pass that records the end of a background step looks at no workers: it writes the
    // outcome, and the pass after acts on the workers (a failed start, which removes them,
    // excepted).
    let recording = mem.background.as_ref().is_some_and(|bg| {
        !matches!(
            bg.ended.as_ref(),
            Some(Some(Ended::Start(done))) if done.1.is_err()
        )
    });
    let token_from_cache = mem.token.is_some();
    let token = match mem.token.clone() {
        Some(t) => t,
        None => workers.token().await.map_err(PassError::Token)?,
    };
    mem.token = Some(token.clone());
    let listed = if recording {
        Vec::new()
    } else {
        workers.observe().await.map_err(PassError::Observe)?
    };
    let mut pods = Vec::with_capacity(listed.len());
    let mut endpoints = HashMap::new();
    let mut run_groups = HashMap::new();
    for l in listed {
        if let Some(g) = l.max_parallelism {
            run_groups.insert(l.pod.run.clone(), g);
        }
        if let Some(e) = &l.endpoint
            && run_matches(mem, &l.pod.run)
        {
            endpoints.insert(l.pod.subtask, e.clone());
        }
        pods.push((l.pod, l.endpoint));
    }
    // The workers' own states, asked for at once (a job of 200 workers, or a hung worker with
    // its short timeout, must not make the pass wait for each in turn).
    let states = futures::future::join_all(pods.iter().map(|(p, endpoint)| {
        let ask = match (endpoint, p.phase, p.deleting) {
            (Some(e), PodPhase::Running, false) => Some(e.control.clone()),
            _ => None,
        };
        let token = &token;
        async move {
            match ask {
                Some(control) => worker_state(http, &control, token).await.map(|s| s.state),
                None => None,
            }
        }
    }))
    .await;
    let mut pods: Vec<ObservedPod> = pods
        .into_iter()
        .zip(states)
        .map(|((mut p, _), state)| {
            p.worker = state;
            p
        })
        .collect();
    pods.sort_by(|a, b| (a.run.as_str(), a.subtask).cmp(&(b.run.as_str(), b.subtask)));

    let now = Utc::now();
    let last_snapshot_at =
        decide::last_snapshot_at(&status0, mem.run.as_ref().map(|r| r.started), now);
    let pending_restore = pending_restore(spec, &status0, mem, (&storage, namespace, name)).await;
    let upgrade_refused = upgrade_refusal(spec, mem, (namespace, name));
    let obs = decide::Observed {
        name: name.to_owned(),
        pending_restore,
        upgrade_refused: upgrade_refused.clone(),
        now,
        pods: pods.clone(),
        active: mem.run.as_ref().map(|r| ActiveRun {
            run: r.run.clone(),
            parallelism: r.parallelism,
        }),
        last_snapshot_at,
        backoff_until: mem.backoff_until,
        new_run: run::new_run_id()?,
    };
    // A background step that ended is recorded first; what to do next is decided in the pass
    // after (on the status that records it).
    let background = mem.background.take();
    let progress = Progress {
        failure: mem.last_failure.clone(),
        ..Default::default()
    };
    let mut pass = Pass {
        workers,
        metrics,
        spec,
        ns: namespace.to_owned(),
        name: name.to_owned(),
        storage,
        token,
        token_from_cache,
        status: status0.clone(),
        progress,
        mem,
        pods,
        endpoints,
        pending: obs.pending_restore.clone().and_then(Result::ok),
        run_groups,
        events: Vec::new(),
    };
    // status.restore is the restore running now: none runs while a pass does.
    pass.status.restore = None;
    let requeue = match background {
        Some(bg) => pass.record_background(bg).await,
        None => {
            let action = decide::decide(spec, &status0, &obs);
            tracing::debug!(job = %name, ?action, "decided");
            let pinned = matches!(action, Action::PinMaxParallelism { .. });
            let mut requeue = pass.execute(action).await;
            // Pinning the key-group count only changes status. When what follows only changes
            // status as well (a new suspended job is Suspended), it is done in the same pass and
            // written with it; anything that acts (creates workers, ...) waits for the pin to be
            // recorded.
            if pinned && requeue.is_ok() {
                let next = decide::decide(spec, &pass.status, &obs);
                if matches!(next, Action::MarkSuspended) {
                    tracing::debug!(job = %name, action = ?next, "decided");
                    requeue = pass.execute(next).await;
                }
            }
            requeue
        }
    };
    // The run is in memory before a pass that hands it to a background step and after one that
    // records its end.
    if let Some((reason, message)) =
        upgrade_refused.or_else(|| upgrade_refusal(spec, pass.mem, (namespace, name)))
    {
        pass.stall(reason, message);
    }
    let requeue = requeue?;
    pass.progress.checkpoint_failures = pass
        .mem
        .checkpoint_failures
        .clone()
        .filter(|_| pass.status.phase == Some(Phase::Running) || pass.mem.coordinating());
    if pass.status.phase == Some(Phase::Running) && pass.progress.checkpoint_failures.is_none() {
        pass.progress.checkpoint_failures = Some((0, String::new()));
    }
    pass.pin_in_use().await;
    pass.observe_sink();
    let mut status = pass.status;
    let progress = pass.progress;
    let events = pass.events;
    let view = pass
        .mem
        .background
        .as_mut()
        .and_then(|bg| bg.restore.as_mut());
    let analysis = decide::check_spec(name, spec, &decide::effective_status(&status, &obs)).ok();
    status::finish(
        spec,
        generation,
        &mut status,
        analysis.as_ref(),
        &progress,
        Timestamp::now(),
    );
    if let Some(view) = view
        && view.pass.is_none()
    {
        view.pass = Some(progress);
    }
    Ok(PassOutput {
        status,
        events,
        requeue,
    })
}

/// The snapshots of the job's own directory that its state depends on beyond what `savepoint
/// dispose` protects by itself (the newest checkpoint and snapshot): the savepoint of a
/// transition in flight, and the snapshot the job was (or is being) restored from when it lies in
/// the job's directory. Written to the job's in-use marker, so that `dispose` refuses them.
/// Snapshots of another job are not pinned (that job's marker has its own writer).
pub fn in_use(
    spec: &StreamJobSpec,
    status: &StreamJobStatus,
    storage: &str,
    namespace: &str,
    name: &str,
) -> Vec<InUseEntry> {
    let prefix = format!("{}/{namespace}/{name}/", storage.trim_end_matches('/'));
    let relative = |url: &str| {
        url.strip_prefix(&prefix)
            .map(|r| r.trim_matches('/').to_owned())
            .filter(|r| !r.is_empty())
    };
    let mut pins: Vec<InUseEntry> = Vec::new();
    let mut pin = |url: Option<&String>, reason: String| {
        if let Some(path) = url.and_then(|u| relative(u))
            && !pins.iter().any(|p| p.path == path)
        {
            pins.push(InUseEntry {
                path,
                holder: Some("keyshift".into()),
                reason: Some(reason),
            });
        }
    };
    if let Some(r) = status.rescale.as_ref().filter(|r| r.step.active()) {
        pin(
            r.savepoint.as_ref(),
            format!("transition {} -> {} in step {}", r.from, r.to, r.step),
        );
        pin(
            r.restore_from.as_ref(),
            format!("restoring {namespace}/{name} from it"),
        );
    }
    pin(
        spec.restore_from.as_ref(),
        format!("spec.restoreFrom of {namespace}/{name}"),
    );
    pins
}

/// The status of a job that cannot run at all (no storage): Stalled with `reason`/`message`.
pub fn stalled_status(
    spec: &StreamJobSpec,
    generation: Option<i64>,
    status: &StreamJobStatus,
    reason: &str,
    message: &str,
) -> StreamJobStatus {
    let mut status = status.clone();
    let progress = Progress {
        stalled: Some((reason.to_owned(), message.to_owned())),
        ..Default::default()
    };
    status::finish(
        spec,
        generation,
        &mut status,
        None,
        &progress,
        Timestamp::now(),
    );
    status
}

/// The seconds each finished step of a transition took, in protocol order
/// ("Savepointing 0.130 s, Verifying 0.007 s, ...").
pub fn step_times(r: &RescaleStatus) -> String {
    let times: Vec<String> = step::ALL_STEPS
        .iter()
        .filter_map(|s| {
            r.step_seconds
                .get(s.as_str())
                .map(|secs| format!("{s} {secs:.3} s"))
        })
        .collect();
    if times.is_empty() {
        "step times unknown (the orchestrator restarted)".into()
    } else {
        times.join(", ")
    }
}

struct Pass<'a> {
    workers: &'a mut dyn Workers,
    metrics: &'a OperatorMetrics,
    spec: &'a StreamJobSpec,
    ns: String,
    name: String,
    storage: String,
    token: String,
    /// The token came from the job's memory, not from its source in this pass.
    token_from_cache: bool,
    status: StreamJobStatus,
    progress: Progress,
    mem: &'a mut JobMemory,
    pods: Vec<ObservedPod>,
    /// Control and data addresses of the coordinated run's workers, by subtask.
    endpoints: HashMap<u32, WorkerEndpoint>,
    /// The spec.restoreFrom not yet acted on, when its manifest could be read.
    pending: Option<decide::PendingRestore>,
    /// The key-group count each run's workers were created under, by run.
    run_groups: HashMap<String, u32>,
    /// Events of this pass, published when it ends (beside the status write, not before it).
    events: Vec<PendingEvent>,
}

fn run_matches(mem: &JobMemory, run: &str) -> bool {
    mem.run.as_ref().is_none_or(|r| r.run == run)
}

async fn worker_state(http: &reqwest::Client, control: &str, token: &str) -> Option<WorkerStatus> {
    let resp = http
        .get(format!("{control}/v1/status"))
        .bearer_auth(token)
        .send()
        .await
        .ok()?;
    if !resp.status().is_success() {
        return None;
    }
    resp.json().await.ok()
}

fn snapshot_ref(c: &Completed, parallelism: u32) -> SnapshotRef {
    SnapshotRef {
        id: c.id as i64,
        path: c.url.clone(),
        time: Utc::now().to_rfc3339(),
        parallelism: parallelism as i32,
        size_bytes: Some(c.manifest.stats.total_bytes as i64),
    }
}

fn backoff(failures: u32) -> chrono::Duration {
    chrono::Duration::seconds(1i64 << failures.saturating_sub(1).min(6))
}

/// spec.restoreFrom when the job has not been started from it yet: its manifest's key-group
/// count, or why it cannot be read. A failed read is not cached (the snapshot may appear).
async fn pending_restore(
    spec: &StreamJobSpec,
    status: &StreamJobStatus,
    mem: &mut JobMemory,
    (storage, namespace, name): (&str, &str, &str),
) -> Option<Result<decide::PendingRestore, (&'static str, String)>> {
    let url = spec.restore_from.as_ref()?;
    if status.restored_from.as_ref() == Some(url) {
        return None;
    }
    let cached = mem
        .restore_source
        .as_ref()
        .filter(|(cached, ..)| cached == url)
        .map(|(_, g, id)| (*g, id.clone()));
    let (groups, identity) = match cached {
        Some(found) => found,
        None => match coordinator::restore_source(url, storage, namespace).await {
            Ok((g, id)) => {
                mem.restore_source = Some((url.clone(), g, id.clone()));
                (g, id)
            }
            Err(e) => {
                return Some(Err((
                    "RestoreFromUnusable",
                    format!("{e}; nothing was stopped"),
                )));
            }
        },
    };
    // Checked on every pass (the spec may change while the restore waits), before anything
    // stops.
    if let Some((reason, message)) = run::restore_refusal(namespace, name, spec, url, &identity) {
        return Some(Err((reason, format!("{message}; nothing was stopped"))));
    }
    Some(Ok(decide::PendingRestore {
        url: url.clone(),
        max_parallelism: groups,
    }))
}

/// Why the job's changed spec.job must not be applied to its running workers' state (see
/// [`decide::Observed::upgrade_refused`]): only for an upgrade that keeps state.
fn upgrade_refusal(
    spec: &StreamJobSpec,
    mem: &JobMemory,
    (namespace, name): (&str, &str),
) -> Option<(&'static str, String)> {
    let r = mem.run.as_ref()?;
    let changed = r
        .spec_hash
        .as_ref()
        .is_some_and(|h| *h != decide::spec_hash(spec));
    if !changed || spec.upgrade_mode == UpgradeMode::Stateless {
        return None;
    }
    let (reason, message) = run::restore_refusal(
        namespace,
        name,
        spec,
        "the running job",
        r.coordinator.identity(),
    )?;
    Some((
        reason,
        format!("{message}; the upgrade was not begun and the job keeps running its current logic"),
    ))
}

impl<'a> Pass<'a> {
    fn rescale_mut(&mut self) -> Option<&mut RescaleStatus> {
        self.status.rescale.as_mut()
    }

    /// Records a new transition, starting at its first step.
    fn begin(&mut self, rescale: RescaleStatus) {
        self.mem.step_started = Some((rescale.step, Instant::now()));
        self.status.rescale = Some(rescale);
    }

    /// The one place a transition's step changes: the step that follows `outcome` (by
    /// [`step::next`]) is recorded, with the seconds the ended step took (in status and the
    /// step-duration metric).
    fn transition(&mut self, outcome: Outcome) -> Result<(), PassError> {
        let now = Instant::now();
        let started = self.mem.step_started.take();
        let Some(r) = self.status.rescale.as_mut() else {
            return Err(PassError::Transition(format!(
                "outcome {outcome:?} with no transition recorded"
            )));
        };
        let next = step::next(r.step, outcome).map_err(|e| PassError::Transition(e.to_string()))?;
        // Unknown after an operator restart: the step's time is then not reported.
        let secs = match started {
            Some((s, t)) if s == r.step => now.duration_since(t).as_secs_f64(),
            _ => 0.0,
        };
        r.step_seconds
            .insert(r.step.as_str().to_owned(), (secs * 1000.0).round() / 1000.0);
        self.metrics
            .rescale_step_seconds
            .get_or_create(&StepLabels {
                namespace: self.ns.clone(),
                job: self.name.clone(),
                step: r.step.as_str().to_owned(),
            })
            .observe(secs);
        tracing::info!(job = %self.name, from = %r.step, to = %next, ?outcome, "step");
        r.step = next;
        self.mem.step_started = next.active().then_some((next, now));
        Ok(())
    }

    /// The spec cannot be carried out: Stalled with `reason`/`message`, and a warning Event
    /// when the message is new.
    fn stall(&mut self, reason: &str, message: String) {
        let previous = self
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == status::STALLED)
            .is_some_and(|c| c.status == "True" && c.message == message);
        if !previous {
            self.event(true, reason, message.clone());
        }
        self.progress.stalled = Some((reason.to_owned(), message));
    }

    fn fail(&mut self, reason: &str, message: String) {
        self.mem.failures += 1;
        self.mem.backoff_until = Some(Utc::now() + backoff(self.mem.failures));
        self.mem.last_failure = Some((reason.to_owned(), message.clone()));
        self.progress.failure = Some((reason.to_owned(), message));
    }

    fn succeeded(&mut self) {
        self.mem.failures = 0;
        self.mem.backoff_until = None;
        self.mem.last_failure = None;
        self.progress.failure = None;
    }

    /// A transition to spec.restoreFrom whose new run is being started (not rolled back).
    fn restore_transition(&self) -> Option<&RescaleStatus> {
        self.status.rescale.as_ref().filter(|r| {
            r.step == Step::Restoring && r.rolled_back.is_none() && r.restore_from.is_some()
        })
    }

    /// The key-group count new pods and runs use: a restore transition's new count while its
    /// new run starts, a pending restoreFrom's count while no run is coordinated, else the
    /// pinned one.
    fn max_parallelism(&self) -> u32 {
        let transition = self.restore_transition();
        if let Some(g) = transition.and_then(|r| r.max_parallelism) {
            return g.max(1) as u32;
        }
        if self.mem.run.is_none()
            && transition.is_none()
            && let Some(p) = &self.pending
        {
            return p.max_parallelism.max(1);
        }
        let pinned = self
            .status
            .max_parallelism
            .or(self.spec.max_parallelism)
            .unwrap_or_else(|| {
                keygroup::default_max_parallelism(self.spec.replicas.max(1) as u32) as i32
            });
        pinned.max(1) as u32
    }

    fn assignment(&self, parallelism: u32) -> Result<Assignment, PassError> {
        Ok(Assignment::new(
            i64::from(parallelism),
            i64::from(self.max_parallelism()),
        )?)
    }

    /// For a job with an object-store sink: whether the coordinated run's published output is
    /// behind its commits (a condition, and a warning Event when it falls behind).
    fn observe_sink(&mut self) {
        if run::sink_url(self.spec).is_none() {
            return;
        }
        let Some(backlog) = self
            .mem
            .run
            .as_ref()
            .map(|r| r.coordinator.publish_backlog())
        else {
            return;
        };
        let was_behind = self
            .status
            .conditions
            .iter()
            .any(|c| c.type_ == status::SINK_PUBLISHED && c.status == "False");
        if backlog.is_behind() && !was_behind {
            self.event(
                true,
                "SinkPublishBehind",
                format!(
                    "output of committed {} {} not published: {}; retried after every commit",
                    text::noun(backlog.pending.len() as u64, "snapshot"),
                    text::list(&backlog.pending),
                    backlog.last_error.as_deref().unwrap_or("no attempt yet")
                ),
            );
        }
        self.progress.sink = Some(backlog);
    }

    /// Writes the job's in-use marker when what it pins changed ([`in_use`]). Best effort: a
    /// failed write is logged and tried again by the next pass.
    async fn pin_in_use(&mut self) {
        let pins = in_use(self.spec, &self.status, &self.storage, &self.ns, &self.name);
        if self.mem.pinned.as_ref() == Some(&pins) {
            return;
        }
        let written: Result<(), String> = async {
            let (store, base) = snapshot::open_store(&self.storage).map_err(|e| e.to_string())?;
            let job_dir = snapshot::job_dir(&base, &self.ns, &self.name);
            let marker = InUseMarker::new(pins.clone());
            crate::tools::catalog::write_in_use(store.as_ref(), &job_dir, &marker)
                .await
                .map_err(|e| e.to_string())
        }
        .await;
        match written {
            Ok(()) => self.mem.pinned = Some(pins),
            Err(e) => {
                tracing::warn!(job = %self.name, error = %e, "writing the in-use marker failed; retrying next pass")
            }
        }
    }

    /// The coordinator of a run of this job with these workers (the future borrows no part of
    /// the pass: the platform port it holds need not be `Sync`).
    fn coordinator(
        &self,
        assignment: Assignment,
        endpoints: Vec<WorkerEndpoint>,
        identity: JobIdentity,
    ) -> impl Future<Output = Result<Coordinator, CoordinatorError>> + Send + 'a {
        let (spec, storage, token) = (self.spec, self.storage.clone(), self.token.clone());
        async move { run::coordinator(spec, &storage, identity, assignment, endpoints, token).await }
    }

    fn identity(&self) -> JobIdentity {
        run::identity(&self.ns, &self.name, self.spec)
    }

    /// The identity recorded by the job's newest snapshot (this spec's when it has none).
    fn newest_identity(
        &self,
    ) -> impl Future<Output = Result<JobIdentity, CoordinatorError>> + Send + 'a {
        let (storage, ns, name, own) = (
            self.storage.clone(),
            self.ns.clone(),
            self.name.clone(),
            self.identity(),
        );
        async move {
            let newest = coordinator::newest_snapshot(&storage, &ns, &name, None, None).await?;
            Ok(newest.found.map_or(own, |(_, info)| info.job))
        }
    }

    fn endpoints(&self, parallelism: u32) -> Option<Vec<WorkerEndpoint>> {
        (0..parallelism)
            .map(|i| self.endpoints.get(&i).cloned())
            .collect()
    }

    fn set_running(&mut self, parallelism: u32) -> Result<(), PassError> {
        self.status.replicas = Some(parallelism as i32);
        self.progress.phase = Some(Phase::Running);
        self.status.key_groups = Some(status::key_groups(self.assignment(parallelism)?));
        Ok(())
    }

    fn event(&mut self, warning: bool, reason: &str, note: String) {
        self.events.push(PendingEvent {
            warning,
            reason: reason.to_owned(),
            note,
        });
    }

    /// Removes every worker of the job that is not on its way out already; ends the run.
    async fn delete_all(&mut self) -> Result<usize, PassError> {
        let names: Vec<String> = self
            .pods
            .iter()
            .filter(|p| !p.deleting)
            .map(|p| p.name.clone())
            .collect();
        if !names.is_empty() {
            self.workers
                .delete(&names)
                .await
                .map_err(PassError::Delete)?;
        }
        self.mem.run = None;
        Ok(names.len())
    }

    async fn execute(&mut self, action: Action) -> Result<Duration, PassError> {
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
                    "KeyGroupsPinned",
                    format!("key-group count (max parallelism) pinned at {g}"),
                );
                Ok(short)
            }
            Action::BeginRescale { from, to } => {
                let groups_moved = match (self.assignment(from), self.assignment(to.max(1))) {
                    (Ok(a), Ok(b)) if to > 0 => keygroup::rescale_plan(a, b)
                        .ok()
                        .map(|p| p.moved_groups as i32),
                    _ => None,
                };
                self.begin(RescaleStatus {
                    from: from as i32,
                    to: to as i32,
                    step: Step::Savepointing,
                    started: Utc::now().to_rfc3339(),
                    groups_moved,
                    ..Default::default()
                });
                let what = if to == 0 {
                    format!("suspending (parallelism {from}) with a savepoint")
                } else {
                    format!(
                        "rescaling {from} -> {to}: stop with a savepoint, verify, move key groups, restart"
                    )
                };
                self.event(
                    false,
                    if to == 0 {
                        "Suspending"
                    } else {
                        "RescaleStarted"
                    },
                    what,
                );
                Ok(short)
            }
            Action::BeginRestore {
                from,
                to,
                url,
                max_parallelism,
            } => {
                self.begin(RescaleStatus {
                    from: from as i32,
                    to: to as i32,
                    step: Step::Savepointing,
                    started: Utc::now().to_rfc3339(),
                    restore_from: Some(url.clone()),
                    max_parallelism: Some(max_parallelism as i32),
                    ..Default::default()
                });
                self.event(
                    false,
                    "RestoreStarted",
                    format!(
                        "spec.restoreFrom changed: keeping the current state in a savepoint, then restarting at parallelism {to} from {url} ({max_parallelism} key groups)"
                    ),
                );
                Ok(short)
            }
            Action::BeginUpgrade { parallelism, mode } => {
                let p = parallelism as i32;
                self.begin(RescaleStatus {
                    from: p,
                    to: p,
                    step: Step::first_of_upgrade(mode),
                    started: Utc::now().to_rfc3339(),
                    groups_moved: Some(0),
                    upgrade_mode: Some(mode),
                    ..Default::default()
                });
                let how = match mode {
                    crate::crd::UpgradeMode::Savepoint => {
                        "stop with a savepoint, verify, restart with the new spec from it"
                    }
                    crate::crd::UpgradeMode::LastState => {
                        "stop, restart with the new spec from the latest checkpoint"
                    }
                    crate::crd::UpgradeMode::Stateless => {
                        "stop, restart with the new spec and empty state"
                    }
                };
                self.event(
                    false,
                    "UpgradeStarted",
                    format!("spec.job or spec.image changed (parallelism {parallelism}): {how}"),
                );
                Ok(short)
            }
            Action::Savepoint => self.savepoint().await,
            Action::Verify { url } => {
                let work = BackgroundWork::Verify { url: url.clone() };
                self.in_background(work, move |handle| {
                    Ended::Verify(handle.block_on(async {
                        let (store, dir) = snapshot::open_store(&url)?;
                        snapshot::verify(store.as_ref(), &dir).await
                    }))
                });
                Ok(requeue::BACKGROUND_BACKSTOP)
            }
            Action::DeletePods { reason } => {
                let n = self.delete_all().await?;
                if n > 0 {
                    self.event(
                        false,
                        "DeletingPods",
                        format!("{reason}: deleting {}", text::count(n as u64, "worker")),
                    );
                }
                self.progress.note = Some((
                    reason.to_owned(),
                    format!("deleting {}", text::count(n as u64, "worker")),
                ));
                Ok(requeue::WORKERS_CHANGING)
            }
            Action::Advance(outcome) => {
                self.transition(outcome)?;
                Ok(short)
            }
            Action::Abandon { message } => {
                self.abandon(message).await?;
                Ok(short)
            }
            Action::CreatePods {
                run,
                parallelism,
                subtasks,
            } => {
                let assignment = self.assignment(parallelism)?;
                // The workers read the token from its source (the Secret): make sure it
                // (still) exists.
                if self.token_from_cache {
                    let token = self.workers.token().await.map_err(PassError::Token)?;
                    self.mem.token = Some(token.clone());
                    self.token = token;
                    self.token_from_cache = false;
                }
                self.workers
                    .create(&run, assignment, &subtasks, &self.token)
                    .await
                    .map_err(PassError::Create)?;
                self.event(
                    false,
                    "CreatedPods",
                    format!(
                        "run {run}: created {} of {}",
                        subtasks.len(),
                        text::count(u64::from(parallelism), "worker")
                    ),
                );
                self.progress.note = Some((
                    "CreatingPods".into(),
                    format!(
                        "run {run}: {}",
                        text::count(u64::from(parallelism), "worker")
                    ),
                ));
                Ok(requeue::WORKERS_CHANGING)
            }
            Action::Wait { reason } => {
                self.progress.note = Some(("Waiting".into(), reason));
                Ok(requeue::WORKERS_CHANGING)
            }
            Action::Start {
                run,
                parallelism,
                restore,
            } => self.start(run, parallelism, restore).await,
            Action::Adopt { run, parallelism } => {
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
                let want = decide::spec_hash(self.spec);
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
                    .coordinator(assignment, endpoints, identity)
                    .await
                    .map_err(PassError::Adopt)?;
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
                    started: Utc::now(),
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
            Action::Recover { message } => {
                self.delete_all().await?;
                self.progress.phase = Some(Phase::Pending);
                self.fail(
                    "WorkerFailed",
                    format!("{message}; restarting from the last checkpoint"),
                );
                self.metrics
                    .worker_restarts
                    .get_or_create(&OperatorMetrics::job(&self.ns, &self.name))
                    .inc();
                self.event(
                    true,
                    "WorkerFailed",
                    format!("{message}; restarting the job from its last checkpoint"),
                );
                Ok(requeue::WORKERS_CHANGING)
            }
            Action::FinishRescale => {
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
                        "Suspended"
                    } else if rolled_back {
                        "RescaleRolledBack"
                    } else {
                        "Rescaled"
                    },
                    format!(
                        "{} -> {} done: {} key groups moved, {} bytes read; {}",
                        r.from,
                        r.to,
                        r.groups_moved.unwrap_or_default(),
                        r.bytes_to_read.unwrap_or_default(),
                        step_times(&r)
                    ),
                );
                Ok(short)
            }
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

    /// The new run of a rescale is up: step Done, or RolledBack when it runs at the old
    /// parallelism after a failed restore (the failure, its condition and its backoff stay, so
    /// the rescale is retried later).
    fn finish_restoring(&mut self, rolled_back: bool) -> Result<(), PassError> {
        if rolled_back {
            self.transition(Outcome::RestoredAfterRollback)?;
            // The same rescale is retried, but not at once: it just failed.
            let retry = backoff(self.mem.failures).max(chrono::Duration::seconds(10));
            self.mem.backoff_until = Some(Utc::now() + retry);
            if let Some((reason, message)) = self.mem.last_failure.clone() {
                self.progress.failure = Some((reason, message));
            }
        } else {
            self.transition(Outcome::Restored)?;
            self.succeeded();
        }
        Ok(())
    }

    async fn abandon(&mut self, message: String) -> Result<(), PassError> {
        self.transition(Outcome::GaveUp)?;
        if let Some(run) = &self.mem.run {
            run.coordinator.resume().await;
            // The old run goes on: the job runs (at its old parallelism), it is not rescaling.
            let parallelism = run.parallelism;
            self.set_running(parallelism)?;
        }
        self.fail("RescaleAbandoned", message.clone());
        self.event(true, "RescaleAbandoned", format!("{message}; the job keeps running at its old parallelism and the rescale is retried with backoff"));
        Ok(())
    }

    fn kind_labels(&self, kind: &str) -> KindLabels {
        KindLabels {
            namespace: self.ns.clone(),
            job: self.name.clone(),
            kind: kind.to_owned(),
        }
    }

    /// Snapshot metrics: duration and size of a committed snapshot, or one more failure.
    fn record_snapshot(&mut self, labels: &KindLabels, completed: Option<&Completed>) {
        let m = &self.metrics;
        match completed {
            Some(c) => {
                if let Some(d) = status::state_distribution(&c.manifest) {
                    self.status.state_distribution = Some(d);
                }
                m.snapshot_seconds
                    .get_or_create(labels)
                    .observe(c.duration.as_secs_f64());
                m.snapshot_bytes
                    .get_or_create(labels)
                    .set(c.manifest.stats.total_bytes as i64);
                m.snapshot_timestamp
                    .get_or_create(labels)
                    .set(c.manifest.completed_at.timestamp());
            }
            None => {
                m.snapshot_failures.get_or_create(labels).inc();
            }
        }
    }

    /// Runs `work` on a blocking thread (the coordinator's snapshot future is not provably
    /// `Send`: retention and manifest commits borrow inside stream closures). Its end wakes the
    /// job's controller; the pass it triggers records the outcome.
    fn in_background(
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
    fn snapshot_in_background(
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
    async fn record_background(&mut self, bg: Background) -> Result<Duration, PassError> {
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
                BackgroundWork::TriggeredSavepoint { parallelism, nonce },
                Some(Ended::Snapshot(done)),
            ) => Ok(self.triggered_savepoint_done(parallelism, nonce, *done)),
            (BackgroundWork::Start(work), Some(Ended::Start(done))) => {
                let (coordinator, result) = *done;
                self.start_done(*work, coordinator, result.map_err(StartError::from))
                    .await
            }
            (BackgroundWork::Verify { url }, Some(Ended::Verify(result))) => {
                match result {
                    Ok(report) => {
                        self.transition(Outcome::Verified)?;
                        self.event(
                            false,
                            "SavepointVerified",
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
                        self.abandon(format!("savepoint {url} failed verification: {e}"))
                            .await?;
                    }
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

    async fn savepoint(&mut self) -> Result<Duration, PassError> {
        let Some(run) = self.mem.run.take() else {
            return Ok(requeue::SOON);
        };
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
            SnapshotKind::Savepoint,
            true,
            run::timeouts::savepoint(self.spec),
        );
        Ok(requeue::BACKGROUND_BACKSTOP)
    }

    async fn savepoint_done(
        &mut self,
        parallelism: u32,
        (run, result): (RunHandle, Result<Completed, CoordinatorError>),
    ) -> Result<Duration, PassError> {
        let labels = self.kind_labels("savepoint");
        self.mem.run = Some(run);
        match result {
            Ok(c) => {
                self.record_snapshot(&labels, Some(&c));
                self.status.last_savepoint = Some(snapshot_ref(&c, parallelism));
                if let Some(r) = self.rescale_mut() {
                    r.savepoint = Some(c.url.clone());
                    r.bytes_to_read = Some(c.manifest.stats.total_bytes as i64);
                }
                self.transition(Outcome::SavepointTaken)?;
                self.event(
                    false,
                    "SavepointTaken",
                    format!(
                        "savepoint {} ({} bytes) in {} ms; sources stopped at its barrier",
                        c.url,
                        c.manifest.stats.total_bytes,
                        c.duration.as_millis()
                    ),
                );
                Ok(requeue::RECORDED)
            }
            Err(e) => {
                self.record_snapshot(&labels, None);
                self.abandon(format!("savepoint failed: {e}")).await?;
                Ok(requeue::WORKERS_CHANGING)
            }
        }
    }

    /// A savepoint asked for with spec.savepointTriggerNonce: the job keeps running.
    fn triggered_savepoint(&mut self, nonce: i64) -> Duration {
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
            run::timeouts::savepoint(self.spec),
        );
        requeue::BACKGROUND_BACKSTOP
    }

    fn triggered_savepoint_done(
        &mut self,
        parallelism: u32,
        nonce: i64,
        (run, result): (RunHandle, Result<Completed, CoordinatorError>),
    ) -> Duration {
        let labels = self.kind_labels("savepoint");
        self.mem.run = Some(run);
        match result {
            Ok(c) => {
                self.record_snapshot(&labels, Some(&c));
                self.status.last_savepoint = Some(snapshot_ref(&c, parallelism));
                self.status.last_savepoint_nonce = Some(nonce);
                self.succeeded();
                self.event(
                    false,
                    "SavepointTaken",
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
                self.fail("SavepointFailed", message.clone());
                self.event(true, "SavepointFailed", message);
                requeue::AFTER_FAILURE
            }
        }
    }

    fn checkpoint(&mut self) -> Duration {
        let Some(run) = self.mem.run.take() else {
            return decide::checkpoint_interval(self.spec);
        };
        let work = BackgroundWork::Checkpoint {
            parallelism: run.parallelism,
        };
        self.snapshot_in_background(
            work,
            run,
            SnapshotKind::Checkpoint,
            false,
            run::timeouts::checkpoint(self.spec),
        );
        requeue::BACKGROUND_BACKSTOP
    }

    fn checkpoint_done(
        &mut self,
        parallelism: u32,
        (run, result): (RunHandle, Result<Completed, CoordinatorError>),
    ) -> Duration {
        let interval = decide::checkpoint_interval(self.spec);
        let labels = self.kind_labels("checkpoint");
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
                run.started = Utc::now();
                self.record_snapshot(&labels, None);
                let failed = self.mem.checkpoint_failures.take().map_or(0, |(n, _)| n) + 1;
                self.mem.checkpoint_failures = Some((failed, e.to_string()));
                self.event(
                    true,
                    "CheckpointFailed",
                    format!("{e}; the previous checkpoint stays usable"),
                );
                interval / 2
            }
        }
    }

    async fn start(
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
            .and_then(|r| r.restore_from.clone());
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
        let run_started = if restore == Restore::Empty || from_restore_from {
            DateTime::UNIX_EPOCH
        } else {
            Utc::now()
        };
        let resumes_history = restore == Restore::Latest;
        // The job identity the snapshot records, when known without reading its manifest again.
        let mut restored_job = None;
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
                )
                .await
                .map_err(PassError::FindSnapshot)?;
                let newest = match found.skipped.is_empty() {
                    true => Ok(()),
                    false => {
                        let message = run::skipped_message(&found.skipped, found.url.as_deref());
                        self.event(true, "UnreadableSnapshotSkipped", message.clone());
                        Err(message)
                    }
                };
                self.progress.restored_newest = Some(newest);
                restored_job = found.job;
                found.url
            }
        };
        // A run restored from spec.restoreFrom replaces the job's history up to its newest
        // snapshot now: recorded once the run starts, so that no later resume goes back to it.
        let replaced_up_to = match &restored_source {
            Some(_) => {
                let (store, base) = snapshot::open_store(&self.storage)
                    .map_err(|e| PassError::FindSnapshot(e.into()))?;
                let job_dir = snapshot::job_dir(&base, &self.ns, &self.name);
                let next = coordinator::next_snapshot_id(store.as_ref(), &job_dir)
                    .await
                    .map_err(PassError::FindSnapshot)?;
                Some(next.saturating_sub(1))
            }
            None => None,
        };
        let assignment = self.assignment(parallelism)?;
        let coordinator = self
            .coordinator(assignment, endpoints, self.identity())
            .await
            .map_err(PassError::Start)?;
        let template = run::StartPlan {
            namespace: &self.ns,
            name: &self.name,
            spec: self.spec,
            assignment,
            storage: &self.storage,
            restore_from: restore_from.clone(),
            run: &run,
            state_payload_bytes: hooks::state_payload_bytes(),
        }
        .request()?;
        let work = StartWork {
            run,
            parallelism,
            groups: assignment.max_parallelism(),
            restore_from,
            restored_source,
            replaced_up_to,
            run_started,
            started: Instant::now(),
            spec_hash: decide::spec_hash(self.spec),
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
        if restoring_rescale && hooks::fail_restore_at(work.parallelism) {
            let injected = StartError::Injected(format!(
                "{}={}: restore failure injected (test only)",
                hooks::FAIL_RESTORE_ENV,
                work.parallelism
            ));
            return self.start_done(work, coordinator, Err(injected)).await;
        }
        // The workers answer at once and restore their key groups; waiting for them runs in the
        // background.
        let timeout = run::timeouts::start(self.spec);
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
                started: Utc::now().to_rfc3339(),
                began: Instant::now(),
                pass: None,
                shown: None,
            });
        }
        Ok(requeue::BACKGROUND_BACKSTOP)
    }

    /// Records how starting a run ended.
    async fn start_done(
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
                if from_restore_from {
                    let g = key_groups as i32;
                    if self.status.max_parallelism != Some(g) {
                        self.status.max_parallelism_origin = restore_from
                            .as_deref()
                            .map(validation::ceiling_origin_snapshot);
                        self.event(
                            false,
                            "KeyGroupsPinned",
                            format!(
                                "key-group count (max parallelism) is now {g}, from {}",
                                restore_from.as_deref().unwrap_or_default()
                            ),
                        );
                    }
                    self.status.max_parallelism = Some(g);
                    self.status.restored_from = restored_source.clone();
                    self.status.replaced_history_up_to =
                        replaced_up_to.and_then(|b| i64::try_from(b).ok());
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
                    "Started",
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
                            (true, _) => "RescaleRolledBack",
                            (false, None) => "Rescaled",
                            (false, Some(_)) => "Upgraded",
                        },
                        format!(
                            "{}{} -> {} {}: {} key groups moved, {} bytes read; {}",
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
                            step_times(&r)
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
                    self.fail("RescaleRolledBack", why.clone());
                    self.event(true, "RescaleRollingBack", why);
                    return Ok(requeue::AFTER_FAILURE);
                }
                let reason = match &e {
                    StartError::Refused { reason, .. } => reason,
                    _ => "StartFailed",
                };
                self.fail(reason, message.clone());
                self.event(
                    true,
                    reason,
                    format!("{message}; retrying with backoff (the snapshot is intact)"),
                );
                Ok(requeue::AFTER_FAILURE)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_in_use_marker_pins_a_transitions_savepoint_and_the_restore_source_of_the_own_job() {
        let storage = "s3://b/state/";
        let own = |rel: &str| format!("s3://b/state/ns/j/{rel}");
        let mut spec: StreamJobSpec =
            serde_yaml::from_str("replicas: 2\njob: {source: {generator: {partitions: 2, keys: 10}}, key: {field: key}, aggregation: {function: count}}")
                .unwrap();
        let mut status = StreamJobStatus::default();
        assert!(in_use(&spec, &status, storage, "ns", "j").is_empty());
        status.rescale = Some(RescaleStatus {
            from: 2,
            to: 4,
            step: Step::Verifying,
            savepoint: Some(own("savepoints/sp-7")),
            ..Default::default()
        });
        spec.restore_from = Some(own("savepoints/sp-3-mp1024"));
        let pins = in_use(&spec, &status, storage, "ns", "j");
        let paths: Vec<&str> = pins.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(paths, ["savepoints/sp-7", "savepoints/sp-3-mp1024"]);
        assert!(
            pins[0]
                .reason
                .as_deref()
                .unwrap_or_default()
                .contains("2 -> 4 in step Verifying")
        );
        // Finished transitions pin nothing; another job's snapshot is not pinned here.
        if let Some(r) = status.rescale.as_mut() {
            r.step = Step::Done;
        }
        spec.restore_from = Some("s3://b/state/ns/other/savepoints/sp-1".into());
        assert!(in_use(&spec, &status, storage, "ns", "j").is_empty());
    }

    #[test]
    fn a_background_step_runs_until_its_outcome_arrives_or_its_thread_is_gone() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let mut bg = Background {
            work: BackgroundWork::Verify { url: "u".into() },
            rx,
            ended: None,
            restore: None,
        };
        assert!(bg.running());
        assert!(bg.running(), "asking again changes nothing");
        let corrupt = snapshot::SnapshotError::ManifestInconsistent {
            path: "sp-1".into(),
            reason: "corrupt block".into(),
        };
        assert!(tx.send(Ended::Verify(Err(corrupt))).is_ok());
        assert!(!bg.running());
        assert!(!bg.running(), "the outcome is kept");
        assert!(matches!(
            bg.ended,
            Some(Some(Ended::Verify(Err(ref e)))) if e.to_string().contains("corrupt block")
        ));

        let (tx, rx) = tokio::sync::oneshot::channel::<Ended>();
        let mut bg = Background {
            work: BackgroundWork::Checkpoint { parallelism: 2 },
            rx,
            ended: None,
            restore: None,
        };
        drop(tx); // the thread panicked
        assert!(!bg.running());
        assert!(matches!(bg.ended, Some(None)));
    }
}
