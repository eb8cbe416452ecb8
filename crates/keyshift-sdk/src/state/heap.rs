//! The heap backend: keyed state as objects in the worker's memory (Flink's heap state
//! backend), one hash map per owned key group from the key to its states. A read clones the
//! value and a write moves it in; nothing is serialized until a snapshot writes the group
//! (into the same key-group blocks, and the same entry keys, as the byte-addressed
//! [`super::backend::StateBackend`] a disk engine implements).

use super::backend::{Change, GroupEpochs, GroupMode, end_epoch};
use super::{Codec, StateId};
use crate::error::StateError;
use crate::key::{RecordKey, StreamKey, decode_key, encode_record_key};
use hashbrown::HashTable;
use hashbrown::hash_table::Entry;
use keyshift_core::record_key::KeyBuildHasher;
use smallbox::SmallBox;
use smallbox::space::S1;
use smallvec::SmallVec;
use std::any::Any;
use std::collections::BTreeMap;
use std::hash::BuildHasher;
use std::marker::PhantomData;

/// A value held in state: inline when it fits in two words, boxed otherwise.
pub(crate) type Object = SmallBox<dyn Any + Send, S1>;

/// `value` as an [`Object`].
pub(crate) fn object<T: Any + Send>(value: T) -> Object {
    smallbox::smallbox!(value)
}

/// One entry of a key's state: its value (`None`: deleted, kept until no delta needs to say
/// so), its expiry (with a TTL), and the cut epoch of its last change (0: restored).
pub(crate) struct Cell {
    pub(crate) value: Option<Object>,
    pub(crate) expiry: Option<i64>,
    pub(crate) epoch: u32,
}

/// One declared state of one key.
#[derive(Default)]
pub(crate) enum Slot {
    #[default]
    Empty,
    /// A value, reducing or aggregating state.
    One(Cell),
    /// A map (by the user key's bytes), a list (by sequence number) or timers (by time key).
    Many(BTreeMap<Vec<u8>, Cell>),
}

/// Every state of one key, by slot: the declared states in order, then the event-time and the
/// processing-time timers.
#[derive(Default)]
pub(crate) struct KeyStates {
    pub(crate) slots: SmallVec<[Slot; 1]>,
    /// The epoch of the key's last change.
    pub(crate) epoch: u32,
    /// Its live entries when last counted (at the last visit of the key, or its restore): its
    /// share of [`Group::live`].
    counted: u32,
}

/// The slot of state `id` among `states` declared states.
#[inline]
pub(crate) fn slot_of(id: StateId, states: usize) -> usize {
    match id {
        super::EVENT_TIMERS => states,
        super::PROCESSING_TIMERS => states + 1,
        id => usize::from(id),
    }
}

/// The state id of slot `slot` among `states` declared states.
fn id_of(slot: usize, states: usize) -> StateId {
    if slot == states {
        super::EVENT_TIMERS
    } else if slot == states + 1 {
        super::PROCESSING_TIMERS
    } else {
        slot as StateId
    }
}

impl KeyStates {
    /// The slot, created (and every slot before it) if missing.
    #[inline]
    pub(crate) fn slot(&mut self, slot: usize) -> &mut Slot {
        if self.slots.len() <= slot {
            self.grow(slot);
        }
        &mut self.slots[slot]
    }

    /// Adds empty slots up to `slot` (kept out of [`Self::slot`], which is inlined).
    #[cold]
    fn grow(&mut self, slot: usize) {
        self.slots.resize_with(slot + 1, Slot::default);
    }

    /// Whether nothing live or deleted is left (the key can leave the map).
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.slots.iter().all(|s| match s {
            Slot::Empty => true,
            Slot::One(_) => false,
            Slot::Many(m) => m.is_empty(),
        })
    }

    /// Forgets deletions at or before `epoch`.
    fn forget_deletions(&mut self, epoch: u32) {
        for s in &mut self.slots {
            match s {
                Slot::One(c) if c.value.is_none() && c.epoch <= epoch => *s = Slot::Empty,
                Slot::Many(m) => m.retain(|_, c| c.value.is_some() || c.epoch > epoch),
                _ => {}
            }
        }
    }

    fn live(&self) -> usize {
        self.slots
            .iter()
            .map(|s| match s {
                Slot::Empty => 0,
                Slot::One(c) => usize::from(c.value.is_some()),
                Slot::Many(m) => m.values().filter(|c| c.value.is_some()).count(),
            })
            .sum()
    }
}

/// A restored entry, decoded ([`HeapStore::decode_entry`]).
struct RestoredEntry {
    key: RecordKey,
    slot: usize,
    /// Whether its state holds many entries per key (map, list, timers).
    many: bool,
    user: Vec<u8>,
    /// `None`: deleted.
    cell: Option<Cell>,
}

impl RestoredEntry {
    /// Puts the entry into `keys` (or removes it, and its key once nothing is left): its key's
    /// hash, and the live entries counted for a key it removed.
    fn place(
        self,
        keys: &mut HashTable<(RecordKey, KeyStates)>,
        hasher: &KeyBuildHasher,
    ) -> (u64, usize) {
        let hash = hasher.hash_one(&self.key);
        match self.cell {
            Some(cell) => {
                let ks = &mut keys
                    .entry(hash, |(x, _)| *x == self.key, |(x, _)| hasher.hash_one(x))
                    .or_insert_with(|| (self.key.clone(), KeyStates::default()))
                    .into_mut()
                    .1;
                match ks.slot(self.slot) {
                    s if self.many => {
                        if !matches!(s, Slot::Many(_)) {
                            *s = Slot::Many(BTreeMap::new());
                        }
                        if let Slot::Many(m) = s {
                            m.insert(self.user, cell);
                        }
                    }
                    s => *s = Slot::One(cell),
                }
            }
            None => {
                if let Ok(mut e) = keys.find_entry(hash, |(x, _)| *x == self.key) {
                    let ks = &mut e.get_mut().1;
                    match ks.slots.get_mut(self.slot) {
                        Some(Slot::Many(m)) => {
                            m.remove(&self.user);
                        }
                        Some(s) => *s = Slot::Empty,
                        None => {}
                    }
                    if ks.is_empty() {
                        let ((_, gone), _) = e.remove();
                        return (hash, gone.counted as usize);
                    }
                }
            }
        }
        (hash, 0)
    }
}

/// Counts `ks`'s live entries anew into `live` (the group's count).
fn recount(live: &mut usize, ks: &mut KeyStates) {
    let n = ks.live() as u32;
    *live = live.saturating_sub(ks.counted as usize) + n as usize;
    ks.counted = n;
}

/// Asks the CPU to fetch the memory of `value` into its caches without waiting for it: a hint
/// that reads nothing and never faults (a no-op where no prefetch instruction is known).
#[inline(always)]
fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let start = std::ptr::from_ref(value).cast::<i8>();
        let size = size_of::<T>();
        let mut offset = 0;
        // SAFETY: a prefetch is a hint: it reads no memory, cannot fault (whatever the address)
        // and changes no state a program can observe; SSE, which it needs, is part of every
        // x86_64 CPU (the target's baseline).
        unsafe {
            while offset < size {
                _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(offset));
                offset += 64;
            }
            // The line of the last byte, where the value does not start on a line's boundary.
            _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(size.saturating_sub(1)));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

/// What a read-ahead (`HeapStore::touch`) learnt of a key: where its entry is, so that
/// processing the record finds it without a second probe (a hint: checked against the key).
#[derive(Debug, Clone, Copy, Default)]
pub struct ReadAhead(Option<usize>);

struct Group {
    /// Each key with its states, by the key's cached hash (nothing is hashed per record, and a
    /// short string key is compared inline).
    keys: HashTable<(RecordKey, KeyStates)>,
    epochs: GroupEpochs,
    /// (epoch, key hash) of each key's first change in an epoch, in epoch order: what a delta
    /// visits instead of every key.
    touched: Vec<(u32, u64)>,
    /// `touched` holds every change from this epoch on.
    tracked_from: u32,
    /// Live entries as counted: exact for every key changed before the last visit (each
    /// snapshot visits every key changed since the one it builds on), see
    /// [`HeapStore::counted_len`].
    live: usize,
}

impl Group {
    /// Drops the keys of `hash` (just `key`, if given) that hold nothing any more, and their
    /// share of the count.
    fn drop_empty(&mut self, hash: u64, key: Option<&RecordKey>) {
        while let Ok(e) = self.keys.find_entry(hash, |(k, ks)| {
            key.is_none_or(|key| k == key) && ks.is_empty()
        }) {
            let ((_, gone), _) = e.remove();
            self.live = self.live.saturating_sub(gone.counted as usize);
        }
    }
}

impl Default for Group {
    fn default() -> Self {
        Group {
            keys: HashTable::new(),
            epochs: GroupEpochs::default(),
            touched: Vec::new(),
            tracked_from: 0,
            live: 0,
        }
    }
}

/// Keyed state in memory for the owned key groups, keyed by the [`RecordKey`] of the job's key
/// type `K` (which a restore checks its keys against).
pub struct HeapStore<K> {
    groups: Vec<Group>,
    hasher: KeyBuildHasher,
    epoch: u32,
    /// Per declared state, how its values become bytes and back.
    codecs: Vec<Codec>,
    key_type: PhantomData<fn() -> K>,
}

impl<K: StreamKey> HeapStore<K> {
    pub(crate) fn new(groups: usize, codecs: Vec<Codec>) -> Self {
        HeapStore {
            groups: (0..groups).map(|_| Group::default()).collect(),
            hasher: KeyBuildHasher::default(),
            epoch: 1,
            codecs,
            key_type: PhantomData,
        }
    }

    /// The current cut epoch.
    pub(crate) fn epoch(&self) -> u32 {
        self.epoch
    }

    /// The states of `key` in group `group` (created empty if it has none; where the
    /// read-ahead `ahead` found them, else by one probe), and the group marked changed (the
    /// caller is about to run a function on it).
    #[inline]
    pub(crate) fn key_mut(
        &mut self,
        group: usize,
        key: &RecordKey,
        ahead: ReadAhead,
    ) -> Option<&mut KeyStates> {
        let epoch = self.epoch;
        let hasher = &self.hasher;
        let g = self.groups.get_mut(group)?;
        g.epochs.changed = epoch;
        // Where the read-ahead found the key, if nothing has moved it since (checked by the key:
        // a resize, or a released key's bucket taken by another, moves or replaces it).
        let found = ahead
            .0
            .filter(|&i| g.keys.get_bucket(i).is_some_and(|(k, _)| k == key));
        let at = match found {
            Some(i) => i,
            None => match g.keys.entry(
                hasher.hash_one(key),
                |(k, _)| k == key,
                |(k, _)| hasher.hash_one(k),
            ) {
                Entry::Occupied(o) => o.bucket_index(),
                Entry::Vacant(v) => v.insert((key.clone(), KeyStates::default())).bucket_index(),
            },
        };
        let (_, states) = g.keys.get_bucket_mut(at)?;
        Some(states)
    }

    /// Finds where the entry of `key` in group `group` likely is, and asks the CPU to fetch it
    /// (see [`crate::operator::KeyedOperator::prefetch`]).
    ///
    /// Only the group's control bytes are read (small, and in cache): the first entry whose
    /// control byte matches the key's hash is the key's own unless another key shares those
    /// seven bits of hash (about 1 in 128 per entry probed), so it is taken as the hint and its
    /// memory fetched without waiting for it. The process call checks the hint against the key
    /// and probes again if it was wrong.
    ///
    /// Where no control byte matches, the key has no entry: it gets an empty one here, so that
    /// the process call finds its slot in cache too (a new key's insert is as costly as a read
    /// of a key in state). The call that follows drops it again if it leaves it empty
    /// ([`Self::release`]), and an empty entry holds no state (no snapshot, count or visit sees
    /// it).
    pub(crate) fn touch(&mut self, group: usize, key: &RecordKey) -> ReadAhead {
        let hasher = &self.hasher;
        let Some(g) = self.groups.get_mut(group) else {
            return ReadAhead::default();
        };
        let hash = hasher.hash_one(key);
        let entry = match g.keys.find_entry(hash, |_| true) {
            Ok(entry) => entry,
            Err(absent) => absent.into_table().insert_unique(
                hash,
                (key.clone(), KeyStates::default()),
                |(k, _)| hasher.hash_one(k),
            ),
        };
        prefetch(entry.get());
        ReadAhead(Some(entry.bucket_index()))
    }

    /// Drops `key`'s entry, which the caller found empty.
    pub(crate) fn release(&mut self, group: usize, key: &RecordKey) {
        let hash = self.hasher.hash_one(key);
        if let Some(g) = self.groups.get_mut(group) {
            g.drop_empty(hash, Some(key));
        }
    }

    pub(crate) fn cut(&mut self) -> u32 {
        end_epoch(&mut self.epoch)
    }

    pub(crate) fn group_mode(&self, group: usize, since: u32) -> GroupMode {
        self.groups
            .get(group)
            .map_or(GroupMode::Full, |g| g.epochs.mode(since))
    }

    /// Visits the group as `mode` says, values serialized (an expiry first, with a TTL), like
    /// [`super::backend::StateBackend::visit`].
    pub(crate) fn visit(
        &mut self,
        group: usize,
        mode: GroupMode,
        f: &mut dyn FnMut(Change<'_>),
    ) -> Result<(), StateError> {
        let since = match mode {
            GroupMode::Unchanged => return Ok(()),
            GroupMode::Full => None,
            GroupMode::Delta { since } => Some(since),
        };
        let codecs = &self.codecs;
        let states = codecs.len();
        let g = self
            .groups
            .get_mut(group)
            .ok_or_else(|| StateError::Backend(format!("group index {group} is not owned")))?;
        let mut entry = Vec::with_capacity(64);
        let mut value = Vec::with_capacity(64);
        let mut visit_key = |k: &RecordKey, ks: &KeyStates| -> Result<(), StateError> {
            if since.is_some_and(|s| ks.epoch <= s) {
                return Ok(());
            }
            entry.clear();
            encode_record_key(k, &mut entry);
            let key_len = entry.len();
            for (i, slot) in ks.slots.iter().enumerate() {
                let id = id_of(i, states);
                let mut emit = |user: &[u8], cell: &Cell| -> Result<(), StateError> {
                    if since.is_some_and(|s| cell.epoch <= s) {
                        return Ok(());
                    }
                    entry.truncate(key_len);
                    entry.extend_from_slice(&id.to_be_bytes());
                    entry.extend_from_slice(user);
                    match &cell.value {
                        None if since.is_some() => f(Change::Delete(&entry)),
                        None => {}
                        Some(v) => {
                            value.clear();
                            if let Some(e) = cell.expiry {
                                value.extend_from_slice(&e.to_be_bytes());
                            }
                            if let Some(codec) = codecs.get(usize::from(id)) {
                                codec.encode(&**v, &mut value)?;
                            }
                            f(Change::Put(&entry, &value));
                        }
                    }
                    Ok(())
                };
                match slot {
                    Slot::Empty => {}
                    Slot::One(c) => emit(&[], c)?,
                    Slot::Many(m) => {
                        for (user, c) in m {
                            emit(user, c)?;
                        }
                    }
                }
            }
            Ok(())
        };
        // A delta visits only the keys changed since `since` when the group has tracked every
        // change after it; otherwise (and for a full block) every key.
        // Each key the visit sees is counted anew into the group's live entries.
        let tracked = since.filter(|s| s.saturating_add(1) >= g.tracked_from);
        match tracked {
            Some(since) => {
                let mut changed: Vec<(u32, u64)> = g
                    .touched
                    .iter()
                    .copied()
                    .filter(|(e, _)| *e > since)
                    .collect();
                changed.sort_unstable();
                changed.dedup();
                // A key changed in several epochs is written once: from its last one.
                for (epoch, hash) in changed {
                    for (k, ks) in g.keys.iter_hash_mut(hash) {
                        if ks.epoch == epoch {
                            visit_key(k, ks)?;
                            recount(&mut g.live, ks);
                        }
                    }
                }
            }
            None => {
                for (k, ks) in g.keys.iter_mut() {
                    visit_key(k, ks)?;
                    recount(&mut g.live, ks);
                }
            }
        }
        if let Some(since) = since {
            // Deletions to forget lie only on keys changed at or before `since`: those are
            // looked up by hash, unless they are a good share of the group (after a restore's
            // or a first run's every key), which one pass in memory order visits faster.
            let few = tracked
                .map(|_| -> Vec<u64> {
                    g.touched
                        .iter()
                        .filter(|(e, _)| *e <= since)
                        .map(|(_, h)| *h)
                        .collect()
                })
                .filter(|old| old.len() < g.keys.len() / 4);
            match few {
                Some(mut old) => {
                    old.sort_unstable();
                    old.dedup();
                    for hash in old {
                        for (_, ks) in g.keys.iter_hash_mut(hash) {
                            ks.forget_deletions(since);
                        }
                        g.drop_empty(hash, None);
                    }
                }
                None => {
                    let Group { keys, live, .. } = g;
                    for (_, ks) in keys.iter_mut() {
                        ks.forget_deletions(since);
                    }
                    keys.retain(|(_, ks)| {
                        if ks.is_empty() {
                            *live = live.saturating_sub(ks.counted as usize);
                        }
                        !ks.is_empty()
                    });
                }
            }
            g.touched.retain(|(e, _)| *e > since);
            g.epochs.forget_through(since);
        }
        Ok(())
    }

    /// Records that `key` in group `group` changed in the current epoch (its first change in
    /// it), so that a delta visits it without a pass over every key. Past twice the group's keys
    /// the record is dropped: deltas since earlier epochs visit every key again.
    pub(crate) fn touched(&mut self, group: usize, key: &RecordKey) {
        let hash = self.hasher.hash_one(key);
        let epoch = self.epoch;
        if let Some(g) = self.groups.get_mut(group) {
            if g.touched.len() > 2 * g.keys.len() + 1024 {
                g.touched.clear();
                g.tracked_from = epoch.wrapping_add(1);
            } else {
                g.touched.push((epoch, hash));
            }
        }
    }

    /// One checked entry of a restored block, decoded: its key, its state's slot, its user key
    /// (a map key, a list position, a timer's time) and its value (`None`: deleted).
    fn decode_entry(
        &self,
        entry: &[u8],
        bytes: Option<&[u8]>,
        ttl: &[bool],
    ) -> Result<RestoredEntry, StateError> {
        let (key, n) =
            decode_key(entry).map_err(|e| StateError::Backend(format!("a restored key: {e}")))?;
        if K::from_key(&key).is_none() {
            return Err(StateError::Backend(format!(
                "restored key {key} is not of the job's key type"
            )));
        }
        let id = entry
            .get(n..n + 2)
            .map(|b| u16::from_be_bytes([b[0], b[1]]))
            .ok_or_else(|| StateError::Backend("an entry without a state id".into()))?;
        let slot = slot_of(id, self.codecs.len());
        let cell = match bytes {
            None => None,
            Some(bytes) => {
                let (expiry, payload) = if ttl.get(slot).copied().unwrap_or(false) {
                    let (e, rest) = bytes.split_first_chunk::<8>().ok_or_else(|| {
                        StateError::Backend("an entry with a TTL but no expiry".into())
                    })?;
                    (Some(i64::from_be_bytes(*e)), rest)
                } else {
                    (None, bytes)
                };
                let value: Object = match self.codecs.get(slot) {
                    Some(codec) => codec.decode(payload)?,
                    // Timers hold nothing.
                    None => object(()),
                };
                Some(Cell {
                    value: Some(value),
                    expiry,
                    epoch: 0,
                })
            }
        };
        Ok(RestoredEntry {
            key: RecordKey::from(key),
            many: slot >= self.codecs.len() || self.codecs[slot].many,
            slot,
            user: entry[n + 2..].to_vec(),
            cell,
        })
    }

    /// Replaces the group's state with checked `entries` (entry key -> value bytes), each
    /// value deserialized by its state's codec.
    pub(crate) fn install(
        &mut self,
        group: usize,
        entries: BTreeMap<Vec<u8>, Vec<u8>>,
        ttl: &[bool],
    ) -> Result<(), StateError> {
        let mut keys: HashTable<(RecordKey, KeyStates)> = HashTable::new();
        for (entry, bytes) in entries {
            let e = self.decode_entry(&entry, Some(&bytes), ttl)?;
            e.place(&mut keys, &self.hasher);
        }
        let mut live = 0;
        for (_, ks) in keys.iter_mut() {
            recount(&mut live, ks);
        }
        if let Some(g) = self.groups.get_mut(group) {
            *g = Group {
                keys,
                live,
                ..Group::default()
            };
        }
        Ok(())
    }

    /// Applies checked changes (entry key -> value bytes, `None`: deleted) onto the group's
    /// installed state, as part of it (epoch 0, not a change). Every value is deserialized
    /// before anything changes.
    pub(crate) fn apply(
        &mut self,
        group: usize,
        changes: &BTreeMap<Vec<u8>, Option<Vec<u8>>>,
        ttl: &[bool],
    ) -> Result<(), StateError> {
        let decoded = changes
            .iter()
            .map(|(entry, bytes)| self.decode_entry(entry, bytes.as_deref(), ttl))
            .collect::<Result<Vec<_>, _>>()?;
        let hasher = self.hasher.clone();
        if let Some(g) = self.groups.get_mut(group) {
            let mut hashes = Vec::with_capacity(decoded.len());
            for e in decoded {
                let (hash, gone) = e.place(&mut g.keys, &hasher);
                g.live = g.live.saturating_sub(gone);
                hashes.push(hash);
            }
            hashes.sort_unstable();
            hashes.dedup();
            for hash in hashes {
                for (_, ks) in g.keys.iter_hash_mut(hash) {
                    recount(&mut g.live, ks);
                }
            }
        }
        Ok(())
    }

    pub(crate) fn clear(&mut self, group: usize) {
        let epoch = self.epoch;
        if let Some(g) = self.groups.get_mut(group) {
            *g = Group {
                epochs: GroupEpochs::cleared(epoch),
                ..Group::default()
            };
        }
    }

    /// Live entries of the group as counted at its last visit ([`Self::visit`]) or restore:
    /// exact right after a visit, and while nothing changed since; no pass over the keys.
    pub(crate) fn counted_len(&self, group: usize) -> usize {
        self.groups.get(group).map_or(0, |g| g.live)
    }

    /// Live entries of the group (values, map and list elements, timers).
    pub(crate) fn len(&self, group: usize) -> usize {
        self.groups
            .get(group)
            .map_or(0, |g| g.keys.iter().map(|(_, ks)| ks.live()).sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> RecordKey {
        s.to_owned().record_key()
    }

    /// Gives `key` a value state holding `v` (slot 0).
    fn set(store: &mut HeapStore<String>, k: &str, ahead: ReadAhead, v: u64) {
        let states = store.key_mut(0, &key(k), ahead).unwrap();
        *states.slot(0) = Slot::One(Cell {
            value: Some(object(v)),
            expiry: None,
            epoch: 1,
        });
    }

    /// The value state of `key` (slot 0), found through `ahead`.
    fn get(store: &mut HeapStore<String>, k: &str, ahead: ReadAhead) -> Option<u64> {
        let states = store.key_mut(0, &key(k), ahead).unwrap();
        match states.slots.first() {
            Some(Slot::One(c)) => c.value.as_ref()?.downcast_ref::<u64>().copied(),
            _ => None,
        }
    }

    #[test]
    fn a_read_ahead_finds_its_key_even_after_the_table_moved_or_its_bucket_was_reused() {
        let mut store = HeapStore::<String>::new(1, Vec::new());
        set(&mut store, "a", ReadAhead::default(), 1);
        let ahead_a = store.touch(0, &key("a"));
        assert!(ahead_a.0.is_some());
        assert_eq!(get(&mut store, "a", ahead_a), Some(1));
        // Thousands of keys read ahead after it: the table grows, every bucket moves.
        let buckets = store.groups[0].keys.num_buckets();
        for i in 0..5000 {
            let k = format!("k{i}");
            let ahead = store.touch(0, &key(&k));
            set(&mut store, &k, ahead, i);
        }
        assert!(store.groups[0].keys.num_buckets() > buckets);
        assert_eq!(get(&mut store, "a", ahead_a), Some(1));
        assert_eq!(get(&mut store, "k4999", ahead_a), Some(4999));
        // A key read ahead, then released empty, its bucket taken by another key: the stale
        // hint leads to neither the other key's state nor a second entry of its own.
        let ahead_b = store.touch(0, &key("b"));
        store.release(0, &key("b"));
        let ahead_c = store.touch(0, &key("c"));
        set(&mut store, "c", ahead_c, 7);
        assert_eq!(get(&mut store, "b", ahead_b), None);
        assert_eq!(get(&mut store, "c", ahead_b), Some(7));
        assert_eq!(get(&mut store, "c", ahead_c), Some(7));
        let copies = store.groups[0]
            .keys
            .iter()
            .filter(|(k, _)| *k == key("b"))
            .count();
        assert_eq!(copies, 1);
    }

    #[test]
    fn a_key_read_ahead_and_left_without_state_holds_nothing() {
        let mut store = HeapStore::<String>::new(1, Vec::new());
        store.touch(0, &key("a"));
        assert_eq!(store.len(0), 0);
        let states = store.key_mut(0, &key("a"), ReadAhead::default()).unwrap();
        assert!(states.is_empty());
        store.release(0, &key("a"));
        assert_eq!(store.groups[0].keys.len(), 0);
    }
}
