//! The Kafka sink: result rows as Kafka records, exactly once through transactions tied to
//! committed snapshots (`exactlyOnce`, the default), or at least once (`atLeastOnce`).
//!
//! # Records
//!
//! One record per result row. The **value** is the row as the object-store sink writes it, one
//! JSON object without the newline: `{"key":"key-7","value":42}` or, windowed,
//! `{"key":7,"window":{"start":0,"end":10000},"value":42}`. The **key** is the row's key as
//! text: a string key's UTF-8 bytes, a `long` or `int` key in decimal ([`record_key`]). Records
//! are partitioned by librdkafka's `murmur2_random` partitioner (set unless the sink's
//! `properties` choose another): murmur2 of the key bytes, as the Java client's default
//! partitioner, so every result of a key lands in one partition, the same one a Java producer
//! would pick, in the order the job produced them.
//!
//! # Exactly once: stage, commit the snapshot, then publish in a transaction
//!
//! A worker never writes to Kafka in this mode. At each snapshot barrier it *stages* every row
//! since the job's last committed snapshot in the job's snapshot storage, exactly as the
//! object-store sink does ([`crate::job::staging::StagingSink`]), under
//! `<storage>/<namespace>/<job>/sink/_staging/snap-<id>/part-<subtask>-of-<parallelism>.jsonl`,
//! before it acknowledges the snapshot. Once the coordinator has committed snapshot `N` it
//! *publishes* `N`'s staged parts ([`KafkaPublisher::publish`]), in snapshot-id order:
//!
//! 1. one Kafka transaction holds every record of every part of `N` and, through
//!    `send_offsets_to_transaction`, a **marker**: the committed "offset" `N` of the bookkeeping
//!    consumer group (named like the transactional id) on partition 0 of the output topic, with
//!    the metadata `keyshift-sink/1 snapshot=N records=<n>` ([`Marker`]);
//! 2. records and marker become visible together when the transaction commits, or not at all;
//! 3. the staged parts of `N` (and of older ids, published or carried by `N`) are deleted.
//!
//! The marker makes publishing idempotent across any crash: before it publishes anything, a
//! publisher initialises its transactional producer (which **fences** every earlier producer
//! with the same transactional id, and aborts its open transaction) and then reads the marker
//! with `read_committed`. A snapshot at or below the marker is not produced again
//! ([`decide`]). A crash before the commit leaves an open transaction that the next publisher's
//! fencing aborts (nothing of it is ever visible to `read_committed` consumers) and the staged
//! parts still there; a crash after it leaves the marker saying `N` is done.
//!
//! The **transactional id** is one per job, `<transactionalIdPrefix>.sink` with the prefix
//! `keyshift.<namespace>.<job>` by default ([`transactional_id`]; set the prefix to fit a
//! broker's ACLs). The writers (subtasks) only stage, so nothing Kafka sees
//! depends on the parallelism: a rescale changes no id, leaves no producer behind, and the
//! staged parts of the savepoint are published like any other snapshot's.
//!
//! What the runtime already guarantees does the rest (see [`crate::job::staging`]): a snapshot that
//! never commits is never published, its rows ride with the next snapshot's parts; after a
//! failure the job restarts from its last committed snapshot, whose parts are published if the
//! crash came before that; ids are never reused. So **every result row of a committed snapshot
//! becomes visible to `read_committed` consumers exactly once, only after the snapshot commits,
//! in snapshot order; nothing of an aborted transaction is ever visible.** The one cost: records
//! are visible one publish after the commit (a checkpoint interval plus the publish), and
//! `read_uncommitted` consumers may see records of a transaction that is later aborted (as with
//! any transactional producer).
//!
//! A publisher that cannot reach its brokers fails the publish with the broker's error: the
//! snapshot stays pending (retried after every commit, in order), the job's `SinkPublished`
//! condition says why, and checkpoint retention waits, so the snapshots whose output is not
//! published yet stay restorable.
//!
//! # At least once
//!
//! `atLeastOnce`: each worker produces its rows as they come with an idempotent producer and
//! flushes at every snapshot barrier before it acknowledges ([`AtLeastOnceSink`]). A record that
//! cannot be delivered stops the worker, so the job restarts from its last committed snapshot
//! and produces the rows after it again: nothing is lost, rows after the last commit may appear
//! twice.

use crate::job::record::{KeyRef, RecordKey};
use std::time::Duration;

/// The prefix of every [`Marker`]'s metadata.
pub const MARKER_PREFIX: &str = "keyshift-sink/1";

/// How long one Kafka operation of the sink may take before it fails with the broker's error.
pub const KAFKA_TIMEOUT: Duration = Duration::from_secs(30);

/// The folder below a job's snapshot directory (`<storage>/<namespace>/<job>`) where the workers
/// of an exactly-once Kafka sink stage their output.
pub const STAGING_FOLDER: &str = "sink";

/// Where the workers of an exactly-once Kafka sink stage their output for the job whose snapshot
/// directory is `job_dir`: `<job_dir>/sink` (below it `_staging/snap-<id>/...`, as
/// [`crate::sink`] lays it out).
pub fn staging_base(job_dir: &crate::snapshot::Path) -> crate::snapshot::Path {
    job_dir.clone().join(STAGING_FOLDER)
}

pub use keyshift_core::spec::transactional_id;

/// Whether a job's sink stages its output for the coordinator to publish: a Kafka sink with
/// `deliveryGuarantee: exactlyOnce` (the default).
pub fn stages(sink: &keyshift_core::spec::SinkSpec) -> bool {
    sink.sink_type == keyshift_core::spec::SinkType::Kafka
        && sink.kafka.as_ref().is_some_and(|k| {
            k.delivery_guarantee == keyshift_core::spec::KafkaDeliveryGuarantee::ExactlyOnce
        })
}

/// The Kafka record key of a result's key: a string's UTF-8 bytes, a number in decimal.
pub fn record_key(key: &RecordKey) -> Vec<u8> {
    match key.view() {
        KeyRef::Str(s) => s.as_bytes().to_vec(),
        KeyRef::Long(v) => v.to_string().into_bytes(),
        KeyRef::Int(v) => v.to_string().into_bytes(),
    }
}

/// A staged line that is not a result row.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("staged sink line {line} is not a result row ({reason})")]
pub struct LineError {
    pub line: usize,
    pub reason: String,
}

/// A Kafka record of a result: its key bytes and its value (a JSON line without the newline).
pub type KafkaRecord<'a> = (Vec<u8>, &'a [u8]);

/// The Kafka records of staged JSON lines (the object-store sink's format): per line, the key
/// ([`record_key`] of the row's `key`) and the value (the line without its newline). Empty lines
/// are skipped.
pub fn records(text: &[u8]) -> Result<Vec<KafkaRecord<'_>>, LineError> {
    #[derive(serde::Deserialize)]
    struct Row<'a> {
        #[serde(borrow)]
        key: &'a serde_json::value::RawValue,
    }
    let mut out = Vec::new();
    for (i, line) in text.split(|b| *b == b'\n').enumerate() {
        if line.is_empty() {
            continue;
        }
        let err = |reason: String| LineError {
            line: i + 1,
            reason,
        };
        let row: Row = serde_json::from_slice(line).map_err(|e| err(e.to_string()))?;
        let raw = row.key.get();
        let key = if raw.starts_with('"') {
            serde_json::from_str::<String>(raw)
                .map_err(|e| err(e.to_string()))?
                .into_bytes()
        } else if raw.bytes().all(|b| b == b'-' || b.is_ascii_digit()) && !raw.is_empty() {
            raw.as_bytes().to_vec()
        } else {
            return Err(err(format!("key {raw} is neither a string nor an integer")));
        };
        out.push((key, line));
    }
    Ok(out)
}

/// What a publisher leaves in Kafka with each published snapshot, atomically with its records:
/// the snapshot id (as the bookkeeping group's committed offset) and how many records it
/// produced (in the offset's metadata, for people reading the group).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Marker {
    /// The newest published snapshot.
    pub snapshot: u64,
    /// The job that wrote it ([`owner_of`]: a hash of its namespace and name); `None` in
    /// markers written before it was recorded.
    pub owner: Option<u64>,
    /// Records its transaction produced.
    pub records: u64,
}

/// A marker's metadata that is not one of ours.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the bookkeeping group's offset metadata {0:?} is not a keyshift sink marker: another client commits offsets in this group"
)]
pub struct MarkerError(pub String);

impl Marker {
    /// The offset metadata: `keyshift-sink/1 snapshot=<id> records=<n> job=<16 hex digits>`
    /// (without `job=` for a marker of no recorded owner).
    pub fn metadata(&self) -> String {
        let mut out = format!(
            "{MARKER_PREFIX} snapshot={} records={}",
            self.snapshot, self.records
        );
        if let Some(owner) = self.owner {
            out.push_str(&format!(" job={owner:016x}"));
        }
        out
    }

    /// Reads a marker back from the committed offset and its metadata; `None` when nothing was
    /// committed (a negative offset: librdkafka's "invalid").
    pub fn decode(offset: i64, metadata: &str) -> Result<Option<Marker>, MarkerError> {
        if offset < 0 && metadata.is_empty() {
            return Ok(None);
        }
        let bad = || MarkerError(metadata.to_owned());
        let mut words = metadata.split(' ');
        if words.next() != Some(MARKER_PREFIX) {
            return Err(bad());
        }
        let mut number = |name: &str| -> Result<u64, MarkerError> {
            words
                .next()
                .and_then(|w| w.strip_prefix(name))
                .and_then(|w| w.strip_prefix('='))
                .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|n| n.parse().ok())
                .ok_or_else(bad)
        };
        let snapshot = number("snapshot")?;
        let records = number("records")?;
        let owner = match words.next() {
            None => None,
            Some(w) => {
                let hex = w
                    .strip_prefix("job=")
                    .filter(|h| h.len() == 16)
                    .ok_or_else(bad)?;
                Some(u64::from_str_radix(hex, 16).map_err(|_| bad())?)
            }
        };
        if words.next().is_some() || i64::try_from(snapshot).ok() != Some(offset) {
            return Err(bad());
        }
        Ok(Some(Marker {
            snapshot,
            records,
            owner,
        }))
    }

    /// Why this marker must not be used by job `owner` under `transactional_id`: another job
    /// wrote it (two jobs share the transactional id, so each would fence the other and take
    /// the other's published snapshots for its own). A marker of no recorded owner is
    /// accepted. Pure.
    pub fn foreign_to(&self, owner: u64, transactional_id: &str) -> Option<String> {
        let writer = self.owner.filter(|w| *w != owner)?;
        Some(format!(
            "the marker of transactional id {transactional_id} (snapshot {}) was written by another job's sink (job {writer:016x}, this job is {owner:016x}): two jobs share this transactional id, and would fence each other and take each other's output for their own. Give each job its own spec.job.sink.kafka.transactionalIdPrefix (the default, keyshift.<namespace>.<job>, is unique)",
            self.snapshot
        ))
    }
}

/// The owner a marker records for job `namespace/name`: the FNV-1a hash of `namespace/name`.
pub fn owner_of(namespace: &str, name: &str) -> u64 {
    keyshift_core::hash::fnv64(format!("{namespace}/{name}").as_bytes())
}

/// The object below a Kafka sink's staging base (`<job>/sink/_published.json`) that records,
/// after each transaction commits, the snapshot it published: what the job knows of its marker
/// should the broker lose it (a consumer group's offset expires after the broker's
/// `offsets.retention.minutes` without a commit).
pub const PUBLISHED_RECORD: &str = "_published.json";

/// The content of [`PUBLISHED_RECORD`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PublishedRecord {
    /// The newest snapshot whose transaction committed.
    pub snapshot: u64,
    /// The transactional id it was published under.
    pub transactional_id: String,
}

/// The marker a publisher goes by: the broker's, or — when the broker has none but the job's
/// storage records a published snapshot — the recorded one, with what to say about it (the
/// marker's loss is never taken for "nothing published"). The newer of the two when both
/// exist. Pure.
pub fn effective_marker(
    broker: Option<Marker>,
    recorded: Option<u64>,
    transactional_id: &str,
) -> (Option<Marker>, Option<String>) {
    match (broker, recorded) {
        (None, Some(n)) => (
            Some(Marker {
                snapshot: n,
                records: 0,
                owner: None,
            }),
            Some(format!(
                "the Kafka sink's marker (the committed offset of group {transactional_id}) is gone, though the job's storage records snapshot {n} as published: the group's offset expired (the broker's offsets.retention.minutes passed without a publish) or was deleted. Going by the record: snapshots up to {n} are not produced again"
            )),
        ),
        (Some(m), Some(n)) if n > m.snapshot => (
            Some(Marker {
                snapshot: n,
                records: 0,
                owner: m.owner,
            }),
            Some(format!(
                "the Kafka sink's marker (group {transactional_id}) names snapshot {}, older than snapshot {n} the job's storage records as published: going by the record",
                m.snapshot
            )),
        ),
        (m, _) => (m, None),
    }
}

/// The `transaction.timeout.ms` of the publisher's producer unless the sink's properties set
/// it: the broker's default upper bound (`transaction.max.timeout.ms`, 15 min), so that a
/// large snapshot's output fits in one transaction ([`flush_timeout`] bounds its flush).
pub const TRANSACTION_TIMEOUT: Duration = Duration::from_secs(15 * 60);

/// How long a transaction's flush (and commit) may take for `bytes` of records:
/// [`KAFKA_TIMEOUT`] and a second more per MiB (a large snapshot's output is given the time
/// to reach the brokers), never more than [`TRANSACTION_TIMEOUT`] (the transaction would
/// expire). Brokers that went away are still noticed within about [`KAFKA_TIMEOUT`] for a
/// small snapshot. Pure.
pub fn flush_timeout(bytes: u64) -> Duration {
    (KAFKA_TIMEOUT + Duration::from_secs(bytes >> 20)).min(TRANSACTION_TIMEOUT)
}

/// What to do with committed snapshot `id`'s staged parts given the marker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Not in Kafka yet: produce it in a transaction with the marker `id`.
    Publish,
    /// In Kafka already (a crash came between the commit and the clean-up of its staged parts):
    /// only clean up.
    Published,
}

/// Whether committed snapshot `id` is to be produced, given the marker. Pure. Snapshots are
/// published in id order, each with its marker, and snapshot ids of a job only grow (the
/// coordinator raises them above the marker before its first trigger), so a snapshot at or
/// below the marker is in Kafka.
pub fn decide(marker: Option<Marker>, id: u64) -> Decision {
    match marker {
        Some(m) if m.snapshot >= id => Decision::Published,
        _ => Decision::Publish,
    }
}

#[cfg(feature = "kafka")]
pub use io::*;

#[cfg(feature = "kafka")]
mod io {
    use super::*;
    use crate::job::kafka::{Credentials, Role, client_config, producer_properties};
    use crate::sink::staged_dir;
    use crate::snapshot::{ObjectStore, Path};
    use keyshift_core::spec::KafkaSink;
    use object_store::ObjectStoreExt;
    use rdkafka::ClientConfig;
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::error::KafkaError;
    use rdkafka::producer::{
        BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer,
    };
    use rdkafka::{ClientContext, Offset, TopicPartitionList};
    use std::collections::BTreeMap;
    use std::sync::{Arc, Mutex, PoisonError};

    /// Kafka sink failures; each names the broker's error.
    #[derive(Debug, thiserror::Error)]
    pub enum KafkaSinkError {
        #[error("kafka sink: {op}: {source}{}", broker_note(.broker))]
        Kafka {
            op: &'static str,
            source: KafkaError,
            /// The client's last error report (e.g. why it cannot connect), if any.
            broker: Option<String>,
        },
        #[error("kafka sink: {count} records could not be delivered to topic {topic}: {first}")]
        Delivery {
            topic: String,
            count: u64,
            first: String,
        },
        #[error(transparent)]
        Marker(#[from] MarkerError),
        #[error("kafka sink: {0}")]
        Line(#[from] LineError),
        #[error("kafka sink: staged output {path}: {source}")]
        Store {
            path: String,
            source: object_store::Error,
        },
        #[error("kafka sink: {0}")]
        Task(String),
        /// Removing published staged output failed.
        #[error("kafka sink: {0}")]
        Staging(#[source] crate::sink::SinkError),
        /// The marker under this transactional id belongs to another job ([`Marker::foreign_to`]).
        #[error("kafka sink: {0}")]
        ForeignMarker(String),
    }

    fn broker_note(broker: &Option<String>) -> String {
        broker
            .as_deref()
            .map(|b| format!(" (client errors: {b})"))
            .unwrap_or_default()
    }

    fn kafka(op: &'static str) -> impl FnOnce(KafkaError) -> KafkaSinkError {
        move |source| KafkaSinkError::Kafka {
            op,
            source,
            broker: None,
        }
    }

    /// [`kafka`] with the client's last error report.
    fn kafka_at<'a>(
        op: &'static str,
        ctx: &'a DeliveryTracker,
    ) -> impl FnOnce(KafkaError) -> KafkaSinkError + 'a {
        move |source| KafkaSinkError::Kafka {
            op,
            source,
            broker: ctx.last_error(),
        }
    }

    /// A Kafka error without the client's reports gets those of `ctx`.
    fn with_client_note(e: KafkaSinkError, ctx: &DeliveryTracker) -> KafkaSinkError {
        match e {
            KafkaSinkError::Kafka {
                op,
                source,
                broker: None,
            } => KafkaSinkError::Kafka {
                op,
                source,
                broker: ctx.last_error(),
            },
            e => e,
        }
    }

    /// Counts failed deliveries (and keeps the first error) for a flush to report, and keeps the
    /// client's last few distinct error reports (why it cannot reach a broker, say) for the
    /// errors it returns.
    #[derive(Default)]
    pub struct DeliveryTracker {
        failed: Mutex<(u64, Option<String>)>,
        client_errors: Mutex<Vec<String>>,
    }

    /// Distinct client error reports kept ([`DeliveryTracker`]).
    const CLIENT_ERRORS_KEPT: usize = 3;

    impl ClientContext for DeliveryTracker {
        fn error(&self, error: KafkaError, reason: &str) {
            tracing::warn!(%error, reason, "kafka sink client error");
            let text = format!("{error}: {reason}");
            let mut kept = self
                .client_errors
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            kept.retain(|e| *e != text);
            kept.push(text);
            if kept.len() > CLIENT_ERRORS_KEPT {
                kept.remove(0);
            }
        }
    }

    impl ProducerContext for DeliveryTracker {
        type DeliveryOpaque = ();
        fn delivery(&self, result: &DeliveryResult<'_>, _: Self::DeliveryOpaque) {
            if let Err((e, _)) = result {
                let mut f = self.failed.lock().unwrap_or_else(PoisonError::into_inner);
                f.0 += 1;
                if f.1.is_none() {
                    f.1 = Some(e.to_string());
                }
            }
        }
    }

    impl DeliveryTracker {
        /// The client's last distinct error reports, oldest first.
        fn last_error(&self) -> Option<String> {
            let kept = self
                .client_errors
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            (!kept.is_empty()).then(|| kept.join("; "))
        }

        /// Failed deliveries since the last call, and the first error.
        fn take(&self) -> (u64, Option<String>) {
            std::mem::take(&mut *self.failed.lock().unwrap_or_else(PoisonError::into_inner))
        }
    }

    type TrackedProducer = ThreadedProducer<DeliveryTracker>;

    /// Produces one record, waiting while librdkafka's queue is full.
    fn send(
        producer: &TrackedProducer,
        topic: &str,
        key: &[u8],
        value: &[u8],
    ) -> Result<(), KafkaSinkError> {
        let mut record = BaseRecord::to(topic).key(key).payload(value);
        loop {
            match producer.send(record) {
                Ok(()) => return Ok(()),
                Err((
                    KafkaError::MessageProduction(rdkafka::types::RDKafkaErrorCode::QueueFull),
                    r,
                )) => {
                    record = r;
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err((e, _)) => return Err(kafka("produce")(e)),
            }
        }
    }

    /// The producer settings the sink needs on top of the connection's: the Java-compatible
    /// partitioner unless set, idempotence.
    fn producer_config(base: &ClientConfig) -> ClientConfig {
        let mut c = base.clone();
        if c.get("partitioner").is_none() {
            c.set("partitioner", "murmur2_random");
        }
        c.set("enable.idempotence", "true");
        c
    }

    /// Producer properties the bookkeeping consumer leaves out (librdkafka warns about them).
    const PRODUCER_ONLY: &[&str] = &[
        "acks",
        "enable.idempotence",
        "transactional.id",
        "partitioner",
        "compression.type",
        "compression.codec",
        "linger.ms",
        "queue.buffering.max.ms",
        "batch.size",
        "batch.num.messages",
        "message.timeout.ms",
        "delivery.timeout.ms",
        "retries",
        "message.send.max.retries",
        "queue.buffering.max.messages",
        "queue.buffering.max.kbytes",
        "transaction.timeout.ms",
    ];

    /// A transactional producer and what it knows of the marker.
    struct Live {
        producer: TrackedProducer,
        /// The consumer whose group metadata goes with the marker, and that reads it.
        group: BaseConsumer,
        marker: Option<Marker>,
    }

    /// What [`KafkaPublisher::publish`] did.
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
    pub struct KafkaPublished {
        /// Parts staged for the snapshot.
        pub parts: usize,
        /// Records produced now (0 when it was published before).
        pub records: u64,
        /// Whether the marker said the snapshot was published already.
        pub already: bool,
    }

    /// Publishes the staged output of committed snapshots to a Kafka topic, one transaction per
    /// snapshot (see [the module documentation](super)).
    pub struct KafkaPublisher {
        /// The client properties (secrets included: `ClientConfig::config_map` masks them).
        properties: BTreeMap<String, String>,
        topic: String,
        transactional_id: String,
        /// The job the markers it writes name ([`owner_of`]); `None`: no owner recorded or
        /// checked.
        owner: Option<u64>,
        live: Arc<Mutex<Option<Live>>>,
        /// The last Kafka operation's failure, until one succeeds ([`Self::broker_error`]).
        broker_error: Mutex<Option<String>>,
    }

    impl std::fmt::Debug for KafkaPublisher {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("KafkaPublisher")
                .field("topic", &self.topic)
                .field("transactional_id", &self.transactional_id)
                .finish()
        }
    }

    impl KafkaPublisher {
        /// A publisher to `topic` with the client `properties` (bootstrap servers, credentials,
        /// the sink's properties). Connects on first use.
        pub fn new(
            properties: BTreeMap<String, String>,
            topic: String,
            transactional_id: String,
        ) -> Self {
            KafkaPublisher {
                properties,
                topic,
                transactional_id,
                owner: None,
                live: Arc::new(Mutex::new(None)),
                broker_error: Mutex::new(None),
            }
        }

        /// The same publisher for job `owner` ([`owner_of`]): the markers it writes name it, and
        /// it refuses (before fencing anything) a marker another job wrote.
        pub fn owned_by(mut self, owner: u64) -> Self {
            self.owner = Some(owner);
            self
        }

        /// Why the publisher's last attempt to use its brokers failed (naming the bootstrap
        /// servers, the failed operation, the broker's error and the client's reports), until
        /// an attempt succeeds. Failures of the snapshot storage are not counted.
        pub fn broker_error(&self) -> Option<String> {
            self.broker_error
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone()
        }

        /// Records the outcome of an operation that used the brokers.
        fn note<T>(&self, r: Result<T, KafkaSinkError>) -> Result<T, KafkaSinkError> {
            let outage = match &r {
                Ok(_) => None,
                Err(e @ (KafkaSinkError::Kafka { .. } | KafkaSinkError::Delivery { .. })) => {
                    Some(format!(
                        "the sink's publisher (bootstrap {}): {e}",
                        self.properties
                            .get("bootstrap.servers")
                            .map_or("?", String::as_str)
                    ))
                }
                // Not the brokers' doing: what was known of them stays.
                Err(_) => return r,
            };
            *self
                .broker_error
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = outage;
            r
        }

        /// The publisher of job `namespace/name`'s sink `spec`, with the credentials the
        /// platform read for it (the orchestrator's `Workers::kafka_credentials`).
        pub fn from_spec(
            spec: &KafkaSink,
            namespace: &str,
            name: &str,
            creds: &Credentials,
        ) -> KafkaPublisher {
            let id = transactional_id(namespace, name, spec.transactional_id_prefix.as_deref());
            let props = producer_properties(spec, None, creds);
            KafkaPublisher::new(props, spec.topic.clone(), id).owned_by(owner_of(namespace, name))
        }

        /// The transactional id (also the bookkeeping group).
        pub fn transactional_id(&self) -> &str {
            &self.transactional_id
        }

        /// The marker as the broker has it: the newest snapshot this job published. Initialises
        /// (and so fences) the producer first if needed.
        pub async fn marker(&self) -> Result<Option<Marker>, KafkaSinkError> {
            let me = self.handle();
            let r = blocking(move || {
                let mut live = me.live.lock().unwrap_or_else(PoisonError::into_inner);
                Ok(me.ensure(&mut live)?.marker)
            })
            .await;
            self.note(r)
        }

        /// The marker the publisher goes by ([`effective_marker`]): the broker's, or the job
        /// storage's record under `base` when the broker lost it, with what to say about that.
        pub async fn effective_marker(
            &self,
            store: &dyn ObjectStore,
            base: &Path,
        ) -> Result<(Option<Marker>, Option<String>), KafkaSinkError> {
            let marker = self.marker().await?;
            let recorded = read_published(store, base).await?;
            Ok(effective_marker(marker, recorded, &self.transactional_id))
        }

        fn handle(&self) -> Handle {
            Handle {
                properties: self.properties.clone(),
                topic: self.topic.clone(),
                transactional_id: self.transactional_id.clone(),
                owner: self.owner,
                live: self.live.clone(),
            }
        }

        /// Publishes the staged output of committed snapshot `id` under `base` (idempotent, see
        /// [`decide`]), then deletes the staged output of `id` and of every older id.
        ///
        /// The staged parts are streamed into the transaction, a few chunks of whole lines at a
        /// time ([`CHUNKS_IN_FLIGHT`]), whatever their size: the publisher holds a bounded
        /// amount of a snapshot's output, not all of it. The transaction may take up to
        /// [`TRANSACTION_TIMEOUT`] (`transaction.timeout.ms`, unless the sink's properties set
        /// it); its flush and commit wait [`flush_timeout`] of its size.
        pub async fn publish(
            &self,
            store: &dyn ObjectStore,
            base: &Path,
            id: u64,
        ) -> Result<KafkaPublished, KafkaSinkError> {
            let dir = staged_dir(base, id);
            let store_err = |path: &Path| {
                let path = path.to_string();
                move |source| KafkaSinkError::Store { path, source }
            };
            let mut metas: Vec<object_store::ObjectMeta> = store
                .list_with_delimiter(Some(&dir))
                .await
                .map_err(store_err(&dir))?
                .objects;
            if metas.is_empty() {
                return Ok(KafkaPublished::default());
            }
            metas.sort_by(|a, b| a.location.cmp(&b.location));
            let recorded = read_published(store, base).await?;
            let (tx, rx) = tokio::sync::mpsc::channel::<Piece>(CHUNKS_IN_FLIGHT);
            let me = self.handle();
            let producing =
                tokio::task::spawn_blocking(move || me.publish_blocking(id, recorded, rx));
            // Whole lines go to the producer; a chunk's tail waits for the next chunk.
            let read: Result<(), KafkaSinkError> = async {
                for m in &metas {
                    let mut chunks = store
                        .get(&m.location)
                        .await
                        .map_err(store_err(&m.location))?
                        .into_stream();
                    let mut tail = bytes::BytesMut::new();
                    while let Some(chunk) = futures::StreamExt::next(&mut chunks).await {
                        tail.extend_from_slice(&chunk.map_err(store_err(&m.location))?);
                        if let Some(end) = tail.iter().rposition(|b| *b == b'\n') {
                            let lines = tail.split_to(end + 1).freeze();
                            if tx.send(Piece::Lines(lines)).await.is_err() {
                                // The producer stopped: its result says why.
                                return Ok(());
                            }
                        }
                    }
                    if !tail.is_empty() && tx.send(Piece::Lines(tail.freeze())).await.is_err() {
                        return Ok(());
                    }
                }
                // Only now may the transaction commit.
                let _ = tx.send(Piece::End).await;
                Ok(())
            }
            .await;
            drop(tx);
            let produced = producing
                .await
                .map_err(|e| KafkaSinkError::Task(e.to_string()))?;
            // A failed read fails the publish: the producer saw the stream end without its
            // `Piece::End` and aborted.
            let done = match (read, produced) {
                (Err(e), _) => return self.note(Err(e)),
                (Ok(()), r) => self.note(r.map(Streamed::published))?,
            };
            if !done.already {
                // Recorded after the commit: at worst one snapshot behind the marker, which
                // the marker (while it lasts) corrects.
                let record = PublishedRecord {
                    snapshot: id,
                    transactional_id: self.transactional_id.clone(),
                };
                let path = base.clone().join(PUBLISHED_RECORD);
                let json =
                    serde_json::to_vec(&record).map_err(|e| KafkaSinkError::Task(e.to_string()))?;
                if let Err(e) = store.put(&path, json.into()).await {
                    tracing::warn!(%path, error = %e, "recording the published snapshot failed; the broker's marker still says it");
                }
            }
            crate::sink::remove_staged_through(store, base, id)
                .await
                .map_err(KafkaSinkError::Staging)?;
            Ok(KafkaPublished {
                parts: metas.len(),
                ..done
            })
        }
    }

    /// The snapshot the job's storage records as published by its Kafka sink under `base`
    /// ([`PUBLISHED_RECORD`]), if any. A record that does not parse is an error: it cannot be
    /// told what was published.
    pub async fn read_published(
        store: &dyn ObjectStore,
        base: &Path,
    ) -> Result<Option<u64>, KafkaSinkError> {
        let path = base.clone().join(PUBLISHED_RECORD);
        let bytes = match store.get(&path).await {
            Ok(r) => r.bytes().await.map_err(|source| KafkaSinkError::Store {
                path: path.to_string(),
                source,
            })?,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(source) => {
                return Err(KafkaSinkError::Store {
                    path: path.to_string(),
                    source,
                });
            }
        };
        let record: PublishedRecord = serde_json::from_slice(&bytes).map_err(|e| {
            KafkaSinkError::Task(format!(
                "{path} is not a record of the published snapshot ({e}): delete it only if the sink's marker in Kafka is intact"
            ))
        })?;
        Ok(Some(record.snapshot))
    }

    /// Chunks of staged output (whole lines, up to an object store read each) in flight between
    /// the reader and the producer of one publish.
    pub const CHUNKS_IN_FLIGHT: usize = 4;

    /// What the reader of a streamed publish hands the producer.
    enum Piece {
        /// Whole lines of staged output.
        Lines(bytes::Bytes),
        /// Everything was read: the transaction may commit.
        End,
    }

    /// How a streamed publish ended on the producer's side.
    enum Streamed {
        /// Produced and committed (records).
        Committed(u64),
        /// The marker said it was in Kafka already: nothing produced.
        Already,
    }

    impl Streamed {
        fn published(self) -> KafkaPublished {
            match self {
                Streamed::Committed(records) => KafkaPublished {
                    records,
                    ..KafkaPublished::default()
                },
                Streamed::Already => KafkaPublished {
                    already: true,
                    ..KafkaPublished::default()
                },
            }
        }
    }

    /// What the blocking half of a publish needs (cheap clones).
    struct Handle {
        properties: BTreeMap<String, String>,
        topic: String,
        transactional_id: String,
        owner: Option<u64>,
        live: Arc<Mutex<Option<Live>>>,
    }

    async fn blocking<T: Send + 'static>(
        f: impl FnOnce() -> Result<T, KafkaSinkError> + Send + 'static,
    ) -> Result<T, KafkaSinkError> {
        tokio::task::spawn_blocking(f)
            .await
            .map_err(|e| KafkaSinkError::Task(e.to_string()))?
    }

    impl Handle {
        /// The live producer, created, initialised (fencing every earlier one with the same
        /// transactional id and aborting its open transaction) and with the marker read, if
        /// there is none.
        fn ensure<'a>(&self, live: &'a mut Option<Live>) -> Result<&'a mut Live, KafkaSinkError> {
            if live.is_none() {
                let mut pc = producer_config(&client_config(&self.properties));
                pc.set("transactional.id", &self.transactional_id);
                if pc.get("transaction.timeout.ms").is_none() {
                    pc.set(
                        "transaction.timeout.ms",
                        TRANSACTION_TIMEOUT.as_millis().to_string(),
                    );
                }
                // Created, not initialised yet: it fences nothing until `init_transactions`.
                let producer: TrackedProducer = pc
                    .create_with_context(DeliveryTracker::default())
                    .map_err(kafka("creating the transactional producer"))?;
                let mut cc = ClientConfig::new();
                for (k, v) in &self.properties {
                    if !PRODUCER_ONLY.contains(&k.as_str()) {
                        cc.set(k, v);
                    }
                }
                cc.set("group.id", &self.transactional_id)
                    .set("enable.auto.commit", "false")
                    .set("isolation.level", "read_committed");
                let group: BaseConsumer = cc
                    .create()
                    .map_err(kafka("creating the bookkeeping consumer"))?;
                // A marker another job wrote is refused before the initialisation fences that
                // job's producer. Best effort: when the group cannot be read yet (its
                // coordinator still loading, the brokers unreachable) the initialisation below
                // says what is wrong, and the owner is checked after it.
                if let Some(before) = self.read_marker_before_fencing(&group) {
                    self.check_owner(before)?;
                }
                producer.init_transactions(KAFKA_TIMEOUT).map_err(kafka_at(
                    "initialising transactions (fencing earlier producers)",
                    producer.context(),
                ))?;
                // Read again: the initialisation resolved an open transaction of an earlier
                // producer (aborted, or let its commit finish), and this says which.
                let marker = read_marker(&group, &self.topic)
                    .map_err(|e| with_client_note(e, producer.context()))?;
                self.check_owner(marker)?;
                tracing::info!(
                    transactional_id = %self.transactional_id,
                    topic = %self.topic,
                    marker = ?marker.map(|m| m.snapshot),
                    "kafka sink publisher ready (earlier producers fenced)"
                );
                *live = Some(Live {
                    producer,
                    group,
                    marker,
                });
            }
            live.as_mut()
                .ok_or_else(|| KafkaSinkError::Task("the producer vanished".into()))
        }

        /// The marker, read before this producer fences anything: retried while the group's
        /// coordinator is not ready (a new group), `None` if it cannot be read within a few
        /// seconds.
        fn read_marker_before_fencing(&self, group: &BaseConsumer) -> Option<Option<Marker>> {
            use rdkafka::types::RDKafkaErrorCode as Code;
            let started = std::time::Instant::now();
            loop {
                match read_marker_within(group, &self.topic, PRE_READ_TIMEOUT) {
                    Ok(m) => return Some(m),
                    Err(KafkaSinkError::Kafka { source, .. })
                        if matches!(
                            source.rdkafka_error_code(),
                            Some(
                                Code::NotCoordinator
                                    | Code::CoordinatorLoadInProgress
                                    | Code::CoordinatorNotAvailable
                            )
                        ) && started.elapsed() < PRE_READ_TIMEOUT =>
                    {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "reading the sink's marker before fencing; checked after the initialisation");
                        return None;
                    }
                }
            }
        }

        /// A marker another job wrote is [`KafkaSinkError::ForeignMarker`].
        fn check_owner(&self, marker: Option<Marker>) -> Result<(), KafkaSinkError> {
            match (marker, self.owner) {
                (Some(m), Some(owner)) => match m.foreign_to(owner, &self.transactional_id) {
                    Some(why) => Err(KafkaSinkError::ForeignMarker(why)),
                    None => Ok(()),
                },
                _ => Ok(()),
            }
        }

        fn publish_blocking(
            &self,
            id: u64,
            recorded: Option<u64>,
            chunks: tokio::sync::mpsc::Receiver<Piece>,
        ) -> Result<Streamed, KafkaSinkError> {
            let mut guard = self.live.lock().unwrap_or_else(PoisonError::into_inner);
            let live = self.ensure(&mut guard)?;
            let (marker, said) = effective_marker(live.marker, recorded, &self.transactional_id);
            if let Some(said) = said {
                tracing::warn!("{said}");
            }
            live.marker = marker;
            if decide(live.marker, id) == Decision::Published {
                // Drain the reader (it stops at once on a closed channel).
                drop(chunks);
                return Ok(Streamed::Already);
            }
            match self.transaction(live, id, chunks) {
                Ok(records) => {
                    live.marker = Some(Marker {
                        snapshot: id,
                        records,
                        owner: self.owner,
                    });
                    Ok(Streamed::Committed(records))
                }
                Err(e) => {
                    // Whatever state the transaction is in, a new producer resolves it: its
                    // initialisation aborts an open transaction (or lets a commit that reached
                    // the coordinator finish), and the marker read after it tells which.
                    let _ = live.producer.abort_transaction(KAFKA_TIMEOUT);
                    *guard = None;
                    Err(e)
                }
            }
        }

        /// One transaction: every record of the chunks as they come, then, once the reader says
        /// it read everything ([`Piece::End`]), the marker. A reader that stops without saying
        /// so (its read failed) leaves the transaction uncommitted: it is aborted.
        fn transaction(
            &self,
            live: &Live,
            id: u64,
            mut chunks: tokio::sync::mpsc::Receiver<Piece>,
        ) -> Result<u64, KafkaSinkError> {
            let p = &live.producer;
            let ctx = p.context();
            p.begin_transaction()
                .map_err(kafka_at("beginning a transaction", ctx))?;
            let mut n = 0u64;
            let mut bytes = 0u64;
            let mut ended = false;
            while let Some(piece) = chunks.blocking_recv() {
                match piece {
                    Piece::Lines(chunk) => {
                        bytes += chunk.len() as u64;
                        for (key, value) in records(&chunk)? {
                            send(p, &self.topic, &key, value)?;
                            n += 1;
                        }
                    }
                    Piece::End => {
                        ended = true;
                        break;
                    }
                }
            }
            if !ended {
                return Err(KafkaSinkError::Task(format!(
                    "the staged output of snapshot {id} could not be read to its end: not committed"
                )));
            }
            p.flush(flush_timeout(bytes))
                .map_err(kafka_at("flushing", ctx))?;
            let (failed, first) = ctx.take();
            if failed > 0 {
                return Err(KafkaSinkError::Delivery {
                    topic: self.topic.clone(),
                    count: failed,
                    first: first.unwrap_or_default(),
                });
            }
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition_offset(&self.topic, 0, Offset::Offset(id as i64))
                .map_err(kafka("the marker offset"))?;
            let marker = Marker {
                snapshot: id,
                records: n,
                owner: self.owner,
            };
            if let Some(mut e) = tpl.find_partition(&self.topic, 0) {
                e.set_metadata(marker.metadata());
            }
            let cgm = live.group.group_metadata().ok_or_else(|| {
                KafkaSinkError::Task("the bookkeeping consumer has no group metadata".into())
            })?;
            p.send_offsets_to_transaction(&tpl, &cgm, KAFKA_TIMEOUT)
                .map_err(kafka_at("adding the marker to the transaction", ctx))?;
            p.commit_transaction(flush_timeout(bytes))
                .map_err(kafka_at("committing the transaction", ctx))?;
            Ok(n)
        }
    }

    /// The committed marker of the bookkeeping group `group` was created with.
    fn read_marker(group: &BaseConsumer, topic: &str) -> Result<Option<Marker>, KafkaSinkError> {
        read_marker_within(group, topic, KAFKA_TIMEOUT)
    }

    /// How long a publisher tries to read the marker before its producer fences anything.
    const PRE_READ_TIMEOUT: Duration = Duration::from_secs(5);

    /// [`read_marker`] waiting at most `timeout`.
    fn read_marker_within(
        group: &BaseConsumer,
        topic: &str,
        timeout: Duration,
    ) -> Result<Option<Marker>, KafkaSinkError> {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(topic, 0);
        let got = group
            .committed_offsets(tpl, timeout)
            .map_err(kafka("reading the bookkeeping group's marker"))?;
        let Some(e) = got.find_partition(topic, 0) else {
            return Ok(None);
        };
        e.error()
            .map_err(kafka("reading the bookkeeping group's marker"))?;
        let offset = match e.offset() {
            Offset::Offset(o) => o,
            _ => -1,
        };
        Ok(Marker::decode(offset, e.metadata())?)
    }

    /// The `atLeastOnce` sink of one worker: rows are produced as they come (idempotent
    /// producer, `murmur2_random`), and [`AtLeastOnceSink::flush`] at each barrier waits until
    /// every one is acknowledged.
    pub struct AtLeastOnceSink {
        producer: TrackedProducer,
        topic: String,
        /// The first failure to hand a row to librdkafka since the last flush.
        failed: Option<KafkaSinkError>,
    }

    impl AtLeastOnceSink {
        /// A producer to `topic` with the connection settings `config`.
        pub fn new(config: &ClientConfig, topic: String) -> Result<Self, KafkaSinkError> {
            let producer = producer_config(config)
                .create_with_context(DeliveryTracker::default())
                .map_err(kafka("creating the producer"))?;
            Ok(AtLeastOnceSink {
                producer,
                topic,
                failed: None,
            })
        }

        /// The sink `spec` of a worker, with the credentials in its environment.
        pub fn from_spec(spec: &KafkaSink) -> Result<Self, KafkaSinkError> {
            let creds = Credentials::from_env(Role::Sink, spec.credentials.as_ref())
                .map_err(|e| KafkaSinkError::Task(e.to_string()))?;
            let props = producer_properties(spec, None, &creds);
            AtLeastOnceSink::new(&client_config(&props), spec.topic.clone())
        }

        /// Produces result rows given as JSON lines. A failure is kept for the next
        /// [`AtLeastOnceSink::flush`] to report.
        pub fn send_lines(&mut self, lines: &[u8]) {
            if self.failed.is_some() {
                return;
            }
            let sent = records(lines)
                .map_err(KafkaSinkError::from)
                .and_then(|recs| {
                    recs.iter()
                        .try_for_each(|(key, value)| send(&self.producer, &self.topic, key, value))
                });
            if let Err(e) = sent {
                self.failed = Some(e);
            }
        }

        /// Waits until every record produced so far is delivered; fails with the broker's error
        /// if one could not be (the worker must then stop: see the module documentation).
        pub fn flush(&mut self) -> Result<(), KafkaSinkError> {
            if let Some(e) = self.failed.take() {
                return Err(e);
            }
            self.producer
                .flush(KAFKA_TIMEOUT)
                .map_err(kafka_at("flushing at the barrier", self.producer.context()))?;
            let (failed, first) = self.producer.context().take();
            if failed > 0 {
                return Err(KafkaSinkError::Delivery {
                    topic: self.topic.clone(),
                    count: failed,
                    first: first.unwrap_or_default(),
                });
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::result::{ResultRow, Window, format_json_line};

    #[test]
    fn transactional_ids_name_the_job_and_stay_across_rescales() {
        assert_eq!(
            transactional_id("prod", "clicks", None),
            "keyshift.prod.clicks.sink"
        );
        // Neither the parallelism nor a subtask is part of it (a rescale keeps it); two jobs
        // never share one (a namespace has no dot).
        assert_ne!(
            transactional_id("a", "b.c", None),
            transactional_id("a", "b-c", None)
        );
        assert_eq!(
            transactional_id("prod", "clicks", Some("team-x.clicks")),
            "team-x.clicks.sink"
        );
        assert_eq!(
            transactional_id("prod", "clicks", Some("")),
            "keyshift.prod.clicks.sink"
        );
    }

    #[test]
    fn records_have_the_key_as_text_and_the_row_as_value() {
        let mut lines = Vec::new();
        for (key, window) in [
            (RecordKey::string("key-7"), None),
            (RecordKey::string("quo\"te\n"), None),
            (RecordKey::long(-12), Some(Window { start: 0, end: 10 })),
            (RecordKey::int(5), None),
        ] {
            format_json_line(
                &ResultRow {
                    key,
                    window,
                    value: 3,
                },
                &mut lines,
            );
        }
        let recs = records(&lines).unwrap();
        let keys: Vec<&[u8]> = recs.iter().map(|(k, _)| k.as_slice()).collect();
        assert_eq!(
            keys,
            [&b"key-7"[..], &b"quo\"te\n"[..], &b"-12"[..], &b"5"[..]]
        );
        assert_eq!(recs[0].1, br#"{"key":"key-7","value":3}"#);
        assert_eq!(
            recs[2].1,
            br#"{"key":-12,"window":{"start":0,"end":10},"value":3}"#
        );
        assert_eq!(record_key(&RecordKey::string("key-7")), b"key-7");
        assert_eq!(record_key(&RecordKey::long(-12)), b"-12");
        assert_eq!(record_key(&RecordKey::int(5)), b"5");
        assert!(records(b"").unwrap().is_empty());
        let e = records(b"{\"key\":1,\"value\":2}\nnot json\n").unwrap_err();
        assert_eq!(e.line, 2);
        let e = records(b"{\"key\":[1],\"value\":2}\n").unwrap_err();
        assert!(e.reason.contains("neither"), "{e}");
    }

    #[test]
    fn markers_round_trip_and_refuse_what_is_not_ours() {
        let m = Marker {
            snapshot: 42,
            records: 1000,
            owner: None,
        };
        assert_eq!(m.metadata(), "keyshift-sink/1 snapshot=42 records=1000");
        assert_eq!(Marker::decode(42, &m.metadata()), Ok(Some(m)));
        let owned = Marker {
            owner: Some(0xab),
            ..m
        };
        assert_eq!(
            owned.metadata(),
            "keyshift-sink/1 snapshot=42 records=1000 job=00000000000000ab"
        );
        assert_eq!(Marker::decode(42, &owned.metadata()), Ok(Some(owned)));
        assert_eq!(Marker::decode(-1001, ""), Ok(None), "nothing committed");
        for (offset, meta) in [
            (41, m.metadata().as_str()),
            (42, "keyshift-sink/2 snapshot=42 records=1"),
            (42, "keyshift-sink/1 snapshot=42"),
            (42, "keyshift-sink/1 snapshot=42 records=-1"),
            (42, "keyshift-sink/1 snapshot=+42 records=1"),
            (42, "keyshift-sink/1 snapshot=42 records=1 x"),
            (42, "keyshift-sink/1 records=1 snapshot=42"),
            (42, "keyshift-sink/1 snapshot=42 records=1 job=ab"),
            (
                42,
                "keyshift-sink/1 snapshot=42 records=1 job=00000000000000zz",
            ),
            (
                42,
                "keyshift-sink/1 snapshot=42 records=1 job=00000000000000ab x",
            ),
            (7, ""),
        ] {
            assert!(Marker::decode(offset, meta).is_err(), "{offset} {meta:?}");
        }
    }

    proptest::proptest! {
        /// Every marker a publisher writes reads back as itself (the sink's state codec).
        #[test]
        fn marker_codec_round_trips(
            snapshot in 0u64..=i64::MAX as u64,
            records in proptest::prelude::any::<u64>(),
        ) {
            for owner in [None, Some(records.rotate_left(7))] {
                let m = Marker { snapshot, records, owner };
                proptest::prop_assert_eq!(Marker::decode(snapshot as i64, &m.metadata()), Ok(Some(m)));
            }
        }
    }

    /// A marker names the job that wrote it; another job under the same transactional id is
    /// told so, naming the fix; a marker of no recorded owner (an older build's) is accepted.
    #[test]
    fn a_marker_of_another_job_is_refused() {
        let (a, b) = (owner_of("team-a", "clicks"), owner_of("team-b", "clicks"));
        assert_ne!(a, b);
        let m = Marker {
            snapshot: 7,
            records: 3,
            owner: Some(a),
        };
        assert_eq!(m.foreign_to(a, "shared.sink"), None);
        let why = m.foreign_to(b, "shared.sink").expect("another job's");
        assert!(
            why.contains("shared.sink") && why.contains("transactionalIdPrefix"),
            "{why}"
        );
        let older = Marker { owner: None, ..m };
        assert_eq!(older.foreign_to(b, "shared.sink"), None);
    }

    /// A marker the broker lost is never taken for "nothing published": the storage's record
    /// stands in for it, and says so.
    #[test]
    fn a_lost_marker_is_replaced_by_the_storage_record_and_said() {
        let m = |snapshot| Marker {
            snapshot,
            records: 3,
            owner: Some(1),
        };
        assert_eq!(effective_marker(None, None, "t"), (None, None));
        assert_eq!(effective_marker(Some(m(5)), None, "t"), (Some(m(5)), None));
        assert_eq!(
            effective_marker(Some(m(5)), Some(5), "t"),
            (Some(m(5)), None)
        );
        assert_eq!(
            effective_marker(Some(m(5)), Some(4), "t"),
            (Some(m(5)), None)
        );
        let (lost, said) = effective_marker(None, Some(7), "t.sink");
        assert_eq!(lost.map(|l| l.snapshot), Some(7));
        assert_eq!(decide(lost, 7), Decision::Published);
        assert_eq!(decide(lost, 8), Decision::Publish);
        let said = said.expect("the loss is said");
        assert!(
            said.contains("t.sink") && said.contains("offsets.retention.minutes"),
            "{said}"
        );
        let (behind, said) = effective_marker(Some(m(5)), Some(6), "t");
        assert_eq!(behind.map(|b| b.snapshot), Some(6));
        assert!(said.is_some());
    }

    #[test]
    fn a_flush_waits_longer_for_more_bytes_but_never_past_the_transaction() {
        assert_eq!(flush_timeout(0), KAFKA_TIMEOUT);
        assert_eq!(
            flush_timeout(1 << 20),
            KAFKA_TIMEOUT + Duration::from_secs(1)
        );
        assert_eq!(
            flush_timeout(200 << 20),
            KAFKA_TIMEOUT + Duration::from_secs(200)
        );
        assert_eq!(flush_timeout(u64::MAX), TRANSACTION_TIMEOUT);
    }

    #[test]
    fn only_snapshots_above_the_marker_are_produced() {
        let m = |snapshot| {
            Some(Marker {
                snapshot,
                records: 3,
                owner: None,
            })
        };
        assert_eq!(decide(None, 1), Decision::Publish);
        assert_eq!(decide(m(4), 5), Decision::Publish);
        assert_eq!(decide(m(5), 5), Decision::Published);
        assert_eq!(decide(m(6), 5), Decision::Published);
    }
}
