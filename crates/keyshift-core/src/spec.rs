//! The job-level part of a StreamJob's spec: the dataflow (`spec.job`), where and how often its
//! state is snapshotted (`spec.state`) and the policies of its rescales and upgrades.
//!
//! These types are shared by the operator (which embeds them in the `StreamJob` custom resource,
//! so every doc comment here is a field description of `kubectl explain`) and the worker runtime
//! (which receives them in its start request); they carry no Kubernetes types.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub use crate::keygroup::KeyType;

/// Whether a parallelism that does not divide the key-group count is allowed.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum KeyGroupPolicy {
    /// Run with uneven key groups and report the skew in the KeyGroupsBalanced condition.
    #[default]
    Warn,
    /// Refuse a replicas value that does not divide the key-group count.
    Strict,
}

/// How a rescale moves the job's state (spec.rescaleStrategy).
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum RescaleStrategy {
    /// Pre-stage the new workers from the newest checkpoint while the job runs; stop with a
    /// delta checkpoint they apply.
    #[default]
    Prestage,
    /// Stop with a savepoint of the whole state; the new workers restore it.
    StopAndRestore,
}

impl RescaleStrategy {
    pub fn is_default(&self) -> bool {
        *self == RescaleStrategy::default()
    }
}

/// How changes of image or job are rolled out.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum UpgradeMode {
    /// Stop with a savepoint and restore from it.
    #[default]
    #[serde(rename = "savepoint")]
    Savepoint,
    /// Restore from the latest completed checkpoint without taking a savepoint.
    #[serde(rename = "last-state")]
    LastState,
    /// Start without state.
    #[serde(rename = "stateless")]
    Stateless,
}

/// The dataflow a StreamJob runs: records from a partitioned source are keyed, aggregated per key
/// (optionally per tumbling event-time window) and written to a sink; or, with `program`, a job
/// written with keyshift's SDK and built into the worker image runs between the source and the
/// sink.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct JobSpec {
    /// The partitioned, replayable source. Set exactly one of `generator`, `file` or `kafka`.
    pub source: SourceSpec,
    /// A program built into the worker image (a job written with keyshift's SDK, e.g. `dedup`
    /// or `silence-alert` in keyshift's own image): its keyed step keys, keeps state and emits,
    /// instead of the built-in aggregation. With a program, leave out key, aggregation and
    /// window; without one, set key and aggregation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub program: Option<ProgramSpec>,
    /// The record field to key by, and how it is hashed (the built-in aggregation; required
    /// without a program).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<KeySpec>,
    /// The per-key aggregation (the built-in aggregation; required without a program).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aggregation: Option<AggregationSpec>,
    /// Optional tumbling event-time window of the built-in aggregation; without it the
    /// aggregation runs over all time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<WindowSpec>,
    /// Where results go.
    #[serde(default)]
    pub sink: SinkSpec,
}

/// A partitioned, replayable source. Exactly one kind must be set.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SourceSpec {
    /// A deterministic generator: the same seed and positions always give the same records, so
    /// exact expected results can be computed independently. A program reads each record as the
    /// JSON object {"key": "key-<i>", "value": v, "ts": t}.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generator: Option<GeneratorSource>,
    /// A directory of JSON-lines files, one partition per file (sorted by name); the position is
    /// a byte offset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<FileSource>,
    /// Apache Kafka topics: every topic-partition is a source partition, read by exactly one
    /// subtask; the position is the partition's next offset, kept in the job's snapshots (never
    /// in a consumer group).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kafka: Option<KafkaSource>,
}

/// A Kafka source: the topics a job reads, where a job without state starts, and how records
/// become keyed, timestamped records.
///
/// Partitions are assigned to subtasks deterministically (by topic and partition number, as
/// Flink's Kafka source does), read with manual assignment and seeked to the offsets of the
/// snapshot a job restores, so a rescale or recovery resumes each partition exactly where the
/// snapshot cut it. Partitions added to a topic while the job runs are found by a periodic
/// metadata refresh (metadataRefreshInterval) and read from their earliest offset, so none of
/// their records is skipped.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KafkaSource {
    /// Comma-separated `host:port` list of brokers to bootstrap from (librdkafka's
    /// `bootstrap.servers`), e.g. `kafka-0.kafka:9092,kafka-1.kafka:9092`.
    pub bootstrap_servers: String,
    /// The topics to read (at least one, at most 64). Each must exist when the job starts.
    pub topics: Vec<String>,
    /// Where the key comes from: `value` (default: the JSON field spec.job.key.field of the
    /// record's value) or `recordKey` (the Kafka record key, as UTF-8 text: taken as is for
    /// key type `string`, parsed as a decimal number for `long` and `int`). Either way it is
    /// hashed by spec.job.key.type exactly as the other sources' keys.
    #[serde(default)]
    pub key_from: KafkaKeyFrom,
    /// The JSON field of the record's value holding the event time (milliseconds since the
    /// epoch). Unset: the Kafka record's timestamp (CreateTime or LogAppendTime, as the topic
    /// keeps it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp_field: Option<String>,
    /// Where a job without state (its first start, or an upgrade with upgradeMode `stateless`)
    /// starts reading each partition: `earliest` (default), `latest` (only records produced
    /// after the start) or `timestamp` (the first record at or after startingTimestamp). A job
    /// restoring a snapshot always resumes from the snapshot's offsets.
    #[serde(default)]
    pub starting_position: KafkaStartingPosition,
    /// Milliseconds since the epoch; required with startingPosition `timestamp`. A partition
    /// with no record at or after it starts at its end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub starting_timestamp: Option<i64>,
    /// Consumer group the job commits its offsets to after each completed checkpoint, for lag
    /// tools (`kafka-consumer-groups.sh --describe`). The job never reads offsets from it:
    /// restores use the snapshot. Default `keyshift.<namespace>.<job name>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_id: Option<String>,
    /// How long a partition may go without a record before it stops holding the watermark
    /// back, as a duration such as `30s` (default) or `5m`. An idle partition's next record
    /// makes it count again. Only matters with a window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout: Option<String>,
    /// How often the source asks the brokers for the topics' partitions, to pick up partitions
    /// added while the job runs, as a duration. Default `5m`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata_refresh_interval: Option<String>,
    /// Further librdkafka consumer properties (e.g. `fetch.max.bytes`, `client.rack`,
    /// `security.protocol`, `ssl.endpoint.identification.algorithm`), applied after the
    /// operator's own. Refused: the ones keyshift sets itself (`bootstrap.servers`, `group.id`,
    /// `enable.auto.commit`, `enable.auto.offset.store`, `enable.partition.eof`) and secrets
    /// (`sasl.password`, `ssl.key.password`, `ssl.key.pem`, `sasl.oauthbearer.client.secret`):
    /// put those in the credentials Secret. Default isolation: `isolation.level:
    /// read_committed`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub properties: BTreeMap<String, String>,
    /// TLS and SASL credentials from a Secret in the job's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials: Option<KafkaCredentials>,
}

/// Where a Kafka record's key comes from.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum KafkaKeyFrom {
    /// The JSON field spec.job.key.field of the record's value.
    #[default]
    Value,
    /// The Kafka record key (UTF-8 text).
    RecordKey,
}

/// Where a Kafka source without state starts reading.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum KafkaStartingPosition {
    /// The earliest offset each partition still holds.
    #[default]
    Earliest,
    /// The end of each partition at the start: only newer records are read.
    Latest,
    /// The first offset whose timestamp is at or after startingTimestamp.
    Timestamp,
}

/// Kafka TLS and SASL credentials, read from a Secret in the job's namespace. The worker pods
/// get the Secret's keys as environment variables (never the whole Secret). With `sasl` and
/// `tls` the client speaks `SASL_SSL`, with `sasl` alone `SASL_PLAINTEXT`, with `tls` alone
/// `SSL` (properties may override `security.protocol`).
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KafkaCredentials {
    /// Name of the Secret (in the job's namespace) holding the keys below.
    pub secret_name: String,
    /// SASL authentication (username and password from the Secret).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sasl: Option<KafkaSasl>,
    /// TLS: a CA bundle to trust and optionally a client certificate and key, as PEM, from the
    /// Secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<KafkaTls>,
}

/// SASL credentials.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KafkaSasl {
    /// `PLAIN`, `SCRAM-SHA-256` (default) or `SCRAM-SHA-512`.
    #[serde(default)]
    pub mechanism: KafkaSaslMechanism,
    /// Key of the Secret holding the username. Default `username`.
    #[serde(default = "default_username_key")]
    pub username_key: String,
    /// Key of the Secret holding the password. Default `password`.
    #[serde(default = "default_password_key")]
    pub password_key: String,
}

fn default_username_key() -> String {
    "username".into()
}

fn default_password_key() -> String {
    "password".into()
}

/// A SASL mechanism librdkafka supports without Kerberos.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum KafkaSaslMechanism {
    /// Username and password in clear (use it with TLS).
    #[serde(rename = "PLAIN")]
    Plain,
    /// Salted challenge-response with SHA-256.
    #[default]
    #[serde(rename = "SCRAM-SHA-256")]
    ScramSha256,
    /// Salted challenge-response with SHA-512.
    #[serde(rename = "SCRAM-SHA-512")]
    ScramSha512,
}

/// TLS material (PEM) from the credentials Secret.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KafkaTls {
    /// Key of the Secret holding the CA certificates to trust (PEM). Unset: the system's
    /// trust store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_key: Option<String>,
    /// Key of the Secret holding the client certificate (PEM), for mutual TLS; set keyKey too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_key: Option<String>,
    /// Key of the Secret holding the client certificate's private key (PEM), for mutual TLS;
    /// set certKey too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_key: Option<String>,
}

/// A deterministic record generator. Each record has the fields `key`, `value` (an integer) and
/// `ts` (event time in milliseconds, derived from the sequence number); a program reads each as
/// the JSON object `{"key": "key-<i>", "value": v, "ts": t}`.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GeneratorSource {
    /// Number of source partitions (each is read by exactly one subtask). Default 4.
    #[serde(default = "default_partitions")]
    pub partitions: i32,
    /// Number of distinct keys. Default 1000.
    #[serde(default = "default_keys")]
    pub keys: i64,
    /// Seed of the generator. Default 0.
    #[serde(default)]
    pub seed: i64,
    /// How keys are drawn: `uniform` (default) or `zipf` (a few hot keys; see zipfExponent).
    #[serde(default)]
    pub distribution: KeyDistribution,
    /// Exponent of the Zipf distribution (used when distribution is `zipf`); larger is more
    /// skewed. Default 1.0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zipf_exponent: Option<f64>,
    /// Records per second per partition; unset means as fast as possible.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub records_per_second: Option<i64>,
    /// Records per partition after which the partition ends; unset means unbounded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub records_per_partition: Option<i64>,
}

fn default_partitions() -> i32 {
    4
}

fn default_keys() -> i64 {
    1000
}

/// How the generator draws keys.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum KeyDistribution {
    /// Every key equally likely.
    #[default]
    Uniform,
    /// Key of rank k drawn with probability proportional to 1/k^exponent.
    Zipf,
}

/// A directory of JSON-lines files.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FileSource {
    /// Where the partition files are: a local directory every worker can read (a path or
    /// `file:///dir`, e.g. a volume), or an object-store URL (`s3://bucket/dir`,
    /// `gs://bucket/dir`, `az://container/dir`) whose objects directly under the prefix are the
    /// partitions, read with the job's storage credentials (spec.state.credentialsSecret). Files
    /// may only grow (an object grows by being rewritten longer); the lines added are read on.
    pub path: String,
    /// Record field holding the event time (milliseconds since the epoch); needed only with a
    /// window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp_field: Option<String>,
}

/// A program built into the worker image, and how its event time is kept.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProgramSpec {
    /// The program's name in the image (keyshift's own image has `count`, `dedup`,
    /// `order-payments`, `page-views`, `sessions` and `silence-alert`; a job's own image, the
    /// names its binary gives). Lowercase letters, digits and `-`, at most 63 characters. A worker
    /// whose image has no program of that name refuses the start, naming the programs it has.
    pub name: String,
    /// How far event time may go backwards: each source partition's watermark trails the
    /// largest event time it has read by this much (a duration such as 0s, 500ms or 2s;
    /// default 0s). Records older than the watermark are late, and event-time timers fire
    /// when the watermark passes them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_out_of_orderness: Option<String>,
    /// Combine records of one key and window in each source batch before the shuffle, when
    /// the program's keyed step can (a window aggregate of an associative, commutative
    /// function); default `true`, and ignored by steps that cannot. The results are the same
    /// either way. Set `false` only to compare.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub combine: Option<bool>,
}

impl ProgramSpec {
    /// Whether the sources combine before the shuffle where the step can (`combine`, default
    /// true).
    pub fn combines(&self) -> bool {
        self.combine.unwrap_or(true)
    }
}

/// What runs between a job's source and its sink ([`JobSpec::logic`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum JobLogic<'a> {
    /// The built-in aggregation.
    Builtin {
        key: &'a KeySpec,
        aggregation: &'a AggregationSpec,
        window: Option<&'a WindowSpec>,
    },
    /// A program built into the worker image.
    Program(&'a ProgramSpec),
}

impl JobSpec {
    /// What the spec runs; `None` if it sets a program together with any of key, aggregation
    /// and window, or sets neither a program nor both key and aggregation (the rules refuse it,
    /// [`crate::rules::MSG_JOB_LOGIC`]).
    pub fn logic(&self) -> Option<JobLogic<'_>> {
        match (&self.program, &self.key, &self.aggregation) {
            (Some(p), None, None) if self.window.is_none() => Some(JobLogic::Program(p)),
            (None, Some(key), Some(aggregation)) => Some(JobLogic::Builtin {
                key,
                aggregation,
                window: self.window.as_ref(),
            }),
            _ => None,
        }
    }
}

/// The key a record is grouped by.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KeySpec {
    /// Name of the record field holding the key.
    pub field: String,
    /// How the key is hashed into a key group, exactly as Apache Flink hashes `String`, `Long`
    /// or `Integer` keys: `string` (default), `long` or `int`.
    #[serde(default, rename = "type")]
    pub key_type: KeyType,
}

/// The per-key aggregation.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AggregationSpec {
    /// `count`, `sum`, `min` or `max`.
    pub function: AggregateFunction,
    /// The numeric record field that sum, min and max read. Not used by count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// Combine records of the same key (and window) in each source batch before the shuffle
    /// (default `true`): a hot key then costs its subtask one partial result per batch instead
    /// of one update per record. The results are the same either way (count, sum, min and max
    /// are associative and commutative, and a batch never spans a checkpoint barrier); the
    /// sources stop combining by themselves while batches have few repeated keys. Set `false`
    /// only to compare.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub combine: Option<bool>,
}

impl AggregationSpec {
    /// Whether the sources combine records before the shuffle (`combine`, default true).
    pub fn combines(&self) -> bool {
        self.combine.unwrap_or(true)
    }
}

/// An aggregate function.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum AggregateFunction {
    /// Number of records per key.
    Count,
    /// Sum of the field per key.
    Sum,
    /// Smallest value of the field per key.
    Min,
    /// Largest value of the field per key.
    Max,
}

/// A tumbling event-time window.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WindowSpec {
    /// Window length as a duration, e.g. `10s`, `1m`, `1h30m`.
    pub size: String,
    /// How late (in event time) a record may arrive before the watermark passes it, e.g. `2s`.
    /// Later records are counted in metrics as late, not silently dropped. Default `0s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_out_of_orderness: Option<String>,
}

/// Where results go.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SinkSpec {
    /// `log` (default: results printed to the worker's log), `objectStore` (files under `url`,
    /// visible only once the checkpoint covering them completes: exactly once) or `kafka`
    /// (records of the topic in `kafka`).
    #[serde(default, rename = "type")]
    pub sink_type: SinkType,
    /// Object store URL results are written under (for `objectStore`). One job's own: a URL
    /// that is, contains or lies inside an older job's is refused (Stalled, reason SinkInUse).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// The Kafka topic results are written to (for `kafka`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kafka: Option<KafkaSink>,
}

/// A Kafka sink: results as records of one topic, keyed by the result's key, with JSON values
/// in the object-store sink's shape.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KafkaSink {
    /// Comma-separated `host:port` list of brokers to bootstrap from (librdkafka's
    /// `bootstrap.servers`).
    pub bootstrap_servers: String,
    /// The topic to write to. It must exist; records go to partitions by murmur2 of the record
    /// key (librdkafka's `murmur2_random`, set unless properties name another partitioner: the
    /// Java client's default), so one key's results stay in order in one partition.
    pub topic: String,
    /// `exactlyOnce` (default): results are staged with each checkpoint and, once it completes,
    /// written in one Kafka transaction per checkpoint, so `read_committed` consumers see each
    /// exactly once, only after the checkpoint that covers them completes. `atLeastOnce`:
    /// written at once by the workers without transactions (cheaper, lower latency); after a
    /// failure, results since the last checkpoint are written again.
    #[serde(default)]
    pub delivery_guarantee: KafkaDeliveryGuarantee,
    /// Prefix of the job's transactional id (exactlyOnce): the job writes as `<prefix>.sink`,
    /// which is also the consumer group recording the newest checkpoint written. Default
    /// `keyshift.<namespace>.<job name>`. Two jobs must never share it: a job whose id an older
    /// job's sink uses on the same brokers is refused (Stalled, reason SinkInUse).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transactional_id_prefix: Option<String>,
    /// Further librdkafka producer properties (e.g. `compression.type`, `linger.ms`,
    /// `security.protocol`), applied after the operator's own. Refused: the ones keyshift sets
    /// itself (`bootstrap.servers`, `transactional.id`, `enable.idempotence`) and secrets
    /// (`sasl.password`, `ssl.key.password`, `ssl.key.pem`, `sasl.oauthbearer.client.secret`):
    /// put those in the credentials Secret.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub properties: BTreeMap<String, String>,
    /// TLS and SASL credentials from a Secret in the job's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials: Option<KafkaCredentials>,
}

impl KafkaSink {
    /// The transactional id (and bookkeeping group) this sink writes with as job `job` of
    /// `namespace` when it is exactly once: [`transactional_id`].
    pub fn transactional_id(&self, namespace: &str, job: &str) -> String {
        transactional_id(namespace, job, self.transactional_id_prefix.as_deref())
    }

    /// The brokers it bootstraps from, trimmed, without empty entries and duplicates, sorted:
    /// two sinks that share one of them write to the same cluster.
    pub fn brokers(&self) -> std::collections::BTreeSet<&str> {
        self.bootstrap_servers
            .split(',')
            .map(str::trim)
            .filter(|b| !b.is_empty())
            .collect()
    }
}

/// The default transactional id prefix of a job's sink, `keyshift.<namespace>.<job>`.
pub fn default_transactional_id_prefix(namespace: &str, job: &str) -> String {
    format!("keyshift.{namespace}.{job}")
}

/// The transactional id (and bookkeeping group) of a job's exactly-once Kafka sink: the sink's
/// `transactionalIdPrefix` (default [`default_transactional_id_prefix`]) with `.sink` appended.
/// One per job, whatever its parallelism. A namespace holds no `.`, so two jobs' default ids
/// never collide; a prefix set by hand can, which the operator refuses
/// (`TransactionalIdInUse`).
pub fn transactional_id(namespace: &str, job: &str, prefix: Option<&str>) -> String {
    match prefix {
        Some(p) if !p.is_empty() => format!("{p}.sink"),
        _ => format!("{}.sink", default_transactional_id_prefix(namespace, job)),
    }
}

/// Properties neither Kafka client may take from spec.job.*.kafka.properties: secrets.
pub const KAFKA_SECRET_PROPERTIES: &[&str] = &[
    "sasl.password",
    "ssl.key.password",
    "ssl.key.pem",
    "sasl.oauthbearer.client.secret",
];
/// Consumer properties the Kafka source sets itself.
pub const KAFKA_SOURCE_RESERVED: &[&str] = &[
    "bootstrap.servers",
    "group.id",
    "enable.auto.commit",
    "enable.auto.offset.store",
    "enable.partition.eof",
];
/// Producer properties the Kafka sink sets itself.
pub const KAFKA_SINK_RESERVED: &[&str] = &[
    "bootstrap.servers",
    "transactional.id",
    "enable.idempotence",
];
/// What a Kafka sink guarantees.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum KafkaDeliveryGuarantee {
    /// Transactions committed with checkpoints: every result exactly once.
    #[default]
    ExactlyOnce,
    /// No transactions: every result at least once.
    AtLeastOnce,
}

/// A kind of sink.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum SinkType {
    /// Print results to the log.
    #[default]
    Log,
    /// Write results to an object store, committed with checkpoints.
    ObjectStore,
    /// Write results to a Kafka topic (see `kafka`).
    Kafka,
}

/// Where and how often state is snapshotted.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StateSpec {
    /// Object store URL under which checkpoints and savepoints are written, as
    /// `<storage>/<namespace>/<job>/...`: `file:///path`, `s3://bucket/prefix`, `gs://bucket/prefix`
    /// or `az://container/prefix` (also `abfs(s)://`, `memory://` for tests, `http(s)://`).
    /// Defaults to the operator's `--default-storage`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<String>,
    /// Time between periodic checkpoints, as a duration such as `30s` or `5m`. Default `30s`.
    #[serde(default = "default_checkpoint_interval")]
    pub checkpoint_interval: String,
    /// How many completed checkpoints to keep (older ones are deleted after a newer one
    /// commits). Savepoints are never deleted automatically. Default 3.
    #[serde(default = "default_retained_checkpoints")]
    pub retained_checkpoints: i32,
    /// How long a periodic checkpoint may take, trigger to commit, before it is aborted on
    /// every worker (the job keeps running; the previous checkpoint stays usable). A duration
    /// between 1s and 24h. Default `2m`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_timeout: Option<String>,
    /// How long a savepoint (of a rescale, upgrade, suspend or spec.savepointTriggerNonce) may
    /// take before it is abandoned (the job keeps running at its old parallelism). A duration
    /// between 1s and 24h. Default `5m`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub savepoint_timeout: Option<String>,
    /// Name of a Secret in the job's namespace whose keys are passed to the workers as
    /// environment variables: for `s3://` `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
    /// `AWS_REGION` (and `AWS_ENDPOINT` for an S3-compatible server); for `gs://`
    /// `GOOGLE_SERVICE_ACCOUNT_KEY`, the service account key's JSON itself (the
    /// `GOOGLE_SERVICE_ACCOUNT` variable is a key file's path, not its content); for `az://`
    /// `AZURE_STORAGE_ACCOUNT_NAME` and `AZURE_STORAGE_ACCOUNT_KEY` (or `AZURE_STORAGE_SAS_KEY`).
    /// docs/storage.md lists what each store reads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret: Option<String>,
    /// How long starting a run may take, from the start requests until every worker has
    /// restored its key groups and connected to its peers: a duration between 30s and 24h. Raise
    /// it for state that takes longer to read from its storage. Default `3m`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_timeout: Option<String>,
    /// With spec.rescaleStrategy `Prestage`: how long the new workers may take to be created,
    /// scheduled and load their key groups beside the running job before the rescale falls back
    /// to stop-and-restore (nothing is lost: the job has kept running). A duration between 1s
    /// and 24h. Default `2m`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prestage_timeout: Option<String>,
    /// Incremental checkpoints: a checkpoint writes only the keys changed since the previous one
    /// and refers to the earlier files for the rest (on by default; savepoints are always
    /// written in full). Read when a run starts: a change applies from the next start (a
    /// rescale, a restart, a resume).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incremental_checkpoints: Option<IncrementalCheckpoints>,
}

/// The bounds of `spec.state.incrementalCheckpoints.maxDeltas`.
pub const MAX_DELTAS_BOUNDS: std::ops::RangeInclusive<u32> = 1..=64;
/// The bounds of `spec.state.incrementalCheckpoints.maxDeltaPercent`.
pub const MAX_DELTA_PERCENT_BOUNDS: std::ops::RangeInclusive<u32> = 10..=400;

/// How checkpoints build on earlier ones (`spec.state.incrementalCheckpoints`).
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IncrementalCheckpoints {
    /// Write only what changed since the previous checkpoint. `false` writes every checkpoint in
    /// full (more bytes per checkpoint; a restore reads no deltas). Default `true`.
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Deltas a key group may collect before its next change writes it whole again: 1 to 64.
    /// Fewer make restores read less beyond the state; more make checkpoints write less.
    /// Default 32 (staggered by key group: a group is written whole after 25 to 32 deltas).
    /// Above 2016 key groups chains are kept shorter, whatever this says, so that a checkpoint's
    /// manifest stays within its bound: at most 31 deltas at 4096 groups, 3 at 32768.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_deltas: Option<u32>,
    /// Size of a key group's deltas, as a percent of its last full block, past which its next
    /// change writes it whole again: 10 to 400. Default 50.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_delta_percent: Option<u32>,
}

fn default_true() -> bool {
    true
}

impl Default for StateSpec {
    fn default() -> Self {
        StateSpec {
            storage: None,
            checkpoint_interval: default_checkpoint_interval(),
            retained_checkpoints: default_retained_checkpoints(),
            checkpoint_timeout: None,
            savepoint_timeout: None,
            credentials_secret: None,
            restore_timeout: None,
            prestage_timeout: None,
            incremental_checkpoints: None,
        }
    }
}

fn default_checkpoint_interval() -> String {
    "30s".to_owned()
}

fn default_retained_checkpoints() -> i32 {
    3
}
