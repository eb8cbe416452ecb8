//! Publishing the sink's output of committed snapshots, in id order, retried after every later
//! commit (see the module's parent for the contract).

use super::*;

/// Whether the sink's committed output is all visible ([`Coordinator::publish_backlog`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PublishBacklog {
    /// Committed snapshots whose output is not (all) published yet, oldest first; retried after
    /// every commit and by [`Coordinator::publish_pending`].
    pub pending: Vec<u64>,
    /// Why the last attempt failed, while anything is pending.
    pub last_error: Option<String>,
}

impl PublishBacklog {
    /// Whether publishing is behind.
    pub fn is_behind(&self) -> bool {
        !self.pending.is_empty()
    }
}

/// The object-store sink a coordinator publishes.
pub(super) struct Sink {
    pub(super) store: Arc<dyn ObjectStore>,
    pub(super) base: Path,
    /// Whether snapshot ids were raised above the ids of the sink's output yet.
    pub(super) ids_checked: bool,
    /// Whether this coordinator looked for committed output that an earlier one left
    /// unpublished (it does at its first commit).
    pub(super) caught_up: bool,
    /// Committed ids not published yet (a lock: publishing runs behind `&self`, e.g. in
    /// [`Coordinator::start`]; never held across an await).
    pub(super) backlog: Mutex<(BTreeSet<u64>, Option<String>)>,
    /// Committed snapshots of the job newer than the one this run restored from: the run went
    /// back past them (their records are processed again, their results published under new
    /// ids), so their own staged output is never published.
    pub(super) abandoned: Mutex<BTreeSet<u64>>,
    /// Whether the next snapshot's output is held back (joins `abandoned` when triggered):
    /// [`Coordinator::hold_output_of_next_snapshot`].
    pub(super) hold_next: bool,
    /// For a Kafka sink: the publisher that produces the staged output (instead of copying it
    /// to published objects; see [`crate::job::kafka::sink`]).
    #[cfg(feature = "kafka")]
    pub(super) kafka: Option<Arc<crate::job::kafka::sink::KafkaPublisher>>,
    /// Whether snapshot ids were raised above the Kafka sink's marker yet.
    #[cfg(feature = "kafka")]
    pub(super) marker_checked: bool,
}

impl Sink {
    /// Makes snapshot `id`'s staged output visible: published objects, or records of a Kafka
    /// transaction. A summary for the log.
    async fn publish_one(&self, id: u64) -> Result<String, crate::sink::SinkError> {
        #[cfg(feature = "kafka")]
        if let Some(k) = &self.kafka {
            let p = k
                .publish(self.store.as_ref(), &self.base, id)
                .await
                .map_err(|e| crate::sink::SinkError::Kafka(e.to_string()))?;
            return Ok(format!(
                "{} parts, {} records produced{}",
                p.parts,
                p.records,
                if p.already { " (in Kafka already)" } else { "" }
            ));
        }
        let p = crate::sink::publish(self.store.as_ref(), &self.base, id).await?;
        Ok(format!("{} parts, {} copied", p.parts, p.copied))
    }
}

impl Coordinator {
    /// Publishes the staged output of the object-store sink at `url` after every commit.
    pub fn with_sink(self, url: Option<&str>) -> Result<Self, CoordinatorError> {
        Ok(match url {
            Some(url) => {
                let (store, base) = snapshot::open_store(url)?;
                self.with_sink_store(store, base)
            }
            None => self,
        })
    }

    /// [`Coordinator::with_sink`] with the sink's store already open (`base` below it).
    pub fn with_sink_store(mut self, store: Arc<dyn ObjectStore>, base: Path) -> Self {
        self.sink = Some(Sink {
            store,
            base,
            ids_checked: false,
            caught_up: false,
            backlog: Mutex::new((BTreeSet::new(), None)),
            abandoned: Mutex::new(BTreeSet::new()),
            hold_next: false,
            #[cfg(feature = "kafka")]
            kafka: None,
            #[cfg(feature = "kafka")]
            marker_checked: false,
        });
        self
    }

    /// Publishes the output the workers stage for an exactly-once Kafka sink (in the job's
    /// snapshot storage, [`crate::job::kafka::sink::staging_base`]) to Kafka after every commit,
    /// one transaction per snapshot. Before its first trigger the coordinator reads the sink's
    /// marker (which fences earlier publishers of the job) and continues snapshot ids above it.
    #[cfg(feature = "kafka")]
    pub fn with_kafka_sink(self, publisher: crate::job::kafka::sink::KafkaPublisher) -> Self {
        let base = crate::job::kafka::sink::staging_base(&self.job_dir);
        let store = self.store.clone();
        let mut me = self.with_sink_store(store, base);
        if let Some(sink) = me.sink.as_mut() {
            sink.kafka = Some(Arc::new(publisher));
        }
        me
    }

    /// Makes the sink output of snapshot `id`, which must be a committed snapshot of this job,
    /// visible: `id` joins the pending ids, which are published oldest first. Idempotent. On
    /// failure `id` stays pending (retried after the next commit) and the error is returned.
    pub async fn publish(&self, id: u64) -> Result<(), CoordinatorError> {
        if let Some(sink) = &self.sink {
            sink.backlog
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .0
                .insert(id);
            self.publish_pending().await?;
        }
        Ok(())
    }

    /// Publishes the pending ids, oldest first, stopping at the first failure (its error is
    /// returned and kept in [`Coordinator::publish_backlog`]).
    pub async fn publish_pending(&self) -> Result<(), CoordinatorError> {
        let Some(sink) = &self.sink else {
            return Ok(());
        };
        loop {
            let next = sink
                .backlog
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .0
                .first()
                .copied();
            let Some(id) = next else {
                return Ok(());
            };
            let result = sink.publish_one(id).await;
            let mut backlog = sink.backlog.lock().unwrap_or_else(PoisonError::into_inner);
            match result {
                Ok(summary) => {
                    backlog.0.remove(&id);
                    if backlog.0.is_empty() {
                        backlog.1 = None;
                    }
                    tracing::info!(id, %summary, "sink output published");
                }
                Err(e) => {
                    tracing::warn!(
                        id,
                        pending = ?backlog.0,
                        error = %e,
                        "publishing sink output failed; retried after the next commit"
                    );
                    backlog.1 = Some(e.to_string());
                    return Err(e.into());
                }
            }
        }
    }

    /// Why the exactly-once Kafka sink's publisher could not use its brokers at its last
    /// attempt, while that lasts ([`crate::job::kafka::sink::KafkaPublisher::broker_error`]).
    #[cfg(feature = "kafka")]
    pub fn kafka_sink_error(&self) -> Option<String> {
        self.sink
            .as_ref()
            .and_then(|s| s.kafka.as_ref())
            .and_then(|k| k.broker_error())
    }

    /// The next snapshot's sink output is never published: the savepoint a transition takes
    /// before it restores an older snapshot of the job's own history (the records after that
    /// snapshot are processed again, and their results published once, by the next run). Were
    /// it published, the restore would go back past it.
    pub fn hold_output_of_next_snapshot(&mut self) {
        if let Some(sink) = self.sink.as_mut() {
            sink.hold_next = true;
        }
    }

    /// Whether the job's sink publishes committed output (an object-store or exactly-once
    /// Kafka sink).
    pub fn publishes(&self) -> bool {
        self.sink.is_some()
    }

    /// The newest snapshot id whose sink output the sink's readers can see (`None`: none, or no
    /// sink that publishes): the published objects of an object-store sink, the marker of an
    /// exactly-once Kafka sink (read from the brokers). A restore of one of the job's own
    /// snapshots older than it goes back past published output ([`super::super::run::going_back_refusal`]).
    pub async fn published_through(&self) -> Result<Option<u64>, CoordinatorError> {
        let Some(sink) = &self.sink else {
            return Ok(None);
        };
        #[cfg(feature = "kafka")]
        if let Some(k) = &sink.kafka {
            let (marker, _) = k
                .effective_marker(sink.store.as_ref(), &sink.base)
                .await
                .map_err(|e| crate::sink::SinkError::Kafka(e.to_string()))?;
            return Ok(marker.map(|m| m.snapshot));
        }
        Ok(crate::sink::published_through(sink.store.as_ref(), &sink.base).await?)
    }

    /// Committed snapshots whose sink output is not published yet, and the last failure.
    pub fn publish_backlog(&self) -> PublishBacklog {
        match &self.sink {
            Some(sink) => {
                let backlog = sink.backlog.lock().unwrap_or_else(PoisonError::into_inner);
                PublishBacklog {
                    pending: backlog.0.iter().copied().collect(),
                    last_error: backlog.1.clone(),
                }
            }
            None => PublishBacklog::default(),
        }
    }

    /// Publishes the output of every committed snapshot of this job that is not published yet
    /// (for a coordinator that takes over running workers, which may have committed a snapshot
    /// whose output a crashed predecessor never published). Idempotent; returns the backlog, or
    /// the first failure (what failed stays pending). A coordinator does this by itself at its
    /// first commit; call it to do it at once.
    pub async fn publish_committed(&self) -> Result<PublishBacklog, CoordinatorError> {
        self.publish_committed_through(u64::MAX).await?;
        Ok(self.publish_backlog())
    }

    /// Makes every committed snapshot of this job with an id up to `through` pending whose output
    /// is not published, then publishes the pending ids. Snapshots are looked at from the newest
    /// down until one is found published: earlier ones are published too (outputs are published
    /// in id order, every committed snapshot of a job with this sink has staged parts).
    pub(super) async fn publish_committed_through(
        &self,
        through: u64,
    ) -> Result<(), CoordinatorError> {
        let Some(sink) = &self.sink else {
            return Ok(());
        };
        let abandoned = sink
            .abandoned
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let mut unpublished = Vec::new();
        for (id, kind) in snapshot_ids(self.store.as_ref(), &self.job_dir).await? {
            if id > through
                || abandoned.contains(&id)
                || !is_committed(self.store.as_ref(), &self.job_dir, kind, id).await?
            {
                continue;
            }
            match crate::sink::published(sink.store.as_ref(), &sink.base, id).await? {
                Some(true) => break,
                Some(false) => unpublished.push(id),
                // Nothing staged (the sink was added later, or another sink URL then).
                None => {}
            }
        }
        let left: Vec<u64> = unpublished
            .iter()
            .rev()
            .copied()
            .filter(|id| *id != through)
            .collect();
        if !left.is_empty() {
            tracing::info!(ids = ?left, "committed sink output left unpublished: publishing it");
        }
        if !unpublished.is_empty() {
            sink.backlog
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .0
                .extend(unpublished);
        }
        self.publish_pending().await
    }

    /// After a start: publishes the output of the snapshot the run restored from, and of any
    /// earlier committed snapshot of the job, unless already published (the crash may have come
    /// between commit and publish). Only when the restored snapshot is this job's own (its
    /// manifest names this job's namespace and name): a snapshot of another job says nothing
    /// about this job's output, and a staged directory of ours with the same id may belong to a
    /// snapshot of ours that never committed. Failures are logged and left pending.
    pub(super) async fn publish_restored(&self, url: &str) {
        if self.sink.is_none() {
            return;
        }
        let manifest = match snapshot::open_snapshot(url).await {
            Ok((_, _, m)) => m,
            Err(e) => {
                tracing::warn!(url, error = %e, "reading the restored manifest to publish its sink output");
                return;
            }
        };
        if !manifest
            .job
            .is(&self.identity.namespace, &self.identity.name)
        {
            tracing::info!(
                url,
                job = %format!("{}/{}", manifest.job.namespace, manifest.job.name),
                "restored from another job's snapshot: no sink output of it to publish"
            );
            return;
        }
        // The run goes on from this snapshot: the job's committed snapshots after it belong to
        // the history it went back past (a resume that passed over them, a restoreFrom of an
        // older one) and their output is never published (the replay publishes it anew).
        let mut newer = BTreeSet::new();
        match snapshot_ids(self.store.as_ref(), &self.job_dir).await {
            Ok(ids) => {
                for (id, kind) in ids.into_iter().filter(|(id, _)| *id > manifest.snapshot_id) {
                    match is_committed(self.store.as_ref(), &self.job_dir, kind, id).await {
                        Ok(true) => {
                            newer.insert(id);
                        }
                        Ok(false) => {}
                        Err(e) => {
                            tracing::warn!(id, error = %e, "reading whether a snapshot after the restored one committed")
                        }
                    }
                }
            }
            Err(e) => {
                tracing::warn!(url, error = %e, "listing the snapshots after the restored one")
            }
        }
        if !newer.is_empty() {
            tracing::info!(restored = manifest.snapshot_id, abandoned = ?newer, "the run went back past committed snapshots: their sink output is not published");
            if let Some(sink) = &self.sink {
                sink.abandoned
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .extend(newer);
            }
        }
        if let Err(e) = self.publish_committed_through(manifest.snapshot_id).await {
            tracing::warn!(url, error = %e, "publishing the restored snapshot's sink output; retried after the next commit");
        }
    }
}
