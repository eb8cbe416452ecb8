//! One reconcile pass of a StreamJob on Kubernetes: read the job (unless the watch cache holds
//! this process's last write), run the shared orchestration pass over the job's pods, then write
//! its status (server-side apply, one field manager) and publish its Events.

use super::context::Context;
use super::desired::{self, MANAGER};
use super::error::OperatorError;
use super::pods::PodWorkers;
use super::snapshot;
use crate::crd::{SnapshotPhase, StreamJob, StreamJobSnapshot, StreamJobSpec, StreamJobStatus};
use crate::orchestrator::pass::{self, PassInput, Shell, requeue};
use crate::validation;
use keyshift_core::reason::Reason;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action as Requeue;
use std::sync::Arc;

pub(super) async fn apply(
    job: Arc<StreamJob>,
    ctx: Arc<Context>,
) -> Result<Requeue, OperatorError> {
    let (ns, name) = desired::job_key(&job)?;
    let api: Api<StreamJob> = Api::namespaced(ctx.client.clone(), &ns);
    let entry = ctx.entry(&ns, &name);
    let mut entry = entry.lock().await;
    // `reconcile_outer` lets no pass through while a background step runs; this keeps it so.
    if entry.orchestration.background_running() {
        return Ok(Requeue::requeue(requeue::BACKGROUND_BACKSTOP));
    }
    // Every step must act on the step last recorded. The watch cache may not hold the status
    // this process just wrote yet: unless it hands over exactly the version this process wrote
    // last, read the job.
    let job = if job.resource_version().is_some() && job.resource_version() == entry.written_version
    {
        job
    } else {
        Arc::new(api.get(&name).await.map_err(OperatorError::ReadJob)?)
    };
    let spec = &job.spec;
    let status0 = job.status.clone().unwrap_or_default();
    if let Some(uid) = &job.metadata.uid {
        ctx.metrics.observe_uid(&ns, &name, uid);
    }

    // The operator's own policy (allowed images and ServiceAccounts), before anything else acts:
    // a refused job gets no pod. It stalls the way a job without storage does, with the field
    // and the fix in the condition, until its spec (or the operator's policy) changes.
    if let Err(refused) =
        validation::check_pod_policy(spec, &ctx.config.pod_policy, &ctx.config.worker_image)
    {
        return stalled(
            &ctx,
            &api,
            &job,
            &status0,
            refused.reason(),
            &refused.to_string(),
        )
        .await;
    }

    // A sink that would write where an older job's writes (one transactional id, one output
    // directory) gets no pod either: its workers would fence or overwrite the other job's.
    if let Err(shared) = ctx.check_sink_isolation(&job) {
        return stalled(
            &ctx,
            &api,
            &job,
            &status0,
            shared.reason(),
            &shared.to_string(),
        )
        .await;
    }

    let Some(storage) = spec
        .state
        .storage
        .clone()
        .or_else(|| ctx.config.default_storage.clone())
    else {
        return stalled(
            &ctx,
            &api,
            &job,
            &status0,
            Reason::NoStorage,
            "no snapshot storage: set spec.state.storage, or start the operator with --default-storage",
        )
        .await;
    };
    let mut list = ListParams::default().labels(&desired::selector(&name));
    // A consistent LIST waits for the API server's watch cache to catch up with etcd (~60-80 ms
    // after any write, docs/benchmarks.md): most of a pass. A suspended job with nothing in
    // flight gets no pods from us, so a pod the cache does not show yet only delays its
    // deletion to the pass its own watch event triggers; read the cache as it is.
    if spec.suspend
        && !entry.orchestration.coordinating()
        && !status0.rescale.as_ref().is_some_and(|r| r.step.active())
    {
        list = list.match_any();
    } else if let Some(version) = &entry.pods_version {
        // Every pod change this process made is in it; a change by someone else (the kubelet)
        // that it does not show yet triggers a pass of its own through the pods watch.
        list = list
            .at(version)
            .matching(kube::api::VersionMatch::NotOlderThan);
    }
    // Dereferenced for the pass: the StreamJobSnapshot spec.restoreFrom names, and the one
    // waiting for a savepoint.
    let snapshots = ctx.snapshots_in(&ns);
    let resolved = resolve_restore_from(spec, &status0, &snapshots);
    let spec = resolved.as_ref().unwrap_or(spec);
    let savepoint_request = snapshot::savepoint_request(&job, snapshots.iter().map(|s| &**s));
    let entry = &mut *entry;
    let mut workers = PodWorkers::new(&ctx, &job, &ns, &name, list, &mut entry.pods_version);
    let out = pass::run_pass(
        PassInput {
            namespace: &ns,
            name: &name,
            spec,
            status: status0.clone(),
            storage,
            generation: job.metadata.generation,
            savepoint_request,
        },
        &mut entry.orchestration,
        Shell {
            workers: &mut workers,
            metrics: &ctx.metrics,
            http: &ctx.http,
        },
    )
    .await?;
    let mut status = out.status;
    status.selector = Some(desired::selector(&name));
    // Which resource the restored URL came from.
    if let Some(named) = job.spec.restore_from.as_deref()
        && let validation::RestoreSource::Snapshot(named) = validation::restore_source(named)
        && status.restored_from.is_some()
        && status.restored_from == spec.restore_from
    {
        status.restored_from_snapshot = Some(named.to_owned());
    }
    let (written, ()) = tokio::join!(
        write_status(&api, &name, &status0, &status),
        ctx.publish(&job, out.events),
    );
    if let Some(version) = written? {
        entry.written_version = Some(version);
    }
    ctx.metrics.observe_status(&ns, &name, spec, &status);
    Ok(Requeue::requeue(out.requeue))
}

/// The spec with spec.restoreFrom's StreamJobSnapshot name replaced by that snapshot's URL,
/// when it names a Ready one (`None`: nothing to replace). A name that names none stays: the
/// pass reports it (Stalled, SnapshotNotReady) and stops nothing.
fn resolve_restore_from(
    spec: &StreamJobSpec,
    status: &StreamJobStatus,
    snapshots: &[Arc<StreamJobSnapshot>],
) -> Option<StreamJobSpec> {
    let validation::RestoreSource::Snapshot(wanted) =
        validation::restore_source(spec.restore_from.as_deref()?)
    else {
        return None;
    };
    let ready = snapshots
        .iter()
        .find(|s| s.name_any() == wanted)
        .and_then(|s| s.status.as_ref())
        .filter(|st| st.phase == Some(SnapshotPhase::Ready))
        .and_then(|st| st.path.clone());
    // Restored from it already: the resource may be gone since.
    let done = status
        .restored_from
        .clone()
        .filter(|_| status.restored_from_snapshot.as_deref() == Some(wanted));
    let url = ready.or(done)?;
    let mut spec = spec.clone();
    spec.restore_from = Some(url);
    Some(spec)
}

/// A job refused before anything acts (the operator's policy, a sink another job holds, no
/// storage): it gets no pod; its status says Stalled with `reason` and `message` until its spec
/// (or the operator's settings) changes, and it is looked at again now and then.
async fn stalled(
    ctx: &Context,
    api: &Api<StreamJob>,
    job: &StreamJob,
    status0: &StreamJobStatus,
    reason: Reason,
    message: &str,
) -> Result<Requeue, OperatorError> {
    let (ns, name) = desired::job_key(job)?;
    let status = pass::stalled_status(&job.spec, job.metadata.generation, status0, reason, message);
    write_status(api, &name, status0, &status).await?;
    ctx.metrics.observe_status(&ns, &name, &job.spec, &status);
    Ok(Requeue::requeue(requeue::STALLED))
}

/// Writes the status when it changed; returns the job's resourceVersion after the write.
async fn write_status(
    api: &Api<StreamJob>,
    name: &str,
    before: &StreamJobStatus,
    after: &StreamJobStatus,
) -> Result<Option<String>, OperatorError> {
    if before == after {
        return Ok(None);
    }
    let patch = serde_json::json!({
        "apiVersion": "keyshift.dev/v1alpha1",
        "kind": "StreamJob",
        "status": after,
    });
    let written = api
        .patch_status(
            name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map_err(OperatorError::WriteStatus)?;
    Ok(written.resource_version())
}
