//! Starting a subtask: checking a start or pre-stage request, loading its key groups (restored or
//! pre-staged, [`crate::runtime::prestage`]), connecting the shuffle, and spawning the source and
//! keyed operator tasks.

use super::*;

pub(super) async fn start(State(s): State<Arc<Shared>>, Json(req): Json<StartRequest>) -> Response {
    if s.started.swap(true, Ordering::AcqRel) {
        return err(StatusCode::CONFLICT, "the worker was already started");
    }
    let pre = s.prestaged.lock().await.take();
    if pre.is_none() && s.prestaging.load(Ordering::Acquire) {
        s.started.store(false, Ordering::Release);
        return err(
            StatusCode::CONFLICT,
            "the worker is still pre-staging: start it once it reports prestaged",
        );
    }
    s.prestaging.store(false, Ordering::Release);
    // Checked before answering: a bad request fails at once.
    let mut prepared = match prepare_subtask(req, &s.programs).await {
        Ok(p) => p,
        Err(e) => {
            tracing::error!(error = %e, for_good = e.refuses_for_good(), "start refused");
            s.status.lock().await.last_start_error = Some(e.to_string());
            s.started.store(false, Ordering::Release);
            return err(refusal_status(&e), e);
        }
    };
    if let Some(pre) = pre {
        match prestage_fits(&pre, &prepared) {
            Ok(plan) => {
                tracing::info!(
                    loaded = pre.manifest.snapshot_id,
                    groups = plan.groups.len(),
                    replaced = plan.replaced,
                    bytes = plan.bytes,
                    "starting from the pre-staged state: reading only the delta"
                );
                prepared.totals = (plan.bytes, plan.groups.len() as u32);
                prepared.keyed = pre.keyed;
                if let Some(c) = pre.compiled {
                    prepared.compiled = c;
                }
                prepared.delta = Some(plan);
            }
            Err(why) => tracing::warn!(
                reason = %why,
                "the pre-staged state does not fit the start: dropped, restoring in full"
            ),
        }
    }
    let accepted = StartAccepted {
        bytes_total: prepared.totals.0,
        groups_total: prepared.totals.1,
        source_partitions: match prepared.compiled.current_partitions() {
            job::CurrentPartitions::Named(names) => Some(PartitionList::of(names)),
            job::CurrentPartitions::Indexed(_) => None,
        },
    };
    let progress = Arc::new(restore::Progress::default());
    *s.restore_progress.lock().await = progress.clone();
    {
        let mut st = s.status.lock().await;
        st.state = WorkerState::Restoring;
        st.last_start_error = None;
        st.last_start_unrestorable = false;
        st.last_start_refused = false;
        st.started = None;
        st.restore = Some(RestoreProgress {
            bytes_total: accepted.bytes_total,
            groups_total: accepted.groups_total,
            ..RestoreProgress::default()
        });
    }
    // The restore outlasts any request timeout: it runs on, `/v1/status` reports it.
    let s2 = s.clone();
    tokio::spawn(async move {
        match start_subtask(s2.clone(), prepared, &progress).await {
            Ok(resp) => {
                let mut st = s2.status.lock().await;
                if let Some(r) = st.restore.as_mut() {
                    r.bytes_read = progress.bytes_read();
                    r.groups_read = progress.groups_read();
                }
                st.started = Some(resp);
            }
            Err(e) => {
                tracing::error!(
                    error = %e,
                    unrestorable = e.snapshot_unrestorable(),
                    refused = e.refuses_for_good(),
                    "start failed"
                );
                {
                    let mut st = s2.status.lock().await;
                    st.state = WorkerState::Idle;
                    st.last_start_error = Some(e.to_string());
                    st.last_start_unrestorable = e.snapshot_unrestorable();
                    st.last_start_refused = e.refuses_for_good();
                }
                s2.started.store(false, Ordering::Release);
            }
        }
    });
    (StatusCode::ACCEPTED, Json(accepted)).into_response()
}

/// Whether the request's `restore_from` names the job's own checkpoint that `manifest` is
/// (not a savepoint, nor another job's snapshot).
pub(super) fn own_checkpoint(req: &StartRequest, manifest: &snapshot::Manifest) -> bool {
    let own = crate::snapshot::snapshot_url(
        &req.storage,
        &req.namespace,
        &req.name,
        manifest.kind,
        manifest.snapshot_id,
    );
    manifest.kind == snapshot::SnapshotKind::Checkpoint
        && req
            .restore_from
            .as_deref()
            .is_some_and(|u| u.trim().trim_end_matches('/') == own)
}

/// Whether a start (`prepared`) may build on what a pre-stage loaded (`pre`): the same job,
/// subtask, parallelism and key groups, and a snapshot that is a later checkpoint of the job;
/// then what to read of it. Why not, otherwise.
pub(super) fn prestage_fits(
    pre: &Prestaged,
    prepared: &Prepared,
) -> Result<prestage::DeltaPlan, String> {
    let (a, b) = (&pre.req, &prepared.req);
    let same = a.namespace == b.namespace
        && a.name == b.name
        && a.storage == b.storage
        && a.subtask == b.subtask
        && a.parallelism == b.parallelism
        && a.max_parallelism == b.max_parallelism
        && a.state_payload_bytes == b.state_payload_bytes
        && a.job == b.job;
    if !same {
        return Err("the start names another job, subtask or parallelism".into());
    }
    let Some((_, _, target)) = &prepared.snapshot else {
        return Err("the start restores nothing".into());
    };
    if !own_checkpoint(b, target)
        || target.snapshot_id <= pre.manifest.snapshot_id
        || target.state_schema != prepared.keyed.schema()
    {
        return Err(format!(
            "the start restores snapshot {} ({:?}), not a later checkpoint of the job than the pre-staged {}",
            target.snapshot_id, target.kind, pre.manifest.snapshot_id
        ));
    }
    Ok(prestage::plan(
        &pre.manifest,
        target,
        prepared.assignment.range(b.subtask),
    ))
}

/// The tasks sending to a subtask's peers, one per peer.
type Senders = Vec<tokio::task::JoinHandle<Result<(), shuffle::ShuffleError>>>;
/// A failure to connect to a peer, with the receiver of what was to be sent to it.
type Unreached = (WorkerError, Option<mpsc::Receiver<Msg>>);

/// How the task making a subtask's own data connections ended: their senders, or the failure
/// (the receiver of a peer it could not reach goes to `unreached`, to be dropped only once the
/// failure is reported: dropped before, it would fail the source first, with less to say).
fn connections_made(
    done: Result<Result<Senders, Unreached>, tokio::task::JoinError>,
    unreached: &mut Vec<mpsc::Receiver<Msg>>,
) -> Result<Senders, WorkerError> {
    match done {
        Ok(Ok(senders)) => Ok(senders),
        Ok(Err((e, rx))) => {
            unreached.extend(rx);
            Err(e)
        }
        Err(e) => Err(WorkerError::Fatal(e.to_string())),
    }
}

/// How a refused start or pre-stage is answered: 422 when no retry of the same request can
/// succeed ([`WorkerError::refuses_for_good`]), 503 when a later one may.
pub(super) fn refusal_status(e: &WorkerError) -> StatusCode {
    if e.refuses_for_good() {
        StatusCode::UNPROCESSABLE_ENTITY
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

/// `POST /v1/prestage`: loads this subtask's key groups from the job's checkpoint the request
/// names, and holds them for the start that follows (see [`prestage`]). Reads no source,
/// connects to no peer, emits nothing. 202 once the request is checked; `/v1/status` says
/// `restoring`, then `prestaged` (or `idle` with the error). A worker already pre-staged and
/// sent a later checkpoint of the job catches up: it reads only the blocks it lacks, as a start
/// does, so that the delta the old run's stop writes stays small.
pub(super) async fn prestage_handler(
    State(s): State<Arc<Shared>>,
    Json(req): Json<StartRequest>,
) -> Response {
    if s.started.load(Ordering::Acquire) {
        return err(StatusCode::CONFLICT, "the worker was already started");
    }
    let pre = s.prestaged.lock().await.take();
    if s.prestaging.swap(true, Ordering::AcqRel) && pre.is_none() {
        return err(StatusCode::CONFLICT, "the worker is still pre-staging");
    }
    let shared = &s;
    let refuse = |status: StatusCode, e: String| async move {
        tracing::error!(error = %e, "pre-stage refused");
        shared.status.lock().await.last_start_error = Some(e.clone());
        shared.prestaging.store(false, Ordering::Release);
        err(status, e)
    };
    let prepared = match prepare_subtask(req, &s.programs).await {
        Ok(p) => p,
        Err(e) => return refuse(refusal_status(&e), e.to_string()).await,
    };
    let own = prepared.snapshot.as_ref().is_some_and(|(_, _, m)| {
        own_checkpoint(&prepared.req, m) && m.state_schema == prepared.keyed.schema()
    });
    if !own {
        return refuse(
            StatusCode::UNPROCESSABLE_ENTITY,
            "a pre-stage loads one of the job's own checkpoints: restoreFrom must name one".into(),
        )
        .await;
    }
    // Catching up: only what the pre-staged state lacks.
    let catch_up = pre.and_then(|p| match prestage_fits(&p, &prepared) {
        Ok(plan) => Some((p, plan)),
        Err(why) => {
            tracing::warn!(reason = %why, "the pre-staged state does not fit: loading in full");
            None
        }
    });
    let totals = catch_up.as_ref().map_or(prepared.totals, |(_, plan)| {
        (plan.bytes, plan.groups.len() as u32)
    });
    let accepted = StartAccepted {
        bytes_total: totals.0,
        groups_total: totals.1,
        source_partitions: None,
    };
    let progress = Arc::new(restore::Progress::default());
    *s.restore_progress.lock().await = progress.clone();
    {
        let mut st = s.status.lock().await;
        st.state = WorkerState::Restoring;
        st.last_start_error = None;
        st.last_start_unrestorable = false;
        st.last_start_refused = false;
        st.prestaged = None;
        st.restore = Some(RestoreProgress {
            bytes_total: accepted.bytes_total,
            groups_total: accepted.groups_total,
            ..RestoreProgress::default()
        });
    }
    let s2 = s.clone();
    tokio::spawn(async move {
        let Prepared {
            req,
            mut keyed,
            snapshot: snap,
            compiled,
            ..
        } = prepared;
        let started = Instant::now();
        if let Some((pre, plan)) = catch_up {
            let mut keyed = pre.keyed;
            let result = match snap {
                Some((rstore, dir, manifest)) => {
                    async {
                        let store = rstore.as_ref();
                        let a = prestage::apply(&mut keyed, store, &dir, &plan, Some(&progress))
                            .await?;
                        let at = (req.subtask, req.parallelism);
                        restore::restore_operator_state(&mut keyed, store, &dir, &manifest, at)
                            .await?;
                        Ok((a, manifest))
                    }
                    .await
                }
                None => Err(restore::RestoreError::Decoder("no snapshot".into())),
            };
            let restored = result.map(|(a, manifest)| {
                (
                    restore::Restored {
                        groups: a.groups,
                        keys: keyed.key_count() as u64,
                        bytes_read: a.bytes_read,
                    },
                    manifest,
                )
            });
            prestaged(&s2, req, keyed, pre.compiled, restored, started, &progress).await;
            return;
        }
        // A generator's key table is built on its first record: built here instead.
        let compiled = match compiled.source {
            job::SourceKind::Generator(_) => tokio::task::spawn_blocking(move || {
                if let job::SourceKind::Generator(g) = &compiled.source {
                    let _ = g.key_for_index(0);
                }
                compiled
            })
            .await
            .ok(),
            _ => None,
        };
        let result = match snap {
            // The operator state too: a rescale it cannot follow is refused here, before the
            // old run stops (the start takes it again from the stop checkpoint).
            Some((rstore, dir, manifest)) => {
                async {
                    let store = rstore.as_ref();
                    let options = RestoreOptions::default();
                    let r = restore::restore_keyed(
                        &mut keyed,
                        store,
                        &dir,
                        &manifest,
                        options,
                        Some(&progress),
                    )
                    .await?;
                    let at = (req.subtask, req.parallelism);
                    restore::restore_operator_state(&mut keyed, store, &dir, &manifest, at).await?;
                    Ok((r, manifest))
                }
                .await
            }
            None => Err(restore::RestoreError::Decoder("no snapshot".into())),
        };
        prestaged(&s2, req, keyed, compiled, result, started, &progress).await;
    });
    (StatusCode::ACCEPTED, Json(accepted)).into_response()
}

/// A pre-stage's (or catch-up's) load ended: the state is held for the start, or the worker is
/// idle again with the error.
pub(super) async fn prestaged(
    s: &Shared,
    req: StartRequest,
    keyed: Keyed,
    compiled: Option<CompiledJob>,
    result: Result<(restore::Restored, snapshot::Manifest), restore::RestoreError>,
    started: Instant,
    progress: &restore::Progress,
) {
    match result {
        Ok((r, manifest)) => {
            let resp = StartResponse {
                groups_restored: r.groups,
                keys_restored: r.keys,
                bytes_read: r.bytes_read,
                restore_ms: started.elapsed().as_millis() as u64,
                records_expired: Vec::new(),
            };
            tracing::info!(
                subtask = req.subtask,
                parallelism = req.parallelism,
                checkpoint = manifest.snapshot_id,
                keys = r.keys,
                bytes = r.bytes_read,
                ms = resp.restore_ms,
                "pre-staged"
            );
            *s.prestaged.lock().await = Some(Prestaged {
                req,
                keyed,
                manifest,
                compiled,
            });
            let mut st = s.status.lock().await;
            if let Some(p) = st.restore.as_mut() {
                p.bytes_read = progress.bytes_read();
                p.groups_read = progress.groups_read();
            }
            st.state = WorkerState::Prestaged;
            st.prestaged = Some(resp);
        }
        Err(e) => {
            tracing::error!(error = %e, "pre-stage failed");
            let mut st = s.status.lock().await;
            st.state = WorkerState::Idle;
            st.last_start_error = Some(format!("pre-stage: {e}"));
            // The state does not fit the job at this parallelism: the rescale is refused before
            // the old run stops.
            st.last_start_refused = e.refuses_the_job();
            s.prestaging.store(false, Ordering::Release);
        }
    }
}

/// Checks a start request: its bounds, its layout, its dataflow (by the CRD's rules,
/// [`keyshift_core::rules::validate_job`], then by what it takes to run it), and the manifest of
/// the snapshot it restores (key-group count, state schema). Reads nothing but that manifest
/// (and a file source's directory listing).
pub(super) async fn prepare_subtask(
    req: StartRequest,
    programs: &Programs,
) -> Result<Prepared, WorkerError> {
    let connect_by = tokio::time::Instant::now() + req.start_window();
    req.check_bounds()
        .map_err(|e| WorkerError::BadStart(e.to_string()))?;
    // The dataflow by the CRD's rules, as a manifest's (a start request may come from any
    // caller holding the token, not only from a spec the API server checked).
    keyshift_core::rules::validate_job(&req.job)
        .map_err(|e| WorkerError::BadStart(e.0.join("; ")))?;
    let assignment = Assignment::new(i64::from(req.parallelism), i64::from(req.max_parallelism))
        .map_err(|e| WorkerError::BadStart(e.to_string()))?;
    if req.subtask >= req.parallelism || req.peers.len() != req.parallelism as usize {
        return Err(WorkerError::BadStart(format!(
            "subtask {} of {} with {} peer addresses",
            req.subtask,
            req.parallelism,
            req.peers.len()
        )));
    }
    let options = JobOptions {
        state_payload_bytes: req.state_payload_bytes,
    };
    // A Kafka source asks its brokers for the topics' partitions here: off the runtime threads.
    let compiled = {
        let (spec, maxp) = (req.job.clone(), req.max_parallelism);
        let (ns, name) = (req.namespace.clone(), req.name.clone());
        let programs = programs.clone();
        tokio::task::spawn_blocking(move || {
            job::compile_for(&spec, maxp, &options, &ns, &name, &programs)
        })
        .await
        .map_err(|e| WorkerError::Fatal(format!("compiling the job: {e}")))??
    };
    let range = assignment.range(req.subtask);
    let keyed = compiled.new_keyed(req.max_parallelism, range)?;
    let schema = keyed.schema();
    let (store, base) = snapshot::open_store(&req.storage)?;
    let job_dir = snapshot::job_dir(&base, &req.namespace, &req.name);
    let mut snap = None;
    let mut totals = (0, 0);
    let mut positions = BTreeMap::new();
    if let Some(url) = &req.restore_from {
        let (rstore, dir, manifest) = snapshot::open_snapshot(url).await?;
        if manifest.max_parallelism != req.max_parallelism {
            return Err(WorkerError::BadStart(format!(
                "snapshot {url} has {} key groups but the job runs with {}: restore it with maxParallelism {}, or rewrite it with `keyshift savepoint rewrite {url} --max-parallelism {} --to <url>`",
                manifest.max_parallelism,
                req.max_parallelism,
                manifest.max_parallelism,
                req.max_parallelism
            )));
        }
        if manifest.state_schema != schema && !req.allow_non_restored_state {
            return Err(WorkerError::BadStart(format!(
                "snapshot {url} holds state of schema {:?}, this job keeps {:?}: set allowNonRestoredState to start without it",
                manifest.state_schema, schema
            )));
        }
        if manifest.state_schema == schema {
            totals = restore::restore_totals(&manifest, range);
        }
        positions = restored_positions(&req, &compiled, &manifest)?;
        snap = Some((rstore, dir, manifest));
    }
    Ok(Prepared {
        req,
        assignment,
        compiled,
        keyed,
        store,
        job_dir,
        snapshot: snap,
        positions,
        totals,
        delta: None,
        connect_by,
    })
}

/// The snapshot's source positions laid onto the source's partitions as they are now: by file
/// name for a snapshot of a file source that recorded names, by index otherwise (see
/// [`job::positions`]). New and gone partitions are logged (new ones by the subtask that reads
/// them, gone ones by subtask 0), and each of this subtask's partitions is checked against its
/// position: a file shorter than its position refuses the start, naming the file.
pub(super) fn restored_positions(
    req: &StartRequest,
    compiled: &CompiledJob,
    manifest: &snapshot::Manifest,
) -> Result<BTreeMap<u32, u64>, WorkerError> {
    let current = compiled.current_partitions();
    let named = matches!(current, job::CurrentPartitions::Named(_));
    let remap = job::remap_positions(
        &manifest.source_positions,
        &manifest.source_partitions,
        current,
    )
    .map_err(|e| WorkerError::BadStart(format!("the snapshot's source partitions: {e}")))?;
    let mine = |p: u32| p % req.parallelism == req.subtask;
    for n in remap.new.iter().filter(|n| mine(n.index)) {
        tracing::info!(
            partition = n.index,
            file = n.name.as_deref().unwrap_or("-"),
            "a source partition the snapshot does not know (new since): reading it from the start"
        );
    }
    if req.subtask == 0 {
        for g in &remap.gone {
            tracing::warn!(
                snapshot_partition = g.index,
                file = g.name.as_deref().unwrap_or("-"),
                position = g.position,
                "a source partition of the snapshot is gone: it had been read up to its position, nothing of it to restore"
            );
        }
        if let Some((then, now)) = remap.count_changed {
            if named {
                tracing::warn!(
                    then,
                    now,
                    "the snapshot records no partition file names (written by an older keyshift): positions are restored by index, but the directory held {then} files then and {now} now, so offsets may apply to other files than they were taken on"
                );
            } else {
                tracing::warn!(
                    then,
                    now,
                    "the source had {then} partitions at the snapshot and has {now} now: positions restored by index"
                );
            }
        }
    }
    tracing::debug!(matched_by = ?remap.matched_by, positions = remap.positions.len(), "source positions restored");
    for (&p, &position) in remap.positions.iter().filter(|(p, _)| mine(**p)) {
        compiled.check_position(p, position)?;
    }
    Ok(remap.positions)
}

pub(super) async fn start_subtask(
    s: Arc<Shared>,
    prepared: Prepared,
    progress: &restore::Progress,
) -> Result<StartResponse, WorkerError> {
    let Prepared {
        req,
        assignment,
        compiled,
        mut keyed,
        store,
        job_dir,
        snapshot: snap,
        positions,
        totals: _,
        delta,
        connect_by,
    } = prepared;
    let range = assignment.range(req.subtask);
    #[cfg(feature = "kafka")]
    let from_snapshot = snap.is_some();

    // Restore: exactly this subtask's key groups, checksummed before anything is applied.
    let started = Instant::now();
    let mut resp = StartResponse::default();
    let mut watermark = i64::MIN;
    let mut chain = incremental::Chain::new(req.incremental);
    if let Some((rstore, dir, manifest)) = snap {
        if let Some(plan) = &delta {
            let applied =
                prestage::apply(&mut keyed, rstore.as_ref(), &dir, plan, Some(progress)).await?;
            resp.keys_restored = keyed.key_count() as u64;
            resp.groups_restored = applied.groups;
            resp.bytes_read = applied.bytes_read;
        } else if manifest.state_schema == keyed.schema() {
            // Decoded while the next blocks are read; installed once every block is checked.
            let restored = restore::restore_keyed(
                &mut keyed,
                rstore.as_ref(),
                &dir,
                &manifest,
                RestoreOptions::default(),
                Some(progress),
            )
            .await?;
            resp.keys_restored = restored.keys;
            resp.groups_restored = restored.groups;
            resp.bytes_read = restored.bytes_read;
        }
        // A program's operator state: this subtask's share of every subtask's section (a
        // pre-staged worker takes it from the stop checkpoint, as its last deltas).
        if delta.is_some() || manifest.state_schema == keyed.schema() {
            restore::restore_operator_state(
                &mut keyed,
                rstore.as_ref(),
                &dir,
                &manifest,
                (req.subtask, req.parallelism),
            )
            .await?;
        }
        // One of the job's own checkpoints: the next checkpoint may build on it.
        let own = crate::snapshot::snapshot_url(
            &req.storage,
            &req.namespace,
            &req.name,
            snapshot::SnapshotKind::Checkpoint,
            manifest.snapshot_id,
        );
        if manifest.kind == snapshot::SnapshotKind::Checkpoint
            && manifest.state_schema == keyed.schema()
            && req
                .restore_from
                .as_deref()
                .is_some_and(|u| u.trim().trim_end_matches('/') == own)
        {
            chain.restored_from(incremental::Base::restored(&manifest, range));
        }
        crate::failpoints::slow_restore(&req.namespace, &req.name).await;
        if let Some(wm) = manifest.watermark {
            watermark = wm;
            keyed.restore_watermark(wm);
        }
    }
    s.metrics.restore_bytes.set(resp.bytes_read as i64);
    s.metrics
        .restore_seconds
        .set(started.elapsed().as_secs_f64());
    resp.restore_ms = started.elapsed().as_millis() as u64;
    s.metrics.keys.set(keyed.key_count() as i64);
    tracing::info!(
        subtask = req.subtask,
        parallelism = req.parallelism,
        key_groups = %range,
        keys = resp.keys_restored,
        bytes = resp.bytes_read,
        ms = resp.restore_ms,
        "restored"
    );

    {
        let mut st = s.status.lock().await;
        st.state = WorkerState::Running;
        st.subtask = req.subtask;
        st.parallelism = req.parallelism;
        st.key_groups = Some([range.start, range.end]);
    }
    let listener = s
        .data_listener
        .lock()
        .await
        .take()
        .ok_or_else(|| WorkerError::BadStart("the data listener is gone".into()))?;

    let n = req.parallelism as usize;
    let me = req.subtask as usize;
    let (cmd_tx, cmd_rx) = mpsc::channel(16);
    *s.run.lock().await = Some(RunHandle { source_cmd: cmd_tx });

    // Operator inputs: one channel per upstream subtask.
    let mut input_tx = Vec::with_capacity(n);
    let mut input_rx = Vec::with_capacity(n);
    for _ in 0..n {
        let (tx, rx) = mpsc::channel::<Msg>(CHANNEL_BATCHES);
        input_tx.push(tx);
        input_rx.push(rx);
    }
    // Source outputs: the local input for ourselves, a sender per peer.
    let mut outputs: Vec<mpsc::Sender<Msg>> = Vec::with_capacity(n);
    let deadline = connect_by;
    let mut connects = Vec::new();
    for (j, addr) in req.peers.iter().enumerate() {
        if j == me {
            outputs.push(input_tx[me].clone());
        } else {
            let (tx, rx) = mpsc::channel::<Msg>(CHANNEL_BATCHES);
            outputs.push(tx);
            let addr = addr.clone();
            let run_id = req.run_id.clone();
            let secret = req.data_secret.clone();
            let from = req.subtask;
            // The receiver comes back with a failure too: dropped, it would fail the source's
            // send first, with less to say than the failure itself.
            connects.push(tokio::spawn(async move {
                let stream = shuffle::connect(&addr, from, &run_id, &secret, deadline).await;
                (stream, rx)
            }));
        }
    }
    // Accept one connection from every peer.
    let peers_expected = n - 1;
    let accept_inputs: Vec<mpsc::Sender<Msg>> = input_tx.clone();
    let run_id = req.run_id.clone();
    let secret = req.data_secret.clone();
    let s2 = s.clone();
    let window = req.start_window();
    tokio::spawn(async move {
        // Receivers of peers that could not be reached, held until the failure is reported.
        let mut unreached: Vec<mpsc::Receiver<Msg>> = Vec::new();
        let result: Result<(), WorkerError> = async {
            // Accept while our own connections are being made: a peer that only accepts once
            // its connects are done would wait on one that waits on it.
            let mut connecting = tokio::spawn(async move {
                let mut senders = Vec::new();
                for c in connects {
                    match c.await {
                        Ok((Ok(stream), rx)) => {
                            senders.push(tokio::spawn(shuffle::send_loop(stream, rx)));
                        }
                        Ok((Err(e), rx)) => return Err((WorkerError::from(e), Some(rx))),
                        Err(e) => return Err((WorkerError::Fatal(e.to_string()), None)),
                    }
                }
                Ok::<_, Unreached>(senders)
            });
            let mut connected = None;
            // Handshakes run side by side, each bounded: a stray, silent or forged connection
            // is refused and logged, and neither stalls the others nor takes a peer's place.
            let (hs_tx, mut hs_rx) = mpsc::channel(64);
            let mut peers: BTreeMap<u32, tokio::net::TcpStream> = BTreeMap::new();
            while peers.len() < peers_expected {
                tokio::select! {
                    accepted = listener.accept() => {
                        let (mut stream, addr) = accepted
                            .map_err(|e| WorkerError::Fatal(format!("accepting a peer: {e}")))?;
                        stream.set_nodelay(true).ok();
                        let (hs_tx, run_id, secret) = (hs_tx.clone(), run_id.clone(), secret.clone());
                        tokio::spawn(async move {
                            let hello = tokio::time::timeout(
                                HANDSHAKE_TIMEOUT,
                                shuffle::accept_hello(&mut stream, &run_id, &secret),
                            )
                            .await;
                            let _ = hs_tx.send((addr, hello, stream)).await;
                        });
                    }
                    Some((addr, hello, stream)) = hs_rx.recv() => match hello {
                        Ok(Ok(from))
                            if from as usize != me
                                && (from as usize) < n
                                && !peers.contains_key(&from) =>
                        {
                            peers.insert(from, stream);
                        }
                        Ok(Ok(from)) => tracing::warn!(
                            %addr, from, "refused a data connection: not an expected peer (or one already connected)"
                        ),
                        Ok(Err(e)) => tracing::warn!(%addr, error = %e, "refused a data connection"),
                        Err(_) => tracing::warn!(%addr, "refused a data connection: no hello in time"),
                    },
                    // Our own connections failed (or are all made) while peers are still due.
                    done = &mut connecting, if connected.is_none() => {
                        connected = Some(connections_made(done, &mut unreached)?);
                    }
                    () = tokio::time::sleep_until(deadline) => {
                        let missing: Vec<u32> = (0..n as u32)
                            .filter(|j| *j as usize != me && !peers.contains_key(j))
                            .collect();
                        return Err(WorkerError::Fatal(format!(
                            "subtasks {missing:?} did not connect within the start's window of {} s (readyTimeoutSecs)",
                            window.as_secs()
                        )));
                    }
                }
            }
            for (from, stream) in peers {
                let Some(tx) = accept_inputs.get(from as usize).cloned() else {
                    continue;
                };
                let s3 = s2.clone();
                tokio::spawn(async move {
                    if let Err(e) = shuffle::recv_loop(from, stream, tx).await {
                        s3.fail(format!("receiving from subtask {from}: {e}"));
                    }
                });
            }
            let senders = match connected {
                Some(senders) => senders,
                None => connections_made(connecting.await, &mut unreached)?,
            };
            s2.ready.store(true, Ordering::Release);
            tracing::info!("connected to every peer");
            for h in senders {
                let s3 = s2.clone();
                tokio::spawn(async move {
                    match h.await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => {
                            s3.fail(format!("sending to a peer: {e}"));
                        }
                        Err(e) => {
                            s3.fail(format!("sender task: {e}"));
                        }
                    }
                });
            }
            Ok(())
        }
        .await;
        if let Err(e) = result {
            s2.fail(format!("connecting the data plane: {e}"));
        }
        drop(unreached);
    });
    drop(input_tx);

    let sink = match (&req.job.sink.sink_type, &req.job.sink.url) {
        (keyshift_core::spec::SinkType::ObjectStore, Some(url)) => {
            let (store, base) = snapshot::open_store(url)?;
            let writer = job::WriterId {
                subtask: req.subtask,
                parallelism: req.parallelism,
            };
            Some(ObjectSink {
                store,
                base,
                staging: job::StagingSink::new(writer),
            })
        }
        // Exactly-once Kafka: staged in the job's storage like the object-store sink's output;
        // the coordinator produces it once its snapshot commits (see job::kafka::sink).
        (keyshift_core::spec::SinkType::Kafka, _) if job::kafka::sink::stages(&req.job.sink) => {
            Some(ObjectSink {
                store: store.clone(),
                base: job::kafka::sink::staging_base(&job_dir),
                staging: job::StagingSink::new(job::WriterId {
                    subtask: req.subtask,
                    parallelism: req.parallelism,
                }),
            })
        }
        _ => None,
    };
    #[cfg(feature = "kafka")]
    let kafka = match (&req.job.sink.sink_type, &req.job.sink.kafka) {
        (keyshift_core::spec::SinkType::Kafka, Some(k))
            if !job::kafka::sink::stages(&req.job.sink) =>
        {
            Some(
                job::kafka::sink::AtLeastOnceSink::from_spec(k)
                    .map_err(|e| WorkerError::KafkaSink(e.to_string()))?,
            )
        }
        _ => None,
    };
    let my_partitions: Vec<u32> = (0..compiled.partitions())
        .filter(|p| p % req.parallelism == req.subtask)
        .collect();
    let source_partitions = compiled.partition_names(&my_partitions);
    // A Kafka source: its partitions assigned at their snapshot offsets (or where a job without
    // state starts), resolved before any record is read; new partitions watched for.
    #[cfg(feature = "kafka")]
    let positions = match &compiled.source {
        job::SourceKind::Kafka(k) => {
            let (k2, mine) = (k.clone(), my_partitions.clone());
            let (resolved, expired) =
                tokio::task::spawn_blocking(move || k2.assign(&mine, &positions, from_snapshot))
                    .await
                    .map_err(|e| {
                        WorkerError::Fatal(format!("assigning the Kafka partitions: {e}"))
                    })?
                    .map_err(job::JobError::from)?;
            for e in &expired {
                tracing::warn!(
                    partition = %e.partition,
                    from = e.from,
                    to = e.to,
                    records = e.to - e.from,
                    "the partition's retention deleted records the job had not read: reading on from its earliest record"
                );
                s.metrics.source_records_expired.inc_by(e.to - e.from);
            }
            resp.records_expired = expired;
            spawn_kafka_partition_watch(s.clone(), k.clone());
            spawn_kafka_lag(s.clone(), k.clone());
            resolved
        }
        _ => positions,
    };
    let sub = Subtask {
        job: (req.namespace.clone(), req.name.clone()),
        subtask: req.subtask,
        assignment,
        keyed,
        store,
        job_dir,
        sink_log: matches!(req.job.sink.sink_type, keyshift_core::spec::SinkType::Log),
        sink,
        #[cfg(feature = "kafka")]
        kafka,
        source_partitions,
        chain,
        capturing: None,
        uploading: None,
    };
    let compiled = Arc::new(compiled);
    let s_src = s.clone();
    let src_compiled = compiled.clone();
    tokio::spawn(async move {
        let r = source_loop(
            s_src.clone(),
            src_compiled,
            my_partitions,
            positions,
            assignment,
            outputs,
            cmd_rx,
        )
        .await;
        if let Err(e) = r {
            s_src.fail(format!("source: {e}"));
        }
    });
    let s_op = s.clone();
    let operator = async move {
        if let Err(e) = operator_loop(s_op.clone(), sub, input_rx, watermark).await {
            s_op.fail(format!("keyed operator: {e}"));
        }
    };
    // The keyed operator gets a thread of its own; its I/O and the tasks it spawns still use the
    // runtime. As a task it took turns with the source on one runtime thread (a woken task runs
    // next on the waker's thread and cannot be stolen), so a subtask never used more than one
    // core; and encoding a large snapshot held a runtime thread for seconds.
    let handle = tokio::runtime::Handle::current();
    let s_thread = s.clone();
    std::thread::Builder::new()
        .name(format!("keyed-operator-{}", req.subtask))
        .spawn(move || {
            let run = std::panic::AssertUnwindSafe(|| handle.block_on(operator));
            if std::panic::catch_unwind(run).is_err() {
                s_thread.fail("keyed operator: panicked");
            }
        })
        .map_err(|e| WorkerError::Fatal(format!("starting the keyed operator thread: {e}")))?;
    Ok(resp)
}
