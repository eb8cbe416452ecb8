//! Barrier alignment: an input that delivered barrier `n` is not read again until every input
//! has; a higher barrier supersedes the one aligning, an abort unblocks the inputs.

use super::*;

/// A snapshot written at its barrier, or still being written (an incremental checkpoint).
pub(super) enum Written {
    Done(Box<SubtaskAck>),
    /// The cut is still being copied ([`Subtask::capturing`]), then uploaded.
    Capturing,
    Uploading(Uploading),
}

/// What a barrier does to the keyed operator's alignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Barrier {
    /// Of a snapshot finished, abandoned or older than the one aligned: ignored.
    Stale,
    /// Its input is blocked until every input has delivered it, or, `aligned`, every input
    /// has: take the snapshot (the inputs are unblocked). `superseded` is the lower snapshot
    /// that was being aligned and is abandoned (its inputs unblocked).
    Accepted {
        superseded: Option<u64>,
        aligned: bool,
    },
}

/// Barrier alignment of the keyed operator (pure): an input that delivered barrier `n` is not
/// read again until every input has. A barrier of a higher id arriving while `n` aligns
/// abandons `n` (Flink's checkpoint subsumption): the barriers of `n` still on their way are
/// then stale, as are barriers of ids at or below one finished here or aborted.
#[derive(Debug)]
pub(super) struct Alignment {
    blocked: Vec<bool>,
    aligning: Option<u64>,
    /// The newest id aligned or abandoned here (0: none).
    settled: u64,
}

impl Alignment {
    pub(super) fn new(inputs: usize) -> Self {
        Alignment {
            blocked: vec![false; inputs],
            aligning: None,
            settled: 0,
        }
    }

    pub(super) fn blocked(&self) -> &[bool] {
        &self.blocked
    }

    pub(super) fn aligning(&self) -> Option<u64> {
        self.aligning
    }

    pub(super) fn unblock(&mut self, settled: u64) {
        self.blocked.iter_mut().for_each(|b| *b = false);
        self.aligning = None;
        self.settled = self.settled.max(settled);
    }

    /// Stops aligning a snapshot at or below `aborted_through`; returns its id if it did.
    pub(super) fn abandon_through(&mut self, aborted_through: u64) -> Option<u64> {
        let id = self.aligning.filter(|a| *a <= aborted_through)?;
        self.unblock(id);
        Some(id)
    }

    /// Barrier `id` from input `i`; ids at or below `aborted_through` were abandoned.
    pub(super) fn barrier(&mut self, i: usize, id: u64, aborted_through: u64) -> Barrier {
        if id <= self.settled || id <= aborted_through || self.aligning.is_some_and(|a| id < a) {
            return Barrier::Stale;
        }
        let superseded = match self.aligning {
            Some(a) if a < id => {
                self.unblock(a);
                Some(a)
            }
            _ => None,
        };
        self.aligning = Some(id);
        self.blocked[i] = true;
        let aligned = self.blocked.iter().all(|b| *b);
        if aligned {
            self.unblock(id);
        }
        Barrier::Accepted {
            superseded,
            aligned,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accepted(superseded: Option<u64>, aligned: bool) -> Barrier {
        Barrier::Accepted {
            superseded,
            aligned,
        }
    }

    #[test]
    fn a_barrier_aligns_once_every_input_delivered_it() {
        let mut a = Alignment::new(3);
        assert_eq!(a.barrier(0, 1, 0), accepted(None, false));
        assert_eq!(a.blocked(), [true, false, false]);
        assert_eq!(a.barrier(2, 1, 0), accepted(None, false));
        assert_eq!(a.barrier(1, 1, 0), accepted(None, true));
        assert_eq!((a.blocked(), a.aligning()), (&[false; 3][..], None));
        // Its barriers are done with: a late copy is stale.
        assert_eq!(a.barrier(0, 1, 0), Barrier::Stale);
    }

    /// The trigger of 5 reached only the source of input 0: 6 supersedes 5, unblocks input 0,
    /// and aligns on its own; 5's barriers still on their way are ignored.
    #[test]
    fn a_higher_barrier_supersedes_the_one_aligning() {
        let mut a = Alignment::new(3);
        assert_eq!(a.barrier(0, 5, 0), accepted(None, false));
        assert_eq!(a.barrier(1, 6, 0), accepted(Some(5), false));
        assert_eq!(a.blocked(), [false, true, false]);
        assert_eq!(a.aligning(), Some(6));
        assert_eq!(
            a.barrier(2, 5, 0),
            Barrier::Stale,
            "older than the one aligning"
        );
        assert_eq!(a.barrier(0, 6, 0), accepted(None, false));
        assert_eq!(a.barrier(2, 6, 0), accepted(None, true));
        assert_eq!(a.barrier(2, 5, 0), Barrier::Stale, "superseded");
        assert_eq!(a.barrier(0, 7, 0), accepted(None, false));
    }

    #[test]
    fn an_abort_unblocks_the_inputs_and_its_barriers_are_stale() {
        let mut a = Alignment::new(2);
        assert_eq!(a.barrier(0, 3, 0), accepted(None, false));
        assert_eq!(a.abandon_through(2), None, "an older abort changes nothing");
        assert_eq!(a.abandon_through(3), Some(3));
        assert_eq!((a.blocked(), a.aligning()), (&[false; 2][..], None));
        assert_eq!(a.barrier(1, 3, 3), Barrier::Stale);
        // Aborted before any of its barriers arrived: never aligned.
        assert_eq!(a.barrier(0, 4, 4), Barrier::Stale);
        assert_eq!(a.barrier(0, 5, 4), accepted(None, false));
        assert_eq!(a.barrier(1, 5, 4), accepted(None, true));
    }
}
