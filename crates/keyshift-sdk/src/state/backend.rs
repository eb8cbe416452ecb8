//! The byte-addressed [`StateBackend`] interface a disk engine implements, and
//! [`SortedBackend`], its in-memory reference.
//!
//! The interface is a sorted key-value store per key group, addressed by bytes, the shape a
//! disk engine (an LSM tree) has natively, so a disk backend implements it without a layer of
//! translation:
//!
//! ```text
//! entry key   = key's byte form (crate::key::encode_key) | state id u16 BE | user key
//!               (empty for value, reducing and aggregating state; a map's key; a list
//!               element's sequence number; a timer's timestamp)
//! entry value = the serializer's bytes (with a TTL: the expiry, i64 BE, first)
//! ```
//!
//! A key's entries are one contiguous range, a state's entries for a key a contiguous range
//! inside it, and a key group's entries a separate store: a snapshot writes and a restore reads
//! groups, never keys.
//!
//! Every change is stamped with the cut epoch it was made in ([`StateBackend::cut`] ends one), so
//! a snapshot can write only what changed since the one it builds on ([`GroupMode::Delta`]),
//! deletions included.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::ops::Bound;

use crate::error::StateError;

pub use keyshift_core::keygroup::GroupMode;

/// One change of a delta: an entry written, or deleted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change<'a> {
    Put(&'a [u8], &'a [u8]),
    Delete(&'a [u8]),
}

/// Entries as (entry key, value), in key order.
pub type Entries = Vec<(Vec<u8>, Vec<u8>)>;

/// The cut epochs of one key group that say how a snapshot must write it ([`Self::mode`]):
/// every backend keeps them the same way.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GroupEpochs {
    /// Epoch of the last change.
    pub changed: u32,
    /// Epoch the group was last cleared (a delta cannot say that).
    pub reset: u32,
    /// Changes at or before this epoch can no longer be told apart (a delta forgot its
    /// deletions): a delta since an earlier cut is written in full.
    pub forgotten_through: u32,
}

impl GroupEpochs {
    /// A group cleared in `epoch`: written in full by the next snapshot.
    pub fn cleared(epoch: u32) -> Self {
        GroupEpochs {
            changed: epoch,
            reset: epoch,
            forgotten_through: 0,
        }
    }

    /// How a snapshot building on the one taken at cut `since` must write the group: in full
    /// if it was cleared since (or `since` is older than what it can tell apart), not at all if
    /// nothing changed, else a delta.
    pub fn mode(&self, since: u32) -> GroupMode {
        if self.reset > since || since < self.forgotten_through {
            GroupMode::Full
        } else if self.changed <= since {
            GroupMode::Unchanged
        } else {
            GroupMode::Delta { since }
        }
    }

    /// A delta since `since` was written: what changed at or before it is forgotten.
    pub fn forget_through(&mut self, since: u32) {
        self.forgotten_through = self.forgotten_through.max(since);
    }
}

/// Ends the current cut epoch (`StateBackend::cut`): returns it and moves `epoch` to the next
/// one (0, the epoch of restored state, is never reused).
pub fn end_epoch(epoch: &mut u32) -> u32 {
    let ended = *epoch;
    *epoch = ended.wrapping_add(1).max(1);
    ended
}

/// The keyed state of one subtask's key groups. Every method takes the group's index among the
/// owned groups (0-based), not the group number.
pub trait StateBackend: Send {
    /// The entry at `key`.
    fn get(&self, group: usize, key: &[u8]) -> Result<Option<Cow<'_, [u8]>>, StateError>;
    /// Writes the entry at `key`.
    fn put(&mut self, group: usize, key: &[u8], value: Vec<u8>) -> Result<(), StateError>;
    /// Deletes the entry at `key` (nothing if absent).
    fn delete(&mut self, group: usize, key: &[u8]) -> Result<(), StateError>;
    /// Every entry whose key starts with `prefix`, in key order.
    fn scan(&self, group: usize, prefix: &[u8]) -> Result<Entries, StateError>;
    /// The greatest entry key starting with `prefix`.
    fn last_key(&self, group: usize, prefix: &[u8]) -> Result<Option<Vec<u8>>, StateError>;
    /// Deletes every entry whose key starts with `prefix`.
    fn delete_prefix(&mut self, group: usize, prefix: &[u8]) -> Result<(), StateError>;

    /// Ends the current cut epoch and returns it: every change so far carries it or an earlier
    /// one, every later change a later one. State installed by a restore is epoch 0.
    fn cut(&mut self) -> u32;
    /// How a snapshot building on the one taken at cut `since` must write `group`.
    fn group_mode(&self, group: usize, since: u32) -> GroupMode;
    /// Visits the group as `mode` says: every entry (`Full`), or the changes after `since`
    /// (`Delta`). A delta's deletions older than `since` are forgotten afterwards (a later
    /// delta since an earlier cut is then written in full, see [`Self::group_mode`]).
    fn visit(
        &mut self,
        group: usize,
        mode: GroupMode,
        f: &mut dyn FnMut(Change<'_>),
    ) -> Result<(), StateError>;
    /// Replaces the group's state with `entries` (a restore: not a change).
    fn install(
        &mut self,
        group: usize,
        entries: BTreeMap<Vec<u8>, Vec<u8>>,
    ) -> Result<(), StateError>;
    /// Applies a restore's later deltas onto the group's installed state: each entry written
    /// (`Some`) or deleted (`None`). Like [`Self::install`], not a change (epoch 0): a disk engine
    /// applies it as one write batch, and the work is the deltas', not the group's.
    fn apply(
        &mut self,
        group: usize,
        changes: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
    ) -> Result<(), StateError>;
    /// Drops the group's state (a change: the next snapshot writes it in full).
    fn clear(&mut self, group: usize) -> Result<(), StateError>;
    /// Number of entries in the group.
    fn len(&self, group: usize) -> usize;
}

#[derive(Debug, Clone)]
struct Entry {
    value: Vec<u8>,
    /// The cut epoch of its last write (0: restored).
    epoch: u32,
}

#[derive(Debug, Default)]
struct Group {
    entries: BTreeMap<Vec<u8>, Entry>,
    /// Keys deleted, and the epoch of the deletion (deltas must say so).
    deleted: BTreeMap<Vec<u8>, u32>,
    epochs: GroupEpochs,
}

/// A byte-addressed backend in memory: one sorted map per owned key group, the layout a disk
/// engine keeps (the reference for one, and what the tests run the state API against besides
/// the heap backend).
#[derive(Debug)]
pub struct SortedBackend {
    groups: Vec<Group>,
    epoch: u32,
}

impl SortedBackend {
    /// An empty backend for `groups` owned key groups.
    pub fn new(groups: usize) -> Self {
        SortedBackend {
            groups: (0..groups).map(|_| Group::default()).collect(),
            epoch: 1,
        }
    }

    fn group(&self, group: usize) -> Result<&Group, StateError> {
        self.groups
            .get(group)
            .ok_or_else(|| StateError::Backend(format!("group index {group} is not owned")))
    }

    fn group_mut(&mut self, group: usize) -> Result<&mut Group, StateError> {
        self.groups
            .get_mut(group)
            .ok_or_else(|| StateError::Backend(format!("group index {group} is not owned")))
    }
}

/// The smallest key greater than every key starting with `prefix` (None: no bound).
fn prefix_end(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < u8::MAX {
            end.push(last + 1);
            return Some(end);
        }
    }
    None
}

fn prefix_range(prefix: &[u8]) -> (Bound<Vec<u8>>, Bound<Vec<u8>>) {
    (
        Bound::Included(prefix.to_vec()),
        prefix_end(prefix).map_or(Bound::Unbounded, Bound::Excluded),
    )
}

impl StateBackend for SortedBackend {
    fn get(&self, group: usize, key: &[u8]) -> Result<Option<Cow<'_, [u8]>>, StateError> {
        Ok(self
            .group(group)?
            .entries
            .get(key)
            .map(|e| Cow::Borrowed(e.value.as_slice())))
    }

    fn put(&mut self, group: usize, key: &[u8], value: Vec<u8>) -> Result<(), StateError> {
        let epoch = self.epoch;
        let g = self.group_mut(group)?;
        g.epochs.changed = epoch;
        match g.entries.get_mut(key) {
            Some(e) => {
                e.value = value;
                e.epoch = epoch;
            }
            None => {
                g.deleted.remove(key);
                g.entries.insert(key.to_vec(), Entry { value, epoch });
            }
        }
        Ok(())
    }

    fn delete(&mut self, group: usize, key: &[u8]) -> Result<(), StateError> {
        let epoch = self.epoch;
        let g = self.group_mut(group)?;
        if g.entries.remove(key).is_some() {
            g.epochs.changed = epoch;
            g.deleted.insert(key.to_vec(), epoch);
        }
        Ok(())
    }

    fn scan(&self, group: usize, prefix: &[u8]) -> Result<Entries, StateError> {
        Ok(self
            .group(group)?
            .entries
            .range(prefix_range(prefix))
            .map(|(k, e)| (k.clone(), e.value.clone()))
            .collect())
    }

    fn last_key(&self, group: usize, prefix: &[u8]) -> Result<Option<Vec<u8>>, StateError> {
        Ok(self
            .group(group)?
            .entries
            .range(prefix_range(prefix))
            .next_back()
            .map(|(k, _)| k.clone()))
    }

    fn delete_prefix(&mut self, group: usize, prefix: &[u8]) -> Result<(), StateError> {
        let epoch = self.epoch;
        let g = self.group_mut(group)?;
        let keys: Vec<Vec<u8>> = g
            .entries
            .range(prefix_range(prefix))
            .map(|(k, _)| k.clone())
            .collect();
        if !keys.is_empty() {
            g.epochs.changed = epoch;
        }
        for k in keys {
            g.entries.remove(&k);
            g.deleted.insert(k, epoch);
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
        let g = self.group_mut(group)?;
        match mode {
            GroupMode::Unchanged => {}
            GroupMode::Full => {
                for (k, e) in &g.entries {
                    f(Change::Put(k, &e.value));
                }
            }
            GroupMode::Delta { since } => {
                for (k, e) in &g.entries {
                    if e.epoch > since {
                        f(Change::Put(k, &e.value));
                    }
                }
                for (k, epoch) in &g.deleted {
                    if *epoch > since {
                        f(Change::Delete(k));
                    }
                }
                g.deleted.retain(|_, epoch| *epoch > since);
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
        *self.group_mut(group)? = Group {
            entries: entries
                .into_iter()
                .map(|(k, value)| (k, Entry { value, epoch: 0 }))
                .collect(),
            ..Group::default()
        };
        Ok(())
    }

    fn apply(
        &mut self,
        group: usize,
        changes: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
    ) -> Result<(), StateError> {
        let g = self.group_mut(group)?;
        for (key, value) in changes {
            match value {
                Some(value) => {
                    g.entries.insert(key, Entry { value, epoch: 0 });
                }
                None => {
                    g.entries.remove(&key);
                }
            }
        }
        Ok(())
    }

    fn clear(&mut self, group: usize) -> Result<(), StateError> {
        let epoch = self.epoch;
        *self.group_mut(group)? = Group {
            epochs: GroupEpochs::cleared(epoch),
            ..Group::default()
        };
        Ok(())
    }

    fn len(&self, group: usize) -> usize {
        self.groups.get(group).map_or(0, |g| g.entries.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn changes(b: &mut SortedBackend, mode: GroupMode) -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
        let mut out = Vec::new();
        b.visit(0, mode, &mut |c| match c {
            Change::Put(k, v) => out.push((k.to_vec(), Some(v.to_vec()))),
            Change::Delete(k) => out.push((k.to_vec(), None)),
        })
        .unwrap();
        out
    }

    #[test]
    fn a_group_s_epochs_say_full_unchanged_or_delta() {
        let mut e = GroupEpochs {
            changed: 5,
            ..GroupEpochs::default()
        };
        assert_eq!(e.mode(5), GroupMode::Unchanged);
        assert_eq!(e.mode(6), GroupMode::Unchanged);
        assert_eq!(e.mode(4), GroupMode::Delta { since: 4 });
        e.forget_through(3);
        assert_eq!(e.mode(2), GroupMode::Full, "older than what it tells apart");
        assert_eq!(e.mode(3), GroupMode::Delta { since: 3 });
        let c = GroupEpochs::cleared(7);
        assert_eq!(c.mode(6), GroupMode::Full);
        assert_eq!(c.mode(7), GroupMode::Unchanged);
        let mut epoch = 1;
        assert_eq!(end_epoch(&mut epoch), 1);
        assert_eq!(epoch, 2);
        let mut epoch = u32::MAX;
        assert_eq!(end_epoch(&mut epoch), u32::MAX);
        assert_eq!(epoch, 1, "0 is the restored state's");
    }

    #[test]
    fn deltas_carry_writes_and_deletes_since_their_base() {
        let mut b = SortedBackend::new(1);
        b.put(0, b"a", b"1".to_vec()).unwrap();
        b.put(0, b"b", b"2".to_vec()).unwrap();
        let first = b.cut();
        assert_eq!(b.group_mode(0, first), GroupMode::Unchanged);
        b.put(0, b"b", b"3".to_vec()).unwrap();
        b.delete(0, b"a").unwrap();
        b.put(0, b"c", b"4".to_vec()).unwrap();
        let second = b.cut();
        assert!(second > first);
        assert_eq!(b.group_mode(0, first), GroupMode::Delta { since: first });
        let delta = changes(&mut b, GroupMode::Delta { since: first });
        assert_eq!(
            delta,
            vec![
                (b"b".to_vec(), Some(b"3".to_vec())),
                (b"c".to_vec(), Some(b"4".to_vec())),
                (b"a".to_vec(), None),
            ]
        );
        // The deletion before `first` is forgotten now: a delta since an earlier cut is full.
        assert_eq!(b.group_mode(0, first - 1), GroupMode::Full);
    }

    #[test]
    fn a_cleared_group_is_written_in_full_and_prefixes_scan_in_order() {
        let mut b = SortedBackend::new(2);
        for k in [&b"k\x01b"[..], b"k\x01a", b"k\x02", b"j\xff"] {
            b.put(1, k, k.to_vec()).unwrap();
        }
        let keys: Vec<_> = b
            .scan(1, b"k\x01")
            .unwrap()
            .into_iter()
            .map(|e| e.0)
            .collect();
        assert_eq!(keys, vec![b"k\x01a".to_vec(), b"k\x01b".to_vec()]);
        assert_eq!(b.last_key(1, b"k").unwrap(), Some(b"k\x02".to_vec()));
        assert_eq!(b.last_key(1, b"j\xff").unwrap(), Some(b"j\xff".to_vec()));
        let cut = b.cut();
        b.clear(1).unwrap();
        assert_eq!(b.group_mode(1, cut), GroupMode::Full);
        assert_eq!(b.group_mode(0, cut), GroupMode::Unchanged);
        assert_eq!(b.len(1), 0);
        b.delete_prefix(0, b"").unwrap();
        assert!(b.get(5, b"x").is_err());
    }
}
