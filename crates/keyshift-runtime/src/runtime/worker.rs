//! `keyshift worker`: one process per subtask.
//!
//! It serves the control API ([`super::protocol`]), and once started runs three kinds of tasks:
//! * the **source** reads this subtask's partitions (partition `p` belongs to subtask
//!   `p % parallelism`), routes every record to the subtask owning its key group, emits
//!   watermarks, and injects checkpoint barriers into every output when told to;
//! * **senders/receivers** move messages to and from peers over TCP ([`super::shuffle`]);
//! * the **keyed operator** reads one input per upstream subtask, aligns barriers (an input that
//!   delivered barrier `n` is not read again until every input has), then writes its key groups
//!   to the object store and acknowledges the snapshot.

use super::checkpoint::{self, StateWriteOptions, Updates};
use super::incremental;
use super::ledger::{BarrierCut, Ledger, Trigger};
use super::metrics::WorkerMetrics;
use super::prestage;
use super::protocol::*;
use super::restore::{self, RestoreOptions};
use super::shuffle::{self, BATCH, CHANNEL_BATCHES, Msg};
use crate::job::WatermarkTracker;
use crate::job::{self, CompiledJob, JobOptions, KeyedAggregator, PartitionWatermark, Record};
use crate::snapshot::{self, ObjectStore, Path as StorePath, SnapshotWriter};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use keyshift_core::keygroup::Assignment;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::{Mutex, mpsc, watch};

/// Worker failures.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("binding {what} on {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("invalid start request: {0}")]
    BadStart(String),
    #[error(transparent)]
    Job(#[from] job::JobError),
    #[error(transparent)]
    Aggregate(#[from] job::AggregateError),
    #[error(transparent)]
    Snapshot(#[from] snapshot::SnapshotError),
    #[error(transparent)]
    Shuffle(#[from] shuffle::ShuffleError),
    #[error(transparent)]
    StateWrite(#[from] checkpoint::StateWriteError),
    #[error(transparent)]
    Restore(#[from] restore::RestoreError),
    #[error(transparent)]
    Sink(#[from] job::SinkError),
    #[error("staging sink output: {0}")]
    SinkStore(#[from] crate::sink::SinkError),
    /// The Kafka sink (at least once) could not deliver or flush its records: the worker
    /// stops, and the job restarts from its last committed snapshot.
    #[error("{0}")]
    KafkaSink(String),
    #[error("{0}")]
    Fatal(String),
}

impl WorkerError {
    /// Whether a failed snapshot must stop the worker (so that the job restarts from its last
    /// committed snapshot) rather than only fail that snapshot.
    fn stops_the_worker(&self) -> bool {
        matches!(
            self,
            WorkerError::Sink(job::SinkError::Backlog { .. }) | WorkerError::KafkaSink(_)
        )
    }
}

/// How a worker listens.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Control API address.
    pub control_addr: SocketAddr,
    /// Data-plane address.
    pub data_addr: SocketAddr,
    /// Bearer token of the control API.
    pub token: String,
}

struct Shared {
    token: String,
    data_listener: Mutex<Option<TcpListener>>,
    started: AtomicBool,
    ready: AtomicBool,
    stopped: AtomicBool,
    run: Mutex<Option<RunHandle>>,
    /// Every snapshot's status, and what the source recorded at each barrier (picked up by the
    /// operator); bounded.
    ledger: Mutex<Ledger>,
    /// [`Ledger::aborted_through`], for the keyed operator: it stops aligning an id at or below
    /// it, and ignores such barriers.
    aborted: watch::Sender<u64>,
    status: Mutex<WorkerStatus>,
    /// Live counters of the running restore (reset by each start).
    restore_progress: Mutex<Arc<restore::Progress>>,
    metrics: WorkerMetrics,
    fatal: watch::Sender<Option<String>>,
    /// Whether a pre-stage was asked for and has not been consumed by a start (it may still be
    /// loading).
    prestaging: AtomicBool,
    /// The state a pre-stage loaded, once it has ([`prestage`]).
    prestaged: Mutex<Option<Prestaged>>,
}

/// What a pre-staged worker holds until its start: the key groups of the checkpoint it loaded.
struct Prestaged {
    /// The pre-stage request (its start must match it, but for the snapshot it names).
    req: StartRequest,
    agg: KeyedAggregator,
    /// The loaded checkpoint's manifest.
    manifest: snapshot::Manifest,
    /// The compiled job of a generator source, its key table built (the start uses it instead
    /// of building the table while the job waits for its first record).
    compiled: Option<CompiledJob>,
}

impl Shared {
    /// Aborts snapshot `id` (and the pending ones below it) in the ledger and tells the keyed
    /// operator.
    async fn abort(&self, id: u64, reason: &str) -> CheckpointStatus {
        let (through, status) = {
            let mut ledger = self.ledger.lock().await;
            let through = ledger.abort(id, reason);
            (through, ledger.status(id))
        };
        self.aborted.send_if_modified(|w| {
            let raise = through > *w;
            *w = (*w).max(through);
            raise
        });
        status
    }
}

struct RunHandle {
    source_cmd: mpsc::Sender<SourceCmd>,
}

enum SourceCmd {
    Barrier(CheckpointRequest),
    Resume,
}

/// A listening socket with an accept queue of `backlog` (capped by the kernel's somaxconn).
fn bind_with_backlog(addr: SocketAddr, backlog: u32) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(backlog)
}

/// A worker whose sockets are bound but which serves nothing yet: its addresses are known (also
/// when bound to port 0) before anything can reach it. [`run`] is [`bind`] + announce +
/// [`BoundWorker::serve`]; tests run workers in-process the same way, without stdout or signal
/// handlers.
pub struct BoundWorker {
    control: TcpListener,
    data: TcpListener,
    token: String,
    /// Where the control API listens.
    pub control_addr: SocketAddr,
    /// Where the data plane listens.
    pub data_addr: SocketAddr,
}

/// Binds a worker's control API and data plane.
pub async fn bind(config: WorkerConfig) -> Result<BoundWorker, WorkerError> {
    let control = TcpListener::bind(config.control_addr)
        .await
        .map_err(|source| WorkerError::Bind {
            what: "the control API",
            addr: config.control_addr,
            source,
        })?;
    // Every peer connects at once when a run starts: keep the accept queue deeper than the
    // largest parallelism we expect to start at once (std's default of 128 drops SYNs above it).
    let data = bind_with_backlog(config.data_addr, 4096).map_err(|source| WorkerError::Bind {
        what: "the data plane",
        addr: config.data_addr,
        source,
    })?;
    let control_addr = control
        .local_addr()
        .map_err(|e| WorkerError::Fatal(e.to_string()))?;
    let data_addr = data
        .local_addr()
        .map_err(|e| WorkerError::Fatal(e.to_string()))?;
    Ok(BoundWorker {
        control,
        data,
        token: config.token,
        control_addr,
        data_addr,
    })
}

/// Runs a worker until it fails (a fatal data-plane or operator error) or is killed.
pub async fn run(config: WorkerConfig) -> Result<(), WorkerError> {
    let worker = bind(config).await?;
    // Installed before anything can see this worker (see the select in `serve`).
    let shutdown = super::signal::shutdown_signal();
    // One line on stdout tells a local launcher where to reach us.
    println!(
        "{}",
        serde_json::json!({"control": worker.control_addr.to_string(), "data": worker.data_addr.to_string()})
    );
    worker.serve(shutdown).await
}

impl BoundWorker {
    /// Serves until the worker fails or `shutdown` completes (then `Ok`).
    pub async fn serve(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) -> Result<(), WorkerError> {
        let BoundWorker {
            control,
            data,
            token,
            control_addr,
            data_addr,
        } = self;
        tracing::info!(%control_addr, %data_addr, "worker listening");
        let (fatal, mut fatal_rx) = watch::channel(None);
        let shared = Arc::new(Shared {
            token,
            data_listener: Mutex::new(Some(data)),
            started: AtomicBool::new(false),
            ready: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            run: Mutex::new(None),
            ledger: Mutex::new(Ledger::new()),
            aborted: watch::channel(0).0,
            status: Mutex::new(WorkerStatus {
                state: WorkerState::Idle,
                ..Default::default()
            }),
            restore_progress: Mutex::new(Arc::new(restore::Progress::default())),
            metrics: WorkerMetrics::new(),
            fatal,
            prestaging: AtomicBool::new(false),
            prestaged: Mutex::new(None),
        });
        // Every control route needs the token, checked before its body is read or parsed.
        let guarded = Router::new()
            .route("/v1/start", post(start))
            .route("/v1/prestage", post(prestage_handler))
            .route("/v1/checkpoints", post(trigger))
            .route("/v1/checkpoints/{id}", get(checkpoint_status))
            .route("/v1/checkpoints/{id}/abort", post(abort))
            .route("/v1/resume", post(resume))
            .route("/v1/status", get(status))
            .route_layer(axum::middleware::from_fn_with_state(
                shared.clone(),
                require_token,
            ));
        let app = Router::new()
            .route("/v1/healthz", get(|| async { "ok" }))
            .route("/v1/readyz", get(readyz))
            .route("/metrics", get(metrics))
            .merge(guarded)
            .layer(axum::extract::DefaultBodyLimit::max(MAX_CONTROL_BODY))
            .with_state(shared.clone());
        let server = axum::serve(control, app);
        tokio::select! {
            r = server => r.map_err(|e| WorkerError::Fatal(format!("control API: {e}"))),
            reason = async { fatal_rx.wait_for(|f| f.is_some()).await.map(|f| f.clone().unwrap_or_default()) } => {
                Err(WorkerError::Fatal(reason.unwrap_or_else(|_| "worker state dropped".into())))
            }
            // In a container the worker is PID 1, which the kernel gives no default action for
            // SIGTERM: without a handler a deleted pod would wait out its whole grace period (and
            // every rescale with it) before the kubelet's SIGKILL. Nothing is lost by stopping at
            // once: a worker's state is the job's last snapshot, and the operator only deletes
            // workers after a savepoint or to restart from one.
            () = shutdown => {
                tracing::info!("worker stopping on SIGTERM/SIGINT");
                Ok(())
            }
        }
    }
}

/// How long an accepted data connection has to prove it is a peer of the run: as long as a peer
/// may take to connect (a real peer's hello can be slow on a loaded node, and a refused one would
/// never connect again). Handshakes run side by side, so a silent stray only holds its own task.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(120);

/// The largest control request body (a start request for 32768 subtasks' peers fits easily).
const MAX_CONTROL_BODY: usize = 4 << 20;

/// Refuses a control request without the job's token before anything reads its body.
async fn require_token(
    State(s): State<Arc<Shared>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match authorized(&s, request.headers()) {
        Ok(()) => next.run(request).await,
        Err(refused) => *refused,
    }
}

fn authorized(shared: &Shared, headers: &HeaderMap) -> Result<(), Box<Response>> {
    let ok = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|t| constant_time_eq(t.as_bytes(), shared.token.as_bytes()));
    if ok {
        Ok(())
    } else {
        Err(Box::new(
            (
                StatusCode::UNAUTHORIZED,
                "missing or wrong bearer token: send Authorization: Bearer <the job's control token>",
            )
                .into_response(),
        ))
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn err(code: StatusCode, message: impl std::fmt::Display) -> Response {
    (
        code,
        Json(serde_json::json!({ "error": message.to_string() })),
    )
        .into_response()
}

async fn readyz(State(s): State<Arc<Shared>>) -> Response {
    if s.ready.load(Ordering::Acquire) {
        (StatusCode::OK, "ready").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not started or not connected",
        )
            .into_response()
    }
}

async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    match s.metrics.encode() {
        Ok(text) => (
            [(
                axum::http::header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(e) => err(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}

async fn status(State(s): State<Arc<Shared>>) -> Response {
    let mut st = s.status.lock().await.clone();
    let m = &s.metrics;
    st.records_in = m.records_in.get();
    st.records_processed = m.records_processed.get();
    st.records_out = m.records_out.get();
    st.late_records = m.late_records.get();
    st.keys = m.keys.get() as u64;
    st.watermark = m.watermark_ms();
    st.backpressure_ms = (m.backpressure_seconds.get() * 1000.0).round() as u64;
    st.newest_snapshot = s.ledger.lock().await.newest_id();
    if s.stopped.load(Ordering::Acquire) {
        st.state = WorkerState::Stopped;
    }
    if st.state == WorkerState::Restoring
        && let Some(r) = st.restore.as_mut()
    {
        let p = s.restore_progress.lock().await;
        r.bytes_read = p.bytes_read();
        r.groups_read = p.groups_read();
    }
    Json(st).into_response()
}

async fn checkpoint_status(State(s): State<Arc<Shared>>, Path(id): Path<u64>) -> Response {
    let st = s.ledger.lock().await.status(id);
    Json(st).into_response()
}

/// Abandons snapshot `id` (idempotent): it is reported failed, its cut is dropped, and the keyed
/// operator stops aligning it (see [`super::ledger`]).
async fn abort(State(s): State<Arc<Shared>>, Path(id): Path<u64>) -> Response {
    let status = s
        .abort(
            id,
            &format!("aborted: snapshot {id} was abandoned by the coordinator"),
        )
        .await;
    tracing::info!(id, "snapshot aborted by the coordinator");
    Json(status).into_response()
}

async fn trigger(State(s): State<Arc<Shared>>, Json(req): Json<CheckpointRequest>) -> Response {
    let run = s.run.lock().await;
    let Some(run) = run.as_ref() else {
        return err(StatusCode::CONFLICT, "the worker has not been started");
    };
    let (outcome, through) = {
        let mut ledger = s.ledger.lock().await;
        (ledger.trigger(req.id), ledger.aborted_through())
    };
    // Too many in flight: the ledger abandoned the oldest.
    s.aborted.send_if_modified(|w| {
        let raise = through > *w;
        *w = (*w).max(through);
        raise
    });
    match outcome {
        Trigger::New => {}
        // Idempotent: a retried trigger changes nothing.
        Trigger::Known => return StatusCode::ACCEPTED.into_response(),
        Trigger::Stale { newest_finished } => {
            return err(
                StatusCode::CONFLICT,
                format!(
                    "snapshot {} is not above snapshot {newest_finished}, the newest this worker finished or abandoned: snapshot ids only grow",
                    req.id
                ),
            );
        }
    }
    if run.source_cmd.send(SourceCmd::Barrier(req)).await.is_err() {
        return err(StatusCode::INTERNAL_SERVER_ERROR, "the source has stopped");
    }
    StatusCode::ACCEPTED.into_response()
}

async fn resume(State(s): State<Arc<Shared>>) -> Response {
    let run = s.run.lock().await;
    match run.as_ref() {
        Some(run) => {
            let _ = run.source_cmd.send(SourceCmd::Resume).await;
            s.stopped.store(false, Ordering::Release);
            StatusCode::OK.into_response()
        }
        None => err(StatusCode::CONFLICT, "the worker has not been started"),
    }
}

async fn start(State(s): State<Arc<Shared>>, Json(req): Json<StartRequest>) -> Response {
    if s.started.swap(true, Ordering::AcqRel) {
        return err(StatusCode::CONFLICT, "the worker was already started");
    }
    let pre = s.prestaged.lock().await.take();
    if pre.is_none() && s.prestaging.load(Ordering::Acquire) {
        s.started.store(false, Ordering::Release);
        return err(
            StatusCode::CONFLICT,
            "the worker is still pre-staging: start it once it reports prestaged",
        );
    }
    s.prestaging.store(false, Ordering::Release);
    // Checked before answering: a bad request fails at once.
    let mut prepared = match prepare_subtask(req).await {
        Ok(p) => p,
        Err(e) => {
            tracing::error!(error = %e, "start refused");
            s.status.lock().await.last_start_error = Some(e.to_string());
            s.started.store(false, Ordering::Release);
            return err(StatusCode::UNPROCESSABLE_ENTITY, e);
        }
    };
    if let Some(pre) = pre {
        match prestage_fits(&pre, &prepared) {
            Ok(plan) => {
                tracing::info!(
                    loaded = pre.manifest.snapshot_id,
                    groups = plan.groups.len(),
                    replaced = plan.replaced,
                    bytes = plan.bytes,
                    "starting from the pre-staged state: reading only the delta"
                );
                prepared.totals = (plan.bytes, plan.groups.len() as u32);
                prepared.agg = pre.agg;
                if let Some(c) = pre.compiled {
                    prepared.compiled = c;
                }
                prepared.delta = Some(plan);
            }
            Err(why) => tracing::warn!(
                reason = %why,
                "the pre-staged state does not fit the start: dropped, restoring in full"
            ),
        }
    }
    let accepted = StartAccepted {
        bytes_total: prepared.totals.0,
        groups_total: prepared.totals.1,
        source_partitions: match prepared.compiled.current_partitions() {
            job::CurrentPartitions::Named(names) => Some(PartitionList::of(names)),
            job::CurrentPartitions::Indexed(_) => None,
        },
    };
    let progress = Arc::new(restore::Progress::default());
    *s.restore_progress.lock().await = progress.clone();
    {
        let mut st = s.status.lock().await;
        st.state = WorkerState::Restoring;
        st.last_start_error = None;
        st.started = None;
        st.restore = Some(RestoreProgress {
            bytes_total: accepted.bytes_total,
            groups_total: accepted.groups_total,
            ..RestoreProgress::default()
        });
    }
    // The restore outlasts any request timeout: it runs on, `/v1/status` reports it.
    let s2 = s.clone();
    tokio::spawn(async move {
        match start_subtask(s2.clone(), prepared, &progress).await {
            Ok(resp) => {
                let mut st = s2.status.lock().await;
                if let Some(r) = st.restore.as_mut() {
                    r.bytes_read = progress.bytes_read();
                    r.groups_read = progress.groups_read();
                }
                st.started = Some(resp);
            }
            Err(e) => {
                tracing::error!(error = %e, "start failed");
                {
                    let mut st = s2.status.lock().await;
                    st.state = WorkerState::Idle;
                    st.last_start_error = Some(e.to_string());
                }
                s2.started.store(false, Ordering::Release);
            }
        }
    });
    (StatusCode::ACCEPTED, Json(accepted)).into_response()
}

/// Whether the request's `restore_from` names the job's own checkpoint that `manifest` is
/// (not a savepoint, nor another job's snapshot).
fn own_checkpoint(req: &StartRequest, manifest: &snapshot::Manifest) -> bool {
    let own = crate::snapshot::snapshot_url(
        &req.storage,
        &req.namespace,
        &req.name,
        manifest.kind,
        manifest.snapshot_id,
    );
    manifest.kind == snapshot::SnapshotKind::Checkpoint
        && req
            .restore_from
            .as_deref()
            .is_some_and(|u| u.trim().trim_end_matches('/') == own)
}

/// Whether a start (`prepared`) may build on what a pre-stage loaded (`pre`): the same job,
/// subtask, parallelism and key groups, and a snapshot that is a later checkpoint of the job;
/// then what to read of it. Why not, otherwise.
fn prestage_fits(pre: &Prestaged, prepared: &Prepared) -> Result<prestage::DeltaPlan, String> {
    let (a, b) = (&pre.req, &prepared.req);
    let same = a.namespace == b.namespace
        && a.name == b.name
        && a.storage == b.storage
        && a.subtask == b.subtask
        && a.parallelism == b.parallelism
        && a.max_parallelism == b.max_parallelism
        && a.state_payload_bytes == b.state_payload_bytes
        && a.job == b.job;
    if !same {
        return Err("the start names another job, subtask or parallelism".into());
    }
    let Some((_, _, target)) = &prepared.snapshot else {
        return Err("the start restores nothing".into());
    };
    if !own_checkpoint(b, target)
        || target.snapshot_id <= pre.manifest.snapshot_id
        || target.state_schema != job::AGG_SCHEMA
    {
        return Err(format!(
            "the start restores snapshot {} ({:?}), not a later checkpoint of the job than the pre-staged {}",
            target.snapshot_id, target.kind, pre.manifest.snapshot_id
        ));
    }
    Ok(prestage::plan(
        &pre.manifest,
        target,
        prepared.assignment.range(b.subtask),
    ))
}

/// `POST /v1/prestage`: loads this subtask's key groups from the job's checkpoint the request
/// names, and holds them for the start that follows (see [`prestage`]). Reads no source,
/// connects to no peer, emits nothing. 202 once the request is checked; `/v1/status` says
/// `restoring`, then `prestaged` (or `idle` with the error). A worker already pre-staged and
/// sent a later checkpoint of the job catches up: it reads only the blocks it lacks, as a start
/// does, so that the delta the old run's stop writes stays small.
async fn prestage_handler(State(s): State<Arc<Shared>>, Json(req): Json<StartRequest>) -> Response {
    if s.started.load(Ordering::Acquire) {
        return err(StatusCode::CONFLICT, "the worker was already started");
    }
    let pre = s.prestaged.lock().await.take();
    if s.prestaging.swap(true, Ordering::AcqRel) && pre.is_none() {
        return err(StatusCode::CONFLICT, "the worker is still pre-staging");
    }
    let refuse = |e: String| async {
        tracing::error!(error = %e, "pre-stage refused");
        s.status.lock().await.last_start_error = Some(e.clone());
        s.prestaging.store(false, Ordering::Release);
        err(StatusCode::UNPROCESSABLE_ENTITY, e)
    };
    let prepared = match prepare_subtask(req).await {
        Ok(p) => p,
        Err(e) => return refuse(e.to_string()).await,
    };
    let own = prepared.snapshot.as_ref().is_some_and(|(_, _, m)| {
        own_checkpoint(&prepared.req, m) && m.state_schema == job::AGG_SCHEMA
    });
    if !own {
        return refuse(
            "a pre-stage loads one of the job's own checkpoints: restoreFrom must name one".into(),
        )
        .await;
    }
    // Catching up: only what the pre-staged state lacks.
    let catch_up = pre.and_then(|p| match prestage_fits(&p, &prepared) {
        Ok(plan) => Some((p, plan)),
        Err(why) => {
            tracing::warn!(reason = %why, "the pre-staged state does not fit: loading in full");
            None
        }
    });
    let totals = catch_up.as_ref().map_or(prepared.totals, |(_, plan)| {
        (plan.bytes, plan.groups.len() as u32)
    });
    let accepted = StartAccepted {
        bytes_total: totals.0,
        groups_total: totals.1,
        source_partitions: None,
    };
    let progress = Arc::new(restore::Progress::default());
    *s.restore_progress.lock().await = progress.clone();
    {
        let mut st = s.status.lock().await;
        st.state = WorkerState::Restoring;
        st.last_start_error = None;
        st.prestaged = None;
        st.restore = Some(RestoreProgress {
            bytes_total: accepted.bytes_total,
            groups_total: accepted.groups_total,
            ..RestoreProgress::default()
        });
    }
    let s2 = s.clone();
    tokio::spawn(async move {
        let Prepared {
            req,
            mut agg,
            snapshot: snap,
            compiled,
            ..
        } = prepared;
        let started = Instant::now();
        if let Some((pre, plan)) = catch_up {
            let mut agg = pre.agg;
            let result = match snap {
                Some((rstore, dir, manifest)) => {
                    prestage::apply(&mut agg, rstore.as_ref(), &dir, &plan, Some(&progress))
                        .await
                        .map(|a| (a, manifest))
                }
                None => Err(restore::RestoreError::Decoder("no snapshot".into())),
            };
            let restored = result.map(|(a, manifest)| {
                (
                    restore::Restored {
                        groups: a.groups,
                        keys: agg.key_count() as u64,
                        bytes_read: a.bytes_read,
                    },
                    manifest,
                )
            });
            prestaged(&s2, req, agg, pre.compiled, restored, started, &progress).await;
            return;
        }
        // A generator's key table is built on its first record: built here instead.
        let compiled = match compiled.source {
            job::SourceKind::Generator(_) => tokio::task::spawn_blocking(move || {
                if let job::SourceKind::Generator(g) = &compiled.source {
                    let _ = g.key_for_index(0);
                }
                compiled
            })
            .await
            .ok(),
            _ => None,
        };
        let result = match snap {
            Some((rstore, dir, manifest)) => restore::restore_state_reporting(
                &mut agg,
                rstore.as_ref(),
                &dir,
                &manifest,
                RestoreOptions::default(),
                Some(&progress),
            )
            .await
            .map(|r| (r, manifest)),
            None => Err(restore::RestoreError::Decoder("no snapshot".into())),
        };
        prestaged(&s2, req, agg, compiled, result, started, &progress).await;
    });
    (StatusCode::ACCEPTED, Json(accepted)).into_response()
}

/// A pre-stage's (or catch-up's) load ended: the state is held for the start, or the worker is
/// idle again with the error.
async fn prestaged(
    s: &Shared,
    req: StartRequest,
    agg: KeyedAggregator,
    compiled: Option<CompiledJob>,
    result: Result<(restore::Restored, snapshot::Manifest), restore::RestoreError>,
    started: Instant,
    progress: &restore::Progress,
) {
    match result {
        Ok((r, manifest)) => {
            let resp = StartResponse {
                groups_restored: r.groups,
                keys_restored: r.keys,
                bytes_read: r.bytes_read,
                restore_ms: started.elapsed().as_millis() as u64,
            };
            tracing::info!(
                subtask = req.subtask,
                parallelism = req.parallelism,
                checkpoint = manifest.snapshot_id,
                keys = r.keys,
                bytes = r.bytes_read,
                ms = resp.restore_ms,
                "pre-staged"
            );
            *s.prestaged.lock().await = Some(Prestaged {
                req,
                agg,
                manifest,
                compiled,
            });
            let mut st = s.status.lock().await;
            if let Some(p) = st.restore.as_mut() {
                p.bytes_read = progress.bytes_read();
                p.groups_read = progress.groups_read();
            }
            st.state = WorkerState::Prestaged;
            st.prestaged = Some(resp);
        }
        Err(e) => {
            tracing::error!(error = %e, "pre-stage failed");
            let mut st = s.status.lock().await;
            st.state = WorkerState::Idle;
            st.last_start_error = Some(format!("pre-stage: {e}"));
            s.prestaging.store(false, Ordering::Release);
        }
    }
}

/// Everything the operator task of a running subtask owns.
struct Subtask {
    /// The job's namespace and name.
    job: (String, String),
    subtask: u32,
    assignment: Assignment,
    agg: KeyedAggregator,
    store: Arc<dyn ObjectStore>,
    job_dir: StorePath,
    sink_log: bool,
    /// The object-store sink, or the staging of an exactly-once Kafka sink.
    sink: Option<ObjectSink>,
    /// The Kafka sink at least once: rows are produced as they come, flushed at barriers.
    #[cfg(feature = "kafka")]
    kafka: Option<job::kafka::sink::AtLeastOnceSink>,
    /// The names of the source partitions it reads (file sources), for its acks.
    source_partitions: BTreeMap<u32, String>,
    /// What its next checkpoint builds on (incremental checkpoints).
    chain: incremental::Chain,
    /// A snapshot whose cut was taken at its barrier and whose deltas' changed keys are still
    /// being copied, a step between batches ([`CAPTURE_STEP_KEYS`]).
    capturing: Option<CutTaken>,
    /// A snapshot whose cut was taken and whose state is still being written.
    uploading: Option<Uploading>,
}

/// A snapshot being written while records flow: it settles in the ledger itself, and hands
/// back what it wrote for the next checkpoint to build on.
struct Uploading {
    id: u64,
    /// A savepoint is no base for a checkpoint (it is self-contained, and outlives them).
    kind: snapshot::SnapshotKind,
    cut: u32,
    task: tokio::task::JoinHandle<Result<Option<snapshot::SubtaskSnapshot>, WorkerError>>,
}

/// The object-store sink of a subtask: where it stages, and what (every result since the job's
/// last committed snapshot, see [`job::sink`]).
struct ObjectSink {
    store: Arc<dyn ObjectStore>,
    base: StorePath,
    staging: job::StagingSink,
}

/// A start request, checked: everything but the restore itself.
struct Prepared {
    req: StartRequest,
    assignment: Assignment,
    compiled: CompiledJob,
    agg: KeyedAggregator,
    store: Arc<dyn ObjectStore>,
    job_dir: StorePath,
    /// The snapshot to restore (its store, directory and manifest), if any.
    snapshot: Option<(Arc<dyn ObjectStore>, StorePath, snapshot::Manifest)>,
    /// The snapshot's source positions per current partition index ([`restored_positions`]).
    positions: BTreeMap<u32, u64>,
    /// What the restore reads in all: bytes, key groups.
    totals: (u64, u32),
    /// With a pre-staged state in `agg`: what to read of the snapshot over it.
    delta: Option<prestage::DeltaPlan>,
}

/// Checks a start request: its bounds, its layout, its dataflow (by the CRD's rules,
/// [`keyshift_core::rules::validate_job`], then by what it takes to run it), and the manifest of
/// the snapshot it restores (key-group count, state schema). Reads nothing but that manifest
/// (and a file source's directory listing).
async fn prepare_subtask(req: StartRequest) -> Result<Prepared, WorkerError> {
    req.check_bounds()
        .map_err(|e| WorkerError::BadStart(e.to_string()))?;
    // The dataflow by the CRD's rules, as a manifest's (a start request may come from any
    // caller holding the token, not only from a spec the API server checked).
    keyshift_core::rules::validate_job(&req.job)
        .map_err(|e| WorkerError::BadStart(e.0.join("; ")))?;
    let assignment = Assignment::new(i64::from(req.parallelism), i64::from(req.max_parallelism))
        .map_err(|e| WorkerError::BadStart(e.to_string()))?;
    if req.subtask >= req.parallelism || req.peers.len() != req.parallelism as usize {
        return Err(WorkerError::BadStart(format!(
            "subtask {} of {} with {} peer addresses",
            req.subtask,
            req.parallelism,
            req.peers.len()
        )));
    }
    let options = JobOptions {
        state_payload_bytes: req.state_payload_bytes,
    };
    // A Kafka source asks its brokers for the topics' partitions here: off the runtime threads.
    let compiled = {
        let (spec, maxp) = (req.job.clone(), req.max_parallelism);
        let (ns, name) = (req.namespace.clone(), req.name.clone());
        tokio::task::spawn_blocking(move || job::compile_for(&spec, maxp, &options, &ns, &name))
            .await
            .map_err(|e| WorkerError::Fatal(format!("compiling the job: {e}")))??
    };
    let range = assignment.range(req.subtask);
    let agg = compiled.new_aggregator(range)?;
    let (store, base) = snapshot::open_store(&req.storage)?;
    let job_dir = snapshot::job_dir(&base, &req.namespace, &req.name);
    let mut snap = None;
    let mut totals = (0, 0);
    let mut positions = BTreeMap::new();
    if let Some(url) = &req.restore_from {
        let (rstore, dir, manifest) = snapshot::open_snapshot(url).await?;
        if manifest.max_parallelism != req.max_parallelism {
            return Err(WorkerError::BadStart(format!(
                "snapshot {url} has {} key groups but the job runs with {}: restore it with maxParallelism {}, or rewrite it with `keyshift savepoint rewrite {url} --max-parallelism {} --to <url>`",
                manifest.max_parallelism,
                req.max_parallelism,
                manifest.max_parallelism,
                req.max_parallelism
            )));
        }
        if manifest.state_schema != job::AGG_SCHEMA && !req.allow_non_restored_state {
            return Err(WorkerError::BadStart(format!(
                "snapshot {url} holds state of schema {:?}, this job keeps {:?}: set allowNonRestoredState to start without it",
                manifest.state_schema,
                job::AGG_SCHEMA
            )));
        }
        if manifest.state_schema == job::AGG_SCHEMA {
            totals = restore::restore_totals(&manifest, range);
        }
        positions = restored_positions(&req, &compiled, &manifest)?;
        snap = Some((rstore, dir, manifest));
    }
    Ok(Prepared {
        req,
        assignment,
        compiled,
        agg,
        store,
        job_dir,
        snapshot: snap,
        positions,
        totals,
        delta: None,
    })
}

/// The snapshot's source positions laid onto the source's partitions as they are now: by file
/// name for a snapshot of a file source that recorded names, by index otherwise (see
/// [`job::positions`]). New and gone partitions are logged (new ones by the subtask that reads
/// them, gone ones by subtask 0), and each of this subtask's partitions is checked against its
/// position: a file shorter than its position refuses the start, naming the file.
fn restored_positions(
    req: &StartRequest,
    compiled: &CompiledJob,
    manifest: &snapshot::Manifest,
) -> Result<BTreeMap<u32, u64>, WorkerError> {
    let current = compiled.current_partitions();
    let named = matches!(current, job::CurrentPartitions::Named(_));
    let remap = job::remap_positions(
        &manifest.source_positions,
        &manifest.source_partitions,
        current,
    )
    .map_err(|e| WorkerError::BadStart(format!("the snapshot's source partitions: {e}")))?;
    let mine = |p: u32| p % req.parallelism == req.subtask;
    for n in remap.new.iter().filter(|n| mine(n.index)) {
        tracing::info!(
            partition = n.index,
            file = n.name.as_deref().unwrap_or("-"),
            "a source partition the snapshot does not know (new since): reading it from the start"
        );
    }
    if req.subtask == 0 {
        for g in &remap.gone {
            tracing::warn!(
                snapshot_partition = g.index,
                file = g.name.as_deref().unwrap_or("-"),
                position = g.position,
                "a source partition of the snapshot is gone: it had been read up to its position, nothing of it to restore"
            );
        }
        if let Some((then, now)) = remap.count_changed {
            if named {
                tracing::warn!(
                    then,
                    now,
                    "the snapshot records no partition file names (written by an older keyshift): positions are restored by index, but the directory held {then} files then and {now} now, so offsets may apply to other files than they were taken on"
                );
            } else {
                tracing::warn!(
                    then,
                    now,
                    "the source had {then} partitions at the snapshot and has {now} now: positions restored by index"
                );
            }
        }
    }
    tracing::debug!(matched_by = ?remap.matched_by, positions = remap.positions.len(), "source positions restored");
    for (&p, &position) in remap.positions.iter().filter(|(p, _)| mine(**p)) {
        compiled.check_position(p, position)?;
    }
    Ok(remap.positions)
}

async fn start_subtask(
    s: Arc<Shared>,
    prepared: Prepared,
    progress: &restore::Progress,
) -> Result<StartResponse, WorkerError> {
    let Prepared {
        req,
        assignment,
        compiled,
        mut agg,
        store,
        job_dir,
        snapshot: snap,
        positions,
        totals: _,
        delta,
    } = prepared;
    let range = assignment.range(req.subtask);
    #[cfg(feature = "kafka")]
    let from_snapshot = snap.is_some();

    // Restore: exactly this subtask's key groups, checksummed before anything is applied.
    let started = Instant::now();
    let mut resp = StartResponse::default();
    let mut watermark = i64::MIN;
    let mut chain = incremental::Chain::new(req.incremental);
    if let Some((rstore, dir, manifest)) = snap {
        if let Some(plan) = &delta {
            let applied =
                prestage::apply(&mut agg, rstore.as_ref(), &dir, plan, Some(progress)).await?;
            resp.keys_restored = agg.key_count() as u64;
            resp.groups_restored = applied.groups;
            resp.bytes_read = applied.bytes_read;
        } else if manifest.state_schema == job::AGG_SCHEMA {
            // Decoded while the next blocks are read; installed once every block is checked.
            let restored = restore::restore_state_reporting(
                &mut agg,
                rstore.as_ref(),
                &dir,
                &manifest,
                RestoreOptions::default(),
                Some(progress),
            )
            .await?;
            resp.keys_restored = restored.keys;
            resp.groups_restored = restored.groups;
            resp.bytes_read = restored.bytes_read;
        }
        // One of the job's own checkpoints: the next checkpoint may build on it.
        let own = crate::snapshot::snapshot_url(
            &req.storage,
            &req.namespace,
            &req.name,
            snapshot::SnapshotKind::Checkpoint,
            manifest.snapshot_id,
        );
        if manifest.kind == snapshot::SnapshotKind::Checkpoint
            && manifest.state_schema == job::AGG_SCHEMA
            && req
                .restore_from
                .as_deref()
                .is_some_and(|u| u.trim().trim_end_matches('/') == own)
        {
            chain.restored_from(incremental::Base::restored(&manifest, range));
        }
        crate::failpoints::slow_restore(&req.namespace, &req.name).await;
        if let Some(wm) = manifest.watermark {
            watermark = wm;
            agg.restore_watermark(wm);
        }
    }
    s.metrics.restore_bytes.set(resp.bytes_read as i64);
    s.metrics
        .restore_seconds
        .set(started.elapsed().as_secs_f64());
    resp.restore_ms = started.elapsed().as_millis() as u64;
    s.metrics.keys.set(agg.key_count() as i64);
    tracing::info!(
        subtask = req.subtask,
        parallelism = req.parallelism,
        key_groups = %range,
        keys = resp.keys_restored,
        bytes = resp.bytes_read,
        ms = resp.restore_ms,
        "restored"
    );

    {
        let mut st = s.status.lock().await;
        st.state = WorkerState::Running;
        st.subtask = req.subtask;
        st.parallelism = req.parallelism;
        st.key_groups = Some([range.start, range.end]);
    }
    let listener = s
        .data_listener
        .lock()
        .await
        .take()
        .ok_or_else(|| WorkerError::BadStart("the data listener is gone".into()))?;

    let n = req.parallelism as usize;
    let me = req.subtask as usize;
    let (cmd_tx, cmd_rx) = mpsc::channel(16);
    *s.run.lock().await = Some(RunHandle { source_cmd: cmd_tx });

    // Operator inputs: one channel per upstream subtask.
    let mut input_tx = Vec::with_capacity(n);
    let mut input_rx = Vec::with_capacity(n);
    for _ in 0..n {
        let (tx, rx) = mpsc::channel::<Msg>(CHANNEL_BATCHES);
        input_tx.push(tx);
        input_rx.push(rx);
    }
    // Source outputs: the local input for ourselves, a sender per peer.
    let mut outputs: Vec<mpsc::Sender<Msg>> = Vec::with_capacity(n);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let mut connects = Vec::new();
    for (j, addr) in req.peers.iter().enumerate() {
        if j == me {
            outputs.push(input_tx[me].clone());
        } else {
            let (tx, rx) = mpsc::channel::<Msg>(CHANNEL_BATCHES);
            outputs.push(tx);
            let addr = addr.clone();
            let run_id = req.run_id.clone();
            let secret = req.data_secret.clone();
            let from = req.subtask;
            connects.push(tokio::spawn(async move {
                let stream = shuffle::connect(&addr, from, &run_id, &secret, deadline).await?;
                Ok::<_, shuffle::ShuffleError>((stream, rx))
            }));
        }
    }
    // Accept one connection from every peer.
    let peers_expected = n - 1;
    let accept_inputs: Vec<mpsc::Sender<Msg>> = input_tx.clone();
    let run_id = req.run_id.clone();
    let secret = req.data_secret.clone();
    let s2 = s.clone();
    tokio::spawn(async move {
        let result: Result<(), WorkerError> = async {
            // Accept while our own connections are being made: a peer that only accepts once
            // its connects are done would wait on one that waits on it.
            let connecting = tokio::spawn(async move {
                let mut senders = Vec::new();
                for c in connects {
                    let (stream, rx) = c.await.map_err(|e| WorkerError::Fatal(e.to_string()))??;
                    senders.push(tokio::spawn(shuffle::send_loop(stream, rx)));
                }
                Ok::<_, WorkerError>(senders)
            });
            // Handshakes run side by side, each bounded: a stray, silent or forged connection
            // is refused and logged, and neither stalls the others nor takes a peer's place.
            let (hs_tx, mut hs_rx) = mpsc::channel(64);
            let mut peers: BTreeMap<u32, tokio::net::TcpStream> = BTreeMap::new();
            while peers.len() < peers_expected {
                tokio::select! {
                    accepted = listener.accept() => {
                        let (mut stream, addr) = accepted
                            .map_err(|e| WorkerError::Fatal(format!("accepting a peer: {e}")))?;
                        stream.set_nodelay(true).ok();
                        let (hs_tx, run_id, secret) = (hs_tx.clone(), run_id.clone(), secret.clone());
                        tokio::spawn(async move {
                            let hello = tokio::time::timeout(
                                HANDSHAKE_TIMEOUT,
                                shuffle::accept_hello(&mut stream, &run_id, &secret),
                            )
                            .await;
                            let _ = hs_tx.send((addr, hello, stream)).await;
                        });
                    }
                    Some((addr, hello, stream)) = hs_rx.recv() => match hello {
                        Ok(Ok(from))
                            if from as usize != me
                                && (from as usize) < n
                                && !peers.contains_key(&from) =>
                        {
                            peers.insert(from, stream);
                        }
                        Ok(Ok(from)) => tracing::warn!(
                            %addr, from, "refused a data connection: not an expected peer (or one already connected)"
                        ),
                        Ok(Err(e)) => tracing::warn!(%addr, error = %e, "refused a data connection"),
                        Err(_) => tracing::warn!(%addr, "refused a data connection: no hello in time"),
                    },
                }
            }
            for (from, stream) in peers {
                let Some(tx) = accept_inputs.get(from as usize).cloned() else {
                    continue;
                };
                let s3 = s2.clone();
                tokio::spawn(async move {
                    if let Err(e) = shuffle::recv_loop(from, stream, tx).await {
                        let _ = s3
                            .fatal
                            .send(Some(format!("receiving from subtask {from}: {e}")));
                    }
                });
            }
            let senders = connecting
                .await
                .map_err(|e| WorkerError::Fatal(e.to_string()))??;
            s2.ready.store(true, Ordering::Release);
            tracing::info!("connected to every peer");
            for h in senders {
                let s3 = s2.clone();
                tokio::spawn(async move {
                    match h.await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => {
                            let _ = s3.fatal.send(Some(format!("sending to a peer: {e}")));
                        }
                        Err(e) => {
                            let _ = s3.fatal.send(Some(format!("sender task: {e}")));
                        }
                    }
                });
            }
            Ok(())
        }
        .await;
        if let Err(e) = result {
            let _ = s2
                .fatal
                .send(Some(format!("connecting the data plane: {e}")));
        }
    });
    drop(input_tx);

    let sink = match (&req.job.sink.sink_type, &req.job.sink.url) {
        (keyshift_core::spec::SinkType::ObjectStore, Some(url)) => {
            let (store, base) = snapshot::open_store(url)?;
            let writer = job::WriterId {
                subtask: req.subtask,
                parallelism: req.parallelism,
            };
            Some(ObjectSink {
                store,
                base,
                staging: job::StagingSink::new(writer),
            })
        }
        // Exactly-once Kafka: staged in the job's storage like the object-store sink's output;
        // the coordinator produces it once its snapshot commits (see job::kafka::sink).
        (keyshift_core::spec::SinkType::Kafka, _) if job::kafka::sink::stages(&req.job.sink) => {
            Some(ObjectSink {
                store: store.clone(),
                base: job::kafka::sink::staging_base(&job_dir),
                staging: job::StagingSink::new(job::WriterId {
                    subtask: req.subtask,
                    parallelism: req.parallelism,
                }),
            })
        }
        _ => None,
    };
    #[cfg(feature = "kafka")]
    let kafka = match (&req.job.sink.sink_type, &req.job.sink.kafka) {
        (keyshift_core::spec::SinkType::Kafka, Some(k))
            if !job::kafka::sink::stages(&req.job.sink) =>
        {
            Some(
                job::kafka::sink::AtLeastOnceSink::from_spec(k)
                    .map_err(|e| WorkerError::KafkaSink(e.to_string()))?,
            )
        }
        _ => None,
    };
    let my_partitions: Vec<u32> = (0..compiled.partitions())
        .filter(|p| p % req.parallelism == req.subtask)
        .collect();
    let source_partitions = compiled.partition_names(&my_partitions);
    // A Kafka source: its partitions assigned at their snapshot offsets (or where a job without
    // state starts), resolved before any record is read; new partitions watched for.
    #[cfg(feature = "kafka")]
    let positions = match &compiled.source {
        job::SourceKind::Kafka(k) => {
            let (k2, mine) = (k.clone(), my_partitions.clone());
            let resolved =
                tokio::task::spawn_blocking(move || k2.assign(&mine, &positions, from_snapshot))
                    .await
                    .map_err(|e| {
                        WorkerError::Fatal(format!("assigning the Kafka partitions: {e}"))
                    })?
                    .map_err(job::JobError::from)?;
            spawn_kafka_partition_watch(s.clone(), k.clone());
            spawn_kafka_lag(s.clone(), k.clone());
            resolved
        }
        _ => positions,
    };
    let sub = Subtask {
        job: (req.namespace.clone(), req.name.clone()),
        subtask: req.subtask,
        assignment,
        agg,
        store,
        job_dir,
        sink_log: matches!(req.job.sink.sink_type, keyshift_core::spec::SinkType::Log),
        sink,
        #[cfg(feature = "kafka")]
        kafka,
        source_partitions,
        chain,
        capturing: None,
        uploading: None,
    };
    let compiled = Arc::new(compiled);
    let s_src = s.clone();
    let src_compiled = compiled.clone();
    tokio::spawn(async move {
        let r = source_loop(
            s_src.clone(),
            src_compiled,
            my_partitions,
            positions,
            assignment,
            outputs,
            cmd_rx,
        )
        .await;
        if let Err(e) = r {
            let _ = s_src.fatal.send(Some(format!("source: {e}")));
        }
    });
    let s_op = s.clone();
    let operator = async move {
        if let Err(e) = operator_loop(s_op.clone(), sub, input_rx, watermark).await {
            let _ = s_op.fatal.send(Some(format!("keyed operator: {e}")));
        }
    };
    // The keyed operator gets a thread of its own; its I/O and the tasks it spawns still use the
    // runtime. As a task it took turns with the source on one runtime thread (a woken task runs
    // next on the waker's thread and cannot be stolen), so a subtask never used more than one
    // core; and encoding a large snapshot held a runtime thread for seconds.
    let handle = tokio::runtime::Handle::current();
    let s_thread = s.clone();
    std::thread::Builder::new()
        .name(format!("keyed-operator-{}", req.subtask))
        .spawn(move || {
            let run = std::panic::AssertUnwindSafe(|| handle.block_on(operator));
            if std::panic::catch_unwind(run).is_err() {
                let _ = s_thread.fatal.send(Some("keyed operator: panicked".into()));
            }
        })
        .map_err(|e| WorkerError::Fatal(format!("starting the keyed operator thread: {e}")))?;
    Ok(resp)
}

/// Measures the lag of this subtask's Kafka partitions every [`LAG_INTERVAL`] (see
/// [`job::kafka::source`], "Lag") into the status and the metrics. Brokers that do not answer
/// leave the last numbers and put their error in the status.
///
/// [`LAG_INTERVAL`]: job::kafka::source::LAG_INTERVAL
#[cfg(feature = "kafka")]
fn spawn_kafka_lag(s: Arc<Shared>, k: Arc<job::kafka::source::KafkaSourceReader>) {
    tokio::spawn(async move {
        loop {
            let positions = s.status.lock().await.source_positions.clone();
            if !positions.is_empty() {
                let k2 = k.clone();
                let measured = match tokio::task::spawn_blocking(move || k2.lag(&positions)).await {
                    Ok(m) => m,
                    Err(_) => return,
                };
                let mut st = s.status.lock().await;
                match measured {
                    Ok(lag) => {
                        s.metrics
                            .source_lag_records
                            .set(i64::try_from(lag.records).unwrap_or(i64::MAX));
                        s.metrics.source_lag_seconds.set(lag.seconds.unwrap_or(0.0));
                        st.source_lag = Some(lag);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "measuring the Kafka source's lag");
                        let lag = st.source_lag.get_or_insert_with(Default::default);
                        lag.error = Some(e.to_string());
                        lag.bootstrap = k.bootstrap().to_owned();
                    }
                }
            }
            tokio::time::sleep(job::kafka::source::LAG_INTERVAL).await;
        }
    });
}

/// Fails the run when a Kafka topic's partition count changes (checked every
/// metadataRefreshInterval): the job restarts from its latest checkpoint, whose start lists the
/// new partitions and reads them from their earliest offset (see [`job::kafka::source`]).
#[cfg(feature = "kafka")]
fn spawn_kafka_partition_watch(s: Arc<Shared>, k: Arc<job::kafka::source::KafkaSourceReader>) {
    tokio::spawn(async move {
        let every = k.refresh_interval();
        loop {
            tokio::time::sleep(every).await;
            let k2 = k.clone();
            let changed = match tokio::task::spawn_blocking(move || k2.changed_topics()).await {
                Ok(Ok(changed)) => changed,
                Ok(Err(e)) => {
                    // Brokers unreachable: the reads wait and retry; so does this check.
                    tracing::warn!(error = %e, "refreshing the Kafka topics' partitions");
                    continue;
                }
                Err(_) => return,
            };
            if let Some((topic, then, now)) = changed.into_iter().next() {
                let message = format!(
                    "Kafka topic {topic:?} has {now} partitions now, {then} when this run started: restarting from the latest checkpoint to read the new partitions from their earliest offset"
                );
                tracing::warn!("{message}");
                let _ = s.fatal.send(Some(message));
                return;
            }
        }
    });
}

/// Per-output buffers of the source.
struct Outputs {
    outputs: Vec<mpsc::Sender<Msg>>,
    buffers: Vec<Vec<Record>>,
    assignment: Assignment,
}

impl Outputs {
    async fn send(
        &mut self,
        i: usize,
        msg: Msg,
        metrics: &WorkerMetrics,
    ) -> Result<(), WorkerError> {
        let tx = &self.outputs[i];
        match tx.try_send(msg) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(msg)) => {
                let t = Instant::now();
                let r = tx.send(msg).await;
                metrics
                    .backpressure_seconds
                    .inc_by(t.elapsed().as_secs_f64());
                r.map_err(|_| WorkerError::Fatal("an output channel closed".into()))
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                Err(WorkerError::Fatal("an output channel closed".into()))
            }
        }
    }

    async fn flush(&mut self, i: usize, metrics: &WorkerMetrics) -> Result<(), WorkerError> {
        if self.buffers[i].is_empty() {
            return Ok(());
        }
        let batch = std::mem::replace(&mut self.buffers[i], Vec::with_capacity(BATCH));
        self.send(i, Msg::Records(batch), metrics).await
    }

    async fn flush_all(&mut self, metrics: &WorkerMetrics) -> Result<(), WorkerError> {
        for i in 0..self.outputs.len() {
            self.flush(i, metrics).await?;
        }
        Ok(())
    }

    async fn broadcast(&mut self, msg: Msg, metrics: &WorkerMetrics) -> Result<(), WorkerError> {
        self.flush_all(metrics).await?;
        for i in 0..self.outputs.len() {
            self.send(i, msg.clone(), metrics).await?;
        }
        Ok(())
    }
}

/// How often a source sends its advancing watermark downstream.
const WATERMARK_INTERVAL: Duration = Duration::from_millis(200);

async fn source_loop(
    s: Arc<Shared>,
    compiled: Arc<CompiledJob>,
    partitions: Vec<u32>,
    restored: BTreeMap<u32, u64>,
    assignment: Assignment,
    outputs: Vec<mpsc::Sender<Msg>>,
    mut cmds: mpsc::Receiver<SourceCmd>,
) -> Result<(), WorkerError> {
    let n = outputs.len();
    let mut router = Outputs {
        outputs,
        buffers: (0..n).map(|_| Vec::with_capacity(BATCH)).collect(),
        assignment,
    };
    let maxp = assignment.max_parallelism();
    let mut pos: BTreeMap<u32, u64> = partitions
        .iter()
        .map(|p| (*p, restored.get(p).copied().unwrap_or(0)))
        .collect();
    let mut wms: BTreeMap<u32, PartitionWatermark> = partitions
        .iter()
        .map(|p| (*p, compiled.partition_watermark()))
        .collect();
    let mut finished: BTreeMap<u32, bool> = partitions.iter().map(|p| (*p, false)).collect();
    // When each partition last gave a record: one quiet for the source's idle timeout (Kafka)
    // stops holding the watermark back until its next record.
    let idle_after = compiled.idle_timeout();
    let mut last_record: BTreeMap<u32, Instant> =
        partitions.iter().map(|p| (*p, Instant::now())).collect();
    let mut commits = OffsetCommits::new(&compiled);
    let rate = match &compiled.source {
        job::SourceKind::Generator(g) => g.records_per_second(),
        job::SourceKind::File(_) => None,
        #[cfg(feature = "kafka")]
        job::SourceKind::Kafka(_) => None,
    };
    let paced_from: BTreeMap<u32, u64> = pos.clone();
    let t0 = Instant::now();
    let mut stopped = false;
    let mut last_wm = i64::MIN;
    let mut last_wm_sent = Instant::now() - WATERMARK_INTERVAL;
    let mut batch: Vec<Record> = Vec::with_capacity(BATCH);
    if partitions.is_empty() {
        // Nothing to read: never hold back the watermark downstream.
        router
            .broadcast(Msg::Watermark(i64::MAX), &s.metrics)
            .await?;
        last_wm = i64::MAX;
    }
    loop {
        // Control first: barriers go out between batches, never inside one.
        loop {
            let cmd = if stopped {
                match cmds.recv().await {
                    Some(c) => c,
                    None => return Ok(()),
                }
            } else {
                match cmds.try_recv() {
                    Ok(c) => c,
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => return Ok(()),
                }
            };
            handle_source_cmd(&s, &mut router, &pos, cmd, &mut stopped, &mut commits).await?;
        }
        if stopped {
            continue;
        }

        let mut read_any = false;
        let elapsed_ms = t0.elapsed().as_millis() as u64;
        for p in &partitions {
            if finished[p] {
                continue;
            }
            let at = pos[p];
            let mut max = BATCH;
            if let Some(r) = rate {
                let due = paced_from[p] + elapsed_ms.saturating_mul(r) / 1000;
                max = max.min(due.saturating_sub(at) as usize);
                if max == 0 {
                    continue;
                }
            }
            batch.clear();
            let b = compiled.read(*p, at, &mut batch, max)?;
            if b.finished {
                finished.insert(*p, true);
            }
            if b.records == 0 {
                continue;
            }
            read_any = true;
            last_record.insert(*p, Instant::now());
            pos.insert(*p, b.next_position);
            s.metrics.records_in.inc_by(b.records as u64);
            let mut wm = wms.get_mut(p);
            for r in batch.drain(..) {
                if let Some(w) = wm.as_mut() {
                    w.observe(r.ts);
                }
                let owner = router.assignment.owner(r.key.key_group(maxp)) as usize;
                router.buffers[owner].push(r);
                if router.buffers[owner].len() >= BATCH {
                    router.flush(owner, &s.metrics).await?;
                }
            }
        }
        router.flush_all(&s.metrics).await?;

        // Source watermark: the slowest of our partitions (finished ones do not hold back, nor
        // idle ones while another is active; all idle: the most advanced).
        let now = Instant::now();
        let wm = job::watermark::source_watermark(partitions.iter().map(|p| {
            job::watermark::PartitionProgress {
                watermark: wms[p].watermark(),
                finished: finished[p],
                idle: idle_after.is_some_and(|d| now.duration_since(last_record[p]) >= d),
            }
        }));
        // Watermarks go to every downstream subtask, so they are sent periodically (as
        // Flink's autoWatermarkInterval does), not after every batch: at parallelism n each
        // source would otherwise send n messages per batch.
        if wm > last_wm && (wm == i64::MAX || last_wm_sent.elapsed() >= WATERMARK_INTERVAL) {
            last_wm = wm;
            last_wm_sent = Instant::now();
            router.broadcast(Msg::Watermark(wm), &s.metrics).await?;
        }
        {
            let mut st = s.status.lock().await;
            st.source_positions = pos.clone();
        }
        if partitions.is_empty() {
            // No partition to read (more subtasks than partitions): only commands matter.
            match cmds.recv().await {
                Some(cmd) => {
                    handle_source_cmd(&s, &mut router, &pos, cmd, &mut stopped, &mut commits)
                        .await?
                }
                None => return Ok(()),
            }
        } else if !read_any {
            // Idle (paced, or at the end of input): wait a little or for a command.
            tokio::select! {
                c = cmds.recv() => match c {
                    Some(cmd) => {
                    handle_source_cmd(&s, &mut router, &pos, cmd, &mut stopped, &mut commits).await?
                }
                    None => return Ok(()),
                },
                _ = tokio::time::sleep(Duration::from_millis(if rate.is_some() { 5 } else { 50 })) => {}
            }
        } else {
            tokio::task::yield_now().await;
        }
    }
}

/// A Kafka source's offsets at each barrier, committed to its consumer group once the barrier's
/// snapshot has committed (the worker learns that from a later barrier's `last_committed`), for
/// lag tools only. Nothing for other sources.
struct OffsetCommits {
    #[cfg(feature = "kafka")]
    source: Option<Arc<job::kafka::source::KafkaSourceReader>>,
    #[cfg(feature = "kafka")]
    cuts: BTreeMap<u64, BTreeMap<u32, u64>>,
}

impl OffsetCommits {
    fn new(compiled: &CompiledJob) -> OffsetCommits {
        #[cfg(not(feature = "kafka"))]
        let _ = compiled;
        OffsetCommits {
            #[cfg(feature = "kafka")]
            source: match &compiled.source {
                job::SourceKind::Kafka(k) => Some(k.clone()),
                _ => None,
            },
            #[cfg(feature = "kafka")]
            cuts: BTreeMap::new(),
        }
    }

    fn on_barrier(&mut self, id: u64, last_committed: Option<u64>, pos: &BTreeMap<u32, u64>) {
        #[cfg(not(feature = "kafka"))]
        let _ = (id, last_committed, pos);
        #[cfg(feature = "kafka")]
        if let Some(k) = &self.source {
            self.cuts.insert(id, pos.clone());
            if let Some(done) = last_committed {
                if let Some(p) = self.cuts.get(&done) {
                    k.commit(p);
                }
                // Older cuts never commit after a newer one did; bound the map either way.
                self.cuts.retain(|c, _| *c > done);
            }
            while self.cuts.len() > 64 {
                self.cuts.pop_first();
            }
        }
    }
}

/// Applies a control command at a batch boundary: a barrier records the partitions' positions
/// and goes to every output (then, for stop-with-savepoint, the sources stop); resume restarts
/// stopped sources.
async fn handle_source_cmd(
    s: &Shared,
    router: &mut Outputs,
    pos: &BTreeMap<u32, u64>,
    cmd: SourceCmd,
    stopped: &mut bool,
    commits: &mut OffsetCommits,
) -> Result<(), WorkerError> {
    match cmd {
        SourceCmd::Barrier(req) => {
            let cut = BarrierCut {
                kind: req.kind,
                positions: pos.clone(),
                at: Instant::now(),
                last_committed: req.last_committed,
                stop: req.stop,
            };
            if !s.ledger.lock().await.record_cut(req.id, cut) {
                // Aborted before its barrier went out: nothing to inject (nor to stop at).
                tracing::debug!(id = req.id, "barrier of an aborted snapshot not injected");
                return Ok(());
            }
            router.broadcast(Msg::Barrier(req.id), &s.metrics).await?;
            tracing::debug!(id = req.id, "barrier injected");
            commits.on_barrier(req.id, req.last_committed, pos);
            if req.stop {
                *stopped = true;
                s.stopped.store(true, Ordering::Release);
                tracing::info!(id = req.id, "sources stopped at the savepoint barrier");
            }
        }
        SourceCmd::Resume => {
            if *stopped {
                tracing::info!("sources resumed");
            }
            *stopped = false;
        }
    }
    Ok(())
}

/// Polls the inputs that are not blocked by barrier alignment, fairly.
async fn next_input(
    inputs: &mut [mpsc::Receiver<Msg>],
    blocked: &[bool],
    start: &mut usize,
) -> Option<(usize, Option<Msg>)> {
    let n = inputs.len();
    if blocked.iter().all(|b| *b) {
        return None;
    }
    std::future::poll_fn(|cx| {
        for k in 0..n {
            let i = (*start + k) % n;
            if blocked[i] {
                continue;
            }
            if let std::task::Poll::Ready(m) = inputs[i].poll_recv(cx) {
                *start = (i + 1) % n;
                return std::task::Poll::Ready(Some((i, m)));
            }
        }
        std::task::Poll::Pending
    })
    .await
}

async fn operator_loop(
    s: Arc<Shared>,
    mut sub: Subtask,
    mut inputs: Vec<mpsc::Receiver<Msg>>,
    restored_watermark: i64,
) -> Result<(), WorkerError> {
    let n = inputs.len();
    let mut tracker = if restored_watermark > i64::MIN {
        WatermarkTracker::restored(n, restored_watermark)
    } else {
        WatermarkTracker::new(n)
    };
    let mut aborts = s.aborted.subscribe();
    let mut align = Alignment::new(n);
    let mut start = 0usize;
    let mut batches = 0u64;
    // Late records of this run's keyed operator already counted in the metric.
    let mut late_seen = 0u64;
    loop {
        // A cut still being copied takes a step between two messages; once complete, its
        // upload starts.
        if sub.capturing.is_some() && sub.agg.capture_step(CAPTURE_STEP_KEYS) {
            complete_capture(&s, &mut sub).await?;
        }
        let capturing = sub.capturing.is_some();
        // An abort of the snapshot being aligned unblocks its inputs even while the others
        // are idle; a cut still being copied goes on while they are.
        let next = tokio::select! {
            biased;
            _ = aborts.changed(), if align.aligning().is_some() => None,
            m = next_input(&mut inputs, align.blocked(), &mut start) => Some(m),
            _ = std::future::ready(()), if capturing => None,
        };
        let aborted_through = *aborts.borrow_and_update();
        if let Some(id) = align.abandon_through(aborted_through) {
            tracing::info!(id, "stopped aligning an aborted snapshot");
        }
        let Some(next) = next else {
            continue;
        };
        let Some((i, msg)) = next else {
            return Err(WorkerError::Fatal("every input is blocked".into()));
        };
        let Some(msg) = msg else {
            return Err(WorkerError::Fatal(format!(
                "input from subtask {i} closed: a peer stopped or lost its connection"
            )));
        };
        match msg {
            Msg::Records(records) => {
                sub.agg.process_batch(&records)?;
                s.metrics.records_processed.inc_by(records.len() as u64);
                batches += 1;
                if batches.is_multiple_of(64) {
                    s.metrics.keys.set(sub.agg.key_count() as i64);
                    s.metrics.count_late(sub.agg.late_records(), &mut late_seen);
                }
            }
            Msg::Watermark(wm) => {
                if let Some(new) = tracker.update(i, wm) {
                    let rows = sub.agg.advance_watermark(new);
                    s.metrics.set_watermark_ms(new);
                    emit(&s, &mut sub, &rows);
                }
            }
            Msg::Barrier(id) => match align.barrier(i, id, aborted_through) {
                Barrier::Stale => {
                    tracing::debug!(
                        id,
                        input = i,
                        "barrier of a finished or abandoned snapshot ignored"
                    );
                }
                Barrier::Accepted {
                    superseded,
                    aligned,
                } => {
                    if let Some(old) = superseded {
                        tracing::warn!(old, id, "snapshot superseded while aligning: aborted");
                        s.abort(
                            old,
                            &format!(
                                "aborted: superseded by snapshot {id} while aligning (a barrier of {old} never arrived)"
                            ),
                        )
                        .await;
                    }
                    if !aligned {
                        continue;
                    }
                    let result = snapshot(&s, &mut sub, id, tracker.current()).await;
                    let result = match result {
                        Ok(Some(Written::Uploading(u))) => {
                            sub.uploading = Some(u);
                            continue;
                        }
                        Ok(Some(Written::Capturing)) => continue,
                        Ok(Some(Written::Done(ack))) => Ok(Some(*ack)),
                        Ok(None) => Ok(None),
                        Err(e) => Err(e),
                    };
                    settle(&s, id, result).await?;
                }
            },
        }
    }
}

/// Records the outcome of snapshot `id` in the ledger (and the status); returns what was
/// written if it completed. A failure that must stop the worker is returned as the error.
async fn settle(
    s: &Shared,
    id: u64,
    result: Result<Option<SubtaskAck>, WorkerError>,
) -> Result<Option<snapshot::SubtaskSnapshot>, WorkerError> {
    let status = match result {
        Ok(Some(ack)) => {
            tracing::info!(
                id,
                bytes = ack.snapshot.file.size,
                ms = ack.duration_ms,
                blocked_ms = ?ack.blocked_ms,
                "snapshot written"
            );
            CheckpointStatus::Completed(Box::new(ack))
        }
        Ok(None) => {
            tracing::info!(id, "snapshot aborted before it was written");
            return Ok(None);
        }
        Err(e) if e.stops_the_worker() => {
            s.ledger.lock().await.finish(
                id,
                CheckpointStatus::Failed {
                    error: e.to_string(),
                },
            );
            return Err(e);
        }
        Err(e) => {
            tracing::error!(id, error = %e, "snapshot failed");
            CheckpointStatus::Failed {
                error: e.to_string(),
            }
        }
    };
    let written = match &status {
        CheckpointStatus::Completed(ack) => Some(ack.snapshot.clone()),
        _ => None,
    };
    if !s.ledger.lock().await.finish(id, status) {
        tracing::info!(
            id,
            "snapshot written after it was aborted: it stays aborted"
        );
        return Ok(None);
    }
    if written.is_some() {
        s.status.lock().await.last_checkpoint = Some(id);
    }
    Ok(written)
}

/// A snapshot written at its barrier, or still being written (an incremental checkpoint).
enum Written {
    Done(Box<SubtaskAck>),
    /// The cut is still being copied ([`Subtask::capturing`]), then uploaded.
    Capturing,
    Uploading(Uploading),
}

/// What a barrier does to the keyed operator's alignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Barrier {
    /// Of a snapshot finished, abandoned or older than the one aligned: ignored.
    Stale,
    /// Its input is blocked until every input has delivered it, or, `aligned`, every input
    /// has: take the snapshot (the inputs are unblocked). `superseded` is the lower snapshot
    /// that was being aligned and is abandoned (its inputs unblocked).
    Accepted {
        superseded: Option<u64>,
        aligned: bool,
    },
}

/// Barrier alignment of the keyed operator (pure): an input that delivered barrier `n` is not
/// read again until every input has. A barrier of a higher id arriving while `n` aligns
/// abandons `n` (Flink's checkpoint subsumption): the barriers of `n` still on their way are
/// then stale, as are barriers of ids at or below one finished here or aborted.
#[derive(Debug)]
struct Alignment {
    blocked: Vec<bool>,
    aligning: Option<u64>,
    /// The newest id aligned or abandoned here (0: none).
    settled: u64,
}

impl Alignment {
    fn new(inputs: usize) -> Self {
        Alignment {
            blocked: vec![false; inputs],
            aligning: None,
            settled: 0,
        }
    }

    fn blocked(&self) -> &[bool] {
        &self.blocked
    }

    fn aligning(&self) -> Option<u64> {
        self.aligning
    }

    fn unblock(&mut self, settled: u64) {
        self.blocked.iter_mut().for_each(|b| *b = false);
        self.aligning = None;
        self.settled = self.settled.max(settled);
    }

    /// Stops aligning a snapshot at or below `aborted_through`; returns its id if it did.
    fn abandon_through(&mut self, aborted_through: u64) -> Option<u64> {
        let id = self.aligning.filter(|a| *a <= aborted_through)?;
        self.unblock(id);
        Some(id)
    }

    /// Barrier `id` from input `i`; ids at or below `aborted_through` were abandoned.
    fn barrier(&mut self, i: usize, id: u64, aborted_through: u64) -> Barrier {
        if id <= self.settled || id <= aborted_through || self.aligning.is_some_and(|a| id < a) {
            return Barrier::Stale;
        }
        let superseded = match self.aligning {
            Some(a) if a < id => {
                self.unblock(a);
                Some(a)
            }
            _ => None,
        };
        self.aligning = Some(id);
        self.blocked[i] = true;
        let aligned = self.blocked.iter().all(|b| *b);
        if aligned {
            self.unblock(id);
        }
        Barrier::Accepted {
            superseded,
            aligned,
        }
    }
}

fn emit(s: &Shared, sub: &mut Subtask, rows: &[job::ResultRow]) {
    if rows.is_empty() {
        return;
    }
    s.metrics.records_out.inc_by(rows.len() as u64);
    #[cfg(feature = "kafka")]
    if let Some(k) = &mut sub.kafka {
        let mut lines = Vec::with_capacity(rows.len() * 48);
        for r in rows {
            job::sink::format_json_line(r, &mut lines);
        }
        k.send_lines(&lines);
        return;
    }
    if let Some(sink) = &mut sub.sink {
        sink.staging.emit(rows);
    } else if sub.sink_log {
        use std::io::Write;
        let mut lines = Vec::with_capacity(rows.len() * 48);
        for r in rows {
            job::sink::format_json_line(r, &mut lines);
        }
        // One large write (stdout is line-buffered: writing row by row makes one write(2) each).
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(&lines);
        let _ = out.flush();
    }
}

/// Where result lines drained by a cut go in the object-store sink.
#[derive(Clone, Copy, Debug)]
enum Lines {
    /// Drained at the barrier, before the snapshot seals its output: staged with the rows
    /// since the last barrier (they are output all the same when the snapshot fails: they
    /// ride with the next one).
    AtBarrier,
    /// Drained after snapshot `id`'s barrier, while its cut was copied: sealed with that
    /// snapshot's output.
    SealedWith(u64),
}

/// Result lines drained by a cut: to the at-least-once Kafka sink, or staged in the
/// object-store sink where `to` says.
fn emit_lines(sub: &mut Subtask, lines: Vec<u8>, rows: u64, to: Lines) -> Result<(), WorkerError> {
    if rows == 0 {
        return Ok(());
    }
    #[cfg(feature = "kafka")]
    if let Some(k) = &mut sub.kafka {
        k.send_lines(&lines);
        return Ok(());
    }
    if let Some(sink) = &mut sub.sink {
        match to {
            Lines::AtBarrier => sink.staging.emit_lines(lines, rows),
            Lines::SealedWith(id) => sink.staging.add_sealed(id, &lines, rows)?,
        }
    }
    Ok(())
}

/// The Kafka sink at least once: every row so far is acknowledged by the brokers before the
/// snapshot that drained it may be acknowledged. A row that could not be delivered stops the
/// worker (its snapshot must never commit past it).
fn deliver_at_least_once(sub: &mut Subtask) -> Result<(), WorkerError> {
    #[cfg(feature = "kafka")]
    if let Some(k) = &mut sub.kafka {
        k.flush()
            .map_err(|e| WorkerError::KafkaSink(e.to_string()))?;
    }
    #[cfg(not(feature = "kafka"))]
    let _ = sub;
    Ok(())
}

/// Writes snapshot `id` at its aligned barrier; `None` if it was aborted before it began
/// (nothing is written or drained then: this subtask's output rides with the next snapshot).
///
/// A snapshot holds records up only for its cut (the entries it writes copied out: the changed
/// keys' for a checkpoint that builds on the previous one ([`incremental`]), every key's
/// otherwise; the results drained and staged in memory): its upload runs in a task while
/// records flow, and it is acknowledged when the upload is durable. A snapshot waits for the
/// upload before it takes its own cut. Only a savepoint that stops the job, with nothing to
/// flow after it, is written on the spot.
async fn snapshot(
    s: &Arc<Shared>,
    sub: &mut Subtask,
    id: u64,
    watermark: i64,
) -> Result<Option<Written>, WorkerError> {
    // The snapshot before: its cut completed, its upload done.
    complete_capture(s, sub).await?;
    if let Some(u) = sub.uploading.take() {
        let written = u
            .task
            .await
            .map_err(|e| WorkerError::Fatal(format!("checkpoint upload task: {e}")))??;
        match (u.kind, written) {
            (snapshot::SnapshotKind::Savepoint, _) => {}
            (_, Some(w)) => sub
                .chain
                .written(incremental::Base::written(u.id, u.cut, &w)),
            // It failed or was aborted: the next checkpoint is full.
            (_, None) => sub.chain.reset(),
        }
    }
    let cut = {
        let mut ledger = s.ledger.lock().await;
        match ledger.take_cut(id) {
            Some(cut) => cut,
            None if ledger.is_aborted(id) => return Ok(None),
            None => {
                return Err(WorkerError::Fatal(format!(
                    "barrier {id} was not injected here"
                )));
            }
        }
    };
    let BarrierCut {
        kind,
        positions,
        at: started,
        last_committed,
        stop,
    } = cut;
    // Non-windowed results go out with each checkpoint (windowed ones when windows fire): the
    // changed keys are drained in the same pass that encodes the state (on
    // KEYSHIFT_ENCODE_THREADS threads, 1 by default), and are on stdout (log sink) or in the sink
    // buffer (object-store sink) before the ack.
    let updates = if sub.agg.config().window_size_ms.is_some() {
        Updates::Skip
    } else if sub.sink_log && sub.sink.is_none() {
        Updates::Log
    } else {
        Updates::Keep
    };
    crate::failpoints::slow_snapshot(&sub.job.0, &sub.job.1, sub.subtask, id).await;
    let dir = snapshot::snapshot_dir(&sub.job_dir, kind, id);
    let writer = SnapshotWriter::new(sub.store.clone(), &dir, sub.assignment, sub.subtask)?;
    let base = match kind {
        snapshot::SnapshotKind::Checkpoint => sub.chain.base_for(last_committed).cloned(),
        // Savepoints are self-contained.
        snapshot::SnapshotKind::Savepoint => None,
    };
    let cut_epoch = sub.agg.cut();
    // Records flow while the state is written, except after a stop snapshot without a base
    // (a savepoint that stops the job): nothing flows after it, so it is encoded and written
    // on the spot, on the encoder threads, without copying the state first.
    if base.is_some() || !stop {
        let policy = sub.chain.policy.for_checkpoint(stop);
        // A delta's changed keys are copied after the barrier while records flow, except for
        // a stop snapshot (nothing flows after it).
        let mut taken = checkpoint::take_cut(&mut sub.agg, base.as_ref(), updates, !stop).await;
        s.metrics.records_out.inc_by(taken.rows);
        emit_lines(
            sub,
            std::mem::take(&mut taken.lines),
            taken.rows,
            Lines::AtBarrier,
        )?;
        // The rows since the last barrier are this snapshot's: sealed now, before any record
        // after the barrier can emit more (a cut still being copied adds its own later).
        if let Some(sink) = &mut sub.sink {
            sink.staging
                .seal(id, job::sink::Committed::from_wire(last_committed))?;
        }
        let cut = CutTaken {
            id,
            kind,
            cut_epoch,
            positions,
            started,
            blocked_ms: started.elapsed().as_millis() as u64,
            watermark,
            writer,
            dir,
            base,
            policy,
            taken,
        };
        tracing::debug!(
            id,
            base = cut.base.as_ref().map(|b| b.id),
            entries = cut.taken.entries(),
            capturing = cut.taken.capturing,
            blocked_ms = cut.blocked_ms,
            "snapshot cut taken"
        );
        if cut.taken.capturing {
            sub.capturing = Some(cut);
            return Ok(Some(Written::Capturing));
        }
        return complete_cut(s, sub, cut)
            .await
            .map(|u| Some(Written::Uploading(u)));
    }
    let opts = StateWriteOptions {
        threads: StateWriteOptions::threads_for(sub.agg.key_count()),
        updates,
    };
    let written = match checkpoint::write_state(&mut sub.agg, writer, opts).await {
        Ok(w) => w,
        Err(failed) => {
            // The drained rows are output all the same: they ride with the next snapshot.
            s.metrics.records_out.inc_by(failed.rows);
            emit_lines(sub, failed.lines, failed.rows, Lines::AtBarrier)?;
            return Err(failed.error.into());
        }
    };
    s.metrics.records_out.inc_by(written.rows);
    emit_lines(sub, written.lines, written.rows, Lines::AtBarrier)?;
    deliver_at_least_once(sub)?;
    // Every result since the job's last committed snapshot is staged for this one (results
    // staged for snapshots that did not commit ride along); the coordinator publishes them once
    // this snapshot is committed (exactly once). If staging fails, the snapshot fails, and they
    // ride with the next one.
    if let Some(sink) = &mut sub.sink {
        let output = sink
            .staging
            .on_barrier(id, job::sink::Committed::from_wire(last_committed))?;
        stage_output(sink.store.as_ref(), &sink.base, id, &output).await?;
    }
    let keys_per_group = written.keys_per_group;
    let snapshot = written.snapshot;
    if kind == snapshot::SnapshotKind::Checkpoint {
        sub.chain
            .written(incremental::Base::written(id, cut_epoch, &snapshot));
    }
    let duration_ms = started.elapsed().as_millis() as u64;
    s.metrics
        .checkpoint_seconds
        .set(started.elapsed().as_secs_f64());
    s.metrics.checkpoint_bytes.set(snapshot.file.size as i64);
    s.metrics.keys.set(sub.agg.key_count() as i64);
    s.status.lock().await.keys_per_group = keys_per_group;
    Ok(Some(Written::Done(Box::new(SubtaskAck {
        snapshot,
        source_positions: positions,
        source_partitions: sub.source_partitions.clone(),
        watermark,
        duration_ms,
        blocked_ms: Some(duration_ms),
    }))))
}

/// A snapshot whose cut was taken at its barrier: what it needs to complete its cut and
/// upload it.
struct CutTaken {
    id: u64,
    kind: snapshot::SnapshotKind,
    cut_epoch: u32,
    positions: BTreeMap<u32, u64>,
    started: Instant,
    blocked_ms: u64,
    watermark: i64,
    writer: SnapshotWriter,
    dir: StorePath,
    base: Option<incremental::Base>,
    policy: incremental::ChainPolicy,
    taken: checkpoint::Cut,
}

/// Keys a step of a cut still being copied copies between two batches
/// ([`job::KeyedAggregator::capture_step`]): a fraction of a millisecond.
pub const CAPTURE_STEP_KEYS: usize = 512;

/// Completes a snapshot's cut (the deltas still being copied, and their results: sealed with
/// the snapshot's output, sent to Kafka or written to stdout), delivers an at-least-once Kafka
/// sink's rows, and starts the upload of the state and the sink output, which acknowledges
/// the snapshot once durable.
async fn complete_cut(
    s: &Arc<Shared>,
    sub: &mut Subtask,
    mut cut: CutTaken,
) -> Result<Uploading, WorkerError> {
    let id = cut.id;
    let (late, rows) = checkpoint::finish_cut(&mut sub.agg, &mut cut.taken).await;
    s.metrics.records_out.inc_by(rows);
    emit_lines(sub, late, rows, Lines::SealedWith(id))?;
    deliver_at_least_once(sub)?;
    let output = sub.sink.as_ref().map(|sink| {
        (
            sink.store.clone(),
            sink.base.clone(),
            sink.staging.output(id),
        )
    });
    s.metrics.keys.set(sub.agg.key_count() as i64);
    s.status.lock().await.keys_per_group = cut.taken.keys_per_group();
    let CutTaken {
        id,
        kind,
        cut_epoch,
        positions,
        started,
        blocked_ms,
        watermark,
        writer,
        dir,
        base,
        policy,
        taken,
    } = cut;
    let groups = taken.groups;
    let source_partitions = sub.source_partitions.clone();
    let shared = s.clone();
    let store = sub.store.clone();
    let task = tokio::spawn(async move {
        let result: Result<Option<SubtaskAck>, WorkerError> = async {
            let snapshot =
                checkpoint::upload_cut(groups, writer, base.as_ref(), policy, store.as_ref(), &dir)
                    .await?;
            if let Some((store, sink_base, output)) = &output {
                stage_output(store.as_ref(), sink_base, id, output).await?;
            }
            let duration = started.elapsed();
            shared
                .metrics
                .checkpoint_seconds
                .set(duration.as_secs_f64());
            shared
                .metrics
                .checkpoint_bytes
                .set(snapshot.file.size as i64);
            Ok(Some(SubtaskAck {
                snapshot,
                source_positions: positions,
                source_partitions,
                watermark,
                duration_ms: duration.as_millis() as u64,
                blocked_ms: Some(blocked_ms),
            }))
        }
        .await;
        settle(&shared, id, result).await
    });
    Ok(Uploading {
        id,
        kind,
        cut: cut_epoch,
        task,
    })
}

/// Completes the cut still being copied, if any, and starts its upload; a failure settles
/// its snapshot (and is returned if it must stop the worker).
async fn complete_capture(s: &Arc<Shared>, sub: &mut Subtask) -> Result<(), WorkerError> {
    let Some(cut) = sub.capturing.take() else {
        return Ok(());
    };
    let id = cut.id;
    match complete_cut(s, sub, cut).await {
        Ok(u) => sub.uploading = Some(u),
        Err(e) => {
            settle(s, id, Err(e)).await?;
        }
    }
    Ok(())
}

/// Stages a snapshot's sink output (see [`crate::sink::stage`]).
async fn stage_output(
    store: &dyn ObjectStore,
    base: &StorePath,
    id: u64,
    output: &job::Output,
) -> Result<(), WorkerError> {
    let path = crate::sink::stage(store, base, output).await?;
    tracing::debug!(
        id,
        %path,
        rows = output.rows,
        bytes = output.len(),
        carried = ?output.carried,
        "sink output staged"
    );
    if !output.carried.is_empty() {
        tracing::info!(
            id,
            carried = ?output.carried,
            rows = output.rows,
            "sink output of snapshots that did not commit staged again with this one"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accepted(superseded: Option<u64>, aligned: bool) -> Barrier {
        Barrier::Accepted {
            superseded,
            aligned,
        }
    }

    #[test]
    fn a_barrier_aligns_once_every_input_delivered_it() {
        let mut a = Alignment::new(3);
        assert_eq!(a.barrier(0, 1, 0), accepted(None, false));
        assert_eq!(a.blocked(), [true, false, false]);
        assert_eq!(a.barrier(2, 1, 0), accepted(None, false));
        assert_eq!(a.barrier(1, 1, 0), accepted(None, true));
        assert_eq!((a.blocked(), a.aligning()), (&[false; 3][..], None));
        // Its barriers are done with: a late copy is stale.
        assert_eq!(a.barrier(0, 1, 0), Barrier::Stale);
    }

    /// The trigger of 5 reached only the source of input 0: 6 supersedes 5, unblocks input 0,
    /// and aligns on its own; 5's barriers still on their way are ignored.
    #[test]
    fn a_higher_barrier_supersedes_the_one_aligning() {
        let mut a = Alignment::new(3);
        assert_eq!(a.barrier(0, 5, 0), accepted(None, false));
        assert_eq!(a.barrier(1, 6, 0), accepted(Some(5), false));
        assert_eq!(a.blocked(), [false, true, false]);
        assert_eq!(a.aligning(), Some(6));
        assert_eq!(
            a.barrier(2, 5, 0),
            Barrier::Stale,
            "older than the one aligning"
        );
        assert_eq!(a.barrier(0, 6, 0), accepted(None, false));
        assert_eq!(a.barrier(2, 6, 0), accepted(None, true));
        assert_eq!(a.barrier(2, 5, 0), Barrier::Stale, "superseded");
        assert_eq!(a.barrier(0, 7, 0), accepted(None, false));
    }

    #[test]
    fn an_abort_unblocks_the_inputs_and_its_barriers_are_stale() {
        let mut a = Alignment::new(2);
        assert_eq!(a.barrier(0, 3, 0), accepted(None, false));
        assert_eq!(a.abandon_through(2), None, "an older abort changes nothing");
        assert_eq!(a.abandon_through(3), Some(3));
        assert_eq!((a.blocked(), a.aligning()), (&[false; 2][..], None));
        assert_eq!(a.barrier(1, 3, 3), Barrier::Stale);
        // Aborted before any of its barriers arrived: never aligned.
        assert_eq!(a.barrier(0, 4, 4), Barrier::Stale);
        assert_eq!(a.barrier(0, 5, 4), accepted(None, false));
        assert_eq!(a.barrier(1, 5, 4), accepted(None, true));
    }
}
