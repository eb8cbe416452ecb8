//! Prometheus metrics of a worker, served at `/metrics`.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The worker's counters and gauges (cheap atomics, also read by the status endpoint).
pub struct WorkerMetrics {
    registry: Registry,
    pub records_in: Counter,
    pub records_processed: Counter,
    pub records_out: Counter,
    pub backpressure_ms: Counter,
    pub restore_bytes: Counter,
    pub late_records: Gauge,
    pub keys: Gauge,
    pub watermark: Gauge,
    pub checkpoint_ms: Gauge,
    pub checkpoint_bytes: Gauge,
}

impl Default for WorkerMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl WorkerMetrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("keyshift_worker");
        let m = WorkerMetrics {
            records_in: Counter::default(),
            records_processed: Counter::default(),
            records_out: Counter::default(),
            backpressure_ms: Counter::default(),
            restore_bytes: Counter::default(),
            late_records: Gauge::default(),
            keys: Gauge::default(),
            watermark: Gauge::default(),
            checkpoint_ms: Gauge::default(),
            checkpoint_bytes: Gauge::default(),
            registry: Registry::default(),
        };
        registry.register(
            "records_in",
            "Records read by this subtask's sources",
            m.records_in.clone(),
        );
        registry.register(
            "records_processed",
            "Records applied to keyed state by this subtask",
            m.records_processed.clone(),
        );
        registry.register(
            "records_out",
            "Results emitted to the sink",
            m.records_out.clone(),
        );
        registry.register(
            "backpressure_milliseconds",
            "Time the sources waited on full downstream buffers",
            m.backpressure_ms.clone(),
        );
        registry.register(
            "restore_bytes",
            "Bytes of state read from snapshots when starting",
            m.restore_bytes.clone(),
        );
        registry.register(
            "late_records",
            "Records that arrived after their window had fired (counted, not applied)",
            m.late_records.clone(),
        );
        registry.register("keys", "Keys held in keyed state", m.keys.clone());
        registry.register(
            "watermark_milliseconds",
            "The keyed operator's event-time watermark",
            m.watermark.clone(),
        );
        registry.register(
            "last_checkpoint_duration_milliseconds",
            "Barrier-to-durable time of the last snapshot",
            m.checkpoint_ms.clone(),
        );
        registry.register(
            "last_checkpoint_bytes",
            "State bytes written by the last snapshot",
            m.checkpoint_bytes.clone(),
        );
        WorkerMetrics { registry, ..m }
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}
