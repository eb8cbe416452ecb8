//! Pure: the objects a StreamJob should own (worker pods, the control-token Secret), built from
//! its spec and the run being started. No I/O.

use crate::crd::StreamJob;
use crate::keygroup::Assignment;
use k8s_openapi::api::core::v1::{
    Container, ContainerPort, EnvFromSource, EnvVar, EnvVarSource, HTTPGetAction, Pod, PodSpec,
    Probe, Secret, SecretEnvSource, SecretKeySelector,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
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
/// The `decide::spec_hash` (job and image) a pod was created for.
/// The key-group count the pod's run was started under.
pub const LABEL_MAX_PARALLELISM: &str = "keyshift.dev/max-parallelism";
pub const LABEL_SPEC_HASH: &str = "keyshift.dev/spec-hash";
pub const ANNOTATION_KEY_GROUPS: &str = "keyshift.dev/key-groups";
/// Key of the control token in the job's Secret.
pub const TOKEN_KEY: &str = "token";
pub const CONTROL_PORT: u16 = 9090;
pub const DATA_PORT: u16 = 9091;

/// Problems building the desired objects (a StreamJob without name or namespace).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DesiredError {
    #[error("the StreamJob has no {0}")]
    Missing(&'static str),
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

/// One worker pod: subtask `subtask` of `assignment` in run `run`.
pub fn pod(
    job: &StreamJob,
    run: &str,
    subtask: u32,
    assignment: Assignment,
    image: &str,
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
        (LABEL_SPEC_HASH.to_owned(), super::decide::spec_hash(spec)),
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
        name: "POD_IP".into(),
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
        name: "KEYSHIFT_TOKEN".into(),
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
        name: "KEYSHIFT_SUBTASK".into(),
        value: Some(subtask.to_string()),
        ..Default::default()
    });
    let env_from = spec.state.credentials_secret.as_ref().map(|s| {
        vec![EnvFromSource {
            secret_ref: Some(SecretEnvSource {
                name: s.clone(),
                optional: Some(false),
            }),
            ..Default::default()
        }]
    });
    let container = Container {
        name: "worker".into(),
        image: Some(spec.image.clone().unwrap_or_else(|| image.to_owned())),
        command: Some(vec!["keyshift".into()]),
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
        resources: spec.resources.clone(),
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
            ..Default::default()
        }),
        status: None,
    })
}

#[cfg(test)]
pub(crate) mod tests_support {
    use crate::crd::{StreamJob, StreamJobSpec};

    /// A valid job named `clicks` in namespace `ns`.
    pub(crate) fn job() -> StreamJob {
        let spec: StreamJobSpec = serde_yaml::from_str(
            "replicas: 4
maxParallelism: 128
job:
  source: {generator: {partitions: 4, keys: 100}}
  key: {field: key}
  aggregation: {function: count}
state: {credentialsSecret: s3creds}
podTemplate: {labels: {team: a}, nodeSelector: {disk: ssd}}
",
        )
        .unwrap();
        let mut j = StreamJob::new("clicks", spec);
        j.metadata.namespace = Some("ns".into());
        j.metadata.uid = Some("u-1".into());
        j
    }
}

#[cfg(test)]
mod tests {
    use super::tests_support::job;
    use super::*;

    #[test]
    fn pod_carries_identity_token_ports_probe_and_owner() {
        let j = job();
        let a = Assignment::new(4, 128).unwrap();
        let p = pod(&j, "r1", 2, a, "keyshift:dev").unwrap();
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
    fn secret_holds_the_token() {
        let s = secret(&job(), "abc").unwrap();
        assert_eq!(s.metadata.name.as_deref(), Some("clicks-control"));
        assert_eq!(s.string_data.unwrap()[TOKEN_KEY], "abc");
    }
}
