//! The steps of a transition (a rescale, an upgrade, a suspend, a restore from
//! `spec.restoreFrom`) and the one function that says which step follows which outcome.
//!
//! A transition's step lives in `status.rescale.step` and is written there before the step acts,
//! so a restarted orchestrator resumes from it. Steps serialize to the strings users read in
//! `kubectl get/describe` (`Savepointing`, ...); the CRD keeps the field a string.
//!
//! ```text
//! Prestaging --Prestaged / FellBack--> Savepointing      (spec.rescaleStrategy: Prestage)
//!      +--GaveUp--> Abandoned
//!
//! Savepointing --SavepointTaken--> Verifying --Verified--> Stopping --Stopped--> Restoring
//!      |                              |                       |                   |  ^
//!      +--Abandoned--> Abandoned <----+      StoppedForRewrite|  RestoreFailed (rollback) +--+
//!                                                             v                    |
//!                                      Rewriting --Rewritten--> VerifyingRewrite   |
//!                                          |                      |   |            |
//!                                          +--RewriteFailed-------+   +--RewriteVerified--> Restoring
//!                                             (rollback: Restoring the original savepoint
//!                                              at the old parallelism and key-group count)
//!
//!                        Done <--Restored--+--RestoredAfterRollback--> RolledBack
//! ```
//!
//! A pre-staged rescale starts at Prestaging: the new workers are created beside the old ones
//! and load their key groups from the newest checkpoint while the job runs. Its Savepointing
//! step then stops the job with an incremental checkpoint (the delta since what they loaded),
//! Verifying checks the files that checkpoint wrote, Stopping removes only the old workers and
//! Restoring starts the pre-staged ones from the checkpoint. If the new workers are not ready
//! in time, or one is lost before the start, the rescale falls back (`FellBack`): they are
//! removed and the steps go on as a stop-and-restore.
//!
//! A change of the key-group count (spec.maxParallelism) takes the savepoint, stops the old
//! workers, rewrites the savepoint to the new count (a new savepoint; the original is never
//! touched), verifies the rewritten one down to every key, and restores it.

use crate::spec::UpgradeMode;
use serde::{Deserialize, Serialize};
use std::fmt;

/// A step of a transition.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub enum Step {
    /// Start the new workers beside the running job and load their key groups from its newest
    /// checkpoint (spec.rescaleStrategy: Prestage).
    Prestaging,
    /// Stop the sources with a savepoint (the job's state is kept in it).
    #[default]
    Savepointing,
    /// Check every file of the savepoint before anything stops.
    Verifying,
    /// Remove the old workers.
    Stopping,
    /// Re-hash the savepoint's keys into the new key-group count, into a new savepoint (a
    /// change of spec.maxParallelism; the original savepoint is only read).
    Rewriting,
    /// Check the rewritten savepoint fully: every block, every key's new group, and as many
    /// keys as the original.
    VerifyingRewrite,
    /// Start the new workers, restoring their key groups.
    Restoring,
    /// Finished: the job runs at the new parallelism (or is suspended).
    Done,
    /// Given up before the old workers stopped: the job keeps its old parallelism.
    Abandoned,
    /// Restoring at the new parallelism failed; the old parallelism was restored from the same
    /// savepoint.
    RolledBack,
}

/// Every step, in protocol order (for tables and tests).
pub const ALL_STEPS: [Step; 10] = [
    Step::Prestaging,
    Step::Savepointing,
    Step::Verifying,
    Step::Stopping,
    Step::Rewriting,
    Step::VerifyingRewrite,
    Step::Restoring,
    Step::Done,
    Step::Abandoned,
    Step::RolledBack,
];

impl Step {
    /// The name users read (and status stores).
    pub fn as_str(self) -> &'static str {
        match self {
            Step::Prestaging => "Prestaging",
            Step::Savepointing => "Savepointing",
            Step::Verifying => "Verifying",
            Step::Stopping => "Stopping",
            Step::Rewriting => "Rewriting",
            Step::VerifyingRewrite => "VerifyingRewrite",
            Step::Restoring => "Restoring",
            Step::Done => "Done",
            Step::Abandoned => "Abandoned",
            Step::RolledBack => "RolledBack",
        }
    }

    /// Whether the transition is in flight (not finished or given up).
    pub fn active(self) -> bool {
        matches!(
            self,
            Step::Prestaging
                | Step::Savepointing
                | Step::Verifying
                | Step::Stopping
                | Step::Rewriting
                | Step::VerifyingRewrite
                | Step::Restoring
        )
    }

    /// Whether the old workers may already be gone: the transition must then go on to a started
    /// run (to its target, or back), never be abandoned.
    pub fn past_savepoint(self) -> bool {
        self.active() && !matches!(self, Step::Prestaging | Step::Savepointing)
    }

    /// The first step of an upgrade in `mode`: `savepoint` keeps the state in a savepoint first;
    /// `last-state` and `stateless` stop at once.
    pub fn first_of_upgrade(mode: UpgradeMode) -> Step {
        match mode {
            UpgradeMode::Savepoint => Step::Savepointing,
            UpgradeMode::LastState | UpgradeMode::Stateless => Step::Stopping,
        }
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a step's work ended with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Every new worker of a pre-staged rescale loaded its key groups.
    Prestaged,
    /// A pre-staged rescale cannot use its new workers (not ready in time, or one was lost):
    /// they are removed and the rescale goes on as a stop-and-restore.
    FellBack,
    /// The savepoint committed (sources stopped at its barrier).
    SavepointTaken,
    /// Every file of the savepoint checked out.
    Verified,
    /// Every old worker is gone.
    Stopped,
    /// Every old worker is gone, and the savepoint must be rewritten to a new key-group count
    /// before anything restores it.
    StoppedForRewrite,
    /// The rewritten savepoint committed.
    Rewritten,
    /// The rewritten savepoint checked out (every block and key, the key count).
    RewriteVerified,
    /// The rewrite failed or its result did not verify (or spec.maxParallelism was set back):
    /// the original savepoint is restored at the old parallelism and key-group count.
    RewriteFailed,
    /// The new run started at the transition's target.
    Restored,
    /// Starting the new run failed; the old parallelism is restored next, from the same
    /// savepoint.
    RestoreFailed,
    /// After a rollback, the run at the old parallelism started.
    RestoredAfterRollback,
    /// The step cannot go on (savepoint failed, verification failed, workers gone before the
    /// savepoint): the job keeps (or returns to) its old parallelism.
    GaveUp,
}

/// Every outcome (for tables and tests).
pub const ALL_OUTCOMES: [Outcome; 13] = [
    Outcome::Prestaged,
    Outcome::FellBack,
    Outcome::SavepointTaken,
    Outcome::Verified,
    Outcome::Stopped,
    Outcome::StoppedForRewrite,
    Outcome::Rewritten,
    Outcome::RewriteVerified,
    Outcome::RewriteFailed,
    Outcome::Restored,
    Outcome::RestoreFailed,
    Outcome::RestoredAfterRollback,
    Outcome::GaveUp,
];

/// An outcome that cannot happen in a step: a bug in the caller, reported instead of acted on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("illegal transition: outcome {outcome:?} in step {step}")]
pub struct IllegalTransition {
    pub step: Step,
    pub outcome: Outcome,
}

/// The step that follows `outcome` in `step`: the whole protocol in one table.
pub fn next(step: Step, outcome: Outcome) -> Result<Step, IllegalTransition> {
    use Outcome as O;
    use Step as S;
    match (step, outcome) {
        (S::Prestaging, O::Prestaged | O::FellBack) => Ok(S::Savepointing),
        // The new workers were lost before the stop (Savepointing) or before their start
        // (Restoring): the same step goes on without them.
        (S::Savepointing, O::FellBack) => Ok(S::Savepointing),
        (S::Restoring, O::FellBack) => Ok(S::Restoring),
        (S::Savepointing, O::SavepointTaken) => Ok(S::Verifying),
        (S::Verifying, O::Verified) => Ok(S::Stopping),
        (S::Stopping, O::Stopped) => Ok(S::Restoring),
        (S::Stopping, O::StoppedForRewrite) => Ok(S::Rewriting),
        (S::Rewriting, O::Rewritten) => Ok(S::VerifyingRewrite),
        (S::VerifyingRewrite, O::RewriteVerified) => Ok(S::Restoring),
        // The old workers are gone: back is a restore of the untouched original savepoint.
        (S::Rewriting | S::VerifyingRewrite, O::RewriteFailed) => Ok(S::Restoring),
        (S::Restoring, O::Restored) => Ok(S::Done),
        (S::Restoring, O::RestoreFailed) => Ok(S::Restoring),
        (S::Restoring, O::RestoredAfterRollback) => Ok(S::RolledBack),
        // Only before the old workers stop: afterwards the only way is forward (or back by a
        // rollback), never "keep the old run", which no longer exists.
        (S::Prestaging | S::Savepointing | S::Verifying, O::GaveUp) => Ok(S::Abandoned),
        _ => Err(IllegalTransition { step, outcome }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole table, written out: every (step, outcome) pair is listed with its expected
    /// result, so a change to `next` must change this table too.
    #[test]
    fn every_step_and_outcome_pair() {
        use Outcome as O;
        use Step as S;
        let legal: &[(Step, Outcome, Step)] = &[
            (S::Prestaging, O::Prestaged, S::Savepointing),
            (S::Prestaging, O::FellBack, S::Savepointing),
            (S::Prestaging, O::GaveUp, S::Abandoned),
            (S::Savepointing, O::FellBack, S::Savepointing),
            (S::Restoring, O::FellBack, S::Restoring),
            (S::Savepointing, O::SavepointTaken, S::Verifying),
            (S::Savepointing, O::GaveUp, S::Abandoned),
            (S::Verifying, O::Verified, S::Stopping),
            (S::Verifying, O::GaveUp, S::Abandoned),
            (S::Stopping, O::Stopped, S::Restoring),
            (S::Stopping, O::StoppedForRewrite, S::Rewriting),
            (S::Rewriting, O::Rewritten, S::VerifyingRewrite),
            (S::Rewriting, O::RewriteFailed, S::Restoring),
            (S::VerifyingRewrite, O::RewriteVerified, S::Restoring),
            (S::VerifyingRewrite, O::RewriteFailed, S::Restoring),
            (S::Restoring, O::Restored, S::Done),
            (S::Restoring, O::RestoreFailed, S::Restoring),
            (S::Restoring, O::RestoredAfterRollback, S::RolledBack),
        ];
        let mut checked = 0;
        for step in ALL_STEPS {
            for outcome in ALL_OUTCOMES {
                let want = legal
                    .iter()
                    .find(|(s, o, _)| *s == step && *o == outcome)
                    .map(|(_, _, n)| *n);
                match (next(step, outcome), want) {
                    (Ok(got), Some(want)) => assert_eq!(got, want, "{step} x {outcome:?}"),
                    (Err(e), None) => {
                        assert_eq!(e, IllegalTransition { step, outcome });
                        assert!(e.to_string().contains(step.as_str()));
                    }
                    (got, want) => panic!("{step} x {outcome:?}: got {got:?}, want {want:?}"),
                }
                checked += 1;
            }
        }
        assert_eq!(checked, ALL_STEPS.len() * ALL_OUTCOMES.len());
    }

    #[test]
    fn finished_steps_accept_no_outcome_and_active_steps_lead_somewhere() {
        for step in ALL_STEPS {
            let leads = ALL_OUTCOMES.iter().any(|o| next(step, *o).is_ok());
            assert_eq!(leads, step.active(), "{step}");
        }
    }

    #[test]
    fn steps_serialize_to_the_names_users_read() {
        for step in ALL_STEPS {
            let json = serde_json::to_string(&step).unwrap();
            assert_eq!(json, format!("\"{}\"", step.as_str()));
            let back: Step = serde_json::from_str(&json).unwrap();
            assert_eq!(back, step);
            assert_eq!(step.to_string(), step.as_str());
        }
        assert!(serde_json::from_str::<Step>("\"Paused\"").is_err());
    }

    #[test]
    fn only_steps_after_the_savepoint_are_past_it() {
        let past: Vec<Step> = ALL_STEPS
            .into_iter()
            .filter(|s| s.past_savepoint())
            .collect();
        assert_eq!(
            past,
            [
                Step::Verifying,
                Step::Stopping,
                Step::Rewriting,
                Step::VerifyingRewrite,
                Step::Restoring
            ]
        );
    }

    #[test]
    fn upgrades_start_where_their_mode_says() {
        assert_eq!(
            Step::first_of_upgrade(UpgradeMode::Savepoint),
            Step::Savepointing
        );
        assert_eq!(
            Step::first_of_upgrade(UpgradeMode::LastState),
            Step::Stopping
        );
        assert_eq!(
            Step::first_of_upgrade(UpgradeMode::Stateless),
            Step::Stopping
        );
    }
}
