//! The Kafka source: topic-partitions as source partitions, offsets as positions.
//!
//! * **Partitions.** [`KafkaSourceReader::open`] asks the brokers for the topics' partitions and
//!   lists them in a fixed order: topics in spec order, partitions by number. Partition `i` of
//!   that list is the source partition `i`, named `<topic>/<partition>` in snapshots, and read by
//!   subtask `i % parallelism` as every other source's partitions. Every worker of a run lists
//!   the partitions at its start and the coordinator refuses a start whose workers disagree (a
//!   partition added during the start), exactly as for a file source.
//! * **Positions** are the next offset to read of each partition, kept in the snapshot with the
//!   partitions' names. A restore lays them onto the partitions by name, whatever the
//!   parallelism, and [`KafkaSourceReader::assign`] assigns the subtask's partitions by hand at
//!   exactly those offsets: no consumer-group assignment or committed offset is ever used to
//!   restore. Partitions the snapshot does not know are read from their earliest offset; a job
//!   without state starts where spec.job.source.kafka.startingPosition says, resolved to offsets
//!   before the first record is read (so a checkpoint taken before any record holds real
//!   offsets, not "latest").
//! * **Offsets for lag tools.** [`KafkaSourceReader::commit`] commits the positions of a
//!   snapshot to the consumer group once that snapshot has committed (the worker learns it with
//!   the next barrier); nothing reads them back.
//! * **New partitions** of a running job: [`KafkaSourceReader::partition_count_now`] asks the
//!   brokers again every metadataRefreshInterval; when a topic has more partitions than at the
//!   start, the worker fails its run with a message saying so, and the job restarts from its
//!   latest checkpoint, whose start lists the new partitions and reads them from their earliest
//!   offset (none of their history is skipped; records since the checkpoint are read again,
//!   as after any recovery, which the exactly-once sinks absorb).
//! * **Lag** ([`KafkaSourceReader::lag`], asked every [`LAG_INTERVAL`] by each worker for its
//!   own partitions, [`partition_lag`]): **records behind** a partition is its high watermark
//!   (the offset the next record written gets, from the brokers' ListOffsets) minus the source's
//!   position (the next offset it reads), never below 0. **Seconds behind** is 0 for a partition
//!   read to its end, and otherwise `now` minus the later of the record timestamp of the newest
//!   record the source read from it and the last moment it was measured read to its end: every
//!   record still unread was written after that moment (or carries a later timestamp), so this
//!   bounds from above how long the oldest unread record has waited. It is unknown (absent)
//!   for a partition the run has read nothing from and never measured read to its end. The
//!   end offset is the one the consumer's isolation level sees (librdkafka asks ListOffsets at
//!   that level): under `read_committed`, the last stable offset, so an open transaction's
//!   records are not counted until it commits; the marker of each committed transaction is, so
//!   a fully read partition of a transactional topic may show one record behind until its next
//!   record. A measurement that cannot reach the brokers reports their error instead
//!   ([`KafkaSourceError::Unreachable`]): the source keeps its position and reads on once they
//!   answer again (librdkafka reconnects by itself).
//! * **A consumer that stops fetching** ([`stalled`]): librdkafka's consumer with assigned
//!   partitions sometimes does not resume fetching after a broker restart. Each lag measurement
//!   also compares a partition's end (at the source's isolation level: the last stable offset
//!   for `read_committed`) with where its fetcher stands (librdkafka's statistics, every
//!   [`STATISTICS_INTERVAL`]); a fetcher that sits behind readable records for [`STALL_AFTER`]
//!   while the source polls and reads nothing fails the run with a message saying so, and the
//!   job restarts from its latest checkpoint with a new consumer (records since the checkpoint
//!   are read again, which the exactly-once sinks absorb). A source that is not polling (paused
//!   for a snapshot, held back by a slower operator), an open transaction, and an outage (the
//!   time counts from when the brokers answer again) are never a stall. A measurement that finds
//!   a partition missing from the client's metadata asks the brokers for it again at once.
//! * **Records**: the key from the value's JSON field or the record key, the value field for
//!   sum/min/max, the event time from a JSON field or the record timestamp. A record that does
//!   not parse is skipped with a warning naming its topic, partition and offset (and counted),
//!   so one bad record does not stop the job in a crash loop.

use super::{Credentials, Role, consumer_properties, default_group_id, redacted};
use crate::job::file_source::{FieldMapping, parse_line};
use crate::job::record::{Record, RecordKey};
use crate::runtime::protocol::ExpiredRecords;
use keyshift_core::keygroup::KeyType;
use keyshift_core::spec::{KafkaKeyFrom, KafkaSource, KafkaStartingPosition};
use rdkafka::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::message::Message;
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::util::Timeout;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a metadata or offset request to the brokers may take.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Default of spec.job.source.kafka.idleTimeout.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Default of spec.job.source.kafka.metadataRefreshInterval.
pub const DEFAULT_REFRESH_INTERVAL: Duration = Duration::from_secs(300);
/// How often a worker measures its partitions' lag.
pub const LAG_INTERVAL: Duration = Duration::from_secs(2);
/// How long one lag measurement may wait for the brokers before it reports them unreachable.
pub const LAG_TIMEOUT: Duration = Duration::from_secs(5);

/// A Kafka source that cannot start or read.
#[derive(Debug, thiserror::Error)]
pub enum KafkaSourceError {
    #[error("creating the Kafka consumer (bootstrap {bootstrap}): {error}")]
    Client {
        bootstrap: String,
        error: rdkafka::error::KafkaError,
    },
    #[error("asking the Kafka brokers ({bootstrap}) for topic {topic:?}: {error}")]
    Metadata {
        bootstrap: String,
        topic: String,
        error: String,
    },
    #[error(
        "Kafka topic {topic:?} does not exist on {bootstrap} (or has no partitions): create it, or correct spec.job.source.kafka.topics"
    )]
    NoSuchTopic { bootstrap: String, topic: String },
    #[error("resolving the starting offsets of {partition}: {error}")]
    Offsets { partition: String, error: String },
    #[error(
        "Kafka partition {partition}: the snapshot's position {offset} is past the partition's end {end} (the topic was deleted and created again, or truncated): refusing to read it from another position, which would count its records again or skip them. Restore a snapshot taken since, or point spec.restoreFrom at one that matches the topic (or set spec.upgradeMode: stateless to start over)"
    )]
    PastEnd {
        partition: String,
        offset: u64,
        end: i64,
    },
    #[error("assigning the Kafka partitions: {0}")]
    Assign(rdkafka::error::KafkaError),
    #[error("Kafka source partition {0} is not one of this source's partitions")]
    UnknownPartition(u32),
    #[error("reading Kafka partition {partition}: {error}")]
    Read { partition: String, error: String },
    #[error(transparent)]
    Credentials(#[from] super::MissingCredential),
    #[error(
        "cannot reach the Kafka brokers {bootstrap} of the source: {error}{}",
        client_note(.client)
    )]
    Unreachable {
        bootstrap: String,
        /// The request that failed and its error.
        error: String,
        /// The client's recent reports of its own (why it cannot connect), oldest first.
        client: Option<String>,
    },
}

fn client_note(client: &Option<String>) -> String {
    client
        .as_deref()
        .map(|c| format!(" (client reports: {c})"))
        .unwrap_or_default()
}

/// How long a partition's fetcher may sit behind readable records while the source polls
/// before its consumer is called stalled ([`stalled`]).
pub const STALL_AFTER: Duration = Duration::from_secs(30);

/// How recently the source must have polled a partition for it to count as stalled rather than
/// paused.
pub const POLLING_WITHIN: Duration = Duration::from_secs(5);

/// What librdkafka's statistics say of one partition's fetcher ([`SourceContext`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FetchView {
    /// The next offset the fetcher asks the broker for (past control and aborted records it
    /// skipped); negative before its first fetch.
    pub next_offset: i64,
    /// When (ms) the statistics were taken.
    pub at_ms: i64,
    /// When (ms) `next_offset` last changed.
    pub moved_ms: i64,
}

/// How often librdkafka reports its statistics to the source ([`FetchView`]).
pub const STATISTICS_INTERVAL: Duration = Duration::from_secs(5);

/// Whether a partition's consumer has stalled: the brokers hold readable records past what its
/// fetcher asked for (`end`, the partition's end offset as the source's isolation level sees
/// it: the last stable offset for `read_committed`, so open transactions never count, is beyond
/// `fetch.next_offset`, which moves past control and aborted records), the source has polled
/// within [`POLLING_WITHIN`] of `now_ms` (it is reading, not paused or held back), the
/// statistics are fresh, and for [`STALL_AFTER`] neither has the fetcher moved nor has the
/// source read a record (`since_ms`: the later of its last record, the assignment and the
/// brokers answering again after an outage; a slow job draining what was fetched reads records).
/// Times in Unix milliseconds. Pure.
pub fn stalled(end: i64, fetch: FetchView, last_poll_ms: i64, since_ms: i64, now_ms: i64) -> bool {
    let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
    fetch.next_offset >= 0
        && end > fetch.next_offset
        && now_ms.saturating_sub(fetch.at_ms) <= 3 * ms(STATISTICS_INTERVAL)
        && now_ms.saturating_sub(last_poll_ms) <= ms(POLLING_WITHIN)
        && now_ms.saturating_sub(since_ms.max(fetch.moved_ms)) >= ms(STALL_AFTER)
}

/// Distinct client reports kept ([`SourceContext`]).
const CLIENT_REPORTS_KEPT: usize = 3;

/// The source consumer's context: forwards librdkafka's logs to tracing and keeps the client's
/// last few distinct errors (a broker that refuses connections, a failed authentication, all
/// brokers down) to name them when the brokers cannot be reached.
#[derive(Default)]
pub struct SourceContext {
    reports: Mutex<Vec<String>>,
    /// Each partition's fetcher as the last statistics showed it, by (topic, partition).
    fetch: Mutex<BTreeMap<(String, i32), FetchView>>,
}

impl SourceContext {
    fn keep(&self, text: String) {
        let mut kept = self
            .reports
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        kept.retain(|e| *e != text);
        kept.push(text);
        if kept.len() > CLIENT_REPORTS_KEPT {
            kept.remove(0);
        }
    }

    /// The last distinct reports, oldest first.
    fn reports(&self) -> Option<String> {
        let kept = self
            .reports
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        (!kept.is_empty()).then(|| kept.join("; "))
    }

    /// The fetcher of `topic`/`partition` as the last statistics showed it.
    fn fetch(&self, topic: &str, partition: i32) -> Option<FetchView> {
        self.fetch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&(topic.to_owned(), partition))
            .copied()
    }

    /// Forgets the reports (the brokers answered).
    fn clear(&self) {
        self.reports
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clear();
    }
}

impl ClientContext for SourceContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        match level {
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error
            | RDKafkaLogLevel::Warning => {
                // What a failure is about also comes through `error` (kept there, once).
                tracing::warn!(facility = fac, "Kafka consumer: {log_message}")
            }
            _ => tracing::debug!(facility = fac, "Kafka consumer: {log_message}"),
        }
    }

    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        tracing::warn!(%error, reason, "Kafka consumer error");
        self.keep(format!("{error}: {reason}"));
    }

    fn stats(&self, statistics: rdkafka::Statistics) {
        let now = now_ms();
        let mut fetch = self
            .fetch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (topic, t) in statistics.topics {
            // Partition -1 is librdkafka's internal "unassigned" partition.
            for (partition, p) in t.partitions.into_iter().filter(|(p, _)| *p >= 0) {
                let key = (topic.clone(), partition);
                let moved_ms = match fetch.get(&key) {
                    Some(old) if old.next_offset == p.next_offset => old.moved_ms,
                    _ => now,
                };
                fetch.insert(
                    key,
                    FetchView {
                        next_offset: p.next_offset,
                        at_ms: now,
                        moved_ms,
                    },
                );
            }
        }
    }
}

impl ConsumerContext for SourceContext {}

type SourceConsumer = BaseConsumer<SourceContext>;

/// A partition's lag: records behind (`high - position`, at least 0) and seconds behind (0 when
/// none is behind; else `now` minus the later of the newest read record's timestamp and the
/// last time the partition was measured read to its end; unknown without either). Times in
/// Unix milliseconds. Pure.
pub fn partition_lag(
    position: u64,
    high: i64,
    newest_read_ms: Option<i64>,
    caught_up_ms: Option<i64>,
    now_ms: i64,
) -> (u64, Option<f64>) {
    let records = u64::try_from(high).unwrap_or(0).saturating_sub(position);
    if records == 0 {
        return (0, Some(0.0));
    }
    let since = match (newest_read_ms, caught_up_ms) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
    (
        records,
        since.map(|t| now_ms.saturating_sub(t).max(0) as f64 / 1000.0),
    )
}

/// How records become keyed records.
#[derive(Debug, Clone)]
pub struct KafkaFields {
    /// Where the key comes from.
    pub key_from: KafkaKeyFrom,
    /// The key's JSON field (key_from `value`) and its type.
    pub key_field: String,
    /// The key type.
    pub key_type: KeyType,
    /// The numeric JSON field sum/min/max read; None for count.
    pub value_field: Option<String>,
    /// The event-time JSON field; None: the record timestamp.
    pub timestamp_field: Option<String>,
}

/// The job a source belongs to (for its default consumer group).
#[derive(Debug, Clone)]
pub struct JobIdentity {
    pub namespace: String,
    pub name: String,
}

/// One topic-partition.
#[derive(Debug, Clone, PartialEq, Eq)]
struct TopicPartition {
    topic: String,
    partition: i32,
}

/// The name of a topic-partition in snapshots: `<topic>/<partition>` (a topic name has no `/`).
pub fn partition_name(topic: &str, partition: i32) -> String {
    format!("{topic}/{partition}")
}

/// The topic-partition of a name made by [`partition_name`].
pub fn parse_partition_name(name: &str) -> Option<(&str, i32)> {
    let (topic, p) = name.rsplit_once('/')?;
    let p: i32 = p.parse().ok()?;
    (!topic.is_empty() && p >= 0).then_some((topic, p))
}

/// The source partitions of `topics` (in spec order) with `counts[i]` partitions each: topics in
/// order, partitions by number. Pure.
pub fn list_partitions(topics: &[String], counts: &[i32]) -> Vec<String> {
    topics
        .iter()
        .zip(counts)
        .flat_map(|(t, n)| (0..*n).map(move |p| partition_name(t, p)))
        .collect()
}

/// Where a partition without a restored offset starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartAt {
    /// The earliest offset the partition holds.
    Earliest,
    /// Its end (the next offset to be written).
    Latest,
    /// The first offset at or after this time (ms).
    Timestamp(i64),
}

/// Where a partition starts: its restored offset, or — without one — the earliest offset when
/// the job restored a snapshot (a partition new since), or the spec's starting position. Pure.
pub fn start_at(
    restored: Option<u64>,
    from_snapshot: bool,
    spec: &KafkaSource,
) -> Result<u64, StartAt> {
    if let Some(o) = restored {
        return Ok(o);
    }
    if from_snapshot {
        return Err(StartAt::Earliest);
    }
    Err(match spec.starting_position {
        KafkaStartingPosition::Earliest => StartAt::Earliest,
        KafkaStartingPosition::Latest => StartAt::Latest,
        KafkaStartingPosition::Timestamp => {
            StartAt::Timestamp(spec.starting_timestamp.unwrap_or(0))
        }
    })
}

/// Whether a restored position lies past a partition's end `high` (its high watermark: the
/// next offset to be written). A position at the end is the usual one of a source that read
/// everything. Pure.
pub fn past_end(position: u64, high: i64) -> bool {
    position > u64::try_from(high.max(0)).unwrap_or(0)
}

/// Where a restored position `position` starts when the partition's earliest record is at
/// `low` (its low watermark): `Some(low)` when retention deleted records the position had not
/// reached, `None` when the position is still there. Pure.
pub fn below_start(position: u64, low: i64) -> Option<u64> {
    let low = u64::try_from(low.max(0)).unwrap_or(0);
    (position < low).then_some(low)
}

/// Turns one Kafka record into a keyed record. Pure.
pub fn to_record(
    key: Option<&[u8]>,
    payload: Option<&[u8]>,
    record_ts: Option<i64>,
    fields: &KafkaFields,
) -> Result<Record, String> {
    let needs_json = fields.key_from == KafkaKeyFrom::Value
        || fields.value_field.is_some()
        || fields.timestamp_field.is_some();
    let parsed = if needs_json {
        let payload = payload.ok_or("the record has no value (a tombstone)")?;
        // The JSON parse of the file source, with its field rules and messages; the key field
        // is read from the value only when the key comes from there.
        let mapping = FieldMapping {
            key_field: match fields.key_from {
                KafkaKeyFrom::Value => fields.key_field.clone(),
                KafkaKeyFrom::RecordKey => String::new(),
            },
            key_type: fields.key_type,
            value_field: fields.value_field.clone(),
            timestamp_field: fields.timestamp_field.clone(),
        };
        Some(parse_value(payload, &mapping)?)
    } else {
        None
    };
    let key = match fields.key_from {
        KafkaKeyFrom::Value => parsed
            .as_ref()
            .map(|r| r.key.clone())
            .ok_or("the record has no value")?,
        KafkaKeyFrom::RecordKey => {
            let raw = key.ok_or("the record has no key")?;
            let text = std::str::from_utf8(raw).map_err(|e| format!("record key: {e}"))?;
            match fields.key_type {
                KeyType::String => RecordKey::string(text),
                KeyType::Long => RecordKey::long(
                    text.trim()
                        .parse()
                        .map_err(|e| format!("record key {text:?}: {e}"))?,
                ),
                KeyType::Int => RecordKey::int(
                    text.trim()
                        .parse()
                        .map_err(|e| format!("record key {text:?}: {e}"))?,
                ),
            }
        }
    };
    let value = parsed.as_ref().map_or(0, |r| r.value);
    let ts = match &fields.timestamp_field {
        Some(_) => parsed.as_ref().map_or(0, |r| r.ts),
        None => record_ts.unwrap_or(0),
    };
    Ok(Record { key, value, ts })
}

/// [`parse_line`] with an empty key field meaning "no key in the value" (a placeholder key).
fn parse_value(payload: &[u8], mapping: &FieldMapping) -> Result<Record, String> {
    if mapping.key_field.is_empty() {
        // Parse with a key field that cannot be missing: the object itself is checked, the key
        // comes from the record key.
        let mut obj: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(payload).map_err(|e| format!("not a JSON object: {e}"))?;
        obj.insert(KEY_PLACEHOLDER.into(), serde_json::Value::from(0));
        let line = serde_json::to_vec(&obj).map_err(|e| e.to_string())?;
        let m = FieldMapping {
            key_field: KEY_PLACEHOLDER.into(),
            key_type: KeyType::Long,
            ..mapping.clone()
        };
        parse_line(&line, &m)
    } else {
        parse_line(payload, mapping)
    }
}

const KEY_PLACEHOLDER: &str = "\u{0}keyshift-record-key";

/// The state of a reading source: its partition queues.
struct Assigned {
    /// Per source partition this subtask reads: its queue.
    queues: BTreeMap<u32, rdkafka::consumer::base_consumer::PartitionQueue<SourceContext>>,
    /// Messages fetched into the consumer's main queue before the partition queues were split
    /// off (librdkafka starts fetching at `assign`): read before the partition's queue, in order.
    early: BTreeMap<u32, std::collections::VecDeque<rdkafka::message::OwnedMessage>>,
}

/// What a read does with each record: its key, value and timestamp (ms), or why it is skipped.
type Take<'a> = dyn FnMut(Option<&[u8]>, Option<&[u8]>, Option<i64>) -> Result<(), String> + 'a;

/// A Kafka source of one worker: its consumer and the partitions it listed at the start.
pub struct KafkaSourceReader {
    spec: KafkaSource,
    /// How a record becomes one of the built-in aggregation (`None`: a program's source, read
    /// with [`KafkaSourceReader::read_payloads`]).
    fields: Option<KafkaFields>,
    consumer: Arc<SourceConsumer>,
    partitions: Vec<TopicPartition>,
    names: Vec<String>,
    /// Partition count per topic (spec order) at the start.
    counts: Vec<i32>,
    assigned: Mutex<Option<Assigned>>,
    skipped: AtomicU64,
    /// Per partition: the record timestamp (ms) of the newest record read, [`i64::MIN`] if none.
    newest_read_ms: Vec<AtomicI64>,
    /// Per partition: when (ms) a lag measurement last found it read to its end, or
    /// [`i64::MIN`].
    caught_up_ms: Vec<AtomicI64>,
    /// Per partition: when (ms) it was assigned or last yielded a record ([`stalled`]).
    progress_ms: Vec<AtomicI64>,
    /// Per partition: when (ms) the source last polled it, or [`i64::MIN`].
    polled_ms: Vec<AtomicI64>,
    /// When (ms) a lag measurement last failed to reach the brokers, or [`i64::MIN`]: a stall
    /// is counted from when they answer again, not from the last record before the outage.
    unreachable_ms: AtomicI64,
}

impl std::fmt::Debug for KafkaSourceReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSourceReader")
            .field("bootstrap", &self.spec.bootstrap_servers)
            .field("topics", &self.spec.topics)
            .field("partitions", &self.names.len())
            .finish()
    }
}

impl KafkaSourceReader {
    /// Connects (consumer properties from the spec and the worker's credentials) and lists the
    /// topics' partitions. Blocking: asks the brokers.
    pub fn open(
        spec: &KafkaSource,
        fields: Option<KafkaFields>,
        job: &JobIdentity,
    ) -> Result<KafkaSourceReader, KafkaSourceError> {
        let creds = Credentials::from_env(Role::Source, spec.credentials.as_ref())?;
        let group = spec
            .group_id
            .clone()
            .unwrap_or_else(|| default_group_id(&job.namespace, &job.name));
        let props = consumer_properties(spec, &group, &creds);
        tracing::debug!(properties = ?redacted(&props), "Kafka consumer");
        let consumer: SourceConsumer = super::client_config(&props)
            .create_with_context(SourceContext::default())
            .map_err(|error| KafkaSourceError::Client {
                bootstrap: spec.bootstrap_servers.clone(),
                error,
            })?;
        let consumer = Arc::new(consumer);
        let counts = topic_partition_counts(&consumer, spec)?;
        let names = list_partitions(&spec.topics, &counts);
        let partitions = spec
            .topics
            .iter()
            .zip(&counts)
            .flat_map(|(t, n)| {
                (0..*n).map(move |p| TopicPartition {
                    topic: t.clone(),
                    partition: p,
                })
            })
            .collect();
        Ok(KafkaSourceReader {
            spec: spec.clone(),
            fields,
            consumer,
            partitions,
            counts,
            assigned: Mutex::new(None),
            skipped: AtomicU64::new(0),
            newest_read_ms: names.iter().map(|_| AtomicI64::new(i64::MIN)).collect(),
            caught_up_ms: names.iter().map(|_| AtomicI64::new(i64::MIN)).collect(),
            progress_ms: names.iter().map(|_| AtomicI64::new(i64::MIN)).collect(),
            polled_ms: names.iter().map(|_| AtomicI64::new(i64::MIN)).collect(),
            unreachable_ms: AtomicI64::new(i64::MIN),
            names,
        })
    }

    /// The source's bootstrap servers.
    pub fn bootstrap(&self) -> &str {
        &self.spec.bootstrap_servers
    }

    /// Number of source partitions listed at the start.
    pub fn partitions(&self) -> u32 {
        self.names.len() as u32
    }

    /// The partitions' names (`<topic>/<partition>`), in source partition order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Records skipped because they did not parse.
    pub fn skipped(&self) -> u64 {
        self.skipped.load(Ordering::Relaxed)
    }

    /// How long a partition may go without records before it no longer holds the watermark.
    pub fn idle_timeout(&self) -> Duration {
        self.spec
            .idle_timeout
            .as_deref()
            .and_then(keyshift_core::duration::parse_duration)
            .unwrap_or(DEFAULT_IDLE_TIMEOUT)
    }

    /// How often to look for new partitions.
    pub fn refresh_interval(&self) -> Duration {
        self.spec
            .metadata_refresh_interval
            .as_deref()
            .and_then(keyshift_core::duration::parse_duration)
            .unwrap_or(DEFAULT_REFRESH_INTERVAL)
    }

    fn partition(&self, p: u32) -> Result<&TopicPartition, KafkaSourceError> {
        self.partitions
            .get(p as usize)
            .ok_or(KafkaSourceError::UnknownPartition(p))
    }

    /// A partition's low and high watermarks as a start resolves offsets (retried). Blocking.
    fn start_watermarks(&self, tp: &TopicPartition) -> Result<(i64, i64), KafkaSourceError> {
        retrying(|| {
            self.consumer
                .fetch_watermarks(&tp.topic, tp.partition, REQUEST_TIMEOUT)
        })
        .map_err(|e| KafkaSourceError::Offsets {
            partition: partition_name(&tp.topic, tp.partition),
            error: e.to_string(),
        })
    }

    /// Resolves where each of `mine` starts ([`start_at`]), assigns them to the consumer at those
    /// offsets and splits their queues. Returns every partition's starting offset, and the
    /// records of restored partitions that were deleted before the job read them (a restored
    /// offset below the partition's earliest: the partition starts there, and says so). Blocking.
    pub fn assign(
        &self,
        mine: &[u32],
        restored: &BTreeMap<u32, u64>,
        from_snapshot: bool,
    ) -> Result<(BTreeMap<u32, u64>, Vec<ExpiredRecords>), KafkaSourceError> {
        let mut starts = BTreeMap::new();
        let mut expired = Vec::new();
        let mut by_time = TopicPartitionList::new();
        let mut timed = Vec::new();
        for &p in mine {
            let tp = self.partition(p)?;
            let name = || partition_name(&tp.topic, tp.partition);
            let offset = match start_at(restored.get(&p).copied(), from_snapshot, &self.spec) {
                Ok(o) => {
                    // A restored position the partition does not reach: the consumer would
                    // reset it (auto.offset.reset) and read the partition again.
                    let (low, high) = self.start_watermarks(tp)?;
                    if past_end(o, high) {
                        return Err(KafkaSourceError::PastEnd {
                            partition: name(),
                            offset: o,
                            end: high,
                        });
                    }
                    // Below the earliest record the partition still holds: its retention
                    // deleted the records in between before the job read them. The source
                    // starts at the earliest, and the start reports what was lost.
                    match below_start(o, low) {
                        Some(earliest) => {
                            expired.push(ExpiredRecords {
                                partition: name(),
                                from: o,
                                to: earliest,
                            });
                            earliest
                        }
                        None => o,
                    }
                }
                Err(StartAt::Timestamp(ts)) => {
                    by_time
                        .add_partition_offset(&tp.topic, tp.partition, Offset::Offset(ts))
                        .map_err(|e| KafkaSourceError::Offsets {
                            partition: name(),
                            error: e.to_string(),
                        })?;
                    timed.push(p);
                    continue;
                }
                Err(at) => {
                    let (low, high) = self.start_watermarks(tp)?;
                    let o = if at == StartAt::Latest { high } else { low };
                    o.max(0) as u64
                }
            };
            starts.insert(p, offset);
        }
        if !timed.is_empty() {
            let found = retrying(|| {
                self.consumer
                    .offsets_for_times(by_time.clone(), REQUEST_TIMEOUT)
            })
            .map_err(|e| KafkaSourceError::Offsets {
                partition: "the partitions of startingTimestamp".into(),
                error: e.to_string(),
            })?;
            for p in timed {
                let tp = self.partition(p)?;
                let at = found
                    .find_partition(&tp.topic, tp.partition)
                    .map(|e| e.offset());
                let offset = match at {
                    Some(Offset::Offset(o)) if o >= 0 => o as u64,
                    // No record at or after the time: the partition's end.
                    _ => {
                        let (_, high) = self.start_watermarks(tp)?;
                        high.max(0) as u64
                    }
                };
                starts.insert(p, offset);
            }
        }
        let mut tpl = TopicPartitionList::new();
        for (&p, &offset) in &starts {
            let tp = self.partition(p)?;
            let offset = i64::try_from(offset).unwrap_or(i64::MAX);
            tpl.add_partition_offset(&tp.topic, tp.partition, Offset::Offset(offset))
                .map_err(KafkaSourceError::Assign)?;
        }
        self.consumer
            .assign(&tpl)
            .map_err(KafkaSourceError::Assign)?;
        let mut queues = BTreeMap::new();
        for &p in starts.keys() {
            let tp = self.partition(p)?;
            let q = self
                .consumer
                .split_partition_queue(&tp.topic, tp.partition)
                .ok_or_else(|| KafkaSourceError::Read {
                    partition: partition_name(&tp.topic, tp.partition),
                    error: "no partition queue".into(),
                })?;
            queues.insert(p, q);
        }
        if let Ok(mut a) = self.assigned.lock() {
            *a = Some(Assigned {
                queues,
                early: BTreeMap::new(),
            });
        }
        let now = now_ms();
        for (p, o) in &starts {
            if let Some(t) = self.progress_ms.get(*p as usize) {
                t.store(now, Ordering::Relaxed);
            }
            tracing::info!(partition = %self.names[*p as usize], offset = o, "Kafka partition assigned");
        }
        Ok((starts, expired))
    }

    /// Reads up to `max` records of partition `p` that are already fetched (never waits), from
    /// offset `at`, into `out`. Returns (records, next position, at end).
    pub fn read(
        &self,
        p: u32,
        at: u64,
        out: &mut Vec<Record>,
        max: usize,
    ) -> Result<(usize, u64, bool), KafkaSourceError> {
        let Some(fields) = &self.fields else {
            return Err(KafkaSourceError::Read {
                partition: self.names.get(p as usize).cloned().unwrap_or_default(),
                error: "this source feeds a program: its records are read with read_payloads"
                    .into(),
            });
        };
        self.read_with(p, at, max, &mut |key, payload, ts| {
            out.push(to_record(key, payload, ts, fields)?);
            Ok(())
        })
    }

    /// Reads up to `max` records of partition `p` from offset `at` for a program: each record's
    /// value goes to `each` (a record without a value, or one `each` refuses, is skipped with a
    /// warning, as a record that does not parse is). Returns what [`Self::read`] returns.
    pub fn read_payloads(
        &self,
        p: u32,
        at: u64,
        max: usize,
        each: &mut dyn FnMut(&[u8]) -> Result<(), String>,
    ) -> Result<(usize, u64, bool), KafkaSourceError> {
        self.read_with(p, at, max, &mut |_, payload, _| {
            each(payload.ok_or_else(|| "the record has no value".to_owned())?)
        })
    }

    fn read_with(
        &self,
        p: u32,
        at: u64,
        max: usize,
        each: &mut Take<'_>,
    ) -> Result<(usize, u64, bool), KafkaSourceError> {
        let read = self.read_queues(p, at, each, max)?;
        let now = now_ms();
        if let Some(t) = self.polled_ms.get(p as usize) {
            t.store(now, Ordering::Relaxed);
        }
        if read.1 > at
            && let Some(t) = self.progress_ms.get(p as usize)
        {
            t.store(now, Ordering::Relaxed);
        }
        Ok(read)
    }

    fn read_queues(
        &self,
        p: u32,
        at: u64,
        out: &mut Take<'_>,
        max: usize,
    ) -> Result<(usize, u64, bool), KafkaSourceError> {
        let mut guard = self.assigned.lock().map_err(|_| KafkaSourceError::Read {
            partition: p.to_string(),
            error: "the consumer's lock is poisoned".into(),
        })?;
        let assigned = guard
            .as_mut()
            .ok_or(KafkaSourceError::UnknownPartition(p))?;
        // Serve the consumer's events (errors, statistics). Its messages come through the
        // partition queues, except those fetched before the queues were split: keep them.
        while let Some(polled) = self.consumer.poll(Duration::ZERO) {
            match polled {
                Err(e) => tracing::warn!(error = %e, "Kafka consumer"),
                Ok(m) => {
                    let index = self
                        .partitions
                        .iter()
                        .position(|tp| tp.topic == m.topic() && tp.partition == m.partition());
                    if let Some(index) = index {
                        assigned
                            .early
                            .entry(index as u32)
                            .or_default()
                            .push_back(m.detach());
                    }
                }
            }
        }
        let tp = self.partition(p)?;
        if crate::failpoints::kafka_fetch_stalled(&tp.topic) {
            // As a consumer that stopped fetching: the partition paused, nothing read.
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition(&tp.topic, tp.partition);
            if let Err(e) = self.consumer.pause(&tpl) {
                tracing::warn!(error = %e, "pausing the partition (test only)");
            }
            return Ok((0, at, true));
        }
        let mut next = at;
        let mut n = 0;
        while n < max {
            if let Some(m) = assigned.early.get_mut(&p).and_then(|q| q.pop_front()) {
                self.take(p, &m, &mut next, &mut n, out);
                continue;
            }
            let queue = assigned
                .queues
                .get(&p)
                .ok_or(KafkaSourceError::UnknownPartition(p))?;
            match queue.poll(Duration::ZERO) {
                None => return Ok((n, next, true)),
                Some(Err(e)) => {
                    // Transient errors (a broker restarting, a leader moving) are retried by
                    // librdkafka; the partition simply has nothing now.
                    tracing::warn!(partition = %self.names[p as usize], error = %e, "Kafka fetch");
                    return Ok((n, next, true));
                }
                Some(Ok(m)) => self.take(p, &m, &mut next, &mut n, out),
            }
        }
        Ok((n, next, false))
    }

    /// Hands message `m` of partition `p` to `out` (unless it is before `next`; one `out`
    /// refuses is skipped with a warning), moving `next` past it.
    fn take(&self, p: u32, m: &impl Message, next: &mut u64, n: &mut usize, out: &mut Take<'_>) {
        let offset = m.offset();
        if offset < 0 || (offset as u64) < *next {
            return;
        }
        *next = offset as u64 + 1;
        if let (Some(ts), Some(newest)) = (
            m.timestamp().to_millis(),
            self.newest_read_ms.get(p as usize),
        ) {
            newest.fetch_max(ts, Ordering::Relaxed);
        }
        match out(m.key(), m.payload(), m.timestamp().to_millis()) {
            Ok(()) => {
                *n += 1;
            }
            Err(reason) => {
                let skipped = self.skipped.fetch_add(1, Ordering::Relaxed) + 1;
                tracing::warn!(
                    partition = %self.names[p as usize],
                    offset,
                    skipped,
                    reason,
                    "Kafka record skipped: it does not parse"
                );
            }
        }
    }

    /// Commits `positions` (of a committed snapshot) to the consumer group, for lag tools.
    /// Asynchronous: a failure is logged, never fatal (nothing reads them back).
    pub fn commit(&self, positions: &BTreeMap<u32, u64>) {
        let mut tpl = TopicPartitionList::new();
        for (&p, &o) in positions {
            let Ok(tp) = self.partition(p) else { continue };
            let o = i64::try_from(o).unwrap_or(i64::MAX);
            if tpl
                .add_partition_offset(&tp.topic, tp.partition, Offset::Offset(o))
                .is_err()
            {
                continue;
            }
        }
        if tpl.count() == 0 {
            return;
        }
        if let Err(e) = self.consumer.commit(&tpl, CommitMode::Async) {
            tracing::warn!(error = %e, "committing offsets to the Kafka consumer group (for lag tools only)");
        }
    }

    /// The topics whose partition count differs from the start's, as `(topic, then, now)`, by
    /// asking the brokers. Blocking.
    pub fn changed_topics(&self) -> Result<Vec<(String, i32, i32)>, KafkaSourceError> {
        let now = topic_partition_counts(&self.consumer, &self.spec)?;
        Ok(self
            .spec
            .topics
            .iter()
            .zip(self.counts.iter().zip(&now))
            .filter(|(_, (a, b))| a != b)
            .map(|(t, (a, b))| (t.clone(), *a, *b))
            .collect())
    }

    /// Each partition's (low, high) offsets, for lag: `high - position` records behind.
    pub fn watermarks(&self, p: u32) -> Result<(i64, i64), KafkaSourceError> {
        let tp = self.partition(p)?;
        self.consumer
            .fetch_watermarks(&tp.topic, tp.partition, Timeout::After(REQUEST_TIMEOUT))
            .map_err(|e| KafkaSourceError::Read {
                partition: partition_name(&tp.topic, tp.partition),
                error: e.to_string(),
            })
    }

    /// The lag of the partitions at `positions` (source partition -> next offset), measured
    /// now against the brokers' high watermarks ([`partition_lag`]); each request waits at
    /// most [`LAG_TIMEOUT`]. Brokers that do not answer give
    /// [`KafkaSourceError::Unreachable`] with the client's own reports. Blocking.
    pub fn lag(
        &self,
        positions: &BTreeMap<u32, u64>,
    ) -> Result<crate::runtime::protocol::SourceLag, KafkaSourceError> {
        let mut out = crate::runtime::protocol::SourceLag {
            bootstrap: self.spec.bootstrap_servers.clone(),
            ..Default::default()
        };
        for (&p, &position) in positions {
            let tp = self.partition(p)?;
            let name = partition_name(&tp.topic, tp.partition);
            let (_, high) = self
                .consumer
                .fetch_watermarks(&tp.topic, tp.partition, Timeout::After(LAG_TIMEOUT))
                .map_err(|e| {
                    self.unreachable_ms.store(now_ms(), Ordering::Relaxed);
                    if e.rdkafka_error_code() == Some(RDKafkaErrorCode::UnknownPartition) {
                        // The client lost the partition from its metadata (a broker restarting
                        // answers without it): ask again now, not at the periodic refresh.
                        if let Err(e) = self
                            .consumer
                            .fetch_metadata(Some(&tp.topic), Timeout::After(LAG_TIMEOUT))
                        {
                            tracing::warn!(topic = %tp.topic, error = %e, "refreshing the Kafka topic's metadata");
                        }
                    }
                    KafkaSourceError::Unreachable {
                        bootstrap: self.spec.bootstrap_servers.clone(),
                        error: format!("asking for the end offset of {name}: {e}"),
                        client: self.consumer.context().reports(),
                    }
                })?;
            let now = now_ms();
            let known = |v: Option<&AtomicI64>| {
                v.map(|a| a.load(Ordering::Relaxed))
                    .filter(|t| *t != i64::MIN)
            };
            let (records, seconds) = partition_lag(
                position,
                high,
                known(self.newest_read_ms.get(p as usize)),
                known(self.caught_up_ms.get(p as usize)),
                now,
            );
            if records == 0
                && let Some(c) = self.caught_up_ms.get(p as usize)
            {
                c.store(now, Ordering::Relaxed);
            }
            out.records += records;
            out.seconds = match (out.seconds, seconds) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            };
            out.partitions.push(crate::runtime::protocol::PartitionLag {
                partition: name,
                position,
                high_watermark: u64::try_from(high).unwrap_or(0),
                records,
                seconds,
            });
        }
        self.consumer.context().clear();
        out.measured_ms = now_ms();
        Ok(out)
    }

    /// The partitions of `lag` (a measurement just taken) whose consumer has stalled
    /// ([`stalled`]), each as a sentence for the run's failure.
    pub fn stalled_partitions(&self, lag: &crate::runtime::protocol::SourceLag) -> Vec<String> {
        let now = now_ms();
        let at =
            |v: &[AtomicI64], i: usize| v.get(i).map_or(i64::MIN, |a| a.load(Ordering::Relaxed));
        let unreachable = self.unreachable_ms.load(Ordering::Relaxed);
        lag.partitions
            .iter()
            .filter_map(|pl| {
                let i = self.names.iter().position(|n| *n == pl.partition)?;
                let tp = self.partitions.get(i)?;
                let fetch = self.consumer.context().fetch(&tp.topic, tp.partition)?;
                let end = i64::try_from(pl.high_watermark).unwrap_or(i64::MAX);
                let since = at(&self.progress_ms, i).max(unreachable);
                stalled(end, fetch, at(&self.polled_ms, i), since, now).then(|| {
                    format!(
                        "Kafka partition {} has records up to offset {end} but its consumer has fetched nothing past offset {} for {} s while the source polled it",
                        pl.partition,
                        fetch.next_offset,
                        now.saturating_sub(since.max(fetch.moved_ms)) / 1000
                    )
                })
            })
            .collect()
    }
}

/// Now, in Unix milliseconds.
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// How long [`retrying`] keeps trying.
const RETRY_FOR: Duration = Duration::from_secs(30);

/// Runs a broker request until it succeeds or [`RETRY_FOR`] has passed, with growing pauses:
/// errors such as "not leader for partition" (a partition just created, a broker restarting)
/// pass within seconds. Blocking.
fn retrying<T>(
    mut request: impl FnMut() -> rdkafka::error::KafkaResult<T>,
) -> rdkafka::error::KafkaResult<T> {
    let start = std::time::Instant::now();
    let mut pause = Duration::from_millis(100);
    loop {
        match request() {
            Ok(v) => return Ok(v),
            Err(e) if start.elapsed() + pause < RETRY_FOR => {
                tracing::debug!(error = %e, "Kafka request failed; retrying");
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Partition count of each of the spec's topics (spec order). Blocking.
fn topic_partition_counts(
    consumer: &SourceConsumer,
    spec: &KafkaSource,
) -> Result<Vec<i32>, KafkaSourceError> {
    let mut counts = Vec::with_capacity(spec.topics.len());
    for topic in &spec.topics {
        let md =
            retrying(|| consumer.fetch_metadata(Some(topic), REQUEST_TIMEOUT)).map_err(|e| {
                KafkaSourceError::Metadata {
                    bootstrap: spec.bootstrap_servers.clone(),
                    topic: topic.clone(),
                    error: e.to_string(),
                }
            })?;
        let t = md.topics().iter().find(|t| t.name() == topic);
        let n = match t {
            Some(t) if t.error().is_none() => t.partitions().len() as i32,
            Some(t) => {
                let err = t.error().map(|e| format!("{e:?}")).unwrap_or_default();
                if err.contains("UnknownTopic") {
                    0
                } else {
                    return Err(KafkaSourceError::Metadata {
                        bootstrap: spec.bootstrap_servers.clone(),
                        topic: topic.clone(),
                        error: err,
                    });
                }
            }
            None => 0,
        };
        if n == 0 {
            return Err(KafkaSourceError::NoSuchTopic {
                bootstrap: spec.bootstrap_servers.clone(),
                topic: topic.clone(),
            });
        }
        counts.push(n);
    }
    Ok(counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(position: KafkaStartingPosition, ts: Option<i64>) -> KafkaSource {
        KafkaSource {
            bootstrap_servers: "k:9092".into(),
            topics: vec!["a".into(), "b".into()],
            key_from: KafkaKeyFrom::Value,
            timestamp_field: None,
            starting_position: position,
            starting_timestamp: ts,
            group_id: None,
            idle_timeout: None,
            metadata_refresh_interval: None,
            properties: BTreeMap::new(),
            credentials: None,
        }
    }

    fn fields(key_from: KafkaKeyFrom, key_type: KeyType) -> KafkaFields {
        KafkaFields {
            key_from,
            key_field: "user".into(),
            key_type,
            value_field: None,
            timestamp_field: None,
        }
    }

    /// A restored position below a partition's earliest record (retention deleted records the
    /// job had not read) starts at the earliest, and the start says so.
    #[test]
    fn a_position_below_the_earliest_record_starts_there_and_says_so() {
        assert_eq!(below_start(5, 0), None);
        assert_eq!(
            below_start(5, 5),
            None,
            "the earliest record is the next to read"
        );
        assert_eq!(below_start(3, 8), Some(8));
        assert_eq!(below_start(0, -1), None, "an empty partition");
    }

    /// A restored position at or before a partition's end is read from; one past it (a topic
    /// deleted and created again) is refused instead of reset.
    #[test]
    fn a_restored_position_past_the_partitions_end_is_refused() {
        assert!(!past_end(0, 0));
        assert!(!past_end(10, 10), "read to the end");
        assert!(!past_end(3, 10));
        assert!(past_end(11, 10));
        assert!(
            past_end(1, -1),
            "an empty partition the broker reports as -1"
        );
        assert!(!past_end(0, -1));
        let e = KafkaSourceError::PastEnd {
            partition: "clicks/3".into(),
            offset: 500,
            end: 12,
        }
        .to_string();
        assert!(
            e.contains("clicks/3") && e.contains("500") && e.contains("12"),
            "{e}"
        );
    }

    #[test]
    fn partitions_are_listed_by_topic_order_then_number_and_named_back() {
        let names = list_partitions(&["b".into(), "a.x".into()], &[2, 3]);
        assert_eq!(names, ["b/0", "b/1", "a.x/0", "a.x/1", "a.x/2"]);
        for (i, n) in names.iter().enumerate() {
            let (t, p) = parse_partition_name(n).unwrap();
            assert_eq!(partition_name(t, p), *n, "{i}");
        }
        assert_eq!(parse_partition_name("t/x"), None);
        assert_eq!(parse_partition_name("/1"), None);
        assert_eq!(parse_partition_name("t/-1"), None);
    }

    #[test]
    fn a_partition_is_stalled_only_when_its_fetcher_sits_behind_readable_records_while_polled() {
        let after = STALL_AFTER.as_millis() as i64;
        let now = 1_000_000;
        let long_ago = now - after;
        let fetch = FetchView {
            next_offset: 100,
            at_ms: now - 1000,
            moved_ms: long_ago,
        };
        // Readable records past the fetcher, polled just now, no move for STALL_AFTER: stalled.
        assert!(stalled(150, fetch, now, long_ago, now));
        // The fetcher moved, or the source read a record, or the brokers answered again, less
        // than STALL_AFTER ago.
        let moved = FetchView {
            moved_ms: long_ago + 1,
            ..fetch
        };
        assert!(!stalled(150, moved, now, long_ago, now));
        assert!(!stalled(150, fetch, now, long_ago + 1, now));
        // Nothing readable past it: its end (the last stable offset under read_committed, so
        // open transactions do not count) is where the fetcher is, after a commit marker or an
        // aborted transaction it skipped.
        assert!(!stalled(100, fetch, now, long_ago, now));
        // Not polling (paused for a snapshot, or held back downstream).
        let poll_gap = POLLING_WITHIN.as_millis() as i64;
        assert!(!stalled(150, fetch, now - poll_gap - 1, long_ago, now));
        assert!(stalled(150, fetch, now - poll_gap, long_ago, now));
        // Before its first fetch, or with statistics too old to say.
        assert!(!stalled(
            150,
            FetchView {
                next_offset: -1001,
                ..fetch
            },
            now,
            long_ago,
            now
        ));
        let stale = FetchView {
            at_ms: now - 3 * STATISTICS_INTERVAL.as_millis() as i64 - 1,
            ..fetch
        };
        assert!(!stalled(150, stale, now, long_ago, now));
    }

    #[test]
    fn lag_is_high_minus_position_and_its_time_the_later_of_read_and_caught_up() {
        let now = 1_000_000;
        // Read to the end: nothing behind, 0 s, whatever is known of the past.
        assert_eq!(partition_lag(50, 50, None, None, now), (0, Some(0.0)));
        assert_eq!(partition_lag(50, 40, Some(1), None, now), (0, Some(0.0)));
        // Behind, with nothing read and never caught up: the time is unknown.
        assert_eq!(partition_lag(0, 30, None, None, now), (30, None));
        // The newest read record 10 s ago.
        assert_eq!(
            partition_lag(10, 30, Some(now - 10_000), None, now),
            (20, Some(10.0))
        );
        // Caught up 2.5 s ago (after the newest record read): the unread records are younger.
        assert_eq!(
            partition_lag(10, 30, Some(now - 10_000), Some(now - 2_500), now),
            (20, Some(2.5))
        );
        // A record timestamp in the future (a producer's clock): never negative.
        assert_eq!(
            partition_lag(10, 11, Some(now + 5_000), None, now),
            (1, Some(0.0))
        );
        // An empty partition (high -1 from a broker that knows nothing yet).
        assert_eq!(partition_lag(0, -1, None, None, now), (0, Some(0.0)));
    }

    #[test]
    fn an_unreachable_source_names_its_brokers_and_the_clients_reports() {
        let e = KafkaSourceError::Unreachable {
            bootstrap: "k0:9092,k1:9092".into(),
            error: "asking for the end offset of t/0: Local: Timed out".into(),
            client: Some("Connect to ipv4#10.0.0.1:9092 failed: Connection refused".into()),
        };
        assert_eq!(
            e.to_string(),
            "cannot reach the Kafka brokers k0:9092,k1:9092 of the source: asking for the end offset of t/0: Local: Timed out (client reports: Connect to ipv4#10.0.0.1:9092 failed: Connection refused)"
        );
        let ctx = SourceContext::default();
        for m in ["a", "b", "a", "c", "d"] {
            ctx.keep(m.into());
        }
        assert_eq!(ctx.reports().as_deref(), Some("a; c; d"));
        ctx.clear();
        assert_eq!(ctx.reports(), None);
    }

    #[test]
    fn a_restored_offset_wins_then_earliest_after_a_restore_then_the_spec() {
        let latest = spec(KafkaStartingPosition::Latest, None);
        assert_eq!(start_at(Some(42), true, &latest), Ok(42));
        assert_eq!(start_at(Some(42), false, &latest), Ok(42));
        // A partition the snapshot does not know: new since, read from its start.
        assert_eq!(start_at(None, true, &latest), Err(StartAt::Earliest));
        assert_eq!(start_at(None, false, &latest), Err(StartAt::Latest));
        let at = spec(KafkaStartingPosition::Timestamp, Some(1_700_000_000_000));
        assert_eq!(
            start_at(None, false, &at),
            Err(StartAt::Timestamp(1_700_000_000_000))
        );
        let earliest = spec(KafkaStartingPosition::Earliest, None);
        assert_eq!(start_at(None, false, &earliest), Err(StartAt::Earliest));
    }

    #[test]
    fn records_take_their_key_from_the_value_or_the_record_key() {
        let v = br#"{"user":"ann","amount":7,"ts":1000}"#;
        let f = fields(KafkaKeyFrom::Value, KeyType::String);
        let r = to_record(Some(b"ignored"), Some(v), Some(5), &f).unwrap();
        assert_eq!(r.key, RecordKey::string("ann"));
        assert_eq!(r.ts, 5, "the record timestamp by default");

        let mut f = fields(KafkaKeyFrom::RecordKey, KeyType::Long);
        f.value_field = Some("amount".into());
        f.timestamp_field = Some("ts".into());
        let r = to_record(Some(b" 123 "), Some(v), Some(5), &f).unwrap();
        assert_eq!(r.key, RecordKey::long(123));
        assert_eq!((r.value, r.ts), (7, 1000));

        // Count keyed by the record key: the value is not even parsed.
        let f = fields(KafkaKeyFrom::RecordKey, KeyType::Int);
        let r = to_record(Some(b"-5"), Some(b"not json"), None, &f).unwrap();
        assert_eq!(r.key, RecordKey::int(-5));
        assert_eq!(r.ts, 0);

        let f = fields(KafkaKeyFrom::RecordKey, KeyType::Int);
        assert!(
            to_record(None, Some(v), None, &f)
                .unwrap_err()
                .contains("no key")
        );
        assert!(to_record(Some(b"x"), Some(v), None, &f).is_err());
        let f = fields(KafkaKeyFrom::Value, KeyType::String);
        assert!(
            to_record(None, None, None, &f)
                .unwrap_err()
                .contains("tombstone")
        );
        assert!(to_record(None, Some(b"[1]"), None, &f).is_err());
        assert!(to_record(None, Some(br#"{"other":1}"#), None, &f).is_err());
    }
}
