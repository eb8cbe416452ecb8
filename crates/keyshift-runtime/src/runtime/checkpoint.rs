//! Writing a subtask's keyed state at a barrier.
//!
//! [`write_state`] encodes every owned key group (and, for a non-windowed job, drains the changed
//! keys' results in the same pass over the state) and streams the blocks into a
//! [`SnapshotWriter`] (whose multipart uploads run behind the encoder, up to 4 parts in flight).
//! With more than one thread, groups are encoded on `threads` threads at once,
//! claimed in group order, while a task on the async runtime hands the finished blocks to the
//! writer in group order: encoding overlaps writing, and memory stays bounded (an encoder may run
//! at most a few groups ahead of the writer).
//!
//! The drained result lines come out in group order (keys in map order within a group). With
//! [`Updates::Log`] they are written to stdout by a helper thread as groups complete; with
//! [`Updates::Keep`] they are returned (the object-store sink stages them with the snapshot).
//! Either way they are all written or returned before [`write_state`] returns, also when it fails:
//! their keys' change marks are cleared, so a failed write hands the lines back
//! ([`StateWriteFailed::lines`]) for the caller to keep for the next snapshot.

use super::incremental::{Base, CutPolicy};
use crate::job::{
    EncodedGroup, FrozenGroup, GroupMode, GroupModes, GroupSnapshot, KeyedAggregator, ProgramError,
    ProgramStep,
};
use crate::snapshot::{self, ObjectStore, Path};
use crate::snapshot::{SnapshotError, SnapshotWriter, SubtaskSnapshot};
use bytes::Bytes;
use keyshift_sdk::block::{self, EncodedBlock};
use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use tokio::sync::{mpsc, oneshot};

/// What happens to the results of the keys changed since the last snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Updates {
    /// Not drained (a windowed job emits when windows fire).
    Skip,
    /// Drained and written to stdout (the log sink).
    Log,
    /// Drained and returned as JSON lines (the object-store sink).
    Keep,
}

/// Environment variable that sets a worker's encoder threads ([`StateWriteOptions::threads_for`]).
pub const ENCODE_THREADS_ENV: &str = "KEYSHIFT_ENCODE_THREADS";

/// How [`write_state`] runs.
#[derive(Debug, Clone, Copy)]
pub struct StateWriteOptions {
    /// Threads encoding groups at once. 1 encodes on the calling thread between writes; more
    /// need a multi-threaded tokio runtime (on another runtime flavour 1 is used).
    pub threads: usize,
    /// The changed keys' results.
    pub updates: Updates,
}

impl StateWriteOptions {
    /// Encoder threads for a state of `keys` keys: `KEYSHIFT_ENCODE_THREADS` if set (1 to 16),
    /// else [`DEFAULT_ENCODE_THREADS`]; always one for small states, where starting threads
    /// would cost more than it saves.
    pub fn threads_for(keys: usize) -> usize {
        if keys < 50_000 {
            return 1;
        }
        std::env::var(ENCODE_THREADS_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .map_or(DEFAULT_ENCODE_THREADS, |n| n.clamp(1, 16))
    }
}

/// Encoder threads by default: one. Encoding is memory-bound; two threads on the same cores cost
/// 25-30% more CPU for the same bytes, which lengthens the barrier whenever the subtasks of a
/// machine have no idle CPU (4 subtasks on 2 vCPUs in `keyshift bench rescale`: savepoint step
/// 4.2-4.6 s with one thread, 5.5-6.1 s with two). A worker with CPUs to spare (one subtask per
/// multi-CPU pod) can set `KEYSHIFT_ENCODE_THREADS`.
pub const DEFAULT_ENCODE_THREADS: usize = 1;

/// What [`write_state`] wrote.
#[derive(Debug)]
pub struct StateWritten {
    /// The durable state file, to acknowledge to the coordinator.
    pub snapshot: SubtaskSnapshot,
    /// Entries of every owned group, in group order.
    pub keys_per_group: Vec<u64>,
    /// The drained result lines with [`Updates::Keep`] (empty otherwise), in group order.
    pub lines: Vec<u8>,
    /// Result rows drained (written to stdout or in `lines`).
    pub rows: u64,
}

/// Why writing the state failed.
#[derive(Debug, thiserror::Error)]
pub enum StateWriteError {
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    #[error("a state encoder thread panicked")]
    EncoderPanicked,
    #[error("the state writer task failed: {0}")]
    WriterTask(String),
}

/// A failed [`write_state`]: the error, and the result lines drained before it (with
/// [`Updates::Keep`]; with [`Updates::Log`] they were written to stdout).
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct StateWriteFailed {
    /// What failed.
    #[source]
    pub error: StateWriteError,
    /// Drained lines the caller must keep (their change marks are cleared).
    pub lines: Vec<u8>,
    /// Rows in `lines`, or written to stdout.
    pub rows: u64,
}

/// A subtask's state taken at a barrier ([`take_cut`]): each group as the barrier left it (the
/// entries of a whole group or of a delta copied out, to be encoded by [`upload_cut`]; nothing
/// for an unchanged group), so that records flow again while [`upload_cut`] encodes and writes
/// it. The deltas whose changed keys are known may still be being copied after the barrier
/// ([`KeyedAggregator::begin_capture`]): [`finish_cut`] adds them.
#[derive(Debug)]
pub struct Cut {
    /// Every owned group, in group order (once [`finish_cut`] added the deltas still being
    /// copied).
    pub groups: Vec<CutGroup>,
    /// How the blocks are encoded (what compacts a chain of them).
    pub codec: Codec,
    /// The drained result lines with [`Updates::Keep`] (empty otherwise).
    pub lines: Vec<u8>,
    /// Result rows drained (written to stdout or in `lines`).
    pub rows: u64,
    /// Whether some deltas are still being copied ([`finish_cut`] completes them).
    pub capturing: bool,
    /// A program's operator state, encoded at the barrier (written after the groups).
    pub operator_state: Option<OperatorSection>,
    updates: Updates,
}

/// What [`upload_cut`] writes of a [`Cut`]: its groups, how they are encoded, and a program's
/// operator state.
#[derive(Debug)]
pub struct Upload {
    pub groups: Vec<CutGroup>,
    pub codec: Codec,
    pub operator_state: Option<OperatorSection>,
}

impl Cut {
    /// What [`upload_cut`] writes of the cut.
    pub fn into_upload(self) -> Upload {
        Upload {
            groups: self.groups,
            codec: self.codec,
            operator_state: self.operator_state,
        }
    }
}

/// A subtask's operator-state section ([`keyshift_sdk::operator_state`]), encoded at the
/// barrier: the state a program's step keeps per subtask, written whole with every snapshot.
#[derive(Debug, Clone)]
pub struct OperatorSection {
    /// The subtask that wrote it.
    pub subtask: u32,
    /// The parallelism of its run.
    pub parallelism: u32,
    pub bytes: Bytes,
}

/// One group of a [`Cut`]: the aggregation's entries copied out at the barrier (encoded by
/// [`upload_cut`]), or a program's block, encoded at the barrier.
#[derive(Debug)]
pub enum CutGroup {
    Frozen(FrozenGroup),
    Encoded(EncodedGroup),
}

impl CutGroup {
    /// The key group.
    pub fn group(&self) -> u32 {
        match self {
            CutGroup::Frozen(f) => f.group(),
            CutGroup::Encoded(e) => e.group,
        }
    }

    /// Keys in the group at the barrier.
    pub fn keys(&self) -> u64 {
        match self {
            CutGroup::Frozen(f) => f.keys(),
            CutGroup::Encoded(e) => e.keys,
        }
    }

    /// Entries copied out at the barrier, to be encoded later (none for a block encoded at
    /// the barrier).
    pub fn entries(&self) -> u64 {
        match self {
            CutGroup::Frozen(f) => f.entries(),
            CutGroup::Encoded(_) => 0,
        }
    }

    /// The group's block as of the barrier.
    pub fn encode(self) -> EncodedGroup {
        match self {
            CutGroup::Frozen(f) => f.encode(),
            CutGroup::Encoded(e) => e,
        }
    }
}

/// How a snapshot's blocks are encoded: what merges a group's chain into one block when a
/// checkpoint compacts it ([`Base::compacts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    /// The built-in aggregation's blocks ([`crate::job::state_codec`]).
    Aggregate,
    /// A program's blocks ([`keyshift_sdk::block`]).
    Program,
}

impl Codec {
    /// `first` and its `deltas` merged into one whole block of `group`: its bytes and entries.
    fn merge(self, group: u32, first: &Bytes, deltas: &[Bytes]) -> Result<(Vec<u8>, u64), String> {
        match self {
            Codec::Aggregate => {
                crate::job::state_codec::merge_chain(first, deltas).map_err(|e| e.to_string())
            }
            Codec::Program => block::compact(group, &block::chain(first, deltas))
                .map(|b| (b.bytes, b.entries))
                .map_err(|e| e.to_string()),
        }
    }
}

impl Cut {
    /// Keys of every owned group at the barrier, in group order (complete once
    /// [`finish_cut`] added the deltas still being copied).
    pub fn keys_per_group(&self) -> Vec<u64> {
        self.groups.iter().map(CutGroup::keys).collect()
    }

    /// Entries copied out to be encoded after the barrier.
    pub fn entries(&self) -> u64 {
        self.groups.iter().map(CutGroup::entries).sum()
    }
}

/// Takes a program's cut at a barrier: every owned group encoded as a checkpoint on top of
/// `base` writes it (or whole without one), on the calling thread. Its output is not part of
/// the cut: the program emits as it processes, and the caller stages what it emitted before
/// the barrier.
/// The cut of a program's step, `subtask` of a run of `parallelism`: every owned group encoded
/// (in full, as a delta over `base`, or not at all when unchanged) and its operator state.
pub fn take_program_cut(
    step: &mut ProgramStep,
    base: Option<&Base>,
    (subtask, parallelism): (u32, u32),
) -> Result<Cut, ProgramError> {
    let range = step.range();
    let mut groups = Vec::with_capacity(range.len() as usize);
    for g in range.iter() {
        let mode = base.map_or(GroupMode::Full, |b| b.mode(&*step, g));
        let EncodedBlock {
            bytes: block,
            entries,
        } = step.encode_group(g, mode)?.unwrap_or_default();
        groups.push(CutGroup::Encoded(EncodedGroup {
            group: g,
            block,
            entries,
            rows: 0,
            mode,
            keys: step.encoded_group_entries(g),
        }));
    }
    let operator_state = step
        .encode_operator_state(subtask, parallelism)
        .map(|bytes| OperatorSection {
            subtask,
            parallelism,
            bytes: Bytes::from(bytes),
        });
    Ok(Cut {
        groups,
        codec: Codec::Program,
        lines: Vec::new(),
        rows: 0,
        capturing: false,
        operator_state,
        updates: Updates::Skip,
    })
}

impl GroupModes for ProgramStep {
    fn group_mode(&self, group: u32, since: u32) -> GroupMode {
        ProgramStep::group_mode(self, group, since)
    }
}

/// Takes the consistent cut of a snapshot on the calling thread: freezes each owned group as a
/// checkpoint on top of `base` takes it, or whole without one (see [`crate::runtime::incremental`] and
/// [`GroupSnapshot::freeze`](crate::job::GroupSnapshot::freeze)) and drains the changed keys'
/// results as `updates` says. The entries are only copied (payloads shared), not encoded; and
/// with `after_barrier` (and no windows), a delta's changed keys are not even copied here, but
/// after the barrier while records flow ([`KeyedAggregator::begin_capture`], completed by
/// [`finish_cut`]): this is what a snapshot holds records up for. The encoding and the upload
/// ([`upload_cut`]) run after.
pub async fn take_cut(
    agg: &mut KeyedAggregator,
    base: Option<&Base>,
    updates: Updates,
    after_barrier: bool,
) -> Cut {
    // Each group on top of `base` (Base::mode), or whole without one.
    let range = agg.range();
    let modes: Vec<GroupMode> = range
        .iter()
        .map(|g| base.map_or(GroupMode::Full, |b| b.mode(agg, g)))
        .collect();
    // One capture at a time: a caller that did not finish the last cut gets this one whole.
    let after_barrier = after_barrier && agg.config().window_size_ms.is_none() && !agg.capturing();
    let mut lines = Lines::new(updates);
    let mut groups = Vec::with_capacity(agg.range().len() as usize);
    let mut deferred = Vec::new();
    for g in agg.snapshot_groups_as(|g| modes[(g - range.start) as usize]) {
        let g = match after_barrier {
            true => match g.defer() {
                Ok(d) => {
                    deferred.push(d);
                    continue;
                }
                Err(g) => g,
            },
            false => g,
        };
        let mut buf = lines.drains().then(Vec::new);
        let f = g.freeze(buf.as_mut());
        lines.add(buf.unwrap_or_default(), f.rows());
        groups.push(CutGroup::Frozen(f));
    }
    let capturing = !deferred.is_empty();
    if let Some(now) = agg.begin_capture(deferred, lines.drains()) {
        lines.add(now.lines, now.rows);
        groups.extend(now.groups.into_iter().map(CutGroup::Frozen));
        groups.sort_by_key(CutGroup::group);
    }
    let (lines, rows) = lines.finish().await;
    Cut {
        groups,
        codec: Codec::Aggregate,
        lines,
        rows,
        capturing: capturing && agg.capturing(),
        operator_state: None,
        updates,
    }
}

/// Completes a [`Cut`] whose deltas were still being copied after its barrier: finishes the
/// copy ([`KeyedAggregator::take_captured`]) and adds the groups; returns their result lines
/// (with [`Updates::Keep`]; written to stdout with [`Updates::Log`]) and rows, which belong to
/// the cut's snapshot. Nothing to do (empty lines) for a cut taken whole at its barrier.
pub async fn finish_cut(agg: &mut KeyedAggregator, cut: &mut Cut) -> (Vec<u8>, u64) {
    if !std::mem::take(&mut cut.capturing) {
        return (Vec::new(), 0);
    }
    let Some(captured) = agg.take_captured() else {
        return (Vec::new(), 0);
    };
    cut.groups
        .extend(captured.groups.into_iter().map(CutGroup::Frozen));
    cut.groups.sort_by_key(CutGroup::group);
    let mut lines = Lines::new(cut.updates);
    lines.add(captured.lines, captured.rows);
    let (lines, rows) = lines.finish().await;
    cut.rows += rows;
    (lines, rows)
}

/// Encodes the groups of a [`Cut`] and writes them through `writer`, on top of `base` (the
/// checkpoint the cut's modes were taken against; `None` for a cut of whole groups), then
/// finishes the file: durable when this returns. A delta of a group that `base` says to compact
/// ([`Base::compacts`]) is merged here with the group's chain, read back from `store` (`dir` is
/// the new snapshot's directory), and written as the whole group.
pub async fn upload_cut(
    Upload {
        groups,
        codec,
        operator_state,
    }: Upload,
    mut writer: SnapshotWriter,
    base: Option<&Base>,
    policy: CutPolicy,
    store: &dyn ObjectStore,
    dir: &Path,
) -> Result<SubtaskSnapshot, SnapshotError> {
    for g in groups {
        let r = write_cut_group(g.encode(), codec, &mut writer, base, policy, store, dir).await;
        if let Err(err) = r {
            let _ = writer.abort().await;
            return Err(err);
        }
    }
    if let Some(o) = operator_state
        && let Err(err) = writer
            .write_operator_state(o.subtask, o.parallelism, o.bytes)
            .await
    {
        let _ = writer.abort().await;
        return Err(err);
    }
    writer.finish().await
}

async fn write_cut_group(
    e: EncodedGroup,
    codec: Codec,
    writer: &mut SnapshotWriter,
    base: Option<&Base>,
    policy: CutPolicy,
    store: &dyn ObjectStore,
    dir: &Path,
) -> Result<(), SnapshotError> {
    let base = || {
        base.ok_or_else(|| {
            SnapshotError::Assemble(format!(
                "key group {} was cut as a delta or unchanged, but the snapshot builds on none",
                e.group
            ))
        })
    };
    let prior = || {
        base()?.groups.get(&e.group).cloned().ok_or_else(|| {
            SnapshotError::Assemble(format!(
                "key group {} is not in the checkpoint this one builds on",
                e.group
            ))
        })
    };
    match e.mode {
        GroupMode::Full => {
            writer
                .write_group(e.group, Bytes::from(e.block), e.entries)
                .await
        }
        GroupMode::Delta { .. } if base()?.compacts(e.group, policy) => {
            let prior = prior()?;
            let (first, mut deltas) = snapshot::read_chain(store, dir, &prior).await?;
            deltas.push(Bytes::from(e.block));
            let (merged, entries) = codec.merge(e.group, &first, &deltas).map_err(|reason| {
                SnapshotError::ChainUnreadable {
                    path: snapshot::file_path(dir, &prior.file).to_string(),
                    group: e.group,
                    reason,
                }
            })?;
            writer
                .write_group(e.group, Bytes::from(merged), entries)
                .await
        }
        GroupMode::Delta { .. } => {
            writer
                .write_on(
                    prior()?,
                    Some((Bytes::from(e.block), e.entries)),
                    e.keys,
                    &base()?.files,
                )
                .await
        }
        GroupMode::Unchanged => {
            writer
                .write_on(prior()?, None, e.keys, &base()?.files)
                .await
        }
    }
}

/// Groups an encoder may run ahead of the writer, per encoder thread.
const AHEAD_PER_THREAD: usize = 2;

/// Encodes and writes every owned group of `agg` through `writer` (then `finish`: the file is
/// durable when this returns), draining the changed keys' results as `opts.updates` says.
/// Blocks written before a failure are abandoned with the writer.
pub async fn write_state(
    agg: &mut KeyedAggregator,
    writer: SnapshotWriter,
    opts: StateWriteOptions,
) -> Result<StateWritten, Box<StateWriteFailed>> {
    let groups = agg.snapshot_groups();
    let multi_thread = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    let threads = opts.threads.clamp(1, groups.len().max(1));
    let mut lines = Lines::new(opts.updates);
    let written = if threads > 1 && multi_thread {
        parallel(groups, writer, threads, &mut lines).await
    } else {
        sequential(groups, writer, &mut lines).await
    };
    let (kept, rows) = lines.finish().await;
    match written {
        Ok((snapshot, keys_per_group)) => Ok(StateWritten {
            snapshot,
            keys_per_group,
            lines: kept,
            rows,
        }),
        Err(error) => Err(Box::new(StateWriteFailed {
            error,
            lines: kept,
            rows,
        })),
    }
}

/// Encodes one group between writes, on the calling thread.
async fn sequential(
    groups: Vec<GroupSnapshot<'_>>,
    mut writer: SnapshotWriter,
    lines: &mut Lines,
) -> Result<(SubtaskSnapshot, Vec<u64>), StateWriteError> {
    let mut keys_per_group = Vec::with_capacity(groups.len());
    for g in groups {
        let mut buf = lines.drains().then(Vec::new);
        let e = g.encode(buf.as_mut());
        lines.add(buf.unwrap_or_default(), e.rows);
        keys_per_group.push(e.entries);
        if let Err(err) = writer
            .write_group(e.group, Bytes::from(e.block), e.entries)
            .await
        {
            let _ = writer.abort().await;
            return Err(err.into());
        }
    }
    Ok((writer.finish().await?, keys_per_group))
}

/// A finished group on its way to the writer.
struct Encoded {
    index: usize,
    group: EncodedGroup,
    lines: Vec<u8>,
}

/// How far the writer got, so that encoders do not run too far ahead; and whether to stop.
struct Progress {
    state: Mutex<(usize, bool)>,
    changed: Condvar,
}

impl Progress {
    fn new() -> Self {
        Progress {
            state: Mutex::new((0, false)),
            changed: Condvar::new(),
        }
    }

    /// Waits until group `index` may be encoded (fewer than `ahead` groups past the last one
    /// written); false once the write was abandoned.
    fn wait_turn(&self, index: usize, ahead: usize) -> bool {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        while !st.1 && index >= st.0 + ahead {
            st = self
                .changed
                .wait(st)
                .unwrap_or_else(PoisonError::into_inner);
        }
        !st.1
    }

    fn advance(&self) {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).0 += 1;
        self.changed.notify_all();
    }

    fn abandon(&self) {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).1 = true;
        self.changed.notify_all();
    }
}

/// Abandons the write if an encoder unwinds, so that no other encoder waits for its group.
struct AbandonOnPanic<'a>(&'a Progress);

impl Drop for AbandonOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.abandon();
        }
    }
}

/// Abandons the write when the writer task ends, however it ends (a panic included), so that
/// no encoder waits for it forever.
struct AbandonOnExit(Arc<Progress>);

impl Drop for AbandonOnExit {
    fn drop(&mut self) {
        self.0.abandon();
    }
}

/// Claims groups in order and encodes them until none is left or the write is abandoned.
fn encode_loop(
    slots: &[Mutex<Option<GroupSnapshot<'_>>>],
    next: &AtomicUsize,
    progress: &Progress,
    ahead: usize,
    drain: bool,
    tx: mpsc::Sender<Encoded>,
) {
    let _guard = AbandonOnPanic(progress);
    loop {
        let index = next.fetch_add(1, Ordering::Relaxed);
        let Some(slot) = slots.get(index) else {
            return;
        };
        if !progress.wait_turn(index, ahead) {
            return;
        }
        let Some(g) = slot.lock().unwrap_or_else(PoisonError::into_inner).take() else {
            return;
        };
        let mut lines = if drain {
            Vec::with_capacity(g.len() * 32)
        } else {
            Vec::new()
        };
        let group = g.encode(drain.then_some(&mut lines));
        // The writer receives until every encoder is done, so a send fails only if it is gone.
        if tx
            .blocking_send(Encoded {
                index,
                group,
                lines,
            })
            .is_err()
        {
            return;
        }
    }
}

/// Encodes on `threads` threads (this one included) while a runtime task writes in order.
async fn parallel(
    groups: Vec<GroupSnapshot<'_>>,
    writer: SnapshotWriter,
    threads: usize,
    lines: &mut Lines,
) -> Result<(SubtaskSnapshot, Vec<u64>), StateWriteError> {
    let n = groups.len();
    let ahead = threads * AHEAD_PER_THREAD;
    let drain = lines.drains();
    let (tx, rx) = mpsc::channel::<Encoded>(ahead);
    let progress = Arc::new(Progress::new());
    let task = tokio::spawn(write_in_order(writer, rx, progress.clone(), n));
    let slots: Vec<Mutex<Option<GroupSnapshot<'_>>>> =
        groups.into_iter().map(|g| Mutex::new(Some(g))).collect();
    let next = AtomicUsize::new(0);
    let (slots, next, progress_ref) = (&slots, &next, &*progress);
    // The encoders block (on the writer's progress and the channel): take this thread out of
    // the runtime while they run, so its other tasks (the writer among them) keep going.
    let panicked = tokio::task::block_in_place(move || {
        std::thread::scope(|s| {
            let mut helpers = Vec::with_capacity(threads - 1);
            for i in 1..threads {
                let tx = tx.clone();
                let spawned = std::thread::Builder::new()
                    .name(format!("state-encoder-{i}"))
                    .spawn_scoped(s, move || {
                        encode_loop(slots, next, progress_ref, ahead, drain, tx)
                    });
                match spawned {
                    Ok(h) => helpers.push(h),
                    // Fewer helpers only means slower: this thread encodes whatever is left.
                    Err(e) => tracing::warn!(error = %e, "starting a state encoder thread"),
                }
            }
            let mine = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                encode_loop(slots, next, progress_ref, ahead, drain, tx)
            }));
            let mut panicked = mine.is_err();
            for h in helpers {
                panicked |= h.join().is_err();
            }
            panicked
        })
    });
    let written = task
        .await
        .map_err(|e| StateWriteError::WriterTask(e.to_string()))?;
    for e in written.encoded {
        lines.add(e.lines, e.group.rows);
    }
    if panicked {
        return Err(StateWriteError::EncoderPanicked);
    }
    Ok((written.result?, written.keys_per_group))
}

/// What the writer task did: the state file (or why not), and every group it received, in
/// group order, for the caller to collect their result lines.
struct InOrder {
    result: Result<SubtaskSnapshot, StateWriteError>,
    keys_per_group: Vec<u64>,
    encoded: Vec<Encoded>,
}

/// Receives encoded groups in any order and writes them in group order; after a failure it
/// stops the encoders and keeps receiving (their lines must not be lost) until they are done.
async fn write_in_order(
    mut writer: SnapshotWriter,
    mut rx: mpsc::Receiver<Encoded>,
    progress: Arc<Progress>,
    n: usize,
) -> InOrder {
    let _abandon = AbandonOnExit(progress.clone());
    let mut pending: BTreeMap<usize, Encoded> = BTreeMap::new();
    let mut done: Vec<Encoded> = Vec::with_capacity(n);
    let mut keys_per_group = Vec::with_capacity(n);
    let mut failed: Option<SnapshotError> = None;
    while let Some(mut e) = rx.recv().await {
        if failed.is_some() {
            pending.insert(e.index, e);
            continue;
        }
        if e.index != done.len() {
            pending.insert(e.index, e);
            continue;
        }
        loop {
            let block = Bytes::from(std::mem::take(&mut e.group.block));
            keys_per_group.push(e.group.entries);
            let r = writer
                .write_group(e.group.group, block, e.group.entries)
                .await;
            done.push(e);
            if let Err(err) = r {
                failed = Some(err);
                progress.abandon();
                break;
            }
            progress.advance();
            match pending.remove(&done.len()) {
                Some(p) => e = p,
                None => break,
            }
        }
    }
    done.extend(pending.into_values());
    let result = match failed {
        Some(err) => {
            let _ = writer.abort().await;
            Err(err.into())
        }
        // Every encoder is done; a group missing means one of them panicked.
        None if done.len() < n => {
            let _ = writer.abort().await;
            Err(StateWriteError::EncoderPanicked)
        }
        None => writer.finish().await.map_err(StateWriteError::from),
    };
    InOrder {
        result,
        keys_per_group,
        encoded: done,
    }
}

/// Where drained result lines go: kept, or to stdout through a helper thread (started with the
/// first line), which [`Lines::finish`] waits for.
struct Lines {
    updates: Updates,
    kept: Vec<u8>,
    rows: u64,
    log: Option<StdoutThread>,
}

struct StdoutThread {
    tx: std::sync::mpsc::Sender<Vec<u8>>,
    done: oneshot::Receiver<()>,
}

impl Lines {
    fn new(updates: Updates) -> Self {
        Lines {
            updates,
            kept: Vec::new(),
            rows: 0,
            log: None,
        }
    }

    fn drains(&self) -> bool {
        self.updates != Updates::Skip
    }

    fn add(&mut self, chunk: Vec<u8>, rows: u64) {
        self.rows += rows;
        if chunk.is_empty() {
            return;
        }
        match self.updates {
            Updates::Skip => {}
            Updates::Keep => {
                if self.kept.is_empty() {
                    self.kept = chunk;
                } else {
                    self.kept.extend_from_slice(&chunk);
                }
            }
            Updates::Log => {
                if self.log.is_none() {
                    self.log = StdoutThread::start();
                }
                let unsent = match &self.log {
                    Some(t) => t.tx.send(chunk).err().map(|e| e.0),
                    None => Some(chunk),
                };
                // No helper thread: write here.
                if let Some(chunk) = unsent {
                    let mut out = std::io::stdout().lock();
                    let _ = out.write_all(&chunk);
                    let _ = out.flush();
                }
            }
        }
    }

    /// Waits until every line is on stdout; returns the kept lines and the row count.
    async fn finish(self) -> (Vec<u8>, u64) {
        if let Some(t) = self.log {
            drop(t.tx);
            let _ = t.done.await;
        }
        (self.kept, self.rows)
    }
}

impl StdoutThread {
    fn start() -> Option<Self> {
        let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
        let (done_tx, done) = oneshot::channel();
        let spawned = std::thread::Builder::new()
            .name("log-sink".into())
            .spawn(move || {
                {
                    let mut out = std::io::stdout().lock();
                    for chunk in rx {
                        // Like the rest of the log sink: a closed stdout loses lines, nothing
                        // else.
                        let _ = out.write_all(&chunk);
                    }
                    let _ = out.flush();
                }
                let _ = done_tx.send(());
            });
        match spawned {
            Ok(_) => Some(StdoutThread { tx, done }),
            Err(e) => {
                tracing::warn!(error = %e, "starting the log sink thread; writing inline");
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::{AggConfig, Record, RecordKey};
    use crate::runtime::restore::{RestoreError, RestoreOptions, restore_state};
    use crate::snapshot::{self, JobIdentity, Manifest, SnapshotKind, SnapshotMeta};
    use keyshift_core::keygroup::{Assignment, KeyGroupRange};
    use keyshift_core::spec::AggregateFunction;
    use object_store::ObjectStoreExt;

    const MAXP: u32 = 128;

    fn config(window: Option<i64>) -> AggConfig {
        AggConfig {
            function: AggregateFunction::Sum,
            window_size_ms: window,
            max_parallelism: MAXP,
            state_payload_bytes: 24,
        }
    }

    /// Subtask `i` of `p`, with every third key changed since the last drain.
    fn state(p: u32, i: u32, window: Option<i64>) -> KeyedAggregator {
        let assignment = Assignment::new(i64::from(p), i64::from(MAXP)).unwrap();
        let range = assignment.range(i);
        let mut op = KeyedAggregator::new(config(window), range).unwrap();
        let keys: Vec<RecordKey> = (0..3000)
            .map(|k| {
                if k % 2 == 0 {
                    RecordKey::string(format!("key-{k}"))
                } else {
                    RecordKey::long(k)
                }
            })
            .filter(|k| range.contains(k.key_group(MAXP)))
            .collect();
        for (n, k) in keys.iter().enumerate() {
            op.process(&Record {
                key: k.clone(),
                value: n as i64,
                ts: (n as i64 % 5) * 3_000,
            })
            .unwrap();
        }
        let _ = op.drain_updates();
        for k in keys.iter().step_by(3) {
            op.process(&Record {
                key: k.clone(),
                value: 7,
                ts: 1_000,
            })
            .unwrap();
        }
        op
    }

    fn store(name: &str) -> (Arc<dyn snapshot::ObjectStore>, snapshot::Path) {
        let (store, base) = snapshot::open_store(&format!("memory://checkpoint-{name}")).unwrap();
        (
            store,
            snapshot::snapshot_dir(&base, SnapshotKind::Checkpoint, 1),
        )
    }

    fn writer(
        store: &Arc<dyn snapshot::ObjectStore>,
        dir: &snapshot::Path,
        p: u32,
        i: u32,
    ) -> SnapshotWriter {
        let assignment = Assignment::new(i64::from(p), i64::from(MAXP)).unwrap();
        // Small parts: the multipart path is exercised too.
        SnapshotWriter::new(store.clone(), dir, assignment, i)
            .unwrap()
            .with_parts(16 * 1024, 2)
    }

    fn opts(threads: usize, updates: Updates) -> StateWriteOptions {
        StateWriteOptions { threads, updates }
    }

    /// Keys of the JSON lines, with their groups in line order.
    fn line_keys(lines: &[u8]) -> Vec<(String, u32)> {
        lines
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| {
                let v: serde_json::Value = serde_json::from_slice(l).unwrap();
                let key = match &v["key"] {
                    serde_json::Value::String(s) => RecordKey::string(s.as_str()),
                    n => RecordKey::long(n.as_i64().unwrap()),
                };
                (key.to_string(), key.key_group(MAXP))
            })
            .collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn parallel_and_sequential_writes_are_identical() {
        for window in [None, Some(10_000)] {
            let mut results = Vec::new();
            for threads in [1, 3] {
                let (store, dir) = store(&format!("same-{window:?}-{threads}"));
                let mut op = state(2, 1, window);
                let w = write_state(
                    &mut op,
                    writer(&store, &dir, 2, 1),
                    opts(threads, Updates::Skip),
                )
                .await
                .unwrap();
                assert_eq!((w.rows, w.lines.len()), (0, 0));
                assert_eq!(w.keys_per_group.len(), op.range().len() as usize);
                let file = store
                    .get(&dir.clone().join(w.snapshot.file.name.as_str()))
                    .await
                    .unwrap()
                    .bytes()
                    .await
                    .unwrap();
                results.push((w.snapshot, w.keys_per_group, file));
            }
            assert_eq!(results[0], results[1], "window {window:?}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn drained_lines_are_the_changed_keys_in_group_order() {
        for threads in [1, 4] {
            let mut reference = state(1, 0, None);
            let mut expected: Vec<String> = reference
                .drain_updates()
                .iter()
                .map(|r| r.key.to_string())
                .collect();
            let (store, dir) = store(&format!("lines-{threads}"));
            let mut op = state(1, 0, None);
            let w = write_state(
                &mut op,
                writer(&store, &dir, 1, 0),
                opts(threads, Updates::Keep),
            )
            .await
            .unwrap();
            let got = line_keys(&w.lines);
            assert_eq!(w.rows as usize, got.len());
            assert!(
                got.windows(2).all(|p| p[0].1 <= p[1].1),
                "lines come in group order"
            );
            let mut got: Vec<String> = got.into_iter().map(|(k, _)| k).collect();
            got.sort();
            expected.sort();
            assert_eq!(got, expected);
            assert!(op.drain_updates().is_empty());
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_write_hands_back_every_drained_line() {
        for threads in [1, 3] {
            let changed = state(2, 1, None).drain_updates().len();
            let (store, dir) = store(&format!("failed-{threads}"));
            // The writer is for subtask 0: the operator's first group is outside its range.
            let mut op = state(2, 1, None);
            let failed = write_state(
                &mut op,
                writer(&store, &dir, 2, 0),
                opts(threads, Updates::Keep),
            )
            .await
            .unwrap_err();
            assert!(
                matches!(failed.error, StateWriteError::Snapshot(_)),
                "{}",
                failed.error
            );
            let handed_back = line_keys(&failed.lines).len();
            assert_eq!(failed.rows as usize, handed_back);
            // Every changed key is either handed back or still marked changed.
            assert_eq!(
                handed_back + op.drain_updates().len(),
                changed,
                "threads {threads}"
            );
        }
    }

    #[tokio::test]
    async fn a_current_thread_runtime_encodes_on_one_thread() {
        let (store, dir) = store("current-thread");
        let mut op = state(1, 0, None);
        let w = write_state(&mut op, writer(&store, &dir, 1, 0), opts(4, Updates::Keep))
            .await
            .unwrap();
        assert_eq!(w.rows as usize, line_keys(&w.lines).len());
        assert!(w.rows > 0);
    }

    fn meta() -> SnapshotMeta {
        SnapshotMeta {
            job: JobIdentity {
                namespace: "test".into(),
                name: "checkpoint".into(),
                job_fingerprint: "test".into(),
                layout: None,
            },
            snapshot_id: 1,
            kind: SnapshotKind::Checkpoint,
            completed_at: jiff::Timestamp::now(),
            state_schema: crate::job::AGG_SCHEMA.into(),
            source_positions: Default::default(),
            source_partitions: Default::default(),
            watermark: None,
        }
    }

    /// Writes a snapshot of the state at parallelism 2 and commits it.
    async fn committed(
        name: &str,
        window: Option<i64>,
    ) -> (
        Arc<dyn snapshot::ObjectStore>,
        snapshot::Path,
        Manifest,
        Vec<KeyedAggregator>,
    ) {
        let (store, dir) = store(name);
        let mut acks = Vec::new();
        let mut ops = Vec::new();
        for i in 0..2 {
            let mut op = state(2, i, window);
            let w = write_state(&mut op, writer(&store, &dir, 2, i), opts(2, Updates::Skip))
                .await
                .unwrap();
            acks.push(w.snapshot);
            ops.push(op);
        }
        let assignment = Assignment::new(2, i64::from(MAXP)).unwrap();
        let manifest = Manifest::assemble(meta(), assignment, acks).unwrap();
        snapshot::commit_manifest(store.as_ref(), &dir, &manifest)
            .await
            .unwrap();
        (store, dir, manifest, ops)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn restore_reads_decodes_and_installs_exactly_the_range() {
        for window in [None, Some(10_000)] {
            let name = format!("restore-{window:?}");
            let (store, dir, manifest, ops) = committed(&name, window).await;
            // At parallelism 3 the middle subtask's groups straddle both old files.
            let new = Assignment::new(3, i64::from(MAXP)).unwrap();
            let range = new.range(1);
            let mut op = KeyedAggregator::new(config(window), range).unwrap();
            let tiny = RestoreOptions {
                request_bytes: 1024,
                reads_ahead: 3,
                decoders: 2,
            };
            let r = restore_state(&mut op, store.as_ref(), &dir, &manifest, tiny)
                .await
                .unwrap();
            assert_eq!(r.groups, range.len());
            assert_eq!(r.bytes_read, manifest.bytes_in(range));
            assert_eq!(r.keys as usize, op.key_count());
            for g in range.iter() {
                let old = &ops[usize::from(g >= 64)];
                let mut a = old.group_entries(g);
                let mut b = op.group_entries(g);
                a.sort_by(|x, y| x.0.cmp(&y.0));
                b.sort_by(|x, y| x.0.cmp(&y.0));
                assert_eq!(a, b, "group {g}");
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_corrupt_block_restores_nothing() {
        let (store, dir, manifest, _) = committed("corrupt", None).await;
        // Flip a byte in the last block of the second file.
        let file = dir.clone().join(manifest.files[1].name.as_str());
        let mut bytes = store
            .get(&file)
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap()
            .to_vec();
        let last = bytes.len() - 10;
        bytes[last] ^= 0x40;
        store.put(&file, bytes.into()).await.unwrap();
        let range = KeyGroupRange { start: 0, end: 127 };
        let mut op = KeyedAggregator::new(config(None), range).unwrap();
        let small = RestoreOptions {
            request_bytes: 4096,
            ..RestoreOptions::default()
        };
        let err = restore_state(&mut op, store.as_ref(), &dir, &manifest, small)
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                RestoreError::Snapshot(snapshot::SnapshotError::BlockChecksum { group: 127, .. })
            ),
            "{err}"
        );
        assert_eq!(op.key_count(), 0, "nothing is installed");
    }
}
