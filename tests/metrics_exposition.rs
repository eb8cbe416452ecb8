//! Both `/metrics` endpoints, the operator's and a worker's, served over HTTP and parsed by
//! Prometheus' reference parser (the Python client's OpenMetrics parser, through
//! tests/monitoring/check_exposition.py), which also checks the names and types against
//! Prometheus' conventions: counters end in `_total`, base units, nothing in milliseconds, no
//! `job`/`instance` label. tests/e2e_helm.rs runs the same check on a deployed operator.

mod support;

use keyshift::crd::{Phase, RescaleStatus, SnapshotRef, StreamJobSpec, StreamJobStatus};
use keyshift::operator::metrics::OperatorMetrics;
use keyshift::orchestrator::pass::ErrorKind;
use keyshift::orchestrator::step::Step;
use keyshift::runtime::worker::{self, WorkerConfig};
use keyshift::snapshot::SnapshotKind;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// The families of the endpoint at `url` by name, with their types.
fn check(url: &str) -> BTreeMap<String, String> {
    support::check_exposition(url)
}

fn spec() -> StreamJobSpec {
    serde_yaml::from_str(
        "replicas: 2\njob:\n  source: {generator: {partitions: 2, keys: 10}}\n  key: {field: key, type: string}\n  aggregation: {function: count}\n  sink: {type: log}\n",
    )
    .expect("a valid spec")
}

#[tokio::test]
async fn the_operator_endpoint_parses_and_follows_the_conventions() {
    let m = Arc::new(OperatorMetrics::new());
    // Every family with a series: a job mid-rescale with snapshots, errors, restarts.
    let (ns, job) = ("team-a", "clicks");
    m.reconciles
        .get_or_create(&OperatorMetrics::job(ns, job))
        .inc();
    m.reconcile_errors
        .get_or_create(&OperatorMetrics::error(ns, job, ErrorKind::Storage))
        .inc();
    m.reconcile_seconds.observe(0.02);
    m.rescale_step_seconds
        .get_or_create(&OperatorMetrics::step(ns, job, Step::Savepointing))
        .observe(1.5);
    m.snapshot_seconds
        .get_or_create(&OperatorMetrics::snapshot(
            ns,
            job,
            SnapshotKind::Checkpoint,
        ))
        .observe(0.2);
    m.snapshot_failures
        .get_or_create(&OperatorMetrics::snapshot(ns, job, SnapshotKind::Savepoint))
        .inc();
    m.restarts
        .get_or_create(&OperatorMetrics::job(ns, job))
        .inc();
    let at = |time: &str| SnapshotRef {
        id: 3,
        path: "s3://b/team-a/clicks/checkpoints/chk-3".into(),
        time: time.into(),
        parallelism: 2,
        size_bytes: Some(4096),
        source_partitions: None,
        snapshot: None,
    };
    let status = StreamJobStatus {
        phase: Some(Phase::Rescaling),
        replicas: Some(2),
        last_checkpoint: Some(at("2026-03-01T10:00:00Z")),
        last_savepoint: Some(at("2026-03-01T10:05:00Z")),
        rescale: Some(RescaleStatus {
            step: Step::Verifying,
            ..Default::default()
        }),
        source: Some(keyshift::crd::SourceStatus {
            lag: Some(keyshift::crd::SourceLagStatus {
                records: 1200,
                seconds: Some(7),
                ..Default::default()
            }),
        }),
        ..Default::default()
    };
    m.observe_status(ns, job, &spec(), &status);

    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        l.local_addr().expect("address").port()
    };
    let addr = format!("127.0.0.1:{port}").parse().expect("address");
    let server = tokio::spawn(keyshift::operator::metrics::serve(addr, m.clone()));
    let url = format!("http://127.0.0.1:{port}/metrics");
    let client = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client");
    let mut up = false;
    for _ in 0..100 {
        if client.get(&url).send().await.is_ok() {
            up = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(up, "the metrics server answers");
    let url2 = url.clone();
    let families = tokio::task::spawn_blocking(move || check(&url2))
        .await
        .expect("checked");
    server.abort();
    for (name, kind) in [
        ("keyshift_operator_reconciles", "counter"),
        ("keyshift_operator_reconcile_errors", "counter"),
        ("keyshift_operator_reconcile_duration_seconds", "histogram"),
        ("keyshift_job_rescale_step_duration_seconds", "histogram"),
        ("keyshift_job_rescale_step", "gauge"),
        ("keyshift_job_snapshot_duration_seconds", "histogram"),
        ("keyshift_job_snapshot_failures", "counter"),
        ("keyshift_job_restarts", "counter"),
        ("keyshift_job_last_checkpoint_timestamp_seconds", "gauge"),
        ("keyshift_job_last_checkpoint_size_bytes", "gauge"),
        ("keyshift_job_last_savepoint_timestamp_seconds", "gauge"),
        ("keyshift_job_last_savepoint_size_bytes", "gauge"),
        ("keyshift_job_checkpoint_interval_seconds", "gauge"),
        ("keyshift_job_phase", "gauge"),
        ("keyshift_job_ready", "gauge"),
        ("keyshift_job_stalled", "gauge"),
        ("keyshift_job_parallelism", "gauge"),
        ("keyshift_job_desired_parallelism", "gauge"),
        ("keyshift_job_source_lag_records", "gauge"),
        ("keyshift_job_source_lag_seconds", "gauge"),
        ("keyshift_build", "info"),
    ] {
        assert_eq!(
            families.get(name).map(String::as_str),
            Some(kind),
            "{name}: {families:?}"
        );
    }
    let text = m.encode();
    let build = text
        .lines()
        .find(|l| l.starts_with("keyshift_build_info{"))
        .expect("a build_info sample");
    assert!(build.contains("component=\"operator\""), "{build}");
}

#[tokio::test]
async fn a_worker_endpoint_parses_and_follows_the_conventions() {
    let loopback = "127.0.0.1:0".parse().expect("loopback");
    let bound = worker::bind(WorkerConfig {
        control_addr: loopback,
        data_addr: loopback,
        token: "metrics-test-token".to_owned(),
        programs: Default::default(),
    })
    .await
    .expect("bind");
    let url = format!("http://{}/metrics", bound.control_addr);
    let server = tokio::spawn(bound.serve(std::future::pending()));
    let families = tokio::task::spawn_blocking(move || check(&url))
        .await
        .expect("checked");
    server.abort();
    for (name, kind) in [
        ("keyshift_worker_records_in", "counter"),
        ("keyshift_worker_records_processed", "counter"),
        ("keyshift_worker_records_combined", "counter"),
        ("keyshift_worker_records_out", "counter"),
        ("keyshift_worker_backpressure_seconds", "counter"),
        ("keyshift_worker_late_records", "counter"),
        ("keyshift_worker_keys", "gauge"),
        ("keyshift_worker_watermark_timestamp_seconds", "gauge"),
        ("keyshift_worker_last_restore_size_bytes", "gauge"),
        ("keyshift_worker_last_restore_duration_seconds", "gauge"),
        ("keyshift_worker_last_checkpoint_duration_seconds", "gauge"),
        ("keyshift_worker_last_checkpoint_size_bytes", "gauge"),
        ("keyshift_worker_source_lag_records", "gauge"),
        ("keyshift_worker_source_lag_seconds", "gauge"),
        ("keyshift_worker_source_records_expired", "counter"),
        ("keyshift_build", "info"),
    ] {
        assert_eq!(
            families.get(name).map(String::as_str),
            Some(kind),
            "{name}: {families:?}"
        );
    }
    assert_eq!(families.len(), 16, "{families:?}");
    let text = keyshift::runtime::metrics::WorkerMetrics::new()
        .encode()
        .expect("encodes");
    let build = text
        .lines()
        .find(|l| l.starts_with("keyshift_build_info{"))
        .expect("a build_info sample");
    for label in [
        "component=\"worker\"".to_owned(),
        format!("version=\"{}\"", env!("CARGO_PKG_VERSION")),
        format!(
            "protocol=\"{}\"",
            keyshift::runtime::protocol::PROTOCOL_VERSION
        ),
    ] {
        assert!(build.contains(&label), "{build}");
    }
    assert!(build.ends_with(" 1"), "{build}");
}
