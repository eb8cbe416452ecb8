//! The keyed aggregation operator.
//!
//! One [`KeyedAggregator`] runs per subtask and keeps state only for the key groups of its
//! [`KeyGroupRange`], organised per group (one hash map per group), so a group's state can be
//! snapshotted ([`KeyedAggregator::encode_group`]) and restored
//! ([`KeyedAggregator::restore_group`]) on its own — the unit a rescale moves.
//!
//! * Without a window, every key has one accumulator; [`KeyedAggregator::results`] gives all
//!   current values and [`KeyedAggregator::drain_updates`] those changed since the last call.
//! * With a tumbling event-time window, every key has one accumulator per open window; a window
//!   `[start, start + size)` fires when the watermark reaches its end
//!   ([`KeyedAggregator::advance_watermark`]) and its state is dropped. A record whose window
//!   has fired is late: it is counted ([`KeyedAggregator::late_records`]) and not applied.
//!
//! `sum` wraps on overflow (two's complement), which keeps it independent of record order.

use super::record::{KeyMap, Record, RecordKey};
use super::result::{ResultRow, Window};
use super::state_codec::{self, AccValue, BlockInfo, BlockWriter, CodecError, StateValue};
use super::watermark::MIN_WATERMARK;
use bytes::{Bytes, BytesMut};
use keyshift_core::keygroup::KeyGroupRange;
use keyshift_core::spec::AggregateFunction;
use std::collections::BTreeMap;

/// What the operator computes and how it lays out state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AggConfig {
    /// The aggregate function.
    pub function: AggregateFunction,
    /// Tumbling window size in ms (`None`: aggregate over all time).
    pub window_size_ms: Option<i64>,
    /// The key-group count.
    pub max_parallelism: u32,
    /// Opaque bytes kept with every key's state (benchmark ballast; 0 normally).
    pub state_payload_bytes: usize,
}

/// Errors of the operator.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AggregateError {
    #[error(
        "key group {group} is not owned by this subtask (groups {range}): the record or block was routed to the wrong subtask"
    )]
    NotOwned { group: u32, range: KeyGroupRange },
    #[error("key group {group} block is unreadable: {source}")]
    Codec {
        group: u32,
        #[source]
        source: CodecError,
    },
    #[error(
        "key group {group} block does not fit this job: {what} is {block} in the block but {job} in the job"
    )]
    Incompatible {
        group: u32,
        what: &'static str,
        block: String,
        job: String,
    },
    #[error(
        "key {key} in the block of group {group} belongs to group {actual}: the block was written under another key-group count or is corrupt"
    )]
    KeyInWrongGroup {
        key: String,
        group: u32,
        actual: u32,
    },
    #[error("invalid window size {0} ms: must be at least 1")]
    WindowSize(i64),
}

#[derive(Debug, Clone)]
struct Slot {
    acc: AccValue,
    /// Immutable once created; a restored key's payload shares the memory of the block it was
    /// restored from (no copy, no allocation per key).
    payload: Bytes,
    dirty: bool,
    /// Its value at the barrier of the capture running ([`KeyedAggregator::begin_capture`])
    /// was copied by a step (cleared by the key's next change).
    captured: bool,
    /// The cut epoch of the key's last change ([`KeyedAggregator::cut`]; 0: restored).
    epoch: u32,
}

pub use keyshift_core::keygroup::GroupMode;

/// The keyed aggregation operator of one subtask.
#[derive(Debug)]
pub struct KeyedAggregator {
    config: AggConfig,
    range: KeyGroupRange,
    groups: Vec<KeyMap<Slot>>,
    /// Per group, where new keys' payloads are allocated (see [`PayloadArena`]).
    arenas: Vec<PayloadArena>,
    watermark: i64,
    /// Window start -> number of keys with that window open (to skip scans when nothing fires).
    open_windows: BTreeMap<i64, u64>,
    late_records: u64,
    records: u64,
    /// The current cut epoch: changes are stamped with it; [`KeyedAggregator::cut`] ends it.
    epoch: u32,
    /// Per group, the epoch of its last change.
    changed: Vec<u32>,
    /// Per group, the epoch it last lost keys or was replaced (a delta cannot say that).
    reset: Vec<u32>,
    /// Per group, the keys changed since the last cut (each once), so that a delta is
    /// encoded without scanning the group; `None` once too many changed to be worth it.
    touched: Vec<Option<Vec<RecordKey>>>,
    /// The lists of the last cut, for the snapshot taken at it, and the cut before it (the
    /// deltas they can write are those since that cut).
    cut_lists: Option<(u32, Vec<Option<Vec<RecordKey>>>)>,
    /// The epoch of the last cut (0: none since the state was created or restored).
    last_cut: u32,
    /// The changed keys of the last cut still to be copied, if any ([`Self::begin_capture`]).
    capture: Option<Capture>,
}

/// The deltas of a cut whose changed keys are copied after its barrier rather than at it
/// ([`KeyedAggregator::begin_capture`]): each key's value at the barrier is copied either by a
/// step between batches ([`KeyedAggregator::capture_step`]) or, if a record changes the key
/// first, just before that change (copy on write). Either way exactly once: a step marks the
/// key captured, a change moves it out of the cut's epoch.
#[derive(Debug)]
struct Capture {
    /// The cut's epoch: its deltas hold the keys last changed in it.
    epoch: u32,
    /// Per owned group (by index): its delta being copied, if it is one.
    groups: Vec<Option<Capturing>>,
    /// Group indices with keys still to visit, in order, and how far the steps got.
    order: Vec<usize>,
    at: usize,
    /// Drain the copied keys' results (their change marks cleared) into `lines`.
    drain: bool,
    lines: Vec<u8>,
}

#[derive(Debug)]
struct Capturing {
    frozen: FrozenGroup,
    /// The keys changed in the cut's epoch, and the next one a step visits.
    keys: Vec<RecordKey>,
    next: usize,
}

impl Capture {
    /// Copies `key`'s value as the cut's barrier left it, if it belongs to the cut and was not
    /// copied yet: a record is about to change it (`slot.epoch` is not the current epoch).
    #[inline]
    fn copy_on_write(&mut self, index: usize, key: &RecordKey, slot: &mut Slot, size: Option<i64>) {
        if slot.epoch != self.epoch || slot.captured {
            return;
        }
        if let Some(Some(g)) = self.groups.get_mut(index) {
            take_entry(
                &mut g.frozen,
                key,
                slot,
                self.drain.then_some(&mut self.lines),
                size,
            );
        }
    }
}

/// Copies a key's entry into a frozen group, draining its result if asked.
#[inline]
fn take_entry(
    frozen: &mut FrozenGroup,
    key: &RecordKey,
    slot: &mut Slot,
    lines: Option<&mut Vec<u8>>,
    size: Option<i64>,
) {
    frozen.rows += drain_row(lines, key, slot, size);
    frozen
        .entries
        .push((key.clone(), slot.acc.clone(), slot.payload.clone()));
}

/// Copies the listed keys last changed in cut `epoch` and not copied yet into a frozen group
/// (marking them copied), draining their results if asked.
fn copy_listed(
    map: &mut KeyMap<Slot>,
    keys: &[RecordKey],
    epoch: u32,
    frozen: &mut FrozenGroup,
    mut lines: Option<&mut Vec<u8>>,
    size: Option<i64>,
) {
    for key in keys {
        if let Some(slot) = map.get_mut(key)
            && slot.epoch == epoch
            && !slot.captured
        {
            take_entry(frozen, key, slot, lines.as_deref_mut(), size);
            slot.captured = true;
        }
    }
}

/// Drains a changed key's result into `out` (if asked): appends its rows as sink JSON lines and
/// clears its change mark; returns how many rows.
#[inline]
fn drain_row(
    out: Option<&mut Vec<u8>>,
    key: &RecordKey,
    slot: &mut Slot,
    size: Option<i64>,
) -> u64 {
    match out {
        Some(out) if slot.dirty => {
            slot.dirty = false;
            format_rows(out, key, &slot.acc, size)
        }
        _ => 0,
    }
}

/// A cut's deltas still being copied, as [`KeyedAggregator::take_captured`] hands them over
/// once complete.
#[derive(Debug)]
pub struct Captured {
    /// The groups, in group order.
    pub groups: Vec<FrozenGroup>,
    /// Their drained result lines.
    pub lines: Vec<u8>,
    /// Rows in `lines`.
    pub rows: u64,
}

#[inline(always)]
fn combine(f: AggregateFunction, acc: i64, value: i64) -> i64 {
    match f {
        AggregateFunction::Count => acc.wrapping_add(1),
        AggregateFunction::Sum => acc.wrapping_add(value),
        AggregateFunction::Min => acc.min(value),
        AggregateFunction::Max => acc.max(value),
    }
}

#[inline(always)]
fn initial(f: AggregateFunction, value: i64) -> i64 {
    match f {
        AggregateFunction::Count => 1,
        _ => value,
    }
}

/// Merges two partial accumulators of the same function (used by tests and tools that combine
/// partial results).
pub fn merge(f: AggregateFunction, a: i64, b: i64) -> i64 {
    match f {
        AggregateFunction::Count | AggregateFunction::Sum => a.wrapping_add(b),
        AggregateFunction::Min => a.min(b),
        AggregateFunction::Max => a.max(b),
    }
}

pub use keyshift_core::window::window_start;

/// Smallest and largest chunk of a [`PayloadArena`].
const ARENA_MIN_CHUNK: usize = 4 * 1024;
const ARENA_MAX_CHUNK: usize = 1024 * 1024;

/// Where one key group's new payloads are allocated: consecutive slices of shared chunks (4 KiB
/// doubling up to 1 MiB), so that a group's payloads lie together in memory in the order their
/// keys arrived, instead of scattered over the whole heap. Encoding a group then reads a few
/// dense chunks rather than one page (and one TLB miss) per key. A chunk is freed when the last
/// payload in it is (keys leave the state only when their windows fire or the group is cleared).
#[derive(Debug, Default)]
struct PayloadArena {
    chunk: BytesMut,
    next_chunk: usize,
}

impl PayloadArena {
    /// A payload of `n` bytes of deterministic ballast for `key` (so it does not compress to
    /// nothing).
    fn payload_for(&mut self, key: &RecordKey, n: usize) -> Bytes {
        if n == 0 {
            return Bytes::new();
        }
        if self.chunk.capacity() - self.chunk.len() < n {
            let size = self.next_chunk.clamp(ARENA_MIN_CHUNK, ARENA_MAX_CHUNK);
            self.next_chunk = size.saturating_mul(2);
            self.chunk = BytesMut::with_capacity(size.max(n));
        }
        let mut s = key.java_hash() as u32 as u64;
        let mut left = n;
        while left > 0 {
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let word = super::generator::splitmix64(s).to_le_bytes();
            let take = left.min(8);
            self.chunk.extend_from_slice(&word[..take]);
            left -= take;
        }
        self.chunk.split().freeze()
    }
}

impl KeyedAggregator {
    /// An empty operator for the groups in `range`.
    pub fn new(config: AggConfig, range: KeyGroupRange) -> Result<Self, AggregateError> {
        if let Some(size) = config.window_size_ms
            && size < 1
        {
            return Err(AggregateError::WindowSize(size));
        }
        Ok(KeyedAggregator {
            config,
            range,
            groups: (0..range.len()).map(|_| KeyMap::default()).collect(),
            arenas: (0..range.len()).map(|_| PayloadArena::default()).collect(),
            watermark: MIN_WATERMARK,
            open_windows: BTreeMap::new(),
            late_records: 0,
            records: 0,
            epoch: 1,
            changed: vec![0; range.len() as usize],
            reset: vec![0; range.len() as usize],
            touched: (0..range.len()).map(|_| Some(Vec::new())).collect(),
            cut_lists: None,
            last_cut: 0,
            capture: None,
        })
    }

    /// Ends the current cut epoch at a snapshot's barrier and returns it: every change so far
    /// is stamped with it or an earlier one, every later change with a later one. The state as
    /// restored is epoch 0.
    pub fn cut(&mut self) -> u32 {
        self.capture_all();
        let e = self.epoch;
        let fresh = (0..self.touched.len()).map(|_| Some(Vec::new())).collect();
        let lists = std::mem::replace(&mut self.touched, fresh);
        self.cut_lists = Some((self.last_cut, lists));
        self.last_cut = e;
        self.epoch = self.epoch.wrapping_add(1).max(1);
        e
    }

    /// How a snapshot building on the one taken at cut `since` must write `group`: in full if
    /// it lost keys (or was replaced) since, not at all if nothing changed, else a delta.
    pub fn group_mode(&self, group: u32, since: u32) -> GroupMode {
        match self.group_index(group) {
            None => GroupMode::Full,
            Some(i) if self.reset[i] > since => GroupMode::Full,
            Some(i) if self.changed[i] <= since => GroupMode::Unchanged,
            Some(_) => GroupMode::Delta { since },
        }
    }

    /// The configuration.
    pub fn config(&self) -> &AggConfig {
        &self.config
    }

    /// The key groups this operator owns.
    pub fn range(&self) -> KeyGroupRange {
        self.range
    }

    /// The current watermark ([`MIN_WATERMARK`] until the first advance).
    pub fn watermark(&self) -> i64 {
        self.watermark
    }

    /// Records dropped because their window had already fired.
    pub fn late_records(&self) -> u64 {
        self.late_records
    }

    /// Records applied (late ones excluded).
    pub fn records_processed(&self) -> u64 {
        self.records
    }

    /// Number of keys in state.
    pub fn key_count(&self) -> usize {
        self.groups.iter().map(|g| g.len()).sum()
    }

    /// Number of keys in one owned group (0 for groups not owned).
    pub fn group_key_count(&self, group: u32) -> usize {
        self.group_index(group).map_or(0, |i| self.groups[i].len())
    }

    /// Notes that `key` of group `index` changed for the first time since the last cut.
    #[inline]
    fn note_touched(touched: &mut Option<Vec<RecordKey>>, key: &RecordKey, group_keys: usize) {
        if let Some(list) = touched {
            // Past a quarter of the group, a scan costs less than the list.
            if list.len() > 64 && list.len() > group_keys / 4 {
                *touched = None;
            } else {
                list.push(key.clone());
            }
        }
    }

    #[inline]
    fn group_index(&self, group: u32) -> Option<usize> {
        self.range
            .contains(group)
            .then(|| (group - self.range.start) as usize)
    }

    /// Applies one record. A record whose key group this subtask does not own is an error (a
    /// routing bug); a record whose window has fired is counted as late and skipped.
    #[inline]
    pub fn process(&mut self, record: &Record) -> Result<(), AggregateError> {
        self.apply::<false>(record, 1)
    }

    /// Applies a batch of records; stops at the first error.
    pub fn process_batch(&mut self, records: &[Record]) -> Result<(), AggregateError> {
        records.iter().try_for_each(|r| self.process(r))
    }

    /// Merges partial results combined before the shuffle (each with how many records it stands
    /// for; [`super::combine`]) into the state,
    /// as [`Self::process`] would apply the records each stands for (counted as that many, late
    /// ones too); stops at the first error.
    pub fn process_partials<'a>(
        &mut self,
        partials: impl IntoIterator<Item = (&'a Record, u32)>,
    ) -> Result<(), AggregateError> {
        partials
            .into_iter()
            .try_for_each(|(r, weight)| self.apply::<true>(r, u64::from(weight)))
    }

    /// Applies `record`, standing for `weight` records: a raw record (its value the input of
    /// the function) or, `PARTIAL`, a partial accumulator (merged).
    #[inline(always)]
    fn apply<const PARTIAL: bool>(
        &mut self,
        record: &Record,
        weight: u64,
    ) -> Result<(), AggregateError> {
        let f = self.config.function;
        let initial = |v| if PARTIAL { v } else { initial(f, v) };
        let combine = |acc, v| {
            if PARTIAL {
                merge(f, acc, v)
            } else {
                combine(f, acc, v)
            }
        };
        let group = record.key.key_group(self.config.max_parallelism);
        let Some(index) = self.group_index(group) else {
            return Err(AggregateError::NotOwned {
                group,
                range: self.range,
            });
        };
        let epoch = self.epoch;
        let map = &mut self.groups[index];
        match self.config.window_size_ms {
            None => {
                self.changed[index] = epoch;
                let group_keys = map.len();
                if let Some(slot) = map.get_mut(&record.key) {
                    if slot.epoch != epoch {
                        // The key's first change since the last cut: the cut still being
                        // copied takes its value first.
                        if let Some(c) = &mut self.capture {
                            c.copy_on_write(index, &record.key, slot, None);
                        }
                        slot.epoch = epoch;
                        slot.captured = false;
                        Self::note_touched(&mut self.touched[index], &record.key, group_keys);
                    }
                    if let AccValue::Scalar(acc) = &mut slot.acc {
                        *acc = combine(*acc, record.value);
                    }
                    slot.dirty = true;
                } else {
                    Self::note_touched(&mut self.touched[index], &record.key, map.len());
                    let payload = self.arenas[index]
                        .payload_for(&record.key, self.config.state_payload_bytes);
                    map.insert(
                        record.key.clone(),
                        Slot {
                            acc: AccValue::Scalar(initial(record.value)),
                            payload,
                            dirty: true,
                            captured: false,
                            epoch,
                        },
                    );
                }
            }
            Some(size) => {
                let start = window_start(record.ts, size);
                if start.saturating_add(size) <= self.watermark {
                    self.late_records += weight;
                    return Ok(());
                }
                self.changed[index] = epoch;
                let n = map.len();
                let slot = match map.get_mut(&record.key) {
                    Some(slot) => slot,
                    None => {
                        Self::note_touched(&mut self.touched[index], &record.key, n);
                        let payload = self.arenas[index]
                            .payload_for(&record.key, self.config.state_payload_bytes);
                        map.entry(record.key.clone()).or_insert(Slot {
                            acc: AccValue::Windows(Vec::new()),
                            payload,
                            dirty: true,
                            captured: false,
                            epoch,
                        })
                    }
                };
                slot.dirty = true;
                if slot.epoch != epoch {
                    // (A windowed job's cuts copy everything at the barrier: no capture runs.)
                    slot.epoch = epoch;
                    slot.captured = false;
                    Self::note_touched(&mut self.touched[index], &record.key, n);
                }
                if let AccValue::Windows(ws) = &mut slot.acc {
                    // Few windows are open per key, and the newest is the likeliest: search
                    // from the back.
                    match ws.iter().rposition(|(s, _)| *s <= start) {
                        Some(i) if ws[i].0 == start => ws[i].1 = combine(ws[i].1, record.value),
                        pos => {
                            let at = pos.map_or(0, |i| i + 1);
                            ws.insert(at, (start, initial(record.value)));
                            *self.open_windows.entry(start).or_insert(0) += 1;
                        }
                    }
                }
            }
        }
        self.records += weight;
        Ok(())
    }

    /// Advances the watermark (never backwards) and returns the windows that fire (end <=
    /// watermark), sorted by window then key; their state is dropped, and keys without open
    /// windows leave the state. Without a window it only records the watermark.
    pub fn advance_watermark(&mut self, watermark: i64) -> Vec<ResultRow> {
        self.capture_all();
        if watermark <= self.watermark {
            return Vec::new();
        }
        self.watermark = watermark;
        let Some(size) = self.config.window_size_ms else {
            return Vec::new();
        };
        let fires = |start: i64| start.saturating_add(size) <= watermark;
        match self.open_windows.first_key_value() {
            Some((start, _)) if fires(*start) => {}
            _ => return Vec::new(),
        }
        let mut out = Vec::new();
        let epoch = self.epoch;
        for (i, map) in self.groups.iter_mut().enumerate() {
            let before = map.len();
            let mut touched = false;
            let list = &mut self.touched[i];
            let group_keys = map.len();
            map.retain(|key, slot| {
                if let AccValue::Windows(ws) = &mut slot.acc {
                    let n = ws.partition_point(|(s, _)| fires(*s));
                    if n > 0 {
                        if slot.epoch != epoch {
                            Self::note_touched(list, key, group_keys);
                        }
                        slot.epoch = epoch;
                        touched = true;
                    }
                    for (start, v) in ws.drain(..n) {
                        out.push(ResultRow {
                            key: key.clone(),
                            window: Some(Window {
                                start,
                                end: start.saturating_add(size),
                            }),
                            value: v,
                        });
                    }
                    !ws.is_empty()
                } else {
                    true
                }
            });
            if touched {
                self.changed[i] = epoch;
            }
            if map.len() != before {
                self.reset[i] = epoch;
            }
        }
        self.open_windows.retain(|start, _| !fires(*start));
        out.sort_by(|a, b| a.window.cmp(&b.window).then_with(|| a.key.cmp(&b.key)));
        out
    }

    /// Sets the watermark without firing anything (for restore: the snapshot's watermark).
    /// Windows that already end at or before it fire on the next advance.
    pub fn restore_watermark(&mut self, watermark: i64) {
        self.watermark = watermark;
    }

    /// Every key's current value (all-time), or every open window's partial value (windowed),
    /// sorted by window then key.
    pub fn results(&self) -> Vec<ResultRow> {
        let mut out = Vec::with_capacity(self.key_count());
        for map in &self.groups {
            for (key, slot) in map {
                push_rows(&mut out, key, &slot.acc, self.config.window_size_ms);
            }
        }
        out.sort_by(|a, b| a.window.cmp(&b.window).then_with(|| a.key.cmp(&b.key)));
        out
    }

    /// Current values of the keys changed since the last call (all-time aggregation), or of
    /// their open windows (windowed); clears the change marks. Scans the whole state.
    pub fn drain_updates(&mut self) -> Vec<ResultRow> {
        self.capture_all();
        let mut out = Vec::new();
        let size = self.config.window_size_ms;
        for map in &mut self.groups {
            for (key, slot) in map.iter_mut() {
                if slot.dirty {
                    slot.dirty = false;
                    push_rows(&mut out, key, &slot.acc, size);
                }
            }
        }
        out.sort_by(|a, b| a.window.cmp(&b.window).then_with(|| a.key.cmp(&b.key)));
        out
    }

    /// Marks every key changed, as if each had just received a record (benchmarks and tests:
    /// the next drain reports them all).
    pub fn mark_all_changed(&mut self) {
        self.capture_all();
        for (i, map) in self.groups.iter_mut().enumerate() {
            for slot in map.values_mut() {
                slot.dirty = true;
                slot.epoch = self.epoch;
            }
            self.changed[i] = self.epoch;
            self.touched[i] = None;
        }
    }

    /// Starts copying the changed keys of deltas set aside at a cut ([`GroupSnapshot::defer`])
    /// after its barrier, so that the barrier itself copies nothing of them: records flow at
    /// once, [`capture_step`](Self::capture_step) copies a few keys at a time between batches,
    /// and a record about to change a key not copied yet copies it first. Their results are
    /// drained too if `drain` (each key's value at the barrier). Bulk changes (a window
    /// firing, a group taken or replaced, the next cut) complete the copy first; so does
    /// [`take_captured`](Self::take_captured).
    ///
    /// Only one capture is held at a time: if the last one was not taken yet, these deltas are
    /// copied now and returned (the caller's bug, but nothing is lost).
    pub fn begin_capture(&mut self, deferred: Vec<DeferredGroup>, drain: bool) -> Option<Captured> {
        if self.capture.is_some() {
            let size = self.config.window_size_ms;
            let (epoch, mut lines) = (self.last_cut, Vec::new());
            let mut groups = Vec::with_capacity(deferred.len());
            for mut d in deferred {
                if let Some(map) = self
                    .group_index(d.frozen.group())
                    .map(|i| &mut self.groups[i])
                {
                    let lines = drain.then_some(&mut lines);
                    copy_listed(map, &d.keys, epoch, &mut d.frozen, lines, size);
                }
                groups.push(d.frozen);
            }
            let rows = groups.iter().map(|g| g.rows).sum();
            return Some(Captured {
                groups,
                lines,
                rows,
            });
        }
        if deferred.is_empty() {
            return None;
        }
        let mut groups: Vec<Option<Capturing>> = (0..self.groups.len()).map(|_| None).collect();
        let mut order = Vec::with_capacity(deferred.len());
        for d in deferred {
            let Some(index) = self.group_index(d.frozen.group()) else {
                continue;
            };
            order.push(index);
            groups[index] = Some(Capturing {
                frozen: d.frozen,
                keys: d.keys,
                next: 0,
            });
        }
        self.capture = Some(Capture {
            epoch: self.last_cut,
            groups,
            order,
            at: 0,
            drain,
            lines: Vec::new(),
        });
        None
    }

    /// Copies up to `budget` more keys of the capture running; true once none is left to
    /// copy (or none runs).
    pub fn capture_step(&mut self, budget: usize) -> bool {
        let Some(c) = &mut self.capture else {
            return true;
        };
        let size = self.config.window_size_ms;
        let mut left = budget;
        while let Some(&index) = c.order.get(c.at) {
            let (Some(Some(g)), Some(map)) = (c.groups.get_mut(index), self.groups.get_mut(index))
            else {
                c.at += 1;
                continue;
            };
            let end = g.keys.len().min(g.next.saturating_add(left));
            let lines = c.drain.then_some(&mut c.lines);
            copy_listed(
                map,
                &g.keys[g.next..end],
                c.epoch,
                &mut g.frozen,
                lines,
                size,
            );
            left -= end - g.next;
            g.next = end;
            if g.next < g.keys.len() {
                return false;
            }
            g.keys = Vec::new();
            c.at += 1;
        }
        true
    }

    /// Whether a capture is running ([`begin_capture`](Self::begin_capture)) and not yet handed
    /// over.
    pub fn capturing(&self) -> bool {
        self.capture.is_some()
    }

    /// Completes the capture running, if any (its result stays for
    /// [`take_captured`](Self::take_captured)).
    fn capture_all(&mut self) {
        if self.capture.is_some() {
            self.capture_step(usize::MAX);
        }
    }

    /// Completes the capture running and hands over its groups (as of its barrier) and result
    /// lines; `None` if none runs.
    pub fn take_captured(&mut self) -> Option<Captured> {
        self.capture_all();
        let c = self.capture.take()?;
        let groups: Vec<FrozenGroup> = c.groups.into_iter().flatten().map(|g| g.frozen).collect();
        let rows = groups.iter().map(|g| g.rows).sum();
        Some(Captured {
            groups,
            lines: c.lines,
            rows,
        })
    }

    fn block_info(&self, group: u32) -> BlockInfo {
        BlockInfo {
            function: self.config.function,
            window_size_ms: self.config.window_size_ms,
            max_parallelism: self.config.max_parallelism,
            key_group: group,
        }
    }

    /// Encodes one owned group's state as a self-describing block (see
    /// [`super::state_codec`]); returns the bytes and the number of entries.
    pub fn encode_group(&self, group: u32) -> Result<(Vec<u8>, u64), AggregateError> {
        let index = self.group_index(group).ok_or(AggregateError::NotOwned {
            group,
            range: self.range,
        })?;
        let map = &self.groups[index];
        let per_entry = 40 + self.config.state_payload_bytes;
        let mut w = BlockWriter::new(&self.block_info(group), 64 + map.len() * per_entry);
        for (key, slot) in map {
            w.push(key, &slot.acc, &slot.payload);
        }
        Ok(w.finish())
    }

    /// Every owned group, in group order, detached for one snapshot: each can be encoded
    /// ([`GroupSnapshot::encode`]) on its own thread, since it borrows only its group's state.
    pub fn snapshot_groups(&mut self) -> Vec<GroupSnapshot<'_>> {
        self.snapshot_groups_as(|_| GroupMode::Full)
    }

    /// [`snapshot_groups`](Self::snapshot_groups), each group written as `mode(group)` says
    /// (see [`group_mode`](Self::group_mode); a mode that cannot describe the group's changes
    /// is the caller's error).
    pub fn snapshot_groups_as(
        &mut self,
        mode: impl Fn(u32) -> GroupMode,
    ) -> Vec<GroupSnapshot<'_>> {
        self.capture_all();
        let (config, start) = (self.config, self.range.start);
        let per_entry = 40 + config.state_payload_bytes;
        // The keys changed since the cut before this snapshot's: enough for a delta since that
        // cut without a scan.
        let (lists_since, mut lists) = match self.cut_lists.take() {
            Some((since, lists)) => (Some(since), lists),
            None => (None, Vec::new()),
        };
        self.groups
            .iter_mut()
            .enumerate()
            .map(|(i, map)| GroupSnapshot {
                changed_keys: match mode(start + i as u32) {
                    GroupMode::Delta { since } if Some(since) == lists_since => {
                        lists.get_mut(i).and_then(Option::take)
                    }
                    _ => None,
                },
                mode: mode(start + i as u32),
                info: BlockInfo {
                    function: config.function,
                    window_size_ms: config.window_size_ms,
                    max_parallelism: config.max_parallelism,
                    key_group: start + i as u32,
                },
                per_entry,
                map,
            })
            .collect()
    }

    /// Replaces one owned group's state with a block's. The block must have this job's schema,
    /// function, window size and key-group count, be for `group`, and hold only keys of that
    /// group. Restored keys are not marked changed. (One copy of the block is kept; see
    /// [`GroupDecoder`] to restore from shared bytes without it.)
    pub fn restore_group(&mut self, group: u32, block: &[u8]) -> Result<(), AggregateError> {
        let state = self
            .decoder()
            .decode(group, &Bytes::copy_from_slice(block))?;
        self.install_group(state)
    }

    /// A decoder of this operator's blocks, usable on other threads ([`GroupDecoder::decode`]);
    /// the decoded groups are then installed with [`install_group`](Self::install_group).
    pub fn decoder(&self) -> GroupDecoder {
        GroupDecoder {
            config: self.config,
            range: self.range,
        }
    }

    /// Replaces one owned group's state with a decoded one (from this operator's
    /// [`decoder`](Self::decoder) or one of the same configuration and range). The installed
    /// state is what a restore read: it counts as unchanged since the snapshot it came from
    /// (epoch 0), so a checkpoint building on that snapshot writes only what changes later.
    pub fn install_group(&mut self, state: DecodedGroupState) -> Result<(), AggregateError> {
        self.capture_all();
        let group = state.group;
        let index = self.group_index(group).ok_or(AggregateError::NotOwned {
            group,
            range: self.range,
        })?;
        self.forget_windows(index);
        for start in state.opened {
            *self.open_windows.entry(start).or_insert(0) += 1;
        }
        self.groups[index] = state.map;
        self.arenas[index] = PayloadArena::default();
        // What was restored is no change.
        self.touched[index] = Some(Vec::new());
        Ok(())
    }

    /// Takes one owned group's state out of the operator (it is left empty), so that deltas
    /// can be applied to it off the operator ([`GroupDecoder::decode_onto`]) and the result
    /// installed again ([`install_group`](Self::install_group)): a pre-staged subtask applies
    /// the delta since the checkpoint it loaded this way.
    pub fn take_group(&mut self, group: u32) -> Result<DecodedGroupState, AggregateError> {
        self.capture_all();
        let index = self.group_index(group).ok_or(AggregateError::NotOwned {
            group,
            range: self.range,
        })?;
        self.forget_windows(index);
        let map = std::mem::take(&mut self.groups[index]);
        Ok(DecodedGroupState {
            group,
            map,
            opened: Vec::new(),
        })
    }

    /// Drops one owned group's state (e.g. before handing it to another subtask).
    pub fn clear_group(&mut self, group: u32) -> Result<(), AggregateError> {
        self.capture_all();
        let index = self.group_index(group).ok_or(AggregateError::NotOwned {
            group,
            range: self.range,
        })?;
        self.forget_windows(index);
        self.groups[index].clear();
        self.arenas[index] = PayloadArena::default();
        self.touched[index] = None;
        self.reset[index] = self.epoch;
        self.changed[index] = self.epoch;
        Ok(())
    }

    fn forget_windows(&mut self, index: usize) {
        // No window open (always so without windows): nothing to scan the group for (a large
        // group's scan is most of what taking and installing it costs).
        if self.open_windows.is_empty() {
            return;
        }
        for slot in self.groups[index].values() {
            if let AccValue::Windows(ws) = &slot.acc {
                for (s, _) in ws {
                    if let Some(n) = self.open_windows.get_mut(s) {
                        *n -= 1;
                        if *n == 0 {
                            self.open_windows.remove(s);
                        }
                    }
                }
            }
        }
    }

    /// One group's entries as plain values (for tests and tools).
    pub fn group_entries(&self, group: u32) -> Vec<(RecordKey, StateValue)> {
        self.group_index(group).map_or_else(Vec::new, |i| {
            self.groups[i]
                .iter()
                .map(|(k, s)| {
                    (
                        k.clone(),
                        StateValue {
                            acc: s.acc.clone(),
                            payload: s.payload.to_vec(),
                        },
                    )
                })
                .collect()
        })
    }
}

/// Decodes key-group blocks for an operator (its configuration and key groups) without
/// touching it, so that blocks can be decoded on other threads while the next ones are read and
/// installed ([`KeyedAggregator::install_group`]) only once every block has been checked.
#[derive(Debug, Clone, Copy)]
pub struct GroupDecoder {
    config: AggConfig,
    range: KeyGroupRange,
}

/// One group's state decoded from its block, not part of any operator yet.
#[derive(Debug)]
pub struct DecodedGroupState {
    group: u32,
    map: KeyMap<Slot>,
    opened: Vec<i64>,
}

impl DecodedGroupState {
    /// The key group.
    pub fn group(&self) -> u32 {
        self.group
    }

    /// Keys decoded.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the block held no keys.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Drops every key (a group about to be read again from nothing).
    pub fn clear(&mut self) {
        self.map.clear();
        self.opened.clear();
    }
}

impl GroupDecoder {
    /// Decodes the block of `group`. The block must have this job's schema, function, window
    /// size and key-group count, be for `group` (owned), and hold only keys of that group. Keys'
    /// payloads are slices of `block` (its memory lives as long as one of them does).
    pub fn decode(&self, group: u32, block: &Bytes) -> Result<DecodedGroupState, AggregateError> {
        self.decode_chain(group, block, &[])
    }

    /// Decodes the block of `group` and then its delta blocks (incremental checkpoints) in
    /// order: a key in a delta replaces the same key's state. Each block is checked like
    /// [`decode`](Self::decode)'s.
    pub fn decode_chain(
        &self,
        group: u32,
        block: &Bytes,
        deltas: &[Bytes],
    ) -> Result<DecodedGroupState, AggregateError> {
        if !self.range.contains(group) {
            return Err(AggregateError::NotOwned {
                group,
                range: self.range,
            });
        }
        let mut map = KeyMap::default();
        if !block.is_empty() || deltas.is_empty() {
            self.decode_into(group, block, &mut map)?;
        }
        for d in deltas {
            self.decode_into(group, d, &mut map)?;
        }
        let mut opened: Vec<i64> = Vec::new();
        if self.config.window_size_ms.is_some() {
            for slot in map.values() {
                if let AccValue::Windows(ws) = &slot.acc {
                    opened.extend(ws.iter().map(|(s, _)| *s));
                }
            }
        }
        Ok(DecodedGroupState { group, map, opened })
    }

    /// Applies delta blocks of `state`'s group in order over it (a key in a delta replaces the
    /// same key's state; a windowed key without open windows leaves), each block checked like
    /// [`decode`](Self::decode)'s. On an error the state is dropped with the group half applied:
    /// the caller must not install anything of it.
    pub fn decode_onto(
        &self,
        mut state: DecodedGroupState,
        deltas: &[Bytes],
    ) -> Result<DecodedGroupState, AggregateError> {
        for d in deltas {
            self.decode_into(state.group, d, &mut state.map)?;
        }
        state.opened.clear();
        if self.config.window_size_ms.is_some() {
            for slot in state.map.values() {
                if let AccValue::Windows(ws) = &slot.acc {
                    state.opened.extend(ws.iter().map(|(s, _)| *s));
                }
            }
        }
        Ok(state)
    }

    fn decode_into(
        &self,
        group: u32,
        block: &Bytes,
        map: &mut KeyMap<Slot>,
    ) -> Result<(), AggregateError> {
        // Checksum and header, once; then the entries.
        let entries = state_codec::shared_entries(block)
            .map_err(|source| AggregateError::Codec { group, source })?;
        let info = entries.header().info;
        let incompatible = |what, block: String, job: String| AggregateError::Incompatible {
            group,
            what,
            block,
            job,
        };
        if info.key_group != group {
            return Err(incompatible(
                "key group",
                info.key_group.to_string(),
                group.to_string(),
            ));
        }
        if info.max_parallelism != self.config.max_parallelism {
            return Err(incompatible(
                "max parallelism",
                info.max_parallelism.to_string(),
                self.config.max_parallelism.to_string(),
            ));
        }
        if info.function != self.config.function {
            return Err(incompatible(
                "aggregate function",
                format!("{:?}", info.function),
                format!("{:?}", self.config.function),
            ));
        }
        if info.window_size_ms != self.config.window_size_ms {
            return Err(incompatible(
                "window size (ms)",
                format!("{:?}", info.window_size_ms),
                format!("{:?}", self.config.window_size_ms),
            ));
        }
        let maxp = self.config.max_parallelism;
        // Sized for the first block; a delta's keys are mostly held already (reserving room for
        // all of them could double a large group's table for nothing).
        if map.is_empty() {
            map.reserve(entries.header().entries.min(block.len() as u64 / 10) as usize);
        }
        let mut wrong: Option<AggregateError> = None;
        entries
            .for_each(|key, acc, payload| {
                let actual = key.key_group(maxp);
                if actual != group && wrong.is_none() {
                    wrong = Some(AggregateError::KeyInWrongGroup {
                        key: key.to_string(),
                        group,
                        actual,
                    });
                }
                if let AccValue::Windows(ws) = &acc
                    && ws.is_empty()
                {
                    map.remove(&key);
                    return Ok(());
                }
                match map.entry(key) {
                    // A key of a delta that the group holds already keeps its payload when
                    // the delta's is the same bytes (a payload does not change once created):
                    // then no key refers into the delta block, which is freed once applied,
                    // and the earlier block's copy stays in use.
                    std::collections::hash_map::Entry::Occupied(mut held) => {
                        let slot = held.get_mut();
                        slot.acc = acc;
                        if slot.payload != payload {
                            slot.payload = payload;
                        }
                        slot.dirty = false;
                        slot.captured = false;
                        slot.epoch = 0;
                    }
                    std::collections::hash_map::Entry::Vacant(new) => {
                        new.insert(Slot {
                            acc,
                            payload,
                            dirty: false,
                            captured: false,
                            epoch: 0,
                        });
                    }
                }
                Ok(())
            })
            .map_err(|source| AggregateError::Codec { group, source })?;
        if let Some(e) = wrong {
            return Err(e);
        }
        Ok(())
    }
}

/// One key group's state, borrowed from its operator for a snapshot
/// ([`KeyedAggregator::snapshot_groups`]).
pub struct GroupSnapshot<'a> {
    mode: GroupMode,
    /// For a delta: the keys changed since its cut, if known (else the group is scanned).
    changed_keys: Option<Vec<RecordKey>>,
    info: BlockInfo,
    per_entry: usize,
    map: &'a mut KeyMap<Slot>,
}

/// A delta set aside at a cut ([`GroupSnapshot::defer`]), for [`KeyedAggregator::begin_capture`].
#[derive(Debug)]
pub struct DeferredGroup {
    frozen: FrozenGroup,
    keys: Vec<RecordKey>,
}

/// What [`GroupSnapshot::encode`] produced.
#[derive(Debug)]
pub struct EncodedGroup {
    /// The key group.
    pub group: u32,
    /// Its block, exactly what [`KeyedAggregator::encode_group`] returns.
    pub block: Vec<u8>,
    /// Entries in the block.
    pub entries: u64,
    /// Result rows appended to the caller's buffer (0 without one).
    pub rows: u64,
    /// How the block was written: the whole group, a delta (only changed keys), or nothing
    /// (an unchanged group: `block` is empty).
    pub mode: GroupMode,
    /// Keys in the group.
    pub keys: u64,
}

impl GroupSnapshot<'_> {
    /// The key group.
    pub fn group(&self) -> u32 {
        self.info.key_group
    }

    /// Keys in the group.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the group holds no keys.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Sets a delta whose changed keys are known aside, to be copied after the barrier
    /// ([`KeyedAggregator::begin_capture`]); any other group is handed back (to be frozen at
    /// the barrier).
    pub fn defer(self) -> Result<DeferredGroup, Self> {
        let since = match (self.mode, &self.changed_keys) {
            (GroupMode::Delta { since }, Some(_)) => since,
            _ => return Err(self),
        };
        let keys = self.changed_keys.unwrap_or_default();
        Ok(DeferredGroup {
            frozen: FrozenGroup {
                info: self.info,
                mode: GroupMode::Delta { since },
                entries: Vec::with_capacity(keys.len()),
                rows: 0,
                keys: self.map.len() as u64,
            },
            keys,
        })
    }

    /// Takes the group for a snapshot's cut at its barrier, like [`encode`](Self::encode)
    /// (the same result lines drained, the same block in the end), but encodes nothing: the
    /// entries the block will hold (every key for a whole group, the changed ones for a delta)
    /// are copied out, payloads shared rather than copied, and encoded later
    /// ([`FrozenGroup::encode`]), so that the record path waits only for the copy, not for
    /// the encoding and the write. A delta whose changed keys are known visits only those.
    pub fn freeze(self, mut updates: Option<&mut Vec<u8>>) -> FrozenGroup {
        let keys = self.map.len() as u64;
        let size = self.info.window_size_ms;
        let mut rows = 0u64;
        let mut take = |key: &RecordKey, slot: &mut Slot, copy: bool, entries: &mut Vec<_>| {
            rows += drain_row(updates.as_deref_mut(), key, slot, size);
            if copy {
                entries.push((key.clone(), slot.acc.clone(), slot.payload.clone()));
            }
        };
        let mut entries = Vec::new();
        match (self.mode, self.changed_keys) {
            // Nothing changed since the snapshot it builds on: no key is marked either.
            (GroupMode::Unchanged, _) => {}
            (GroupMode::Delta { since }, Some(changed)) => {
                entries.reserve(changed.len());
                for key in changed {
                    if let Some(slot) = self.map.get_mut(&key) {
                        let copy = slot.epoch > since;
                        take(&key, slot, copy, &mut entries);
                    }
                }
            }
            (mode, _) => {
                let since = match mode {
                    GroupMode::Delta { since } => Some(since),
                    _ => {
                        entries.reserve(self.map.len());
                        None
                    }
                };
                for (key, slot) in self.map.iter_mut() {
                    let copy = since.is_none_or(|s| slot.epoch > s);
                    take(key, slot, copy, &mut entries);
                }
            }
        }
        FrozenGroup {
            info: self.info,
            mode: self.mode,
            entries,
            rows,
            keys,
        }
    }

    /// Encodes the group's block, the same bytes as [`KeyedAggregator::encode_group`]. With
    /// `updates`, in the same pass over the state, also drains the group's changed keys like
    /// [`KeyedAggregator::drain_updates`]: appends each one's current value (or open windows) as
    /// a sink JSON line ([`super::result::format_json_row`]) and clears its change mark. Rows come
    /// in the map's order, not sorted.
    pub fn encode(self, mut updates: Option<&mut Vec<u8>>) -> EncodedGroup {
        let keys = self.map.len() as u64;
        let group = self.info.key_group;
        let since = match self.mode {
            GroupMode::Unchanged => {
                return EncodedGroup {
                    group,
                    block: Vec::new(),
                    entries: 0,
                    rows: 0,
                    mode: GroupMode::Unchanged,
                    keys,
                };
            }
            GroupMode::Full => None,
            GroupMode::Delta { since } => Some(since),
        };
        let hint = match since {
            None => 64 + self.map.len() * self.per_entry,
            Some(_) => 4096,
        };
        let mut w = BlockWriter::new(&self.info, hint);
        let size = self.info.window_size_ms;
        let mut rows = 0u64;
        match (since, self.changed_keys) {
            // Only the changed keys (every key changed and marked for the sink since the last
            // cut is in the list).
            (Some(since), Some(keys)) => {
                for key in &keys {
                    let Some(slot) = self.map.get_mut(key) else {
                        continue;
                    };
                    if slot.epoch > since {
                        w.push(key, &slot.acc, &slot.payload);
                    }
                    rows += drain_row(updates.as_deref_mut(), key, slot, size);
                }
            }
            _ => {
                for (key, slot) in self.map.iter_mut() {
                    if since.is_none_or(|s| slot.epoch > s) {
                        w.push(key, &slot.acc, &slot.payload);
                    }
                    rows += drain_row(updates.as_deref_mut(), key, slot, size);
                }
            }
        }
        let (block, entries) = w.finish();
        if since.is_some() && entries == 0 {
            return EncodedGroup {
                group,
                block: Vec::new(),
                entries: 0,
                rows,
                mode: GroupMode::Unchanged,
                keys,
            };
        }
        EncodedGroup {
            group,
            block,
            entries,
            rows,
            mode: self.mode,
            keys,
        }
    }
}

/// One key group as a snapshot's cut took it at its barrier ([`GroupSnapshot::freeze`]): the
/// entries its block will hold (accumulators copied, payloads shared), to be encoded later, off
/// the record path ([`FrozenGroup::encode`]). Records processed after the barrier do not
/// change it.
#[derive(Debug)]
pub struct FrozenGroup {
    info: BlockInfo,
    mode: GroupMode,
    entries: Vec<(RecordKey, AccValue, Bytes)>,
    rows: u64,
    keys: u64,
}

impl FrozenGroup {
    /// The key group.
    pub fn group(&self) -> u32 {
        self.info.key_group
    }

    /// Keys in the group at the barrier.
    pub fn keys(&self) -> u64 {
        self.keys
    }

    /// Result rows drained at the barrier.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Entries copied out at the barrier, to be encoded later.
    pub fn entries(&self) -> u64 {
        self.entries.len() as u64
    }

    /// The group's block as of the barrier: the same bytes as [`GroupSnapshot::encode`] would
    /// have produced there.
    pub fn encode(self) -> EncodedGroup {
        let FrozenGroup {
            info,
            mode,
            entries,
            rows,
            keys,
        } = self;
        // A delta without a change is no block at all.
        if mode == GroupMode::Unchanged
            || (matches!(mode, GroupMode::Delta { .. }) && entries.is_empty())
        {
            return EncodedGroup {
                group: info.key_group,
                block: Vec::new(),
                entries: 0,
                rows,
                mode: GroupMode::Unchanged,
                keys,
            };
        }
        let hint = 64 + entries.iter().map(|e| 40 + e.2.len()).sum::<usize>();
        let mut w = BlockWriter::new(&info, hint);
        for (key, acc, payload) in &entries {
            w.push(key, acc, payload);
        }
        drop(entries);
        let (block, n) = w.finish();
        EncodedGroup {
            group: info.key_group,
            block,
            entries: n,
            rows,
            mode,
            keys,
        }
    }
}

/// Appends a key's result rows as sink JSON lines (what [`push_rows`] would build); returns
/// how many.
fn format_rows(out: &mut Vec<u8>, key: &RecordKey, acc: &AccValue, size: Option<i64>) -> u64 {
    match acc {
        AccValue::Scalar(v) => {
            super::result::format_json_row(key, None, *v, out);
            1
        }
        AccValue::Windows(ws) => {
            let size = size.unwrap_or(0);
            for (start, v) in ws {
                let window = Window {
                    start: *start,
                    end: start.saturating_add(size),
                };
                super::result::format_json_row(key, Some(window), *v, out);
            }
            ws.len() as u64
        }
    }
}

fn push_rows(out: &mut Vec<ResultRow>, key: &RecordKey, acc: &AccValue, size: Option<i64>) {
    match acc {
        AccValue::Scalar(v) => out.push(ResultRow {
            key: key.clone(),
            window: None,
            value: *v,
        }),
        AccValue::Windows(ws) => {
            let size = size.unwrap_or(0);
            for (start, v) in ws {
                out.push(ResultRow {
                    key: key.clone(),
                    window: Some(Window {
                        start: *start,
                        end: start.saturating_add(size),
                    }),
                    value: *v,
                });
            }
        }
    }
}
