//! The spec's rules, the part the worker runtime needs too: the message of every rule (the API
//! server's CEL rules on the CRD and the Rust checks say the same words, each naming the field and
//! the fix), and the rules of `spec.job` in Rust ([`validate_job`]), which a worker checks again
//! on its start request. The CEL attachment and the rules of the rest of the spec (pods, storage,
//! timeouts against the status) are the operator's (`keyshift::validation`).

use crate::duration::parse_duration;
use crate::spec::{
    AggregateFunction, JobLogic, JobSpec, KAFKA_SECRET_PROPERTIES, KAFKA_SINK_RESERVED,
    KAFKA_SOURCE_RESERVED,
};
use std::fmt;
use std::time::Duration;

pub const MSG_REPLICAS_MIN: &str = "spec.replicas must be at least 1: set it to the number of parallel subtasks (to stop the job, set spec.suspend: true instead)";
pub const MSG_MAXP_RANGE: &str = "spec.maxParallelism must be between 1 and 32768: choose a key-group count in that range, ideally a power of two 4-8x the largest parallelism you foresee";
pub const MSG_REPLICAS_LE_MAXP: &str = "spec.replicas must not exceed spec.maxParallelism (the key-group ceiling): lower replicas, or raise maxParallelism before the job's first snapshot";
pub const MSG_REPLICAS_LE_PINNED: &str = "spec.replicas must not exceed status.maxParallelism, the key-group ceiling pinned at the job's first snapshot: lower replicas, or raise the ceiling in the same change by setting spec.maxParallelism to the new key-group count (keyshift then takes a savepoint, rewrites it to the new count, verifies it and restores it; the original savepoint is kept)";
pub const MSG_STRICT_DIVISOR: &str = "spec.replicas must divide the key-group count (maxParallelism) evenly because spec.keyGroupPolicy is Strict: choose a divisor (`keyshift plan` lists the nearest ones) or set keyGroupPolicy: Warn to accept the skew";
pub const MSG_STORAGE_URL: &str = "spec.state.storage must be an object store URL: file:///path, s3://bucket/prefix, gs://bucket/prefix or az://container/prefix (also abfs://, abfss://, memory://, http(s)://)";
pub const MSG_RESTORE_URL: &str = "spec.restoreFrom must be the object store URL of a snapshot directory, e.g. s3://bucket/prefix/ns/job/savepoints/sp-7 or file:///path/savepoints/sp-7, or the name of a StreamJobSnapshot in the job's namespace";
pub const MSG_RETENTION_KEEP: &str = "spec.snapshotRetention.keep must be at least 1: the newest snapshot is always kept (remove snapshotRetention to keep every snapshot)";
pub const MSG_RETENTION_MAX_AGE: &str =
    "spec.snapshotRetention.maxAge must be a duration such as 168h or 30m (units: ms, s, m, h)";
pub const MSG_SNAPSHOT_JOB_NAME: &str = "spec.jobName must name a StreamJob of the snapshot's namespace (a Kubernetes object name: lowercase letters, digits, '-' and '.')";
pub const MSG_SNAPSHOT_PATH: &str = "spec.path must be the object store URL of a committed snapshot directory, e.g. s3://bucket/prefix/ns/job/savepoints/sp-7";
pub const MSG_SNAPSHOT_FIXED: &str = "spec.jobName and spec.path of a StreamJobSnapshot are fixed once it is created: create another StreamJobSnapshot instead";
/// A Kubernetes object name (DNS subdomain): how spec.restoreFrom names a StreamJobSnapshot.
pub const OBJECT_NAME_RE: &str =
    "^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";
pub const MSG_CHECKPOINT_TIMEOUT: &str = "spec.state.checkpointTimeout must be a duration between 1s and 24h, such as 2m (units: ms, s, m, h)";
pub const MSG_PRESTAGE_TIMEOUT: &str = "spec.state.prestageTimeout must be a duration between 1s and 24h, such as 2m (units: ms, s, m, h)";
pub const MSG_SAVEPOINT_TIMEOUT: &str = "spec.state.savepointTimeout must be a duration between 1s and 24h, such as 5m (units: ms, s, m, h)";
/// The bounds of spec.state.checkpointTimeout and savepointTimeout.
pub const TIMEOUT_BOUNDS: std::ops::RangeInclusive<Duration> =
    Duration::from_secs(1)..=Duration::from_secs(24 * 3600);
pub const MSG_CHECKPOINT_INTERVAL: &str = "spec.state.checkpointInterval must be a duration such as 30s, 5m or 1h30m (units: ms, s, m, h)";
pub const MSG_WINDOW_SIZE: &str =
    "spec.job.window.size must be a duration such as 10s, 1m or 1h (units: ms, s, m, h)";
pub const MSG_OUT_OF_ORDERNESS: &str = "spec.job.window.maxOutOfOrderness must be a duration such as 0s, 500ms or 2s (units: ms, s, m, h)";
pub const MSG_RESTORE_TIMEOUT: &str = "spec.state.restoreTimeout must be a duration between 30s and 24h, such as 10m (units: ms, s, m, h)";
/// The bounds of spec.state.restoreTimeout.
pub const RESTORE_TIMEOUT_BOUNDS: std::ops::RangeInclusive<Duration> =
    Duration::from_secs(30)..=Duration::from_secs(24 * 3600);
pub const MSG_RETAINED: &str = "spec.state.retainedCheckpoints must be at least 1: the newest completed checkpoint is always kept";
pub const MSG_INCREMENTAL_MAX_DELTAS: &str = "spec.state.incrementalCheckpoints.maxDeltas must be between 1 and 64 (default 32): the deltas a key group collects before it is written whole again";
pub const MSG_INCREMENTAL_DELTA_PERCENT: &str = "spec.state.incrementalCheckpoints.maxDeltaPercent must be between 10 and 400 (default 50): the size of a key group's deltas, in percent of its full block, past which it is written whole again";
pub const MSG_SOURCE_ONE_OF: &str =
    "spec.job.source must set exactly one of generator, file or kafka";
pub const MSG_KAFKA_SOURCE_BOOTSTRAP: &str = "spec.job.source.kafka.bootstrapServers must be a comma-separated list of host:port, such as kafka-0.kafka:9092,kafka-1.kafka:9092";
pub const MSG_KAFKA_SOURCE_TOPICS: &str = "spec.job.source.kafka.topics must list 1 to 64 topic names, each of 1-249 letters, digits, '.', '_' or '-'";
pub const MSG_KAFKA_STARTING_TIMESTAMP: &str = "spec.job.source.kafka.startingTimestamp (milliseconds since the epoch, at least 0) is required when startingPosition is timestamp";
pub const MSG_KAFKA_IDLE_TIMEOUT: &str =
    "spec.job.source.kafka.idleTimeout must be a duration such as 30s or 5m (units: ms, s, m, h)";
pub const MSG_KAFKA_REFRESH: &str = "spec.job.source.kafka.metadataRefreshInterval must be a duration of at least 1s, such as 5m (units: ms, s, m, h)";
pub const MSG_KAFKA_SOURCE_PROPERTIES: &str = "spec.job.source.kafka.properties must not set bootstrap.servers, group.id, enable.auto.commit, enable.auto.offset.store, enable.partition.eof (keyshift sets them: use bootstrapServers and groupId) nor secrets (sasl.password, ssl.key.password, ssl.key.pem, sasl.oauthbearer.client.secret: put them in the credentials Secret)";
pub const MSG_KAFKA_SOURCE_CREDENTIALS: &str = "spec.job.source.kafka.credentials must name a Secret (secretName) and set sasl, tls or both; tls.certKey and tls.keyKey go together (mutual TLS needs both)";
pub const MSG_KAFKA_SINK_REQUIRED: &str = "spec.job.sink.kafka is required when spec.job.sink.type is kafka (and only then): give bootstrapServers and topic, or choose another sink type";
pub const MSG_KAFKA_SINK_BOOTSTRAP: &str = "spec.job.sink.kafka.bootstrapServers must be a comma-separated list of host:port, such as kafka-0.kafka:9092,kafka-1.kafka:9092";
pub const MSG_KAFKA_SINK_TOPIC: &str =
    "spec.job.sink.kafka.topic must be a topic name of 1-249 letters, digits, '.', '_' or '-'";
pub const MSG_KAFKA_SINK_PROPERTIES: &str = "spec.job.sink.kafka.properties must not set bootstrap.servers, transactional.id, enable.idempotence (keyshift sets them: use bootstrapServers, transactionalIdPrefix and deliveryGuarantee) nor secrets (sasl.password, ssl.key.password, ssl.key.pem, sasl.oauthbearer.client.secret: put them in the credentials Secret)";
pub const MSG_KAFKA_SINK_CREDENTIALS: &str = "spec.job.sink.kafka.credentials must name a Secret (secretName) and set sasl, tls or both; tls.certKey and tls.keyKey go together (mutual TLS needs both)";
/// The CEL rules' pattern of a bootstrap list (the Rust check is [`valid_bootstrap`]).
pub const KAFKA_BOOTSTRAP_RE: &str = "^[^, ]+:[0-9]{1,5}(,[^, ]+:[0-9]{1,5})*$";
/// The CEL rules' pattern of a topic name (the Rust check is [`valid_topic`]).
pub const KAFKA_TOPIC_RE: &str = "^[a-zA-Z0-9._-]{1,249}$";
/// At most this many topics per Kafka source.
pub const MAX_KAFKA_TOPICS: usize = 64;
pub const MSG_JOB_LOGIC: &str = "spec.job must set either program (a job built into the worker image) or key and aggregation (the built-in aggregation): with a program, leave out key, aggregation and window";
pub const MSG_PROGRAM_OUT_OF_ORDERNESS: &str = "spec.job.program.maxOutOfOrderness must be a duration such as 0s, 500ms or 2s (units: ms, s, m, h)";
pub const MSG_PROGRAM_NAME: &str = "spec.job.program.name must be a program's name: lowercase letters, digits and '-', starting and ending with a letter or digit, at most 63 characters";
/// The pattern of a program's name (as a DNS label), for the CEL rule and [`valid_program_name`].
pub const PROGRAM_NAME_RE: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$";
pub const MSG_AGG_FIELD: &str = "spec.job.aggregation.field is required for sum, min and max: name the numeric record field to aggregate";
pub const MSG_PARTITIONS: &str = "spec.job.source.generator.partitions must be between 1 and 65536";
pub const MSG_KEYS: &str = "spec.job.source.generator.keys must be between 1 and 1000000000000";
/// The most generator partitions a job may have (each is read by one subtask, at most 32768).
pub const MAX_GENERATOR_PARTITIONS: i32 = 65_536;
/// The most distinct generator keys (10^12): beyond any state a worker can hold.
pub const MAX_GENERATOR_KEYS: i64 = 1_000_000_000_000;
pub const MSG_KEY_FIELD: &str =
    "spec.job.key.field must name the record field to key by; it is empty";
pub const MSG_SINK_URL: &str = "spec.job.sink.url is required when spec.job.sink.type is objectStore: give an object store URL such as s3://bucket/results";
pub const MSG_TMP_VOLUME: &str = "spec.podTemplate.volumes must not contain a volume named tmp: that name is reserved for the worker's scratch emptyDir at /tmp; give the volume another name";
pub const MSG_TMP_MOUNT: &str = "spec.podTemplate.volumeMounts must not mount at /tmp: the worker's scratch emptyDir is mounted there; mount the volume at another path, such as /data";
pub const MSG_MOUNT_VOLUME: &str = "spec.podTemplate.volumeMounts must each name a volume declared in spec.podTemplate.volumes: add the volume there or correct the mount's name";
pub const MSG_RESERVED_ENV: &str = "spec.podTemplate.env must not set POD_IP, KEYSHIFT_TOKEN or KEYSHIFT_SUBTASK: the operator sets them on every worker; remove them or use another name";

/// Validation failures, each a message naming the field and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ValidationErrors(pub Vec<String>);

impl fmt::Display for ValidationErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.join("\n"))
    }
}

impl ValidationErrors {
    pub fn contains(&self, message: &str) -> bool {
        self.0.iter().any(|m| m == message)
    }
}

/// The CEL rules of `spec.job` alone, with the same messages as [`validate`] (which applies
/// them to a manifest): for a dataflow that reaches a worker without passing the API server or
/// [`validate`], such as a start request on the control API.
pub fn validate_job(job: &JobSpec) -> Result<(), ValidationErrors> {
    let mut errors: Vec<String> = Vec::new();
    job_rules(job, &mut |m: &str| {
        if !errors.iter().any(|e| e == m) {
            errors.push(m.to_owned());
        }
    });
    if errors.is_empty() {
        Ok(())
    } else {
        Err(ValidationErrors(errors))
    }
}

/// The rules of `spec.job` ([`validate`], [`validate_job`]).
pub fn job_rules(job: &JobSpec, fail: &mut impl FnMut(&str)) {
    if let Some(window) = &job.window {
        if window.size.len() > 64 || parse_duration(&window.size).is_none() {
            fail(MSG_WINDOW_SIZE);
        }
        if let Some(ooo) = &window.max_out_of_orderness
            && (ooo.len() > 64 || parse_duration(ooo).is_none())
        {
            fail(MSG_OUT_OF_ORDERNESS);
        }
    }
    let source = &job.source;
    let kinds = [
        source.generator.is_some(),
        source.file.is_some(),
        source.kafka.is_some(),
    ];
    if kinds.iter().filter(|k| **k).count() != 1 {
        fail(MSG_SOURCE_ONE_OF);
    }
    if let Some(k) = &source.kafka {
        kafka_source_rules(k, fail);
    }
    if (job.sink.sink_type == crate::spec::SinkType::Kafka) != job.sink.kafka.is_some() {
        fail(MSG_KAFKA_SINK_REQUIRED);
    }
    if let Some(k) = &job.sink.kafka {
        kafka_sink_rules(k, fail);
    }
    if let Some(g) = &source.generator {
        if !(1..=MAX_GENERATOR_PARTITIONS).contains(&g.partitions) {
            fail(MSG_PARTITIONS);
        }
        if !(1..=MAX_GENERATOR_KEYS).contains(&g.keys) {
            fail(MSG_KEYS);
        }
    }
    match job.logic() {
        None => fail(MSG_JOB_LOGIC),
        Some(JobLogic::Program(p)) => {
            if !valid_program_name(&p.name) {
                fail(MSG_PROGRAM_NAME);
            }
            if let Some(ooo) = &p.max_out_of_orderness
                && (ooo.len() > 64 || parse_duration(ooo).is_none())
            {
                fail(MSG_PROGRAM_OUT_OF_ORDERNESS);
            }
        }
        Some(JobLogic::Builtin { .. }) => {}
    }
    if job.key.as_ref().is_some_and(|k| k.field.is_empty()) {
        fail(MSG_KEY_FIELD);
    }
    if job
        .aggregation
        .as_ref()
        .is_some_and(|a| a.function != AggregateFunction::Count && a.field.is_none())
    {
        fail(MSG_AGG_FIELD);
    }
    if job.sink.sink_type == crate::spec::SinkType::ObjectStore && job.sink.url.is_none() {
        fail(MSG_SINK_URL);
    }
}

/// A legal program name ([`PROGRAM_NAME_RE`], at most 63 characters).
pub fn valid_program_name(name: &str) -> bool {
    let b = name.as_bytes();
    (1..=63).contains(&b.len())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// The CEL rules' bootstrap list: `host:port[,host:port...]`, no spaces.
pub fn valid_bootstrap(text: &str) -> bool {
    text.len() <= 4096
        && !text.is_empty()
        && text.split(',').all(|server| {
            server.rsplit_once(':').is_some_and(|(host, port)| {
                !host.is_empty()
                    && !host.contains(' ')
                    && (1..=5).contains(&port.len())
                    && port.bytes().all(|b| b.is_ascii_digit())
            })
        })
}

/// A legal Kafka topic name.
pub fn valid_topic(name: &str) -> bool {
    (1..=249).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

fn valid_credentials(c: &crate::spec::KafkaCredentials) -> bool {
    !c.secret_name.is_empty()
        && c.secret_name.len() <= 253
        && (c.sasl.is_some() || c.tls.is_some())
        && c.tls
            .as_ref()
            .is_none_or(|t| t.cert_key.is_some() == t.key_key.is_some())
}

fn reserved_property(
    properties: &std::collections::BTreeMap<String, String>,
    reserved: &[&str],
) -> bool {
    properties.len() > 256
        || properties.keys().any(|k| {
            reserved.contains(&k.as_str()) || KAFKA_SECRET_PROPERTIES.contains(&k.as_str())
        })
}

fn kafka_source_rules(k: &crate::spec::KafkaSource, fail: &mut impl FnMut(&str)) {
    use crate::spec::KafkaStartingPosition;
    if !valid_bootstrap(&k.bootstrap_servers) {
        fail(MSG_KAFKA_SOURCE_BOOTSTRAP);
    }
    if k.topics.is_empty()
        || k.topics.len() > MAX_KAFKA_TOPICS
        || !k.topics.iter().all(|t| valid_topic(t))
    {
        fail(MSG_KAFKA_SOURCE_TOPICS);
    }
    if k.starting_position == KafkaStartingPosition::Timestamp
        && k.starting_timestamp.is_none_or(|t| t < 0)
    {
        fail(MSG_KAFKA_STARTING_TIMESTAMP);
    }
    if let Some(t) = &k.idle_timeout
        && (t.len() > 64 || parse_duration(t).is_none())
    {
        fail(MSG_KAFKA_IDLE_TIMEOUT);
    }
    if let Some(t) = &k.metadata_refresh_interval
        && (t.len() > 64 || parse_duration(t).is_none_or(|d| d < Duration::from_secs(1)))
    {
        fail(MSG_KAFKA_REFRESH);
    }
    if reserved_property(&k.properties, KAFKA_SOURCE_RESERVED) {
        fail(MSG_KAFKA_SOURCE_PROPERTIES);
    }
    if k.credentials
        .as_ref()
        .is_some_and(|c| !valid_credentials(c))
    {
        fail(MSG_KAFKA_SOURCE_CREDENTIALS);
    }
}

fn kafka_sink_rules(k: &crate::spec::KafkaSink, fail: &mut impl FnMut(&str)) {
    if !valid_bootstrap(&k.bootstrap_servers) {
        fail(MSG_KAFKA_SINK_BOOTSTRAP);
    }
    if !valid_topic(&k.topic) {
        fail(MSG_KAFKA_SINK_TOPIC);
    }
    if reserved_property(&k.properties, KAFKA_SINK_RESERVED) {
        fail(MSG_KAFKA_SINK_PROPERTIES);
    }
    if k.credentials
        .as_ref()
        .is_some_and(|c| !valid_credentials(c))
    {
        fail(MSG_KAFKA_SINK_CREDENTIALS);
    }
}
