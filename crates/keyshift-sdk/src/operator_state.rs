//! Operator state: what a keyed step keeps per subtask rather than per key (Flink's operator
//! state), with the redistribution it declares for a change of parallelism.
//!
//! Keyed state moves with its key's group. State without a key (a per-subtask buffer, a running
//! total, a connection's bookkeeping) cannot be split by key, so a step declares how its entries
//! go to the subtasks of a run at another parallelism ([`Redistribution`]):
//!
//! * a list declared [`OperatorListStateDescriptor::split`]: the entries of every old subtask are
//!   divided evenly over the new ones, each entry landing on exactly one;
//! * a list declared [`OperatorListStateDescriptor::union`]: every new subtask gets every entry;
//! * a [`BroadcastStateDescriptor`]: one value, the same on every subtask, copied to every new
//!   subtask (copies that differ are refused at the rescale, never resolved by picking one);
//! * a list that declares neither: the job restores at its parallelism, and a rescale is refused
//!   naming the state and the choices.
//!
//! A function declares operator states in `declare` beside its keyed ones (the names share one
//! namespace) and reaches them through its [`Context`](crate::Context)
//! (`ctx.operator_list(&h)`, `ctx.broadcast(&h)`), whatever key is in scope. Every snapshot
//! writes a subtask's operator state whole, in one section ([`OperatorStates::encode`]): keep
//! it small (keyed state is where large state belongs). A restore reads the sections of every
//! subtask of the run that wrote them and gives this subtask its share
//! ([`OperatorStates::restore`]); a changed declaration (kind, version, serializer) or a state
//! the job no longer declares is refused by name, as keyed state is (`Declarations::drop_state`
//! drops one).

use crate::block::{checked, crc};
use crate::error::{BlockError, StateError};
use crate::key::put_varint;
use crate::serializer::{Postcard, Serializer};
use crate::state::{DeclarationError, Declarations, MAX_STATES, Migration};
pub use crate::state::{OperatorDeclaration, OperatorStateKind};
pub use keyshift_core::redistribution::{Redistribution, RedistributionError};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;

use std::sync::Arc;

/// The first bytes of a subtask's operator-state section.
pub const OPERATOR_STATE_MAGIC: [u8; 4] = *b"KSOS";
/// The section's format version.
const FORMAT_VERSION: u16 = 1;

fn declaration(name: String, kind: OperatorStateKind, serializer: &str) -> OperatorDeclaration {
    OperatorDeclaration {
        name,
        kind,
        version: 1,
        serializer: serializer.to_owned(),
        redistribution: match kind {
            OperatorStateKind::List => None,
            OperatorStateKind::Broadcast => Some(Redistribution::Broadcast),
        },
    }
}

/// Declares an operator list state of `T` (entries per subtask).
pub struct OperatorListStateDescriptor<T> {
    decl: OperatorDeclaration,
    ser: Arc<dyn Serializer<T>>,
}

impl<T: Serialize + DeserializeOwned + 'static> OperatorListStateDescriptor<T> {
    /// A list named `name`, serialized with [`Postcard`], with no redistribution declared (a
    /// rescale is refused until one is: [`Self::split`], [`Self::union`]).
    pub fn new(name: impl Into<String>) -> Self {
        Self::with_serializer(name, Postcard::<T>::default())
    }
}

impl<T: 'static> OperatorListStateDescriptor<T> {
    /// A list named `name`, serialized with `ser`.
    pub fn with_serializer(name: impl Into<String>, ser: impl Serializer<T> + 'static) -> Self {
        OperatorListStateDescriptor {
            decl: declaration(name.into(), OperatorStateKind::List, ser.name()),
            ser: Arc::new(ser),
        }
    }

    /// At a rescale, the entries of every subtask are divided evenly over the new subtasks,
    /// each entry to exactly one (Flink's list state).
    pub fn split(mut self) -> Self {
        self.decl.redistribution = Some(Redistribution::Split);
        self
    }

    /// At a rescale, every new subtask gets every entry (Flink's union list state).
    pub fn union(mut self) -> Self {
        self.decl.redistribution = Some(Redistribution::Union);
        self
    }

    /// Sets the version of the entries' type (1 by default); a snapshot of another version is
    /// refused, naming both.
    pub fn version(mut self, version: u32) -> Self {
        self.decl.version = version;
        self
    }

    /// The declaration as snapshots record it.
    pub fn declaration(&self) -> &OperatorDeclaration {
        &self.decl
    }
}

/// Declares a broadcast state of `T`: one value that every subtask holds the same copy of.
pub struct BroadcastStateDescriptor<T> {
    decl: OperatorDeclaration,
    ser: Arc<dyn Serializer<T>>,
}

impl<T: Serialize + DeserializeOwned + 'static> BroadcastStateDescriptor<T> {
    /// A broadcast state named `name`, serialized with [`Postcard`].
    pub fn new(name: impl Into<String>) -> Self {
        Self::with_serializer(name, Postcard::<T>::default())
    }
}

impl<T: 'static> BroadcastStateDescriptor<T> {
    /// A broadcast state named `name`, serialized with `ser`.
    pub fn with_serializer(name: impl Into<String>, ser: impl Serializer<T> + 'static) -> Self {
        BroadcastStateDescriptor {
            decl: declaration(name.into(), OperatorStateKind::Broadcast, ser.name()),
            ser: Arc::new(ser),
        }
    }

    /// Sets the version of the value's type (1 by default).
    pub fn version(mut self, version: u32) -> Self {
        self.decl.version = version;
        self
    }

    /// The declaration as snapshots record it.
    pub fn declaration(&self) -> &OperatorDeclaration {
        &self.decl
    }
}

/// A declared operator list state; use it with `Context::operator_list`.
pub struct OperatorListHandle<T> {
    id: usize,
    name: Arc<str>,
    ser: Arc<dyn Serializer<T>>,
}

/// A declared broadcast state; use it with `Context::broadcast`.
pub struct BroadcastHandle<T> {
    id: usize,
    name: Arc<str>,
    ser: Arc<dyn Serializer<T>>,
}

impl Declarations {
    fn add_operator(&mut self, decl: &OperatorDeclaration) -> Result<usize, DeclarationError> {
        if decl.name.is_empty() {
            return Err(DeclarationError::EmptyName);
        }
        if self.is_declared(&decl.name) {
            return Err(DeclarationError::Duplicate(decl.name.clone()));
        }
        if self.operator.len() >= MAX_STATES {
            return Err(DeclarationError::TooMany);
        }
        self.operator.push(decl.clone());
        Ok(self.operator.len() - 1)
    }

    /// Declares an operator list state.
    pub fn operator_list<T: 'static>(
        &mut self,
        d: OperatorListStateDescriptor<T>,
    ) -> Result<OperatorListHandle<T>, DeclarationError> {
        Ok(OperatorListHandle {
            id: self.add_operator(&d.decl)?,
            name: d.decl.name.as_str().into(),
            ser: d.ser,
        })
    }

    /// Declares a broadcast state.
    pub fn broadcast<T: 'static>(
        &mut self,
        d: BroadcastStateDescriptor<T>,
    ) -> Result<BroadcastHandle<T>, DeclarationError> {
        Ok(BroadcastHandle {
            id: self.add_operator(&d.decl)?,
            name: d.decl.name.as_str().into(),
            ser: d.ser,
        })
    }

    /// The operator states declared, in order.
    pub fn operator_states(&self) -> &[OperatorDeclaration] {
        &self.operator
    }

    /// Reads snapshots written under version `from_version` of the operator state `handle`
    /// declares (its entries then postcard-serialized `O`s) by converting each entry with
    /// `convert`, as [`Declarations::migrate`] does for keyed state. Its kind cannot change
    /// this way; a version no migration reads is refused, naming both.
    pub fn migrate_operator<H, O>(
        &mut self,
        handle: &H,
        from_version: u32,
        convert: impl Fn(O) -> H::Value + Send + Sync + 'static,
    ) -> Result<(), DeclarationError>
    where
        H: OperatorStateHandle,
        H::Value: 'static,
        O: DeserializeOwned + 'static,
    {
        let at = handle.declared_index();
        let decl = self.operator.get(at).map(|d| (&*d.name, d.version));
        let m = Migration::checked(decl, handle.value_serializer(), from_version, convert)?;
        self.operator_migrations.entry(at).or_default().push(m);
        Ok(())
    }
}

/// A handle of a declared operator state: its index, and the serializer of its entries (what a
/// migration writes).
pub trait OperatorStateHandle {
    /// The type of the state's entries.
    type Value;
    #[doc(hidden)]
    fn declared_index(&self) -> usize;
    #[doc(hidden)]
    fn value_serializer(&self) -> Arc<dyn Serializer<Self::Value>>;
}

impl<T> OperatorStateHandle for OperatorListHandle<T> {
    type Value = T;
    fn declared_index(&self) -> usize {
        self.id
    }
    fn value_serializer(&self) -> Arc<dyn Serializer<T>> {
        self.ser.clone()
    }
}

impl<T> OperatorStateHandle for BroadcastHandle<T> {
    type Value = T;
    fn declared_index(&self) -> usize {
        self.id
    }
    fn value_serializer(&self) -> Arc<dyn Serializer<T>> {
        self.ser.clone()
    }
}

/// One subtask's operator states: each declared state's entries, serialized.
#[derive(Clone, Default)]
pub struct OperatorStates {
    decls: Vec<OperatorDeclaration>,
    entries: Vec<Vec<Vec<u8>>>,
    /// States of earlier releases a restore leaves behind (`Declarations::drop_state`).
    dropped: Vec<String>,
    /// How older versions are read, by state index (`Declarations::migrate_operator`).
    migrations: BTreeMap<usize, Vec<Migration>>,
}

impl std::fmt::Debug for OperatorStates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OperatorStates")
            .field("decls", &self.decls)
            .field(
                "entries",
                &self.entries.iter().map(Vec::len).collect::<Vec<_>>(),
            )
            .field("dropped", &self.dropped)
            .finish_non_exhaustive()
    }
}

/// A subtask's operator-state section, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperatorSection {
    /// The step's uid.
    pub operator: String,
    /// The subtask that wrote it.
    pub subtask: u32,
    /// The parallelism of the run that wrote it.
    pub parallelism: u32,
    /// Each state and its entries.
    pub states: Vec<(OperatorDeclaration, Vec<Vec<u8>>)>,
}

fn err(what: &'static str) -> BlockError {
    BlockError::Malformed(what)
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

impl OperatorStates {
    /// The operator states `declarations` declares, empty (with the migrations and the dropped
    /// states it declares).
    pub fn new(declarations: &Declarations) -> Self {
        OperatorStates {
            decls: declarations.operator.clone(),
            entries: vec![Vec::new(); declarations.operator.len()],
            dropped: declarations.dropped.clone(),
            migrations: declarations.operator_migrations.clone(),
        }
    }

    /// The declarations.
    pub fn declarations(&self) -> &[OperatorDeclaration] {
        &self.decls
    }

    /// Whether the step declares any operator state.
    pub fn is_declared(&self) -> bool {
        !self.decls.is_empty()
    }

    /// Entries over every state.
    pub fn entries(&self) -> usize {
        self.entries.iter().map(Vec::len).sum()
    }

    /// The serialized entries of the state named `name`.
    pub fn raw(&self, name: &str) -> Option<&[Vec<u8>]> {
        let i = self.decls.iter().position(|d| d.name == name)?;
        Some(&self.entries[i])
    }

    fn slot(&mut self, id: usize, name: &str) -> Result<&mut Vec<Vec<u8>>, StateError> {
        self.entries
            .get_mut(id)
            .ok_or_else(|| StateError::Undeclared(name.to_owned()))
    }

    /// The section a snapshot keeps of this subtask's operator state (`None` when the step
    /// declares none: its snapshots have no section). Ends with a CRC-32 of what precedes it.
    pub fn encode(&self, operator: &str, subtask: u32, parallelism: u32) -> Option<Vec<u8>> {
        if self.decls.is_empty() {
            return None;
        }
        let mut out =
            Vec::with_capacity(64 + self.entries.iter().flatten().map(Vec::len).sum::<usize>());
        out.extend_from_slice(&OPERATOR_STATE_MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        put_bytes(&mut out, operator.as_bytes());
        put_varint(&mut out, u64::from(subtask));
        put_varint(&mut out, u64::from(parallelism));
        put_varint(&mut out, self.decls.len() as u64);
        for (d, entries) in self.decls.iter().zip(&self.entries) {
            put_bytes(&mut out, d.name.as_bytes());
            out.push(d.kind.code());
            put_varint(&mut out, u64::from(d.version));
            put_bytes(&mut out, d.serializer.as_bytes());
            out.push(Redistribution::code(d.redistribution));
            put_varint(&mut out, entries.len() as u64);
            for e in entries {
                put_bytes(&mut out, e);
            }
        }
        let c = crc(&out);
        out.extend_from_slice(&c.to_le_bytes());
        Some(out)
    }

    /// Decodes a section, checking its magic, checksum and version.
    pub fn decode(section: &[u8]) -> Result<OperatorSection, BlockError> {
        let mut r = checked(section, OPERATOR_STATE_MAGIC, 10)?;
        let version = u16::from_le_bytes(r.array("operator-state format version")?);
        if version != FORMAT_VERSION {
            return Err(BlockError::UnsupportedVersion(version));
        }
        let operator = r.string("operator-state uid")?;
        let small = |v: u64, what: &'static str| u32::try_from(v).map_err(|_| err(what));
        let subtask = small(
            r.varint("operator-state subtask")?,
            "operator-state subtask",
        )?;
        let parallelism = small(
            r.varint("operator-state parallelism")?,
            "operator-state parallelism",
        )?;
        if subtask >= parallelism {
            return Err(err("operator-state subtask beyond its parallelism"));
        }
        let n = r.varint("operator-state count")?;
        let mut states = Vec::new();
        for _ in 0..n {
            let name = r.string("operator-state name")?;
            let kind = OperatorStateKind::from_code(r.u8("operator-state kind")?)
                .ok_or(err("operator-state kind"))?;
            let version = small(
                r.varint("operator-state version")?,
                "operator-state version",
            )?;
            let serializer = r.string("operator-state serializer")?;
            let redistribution = Redistribution::from_code(r.u8("operator-state redistribution")?)
                .ok_or(err("operator-state redistribution"))?;
            let count = r.varint("operator-state entries")?;
            let mut entries = Vec::new();
            for _ in 0..count {
                entries.push(r.bytes("operator-state entry")?.to_vec());
            }
            states.push((
                OperatorDeclaration {
                    name,
                    kind,
                    version,
                    serializer,
                    redistribution,
                },
                entries,
            ));
        }
        if !r.at_end() {
            return Err(err("bytes after the operator states"));
        }
        Ok(OperatorSection {
            operator,
            subtask,
            parallelism,
            states,
        })
    }

    /// Replaces this subtask's operator state with its share of `sections` (one per subtask of
    /// the run that wrote them, in any order) for subtask `subtask` of `parallelism`. Every
    /// section is checked, and the declarations compared, before anything is replaced: on an
    /// error the state is as it was. No sections: the states start empty.
    pub fn restore(
        &mut self,
        operator: &str,
        sections: &[&[u8]],
        subtask: u32,
        parallelism: u32,
    ) -> Result<(), BlockError> {
        let mut decoded = sections
            .iter()
            .map(|s| Self::decode(s))
            .collect::<Result<Vec<_>, _>>()?;
        decoded.sort_by_key(|s| s.subtask);
        let from = decoded.first().map_or(0, |s| s.parallelism);
        for (i, s) in decoded.iter().enumerate() {
            if s.operator != operator {
                return Err(BlockError::Operator {
                    block: s.operator.clone(),
                    job: operator.to_owned(),
                });
            }
            if s.parallelism != from || s.subtask != i as u32 {
                return Err(BlockError::OperatorStateSections {
                    found: decoded.iter().map(|s| (s.subtask, s.parallelism)).collect(),
                });
            }
        }
        if decoded.len() as u32 != from {
            return Err(BlockError::OperatorStateSections {
                found: decoded.iter().map(|s| (s.subtask, s.parallelism)).collect(),
            });
        }
        // Every state of the snapshot is declared (or dropped), the same way or through a
        // migration the job declares, which converts its entries.
        let mut migrate: Vec<(String, &Migration)> = Vec::new();
        for (d, _) in decoded.first().map_or(&[][..], |s| s.states.as_slice()) {
            let Some(at) = self.decls.iter().position(|o| o.name == d.name) else {
                if self.dropped.contains(&d.name) {
                    continue;
                }
                return Err(BlockError::UndeclaredState {
                    name: d.name.clone(),
                });
            };
            let o = &self.decls[at];
            if o.compatibility() == d.compatibility() {
                continue;
            }
            let migration = self.migrations.get(&at).and_then(|ms| {
                ms.iter()
                    .find(|m| m.from_version == d.version && m.from_serializer == d.serializer)
            });
            match migration.filter(|_| o.kind == d.kind) {
                Some(m) => migrate.push((d.name.clone(), m)),
                None => {
                    return Err(BlockError::StateChanged {
                        name: d.name.clone(),
                        block: d.compatibility(),
                        job: o.compatibility(),
                    });
                }
            }
        }
        for (name, m) in migrate {
            let states = decoded.iter_mut().flat_map(|s| s.states.iter_mut());
            for (_, entries) in states.filter(|(d, _)| d.name == name) {
                for e in entries.iter_mut() {
                    *e = (m.convert)(e).map_err(|why| {
                        BlockError::Undecodable(format!(
                            "migrating operator state {name:?} from version {}: {why}",
                            m.from_version
                        ))
                    })?;
                }
            }
        }
        let mut entries = Vec::with_capacity(self.decls.len());
        for d in &self.decls {
            let old: Vec<Vec<Vec<u8>>> = decoded
                .iter()
                .map(|s| {
                    s.states
                        .iter()
                        .find(|(o, _)| o.name == d.name)
                        .map(|(_, e)| e.clone())
                        .unwrap_or_default()
                })
                .collect();
            let declared_anywhere = decoded
                .iter()
                .any(|s| s.states.iter().any(|(o, _)| o.name == d.name));
            entries.push(if declared_anywhere {
                keyshift_core::redistribution::entries_for(
                    &d.name,
                    d.redistribution,
                    &old,
                    parallelism,
                    subtask,
                )?
            } else {
                Vec::new()
            });
        }
        self.entries = entries;
        Ok(())
    }
}

/// One entry of a snapshot's operator state as people read it (`keyshift savepoint dump`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct OperatorEntryView {
    /// The state's declared name.
    pub operator_state: String,
    /// `operator list` or `broadcast`.
    pub kind: String,
    /// The subtask that wrote it, of `parallelism`.
    pub subtask: u32,
    pub parallelism: u32,
    /// Its position in the subtask's list.
    pub index: u64,
    /// The value, for a state serialized as JSON.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<serde_json::Value>,
    /// The value as stored (hex), for any other serializer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value_hex: Option<String>,
}

impl OperatorSection {
    /// Every entry, by state and position.
    pub fn describe(&self) -> Vec<OperatorEntryView> {
        let mut out = Vec::new();
        for (d, entries) in &self.states {
            for (i, e) in entries.iter().enumerate() {
                let value = crate::block::as_json(&d.serializer, e);
                out.push(OperatorEntryView {
                    operator_state: d.name.clone(),
                    kind: d.kind.to_string(),
                    subtask: self.subtask,
                    parallelism: self.parallelism,
                    index: i as u64,
                    value_hex: value.is_none().then(|| crate::block::hex(e)),
                    value,
                });
            }
        }
        out
    }
}

/// A subtask's operator list state, in a function's [`Context`](crate::Context).
pub struct OperatorList<'s, T> {
    pub(crate) states: &'s mut OperatorStates,
    pub(crate) handle: &'s OperatorListHandle<T>,
}

/// One entry of the operator state `name` in its serializer's bytes.
fn encode<T>(name: &str, ser: &dyn Serializer<T>, value: &T) -> Result<Vec<u8>, StateError> {
    let mut b = Vec::new();
    ser.serialize(value, &mut b)
        .map_err(|source| StateError::Serialize {
            state: name.to_owned(),
            source,
        })?;
    Ok(b)
}

/// One entry of the operator state `name`, read back.
fn decode<T>(name: &str, ser: &dyn Serializer<T>, bytes: &[u8]) -> Result<T, StateError> {
    ser.deserialize(bytes)
        .map_err(|source| StateError::Serialize {
            state: name.to_owned(),
            source,
        })
}

impl<T> OperatorList<'_, T> {
    /// The subtask's entries, in order.
    pub fn get(&mut self) -> Result<Vec<T>, StateError> {
        let h = self.handle;
        let slot = self.states.slot(h.id, &h.name)?;
        slot.iter()
            .map(|e| decode(&h.name, h.ser.as_ref(), e))
            .collect()
    }

    /// Appends an entry.
    pub fn add(&mut self, value: &T) -> Result<(), StateError> {
        let h = self.handle;
        let b = encode(&h.name, h.ser.as_ref(), value)?;
        self.states.slot(h.id, &h.name)?.push(b);
        Ok(())
    }

    /// Replaces the entries.
    pub fn update(&mut self, values: &[T]) -> Result<(), StateError> {
        let h = self.handle;
        let encoded = values
            .iter()
            .map(|v| encode(&h.name, h.ser.as_ref(), v))
            .collect::<Result<Vec<_>, _>>()?;
        *self.states.slot(h.id, &h.name)? = encoded;
        Ok(())
    }

    /// The number of entries.
    pub fn len(&mut self) -> Result<usize, StateError> {
        let h = self.handle;
        Ok(self.states.slot(h.id, &h.name)?.len())
    }

    /// Whether there are no entries.
    pub fn is_empty(&mut self) -> Result<bool, StateError> {
        Ok(self.len()? == 0)
    }

    /// Removes every entry.
    pub fn clear(&mut self) -> Result<(), StateError> {
        let h = self.handle;
        self.states.slot(h.id, &h.name)?.clear();
        Ok(())
    }
}

/// A subtask's copy of a broadcast state, in a function's [`Context`](crate::Context).
pub struct Broadcast<'s, T> {
    pub(crate) states: &'s mut OperatorStates,
    pub(crate) handle: &'s BroadcastHandle<T>,
}

impl<T> Broadcast<'_, T> {
    /// The value, if set.
    pub fn get(&mut self) -> Result<Option<T>, StateError> {
        let h = self.handle;
        let slot = self.states.slot(h.id, &h.name)?;
        slot.first()
            .map(|b| decode(&h.name, h.ser.as_ref(), b))
            .transpose()
    }

    /// Sets the value. Every subtask must set the same value: a rescale refuses copies that
    /// differ.
    pub fn set(&mut self, value: &T) -> Result<(), StateError> {
        let h = self.handle;
        let b = encode(&h.name, h.ser.as_ref(), value)?;
        *self.states.slot(h.id, &h.name)? = vec![b];
        Ok(())
    }

    /// Removes the value.
    pub fn clear(&mut self) -> Result<(), StateError> {
        let h = self.handle;
        self.states.slot(h.id, &h.name)?.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn states(redistribution: Option<Redistribution>) -> (OperatorStates, OperatorListHandle<u64>) {
        let mut d = Declarations::default();
        let mut desc = OperatorListStateDescriptor::<u64>::new("totals");
        desc = match redistribution {
            Some(Redistribution::Split) => desc.split(),
            Some(Redistribution::Union) => desc.union(),
            _ => desc,
        };
        let h = d.operator_list(desc).unwrap();
        (OperatorStates::new(&d), h)
    }

    fn with(values: &[u64], redistribution: Option<Redistribution>) -> OperatorStates {
        let (mut s, h) = states(redistribution);
        OperatorList {
            states: &mut s,
            handle: &h,
        }
        .update(values)
        .unwrap();
        s
    }

    fn read(s: &mut OperatorStates, h: &OperatorListHandle<u64>) -> Vec<u64> {
        OperatorList {
            states: s,
            handle: h,
        }
        .get()
        .unwrap()
    }

    #[test]
    fn sections_round_trip_and_detect_corruption() {
        let s = with(&[1, 2, 3], Some(Redistribution::Split));
        let bytes = s.encode("uid", 1, 2).unwrap();
        let section = OperatorStates::decode(&bytes).unwrap();
        assert_eq!(
            (
                section.operator.as_str(),
                section.subtask,
                section.parallelism
            ),
            ("uid", 1, 2)
        );
        assert_eq!(section.states.len(), 1);
        assert_eq!(section.states[0].1.len(), 3);
        let views = section.describe();
        assert_eq!(views.len(), 3);
        assert_eq!(
            (views[2].operator_state.as_str(), views[2].index),
            ("totals", 2)
        );
        assert_eq!(
            views[2].value_hex.as_deref(),
            Some("03"),
            "postcard 3, in hex"
        );
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            assert!(OperatorStates::decode(&bad).is_err(), "byte {i}");
        }
        assert!(OperatorStates::decode(&bytes[..bytes.len() - 1]).is_err());
        assert!(OperatorStates::default().encode("uid", 0, 1).is_none());
    }

    #[test]
    fn a_split_list_is_divided_over_a_non_divisor_rescale_both_ways() {
        let old: Vec<Vec<u8>> = [vec![1, 2, 3, 4, 5], vec![6]]
            .iter()
            .enumerate()
            .map(|(i, v)| {
                with(v, Some(Redistribution::Split))
                    .encode("u", i as u32, 2)
                    .unwrap()
            })
            .collect();
        let refs: Vec<&[u8]> = old.iter().map(Vec::as_slice).collect();
        let mut three = Vec::new();
        for s in 0..3 {
            let (mut st, h) = states(Some(Redistribution::Split));
            st.restore("u", &refs, s, 3).unwrap();
            three.push((read(&mut st, &h), st));
        }
        assert_eq!(
            three.iter().map(|(v, _)| v.clone()).collect::<Vec<_>>(),
            vec![vec![1, 2], vec![3, 4], vec![5, 6]]
        );
        let back: Vec<Vec<u8>> = three
            .iter()
            .enumerate()
            .map(|(i, (_, st))| st.encode("u", i as u32, 3).unwrap())
            .collect();
        let refs: Vec<&[u8]> = back.iter().map(Vec::as_slice).collect();
        let mut all = Vec::new();
        for s in 0..2 {
            let (mut st, h) = states(Some(Redistribution::Split));
            st.restore("u", &refs, s, 2).unwrap();
            all.extend(read(&mut st, &h));
        }
        assert_eq!(all, vec![1, 2, 3, 4, 5, 6]);
    }

    #[test]
    fn an_undeclared_redistribution_restores_in_place_and_refuses_a_rescale() {
        let old: Vec<Vec<u8>> = (0..2)
            .map(|i| with(&[i], None).encode("u", i as u32, 2).unwrap())
            .collect();
        let refs: Vec<&[u8]> = old.iter().map(Vec::as_slice).collect();
        let (mut st, h) = states(None);
        st.restore("u", &refs, 1, 2).unwrap();
        assert_eq!(read(&mut st, &h), vec![1]);
        let before = st.entries.clone();
        let e = st.restore("u", &refs, 0, 3).unwrap_err();
        assert!(e.refuses_the_job(), "{e}");
        assert!(e.to_string().contains("\"totals\""), "{e}");
        assert_eq!(st.entries, before, "nothing replaced on an error");
    }

    #[test]
    fn changed_missing_or_foreign_sections_are_refused_by_name() {
        let one = with(&[1], Some(Redistribution::Split))
            .encode("u", 0, 1)
            .unwrap();
        // Another operator's.
        let (mut st, _) = states(Some(Redistribution::Split));
        assert!(matches!(
            st.restore("v", &[&one], 0, 1),
            Err(BlockError::Operator { .. })
        ));
        // A state the job no longer declares, unless dropped.
        let mut none = OperatorStates::new(&Declarations::default());
        assert!(matches!(
            none.restore("u", &[&one], 0, 1),
            Err(BlockError::UndeclaredState { name }) if name == "totals"
        ));
        let mut dropper = Declarations::default();
        dropper.drop_state("totals").unwrap();
        let mut dropping = OperatorStates::new(&dropper);
        dropping.restore("u", &[&one], 0, 1).unwrap();
        // Another version.
        let mut d = Declarations::default();
        d.operator_list(OperatorListStateDescriptor::<u64>::new("totals").version(2))
            .unwrap();
        let mut v2 = OperatorStates::new(&d);
        let e = v2.restore("u", &[&one], 0, 1).unwrap_err();
        assert!(
            e.to_string().contains("version 1") && e.to_string().contains("version 2"),
            "{e}"
        );
        assert!(e.refuses_the_job());
        // One subtask's section of two missing.
        let half = with(&[1], Some(Redistribution::Split))
            .encode("u", 0, 2)
            .unwrap();
        let e = st.restore("u", &[&half], 0, 1).unwrap_err();
        assert!(
            !e.refuses_the_job(),
            "a damaged snapshot, not a changed job: {e}"
        );
    }

    #[test]
    fn a_changed_version_restores_through_the_migration_the_job_declares() {
        // Release 1 kept each subtask's totals as u32s; release 2 keeps (count, label) pairs.
        let old: Vec<Vec<u8>> = (0..2u32)
            .map(|i| {
                let mut d = Declarations::default();
                let h = d
                    .operator_list(OperatorListStateDescriptor::<u32>::new("totals").split())
                    .unwrap();
                let mut s = OperatorStates::new(&d);
                OperatorList {
                    states: &mut s,
                    handle: &h,
                }
                .update(&[10 + i, 20 + i])
                .unwrap();
                s.encode("u", i, 2).unwrap()
            })
            .collect();
        let refs: Vec<&[u8]> = old.iter().map(Vec::as_slice).collect();
        let release2 = |migrate: bool| {
            let mut d = Declarations::default();
            let h = d
                .operator_list(
                    OperatorListStateDescriptor::<(u64, String)>::new("totals")
                        .split()
                        .version(2),
                )
                .unwrap();
            if migrate {
                d.migrate_operator(&h, 1, |n: u32| (u64::from(n), "v1".to_owned()))
                    .unwrap();
                assert!(matches!(
                    d.migrate_operator(&h, 2, |n: u32| (u64::from(n), String::new())),
                    Err(DeclarationError::MigrationFromItself { .. })
                ));
            }
            (OperatorStates::new(&d), h)
        };
        // Without the migration: refused, naming both versions.
        let (mut s, _) = release2(false);
        let e = s.restore("u", &refs, 0, 3).unwrap_err();
        assert!(
            e.refuses_the_job() && e.to_string().contains("version 2"),
            "{e}"
        );
        // With it: every entry converted, then split over 3.
        let mut all = Vec::new();
        for sub in 0..3 {
            let (mut s, h) = release2(true);
            s.restore("u", &refs, sub, 3).unwrap();
            all.extend(
                OperatorList {
                    states: &mut s,
                    handle: &h,
                }
                .get()
                .unwrap(),
            );
        }
        let want: Vec<(u64, String)> = [10, 20, 11, 21]
            .into_iter()
            .map(|n| (n, "v1".to_owned()))
            .collect();
        assert_eq!(all, want);
    }

    #[test]
    fn names_are_shared_with_keyed_state() {
        let mut d = Declarations::default();
        d.value(crate::state::ValueStateDescriptor::<u64>::new("n"))
            .unwrap();
        assert!(matches!(
            d.operator_list(OperatorListStateDescriptor::<u64>::new("n")),
            Err(DeclarationError::Duplicate(_))
        ));
        d.broadcast(BroadcastStateDescriptor::<u64>::new("rules"))
            .unwrap();
        assert!(matches!(
            d.value(crate::state::ValueStateDescriptor::<u64>::new("rules")),
            Err(DeclarationError::Duplicate(_))
        ));
        assert!(matches!(
            d.drop_state("rules"),
            Err(DeclarationError::DropDeclared(_))
        ));
    }

    #[test]
    fn a_broadcast_copy_reaches_every_new_subtask() {
        let mut d = Declarations::default();
        let h = d
            .broadcast(BroadcastStateDescriptor::<String>::new("rules"))
            .unwrap();
        let sections: Vec<Vec<u8>> = (0..3)
            .map(|i| {
                let mut s = OperatorStates::new(&d);
                Broadcast {
                    states: &mut s,
                    handle: &h,
                }
                .set(&"v1".to_owned())
                .unwrap();
                s.encode("u", i, 3).unwrap()
            })
            .collect();
        let refs: Vec<&[u8]> = sections.iter().map(Vec::as_slice).collect();
        for sub in 0..5 {
            let mut s = OperatorStates::new(&d);
            s.restore("u", &refs, sub, 5).unwrap();
            assert_eq!(
                Broadcast {
                    states: &mut s,
                    handle: &h
                }
                .get()
                .unwrap()
                .as_deref(),
                Some("v1")
            );
        }
    }

    /// Counts its records per key (keyed) and per subtask (a split list: one running total
    /// per subtask, several after a merge), and keeps a broadcast setting.
    struct Tally;

    impl crate::KeyedProcessFunction for Tally {
        type Key = String;
        type In = u64;
        type Out = (String, u64);
        type State = (
            crate::state::ValueHandle<u64>,
            OperatorListHandle<u64>,
            BroadcastHandle<String>,
        );

        fn declare(&self, s: &mut Declarations) -> Result<Self::State, DeclarationError> {
            Ok((
                s.value(crate::state::ValueStateDescriptor::new("n"))?,
                s.operator_list(OperatorListStateDescriptor::new("seen").split())?,
                s.broadcast(BroadcastStateDescriptor::new("mode"))?,
            ))
        }

        fn process(
            &mut self,
            _: u64,
            (n, seen, mode): &Self::State,
            ctx: &mut crate::Context<'_, String, (String, u64)>,
        ) -> crate::Result<()> {
            let c = ctx.value(n).get()?.unwrap_or(0) + 1;
            ctx.value(n).set(c)?;
            let mut totals = ctx.operator_list(seen).get()?;
            match totals.last_mut() {
                Some(t) => *t += 1,
                None => totals.push(1),
            }
            ctx.operator_list(seen).update(&totals)?;
            ctx.broadcast(mode).set(&"exact".to_owned())?;
            let key = ctx.key().clone();
            ctx.emit((key, c));
            Ok(())
        }
    }

    fn seen_total(h: &crate::testing::Harness<Tally>) -> u64 {
        h.subtasks()
            .iter()
            .flat_map(|s| s.operator_states().raw("seen").unwrap_or_default().to_vec())
            .map(|b| postcard::from_bytes::<u64>(&b).unwrap())
            .sum()
    }

    #[test]
    fn a_split_total_counts_every_record_once_through_kills_and_rescales_both_ways() {
        let input: Vec<(String, i64, u64)> = (0..700u64)
            .map(|i| (format!("k{}", i % 37), i as i64, i))
            .collect();
        let mut h = crate::testing::Harness::new("tally", || Tally, 2, 128, input, 0).unwrap();
        h.step(100).unwrap();
        h.checkpoint().unwrap();
        h.step(50).unwrap();
        h.kill().unwrap();
        assert_eq!(
            seen_total(&h),
            100,
            "the killed run's records are counted again, once"
        );
        h.step(150).unwrap();
        h.rescale(3).unwrap();
        assert_eq!(seen_total(&h), 250);
        h.step(200).unwrap();
        h.rescale(2).unwrap();
        assert_eq!(seen_total(&h), 450);
        h.change_ceiling(256, 5).unwrap();
        h.finish().unwrap();
        h.checkpoint().unwrap();
        assert_eq!(seen_total(&h), 700);
        assert_eq!(h.position(), 700);
        for s in h.subtasks() {
            let mode = s.operator_states().raw("mode").unwrap();
            assert_eq!(postcard::from_bytes::<String>(&mode[0]).unwrap(), "exact");
        }
        // The keyed counts are untouched by it: each key's last count is its record count.
        let mut last = std::collections::BTreeMap::new();
        for (_, (k, c)) in h.committed() {
            last.insert(k.clone(), *c);
        }
        assert_eq!(last.values().sum::<u64>(), 700);
    }
}
