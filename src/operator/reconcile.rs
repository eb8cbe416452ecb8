//! The I/O shell of the operator: watches, reads pods and workers, executes one decided action
//! per pass, writes status and Events.

use super::decide::{self, Action, ActiveRun, ObservedPod, PodPhase, Restore};
use super::desired::{self, LABEL_JOB, LABEL_PARALLELISM, LABEL_RUN, LABEL_SUBTASK, MANAGER};
use super::metrics::{KindLabels, OperatorMetrics, StepLabels};
use super::status::{self, Progress};
use crate::coordinator::{self, Completed, Coordinator, CoordinatorError, WorkerEndpoint};
use crate::crd::{Phase, RescaleStatus, SnapshotRef, StreamJob, StreamJobSpec, StreamJobStatus};
use crate::keygroup::{self, Assignment};
use crate::orchestrator::run;
use crate::orchestrator::step::{self, Outcome, Step};
use crate::runtime::protocol::{StartResponse, WorkerState, WorkerStatus};
use crate::snapshot::{self, JobIdentity, SnapshotKind};
use crate::validation;
use chrono::{DateTime, Utc};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action as Requeue, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::finalizer::{Event as FinalizerEvent, finalizer};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Settings of `keyshift operator`.
#[derive(Debug, Clone)]
pub struct OperatorConfig {
    /// Namespaces to watch; empty means all.
    pub namespaces: Vec<String>,
    /// Storage URL for jobs without spec.state.storage.
    pub default_storage: Option<String>,
    /// Where `/metrics`, `/healthz` and `/readyz` are served.
    pub metrics_addr: SocketAddr,
    /// Worker image for jobs without spec.image.
    pub worker_image: String,
    /// Reconcile passes that may run at once per controller (0: unbounded).
    pub max_concurrent_reconciles: u16,
    /// Leader election (None: this process reconciles unconditionally).
    pub leader: Option<crate::leader::LeaderConfig>,
}

/// Operator failures (a failed pass is retried with backoff).
#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("kubernetes client configuration (kubeconfig or in-cluster): {0}")]
    ClientConfig(#[from] kube::config::InferConfigError),
    #[error(transparent)]
    Desired(#[from] desired::DesiredError),
    #[error(transparent)]
    Coordinator(#[from] CoordinatorError),
    #[error(transparent)]
    Snapshot(#[from] snapshot::SnapshotError),
    #[error(transparent)]
    Bounds(#[from] keygroup::BoundsError),
    #[error("finalizer: {0}")]
    Finalizer(String),
    #[error("metrics server on {addr}: {source}")]
    Metrics {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("rescale state machine: {0}")]
    Transition(String),
    #[error("the control-token Secret {0} has no usable token")]
    Token(String),
    #[error(transparent)]
    Leader(#[from] crate::leader::LeaderError),
}

/// The run the operator coordinates for a job.
struct RunHandle {
    run: String,
    parallelism: u32,
    coordinator: Coordinator,
    started: DateTime<Utc>,
}

/// What the operator remembers about a job between passes (lost on restart by design: status
/// and the pods carry everything needed to resume).
#[derive(Default)]
struct JobMemory {
    run: Option<RunHandle>,
    failures: u32,
    backoff_until: Option<DateTime<Utc>>,
    last_failure: Option<(String, String)>,
    step_started: Option<(Step, Instant)>,
    /// The key-group count of a spec.restoreFrom snapshot, by URL (read once: committed
    /// manifests never change).
    restore_source: Option<(String, u32)>,
    /// The resourceVersion of the StreamJob as this process last wrote it (the finalizer patch
    /// or a status write). A pass handed exactly that object by the watch cache acts on it
    /// without reading the job again: it holds every step this process recorded.
    written_version: Option<String>,
    /// The control token, as read from or written to the job's Secret. Read again before pods
    /// are created, so a deleted Secret is recreated before a pod needs it.
    token: Option<String>,
    /// The step running in the background, if any.
    background: Option<Background>,
    /// The resourceVersion of this process's last write to one of the job's pods (create or
    /// delete). Its pods are listed "not older than" it: from the API server's watch cache, which
    /// is then known to hold that write, instead of a consistent read that waits for the cache
    /// to catch up with etcd (60-80 ms).
    pods_version: Option<String>,
}

type SharedMemory = Arc<tokio::sync::Mutex<JobMemory>>;

/// How often a job whose background step runs is looked at anyway (the step's end wakes it at
/// once through the controller's `reconcile_on` trigger; this only backs that up).
const BACKGROUND_BACKSTOP: Duration = Duration::from_secs(1);

/// A long step that runs outside the reconcile pass, so that it holds no reconcile slot: a
/// checkpoint stuck on a storage outage (up to its timeout) then delays its own job only, not
/// every job behind it in the controller's queue. While it runs, passes of its job do nothing;
/// the pass after it ended records its outcome.
struct Background {
    work: BackgroundWork,
    rx: tokio::sync::oneshot::Receiver<Ended>,
    /// Once ended: its outcome (`None`: the task panicked and the run's coordinator is lost).
    ended: Option<Option<Ended>>,
}

#[derive(Debug, Clone)]
enum BackgroundWork {
    Checkpoint {
        parallelism: u32,
    },
    /// The savepoint of a rescale, upgrade or suspend (stops the sources).
    Savepoint {
        parallelism: u32,
    },
    /// A savepoint for spec.savepointTriggerNonce (the job keeps running).
    TriggeredSavepoint {
        parallelism: u32,
        nonce: i64,
    },
    Verify {
        url: String,
    },
    /// Starting a run: the workers restore their key groups, then connect.
    Start(Box<StartWork>),
}

/// A run being started, and what recording its start needs.
#[derive(Debug, Clone)]
struct StartWork {
    run: String,
    parallelism: u32,
    /// The key-group count it runs under.
    groups: u32,
    restore_from: Option<String>,
    /// spec.restoreFrom (or a restore transition's source) when the run restores it.
    restored_source: Option<String>,
    run_started: DateTime<Utc>,
    started: Instant,
}

enum Ended {
    Snapshot(Box<(RunHandle, Result<Completed, CoordinatorError>)>),
    Verify(Result<snapshot::VerifyReport, String>),
    Start(Box<(Coordinator, Result<Vec<StartResponse>, String>)>),
}

impl Background {
    /// Whether it still runs; once it ended, its outcome is kept for the next pass.
    fn running(&mut self) -> bool {
        if self.ended.is_some() {
            return false;
        }
        match self.rx.try_recv() {
            Ok(outcome) => self.ended = Some(Some(outcome)),
            Err(tokio::sync::oneshot::error::TryRecvError::Empty) => return true,
            Err(tokio::sync::oneshot::error::TryRecvError::Closed) => self.ended = Some(None),
        }
        false
    }
}

/// An Event recorded during a pass; published at its end, beside the status write.
struct PendingEvent {
    warning: bool,
    reason: String,
    note: String,
}

/// Shared state of the controller.
pub struct Context {
    client: Client,
    config: OperatorConfig,
    metrics: Arc<OperatorMetrics>,
    http: reqwest::Client,
    recorder: Recorder,
    jobs: std::sync::Mutex<HashMap<(String, String), SharedMemory>>,
    /// Per controller (its namespace, or `None` for all): wakes a job whose background step
    /// ended.
    wakers: std::sync::Mutex<Vec<(Option<String>, Waker)>>,
}

type Waker = futures::channel::mpsc::UnboundedSender<ObjectRef<StreamJob>>;

impl Context {
    pub fn new(client: Client, config: OperatorConfig, metrics: Arc<OperatorMetrics>) -> Self {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(3))
            .build()
            .unwrap_or_default();
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: MANAGER.into(),
                instance: std::env::var("POD_NAME").ok(),
            },
        );
        Context {
            client,
            config,
            metrics,
            http,
            recorder,
            jobs: std::sync::Mutex::new(HashMap::new()),
            wakers: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// The waker of the controller that reconciles jobs of `ns`.
    fn waker(&self, ns: &str) -> Option<Waker> {
        let wakers = self.wakers.lock().unwrap_or_else(|p| p.into_inner());
        wakers
            .iter()
            .find(|(scope, _)| scope.as_deref().is_none_or(|s| s == ns))
            .map(|(_, w)| w.clone())
    }

    /// Whether the job's background step still runs.
    async fn background_running(&self, ns: &str, name: &str) -> bool {
        let memory = self.memory(ns, name);
        let mut mem = memory.lock().await;
        mem.background.as_mut().is_some_and(Background::running)
    }

    fn memory(&self, ns: &str, name: &str) -> Arc<tokio::sync::Mutex<JobMemory>> {
        let mut jobs = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        jobs.entry((ns.to_owned(), name.to_owned()))
            .or_default()
            .clone()
    }

    fn forget(&self, ns: &str, name: &str) {
        let mut jobs = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        jobs.remove(&(ns.to_owned(), name.to_owned()));
    }

    async fn event(&self, job: &StreamJob, warning: bool, reason: &str, note: String) {
        let ev = Event {
            type_: if warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: reason.into(),
            note: Some(note.chars().take(1000).collect()),
            action: reason.into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &job.object_ref(&())).await {
            tracing::warn!(error = %e, reason, "publishing an Event failed");
        }
    }

    /// A pass's Events, in the order they were recorded.
    async fn publish(&self, job: &StreamJob, events: Vec<PendingEvent>) {
        for e in events {
            self.event(job, e.warning, &e.reason, e.note).await;
        }
    }
}

/// Runs the operator until SIGTERM/Ctrl-C.
pub async fn run(config: OperatorConfig) -> Result<(), OperatorError> {
    crate::telemetry::install_crypto_provider();
    let client = Client::try_from(client_config(kube::Config::infer().await?))?;
    let metrics = Arc::new(OperatorMetrics::new());
    let addr = config.metrics_addr;
    let server = tokio::spawn(super::metrics::serve(addr, metrics.clone()));
    // Leader election (`src/leader.rs`): `run_controllers` runs only while this replica holds
    // the Lease; losing it ends `run` with an error, so the process exits and its Deployment
    // restarts it as a fresh candidate.
    let leader = config.leader.clone();
    let ctx = Arc::new(Context::new(client.clone(), config, metrics));
    let result = match leader {
        None => run_controllers(ctx).await,
        Some(leader) => {
            // A standby is healthy and ready too (readiness must not depend on leadership, or a
            // rolling update of two replicas never completes).
            ctx.metrics
                .ready
                .store(true, std::sync::atomic::Ordering::Relaxed);
            match crate::leader::run_while_leading(
                client,
                leader,
                crate::leader::shutdown_signal(),
                || run_controllers(ctx),
            )
            .await
            {
                Ok(crate::leader::Led::Finished(r)) => r,
                Ok(crate::leader::Led::ShutDownWhileStandingBy) => Ok(()),
                Err(e) => Err(e.into()),
            }
        }
    };
    server.abort();
    if let Ok(Ok(Err(source))) = tokio::time::timeout(Duration::from_millis(10), server).await {
        return Err(OperatorError::Metrics { addr, source });
    }
    result
}

/// Server-side timeout of the controller's watches: the API server ends each watch after this
/// long and the watcher starts the next one.
const WATCH_TIMEOUT_SECS: u32 = 50;

/// Longest silence on an API server connection before its request fails (and is retried).
/// kube's default, 295 s, is there to outlast its watches' default 290 s; with the watches ended
/// after [`WATCH_TIMEOUT_SECS`], a connection left hanging by a network partition fails a pass
/// or a watch within a minute instead of five.
const API_READ_TIMEOUT: Duration = Duration::from_secs(60);

fn client_config(mut config: kube::Config) -> kube::Config {
    config.read_timeout = Some(API_READ_TIMEOUT);
    config
}

fn watch_config() -> watcher::Config {
    watcher::Config::default().timeout(WATCH_TIMEOUT_SECS)
}

/// One controller per watched namespace (or one for all), until shutdown.
pub async fn run_controllers(ctx: Arc<Context>) -> Result<(), OperatorError> {
    let scopes: Vec<Option<String>> = if ctx.config.namespaces.is_empty() {
        vec![None]
    } else {
        ctx.config.namespaces.iter().cloned().map(Some).collect()
    };
    tracing::info!(
        namespaces = ?ctx.config.namespaces,
        storage = ?ctx.config.default_storage,
        image = %ctx.config.worker_image,
        "keyshift operator starting"
    );
    let controllers = scopes.into_iter().map(|ns| {
        let (jobs, pods): (Api<StreamJob>, Api<Pod>) = match &ns {
            Some(ns) => (
                Api::namespaced(ctx.client.clone(), ns),
                Api::namespaced(ctx.client.clone(), ns),
            ),
            None => (Api::all(ctx.client.clone()), Api::all(ctx.client.clone())),
        };
        let ctx = ctx.clone();
        let (waker, woken) = futures::channel::mpsc::unbounded();
        ctx.wakers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((ns.clone(), waker));
        async move {
            ctx.metrics
                .ready
                .store(true, std::sync::atomic::Ordering::Relaxed);
            Controller::new(jobs, watch_config())
                .owns(pods, watch_config().labels(LABEL_JOB))
                .reconcile_on(woken)
                .with_config(
                    kube::runtime::controller::Config::default()
                        .concurrency(ctx.config.max_concurrent_reconciles),
                )
                .trigger_backoff(watch_backoff())
                .shutdown_on_signal()
                .run(reconcile_outer, error_policy, ctx)
                .for_each(|res| async move {
                    if let Err(e) = res {
                        tracing::debug!(error = %e, "reconcile");
                    }
                })
                .await;
        }
    });
    futures::future::join_all(controllers).await;
    Ok(())
}

/// Back-off of the controller's watches after an error. kube's default (client-go's: 0.8 s
/// doubling to 30 s, reset after 120 s quiet) applies to the merged trigger stream, so after an
/// API server restart the watches came back up to a minute late: the delay had grown during the
/// outage, and the "too old resource version" that the fresh server answers to the first re-watch
/// counted as one more error. Meanwhile only requeues drove jobs, and a deletion waited for the
/// job's next requeue (5 minutes for a suspended job). Capped at 5 s here: two watches per
/// controller are no burden for an API server.
fn watch_backoff()
-> kube::runtime::utils::ResetTimerBackoff<kube::runtime::watcher::ExponentialBackoff> {
    kube::runtime::utils::ResetTimerBackoff::new(
        backon::ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(250))
            .with_max_delay(Duration::from_secs(5))
            .with_factor(2.0)
            .with_jitter()
            .without_max_times()
            .into(),
        Duration::from_secs(30),
    )
}

fn error_policy(job: Arc<StreamJob>, error: &OperatorError, ctx: Arc<Context>) -> Requeue {
    let labels = OperatorMetrics::job(
        job.namespace().as_deref().unwrap_or_default(),
        &job.name_any(),
    );
    ctx.metrics.reconcile_errors.get_or_create(&labels).inc();
    tracing::warn!(job = %job.name_any(), error = %error, "reconcile failed; retrying");
    Requeue::requeue(Duration::from_secs(3))
}

async fn reconcile_outer(job: Arc<StreamJob>, ctx: Arc<Context>) -> Result<Requeue, OperatorError> {
    let started = Instant::now();
    let ns = job.namespace().unwrap_or_default();
    let name = job.name_any();
    // Not a pass (neither counted nor timed): the job waits for its background step. A deletion
    // goes ahead (its pods go, so the step fails and ends).
    if job.metadata.deletion_timestamp.is_none() && ctx.background_running(&ns, &name).await {
        return Ok(Requeue::requeue(BACKGROUND_BACKSTOP));
    }
    ctx.metrics
        .reconciles
        .get_or_create(&OperatorMetrics::job(&ns, &name))
        .inc();
    let api: Api<StreamJob> = Api::namespaced(ctx.client.clone(), &ns);
    let inner = ctx.clone();
    let result = match with_finalizer(&api, &ctx, job).await {
        Ok(job) => finalizer(&api, desired::FINALIZER, job, move |event| {
            let ctx = inner.clone();
            let fut: std::pin::Pin<
                Box<dyn std::future::Future<Output = Result<Requeue, OperatorError>> + Send>,
            > = match event {
                FinalizerEvent::Apply(job) => Box::pin(apply(job, ctx)),
                FinalizerEvent::Cleanup(job) => Box::pin(cleanup(job, ctx)),
            };
            fut
        })
        .await
        .map_err(|e| match e {
            kube::runtime::finalizer::Error::ApplyFailed(e)
            | kube::runtime::finalizer::Error::CleanupFailed(e) => e,
            other => OperatorError::Finalizer(other.to_string()),
        }),
        Err(e) => Err(e),
    };
    ctx.metrics
        .reconcile_seconds
        .observe(started.elapsed().as_secs_f64());
    // Exact per-pass durations for `keyshift bench operator` (the histogram is too coarse).
    tracing::debug!(
        target: "keyshift::reconcile_pass",
        namespace = %ns,
        job = %name,
        seconds = started.elapsed().as_secs_f64(),
        ok = result.is_ok(),
        "reconcile pass"
    );
    result
}

/// Adds the cleanup finalizer to a job that lacks it and is not being deleted, and returns the
/// job as written. kube's `finalizer` helper adds it too, but then ends the pass and waits for
/// the watch event of its own patch: a new job's first status came one queue turn later, which
/// in a burst of creates (bounded concurrency, FIFO) is most of the latency. The patch carries
/// the resourceVersion it was based on, so a concurrent change fails it (409) and the pass is
/// retried. The patch's answer is the job as it now is, so the pass goes on without reading it.
async fn with_finalizer(
    api: &Api<StreamJob>,
    ctx: &Context,
    job: Arc<StreamJob>,
) -> Result<Arc<StreamJob>, OperatorError> {
    if job.metadata.deletion_timestamp.is_some()
        || job.finalizers().iter().any(|f| f == desired::FINALIZER)
    {
        return Ok(job);
    }
    let mut finalizers = job.finalizers().to_vec();
    finalizers.push(desired::FINALIZER.to_owned());
    let patch = serde_json::json!({
        "metadata": {
            "resourceVersion": job.resource_version(),
            "finalizers": finalizers,
        }
    });
    let updated = api
        .patch(
            &job.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await?;
    let (ns, name) = desired::job_key(&updated)?;
    ctx.memory(&ns, &name).lock().await.written_version = updated.resource_version();
    Ok(Arc::new(updated))
}

/// Deleting a StreamJob: remove its pods (savepoints and checkpoints stay in storage).
async fn cleanup(job: Arc<StreamJob>, ctx: Arc<Context>) -> Result<Requeue, OperatorError> {
    let (ns, name) = desired::job_key(&job)?;
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let list = pods
        .list(&ListParams::default().labels(&desired::selector(&name)))
        .await?;
    for p in list {
        delete_pod(&pods, &p.name_any()).await?;
    }
    ctx.forget(&ns, &name);
    ctx.event(
        &job,
        false,
        "Deleted",
        "worker pods removed; snapshots are kept in storage".into(),
    )
    .await;
    Ok(Requeue::await_change())
}

/// Deletes a pod; returns its resourceVersion once marked for deletion (`None` when it is gone
/// already).
async fn delete_pod(pods: &Api<Pod>, name: &str) -> Result<Option<String>, OperatorError> {
    match pods.delete(name, &DeleteParams::default()).await {
        // The pod marked for deletion, or a Status when it was removed at once.
        Ok(deleted) => Ok(deleted.left().and_then(|pod| pod.resource_version())),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(None),
        Err(e) => Err(e.into()),
    }
}

fn parse_time(t: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(t)
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

fn label_u32(p: &Pod, key: &str) -> Option<u32> {
    p.labels().get(key).and_then(|v| v.parse().ok())
}

fn snapshot_ref(c: &Completed, parallelism: u32) -> SnapshotRef {
    SnapshotRef {
        id: c.id as i64,
        path: c.url.clone(),
        time: Utc::now().to_rfc3339(),
        parallelism: parallelism as i32,
        size_bytes: Some(c.manifest.stats.total_bytes as i64),
    }
}

fn backoff(failures: u32) -> chrono::Duration {
    chrono::Duration::seconds(1i64 << failures.saturating_sub(1).min(6))
}

struct Pass<'a> {
    ctx: &'a Context,
    job: &'a StreamJob,
    spec: &'a StreamJobSpec,
    ns: String,
    name: String,
    storage: String,
    token: String,
    /// The token came from the job's memory, not from its Secret in this pass.
    token_from_cache: bool,
    status: StreamJobStatus,
    progress: Progress,
    mem: tokio::sync::MutexGuard<'a, JobMemory>,
    pods: Vec<ObservedPod>,
    pod_ips: HashMap<u32, String>,
    /// The spec.restoreFrom not yet acted on, when its manifest could be read.
    pending: Option<decide::PendingRestore>,
    /// The key-group count each run's pods were created under (their label), by run.
    run_groups: HashMap<String, u32>,
    /// Events of this pass, published when it ends (beside the status write, not before it).
    events: Vec<PendingEvent>,
}

/// What a pass does: record a background step that ended, or act on a decision.
enum Next {
    Record(Background),
    Act(Action),
}

async fn apply(job: Arc<StreamJob>, ctx: Arc<Context>) -> Result<Requeue, OperatorError> {
    let (ns, name) = desired::job_key(&job)?;
    let api: Api<StreamJob> = Api::namespaced(ctx.client.clone(), &ns);
    let memory = ctx.memory(&ns, &name);
    let mut mem = memory.lock().await;
    // `reconcile_outer` lets no pass through while a background step runs; this keeps it so.
    if mem.background.as_mut().is_some_and(Background::running) {
        return Ok(Requeue::requeue(BACKGROUND_BACKSTOP));
    }
    // Every step must act on the step last recorded. The watch cache may not hold the status
    // this process just wrote yet: unless it hands over exactly the version this process wrote
    // last, read the job.
    let job = if job.resource_version().is_some() && job.resource_version() == mem.written_version {
        job
    } else {
        Arc::new(api.get(&name).await?)
    };
    let spec = &job.spec;
    let status0 = job.status.clone().unwrap_or_default();
    test_pause_at_step(&name, &status0);

    let Some(storage) = spec
        .state
        .storage
        .clone()
        .or_else(|| ctx.config.default_storage.clone())
    else {
        let mut status = status0.clone();
        let progress = Progress {
            stalled: Some((
                "NoStorage".into(),
                "no snapshot storage: set spec.state.storage, or start the operator with --default-storage".into(),
            )),
            ..Default::default()
        };
        status::finish(
            spec,
            job.metadata.generation,
            &mut status,
            None,
            &progress,
            Timestamp::now(),
        );
        write_status(&api, &name, &status0, &status).await?;
        return Ok(Requeue::requeue(Duration::from_secs(60)));
    };
    let pods_api: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let mut list_params = ListParams::default().labels(&desired::selector(&name));
    // A consistent LIST waits for the API server's watch cache to catch up with etcd (~60-80 ms
    // after any write, docs/benchmarks.md): most of a pass. A suspended job with nothing in
    // flight gets no pods from us, so a pod the cache does not show yet only delays its
    // deletion to the pass its own watch event triggers; read the cache as it is.
    if spec.suspend
        && mem.run.is_none()
        && !status0.rescale.as_ref().is_some_and(|r| r.step.active())
    {
        list_params = list_params.match_any();
    } else if let Some(version) = &mem.pods_version {
        // Every pod change this process made is in it; a change by someone else (the kubelet)
        // that it does not show yet triggers a pass of its own through the pods watch.
        list_params = list_params
            .at(version)
            .matching(kube::api::VersionMatch::NotOlderThan);
    }
    // A pass that records the end of a background step looks at no pods: it writes the
    // outcome, and the pass after acts on the pods (a failed start, which removes its pods,
    // excepted).
    let recording = mem.background.as_ref().is_some_and(|bg| {
        !matches!(
            bg.ended.as_ref(),
            Some(Some(Ended::Start(done))) if done.1.is_err()
        )
    });
    let cached_token = mem.token.clone();
    let token_from_cache = cached_token.is_some();
    let (token, listed) = tokio::try_join!(
        async {
            match cached_token {
                Some(t) => Ok(t),
                None => ensure_secret(&ctx, &job, &ns, &name).await,
            }
        },
        async {
            if recording {
                return Ok(Vec::new());
            }
            Ok(pods_api.list(&list_params).await?.items)
        },
    )?;
    mem.token = Some(token.clone());
    let mut pods = Vec::new();
    let mut pod_ips = HashMap::new();
    let mut run_groups = HashMap::new();
    for p in &listed {
        let (Some(run), Some(subtask), Some(parallelism)) = (
            p.labels().get(LABEL_RUN).cloned(),
            label_u32(p, LABEL_SUBTASK),
            label_u32(p, LABEL_PARALLELISM),
        ) else {
            continue;
        };
        if let Some(g) = label_u32(p, desired::LABEL_MAX_PARALLELISM) {
            run_groups.insert(run.clone(), g);
        }
        let st = p.status.as_ref();
        let phase = PodPhase::parse(st.and_then(|s| s.phase.as_deref()));
        let ip = st
            .and_then(|s| s.pod_ip.clone())
            .filter(|ip| !ip.is_empty());
        let deleting = p.metadata.deletion_timestamp.is_some();
        if let Some(ip) = &ip
            && run_matches(&mem, &run)
        {
            pod_ips.insert(subtask, ip.clone());
        }
        pods.push(ObservedPod {
            name: p.name_any(),
            run,
            subtask,
            parallelism,
            phase,
            ip,
            deleting,
            grace_deadline: p.metadata.deletion_timestamp.as_ref().and_then(|t| {
                DateTime::from_timestamp(t.0.as_second(), t.0.subsec_nanosecond().max(0) as u32)
            }),
            worker: None,
            spec_hash: p.labels().get(desired::LABEL_SPEC_HASH).cloned(),
        });
    }
    // The workers' own states, asked for at once (a job of 200 pods, or a hung worker with its
    // 3 s timeout, must not make the pass wait for each in turn).
    let states = futures::future::join_all(pods.iter().map(|p| {
        let ask = match (&p.ip, p.phase, p.deleting) {
            (Some(ip), PodPhase::Running, false) => Some(ip.clone()),
            _ => None,
        };
        let (http, token) = (&ctx.http, &token);
        async move {
            match ask {
                Some(ip) => worker_state(http, &ip, token).await.map(|s| s.state),
                None => None,
            }
        }
    }))
    .await;
    for (p, state) in pods.iter_mut().zip(states) {
        p.worker = state;
    }
    pods.sort_by(|a, b| (a.run.as_str(), a.subtask).cmp(&(b.run.as_str(), b.subtask)));

    let now = Utc::now();
    let last_snapshot_at = [
        status0
            .last_checkpoint
            .as_ref()
            .and_then(|c| parse_time(&c.time)),
        status0
            .last_savepoint
            .as_ref()
            .and_then(|c| parse_time(&c.time)),
        mem.run.as_ref().map(|r| r.started),
    ]
    .into_iter()
    .flatten()
    .max();
    let pending_restore = pending_restore(spec, &status0, &mut mem).await;
    let obs = decide::Observed {
        name: name.clone(),
        pending_restore,
        now,
        pods: pods.clone(),
        active: mem.run.as_ref().map(|r| ActiveRun {
            run: r.run.clone(),
            parallelism: r.parallelism,
        }),
        last_snapshot_at,
        backoff_until: mem.backoff_until,
        new_run: run::new_run_id().map_err(|e| OperatorError::Token(e.to_string()))?,
    };
    // A background step that ended is recorded first; what to do next is decided in the pass
    // after (on the status that records it).
    let next = match mem.background.take() {
        Some(bg) => Next::Record(bg),
        None => {
            let action = decide::decide(spec, &status0, &obs);
            tracing::debug!(job = %name, ?action, "decided");
            Next::Act(action)
        }
    };
    let progress = Progress {
        failure: mem.last_failure.clone(),
        ..Default::default()
    };
    let mut pass = Pass {
        ctx: &ctx,
        job: &job,
        spec,
        ns: ns.clone(),
        name: name.clone(),
        storage,
        token,
        token_from_cache,
        status: status0.clone(),
        progress,
        mem,
        pods,
        pod_ips,
        pending: obs.pending_restore.clone().and_then(Result::ok),
        run_groups,
        events: Vec::new(),
    };
    let requeue = match next {
        Next::Record(bg) => pass.record_background(bg, &pods_api).await,
        Next::Act(action) => {
            let pinned = matches!(action, Action::PinMaxParallelism { .. });
            let mut requeue = pass.execute(action, &pods_api).await;
            // Pinning the key-group count only changes status. When what follows only changes
            // status as well (a new suspended job is Suspended), it is done in the same pass and
            // written with it; anything that acts (creates pods, ...) waits for the pin to be
            // recorded.
            if pinned && requeue.is_ok() {
                let next = decide::decide(spec, &pass.status, &obs);
                if matches!(next, Action::MarkSuspended) {
                    tracing::debug!(job = %name, action = ?next, "decided");
                    requeue = pass.execute(next, &pods_api).await;
                }
            }
            requeue
        }
    };
    let mut status = pass.status;
    let progress = pass.progress;
    let events = pass.events;
    drop(pass.mem);
    let analysis = decide::check_spec(&name, spec, &decide::effective_status(&status, &obs)).ok();
    status.selector = Some(desired::selector(&name));
    status::finish(
        spec,
        job.metadata.generation,
        &mut status,
        analysis.as_ref(),
        &progress,
        Timestamp::now(),
    );
    let (written, ()) = tokio::join!(
        write_status(&api, &name, &status0, &status),
        ctx.publish(&job, events),
    );
    if let Some(version) = written? {
        memory.lock().await.written_version = Some(version);
    }
    Ok(Requeue::requeue(requeue?))
}

/// spec.restoreFrom when the job has not been started from it yet: its manifest's key-group
/// count, or why it cannot be read. A failed read is not cached (the snapshot may appear).
async fn pending_restore(
    spec: &StreamJobSpec,
    status: &StreamJobStatus,
    mem: &mut JobMemory,
) -> Option<Result<decide::PendingRestore, String>> {
    let url = spec.restore_from.as_ref()?;
    if status.restored_from.as_ref() == Some(url) {
        return None;
    }
    if let Some((cached, g)) = &mem.restore_source
        && cached == url
    {
        return Some(Ok(decide::PendingRestore {
            url: url.clone(),
            max_parallelism: *g,
        }));
    }
    match coordinator::restore_from_key_groups(url).await {
        Ok(g) => {
            mem.restore_source = Some((url.clone(), g));
            Some(Ok(decide::PendingRestore {
                url: url.clone(),
                max_parallelism: g,
            }))
        }
        Err(e) => Some(Err(format!("{e}; nothing was stopped"))),
    }
}

/// TEST ONLY: the environment variable that makes the operator exit at a recorded rescale step.
pub const TEST_PAUSE_ENV: &str = "KEYSHIFT_TEST_PAUSE_AFTER_STEP";

/// TEST ONLY (never set in production): with `KEYSHIFT_TEST_PAUSE_AFTER_STEP=<Step>` (one of
/// `Savepointing`, `Verifying`, `Stopping`, `Restoring`), the operator exits with code 3 as soon
/// as a pass finds that step recorded in a job's status.rescale.step, before acting on it: the
/// step is in status, its work is not done. The end-to-end tests use it to kill the operator
/// deterministically inside each step and check that a fresh operator resumes from status.
fn test_pause_at_step(name: &str, status: &StreamJobStatus) {
    let Ok(want) = std::env::var(TEST_PAUSE_ENV) else {
        return;
    };
    if status
        .rescale
        .as_ref()
        .is_some_and(|r| r.step.active() && r.step.as_str() == want)
    {
        tracing::warn!(job = %name, step = %want, "{TEST_PAUSE_ENV}: exiting inside the step (test only)");
        std::process::exit(3);
    }
}

/// TEST ONLY: the environment variable that makes a rescale's restore fail at one parallelism.
pub const TEST_FAIL_RESTORE_ENV: &str = "KEYSHIFT_TEST_FAIL_RESTORE_AT";

/// TEST ONLY (never set in production): with `KEYSHIFT_TEST_FAIL_RESTORE_AT=<N>`, starting the
/// new run of a rescale to parallelism N fails as if its restore had failed (the workers are
/// not started), so the end-to-end tests can drive the rollback deterministically.
fn test_fail_restore_at(parallelism: u32) -> bool {
    std::env::var(TEST_FAIL_RESTORE_ENV).is_ok_and(|v| v.trim() == parallelism.to_string())
}

/// BENCH ONLY (never set in production): with `KEYSHIFT_TEST_STATE_PAYLOAD_BYTES=<N>`, workers
/// keep N opaque bytes with each key's state (`StartRequest::state_payload_bytes`), so
/// `keyshift bench operator rescale` can build large state from a small generator.
fn test_state_payload_bytes() -> usize {
    std::env::var("KEYSHIFT_TEST_STATE_PAYLOAD_BYTES").map_or(0, |v| v.trim().parse().unwrap_or(0))
}

fn run_matches(mem: &JobMemory, run: &str) -> bool {
    mem.run.as_ref().is_none_or(|r| r.run == run)
}

async fn worker_state(http: &reqwest::Client, ip: &str, token: &str) -> Option<WorkerStatus> {
    let url = format!("http://{ip}:{}/v1/status", desired::CONTROL_PORT);
    let resp = http.get(url).bearer_auth(token).send().await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    resp.json().await.ok()
}

/// Writes the status when it changed; returns the job's resourceVersion after the write.
async fn write_status(
    api: &Api<StreamJob>,
    name: &str,
    before: &StreamJobStatus,
    after: &StreamJobStatus,
) -> Result<Option<String>, OperatorError> {
    if before == after {
        return Ok(None);
    }
    let patch = serde_json::json!({
        "apiVersion": "keyshift.dev/v1alpha1",
        "kind": "StreamJob",
        "status": after,
    });
    let written = api
        .patch_status(
            name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await?;
    Ok(written.resource_version())
}

/// The job's control token: from its Secret, created on first use. A job that has no status yet
/// (never reconciled) most likely has no Secret either: it is created without reading first,
/// and read only when it exists already.
async fn ensure_secret(
    ctx: &Context,
    job: &StreamJob,
    ns: &str,
    name: &str,
) -> Result<String, OperatorError> {
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    let secret_name = desired::secret_name(name);
    let create = || async {
        let token = run::new_token().map_err(|e| OperatorError::Token(e.to_string()))?;
        let secret = desired::secret(job, &token)?;
        match secrets.create(&PostParams::default(), &secret).await {
            Ok(_) => Ok(Some(token)),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(None),
            Err(e) => Err(OperatorError::from(e)),
        }
    };
    if job.status.is_none()
        && let Some(token) = create().await?
    {
        return Ok(token);
    }
    if let Some(s) = secrets.get_opt(&secret_name).await? {
        let token = s
            .data
            .as_ref()
            .and_then(|d| d.get(desired::TOKEN_KEY))
            .and_then(|b| String::from_utf8(b.0.clone()).ok())
            .filter(|t| t.len() >= 16);
        return token.ok_or(OperatorError::Token(secret_name));
    }
    // Created concurrently, or deleted since the create: read it back next pass.
    create().await?.ok_or(OperatorError::Token(secret_name))
}

impl Pass<'_> {
    fn rescale_mut(&mut self) -> Option<&mut RescaleStatus> {
        self.status.rescale.as_mut()
    }

    /// Records a new transition, starting at its first step.
    fn begin(&mut self, rescale: RescaleStatus) {
        self.mem.step_started = Some((rescale.step, Instant::now()));
        self.status.rescale = Some(rescale);
    }

    /// The one place a transition's step changes: the step that follows `outcome` (by
    /// [`step::next`]) is recorded, with the seconds the ended step took (in status and the
    /// step-duration metric).
    fn transition(&mut self, outcome: Outcome) -> Result<(), OperatorError> {
        let now = Instant::now();
        let started = self.mem.step_started.take();
        let Some(r) = self.status.rescale.as_mut() else {
            return Err(OperatorError::Transition(format!(
                "outcome {outcome:?} with no transition recorded"
            )));
        };
        let next =
            step::next(r.step, outcome).map_err(|e| OperatorError::Transition(e.to_string()))?;
        // Unknown after an operator restart: the step's time is then not reported.
        let secs = match started {
            Some((s, t)) if s == r.step => now.duration_since(t).as_secs_f64(),
            _ => 0.0,
        };
        r.step_seconds
            .insert(r.step.as_str().to_owned(), (secs * 1000.0).round() / 1000.0);
        self.ctx
            .metrics
            .rescale_step_seconds
            .get_or_create(&StepLabels {
                namespace: self.ns.clone(),
                job: self.name.clone(),
                step: r.step.as_str().to_owned(),
            })
            .observe(secs);
        tracing::info!(job = %self.name, from = %r.step, to = %next, ?outcome, "step");
        r.step = next;
        self.mem.step_started = next.active().then_some((next, now));
        Ok(())
    }

    fn fail(&mut self, reason: &str, message: String) {
        self.mem.failures += 1;
        self.mem.backoff_until = Some(Utc::now() + backoff(self.mem.failures));
        self.mem.last_failure = Some((reason.to_owned(), message.clone()));
        self.progress.failure = Some((reason.to_owned(), message));
    }

    fn succeeded(&mut self) {
        self.mem.failures = 0;
        self.mem.backoff_until = None;
        self.mem.last_failure = None;
        self.progress.failure = None;
    }

    /// A transition to spec.restoreFrom whose new run is being started (not rolled back).
    fn restore_transition(&self) -> Option<&RescaleStatus> {
        self.status.rescale.as_ref().filter(|r| {
            r.step == Step::Restoring && r.rolled_back.is_none() && r.restore_from.is_some()
        })
    }

    /// The key-group count new pods and runs use: a restore transition's new count while its
    /// new run starts, a pending restoreFrom's count while no run is coordinated, else the
    /// pinned one.
    fn max_parallelism(&self) -> Result<u32, OperatorError> {
        let transition = self.restore_transition();
        if let Some(g) = transition.and_then(|r| r.max_parallelism) {
            return Ok(g.max(1) as u32);
        }
        if self.mem.run.is_none()
            && transition.is_none()
            && let Some(p) = &self.pending
        {
            return Ok(p.max_parallelism.max(1));
        }
        let pinned = self
            .status
            .max_parallelism
            .or(self.spec.max_parallelism)
            .unwrap_or_else(|| {
                keygroup::default_max_parallelism(self.spec.replicas.max(1) as u32) as i32
            });
        Ok(pinned.max(1) as u32)
    }

    fn assignment(&self, parallelism: u32) -> Result<Assignment, OperatorError> {
        Ok(Assignment::new(
            i64::from(parallelism),
            i64::from(self.max_parallelism()?),
        )?)
    }

    fn identity(&self) -> JobIdentity {
        run::identity(&self.ns, &self.name, self.spec)
    }

    fn endpoints(&self, parallelism: u32) -> Option<Vec<WorkerEndpoint>> {
        (0..parallelism)
            .map(|i| {
                self.pod_ips.get(&i).map(|ip| WorkerEndpoint {
                    control: format!("http://{ip}:{}", desired::CONTROL_PORT),
                    data: format!("{ip}:{}", desired::DATA_PORT),
                })
            })
            .collect()
    }

    fn set_running(&mut self, parallelism: u32) -> Result<(), OperatorError> {
        self.status.replicas = Some(parallelism as i32);
        self.status.phase = Some(Phase::Running);
        self.status.key_groups = Some(status::key_groups(self.assignment(parallelism)?));
        Ok(())
    }

    fn event(&mut self, warning: bool, reason: &str, note: String) {
        self.events.push(PendingEvent {
            warning,
            reason: reason.to_owned(),
            note,
        });
    }

    async fn delete_all(&mut self, pods_api: &Api<Pod>) -> Result<usize, OperatorError> {
        let mut n = 0;
        for p in self.pods.iter().filter(|p| !p.deleting) {
            // A pod gone by now (404) was not changed by this delete.
            if let Some(version) = delete_pod(pods_api, &p.name).await? {
                self.mem.pods_version = Some(version);
            }
            n += 1;
        }
        self.mem.run = None;
        Ok(n)
    }

    async fn execute(
        &mut self,
        action: Action,
        pods_api: &Api<Pod>,
    ) -> Result<Duration, OperatorError> {
        let short = Duration::from_millis(200);
        match action {
            Action::Stall { reason, message } => {
                let previous = self
                    .status
                    .conditions
                    .iter()
                    .find(|c| c.type_ == status::STALLED)
                    .is_some_and(|c| c.status == "True" && c.message == message);
                if !previous {
                    self.event(true, reason, message.clone());
                }
                self.progress.stalled = Some((reason.to_owned(), message));
                Ok(Duration::from_secs(60))
            }
            Action::PinMaxParallelism { groups: g, origin } => {
                self.status.max_parallelism = Some(g as i32);
                self.status.max_parallelism_origin = Some(origin);
                self.event(
                    false,
                    "KeyGroupsPinned",
                    format!("key-group count (max parallelism) pinned at {g}"),
                );
                Ok(short)
            }
            Action::BeginRescale { from, to } => {
                let groups_moved = match (self.assignment(from), self.assignment(to.max(1))) {
                    (Ok(a), Ok(b)) if to > 0 => keygroup::rescale_plan(a, b)
                        .ok()
                        .map(|p| p.moved_groups as i32),
                    _ => None,
                };
                self.begin(RescaleStatus {
                    from: from as i32,
                    to: to as i32,
                    step: Step::Savepointing,
                    started: Utc::now().to_rfc3339(),
                    groups_moved,
                    ..Default::default()
                });
                let what = if to == 0 {
                    format!("suspending (parallelism {from}) with a savepoint")
                } else {
                    format!(
                        "rescaling {from} -> {to}: stop with a savepoint, verify, move key groups, restart"
                    )
                };
                self.event(
                    false,
                    if to == 0 {
                        "Suspending"
                    } else {
                        "RescaleStarted"
                    },
                    what,
                );
                Ok(short)
            }
            Action::BeginRestore {
                from,
                to,
                url,
                max_parallelism,
            } => {
                self.begin(RescaleStatus {
                    from: from as i32,
                    to: to as i32,
                    step: Step::Savepointing,
                    started: Utc::now().to_rfc3339(),
                    restore_from: Some(url.clone()),
                    max_parallelism: Some(max_parallelism as i32),
                    ..Default::default()
                });
                self.event(
                    false,
                    "RestoreStarted",
                    format!(
                        "spec.restoreFrom changed: keeping the current state in a savepoint, then restarting at parallelism {to} from {url} ({max_parallelism} key groups)"
                    ),
                );
                Ok(short)
            }
            Action::BeginUpgrade { parallelism, mode } => {
                let p = parallelism as i32;
                self.begin(RescaleStatus {
                    from: p,
                    to: p,
                    step: Step::first_of_upgrade(mode),
                    started: Utc::now().to_rfc3339(),
                    groups_moved: Some(0),
                    upgrade_mode: Some(mode),
                    ..Default::default()
                });
                let how = match mode {
                    crate::crd::UpgradeMode::Savepoint => {
                        "stop with a savepoint, verify, restart with the new spec from it"
                    }
                    crate::crd::UpgradeMode::LastState => {
                        "stop, restart with the new spec from the latest checkpoint"
                    }
                    crate::crd::UpgradeMode::Stateless => {
                        "stop, restart with the new spec and empty state"
                    }
                };
                self.event(
                    false,
                    "UpgradeStarted",
                    format!("spec.job or spec.image changed (parallelism {parallelism}): {how}"),
                );
                Ok(short)
            }
            Action::Savepoint => self.savepoint().await,
            Action::Verify { url } => {
                let work = BackgroundWork::Verify { url: url.clone() };
                self.in_background(work, move |handle| {
                    Ended::Verify(handle.block_on(async {
                        let (store, dir) = snapshot::open_store(&url).map_err(|e| e.to_string())?;
                        snapshot::verify(store.as_ref(), &dir)
                            .await
                            .map_err(|e| e.to_string())
                    }))
                });
                Ok(BACKGROUND_BACKSTOP)
            }
            Action::DeletePods { reason } => {
                let n = self.delete_all(pods_api).await?;
                if n > 0 {
                    self.event(
                        false,
                        "DeletingPods",
                        format!("{reason}: deleting {n} worker pod(s)"),
                    );
                }
                self.progress.note =
                    Some((reason.to_owned(), format!("deleting {n} worker pod(s)")));
                Ok(Duration::from_millis(500))
            }
            Action::Advance(outcome) => {
                self.transition(outcome)?;
                Ok(short)
            }
            Action::Abandon { message } => {
                self.abandon(message).await?;
                Ok(short)
            }
            Action::CreatePods {
                run,
                parallelism,
                subtasks,
            } => {
                let assignment = self.assignment(parallelism)?;
                // The pods read the token from the Secret: make sure it (still) exists.
                if self.token_from_cache {
                    let token = ensure_secret(self.ctx, self.job, &self.ns, &self.name).await?;
                    self.mem.token = Some(token.clone());
                    self.token = token;
                    self.token_from_cache = false;
                }
                for i in &subtasks {
                    let pod = desired::pod(
                        self.job,
                        &run,
                        *i,
                        assignment,
                        &self.ctx.config.worker_image,
                    )?;
                    let pod_name = desired::pod_name(&self.name, &run, *i);
                    let written = pods_api
                        .patch(
                            &pod_name,
                            &PatchParams::apply(MANAGER).force(),
                            &Patch::Apply(&pod),
                        )
                        .await?;
                    self.mem.pods_version = written.resource_version();
                }
                self.event(
                    false,
                    "CreatedPods",
                    format!(
                        "run {run}: created {} of {parallelism} worker pod(s)",
                        subtasks.len()
                    ),
                );
                self.progress.note = Some((
                    "CreatingPods".into(),
                    format!("run {run}: {parallelism} worker pod(s)"),
                ));
                Ok(Duration::from_millis(500))
            }
            Action::Wait { reason } => {
                self.progress.note = Some(("Waiting".into(), reason));
                Ok(Duration::from_millis(500))
            }
            Action::Start {
                run,
                parallelism,
                restore,
            } => self.start(run, parallelism, restore, pods_api).await,
            Action::Adopt { run, parallelism } => {
                let Some(endpoints) = self.endpoints(parallelism) else {
                    return Ok(short);
                };
                // The workers run under the key-group count they were started with.
                let assignment = match self.run_groups.get(&run) {
                    Some(g) => Assignment::new(i64::from(parallelism), i64::from(*g))?,
                    None => self.assignment(parallelism)?,
                };
                let coordinator = run::coordinator(
                    self.spec,
                    &self.storage,
                    self.identity(),
                    assignment,
                    endpoints,
                    self.token.clone(),
                )
                .await?;
                if self
                    .pods
                    .iter()
                    .any(|p| p.worker == Some(WorkerState::Stopped))
                {
                    coordinator.resume().await;
                }
                self.mem.run = Some(RunHandle {
                    run: run.clone(),
                    parallelism,
                    coordinator,
                    started: Utc::now(),
                });
                let rescaling = self
                    .status
                    .rescale
                    .as_ref()
                    .is_some_and(|r| r.step.active());
                if !rescaling {
                    self.set_running(parallelism)?;
                }
                tracing::info!(job = %self.name, run, parallelism, "adopted running workers");
                Ok(short)
            }
            Action::Recover { message } => {
                self.delete_all(pods_api).await?;
                self.status.phase = Some(Phase::Pending);
                self.fail(
                    "WorkerFailed",
                    format!("{message}; restarting from the last checkpoint"),
                );
                self.ctx
                    .metrics
                    .worker_restarts
                    .get_or_create(&OperatorMetrics::job(&self.ns, &self.name))
                    .inc();
                self.event(
                    true,
                    "WorkerFailed",
                    format!("{message}; restarting the job from its last checkpoint"),
                );
                Ok(Duration::from_millis(500))
            }
            Action::FinishRescale => {
                let (to, rolled_back) = self.status.rescale.as_ref().map_or((0, false), |r| {
                    (decide::restore_target(r), r.rolled_back.is_some())
                });
                self.finish_restoring(rolled_back)?;
                if to == 0 {
                    self.status.replicas = Some(0);
                    self.status.phase = Some(Phase::Suspended);
                    self.status.key_groups = None;
                } else {
                    self.set_running(to)?;
                }
                let r = self.status.rescale.clone().unwrap_or_default();
                self.event(
                    rolled_back,
                    if to == 0 {
                        "Suspended"
                    } else if rolled_back {
                        "RescaleRolledBack"
                    } else {
                        "Rescaled"
                    },
                    format!(
                        "{} -> {} done: {} key groups moved, {} bytes read, steps {:?}",
                        r.from,
                        r.to,
                        r.groups_moved.unwrap_or_default(),
                        r.bytes_to_read.unwrap_or_default(),
                        r.step_seconds
                    ),
                );
                Ok(short)
            }
            Action::Checkpoint => Ok(self.checkpoint()),
            Action::TriggerSavepoint { nonce } => Ok(self.triggered_savepoint(nonce)),
            Action::MarkSuspended => {
                self.status.phase = Some(Phase::Suspended);
                self.status.replicas = Some(0);
                self.status.key_groups = None;
                Ok(short)
            }
            Action::Idle { requeue } => Ok(requeue),
        }
    }

    /// The new run of a rescale is up: step Done, or RolledBack when it runs at the old
    /// parallelism after a failed restore (the failure, its condition and its backoff stay, so
    /// the rescale is retried later).
    fn finish_restoring(&mut self, rolled_back: bool) -> Result<(), OperatorError> {
        if rolled_back {
            self.transition(Outcome::RestoredAfterRollback)?;
            // The same rescale is retried, but not at once: it just failed.
            let retry = backoff(self.mem.failures).max(chrono::Duration::seconds(10));
            self.mem.backoff_until = Some(Utc::now() + retry);
            if let Some((reason, message)) = self.mem.last_failure.clone() {
                self.progress.failure = Some((reason, message));
            }
        } else {
            self.transition(Outcome::Restored)?;
            self.succeeded();
        }
        Ok(())
    }

    async fn abandon(&mut self, message: String) -> Result<(), OperatorError> {
        self.transition(Outcome::GaveUp)?;
        if let Some(run) = &self.mem.run {
            run.coordinator.resume().await;
        }
        self.fail("RescaleAbandoned", message.clone());
        self.event(true, "RescaleAbandoned", format!("{message}; the job keeps running at its old parallelism and the rescale is retried with backoff"));
        Ok(())
    }

    fn kind_labels(&self, kind: &str) -> KindLabels {
        KindLabels {
            namespace: self.ns.clone(),
            job: self.name.clone(),
            kind: kind.to_owned(),
        }
    }

    /// Snapshot metrics: duration and size of a committed snapshot, or one more failure.
    fn record_snapshot(&mut self, labels: &KindLabels, completed: Option<&Completed>) {
        let m = &self.ctx.metrics;
        match completed {
            Some(c) => {
                if let Some(d) = status::state_distribution(&c.manifest) {
                    self.status.state_distribution = Some(d);
                }
                m.snapshot_seconds
                    .get_or_create(labels)
                    .observe(c.duration.as_secs_f64());
                m.snapshot_bytes
                    .get_or_create(labels)
                    .set(c.manifest.stats.total_bytes as i64);
            }
            None => {
                m.snapshot_failures.get_or_create(labels).inc();
            }
        }
    }

    /// Runs `work` on a blocking thread (the coordinator's snapshot future is not provably
    /// `Send`: retention and manifest commits borrow inside stream closures). Its end wakes the
    /// job's controller; the pass it triggers records the outcome.
    fn in_background(
        &mut self,
        work: BackgroundWork,
        run: impl FnOnce(&tokio::runtime::Handle) -> Ended + Send + 'static,
    ) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let waker = self.ctx.waker(&self.ns);
        let job = ObjectRef::from_obj(self.job);
        let handle = tokio::runtime::Handle::current();
        tracing::debug!(job = %self.name, ?work, "background step started");
        tokio::task::spawn_blocking(move || {
            // The outcome first: the pass the wake-up triggers must find it.
            let _ = tx.send(run(&handle));
            if let Some(waker) = waker {
                let _ = waker.unbounded_send(job);
            }
        });
        self.mem.background = Some(Background {
            work,
            rx,
            ended: None,
        });
    }

    /// A snapshot of the coordinated run in the background (the run's coordinator moves there
    /// and back).
    fn snapshot_in_background(
        &mut self,
        work: BackgroundWork,
        mut run: RunHandle,
        kind: SnapshotKind,
        stop: bool,
        timeout: Duration,
    ) {
        self.in_background(work, move |handle| {
            let result = handle.block_on(run.coordinator.snapshot(kind, stop, timeout));
            Ended::Snapshot(Box::new((run, result)))
        });
    }

    /// Records what a background step that ended did.
    async fn record_background(
        &mut self,
        bg: Background,
        pods_api: &Api<Pod>,
    ) -> Result<Duration, OperatorError> {
        let Background { work, ended, .. } = bg;
        tracing::debug!(job = %self.name, ?work, "background step ended");
        match (work, ended.flatten()) {
            (BackgroundWork::Checkpoint { parallelism }, Some(Ended::Snapshot(done))) => {
                Ok(self.checkpoint_done(parallelism, *done))
            }
            (BackgroundWork::Savepoint { parallelism }, Some(Ended::Snapshot(done))) => {
                self.savepoint_done(parallelism, *done).await
            }
            (
                BackgroundWork::TriggeredSavepoint { parallelism, nonce },
                Some(Ended::Snapshot(done)),
            ) => Ok(self.triggered_savepoint_done(parallelism, nonce, *done)),
            (BackgroundWork::Start(work), Some(Ended::Start(done))) => {
                let (coordinator, result) = *done;
                self.start_done(*work, coordinator, result, pods_api).await
            }
            (BackgroundWork::Verify { url }, Some(Ended::Verify(result))) => {
                match result {
                    Ok(report) => {
                        self.transition(Outcome::Verified)?;
                        self.event(
                            false,
                            "SavepointVerified",
                            format!("{url}: {report:?}").chars().take(300).collect(),
                        );
                    }
                    Err(e) => {
                        self.abandon(format!("savepoint {url} failed verification: {e}"))
                            .await?;
                    }
                }
                Ok(Duration::from_millis(200))
            }
            (work, _) => {
                // The thread panicked: a snapshot's run (its coordinator) is lost with it. The
                // workers still run; the next pass adopts them again.
                tracing::error!(job = %self.name, ?work, "background step failed without an outcome");
                Ok(Duration::from_secs(1))
            }
        }
    }

    async fn savepoint(&mut self) -> Result<Duration, OperatorError> {
        let Some(run) = self.mem.run.take() else {
            return Ok(Duration::from_millis(200));
        };
        if self
            .pods
            .iter()
            .any(|p| p.worker == Some(WorkerState::Stopped))
        {
            // A savepoint taken by an operator that died before recording it: the sources are
            // stopped at its barrier. Take a new one (the old one stays valid in storage).
            run.coordinator.resume().await;
        }
        let work = BackgroundWork::Savepoint {
            parallelism: run.parallelism,
        };
        self.snapshot_in_background(
            work,
            run,
            SnapshotKind::Savepoint,
            true,
            run::timeouts::SAVEPOINT,
        );
        Ok(BACKGROUND_BACKSTOP)
    }

    async fn savepoint_done(
        &mut self,
        parallelism: u32,
        (run, result): (RunHandle, Result<Completed, CoordinatorError>),
    ) -> Result<Duration, OperatorError> {
        let labels = self.kind_labels("savepoint");
        self.mem.run = Some(run);
        match result {
            Ok(c) => {
                self.record_snapshot(&labels, Some(&c));
                self.status.last_savepoint = Some(snapshot_ref(&c, parallelism));
                if let Some(r) = self.rescale_mut() {
                    r.savepoint = Some(c.url.clone());
                    r.bytes_to_read = Some(c.manifest.stats.total_bytes as i64);
                }
                self.transition(Outcome::SavepointTaken)?;
                self.event(
                    false,
                    "SavepointTaken",
                    format!(
                        "savepoint {} ({} bytes) in {} ms; sources stopped at its barrier",
                        c.url,
                        c.manifest.stats.total_bytes,
                        c.duration.as_millis()
                    ),
                );
                Ok(Duration::from_millis(100))
            }
            Err(e) => {
                self.record_snapshot(&labels, None);
                self.abandon(format!("savepoint failed: {e}")).await?;
                Ok(Duration::from_millis(500))
            }
        }
    }

    /// A savepoint asked for with spec.savepointTriggerNonce: the job keeps running.
    fn triggered_savepoint(&mut self, nonce: i64) -> Duration {
        let Some(run) = self.mem.run.take() else {
            return Duration::from_millis(200);
        };
        let work = BackgroundWork::TriggeredSavepoint {
            parallelism: run.parallelism,
            nonce,
        };
        self.snapshot_in_background(
            work,
            run,
            SnapshotKind::Savepoint,
            false,
            run::timeouts::SAVEPOINT,
        );
        BACKGROUND_BACKSTOP
    }

    fn triggered_savepoint_done(
        &mut self,
        parallelism: u32,
        nonce: i64,
        (run, result): (RunHandle, Result<Completed, CoordinatorError>),
    ) -> Duration {
        let labels = self.kind_labels("savepoint");
        self.mem.run = Some(run);
        match result {
            Ok(c) => {
                self.record_snapshot(&labels, Some(&c));
                self.status.last_savepoint = Some(snapshot_ref(&c, parallelism));
                self.status.last_savepoint_nonce = Some(nonce);
                self.succeeded();
                self.event(
                    false,
                    "SavepointTaken",
                    format!(
                        "savepoint {} ({} bytes) in {} ms for savepointTriggerNonce {nonce}; the job keeps running",
                        c.url,
                        c.manifest.stats.total_bytes,
                        c.duration.as_millis()
                    ),
                );
                Duration::from_millis(200)
            }
            Err(e) => {
                self.record_snapshot(&labels, None);
                let message = format!(
                    "savepoint for savepointTriggerNonce {nonce} failed: {e}; retrying with backoff"
                );
                self.fail("SavepointFailed", message.clone());
                self.event(true, "SavepointFailed", message);
                Duration::from_secs(1)
            }
        }
    }

    fn checkpoint(&mut self) -> Duration {
        let Some(run) = self.mem.run.take() else {
            return decide::checkpoint_interval(self.spec);
        };
        let work = BackgroundWork::Checkpoint {
            parallelism: run.parallelism,
        };
        self.snapshot_in_background(
            work,
            run,
            SnapshotKind::Checkpoint,
            false,
            run::timeouts::CHECKPOINT,
        );
        BACKGROUND_BACKSTOP
    }

    fn checkpoint_done(
        &mut self,
        parallelism: u32,
        (run, result): (RunHandle, Result<Completed, CoordinatorError>),
    ) -> Duration {
        let interval = decide::checkpoint_interval(self.spec);
        let labels = self.kind_labels("checkpoint");
        let run = self.mem.run.insert(run);
        match result {
            Ok(c) => {
                self.record_snapshot(&labels, Some(&c));
                self.status.last_checkpoint = Some(snapshot_ref(&c, parallelism));
                self.succeeded();
                interval
            }
            Err(e) => {
                // Try again after a fraction of the interval; a dead worker shows up as a pod
                // exit and restarts the job.
                run.started = Utc::now();
                self.record_snapshot(&labels, None);
                self.event(
                    true,
                    "CheckpointFailed",
                    format!("{e}; the previous checkpoint stays usable"),
                );
                interval / 2
            }
        }
    }

    async fn start(
        &mut self,
        run: String,
        parallelism: u32,
        restore: Restore,
        pods_api: &Api<Pod>,
    ) -> Result<Duration, OperatorError> {
        let Some(endpoints) = self.endpoints(parallelism) else {
            return Ok(Duration::from_millis(200));
        };
        // A run started empty (a `stateless` upgrade) checkpoints at once, so that a recovery
        // restores its new state rather than the job's older snapshots.
        // So does a run restored from spec.restoreFrom: the job's own storage then holds a
        // snapshot under its (possibly new) key-group count.
        let transition_source = self
            .restore_transition()
            .and_then(|r| r.restore_from.clone());
        let restored_source = match &restore {
            Restore::Url(u)
                if self.spec.restore_from.as_ref() == Some(u)
                    || transition_source.as_ref() == Some(u) =>
            {
                Some(u.clone())
            }
            _ => None,
        };
        let from_restore_from = restored_source.is_some();
        let run_started = if restore == Restore::Empty || from_restore_from {
            DateTime::UNIX_EPOCH
        } else {
            Utc::now()
        };
        let restore_from = match restore {
            Restore::Url(u) => Some(u),
            Restore::Empty => None,
            // The job's newest own snapshot under its current key-group count (snapshots taken
            // before a restore from a rewritten savepoint have another count and are skipped),
            // else the snapshot it was restored from.
            Restore::Latest => {
                let groups = self.max_parallelism()?;
                let own = coordinator::latest_snapshot_with(
                    &self.storage,
                    &self.ns,
                    &self.name,
                    Some(groups),
                )
                .await?
                .map(|(url, _)| url);
                own.or_else(|| self.spec.restore_from.clone())
            }
        };
        let assignment = self.assignment(parallelism)?;
        let coordinator = run::coordinator(
            self.spec,
            &self.storage,
            self.identity(),
            assignment,
            endpoints,
            self.token.clone(),
        )
        .await?;
        let template = run::StartPlan {
            namespace: &self.ns,
            name: &self.name,
            spec: self.spec,
            assignment,
            storage: &self.storage,
            restore_from: restore_from.clone(),
            run: &run,
            state_payload_bytes: test_state_payload_bytes(),
        }
        .request();
        let work = StartWork {
            run,
            parallelism,
            groups: assignment.max_parallelism(),
            restore_from,
            restored_source,
            run_started,
            started: Instant::now(),
        };
        let restoring_rescale = self
            .status
            .rescale
            .as_ref()
            .is_some_and(|r| r.step == Step::Restoring && r.rolled_back.is_none());
        if restoring_rescale && test_fail_restore_at(work.parallelism) {
            let injected = format!(
                "{TEST_FAIL_RESTORE_ENV}={}: restore failure injected (test only)",
                work.parallelism
            );
            return self
                .start_done(work, coordinator, Err(injected), pods_api)
                .await;
        }
        // The workers restore their key groups before they answer: in the background.
        self.in_background(BackgroundWork::Start(Box::new(work)), move |handle| {
            let result = handle
                .block_on(coordinator.start(&template, run::timeouts::START))
                .map_err(|e| e.to_string());
            Ended::Start(Box::new((coordinator, result)))
        });
        Ok(BACKGROUND_BACKSTOP)
    }

    /// Records how starting a run ended.
    async fn start_done(
        &mut self,
        work: StartWork,
        coordinator: Coordinator,
        result: Result<Vec<StartResponse>, String>,
        pods_api: &Api<Pod>,
    ) -> Result<Duration, OperatorError> {
        let StartWork {
            run,
            parallelism,
            groups: key_groups,
            restore_from,
            restored_source,
            run_started,
            started,
        } = work;
        let from_restore_from = restored_source.is_some();
        match result {
            Ok(responses) => {
                let bytes: u64 = responses.iter().map(|r| r.bytes_read).sum();
                let groups: u32 = responses.iter().map(|r| r.groups_restored).sum();
                if from_restore_from {
                    let g = key_groups as i32;
                    if self.status.max_parallelism != Some(g) {
                        self.status.max_parallelism_origin = restore_from
                            .as_deref()
                            .map(validation::ceiling_origin_snapshot);
                        self.event(
                            false,
                            "KeyGroupsPinned",
                            format!(
                                "key-group count (max parallelism) is now {g}, from {}",
                                restore_from.as_deref().unwrap_or_default()
                            ),
                        );
                    }
                    self.status.max_parallelism = Some(g);
                    self.status.restored_from = restored_source.clone();
                }
                self.mem.run = Some(RunHandle {
                    run: run.clone(),
                    parallelism,
                    coordinator,
                    started: run_started,
                });
                let restoring = self
                    .status
                    .rescale
                    .as_ref()
                    .is_some_and(|r| r.step == Step::Restoring);
                let rolled_back = self
                    .status
                    .rescale
                    .as_ref()
                    .is_some_and(|r| restoring && r.rolled_back.is_some());
                if restoring {
                    if let Some(r) = self.rescale_mut() {
                        r.bytes_to_read = Some(bytes as i64);
                    }
                    self.finish_restoring(rolled_back)?;
                } else {
                    self.succeeded();
                }
                self.set_running(parallelism)?;
                self.event(false, "Started", format!(
                    "run {run}: {parallelism} worker(s) running in {} ms, restored {groups} key groups ({bytes} bytes) from {}",
                    started.elapsed().as_millis(),
                    restore_from.as_deref().unwrap_or("nothing (empty state)")
                ));
                if restoring {
                    let r = self.status.rescale.clone().unwrap_or_default();
                    self.event(
                        rolled_back,
                        if rolled_back {
                            "RescaleRolledBack"
                        } else {
                            "Rescaled"
                        },
                        format!(
                            "{} -> {} {}: {} key groups moved, {} bytes read, steps {:?}",
                            r.from,
                            r.to,
                            if rolled_back {
                                "rolled back (running at the old parallelism)"
                            } else {
                                "done"
                            },
                            r.groups_moved.unwrap_or_default(),
                            bytes,
                            r.step_seconds
                        ),
                    );
                }
                Ok(Duration::from_millis(200))
            }
            Err(e) => {
                self.delete_all(pods_api).await?;
                let message = format!(
                    "starting run {run} at parallelism {parallelism} from {} failed: {e}",
                    restore_from.as_deref().unwrap_or("empty state")
                );
                let rollback = self
                    .status
                    .rescale
                    .as_ref()
                    .and_then(decide::rollback_on_restore_failure);
                if let Some(old) = rollback {
                    let why = format!(
                        "{message}; rolling back: restoring the old parallelism {old} from the same savepoint"
                    );
                    self.transition(Outcome::RestoreFailed)?;
                    if let Some(r) = self.rescale_mut() {
                        r.rolled_back = Some(why.clone());
                    }
                    self.fail("RescaleRolledBack", why.clone());
                    self.event(true, "RescaleRollingBack", why);
                    return Ok(Duration::from_secs(1));
                }
                self.fail("StartFailed", message.clone());
                self.event(
                    true,
                    "StartFailed",
                    format!("{message}; retrying with backoff (the snapshot is intact)"),
                );
                Ok(Duration::from_secs(1))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::utils::Backoff;

    #[test]
    fn watch_backoff_starts_small_is_capped_and_resets() {
        let mut b = watch_backoff();
        let delays: Vec<Duration> = (0..30).map_while(|_| b.next()).collect();
        assert_eq!(delays.len(), 30, "it never gives up");
        assert!(delays[0] <= Duration::from_millis(500), "{delays:?}");
        // The cap (5 s) plus at most as much jitter.
        assert!(
            delays.iter().all(|d| *d <= Duration::from_secs(10)),
            "{delays:?}"
        );
        assert!(delays[29] >= Duration::from_secs(5), "{delays:?}");
        b.reset();
        let first = b.next().unwrap_or_default();
        assert!(
            first <= Duration::from_millis(500),
            "after reset: {first:?}"
        );
    }

    #[test]
    fn a_background_step_runs_until_its_outcome_arrives_or_its_thread_is_gone() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let mut bg = Background {
            work: BackgroundWork::Verify { url: "u".into() },
            rx,
            ended: None,
        };
        assert!(bg.running());
        assert!(bg.running(), "asking again changes nothing");
        assert!(tx.send(Ended::Verify(Err("corrupt block".into()))).is_ok());
        assert!(!bg.running());
        assert!(!bg.running(), "the outcome is kept");
        assert!(matches!(
            bg.ended,
            Some(Some(Ended::Verify(Err(ref e)))) if e == "corrupt block"
        ));

        let (tx, rx) = tokio::sync::oneshot::channel::<Ended>();
        let mut bg = Background {
            work: BackgroundWork::Checkpoint { parallelism: 2 },
            rx,
            ended: None,
        };
        drop(tx); // the thread panicked
        assert!(!bg.running());
        assert!(matches!(bg.ended, Some(None)));
    }

    #[test]
    fn idle_watches_end_before_the_read_timeout_cuts_them() {
        let watch = watch_config();
        assert_eq!(watch.timeout, Some(WATCH_TIMEOUT_SECS));
        let config = client_config(kube::Config::new("https://127.0.0.1:6443".parse().unwrap()));
        let read = config.read_timeout.unwrap_or(Duration::MAX);
        // A watch with no events sends nothing until the server ends it: the client must wait
        // longer than that, with room for a slow server, and still far less than kube's 295 s.
        assert!(
            read >= Duration::from_secs(u64::from(WATCH_TIMEOUT_SECS) + 10),
            "{read:?}"
        );
        assert!(read <= Duration::from_secs(90), "{read:?}");
    }
}
