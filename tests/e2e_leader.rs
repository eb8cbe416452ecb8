//! Leader election (`keyshift::leader`) against the real kube-apiserver of the test control plane
//! (`hack/testenv.sh`): several candidates in one process, exactly one leads; a crashed leader
//! is replaced once its lease expires, a leader that steps down is replaced at once, and a
//! leader whose lease is taken notices. Run by `hack/test.sh`; by hand:
//! `eval "$(hack/testenv.sh up)"` then `cargo test --test e2e_leader -- --ignored`.

mod support;

use k8s_openapi::api::coordination::v1::Lease;
use keyshift::leader::{LeaderConfig, LeaderError, LeaderHandle};
use kube::api::{Api, PostParams};
use std::time::Duration;
use support::*;
use tokio::time::{Instant, sleep};

/// Short leases keep the tests quick: renewals every 2 s, a leader gives up after 4 s.
const LEASE: Duration = Duration::from_secs(6);
const LEASE_NAME: &str = "keyshift-operator";

async fn client() -> kube::Client {
    keyshift::telemetry::install_crypto_provider();
    let path = kubeconfig();
    let kubeconfig = kube::config::Kubeconfig::read_from(&path).expect("kubeconfig parses");
    let config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .expect("kubeconfig is usable");
    kube::Client::try_from(config).expect("client")
}

fn candidate(client: &kube::Client, ns: &str, name: &str) -> LeaderHandle {
    let config = LeaderConfig::new(ns, LEASE_NAME, name).with_lease_duration(LEASE);
    LeaderHandle::spawn(client.clone(), config).expect("valid settings")
}

async fn holder(client: &kube::Client, ns: &str) -> Option<String> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    leases
        .get_opt(LEASE_NAME)
        .await
        .expect("reading the lease")
        .and_then(|l| l.spec)
        .and_then(|s| s.holder_identity)
}

async fn transitions(client: &kube::Client, ns: &str) -> i32 {
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    leases
        .get(LEASE_NAME)
        .await
        .expect("reading the lease")
        .spec
        .and_then(|s| s.lease_transitions)
        .unwrap_or_default()
}

/// Waits until exactly one of `candidates` leads; returns its index.
async fn one_leader(candidates: &[&LeaderHandle], within: Duration) -> usize {
    let start = Instant::now();
    loop {
        let leading: Vec<usize> = (0..candidates.len())
            .filter(|&i| candidates[i].is_leader())
            .collect();
        assert!(
            leading.len() <= 1,
            "two candidates lead at once: {leading:?}"
        );
        if let [i] = leading[..] {
            return i;
        }
        assert!(
            start.elapsed() < within,
            "no leader within {within:?} ({:?} elapsed)",
            start.elapsed()
        );
        sleep(Duration::from_millis(50)).await;
    }
}

/// Over `period`, exactly `candidates[leader]` leads at every sample and the Lease names it.
async fn stays_the_only_leader(
    client: &kube::Client,
    ns: &str,
    candidates: &[&LeaderHandle],
    leader: usize,
    period: Duration,
) {
    let start = Instant::now();
    while start.elapsed() < period {
        for (i, c) in candidates.iter().enumerate() {
            assert_eq!(
                c.is_leader(),
                i == leader,
                "candidate {i} ({}) leader={} at {:?}",
                c.identity(),
                c.is_leader(),
                start.elapsed()
            );
        }
        assert_eq!(
            holder(client, ns).await.as_deref(),
            Some(candidates[leader].identity())
        );
        sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the test control plane (hack/test.sh starts it)"]
async fn two_candidates_one_leader_and_takeover_after_a_crash() {
    let _plane = shared_plane();
    keyshift::telemetry::init(keyshift::telemetry::LogFormat::Text);
    let ns = Namespace::new("e2e-leader-crash");
    let client = client().await;
    let a = candidate(&client, &ns.0, "candidate-a");
    let b = candidate(&client, &ns.0, "candidate-b");
    let first = one_leader(&[&a, &b], LEASE * 2).await;
    // Several renewals later, still exactly one, and it is the Lease's holder.
    stays_the_only_leader(&client, &ns.0, &[&a, &b], first, LEASE * 2).await;
    let before = transitions(&client, &ns.0).await;

    // The leader crashes (no release): the other takes over once the lease expires, and not
    // before. The last renewal happened at most one renew interval (LEASE/3) before the crash.
    let (leader, standby) = if first == 0 { (a, b) } else { (b, a) };
    let crashed = leader.identity().to_owned();
    let mut lost = standby.subscribe();
    let killed = Instant::now();
    leader.abandon();
    assert_eq!(
        holder(&client, &ns.0).await.as_deref(),
        Some(crashed.as_str())
    );
    tokio::time::timeout(LEASE + LEASE / 3 + Duration::from_secs(3), async {
        lost.wait_for(|l| *l).await.expect("standby still runs");
    })
    .await
    .expect("the standby takes over within the lease duration (plus one renew interval)");
    // Not before the lease could have expired: the last renewal was at most about one renew
    // interval before the crash (half the lease leaves room for a slow, shared machine; taking
    // an unreleased lease any sooner would be a bug).
    let took = killed.elapsed();
    assert!(
        took >= LEASE / 2,
        "took over after {took:?}: before the crashed leader's lease could have expired"
    );
    assert_eq!(
        holder(&client, &ns.0).await.as_deref(),
        Some(standby.identity())
    );
    assert_eq!(transitions(&client, &ns.0).await, before + 1);
    standby.step_down().await.expect("clean step-down");
    assert_eq!(holder(&client, &ns.0).await, None, "released on step-down");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the test control plane (hack/test.sh starts it)"]
async fn a_leader_that_steps_down_is_replaced_at_once() {
    let _plane = shared_plane();
    keyshift::telemetry::init(keyshift::telemetry::LogFormat::Text);
    let ns = Namespace::new("e2e-leader-handover");
    let client = client().await;
    let a = candidate(&client, &ns.0, "candidate-a");
    let b = candidate(&client, &ns.0, "candidate-b");
    let first = one_leader(&[&a, &b], LEASE * 2).await;
    let (leader, standby) = if first == 0 { (a, b) } else { (b, a) };
    let lost = leader.lost();
    let start = Instant::now();
    leader.step_down().await.expect("clean step-down");
    tokio::time::timeout(Duration::from_secs(1), lost)
        .await
        .expect("lost() resolves on step-down");
    // A released lease is taken at the standby's next look: within one renew interval.
    let mut rx = standby.subscribe();
    tokio::time::timeout(LEASE / 3 + Duration::from_secs(2), rx.wait_for(|l| *l))
        .await
        .expect("the standby takes over a released lease without waiting for expiry")
        .expect("standby runs");
    assert!(start.elapsed() < LEASE, "took {:?}", start.elapsed());
    stays_the_only_leader(&client, &ns.0, &[&standby], 0, LEASE / 2).await;
    standby.step_down().await.expect("clean step-down");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the test control plane (hack/test.sh starts it)"]
async fn many_candidates_racing_for_a_new_lease_elect_one() {
    let _plane = shared_plane();
    keyshift::telemetry::init(keyshift::telemetry::LogFormat::Text);
    let ns = Namespace::new("e2e-leader-race");
    let client = client().await;
    let all: Vec<LeaderHandle> = (0..5)
        .map(|i| candidate(&client, &ns.0, &format!("racer-{i}")))
        .collect();
    let refs: Vec<&LeaderHandle> = all.iter().collect();
    let leader = one_leader(&refs, LEASE * 2).await;
    stays_the_only_leader(&client, &ns.0, &refs, leader, LEASE).await;
    for c in all {
        c.step_down().await.expect("clean step-down");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the test control plane (hack/test.sh starts it)"]
async fn a_leader_whose_lease_is_taken_stops_leading() {
    let _plane = shared_plane();
    keyshift::telemetry::init(keyshift::telemetry::LogFormat::Text);
    let ns = Namespace::new("e2e-leader-taken");
    let client = client().await;
    let mut a = candidate(&client, &ns.0, "candidate-a");
    tokio::time::timeout(LEASE * 2, a.wait_for_leadership())
        .await
        .expect("a lone candidate leads")
        .expect("no error");
    let lost = a.lost();

    // Someone else writes itself into the lease (as a buggy or foreign elector might).
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.0);
    let mut lease = leases.get(LEASE_NAME).await.expect("lease exists");
    if let Some(spec) = lease.spec.as_mut() {
        spec.holder_identity = Some("intruder".into());
    }
    leases
        .replace(LEASE_NAME, &PostParams::default(), &lease)
        .await
        .expect("overwriting the holder");

    tokio::time::timeout(LEASE / 3 + Duration::from_secs(2), lost)
        .await
        .expect("the leader notices at its next renewal");
    assert!(!a.is_leader());
    match a.step_down().await {
        Err(LeaderError::Lost { reason, .. }) => {
            assert!(reason.contains("intruder"), "{reason}")
        }
        other => panic!("expected Lost, got {other:?}"),
    }
    // It did not release (or overwrite) the intruder's lease.
    assert_eq!(holder(&client, &ns.0).await.as_deref(), Some("intruder"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the test control plane (hack/test.sh starts it)"]
async fn run_while_leading_runs_work_only_while_leading() {
    let _plane = shared_plane();
    use keyshift::leader::{Led, run_while_leading};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    keyshift::telemetry::init(keyshift::telemetry::LogFormat::Text);
    let ns = Namespace::new("e2e-leader-work");
    let client = client().await;
    let config = |id: &str| LeaderConfig::new(&ns.0, LEASE_NAME, id).with_lease_duration(LEASE);

    // Someone else leads: a standby told to shut down never starts its work.
    let mut other = candidate(&client, &ns.0, "other");
    other.wait_for_leadership().await.expect("other leads");
    let started = Arc::new(AtomicBool::new(false));
    let flag = started.clone();
    let led = run_while_leading(
        client.clone(),
        config("standby"),
        sleep(Duration::from_secs(1)),
        move || async move { flag.store(true, Ordering::SeqCst) },
    )
    .await
    .expect("no error");
    assert!(matches!(led, Led::ShutDownWhileStandingBy));
    assert!(!started.load(Ordering::SeqCst), "work never started");
    other.step_down().await.expect("clean step-down");

    // Work that finishes: its result comes back and the Lease is released.
    let led = run_while_leading(
        client.clone(),
        config("worker"),
        std::future::pending(),
        || async { 42 },
    )
    .await
    .expect("no error");
    assert!(matches!(led, Led::Finished(42)));
    assert_eq!(holder(&client, &ns.0).await, None, "released");

    // Leadership lost mid-work: the work is dropped and the error says why.
    let task = tokio::spawn(run_while_leading(
        client.clone(),
        config("loser"),
        std::future::pending(),
        std::future::pending::<()>,
    ));
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.0);
    let start = Instant::now();
    loop {
        if holder(&client, &ns.0).await.as_deref() == Some("loser") {
            break;
        }
        assert!(start.elapsed() < LEASE * 2, "loser never led");
        sleep(Duration::from_millis(100)).await;
    }
    let mut lease = leases.get(LEASE_NAME).await.expect("lease exists");
    if let Some(spec) = lease.spec.as_mut() {
        spec.holder_identity = Some("intruder".into());
    }
    leases
        .replace(LEASE_NAME, &PostParams::default(), &lease)
        .await
        .expect("overwriting the holder");
    let r = tokio::time::timeout(LEASE, task)
        .await
        .expect("returns once the loss is noticed")
        .expect("task ran");
    assert!(
        matches!(r, Err(LeaderError::Lost { .. })),
        "expected Lost, got {r:?}"
    );
}
