//! A keyed step with its types erased: what the worker runtime (and the whole-job harness)
//! drives, whatever the author's key, record and state types. Records arrive as their key and
//! their serialized form (as they cross the key-group shuffle), and leave as values the next
//! stage of the dataflow takes.

use crate::block::EncodedBlock;
use crate::error::{BlockError, Error, Result, StateError};
use crate::function::KeyedProcessFunction;
use crate::key::{RecordKey, StreamKey};
use crate::operator::{KeyedOperator, READ_AHEAD};
use crate::operator_state::OperatorStates;
use crate::serializer::{Postcard, Serializer};
use crate::state::backend::GroupMode;
use crate::state::heap::ReadAhead;
use crate::state::{Declaration, DeclarationError};
use keyshift_core::keygroup::KeyGroupRange;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::any::Any;

/// A value between two stages of a dataflow.
pub type Value = Box<dyn Any + Send>;

/// A record crossing the key-group shuffle to a keyed step: its key (with its Java hash, as the
/// shuffle routed it), that key's group, its event time and its serialized form.
#[derive(Debug, Clone)]
pub struct Routed<'a> {
    pub key: RecordKey,
    pub group: u32,
    pub timestamp: i64,
    pub record: &'a [u8],
}

/// One subtask's instance of a keyed step, its types erased.
pub trait KeyedStep: Send {
    /// The step's uid.
    fn uid(&self) -> &str;
    /// Its declared states.
    fn declarations(&self) -> &[Declaration];
    /// The key groups it owns.
    fn range(&self) -> KeyGroupRange;
    /// Handles a batch of records routed to this subtask, in order, reading the state of their
    /// keys ahead ([`KeyedOperator::prefetch`], [`READ_AHEAD`] records at a time).
    fn process_batch(&mut self, batch: &[Routed<'_>]) -> Result<()>;
    /// Handles one record already in memory (a stage chained without a shuffle).
    fn process_value(&mut self, key: &RecordKey, timestamp: i64, record: Value) -> Result<()>;
    /// See [`KeyedOperator::advance_watermark`].
    fn advance_watermark(&mut self, watermark: i64) -> Result<()>;
    /// See [`KeyedOperator::advance_processing_time`].
    fn advance_processing_time(&mut self, now: i64) -> Result<()>;
    /// The event-time watermark.
    fn watermark(&self) -> i64;
    /// Takes what was emitted so far, as (event time, value).
    fn take_output(&mut self) -> Vec<(i64, Value)>;
    /// See [`KeyedOperator::cut`].
    fn cut(&mut self) -> u32;
    /// See [`KeyedOperator::group_mode`].
    fn group_mode(&self, group: u32, since: u32) -> GroupMode;
    /// See [`KeyedOperator::encode_group`].
    fn encode_group(&mut self, group: u32, mode: GroupMode) -> Result<Option<EncodedBlock>>;
    /// See [`KeyedOperator::restore_group`].
    fn restore_group(&mut self, group: u32, chain: &[&[u8]]) -> Result<(), BlockError>;
    /// See [`KeyedOperator::apply_deltas`].
    fn apply_deltas(&mut self, group: u32, deltas: &[&[u8]]) -> Result<(), BlockError>;
    /// See [`KeyedOperator::clear_group`].
    fn clear_group(&mut self, group: u32) -> Result<(), StateError>;
    /// See [`KeyedOperator::restore_watermark`].
    fn restore_watermark(&mut self, watermark: i64);
    /// See [`KeyedOperator::restore_processing_time`].
    fn restore_processing_time(&mut self, now: i64);
    /// State entries (timers included).
    fn entries(&self) -> usize;
    /// State entries of `group` (timers included).
    fn group_entries(&self, group: u32) -> usize;
    /// See [`KeyedOperator::encoded_group_entries`].
    fn encoded_group_entries(&self, group: u32) -> usize;
    /// See [`KeyedOperator::operator_states`].
    fn operator_states(&self) -> &OperatorStates;
    /// See [`KeyedOperator::encode_operator_state`].
    fn encode_operator_state(&self, subtask: u32, parallelism: u32) -> Option<Vec<u8>>;
    /// See [`KeyedOperator::restore_operator_state`].
    fn restore_operator_state(
        &mut self,
        sections: &[&[u8]],
        subtask: u32,
        parallelism: u32,
    ) -> Result<(), BlockError>;
}

/// A [`KeyedOperator`] as a [`KeyedStep`]: records deserialized with [`Postcard`].
struct Erased<F: KeyedProcessFunction> {
    op: KeyedOperator<F>,
    records: Postcard<F::In>,
}

/// A record routed to a step did not deserialize, or a key of another type reached it.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("step {uid:?}: a record did not deserialize: {message}")]
    Deserialize { uid: String, message: String },
    #[error("step {uid:?}: key {key} is not of the step's key type")]
    KeyType { uid: String, key: String },
    #[error("step {uid:?}: a record of another type reached it")]
    Type { uid: String },
}

impl<F: KeyedProcessFunction> Erased<F> {
    fn key(&self, key: &RecordKey) -> Result<F::Key> {
        F::Key::from_record_key(key).ok_or_else(|| self.key_type_error(key))
    }

    fn key_type_error(&self, key: &RecordKey) -> Error {
        Error::user(RecordError::KeyType {
            uid: self.op.uid().to_owned(),
            key: key.to_string(),
        })
    }
}

impl<F> KeyedStep for Erased<F>
where
    F: KeyedProcessFunction,
    F::In: Serialize + DeserializeOwned + Send + 'static,
    F::Out: Send + 'static,
{
    fn uid(&self) -> &str {
        self.op.uid()
    }
    fn declarations(&self) -> &[Declaration] {
        self.op.declarations()
    }
    fn range(&self) -> KeyGroupRange {
        self.op.range()
    }
    fn process_batch(&mut self, batch: &[Routed<'_>]) -> Result<()> {
        let mut ahead = [ReadAhead::default(); READ_AHEAD];
        for chunk in batch.chunks(READ_AHEAD) {
            for (r, a) in chunk.iter().zip(&mut ahead) {
                *a = self.op.prefetch(r.group, &r.key);
            }
            self.process_chunk(chunk, &ahead)?;
        }
        Ok(())
    }

    fn process_value(&mut self, key: &RecordKey, timestamp: i64, record: Value) -> Result<()> {
        let value = record.downcast::<F::In>().map_err(|_| {
            Error::user(RecordError::Type {
                uid: self.op.uid().to_owned(),
            })
        })?;
        let key = self.key(key)?;
        self.op.process(&key, timestamp, *value)
    }
    fn advance_watermark(&mut self, watermark: i64) -> Result<()> {
        self.op.advance_watermark(watermark)
    }
    fn advance_processing_time(&mut self, now: i64) -> Result<()> {
        self.op.advance_processing_time(now)
    }
    fn watermark(&self) -> i64 {
        self.op.watermark()
    }
    fn take_output(&mut self) -> Vec<(i64, Value)> {
        self.op
            .take_output()
            .into_iter()
            .map(|(ts, v)| (ts, Box::new(v) as Value))
            .collect()
    }
    fn cut(&mut self) -> u32 {
        self.op.cut()
    }
    fn group_mode(&self, group: u32, since: u32) -> GroupMode {
        self.op.group_mode(group, since)
    }
    fn encode_group(&mut self, group: u32, mode: GroupMode) -> Result<Option<EncodedBlock>> {
        self.op.encode_group(group, mode)
    }
    fn restore_group(&mut self, group: u32, chain: &[&[u8]]) -> Result<(), BlockError> {
        self.op.restore_group(group, chain)
    }
    fn apply_deltas(&mut self, group: u32, deltas: &[&[u8]]) -> Result<(), BlockError> {
        self.op.apply_deltas(group, deltas)
    }
    fn clear_group(&mut self, group: u32) -> Result<(), StateError> {
        self.op.clear_group(group)
    }
    fn restore_watermark(&mut self, watermark: i64) {
        self.op.restore_watermark(watermark)
    }
    fn restore_processing_time(&mut self, now: i64) {
        self.op.restore_processing_time(now)
    }
    fn group_entries(&self, group: u32) -> usize {
        self.op.group_entries(group)
    }
    fn encoded_group_entries(&self, group: u32) -> usize {
        self.op.encoded_group_entries(group)
    }
    fn entries(&self) -> usize {
        self.op.entries()
    }
    fn operator_states(&self) -> &OperatorStates {
        self.op.operator_states()
    }
    fn encode_operator_state(&self, subtask: u32, parallelism: u32) -> Option<Vec<u8>> {
        self.op.encode_operator_state(subtask, parallelism)
    }
    fn restore_operator_state(
        &mut self,
        sections: &[&[u8]],
        subtask: u32,
        parallelism: u32,
    ) -> Result<(), BlockError> {
        self.op
            .restore_operator_state(sections, subtask, parallelism)
    }
}

impl<F> Erased<F>
where
    F: KeyedProcessFunction,
    F::In: Serialize + DeserializeOwned + Send + 'static,
    F::Out: Send + 'static,
{
    /// Processes `batch`, read ahead (`ahead[i]` is record `i`'s).
    fn process_chunk(&mut self, batch: &[Routed<'_>], ahead: &[ReadAhead]) -> Result<()> {
        for (r, a) in batch.iter().zip(ahead) {
            let value = self.records.deserialize(r.record).map_err(|e| {
                Error::user(RecordError::Deserialize {
                    uid: self.op.uid().to_owned(),
                    message: e.to_string(),
                })
            })?;
            if !self
                .op
                .process_record_key(r.group, &r.key, *a, r.timestamp, value)?
            {
                return Err(self.key_type_error(&r.key));
            }
        }
        Ok(())
    }
}

/// Builds a keyed step's instance for a subtask: (max parallelism, owned groups).
pub type StepFactory =
    Box<dyn Fn(u32, KeyGroupRange) -> Result<Box<dyn KeyedStep>, DeclarationError> + Send + Sync>;

/// The factory of step `uid` running the functions `factory` builds.
pub fn factory<F>(uid: &str, factory: impl Fn() -> F + Send + Sync + 'static) -> StepFactory
where
    F: KeyedProcessFunction,
    F::In: Serialize + DeserializeOwned + Send + 'static,
    F::Out: Send + 'static,
{
    let uid = uid.to_owned();
    Box::new(move |max_parallelism, range| {
        let op = KeyedOperator::new(uid.clone(), factory(), max_parallelism, range)?;
        Ok(Box::new(Erased {
            op,
            records: Postcard::default(),
        }) as Box<dyn KeyedStep>)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prelude::*;
    use keyshift_core::keygroup::{Key, KeyType};

    /// Emits the key it is called for when the record asks for it.
    struct Echo;

    impl KeyedProcessFunction for Echo {
        type Key = String;
        type In = bool;
        type Out = String;
        type State = ValueHandle<u64>;

        fn declare(&self, states: &mut Declarations) -> Result<Self::State, DeclarationError> {
            states.value(ValueStateDescriptor::new("seen"))
        }

        fn process(
            &mut self,
            ask: bool,
            seen: &Self::State,
            ctx: &mut Context<'_, String, String>,
        ) -> crate::Result<()> {
            let n = ctx.value(seen).get()?.unwrap_or(0) + 1;
            ctx.value(seen).set(n)?;
            if ask {
                let key = ctx.key().clone();
                ctx.emit(key);
            }
            Ok(())
        }
    }

    /// A key type of one's own whose conversion refuses some keys of its kind.
    #[derive(Debug, Clone, PartialEq, Eq, Hash)]
    struct Upper(String);

    impl StreamKey for Upper {
        const KEY_TYPE: KeyType = KeyType::String;
        fn to_key(&self) -> Key {
            Key::String(self.0.clone())
        }
        fn from_key(key: &Key) -> Option<Self> {
            match key {
                Key::String(s) if s.chars().all(|c| c.is_ascii_uppercase()) => {
                    Some(Upper(s.clone()))
                }
                _ => None,
            }
        }
    }

    struct Count;

    impl KeyedProcessFunction for Count {
        type Key = Upper;
        type In = bool;
        type Out = String;
        type State = ValueHandle<u64>;

        fn declare(&self, states: &mut Declarations) -> Result<Self::State, DeclarationError> {
            states.value(ValueStateDescriptor::new("n"))
        }

        fn process(
            &mut self,
            _: bool,
            n: &Self::State,
            ctx: &mut Context<'_, Upper, String>,
        ) -> crate::Result<()> {
            let v = ctx.value(n).get()?.unwrap_or(0) + 1;
            Ok(ctx.value(n).set(v)?)
        }
    }

    fn routed(key: RecordKey, record: &[u8]) -> Routed<'_> {
        Routed {
            group: key.key_group(128),
            key,
            timestamp: 0,
            record,
        }
    }

    fn serialized(b: bool) -> Vec<u8> {
        let mut out = Vec::new();
        Postcard::<bool>::default().serialize(&b, &mut out).unwrap();
        out
    }

    const ALL: KeyGroupRange = KeyGroupRange { start: 0, end: 127 };

    #[test]
    fn a_key_is_built_when_the_function_asks_and_a_key_of_another_type_is_refused() {
        let (ask, quiet) = (serialized(true), serialized(false));
        let mut step = factory("echo", || Echo)(128, ALL).unwrap();
        let long_key = "a-key-longer-than-the-inline-bytes-of-a-record-key";
        step.process_batch(&[
            routed(RecordKey::string("a"), &quiet),
            routed(RecordKey::string("b"), &ask),
            routed(RecordKey::string(long_key), &ask),
            routed(RecordKey::string("a"), &ask),
        ])
        .unwrap();
        let keys: Vec<String> = step
            .take_output()
            .into_iter()
            .map(|(_, v)| *v.downcast::<String>().unwrap())
            .collect();
        assert_eq!(keys, ["b", long_key, "a"]);
        assert_eq!(step.entries(), 3, "a's count and b's and the long key's");
        let refused = step
            .process_batch(&[routed(RecordKey::long(7), &ask)])
            .unwrap_err();
        assert!(
            refused.to_string().contains("not of the step's key type"),
            "{refused}"
        );
        assert_eq!(step.entries(), 3, "nothing processed for the refused key");
    }

    #[test]
    fn a_key_type_of_ones_own_is_built_and_checked_before_each_call() {
        let one = serialized(true);
        let mut step = factory("count", || Count)(128, ALL).unwrap();
        step.process_batch(&[routed(RecordKey::string("AB"), &one)])
            .unwrap();
        let refused = step
            .process_batch(&[routed(RecordKey::string("ab"), &one)])
            .unwrap_err();
        assert!(refused.to_string().contains("key ab"), "{refused}");
        assert_eq!(step.entries(), 1);
    }
}
