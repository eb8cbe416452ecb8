//! One pass of the orchestration, the same on every platform: observe the job's workers through
//! the [`Workers`] port, decide the one next action ([`decide::decide`], pure), execute it, and
//! return the status (phase and conditions by [`status::finish`]) and Events for the platform to
//! record. Long steps (snapshots, verification, a run's start) run in the background; the pass
//! after their end records their outcome. Every change of a transition's step goes through
//! [`Pass::transition`].

mod background;
pub mod error;
mod execute;
mod key_group_change;
mod prestage;
mod snapshots;
mod start;

use background::{Background, BackgroundWork, Ended, RestoreView, StartError, StartWork};
pub use error::{ErrorKind, PassError};

use super::decide::{self, Action, ActiveRun, ObservedPod, PodPhase, Restore};
use super::port::{PortError, Workers};
use super::run::{self, RandomError};
use super::settings::JobSettings;
use super::status::{self, Progress};
use crate::crd::{Phase, RescaleStatus, SnapshotRef, StreamJobSpec, StreamJobStatus, UpgradeMode};
use crate::failpoints;
use crate::operator::metrics::{OperatorMetrics, SnapshotLabels};
use crate::orchestrator::coordinator::{
    self, Completed, Coordinator, CoordinatorError, WorkerEndpoint,
};
use crate::runtime::protocol::{StartResponse, WorkerState, WorkerStatus};
use crate::snapshot::{self, JobIdentity, SnapshotKind};
use crate::snapshot::{InUseEntry, InUseMarker};
use crate::validation;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use keyshift_core::keygroup::{self, Assignment};
use keyshift_core::reason::Reason;
use keyshift_core::step::{self, Outcome, Step};
use keyshift_core::text;
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

/// How often, at most, status shows a new value of a running Kafka source's lag (each is a
/// status write; the workers' own metrics are live).
pub const SOURCE_LAG_EVERY: Duration = Duration::from_secs(30);

/// The run the orchestrator coordinates for a job.
pub struct RunHandle {
    run: String,
    parallelism: u32,
    coordinator: Coordinator,
    started: Timestamp,
    /// The spec hash ([`settings::spec_hash`]) its workers were created for, when known.
    spec_hash: Option<String>,
}

/// What the orchestrator remembers about a job between passes (lost on restart by design:
/// status and the workers carry everything needed to resume).
#[derive(Default)]
pub struct JobMemory {
    run: Option<RunHandle>,
    failures: u32,
    backoff_until: Option<Timestamp>,
    /// No key-group rewrite before this time (one rolled back).
    change_retry_at: Option<Timestamp>,
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
    /// A start refused for good ([`StartError::refuses_for_good`]): the spec it was refused for
    /// ([`refusal_key`]) and the refusal. No run (or none at the refused parallelism) is started
    /// again until the spec changes.
    start_refused: Option<(String, decide::StartRefusal)>,
    /// Snapshots of the job's own history that a restore found it cannot restore (a block that
    /// does not match its checksum, which no listing can tell), by URL, with why: later resumes
    /// pass over them ([`run::latest_restorable`]). A new leader tries each once more.
    unrestorable: std::collections::BTreeMap<String, String>,
}

/// A refusal as status.startRefused keeps it (`None` for a reason this build does not know).
fn refusal_from_status(
    s: &crate::crd::StartRefusedStatus,
) -> Option<(String, decide::StartRefusal)> {
    Some((
        s.spec_hash.clone(),
        decide::StartRefusal {
            reason: Reason::parse(&s.reason)?,
            message: s.message.clone(),
            parallelism: s.parallelism.and_then(|p| u32::try_from(p).ok()),
        },
    ))
}

/// status.startRefused for a remembered refusal.
fn refusal_status((key, r): &(String, decide::StartRefusal)) -> crate::crd::StartRefusedStatus {
    crate::crd::StartRefusedStatus {
        spec_hash: key.clone(),
        reason: r.reason.as_str().to_owned(),
        message: r.message.clone(),
        parallelism: r.parallelism.and_then(|p| i32::try_from(p).ok()),
    }
}

/// What a refusal is remembered for: the whole spec (any edit of it ends the refusal, the
/// edit that fixes it or any other: a retry then tells).
fn refusal_key(spec: &StreamJobSpec) -> String {
    keyshift_core::hash::fnv(serde_json::to_string(spec).unwrap_or_default().as_bytes())
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

    /// The coordinated run's id.
    pub fn run_id(&self) -> Option<&str> {
        self.run.as_ref().map(|r| r.run.as_str())
    }

    /// The coordinated run's parallelism and coordinator.
    pub fn coordinator(&mut self) -> Option<&mut Coordinator> {
        self.run.as_mut().map(|r| &mut r.coordinator)
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
    /// A StreamJobSnapshot (its name) waiting for a savepoint of the running job
    /// ([`decide::Observed::savepoint_request`]).
    pub savepoint_request: Option<String>,
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
        savepoint_request,
    } = input;
    let Shell {
        workers,
        metrics,
        http,
    } = shell;
    // The spec as this pass acts on it, read once.
    let settings = JobSettings::read(spec);
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
    failpoints::pause_at_step(name, status0.rescale.as_ref().map(|r| r.step));
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
    let mut prestage_endpoints = HashMap::new();
    let mut run_groups = HashMap::new();
    // A pre-staged rescale's new workers are kept apart until they are the job's run.
    let beside = status0.rescale.as_ref().and_then(beside_the_job);
    for l in listed {
        if let Some(g) = l.max_parallelism {
            run_groups.insert(l.pod.run.clone(), g);
        }
        if let Some(e) = &l.endpoint {
            if beside == Some(l.pod.run.as_str()) {
                prestage_endpoints.insert(l.pod.subtask, e.clone());
            } else if run_matches(mem, &l.pod.run) {
                endpoints.insert(l.pod.subtask, e.clone());
            }
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
                Some(control) => worker_state(http, &control, token).await,
                None => None,
            }
        }
    }))
    .await;
    // The source lag the coordinated run's workers measured (a Kafka source), by subtask.
    let mut lags: Vec<(u32, crate::runtime::protocol::SourceLag)> = Vec::new();
    let mut pods: Vec<ObservedPod> = pods
        .into_iter()
        .zip(states)
        .map(|((mut p, _), state)| {
            p.worker = state.as_ref().map(|s| s.state);
            if let Some(lag) = state.and_then(|s| s.source_lag)
                && mem.run.as_ref().is_some_and(|r| r.run == p.run)
            {
                lags.push((p.subtask, lag));
            }
            p
        })
        .collect();
    pods.sort_by(|a, b| (a.run.as_str(), a.subtask).cmp(&(b.run.as_str(), b.subtask)));

    let now = Timestamp::now();
    let last_snapshot_at =
        decide::last_snapshot_at(&status0, mem.run.as_ref().map(|r| r.started), now);
    let pending_restore = pending_restore(spec, &status0, mem, (&storage, namespace, name)).await;
    let upgrade_refused = upgrade_refusal(spec, &settings, mem, (namespace, name));
    // A refusal recorded in status by an earlier process (a restart, another leader) holds as
    // if this process had seen it.
    if mem.start_refused.is_none() {
        mem.start_refused = status0.start_refused.as_ref().and_then(refusal_from_status);
    }
    if mem
        .start_refused
        .as_ref()
        .is_some_and(|(key, ..)| *key != refusal_key(spec))
    {
        mem.start_refused = None;
    }
    let obs = decide::Observed {
        start_refused: mem.start_refused.as_ref().map(|(_, r)| r.clone()),
        savepoint_request: savepoint_request.clone(),
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
        change_retry_at: mem.change_retry_at,
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
        settings: &settings,
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
        prestage_endpoints,
        pending: obs.pending_restore.clone().and_then(Result::ok),
        run_groups,
        events: Vec::new(),
    };
    // status.restore is the restore running now: none runs while a pass does.
    pass.status.restore = None;
    let requeue = match background {
        Some(bg) => pass.record_background(bg).await,
        None => {
            let action = decide::decide_with(spec, &settings, &status0, &obs);
            tracing::debug!(job = %name, ?action, "decided");
            let pinned = matches!(action, Action::PinMaxParallelism { .. });
            let mut requeue = pass.execute(action).await;
            // Pinning the key-group count only changes status. When what follows only changes
            // status as well (a new suspended job is Suspended), it is done in the same pass and
            // written with it; anything that acts (creates workers, ...) waits for the pin to be
            // recorded.
            if pinned && requeue.is_ok() {
                let next = decide::decide_with(spec, &settings, &pass.status, &obs);
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
    if let Some((reason, message)) = upgrade_refused
        .or_else(|| upgrade_refusal(spec, pass.settings, pass.mem, (namespace, name)))
    {
        pass.stall(reason, message);
    }
    // A rescale or upgrade refused for good while the job ran (rolled back or abandoned): the
    // job runs on and is stalled on the change until the spec changes. (A refusal of any start
    // leaves a run that is up, an adopted one, alone.)
    if let Some(running) = pass.mem.run.as_ref().map(|r| r.parallelism)
        && let Some((_, refusal)) = pass.mem.start_refused.clone()
        && refusal.parallelism.is_some()
    {
        pass.stall(refusal.reason, refusal.running_message(running));
    }
    let mut requeue = requeue?;
    // A running Kafka source's lag reaches status at least this often.
    if spec.job.source.kafka.is_some() && pass.mem.coordinating() {
        requeue = requeue.min(SOURCE_LAG_EVERY);
    }
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
    pass.observe_kafka(&lags, recording);
    pass.status.start_refused = pass.mem.start_refused.as_ref().map(refusal_status);
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
    let prefix = format!("{}/", snapshot::job_url(storage, namespace, name));
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
        pin(
            r.rewritten.as_ref(),
            format!("the rewrite of a key-group change of {namespace}/{name}"),
        );
        pin(
            r.prestaged().and_then(|p| p.base.as_ref()),
            format!("what the pre-staged workers of {namespace}/{name} loaded"),
        );
    }
    // While a key-group change can be undone, its original savepoint is what undoing restores.
    if let Some(c) = status
        .key_group_change
        .as_ref()
        .filter(|c| c.point_of_no_return.is_none())
    {
        pin(
            Some(&c.original_savepoint),
            format!(
                "the original savepoint of the change to {} key groups (reversible until the first checkpoint after it)",
                c.to_max_parallelism
            ),
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
    reason: Reason,
    message: &str,
) -> StreamJobStatus {
    let mut status = status.clone();
    let progress = Progress {
        stalled: Some((reason.into(), message.to_owned())),
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

/// The Event of a transition whose new run is up: its reason (`suspended`: the run is a
/// suspend's, with no workers) and its message, what moved and how long each step took.
fn transition_finished(
    r: &RescaleStatus,
    rolled_back: bool,
    suspended: bool,
    bytes_read: i64,
) -> (Reason, String) {
    let reason = match (suspended, rolled_back, r.upgrade_mode) {
        (true, ..) => Reason::Suspended,
        (false, true, _) => Reason::RescaleRolledBack,
        (false, false, None) => Reason::Rescaled,
        (false, false, Some(_)) => Reason::Upgraded,
    };
    let message = format!(
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
        bytes_read,
        step_times(r),
        prestage::prestage_summary(r)
    );
    (reason, message)
}

struct Pass<'a> {
    workers: &'a mut dyn Workers,
    metrics: &'a OperatorMetrics,
    spec: &'a StreamJobSpec,
    /// `spec` as this pass read it.
    settings: &'a JobSettings,
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
    /// Those of a pre-staged rescale's new workers while they run beside the job.
    prestage_endpoints: HashMap<u32, WorkerEndpoint>,
    /// The spec.restoreFrom not yet acted on, when its manifest could be read.
    pending: Option<decide::PendingRestore>,
    /// The key-group count each run's workers were created under, by run.
    run_groups: HashMap<String, u32>,
    /// Events of this pass, published when it ends (beside the status write, not before it).
    events: Vec<PendingEvent>,
}

/// The run of a pre-staged rescale's new workers while they are not (or will not become) the
/// job's run: before the old workers are gone, or once the rescale fell back or ended without
/// them. Pure.
fn beside_the_job(r: &RescaleStatus) -> Option<&str> {
    let the_job = r.fallback.is_none() && matches!(r.step, Step::Restoring | Step::Done);
    r.prestage_run().filter(|_| !the_job)
}

/// The endpoints of subtasks `0..parallelism` in `by_subtask`, if every one has them.
fn endpoints_of(
    by_subtask: &HashMap<u32, WorkerEndpoint>,
    parallelism: u32,
) -> Option<Vec<WorkerEndpoint>> {
    (0..parallelism)
        .map(|i| by_subtask.get(&i).cloned())
        .collect()
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
        time: Timestamp::now().to_string(),
        parallelism: parallelism as i32,
        size_bytes: Some(c.manifest.stats.total_bytes as i64),
        source_partitions: (!c.manifest.source_partitions.is_empty())
            .then(|| i32::try_from(c.manifest.source_partitions.len()).unwrap_or(i32::MAX)),
        snapshot: None,
    }
}

/// How long the job waits after `failures` failed passes in a row: [`crate::backoff::pass_failure`]
/// (1 s doubling to 64 s, jittered), as a time to add to now.
fn backoff(failures: u32) -> SignedDuration {
    let wait = crate::backoff::pass_failure(failures);
    SignedDuration::try_from(wait).unwrap_or(SignedDuration::from_secs(128))
}

/// Why restoring the job's own snapshot at `url` would go back past sink output already
/// published ([`run::going_back_refusal`]), asking `coordinator`'s sink how far it published.
/// An error when the sink (or the snapshot's manifest) cannot be read: it cannot be decided, so
/// nothing starts.
/// (The savepoint a running job stops with before such a restore publishes nothing:
/// [`Coordinator::hold_output_of_next_snapshot`].)
async fn going_back(
    spec: &StreamJobSpec,
    url: &str,
    coordinator: &Coordinator,
) -> Result<Option<(Reason, String)>, CoordinatorError> {
    if !coordinator.publishes() {
        return Ok(None);
    }
    let published = coordinator.published_through().await?;
    if published.is_none() {
        return Ok(None);
    }
    let id = snapshot::open_snapshot(url).await?.2.snapshot_id;
    Ok(run::going_back_refusal(
        url,
        id,
        published,
        &sink_name(spec),
        spec,
    ))
}

/// How a refusal names the job's sink: its URL, or its Kafka topic.
fn sink_name(spec: &StreamJobSpec) -> String {
    let sink = &spec.job.sink;
    match (&sink.url, &sink.kafka) {
        (Some(url), _) => format!("the sink {url}"),
        (None, Some(k)) => format!("the Kafka topic {}", k.topic),
        (None, None) => "the sink".to_owned(),
    }
}

/// spec.restoreFrom when the job has not been started from it yet: its manifest's key-group
/// count, or why it cannot be read. A failed read is not cached (the snapshot may appear).
async fn pending_restore(
    spec: &StreamJobSpec,
    status: &StreamJobStatus,
    mem: &mut JobMemory,
    (storage, namespace, name): (&str, &str, &str),
) -> Option<Result<decide::PendingRestore, (Reason, String)>> {
    let url = spec.restore_from.as_ref()?;
    if status.restored_from.as_ref() == Some(url) {
        return None;
    }
    // The platform puts a StreamJobSnapshot's URL in place of its name once it is Ready; a
    // name left here names none that is.
    if let validation::RestoreSource::Snapshot(snapshot) = validation::restore_source(url) {
        return Some(Err((
            Reason::SnapshotNotReady,
            format!(
                "spec.restoreFrom names the StreamJobSnapshot {snapshot}, which does not exist or is not Ready (`kubectl get streamjobsnapshot {snapshot}` says why); the job restores from it once it is Ready; nothing was stopped"
            ),
        )));
    }
    let cached = mem
        .restore_source
        .as_ref()
        .filter(|(cached, ..)| cached == url)
        .map(|(_, g, id)| (*g, id.clone()));
    let (groups, identity) = match cached {
        Some(found) => found,
        None => match snapshot::restore_source(url, storage, namespace).await {
            Ok((g, id)) => {
                mem.restore_source = Some((url.clone(), g, id.clone()));
                (g, id)
            }
            Err(e) => {
                return Some(Err((
                    Reason::RestoreFromUnusable,
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
    // A restore of the job's own snapshot behind the output its running sink published: said
    // before anything stops (without a running job the start says it, and nothing is stopped).
    if identity.is(namespace, name)
        && !spec.allow_republishing_output
        && let Some(run) = mem.run.as_ref()
    {
        match going_back(spec, url, &run.coordinator).await {
            Ok(None) => {}
            Ok(Some((reason, message))) => {
                return Some(Err((reason, format!("{message}; nothing was stopped"))));
            }
            // Cannot be decided now (the sink or the manifest unreadable): the start decides.
            Err(e) => {
                tracing::warn!(job = %name, error = %e, "cannot tell whether spec.restoreFrom goes back past published sink output; the start checks it again")
            }
        }
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
    settings: &JobSettings,
    mem: &JobMemory,
    (namespace, name): (&str, &str),
) -> Option<(Reason, String)> {
    let r = mem.run.as_ref()?;
    let changed = r
        .spec_hash
        .as_ref()
        .is_some_and(|h| *h != settings.spec_hash);
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
            .get_or_create(&OperatorMetrics::step(&self.ns, &self.name, r.step))
            .observe(secs);
        tracing::info!(job = %self.name, from = %r.step, to = %next, ?outcome, "step");
        r.step = next;
        self.mem.step_started = next.active().then_some((next, now));
        Ok(())
    }

    /// The spec cannot be carried out: Stalled with `reason`/`message`, and a warning Event
    /// when the message is new.
    fn stall(&mut self, reason: Reason, message: String) {
        let previous = self
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == status::STALLED)
            .is_some_and(|c| c.status == "True" && c.message == message);
        if !previous {
            self.event(true, reason, message.clone());
        }
        self.progress.stalled = Some((reason.into(), message));
    }

    fn fail(&mut self, reason: Reason, message: String) {
        self.mem.failures += 1;
        self.mem.backoff_until = Some(Timestamp::now() + backoff(self.mem.failures));
        self.mem.last_failure = Some((reason.into(), message.clone()));
        self.progress.failure = Some((reason.into(), message));
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
            r.step == Step::Restoring
                && r.rolled_back.is_none()
                && (r.restore_from.is_some() || r.rewritten.is_some())
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
        if !run::publishes_sink(self.spec) {
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
                Reason::SinkPublishBehind,
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

    /// For a job with a Kafka source or sink: status.source.lag from the coordinated run's
    /// workers (`lags`, by subtask; kept from the last pass when this pass asked no worker),
    /// and which Kafka clients cannot reach their brokers (the KafkaReachable condition).
    fn observe_kafka(
        &mut self,
        lags: &[(u32, crate::runtime::protocol::SourceLag)],
        asked_none: bool,
    ) {
        let has_source = self.spec.job.source.kafka.is_some();
        let has_sink = self.spec.job.sink.sink_type == crate::crd::SinkType::Kafka;
        // The failure being retried, when a Kafka client's (a worker's at-least-once sink, a
        // source that could not list its partitions at its start).
        let failed = self
            .mem
            .last_failure
            .as_ref()
            .and_then(|(_, m)| status::kafka_failure(m));
        if !self.mem.coordinating() {
            self.status.source = None;
            if (has_source || has_sink)
                && let Some(f) = failed
            {
                self.progress.kafka = Some(vec![f]);
            }
            return;
        }
        if has_source && !asked_none {
            let measured: Vec<_> = lags.iter().map(|(_, l)| l).collect();
            self.status.source = Some(crate::crd::SourceStatus {
                lag: status::source_lag(&measured),
            });
        }
        if !has_source && !has_sink {
            return;
        }
        #[cfg(feature = "kafka")]
        let publisher = self
            .mem
            .run
            .as_ref()
            .and_then(|r| r.coordinator.kafka_sink_error());
        #[cfg(not(feature = "kafka"))]
        let publisher: Option<String> = None;
        let lags: Vec<(u32, &crate::runtime::protocol::SourceLag)> =
            lags.iter().map(|(i, l)| (*i, l)).collect();
        let mut outages = status::kafka_outages(&lags, publisher.as_deref());
        outages.extend(failed);
        if asked_none && outages.is_empty() {
            // Nothing new about the workers: the condition stays as it is.
            return;
        }
        self.progress.kafka = Some(outages);
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
            snapshot::write_in_use(store.as_ref(), &job_dir, &marker)
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

    /// The coordinator of a run of this job with these workers. The credentials of the Kafka
    /// sink's publisher (which runs beside the coordinator) are read from the platform first.
    async fn coordinator(
        &mut self,
        assignment: Assignment,
        endpoints: Vec<WorkerEndpoint>,
        identity: JobIdentity,
        failed: fn(CoordinatorError) -> PassError,
    ) -> Result<Coordinator, PassError> {
        let sink_credentials = match self
            .spec
            .job
            .sink
            .kafka
            .as_ref()
            .and_then(|k| k.credentials.as_ref())
        {
            Some(creds) => self
                .workers
                .kafka_credentials(crate::job::kafka::Role::Sink, creds)
                .await
                .map_err(PassError::Credentials)?,
            None => crate::job::kafka::Credentials::default(),
        };
        let (spec, storage, token) = (self.spec, self.storage.clone(), self.token.clone());
        run::coordinator(
            spec,
            &storage,
            identity,
            assignment,
            endpoints,
            token,
            &sink_credentials,
        )
        .await
        .map_err(failed)
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
            let newest = snapshot::newest_snapshot(&storage, &ns, &name, None, None).await?;
            Ok(newest.found.map_or(own, |(_, info)| info.job))
        }
    }

    fn endpoints(&self, parallelism: u32) -> Option<Vec<WorkerEndpoint>> {
        endpoints_of(&self.endpoints, parallelism)
    }

    fn set_running(&mut self, parallelism: u32) -> Result<(), PassError> {
        self.status.replicas = Some(parallelism as i32);
        self.progress.phase = Some(Phase::Running);
        self.status.key_groups = Some(status::key_groups(self.assignment(parallelism)?));
        Ok(())
    }

    fn event(&mut self, warning: bool, reason: Reason, note: String) {
        self.events.push(PendingEvent {
            warning,
            reason: reason.into(),
            note,
        });
    }

    /// Removes every worker of the job that is not on its way out already; ends the run.
    async fn delete_all(&mut self) -> Result<usize, PassError> {
        let n = self.delete_where(|_| true).await?;
        self.mem.run = None;
        Ok(n)
    }

    /// Removes the workers `which` selects that are not on their way out already; how many
    /// (a run's coordinator, if any, is left to the caller).
    async fn delete_where(
        &mut self,
        which: impl Fn(&ObservedPod) -> bool,
    ) -> Result<usize, PassError> {
        let names: Vec<String> = self
            .pods
            .iter()
            .filter(|p| !p.deleting && which(p))
            .map(|p| p.name.clone())
            .collect();
        if !names.is_empty() {
            self.workers
                .delete(&names)
                .await
                .map_err(PassError::Delete)?;
        }
        Ok(names.len())
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
