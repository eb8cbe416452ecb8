//! The keyed operator of a subtask, whichever logic runs in it: the built-in aggregation
//! ([`KeyedAggregator`]) or a program's keyed step ([`ProgramStep`]). The worker holds one
//! [`Keyed`]; what both do (their range, cut epochs, group modes, watermark, counts) is asked
//! here, and what only one does is reached by matching on it.

use super::aggregate::{GroupMode, KeyedAggregator};
use super::program::{PROGRAM_SCHEMA, ProgramStep};
use super::state_codec::AGG_SCHEMA;
use keyshift_core::keygroup::KeyGroupRange;

/// The keyed operator of a subtask.
// One per subtask, moved only while it starts: kept inline rather than boxing the aggregation
// behind one more pointer on its per-record path.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Keyed {
    /// The built-in aggregation of `spec.job.aggregation`.
    Aggregate(KeyedAggregator),
    /// The keyed step of `spec.job.program`.
    Program(ProgramStep),
}

/// What says how a checkpoint building on an earlier one writes each group (see
/// [`crate::runtime::incremental::Base::mode`]).
pub trait GroupModes {
    /// How a snapshot building on the one taken at cut `since` must write `group`.
    fn group_mode(&self, group: u32, since: u32) -> GroupMode;
}

impl GroupModes for KeyedAggregator {
    fn group_mode(&self, group: u32, since: u32) -> GroupMode {
        KeyedAggregator::group_mode(self, group, since)
    }
}

impl GroupModes for Keyed {
    fn group_mode(&self, group: u32, since: u32) -> GroupMode {
        match self {
            Keyed::Aggregate(a) => a.group_mode(group, since),
            Keyed::Program(p) => p.group_mode(group, since),
        }
    }
}

impl Keyed {
    /// The key groups it owns.
    pub fn range(&self) -> KeyGroupRange {
        match self {
            Keyed::Aggregate(a) => a.range(),
            Keyed::Program(p) => p.range(),
        }
    }

    /// The schema of its key-group blocks in a snapshot's manifest.
    pub fn schema(&self) -> &'static str {
        match self {
            Keyed::Aggregate(_) => AGG_SCHEMA,
            Keyed::Program(_) => PROGRAM_SCHEMA,
        }
    }

    /// Keys held (the aggregation's keys; a program's state entries, timers included, as
    /// counted at its last checkpoint, restore or catch-up: [`ProgramStep::counted_entries`]).
    /// No pass over the keys: it is read while records flow and inside a rescale's pause.
    pub fn key_count(&self) -> usize {
        match self {
            Keyed::Aggregate(a) => a.key_count(),
            Keyed::Program(p) => p.counted_entries(),
        }
    }

    /// Records that arrived behind the watermark so far.
    pub fn late_records(&self) -> u64 {
        match self {
            Keyed::Aggregate(a) => a.late_records(),
            Keyed::Program(p) => p.late_records(),
        }
    }

    /// Ends the current cut epoch at a snapshot's barrier.
    pub fn cut(&mut self) -> u32 {
        match self {
            Keyed::Aggregate(a) => a.cut(),
            Keyed::Program(p) => p.cut(),
        }
    }

    /// Restores the watermark a snapshot recorded.
    pub fn restore_watermark(&mut self, watermark: i64) {
        match self {
            Keyed::Aggregate(a) => a.restore_watermark(watermark),
            Keyed::Program(p) => p.restore_watermark(watermark),
        }
    }

    /// Whether a snapshot's cut drains the changed keys' results (the aggregation over all
    /// time).
    pub fn drains_updates(&self) -> bool {
        matches!(self, Keyed::Aggregate(a) if a.config().window_size_ms.is_none())
    }
}
