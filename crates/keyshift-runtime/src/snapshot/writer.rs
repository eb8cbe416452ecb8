//! The write path: one subtask streams its key-group blocks into one state file.

use super::checksum::Crc32c;
use super::error::{Result, SnapshotError};
use super::manifest::{FileEntry, FileLayout, GroupEntry, SubtaskSnapshot};
use bytes::{Bytes, BytesMut};
use keyshift_core::keygroup::Assignment;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload, WriteMultipart};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Default size of one upload part (S3 requires at least 5 MiB for all parts but the last).
pub const DEFAULT_PART_SIZE: usize = 16 * 1024 * 1024;
/// Default number of parts uploading at once; with the part size this bounds the bytes the writer
/// holds on top of the blocks the caller hands it.
pub const DEFAULT_PARTS_IN_FLIGHT: usize = 4;
/// Blocks smaller than this are copied together into one buffer rather than passed on one by one,
/// so many small groups still reach the store as large writes.
const SMALL_BLOCK: usize = 64 * 1024;
/// Size at which gathered small blocks are handed on.
const GATHER: usize = 1024 * 1024;

/// Writes one subtask's state file for a snapshot: blocks go in group order, each is checksummed
/// and placed at the next offset; the file is uploaded as it fills (a single put when it stays
/// below one part, a multipart upload otherwise), so memory stays bounded by
/// `part size x (parts in flight + 1)` beyond the blocks themselves. Large blocks are never
/// copied; blocks under 64 KiB are gathered into 1 MiB buffers so that many small groups still
/// make large writes.
///
/// [`finish`](Self::finish) returns only once the file is durable (object stores acknowledge
/// durable writes; `file://` stores from [`open_store`](super::open_store) fsync the file and its
/// directory) and then yields the [`SubtaskSnapshot`] to acknowledge to the coordinator.
///
/// Dropping the writer without `finish` abandons the file: a local staging file is removed; a
/// cloud multipart upload is left for the bucket's lifecycle rule unless [`abort`](Self::abort)
/// is called.
#[derive(Debug)]
pub struct SnapshotWriter {
    store: Arc<dyn ObjectStore>,
    path: Path,
    layout: FileLayout,
    sink: Sink,
    /// Small blocks gathered for one larger write.
    gathered: BytesMut,
    part_size: usize,
    parts_in_flight: usize,
}

#[derive(Debug)]
enum Sink {
    /// Below one part so far: hold the blocks (no copy) for a single put.
    Buffer { blocks: Vec<Bytes>, len: usize },
    /// Streaming parts of a multipart upload.
    Multipart(Box<WriteMultipart>),
    /// A previous operation failed; the writer is unusable.
    Failed,
}

impl SnapshotWriter {
    /// Starts the state file of `subtask` (at `assignment`) in the snapshot directory `dir`.
    /// Does no I/O yet.
    pub fn new(
        store: Arc<dyn ObjectStore>,
        dir: &Path,
        assignment: Assignment,
        subtask: u32,
    ) -> Result<Self> {
        let layout = FileLayout::new(assignment, subtask)?;
        let path = dir.clone().join(layout.file_name());
        Ok(SnapshotWriter {
            store,
            path,
            layout,
            sink: Sink::Buffer {
                blocks: Vec::new(),
                len: 0,
            },
            gathered: BytesMut::new(),
            part_size: DEFAULT_PART_SIZE,
            parts_in_flight: DEFAULT_PARTS_IN_FLIGHT,
        })
    }

    /// Sets the upload part size (default [`DEFAULT_PART_SIZE`]; S3 needs at least 5 MiB) and how
    /// many parts may upload at once (default [`DEFAULT_PARTS_IN_FLIGHT`]). Call before writing.
    pub fn with_parts(mut self, part_size: usize, parts_in_flight: usize) -> Self {
        self.part_size = part_size.max(1);
        self.parts_in_flight = parts_in_flight.max(1);
        self
    }

    /// The state file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends the block of `group`: the caller's encoding of the group's keyed state and its
    /// number of entries. Groups must be inside the subtask's range and strictly increasing;
    /// groups skipped are recorded as empty.
    pub async fn write_group(&mut self, group: u32, bytes: Bytes, entries: u64) -> Result<()> {
        if matches!(self.sink, Sink::Failed) {
            return Err(self.failed());
        }
        self.layout.check_next(group)?;
        let checksum = Crc32c::of(&bytes);
        self.layout
            .push(group, bytes.len() as u64, checksum, entries)?;
        self.append(bytes).await
    }

    /// Records a group that builds on an earlier snapshot's blocks (incremental checkpoints):
    /// `prior` is its entry there (file names as
    /// [`referenced_file_name`](super::referenced_file_name) gives them, each described in
    /// `files`), followed by `delta` (the block of the keys changed since, and their number),
    /// if any, which is appended to this file. `keys` is the group's key count. Groups must come
    /// in order, as for [`write_group`](Self::write_group).
    pub async fn write_on(
        &mut self,
        prior: GroupEntry,
        delta: Option<(Bytes, u64)>,
        keys: u64,
        files: &BTreeMap<String, FileEntry>,
    ) -> Result<()> {
        if matches!(self.sink, Sink::Failed) {
            return Err(self.failed());
        }
        let described = delta
            .as_ref()
            .map(|(bytes, entries)| (bytes.len() as u64, Crc32c::of(bytes), *entries));
        self.layout.push_on(prior, described, keys, files)?;
        match delta {
            Some((bytes, _)) => self.append(bytes).await,
            None => Ok(()),
        }
    }

    /// Passes a block on, gathering small ones into larger buffers first (order is kept).
    /// Writes an operator-state section of `subtask` of a run of `parallelism` after the
    /// groups (no group may follow): a worker's own, or one a rewrite carries over.
    pub async fn write_operator_state(
        &mut self,
        subtask: u32,
        parallelism: u32,
        bytes: Bytes,
    ) -> Result<()> {
        if matches!(self.sink, Sink::Failed) {
            return Err(self.failed());
        }
        self.layout.push_operator_state(
            subtask,
            parallelism,
            bytes.len() as u64,
            Crc32c::of(&bytes),
        );
        self.append(bytes).await
    }

    /// Appends `bytes` (recorded in the layout already) to the file; a failure aborts the
    /// upload.
    async fn append(&mut self, bytes: Bytes) -> Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        if let Err(e) = self.gather(bytes).await {
            self.abort_quietly().await;
            return Err(e);
        }
        Ok(())
    }

    async fn gather(&mut self, bytes: Bytes) -> Result<()> {
        if bytes.len() < SMALL_BLOCK {
            if self.gathered.capacity() == 0 {
                self.gathered.reserve(GATHER);
            }
            self.gathered.extend_from_slice(&bytes);
            if self.gathered.len() >= GATHER {
                let full = self.gathered.split().freeze();
                self.feed(full).await?;
            }
            return Ok(());
        }
        self.flush_gathered().await?;
        self.feed(bytes).await
    }

    async fn flush_gathered(&mut self) -> Result<()> {
        if self.gathered.is_empty() {
            return Ok(());
        }
        let pending = self.gathered.split().freeze();
        self.feed(pending).await
    }

    async fn feed(&mut self, mut bytes: Bytes) -> Result<()> {
        if let Sink::Buffer { blocks, len } = &mut self.sink {
            if *len + bytes.len() < self.part_size {
                *len += bytes.len();
                blocks.push(bytes);
                return Ok(());
            }
            let held = std::mem::take(blocks);
            let upload = self
                .store
                .put_multipart(&self.path)
                .await
                .map_err(|e| SnapshotError::store("multipart upload start", &self.path, e))?;
            let mut w = WriteMultipart::new_with_chunk_size(upload, self.part_size);
            for b in held {
                w.put(b);
            }
            self.sink = Sink::Multipart(Box::new(w));
        }
        let Sink::Multipart(w) = &mut self.sink else {
            return Err(self.failed());
        };
        // Hand the block over in part-sized slices, waiting for upload capacity in between, so a
        // huge block never spawns more than `parts_in_flight` concurrent part uploads.
        while !bytes.is_empty() {
            w.wait_for_capacity(self.parts_in_flight)
                .await
                .map_err(|e| SnapshotError::store("multipart upload", &self.path, e))?;
            let n = bytes.len().min(self.part_size);
            w.put(bytes.split_to(n));
        }
        Ok(())
    }

    /// Completes the file (groups not written are empty), waits until it is durable and checks
    /// its size in the store, and returns what to acknowledge to the coordinator.
    pub async fn finish(mut self) -> Result<SubtaskSnapshot> {
        if !matches!(self.sink, Sink::Failed)
            && let Err(e) = self.flush_gathered().await
        {
            self.abort_quietly().await;
            return Err(e);
        }
        let sink = std::mem::replace(&mut self.sink, Sink::Failed);
        let snapshot = self.layout.clone().finish();
        match sink {
            Sink::Failed => return Err(self.failed()),
            Sink::Buffer { blocks, .. } => {
                let payload: PutPayload = blocks.into_iter().collect();
                self.store
                    .put(&self.path, payload)
                    .await
                    .map_err(|e| SnapshotError::store("write", &self.path, e))?;
            }
            Sink::Multipart(w) => {
                // `finish` aborts the upload itself when a part or the completion fails.
                w.finish().await.map_err(|e| {
                    SnapshotError::store("multipart upload completion", &self.path, e)
                })?;
            }
        }
        let meta = self
            .store
            .head(&self.path)
            .await
            .map_err(|e| SnapshotError::store("head", &self.path, e))?;
        if meta.size != snapshot.file.size {
            return Err(SnapshotError::SizeMismatch {
                path: self.path.to_string(),
                expected: snapshot.file.size,
                actual: meta.size,
            });
        }
        Ok(snapshot)
    }

    /// Abandons the file, aborting a multipart upload in progress.
    pub async fn abort(mut self) -> Result<()> {
        match std::mem::replace(&mut self.sink, Sink::Failed) {
            Sink::Multipart(w) => w
                .abort()
                .await
                .map_err(|e| SnapshotError::store("multipart upload abort", &self.path, e)),
            Sink::Buffer { .. } | Sink::Failed => Ok(()),
        }
    }

    async fn abort_quietly(&mut self) {
        if let Sink::Multipart(w) = std::mem::replace(&mut self.sink, Sink::Failed)
            && let Err(e) = w.abort().await
        {
            tracing::warn!(path = %self.path, error = %e, "aborting a failed state-file upload failed");
        }
    }

    fn failed(&self) -> SnapshotError {
        SnapshotError::WriterFailed {
            path: self.path.to_string(),
        }
    }
}

/// Writes a whole state file from blocks `(group, bytes, entries)` in group order; see
/// [`SnapshotWriter`].
pub async fn write_subtask_state<I>(
    store: Arc<dyn ObjectStore>,
    dir: &Path,
    assignment: Assignment,
    subtask: u32,
    blocks: I,
) -> Result<SubtaskSnapshot>
where
    I: IntoIterator<Item = (u32, Bytes, u64)>,
{
    let mut writer = SnapshotWriter::new(store, dir, assignment, subtask)?;
    for (group, bytes, entries) in blocks {
        writer.write_group(group, bytes, entries).await?;
    }
    writer.finish().await
}
