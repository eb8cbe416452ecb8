//! Leader election on a `coordination.k8s.io/v1` Lease, so that exactly one operator replica
//! reconciles at a time.
//!
//! # Protocol
//!
//! * A candidate **acquires** the Lease when it does not exist (create), when it has no holder
//!   (released), or when it has expired; otherwise it waits and looks again.
//! * The holder **renews** every `lease_duration / 3` by rewriting `renewTime`.
//! * Every write is a create or a `PUT` carrying the `resourceVersion` that was read, so when two
//!   candidates race for the same Lease the API server accepts one write and refuses the other
//!   with `409 Conflict`: two candidates never both hold it.
//! * **Expiry is judged on the candidate's own clock**, as client-go does: a Lease counts as
//!   expired once it has not changed (same `resourceVersion`) for its `leaseDurationSeconds`
//!   since this candidate first saw that version. Clocks of different nodes are never compared.
//!   A fresh candidate therefore waits one full lease duration before taking over a Lease whose
//!   holder died.
//! * A leader that cannot renew for `renew_deadline` (`2/3` of the lease duration, measured from
//!   the moment it *sent* its last successful renewal) gives up before any other candidate can
//!   consider the Lease expired, and so does a leader that finds another holder in the Lease.
//!   Once lost, leadership is not sought again by the same elector.
//! * On a clean shutdown ([`LeaderHandle::step_down`]) the leader **releases** the Lease (clears
//!   the holder, sets the duration to one second) so a standby takes over at its next look
//!   instead of waiting for expiry.
//!
//! # Contract for callers
//!
//! Reconcile only while [`LeaderHandle::is_leader`] is true. **When leadership is lost
//! ([`LeaderHandle::lost`] resolves), stop reconciling at once**: another replica may already be
//! acting. The keyshift operator exits with a non-zero status, so its Deployment restarts it as
//! a fresh candidate; that is simpler and safer than tearing down and rebuilding controllers
//! in-process.
//!
//! ```no_run
//! # async fn demo(client: kube::Client) -> Result<(), keyshift::leader::LeaderError> {
//! use keyshift::leader::{LeaderConfig, LeaderHandle};
//! let config = LeaderConfig::new("keyshift-system", "keyshift-operator", LeaderConfig::default_identity());
//! let mut leader = LeaderHandle::spawn(client, config)?;
//! leader.wait_for_leadership().await?;
//! tokio::select! {
//!     _ = leader.lost() => {
//!         tracing::error!("leadership lost; exiting so a fresh replica can take over");
//!         std::process::exit(1);
//!     }
//!     _ = tokio::signal::ctrl_c() => {
//!         // stop the controllers first, then hand the Lease over
//!         leader.step_down().await?;
//!     }
//! }
//! # Ok(()) }
//! ```

use crate::backoff;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use std::future::Future;
use std::time::Duration;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until, timeout, timeout_at};

/// Default lease duration (as client-go and controller-runtime use).
pub const DEFAULT_LEASE_DURATION: Duration = Duration::from_secs(15);
/// Shortest lease duration accepted: renewals every second.
pub const MIN_LEASE_DURATION: Duration = Duration::from_secs(3);
/// How long a release on shutdown may take before it is abandoned (the Lease then expires).
const RELEASE_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors of leader election.
#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    #[error("invalid leader election settings: {0}")]
    Config(String),
    #[error("lease {namespace}/{name}: Kubernetes API request failed: {source}")]
    Api {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("lease {namespace}/{name}: leadership lost: {reason}")]
    Lost {
        namespace: String,
        name: String,
        reason: String,
    },
    #[error("leader election task ended unexpectedly: {0}")]
    Task(String),
}

/// Where the Lease lives, who we are, and how long a lease lasts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderConfig {
    /// Namespace of the Lease (the operator's own namespace).
    pub namespace: String,
    /// Name of the Lease.
    pub lease_name: String,
    /// This candidate's identity, written to `holderIdentity`; unique per process.
    pub identity: String,
    /// How long a lease lasts without renewal (whole seconds, at least 3).
    pub lease_duration: Duration,
}

impl LeaderConfig {
    /// Settings with the [`DEFAULT_LEASE_DURATION`].
    pub fn new(
        namespace: impl Into<String>,
        lease_name: impl Into<String>,
        identity: impl Into<String>,
    ) -> Self {
        LeaderConfig {
            namespace: namespace.into(),
            lease_name: lease_name.into(),
            identity: identity.into(),
            lease_duration: DEFAULT_LEASE_DURATION,
        }
    }

    /// The same settings with another lease duration.
    pub fn with_lease_duration(mut self, lease_duration: Duration) -> Self {
        self.lease_duration = lease_duration;
        self
    }

    /// How often the holder renews: a third of the lease duration.
    pub fn renew_interval(&self) -> Duration {
        self.lease_duration / 3
    }

    /// How long the holder keeps leading without a successful renewal: two thirds of the lease
    /// duration, leaving a third as margin before anyone else may consider the lease expired.
    pub fn renew_deadline(&self) -> Duration {
        self.lease_duration * 2 / 3
    }

    /// Checks the settings.
    pub fn validate(&self) -> Result<(), LeaderError> {
        let bad = |m: String| Err(LeaderError::Config(m));
        if self.namespace.is_empty() {
            return bad(
                "the lease namespace is empty (set --lease-namespace or POD_NAMESPACE)".into(),
            );
        }
        if self.lease_name.is_empty() {
            return bad("the lease name is empty".into());
        }
        if self.identity.is_empty() {
            return bad("the candidate identity is empty".into());
        }
        if self.lease_duration < MIN_LEASE_DURATION
            || self.lease_duration.subsec_nanos() != 0
            || self.lease_duration.as_secs() > i32::MAX as u64
        {
            return bad(format!(
                "lease duration {:?} must be a whole number of seconds, at least {:?}",
                self.lease_duration, MIN_LEASE_DURATION
            ));
        }
        Ok(())
    }

    /// A unique identity for this process: the pod name (`POD_NAME`, else `HOSTNAME`, else the
    /// kernel's hostname) and a random suffix, so two processes in one pod never share it.
    pub fn default_identity() -> String {
        let host = ["POD_NAME", "HOSTNAME"]
            .iter()
            .filter_map(|v| std::env::var(v).ok())
            .find(|v| !v.is_empty())
            .or_else(|| {
                std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .ok()
                    .map(|h| h.trim().to_owned())
                    .filter(|h| !h.is_empty())
            })
            .unwrap_or_else(|| "keyshift".into());
        format!("{host}_{:08x}", random_u32())
    }
}

/// 32 random bits from the standard library's per-process random hash keys.
fn random_u32() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    h.write_u32(std::process::id());
    h.finish() as u32
}

// -------------------------------------------------------------------------------------------
// Pure decision logic
// -------------------------------------------------------------------------------------------

/// The parts of a Lease that the decision looks at.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LeaseRecord {
    /// `holderIdentity`; `None` or empty means free (released).
    pub holder: Option<String>,
    /// `leaseDurationSeconds`.
    pub lease_duration: Option<Duration>,
}

impl From<&LeaseSpec> for LeaseRecord {
    fn from(spec: &LeaseSpec) -> Self {
        LeaseRecord {
            holder: spec.holder_identity.clone().filter(|h| !h.is_empty()),
            lease_duration: spec
                .lease_duration_seconds
                .map(|s| Duration::from_secs(s.max(0) as u64)),
        }
    }
}

/// What a candidate should do after reading the Lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// No Lease exists: create it with us as holder.
    Create,
    /// We hold it: renew it.
    Renew,
    /// It is free or expired: take it over.
    Acquire,
    /// Someone else holds it and it has not expired: look again within `expires_in`.
    Wait {
        holder: String,
        expires_in: Duration,
    },
}

/// Decides from the Lease as read (`None`: it does not exist), the local time at which this
/// candidate first saw this version of it, and the local time now. `fallback_duration` applies
/// when the Lease names no duration.
pub fn decide(
    lease: Option<&LeaseRecord>,
    identity: &str,
    observed_at: Instant,
    now: Instant,
    fallback_duration: Duration,
) -> Decision {
    let Some(lease) = lease else {
        return Decision::Create;
    };
    match lease.holder.as_deref() {
        None => Decision::Acquire,
        Some(holder) if holder == identity => Decision::Renew,
        Some(holder) => {
            let expires = observed_at + lease.lease_duration.unwrap_or(fallback_duration);
            if now >= expires {
                Decision::Acquire
            } else {
                Decision::Wait {
                    holder: holder.to_owned(),
                    expires_in: expires - now,
                }
            }
        }
    }
}

/// Remembers since when the Lease has been unchanged (by `resourceVersion`), on our own clock.
#[derive(Debug, Default, Clone)]
pub struct Observer {
    seen: Option<(String, Instant)>,
}

impl Observer {
    /// Records that the Lease at `resource_version` was read at `now`; returns when this version
    /// was first seen.
    pub fn observe(&mut self, resource_version: &str, now: Instant) -> Instant {
        match &self.seen {
            Some((rv, at)) if rv == resource_version => *at,
            _ => {
                self.seen = Some((resource_version.to_owned(), now));
                now
            }
        }
    }
}

/// The Lease spec to write for `decision` (`Create`, `Renew` or `Acquire`), starting from the
/// current spec so fields we do not manage (e.g. `preferredHolder`, `strategy`) survive.
pub fn claim_spec(
    current: Option<&LeaseSpec>,
    decision: &Decision,
    identity: &str,
    lease_duration: Duration,
    now: Timestamp,
) -> LeaseSpec {
    let mut spec = current.cloned().unwrap_or_default();
    let previous_holder = spec.holder_identity.clone().unwrap_or_default();
    spec.holder_identity = Some(identity.to_owned());
    spec.lease_duration_seconds = Some(lease_duration.as_secs() as i32);
    spec.renew_time = Some(MicroTime(now));
    match decision {
        Decision::Create => {
            spec.acquire_time = Some(MicroTime(now));
            spec.lease_transitions = Some(0);
        }
        Decision::Acquire | Decision::Wait { .. } => {
            spec.acquire_time = Some(MicroTime(now));
            if previous_holder != identity {
                spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
            }
        }
        Decision::Renew => {
            if spec.acquire_time.is_none() {
                spec.acquire_time = Some(MicroTime(now));
            }
        }
    }
    spec
}

/// The Lease spec that releases it: no holder, a one-second duration (so a standby that saw the
/// holder before does not wait long), transitions kept.
pub fn release_spec(current: &LeaseSpec, now: Timestamp) -> LeaseSpec {
    LeaseSpec {
        holder_identity: None,
        lease_duration_seconds: Some(1),
        renew_time: Some(MicroTime(now)),
        acquire_time: None,
        ..current.clone()
    }
}

/// Whether a leader whose last successful renewal was *sent* at `last_renewal_sent` must give
/// up at `now`.
pub fn renewal_overdue(last_renewal_sent: Instant, now: Instant, config: &LeaderConfig) -> bool {
    now >= last_renewal_sent + config.renew_deadline()
}

// -------------------------------------------------------------------------------------------
// Runtime
// -------------------------------------------------------------------------------------------

/// A running leader election candidate (a background task). Dropping the handle stops the
/// candidate and releases the Lease if held, in the background (if the runtime keeps running);
/// prefer [`step_down`](Self::step_down), which waits for the release.
pub struct LeaderHandle {
    leader: watch::Receiver<bool>,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), LeaderError>>>,
    identity: String,
}

/// Result of one look at the Lease.
enum Round {
    /// We hold the Lease (created, acquired or renewed it).
    Leading,
    /// Someone else holds it; look again within this long.
    Following { holder: String, retry_in: Duration },
    /// Our write lost a race (409): look again soon.
    Contended,
}

struct Candidate {
    api: Api<Lease>,
    config: LeaderConfig,
    observer: Observer,
    leader: watch::Sender<bool>,
}

impl LeaderHandle {
    /// Starts a candidate for `config` on the current Tokio runtime.
    pub fn spawn(client: Client, config: LeaderConfig) -> Result<LeaderHandle, LeaderError> {
        config.validate()?;
        let (leader_tx, leader_rx) = watch::channel(false);
        let (shutdown_tx, shutdown_rx) = oneshot::channel();
        let identity = config.identity.clone();
        let candidate = Candidate {
            api: Api::namespaced(client, &config.namespace),
            config,
            observer: Observer::default(),
            leader: leader_tx,
        };
        let task = tokio::spawn(candidate.run(shutdown_rx));
        Ok(LeaderHandle {
            leader: leader_rx,
            shutdown: Some(shutdown_tx),
            task: Some(task),
            identity,
        })
    }

    /// This candidate's identity (as written to the Lease).
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Whether this candidate leads right now.
    pub fn is_leader(&self) -> bool {
        *self.leader.borrow()
    }

    /// "Am I leader", as a watch channel: `true` while leading.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.leader.clone()
    }

    /// Resolves once this candidate leads. Fails if the candidate stopped without ever leading
    /// (which happens only after [`step_down`](Self::step_down) or a bug).
    pub async fn wait_for_leadership(&mut self) -> Result<(), LeaderError> {
        let mut rx = self.leader.clone();
        if rx.wait_for(|leading| *leading).await.is_ok() {
            return Ok(());
        }
        match self.task.take() {
            Some(task) => match task.await {
                Ok(Err(e)) => Err(e),
                Ok(Ok(())) => Err(LeaderError::Task("stopped before leading".into())),
                Err(e) => Err(LeaderError::Task(e.to_string())),
            },
            None => Err(LeaderError::Task("stopped before leading".into())),
        }
    }

    /// A future that resolves when this candidate, having led, leads no more (lost the Lease or
    /// stepped down), or when it stops without ever leading. Independent of `self`, so it can be
    /// moved into a `select!` or a task.
    pub fn lost(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.leader.clone();
        async move {
            if rx.wait_for(|leading| *leading).await.is_err() {
                return;
            }
            let _ = rx.wait_for(|leading| !*leading).await;
        }
    }

    /// Stops the candidate; a leader first flips the watch to `false`, then releases the Lease
    /// so a standby takes over at once. Returns the candidate's error if it had already failed
    /// (e.g. [`LeaderError::Lost`]).
    pub async fn step_down(mut self) -> Result<(), LeaderError> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        match self.task.take() {
            Some(task) => task
                .await
                .map_err(|e| LeaderError::Task(e.to_string()))
                .and_then(|r| r),
            None => Ok(()),
        }
    }

    /// Stops the candidate at once *without* releasing the Lease, as a crash would: the others
    /// take over once it expires. For tests and for emergencies.
    pub fn abandon(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
        // Dropped unsent: the task (should it run again before the abort lands) stops without
        // releasing.
        self.shutdown.take();
    }
}

impl Drop for LeaderHandle {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

impl Candidate {
    fn api_error(&self, source: kube::Error) -> LeaderError {
        LeaderError::Api {
            namespace: self.config.namespace.clone(),
            name: self.config.lease_name.clone(),
            source,
        }
    }

    fn lost(&self, reason: impl Into<String>) -> LeaderError {
        let _ = self.leader.send(false);
        let reason = reason.into();
        tracing::error!(
            lease = %self.config.lease_name,
            namespace = %self.config.namespace,
            identity = %self.config.identity,
            %reason,
            "leadership lost"
        );
        LeaderError::Lost {
            namespace: self.config.namespace.clone(),
            name: self.config.lease_name.clone(),
            reason,
        }
    }

    /// Reads the Lease and creates, acquires or renews it if we may.
    async fn round(&mut self) -> Result<Round, LeaderError> {
        let name = self.config.lease_name.clone();
        let current = self
            .api
            .get_opt(&name)
            .await
            .map_err(|e| self.api_error(e))?;
        let now = Instant::now();
        let observed_at = match &current {
            Some(lease) => self
                .observer
                .observe(&lease.resource_version().unwrap_or_default(), now),
            None => now,
        };
        let record = current
            .as_ref()
            .map(|l| l.spec.as_ref().map(LeaseRecord::from).unwrap_or_default());
        let decision = decide(
            record.as_ref(),
            &self.config.identity,
            observed_at,
            now,
            self.config.lease_duration,
        );
        let written = match (&decision, current) {
            (Decision::Wait { holder, expires_in }, _) => {
                return Ok(Round::Following {
                    holder: holder.clone(),
                    retry_in: *expires_in,
                });
            }
            // `decide` answers Create exactly when there is no Lease.
            (_, None) => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(name.clone()),
                        namespace: Some(self.config.namespace.clone()),
                        ..Default::default()
                    },
                    spec: Some(claim_spec(
                        None,
                        &Decision::Create,
                        &self.config.identity,
                        self.config.lease_duration,
                        Timestamp::now(),
                    )),
                };
                self.api.create(&PostParams::default(), &lease).await
            }
            (_, Some(mut lease)) => {
                // A PUT with the resourceVersion we read: refused with 409 if anyone wrote since.
                lease.spec = Some(claim_spec(
                    lease.spec.as_ref(),
                    &decision,
                    &self.config.identity,
                    self.config.lease_duration,
                    Timestamp::now(),
                ));
                self.api
                    .replace(&name, &PostParams::default(), &lease)
                    .await
            }
        };
        match written {
            Ok(lease) => {
                // Our own write is a version we have seen.
                self.observer
                    .observe(&lease.resource_version().unwrap_or_default(), now);
                if decision != Decision::Renew {
                    tracing::debug!(lease = %name, ?decision, "lease claimed");
                }
                Ok(Round::Leading)
            }
            Err(kube::Error::Api(s)) if s.is_conflict() || s.is_already_exists() => {
                Ok(Round::Contended)
            }
            Err(e) => Err(self.api_error(e)),
        }
    }

    async fn run(mut self, mut shutdown: oneshot::Receiver<()>) -> Result<(), LeaderError> {
        let config = self.config.clone();
        let interval = config.renew_interval();
        // Send time of the last successful renewal, while leading.
        let mut leading_since: Option<Instant> = None;
        tracing::info!(
            lease = %config.lease_name,
            namespace = %config.namespace,
            identity = %config.identity,
            lease_duration = ?config.lease_duration,
            "leader election: candidate started"
        );
        loop {
            let sent = Instant::now();
            // A leader's round must finish before its renew deadline; a candidate's within
            // one interval (a hung request is retried).
            let round_deadline = match leading_since {
                Some(last) => last + config.renew_deadline(),
                None => sent + interval.max(Duration::from_secs(1)),
            };
            let outcome = tokio::select! {
                r = timeout_at(round_deadline, self.round()) => r,
                stop = &mut shutdown => match stop {
                    Ok(()) => break,
                    // Abandoned: stop without releasing.
                    Err(_) => return Ok(()),
                },
            };
            let next = match outcome {
                Ok(Ok(Round::Leading)) => {
                    if leading_since.is_none() {
                        tracing::info!(
                            lease = %config.lease_name,
                            namespace = %config.namespace,
                            identity = %config.identity,
                            "leadership acquired"
                        );
                        let _ = self.leader.send(true);
                    }
                    leading_since = Some(sent);
                    sent + interval
                }
                Ok(Ok(Round::Following { holder, retry_in })) => {
                    if leading_since.is_some() {
                        return Err(self.lost(format!("the lease is now held by {holder}")));
                    }
                    tracing::debug!(%holder, ?retry_in, "lease held by another candidate");
                    // Look again when it would expire, or after one interval, whichever is
                    // first (a release is noticed within an interval).
                    Instant::now() + retry_in.min(interval) + Duration::from_millis(10)
                }
                Ok(Ok(Round::Contended)) => {
                    tracing::debug!("lost a race for the lease; looking again");
                    // Jittered, so two replicas that raced do not race again in step.
                    Instant::now() + backoff::jittered_within(Duration::from_millis(100))
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "leader election round failed; retrying");
                    // A leader retries soon (its deadline runs); a candidate at its pace. Both
                    // jittered, never later than these bounds.
                    match leading_since {
                        Some(_) => {
                            Instant::now()
                                + backoff::jittered_within(interval.min(Duration::from_secs(1)))
                        }
                        None => Instant::now() + backoff::jittered_within(interval),
                    }
                }
                Err(_) => {
                    tracing::warn!("leader election round timed out; retrying");
                    Instant::now()
                }
            };
            if let Some(last) = leading_since
                && renewal_overdue(last, Instant::now(), &config)
            {
                return Err(self.lost(format!(
                    "could not renew within {:?}",
                    config.renew_deadline()
                )));
            }
            // A leader never sleeps past its renew deadline.
            let next = match leading_since {
                Some(last) => next.min(last + config.renew_deadline()),
                None => next,
            };
            tokio::select! {
                _ = sleep_until(next) => {}
                stop = &mut shutdown => match stop {
                    Ok(()) => break,
                    Err(_) => return Ok(()),
                },
            }
        }
        // Shutdown requested (or the handle dropped).
        if leading_since.is_some() {
            let _ = self.leader.send(false);
            match timeout(RELEASE_TIMEOUT, self.release()).await {
                Ok(Ok(())) => tracing::info!(
                    lease = %config.lease_name,
                    identity = %config.identity,
                    "stepped down: lease released"
                ),
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "releasing the lease failed; it will expire");
                    return Err(e);
                }
                Err(_) => tracing::warn!("releasing the lease timed out; it will expire"),
            }
        }
        Ok(())
    }

    /// Clears the holder if it is still us (a PUT with the version read, retried on conflict).
    async fn release(&mut self) -> Result<(), LeaderError> {
        let name = self.config.lease_name.clone();
        for _ in 0..3 {
            let Some(mut lease) = self
                .api
                .get_opt(&name)
                .await
                .map_err(|e| self.api_error(e))?
            else {
                return Ok(());
            };
            let Some(spec) = lease.spec.as_ref() else {
                return Ok(());
            };
            if spec.holder_identity.as_deref() != Some(self.config.identity.as_str()) {
                return Ok(());
            }
            lease.spec = Some(release_spec(spec, Timestamp::now()));
            match self
                .api
                .replace(&name, &PostParams::default(), &lease)
                .await
            {
                Ok(_) => return Ok(()),
                Err(kube::Error::Api(s)) if s.is_conflict() => continue,
                Err(e) => return Err(self.api_error(e)),
            }
        }
        Ok(())
    }
}

/// What [`run_while_leading`] ended with.
#[derive(Debug)]
pub enum Led<T> {
    /// `work` ran to completion (e.g. the controllers stopped on a signal); the Lease was
    /// released.
    Finished(T),
    /// `shutdown` came before this replica became leader; `work` never started.
    ShutDownWhileStandingBy,
}

/// Runs `work` only while this replica leads: waits for the Lease (until `shutdown` resolves),
/// then runs the future `work()` returns until it finishes, and releases the Lease. Returns
/// [`LeaderError::Lost`] as soon as leadership is lost, dropping `work` mid-way: the caller
/// must then exit (the operator exits non-zero so its Deployment restarts it).
///
/// This is the operator's integration point:
///
/// ```no_run
/// # async fn demo(client: kube::Client, ns: String, run_controllers: impl std::future::Future<Output = ()>) -> Result<(), keyshift::leader::LeaderError> {
/// use keyshift::leader::{LeaderConfig, Led, run_while_leading};
/// use keyshift::runtime::signal::shutdown_signal;
/// let config = LeaderConfig::new(ns, "keyshift-operator", LeaderConfig::default_identity());
/// match run_while_leading(client, config, shutdown_signal(), || run_controllers).await? {
///     Led::Finished(()) | Led::ShutDownWhileStandingBy => Ok(()),
/// }
/// # }
/// ```
pub async fn run_while_leading<W, F>(
    client: Client,
    config: LeaderConfig,
    shutdown: impl Future<Output = ()>,
    work: W,
) -> Result<Led<F::Output>, LeaderError>
where
    W: FnOnce() -> F,
    F: Future,
{
    let mut leader = LeaderHandle::spawn(client, config)?;
    tokio::pin!(shutdown);
    tokio::select! {
        r = leader.wait_for_leadership() => r?,
        _ = &mut shutdown => {
            leader.step_down().await?;
            return Ok(Led::ShutDownWhileStandingBy);
        }
    }
    tracing::info!(identity = %leader.identity(), "leading: starting work");
    let lost = leader.lost();
    tokio::select! {
        out = work() => {
            leader.step_down().await?;
            Ok(Led::Finished(out))
        }
        _ = lost => {
            // step_down reports why (Lost, or an API error); a stop without an error would
            // mean the candidate ended on its own, which it does only when told to.
            match leader.step_down().await {
                Err(e) => Err(e),
                Ok(()) => Err(LeaderError::Task("leadership ended unexpectedly".into())),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ME: &str = "me";
    const D: Duration = Duration::from_secs(15);

    fn held(by: &str, secs: u64) -> LeaseRecord {
        LeaseRecord {
            holder: Some(by.into()),
            lease_duration: Some(Duration::from_secs(secs)),
        }
    }

    #[test]
    fn missing_lease_is_created() {
        let t = Instant::now();
        assert_eq!(decide(None, ME, t, t, D), Decision::Create);
    }

    #[test]
    fn free_lease_is_acquired_at_once() {
        let t = Instant::now();
        let free = LeaseRecord::default();
        assert_eq!(decide(Some(&free), ME, t, t, D), Decision::Acquire);
        // An empty holder (as other implementations release) is free too.
        let spec = LeaseSpec {
            holder_identity: Some(String::new()),
            lease_duration_seconds: Some(1),
            ..Default::default()
        };
        assert_eq!(
            decide(Some(&LeaseRecord::from(&spec)), ME, t, t, D),
            Decision::Acquire
        );
    }

    #[test]
    fn own_lease_is_renewed() {
        let t = Instant::now();
        assert_eq!(
            decide(Some(&held(ME, 15)), ME, t, t + D * 10, D),
            Decision::Renew
        );
    }

    #[test]
    fn taken_lease_is_waited_for_until_it_expires_on_our_clock() {
        let seen = Instant::now();
        let other = held("other", 10);
        assert_eq!(
            decide(Some(&other), ME, seen, seen, D),
            Decision::Wait {
                holder: "other".into(),
                expires_in: Duration::from_secs(10)
            }
        );
        assert_eq!(
            decide(Some(&other), ME, seen, seen + Duration::from_secs(4), D),
            Decision::Wait {
                holder: "other".into(),
                expires_in: Duration::from_secs(6)
            }
        );
        // Expired: the lease's own duration counts, not ours.
        assert_eq!(
            decide(Some(&other), ME, seen, seen + Duration::from_secs(10), D),
            Decision::Acquire
        );
        // Without a duration in the lease, ours applies.
        let no_duration = LeaseRecord {
            holder: Some("other".into()),
            lease_duration: None,
        };
        assert!(matches!(
            decide(
                Some(&no_duration),
                ME,
                seen,
                seen + Duration::from_secs(10),
                D
            ),
            Decision::Wait { .. }
        ));
        assert_eq!(
            decide(Some(&no_duration), ME, seen, seen + D, D),
            Decision::Acquire
        );
    }

    #[test]
    fn expiry_restarts_whenever_the_lease_changes() {
        let t0 = Instant::now();
        let mut obs = Observer::default();
        assert_eq!(obs.observe("1", t0), t0);
        // Same version later: still first seen at t0.
        assert_eq!(obs.observe("1", t0 + Duration::from_secs(5)), t0);
        // The holder renewed (new version): the clock restarts.
        let t1 = t0 + Duration::from_secs(9);
        assert_eq!(obs.observe("2", t1), t1);
        let other = held("other", 10);
        let at = obs.observe("2", t0 + Duration::from_secs(12));
        assert!(matches!(
            decide(Some(&other), ME, at, t0 + Duration::from_secs(12), D),
            Decision::Wait { .. }
        ));
        assert_eq!(
            decide(Some(&other), ME, at, t1 + Duration::from_secs(10), D),
            Decision::Acquire
        );
    }

    #[test]
    fn claims_and_releases() {
        let now = Timestamp::from_second(1_700_000_000).unwrap();
        let created = claim_spec(None, &Decision::Create, ME, D, now);
        assert_eq!(created.holder_identity.as_deref(), Some(ME));
        assert_eq!(created.lease_duration_seconds, Some(15));
        assert_eq!(created.lease_transitions, Some(0));
        assert_eq!(created.acquire_time, Some(MicroTime(now)));
        assert_eq!(created.renew_time, Some(MicroTime(now)));

        let later = Timestamp::from_second(1_700_000_005).unwrap();
        let renewed = claim_spec(Some(&created), &Decision::Renew, ME, D, later);
        assert_eq!(renewed.acquire_time, Some(MicroTime(now)), "kept");
        assert_eq!(renewed.renew_time, Some(MicroTime(later)));
        assert_eq!(renewed.lease_transitions, Some(0));

        let theirs = LeaseSpec {
            holder_identity: Some("other".into()),
            lease_transitions: Some(3),
            preferred_holder: Some("x".into()),
            ..created.clone()
        };
        let taken = claim_spec(Some(&theirs), &Decision::Acquire, ME, D, later);
        assert_eq!(taken.holder_identity.as_deref(), Some(ME));
        assert_eq!(taken.lease_transitions, Some(4));
        assert_eq!(taken.acquire_time, Some(MicroTime(later)));
        assert_eq!(
            taken.preferred_holder.as_deref(),
            Some("x"),
            "unmanaged fields survive"
        );

        let released = release_spec(&taken, later);
        assert_eq!(released.holder_identity, None);
        assert_eq!(released.lease_duration_seconds, Some(1));
        assert_eq!(released.lease_transitions, Some(4));
        assert_eq!(
            decide(
                Some(&LeaseRecord::from(&released)),
                "other",
                Instant::now(),
                Instant::now(),
                D
            ),
            Decision::Acquire
        );
        // Taking a released lease is a transition as well.
        let retaken = claim_spec(Some(&released), &Decision::Acquire, "other", D, later);
        assert_eq!(retaken.lease_transitions, Some(5));
    }

    #[test]
    fn a_leader_gives_up_before_anyone_may_take_over() {
        let config = LeaderConfig::new("ns", "lease", ME);
        assert_eq!(config.renew_interval(), Duration::from_secs(5));
        assert_eq!(config.renew_deadline(), Duration::from_secs(10));
        let sent = Instant::now();
        assert!(!renewal_overdue(
            sent,
            sent + Duration::from_secs(9),
            &config
        ));
        assert!(renewal_overdue(
            sent,
            sent + Duration::from_secs(10),
            &config
        ));
        // Others see our write no earlier than we sent it, so they wait at least until
        // sent + lease_duration: strictly after we gave up.
        let other_seen_at = sent;
        let ours = held(ME, 15);
        assert!(matches!(
            decide(
                Some(&ours),
                "other",
                other_seen_at,
                sent + config.renew_deadline(),
                D
            ),
            Decision::Wait { .. }
        ));
    }

    #[test]
    fn settings_are_checked() {
        let ok = LeaderConfig::new("ns", "lease", ME);
        ok.validate().expect("defaults are valid");
        for bad in [
            LeaderConfig::new("", "lease", ME),
            LeaderConfig::new("ns", "", ME),
            LeaderConfig::new("ns", "lease", ""),
            ok.clone().with_lease_duration(Duration::from_secs(2)),
            ok.clone().with_lease_duration(Duration::from_millis(4500)),
        ] {
            assert!(
                matches!(bad.validate(), Err(LeaderError::Config(_))),
                "{bad:?}"
            );
        }
        let a = LeaderConfig::default_identity();
        let b = LeaderConfig::default_identity();
        assert_ne!(a, b, "identities are unique per candidate");
        assert!(a.contains('_'), "{a}");
    }
}
