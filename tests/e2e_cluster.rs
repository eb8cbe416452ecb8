//! End to end against a real kube-apiserver + etcd + kube-controller-manager and the process
//! kubelet (`hack/testenv.sh`): the CRD, its CEL rules, the scale subresource, and pods run as
//! processes. Run by `hack/test.sh`; by hand: `eval "$(hack/testenv.sh up)"` then
//! `cargo test --test e2e_cluster -- --ignored`.

mod support;

use keyshift::validation::*;
use std::time::Duration;
use support::*;

fn sample(name: &str) -> String {
    std::fs::read_to_string(root().join("config/samples").join(name)).expect("sample exists")
}

#[test]
#[ignore = "needs the test control plane (hack/test.sh starts it)"]
fn crd_is_established_and_explained() {
    ensure_crd();
    // The API server publishes the CRD's OpenAPI a moment after it is Established.
    let mut out = String::new();
    wait_for(Duration::from_secs(60), || {
        let r = kubectl(&["explain", "streamjob.spec.replicas"]);
        out = r.stdout;
        r.ok
    });
    assert!(
        out.contains("Parallelism: the number of worker subtasks"),
        "kubectl explain shows our field docs: {out}"
    );
    let out = kubectl_ok(&["explain", "streamjob.spec.maxParallelism"]);
    assert!(out.contains("Key-group count"), "{out}");
    let names = kubectl_ok(&["api-resources", "--api-group=keyshift.dev", "-o", "wide"]);
    assert!(
        names.contains("sj") && names.contains("StreamJob"),
        "{names}"
    );
}

#[test]
#[ignore = "needs the test control plane (hack/test.sh starts it)"]
fn every_sample_applies() {
    ensure_crd();
    let ns = Namespace::new("e2e-samples");
    let dir = root().join("config/samples");
    let mut count = 0;
    for entry in std::fs::read_dir(&dir).expect("samples dir") {
        let path = entry.expect("dir entry").path();
        let r = kubectl(&[
            "apply",
            "-n",
            &ns.0,
            "-f",
            path.to_str().expect("utf-8 path"),
        ]);
        assert!(r.ok, "{} does not apply: {}", path.display(), r.stderr);
        count += 1;
    }
    assert!(count >= 2);
    let listed = kubectl_ok(&["get", "sj", "-n", &ns.0, "-o", "name"]);
    assert_eq!(listed.lines().count(), count, "{listed}");
}

/// A minimal valid StreamJob with `extra` spec lines.
fn job(name: &str, replicas: i32, extra: &str) -> String {
    format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata:
  name: {name}
spec:
  replicas: {replicas}
{extra}
  job:
    source:
      generator: {{partitions: 2, keys: 100}}
    key: {{field: key}}
    aggregation: {{function: count}}
"
    )
}

fn refused(ns: &str, yaml: &str, message: &str) {
    let r = apply(ns, yaml);
    assert!(
        !r.ok,
        "expected refusal with {message:?}, but apply succeeded:\n{yaml}"
    );
    assert!(
        r.stderr.contains(message),
        "expected the API server to say {message:?}, it said: {}",
        r.stderr
    );
}

#[test]
#[ignore = "needs the test control plane (hack/test.sh starts it)"]
fn cel_rules_refuse_bad_manifests_with_their_messages() {
    ensure_crd();
    let ns = Namespace::new("e2e-cel");
    let ns = &ns.0;
    refused(ns, &job("zero", 0, ""), MSG_REPLICAS_MIN);
    refused(
        ns,
        &job("above", 200, "  maxParallelism: 128"),
        MSG_REPLICAS_LE_MAXP,
    );
    refused(
        ns,
        &job("huge", 4, "  maxParallelism: 40000"),
        MSG_MAXP_RANGE,
    );
    refused(
        ns,
        &job(
            "strict",
            3,
            "  maxParallelism: 128\n  keyGroupPolicy: Strict",
        ),
        MSG_STRICT_DIVISOR,
    );
    refused(
        ns,
        &job("badurl", 2, "  state:\n    storage: bucket/prefix"),
        MSG_STORAGE_URL,
    );
    refused(
        ns,
        &job(
            "badinterval",
            2,
            "  state:\n    checkpointInterval: 10 seconds",
        ),
        MSG_CHECKPOINT_INTERVAL,
    );

    // maxParallelism is immutable once set.
    let r = apply(ns, &job("fixed", 4, "  maxParallelism: 128"));
    assert!(r.ok, "{}", r.stderr);
    refused(
        ns,
        &job("fixed", 4, "  maxParallelism: 256"),
        MSG_MAXP_IMMUTABLE,
    );
    // ... except together with a restore from a (rewritten) savepoint.
    let r = apply(
        ns,
        &job(
            "fixed",
            4,
            "  maxParallelism: 256\n  restoreFrom: file:///savepoints/sp-1-rewritten",
        ),
    );
    assert!(
        r.ok,
        "restoreFrom with a new maxParallelism is allowed: {}",
        r.stderr
    );

    // The same rules, mirrored in Rust, agree with what the API server accepted and refused.
    let ok: keyshift::crd::StreamJob =
        serde_yaml::from_str(&job("x", 4, "  maxParallelism: 128")).expect("parses");
    validate(&ok.spec, None, None).expect("valid in Rust too");
}

#[test]
#[ignore = "needs the test control plane (hack/test.sh starts it)"]
fn scale_subresource_and_printer_columns() {
    ensure_crd();
    let ns = Namespace::new("e2e-scale");
    let ns = &ns.0;
    let r = apply(ns, &sample("generator-count.yaml"));
    assert!(r.ok, "{}", r.stderr);
    kubectl_ok(&["scale", "-n", ns, "sj/clicks", "--replicas=8"]);
    assert_eq!(jsonpath(ns, "sj/clicks", "{.spec.replicas}"), "8");

    // The scale subresource reads status.replicas and status.selector.
    kubectl_ok(&[
        "patch",
        "-n",
        ns,
        "sj/clicks",
        "--subresource=status",
        "--type=merge",
        "-p",
        r#"{"status":{"replicas":4,"selector":"keyshift.dev/job=clicks","maxParallelism":128,"phase":"Running"}}"#,
    ]);
    let scale = kubectl_ok(&[
        "get",
        "--raw",
        &format!("/apis/keyshift.dev/v1alpha1/namespaces/{ns}/streamjobs/clicks/scale"),
    ]);
    let scale: serde_json::Value = serde_json::from_str(&scale).expect("scale is JSON");
    assert_eq!(scale["spec"]["replicas"], 8);
    assert_eq!(scale["status"]["replicas"], 4);
    assert_eq!(scale["status"]["selector"], "keyshift.dev/job=clicks");

    // Printer columns.
    let table = kubectl_ok(&["get", "sj", "-n", ns]);
    let header = table.lines().next().unwrap_or_default().to_string();
    for col in [
        "NAME", "DESIRED", "RUNNING", "MAXP", "PHASE", "READY", "AGE",
    ] {
        assert!(header.contains(col), "column {col} missing: {table}");
    }
    let row = table.lines().nth(1).unwrap_or_default();
    assert!(
        row.contains("clicks")
            && row.contains("8")
            && row.contains("128")
            && row.contains("Running"),
        "{table}"
    );

    // A job without spec.maxParallelism: once the ceiling is pinned in status, scaling past it
    // is refused by the API server before anything stops.
    let r = apply(ns, &sample("zipf-hot-key.yaml"));
    assert!(r.ok, "{}", r.stderr);
    kubectl_ok(&[
        "patch",
        "-n",
        ns,
        "sj/hot-keys",
        "--subresource=status",
        "--type=merge",
        "-p",
        r#"{"status":{"maxParallelism":128}}"#,
    ]);
    let r = kubectl(&["scale", "-n", ns, "sj/hot-keys", "--replicas=200"]);
    assert!(!r.ok, "scale past the pinned ceiling must be refused");
    // The message is built by the API server from the object: the ceiling, and the exact
    // commands that raise it (the same text the operator's Stalled condition gives).
    let guidance = keyshift::validation::ceiling_guidance(&keyshift::validation::CeilingContext {
        name: "hot-keys",
        replicas: 200,
        ceiling: 128,
        origin: None,
        suspended_savepoint: None,
    });
    assert!(
        r.stderr.contains(&guidance),
        "{}\nexpected: {guidance}",
        r.stderr
    );
    assert_eq!(jsonpath(ns, "sj/hot-keys", "{.spec.replicas}"), "3");
    kubectl_ok(&["scale", "-n", ns, "sj/hot-keys", "--replicas=128"]);
}

fn pod(name: &str, command: &[&str], restart: &str, stdin: bool) -> String {
    let args: Vec<String> = command.iter().map(|a| format!("{a:?}")).collect();
    format!(
        "apiVersion: v1
kind: Pod
metadata:
  name: {name}
spec:
  restartPolicy: {restart}
  terminationGracePeriodSeconds: 5
  containers:
  - name: main
    image: example.org/acme/keyshift:dev
    stdin: {stdin}
    command: [{}]
",
        args.join(", ")
    )
}

fn phase(ns: &str, name: &str) -> String {
    jsonpath(ns, &format!("pod/{name}"), "{.status.phase}")
}

#[test]
#[ignore = "needs the test control plane (hack/test.sh starts it)"]
fn process_kubelet_runs_pods() {
    let ns = Namespace::new("e2e-kubelet");
    let ns = &ns.0;
    let timeout = Duration::from_secs(60);

    // Succeeds.
    assert!(
        apply(
            ns,
            &pod("version", &["keyshift", "--version"], "Never", false)
        )
        .ok
    );
    wait_for(timeout, || phase(ns, "version") == "Succeeded");
    let code = jsonpath(
        ns,
        "pod/version",
        "{.status.containerStatuses[0].state.terminated.exitCode}",
    );
    assert_eq!(code, "0");
    // Pod addresses come from the node's /16 (10.<KEYSHIFT_SUBNET>.0.0/16, default 213).
    let ip = jsonpath(ns, "pod/version", "{.status.podIP}");
    let host_ip = jsonpath(ns, "pod/version", "{.status.hostIP}");
    let subnet = |a: &str| a.split('.').take(2).collect::<Vec<_>>().join(".");
    assert!(
        !host_ip.is_empty() && subnet(&ip) == subnet(&host_ip) && ip != host_ip,
        "pod gets an address of its own in the node's /16: pod {ip}, node {host_ip}"
    );

    // Fails with its exit code.
    assert!(
        apply(
            ns,
            &pod(
                "fails",
                &[
                    "keyshift",
                    "plan",
                    "--parallelism",
                    "0",
                    "--max-parallelism",
                    "128"
                ],
                "Never",
                false
            )
        )
        .ok
    );
    wait_for(timeout, || phase(ns, "fails") == "Failed");
    let code = jsonpath(
        ns,
        "pod/fails",
        "{.status.containerStatuses[0].state.terminated.exitCode}",
    );
    assert_eq!(code, "1");

    // Images other than keyshift are refused with a clear status.
    let other = pod("other", &["keyshift", "--version"], "Never", false)
        .replace("example.org/acme/keyshift:dev", "busybox:1.36");
    assert!(apply(ns, &other).ok);
    wait_for(timeout, || {
        jsonpath(
            ns,
            "pod/other",
            "{.status.containerStatuses[0].state.waiting.reason}",
        ) == "ErrImagePull"
    });
    let msg = jsonpath(
        ns,
        "pod/other",
        "{.status.containerStatuses[0].state.waiting.message}",
    );
    assert!(msg.contains("busybox:1.36"), "{msg}");

    // A running pod (keygroup reads its attached stdin forever) becomes Ready; deleting it
    // stops its process.
    assert!(
        apply(
            ns,
            &pod(
                "runs",
                &["keyshift", "keygroup", "--max-parallelism", "128"],
                "Always",
                true
            )
        )
        .ok
    );
    wait_for(timeout, || {
        jsonpath(
            ns,
            "pod/runs",
            "{.status.conditions[?(@.type==\"Ready\")].status}",
        ) == "True"
    });
    let id = jsonpath(ns, "pod/runs", "{.status.containerStatuses[0].containerID}");
    let pid: u32 = id
        .strip_prefix("process://")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("container id names the process: {id:?}"));
    assert!(
        std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "process {pid} runs"
    );
    kubectl_ok(&[
        "delete",
        "pod",
        "-n",
        ns,
        "runs",
        "--wait=true",
        "--timeout=60s",
    ]);
    wait_for(Duration::from_secs(10), || {
        !std::path::Path::new(&format!("/proc/{pid}")).exists()
    });

    // restartPolicy OnFailure restarts a failing container and counts it.
    assert!(
        apply(
            ns,
            &pod(
                "restarts",
                &[
                    "keyshift",
                    "plan",
                    "--parallelism",
                    "0",
                    "--max-parallelism",
                    "128"
                ],
                "OnFailure",
                false
            )
        )
        .ok
    );
    wait_for(timeout, || {
        jsonpath(
            ns,
            "pod/restarts",
            "{.status.containerStatuses[0].restartCount}",
        )
        .parse::<u32>()
        .is_ok_and(|n| n >= 1)
    });
}
