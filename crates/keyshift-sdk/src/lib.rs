//! keyshift's job SDK: write a keyed dataflow in Rust and run it on keyshift's state machinery.
//!
//! A job reads records, transforms them without state, keys them (`key_by`: a shuffle by key
//! group), and runs a keyed step: a [`KeyedProcessFunction`] called once per record with that
//! record's key in scope. Everything a keyed step keeps lives in its declared state (value, map,
//! list, reducing, aggregating; optionally with a TTL) and its timers, per key, and therefore
//! per key group: the unit keyshift snapshots incrementally, restores by range, moves on a
//! rescale and re-hashes on a key-group ceiling change. Fields of the function itself are not
//! saved.
//!
//! ```
//! use keyshift_sdk::prelude::*;
//!
//! /// Emits each event id the first time it is seen within an hour of event time.
//! struct Dedup;
//!
//! impl KeyedProcessFunction for Dedup {
//!     type Key = String;
//!     type In = String;
//!     type Out = String;
//!     type State = ValueHandle<bool>;
//!
//!     fn declare(&self, states: &mut Declarations) -> Result<Self::State, DeclarationError> {
//!         states.value(
//!             ValueStateDescriptor::new("seen").ttl(Ttl::event_time(std::time::Duration::from_secs(3600))),
//!         )
//!     }
//!
//!     fn process(&mut self, event: String, seen: &Self::State, ctx: &mut Context<'_, String, String>) -> keyshift_sdk::Result<()> {
//!         if ctx.value(seen).get()?.is_none() {
//!             ctx.value(seen).set(true)?;
//!             ctx.emit(event);
//!         }
//!         Ok(())
//!     }
//! }
//!
//! let range = keyshift_sdk::KeyGroupRange { start: 0, end: 127 };
//! let mut op = KeyedOperator::new("dedup", Dedup, 128, range).unwrap();
//! op.process(&"e1".to_string(), 1_000, "e1".to_string()).unwrap();
//! op.process(&"e1".to_string(), 2_000, "e1".to_string()).unwrap();
//! assert_eq!(op.take_output(), vec![(1_000, "e1".to_string())]);
//! ```
//!
//! The pieces:
//! * [`function`]: the keyed function and its [`Context`] (state, timers, clocks, output).
//! * [`state`]: state declarations, handles and views; [`state::backend`] the byte-addressed
//!   store beneath them (the heap backend; a disk backend implements the same interface).
//! * [`dataflow`]: a whole job: a JSON-lines source, stateless steps, keyed steps, a sink.
//! * [`operator`]: one subtask's instance of a keyed step, and its snapshot side;
//!   [`step`] the same with its types erased, as the worker runtime drives it.
//! * [`block`]: the key-group block a snapshot stores.
//! * [`testing`]: a harness that runs a keyed step over several subtasks in one process,
//!   checkpoints, restores and rescales it, for a job's own tests; and [`testing::run_job`],
//!   a whole job over input lines.
//! * [`key`], [`serializer`], [`error`].

pub mod block;
pub mod dataflow;
pub mod error;
pub mod function;
pub mod join;
pub mod key;
pub mod operator;
pub mod operator_state;
pub mod serializer;
pub mod state;
pub mod step;
pub mod testing;
mod timers;
pub mod windows;

pub use error::{BlockError, Error, Result, StateError};
pub use function::{Context, KeyedProcessFunction, Timer};
pub use keyshift_core::keygroup::KeyGroupRange;
pub use operator::KeyedOperator;

/// What a job author imports.
pub mod prelude {
    pub use crate::dataflow::Job;
    pub use crate::function::{Context, KeyedProcessFunction, Timer};
    pub use crate::join::{IntervalJoin, JoinInput, TemporalJoin};
    pub use crate::operator::KeyedOperator;
    pub use crate::operator_state::{
        BroadcastHandle, BroadcastStateDescriptor, OperatorListHandle, OperatorListStateDescriptor,
        Redistribution,
    };
    pub use crate::serializer::{Json, Postcard, Serializer};
    pub use crate::state::{
        AggregateFunction, AggregatingHandle, AggregatingStateDescriptor, DeclarationError,
        Declarations, ListHandle, ListStateDescriptor, MapHandle, MapStateDescriptor,
        ReducingHandle, ReducingStateDescriptor, TimeDomain, Ttl, ValueHandle,
        ValueStateDescriptor,
    };
    pub use crate::windows::{
        EventTimeSessions, MergingAggregate, Partial, Session, TumblingWindows, WindowResult,
    };
}
