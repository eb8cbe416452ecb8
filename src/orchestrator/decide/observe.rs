//! What the operator observes of a job: its pods (phase, run, readiness), its active run, a pending
//! restore; and what the pods say (a failed run, an adoptable one, pods still terminating).

use super::*;

/// The phase of a pod as far as the operator cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodPhase {
    Pending,
    Running,
    /// Exited (Succeeded or Failed): a worker never exits on its own while its job runs.
    Exited,
    Unknown,
}

impl PodPhase {
    pub fn parse(phase: Option<&str>) -> PodPhase {
        match phase {
            Some("Pending") | None => PodPhase::Pending,
            Some("Running") => PodPhase::Running,
            Some("Succeeded" | "Failed") => PodPhase::Exited,
            Some(_) => PodPhase::Unknown,
        }
    }
}

/// A worker pod of the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedPod {
    pub name: String,
    pub run: String,
    pub subtask: u32,
    pub parallelism: u32,
    pub phase: PodPhase,
    pub ip: Option<String>,
    /// Has a deletion timestamp.
    pub deleting: bool,
    /// The deletion timestamp: when the pod's grace period ends and its kubelet must have
    /// stopped it.
    pub grace_deadline: Option<Timestamp>,
    /// The worker's own state from its control API; `None` when it was not asked or did not
    /// answer.
    pub worker: Option<WorkerState>,
    /// The spec hash (`spec_hash`) the pod was created for; `None` for pods without the label.
    pub spec_hash: Option<String>,
    /// Why the scheduler cannot place the pod (its PodScheduled condition is False with reason
    /// Unschedulable: no node has room, or none fits its constraints).
    pub unschedulable: Option<String>,
}

/// The run the operator currently coordinates (its coordinator is in memory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActiveRun {
    pub run: String,
    pub parallelism: u32,
}

/// Everything a decision depends on besides spec and status.
#[derive(Debug, Clone)]
pub struct Observed {
    pub now: Timestamp,
    pub pods: Vec<ObservedPod>,
    pub active: Option<ActiveRun>,
    /// When the latest snapshot of the running job completed, or the run started.
    pub last_snapshot_at: Option<Timestamp>,
    /// No new attempt (restart, rescale) before this time (backoff after a failure).
    pub backoff_until: Option<Timestamp>,
    /// No new attempt at a key-group change before this time (one rolled back: a rewrite
    /// costs the whole state, and what made it fail rarely goes away at once).
    pub change_retry_at: Option<Timestamp>,
    /// A fresh run id, used when new pods must be created and no run exists.
    pub new_run: String,
    /// metadata.name of the job (for messages that name commands).
    pub name: String,
    /// spec.restoreFrom when it differs from status.restoredFrom (not yet acted on): the
    /// snapshot's key-group count as read from its manifest, or why it cannot be used (reason,
    /// message).
    pub pending_restore: Option<Result<PendingRestore, (Reason, String)>>,
    /// Why the job's changed spec.job must not be applied to the state of its running workers
    /// (reason, message; see [`run::restore_refusal`](super::run::restore_refusal)): the
    /// upgrade is not begun, and the job keeps running and checkpointing under its old logic.
    pub upgrade_refused: Option<(Reason, String)>,
    /// Why the last start of this very spec was refused for good: no run is started until the
    /// spec changes (the shell forgets the refusal then), or, for a refusal of one parallelism
    /// (a rescale that rolled back), no run at that parallelism.
    pub start_refused: Option<StartRefusal>,
    /// A StreamJobSnapshot (its name) waiting for a savepoint of the running job: the
    /// platform's oldest such request, `None` when there is none (or no such resource, as in
    /// local mode).
    pub savepoint_request: Option<String>,
}

/// A start refused for good ([`Observed::start_refused`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartRefusal {
    pub reason: Reason,
    pub message: String,
    /// The parallelism refused (a rescale's new one: the job runs on at its old one), or `None`:
    /// any start.
    pub parallelism: Option<u32>,
}

impl Observed {
    /// Whether a start at `parallelism` was refused for good under this spec.
    pub fn refuses_start_at(&self, parallelism: u32) -> bool {
        self.start_refused
            .as_ref()
            .is_some_and(|r| r.refuses(parallelism))
    }
}

impl StartRefusal {
    /// Whether it refuses a start at `parallelism`.
    pub fn refuses(&self, parallelism: u32) -> bool {
        self.parallelism.is_none_or(|p| p == parallelism)
    }

    /// The Stalled message while the job runs on at `running` (the refused change's old
    /// parallelism, or an upgrade's).
    pub fn running_message(&self, running: u32) -> String {
        format!(
            "{}. The job runs on at parallelism {running}; no retry can change that: it changes again once its spec changes",
            self.message
        )
    }

    /// The Stalled message once no run is up: for a refused change of a running job, its run
    /// has ended since, and the start it would need is the refused one.
    pub fn stopped_message(&self) -> String {
        match self.parallelism {
            Some(p) => format!(
                "{}. The job's run has ended since, and a start at parallelism {p} is refused the same way: no retry can change that; it starts again once its spec changes",
                self.message
            ),
            None => self.message.clone(),
        }
    }
}

/// A spec.restoreFrom the job has not been started from yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingRestore {
    pub url: String,
    /// maxParallelism of its manifest: the job's ceiling once restored.
    pub max_parallelism: u32,
}

/// Where a starting run restores from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Restore {
    /// The newest committed snapshot of the job, or spec.restoreFrom when the job has none
    /// recorded in status yet (the shell resolves it).
    Latest,
    /// This snapshot (a rescale's savepoint).
    Url(String),
    /// Nothing: empty state (a `stateless` upgrade).
    Empty,
}

/// How a pod is on its way out, if it is: "is being deleted" or "exited".
pub(super) fn leaving(q: &ObservedPod) -> Option<&'static str> {
    if q.deleting {
        Some("is being deleted")
    } else if q.phase == PodPhase::Exited {
        Some("exited")
    } else {
        None
    }
}

/// Why the active run is broken, if it is.
pub(super) fn run_failure(pods: &[ObservedPod], active: &ActiveRun) -> Option<String> {
    let mut mine: BTreeMap<u32, &ObservedPod> = BTreeMap::new();
    for p in pods.iter().filter(|p| p.run == active.run) {
        mine.insert(p.subtask, p);
    }
    for i in 0..active.parallelism {
        match mine.get(&i) {
            None => return Some(format!("the pod of subtask {i} is gone")),
            Some(p) if p.deleting => {
                return Some(format!("pod {} of subtask {i} is being deleted", p.name));
            }
            Some(p) if p.phase == PodPhase::Exited => {
                return Some(format!("the worker of subtask {i} (pod {}) exited", p.name));
            }
            Some(p) if p.phase == PodPhase::Running && p.worker == Some(WorkerState::Idle) => {
                return Some(format!(
                    "the worker of subtask {i} (pod {}) restarted and lost its state",
                    p.name
                ));
            }
            Some(_) => {}
        }
    }
    None
}

/// Pods of one run whose workers all run (or are stopped at a savepoint): `(run, parallelism)`.
pub(super) fn adoptable(pods: &[ObservedPod]) -> Option<(String, u32)> {
    let first = pods.first()?;
    let run = &first.run;
    let parallelism = first.parallelism;
    if parallelism == 0 || pods.len() != parallelism as usize {
        return None;
    }
    let mut seen = vec![false; parallelism as usize];
    for p in pods {
        if &p.run != run
            || p.parallelism != parallelism
            || p.deleting
            || p.phase != PodPhase::Running
            || p.ip.is_none()
            || !matches!(p.worker, Some(WorkerState::Running | WorkerState::Stopped))
        {
            return None;
        }
        match seen.get_mut(p.subtask as usize) {
            Some(s) if !*s => *s = true,
            _ => return None,
        }
    }
    Some((run.clone(), parallelism))
}

/// How long a terminating pod may be past its grace period before the status points at it.
pub(super) const OVERDUE_SECONDS: i64 = 30;

/// The wait for terminating pods, naming the one furthest past its grace period when that is
/// over [`OVERDUE_SECONDS`]: a pod whose node is down stays terminating until someone removes
/// it, and the operator never force-deletes (the pod's process may still run).
pub(super) fn waiting_for_termination(pods: &[ObservedPod], now: Timestamp) -> String {
    let terminating: Vec<&ObservedPod> = pods.iter().filter(|p| p.deleting).collect();
    let mut reason = format!("waiting for {} old pod(s) to terminate", terminating.len());
    let overdue = terminating
        .iter()
        .filter_map(|p| Some((p, now.duration_since(p.grace_deadline?).as_secs())))
        .filter(|(_, late)| *late >= OVERDUE_SECONDS)
        .max_by_key(|(_, late)| *late);
    if let Some((p, late)) = overdue {
        reason.push_str(&format!(
            "; pod {name} is {late}s past its grace period (its node may be down or its kubelet \
             stuck). The operator does not force-delete pods: once the pod's process is known to \
             be stopped, `kubectl delete pod {name} --grace-period=0 --force` lets this go on",
            name = p.name
        ));
    }
    reason
}

/// Pods exist, none exited, and some are not yet up.
pub(super) fn starting(pods: &[ObservedPod]) -> bool {
    !pods.is_empty()
        && pods
            .iter()
            .all(|p| !p.deleting && p.phase != PodPhase::Exited)
}
