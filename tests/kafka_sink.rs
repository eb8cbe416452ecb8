//! The Kafka sink against a real broker (`hack/kafka.sh start`, then `KEYSHIFT_KAFKA_BOOTSTRAP`),
//! through `keyshift local`'s machinery: real worker processes, the real coordinator, the
//! generator source (so nothing here depends on the Kafka source). Every check reads the output
//! topic as a `read_committed` consumer and compares it with the exact results computed from the
//! generator's definition at the final savepoint's positions.
#![cfg(feature = "kafka")]

mod kafka_support;
mod snapshot_support;

use kafka_support::*;
use keyshift::crd::StreamJob;
use keyshift::job::{self, Expected};
use keyshift::keygroup::Key;
use keyshift::local::LocalJob;
use rdkafka::ClientConfig;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_keyshift"))
}

/// Tests hold it shared while they use the broker; the one that stops the broker holds it alone.
static BROKER: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// A job over the generator whose results go to `topic` exactly once.
fn kafka_job(name: &str, bootstrap: &str, topic: &str, agg: &str, window: &str) -> StreamJob {
    serde_yaml::from_str(&format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {{name: {name}, namespace: test}}
spec:
  replicas: 3
  maxParallelism: 128
  job:
    source:
      generator: {{partitions: 4, keys: 300, seed: 13, recordsPerSecond: 4000, distribution: zipf, zipfExponent: 1.2}}
    key: {{field: key}}
    aggregation: {agg}{window}
    sink:
      type: kafka
      kafka: {{bootstrapServers: '{bootstrap}', topic: {topic}}}
  state:
    checkpointInterval: 1h
"
    ))
    .expect("test manifest parses")
}

struct Env {
    dir: tempfile::TempDir,
    storage: String,
}

fn env() -> Env {
    let dir = tempfile::tempdir().expect("temp dir");
    let storage = format!("file://{}", dir.path().join("state").display());
    Env { dir, storage }
}

/// A crashed publisher of the job: a producer with the job's transactional id that wrote
/// records (key `zombie`) in a transaction it never ends. Returns it, still open.
fn zombie(bootstrap: &str, topic: &str, transactional_id: &str) -> BaseProducer {
    let p: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("transactional.id", transactional_id)
        .create()
        .expect("zombie producer");
    p.init_transactions(Duration::from_secs(30))
        .expect("zombie init");
    p.begin_transaction().expect("zombie begin");
    for i in 0..20 {
        let value = format!("{{\"key\":\"zombie\",\"value\":{i}}}");
        p.send(BaseRecord::to(topic).key("zombie").payload(&value))
            .expect("zombie send");
    }
    p.flush(Duration::from_secs(30)).expect("zombie flush");
    p
}

/// The run every test drives: 3 subtasks, a committed checkpoint, a killed worker (the next
/// checkpoint fails), recovery, a rescale to `to`, and a final savepoint. Returns its URL.
async fn crash_and_rescale(local: &mut LocalJob, to: u32) -> String {
    local.launch(3, None).await.expect("launch");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let good = local.checkpoint().await.expect("checkpoint");
    tokio::time::sleep(Duration::from_millis(800)).await;
    local.kill_worker(1).await;
    assert!(
        local.checkpoint().await.is_err(),
        "a checkpoint without worker 1 fails"
    );
    let r = local.recover(3).await.expect("recover");
    assert_eq!(r.restored_from.as_deref(), Some(good.url.as_str()));
    tokio::time::sleep(Duration::from_millis(1200)).await;
    local.rescale(to).await.expect("rescale");
    tokio::time::sleep(Duration::from_millis(800)).await;
    local.shutdown().await.expect("stop with a savepoint").url
}

/// Nothing is left staged once every committed snapshot is published.
fn assert_nothing_staged(env: &Env, job: &str) {
    let staging = env
        .dir
        .path()
        .join("state/test")
        .join(job)
        .join("sink/_staging");
    let left: Vec<_> = std::fs::read_dir(&staging)
        .map(|d| d.filter_map(Result::ok).map(|e| e.path()).collect())
        .unwrap_or_default();
    let files: Vec<_> = left
        .iter()
        .flat_map(|d| std::fs::read_dir(d).into_iter().flatten())
        .collect();
    assert!(
        files.is_empty(),
        "staged output left in {staging:?}: {files:?}"
    );
}

/// Every key lands in the partition Java's producer would pick, and nothing of the zombie's
/// aborted transaction is visible to `read_committed` (though it is in the log).
fn assert_partitioned_and_no_zombie(bootstrap: &str, topic: &str, records: &[Rec]) {
    for r in records {
        assert_ne!(
            r.key, "zombie",
            "a record of an aborted transaction is visible"
        );
        assert_eq!(
            r.partition,
            java_partition(&r.key),
            "key {} is in partition {}, not where murmur2 puts it",
            r.key,
            r.partition
        );
        assert_eq!(
            r.value["key"],
            serde_json::json!(r.key),
            "value and key agree"
        );
    }
    let raw = read_topic(bootstrap, topic, false);
    assert_eq!(
        raw.iter().filter(|r| r.key == "zombie").count(),
        20,
        "the aborted records are in the log (read_uncommitted sees them): the test exercised an abort"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windowed_results_appear_exactly_once_across_a_crash_and_a_rescale() {
    let test = "windowed_results_appear_exactly_once_across_a_crash_and_a_rescale";
    let Some(bootstrap) = bootstrap(test) else {
        return;
    };
    let _broker = BROKER.read().await;
    let env = env();
    let topic = unique("ks-sink-windows");
    create_topic(&bootstrap, &topic).await;
    let spec = kafka_job(
        "kwin",
        &bootstrap,
        &topic,
        "{function: sum, field: value}",
        "\n    window: {size: 500ms}",
    );
    // A publisher of this job that crashed inside a transaction: the job's own publisher fences
    // it before it publishes anything, which aborts its records.
    let zombie = zombie(&bootstrap, &topic, "keyshift.test.kwin.sink");
    let mut local = LocalJob::new(
        &spec,
        env.storage.clone(),
        bin(),
        env.dir.path().join("logs"),
    )
    .await
    .expect("job prepares");
    let sp = crash_and_rescale(&mut local, 2).await;
    assert!(
        zombie.commit_transaction(Duration::from_secs(10)).is_err(),
        "the zombie publisher is fenced"
    );

    let records = read_topic(&bootstrap, &topic, true);
    assert!(!records.is_empty(), "results were published");
    assert_partitioned_and_no_zombie(&bootstrap, &topic, &records);
    let mut seen: BTreeMap<Key, BTreeMap<i64, i64>> = BTreeMap::new();
    for r in &records {
        let start = r.value["window"]["start"].as_i64().expect("window start");
        let value = r.value["value"].as_i64().expect("value");
        let prev = seen
            .entry(Key::String(r.key.clone()))
            .or_default()
            .insert(start, value);
        assert!(
            prev.is_none(),
            "window {start} of {} published twice",
            r.key
        );
    }
    // What was published plus the windows still open in the final savepoint are exactly the
    // expected windows at its positions.
    let state = snapshot_support::read_state(&sp).await;
    let published: usize = seen.values().map(BTreeMap::len).sum();
    for (key, windows) in state.windows() {
        for (start, acc) in windows {
            let prev = seen.entry(key.clone()).or_default().insert(start, acc);
            assert!(
                prev.is_none(),
                "window {start} of {key:?} both published and open"
            );
        }
    }
    let Expected::Windowed(expected) =
        job::expected_results(&spec.spec.job, &state.positions).expect("oracle")
    else {
        panic!("expected windows");
    };
    assert!(
        seen == expected,
        "published + open windows differ from the exact expected windows"
    );
    assert_nothing_staged(&env, "kwin");
    eprintln!(
        "{test}: {} records read_committed, {published} windows published, positions {:?}",
        records.len(),
        state.positions
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_newest_value_of_every_key_is_its_total_across_a_crash_and_a_rescale() {
    let test = "the_newest_value_of_every_key_is_its_total_across_a_crash_and_a_rescale";
    let Some(bootstrap) = bootstrap(test) else {
        return;
    };
    let _broker = BROKER.read().await;
    let env = env();
    let topic = unique("ks-sink-counts");
    create_topic(&bootstrap, &topic).await;
    let spec = kafka_job("kcount", &bootstrap, &topic, "{function: count}", "");
    let zombie = zombie(&bootstrap, &topic, "keyshift.test.kcount.sink");
    let mut local = LocalJob::new(
        &spec,
        env.storage.clone(),
        bin(),
        env.dir.path().join("logs"),
    )
    .await
    .expect("job prepares");
    let sp = crash_and_rescale(&mut local, 4).await;
    drop(zombie);

    let records = read_topic(&bootstrap, &topic, true);
    assert_partitioned_and_no_zombie(&bootstrap, &topic, &records);
    // Partition by partition in offset order, the last record of a key is its newest value.
    let mut newest: BTreeMap<Key, i64> = BTreeMap::new();
    for r in &records {
        let v = r.value["value"].as_i64().expect("value");
        let prev = newest.insert(Key::String(r.key.clone()), v);
        assert!(
            prev.is_none_or(|p| p <= v),
            "a count of {} went down from {prev:?} to {v}: an older result after a newer one",
            r.key
        );
    }
    let state = snapshot_support::read_state(&sp).await;
    let Expected::Global(expected) =
        job::expected_results(&spec.spec.job, &state.positions).expect("oracle")
    else {
        panic!("expected a global aggregate");
    };
    assert_eq!(newest.len(), expected.len(), "every key has a result");
    assert!(
        newest == expected,
        "the newest value of some key differs from its exact total"
    );
    let hot = Key::String("key-0".into());
    assert!(
        expected[&hot] * 10 > expected.values().sum::<i64>(),
        "the hot key carries more than a tenth of the records"
    );
    assert_nothing_staged(&env, "kcount");
    eprintln!(
        "{test}: {} records read_committed for {} keys, hot key {} of {} records",
        records.len(),
        newest.len(),
        expected[&hot],
        expected.values().sum::<i64>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_least_once_loses_nothing_across_a_crash() {
    let test = "at_least_once_loses_nothing_across_a_crash";
    let Some(bootstrap) = bootstrap(test) else {
        return;
    };
    let _broker = BROKER.read().await;
    let env = env();
    let topic = unique("ks-sink-alo");
    create_topic(&bootstrap, &topic).await;
    let mut spec = kafka_job("kalo", &bootstrap, &topic, "{function: count}", "");
    if let Some(k) = spec.spec.job.sink.kafka.as_mut() {
        k.delivery_guarantee = keyshift::crd::KafkaDeliveryGuarantee::AtLeastOnce;
    }
    let mut local = LocalJob::new(
        &spec,
        env.storage.clone(),
        bin(),
        env.dir.path().join("logs"),
    )
    .await
    .expect("job prepares");
    let sp = crash_and_rescale(&mut local, 2).await;
    let records = read_topic(&bootstrap, &topic, true);
    let mut newest: BTreeMap<Key, i64> = BTreeMap::new();
    for r in &records {
        newest.insert(
            Key::String(r.key.clone()),
            r.value["value"].as_i64().expect("value"),
        );
    }
    let state = snapshot_support::read_state(&sp).await;
    let Expected::Global(expected) =
        job::expected_results(&spec.spec.job, &state.positions).expect("oracle")
    else {
        panic!("expected a global aggregate");
    };
    // A replay after the crash writes results again (at least once), but the last result of
    // every key, written at the final savepoint, is its total.
    assert!(
        newest == expected,
        "the newest value of some key differs from its exact total"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_that_cannot_reach_its_brokers_fails_with_their_error_and_keeps_the_snapshot() {
    let env = env();
    // Nothing listens on port 9 of localhost.
    let spec = kafka_job("kdown", "127.0.0.1:9", "nowhere", "{function: count}", "");
    let mut local = LocalJob::new(
        &spec,
        env.storage.clone(),
        bin(),
        env.dir.path().join("logs"),
    )
    .await
    .expect("job prepares");
    local.launch(2, None).await.expect("launch");
    let e = local
        .checkpoint()
        .await
        .expect_err("no snapshot id is handed out while the sink's marker cannot be read");
    let text = e.to_string();
    eprintln!("unreachable brokers: {text}");
    assert!(text.contains("kafka sink"), "{text}");
    assert!(
        text.contains("127.0.0.1:9") || text.contains("Connection refused"),
        "the error says what the client saw: {text}"
    );
    // The KafkaReachable condition names the publisher, its brokers and their error.
    let outages = local.kafka_outages().await.expect("outages");
    assert_eq!(outages.len(), 1, "{outages:?}");
    assert!(
        outages[0].starts_with("the sink's publisher (bootstrap 127.0.0.1:9): kafka sink: "),
        "{outages:?}"
    );
    assert_eq!(
        local.latest_snapshot().await.expect("listing"),
        None,
        "nothing was committed"
    );
    local.stop().await;
}

/// The publisher alone, on staged output in memory: a publisher that restarts between its
/// transaction's commit and the clean-up of the staged parts (a coordinator killed there) reads
/// the marker and produces nothing twice; the next snapshot is produced as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_restarted_between_its_commit_and_its_clean_up_produces_nothing_twice() {
    use keyshift::job::kafka::sink::KafkaPublisher;
    use keyshift::job::staging::{Committed, StagingSink, WriterId};
    use keyshift::job::{RecordKey, ResultRow};
    let test = "a_publisher_restarted_between_its_commit_and_its_clean_up_produces_nothing_twice";
    let Some(bootstrap) = bootstrap(test) else {
        return;
    };
    let _broker = BROKER.read().await;
    let topic = unique("ks-sink-publisher");
    create_topic(&bootstrap, &topic).await;
    let store = object_store::memory::InMemory::new();
    let base = keyshift::snapshot::Path::from("job/sink");
    let stage = |id: u64, values: &[i64]| {
        let mut outs = Vec::new();
        for subtask in 0..2u32 {
            let mut s = StagingSink::new(WriterId {
                subtask,
                parallelism: 2,
            });
            let rows: Vec<ResultRow> = values
                .iter()
                .map(|v| ResultRow {
                    key: RecordKey::string(format!("key-{subtask}-{v}").as_str()),
                    window: None,
                    value: *v,
                })
                .collect();
            s.emit(&rows);
            outs.push(
                s.on_barrier(id, Committed::Through(id - 1))
                    .expect("barrier"),
            );
        }
        outs
    };
    let props: BTreeMap<String, String> =
        [("bootstrap.servers".to_owned(), bootstrap.clone())].into();
    let tid = unique("publisher");
    let first = KafkaPublisher::new(props.clone(), topic.clone(), tid.clone());
    assert_eq!(first.marker().await.expect("marker"), None);
    for out in stage(1, &[1, 2, 3]) {
        keyshift::sink::stage(&store, &base, &out)
            .await
            .expect("stage");
    }
    let p = first.publish(&store, &base, 1).await.expect("publish 1");
    assert_eq!((p.parts, p.records, p.already), (2, 6, false));
    // Snapshot 2 is produced, then its staged parts are back as if the clean-up never ran.
    let two = stage(2, &[4, 5]);
    for out in &two {
        keyshift::sink::stage(&store, &base, out)
            .await
            .expect("stage");
    }
    first.publish(&store, &base, 2).await.expect("publish 2");
    for out in &two {
        keyshift::sink::stage(&store, &base, out)
            .await
            .expect("stage again");
    }
    drop(first);
    let second = KafkaPublisher::new(props, topic.clone(), tid);
    let marker = second.marker().await.expect("marker").expect("a marker");
    assert_eq!((marker.snapshot, marker.records), (2, 4));
    let p = second
        .publish(&store, &base, 2)
        .await
        .expect("publish 2 again");
    assert!(p.already && p.records == 0, "{p:?}");
    for out in stage(3, &[6]) {
        keyshift::sink::stage(&store, &base, &out)
            .await
            .expect("stage");
    }
    let p = second.publish(&store, &base, 3).await.expect("publish 3");
    assert_eq!((p.records, p.already), (2, false));
    assert_eq!(
        keyshift::sink::max_snapshot_id(&store, &base)
            .await
            .expect("ids"),
        0,
        "nothing is left staged"
    );
    let records = read_topic(&bootstrap, &topic, true);
    let mut keys: Vec<&str> = records.iter().map(|r| r.key.as_str()).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "key-0-1", "key-0-2", "key-0-3", "key-0-4", "key-0-5", "key-0-6", "key-1-1", "key-1-2",
            "key-1-3", "key-1-4", "key-1-5", "key-1-6"
        ],
        "every row once"
    );
}

/// Two jobs given the same transactional id: the second job's publisher finds the first job's
/// marker, refuses it (naming the id and the fix) before its producer initialises, so the first
/// job's publisher is not fenced and goes on publishing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_refuses_another_jobs_marker_without_fencing_it() {
    use keyshift::job::kafka::sink::{KafkaPublisher, owner_of};
    use keyshift::job::staging::{Committed, StagingSink, WriterId};
    use keyshift::job::{RecordKey, ResultRow};
    let test = "a_publisher_refuses_another_jobs_marker_without_fencing_it";
    let Some(bootstrap) = bootstrap(test) else {
        return;
    };
    let _broker = BROKER.read().await;
    let topic = unique("ks-sink-shared");
    create_topic(&bootstrap, &topic).await;
    let store = object_store::memory::InMemory::new();
    let base = keyshift::snapshot::Path::from("job/sink");
    let stage = |id: u64| {
        let mut s = StagingSink::new(WriterId {
            subtask: 0,
            parallelism: 1,
        });
        s.emit(&[ResultRow {
            key: RecordKey::string(format!("key-{id}").as_str()),
            window: None,
            value: id as i64,
        }]);
        s.on_barrier(id, Committed::Through(id - 1))
            .expect("barrier")
    };
    let props: BTreeMap<String, String> =
        [("bootstrap.servers".to_owned(), bootstrap.clone())].into();
    let tid = unique("shared");
    let first = KafkaPublisher::new(props.clone(), topic.clone(), tid.clone())
        .owned_by(owner_of("team-a", "clicks"));
    keyshift::sink::stage(&store, &base, &stage(1))
        .await
        .expect("stage");
    first.publish(&store, &base, 1).await.expect("publish 1");
    let other = KafkaPublisher::new(props, topic.clone(), tid.clone())
        .owned_by(owner_of("team-b", "clicks"));
    let e = other
        .marker()
        .await
        .expect_err("another job's marker is refused")
        .to_string();
    assert!(
        e.contains(&tid) && e.contains("another job") && e.contains("transactionalIdPrefix"),
        "{e}"
    );
    // Not fenced: the first job publishes on.
    keyshift::sink::stage(&store, &base, &stage(2))
        .await
        .expect("stage");
    let p = first.publish(&store, &base, 2).await.expect("publish 2");
    assert_eq!((p.records, p.already), (1, false));
    let marker = first.marker().await.expect("marker").expect("a marker");
    assert_eq!(marker.snapshot, 2);
    assert_eq!(marker.owner, Some(owner_of("team-a", "clicks")));
}

/// A snapshot's output is streamed into its transaction, whatever its size: parts of many
/// object-store read chunks (lines cut at chunk boundaries) come out as exactly their records,
/// once; a part that cannot be read to its end fails the publish and commits nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_snapshot_is_streamed_into_one_transaction_and_a_failed_read_commits_nothing() {
    use keyshift::job::kafka::sink::KafkaPublisher;
    use keyshift::job::staging::{Committed, StagingSink, WriterId};
    use keyshift::job::{RecordKey, ResultRow};
    let test =
        "a_large_snapshot_is_streamed_into_one_transaction_and_a_failed_read_commits_nothing";
    let Some(bootstrap) = bootstrap(test) else {
        return;
    };
    let _broker = BROKER.read().await;
    let topic = unique("ks-sink-large");
    create_topic(&bootstrap, &topic).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let store = object_store::local::LocalFileSystem::new_with_prefix(dir.path()).expect("store");
    let base = keyshift::snapshot::Path::from("job/sink");
    const ROWS: i64 = 40_000;
    for subtask in 0..2u32 {
        let mut s = StagingSink::new(WriterId {
            subtask,
            parallelism: 2,
        });
        let rows: Vec<ResultRow> = (0..ROWS)
            .map(|v| ResultRow {
                key: RecordKey::string(format!("key-{subtask}-{v:06}-{}", "x".repeat(40)).as_str()),
                window: None,
                value: v,
            })
            .collect();
        s.emit(&rows);
        let out = s.on_barrier(1, Committed::Through(0)).expect("barrier");
        keyshift::sink::stage(&store, &base, &out)
            .await
            .expect("stage");
    }
    let props: BTreeMap<String, String> =
        [("bootstrap.servers".to_owned(), bootstrap.clone())].into();
    let publisher = KafkaPublisher::new(props, topic.clone(), unique("large"));
    let p = publisher.publish(&store, &base, 1).await.expect("publish");
    assert_eq!((p.parts, p.records, p.already), (2, 2 * ROWS as u64, false));
    let records = read_topic(&bootstrap, &topic, true);
    assert_eq!(records.len(), 2 * ROWS as usize);
    let keys: std::collections::BTreeSet<&str> = records.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(keys.len(), 2 * ROWS as usize, "every row once");

    // Snapshot 2's second part cannot be read: the first part went into the transaction, which
    // is not committed.
    let flaky = keyshift::sink::testing::Flaky::default();
    for subtask in 0..2u32 {
        let mut s = StagingSink::new(WriterId {
            subtask,
            parallelism: 2,
        });
        s.emit(&[ResultRow {
            key: RecordKey::string(format!("late-{subtask}").as_str()),
            window: None,
            value: 1,
        }]);
        let out = s.on_barrier(2, Committed::Through(1)).expect("barrier");
        keyshift::sink::stage(&flaky, &base, &out)
            .await
            .expect("stage");
    }
    flaky.fail_gets("job/sink/_staging/snap-2/part-1");
    let e = publisher
        .publish(&flaky, &base, 2)
        .await
        .expect_err("a part that cannot be read fails the publish");
    assert!(e.to_string().contains("part-1-of-2"), "{e}");
    let marker = publisher.marker().await.expect("marker").expect("a marker");
    assert_eq!(marker.snapshot, 1, "snapshot 2 is not published");
    assert_eq!(
        read_topic(&bootstrap, &topic, true).len(),
        2 * ROWS as usize
    );
}

/// The marker lost on the broker (the bookkeeping group deleted, as its offset expiring after
/// `offsets.retention.minutes` would): a new publisher goes by the job storage's record of the
/// published snapshot and produces nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_marker_lost_on_the_broker_is_not_taken_for_nothing_published() {
    use keyshift::job::kafka::sink::KafkaPublisher;
    use keyshift::job::staging::{Committed, StagingSink, WriterId};
    use keyshift::job::{RecordKey, ResultRow};
    use rdkafka::admin::{AdminClient, AdminOptions};
    use rdkafka::client::DefaultClientContext;
    let test = "a_marker_lost_on_the_broker_is_not_taken_for_nothing_published";
    let Some(bootstrap) = bootstrap(test) else {
        return;
    };
    let _broker = BROKER.read().await;
    let topic = unique("ks-sink-lost-marker");
    create_topic(&bootstrap, &topic).await;
    let store = object_store::memory::InMemory::new();
    let base = keyshift::snapshot::Path::from("job/sink");
    let stage = || {
        let mut s = StagingSink::new(WriterId {
            subtask: 0,
            parallelism: 1,
        });
        s.emit(&[ResultRow {
            key: RecordKey::string("k"),
            window: None,
            value: 1,
        }]);
        s.on_barrier(1, Committed::Through(0)).expect("barrier")
    };
    let props: BTreeMap<String, String> =
        [("bootstrap.servers".to_owned(), bootstrap.clone())].into();
    let tid = unique("lost");
    let first = KafkaPublisher::new(props.clone(), topic.clone(), tid.clone());
    keyshift::sink::stage(&store, &base, &stage())
        .await
        .expect("stage");
    first.publish(&store, &base, 1).await.expect("publish 1");
    drop(first);
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .expect("admin client");
    for r in admin
        .delete_groups(&[tid.as_str()], &AdminOptions::new())
        .await
        .expect("delete the group")
    {
        r.expect("group deleted");
    }
    // Snapshot 1's parts are back (as after a crash before the clean-up), the marker is gone.
    keyshift::sink::stage(&store, &base, &stage())
        .await
        .expect("stage again");
    let second = KafkaPublisher::new(props, topic.clone(), tid);
    assert_eq!(
        second.marker().await.expect("marker"),
        None,
        "the marker is gone"
    );
    let p = second
        .publish(&store, &base, 1)
        .await
        .expect("publish 1 again");
    assert!(p.already && p.records == 0, "{p:?}");
    assert_eq!(
        read_topic(&bootstrap, &topic, true).len(),
        1,
        "produced once"
    );
}

/// Kafka to Kafka: a count per user read from a topic (the Kafka source) and written exactly
/// once to another, through a killed worker, more records, a rescale and a final savepoint taken
/// once every produced record is read: the newest count of every user in the output topic is
/// the number of records produced for that user.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_to_kafka_counts_are_exact_across_a_crash_and_a_rescale() {
    let test = "kafka_to_kafka_counts_are_exact_across_a_crash_and_a_rescale";
    let Some(bootstrap) = bootstrap(test) else {
        return;
    };
    let _broker = BROKER.read().await;
    let env = env();
    let input = unique("ks-k2k-in");
    let output = unique("ks-k2k-out");
    create_topic(&bootstrap, &input).await;
    create_topic(&bootstrap, &output).await;
    let mut totals = BTreeMap::new();
    produce_clicks(&bootstrap, &input, 0, 6000, &mut totals);
    let spec: StreamJob = serde_yaml::from_str(&format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {{name: k2k, namespace: test}}
spec:
  replicas: 2
  maxParallelism: 64
  job:
    source:
      kafka: {{bootstrapServers: '{bootstrap}', topics: [{input}]}}
    key: {{field: user, type: string}}
    aggregation: {{function: count}}
    sink:
      type: kafka
      kafka: {{bootstrapServers: '{bootstrap}', topic: {output}}}
  state:
    checkpointInterval: 1h
"
    ))
    .expect("manifest parses");
    let mut local = LocalJob::new(
        &spec,
        env.storage.clone(),
        bin(),
        env.dir.path().join("logs"),
    )
    .await
    .expect("job prepares");
    local.launch(2, None).await.expect("launch");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let good = local.checkpoint().await.expect("checkpoint");
    local.kill_worker(1).await;
    assert!(
        local.checkpoint().await.is_err(),
        "a checkpoint without worker 1 fails"
    );
    let r = local.recover(2).await.expect("recover");
    assert_eq!(r.restored_from.as_deref(), Some(good.url.as_str()));
    produce_clicks(&bootstrap, &input, 6000, 6000, &mut totals);
    local.rescale(3).await.expect("rescale 2 -> 3");
    // Offsets start at 0 (a plain idempotent producer): caught up when they add up to 12000.
    let started = Instant::now();
    loop {
        let c = local.checkpoint().await.expect("checkpoint");
        let read: u64 = snapshot_support::read_state(&c.url)
            .await
            .positions
            .values()
            .sum();
        if read == 12_000 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(90),
            "not caught up: {read} of 12000 read"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let sp = local.shutdown().await.expect("stop with a savepoint");
    let state = snapshot_support::read_state(&sp.url).await;
    assert_eq!(
        state.scalars(),
        totals,
        "the final savepoint holds the exact counts"
    );

    let records = read_topic(&bootstrap, &output, true);
    let newest = newest_counts(&records);
    assert!(
        newest == totals,
        "the newest count of some user in the output topic differs from the records produced"
    );
    assert_nothing_staged(&env, "k2k");
    eprintln!(
        "{test}: 12000 records in, {} records out for {} users, hot user {}",
        records.len(),
        newest.len(),
        totals[&Key::String("hot".into())]
    );
}

/// The broker is down while a checkpoint commits: its publish fails (the snapshot stays
/// committed, its output pending), the job runs on, and once the broker is back the next commit
/// publishes the pending output first. Nothing is lost or doubled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_committed_while_the_broker_is_down_is_published_once_it_is_back() {
    let test = "output_committed_while_the_broker_is_down_is_published_once_it_is_back";
    let Some(bootstrap) = bootstrap(test) else {
        return;
    };
    if std::env::var("KEYSHIFT_KAFKA_STATE").is_err() {
        eprintln!("SKIPPED {test}: set KEYSHIFT_KAFKA_STATE (hack/kafka.sh start prints it)");
        return;
    }
    let _broker = BROKER.write().await;
    let env = env();
    let topic = unique("ks-sink-restart");
    create_topic(&bootstrap, &topic).await;
    let spec = kafka_job("kdown2", &bootstrap, &topic, "{function: count}", "");
    let mut local = LocalJob::new(
        &spec,
        env.storage.clone(),
        bin(),
        env.dir.path().join("logs"),
    )
    .await
    .expect("job prepares");
    local.launch(2, None).await.expect("launch");
    tokio::time::sleep(Duration::from_millis(800)).await;
    local.checkpoint().await.expect("checkpoint, published");
    /// Starts the broker again however the test ends (it is shared with the tests after it).
    struct Restart;
    impl Drop for Restart {
        fn drop(&mut self) {
            kafka_sh(&["start"]);
        }
    }
    kafka_sh(&["stop"]);
    let restart = Restart;
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The snapshot commits; producing its output fails (after the client's timeout) and waits.
    let down = local
        .checkpoint()
        .await
        .expect("a checkpoint commits without the broker");
    let staged = env
        .dir
        .path()
        .join(format!("state/test/kdown2/sink/_staging/snap-{}", down.id));
    assert!(
        std::fs::read_dir(&staged).is_ok_and(|d| d.count() == 2),
        "the output of snapshot {} waits, staged, in {staged:?}",
        down.id
    );
    // KafkaReachable is False, naming the publisher and the brokers' error.
    let outages = local.kafka_outages().await.expect("outages");
    eprintln!("{test}: outages while down: {outages:?}");
    assert_eq!(outages.len(), 1, "{outages:?}");
    assert!(
        outages[0].starts_with(&format!(
            "the sink's publisher (bootstrap {bootstrap}): kafka sink: "
        )),
        "{outages:?}"
    );
    drop(restart);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = local
        .checkpoint()
        .await
        .expect("checkpoint after the restart");
    assert!(after.id > down.id);
    // Published: the publisher reaches its brokers again.
    assert_eq!(
        local.kafka_outages().await.expect("outages"),
        Vec::<String>::new()
    );
    let sp = local.shutdown().await.expect("stop with a savepoint");
    let records = read_topic(&bootstrap, &topic, true);
    let mut newest: BTreeMap<Key, i64> = BTreeMap::new();
    for r in &records {
        let v = r.value["value"].as_i64().expect("value");
        let prev = newest.insert(Key::String(r.key.clone()), v);
        assert!(
            prev.is_none_or(|p| p <= v),
            "the count of {} went down from {prev:?} to {v}",
            r.key
        );
    }
    let state = snapshot_support::read_state(&sp.url).await;
    let Expected::Global(expected) =
        job::expected_results(&spec.spec.job, &state.positions).expect("oracle")
    else {
        panic!("expected a global aggregate");
    };
    assert!(
        newest == expected,
        "the newest value of some key differs from its exact total"
    );
    assert_nothing_staged(&env, "kdown2");
    eprintln!(
        "{test}: {} records read_committed for {} keys; snapshot {} committed while the broker was down",
        records.len(),
        newest.len(),
        down.id
    );
}
