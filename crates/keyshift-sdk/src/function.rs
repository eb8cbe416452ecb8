//! A keyed step's logic: the [`KeyedProcessFunction`] an author implements, and the
//! [`Context`] it works through (the current key, its state, timers, clocks, and output).

use crate::error::{Error, Result, StateError};
use crate::key::{RecordKey, StreamKey};
use crate::operator_state::{
    Broadcast, BroadcastHandle, OperatorList, OperatorListHandle, OperatorStates,
};
use crate::state::{
    AggregateFunction, AggregatingHandle, AggregatingState, DeclarationError, Declarations,
    KeyScope, ListHandle, ListState, MapHandle, MapState, ReducingHandle, ReducingState,
    TimeDomain, ValueHandle, ValueState,
};
use crate::timers::Timers;
use std::cell::OnceCell;

/// A record without an event time reached a step that works in event time (a window, a join).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{step} got a record without an event time")]
pub struct NoEventTime {
    /// What needed it, in words ("an event-time session window").
    pub step: &'static str,
}

/// A timer that fired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timer {
    /// The time it was registered for.
    pub timestamp: i64,
    pub domain: TimeDomain,
}

/// The logic of a keyed step (Flink's `KeyedProcessFunction`): called once per record with that
/// record's key in scope, and once per timer that fires. Everything it keeps between calls
/// lives in its declared state, which moves with its key's group; fields of the function itself
/// are not saved.
pub trait KeyedProcessFunction: Send + 'static {
    /// The key the step's input is keyed by.
    type Key: StreamKey;
    /// The records it reads.
    type In;
    /// The records it emits.
    type Out;
    /// The handles of its declared states.
    type State: Send + 'static;

    /// Declares the function's states (once per operator, before any record). The names, kinds,
    /// versions, serializers and TTLs are the state's identity in snapshots.
    fn declare(&self, states: &mut Declarations) -> Result<Self::State, DeclarationError>;

    /// Handles one record of the key in `ctx`.
    fn process(
        &mut self,
        value: Self::In,
        state: &Self::State,
        ctx: &mut Context<'_, Self::Key, Self::Out>,
    ) -> Result<()>;

    /// Handles a timer of the key in `ctx` (registered with `ctx.register_*_timer`). Each
    /// registered timer fires exactly once, also across checkpoints, rescales and restores.
    fn on_timer(
        &mut self,
        timer: Timer,
        state: &Self::State,
        ctx: &mut Context<'_, Self::Key, Self::Out>,
    ) -> Result<()> {
        let _ = (timer, state, ctx);
        Ok(())
    }
}

/// What a keyed function sees of the key it is called for.
pub struct Context<'a, K, O> {
    pub(crate) scope: KeyScope<'a>,
    pub(crate) key: KeyArg<'a, K>,
    pub(crate) timers: &'a mut Timers,
    pub(crate) out: &'a mut Vec<(i64, O)>,
    /// The subtask's operator state (whatever key is in scope).
    pub(crate) operator: &'a mut OperatorStates,
}

/// The key a [`Context`] is for: built already, or built from the record's key the first time
/// the function asks for it.
pub(crate) enum KeyArg<'a, K> {
    Built(&'a K),
    /// `record_key` is of `K`'s kind and `K` is [`StreamKey::BUILT_ON_DEMAND`]: the conversion
    /// cannot refuse it.
    OnDemand {
        record_key: &'a RecordKey,
        built: &'a OnceCell<K>,
    },
}

impl<'a, K: StreamKey, O> Context<'a, K, O> {
    /// The key.
    pub fn key(&self) -> &K {
        match &self.key {
            KeyArg::Built(k) => k,
            KeyArg::OnDemand { record_key, built } => built.get_or_init(|| {
                match K::from_record_key(record_key) {
                    Some(k) => k,
                    // The step checked the key's kind, and `K` promised to take every key of
                    // its kind (`BUILT_ON_DEMAND`).
                    None => unreachable!(
                        "StreamKey::BUILT_ON_DEMAND is true but from_record_key refused {record_key}"
                    ),
                }
            }),
        }
    }
}

impl<'a, K, O> Context<'a, K, O> {
    /// The event time of the record (or of the timer) being handled, if it has one.
    pub fn timestamp(&self) -> Option<i64> {
        self.scope.timestamp
    }

    /// The event time of the record (or timer) being handled, for a step that works in event
    /// time (`step`, in words, names it in the error when there is none: [`NoEventTime`]).
    pub fn event_time(&self, step: &'static str) -> Result<i64> {
        self.timestamp()
            .ok_or_else(|| Error::user(NoEventTime { step }))
    }

    /// The operator's event-time watermark: no record at or before it is expected.
    pub fn current_watermark(&self) -> i64 {
        self.scope.watermark
    }

    /// The worker's clock, in ms since the epoch, as the operator last read it.
    pub fn current_processing_time(&self) -> i64 {
        self.scope.processing_time
    }

    /// The key's value state.
    pub fn value<'s, T>(&'s mut self, h: &'s ValueHandle<T>) -> ValueState<'s, 'a, T> {
        ValueState {
            scope: &mut self.scope,
            handle: h,
        }
    }

    /// The key's map state.
    pub fn map<'s, MK, V>(&'s mut self, h: &'s MapHandle<MK, V>) -> MapState<'s, 'a, MK, V> {
        MapState {
            scope: &mut self.scope,
            handle: h,
        }
    }

    /// The key's list state.
    pub fn list<'s, T>(&'s mut self, h: &'s ListHandle<T>) -> ListState<'s, 'a, T> {
        ListState {
            scope: &mut self.scope,
            handle: h,
        }
    }

    /// The key's reducing state.
    pub fn reducing<'s, T>(&'s mut self, h: &'s ReducingHandle<T>) -> ReducingState<'s, 'a, T> {
        ReducingState {
            scope: &mut self.scope,
            handle: h,
        }
    }

    /// The key's aggregating state.
    pub fn aggregating<'s, A: AggregateFunction>(
        &'s mut self,
        h: &'s AggregatingHandle<A>,
    ) -> AggregatingState<'s, 'a, A> {
        AggregatingState {
            scope: &mut self.scope,
            handle: h,
        }
    }

    /// The subtask's operator list state (not the key's: every key of the subtask sees the
    /// same entries; see [`crate::operator_state`]).
    pub fn operator_list<'s, T>(&'s mut self, h: &'s OperatorListHandle<T>) -> OperatorList<'s, T> {
        OperatorList {
            states: self.operator,
            handle: h,
        }
    }

    /// The subtask's copy of a broadcast state.
    pub fn broadcast<'s, T>(&'s mut self, h: &'s BroadcastHandle<T>) -> Broadcast<'s, T> {
        Broadcast {
            states: self.operator,
            handle: h,
        }
    }

    /// Calls `on_timer` for this key once the watermark reaches `timestamp` (once, however
    /// often it is registered).
    pub fn register_event_time_timer(&mut self, timestamp: i64) -> Result<(), StateError> {
        self.timers
            .register(&mut self.scope, TimeDomain::EventTime, timestamp)
    }

    /// Calls `on_timer` for this key once the worker's clock reaches `timestamp`.
    pub fn register_processing_time_timer(&mut self, timestamp: i64) -> Result<(), StateError> {
        self.timers
            .register(&mut self.scope, TimeDomain::ProcessingTime, timestamp)
    }

    /// Cancels this key's event-time timer at `timestamp`, if registered.
    pub fn delete_event_time_timer(&mut self, timestamp: i64) -> Result<(), StateError> {
        self.timers
            .delete(&mut self.scope, TimeDomain::EventTime, timestamp)
    }

    /// Cancels this key's processing-time timer at `timestamp`, if registered.
    pub fn delete_processing_time_timer(&mut self, timestamp: i64) -> Result<(), StateError> {
        self.timers
            .delete(&mut self.scope, TimeDomain::ProcessingTime, timestamp)
    }

    /// Emits `value` with the event time of the record or timer being handled (the watermark
    /// if it has none).
    pub fn emit(&mut self, value: O) {
        let ts = self.scope.timestamp.unwrap_or(self.scope.watermark);
        self.out.push((ts, value));
    }

    /// Emits `value` with event time `timestamp`.
    pub fn emit_at(&mut self, value: O, timestamp: i64) {
        self.out.push((timestamp, value));
    }
}
