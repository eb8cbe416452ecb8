//! The pre-staged rescale's own waits: whether the new workers are loaded, overdue or unused.

use super::*;

/// The Prestaging step: the old run goes on (coordinated again after an operator restart);
/// the new run's pods are created and, once all run, pre-staged; if they are not ready within
/// spec.state.prestageTimeout, or one is lost, the rescale falls back to stop-and-restore.
pub(super) fn prestaging(
    timeout: Duration,
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
    if let Some(message) = prestage_overdue(timeout, p, obs.now, &why) {
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
pub(super) enum Readiness {
    /// Every one runs and holds its key groups.
    Ready,
    /// Not yet known (a worker did not answer).
    NotYet(String),
    /// One is gone, exited, being deleted, or lost what it loaded.
    Lost(String),
}

/// Whether the `to` workers of run `run` are all there and pre-staged.
pub(super) fn prestage_ready(pods: &[ObservedPod], run: &str, to: u32) -> Readiness {
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
/// (`timeout`) since its pods were first asked for.
pub(super) fn prestage_overdue(
    timeout: Duration,
    p: &crate::crd::PrestageStatus,
    now: Timestamp,
    why: &str,
) -> Option<String> {
    let since = p.since.parse::<Timestamp>().ok()?;
    let deadline = since
        .saturating_add(
            jiff::SignedDuration::try_from(timeout).unwrap_or(jiff::SignedDuration::MAX),
        )
        .unwrap_or(Timestamp::MAX);
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
pub(super) fn unused_prestage(r: &RescaleStatus, obs: &Observed) -> Option<String> {
    let run = r.prestage_run()?;
    let unused = r.fallback.is_some() || matches!(r.step, Step::Abandoned | Step::RolledBack);
    (unused && obs.pods.iter().any(|p| p.run == run && !p.deleting)).then(|| run.to_owned())
}
