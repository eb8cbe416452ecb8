//! Snapshot storage: key-group state files and manifests in an object store (see
//! `docs/architecture.md` §5 and §6).
//!
//! I/O sits at the edge ([`open_store`], [`SnapshotWriter`], [`commit_manifest`],
//! [`read_groups`], [`verify`], [`list_snapshots`], [`retain`]); the format logic — block layout,
//! manifest assembly and consistency checks, range-read planning — is pure ([`Manifest`]).
//!
//! # Layout
//!
//! ```text
//! <storage>/<namespace>/<job>/checkpoints/chk-<id>/_manifest.json
//!                                                  state-<subtask>-of-<parallelism>.bin
//! <storage>/<namespace>/<job>/savepoints/sp-<id>/...
//! ```
//!
//! A state file holds one subtask's key groups as contiguous blocks in group order, no header, no
//! padding: a block is exactly the bytes the worker handed over for that group (its own encoding).
//! The manifest (JSON, `formatVersion: 1` when self-contained) says for every group
//! `0..maxParallelism` which file, offset, length, CRC-32C and entry count; for every file its
//! size and CRC-32C; plus job
//! identity, id, kind, completion time, parallelism, source positions, watermark, state schema and
//! totals. **A snapshot exists iff its manifest exists**: the manifest is written last,
//! create-only.
//!
//! An incremental checkpoint (`formatVersion: 2`) also names files of earlier checkpoints of the
//! job (`checkpoints/chk-<id>/<file>`, relative to the job directory: [`file_path`]) whose blocks
//! it reads, and per group a chain of delta blocks applied in order over the first
//! ([`GroupEntry::deltas`]). Retention and disposal keep every file a kept manifest names
//! ([`referenced_files`]); savepoints are always self-contained (`formatVersion: 1`).
//!
//! # Use
//!
//! ```no_run
//! # async fn demo() -> keyshift_runtime::snapshot::Result<()> {
//! use keyshift_core::keygroup::Assignment;
//! use keyshift_runtime::snapshot::*;
//! let (store, base) = open_store("file:///var/lib/keyshift")?;
//! let job = job_dir(&base, "default", "clicks");
//! let dir = snapshot_dir(&job, SnapshotKind::Checkpoint, 7);
//! let old = Assignment::new(4, 128)?;
//!
//! // Each subtask, at the barrier: its groups' blocks in order -> one durable state file.
//! let mut w = SnapshotWriter::new(store.clone(), &dir, old, 0)?;
//! w.write_group(0, bytes::Bytes::from_static(b"..."), 1).await?;
//! let ack: SubtaskSnapshot = w.finish().await?; // send to the coordinator
//! # let acks = vec![ack];
//! # let meta: SnapshotMeta = todo!();
//!
//! // The coordinator, once every subtask acked: assemble and commit (create-only).
//! let manifest = Manifest::assemble(meta, old, acks)?;
//! commit_manifest(store.as_ref(), &dir, &manifest).await?;
//!
//! // Restore at a new parallelism: each new subtask reads exactly its own groups.
//! let new = Assignment::new(3, 128)?;
//! let restored = read_groups(store.as_ref(), &dir, &manifest, new.range(1)).await?;
//! for g in restored.groups { /* decode g.bytes for g.group */ }
//! # Ok(()) }
//! ```
//!
//! # API
//!
//! - Stores: [`open_store`]`(url) -> (Arc<dyn ObjectStore>, Path)`; paths: [`job_dir`],
//!   [`snapshot_dir`], [`manifest_path`], [`state_file_name`].
//! - Write: [`SnapshotWriter`] (`new`, `write_group`, `finish`, `abort`), [`write_subtask_state`];
//!   each yields a [`SubtaskSnapshot`].
//! - Commit: [`Manifest::assemble`]`(`[`SnapshotMeta`]`, Assignment, Vec<SubtaskSnapshot>)`, then
//!   [`commit_manifest`] (create-only; [`SnapshotError::AlreadyExists`] the second time).
//! - Read: [`read_manifest`], [`open_snapshot`]`(url)`, [`read_groups`] -> [`Restore`]
//!   (groups + `bytes_read`); [`read_groups_stream`] -> checked [`RestoredChunk`]s as they
//!   arrive, for decoding while the next ones are read.
//! - Check: [`verify`] -> [`VerifyReport`].
//! - Catalog: [`list_snapshots`], [`latest_checkpoint`], [`retain`] -> [`RetentionReport`] (it
//!   keeps what the in-use marker pins: [`read_in_use`], [`write_in_use`]).
//!
//! Errors are [`SnapshotError`]; each names the URL, file or group concerned.

mod catalog;
mod checksum;
mod error;
mod file_store;
mod in_use;
mod layout;
mod manifest;
mod reader;
mod store;
mod writer;

pub use catalog::{
    Newest, RetentionReport, SnapshotInfo, SnapshotScan, UnreadableSnapshot, delete_unreferenced,
    is_committed, latest_checkpoint, list_snapshots, newest_snapshot, newest_snapshot_except,
    next_snapshot_id, referenced_files, restore_source, retain, scan_snapshots, snapshot_ids,
};
pub use checksum::Crc32c;
pub use error::{Result, SnapshotError};
pub use in_use::{
    IN_USE_FILE, IN_USE_FORMAT_VERSION, InUseEntry, InUseMarker, read_in_use, write_in_use,
};
pub use layout::{
    CHECKPOINTS_DIR, MANIFEST_FILE, SAVEPOINTS_DIR, SnapshotKind, file_path, job_dir, job_url,
    manifest_path, parse_snapshot_dir_name, snapshot_dir, snapshot_url, state_file_name,
};
pub use manifest::{
    CHECKSUM_ALGORITHM, DeltaBlock, FORMAT_VERSION, FULL_FORMAT_VERSION, FileEntry, GroupEntry,
    JobIdentity, LayoutChange, Manifest, OPERATOR_STATE_FORMAT_VERSION, OperatorStateEntry,
    ReadRequest, SnapshotMeta, StateLayout, Stats, SubtaskSnapshot, is_referenced_file,
    referenced_file_name, split_referenced_file,
};
pub use object_store::ObjectStore;
pub use object_store::path::Path;
pub use reader::{
    MANIFEST_CHECKSUM_FIELD, MAX_MANIFEST_BYTES, Restore, RestoredChunk, RestoredGroup,
    STREAM_REQUEST_BYTES, VerifyReport, check_files_present, commit_manifest, fetch_deltas,
    open_snapshot, open_snapshot_dir, parse_manifest, plan_stream_reads, read_chain, read_groups,
    read_groups_stream, read_manifest, read_operator_state, sealed_manifest_json, verify,
    verify_written,
};
pub use store::open_store;
pub use writer::{DEFAULT_PART_SIZE, DEFAULT_PARTS_IN_FLIGHT, SnapshotWriter, write_subtask_state};
