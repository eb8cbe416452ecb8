//! `keyshift savepoint rewrite`: re-hash a snapshot's keys into a new key-group count.
//!
//! # Algorithm (external bucketing, two passes, bounded memory)
//!
//! A key's new group is `murmur(hashCode(key)) % G'` (Flink's formula, [`keyshift_core::keygroup`]), which
//! scatters the keys of every old group over all new groups, so the new blocks cannot be built in
//! one streaming pass. Instead:
//!
//! 1. **Check the target.** Refused if its manifest exists (or if it is a checkpoint directory).
//! 2. **Scatter.** The new groups `0..G'` are cut into `B` contiguous *buckets* sized so each holds
//!    about a quarter of the memory budget (estimated from the source's total bytes; at most 256
//!    buckets). The old blocks are streamed in group order (range reads of 16 MiB, two in flight),
//!    each checked (CRC-32C against the manifest, block header against the manifest, every key
//!    hashing to its old group). Every entry is appended, unchanged (key, accumulators and payload
//!    exactly as encoded), to the local spill file of its new group's bucket, tagged with the new
//!    group. Nothing is written to the target in this pass, so corrupt input leaves no trace there.
//! 3. **Split oversized buckets.** Hashing is uniform but a hot key is not: a spill file larger
//!    than its share is re-scattered into finer buckets (recursively), so only a single new group
//!    larger than the budget can exceed it — and a group's block is built in memory anyway.
//! 4. **Assemble.** Buckets are processed in group order: a bucket's spill file is read, its
//!    entries are sorted by new group (stably) and each new group's block is built in the block
//!    format (header for `G'` and the group, the raw entries, the block checksum), while the blocks
//!    of the previous bucket are written. New groups go, in order, to the state file of the subtask
//!    owning them at the new parallelism ([`SnapshotWriter`], multipart uploads).
//! 5. **Commit.** The manifest — job identity, source positions, watermark and state schema
//!    carried over, `kind: savepoint`, the target's id, and `stats.rewrittenFrom` naming the
//!    source — is assembled and written last, create-only. The key count must match the source's.
//!
//! Memory: about the budget (two buckets' entries and blocks, plus the writer's upload parts and
//! two read windows), or the largest single new group if that is bigger. Local disk: about the
//! state's size in the temp directory. The source is only read.

use super::blocks::{self, Block, Shape, WINDOW_BYTES};
use super::error::{Result, ToolError};
use super::location::{SnapshotLocation, open_location, open_location_for_write};
use crate::job::state_codec::{self, BlockInfo, BlockWriter};
use crate::snapshot::{
    DEFAULT_PART_SIZE, Manifest, SnapshotError, SnapshotKind, SnapshotMeta, SnapshotWriter,
    SubtaskSnapshot, commit_manifest, manifest_path, read_manifest, state_file_name,
};
use bytes::Bytes;
use jiff::Timestamp;
use keyshift_core::keygroup::{Assignment, KeyGroupRange};
use object_store::ObjectStoreExt;
use serde::Serialize;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The default memory budget of a rewrite.
pub const DEFAULT_MEMORY_BUDGET: usize = 512 * 1024 * 1024;
/// Most spill files open at once.
const MAX_BUCKETS: u64 = 256;
/// Upload parts in flight per state file.
const PARTS_IN_FLIGHT: usize = 2;
/// Spill record header: new group (u32 LE) + entry length (u32 LE).
const RECORD_HEADER: usize = 8;

/// Which pass a progress report is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Reading the source and spilling entries by new group.
    Scatter,
    /// Building the new blocks and writing the target.
    Assemble,
}

/// A progress report.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    /// The pass.
    pub phase: Phase,
    /// Bytes done in this pass.
    pub done: u64,
    /// Bytes this pass handles in all.
    pub total: u64,
    /// Keys handled so far in this pass.
    pub keys: u64,
    /// Time since the rewrite started.
    pub elapsed: Duration,
}

/// Receives progress reports.
pub type ProgressFn = Arc<dyn Fn(&Progress) + Send + Sync>;

/// Options of [`rewrite`].
#[derive(Clone)]
pub struct RewriteOptions {
    /// The new key-group count `G'`.
    pub max_parallelism: u32,
    /// The new parallelism; the source's when `None`.
    pub parallelism: Option<u32>,
    /// Memory to aim for (see the module docs).
    pub memory_budget: usize,
    /// Where to spill (a fresh directory inside it, removed afterwards); the system temp
    /// directory when `None`.
    pub temp_dir: Option<PathBuf>,
    /// Progress callback.
    pub progress: Option<ProgressFn>,
}

impl RewriteOptions {
    /// Options for a new key-group count, everything else default.
    pub fn new(max_parallelism: u32) -> Self {
        RewriteOptions {
            max_parallelism,
            parallelism: None,
            memory_budget: DEFAULT_MEMORY_BUDGET,
            temp_dir: None,
            progress: None,
        }
    }
}

impl std::fmt::Debug for RewriteOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RewriteOptions")
            .field("max_parallelism", &self.max_parallelism)
            .field("parallelism", &self.parallelism)
            .field("memory_budget", &self.memory_budget)
            .field("temp_dir", &self.temp_dir)
            .finish_non_exhaustive()
    }
}

/// What a rewrite did.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RewriteReport {
    /// The source URL.
    pub source: String,
    /// The target URL.
    pub target: String,
    /// The new snapshot's id.
    pub snapshot_id: u64,
    /// Source parallelism and key-group count.
    pub from_parallelism: u32,
    /// Source key-group count.
    pub from_max_parallelism: u32,
    /// New parallelism.
    pub parallelism: u32,
    /// New key-group count.
    pub max_parallelism: u32,
    /// Keys moved.
    pub keys: u64,
    /// State bytes read from the source.
    pub bytes_read: u64,
    /// State bytes written to the target.
    pub bytes_written: u64,
    /// Bytes spilled to local disk (including re-splits).
    pub spill_bytes: u64,
    /// Buckets assembled.
    pub buckets: usize,
    /// The largest bucket, in spilled bytes.
    pub largest_bucket_bytes: u64,
    /// Seconds in the scatter pass.
    pub scatter_secs: f64,
    /// Seconds splitting oversized buckets and assembling.
    pub assemble_secs: f64,
    /// Seconds committing the manifest.
    pub commit_secs: f64,
    /// Seconds in all.
    pub total_secs: f64,
    /// Where the time went.
    pub timings: Timings,
}

/// A breakdown of a rewrite's time (seconds), to tell reading, CPU work and writing apart.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Timings {
    /// Scatter: waiting for source reads.
    pub read_wait: f64,
    /// Scatter: checking, decoding and spilling entries.
    pub scatter_work: f64,
    /// Splitting oversized buckets.
    pub split: f64,
    /// Assemble: building blocks (summed over buckets; overlaps writing).
    pub build: f64,
    /// Assemble: waiting for a bucket's blocks to be built.
    pub build_wait: f64,
    /// Assemble: handing blocks to the state-file writers and completing the files (durable).
    pub write: f64,
}

impl RewriteReport {
    /// Source state MB (10^6 bytes) per second over the whole rewrite.
    pub fn mb_per_sec(&self) -> f64 {
        self.bytes_read as f64 / 1e6 / self.total_secs.max(1e-9)
    }

    /// Keys per second over the whole rewrite.
    pub fn keys_per_sec(&self) -> f64 {
        self.keys as f64 / self.total_secs.max(1e-9)
    }
}

/// A spill directory removed when dropped.
struct SpillDir(PathBuf);

static SPILL_COUNTER: AtomicU64 = AtomicU64::new(0);

impl SpillDir {
    fn create(parent: Option<&FsPath>) -> Result<Self> {
        let parent = parent.map_or_else(std::env::temp_dir, FsPath::to_path_buf);
        let name = format!(
            "keyshift-rewrite-{}-{}-{}",
            std::process::id(),
            Timestamp::now().as_microsecond(),
            SPILL_COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let dir = parent.join(name);
        std::fs::create_dir_all(&dir).map_err(ToolError::spill(&dir))?;
        Ok(SpillDir(dir))
    }

    fn file(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for SpillDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.0) {
            tracing::warn!(dir = %self.0.display(), error = %e, "removing the rewrite's spill directory failed");
        }
    }
}

/// One bucket: a contiguous range of new groups and its spill file.
#[derive(Debug)]
struct Bucket {
    range: KeyGroupRange,
    path: PathBuf,
    size: u64,
}

/// Cuts `range` (of new groups) into `n` contiguous, nearly equal parts.
fn cut(range: KeyGroupRange, n: u64) -> Vec<KeyGroupRange> {
    let len = u64::from(range.len());
    let n = n.clamp(1, len);
    (0..n)
        .map(|i| KeyGroupRange {
            start: range.start + (i * len).div_ceil(n) as u32,
            end: range.start + (((i + 1) * len - 1) / n) as u32,
        })
        .collect()
}

/// The spill files of one scatter: one buffered writer per bucket.
struct SpillSet {
    ranges: Vec<KeyGroupRange>,
    paths: Vec<PathBuf>,
    files: Vec<BufWriter<File>>,
    sizes: Vec<u64>,
    /// First group of the ranges, to find a group's bucket by binary search.
    starts: Vec<u32>,
}

impl SpillSet {
    fn create(
        dir: &SpillDir,
        tag: &str,
        ranges: Vec<KeyGroupRange>,
        buffer: usize,
    ) -> Result<Self> {
        let mut paths = Vec::with_capacity(ranges.len());
        let mut files = Vec::with_capacity(ranges.len());
        for (i, r) in ranges.iter().enumerate() {
            let path = dir.file(&format!("{tag}-{i}-groups-{}-{}.spill", r.start, r.end));
            let f = File::create(&path).map_err(ToolError::spill(&path))?;
            files.push(BufWriter::with_capacity(buffer, f));
            paths.push(path);
        }
        Ok(SpillSet {
            starts: ranges.iter().map(|r| r.start).collect(),
            sizes: vec![0; ranges.len()],
            ranges,
            paths,
            files,
        })
    }

    #[inline]
    fn push(&mut self, group: u32, entry: &[u8]) -> std::io::Result<usize> {
        let i = self
            .starts
            .partition_point(|s| *s <= group)
            .saturating_sub(1);
        let len = u32::try_from(entry.len())
            .map_err(|_| std::io::Error::other("an entry larger than 4 GiB"))?;
        let w = &mut self.files[i];
        w.write_all(&group.to_le_bytes())?;
        w.write_all(&len.to_le_bytes())?;
        w.write_all(entry)?;
        self.sizes[i] += (RECORD_HEADER + entry.len()) as u64;
        Ok(i)
    }

    fn finish(self) -> Result<Vec<Bucket>> {
        let mut out = Vec::with_capacity(self.ranges.len());
        for ((w, path), (range, size)) in self
            .files
            .into_iter()
            .zip(self.paths)
            .zip(self.ranges.into_iter().zip(self.sizes))
        {
            w.into_inner().map_err(|e| ToolError::Spill {
                path: path.clone(),
                source: e.into_error(),
            })?;
            out.push(Bucket { range, path, size });
        }
        Ok(out)
    }
}

/// Pass 1's state, moved in and out of blocking tasks.
struct Scatter {
    manifest: Arc<Manifest>,
    spill: SpillSet,
    shape: Option<Shape>,
    new_max_p: u32,
    keys: u64,
    bytes: u64,
}

impl Scatter {
    fn blocks(&mut self, blocks: &[Block]) -> Result<()> {
        for b in blocks {
            self.block(b)?;
        }
        Ok(())
    }

    fn block(&mut self, b: &Block) -> Result<()> {
        let codec = |source| ToolError::Block {
            file: b.file.to_string(),
            group: b.group,
            source,
        };
        let Some(entry) = self.manifest.group(b.group) else {
            return Ok(());
        };
        // One pass over the block: entries are spilled as they are walked and the header (read
        // at the start, returned at the end) is checked before anything else is reported. On any
        // error the whole rewrite stops before writing to the target, so spilled entries of a bad
        // block never reach it.
        let (old_max_p, new_max_p) = (self.manifest.max_parallelism, self.new_max_p);
        let spill = &mut self.spill;
        let mut failed: Option<ToolError> = None;
        let mut keys = 0u64;
        let header = state_codec::for_each_raw_entry(&b.bytes, |key, raw| {
            if failed.is_some() {
                return Ok(());
            }
            let hash = key.java_hash();
            let actual = keyshift_core::keygroup::key_group_for_hash(hash, old_max_p);
            if actual != b.group {
                failed = Some(ToolError::KeyInWrongGroup {
                    file: b.file.to_string(),
                    group: b.group,
                    key: key.to_key().to_string(),
                    actual,
                    max_parallelism: old_max_p,
                });
                return Ok(());
            }
            let new_group = keyshift_core::keygroup::key_group_for_hash(hash, new_max_p);
            if let Err(e) = spill.push(new_group, raw) {
                failed = Some(if raw.len() > u32::MAX as usize {
                    ToolError::EntryTooLarge {
                        file: b.file.to_string(),
                        group: b.group,
                        len: raw.len(),
                    }
                } else {
                    let i = spill.starts.partition_point(|s| *s <= new_group);
                    ToolError::Spill {
                        path: spill.paths[i.saturating_sub(1)].clone(),
                        source: e,
                    }
                });
            }
            keys += 1;
            Ok(())
        })
        .map_err(codec)?;
        blocks::check_header(&self.manifest, entry, &header, &mut self.shape)?;
        if let Some(e) = failed {
            return Err(e);
        }
        self.keys += keys;
        self.bytes += b.bytes.len() as u64;
        Ok(())
    }
}

/// Re-scatters buckets larger than `limit` into finer ones (recursively), in group order.
fn split_oversized(
    dir: &SpillDir,
    buckets: Vec<Bucket>,
    limit: u64,
    spilled: &mut u64,
) -> Result<Vec<Bucket>> {
    let mut out = Vec::with_capacity(buckets.len());
    for b in buckets {
        if b.size <= limit || b.range.len() == 1 {
            out.push(b);
            continue;
        }
        let n = b.size.div_ceil(limit.max(1)).clamp(2, MAX_BUCKETS);
        let tag = format!("split-{}-{}", b.range.start, b.range.end);
        let mut set = SpillSet::create(dir, &tag, cut(b.range, n), 256 * 1024)?;
        let mut reader = RecordReader::open(&b.path)?;
        while let Some((group, entry)) = reader.next_record()? {
            set.push(group, entry)
                .map_err(ToolError::spill(reader.path.clone()))?;
        }
        drop(reader);
        std::fs::remove_file(&b.path).map_err(ToolError::spill(&b.path))?;
        *spilled += set.sizes.iter().sum::<u64>();
        let finer = set.finish()?;
        out.extend(split_oversized(dir, finer, limit, spilled)?);
    }
    Ok(out)
}

/// Streams the records of a spill file.
struct RecordReader {
    path: PathBuf,
    reader: BufReader<File>,
    buf: Vec<u8>,
}

impl RecordReader {
    fn open(path: &FsPath) -> Result<Self> {
        let f = File::open(path).map_err(ToolError::spill(path))?;
        Ok(RecordReader {
            path: path.to_path_buf(),
            reader: BufReader::with_capacity(1024 * 1024, f),
            buf: Vec::new(),
        })
    }

    fn next_record(&mut self) -> Result<Option<(u32, &[u8])>> {
        let mut head = [0u8; RECORD_HEADER];
        let mut got = 0;
        while got < RECORD_HEADER {
            let n = self
                .reader
                .read(&mut head[got..])
                .map_err(ToolError::spill(&self.path))?;
            if n == 0 {
                if got == 0 {
                    return Ok(None);
                }
                return Err(truncated(&self.path));
            }
            got += n;
        }
        let (group, len) = record_header(&head);
        self.buf.resize(len, 0);
        self.reader.read_exact(&mut self.buf).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                truncated(&self.path)
            } else {
                ToolError::Spill {
                    path: self.path.clone(),
                    source: e,
                }
            }
        })?;
        Ok(Some((group, &self.buf)))
    }
}

fn truncated(path: &FsPath) -> ToolError {
    ToolError::Spill {
        path: path.to_path_buf(),
        source: std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "spill file is truncated"),
    }
}

fn record_header(head: &[u8; RECORD_HEADER]) -> (u32, usize) {
    let group = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
    let len = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize;
    (group, len)
}

/// A built block of the new snapshot: (group, bytes, entries).
type NewBlock = (u32, Bytes, u64);

/// Reads one bucket's spill file and builds the blocks of its groups, in group order.
///
/// `data` is a reusable read buffer (kept across buckets so its pages are not faulted in anew for
/// every bucket).
fn build_bucket(
    bucket: &Bucket,
    template: Option<BlockInfo>,
    data: &mut Vec<u8>,
) -> Result<Vec<NewBlock>> {
    data.clear();
    data.reserve_exact(usize::try_from(bucket.size).unwrap_or(0));
    File::open(&bucket.path)
        .and_then(|mut f| f.read_to_end(data))
        .map_err(ToolError::spill(&bucket.path))?;
    std::fs::remove_file(&bucket.path).map_err(ToolError::spill(&bucket.path))?;
    let data: &[u8] = data;
    if data.is_empty() {
        return Ok(Vec::new());
    }
    let Some(template) = template else {
        return Err(ToolError::Task(
            "entries were spilled but no block header was seen".to_owned(),
        ));
    };
    // Index the records, then order them by group (stable: a group's entries keep source order).
    let mut index: Vec<(u32, usize, usize)> = Vec::new();
    let mut pos = 0usize;
    while pos < data.len() {
        let head: &[u8; RECORD_HEADER] = data
            .get(pos..pos + RECORD_HEADER)
            .and_then(|s| s.try_into().ok())
            .ok_or_else(|| truncated(&bucket.path))?;
        let (group, len) = record_header(head);
        let start = pos + RECORD_HEADER;
        if start + len > data.len() || !bucket.range.contains(group) {
            return Err(truncated(&bucket.path));
        }
        index.push((group, start, len));
        pos = start + len;
    }
    index.sort_by_key(|(g, ..)| *g);
    // All of the bucket's blocks go into one buffer, handed on as slices: one large allocation
    // per bucket, returned to the system as soon as its last block is written (small per-block
    // allocations spread over threads would stay resident in malloc arenas).
    let groups = 1 + index.windows(2).filter(|w| w[0].0 != w[1].0).count();
    let size =
        index.iter().map(|(_, _, l)| l).sum::<usize>() + groups * (BlockWriter::HEADER_LEN + 4);
    let mut buf: Vec<u8> = Vec::with_capacity(size);
    let mut spans = Vec::with_capacity(groups);
    let mut i = 0;
    while i < index.len() {
        let group = index[i].0;
        let j = i + index[i..].partition_point(|(g, ..)| *g == group);
        let info = BlockInfo {
            key_group: group,
            ..template
        };
        let at = buf.len();
        let mut w = BlockWriter::append_to(buf, &info);
        for &(_, start, len) in &index[i..j] {
            w.push_raw(&data[start..start + len]);
        }
        let (b, entries) = w.finish();
        buf = b;
        spans.push((group, at..buf.len(), entries));
        i = j;
    }
    let all = Bytes::from(buf);
    Ok(spans
        .into_iter()
        .map(|(group, span, entries)| (group, all.slice(span), entries))
        .collect())
}

/// Writes the new state files from blocks arriving in group order, one subtask after another.
struct Layout {
    loc: SnapshotLocation,
    assignment: Assignment,
    part_size: usize,
    current: u32,
    writer: Option<SnapshotWriter>,
    acks: Vec<SubtaskSnapshot>,
    /// The source's operator-state sections (subtask, its run's parallelism, bytes), carried
    /// over unchanged: the section of old subtask `i` goes after the groups of new subtask
    /// `i % parallelism` (a restore reads them all, wherever they lie).
    sections: Vec<(u32, u32, Bytes)>,
}

impl Layout {
    fn new(loc: SnapshotLocation, assignment: Assignment, part_size: usize) -> Result<Self> {
        let writer = SnapshotWriter::new(loc.store.clone(), &loc.dir, assignment, 0)?
            .with_parts(part_size, PARTS_IN_FLIGHT);
        Ok(Layout {
            loc,
            assignment,
            part_size,
            current: 0,
            writer: Some(writer),
            acks: Vec::new(),
            sections: Vec::new(),
        })
    }

    /// Carries the source's operator-state `sections` into the new files.
    fn with_operator_state(mut self, sections: Vec<(u32, u32, Bytes)>) -> Self {
        self.sections = sections;
        self
    }

    /// Writes the sections that go after the current subtask's groups, and finishes its file.
    async fn close_current(&mut self) -> Result<()> {
        let Some(mut w) = self.writer.take() else {
            return Ok(());
        };
        let p = self.assignment.parallelism();
        for (subtask, parallelism, bytes) in &self.sections {
            if subtask % p == self.current {
                w.write_operator_state(*subtask, *parallelism, bytes.clone())
                    .await?;
            }
        }
        self.acks.push(w.finish().await?);
        Ok(())
    }

    /// Finishes subtasks up to (excluding) `subtask` and opens its writer.
    async fn advance_to(&mut self, subtask: u32) -> Result<()> {
        while self.current < subtask {
            self.close_current().await?;
            self.current += 1;
            self.writer = Some(
                SnapshotWriter::new(
                    self.loc.store.clone(),
                    &self.loc.dir,
                    self.assignment,
                    self.current,
                )?
                .with_parts(self.part_size, PARTS_IN_FLIGHT),
            );
        }
        Ok(())
    }

    async fn write(&mut self, group: u32, bytes: Bytes, entries: u64) -> Result<()> {
        self.advance_to(self.assignment.owner(group)).await?;
        match self.writer.as_mut() {
            Some(w) => Ok(w.write_group(group, bytes, entries).await?),
            None => Err(ToolError::Task("no state-file writer is open".to_owned())),
        }
    }

    async fn finish(mut self) -> Result<Vec<SubtaskSnapshot>> {
        let last = self.assignment.parallelism() - 1;
        self.advance_to(last).await?;
        self.close_current().await?;
        Ok(self.acks)
    }
}

/// Deletes the state files a failed rewrite may have written (best effort; nothing was
/// committed).
async fn clean_target(loc: &SnapshotLocation, assignment: Assignment) {
    for s in 0..assignment.parallelism() {
        let path = loc
            .dir
            .clone()
            .join(state_file_name(s, assignment.parallelism()).as_str());
        match loc.store.delete(&path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => {
                tracing::warn!(path = %path, error = %e, "cleaning up after a failed rewrite")
            }
        }
    }
}

/// Rewrites the snapshot at `source` into `opts.max_parallelism` key groups as a new savepoint at
/// `target` (see the module docs). Never modifies the source; refuses a target that already holds
/// a committed snapshot.
pub async fn rewrite(source: &str, target: &str, opts: RewriteOptions) -> Result<RewriteReport> {
    let started = Instant::now();
    let src = open_location(source)?;
    let manifest = Arc::new(read_manifest(src.store.as_ref(), &src.dir).await?);
    let parallelism = opts.parallelism.unwrap_or(manifest.parallelism);
    let assignment = Assignment::new(i64::from(parallelism), i64::from(opts.max_parallelism))
        .map_err(|source| ToolError::Bounds {
            what: match opts.parallelism {
                Some(_) => format!(
                    "--parallelism {parallelism} with --max-parallelism {}",
                    opts.max_parallelism
                ),
                None => format!(
                    "--max-parallelism {} with the source's parallelism {parallelism} (pass --parallelism to choose another)",
                    opts.max_parallelism
                ),
            },
            source,
        })?;
    let dst = open_location_for_write(target)?;
    let snapshot_id = match dst.named {
        Some((SnapshotKind::Checkpoint, _)) => {
            return Err(ToolError::TargetIsCheckpoint { url: dst.url });
        }
        Some((SnapshotKind::Savepoint, id)) => id,
        None => manifest.snapshot_id,
    };
    if dst.is_committed().await? {
        return Err(ToolError::TargetExists {
            path: manifest_path(&dst.dir).to_string(),
            url: dst.url,
        });
    }
    let progress = opts.progress.clone();
    let report = |phase, done, total, keys| {
        if let Some(p) = &progress {
            p(&Progress {
                phase,
                done,
                total,
                keys,
                elapsed: started.elapsed(),
            });
        }
    };

    if manifest.state_schema == crate::job::PROGRAM_SCHEMA {
        return rewrite_program(src, dst, manifest, assignment, snapshot_id, &opts, started).await;
    }

    // Pass 1: scatter the source's entries into buckets of new groups.
    let spill_dir = SpillDir::create(opts.temp_dir.as_deref())?;
    let total = manifest.stats.total_bytes;
    let limit = (opts.memory_budget as u64 / 4).max(64 * 1024);
    let all_new = KeyGroupRange {
        start: 0,
        end: opts.max_parallelism - 1,
    };
    // Spilled bytes: the entries plus a record header each. A bucket holds whole groups, so size
    // buckets in groups: as many as fit the limit with 10% headroom over the mean group (ordinary
    // hashing variance stays below it; outliers are split later).
    let spill_estimate = total + RECORD_HEADER as u64 * manifest.stats.total_keys;
    let per_group =
        (spill_estimate + spill_estimate / 10).div_ceil(u64::from(opts.max_parallelism));
    let groups_per_bucket = (limit / per_group.max(1)).max(1);
    let n = u64::from(opts.max_parallelism)
        .div_ceil(groups_per_bucket)
        .clamp(1, MAX_BUCKETS);
    let ranges = cut(all_new, n);
    let buffer = (opts.memory_budget / 8 / ranges.len()).clamp(16 * 1024, 1024 * 1024);
    let spill = SpillSet::create(&spill_dir, "bucket", ranges, buffer)?;
    let mut scatter = Scatter {
        manifest: manifest.clone(),
        spill,
        shape: None,
        new_max_p: opts.max_parallelism,
        keys: 0,
        bytes: 0,
    };
    // Read windows and upload parts scale down with small budgets (S3 needs parts of 5 MiB).
    let window = (opts.memory_budget as u64 / 32).clamp(1024 * 1024, WINDOW_BYTES);
    let part = (opts.memory_budget / 32).clamp(5 * 1024 * 1024, DEFAULT_PART_SIZE);
    let windows = blocks::plan_windows(&manifest, 0..manifest.max_parallelism, window);
    let mut rx = blocks::read_windows(
        src.store.clone(),
        src.dir.clone(),
        manifest.clone(),
        windows,
    );
    let mut timings = Timings::default();
    let mut waited = Instant::now();
    while let Some(fetched) = rx.recv().await {
        timings.read_wait += waited.elapsed().as_secs_f64();
        let blocks = fetched?;
        let work = Instant::now();
        let (back, result) = blocks::blocking(move || {
            let r = scatter.blocks(&blocks);
            (scatter, r)
        })
        .await?;
        timings.scatter_work += work.elapsed().as_secs_f64();
        scatter = back;
        result?;
        report(Phase::Scatter, scatter.bytes, total, scatter.keys);
        waited = Instant::now();
    }
    let scatter_secs = started.elapsed().as_secs_f64();
    let Scatter {
        spill,
        shape,
        keys: keys_read,
        bytes: bytes_read,
        ..
    } = scatter;
    let mut spill_bytes: u64 = spill.sizes.iter().sum();
    let spilled_first = spill_bytes;
    let template = shape.map(|s| BlockInfo {
        function: s.function,
        window_size_ms: s.window_size_ms,
        max_parallelism: opts.max_parallelism,
        key_group: 0,
    });

    // Split oversized buckets.
    let spill_dir = Arc::new(spill_dir);
    let split_started = Instant::now();
    let buckets = {
        let dir = spill_dir.clone();
        let (buckets, extra) = blocks::blocking(move || {
            let mut extra = 0u64;
            let b = spill
                .finish()
                .and_then(|b| split_oversized(&dir, b, limit, &mut extra));
            b.map(|b| (b, extra))
        })
        .await??;
        spill_bytes += extra;
        buckets
    };
    timings.split = split_started.elapsed().as_secs_f64();
    let bucket_count = buckets.len();
    let largest_bucket_bytes = buckets.iter().map(|b| b.size).max().unwrap_or(0);
    // After the split only a single new group can exceed the bucket limit; its block is built
    // in memory (its entries and the block), so more than half the budget cannot be honoured.
    if let Some(b) = buckets
        .iter()
        .find(|b| b.size > opts.memory_budget as u64 / 2)
    {
        return Err(ToolError::MemoryBudget {
            groups: match b.range.len() {
                1 => format!("key group {}", b.range.start),
                _ => format!("key groups {}..={}", b.range.start, b.range.end),
            },
            needed: b.size,
            budget: opts.memory_budget as u64,
        });
    }

    // Pass 2: build each bucket's blocks (the next bucket while this one is written).
    let assemble_started = Instant::now();
    let mut layout = Layout::new(dst.clone(), assignment, part)?;
    let result: Result<Vec<SubtaskSnapshot>> = async {
        let buckets: Vec<Arc<Bucket>> = buckets.into_iter().map(Arc::new).collect();
        // One read buffer, reused by the builds (they run one at a time).
        let buffer = Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
        let spawn = |b: Arc<Bucket>| {
            let dir = spill_dir.clone();
            let buffer = buffer.clone();
            tokio::task::spawn_blocking(move || {
                let _keep = dir;
                let started = Instant::now();
                let mut data = buffer
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                build_bucket(&b, template, &mut data).map(|blocks| (blocks, started.elapsed()))
            })
        };
        let mut next = buckets.first().cloned().map(spawn);
        let (mut done, mut keys_written) = (0u64, 0u64);
        for i in 0..buckets.len() {
            let Some(handle) = next.take() else { break };
            let wait = Instant::now();
            let (blocks, built_in) = handle.await??;
            timings.build_wait += wait.elapsed().as_secs_f64();
            timings.build += built_in.as_secs_f64();
            next = buckets.get(i + 1).cloned().map(spawn);
            let write = Instant::now();
            for (group, bytes, entries) in blocks {
                keys_written += entries;
                layout.write(group, bytes, entries).await?;
            }
            timings.write += write.elapsed().as_secs_f64();
            done += buckets[i].size;
            report(Phase::Assemble, done, spilled_first.max(done), keys_written);
        }
        let write = Instant::now();
        let acks = layout.finish().await;
        timings.write += write.elapsed().as_secs_f64();
        acks
    }
    .await;
    let target = Target {
        src,
        dst,
        manifest: &manifest,
        assignment,
        snapshot_id,
        max_parallelism: opts.max_parallelism,
        started,
    };
    let measured = Measured {
        keys: keys_read,
        bytes_read,
        spill_bytes,
        buckets: bucket_count,
        largest_bucket_bytes,
        scatter_secs,
        assemble_started,
        timings,
    };
    target.finish(result, measured, true).await
}

/// Where a rewrite writes, and what it started from: what its commit and report need.
struct Target<'a> {
    src: SnapshotLocation,
    dst: SnapshotLocation,
    manifest: &'a Manifest,
    assignment: Assignment,
    snapshot_id: u64,
    max_parallelism: u32,
    started: Instant,
}

/// What a rewrite measured before its commit, for its report.
struct Measured {
    /// Keys written (and, for a whole rewrite, read).
    keys: u64,
    bytes_read: u64,
    spill_bytes: u64,
    buckets: usize,
    largest_bucket_bytes: u64,
    scatter_secs: f64,
    assemble_started: Instant,
    timings: Timings,
}

impl Target<'_> {
    /// Ends a rewrite once its state files are written: a failed write cleans the target;
    /// otherwise the manifest commits ([`commit`]; `whole`: the keys must also match the
    /// source manifest's count) and the report is built.
    async fn finish(
        self,
        written: Result<Vec<SubtaskSnapshot>>,
        m: Measured,
        whole: bool,
    ) -> Result<RewriteReport> {
        let acks = match written {
            Ok(a) => a,
            Err(e) => {
                clean_target(&self.dst, self.assignment).await;
                return Err(e);
            }
        };
        let assemble_secs = m.assemble_started.elapsed().as_secs_f64();
        // The manifest last, create-only.
        let commit_started = Instant::now();
        let new_manifest = commit(
            &self.src,
            &self.dst,
            self.manifest,
            self.assignment,
            self.snapshot_id,
            acks,
            m.keys,
            whole,
        )
        .await?;
        Ok(RewriteReport {
            source: self.src.url,
            target: self.dst.url,
            snapshot_id: self.snapshot_id,
            from_parallelism: self.manifest.parallelism,
            from_max_parallelism: self.manifest.max_parallelism,
            parallelism: self.assignment.parallelism(),
            max_parallelism: self.max_parallelism,
            keys: m.keys,
            bytes_read: m.bytes_read,
            bytes_written: new_manifest.stats.total_bytes,
            spill_bytes: m.spill_bytes,
            buckets: m.buckets,
            largest_bucket_bytes: m.largest_bucket_bytes,
            scatter_secs: m.scatter_secs,
            assemble_secs,
            commit_secs: commit_started.elapsed().as_secs_f64(),
            total_secs: self.started.elapsed().as_secs_f64(),
            timings: m.timings,
        })
    }
}

/// Commits a rewritten snapshot: its manifest (the source's job identity, positions, watermark
/// and schema; `kind: savepoint`; `stats.rewrittenFrom` naming the source) is written last,
/// create-only, once the keys written match the keys read (and, with `whole`, the source
/// manifest's count). Cleans the target on failure.
#[allow(clippy::too_many_arguments)]
async fn commit(
    src: &SnapshotLocation,
    dst: &SnapshotLocation,
    manifest: &Manifest,
    assignment: Assignment,
    snapshot_id: u64,
    acks: Vec<SubtaskSnapshot>,
    keys_read: u64,
    whole: bool,
) -> Result<Manifest> {
    let meta = SnapshotMeta {
        job: manifest.job.clone(),
        snapshot_id,
        kind: SnapshotKind::Savepoint,
        completed_at: Timestamp::now(),
        state_schema: manifest.state_schema.clone(),
        source_positions: manifest.source_positions.clone(),
        source_partitions: manifest.source_partitions.clone(),
        watermark: manifest.watermark,
    };
    let mut new_manifest = Manifest::assemble(meta, assignment, acks)?;
    new_manifest.stats.extra.insert(
        "rewrittenFrom".to_owned(),
        serde_json::json!({
            "url": src.url,
            "kind": manifest.kind,
            "snapshotId": manifest.snapshot_id,
            "completedAt": manifest.completed_at,
            "maxParallelism": manifest.max_parallelism,
            "parallelism": manifest.parallelism,
            "tool": format!("keyshift {} savepoint rewrite", env!("CARGO_PKG_VERSION")),
        }),
    );
    let written = new_manifest.stats.total_keys;
    if written != keys_read || (whole && keys_read != manifest.stats.total_keys) {
        clean_target(dst, assignment).await;
        return Err(ToolError::KeyCount {
            read: keys_read,
            written,
            manifest: manifest.stats.total_keys,
        });
    }
    match commit_manifest(dst.store.as_ref(), &dst.dir, &new_manifest).await {
        Ok(()) => Ok(new_manifest),
        Err(SnapshotError::AlreadyExists { path }) => Err(ToolError::TargetExists {
            url: dst.url.clone(),
            path,
        }),
        Err(e) => {
            clean_target(dst, assignment).await;
            Err(e.into())
        }
    }
}

/// [`rewrite`] of a program's snapshot (schema [`crate::job::PROGRAM_SCHEMA`]): every group's
/// chain is read (checked against the manifest) and merged, every entry (each kind of state,
/// and the timers) goes to the group its key hashes to under the new count
/// ([`keyshift_sdk::block::rewrite`], every block checked first), and each new group is written
/// whole, in group order, to the state file of the subtask owning it. In memory: refused
/// (naming the budget) when the state would take more than a third of it; no spill files.
async fn rewrite_program(
    src: SnapshotLocation,
    dst: SnapshotLocation,
    manifest: Arc<Manifest>,
    assignment: Assignment,
    snapshot_id: u64,
    opts: &RewriteOptions,
    started: Instant,
) -> Result<RewriteReport> {
    let total = manifest.stats.total_bytes;
    let budget = opts.memory_budget as u64;
    if total.saturating_mul(3) > budget {
        return Err(ToolError::MemoryBudget {
            groups: "a program's key groups (rewritten in memory, for now: the blocks read, their entries and the new blocks)".to_owned(),
            needed: total.saturating_mul(3),
            budget,
        });
    }
    let mut chains: Vec<(u32, Bytes, Vec<Bytes>)> = Vec::new();
    let mut bytes_read = 0u64;
    for entry in manifest.key_groups.iter().filter(|e| e.length > 0) {
        let (first, deltas) =
            crate::snapshot::read_chain(src.store.as_ref(), &src.dir, entry).await?;
        bytes_read += first.len() as u64 + deltas.iter().map(|d| d.len() as u64).sum::<u64>();
        chains.push((entry.group, first, deltas));
    }
    let new_max_p = opts.max_parallelism;
    let groups = blocks::blocking(move || {
        keyshift_sdk::block::rewrite(
            chains
                .iter()
                .map(|(g, first, deltas)| (*g, keyshift_sdk::block::chain(first, deltas))),
            new_max_p,
        )
    })
    .await?
    .map_err(ToolError::ProgramRewrite)?;
    let scatter_secs = started.elapsed().as_secs_f64();
    let assemble_started = Instant::now();
    let sections = crate::snapshot::read_operator_state(src.store.as_ref(), &src.dir, &manifest)
        .await?
        .into_iter()
        .zip(&manifest.operator_state)
        .map(|(bytes, o)| (o.subtask, o.parallelism, bytes))
        .collect();
    let mut layout =
        Layout::new(dst.clone(), assignment, DEFAULT_PART_SIZE)?.with_operator_state(sections);
    let mut keys = 0u64;
    let written: Result<Vec<SubtaskSnapshot>> = async {
        for (group, block) in groups {
            keys += block.entries;
            layout
                .write(group, Bytes::from(block.bytes), block.entries)
                .await?;
        }
        layout.finish().await
    }
    .await;
    let target = Target {
        src,
        dst,
        manifest: &manifest,
        assignment,
        snapshot_id,
        max_parallelism: opts.max_parallelism,
        started,
    };
    // The source's count can include entries a TTL had expired (they are left out of whole
    // blocks): the keys written must be the merged chains', not the manifest's.
    let measured = Measured {
        keys,
        bytes_read,
        spill_bytes: 0,
        buckets: 1,
        largest_bucket_bytes: total,
        scatter_secs,
        assemble_started,
        timings: Timings::default(),
    };
    target.finish(written, measured, false).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cut_covers_the_range_contiguously() {
        for (start, end, n) in [
            (0u32, 127u32, 5u64),
            (10, 10, 3),
            (0, 32767, 256),
            (7, 20, 14),
        ] {
            let r = KeyGroupRange { start, end };
            let parts = cut(r, n);
            assert_eq!(parts.first().unwrap().start, start);
            assert_eq!(parts.last().unwrap().end, end);
            for w in parts.windows(2) {
                assert_eq!(w[0].end + 1, w[1].start);
            }
            assert!(parts.iter().all(|p| !p.is_empty()));
            assert_eq!(parts.len() as u64, n.min(u64::from(r.len())));
        }
    }

    #[test]
    fn oversized_buckets_split_until_they_fit() {
        let dir = SpillDir::create(None).unwrap();
        let path_of_dir = dir.0.clone();
        let range = KeyGroupRange { start: 0, end: 63 };
        let mut set = SpillSet::create(&dir, "t", vec![range], 4096).unwrap();
        // 64 groups x 20 entries of 100 bytes; group 5 holds a hot entry of 5000 bytes.
        for g in 0..64u32 {
            for i in 0..20u8 {
                set.push(g, &[i; 100]).unwrap();
            }
        }
        set.push(5, &[9; 5000]).unwrap();
        let buckets = set.finish().unwrap();
        let mut extra = 0;
        let split = split_oversized(&dir, buckets, 20_000, &mut extra).unwrap();
        assert!(split.len() > 1);
        assert!(extra > 0);
        let mut next = 0;
        for b in &split {
            assert_eq!(b.range.start, next);
            next = b.range.end + 1;
            assert!(b.size <= 20_000 || b.range.len() == 1, "{b:?}");
        }
        assert_eq!(next, 64);
        // Building gives each group's entries in order, as one block per group.
        let template = BlockInfo {
            function: keyshift_core::spec::AggregateFunction::Count,
            window_size_ms: None,
            max_parallelism: 64,
            key_group: 0,
        };
        let mut groups = Vec::new();
        for b in &split {
            for (g, _bytes, n) in build_bucket(b, Some(template), &mut Vec::new()).unwrap() {
                assert_eq!(n, if g == 5 { 21 } else { 20 });
                groups.push(g);
            }
        }
        assert_eq!(groups, (0..64).collect::<Vec<_>>());
        drop(dir);
        assert!(!path_of_dir.exists(), "spill directory removed");
    }
}
