//! The pre-staged rescale, on the worker's side.
//!
//! A worker of the new run is pre-staged (`POST /v1/prestage`): it loads its key groups from
//! the job's newest completed checkpoint (range reads, every block checked, as any restore)
//! while the old run keeps going. It reads no source, emits nothing and connects to no peer.
//! The old run then stops with an incremental checkpoint, which writes only what changed since
//! (its manifest refers to the blocks it did not rewrite). The new worker's `/v1/start` names
//! that checkpoint: the worker reads only the blocks of it that it did not load already
//! ([`plan`]), applies them over its state ([`apply`]) and runs from the checkpoint's source
//! positions. The stop checkpoint is an ordinary checkpoint of the job: a normal restore reads
//! it whole, and retention keeps every file it refers to.
//!
//! [`plan`] is pure: per key group it compares the chain of blocks the new worker loaded with
//! the chain the stop checkpoint names (file names taken relative to the job directory):
//! * the same chain: nothing to read;
//! * the loaded chain followed by more deltas: read those deltas and apply them over the group;
//! * any other chain (the group was written whole, or compacted, since): read it whole and
//!   replace the group.

use super::restore::{Progress, RestoreError};
use crate::job::{Keyed, KeyedAggregator, ProgramStep};
use crate::snapshot::{self, DeltaBlock, GroupEntry, Manifest, ObjectStore, Path};
use keyshift_core::keygroup::KeyGroupRange;

/// When a pre-stage's catch-up ends. After the first load, the old job takes an incremental
/// checkpoint and the new workers read only its delta (a round), so that the delta its stop
/// writes (inside the pause) covers only the last round's time. A round takes a fixed time
/// (the checkpoint's barrier and commit, the requests) plus a time in proportion to the changes
/// of the round before: under a load that changes much of the state the rounds get shorter only
/// slowly, so a fixed number of rounds leaves the stop a delta that grows with the load (and a
/// steady load of a share of the keys grows with the state). The catch-up therefore goes on
/// while the rounds still get shorter, and ends
/// * once a round took less than [`CatchUp::short_round`] (its delta is small enough),
/// * once a round took more than [`CatchUp::shrink_percent`] of the one before (the rounds
///   stopped getting shorter: one more would not shorten the stop's delta),
/// * after [`CatchUp::max_rounds`] rounds.
///
/// One policy for every orchestrator (`keyshift local`, the operator). Pure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CatchUp {
    /// Catch-up rounds at most. Each adds a delta to the chains of the job's checkpoints (a
    /// stop checkpoint does not compact, see [`crate::runtime::incremental`]).
    pub max_rounds: u32,
    /// A round (or first load) shorter than this ends the catch-up.
    pub short_round: std::time::Duration,
    /// A catch-up round that took more than this percentage of the round before it (of the
    /// first load, for the first round) ends the catch-up. None: only
    /// [`CatchUp::short_round`] and [`CatchUp::max_rounds`] end it.
    pub shrink_percent: Option<u32>,
}

impl Default for CatchUp {
    fn default() -> Self {
        CatchUp {
            max_rounds: 8,
            short_round: std::time::Duration::from_millis(150),
            shrink_percent: Some(90),
        }
    }
}

impl CatchUp {
    /// Whether another round follows, after `done` catch-up rounds, the last of which (or the
    /// first load) took `last`, by [`CatchUp::max_rounds`] and [`CatchUp::short_round`] only
    /// (it does not know the round before: [`CatchUp::again_after`] does).
    pub fn again(&self, done: u32, last: std::time::Duration) -> bool {
        done < self.max_rounds && last >= self.short_round
    }

    /// Whether another round follows, given how long the first load and every catch-up round
    /// since took, in order (`rounds[0]` is the first load; `rounds.len() - 1` catch-up rounds
    /// are done). None at all: the first load is yet to come, so a round follows.
    pub fn again_after(&self, rounds: &[std::time::Duration]) -> bool {
        let (Some(&last), done) = (rounds.last(), rounds.len().saturating_sub(1)) else {
            return true;
        };
        let done = u32::try_from(done).unwrap_or(u32::MAX);
        if !self.again(done, last) {
            return false;
        }
        match (rounds.len().checked_sub(2), self.shrink_percent) {
            (Some(i), Some(percent)) => {
                last.as_nanos() * 100 <= rounds[i].as_nanos() * u128::from(percent)
            }
            _ => true,
        }
    }
}

/// What one key group needs from the stop checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupApply {
    /// The key group.
    pub group: u32,
    /// Whether the group's state is replaced (read from nothing) rather than added to.
    pub replace: bool,
    /// The blocks to apply in order (file names relative to the job directory); none with
    /// `replace`: the group is empty.
    pub blocks: Vec<DeltaBlock>,
}

/// What a pre-staged worker reads of the stop checkpoint ([`plan`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeltaPlan {
    /// The groups that changed, in group order (unchanged ones are left out).
    pub groups: Vec<GroupApply>,
    /// Bytes to read in all.
    pub bytes: u64,
    /// Groups whose chain is not the loaded one plus deltas (read whole).
    pub replaced: u32,
}

/// A group entry of snapshot `kind`/`id` with its file names relative to the job directory.
fn job_relative(m: &Manifest, g: &GroupEntry) -> GroupEntry {
    let mut g = g.clone();
    g.file = snapshot::referenced_file_name(m.kind, m.snapshot_id, &g.file);
    for d in &mut g.deltas {
        d.file = snapshot::referenced_file_name(m.kind, m.snapshot_id, &d.file);
    }
    g
}

/// What a worker of key groups `range` that loaded `loaded` (a checkpoint of the job) reads of
/// `target` (a later snapshot of the same job) to hold `target`'s state. Pure.
pub fn plan(loaded: &Manifest, target: &Manifest, range: KeyGroupRange) -> DeltaPlan {
    let mut out = DeltaPlan::default();
    for group in range.iter() {
        let to = target.group(group).map(|g| job_relative(target, g));
        let from = loaded.group(group).map(|g| job_relative(loaded, g));
        let apply = match (from, to) {
            (Some(f), Some(t)) if f == t => continue,
            (from, None) => {
                if from.is_some_and(|f| f.stored_bytes() == 0) {
                    continue;
                }
                GroupApply {
                    group,
                    replace: true,
                    blocks: Vec::new(),
                }
            }
            (Some(f), Some(t))
                if (&f.file, f.offset, f.length, f.checksum)
                    == (&t.file, t.offset, t.length, t.checksum)
                    && t.deltas.starts_with(&f.deltas) =>
            {
                GroupApply {
                    group,
                    replace: false,
                    blocks: t.deltas[f.deltas.len()..].to_vec(),
                }
            }
            (_, Some(t)) => {
                let first = (t.length > 0).then(|| DeltaBlock {
                    file: t.file.clone(),
                    offset: t.offset,
                    length: t.length,
                    checksum: t.checksum,
                    entries: t.entries,
                });
                GroupApply {
                    group,
                    replace: true,
                    blocks: first.into_iter().chain(t.deltas).collect(),
                }
            }
        };
        out.bytes += apply.blocks.iter().map(|b| b.length).sum::<u64>();
        out.replaced += u32::from(apply.replace);
        out.groups.push(apply);
    }
    out
}

/// What [`apply`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    /// Groups changed.
    pub groups: u32,
    /// Bytes read.
    pub bytes_read: u64,
}

/// Bytes of blocks [`apply`] reads and decodes at a time: a large delta (the first catch-up
/// round's, after a long first load) is not held whole beside the state it is applied to.
pub const APPLY_BATCH_BYTES: u64 = 16 << 20;

/// `plan`'s groups in batches of consecutive groups whose blocks add up to at most `budget`
/// bytes (a group larger than that alone). Pure.
pub fn batches(plan: &DeltaPlan, budget: u64) -> Vec<&[GroupApply]> {
    let mut out = Vec::new();
    let (mut from, mut bytes) = (0, 0u64);
    for (i, g) in plan.groups.iter().enumerate() {
        let b: u64 = g.blocks.iter().map(|b| b.length).sum();
        if i > from && bytes + b > budget {
            out.push(&plan.groups[from..i]);
            (from, bytes) = (i, 0);
        }
        bytes += b;
    }
    if from < plan.groups.len() {
        out.push(&plan.groups[from..]);
    }
    out
}

/// Reads the blocks of `plan` from the snapshot in `dir` (the stop checkpoint; file names are
/// resolved against its job directory), checking each block's length and checksum, and applies
/// them to `agg`, [`APPLY_BATCH_BYTES`] of blocks at a time (each batch read and checked
/// whole before any of it is applied). On an error `agg` may hold groups applied or half
/// applied: the caller drops it (the worker fails its start and is started afresh).
pub async fn apply(
    keyed: &mut Keyed,
    store: &dyn ObjectStore,
    dir: &Path,
    plan: &DeltaPlan,
    progress: Option<&Progress>,
) -> Result<Applied, RestoreError> {
    let mut bytes_read = 0;
    for batch in batches(plan, APPLY_BATCH_BYTES) {
        bytes_read += match keyed {
            Keyed::Aggregate(agg) => apply_batch(agg, store, dir, batch, progress).await?,
            Keyed::Program(step) => apply_program_batch(step, store, dir, batch, progress).await?,
        };
    }
    Ok(Applied {
        groups: plan.groups.len() as u32,
        bytes_read,
    })
}

/// The blocks of `groups` as [`fetch_deltas`](snapshot::fetch_deltas) reads them, by group.
async fn fetch_batch(
    store: &dyn ObjectStore,
    dir: &Path,
    groups: &[GroupApply],
    progress: Option<&Progress>,
) -> Result<(u64, std::collections::BTreeMap<u32, Vec<bytes::Bytes>>), RestoreError> {
    let entries: Vec<GroupEntry> = groups
        .iter()
        .map(|g| GroupEntry {
            group: g.group,
            file: String::new(),
            offset: 0,
            length: 0,
            checksum: snapshot::Crc32c(0),
            entries: 0,
            deltas: g.blocks.clone(),
        })
        .collect();
    let (bytes_read, blocks) = snapshot::fetch_deltas(store, dir, &entries).await?;
    if let Some(p) = progress {
        p.add(bytes_read, groups.len() as u32);
    }
    Ok((bytes_read, blocks))
}

/// A program's groups of one batch: each group's blocks applied over what its step holds (or
/// replacing it).
async fn apply_program_batch(
    step: &mut ProgramStep,
    store: &dyn ObjectStore,
    dir: &Path,
    groups: &[GroupApply],
    progress: Option<&Progress>,
) -> Result<u64, RestoreError> {
    let (bytes_read, mut blocks) = fetch_batch(store, dir, groups, progress).await?;
    for g in groups {
        let blocks = blocks.remove(&g.group).unwrap_or_default();
        let chain: Vec<&[u8]> = blocks.iter().map(|b| b.as_ref()).collect();
        if g.replace && chain.is_empty() {
            step.clear_group(g.group)?;
        } else {
            step.apply_blocks(g.group, &chain, g.replace)?;
        }
    }
    Ok(bytes_read)
}

async fn apply_batch(
    agg: &mut KeyedAggregator,
    store: &dyn ObjectStore,
    dir: &Path,
    groups: &[GroupApply],
    progress: Option<&Progress>,
) -> Result<u64, RestoreError> {
    let (bytes_read, mut blocks) = fetch_batch(store, dir, groups, progress).await?;
    let mut work = Vec::with_capacity(groups.len());
    for g in groups {
        // A replaced group is read again from nothing; it counts as restored (unchanged since
        // the snapshot), like any restored group.
        let mut state = agg.take_group(g.group)?;
        if g.replace {
            state.clear();
        }
        work.push((state, blocks.remove(&g.group).unwrap_or_default()));
    }
    let decoder = agg.decoder();
    let decoded = tokio::task::spawn_blocking(move || {
        work.into_iter()
            .map(|(state, deltas)| decoder.decode_onto(state, &deltas))
            .collect::<Result<Vec<_>, _>>()
    })
    .await
    .map_err(|e| RestoreError::Decoder(e.to_string()))??;
    for state in decoded {
        agg.install_group(state)?;
    }
    Ok(bytes_read)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn catch_up_goes_on_while_rounds_are_long_and_stops_after_its_rounds() {
        use std::time::Duration;
        let c = CatchUp {
            max_rounds: 3,
            short_round: Duration::from_millis(300),
            shrink_percent: Some(90),
        };
        assert!(c.again(0, Duration::from_secs(2)));
        assert!(c.again(2, Duration::from_millis(300)));
        assert!(!c.again(3, Duration::from_secs(2)), "at most max_rounds");
        assert!(
            !c.again(0, Duration::from_millis(299)),
            "a short round ends it"
        );
        let every = CatchUp {
            short_round: Duration::ZERO,
            ..c
        };
        assert!(every.again(0, Duration::ZERO));
    }

    #[test]
    fn catch_up_goes_on_while_the_rounds_get_shorter() {
        use std::time::Duration;
        let ms = |v: &[u64]| {
            v.iter()
                .map(|m| Duration::from_millis(*m))
                .collect::<Vec<_>>()
        };
        let c = CatchUp::default();
        assert!(c.again_after(&[]), "the first load is to come");
        assert!(c.again_after(&ms(&[15_000])), "a long first load");
        assert!(!c.again_after(&ms(&[100])), "a short first load ends it");
        // Rounds converging towards a fixed time: on while each is at most 90% of the one
        // before.
        assert!(c.again_after(&ms(&[15_000, 4_000, 1_500, 800])));
        assert!(
            c.again_after(&ms(&[15_000, 4_000, 1_000, 900])),
            "exactly 90%"
        );
        assert!(
            !c.again_after(&ms(&[15_000, 4_000, 1_000, 901])),
            "no longer shorter enough: another round would not shorten the stop's delta"
        );
        assert!(
            !c.again_after(&ms(&[15_000, 4_000, 5_000])),
            "a round longer than the one before"
        );
        // Short enough ends it, however the rounds went.
        assert!(!c.again_after(&ms(&[15_000, 149])));
        // At most max_rounds.
        let many: Vec<u64> = (0..=c.max_rounds).map(|i| 60_000 >> i).collect();
        assert!(c.again_after(&ms(&many[..many.len() - 1])));
        assert!(!c.again_after(&ms(&many)), "max_rounds rounds done");
        // Without the shrink rule: every round up to max_rounds, as long as none is short.
        let every = CatchUp {
            short_round: Duration::ZERO,
            shrink_percent: None,
            max_rounds: 3,
        };
        assert!(every.again_after(&ms(&[10, 20, 40])));
        assert!(!every.again_after(&ms(&[10, 20, 40, 80])));
        // `again` is the same rule without the round before.
        for rounds in [ms(&[15_000, 4_000]), ms(&[300, 299]), ms(&[1, 2, 3, 4])] {
            let done = rounds.len() as u32 - 1;
            let last = *rounds.last().unwrap();
            if c.again_after(&rounds) {
                assert!(c.again(done, last));
            }
        }
    }
    use crate::snapshot::{Crc32c, SnapshotKind};

    fn block(file: &str, offset: u64, length: u64, crc: u32) -> DeltaBlock {
        DeltaBlock {
            file: file.into(),
            offset,
            length,
            checksum: Crc32c(crc),
            entries: 1,
        }
    }

    fn entry(group: u32, first: DeltaBlock, deltas: Vec<DeltaBlock>) -> GroupEntry {
        GroupEntry {
            group,
            file: first.file,
            offset: first.offset,
            length: first.length,
            checksum: first.checksum,
            entries: first.entries,
            deltas,
        }
    }

    fn manifest(id: u64, groups: Vec<GroupEntry>) -> Manifest {
        Manifest {
            format_version: snapshot::FORMAT_VERSION,
            job: snapshot::JobIdentity {
                namespace: "ns".into(),
                name: "j".into(),
                job_fingerprint: "f".into(),
                layout: None,
            },
            snapshot_id: id,
            kind: SnapshotKind::Checkpoint,
            completed_at: jiff::Timestamp::now(),
            max_parallelism: 4,
            parallelism: 1,
            state_schema: "s".into(),
            checksum_algorithm: snapshot::CHECKSUM_ALGORITHM.into(),
            source_positions: Default::default(),
            source_partitions: Default::default(),
            watermark: None,
            stats: Default::default(),
            files: vec![],
            key_groups: groups,
            operator_state: Vec::new(),
        }
    }

    #[test]
    fn only_what_the_loaded_checkpoint_lacks_is_read() {
        let f5 = "state-0-of-1.bin";
        let ref5 = |o| block("checkpoints/chk-5/state-0-of-1.bin", o, 10, o as u32);
        // Checkpoint 5, loaded: groups 0..3 whole in its own file, group 3 empty.
        let loaded = manifest(
            5,
            vec![
                entry(0, block(f5, 0, 10, 0), vec![]),
                entry(1, block(f5, 10, 10, 10), vec![]),
                entry(2, block(f5, 20, 10, 20), vec![]),
                entry(3, block(f5, 30, 0, 30), vec![]),
            ],
        );
        // The stop checkpoint 6: group 0 unchanged, group 1 one delta more, group 2 written
        // whole again, group 3 gained keys (whole).
        let target = manifest(
            6,
            vec![
                entry(0, ref5(0), vec![]),
                entry(1, ref5(10), vec![block("state-0-of-2.bin", 0, 3, 7)]),
                entry(2, block("state-0-of-2.bin", 3, 12, 8), vec![]),
                entry(3, block("state-0-of-2.bin", 15, 4, 9), vec![]),
            ],
        );
        let p = plan(&loaded, &target, KeyGroupRange { start: 0, end: 3 });
        let own6 = |o, l, c| block("checkpoints/chk-6/state-0-of-2.bin", o, l, c);
        assert_eq!(
            p.groups,
            vec![
                GroupApply {
                    group: 1,
                    replace: false,
                    blocks: vec![own6(0, 3, 7)]
                },
                GroupApply {
                    group: 2,
                    replace: true,
                    blocks: vec![own6(3, 12, 8)]
                },
                GroupApply {
                    group: 3,
                    replace: true,
                    blocks: vec![own6(15, 4, 9)]
                },
            ]
        );
        assert_eq!((p.bytes, p.replaced), (19, 2));
        // Only the worker's own groups.
        let p = plan(&loaded, &target, KeyGroupRange { start: 0, end: 1 });
        assert_eq!(p.groups.len(), 1);
        // The same snapshot: nothing.
        assert_eq!(
            plan(&loaded, &loaded, KeyGroupRange { start: 0, end: 3 }),
            DeltaPlan::default()
        );
        // A chain that dropped a delta the loaded one had (compacted): whole.
        let with_delta = manifest(
            7,
            vec![entry(
                0,
                block(f5, 0, 10, 0),
                vec![block("state-0-of-3.bin", 0, 2, 1)],
            )],
        );
        let compacted = manifest(8, vec![entry(0, ref5(0), vec![])]);
        let p = plan(&with_delta, &compacted, KeyGroupRange { start: 0, end: 0 });
        assert_eq!(p.replaced, 1);
        assert_eq!(p.groups[0].blocks, vec![ref5(0)]);
    }

    #[test]
    fn a_plan_is_applied_in_batches_of_a_byte_budget() {
        let g = |group: u32, lengths: &[u64]| GroupApply {
            group,
            replace: false,
            blocks: lengths.iter().map(|l| block("f", 0, *l, 0)).collect(),
        };
        let plan = DeltaPlan {
            groups: vec![
                g(0, &[4, 4]),
                g(1, &[3]),
                g(2, &[20]),
                g(3, &[]),
                g(4, &[1]),
            ],
            bytes: 32,
            replaced: 0,
        };
        let groups = |b: Vec<&[GroupApply]>| -> Vec<Vec<u32>> {
            b.iter()
                .map(|s| s.iter().map(|g| g.group).collect())
                .collect()
        };
        // 8 + 3 fit 11; 20 is alone (over the budget); the empty group and 1 follow it.
        assert_eq!(
            groups(batches(&plan, 11)),
            vec![vec![0, 1], vec![2], vec![3, 4]]
        );
        assert_eq!(
            groups(batches(&plan, 10)),
            vec![vec![0], vec![1], vec![2], vec![3, 4]]
        );
        assert_eq!(groups(batches(&plan, u64::MAX)), vec![vec![0, 1, 2, 3, 4]]);
        // Every group once, in order, whatever the budget.
        for budget in 0..40 {
            let all: Vec<u32> = groups(batches(&plan, budget)).concat();
            assert_eq!(all, vec![0, 1, 2, 3, 4]);
        }
        assert!(batches(&DeltaPlan::default(), 5).is_empty());
    }

    #[test]
    fn a_delta_of_held_keys_is_not_kept_in_memory_once_applied() {
        use crate::job::{AggConfig, Record, RecordKey};
        use bytes::Bytes;
        use keyshift_core::spec::AggregateFunction;
        let config = AggConfig {
            function: AggregateFunction::Count,
            window_size_ms: None,
            max_parallelism: 4,
            state_payload_bytes: 64,
        };
        let range = KeyGroupRange { start: 0, end: 3 };
        let keys: Vec<RecordKey> = (0..1000)
            .map(RecordKey::long)
            .filter(|k| k.key_group(4) == 1)
            .take(3)
            .collect();
        let record = |k: &RecordKey| Record {
            key: k.clone(),
            value: 1,
            ts: 0,
        };
        let mut old = KeyedAggregator::new(config, range).unwrap();
        for k in &keys[..2] {
            old.process(&record(k)).unwrap();
        }
        let base = Bytes::from(old.encode_group(1).unwrap().0);
        // A delta of a held key (its payload the same bytes), then one with a new key too.
        let mut changed = KeyedAggregator::new(config, range).unwrap();
        changed.process(&record(&keys[0])).unwrap();
        let held = Bytes::from(changed.encode_group(1).unwrap().0);
        changed.process(&record(&keys[2])).unwrap();
        let with_new = Bytes::from(changed.encode_group(1).unwrap().0);
        let mut new = KeyedAggregator::new(config, range).unwrap();
        let decoder = new.decoder();
        new.install_group(decoder.decode(1, &base).unwrap())
            .unwrap();
        let state = new.take_group(1).unwrap();
        let state = decoder
            .decode_onto(state, std::slice::from_ref(&held))
            .unwrap();
        new.install_group(state).unwrap();
        assert!(
            held.is_unique(),
            "no key refers into a delta of held keys with the same payloads"
        );
        assert_eq!(new.group_key_count(1), 2);
        let state = new.take_group(1).unwrap();
        let state = decoder
            .decode_onto(state, std::slice::from_ref(&with_new))
            .unwrap();
        new.install_group(state).unwrap();
        assert_eq!(new.group_key_count(1), 3);
        assert!(
            !with_new.is_unique(),
            "a new key's payload is a slice of it"
        );
        let payloads: Vec<_> = new
            .group_entries(1)
            .into_iter()
            .map(|(k, v)| (k, v.payload))
            .collect();
        let mut want = KeyedAggregator::new(config, range).unwrap();
        for k in &keys {
            want.process(&record(k)).unwrap();
        }
        let mut want: Vec<_> = want
            .group_entries(1)
            .into_iter()
            .map(|(k, v)| (k, v.payload))
            .collect();
        let mut payloads = payloads;
        payloads.sort_by_key(|(k, _)| keys.iter().position(|x| x == k));
        want.sort_by_key(|(k, _)| keys.iter().position(|x| x == k));
        assert_eq!(payloads, want);
    }

    #[test]
    fn a_delta_applied_over_a_group_replaces_its_keys_and_the_group_counts_as_restored() {
        use crate::job::{AccValue, AggConfig, GroupMode, Record, RecordKey};
        use bytes::Bytes;
        use keyshift_core::spec::AggregateFunction;
        let config = AggConfig {
            function: AggregateFunction::Count,
            window_size_ms: None,
            max_parallelism: 4,
            state_payload_bytes: 0,
        };
        let range = KeyGroupRange { start: 0, end: 3 };
        let keys: Vec<RecordKey> = (0..1000)
            .map(RecordKey::long)
            .filter(|k| k.key_group(4) == 1)
            .take(3)
            .collect();
        let record = |k: &RecordKey| Record {
            key: k.clone(),
            value: 1,
            ts: 0,
        };
        // The loaded checkpoint: three keys counted once.
        let mut old = KeyedAggregator::new(config, range).unwrap();
        for k in &keys {
            old.process(&record(k)).unwrap();
        }
        let (base, _) = old.encode_group(1).unwrap();
        // A delta: the first key, counted three times.
        let mut changed = KeyedAggregator::new(config, range).unwrap();
        for _ in 0..3 {
            changed.process(&record(&keys[0])).unwrap();
        }
        let (delta, _) = changed.encode_group(1).unwrap();
        let counts = |agg: &KeyedAggregator| -> Vec<(RecordKey, AccValue)> {
            let mut v: Vec<_> = agg
                .group_entries(1)
                .into_iter()
                .map(|(k, s)| (k, s.acc))
                .collect();
            v.sort_by_key(|(k, _)| keys.iter().position(|x| x == k));
            v
        };
        let mut new = KeyedAggregator::new(config, range).unwrap();
        new.restore_group(1, &base).unwrap();
        let decoder = new.decoder();
        let state = new.take_group(1).unwrap();
        assert_eq!(new.group_key_count(1), 0);
        let state = decoder
            .decode_onto(state, &[Bytes::from(delta.clone())])
            .unwrap();
        new.install_group(state).unwrap();
        assert_eq!(
            counts(&new),
            vec![
                (keys[0].clone(), AccValue::Scalar(3)),
                (keys[1].clone(), AccValue::Scalar(1)),
                (keys[2].clone(), AccValue::Scalar(1)),
            ]
        );
        // Applied state is restored state: a checkpoint building on the snapshot skips it.
        assert_eq!(new.group_mode(1, 0), GroupMode::Unchanged);
        // Replaced: read again from nothing.
        let mut state = new.take_group(1).unwrap();
        state.clear();
        let state = decoder.decode_onto(state, &[Bytes::from(delta)]).unwrap();
        new.install_group(state).unwrap();
        assert_eq!(counts(&new), vec![(keys[0].clone(), AccValue::Scalar(3))]);
        assert_eq!(new.group_mode(1, 0), GroupMode::Unchanged);
    }
}
