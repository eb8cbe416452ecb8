//! Pure: status phase and kstatus conditions (`Ready`, `Reconciling`, `Stalled`, each with
//! observedGeneration) plus the domain conditions `KeyGroupsBalanced` and
//! `AllSubtasksHavePartitions`, from the status the shell arrived at.

use super::decide::step;
use crate::crd::{KeyGroupsStatus, Phase, StreamJobSpec, StreamJobStatus};
use crate::keygroup::Assignment;
use crate::validation::Analysis;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

pub const READY: &str = "Ready";
pub const RECONCILING: &str = "Reconciling";
pub const STALLED: &str = "Stalled";
pub const KEY_GROUPS_BALANCED: &str = "KeyGroupsBalanced";
pub const ALL_SUBTASKS_HAVE_PARTITIONS: &str = "AllSubtasksHavePartitions";

/// What the pass learned beyond the status fields.
#[derive(Debug, Clone, Default)]
pub struct Progress {
    /// The spec cannot run: (reason, message).
    pub stalled: Option<(String, String)>,
    /// What the operator waits for or just did: (reason, message), shown in Reconciling.
    pub note: Option<(String, String)>,
    /// The last failure (worker, savepoint, restore) that is being retried: (reason, message).
    pub failure: Option<(String, String)>,
}

/// Sets `type_` in `conditions`, keeping lastTransitionTime when the status does not change.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
    now: Timestamp,
) {
    let status = if status { "True" } else { "False" };
    let message: String = message.chars().take(32_000).collect();
    match conditions.iter_mut().find(|c| c.type_ == type_) {
        Some(c) => {
            if c.status != status {
                c.last_transition_time = Time(now);
            }
            c.status = status.into();
            c.reason = reason.into();
            c.message = message;
            c.observed_generation = generation;
        }
        None => conditions.push(Condition {
            type_: type_.into(),
            status: status.into(),
            reason: reason.into(),
            message,
            observed_generation: generation,
            last_transition_time: Time(now),
        }),
    }
}

/// Key-group spread of a running assignment, for status.keyGroups.
pub fn key_groups(assignment: Assignment) -> KeyGroupsStatus {
    let skew = assignment.skew();
    KeyGroupsStatus {
        summary: skew.summary(),
        ranges: assignment
            .ranges()
            .iter()
            .map(ToString::to_string)
            .collect(),
        min_groups: skew.min_groups as i32,
        max_groups: skew.max_groups as i32,
        skew: format!("{:.2}", skew.ratio),
    }
}

/// Whether the job runs as its spec asks.
pub fn is_ready(spec: &StreamJobSpec, status: &StreamJobStatus, progress: &Progress) -> bool {
    let rescaling = status
        .rescale
        .as_ref()
        .is_some_and(|r| step::active(&r.step));
    if progress.stalled.is_some() || rescaling {
        return false;
    }
    if spec.suspend {
        status.phase == Some(Phase::Suspended)
    } else {
        status.phase == Some(Phase::Running) && status.replicas == Some(spec.replicas)
    }
}

/// Fills observedGeneration, phase and conditions.
pub fn finish(
    spec: &StreamJobSpec,
    generation: Option<i64>,
    status: &mut StreamJobStatus,
    analysis: Option<&Analysis>,
    progress: &Progress,
    now: Timestamp,
) {
    status.observed_generation = generation;
    let rescale = status.rescale.as_ref().filter(|r| step::active(&r.step));
    if let Some(r) = rescale {
        status.phase = Some(if r.upgrade_mode.is_some() {
            Phase::Upgrading
        } else {
            Phase::Rescaling
        });
    } else if progress.stalled.is_some() && status.replicas.is_none() {
        status.phase = Some(Phase::Failed);
    } else if status.phase.is_none() {
        status.phase = Some(Phase::Pending);
    }
    let ready = is_ready(spec, status, progress);
    let conds = &mut status.conditions;
    match &progress.stalled {
        Some((reason, message)) => {
            set_condition(conds, STALLED, true, reason, message, generation, now);
            set_condition(conds, READY, false, reason, message, generation, now);
            set_condition(
                conds,
                RECONCILING,
                false,
                reason,
                "waiting for a spec that can run",
                generation,
                now,
            );
        }
        None => {
            set_condition(
                conds,
                STALLED,
                false,
                "SpecValid",
                "the spec can run",
                generation,
                now,
            );
            if ready {
                let (reason, message) = if spec.suspend {
                    (
                        "Suspended".to_owned(),
                        "suspended with a savepoint".to_owned(),
                    )
                } else {
                    (
                        "Running".to_owned(),
                        format!("running at parallelism {}", spec.replicas),
                    )
                };
                set_condition(conds, READY, true, &reason, &message, generation, now);
                set_condition(
                    conds,
                    RECONCILING,
                    false,
                    &reason,
                    &message,
                    generation,
                    now,
                );
            } else {
                let (reason, message) = match (rescale, &progress.failure, &progress.note) {
                    (Some(r), failure, _) => {
                        let what = if r.upgrade_mode.is_some() {
                            "upgrading"
                        } else if r.to == 0 {
                            "suspending"
                        } else {
                            "rescaling"
                        };
                        let mut m = format!("{what} {} -> {}: step {}", r.from, r.to, r.step);
                        if let Some((_, f)) = failure {
                            m.push_str(&format!(" (retrying after: {f})"));
                        }
                        (r.step.clone(), m)
                    }
                    (None, Some((reason, message)), _) => (reason.clone(), message.clone()),
                    (None, None, Some((reason, message))) => (reason.clone(), message.clone()),
                    (None, None, None) => (
                        "Progressing".to_owned(),
                        format!("bringing the job to parallelism {}", spec.replicas),
                    ),
                };
                set_condition(conds, READY, false, &reason, &message, generation, now);
                set_condition(conds, RECONCILING, true, &reason, &message, generation, now);
            }
        }
    }
    if let Some(a) = analysis {
        let skew = &a.skew;
        let (ok, reason) = if skew.divides {
            (true, "EvenSpread")
        } else {
            (false, "UnevenKeyGroups")
        };
        set_condition(
            conds,
            KEY_GROUPS_BALANCED,
            ok,
            reason,
            &skew.summary(),
            generation,
            now,
        );
        let partitions = spec
            .job
            .source
            .generator
            .as_ref()
            .map(|g| g.partitions.max(0));
        let (ok, reason, message) = if a.idle_subtasks > 0 {
            (
                false,
                "MoreSubtasksThanPartitions",
                format!(
                    "{} of {} subtasks read no source partition (the source has {} partitions); they still own key groups and process shuffled records",
                    a.idle_subtasks,
                    a.assignment.parallelism(),
                    partitions.unwrap_or_default()
                ),
            )
        } else {
            (
                true,
                "EverySubtaskReads",
                "every subtask reads at least one source partition".to_owned(),
            )
        };
        set_condition(
            conds,
            ALL_SUBTASKS_HAVE_PARTITIONS,
            ok,
            reason,
            &message,
            generation,
            now,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::RescaleStatus;
    use crate::operator::desired::tests_support::job;
    use crate::validation::analyse;

    fn cond<'a>(s: &'a StreamJobStatus, t: &str) -> &'a Condition {
        s.conditions.iter().find(|c| c.type_ == t).unwrap()
    }

    #[test]
    fn ready_only_when_running_at_the_requested_parallelism() {
        let spec = job().spec;
        let mut st = StreamJobStatus {
            phase: Some(Phase::Running),
            replicas: Some(4),
            max_parallelism: Some(128),
            ..Default::default()
        };
        let a = analyse(&spec, Some(&st)).unwrap();
        finish(
            &spec,
            Some(3),
            &mut st,
            Some(&a),
            &Progress::default(),
            Timestamp::now(),
        );
        assert_eq!(cond(&st, READY).status, "True");
        assert_eq!(cond(&st, READY).observed_generation, Some(3));
        assert_eq!(cond(&st, RECONCILING).status, "False");
        assert_eq!(cond(&st, STALLED).status, "False");
        assert_eq!(cond(&st, KEY_GROUPS_BALANCED).status, "True");
        assert_eq!(st.observed_generation, Some(3));

        let mut scaled = spec.clone();
        scaled.replicas = 3;
        st.rescale = Some(RescaleStatus {
            from: 4,
            to: 3,
            step: step::SAVEPOINTING.into(),
            ..Default::default()
        });
        let a = analyse(&scaled, Some(&st)).unwrap();
        finish(
            &scaled,
            Some(4),
            &mut st,
            Some(&a),
            &Progress::default(),
            Timestamp::now(),
        );
        assert_eq!(st.phase, Some(Phase::Rescaling));
        assert_eq!(cond(&st, READY).status, "False");
        assert_eq!(cond(&st, READY).reason, "Savepointing");
        assert_eq!(cond(&st, RECONCILING).status, "True");
        let kg = cond(&st, KEY_GROUPS_BALANCED);
        assert_eq!(kg.status, "False");
        assert!(kg.message.contains("divisors of 128"), "{}", kg.message);
    }

    #[test]
    fn stalled_names_the_problem_and_idle_subtasks_are_reported() {
        let mut spec = job().spec;
        spec.replicas = 8;
        let mut st = StreamJobStatus {
            max_parallelism: Some(128),
            ..Default::default()
        };
        let a = analyse(&spec, Some(&st)).unwrap();
        let p = Progress {
            stalled: Some(("AboveKeyGroupCeiling".into(), "too many".into())),
            ..Default::default()
        };
        finish(&spec, Some(1), &mut st, Some(&a), &p, Timestamp::now());
        assert_eq!(cond(&st, STALLED).status, "True");
        assert_eq!(cond(&st, STALLED).message, "too many");
        assert_eq!(cond(&st, READY).status, "False");
        assert_eq!(st.phase, Some(Phase::Failed));
        let idle = cond(&st, ALL_SUBTASKS_HAVE_PARTITIONS);
        assert_eq!(idle.status, "False");
        assert!(
            idle.message.starts_with("4 of 8 subtasks"),
            "{}",
            idle.message
        );
    }
}
