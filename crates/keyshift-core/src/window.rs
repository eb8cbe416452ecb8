//! Tumbling event-time windows: which window a timestamp is in (the built-in aggregation's
//! windows, the SDK's `TumblingWindows`, and their combining before the shuffle).

/// The start of the tumbling window of `size` ms holding `ts` (aligned to the epoch; correct for
/// negative timestamps; a start below `i64::MIN` is clamped to it). `size` must be positive.
#[inline]
pub fn window_start(ts: i64, size: i64) -> i64 {
    ts.checked_sub(ts.rem_euclid(size)).unwrap_or(i64::MIN)
}
