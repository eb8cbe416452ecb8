//! The source task: reads this subtask's partitions, routes each record to the subtask owning its
//! key group, emits watermarks, injects barriers when told to, and reports Kafka lag.

use super::*;

/// Measures the lag of this subtask's Kafka partitions every [`LAG_INTERVAL`] (see
/// [`job::kafka::source`], "Lag") into the status and the metrics. Brokers that do not answer
/// leave the last numbers and put their error in the status.
///
/// [`LAG_INTERVAL`]: job::kafka::source::LAG_INTERVAL
#[cfg(feature = "kafka")]
pub(super) fn spawn_kafka_lag(s: Arc<Shared>, k: Arc<job::kafka::source::KafkaSourceReader>) {
    tokio::spawn(async move {
        loop {
            let positions = s.status.lock().await.source_positions.clone();
            if !positions.is_empty() {
                let k2 = k.clone();
                let measured = match tokio::task::spawn_blocking(move || k2.lag(&positions)).await {
                    Ok(m) => m,
                    Err(_) => return,
                };
                let mut st = s.status.lock().await;
                match measured {
                    Ok(lag) => {
                        s.metrics
                            .source_lag_records
                            .set(i64::try_from(lag.records).unwrap_or(i64::MAX));
                        s.metrics.source_lag_seconds.set(lag.seconds.unwrap_or(0.0));
                        let stalled = k.stalled_partitions(&lag);
                        st.source_lag = Some(lag);
                        if !stalled.is_empty() {
                            // A consumer that stopped fetching does not resume by itself: a
                            // new run's consumer does (from the latest checkpoint).
                            let message = format!(
                                "{}: restarting from the latest checkpoint with a new Kafka consumer",
                                stalled.join("; ")
                            );
                            tracing::error!("{message}");
                            s.fail(message);
                            return;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "measuring the Kafka source's lag");
                        let lag = st.source_lag.get_or_insert_with(Default::default);
                        lag.error = Some(e.to_string());
                        lag.bootstrap = k.bootstrap().to_owned();
                    }
                }
            }
            tokio::time::sleep(job::kafka::source::LAG_INTERVAL).await;
        }
    });
}

/// Fails the run when a Kafka topic's partition count changes (checked every
/// metadataRefreshInterval): the job restarts from its latest checkpoint, whose start lists the
/// new partitions and reads them from their earliest offset (see [`job::kafka::source`]).
#[cfg(feature = "kafka")]
pub(super) fn spawn_kafka_partition_watch(
    s: Arc<Shared>,
    k: Arc<job::kafka::source::KafkaSourceReader>,
) {
    tokio::spawn(async move {
        let every = k.refresh_interval();
        loop {
            tokio::time::sleep(every).await;
            let k2 = k.clone();
            let changed = match tokio::task::spawn_blocking(move || k2.changed_topics()).await {
                Ok(Ok(changed)) => changed,
                Ok(Err(e)) => {
                    // Brokers unreachable: the reads wait and retry; so does this check.
                    tracing::warn!(error = %e, "refreshing the Kafka topics' partitions");
                    continue;
                }
                Err(_) => return,
            };
            if let Some((topic, then, now)) = changed.into_iter().next() {
                let message = format!(
                    "Kafka topic {topic:?} has {now} partitions now, {then} when this run started: restarting from the latest checkpoint to read the new partitions from their earliest offset"
                );
                tracing::warn!("{message}");
                s.fail(message);
                return;
            }
        }
    });
}

/// Per-output buffers of the source.
pub(super) struct Outputs {
    outputs: Vec<mpsc::Sender<Msg>>,
    buffers: Vec<Vec<Record>>,
    /// A program's records, per output.
    encoded: Vec<job::EncodedRecords>,
    /// Partial results combined before the shuffle, per output.
    partials: Vec<job::combine::Partials>,
    assignment: Assignment,
}

impl Outputs {
    pub(super) async fn send(
        &mut self,
        i: usize,
        msg: Msg,
        metrics: &WorkerMetrics,
    ) -> Result<(), WorkerError> {
        let tx = &self.outputs[i];
        match tx.try_send(msg) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(msg)) => {
                let t = Instant::now();
                let r = tx.send(msg).await;
                metrics
                    .backpressure_seconds
                    .inc_by(t.elapsed().as_secs_f64());
                r.map_err(|_| WorkerError::Fatal("an output channel closed".into()))
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                Err(WorkerError::Fatal("an output channel closed".into()))
            }
        }
    }

    pub(super) async fn flush(
        &mut self,
        i: usize,
        metrics: &WorkerMetrics,
    ) -> Result<(), WorkerError> {
        if !self.encoded[i].is_empty() {
            let batch = std::mem::replace(
                &mut self.encoded[i],
                job::EncodedRecords::with_capacity(BATCH),
            );
            self.send(i, Msg::Encoded(batch), metrics).await?;
        }
        if !self.partials[i].is_empty() {
            let batch = std::mem::replace(
                &mut self.partials[i],
                job::combine::Partials::with_capacity(BATCH),
            );
            self.send(i, Msg::Partials(batch), metrics).await?;
        }
        if self.buffers[i].is_empty() {
            return Ok(());
        }
        let batch = std::mem::replace(&mut self.buffers[i], Vec::with_capacity(BATCH));
        self.send(i, Msg::Records(batch), metrics).await
    }

    pub(super) async fn flush_all(&mut self, metrics: &WorkerMetrics) -> Result<(), WorkerError> {
        for i in 0..self.outputs.len() {
            self.flush(i, metrics).await?;
        }
        Ok(())
    }

    pub(super) async fn broadcast(
        &mut self,
        msg: Msg,
        metrics: &WorkerMetrics,
    ) -> Result<(), WorkerError> {
        self.flush_all(metrics).await?;
        for i in 0..self.outputs.len() {
            self.send(i, msg.clone(), metrics).await?;
        }
        Ok(())
    }
}

/// How often a source sends its advancing watermark downstream.
pub(super) const WATERMARK_INTERVAL: Duration = Duration::from_millis(200);

pub(super) async fn source_loop(
    s: Arc<Shared>,
    compiled: Arc<CompiledJob>,
    partitions: Vec<u32>,
    restored: BTreeMap<u32, u64>,
    assignment: Assignment,
    outputs: Vec<mpsc::Sender<Msg>>,
    mut cmds: mpsc::Receiver<SourceCmd>,
) -> Result<(), WorkerError> {
    let n = outputs.len();
    let mut router = Outputs {
        outputs,
        buffers: (0..n).map(|_| Vec::with_capacity(BATCH)).collect(),
        encoded: (0..n).map(|_| job::EncodedRecords::default()).collect(),
        partials: (0..n).map(|_| job::combine::Partials::default()).collect(),
        assignment,
    };
    // The built-in aggregation's records are combined per key (and window) in each batch read
    // before they are routed, unless the job turned it off.
    let mut combiner = compiled.combiner();
    // A program's keyed step that combines (a window aggregate): likewise, per key and window.
    let mut program_combiner = compiled.program_combiner();
    let maxp = assignment.max_parallelism();
    let mut pos: BTreeMap<u32, u64> = partitions
        .iter()
        .map(|p| (*p, restored.get(p).copied().unwrap_or(0)))
        .collect();
    let mut wms: BTreeMap<u32, PartitionWatermark> = partitions
        .iter()
        .map(|p| (*p, compiled.partition_watermark()))
        .collect();
    let mut finished: BTreeMap<u32, bool> = partitions.iter().map(|p| (*p, false)).collect();
    // When each partition last gave a record: one quiet for the source's idle timeout (Kafka)
    // stops holding the watermark back until its next record.
    let idle_after = compiled.idle_timeout();
    let mut last_record: BTreeMap<u32, Instant> =
        partitions.iter().map(|p| (*p, Instant::now())).collect();
    let mut commits = OffsetCommits::new(&compiled);
    let rate = match &compiled.source {
        job::SourceKind::Generator(g) => g.records_per_second(),
        job::SourceKind::File(_) => None,
        #[cfg(feature = "kafka")]
        job::SourceKind::Kafka(_) => None,
    };
    let paced_from: BTreeMap<u32, u64> = pos.clone();
    let t0 = Instant::now();
    let mut stopped = false;
    let mut last_wm = i64::MIN;
    let mut last_wm_sent = Instant::now() - WATERMARK_INTERVAL;
    let mut batch: Vec<Record> = Vec::with_capacity(BATCH);
    // A program's records (`compiled` runs one).
    let program = compiled.program().is_some();
    let mut encoded = job::EncodedRecords::default();
    if partitions.is_empty() {
        // Nothing to read: never hold back the watermark downstream.
        router
            .broadcast(Msg::Watermark(i64::MAX), &s.metrics)
            .await?;
        last_wm = i64::MAX;
    }
    loop {
        // Control first: barriers go out between batches, never inside one.
        loop {
            let cmd = if stopped {
                match cmds.recv().await {
                    Some(c) => c,
                    None => return Ok(()),
                }
            } else {
                match cmds.try_recv() {
                    Ok(c) => c,
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => return Ok(()),
                }
            };
            handle_source_cmd(&s, &mut router, &pos, cmd, &mut stopped, &mut commits).await?;
        }
        if stopped {
            continue;
        }

        let mut read_any = false;
        let elapsed_ms = t0.elapsed().as_millis() as u64;
        for p in &partitions {
            if finished[p] {
                continue;
            }
            let at = pos[p];
            let mut max = BATCH;
            if let Some(r) = rate {
                let due = paced_from[p] + elapsed_ms.saturating_mul(r) / 1000;
                max = max.min(due.saturating_sub(at) as usize);
                if max == 0 {
                    continue;
                }
            }
            batch.clear();
            encoded.clear();
            let b = match program {
                true => {
                    // Combined, or (a batch after one that saved little) ingested as it is.
                    let attempt = program_combiner.as_mut().is_some_and(|c| c.attempt());
                    let combining = program_combiner.as_mut().filter(|_| attempt);
                    let b = compiled.read_program(*p, at, &mut encoded, max, combining)?;
                    // What the partials stand for beyond themselves was merged away.
                    s.metrics
                        .records_combined
                        .inc_by(encoded.inputs() - encoded.len() as u64);
                    b
                }
                false => compiled.read(*p, at, &mut batch, max)?,
            };
            if b.finished {
                finished.insert(*p, true);
            }
            if b.records == 0 {
                continue;
            }
            read_any = true;
            last_record.insert(*p, Instant::now());
            pos.insert(*p, b.next_position);
            s.metrics.records_in.inc_by(b.records as u64);
            let mut wm = wms.get_mut(p);
            // Combined, or (a batch after one that saved little) sent as it is below.
            let combine = combiner.as_mut().is_some_and(|c| c.attempt());
            if combine && let Some(c) = combiner.as_mut() {
                if let Some(w) = wm.as_mut() {
                    batch.iter().for_each(|r| w.observe(r.ts));
                }
                let read = batch.len();
                let partials = c.combine(&mut batch);
                s.metrics
                    .records_combined
                    .inc_by((read - partials.len()) as u64);
                for (r, weight) in partials.drain() {
                    let owner = router.assignment.owner(r.key.key_group(maxp)) as usize;
                    router.partials[owner].push(r, weight);
                    if router.partials[owner].len() >= BATCH {
                        router.flush(owner, &s.metrics).await?;
                    }
                }
            }
            for r in batch.drain(..) {
                if let Some(w) = wm.as_mut() {
                    w.observe(r.ts);
                }
                let owner = router.assignment.owner(r.key.key_group(maxp)) as usize;
                router.buffers[owner].push(r);
                if router.buffers[owner].len() >= BATCH {
                    router.flush(owner, &s.metrics).await?;
                }
            }
            for ((key, ts, record), weight) in encoded.iter().zip(encoded.weights()) {
                if let Some(w) = wm.as_mut() {
                    w.observe(ts);
                }
                let owner = router.assignment.owner(key.key_group(maxp)) as usize;
                router.encoded[owner].push_weighted(key.clone(), ts, record, weight);
                if router.encoded[owner].len() >= BATCH {
                    router.flush(owner, &s.metrics).await?;
                }
            }
        }
        router.flush_all(&s.metrics).await?;

        // Source watermark: the slowest of our partitions (finished ones do not hold back, nor
        // idle ones while another is active; all idle: the most advanced).
        let now = Instant::now();
        let wm = job::watermark::source_watermark(partitions.iter().map(|p| {
            job::watermark::PartitionProgress {
                watermark: wms[p].watermark(),
                finished: finished[p],
                idle: idle_after.is_some_and(|d| now.duration_since(last_record[p]) >= d),
            }
        }));
        // Watermarks go to every downstream subtask, so they are sent periodically (as
        // Flink's autoWatermarkInterval does), not after every batch: at parallelism n each
        // source would otherwise send n messages per batch.
        if wm > last_wm && (wm == i64::MAX || last_wm_sent.elapsed() >= WATERMARK_INTERVAL) {
            last_wm = wm;
            last_wm_sent = Instant::now();
            router.broadcast(Msg::Watermark(wm), &s.metrics).await?;
        }
        {
            let mut st = s.status.lock().await;
            st.source_positions = pos.clone();
        }
        if partitions.is_empty() {
            // No partition to read (more subtasks than partitions): only commands matter.
            match cmds.recv().await {
                Some(cmd) => {
                    handle_source_cmd(&s, &mut router, &pos, cmd, &mut stopped, &mut commits)
                        .await?
                }
                None => return Ok(()),
            }
        } else if !read_any {
            // Idle (paced, or at the end of input): wait a little or for a command.
            tokio::select! {
                c = cmds.recv() => match c {
                    Some(cmd) => {
                    handle_source_cmd(&s, &mut router, &pos, cmd, &mut stopped, &mut commits).await?
                }
                    None => return Ok(()),
                },
                _ = tokio::time::sleep(Duration::from_millis(if rate.is_some() { 5 } else { 50 })) => {}
            }
        } else {
            tokio::task::yield_now().await;
        }
    }
}

/// A Kafka source's offsets at each barrier, committed to its consumer group once the barrier's
/// snapshot has committed (the worker learns that from a later barrier's `last_committed`), for
/// lag tools only. Nothing for other sources.
pub(super) struct OffsetCommits {
    #[cfg(feature = "kafka")]
    source: Option<Arc<job::kafka::source::KafkaSourceReader>>,
    #[cfg(feature = "kafka")]
    cuts: BTreeMap<u64, BTreeMap<u32, u64>>,
}

impl OffsetCommits {
    pub(super) fn new(compiled: &CompiledJob) -> OffsetCommits {
        #[cfg(not(feature = "kafka"))]
        let _ = compiled;
        OffsetCommits {
            #[cfg(feature = "kafka")]
            source: match &compiled.source {
                job::SourceKind::Kafka(k) => Some(k.clone()),
                _ => None,
            },
            #[cfg(feature = "kafka")]
            cuts: BTreeMap::new(),
        }
    }

    pub(super) fn on_barrier(
        &mut self,
        id: u64,
        last_committed: Option<u64>,
        pos: &BTreeMap<u32, u64>,
    ) {
        #[cfg(not(feature = "kafka"))]
        let _ = (id, last_committed, pos);
        #[cfg(feature = "kafka")]
        if let Some(k) = &self.source {
            self.cuts.insert(id, pos.clone());
            if let Some(done) = last_committed {
                if let Some(p) = self.cuts.get(&done) {
                    k.commit(p);
                }
                // Older cuts never commit after a newer one did; bound the map either way.
                self.cuts.retain(|c, _| *c > done);
            }
            while self.cuts.len() > 64 {
                self.cuts.pop_first();
            }
        }
    }
}

/// Applies a control command at a batch boundary: a barrier records the partitions' positions
/// and goes to every output (then, for stop-with-savepoint, the sources stop); resume restarts
/// stopped sources.
pub(super) async fn handle_source_cmd(
    s: &Shared,
    router: &mut Outputs,
    pos: &BTreeMap<u32, u64>,
    cmd: SourceCmd,
    stopped: &mut bool,
    commits: &mut OffsetCommits,
) -> Result<(), WorkerError> {
    match cmd {
        SourceCmd::Barrier(req) => {
            let cut = BarrierCut {
                kind: req.kind,
                positions: pos.clone(),
                at: Instant::now(),
                last_committed: req.last_committed,
                stop: req.stop,
            };
            if !s.ledger.lock().await.record_cut(req.id, cut) {
                // Aborted before its barrier went out: nothing to inject (nor to stop at).
                tracing::debug!(id = req.id, "barrier of an aborted snapshot not injected");
                return Ok(());
            }
            router.broadcast(Msg::Barrier(req.id), &s.metrics).await?;
            tracing::debug!(id = req.id, "barrier injected");
            commits.on_barrier(req.id, req.last_committed, pos);
            if req.stop {
                *stopped = true;
                s.stopped.store(true, Ordering::Release);
                tracing::info!(id = req.id, "sources stopped at the savepoint barrier");
            }
        }
        SourceCmd::Resume => {
            if *stopped {
                tracing::info!("sources resumed");
            }
            *stopped = false;
        }
    }
    Ok(())
}
