//! The managed key-group change (spec.maxParallelism) in a pass: rewriting the savepoint to the
//! new count, verifying the rewrite, passing the point of no return and rolling back.

use super::*;

impl Pass<'_> {
    /// Verifies the rewritten savepoint `target` against `source`, in the background.
    pub(super) fn verify_rewrite(
        &mut self,
        source: String,
        target: String,
    ) -> Result<Duration, PassError> {
        let groups = self
            .status
            .rescale
            .as_ref()
            .and_then(|r| r.max_parallelism)
            .unwrap_or_default()
            .max(0) as u32;
        let parallelism = self
            .status
            .rescale
            .as_ref()
            .map_or(0, |r| r.to.max(0) as u32);
        let work = BackgroundWork::VerifyRewrite {
            source: source.clone(),
            target: target.clone(),
        };
        self.in_background(work, move |handle| {
            Ended::VerifyRewrite(handle.block_on(run::verify_rewrite(
                &source,
                &target,
                groups,
                parallelism,
            )))
        });
        Ok(requeue::BACKGROUND_BACKSTOP)
    }

    /// Rewrites savepoint `source` into `target` at `groups` key groups (for a run at
    /// `parallelism`), in the background.
    pub(super) async fn rewrite(
        &mut self,
        source: String,
        target: String,
        groups: u32,
        parallelism: u32,
    ) -> Result<Duration, PassError> {
        let short = requeue::SOON;
        let (memory, spill) = match super::super::ceiling::rewrite_settings() {
            Ok(s) => s,
            Err(e) => {
                self.roll_back_rewrite(e.to_string())?;
                return Ok(short);
            }
        };
        let fault = crate::failpoints::rewrite_fault(&self.ns, &self.name);
        let memory = match fault {
            Some(crate::failpoints::RewriteFault::MemoryBudget(m)) => m,
            _ => memory,
        };
        let work = BackgroundWork::Rewrite {
            source: source.clone(),
            target: target.clone(),
            groups,
        };
        self.in_background(work, move |handle| {
            Ended::Rewrite(handle.block_on(async {
                let done =
                    run::rewrite_savepoint(&source, &target, groups, parallelism, memory, spill)
                        .await;
                if matches!(done, Ok(Some(_)))
                    && fault == Some(crate::failpoints::RewriteFault::CorruptOutput)
                    && let Err(e) = crate::failpoints::corrupt_snapshot(&target).await
                {
                    tracing::error!(%target, "could not corrupt it: {e}");
                }
                done
            }))
        });
        Ok(requeue::BACKGROUND_BACKSTOP)
    }

    /// Records a key-group change. A running job takes its savepoint first; a stopped one has its
    /// newest snapshot verified and rewritten (or, with no snapshot at all, no state to
    /// rewrite: the new count is simply pinned).
    pub(super) async fn begin_key_group_change(
        &mut self,
        from: u32,
        to: u32,
        groups: u32,
        running: bool,
    ) -> Result<Duration, PassError> {
        let old = self.status.max_parallelism.unwrap_or_default().max(1);
        let mut change = RescaleStatus {
            from: from as i32,
            to: to as i32,
            step: Step::Savepointing,
            started: Timestamp::now().to_string(),
            max_parallelism: Some(groups as i32),
            from_max_parallelism: Some(old),
            ..Default::default()
        };
        if !running {
            let found = self.latest_restorable(old as u32).await?;
            let Some(url) = found.url else {
                self.status.max_parallelism = Some(groups as i32);
                self.status.max_parallelism_origin = Some(validation::ceiling_origin(
                    validation::CeilingSource::Spec,
                    0,
                ));
                self.event(
                    false,
                    Reason::KeyGroupsPinned,
                    format!(
                        "key-group count (max parallelism) is now {groups}: the job had no snapshot under {old}, so there was no state to rewrite"
                    ),
                );
                return Ok(requeue::SOON);
            };
            let manifest = snapshot::open_snapshot(&url)
                .await
                .map_err(|e| PassError::FindSnapshot(e.into()))?
                .2;
            change.from = manifest.parallelism as i32;
            change.step = Step::Verifying;
            change.savepoint = Some(url);
        }
        let what = format!(
            "spec.maxParallelism changed {old} -> {groups}: {}verify it, stop the old workers, rewrite it to {groups} key groups, verify every key of the rewrite, restore it at parallelism {to}; the original savepoint is kept",
            match &change.savepoint {
                Some(url) =>
                    format!("the job is stopped, so its newest snapshot {url} is rewritten: "),
                None => format!("stop the job (parallelism {from}) with a savepoint, "),
            }
        );
        self.begin(change);
        self.event(false, Reason::KeyGroupChangeStarted, what);
        Ok(requeue::SOON)
    }

    /// A run restored by a transition that changed the key-group count started: a rewrite's
    /// new run records the change (reversible until its first checkpoint), an undo of a change
    /// forgets it.
    pub(super) fn record_key_group_change(&mut self, restored: Option<&str>) {
        let undone = self
            .status
            .key_group_change
            .as_ref()
            .is_some_and(|c| Some(c.original_savepoint.as_str()) == restored);
        if undone {
            if let Some(c) = self.status.key_group_change.take() {
                self.event(
                    false,
                    Reason::KeyGroupsChanged,
                    format!(
                        "the change to {} key groups was undone: the job runs from the original savepoint {} under {} key groups again",
                        c.to_max_parallelism, c.original_savepoint, c.from_max_parallelism
                    ),
                );
            }
            return;
        }
        let Some(r) = self
            .status
            .rescale
            .as_ref()
            .filter(|r| r.rewrites() && r.rolled_back.is_none())
        else {
            return;
        };
        let mut change = crate::crd::KeyGroupChangeStatus {
            from_max_parallelism: r.from_max_parallelism.unwrap_or_default(),
            to_max_parallelism: r.max_parallelism.unwrap_or_default(),
            from_replicas: r.from,
            original_savepoint: r.savepoint.clone().unwrap_or_default(),
            rewritten_savepoint: r.rewritten.clone().unwrap_or_default(),
            finished: Timestamp::now().to_string(),
            point_of_no_return: None,
            point_of_no_return_time: None,
            message: String::new(),
        };
        change.message = crate::orchestrator::ceiling::change_message(&change);
        let note = format!(
            "key-group count {} -> {} at parallelism {}: {}",
            change.from_max_parallelism, change.to_max_parallelism, r.to, change.message
        );
        self.status.key_group_change = Some(change);
        self.event(false, Reason::KeyGroupsChanged, note);
    }

    /// A snapshot of the job committed: the first one after a key-group change is its point of
    /// no return (its output becomes visible; the original savepoint no longer holds it).
    pub(super) fn pass_point_of_no_return(&mut self, c: &Completed) {
        let Some(change) = self
            .status
            .key_group_change
            .as_mut()
            .filter(|k| k.point_of_no_return.is_none())
        else {
            return;
        };
        if c.manifest.max_parallelism as i32 != change.to_max_parallelism
            || c.url == change.rewritten_savepoint
        {
            return;
        }
        change.point_of_no_return = Some(c.id as i64);
        change.point_of_no_return_time = Some(Timestamp::now().to_string());
        change.message = crate::orchestrator::ceiling::change_message(change);
        let note = change.message.clone();
        self.event(false, Reason::KeyGroupChangeIrreversible, note);
    }

    /// How the rewrite of a key-group change ended.
    pub(super) fn rewrite_done(
        &mut self,
        source: &str,
        target: &str,
        groups: u32,
        result: Result<Option<crate::offline::RewriteReport>, crate::offline::ToolError>,
    ) -> Result<(), PassError> {
        match result {
            Ok(report) => {
                let detail = match &report {
                    Some(r) => {
                        if let Some(s) = self.rescale_mut() {
                            s.rewritten_keys = Some(r.keys as i64);
                            s.rewritten_bytes = Some(r.bytes_written as i64);
                        }
                        format!(
                            "{} keys, {} bytes read and {} written ({} spilled to local disk) in {:.3} s",
                            r.keys, r.bytes_read, r.bytes_written, r.spill_bytes, r.total_secs
                        )
                    }
                    None => "it had already committed before the orchestrator restarted".into(),
                };
                self.transition(Outcome::Rewritten)?;
                self.event(
                    false,
                    Reason::SavepointRewritten,
                    format!("{source} rewritten to {groups} key groups as {target}: {detail}"),
                );
            }
            Err(e) => self.roll_back_rewrite(format!(
                "rewriting {source} to {groups} key groups failed: {e}"
            ))?,
        }
        Ok(())
    }

    /// A key-group change goes back: the original savepoint is restored at the old parallelism
    /// and key-group count (step Restoring, rolled back).
    pub(super) fn roll_back_rewrite(&mut self, message: String) -> Result<(), PassError> {
        let (from, old) = self.status.rescale.as_ref().map_or((0, 0), |r| {
            (r.from, r.from_max_parallelism.unwrap_or_default())
        });
        let why = format!(
            "{message}; rolling back: restoring the original savepoint at parallelism {from} under {old} key groups (the rewritten savepoint, if any, is left for inspection)"
        );
        self.transition(Outcome::RewriteFailed)?;
        if let Some(r) = self.rescale_mut() {
            r.rolled_back = Some(why.clone());
        }
        self.fail(Reason::KeyGroupChangeRolledBack, why.clone());
        self.event(true, Reason::KeyGroupChangeRolledBack, why);
        Ok(())
    }
}
