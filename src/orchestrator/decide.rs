//! Pure: from what the operator observes (spec, status, pods, worker states) to the one next
//! action. The I/O shell (`reconcile`) executes the action and records its outcome in status;
//! the step of a rescale is always in status before the step acts, so a restarted operator
//! resumes from status.

use crate::crd::{RescaleStatus, RescaleStrategy, StreamJobSpec, StreamJobStatus, UpgradeMode};
use crate::runtime::protocol::WorkerState;
use crate::validation::{self, Analysis};
use chrono::{DateTime, Utc};
use keyshift_core::reason::Reason;
use keyshift_core::step::{Outcome, Step};
use std::collections::BTreeMap;
use std::time::Duration;

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
    pub grace_deadline: Option<DateTime<Utc>>,
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
    pub now: DateTime<Utc>,
    pub pods: Vec<ObservedPod>,
    pub active: Option<ActiveRun>,
    /// When the latest snapshot of the running job completed, or the run started.
    pub last_snapshot_at: Option<DateTime<Utc>>,
    /// No new attempt (restart, rescale) before this time (backoff after a failure).
    pub backoff_until: Option<DateTime<Utc>>,
    /// No new attempt at a key-group change before this time (one rolled back: a rewrite
    /// costs the whole state, and what made it fail rarely goes away at once).
    pub change_retry_at: Option<DateTime<Utc>>,
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

/// The one next thing to do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// The spec cannot be run as is: say so (Stalled), leave the workers as they are.
    Stall { reason: Reason, message: String },
    /// Record the key-group count (and where it came from) in status before anything is
    /// snapshotted.
    PinMaxParallelism { groups: u32, origin: String },
    /// Record a new rescale in status (step Savepointing; with `prestage`, the run id of its
    /// new workers, step Prestaging); nothing else happens in this pass.
    BeginRescale {
        from: u32,
        to: u32,
        prestage: Option<String>,
    },
    /// Pre-stage the new workers of run `run` (all running and idle or pre-staged) beside the
    /// running job: they load their key groups from its newest checkpoint and catch up (in the
    /// background); on success record step Savepointing.
    Prestage { run: String, parallelism: u32 },
    /// A pre-staged rescale cannot use its new workers: record why (status.rescale.fallback)
    /// and go on as a stop-and-restore.
    FallBack { message: String },
    /// Delete the pods of run `run` only (a pre-staged rescale's new workers that are not
    /// used).
    DeleteRun { run: String, reason: Reason },
    /// Delete every pod of the job except those of run `keep` (the Stopping step of a
    /// pre-staged rescale: the old workers go, the new ones stay).
    DeleteAllBut { keep: String },
    /// spec.job or spec.image changed: record an upgrade at the same parallelism in status
    /// (step Savepointing for `savepoint`, Stopping otherwise).
    BeginUpgrade { parallelism: u32, mode: UpgradeMode },
    /// spec.restoreFrom changed on a running job: record a transition (step Savepointing, so
    /// the current state is kept in a savepoint) whose new run restores `url` at `to`, under
    /// `max_parallelism` key groups.
    BeginRestore {
        from: u32,
        to: u32,
        url: String,
        max_parallelism: u32,
    },
    /// spec.maxParallelism differs from the pinned key-group count: record a key-group change
    /// from parallelism `from` to `to` under `groups` key groups. With the job `running`, its
    /// first step takes a savepoint; otherwise the newest snapshot is the one rewritten, and
    /// the change starts by verifying it.
    BeginKeyGroupChange {
        from: u32,
        to: u32,
        groups: u32,
        running: bool,
    },
    /// Rewrite savepoint `source` into `target` under `groups` key groups at `parallelism`
    /// (in the background); on success record step VerifyingRewrite.
    Rewrite {
        source: String,
        target: String,
        groups: u32,
        parallelism: u32,
    },
    /// Verify the rewritten savepoint `target` down to every key, and its key count against
    /// `source`'s; on success record step Restoring.
    VerifyRewrite { source: String, target: String },
    /// A key-group change cannot go on (or spec.maxParallelism was set back): restore the
    /// original savepoint at the old parallelism and key-group count.
    RollBackRewrite { message: String },
    /// Take a savepoint stopping the sources; on success record step Verifying with its URL.
    Savepoint,
    /// Verify the recorded savepoint; on success record step Stopping.
    Verify { url: String },
    /// Delete every pod of the job (stopping a run; a rescale's Stopping step).
    DeletePods { reason: Reason },
    /// A step's work is done (nothing ran in the background): record the step that follows.
    Advance(Outcome),
    /// Give up the rescale in flight: the job keeps (or returns to) its old parallelism.
    Abandon { message: String },
    /// Create the missing pods of a run.
    CreatePods {
        run: String,
        parallelism: u32,
        subtasks: Vec<u32>,
    },
    /// Pods are on their way (scheduled, starting, or workers booting).
    Wait { reason: String },
    /// Start the workers of a run whose pods are all running.
    Start {
        run: String,
        parallelism: u32,
        restore: Restore,
    },
    /// The workers of this run already run (operator restarted): coordinate them again.
    Adopt { run: String, parallelism: u32 },
    /// A worker of the running job failed: stop the run so it restarts from the last
    /// checkpoint.
    Recover { message: String },
    /// A rescale's new run is up: record step Done and the new parallelism.
    FinishRescale,
    /// Take a periodic checkpoint.
    Checkpoint,
    /// spec.savepointTriggerNonce differs from status.lastSavepointNonce: take a savepoint
    /// without stopping the job, then record the nonce.
    TriggerSavepoint { nonce: i64 },
    /// spec.suspend and nothing runs: record phase Suspended at parallelism 0.
    MarkSuspended,
    /// Nothing to do until this much time has passed (or something changes).
    Idle { requeue: Duration },
}

/// Why a spec cannot run: (reason, message) for the Stalled condition. `name` is the job's
/// metadata.name (the guidance names commands).
pub fn check_spec(
    name: &str,
    spec: &StreamJobSpec,
    status: &StreamJobStatus,
) -> Result<Analysis, (Reason, String)> {
    if let Some(pinned) = status.max_parallelism {
        // Another spec.maxParallelism is the ceiling the job moves to.
        let changing = spec.max_parallelism.is_some_and(|g| g != pinned);
        if spec.replicas > pinned && !changing {
            let context = validation::ceiling_context(name, spec, status, pinned);
            let mut message = validation::ceiling_guidance(&context);
            let suggested =
                keyshift_core::keygroup::suggested_max_parallelism(spec.replicas.max(1) as u32);
            if let Some(note) = status
                .last_checkpoint
                .iter()
                .chain(&status.last_savepoint)
                .filter_map(|s| s.size_bytes)
                .max()
                .and_then(|bytes| {
                    keyshift_core::keygroup::tiny_groups(suggested, bytes.max(0) as u64)
                })
            {
                message = format!("{message}. Note: {note}");
            }
            return Err((Reason::AboveKeyGroupCeiling, message));
        }
    }
    if let Err(e) = validation::validate(spec, Some(status)) {
        return Err((Reason::InvalidSpec, e.to_string()));
    }
    validation::analyse(spec, Some(status)).map_err(|e| {
        let reason = match e {
            validation::AnalysisError::AboveCeiling { .. } => Reason::AboveKeyGroupCeiling,
            validation::AnalysisError::StrictNonDivisor { .. } => Reason::StrictNonDivisor,
            validation::AnalysisError::Bounds(_) => Reason::InvalidSpec,
        };
        (reason, e.to_string())
    })
}

/// When the job's latest snapshot completed (or its run started), as far as this process can
/// trust it. Times in status come from whichever process wrote them; one later than `now` (a
/// previous leader whose clock ran ahead) is ignored, or it would hold checkpoints back until
/// this clock caught up with it. `run_started` is this process's own clock.
pub fn last_snapshot_at(
    status: &StreamJobStatus,
    run_started: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
) -> Option<DateTime<Utc>> {
    let parse = |t: &str| {
        DateTime::parse_from_rfc3339(t)
            .ok()
            .map(|t| t.with_timezone(&Utc))
    };
    [
        status.last_checkpoint.as_ref().and_then(|c| parse(&c.time)),
        status.last_savepoint.as_ref().and_then(|c| parse(&c.time)),
    ]
    .into_iter()
    .flatten()
    .filter(|t| *t <= now)
    .chain(run_started)
    .max()
}

/// The parallelism the spec asks for (0 while suspended).
pub fn desired_parallelism(spec: &StreamJobSpec) -> u32 {
    if spec.suspend {
        0
    } else {
        spec.replicas.max(1) as u32
    }
}

/// The checkpoint interval (default 30 s; never below 1 s).
pub fn checkpoint_interval(spec: &StreamJobSpec) -> Duration {
    keyshift_core::duration::parse_duration(&spec.state.checkpoint_interval)
        .unwrap_or(Duration::from_secs(30))
        .max(Duration::from_secs(1))
}

/// What the worker pods depend on besides their parallelism: the job and the image. Pods carry
/// it as a label; a running job whose pods carry another value is upgraded.
pub fn spec_hash(spec: &StreamJobSpec) -> String {
    keyshift_core::hash::fnv(
        serde_json::to_string(&(&spec.job, &spec.image))
            .unwrap_or_default()
            .as_bytes(),
    )
}

/// The parallelism a rescale restores: its target, or its origin once rolled back.
pub fn restore_target(r: &crate::crd::RescaleStatus) -> u32 {
    if r.rolled_back.is_some() {
        r.from.max(0) as u32
    } else {
        r.to.max(0) as u32
    }
}

/// Starting the new run of a rescale failed: the parallelism to roll back to (the old one,
/// restored from the same savepoint), or `None` to retry the same start with backoff (already
/// rolled back, or there is no old parallelism to return to).
pub fn rollback_on_restore_failure(r: &crate::crd::RescaleStatus) -> Option<u32> {
    (r.step == Step::Restoring
        && r.rolled_back.is_none()
        && r.from > 0
        && (r.from != r.to || r.rewrites()))
    .then_some(r.from as u32)
}

/// The status the spec is checked against: while a spec.restoreFrom is pending, its snapshot's
/// key-group count is the ceiling the job will run under.
pub fn effective_status(status: &StreamJobStatus, obs: &Observed) -> StreamJobStatus {
    let mut s = status.clone();
    if let Some(Ok(p)) = &obs.pending_restore {
        s.max_parallelism = Some(p.max_parallelism as i32);
    }
    s
}

/// Whether a pending restoreFrom can run with this spec: (reason, message) if not.
fn check_pending_restore(
    spec: &StreamJobSpec,
    pending: &Result<PendingRestore, (Reason, String)>,
) -> Result<(), (Reason, String)> {
    let p = pending.as_ref().map_err(Clone::clone)?;
    match spec.max_parallelism {
        Some(g) if g as u32 != p.max_parallelism => Err((
            Reason::RestoreFromKeyGroupMismatch,
            format!(
                "{}; nothing was stopped",
                validation::restore_from_mismatch(&p.url, p.max_parallelism, g)
            ),
        )),
        _ => Ok(()),
    }
}

/// What a spec.maxParallelism other than the pinned key-group count asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CeilingChange {
    /// Rewrite the job's state to `groups` key groups.
    Rewrite { groups: u32 },
    /// Undo the last change, which has not passed its point of no return: restore its
    /// original savepoint, under its `groups` key groups.
    Revert { url: String, groups: u32 },
}

/// The key-group change the spec asks for, if any (none while a spec.restoreFrom is pending:
/// that restore sets the count). Pure.
pub fn ceiling_change(spec: &StreamJobSpec, status: &StreamJobStatus) -> Option<CeilingChange> {
    let pinned = status.max_parallelism?;
    let g = spec.max_parallelism.filter(|g| *g != pinned && *g >= 1)?;
    match &status.key_group_change {
        Some(last)
            if last.point_of_no_return.is_none()
                && last.from_max_parallelism == g
                && last.to_max_parallelism == pinned =>
        {
            Some(CeilingChange::Revert {
                url: last.original_savepoint.clone(),
                groups: g as u32,
            })
        }
        _ => Some(CeilingChange::Rewrite { groups: g as u32 }),
    }
}

/// How long a key-group rewrite must still wait after one rolled back (an undo never waits).
fn change_wait(change: &CeilingChange, obs: &Observed) -> Option<Duration> {
    match change {
        CeilingChange::Revert { .. } => None,
        CeilingChange::Rewrite { .. } => obs
            .change_retry_at
            .filter(|t| *t > obs.now)
            .map(|t| (t - obs.now).to_std().unwrap_or(Duration::from_secs(1))),
    }
}

/// What to do next.
pub fn decide(spec: &StreamJobSpec, status: &StreamJobStatus, obs: &Observed) -> Action {
    let in_flight = status
        .rescale
        .as_ref()
        .is_some_and(|r| r.step.past_savepoint());
    if let Some(pending) = &obs.pending_restore
        && !in_flight
        && let Err((reason, message)) = check_pending_restore(spec, pending)
    {
        return Action::Stall { reason, message };
    }
    let pending = obs.pending_restore.as_ref().and_then(|p| p.as_ref().ok());
    let status0_unpinned = status.max_parallelism.is_none();
    let status = &effective_status(status, obs);
    let analysis = match check_spec(&obs.name, spec, status) {
        Ok(a) => Some(a),
        Err((reason, message)) => {
            // A rescale in flight past its savepoint must still finish (to its recorded target),
            // or the job would stay stopped; anything else waits for a fixed spec.
            match status.rescale.as_ref() {
                Some(r) if r.step.past_savepoint() => None,
                _ => return Action::Stall { reason, message },
            }
        }
    };
    if status0_unpinned && let Some(a) = &analysis {
        let origin = match pending {
            Some(p) => validation::ceiling_origin_snapshot(&p.url),
            None => validation::ceiling_origin(a.ceiling_source, spec.replicas),
        };
        return Action::PinMaxParallelism {
            groups: a.assignment.max_parallelism(),
            origin,
        };
    }

    if let Some(run) = status
        .rescale
        .as_ref()
        .and_then(|r| unused_prestage(r, obs))
    {
        return Action::DeleteRun {
            run,
            reason: Reason::PrestageFellBack,
        };
    }
    if let Some(r) = status.rescale.as_ref().filter(|r| r.step.active()) {
        return rescale_step(spec, r, obs);
    }
    let change = match pending {
        Some(_) => None,
        None => ceiling_change(spec, status),
    };

    let desired = desired_parallelism(spec);
    let backoff = obs.backoff_until.filter(|t| *t > obs.now).map(|t| {
        (t - obs.now)
            .to_std()
            .unwrap_or(Duration::from_secs(1))
            .max(Duration::from_millis(100))
    });

    if let Some(active) = &obs.active {
        if let Some(message) = run_failure(&obs.pods, active) {
            return Action::Recover { message };
        }
        if let Some(p) = pending
            && desired > 0
        {
            if let Some(requeue) = backoff {
                return Action::Idle { requeue };
            }
            return Action::BeginRestore {
                from: active.parallelism,
                to: desired,
                url: p.url.clone(),
                max_parallelism: p.max_parallelism,
            };
        }
        if let Some(change) = &change
            && desired > 0
        {
            if let Some(requeue) = backoff.or_else(|| change_wait(change, obs)) {
                return Action::Idle { requeue };
            }
            return match change {
                CeilingChange::Rewrite { groups } => Action::BeginKeyGroupChange {
                    from: active.parallelism,
                    to: desired,
                    groups: *groups,
                    running: true,
                },
                CeilingChange::Revert { url, groups } => Action::BeginRestore {
                    from: active.parallelism,
                    to: desired,
                    url: url.clone(),
                    max_parallelism: *groups,
                },
            };
        }
        if desired != active.parallelism {
            if let Some(requeue) = backoff {
                return Action::Idle { requeue };
            }
            let prestage = (spec.rescale_strategy == RescaleStrategy::Prestage && desired > 0)
                .then(|| obs.new_run.clone());
            return Action::BeginRescale {
                from: active.parallelism,
                to: desired,
                prestage,
            };
        }
        let want = spec_hash(spec);
        if obs.upgrade_refused.is_none()
            && obs
                .pods
                .iter()
                .any(|p| p.run == active.run && p.spec_hash.as_deref().is_some_and(|h| h != want))
        {
            if let Some(requeue) = backoff {
                return Action::Idle { requeue };
            }
            return Action::BeginUpgrade {
                parallelism: active.parallelism,
                mode: spec.upgrade_mode,
            };
        }
        if let Some(nonce) = spec.savepoint_trigger_nonce
            && status.last_savepoint_nonce != Some(nonce)
            && backoff.is_none()
        {
            return Action::TriggerSavepoint { nonce };
        }
        let interval = checkpoint_interval(spec);
        let due = obs.last_snapshot_at.map_or(obs.now, |t| {
            t + chrono::Duration::from_std(interval).unwrap_or_default()
        });
        if due <= obs.now {
            return Action::Checkpoint;
        }
        return Action::Idle {
            requeue: (due - obs.now).to_std().unwrap_or(interval).min(interval),
        };
    }

    // Not coordinating a run.
    if desired == 0 {
        if obs.pods.is_empty() {
            // Nothing runs: a job created (or left) suspended is Suspended, not Pending.
            if status.phase != Some(crate::crd::Phase::Suspended) || status.replicas != Some(0) {
                return Action::MarkSuspended;
            }
            return Action::Idle {
                requeue: Duration::from_secs(300),
            };
        }
        // Suspended without a savepoint to take (the workers never ran under this operator
        // process and are not running): remove them.
        return match adoptable(&obs.pods) {
            Some((run, parallelism)) => Action::Adopt { run, parallelism },
            None => Action::DeletePods {
                reason: Reason::Suspended,
            },
        };
    }
    if let Some(requeue) = backoff
        && obs.pods.is_empty()
    {
        return Action::Idle { requeue };
    }
    // Workers that still run from before an operator restart are adopted at whatever
    // parallelism they run at (a rescale follows if it differs).
    if let Some((run, parallelism)) = adoptable(&obs.pods) {
        return Action::Adopt { run, parallelism };
    }
    // A stopped job whose key-group count changed: its newest snapshot is rewritten before
    // anything runs. (Undoing a change that has not passed its point of no return rewrites the
    // newest snapshot back as well: it holds the same state as the original savepoint.)
    if let Some(change) = &change
        && obs.pods.is_empty()
        && change_wait(change, obs).is_none()
    {
        let (CeilingChange::Rewrite { groups } | CeilingChange::Revert { groups, .. }) = change;
        return Action::BeginKeyGroupChange {
            from: status.replicas.unwrap_or_default().max(0) as u32,
            to: desired,
            groups: *groups,
            running: false,
        };
    }
    let restore = match pending {
        Some(p) => Restore::Url(p.url.clone()),
        None => Restore::Latest,
    };
    let parallelism = recovery_parallelism(status, desired, pending.is_some());
    bring_up(&obs.pods, parallelism, restore, &obs.new_run, obs.now)
}

/// The parallelism a job that runs no coordinated run is brought up at: the desired one, except
/// after a rescale to it rolled back (that parallelism failed to restore) while the job still
/// ran at the rescale's old parallelism: then the old one, so that a crash does not keep the job
/// down while the new parallelism fails; the rescale begins again from the running job after
/// its backoff (savepoint, and a rollback if it fails again). A pending spec.restoreFrom is
/// started as asked (the job's own history is what it replaces). Pure.
pub fn recovery_parallelism(status: &StreamJobStatus, desired: u32, restoring_from: bool) -> u32 {
    match &status.rescale {
        Some(r)
            if !restoring_from
                && r.step == Step::RolledBack
                && r.upgrade_mode.is_none()
                && r.from > 0
                && r.to > 0
                && r.to as u32 == desired
                && status.replicas == Some(r.from) =>
        {
            r.from as u32
        }
        _ => desired,
    }
}

fn rescale_step(spec: &StreamJobSpec, r: &RescaleStatus, obs: &Observed) -> Action {
    // The old run's pods: never a pre-staged rescale's new workers.
    let old: Vec<ObservedPod> = match r.prestage_run() {
        Some(run) => obs.pods.iter().filter(|p| p.run != run).cloned().collect(),
        None => obs.pods.clone(),
    };
    match r.step {
        Step::Prestaging => prestaging(spec, r, obs, &old),
        Step::Savepointing => {
            if obs.active.is_some() {
                if let Some(active) = &obs.active
                    && let Some(message) = run_failure(&old, active)
                {
                    return Action::Abandon {
                        message: format!("a worker failed before the savepoint: {message}"),
                    };
                }
                // The job stops only once its pre-staged workers are all still there.
                if let Some(p) = r.prestaged() {
                    match prestage_ready(&obs.pods, &p.run, r.to.max(0) as u32) {
                        Readiness::Ready => {}
                        Readiness::Lost(why) => {
                            return Action::FallBack {
                                message: format!("{why} before the job stopped"),
                            };
                        }
                        Readiness::NotYet(why) => {
                            if let Some(message) = prestage_overdue(spec, p, obs.now, &why) {
                                return Action::FallBack { message };
                            }
                            return Action::Wait { reason: why };
                        }
                    }
                }
                return Action::Savepoint;
            }
            // The operator restarted in this step: coordinate the old workers again first.
            match adoptable(&old) {
                Some((run, parallelism)) => Action::Adopt { run, parallelism },
                None if starting(&old) => Action::Wait {
                    reason: "waiting for the workers to answer before the savepoint".into(),
                },
                None => Action::Abandon {
                    message: "the workers are not running, so no savepoint can be taken".into(),
                },
            }
        }
        Step::Verifying => match &r.savepoint {
            Some(url) => Action::Verify { url: url.clone() },
            None => Action::Abandon {
                message: "no savepoint was recorded for this rescale".into(),
            },
        },
        Step::Stopping if r.prestaged().is_some() => {
            let keep = r.prestage_run().unwrap_or_default().to_owned();
            if old.is_empty() {
                Action::Advance(Outcome::Stopped)
            } else if old.iter().all(|p| p.deleting) {
                Action::Wait {
                    reason: waiting_for_termination(&old, obs.now),
                }
            } else {
                Action::DeleteAllBut { keep }
            }
        }
        Step::Stopping => {
            if obs.pods.is_empty() {
                Action::Advance(if r.rewrites() {
                    Outcome::StoppedForRewrite
                } else {
                    Outcome::Stopped
                })
            } else if obs.pods.iter().all(|p| p.deleting) {
                Action::Wait {
                    reason: waiting_for_termination(&obs.pods, obs.now),
                }
            } else {
                Action::DeletePods {
                    reason: Reason::Stopping,
                }
            }
        }
        Step::Rewriting | Step::VerifyingRewrite => {
            if let Some(old) = r.from_max_parallelism
                && spec.max_parallelism == Some(old)
            {
                return Action::RollBackRewrite {
                    message: format!("spec.maxParallelism was set back to {old} during the change"),
                };
            }
            match (&r.savepoint, &r.rewritten, r.max_parallelism) {
                (Some(source), Some(target), Some(g)) if r.step == Step::Rewriting => {
                    Action::Rewrite {
                        source: source.clone(),
                        target: target.clone(),
                        groups: g.max(1) as u32,
                        parallelism: r.to.max(1) as u32,
                    }
                }
                (Some(source), Some(target), Some(_)) => Action::VerifyRewrite {
                    source: source.clone(),
                    target: target.clone(),
                },
                _ => Action::RollBackRewrite {
                    message: "no savepoint, rewrite target or key-group count was recorded for this change".into(),
                },
            }
        }
        Step::Restoring => {
            let to = restore_target(r);
            if to == 0 {
                return Action::FinishRescale;
            }
            if obs.pods.is_empty()
                && let Some(t) = obs.backoff_until.filter(|t| *t > obs.now)
            {
                return Action::Idle {
                    requeue: (t - obs.now).to_std().unwrap_or(Duration::from_secs(1)),
                };
            }
            if obs
                .active
                .as_ref()
                .is_some_and(|a| a.parallelism == to && run_failure(&obs.pods, a).is_none())
            {
                return Action::FinishRescale;
            }
            if let Some((run, parallelism)) = adoptable(&obs.pods)
                && parallelism == to
            {
                return Action::Adopt { run, parallelism };
            }
            // Pre-staged workers start from the stop checkpoint, applying only its delta; if one
            // is lost, fresh workers restore it in full.
            if let Some(p) = r.prestaged().filter(|_| r.rolled_back.is_none())
                && let Readiness::Lost(why) | Readiness::NotYet(why) =
                    prestage_ready(&obs.pods, &p.run, to)
            {
                return Action::FallBack {
                    message: format!("{why} before their start"),
                };
            }
            let restore = match (&r.savepoint, r.upgrade_mode) {
                _ if r.rolled_back.is_none() && r.restore_from.is_some() => {
                    Restore::Url(r.restore_from.clone().unwrap_or_default())
                }
                _ if r.rolled_back.is_none() && r.rewritten.is_some() => {
                    Restore::Url(r.rewritten.clone().unwrap_or_default())
                }
                (_, Some(UpgradeMode::Stateless)) => Restore::Empty,
                (_, Some(UpgradeMode::LastState)) => Restore::Latest,
                (Some(url), _) => Restore::Url(url.clone()),
                (None, _) => Restore::Latest,
            };
            bring_up(&obs.pods, to, restore, &obs.new_run, obs.now)
        }
        Step::Done | Step::Abandoned | Step::RolledBack => Action::Idle {
            requeue: Duration::from_secs(1),
        },
    }
}

/// The Prestaging step: the old run goes on (coordinated again after an operator restart);
/// the new run's pods are created and, once all run, pre-staged; if they are not ready within
/// spec.state.prestageTimeout, or one is lost, the rescale falls back to stop-and-restore.
fn prestaging(
    spec: &StreamJobSpec,
    r: &RescaleStatus,
    obs: &Observed,
    old: &[ObservedPod],
) -> Action {
    let Some(p) = r.prestage.as_ref() else {
        return Action::FallBack {
            message: "no run was recorded for the pre-staged workers".into(),
        };
    };
    match &obs.active {
        Some(active) => {
            if let Some(message) = run_failure(old, active) {
                return Action::Abandon {
                    message: format!(
                        "a worker failed while the new ones were pre-staged: {message}"
                    ),
                };
            }
        }
        None => {
            return match adoptable(old) {
                Some((run, parallelism)) => Action::Adopt { run, parallelism },
                None if starting(old) => Action::Wait {
                    reason: "waiting for the workers to answer before pre-staging".into(),
                },
                None => Action::Abandon {
                    message: "the workers are not running, so nothing can be pre-staged".into(),
                },
            };
        }
    }
    let to = r.to.max(0) as u32;
    let new: Vec<&ObservedPod> = obs.pods.iter().filter(|q| q.run == p.run).collect();
    if let Some((q, why)) = new
        .iter()
        .find_map(|q| q.unschedulable.as_ref().map(|why| (q, why)))
    {
        return Action::FallBack {
            message: format!(
                "new worker pod {} (subtask {}) cannot be scheduled: {why}",
                q.name, q.subtask
            ),
        };
    }
    if let Some((q, how)) = new.iter().find_map(|q| leaving(q).map(|how| (q, how))) {
        return Action::FallBack {
            message: format!(
                "new worker pod {} (subtask {}) {how} while pre-staging",
                q.name, q.subtask
            ),
        };
    }
    let missing: Vec<u32> = (0..to)
        .filter(|i| !new.iter().any(|q| q.subtask == *i))
        .collect();
    let not_up = new
        .iter()
        .filter(|q| q.phase != PodPhase::Running || q.ip.is_none())
        .count();
    let why = if !missing.is_empty() {
        format!("{} of {to} new worker pod(s) missing", missing.len())
    } else if not_up > 0 {
        format!("{not_up} of {to} new worker pod(s) not running yet")
    } else if new.iter().any(|q| q.worker == Some(WorkerState::Restoring)) {
        "the new workers are loading their key groups".to_owned()
    } else if new
        .iter()
        .all(|q| matches!(q.worker, Some(WorkerState::Idle | WorkerState::Prestaged)))
    {
        return Action::Prestage {
            run: p.run.clone(),
            parallelism: to,
        };
    } else {
        "waiting for the new workers' control API".to_owned()
    };
    if let Some(message) = prestage_overdue(spec, p, obs.now, &why) {
        return Action::FallBack { message };
    }
    if !missing.is_empty() {
        return Action::CreatePods {
            run: p.run.clone(),
            parallelism: to,
            subtasks: missing,
        };
    }
    Action::Wait {
        reason: format!("pre-staging: {why}"),
    }
}

/// Whether a pre-staged rescale's new workers can be used now.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Readiness {
    /// Every one runs and holds its key groups.
    Ready,
    /// Not yet known (a worker did not answer).
    NotYet(String),
    /// One is gone, exited, being deleted, or lost what it loaded.
    Lost(String),
}

/// Whether the `to` workers of run `run` are all there and pre-staged.
fn prestage_ready(pods: &[ObservedPod], run: &str, to: u32) -> Readiness {
    for i in 0..to {
        let Some(q) = pods.iter().find(|q| q.run == run && q.subtask == i) else {
            return Readiness::Lost(format!("the pre-staged worker of subtask {i} is gone"));
        };
        if let Some(how) = leaving(q) {
            return Readiness::Lost(format!(
                "the pre-staged worker {} (subtask {i}) {how}",
                q.name
            ));
        }
        match q.worker {
            Some(WorkerState::Prestaged) => {}
            None => {
                return Readiness::NotYet(format!(
                    "waiting for the pre-staged worker {} (subtask {i}) to answer",
                    q.name
                ));
            }
            Some(other) => {
                return Readiness::Lost(format!(
                    "the pre-staged worker {} (subtask {i}) is {other:?} (it restarted and lost what it loaded)",
                    q.name
                ));
            }
        }
    }
    Readiness::Ready
}

/// Why a pre-stage that waits for `why` falls back now: spec.state.prestageTimeout has passed
/// since its pods were first asked for.
fn prestage_overdue(
    spec: &StreamJobSpec,
    p: &crate::crd::PrestageStatus,
    now: DateTime<Utc>,
    why: &str,
) -> Option<String> {
    let timeout = super::run::timeouts::prestage(spec);
    let since = DateTime::parse_from_rfc3339(&p.since)
        .ok()?
        .with_timezone(&Utc);
    let deadline = since + chrono::Duration::from_std(timeout).unwrap_or_default();
    (now >= deadline).then(|| {
        format!(
            "the new workers were not ready within spec.state.prestageTimeout ({}s): {why} (no room on the nodes, or a quota? `kubectl describe pod` the new workers)",
            timeout.as_secs()
        )
    })
}

/// The run of a pre-staged rescale's new workers when they must go because it will not be used
/// (the rescale fell back, was abandoned or rolled back), while one is not on its way out
/// already.
fn unused_prestage(r: &RescaleStatus, obs: &Observed) -> Option<String> {
    let run = r.prestage_run()?;
    let unused = r.fallback.is_some() || matches!(r.step, Step::Abandoned | Step::RolledBack);
    (unused && obs.pods.iter().any(|p| p.run == run && !p.deleting)).then(|| run.to_owned())
}

/// How a pod is on its way out, if it is: "is being deleted" or "exited".
fn leaving(q: &ObservedPod) -> Option<&'static str> {
    if q.deleting {
        Some("is being deleted")
    } else if q.phase == PodPhase::Exited {
        Some("exited")
    } else {
        None
    }
}

/// Why the active run is broken, if it is.
fn run_failure(pods: &[ObservedPod], active: &ActiveRun) -> Option<String> {
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
fn adoptable(pods: &[ObservedPod]) -> Option<(String, u32)> {
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
const OVERDUE_SECONDS: i64 = 30;

/// The wait for terminating pods, naming the one furthest past its grace period when that is
/// over [`OVERDUE_SECONDS`]: a pod whose node is down stays terminating until someone removes
/// it, and the operator never force-deletes (the pod's process may still run).
fn waiting_for_termination(pods: &[ObservedPod], now: DateTime<Utc>) -> String {
    let terminating: Vec<&ObservedPod> = pods.iter().filter(|p| p.deleting).collect();
    let mut reason = format!("waiting for {} old pod(s) to terminate", terminating.len());
    let overdue = terminating
        .iter()
        .filter_map(|p| Some((p, (now - p.grace_deadline?).num_seconds())))
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
fn starting(pods: &[ObservedPod]) -> bool {
    !pods.is_empty()
        && pods
            .iter()
            .all(|p| !p.deleting && p.phase != PodPhase::Exited)
}

/// Steps towards a started run of `parallelism` workers.
fn bring_up(
    pods: &[ObservedPod],
    parallelism: u32,
    restore: Restore,
    new_run: &str,
    now: DateTime<Utc>,
) -> Action {
    if pods.iter().any(|p| p.deleting) {
        return Action::Wait {
            reason: waiting_for_termination(pods, now),
        };
    }
    let run = match pods.first() {
        None => new_run.to_owned(),
        Some(p) => p.run.clone(),
    };
    let foreign = pods
        .iter()
        .any(|p| p.run != run || p.parallelism != parallelism || p.subtask >= parallelism);
    if foreign {
        return Action::DeletePods {
            reason: Reason::StaleRun,
        };
    }
    if pods.iter().any(|p| p.phase == PodPhase::Exited) {
        return Action::DeletePods {
            reason: Reason::WorkerExited,
        };
    }
    let present: Vec<u32> = pods.iter().map(|p| p.subtask).collect();
    let missing: Vec<u32> = (0..parallelism).filter(|i| !present.contains(i)).collect();
    if !missing.is_empty() {
        return Action::CreatePods {
            run,
            parallelism,
            subtasks: missing,
        };
    }
    let not_up = pods
        .iter()
        .filter(|p| p.phase != PodPhase::Running || p.ip.is_none())
        .count();
    if not_up > 0 {
        let mut reason = format!("{not_up} of {parallelism} worker pod(s) not running yet");
        // The scheduler's own words when it cannot place one (no room, a constraint).
        if let Some((name, why)) = pods
            .iter()
            .find_map(|p| p.unschedulable.as_ref().map(|why| (&p.name, why)))
        {
            reason.push_str(&format!("; pod {name} cannot be scheduled: {why}"));
        }
        return Action::Wait { reason };
    }
    // Pre-staged workers (a pre-staged rescale's) start as idle ones do: each applies only what
    // it does not hold yet.
    if pods
        .iter()
        .all(|p| matches!(p.worker, Some(WorkerState::Idle | WorkerState::Prestaged)))
    {
        return Action::Start {
            run,
            parallelism,
            restore,
        };
    }
    if pods.iter().any(|p| {
        matches!(
            p.worker,
            Some(WorkerState::Running | WorkerState::Stopped | WorkerState::Restoring)
        )
    }) {
        // Started by an earlier attempt whose outcome is unknown: start clean.
        return Action::DeletePods {
            reason: Reason::UnknownRunState,
        };
    }
    Action::Wait {
        reason: "waiting for the workers' control API".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{RescaleStatus, StreamJob};

    /// A job that rescales by stop-and-restore (the pre-staged steps have tests of their own).
    fn spec(replicas: i32) -> StreamJobSpec {
        let mut j = crate::fixtures::job();
        j.spec.replicas = replicas;
        j.spec.rescale_strategy = RescaleStrategy::StopAndRestore;
        j.spec
    }

    fn status() -> StreamJobStatus {
        StreamJobStatus {
            max_parallelism: Some(128),
            ..Default::default()
        }
    }

    fn now() -> DateTime<Utc> {
        DateTime::from_timestamp(1_000_000, 0).unwrap()
    }

    fn obs(pods: Vec<ObservedPod>, active: Option<(&str, u32)>) -> Observed {
        Observed {
            now: now(),
            pods,
            active: active.map(|(r, p)| ActiveRun {
                run: r.into(),
                parallelism: p,
            }),
            last_snapshot_at: Some(now()),
            backoff_until: None,
            change_retry_at: None,
            new_run: "new".into(),
            name: "clicks".into(),
            pending_restore: None,
            upgrade_refused: None,
        }
    }

    fn pods(run: &str, p: u32, phase: PodPhase, worker: Option<WorkerState>) -> Vec<ObservedPod> {
        (0..p)
            .map(|i| ObservedPod {
                name: format!("j-{run}-{i}"),
                run: run.into(),
                subtask: i,
                parallelism: p,
                phase,
                ip: (phase == PodPhase::Running).then(|| format!("10.0.0.{i}")),
                deleting: false,
                grace_deadline: None,
                worker,
                spec_hash: None,
                unschedulable: None,
            })
            .collect()
    }

    fn rescaling(step: Step, savepoint: Option<&str>) -> StreamJobStatus {
        StreamJobStatus {
            rescale: Some(RescaleStatus {
                from: 4,
                to: 8,
                step,
                started: "t".into(),
                savepoint: savepoint.map(str::to_owned),
                ..Default::default()
            }),
            ..status()
        }
    }

    #[test]
    fn new_job_pins_then_creates_pods_then_waits_then_starts() {
        let s = spec(4);
        let a = decide(&s, &StreamJobStatus::default(), &obs(vec![], None));
        assert_eq!(
            a,
            Action::PinMaxParallelism {
                groups: 128,
                origin: "set by spec.maxParallelism".into()
            }
        );
        let a = decide(&s, &status(), &obs(vec![], None));
        assert_eq!(
            a,
            Action::CreatePods {
                run: "new".into(),
                parallelism: 4,
                subtasks: vec![0, 1, 2, 3]
            }
        );
        let mut some = pods("r", 4, PodPhase::Pending, None);
        some.remove(1);
        let a = decide(&s, &status(), &obs(some, None));
        assert_eq!(
            a,
            Action::CreatePods {
                run: "r".into(),
                parallelism: 4,
                subtasks: vec![1]
            }
        );
        let a = decide(
            &s,
            &status(),
            &obs(pods("r", 4, PodPhase::Pending, None), None),
        );
        assert!(matches!(a, Action::Wait { .. }), "{a:?}");
        let a = decide(
            &s,
            &status(),
            &obs(
                pods("r", 4, PodPhase::Running, Some(WorkerState::Idle)),
                None,
            ),
        );
        assert_eq!(
            a,
            Action::Start {
                run: "r".into(),
                parallelism: 4,
                restore: Restore::Latest
            }
        );
    }

    #[test]
    fn after_a_rolled_back_rescale_a_recovery_brings_the_job_up_at_the_old_parallelism() {
        let s = spec(8);
        let mut st = rescaling(Step::RolledBack, Some("sp-3"));
        st.replicas = Some(4);
        if let Some(r) = st.rescale.as_mut() {
            r.rolled_back = Some("restore failed".into());
        }
        let a = decide(&s, &st, &obs(vec![], None));
        assert_eq!(
            a,
            Action::CreatePods {
                run: "new".into(),
                parallelism: 4,
                subtasks: vec![0, 1, 2, 3]
            }
        );
        assert_eq!(recovery_parallelism(&st, 8, false), 4);
        // Another parallelism asked for since, a pending restoreFrom, a rescale that succeeded,
        // or a job that no longer ran at the old parallelism: the desired one.
        assert_eq!(recovery_parallelism(&st, 6, false), 6);
        assert_eq!(recovery_parallelism(&st, 8, true), 8);
        let mut done = st.clone();
        if let Some(r) = done.rescale.as_mut() {
            r.step = Step::Done;
        }
        assert_eq!(recovery_parallelism(&done, 8, false), 8);
        let mut moved = st.clone();
        moved.replicas = Some(8);
        assert_eq!(recovery_parallelism(&moved, 8, false), 8);
    }

    #[test]
    fn default_ceiling_is_pinned_from_replicas() {
        let mut s = spec(200);
        s.max_parallelism = None;
        let a = decide(&s, &StreamJobStatus::default(), &obs(vec![], None));
        assert_eq!(
            a,
            Action::PinMaxParallelism {
                groups: 512,
                origin: "Flink's default for the 200 replicas the job first ran with, as spec.maxParallelism was not set".into()
            }
        );
    }

    #[test]
    fn running_job_checkpoints_when_due_and_idles_otherwise() {
        let s = spec(4);
        let running = pods("r", 4, PodPhase::Running, Some(WorkerState::Running));
        let mut o = obs(running, Some(("r", 4)));
        let a = decide(&s, &status(), &o);
        assert!(matches!(a, Action::Idle { requeue } if requeue <= Duration::from_secs(30)));
        o.last_snapshot_at = Some(now() - chrono::Duration::seconds(31));
        assert_eq!(decide(&s, &status(), &o), Action::Checkpoint);
    }

    #[test]
    fn a_snapshot_time_from_a_clock_ahead_of_ours_does_not_hold_checkpoints_back() {
        let s = spec(4);
        let running = pods("r", 4, PodPhase::Running, Some(WorkerState::Running));
        let mut st = status();
        st.last_checkpoint = Some(crate::crd::SnapshotRef {
            id: 7,
            path: "file:///s/chk-7".into(),
            // A previous leader's clock, an hour ahead.
            time: (now() + chrono::Duration::hours(1)).to_rfc3339(),
            parallelism: 4,
            size_bytes: None,
            source_partitions: None,
        });
        let started = now() - chrono::Duration::seconds(40);
        let mut o = obs(running, Some(("r", 4)));
        o.last_snapshot_at = last_snapshot_at(&st, Some(started), now());
        assert_eq!(o.last_snapshot_at, Some(started));
        assert_eq!(decide(&s, &st, &o), Action::Checkpoint);
        // A time in the past is used as it is.
        let recent = now() - chrono::Duration::seconds(5);
        if let Some(c) = st.last_checkpoint.as_mut() {
            c.time = recent.to_rfc3339();
        }
        o.last_snapshot_at = last_snapshot_at(&st, Some(started), now());
        assert_eq!(o.last_snapshot_at, Some(recent));
        assert!(matches!(decide(&s, &st, &o), Action::Idle { .. }));
    }

    #[test]
    fn operator_restart_adopts_running_workers() {
        let s = spec(4);
        let a = decide(
            &s,
            &status(),
            &obs(
                pods("r", 4, PodPhase::Running, Some(WorkerState::Running)),
                None,
            ),
        );
        assert_eq!(
            a,
            Action::Adopt {
                run: "r".into(),
                parallelism: 4
            }
        );
    }

    #[test]
    fn a_scale_begins_a_rescale_and_each_step_follows_from_status() {
        let running = pods("r", 4, PodPhase::Running, Some(WorkerState::Running));
        let a = decide(&spec(8), &status(), &obs(running.clone(), Some(("r", 4))));
        assert_eq!(
            a,
            Action::BeginRescale {
                from: 4,
                to: 8,
                prestage: None
            }
        );

        let st = rescaling(Step::Savepointing, None);
        assert_eq!(
            decide(&spec(8), &st, &obs(running.clone(), Some(("r", 4)))),
            Action::Savepoint
        );
        // Operator restarted while savepointing: adopt the old workers (possibly stopped).
        let stopped = pods("r", 4, PodPhase::Running, Some(WorkerState::Stopped));
        assert_eq!(
            decide(&spec(8), &st, &obs(stopped, None)),
            Action::Adopt {
                run: "r".into(),
                parallelism: 4
            }
        );

        let st = rescaling(Step::Verifying, Some("file:///s/sp-3"));
        assert_eq!(
            decide(&spec(8), &st, &obs(running.clone(), None)),
            Action::Verify {
                url: "file:///s/sp-3".into()
            }
        );

        let st = rescaling(Step::Stopping, Some("file:///s/sp-3"));
        assert_eq!(
            decide(&spec(8), &st, &obs(running.clone(), None)),
            Action::DeletePods {
                reason: Reason::Stopping
            }
        );
        let mut going = running.clone();
        for (i, p) in going.iter_mut().enumerate() {
            p.deleting = true;
            // Grace periods ending 20 s ago (pod 0) to 5 s from now (pod 3).
            p.grace_deadline = Some(now() - chrono::Duration::seconds(20 - 8 * i as i64));
        }
        let Action::Wait { reason } = decide(&spec(8), &st, &obs(going.clone(), None)) else {
            panic!("terminating pods are waited for");
        };
        assert_eq!(reason, "waiting for 4 old pod(s) to terminate");
        // A pod 45 s past its grace period (its node is gone, say) is named, with the way out.
        going[2].grace_deadline = Some(now() - chrono::Duration::seconds(45));
        let Action::Wait { reason } = decide(&spec(8), &st, &obs(going, None)) else {
            panic!("terminating pods are waited for");
        };
        assert!(
            reason.starts_with("waiting for 4 old pod(s) to terminate; pod j-r-2 is 45s past"),
            "{reason}"
        );
        assert!(
            reason.contains("kubectl delete pod j-r-2 --grace-period=0 --force"),
            "{reason}"
        );
        assert_eq!(
            decide(&spec(8), &st, &obs(vec![], None)),
            Action::Advance(Outcome::Stopped)
        );

        let st = rescaling(Step::Restoring, Some("file:///s/sp-3"));
        assert_eq!(
            decide(&spec(8), &st, &obs(vec![], None)),
            Action::CreatePods {
                run: "new".into(),
                parallelism: 8,
                subtasks: (0..8).collect()
            }
        );
        assert_eq!(
            decide(
                &spec(8),
                &st,
                &obs(
                    pods("n", 8, PodPhase::Running, Some(WorkerState::Idle)),
                    None
                )
            ),
            Action::Start {
                run: "n".into(),
                parallelism: 8,
                restore: Restore::Url("file:///s/sp-3".into())
            }
        );
        // Started, but the operator died before recording Done: adopt, then finish.
        let up = pods("n", 8, PodPhase::Running, Some(WorkerState::Running));
        assert_eq!(
            decide(&spec(8), &st, &obs(up.clone(), None)),
            Action::Adopt {
                run: "n".into(),
                parallelism: 8
            }
        );
        assert_eq!(
            decide(&spec(8), &st, &obs(up, Some(("n", 8)))),
            Action::FinishRescale
        );
    }

    #[test]
    fn a_failed_worker_restarts_the_run_and_backoff_delays_it() {
        let s = spec(4);
        let mut running = pods("r", 4, PodPhase::Running, Some(WorkerState::Running));
        running[2].phase = PodPhase::Exited;
        let a = decide(&s, &status(), &obs(running, Some(("r", 4))));
        assert!(matches!(a, Action::Recover { .. }), "{a:?}");
        let mut o = obs(vec![], None);
        o.backoff_until = Some(now() + chrono::Duration::seconds(4));
        assert!(matches!(decide(&s, &status(), &o), Action::Idle { .. }));
        // Stopped pods of a broken run are removed before a new run is created.
        let mut broken = pods("r", 4, PodPhase::Running, Some(WorkerState::Idle));
        broken[0].phase = PodPhase::Exited;
        assert!(matches!(
            decide(&s, &status(), &obs(broken, None)),
            Action::DeletePods { .. }
        ));
    }

    #[test]
    fn above_the_pinned_ceiling_stalls_without_touching_workers() {
        let s = spec(200);
        let st = StreamJobStatus {
            max_parallelism: Some(128),
            ..Default::default()
        };
        let running = pods("r", 24, PodPhase::Running, Some(WorkerState::Running));
        match decide(&s, &st, &obs(running, Some(("r", 24)))) {
            Action::Stall { reason, message } => {
                assert_eq!(reason, Reason::AboveKeyGroupCeiling);
                assert!(
                    message.starts_with("spec.replicas 200 exceeds 128, the key-group ceiling"),
                    "{message}"
                );
                assert!(message.contains("nothing was changed"), "{message}");
                // The one edit that raises it: 4x200 -> 1024 groups with the replicas.
                assert!(
                    message.contains(
                        "kubectl patch streamjob clicks --type merge -p '{\"spec\":{\"maxParallelism\":1024,\"replicas\":200}}'"
                    ),
                    "{message}"
                );
                assert!(
                    message.contains("the original savepoint is kept"),
                    "{message}"
                );
                assert!(!message.contains("Note:"), "no state size known: {message}");
            }
            a => panic!("{a:?}"),
        }
        // With the state's size known, tiny groups are warned about.
        let st = StreamJobStatus {
            max_parallelism: Some(128),
            max_parallelism_origin: Some("set by spec.maxParallelism".into()),
            last_checkpoint: Some(crate::crd::SnapshotRef {
                size_bytes: Some(1 << 20),
                ..Default::default()
            }),
            ..Default::default()
        };
        let (reason, message) = check_spec("clicks", &s, &st).unwrap_err();
        assert_eq!(reason, Reason::AboveKeyGroupCeiling);
        assert!(
            message.contains("(status.maxParallelism: set by spec.maxParallelism)"),
            "{message}"
        );
        assert!(
            message.contains("Note: 1024 key groups over 1048576 bytes of state make tiny groups"),
            "{message}"
        );
        // The derived default ceiling (no spec.maxParallelism) is reported with its origin.
        let mut s = spec(200);
        s.max_parallelism = None;
        let st = StreamJobStatus::default();
        let a = check_spec("clicks", &s, &st);
        assert!(a.is_ok(), "default ceiling follows replicas: {a:?}");
    }

    fn pending(url: &str, groups: u32) -> Option<Result<PendingRestore, (Reason, String)>> {
        Some(Ok(PendingRestore {
            url: url.into(),
            max_parallelism: groups,
        }))
    }

    #[test]
    fn a_new_restore_from_on_a_running_job_savepoints_then_restores_it() {
        // The 24 -> 200 path: the job runs at 24 under 128 groups; the spec now names a savepoint
        // rewritten to 1024 groups, with maxParallelism 1024 and replicas 200.
        let mut s = spec(200);
        s.max_parallelism = Some(1024);
        s.restore_from = Some("file:///x/sp-3-mp1024".into());
        let running = pods("r", 24, PodPhase::Running, Some(WorkerState::Running));
        let mut o = obs(running, Some(("r", 24)));
        o.pending_restore = pending("file:///x/sp-3-mp1024", 1024);
        assert_eq!(
            decide(&s, &status(), &o),
            Action::BeginRestore {
                from: 24,
                to: 200,
                url: "file:///x/sp-3-mp1024".into(),
                max_parallelism: 1024
            }
        );
        // Its Restoring step restores the named snapshot, not the savepoint it took.
        let mut st = rescaling(Step::Restoring, Some("file:///x/sp-4"));
        if let Some(r) = st.rescale.as_mut() {
            r.from = 24;
            r.to = 200;
            r.restore_from = Some("file:///x/sp-3-mp1024".into());
            r.max_parallelism = Some(1024);
        }
        let idle = pods("n", 200, PodPhase::Running, Some(WorkerState::Idle));
        assert_eq!(
            decide(&s, &st, &obs(idle.clone(), None)),
            Action::Start {
                run: "n".into(),
                parallelism: 200,
                restore: Restore::Url("file:///x/sp-3-mp1024".into())
            }
        );
        // Rolled back: the old parallelism comes back from the job's own savepoint.
        if let Some(r) = st.rescale.as_mut() {
            r.rolled_back = Some("failed".into());
        }
        let old = pods("n", 24, PodPhase::Running, Some(WorkerState::Idle));
        assert_eq!(
            decide(&s, &st, &obs(old, None)),
            Action::Start {
                run: "n".into(),
                parallelism: 24,
                restore: Restore::Url("file:///x/sp-4".into())
            }
        );
    }

    #[test]
    fn a_suspended_job_resumes_from_a_new_restore_from() {
        let mut s = spec(200);
        s.max_parallelism = Some(1024);
        s.restore_from = Some("file:///x/sp-3-mp1024".into());
        let st = StreamJobStatus {
            phase: Some(crate::crd::Phase::Suspended),
            replicas: Some(0),
            ..status()
        };
        let mut o = obs(
            pods("n", 200, PodPhase::Running, Some(WorkerState::Idle)),
            None,
        );
        o.pending_restore = pending("file:///x/sp-3-mp1024", 1024);
        assert_eq!(
            decide(&s, &st, &o),
            Action::Start {
                run: "n".into(),
                parallelism: 200,
                restore: Restore::Url("file:///x/sp-3-mp1024".into())
            }
        );
        // Without the pending restore (already used) the same spec resumes its own state.
        let st = StreamJobStatus {
            max_parallelism: Some(1024),
            ..st
        };
        let o = obs(
            pods("n", 200, PodPhase::Running, Some(WorkerState::Idle)),
            None,
        );
        assert_eq!(
            decide(&s, &st, &o),
            Action::Start {
                run: "n".into(),
                parallelism: 200,
                restore: Restore::Latest
            }
        );
    }

    #[test]
    fn an_unusable_restore_from_stalls_and_stops_nothing() {
        let mut s = spec(200);
        s.max_parallelism = Some(512);
        s.restore_from = Some("file:///x/sp-3-mp1024".into());
        let running = pods("r", 24, PodPhase::Running, Some(WorkerState::Running));
        let mut o = obs(running, Some(("r", 24)));
        o.pending_restore = pending("file:///x/sp-3-mp1024", 1024);
        match decide(&s, &status(), &o) {
            Action::Stall { reason, message } => {
                assert_eq!(reason, Reason::RestoreFromKeyGroupMismatch);
                assert!(message.contains("has 1024 key groups"), "{message}");
                assert!(
                    message.contains("set spec.maxParallelism to 1024"),
                    "{message}"
                );
            }
            a => panic!("{a:?}"),
        }
        o.pending_restore = Some(Err((Reason::RestoreFromUnusable, "cannot read it".into())));
        assert_eq!(
            decide(&s, &status(), &o),
            Action::Stall {
                reason: Reason::RestoreFromUnusable,
                message: "cannot read it".into()
            }
        );
        // A new job pins the snapshot's count, not Flink's default for its replicas.
        let mut s = spec(200);
        s.max_parallelism = None;
        s.restore_from = Some("file:///x/sp-3-mp1024".into());
        let mut o = obs(vec![], None);
        o.pending_restore = pending("file:///x/sp-3-mp1024", 1024);
        assert!(matches!(
            decide(&s, &StreamJobStatus::default(), &o),
            Action::PinMaxParallelism { groups: 1024, .. }
        ));
    }

    #[test]
    fn a_job_created_suspended_is_suspended_and_ready() {
        let mut s = spec(2);
        s.suspend = true;
        assert_eq!(
            decide(&s, &status(), &obs(vec![], None)),
            Action::MarkSuspended
        );
        let st = StreamJobStatus {
            phase: Some(crate::crd::Phase::Suspended),
            replicas: Some(0),
            ..status()
        };
        assert!(matches!(
            decide(&s, &st, &obs(vec![], None)),
            Action::Idle { .. }
        ));
        assert!(crate::orchestrator::status::is_ready(
            &s,
            &st,
            &crate::orchestrator::status::Progress::default()
        ));
    }

    #[test]
    fn suspend_is_a_rescale_to_zero() {
        let mut s = spec(4);
        s.suspend = true;
        let running = pods("r", 4, PodPhase::Running, Some(WorkerState::Running));
        assert_eq!(
            decide(&s, &status(), &obs(running, Some(("r", 4)))),
            Action::BeginRescale {
                from: 4,
                to: 0,
                prestage: None
            }
        );
        let mut st = rescaling(Step::Restoring, Some("u"));
        if let Some(r) = st.rescale.as_mut() {
            r.to = 0;
        }
        assert_eq!(decide(&s, &st, &obs(vec![], None)), Action::FinishRescale);
        let suspended = StreamJobStatus {
            phase: Some(crate::crd::Phase::Suspended),
            replicas: Some(0),
            ..status()
        };
        assert!(matches!(
            decide(&s, &suspended, &obs(vec![], None)),
            Action::Idle { .. }
        ));
    }

    #[test]
    fn a_failed_restore_rolls_back_to_the_old_parallelism_from_the_same_savepoint() {
        let st = rescaling(Step::Restoring, Some("file:///s/sp-3"));
        let r = st.rescale.clone().unwrap();
        assert_eq!(rollback_on_restore_failure(&r), Some(4));
        // Rolled back: restore the old parallelism (4) from the same savepoint.
        let mut rolled = st.clone();
        rolled.rescale.as_mut().unwrap().rolled_back = Some("restore failed".into());
        let r = rolled.rescale.clone().unwrap();
        assert_eq!(restore_target(&r), 4);
        // A second failure (at the old parallelism) retries, it does not roll back again.
        assert_eq!(rollback_on_restore_failure(&r), None);
        assert_eq!(
            decide(&spec(8), &rolled, &obs(vec![], None)),
            Action::CreatePods {
                run: "new".into(),
                parallelism: 4,
                subtasks: (0..4).collect()
            }
        );
        assert_eq!(
            decide(
                &spec(8),
                &rolled,
                &obs(
                    pods("n", 4, PodPhase::Running, Some(WorkerState::Idle)),
                    None
                )
            ),
            Action::Start {
                run: "n".into(),
                parallelism: 4,
                restore: Restore::Url("file:///s/sp-3".into())
            }
        );
        let up = pods("n", 4, PodPhase::Running, Some(WorkerState::Running));
        assert_eq!(
            decide(&spec(8), &rolled, &obs(up, Some(("n", 4)))),
            Action::FinishRescale
        );
        // Not in Restoring, or a suspend/resume without an old run: no rollback.
        let st = rescaling(Step::Stopping, Some("u"));
        assert_eq!(rollback_on_restore_failure(&st.rescale.unwrap()), None);
        let mut st = rescaling(Step::Restoring, Some("u"));
        st.rescale.as_mut().unwrap().from = 0;
        assert_eq!(rollback_on_restore_failure(&st.rescale.unwrap()), None);
    }

    #[test]
    fn a_new_savepoint_nonce_takes_one_savepoint_without_stopping() {
        let mut s = spec(4);
        let running = pods("r", 4, PodPhase::Running, Some(WorkerState::Running));
        let o = obs(running.clone(), Some(("r", 4)));
        // No nonce: nothing to trigger.
        assert!(matches!(decide(&s, &status(), &o), Action::Idle { .. }));
        s.savepoint_trigger_nonce = Some(7);
        assert_eq!(
            decide(&s, &status(), &o),
            Action::TriggerSavepoint { nonce: 7 }
        );
        // Recorded: nothing more until the nonce changes.
        let done = StreamJobStatus {
            last_savepoint_nonce: Some(7),
            ..status()
        };
        assert!(matches!(decide(&s, &done, &o), Action::Idle { .. }));
        s.savepoint_trigger_nonce = Some(8);
        assert_eq!(decide(&s, &done, &o), Action::TriggerSavepoint { nonce: 8 });
        // After a failed attempt, the retry waits for the backoff.
        let mut later = o.clone();
        later.backoff_until = Some(now() + chrono::Duration::seconds(2));
        assert!(matches!(decide(&s, &done, &later), Action::Idle { .. }));
        // A rescale takes precedence (its savepoint is newer anyway).
        let o8 = obs(running, Some(("r", 4)));
        assert_eq!(
            decide(&spec(8), &done, &o8),
            Action::BeginRescale {
                from: 4,
                to: 8,
                prestage: None
            }
        );
    }

    fn upgrading(mode: UpgradeMode, step: Step, savepoint: Option<&str>) -> StreamJobStatus {
        let mut st = rescaling(step, savepoint);
        if let Some(r) = st.rescale.as_mut() {
            r.from = 4;
            r.to = 4;
            r.upgrade_mode = Some(mode);
        }
        st
    }

    #[test]
    fn a_changed_job_or_image_upgrades_in_the_spec_upgrade_mode() {
        let mut s = spec(4);
        let mut running = pods("r", 4, PodPhase::Running, Some(WorkerState::Running));
        // Pods without the label (older operators) are not upgraded.
        assert!(matches!(
            decide(&s, &status(), &obs(running.clone(), Some(("r", 4)))),
            Action::Idle { .. }
        ));
        for p in &mut running {
            p.spec_hash = Some(spec_hash(&s));
        }
        assert!(matches!(
            decide(&s, &status(), &obs(running.clone(), Some(("r", 4)))),
            Action::Idle { .. }
        ));
        s.image = Some("keyshift:v2".into());
        assert_ne!(spec_hash(&s), spec_hash(&spec(4)));
        for mode in [
            UpgradeMode::Savepoint,
            UpgradeMode::LastState,
            UpgradeMode::Stateless,
        ] {
            s.upgrade_mode = mode;
            assert_eq!(
                decide(&s, &status(), &obs(running.clone(), Some(("r", 4)))),
                Action::BeginUpgrade {
                    parallelism: 4,
                    mode
                }
            );
        }
        // Backoff after a failed attempt delays the next one.
        let mut o = obs(running.clone(), Some(("r", 4)));
        o.backoff_until = Some(now() + chrono::Duration::seconds(2));
        assert!(matches!(decide(&s, &status(), &o), Action::Idle { .. }));

        // Each mode restores from its own source once the old pods are gone.
        let idle = pods("n", 4, PodPhase::Running, Some(WorkerState::Idle));
        let cases = [
            (
                upgrading(
                    UpgradeMode::Savepoint,
                    Step::Restoring,
                    Some("file:///s/sp-9"),
                ),
                Restore::Url("file:///s/sp-9".into()),
            ),
            (
                upgrading(UpgradeMode::LastState, Step::Restoring, None),
                Restore::Latest,
            ),
            (
                upgrading(UpgradeMode::Stateless, Step::Restoring, None),
                Restore::Empty,
            ),
        ];
        for (st, restore) in cases {
            assert_eq!(
                decide(&s, &st, &obs(idle.clone(), None)),
                Action::Start {
                    run: "n".into(),
                    parallelism: 4,
                    restore
                }
            );
        }
        // last-state and stateless skip the savepoint: Stopping deletes the running pods.
        let st = upgrading(UpgradeMode::LastState, Step::Stopping, None);
        assert_eq!(
            decide(&s, &st, &obs(running, None)),
            Action::DeletePods {
                reason: Reason::Stopping
            }
        );
    }

    #[allow(dead_code)]
    fn _uses(_: StreamJob) {}

    fn changing(step: Step) -> crate::crd::RescaleStatus {
        crate::crd::RescaleStatus {
            from: 24,
            to: 200,
            step,
            max_parallelism: Some(1024),
            from_max_parallelism: Some(128),
            savepoint: Some("file:///s/sp-3".into()),
            rewritten: Some("file:///s/sp-4".into()),
            ..Default::default()
        }
    }

    fn changed(point_of_no_return: Option<i64>) -> crate::crd::KeyGroupChangeStatus {
        crate::crd::KeyGroupChangeStatus {
            from_max_parallelism: 128,
            to_max_parallelism: 1024,
            from_replicas: 24,
            original_savepoint: "file:///s/sp-3".into(),
            rewritten_savepoint: "file:///s/sp-4".into(),
            point_of_no_return,
            ..Default::default()
        }
    }

    #[test]
    fn a_new_max_parallelism_on_a_running_job_begins_a_key_group_change() {
        let mut s = spec(200);
        s.max_parallelism = Some(1024);
        let running = pods("r", 24, PodPhase::Running, Some(WorkerState::Running));
        assert_eq!(
            decide(&s, &status(), &obs(running.clone(), Some(("r", 24)))),
            Action::BeginKeyGroupChange {
                from: 24,
                to: 200,
                groups: 1024,
                running: true
            }
        );
        // At the same parallelism too (only the count changes).
        s.replicas = 24;
        assert!(matches!(
            decide(&s, &status(), &obs(running.clone(), Some(("r", 24)))),
            Action::BeginKeyGroupChange {
                from: 24,
                to: 24,
                groups: 1024,
                ..
            }
        ));
        // Not while a spec.restoreFrom is pending: that restore sets the count.
        let mut o = obs(running, Some(("r", 24)));
        o.pending_restore = pending("file:///s/other", 1024);
        assert!(matches!(
            decide(&s, &status(), &o),
            Action::BeginRestore {
                max_parallelism: 1024,
                ..
            }
        ));
        // A stopped job: its newest snapshot is rewritten before anything runs.
        assert_eq!(
            decide(&s, &status(), &obs(Vec::new(), None)),
            Action::BeginKeyGroupChange {
                from: 0,
                to: 24,
                groups: 1024,
                running: false
            }
        );
    }

    #[test]
    fn setting_the_count_back_before_the_point_of_no_return_restores_the_original() {
        let mut s = spec(24);
        s.max_parallelism = Some(128);
        let st = StreamJobStatus {
            max_parallelism: Some(1024),
            key_group_change: Some(changed(None)),
            ..Default::default()
        };
        let running = pods("r", 200, PodPhase::Running, Some(WorkerState::Running));
        assert_eq!(
            decide(&s, &st, &obs(running.clone(), Some(("r", 200)))),
            Action::BeginRestore {
                from: 200,
                to: 24,
                url: "file:///s/sp-3".into(),
                max_parallelism: 128
            }
        );
        // Past it, the current state is rewritten back instead (nothing it produced is lost).
        let st = StreamJobStatus {
            key_group_change: Some(changed(Some(7))),
            ..st
        };
        assert!(matches!(
            decide(&s, &st, &obs(running, Some(("r", 200)))),
            Action::BeginKeyGroupChange {
                groups: 128,
                running: true,
                ..
            }
        ));
    }

    #[test]
    fn the_steps_of_a_key_group_change_act_in_order() {
        let mut s = spec(200);
        s.max_parallelism = Some(1024);
        let at = |step| StreamJobStatus {
            max_parallelism: Some(128),
            rescale: Some(changing(step)),
            ..Default::default()
        };
        assert_eq!(
            decide(&s, &at(Step::Stopping), &obs(Vec::new(), None)),
            Action::Advance(Outcome::StoppedForRewrite)
        );
        assert_eq!(
            decide(&s, &at(Step::Rewriting), &obs(Vec::new(), None)),
            Action::Rewrite {
                source: "file:///s/sp-3".into(),
                target: "file:///s/sp-4".into(),
                groups: 1024,
                parallelism: 200
            }
        );
        assert_eq!(
            decide(&s, &at(Step::VerifyingRewrite), &obs(Vec::new(), None)),
            Action::VerifyRewrite {
                source: "file:///s/sp-3".into(),
                target: "file:///s/sp-4".into()
            }
        );
        // The rewritten savepoint is restored at the new parallelism...
        match decide(&s, &at(Step::Restoring), &obs(Vec::new(), None)) {
            Action::CreatePods { parallelism, .. } => assert_eq!(parallelism, 200),
            a => panic!("{a:?}"),
        }
        let up = pods("new", 200, PodPhase::Running, Some(WorkerState::Idle));
        match decide(&s, &at(Step::Restoring), &obs(up, None)) {
            Action::Start {
                parallelism,
                restore,
                ..
            } => {
                assert_eq!(parallelism, 200);
                assert_eq!(restore, Restore::Url("file:///s/sp-4".into()));
            }
            a => panic!("{a:?}"),
        }
        // ... or, rolled back, the original at the old parallelism.
        let mut back = at(Step::Restoring);
        if let Some(r) = back.rescale.as_mut() {
            r.rolled_back = Some("the rewrite failed".into());
        }
        let up = pods("new", 24, PodPhase::Running, Some(WorkerState::Idle));
        match decide(&s, &back, &obs(up, None)) {
            Action::Start {
                parallelism,
                restore,
                ..
            } => {
                assert_eq!(parallelism, 24);
                assert_eq!(restore, Restore::Url("file:///s/sp-3".into()));
            }
            a => panic!("{a:?}"),
        }
        // Setting the count back while the rewrite runs rolls the change back.
        s.max_parallelism = Some(128);
        s.replicas = 24;
        for step in [Step::Rewriting, Step::VerifyingRewrite] {
            assert!(
                matches!(
                    decide(&s, &at(step), &obs(Vec::new(), None)),
                    Action::RollBackRewrite { .. }
                ),
                "{step}"
            );
        }
        // A failed restore of the new run rolls back even at the same parallelism.
        let mut same = changing(Step::Restoring);
        same.to = 24;
        assert_eq!(rollback_on_restore_failure(&same), Some(24));
        let mut plain = same.clone();
        plain.from_max_parallelism = None;
        assert_eq!(rollback_on_restore_failure(&plain), None);
    }

    /// A pre-staged rescale 4 -> 8 in `step`, its new run "new" asked for at `now()`.
    fn prestaging(step: Step) -> StreamJobStatus {
        let mut st = rescaling(step, Some("s3://b/ns/j/checkpoints/chk-9"));
        if let Some(r) = st.rescale.as_mut() {
            r.prestage = Some(crate::crd::PrestageStatus {
                run: "new".into(),
                since: now().to_rfc3339(),
                ..Default::default()
            });
        }
        st
    }

    fn prestage_spec() -> StreamJobSpec {
        let mut s = spec(8);
        s.rescale_strategy = RescaleStrategy::Prestage;
        s
    }

    fn later(mut o: Observed, secs: i64) -> Observed {
        o.now += chrono::Duration::seconds(secs);
        o
    }

    #[test]
    fn rescales_are_prestaged_by_default() {
        let j = crate::fixtures::job();
        assert_eq!(j.spec.rescale_strategy, RescaleStrategy::Prestage);
        let yaml = serde_yaml::to_string(&j.spec).unwrap();
        assert!(
            !yaml.contains("rescaleStrategy"),
            "the default is not written"
        );
        let mut s = j.spec.clone();
        s.rescale_strategy = RescaleStrategy::StopAndRestore;
        let yaml = serde_yaml::to_string(&s).unwrap();
        assert!(yaml.contains("rescaleStrategy: StopAndRestore"), "{yaml}");
    }

    #[test]
    fn a_prestage_rescale_begins_at_prestaging_but_a_suspend_does_not() {
        let old = pods("old", 4, PodPhase::Running, Some(WorkerState::Running));
        let st = StreamJobStatus {
            replicas: Some(4),
            ..status()
        };
        let a = decide(&prestage_spec(), &st, &obs(old.clone(), Some(("old", 4))));
        assert_eq!(
            a,
            Action::BeginRescale {
                from: 4,
                to: 8,
                prestage: Some("new".into())
            }
        );
        let mut suspend = prestage_spec();
        suspend.suspend = true;
        let a = decide(&suspend, &st, &obs(old, Some(("old", 4))));
        assert_eq!(
            a,
            Action::BeginRescale {
                from: 4,
                to: 0,
                prestage: None
            }
        );
    }

    #[test]
    fn prestaging_creates_waits_loads_and_falls_back_when_late() {
        let s = prestage_spec();
        let st = prestaging(Step::Prestaging);
        let old = pods("old", 4, PodPhase::Running, Some(WorkerState::Running));
        let with = |new: Vec<ObservedPod>| {
            let mut all = old.clone();
            all.extend(new);
            obs(all, Some(("old", 4)))
        };
        assert_eq!(
            decide(&s, &st, &with(vec![])),
            Action::CreatePods {
                run: "new".into(),
                parallelism: 8,
                subtasks: (0..8).collect()
            }
        );
        let pending = pods("new", 8, PodPhase::Pending, None);
        assert!(matches!(
            decide(&s, &st, &with(pending.clone())),
            Action::Wait { reason } if reason.contains("8 of 8 new worker pod(s) not running")
        ));
        // spec.state.prestageTimeout (2m by default) passed: fall back, the job still runs.
        match decide(&s, &st, &later(with(pending), 120)) {
            Action::FallBack { message } => {
                assert!(message.contains("prestageTimeout (120s)"), "{message}");
                assert!(message.contains("not running yet"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        let idle = pods("new", 8, PodPhase::Running, Some(WorkerState::Idle));
        assert_eq!(
            decide(&s, &st, &with(idle.clone())),
            Action::Prestage {
                run: "new".into(),
                parallelism: 8
            }
        );
        // A pod the scheduler cannot place: no need to wait for the timeout.
        let mut unplaced = pods("new", 8, PodPhase::Pending, None);
        unplaced[4].unschedulable = Some("0/1 nodes are available: 1 Insufficient cpu.".into());
        assert!(matches!(
            decide(&s, &st, &with(unplaced)),
            Action::FallBack { message } if message.contains("(subtask 4) cannot be scheduled: 0/1 nodes")
        ));
        let loading = pods("new", 8, PodPhase::Running, Some(WorkerState::Restoring));
        assert!(matches!(
            decide(&s, &st, &with(loading)),
            Action::Wait { reason } if reason.contains("loading")
        ));
        let mut exited = idle.clone();
        exited[3].phase = PodPhase::Exited;
        assert!(matches!(
            decide(&s, &st, &with(exited)),
            Action::FallBack { message } if message.contains("subtask 3") && message.contains("exited")
        ));
        // An old worker lost: the rescale is abandoned (the job recovers as it would anyway).
        let mut broken = old.clone();
        broken[1].phase = PodPhase::Exited;
        broken.extend(idle.clone());
        assert!(matches!(
            decide(&s, &st, &obs(broken, Some(("old", 4)))),
            Action::Abandon { .. }
        ));
        // After an operator restart: the old workers are adopted, the new ones left aside.
        let mut all = old.clone();
        all.extend(idle);
        assert_eq!(
            decide(&s, &st, &obs(all, None)),
            Action::Adopt {
                run: "old".into(),
                parallelism: 4
            }
        );
    }

    #[test]
    fn a_prestaged_job_stops_only_with_every_new_worker_loaded() {
        let s = prestage_spec();
        let st = prestaging(Step::Savepointing);
        let old = pods("old", 4, PodPhase::Running, Some(WorkerState::Running));
        let with = |new: Vec<ObservedPod>| {
            let mut all = old.clone();
            all.extend(new);
            obs(all, Some(("old", 4)))
        };
        let loaded = pods("new", 8, PodPhase::Running, Some(WorkerState::Prestaged));
        assert_eq!(decide(&s, &st, &with(loaded.clone())), Action::Savepoint);
        let mut silent = loaded.clone();
        silent[2].worker = None;
        assert!(matches!(
            decide(&s, &st, &with(silent.clone())),
            Action::Wait { reason } if reason.contains("subtask 2")
        ));
        assert!(matches!(
            decide(&s, &st, &later(with(silent), 121)),
            Action::FallBack { .. }
        ));
        let mut restarted = loaded.clone();
        restarted[5].worker = Some(WorkerState::Idle);
        assert!(matches!(
            decide(&s, &st, &with(restarted)),
            Action::FallBack { message } if message.contains("subtask 5") && message.contains("before the job stopped")
        ));
        // Fallen back: the savepoint is taken as in a stop-and-restore, and the new workers go.
        let mut fell = st.clone();
        if let Some(r) = fell.rescale.as_mut() {
            r.fallback = Some("late".into());
        }
        assert_eq!(
            decide(&s, &fell, &with(loaded.clone())),
            Action::DeleteRun {
                run: "new".into(),
                reason: Reason::PrestageFellBack
            }
        );
        let mut going = loaded;
        for p in &mut going {
            p.deleting = true;
        }
        assert_eq!(decide(&s, &fell, &with(going)), Action::Savepoint);
    }

    #[test]
    fn a_prestaged_rescale_removes_only_the_old_workers_then_starts_the_new_ones() {
        let s = prestage_spec();
        let old = pods("old", 4, PodPhase::Running, Some(WorkerState::Stopped));
        let loaded = pods("new", 8, PodPhase::Running, Some(WorkerState::Prestaged));
        let mut all = old.clone();
        all.extend(loaded.clone());
        let st = prestaging(Step::Stopping);
        assert_eq!(
            decide(&s, &st, &obs(all, None)),
            Action::DeleteAllBut { keep: "new".into() }
        );
        assert_eq!(
            decide(&s, &st, &obs(loaded.clone(), None)),
            Action::Advance(Outcome::Stopped)
        );
        let st = prestaging(Step::Restoring);
        assert_eq!(
            decide(&s, &st, &obs(loaded.clone(), None)),
            Action::Start {
                run: "new".into(),
                parallelism: 8,
                restore: Restore::Url("s3://b/ns/j/checkpoints/chk-9".into())
            }
        );
        let mut lost = loaded;
        lost.remove(6);
        assert!(matches!(
            decide(&s, &st, &obs(lost, None)),
            Action::FallBack { message } if message.contains("subtask 6") && message.contains("before their start")
        ));
    }

    #[test]
    fn a_start_waiting_for_an_unschedulable_pod_says_why() {
        let s = spec(2);
        let mut waiting = pods("r", 2, PodPhase::Pending, None);
        let a = decide(&s, &status(), &obs(waiting.clone(), None));
        assert_eq!(
            a,
            Action::Wait {
                reason: "2 of 2 worker pod(s) not running yet".into()
            }
        );
        waiting[1].unschedulable = Some("0/1 nodes are available: 1 Too many pods.".into());
        let a = decide(&s, &status(), &obs(waiting, None));
        assert_eq!(
            a,
            Action::Wait {
                reason: "2 of 2 worker pod(s) not running yet; pod j-r-1 cannot be scheduled: 0/1 nodes are available: 1 Too many pods.".into()
            }
        );
    }
}
