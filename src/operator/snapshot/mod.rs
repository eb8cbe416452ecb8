//! The StreamJobSnapshot controller: records the savepoint a job took for a snapshot resource
//! (or the snapshot spec.path names) in its status, keeps status.inUse current, applies the
//! job's spec.snapshotRetention, and disposes of a deleted snapshot's files behind a finalizer.
//!
//! The savepoint itself is taken by the job's own pass ([`savepoint_request`] picks the
//! snapshot it takes next; `status.lastSavepoint.snapshot` records it), so it is ordered with
//! the job's rescales and checkpoints, and the job's spec is never edited.

mod plan;

pub use plan::{Kept, Next, next, ready_status, retire, savepoint_request, set_conditions};

use super::context::Context;
use super::desired::MANAGER;
use super::error::OperatorError;
use crate::crd::{
    DeletionPolicy, SnapshotPhase, StreamJob, StreamJobSnapshot, StreamJobSnapshotStatus,
};
use crate::offline::{self, DisposeOptions, ToolError};
use crate::snapshot::SnapshotError;
use futures::StreamExt;
use keyshift_core::reason::Reason;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::runtime::controller::{Action as Requeue, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use std::sync::Arc;
use std::time::Duration;

/// The finalizer that disposes of a deleted snapshot's files (spec.deletionPolicy).
pub const FINALIZER: &str = "keyshift.dev/snapshot-files";

/// How often a Ready snapshot's status.inUse is refreshed (and its job's retention applied).
const REFRESH: Duration = Duration::from_secs(300);
/// How often a deletion waiting for its job to stop needing the snapshot is retried.
const IN_USE_RETRY: Duration = Duration::from_secs(30);
/// The least time between two reads of a Ready snapshot's storage (its in-use check and its
/// job's retention), however often the job changes.
const REFRESH_AT_MOST: Duration = Duration::from_secs(60);
/// The least time between two in-use checks of a deletion that waits.
const IN_USE_CHECK_AT_MOST: Duration = Duration::from_secs(10);
/// How often a Pending snapshot is looked at without a change of its own or of its job.
const PENDING: Duration = Duration::from_secs(30);

/// One StreamJobSnapshot controller for a scope (a namespace, or all), until shutdown. Its
/// watch cache goes into the context for the job passes; a change of a job wakes its
/// snapshots.
pub async fn run(ctx: Arc<Context>, ns: Option<String>, watch: watcher::Config) {
    let (snapshots, jobs): (Api<StreamJobSnapshot>, Api<StreamJob>) = match &ns {
        Some(ns) => (
            Api::namespaced(ctx.client.clone(), ns),
            Api::namespaced(ctx.client.clone(), ns),
        ),
        None => (Api::all(ctx.client.clone()), Api::all(ctx.client.clone())),
    };
    let controller = Controller::new(snapshots, watch.clone());
    let store = controller.store();
    ctx.snapshot_stores
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(store.clone());
    controller
        .watches(jobs, watch, move |job: StreamJob| {
            let name = job.name_any();
            let ns = job.namespace();
            store
                .state()
                .into_iter()
                .filter(|s| s.spec.job_name == name && s.namespace() == ns)
                .map(|s| ObjectRef::from_obj(&*s))
                .collect::<Vec<_>>()
        })
        .shutdown_on_signal()
        .run(reconcile, error_policy, ctx)
        .for_each(|res| async move {
            if let Err(e) = res {
                tracing::debug!(error = %e, "snapshot reconcile");
            }
        })
        .await;
}

fn error_policy(snap: Arc<StreamJobSnapshot>, error: &OperatorError, ctx: Arc<Context>) -> Requeue {
    let kind = error.kind();
    // Counted with its job's series, while the operator tracks that job (a snapshot of a job
    // that is gone adds no series).
    ctx.metrics.record_error(
        &snap.namespace().unwrap_or_default(),
        &snap.spec.job_name,
        true,
        kind,
    );
    tracing::warn!(snapshot = %snap.name_any(), error = %error, kind = kind.label(), "snapshot reconcile failed; retrying");
    Requeue::requeue(crate::backoff::jittered(kind.retry_after()))
}

async fn reconcile(
    snap: Arc<StreamJobSnapshot>,
    ctx: Arc<Context>,
) -> Result<Requeue, OperatorError> {
    let ns = snap.namespace().unwrap_or_default();
    let api: Api<StreamJobSnapshot> = Api::namespaced(ctx.client.clone(), &ns);
    let has_finalizer = snap.finalizers().iter().any(|f| f == FINALIZER);
    if snap.metadata.deletion_timestamp.is_some() {
        if !has_finalizer {
            return Ok(Requeue::await_change());
        }
        return delete(&api, &snap, &ctx).await;
    }
    if !has_finalizer {
        let mut finalizers = snap.finalizers().to_vec();
        finalizers.push(FINALIZER.to_owned());
        patch_finalizers(&api, &snap, finalizers).await?;
        // The patch's watch event brings the snapshot back with it.
        return Ok(Requeue::await_change());
    }
    let job = job_of(&ctx, &ns, &snap.spec.job_name).await?;
    let before = snap.status.clone().unwrap_or_default();
    let generation = snap.metadata.generation;
    let (mut status, requeue) = match next(&snap, job.as_ref()) {
        Next::Nothing => return Ok(Requeue::await_change()),
        Next::Wait { message, wake } => {
            if wake && let Some(waker) = ctx.waker(&ns) {
                let _ = waker
                    .unbounded_send(ObjectRef::<StreamJob>::new(&snap.spec.job_name).within(&ns));
            }
            let mut status = StreamJobSnapshotStatus {
                phase: Some(SnapshotPhase::Pending),
                message: Some(message.clone()),
                conditions: before.conditions.clone(),
                ..Default::default()
            };
            set_conditions(
                &mut status,
                Reason::SnapshotPending,
                &message,
                generation,
                jiff::Timestamp::now(),
            );
            (status, PENDING)
        }
        Next::Record { url, taken } => {
            let status = record(&snap, &url, taken, generation, &before, &ctx).await?;
            // Recording read the storage (in use) just now: it counts as this snapshot's
            // refresh, retention included.
            ctx.snapshot_due(&ns, &snap.name_any(), "refresh", REFRESH_AT_MOST);
            if let Some(job) = &job
                && status.phase == Some(SnapshotPhase::Ready)
            {
                retain(&ctx, &api, job, &snap, &status).await?;
            }
            (status, REFRESH)
        }
        Next::Refresh { url } => {
            // Every change of the job (each checkpoint) brings its snapshots here: their
            // storage is read at most once per REFRESH_AT_MOST.
            if !ctx.snapshot_due(&ns, &snap.name_any(), "refresh", REFRESH_AT_MOST) {
                return Ok(Requeue::requeue(REFRESH));
            }
            let mut status = before.clone();
            refresh_in_use(&mut status, &ns, &snap, &url, &ctx).await;
            if let Some(job) = &job {
                retain(&ctx, &api, job, &snap, &status).await?;
            }
            (status, REFRESH)
        }
    };
    status.observed_generation = generation;
    write_status(&api, &snap, &before, &status).await?;
    Ok(Requeue::requeue(requeue))
}

/// Reads the snapshot at `url` and checks its files: Ready with what it holds, or Failed when it
/// cannot be restored. A store that cannot be reached is an error (retried).
async fn record(
    snap: &StreamJobSnapshot,
    url: &str,
    taken: bool,
    generation: Option<i64>,
    before: &StreamJobSnapshotStatus,
    ctx: &Context,
) -> Result<StreamJobSnapshotStatus, OperatorError> {
    let name = snap.name_any();
    // Off the reconciler (checking every file is the long part).
    let owned = url.to_owned();
    let read = off_task(move || async move {
        let loc = offline::open_location(&owned)?;
        let manifest = crate::snapshot::read_manifest(loc.store.as_ref(), &loc.dir).await?;
        crate::snapshot::verify(loc.store.as_ref(), &loc.dir).await?;
        Ok::<_, ToolError>(manifest)
    })
    .await?;
    let mut status = match read {
        Ok(manifest) => {
            let mut status = ready_status(url, &manifest, true);
            let how = if taken {
                format!("savepoint taken by StreamJob {}", snap.spec.job_name)
            } else {
                "recorded from spec.path".to_owned()
            };
            let message = format!(
                "{how}: {url}, {} of state, {} keys in {} key groups; every file checked out",
                keyshift_core::text::bytes(manifest.stats.total_bytes),
                manifest.stats.total_keys,
                manifest.max_parallelism
            );
            status.conditions = before.conditions.clone();
            announce(
                ctx,
                snap,
                &mut status,
                Reason::SnapshotReady,
                message,
                generation,
            )
            .await;
            status
        }
        Err(e) if unreachable(&e) => return Err(OperatorError::SnapshotStorage(e)),
        Err(e) => {
            let message = format!(
                "{url} cannot be restored: {e}; delete this StreamJobSnapshot (`keyshift savepoint verify {url}` shows the details)"
            );
            tracing::warn!(snapshot = %name, %url, error = %e, "snapshot unusable");
            let mut status = StreamJobSnapshotStatus {
                phase: Some(SnapshotPhase::Failed),
                path: Some(url.to_owned()),
                verified: Some(false),
                conditions: before.conditions.clone(),
                ..Default::default()
            };
            announce(
                ctx,
                snap,
                &mut status,
                Reason::SnapshotUnusable,
                message,
                generation,
            )
            .await;
            status
        }
    };
    let ns = snap.namespace().unwrap_or_default();
    refresh_in_use(&mut status, &ns, snap, url, ctx).await;
    Ok(status)
}

/// A store that could not be reached (or configured), as opposed to a snapshot that is not
/// there or does not check out.
fn unreachable(e: &ToolError) -> bool {
    matches!(
        e,
        ToolError::Snapshot(SnapshotError::Store { .. } | SnapshotError::StoreConfig { .. })
    )
}

/// Why the snapshot at `url` is still needed: by any StreamJob of the namespace whose
/// spec.restoreFrom names it (by resource name or URL), and by the job whose directory holds it
/// (its newest checkpoint or snapshot, its in-use marker) while that job exists.
#[derive(Debug, Default)]
struct Needed {
    reasons: Vec<String>,
    /// The StreamJob whose directory holds the snapshot is gone (deleted): its storage's
    /// "newest snapshot" rules no longer protect anything, so a disposal overrides them.
    owner_gone: bool,
}

/// [`Needed`] for the snapshot at `url`. `Err` when the storage (or the API server, asked
/// whether the owning job still exists) cannot be read.
async fn needed_by(
    ns: &str,
    snap: &StreamJobSnapshot,
    url: &str,
    ctx: &Context,
) -> Result<Needed, OperatorError> {
    let mut needed = Needed {
        reasons: named_by_restore_from(&ctx.jobs_in(ns), &snap.name_any(), url),
        owner_gone: false,
    };
    let Some((job_url, kind, id)) = offline::split_snapshot_url(url) else {
        return Ok(needed);
    };
    // `<storage>/<namespace>/<job>`: a job of this namespace that is gone needs nothing (one of
    // another namespace is taken to exist: this controller may not read it).
    let mut segments = job_url.trim_end_matches('/').rsplit('/');
    if let (Some(owner), Some(owner_ns)) = (segments.next(), segments.next())
        && owner_ns == ns
        && job_of(ctx, ns, owner).await?.is_none()
    {
        needed.owner_gone = true;
        return Ok(needed);
    }
    let listing = off_task(move || async move { offline::list_job(&job_url).await })
        .await?
        .map_err(OperatorError::SnapshotStorage)?;
    let relative = kind.relative_dir(id);
    if let Some(listed) = listing.snapshots.iter().find(|l| l.path == relative) {
        needed
            .reasons
            .extend(listed.in_use.iter().map(|u| u.detail.clone()));
    }
    if let Some(e) = listing.marker_error {
        needed.reasons.push(e);
    }
    Ok(needed)
}

/// StreamJob `ns/name` as the watch cache holds it (every change of it brings its snapshots
/// here), else (a cache that does not hold it may not have caught up) as the API server does;
/// `None` when it does not exist.
async fn job_of(ctx: &Context, ns: &str, name: &str) -> Result<Option<StreamJob>, OperatorError> {
    if let Some(job) = ctx.jobs_in(ns).into_iter().find(|j| j.name_any() == name) {
        return Ok(Some((*job).clone()));
    }
    Api::<StreamJob>::namespaced(ctx.client.clone(), ns)
        .get_opt(name)
        .await
        .map_err(|e| OperatorError::SnapshotApi("reading a StreamJob", e))
}

/// The StreamJobs among `jobs` whose spec.restoreFrom names the snapshot `name` at `url`.
fn named_by_restore_from(jobs: &[Arc<StreamJob>], name: &str, url: &str) -> Vec<String> {
    let url = url.trim_end_matches('/');
    jobs.iter()
        .filter(|j| {
            j.spec
                .restore_from
                .as_deref()
                .is_some_and(|r| r == name || r.trim_end_matches('/') == url)
        })
        .map(|j| format!("spec.restoreFrom of StreamJob {}", j.name_any()))
        .collect()
}

/// Sets status.inUse and its reasons; a storage that cannot be read leaves them as they were.
async fn refresh_in_use(
    status: &mut StreamJobSnapshotStatus,
    ns: &str,
    snap: &StreamJobSnapshot,
    url: &str,
    ctx: &Context,
) {
    match needed_by(ns, snap, url, ctx).await {
        Ok(Needed { reasons, .. }) => {
            status.in_use = Some(!reasons.is_empty());
            status.in_use_reasons = reasons;
        }
        Err(e) => {
            tracing::warn!(snapshot = %snap.name_any(), error = %e, "cannot tell whether the snapshot is in use");
        }
    }
}

/// Applies the job's spec.snapshotRetention to its Ready snapshots (once per reconcile of one
/// of them; deleting one hands it to its finalizer).
async fn retain(
    ctx: &Context,
    api: &Api<StreamJobSnapshot>,
    job: &StreamJob,
    snap: &StreamJobSnapshot,
    status: &StreamJobSnapshotStatus,
) -> Result<(), OperatorError> {
    let Some(retention) = &job.spec.snapshot_retention else {
        return Ok(());
    };
    let ns = snap.namespace().unwrap_or_default();
    let job_name = job.name_any();
    let snapshots = ctx.snapshots_in(&ns);
    let (snapshots, mut kept) = kept_of(&snapshots, &job_name, snap, status);
    let now = jiff::Timestamp::now();
    // Whether a snapshot is still needed changes as the job runs on (a newer checkpoint): asked
    // afresh for each one the policy would retire.
    for name in retire(&kept, retention, now) {
        let Some(s) = snapshots.iter().find(|s| s.name_any() == name) else {
            continue;
        };
        let Some(url) = s.status.as_ref().and_then(|st| st.path.clone()) else {
            continue;
        };
        let in_use = !needed_by(&ns, s, &url, ctx).await?.reasons.is_empty();
        if let Some(k) = kept.iter_mut().find(|k| k.name == name) {
            k.in_use = in_use;
        }
    }
    for name in retire(&kept, retention, now) {
        let Some(s) = snapshots.iter().find(|s| s.name_any() == name) else {
            continue;
        };
        let note = format!(
            "deleted by spec.snapshotRetention of StreamJob {job_name} (keep {}, maxAge {}); its files are {}",
            retention.keep.map_or("any".to_owned(), |k| k.to_string()),
            retention.max_age.as_deref().unwrap_or("any"),
            match s.spec.effective_deletion_policy() {
                DeletionPolicy::Delete => "disposed of",
                DeletionPolicy::Retain => "kept (deletionPolicy Retain)",
            }
        );
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => {
                tracing::info!(snapshot = %name, job = %job_name, "retired by the job's snapshotRetention");
                ctx.event_on(
                    s.object_ref(&()),
                    false,
                    Reason::SnapshotRetired.as_str(),
                    note,
                )
                .await;
            }
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(OperatorError::SnapshotApi("deleting a retired snapshot", e)),
        }
    }
    Ok(())
}

/// The job's snapshots that are not being deleted, and the Ready ones as retention sees them:
/// `snap`'s status as just refreshed, the others' as last written.
fn kept_of(
    all: &[Arc<StreamJobSnapshot>],
    job_name: &str,
    snap: &StreamJobSnapshot,
    status: &StreamJobSnapshotStatus,
) -> (Vec<Arc<StreamJobSnapshot>>, Vec<Kept>) {
    let mine = snap.name_any();
    let snapshots: Vec<Arc<StreamJobSnapshot>> = all
        .iter()
        .filter(|s| s.spec.job_name == job_name && s.metadata.deletion_timestamp.is_none())
        .cloned()
        .collect();
    let kept = snapshots
        .iter()
        .filter_map(|s| {
            let st = if s.name_any() == mine {
                status.clone()
            } else {
                s.status.clone()?
            };
            if st.phase != Some(SnapshotPhase::Ready) {
                return None;
            }
            Some(Kept {
                name: s.name_any(),
                time: st.time.as_deref()?.parse().ok()?,
                // Asked afresh before anything is retired.
                in_use: false,
            })
        })
        .collect();
    (snapshots, kept)
}

/// A snapshot being deleted: disposes of its files (deletionPolicy Delete) unless its job still
/// needs them, then lets the resource go. While needed, the deletion waits.
async fn delete(
    api: &Api<StreamJobSnapshot>,
    snap: &StreamJobSnapshot,
    ctx: &Context,
) -> Result<Requeue, OperatorError> {
    let ns = snap.namespace().unwrap_or_default();
    let before = snap.status.clone().unwrap_or_default();
    let url = before.path.clone().filter(|_| {
        // A snapshot that never became Ready has no files of its own (a failed recorded path
        // is not ours to dispose of).
        before.phase == Some(SnapshotPhase::Ready)
    });
    let policy = snap.spec.effective_deletion_policy();
    match (policy, url) {
        (DeletionPolicy::Delete, Some(url)) => {
            if !ctx.snapshot_due(&ns, &snap.name_any(), "delete", IN_USE_CHECK_AT_MOST) {
                return Ok(Requeue::requeue(IN_USE_CHECK_AT_MOST));
            }
            let Needed {
                mut reasons,
                owner_gone,
            } = needed_by(&ns, snap, &url, ctx).await?;
            let mut disposed = None;
            if reasons.is_empty() {
                let owned = url.clone();
                // The tool's own rules (newest snapshot, marker) are the owning job's: with the
                // job gone they protect nothing.
                let options = DisposeOptions {
                    force: owner_gone,
                    dry_run: false,
                };
                let disposed_now =
                    off_task(move || async move { offline::dispose(&owned, options).await })
                        .await?;
                match disposed_now {
                    Ok(report) => disposed = Some(report),
                    Err(ToolError::NothingThere { .. }) => {}
                    Err(ToolError::InUse { reasons: r, .. }) => reasons.push(r),
                    Err(e) => return Err(OperatorError::SnapshotStorage(e)),
                }
            }
            if !reasons.is_empty() {
                let message = format!(
                    "not disposing of {url}: {}; the deletion waits until the job no longer needs it (or set spec.deletionPolicy: Retain to keep the files)",
                    reasons.join("; ")
                );
                let mut status = before.clone();
                status.in_use = Some(true);
                status.in_use_reasons = reasons;
                if status.message.as_deref() != Some(message.as_str()) {
                    ctx.event_on(
                        snap.object_ref(&()),
                        true,
                        Reason::SnapshotInUse.as_str(),
                        message.clone(),
                    )
                    .await;
                }
                status.message = Some(message);
                write_status(api, snap, &before, &status).await?;
                return Ok(Requeue::requeue(IN_USE_RETRY));
            }
            let note = match disposed {
                Some(r) => format!(
                    "disposed of {url}: {} objects, {}{}",
                    r.objects,
                    keyshift_core::text::bytes(r.bytes),
                    if r.kept_referenced > 0 {
                        format!(
                            "; {} files newer incremental checkpoints read stay until those go",
                            r.kept_referenced
                        )
                    } else {
                        String::new()
                    }
                ),
                None => format!("{url} was already gone"),
            };
            tracing::info!(snapshot = %snap.name_any(), %url, "snapshot disposed of");
            ctx.event_on(
                snap.object_ref(&()),
                false,
                Reason::SnapshotDisposed.as_str(),
                note,
            )
            .await;
        }
        (DeletionPolicy::Retain, Some(url)) => {
            ctx.event_on(
                snap.object_ref(&()),
                false,
                Reason::SnapshotRetained.as_str(),
                format!("{url} is kept in storage (deletionPolicy Retain)"),
            )
            .await;
        }
        (_, None) => {}
    }
    let finalizers: Vec<String> = snap
        .finalizers()
        .iter()
        .filter(|f| *f != FINALIZER)
        .cloned()
        .collect();
    patch_finalizers(api, snap, finalizers).await?;
    ctx.forget_snapshot(&ns, &snap.name_any());
    Ok(Requeue::await_change())
}

/// Sets metadata.finalizers, based on the version read (a concurrent change fails it: 409).
async fn patch_finalizers(
    api: &Api<StreamJobSnapshot>,
    snap: &StreamJobSnapshot,
    finalizers: Vec<String>,
) -> Result<(), OperatorError> {
    let patch = serde_json::json!({
        "metadata": {
            "resourceVersion": snap.resource_version(),
            "finalizers": finalizers,
        }
    });
    match api
        .patch(
            &snap.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(OperatorError::SnapshotApi("updating its finalizers", e)),
    }
}

/// Writes the status when it changed.
async fn write_status(
    api: &Api<StreamJobSnapshot>,
    snap: &StreamJobSnapshot,
    before: &StreamJobSnapshotStatus,
    after: &StreamJobSnapshotStatus,
) -> Result<(), OperatorError> {
    if before == after {
        return Ok(());
    }
    let patch = serde_json::json!({
        "apiVersion": "keyshift.dev/v1alpha1",
        "kind": "StreamJobSnapshot",
        "status": after,
    });
    match api
        .patch_status(
            &snap.name_any(),
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(OperatorError::SnapshotApi("writing its status", e)),
    }
}

/// The snapshot became Ready (`SnapshotReady`) or Failed: its message and Ready condition say
/// so, and an Event (a warning when it failed).
async fn announce(
    ctx: &Context,
    snap: &StreamJobSnapshot,
    status: &mut StreamJobSnapshotStatus,
    reason: Reason,
    message: String,
    generation: Option<i64>,
) {
    let ready = reason == Reason::SnapshotReady;
    status.message = Some(message.clone());
    set_conditions(status, reason, &message, generation, jiff::Timestamp::now());
    ctx.event_on(snap.object_ref(&()), !ready, reason.as_str(), message)
        .await;
}

/// Runs the future `make` builds on a blocking thread of the runtime. The snapshot tools'
/// futures are not `Send` for every lifetime (their closures borrow what they iterate), which
/// a controller's reconciler must be; their work (listing, reading and checksumming every
/// file) does not belong on the reconciler's thread anyway.
async fn off_task<T, F, Fut>(make: F) -> Result<T, OperatorError>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = T>,
    T: Send + 'static,
{
    let handle = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || handle.block_on(make()))
        .await
        .map_err(|e| OperatorError::SnapshotTask(e.to_string()))
}
