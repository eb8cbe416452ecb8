//! The worker control API (HTTP/JSON, versioned paths under `/v1`, bearer token).
//!
//! | method and path | body | answer |
//! | --- | --- | --- |
//! | `GET /v1/healthz` | - | `ok` while the process serves (no token) |
//! | `GET /v1/readyz` | - | 200 once started and connected to every peer (no token) |
//! | `GET /metrics` | - | Prometheus text (no token) |
//! | `POST /v1/start` | [`StartRequest`] | 202 [`StartAccepted`] once the request is checked; the restore runs on |
//! | `POST /v1/prestage` | [`StartRequest`] naming one of the job's checkpoints | 202 [`StartAccepted`]; the worker loads its key groups from it and holds them (`prestaged`), reading no source and connecting to no peer, until a `/v1/start` that then reads only what changed since ([`super::prestage`]); a second one naming a later checkpoint catches up the same way |
//! | `POST /v1/checkpoints` | [`CheckpointRequest`] | 202; the barrier is injected at the sources |
//! | `GET /v1/checkpoints/{id}[?waitMs=N]` | - | [`CheckpointStatus`]: the subtask's acknowledgement; with `waitMs`, a long poll: answered once the status is no longer pending, or after N ms (at most [`MAX_CHECKPOINT_WAIT_MS`]) with `pending` |
//! | `POST /v1/checkpoints/{id}/abort` | - | 200 [`CheckpointStatus`] (now failed); idempotent: the snapshot is abandoned |
//! | `POST /v1/resume` | - | 200; sources stopped by a savepoint read again |
//! | `GET /v1/status` | - | [`WorkerStatus`] |
//!
//! `/v1/start` answers before the state is restored (a restore of any size outlasts no request
//! timeout): a bad request gets a 4xx at once, a second start while one runs or after it
//! succeeded a 409. The caller then polls `/v1/status`: `restoring` with
//! [`WorkerStatus::restore`] (bytes and key groups read of the totals) while it runs; `running`
//! with [`WorkerStatus::started`] (the [`StartResponse`]) once restored; `idle` with
//! [`WorkerStatus::last_start_error`] if it failed (the worker can be started again).
//!
//! A file source's directory is listed by every worker when it checks its request; the answer
//! carries the list in brief ([`StartAccepted::source_partitions`]), and the coordinator refuses
//! a start whose workers listed different files.
//!
//! A start request beyond the bounds of [`StartRequest::check_bounds`] gets a 422 naming the field
//! and its bound, and one whose `job` breaks a rule of the CRD a 422 with the API server's message
//! for it ([`keyshift_core::rules::validate_job`]).
//!
//! `POST /v1/checkpoints` answers 409 for an id this worker does not know that is not above the
//! newest one it finished or abandoned (ids only grow). The coordinator aborts a snapshot that
//! failed, timed out or whose trigger did not reach every worker on every worker with
//! `POST /v1/checkpoints/{id}/abort`: the id (and any pending one below it) is reported
//! [`CheckpointStatus::Failed`] with an error starting with `aborted`, its cut is dropped, its
//! barrier is no longer injected, and the keyed operator stops aligning it. A worker that sees a
//! barrier of a higher id while aligning a lower one aborts the lower one the same way
//! (`superseded`). See [`super::ledger`].
//!
//! Every `/v1` call but health and readiness needs `Authorization: Bearer <token>`.

use crate::snapshot::{SnapshotKind, SubtaskSnapshot};
use keyshift_core::spec::JobSpec;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The longest `GET /v1/checkpoints/{id}?waitMs=N` holds its answer while the snapshot is
/// pending: a larger N is cut to it.
pub const MAX_CHECKPOINT_WAIT_MS: u64 = 10_000;

/// The query of `GET /v1/checkpoints/{id}`.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointStatusQuery {
    /// Hold the answer while the snapshot is pending, at most this many milliseconds (absent:
    /// answer at once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_ms: Option<u64>,
}

/// The version of the control protocol between the orchestration (operator, `keyshift local`)
/// and a worker: a start request carries the sender's, and a worker refuses a start of another
/// version, naming both (a job's own worker binary built against another keyshift release).
pub const PROTOCOL_VERSION: u32 = 1;

/// Everything a worker needs to run its subtask.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StartRequest {
    /// The sender's [`PROTOCOL_VERSION`] (0: a sender from before versions were sent).
    #[serde(default)]
    pub protocol: u32,
    /// Namespace of the job (snapshot layout and logs).
    pub namespace: String,
    /// Name of the job.
    pub name: String,
    /// The dataflow.
    pub job: JobSpec,
    /// This subtask's index.
    pub subtask: u32,
    /// The parallelism.
    pub parallelism: u32,
    /// The key-group count.
    pub max_parallelism: u32,
    /// Data-plane address (`host:port`) of every subtask, in subtask order (own included).
    pub peers: Vec<String>,
    /// Snapshot storage root URL (`<storage>/<namespace>/<job>/...` lies below it).
    pub storage: String,
    /// URL of the snapshot directory to restore from, if any.
    #[serde(default)]
    pub restore_from: Option<String>,
    /// Accept a snapshot whose state schema differs (its state is dropped).
    #[serde(default)]
    pub allow_non_restored_state: bool,
    /// Opaque bytes kept with each key's state (benchmarks).
    #[serde(default)]
    pub state_payload_bytes: usize,
    /// Run identity: workers of one run only talk to each other.
    pub run_id: String,
    /// The run's data-plane secret: a peer proves it holds it before its connection is
    /// accepted (see [`shuffle`](super::shuffle)). Fresh per run, sent only on the
    /// token-guarded control API, never logged.
    pub data_secret: RunSecret,
    /// How checkpoints build on earlier ones (`spec.state.incrementalCheckpoints`; a request
    /// without it gets the defaults).
    #[serde(default)]
    pub incremental: super::incremental::ChainSettings,
    /// How long the coordinator waits, from sending this request, for every subtask to restore
    /// and connect (the job's start timeout). The worker's data plane waits for its peers as
    /// long, counted from the request too, so that subtasks whose restores take different
    /// times still meet. A request without it: [`DEFAULT_START_WINDOW`].
    #[serde(default)]
    pub ready_timeout_secs: Option<u64>,
}

/// How long a worker's data plane waits for its peers when the start request does not say
/// ([`StartRequest::ready_timeout_secs`]).
pub const DEFAULT_START_WINDOW: std::time::Duration = std::time::Duration::from_secs(120);
/// The longest `readyTimeoutSecs` (a week: the job's restore timeout is bounded the same way).
pub const MAX_READY_TIMEOUT_SECS: u64 = 7 * 24 * 3600;

/// The longest `namespace` (a Kubernetes namespace is a DNS label).
pub const MAX_NAMESPACE_LEN: usize = 63;
/// The longest job `name` (a Kubernetes object name).
pub const MAX_NAME_LEN: usize = 253;
/// The longest `storage` and `restoreFrom` URL (as the CRD bounds `spec.state.storage`).
pub const MAX_URL_LEN: usize = 2048;
/// The longest `runId` (`<job>-<run>`).
pub const MAX_RUN_ID_LEN: usize = MAX_NAME_LEN + 1 + 64;
/// The longest data-plane address in `peers` (`host:port`).
pub const MAX_PEER_ADDRESS_LEN: usize = 512;
/// The longest `dataSecret`.
pub const MAX_DATA_SECRET_LEN: usize = 1024;
/// The largest `statePayloadBytes` (opaque bytes per key; benchmarks use a few hundred).
pub const MAX_STATE_PAYLOAD_BYTES: usize = 64 * 1024;

/// A start request field out of its bounds ([`StartRequest::check_bounds`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StartBoundsError {
    /// A string field longer than its bound.
    #[error("{field} is {len} bytes long: it may be at most {max} bytes")]
    TooLong {
        field: String,
        len: usize,
        max: usize,
    },
    /// A required string field that is empty.
    #[error("{field} must not be empty")]
    Empty { field: &'static str },
    /// A number above its bound.
    #[error("{field} is {value}: it may be at most {max}")]
    TooLarge {
        field: &'static str,
        value: u64,
        max: u64,
    },
    /// A start of another control protocol version than the worker's.
    #[error(
        "the start request speaks worker protocol {request}, this worker (keyshift-runtime {runtime}) speaks {worker}: run a worker image built against the keyshift release that runs the job"
    )]
    Protocol {
        request: u32,
        worker: u32,
        runtime: &'static str,
    },
    /// Checkpoint chain limits outside the CRD's bounds.
    #[error(
        "incremental is {maxDeltas} deltas and {maxDeltaPercent}%: maxDeltas must lie in {deltas:?} and maxDeltaPercent in {percent:?}",
        maxDeltas = .0.policy.max_deltas,
        maxDeltaPercent = .0.policy.max_delta_share,
        deltas = super::incremental::MAX_DELTAS_BOUNDS,
        percent = super::incremental::MAX_DELTA_PERCENT_BOUNDS
    )]
    Chain(super::incremental::ChainSettings),
}

impl StartRequest {
    /// How long the subtask waits, from receiving this request, for its peers' data
    /// connections: as long as the coordinator waits for the run to be ready.
    pub fn start_window(&self) -> std::time::Duration {
        self.ready_timeout_secs.map_or(DEFAULT_START_WINDOW, |s| {
            std::time::Duration::from_secs(s.max(1))
        })
    }

    /// Checks the sizes of the request's fields against the named bounds above (the
    /// parallelism, key-group count, peer count and dataflow are checked when the subtask is
    /// prepared).
    pub fn check_bounds(&self) -> Result<(), StartBoundsError> {
        if self.protocol != PROTOCOL_VERSION {
            return Err(StartBoundsError::Protocol {
                request: self.protocol,
                worker: PROTOCOL_VERSION,
                runtime: env!("CARGO_PKG_VERSION"),
            });
        }
        let long = |field: &str, value: &str, max: usize| {
            if value.len() > max {
                Err(StartBoundsError::TooLong {
                    field: field.to_owned(),
                    len: value.len(),
                    max,
                })
            } else {
                Ok(())
            }
        };
        for (field, value) in [
            ("namespace", &self.namespace),
            ("name", &self.name),
            ("runId", &self.run_id),
            ("storage", &self.storage),
            ("dataSecret", &self.data_secret.0),
        ] {
            if value.is_empty() {
                return Err(StartBoundsError::Empty { field });
            }
        }
        long("namespace", &self.namespace, MAX_NAMESPACE_LEN)?;
        long("name", &self.name, MAX_NAME_LEN)?;
        long("runId", &self.run_id, MAX_RUN_ID_LEN)?;
        long("storage", &self.storage, MAX_URL_LEN)?;
        if let Some(url) = &self.restore_from {
            long("restoreFrom", url, MAX_URL_LEN)?;
        }
        long("dataSecret", &self.data_secret.0, MAX_DATA_SECRET_LEN)?;
        for (i, peer) in self.peers.iter().enumerate() {
            long(&format!("peers[{i}]"), peer, MAX_PEER_ADDRESS_LEN)?;
        }
        if let Some(secs) = self.ready_timeout_secs
            && secs > MAX_READY_TIMEOUT_SECS
        {
            return Err(StartBoundsError::TooLarge {
                field: "readyTimeoutSecs",
                value: secs,
                max: MAX_READY_TIMEOUT_SECS,
            });
        }
        if self.state_payload_bytes > MAX_STATE_PAYLOAD_BYTES {
            return Err(StartBoundsError::TooLarge {
                field: "statePayloadBytes",
                value: self.state_payload_bytes as u64,
                max: MAX_STATE_PAYLOAD_BYTES as u64,
            });
        }
        if !self.incremental.in_bounds() {
            return Err(StartBoundsError::Chain(self.incremental));
        }
        Ok(())
    }
}

/// A secret that must not appear in logs: its `Debug` form is redacted.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RunSecret(pub String);

impl std::fmt::Debug for RunSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RunSecret(redacted)")
    }
}

/// What a worker reports once its state is restored.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StartResponse {
    /// Key groups restored from the snapshot (its own range).
    pub groups_restored: u32,
    /// Keys restored.
    pub keys_restored: u64,
    /// Bytes read from the snapshot's state files.
    pub bytes_read: u64,
    /// Milliseconds spent restoring.
    pub restore_ms: u64,
    /// Source records the job can no longer read: a Kafka partition's restored offset lay
    /// below the earliest record the partition still holds (its retention deleted them before
    /// the job read them), so the source starts at that earliest record.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub records_expired: Vec<ExpiredRecords>,
}

/// Records of a source partition deleted before the job read them: offsets `from..to`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExpiredRecords {
    /// The partition (`topic/partition`).
    pub partition: String,
    /// The offset the snapshot had it at.
    pub from: u64,
    /// The earliest offset the partition still holds, where the source starts.
    pub to: u64,
}

/// The answer to an accepted `/v1/start`: the restore runs on.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StartAccepted {
    /// Bytes the restore reads in all (0: nothing to restore).
    pub bytes_total: u64,
    /// Key groups the restore reads in all.
    pub groups_total: u32,
    /// The source partitions this worker listed when it checked the request (a file source
    /// lists its directory then; absent for the generator, whose partitions are its spec's).
    /// Every worker of a run must have listed the same partitions, or a file that appeared
    /// during the start would be read by two subtasks or by none: the coordinator refuses a
    /// start whose workers differ ([`PartitionList::first_difference`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_partitions: Option<PartitionList>,
}

/// A worker's list of source partitions in brief: how many, and a digest of every name in
/// partition order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PartitionList {
    /// Number of partitions (files).
    pub count: u32,
    /// FNV-1a (64 bits, hex) over every name in partition order, each preceded by its length.
    pub digest: String,
}

impl PartitionList {
    /// The list of partition `names` (in partition order) in brief. Pure.
    pub fn of(names: &[String]) -> PartitionList {
        let mut bytes = Vec::new();
        for name in names {
            bytes.extend_from_slice(&(name.len() as u64).to_le_bytes());
            bytes.extend_from_slice(name.as_bytes());
        }
        PartitionList {
            count: names.len() as u32,
            digest: keyshift_core::hash::fnv(&bytes),
        }
    }

    /// The first subtask whose list (`lists`, in subtask order, as each worker's
    /// [`StartAccepted::source_partitions`]) differs from subtask 0's, if any. A worker that
    /// reported no list differs from one that did. Pure.
    pub fn first_difference(lists: &[Option<&PartitionList>]) -> Option<usize> {
        let first = lists.first()?;
        lists.iter().position(|l| l != first)
    }

    /// `3 files`, or what a worker without a list reported, for messages.
    pub fn describe(list: Option<&PartitionList>) -> String {
        match list {
            Some(l) => format!("{} files (digest {})", l.count, l.digest),
            None => "no partition list".to_owned(),
        }
    }
}

/// How far a running restore got.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RestoreProgress {
    /// Bytes of the subtask's key groups read so far.
    pub bytes_read: u64,
    /// Bytes to read in all.
    pub bytes_total: u64,
    /// Key groups read so far.
    pub groups_read: u32,
    /// Key groups to read in all.
    pub groups_total: u32,
}

/// A checkpoint or savepoint trigger.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointRequest {
    /// The snapshot id (never reused for a job).
    pub id: u64,
    /// Checkpoint or savepoint.
    pub kind: SnapshotKind,
    /// Stop the sources at the barrier (stop-with-savepoint).
    #[serde(default)]
    pub stop: bool,
    /// The job's newest committed snapshot id as the coordinator knows it (0: none yet; no
    /// snapshot above it has committed). A worker's object-store sink output staged at barriers
    /// above it did not commit and is staged again with this snapshot's
    /// ([`crate::job::staging::StagingSink::on_barrier`]). Absent (a coordinator from before this
    /// field): every earlier barrier counts as committed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_committed: Option<u64>,
}

/// Progress of one snapshot on one subtask.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
// Externally tagged: an internally tagged enum would buffer the acknowledgement and lose its
// integer map keys.
#[serde(rename_all = "camelCase")]
pub enum CheckpointStatus {
    /// Barriers are on their way or state is being written.
    Pending,
    /// The state file is durable.
    Completed(Box<SubtaskAck>),
    /// The subtask could not take the snapshot.
    Failed { error: String },
    /// The worker has never seen this id.
    Unknown,
}

/// A subtask's acknowledgement of a snapshot.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SubtaskAck {
    /// The state file and its groups.
    pub snapshot: SubtaskSnapshot,
    /// Positions of the source partitions this subtask reads, at the barrier.
    pub source_positions: BTreeMap<u32, u64>,
    /// Names of those partitions (file sources: the file name relative to the source
    /// directory), keyed like `source_positions`; empty for the generator.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub source_partitions: BTreeMap<u32, String>,
    /// The operator's watermark at the barrier.
    pub watermark: i64,
    /// Milliseconds from trigger to durable state.
    pub duration_ms: u64,
    /// Milliseconds the keyed operator held records up for this snapshot: the whole write for
    /// a full one, only the consistent cut for an incremental one whose upload ran while
    /// records flowed (absent from workers before incremental checkpoints).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocked_ms: Option<u64>,
}

/// A worker's state, as its control API reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerState {
    /// Waiting for `/v1/start` (a fresh process, or one that restarted and lost its state).
    #[default]
    Idle,
    /// Started: restoring its key groups and connecting to its peers.
    Restoring,
    /// Processing records.
    Running,
    /// Its sources stopped at a savepoint's barrier (until `/v1/resume` or the end of the run).
    Stopped,
    /// Pre-staged: its key groups are loaded from a checkpoint (`/v1/prestage`); it waits for
    /// `/v1/start`, reading no source and connected to no peer.
    Prestaged,
}

/// A worker's view of itself.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkerStatus {
    /// Where the worker is in its life (`idle`, `restoring`, `running`, `stopped`).
    pub state: WorkerState,
    pub subtask: u32,
    pub parallelism: u32,
    /// Inclusive key-group range owned.
    pub key_groups: Option<[u32; 2]>,
    /// Records read by this subtask's sources.
    pub records_in: u64,
    /// Records processed by this subtask's keyed operator.
    pub records_processed: u64,
    /// Records this subtask's sources combined into another of the same key (and window)
    /// before the shuffle (absent from workers of earlier versions).
    #[serde(default)]
    pub records_combined: u64,
    /// Results emitted to the sink.
    pub records_out: u64,
    /// Records that arrived after their window had fired.
    pub late_records: u64,
    /// Keys held (a program: its state entries, timers included, as of its last checkpoint,
    /// restore or catch-up).
    pub keys: u64,
    /// Keys per owned key group, in group order.
    pub keys_per_group: Vec<u64>,
    /// Milliseconds the sources spent blocked on full downstream buffers.
    pub backpressure_ms: u64,
    /// The operator watermark.
    pub watermark: i64,
    /// The last completed snapshot id.
    pub last_checkpoint: Option<u64>,
    /// Source positions now.
    pub source_positions: BTreeMap<u32, u64>,
    /// The restore of the current (or last) start: live while `restoring`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore: Option<RestoreProgress>,
    /// What the start restored, once it has (`running` or `stopped`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started: Option<StartResponse>,
    /// What a pre-stage loaded, once it has (`prestaged`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prestaged: Option<StartResponse>,
    /// Why the last start failed (the worker is `idle` again and can be started anew).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_start_error: Option<String>,
    /// Whether that failure was the snapshot's own (a state file lost or truncated, a block
    /// that does not match its checksum): a start from the same snapshot cannot succeed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub last_start_unrestorable: bool,
    /// Whether that failure was a refusal no retry can cure, found while restoring (the
    /// snapshot's state does not fit the job: a state declaration, a step's uid or the key type
    /// changed): the start is refused as a start request the worker answers with 422 is.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub last_start_refused: bool,
    /// The newest snapshot id this worker was triggered or told to abort, if any: a coordinator
    /// that takes the worker over continues above it (a worker ignores ids at or below the
    /// newest it finished or abandoned).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub newest_snapshot: Option<u64>,
    /// A Kafka source's consumer lag over this subtask's partitions, as last measured against
    /// the brokers (absent for other sources, and until the first measurement).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_lag: Option<SourceLag>,
}

/// How far a subtask's Kafka source is behind its partitions' ends, from the brokers' offsets
/// (see [`crate::job::kafka::source`], "Lag").
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SourceLag {
    /// When it was measured (Unix milliseconds).
    pub measured_ms: i64,
    /// Records behind, summed over the partitions measured.
    pub records: u64,
    /// Seconds behind: the most of any partition measured (absent when no partition's is known).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seconds: Option<f64>,
    /// Per partition this subtask reads.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partitions: Vec<PartitionLag>,
    /// The brokers could not be asked: the bootstrap servers, the request's error and the
    /// client's own reports (why it cannot connect). The numbers are then those of the last
    /// measurement that succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The source's bootstrap servers.
    #[serde(default)]
    pub bootstrap: String,
}

/// One partition's lag.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PartitionLag {
    /// `<topic>/<partition>`.
    pub partition: String,
    /// The next offset the source reads.
    pub position: u64,
    /// The partition's high watermark (the offset the next record written gets).
    pub high_watermark: u64,
    /// `highWatermark - position` (0 if negative).
    pub records: u64,
    /// Seconds behind (absent while unknown: nothing read and never seen fully read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seconds: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_requests_without_last_committed_still_parse() {
        let old: CheckpointRequest =
            serde_json::from_str(r#"{"id":7,"kind":"checkpoint"}"#).unwrap();
        assert_eq!((old.id, old.stop, old.last_committed), (7, false, None));
        let new = CheckpointRequest {
            id: 8,
            kind: SnapshotKind::Savepoint,
            stop: true,
            last_committed: Some(6),
        };
        let text = serde_json::to_string(&new).unwrap();
        assert!(text.contains(r#""lastCommitted":6"#), "{text}");
        let back: CheckpointRequest = serde_json::from_str(&text).unwrap();
        assert_eq!(back.last_committed, Some(6));
    }

    #[test]
    fn worker_status_carries_restore_progress_and_start_errors() {
        // A status without the start fields (an idle worker that never started) parses.
        let old: WorkerStatus = serde_json::from_value(serde_json::json!({
            "state": "idle", "subtask": 0, "parallelism": 0, "keyGroups": null,
            "recordsIn": 0, "recordsProcessed": 0, "recordsOut": 0, "lateRecords": 0,
            "keys": 0, "keysPerGroup": [], "backpressureMs": 0, "watermark": 0,
            "lastCheckpoint": null, "sourcePositions": {}
        }))
        .unwrap();
        assert!(old.restore.is_none() && old.started.is_none() && old.last_start_error.is_none());
        let st = WorkerStatus {
            state: WorkerState::Restoring,
            restore: Some(RestoreProgress {
                bytes_read: 10,
                bytes_total: 40,
                groups_read: 1,
                groups_total: 4,
            }),
            last_start_error: Some("checksum mismatch".into()),
            ..WorkerStatus::default()
        };
        let text = serde_json::to_string(&st).unwrap();
        assert!(
            text.contains(
                r#""restore":{"bytesRead":10,"bytesTotal":40,"groupsRead":1,"groupsTotal":4}"#
            ),
            "{text}"
        );
        assert!(
            text.contains(r#""lastStartError":"checksum mismatch""#),
            "{text}"
        );
        assert!(!text.contains("started"), "{text}");
        let back: WorkerStatus = serde_json::from_str(&text).unwrap();
        assert_eq!(back.state, WorkerState::Restoring);
        assert_eq!(back.restore, st.restore);
        assert_eq!(back.last_start_error.as_deref(), Some("checksum mismatch"));
    }

    #[test]
    fn start_requests_beyond_their_bounds_name_the_field_and_the_bound() {
        let ok = StartRequest {
            protocol: PROTOCOL_VERSION,
            namespace: "team".into(),
            name: "clicks".into(),
            job: serde_yaml::from_str(
                "{source: {generator: {partitions: 1, keys: 1}}, key: {field: key}, aggregation: {function: count}}",
            )
            .unwrap(),
            subtask: 0,
            parallelism: 1,
            max_parallelism: 8,
            peers: vec!["10.0.0.1:9091".into()],
            storage: "memory://x".into(),
            restore_from: None,
            allow_non_restored_state: false,
            state_payload_bytes: MAX_STATE_PAYLOAD_BYTES,
            run_id: "clicks-abc123".into(),
            data_secret: RunSecret("s".into()),
            incremental: Default::default(),
            ready_timeout_secs: Some(900),
        };
        assert_eq!(ok.check_bounds(), Ok(()));
        assert_eq!(ok.start_window(), std::time::Duration::from_secs(900));
        let unsaid = StartRequest {
            ready_timeout_secs: None,
            ..ok.clone()
        };
        assert_eq!(unsaid.start_window(), DEFAULT_START_WINDOW);
        // Sent as camelCase, and absent from an older coordinator's request.
        let json = serde_json::to_value(&ok).unwrap();
        assert_eq!(json["readyTimeoutSecs"], 900);
        let mut old = json.clone();
        old.as_object_mut().unwrap().remove("readyTimeoutSecs");
        let read: StartRequest = serde_json::from_value(old).unwrap();
        assert_eq!(read.ready_timeout_secs, None);
        let refused = |edit: &dyn Fn(&mut StartRequest)| {
            let mut r = ok.clone();
            edit(&mut r);
            r.check_bounds().unwrap_err().to_string()
        };
        assert_eq!(
            refused(&|r| r.ready_timeout_secs = Some(MAX_READY_TIMEOUT_SECS + 1)),
            "readyTimeoutSecs is 604801: it may be at most 604800"
        );
        assert_eq!(
            refused(&|r| r.namespace = "n".repeat(64)),
            "namespace is 64 bytes long: it may be at most 63 bytes"
        );
        assert_eq!(
            refused(&|r| r.name = "n".repeat(254)),
            "name is 254 bytes long: it may be at most 253 bytes"
        );
        assert_eq!(
            refused(&|r| r.run_id = "r".repeat(MAX_RUN_ID_LEN + 1)),
            format!(
                "runId is {} bytes long: it may be at most {MAX_RUN_ID_LEN} bytes",
                MAX_RUN_ID_LEN + 1
            )
        );
        assert!(refused(&|r| r.restore_from = Some("u".repeat(2049))).starts_with("restoreFrom "));
        assert!(refused(&|r| r.storage = "u".repeat(2049)).starts_with("storage "));
        assert!(refused(&|r| r.peers[0] = "p".repeat(513)).starts_with("peers[0] "));
        assert!(
            refused(&|r| r.data_secret = RunSecret("s".repeat(1025))).starts_with("dataSecret ")
        );
        assert_eq!(
            refused(&|r| r.state_payload_bytes = usize::MAX),
            format!(
                "statePayloadBytes is {}: it may be at most 65536",
                usize::MAX
            )
        );
        assert_eq!(refused(&|r| r.run_id.clear()), "runId must not be empty");
        let other = refused(&|r| r.protocol = 0);
        assert!(
            other.contains("speaks worker protocol 0")
                && other.contains(&format!("speaks {PROTOCOL_VERSION}")),
            "{other}"
        );
        // A sender from before versions were sent is protocol 0.
        let mut old: serde_json::Value = serde_json::to_value(&ok).unwrap();
        old.as_object_mut().unwrap().remove("protocol");
        let old: StartRequest = serde_json::from_value(old).unwrap();
        assert_eq!(old.protocol, 0);
        assert_eq!(
            refused(&|r| r.incremental.policy.max_deltas = 0),
            "incremental is 0 deltas and 50%: maxDeltas must lie in 1..=64 and maxDeltaPercent in 10..=400"
        );
    }

    #[test]
    fn partition_lists_tell_names_apart_and_are_absent_for_the_generator() {
        let list = |names: &[&str]| {
            PartitionList::of(&names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
        };
        let ab_c = list(&["ab", "c"]);
        assert_eq!(ab_c.count, 2);
        assert_eq!(ab_c, list(&["ab", "c"]));
        // Names are delimited, and order counts.
        assert_ne!(ab_c.digest, list(&["a", "bc"]).digest);
        assert_ne!(ab_c.digest, list(&["c", "ab"]).digest);
        assert_eq!(ab_c.digest.len(), 16);
        // An answer without the field (the generator, or a worker from before it) parses.
        let old: StartAccepted =
            serde_json::from_str(r#"{"bytesTotal":1,"groupsTotal":2}"#).unwrap();
        assert!(old.source_partitions.is_none());
        let text = serde_json::to_string(&StartAccepted::default()).unwrap();
        assert!(!text.contains("sourcePartitions"), "{text}");
        let text = serde_json::to_string(&StartAccepted {
            source_partitions: Some(ab_c.clone()),
            ..StartAccepted::default()
        })
        .unwrap();
        assert!(
            text.contains(&format!(
                r#""sourcePartitions":{{"count":2,"digest":"{}"}}"#,
                ab_c.digest
            )),
            "{text}"
        );
        let same = Some(&ab_c);
        let other = list(&["ab"]);
        assert_eq!(PartitionList::first_difference(&[same, same]), None);
        assert_eq!(
            PartitionList::first_difference(&[same, same, Some(&other)]),
            Some(2)
        );
        assert_eq!(PartitionList::first_difference(&[None, same]), Some(1));
        assert_eq!(PartitionList::first_difference(&[]), None);
    }

    #[test]
    fn checkpoint_status_round_trips() {
        let ack = SubtaskAck {
            snapshot: serde_json::from_value(serde_json::json!({
                "subtask": 0, "parallelism": 1, "maxParallelism": 1,
                "file": {"name": "state-0-of-1.bin", "size": 0, "checksum": "00000000"},
                "groups": [{"group": 0, "file": "state-0-of-1.bin", "offset": 0, "length": 0, "checksum": "00000000", "entries": 0}]
            }))
            .unwrap(),
            source_positions: BTreeMap::from([(0, 5)]),
            source_partitions: BTreeMap::from([(0, "part-0.jsonl".into())]),
            watermark: i64::MIN,
            duration_ms: 3,
            blocked_ms: Some(1),
        };
        for st in [
            CheckpointStatus::Pending,
            CheckpointStatus::Completed(Box::new(ack)),
            CheckpointStatus::Failed { error: "x".into() },
            CheckpointStatus::Unknown,
        ] {
            let text = serde_json::to_string(&st).unwrap();
            let back: CheckpointStatus =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(back, st);
        }
    }
}
