//! Event-time watermarks.
//!
//! A watermark `w` promises that no more records with `ts < w` are expected. Each source
//! partition generates `max_ts_seen - maxOutOfOrderness` ([`PartitionWatermark`]); an operator's
//! watermark is the minimum over its inputs ([`WatermarkTracker`]), where an idle or finished
//! input counts as `+inf` and an input that has not produced a watermark yet holds the minimum
//! at `-inf`. Both never go backwards.
//!
//! A tumbling window `[start, end)` fires once the watermark reaches `end` (`end <= w`); a record
//! whose window has fired is *late*.

/// The smallest watermark: nothing is known yet.
pub const MIN_WATERMARK: i64 = i64::MIN;
/// The largest watermark: the input is finished (or idle); every window may fire.
pub const MAX_WATERMARK: i64 = i64::MAX;

/// The bounded-out-of-orderness watermark of one source partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionWatermark {
    max_out_of_orderness_ms: i64,
    max_ts: Option<i64>,
}

impl PartitionWatermark {
    /// A generator for records that may arrive up to `max_out_of_orderness_ms` out of order.
    pub fn new(max_out_of_orderness_ms: i64) -> Self {
        PartitionWatermark {
            max_out_of_orderness_ms: max_out_of_orderness_ms.max(0),
            max_ts: None,
        }
    }

    /// Records an event timestamp.
    #[inline]
    pub fn observe(&mut self, ts: i64) {
        self.max_ts = Some(self.max_ts.map_or(ts, |m| m.max(ts)));
    }

    /// The largest timestamp seen, if any (worth keeping with the source position).
    pub fn max_ts(&self) -> Option<i64> {
        self.max_ts
    }

    /// Restores the largest timestamp seen (e.g. from a snapshot).
    pub fn set_max_ts(&mut self, max_ts: Option<i64>) {
        self.max_ts = max_ts;
    }

    /// `max_ts_seen - maxOutOfOrderness`, or [`MIN_WATERMARK`] before the first record.
    pub fn watermark(&self) -> i64 {
        self.max_ts.map_or(MIN_WATERMARK, |m| {
            m.saturating_sub(self.max_out_of_orderness_ms)
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InputState {
    /// Watermark received (MIN_WATERMARK if none yet).
    Active(i64),
    /// Temporarily without data: does not hold back the minimum.
    Idle(i64),
    /// Will send nothing more.
    Finished,
}

/// The operator-level watermark: the minimum over its inputs, monotonic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatermarkTracker {
    inputs: Vec<InputState>,
    current: i64,
}

impl WatermarkTracker {
    /// A tracker over `inputs` inputs, none of which has sent a watermark.
    pub fn new(inputs: usize) -> Self {
        WatermarkTracker {
            inputs: vec![InputState::Active(MIN_WATERMARK); inputs],
            current: MIN_WATERMARK,
        }
    }

    /// A tracker that starts at a restored watermark (it never reports less).
    pub fn restored(inputs: usize, watermark: i64) -> Self {
        WatermarkTracker {
            inputs: vec![InputState::Active(MIN_WATERMARK); inputs],
            current: watermark,
        }
    }

    /// Number of inputs.
    pub fn inputs(&self) -> usize {
        self.inputs.len()
    }

    /// The current operator watermark.
    pub fn current(&self) -> i64 {
        self.current
    }

    /// Records input `input`'s watermark (an input's own watermark never goes back; an idle
    /// input becomes active again). Returns the new operator watermark if it advanced.
    /// Out-of-range inputs are ignored.
    pub fn update(&mut self, input: usize, watermark: i64) -> Option<i64> {
        let state = self.inputs.get_mut(input)?;
        *state = match *state {
            InputState::Active(w) | InputState::Idle(w) => InputState::Active(w.max(watermark)),
            InputState::Finished => InputState::Finished,
        };
        self.recompute()
    }

    /// Marks an input idle: it stops holding back the minimum until it sends a watermark again.
    pub fn mark_idle(&mut self, input: usize) -> Option<i64> {
        if let Some(state) = self.inputs.get_mut(input)
            && let InputState::Active(w) = *state
        {
            *state = InputState::Idle(w);
        }
        self.recompute()
    }

    /// Marks an input finished (+inf for good).
    pub fn mark_finished(&mut self, input: usize) -> Option<i64> {
        if let Some(state) = self.inputs.get_mut(input) {
            *state = InputState::Finished;
        }
        self.recompute()
    }

    fn recompute(&mut self) -> Option<i64> {
        let mut min = MAX_WATERMARK;
        let mut any_active = false;
        for s in &self.inputs {
            if let InputState::Active(w) = s {
                any_active = true;
                min = min.min(*w);
            }
        }
        // All inputs idle (but not all finished): hold the watermark where it is.
        let all_finished = self.inputs.iter().all(|s| *s == InputState::Finished);
        if !any_active && !all_finished {
            return None;
        }
        if min > self.current {
            self.current = min;
            Some(min)
        } else {
            None
        }
    }
}

/// What one source partition contributes to its subtask's watermark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionProgress {
    /// The partition's own watermark ([`PartitionWatermark::watermark`]).
    pub watermark: i64,
    /// No record will ever come (a bounded partition at its end).
    pub finished: bool,
    /// No record came for the source's idle timeout.
    pub idle: bool,
}

/// A source subtask's watermark over its partitions: the slowest of those neither finished nor
/// idle; when every unfinished partition is idle, the most advanced of them (an idle partition
/// does not hold the others back, and the subtask's watermark never waits on idleness alone);
/// [`MAX_WATERMARK`] when every partition is finished or there are none. Pure.
pub fn source_watermark(parts: impl IntoIterator<Item = PartitionProgress>) -> i64 {
    let mut active: Option<i64> = None;
    let mut idle: Option<i64> = None;
    for p in parts {
        if p.finished {
            continue;
        }
        if p.idle {
            idle = Some(idle.map_or(p.watermark, |w| w.max(p.watermark)));
        } else {
            active = Some(active.map_or(p.watermark, |w| w.min(p.watermark)));
        }
    }
    active.or(idle).unwrap_or(MAX_WATERMARK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_watermark_lags_max_ts() {
        let mut p = PartitionWatermark::new(2000);
        assert_eq!(p.watermark(), MIN_WATERMARK);
        p.observe(10_000);
        p.observe(9_000);
        assert_eq!(p.watermark(), 8_000);
        p.observe(i64::MIN);
        assert_eq!(p.watermark(), 8_000);
    }

    #[test]
    fn tracker_is_min_over_inputs_and_monotonic() {
        let mut t = WatermarkTracker::new(3);
        assert_eq!(t.update(0, 100), None, "others still at -inf");
        assert_eq!(t.update(1, 50), None);
        assert_eq!(t.update(2, 70), Some(50));
        assert_eq!(t.update(1, 200), Some(70));
        assert_eq!(t.update(1, 10), None, "input watermark never goes back");
        assert_eq!(t.current(), 70);
        // Idle input 2 no longer holds back; becomes active again on its next watermark.
        assert_eq!(t.mark_idle(2), Some(100));
        assert_eq!(t.update(2, 80), None, "operator watermark stays monotonic");
        assert_eq!(t.current(), 100);
        // min(300, 200, 80) = 80 is below the current 100: hold.
        assert_eq!(t.update(0, 300), None);
        assert_eq!(t.update(2, 250), Some(200));
    }

    #[test]
    fn finished_inputs_count_as_infinity() {
        let mut t = WatermarkTracker::new(2);
        t.update(0, 5);
        assert_eq!(t.mark_finished(1), Some(5));
        assert_eq!(t.mark_finished(0), Some(MAX_WATERMARK));
        let mut idle = WatermarkTracker::new(1);
        assert_eq!(idle.mark_idle(0), None, "all idle holds the watermark");
        let r = WatermarkTracker::restored(2, 1000);
        assert_eq!(r.current(), 1000);
    }

    #[test]
    fn idle_partitions_do_not_hold_the_source_back() {
        let p = |watermark, finished, idle| PartitionProgress {
            watermark,
            finished,
            idle,
        };
        assert_eq!(source_watermark([]), MAX_WATERMARK);
        assert_eq!(source_watermark([p(5, true, false)]), MAX_WATERMARK);
        assert_eq!(
            source_watermark([p(5, false, false), p(9, false, false)]),
            5,
            "the slowest active partition"
        );
        assert_eq!(
            source_watermark([p(MIN_WATERMARK, false, true), p(9, false, false)]),
            9,
            "a partition that never had a record, idle, holds nothing back"
        );
        assert_eq!(
            source_watermark([p(3, false, true), p(7, false, true), p(1, true, false)]),
            7,
            "all idle: the most advanced"
        );
        assert_eq!(
            source_watermark([p(MIN_WATERMARK, false, true)]),
            MIN_WATERMARK
        );
    }
}
