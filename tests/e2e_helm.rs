//! The Helm chart against the real control plane (`hack/testenv.sh`): `helm install` creates
//! the CRD and the operator's objects, the kubelet runs the operator pod under the chart's
//! ServiceAccount, RBAC allows exactly what the operator needs (checked with `kubectl auth
//! can-i` as that ServiceAccount), `helm upgrade` applies changed values, and `helm uninstall`
//! leaves nothing of the release behind but the CRD. A second test runs real processes (two
//! `keyshift operator` pods of its own) under the chart's ServiceAccount to show its Lease RBAC
//! suffices for leader election and takeover.
//!
//! A third test runs the whole path with the real operator: install, a sample StreamJob to
//! Ready, `kubectl scale`, then two replicas and a leader handover that keeps reconciling.
//!
//! Every pod runs on the test cluster's real node (kubelet + containerd) from the keyshift image
//! built from this checkout (`KEYSHIFT_IMAGE`), in namespaces enforcing Pod Security
//! `restricted`.
//!
//! Run by `hack/test.sh`; by hand: `eval "$(hack/s3-server.sh start)"`, `eval "$(hack/testenv.sh
//! up)"`, then `cargo test --test e2e_helm -- --ignored`.

mod support;

use std::time::Duration;
use support::*;

const CHART: &str = "charts/keyshift";
/// The chart as it last shipped (version 0.1.0, packaged from the landed main of 2026-12-07): the
/// chart users upgrade from.
const PREVIOUS_CHART: &str = "tests/fixtures/charts/keyshift-0.1.0.tgz";

/// `--set` arguments pointing the chart at the image the test node holds.
fn image_values() -> Vec<String> {
    let image = image();
    let (repository, tag) = image.rsplit_once(':').expect("KEYSHIFT_IMAGE is REPO:TAG");
    vec![
        "--set".into(),
        format!("image.repository={repository}"),
        "--set".into(),
        format!("image.tag={tag}"),
    ]
}

/// `kubectl auth can-i VERB RESOURCE [flags]` as `sa`: true for "yes".
fn can(sa: &str, args: &[&str]) -> bool {
    let mut all = vec!["auth", "can-i"];
    all.extend_from_slice(args);
    let r = kubectl(&[&all[..], &["--as", sa]].concat());
    match r.stdout.trim() {
        "yes" => true,
        "no" => false,
        _ => panic!("kubectl auth can-i {args:?}: {}{}", r.stdout, r.stderr),
    }
}

fn assert_can(sa: &str, args: &[&str]) {
    assert!(can(sa, args), "{sa} should be allowed: {args:?}");
}

fn assert_cannot(sa: &str, args: &[&str]) {
    assert!(!can(sa, args), "{sa} should be denied: {args:?}");
}

/// Names (kind/name) of objects of `kinds` labelled with the release, in `ns` (or cluster-wide
/// when `ns` is None).
fn release_objects(release: &str, kinds: &str, ns: Option<&str>) -> Vec<String> {
    let selector = format!("app.kubernetes.io/instance={release}");
    let mut args = vec!["get", kinds, "-l", &selector, "-o", "name"];
    if let Some(ns) = ns {
        args.extend_from_slice(&["-n", ns]);
    }
    kubectl_ok(&args)
        .lines()
        .map(str::to_owned)
        .filter(|l| !l.is_empty())
        .collect()
}

/// The chart's user-facing ClusterRoles (aggregated into view, edit and admin), release "ks".
const AGGREGATED_ROLES: [&str; 2] = [
    "clusterrole.rbac.authorization.k8s.io/ks-keyshift-streamjobs-edit",
    "clusterrole.rbac.authorization.k8s.io/ks-keyshift-streamjobs-view",
];

const NAMESPACED_KINDS: &str =
    "deployments,replicasets,pods,serviceaccounts,services,roles,rolebindings,configmaps,secrets";

fn pods(ns: &str, release: &str) -> Vec<String> {
    release_objects(release, "pods", Some(ns))
}

#[test]
#[ignore = "needs the test control plane (hack/test.sh starts it)"]
fn install_upgrade_uninstall() {
    let _plane = shared_plane();
    let release = "ks";
    let system = Namespace::new("e2e-helm-system");
    let a = Namespace::new("e2e-helm-a");
    let b = Namespace::new("e2e-helm-b");
    let (system, a, b) = (system.0.as_str(), a.0.as_str(), b.0.as_str());
    let sa = format!("system:serviceaccount:{system}:ks-keyshift");
    let sa = sa.as_str();
    let crd = "crd/streamjobs.keyshift.dev";
    let crd_existed = kubectl(&["get", crd]).ok;

    // ---- install, namespaced mode
    let watch = format!(r#"watchNamespaces=["{a}","{b}"]"#);
    let image_args = image_values();
    let mut args = vec!["install", release, CHART, "-n", system];
    args.extend(image_args.iter().map(String::as_str));
    args.extend_from_slice(&["--set-json", &watch]);
    let out = helm_ok(&args);
    assert!(
        out.contains("kubectl -n e2e-helm-a wait --for=condition=Ready streamjob/clicks"),
        "NOTES: {out}"
    );
    // Real commands only: no placeholder a user would have to guess (`<repository>`).
    assert!(
        !out.contains("<repository>") && !out.contains("<new version>"),
        "NOTES: {out}"
    );
    assert!(
        out.contains("kubectl keyshift -n e2e-helm-a status clicks"),
        "NOTES: {out}"
    );

    // The CRD: created by the install unless it was there already; established either way.
    kubectl_ok(&["wait", "--for=condition=Established", crd, "--timeout=60s"]);
    if !crd_existed {
        let managers = kubectl_ok(&[
            "get",
            crd,
            "-o",
            "jsonpath={.metadata.managedFields[*].manager}",
        ]);
        assert!(
            managers.contains("helm"),
            "helm created the CRD: {managers}"
        );
    }

    let objects = release_objects(release, NAMESPACED_KINDS, Some(system));
    for want in [
        "deployment.apps/ks-keyshift",
        "serviceaccount/ks-keyshift",
        "service/ks-keyshift-metrics",
        "role.rbac.authorization.k8s.io/ks-keyshift-leader-election",
        "rolebinding.rbac.authorization.k8s.io/ks-keyshift-leader-election",
    ] {
        assert!(
            objects.contains(&want.to_owned()),
            "{want} missing: {objects:?}"
        );
    }
    for ns in [a, b] {
        let objects = release_objects(release, "roles,rolebindings", Some(ns));
        assert_eq!(
            objects,
            [
                "role.rbac.authorization.k8s.io/ks-keyshift",
                "rolebinding.rbac.authorization.k8s.io/ks-keyshift"
            ],
            "in {ns}"
        );
    }
    assert_eq!(
        release_objects(release, "clusterroles,clusterrolebindings", None),
        AGGREGATED_ROLES,
        "namespaced mode has nothing cluster-wide for the operator: only the user-facing roles"
    );

    // The Deployment's pod (made by kube-controller-manager) is scheduled and started by the
    // kubelet in a container of the image, as the chart's ServiceAccount, with the chart's
    // security context (the namespace enforces Pod Security `restricted`).
    let mut pod = String::new();
    wait_for(Duration::from_secs(90), || {
        let Some(p) = pods(system, release).into_iter().next() else {
            return false;
        };
        pod = p;
        let started = jsonpath(
            system,
            &pod,
            "{.status.containerStatuses[0].state.running.startedAt}{.status.containerStatuses[0].state.terminated.exitCode}{.status.containerStatuses[0].lastState.terminated.exitCode}",
        );
        !started.is_empty()
    });
    assert_eq!(jsonpath(system, &pod, "{.spec.nodeName}"), "keyshift-node");
    assert_eq!(
        jsonpath(system, &pod, "{.spec.serviceAccountName}"),
        "ks-keyshift"
    );
    assert_eq!(
        jsonpath(
            system,
            &pod,
            "{.spec.containers[0].securityContext.readOnlyRootFilesystem}"
        ),
        "true"
    );
    assert_eq!(
        jsonpath(system, &pod, "{.spec.containers[0].args[0]}"),
        "operator"
    );
    assert!(
        jsonpath(system, &pod, "{.status.containerStatuses[0].containerID}")
            .starts_with("containerd://"),
        "a containerd container"
    );

    // RBAC, as the ServiceAccount.
    for ns in [a, b] {
        assert_can(sa, &["list", "streamjobs.keyshift.dev", "-n", ns]);
        assert_can(sa, &["watch", "streamjobs.keyshift.dev", "-n", ns]);
        assert_can(sa, &["watch", "streamjobsnapshots.keyshift.dev", "-n", ns]);
        assert_can(sa, &["delete", "streamjobsnapshots.keyshift.dev", "-n", ns]);
        assert_can(
            sa,
            &[
                "patch",
                "streamjobsnapshots.keyshift.dev",
                "--subresource=status",
                "-n",
                ns,
            ],
        );
        assert_can(
            sa,
            &[
                "patch",
                "streamjobs.keyshift.dev",
                "--subresource=status",
                "-n",
                ns,
            ],
        );
        assert_can(
            sa,
            &[
                "update",
                "streamjobs.keyshift.dev",
                "--subresource=finalizers",
                "-n",
                ns,
            ],
        );
        assert_can(sa, &["create", "pods", "-n", ns]);
        assert_can(sa, &["delete", "pods", "-n", ns]);
        // Secrets: the control token is created and read by name, nothing else.
        assert_can(sa, &["get", "secrets", "-n", ns]);
        assert_can(sa, &["create", "secrets", "-n", ns]);
        for verb in ["list", "watch", "update", "patch", "delete"] {
            assert_cannot(sa, &[verb, "secrets", "-n", ns]);
        }
        assert_can(sa, &["create", "events.events.k8s.io", "-n", ns]);
        // The job's NetworkPolicy: server-side applied, never read or deleted by the operator.
        for verb in ["create", "patch"] {
            assert_can(sa, &[verb, "networkpolicies.networking.k8s.io", "-n", ns]);
        }
        for verb in ["list", "delete"] {
            assert_cannot(sa, &[verb, "networkpolicies.networking.k8s.io", "-n", ns]);
        }
        assert_cannot(sa, &["create", "streamjobs.keyshift.dev", "-n", ns]);
        assert_cannot(sa, &["delete", "streamjobs.keyshift.dev", "-n", ns]);
        assert_cannot(sa, &["update", "pods", "-n", ns]);
        assert_cannot(sa, &["get", "configmaps", "-n", ns]);
        assert_cannot(sa, &["create", "pods", "--subresource=exec", "-n", ns]);
    }
    assert_cannot(sa, &["get", "secrets", "--all-namespaces"]);
    assert_cannot(sa, &["list", "streamjobs.keyshift.dev", "--all-namespaces"]);
    assert_cannot(sa, &["list", "pods", "-n", "default"]);
    assert_cannot(sa, &["get", "secrets", "-n", system]);
    assert_cannot(sa, &["delete", "nodes"]);
    assert_cannot(sa, &["list", "nodes"]);
    // The Lease: in the release namespace only, and only the operator's.
    assert_can(sa, &["create", "leases.coordination.k8s.io", "-n", system]);
    for verb in ["get", "update", "patch"] {
        assert_can(
            sa,
            &[
                verb,
                "leases.coordination.k8s.io/keyshift-operator",
                "-n",
                system,
            ],
        );
        assert_cannot(
            sa,
            &[verb, "leases.coordination.k8s.io/other", "-n", system],
        );
    }
    assert_cannot(
        sa,
        &[
            "delete",
            "leases.coordination.k8s.io/keyshift-operator",
            "-n",
            system,
        ],
    );
    assert_cannot(sa, &["create", "leases.coordination.k8s.io", "-n", a]);

    // ---- people: the built-in roles carry StreamJobs (the controller manager aggregates the
    // chart's ClusterRoles into them). alice has `edit` in namespace a, bob `view`.
    kubectl_ok(&[
        "create",
        "rolebinding",
        "alice-edit",
        "--clusterrole=edit",
        "--user=alice",
        "-n",
        a,
    ]);
    kubectl_ok(&[
        "create",
        "rolebinding",
        "bob-view",
        "--clusterrole=view",
        "--user=bob",
        "-n",
        a,
    ]);
    wait_for(Duration::from_secs(60), || {
        can(
            "alice",
            &[
                "patch",
                "streamjobs.keyshift.dev",
                "--subresource=scale",
                "-n",
                a,
            ],
        ) && can("bob", &["watch", "streamjobs.keyshift.dev", "-n", a])
    });
    for verb in [
        "create", "update", "patch", "delete", "get", "list", "watch",
    ] {
        assert_can("alice", &[verb, "streamjobs.keyshift.dev", "-n", a]);
    }
    for verb in ["get", "list", "watch"] {
        assert_can("bob", &[verb, "streamjobs.keyshift.dev", "-n", a]);
        assert_can(
            "bob",
            &[
                verb,
                "streamjobs.keyshift.dev",
                "--subresource=status",
                "-n",
                a,
            ],
        );
    }
    for verb in ["create", "update", "patch", "delete"] {
        assert_cannot("bob", &[verb, "streamjobs.keyshift.dev", "-n", a]);
    }
    assert_cannot(
        "bob",
        &[
            "patch",
            "streamjobs.keyshift.dev",
            "--subresource=scale",
            "-n",
            a,
        ],
    );
    // Status stays the operator's; nothing outside the bound namespace.
    for who in ["alice", "bob"] {
        assert_cannot(
            who,
            &[
                "patch",
                "streamjobs.keyshift.dev",
                "--subresource=status",
                "-n",
                a,
            ],
        );
        assert_cannot(who, &["get", "streamjobs.keyshift.dev", "-n", b]);
    }
    // What alice does as a user: create a StreamJob, `kubectl scale` it, delete it.
    let r = kubectl_in(
        &["apply", "-n", a, "--as", "alice", "-f", "-"],
        Some(&sample_job()),
    );
    assert!(r.ok, "alice creates a StreamJob: {}{}", r.stdout, r.stderr);
    kubectl_ok(&[
        "scale",
        "-n",
        a,
        "--as",
        "alice",
        "streamjob/clicks",
        "--replicas=2",
    ]);
    assert_eq!(jsonpath(a, "streamjob/clicks", "{.spec.replicas}"), "2");
    let r = kubectl(&[
        "scale",
        "-n",
        a,
        "--as",
        "bob",
        "streamjob/clicks",
        "--replicas=3",
    ]);
    assert!(
        !r.ok && r.stderr.contains("forbidden"),
        "bob may not scale: {}",
        r.stderr
    );
    assert!(
        kubectl(&["get", "-n", a, "--as", "bob", "streamjob/clicks"]).ok,
        "bob reads it"
    );
    kubectl_ok(&[
        "delete",
        "-n",
        a,
        "--as",
        "alice",
        "streamjob/clicks",
        "--timeout=90s",
    ]);

    // ---- helm test: the hook Pod (the chart's image, Pod Security restricted) finds the
    // operator pods through the metrics Service's EndpointSlices and GETs /readyz and /metrics
    // from each. First with no operator pod: it must fail, naming why.
    let test_pod = "pod/ks-keyshift-test";
    kubectl_ok(&[
        "scale",
        "-n",
        system,
        "deployment/ks-keyshift",
        "--replicas=0",
    ]);
    wait_for(Duration::from_secs(90), || pods(system, release).is_empty());
    let r = helm(&["test", release, "-n", system, "--timeout=180s"]);
    assert!(!r.ok, "helm test passed with no operator pod: {}", r.stdout);
    let logs = kubectl(&["logs", "-n", system, test_pod]).stdout;
    assert!(
        logs.contains("has no ready endpoint"),
        "the failed test says why: {logs}"
    );
    kubectl_ok(&[
        "scale",
        "-n",
        system,
        "deployment/ks-keyshift",
        "--replicas=1",
    ]);
    wait_for(Duration::from_secs(120), || {
        pods(system, release).iter().any(|p| {
            jsonpath(
                system,
                p,
                "{.status.conditions[?(@.type==\"Ready\")].status}",
            ) == "True"
        })
    });
    let r = helm(&["test", release, "-n", system, "--timeout=180s"]);
    let logs = kubectl(&["logs", "-n", system, test_pod]);
    assert!(
        r.ok && r.stdout.contains("Succeeded"),
        "helm test: {}{}\ntest pod log: {}{}",
        r.stdout,
        r.stderr,
        logs.stdout,
        logs.stderr
    );
    // Passed: the hook's Pod, ServiceAccount, Role and RoleBinding are deleted.
    wait_for(Duration::from_secs(60), || {
        !kubectl(&["get", "-n", system, test_pod]).ok
    });
    for what in [
        "serviceaccount/ks-keyshift-test",
        "role/ks-keyshift-test",
        "rolebinding/ks-keyshift-test",
    ] {
        assert!(
            !kubectl(&["get", "-n", system, what]).ok,
            "{what} is deleted"
        );
    }

    // The documented CRD upgrade step works on a Helm-installed CRD.
    apply_new_crd();

    // ---- upgrade: all namespaces, two replicas, a default storage. The image changes to one
    // the node does not have (and cannot pull): an operator watching every namespace must not
    // reconcile the other tests' StreamJobs in this shared cluster (its pods are still created).
    upgrade(
        release,
        system,
        &[
            "--set-json",
            "watchNamespaces=[]",
            "--set",
            "replicas=2",
            "--set",
            "defaultStorage=file:///tmp/keyshift-state",
            "--set",
            "image.repository=localhost/not-run-here",
        ],
    );
    assert_eq!(
        jsonpath(system, "deployment/ks-keyshift", "{.spec.replicas}"),
        "2"
    );
    let deploy_args = jsonpath(
        system,
        "deployment/ks-keyshift",
        "{.spec.template.spec.containers[0].args}",
    );
    assert!(
        deploy_args.contains("--default-storage=file:///tmp/keyshift-state")
            && !deploy_args.contains("--namespaces"),
        "{deploy_args}"
    );
    assert_eq!(
        jsonpath(
            system,
            "deployment/ks-keyshift",
            "{.spec.template.spec.containers[0].image}"
        ),
        format!(
            "localhost/not-run-here:{}",
            image().rsplit_once(':').expect("REPO:TAG").1
        ),
        "--reset-then-reuse-values kept the tag set at install"
    );
    let mut want = vec![
        "clusterrole.rbac.authorization.k8s.io/ks-keyshift",
        "clusterrole.rbac.authorization.k8s.io/ks-keyshift-streamjobs-edit",
        "clusterrole.rbac.authorization.k8s.io/ks-keyshift-streamjobs-view",
        "clusterrolebinding.rbac.authorization.k8s.io/ks-keyshift",
    ];
    want.sort();
    let mut have = release_objects(release, "clusterroles,clusterrolebindings", None);
    have.sort();
    assert_eq!(have, want);
    for ns in [a, b] {
        assert!(
            release_objects(release, "roles,rolebindings", Some(ns)).is_empty(),
            "the upgrade removed the Role in {ns}"
        );
    }
    assert_can(sa, &["get", "secrets", "--all-namespaces"]);
    assert_can(sa, &["create", "secrets", "-n", "default"]);
    assert_cannot(sa, &["list", "secrets", "--all-namespaces"]);
    assert_cannot(sa, &["delete", "secrets", "-n", "default"]);
    assert_can(sa, &["list", "streamjobs.keyshift.dev", "--all-namespaces"]);
    assert_can(sa, &["create", "pods", "-n", "default"]);
    assert_cannot(sa, &["delete", "nodes"]);
    assert_cannot(sa, &["get", "configmaps", "-n", "default"]);
    wait_for(Duration::from_secs(90), || pods(system, release).len() >= 2);

    // ---- uninstall: nothing of the release is left, the CRD stays
    helm_ok(&[
        "uninstall",
        release,
        "-n",
        system,
        "--wait",
        "--timeout=120s",
    ]);
    wait_for(Duration::from_secs(90), || {
        release_objects(release, NAMESPACED_KINDS, Some(system)).is_empty()
    });
    for ns in [a, b] {
        assert!(release_objects(release, NAMESPACED_KINDS, Some(ns)).is_empty());
    }
    assert!(release_objects(release, "clusterroles,clusterrolebindings", None).is_empty());
    assert!(
        kubectl_ok(&[
            "get",
            "secrets",
            "-n",
            system,
            "-l",
            "owner=helm",
            "-o",
            "name"
        ])
        .is_empty(),
        "no release records left"
    );
    assert!(kubectl(&["get", crd]).ok, "the CRD is kept");
}

/// Two operator pods of the test's own (not the chart's Deployment) as Lease candidates, under
/// the ServiceAccount `sa`, watching `ns`.
fn demo_deployment(sa: &str, ns: &str) -> String {
    format!(
        "apiVersion: apps/v1
kind: Deployment
metadata:
  name: lease-demo
spec:
  replicas: 2
  selector:
    matchLabels: {{app: lease-demo}}
  template:
    metadata:
      labels: {{app: lease-demo}}
    spec:
      serviceAccountName: {sa}
      terminationGracePeriodSeconds: 10
      securityContext:
        runAsNonRoot: true
        runAsUser: 65532
        seccompProfile: {{type: RuntimeDefault}}
      containers:
      - name: demo
        image: {image}
        args: [operator, --namespaces={ns}]
        securityContext:
          allowPrivilegeEscalation: false
          readOnlyRootFilesystem: true
          capabilities: {{drop: [ALL]}}
        env:
        - name: POD_NAMESPACE
          valueFrom: {{fieldRef: {{fieldPath: metadata.namespace}}}}
        - name: POD_NAME
          valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}
",
        image = image()
    )
}

/// The Lease holder's pod name (identities are `<pod>_<random>`).
fn holder_pod(ns: &str) -> String {
    let holder = jsonpath(ns, "lease/keyshift-operator", "{.spec.holderIdentity}");
    holder
        .rsplit_once('_')
        .map(|(pod, _)| pod.to_owned())
        .unwrap_or(holder)
}

#[test]
#[ignore = "needs the test control plane (hack/test.sh starts it)"]
fn chart_rbac_suffices_for_leader_election_with_real_processes() {
    let _plane = shared_plane();
    let release = "ks-lease";
    let ns = Namespace::new("e2e-helm-lease");
    let ns = ns.0.as_str();
    // The chart's ServiceAccount and RBAC only; no operator pod of the chart.
    let watch = format!(r#"watchNamespaces=["{ns}"]"#);
    let image_args = image_values();
    let mut args = vec!["install", release, CHART, "-n", ns, "--set", "replicas=0"];
    args.extend(image_args.iter().map(String::as_str));
    args.extend_from_slice(&["--set-json", &watch]);
    helm_ok(&args);

    // Two candidates as pods with the chart's ServiceAccount: one holds the Lease.
    let r = apply(ns, &demo_deployment("ks-lease-keyshift", ns));
    assert!(r.ok, "{}", r.stderr);
    let running = || {
        kubectl_ok(&[
            "get",
            "pods",
            "-n",
            ns,
            "-l",
            "app=lease-demo",
            "--field-selector=status.phase=Running",
            "-o",
            "jsonpath={.items[*].metadata.name}",
        ])
        .split_whitespace()
        .map(str::to_owned)
        .collect::<Vec<_>>()
    };
    let mut leader = String::new();
    wait_for(Duration::from_secs(90), || {
        leader = holder_pod(ns);
        running().len() == 2 && running().contains(&leader)
    });
    // The operator's lease lasts 15 s: renewals every 5 s.
    let renewed = jsonpath(ns, "lease/keyshift-operator", "{.spec.renewTime}");
    std::thread::sleep(Duration::from_secs(7));
    assert_eq!(holder_pod(ns), leader, "the leader keeps the Lease");
    assert_ne!(
        jsonpath(ns, "lease/keyshift-operator", "{.spec.renewTime}"),
        renewed,
        "and renews it"
    );

    // Delete the leader's pod: it releases the Lease on SIGTERM and another pod takes over at
    // its next look (every 5 s), well within the 15 s an expiry would take.
    kubectl_ok(&["delete", "pod", "-n", ns, &leader, "--wait=false"]);
    let mut next = String::new();
    wait_for(Duration::from_secs(12), || {
        next = holder_pod(ns);
        !next.is_empty() && next != leader
    });
    // The new holder is one of the running pods (the survivor or the replacement).
    wait_for(Duration::from_secs(10), || running().contains(&next));

    kubectl_ok(&[
        "delete",
        "deployment",
        "-n",
        ns,
        "lease-demo",
        "--wait=true",
    ]);
    helm_ok(&["uninstall", release, "-n", ns, "--wait", "--timeout=120s"]);
}

/// Fetches a metrics endpoint and parses it with the Prometheus client library's parser
/// (`prometheus_client` for Python, installed by hack/test.sh) through
/// tests/monitoring/check_exposition.py, which also checks the names and types against
/// Prometheus' conventions (counters end in `_total`, base units, nothing in milliseconds);
/// returns the family names.
fn parse_metrics(url: &str) -> Vec<String> {
    check_exposition(url).into_keys().collect()
}

/// The text a URL serves (Python's urllib: no HTTP client in the test's dependencies).
fn fetch_text(url: &str) -> String {
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())",
            url,
        ])
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "GET {url}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The sample job `clicks` (4 replicas, max parallelism 128).
fn sample_job() -> String {
    let yaml = std::fs::read_to_string(root().join("config/samples/generator-count.yaml"))
        .expect("sample exists");
    // The workers' credentials for the S3 store (the operator's default storage).
    let with_secret = yaml.replace(
        "  state:\n",
        &format!("  state:\n    credentialsSecret: {S3_SECRET}\n"),
    );
    assert_ne!(with_secret, yaml, "the sample has a state section");
    with_secret
}

/// The operator container's log of each pod of the release (`kubectl logs`).
fn operator_logs(ns: &str, release: &str) -> Vec<(String, String)> {
    pods(ns, release)
        .into_iter()
        .map(|pod| {
            let log = kubectl(&["logs", "-n", ns, &pod, "-c", "operator"]).stdout;
            (pod, log)
        })
        .collect()
}

/// `sj/clicks` runs at `replicas`, is Ready, and the operator has seen its latest spec.
/// The documented first step of an upgrade: this chart's CRD, server-side applied.
fn apply_new_crd() {
    kubectl_ok(&[
        "apply",
        "--server-side",
        "--force-conflicts",
        "-f",
        "charts/keyshift/crds/",
    ]);
}

/// `helm upgrade RELEASE` to this chart as documented (`--reset-then-reuse-values`), with `extra`
/// arguments.
fn upgrade(release: &str, ns: &str, extra: &[&str]) {
    let mut args = vec![
        "upgrade",
        release,
        CHART,
        "-n",
        ns,
        "--reset-then-reuse-values",
    ];
    args.extend_from_slice(extra);
    helm_ok(&args);
}

/// The `helm.sh/chart` label of the release `ks-full`'s operator Deployment (`keyshift-VERSION`).
fn chart_label(ns: &str) -> String {
    jsonpath(
        ns,
        "deployment/ks-full-keyshift",
        "{.metadata.labels.helm\\.sh/chart}",
    )
}

fn job_ready_at(ns: &str, replicas: &str) -> bool {
    let generation = jsonpath(ns, "sj/clicks", "{.metadata.generation}");
    jsonpath(
        ns,
        "sj/clicks",
        "{.status.replicas}/{.status.conditions[?(@.type==\"Ready\")].status}/{.status.observedGeneration}",
    ) == format!("{replicas}/True/{generation}")
}

/// The operator put a NetworkPolicy in front of `clicks`'s workers: the data port admits the job's
/// workers, the control port the release's operator pods in `system` (their labels are the
/// chart's selector labels). The test node's CNI (ptp) does not enforce policies, so this checks
/// the object the API server holds, not the traffic.
fn assert_network_policy(jobs: &str, system: &str, release: &str) {
    let np: serde_json::Value = serde_json::from_str(&kubectl_ok(&[
        "get",
        "networkpolicy",
        "clicks-workers",
        "-n",
        jobs,
        "-o",
        "json",
    ]))
    .expect("NetworkPolicy JSON");
    let owner = &np["metadata"]["ownerReferences"][0];
    assert_eq!(
        (&owner["kind"], &owner["name"]),
        (&"StreamJob".into(), &"clicks".into())
    );
    assert_eq!(owner["uid"], jsonpath(jobs, "sj/clicks", "{.metadata.uid}"));
    let spec = &np["spec"];
    let workers = serde_json::json!({"matchLabels": {"keyshift.dev/job": "clicks"}});
    assert_eq!(spec["podSelector"], workers);
    assert_eq!(spec["policyTypes"], serde_json::json!(["Ingress"]));
    assert_eq!(
        spec["ingress"],
        serde_json::json!([
            {"from": [{"podSelector": workers}], "ports": [{"protocol": "TCP", "port": 9091}]},
            {
                "from": [{
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": system}},
                    "podSelector": {"matchLabels": {
                        "app.kubernetes.io/component": "operator",
                        "app.kubernetes.io/instance": release,
                        "app.kubernetes.io/name": "keyshift"
                    }}
                }],
                "ports": [{"protocol": "TCP", "port": 9090}]
            }
        ])
    );
    // Every worker carries the selected label, and the selected operator pods exist.
    let selected = kubectl_ok(&[
        "get",
        "pods",
        "-n",
        jobs,
        "-l",
        "keyshift.dev/job=clicks",
        "-o",
        "name",
    ]);
    assert_eq!(selected.lines().count(), 4, "{selected}");
    let operators = kubectl_ok(&[
        "get",
        "pods",
        "-n",
        system,
        "-l",
        &format!(
            "app.kubernetes.io/component=operator,app.kubernetes.io/instance={release},app.kubernetes.io/name=keyshift"
        ),
        "-o",
        "name",
    ]);
    assert!(
        !operators.trim().is_empty(),
        "the policy's operator selector matches no pod"
    );
}

#[test]
#[ignore = "needs the test control plane (hack/test.sh starts it)"]
fn chart_runs_the_operator_install_ready_scale_handover() {
    let _plane = shared_plane();
    let release = "ks-full";
    let system = Namespace::new("e2e-helm-full-system");
    let jobs = Namespace::new("e2e-helm-full");
    let (system, jobs) = (system.0.as_str(), jobs.0.as_str());
    // Operator and workers keep state on the S3 test server, with credentials from Secrets:
    // the operator's through extraEnv, the workers' through the job's credentialsSecret.
    s3_secret(system);
    s3_secret(jobs);
    let storage = format!("defaultStorage={}", s3_storage("helm-full"));
    let s3_env: Vec<serde_json::Value> = [
        "AWS_ENDPOINT",
        "AWS_ALLOW_HTTP",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_REGION",
    ]
    .iter()
    .map(|k| {
        serde_json::json!({
            "name": k,
            "valueFrom": {"secretKeyRef": {"name": S3_SECRET, "key": k}}
        })
    })
    .collect();
    let extra_env = format!("extraEnv={}", serde_json::Value::Array(s3_env));
    let watch = format!(r#"watchNamespaces=["{jobs}"]"#);
    let image_args = image_values();
    // Installed from the previous chart release, then upgraded to this chart while a job runs
    // (below), as docs/upgrading.md says. The shared test cluster holds this chart's CRD
    // already, newer than the previous chart's: Helm 4 would server-side apply the older one
    // over it and stop on the conflict, so the install skips CRDs, as the chart README says for
    // a cluster whose CRD is newer than the chart's.
    let mut args = vec![
        "install",
        release,
        PREVIOUS_CHART,
        "-n",
        system,
        "--skip-crds",
    ];
    args.extend(image_args.iter().map(String::as_str));
    args.extend_from_slice(&[
        "--set-json",
        &watch,
        "--set-json",
        &extra_env,
        "--set",
        &storage,
        "--set",
        "logFormat=text",
    ]);
    helm_ok(&args);
    let rollout = [
        "-n",
        system,
        "rollout",
        "status",
        "deployment/ks-full-keyshift",
        "--timeout=120s",
    ];
    kubectl_ok(&rollout);
    assert_eq!(chart_label(system), "keyshift-0.1.0");
    // A sample job becomes Ready under the previous chart's operator.
    let r = apply(jobs, &sample_job());
    assert!(r.ok, "{}", r.stderr);
    wait_for(Duration::from_secs(180), || job_ready_at(jobs, "4"));
    // The upgrade as documented: the new CRD first, then the chart with --reset-then-reuse-values.
    apply_new_crd();
    upgrade(release, system, &[]);
    kubectl_ok(&rollout);
    let chart_yaml =
        std::fs::read_to_string(root().join("charts/keyshift/Chart.yaml")).expect("Chart.yaml");
    let version = chart_yaml
        .lines()
        .find_map(|l| l.strip_prefix("version: "))
        .expect("the chart's version");
    assert_ne!(
        version, "0.1.0",
        "bump the chart's version on a chart change"
    );
    assert_eq!(chart_label(system), format!("keyshift-{version}"));
    // The new operator takes the running job over and reconciles it (the rescale below), with
    // the values set at install (the S3 storage and credentials, the namespaces it watches).
    // The kubectl plugin finds the chart's operator and its version.
    let versions: serde_json::Value =
        serde_json::from_str(&plugin_ok(&["keyshift", "version", "-o", "json"]))
            .expect("version -o json is JSON");
    let operators = versions["operators"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let ours = operators
        .iter()
        .find(|o| o["namespace"] == system && o["name"] == "ks-full-keyshift")
        .unwrap_or_else(|| panic!("the chart's operator among {versions}"));
    assert_eq!(ours["version"], env!("CARGO_PKG_VERSION"), "{ours}");
    assert_eq!(ours["readyReplicas"], 1, "{ours}");
    assert_eq!(versions["client"]["version"], env!("CARGO_PKG_VERSION"));

    // The job, now reconciled by this chart's operator, rescales 4 -> 8 through a savepoint.
    wait_for(Duration::from_secs(180), || job_ready_at(jobs, "4"));
    assert_network_policy(jobs, system, release);
    kubectl_ok(&["-n", jobs, "scale", "sj/clicks", "--replicas=8"]);
    wait_for(Duration::from_secs(180), || job_ready_at(jobs, "8"));
    let rescale = "{.status.rescale.from}->{.status.rescale.to} {.status.rescale.step}";
    assert_eq!(jsonpath(jobs, "sj/clicks", rescale), "4->8 Done");
    // The chart's logFormat is the workers' too: every worker pod is told the operator's.
    let workers: serde_json::Value = serde_json::from_str(&kubectl_ok(&[
        "-n",
        jobs,
        "get",
        "pods",
        "-l",
        "keyshift.dev/job=clicks",
        "-o",
        "json",
    ]))
    .expect("pod list JSON");
    let formats: Vec<Option<&str>> = workers["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|p| {
            p["spec"]["containers"][0]["env"]
                .as_array()?
                .iter()
                .find(|e| e["name"] == "KEYSHIFT_LOG_FORMAT")?["value"]
                .as_str()
        })
        .collect();
    assert!(
        !formats.is_empty() && formats.iter().all(|f| *f == Some("text")),
        "{formats:?}"
    );

    // Two replicas: one leads. Deleting the leader's pod hands over (it releases the Lease on
    // SIGTERM) and the new leader reconciles the next rescale.
    upgrade(release, system, &["--set", "replicas=2"]);
    kubectl_ok(&rollout);
    let leader = holder_pod(system);
    assert!(
        pods(system, release).contains(&format!("pod/{leader}")),
        "the Lease names a running operator pod: {leader}"
    );
    // The logs of both replicas before the leader goes (a deleted pod's log goes with it).
    let mut logs = operator_logs(system, release);
    kubectl_ok(&["delete", "pod", "-n", system, &leader, "--wait=false"]);
    let mut next = String::new();
    wait_for(Duration::from_secs(15), || {
        next = holder_pod(system);
        !next.is_empty() && next != leader
    });
    kubectl_ok(&["-n", jobs, "scale", "sj/clicks", "--replicas=3"]);
    wait_for(Duration::from_secs(180), || job_ready_at(jobs, "3"));
    assert_eq!(jsonpath(jobs, "sj/clicks", rescale), "8->3 Done");

    // The metrics endpoint serves exposition text that Prometheus' own parser accepts, with the
    // reconcile and rescale metrics (labelled error counters appear once they count something).
    let ip = jsonpath(system, &format!("pod/{next}"), "{.status.podIP}");
    let families = parse_metrics(&format!("http://{ip}:8080/metrics"));
    for name in [
        "keyshift_operator_reconciles",
        "keyshift_operator_reconcile_duration_seconds",
        "keyshift_job_rescale_step_duration_seconds",
        "keyshift_job_snapshot_duration_seconds",
        "keyshift_job_last_checkpoint_timestamp_seconds",
        "keyshift_job_phase",
    ] {
        assert!(
            families.iter().any(|f| f == name),
            "metric family {name} missing: {families:?}"
        );
    }
    // A worker's endpoint (the control port; the test node's CNI does not enforce the
    // NetworkPolicy) passes the same checks.
    let worker_ip = kubectl_ok(&[
        "get",
        "pods",
        "-n",
        jobs,
        "-l",
        "keyshift.dev/job=clicks",
        "--field-selector=status.phase=Running",
        "-o",
        "jsonpath={.items[0].status.podIP}",
    ]);
    let worker_families = parse_metrics(&format!("http://{worker_ip}:9090/metrics"));
    assert!(
        worker_families
            .iter()
            .any(|f| f == "keyshift_worker_records_in"),
        "{worker_families:?}"
    );

    // The chart's RBAC sufficed: no operator pod ever got a Forbidden from the API server.
    logs.extend(operator_logs(system, release));
    let mut read = std::collections::BTreeSet::new();
    for (pod, log) in &logs {
        assert!(
            !log.contains("Forbidden") && !log.contains("forbidden"),
            "operator pod {pod} was refused by the API server:\n{log}"
        );
        if !log.is_empty() {
            read.insert(pod.clone());
        }
    }
    assert!(
        read.len() >= 2,
        "read the logs of both operator replicas: {read:?}"
    );

    // The operator removes its finalizer; then the release goes.
    kubectl_ok(&[
        "-n",
        jobs,
        "delete",
        "sj/clicks",
        "--wait=true",
        "--timeout=120s",
    ]);
    // The deleted job's series went with it.
    let text = fetch_text(&format!("http://{ip}:8080/metrics"));
    assert!(
        !text.contains("streamjob=\"clicks\""),
        "the operator still exports series of the deleted job:\n{text}"
    );
    helm_ok(&[
        "uninstall",
        release,
        "-n",
        system,
        "--wait",
        "--timeout=120s",
    ]);
}
