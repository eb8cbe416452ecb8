//! Pure: status phase and kstatus conditions (`Ready`, `Reconciling`, `Stalled`, each with
//! observedGeneration) plus the domain conditions `KeyGroupsBalanced` and
//! `AllSubtasksHavePartitions`, from the status the shell arrived at.

use crate::crd::{
    KeyGroupsStatus, Phase, RestoreStatus, StateDistribution, StreamJobSpec, StreamJobStatus,
};
use crate::orchestrator::coordinator::StartProgress;
use crate::validation::Analysis;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use keyshift_core::keygroup::Assignment;
use keyshift_core::reason::Reason;

pub const READY: &str = "Ready";
pub const RECONCILING: &str = "Reconciling";
pub const STALLED: &str = "Stalled";
pub const KEY_GROUPS_BALANCED: &str = "KeyGroupsBalanced";
pub const ALL_SUBTASKS_HAVE_PARTITIONS: &str = "AllSubtasksHavePartitions";
/// Jobs with an object-store sink: whether every committed snapshot's output is published.
pub const SINK_PUBLISHED: &str = "SinkPublished";
/// Whether the job's last resume of its own history restored its newest snapshot (False when
/// it passed over snapshots whose manifest cannot be used).
pub const NEWEST_SNAPSHOT_RESTORED: &str = "NewestSnapshotRestored";
/// Whether the running job's periodic checkpoints succeed (False after two failures in a row).
pub const CHECKPOINTS_HEALTHY: &str = "CheckpointsHealthy";
/// Jobs with a Kafka source or sink: whether every Kafka client of the job (the workers'
/// source consumers, the coordinator's exactly-once publisher) reaches its brokers.
pub const KAFKA_REACHABLE: &str = "KafkaReachable";
/// Every condition type the operator sets (docs/troubleshooting.md lists each one; a test checks).
pub const ALL_CONDITIONS: [&str; 9] = [
    READY,
    RECONCILING,
    STALLED,
    KEY_GROUPS_BALANCED,
    ALL_SUBTASKS_HAVE_PARTITIONS,
    SINK_PUBLISHED,
    NEWEST_SNAPSHOT_RESTORED,
    CHECKPOINTS_HEALTHY,
    KAFKA_REACHABLE,
];
/// Consecutive checkpoint failures from which CheckpointsHealthy is False.
pub const CHECKPOINT_FAILURES_UNHEALTHY: u32 = 2;

/// What the pass learned beyond the status fields.
#[derive(Debug, Clone, Default)]
pub struct Progress {
    /// The spec cannot run: (reason, message).
    pub stalled: Option<(String, String)>,
    /// What the operator waits for or just did: (reason, message), shown in Reconciling.
    pub note: Option<(String, String)>,
    /// The last failure (worker, savepoint, restore) that is being retried: (reason, message).
    pub failure: Option<(String, String)>,
    /// What the pass did to the run: started or adopted it (Running), removed it to restart it
    /// (Pending), suspended it (Suspended). [`finish`] is the only writer of `status.phase`.
    pub phase: Option<Phase>,
    /// For a job with an object-store sink whose run is coordinated: the committed snapshots
    /// whose output is not published yet, and why the last attempt failed.
    pub sink: Option<crate::orchestrator::coordinator::PublishBacklog>,
    /// A start that resumes the job's own history chose its snapshot: Ok when it is the newest,
    /// else what it passed over.
    pub restored_newest: Option<Result<(), String>>,
    /// For a running job: the periodic checkpoints that failed in a row (0 when the last one
    /// committed) and the last error.
    pub checkpoint_failures: Option<(u32, String)>,
    /// For a job with a Kafka source or sink whose run is coordinated: what cannot reach its
    /// brokers now, one line each naming the client, its bootstrap servers and the client's
    /// error (empty: every client reached them at its last attempt).
    pub kafka: Option<Vec<String>>,
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

/// How a snapshot's state is spread over its subtasks and key groups (pure: from the manifest).
/// `None` if the manifest's assignment is invalid (a committed manifest never is).
pub fn state_distribution(m: &crate::snapshot::Manifest) -> Option<StateDistribution> {
    let assignment = m.assignment().ok()?;
    let p = assignment.parallelism() as usize;
    let mut bytes = vec![0u64; p];
    let mut keys = vec![0u64; p];
    let mut largest: Option<&crate::snapshot::GroupEntry> = None;
    for g in &m.key_groups {
        let owner = assignment.owner(g.group) as usize;
        if let (Some(b), Some(k)) = (bytes.get_mut(owner), keys.get_mut(owner)) {
            *b += g.length;
            *k += g.entries;
        }
        if largest.is_none_or(|l| g.length > l.length) {
            largest = Some(g);
        }
    }
    let total_bytes: u64 = bytes.iter().sum();
    let total_keys: u64 = keys.iter().sum();
    // Ties go to the lowest subtask.
    let busiest = (0..p).rev().max_by_key(|&i| bytes[i]).unwrap_or(0);
    let mean_bytes = total_bytes as f64 / p.max(1) as f64;
    let mean_keys = total_keys as f64 / p.max(1) as f64;
    let skew = if mean_bytes > 0.0 {
        bytes[busiest] as f64 / mean_bytes
    } else {
        1.0
    };
    let (lg, lg_bytes, lg_keys) = largest.map_or((0, 0, 0), |g| (g.group, g.length, g.entries));
    let summary = format!(
        "snapshot {}: {} in {} keys over {p} subtasks; busiest subtask {busiest} holds {} in {} keys ({skew:.2}x the mean of {}); largest key group {lg}: {} in {} key{}",
        m.snapshot_id,
        keyshift_core::text::bytes(total_bytes),
        total_keys,
        keyshift_core::text::bytes(bytes[busiest]),
        keys[busiest],
        keyshift_core::text::bytes(mean_bytes.round() as u64),
        keyshift_core::text::bytes(lg_bytes),
        lg_keys,
        if lg_keys == 1 { "" } else { "s" },
    );
    let i = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    Some(StateDistribution {
        snapshot_id: i(m.snapshot_id),
        parallelism: p as i32,
        total_bytes: i(total_bytes),
        total_keys: i(total_keys),
        busiest_subtask: busiest as i32,
        busiest_subtask_bytes: i(bytes[busiest]),
        busiest_subtask_keys: i(keys[busiest]),
        mean_subtask_bytes: mean_bytes.round() as i64,
        mean_subtask_keys: mean_keys.round() as i64,
        bytes_skew: format!("{skew:.2}"),
        largest_key_group: lg as i32,
        largest_key_group_bytes: i(lg_bytes),
        largest_key_group_keys: i(lg_keys),
        summary,
    })
}

/// status.restore for a start's restore `progress` (of `snapshot`, begun at `started`). Pure.
pub fn restore_status(
    progress: &StartProgress,
    snapshot: Option<&str>,
    started: &str,
) -> RestoreStatus {
    let i = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    let summary = format!(
        "restoring: {} of {} read ({} of {} key groups), {}/{} subtasks done",
        keyshift_core::text::bytes(progress.bytes_read),
        keyshift_core::text::bytes(progress.bytes_total),
        progress.groups_read,
        progress.groups_total,
        progress.subtasks_done,
        progress.subtasks,
    );
    RestoreStatus {
        snapshot: snapshot.map(str::to_owned),
        started: started.to_owned(),
        bytes_read: i(progress.bytes_read),
        bytes_total: i(progress.bytes_total),
        key_groups_read: i(progress.groups_read),
        key_groups_total: i(progress.groups_total),
        subtasks_done: progress.subtasks_done as i32,
        subtasks: progress.subtasks as i32,
        summary,
    }
}

/// Whether the job runs as its spec asks.
pub fn is_ready(spec: &StreamJobSpec, status: &StreamJobStatus, progress: &Progress) -> bool {
    let rescaling = status.rescale.as_ref().is_some_and(|r| r.step.active());
    if progress.stalled.is_some() || rescaling || status.restore.is_some() {
        return false;
    }
    if spec.suspend {
        status.phase == Some(Phase::Suspended)
    } else {
        status.phase == Some(Phase::Running) && status.replicas == Some(spec.replicas)
    }
}

/// Whether a StreamJob as read from the API server reports Ready for the spec as it stands: its
/// status and its Ready condition observed the object's generation, and the condition is True
/// (what `kubectl wait --for=condition=Ready` and kstatus read).
pub fn reports_ready(job: &crate::crd::StreamJob) -> bool {
    let generation = job.metadata.generation;
    job.status.as_ref().is_some_and(|s| {
        s.observed_generation == generation
            && s.conditions.iter().any(|c| {
                c.type_ == READY && c.status == "True" && c.observed_generation == generation
            })
    })
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
    let rescale = status.rescale.as_ref().filter(|r| r.step.active());
    if let Some(r) = rescale {
        status.phase = Some(if r.upgrade_mode.is_some() {
            Phase::Upgrading
        } else {
            Phase::Rescaling
        });
    } else if progress.stalled.is_some() && status.replicas.is_none() {
        status.phase = Some(Phase::Failed);
    } else if let Some(phase) = progress.phase {
        status.phase = Some(phase);
    } else if status.phase.is_none() {
        status.phase = Some(Phase::Pending);
    }
    let ready = is_ready(spec, status, progress);
    let restore = status.restore.clone();
    let restoring = restore.as_ref().map(|r| r.summary.clone());
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
                Reason::SpecValid.as_str(),
                "the spec can run",
                generation,
                now,
            );
            if ready {
                let (reason, message) = if spec.suspend {
                    (
                        String::from(Reason::Suspended),
                        "suspended with a savepoint".to_owned(),
                    )
                } else {
                    (
                        String::from(Reason::Running),
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
                    (Some(r), failure, note) => {
                        let what = if r.upgrade_mode.is_some() {
                            "upgrading"
                        } else if r.to == 0 {
                            "suspending"
                        } else {
                            "rescaling"
                        };
                        let mut m = match (r.from_max_parallelism, r.max_parallelism) {
                            (Some(g0), Some(g)) => format!(
                                "changing the key-group count {g0} -> {g} (parallelism {} -> {}): step {}",
                                r.from, r.to, r.step
                            ),
                            _ => format!("{what} {} -> {}: step {}", r.from, r.to, r.step),
                        };
                        if let Some(f) = &r.fallback {
                            m.push_str(&format!(" (fell back to stop-and-restore: {f})"));
                        }
                        // What the step waits for (pods to terminate, to start, ...).
                        if let Some((_, n)) = note {
                            m.push_str(&format!(": {n}"));
                        }
                        if let Some(restoring) = &restoring {
                            m.push_str(&format!(": {restoring}"));
                        }
                        if let Some((_, f)) = failure {
                            m.push_str(&format!(" (retrying after: {f})"));
                        }
                        (r.step.as_str().to_owned(), m)
                    }
                    (None, failure, _) if restore.is_some() => {
                        let r = restore.clone().unwrap_or_default();
                        let from = r.snapshot.as_deref().unwrap_or("nothing (empty state)");
                        let mut m = format!("starting the run from {from}: {}", r.summary);
                        if let Some((_, f)) = failure {
                            m.push_str(&format!(" (retrying after: {f})"));
                        }
                        (String::from(Reason::Restoring), m)
                    }
                    (None, Some((reason, message)), _) => (reason.clone(), message.clone()),
                    (None, None, Some((reason, message))) => (reason.clone(), message.clone()),
                    (None, None, None) => (
                        String::from(Reason::Progressing),
                        format!("bringing the job to parallelism {}", spec.replicas),
                    ),
                };
                set_condition(conds, READY, false, &reason, &message, generation, now);
                set_condition(conds, RECONCILING, true, &reason, &message, generation, now);
            }
        }
    }
    if let Some((failed, error)) = &progress.checkpoint_failures {
        let (ok, reason, message) = if *failed >= CHECKPOINT_FAILURES_UNHEALTHY {
            let last = status.last_checkpoint.as_ref().map_or_else(
                || "the job has no checkpoint yet".to_owned(),
                |c| {
                    format!(
                        "the last good checkpoint ({}, completed {}) stays usable",
                        c.path, c.time
                    )
                },
            );
            (
                false,
                Reason::CheckpointsFailing.as_str(),
                format!(
                    "{failed} checkpoints in a row failed, the last with: {error}; {last}, and a recovery would replay from it. Check the storage and the workers' logs; spec.state.checkpointTimeout bounds each attempt"
                ),
            )
        } else {
            (
                true,
                Reason::Checkpointing.as_str(),
                "the job's periodic checkpoints commit".to_owned(),
            )
        };
        set_condition(
            conds,
            CHECKPOINTS_HEALTHY,
            ok,
            reason,
            &message,
            generation,
            now,
        );
    }
    if let Some(newest) = &progress.restored_newest {
        let (ok, reason, message) = match newest {
            Ok(()) => (
                true,
                Reason::Restored.as_str(),
                "the last resume restored the job's newest snapshot",
            ),
            Err(m) => (
                false,
                Reason::UnreadableSnapshotSkipped.as_str(),
                m.as_str(),
            ),
        };
        set_condition(
            conds,
            NEWEST_SNAPSHOT_RESTORED,
            ok,
            reason,
            message,
            generation,
            now,
        );
    }
    if let Some(backlog) = &progress.sink {
        let (ok, reason, message) = if backlog.is_behind() {
            (
                false,
                Reason::PublishBehind.as_str(),
                format!(
                    "the output of committed {} {} is not published yet ({}); it is retried after every commit, in order, and nothing is published twice",
                    keyshift_core::text::noun(backlog.pending.len() as u64, "snapshot"),
                    keyshift_core::text::list(&backlog.pending),
                    backlog.last_error.as_deref().unwrap_or("no attempt yet")
                ),
            )
        } else {
            (
                true,
                Reason::Published.as_str(),
                "every committed snapshot's output is published".to_owned(),
            )
        };
        set_condition(conds, SINK_PUBLISHED, ok, reason, &message, generation, now);
    }
    if let Some(outages) = &progress.kafka {
        let (ok, reason, message) = kafka_reachable(outages, status.last_checkpoint.as_ref());
        set_condition(
            conds,
            KAFKA_REACHABLE,
            ok,
            reason,
            &message,
            generation,
            now,
        );
    }
    if let Some(a) = analysis {
        let skew = &a.skew;
        let (ok, reason) = if skew.divides {
            (true, Reason::EvenSpread.as_str())
        } else {
            (false, Reason::UnevenKeyGroups.as_str())
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
        let partitions = a.source_partitions;
        let (ok, reason, message) = if a.idle_subtasks > 0 {
            (
                false,
                Reason::MoreSubtasksThanPartitions.as_str(),
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
                Reason::EverySubtaskReads.as_str(),
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
    status.step = status
        .rescale
        .as_ref()
        .map(|r| r.step)
        .filter(|s| s.active());
    status.message = status
        .conditions
        .iter()
        .find(|c| c.type_ == READY)
        .map(|c| short_message(&c.message));
}

/// The job's Kafka clients that cannot reach their brokers, one line each (what the
/// KafkaReachable condition says): the source of the subtasks whose last lag measurement failed
/// (`lags`, by subtask), and the exactly-once sink's publisher (its last broker error). Pure.
pub fn kafka_outages(
    lags: &[(u32, &crate::runtime::protocol::SourceLag)],
    publisher: Option<&str>,
) -> Vec<String> {
    let mut outages = Vec::new();
    let failing: Vec<_> = lags.iter().filter(|(_, l)| l.error.is_some()).collect();
    if let Some((_, first)) = failing.first() {
        let subtasks: Vec<u64> = failing.iter().map(|(i, _)| u64::from(*i)).collect();
        outages.push(format!(
            "the source of {} {}: {}",
            keyshift_core::text::noun(subtasks.len() as u64, "subtask"),
            keyshift_core::text::list(&subtasks),
            first.error.as_deref().unwrap_or_default()
        ));
    }
    if let Some(e) = publisher {
        outages.push(e.to_owned());
    }
    outages
}

/// The line KafkaReachable shows for a failure being retried (a worker that stopped, a start
/// that failed) when a Kafka client caused it: a worker's at-least-once sink that could not
/// deliver (`kafka sink: ...`) or a source that could not ask its brokers. Pure.
pub fn kafka_failure(message: &str) -> Option<String> {
    const KAFKA: [&str; 3] = [
        "kafka sink: ",
        "cannot reach the Kafka brokers",
        "asking the Kafka brokers",
    ];
    KAFKA
        .iter()
        .any(|k| message.contains(k))
        .then(|| format!("the job's last failure (retried with backoff): {message}"))
}

/// The KafkaReachable condition for the job's Kafka clients that cannot reach their brokers
/// (`outages`, one line each): (status, reason, message). Pure.
pub fn kafka_reachable(
    outages: &[String],
    last_checkpoint: Option<&crate::crd::SnapshotRef>,
) -> (bool, &'static str, String) {
    if outages.is_empty() {
        return (
            true,
            Reason::KafkaReachable.as_str(),
            "every Kafka client of the job reaches its brokers".to_owned(),
        );
    }
    let kept = last_checkpoint.map_or_else(
        || "it has no checkpoint yet".to_owned(),
        |c| format!("it keeps its last checkpoint ({})", c.path),
    );
    (
        false,
        Reason::KafkaUnreachable.as_str(),
        format!(
            "{}. Nothing is lost and the job keeps running: {kept}, the source reads on from its position and committed output is published once the brokers answer. Check that the brokers run and that the workers and the operator can reach them (bootstrapServers, DNS, network policies, TLS/SASL credentials)",
            outages.join("; ")
        ),
    )
}

/// The Kafka source's lag over the whole job from the running subtasks' last measurements (a
/// subtask without one counts nothing); `None` when none has measured. Pure.
pub fn source_lag(
    lags: &[&crate::runtime::protocol::SourceLag],
) -> Option<crate::crd::SourceLagStatus> {
    let measured: Vec<_> = lags.iter().filter(|l| l.measured_ms > 0).collect();
    if measured.is_empty() {
        return None;
    }
    let mut records = 0u64;
    let mut seconds: Option<f64> = None;
    let mut partitions = 0usize;
    let mut behind = 0usize;
    let mut furthest: Option<(&str, u64)> = None;
    let mut oldest = i64::MAX;
    for l in &measured {
        oldest = oldest.min(l.measured_ms);
        for p in &l.partitions {
            partitions += 1;
            records += p.records;
            if p.records > 0 {
                behind += 1;
                if furthest.is_none_or(|(_, r)| p.records > r) {
                    furthest = Some((&p.partition, p.records));
                }
            }
            if let Some(s) = p.seconds {
                seconds = Some(seconds.map_or(s, |m: f64| m.max(s)));
            }
        }
    }
    let seconds = seconds.map(|s| s.floor() as i64);
    let measured_at = Timestamp::from_millisecond(oldest)
        .map(|t| t.to_string())
        .unwrap_or_default();
    let summary = match furthest {
        None => format!(
            "{partitions} {} read to the end",
            keyshift_core::text::noun(partitions as u64, "partition")
        ),
        Some((name, most)) => format!(
            "{records} {} behind over {behind} of {partitions} partitions{}; furthest behind: {name} ({most})",
            keyshift_core::text::noun(records, "record"),
            seconds.map_or_else(String::new, |s| format!(", up to {s} s")),
        ),
    };
    let i = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    Some(crate::crd::SourceLagStatus {
        records: i(records),
        seconds,
        partitions: i32::try_from(partitions).unwrap_or(i32::MAX),
        partitions_behind: i32::try_from(behind).unwrap_or(i32::MAX),
        furthest_behind: furthest.map(|(n, _)| n.to_owned()),
        measured: measured_at,
        summary,
    })
}

/// Longest status.message, in characters.
pub const SHORT_MESSAGE_CHARS: usize = 80;

/// `message` as one line of at most [`SHORT_MESSAGE_CHARS`] characters: line breaks become
/// spaces, and a longer text is cut at a word boundary (when one is near) and ends in "...".
pub fn short_message(message: &str) -> String {
    let line = message.split_whitespace().collect::<Vec<_>>().join(" ");
    if line.chars().count() <= SHORT_MESSAGE_CHARS {
        return line;
    }
    const ELLIPSIS: &str = "...";
    let keep = SHORT_MESSAGE_CHARS - ELLIPSIS.len();
    let cut: String = line.chars().take(keep).collect();
    // Prefer a cut at a space in the last quarter of the line over one inside a word.
    let cut = match cut.rfind(' ') {
        Some(i) if cut[..i].chars().count() >= keep * 3 / 4 => &cut[..i],
        _ => cut.as_str(),
    };
    format!("{}{ELLIPSIS}", cut.trim_end_matches([' ', ',', ';', ':']))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::RescaleStatus;
    use crate::fixtures::job;
    use crate::validation::analyse;
    use keyshift_core::step::Step;

    /// A manifest of 8 groups at parallelism 2 with the given (bytes, keys) per group.
    fn manifest(groups: &[(u64, u64)]) -> crate::snapshot::Manifest {
        use crate::snapshot::{Crc32c, GroupEntry, JobIdentity, Manifest, SnapshotKind, Stats};
        Manifest {
            format_version: 1,
            job: JobIdentity {
                namespace: "n".into(),
                name: "j".into(),
                job_fingerprint: String::new(),
                layout: None,
            },
            snapshot_id: 7,
            kind: SnapshotKind::Checkpoint,
            completed_at: Timestamp::now(),
            max_parallelism: groups.len() as u32,
            parallelism: 2,
            state_schema: "s".into(),
            checksum_algorithm: "crc32c".into(),
            source_positions: Default::default(),
            source_partitions: Default::default(),
            watermark: None,
            stats: Stats::default(),
            files: Vec::new(),
            operator_state: Vec::new(),
            key_groups: groups
                .iter()
                .enumerate()
                .map(|(g, (length, entries))| GroupEntry {
                    group: g as u32,
                    file: format!("state-{}", g / 4),
                    offset: 0,
                    length: *length,
                    checksum: Crc32c::EMPTY,
                    entries: *entries,
                    deltas: Vec::new(),
                })
                .collect(),
        }
    }

    #[test]
    fn state_distribution_names_the_busiest_subtask_and_the_hot_group() {
        // Subtask 0 owns groups 0-3, subtask 1 groups 4-7; group 5 holds one large key.
        let m = manifest(&[
            (100, 10),
            (100, 10),
            (100, 10),
            (100, 10),
            (50, 5),
            (3000, 1),
            (50, 5),
            (0, 0),
        ]);
        let d = state_distribution(&m).unwrap();
        assert_eq!(d.snapshot_id, 7);
        assert_eq!((d.total_bytes, d.total_keys), (3500, 51));
        assert_eq!(d.busiest_subtask, 1);
        assert_eq!(
            (d.busiest_subtask_bytes, d.busiest_subtask_keys),
            (3100, 11)
        );
        assert_eq!((d.mean_subtask_bytes, d.mean_subtask_keys), (1750, 26));
        assert_eq!(d.bytes_skew, "1.77");
        assert_eq!(d.largest_key_group, 5);
        assert_eq!(
            (d.largest_key_group_bytes, d.largest_key_group_keys),
            (3000, 1)
        );
        assert!(
            d.summary
                .contains("busiest subtask 1 holds 3.0 KiB in 11 keys (1.77x the mean"),
            "{}",
            d.summary
        );
        assert!(
            d.summary.contains("largest key group 5: 2.9 KiB in 1 key"),
            "{}",
            d.summary
        );
        // Even state: skew 1.00, ties go to the lowest subtask.
        let d = state_distribution(&manifest(&[(10, 1); 8])).unwrap();
        assert_eq!((d.busiest_subtask, d.bytes_skew.as_str()), (0, "1.00"));
        // Empty state.
        let d = state_distribution(&manifest(&[(0, 0); 8])).unwrap();
        assert_eq!((d.total_bytes, d.bytes_skew.as_str()), (0, "1.00"));
        assert_eq!(keyshift_core::text::bytes(1023), "1023 B");
        assert_eq!(keyshift_core::text::bytes(3 * 1024 * 1024 / 2), "1.5 MiB");
    }

    fn cond<'a>(s: &'a StreamJobStatus, t: &str) -> &'a Condition {
        s.conditions.iter().find(|c| c.type_ == t).unwrap()
    }

    #[test]
    fn sink_published_says_which_commits_wait_for_their_output() {
        let spec = job().spec;
        let mut st = StreamJobStatus {
            phase: Some(Phase::Running),
            replicas: Some(4),
            ..Default::default()
        };
        let behind = Progress {
            sink: Some(crate::orchestrator::coordinator::PublishBacklog {
                pending: vec![8, 9],
                last_error: Some("403 Forbidden".into()),
            }),
            ..Default::default()
        };
        finish(&spec, Some(1), &mut st, None, &behind, Timestamp::now());
        let c = cond(&st, SINK_PUBLISHED);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", Reason::PublishBehind.as_str())
        );
        assert!(
            c.message.contains("committed snapshots 8, 9 is")
                && c.message.contains("403 Forbidden"),
            "{}",
            c.message
        );
        let caught_up = Progress {
            sink: Some(crate::orchestrator::coordinator::PublishBacklog::default()),
            ..Default::default()
        };
        finish(&spec, Some(1), &mut st, None, &caught_up, Timestamp::now());
        assert_eq!(cond(&st, SINK_PUBLISHED).status, "True");
        // Not known this pass (a snapshot runs in the background): the condition stays.
        finish(
            &spec,
            Some(1),
            &mut st,
            None,
            &Progress::default(),
            Timestamp::now(),
        );
        assert_eq!(cond(&st, SINK_PUBLISHED).status, "True");
    }

    #[test]
    fn a_job_reports_ready_only_for_the_generation_it_stands_at() {
        let doc = |generation: i64,
                   observed: i64,
                   condition: i64,
                   ready: &str|
         -> crate::crd::StreamJob {
            serde_yaml::from_str(&format!(
                "metadata: {{name: j, generation: {generation}}}
spec:
  replicas: 1
  job: {{source: {{generator: {{partitions: 1, keys: 1}}}}, key: {{field: key}}, aggregation: {{function: count}}, sink: {{type: log}}}}
status:
  observedGeneration: {observed}
  conditions:
  - {{type: Ready, status: '{ready}', reason: Running, message: '', observedGeneration: {condition}, lastTransitionTime: '2026-12-07T10:00:00Z'}}
"
            ))
            .unwrap()
        };
        assert!(reports_ready(&doc(3, 3, 3, "True")));
        assert!(!reports_ready(&doc(3, 3, 3, "False")));
        assert!(
            !reports_ready(&doc(4, 3, 3, "True")),
            "a spec change not yet observed"
        );
        assert!(
            !reports_ready(&doc(3, 3, 2, "True")),
            "a condition from an older spec"
        );
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
            step: Step::Savepointing,
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
        assert_eq!(cond(&st, READY).reason, Reason::Savepointing);
        assert_eq!(cond(&st, RECONCILING).status, "True");
        assert_eq!(
            cond(&st, RECONCILING).message,
            "rescaling 4 -> 3: step Savepointing"
        );
        // What a step waits for is in the message.
        if let Some(r) = st.rescale.as_mut() {
            r.step = Step::Stopping;
        }
        let waiting = Progress {
            note: Some((
                Reason::Waiting.into(),
                "waiting for 4 old pod(s) to terminate".into(),
            )),
            ..Default::default()
        };
        finish(
            &scaled,
            Some(4),
            &mut st,
            Some(&a),
            &waiting,
            Timestamp::now(),
        );
        assert_eq!(
            cond(&st, RECONCILING).message,
            "rescaling 4 -> 3: step Stopping: waiting for 4 old pod(s) to terminate"
        );
        let kg = cond(&st, KEY_GROUPS_BALANCED);
        assert_eq!(kg.status, "False");
        assert!(kg.message.contains("divisors of 128"), "{}", kg.message);
    }

    #[test]
    fn step_and_message_columns_follow_the_transition() {
        let mut spec = job().spec;
        let mut st = StreamJobStatus {
            phase: Some(Phase::Running),
            replicas: Some(4),
            max_parallelism: Some(128),
            ..Default::default()
        };
        let a = analyse(&spec, Some(&st)).unwrap();
        let pass = |spec: &StreamJobSpec, st: &mut StreamJobStatus, p: &Progress| {
            finish(spec, Some(1), st, Some(&a), p, Timestamp::now())
        };
        pass(&spec, &mut st, &Progress::default());
        assert_eq!(st.step, None);
        assert_eq!(st.message.as_deref(), Some("running at parallelism 4"));

        spec.replicas = 8;
        st.rescale = Some(RescaleStatus {
            from: 4,
            to: 8,
            step: Step::Stopping,
            ..Default::default()
        });
        let waiting = Progress {
            note: Some((
                "Waiting".into(),
                "waiting for 4 old pod(s) to terminate: ks-clicks-0 is 45 s past its grace period"
                    .into(),
            )),
            ..Default::default()
        };
        pass(&spec, &mut st, &waiting);
        assert_eq!(st.step, Some(Step::Stopping));
        let full = &cond(&st, READY).message;
        let short = st.message.clone().unwrap_or_default();
        assert!(full.chars().count() > SHORT_MESSAGE_CHARS, "{full}");
        assert!(short.chars().count() <= SHORT_MESSAGE_CHARS, "{short}");
        assert!(short.ends_with("..."), "{short}");
        assert!(
            full.starts_with(short.trim_end_matches("...")),
            "{short} is the start of {full}"
        );

        // Done: no step in progress any more (status.rescale keeps the last transition).
        if let Some(r) = st.rescale.as_mut() {
            r.step = Step::Done;
        }
        st.replicas = Some(8);
        let started = Progress {
            phase: Some(Phase::Running),
            ..Default::default()
        };
        pass(&spec, &mut st, &started);
        assert_eq!(st.step, None);
        assert_eq!(st.message.as_deref(), Some("running at parallelism 8"));

        // A spec that cannot run: the column says why.
        let stalled = Progress {
            stalled: Some((
                "ImageNotAllowed".into(),
                "spec.image x is not allowed".into(),
            )),
            ..Default::default()
        };
        pass(&spec, &mut st, &stalled);
        assert_eq!(st.message.as_deref(), Some("spec.image x is not allowed"));
    }

    #[test]
    fn source_lag_sums_records_and_takes_the_most_seconds() {
        use crate::runtime::protocol::{PartitionLag, SourceLag};
        let part = |name: &str, position, high, seconds| PartitionLag {
            partition: name.into(),
            position,
            high_watermark: high,
            records: high - position,
            seconds,
        };
        let a = SourceLag {
            measured_ms: 1_767_225_600_000,
            records: 30,
            seconds: Some(4.0),
            partitions: vec![part("t/0", 10, 40, Some(4.9)), part("t/2", 5, 5, Some(0.0))],
            ..Default::default()
        };
        let b = SourceLag {
            measured_ms: 1_767_225_601_000,
            partitions: vec![part("t/1", 0, 100, None), part("t/3", 7, 7, Some(0.0))],
            ..Default::default()
        };
        // A worker that never measured counts nothing.
        let none = SourceLag::default();
        let lag = source_lag(&[&a, &b, &none]).expect("measured");
        assert_eq!(lag.records, 130);
        assert_eq!(lag.seconds, Some(4));
        assert_eq!((lag.partitions, lag.partitions_behind), (4, 2));
        assert_eq!(lag.furthest_behind.as_deref(), Some("t/1"));
        assert_eq!(lag.measured, "2026-01-01T00:00:00Z");
        assert_eq!(
            lag.summary,
            "130 records behind over 2 of 4 partitions, up to 4 s; furthest behind: t/1 (100)"
        );
        let caught_up = SourceLag {
            measured_ms: 1,
            partitions: vec![part("t/0", 3, 3, Some(0.0))],
            ..Default::default()
        };
        let lag = source_lag(&[&caught_up]).expect("measured");
        assert_eq!((lag.records, lag.seconds), (0, Some(0)));
        assert_eq!(lag.summary, "1 partition read to the end");
        assert_eq!(lag.furthest_behind, None);
        assert_eq!(source_lag(&[&none]), None);
        assert_eq!(source_lag(&[]), None);
    }

    #[test]
    fn kafka_reachable_names_every_outage_and_what_is_kept() {
        use crate::runtime::protocol::SourceLag;
        let down = SourceLag {
            error: Some("cannot reach the Kafka brokers k:9092 of the source: x".into()),
            ..Default::default()
        };
        let up = SourceLag::default();
        assert_eq!(
            kafka_outages(
                &[(0, &down), (1, &up), (2, &down)],
                Some("the sink's publisher (bootstrap k:9092): kafka sink: y")
            ),
            [
                "the source of subtasks 0, 2: cannot reach the Kafka brokers k:9092 of the source: x",
                "the sink's publisher (bootstrap k:9092): kafka sink: y"
            ]
        );
        assert!(kafka_outages(&[(0, &up)], None).is_empty());
        assert_eq!(
            kafka_failure(
                "worker 1 exited: keyed operator: kafka sink: flushing: Local: Message timed out"
            )
            .as_deref(),
            Some(
                "the job's last failure (retried with backoff): worker 1 exited: keyed operator: kafka sink: flushing: Local: Message timed out"
            )
        );
        assert!(
            kafka_failure("starting worker 0: asking the Kafka brokers (k:9092) for topic \"in\": Local: Timed out").is_some()
        );
        assert_eq!(kafka_failure("checksum mismatch in state-0-of-2.bin"), None);
        let (ok, reason, message) = kafka_reachable(&[], None);
        assert!(ok);
        assert_eq!(reason, "KafkaReachable");
        assert!(message.contains("reaches its brokers"), "{message}");
        let last = crate::crd::SnapshotRef {
            id: 4,
            path: "file:///s/ns/j/chk-4".into(),
            ..Default::default()
        };
        let (ok, reason, message) = kafka_reachable(
            &[
                "the source of subtasks 0, 1: cannot reach the Kafka brokers k:9092 of the source: x".into(),
                "the sink's publisher (bootstrap k:9092): kafka sink: y".into(),
            ],
            Some(&last),
        );
        assert!(!ok);
        assert_eq!(reason, "KafkaUnreachable");
        assert!(
            message.starts_with("the source of subtasks 0, 1: cannot reach the Kafka brokers k:9092 of the source: x; the sink's publisher"),
            "{message}"
        );
        assert!(
            message.contains("keeps its last checkpoint (file:///s/ns/j/chk-4)"),
            "{message}"
        );
        assert!(message.contains("Check that the brokers run"), "{message}");
        let mut status = StreamJobStatus::default();
        let progress = Progress {
            kafka: Some(vec!["the sink's publisher (bootstrap k:9092): down".into()]),
            ..Default::default()
        };
        finish(
            &job().spec,
            None,
            &mut status,
            None,
            &progress,
            Timestamp::UNIX_EPOCH,
        );
        let c = cond(&status, KAFKA_REACHABLE);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "KafkaUnreachable")
        );
        let progress = Progress {
            kafka: Some(Vec::new()),
            ..Default::default()
        };
        finish(
            &job().spec,
            None,
            &mut status,
            None,
            &progress,
            Timestamp::UNIX_EPOCH,
        );
        assert_eq!(cond(&status, KAFKA_REACHABLE).status, "True");
    }

    #[test]
    fn short_message_is_one_bounded_line() {
        assert_eq!(
            short_message("running at parallelism 4"),
            "running at parallelism 4"
        );
        assert_eq!(short_message("two\nlines  here"), "two lines here");
        let long = "word ".repeat(40);
        let s = short_message(&long);
        assert!(s.chars().count() <= SHORT_MESSAGE_CHARS, "{s}");
        assert!(s.ends_with("word..."), "cut at a word boundary: {s}");
        // No space to cut at: cut inside the word, on a char boundary (multi-byte text).
        let s = short_message(&"ü".repeat(200));
        assert_eq!(s.chars().count(), SHORT_MESSAGE_CHARS);
        assert!(s.ends_with("üüü..."), "{s}");
        let exact = "x".repeat(SHORT_MESSAGE_CHARS);
        assert_eq!(short_message(&exact), exact);
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
            stalled: Some((Reason::AboveKeyGroupCeiling.into(), "too many".into())),
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

    #[test]
    fn a_running_restore_shows_in_reconciling_and_the_job_is_not_ready() {
        let spec = job().spec;
        let progress = StartProgress {
            bytes_read: 1288490189,
            bytes_total: 4 << 30,
            groups_read: 40,
            groups_total: 128,
            subtasks_done: 37,
            subtasks: 64,
        };
        let url = "s3://b/ns/j/checkpoints/chk-9";
        let r = restore_status(&progress, Some(url), "2026-01-01T00:00:00Z");
        assert_eq!(
            r.summary,
            "restoring: 1.2 GiB of 4.0 GiB read (40 of 128 key groups), 37/64 subtasks done"
        );
        assert_eq!(
            (
                r.bytes_read,
                r.bytes_total,
                r.key_groups_read,
                r.key_groups_total
            ),
            (1288490189, 4 << 30, 40, 128)
        );
        assert_eq!((r.subtasks_done, r.subtasks), (37, 64));
        // A recovery (no transition): the job would otherwise count as ready.
        let mut st = StreamJobStatus {
            phase: Some(Phase::Running),
            replicas: Some(4),
            max_parallelism: Some(128),
            restore: Some(r.clone()),
            ..Default::default()
        };
        let failed = Progress {
            failure: Some((Reason::WorkerFailed.into(), "worker 1 exited".into())),
            ..Default::default()
        };
        finish(&spec, Some(1), &mut st, None, &failed, Timestamp::now());
        assert_eq!(cond(&st, READY).status, "False");
        assert_eq!(cond(&st, RECONCILING).status, "True");
        assert_eq!(cond(&st, RECONCILING).reason, Reason::Restoring);
        assert_eq!(
            cond(&st, RECONCILING).message,
            format!(
                "starting the run from {url}: {} (retrying after: worker 1 exited)",
                r.summary
            )
        );
        // A rescale's Restoring step.
        st.rescale = Some(RescaleStatus {
            from: 4,
            to: 64,
            step: Step::Restoring,
            ..Default::default()
        });
        finish(
            &spec,
            Some(1),
            &mut st,
            None,
            &Progress::default(),
            Timestamp::now(),
        );
        assert_eq!(
            cond(&st, RECONCILING).message,
            format!("rescaling 4 -> 64: step Restoring: {}", r.summary)
        );
        // Once the run started, status.restore is gone and so is the progress.
        st.rescale = None;
        st.restore = None;
        st.phase = Some(Phase::Running);
        finish(
            &spec,
            Some(1),
            &mut st,
            None,
            &Progress::default(),
            Timestamp::now(),
        );
        assert_eq!(cond(&st, READY).status, "True");
    }
}
