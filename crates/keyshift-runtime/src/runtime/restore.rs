//! Restoring a subtask's keyed state from a snapshot.
//!
//! [`restore_state`] reads exactly the subtask's key groups ([`snapshot::read_groups_stream`]:
//! range reads of at most a few MiB, a couple ahead), and decodes each piece on a blocking
//! thread while the next ones are read. Nothing reaches the operator until every block has been
//! read, its length and checksum checked against the manifest, and decoded: only then are the
//! decoded groups installed, so a failed restore leaves the operator as it was.

use crate::job::{
    AggregateError, DecodedGroupState, Keyed, KeyedAggregator, ProgramError, ProgramStep,
};
use crate::snapshot::{self, Manifest, ObjectStore, Path, SnapshotError};
use futures::StreamExt;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Why a restore failed.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    #[error(transparent)]
    Aggregate(#[from] AggregateError),
    #[error("decoding restored state: {0}")]
    Decoder(String),
    #[error(transparent)]
    Program(#[from] ProgramError),
}

impl RestoreError {
    /// Whether the snapshot's state does not fit the job's program (a changed declaration, a
    /// rescale its operator state refuses): no retry from any snapshot of it can succeed.
    pub fn refuses_the_job(&self) -> bool {
        matches!(self, RestoreError::Program(p) if p.refuses_the_job())
    }
}

/// What [`restore_state`] restored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Restored {
    /// Key groups of the range that the snapshot holds (empty ones included).
    pub groups: u32,
    /// Keys restored.
    pub keys: u64,
    /// Bytes fetched: exactly the blocks of the range.
    pub bytes_read: u64,
}

/// How [`restore_state`] reads.
#[derive(Debug, Clone, Copy)]
pub struct RestoreOptions {
    /// Upper bound of one range request (whole blocks).
    pub request_bytes: u64,
    /// Requests fetched ahead of decoding.
    pub reads_ahead: usize,
    /// Pieces decoded at once (each on a blocking thread).
    pub decoders: usize,
}

impl Default for RestoreOptions {
    fn default() -> Self {
        RestoreOptions {
            request_bytes: snapshot::STREAM_REQUEST_BYTES,
            reads_ahead: 2,
            decoders: std::thread::available_parallelism().map_or(1, |n| n.get().clamp(1, 4)),
        }
    }
}

/// Live counters of a running restore ([`restore_state_reporting`]): bytes fetched and key
/// groups read so far (read and checksummed; installed only once all are).
#[derive(Debug, Default)]
pub struct Progress {
    bytes_read: AtomicU64,
    groups_read: AtomicU32,
}

impl Progress {
    /// Bytes fetched so far.
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::Relaxed)
    }

    /// Key groups read so far.
    pub fn groups_read(&self) -> u32 {
        self.groups_read.load(Ordering::Relaxed)
    }

    /// Counts `bytes` and `groups` read (a restore that reads otherwise, e.g. a pre-staged
    /// worker's delta, [`super::prestage::apply`]).
    pub fn add(&self, bytes: u64, groups: u32) {
        self.bytes_read.fetch_add(bytes, Ordering::Relaxed);
        self.groups_read.fetch_add(groups, Ordering::Relaxed);
    }
}

/// What a restore of `range` from `manifest` reads in all: (bytes, key groups the snapshot
/// holds).
pub fn restore_totals(
    manifest: &Manifest,
    range: keyshift_core::keygroup::KeyGroupRange,
) -> (u64, u32) {
    range
        .iter()
        .filter_map(|g| manifest.group(g))
        .fold((0, 0), |(b, n), e| (b + e.stored_bytes(), n + 1))
}

type Decoding = tokio::task::JoinHandle<Result<Vec<DecodedGroupState>, AggregateError>>;

/// Restores the key groups of `agg`'s range from the snapshot in `dir` (described by
/// `manifest`, whose state schema the caller has checked): see the module docs.
pub async fn restore_state(
    agg: &mut KeyedAggregator,
    store: &dyn ObjectStore,
    dir: &Path,
    manifest: &Manifest,
    opts: RestoreOptions,
) -> Result<Restored, RestoreError> {
    restore_state_reporting(agg, store, dir, manifest, opts, None).await
}

/// The pieces of `range` as [`snapshot::read_groups_stream`] reads them, and the count a
/// restore of them starts from (the range's groups in the snapshot, nothing read yet; each piece
/// is counted with [`Restored::count`]).
fn read_range<'a>(
    store: &'a dyn ObjectStore,
    dir: &'a Path,
    manifest: &'a Manifest,
    range: keyshift_core::keygroup::KeyGroupRange,
    opts: RestoreOptions,
) -> Result<
    (
        Restored,
        impl futures::Stream<Item = Result<snapshot::RestoredChunk, SnapshotError>> + 'a,
    ),
    RestoreError,
> {
    let out = Restored {
        groups: range
            .iter()
            .filter(|g| manifest.group(*g).is_some())
            .count() as u32,
        ..Restored::default()
    };
    let pieces = snapshot::read_groups_stream(
        store,
        dir,
        manifest,
        range,
        opts.request_bytes,
        opts.reads_ahead,
    )?;
    Ok((out, pieces))
}

impl Restored {
    /// Counts `piece` as read (here and in `progress`), and hands it back.
    fn count(
        &mut self,
        piece: snapshot::RestoredChunk,
        progress: Option<&Progress>,
    ) -> snapshot::RestoredChunk {
        self.bytes_read += piece.bytes_read;
        if let Some(p) = progress {
            p.bytes_read.fetch_add(piece.bytes_read, Ordering::Relaxed);
            p.groups_read
                .fetch_add(piece.groups.len() as u32, Ordering::Relaxed);
        }
        piece
    }
}

/// Restores the key groups of `keyed`'s range from the snapshot in `dir`, whichever logic it
/// runs: the aggregation's as [`restore_state_reporting`] does; a program's once every block of
/// the range has been read and checked against the manifest, each group's chain checked again
/// by the program's step before it replaces the group. On an error the caller drops `keyed`
/// (groups before the failing one may be installed).
pub async fn restore_keyed(
    keyed: &mut Keyed,
    store: &dyn ObjectStore,
    dir: &Path,
    manifest: &Manifest,
    opts: RestoreOptions,
    progress: Option<&Progress>,
) -> Result<Restored, RestoreError> {
    match keyed {
        Keyed::Aggregate(agg) => {
            restore_state_reporting(agg, store, dir, manifest, opts, progress).await
        }
        Keyed::Program(step) => restore_program(step, store, dir, manifest, opts, progress).await,
    }
}

async fn restore_program(
    step: &mut ProgramStep,
    store: &dyn ObjectStore,
    dir: &Path,
    manifest: &Manifest,
    opts: RestoreOptions,
    progress: Option<&Progress>,
) -> Result<Restored, RestoreError> {
    let (mut out, pieces) = read_range(store, dir, manifest, step.range(), opts)?;
    let mut pieces = std::pin::pin!(pieces);
    let mut groups = Vec::new();
    while let Some(piece) = pieces.next().await {
        groups.extend(out.count(piece?, progress).groups);
    }
    let before = step.counted_entries();
    for g in groups {
        step.restore_group(g.group, &keyshift_sdk::block::chain(&g.bytes, &g.deltas))?;
    }
    out.keys = step.counted_entries().saturating_sub(before) as u64;
    Ok(out)
}

/// Gives `keyed` (a program's step; the aggregation keeps no operator state) its share of the
/// operator state of the snapshot in `dir`, as `subtask` of `parallelism`: every section is
/// read and checked before the step takes any ([`ProgramStep::restore_operator_state`]). A
/// snapshot without sections leaves the step's operator state empty.
pub async fn restore_operator_state(
    keyed: &mut Keyed,
    store: &dyn ObjectStore,
    dir: &Path,
    manifest: &Manifest,
    (subtask, parallelism): (u32, u32),
) -> Result<(), RestoreError> {
    let Keyed::Program(step) = keyed else {
        return Ok(());
    };
    let sections = crate::snapshot::read_operator_state(store, dir, manifest).await?;
    let sections: Vec<&[u8]> = sections.iter().map(|b| b.as_ref()).collect();
    step.restore_operator_state(&sections, subtask, parallelism)?;
    Ok(())
}

/// [`restore_state`], counting what it has read so far into `progress`.
pub async fn restore_state_reporting(
    agg: &mut KeyedAggregator,
    store: &dyn ObjectStore,
    dir: &Path,
    manifest: &Manifest,
    opts: RestoreOptions,
    progress: Option<&Progress>,
) -> Result<Restored, RestoreError> {
    let (mut out, pieces) = read_range(store, dir, manifest, agg.range(), opts)?;
    let mut pieces = std::pin::pin!(pieces);
    let decoder = agg.decoder();
    let mut decoding: VecDeque<Decoding> = VecDeque::new();
    let mut decoded: Vec<DecodedGroupState> = Vec::new();
    let result: Result<(), RestoreError> = async {
        while let Some(piece) = pieces.next().await {
            let piece = out.count(piece?, progress);
            if decoding.len() >= opts.decoders.max(1)
                && let Some(oldest) = decoding.pop_front()
            {
                decoded.extend(join(oldest).await?);
            }
            decoding.push_back(tokio::task::spawn_blocking(move || {
                piece
                    .groups
                    .iter()
                    .map(|g| decoder.decode_chain(g.group, &g.bytes, &g.deltas))
                    .collect()
            }));
        }
        while let Some(d) = decoding.pop_front() {
            decoded.extend(join(d).await?);
        }
        Ok(())
    }
    .await;
    // On failure, decodes still in progress finish on their own; nothing of them is used.
    result?;
    for state in decoded {
        out.keys += state.len() as u64;
        agg.install_group(state)?;
    }
    Ok(out)
}

async fn join(d: Decoding) -> Result<Vec<DecodedGroupState>, RestoreError> {
    d.await
        .map_err(|e| RestoreError::Decoder(e.to_string()))?
        .map_err(RestoreError::from)
}
