//! End to end with Kafka: `keyshift operator` (a host process) runs a Kafka -> keyed count ->
//! Kafka job on the test cluster's real node (the keyshift image, Pod Security `restricted`),
//! against the Kafka test broker (`hack/kafka.sh`). The workers reach the broker on its pods'
//! listener, which requires SASL PLAIN: the workers get the username and password from a Secret
//! through their environment, and the operator, whose coordinator publishes the sink's
//! transactions, reads the same Secret through the API. The test produces click records with
//! known per-user counts and checks, as a `read_committed` consumer of the output topic, that the
//! newest count of every user is exactly the number of records produced for that user, after
//! `kubectl scale` up and down, a killed worker, an operator restart and a broker restart, with
//! records arriving throughout.
//!
//! A second test runs a user's own job the same way: the job template's image (its own worker
//! binary, `crates/keyshift-job-template`) with its program `threshold` over a Kafka topic, its
//! output on the object-store sink, checked against crossings computed from the input.
//!
//! Run by `hack/test.sh` (which starts the broker with its pods' listener, then the cluster).
#![cfg(feature = "kafka")]

mod kafka_support;
mod operator_support;
mod snapshot_support;
mod support;

use kafka_support::*;
use keyshift::keygroup::Key;
use operator_support::*;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use support::*;

/// The broker as the test process reaches it (loopback, no authentication), and as pods reach
/// it (the host's address in the test network, SASL PLAIN): bootstrap, username, password.
fn broker() -> (String, String, String, String) {
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} (hack/test.sh)"));
    (
        var("KEYSHIFT_KAFKA_BOOTSTRAP"),
        var("KEYSHIFT_KAFKA_POD_BOOTSTRAP"),
        var("KEYSHIFT_KAFKA_POD_USERNAME"),
        var("KEYSHIFT_KAFKA_POD_PASSWORD"),
    )
}

const CREDENTIALS: &str = "kafka-creds";

/// Secret CREDENTIALS in `ns`: the pods' SASL username and password for the broker.
fn credentials_secret(ns: &str, username: &str, password: &str) {
    kubectl_ok(&[
        "create",
        "secret",
        "generic",
        CREDENTIALS,
        "-n",
        ns,
        &format!("--from-literal=username={username}"),
        &format!("--from-literal=password={password}"),
    ]);
}

fn kafka_job_yaml(name: &str, pods: &str, input: &str, output: &str) -> String {
    let creds = format!("{{secretName: {CREDENTIALS}, sasl: {{mechanism: PLAIN}}}}");
    format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata:
  name: {name}
spec:
  replicas: 2
  maxParallelism: 64
  job:
    source:
      kafka: {{bootstrapServers: '{pods}', topics: [{input}], credentials: {creds}}}
    key: {{field: user, type: string}}
    aggregation: {{function: count}}
    sink:
      type: kafka
      kafka: {{bootstrapServers: '{pods}', topic: {output}, credentials: {creds}}}
  state:
    checkpointInterval: 3s
    credentialsSecret: {S3_SECRET}
  resources:
    requests: {{cpu: 5m, memory: 32Mi}}
"
    )
}

/// Waits (3 minutes at most) until job `name` has read all `produced` records of `input` and
/// committed them with a snapshot.
fn wait_read_all(
    bootstrap: &str,
    ns: &str,
    name: &str,
    input: &str,
    produced: u64,
    log: &std::path::Path,
) {
    let started = Instant::now();
    loop {
        let read = read_by_job(bootstrap, ns, name, input);
        if read == produced {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(180),
            "the job read {read} of {produced} records\n{}",
            diagnostics(ns, name, log)
        );
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Records read so far by the job, as its consumer group has them committed (after snapshots).
fn read_by_job(bootstrap: &str, ns: &str, name: &str, input: &str) -> u64 {
    committed(
        bootstrap,
        &keyshift::job::kafka::default_group_id(ns, name),
        input,
    )
    .values()
    .sum()
}

#[test]
#[ignore = "needs the test control plane and the Kafka test broker (hack/test.sh starts both)"]
fn kafka_to_kafka_is_exact_through_scale_a_killed_worker_and_operator_and_broker_restarts() {
    let _plane = shared_plane();
    let (host, pods, username, password) = broker();
    let (ns, dir, mut op) = setup("e2e-kafka", "kafka");
    let ns = &ns.0;
    let log = op.log.clone();
    let name = "clicks-kafka";
    credentials_secret(ns, &username, &password);
    let input = unique("e2e-in");
    let output = unique("e2e-out");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(create_topic(&host, &input));
    rt.block_on(create_topic(&host, &output));

    let mut totals: BTreeMap<Key, i64> = BTreeMap::new();
    let mut produced = 0u64;
    let mut produce = |n: u64, totals: &mut BTreeMap<Key, i64>| {
        produce_clicks(&host, &input, produced, n, totals);
        produced += n;
    };
    produce(4000, &mut totals);
    let r = apply(ns, &kafka_job_yaml(name, &pods, &input, &output));
    assert!(r.ok, "{}", r.stderr);
    wait_ready(ns, name, &log);
    assert_eq!(
        get(
            ns,
            name,
            "{.status.conditions[?(@.type==\"AllSubtasksHavePartitions\")].status}"
        ),
        "True",
        "4 partitions for 2 subtasks (from the broker's metadata)"
    );

    // Up while records arrive.
    produce(3000, &mut totals);
    scale(ns, name, 3, &log);
    produce(3000, &mut totals);

    // A killed worker: the job restarts from its last checkpoint at the same parallelism.
    kill_a_worker(ns, name, &log);
    produce(3000, &mut totals);

    // The operator restarts: it adopts the running workers and goes on publishing.
    op.kill();
    let adopted = worker_pods(ns, name);
    let mut op = Operator::start(ns, &dir);
    std::thread::sleep(Duration::from_secs(3));
    wait_ready(ns, name, &log);
    assert_eq!(worker_pods(ns, name), adopted, "workers were adopted");

    // The broker restarts (a clean stop and start on the same ports and data) mid-run.
    kafka_sh(&["restart"]);
    produce(3000, &mut totals);

    // Down to 1 while records arrive.
    scale(ns, name, 1, &log);
    produce(2000, &mut totals);

    // Every record read and committed by a snapshot, then a final savepoint (suspend): its
    // output is the last the sink publishes.
    wait_read_all(&host, ns, name, &input, produced, &log);
    // Caught up: the consumer lag in status comes from the broker's metadata (4 partitions, 0
    // records behind), and the brokers are reachable.
    wait_for(Duration::from_secs(90), || {
        get(ns, name, "{.status.source.lag.records}") == "0"
            && get(ns, name, "{.status.source.lag.partitions}") == "4"
    });
    assert_eq!(
        get(
            ns,
            name,
            "{.status.conditions[?(@.type==\"KafkaReachable\")].status}"
        ),
        "True"
    );
    set_suspend(ns, name, true, &log);
    let url = get(ns, name, "{.status.lastSavepoint.path}");
    let state = snapshot_support::read_state_blocking(&url);
    assert_eq!(
        state.positions.values().sum::<u64>(),
        produced,
        "the final savepoint's offsets cover every record"
    );
    assert!(
        state.scalars() == totals,
        "the final savepoint's counts differ from the records produced"
    );

    // The output topic, read_committed: each user's newest count is its total; counts only grow
    // (nothing duplicated or from an aborted transaction); every key in its Java partition.
    let records = read_topic(&host, &output, true);
    let newest = newest_counts(&records);
    let wrong: Vec<_> = totals
        .iter()
        .filter(|(k, v)| newest.get(*k) != Some(*v))
        .take(5)
        .map(|(k, v)| (k, v, newest.get(k)))
        .collect();
    assert!(
        wrong.is_empty() && newest.len() == totals.len(),
        "newest counts in the output topic differ from the records produced, e.g. {wrong:?}"
    );
    eprintln!(
        "{produced} records in, {} records out for {} users (hot user {})",
        records.len(),
        newest.len(),
        totals[&Key::String("hot".into())]
    );
    delete_job(ns, name, &log);
    op.kill();
    let _ = std::fs::remove_dir_all(&dir);
}

/// The job template's threshold (`THRESHOLD` in crates/keyshift-job-template/src/main.rs).
const THRESHOLD: i64 = 1_000;

/// Payment `i`: its account (of 240), amount and event time. Account `n`'s amounts average
/// about `n / 2`, so accounts cross the threshold early, late or never; some amounts are
/// refunds (not positive), which the job's filter drops.
fn payment(i: u64) -> (String, i64, i64) {
    let h = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 16;
    let n = h % 240;
    let amount = ((h >> 12) % (30 + n)) as i64 - 6;
    (format!("account-{n}"), amount, 1_700_000_000_000 + i as i64)
}

/// Produces payments `from..from + n` to `topic`, each account's to one partition (so its
/// payments are read in order), adding each account's crossings of [`THRESHOLD`] to `crossings`
/// (what the job must publish, once each: account, total, payment time), with the running
/// totals in `totals`.
fn produce_payments(
    bootstrap: &str,
    topic: &str,
    from: u64,
    n: u64,
    totals: &mut BTreeMap<String, i64>,
    crossings: &mut Vec<(String, i64, i64)>,
) {
    let records: Vec<(String, String, i32)> = (from..from + n)
        .map(|i| {
            let (account, amount, ts) = payment(i);
            if amount > 0 {
                let total = totals.entry(account.clone()).or_insert(0);
                let before = *total;
                *total += amount;
                if before < THRESHOLD && *total >= THRESHOLD {
                    crossings.push((account.clone(), *total, ts));
                }
            }
            let payload = format!("{{\"account\":\"{account}\",\"amount\":{amount},\"ts\":{ts}}}");
            let partition = java_partition(&account);
            (account, payload, partition)
        })
        .collect();
    produce_keyed(bootstrap, topic, &records);
}

/// A user's own job on the real node: the job template's image (its own static worker binary,
/// not keyshift's) runs its program `threshold` over a Kafka topic under the operator, through
/// a pre-staged rescale up, a killed worker and a rescale down with payments arriving
/// throughout; a final savepoint, then the published output holds every crossing of the
/// threshold exactly once (its state moved with each rescale: a lost total would miss or
/// repeat a crossing).
#[test]
#[ignore = "needs the test control plane, the job template's image and the Kafka test broker (hack/test.sh)"]
fn a_jobs_own_image_runs_its_program_exactly_once_through_rescales_and_a_killed_worker() {
    let _plane = shared_plane();
    let (host, pods, username, password) = broker();
    let (ns, dir, mut op) = setup("e2e-own-job", "own-job");
    let ns = &ns.0;
    let log = op.log.clone();
    let name = "threshold";
    credentials_secret(ns, &username, &password);
    let input = unique("e2e-payments");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(create_topic(&host, &input));
    let sink = format!("{}-sink/{name}", op.storage);
    let creds = format!("{{secretName: {CREDENTIALS}, sasl: {{mechanism: PLAIN}}}}");
    let manifest = format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata:
  name: {name}
spec:
  image: {image}
  replicas: 2
  maxParallelism: 64
  job:
    program: {{name: threshold}}
    source:
      kafka: {{bootstrapServers: '{pods}', topics: [{input}], credentials: {creds}}}
    sink: {{type: objectStore, url: '{sink}'}}
  state:
    checkpointInterval: 3s
    credentialsSecret: {S3_SECRET}
  resources:
    requests: {{cpu: 5m, memory: 32Mi}}
",
        image = job_image(),
    );

    let (mut totals, mut crossings) = (BTreeMap::new(), Vec::new());
    let mut produced = 0u64;
    let mut produce = |n: u64, totals: &mut BTreeMap<String, i64>, c: &mut Vec<_>| {
        produce_payments(&host, &input, produced, n, totals, c);
        produced += n;
    };
    produce(3000, &mut totals, &mut crossings);
    let r = apply(ns, &manifest);
    assert!(r.ok, "{}", r.stderr);
    wait_ready(ns, name, &log);
    let pod = worker_pods(ns, name)[0].clone();
    assert_eq!(
        jsonpath(ns, &format!("pod/{pod}"), "{.spec.containers[0].image}"),
        job_image(),
        "the workers run the job's own image"
    );

    // Up, pre-staged, while payments arrive.
    produce(3000, &mut totals, &mut crossings);
    scale(ns, name, 3, &log);
    assert!(
        !get(ns, name, "{.status.rescale.prestage.run}").is_empty(),
        "the rescale to 3 was pre-staged"
    );
    assert_eq!(get(ns, name, "{.status.rescale.fallback}"), "");
    produce(3000, &mut totals, &mut crossings);

    // A killed worker: the job restarts from its last checkpoint at the same parallelism.
    kill_a_worker(ns, name, &log);
    produce(3000, &mut totals, &mut crossings);

    // Down to 1 while payments arrive.
    scale(ns, name, 1, &log);
    produce(2000, &mut totals, &mut crossings);

    wait_read_all(&host, ns, name, &input, produced, &log);
    set_suspend(ns, name, true, &log);

    // The published output: every crossing once, nothing else.
    let mut published: BTreeMap<(String, i64, i64), u32> = BTreeMap::new();
    for (_, _, text) in published_parts(&sink) {
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let v: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
            let crossing = (
                v["account"].as_str().expect("account").to_owned(),
                v["total"].as_i64().expect("total"),
                v["ts"].as_i64().expect("ts"),
            );
            *published.entry(crossing).or_insert(0) += 1;
        }
    }
    let want: BTreeMap<(String, i64, i64), u32> =
        crossings.iter().cloned().map(|c| (c, 1)).collect();
    let missing: Vec<_> = want
        .keys()
        .filter(|c| !published.contains_key(*c))
        .take(5)
        .collect();
    let wrong: Vec<_> = published
        .iter()
        .filter(|(c, n)| want.get(*c) != Some(*n))
        .take(5)
        .collect();
    assert!(
        missing.is_empty() && wrong.is_empty(),
        "{} crossings expected, {} published; missing e.g. {missing:?}; extra or repeated e.g. {wrong:?}",
        want.len(),
        published.values().sum::<u32>()
    );
    assert!(
        want.len() > 100,
        "only {} crossings: too few to prove much",
        want.len()
    );
    eprintln!(
        "{produced} payments in, {} crossings out, from the job's own image",
        want.len()
    );
    delete_job(ns, name, &log);
    op.kill();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A join on the real node: keyshift's own image runs the example `order-payments` program
/// (orders joined with their payments by order id: an interval join whose buffers of both
/// sides are keyed state and move together with their order's key group) over a Kafka topic
/// under the operator, through a pre-staged rescale up, a killed worker and a rescale down with
/// events arriving throughout; a final savepoint, then the published output holds every
/// (order, payment) pair of the oracle exactly once (a buffer split from its other side, or
/// lost, would miss pairs; a replay past published output would repeat them).
#[test]
#[ignore = "needs the test control plane, the keyshift image and the Kafka test broker (hack/test.sh)"]
fn a_join_of_orders_and_payments_publishes_each_pair_once_through_rescales_and_a_killed_worker() {
    use keyshift_examples::orders::{self, Event, Paid, Shop};
    let _plane = shared_plane();
    let (host, pods, username, password) = broker();
    let (ns, dir, mut op) = setup("e2e-join", "join");
    let ns = &ns.0;
    let log = op.log.clone();
    let name = "orders";
    credentials_secret(ns, &username, &password);
    let input = unique("e2e-orders");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(create_topic(&host, &input));
    let sink = format!("{}-sink/{name}", op.storage);
    let creds = format!("{{secretName: {CREDENTIALS}, sasl: {{mechanism: PLAIN}}}}");
    let manifest = format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata:
  name: {name}
spec:
  replicas: 2
  maxParallelism: 64
  job:
    program: {{name: order-payments, maxOutOfOrderness: 2s}}
    source:
      kafka: {{bootstrapServers: '{pods}', topics: [{input}], credentials: {creds}}}
    sink: {{type: objectStore, url: '{sink}'}}
  state:
    checkpointInterval: 3s
    credentialsSecret: {S3_SECRET}
  resources:
    requests: {{cpu: 5m, memory: 32Mi}}
"
    );

    let window_ms = keyshift_examples::PAYMENT_WINDOW.as_millis() as i64;
    let shop = Shop {
        orders: 1_500,
        customers: 50,
        step_ms: 400,
        window_ms,
        tier_every_ms: 40_000,
        max_out_of_orderness: 2_000,
        seed: 29,
    };
    let events: Vec<(i64, Event)> = shop
        .events()
        .into_iter()
        .filter(|(_, e)| !matches!(e, Event::Tier(_)))
        .collect();
    // An order and its payments in one partition (by the order's id), in arrival order.
    let records: Vec<(String, String, i32)> = events
        .iter()
        .map(|(_, e)| {
            let order = match e {
                Event::Order(o) => o.id.clone(),
                Event::Payment(p) => p.order.clone(),
                Event::Tier(t) => t.customer.clone(),
            };
            let payload = serde_json::to_string(e).expect("an event serializes");
            let partition = java_partition(&order);
            (order, payload, partition)
        })
        .collect();
    let n = records.len();
    let phase = |i: usize| &records[i * n / 5..(i + 1) * n / 5];

    produce_keyed(&host, &input, phase(0));
    let r = apply(ns, &manifest);
    assert!(r.ok, "{}", r.stderr);
    wait_ready(ns, name, &log);

    // Up, pre-staged, while events arrive.
    produce_keyed(&host, &input, phase(1));
    scale(ns, name, 3, &log);
    assert!(
        !get(ns, name, "{.status.rescale.prestage.run}").is_empty(),
        "the rescale to 3 was pre-staged"
    );
    assert_eq!(get(ns, name, "{.status.rescale.fallback}"), "");
    produce_keyed(&host, &input, phase(2));

    // A killed worker: the job restarts from its last checkpoint at the same parallelism.
    kill_a_worker(ns, name, &log);
    produce_keyed(&host, &input, phase(3));

    // Down to 2 while events arrive.
    scale(ns, name, 2, &log);
    produce_keyed(&host, &input, phase(4));

    wait_read_all(&host, ns, name, &input, n as u64, &log);
    set_suspend(ns, name, true, &log);

    let mut got: Vec<Paid> = published_parts(&sink)
        .iter()
        .flat_map(|(_, _, text)| {
            text.lines()
                .filter(|l| !l.trim().is_empty())
                .map(|l| serde_json::from_str::<Paid>(l).expect("a published pair"))
                .collect::<Vec<_>>()
        })
        .collect();
    got.sort();
    let want = orders::expected_paid(&events, window_ms);
    assert!(
        want.len() > 700,
        "only {} pairs: too few to prove much",
        want.len()
    );
    let missing: Vec<_> = want
        .iter()
        .filter(|p| got.binary_search(p).is_err())
        .take(3)
        .collect();
    assert!(
        got == want,
        "{} pairs expected, {} published; missing e.g. {missing:?}",
        want.len(),
        got.len()
    );
    eprintln!("{n} events in, {} pairs out", want.len());
    delete_job(ns, name, &log);
    op.kill();
    let _ = std::fs::remove_dir_all(&dir);
}
