//! The Helm chart (`charts/keyshift`), rendered with a real `helm template`: RBAC is exactly the
//! operator's documented API use with no wildcards, namespaced mode grants nothing cluster-wide,
//! the pod is restricted, and the chart's CRD is the generated one.
//!
//! Helm comes from `KEYSHIFT_HELM` (`hack/test.sh` sets it from `hack/get-helm.sh`), else from
//! the cache `hack/get-helm.sh` fills. Without either, the tests that need helm say so and pass;
//! `hack/test.sh` always provides it.

mod support;

use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;
use support::root;

const RELEASE: &str = "ks";
const NAMESPACE: &str = "keyshift-system";
const NAMESPACED_VALUES: &str = "charts/keyshift/ci/namespaced-values.yaml";
const SERVICE_MONITOR_API: &str = "monitoring.coreos.com/v1/ServiceMonitor";
const OPTIONS_VALUES: &str = "charts/keyshift/ci/options-values.yaml";

fn helm() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KEYSHIFT_HELM").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        assert!(p.exists(), "KEYSHIFT_HELM={} does not exist", p.display());
        return Some(p);
    }
    let cache = std::env::var_os("KEYSHIFT_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/keyshift")))?;
    let p = cache.join("bin/helm-v4.1.4/helm");
    p.exists().then_some(p)
}

/// Runs `f` with helm, or explains why the test is skipped.
fn with_helm(f: impl FnOnce(&PathBuf)) {
    match helm() {
        Some(h) => f(&h),
        None => eprintln!(
            "skipped: no helm (run hack/get-helm.sh or set KEYSHIFT_HELM; hack/test.sh does)"
        ),
    }
}

/// `helm template` of the chart with extra arguments: the rendered objects, or helm's error.
fn render(helm: &PathBuf, args: &[&str]) -> Result<Vec<Value>, String> {
    let out = Command::new(helm)
        .current_dir(root())
        .args(["template", RELEASE, "charts/keyshift", "-n", NAMESPACE])
        .args(args)
        .output()
        .expect("helm runs");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let mut docs = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let v = Value::deserialize(doc).expect("helm renders YAML");
        if !v.is_null() {
            docs.push(v);
        }
    }
    Ok(docs)
}

fn render_ok(helm: &PathBuf, args: &[&str]) -> Vec<Value> {
    render(helm, args).unwrap_or_else(|e| panic!("helm template {args:?} failed: {e}"))
}

fn defaults(helm: &PathBuf) -> Vec<Value> {
    render_ok(helm, &[])
}

fn namespaced(helm: &PathBuf) -> Vec<Value> {
    render_ok(
        helm,
        &[
            "-f",
            NAMESPACED_VALUES,
            "--api-versions",
            SERVICE_MONITOR_API,
        ],
    )
}

/// A `helm test` hook (rendered by `helm template` too).
fn is_test_hook(doc: &Value) -> bool {
    doc["metadata"]["annotations"]["helm.sh/hook"] == "test"
}

/// A ClusterRole aggregated into Kubernetes' built-in user-facing roles.
fn is_aggregated(doc: &Value) -> bool {
    doc["metadata"]["labels"].as_object().is_some_and(|l| {
        l.keys()
            .any(|k| k.starts_with("rbac.authorization.k8s.io/aggregate-to-"))
    })
}

/// The operator's own objects of `kind`: neither test hooks nor the user-facing aggregated
/// roles (their own tests check those).
fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter()
        .filter(|d| d["kind"] == kind && !is_test_hook(d) && !is_aggregated(d))
        .collect()
}

fn one<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let found = of_kind(docs, kind);
    assert_eq!(found.len(), 1, "expected one {kind}, found {}", found.len());
    found[0]
}

type Rules = BTreeMap<(String, String), BTreeSet<String>>;

/// (apiGroup, resource) -> verbs, over all rules of a (Cluster)Role.
fn rules(role: &Value) -> Rules {
    let mut out = Rules::new();
    for rule in role["rules"].as_array().expect("rules") {
        for group in rule["apiGroups"].as_array().expect("apiGroups") {
            for resource in rule["resources"].as_array().expect("resources") {
                let verbs = out
                    .entry((
                        group.as_str().unwrap().to_owned(),
                        resource.as_str().unwrap().to_owned(),
                    ))
                    .or_default();
                for verb in rule["verbs"].as_array().expect("verbs") {
                    verbs.insert(verb.as_str().unwrap().to_owned());
                }
            }
        }
    }
    out
}

fn expect_rules(entries: &[(&str, &str, &[&str])]) -> Rules {
    entries
        .iter()
        .map(|(g, r, verbs)| {
            (
                ((*g).to_owned(), (*r).to_owned()),
                verbs.iter().map(|v| (*v).to_owned()).collect(),
            )
        })
        .collect()
}

/// The operator's contract: what it does with StreamJobs, pods, secrets and events.
fn workload_rules() -> Rules {
    expect_rules(&[
        (
            "keyshift.dev",
            "streamjobs",
            &["get", "list", "watch", "patch", "update"],
        ),
        (
            "keyshift.dev",
            "streamjobs/status",
            &["get", "patch", "update"],
        ),
        ("keyshift.dev", "streamjobs/finalizers", &["update"]),
        (
            "keyshift.dev",
            "streamjobsnapshots",
            &["get", "list", "watch", "patch", "update", "delete"],
        ),
        (
            "keyshift.dev",
            "streamjobsnapshots/status",
            &["get", "patch", "update"],
        ),
        ("keyshift.dev", "streamjobsnapshots/finalizers", &["update"]),
        (
            "",
            "pods",
            &["get", "list", "watch", "create", "delete", "patch"],
        ),
        ("", "secrets", &["get", "create"]),
        ("events.k8s.io", "events", &["create", "patch"]),
        ("networking.k8s.io", "networkpolicies", &["create", "patch"]),
    ])
}

fn lease_rules() -> Rules {
    expect_rules(&[(
        "coordination.k8s.io",
        "leases",
        &["get", "create", "update", "patch"],
    )])
}

fn name(doc: &Value) -> &str {
    doc["metadata"]["name"].as_str().unwrap_or_default()
}

fn namespace(doc: &Value) -> &str {
    doc["metadata"]["namespace"].as_str().unwrap_or_default()
}

fn container(docs: &[Value]) -> &Value {
    &one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
}

fn args(docs: &[Value]) -> Vec<String> {
    container(docs)["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().unwrap().to_owned())
        .collect()
}

fn env<'a>(docs: &'a [Value], var: &str) -> &'a Value {
    container(docs)["env"]
        .as_array()
        .expect("env")
        .iter()
        .find(|e| e["name"] == var)
        .unwrap_or_else(|| panic!("env {var} missing"))
}

#[test]
fn chart_crd_is_the_committed_crd_and_versions_match() {
    let files = |dir: &str| -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(root().join(dir))
            .expect("crds dir")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    assert_eq!(
        files("crds"),
        ["streamjob.yaml", "streamjobsnapshot.yaml"],
        "the committed CRDs"
    );
    assert_eq!(files("charts/keyshift/crds"), files("crds"));
    for file in files("crds") {
        let committed = std::fs::read_to_string(root().join("crds").join(&file)).expect("crd");
        let in_chart =
            std::fs::read_to_string(root().join("charts/keyshift/crds").join(&file)).expect("crd");
        assert!(
            committed == in_chart,
            "charts/keyshift/crds/{file} differs from crds/{file}: \
             run `cp crds/{file} charts/keyshift/crds/` (and read the CRD upgrade notes in charts/keyshift/README.md)"
        );
    }
    let chart: Value = serde_yaml::from_str(
        &std::fs::read_to_string(root().join("charts/keyshift/Chart.yaml")).expect("Chart.yaml"),
    )
    .expect("Chart.yaml parses");
    assert_eq!(
        chart["appVersion"],
        env!("CARGO_PKG_VERSION"),
        "Chart.yaml appVersion follows the crate version"
    );
    assert_eq!(chart["kubeVersion"], ">= 1.30.0-0");
    assert_eq!(chart["apiVersion"], "v2");
}

#[test]
fn values_schema_accepts_the_storage_schemes_the_crd_does() {
    let schema: Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("charts/keyshift/values.schema.json"))
            .expect("schema"),
    )
    .expect("schema is JSON");
    assert_eq!(
        schema["properties"]["defaultStorage"]["pattern"],
        format!(
            "^$|^({})://.+$",
            keyshift::validation::STORAGE_SCHEMES.join("|")
        )
    );
}

#[test]
fn rendered_crd_equals_the_committed_crd() {
    with_helm(|helm| {
        let docs = render_ok(helm, &["--include-crds"]);
        let crds = of_kind(&docs, "CustomResourceDefinition");
        assert_eq!(crds.len(), 2, "StreamJob and StreamJobSnapshot");
        for file in ["streamjob.yaml", "streamjobsnapshot.yaml"] {
            let committed: Value = serde_yaml::from_str(
                &std::fs::read_to_string(root().join("crds").join(file)).expect("crd"),
            )
            .expect("crd parses");
            assert!(
                crds.iter().any(|c| **c == committed),
                "helm renders the committed {file}"
            );
        }
        // Without --include-crds the CRD is not a template: Helm never upgrades or deletes it.
        assert!(of_kind(&defaults(helm), "CustomResourceDefinition").is_empty());
    });
}

#[test]
fn default_values_grant_the_contract_cluster_wide() {
    with_helm(|helm| {
        let docs = defaults(helm);
        let kinds: BTreeSet<&str> = docs
            .iter()
            .filter(|d| !is_test_hook(d))
            .map(|d| d["kind"].as_str().unwrap())
            .collect();
        assert_eq!(
            kinds,
            BTreeSet::from([
                "ServiceAccount",
                "ClusterRole",
                "ClusterRoleBinding",
                "Role",
                "RoleBinding",
                "Service",
                "Deployment"
            ]),
            "no ServiceMonitor by default, no PodDisruptionBudget for one replica"
        );
        let sa = one(&docs, "ServiceAccount");
        assert_eq!(namespace(sa), NAMESPACE);

        let cluster_role = one(&docs, "ClusterRole");
        assert_eq!(rules(cluster_role), workload_rules());
        let binding = one(&docs, "ClusterRoleBinding");
        assert_eq!(binding["roleRef"]["name"], name(cluster_role));
        assert_eq!(
            binding["subjects"],
            json!([{"kind": "ServiceAccount", "name": name(sa), "namespace": NAMESPACE}])
        );

        // The only Role: the Lease, in the release namespace.
        let lease_role = one(&docs, "Role");
        assert_eq!(namespace(lease_role), NAMESPACE);
        assert_eq!(rules(lease_role), lease_rules());
        for rule in lease_role["rules"].as_array().unwrap() {
            let verbs = rule["verbs"].as_array().unwrap();
            if verbs.iter().any(|v| v != "create") {
                assert_eq!(
                    rule["resourceNames"],
                    json!(["keyshift-operator"]),
                    "get/update/patch only on the operator's Lease"
                );
            }
        }
        let lease_binding = one(&docs, "RoleBinding");
        assert_eq!(namespace(lease_binding), NAMESPACE);
        assert_eq!(lease_binding["roleRef"]["name"], name(lease_role));
        assert_eq!(lease_binding["subjects"][0]["name"], name(sa));

        // The Deployment, per the operator's command-line contract.
        let deploy = one(&docs, "Deployment");
        assert_eq!(deploy["spec"]["replicas"], 1);
        let pod = &deploy["spec"]["template"]["spec"];
        assert_eq!(pod["serviceAccountName"], name(sa));
        let c = container(&docs);
        assert_eq!(
            c["image"],
            format!("ghcr.io/keyshift/keyshift:{}", env!("CARGO_PKG_VERSION"))
        );
        assert!(c.get("command").is_none(), "the image's entrypoint runs");
        assert_eq!(
            args(&docs),
            [
                "operator",
                "--metrics-addr=0.0.0.0:8080",
                "--log-format=json",
                "--max-concurrent-reconciles=32",
                "--lease-name=keyshift-operator",
                &format!("--lease-namespace={NAMESPACE}"),
            ]
        );
        assert_eq!(
            env(&docs, "POD_NAMESPACE")["valueFrom"]["fieldRef"]["fieldPath"],
            "metadata.namespace"
        );
        assert_eq!(env(&docs, "KEYSHIFT_IMAGE")["value"], c["image"]);
        assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
        assert_eq!(c["livenessProbe"]["httpGet"]["port"], 8080);
        assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
        assert_eq!(c["readinessProbe"]["httpGet"]["port"], 8080);
        assert_eq!(c["ports"][0]["containerPort"], 8080);
        assert_eq!(c["resources"]["requests"]["memory"], "128Mi");
        assert_eq!(c["resources"]["limits"]["memory"], "256Mi");

        let svc = one(&docs, "Service");
        assert_eq!(svc["spec"]["ports"][0]["targetPort"], "metrics");
        assert_eq!(
            svc["spec"]["selector"],
            deploy["spec"]["selector"]["matchLabels"]
        );
    });
}

#[test]
fn namespaced_values_grant_nothing_cluster_wide() {
    with_helm(|helm| {
        let docs = namespaced(helm);
        assert!(of_kind(&docs, "ClusterRole").is_empty());
        assert!(of_kind(&docs, "ClusterRoleBinding").is_empty());
        // The only cluster-scoped objects are the user-facing aggregated roles, bound by nobody.
        for d in docs.iter().filter(|d| d["kind"] == "ClusterRole") {
            assert!(is_aggregated(d), "{}", name(d));
        }
        assert!(docs.iter().all(|d| d["kind"] != "ClusterRoleBinding"));
        let sa = one(&docs, "ServiceAccount");

        // One Role + RoleBinding per watched namespace, with the contract's rules; the Lease
        // Role in the release namespace.
        let roles = of_kind(&docs, "Role");
        let by_ns: BTreeMap<&str, &Value> = roles.iter().map(|r| (namespace(r), *r)).collect();
        assert_eq!(
            by_ns.keys().copied().collect::<Vec<_>>(),
            ["keyshift-system", "team-a", "team-b"]
        );
        for ns in ["team-a", "team-b"] {
            assert_eq!(rules(by_ns[ns]), workload_rules(), "Role in {ns}");
        }
        assert_eq!(rules(by_ns[NAMESPACE]), lease_rules());
        let bindings = of_kind(&docs, "RoleBinding");
        assert_eq!(bindings.len(), 3);
        for b in bindings {
            let role = by_ns[namespace(b)];
            assert_eq!(b["roleRef"]["kind"], "Role");
            assert_eq!(b["roleRef"]["name"], name(role));
            assert_eq!(
                b["subjects"],
                json!([{"kind": "ServiceAccount", "name": name(sa), "namespace": NAMESPACE}])
            );
        }

        let deploy = one(&docs, "Deployment");
        assert_eq!(deploy["spec"]["replicas"], 2);
        let a = args(&docs);
        assert!(
            a.contains(&"--namespaces=team-a,team-b".to_owned()),
            "{a:?}"
        );
        assert!(
            a.contains(&"--default-storage=s3://keyshift-state/prod".to_owned()),
            "{a:?}"
        );
        assert!(a.contains(&"--log-format=text".to_owned()), "{a:?}");
        let c = container(&docs);
        assert_eq!(c["image"], "ghcr.io/keyshift/keyshift:0.1.0-rc.1");
        assert_eq!(
            c["resources"],
            json!({"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}})
        );
        assert_eq!(env(&docs, "RUST_LOG")["value"], "info,keyshift=debug");
        assert_eq!(
            env(&docs, "KEYSHIFT_NETWORK_POLICY_METRICS_FROM")["value"],
            r#"[{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"monitoring"}}}]"#
        );
        assert_eq!(
            env(&docs, "KEYSHIFT_ALLOWED_IMAGE_PREFIXES")["value"],
            "registry.example.com/streaming/,ghcr.io/keyshift/"
        );
        assert_eq!(
            env(&docs, "KEYSHIFT_ALLOWED_SERVICE_ACCOUNTS")["value"],
            "stream-workers"
        );

        let sm = one(&docs, "ServiceMonitor");
        assert_eq!(sm["apiVersion"], "monitoring.coreos.com/v1");
        assert_eq!(namespace(sm), NAMESPACE);
        assert_eq!(sm["metadata"]["labels"]["release"], "prometheus");
        assert_eq!(sm["spec"]["endpoints"][0]["port"], "metrics");
        assert_eq!(sm["spec"]["endpoints"][0]["path"], "/metrics");
        assert_eq!(sm["spec"]["endpoints"][0]["interval"], "15s");
        let svc = one(&docs, "Service");
        for (k, v) in sm["spec"]["selector"]["matchLabels"].as_object().unwrap() {
            assert_eq!(
                &svc["metadata"]["labels"][k], v,
                "ServiceMonitor selects the Service"
            );
        }
    });
}

/// Every string in an RBAC rule's lists, for every (Cluster)Role in `docs`.
fn rbac_strings(docs: &[Value]) -> Vec<String> {
    let mut out = Vec::new();
    for doc in docs {
        if doc["kind"] != "Role" && doc["kind"] != "ClusterRole" {
            continue;
        }
        for rule in doc["rules"].as_array().expect("rules") {
            for field in [
                "apiGroups",
                "resources",
                "verbs",
                "resourceNames",
                "nonResourceURLs",
            ] {
                for v in rule[field].as_array().into_iter().flatten() {
                    out.push(v.as_str().expect("strings").to_owned());
                }
            }
        }
        assert!(
            doc.get("aggregationRule").is_none(),
            "no aggregated roles: {}",
            name(doc)
        );
    }
    out
}

#[test]
fn no_rbac_rule_has_a_wildcard() {
    with_helm(|helm| {
        for docs in [
            defaults(helm),
            namespaced(helm),
            render_ok(helm, &["--set", "leaderElection.enabled=false"]),
        ] {
            let strings = rbac_strings(&docs);
            assert!(!strings.is_empty());
            for s in strings {
                assert!(!s.contains('*'), "wildcard in an RBAC rule: {s:?}");
            }
        }
    });
}

#[test]
fn the_pod_is_restricted_by_default() {
    with_helm(|helm| {
        for docs in [defaults(helm), namespaced(helm)] {
            let pod = &one(&docs, "Deployment")["spec"]["template"]["spec"];
            let psc = &pod["securityContext"];
            assert_eq!(psc["runAsNonRoot"], true);
            assert_eq!(psc["runAsUser"], 65532);
            assert_eq!(psc["seccompProfile"]["type"], "RuntimeDefault");
            for c in pod["containers"].as_array().unwrap() {
                let sc = &c["securityContext"];
                assert_eq!(sc["runAsNonRoot"], true, "{}", c["name"]);
                assert_eq!(sc["readOnlyRootFilesystem"], true);
                assert_eq!(sc["allowPrivilegeEscalation"], false);
                assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
                assert!(sc["capabilities"].get("add").is_none());
                assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault");
                assert!(sc.get("privileged").is_none_or(|p| p == false));
            }
            assert!(pod.get("hostNetwork").is_none() && pod.get("hostPID").is_none());
        }
    });
}

#[test]
fn other_values_render_as_documented() {
    with_helm(|helm| {
        // No leader election: no Lease Role, and the operator is told.
        let docs = render_ok(helm, &["--set", "leaderElection.enabled=false"]);
        assert!(of_kind(&docs, "Role").is_empty());
        let a = args(&docs);
        assert!(a.contains(&"--leader-elect=false".to_owned()), "{a:?}");
        assert!(!a.iter().any(|x| x.starts_with("--lease-")), "{a:?}");

        // A digest wins over the tag; a worker image of its own.
        let docs = render_ok(
            helm,
            &[
                "--set",
                &format!("image.digest=sha256:{}", "a".repeat(64)),
                "--set",
                "workerImage=registry.example/acme/keyshift-worker:1",
                "--set",
                "metrics.bindAddress=$(POD_IP)",
            ],
        );
        let c = container(&docs);
        assert_eq!(
            c["image"],
            format!("ghcr.io/keyshift/keyshift@sha256:{}", "a".repeat(64))
        );
        assert_eq!(
            env(&docs, "KEYSHIFT_IMAGE")["value"],
            "registry.example/acme/keyshift-worker:1"
        );
        assert!(args(&docs).contains(&"--metrics-addr=$(POD_IP):8080".to_owned()));
        let docs = render_ok(helm, &["--set", "maxConcurrentReconciles=0"]);
        assert!(
            args(&docs).contains(&"--max-concurrent-reconciles=0".to_owned()),
            "0 (unbounded) is passed through"
        );
        assert_eq!(
            env(&docs, "POD_IP")["valueFrom"]["fieldRef"]["fieldPath"],
            "status.podIP"
        );

        // No RBAC, an existing ServiceAccount.
        let docs = render_ok(
            helm,
            &[
                "--set",
                "rbac.create=false",
                "--set",
                "serviceAccount.create=false",
                "--set",
                "serviceAccount.name=mine",
            ],
        );
        // Nothing but the `helm test` hook's own Role (made only while `helm test` runs).
        let non_hooks: Vec<Value> = docs.iter().filter(|d| !is_test_hook(d)).cloned().collect();
        assert!(rbac_strings(&non_hooks).is_empty());
        assert!(!non_hooks.iter().any(is_aggregated));
        assert!(of_kind(&docs, "ServiceAccount").is_empty());
        assert_eq!(
            one(&docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"],
            "mine"
        );
    });
}

/// The operator learns who it is for the NetworkPolicy's `from`: its pod labels are exactly the
/// Deployment's selector labels, its namespace comes from the downward API; off, it creates none
/// and the chart grants nothing on NetworkPolicies.
#[test]
fn network_policy_values_reach_the_operator() {
    with_helm(|helm| {
        let docs = defaults(helm);
        assert_eq!(env(&docs, "KEYSHIFT_NETWORK_POLICY")["value"], "true");
        let labels: BTreeMap<String, String> = env(&docs, "KEYSHIFT_OPERATOR_POD_LABELS")["value"]
            .as_str()
            .expect("a string")
            .split(',')
            .map(|kv| {
                let (k, v) = kv.split_once('=').expect("key=value");
                (k.to_owned(), v.to_owned())
            })
            .collect();
        let deploy = one(&docs, "Deployment");
        let selector: BTreeMap<String, String> =
            serde_json::from_value(deploy["spec"]["selector"]["matchLabels"].clone())
                .expect("matchLabels");
        assert_eq!(labels, selector);
        assert_eq!(labels["app.kubernetes.io/instance"], RELEASE);
        let pod_labels = &deploy["spec"]["template"]["metadata"]["labels"];
        for (k, v) in &labels {
            assert_eq!(pod_labels[k], v.as_str(), "the operator pod carries {k}");
        }
        assert_eq!(
            env(&docs, "POD_NAMESPACE")["valueFrom"]["fieldRef"]["fieldPath"],
            "metadata.namespace"
        );
        let names: Vec<&str> = container(&docs)["env"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|e| e["name"].as_str())
            .collect();
        assert!(!names.contains(&"KEYSHIFT_NETWORK_POLICY_METRICS_FROM"));

        let docs = render_ok(
            helm,
            &[
                "--set-json",
                r#"networkPolicy.metricsFrom=[{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"monitoring"}}}]"#,
            ],
        );
        let peers: Value = serde_json::from_str(
            env(&docs, "KEYSHIFT_NETWORK_POLICY_METRICS_FROM")["value"]
                .as_str()
                .expect("a string"),
        )
        .expect("JSON");
        assert_eq!(
            peers,
            json!([{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}])
        );

        for args in [
            &["--set", "networkPolicy.enabled=false"][..],
            &[
                "-f",
                NAMESPACED_VALUES,
                "--api-versions",
                SERVICE_MONITOR_API,
                "--set",
                "networkPolicy.enabled=false",
            ][..],
        ] {
            let docs = render_ok(helm, args);
            assert_eq!(env(&docs, "KEYSHIFT_NETWORK_POLICY")["value"], "false");
            assert!(
                !rbac_strings(&docs)
                    .iter()
                    .any(|r| r.contains("networkpolicies")),
                "{args:?}"
            );
        }
    });
}

/// policy.* reaches the operator as its allow-lists; empty lists set nothing (anything goes).
#[test]
fn policy_values_reach_the_operator() {
    with_helm(|helm| {
        let names = |docs: &[Value]| -> Vec<String> {
            container(docs)["env"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|e| e["name"].as_str().map(str::to_owned))
                .collect()
        };
        let docs = defaults(helm);
        let env_names = names(&docs);
        assert!(
            !env_names.iter().any(|n| n.starts_with("KEYSHIFT_ALLOWED_")),
            "{env_names:?}"
        );
        let docs = render_ok(
            helm,
            &[
                "--set-json",
                r#"policy.allowedImagePrefixes=["registry.example.com/streaming/","ghcr.io/keyshift/"]"#,
                "--set-json",
                r#"policy.allowedServiceAccounts=["stream-workers","etl"]"#,
            ],
        );
        assert_eq!(
            env(&docs, "KEYSHIFT_ALLOWED_IMAGE_PREFIXES")["value"],
            "registry.example.com/streaming/,ghcr.io/keyshift/"
        );
        assert_eq!(
            env(&docs, "KEYSHIFT_ALLOWED_SERVICE_ACCOUNTS")["value"],
            "stream-workers,etl"
        );
    });
}

#[test]
fn bad_values_are_refused_with_a_reason() {
    with_helm(|helm| {
        let cases: &[(&[&str], &str)] = &[
            (&["--set", "replicas=-1"], "/replicas"),
            (&["--set", "bogus=1"], "bogus"),
            (
                &["--set", "defaultStorage=bucket/prefix"],
                "/defaultStorage",
            ),
            (
                &["--set-json", r#"watchNamespaces=["a","a"]"#],
                "/watchNamespaces",
            ),
            (&["--set", "watchNamespaces=Team_A"], "/watchNamespaces"),
            (&["--set", "logFormat=xml"], "/logFormat"),
            (
                &["--set", "maxConcurrentReconciles=-1"],
                "/maxConcurrentReconciles",
            ),
            (
                &[
                    "--set",
                    "replicas=2",
                    "--set",
                    "leaderElection.enabled=false",
                ],
                "replicas > 1 needs leaderElection.enabled",
            ),
            (
                &["--set", "serviceMonitor.enabled=true"],
                "does not serve monitoring.coreos.com/v1 ServiceMonitor",
            ),
            (
                &["--set", "rewrite.memory=200Mi"],
                "rewrite.memory (200Mi) must be at most half of resources.limits.memory (256Mi)",
            ),
            (
                &[
                    "--set",
                    "rewrite.memory=3Gi",
                    "--set",
                    "resources.limits.memory=5000M",
                ],
                "rewrite.memory (3Gi) must be at most half of resources.limits.memory (5000M)",
            ),
            (
                &["--set-json", r#"policy.allowedImagePrefixes=["a,b"]"#],
                "/policy/allowedImagePrefixes/0",
            ),
            (
                &[
                    "--set-json",
                    r#"policy.allowedServiceAccounts=["Not_A_Name"]"#,
                ],
                "/policy/allowedServiceAccounts/0",
            ),
            (
                &["--kube-version", "1.29.0"],
                "chart requires kubeVersion: >= 1.30.0-0",
            ),
            (
                &[
                    "--set-json",
                    r#"extraVolumes=[{"name":"tmp","emptyDir":{}}]"#,
                ],
                "/extraVolumes/0/name",
            ),
            (
                &[
                    "--set-json",
                    r#"extraVolumeMounts=[{"name":"ca","mountPath":"/etc/ca"}]"#,
                ],
                "mounts volume \"ca\", which extraVolumes does not declare",
            ),
            (
                &[
                    "--set-json",
                    r#"extraVolumes=[{"name":"scratch","emptyDir":{}}]"#,
                    "--set-json",
                    r#"extraVolumeMounts=[{"name":"scratch","mountPath":"/tmp/"}]"#,
                ],
                "/tmp is the chart's own mount",
            ),
            (
                &[
                    "--set-json",
                    r#"extraVolumeMounts=[{"name":"tmp","mountPath":"relative"}]"#,
                ],
                "/extraVolumeMounts/0/mountPath",
            ),
            (
                &["--set", "podDisruptionBudget.maxUnavailable=half"],
                "/podDisruptionBudget/maxUnavailable",
            ),
            (
                &["--set", "tests.timeoutSeconds=0"],
                "/tests/timeoutSeconds",
            ),
            (
                &["--set", "rbac.aggregateToDefaultRoles=yes"],
                "/rbac/aggregateToDefaultRoles",
            ),
        ];
        for (args, message) in cases {
            match render(helm, args) {
                Ok(_) => panic!("helm template {args:?} should fail"),
                Err(e) => assert!(e.contains(message), "{args:?}: expected {message:?} in {e}"),
            }
        }
        // The oldest supported Kubernetes renders.
        render_ok(helm, &["--kube-version", "1.30.0"]);
    });
}

/// The one aggregated ClusterRole whose name ends in `suffix`.
fn aggregated_role<'a>(docs: &'a [Value], suffix: &str) -> &'a Value {
    let found: Vec<&Value> = docs
        .iter()
        .filter(|d| d["kind"] == "ClusterRole" && is_aggregated(d) && name(d).ends_with(suffix))
        .collect();
    assert_eq!(found.len(), 1, "one aggregated ClusterRole *{suffix}");
    found[0]
}

fn aggregates_to(role: &Value) -> BTreeSet<String> {
    role["metadata"]["labels"]
        .as_object()
        .expect("labels")
        .iter()
        .filter_map(|(k, v)| {
            let target = k.strip_prefix("rbac.authorization.k8s.io/aggregate-to-")?;
            assert_eq!(v, "true", "{k}");
            Some(target.to_owned())
        })
        .collect()
}

/// A namespace `view` user reads StreamJobs (and their status and scale); `edit` and `admin`
/// also create, change, delete and `kubectl scale` them; nobody but the operator writes status.
#[test]
fn aggregated_roles_add_streamjobs_to_view_edit_and_admin() {
    with_helm(|helm| {
        for docs in [defaults(helm), namespaced(helm)] {
            let all_aggregated: Vec<&Value> = docs.iter().filter(|d| is_aggregated(d)).collect();
            assert_eq!(all_aggregated.len(), 2);
            let view = aggregated_role(&docs, "-streamjobs-view");
            assert_eq!(
                aggregates_to(view),
                BTreeSet::from(["view".into(), "edit".into(), "admin".into()])
            );
            assert_eq!(
                rules(view),
                expect_rules(&[
                    ("keyshift.dev", "streamjobs", &["get", "list", "watch"]),
                    (
                        "keyshift.dev",
                        "streamjobs/status",
                        &["get", "list", "watch"]
                    ),
                    (
                        "keyshift.dev",
                        "streamjobs/scale",
                        &["get", "list", "watch"]
                    ),
                    (
                        "keyshift.dev",
                        "streamjobsnapshots",
                        &["get", "list", "watch"]
                    ),
                    (
                        "keyshift.dev",
                        "streamjobsnapshots/status",
                        &["get", "list", "watch"]
                    ),
                ])
            );
            let edit = aggregated_role(&docs, "-streamjobs-edit");
            assert_eq!(
                aggregates_to(edit),
                BTreeSet::from(["edit".into(), "admin".into()]),
                "view must not gain write access"
            );
            assert_eq!(
                rules(edit),
                expect_rules(&[
                    (
                        "keyshift.dev",
                        "streamjobs",
                        &["create", "update", "patch", "delete", "deletecollection"]
                    ),
                    (
                        "keyshift.dev",
                        "streamjobsnapshots",
                        &["create", "update", "patch", "delete", "deletecollection"]
                    ),
                    ("keyshift.dev", "streamjobs/scale", &["update", "patch"]),
                ])
            );
            // They grant through the built-in roles only: nothing binds them.
            for b in docs
                .iter()
                .filter(|d| d["kind"] == "ClusterRoleBinding" || d["kind"] == "RoleBinding")
            {
                assert!(
                    b["roleRef"]["name"] != name(view) && b["roleRef"]["name"] != name(edit),
                    "{} binds an aggregated role",
                    name(b)
                );
            }
        }
        let docs = render_ok(helm, &["--set", "rbac.aggregateToDefaultRoles=false"]);
        assert!(!docs.iter().any(is_aggregated));
    });
}

#[test]
fn pod_disruption_budget_only_for_several_replicas() {
    with_helm(|helm| {
        assert!(docs_of_kind(&defaults(helm), "PodDisruptionBudget").is_empty());
        let docs = render_ok(helm, &["--set", "replicas=2"]);
        let pdb = one(&docs, "PodDisruptionBudget");
        assert_eq!(pdb["apiVersion"], "policy/v1");
        assert_eq!(namespace(pdb), NAMESPACE);
        assert_eq!(pdb["spec"]["maxUnavailable"], 1);
        assert!(pdb["spec"].get("minAvailable").is_none());
        assert_eq!(
            pdb["spec"]["selector"],
            one(&docs, "Deployment")["spec"]["selector"],
            "the PDB covers exactly the operator's pods"
        );
        let docs = render_ok(
            helm,
            &[
                "--set",
                "replicas=4",
                "--set",
                "podDisruptionBudget.maxUnavailable=50%",
            ],
        );
        assert_eq!(
            one(&docs, "PodDisruptionBudget")["spec"]["maxUnavailable"],
            "50%"
        );
        let docs = render_ok(
            helm,
            &[
                "--set",
                "replicas=2",
                "--set",
                "podDisruptionBudget.enabled=false",
            ],
        );
        assert!(docs_of_kind(&docs, "PodDisruptionBudget").is_empty());
        for docs in [namespaced(helm), options(helm)] {
            one(&docs, "PodDisruptionBudget");
        }
        // Zero replicas (RBAC only): no PDB either.
        let docs = render_ok(helm, &["--set", "replicas=0"]);
        assert!(docs_of_kind(&docs, "PodDisruptionBudget").is_empty());
    });
}

fn docs_of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

fn options(helm: &PathBuf) -> Vec<Value> {
    render_ok(helm, &["-f", OPTIONS_VALUES])
}

/// ci/options-values.yaml: the CA bundle is mounted and named, the credentials reach the
/// container, pull secrets, annotations, labels and probe timings reach the pod.
#[test]
fn extra_volumes_env_pull_secrets_annotations_and_probes_reach_the_pod() {
    with_helm(|helm| {
        let docs = options(helm);
        let deploy = one(&docs, "Deployment");
        let pod = &deploy["spec"]["template"];
        let spec = &pod["spec"];
        assert_eq!(
            spec["volumes"],
            json!([
                {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
                {"name": "rewrite-spill", "emptyDir": {}},
                {"name": "ca", "configMap": {"name": "keyshift-ca"}},
            ])
        );
        let c = container(&docs);
        assert_eq!(
            c["volumeMounts"],
            json!([
                {"name": "tmp", "mountPath": "/tmp"},
                {"name": "rewrite-spill", "mountPath": "/var/lib/keyshift/rewrite"},
                {"name": "ca", "mountPath": "/etc/keyshift-ca", "readOnly": true},
            ])
        );
        // The rewrite of a key-group change: its budget and spill directory.
        assert_eq!(env(&docs, "KEYSHIFT_REWRITE_MEMORY")["value"], "64Mi");
        assert_eq!(
            env(&docs, "KEYSHIFT_REWRITE_SPILL_DIR")["value"],
            "/var/lib/keyshift/rewrite"
        );
        // A budget of exactly half the memory limit, and one with no limit, render.
        for ok in [
            &["--set", "rewrite.memory=128Mi"][..],
            &[
                "--set",
                "rewrite.memory=1Gi",
                "--set",
                "resources.limits.memory=2Gi",
            ][..],
            &[
                "--set",
                "rewrite.memory=1Gi",
                "--set",
                "resources.limits=null",
            ][..],
        ] {
            let docs = render_ok(helm, ok);
            assert!(env(&docs, "KEYSHIFT_REWRITE_MEMORY")["value"].is_string());
        }
        let limited = render_ok(helm, &["--set", "rewrite.spillSizeLimit=20Gi"]);
        let volumes = &one(&limited, "Deployment")["spec"]["template"]["spec"]["volumes"];
        assert!(
            volumes.as_array().is_some_and(|v| v
                .contains(&json!({"name": "rewrite-spill", "emptyDir": {"sizeLimit": "20Gi"}}))),
            "{volumes}"
        );
        assert_eq!(
            env(&docs, "SSL_CERT_FILE")["value"],
            "/etc/keyshift-ca/ca.crt"
        );
        assert_eq!(
            c["envFrom"],
            json!([{"secretRef": {"name": "keyshift-s3"}}])
        );
        assert_eq!(spec["imagePullSecrets"], json!([{"name": "regcred"}]));
        assert_eq!(
            pod["metadata"]["annotations"],
            json!({"example.com/team": "streaming"})
        );
        let labels = &pod["metadata"]["labels"];
        assert_eq!(labels["azure.workload.identity/use"], "true");
        for (k, v) in deploy["spec"]["selector"]["matchLabels"]
            .as_object()
            .unwrap()
        {
            assert_eq!(&labels[k], v, "the selector still matches the pod");
        }
        assert_eq!(
            one(&docs, "ServiceAccount")["metadata"]["annotations"],
            json!({"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/keyshift-operator"})
        );
        assert_eq!(
            c["livenessProbe"],
            json!({"httpGet": {"path": "/healthz", "port": 8080}, "initialDelaySeconds": 10,
                   "periodSeconds": 30, "timeoutSeconds": 3, "failureThreshold": 4})
        );
        assert_eq!(
            c["readinessProbe"],
            json!({"httpGet": {"path": "/readyz", "port": 8080}, "initialDelaySeconds": 1,
                   "periodSeconds": 5, "timeoutSeconds": 2, "failureThreshold": 2})
        );

        // podLabels cannot take the selector's labels over.
        let docs = render_ok(
            helm,
            &[
                "--set-json",
                r#"podLabels={"app.kubernetes.io/instance":"other","x":"y"}"#,
            ],
        );
        let labels = &one(&docs, "Deployment")["spec"]["template"]["metadata"]["labels"];
        assert_eq!(labels["app.kubernetes.io/instance"], RELEASE);
        assert_eq!(labels["x"], "y");

        // Defaults: nothing extra (/tmp and the rewrite spill directory).
        let docs = defaults(helm);
        let spec = &one(&docs, "Deployment")["spec"]["template"]["spec"];
        assert_eq!(spec["volumes"].as_array().map(Vec::len), Some(2));
        assert!(spec.get("imagePullSecrets").is_none());
        assert!(container(&docs).get("envFrom").is_none());
    });
}

/// `helm test`: a restricted Pod from the operator's image probes every ready endpoint of the
/// metrics Service; its ServiceAccount may only list EndpointSlices; all of it goes away once
/// it passes.
#[test]
fn test_hook_is_restricted_and_probes_the_operator() {
    with_helm(|helm| {
        for docs in [defaults(helm), namespaced(helm), options(helm)] {
            let hooks: Vec<&Value> = docs.iter().filter(|d| is_test_hook(d)).collect();
            let kinds: BTreeSet<&str> = hooks.iter().map(|d| d["kind"].as_str().unwrap()).collect();
            assert_eq!(
                kinds,
                BTreeSet::from(["Pod", "ServiceAccount", "Role", "RoleBinding"])
            );
            assert_eq!(hooks.len(), 4);
            for h in &hooks {
                assert_eq!(namespace(h), NAMESPACE);
                let policy = h["metadata"]["annotations"]["helm.sh/hook-delete-policy"]
                    .as_str()
                    .unwrap_or_default();
                assert!(
                    policy.contains("hook-succeeded") && policy.contains("before-hook-creation"),
                    "{}: {policy}",
                    name(h)
                );
            }
            let of = |kind: &str| *hooks.iter().find(|d| d["kind"] == kind).unwrap();
            let (pod, sa, role, binding) = (
                of("Pod"),
                of("ServiceAccount"),
                of("Role"),
                of("RoleBinding"),
            );
            assert_eq!(
                rules(role),
                expect_rules(&[("discovery.k8s.io", "endpointslices", &["list"])])
            );
            assert!(role["rules"][0].get("resourceNames").is_none());
            assert_eq!(binding["roleRef"]["name"], name(role));
            assert_eq!(
                binding["subjects"],
                json!([{"kind": "ServiceAccount", "name": name(sa), "namespace": NAMESPACE}])
            );
            let spec = &pod["spec"];
            assert_eq!(spec["serviceAccountName"], name(sa));
            assert_eq!(spec["restartPolicy"], "Never");
            // Pod Security `restricted`.
            let psc = &spec["securityContext"];
            assert_eq!(psc["runAsNonRoot"], true);
            assert_eq!(psc["runAsUser"], 65532);
            assert_eq!(psc["seccompProfile"]["type"], "RuntimeDefault");
            assert!(spec.get("hostNetwork").is_none() && spec.get("volumes").is_none());
            let containers = spec["containers"].as_array().unwrap();
            assert_eq!(containers.len(), 1);
            let c = &containers[0];
            let sc = &c["securityContext"];
            assert_eq!(sc["runAsNonRoot"], true);
            assert_eq!(sc["readOnlyRootFilesystem"], true);
            assert_eq!(sc["allowPrivilegeEscalation"], false);
            assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
            assert!(sc["capabilities"].get("add").is_none());
            assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault");
            // The operator's image, probing the metrics Service's port by name.
            assert_eq!(c["image"], container(&docs)["image"]);
            let svc = one(&docs, "Service");
            assert_eq!(svc["spec"]["ports"][0]["name"], "metrics");
            let a: Vec<&str> = c["args"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap())
                .collect();
            assert_eq!(a[0], "probe");
            for want in [
                format!("--service={}", name(svc)),
                format!("--namespace={NAMESPACE}"),
                "--port=metrics".to_owned(),
                "/readyz".to_owned(),
                "/metrics".to_owned(),
            ] {
                assert!(a.contains(&want.as_str()), "{want} in {a:?}");
            }
        }
        let docs = options(helm);
        let pod = docs
            .iter()
            .find(|d| is_test_hook(d) && d["kind"] == "Pod")
            .unwrap();
        assert_eq!(
            pod["spec"]["imagePullSecrets"],
            json!([{"name": "regcred"}])
        );
        assert!(
            pod["spec"]["containers"][0]["args"]
                .as_array()
                .unwrap()
                .contains(&json!("--timeout=30"))
        );

        let docs = render_ok(helm, &["--set", "tests.enabled=false"]);
        assert!(!docs.iter().any(is_test_hook));
    });
}

const MONITORING_VALUES: &str = "charts/keyshift/ci/monitoring-values.yaml";
const MONITORING_APIS: [&str; 6] = [
    "--api-versions",
    "monitoring.coreos.com/v1/ServiceMonitor",
    "--api-versions",
    "monitoring.coreos.com/v1/PodMonitor",
    "--api-versions",
    "monitoring.coreos.com/v1/PrometheusRule",
];

/// Prometheus' name for a pod label in service discovery (`__meta_kubernetes_pod_label_<name>`,
/// every character outside `[a-zA-Z0-9_]` an underscore).
fn pod_label_meta(label: &str) -> String {
    let sanitized: String = label
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    format!("__meta_kubernetes_pod_label_{sanitized}")
}

/// The monitoring objects are opt-in; when on, the PodMonitor selects the worker pods the
/// operator creates (their labels and control port as `src/operator/desired.rs` names them) and
/// turns their job and subtask labels into `streamjob` and `subtask`; the dashboard ConfigMap
/// carries the sidecar label and the committed dashboard; the PrometheusRule has the four
/// alerts; each needs its API served.
#[test]
fn monitoring_objects_are_opt_in_and_select_the_workers() {
    use keyshift::operator::desired::{LABEL_JOB, LABEL_SUBTASK};
    with_helm(|helm| {
        let docs = defaults(helm);
        for kind in ["PodMonitor", "PrometheusRule"] {
            assert!(of_kind(&docs, kind).is_empty(), "no {kind} by default");
        }
        assert!(
            of_kind(&docs, "ConfigMap").is_empty(),
            "no dashboard by default"
        );

        let mut args = vec!["-f", MONITORING_VALUES];
        args.extend(MONITORING_APIS);
        let docs = render_ok(helm, &args);
        let pm = one(&docs, "PodMonitor");
        assert_eq!(namespace(pm), NAMESPACE);
        assert_eq!(
            pm["spec"]["selector"],
            json!({
                "matchLabels": {"app.kubernetes.io/managed-by": "keyshift"},
                "matchExpressions": [{"key": LABEL_JOB, "operator": "Exists"}]
            })
        );
        assert_eq!(pm["spec"]["namespaceSelector"], json!({"any": true}));
        let endpoint = &pm["spec"]["podMetricsEndpoints"][0];
        assert_eq!(endpoint["port"], "control");
        assert_eq!(endpoint["path"], "/metrics");
        assert_eq!(
            endpoint["relabelings"],
            json!([
                {"sourceLabels": [pod_label_meta(LABEL_JOB)], "targetLabel": "streamjob"},
                {"sourceLabels": [pod_label_meta(LABEL_SUBTASK)], "targetLabel": "subtask"}
            ])
        );
        let rule = one(&docs, "PrometheusRule");
        let alerts: Vec<&str> = rule["spec"]["groups"][0]["rules"]
            .as_array()
            .expect("rules")
            .iter()
            .filter_map(|r| r["alert"].as_str())
            .collect();
        assert_eq!(
            alerts,
            [
                "KeyshiftCheckpointTooOld",
                "KeyshiftRescaleStuck",
                "KeyshiftJobRestartLoop",
                "KeyshiftJobStalled",
                "KeyshiftSourceLagging",
                "KeyshiftCheckpointsFailing",
                "KeyshiftKafkaUnreachable",
                "KeyshiftSinkBehind",
            ]
        );
        let cm = one(&docs, "ConfigMap");
        assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
        let committed: Value = serde_json::from_str(
            &std::fs::read_to_string(root().join("charts/keyshift/dashboards/keyshift.json"))
                .expect("dashboard"),
        )
        .expect("the dashboard is JSON");
        let shipped: Value = serde_json::from_str(
            cm["data"]["keyshift.json"]
                .as_str()
                .expect("dashboard data"),
        )
        .expect("the shipped dashboard is JSON");
        assert_eq!(shipped, committed);
        // The operator's ServiceMonitor keeps the job's namespace label.
        assert_eq!(
            one(&docs, "ServiceMonitor")["spec"]["endpoints"][0]["honorLabels"],
            true
        );
        // The watched namespaces bound the PodMonitor.
        let mut args = vec![
            "-f",
            MONITORING_VALUES,
            "--set-json",
            r#"watchNamespaces=["team-a","team-b"]"#,
        ];
        args.extend(MONITORING_APIS);
        let docs = render_ok(helm, &args);
        assert_eq!(
            one(&docs, "PodMonitor")["spec"]["namespaceSelector"],
            json!({"matchNames": ["team-a", "team-b"]})
        );

        // Without the Prometheus Operator's APIs, rendering says what is missing.
        for (set, api) in [
            ("monitoring.podMonitor.enabled=true", "PodMonitor"),
            ("monitoring.prometheusRule.enabled=true", "PrometheusRule"),
        ] {
            let err = render(helm, &["--set", set]).expect_err("refused without the CRDs");
            assert!(
                err.contains(&format!("does not serve monitoring.coreos.com/v1 {api}")),
                "{err}"
            );
        }
        // Thresholds are checked by the schema.
        let err = render(
            helm,
            &["--set", "monitoring.prometheusRule.restartWindow=soon"],
        )
        .expect_err("refused");
        assert!(err.contains("restartWindow"), "{err}");
    });
}
