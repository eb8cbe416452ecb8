//! Keyed two-input joins, built from keyed state and event-time timers only (as
//! [`crate::windows`]), so that every snapshot, restore, rescale and key-group ceiling change
//! carries both sides' buffers exactly.
//!
//! A join's two inputs reach one keyed step as one stream of [`JoinInput`]s (map each source's
//! records to its side before `key_by`), keyed by the join key: both sides of a key are then in
//! the same key group, and move together. Keyed by anything else, a pair would be split across
//! subtasks and never meet.
//!
//! * [`IntervalJoin`]: each left record with each right record of its key whose event time lies
//!   within `[left + lower, left + upper]` (Flink's interval join).
//! * [`TemporalJoin`]: each left record with the version of a slowly changing table (the right
//!   side: rows by key, each valid from its event time on) that was current at the left
//!   record's event time (Flink's event-time temporal table join). Deterministic whatever the
//!   arrival order, because it waits for the watermark.
//!
//! Records behind the watermark are late and dropped, as in Flink.

use crate::error::Result;
use crate::function::{Context, KeyedProcessFunction, Timer};
use crate::key::StreamKey;
use crate::state::{DeclarationError, Declarations, MapHandle, MapStateDescriptor};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::marker::PhantomData;
use std::time::Duration;

/// A record of a two-input step: from its left input or its right one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum JoinInput<L, R> {
    Left(L),
    Right(R),
}

pub use crate::function::NoEventTime;

/// An interval join's bounds leave no time between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "an interval join's lower bound ({lower} ms) is after its upper bound ({upper} ms): no record could match"
)]
pub struct EmptyInterval {
    pub lower: i64,
    pub upper: i64,
}

fn event_time<K, O>(ctx: &Context<'_, K, O>) -> Result<i64> {
    ctx.event_time("an event-time join")
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The types a join is for (it holds none of them).
type Types<K, L, R, O> = PhantomData<fn() -> (K, L, R, O)>;

/// The names of an [`IntervalJoin`]'s buffers (what the savepoint tools show).
pub const LEFT_BUFFER: &str = "left";
/// See [`LEFT_BUFFER`].
pub const RIGHT_BUFFER: &str = "right";

/// Joins each left record with each right record of its key whose event time is within
/// `[left + lower, left + upper]`, emitting `join(&left, &right)` at the later of the two event
/// times.
///
/// State per key: two map states, `left` and `right`, from an event time to the records of
/// that time still able to match, and one event-time timer per buffered time, at which the
/// records of that time can match nothing more and leave (a left record once the watermark
/// reaches `left + upper`, a right one at `right - lower`).
pub struct IntervalJoin<K, L, R, O, F> {
    lower: i64,
    upper: i64,
    join: F,
    _types: Types<K, L, R, O>,
}

impl<K, L, R, O, F> IntervalJoin<K, L, R, O, F>
where
    F: Fn(&L, &R) -> O,
{
    /// Right records from `lower` before to `upper` after a left record's event time (negative
    /// offsets reach before it); refuses an empty interval (`lower` after `upper`).
    pub fn new(lower: i64, upper: i64, join: F) -> Result<Self, EmptyInterval> {
        if lower > upper {
            return Err(EmptyInterval { lower, upper });
        }
        Ok(IntervalJoin {
            lower,
            upper,
            join,
            _types: PhantomData,
        })
    }

    /// Right records from `before` before to `after` after each left record's event time.
    pub fn around(before: Duration, after: Duration, join: F) -> Self {
        IntervalJoin {
            lower: -millis(before),
            upper: millis(after),
            join,
            _types: PhantomData,
        }
    }
}

impl<K, L, R, O, F> KeyedProcessFunction for IntervalJoin<K, L, R, O, F>
where
    K: StreamKey,
    L: Clone + Send + Serialize + DeserializeOwned + 'static,
    R: Clone + Send + Serialize + DeserializeOwned + 'static,
    O: Send + 'static,
    F: Fn(&L, &R) -> O + Send + 'static,
{
    type Key = K;
    type In = JoinInput<L, R>;
    type Out = O;
    type State = (Buffer<L>, Buffer<R>);

    fn declare(&self, states: &mut Declarations) -> Result<Self::State, DeclarationError> {
        Ok((
            states.map(MapStateDescriptor::new(LEFT_BUFFER))?,
            states.map(MapStateDescriptor::new(RIGHT_BUFFER))?,
        ))
    }

    fn process(
        &mut self,
        input: JoinInput<L, R>,
        (left, right): &Self::State,
        ctx: &mut Context<'_, K, O>,
    ) -> Result<()> {
        let ts = event_time(ctx)?;
        if ts <= ctx.current_watermark() {
            return Ok(());
        }
        let (lower, upper) = (self.lower, self.upper);
        let join = &self.join;
        match input {
            // Right records at [ts + lower, ts + upper]; none after ts + upper can match.
            JoinInput::Left(l) => {
                let others = ts.saturating_add(lower)..=ts.saturating_add(upper);
                let until = ts.saturating_add(upper);
                probe_and_buffer(ctx, (left, right), l, ts, others, until, |l, r| join(l, r))?;
            }
            // Left records at [ts - upper, ts - lower]; none after ts - lower can match.
            JoinInput::Right(r) => {
                let others = ts.saturating_sub(upper)..=ts.saturating_sub(lower);
                let until = ts.saturating_sub(lower);
                probe_and_buffer(ctx, (right, left), r, ts, others, until, |r, l| join(l, r))?;
            }
        }
        Ok(())
    }

    fn on_timer(
        &mut self,
        timer: Timer,
        (left, right): &Self::State,
        ctx: &mut Context<'_, K, O>,
    ) -> Result<()> {
        // Left records of `t - upper` and right records of `t + lower` can match no record
        // still to come (those are after the watermark, which reached `t`).
        ctx.map(left)
            .remove(&timer.timestamp.saturating_sub(self.upper))?;
        ctx.map(right)
            .remove(&timer.timestamp.saturating_add(self.lower))?;
        Ok(())
    }
}

/// A buffer of one side of a join: records by event time.
type Buffer<T> = MapHandle<i64, Vec<T>>;

/// One record of an interval join, of the side whose buffer is `mine`: joined (by `join`) with
/// every buffered record of the other side whose time is in `others`, each pair emitted at the
/// later of its two times; then buffered itself until the watermark reaches `until`.
fn probe_and_buffer<K, Mine, Other, O>(
    ctx: &mut Context<'_, K, O>,
    (mine, other): (&Buffer<Mine>, &Buffer<Other>),
    record: Mine,
    ts: i64,
    others: std::ops::RangeInclusive<i64>,
    until: i64,
    join: impl Fn(&Mine, &Other) -> O,
) -> Result<()>
where
    Mine: Clone + Send + 'static,
    Other: Clone + Send + 'static,
{
    for (at, records) in ctx.map(other).entries()? {
        if others.contains(&at) {
            for o in &records {
                ctx.emit_at(join(&record, o), ts.max(at));
            }
        }
    }
    let mut buffered = ctx.map(mine).get(&ts)?.unwrap_or_default();
    buffered.push(record);
    ctx.map(mine).insert(&ts, buffered)?;
    ctx.register_event_time_timer(until)?;
    Ok(())
}

/// The names of a [`TemporalJoin`]'s states (what the savepoint tools show).
pub const WAITING: &str = "waiting";
/// See [`WAITING`].
pub const VERSIONS: &str = "versions";

/// Joins each left record with the row of a slowly changing table (the right input, one row per
/// key, each version valid from its event time on) that was current at the left record's event
/// time: `join(&left, Some(&row))`, or `join(&left, None)` when the key had no row yet. It
/// emits once the watermark reaches the left record's event time (so a version that arrives
/// late but in time counts), at that event time.
///
/// State per key: `waiting`, the left records by event time until the watermark reaches them
/// (one event-time timer per time), and `versions`, the table's rows by the event time they
/// became current, of which only those the watermark has not passed and the last before it
/// are kept.
pub struct TemporalJoin<K, L, R, O, F> {
    join: F,
    _types: Types<K, L, R, O>,
}

impl<K, L, R, O, F> TemporalJoin<K, L, R, O, F>
where
    F: Fn(&L, Option<&R>) -> O,
{
    pub fn new(join: F) -> Self {
        TemporalJoin {
            join,
            _types: PhantomData,
        }
    }
}

impl<K, L, R, O, F> KeyedProcessFunction for TemporalJoin<K, L, R, O, F>
where
    K: StreamKey,
    L: Clone + Send + Serialize + DeserializeOwned + 'static,
    R: Clone + Send + Serialize + DeserializeOwned + 'static,
    O: Send + 'static,
    F: Fn(&L, Option<&R>) -> O + Send + 'static,
{
    type Key = K;
    type In = JoinInput<L, R>;
    type Out = O;
    type State = (MapHandle<i64, Vec<L>>, MapHandle<i64, R>);

    fn declare(&self, states: &mut Declarations) -> Result<Self::State, DeclarationError> {
        Ok((
            states.map(MapStateDescriptor::new(WAITING))?,
            states.map(MapStateDescriptor::new(VERSIONS))?,
        ))
    }

    fn process(
        &mut self,
        input: JoinInput<L, R>,
        (waiting, versions): &Self::State,
        ctx: &mut Context<'_, K, O>,
    ) -> Result<()> {
        let ts = event_time(ctx)?;
        if ts <= ctx.current_watermark() {
            return Ok(());
        }
        match input {
            JoinInput::Left(l) => {
                let mut at = ctx.map(waiting).get(&ts)?.unwrap_or_default();
                at.push(l);
                ctx.map(waiting).insert(&ts, at)?;
                ctx.register_event_time_timer(ts)?;
            }
            JoinInput::Right(row) => {
                // A later version of the same time replaces the earlier one.
                ctx.map(versions).insert(&ts, row)?;
                // Kept until the watermark passes it, where the versions before it go.
                ctx.register_event_time_timer(ts)?;
            }
        }
        Ok(())
    }

    fn on_timer(
        &mut self,
        timer: Timer,
        (waiting, versions): &Self::State,
        ctx: &mut Context<'_, K, O>,
    ) -> Result<()> {
        let t = timer.timestamp;
        let mut all = ctx.map(versions).entries()?;
        all.sort_by_key(|(v, _)| *v);
        let current = all.iter().rev().find(|(v, _)| *v <= t);
        if let Some(ls) = ctx.map(waiting).get(&t)? {
            for l in &ls {
                let out = (self.join)(l, current.map(|(_, row)| row));
                ctx.emit_at(out, t);
            }
            ctx.map(waiting).remove(&t)?;
        }
        // Versions older than the one current at `t` can serve no record still to come.
        if let Some((current_at, _)) = current {
            for (v, _) in all.iter().filter(|(v, _)| v < current_at) {
                ctx.map(versions).remove(v)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::operator::KeyedOperator;
    use keyshift_core::keygroup::KeyGroupRange;

    const ALL: KeyGroupRange = KeyGroupRange { start: 0, end: 127 };

    #[test]
    fn an_interval_join_pairs_records_within_the_interval_and_forgets_them_after_it() {
        let join = IntervalJoin::new(-5, 10, |l: &i64, r: &i64| (*l, *r)).unwrap();
        let mut op: KeyedOperator<IntervalJoin<String, i64, i64, (i64, i64), _>> =
            KeyedOperator::new("join", join, 128, ALL).unwrap();
        let k = "k".to_owned();
        // Left 100 matches right in [95, 110].
        op.process(&k, 100, JoinInput::Left(100)).unwrap();
        for r in [94, 95, 110, 111] {
            op.process(&k, r, JoinInput::Right(r)).unwrap();
        }
        // A left record after the rights: 105 matches rights in [100, 115].
        op.process(&k, 105, JoinInput::Left(105)).unwrap();
        let mut got: Vec<(i64, i64)> = op.take_output().into_iter().map(|(_, p)| p).collect();
        got.sort();
        assert_eq!(got, vec![(100, 95), (100, 110), (105, 110), (105, 111)]);
        op.advance_watermark(1_000).unwrap();
        assert_eq!(op.entries(), 0, "every buffer and timer gone");
        // Late records change nothing.
        op.process(&k, 999, JoinInput::Left(999)).unwrap();
        assert_eq!(op.entries(), 0);
        assert!(IntervalJoin::<String, i64, i64, (), _>::new(1, 0, |_: &i64, _: &i64| ()).is_err());
    }

    #[test]
    fn a_temporal_join_takes_the_version_current_at_the_records_time_whatever_the_arrival_order() {
        let join =
            TemporalJoin::<String, _, _, _, _>::new(|l: &i64, r: Option<&String>| (*l, r.cloned()));
        let mut op = KeyedOperator::new("join", join, 128, ALL).unwrap();
        let k = "k".to_owned();
        op.process(&k, 5, JoinInput::Left(5)).unwrap();
        op.process(&k, 20, JoinInput::Left(20)).unwrap();
        // Versions arrive after the records they serve.
        op.process(&k, 10, JoinInput::Right("v10".into())).unwrap();
        op.process(&k, 3, JoinInput::Right("v3".into())).unwrap();
        op.process(&k, 15, JoinInput::Left(15)).unwrap();
        op.process(&k, 18, JoinInput::Right("v18".into())).unwrap();
        op.advance_watermark(100).unwrap();
        let got: Vec<(i64, Option<String>)> =
            op.take_output().into_iter().map(|(_, p)| p).collect();
        assert_eq!(
            got,
            vec![
                (5, Some("v3".into())),
                (15, Some("v10".into())),
                (20, Some("v18".into()))
            ]
        );
        // Only the version still current is kept.
        assert_eq!(op.entries(), 1);
        op.process(&k, 2, JoinInput::Left(2)).unwrap();
        assert_eq!(op.entries(), 1, "a late record is dropped");
    }
}
