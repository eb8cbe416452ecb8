//! The operator's shared state: its settings, its Kubernetes client, the Event recorder, what it
//! remembers about each job between passes, and the wakers of its controllers.

use super::desired::MANAGER;
use super::metrics::OperatorMetrics;
use crate::crd::{StreamJob, StreamJobSnapshot};
use crate::orchestrator::pass::{JobMemory, PendingEvent};
use kube::Client;
use kube::Resource;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

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
    /// The workers' log format: the operator's own, so that one setting governs both.
    pub worker_log_format: crate::telemetry::LogFormat,
    /// Reconcile passes that may run at once per controller (0: unbounded).
    pub max_concurrent_reconciles: u16,
    /// Leader election (None: this process reconciles unconditionally).
    pub leader: Option<crate::leader::LeaderConfig>,
    /// The NetworkPolicy created in front of every job's workers (None: none is created, for
    /// clusters whose CNI does not enforce policies or whose policies the user manages).
    pub network_policy: Option<super::desired::NetworkPolicyConfig>,
    /// Which images and ServiceAccounts a job may ask for (empty lists: any).
    pub pod_policy: crate::validation::PodPolicy,
}

/// What the operator remembers about one job: the orchestration's memory, and what only the pod
/// platform needs.
#[derive(Default)]
pub(super) struct JobEntry {
    pub(super) orchestration: JobMemory,
    /// The resourceVersion of the StreamJob as this process last wrote it (the finalizer patch
    /// or a status write). A pass handed exactly that object by the watch cache acts on it
    /// without reading the job again: it holds every step this process recorded.
    pub(super) written_version: Option<String>,
    /// The resourceVersion of this process's last write to one of the job's pods (create or
    /// delete). Its pods are listed "not older than" it: from the API server's watch cache, which
    /// is then known to hold that write, instead of a consistent read that waits for the cache
    /// to catch up with etcd (60-80 ms).
    pub(super) pods_version: Option<String>,
}

pub(super) type SharedEntry = Arc<tokio::sync::Mutex<JobEntry>>;

/// Shared state of the controller.
pub struct Context {
    pub(super) client: Client,
    pub(super) config: OperatorConfig,
    pub(super) metrics: Arc<OperatorMetrics>,
    pub(super) http: reqwest::Client,
    pub(super) recorder: Recorder,
    pub(super) jobs: std::sync::Mutex<HashMap<(String, String), SharedEntry>>,
    /// Per controller (its namespace, or `None` for all): wakes a job whose background step
    /// ended.
    pub(super) wakers: std::sync::Mutex<Vec<(Option<String>, Waker)>>,
    /// Per controller: its watch cache of StreamJobs, to check one job against the others
    /// (their sinks) without a request.
    pub(super) job_stores: std::sync::Mutex<Vec<kube::runtime::reflector::Store<StreamJob>>>,
    /// Per snapshot controller: its watch cache of StreamJobSnapshots, for the job passes to
    /// find the snapshots that wait for a savepoint and the one spec.restoreFrom names.
    pub(super) snapshot_stores:
        std::sync::Mutex<Vec<kube::runtime::reflector::Store<StreamJobSnapshot>>>,
    /// When each StreamJobSnapshot's storage was last read, by (namespace, name, what for).
    snapshot_checked: std::sync::Mutex<HashMap<(String, String, &'static str), std::time::Instant>>,
}

pub(super) type Waker = futures::channel::mpsc::UnboundedSender<ObjectRef<StreamJob>>;

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
            job_stores: std::sync::Mutex::new(Vec::new()),
            snapshot_stores: std::sync::Mutex::new(Vec::new()),
            snapshot_checked: std::sync::Mutex::new(HashMap::new()),
        }
    }

    /// The waker of the controller that reconciles jobs of `ns`.
    pub(super) fn waker(&self, ns: &str) -> Option<Waker> {
        let wakers = self.wakers.lock().unwrap_or_else(|p| p.into_inner());
        wakers
            .iter()
            .find(|(scope, _)| scope.as_deref().is_none_or(|s| s == ns))
            .map(|(_, w)| w.clone())
    }

    /// Whether the job's background step still runs.
    pub(super) async fn background_running(&self, ns: &str, name: &str) -> bool {
        let entry = self.entry(ns, name);
        let mut entry = entry.lock().await;
        entry.orchestration.background_running()
    }

    pub(super) fn entry(&self, ns: &str, name: &str) -> SharedEntry {
        let mut jobs = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        jobs.entry((ns.to_owned(), name.to_owned()))
            .or_default()
            .clone()
    }

    pub(super) fn forget(&self, ns: &str, name: &str) {
        let mut jobs = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        jobs.remove(&(ns.to_owned(), name.to_owned()));
    }

    /// Publishes an Event about `object` (a StreamJob or a StreamJobSnapshot).
    pub(super) async fn event<K: Resource<DynamicType = ()>>(
        &self,
        object: &K,
        warning: bool,
        reason: &str,
        note: String,
    ) {
        self.event_on(object.object_ref(&()), warning, reason, note)
            .await;
    }

    /// Publishes an Event about the object `reference` names. Boxed as a `Send` future with
    /// concrete lifetimes: the recorder's own future is not `Send` for every lifetime, which a
    /// controller's reconciler (the StreamJobSnapshot's) must be.
    pub(super) fn event_on(
        &self,
        reference: k8s_openapi::api::core::v1::ObjectReference,
        warning: bool,
        reason: &str,
        note: String,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
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
        Box::pin(async move {
            if let Err(e) = self.recorder.publish(&ev, &reference).await {
                tracing::warn!(error = %e, reason = %ev.reason, "publishing an Event failed");
            }
        })
    }

    /// A pass's Events, in the order they were recorded.
    pub(super) async fn publish(&self, job: &StreamJob, events: Vec<PendingEvent>) {
        for e in events {
            self.event(job, e.warning, &e.reason, e.note).await;
        }
    }
}

impl Context {
    /// Whether `job`'s sink may write where it is set to: refused when an older job this
    /// operator watches writes there (`validation::check_sink_isolation`). Jobs outside the
    /// operator's namespaces are not seen; their workers' publish still refuses a marker
    /// another job wrote.
    pub(super) fn check_sink_isolation(
        &self,
        job: &StreamJob,
    ) -> Result<(), crate::validation::SharedSink> {
        let stores = self
            .job_stores
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let others: Vec<Arc<StreamJob>> = stores.iter().flat_map(|s| s.state()).collect();
        crate::validation::check_sink_isolation(&identity(job), others.iter().map(|o| identity(o)))
    }
}

impl Context {
    /// The StreamJobSnapshots of namespace `ns` in the watch caches.
    pub(super) fn snapshots_in(&self, ns: &str) -> Vec<Arc<StreamJobSnapshot>> {
        in_namespace(&self.snapshot_stores, ns)
    }

    /// Whether the storage of snapshot `ns/name` may be read `what` for now: not within `every`
    /// of the last time it was (which this records).
    pub(super) fn snapshot_due(
        &self,
        ns: &str,
        name: &str,
        what: &'static str,
        every: Duration,
    ) -> bool {
        let mut checked = self
            .snapshot_checked
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let now = std::time::Instant::now();
        let key = (ns.to_owned(), name.to_owned(), what);
        if checked
            .get(&key)
            .is_some_and(|t| now.duration_since(*t) < every)
        {
            return false;
        }
        checked.insert(key, now);
        true
    }

    /// Forgets a deleted snapshot's [`Self::snapshot_due`] times.
    pub(super) fn forget_snapshot(&self, ns: &str, name: &str) {
        self.snapshot_checked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(n, s, _), _| !(n == ns && s == name));
    }

    /// The StreamJobs of namespace `ns` in the watch caches.
    pub(super) fn jobs_in(&self, ns: &str) -> Vec<Arc<StreamJob>> {
        in_namespace(&self.job_stores, ns)
    }
}

/// The objects of namespace `ns` in the watch caches `stores` (one per controller).
fn in_namespace<K>(
    stores: &std::sync::Mutex<Vec<kube::runtime::reflector::Store<K>>>,
    ns: &str,
) -> Vec<Arc<K>>
where
    K: Resource + Clone + 'static,
    K::DynamicType: std::hash::Hash + Eq + Clone,
{
    let stores = stores.lock().unwrap_or_else(|p| p.into_inner()).clone();
    stores
        .iter()
        .flat_map(|s| s.state())
        .filter(|o| o.meta().namespace.as_deref() == Some(ns))
        .collect()
}

fn identity(job: &StreamJob) -> crate::validation::JobIdentity<'_> {
    crate::validation::JobIdentity {
        namespace: job.metadata.namespace.as_deref().unwrap_or_default(),
        name: job.metadata.name.as_deref().unwrap_or_default(),
        created: job.metadata.creation_timestamp.as_ref().map(|t| t.0),
        spec: &job.spec,
    }
}
