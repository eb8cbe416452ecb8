//! Every reason the orchestration writes: the `reason` of a status condition (`Ready`,
//! `Reconciling`, `Stalled`, `CheckpointsHealthy`, ...) and of a Kubernetes Event. One typed
//! list, so `docs/troubleshooting.md` can be checked against it (tests/docs_reasons.rs): each
//! reason is in the doc's table and the table names no other.

use std::fmt;

macro_rules! reasons {
    ($($(#[$doc:meta])* $name:ident),+ $(,)?) => {
        /// A condition or Event reason.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Reason {
            $($(#[$doc])* $name,)+
        }

        impl Reason {
            /// Every reason, in declaration order.
            pub const ALL: &'static [Reason] = &[$(Reason::$name,)+];

            /// The reason a condition or Event wrote as `s` (`None`: not one of ours).
            pub fn parse(s: &str) -> Option<Reason> {
                Reason::ALL.iter().copied().find(|r| r.as_str() == s)
            }

            /// The string written into conditions and Events.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(Reason::$name => stringify!($name),)+
                }
            }
        }
    };
}

reasons! {
    // Ready / Reconciling.
    /// Ready: the job runs at spec.replicas.
    Running,
    /// Ready: suspended with a savepoint; also the reason workers are deleted for a suspend and
    /// the Event when the suspend completed.
    Suspended,
    /// Reconciling: nothing more specific to say; the job is being brought to spec.replicas.
    Progressing,
    /// Reconciling: a transition's step, or a run starting from a snapshot.
    Prestaging,
    Savepointing,
    Verifying,
    Stopping,
    Rewriting,
    VerifyingRewrite,
    Restoring,
    /// Reconciling: waiting for workers (a message says for what).
    Waiting,
    /// Reconciling: worker pods were just created.
    CreatingPods,
    /// Reconciling: pods of an older run are removed.
    StaleRun,
    /// Reconciling: a worker exited; the run is restarted from the last snapshot.
    WorkerExited,
    /// Reconciling: the run's state could not be read after an operator restart.
    UnknownRunState,
    /// Stalled False.
    SpecValid,
    // Stalled True (and a warning Event).
    AboveKeyGroupCeiling,
    StrictNonDivisor,
    InvalidSpec,
    RestoreFromKeyGroupMismatch,
    RestoreFromUnusable,
    /// Stalled: spec.restoreFrom names a StreamJobSnapshot that does not exist or is not Ready.
    SnapshotNotReady,
    SnapshotOfAnotherJob,
    StateLayoutChanged,
    /// Stalled: the restore would go back past sink output already published (its results
    /// would be published twice) and spec.allowRepublishingOutput is not set.
    OutputWouldRepeat,
    /// Stalled: the workers refused the start for good (a program their image does not carry,
    /// a spec they cannot run, a snapshot of another schema or key-group count): no retry can
    /// change that, the job waits for a changed spec.
    StartRefused,
    NoStorage,
    ImageNotAllowed,
    ServiceAccountNotAllowed,
    /// Stalled: the job's sink would write where an older job's sink writes (one exactly-once
    /// Kafka transactional id on the same cluster, or one object-store output directory).
    SinkInUse,
    // Failures being retried (Reconciling, and a warning Event).
    WorkerFailed,
    StartFailed,
    SavepointFailed,
    RescaleAbandoned,
    RescaleRolledBack,
    /// A pre-staged rescale fell back to stop-and-restore (its new workers were not ready in
    /// time, or one was lost); also the reason its new workers are deleted.
    PrestageFellBack,
    /// A change of spec.maxParallelism was rolled back: the job runs from its original
    /// savepoint at the old key-group count.
    KeyGroupChangeRolledBack,
    // CheckpointsHealthy.
    Checkpointing,
    CheckpointsFailing,
    // NewestSnapshotRestored.
    Restored,
    UnreadableSnapshotSkipped,
    // SinkPublished.
    Published,
    PublishBehind,
    // KafkaReachable.
    KafkaReachable,
    KafkaUnreachable,
    // KeyGroupsBalanced.
    EvenSpread,
    UnevenKeyGroups,
    // AllSubtasksHavePartitions.
    EverySubtaskReads,
    MoreSubtasksThanPartitions,
    // Events only.
    KeyGroupsPinned,
    RescaleStarted,
    /// The new workers of a pre-staged rescale loaded their key groups.
    Prestaged,
    Suspending,
    RestoreStarted,
    UpgradeStarted,
    DeletingPods,
    CreatedPods,
    Started,
    Rescaled,
    Upgraded,
    RescaleRollingBack,
    KeyGroupChangeStarted,
    SavepointRewritten,
    RewriteVerified,
    KeyGroupsChanged,
    KeyGroupChangeIrreversible,
    SavepointTaken,
    SavepointVerified,
    CheckpointFailed,
    SinkPublishBehind,
    /// A run started from a snapshot whose Kafka offsets lay below a partition's earliest
    /// record: retention deleted records the job had not read.
    SourceRecordsExpired,
    Deleted,
    // A StreamJobSnapshot's Ready condition and Events.
    /// Ready False: the snapshot waits for its job to take it.
    SnapshotPending,
    /// Ready True: the snapshot exists and can be restored (taken, or recorded from spec.path).
    SnapshotReady,
    /// Ready False, phase Failed: spec.path names no committed snapshot, or one that does not
    /// check out.
    SnapshotUnusable,
    /// Event: the deleted snapshot's files were disposed of.
    SnapshotDisposed,
    /// Event: the deleted snapshot's files were kept (spec.deletionPolicy Retain).
    SnapshotRetained,
    /// Event: the deletion waits, the job still needs the snapshot.
    SnapshotInUse,
    /// Event: spec.snapshotRetention of its job deleted the snapshot.
    SnapshotRetired,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<Reason> for String {
    fn from(r: Reason) -> String {
        r.as_str().to_owned()
    }
}

impl PartialEq<Reason> for String {
    fn eq(&self, other: &Reason) -> bool {
        self == other.as_str()
    }
}

impl PartialEq<Reason> for &str {
    fn eq(&self, other: &Reason) -> bool {
        *self == other.as_str()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_camel_case_words() {
        let mut seen = std::collections::BTreeSet::new();
        for r in Reason::ALL {
            let s = r.as_str();
            assert!(seen.insert(s), "{s} twice");
            assert!(
                s.chars().next().is_some_and(|c| c.is_ascii_uppercase()),
                "{s}"
            );
            assert!(s.chars().all(|c| c.is_ascii_alphanumeric()), "{s}");
        }
        assert_eq!(seen.len(), Reason::ALL.len());
        assert_eq!(Reason::RescaleRolledBack.to_string(), "RescaleRolledBack");
    }
}
