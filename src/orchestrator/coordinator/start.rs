//! Starting a run's workers (or pre-staging them) and waiting until they restored their key
//! groups and connected, with the restore's progress summed over the workers.

use super::*;

/// Refuses a start whose workers (`accepted`, in subtask order) listed different source
/// partitions. Pure.
pub(super) fn check_partition_lists(accepted: &[StartAccepted]) -> Result<(), CoordinatorError> {
    let lists: Vec<Option<&PartitionList>> = accepted
        .iter()
        .map(|a| a.source_partitions.as_ref())
        .collect();
    match PartitionList::first_difference(&lists) {
        None => Ok(()),
        Some(subtask) => Err(CoordinatorError::PartitionsDiffer {
            subtask,
            first: PartitionList::describe(lists[0]),
            other: PartitionList::describe(lists[subtask]),
        }),
    }
}

/// How far the restore of a run's start got, summed over its workers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StartProgress {
    /// Bytes of the snapshot's state read so far.
    pub bytes_read: u64,
    /// Bytes the workers read in all.
    pub bytes_total: u64,
    /// Key groups read so far.
    pub groups_read: u64,
    /// Key groups the workers read in all.
    pub groups_total: u64,
    /// Subtasks whose restore is done.
    pub subtasks_done: u32,
    /// Subtasks of the run.
    pub subtasks: u32,
}

impl StartProgress {
    /// The sum over a run's workers of what each accepted to read (`accepted`, from
    /// `/v1/start`), how far each reports it got (`reported`, from `/v1/status` while it
    /// restores) and what each restored once done (`done`); all in subtask order. Pure.
    pub fn sum(
        accepted: &[StartAccepted],
        reported: &[Option<RestoreProgress>],
        done: &[Option<StartResponse>],
    ) -> StartProgress {
        let mut sum = StartProgress {
            subtasks: accepted.len() as u32,
            ..StartProgress::default()
        };
        for (i, a) in accepted.iter().enumerate() {
            let (read, total, groups_read, groups_total) = match (
                done.get(i).and_then(Option::as_ref),
                reported.get(i).copied().flatten(),
            ) {
                (Some(d), _) => {
                    sum.subtasks_done += 1;
                    let groups = u64::from(d.groups_restored);
                    (
                        d.bytes_read,
                        a.bytes_total.max(d.bytes_read),
                        groups,
                        u64::from(a.groups_total).max(groups),
                    )
                }
                (None, Some(p)) => (
                    p.bytes_read,
                    p.bytes_total,
                    u64::from(p.groups_read),
                    u64::from(p.groups_total),
                ),
                (None, None) => (0, a.bytes_total, 0, u64::from(a.groups_total)),
            };
            sum.bytes_read += read;
            sum.bytes_total += total;
            sum.groups_read += groups_read;
            sum.groups_total += groups_total;
        }
        sum
    }
}

impl Coordinator {
    /// Starts every worker with its subtask index and waits until all are connected.
    /// `template.subtask` is overwritten per worker; `template.peers` is filled in. Every worker
    /// lists a file source's directory itself when it checks its request: a start whose workers
    /// listed different partitions is refused ([`CoordinatorError::PartitionsDiffer`]; the
    /// platform starts again as after any failed start), so that none reads another list. Then, with a
    /// sink, publishes the output of what the run restored from (`template.restore_from`) and of
    /// the job's committed snapshots before it, unless already published (the crash may have
    /// come between commit and publish) -- only when the restored snapshot is this job's own
    /// (its manifest names this job): another job's snapshot says nothing about this job's
    /// output, and a staged directory of ours with the same id may belong to a snapshot of ours
    /// that never committed. A publish failure does not fail the start: it is pending
    /// ([`Coordinator::publish_backlog`]).
    pub async fn start(
        &self,
        template: &StartRequest,
        ready_timeout: Duration,
    ) -> Result<Vec<StartResponse>, CoordinatorError> {
        let began = Instant::now();
        let peers: Vec<String> = self.workers.iter().map(|w| w.data.clone()).collect();
        // Each worker checks its request and answers at once (with what it reads in all); the
        // restores run on.
        let accepted = try_join_all((0..self.workers.len()).map(|i| {
            let mut req = template.clone();
            req.subtask = i as u32;
            req.peers = peers.clone();
            // The workers' data planes wait for each other as long as this start waits.
            req.ready_timeout_secs = Some(ready_timeout.as_secs().max(1));
            async move {
                self.post::<_, StartAccepted>(i, "/v1/start", &req)
                    .await
                    .map(Option::unwrap_or_default)
            }
        }))
        .await?;
        check_partition_lists(&accepted)?;
        let responses = self
            .wait_restored(
                &accepted,
                began,
                ready_timeout,
                template.restore_from.as_deref(),
            )
            .await?;
        self.wait_ready(ready_timeout.saturating_sub(began.elapsed()))
            .await?;
        if let Some(url) = &template.restore_from {
            self.publish_restored(url).await;
        }
        Ok(responses)
    }

    /// Polls every worker's `/v1/status` until each has restored its state (what it reports
    /// then, in subtask order), one reports that its start failed (the snapshot `restoring`
    /// itself, when the worker says so: [`CoordinatorError::Unrestorable`]), or `timeout`
    /// (counted from `began`) passes. Each round's progress (over `accepted`, what each worker said it reads)
    /// goes to [`Coordinator::restore_progress`].
    pub(super) async fn wait_restored(
        &self,
        accepted: &[StartAccepted],
        began: Instant,
        timeout: Duration,
        restoring: Option<&str>,
    ) -> Result<Vec<StartResponse>, CoordinatorError> {
        /// Status requests in a row that may fail before the worker counts as gone.
        const STATUS_FAILURES: u32 = 3;
        let n = self.workers.len();
        let mut done: Vec<Option<StartResponse>> = vec![None; n];
        let mut failures = vec![0u32; n];
        let mut progress: Vec<Option<RestoreProgress>> = vec![None; n];
        let mut logged = Instant::now();
        let mut round = 0u32;
        loop {
            round = round.saturating_add(1);
            for i in 0..n {
                if done[i].is_some() {
                    continue;
                }
                let st = match self.get::<WorkerStatus>(i, "/v1/status").await {
                    Ok(st) => {
                        failures[i] = 0;
                        st
                    }
                    Err(e) => {
                        failures[i] += 1;
                        if failures[i] >= STATUS_FAILURES {
                            return Err(e);
                        }
                        continue;
                    }
                };
                match st.state {
                    WorkerState::Restoring => progress[i] = st.restore,
                    // Pre-staged and not started yet: a moment later.
                    WorkerState::Prestaged => {}
                    // Running before `started` is filled in: a moment later.
                    WorkerState::Running | WorkerState::Stopped => done[i] = st.started,
                    WorkerState::Idle => {
                        let reason = st.last_start_error.unwrap_or_else(|| {
                            "the worker is idle again (it restarted and lost the start)".into()
                        });
                        if st.last_start_refused {
                            return Err(CoordinatorError::Refused {
                                subtask: i,
                                url: self.workers[i].control.clone(),
                                reason,
                            });
                        }
                        if st.last_start_unrestorable
                            && let Some(snapshot) = restoring
                        {
                            return Err(CoordinatorError::Unrestorable {
                                subtask: i,
                                url: self.workers[i].control.clone(),
                                snapshot: snapshot.to_owned(),
                                reason,
                            });
                        }
                        return Err(self.fail(i, format!("/v1/start: restore failed: {reason}")));
                    }
                }
            }
            let sum = StartProgress::sum(accepted, &progress, &done);
            self.restore.send_replace(Some(sum));
            let waiting: Vec<usize> = (0..n).filter(|i| done[*i].is_none()).collect();
            if waiting.is_empty() {
                return Ok(done.into_iter().map(Option::unwrap_or_default).collect());
            }
            let (read, total) = (sum.bytes_read, sum.bytes_total);
            if began.elapsed() > timeout {
                return Err(CoordinatorError::NotReady(
                    timeout.as_secs(),
                    format!("subtasks {waiting:?} still restoring ({read} of {total} bytes read)"),
                ));
            }
            if logged.elapsed() >= Duration::from_secs(5) {
                logged = Instant::now();
                tracing::info!(
                    subtasks = ?waiting,
                    bytes_read = read,
                    bytes_total = total,
                    subtasks_done = sum.subtasks_done,
                    "restoring"
                );
            }
            // Every 200 ms (sooner in the first rounds: a pre-staged start or a small restore is
            // done in a few milliseconds, and every poll interval is part of a rescale's pause),
            // and no more than 200 status requests a second in all (a 200-worker run on a
            // small node polls once a second).
            // (Counted over the subtasks still polled: a few slow ones are not polled as
            // seldom as all.)
            let pause = Duration::from_millis((5u64 << round.min(6)).min(200))
                .max(Duration::from_millis(5) * waiting.len() as u32);
            tokio::time::sleep(pause).await;
        }
    }

    /// Pre-stages every worker (`POST /v1/prestage`, see [`crate::runtime::prestage`]): each
    /// loads its key groups from `template.restore_from`, one of the job's checkpoints, and
    /// holds them without reading any source or connecting to any peer. Waits until all are
    /// `prestaged` (what each loaded, in subtask order), one failed, or `timeout` passed. A
    /// later [`Coordinator::start`] of the same workers with a later checkpoint of the job then
    /// reads only what changed since.
    pub async fn prestage(
        &self,
        template: &StartRequest,
        timeout: Duration,
    ) -> Result<Vec<StartResponse>, CoordinatorError> {
        let began = Instant::now();
        let peers: Vec<String> = self.workers.iter().map(|w| w.data.clone()).collect();
        try_join_all((0..self.workers.len()).map(|i| {
            let mut req = template.clone();
            req.subtask = i as u32;
            req.peers = peers.clone();
            async move {
                self.post::<_, StartAccepted>(i, "/v1/prestage", &req)
                    .await
                    .map(Option::unwrap_or_default)
            }
        }))
        .await?;
        let n = self.workers.len();
        let mut done: Vec<Option<StartResponse>> = vec![None; n];
        let mut round = 0u32;
        loop {
            round = round.saturating_add(1);
            for (i, slot) in done.iter_mut().enumerate() {
                if slot.is_some() {
                    continue;
                }
                let st = self.get::<WorkerStatus>(i, "/v1/status").await?;
                match st.state {
                    WorkerState::Prestaged => *slot = Some(st.prestaged.unwrap_or_default()),
                    WorkerState::Restoring => {}
                    WorkerState::Idle => {
                        let reason = st
                            .last_start_error
                            .unwrap_or_else(|| "the worker is idle (it restarted?)".into());
                        if st.last_start_refused {
                            return Err(CoordinatorError::Refused {
                                subtask: i,
                                url: self.workers[i].control.clone(),
                                reason,
                            });
                        }
                        return Err(self.fail(i, format!("/v1/prestage: {reason}")));
                    }
                    other => {
                        return Err(self.fail(i, format!("/v1/prestage: the worker is {other:?}")));
                    }
                }
            }
            if done.iter().all(Option::is_some) {
                return Ok(done.into_iter().flatten().collect());
            }
            if began.elapsed() > timeout {
                let waiting: Vec<usize> = (0..n).filter(|i| done[*i].is_none()).collect();
                return Err(CoordinatorError::NotReady(
                    timeout.as_secs(),
                    format!("subtasks {waiting:?} still pre-staging"),
                ));
            }
            // As a start's: sooner in the first rounds (a catch-up round's delta is read in a few
            // milliseconds, and the stop's delta covers every millisecond of the last round),
            // every 200 ms later, and no more than 200 status requests a second in all (over
            // the subtasks still polled).
            let waiting = done.iter().filter(|d| d.is_none()).count();
            let pause = Duration::from_millis((5u64 << round.min(6)).min(200))
                .max(Duration::from_millis(5) * waiting as u32);
            tokio::time::sleep(pause).await;
        }
    }

    /// Waits until every worker answers `/v1/readyz`.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<(), CoordinatorError> {
        let start = Instant::now();
        let mut round = 0u32;
        loop {
            round = round.saturating_add(1);
            let mut waiting = Vec::new();
            for (i, w) in self.workers.iter().enumerate() {
                let ok = self
                    .http
                    .get(format!("{}/v1/readyz", w.control))
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success());
                if !ok {
                    waiting.push(i);
                }
            }
            if waiting.is_empty() {
                return Ok(());
            }
            if start.elapsed() > timeout {
                return Err(CoordinatorError::NotReady(
                    timeout.as_secs(),
                    format!("subtasks {waiting:?}"),
                ));
            }
            // Every 100 ms, sooner at first (the peers usually connect in milliseconds).
            tokio::time::sleep(Duration::from_millis((2u64 << round.min(6)).min(100))).await;
        }
    }
}
