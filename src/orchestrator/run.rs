//! One run of a job: a set of workers at one parallelism, coordinated by one [`Coordinator`].
//! Everything about a run that does not depend on where its workers live is built here: the
//! coordinator (with the job's sink and retention), the start request, the job's identity in its
//! snapshots, the control token, the run id, and the timeouts of each long step.

use crate::coordinator::{Coordinator, CoordinatorError, WorkerEndpoint};
use crate::crd::{SinkType, StreamJobSpec};
use crate::keygroup::Assignment;
use crate::runtime::protocol::StartRequest;
use crate::snapshot::{self, JobIdentity, SnapshotInfo};
/// How long each long step of a run may take before it counts as failed.
pub mod timeouts {
    use std::time::Duration;

    /// Workers of a starting run restore their key groups and connect to each other.
    pub const START: Duration = Duration::from_secs(180);
    /// A periodic checkpoint, trigger to commit.
    pub const CHECKPOINT: Duration = Duration::from_secs(120);
    /// A savepoint (a rescale's, an upgrade's, a triggered one), trigger to commit.
    pub const SAVEPOINT: Duration = Duration::from_secs(300);
    /// One request of the coordinator to a worker's control API.
    pub const CONTROL_REQUEST: Duration = Duration::from_secs(30);
}

/// How long starting a run of `spec` may take: `spec.state.restoreTimeoutSeconds`, else
/// [`timeouts::START`].
pub fn start_timeout(spec: &StreamJobSpec) -> std::time::Duration {
    spec.state
        .restore_timeout_seconds
        .and_then(|s| u64::try_from(s).ok())
        .map_or(timeouts::START, std::time::Duration::from_secs)
}

/// Failures of the OS random number generator (no weaker source is ever used instead).
#[derive(Debug, thiserror::Error)]
#[error("the operating system's random number generator failed: {0}")]
pub struct RandomError(String);

fn random_hex(bytes: usize) -> Result<String, RandomError> {
    let mut buf = vec![0u8; bytes];
    getrandom::fill(&mut buf).map_err(|e| RandomError(e.to_string()))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// A fresh control token: 128 bits from the OS RNG, hex. Guards a run's control API (and is never
/// part of a run id, which travels in clear on the data plane).
pub fn new_token() -> Result<String, RandomError> {
    random_hex(16)
}

/// A fresh run id: 24 bits from the OS RNG, hex (6 characters, so that pod names stay short).
/// Names one set of workers; carries no secret.
pub fn new_run_id() -> Result<String, RandomError> {
    random_hex(3)
}

/// The run id workers of a run present to each other on the data plane: the job and the run.
pub fn data_plane_run_id(name: &str, run: &str) -> String {
    format!("{name}-{run}")
}

/// Identity of a job's dataflow, recorded in snapshots (a stable hash of `spec.job`).
pub fn fingerprint(spec: &StreamJobSpec) -> String {
    let text = serde_json::to_string(&spec.job).unwrap_or_default();
    let h = text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    format!("{h:016x}")
}

/// The job as its snapshots name it.
pub fn identity(namespace: &str, name: &str, spec: &StreamJobSpec) -> JobIdentity {
    JobIdentity {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        job_fingerprint: fingerprint(spec),
    }
}

/// Where the job's object-store sink publishes, if it has one.
pub fn sink_url(spec: &StreamJobSpec) -> Option<&str> {
    match spec.job.sink.sink_type {
        SinkType::ObjectStore => spec.job.sink.url.as_deref(),
        SinkType::Log => None,
    }
}

/// Which of a job's snapshots a resume restores: the newest one under `max_parallelism` key
/// groups (snapshots taken before a restore from a rewritten savepoint have another count) whose
/// id is above `replaced_up_to` (the job's snapshots at or below it hold the history a restore from
/// `spec.restoreFrom` replaced). Pure.
pub fn newest_restorable(
    snapshots: &[SnapshotInfo],
    max_parallelism: u32,
    replaced_up_to: Option<u64>,
) -> Option<&SnapshotInfo> {
    snapshots
        .iter()
        .filter(|s| s.max_parallelism == max_parallelism)
        .filter(|s| replaced_up_to.is_none_or(|b| s.id > b))
        .max_by_key(|s| s.id)
}

/// What a run restores when it resumes the job's own history: [`newest_restorable`] among the
/// job's snapshots in storage, else `spec.restoreFrom`, else nothing.
pub async fn latest_restorable(
    spec: &StreamJobSpec,
    storage: &str,
    namespace: &str,
    name: &str,
    max_parallelism: u32,
    replaced_up_to: Option<u64>,
) -> Result<Option<String>, CoordinatorError> {
    let (store, base) = snapshot::open_store(storage)?;
    let job_dir = snapshot::job_dir(&base, namespace, name);
    let all = snapshot::list_snapshots(store.as_ref(), &job_dir).await?;
    let own = newest_restorable(&all, max_parallelism, replaced_up_to)
        .map(|s| crate::coordinator::snapshot_url(storage, namespace, name, s.kind, s.id));
    Ok(own.or_else(|| spec.restore_from.clone()))
}

/// The coordinator of a run: snapshots in `storage`, the job's retention, its sink attached (so
/// every committed snapshot's output is published, on every platform).
pub async fn coordinator(
    spec: &StreamJobSpec,
    storage: &str,
    identity: JobIdentity,
    assignment: Assignment,
    workers: Vec<WorkerEndpoint>,
    token: String,
) -> Result<Coordinator, CoordinatorError> {
    Coordinator::new(
        storage,
        identity,
        assignment,
        workers,
        token,
        spec.state.retained_checkpoints.max(1) as usize,
    )
    .await?
    .with_sink(sink_url(spec))
}

/// What a run's workers are started with (the coordinator fills in each subtask and the peers).
pub struct StartPlan<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub spec: &'a StreamJobSpec,
    pub assignment: Assignment,
    pub storage: &'a str,
    pub restore_from: Option<String>,
    /// The run's id (see [`new_run_id`]).
    pub run: &'a str,
    /// Opaque bytes kept with each key's state (benchmarks; 0 otherwise).
    pub state_payload_bytes: usize,
}

impl StartPlan<'_> {
    /// The start request template.
    pub fn request(&self) -> StartRequest {
        StartRequest {
            namespace: self.namespace.to_owned(),
            name: self.name.to_owned(),
            job: self.spec.job.clone(),
            subtask: 0,
            parallelism: self.assignment.parallelism(),
            max_parallelism: self.assignment.max_parallelism(),
            peers: Vec::new(),
            storage: self.storage.to_owned(),
            restore_from: self.restore_from.clone(),
            allow_non_restored_state: self.spec.allow_non_restored_state,
            state_payload_bytes: self.state_payload_bytes,
            run_id: data_plane_run_id(self.name, self.run),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resume_skips_other_key_group_counts_and_history_a_restore_replaced() {
        let snap = |id: u64, groups: u32| SnapshotInfo {
            kind: crate::snapshot::SnapshotKind::Checkpoint,
            id,
            dir: format!("ns/j/checkpoints/chk-{id}").into(),
            completed_at: chrono::Utc::now(),
            parallelism: 2,
            max_parallelism: groups,
            total_bytes: 0,
            total_keys: 0,
        };
        let all = [snap(3, 128), snap(5, 128), snap(6, 1024), snap(4, 128)];
        let pick = |g, after| newest_restorable(&all, g, after).map(|s| s.id);
        assert_eq!(pick(128, None), Some(5));
        assert_eq!(pick(1024, None), Some(6));
        // Restored from spec.restoreFrom when the newest id was 5: 3, 4 and 5 are the old
        // history; until a new snapshot commits there is nothing of the job's own to resume.
        assert_eq!(pick(128, Some(5)), None);
        assert_eq!(pick(128, Some(4)), Some(5));
        assert_eq!(pick(512, None), None);
    }

    #[test]
    fn tokens_and_run_ids_are_fresh_hex_and_run_ids_carry_no_token() {
        let a = new_token().unwrap();
        let b = new_token().unwrap();
        assert_eq!(a.len(), 32);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b, "two tokens from the OS RNG were equal");
        let run = new_run_id().unwrap();
        assert_eq!(run.len(), 6);
        let wire = data_plane_run_id("job", &run);
        assert!(
            !wire.contains(&a),
            "the data-plane run id carries the token"
        );
        assert_eq!(wire, format!("job-{run}"));
    }
}
