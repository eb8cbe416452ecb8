//! What the spec and status say, read for a decision: whether the spec can run, its
//! parallelism, checkpoint interval and hash, when the last snapshot was, where a rescale restores.

use super::*;

/// Why a spec cannot run: (reason, message) for the Stalled condition. `name` is the job's
/// metadata.name (the guidance names commands).
pub fn check_spec(
    name: &str,
    spec: &StreamJobSpec,
    status: &StreamJobStatus,
) -> Result<Analysis, (Reason, String)> {
    if let Some(pinned) = status.max_parallelism {
        // Another spec.maxParallelism is the ceiling the job moves to.
        let changing = spec.max_parallelism.is_some_and(|g| g != pinned);
        if spec.replicas > pinned && !changing {
            let context = validation::ceiling_context(name, spec, status, pinned);
            let mut message = validation::ceiling_guidance(&context);
            let suggested =
                keyshift_core::keygroup::suggested_max_parallelism(spec.replicas.max(1) as u32);
            if let Some(note) = status
                .last_checkpoint
                .iter()
                .chain(&status.last_savepoint)
                .filter_map(|s| s.size_bytes)
                .max()
                .and_then(|bytes| {
                    keyshift_core::keygroup::tiny_groups(suggested, bytes.max(0) as u64)
                })
            {
                message = format!("{message}. Note: {note}");
            }
            return Err((Reason::AboveKeyGroupCeiling, message));
        }
    }
    if let Err(e) = validation::validate(spec, Some(status)) {
        return Err((Reason::InvalidSpec, e.to_string()));
    }
    validation::analyse(spec, Some(status)).map_err(|e| {
        let reason = match e {
            validation::AnalysisError::AboveCeiling { .. } => Reason::AboveKeyGroupCeiling,
            validation::AnalysisError::StrictNonDivisor { .. } => Reason::StrictNonDivisor,
            validation::AnalysisError::Bounds(_) => Reason::InvalidSpec,
        };
        (reason, e.to_string())
    })
}

/// When the job's latest snapshot completed (or its run started), as far as this process can
/// trust it. Times in status come from whichever process wrote them; one later than `now` (a
/// previous leader whose clock ran ahead) is ignored, or it would hold checkpoints back until
/// this clock caught up with it. `run_started` is this process's own clock.
pub fn last_snapshot_at(
    status: &StreamJobStatus,
    run_started: Option<Timestamp>,
    now: Timestamp,
) -> Option<Timestamp> {
    let parse = |t: &str| t.parse::<Timestamp>().ok();
    [
        status.last_checkpoint.as_ref().and_then(|c| parse(&c.time)),
        status.last_savepoint.as_ref().and_then(|c| parse(&c.time)),
    ]
    .into_iter()
    .flatten()
    .filter(|t| *t <= now)
    .chain(run_started)
    .max()
}

/// The parallelism a rescale restores: its target, or its origin once rolled back.
pub fn restore_target(r: &crate::crd::RescaleStatus) -> u32 {
    if r.rolled_back.is_some() {
        r.from.max(0) as u32
    } else {
        r.to.max(0) as u32
    }
}

/// Starting the new run of a rescale failed: the parallelism to roll back to (the old one,
/// restored from the same savepoint), or `None` to retry the same start with backoff (already
/// rolled back, or there is no old parallelism to return to).
pub fn rollback_on_restore_failure(r: &crate::crd::RescaleStatus) -> Option<u32> {
    (r.step == Step::Restoring
        && r.rolled_back.is_none()
        && r.from > 0
        && (r.from != r.to || r.rewrites()))
    .then_some(r.from as u32)
}

/// The status the spec is checked against: while a spec.restoreFrom is pending, its snapshot's
/// key-group count is the ceiling the job will run under.
pub fn effective_status(status: &StreamJobStatus, obs: &Observed) -> StreamJobStatus {
    let mut s = status.clone();
    if let Some(Ok(p)) = &obs.pending_restore {
        s.max_parallelism = Some(p.max_parallelism as i32);
    }
    s
}

/// Whether a pending restoreFrom can run with this spec: (reason, message) if not.
pub(super) fn check_pending_restore(
    spec: &StreamJobSpec,
    pending: &Result<PendingRestore, (Reason, String)>,
) -> Result<(), (Reason, String)> {
    let p = pending.as_ref().map_err(Clone::clone)?;
    match spec.max_parallelism {
        Some(g) if g as u32 != p.max_parallelism => Err((
            Reason::RestoreFromKeyGroupMismatch,
            format!(
                "{}; nothing was stopped",
                validation::restore_from_mismatch(&p.url, p.max_parallelism, g)
            ),
        )),
        _ => Ok(()),
    }
}
