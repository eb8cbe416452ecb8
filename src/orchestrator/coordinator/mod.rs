//! The checkpoint coordinator: starts workers with their assignment, triggers checkpoints and
//! savepoints, collects acknowledgements and commits manifests (create-only, last), applies
//! retention, and publishes the object-store sink's output of committed snapshots. It talks to
//! workers only through the control API, so the same code serves `keyshift local` (processes)
//! and the operator (pods).
//!
//! # The sink's output
//!
//! With a sink attached ([`Coordinator::with_sink`]) every trigger tells the workers the job's
//! newest committed snapshot ([`CheckpointRequest::last_committed`]), so the output they stage
//! for a snapshot holds everything since that one (see [`crate::job::staging`]). After each commit
//! the coordinator publishes the committed snapshot's output ([`crate::sink::publish`]). A
//! failed publish is not lost: the id stays pending and is retried after every later commit
//! (and by [`Coordinator::publish_pending`]); snapshots are published in id order, so a reader
//! never sees a snapshot's output before an earlier one's. While publishing is behind
//! ([`Coordinator::publish_backlog`]), checkpoint retention is skipped, so that the committed
//! snapshots whose output is not visible yet stay listed in storage. A coordinator of a new run
//! publishes what the run restores from ([`Coordinator::start`]), and every coordinator, at its
//! first commit, also publishes committed output an earlier one left unpublished (it crashed
//! between commit and publish), so one that takes over running workers catches up by itself;
//! [`Coordinator::publish_committed`] does that at once.
//!
//! One module per role around the [`Coordinator`] here: `client` (requests to a worker's control
//! API), `start` (starting or pre-staging a run's workers), `checkpoint` (trigger, acknowledge,
//! commit, abort), `publish` (the sink's output). Which snapshots a job has is the snapshot
//! catalog's ([`crate::snapshot::newest_snapshot`], [`crate::snapshot::next_snapshot_id`]).

use crate::runtime::protocol::*;
use crate::snapshot::{
    self, JobIdentity, Manifest, ObjectStore, Path, SnapshotKind, SnapshotMeta, is_committed,
    snapshot_ids, snapshot_url,
};
use futures::future::try_join_all;
use jiff::Timestamp;
use keyshift_core::keygroup::Assignment;
use object_store::ObjectStoreExt;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

mod checkpoint;
mod client;
mod publish;
mod start;
#[cfg(test)]
pub(crate) mod tests;

pub use self::client::{CONTROL_REQUEST_TIMEOUT, MAX_WORKER_ANSWER_BYTES};
pub use self::publish::PublishBacklog;
use self::publish::*;
pub use self::start::StartProgress;

/// Coordinator failures.
#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    #[error("worker {subtask} ({url}): {reason}")]
    Worker {
        subtask: usize,
        url: String,
        reason: String,
    },
    /// The worker refused the request for good (HTTP 422): the same request can never succeed,
    /// only a changed spec or image can help.
    #[error("worker {subtask} ({url}) refused: {reason}")]
    Refused {
        subtask: usize,
        url: String,
        reason: String,
    },
    /// A worker could not restore the snapshot itself (a state file lost or truncated, a block
    /// that does not match its checksum): a start from it cannot succeed, an older one may.
    #[error("worker {subtask} ({url}): the snapshot {snapshot} cannot be restored: {reason}")]
    Unrestorable {
        subtask: usize,
        url: String,
        snapshot: String,
        reason: String,
    },
    #[error("snapshot {id} failed on subtask {subtask}: {error}")]
    SnapshotFailed {
        id: u64,
        subtask: usize,
        error: String,
    },
    #[error("snapshot {id} timed out after {secs}s waiting for subtasks {missing:?}")]
    SnapshotTimeout {
        id: u64,
        secs: u64,
        missing: Vec<usize>,
    },
    #[error("workers not ready after {0}s: {1}")]
    NotReady(u64, String),
    #[error(
        "the workers listed different source partitions: subtask 0 {first}, subtask {subtask} {other} (a file appeared in or vanished from the source directory while the run started); the start is refused so that no file is read twice or never: start again"
    )]
    PartitionsDiffer {
        /// The first subtask whose list differs from subtask 0's.
        subtask: usize,
        /// Subtask 0's list ([`PartitionList::describe`]).
        first: String,
        /// That subtask's list.
        other: String,
    },
    #[error(
        "snapshot {id}: committing the manifest failed ({error}) and whether it was written is unknown ({check}); it is checked again before the next snapshot"
    )]
    CommitInDoubt {
        id: u64,
        error: String,
        check: String,
    },
    #[error(transparent)]
    Snapshot(#[from] snapshot::SnapshotError),
    #[error("publishing sink output: {0}")]
    Sink(#[from] crate::sink::SinkError),
}

/// Where a worker listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerEndpoint {
    /// Base URL of the control API, e.g. `http://10.0.0.5:9090`.
    pub control: String,
    /// Data-plane address `host:port`.
    pub data: String,
}

/// A committed snapshot.
#[derive(Debug, Clone)]
pub struct Completed {
    pub id: u64,
    pub kind: SnapshotKind,
    /// URL of the snapshot directory.
    pub url: String,
    pub manifest: Manifest,
    /// Trigger to commit.
    pub duration: Duration,
}

/// Coordinates one run of a job (one set of workers at one parallelism).
pub struct Coordinator {
    http: reqwest::Client,
    /// The per-request timeout of `http`: a long poll holds less than half of it.
    request_timeout: Duration,
    token: String,
    workers: Vec<WorkerEndpoint>,
    store: Arc<dyn ObjectStore>,
    job_dir: Path,
    storage: String,
    identity: JobIdentity,
    assignment: Assignment,
    next_id: u64,
    /// The job's newest committed snapshot id (0: none), as triggers tell the workers.
    last_committed: u64,
    /// Snapshots whose manifest commit failed without telling whether it was written: checked
    /// before the next trigger, which must name the newest committed snapshot exactly.
    in_doubt: BTreeMap<u64, SnapshotKind>,
    /// Whether snapshot ids were raised above the newest id any worker knows yet (once).
    worker_ids_checked: bool,
    retained: usize,
    /// The object-store sink whose staged output is published after each commit.
    sink: Option<Sink>,
    /// How far the restore of the run's start got ([`Coordinator::restore_progress`]).
    restore: tokio::sync::watch::Sender<Option<StartProgress>>,
}

impl Coordinator {
    /// How far the restore of the run's start got: `None` until [`Coordinator::start`] asked
    /// the workers for the first time, then updated with every round of status requests (the
    /// last value stays once the start ended). Every receiver sees the same values.
    pub fn restore_progress(&self) -> tokio::sync::watch::Receiver<Option<StartProgress>> {
        self.restore.subscribe()
    }

    /// The job as this coordinator's snapshots name it.
    pub fn identity(&self) -> &JobIdentity {
        &self.identity
    }

    /// A coordinator for `workers` (subtask order). Snapshot ids continue after the largest id
    /// already in storage (and, with a sink, under the sink), so an id is never reused; the
    /// newest committed one is what the first trigger tells the workers.
    pub async fn new(
        storage: &str,
        identity: JobIdentity,
        assignment: Assignment,
        workers: Vec<WorkerEndpoint>,
        token: String,
        retained: usize,
    ) -> Result<Self, CoordinatorError> {
        let (store, base) = snapshot::open_store(storage)?;
        let job_dir = snapshot::job_dir(&base, &identity.namespace, &identity.name);
        let ids = snapshot_ids(store.as_ref(), &job_dir).await?;
        let next_id = ids.first().map_or(1, |(id, _)| id + 1);
        let mut last_committed = 0;
        for (id, kind) in &ids {
            if is_committed(store.as_ref(), &job_dir, *kind, *id).await? {
                last_committed = *id;
                break;
            }
        }
        let request_timeout = crate::failpoints::control_request_timeout(CONTROL_REQUEST_TIMEOUT);
        let http = reqwest::Client::builder()
            .timeout(request_timeout)
            .build()
            .map_err(|e| CoordinatorError::Worker {
                subtask: 0,
                url: String::new(),
                reason: e.to_string(),
            })?;
        Ok(Coordinator {
            http,
            request_timeout,
            token,
            workers,
            store,
            job_dir,
            storage: storage.to_owned(),
            identity,
            assignment,
            next_id,
            last_committed,
            in_doubt: BTreeMap::new(),
            worker_ids_checked: false,
            retained,
            sink: None,
            restore: tokio::sync::watch::channel(None).0,
        })
    }

    pub fn assignment(&self) -> Assignment {
        self.assignment
    }

    pub fn workers(&self) -> &[WorkerEndpoint] {
        &self.workers
    }
}
