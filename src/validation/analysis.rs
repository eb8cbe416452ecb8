//! What the API server cannot check: the derived default key-group count, skew, idle subtasks,
//! and where the ceiling comes from; what the operator turns into conditions.

use super::*;

/// Where the key-group count of a job comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CeilingSource {
    /// Pinned in status at the job's first snapshot.
    Pinned,
    /// Set in spec.maxParallelism.
    Spec,
    /// Derived from spec.replicas by Flink's default rule (not yet pinned).
    Default,
}

/// What the operator (or `keyshift local`) concludes about a valid spec.
#[derive(Debug, Clone, PartialEq)]
pub struct Analysis {
    pub assignment: Assignment,
    pub ceiling_source: CeilingSource,
    pub skew: Skew,
    /// Subtasks that will read no source partition (they still own key groups).
    pub idle_subtasks: u32,
    /// The source's partition count, when known (see [`snapshot_partitions`]).
    pub source_partitions: Option<u32>,
}

/// Problems only visible with the derived key-group count; each becomes a Stalled condition.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AnalysisError {
    #[error(
        "spec.replicas {replicas} exceeds the key-group ceiling {ceiling} ({source_text}): lower replicas to at most {ceiling}, or raise the ceiling offline with `keyshift savepoint rewrite <savepoint> --max-parallelism <G> --to <url>` and restore from the rewritten savepoint"
    )]
    AboveCeiling {
        replicas: i32,
        ceiling: u32,
        source_text: &'static str,
    },
    #[error(
        "spec.replicas {replicas} does not divide the key-group count {ceiling} and spec.keyGroupPolicy is Strict: {summary}; choose one of those divisors or set keyGroupPolicy: Warn"
    )]
    StrictNonDivisor {
        replicas: i32,
        ceiling: u32,
        summary: String,
    },
    #[error("{0}")]
    Bounds(#[from] BoundsError),
}

/// The partition count recorded with the newest of the job's latest checkpoint and savepoint,
/// if it recorded one ([`crate::crd::SnapshotRef::source_partitions`]).
pub fn snapshot_partitions(status: &StreamJobStatus) -> Option<u32> {
    [&status.last_checkpoint, &status.last_savepoint]
        .into_iter()
        .flatten()
        .max_by_key(|s| s.id)
        .and_then(|s| s.source_partitions)
        .and_then(|n| u32::try_from(n).ok())
}

/// Resolves the key-group count and checks what CEL cannot: the derived default ceiling, Strict
/// against it, skew and idle subtasks.
pub fn analyse(
    spec: &StreamJobSpec,
    status: Option<&StreamJobStatus>,
) -> Result<Analysis, AnalysisError> {
    let pinned = status.and_then(|s| s.max_parallelism);
    let (ceiling, ceiling_source) = match (pinned, spec.max_parallelism) {
        // A count other than the pinned one is where the job goes (a managed change of the
        // key-group count, or a restore of a rewritten savepoint).
        (Some(p), Some(g)) if g != p => (i64::from(g), CeilingSource::Spec),
        (Some(p), _) => (i64::from(p), CeilingSource::Pinned),
        (None, Some(g)) => (i64::from(g), CeilingSource::Spec),
        (None, None) => (
            i64::from(keygroup::default_max_parallelism(
                spec.replicas.max(1) as u32
            )),
            CeilingSource::Default,
        ),
    };
    let assignment = match Assignment::new(i64::from(spec.replicas), ceiling) {
        Ok(a) => a,
        Err(BoundsError::ParallelismAboveCeiling {
            max_parallelism, ..
        }) => {
            return Err(AnalysisError::AboveCeiling {
                replicas: spec.replicas,
                ceiling: max_parallelism,
                source_text: match ceiling_source {
                    CeilingSource::Pinned => {
                        "pinned in status.maxParallelism at the job's first snapshot"
                    }
                    CeilingSource::Spec => "set in spec.maxParallelism",
                    CeilingSource::Default => "derived by default from spec.replicas",
                },
            });
        }
        Err(e) => return Err(e.into()),
    };
    let skew = assignment.skew();
    if spec.key_group_policy == KeyGroupPolicy::Strict && !skew.divides {
        return Err(AnalysisError::StrictNonDivisor {
            replicas: spec.replicas,
            ceiling: assignment.max_parallelism(),
            summary: skew.summary(),
        });
    }
    // The generator's partitions are its spec's; a file or Kafka source's are what its latest
    // snapshot listed (the brokers' metadata for Kafka), unknown before the first one.
    let partitions = spec
        .job
        .source
        .generator
        .as_ref()
        .map(|g| g.partitions.max(0) as u32)
        .or_else(|| status.and_then(snapshot_partitions));
    let idle_subtasks = partitions.map_or(0, |n| assignment.parallelism().saturating_sub(n));
    Ok(Analysis {
        source_partitions: partitions,
        assignment,
        ceiling_source,
        skew,
        idle_subtasks,
    })
}
