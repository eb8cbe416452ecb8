//! A pre-staged rescale in a pass: starting the new workers beside the running job, and what
//! their loading ended with.

use super::*;

impl Pass<'_> {
    /// Pre-stages the new workers of run `run_id` (see [`run::prestage`]) in the background; the
    /// running job's run goes with it (for its catch-up checkpoints) and comes back.
    pub(super) async fn prestage(
        &mut self,
        run_id: String,
        parallelism: u32,
    ) -> Result<Duration, PassError> {
        let endpoints = endpoints_of(&self.prestage_endpoints, parallelism);
        let (Some(endpoints), true) = (endpoints, self.mem.run.is_some()) else {
            return Ok(requeue::SOON);
        };
        let (new, template) = self.new_run(parallelism, endpoints, &run_id, None).await?;
        let Some(mut old) = self.mem.run.take() else {
            return Ok(requeue::SOON);
        };
        let checkpoint_timeout = self.settings.timeouts.checkpoint;
        let job = (self.storage.clone(), self.ns.clone(), self.name.clone());
        let groups = self.max_parallelism();
        let replaced_up_to = self
            .status
            .replaced_history_up_to
            .and_then(|b| u64::try_from(b).ok());
        let timeout = self.settings.timeouts.prestage;
        let work = BackgroundWork::Prestage {
            run: run_id,
            parallelism,
        };
        self.in_background(work, move |handle| {
            let result = handle.block_on(run::prestage(
                checkpoint_timeout,
                (&job.0, &job.1, &job.2),
                groups,
                replaced_up_to,
                &mut old.coordinator,
                &new,
                &template,
                crate::runtime::prestage::CatchUp::default(),
                timeout,
            ));
            Ended::Prestage(Box::new((old, result)))
        });
        Ok(requeue::BACKGROUND_BACKSTOP)
    }

    /// Records how pre-staging ended: step Savepointing with what was loaded, or a fallback.
    pub(super) async fn prestage_done(
        &mut self,
        run_id: &str,
        parallelism: u32,
        old: RunHandle,
        result: Result<run::Prestaged, CoordinatorError>,
    ) -> Result<Duration, PassError> {
        let old_parallelism = old.parallelism;
        self.mem.run = Some(old);
        match result {
            Ok(done) => {
                let labels = self.kind_labels(SnapshotKind::Checkpoint);
                for c in &done.checkpoints {
                    self.record_snapshot(&labels, Some(c));
                    self.status.last_checkpoint = Some(snapshot_ref(c, old_parallelism));
                }
                let loaded = done.loaded_bytes();
                if let Some(p) = self.rescale_mut().and_then(|r| r.prestage.as_mut()) {
                    p.base = Some(done.base.clone());
                    p.loaded_bytes = Some(loaded as i64);
                    p.catch_up_rounds = Some(done.catch_up_rounds() as i32);
                }
                self.transition(Outcome::Prestaged)?;
                self.event(
                    false,
                    Reason::Prestaged,
                    format!(
                        "run {run_id}: {} loaded {loaded} bytes of state from {} ({}) while the job kept running",
                        text::count(u64::from(parallelism), "new worker"),
                        done.base,
                        text::count(u64::from(done.catch_up_rounds()), "catch-up round"),
                    ),
                );
                Ok(requeue::RECORDED)
            }
            // The new workers refused the state for good (it cannot go to that parallelism):
            // the old run has not stopped, and goes on; the rescale is not tried again until
            // the spec changes.
            Err(e @ CoordinatorError::Refused { .. }) => {
                let refusal = decide::StartRefusal {
                    reason: Reason::StartRefused,
                    message: format!(
                        "pre-staging the new workers at parallelism {parallelism} was refused: {e}"
                    ),
                    parallelism: Some(parallelism),
                };
                let message = refusal.running_message(old_parallelism);
                self.remember_refusal(refusal);
                self.abandon(message, false).await?;
                Ok(requeue::SOON)
            }
            Err(e) => {
                self.fall_back(format!("pre-staging the new workers failed: {e}"))?;
                Ok(requeue::SOON)
            }
        }
    }
}

/// What a finished rescale's Event says of its pre-stage, if it had one. Pure.
pub(super) fn prestage_summary(r: &RescaleStatus) -> String {
    match (&r.prestage, &r.fallback) {
        (Some(_), Some(why)) => format!("; fell back to stop-and-restore ({why})"),
        (Some(p), None) if r.upgrade_mode.is_some() => format!(
            "; pre-staged: the new spec's workers loaded {} bytes of state while the job ran (it fits the new spec) and started from the savepoint",
            p.loaded_bytes.unwrap_or_default()
        ),
        (Some(p), None) => format!(
            "; pre-staged: {} bytes loaded while the job ran, {} bytes written by the stop checkpoint",
            p.loaded_bytes.unwrap_or_default(),
            p.delta_bytes.unwrap_or_default()
        ),
        (None, _) => String::new(),
    }
}
