//! Keyed state on local disk: the SDK's byte-addressed [`StateBackend`] on an embedded
//! log-structured merge tree ([fjall]), for state larger than a worker's memory.
//!
//! The worker's memory is bounded by the engine's block cache and write buffer and by a
//! write-back cache of recently used entries in front of it ([`DiskConfig`]); the state lives
//! in a directory of the worker's local volume, which is scratch space: a worker that restarts
//! restores from the object store, never from it (the directory is removed when the backend is
//! dropped).
//!
//! The layout is the interface's own (`crate::state::backend` of the SDK): one sorted key space,
//! every entry key prefixed by its key group's index among the owned groups (4 bytes,
//! big-endian), so a group's entries are one contiguous range and a key's one range inside it.
//!
//! Snapshots are the same key-group blocks as the heap backend's: [`StateBackend::visit`]
//! writes a group in full from a scan, or as a delta from the keys changed since the cut it
//! builds on. Those keys are tracked in memory per group, with whether each held an entry
//! before its first tracked change (so the group's entry count stays exact without a count of
//! the store). A group whose tracked keys outgrow [`DiskConfig::max_tracked_keys`] forgets them
//! and is written in full by the next snapshot: the tracking's memory stays bounded whatever
//! the rate of change.
//!
//! [fjall]: https://crates.io/crates/fjall

use fjall::{Database, Keyspace, KeyspaceCreateOptions};
use keyshift_sdk::StateError;
use keyshift_sdk::state::backend::{
    Change, Entries, GroupEpochs, GroupMode, StateBackend, end_epoch,
};
use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// How much memory the engine may use, and how many changed keys a group tracks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskConfig {
    /// The block cache: recently read blocks of the store's files, in bytes.
    pub cache_bytes: u64,
    /// The write buffer (the memtable) before it is flushed to a file, in bytes (at least 1
    /// MiB).
    pub write_buffer_bytes: u64,
    /// Changed keys a group tracks for its next delta; past it, the next snapshot writes the
    /// group in full instead.
    pub max_tracked_keys: usize,
    /// The write-back cache of recently used entries in front of the store, in bytes: a key
    /// read and written again and again (a counter) reaches the store once per flush, not per
    /// record. Flushed in one batch when full and before every scan or snapshot.
    pub write_cache_bytes: usize,
}

impl Default for DiskConfig {
    fn default() -> Self {
        DiskConfig {
            cache_bytes: 64 << 20,
            write_buffer_bytes: 64 << 20,
            max_tracked_keys: 1 << 20,
            write_cache_bytes: 64 << 20,
        }
    }
}

/// The store could not be opened.
#[derive(Debug, thiserror::Error)]
#[error("opening the disk state store in {dir}: {source}")]
pub struct OpenError {
    dir: PathBuf,
    #[source]
    source: fjall::Error,
}

/// An engine failure as the SDK's state error (a disk's I/O, a corrupt file).
fn engine(e: fjall::Error) -> StateError {
    StateError::Backend(format!("disk state store: {e}"))
}

/// A key tracked for the next delta: the epoch of its last change, and whether it held an entry
/// before its first tracked change and holds one now.
#[derive(Debug, Clone, Copy)]
struct Tracked {
    epoch: u32,
    was: bool,
    now: bool,
}

#[derive(Debug, Default)]
struct Group {
    /// Keys changed since the oldest cut a delta may still build on.
    tracked: BTreeMap<Vec<u8>, Tracked>,
    /// Entries, not counting what the tracked keys changed.
    base_len: usize,
    /// Its changes' epochs (`reset` also when its tracking was dropped; `forgotten_through`:
    /// changes at or before it are no longer tracked).
    epochs: GroupEpochs,
}

impl Group {
    fn len(&self) -> usize {
        let (added, removed) =
            self.tracked
                .values()
                .fold((0usize, 0usize), |(a, r), t| match (t.was, t.now) {
                    (false, true) => (a + 1, r),
                    (true, false) => (a, r + 1),
                    _ => (a, r),
                });
        (self.base_len + added).saturating_sub(removed)
    }

    /// Stops tracking the keys changed at or before `epoch`, their effect kept in the count.
    fn untrack_through(&mut self, epoch: u32) {
        let mut base = self.base_len as isize;
        self.tracked.retain(|_, t| {
            if t.epoch > epoch {
                return true;
            }
            base += isize::from(t.now) - isize::from(t.was);
            false
        });
        self.base_len = base.max(0) as usize;
    }
}

/// An entry in the write-back cache: its value (`None`: no entry), and whether the store has
/// it yet.
#[derive(Debug)]
struct Cached {
    value: Option<Vec<u8>>,
    dirty: bool,
}

/// What an entry costs the cache beyond its key's and value's bytes (the map's slot, the two
/// vectors' headers).
const CACHED_OVERHEAD: usize = 64;

/// Recently used entries by store key, bounded by bytes.
#[derive(Debug, Default)]
struct WriteCache {
    entries: HashMap<Vec<u8>, Cached, foldhash::fast::RandomState>,
    bytes: usize,
    dirty: usize,
}

impl WriteCache {
    fn cost(key: &[u8], value: &Option<Vec<u8>>) -> usize {
        key.len() + value.as_ref().map_or(0, Vec::len) + CACHED_OVERHEAD
    }

    fn insert(&mut self, key: Vec<u8>, value: Option<Vec<u8>>, dirty: bool) {
        self.bytes += Self::cost(&key, &value);
        if dirty {
            self.dirty += 1;
        }
        if let Some(old) = self.entries.insert(key, Cached { value, dirty }) {
            // The key's bytes were counted twice: once is taken off with the old value.
            self.bytes = self
                .bytes
                .saturating_sub(old.value.as_ref().map_or(0, Vec::len) + CACHED_OVERHEAD);
            if old.dirty {
                self.dirty -= 1;
            }
        }
    }
}

/// Keyed state of one subtask's key groups in an LSM tree on local disk.
pub struct DiskBackend {
    /// Dropped after the keyspace (declaration order): the database removes its directory.
    keyspace: Keyspace,
    db: Database,
    /// Behind a `RefCell`: reads (`&self`) fill it and scans flush it.
    cache: RefCell<WriteCache>,
    cache_limit: usize,
    groups: Vec<Group>,
    epoch: u32,
    max_tracked: usize,
}

impl std::fmt::Debug for DiskBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskBackend")
            .field("groups", &self.groups.len())
            .field("epoch", &self.epoch)
            .finish_non_exhaustive()
    }
}

/// The store's key of entry `key` of group index `group`.
fn store_key(group: usize, key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(4 + key.len());
    k.extend_from_slice(&(group as u32).to_be_bytes());
    k.extend_from_slice(key);
    k
}

impl DiskBackend {
    /// An empty store for `groups` owned key groups in the new directory `dir` (removed again
    /// when the backend is dropped).
    pub fn open(dir: &Path, groups: usize, config: DiskConfig) -> Result<Self, OpenError> {
        let open_error = |source| OpenError {
            dir: dir.to_owned(),
            source,
        };
        let db = Database::builder(dir)
            .cache_size(config.cache_bytes)
            // Scratch space: the snapshots in the object store are what survives a restart, so
            // nothing is synced.
            .manual_journal_persist(true)
            .temporary(true)
            .open()
            .map_err(open_error)?;
        let keyspace = db
            .keyspace("state", || {
                KeyspaceCreateOptions::default()
                    .max_memtable_size(config.write_buffer_bytes.max(1 << 20))
                    .manual_journal_persist(true)
            })
            .map_err(open_error)?;
        Ok(DiskBackend {
            keyspace,
            db,
            cache: RefCell::new(WriteCache::default()),
            cache_limit: config.write_cache_bytes,
            groups: (0..groups).map(|_| Group::default()).collect(),
            epoch: 1,
            max_tracked: config.max_tracked_keys.max(1),
        })
    }

    /// Refuses a group index this subtask does not own.
    fn check(&self, group: usize) -> Result<(), StateError> {
        if group < self.groups.len() {
            Ok(())
        } else {
            Err(StateError::Backend(format!(
                "group index {group} is not owned"
            )))
        }
    }

    /// The entry at store key `sk`: from the cache, else from the store (then cached).
    fn read(&self, sk: Vec<u8>) -> Result<Option<Vec<u8>>, StateError> {
        if let Some(c) = self.cache.borrow().entries.get(&sk) {
            return Ok(c.value.clone());
        }
        let value = self.keyspace.get(&sk).map_err(engine)?.map(|v| v.to_vec());
        self.cache.borrow_mut().insert(sk, value.clone(), false);
        self.bound()?;
        Ok(value)
    }

    /// Whether store key `sk` holds an entry.
    fn present(&self, sk: &[u8]) -> Result<bool, StateError> {
        if let Some(c) = self.cache.borrow().entries.get(sk) {
            return Ok(c.value.is_some());
        }
        self.keyspace.contains_key(sk).map_err(engine)
    }

    /// Writes (`Some`) or deletes the entry at store key `sk`, in the cache.
    fn write(&self, sk: Vec<u8>, value: Option<Vec<u8>>) -> Result<(), StateError> {
        self.cache.borrow_mut().insert(sk, value, true);
        self.bound()
    }

    /// Writes the cache's dirty entries to the store in one batch (they stay cached).
    fn flush(&self) -> Result<(), StateError> {
        let mut cache = self.cache.borrow_mut();
        if cache.dirty == 0 {
            return Ok(());
        }
        let mut batch = self.db.batch();
        for (k, c) in cache.entries.iter_mut().filter(|(_, c)| c.dirty) {
            match &c.value {
                Some(v) => batch.insert(&self.keyspace, k.as_slice(), v.as_slice()),
                None => batch.remove(&self.keyspace, k.as_slice()),
            }
            c.dirty = false;
        }
        cache.dirty = 0;
        batch.commit().map_err(engine)
    }

    /// Flushes the cache and empties it: when it is full, and before the store is written
    /// around it (a restore, a clear).
    fn empty_cache(&self) -> Result<(), StateError> {
        self.flush()?;
        let mut cache = self.cache.borrow_mut();
        cache.entries.clear();
        cache.bytes = 0;
        Ok(())
    }

    /// Keeps the cache within its bound.
    fn bound(&self) -> Result<(), StateError> {
        if self.cache.borrow().bytes > self.cache_limit {
            self.empty_cache()?;
        }
        Ok(())
    }

    /// Records that `key` of `group` (at store key `sk`) holds an entry (`now`) or none after a
    /// change in this epoch; returns whether it held one before.
    fn track(
        &mut self,
        group: usize,
        key: &[u8],
        sk: &[u8],
        now: bool,
    ) -> Result<bool, StateError> {
        let epoch = self.epoch;
        let known = self.groups[group].tracked.get(key).map(|t| t.now);
        let was = match known {
            Some(was) => was,
            None => self.present(sk)?,
        };
        let max = self.max_tracked;
        let g = &mut self.groups[group];
        if !was && !now {
            // A key that holds nothing deleted: no change.
            return Ok(false);
        }
        g.epochs.changed = epoch;
        match g.tracked.get_mut(key) {
            Some(t) => {
                t.now = now;
                t.epoch = epoch;
            }
            None => {
                g.tracked.insert(key.to_vec(), Tracked { epoch, was, now });
            }
        }
        if g.tracked.len() > max {
            // Too many to track: the next snapshot writes the group in full.
            g.untrack_through(u32::MAX);
            g.epochs.reset = epoch;
        }
        Ok(was)
    }

    /// Every (entry key, value) of `group` whose entry key starts with `prefix`, in order, as
    /// the store has them (flush the cache first).
    fn range(
        &self,
        group: usize,
        prefix: &[u8],
    ) -> impl DoubleEndedIterator<Item = Result<(Vec<u8>, Vec<u8>), StateError>> + '_ {
        self.keyspace.prefix(store_key(group, prefix)).map(|guard| {
            let (k, v) = guard.into_inner().map_err(engine)?;
            Ok((k[4..].to_vec(), v.to_vec()))
        })
    }

    /// The entry keys of `group` that start with `prefix`, in order, as the store has them.
    fn keys(&self, group: usize, prefix: &[u8]) -> Result<Vec<Vec<u8>>, StateError> {
        self.range(group, prefix)
            .map(|r| r.map(|(k, _)| k))
            .collect()
    }

    /// Deletes every entry of `group` from the store, untracked.
    fn wipe(&mut self, group: usize) -> Result<(), StateError> {
        self.empty_cache()?;
        let keys = self.keys(group, &[])?;
        let mut batch = self.db.batch();
        for k in keys {
            batch.remove(&self.keyspace, store_key(group, &k));
        }
        batch.commit().map_err(engine)
    }
}

impl StateBackend for DiskBackend {
    fn get(&self, group: usize, key: &[u8]) -> Result<Option<Cow<'_, [u8]>>, StateError> {
        self.check(group)?;
        Ok(self.read(store_key(group, key))?.map(Cow::Owned))
    }

    fn put(&mut self, group: usize, key: &[u8], value: Vec<u8>) -> Result<(), StateError> {
        self.check(group)?;
        let sk = store_key(group, key);
        self.track(group, key, &sk, true)?;
        self.write(sk, Some(value))
    }

    fn delete(&mut self, group: usize, key: &[u8]) -> Result<(), StateError> {
        self.check(group)?;
        let sk = store_key(group, key);
        if self.track(group, key, &sk, false)? {
            self.write(sk, None)?;
        }
        Ok(())
    }

    fn scan(&self, group: usize, prefix: &[u8]) -> Result<Entries, StateError> {
        self.check(group)?;
        self.flush()?;
        self.range(group, prefix).collect()
    }

    fn last_key(&self, group: usize, prefix: &[u8]) -> Result<Option<Vec<u8>>, StateError> {
        self.check(group)?;
        self.flush()?;
        self.range(group, prefix)
            .next_back()
            .transpose()
            .map(|e| e.map(|(k, _)| k))
    }

    fn delete_prefix(&mut self, group: usize, prefix: &[u8]) -> Result<(), StateError> {
        self.check(group)?;
        self.flush()?;
        for k in self.keys(group, prefix)? {
            self.delete(group, &k)?;
        }
        Ok(())
    }

    fn cut(&mut self) -> u32 {
        end_epoch(&mut self.epoch)
    }

    fn group_mode(&self, group: usize, since: u32) -> GroupMode {
        self.groups
            .get(group)
            .map_or(GroupMode::Full, |g| g.epochs.mode(since))
    }

    fn visit(
        &mut self,
        group: usize,
        mode: GroupMode,
        f: &mut dyn FnMut(Change<'_>),
    ) -> Result<(), StateError> {
        self.check(group)?;
        self.flush()?;
        match mode {
            GroupMode::Unchanged => {}
            GroupMode::Full => {
                for entry in self.range(group, &[]) {
                    let (k, v) = entry?;
                    f(Change::Put(&k, &v));
                }
            }
            GroupMode::Delta { since } => {
                let g = &self.groups[group];
                for (k, t) in g.tracked.iter().filter(|(_, t)| t.epoch > since) {
                    if !t.now {
                        f(Change::Delete(k));
                        continue;
                    }
                    let value = self
                        .keyspace
                        .get(store_key(group, k))
                        .map_err(engine)?
                        .ok_or_else(|| {
                            StateError::Backend(
                                "disk state store: a tracked entry is missing from the store"
                                    .into(),
                            )
                        })?;
                    f(Change::Put(k, &value));
                }
                let g = &mut self.groups[group];
                g.untrack_through(since);
                g.epochs.forget_through(since);
            }
        }
        Ok(())
    }

    fn install(
        &mut self,
        group: usize,
        entries: BTreeMap<Vec<u8>, Vec<u8>>,
    ) -> Result<(), StateError> {
        self.check(group)?;
        self.wipe(group)?;
        let len = entries.len();
        let mut batch = self.db.batch();
        for (k, v) in entries {
            batch.insert(&self.keyspace, store_key(group, &k), v);
        }
        batch.commit().map_err(engine)?;
        self.groups[group] = Group {
            base_len: len,
            ..Group::default()
        };
        Ok(())
    }

    fn apply(
        &mut self,
        group: usize,
        changes: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
    ) -> Result<(), StateError> {
        self.check(group)?;
        self.empty_cache()?;
        // Not a change (epoch 0); the count follows what each key held before.
        let mut batch = self.db.batch();
        for (k, v) in changes {
            let key = store_key(group, &k);
            let now = v.is_some();
            // An applied key is restored state, not a change: it leaves the tracking.
            let had = match self.groups[group].tracked.remove(&k) {
                Some(t) => t.was,
                None => self.keyspace.contains_key(&key).map_err(engine)?,
            };
            let g = &mut self.groups[group];
            g.base_len = (g.base_len + usize::from(now)).saturating_sub(usize::from(had));
            match v {
                Some(v) => batch.insert(&self.keyspace, key, v),
                None => batch.remove(&self.keyspace, key),
            }
        }
        batch.commit().map_err(engine)
    }

    fn clear(&mut self, group: usize) -> Result<(), StateError> {
        self.check(group)?;
        self.wipe(group)?;
        let epoch = self.epoch;
        self.groups[group] = Group {
            epochs: GroupEpochs::cleared(epoch),
            ..Group::default()
        };
        Ok(())
    }

    fn len(&self, group: usize) -> usize {
        self.groups.get(group).map_or(0, Group::len)
    }
}
