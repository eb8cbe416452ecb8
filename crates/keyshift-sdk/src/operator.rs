//! One subtask's instance of a keyed step: a [`KeyedProcessFunction`] over the key groups the
//! subtask owns, its state in a [`StateBackend`], its timers, and the snapshot side (cut, write
//! a group in full or as a delta, restore a group's chain, drop a group) that the worker runtime
//! and the test harness drive.

use crate::block::{self, BlockHeader, BlockKind, BlockWriter, EncodedBlock};
use crate::error::{BlockError, Error, Result, StateError};
use crate::function::{Context, KeyArg, KeyedProcessFunction, Timer};
use crate::key::{RecordKey, StreamKey, decode_key, encode_record_key};
use crate::operator_state::OperatorStates;
use crate::state::backend::{Change, GroupMode, StateBackend};
use crate::state::heap::{HeapStore, ReadAhead};
use crate::state::{
    Declaration, DeclarationError, Declarations, KeyBytes, KeyScope, Migration, StateId, Store,
    TimeDomain,
};
use crate::timers::{self, Timers};
use keyshift_core::keygroup::{self, KeyGroupRange};
use std::cell::OnceCell;
use std::collections::BTreeMap;

/// The lowest watermark (nothing has been seen yet).
pub const MIN_WATERMARK: i64 = i64::MIN;

/// How many records' state a caller of [`KeyedOperator::prefetch`] reads ahead before it
/// processes the first of them. Enough for the memory reads of many keys to overlap; few
/// enough that what they read is still in the CPU's cache when the records are processed (a
/// whole batch of 2048 read ahead was measured 10-15% slower at a million keys).
pub const READ_AHEAD: usize = 32;

/// Where an operator keeps its keyed state.
enum Backend<K> {
    /// Objects in memory (the default).
    Heap(HeapStore<K>),
    /// A byte-addressed store (the shape of a disk engine).
    Bytes(Box<dyn StateBackend>),
}

/// A keyed step's operator for one subtask.
pub struct KeyedOperator<F: KeyedProcessFunction> {
    uid: String,
    function: F,
    state: F::State,
    declarations: Vec<Declaration>,
    /// How older versions of declared states are read, and states of earlier releases to drop
    /// on restore.
    evolution: Evolution,
    max_parallelism: u32,
    range: KeyGroupRange,
    backend: Backend<F::Key>,
    timers: Timers,
    /// The subtask's operator state ([`crate::operator_state`]).
    operator_states: OperatorStates,
    watermark: i64,
    processing_time: i64,
    out: Vec<(i64, F::Out)>,
}

/// A restored entry: its key, and its value (`None`: deleted, in a delta).
type Entry = (Vec<u8>, Option<Vec<u8>>);

/// How a restore reads states that changed since the snapshot was written.
struct Evolution {
    migrations: BTreeMap<StateId, Vec<Migration>>,
    dropped: Vec<String>,
}

/// Where a snapshot's state goes in this operator.
enum Target<'a> {
    /// To the declared state of this id, each value converted by the migration (whether the
    /// state has a TTL: its values start with their expiry, which stays) if it has one.
    State(StateId, Option<(&'a Migration, bool)>),
    /// Nowhere: the function drops it.
    Dropped,
}

/// `value` (an entry's value, its expiry first when `ttl`) converted by `m`.
fn migrate(m: &Migration, ttl: bool, value: &[u8]) -> Result<Vec<u8>, BlockError> {
    let (expiry, payload) = if ttl {
        value.split_at_checked(8).ok_or(BlockError::Malformed(
            "a value with a TTL shorter than its expiry",
        ))?
    } else {
        (&[][..], value)
    };
    let converted = (m.convert)(payload).map_err(|e| {
        BlockError::Undecodable(format!(
            "migrating a value of version {}: {e}",
            m.from_version
        ))
    })?;
    Ok([expiry, &converted].concat())
}

/// A record routed to a subtask that does not own its key group: a routing bug, or a key whose
/// group changed (its `key_by` is not deterministic).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "key {key} is in key group {group}, which this subtask does not own (groups {range}): key_by must give a record the same key every time"
)]
pub struct NotOwned {
    pub key: String,
    pub group: u32,
    pub range: KeyGroupRange,
}

impl<F: KeyedProcessFunction> KeyedOperator<F> {
    /// The operator of step `uid` for the groups in `range` of `max_parallelism`, state in
    /// memory (the heap backend).
    pub fn new(
        uid: impl Into<String>,
        function: F,
        max_parallelism: u32,
        range: KeyGroupRange,
    ) -> Result<Self, DeclarationError> {
        let mut declarations = Declarations::default();
        let state = function.declare(&mut declarations)?;
        let operator_states = OperatorStates::new(&declarations);
        let heap = HeapStore::new(range.len() as usize, declarations.codecs);
        let evolution = Evolution {
            migrations: declarations.migrations,
            dropped: declarations.dropped,
        };
        Ok(Self::build(
            uid.into(),
            function,
            state,
            (declarations.list, evolution, operator_states),
            max_parallelism,
            range,
            Backend::Heap(heap),
        ))
    }

    /// [`KeyedOperator::new`] with state in a byte-addressed `backend` (sized for `range`).
    pub fn with_backend(
        uid: impl Into<String>,
        function: F,
        max_parallelism: u32,
        range: KeyGroupRange,
        backend: Box<dyn StateBackend>,
    ) -> Result<Self, DeclarationError> {
        let mut declarations = Declarations::default();
        let state = function.declare(&mut declarations)?;
        let operator_states = OperatorStates::new(&declarations);
        let evolution = Evolution {
            migrations: declarations.migrations,
            dropped: declarations.dropped,
        };
        Ok(Self::build(
            uid.into(),
            function,
            state,
            (declarations.list, evolution, operator_states),
            max_parallelism,
            range,
            Backend::Bytes(backend),
        ))
    }

    fn build(
        uid: String,
        function: F,
        state: F::State,
        (declarations, evolution, operator_states): (Vec<Declaration>, Evolution, OperatorStates),
        max_parallelism: u32,
        range: KeyGroupRange,
        backend: Backend<F::Key>,
    ) -> Self {
        KeyedOperator {
            uid,
            function,
            state,
            declarations,
            evolution,
            max_parallelism,
            range,
            backend,
            timers: Timers::default(),
            operator_states,
            watermark: MIN_WATERMARK,
            processing_time: 0,
            out: Vec::new(),
        }
    }

    /// The subtask's operator state.
    pub fn operator_states(&self) -> &OperatorStates {
        &self.operator_states
    }

    /// The section a snapshot keeps of this subtask's operator state, as subtask `subtask` of
    /// `parallelism` (`None`: the step declares none; [`OperatorStates::encode`]).
    pub fn encode_operator_state(&self, subtask: u32, parallelism: u32) -> Option<Vec<u8>> {
        self.operator_states.encode(&self.uid, subtask, parallelism)
    }

    /// Replaces the operator state with this subtask's share of a snapshot's `sections` (one
    /// per subtask of the run that wrote them), as subtask `subtask` of `parallelism`
    /// ([`OperatorStates::restore`]): nothing is replaced on an error.
    pub fn restore_operator_state(
        &mut self,
        sections: &[&[u8]],
        subtask: u32,
        parallelism: u32,
    ) -> Result<(), BlockError> {
        self.operator_states
            .restore(&self.uid, sections, subtask, parallelism)
    }

    /// The step's uid.
    pub fn uid(&self) -> &str {
        &self.uid
    }

    /// The declared states, in declaration order (their ids).
    pub fn declarations(&self) -> &[Declaration] {
        &self.declarations
    }

    /// The key groups it owns.
    pub fn range(&self) -> KeyGroupRange {
        self.range
    }

    /// The event-time watermark.
    pub fn watermark(&self) -> i64 {
        self.watermark
    }

    /// Registered timers (event time, processing time).
    pub fn timers(&self) -> (usize, usize) {
        self.timers.len()
    }

    /// Live state entries (values, map and list elements, timers).
    pub fn entries(&self) -> usize {
        (0..self.range.len() as usize)
            .map(|g| self.index_entries(g))
            .sum()
    }

    /// Live state entries of `group` (0 if it is not owned).
    pub fn group_entries(&self, group: u32) -> usize {
        self.group_index(group).map_or(0, |i| self.index_entries(i))
    }

    /// [`Self::group_entries`] as of the group's last [`Self::encode_group`] (or restore):
    /// exact right after it, and while the group is unchanged since (a snapshot's count of
    /// its groups, taken at the cut); on the heap without a pass over the group's keys.
    pub fn encoded_group_entries(&self, group: u32) -> usize {
        match (self.group_index(group), &self.backend) {
            (None, _) => 0,
            (Some(i), Backend::Heap(h)) => h.counted_len(i),
            (Some(i), Backend::Bytes(b)) => b.len(i),
        }
    }

    fn index_entries(&self, index: usize) -> usize {
        match &self.backend {
            Backend::Heap(h) => h.len(index),
            Backend::Bytes(b) => b.len(index),
        }
    }

    fn group_index(&self, group: u32) -> Option<usize> {
        self.range
            .contains(group)
            .then(|| (group - self.range.start) as usize)
    }

    /// Runs `call` with a context for `key` (its [`RecordKey`] `rk`) of group index `index` at
    /// event time `timestamp`.
    fn with_key(
        &mut self,
        index: usize,
        rk: &RecordKey,
        ahead: ReadAhead,
        key: KeyArg<'_, F::Key>,
        timestamp: i64,
        call: impl FnOnce(&mut F, &F::State, &mut Context<'_, F::Key, F::Out>) -> Result<()>,
    ) -> Result<()> {
        let (watermark, processing_time) = (self.watermark, self.processing_time);
        let declared = self.declarations.len();
        let lazy = || {
            let mut v = Vec::with_capacity(16);
            encode_record_key(rk, &mut v);
            v
        };
        let ready;
        let mut key_epoch = 0;
        // The heap keeps the key's states by its hash (released below if the call left them
        // empty); a byte store addresses them by the key's byte form.
        let (store, key_bytes) = match &mut self.backend {
            Backend::Heap(h) => {
                let epoch = h.epoch();
                let states = h.key_mut(index, rk, ahead).ok_or_else(|| {
                    StateError::Backend(format!("group index {index} is not owned"))
                })?;
                key_epoch = states.epoch;
                let store = Store::Heap {
                    states,
                    epoch,
                    declared,
                };
                (store, KeyBytes::Lazy(&lazy))
            }
            Backend::Bytes(b) => {
                ready = lazy();
                let store = Store::Bytes {
                    backend: b.as_mut(),
                };
                (store, KeyBytes::Ready(&ready))
            }
        };
        let mut ctx = Context {
            scope: KeyScope {
                store,
                group: index,
                key: key_bytes,
                watermark,
                processing_time,
                timestamp: Some(timestamp),
            },
            key,
            timers: &mut self.timers,
            out: &mut self.out,
            operator: &mut self.operator_states,
        };
        let r = call(&mut self.function, &self.state, &mut ctx);
        let (empty, first_change) = match &ctx.scope.store {
            Store::Heap { states, .. } => (states.is_empty(), states.epoch != key_epoch),
            Store::Bytes { .. } => (false, false),
        };
        if let Backend::Heap(h) = &mut self.backend {
            if empty {
                h.release(index, rk);
            } else if first_change {
                // The key's first change in this epoch: a delta visits it.
                h.touched(index, rk);
            }
        }
        r
    }

    /// Handles one record of `key` with event time `timestamp`.
    pub fn process(&mut self, key: &F::Key, timestamp: i64, value: F::In) -> Result<()> {
        let group = key.key_group(self.max_parallelism);
        self.process_in(group, key, timestamp, value)
    }

    /// [`Self::process`] for a record whose key group is known already (the shuffle routed it
    /// by that group): `group` must be `key`'s.
    pub fn process_in(
        &mut self,
        group: u32,
        key: &F::Key,
        timestamp: i64,
        value: F::In,
    ) -> Result<()> {
        let rk = key.record_key();
        self.process_routed(group, &rk, key, timestamp, value)
    }

    /// [`Self::process_in`] for a record that comes with its key's [`RecordKey`] (the shuffle
    /// routes by it, its hash already computed): `record_key` must be `key`'s, and `group` its
    /// group.
    pub fn process_routed(
        &mut self,
        group: u32,
        record_key: &RecordKey,
        key: &F::Key,
        timestamp: i64,
        value: F::In,
    ) -> Result<()> {
        debug_assert_eq!(group, key.key_group(self.max_parallelism));
        debug_assert_eq!(*record_key, key.record_key());
        let key = KeyArg::Built(key);
        self.process_key(
            group,
            record_key,
            ReadAhead::default(),
            key,
            timestamp,
            value,
        )
    }

    /// [`Self::process_routed`] with the key built from `record_key` only if the function asks
    /// for it ([`Context::key`]): for a key type that is [`StreamKey::BUILT_ON_DEMAND`], and a
    /// `record_key` of its kind (else the key is built first, and a key of another type is
    /// `Ok(false)`, nothing processed). `group` must be `record_key`'s; `ahead` is what
    /// [`Self::prefetch`] returned for it.
    pub(crate) fn process_record_key(
        &mut self,
        group: u32,
        record_key: &RecordKey,
        ahead: ReadAhead,
        timestamp: i64,
        value: F::In,
    ) -> Result<bool> {
        if !F::Key::BUILT_ON_DEMAND || record_key.key_type() != F::Key::KEY_TYPE {
            let Some(key) = F::Key::from_record_key(record_key) else {
                return Ok(false);
            };
            let key = KeyArg::Built(&key);
            self.process_key(group, record_key, ahead, key, timestamp, value)?;
            return Ok(true);
        }
        let built = OnceCell::new();
        let key = KeyArg::OnDemand {
            record_key,
            built: &built,
        };
        self.process_key(group, record_key, ahead, key, timestamp, value)?;
        Ok(true)
    }

    /// Calls the function for a record of `record_key` (of group `group`, which this subtask
    /// must own) with `key` in its context.
    fn process_key(
        &mut self,
        group: u32,
        record_key: &RecordKey,
        ahead: ReadAhead,
        key: KeyArg<'_, F::Key>,
        timestamp: i64,
        value: F::In,
    ) -> Result<()> {
        let index = self.group_index(group).ok_or_else(|| {
            Error::user(NotOwned {
                key: record_key.to_string(),
                group,
                range: self.range,
            })
        })?;
        self.with_key(index, record_key, ahead, key, timestamp, |f, state, ctx| {
            f.process(value, state, ctx)
        })
    }

    /// A hint that a record of `record_key` (of key group `group`) is about to be processed:
    /// finds where the key's state entry is from the hash table's control bytes alone (making
    /// an empty one for a key without state, which the process call drops again if it leaves
    /// it empty) and has the CPU fetch it without waiting for it, so that the process call
    /// finds it in cache. Called over [`READ_AHEAD`] records before they are processed, the
    /// memory reads of many keys overlap, where one record's would otherwise wait for the
    /// last's (with state larger than the CPU's caches, most of a record's time is that wait).
    /// Only the heap backend reads ahead. What it returns tells the process call where the
    /// entry is (a hint, checked against the key).
    pub fn prefetch(&mut self, group: u32, record_key: &RecordKey) -> ReadAhead {
        match (self.group_index(group), &mut self.backend) {
            (Some(index), Backend::Heap(h)) => h.touch(index, record_key),
            _ => ReadAhead::default(),
        }
    }

    /// Raises the watermark to `watermark` (a lower one is ignored) and fires every event-time
    /// timer at or before it, in time order.
    pub fn advance_watermark(&mut self, watermark: i64) -> Result<()> {
        if watermark <= self.watermark {
            return Ok(());
        }
        self.watermark = watermark;
        self.fire(TimeDomain::EventTime, watermark)
    }

    /// Sets the worker's clock to `now` (ms since the epoch; a lower one is ignored) and fires
    /// every processing-time timer at or before it.
    pub fn advance_processing_time(&mut self, now: i64) -> Result<()> {
        if now < self.processing_time {
            return Ok(());
        }
        self.processing_time = now;
        self.fire(TimeDomain::ProcessingTime, now)
    }

    fn fire(&mut self, domain: TimeDomain, now: i64) -> Result<()> {
        while let Some((ts, index, key_bytes)) = self.timers.pop_due(domain, now) {
            let (k, _) = decode_key(&key_bytes)
                .map_err(|e| StateError::Backend(format!("a timer's key: {e}")))?;
            let key = F::Key::from_key(&k).ok_or_else(|| {
                StateError::Backend(format!("a timer's key {k} is not of the job's key type"))
            })?;
            let rk = key.record_key();
            self.with_key(
                index,
                &rk,
                ReadAhead::default(),
                KeyArg::Built(&key),
                ts,
                |f, state, ctx| {
                    ctx.scope
                        .many_delete(timers::state_id(domain), Some(&timers::time_key(ts)))?;
                    f.on_timer(
                        Timer {
                            timestamp: ts,
                            domain,
                        },
                        state,
                        ctx,
                    )
                },
            )?;
        }
        Ok(())
    }

    /// Takes what was emitted so far, as (event time, record).
    pub fn take_output(&mut self) -> Vec<(i64, F::Out)> {
        std::mem::take(&mut self.out)
    }

    /// Sets the watermark a restore resumes from (the minimum over the subtasks that wrote the
    /// snapshot): timers at or before it fired before the snapshot, and are not in it.
    pub fn restore_watermark(&mut self, watermark: i64) {
        self.watermark = watermark;
    }

    /// Sets the clock a restore resumes from without firing anything (timers at or before it
    /// fired before the snapshot, and are not in it).
    pub fn restore_processing_time(&mut self, now: i64) {
        self.processing_time = now;
    }

    /// Ends the current cut epoch at a snapshot's barrier (see [`StateBackend::cut`]).
    pub fn cut(&mut self) -> u32 {
        match &mut self.backend {
            Backend::Heap(h) => h.cut(),
            Backend::Bytes(b) => b.cut(),
        }
    }

    /// How a snapshot building on the one taken at cut `since` must write `group`.
    pub fn group_mode(&self, group: u32, since: u32) -> GroupMode {
        match self.group_index(group) {
            None => GroupMode::Full,
            Some(i) => match &self.backend {
                Backend::Heap(h) => h.group_mode(i, since),
                Backend::Bytes(b) => b.group_mode(i, since),
            },
        }
    }

    fn header(&self, group: u32, kind: BlockKind) -> BlockHeader {
        BlockHeader {
            kind,
            max_parallelism: self.max_parallelism,
            key_group: group,
            key_type: F::Key::KEY_TYPE,
            operator: self.uid.clone(),
            states: self
                .declarations
                .iter()
                .enumerate()
                .map(|(i, d)| (i as StateId, d.clone()))
                .collect(),
        }
    }

    /// Writes `group` as `mode` says (call it at the cut, before the next record): a full
    /// block (expired TTL entries left out), a delta block, or nothing if unchanged; with the
    /// entries it holds.
    pub fn encode_group(&mut self, group: u32, mode: GroupMode) -> Result<Option<EncodedBlock>> {
        let index = self.group_index(group).ok_or_else(|| {
            StateError::Backend(format!("key group {group} is not owned ({})", self.range))
        })?;
        let kind = match mode {
            GroupMode::Unchanged => return Ok(None),
            GroupMode::Full => BlockKind::Full,
            GroupMode::Delta { .. } => BlockKind::Delta,
        };
        let mut w = BlockWriter::new(&self.header(group, kind));
        let ttls: Vec<_> = self.declarations.iter().map(|d| d.ttl).collect();
        let (watermark, processing_time) = (self.watermark, self.processing_time);
        let expired = |key: &[u8], value: &[u8]| -> bool {
            let Ok((_, n)) = decode_key(key) else {
                return false;
            };
            let Some(id) = key.get(n..n + 2).map(|b| u16::from_be_bytes([b[0], b[1]])) else {
                return false;
            };
            let (Some(Some(ttl)), Some(expiry)) =
                (ttls.get(usize::from(id)), value.first_chunk::<8>())
            else {
                return false;
            };
            let now = match ttl.domain {
                TimeDomain::EventTime => watermark,
                TimeDomain::ProcessingTime => processing_time,
            };
            i64::from_be_bytes(*expiry) <= now
        };
        let mut add = |c: Change<'_>| match c {
            Change::Put(k, v) if kind == BlockKind::Full && expired(k, v) => {}
            Change::Put(k, v) => w.put(k, v),
            Change::Delete(k) => w.delete(k),
        };
        match &mut self.backend {
            Backend::Heap(h) => h.visit(index, mode, &mut add)?,
            Backend::Bytes(b) => b.visit(index, mode, &mut add)?,
        }
        Ok(Some(w.finish_counted()))
    }

    /// Replaces `group`'s state with a snapshot's: its full block, then its deltas in order.
    /// Every block is checked (container, group, key-group count, operator, key type, every
    /// state's identity, every key's group) before anything is installed: a block that fails
    /// leaves the group as it was.
    pub fn restore_group(&mut self, group: u32, chain: &[&[u8]]) -> Result<(), BlockError> {
        let index = self.group_index(group).ok_or(BlockError::WrongGroup {
            block: group,
            expected: self.range.start,
        })?;
        let mut entries: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
        for (i, bytes) in chain.iter().enumerate() {
            let b = block::decode(bytes)?;
            self.check_header(&b.header, group)?;
            if i == 0 && b.header.kind == BlockKind::Delta {
                return Err(BlockError::DeltaFirst(group));
            }
            let ids = self.id_map(&b.header)?;
            for (n, (key, value)) in b.entries.into_iter().enumerate() {
                let Some((key, value)) = self.checked_entry(group, n as u64, key, value, &ids)?
                else {
                    continue;
                };
                match value {
                    Some(v) => {
                        entries.insert(key, v);
                    }
                    None => {
                        entries.remove(&key);
                    }
                }
            }
        }
        self.timers.forget_group(index);
        for key in entries.keys() {
            self.timers.index_entry(index, key);
        }
        match &mut self.backend {
            Backend::Heap(h) => {
                let ttl: Vec<bool> = self.declarations.iter().map(|d| d.ttl.is_some()).collect();
                h.install(index, entries, &ttl)
                    .map_err(|e| BlockError::Undecodable(e.to_string()))?;
            }
            Backend::Bytes(b) => b.install(index, entries).map_err(BlockError::Backend)?,
        }
        Ok(())
    }

    /// Applies delta blocks written after the state `group` holds, in order, onto it: a group
    /// restored (or pre-staged) from one snapshot catching up with the checkpoints taken since.
    /// The work is the deltas', not the group's. Every block is checked as
    /// [`Self::restore_group`] checks it, and must be a delta, before anything is applied: a
    /// block that fails leaves the group as it was.
    pub fn apply_deltas(&mut self, group: u32, deltas: &[&[u8]]) -> Result<(), BlockError> {
        let index = self.group_index(group).ok_or(BlockError::WrongGroup {
            block: group,
            expected: self.range.start,
        })?;
        let mut changes: BTreeMap<Vec<u8>, Option<Vec<u8>>> = BTreeMap::new();
        for bytes in deltas {
            let b = block::decode(bytes)?;
            self.check_header(&b.header, group)?;
            if b.header.kind != BlockKind::Delta {
                return Err(BlockError::Malformed(
                    "a full block among the deltas to apply (restore the chain from it instead)",
                ));
            }
            let ids = self.id_map(&b.header)?;
            for (n, (key, value)) in b.entries.into_iter().enumerate() {
                if let Some((key, value)) = self.checked_entry(group, n as u64, key, value, &ids)? {
                    changes.insert(key, value);
                }
            }
        }
        // The heap decodes every value first (the one step that can still fail); the byte
        // backend takes the changes as they are.
        if let Backend::Heap(h) = &mut self.backend {
            let ttl: Vec<bool> = self.declarations.iter().map(|d| d.ttl.is_some()).collect();
            h.apply(index, &changes, &ttl)
                .map_err(|e| BlockError::Undecodable(e.to_string()))?;
        }
        for (key, value) in &changes {
            match value {
                Some(_) => self.timers.index_entry(index, key),
                None => self.timers.forget_entry(index, key),
            };
        }
        if let Backend::Bytes(b) = &mut self.backend {
            b.apply(index, changes).map_err(BlockError::Backend)?;
        }
        Ok(())
    }

    fn check_header(&self, h: &BlockHeader, group: u32) -> Result<(), BlockError> {
        if h.key_group != group {
            return Err(BlockError::WrongGroup {
                block: h.key_group,
                expected: group,
            });
        }
        if h.max_parallelism != self.max_parallelism {
            return Err(BlockError::MaxParallelism {
                block: h.max_parallelism,
                job: self.max_parallelism,
            });
        }
        if h.operator != self.uid {
            return Err(BlockError::Operator {
                block: h.operator.clone(),
                job: self.uid.clone(),
            });
        }
        if h.key_type != F::Key::KEY_TYPE {
            return Err(BlockError::KeyType {
                block: h.key_type.to_string(),
                job: F::Key::KEY_TYPE.to_string(),
            });
        }
        Ok(())
    }

    /// The block's state ids mapped onto this operator's, each state checked against its
    /// declaration: the same identity, an older version a declared migration reads, or a state
    /// the function drops.
    fn id_map(&self, h: &BlockHeader) -> Result<BTreeMap<StateId, Target<'_>>, BlockError> {
        let mut ids = BTreeMap::new();
        for (id, d) in &h.states {
            let Some((mine, decl)) = self
                .declarations
                .iter()
                .enumerate()
                .find(|(_, m)| m.name == d.name)
            else {
                if self.evolution.dropped.contains(&d.name) {
                    ids.insert(*id, Target::Dropped);
                    continue;
                }
                return Err(BlockError::UndeclaredState {
                    name: d.name.clone(),
                });
            };
            let mine = mine as StateId;
            let same_shape = decl.kind == d.kind && decl.ttl.is_some() == d.ttl.is_some();
            let migration = if decl.version == d.version && decl.serializer == d.serializer {
                None
            } else {
                self.evolution.migrations.get(&mine).and_then(|ms| {
                    ms.iter()
                        .find(|m| m.from_version == d.version && m.from_serializer == d.serializer)
                })
            };
            let readable =
                decl.version == d.version && decl.serializer == d.serializer || migration.is_some();
            if !same_shape || !readable {
                return Err(BlockError::StateChanged {
                    name: d.name.clone(),
                    block: d.compatibility(),
                    job: decl.compatibility(),
                });
            }
            let ttl = decl.ttl.is_some();
            ids.insert(*id, Target::State(mine, migration.map(|m| (m, ttl))));
        }
        Ok(ids)
    }

    /// An entry checked (its key in `group`, its state known) with its state id mapped and its
    /// value migrated; `None` for an entry of a dropped state.
    fn checked_entry(
        &self,
        group: u32,
        entry: u64,
        mut key: Vec<u8>,
        value: Option<Vec<u8>>,
        ids: &BTreeMap<StateId, Target<'_>>,
    ) -> Result<Option<Entry>, BlockError> {
        let (k, n) = decode_key(&key).map_err(|source| BlockError::Key { entry, source })?;
        let actual = keygroup::key_group_for_key(&k, self.max_parallelism);
        if actual != group {
            return Err(BlockError::KeyInWrongGroup {
                key: k.to_string(),
                group,
                actual,
            });
        }
        let id = key
            .get(n..n + 2)
            .map(|b| u16::from_be_bytes([b[0], b[1]]))
            .ok_or(BlockError::Malformed("entry without a state id"))?;
        let (mapped, value) =
            if id == crate::state::EVENT_TIMERS || id == crate::state::PROCESSING_TIMERS {
                (id, value)
            } else {
                match ids.get(&id) {
                    None => {
                        return Err(BlockError::Malformed(
                            "entry of a state the block does not declare",
                        ));
                    }
                    Some(Target::Dropped) => return Ok(None),
                    Some(Target::State(mine, None)) => (*mine, value),
                    Some(Target::State(mine, Some((m, ttl)))) => {
                        let value = value.map(|v| migrate(m, *ttl, &v)).transpose()?;
                        (*mine, value)
                    }
                }
            };
        key[n..n + 2].copy_from_slice(&mapped.to_be_bytes());
        Ok(Some((key, value)))
    }

    /// Drops `group`'s state and timers (it moved to another subtask).
    pub fn clear_group(&mut self, group: u32) -> Result<(), StateError> {
        if let Some(index) = self.group_index(group) {
            self.timers.forget_group(index);
            match &mut self.backend {
                Backend::Heap(h) => h.clear(index),
                Backend::Bytes(b) => b.clear(index)?,
            }
        }
        Ok(())
    }
}
