//! Pure: from what the operator observes (spec, status, pods, worker states) to the one next
//! action. The I/O shell (`reconcile`) executes the action and records its outcome in status;
//! the step of a rescale is always in status before the step acts, so a restarted operator
//! resumes from status.
//!
//! `observe` holds the observation model, `action` the actions, `spec` what spec and status say,
//! `rescale` and `prestage` the steps of a rescale; [`decide`] here puts them together.

use crate::crd::{RescaleStatus, RescaleStrategy, StreamJobSpec, StreamJobStatus, UpgradeMode};
use crate::orchestrator::settings::JobSettings;
use crate::runtime::protocol::WorkerState;
use crate::validation::{self, Analysis};
use jiff::Timestamp;
use keyshift_core::reason::Reason;
use keyshift_core::step::{Outcome, Step};
use std::collections::BTreeMap;
use std::time::Duration;

mod action;
mod observe;
mod prestage;
mod rescale;
mod spec;
#[cfg(test)]
mod tests;

pub use self::action::*;
pub use self::observe::*;
use self::prestage::*;
pub use self::rescale::*;
pub use self::spec::*;

/// What to do next, for a spec read here: a pass reads its spec once ([`JobSettings::read`])
/// and calls [`decide_with`].
pub fn decide(spec: &StreamJobSpec, status: &StreamJobStatus, obs: &Observed) -> Action {
    decide_with(spec, &JobSettings::read(spec), status, obs)
}

/// What to do next: `settings` is `spec` as the pass read it.
pub fn decide_with(
    spec: &StreamJobSpec,
    settings: &JobSettings,
    status: &StreamJobStatus,
    obs: &Observed,
) -> Action {
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
    // A start of this spec was refused for good: nothing is started until the spec changes
    // (a retry would be refused the same way), except the rollback of a rescale whose new run
    // was refused (the old parallelism restores). A suspend is a change of the spec too.
    if obs.active.is_none()
        && let Some(refusal) = &obs.start_refused
        && !status
            .rescale
            .as_ref()
            .is_some_and(|r| r.step.active() && r.rolled_back.is_some())
        && refusal.refuses(recovery_parallelism(
            status,
            settings.desired_parallelism,
            pending.is_some(),
        ))
    {
        // A run still up at a parallelism the refusal leaves alone (the job ran on while its
        // change was refused, and this process is new: a restart, another leader): it is
        // coordinated again and runs on, Stalled on the change.
        if let Some((run, parallelism)) = adoptable(&obs.pods)
            && !refusal.refuses(parallelism)
        {
            return Action::Adopt { run, parallelism };
        }
        // The run the refused change left running has ended since: it comes back at the
        // parallelism it ran at (status.replicas), from its newest snapshot, unless that one is
        // refused too (an upgrade's, at the same parallelism).
        if let Some(ran) = status.replicas.and_then(|r| u32::try_from(r).ok())
            && ran > 0
            && pending.is_none()
            && !refusal.refuses(ran)
        {
            return bring_up(&obs.pods, ran, Restore::Latest, &obs.new_run, obs.now);
        }
        return Action::Stall {
            reason: refusal.reason,
            message: refusal.stopped_message(),
        };
    }
    if let Some(r) = status.rescale.as_ref().filter(|r| r.step.active()) {
        return rescale_step(spec, settings, r, obs);
    }
    let change = match pending {
        Some(_) => None,
        None => ceiling_change(spec, status),
    };

    let desired = settings.desired_parallelism;
    let backoff = obs.backoff_until.filter(|t| *t > obs.now).map(|t| {
        Duration::try_from(t.duration_since(obs.now))
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
        // A change to a parallelism whose start was refused for good is not begun again while
        // the spec stays (the pass reports the stall; the running job goes on).
        if desired != active.parallelism && !obs.refuses_start_at(desired) {
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
        let want = &settings.spec_hash;
        if obs.upgrade_refused.is_none()
            && !obs.refuses_start_at(active.parallelism)
            && obs.pods.iter().any(|p| {
                p.run == active.run && p.spec_hash.as_deref().is_some_and(|h| h != want.as_str())
            })
        {
            if let Some(requeue) = backoff {
                return Action::Idle { requeue };
            }
            // An upgrade that keeps the state is pre-staged like a rescale: the new spec's
            // workers are up and have checked the state (a refusal leaves the job running)
            // before the job stops, with its savepoint (`savepoint`) or with a checkpoint that
            // writes only what changed since they loaded (`last-state`).
            let prestage = (spec.rescale_strategy == RescaleStrategy::Prestage
                && spec.upgrade_mode != UpgradeMode::Stateless)
                .then(|| obs.new_run.clone());
            return Action::BeginUpgrade {
                parallelism: active.parallelism,
                mode: spec.upgrade_mode,
                prestage,
            };
        }
        if backoff.is_none() {
            if let Some(nonce) = spec.savepoint_trigger_nonce
                && status.last_savepoint_nonce != Some(nonce)
            {
                return Action::TriggerSavepoint {
                    trigger: SavepointTrigger::Nonce(nonce),
                };
            }
            if let Some(name) = &obs.savepoint_request {
                return Action::TriggerSavepoint {
                    trigger: SavepointTrigger::Snapshot(name.clone()),
                };
            }
        }
        let interval = settings.checkpoint_interval;
        let due = obs.last_snapshot_at.map_or(obs.now, |t| {
            t.saturating_add(jiff::SignedDuration::try_from(interval).unwrap_or_default())
                .unwrap_or(jiff::Timestamp::MAX)
        });
        if due <= obs.now {
            return Action::Checkpoint;
        }
        return Action::Idle {
            requeue: Duration::try_from(due.duration_since(obs.now))
                .unwrap_or(interval)
                .min(interval),
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

/// Steps towards a started run of `parallelism` workers.
fn bring_up(
    pods: &[ObservedPod],
    parallelism: u32,
    restore: Restore,
    new_run: &str,
    now: Timestamp,
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
