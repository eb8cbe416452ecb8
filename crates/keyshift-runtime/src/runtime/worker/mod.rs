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
//!
//! One module per role: this one holds the process (binding, the router, the state its tasks
//! share); `control` the control API's handlers; `start` the start and pre-stage requests and the
//! restore they run; `source` the source task; `operator` the keyed operator task; `barrier`
//! barrier alignment; `cut` the snapshot cut. Each role module works on the shared types here
//! (`use super::*`).

use super::checkpoint::{self, StateWriteOptions, Updates};
use super::incremental;
use super::ledger::{BarrierCut, Ledger, Trigger};
use super::metrics::WorkerMetrics;
use super::prestage;
use super::protocol::*;
use super::restore::{self, RestoreOptions};
use super::shuffle::{self, BATCH, CHANNEL_BATCHES, Msg};
use crate::job::WatermarkTracker;
use crate::job::{self, CompiledJob, JobOptions, Keyed, PartitionWatermark, Programs, Record};
use crate::snapshot::{self, ObjectStore, Path as StorePath, SnapshotWriter};
use axum::extract::{Path, Query, State};
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

mod barrier;
mod control;
mod cut;
mod operator;
mod source;
mod start;

use self::barrier::*;
use self::control::*;
pub use self::cut::CAPTURE_STEP_KEYS;
use self::cut::*;
use self::operator::*;
use self::source::*;
use self::start::*;

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
    /// Whether a refused start request can never succeed as it stands (a bad request, a spec
    /// the worker cannot run, a snapshot of another key-group count or schema): answered 422,
    /// which the coordinator reports as a refusal no retry cures. Anything else (storage or a
    /// broker not reachable) is answered 503 and retried.
    pub fn refuses_for_good(&self) -> bool {
        match self {
            WorkerError::BadStart(_) => true,
            WorkerError::Job(j) => j.refuses_for_good(),
            // Found while restoring: the snapshot's state does not fit the job's program.
            WorkerError::Restore(r) => r.refuses_the_job(),
            _ => false,
        }
    }

    /// Whether the snapshot a start restores cannot be restored (a state file lost or
    /// truncated, a block that does not match its checksum, a chain that does not merge, a
    /// manifest that cannot be used): no retry from the same snapshot can succeed, an older one
    /// may ([`WorkerStatus::last_start_unrestorable`]).
    pub fn snapshot_unrestorable(&self) -> bool {
        match self {
            WorkerError::Snapshot(e) | WorkerError::Restore(restore::RestoreError::Snapshot(e)) => {
                e.is_unrestorable()
            }
            _ => false,
        }
    }

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
    /// The programs this worker binary carries (`spec.job.program`).
    pub programs: Programs,
}

struct Shared {
    token: String,
    programs: Programs,
    data_listener: Mutex<Option<TcpListener>>,
    started: AtomicBool,
    ready: AtomicBool,
    stopped: AtomicBool,
    run: Mutex<Option<RunHandle>>,
    /// Every snapshot's status, and what the source recorded at each barrier (picked up by the
    /// operator); bounded.
    ledger: Mutex<Ledger>,
    /// Wakes the long polls of `GET /v1/checkpoints/{id}?waitMs=N` whenever a snapshot's status
    /// in the ledger changes.
    ledger_changed: tokio::sync::Notify,
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
    keyed: Keyed,
    /// The loaded checkpoint's manifest.
    manifest: snapshot::Manifest,
    /// The compiled job of a generator source, its key table built (the start uses it instead
    /// of building the table while the job waits for its first record).
    compiled: Option<CompiledJob>,
}

impl Shared {
    /// Stops the worker with `reason`, unless a failure was reported already: the first one is
    /// the cause; what fails after it (a closed channel, a peer gone) is its consequence.
    fn fail(&self, reason: impl Into<String>) {
        let reason = reason.into();
        self.fatal.send_if_modified(|f| match f {
            None => {
                *f = Some(reason);
                true
            }
            Some(_) => false,
        });
    }

    /// Records how snapshot `id` ended (see [`Ledger::finish`]) and wakes the long polls of its
    /// status. False when it had been aborted meanwhile (it stays aborted).
    async fn finish(&self, id: u64, status: CheckpointStatus) -> bool {
        let finished = self.ledger.lock().await.finish(id, status);
        self.ledger_changed.notify_waiters();
        finished
    }

    /// Aborts snapshot `id` (and the pending ones below it) in the ledger and tells the keyed
    /// operator.
    async fn abort(&self, id: u64, reason: &str) -> CheckpointStatus {
        let (through, status) = {
            let mut ledger = self.ledger.lock().await;
            let through = ledger.abort(id, reason);
            (through, ledger.status(id))
        };
        self.ledger_changed.notify_waiters();
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
    programs: Programs,
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
        programs: config.programs,
        control_addr,
        data_addr,
    })
}

impl WorkerConfig {
    /// A worker's configuration; refused if the token is shorter than 16 characters.
    pub fn new(
        control_addr: SocketAddr,
        data_addr: SocketAddr,
        token: String,
        programs: Programs,
    ) -> Result<Self, WorkerError> {
        if token.len() < 16 {
            return Err(WorkerError::BadStart(
                "KEYSHIFT_TOKEN must hold at least 16 characters".into(),
            ));
        }
        Ok(WorkerConfig {
            control_addr,
            data_addr,
            token,
            programs,
        })
    }
}

/// The arguments of a worker process, as `keyshift local` and the operator start one:
/// `worker --control-addr ADDR --data-addr ADDR` (each address defaults to `0.0.0.0:9090` and
/// `0.0.0.0:9091`), the control API's token in `KEYSHIFT_TOKEN` (at least 16 characters).
/// `programs`: what the binary carries. Pure: [`main`] reads them from the process.
pub fn worker_config(
    args: &[String],
    token: Option<String>,
    programs: Programs,
) -> Result<WorkerConfig, WorkerError> {
    let bad = |m: String| WorkerError::BadStart(m);
    let mut rest = args.iter();
    if rest.next().map(String::as_str) != Some("worker") {
        return Err(bad(format!(
            "usage: worker --control-addr ADDR --data-addr ADDR (KEYSHIFT_TOKEN in the environment); got {args:?}"
        )));
    }
    let default = |port: u16| SocketAddr::from(([0, 0, 0, 0], port));
    let (mut control_addr, mut data_addr) = (default(9090), default(9091));
    while let Some(flag) = rest.next() {
        let (name, inline) = match flag.split_once('=') {
            Some((n, v)) => (n, Some(v.to_owned())),
            None => (flag.as_str(), None),
        };
        let value = match inline.or_else(|| rest.next().cloned()) {
            Some(v) => v,
            None => return Err(bad(format!("{name} needs a value"))),
        };
        let addr = || {
            value
                .parse::<SocketAddr>()
                .map_err(|e| bad(format!("{name} {value:?}: {e}")))
        };
        match name {
            "--control-addr" => control_addr = addr()?,
            "--data-addr" => data_addr = addr()?,
            other => {
                return Err(bad(format!(
                    "unknown argument {other:?}: a worker takes --control-addr and --data-addr"
                )));
            }
        }
    }
    WorkerConfig::new(control_addr, data_addr, token.unwrap_or_default(), programs)
}

/// What a job binary's `--version` prints: the runtime it was built with, the worker protocol
/// it speaks, and the programs it carries (the names `spec.job.program.name` may give).
pub fn version_line(programs: &Programs) -> String {
    format!(
        "keyshift-runtime {} (worker protocol {}); programs: {}",
        env!("CARGO_PKG_VERSION"),
        super::protocol::PROTOCOL_VERSION,
        programs.names().join(", ")
    )
}

/// The `main` of a job's own worker binary: serves as `keyshift worker` does ([`worker_config`]
/// reads the process's arguments and `KEYSHIFT_TOKEN`), running `programs`, with logs on stderr
/// (JSON lines when `KEYSHIFT_LOG_FORMAT=json`); `--version` prints [`version_line`]. Returns
/// the process's exit code.
pub fn main(programs: Programs) -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--version") {
        println!("{}", version_line(&programs));
        return std::process::ExitCode::SUCCESS;
    }
    let json = std::env::var(keyshift_core::worker_pod::ENV_LOG_FORMAT)
        .is_ok_and(|f| f.eq_ignore_ascii_case("json"));
    crate::telemetry::init(json);
    let result =
        worker_config(&args, std::env::var("KEYSHIFT_TOKEN").ok(), programs).and_then(|config| {
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .map_err(|e| WorkerError::Fatal(format!("starting the async runtime: {e}")))?
                .block_on(run(config))
        });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "worker failed");
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
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
            programs,
            control_addr,
            data_addr,
        } = self;
        tracing::info!(%control_addr, %data_addr, "worker listening");
        let (fatal, mut fatal_rx) = watch::channel(None);
        let shared = Arc::new(Shared {
            token,
            programs,
            data_listener: Mutex::new(Some(data)),
            started: AtomicBool::new(false),
            ready: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            run: Mutex::new(None),
            ledger: Mutex::new(Ledger::new()),
            ledger_changed: tokio::sync::Notify::new(),
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

/// Everything the operator task of a running subtask owns.
struct Subtask {
    /// The job's namespace and name.
    job: (String, String),
    subtask: u32,
    assignment: Assignment,
    keyed: Keyed,
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
/// last committed snapshot, see [`job::staging`]).
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
    keyed: Keyed,
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
    /// Until when the data plane waits for the peers' connections: the request's start window
    /// ([`StartRequest::start_window`]) from its receipt, whatever this subtask's own restore
    /// takes.
    connect_by: tokio::time::Instant,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| (*s).to_owned()).collect()
    }

    const TOKEN: &str = "0123456789abcdef";

    #[test]
    fn a_start_is_refused_for_good_only_when_no_retry_can_help() {
        let for_good = [
            WorkerError::BadStart("snapshot of another schema".into()),
            WorkerError::Job(job::JobError::UnknownProgram {
                name: "nope".into(),
                available: "count".into(),
            }),
            WorkerError::Job(job::JobError::FileSourceLocation {
                path: "ftp://b/in".into(),
                reason: "unsupported scheme".into(),
            }),
        ];
        let for_now = [
            WorkerError::Job(job::JobError::File(job::FileSourceError::NoFiles {
                path: "/in".into(),
            })),
            WorkerError::Snapshot(snapshot::SnapshotError::ManifestMissing {
                path: "chk-3/_manifest.json".into(),
            }),
            WorkerError::Fatal("the data listener is gone".into()),
        ];
        for e in &for_good {
            assert!(e.refuses_for_good(), "{e}");
            assert_eq!(start::refusal_status(e), StatusCode::UNPROCESSABLE_ENTITY);
        }
        for e in &for_now {
            assert!(!e.refuses_for_good(), "{e}");
            assert_eq!(start::refusal_status(e), StatusCode::SERVICE_UNAVAILABLE);
        }
    }

    #[test]
    fn a_job_binary_takes_the_arguments_keyshift_starts_a_worker_with() {
        let c = worker_config(
            &args(&[
                "worker",
                "--control-addr",
                "127.0.0.1:0",
                "--data-addr=10.0.0.7:9091",
            ]),
            Some(TOKEN.into()),
            Programs::new(),
        )
        .unwrap();
        assert_eq!(c.control_addr, "127.0.0.1:0".parse().unwrap());
        assert_eq!(c.data_addr, "10.0.0.7:9091".parse().unwrap());
        assert_eq!(c.token, TOKEN);
        let d = worker_config(&args(&["worker"]), Some(TOKEN.into()), Programs::new()).unwrap();
        assert_eq!(d.control_addr, "0.0.0.0:9090".parse().unwrap());
        assert_eq!(d.data_addr, "0.0.0.0:9091".parse().unwrap());
    }

    #[test]
    fn bad_arguments_and_a_short_token_are_refused_by_name() {
        let refused = |a: &[&str], token: Option<&str>| {
            worker_config(&args(a), token.map(str::to_owned), Programs::new())
                .unwrap_err()
                .to_string()
        };
        assert!(refused(&[], Some(TOKEN)).contains("usage: worker"));
        assert!(refused(&["serve"], Some(TOKEN)).contains("usage: worker"));
        assert!(refused(&["worker", "--control-addr"], Some(TOKEN)).contains("needs a value"));
        assert!(
            refused(&["worker", "--data-addr", "nowhere"], Some(TOKEN)).contains("\"nowhere\"")
        );
        assert!(refused(&["worker", "--threads", "4"], Some(TOKEN)).contains("\"--threads\""));
        assert!(refused(&["worker"], Some("short")).contains("16 characters"));
        assert!(refused(&["worker"], None).contains("16 characters"));
    }

    #[test]
    fn the_version_line_names_the_protocol_and_the_programs() {
        let line = version_line(&Programs::new());
        assert!(
            line.contains(&format!(
                "worker protocol {}",
                crate::runtime::protocol::PROTOCOL_VERSION
            )),
            "{line}"
        );
        assert!(line.starts_with("keyshift-runtime "), "{line}");
    }
}
