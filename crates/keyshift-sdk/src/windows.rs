//! Windows over a keyed stream, built from keyed state and event-time timers only, so that
//! everything keyshift does with a key group (incremental checkpoints, restore, rescale,
//! pre-staging, the key-group ceiling change) carries them exactly, as it does any function's
//! state.
//!
//! [`EventTimeSessions`]: gap-based session windows in event time (Flink's
//! `EventTimeSessionWindows` with an aggregate): a key's records at most a gap apart form one
//! session; a record that bridges two sessions merges them. A session closes once the
//! watermark passes its end, and is emitted once, as a [`Session`].
//!
//! A session's records belong together, and they do because they share a key: keyed by the
//! entity whose sessions they are (a user, a device), a session is in one key group and moves
//! as one. Keyed by anything finer, a session is split over keys and never merges.

use crate::error::Result;
use crate::function::{Context, KeyedProcessFunction, Timer};
use crate::key::StreamKey;
use crate::state::{
    AggregateFunction, DeclarationError, Declarations, MapHandle, MapStateDescriptor,
};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

/// An aggregate whose accumulators also merge (Flink's `AggregateFunction.merge`): what a
/// session keeps when a record joins two sessions into one.
pub trait MergingAggregate: AggregateFunction {
    /// The accumulator of `a`'s and `b`'s records together.
    fn merge(&self, a: Self::Acc, b: Self::Acc) -> Self::Acc;
}

/// A closed session of one key: its first record's event time, its end (the last record's event
/// time plus the gap; exclusive, as Flink's `TimeWindow`), and the aggregate of its records.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Session<K, R> {
    pub key: K,
    pub start: i64,
    pub end: i64,
    pub result: R,
}

/// An open session as its key's state keeps it (by its start, in a map state).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OpenSession<A> {
    pub end: i64,
    pub acc: A,
}

pub use crate::function::NoEventTime;

/// Gap-based session windows in event time over each key's records, folded with `A`.
///
/// Its state is one map per key, `sessions`, from each open session's start to its end and
/// accumulator, and one event-time timer per open session, at its last millisecond (`end - 1`).
/// A record whose session would have closed already (its merged session ends at or before the
/// watermark) is late: it is dropped and changes nothing, as in Flink without allowed
/// lateness.
pub struct EventTimeSessions<K, A> {
    gap_ms: i64,
    agg: Arc<A>,
    _key: PhantomData<fn() -> K>,
}

impl<K, A> EventTimeSessions<K, A> {
    /// Sessions of records at most `gap` apart, folded with `agg`. A gap under a millisecond
    /// counts as one millisecond.
    pub fn new(gap: Duration, agg: A) -> Self {
        EventTimeSessions {
            gap_ms: i64::try_from(gap.as_millis()).unwrap_or(i64::MAX).max(1),
            agg: Arc::new(agg),
            _key: PhantomData,
        }
    }

    /// The gap, in ms.
    pub fn gap_ms(&self) -> i64 {
        self.gap_ms
    }
}

impl<K, A> Clone for EventTimeSessions<K, A> {
    fn clone(&self) -> Self {
        EventTimeSessions {
            gap_ms: self.gap_ms,
            agg: Arc::clone(&self.agg),
            _key: PhantomData,
        }
    }
}

/// The name of the sessions' map state (what the savepoint tools show).
pub const SESSIONS_STATE: &str = "sessions";

impl<K, A> KeyedProcessFunction for EventTimeSessions<K, A>
where
    K: StreamKey + Clone + Send + 'static,
    A: MergingAggregate,
    A::In: Send + 'static,
    A::Acc: Clone + Send + Serialize + DeserializeOwned + 'static,
    A::Out: Send + 'static,
{
    type Key = K;
    type In = A::In;
    type Out = Session<K, A::Out>;
    type State = MapHandle<i64, OpenSession<A::Acc>>;

    fn declare(&self, states: &mut Declarations) -> Result<Self::State, DeclarationError> {
        states.map(MapStateDescriptor::new(SESSIONS_STATE))
    }

    fn process(
        &mut self,
        value: A::In,
        sessions: &Self::State,
        ctx: &mut Context<'_, K, Self::Out>,
    ) -> Result<()> {
        let ts = ctx.event_time("an event-time session window")?;
        let mut start = ts;
        let mut end = ts.saturating_add(self.gap_ms);
        // The sessions this record touches (Flink's `TimeWindow.intersects`: ends count, so a
        // record exactly a gap after a session's last joins it). Open sessions never touch
        // each other, so one pass over them finds every session the merged one covers.
        let touched: Vec<(i64, OpenSession<A::Acc>)> = ctx
            .map(sessions)
            .entries()?
            .into_iter()
            .filter(|(s, open)| *s <= end && open.end >= start)
            .collect();
        for (s, open) in &touched {
            start = start.min(*s);
            end = end.max(open.end);
        }
        if end - 1 <= ctx.current_watermark() {
            // Late: its session closed (or would have) already.
            return Ok(());
        }
        let mut acc = self.agg.add(value, self.agg.create());
        for (s, open) in touched {
            acc = self.agg.merge(open.acc, acc);
            ctx.map(sessions).remove(&s)?;
            ctx.delete_event_time_timer(open.end - 1)?;
        }
        ctx.map(sessions).insert(&start, OpenSession { end, acc })?;
        ctx.register_event_time_timer(end - 1)?;
        Ok(())
    }

    fn on_timer(
        &mut self,
        timer: Timer,
        sessions: &Self::State,
        ctx: &mut Context<'_, K, Self::Out>,
    ) -> Result<()> {
        let closing = ctx
            .map(sessions)
            .entries()?
            .into_iter()
            .find(|(_, open)| open.end - 1 == timer.timestamp);
        if let Some((start, open)) = closing {
            ctx.map(sessions).remove(&start)?;
            let session = Session {
                key: ctx.key().clone(),
                start,
                end: open.end,
                result: self.agg.result(&open.acc),
            };
            ctx.emit_at(session, timer.timestamp);
        }
        Ok(())
    }
}

/// The result of one key's tumbling event-time window: its start (inclusive), its end
/// (exclusive) and the aggregate of its records.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct WindowResult<K, R> {
    pub key: K,
    pub start: i64,
    pub end: i64,
    pub result: R,
}

/// Records of one key and one tumbling window folded into an accumulator: what a
/// [`TumblingWindows`] step takes in, made before the shuffle (one per record, or one per key
/// and window of a batch when the source combines: `KeyedStream::window_aggregate`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Partial<A> {
    /// The window's start.
    pub start: i64,
    /// The accumulator of the records.
    pub acc: A,
}

pub use keyshift_core::window::window_start;

/// The name of the tumbling windows' map state (what the savepoint tools show).
pub const WINDOWS_STATE: &str = "windows";

/// Tumbling event-time windows over each key's [`Partial`]s, merged with `A`: a window fires
/// once, when the watermark passes its last millisecond, as a [`WindowResult`] at that time.
///
/// Its state is one map per key, `windows`, from each open window's start to its accumulator,
/// and one event-time timer per open window. A partial whose window has fired is late: dropped,
/// as in Flink without allowed lateness.
pub struct TumblingWindows<K, A> {
    size_ms: i64,
    agg: Arc<A>,
    _key: PhantomData<fn() -> K>,
}

impl<K, A> TumblingWindows<K, A> {
    /// Windows of `size` (at least a millisecond), merged with `agg`.
    pub fn new(size: Duration, agg: Arc<A>) -> Self {
        TumblingWindows {
            size_ms: i64::try_from(size.as_millis()).unwrap_or(i64::MAX).max(1),
            agg,
            _key: PhantomData,
        }
    }

    /// The windows' length, in ms.
    pub fn size_ms(&self) -> i64 {
        self.size_ms
    }
}

impl<K, A> Clone for TumblingWindows<K, A> {
    fn clone(&self) -> Self {
        TumblingWindows {
            size_ms: self.size_ms,
            agg: Arc::clone(&self.agg),
            _key: PhantomData,
        }
    }
}

impl<K, A> KeyedProcessFunction for TumblingWindows<K, A>
where
    K: StreamKey + Clone + Send + 'static,
    A: MergingAggregate,
    A::Acc: Clone + Send + Serialize + DeserializeOwned + 'static,
    A::Out: Send + 'static,
{
    type Key = K;
    type In = Partial<A::Acc>;
    type Out = WindowResult<K, A::Out>;
    type State = MapHandle<i64, A::Acc>;

    fn declare(&self, states: &mut Declarations) -> Result<Self::State, DeclarationError> {
        states.map(MapStateDescriptor::new(WINDOWS_STATE))
    }

    fn process(
        &mut self,
        partial: Partial<A::Acc>,
        windows: &Self::State,
        ctx: &mut Context<'_, K, Self::Out>,
    ) -> Result<()> {
        let last = partial.start.saturating_add(self.size_ms - 1);
        if last <= ctx.current_watermark() {
            // Late: its window fired already.
            return Ok(());
        }
        let acc = match ctx.map(windows).get(&partial.start)? {
            Some(open) => self.agg.merge(open, partial.acc),
            None => {
                ctx.register_event_time_timer(last)?;
                partial.acc
            }
        };
        ctx.map(windows).insert(&partial.start, acc)?;
        Ok(())
    }

    fn on_timer(
        &mut self,
        timer: Timer,
        windows: &Self::State,
        ctx: &mut Context<'_, K, Self::Out>,
    ) -> Result<()> {
        let start = timer.timestamp.saturating_sub(self.size_ms - 1);
        if let Some(acc) = ctx.map(windows).get(&start)? {
            ctx.map(windows).remove(&start)?;
            let window = WindowResult {
                key: ctx.key().clone(),
                start,
                end: start.saturating_add(self.size_ms),
                result: self.agg.result(&acc),
            };
            ctx.emit_at(window, timer.timestamp);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::operator::KeyedOperator;
    use keyshift_core::keygroup::KeyGroupRange;

    /// Counts a session's records.
    struct Count;

    impl AggregateFunction for Count {
        type In = ();
        type Acc = u64;
        type Out = u64;
        fn create(&self) -> u64 {
            0
        }
        fn add(&self, _: (), acc: u64) -> u64 {
            acc + 1
        }
        fn result(&self, acc: &u64) -> u64 {
            *acc
        }
    }

    impl MergingAggregate for Count {
        fn merge(&self, a: u64, b: u64) -> u64 {
            a + b
        }
    }

    const ALL: KeyGroupRange = KeyGroupRange { start: 0, end: 127 };

    fn op() -> KeyedOperator<EventTimeSessions<String, Count>> {
        let f = EventTimeSessions::new(Duration::from_millis(10), Count);
        KeyedOperator::new("sessions", f, 128, ALL).unwrap()
    }

    fn sessions(op: &mut KeyedOperator<EventTimeSessions<String, Count>>) -> Vec<(i64, i64, u64)> {
        op.take_output()
            .into_iter()
            .map(|(_, s)| (s.start, s.end, s.result))
            .collect()
    }

    #[test]
    fn records_a_gap_apart_form_one_session_and_a_bridge_merges_two() {
        let mut op = op();
        let k = "u".to_owned();
        for ts in [0, 5, 25, 33] {
            op.process(&k, ts, ()).unwrap();
        }
        // Two sessions so far, [0, 15) and [25, 43); a record at 15 ([15, 25)) touches both
        // ends, and the three become one.
        op.process(&k, 15, ()).unwrap();
        op.advance_watermark(1_000).unwrap();
        assert_eq!(sessions(&mut op), vec![(0, 43, 5)]);
        assert_eq!(op.entries(), 0, "closed sessions leave the state");
    }

    #[test]
    fn a_session_closes_once_the_watermark_passes_its_end_and_a_late_record_changes_nothing() {
        let mut op = op();
        let k = "u".to_owned();
        op.process(&k, 100, ()).unwrap();
        op.advance_watermark(108).unwrap();
        assert_eq!(sessions(&mut op), vec![]);
        op.advance_watermark(109).unwrap();
        assert_eq!(sessions(&mut op), vec![(100, 110, 1)]);
        // Its session would end at 105, long behind the watermark: dropped.
        op.process(&k, 95, ()).unwrap();
        op.advance_watermark(2_000).unwrap();
        assert_eq!(sessions(&mut op), vec![]);
        assert_eq!(op.entries(), 0);
    }

    #[test]
    fn a_tumbling_window_merges_its_partials_and_fires_once_at_its_end() {
        let f = TumblingWindows::<String, Count>::new(Duration::from_millis(10), Arc::new(Count));
        let mut op = KeyedOperator::new("windows", f, 128, ALL).unwrap();
        let k = "u".to_owned();
        for (ts, start, acc) in [(3, 0, 2), (9, 0, 5), (12, 10, 1), (-1, -10, 1)] {
            op.process(&k, ts, Partial { start, acc }).unwrap();
        }
        op.advance_watermark(8).unwrap();
        let fired: Vec<_> = op.take_output();
        assert_eq!(
            fired
                .iter()
                .map(|(t, w)| (*t, w.start, w.end, w.result))
                .collect::<Vec<_>>(),
            vec![(-1, -10, 0, 1)]
        );
        op.advance_watermark(9).unwrap();
        let fired: Vec<_> = op.take_output().into_iter().map(|(_, w)| w).collect();
        assert_eq!(
            fired,
            vec![WindowResult {
                key: k.clone(),
                start: 0,
                end: 10,
                result: 7
            }]
        );
        // Window [0, 10) fired: a partial of it is late and changes nothing.
        op.process(&k, 9, Partial { start: 0, acc: 4 }).unwrap();
        op.advance_watermark(100).unwrap();
        let fired: Vec<_> = op
            .take_output()
            .into_iter()
            .map(|(_, w)| (w.start, w.result))
            .collect();
        assert_eq!(fired, vec![(10, 1)]);
        assert_eq!(op.entries(), 0, "fired windows leave the state");
        assert_eq!(window_start(-1, 10), -10);
        assert_eq!(window_start(i64::MIN + 1, 10), i64::MIN);
    }

    #[test]
    fn a_record_without_an_event_time_is_refused() {
        struct NoTime;
        impl KeyedProcessFunction for NoTime {
            type Key = String;
            type In = ();
            type Out = Session<String, u64>;
            type State = MapHandle<i64, OpenSession<u64>>;
            fn declare(&self, s: &mut Declarations) -> Result<Self::State, DeclarationError> {
                EventTimeSessions::<String, Count>::new(Duration::from_millis(1), Count).declare(s)
            }
            fn process(
                &mut self,
                v: (),
                st: &Self::State,
                ctx: &mut Context<'_, String, Self::Out>,
            ) -> Result<()> {
                ctx.scope.timestamp = None;
                EventTimeSessions::<String, Count>::new(Duration::from_millis(1), Count)
                    .process(v, st, ctx)
            }
        }
        let mut op = KeyedOperator::new("s", NoTime, 128, ALL).unwrap();
        let err = op.process(&"u".to_owned(), 0, ()).unwrap_err();
        assert!(err.to_string().contains("without an event time"), "{err}");
    }
}
