//! The steps of a rescale (stop-and-restore and the ceiling change): which action each step asks
//! for, from status and what is observed.

use super::*;

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
pub(super) fn change_wait(change: &CeilingChange, obs: &Observed) -> Option<Duration> {
    match change {
        CeilingChange::Revert { .. } => None,
        CeilingChange::Rewrite { .. } => obs.change_retry_at.filter(|t| *t > obs.now).map(|t| {
            Duration::try_from(t.duration_since(obs.now)).unwrap_or(Duration::from_secs(1))
        }),
    }
}

pub(super) fn rescale_step(
    spec: &StreamJobSpec,
    settings: &JobSettings,
    r: &RescaleStatus,
    obs: &Observed,
) -> Action {
    // The old run's pods: never a pre-staged rescale's new workers.
    let old: Vec<ObservedPod> = match r.prestage_run() {
        Some(run) => obs.pods.iter().filter(|p| p.run != run).cloned().collect(),
        None => obs.pods.clone(),
    };
    match r.step {
        Step::Prestaging => prestaging(settings.timeouts.prestage, r, obs, &old),
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
                            if let Some(message) =
                                prestage_overdue(settings.timeouts.prestage, p, obs.now, &why)
                            {
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
                    requeue: Duration::try_from(t.duration_since(obs.now))
                        .unwrap_or(Duration::from_secs(1)),
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
                // A `last-state` upgrade took no savepoint: the latest checkpoint, unless it was
                // pre-staged (its stop checkpoint, recorded like a savepoint, is that one).
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
