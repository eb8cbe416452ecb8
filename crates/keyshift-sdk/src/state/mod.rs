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
pub mod heap;

use crate::error::StateError;
use crate::serializer::{Postcard, Serializer};
use backend::StateBackend;
use heap::{Cell, KeyStates, Object, Slot, object};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::any::Any;
use std::borrow::Cow;
use std::collections::BTreeMap;
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

/// The kinds of operator state ([`crate::operator_state`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OperatorStateKind {
    /// A list of entries per subtask.
    List,
    /// One value, the same on every subtask.
    Broadcast,
}

impl OperatorStateKind {
    pub(crate) fn code(self) -> u8 {
        match self {
            OperatorStateKind::List => 0,
            OperatorStateKind::Broadcast => 1,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(OperatorStateKind::List),
            1 => Some(OperatorStateKind::Broadcast),
            _ => None,
        }
    }
}

impl fmt::Display for OperatorStateKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OperatorStateKind::List => "operator list",
            OperatorStateKind::Broadcast => "broadcast",
        })
    }
}

/// An operator state's identity, as snapshots record it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperatorDeclaration {
    /// Unique among the function's states (keyed and operator).
    pub name: String,
    pub kind: OperatorStateKind,
    /// The author's version of the entries' type.
    pub version: u32,
    /// The serializer's name.
    pub serializer: String,
    /// How the entries go to a run at another parallelism (`None`: a rescale is refused).
    pub redistribution: Option<keyshift_core::redistribution::Redistribution>,
}

impl OperatorDeclaration {
    /// What must stay the same for a snapshot's entries to be read by this declaration (the
    /// redistribution may change: it is the new release's that applies).
    pub(crate) fn compatibility(&self) -> String {
        format!(
            "{} state, version {}, serializer {}",
            self.kind, self.version, self.serializer
        )
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
    /// Expires once event time passes the event time of the write (the record's or timer's
    /// being handled) plus `after`; event time being the watermark, or the timestamp of the
    /// record or timer being handled when that is later. A key's records arrive in one order on
    /// every replay, so whether an entry has expired when its key's next record reads it does
    /// not depend on how far the watermark had come (only a record behind the watermark sees
    /// the watermark's time).
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
            /// another version is refused unless a migration reads it ([`Declarations::migrate`]).
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

/// What every handle holds of its declaration: the state's id, name, serializer and TTL.
pub(crate) struct Declared<T> {
    pub(crate) id: StateId,
    pub(crate) name: Arc<str>,
    pub(crate) ser: Arc<dyn Serializer<T>>,
    pub(crate) ttl: Option<Ttl>,
}

impl<T> Declared<T> {
    /// What a state view needs of it.
    pub(crate) fn spec(&self) -> Spec<'_, T> {
        Spec {
            id: self.id,
            name: &self.name,
            ser: self.ser.as_ref(),
            ttl: self.ttl.as_ref(),
        }
    }
}

/// A declared value state, as `declare` hands it back; use it with `Context::value`.
pub struct ValueHandle<T>(pub(crate) Declared<T>);

/// A declared map state; use it with `Context::map`.
pub struct MapHandle<K, V> {
    pub(crate) values: Declared<V>,
    pub(crate) keys: Arc<dyn Serializer<K>>,
}

/// A declared list state; use it with `Context::list`.
pub struct ListHandle<T>(pub(crate) Declared<T>);

/// A declared reducing state; use it with `Context::reducing`.
pub struct ReducingHandle<T> {
    pub(crate) values: Declared<T>,
    pub(crate) reduce: ReduceFn<T>,
}

/// A declared aggregating state; use it with `Context::aggregating`.
pub struct AggregatingHandle<A: AggregateFunction> {
    pub(crate) values: Declared<A::Acc>,
    pub(crate) agg: Arc<A>,
}

/// The declarations of a function's states, collected by its `open`.
#[derive(Default)]
pub struct Declarations {
    pub(crate) list: Vec<Declaration>,
    pub(crate) codecs: Vec<Codec>,
    /// How snapshots of older versions of a declared state are read: by its id.
    pub(crate) migrations: BTreeMap<StateId, Vec<Migration>>,
    /// States of earlier releases this one no longer declares, whose entries a restore drops.
    pub(crate) dropped: Vec<String>,
    /// Operator states ([`crate::operator_state`]), in declaration order.
    pub(crate) operator: Vec<OperatorDeclaration>,
    /// How snapshots of older versions of an operator state are read: by its index.
    pub(crate) operator_migrations: BTreeMap<usize, Vec<Migration>>,
}

/// Converts a value written under an older version of a state (its payload, the serializer's
/// bytes without an expiry) into the payload of the declared version.
pub(crate) type ConvertFn = Arc<dyn Fn(&[u8]) -> Result<Vec<u8>, String> + Send + Sync>;

/// How to read a snapshot of an older version of a state ([`Declarations::migrate`]).
#[derive(Clone)]
pub(crate) struct Migration {
    /// The version it reads.
    pub(crate) from_version: u32,
    /// The serializer the older version was written with.
    pub(crate) from_serializer: &'static str,
    pub(crate) convert: ConvertFn,
}

impl Migration {
    /// [`Migration::from_postcard`] for the state declared as `decl` (its name and version):
    /// refused when it is not declared, or already of `from_version`.
    pub(crate) fn checked<V: 'static, O: DeserializeOwned + 'static>(
        decl: Option<(&str, u32)>,
        ser: Arc<dyn Serializer<V>>,
        from_version: u32,
        convert: impl Fn(O) -> V + Send + Sync + 'static,
    ) -> Result<Migration, DeclarationError> {
        let Some((name, version)) = decl else {
            return Err(DeclarationError::NotDeclared);
        };
        if version == from_version {
            return Err(DeclarationError::MigrationFromItself {
                name: name.to_owned(),
                version: from_version,
            });
        }
        Ok(Migration::from_postcard(ser, from_version, convert))
    }

    /// Reads values of version `from_version`, postcard-serialized `O`s, as `convert` makes
    /// them into values `ser` writes.
    pub(crate) fn from_postcard<V: 'static, O: DeserializeOwned + 'static>(
        ser: Arc<dyn Serializer<V>>,
        from_version: u32,
        convert: impl Fn(O) -> V + Send + Sync + 'static,
    ) -> Migration {
        let convert: ConvertFn = Arc::new(move |bytes: &[u8]| {
            let value: O = postcard::from_bytes(bytes).map_err(|e| e.to_string())?;
            let mut out = Vec::new();
            ser.serialize(&convert(value), &mut out)
                .map_err(|e| e.to_string())?;
            Ok(out)
        });
        Migration {
            from_version,
            from_serializer: "postcard",
            convert,
        }
    }
}

/// A handle of a declared state: its id, and the serializer of its values (what a migration
/// writes).
pub trait StateHandle {
    /// The type of the state's values (a map's values; a reducing or aggregating state's
    /// accumulator).
    type Value;
    #[doc(hidden)]
    fn declared_id(&self) -> StateId;
    #[doc(hidden)]
    fn value_serializer(&self) -> Arc<dyn Serializer<Self::Value>>;
}

macro_rules! state_handle {
    ($t:ident < $($g:ident),+ >, $v:ty, $field:tt) => {
        impl<$($g),+> StateHandle for $t<$($g),+> {
            type Value = $v;
            fn declared_id(&self) -> StateId {
                self.$field.id
            }
            fn value_serializer(&self) -> Arc<dyn Serializer<$v>> {
                self.$field.ser.clone()
            }
        }
    };
}
state_handle!(ValueHandle<T>, T, 0);
state_handle!(ListHandle<T>, T, 0);
state_handle!(MapHandle<K, V>, V, values);
state_handle!(ReducingHandle<T>, T, values);

impl<A: AggregateFunction> StateHandle for AggregatingHandle<A> {
    type Value = A::Acc;
    fn declared_id(&self) -> StateId {
        self.values.id
    }
    fn value_serializer(&self) -> Arc<dyn Serializer<A::Acc>> {
        self.values.ser.clone()
    }
}

type EncodeFn = Arc<dyn Fn(&dyn Any, &mut Vec<u8>) -> Result<(), StateError> + Send + Sync>;
type DecodeFn = Arc<dyn Fn(&[u8]) -> Result<Object, StateError> + Send + Sync>;

/// How one declared state's values become bytes and back, their types erased (the heap
/// backend serializes only when a snapshot writes a group).
#[derive(Clone)]
pub(crate) struct Codec {
    /// A map or a list: many entries per key.
    pub(crate) many: bool,
    encode: EncodeFn,
    decode: DecodeFn,
}

impl Codec {
    fn of<T: Send + 'static>(name: &str, ser: Arc<dyn Serializer<T>>, many: bool) -> Codec {
        let (n1, n2) = (name.to_owned(), name.to_owned());
        let s2 = ser.clone();
        Codec {
            many,
            encode: Arc::new(move |v, out| {
                let v = v.downcast_ref::<T>().ok_or_else(|| {
                    StateError::Backend(format!("state {n1:?} holds a value of another type"))
                })?;
                ser.serialize(v, out).map_err(|e| ser_err(&n1, e))
            }),
            decode: Arc::new(move |b| s2.deserialize(b).map(object).map_err(|e| ser_err(&n2, e))),
        }
    }

    pub(crate) fn encode(&self, v: &dyn Any, out: &mut Vec<u8>) -> Result<(), StateError> {
        (self.encode)(v, out)
    }

    pub(crate) fn decode(&self, bytes: &[u8]) -> Result<Object, StateError> {
        (self.decode)(bytes)
    }
}

impl fmt::Debug for Declarations {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(&self.list).finish()
    }
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
    #[error("a migration names a state this function's declarations do not have")]
    NotDeclared,
    #[error("state {name:?} declares a migration from its own version {version}")]
    MigrationFromItself { name: String, version: u32 },
    #[error(
        "state {0:?} is declared and dropped: drop only a state the function no longer declares"
    )]
    DropDeclared(String),
}

impl Declarations {
    /// Whether a keyed or an operator state is declared as `name`.
    pub(crate) fn is_declared(&self, name: &str) -> bool {
        self.list.iter().any(|d| d.name == name) || self.operator.iter().any(|d| d.name == name)
    }

    /// Adds a declaration and the codec of its values (same index: the state's id).
    fn add<T: Send + 'static>(
        &mut self,
        decl: &Declaration,
        ser: &Arc<dyn Serializer<T>>,
        many: bool,
    ) -> Result<Declared<T>, DeclarationError> {
        if decl.name.is_empty() {
            return Err(DeclarationError::EmptyName);
        }
        if self.is_declared(&decl.name) {
            return Err(DeclarationError::Duplicate(decl.name.clone()));
        }
        if self.list.len() >= MAX_STATES {
            return Err(DeclarationError::TooMany);
        }
        let id = self.list.len() as StateId;
        self.list.push(decl.clone());
        self.codecs.push(Codec::of(&decl.name, ser.clone(), many));
        Ok(Declared {
            id,
            name: decl.name.as_str().into(),
            ser: ser.clone(),
            ttl: decl.ttl,
        })
    }

    /// Declares a value state.
    pub fn value<T: Send + 'static>(
        &mut self,
        d: ValueStateDescriptor<T>,
    ) -> Result<ValueHandle<T>, DeclarationError> {
        Ok(ValueHandle(self.add(&d.decl, &d.ser, false)?))
    }

    /// Declares a map state.
    pub fn map<K, V: Send + 'static>(
        &mut self,
        d: MapStateDescriptor<K, V>,
    ) -> Result<MapHandle<K, V>, DeclarationError> {
        Ok(MapHandle {
            values: self.add(&d.decl, &d.ser, true)?,
            keys: d.keys,
        })
    }

    /// Declares a list state.
    pub fn list<T: Send + 'static>(
        &mut self,
        d: ListStateDescriptor<T>,
    ) -> Result<ListHandle<T>, DeclarationError> {
        Ok(ListHandle(self.add(&d.decl, &d.ser, true)?))
    }

    /// Declares a reducing state.
    pub fn reducing<T: Send + 'static>(
        &mut self,
        d: ReducingStateDescriptor<T>,
    ) -> Result<ReducingHandle<T>, DeclarationError> {
        Ok(ReducingHandle {
            values: self.add(&d.decl, &d.ser, false)?,
            reduce: d.reduce,
        })
    }

    /// Declares an aggregating state.
    pub fn aggregating<A: AggregateFunction>(
        &mut self,
        d: AggregatingStateDescriptor<A>,
    ) -> Result<AggregatingHandle<A>, DeclarationError>
    where
        A::Acc: Send,
    {
        Ok(AggregatingHandle {
            values: self.add(&d.decl, &d.ser, false)?,
            agg: d.agg,
        })
    }

    /// Every declaration, in order.
    pub fn all(&self) -> &[Declaration] {
        &self.list
    }

    /// Reads snapshots written under version `from_version` of the state `handle` declares (its
    /// values then of type `O`, serialized with [`Postcard`]) by converting each old value with
    /// `convert` (Flink's state schema evolution, done by the author's function): an added field
    /// gets its default there, a changed type its new form. A state's kind and TTL cannot change
    /// this way. Declare one migration per older version still in snapshots; the restore refuses
    /// a version none reads, naming it.
    pub fn migrate<H, O>(
        &mut self,
        handle: &H,
        from_version: u32,
        convert: impl Fn(O) -> H::Value + Send + Sync + 'static,
    ) -> Result<(), DeclarationError>
    where
        H: StateHandle,
        H::Value: 'static,
        O: DeserializeOwned + 'static,
    {
        let id = handle.declared_id();
        let decl = self
            .list
            .get(usize::from(id))
            .map(|d| (&*d.name, d.version));
        let m = Migration::checked(decl, handle.value_serializer(), from_version, convert)?;
        self.migrations.entry(id).or_default().push(m);
        Ok(())
    }

    /// Drops the state `name` of an earlier release of this function: a restore leaves its
    /// entries behind instead of refusing a state the function no longer declares.
    pub fn drop_state(&mut self, name: impl Into<String>) -> Result<(), DeclarationError> {
        let name = name.into();
        if self.is_declared(&name) {
            return Err(DeclarationError::DropDeclared(name));
        }
        self.dropped.push(name);
        Ok(())
    }
}

/// Where the current key's state is: its objects in the heap backend, or entries of a
/// byte-addressed backend.
pub(crate) enum Store<'a> {
    Heap {
        states: &'a mut KeyStates,
        epoch: u32,
        /// Declared states (the timers' slots follow them).
        declared: usize,
    },
    Bytes {
        backend: &'a mut dyn StateBackend,
    },
}

/// The key's byte form: computed, or computed when first needed (the heap backend needs it only
/// for timers).
pub(crate) enum KeyBytes<'a> {
    Ready(&'a [u8]),
    Lazy(&'a dyn Fn() -> Vec<u8>),
}

impl KeyBytes<'_> {
    pub(crate) fn get(&self) -> Cow<'_, [u8]> {
        match self {
            KeyBytes::Ready(b) => Cow::Borrowed(b),
            KeyBytes::Lazy(f) => Cow::Owned(f()),
        }
    }
}

/// The state of the key being processed: where it is, its group, its byte form, and the clocks
/// TTLs read.
pub(crate) struct KeyScope<'a> {
    pub(crate) store: Store<'a>,
    pub(crate) group: usize,
    pub(crate) key: KeyBytes<'a>,
    pub(crate) watermark: i64,
    pub(crate) processing_time: i64,
    /// The event time of the record or timer being handled.
    pub(crate) timestamp: Option<i64>,
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

/// What a state view needs of its declaration.
pub(crate) struct Spec<'h, T> {
    pub(crate) id: StateId,
    pub(crate) name: &'h str,
    pub(crate) ser: &'h dyn Serializer<T>,
    pub(crate) ttl: Option<&'h Ttl>,
}

impl KeyScope<'_> {
    /// The entry key of state `id` with user key `user` (byte-addressed backends).
    pub(crate) fn entry_key(&self, id: StateId, user: &[u8]) -> Vec<u8> {
        let key = self.key.get();
        let mut k = Vec::with_capacity(key.len() + 2 + user.len());
        k.extend_from_slice(&key);
        k.extend_from_slice(&id.to_be_bytes());
        k.extend_from_slice(user);
        k
    }

    /// The time an entry's expiry is compared with (see [`Ttl::event_time`]).
    #[inline]
    fn now(&self, ttl: &Ttl) -> i64 {
        match ttl.domain {
            TimeDomain::EventTime => self
                .timestamp
                .map_or(self.watermark, |t| t.max(self.watermark)),
            TimeDomain::ProcessingTime => self.processing_time,
        }
    }

    /// The expiry of an entry written now.
    #[inline]
    fn expiry(&self, ttl: Option<&Ttl>) -> Option<i64> {
        ttl.map(|t| {
            let at = match t.domain {
                TimeDomain::EventTime => self.timestamp.unwrap_or(self.watermark),
                TimeDomain::ProcessingTime => self.processing_time,
            };
            at.saturating_add(t.after_ms)
        })
    }

    #[inline]
    fn alive(&self, expiry: Option<i64>, ttl: Option<&Ttl>) -> bool {
        match (expiry, ttl) {
            (Some(e), Some(t)) => e > self.now(t),
            _ => true,
        }
    }

    /// A byte entry's payload: without its expiry if it has a TTL; `None` if expired (or too
    /// short to hold an expiry).
    fn live<'b>(&self, bytes: &'b [u8], ttl: Option<&Ttl>) -> Option<&'b [u8]> {
        match ttl {
            None => Some(bytes),
            Some(t) => {
                let (expiry, rest) = bytes.split_first_chunk::<8>()?;
                (i64::from_be_bytes(*expiry) > self.now(t)).then_some(rest)
            }
        }
    }

    fn with_expiry(&self, ttl: Option<&Ttl>, payload: Vec<u8>) -> Vec<u8> {
        match self.expiry(ttl) {
            None => payload,
            Some(e) => {
                let mut b = Vec::with_capacity(8 + payload.len());
                b.extend_from_slice(&e.to_be_bytes());
                b.extend_from_slice(&payload);
                b
            }
        }
    }

    #[inline]
    fn slot_index(id: StateId, declared: usize) -> usize {
        heap::slot_of(id, declared)
    }

    /// Writes an entry of a byte-addressed store (the heap keeps objects: nothing to do).
    fn put_bytes(&mut self, id: StateId, user: &[u8], bytes: Vec<u8>) -> Result<(), StateError> {
        let key = self.entry_key(id, user);
        let group = self.group;
        match &mut self.store {
            Store::Bytes { backend } => backend.put(group, &key, bytes),
            Store::Heap { .. } => Ok(()),
        }
    }

    /// A one-entry state's value.
    pub(crate) fn one_get<T: Clone + 'static>(
        &self,
        s: &Spec<'_, T>,
    ) -> Result<Option<T>, StateError> {
        match &self.store {
            Store::Heap {
                states, declared, ..
            } => match states.slots.get(Self::slot_index(s.id, *declared)) {
                Some(Slot::One(c)) if self.alive(c.expiry, s.ttl) => Ok(c
                    .value
                    .as_ref()
                    .and_then(|v| v.downcast_ref::<T>())
                    .cloned()),
                _ => Ok(None),
            },
            Store::Bytes { backend } => {
                let key = self.entry_key(s.id, &[]);
                match backend.get(self.group, &key)? {
                    None => Ok(None),
                    Some(b) => match self.live(&b, s.ttl) {
                        None => Ok(None),
                        Some(p) => decode(s.name, s.ser, p).map(Some),
                    },
                }
            }
        }
    }

    /// Sets a one-entry state's value.
    pub(crate) fn one_set<T: Send + 'static>(
        &mut self,
        s: &Spec<'_, T>,
        value: T,
    ) -> Result<(), StateError> {
        let expiry = self.expiry(s.ttl);
        match &mut self.store {
            Store::Heap {
                states,
                epoch,
                declared,
            } => {
                let e = *epoch;
                states.epoch = e;
                let slot = states.slot(Self::slot_index(s.id, *declared));
                // The value in place where one of the type is there (no allocation).
                if let Slot::One(c) = slot
                    && let Some(old) = c.value.as_mut().and_then(|v| v.downcast_mut::<T>())
                {
                    *old = value;
                    c.expiry = expiry;
                    c.epoch = e;
                } else {
                    *slot = Slot::One(Cell {
                        value: Some(object(value)),
                        expiry,
                        epoch: e,
                    });
                }
                Ok(())
            }
            Store::Bytes { .. } => {
                let payload = encode(s.name, s.ser, &value)?;
                let bytes = self.with_expiry(s.ttl, payload);
                self.put_bytes(s.id, &[], bytes)
            }
        }
    }

    /// Deletes a one-entry state's value.
    pub(crate) fn one_clear(&mut self, id: StateId) -> Result<(), StateError> {
        let key = match &self.store {
            Store::Bytes { .. } => Some(self.entry_key(id, &[])),
            Store::Heap { .. } => None,
        };
        let group = self.group;
        match &mut self.store {
            Store::Heap {
                states,
                epoch,
                declared,
            } => {
                let e = *epoch;
                let slot = Self::slot_index(id, *declared);
                if let Some(Slot::One(c)) = states.slots.get_mut(slot)
                    && c.value.is_some()
                {
                    c.value = None;
                    c.epoch = e;
                    states.epoch = e;
                }
                Ok(())
            }
            Store::Bytes { backend } => backend.delete(group, &key.unwrap_or_default()),
        }
    }

    /// One entry of a many-entry state.
    pub(crate) fn many_get<T: Clone + 'static>(
        &self,
        s: &Spec<'_, T>,
        user: &[u8],
    ) -> Result<Option<T>, StateError> {
        match &self.store {
            Store::Heap {
                states, declared, ..
            } => match states.slots.get(Self::slot_index(s.id, *declared)) {
                Some(Slot::Many(m)) => Ok(m
                    .get(user)
                    .filter(|c| self.alive(c.expiry, s.ttl))
                    .and_then(|c| c.value.as_ref())
                    .and_then(|v| v.downcast_ref::<T>())
                    .cloned()),
                _ => Ok(None),
            },
            Store::Bytes { backend } => {
                let key = self.entry_key(s.id, user);
                match backend.get(self.group, &key)? {
                    None => Ok(None),
                    Some(b) => match self.live(&b, s.ttl) {
                        None => Ok(None),
                        Some(p) => decode(s.name, s.ser, p).map(Some),
                    },
                }
            }
        }
    }

    /// Writes one entry of a many-entry state.
    pub(crate) fn many_put<T: Send + 'static>(
        &mut self,
        s: &Spec<'_, T>,
        user: Vec<u8>,
        value: T,
    ) -> Result<(), StateError> {
        let expiry = self.expiry(s.ttl);
        match &mut self.store {
            Store::Heap {
                states,
                epoch,
                declared,
            } => {
                let e = *epoch;
                states.epoch = e;
                let slot = states.slot(Self::slot_index(s.id, *declared));
                if !matches!(slot, Slot::Many(_)) {
                    *slot = Slot::Many(BTreeMap::new());
                }
                if let Slot::Many(m) = slot {
                    m.insert(
                        user,
                        Cell {
                            value: Some(object(value)),
                            expiry,
                            epoch: e,
                        },
                    );
                }
                Ok(())
            }
            Store::Bytes { .. } => {
                let payload = encode(s.name, s.ser, &value)?;
                let bytes = self.with_expiry(s.ttl, payload);
                self.put_bytes(s.id, &user, bytes)
            }
        }
    }

    /// Deletes one entry of a many-entry state (`None`: every entry).
    pub(crate) fn many_delete(
        &mut self,
        id: StateId,
        user: Option<&[u8]>,
    ) -> Result<(), StateError> {
        let key = match &self.store {
            Store::Bytes { .. } => Some(self.entry_key(id, user.unwrap_or_default())),
            Store::Heap { .. } => None,
        };
        let group = self.group;
        match &mut self.store {
            Store::Heap {
                states,
                epoch,
                declared,
            } => {
                let e = *epoch;
                if let Some(Slot::Many(m)) = states.slots.get_mut(Self::slot_index(id, *declared)) {
                    let mut changed = false;
                    let mut kill = |c: &mut Cell| {
                        if c.value.is_some() {
                            c.value = None;
                            c.epoch = e;
                            changed = true;
                        }
                    };
                    match user {
                        Some(u) => {
                            if let Some(c) = m.get_mut(u) {
                                kill(c);
                            }
                        }
                        None => m.values_mut().for_each(kill),
                    }
                    if changed {
                        states.epoch = e;
                    }
                }
                Ok(())
            }
            Store::Bytes { backend } => {
                let key = key.unwrap_or_default();
                match user {
                    Some(_) => backend.delete(group, &key),
                    None => backend.delete_prefix(group, &key),
                }
            }
        }
    }

    /// Every live entry of a many-entry state, by user key.
    pub(crate) fn many_entries<T: Clone + 'static>(
        &self,
        s: &Spec<'_, T>,
    ) -> Result<Vec<(Vec<u8>, T)>, StateError> {
        match &self.store {
            Store::Heap {
                states, declared, ..
            } => match states.slots.get(Self::slot_index(s.id, *declared)) {
                Some(Slot::Many(m)) => Ok(m
                    .iter()
                    .filter(|(_, c)| self.alive(c.expiry, s.ttl))
                    .filter_map(|(k, c)| {
                        c.value
                            .as_ref()
                            .and_then(|v| v.downcast_ref::<T>())
                            .map(|v| (k.clone(), v.clone()))
                    })
                    .collect()),
                _ => Ok(Vec::new()),
            },
            Store::Bytes { backend } => {
                let prefix = self.entry_key(s.id, &[]);
                let mut out = Vec::new();
                for (k, v) in backend.scan(self.group, &prefix)? {
                    if let Some(p) = self.live(&v, s.ttl) {
                        out.push((k[prefix.len()..].to_vec(), decode(s.name, s.ser, p)?));
                    }
                }
                Ok(out)
            }
        }
    }

    /// Writes a timer's entry: an entry of a many-entry state holding nothing.
    pub(crate) fn timer_put(&mut self, id: StateId, time: &[u8]) -> Result<(), StateError> {
        let unit = Postcard::<()>::default();
        let spec = Spec {
            id,
            name: "timers",
            ser: &unit,
            ttl: None,
        };
        self.many_put(&spec, time.to_vec(), ())
    }

    /// The greatest user key of a many-entry state (deleted entries included).
    pub(crate) fn many_last(&self, id: StateId) -> Result<Option<Vec<u8>>, StateError> {
        match &self.store {
            Store::Heap {
                states, declared, ..
            } => match states.slots.get(Self::slot_index(id, *declared)) {
                Some(Slot::Many(m)) => Ok(m.keys().next_back().cloned()),
                _ => Ok(None),
            },
            Store::Bytes { backend } => {
                let prefix = self.entry_key(id, &[]);
                Ok(backend
                    .last_key(self.group, &prefix)?
                    .map(|k| k[prefix.len()..].to_vec()))
            }
        }
    }
}

/// The current key's value state.
pub struct ValueState<'s, 'a, T> {
    pub(crate) scope: &'s mut KeyScope<'a>,
    pub(crate) handle: &'s ValueHandle<T>,
}

impl<T: Clone + Send + 'static> ValueState<'_, '_, T> {
    /// The value, if set (and not expired).
    pub fn get(&self) -> Result<Option<T>, StateError> {
        self.scope.one_get(&self.handle.0.spec())
    }

    /// Sets the value.
    pub fn set(&mut self, value: T) -> Result<(), StateError> {
        let h = self.handle;
        self.scope.one_set(&h.0.spec(), value)
    }

    /// Removes the value.
    pub fn clear(&mut self) -> Result<(), StateError> {
        self.scope.one_clear(self.handle.0.id)
    }
}

/// The current key's map state.
pub struct MapState<'s, 'a, K, V> {
    pub(crate) scope: &'s mut KeyScope<'a>,
    pub(crate) handle: &'s MapHandle<K, V>,
}

impl<K, V: Clone + Send + 'static> MapState<'_, '_, K, V> {
    fn user(&self, k: &K) -> Result<Vec<u8>, StateError> {
        encode(&self.handle.values.name, self.handle.keys.as_ref(), k)
    }

    /// The value at `k`.
    pub fn get(&self, k: &K) -> Result<Option<V>, StateError> {
        let user = self.user(k)?;
        self.scope.many_get(&self.handle.values.spec(), &user)
    }

    /// Whether `k` has a value.
    pub fn contains(&self, k: &K) -> Result<bool, StateError> {
        Ok(self.get(k)?.is_some())
    }

    /// Sets the value at `k`.
    pub fn insert(&mut self, k: &K, v: V) -> Result<(), StateError> {
        let user = self.user(k)?;
        let h = self.handle;
        self.scope.many_put(&h.values.spec(), user, v)
    }

    /// Removes the value at `k`.
    pub fn remove(&mut self, k: &K) -> Result<(), StateError> {
        let user = self.user(k)?;
        self.scope.many_delete(self.handle.values.id, Some(&user))
    }

    /// Every entry, in the order of the keys' serialized form.
    pub fn entries(&self) -> Result<Vec<(K, V)>, StateError> {
        let h = self.handle;
        self.scope
            .many_entries(&h.values.spec())?
            .into_iter()
            .map(|(k, v)| Ok((decode(&h.values.name, h.keys.as_ref(), &k)?, v)))
            .collect()
    }

    /// Whether the map has no (live) entry.
    pub fn is_empty(&self) -> Result<bool, StateError> {
        Ok(self
            .scope
            .many_entries(&self.handle.values.spec())?
            .is_empty())
    }

    /// Removes every entry.
    pub fn clear(&mut self) -> Result<(), StateError> {
        self.scope.many_delete(self.handle.values.id, None)
    }
}

/// The current key's list state. Elements are entries of their own (sequence numbered), so an
/// append writes one entry and reads none but the last key.
pub struct ListState<'s, 'a, T> {
    pub(crate) scope: &'s mut KeyScope<'a>,
    pub(crate) handle: &'s ListHandle<T>,
}

impl<T: Clone + Send + 'static> ListState<'_, '_, T> {
    /// Appends `value`.
    pub fn add(&mut self, value: T) -> Result<(), StateError> {
        let h = &self.handle.0;
        let next = match self.scope.many_last(h.id)? {
            None => 0u64,
            Some(last) => {
                let seq = <[u8; 8]>::try_from(last.as_slice()).map_err(|_| {
                    StateError::Backend(format!("list {:?}: malformed element key", h.name))
                })?;
                u64::from_be_bytes(seq) + 1
            }
        };
        self.scope
            .many_put(&h.spec(), next.to_be_bytes().to_vec(), value)
    }

    /// Every (live) element, in the order added.
    pub fn get(&self) -> Result<Vec<T>, StateError> {
        Ok(self
            .scope
            .many_entries(&self.handle.0.spec())?
            .into_iter()
            .map(|(_, v)| v)
            .collect())
    }

    /// Replaces the list with `values`.
    pub fn update(&mut self, values: Vec<T>) -> Result<(), StateError> {
        self.clear()?;
        for v in values {
            self.add(v)?;
        }
        Ok(())
    }

    /// Removes every element.
    pub fn clear(&mut self) -> Result<(), StateError> {
        self.scope.many_delete(self.handle.0.id, None)
    }
}

/// The current key's reducing state.
pub struct ReducingState<'s, 'a, T> {
    pub(crate) scope: &'s mut KeyScope<'a>,
    pub(crate) handle: &'s ReducingHandle<T>,
}

impl<T: Clone + Send + 'static> ReducingState<'_, '_, T> {
    /// The folded value, if any was added.
    pub fn get(&self) -> Result<Option<T>, StateError> {
        self.scope.one_get(&self.handle.values.spec())
    }

    /// Folds `value` in.
    pub fn add(&mut self, value: T) -> Result<(), StateError> {
        let h = self.handle;
        let folded = match self.scope.one_get(&h.values.spec())? {
            None => value,
            Some(acc) => (h.reduce)(acc, value),
        };
        self.scope.one_set(&h.values.spec(), folded)
    }

    /// Removes the value.
    pub fn clear(&mut self) -> Result<(), StateError> {
        self.scope.one_clear(self.handle.values.id)
    }
}

/// The current key's aggregating state.
pub struct AggregatingState<'s, 'a, A: AggregateFunction> {
    pub(crate) scope: &'s mut KeyScope<'a>,
    pub(crate) handle: &'s AggregatingHandle<A>,
}

impl<A: AggregateFunction> AggregatingState<'_, '_, A>
where
    A::Acc: Clone + Send,
{
    /// The result, if any value was added.
    pub fn get(&self) -> Result<Option<A::Out>, StateError> {
        let h = self.handle;
        Ok(self
            .scope
            .one_get(&h.values.spec())?
            .map(|acc| h.agg.result(&acc)))
    }

    /// Folds `value` in.
    pub fn add(&mut self, value: A::In) -> Result<(), StateError> {
        let h = self.handle;
        let acc = self
            .scope
            .one_get(&h.values.spec())?
            .unwrap_or_else(|| h.agg.create());
        let acc = h.agg.add(value, acc);
        self.scope.one_set(&h.values.spec(), acc)
    }

    /// Removes the accumulator.
    pub fn clear(&mut self) -> Result<(), StateError> {
        self.scope.one_clear(self.handle.values.id)
    }
}
