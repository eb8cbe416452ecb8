//! The pod platform: the [`Workers`] port over the Kubernetes API. A job's workers are pods
//! labelled with the job, run, subtask and parallelism; its control token lives in a Secret.

use super::context::Context;
use super::desired::{self, LABEL_PARALLELISM, LABEL_RUN, LABEL_SUBTASK, MANAGER};
use crate::crd::{KafkaCredentials, StreamJob};
use crate::job::kafka::{Credentials, Role};
use crate::orchestrator::coordinator::WorkerEndpoint;
use crate::orchestrator::decide::{ObservedPod, PodPhase};
use crate::orchestrator::port::{Listed, PortError, Waker, Workers};
use crate::orchestrator::run;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use keyshift_core::keygroup::Assignment;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::reflector::ObjectRef;
use std::sync::Arc;

/// The pods of one job, for one pass.
pub struct PodWorkers<'a> {
    ctx: &'a Context,
    job: &'a StreamJob,
    ns: &'a str,
    name: &'a str,
    api: Api<Pod>,
    list: ListParams,
    /// The resourceVersion of this process's last write to one of the job's pods.
    pods_version: &'a mut Option<String>,
}

fn kube_error(what: String, e: kube::Error) -> PortError {
    let transient = !matches!(&e, kube::Error::Api(s) if s.code == 422 || s.code == 403);
    PortError::new(what, e, transient)
}

impl<'a> PodWorkers<'a> {
    /// `list`: how the pods are listed (from the watch cache when that is known to be fresh
    /// enough, see `apply`).
    pub(super) fn new(
        ctx: &'a Context,
        job: &'a StreamJob,
        ns: &'a str,
        name: &'a str,
        list: ListParams,
        pods_version: &'a mut Option<String>,
    ) -> Self {
        PodWorkers {
            ctx,
            job,
            ns,
            name,
            api: Api::namespaced(ctx.client.clone(), ns),
            list,
            pods_version,
        }
    }
}

fn label_u32(p: &Pod, key: &str) -> Option<u32> {
    p.labels().get(key).and_then(|v| v.parse().ok())
}

/// A pod of the job as the orchestration sees it; `None` for a pod without the labels.
fn listed(p: &Pod) -> Option<Listed> {
    let run = p.labels().get(LABEL_RUN).cloned()?;
    let subtask = label_u32(p, LABEL_SUBTASK)?;
    let parallelism = label_u32(p, LABEL_PARALLELISM)?;
    let st = p.status.as_ref();
    let phase = PodPhase::parse(st.and_then(|s| s.phase.as_deref()));
    let ip = st
        .and_then(|s| s.pod_ip.clone())
        .filter(|ip| !ip.is_empty());
    let endpoint = ip.as_ref().map(|ip| WorkerEndpoint {
        control: format!("http://{ip}:{}", desired::CONTROL_PORT),
        data: format!("{ip}:{}", desired::DATA_PORT),
    });
    Some(Listed {
        pod: ObservedPod {
            name: p.name_any(),
            run,
            subtask,
            parallelism,
            phase,
            ip,
            deleting: p.metadata.deletion_timestamp.is_some(),
            grace_deadline: p.metadata.deletion_timestamp.as_ref().map(|t| t.0),
            worker: None,
            spec_hash: p.labels().get(desired::LABEL_SPEC_HASH).cloned(),
            unschedulable: unschedulable(p),
        },
        endpoint,
        max_parallelism: label_u32(p, desired::LABEL_MAX_PARALLELISM),
    })
}

/// The scheduler's message when it cannot place the pod (condition PodScheduled False, reason
/// Unschedulable).
fn unschedulable(p: &Pod) -> Option<String> {
    let c = p
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "PodScheduled")?;
    (c.status == "False" && c.reason.as_deref() == Some("Unschedulable"))
        .then(|| c.message.clone().unwrap_or_else(|| "Unschedulable".into()))
}

/// Deletes a pod; returns its resourceVersion once marked for deletion (`None` when it is gone
/// already).
pub(super) async fn delete_pod(pods: &Api<Pod>, name: &str) -> Result<Option<String>, PortError> {
    match pods.delete(name, &DeleteParams::default()).await {
        // The pod marked for deletion, or a Status when it was removed at once.
        Ok(deleted) => Ok(deleted.left().and_then(|pod| pod.resource_version())),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(None),
        Err(e) => Err(kube_error(format!("deleting pod {name}"), e)),
    }
}

/// The job's control token: from its Secret, created on first use. A job that has no status yet
/// (never reconciled) most likely has no Secret either: it is created without reading first,
/// and read only when it exists already.
async fn ensure_secret(
    ctx: &Context,
    job: &StreamJob,
    ns: &str,
    name: &str,
) -> Result<String, PortError> {
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    let secret_name = desired::secret_name(name);
    let create = || async {
        let token = run::new_token().map_err(|e| PortError::new("making a token", e, false))?;
        let secret = desired::secret(job, &token)
            .map_err(|e| PortError::new(format!("building Secret {secret_name}"), e, false))?;
        match secrets.create(&PostParams::default(), &secret).await {
            Ok(_) => Ok(Some(token)),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(None),
            Err(e) => Err(kube_error(format!("creating Secret {secret_name}"), e)),
        }
    };
    let unusable = || {
        PortError::new(
            format!("reading Secret {secret_name}"),
            format!(
                "it has no usable `{}` (16 characters or more); delete it and the operator creates a new one",
                desired::TOKEN_KEY
            ),
            false,
        )
    };
    if job.status.is_none()
        && let Some(token) = create().await?
    {
        return Ok(token);
    }
    let existing = secrets
        .get_opt(&secret_name)
        .await
        .map_err(|e| kube_error(format!("reading Secret {secret_name}"), e))?;
    if let Some(s) = existing {
        let token = s
            .data
            .as_ref()
            .and_then(|d| d.get(desired::TOKEN_KEY))
            .and_then(|b| String::from_utf8(b.0.clone()).ok())
            .filter(|t| t.len() >= 16);
        return token.ok_or_else(unusable);
    }
    // Created concurrently, or deleted since the create: read it back next pass.
    create().await?.ok_or_else(unusable)
}

/// Server-side applies the job's NetworkPolicy (owned by the StreamJob, so it is
/// garbage-collected with it).
async fn apply_network_policy(
    ctx: &Context,
    job: &StreamJob,
    ns: &str,
    name: &str,
    config: &desired::NetworkPolicyConfig,
) -> Result<(), PortError> {
    let policy_name = desired::network_policy_name(name);
    let policy = desired::network_policy(job, config)
        .map_err(|e| PortError::new(format!("building NetworkPolicy {policy_name}"), e, false))?;
    let api: Api<NetworkPolicy> = Api::namespaced(ctx.client.clone(), ns);
    api.patch(
        &policy_name,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(&policy),
    )
    .await
    .map_err(|e| match &e {
        kube::Error::Api(s) if s.code == 403 => PortError::new(
            format!("applying NetworkPolicy {policy_name}"),
            format!(
                "{e}: grant the operator `patch` on networkpolicies.networking.k8s.io (the chart does), or start it with --network-policy=false"
            ),
            false,
        ),
        _ => kube_error(format!("applying NetworkPolicy {policy_name}"), e),
        })?;
    Ok(())
}

#[async_trait::async_trait]
impl Workers for PodWorkers<'_> {
    async fn observe(&mut self) -> Result<Vec<Listed>, PortError> {
        let pods = self
            .api
            .list(&self.list)
            .await
            .map_err(|e| kube_error(format!("listing the pods of {}", self.name), e))?;
        Ok(pods.items.iter().filter_map(listed).collect())
    }

    async fn create(
        &mut self,
        run: &str,
        assignment: Assignment,
        subtasks: &[u32],
        _token: &str,
    ) -> Result<(), PortError> {
        // The policy in front of the workers exists before any of them does: a new run applies
        // it again (one request per start, not per pass), so a deleted policy comes back.
        if let Some(config) = &self.ctx.config.network_policy {
            apply_network_policy(self.ctx, self.job, self.ns, self.name, config).await?;
        }
        // The pods read the token from the job's Secret (`token` ensured it exists).
        for i in subtasks {
            let pod_name = desired::pod_name(self.name, run, *i);
            let pod = desired::pod(
                self.job,
                run,
                *i,
                assignment,
                &self.ctx.config.worker_image,
                self.ctx.config.worker_log_format,
            )
            .map_err(|e| PortError::new(format!("building pod {pod_name}"), e, false))?;
            let written = self
                .api
                .patch(
                    &pod_name,
                    &PatchParams::apply(MANAGER).force(),
                    &Patch::Apply(&pod),
                )
                .await
                .map_err(|e| kube_error(format!("creating pod {pod_name}"), e))?;
            *self.pods_version = written.resource_version();
        }
        Ok(())
    }

    async fn delete(&mut self, names: &[String]) -> Result<(), PortError> {
        for name in names {
            // A pod gone by now (404) was not changed by this delete.
            if let Some(version) = delete_pod(&self.api, name).await? {
                *self.pods_version = Some(version);
            }
        }
        Ok(())
    }

    async fn token(&mut self) -> Result<String, PortError> {
        ensure_secret(self.ctx, self.job, self.ns, self.name).await
    }

    /// From the job's Secret through the API (the operator's own environment has no job's
    /// credentials), read on every call so a rotated Secret is used by the next run.
    async fn kafka_credentials(
        &mut self,
        role: Role,
        creds: &KafkaCredentials,
    ) -> Result<Credentials, PortError> {
        let what = format!(
            "reading the Kafka credentials of Secret {}",
            creds.secret_name
        );
        let secrets: Api<Secret> = Api::namespaced(self.ctx.client.clone(), self.ns);
        let secret = secrets
            .get_opt(&creds.secret_name)
            .await
            .map_err(|e| kube_error(what.clone(), e))?
            .ok_or_else(|| {
                PortError::new(
                    what.clone(),
                    format!(
                        "Secret {} does not exist in namespace {}: create it, or fix credentials.secretName",
                        creds.secret_name, self.ns
                    ),
                    false,
                )
            })?;
        let data: std::collections::BTreeMap<String, Vec<u8>> = secret
            .data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.0))
            .chain(
                secret
                    .string_data
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(k, v)| (k, v.into_bytes())),
            )
            .collect();
        Credentials::from_secret(role, creds, &data).map_err(|e| PortError::new(what, e, false))
    }

    fn waker(&self) -> Waker {
        let waker = self.ctx.waker(self.ns);
        let job = ObjectRef::from_obj(self.job);
        Arc::new(move || {
            if let Some(w) = &waker {
                let _ = w.unbounded_send(job.clone());
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unschedulable_pod_says_why() {
        let pod = |status: &str, reason: &str| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "p"},
                "status": {"phase": "Pending", "conditions": [{
                    "type": "PodScheduled", "status": status, "reason": reason,
                    "message": "0/1 nodes are available: 1 Insufficient cpu."
                }]}
            }))
            .unwrap()
        };
        assert_eq!(
            unschedulable(&pod("False", "Unschedulable")).as_deref(),
            Some("0/1 nodes are available: 1 Insufficient cpu.")
        );
        assert_eq!(unschedulable(&pod("True", "")), None);
        assert_eq!(unschedulable(&pod("False", "SchedulingGated")), None);
        assert_eq!(unschedulable(&Pod::default()), None);
    }
}
