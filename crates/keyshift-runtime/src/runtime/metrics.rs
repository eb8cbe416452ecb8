//! Prometheus metrics of a worker (one subtask), served at `/metrics` on its control port.
//!
//! Names follow Prometheus' conventions: base units in the name (`_seconds`, `_bytes`), counters
//! end in `_total` (the encoder appends it to the registered name). A worker's series carry no
//! labels of their own: the subtask is the scrape target, and the chart's PodMonitor turns the
//! pod's `keyshift.dev/job` and `keyshift.dev/subtask` labels into `streamjob` and `subtask`.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

/// A gauge holding a float (seconds).
type FloatGauge = Gauge<f64, AtomicU64>;
/// A counter of a float quantity (seconds).
type FloatCounter = Counter<f64, AtomicU64>;

/// The worker's counters and gauges (cheap atomics, also read by the status endpoint).
pub struct WorkerMetrics {
    registry: Registry,
    pub records_in: Counter,
    pub records_processed: Counter,
    pub records_combined: Counter,
    pub records_out: Counter,
    pub backpressure_seconds: FloatCounter,
    pub late_records: Counter,
    pub keys: Gauge,
    /// The keyed operator's event-time watermark, in Unix seconds.
    pub watermark_seconds: FloatGauge,
    pub restore_bytes: Gauge,
    pub restore_seconds: FloatGauge,
    pub checkpoint_seconds: FloatGauge,
    pub checkpoint_bytes: Gauge,
    /// A Kafka source's records behind over this subtask's partitions.
    pub source_lag_records: Gauge,
    /// A Kafka source's seconds behind (the most of this subtask's partitions).
    pub source_lag_seconds: FloatGauge,
    /// Source records deleted (by a Kafka partition's retention) before the job read them,
    /// found at a start.
    pub source_records_expired: Counter,
}

impl Default for WorkerMetrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Registers `keyshift_build_info{component, version, protocol}` (always 1; Prometheus' info
/// convention): which build of keyshift's runtime serves the endpoint (`component`: `operator`
/// or `worker`), and the worker protocol it speaks. The operator's endpoint and every worker's,
/// a job's own worker binary's too, have it.
pub fn register_build_info(registry: &mut Registry, component: &str) {
    let labels = vec![
        ("component".to_owned(), component.to_owned()),
        ("version".to_owned(), env!("CARGO_PKG_VERSION").to_owned()),
        (
            "protocol".to_owned(),
            super::protocol::PROTOCOL_VERSION.to_string(),
        ),
    ];
    registry.register(
        "keyshift_build",
        "The build serving this endpoint: its component, keyshift version and worker protocol version",
        prometheus_client::metrics::info::Info::new(labels),
    );
}

impl WorkerMetrics {
    pub fn new() -> Self {
        let mut root = Registry::default();
        register_build_info(&mut root, "worker");
        let registry = root.sub_registry_with_prefix("keyshift_worker");
        let m = WorkerMetrics {
            records_in: Counter::default(),
            records_processed: Counter::default(),
            records_combined: Counter::default(),
            records_out: Counter::default(),
            backpressure_seconds: FloatCounter::default(),
            late_records: Counter::default(),
            keys: Gauge::default(),
            watermark_seconds: FloatGauge::default(),
            restore_bytes: Gauge::default(),
            restore_seconds: FloatGauge::default(),
            checkpoint_seconds: FloatGauge::default(),
            checkpoint_bytes: Gauge::default(),
            source_lag_records: Gauge::default(),
            source_lag_seconds: FloatGauge::default(),
            source_records_expired: Counter::default(),
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
            "records_combined",
            "Records this subtask's sources merged into another of the same key (and window) before the shuffle",
            m.records_combined.clone(),
        );
        registry.register(
            "records_out",
            "Results this subtask emitted to the sink",
            m.records_out.clone(),
        );
        registry.register(
            "backpressure_seconds",
            "Time this subtask's sources waited on full downstream buffers",
            m.backpressure_seconds.clone(),
        );
        registry.register(
            "late_records",
            "Records that arrived after their window had fired (counted, not applied)",
            m.late_records.clone(),
        );
        registry.register(
            "keys",
            "Keys held in keyed state (a program: its state entries as of its last checkpoint or restore)",
            m.keys.clone(),
        );
        registry.register(
            "watermark_timestamp_seconds",
            "The keyed operator's event-time watermark, in Unix seconds (0 before the first)",
            m.watermark_seconds.clone(),
        );
        registry.register(
            "last_restore_size_bytes",
            "Bytes of state this subtask read from a snapshot when its run started",
            m.restore_bytes.clone(),
        );
        registry.register(
            "last_restore_duration_seconds",
            "Time this subtask took to restore its key groups when its run started",
            m.restore_seconds.clone(),
        );
        registry.register(
            "last_checkpoint_duration_seconds",
            "Barrier-to-durable time of this subtask's last snapshot",
            m.checkpoint_seconds.clone(),
        );
        registry.register(
            "last_checkpoint_size_bytes",
            "State bytes this subtask wrote in its last snapshot",
            m.checkpoint_bytes.clone(),
        );
        registry.register(
            "source_lag_records",
            "Records a Kafka source is behind over this subtask's partitions: the sum of each partition's high watermark minus the source's position, as last measured (0 for other sources)",
            m.source_lag_records.clone(),
        );
        registry.register(
            "source_lag_seconds",
            "How far a Kafka source is behind in time: the most of this subtask's partitions, each 0 when read to its end, else now minus the later of the newest read record's timestamp and when it was last read to its end (0 for other sources)",
            m.source_lag_seconds.clone(),
        );
        registry.register(
            "source_records_expired",
            "Source records this subtask can no longer read: a Kafka partition's retention deleted them before the job read them (found when a run starts from a snapshot; the source goes on from the earliest record left)",
            m.source_records_expired.clone(),
        );
        WorkerMetrics {
            registry: root,
            ..m
        }
    }

    /// Raises the late-record counter to the keyed operator's running count `total`, of which
    /// `*seen` were counted before (a counter only goes up; a new run's operator starts at 0).
    pub fn count_late(&self, total: u64, seen: &mut u64) {
        if total > *seen {
            self.late_records.inc_by(total - *seen);
            *seen = total;
        }
    }

    /// The watermark in milliseconds (the status endpoint's unit), as set by
    /// [`set_watermark_ms`](Self::set_watermark_ms).
    pub fn watermark_ms(&self) -> i64 {
        (self.watermark_seconds.get() * 1000.0).round() as i64
    }

    /// Sets the watermark from the runtime's milliseconds.
    pub fn set_watermark_ms(&self, ms: i64) {
        self.watermark_seconds.set(ms as f64 / 1000.0);
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn late_records_count_up_across_runs() {
        let m = WorkerMetrics::new();
        let mut seen = 0;
        m.count_late(3, &mut seen);
        m.count_late(3, &mut seen);
        m.count_late(5, &mut seen);
        // A new run's keyed operator counts from 0 again: the counter keeps going up.
        let mut seen = 0;
        m.count_late(2, &mut seen);
        assert_eq!(m.late_records.get(), 7);
        let text = m.encode().expect("encodes");
        assert!(
            text.contains("# TYPE keyshift_worker_late_records counter"),
            "{text}"
        );
        assert!(
            text.contains("keyshift_worker_late_records_total 7"),
            "{text}"
        );
    }

    #[test]
    fn the_watermark_is_exposed_in_seconds_and_read_back_in_milliseconds() {
        let m = WorkerMetrics::new();
        m.set_watermark_ms(1_767_225_620_123);
        assert_eq!(m.watermark_ms(), 1_767_225_620_123);
        let text = m.encode().expect("encodes");
        assert!(
            text.contains("keyshift_worker_watermark_timestamp_seconds 1767225620.123"),
            "{text}"
        );
    }

    #[test]
    fn names_carry_base_units_and_counters_end_in_total() {
        let m = WorkerMetrics::new();
        m.backpressure_seconds.inc_by(0.25);
        let text = m.encode().expect("encodes");
        assert!(
            text.contains("keyshift_worker_backpressure_seconds_total 0.25"),
            "{text}"
        );
        let mut counters = 0;
        for line in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
            let (family, kind) = line.split_once(' ').expect("name and type");
            assert!(
                !family.contains("milli") && !family.ends_with("_ms"),
                "{family}"
            );
            if kind == "counter" {
                counters += 1;
                assert!(text.contains(&format!("\n{family}_total ")), "{family}");
            }
        }
        assert_eq!(counters, 7, "{text}");
    }
}
