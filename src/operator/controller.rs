//! Controller wiring: one kube-rs `Controller` per watched namespace, the finalizer around each
//! pass, the error policy, and the watches' timeouts and back-off.

use super::context::{Context, OperatorConfig};
use super::desired;
use super::error::OperatorError;
use super::metrics::OperatorMetrics;
use super::pods::delete_pod;
use crate::crd::StreamJob;
use crate::orchestrator::pass::requeue;
use crate::orchestrator::port::PortError;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use keyshift_core::reason::Reason;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::controller::{Action as Requeue, Controller};
use kube::runtime::finalizer::{Event as FinalizerEvent, finalizer};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Runs the operator until SIGTERM/Ctrl-C.
pub async fn run(config: OperatorConfig) -> Result<(), OperatorError> {
    crate::telemetry::install_crypto_provider();
    let client = Client::try_from(client_config(kube::Config::infer().await?))
        .map_err(OperatorError::Client)?;
    let metrics = Arc::new(OperatorMetrics::new());
    let addr = config.metrics_addr;
    let server = tokio::spawn(super::metrics::serve(addr, metrics.clone()));
    // Leader election (`src/leader.rs`): `run_controllers` runs only while this replica holds
    // the Lease; losing it ends `run` with an error, so the process exits and its Deployment
    // restarts it as a fresh candidate.
    let leader = config.leader.clone();
    let ctx = Arc::new(Context::new(client.clone(), config, metrics));
    let result = match leader {
        None => run_controllers(ctx).await,
        Some(leader) => {
            // A standby is healthy and ready too (readiness must not depend on leadership, or a
            // rolling update of two replicas never completes).
            ctx.metrics
                .ready
                .store(true, std::sync::atomic::Ordering::Relaxed);
            match crate::leader::run_while_leading(
                client,
                leader,
                crate::runtime::signal::shutdown_signal(),
                || run_controllers(ctx),
            )
            .await
            {
                Ok(crate::leader::Led::Finished(r)) => r,
                Ok(crate::leader::Led::ShutDownWhileStandingBy) => Ok(()),
                Err(e) => Err(e.into()),
            }
        }
    };
    server.abort();
    if let Ok(Ok(Err(source))) = tokio::time::timeout(Duration::from_millis(10), server).await {
        return Err(OperatorError::Metrics { addr, source });
    }
    result
}

/// Server-side timeout of the controller's watches: the API server ends each watch after this
/// long and the watcher starts the next one.
const WATCH_TIMEOUT_SECS: u32 = 50;

/// Longest silence on an API server connection before its request fails (and is retried).
/// kube's default, 295 s, is there to outlast its watches' default 290 s; with the watches ended
/// after [`WATCH_TIMEOUT_SECS`], a connection left hanging by a network partition fails a pass
/// or a watch within a minute instead of five.
const API_READ_TIMEOUT: Duration = Duration::from_secs(60);

fn client_config(mut config: kube::Config) -> kube::Config {
    config.read_timeout = Some(API_READ_TIMEOUT);
    config
}

fn watch_config() -> watcher::Config {
    watcher::Config::default().timeout(WATCH_TIMEOUT_SECS)
}

/// One controller per watched namespace (or one for all), until shutdown.
pub async fn run_controllers(ctx: Arc<Context>) -> Result<(), OperatorError> {
    let scopes: Vec<Option<String>> = if ctx.config.namespaces.is_empty() {
        vec![None]
    } else {
        ctx.config.namespaces.iter().cloned().map(Some).collect()
    };
    tracing::info!(
        namespaces = ?ctx.config.namespaces,
        storage = ?ctx.config.default_storage,
        image = %ctx.config.worker_image,
        "keyshift operator starting"
    );
    let snapshot_controllers = scopes
        .clone()
        .into_iter()
        .map(|ns| super::snapshot::run(ctx.clone(), ns, watch_config()));
    let controllers = scopes.into_iter().map(|ns| {
        let (jobs, pods): (Api<StreamJob>, Api<Pod>) = match &ns {
            Some(ns) => (
                Api::namespaced(ctx.client.clone(), ns),
                Api::namespaced(ctx.client.clone(), ns),
            ),
            None => (Api::all(ctx.client.clone()), Api::all(ctx.client.clone())),
        };
        let ctx = ctx.clone();
        let (waker, woken) = futures::channel::mpsc::unbounded();
        ctx.wakers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((ns.clone(), waker));
        async move {
            ctx.metrics
                .ready
                .store(true, std::sync::atomic::Ordering::Relaxed);
            let controller = Controller::new(jobs, watch_config());
            ctx.job_stores
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(controller.store());
            controller
                .owns(pods, watch_config().labels(desired::LABEL_JOB))
                .reconcile_on(woken)
                .with_config(
                    kube::runtime::controller::Config::default()
                        .concurrency(ctx.config.max_concurrent_reconciles),
                )
                .trigger_backoff(watch_backoff())
                .shutdown_on_signal()
                .run(reconcile_outer, error_policy, ctx)
                .for_each(|res| async move {
                    if let Err(e) = res {
                        tracing::debug!(error = %e, "reconcile");
                    }
                })
                .await;
        }
    });
    futures::future::join(
        futures::future::join_all(controllers),
        futures::future::join_all(snapshot_controllers),
    )
    .await;
    Ok(())
}

/// Back-off of the controller's watches after an error. kube's default (client-go's: 0.8 s
/// doubling to 30 s, reset after 120 s quiet) applies to the merged trigger stream, so after an
/// API server restart the watches came back up to a minute late: the delay had grown during the
/// outage, and the "too old resource version" that the fresh server answers to the first re-watch
/// counted as one more error. Meanwhile only requeues drove jobs, and a deletion waited for the
/// job's next requeue (5 minutes for a suspended job). Capped at 5 s here: two watches per
/// controller are no burden for an API server.
fn watch_backoff()
-> kube::runtime::utils::ResetTimerBackoff<kube::runtime::watcher::ExponentialBackoff> {
    kube::runtime::utils::ResetTimerBackoff::new(
        backon::ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(250))
            .with_max_delay(Duration::from_secs(5))
            .with_factor(2.0)
            .with_jitter()
            .without_max_times()
            .into(),
        Duration::from_secs(30),
    )
}

/// A failed pass is counted by its kind and retried after its kind's delay (plus jitter).
fn error_policy(job: Arc<StreamJob>, error: &OperatorError, ctx: Arc<Context>) -> Requeue {
    let kind = error.kind();
    ctx.metrics.record_error(
        &job.namespace().unwrap_or_default(),
        &job.name_any(),
        job.metadata.deletion_timestamp.is_some(),
        kind,
    );
    tracing::warn!(job = %job.name_any(), error = %error, kind = kind.label(), "reconcile failed; retrying");
    // Jittered: when the API server or the store fails, every job fails at once; their retries
    // should not arrive at once too.
    Requeue::requeue(crate::backoff::jittered(kind.retry_after()))
}

async fn reconcile_outer(job: Arc<StreamJob>, ctx: Arc<Context>) -> Result<Requeue, OperatorError> {
    let started = Instant::now();
    let ns = job.namespace().unwrap_or_default();
    let name = job.name_any();
    // A job on its way out that no longer carries our finalizer was cleaned up (or someone
    // removed the finalizer): nothing to do, and counting a pass would bring back the series its
    // cleanup removed.
    if job.metadata.deletion_timestamp.is_some()
        && !job.finalizers().iter().any(|f| f == desired::FINALIZER)
    {
        ctx.metrics.forget_job(&ns, &name);
        return Ok(Requeue::await_change());
    }
    // Not a pass (neither counted nor timed): the job waits for its background step. A deletion
    // goes ahead (its pods go, so the step fails and ends).
    if job.metadata.deletion_timestamp.is_none() && ctx.background_running(&ns, &name).await {
        return Ok(Requeue::requeue(requeue::BACKGROUND_BACKSTOP));
    }
    let deleting = job.metadata.deletion_timestamp.is_some();
    let api: Api<StreamJob> = Api::namespaced(ctx.client.clone(), &ns);
    let inner = ctx.clone();
    let result = match with_finalizer(&api, &ctx, job).await {
        Ok(job) => finalizer(&api, desired::FINALIZER, job, move |event| {
            let ctx = inner.clone();
            let fut: std::pin::Pin<
                Box<dyn std::future::Future<Output = Result<Requeue, OperatorError>> + Send>,
            > = match event {
                FinalizerEvent::Apply(job) => Box::pin(super::apply::apply(job, ctx)),
                FinalizerEvent::Cleanup(job) => Box::pin(cleanup(job, ctx)),
            };
            fut
        })
        .await
        .map_err(|e| match e {
            kube::runtime::finalizer::Error::ApplyFailed(e)
            | kube::runtime::finalizer::Error::CleanupFailed(e) => e,
            other => OperatorError::Finalizer(other.to_string()),
        }),
        Err(e) => Err(e),
    };
    // Counted once the pass is over, so that a cleanup (which forgets the job's series) is not
    // followed by a count that brings one back.
    ctx.metrics.record_pass(&ns, &name, deleting);
    ctx.metrics
        .reconcile_seconds
        .observe(started.elapsed().as_secs_f64());
    // Exact per-pass durations for `keyshift bench operator` (the histogram is too coarse).
    tracing::debug!(
        target: "keyshift::reconcile_pass",
        namespace = %ns,
        job = %name,
        seconds = started.elapsed().as_secs_f64(),
        ok = result.is_ok(),
        "reconcile pass"
    );
    result
}

/// Adds the cleanup finalizer to a job that lacks it and is not being deleted, and returns the
/// job as written. kube's `finalizer` helper adds it too, but then ends the pass and waits for
/// the watch event of its own patch: a new job's first status came one queue turn later, which
/// in a burst of creates (bounded concurrency, FIFO) is most of the latency. The patch carries
/// the resourceVersion it was based on, so a concurrent change fails it (409) and the pass is
/// retried. The patch's answer is the job as it now is, so the pass goes on without reading it.
async fn with_finalizer(
    api: &Api<StreamJob>,
    ctx: &Context,
    job: Arc<StreamJob>,
) -> Result<Arc<StreamJob>, OperatorError> {
    if job.metadata.deletion_timestamp.is_some()
        || job.finalizers().iter().any(|f| f == desired::FINALIZER)
    {
        return Ok(job);
    }
    let mut finalizers = job.finalizers().to_vec();
    finalizers.push(desired::FINALIZER.to_owned());
    let patch = serde_json::json!({
        "metadata": {
            "resourceVersion": job.resource_version(),
            "finalizers": finalizers,
        }
    });
    let updated = api
        .patch(
            &job.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .map_err(OperatorError::AddFinalizer)?;
    let (ns, name) = desired::job_key(&updated)?;
    ctx.entry(&ns, &name).lock().await.written_version = updated.resource_version();
    Ok(Arc::new(updated))
}

/// Deleting a StreamJob: remove its pods (savepoints and checkpoints stay in storage).
async fn cleanup(job: Arc<StreamJob>, ctx: Arc<Context>) -> Result<Requeue, OperatorError> {
    let (ns, name) = desired::job_key(&job)?;
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let list = pods
        .list(&ListParams::default().labels(&desired::selector(&name)))
        .await
        .map_err(|e| {
            OperatorError::Cleanup(PortError::new(
                format!("listing the pods of {name}"),
                e,
                true,
            ))
        })?;
    for p in list {
        delete_pod(&pods, &p.name_any())
            .await
            .map_err(OperatorError::Cleanup)?;
    }
    ctx.forget(&ns, &name);
    // The job's series go with it (a deleted job's last values are no one's business).
    ctx.metrics.forget_job(&ns, &name);
    ctx.event(
        &*job,
        false,
        Reason::Deleted.as_str(),
        "worker pods removed; snapshots are kept in storage".into(),
    )
    .await;
    Ok(Requeue::await_change())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::utils::Backoff;

    #[test]
    fn watch_backoff_starts_small_is_capped_and_resets() {
        let mut b = watch_backoff();
        let delays: Vec<Duration> = (0..30).map_while(|_| b.next()).collect();
        assert_eq!(delays.len(), 30, "it never gives up");
        assert!(delays[0] <= Duration::from_millis(500), "{delays:?}");
        // The cap (5 s) plus at most as much jitter.
        assert!(
            delays.iter().all(|d| *d <= Duration::from_secs(10)),
            "{delays:?}"
        );
        assert!(delays[29] >= Duration::from_secs(5), "{delays:?}");
        b.reset();
        let first = b.next().unwrap_or_default();
        assert!(
            first <= Duration::from_millis(500),
            "after reset: {first:?}"
        );
    }

    #[test]
    fn idle_watches_end_before_the_read_timeout_cuts_them() {
        let watch = watch_config();
        assert_eq!(watch.timeout, Some(WATCH_TIMEOUT_SECS));
        let config = client_config(kube::Config::new("https://127.0.0.1:6443".parse().unwrap()));
        let read = config.read_timeout.unwrap_or(Duration::MAX);
        // A watch with no events sends nothing until the server ends it: the client must wait
        // longer than that, with room for a slow server, and still far less than kube's 295 s.
        assert!(
            read >= Duration::from_secs(u64::from(WATCH_TIMEOUT_SECS) + 10),
            "{read:?}"
        );
        assert!(read <= Duration::from_secs(90), "{read:?}");
    }
}
