//! Pure: the objects a StreamJob should own (worker pods, the control-token Secret, the
//! NetworkPolicy in front of its workers), built from its spec and the run being started. No I/O.

use crate::crd::StreamJob;
use crate::telemetry::LogFormat;
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EmptyDirVolumeSource, EnvFromSource, EnvVar,
    EnvVarSource, HTTPGetAction, Pod, PodSecurityContext, PodSpec, Probe, ResourceRequirements,
    SeccompProfile, Secret, SecretEnvSource, SecretKeySelector, SecurityContext, Volume,
    VolumeMount,
};
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
    NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use keyshift_core::keygroup::Assignment;
use kube::{Resource, ResourceExt};
use std::collections::BTreeMap;

/// The operator's field manager (server-side apply) and event reporter.
pub const MANAGER: &str = "keyshift-operator";
/// The finalizer that removes a job's pods before the StreamJob goes away.
pub const FINALIZER: &str = "keyshift.dev/cleanup";
pub const LABEL_JOB: &str = "keyshift.dev/job";
pub const LABEL_RUN: &str = "keyshift.dev/run";
pub const LABEL_SUBTASK: &str = "keyshift.dev/subtask";
pub const LABEL_PARALLELISM: &str = "keyshift.dev/parallelism";
/// The key-group count the pod's run was started under.
pub const LABEL_MAX_PARALLELISM: &str = "keyshift.dev/max-parallelism";
/// The `orchestrator::settings::spec_hash` (job and image) a pod was created for.
pub const LABEL_SPEC_HASH: &str = "keyshift.dev/spec-hash";
pub const ANNOTATION_KEY_GROUPS: &str = "keyshift.dev/key-groups";
/// Key of the control token in the job's Secret.
pub const TOKEN_KEY: &str = "token";
pub use keyshift_core::worker_pod::{
    CONTROL_PORT, DATA_PORT, ENV_LOG_FORMAT, ENV_POD_IP, ENV_SUBTASK, ENV_TOKEN, RESERVED_ENV,
    SCRATCH_PATH, SCRATCH_VOLUME,
};
/// The non-root UID and GID the workers run as (the image's user, 65532 as in distroless).
pub const WORKER_UID: i64 = 65532;
/// Resource requests of a worker container when spec.resources is unset (no limits).
pub const DEFAULT_CPU_REQUEST: &str = "100m";
pub const DEFAULT_MEMORY_REQUEST: &str = "128Mi";

/// The label every namespace carries with its own name (set by the API server).
pub const LABEL_NAMESPACE_NAME: &str = "kubernetes.io/metadata.name";
/// The operator pods' labels when none are configured: the chart's selector labels of a release
/// named `keyshift` (`--operator-pod-labels` / `KEYSHIFT_OPERATOR_POD_LABELS`).
pub const DEFAULT_OPERATOR_POD_LABELS: &str =
    "app.kubernetes.io/name=keyshift,app.kubernetes.io/component=operator";

/// Who may reach a job's workers besides the job's own workers: the `from` side of the
/// NetworkPolicy the operator creates for every job.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NetworkPolicyConfig {
    /// Namespace of the operator's pods (`POD_NAMESPACE`, the downward API). `None` (an operator
    /// that does not run in a pod, or does not know its namespace): the peer is the job's own
    /// namespace.
    pub operator_namespace: Option<String>,
    /// Labels of the operator's pods (never empty: an empty selector would admit every pod).
    pub operator_pod_labels: BTreeMap<String, String>,
    /// Extra peers admitted to the control port, which also serves the workers' `/metrics` (for
    /// example the monitoring namespace). Every control call but `/metrics` and `/v1/readyz`
    /// still needs the job's token.
    pub metrics_from: Vec<NetworkPolicyPeer>,
}

/// Problems building the desired objects (a StreamJob without name or namespace).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DesiredError {
    #[error("the StreamJob has no {0}")]
    Missing(&'static str),
    #[error(
        "no operator pod labels for the NetworkPolicy's `from` selector: set --operator-pod-labels (KEYSHIFT_OPERATOR_POD_LABELS), or disable the policy with --network-policy=false"
    )]
    NoOperatorLabels,
}

/// Name and namespace of a job.
pub fn job_key(job: &StreamJob) -> Result<(String, String), DesiredError> {
    let ns = job.namespace().ok_or(DesiredError::Missing("namespace"))?;
    let name = job
        .metadata
        .name
        .clone()
        .ok_or(DesiredError::Missing("name"))?;
    Ok((ns, name))
}

/// The label selector of a job's worker pods (status.selector, the scale subresource's).
pub fn selector(job_name: &str) -> String {
    format!("{LABEL_JOB}={job_name}")
}

/// Name of the Secret holding a job's control token.
pub fn secret_name(job_name: &str) -> String {
    format!("{job_name}-control")
}

/// Name of the pod of `subtask` in `run`.
pub fn pod_name(job_name: &str, run: &str, subtask: u32) -> String {
    format!("{job_name}-{run}-{subtask}")
}

/// Name of the NetworkPolicy in front of a job's workers.
pub fn network_policy_name(job_name: &str) -> String {
    format!("{job_name}-workers")
}

fn owner(job: &StreamJob) -> Result<OwnerReference, DesiredError> {
    job.controller_owner_ref(&())
        .ok_or(DesiredError::Missing("uid"))
}

/// The Secret with the control token workers require on every control call.
pub fn secret(job: &StreamJob, token: &str) -> Result<Secret, DesiredError> {
    let (ns, name) = job_key(job)?;
    Ok(Secret {
        metadata: ObjectMeta {
            name: Some(secret_name(&name)),
            namespace: Some(ns),
            labels: Some(BTreeMap::from([(LABEL_JOB.to_owned(), name.clone())])),
            owner_references: Some(vec![owner(job)?]),
            ..Default::default()
        },
        string_data: Some(BTreeMap::from([(TOKEN_KEY.to_owned(), token.to_owned())])),
        type_: Some("Opaque".into()),
        ..Default::default()
    })
}

/// The NetworkPolicy of a job: its worker pods (every run's) accept the data port (shuffle) only
/// from the job's own workers, and the control port (control API, readiness, `/metrics`) only
/// from the operator's pods and `config.metrics_from`. Nothing else reaches them (traffic from
/// the pod's own node, such as the kubelet's probes, is always allowed). Egress is not
/// restricted: workers reach their object store.
pub fn network_policy(
    job: &StreamJob,
    config: &NetworkPolicyConfig,
) -> Result<NetworkPolicy, DesiredError> {
    let (ns, name) = job_key(job)?;
    if config.operator_pod_labels.is_empty() {
        return Err(DesiredError::NoOperatorLabels);
    }
    let job_labels = BTreeMap::from([(LABEL_JOB.to_owned(), name.clone())]);
    let workers = LabelSelector {
        match_labels: Some(job_labels.clone()),
        ..Default::default()
    };
    let port = |p: u16| NetworkPolicyPort {
        protocol: Some("TCP".into()),
        port: Some(IntOrString::Int(i32::from(p))),
        ..Default::default()
    };
    let operator_ns = config
        .operator_namespace
        .clone()
        .unwrap_or_else(|| ns.clone());
    let operator = NetworkPolicyPeer {
        namespace_selector: Some(LabelSelector {
            match_labels: Some(BTreeMap::from([(
                LABEL_NAMESPACE_NAME.to_owned(),
                operator_ns,
            )])),
            ..Default::default()
        }),
        pod_selector: Some(LabelSelector {
            match_labels: Some(config.operator_pod_labels.clone()),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut control_from = vec![operator];
    control_from.extend(config.metrics_from.iter().cloned());
    Ok(NetworkPolicy {
        metadata: ObjectMeta {
            name: Some(network_policy_name(&name)),
            namespace: Some(ns),
            labels: Some(job_labels),
            owner_references: Some(vec![owner(job)?]),
            ..Default::default()
        },
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(workers.clone()),
            policy_types: Some(vec!["Ingress".into()]),
            ingress: Some(vec![
                NetworkPolicyIngressRule {
                    from: Some(vec![NetworkPolicyPeer {
                        pod_selector: Some(workers),
                        ..Default::default()
                    }]),
                    ports: Some(vec![port(DATA_PORT)]),
                },
                NetworkPolicyIngressRule {
                    from: Some(control_from),
                    ports: Some(vec![port(CONTROL_PORT)]),
                },
            ]),
            egress: None,
        }),
    })
}

/// One worker pod: subtask `subtask` of `assignment` in run `run`.
pub fn pod(
    job: &StreamJob,
    run: &str,
    subtask: u32,
    assignment: Assignment,
    image: &str,
    log_format: LogFormat,
) -> Result<Pod, DesiredError> {
    let (ns, name) = job_key(job)?;
    let spec = &job.spec;
    let overrides = spec.pod_template.clone().unwrap_or_default();
    let mut labels = overrides.labels.clone();
    labels.extend([
        (LABEL_JOB.to_owned(), name.clone()),
        (LABEL_RUN.to_owned(), run.to_owned()),
        (LABEL_SUBTASK.to_owned(), subtask.to_string()),
        (
            LABEL_PARALLELISM.to_owned(),
            assignment.parallelism().to_string(),
        ),
        (
            LABEL_MAX_PARALLELISM.to_owned(),
            assignment.max_parallelism().to_string(),
        ),
        (
            LABEL_SPEC_HASH.to_owned(),
            crate::orchestrator::settings::spec_hash(spec),
        ),
        (
            "app.kubernetes.io/managed-by".to_owned(),
            "keyshift".to_owned(),
        ),
    ]);
    let mut annotations = overrides.annotations.clone();
    if let Some(range) = assignment.ranges().get(subtask as usize) {
        annotations.insert(ANNOTATION_KEY_GROUPS.to_owned(), range.to_string());
    }
    let mut env = vec![EnvVar {
        name: ENV_POD_IP.into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(k8s_openapi::api::core::v1::ObjectFieldSelector {
                field_path: "status.podIP".into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }];
    env.push(EnvVar {
        name: ENV_TOKEN.into(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret_name(&name),
                key: TOKEN_KEY.into(),
                optional: Some(false),
            }),
            ..Default::default()
        }),
        ..Default::default()
    });
    env.push(EnvVar {
        name: ENV_SUBTASK.into(),
        value: Some(subtask.to_string()),
        ..Default::default()
    });
    // Kafka credentials: one variable per key of the credentials Secret a Kafka client uses
    // (crate::job::kafka::credential_env), never the whole Secret.
    let kafka_credentials = [
        (
            crate::job::kafka::Role::Source,
            spec.job
                .source
                .kafka
                .as_ref()
                .and_then(|k| k.credentials.as_ref()),
        ),
        (
            crate::job::kafka::Role::Sink,
            spec.job
                .sink
                .kafka
                .as_ref()
                .and_then(|k| k.credentials.as_ref()),
        ),
    ];
    for (role, creds) in kafka_credentials {
        for e in creds
            .map(|c| crate::job::kafka::credential_env(role, c))
            .unwrap_or_default()
        {
            env.push(EnvVar {
                name: e.env,
                value_from: Some(EnvVarSource {
                    secret_key_ref: Some(SecretKeySelector {
                        name: e.secret,
                        key: e.key,
                        optional: Some(false),
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            });
        }
    }
    // The operator's log format, unless the job sets the workers' own.
    if !overrides.env.iter().any(|e| e.name == ENV_LOG_FORMAT) {
        env.push(EnvVar {
            name: ENV_LOG_FORMAT.into(),
            value: Some(
                match log_format {
                    LogFormat::Json => "json",
                    LogFormat::Text => "text",
                }
                .into(),
            ),
            ..Default::default()
        });
    }
    // The user's extra variables come after the operator's (validation refuses reserved
    // names), so their values may reference $(POD_IP).
    env.extend(overrides.env.iter().cloned());
    let env_from = spec.state.credentials_secret.as_ref().map(|s| {
        vec![EnvFromSource {
            secret_ref: Some(SecretEnvSource {
                name: s.clone(),
                optional: Some(false),
            }),
            ..Default::default()
        }]
    });
    let mut volume_mounts = vec![VolumeMount {
        name: SCRATCH_VOLUME.into(),
        mount_path: SCRATCH_PATH.into(),
        ..Default::default()
    }];
    volume_mounts.extend(overrides.volume_mounts.iter().cloned());
    let mut volumes = vec![Volume {
        name: SCRATCH_VOLUME.into(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Default::default()
    }];
    volumes.extend(overrides.volumes.iter().cloned());
    let container = Container {
        name: "worker".into(),
        image: Some(spec.image.clone().unwrap_or_else(|| image.to_owned())),
        // No command: the image's ENTRYPOINT (`/keyshift` in ours, and in any image built
        // `FROM` it) runs with these arguments.
        args: Some(vec![
            "worker".into(),
            "--control-addr".into(),
            // The pod's own address: pods that share a network namespace (the test kubelet)
            // must not collide on the ports.
            format!("$(POD_IP):{CONTROL_PORT}"),
            "--data-addr".into(),
            format!("$(POD_IP):{DATA_PORT}"),
        ]),
        env: Some(env),
        env_from,
        ports: Some(vec![
            ContainerPort {
                name: Some("control".into()),
                container_port: i32::from(CONTROL_PORT),
                ..Default::default()
            },
            ContainerPort {
                name: Some("data".into()),
                container_port: i32::from(DATA_PORT),
                ..Default::default()
            },
        ]),
        readiness_probe: Some(Probe {
            http_get: Some(HTTPGetAction {
                path: Some("/v1/readyz".into()),
                port: IntOrString::Int(i32::from(CONTROL_PORT)),
                ..Default::default()
            }),
            period_seconds: Some(2),
            ..Default::default()
        }),
        resources: Some(spec.resources.clone().unwrap_or_else(default_resources)),
        security_context: Some(container_security_context()),
        volume_mounts: Some(volume_mounts),
        ..Default::default()
    };
    Ok(Pod {
        metadata: ObjectMeta {
            name: Some(pod_name(&name, run, subtask)),
            namespace: Some(ns),
            labels: Some(labels),
            annotations: (!annotations.is_empty()).then_some(annotations),
            owner_references: Some(vec![owner(job)?]),
            ..Default::default()
        },
        spec: Some(PodSpec {
            containers: vec![container],
            // A worker that exits is not restarted in place: its in-memory state is gone, so
            // the operator restarts the whole job from the last checkpoint.
            restart_policy: Some("Never".into()),
            termination_grace_period_seconds: Some(10),
            node_selector: (!overrides.node_selector.is_empty())
                .then_some(overrides.node_selector.clone()),
            service_account_name: overrides.service_account_name.clone(),
            automount_service_account_token: Some(false),
            security_context: Some(pod_security_context()),
            volumes: Some(volumes),
            tolerations: non_empty(&overrides.tolerations),
            affinity: overrides.affinity.clone(),
            topology_spread_constraints: non_empty(&overrides.topology_spread_constraints),
            priority_class_name: overrides.priority_class_name.clone(),
            image_pull_secrets: non_empty(&overrides.image_pull_secrets),
            ..Default::default()
        }),
        status: None,
    })
}

fn non_empty<T: Clone>(items: &[T]) -> Option<Vec<T>> {
    (!items.is_empty()).then(|| items.to_vec())
}

/// Requests when spec.resources is unset: [`DEFAULT_CPU_REQUEST`], [`DEFAULT_MEMORY_REQUEST`],
/// no limits.
pub fn default_resources() -> ResourceRequirements {
    ResourceRequirements {
        requests: Some(BTreeMap::from([
            ("cpu".to_owned(), Quantity(DEFAULT_CPU_REQUEST.to_owned())),
            (
                "memory".to_owned(),
                Quantity(DEFAULT_MEMORY_REQUEST.to_owned()),
            ),
        ])),
        ..Default::default()
    }
}

/// The pod half of Pod Security `restricted`: a non-root UID/GID (also owning the volumes that
/// support ownership, through fsGroup) and the runtime's default seccomp profile.
fn pod_security_context() -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(WORKER_UID),
        run_as_group: Some(WORKER_UID),
        fs_group: Some(WORKER_UID),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The container half: no privilege escalation, no capabilities, a read-only root filesystem
/// (scratch space is the emptyDir at /tmp).
fn container_security_context() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            ..Default::default()
        }),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(true),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::job;

    #[test]
    fn pod_carries_identity_token_ports_probe_and_owner() {
        let j = job();
        let a = Assignment::new(4, 128).unwrap();
        let p = pod(&j, "r1", 2, a, "keyshift:dev", LogFormat::Text).unwrap();
        assert_eq!(p.metadata.name.as_deref(), Some("clicks-r1-2"));
        let labels = p.metadata.labels.clone().unwrap();
        assert_eq!(labels[LABEL_JOB], "clicks");
        assert_eq!(labels[LABEL_RUN], "r1");
        assert_eq!(labels[LABEL_SUBTASK], "2");
        assert_eq!(labels[LABEL_PARALLELISM], "4");
        assert_eq!(labels[LABEL_MAX_PARALLELISM], "128");
        assert_eq!(labels["team"], "a");
        assert_eq!(
            p.metadata.annotations.unwrap()[ANNOTATION_KEY_GROUPS],
            "64-95"
        );
        let owner = &p.metadata.owner_references.unwrap()[0];
        assert_eq!(owner.kind, "StreamJob");
        assert_eq!(owner.controller, Some(true));
        let spec = p.spec.unwrap();
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        assert_eq!(spec.node_selector.unwrap()["disk"], "ssd");
        let c = &spec.containers[0];
        assert_eq!(c.image.as_deref(), Some("keyshift:dev"));
        assert_eq!(c.args.as_ref().unwrap()[0], "worker");
        let env = c.env.as_ref().unwrap();
        let token = env.iter().find(|e| e.name == "KEYSHIFT_TOKEN").unwrap();
        let sel = token
            .value_from
            .as_ref()
            .unwrap()
            .secret_key_ref
            .as_ref()
            .unwrap();
        assert_eq!(sel.name, "clicks-control");
        assert_eq!(
            c.env_from.as_ref().unwrap()[0]
                .secret_ref
                .as_ref()
                .unwrap()
                .name,
            "s3creds"
        );
        let probe = c
            .readiness_probe
            .as_ref()
            .unwrap()
            .http_get
            .as_ref()
            .unwrap();
        assert_eq!(probe.path.as_deref(), Some("/v1/readyz"));
        assert_eq!(c.ports.as_ref().unwrap().len(), 2);
    }

    #[test]
    fn worker_runs_the_image_entrypoint_under_restricted_pod_security() {
        let j = job();
        let a = Assignment::new(4, 128).unwrap();
        let p = pod(&j, "r1", 0, a, "keyshift:dev", LogFormat::Text).unwrap();
        let spec = p.spec.unwrap();
        let c = &spec.containers[0];
        // The image's ENTRYPOINT (/keyshift) runs: a bare `keyshift` is not on any PATH of a
        // scratch image.
        assert_eq!(c.command, None);
        assert_eq!(
            c.args.as_deref().unwrap(),
            [
                "worker",
                "--control-addr",
                "$(POD_IP):9090",
                "--data-addr",
                "$(POD_IP):9091"
            ]
        );
        let psc = spec.security_context.as_ref().unwrap();
        assert_eq!(psc.run_as_non_root, Some(true));
        assert_eq!(psc.run_as_user, Some(65532));
        assert_eq!(psc.run_as_group, Some(65532));
        assert_eq!(psc.fs_group, Some(65532));
        assert_eq!(
            psc.seccomp_profile.as_ref().unwrap().type_,
            "RuntimeDefault"
        );
        let csc = c.security_context.as_ref().unwrap();
        assert_eq!(csc.allow_privilege_escalation, Some(false));
        assert_eq!(
            csc.capabilities.as_ref().unwrap().drop.as_deref(),
            Some(&["ALL".to_owned()][..])
        );
        assert_eq!(csc.read_only_root_filesystem, Some(true));
        assert_eq!(csc.run_as_non_root, Some(true));
        assert_eq!(csc.privileged, None);
        assert_eq!(spec.automount_service_account_token, Some(false));
        // Scratch space on the read-only root filesystem: an emptyDir at /tmp.
        let volumes = spec.volumes.as_ref().unwrap();
        assert_eq!(volumes.len(), 1);
        assert_eq!(volumes[0].name, "tmp");
        assert!(volumes[0].empty_dir.is_some());
        let mounts = c.volume_mounts.as_ref().unwrap();
        assert_eq!(mounts.len(), 1);
        assert_eq!(
            (mounts[0].name.as_str(), mounts[0].mount_path.as_str()),
            ("tmp", "/tmp")
        );
        // Default requests, no limits.
        let resources = c.resources.as_ref().unwrap();
        let requests = resources.requests.as_ref().unwrap();
        assert_eq!(requests["cpu"].0, "100m");
        assert_eq!(requests["memory"].0, "128Mi");
        assert_eq!(resources.limits, None);
        // Only the operator's variables: the reserved ones, then the log format (which a job may
        // set for its workers instead).
        let names: Vec<&str> = c.env.iter().flatten().map(|e| e.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "POD_IP",
                "KEYSHIFT_TOKEN",
                "KEYSHIFT_SUBTASK",
                "KEYSHIFT_LOG_FORMAT"
            ]
        );
        assert!(names[..3].iter().all(|n| RESERVED_ENV.contains(n)));
        for unset in [
            spec.tolerations.is_some(),
            spec.affinity.is_some(),
            spec.topology_spread_constraints.is_some(),
            spec.priority_class_name.is_some(),
            spec.image_pull_secrets.is_some(),
        ] {
            assert!(!unset);
        }
    }

    #[test]
    fn kafka_credentials_reach_the_worker_as_single_secret_keys() {
        let mut j = job();
        j.spec.job.source.generator = None;
        j.spec.job.source.kafka = Some(
            serde_yaml::from_str(
                "{bootstrapServers: 'k:9093', topics: [in], credentials: {secretName: kc, sasl: {passwordKey: pw}, tls: {caKey: ca.crt}}}",
            )
            .unwrap(),
        );
        let a = Assignment::new(4, 128).unwrap();
        let p = pod(&j, "r1", 0, a, "keyshift:dev", LogFormat::Text).unwrap();
        let env = p.spec.unwrap().containers[0].env.clone().unwrap();
        let refs: Vec<(String, String, String)> = env
            .iter()
            .filter(|e| e.name.starts_with("KEYSHIFT_KAFKA_"))
            .map(|e| {
                let r = e
                    .value_from
                    .as_ref()
                    .and_then(|v| v.secret_key_ref.as_ref())
                    .unwrap();
                (e.name.clone(), r.name.clone(), r.key.clone())
            })
            .collect();
        let want = [
            ("KEYSHIFT_KAFKA_SOURCE_SASL_USERNAME", "kc", "username"),
            ("KEYSHIFT_KAFKA_SOURCE_SASL_PASSWORD", "kc", "pw"),
            ("KEYSHIFT_KAFKA_SOURCE_TLS_CA", "kc", "ca.crt"),
        ]
        .map(|(a, b, c)| (a.to_owned(), b.to_owned(), c.to_owned()));
        assert_eq!(refs, want);
    }

    #[test]
    fn resources_when_set_replace_the_default_requests() {
        let mut j = job();
        j.spec.resources =
            Some(serde_yaml::from_str("{requests: {cpu: '2'}, limits: {memory: 1Gi}}").unwrap());
        let a = Assignment::new(4, 128).unwrap();
        let p = pod(&j, "r1", 0, a, "keyshift:dev", LogFormat::Text).unwrap();
        let r = p.spec.unwrap().containers[0].resources.clone().unwrap();
        assert_eq!(r.requests.unwrap()["cpu"].0, "2");
        assert_eq!(r.limits.unwrap()["memory"].0, "1Gi");
        // `resources: {}` asks for none.
        j.spec.resources = Some(Default::default());
        let p = pod(&j, "r1", 0, a, "keyshift:dev", LogFormat::Text).unwrap();
        let r = p.spec.unwrap().containers[0].resources.clone().unwrap();
        assert_eq!((r.requests, r.limits), (None, None));
    }

    #[test]
    fn workers_log_in_the_operators_format_unless_the_job_sets_theirs() {
        let env_of = |p: Pod| -> Vec<(String, Option<String>)> {
            p.spec.unwrap().containers[0]
                .env
                .clone()
                .unwrap_or_default()
                .into_iter()
                .filter(|e| e.name == ENV_LOG_FORMAT)
                .map(|e| (e.name, e.value))
                .collect()
        };
        let a = Assignment::new(4, 128).unwrap();
        let mut j = job();
        for (format, value) in [(LogFormat::Json, "json"), (LogFormat::Text, "text")] {
            let p = pod(&j, "r1", 0, a, "keyshift:dev", format).unwrap();
            assert_eq!(
                env_of(p),
                [(ENV_LOG_FORMAT.to_owned(), Some(value.to_owned()))]
            );
        }
        // The job's own setting is the one the worker sees (once, not beside the operator's).
        j.spec.pod_template = Some(
            serde_yaml::from_str("{env: [{name: KEYSHIFT_LOG_FORMAT, value: text}]}").unwrap(),
        );
        let p = pod(&j, "r1", 0, a, "keyshift:dev", LogFormat::Json).unwrap();
        assert_eq!(
            env_of(p),
            [(ENV_LOG_FORMAT.to_owned(), Some("text".to_owned()))]
        );
    }

    #[test]
    fn pod_template_fields_land_in_the_pod() {
        let mut j = job();
        j.spec.pod_template = Some(
            serde_yaml::from_str(
                "labels: {team: a}
volumes:
- name: ca
  configMap: {name: corp-ca}
- name: data
  persistentVolumeClaim: {claimName: in}
volumeMounts:
- {name: ca, mountPath: /etc/corp-ca, readOnly: true}
- {name: data, mountPath: /data}
env:
- {name: SSL_CERT_FILE, value: /etc/corp-ca/ca.crt}
- {name: KEYSHIFT_ENCODE_THREADS, value: '2'}
tolerations:
- {key: dedicated, operator: Equal, value: streaming, effect: NoSchedule}
affinity:
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms:
      - matchExpressions:
        - {key: disk, operator: In, values: [ssd]}
topologySpreadConstraints:
- maxSkew: 1
  topologyKey: topology.kubernetes.io/zone
  whenUnsatisfiable: ScheduleAnyway
  labelSelector: {matchLabels: {keyshift.dev/job: clicks}}
priorityClassName: streaming-high
imagePullSecrets:
- name: registry-creds
",
            )
            .unwrap(),
        );
        let a = Assignment::new(4, 128).unwrap();
        let p = pod(&j, "r1", 1, a, "keyshift:dev", LogFormat::Text).unwrap();
        let spec = p.spec.unwrap();
        let volumes: Vec<&str> = spec
            .volumes
            .iter()
            .flatten()
            .map(|v| v.name.as_str())
            .collect();
        assert_eq!(volumes, ["tmp", "ca", "data"]);
        let vols = spec.volumes.as_ref().unwrap();
        assert_eq!(vols[1].config_map.as_ref().unwrap().name, "corp-ca");
        assert_eq!(
            vols[2].persistent_volume_claim.as_ref().unwrap().claim_name,
            "in"
        );
        let c = &spec.containers[0];
        let mounts: Vec<(&str, &str, Option<bool>)> = c
            .volume_mounts
            .iter()
            .flatten()
            .map(|m| (m.name.as_str(), m.mount_path.as_str(), m.read_only))
            .collect();
        assert_eq!(
            mounts,
            [
                ("tmp", "/tmp", None),
                ("ca", "/etc/corp-ca", Some(true)),
                ("data", "/data", None)
            ]
        );
        let env: Vec<(&str, Option<&str>)> = c
            .env
            .iter()
            .flatten()
            .map(|e| (e.name.as_str(), e.value.as_deref()))
            .collect();
        assert_eq!(
            env[4..],
            [
                ("SSL_CERT_FILE", Some("/etc/corp-ca/ca.crt")),
                ("KEYSHIFT_ENCODE_THREADS", Some("2"))
            ]
        );
        assert_eq!(
            env[..3].iter().map(|e| e.0).collect::<Vec<_>>(),
            RESERVED_ENV
        );
        let tolerations = spec.tolerations.as_ref().unwrap();
        assert_eq!(tolerations[0].key.as_deref(), Some("dedicated"));
        assert_eq!(tolerations[0].effect.as_deref(), Some("NoSchedule"));
        let terms = &spec
            .affinity
            .as_ref()
            .unwrap()
            .node_affinity
            .as_ref()
            .unwrap()
            .required_during_scheduling_ignored_during_execution
            .as_ref()
            .unwrap()
            .node_selector_terms;
        assert_eq!(terms[0].match_expressions.as_ref().unwrap()[0].key, "disk");
        let spread = &spec.topology_spread_constraints.as_ref().unwrap()[0];
        assert_eq!(spread.topology_key, "topology.kubernetes.io/zone");
        assert_eq!(spread.max_skew, 1);
        assert_eq!(spec.priority_class_name.as_deref(), Some("streaming-high"));
        assert_eq!(
            spec.image_pull_secrets.as_ref().unwrap()[0].name,
            "registry-creds"
        );
        // The restricted securityContext is not given up for any of it.
        assert_eq!(
            c.security_context
                .as_ref()
                .unwrap()
                .read_only_root_filesystem,
            Some(true)
        );
    }

    fn policy_config() -> NetworkPolicyConfig {
        NetworkPolicyConfig {
            operator_namespace: Some("keyshift-system".into()),
            operator_pod_labels: BTreeMap::from([
                ("app.kubernetes.io/name".to_owned(), "keyshift".to_owned()),
                ("app.kubernetes.io/instance".to_owned(), "ks".to_owned()),
            ]),
            metrics_from: Vec::new(),
        }
    }

    fn match_labels(s: &Option<LabelSelector>) -> Vec<(String, String)> {
        let s = s.as_ref().expect("a selector");
        assert_eq!(s.match_expressions, None);
        s.match_labels
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect()
    }

    fn ports(rule: &NetworkPolicyIngressRule) -> Vec<(Option<String>, Option<IntOrString>)> {
        rule.ports
            .iter()
            .flatten()
            .map(|p| (p.protocol.clone(), p.port.clone()))
            .collect()
    }

    #[test]
    fn network_policy_admits_the_job_to_data_and_the_operator_to_control() {
        let j = job();
        let np = network_policy(&j, &policy_config()).unwrap();
        assert_eq!(np.metadata.name.as_deref(), Some("clicks-workers"));
        assert_eq!(np.metadata.namespace.as_deref(), Some("ns"));
        assert_eq!(np.metadata.labels.as_ref().unwrap()[LABEL_JOB], "clicks");
        let owner = &np.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
            ("StreamJob", "clicks", "u-1")
        );
        assert_eq!(owner.controller, Some(true));
        let spec = np.spec.unwrap();
        let job_only = vec![("keyshift.dev/job".to_owned(), "clicks".to_owned())];
        // Every worker pod of the job, whatever its run: the pods carry this label.
        assert_eq!(match_labels(&spec.pod_selector), job_only);
        let pod = pod(
            &j,
            "r1",
            0,
            Assignment::new(4, 128).unwrap(),
            "img",
            LogFormat::Text,
        )
        .unwrap();
        assert_eq!(pod.metadata.labels.unwrap()[LABEL_JOB], "clicks");
        assert_eq!(
            spec.policy_types.as_deref(),
            Some(&["Ingress".to_owned()][..])
        );
        assert_eq!(spec.egress, None);
        let ingress = spec.ingress.unwrap();
        assert_eq!(ingress.len(), 2);
        // Data (shuffle): the job's own workers, in the job's namespace (no namespaceSelector).
        assert_eq!(
            ports(&ingress[0]),
            [(Some("TCP".to_owned()), Some(IntOrString::Int(9091)))]
        );
        let data_from = ingress[0].from.as_ref().unwrap();
        assert_eq!(data_from.len(), 1);
        assert_eq!(data_from[0].namespace_selector, None);
        assert_eq!(data_from[0].ip_block, None);
        assert_eq!(match_labels(&data_from[0].pod_selector), job_only);
        // Control: the operator's pods in the operator's namespace, nothing else.
        assert_eq!(
            ports(&ingress[1]),
            [(Some("TCP".to_owned()), Some(IntOrString::Int(9090)))]
        );
        let control_from = ingress[1].from.as_ref().unwrap();
        assert_eq!(control_from.len(), 1);
        assert_eq!(
            match_labels(&control_from[0].namespace_selector),
            [(
                "kubernetes.io/metadata.name".to_owned(),
                "keyshift-system".to_owned()
            )]
        );
        assert_eq!(
            match_labels(&control_from[0].pod_selector),
            [
                ("app.kubernetes.io/instance".to_owned(), "ks".to_owned()),
                ("app.kubernetes.io/name".to_owned(), "keyshift".to_owned())
            ]
        );
    }

    #[test]
    fn network_policy_peers_default_to_the_jobs_namespace_and_add_metrics_scrapers() {
        let mut config = policy_config();
        config.operator_namespace = None;
        let monitoring: NetworkPolicyPeer = serde_json::from_str(
            r#"{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}"#,
        )
        .unwrap();
        config.metrics_from = vec![monitoring.clone()];
        let np = network_policy(&job(), &config).unwrap();
        let ingress = np.spec.unwrap().ingress.unwrap();
        let control_from = ingress[1].from.as_ref().unwrap();
        assert_eq!(
            match_labels(&control_from[0].namespace_selector),
            [("kubernetes.io/metadata.name".to_owned(), "ns".to_owned())]
        );
        assert_eq!(control_from[1..], [monitoring]);
        // Scrapers get the control port (where /metrics is served), never the data port.
        assert_eq!(ingress[0].from.as_ref().unwrap().len(), 1);
    }

    #[test]
    fn network_policy_refuses_an_empty_operator_selector_and_a_job_without_uid() {
        let mut config = policy_config();
        config.operator_pod_labels.clear();
        assert_eq!(
            network_policy(&job(), &config),
            Err(DesiredError::NoOperatorLabels)
        );
        let mut j = job();
        j.metadata.uid = None;
        assert_eq!(
            network_policy(&j, &policy_config()),
            Err(DesiredError::Missing("uid"))
        );
    }

    #[test]
    fn secret_holds_the_token() {
        let s = secret(&job(), "abc").unwrap();
        assert_eq!(s.metadata.name.as_deref(), Some("clicks-control"));
        assert_eq!(s.string_data.unwrap()[TOKEN_KEY], "abc");
    }
}
