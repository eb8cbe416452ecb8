//! The operator's Prometheus metrics and its `/metrics`, `/healthz`, `/readyz` server.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct JobLabels {
    pub namespace: String,
    pub job: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StepLabels {
    pub namespace: String,
    pub job: String,
    pub step: String,
}

/// A failed reconcile pass: the job and what kind of failure it was
/// (`crate::orchestrator::pass::ErrorKind::label`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub namespace: String,
    pub job: String,
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub namespace: String,
    pub job: String,
    pub kind: String,
}

fn seconds_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 20))
}

/// Everything the operator counts.
pub struct OperatorMetrics {
    registry: Registry,
    pub reconciles: Family<JobLabels, Counter>,
    pub reconcile_errors: Family<ErrorLabels, Counter>,
    pub reconcile_seconds: Histogram,
    pub rescale_step_seconds: Family<StepLabels, Histogram>,
    pub snapshot_seconds: Family<KindLabels, Histogram>,
    pub snapshot_bytes: Family<KindLabels, Gauge>,
    /// When the latest checkpoint or savepoint of a job completed (Unix seconds): its age is
    /// `time() - keyshift_operator_last_snapshot_timestamp_seconds`.
    pub snapshot_timestamp: Family<KindLabels, Gauge>,
    pub snapshot_failures: Family<KindLabels, Counter>,
    pub worker_restarts: Family<JobLabels, Counter>,
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
        let mut registry = Registry::with_prefix("keyshift_operator");
        let m = OperatorMetrics {
            reconciles: Family::default(),
            reconcile_errors: Family::default(),
            reconcile_seconds: seconds_histogram(),
            rescale_step_seconds: Family::new_with_constructor(seconds_histogram),
            snapshot_seconds: Family::new_with_constructor(seconds_histogram),
            snapshot_bytes: Family::default(),
            snapshot_timestamp: Family::default(),
            snapshot_failures: Family::default(),
            worker_restarts: Family::default(),
            ready: Arc::new(AtomicBool::new(false)),
            registry: Registry::default(),
        };
        registry.register("reconciles", "Reconcile passes", m.reconciles.clone());
        registry.register(
            "reconcile_errors",
            "Reconcile passes that failed (retried with backoff)",
            m.reconcile_errors.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Duration of a reconcile pass",
            m.reconcile_seconds.clone(),
        );
        registry.register(
            "rescale_step_duration_seconds",
            "Duration of each rescale step (Savepointing, Verifying, Stopping, Restoring)",
            m.rescale_step_seconds.clone(),
        );
        registry.register(
            "snapshot_duration_seconds",
            "Trigger-to-commit duration of checkpoints and savepoints",
            m.snapshot_seconds.clone(),
        );
        registry.register(
            "snapshot_size_bytes",
            "State bytes of the latest checkpoint or savepoint",
            m.snapshot_bytes.clone(),
        );
        registry.register(
            "last_snapshot_timestamp_seconds",
            "When the latest checkpoint or savepoint of the job completed, in Unix seconds",
            m.snapshot_timestamp.clone(),
        );
        registry.register(
            "snapshot_failures",
            "Checkpoints and savepoints that failed",
            m.snapshot_failures.clone(),
        );
        registry.register(
            "job_restarts",
            "Restarts of a job from its last checkpoint after a worker failure",
            m.worker_restarts.clone(),
        );
        OperatorMetrics { registry, ..m }
    }

    /// Prometheus text exposition.
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
            job: job.to_owned(),
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

    #[test]
    fn encodes_families() {
        let m = OperatorMetrics::new();
        m.reconciles
            .get_or_create(&OperatorMetrics::job("ns", "j"))
            .inc();
        m.rescale_step_seconds
            .get_or_create(&StepLabels {
                namespace: "ns".into(),
                job: "j".into(),
                step: "Savepointing".into(),
            })
            .observe(0.5);
        let text = m.encode();
        assert!(
            text.contains("keyshift_operator_reconciles_total{namespace=\"ns\",job=\"j\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("keyshift_operator_rescale_step_duration_seconds_bucket"),
            "{text}"
        );
    }
}
