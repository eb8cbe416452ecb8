//! Incremental checkpoints: what a subtask's next checkpoint builds on (pure, no I/O).
//!
//! A checkpoint builds on the job's newest committed snapshot when that is a checkpoint this
//! subtask wrote (or restored from) in this run: each of its key groups is then written as
//!
//! * nothing new, when it has not changed since that checkpoint's cut: the new manifest refers
//!   to the same blocks ([`GroupMode::Unchanged`]);
//! * a delta block of the keys changed since, appended to the group's chain of blocks
//!   ([`GroupMode::Delta`]);
//! * the whole group ([`GroupMode::Full`]), when it lost keys since (a delta cannot say so).
//!
//! A group whose chain is long ([`ChainPolicy::max_deltas`]) or whose deltas add up to a large
//! part of its first block ([`ChainPolicy::max_delta_share`]) is compacted: the upload, after
//! the cut and while records flow, reads its chain back, merges the new delta into it and
//! writes the group whole ([`Base::compacts`]). That bounds what a restore reads beyond the
//! state itself and how long old files stay referenced, without holding records up.
//!
//! Otherwise (the first checkpoint of a run that did not restore one of the job's own
//! checkpoints, after a savepoint committed, after a checkpoint failed) it writes every group.
//! The newest committed snapshot is never deleted by retention, and retention keeps every file a
//! kept manifest refers to, so the blocks a checkpoint builds on are there when it commits (and
//! the coordinator checks that they are, with their sizes, before it commits).

use crate::job::{GroupMode, GroupModes};
use crate::snapshot::{
    FileEntry, GroupEntry, Manifest, SnapshotKind, SubtaskSnapshot, referenced_file_name,
};
use keyshift_core::keygroup::KeyGroupRange;
use std::collections::BTreeMap;

pub use keyshift_core::spec::{MAX_DELTA_PERCENT_BOUNDS, MAX_DELTAS_BOUNDS};

/// How a run's workers write checkpoints (`spec.state.incrementalCheckpoints`, sent in the start
/// request).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ChainSettings {
    /// Whether checkpoints build on earlier ones.
    pub enabled: bool,
    /// When a group is written whole again.
    #[serde(flatten)]
    pub policy: ChainPolicy,
}

impl Default for ChainSettings {
    fn default() -> Self {
        ChainSettings {
            enabled: true,
            policy: ChainPolicy::default(),
        }
    }
}

impl ChainSettings {
    /// The settings of a job's spec (its defaults where it says nothing).
    pub fn from_spec(spec: Option<&keyshift_core::spec::IncrementalCheckpoints>) -> Self {
        let d = ChainSettings::default();
        let Some(s) = spec else {
            return d;
        };
        ChainSettings {
            enabled: s.enabled,
            policy: ChainPolicy {
                max_deltas: s.max_deltas.map_or(d.policy.max_deltas, |n| n as usize),
                max_delta_share: s
                    .max_delta_percent
                    .map_or(d.policy.max_delta_share, u64::from),
            },
        }
    }

    /// Whether the policy lies within the bounds the CRD allows (a start request is refused
    /// otherwise).
    pub fn in_bounds(&self) -> bool {
        u32::try_from(self.policy.max_deltas).is_ok_and(|n| MAX_DELTAS_BOUNDS.contains(&n))
            && u32::try_from(self.policy.max_delta_share)
                .is_ok_and(|n| MAX_DELTA_PERCENT_BOUNDS.contains(&n))
    }
}

/// When a group's chain of blocks is written out in full again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ChainPolicy {
    /// Deltas a group may have before its next change writes it in full.
    pub max_deltas: usize,
    /// Bytes of deltas, as a share of the group's first block (percent), past which its next
    /// change writes it in full.
    #[serde(rename = "maxDeltaPercent")]
    pub max_delta_share: u64,
}

impl Default for ChainPolicy {
    fn default() -> Self {
        ChainPolicy {
            max_deltas: 32,
            max_delta_share: 50,
        }
    }
}

/// State blocks (first blocks and deltas) a checkpoint's manifest names at most: the chain
/// policy keeps every group's chain short enough ([`ChainPolicy::deltas_cap`]), so that a
/// manifest of 32768 groups at that length stays under half of
/// [`crate::snapshot::MAX_MANIFEST_BYTES`] (a block takes at most about 180 bytes of JSON).
pub const MANIFEST_BLOCK_BUDGET: usize = 1 << 17;

impl ChainPolicy {
    /// The most deltas a group's chain may have at `max_parallelism` key groups: 64 (the most
    /// `maxDeltas` allows), or fewer where the whole manifest would otherwise name more than
    /// [`MANIFEST_BLOCK_BUDGET`] blocks (from 2017 groups on: 31 at 4096, 3 at 32768). Pure.
    pub fn deltas_cap(max_parallelism: u32) -> usize {
        (MANIFEST_BLOCK_BUDGET / (max_parallelism.max(1) as usize))
            .saturating_sub(1)
            .clamp(1, *MAX_DELTAS_BOUNDS.end() as usize)
    }

    /// How a checkpoint at `max_parallelism` key groups writes its groups: by the job's policy,
    /// with no chain longer than [`ChainPolicy::deltas_cap`]. A stop checkpoint (the old run of
    /// a pre-staged rescale stops with one, inside the pause, and the new run's workers read
    /// only its delta: see [`crate::runtime::prestage`]) compacts only a chain at that cap, so
    /// that it writes and the new workers read only the changes; the new run's checkpoints
    /// compact what is then due.
    pub fn for_checkpoint(self, stop: bool, max_parallelism: u32) -> CutPolicy {
        CutPolicy {
            policy: self,
            stop,
            cap: Self::deltas_cap(max_parallelism),
        }
    }
}

/// How one checkpoint writes its groups ([`ChainPolicy::for_checkpoint`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CutPolicy {
    /// The job's policy.
    pub policy: ChainPolicy,
    /// A stop checkpoint: it compacts only chains at `cap`.
    pub stop: bool,
    /// No group's chain is longer.
    pub cap: usize,
}

impl CutPolicy {
    /// The deltas `group` may have before a change to it writes it whole: the job's
    /// `maxDeltas` staggered by group (so that groups reach it at different checkpoints), never
    /// above the cap; the cap itself in a stop checkpoint. Pure.
    pub fn max_deltas(&self, group: u32) -> usize {
        if self.stop {
            self.cap
        } else {
            self.policy
                .max_deltas
                .min(self.cap)
                .saturating_sub((group % 8) as usize)
                .max(1)
        }
    }

    /// Whether deltas of `deltas` bytes over a first block of `first` bytes are past the
    /// job's share (never, in a stop checkpoint). Pure.
    fn share_exceeded(&self, deltas: u64, first: u64) -> bool {
        !self.stop
            && self.policy.max_delta_share < u64::MAX
            && deltas.saturating_mul(100) >= first.saturating_mul(self.policy.max_delta_share)
    }
}

/// A checkpoint as a later one of this subtask can build on it: where each of the subtask's
/// groups lies (file names relative to the job directory) and the cut it was taken at.
#[derive(Debug, Clone, PartialEq)]
pub struct Base {
    /// The checkpoint's id.
    pub id: u64,
    /// The keyed operator's cut epoch at its barrier ([`KeyedAggregator::cut`]; 0: restored).
    pub cut: u32,
    /// The subtask's groups.
    pub groups: BTreeMap<u32, GroupEntry>,
    /// Every file those groups' blocks lie in.
    pub files: BTreeMap<String, FileEntry>,
}

fn rename(kind: SnapshotKind, id: u64, mut g: GroupEntry) -> GroupEntry {
    g.file = referenced_file_name(kind, id, &g.file);
    for d in &mut g.deltas {
        d.file = referenced_file_name(kind, id, &d.file);
    }
    g
}

impl Base {
    /// The checkpoint `id` this subtask wrote at cut `cut` (its acknowledgement).
    pub fn written(id: u64, cut: u32, ack: &SubtaskSnapshot) -> Base {
        let kind = SnapshotKind::Checkpoint;
        let mut files: BTreeMap<String, FileEntry> = ack
            .referenced
            .iter()
            .map(|f| (f.name.clone(), f.clone()))
            .collect();
        let own = FileEntry {
            name: referenced_file_name(kind, id, &ack.file.name),
            ..ack.file.clone()
        };
        files.insert(own.name.clone(), own);
        Base {
            id,
            cut,
            groups: ack
                .groups
                .iter()
                .map(|g| (g.group, rename(kind, id, g.clone())))
                .collect(),
            files,
        }
    }

    /// The checkpoint a subtask of key groups `range` restored from (its manifest): the state as
    /// restored is cut 0.
    pub fn restored(manifest: &Manifest, range: KeyGroupRange) -> Base {
        let (kind, id) = (manifest.kind, manifest.snapshot_id);
        Base {
            id,
            cut: 0,
            groups: range
                .iter()
                .filter_map(|g| manifest.group(g))
                .map(|g| (g.group, rename(kind, id, g.clone())))
                .collect(),
            files: manifest
                .files
                .iter()
                .map(|f| {
                    let name = referenced_file_name(kind, id, &f.name);
                    (name.clone(), FileEntry { name, ..f.clone() })
                })
                .collect(),
        }
    }

    /// How the next checkpoint's cut takes `group` on top of this one.
    pub fn mode(&self, agg: &impl GroupModes, group: u32) -> GroupMode {
        match self.groups.get(&group) {
            Some(prior) if prior.length > 0 => agg.group_mode(group, self.cut),
            _ => GroupMode::Full,
        }
    }

    /// Whether a delta of `group` on top of this checkpoint is written as the group's whole
    /// state instead (compaction: its chain is long, or its deltas add up to a large share of
    /// its first block). The upload merges the chain it reads back from storage with the new
    /// delta, so the cut stays as cheap as any delta's. Groups reach the length limit at
    /// different checkpoints (the limit is staggered by group), so compaction spreads out.
    pub fn compacts(&self, group: u32, policy: CutPolicy) -> bool {
        let Some(g) = self.groups.get(&group) else {
            return false;
        };
        let deltas: u64 = g.deltas.iter().map(|d| d.length).sum();
        g.deltas.len() >= policy.max_deltas(group) || policy.share_exceeded(deltas, g.length)
    }
}

/// What a subtask's checkpoints can build on: the committed one, and those written but not yet
/// known to be committed.
#[derive(Debug, Clone, Default)]
pub struct Chain {
    base: Option<Base>,
    pending: BTreeMap<u64, Base>,
    /// Whether incremental checkpoints are on.
    pub enabled: bool,
    /// When groups are written in full again.
    pub policy: ChainPolicy,
}

/// Checkpoints written and not yet known committed that a subtask remembers.
const PENDING_KEPT: usize = 4;

impl Chain {
    /// No checkpoint to build on yet.
    pub fn new(settings: ChainSettings) -> Self {
        Chain {
            enabled: settings.enabled,
            policy: settings.policy,
            ..Chain::default()
        }
    }

    /// The checkpoint the subtask restored from builds the next one.
    pub fn restored_from(&mut self, base: Base) {
        self.base = Some(base);
    }

    /// The base of the next checkpoint, given the trigger's newest committed snapshot
    /// (`None`: a coordinator that does not say): a checkpoint this subtask wrote or restored
    /// from, and the newest committed snapshot of the job; otherwise none (a full checkpoint).
    pub fn base_for(&mut self, last_committed: Option<u64>) -> Option<&Base> {
        if !self.enabled {
            return None;
        }
        let Some(last) = last_committed else {
            self.base = None;
            return None;
        };
        if let Some(b) = self.pending.remove(&last) {
            self.base = Some(b);
        }
        // A checkpoint written here after the newest committed one did not commit (it failed
        // elsewhere, or its commit found a file it reads gone): start over with a full one.
        let failed = self.pending.keys().any(|id| *id > last);
        self.pending.clear();
        if failed || self.base.as_ref().is_some_and(|b| b.id != last) {
            self.base = None;
        }
        self.base.as_ref()
    }

    /// A checkpoint this subtask took did not complete here (its write failed, or it was
    /// aborted): the next one is written in full, whatever its base was (a write that failed
    /// reading the base back would fail again).
    pub fn reset(&mut self) {
        self.base = None;
        self.pending.clear();
    }

    /// Checkpoint `base.id` was written (not yet committed).
    pub fn written(&mut self, base: Base) {
        if !self.enabled {
            return;
        }
        self.pending.insert(base.id, base);
        while self.pending.len() > PENDING_KEPT {
            self.pending.pop_first();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::{AggConfig, Record, RecordKey};
    use keyshift_core::spec::AggregateFunction;

    #[test]
    fn chain_settings_come_from_the_spec_with_its_defaults_and_travel_as_json() {
        use keyshift_core::spec::IncrementalCheckpoints;
        assert_eq!(ChainSettings::from_spec(None), ChainSettings::default());
        assert!(ChainSettings::default().enabled && ChainSettings::default().in_bounds());
        let off = IncrementalCheckpoints {
            enabled: false,
            max_deltas: None,
            max_delta_percent: None,
        };
        let s = ChainSettings::from_spec(Some(&off));
        assert!(!s.enabled);
        assert_eq!(s.policy, ChainPolicy::default());
        let set = IncrementalCheckpoints {
            enabled: true,
            max_deltas: Some(4),
            max_delta_percent: Some(200),
        };
        let s = ChainSettings::from_spec(Some(&set));
        assert_eq!((s.policy.max_deltas, s.policy.max_delta_share), (4, 200));
        let json = serde_json::to_value(s).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"enabled": true, "maxDeltas": 4, "maxDeltaPercent": 200})
        );
        assert_eq!(serde_json::from_value::<ChainSettings>(json).unwrap(), s);
        // A chain that never builds on anything when off.
        let mut chain = Chain::new(ChainSettings::from_spec(Some(&off)));
        assert!(chain.base_for(Some(1)).is_none());
        for (d, p, ok) in [
            (1, 10, true),
            (64, 400, true),
            (0, 50, false),
            (16, 401, false),
        ] {
            let s = ChainSettings {
                enabled: true,
                policy: ChainPolicy {
                    max_deltas: d,
                    max_delta_share: p,
                },
            };
            assert_eq!(s.in_bounds(), ok, "{d} deltas, {p}%");
        }
    }

    /// The chain limit decides when a group is written whole again: after `maxDeltas` minus
    /// the group's stagger (group % 8), or once the deltas reach `maxDeltaPercent` of the block.
    #[test]
    fn the_chain_limits_decide_when_a_group_is_compacted() {
        let with_deltas = |group: u32, n: usize, each: u64| {
            let mut groups = BTreeMap::new();
            groups.insert(
                group,
                GroupEntry {
                    group,
                    file: "f".into(),
                    offset: 0,
                    length: 1000,
                    checksum: Default::default(),
                    entries: 10,
                    deltas: (0..n)
                        .map(|i| crate::snapshot::DeltaBlock {
                            file: format!("d{i}"),
                            offset: 0,
                            length: each,
                            checksum: Default::default(),
                            entries: 1,
                        })
                        .collect(),
                },
            );
            Base {
                id: 1,
                cut: 0,
                groups,
                files: BTreeMap::new(),
            }
        };
        let policy = |max_deltas, max_delta_share| {
            ChainPolicy {
                max_deltas,
                max_delta_share,
            }
            .for_checkpoint(false, 128)
        };
        // Group 0 has no stagger: 4 deltas of 1 byte under a limit of 4 compact, 3 do not.
        assert!(with_deltas(0, 4, 1).compacts(0, policy(4, 50)));
        assert!(!with_deltas(0, 3, 1).compacts(0, policy(4, 50)));
        // Group 3 is staggered by 3: 13 deltas reach a limit of 16.
        assert!(with_deltas(3, 13, 1).compacts(3, policy(16, 50)));
        assert!(!with_deltas(3, 12, 1).compacts(3, policy(16, 50)));
        // Bytes: 2 deltas of 250 bytes are 50% of a 1000-byte block.
        assert!(with_deltas(0, 2, 250).compacts(0, policy(64, 50)));
        assert!(!with_deltas(0, 2, 250).compacts(0, policy(64, 51)));
        // A stop checkpoint compacts only a chain at the cap (64 at 128 groups), however large
        // its deltas.
        let stop = ChainPolicy {
            max_deltas: 4,
            max_delta_share: 50,
        }
        .for_checkpoint(true, 128);
        for g in 0..16 {
            assert!(!with_deltas(g, 63, 1).compacts(g, stop));
            assert!(with_deltas(g, 64, 1).compacts(g, stop));
            assert!(!with_deltas(g, 3, 1 << 40).compacts(g, stop));
        }
        // At 32768 groups no chain grows past 3 deltas, whatever maxDeltas says, stop or not.
        let wide = ChainPolicy {
            max_deltas: 64,
            max_delta_share: 400,
        };
        for g in 0..16 {
            assert!(with_deltas(g, 3, 1).compacts(g, wide.for_checkpoint(false, 32768)));
            assert!(with_deltas(g, 3, 1).compacts(g, wide.for_checkpoint(true, 32768)));
            assert!(!with_deltas(g, 2, 1).compacts(g, wide.for_checkpoint(true, 32768)));
        }
    }

    /// Every key-group count's cap keeps a manifest within the block budget, and lets the
    /// longest chains `maxDeltas` allows through wherever they fit.
    #[test]
    fn the_chain_cap_keeps_every_manifest_within_its_block_budget() {
        for g in 1..=keyshift_core::keygroup::UPPER_BOUND_MAX_PARALLELISM {
            let cap = ChainPolicy::deltas_cap(g);
            assert!(cap >= 1);
            assert!(
                (cap + 1) * g as usize <= MANIFEST_BLOCK_BUDGET,
                "{g} groups with chains of {cap}"
            );
            // As long as fits: maxDeltas' own bound, or one more would not fit.
            assert!(
                cap == *MAX_DELTAS_BOUNDS.end() as usize
                    || (cap + 2) * g as usize > MANIFEST_BLOCK_BUDGET,
                "{g}: {cap}"
            );
        }
        assert_eq!(ChainPolicy::deltas_cap(128), 64);
        assert_eq!(ChainPolicy::deltas_cap(4096), 31);
        assert_eq!(ChainPolicy::deltas_cap(32768), 3);
    }

    use crate::snapshot::Crc32c;

    fn entry(group: u32, file: &str, length: u64, deltas: usize) -> GroupEntry {
        GroupEntry {
            group,
            file: file.into(),
            offset: 0,
            length,
            checksum: Crc32c(1),
            entries: 1,
            deltas: (0..deltas)
                .map(|_| crate::snapshot::DeltaBlock {
                    file: file.into(),
                    offset: 0,
                    length: 1,
                    checksum: Crc32c(1),
                    entries: 1,
                })
                .collect(),
        }
    }

    fn ack(groups: Vec<GroupEntry>) -> SubtaskSnapshot {
        SubtaskSnapshot {
            subtask: 0,
            parallelism: 1,
            max_parallelism: 4,
            file: FileEntry {
                name: "state-0-of-1.bin".into(),
                size: 10,
                checksum: Crc32c(2),
            },
            groups,
            referenced: vec![],
            operator_state: vec![],
        }
    }

    #[test]
    fn a_base_is_the_newest_committed_checkpoint_written_here() {
        let mut c = Chain::new(ChainSettings::default());
        assert!(c.base_for(Some(0)).is_none());
        c.written(Base::written(
            3,
            1,
            &ack(vec![entry(0, "state-0-of-1.bin", 10, 0)]),
        ));
        // 3 did not commit (the newest committed is 2): no base, and 3 is forgotten.
        assert!(c.base_for(Some(2)).is_none());
        c.written(Base::written(3, 1, &ack(vec![])));
        c.written(Base::written(
            4,
            2,
            &ack(vec![entry(0, "state-0-of-1.bin", 10, 0)]),
        ));
        let b = c.base_for(Some(4)).unwrap();
        assert_eq!((b.id, b.cut), (4, 2));
        let b = b.clone();
        assert_eq!(b.groups[&0].file, "checkpoints/chk-4/state-0-of-1.bin");
        assert!(b.files.contains_key("checkpoints/chk-4/state-0-of-1.bin"));
        // Still the newest committed: still the base.
        assert_eq!(c.base_for(Some(4)).unwrap().id, 4);
        // A checkpoint built on it (7) did not commit: no base, a full one next.
        c.written(Base::written(7, 3, &ack(vec![])));
        assert!(c.base_for(Some(4)).is_none());
        c.restored_from(b);
        // A savepoint (5) committed since: no base (it would have to be the newest).
        assert!(c.base_for(Some(5)).is_none());
        assert!(c.base_for(Some(4)).is_none(), "forgotten");
        // Off: never a base.
        let mut off = Chain::new(ChainSettings {
            enabled: false,
            ..ChainSettings::default()
        });
        off.written(Base::written(1, 1, &ack(vec![])));
        assert!(off.base_for(Some(1)).is_none());
        // An old coordinator that does not say what committed: no base.
        c.written(Base::written(6, 3, &ack(vec![])));
        assert!(c.base_for(None).is_none());
    }

    #[test]
    fn groups_are_written_in_full_when_they_lost_keys_and_compacted_when_their_chain_is_long() {
        let config = AggConfig {
            function: AggregateFunction::Count,
            window_size_ms: None,
            max_parallelism: 4,
            state_payload_bytes: 0,
        };
        let range = KeyGroupRange { start: 0, end: 3 };
        let mut agg = crate::job::KeyedAggregator::new(config, range).unwrap();
        let key = (0..100)
            .map(RecordKey::long)
            .find(|k| k.key_group(4) == 1)
            .unwrap();
        let cut = agg.cut();
        agg.process(&Record {
            key,
            value: 1,
            ts: 0,
        })
        .unwrap();
        let base = Base {
            id: 1,
            cut,
            groups: [
                (0, entry(0, "f", 100, 0)),
                (1, entry(1, "f", 100, 0)),
                (2, entry(2, "f", 0, 0)),
            ]
            .into(),
            files: BTreeMap::new(),
        };
        let p = ChainPolicy::default().for_checkpoint(false, 4);
        assert_eq!(base.mode(&agg, 0), GroupMode::Unchanged);
        assert_eq!(base.mode(&agg, 1), GroupMode::Delta { since: cut });
        assert_eq!(base.mode(&agg, 2), GroupMode::Full, "empty first block");
        assert_eq!(base.mode(&agg, 3), GroupMode::Full, "not in the base");
        assert!(!base.compacts(1, p));
        let mut long = base.clone();
        // The default limit is 32 deltas, staggered by group: 31 for group 1, 32 for group 0.
        // (With 1% of the keys changed per checkpoint, a checkpoint then writes ~4.5% of the
        // state on average, compaction included: docs/benchmarks.md.)
        long.groups.insert(1, entry(1, "f", 100, 30));
        assert!(!long.compacts(1, p), "group 1 compacts at 31 deltas");
        long.groups.insert(1, entry(1, "f", 100, 31));
        assert!(long.compacts(1, p));
        long.groups.insert(0, entry(0, "f", 100, 31));
        assert!(!long.compacts(0, p), "group 0 compacts at 32 deltas");
        let mut big = base.clone();
        big.groups.insert(1, entry(1, "f", 10, 5));
        assert!(big.compacts(1, p), "deltas half the block");
        agg.clear_group(0).unwrap();
        assert_eq!(base.mode(&agg, 0), GroupMode::Full, "lost keys");
    }
}
