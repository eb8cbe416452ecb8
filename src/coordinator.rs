//! The checkpoint coordinator: starts workers with their assignment, triggers checkpoints and
//! savepoints, collects acknowledgements and commits manifests (create-only, last), applies
//! retention. It talks to workers only through the control API, so the same code serves
//! `keyshift local` (processes) and the operator (pods).

use crate::keygroup::Assignment;
use crate::runtime::protocol::*;
use crate::snapshot::{self, JobIdentity, Manifest, ObjectStore, Path, SnapshotKind, SnapshotMeta};
use chrono::Utc;
use futures::future::try_join_all;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Coordinator failures.
#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    #[error("worker {subtask} ({url}): {reason}")]
    Worker {
        subtask: usize,
        url: String,
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
    #[error(transparent)]
    Snapshot(#[from] snapshot::SnapshotError),
    #[error("publishing sink output: {0}")]
    Sink(String),
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

/// The URL of a snapshot directory under a storage root.
pub fn snapshot_url(
    storage: &str,
    namespace: &str,
    job: &str,
    kind: SnapshotKind,
    id: u64,
) -> String {
    format!(
        "{}/{namespace}/{job}/{}/{}{id}",
        storage.trim_end_matches('/'),
        kind.folder(),
        kind.dir_prefix()
    )
}

/// Coordinates one run of a job (one set of workers at one parallelism).
pub struct Coordinator {
    http: reqwest::Client,
    token: String,
    workers: Vec<WorkerEndpoint>,
    store: Arc<dyn ObjectStore>,
    job_dir: Path,
    storage: String,
    identity: JobIdentity,
    assignment: Assignment,
    next_id: u64,
    retained: usize,
    /// The object-store sink (store and base path), whose staged output is published after
    /// each commit.
    sink: Option<(Arc<dyn ObjectStore>, Path)>,
}

impl Coordinator {
    /// A coordinator for `workers` (subtask order). Snapshot ids continue after the largest id
    /// already in storage, so an id is never reused.
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
        let next_id = next_snapshot_id(store.as_ref(), &job_dir).await?;
        let http = reqwest::Client::builder()
            .timeout(crate::orchestrator::run::timeouts::CONTROL_REQUEST)
            .build()
            .map_err(|e| CoordinatorError::Worker {
                subtask: 0,
                url: String::new(),
                reason: e.to_string(),
            })?;
        Ok(Coordinator {
            http,
            token,
            workers,
            store,
            job_dir,
            storage: storage.to_owned(),
            identity,
            assignment,
            next_id,
            retained,
            sink: None,
        })
    }

    /// Publishes the staged output of the object-store sink at `url` after every commit.
    pub fn with_sink(mut self, url: Option<&str>) -> Result<Self, CoordinatorError> {
        self.sink = url.map(snapshot::open_store).transpose()?;
        Ok(self)
    }

    /// Makes the sink output of committed snapshot `id` visible (idempotent; also run after a
    /// restore from `id`, in case the crash came between commit and publish).
    pub async fn publish(&self, id: u64) -> Result<(), CoordinatorError> {
        if let Some((store, base)) = &self.sink {
            crate::sink::publish(store.as_ref(), base, id)
                .await
                .map_err(|e| CoordinatorError::Sink(e.to_string()))?;
        }
        Ok(())
    }

    pub fn assignment(&self) -> Assignment {
        self.assignment
    }

    pub fn workers(&self) -> &[WorkerEndpoint] {
        &self.workers
    }

    fn fail(&self, subtask: usize, reason: impl std::fmt::Display) -> CoordinatorError {
        CoordinatorError::Worker {
            subtask,
            url: self.workers[subtask].control.clone(),
            reason: reason.to_string(),
        }
    }

    async fn post<T: serde::Serialize, R: serde::de::DeserializeOwned>(
        &self,
        subtask: usize,
        path: &str,
        body: &T,
    ) -> Result<Option<R>, CoordinatorError> {
        let url = format!("{}{path}", self.workers[subtask].control);
        let resp = self
            .http
            .post(&url)
            .bearer_auth(&self.token)
            .json(body)
            .send()
            .await
            .map_err(|e| self.fail(subtask, e))?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            return Err(self.fail(subtask, format!("{path}: HTTP {status}: {text}")));
        }
        if status == reqwest::StatusCode::ACCEPTED || status == reqwest::StatusCode::NO_CONTENT {
            return Ok(None);
        }
        let bytes = resp.bytes().await.map_err(|e| self.fail(subtask, e))?;
        if bytes.is_empty() {
            return Ok(None);
        }
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| self.fail(subtask, format!("{path}: bad answer: {e}")))
    }

    async fn get<R: serde::de::DeserializeOwned>(
        &self,
        subtask: usize,
        path: &str,
    ) -> Result<R, CoordinatorError> {
        let url = format!("{}{path}", self.workers[subtask].control);
        let resp = self
            .http
            .get(&url)
            .bearer_auth(&self.token)
            .send()
            .await
            .map_err(|e| self.fail(subtask, e))?;
        let status = resp.status();
        if !status.is_success() {
            return Err(self.fail(subtask, format!("{path}: HTTP {status}")));
        }
        resp.json().await.map_err(|e| self.fail(subtask, e))
    }

    /// Starts every worker with its subtask index and waits until all are connected.
    /// `template.subtask` is overwritten per worker; `template.peers` is filled in.
    pub async fn start(
        &self,
        template: &StartRequest,
        ready_timeout: Duration,
    ) -> Result<Vec<StartResponse>, CoordinatorError> {
        let peers: Vec<String> = self.workers.iter().map(|w| w.data.clone()).collect();
        let responses = try_join_all((0..self.workers.len()).map(|i| {
            let mut req = template.clone();
            req.subtask = i as u32;
            req.peers = peers.clone();
            async move {
                self.post::<_, StartResponse>(i, "/v1/start", &req)
                    .await
                    .map(Option::unwrap_or_default)
            }
        }))
        .await?;
        self.wait_ready(ready_timeout).await?;
        Ok(responses)
    }

    /// Waits until every worker answers `/v1/readyz`.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<(), CoordinatorError> {
        let start = Instant::now();
        loop {
            let mut waiting = Vec::new();
            for (i, w) in self.workers.iter().enumerate() {
                let ok = self
                    .http
                    .get(format!("{}/v1/readyz", w.control))
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success());
                if !ok {
                    waiting.push(i);
                }
            }
            if waiting.is_empty() {
                return Ok(());
            }
            if start.elapsed() > timeout {
                return Err(CoordinatorError::NotReady(
                    timeout.as_secs(),
                    format!("subtasks {waiting:?}"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Takes a checkpoint or savepoint (optionally stopping the sources at the barrier) and
    /// commits it. On failure nothing is committed, the last good snapshot is untouched, and
    /// sources stopped by this call are resumed.
    pub async fn snapshot(
        &mut self,
        kind: SnapshotKind,
        stop: bool,
        timeout: Duration,
    ) -> Result<Completed, CoordinatorError> {
        let id = self.next_id;
        self.next_id += 1;
        let started = Instant::now();
        let result = self.take(id, kind, stop, timeout).await;
        match result {
            Ok(manifest) => {
                let duration = started.elapsed();
                if kind == SnapshotKind::Checkpoint
                    && let Err(e) =
                        snapshot::retain(self.store.as_ref(), &self.job_dir, self.retained).await
                {
                    tracing::warn!(error = %e, "checkpoint retention failed; will retry next time");
                }
                Ok(Completed {
                    id,
                    kind,
                    url: snapshot_url(
                        &self.storage,
                        &self.identity.namespace,
                        &self.identity.name,
                        kind,
                        id,
                    ),
                    manifest,
                    duration,
                })
            }
            Err(e) => {
                if stop {
                    // Leave the job running at its old parallelism.
                    self.resume().await;
                }
                Err(e)
            }
        }
    }

    async fn take(
        &self,
        id: u64,
        kind: SnapshotKind,
        stop: bool,
        timeout: Duration,
    ) -> Result<Manifest, CoordinatorError> {
        let req = &CheckpointRequest { id, kind, stop };
        try_join_all((0..self.workers.len()).map(|i| async move {
            self.post::<_, serde_json::Value>(i, "/v1/checkpoints", req)
                .await
        }))
        .await?;
        let deadline = Instant::now() + timeout;
        let mut acks: Vec<Option<SubtaskAck>> = vec![None; self.workers.len()];
        loop {
            for (i, slot) in acks.iter_mut().enumerate() {
                if slot.is_some() {
                    continue;
                }
                match self
                    .get::<CheckpointStatus>(i, &format!("/v1/checkpoints/{id}"))
                    .await?
                {
                    CheckpointStatus::Completed(ack) => *slot = Some(*ack),
                    CheckpointStatus::Failed { error } => {
                        return Err(CoordinatorError::SnapshotFailed {
                            id,
                            subtask: i,
                            error,
                        });
                    }
                    CheckpointStatus::Unknown => {
                        return Err(CoordinatorError::SnapshotFailed {
                            id,
                            subtask: i,
                            error: "the worker lost the trigger (restarted?)".into(),
                        });
                    }
                    CheckpointStatus::Pending => {}
                }
            }
            if acks.iter().all(Option::is_some) {
                break;
            }
            if Instant::now() > deadline {
                let missing = acks
                    .iter()
                    .enumerate()
                    .filter(|(_, a)| a.is_none())
                    .map(|(i, _)| i)
                    .collect();
                return Err(CoordinatorError::SnapshotTimeout {
                    id,
                    secs: timeout.as_secs(),
                    missing,
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let acks: Vec<SubtaskAck> = acks.into_iter().flatten().collect();
        let mut positions = BTreeMap::new();
        for a in &acks {
            positions.extend(a.source_positions.iter().map(|(k, v)| (*k, *v)));
        }
        let watermark = acks
            .iter()
            .map(|a| a.watermark)
            .min()
            .filter(|w| *w > i64::MIN);
        let meta = SnapshotMeta {
            job: self.identity.clone(),
            snapshot_id: id,
            kind,
            completed_at: Utc::now(),
            state_schema: crate::job::AGG_SCHEMA.to_owned(),
            source_positions: positions,
            watermark,
        };
        let manifest = Manifest::assemble(
            meta,
            self.assignment,
            acks.into_iter().map(|a| a.snapshot).collect(),
        )?;
        let dir = snapshot::snapshot_dir(&self.job_dir, kind, id);
        snapshot::commit_manifest(self.store.as_ref(), &dir, &manifest).await?;
        // Committed: the sink output of this snapshot may become visible. A failure here is
        // repaired by publishing again after a restore from this snapshot.
        if let Err(e) = self.publish(id).await {
            tracing::warn!(id, error = %e, "sink publish failed; it is retried on restore");
        }
        Ok(manifest)
    }

    /// Resumes sources stopped by a savepoint (best effort: a worker that cannot be reached will
    /// be restarted from the last checkpoint by its platform).
    pub async fn resume(&self) {
        for i in 0..self.workers.len() {
            if let Err(e) = self
                .post::<_, serde_json::Value>(i, "/v1/resume", &())
                .await
            {
                tracing::warn!(subtask = i, error = %e, "resume failed");
            }
        }
    }

    /// Every worker's status, in subtask order.
    pub async fn status(&self) -> Result<Vec<WorkerStatus>, CoordinatorError> {
        try_join_all((0..self.workers.len()).map(|i| self.get::<WorkerStatus>(i, "/v1/status")))
            .await
    }
}

/// One more than the largest snapshot id in the job's storage (checkpoints and savepoints,
/// committed or not, so an id is never reused).
pub async fn next_snapshot_id(
    store: &dyn ObjectStore,
    job_dir: &Path,
) -> Result<u64, CoordinatorError> {
    let mut max = 0;
    for kind in [SnapshotKind::Checkpoint, SnapshotKind::Savepoint] {
        let prefix = job_dir.clone().join(kind.folder());
        let listing = store
            .list_with_delimiter(Some(&prefix))
            .await
            .map_err(|e| snapshot::SnapshotError::store("list", &prefix, e))?;
        for dir in listing.common_prefixes {
            if let Some(id) = dir
                .filename()
                .and_then(|n| snapshot::parse_snapshot_dir_name(kind, n))
            {
                max = max.max(id);
            }
        }
    }
    Ok(max + 1)
}

/// The key-group count of the snapshot named by a spec.restoreFrom `url` (from its manifest), or
/// why it cannot be restored from.
pub async fn restore_from_key_groups(url: &str) -> Result<u32, String> {
    snapshot::open_snapshot(url)
        .await
        .map(|(_, _, m)| m.max_parallelism)
        .map_err(|e| {
            format!(
                "spec.restoreFrom {url} cannot be restored: {e}; point it at a committed savepoint or checkpoint directory (one holding _manifest.json), or remove it"
            )
        })
}

/// The newest committed snapshot of a job (checkpoint or savepoint, by id), if any.
pub async fn latest_snapshot(
    storage: &str,
    namespace: &str,
    job: &str,
) -> Result<Option<(String, snapshot::SnapshotInfo)>, CoordinatorError> {
    latest_snapshot_with(storage, namespace, job, None).await
}

/// The newest committed snapshot of a job taken under `max_parallelism` key groups (any, with
/// `None`): after a restore from a rewritten savepoint, the job's older snapshots have the old
/// key-group count and can no longer be restored by it.
pub async fn latest_snapshot_with(
    storage: &str,
    namespace: &str,
    job: &str,
    max_parallelism: Option<u32>,
) -> Result<Option<(String, snapshot::SnapshotInfo)>, CoordinatorError> {
    let (store, base) = snapshot::open_store(storage)?;
    let job_dir = snapshot::job_dir(&base, namespace, job);
    let all = snapshot::list_snapshots(store.as_ref(), &job_dir).await?;
    Ok(all
        .into_iter()
        .filter(|s| max_parallelism.is_none_or(|g| s.max_parallelism == g))
        .max_by_key(|s| s.id)
        .map(|s| (snapshot_url(storage, namespace, job, s.kind, s.id), s)))
}
