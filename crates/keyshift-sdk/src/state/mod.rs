//! Per-key typed state: what a keyed function declares ([`ValueStateDescriptor`] and the
//! others), the handles its `open` gets back, and the views its `process` and `on_timer` work
//! through ([`ValueState`], [`MapState`], [`ListState`], [`ReducingState`],
//! [`AggregatingState`]). Every view is scoped to the key being processed: a function never sees
//! another key's state, which is what lets state move by key group.
//!
//! A declaration is the state's identity in snapshots: its name, kind, version, serializer and
//! whether it has a TTL. A restore refuses a snapshot whose state under the same name differs in
//! any of them, naming the state ([`crate::error::BlockError::StateChanged`]).

pub mod backend;

use crate::error::StateError;
use crate::serializer::{Postcard, Serializer};
use backend::StateBackend;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// The kinds of keyed state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StateKind {
    /// One value per key.
    Value,
    /// A map per key.
    Map,
    /// A list per key (appends do not read the list).
    List,
    /// One value per key, folded with a reduce function.
    Reducing,
    /// An accumulator per key, folded with an [`AggregateFunction`].
    Aggregating,
}

impl StateKind {
    pub(crate) fn code(self) -> u8 {
        match self {
            StateKind::Value => 0,
            StateKind::Map => 1,
            StateKind::List => 2,
            StateKind::Reducing => 3,
            StateKind::Aggregating => 4,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            0 => StateKind::Value,
            1 => StateKind::Map,
            2 => StateKind::List,
            3 => StateKind::Reducing,
            4 => StateKind::Aggregating,
            _ => return None,
        })
    }
}

impl fmt::Display for StateKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StateKind::Value => "value",
            StateKind::Map => "map",
            StateKind::List => "list",
            StateKind::Reducing => "reducing",
            StateKind::Aggregating => "aggregating",
        })
    }
}

/// The two clocks of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TimeDomain {
    /// The records' own timestamps, as the watermark says how far they have come.
    EventTime,
    /// The worker's wall clock.
    ProcessingTime,
}

/// How long a state entry lives after its last write, on which clock. An expired entry is
/// never returned, and is dropped from the snapshots written after it expired.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ttl {
    /// Milliseconds after the write.
    pub after_ms: i64,
    /// The clock it runs on.
    pub domain: TimeDomain,
}

impl Ttl {
    /// Expires once the watermark passes the event time of the write (the record's or timer's
    /// being handled) plus `after`: deterministic, so a replay expires alike.
    pub fn event_time(after: Duration) -> Self {
        Ttl {
            after_ms: i64::try_from(after.as_millis()).unwrap_or(i64::MAX),
            domain: TimeDomain::EventTime,
        }
    }

    /// Expires `after` the write, on the worker's clock (Flink's state TTL).
    pub fn processing_time(after: Duration) -> Self {
        Ttl {
            after_ms: i64::try_from(after.as_millis()).unwrap_or(i64::MAX),
            domain: TimeDomain::ProcessingTime,
        }
    }
}

/// A state's identity, as snapshots record it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Declaration {
    /// Unique among the function's states.
    pub name: String,
    pub kind: StateKind,
    /// The author's version of the state's type.
    pub version: u32,
    /// The serializer's name ([`Serializer::name`]).
    pub serializer: String,
    pub ttl: Option<Ttl>,
}

impl Declaration {
    /// What must stay the same for a snapshot's state to be read by this declaration.
    pub(crate) fn compatibility(&self) -> String {
        format!(
            "{} state, version {}, serializer {}, {}",
            self.kind,
            self.version,
            self.serializer,
            if self.ttl.is_some() {
                "with TTL"
            } else {
                "no TTL"
            }
        )
    }
}

/// Identifies a declared state inside one operator (its index in declaration order).
pub type StateId = u16;

/// The reserved state ids of timers (user states count up from 0).
pub(crate) const EVENT_TIMERS: StateId = u16::MAX;
pub(crate) const PROCESSING_TIMERS: StateId = u16::MAX - 1;
/// The most states a function may declare.
pub const MAX_STATES: usize = (u16::MAX - 2) as usize;

macro_rules! descriptor_builders {
    ($t:ident < $($g:ident),+ >) => {
        impl<$($g),+> $t<$($g),+> {
            /// Sets the version of the state's type (1 by default). A snapshot written under
            /// another version is refused: a changed type needs a new name or a migration.
            pub fn version(mut self, version: u32) -> Self {
                self.decl.version = version;
                self
            }

            /// Expires entries after their last write ([`Ttl`]).
            pub fn ttl(mut self, ttl: Ttl) -> Self {
                self.decl.ttl = Some(ttl);
                self
            }

            /// The declaration as snapshots record it.
            pub fn declaration(&self) -> &Declaration {
                &self.decl
            }
        }
    };
}

fn declaration(name: impl Into<String>, kind: StateKind, serializer: &str) -> Declaration {
    Declaration {
        name: name.into(),
        kind,
        version: 1,
        serializer: serializer.to_owned(),
        ttl: None,
    }
}

/// Declares a value state of `T`.
pub struct ValueStateDescriptor<T> {
    pub(crate) decl: Declaration,
    pub(crate) ser: Arc<dyn Serializer<T>>,
}
descriptor_builders!(ValueStateDescriptor<T>);

impl<T: Serialize + DeserializeOwned + 'static> ValueStateDescriptor<T> {
    /// A value state named `name`, serialized with [`Postcard`].
    pub fn new(name: impl Into<String>) -> Self {
        Self::with_serializer(name, Postcard::<T>::default())
    }
}

impl<T: 'static> ValueStateDescriptor<T> {
    /// A value state named `name`, serialized with `ser`.
    pub fn with_serializer(name: impl Into<String>, ser: impl Serializer<T> + 'static) -> Self {
        ValueStateDescriptor {
            decl: declaration(name, StateKind::Value, ser.name()),
            ser: Arc::new(ser),
        }
    }
}

/// Declares a map state from `K` to `V`. Map keys are stored in their [`Postcard`] form, which
/// must be deterministic for equal keys (no hash maps inside), and iterate in that form's order.
pub struct MapStateDescriptor<K, V> {
    pub(crate) decl: Declaration,
    pub(crate) keys: Arc<dyn Serializer<K>>,
    pub(crate) ser: Arc<dyn Serializer<V>>,
}
descriptor_builders!(MapStateDescriptor<K, V>);

impl<K: Serialize + DeserializeOwned + 'static, V: Serialize + DeserializeOwned + 'static>
    MapStateDescriptor<K, V>
{
    /// A map state named `name`, values serialized with [`Postcard`].
    pub fn new(name: impl Into<String>) -> Self {
        Self::with_serializer(name, Postcard::<V>::default())
    }

    /// A map state named `name`, values serialized with `ser`.
    pub fn with_serializer(name: impl Into<String>, ser: impl Serializer<V> + 'static) -> Self {
        MapStateDescriptor {
            decl: declaration(name, StateKind::Map, ser.name()),
            keys: Arc::new(Postcard::<K>::default()),
            ser: Arc::new(ser),
        }
    }
}

/// Declares a list state of `T`.
pub struct ListStateDescriptor<T> {
    pub(crate) decl: Declaration,
    pub(crate) ser: Arc<dyn Serializer<T>>,
}
descriptor_builders!(ListStateDescriptor<T>);

impl<T: Serialize + DeserializeOwned + 'static> ListStateDescriptor<T> {
    /// A list state named `name`, serialized with [`Postcard`].
    pub fn new(name: impl Into<String>) -> Self {
        Self::with_serializer(name, Postcard::<T>::default())
    }
}

impl<T: 'static> ListStateDescriptor<T> {
    /// A list state named `name`, serialized with `ser`.
    pub fn with_serializer(name: impl Into<String>, ser: impl Serializer<T> + 'static) -> Self {
        ListStateDescriptor {
            decl: declaration(name, StateKind::List, ser.name()),
            ser: Arc::new(ser),
        }
    }
}

/// A reduce function of a [`ReducingStateDescriptor`].
pub type ReduceFn<T> = Arc<dyn Fn(T, T) -> T + Send + Sync>;

/// Declares a reducing state of `T`: each added value is folded into the key's one value.
pub struct ReducingStateDescriptor<T> {
    pub(crate) decl: Declaration,
    pub(crate) ser: Arc<dyn Serializer<T>>,
    pub(crate) reduce: ReduceFn<T>,
}
descriptor_builders!(ReducingStateDescriptor<T>);

impl<T: Serialize + DeserializeOwned + 'static> ReducingStateDescriptor<T> {
    /// A reducing state named `name` folding with `reduce`, serialized with [`Postcard`].
    pub fn new(
        name: impl Into<String>,
        reduce: impl Fn(T, T) -> T + Send + Sync + 'static,
    ) -> Self {
        ReducingStateDescriptor {
            decl: declaration(name, StateKind::Reducing, "postcard"),
            ser: Arc::new(Postcard::<T>::default()),
            reduce: Arc::new(reduce),
        }
    }
}

/// How an [`AggregatingState`] folds inputs into an accumulator and reads a result from it
/// (Flink's `AggregateFunction`).
pub trait AggregateFunction: Send + Sync + 'static {
    type In;
    type Acc: Serialize + DeserializeOwned + 'static;
    type Out;
    /// A fresh accumulator.
    fn create(&self) -> Self::Acc;
    /// Folds `value` into `acc`.
    fn add(&self, value: Self::In, acc: Self::Acc) -> Self::Acc;
    /// The result of `acc`.
    fn result(&self, acc: &Self::Acc) -> Self::Out;
}

/// Declares an aggregating state folding with `A`.
pub struct AggregatingStateDescriptor<A: AggregateFunction> {
    pub(crate) decl: Declaration,
    pub(crate) ser: Arc<dyn Serializer<A::Acc>>,
    pub(crate) agg: Arc<A>,
}

impl<A: AggregateFunction> AggregatingStateDescriptor<A> {
    /// An aggregating state named `name` folding with `agg`, accumulators serialized with
    /// [`Postcard`].
    pub fn new(name: impl Into<String>, agg: A) -> Self {
        AggregatingStateDescriptor {
            decl: declaration(name, StateKind::Aggregating, "postcard"),
            ser: Arc::new(Postcard::<A::Acc>::default()),
            agg: Arc::new(agg),
        }
    }

    /// Sets the version of the accumulator's type (1 by default).
    pub fn version(mut self, version: u32) -> Self {
        self.decl.version = version;
        self
    }

    /// Expires entries after their last write ([`Ttl`]).
    pub fn ttl(mut self, ttl: Ttl) -> Self {
        self.decl.ttl = Some(ttl);
        self
    }
}

/// A declared value state, as `open` hands it back; use it with `Context::value`.
pub struct ValueHandle<T> {
    pub(crate) id: StateId,
    pub(crate) name: Arc<str>,
    pub(crate) ser: Arc<dyn Serializer<T>>,
    pub(crate) ttl: Option<Ttl>,
}

/// A declared map state; use it with `Context::map`.
pub struct MapHandle<K, V> {
    pub(crate) id: StateId,
    pub(crate) name: Arc<str>,
    pub(crate) keys: Arc<dyn Serializer<K>>,
    pub(crate) ser: Arc<dyn Serializer<V>>,
    pub(crate) ttl: Option<Ttl>,
}

/// A declared list state; use it with `Context::list`.
pub struct ListHandle<T> {
    pub(crate) id: StateId,
    pub(crate) name: Arc<str>,
    pub(crate) ser: Arc<dyn Serializer<T>>,
    pub(crate) ttl: Option<Ttl>,
}

/// A declared reducing state; use it with `Context::reducing`.
pub struct ReducingHandle<T> {
    pub(crate) id: StateId,
    pub(crate) name: Arc<str>,
    pub(crate) ser: Arc<dyn Serializer<T>>,
    pub(crate) reduce: ReduceFn<T>,
    pub(crate) ttl: Option<Ttl>,
}

/// A declared aggregating state; use it with `Context::aggregating`.
pub struct AggregatingHandle<A: AggregateFunction> {
    pub(crate) id: StateId,
    pub(crate) name: Arc<str>,
    pub(crate) ser: Arc<dyn Serializer<A::Acc>>,
    pub(crate) agg: Arc<A>,
    pub(crate) ttl: Option<Ttl>,
}

/// The declarations of a function's states, collected by its `open`.
#[derive(Debug, Default)]
pub struct Declarations {
    pub(crate) list: Vec<Declaration>,
}

/// A function's states declared twice, too many, or with an empty name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeclarationError {
    #[error("state {0:?} is declared twice: every state of a function needs its own name")]
    Duplicate(String),
    #[error("a state name must not be empty")]
    EmptyName,
    #[error("a function may declare at most {MAX_STATES} states")]
    TooMany,
}

impl Declarations {
    fn add(&mut self, decl: &Declaration) -> Result<(StateId, Arc<str>), DeclarationError> {
        if decl.name.is_empty() {
            return Err(DeclarationError::EmptyName);
        }
        if self.list.iter().any(|d| d.name == decl.name) {
            return Err(DeclarationError::Duplicate(decl.name.clone()));
        }
        if self.list.len() >= MAX_STATES {
            return Err(DeclarationError::TooMany);
        }
        let id = self.list.len() as StateId;
        self.list.push(decl.clone());
        Ok((id, decl.name.as_str().into()))
    }

    /// Declares a value state.
    pub fn value<T>(
        &mut self,
        d: ValueStateDescriptor<T>,
    ) -> Result<ValueHandle<T>, DeclarationError> {
        let (id, name) = self.add(&d.decl)?;
        Ok(ValueHandle {
            id,
            name,
            ser: d.ser,
            ttl: d.decl.ttl,
        })
    }

    /// Declares a map state.
    pub fn map<K, V>(
        &mut self,
        d: MapStateDescriptor<K, V>,
    ) -> Result<MapHandle<K, V>, DeclarationError> {
        let (id, name) = self.add(&d.decl)?;
        Ok(MapHandle {
            id,
            name,
            keys: d.keys,
            ser: d.ser,
            ttl: d.decl.ttl,
        })
    }

    /// Declares a list state.
    pub fn list<T>(
        &mut self,
        d: ListStateDescriptor<T>,
    ) -> Result<ListHandle<T>, DeclarationError> {
        let (id, name) = self.add(&d.decl)?;
        Ok(ListHandle {
            id,
            name,
            ser: d.ser,
            ttl: d.decl.ttl,
        })
    }

    /// Declares a reducing state.
    pub fn reducing<T>(
        &mut self,
        d: ReducingStateDescriptor<T>,
    ) -> Result<ReducingHandle<T>, DeclarationError> {
        let (id, name) = self.add(&d.decl)?;
        Ok(ReducingHandle {
            id,
            name,
            ser: d.ser,
            reduce: d.reduce,
            ttl: d.decl.ttl,
        })
    }

    /// Declares an aggregating state.
    pub fn aggregating<A: AggregateFunction>(
        &mut self,
        d: AggregatingStateDescriptor<A>,
    ) -> Result<AggregatingHandle<A>, DeclarationError> {
        let (id, name) = self.add(&d.decl)?;
        Ok(AggregatingHandle {
            id,
            name,
            ser: d.ser,
            agg: d.agg,
            ttl: d.decl.ttl,
        })
    }

    /// Every declaration, in order.
    pub fn all(&self) -> &[Declaration] {
        &self.list
    }
}

/// The state of the key being processed: a backend, the key's group and byte form, and the
/// clocks TTLs read.
pub(crate) struct KeyScope<'a> {
    pub(crate) backend: &'a mut dyn StateBackend,
    pub(crate) group: usize,
    /// The key's byte form.
    pub(crate) key: &'a [u8],
    pub(crate) watermark: i64,
    pub(crate) processing_time: i64,
    /// The event time of the record or timer being handled.
    pub(crate) timestamp: Option<i64>,
}

impl KeyScope<'_> {
    /// The entry key of state `id` with user key `user`.
    pub(crate) fn entry_key(&self, id: StateId, user: &[u8]) -> Vec<u8> {
        let mut k = Vec::with_capacity(self.key.len() + 2 + user.len());
        k.extend_from_slice(self.key);
        k.extend_from_slice(&id.to_be_bytes());
        k.extend_from_slice(user);
        k
    }

    /// The time an entry's expiry is compared with.
    fn now(&self, ttl: &Ttl) -> i64 {
        match ttl.domain {
            TimeDomain::EventTime => self.watermark,
            TimeDomain::ProcessingTime => self.processing_time,
        }
    }

    /// The time a write's TTL counts from.
    fn written_at(&self, ttl: &Ttl) -> i64 {
        match ttl.domain {
            TimeDomain::EventTime => self.timestamp.unwrap_or(self.watermark),
            TimeDomain::ProcessingTime => self.processing_time,
        }
    }

    /// The entry's payload, if present and not expired.
    fn read(&self, key: &[u8], ttl: Option<&Ttl>) -> Result<Option<Vec<u8>>, StateError> {
        let Some(bytes) = self.backend.get(self.group, key)? else {
            return Ok(None);
        };
        Ok(self.live(&bytes, ttl).map(<[u8]>::to_vec))
    }

    /// An entry's payload: without its expiry if it has a TTL; `None` if expired (or too short
    /// to hold an expiry).
    fn live<'b>(&self, bytes: &'b [u8], ttl: Option<&Ttl>) -> Option<&'b [u8]> {
        match ttl {
            None => Some(bytes),
            Some(ttl) => {
                let (expiry, rest) = bytes.split_first_chunk::<8>()?;
                (i64::from_be_bytes(*expiry) > self.now(ttl)).then_some(rest)
            }
        }
    }

    /// Writes an entry (its expiry first, with a TTL).
    fn write(&mut self, key: &[u8], ttl: Option<&Ttl>, payload: Vec<u8>) -> Result<(), StateError> {
        let bytes = match ttl {
            None => payload,
            Some(ttl) => {
                let expiry = self.written_at(ttl).saturating_add(ttl.after_ms);
                let mut b = Vec::with_capacity(8 + payload.len());
                b.extend_from_slice(&expiry.to_be_bytes());
                b.extend_from_slice(&payload);
                b
            }
        };
        self.backend.put(self.group, key, bytes)
    }
}

fn ser_err(name: &str, source: crate::serializer::SerializeError) -> StateError {
    StateError::Serialize {
        state: name.to_owned(),
        source,
    }
}

fn encode<T>(name: &str, ser: &dyn Serializer<T>, value: &T) -> Result<Vec<u8>, StateError> {
    let mut out = Vec::new();
    ser.serialize(value, &mut out)
        .map_err(|e| ser_err(name, e))?;
    Ok(out)
}

fn decode<T>(name: &str, ser: &dyn Serializer<T>, bytes: &[u8]) -> Result<T, StateError> {
    ser.deserialize(bytes).map_err(|e| ser_err(name, e))
}

/// The current key's value state.
pub struct ValueState<'s, 'a, T> {
    pub(crate) scope: &'s mut KeyScope<'a>,
    pub(crate) handle: &'s ValueHandle<T>,
}

impl<T> ValueState<'_, '_, T> {
    fn key(&self) -> Vec<u8> {
        self.scope.entry_key(self.handle.id, &[])
    }

    /// The value, if set (and not expired).
    pub fn get(&self) -> Result<Option<T>, StateError> {
        let h = self.handle;
        match self.scope.read(&self.key(), h.ttl.as_ref())? {
            None => Ok(None),
            Some(b) => decode(&h.name, h.ser.as_ref(), &b).map(Some),
        }
    }

    /// Sets the value.
    pub fn set(&mut self, value: &T) -> Result<(), StateError> {
        let h = self.handle;
        let bytes = encode(&h.name, h.ser.as_ref(), value)?;
        let key = self.key();
        self.scope.write(&key, h.ttl.as_ref(), bytes)
    }

    /// Removes the value.
    pub fn clear(&mut self) -> Result<(), StateError> {
        let key = self.key();
        self.scope.backend.delete(self.scope.group, &key)
    }
}

/// The current key's map state.
pub struct MapState<'s, 'a, K, V> {
    pub(crate) scope: &'s mut KeyScope<'a>,
    pub(crate) handle: &'s MapHandle<K, V>,
}

impl<K, V> MapState<'_, '_, K, V> {
    fn entry(&self, k: &K) -> Result<Vec<u8>, StateError> {
        let h = self.handle;
        let user = encode(&h.name, h.keys.as_ref(), k)?;
        Ok(self.scope.entry_key(h.id, &user))
    }

    /// The value at `k`.
    pub fn get(&self, k: &K) -> Result<Option<V>, StateError> {
        let h = self.handle;
        match self.scope.read(&self.entry(k)?, h.ttl.as_ref())? {
            None => Ok(None),
            Some(b) => decode(&h.name, h.ser.as_ref(), &b).map(Some),
        }
    }

    /// Whether `k` has a value.
    pub fn contains(&self, k: &K) -> Result<bool, StateError> {
        Ok(self
            .scope
            .read(&self.entry(k)?, self.handle.ttl.as_ref())?
            .is_some())
    }

    /// Sets the value at `k`.
    pub fn insert(&mut self, k: &K, v: &V) -> Result<(), StateError> {
        let h = self.handle;
        let bytes = encode(&h.name, h.ser.as_ref(), v)?;
        let key = self.entry(k)?;
        self.scope.write(&key, h.ttl.as_ref(), bytes)
    }

    /// Removes the value at `k`.
    pub fn remove(&mut self, k: &K) -> Result<(), StateError> {
        let key = self.entry(k)?;
        self.scope.backend.delete(self.scope.group, &key)
    }

    /// Every entry, in the order of the keys' serialized form.
    pub fn entries(&self) -> Result<Vec<(K, V)>, StateError> {
        let h = self.handle;
        let prefix = self.scope.entry_key(h.id, &[]);
        let mut out = Vec::new();
        for (k, v) in self.scope.backend.scan(self.scope.group, &prefix)? {
            if let Some(v) = self.scope.live(&v, h.ttl.as_ref()) {
                out.push((
                    decode(&h.name, h.keys.as_ref(), &k[prefix.len()..])?,
                    decode(&h.name, h.ser.as_ref(), v)?,
                ));
            }
        }
        Ok(out)
    }

    /// Whether the map has no (live) entry.
    pub fn is_empty(&self) -> Result<bool, StateError> {
        Ok(self.entries()?.is_empty())
    }

    /// Removes every entry.
    pub fn clear(&mut self) -> Result<(), StateError> {
        let prefix = self.scope.entry_key(self.handle.id, &[]);
        self.scope.backend.delete_prefix(self.scope.group, &prefix)
    }
}

/// The current key's list state. Elements are entries of their own (sequence numbered), so an
/// append writes one entry and reads none but the last key.
pub struct ListState<'s, 'a, T> {
    pub(crate) scope: &'s mut KeyScope<'a>,
    pub(crate) handle: &'s ListHandle<T>,
}

impl<T> ListState<'_, '_, T> {
    /// Appends `value`.
    pub fn add(&mut self, value: &T) -> Result<(), StateError> {
        let h = self.handle;
        let prefix = self.scope.entry_key(h.id, &[]);
        let next = match self.scope.backend.last_key(self.scope.group, &prefix)? {
            None => 0u64,
            Some(last) => {
                let seq = last
                    .get(prefix.len()..)
                    .and_then(|s| <[u8; 8]>::try_from(s).ok())
                    .ok_or_else(|| {
                        StateError::Backend(format!("list {:?}: malformed element key", h.name))
                    })?;
                u64::from_be_bytes(seq) + 1
            }
        };
        let bytes = encode(&h.name, h.ser.as_ref(), value)?;
        let key = self.scope.entry_key(h.id, &next.to_be_bytes());
        self.scope.write(&key, h.ttl.as_ref(), bytes)
    }

    /// Every (live) element, in the order added.
    pub fn get(&self) -> Result<Vec<T>, StateError> {
        let h = self.handle;
        let prefix = self.scope.entry_key(h.id, &[]);
        let mut out = Vec::new();
        for (_, v) in self.scope.backend.scan(self.scope.group, &prefix)? {
            if let Some(v) = self.scope.live(&v, h.ttl.as_ref()) {
                out.push(decode(&h.name, h.ser.as_ref(), v)?);
            }
        }
        Ok(out)
    }

    /// Replaces the list with `values`.
    pub fn update(&mut self, values: &[T]) -> Result<(), StateError> {
        self.clear()?;
        for v in values {
            self.add(v)?;
        }
        Ok(())
    }

    /// Removes every element.
    pub fn clear(&mut self) -> Result<(), StateError> {
        let prefix = self.scope.entry_key(self.handle.id, &[]);
        self.scope.backend.delete_prefix(self.scope.group, &prefix)
    }
}

/// The current key's reducing state.
pub struct ReducingState<'s, 'a, T> {
    pub(crate) scope: &'s mut KeyScope<'a>,
    pub(crate) handle: &'s ReducingHandle<T>,
}

impl<T> ReducingState<'_, '_, T> {
    fn key(&self) -> Vec<u8> {
        self.scope.entry_key(self.handle.id, &[])
    }

    /// The folded value, if any was added.
    pub fn get(&self) -> Result<Option<T>, StateError> {
        let h = self.handle;
        match self.scope.read(&self.key(), h.ttl.as_ref())? {
            None => Ok(None),
            Some(b) => decode(&h.name, h.ser.as_ref(), &b).map(Some),
        }
    }

    /// Folds `value` in.
    pub fn add(&mut self, value: T) -> Result<(), StateError> {
        let h = self.handle;
        let folded = match self.get()? {
            None => value,
            Some(acc) => (h.reduce)(acc, value),
        };
        let bytes = encode(&h.name, h.ser.as_ref(), &folded)?;
        let key = self.key();
        self.scope.write(&key, h.ttl.as_ref(), bytes)
    }

    /// Removes the value.
    pub fn clear(&mut self) -> Result<(), StateError> {
        let key = self.key();
        self.scope.backend.delete(self.scope.group, &key)
    }
}

/// The current key's aggregating state.
pub struct AggregatingState<'s, 'a, A: AggregateFunction> {
    pub(crate) scope: &'s mut KeyScope<'a>,
    pub(crate) handle: &'s AggregatingHandle<A>,
}

impl<A: AggregateFunction> AggregatingState<'_, '_, A> {
    fn key(&self) -> Vec<u8> {
        self.scope.entry_key(self.handle.id, &[])
    }

    fn acc(&self) -> Result<Option<A::Acc>, StateError> {
        let h = self.handle;
        match self.scope.read(&self.key(), h.ttl.as_ref())? {
            None => Ok(None),
            Some(b) => decode(&h.name, h.ser.as_ref(), &b).map(Some),
        }
    }

    /// The result, if any value was added.
    pub fn get(&self) -> Result<Option<A::Out>, StateError> {
        Ok(self.acc()?.map(|acc| self.handle.agg.result(&acc)))
    }

    /// Folds `value` in.
    pub fn add(&mut self, value: A::In) -> Result<(), StateError> {
        let h = self.handle;
        let acc = self.acc()?.unwrap_or_else(|| h.agg.create());
        let acc = h.agg.add(value, acc);
        let bytes = encode(&h.name, h.ser.as_ref(), &acc)?;
        let key = self.key();
        self.scope.write(&key, h.ttl.as_ref(), bytes)
    }

    /// Removes the accumulator.
    pub fn clear(&mut self) -> Result<(), StateError> {
        let key = self.key();
        self.scope.backend.delete(self.scope.group, &key)
    }
}
