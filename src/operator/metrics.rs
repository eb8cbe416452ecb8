//! The operator's Prometheus metrics and its `/metrics`, `/healthz`, `/readyz` server.
//!
//! Names follow Prometheus' conventions: the base unit is in the name (`_seconds`, `_bytes`),
//! counters end in `_total` (the encoder appends it to the registered name), points in time are
//! Unix seconds (`_timestamp_seconds`). `keyshift_operator_*` describe the operator's own work;
//! `keyshift_job_*` describe one StreamJob each. Per-job series are labelled `namespace` and
//! `streamjob` (not `job`, which Prometheus gives every series as the scrape job's name) and at
//! most one typed label more: a [`Step`], a [`SnapshotKind`], an [`ErrorKind`], a [`Phase`] or
//! a condition type (one of [`ALL_CONDITIONS`]).
//! A job therefore has at most [`max_series_per_job`] series, and
//! [`OperatorMetrics::forget_job`] removes every one of them when the job is deleted or replaced
//! by a new object of the same name (docs/operations.md, "Metrics", has the table and the count).

use crate::crd::{Phase, StreamJobSpec, StreamJobStatus};
use crate::orchestrator::pass::error::ErrorKind;
use crate::orchestrator::settings;
use crate::orchestrator::status::ALL_CONDITIONS;
use crate::snapshot::SnapshotKind;
use keyshift_core::step::{ALL_STEPS, Step};
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// A gauge holding a float (seconds, timestamps).
pub type FloatGauge = Gauge<f64, AtomicU64>;

/// The series of one job.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct JobLabels {
    pub namespace: String,
    pub streamjob: String,
}

/// A job's series for one step of a rescale or upgrade.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StepLabels {
    pub namespace: String,
    pub streamjob: String,
    pub step: Shown<Step>,
}

/// A value of a lower crate's type as a label value, written as it displays (a [`Step`] as
/// `Savepointing`, a [`SnapshotKind`] as `checkpoint`). The types live in keyshift-core and
/// keyshift-runtime, which know nothing of metrics, so the label wraps them here.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct Shown<T>(pub T);

/// A job's series for one kind of snapshot (`checkpoint`, `savepoint`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SnapshotLabels {
    pub namespace: String,
    pub streamjob: String,
    pub kind: Shown<SnapshotKind>,
}

/// A failed reconcile pass: the job and what kind of failure it was ([`ErrorKind::label`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub namespace: String,
    pub streamjob: String,
    pub kind: ErrorKind,
}

/// A job's series for one lifecycle phase.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    pub namespace: String,
    pub streamjob: String,
    pub phase: Phase,
}

impl<T: std::fmt::Display> EncodeLabelValue for Shown<T> {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        write!(encoder, "{}", self.0)
    }
}

impl EncodeLabelValue for ErrorKind {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        encoder.write_str(self.label())
    }
}

impl EncodeLabelValue for Phase {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        encoder.write_str(phase_name(*self))
    }
}

/// A job's series for one of its conditions (a type of [`ALL_CONDITIONS`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConditionLabels {
    pub namespace: String,
    pub streamjob: String,
    pub condition: &'static str,
}

/// Every phase, in lifecycle order (the `phase` label's values).
pub const ALL_PHASES: [Phase; 6] = [
    Phase::Pending,
    Phase::Running,
    Phase::Rescaling,
    Phase::Upgrading,
    Phase::Suspended,
    Phase::Failed,
];

/// The phase as status shows it (the CRD's enum value).
fn phase_name(phase: Phase) -> &'static str {
    match phase {
        Phase::Pending => "Pending",
        Phase::Running => "Running",
        Phase::Rescaling => "Rescaling",
        Phase::Upgrading => "Upgrading",
        Phase::Suspended => "Suspended",
        Phase::Failed => "Failed",
    }
}

/// Both snapshot kinds (the `kind` label's values).
pub const ALL_SNAPSHOT_KINDS: [SnapshotKind; 2] =
    [SnapshotKind::Checkpoint, SnapshotKind::Savepoint];

/// Upper bounds (seconds) of the per-job duration histograms (steps, snapshots): from a tenth of
/// a second to an hour, few enough that 500 jobs stay affordable.
pub const JOB_SECONDS_BUCKETS: [f64; 10] =
    [0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0];

/// Buckets of the reconcile-duration histogram (1 ms doubling to ~9 minutes).
const RECONCILE_BUCKETS: usize = 20;

fn job_seconds_histogram() -> Histogram {
    Histogram::new(JOB_SECONDS_BUCKETS)
}

/// Sample lines of one histogram series with `buckets` finite buckets: those, `+Inf`, `_sum`
/// and `_count`.
const fn histogram_lines(buckets: usize) -> usize {
    buckets + 3
}

/// The most series (sample lines of the exposition) one job can have: the formula that
/// docs/operations.md states, from the label types' sizes. Rescale-step durations exist only for
/// the steps that end while active (Savepointing, Verifying, Stopping, Restoring); the current
/// step's gauge for one step at a time.
pub fn max_series_per_job() -> usize {
    let active_steps = ALL_STEPS.iter().filter(|s| s.active()).count();
    let kinds = ALL_SNAPSHOT_KINDS.len();
    let job_hist = histogram_lines(JOB_SECONDS_BUCKETS.len());
    1 // reconciles_total
        + ErrorKind::ALL.len() // reconcile_errors_total
        + active_steps * job_hist // rescale_step_duration_seconds
        + 1 // rescale_step
        + kinds * job_hist // snapshot_duration_seconds
        + kinds // snapshot_failures_total
        + 1 // restarts_total
        + 4 // last checkpoint and savepoint: timestamp and size
        + 1 // checkpoint_interval_seconds
        + ALL_PHASES.len() // phase
        + 2 // ready, stalled
        + ALL_CONDITIONS.len() // condition
        + 2 // parallelism, desired_parallelism
        + 2 // source_lag_records, source_lag_seconds
}

/// Series of the operator itself, whatever the number of jobs: the reconcile histogram and
/// `keyshift_build_info`.
pub fn operator_series() -> usize {
    histogram_lines(RECONCILE_BUCKETS) + 1
}

/// Everything the operator counts.
pub struct OperatorMetrics {
    registry: Registry,
    pub reconciles: Family<JobLabels, Counter>,
    pub reconcile_errors: Family<ErrorLabels, Counter>,
    pub reconcile_seconds: Histogram,
    pub rescale_step_seconds: Family<StepLabels, Histogram>,
    rescale_step: Family<StepLabels, Gauge>,
    pub snapshot_seconds: Family<SnapshotLabels, Histogram>,
    pub snapshot_failures: Family<SnapshotLabels, Counter>,
    pub restarts: Family<JobLabels, Counter>,
    last_checkpoint_timestamp: Family<JobLabels, FloatGauge>,
    last_checkpoint_bytes: Family<JobLabels, Gauge>,
    last_savepoint_timestamp: Family<JobLabels, FloatGauge>,
    last_savepoint_bytes: Family<JobLabels, Gauge>,
    checkpoint_interval: Family<JobLabels, FloatGauge>,
    phase: Family<PhaseLabels, Gauge>,
    job_ready: Family<JobLabels, Gauge>,
    job_stalled: Family<JobLabels, Gauge>,
    condition: Family<ConditionLabels, Gauge>,
    parallelism: Family<JobLabels, Gauge>,
    desired_parallelism: Family<JobLabels, Gauge>,
    source_lag_records: Family<JobLabels, Gauge>,
    source_lag_seconds: Family<JobLabels, Gauge>,
    /// The uid of the object each job's series describe (a new object of the same name starts
    /// them afresh).
    uids: Mutex<HashMap<JobLabels, String>>,
    /// Set once the controller watches (readiness).
    pub ready: Arc<AtomicBool>,
}

impl Default for OperatorMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl OperatorMetrics {
    pub fn new() -> Self {
        let m = OperatorMetrics {
            reconciles: Family::default(),
            reconcile_errors: Family::default(),
            reconcile_seconds: Histogram::new(exponential_buckets(
                0.001,
                2.0,
                RECONCILE_BUCKETS as u16,
            )),
            rescale_step_seconds: Family::new_with_constructor(job_seconds_histogram),
            rescale_step: Family::default(),
            snapshot_seconds: Family::new_with_constructor(job_seconds_histogram),
            snapshot_failures: Family::default(),
            restarts: Family::default(),
            last_checkpoint_timestamp: Family::default(),
            last_checkpoint_bytes: Family::default(),
            last_savepoint_timestamp: Family::default(),
            last_savepoint_bytes: Family::default(),
            checkpoint_interval: Family::default(),
            phase: Family::default(),
            job_ready: Family::default(),
            job_stalled: Family::default(),
            condition: Family::default(),
            parallelism: Family::default(),
            desired_parallelism: Family::default(),
            source_lag_records: Family::default(),
            source_lag_seconds: Family::default(),
            uids: Mutex::default(),
            ready: Arc::new(AtomicBool::new(false)),
            registry: Registry::default(),
        };
        let mut registry = Registry::default();
        keyshift_runtime::runtime::metrics::register_build_info(&mut registry, "operator");
        {
            let op = registry.sub_registry_with_prefix("keyshift_operator");
            op.register(
                "reconciles",
                "Reconcile passes, per job",
                m.reconciles.clone(),
            );
            op.register(
                "reconcile_errors",
                "Reconcile passes that failed (retried with backoff), per job and kind of failure",
                m.reconcile_errors.clone(),
            );
            op.register(
                "reconcile_duration_seconds",
                "Duration of a reconcile pass",
                m.reconcile_seconds.clone(),
            );
        }
        let job = registry.sub_registry_with_prefix("keyshift_job");
        job.register(
            "rescale_step_duration_seconds",
            "Duration of each finished step of a rescale or upgrade (Savepointing, Verifying, Stopping, Restoring)",
            m.rescale_step_seconds.clone(),
        );
        job.register(
            "rescale_step",
            "1 while the job's rescale or upgrade is in this step (absent when none is in flight)",
            m.rescale_step.clone(),
        );
        job.register(
            "snapshot_duration_seconds",
            "Trigger-to-commit duration of checkpoints and savepoints",
            m.snapshot_seconds.clone(),
        );
        job.register(
            "snapshot_failures",
            "Checkpoints and savepoints that failed",
            m.snapshot_failures.clone(),
        );
        job.register(
            "restarts",
            "Restarts of the job from its last checkpoint after a worker failure",
            m.restarts.clone(),
        );
        job.register(
            "last_checkpoint_timestamp_seconds",
            "When the newest snapshot the job would restart from (status.lastCheckpoint or status.lastSavepoint, whichever is newer) completed, in Unix seconds; its age is time() minus this",
            m.last_checkpoint_timestamp.clone(),
        );
        job.register(
            "last_checkpoint_size_bytes",
            "State bytes of that snapshot",
            m.last_checkpoint_bytes.clone(),
        );
        job.register(
            "last_savepoint_timestamp_seconds",
            "When status.lastSavepoint completed, in Unix seconds",
            m.last_savepoint_timestamp.clone(),
        );
        job.register(
            "last_savepoint_size_bytes",
            "State bytes of status.lastSavepoint",
            m.last_savepoint_bytes.clone(),
        );
        job.register(
            "checkpoint_interval_seconds",
            "spec.state.checkpointInterval",
            m.checkpoint_interval.clone(),
        );
        job.register(
            "phase",
            "1 for the job's phase (status.phase), 0 for the others",
            m.phase.clone(),
        );
        job.register(
            "ready",
            "1 while the job's Ready condition is True",
            m.job_ready.clone(),
        );
        job.register(
            "stalled",
            "1 while the job's Stalled condition is True: it cannot run until its spec or environment is fixed",
            m.job_stalled.clone(),
        );
        job.register(
            "condition",
            "1 while the job's condition named by the condition label (Ready, Reconciling, Stalled, KeyGroupsBalanced, AllSubtasksHavePartitions, SinkPublished, NewestSnapshotRestored, CheckpointsHealthy, KafkaReachable) is True, 0 while it is False; absent while it is Unknown or not set",
            m.condition.clone(),
        );
        job.register(
            "parallelism",
            "The parallelism the job runs at (status.replicas)",
            m.parallelism.clone(),
        );
        job.register(
            "desired_parallelism",
            "The parallelism the spec asks for (spec.replicas; 0 while suspended)",
            m.desired_parallelism.clone(),
        );
        job.register(
            "source_lag_records",
            "A Kafka source's records behind over all its partitions (status.source.lag.records; absent for other sources)",
            m.source_lag_records.clone(),
        );
        job.register(
            "source_lag_seconds",
            "A Kafka source's seconds behind, the most of its partitions (status.source.lag.seconds; absent for other sources and while unknown)",
            m.source_lag_seconds.clone(),
        );
        OperatorMetrics { registry, ..m }
    }

    /// OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }

    pub fn job(namespace: &str, job: &str) -> JobLabels {
        JobLabels {
            namespace: namespace.to_owned(),
            streamjob: job.to_owned(),
        }
    }

    pub fn step(namespace: &str, job: &str, step: Step) -> StepLabels {
        StepLabels {
            namespace: namespace.to_owned(),
            streamjob: job.to_owned(),
            step: Shown(step),
        }
    }

    pub fn snapshot(namespace: &str, job: &str, kind: SnapshotKind) -> SnapshotLabels {
        SnapshotLabels {
            namespace: namespace.to_owned(),
            streamjob: job.to_owned(),
            kind: Shown(kind),
        }
    }

    pub fn condition(namespace: &str, job: &str, condition: &'static str) -> ConditionLabels {
        ConditionLabels {
            namespace: namespace.to_owned(),
            streamjob: job.to_owned(),
            condition,
        }
    }

    pub fn error(namespace: &str, job: &str, kind: ErrorKind) -> ErrorLabels {
        ErrorLabels {
            namespace: namespace.to_owned(),
            streamjob: job.to_owned(),
            kind,
        }
    }

    /// Records the object the job's series describe. A different uid than before means the job
    /// was deleted and created again (while this operator did not see it go): the old object's
    /// series (its counters above all) are removed first.
    pub fn observe_uid(&self, namespace: &str, job: &str, uid: &str) {
        let key = Self::job(namespace, job);
        let replaced = {
            let mut uids = self.uids.lock().unwrap_or_else(|p| p.into_inner());
            match uids.insert(key, uid.to_owned()) {
                Some(old) => old != uid,
                None => false,
            }
        };
        if replaced {
            self.remove_series(namespace, job);
        }
    }

    /// Sets the job's gauges from its spec and the status just written: phase, conditions,
    /// parallelism, checkpoint interval, the newest snapshots and the step of a rescale or
    /// upgrade in flight. Taken from status, so an operator that restarts shows them at once.
    pub fn observe_status(
        &self,
        namespace: &str,
        job: &str,
        spec: &StreamJobSpec,
        status: &StreamJobStatus,
    ) {
        let labels = Self::job(namespace, job);
        // The job's counters exist at 0 from its first pass, so that increase() and rate() see
        // their first step (a series that appears at 1 shows no increase).
        drop(self.restarts.get_or_create(&labels));
        for kind in ALL_SNAPSHOT_KINDS {
            drop(
                self.snapshot_failures
                    .get_or_create(&Self::snapshot(namespace, job, kind)),
            );
        }
        for p in ALL_PHASES {
            self.phase
                .get_or_create(&PhaseLabels {
                    namespace: namespace.to_owned(),
                    streamjob: job.to_owned(),
                    phase: p,
                })
                .set(i64::from(status.phase == Some(p)));
        }
        let condition = |kind: &str| {
            status
                .conditions
                .iter()
                .any(|c| c.type_ == kind && c.status == "True")
        };
        self.job_ready
            .get_or_create(&labels)
            .set(i64::from(condition("Ready")));
        self.job_stalled
            .get_or_create(&labels)
            .set(i64::from(condition("Stalled")));
        for kind in ALL_CONDITIONS {
            let l = Self::condition(namespace, job, kind);
            let status = status.conditions.iter().find(|c| c.type_ == kind);
            match status.map(|c| c.status.as_str()) {
                Some("True") => drop(self.condition.get_or_create(&l).set(1)),
                Some("False") => drop(self.condition.get_or_create(&l).set(0)),
                _ => drop(self.condition.remove(&l)),
            }
        }
        self.parallelism
            .get_or_create(&labels)
            .set(i64::from(status.replicas.unwrap_or(0)));
        self.desired_parallelism
            .get_or_create(&labels)
            .set(i64::from(settings::desired_parallelism(spec)));
        self.checkpoint_interval
            .get_or_create(&labels)
            .set(settings::checkpoint_interval(spec).as_secs_f64());
        let completed = |r: &crate::crd::SnapshotRef| {
            r.time
                .parse::<jiff::Timestamp>()
                .ok()
                .map(|t| (t.as_millisecond() as f64 / 1000.0, r.size_bytes))
        };
        let checkpoint = status.last_checkpoint.as_ref().and_then(completed);
        let savepoint = status.last_savepoint.as_ref().and_then(completed);
        let newest = match (checkpoint, savepoint) {
            (Some(c), Some(s)) => Some(if s.0 > c.0 { s } else { c }),
            (c, s) => c.or(s),
        };
        set_or_remove(
            &self.last_checkpoint_timestamp,
            &labels,
            newest.map(|n| n.0),
        );
        set_or_remove(
            &self.last_checkpoint_bytes,
            &labels,
            newest.and_then(|n| n.1),
        );
        set_or_remove(
            &self.last_savepoint_timestamp,
            &labels,
            savepoint.map(|s| s.0),
        );
        set_or_remove(
            &self.last_savepoint_bytes,
            &labels,
            savepoint.and_then(|s| s.1),
        );
        let lag = status.source.as_ref().and_then(|s| s.lag.as_ref());
        set_or_remove(&self.source_lag_records, &labels, lag.map(|l| l.records));
        set_or_remove(
            &self.source_lag_seconds,
            &labels,
            lag.and_then(|l| l.seconds),
        );
        let current = status
            .rescale
            .as_ref()
            .map(|r| r.step)
            .filter(|s| s.active());
        for step in ALL_STEPS {
            let l = Self::step(namespace, job, step);
            if current == Some(step) {
                self.rescale_step.get_or_create(&l).set(1);
            } else {
                self.rescale_step.remove(&l);
            }
        }
    }

    /// Whether the job's series are kept: its object was seen by a pass and not forgotten since.
    pub fn tracks(&self, namespace: &str, job: &str) -> bool {
        self.uids
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(&Self::job(namespace, job))
    }

    /// Whether a pass over the job is counted: not when the job is on its way out and its
    /// cleanup already removed its series (a pass after the cleanup, from a cache that has not
    /// yet seen the finalizer go or failing to remove it, would bring back a series of the
    /// deleted job for good).
    fn counts(&self, namespace: &str, job: &str, deleting: bool) -> bool {
        !deleting || self.tracks(namespace, job)
    }

    /// Counts a failed pass of the job, by kind ([`Self::counts`]).
    pub fn record_error(&self, namespace: &str, job: &str, deleting: bool, kind: ErrorKind) {
        if !self.counts(namespace, job, deleting) {
            return;
        }
        self.reconcile_errors
            .get_or_create(&Self::error(namespace, job, kind))
            .inc();
    }

    /// Counts a finished pass of the job ([`Self::counts`]; the cleanup pass itself forgets the
    /// job before it ends, so it is not counted either).
    pub fn record_pass(&self, namespace: &str, job: &str, deleting: bool) {
        if !self.counts(namespace, job, deleting) {
            return;
        }
        self.reconciles
            .get_or_create(&Self::job(namespace, job))
            .inc();
    }

    /// Removes every series of the job: it was deleted (or is no longer this operator's).
    pub fn forget_job(&self, namespace: &str, job: &str) {
        self.uids
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&Self::job(namespace, job));
        self.remove_series(namespace, job);
    }

    fn remove_series(&self, namespace: &str, job: &str) {
        let labels = Self::job(namespace, job);
        for family in [
            &self.last_checkpoint_timestamp,
            &self.last_savepoint_timestamp,
            &self.checkpoint_interval,
        ] {
            family.remove(&labels);
        }
        for family in [
            &self.last_checkpoint_bytes,
            &self.last_savepoint_bytes,
            &self.job_ready,
            &self.job_stalled,
            &self.parallelism,
            &self.desired_parallelism,
            &self.source_lag_records,
            &self.source_lag_seconds,
        ] {
            family.remove(&labels);
        }
        self.reconciles.remove(&labels);
        self.restarts.remove(&labels);
        for kind in ErrorKind::ALL {
            self.reconcile_errors
                .remove(&Self::error(namespace, job, kind));
        }
        for step in ALL_STEPS {
            let l = Self::step(namespace, job, step);
            self.rescale_step_seconds.remove(&l);
            self.rescale_step.remove(&l);
        }
        for kind in ALL_SNAPSHOT_KINDS {
            let l = Self::snapshot(namespace, job, kind);
            self.snapshot_seconds.remove(&l);
            self.snapshot_failures.remove(&l);
        }
        for phase in ALL_PHASES {
            self.phase.remove(&PhaseLabels {
                namespace: namespace.to_owned(),
                streamjob: job.to_owned(),
                phase,
            });
        }
        for kind in ALL_CONDITIONS {
            self.condition
                .remove(&Self::condition(namespace, job, kind));
        }
    }
}

/// A gauge that exists only while its value is known.
fn set_or_remove<N, A>(
    family: &Family<JobLabels, Gauge<N, A>>,
    labels: &JobLabels,
    value: Option<N>,
) where
    A: prometheus_client::metrics::gauge::Atomic<N> + Default,
    Gauge<N, A>: Default,
{
    match value {
        Some(v) => {
            family.get_or_create(labels).set(v);
        }
        None => {
            family.remove(labels);
        }
    }
}

/// Serves `/metrics`, `/healthz` and `/readyz` until the process ends.
pub async fn serve(
    addr: std::net::SocketAddr,
    metrics: Arc<OperatorMetrics>,
) -> std::io::Result<()> {
    use axum::http::StatusCode;
    use axum::routing::get;
    let m = metrics.clone();
    let r = metrics.ready.clone();
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let m = m.clone();
                async move {
                    (
                        [(
                            "content-type",
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        m.encode(),
                    )
                }
            }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(move || {
                let r = r.clone();
                async move {
                    if r.load(Ordering::Relaxed) {
                        (StatusCode::OK, "ok")
                    } else {
                        (StatusCode::SERVICE_UNAVAILABLE, "starting")
                    }
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind(addr).await?;
    axum::serve(listener, app).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{RescaleStatus, SnapshotRef};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

    fn spec() -> StreamJobSpec {
        serde_yaml::from_str(
            "replicas: 4\njob:\n  source: {generator: {partitions: 4, keys: 10}}\n  key: {field: key, type: string}\n  aggregation: {function: count}\n  sink: {type: log}\nstate:\n  checkpointInterval: 45s\n",
        )
        .expect("a valid spec")
    }

    fn snapshot(time: &str, size: i64) -> SnapshotRef {
        SnapshotRef {
            id: 1,
            path: "file:///s".into(),
            time: time.into(),
            parallelism: 4,
            size_bytes: Some(size),
            source_partitions: None,
            snapshot: None,
        }
    }

    fn condition(kind: &str, status: &str) -> Condition {
        Condition {
            type_: kind.into(),
            status: status.into(),
            reason: "R".into(),
            message: String::new(),
            last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ),
            observed_generation: None,
        }
    }

    /// A status with every status-derived series present: both snapshots, a rescale in
    /// `step`, every condition set (Ready, and Stalled False).
    fn busy_status(step: Step) -> StreamJobStatus {
        StreamJobStatus {
            phase: Some(Phase::Rescaling),
            replicas: Some(4),
            last_checkpoint: Some(snapshot("2026-01-01T00:00:10Z", 100)),
            last_savepoint: Some(snapshot("2026-01-01T00:00:20.500Z", 250)),
            rescale: Some(RescaleStatus {
                step,
                ..Default::default()
            }),
            conditions: ALL_CONDITIONS
                .iter()
                .map(|&c| condition(c, if c == "Stalled" { "False" } else { "True" }))
                .collect(),
            source: Some(crate::crd::SourceStatus {
                lag: Some(crate::crd::SourceLagStatus {
                    records: 1200,
                    seconds: Some(7),
                    ..Default::default()
                }),
            }),
            ..Default::default()
        }
    }

    /// Every series the code can make for one job: each error kind, each active step's
    /// duration, both snapshot kinds, every status-derived gauge.
    fn fill_job(m: &OperatorMetrics, ns: &str, job: &str) {
        m.reconciles
            .get_or_create(&OperatorMetrics::job(ns, job))
            .inc();
        m.restarts
            .get_or_create(&OperatorMetrics::job(ns, job))
            .inc();
        for kind in ErrorKind::ALL {
            m.reconcile_errors
                .get_or_create(&OperatorMetrics::error(ns, job, kind))
                .inc();
        }
        for step in ALL_STEPS.into_iter().filter(|s| s.active()) {
            m.rescale_step_seconds
                .get_or_create(&OperatorMetrics::step(ns, job, step))
                .observe(2.0);
        }
        for kind in ALL_SNAPSHOT_KINDS {
            let l = OperatorMetrics::snapshot(ns, job, kind);
            m.snapshot_seconds.get_or_create(&l).observe(0.3);
            m.snapshot_failures.get_or_create(&l).inc();
        }
        m.observe_status(ns, job, &spec(), &busy_status(Step::Verifying));
    }

    /// Sample lines (series) of the exposition whose labels name `job`.
    fn series_of(text: &str, job: &str) -> Vec<String> {
        let needle = format!("streamjob=\"{job}\"");
        text.lines()
            .filter(|l| !l.starts_with('#') && l.contains(&needle))
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn every_condition_is_a_gauge_while_it_is_true_or_false() {
        let m = OperatorMetrics::new();
        let mut status = busy_status(Step::Done);
        status.conditions = vec![
            condition("KafkaReachable", "False"),
            condition("SinkPublished", "True"),
            condition("CheckpointsHealthy", "Unknown"),
        ];
        m.observe_status("ns", "j", &spec(), &status);
        let series = |c: &str| {
            format!("keyshift_job_condition{{namespace=\"ns\",streamjob=\"j\",condition=\"{c}\"}}")
        };
        let text = m.encode();
        assert!(
            text.contains(&format!("{} 0", series("KafkaReachable"))),
            "{text}"
        );
        assert!(
            text.contains(&format!("{} 1", series("SinkPublished"))),
            "{text}"
        );
        assert!(
            !text.contains(&series("CheckpointsHealthy")),
            "Unknown has no series: {text}"
        );
        assert!(
            !text.contains(&series("Ready")),
            "nor has a condition not set: {text}"
        );
        // The broker is reached again and the sink condition goes: the series follow.
        status.conditions = vec![condition("KafkaReachable", "True")];
        m.observe_status("ns", "j", &spec(), &status);
        let text = m.encode();
        assert!(
            text.contains(&format!("{} 1", series("KafkaReachable"))),
            "{text}"
        );
        assert!(!text.contains(&series("SinkPublished")), "{text}");
    }

    #[test]
    fn names_follow_prometheus_conventions() {
        let m = OperatorMetrics::new();
        fill_job(&m, "ns", "j");
        m.reconcile_seconds.observe(0.01);
        let text = m.encode();
        assert!(
            text.contains("keyshift_operator_reconciles_total{namespace=\"ns\",streamjob=\"j\"} 1"),
            "{text}"
        );
        assert!(
            text.contains(
                "keyshift_operator_reconcile_errors_total{namespace=\"ns\",streamjob=\"j\",kind=\"storage\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains("keyshift_job_rescale_step_duration_seconds_bucket{le=\"5.0\",namespace=\"ns\",streamjob=\"j\",step=\"Savepointing\"} 1")
                || text.contains("keyshift_job_rescale_step_duration_seconds_bucket{namespace=\"ns\",streamjob=\"j\",step=\"Savepointing\",le=\"5.0\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("keyshift_job_snapshot_failures_total{namespace=\"ns\",streamjob=\"j\",kind=\"savepoint\"} 1"),
            "{text}"
        );
        // The newest snapshot is the savepoint (20.5 s after the epoch of the day).
        assert!(
            text.contains("keyshift_job_last_checkpoint_timestamp_seconds{namespace=\"ns\",streamjob=\"j\"} 1767225620.5"),
            "{text}"
        );
        assert!(
            text.contains(
                "keyshift_job_last_checkpoint_size_bytes{namespace=\"ns\",streamjob=\"j\"} 250"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "keyshift_job_checkpoint_interval_seconds{namespace=\"ns\",streamjob=\"j\"} 45.0"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "keyshift_job_phase{namespace=\"ns\",streamjob=\"j\",phase=\"Rescaling\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "keyshift_job_phase{namespace=\"ns\",streamjob=\"j\",phase=\"Running\"} 0"
            ),
            "{text}"
        );
        assert!(
            text.contains("keyshift_job_ready{namespace=\"ns\",streamjob=\"j\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("keyshift_job_stalled{namespace=\"ns\",streamjob=\"j\"} 0"),
            "{text}"
        );
        // Every counter's samples end in _total; nothing is in milliseconds.
        for line in text.lines() {
            if let Some(name) = line.strip_prefix("# TYPE ") {
                let mut parts = name.split(' ');
                let (family, kind) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
                assert!(
                    family.starts_with("keyshift_operator_")
                        || family.starts_with("keyshift_job_")
                        || (family, kind) == ("keyshift_build", "info"),
                    "{line}"
                );
                assert!(
                    !family.contains("millis") && !family.ends_with("_ms"),
                    "{line}"
                );
                if kind == "counter" {
                    let samples: Vec<&str> = text
                        .lines()
                        .filter(|l| !l.starts_with('#') && l.starts_with(family))
                        .collect();
                    assert!(
                        samples
                            .iter()
                            .all(|s| s.starts_with(&format!("{family}_total"))),
                        "{samples:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_rescale_step_gauge_shows_only_the_step_in_flight() {
        let m = OperatorMetrics::new();
        m.observe_status("ns", "j", &spec(), &busy_status(Step::Stopping));
        m.observe_status("ns", "j", &spec(), &busy_status(Step::Restoring));
        let text = m.encode();
        let steps: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("keyshift_job_rescale_step{"))
            .collect();
        assert_eq!(
            steps,
            ["keyshift_job_rescale_step{namespace=\"ns\",streamjob=\"j\",step=\"Restoring\"} 1"]
        );
        m.observe_status("ns", "j", &spec(), &busy_status(Step::Done));
        assert!(!m.encode().contains("keyshift_job_rescale_step{"));
    }

    #[test]
    fn a_deleted_job_loses_every_series_and_others_keep_theirs() {
        let m = OperatorMetrics::new();
        fill_job(&m, "ns", "gone");
        fill_job(&m, "ns", "kept");
        let before = m.encode();
        assert_eq!(
            series_of(&before, "gone").len(),
            max_series_per_job(),
            "{before}"
        );
        m.forget_job("ns", "gone");
        let after = m.encode();
        assert_eq!(series_of(&after, "gone"), Vec::<String>::new());
        assert_eq!(series_of(&after, "kept"), series_of(&before, "kept"));
    }

    #[test]
    fn a_pass_failing_after_the_cleanup_brings_no_series_back() {
        let m = OperatorMetrics::new();
        m.observe_uid("ns", "j", "uid-1");
        // A failed pass while the job runs, and one while it is being deleted (before its
        // cleanup), are counted.
        m.record_error("ns", "j", false, ErrorKind::Storage);
        m.record_error("ns", "j", true, ErrorKind::Platform);
        assert_eq!(series_of(&m.encode(), "j").len(), 2, "{}", m.encode());
        m.forget_job("ns", "j");
        // After the cleanup: a failure of the deleting job's last pass is not.
        m.record_error("ns", "j", true, ErrorKind::Platform);
        assert_eq!(series_of(&m.encode(), "j"), Vec::<String>::new());
        // A job of the same name created again counts its failures from the start.
        m.record_error("ns", "j", false, ErrorKind::Platform);
        assert_eq!(series_of(&m.encode(), "j").len(), 1);
    }

    #[test]
    fn the_cleanup_pass_and_any_after_it_bring_no_series_back() {
        let m = OperatorMetrics::new();
        m.observe_uid("ns", "j", "uid-1");
        m.record_pass("ns", "j", false);
        // A pass over the deleting job before its cleanup is counted.
        m.record_pass("ns", "j", true);
        let text = m.encode();
        assert!(
            text.contains("keyshift_operator_reconciles_total{namespace=\"ns\",streamjob=\"j\"} 2"),
            "{text}"
        );
        // The cleanup pass forgets the job before it ends; neither it nor a later pass from a
        // stale cache counts.
        m.forget_job("ns", "j");
        m.record_pass("ns", "j", true);
        m.record_pass("ns", "j", true);
        assert_eq!(series_of(&m.encode(), "j"), Vec::<String>::new());
        // A job of the same name created again is counted.
        m.record_pass("ns", "j", false);
        assert_eq!(series_of(&m.encode(), "j").len(), 1);
    }

    #[test]
    fn a_job_created_again_under_its_name_starts_its_series_afresh() {
        let m = OperatorMetrics::new();
        m.observe_uid("ns", "j", "uid-1");
        fill_job(&m, "ns", "j");
        // The same object again: nothing is reset.
        m.observe_uid("ns", "j", "uid-1");
        assert_eq!(series_of(&m.encode(), "j").len(), max_series_per_job());
        // A new object of the same name (the old one deleted while unseen): its counters start
        // at zero, not at the old object's counts.
        m.observe_uid("ns", "j", "uid-2");
        assert_eq!(series_of(&m.encode(), "j"), Vec::<String>::new());
        m.restarts
            .get_or_create(&OperatorMetrics::job("ns", "j"))
            .inc();
        assert!(
            m.encode()
                .contains("keyshift_job_restarts_total{namespace=\"ns\",streamjob=\"j\"} 1")
        );
    }

    /// The count docs/operations.md states: the series of 500 jobs, each with every series the
    /// code can make, counted in the exposition.
    #[test]
    fn five_hundred_jobs_make_a_bounded_number_of_series() {
        let m = OperatorMetrics::new();
        m.reconcile_seconds.observe(0.01);
        for i in 0..500 {
            fill_job(&m, &format!("ns{}", i % 7), &format!("job-{i}"));
        }
        let text = m.encode();
        let series = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .count();
        assert_eq!(series, 500 * max_series_per_job() + operator_series());
        let docs = std::fs::read_to_string(crate::fixtures::repo_root().join("docs/operations.md"))
            .expect("docs/operations.md");
        let stated = format!("500 jobs make at most {series} series");
        assert!(
            docs.contains(&stated),
            "docs/operations.md must say: {stated}"
        );
        let per_job = format!("{} series per job", max_series_per_job());
        assert!(
            docs.contains(&per_job),
            "docs/operations.md must say: {per_job}"
        );
        // Removing them all leaves the operator's own.
        for i in 0..500 {
            m.forget_job(&format!("ns{}", i % 7), &format!("job-{i}"));
        }
        let left = m.encode();
        assert_eq!(
            left.lines()
                .filter(|l| !l.starts_with('#') && !l.is_empty())
                .count(),
            operator_series()
        );
    }

    #[test]
    fn the_phase_label_is_the_crd_value() {
        for p in ALL_PHASES {
            assert_eq!(
                serde_json::to_value(p).expect("serializes"),
                serde_json::Value::String(phase_name(p).into())
            );
        }
    }

    /// The sample names (what PromQL can select) of a fully populated exposition.
    fn sample_names(text: &str) -> std::collections::BTreeSet<String> {
        text.lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .filter_map(|l| l.split(['{', ' ']).next())
            .map(str::to_owned)
            .collect()
    }

    /// tests/monitoring/metric-names.txt is every sample name the operator and a worker expose:
    /// hack/check-monitoring.sh checks that the chart's dashboard and alerts use no other. With
    /// `KEYSHIFT_BLESS=1` the file is written instead. docs/operations.md's table names every
    /// family too.
    #[test]
    fn the_committed_metric_names_are_what_keyshift_exposes() {
        let m = OperatorMetrics::new();
        fill_job(&m, "ns", "j");
        m.reconcile_seconds.observe(0.01);
        let worker = crate::runtime::metrics::WorkerMetrics::new();
        let mut names = sample_names(&m.encode());
        names.extend(sample_names(&worker.encode().expect("encodes")));
        let mut text = String::from(
            "# Every sample name keyshift exposes (operator and worker), kept by\n# src/operator/metrics.rs's test (KEYSHIFT_BLESS=1 rewrites it); read by hack/check-monitoring.sh.\n",
        );
        for n in &names {
            text.push_str(n);
            text.push('\n');
        }
        let root = crate::fixtures::repo_root();
        let path = root.join("tests/monitoring/metric-names.txt");
        if std::env::var_os("KEYSHIFT_BLESS").is_some() {
            std::fs::write(&path, &text).expect("writes the names");
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert_eq!(
            committed,
            text,
            "{} is stale: run this test with KEYSHIFT_BLESS=1",
            path.display()
        );
        let docs = std::fs::read_to_string(root.join("docs/operations.md")).expect("docs");
        let families: std::collections::BTreeSet<String> = m
            .encode()
            .lines()
            .chain(worker.encode().expect("encodes").lines())
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split_once(' '))
            .map(|(name, kind)| match kind {
                "counter" => format!("{name}_total"),
                "info" => format!("{name}_info"),
                _ => name.to_owned(),
            })
            .collect();
        for f in &families {
            assert!(
                docs.contains(&format!("| `{f}` |")),
                "docs/operations.md's table lacks {f}"
            );
        }
    }
}
