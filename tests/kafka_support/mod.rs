//! The Kafka test broker (`hack/kafka.sh`) as the tests use it: topics, a producer of click
//! records with known per-user counts, a `read_committed` reader of an output topic, and the
//! Java client's partitioner to check where a key landed. Shared by the local tiers and the e2e
//! tier.
#![cfg(feature = "kafka")]
#![allow(dead_code)]

use keyshift::keygroup::Key;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::{Message, Offset, TopicPartitionList};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The broker, or `None` with a message saying how to get one.
pub fn bootstrap(test: &str) -> Option<String> {
    match std::env::var("KEYSHIFT_KAFKA_BOOTSTRAP") {
        Ok(b) if !b.is_empty() => Some(b),
        _ => {
            eprintln!(
                "SKIPPED {test}: set KEYSHIFT_KAFKA_BOOTSTRAP (eval \"$(hack/kafka.sh start)\")"
            );
            None
        }
    }
}

/// A name no earlier run used (topics and the job's transactional id outlive a test).
pub fn unique(tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .subsec_nanos();
    format!("{tag}-{}-{nanos}", std::process::id())
}

pub const PARTITIONS: i32 = 4;

pub async fn create_topic(bootstrap: &str, topic: &str) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("admin client");
    let results = admin
        .create_topics(
            &[NewTopic::new(topic, PARTITIONS, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
        )
        .await
        .expect("create topic");
    for r in results {
        r.expect("topic created");
    }
}

/// One record of the output topic.
#[derive(Debug, Clone)]
pub struct Rec {
    pub partition: i32,
    pub key: String,
    pub value: serde_json::Value,
}

/// Every record of `topic` a consumer sees, partition by partition in offset order:
/// `read_committed` or `read_uncommitted`.
pub fn read_topic(bootstrap: &str, topic: &str, committed: bool) -> Vec<Rec> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", unique("reader"))
        .set("enable.auto.commit", "false")
        .set(
            "isolation.level",
            if committed {
                "read_committed"
            } else {
                "read_uncommitted"
            },
        )
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .expect("partition");
    }
    consumer.assign(&tpl).expect("assign");
    let mut out = Vec::new();
    let started = Instant::now();
    let mut idle_since = Instant::now();
    // Every record is in the topic already (the job has stopped): read until nothing comes for
    // a while.
    while idle_since.elapsed() < Duration::from_secs(4)
        && started.elapsed() < Duration::from_secs(90)
    {
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                idle_since = Instant::now();
                let key = String::from_utf8(m.key().expect("keyed record").to_vec()).expect("utf8");
                let value: serde_json::Value =
                    serde_json::from_slice(m.payload().expect("value")).expect("JSON value");
                out.push(Rec {
                    partition: m.partition(),
                    key,
                    value,
                });
            }
            Some(Err(e)) => panic!("consuming {topic}: {e}"),
            None => {}
        }
    }
    out
}

/// Java's `Utils.murmur2` (what the Java producer's default partitioner hashes a key with).
pub fn murmur2(data: &[u8]) -> i32 {
    let seed: u32 = 0x9747_b28c;
    let m: u32 = 0x5bd1_e995;
    let r = 24;
    let len = data.len();
    let mut h: u32 = seed ^ (len as u32);
    let chunks = data.chunks_exact(4);
    let tail = chunks.remainder();
    for c in chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(m);
        k ^= k >> r;
        k = k.wrapping_mul(m);
        h = h.wrapping_mul(m);
        h ^= k;
    }
    match tail.len() {
        3 => {
            h ^= u32::from(tail[2]) << 16;
            h ^= u32::from(tail[1]) << 8;
            h ^= u32::from(tail[0]);
            h = h.wrapping_mul(m);
        }
        2 => {
            h ^= u32::from(tail[1]) << 8;
            h ^= u32::from(tail[0]);
            h = h.wrapping_mul(m);
        }
        1 => {
            h ^= u32::from(tail[0]);
            h = h.wrapping_mul(m);
        }
        _ => {}
    }
    h ^= h >> 13;
    h = h.wrapping_mul(m);
    h ^= h >> 15;
    h as i32
}

/// The partition Java's default partitioner picks for a keyed record.
pub fn java_partition(key: &str) -> i32 {
    (murmur2(key.as_bytes()) & 0x7fff_ffff) % PARTITIONS
}

/// Produces `records` (key, JSON value, partition) to `topic` and waits until the broker
/// acknowledged them all.
pub fn produce_keyed(bootstrap: &str, topic: &str, records: &[(String, String, i32)]) {
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .create()
        .expect("producer");
    for (key, payload, partition) in records {
        let mut record = BaseRecord::to(topic)
            .key(key.as_str())
            .payload(payload.as_str())
            .partition(*partition);
        loop {
            match producer.send(record) {
                Ok(()) => break,
                Err((_, r)) => {
                    record = r;
                    producer.poll(Duration::from_millis(10));
                }
            }
        }
    }
    producer
        .flush(Duration::from_secs(60))
        .expect("every record acknowledged");
}

/// Produces `n` records to `topic` (key and JSON value name the user; about a third go to the
/// hot user `hot`, the rest over 200 users; partitions picked round the topic, not by key) and
/// counts them per user into `counts`. Waits until the broker acknowledged them all.
pub fn produce_clicks(
    bootstrap: &str,
    topic: &str,
    from: u64,
    n: u64,
    counts: &mut BTreeMap<Key, i64>,
) {
    let records: Vec<(String, String, i32)> = (from..from + n)
        .map(|i| {
            let h = i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let user = if h.is_multiple_of(3) {
                "hot".to_owned()
            } else {
                format!("user-{}", (h >> 20) % 200)
            };
            *counts.entry(Key::String(user.clone())).or_insert(0) += 1;
            let payload = format!("{{\"user\":\"{user}\",\"seq\":{i}}}");
            (user, payload, (i % PARTITIONS as u64) as i32)
        })
        .collect();
    produce_keyed(bootstrap, topic, &records);
}

/// `hack/kafka.sh ARGS` on the test broker (`KEYSHIFT_KAFKA_STATE`).
pub fn kafka_sh(args: &[&str]) {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let status = std::process::Command::new("bash")
        .arg(root.join("hack/kafka.sh"))
        .args(args)
        .stdout(std::process::Stdio::null())
        .status()
        .expect("hack/kafka.sh runs");
    assert!(status.success(), "hack/kafka.sh {args:?}: {status}");
}

/// The offsets consumer group `group` has committed on `topic`'s partitions (the source commits
/// them after each snapshot commits: how far a job has read, as lag tools see it).
pub fn committed(bootstrap: &str, group: &str, topic: &str) -> BTreeMap<i32, u64> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        tpl.add_partition(topic, p);
    }
    let got = c
        .committed_offsets(tpl, Duration::from_secs(10))
        .expect("committed offsets");
    got.elements()
        .iter()
        .filter_map(|e| match e.offset() {
            Offset::Offset(o) if o >= 0 => Some((e.partition(), o as u64)),
            _ => None,
        })
        .collect()
}

/// The newest count of every key among `records` (an output topic of a keyed count, read in
/// offset order), checking on the way that every key lies in its Java partition and that no
/// key's count goes down (nothing doubled, nothing from an aborted transaction).
pub fn newest_counts(records: &[Rec]) -> BTreeMap<Key, i64> {
    let mut newest: BTreeMap<Key, i64> = BTreeMap::new();
    for r in records {
        assert_eq!(
            r.partition,
            java_partition(&r.key),
            "key {} misplaced",
            r.key
        );
        let v = r.value["value"].as_i64().expect("a count");
        let prev = newest.insert(Key::String(r.key.clone()), v);
        assert!(
            prev.is_none_or(|p| p <= v),
            "the count of {} went down from {prev:?} to {v}",
            r.key
        );
    }
    newest
}
