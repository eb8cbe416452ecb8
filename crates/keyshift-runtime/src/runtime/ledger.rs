//! A worker's bookkeeping of the snapshots it was asked to take: each id's status (what
//! `GET /v1/checkpoints/{id}` answers) and the cut its source recorded at the barrier, until the
//! keyed operator writes the snapshot. Pure: no I/O, no clock beyond the [`Instant`] a cut
//! carries.
//!
//! Snapshot ids only grow (the coordinator never reuses one), so the ledger keeps:
//! * every **pending** id (triggered, not finished), at most [`MAX_PENDING`]: one more trigger
//!   abandons the oldest;
//! * the newest [`RETAINED_FINISHED`] **finished** ids (completed, failed or aborted), dropping
//!   older ones (they answer [`CheckpointStatus::Unknown`]);
//! * a **cut** only while its id is pending: completing, failing or aborting an id drops it.
//!
//! **Aborting** id `n` ([`Ledger::abort`]) marks `n`, and every id below it still pending, as
//! failed with the abort's reason; an id that had completed here is marked failed too (the
//! snapshot did not commit, its acknowledgement is worthless). It raises
//! [`Ledger::aborted_through`], the mark the keyed operator checks: it stops aligning any id at or
//! below it and ignores the barriers of such ids, and the source does not inject them. An id that
//! finishes after its abort stays aborted. A trigger of an id not above the newest finished one
//! that the ledger does not know is refused ([`Trigger::Stale`]): the operator would ignore its
//! barriers.

use super::protocol::CheckpointStatus;
use crate::snapshot::SnapshotKind;
use std::collections::BTreeMap;
use std::time::Instant;

/// Finished snapshot statuses a worker keeps (the newest ids).
pub const RETAINED_FINISHED: usize = 64;

/// Snapshots a worker keeps pending at once; a trigger beyond it abandons the oldest.
pub const MAX_PENDING: usize = 16;

/// What the source recorded when it injected a barrier.
#[derive(Debug, Clone, PartialEq)]
pub struct BarrierCut {
    /// Checkpoint or savepoint.
    pub kind: SnapshotKind,
    /// Its partitions' positions at the barrier.
    pub positions: BTreeMap<u32, u64>,
    /// When the barrier was injected.
    pub at: Instant,
    /// The trigger's [`super::protocol::CheckpointRequest::last_committed`].
    pub last_committed: Option<u64>,
    /// Whether the sources stop at this barrier (a stop checkpoint compacts nothing:
    /// [`super::incremental::ChainPolicy::for_checkpoint`]).
    pub stop: bool,
}

/// What a trigger does to the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// A new id, now pending: its barrier is to be injected.
    New,
    /// An id the ledger knows (a retried trigger): nothing changes.
    Known,
    /// An id at or below the newest finished one that the ledger does not know: refused.
    Stale {
        /// The newest finished id.
        newest_finished: u64,
    },
}

/// A worker's snapshot bookkeeping (see the [module documentation](self)).
#[derive(Debug, Default)]
pub struct Ledger {
    statuses: BTreeMap<u64, CheckpointStatus>,
    cuts: BTreeMap<u64, BarrierCut>,
    /// The newest id that completed, failed or was aborted here (0: none).
    newest_finished: u64,
    /// Every id at or below it that is not completed was abandoned (0: none).
    aborted_through: u64,
}

impl Ledger {
    /// An empty ledger.
    pub fn new() -> Self {
        Ledger::default()
    }

    /// The status of `id` ([`CheckpointStatus::Unknown`] if never seen or long finished).
    pub fn status(&self, id: u64) -> CheckpointStatus {
        self.statuses
            .get(&id)
            .cloned()
            .unwrap_or(CheckpointStatus::Unknown)
    }

    /// The newest id this worker was asked about (triggered or aborted), if any: a coordinator
    /// that takes the worker over continues above it.
    pub fn newest_id(&self) -> Option<u64> {
        let newest = self.statuses.keys().next_back().copied().unwrap_or(0);
        Some(newest.max(self.newest_finished).max(self.aborted_through)).filter(|id| *id > 0)
    }

    /// Every id at or below this was either completed or abandoned (the keyed operator's mark).
    pub fn aborted_through(&self) -> u64 {
        self.aborted_through
    }

    /// A trigger of `id`. With more than [`MAX_PENDING`] ids pending, the oldest is aborted
    /// (and [`Ledger::aborted_through`] raised).
    pub fn trigger(&mut self, id: u64) -> Trigger {
        if self.statuses.contains_key(&id) {
            return Trigger::Known;
        }
        if id <= self.newest_finished || id <= self.aborted_through {
            return Trigger::Stale {
                newest_finished: self.newest_finished.max(self.aborted_through),
            };
        }
        self.statuses.insert(id, CheckpointStatus::Pending);
        let pending: Vec<u64> = self.pending().collect();
        if pending.len() > MAX_PENDING {
            let oldest = pending[pending.len() - MAX_PENDING - 1];
            self.abort(
                oldest,
                &format!("abandoned: more than {MAX_PENDING} snapshots were in flight"),
            );
        }
        Trigger::New
    }

    /// Records the source's cut of pending `id`. Returns false (and keeps nothing) when `id` is
    /// not pending (aborted before its barrier was injected): its barrier must not be injected.
    pub fn record_cut(&mut self, id: u64, cut: BarrierCut) -> bool {
        if !matches!(self.statuses.get(&id), Some(CheckpointStatus::Pending)) {
            return false;
        }
        self.cuts.insert(id, cut);
        true
    }

    /// Takes the cut of `id` for its snapshot; `None` if there is none (never injected here, or
    /// aborted meanwhile: see [`Ledger::is_aborted`]).
    pub fn take_cut(&mut self, id: u64) -> Option<BarrierCut> {
        self.cuts.remove(&id)
    }

    /// Whether `id` was abandoned (aborted, superseded) rather than completed.
    pub fn is_aborted(&self, id: u64) -> bool {
        id <= self.aborted_through
            && !matches!(self.statuses.get(&id), Some(CheckpointStatus::Completed(_)))
    }

    /// `id` finished here with `status` (completed or failed). Returns false and changes nothing
    /// if it was aborted meanwhile: it stays aborted. Ids below it still pending can no longer
    /// be aligned (the operator aligns in id order): they are aborted as superseded.
    pub fn finish(&mut self, id: u64, status: CheckpointStatus) -> bool {
        if id <= self.aborted_through {
            return false;
        }
        let superseded: Vec<u64> = self.pending().take_while(|p| *p < id).collect();
        for old in superseded {
            self.statuses.insert(
                old,
                CheckpointStatus::Failed {
                    error: format!("aborted: superseded by snapshot {id}"),
                },
            );
            self.aborted_through = self.aborted_through.max(old);
        }
        self.cuts = self.cuts.split_off(&(id + 1));
        self.statuses.insert(id, status);
        self.newest_finished = self.newest_finished.max(id);
        self.prune();
        true
    }

    /// Aborts `id` and every pending id below it (see the [module documentation](self)): each
    /// becomes [`CheckpointStatus::Failed`] with `reason` and loses its cut. Idempotent: an id
    /// that already failed keeps its first error. Returns [`Ledger::aborted_through`].
    pub fn abort(&mut self, id: u64, reason: &str) -> u64 {
        let failed = || CheckpointStatus::Failed {
            error: reason.to_owned(),
        };
        for (_, status) in self.statuses.range_mut(..id) {
            if matches!(status, CheckpointStatus::Pending) {
                *status = failed();
            }
        }
        match self.statuses.get(&id) {
            Some(CheckpointStatus::Failed { .. }) => {}
            // Pending, completed here (the snapshot did not commit) or never seen (the trigger
            // did not reach this worker): it is abandoned.
            _ => {
                self.statuses.insert(id, failed());
            }
        }
        self.cuts = self.cuts.split_off(&(id + 1));
        self.aborted_through = self.aborted_through.max(id);
        self.newest_finished = self.newest_finished.max(id);
        self.prune();
        self.aborted_through
    }

    /// Pending ids, oldest first.
    fn pending(&self) -> impl Iterator<Item = u64> + '_ {
        self.statuses
            .iter()
            .filter(|(_, s)| matches!(s, CheckpointStatus::Pending))
            .map(|(id, _)| *id)
    }

    /// Keeps the newest [`RETAINED_FINISHED`] finished statuses (and every pending one).
    fn prune(&mut self) {
        let finished = self.statuses.len() - self.pending().count();
        let mut excess = finished.saturating_sub(RETAINED_FINISHED);
        if excess == 0 {
            return;
        }
        self.statuses.retain(|_, s| {
            if excess > 0 && !matches!(s, CheckpointStatus::Pending) {
                excess -= 1;
                false
            } else {
                true
            }
        });
    }

    /// Statuses held (pending and finished), and cuts held.
    pub fn sizes(&self) -> (usize, usize) {
        (self.statuses.len(), self.cuts.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cut() -> BarrierCut {
        BarrierCut {
            kind: SnapshotKind::Checkpoint,
            positions: BTreeMap::from([(0, 1)]),
            at: Instant::now(),
            last_committed: Some(0),
            stop: false,
        }
    }

    fn failed(error: &str) -> CheckpointStatus {
        CheckpointStatus::Failed {
            error: error.into(),
        }
    }

    /// A completed status (the ack's content does not matter to the ledger).
    fn completed() -> CheckpointStatus {
        CheckpointStatus::Completed(Box::new(
            serde_json::from_value(serde_json::json!({
                "snapshot": {
                    "subtask": 0, "parallelism": 1, "maxParallelism": 1,
                    "file": {"name": "state-0-of-1.bin", "size": 0, "checksum": "00000000"},
                    "groups": [{"group": 0, "file": "state-0-of-1.bin", "offset": 0, "length": 0, "checksum": "00000000", "entries": 0}]
                },
                "sourcePositions": {}, "watermark": 0, "durationMs": 1
            }))
            .unwrap(),
        ))
    }

    #[test]
    fn many_checkpoints_keep_the_bookkeeping_bounded() {
        let mut l = Ledger::new();
        for id in 1..=1000u64 {
            assert_eq!(l.trigger(id), Trigger::New);
            assert!(l.record_cut(id, cut()));
            let outcome = match id % 3 {
                0 => {
                    l.abort(id, "aborted");
                    continue;
                }
                1 => completed(),
                _ => failed("disk full"),
            };
            assert!(l.take_cut(id).is_some());
            assert!(l.finish(id, outcome));
        }
        assert_eq!(l.sizes(), (RETAINED_FINISHED, 0));
        assert_eq!(l.newest_id(), Some(1000));
        // The newest are kept, the oldest answer Unknown.
        assert_eq!(l.status(1000), completed());
        assert_eq!(l.status(999), failed("aborted"));
        assert_eq!(l.status(1), CheckpointStatus::Unknown);
        // Triggers the operator never sees (a dead peer) stay bounded too.
        for id in 1001..=1100u64 {
            assert_eq!(l.trigger(id), Trigger::New);
            assert!(l.record_cut(id, cut()));
        }
        let (statuses, cuts) = l.sizes();
        assert!(statuses <= RETAINED_FINISHED + MAX_PENDING, "{statuses}");
        assert_eq!(cuts, MAX_PENDING);
        assert_eq!(l.aborted_through(), 1100 - MAX_PENDING as u64);
        assert!(matches!(
            l.status(1100 - MAX_PENDING as u64),
            CheckpointStatus::Failed { error } if error.contains("in flight")
        ));
        assert_eq!(l.status(1100), CheckpointStatus::Pending);
    }

    #[test]
    fn an_abort_fails_the_id_and_the_pending_ones_below_and_drops_their_cuts() {
        let mut l = Ledger::new();
        for id in 1..=3 {
            l.trigger(id);
            l.record_cut(id, cut());
        }
        assert!(l.take_cut(1).is_some());
        assert!(l.finish(1, completed()));
        assert_eq!(l.abort(2, "aborted by the coordinator"), 2);
        assert_eq!(l.status(1), completed(), "completed below: untouched");
        assert_eq!(l.status(2), failed("aborted by the coordinator"));
        assert_eq!(l.status(3), CheckpointStatus::Pending);
        assert_eq!(l.sizes(), (3, 1));
        assert!(l.take_cut(2).is_none());
        assert!(l.is_aborted(2) && !l.is_aborted(1) && !l.is_aborted(3));
        // Idempotent: a second abort keeps the first reason.
        assert_eq!(l.abort(2, "again"), 2);
        assert_eq!(l.status(2), failed("aborted by the coordinator"));
        // A snapshot that finishes after its abort stays aborted.
        assert!(!l.finish(2, completed()));
        assert_eq!(l.status(2), failed("aborted by the coordinator"));
        // Finishing 4 supersedes 3, still pending below it.
        l.trigger(4);
        l.record_cut(4, cut());
        l.take_cut(4);
        assert!(l.finish(4, completed()));
        assert_eq!(l.status(3), failed("aborted: superseded by snapshot 4"));
        assert_eq!(l.sizes(), (4, 0));
        // A retried trigger changes nothing; an older unknown id is stale.
        assert_eq!(l.trigger(2), Trigger::Known);
        assert_eq!(l.trigger(3), Trigger::Known);
        l.statuses.remove(&1);
        assert_eq!(l.trigger(1), Trigger::Stale { newest_finished: 4 });
        assert_eq!(l.trigger(5), Trigger::New);
    }

    #[test]
    fn an_abort_reaches_ids_this_worker_never_saw_or_completed() {
        let mut l = Ledger::new();
        // The trigger of 5 never reached this worker: its abort still records it.
        l.abort(5, "aborted: the trigger did not reach every worker");
        assert_eq!(
            l.status(5),
            failed("aborted: the trigger did not reach every worker")
        );
        // Its barrier arrives later (the trigger was slow): not injected.
        assert_eq!(l.trigger(5), Trigger::Known);
        assert!(!l.record_cut(5, cut()));
        assert_eq!(l.sizes(), (1, 0));
        // Completed here, failed elsewhere: the abort marks it failed here too.
        l.trigger(6);
        l.record_cut(6, cut());
        l.take_cut(6);
        l.finish(6, completed());
        l.abort(6, "aborted");
        assert_eq!(l.status(6), failed("aborted"));
        assert!(l.is_aborted(6));
    }
}
