//! The control API's handlers: the bearer token, readiness, metrics, status, and the
//! checkpoint commands (trigger, abort, resume) the coordinator sends ([`crate::runtime::protocol`]).

use super::*;

/// Refuses a control request without the job's token before anything reads its body.
pub(super) async fn require_token(
    State(s): State<Arc<Shared>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match authorized(&s, request.headers()) {
        Ok(()) => next.run(request).await,
        Err(refused) => *refused,
    }
}

pub(super) fn authorized(shared: &Shared, headers: &HeaderMap) -> Result<(), Box<Response>> {
    let ok = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|t| constant_time_eq(t.as_bytes(), shared.token.as_bytes()));
    if ok {
        Ok(())
    } else {
        Err(Box::new(
            (
                StatusCode::UNAUTHORIZED,
                "missing or wrong bearer token: send Authorization: Bearer <the job's control token>",
            )
                .into_response(),
        ))
    }
}

pub(super) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

pub(super) fn err(code: StatusCode, message: impl std::fmt::Display) -> Response {
    (
        code,
        Json(serde_json::json!({ "error": message.to_string() })),
    )
        .into_response()
}

pub(super) async fn readyz(State(s): State<Arc<Shared>>) -> Response {
    if s.ready.load(Ordering::Acquire) {
        (StatusCode::OK, "ready").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not started or not connected",
        )
            .into_response()
    }
}

pub(super) async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    match s.metrics.encode() {
        Ok(text) => (
            [(
                axum::http::header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(e) => err(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}

pub(super) async fn status(State(s): State<Arc<Shared>>) -> Response {
    let mut st = s.status.lock().await.clone();
    let m = &s.metrics;
    st.records_in = m.records_in.get();
    st.records_processed = m.records_processed.get();
    st.records_combined = m.records_combined.get();
    st.records_out = m.records_out.get();
    st.late_records = m.late_records.get();
    st.keys = m.keys.get() as u64;
    st.watermark = m.watermark_ms();
    st.backpressure_ms = (m.backpressure_seconds.get() * 1000.0).round() as u64;
    st.newest_snapshot = s.ledger.lock().await.newest_id();
    if s.stopped.load(Ordering::Acquire) {
        st.state = WorkerState::Stopped;
    }
    if st.state == WorkerState::Restoring
        && let Some(r) = st.restore.as_mut()
    {
        let p = s.restore_progress.lock().await;
        r.bytes_read = p.bytes_read();
        r.groups_read = p.groups_read();
    }
    Json(st).into_response()
}

/// Snapshot `id`'s status; with `waitMs`, held while it is pending (a long poll), so the
/// coordinator asks once per snapshot instead of every few milliseconds.
pub(super) async fn checkpoint_status(
    State(s): State<Arc<Shared>>,
    Path(id): Path<u64>,
    Query(query): Query<CheckpointStatusQuery>,
) -> Response {
    let wait = Duration::from_millis(query.wait_ms.unwrap_or(0).min(MAX_CHECKPOINT_WAIT_MS));
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        // Registered before the status is read, so a change in between is not missed.
        let changed = s.ledger_changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let st = s.ledger.lock().await.status(id);
        if !matches!(st, CheckpointStatus::Pending) || tokio::time::Instant::now() >= deadline {
            return Json(st).into_response();
        }
        let _ = tokio::time::timeout_at(deadline, changed).await;
    }
}

/// Abandons snapshot `id` (idempotent): it is reported failed, its cut is dropped, and the keyed
/// operator stops aligning it (see [`crate::runtime::ledger`]).
pub(super) async fn abort(State(s): State<Arc<Shared>>, Path(id): Path<u64>) -> Response {
    let status = s
        .abort(
            id,
            &format!("aborted: snapshot {id} was abandoned by the coordinator"),
        )
        .await;
    tracing::info!(id, "snapshot aborted by the coordinator");
    Json(status).into_response()
}

pub(super) async fn trigger(
    State(s): State<Arc<Shared>>,
    Json(req): Json<CheckpointRequest>,
) -> Response {
    let run = s.run.lock().await;
    let Some(run) = run.as_ref() else {
        return err(StatusCode::CONFLICT, "the worker has not been started");
    };
    let (outcome, through) = {
        let mut ledger = s.ledger.lock().await;
        (ledger.trigger(req.id), ledger.aborted_through())
    };
    // Too many in flight: the ledger abandoned the oldest.
    s.aborted.send_if_modified(|w| {
        let raise = through > *w;
        *w = (*w).max(through);
        raise
    });
    match outcome {
        Trigger::New => {}
        // Idempotent: a retried trigger changes nothing.
        Trigger::Known => return StatusCode::ACCEPTED.into_response(),
        Trigger::Stale { newest_finished } => {
            return err(
                StatusCode::CONFLICT,
                format!(
                    "snapshot {} is not above snapshot {newest_finished}, the newest this worker finished or abandoned: snapshot ids only grow",
                    req.id
                ),
            );
        }
    }
    if run.source_cmd.send(SourceCmd::Barrier(req)).await.is_err() {
        return err(StatusCode::INTERNAL_SERVER_ERROR, "the source has stopped");
    }
    StatusCode::ACCEPTED.into_response()
}

pub(super) async fn resume(State(s): State<Arc<Shared>>) -> Response {
    let run = s.run.lock().await;
    match run.as_ref() {
        Some(run) => {
            let _ = run.source_cmd.send(SourceCmd::Resume).await;
            s.stopped.store(false, Ordering::Release);
            StatusCode::OK.into_response()
        }
        None => err(StatusCode::CONFLICT, "the worker has not been started"),
    }
}
