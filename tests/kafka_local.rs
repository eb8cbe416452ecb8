//! The Kafka source end to end on one machine, against a real broker (hack/kafka.sh: Apache
//! Kafka in KRaft mode): real `keyshift worker` processes, the real coordinator, snapshots on
//! `file://`. The test produces a known set of records (string keys with a hot key, four
//! partitions, each record's partition chosen by the test), so the exact per-key totals of any
//! snapshot follow from its per-partition offsets; it checks them at every snapshot through
//! rescales up and down (past the partition count), a killed worker and a broker restart, and
//! that the consumer group holds the offsets of committed snapshots (for lag tools).
//!
//! Needs KEYSHIFT_KAFKA_BOOTSTRAP (`eval "$(hack/kafka.sh start)"`; hack/test.sh does it);
//! without it the tests pass after saying they were skipped. The broker restart needs
//! KEYSHIFT_KAFKA_STATE too (the state dir hack/kafka.sh prints).
#![cfg(feature = "kafka")]

mod fake_platform;
mod kafka_support;
mod programs_support;
mod snapshot_support;

use kafka_support::committed;
use keyshift::crd::StreamJob;
use keyshift::keygroup::Key;
use keyshift::local::LocalJob;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer, ThreadedProducer};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

const PARTITIONS: i32 = 4;

/// One test at a time: one of them restarts the broker, which the others would see as an
/// outage at a random step.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_keyshift"))
}

fn root() -> PathBuf {
    PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"))
}

fn bootstrap() -> Option<String> {
    match std::env::var("KEYSHIFT_KAFKA_BOOTSTRAP") {
        Ok(b) if !b.is_empty() => Some(b),
        _ => {
            eprintln!(
                "SKIPPED: KEYSHIFT_KAFKA_BOOTSTRAP is not set; start a broker with `eval \"$(hack/kafka.sh start)\"` (hack/test.sh does)"
            );
            None
        }
    }
}

/// A topic name no other run uses.
fn unique_topic(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("ks-{name}-{}-{nanos}", std::process::id())
}

async fn create_topic(bootstrap: &str, topic: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("admin client");
    let r = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
        )
        .await
        .expect("create topics");
    for t in r {
        t.expect("topic created");
    }
}

/// The records the test produced, per partition in offset order: (user, amount).
#[derive(Default)]
struct Produced {
    by_partition: BTreeMap<i32, Vec<(String, i64)>>,
}

impl Produced {
    /// The exact per-key count and sum of the first `positions[p]` records of each partition.
    fn totals_at(
        &self,
        positions: &BTreeMap<i32, u64>,
    ) -> (BTreeMap<String, i64>, BTreeMap<String, i64>) {
        let mut counts = BTreeMap::new();
        let mut sums = BTreeMap::new();
        for (p, records) in &self.by_partition {
            let end = positions.get(p).copied().unwrap_or(0) as usize;
            assert!(
                end <= records.len(),
                "partition {p}: position {end} is past the {} records produced",
                records.len()
            );
            for (user, amount) in &records[..end] {
                *counts.entry(user.clone()).or_insert(0) += 1;
                *sums.entry(user.clone()).or_insert(0) += amount;
            }
        }
        (counts, sums)
    }

    fn ends(&self) -> BTreeMap<i32, u64> {
        (0..PARTITIONS)
            .map(|p| (p, self.by_partition.get(&p).map_or(0, |r| r.len()) as u64))
            .collect()
    }
}

/// Produces `n` records: a hot key on about a third of them, the rest over 200 users, each to a
/// partition the test picks (not by key, so the hot key spreads over every partition), with the
/// user as record key too. Waits until the broker acknowledged them all. Offsets are contiguous
/// from 0 (an idempotent, non-transactional producer), so the i-th record of a partition has
/// offset i.
fn produce(bootstrap: &str, topic: &str, seq: &mut u64, n: u64, out: &mut Produced) {
    produce_to(bootstrap, topic, PARTITIONS, seq, n, out)
}

/// [`produce`] over the first `partitions` partitions.
fn produce_to(
    bootstrap: &str,
    topic: &str,
    partitions: i32,
    seq: &mut u64,
    n: u64,
    out: &mut Produced,
) {
    let producer: ThreadedProducer<DefaultProducerContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .create()
        .expect("producer");
    for _ in 0..n {
        let i = *seq;
        *seq += 1;
        let h = i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let user = if h.is_multiple_of(3) {
            "hot".to_owned()
        } else {
            format!("user-{}", (h >> 20) % 200)
        };
        let amount = (i % 17) as i64 + 1;
        let partition = ((h >> 40) % partitions as u64) as i32;
        let payload = format!("{{\"user\":\"{user}\",\"amount\":{amount},\"seq\":{i}}}");
        send(
            &producer,
            BaseRecord::to(topic)
                .key(user.as_str())
                .payload(payload.as_str())
                .partition(partition),
        );
        out.by_partition
            .entry(partition)
            .or_default()
            .push((user, amount));
    }
    producer
        .flush(Duration::from_secs(60))
        .expect("every record acknowledged");
}

/// Sends `record`, waiting while the producer's queue is full or the partition is one just
/// added that its metadata does not show yet.
fn send(producer: &ThreadedProducer<DefaultProducerContext>, mut record: BaseRecord<'_, str, str>) {
    loop {
        match producer.send(record) {
            Ok(()) => return,
            Err((e, r)) => {
                assert!(
                    matches!(
                        e.rdkafka_error_code(),
                        Some(
                            rdkafka::types::RDKafkaErrorCode::QueueFull
                                | rdkafka::types::RDKafkaErrorCode::UnknownPartition
                        )
                    ),
                    "produce: {e}"
                );
                record = r;
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

fn job_yaml(
    name: &str,
    bootstrap: &str,
    topic: &str,
    replicas: u32,
    agg: &str,
    extra: &str,
) -> StreamJob {
    serde_yaml::from_str(&format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {{name: {name}, namespace: test}}
spec:
  replicas: {replicas}
  maxParallelism: 64
  job:
    source:
      kafka:
        bootstrapServers: '{bootstrap}'
        topics: [{topic}]
        metadataRefreshInterval: 2s
{extra}
    key: {{field: user, type: string}}
    aggregation: {agg}
  state:
    checkpointInterval: 1h
"
    ))
    .expect("test manifest parses")
}

/// A snapshot's per-key values and its positions by partition number (from the names the
/// snapshot records, `<topic>/<partition>`).
async fn snapshot(url: &str, topic: &str) -> (BTreeMap<String, i64>, BTreeMap<i32, u64>) {
    let s = snapshot_support::read_state(url).await;
    let values = s
        .scalars()
        .into_iter()
        .map(|(k, v)| match k {
            Key::String(s) => (s, v),
            other => panic!("a string key, got {other:?}"),
        })
        .collect();
    let mut positions = BTreeMap::new();
    for (index, offset) in &s.positions {
        let name = s
            .manifest
            .source_partitions
            .get(index)
            .unwrap_or_else(|| panic!("snapshot {url} names source partition {index}"));
        let (t, p) = name.rsplit_once('/').expect("<topic>/<partition>");
        assert_eq!(t, topic);
        positions.insert(p.parse::<i32>().expect("partition number"), *offset);
    }
    (values, positions)
}

/// A job over `topic` (see [`job_yaml`]) launched in worker processes at parallelism 2, its
/// state and logs in a new temporary directory that lives as long as the returned guard.
async fn launch_at_2(
    name: &str,
    bootstrap: &str,
    topic: &str,
    aggregation: &str,
    source_extra: &str,
) -> (tempfile::TempDir, LocalJob) {
    let dir = tempfile::tempdir().expect("temp dir");
    let storage = format!("file://{}", dir.path().join("state").display());
    let spec = job_yaml(name, bootstrap, topic, 2, aggregation, source_extra);
    let mut local = LocalJob::new(&spec, storage, bin(), dir.path().join("logs"))
        .await
        .expect("job prepares");
    local.launch(2, None).await.expect("launch at 2");
    (dir, local)
}

/// Checks a snapshot's state against the exact totals at its positions; returns its positions.
async fn assert_exact(
    url: &str,
    topic: &str,
    produced: &Produced,
    sum: bool,
) -> BTreeMap<i32, u64> {
    let (values, positions) = snapshot(url, topic).await;
    assert_eq!(
        positions.keys().copied().collect::<Vec<_>>(),
        (0..PARTITIONS).collect::<Vec<_>>(),
        "every partition has a position in {url}"
    );
    let (counts, sums) = produced.totals_at(&positions);
    let expected = if sum { sums } else { counts };
    assert_eq!(values.len(), expected.len(), "key count in {url}");
    assert!(
        values == expected,
        "state in {url} differs from the exact totals at {positions:?}: hot {:?} vs {:?}",
        values.get("hot"),
        expected.get("hot")
    );
    positions
}

/// Checkpoints until the job has read everything produced (or panics after `timeout`).
async fn checkpoint_when_caught_up(
    local: &mut LocalJob,
    topic: &str,
    produced: &Produced,
    timeout: Duration,
) -> String {
    let start = Instant::now();
    loop {
        recover_a_stalled_source(local).await;
        let c = local.checkpoint().await.expect("checkpoint");
        let (_, positions) = snapshot(&c.url, topic).await;
        if positions == produced.ends() {
            return c.url;
        }
        assert!(
            start.elapsed() < timeout,
            "not caught up within {timeout:?}: at {positions:?}, produced {:?}",
            produced.ends()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// What the platforms do when a worker fails its run because its Kafka consumer stopped
/// fetching (a known librdkafka behaviour after a broker restart; the source's stall watchdog):
/// restart from the latest checkpoint. Any other failed worker fails the test.
async fn recover_a_stalled_source(local: &mut LocalJob) {
    let Some((index, exit)) = local.failed_worker() else {
        return;
    };
    let logs = local.log_dir().to_owned();
    // The failed worker's newest log (one per run).
    let newest = std::fs::read_dir(&logs)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .ends_with(&format!("-worker-{index}.log"))
        })
        .max_by_key(|e| e.metadata().and_then(|m| m.modified()).ok());
    let stalled = newest.is_some_and(|e| {
        std::fs::read_to_string(e.path())
            .unwrap_or_default()
            .contains("restarting from the latest checkpoint with a new Kafka consumer")
    });
    assert!(
        stalled,
        "worker {index} failed ({exit}); logs in {}",
        logs.display()
    );
    let p = local.parallelism().unwrap_or(1);
    eprintln!("worker {index}'s Kafka consumer stalled ({exit}): restarting at parallelism {p}");
    local.recover(p).await.expect("recover");
}

fn restart_broker() -> bool {
    if std::env::var("KEYSHIFT_KAFKA_STATE").is_err() {
        eprintln!("KEYSHIFT_KAFKA_STATE is not set: the broker restart step is skipped");
        return false;
    }
    let status = std::process::Command::new("bash")
        .arg(root().join("hack/kafka.sh"))
        .arg("restart")
        .stdout(std::process::Stdio::null())
        .status()
        .expect("hack/kafka.sh restart runs");
    assert!(status.success(), "hack/kafka.sh restart: {status}");
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_source_exact_through_rescales_a_killed_worker_and_a_broker_restart() {
    let Some(bootstrap) = bootstrap() else { return };
    let _one = ONE_AT_A_TIME.lock().await;
    let topic = unique_topic("count");
    create_topic(&bootstrap, &topic, PARTITIONS).await;
    let mut produced = Produced::default();
    let mut seq = 0;
    produce(&bootstrap, &topic, &mut seq, 6000, &mut produced);

    let (_dir, mut local) = launch_at_2(
        "kcount",
        &bootstrap,
        &topic,
        "{function: sum, field: amount}",
        "",
    )
    .await;

    // Everything produced so far is read; the state is exact.
    let first =
        checkpoint_when_caught_up(&mut local, &topic, &produced, Duration::from_secs(60)).await;
    let first_positions = assert_exact(&first, &topic, &produced, true).await;

    // Up past the partition count (5 subtasks, 4 partitions: one reads nothing) while records
    // arrive: the savepoint is exact at whatever offsets it cut.
    produce(&bootstrap, &topic, &mut seq, 3000, &mut produced);
    let r = local.rescale(5).await.expect("rescale 2 -> 5");
    assert_exact(&r.savepoint, &topic, &produced, true).await;

    // The consumer group holds the offsets of a committed checkpoint (committed when the next
    // barrier tells the workers it committed): never used to restore, only for lag tools.
    let c1 = local.checkpoint().await.expect("checkpoint");
    let (_, c1_positions) = snapshot(&c1.url, &topic).await;
    let _ = local.checkpoint().await.expect("checkpoint after");
    let group = "keyshift.test.kcount";
    let start = Instant::now();
    loop {
        let got = committed(&bootstrap, group, &topic);
        if got == c1_positions {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "group {group} holds {got:?}, expected the committed checkpoint's {c1_positions:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_ne!(c1_positions, first_positions, "the job moved on");

    // A killed worker: the job recovers from the last checkpoint and reads on exactly.
    produce(&bootstrap, &topic, &mut seq, 2000, &mut produced);
    local.kill_worker(1).await;
    assert!(
        local.checkpoint().await.is_err(),
        "no checkpoint without worker 1"
    );
    let rec = local.recover(5).await.expect("recover at 5");
    assert!(rec.restored_from.is_some(), "restored from a checkpoint");
    let caught =
        checkpoint_when_caught_up(&mut local, &topic, &produced, Duration::from_secs(60)).await;
    assert_exact(&caught, &topic, &produced, true).await;

    // The broker restarts mid-run (clean stop, same port and data) while records keep coming.
    if restart_broker() {
        produce(&bootstrap, &topic, &mut seq, 2000, &mut produced);
    }

    // Down to 1 while the rest arrives.
    produce(&bootstrap, &topic, &mut seq, 1000, &mut produced);
    let r = local.rescale(1).await.expect("rescale 5 -> 1");
    assert_exact(&r.savepoint, &topic, &produced, true).await;
    produce(&bootstrap, &topic, &mut seq, 1000, &mut produced);
    let done =
        checkpoint_when_caught_up(&mut local, &topic, &produced, Duration::from_secs(90)).await;
    assert_exact(&done, &topic, &produced, true).await;

    let sp = local.shutdown().await.expect("stop with savepoint");
    let positions = assert_exact(&sp.url, &topic, &produced, true).await;
    assert_eq!(positions, produced.ends(), "every record read, none twice");
    let (values, _) = snapshot(&sp.url, &topic).await;
    let total: i64 = values.values().sum();
    let want: i64 = produced
        .by_partition
        .values()
        .flatten()
        .map(|(_, a)| a)
        .sum();
    assert_eq!(total, want);
    assert!(
        values["hot"]
            > values
                .iter()
                .filter(|(k, _)| *k != "hot")
                .map(|(_, v)| *v)
                .max()
                .unwrap_or(0)
                * 10,
        "the hot key is hot"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_source_keys_from_the_record_key_and_starts_at_latest() {
    let Some(bootstrap) = bootstrap() else { return };
    let _one = ONE_AT_A_TIME.lock().await;
    let topic = unique_topic("latest");
    create_topic(&bootstrap, &topic, PARTITIONS).await;
    let mut old = Produced::default();
    let mut seq = 0;
    // Produced before the job starts: a job starting at `latest` never reads them.
    produce(&bootstrap, &topic, &mut seq, 500, &mut old);
    let before = old.ends();

    let (_dir, mut local) = launch_at_2(
        "klatest",
        &bootstrap,
        &topic,
        "{function: count}",
        "        keyFrom: recordKey\n        startingPosition: latest",
    )
    .await;
    // A checkpoint before any new record holds the resolved end offsets, not "latest": a restore
    // from it must not skip what arrives next.
    let c = local.checkpoint().await.expect("checkpoint");
    let (values, positions) = snapshot(&c.url, &topic).await;
    assert!(
        values.is_empty(),
        "nothing before the start is read: {values:?}"
    );
    assert_eq!(positions, before, "the start's end offsets");

    let mut new = Produced::default();
    produce(&bootstrap, &topic, &mut seq, 1500, &mut new);
    // Everything is produced to the same topic: the job's totals are those of the records after
    // `before`.
    let mut all = old;
    for (p, r) in new.by_partition {
        all.by_partition.entry(p).or_default().extend(r);
    }
    let url = checkpoint_when_caught_up(&mut local, &topic, &all, Duration::from_secs(60)).await;
    let (values, positions) = snapshot(&url, &topic).await;
    let (all_counts, _) = all.totals_at(&positions);
    let (old_counts, _) = all.totals_at(&before);
    let expected: BTreeMap<String, i64> = all_counts
        .into_iter()
        .map(|(k, v)| {
            let v = v - old_counts.get(&k).copied().unwrap_or(0);
            (k, v)
        })
        .filter(|(_, v)| *v > 0)
        .collect();
    assert_eq!(
        values, expected,
        "exact counts of the records after the start, keyed by record key"
    );
    local.shutdown().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_added_while_the_job_runs_are_read_from_their_start() {
    let Some(bootstrap) = bootstrap() else { return };
    let _one = ONE_AT_A_TIME.lock().await;
    let topic = unique_topic("grow");
    create_topic(&bootstrap, &topic, 2).await;
    let mut produced = Produced::default();
    let mut seq = 0;
    produce_to(&bootstrap, &topic, 2, &mut seq, 2000, &mut produced);

    let (_dir, mut local) = launch_at_2("kgrow", &bootstrap, &topic, "{function: count}", "").await;
    let start = Instant::now();
    let checkpoint = loop {
        let c = local.checkpoint().await.expect("checkpoint");
        let (_, positions) = snapshot(&c.url, &topic).await;
        if positions == BTreeMap::from([(0, produced.ends()[&0]), (1, produced.ends()[&1])]) {
            break c.url;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "caught up");
        tokio::time::sleep(Duration::from_millis(300)).await;
    };

    // Two more partitions, written to before the job notices them.
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .expect("admin client");
    for r in admin
        .create_partitions(
            &[rdkafka::admin::NewPartitions::new(
                &topic,
                PARTITIONS as usize,
            )],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
        )
        .await
        .expect("create partitions")
    {
        r.expect("partitions added");
    }
    produce(&bootstrap, &topic, &mut seq, 3000, &mut produced);

    // The metadata refresh (2 s here) notices them: the run fails, saying why.
    let start = Instant::now();
    let (index, reason) = loop {
        if let Some(f) = local.failed_worker() {
            break f;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no worker noticed the new partitions"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!("worker {index} stopped: {reason}");

    // Restarting from the latest checkpoint lists all four partitions and reads the new ones
    // from their first offset: exact counts over everything, nothing skipped.
    let r = local.recover(2).await.expect("recover");
    assert_eq!(r.restored_from.as_deref(), Some(checkpoint.as_str()));
    // A run that started while the brokers' metadata still showed two partitions fails again at
    // its next refresh and is recovered again (as the operator would), from its own checkpoint.
    let start = Instant::now();
    let mut recoveries = 1;
    let url = loop {
        match local.checkpoint().await {
            Ok(c) => {
                let (_, positions) = snapshot(&c.url, &topic).await;
                if positions == produced.ends() {
                    break c.url;
                }
            }
            Err(e) => {
                assert!(
                    recoveries < 3,
                    "checkpoint after {recoveries} recoveries: {e}"
                );
                let f = local.failed_worker();
                assert!(
                    f.is_some(),
                    "a checkpoint failed without a failed worker: {e}"
                );
                local.recover(2).await.expect("recover again");
                recoveries += 1;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(90),
            "not caught up with the four partitions"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert_exact(&url, &topic, &produced, false).await;
    local.shutdown().await.expect("stop");
}

/// The partitions' high watermarks as the broker reports them, by partition number.
fn high_watermarks(bootstrap: &str, topic: &str) -> BTreeMap<i32, u64> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "keyshift-test-watermarks")
        .create()
        .expect("consumer");
    (0..PARTITIONS)
        .map(|p| {
            let (_, high) = c
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .expect("watermarks");
            (p, high as u64)
        })
        .collect()
}

/// The job's lag as its status would show it (the orchestration's own aggregation of the
/// workers' reports), and every partition's (position, high watermark, records) by number.
async fn job_lag(
    local: &mut LocalJob,
) -> (
    Option<keyshift::crd::SourceLagStatus>,
    BTreeMap<i32, (u64, u64, u64)>,
) {
    let statuses = local.status().await.expect("worker status");
    let lags: Vec<_> = statuses
        .iter()
        .filter_map(|s| s.source_lag.as_ref())
        .collect();
    let mut partitions = BTreeMap::new();
    for l in &lags {
        for p in &l.partitions {
            let (_, n) = p.partition.rsplit_once('/').expect("<topic>/<partition>");
            partitions.insert(
                n.parse::<i32>().expect("partition number"),
                (p.position, p.high_watermark, p.records),
            );
        }
    }
    (
        keyshift::orchestrator::status::source_lag(&lags),
        partitions,
    )
}

/// Waits until `ok` holds of the job's lag (or panics after `timeout`, showing the last).
async fn wait_lag(
    local: &mut LocalJob,
    what: &str,
    timeout: Duration,
    ok: impl Fn(&keyshift::crd::SourceLagStatus, &BTreeMap<i32, (u64, u64, u64)>) -> bool,
) -> (
    keyshift::crd::SourceLagStatus,
    BTreeMap<i32, (u64, u64, u64)>,
) {
    let start = Instant::now();
    loop {
        let (lag, partitions) = job_lag(local).await;
        if let Some(lag) = lag
            && ok(&lag, &partitions)
        {
            return (lag, partitions);
        }
        assert!(
            start.elapsed() < timeout,
            "{what}: not within {timeout:?}; last {lag:?}, partitions {partitions:?}",
            lag = job_lag(local).await.0
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Consumer lag from the brokers' offsets: 0 once the job read everything; exactly what the
/// broker says (high watermark - position, per partition and summed) while its sources are
/// stopped and records arrive; 0 again once they read on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_lag_is_what_the_broker_says_and_drops_to_zero_once_read() {
    let Some(bootstrap) = bootstrap() else { return };
    let _one = ONE_AT_A_TIME.lock().await;
    let topic = unique_topic("lag");
    create_topic(&bootstrap, &topic, PARTITIONS).await;
    let mut produced = Produced::default();
    let mut seq = 0;
    produce(&bootstrap, &topic, &mut seq, 2000, &mut produced);

    let (_dir, mut local) = launch_at_2("klag", &bootstrap, &topic, "{function: count}", "").await;
    checkpoint_when_caught_up(&mut local, &topic, &produced, Duration::from_secs(60)).await;
    let (caught_up, _) = wait_lag(&mut local, "lag 0", Duration::from_secs(20), |l, _| {
        l.partitions == PARTITIONS && l.records == 0
    })
    .await;
    assert_eq!(caught_up.seconds, Some(0), "{caught_up:?}");

    // The sources stop at a savepoint's barrier; records arrive.
    let sp = local.savepoint(true).await.expect("stop-with-savepoint");
    let (_, stopped_at) = snapshot(&sp.url, &topic).await;
    assert_eq!(stopped_at, produced.ends(), "stopped with everything read");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    const N: u64 = 3000;
    produce(&bootstrap, &topic, &mut seq, N, &mut produced);
    let high = high_watermarks(&bootstrap, &topic);
    let broker: BTreeMap<i32, u64> = high.iter().map(|(p, h)| (*p, h - stopped_at[p])).collect();
    assert_eq!(
        broker.values().sum::<u64>(),
        N,
        "the broker's lag: {broker:?}"
    );
    let (behind, partitions) = wait_lag(
        &mut local,
        "lag of the records produced while stopped",
        Duration::from_secs(20),
        |l, _| l.records as u64 == N,
    )
    .await;
    for (p, (position, hw, records)) in &partitions {
        assert_eq!(
            (*position, *hw, *records),
            (stopped_at[p], high[p], broker[p]),
            "partition {p}: (position, high watermark, records behind)"
        );
    }
    let seconds = behind.seconds.expect("seconds behind are known");
    assert!(
        (1..60).contains(&seconds),
        "seconds behind since the partitions were last read to their end: {behind:?}"
    );
    assert_eq!(behind.partitions_behind, PARTITIONS);
    let furthest = behind
        .furthest_behind
        .clone()
        .expect("a partition is behind");
    let (_, n) = furthest.rsplit_once('/').expect("<topic>/<partition>");
    let n: i32 = n.parse().expect("partition number");
    assert_eq!(
        broker[&n],
        broker.values().max().copied().unwrap_or(0),
        "furthest behind {furthest}, broker {broker:?}"
    );
    eprintln!("lag while stopped: {} (broker: {broker:?})", behind.summary);

    // Reading on: back to 0 records and 0 seconds.
    local.resume().await.expect("resume");
    let start = Instant::now();
    let (after, _) = wait_lag(
        &mut local,
        "lag 0 again",
        Duration::from_secs(30),
        |l, _| l.records == 0 && l.seconds == Some(0),
    )
    .await;
    eprintln!("caught up in {:?}: {}", start.elapsed(), after.summary);
    let url =
        checkpoint_when_caught_up(&mut local, &topic, &produced, Duration::from_secs(30)).await;
    assert_exact(&url, &topic, &produced, false).await;
    local.shutdown().await.expect("stop");
}

/// `hack/kafka.sh ARGS` on the test broker (`KEYSHIFT_KAFKA_STATE`).
fn kafka_sh(args: &[&str]) {
    let status = std::process::Command::new("bash")
        .arg(root().join("hack/kafka.sh"))
        .args(args)
        .stdout(std::process::Stdio::null())
        .status()
        .expect("hack/kafka.sh runs");
    assert!(status.success(), "hack/kafka.sh {args:?}: {status}");
}

/// A source whose brokers go away says so (the KafkaReachable condition's lines: the bootstrap
/// servers and the client's error), keeps checkpointing its position (nothing lost, nothing
/// read twice) and reads on when they are back, with exact state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_that_cannot_reach_its_brokers_says_so_and_recovers_when_they_return() {
    let Some(bootstrap) = bootstrap() else { return };
    if std::env::var("KEYSHIFT_KAFKA_STATE").is_err() {
        eprintln!("SKIPPED: KEYSHIFT_KAFKA_STATE is not set (hack/kafka.sh start prints it)");
        return;
    }
    let _one = ONE_AT_A_TIME.lock().await;
    let topic = unique_topic("down");
    create_topic(&bootstrap, &topic, PARTITIONS).await;
    let mut produced = Produced::default();
    let mut seq = 0;
    produce(&bootstrap, &topic, &mut seq, 1500, &mut produced);

    let (_dir, mut local) = launch_at_2(
        "kdown",
        &bootstrap,
        &topic,
        "{function: sum, field: amount}",
        "",
    )
    .await;
    let before =
        checkpoint_when_caught_up(&mut local, &topic, &produced, Duration::from_secs(60)).await;
    let before_positions = assert_exact(&before, &topic, &produced, true).await;
    wait_lag(&mut local, "lag 0", Duration::from_secs(20), |l, _| {
        l.records == 0
    })
    .await;
    assert!(
        local.kafka_outages().await.expect("outages").is_empty(),
        "the brokers are reachable"
    );

    /// Starts the broker again however the test ends (it is shared with the tests after it).
    struct Restart;
    impl Drop for Restart {
        fn drop(&mut self) {
            kafka_sh(&["start"]);
        }
    }
    kafka_sh(&["stop"]);
    let restart = Restart;
    let start = Instant::now();
    let outages = loop {
        let o = local.kafka_outages().await.expect("outages");
        if o.len() == 1 && o[0].starts_with("the source of subtasks 0, 1: ") {
            break o;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no outage reported by both subtasks: {o:?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let (ok, reason, message) = keyshift::orchestrator::status::kafka_reachable(&outages, None);
    eprintln!("KafkaReachable {ok} {reason}: {message}");
    assert!(!ok);
    assert_eq!(reason, "KafkaUnreachable");
    assert!(
        message.contains(&format!(
            "cannot reach the Kafka brokers {bootstrap} of the source"
        )),
        "{message}"
    );
    let port = bootstrap.rsplit(':').next().unwrap_or_default();
    assert!(
        message.contains("Connection refused") || message.contains(port),
        "the client's own report names what failed: {message}"
    );
    // The job runs on: checkpoints commit at the same positions (nothing lost, nothing new).
    let during = local
        .checkpoint()
        .await
        .expect("a checkpoint without the brokers");
    let during_positions = assert_exact(&during.url, &topic, &produced, true).await;
    assert_eq!(during_positions, before_positions);

    drop(restart);
    produce(&bootstrap, &topic, &mut seq, 1500, &mut produced);
    let start = Instant::now();
    loop {
        recover_a_stalled_source(&mut local).await;
        let o = local.kafka_outages().await.expect("outages");
        if o.is_empty() {
            break;
        }
        // The broker's JVM starts slowly on a loaded machine: a bound for a hang, not a speed.
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "still unreachable after the broker returned: {o:?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    eprintln!("reachable again after {:?}", start.elapsed());
    let url =
        checkpoint_when_caught_up(&mut local, &topic, &produced, Duration::from_secs(90)).await;
    assert_exact(&url, &topic, &produced, true).await;
    wait_lag(
        &mut local,
        "lag 0 after the outage",
        Duration::from_secs(20),
        |l, _| l.records == 0,
    )
    .await;
    local.shutdown().await.expect("stop");
}

/// The orchestration pass itself, over in-process workers (tests/fake_platform) reading a real
/// topic: it writes status.source.lag from the workers' reports, sets KafkaReachable True, and
/// the per-job lag series follow status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pass_writes_the_lag_to_status_and_the_job_series() {
    use keyshift::orchestrator::pass::{JobMemory, PassInput, Shell, run_pass};
    let Some(bootstrap) = bootstrap() else { return };
    let _one = ONE_AT_A_TIME.lock().await;
    let topic = unique_topic("pass");
    create_topic(&bootstrap, &topic, PARTITIONS).await;
    let mut produced = Produced::default();
    let mut seq = 0;
    produce(&bootstrap, &topic, &mut seq, 1000, &mut produced);
    let spec = job_yaml("kpass", &bootstrap, &topic, 2, "{function: count}", "").spec;
    let mut workers = fake_platform::FakeWorkers::new(
        "kafka-pass-token",
        keyshift::orchestrator::settings::spec_hash(&spec),
    );
    let metrics = keyshift::operator::metrics::OperatorMetrics::new();
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("client");
    let mut mem = JobMemory::default();
    let mut status = keyshift::crd::StreamJobStatus::default();
    let storage = format!("memory://{topic}/state");
    // Passes until `done` holds of the status (or 60 s).
    macro_rules! pass_until {
        ($what:expr, $done:expr) => {{
            let start = Instant::now();
            loop {
                let out = run_pass(
                    PassInput {
                        namespace: "test",
                        name: "kpass",
                        spec: &spec,
                        status: status.clone(),
                        storage: storage.clone(),
                        generation: None,
                        savepoint_request: None,
                    },
                    &mut mem,
                    Shell {
                        workers: &mut workers,
                        metrics: &metrics,
                        http: &http,
                    },
                )
                .await
                .expect("pass");
                status = out.status;
                metrics.observe_status("test", "kpass", &spec, &status);
                let reachable = status
                    .conditions
                    .iter()
                    .find(|c| c.type_ == "KafkaReachable")
                    .cloned();
                if let Some(found) = $done(&status, reachable) {
                    break found;
                }
                assert!(
                    start.elapsed() < Duration::from_secs(60),
                    "{}: not within 60 s: {status:#?}",
                    $what
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }};
    }
    type Cond = Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>;
    let start = Instant::now();
    let lag = pass_until!(
        "lag 0 and KafkaReachable True",
        |status: &keyshift::crd::StreamJobStatus, c: Cond| {
            let reachable = c.map(|c| (c.status, c.reason));
            if let Some(lag) = status.source.as_ref().and_then(|s| s.lag.clone())
                && lag.partitions == PARTITIONS
                && lag.records == 0
                && reachable == Some(("True".into(), "KafkaReachable".into()))
            {
                return Some(lag);
            }
            None
        }
    );
    assert_eq!(lag.seconds, Some(0));
    assert_eq!(lag.summary, "4 partitions read to the end");
    let text = metrics.encode();
    for series in [
        "keyshift_job_source_lag_records{namespace=\"test\",streamjob=\"kpass\"} 0",
        "keyshift_job_source_lag_seconds{namespace=\"test\",streamjob=\"kpass\"} 0",
    ] {
        assert!(text.contains(series), "{series} in {text}");
    }
    eprintln!("status.source.lag after {:?}: {lag:?}", start.elapsed());

    // The broker stops: the condition turns False, naming the brokers and the client's error;
    // back to True once it is up again.
    if std::env::var("KEYSHIFT_KAFKA_STATE").is_err() {
        eprintln!("KEYSHIFT_KAFKA_STATE is not set: the broker outage step is skipped");
        return;
    }
    /// Starts the broker again however the test ends (it is shared with the tests after it).
    struct Restart;
    impl Drop for Restart {
        fn drop(&mut self) {
            kafka_sh(&["start"]);
        }
    }
    kafka_sh(&["stop"]);
    let restart = Restart;
    let down = pass_until!(
        "KafkaReachable False",
        |_: &keyshift::crd::StreamJobStatus, c: Cond| { c.filter(|c| c.status == "False") }
    );
    eprintln!("KafkaReachable {}: {}", down.reason, down.message);
    assert_eq!(down.reason, "KafkaUnreachable");
    assert!(
        down.message.contains(&format!(
            "cannot reach the Kafka brokers {bootstrap} of the source"
        )),
        "{}",
        down.message
    );
    drop(restart);
    pass_until!(
        "KafkaReachable True again",
        |_: &keyshift::crd::StreamJobStatus, c: Cond| { c.filter(|c| c.status == "True") }
    );
}

/// A source whose consumer stops fetching (librdkafka's consumer with assigned partitions
/// sometimes does not resume after a broker restart; here a failpoint stalls the topic's reads)
/// fails its run within the stall watchdog's time, saying which partition and why; the run
/// restarted from the latest checkpoint reads on, and the state is exact.
#[cfg(feature = "test-hooks")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_whose_consumer_stops_fetching_fails_its_run_and_the_restart_loses_nothing() {
    use keyshift_runtime::failpoints::KAFKA_STALL_DIR;
    use keyshift_runtime::job::kafka::source::{LAG_INTERVAL, STALL_AFTER};
    let Some(bootstrap) = bootstrap() else { return };
    let _one = ONE_AT_A_TIME.lock().await;
    let topic = unique_topic("stall");
    create_topic(&bootstrap, &topic, PARTITIONS).await;
    let mut produced = Produced::default();
    let mut seq = 0;
    produce(&bootstrap, &topic, &mut seq, 1000, &mut produced);

    let (_dir, mut local) = launch_at_2(
        "kstall",
        &bootstrap,
        &topic,
        "{function: sum, field: amount}",
        "",
    )
    .await;
    let logs = local.log_dir().to_owned();
    let before =
        checkpoint_when_caught_up(&mut local, &topic, &produced, Duration::from_secs(60)).await;
    assert_exact(&before, &topic, &produced, true).await;

    /// Lets the topic's reads go again however the test ends.
    struct Unstall(PathBuf);
    impl Drop for Unstall {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let stall_dir = std::env::temp_dir().join(KAFKA_STALL_DIR);
    std::fs::create_dir_all(&stall_dir).expect("stall dir");
    let marker = stall_dir.join(&topic);
    std::fs::write(&marker, b"").expect("stall marker");
    let unstall = Unstall(marker);
    let stalled_at = Instant::now();
    produce(&bootstrap, &topic, &mut seq, 1000, &mut produced);

    // Not before STALL_AFTER (the source polls and gets nothing, records wait at the brokers),
    // and not long after it (a lag measurement or two), a worker fails its run.
    let (index, exit) = loop {
        if let Some(failed) = local.failed_worker() {
            break failed;
        }
        assert!(
            stalled_at.elapsed() < STALL_AFTER + 10 * LAG_INTERVAL + Duration::from_secs(20),
            "no worker failed its run {:?} after its source stopped fetching",
            stalled_at.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let took = stalled_at.elapsed();
    assert!(
        took >= STALL_AFTER,
        "failed after {took:?}, before STALL_AFTER"
    );
    eprintln!("worker {index} failed its run after {took:?}: {exit}");
    // Its log says which partition and what happens next.
    let mut said = String::new();
    for entry in std::fs::read_dir(&logs).expect("logs") {
        let text = std::fs::read_to_string(entry.expect("log").path()).unwrap_or_default();
        if let Some(line) = text
            .lines()
            .find(|l| l.contains("has fetched nothing past offset"))
        {
            said = line.to_owned();
        }
    }
    assert!(
        said.contains(&format!("Kafka partition {topic}/"))
            && said.contains("has records up to offset")
            && said.contains("restarting from the latest checkpoint with a new Kafka consumer"),
        "the failure names the partition and the remedy: {said:?}"
    );

    // The consumer of the next run fetches again.
    drop(unstall);
    local.recover(2).await.expect("recover");
    let after =
        checkpoint_when_caught_up(&mut local, &topic, &produced, Duration::from_secs(90)).await;
    assert_exact(&after, &topic, &produced, true).await;
    local.shutdown().await.expect("stop");
}

/// Produces heartbeats to `topic`, each device's to its own partition (in order), and waits
/// until the broker acknowledged them all.
fn produce_heartbeats(
    bootstrap: &str,
    topic: &str,
    beats: &[keyshift_examples::silence::Heartbeat],
) {
    let producer: ThreadedProducer<DefaultProducerContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .create()
        .expect("producer");
    for b in beats {
        let payload = serde_json::to_string(b).expect("heartbeat serializes");
        let partition = programs_support::partition_of(&b.device, PARTITIONS as u64) as i32;
        send(
            &producer,
            BaseRecord::to(topic)
                .key(b.device.as_str())
                .payload(payload.as_str())
                .partition(partition),
        );
    }
    producer
        .flush(Duration::from_secs(60))
        .expect("every record acknowledged");
}

/// A program (the `silence-alert` example keyshift's worker carries) over a Kafka topic: its
/// alerts published exactly once through a checkpoint, a killed worker, a rescale up past and
/// down below the partition count, and a stop, against the oracle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_program_reads_a_kafka_topic_exactly_once_through_rescales_and_a_killed_worker() {
    let Some(bootstrap) = bootstrap() else {
        return;
    };
    let _one = ONE_AT_A_TIME.lock().await;
    let topic = unique_topic("heartbeats");
    create_topic(&bootstrap, &topic, PARTITIONS).await;
    let fleet = programs_support::fleet();
    let (phases, records) = programs_support::phases(&fleet, PARTITIONS as u64);
    produce_heartbeats(&bootstrap, &topic, &phases[0]);
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("out");
    let spec: StreamJob = serde_yaml::from_str(&format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {{name: alerts, namespace: test}}
spec:
  replicas: 2
  maxParallelism: 64
  job:
    program: {{name: silence-alert, maxOutOfOrderness: 2s}}
    source:
      kafka:
        bootstrapServers: '{bootstrap}'
        topics: [{topic}]
    sink: {{type: objectStore, url: 'file://{}'}}
  state:
    checkpointInterval: 1h
",
        out.display()
    ))
    .expect("manifest parses");
    let storage = format!("file://{}", dir.path().join("state").display());
    let mut local = LocalJob::new(&spec, storage, bin(), dir.path().join("logs"))
        .await
        .expect("job prepares");
    local.launch(2, None).await.expect("launch at 2");
    let settle = Duration::from_secs(3);
    tokio::time::sleep(settle).await;
    let first = local.checkpoint().await.expect("first checkpoint");
    assert_eq!(first.manifest.state_schema, keyshift::job::PROGRAM_SCHEMA);
    produce_heartbeats(&bootstrap, &topic, &phases[1]);
    tokio::time::sleep(settle).await;
    local.kill_worker(1).await;
    local.recover(2).await.expect("recover");
    tokio::time::sleep(settle).await;
    local.rescale(6).await.expect("rescale past the partitions");
    produce_heartbeats(&bootstrap, &topic, &phases[2]);
    tokio::time::sleep(settle).await;
    local.rescale(1).await.expect("rescale to 1");
    produce_heartbeats(&bootstrap, &topic, &phases[3]);
    tokio::time::sleep(settle).await;
    let sp = local.shutdown().await.expect("stop with a savepoint");
    let watermark = sp
        .manifest
        .watermark
        .expect("the savepoint has a watermark");
    assert!(
        watermark >= fleet.duration_ms + fleet.silence_ms,
        "event time passed every watch (watermark {watermark})"
    );
    programs_support::assert_alerts(&[&out], &records, fleet.silence_ms, watermark);
}

/// Records a partition's retention deleted before the job read them are said, never skipped
/// silently: a job stops with a savepoint, more records arrive, the earliest of them on
/// partition 0 are deleted (as retention would), and the job resumes from the savepoint. Its
/// source starts partition 0 at the earliest record left; the start reports the lost offsets
/// (`records_expired`, which the operator turns into a SourceRecordsExpired Event), and the
/// state counts every record but those, each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_deleted_before_the_job_read_them_are_reported_not_skipped_silently() {
    let Some(bootstrap) = bootstrap() else { return };
    let _one = ONE_AT_A_TIME.lock().await;
    let topic = unique_topic("expired");
    create_topic(&bootstrap, &topic, PARTITIONS).await;
    let mut produced = Produced::default();
    let mut seq = 0;
    produce(&bootstrap, &topic, &mut seq, 2_000, &mut produced);
    let (dir, mut local) =
        launch_at_2("expired", &bootstrap, &topic, "{function: count}", "").await;
    checkpoint_when_caught_up(&mut local, &topic, &produced, Duration::from_secs(60)).await;
    let stopped = local.shutdown().await.expect("stop with a savepoint");
    let (_, at_stop) = snapshot(&stopped.url, &topic).await;

    // More records, then the first 100 of them on partition 0 deleted.
    produce(&bootstrap, &topic, &mut seq, 2_000, &mut produced);
    let from = at_stop[&0];
    let to = from + 100;
    assert!(
        produced.ends()[&0] > to,
        "partition 0 has records past the deleted ones"
    );
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .expect("admin client");
    let mut deleted = rdkafka::TopicPartitionList::new();
    deleted
        .add_partition_offset(&topic, 0, rdkafka::Offset::Offset(to as i64))
        .expect("partition offset");
    let r = admin
        .delete_records(
            &deleted,
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
        )
        .await
        .expect("delete records");
    for t in r.elements() {
        assert!(t.error().is_ok(), "records deleted: {t:?}");
    }

    let storage = format!("file://{}", dir.path().join("state").display());
    let spec = job_yaml("expired", &bootstrap, &topic, 2, "{function: count}", "");
    let mut resumed = LocalJob::new(&spec, storage, bin(), dir.path().join("logs2"))
        .await
        .expect("job prepares");
    resumed
        .launch(2, Some(stopped.url.clone()))
        .await
        .expect("resume from the savepoint");
    let expired: Vec<_> = resumed
        .status()
        .await
        .expect("status")
        .into_iter()
        .flat_map(|s| s.started.map(|r| r.records_expired).unwrap_or_default())
        .collect();
    assert_eq!(expired.len(), 1, "{expired:?}");
    assert_eq!(
        (
            expired[0].partition.as_str(),
            expired[0].from,
            expired[0].to
        ),
        (format!("{topic}/0").as_str(), from, to)
    );
    let url =
        checkpoint_when_caught_up(&mut resumed, &topic, &produced, Duration::from_secs(60)).await;
    let (values, _) = snapshot(&url, &topic).await;
    let counted: i64 = values.values().sum();
    let all: u64 = produced.ends().values().sum();
    assert_eq!(
        counted as u64,
        all - 100,
        "every record but the 100 deleted, once"
    );
    drop(resumed.shutdown().await);
}
