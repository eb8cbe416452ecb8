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
//! for a snapshot holds everything since that one (see [`crate::job::sink`]). After each commit
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

use crate::runtime::protocol::*;
use crate::snapshot::{
    self, JobIdentity, Manifest, ObjectStore, Path, SnapshotKind, SnapshotMeta, snapshot_url,
};
use chrono::Utc;
use futures::future::try_join_all;
use keyshift_core::keygroup::Assignment;
use object_store::ObjectStoreExt;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, PoisonError};
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

/// Refuses a start whose workers (`accepted`, in subtask order) listed different source
/// partitions. Pure.
fn check_partition_lists(accepted: &[StartAccepted]) -> Result<(), CoordinatorError> {
    let lists: Vec<Option<&PartitionList>> = accepted
        .iter()
        .map(|a| a.source_partitions.as_ref())
        .collect();
    match PartitionList::first_difference(&lists) {
        None => Ok(()),
        Some(subtask) => Err(CoordinatorError::PartitionsDiffer {
            subtask,
            first: PartitionList::describe(lists[0]),
            other: PartitionList::describe(lists[subtask]),
        }),
    }
}

/// One request of the coordinator to a worker's control API.
pub const CONTROL_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// The most a worker's answer to the coordinator may hold: a subtask's acknowledgement is part of
/// a snapshot's manifest, which is bounded the same ([`snapshot::MAX_MANIFEST_BYTES`]).
pub const MAX_WORKER_ANSWER_BYTES: u64 = snapshot::MAX_MANIFEST_BYTES;

/// Whether the sink's committed output is all visible ([`Coordinator::publish_backlog`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PublishBacklog {
    /// Committed snapshots whose output is not (all) published yet, oldest first; retried after
    /// every commit and by [`Coordinator::publish_pending`].
    pub pending: Vec<u64>,
    /// Why the last attempt failed, while anything is pending.
    pub last_error: Option<String>,
}

impl PublishBacklog {
    /// Whether publishing is behind.
    pub fn is_behind(&self) -> bool {
        !self.pending.is_empty()
    }
}

/// The object-store sink a coordinator publishes.
struct Sink {
    store: Arc<dyn ObjectStore>,
    base: Path,
    /// Whether snapshot ids were raised above the ids of the sink's output yet.
    ids_checked: bool,
    /// Whether this coordinator looked for committed output that an earlier one left
    /// unpublished (it does at its first commit).
    caught_up: bool,
    /// Committed ids not published yet (a lock: publishing runs behind `&self`, e.g. in
    /// [`Coordinator::start`]; never held across an await).
    backlog: Mutex<(BTreeSet<u64>, Option<String>)>,
    /// For a Kafka sink: the publisher that produces the staged output (instead of copying it
    /// to published objects; see [`crate::job::kafka::sink`]).
    #[cfg(feature = "kafka")]
    kafka: Option<Arc<crate::job::kafka::sink::KafkaPublisher>>,
    /// Whether snapshot ids were raised above the Kafka sink's marker yet.
    #[cfg(feature = "kafka")]
    marker_checked: bool,
}

impl Sink {
    /// Makes snapshot `id`'s staged output visible: published objects, or records of a Kafka
    /// transaction. A summary for the log.
    async fn publish_one(&self, id: u64) -> Result<String, crate::sink::SinkError> {
        #[cfg(feature = "kafka")]
        if let Some(k) = &self.kafka {
            let p = k
                .publish(self.store.as_ref(), &self.base, id)
                .await
                .map_err(|e| crate::sink::SinkError::Kafka(e.to_string()))?;
            return Ok(format!(
                "{} parts, {} records produced{}",
                p.parts,
                p.records,
                if p.already { " (in Kafka already)" } else { "" }
            ));
        }
        let p = crate::sink::publish(self.store.as_ref(), &self.base, id).await?;
        Ok(format!("{} parts, {} copied", p.parts, p.copied))
    }
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

/// How far the restore of a run's start got, summed over its workers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StartProgress {
    /// Bytes of the snapshot's state read so far.
    pub bytes_read: u64,
    /// Bytes the workers read in all.
    pub bytes_total: u64,
    /// Key groups read so far.
    pub groups_read: u64,
    /// Key groups the workers read in all.
    pub groups_total: u64,
    /// Subtasks whose restore is done.
    pub subtasks_done: u32,
    /// Subtasks of the run.
    pub subtasks: u32,
}

impl StartProgress {
    /// The sum over a run's workers of what each accepted to read (`accepted`, from
    /// `/v1/start`), how far each reports it got (`reported`, from `/v1/status` while it
    /// restores) and what each restored once done (`done`); all in subtask order. Pure.
    pub fn sum(
        accepted: &[StartAccepted],
        reported: &[Option<RestoreProgress>],
        done: &[Option<StartResponse>],
    ) -> StartProgress {
        let mut sum = StartProgress {
            subtasks: accepted.len() as u32,
            ..StartProgress::default()
        };
        for (i, a) in accepted.iter().enumerate() {
            let (read, total, groups_read, groups_total) = match (
                done.get(i).and_then(Option::as_ref),
                reported.get(i).copied().flatten(),
            ) {
                (Some(d), _) => {
                    sum.subtasks_done += 1;
                    let groups = u64::from(d.groups_restored);
                    (
                        d.bytes_read,
                        a.bytes_total.max(d.bytes_read),
                        groups,
                        u64::from(a.groups_total).max(groups),
                    )
                }
                (None, Some(p)) => (
                    p.bytes_read,
                    p.bytes_total,
                    u64::from(p.groups_read),
                    u64::from(p.groups_total),
                ),
                (None, None) => (0, a.bytes_total, 0, u64::from(a.groups_total)),
            };
            sum.bytes_read += read;
            sum.bytes_total += total;
            sum.groups_read += groups_read;
            sum.groups_total += groups_total;
        }
        sum
    }
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
        let http = reqwest::Client::builder()
            .timeout(crate::failpoints::control_request_timeout(
                CONTROL_REQUEST_TIMEOUT,
            ))
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
            last_committed,
            in_doubt: BTreeMap::new(),
            worker_ids_checked: false,
            retained,
            sink: None,
            restore: tokio::sync::watch::channel(None).0,
        })
    }

    /// Publishes the staged output of the object-store sink at `url` after every commit.
    pub fn with_sink(self, url: Option<&str>) -> Result<Self, CoordinatorError> {
        Ok(match url {
            Some(url) => {
                let (store, base) = snapshot::open_store(url)?;
                self.with_sink_store(store, base)
            }
            None => self,
        })
    }

    /// [`Coordinator::with_sink`] with the sink's store already open (`base` below it).
    pub fn with_sink_store(mut self, store: Arc<dyn ObjectStore>, base: Path) -> Self {
        self.sink = Some(Sink {
            store,
            base,
            ids_checked: false,
            caught_up: false,
            backlog: Mutex::new((BTreeSet::new(), None)),
            #[cfg(feature = "kafka")]
            kafka: None,
            #[cfg(feature = "kafka")]
            marker_checked: false,
        });
        self
    }

    /// Publishes the output the workers stage for an exactly-once Kafka sink (in the job's
    /// snapshot storage, [`crate::job::kafka::sink::staging_base`]) to Kafka after every commit,
    /// one transaction per snapshot. Before its first trigger the coordinator reads the sink's
    /// marker (which fences earlier publishers of the job) and continues snapshot ids above it.
    #[cfg(feature = "kafka")]
    pub fn with_kafka_sink(self, publisher: crate::job::kafka::sink::KafkaPublisher) -> Self {
        let base = crate::job::kafka::sink::staging_base(&self.job_dir);
        let store = self.store.clone();
        let mut me = self.with_sink_store(store, base);
        if let Some(sink) = me.sink.as_mut() {
            sink.kafka = Some(Arc::new(publisher));
        }
        me
    }

    /// Makes the sink output of snapshot `id`, which must be a committed snapshot of this job,
    /// visible: `id` joins the pending ids, which are published oldest first. Idempotent. On
    /// failure `id` stays pending (retried after the next commit) and the error is returned.
    pub async fn publish(&self, id: u64) -> Result<(), CoordinatorError> {
        if let Some(sink) = &self.sink {
            sink.backlog
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .0
                .insert(id);
            self.publish_pending().await?;
        }
        Ok(())
    }

    /// Publishes the pending ids, oldest first, stopping at the first failure (its error is
    /// returned and kept in [`Coordinator::publish_backlog`]).
    pub async fn publish_pending(&self) -> Result<(), CoordinatorError> {
        let Some(sink) = &self.sink else {
            return Ok(());
        };
        loop {
            let next = sink
                .backlog
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .0
                .first()
                .copied();
            let Some(id) = next else {
                return Ok(());
            };
            let result = sink.publish_one(id).await;
            let mut backlog = sink.backlog.lock().unwrap_or_else(PoisonError::into_inner);
            match result {
                Ok(summary) => {
                    backlog.0.remove(&id);
                    if backlog.0.is_empty() {
                        backlog.1 = None;
                    }
                    tracing::info!(id, %summary, "sink output published");
                }
                Err(e) => {
                    tracing::warn!(
                        id,
                        pending = ?backlog.0,
                        error = %e,
                        "publishing sink output failed; retried after the next commit"
                    );
                    backlog.1 = Some(e.to_string());
                    return Err(e.into());
                }
            }
        }
    }

    /// Why the exactly-once Kafka sink's publisher could not use its brokers at its last
    /// attempt, while that lasts ([`crate::job::kafka::sink::KafkaPublisher::broker_error`]).
    #[cfg(feature = "kafka")]
    pub fn kafka_sink_error(&self) -> Option<String> {
        self.sink
            .as_ref()
            .and_then(|s| s.kafka.as_ref())
            .and_then(|k| k.broker_error())
    }

    /// Committed snapshots whose sink output is not published yet, and the last failure.
    pub fn publish_backlog(&self) -> PublishBacklog {
        match &self.sink {
            Some(sink) => {
                let backlog = sink.backlog.lock().unwrap_or_else(PoisonError::into_inner);
                PublishBacklog {
                    pending: backlog.0.iter().copied().collect(),
                    last_error: backlog.1.clone(),
                }
            }
            None => PublishBacklog::default(),
        }
    }

    /// Publishes the output of every committed snapshot of this job that is not published yet
    /// (for a coordinator that takes over running workers, which may have committed a snapshot
    /// whose output a crashed predecessor never published). Idempotent; returns the backlog, or
    /// the first failure (what failed stays pending). A coordinator does this by itself at its
    /// first commit; call it to do it at once.
    pub async fn publish_committed(&self) -> Result<PublishBacklog, CoordinatorError> {
        self.publish_committed_through(u64::MAX).await?;
        Ok(self.publish_backlog())
    }

    /// Makes every committed snapshot of this job with an id up to `through` pending whose output
    /// is not published, then publishes the pending ids. Snapshots are looked at from the newest
    /// down until one is found published: earlier ones are published too (outputs are published
    /// in id order, every committed snapshot of a job with this sink has staged parts).
    async fn publish_committed_through(&self, through: u64) -> Result<(), CoordinatorError> {
        let Some(sink) = &self.sink else {
            return Ok(());
        };
        let mut unpublished = Vec::new();
        for (id, kind) in snapshot_ids(self.store.as_ref(), &self.job_dir).await? {
            if id > through || !is_committed(self.store.as_ref(), &self.job_dir, kind, id).await? {
                continue;
            }
            match crate::sink::published(sink.store.as_ref(), &sink.base, id).await? {
                Some(true) => break,
                Some(false) => unpublished.push(id),
                // Nothing staged (the sink was added later, or another sink URL then).
                None => {}
            }
        }
        let left: Vec<u64> = unpublished
            .iter()
            .rev()
            .copied()
            .filter(|id| *id != through)
            .collect();
        if !left.is_empty() {
            tracing::info!(ids = ?left, "committed sink output left unpublished: publishing it");
        }
        if !unpublished.is_empty() {
            sink.backlog
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .0
                .extend(unpublished);
        }
        self.publish_pending().await
    }

    /// After a start: publishes the output of the snapshot the run restored from, and of any
    /// earlier committed snapshot of the job, unless already published (the crash may have come
    /// between commit and publish). Only when the restored snapshot is this job's own (its
    /// manifest names this job's namespace and name): a snapshot of another job says nothing
    /// about this job's output, and a staged directory of ours with the same id may belong to a
    /// snapshot of ours that never committed. Failures are logged and left pending.
    async fn publish_restored(&self, url: &str) {
        if self.sink.is_none() {
            return;
        }
        let manifest = match snapshot::open_snapshot(url).await {
            Ok((_, _, m)) => m,
            Err(e) => {
                tracing::warn!(url, error = %e, "reading the restored manifest to publish its sink output");
                return;
            }
        };
        if manifest.job.namespace != self.identity.namespace
            || manifest.job.name != self.identity.name
        {
            tracing::info!(
                url,
                job = %format!("{}/{}", manifest.job.namespace, manifest.job.name),
                "restored from another job's snapshot: no sink output of it to publish"
            );
            return;
        }
        if let Err(e) = self.publish_committed_through(manifest.snapshot_id).await {
            tracing::warn!(url, error = %e, "publishing the restored snapshot's sink output; retried after the next commit");
        }
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

    /// The body of a worker's answer, read up to a bound: a worker never makes the coordinator
    /// buffer more than [`MAX_WORKER_ANSWER_BYTES`] (checked on `Content-Length` before reading,
    /// then as the body streams).
    async fn body(
        &self,
        subtask: usize,
        path: &str,
        mut resp: reqwest::Response,
    ) -> Result<Vec<u8>, CoordinatorError> {
        let too_large = |n: u64| {
            self.fail(
                subtask,
                format!(
                    "{path}: the answer is larger than {MAX_WORKER_ANSWER_BYTES} bytes ({n} or more); refused"
                ),
            )
        };
        if let Some(n) = resp.content_length()
            && n > MAX_WORKER_ANSWER_BYTES
        {
            return Err(too_large(n));
        }
        let mut out = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| self.fail(subtask, e))? {
            let n = (out.len() + chunk.len()) as u64;
            if n > MAX_WORKER_ANSWER_BYTES {
                return Err(too_large(n));
            }
            out.extend_from_slice(&chunk);
        }
        Ok(out)
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
            let text = match self.body(subtask, path, resp).await {
                Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
                Err(e) => e.to_string(),
            };
            return Err(self.fail(subtask, format!("{path}: HTTP {status}: {text}")));
        }
        if status == reqwest::StatusCode::NO_CONTENT {
            return Ok(None);
        }
        let bytes = self.body(subtask, path, resp).await?;
        if bytes.is_empty() {
            return Ok(None);
        }
        // An accepted request's body is informative (what a start reads in all): one that
        // cannot be read is no failure.
        if status == reqwest::StatusCode::ACCEPTED {
            return Ok(serde_json::from_slice(&bytes).ok());
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
        let bytes = self.body(subtask, path, resp).await?;
        serde_json::from_slice(&bytes).map_err(|e| self.fail(subtask, format!("{path}: {e}")))
    }

    /// Starts every worker with its subtask index and waits until all are connected.
    /// `template.subtask` is overwritten per worker; `template.peers` is filled in. Every worker
    /// lists a file source's directory itself when it checks its request: a start whose workers
    /// listed different partitions is refused ([`CoordinatorError::PartitionsDiffer`]; the
    /// platform starts again as after any failed start), so that none reads another list. Then, with a
    /// sink, publishes the output of what the run restored from (`template.restore_from`) and of
    /// the job's committed snapshots before it, unless already published (the crash may have
    /// come between commit and publish) -- only when the restored snapshot is this job's own
    /// (its manifest names this job): another job's snapshot says nothing about this job's
    /// output, and a staged directory of ours with the same id may belong to a snapshot of ours
    /// that never committed. A publish failure does not fail the start: it is pending
    /// ([`Coordinator::publish_backlog`]).
    pub async fn start(
        &self,
        template: &StartRequest,
        ready_timeout: Duration,
    ) -> Result<Vec<StartResponse>, CoordinatorError> {
        let began = Instant::now();
        let peers: Vec<String> = self.workers.iter().map(|w| w.data.clone()).collect();
        // Each worker checks its request and answers at once (with what it reads in all); the
        // restores run on.
        let accepted = try_join_all((0..self.workers.len()).map(|i| {
            let mut req = template.clone();
            req.subtask = i as u32;
            req.peers = peers.clone();
            async move {
                self.post::<_, StartAccepted>(i, "/v1/start", &req)
                    .await
                    .map(Option::unwrap_or_default)
            }
        }))
        .await?;
        check_partition_lists(&accepted)?;
        let responses = self.wait_restored(&accepted, began, ready_timeout).await?;
        self.wait_ready(ready_timeout.saturating_sub(began.elapsed()))
            .await?;
        if let Some(url) = &template.restore_from {
            self.publish_restored(url).await;
        }
        Ok(responses)
    }

    /// Polls every worker's `/v1/status` until each has restored its state (what it reports
    /// then, in subtask order), one reports that its start failed, or `timeout` (counted from
    /// `began`) passes. Each round's progress (over `accepted`, what each worker said it reads)
    /// goes to [`Coordinator::restore_progress`].
    async fn wait_restored(
        &self,
        accepted: &[StartAccepted],
        began: Instant,
        timeout: Duration,
    ) -> Result<Vec<StartResponse>, CoordinatorError> {
        /// Status requests in a row that may fail before the worker counts as gone.
        const STATUS_FAILURES: u32 = 3;
        let n = self.workers.len();
        let mut done: Vec<Option<StartResponse>> = vec![None; n];
        let mut failures = vec![0u32; n];
        let mut progress: Vec<Option<RestoreProgress>> = vec![None; n];
        let mut logged = Instant::now();
        let mut round = 0u32;
        loop {
            round = round.saturating_add(1);
            for i in 0..n {
                if done[i].is_some() {
                    continue;
                }
                let st = match self.get::<WorkerStatus>(i, "/v1/status").await {
                    Ok(st) => {
                        failures[i] = 0;
                        st
                    }
                    Err(e) => {
                        failures[i] += 1;
                        if failures[i] >= STATUS_FAILURES {
                            return Err(e);
                        }
                        continue;
                    }
                };
                match st.state {
                    WorkerState::Restoring => progress[i] = st.restore,
                    // Pre-staged and not started yet: a moment later.
                    WorkerState::Prestaged => {}
                    // Running before `started` is filled in: a moment later.
                    WorkerState::Running | WorkerState::Stopped => done[i] = st.started,
                    WorkerState::Idle => {
                        let reason = st.last_start_error.unwrap_or_else(|| {
                            "the worker is idle again (it restarted and lost the start)".into()
                        });
                        return Err(self.fail(i, format!("/v1/start: restore failed: {reason}")));
                    }
                }
            }
            let sum = StartProgress::sum(accepted, &progress, &done);
            self.restore.send_replace(Some(sum));
            let waiting: Vec<usize> = (0..n).filter(|i| done[*i].is_none()).collect();
            if waiting.is_empty() {
                return Ok(done.into_iter().map(Option::unwrap_or_default).collect());
            }
            let (read, total) = (sum.bytes_read, sum.bytes_total);
            if began.elapsed() > timeout {
                return Err(CoordinatorError::NotReady(
                    timeout.as_secs(),
                    format!("subtasks {waiting:?} still restoring ({read} of {total} bytes read)"),
                ));
            }
            if logged.elapsed() >= Duration::from_secs(5) {
                logged = Instant::now();
                tracing::info!(
                    subtasks = ?waiting,
                    bytes_read = read,
                    bytes_total = total,
                    subtasks_done = sum.subtasks_done,
                    "restoring"
                );
            }
            // Every 200 ms (sooner in the first rounds: a pre-staged start or a small restore is
            // done in a few milliseconds, and every poll interval is part of a rescale's pause),
            // and no more than 200 status requests a second in all (a 200-worker run on a
            // small node polls once a second).
            // (Counted over the subtasks still polled: a few slow ones are not polled as
            // seldom as all.)
            let pause = Duration::from_millis((5u64 << round.min(6)).min(200))
                .max(Duration::from_millis(5) * waiting.len() as u32);
            tokio::time::sleep(pause).await;
        }
    }

    /// Pre-stages every worker (`POST /v1/prestage`, see [`crate::runtime::prestage`]): each
    /// loads its key groups from `template.restore_from`, one of the job's checkpoints, and
    /// holds them without reading any source or connecting to any peer. Waits until all are
    /// `prestaged` (what each loaded, in subtask order), one failed, or `timeout` passed. A
    /// later [`Coordinator::start`] of the same workers with a later checkpoint of the job then
    /// reads only what changed since.
    pub async fn prestage(
        &self,
        template: &StartRequest,
        timeout: Duration,
    ) -> Result<Vec<StartResponse>, CoordinatorError> {
        let began = Instant::now();
        let peers: Vec<String> = self.workers.iter().map(|w| w.data.clone()).collect();
        try_join_all((0..self.workers.len()).map(|i| {
            let mut req = template.clone();
            req.subtask = i as u32;
            req.peers = peers.clone();
            async move {
                self.post::<_, StartAccepted>(i, "/v1/prestage", &req)
                    .await
                    .map(Option::unwrap_or_default)
            }
        }))
        .await?;
        let n = self.workers.len();
        let mut done: Vec<Option<StartResponse>> = vec![None; n];
        let mut round = 0u32;
        loop {
            round = round.saturating_add(1);
            for (i, slot) in done.iter_mut().enumerate() {
                if slot.is_some() {
                    continue;
                }
                let st = self.get::<WorkerStatus>(i, "/v1/status").await?;
                match st.state {
                    WorkerState::Prestaged => *slot = Some(st.prestaged.unwrap_or_default()),
                    WorkerState::Restoring => {}
                    WorkerState::Idle => {
                        let reason = st
                            .last_start_error
                            .unwrap_or_else(|| "the worker is idle (it restarted?)".into());
                        return Err(self.fail(i, format!("/v1/prestage: {reason}")));
                    }
                    other => {
                        return Err(self.fail(i, format!("/v1/prestage: the worker is {other:?}")));
                    }
                }
            }
            if done.iter().all(Option::is_some) {
                return Ok(done.into_iter().flatten().collect());
            }
            if began.elapsed() > timeout {
                let waiting: Vec<usize> = (0..n).filter(|i| done[*i].is_none()).collect();
                return Err(CoordinatorError::NotReady(
                    timeout.as_secs(),
                    format!("subtasks {waiting:?} still pre-staging"),
                ));
            }
            // As a start's: sooner in the first rounds (a catch-up round's delta is read in a few
            // milliseconds, and the stop's delta covers every millisecond of the last round),
            // every 200 ms later, and no more than 200 status requests a second in all (over
            // the subtasks still polled).
            let waiting = done.iter().filter(|d| d.is_none()).count();
            let pause = Duration::from_millis((5u64 << round.min(6)).min(200))
                .max(Duration::from_millis(5) * waiting as u32);
            tokio::time::sleep(pause).await;
        }
    }

    /// Waits until every worker answers `/v1/readyz`.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<(), CoordinatorError> {
        let start = Instant::now();
        let mut round = 0u32;
        loop {
            round = round.saturating_add(1);
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
            // Every 100 ms, sooner at first (the peers usually connect in milliseconds).
            tokio::time::sleep(Duration::from_millis((2u64 << round.min(6)).min(100))).await;
        }
    }

    /// Takes a checkpoint or savepoint (optionally stopping the sources at the barrier) and
    /// commits it. On failure nothing is committed, the last good snapshot is untouched, the
    /// snapshot is aborted on every worker ([`Coordinator::abort`]; not when its commit is in
    /// doubt) so that none keeps aligning it, and sources stopped by this call are resumed.
    pub async fn snapshot(
        &mut self,
        kind: SnapshotKind,
        stop: bool,
        timeout: Duration,
    ) -> Result<Completed, CoordinatorError> {
        let started = Instant::now();
        let result = match self.prepare().await {
            Ok(()) => {
                let id = self.next_id;
                self.next_id += 1;
                match self.take(id, kind, stop, timeout).await {
                    Ok(m) => Ok((id, m)),
                    // A commit in doubt may have committed: the workers' acknowledgements stand.
                    Err(e @ CoordinatorError::CommitInDoubt { .. }) => Err(e),
                    Err(e) => {
                        self.abort(id, &e).await;
                        Err(e)
                    }
                }
            }
            Err(e) => Err(e),
        };
        match result {
            Ok((id, manifest)) => {
                let duration = started.elapsed();
                self.committed(id).await;
                let backlog = self.publish_backlog();
                if kind == SnapshotKind::Checkpoint && backlog.is_behind() {
                    tracing::warn!(
                        pending = ?backlog.pending,
                        "checkpoint retention skipped while sink output of committed snapshots is not published"
                    );
                } else if kind == SnapshotKind::Checkpoint
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
                if let CoordinatorError::CommitInDoubt { id, .. } = &e {
                    self.in_doubt.insert(*id, kind);
                }
                if stop {
                    // Leave the job running at its old parallelism.
                    self.resume().await;
                }
                Err(e)
            }
        }
    }

    /// Before a trigger: snapshot ids above the sink's and above the workers' (once each), and
    /// every commit in doubt
    /// resolved, so that the trigger names the newest committed snapshot exactly (a worker drops
    /// the output staged up to it, and carries the output staged after it).
    async fn prepare(&mut self) -> Result<(), CoordinatorError> {
        if let Some(sink) = &mut self.sink
            && !sink.ids_checked
        {
            let max = crate::sink::max_snapshot_id(sink.store.as_ref(), &sink.base).await?;
            if max >= self.next_id {
                tracing::warn!(
                    sink_max = max,
                    next = self.next_id,
                    "the sink holds output of snapshot ids this job's storage does not know (storage removed?): ids continue above them"
                );
                self.next_id = max + 1;
            }
            sink.ids_checked = true;
        }
        #[cfg(feature = "kafka")]
        if let Some(sink) = &mut self.sink
            && let Some(k) = &sink.kafka
            && !sink.marker_checked
        {
            // Fails the trigger while the brokers cannot be reached: a snapshot id at or below
            // the marker would never be published.
            let marker = k
                .marker()
                .await
                .map_err(|e| crate::sink::SinkError::Kafka(e.to_string()))?;
            if let Some(m) = marker
                && m.snapshot >= self.next_id
            {
                tracing::warn!(
                    marker = m.snapshot,
                    next = self.next_id,
                    "the Kafka sink's marker names snapshot ids this job's storage does not know (storage replaced?): ids continue above them"
                );
                self.next_id = m.snapshot + 1;
            }
            sink.marker_checked = true;
        }
        if !self.worker_ids_checked {
            // Workers taken over from an earlier coordinator may know ids that left nothing in
            // storage (aborted before anything was written); a worker ignores a snapshot id at
            // or below the newest it finished or abandoned.
            match self.status().await {
                Ok(statuses) => {
                    if let Some(max) = statuses.iter().filter_map(|s| s.newest_snapshot).max()
                        && max >= self.next_id
                    {
                        tracing::info!(
                            workers_newest = max,
                            next = self.next_id,
                            "the workers know snapshot ids this job's storage does not: ids continue above them"
                        );
                        self.next_id = max + 1;
                    }
                    self.worker_ids_checked = true;
                }
                // The trigger tells what is wrong with the worker; checked again next time.
                Err(e) => tracing::debug!(error = %e, "reading the workers' newest snapshot ids"),
            }
        }
        while let Some((&id, &kind)) = self.in_doubt.first_key_value() {
            if is_committed(self.store.as_ref(), &self.job_dir, kind, id).await? {
                tracing::warn!(
                    id,
                    "a manifest commit that reported a failure was written: snapshot committed"
                );
                self.committed(id).await;
            }
            self.in_doubt.remove(&id);
        }
        Ok(())
    }

    /// Snapshot `id` committed: the next trigger names it, and its sink output is published
    /// (with any still pending before it; a failure leaves them pending). At a coordinator's
    /// first commit that includes the committed output an earlier coordinator of the job left
    /// unpublished (it crashed between commit and publish, and this one took over its workers
    /// without a restore): [`Coordinator::publish_committed`] up to `id`, which is cheap when
    /// nothing was left (it stops at the newest published snapshot).
    async fn committed(&mut self, id: u64) {
        self.last_committed = self.last_committed.max(id);
        let Some(sink) = &self.sink else {
            return;
        };
        sink.backlog
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .0
            .insert(id);
        let caught_up = sink.caught_up;
        // Failures are logged and kept in the backlog.
        if caught_up {
            let _ = self.publish_pending().await;
            return;
        }
        let result = self.publish_committed_through(id).await;
        if let Some(sink) = &mut self.sink {
            match result {
                Ok(()) => sink.caught_up = true,
                Err(e) => {
                    sink.backlog
                        .get_mut()
                        .unwrap_or_else(PoisonError::into_inner)
                        .1 = Some(e.to_string());
                }
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
        let req = &CheckpointRequest {
            id,
            kind,
            stop,
            last_committed: Some(self.last_committed),
        };
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
        let mut names = BTreeMap::new();
        for a in &acks {
            positions.extend(a.source_positions.iter().map(|(k, v)| (*k, *v)));
            names.extend(a.source_partitions.iter().map(|(k, v)| (*k, v.clone())));
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
            source_partitions: names,
            watermark,
        };
        let manifest = Manifest::assemble(
            meta,
            self.assignment,
            acks.into_iter().map(|a| a.snapshot).collect(),
        )?;
        let dir = snapshot::snapshot_dir(&self.job_dir, kind, id);
        if let Err(e) = snapshot::commit_manifest(self.store.as_ref(), &dir, &manifest).await {
            // A failed write may still have happened: what the next trigger tells the workers
            // depends on it.
            let path = snapshot::manifest_path(&dir);
            match self.store.head(&path).await {
                Ok(_) => {
                    tracing::warn!(id, error = %e, "committing the manifest reported a failure, but the manifest is there: committed");
                }
                Err(object_store::Error::NotFound { .. }) => return Err(e.into()),
                Err(check) => {
                    return Err(CoordinatorError::CommitInDoubt {
                        id,
                        error: e.to_string(),
                        check: check.to_string(),
                    });
                }
            }
        }
        Ok(manifest)
    }

    /// Abandons snapshot `id` on every worker (`POST /v1/checkpoints/{id}/abort`), because of
    /// `why`: each reports it failed (aborted), drops what its source recorded for it, does not
    /// inject its barrier if it has not yet, and its keyed operator stops aligning it, so that
    /// the inputs blocked for it flow again (a trigger that reached only some workers would
    /// otherwise leave every operator aligning it). Best effort: a worker that cannot be
    /// reached is logged; its operator drops the snapshot anyway when the next one's barrier
    /// arrives. Returns how many workers acknowledged the abort.
    pub async fn abort(&self, id: u64, why: &dyn std::fmt::Display) -> usize {
        let path = format!("/v1/checkpoints/{id}/abort");
        let results = futures::future::join_all(
            (0..self.workers.len()).map(|i| self.post::<_, CheckpointStatus>(i, &path, &())),
        )
        .await;
        let mut acknowledged = 0;
        for (i, r) in results.into_iter().enumerate() {
            match r {
                Ok(_) => acknowledged += 1,
                Err(e) => {
                    tracing::warn!(id, subtask = i, error = %e, "aborting the snapshot on a worker failed")
                }
            }
        }
        tracing::warn!(
            id,
            reason = %why,
            workers = self.workers.len(),
            acknowledged,
            "snapshot aborted on the workers"
        );
        acknowledged
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
    Ok(snapshot_ids(store, job_dir)
        .await?
        .first()
        .map_or(1, |(id, _)| id + 1))
}

/// Every snapshot directory of the job (checkpoints and savepoints, committed or not), newest
/// (largest id) first.
async fn snapshot_ids(
    store: &dyn ObjectStore,
    job_dir: &Path,
) -> Result<Vec<(u64, SnapshotKind)>, CoordinatorError> {
    let mut ids = Vec::new();
    for kind in [SnapshotKind::Checkpoint, SnapshotKind::Savepoint] {
        let prefix = job_dir.clone().join(kind.folder());
        let listing = store
            .list_with_delimiter(Some(&prefix))
            .await
            .map_err(|e| snapshot::SnapshotError::store("list", &prefix, e))?;
        ids.extend(listing.common_prefixes.iter().filter_map(|dir| {
            dir.filename()
                .and_then(|n| snapshot::parse_snapshot_dir_name(kind, n))
                .map(|id| (id, kind))
        }));
    }
    ids.sort_unstable_by(|a, b| b.cmp(a));
    Ok(ids)
}

/// Whether snapshot `id` of the job is committed (its manifest exists).
async fn is_committed(
    store: &dyn ObjectStore,
    job_dir: &Path,
    kind: SnapshotKind,
    id: u64,
) -> Result<bool, CoordinatorError> {
    let path = snapshot::manifest_path(&snapshot::snapshot_dir(job_dir, kind, id));
    match store.head(&path).await {
        Ok(_) => Ok(true),
        Err(object_store::Error::NotFound { .. }) => Ok(false),
        Err(e) => Err(snapshot::SnapshotError::store("head", &path, e).into()),
    }
}

/// The key-group count and the job identity of the snapshot named by a spec.restoreFrom `url`
/// (from its manifest) of a job in `namespace` with snapshots in `storage`, or why it cannot be
/// restored from.
pub async fn restore_source(
    url: &str,
    storage: &str,
    namespace: &str,
) -> Result<(u32, JobIdentity), String> {
    match snapshot::open_snapshot(url).await {
        Ok((_, _, m)) => Ok((m.max_parallelism, m.job)),
        // The storage's words about a path outside this namespace's own storage could tell a
        // tenant about another's: they go to the operator's log only.
        Err(e) if !url.starts_with(&format!("{}/{namespace}/", storage.trim_end_matches('/'))) => {
            tracing::warn!(%url, error = %e, "spec.restoreFrom cannot be read");
            Err(format!(
                "spec.restoreFrom {url} cannot be restored: it is not a committed snapshot this job can read (the storage's error is in the operator's log, as the URL is outside this namespace's storage); point it at a committed savepoint or checkpoint directory (one holding _manifest.json), or remove it"
            ))
        }
        Err(e) => Err(format!(
            "spec.restoreFrom {url} cannot be restored: {e}; point it at a committed savepoint or checkpoint directory (one holding _manifest.json), or remove it"
        )),
    }
}

/// The newest snapshot of a job that a resume can restore, and the newer ones it passed over.
#[derive(Debug, Clone, Default)]
pub struct Newest {
    /// Its URL and summary (with the job identity its manifest records).
    pub found: Option<(String, snapshot::SnapshotInfo)>,
    /// Snapshots of the same history newer than it whose manifest cannot be used (never
    /// deleted; the caller reports them).
    pub skipped: Vec<snapshot::UnreadableSnapshot>,
}

/// The newest committed snapshot (checkpoint or savepoint, by id) of a job whose manifest can be
/// used, taken under `max_parallelism` key groups (any, with `None`: after a restore from a
/// rewritten savepoint the job's older snapshots have the old key-group count and can no longer
/// be restored by it) and above `replaced_up_to` (see `status.replacedHistoryUpTo`). A snapshot
/// whose manifest is corrupt, inconsistent or too large is passed over (and named in
/// [`Newest::skipped`]), never an error: what every resume, adoption and `keyshift local` start
/// asks, in one place ([`snapshot::SnapshotScan::newest`]).
pub async fn newest_snapshot(
    storage: &str,
    namespace: &str,
    job: &str,
    max_parallelism: Option<u32>,
    replaced_up_to: Option<u64>,
) -> Result<Newest, CoordinatorError> {
    let (store, base) = snapshot::open_store(storage)?;
    let job_dir = snapshot::job_dir(&base, namespace, job);
    let scan = snapshot::scan_snapshots(store.as_ref(), &job_dir).await?;
    let (newest, skipped) = scan.newest(max_parallelism, replaced_up_to);
    Ok(Newest {
        found: newest.map(|s| {
            (
                snapshot_url(storage, namespace, job, s.kind, s.id),
                s.clone(),
            )
        }),
        skipped: skipped.into_iter().cloned().collect(),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::job::sink::{Committed, StagingSink, WriterId};
    use crate::sink::testing::Flaky;

    #[test]
    fn a_start_whose_workers_listed_different_partitions_is_refused_naming_both_lists() {
        let names = |n: usize| -> Vec<String> { (0..n).map(|i| format!("part-{i}")).collect() };
        let accepted = |lists: Vec<Option<Vec<String>>>| -> Vec<StartAccepted> {
            lists
                .into_iter()
                .map(|l| StartAccepted {
                    source_partitions: l.map(|l| PartitionList::of(&l)),
                    ..StartAccepted::default()
                })
                .collect()
        };
        // Generator runs (no lists) and file runs that agree start.
        assert!(check_partition_lists(&accepted(vec![None, None])).is_ok());
        assert!(check_partition_lists(&[]).is_ok());
        assert!(check_partition_lists(&accepted(vec![Some(names(3)); 3])).is_ok());
        // One more file, the same count with another name, or no list at all: refused.
        let e = check_partition_lists(&accepted(vec![
            Some(names(3)),
            Some(names(3)),
            Some(names(4)),
        ]))
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("the workers listed different source partitions: subtask 0 3 files")
                && e.contains("subtask 2 4 files"),
            "{e}"
        );
        let mut renamed = names(3);
        renamed[1] = "part-1b".into();
        let e = check_partition_lists(&accepted(vec![Some(names(3)), Some(renamed)]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("subtask 1 3 files"), "{e}");
        let e = check_partition_lists(&accepted(vec![Some(names(2)), None]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("subtask 1 no partition list"), "{e}");
    }

    #[test]
    fn start_progress_sums_what_each_worker_accepted_reported_and_restored() {
        let accepted =
            [(100, 4), (60, 3), (40, 2)].map(|(bytes_total, groups_total)| StartAccepted {
                bytes_total,
                groups_total,
                source_partitions: None,
            });
        let none = StartProgress::sum(&accepted, &[None; 3], &[None, None, None]);
        assert_eq!(
            none,
            StartProgress {
                bytes_read: 0,
                bytes_total: 200,
                groups_read: 0,
                groups_total: 9,
                subtasks_done: 0,
                subtasks: 3,
            }
        );
        let reported = [
            Some(RestoreProgress {
                bytes_read: 50,
                bytes_total: 100,
                groups_read: 2,
                groups_total: 4,
            }),
            None,
            None,
        ];
        let done = [
            None,
            Some(StartResponse {
                groups_restored: 3,
                keys_restored: 10,
                bytes_read: 60,
                restore_ms: 1,
            }),
            None,
        ];
        assert_eq!(
            StartProgress::sum(&accepted, &reported, &done),
            StartProgress {
                bytes_read: 110,
                bytes_total: 200,
                groups_read: 5,
                groups_total: 9,
                subtasks_done: 1,
                subtasks: 3,
            }
        );
    }

    pub(crate) fn identity(name: &str) -> JobIdentity {
        JobIdentity {
            namespace: "team".into(),
            name: name.into(),
            job_fingerprint: "f".into(),
            layout: None,
        }
    }

    fn assignment() -> Assignment {
        Assignment::new(1, 8).unwrap()
    }

    /// Writes and commits snapshot `id` of `job` (one subtask, 8 key groups) in `storage`;
    /// returns its URL.
    pub(crate) async fn commit(
        storage: &str,
        job: &JobIdentity,
        kind: SnapshotKind,
        id: u64,
    ) -> String {
        let (store, base) = snapshot::open_store(storage).unwrap();
        let dir = snapshot::snapshot_dir(
            &snapshot::job_dir(&base, &job.namespace, &job.name),
            kind,
            id,
        );
        let blocks = (0..8).map(|g| (g, bytes::Bytes::from_static(b"x"), 1));
        let ack = snapshot::write_subtask_state(store.clone(), &dir, assignment(), 0, blocks)
            .await
            .unwrap();
        let meta = SnapshotMeta {
            job: job.clone(),
            snapshot_id: id,
            kind,
            completed_at: Utc::now(),
            state_schema: crate::job::AGG_SCHEMA.into(),
            source_positions: Default::default(),
            source_partitions: Default::default(),
            watermark: None,
        };
        let manifest = Manifest::assemble(meta, assignment(), vec![ack]).unwrap();
        snapshot::commit_manifest(store.as_ref(), &dir, &manifest)
            .await
            .unwrap();
        snapshot_url(storage, &job.namespace, &job.name, kind, id)
    }

    /// Stages one row (value `id`) for snapshot `id`, as subtask 0 of 1 would.
    async fn stage(sink: &Flaky, id: u64) {
        let mut staging = StagingSink::new(WriterId {
            subtask: 0,
            parallelism: 1,
        });
        staging.emit(&[crate::job::ResultRow {
            key: crate::job::RecordKey::int(1),
            window: None,
            value: id as i64,
        }]);
        let out = staging.on_barrier(id, Committed::Through(0)).unwrap();
        crate::sink::stage(sink, &Path::from("out"), &out)
            .await
            .unwrap();
    }

    /// The published part of snapshot `id`, if any.
    async fn published(sink: &Flaky, id: u64) -> Option<String> {
        let path = Path::from(format!("out/snap-{id}/part-0-of-1.jsonl"));
        let bytes = sink.get(&path).await.ok()?.bytes().await.ok()?;
        Some(String::from_utf8_lossy(&bytes).into_owned())
    }

    async fn coordinator(storage: &str, job: &str, sink: &Arc<Flaky>) -> Coordinator {
        Coordinator::new(
            storage,
            identity(job),
            assignment(),
            Vec::new(),
            "token".into(),
            2,
        )
        .await
        .unwrap()
        .with_sink_store(sink.clone(), Path::from("out"))
    }

    fn row(id: u64) -> String {
        format!("{{\"key\":1,\"value\":{id}}}\n")
    }

    #[tokio::test]
    async fn a_failed_publish_is_retried_after_each_later_commit_in_id_order() {
        let sink = Arc::new(Flaky::default());
        let mut c = coordinator("memory://coord-retry", "retry", &sink).await;
        for id in 1..=3 {
            stage(&sink, id).await;
        }
        sink.fail_puts("out/snap-1/", 2);
        c.committed(1).await;
        let backlog = c.publish_backlog();
        assert_eq!(backlog.pending, [1]);
        assert!(
            backlog
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains("injected")),
            "{backlog:?}"
        );
        // Still failing: 2 waits behind 1, so no reader sees 2 before 1.
        c.committed(2).await;
        assert_eq!(c.publish_backlog().pending, [1, 2]);
        assert_eq!(published(&sink, 2).await, None);
        assert_eq!(sink.failures_left(), 0);
        // The store is back: the next commit publishes all three, once each.
        c.committed(3).await;
        assert_eq!(c.publish_backlog(), PublishBacklog::default());
        for id in 1..=3 {
            assert_eq!(published(&sink, id).await, Some(row(id)), "snapshot {id}");
        }
        assert_eq!(c.last_committed, 3);
        // An explicit retry with nothing pending does nothing.
        c.publish_pending().await.unwrap();
        assert!(!c.publish_backlog().is_behind());
    }

    #[tokio::test]
    async fn ids_continue_above_storage_and_sink_and_the_newest_commit_is_known() {
        let storage = "memory://coord-ids";
        let job = identity("ids");
        commit(storage, &job, SnapshotKind::Checkpoint, 1).await;
        commit(storage, &job, SnapshotKind::Savepoint, 2).await;
        // An aborted checkpoint 3: a directory without a manifest.
        let (store, base) = snapshot::open_store(storage).unwrap();
        let orphan = snapshot::snapshot_dir(
            &snapshot::job_dir(&base, "team", "ids"),
            SnapshotKind::Checkpoint,
            3,
        );
        store
            .put(&orphan.join("state-0-of-1.bin"), b"x".to_vec().into())
            .await
            .unwrap();
        let sink = Arc::new(Flaky::default());
        let mut c = coordinator(storage, "ids", &sink).await;
        assert_eq!((c.next_id, c.last_committed), (4, 2));
        // The sink has output of ids this storage does not know (its storage was wiped).
        stage(&sink, 9).await;
        c.prepare().await.unwrap();
        assert_eq!(c.next_id, 10);
    }

    #[tokio::test]
    async fn a_commit_in_doubt_is_resolved_before_the_next_trigger() {
        let storage = "memory://coord-doubt";
        let job = identity("doubt");
        let sink = Arc::new(Flaky::default());
        let mut c = coordinator(storage, "doubt", &sink).await;
        // 1 was written after all, 2 was not.
        commit(storage, &job, SnapshotKind::Checkpoint, 1).await;
        stage(&sink, 1).await;
        stage(&sink, 2).await;
        c.in_doubt.insert(1, SnapshotKind::Checkpoint);
        c.in_doubt.insert(2, SnapshotKind::Checkpoint);
        c.prepare().await.unwrap();
        assert!(c.in_doubt.is_empty());
        assert_eq!(c.last_committed, 1);
        assert_eq!(published(&sink, 1).await, Some(row(1)));
        assert_eq!(published(&sink, 2).await, None);
    }

    fn start_request(restore_from: Option<String>) -> StartRequest {
        StartRequest {
            namespace: "team".into(),
            name: "mine".into(),
            job: serde_yaml::from_str(
                "{source: {generator: {partitions: 1, keys: 1, seed: 1}}, key: {field: key}, aggregation: {function: count}}",
            )
            .unwrap(),
            subtask: 0,
            parallelism: 1,
            max_parallelism: 8,
            peers: Vec::new(),
            storage: String::new(),
            restore_from,
            allow_non_restored_state: false,
            state_payload_bytes: 0,
            run_id: "r".into(),
            data_secret: RunSecret("s".into()),
            incremental: Default::default(),
        }
    }

    #[tokio::test]
    async fn a_start_publishes_what_it_restores_only_for_the_job_s_own_snapshot() {
        let storage = "memory://coord-restore";
        let mine = identity("mine");
        let sink = Arc::new(Flaky::default());
        // Ours: checkpoint 2 and savepoint 3 committed, never published (crash after commit);
        // checkpoint 4 staged but never committed.
        commit(storage, &mine, SnapshotKind::Checkpoint, 2).await;
        let own = commit(storage, &mine, SnapshotKind::Savepoint, 3).await;
        for id in [2, 3, 4] {
            stage(&sink, id).await;
        }
        // Another job's savepoint with id 4.
        let theirs = commit(storage, &identity("theirs"), SnapshotKind::Savepoint, 4).await;

        let c = coordinator(storage, "mine", &sink).await;
        c.start(&start_request(Some(theirs)), Duration::from_secs(1))
            .await
            .unwrap();
        for id in [2, 3, 4] {
            assert_eq!(published(&sink, id).await, None, "snapshot {id}");
        }
        c.start(&start_request(None), Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(published(&sink, 3).await, None);

        // Restoring our own savepoint publishes it and the committed checkpoint before it, not
        // the uncommitted 4; a failure is pending, not a failed start.
        sink.fail_puts("out/snap-2/", 1);
        c.start(&start_request(Some(own.clone())), Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(c.publish_backlog().pending, [2, 3]);
        c.start(&start_request(Some(own)), Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(c.publish_backlog(), PublishBacklog::default());
        assert_eq!(published(&sink, 2).await, Some(row(2)));
        assert_eq!(published(&sink, 3).await, Some(row(3)));
        assert_eq!(published(&sink, 4).await, None);
    }

    #[tokio::test]
    async fn a_coordinator_catches_up_on_what_a_crashed_predecessor_left_unpublished() {
        let storage = "memory://coord-adopt";
        let job = identity("adopt");
        let sink = Arc::new(Flaky::default());
        for id in 1..=3 {
            commit(storage, &job, SnapshotKind::Checkpoint, id).await;
            stage(&sink, id).await;
        }
        stage(&sink, 4).await; // staged, not committed
        let before = coordinator(storage, "adopt", &sink).await;
        before.publish(1).await.unwrap();
        // The predecessor crashed after committing 2 and 3. Its successor adopts the workers
        // and publishes at once.
        let c = coordinator(storage, "adopt", &sink).await;
        sink.fail_puts("out/snap-3/", 1);
        let e = c.publish_committed().await.unwrap_err();
        assert!(e.to_string().contains("injected"), "{e}");
        assert_eq!(c.publish_backlog().pending, [3]);
        assert_eq!(published(&sink, 2).await, Some(row(2)));
        assert_eq!(
            c.publish_committed().await.unwrap(),
            PublishBacklog::default()
        );
        assert_eq!(published(&sink, 3).await, Some(row(3)));
        assert_eq!(published(&sink, 4).await, None);
        assert_eq!(
            c.publish_committed().await.unwrap(),
            PublishBacklog::default()
        );
    }

    #[tokio::test]
    async fn the_first_commit_of_a_coordinator_publishes_what_an_earlier_one_left() {
        let storage = "memory://coord-first-commit";
        let job = identity("first");
        let sink = Arc::new(Flaky::default());
        for id in 1..=3 {
            commit(storage, &job, SnapshotKind::Checkpoint, id).await;
            stage(&sink, id).await;
        }
        coordinator(storage, "first", &sink)
            .await
            .publish(1)
            .await
            .unwrap();
        // Took over running workers without being told: its first commit (4) publishes 2 and
        // 3 with it, in id order.
        let mut c = coordinator(storage, "first", &sink).await;
        commit(storage, &job, SnapshotKind::Checkpoint, 4).await;
        stage(&sink, 4).await;
        sink.fail_puts("out/snap-2/", 1);
        c.committed(4).await;
        assert_eq!(c.publish_backlog().pending, [2, 3, 4]);
        assert_eq!(published(&sink, 3).await, None, "3 waits behind 2");
        commit(storage, &job, SnapshotKind::Checkpoint, 5).await;
        stage(&sink, 5).await;
        c.committed(5).await;
        assert_eq!(c.publish_backlog(), PublishBacklog::default());
        for id in 1..=5 {
            assert_eq!(published(&sink, id).await, Some(row(id)), "snapshot {id}");
        }
    }

    #[tokio::test]
    async fn a_restore_from_outside_the_namespace_never_shows_the_storage_error() {
        let storage = "memory://restore-src/state";
        let own = format!("{storage}/team-a/j/savepoints/sp-9");
        let err = restore_source(&own, storage, "team-a").await.unwrap_err();
        assert!(
            err.contains("not found"),
            "own path: the storage's words help: {err}"
        );
        let foreign = format!("{storage}/team-b/j/savepoints/sp-9");
        let err = restore_source(&foreign, storage, "team-a")
            .await
            .unwrap_err();
        assert!(
            !err.contains("not found") && !err.contains("_manifest.json not"),
            "{err}"
        );
        assert!(
            err.contains("operator's log") && err.contains(&foreign),
            "{err}"
        );
    }

    /// Serves one HTTP answer: `head` (status line and headers), then `body` in 1 MiB writes.
    async fn answer_once(head: String, body: Vec<u8>) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut request = [0u8; 4096];
            let _ = conn.read(&mut request).await;
            let _ = conn.write_all(head.as_bytes()).await;
            for part in body.chunks(1 << 20) {
                if conn.write_all(part).await.is_err() {
                    return;
                }
            }
        });
        format!("http://{addr}")
    }

    #[tokio::test]
    async fn a_worker_answer_larger_than_the_bound_is_refused_unread() {
        let dir = tempfile::tempdir().unwrap();
        let storage = format!("file://{}", dir.path().display());
        let over = MAX_WORKER_ANSWER_BYTES + 1;
        // Declared too large: refused before anything is read.
        let declared = answer_once(
            format!("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {over}\r\n\r\n"),
            b"{}".to_vec(),
        )
        .await;
        // Streamed without a length, past the bound.
        let streamed = answer_once(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"
                .to_owned(),
            vec![b' '; over as usize],
        )
        .await;
        for control in [declared, streamed] {
            let c = Coordinator::new(
                &storage,
                identity("big"),
                Assignment::new(1, 128).unwrap(),
                vec![WorkerEndpoint {
                    control: control.clone(),
                    data: "127.0.0.1:1".into(),
                }],
                "token".into(),
                2,
            )
            .await
            .unwrap();
            let e = c.status().await.expect_err("refused").to_string();
            assert!(
                e.contains("larger than") && e.contains("refused"),
                "{control}: {e}"
            );
        }
    }
}
