//! `keyshift savepoint inspect`: what a snapshot holds and how its state is distributed.
//!
//! Everything the manifest says (ids, parallelism, per-subtask ranges, source positions,
//! watermark), plus a pass over every block: keys and bytes per key group, the largest groups, the
//! largest single keys by state bytes, and — for `count` and `sum` jobs — the keys with the
//! largest aggregate, so the hot key of a skewed job stands out. Blocks are streamed; memory holds
//! one number pair per group and the top-N lists.

use super::blocks::{self, Block, Shape, WINDOW_BYTES};
use super::error::{Result, ToolError};
use super::location::SnapshotLocation;
use crate::job::state_codec::{self, AccValue, StateValue};
use crate::job::{KeyRef, RecordKey};
use crate::snapshot::{JobIdentity, Manifest, SnapshotKind, read_manifest};
use jiff::Timestamp;
use keyshift_core::keygroup::{Key, KeyGroupRange, KeyType};
use keyshift_core::spec::AggregateFunction;
use serde::Serialize;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::sync::Arc;

/// One subtask's share of the snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SubtaskShare {
    /// Subtask index.
    pub index: u32,
    /// Its key groups (inclusive).
    pub key_groups: [u32; 2],
    /// Its state file.
    pub file: String,
    /// State bytes.
    pub bytes: u64,
    /// Keys.
    pub keys: u64,
}

/// One key group's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupSize {
    /// The key group.
    pub key_group: u32,
    /// Keys in it.
    pub keys: u64,
    /// Its block's bytes.
    pub bytes: u64,
}

/// One key and its state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct KeyStat {
    /// The key, typed as stored.
    pub key: Key,
    /// `string`, `long` or `int`.
    pub key_type: KeyType,
    /// Its key group.
    pub key_group: u32,
    /// Bytes of its entry in the block (key, accumulators, payload).
    pub bytes: u64,
    /// Its aggregate: the value, or for a windowed job the sum (count, sum) or extreme (min,
    /// max) over its open windows; absent for a windowed key without open windows.
    pub value: Option<i64>,
    /// Open windows (windowed jobs).
    pub windows: usize,
}

/// Spread of a per-group quantity.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Spread {
    /// Smallest.
    pub min: u64,
    /// Median.
    pub median: u64,
    /// Mean.
    pub mean: f64,
    /// Largest.
    pub max: u64,
    /// Largest over mean (1.0 = perfectly even; 0 when all are 0).
    pub max_over_mean: f64,
}

impl Spread {
    fn of(values: &mut [u64]) -> Spread {
        if values.is_empty() {
            return Spread {
                min: 0,
                median: 0,
                mean: 0.0,
                max: 0,
                max_over_mean: 0.0,
            };
        }
        values.sort_unstable();
        let mean = values.iter().sum::<u64>() as f64 / values.len() as f64;
        let max = values[values.len() - 1];
        Spread {
            min: values[0],
            median: values[values.len() / 2],
            mean,
            max,
            max_over_mean: if mean > 0.0 { max as f64 / mean } else { 0.0 },
        }
    }
}

/// One operator state of a program's snapshot, as `inspect` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct OperatorStateSummary {
    /// The state's declared name.
    pub name: String,
    /// `operator list` or `broadcast`.
    pub kind: String,
    /// `split`, `union`, `broadcast`, or `none` (a rescale is refused).
    pub redistribution: String,
    /// Its entries on each subtask of the run that wrote it, in subtask order.
    pub entries: Vec<u64>,
    /// Bytes of its entries, over every subtask.
    pub bytes: u64,
}

/// Everything `inspect` reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InspectReport {
    /// The snapshot URL.
    pub url: String,
    /// The job it belongs to.
    pub job: JobIdentity,
    /// Checkpoint or savepoint.
    pub kind: SnapshotKind,
    /// The snapshot id.
    pub snapshot_id: u64,
    /// When it was completed.
    pub completed_at: Timestamp,
    /// The key-group count.
    pub max_parallelism: u32,
    /// The parallelism it was taken at.
    pub parallelism: u32,
    /// The state schema.
    pub state_schema: String,
    /// The aggregate function, from the blocks (absent when there is no state).
    pub function: Option<AggregateFunction>,
    /// The tumbling window size, if windowed.
    pub window_size_ms: Option<i64>,
    /// Per source partition, the position to resume from.
    pub source_positions: BTreeMap<u32, u64>,
    /// Per source partition, its name (file sources: the file name relative to the source
    /// directory; absent for the generator and older manifests, whose partitions are indexes).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub source_partitions: BTreeMap<u32, String>,
    /// The watermark (epoch ms).
    pub watermark: Option<i64>,
    /// Total state bytes.
    pub total_bytes: u64,
    /// Total keys.
    pub total_keys: u64,
    /// Groups holding state.
    pub non_empty_groups: u32,
    /// Free-form manifest stats (e.g. `rewrittenFrom`).
    pub notes: BTreeMap<String, serde_json::Value>,
    /// Per subtask: range, file, bytes, keys.
    pub subtasks: Vec<SubtaskShare>,
    /// Spread of bytes per key group.
    pub group_bytes: Spread,
    /// Spread of keys per key group.
    pub group_keys: Spread,
    /// Every key group's keys and bytes, in group order.
    pub groups: Vec<GroupSize>,
    /// The largest groups by bytes.
    pub largest_groups: Vec<GroupSize>,
    /// The largest keys by state bytes.
    pub largest_keys: Vec<KeyStat>,
    /// The keys with the largest aggregate (count and sum jobs; empty otherwise).
    pub top_keys_by_value: Vec<KeyStat>,
    /// A program's operator states (what its step keeps per subtask), by declared name.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub operator_state: Vec<OperatorStateSummary>,
}

/// The operator states in a snapshot's sections, summed up by name in declaration order.
async fn operator_states(
    loc: &SnapshotLocation,
    manifest: &crate::snapshot::Manifest,
) -> Result<Vec<OperatorStateSummary>> {
    let sections =
        crate::snapshot::read_operator_state(loc.store.as_ref(), &loc.dir, manifest).await?;
    let from = sections.len();
    let mut out: Vec<OperatorStateSummary> = Vec::new();
    for (i, bytes) in sections.iter().enumerate() {
        let section =
            keyshift_sdk::operator_state::OperatorStates::decode(bytes).map_err(|source| {
                ToolError::OperatorState {
                    subtask: i as u32,
                    source,
                }
            })?;
        for (decl, entries) in section.states {
            let at = match out.iter().position(|o| o.name == decl.name) {
                Some(at) => at,
                None => {
                    out.push(OperatorStateSummary {
                        name: decl.name.clone(),
                        kind: decl.kind.to_string(),
                        redistribution: decl
                            .redistribution
                            .map_or_else(|| "none".to_owned(), |r| r.to_string()),
                        entries: vec![0; from],
                        bytes: 0,
                    });
                    out.len() - 1
                }
            };
            out[at].entries[i] = entries.len() as u64;
            out[at].bytes += entries.iter().map(|e| e.len() as u64).sum::<u64>();
        }
    }
    Ok(out)
}

/// Bounded "largest N" collector.
struct TopN<K: Ord> {
    n: usize,
    heap: BinaryHeap<Reverse<(K, u64)>>,
    items: BTreeMap<u64, KeyStat>,
    next: u64,
}

impl<K: Ord + Copy> TopN<K> {
    fn new(n: usize) -> Self {
        TopN {
            n,
            heap: BinaryHeap::new(),
            items: BTreeMap::new(),
            next: 0,
        }
    }

    /// Whether a candidate with this rank would enter.
    fn admits(&self, rank: &K) -> bool {
        self.n > 0
            && (self.heap.len() < self.n
                || self.heap.peek().is_some_and(|Reverse((r, _))| rank > r))
    }

    fn offer(&mut self, rank: K, make: impl FnOnce() -> KeyStat) {
        if !self.admits(&rank) {
            return;
        }
        let id = self.next;
        self.next += 1;
        self.items.insert(id, make());
        self.heap.push(Reverse((rank, id)));
        if self.heap.len() > self.n
            && let Some(Reverse((_, out))) = self.heap.pop()
        {
            self.items.remove(&out);
        }
    }

    fn into_sorted(self) -> Vec<KeyStat> {
        let mut ranked: Vec<(K, u64)> = self.heap.into_iter().map(|Reverse(x)| x).collect();
        ranked.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut items = self.items;
        ranked
            .into_iter()
            .filter_map(|(_, id)| items.remove(&id))
            .collect()
    }
}

/// The encoded size of an entry (see [`crate::job::state_codec`]).
fn entry_len(key: &RecordKey, value: &StateValue) -> u64 {
    fn varint_len(v: u64) -> u64 {
        u64::from((64 - v.leading_zeros()).max(1).div_ceil(7))
    }
    let key_len = match key.view() {
        KeyRef::Long(_) => 9,
        KeyRef::Int(_) => 5,
        KeyRef::Str(s) => 1 + varint_len(s.len() as u64) + s.len() as u64,
    };
    let acc_len = match &value.acc {
        AccValue::Scalar(_) => 8,
        AccValue::Windows(ws) => varint_len(ws.len() as u64) + 16 * ws.len() as u64,
    };
    let p = value.payload.len() as u64;
    key_len + acc_len + varint_len(p) + p
}

/// The one number `inspect` shows for a key's accumulators.
fn aggregate_of(function: AggregateFunction, acc: &AccValue) -> (Option<i64>, usize) {
    match acc {
        AccValue::Scalar(v) => (Some(*v), 0),
        AccValue::Windows(ws) => {
            let values = ws.iter().map(|(_, v)| *v);
            let v = match function {
                AggregateFunction::Count | AggregateFunction::Sum => {
                    values.reduce(i64::wrapping_add)
                }
                AggregateFunction::Min => values.min(),
                AggregateFunction::Max => values.max(),
            };
            (v, ws.len())
        }
    }
}

struct Collector {
    function: Option<AggregateFunction>,
    shape: Option<Shape>,
    groups: Vec<GroupSize>,
    by_bytes: TopN<(u64, i64)>,
    by_value: TopN<(i64, u64)>,
}

impl Collector {
    fn block(&mut self, manifest: &Manifest, b: &Block) -> Result<()> {
        let codec = |source| ToolError::Block {
            file: b.file.to_string(),
            group: b.group,
            source,
        };
        let Some(entry) = manifest.group(b.group) else {
            return Ok(());
        };
        if manifest.state_schema == crate::job::PROGRAM_SCHEMA {
            return self.program_block(manifest, b);
        }
        let header = state_codec::decode_header(&b.bytes).map_err(codec)?;
        blocks::check_header(manifest, entry, &header, &mut self.shape)?;
        let function = header.info.function;
        self.function = Some(function);
        let group = b.group;
        let (by_bytes, by_value) = (&mut self.by_bytes, &mut self.by_value);
        let ranks_value = matches!(function, AggregateFunction::Count | AggregateFunction::Sum);
        state_codec::for_each_entry(&b.bytes, |key, value| {
            let bytes = entry_len(&key, &value);
            let (agg, windows) = aggregate_of(function, &value.acc);
            let stat = || KeyStat {
                key: key.to_key(),
                key_type: key.key_type(),
                key_group: group,
                bytes,
                value: agg,
                windows,
            };
            let v = agg.unwrap_or(i64::MIN);
            if by_bytes.admits(&(bytes, v)) {
                by_bytes.offer((bytes, v), stat);
            }
            if ranks_value && agg.is_some() && by_value.admits(&(v, bytes)) {
                by_value.offer((v, bytes), stat);
            }
            Ok(())
        })
        .map_err(codec)?;
        if let Some(g) = self.groups.get_mut(group as usize) {
            g.keys = header.entries;
            g.bytes = b.bytes.len() as u64;
        }
        Ok(())
    }
}

impl Collector {
    /// A program's block: its keys (each key's entries, timers included, summed: the bytes it
    /// holds), checked as `verify` checks them. A program's state has no one number per key.
    fn program_block(&mut self, manifest: &Manifest, b: &Block) -> Result<()> {
        let sdk = |source| ToolError::ProgramBlock {
            file: b.file.to_string(),
            group: b.group,
            source,
        };
        keyshift_sdk::block::check(&b.bytes, b.group, manifest.max_parallelism).map_err(sdk)?;
        let block = keyshift_sdk::block::decode(&b.bytes).map_err(sdk)?;
        let mut per_key: std::collections::BTreeMap<keyshift_core::keygroup::Key, u64> =
            std::collections::BTreeMap::new();
        for (n, (key, value)) in block.entries.iter().enumerate() {
            let (k, _) = keyshift_sdk::key::decode_key(key).map_err(|source| {
                sdk(keyshift_sdk::BlockError::Key {
                    entry: n as u64,
                    source,
                })
            })?;
            let len = key.len() + value.as_ref().map_or(0, Vec::len);
            *per_key.entry(k).or_default() += len as u64;
        }
        let group = b.group;
        if let Some(g) = self.groups.get_mut(group as usize) {
            g.keys = per_key.len() as u64;
            g.bytes = b.bytes.len() as u64;
        }
        for (key, bytes) in per_key {
            if self.by_bytes.admits(&(bytes, i64::MIN)) {
                self.by_bytes.offer((bytes, i64::MIN), || KeyStat {
                    key,
                    key_type: block.header.key_type,
                    key_group: group,
                    bytes,
                    value: None,
                    windows: 0,
                });
            }
        }
        Ok(())
    }
}

/// Inspects the snapshot at `loc`, listing the `top` largest groups and keys.
pub async fn inspect(loc: &SnapshotLocation, top: usize) -> Result<InspectReport> {
    let manifest = Arc::new(read_manifest(loc.store.as_ref(), &loc.dir).await?);
    let mut c = Collector {
        function: None,
        shape: None,
        groups: (0..manifest.max_parallelism)
            .map(|g| GroupSize {
                key_group: g,
                keys: 0,
                bytes: 0,
            })
            .collect(),
        by_bytes: TopN::new(top),
        by_value: TopN::new(top),
    };
    let windows = blocks::plan_windows(&manifest, 0..manifest.max_parallelism, WINDOW_BYTES);
    let mut rx = blocks::read_windows(
        loc.store.clone(),
        loc.dir.clone(),
        manifest.clone(),
        windows,
    );
    while let Some(fetched) = rx.recv().await {
        let blocks = fetched?;
        let m = manifest.clone();
        let (back, result) = blocks::blocking(move || {
            let r = blocks.iter().try_for_each(|b| c.block(&m, b));
            (c, r)
        })
        .await?;
        c = back;
        result?;
    }

    let assignment = manifest.assignment()?;
    let subtasks = assignment
        .ranges()
        .into_iter()
        .enumerate()
        .map(|(i, r)| SubtaskShare {
            index: i as u32,
            key_groups: [r.start, r.end],
            file: manifest
                .group(r.start)
                .map(|g| g.file.clone())
                .unwrap_or_default(),
            bytes: range_sum(&c.groups, r, |g| g.bytes),
            keys: range_sum(&c.groups, r, |g| g.keys),
        })
        .collect();
    let mut largest_groups: Vec<GroupSize> =
        c.groups.iter().copied().filter(|g| g.bytes > 0).collect();
    largest_groups.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.key_group.cmp(&b.key_group)));
    largest_groups.truncate(top);
    let mut bytes: Vec<u64> = c.groups.iter().map(|g| g.bytes).collect();
    let mut keys: Vec<u64> = c.groups.iter().map(|g| g.keys).collect();
    Ok(InspectReport {
        url: loc.url.clone(),
        job: manifest.job.clone(),
        kind: manifest.kind,
        snapshot_id: manifest.snapshot_id,
        completed_at: manifest.completed_at,
        max_parallelism: manifest.max_parallelism,
        parallelism: manifest.parallelism,
        state_schema: manifest.state_schema.clone(),
        function: c.function,
        window_size_ms: c.shape.and_then(|s| s.window_size_ms),
        source_positions: manifest.source_positions.clone(),
        source_partitions: manifest.source_partitions.clone(),
        watermark: manifest.watermark,
        total_bytes: manifest.stats.total_bytes,
        total_keys: manifest.stats.total_keys,
        non_empty_groups: manifest.stats.non_empty_groups,
        notes: manifest.stats.extra.clone(),
        subtasks,
        group_bytes: Spread::of(&mut bytes),
        group_keys: Spread::of(&mut keys),
        groups: c.groups,
        largest_groups,
        largest_keys: c.by_bytes.into_sorted(),
        top_keys_by_value: c.by_value.into_sorted(),
        operator_state: operator_states(loc, &manifest).await?,
    })
}

fn range_sum(groups: &[GroupSize], r: KeyGroupRange, f: impl Fn(&GroupSize) -> u64) -> u64 {
    groups
        .get(r.start as usize..=r.end as usize)
        .map_or(0, |gs| gs.iter().map(f).sum())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::state_codec::{BlockInfo, encode_entries};

    #[test]
    fn entry_len_matches_the_encoding() {
        let entries = [
            (
                Key::String("key-1".into()),
                StateValue {
                    acc: AccValue::Scalar(5),
                    payload: vec![7; 300],
                },
            ),
            (
                Key::Long(-1),
                StateValue {
                    acc: AccValue::Scalar(1),
                    payload: vec![],
                },
            ),
            (
                Key::Int(3),
                StateValue {
                    acc: AccValue::Scalar(1),
                    payload: vec![1; 127],
                },
            ),
        ];
        let info = BlockInfo {
            function: AggregateFunction::Count,
            window_size_ms: None,
            max_parallelism: 128,
            key_group: 0,
        };
        let (block, _) = encode_entries(&info, entries.iter().map(|(k, v)| (k, v)));
        let mut total = 0;
        state_codec::for_each_raw_entry(&block, |k, raw| {
            let key = RecordKey::from(&k.to_key());
            let v = &entries.iter().find(|(e, _)| *e == k.to_key()).unwrap().1;
            assert_eq!(entry_len(&key, v), raw.len() as u64);
            total += raw.len();
            Ok(())
        })
        .unwrap();
        assert!(total > 400);
        let w = StateValue {
            acc: AccValue::Windows(vec![(0, 3), (10, 4)]),
            payload: vec![],
        };
        assert_eq!(aggregate_of(AggregateFunction::Count, &w.acc), (Some(7), 2));
        assert_eq!(aggregate_of(AggregateFunction::Max, &w.acc), (Some(4), 2));
        assert_eq!(entry_len(&RecordKey::long(1), &w), 9 + 1 + 32 + 1);
    }

    #[test]
    fn top_n_keeps_the_largest() {
        let mut t: TopN<(u64, i64)> = TopN::new(2);
        for (i, b) in [5u64, 1, 9, 7, 9].into_iter().enumerate() {
            t.offer((b, 0), || KeyStat {
                key: Key::Long(i as i64),
                key_type: KeyType::Long,
                key_group: 0,
                bytes: b,
                value: None,
                windows: 0,
            });
        }
        let got: Vec<u64> = t.into_sorted().iter().map(|k| k.bytes).collect();
        assert_eq!(got, [9, 9]);
    }
}
