//! Committing, reading, restoring from and verifying snapshots.

use super::checksum::{Crc32c, Crc32cHasher};
use super::error::{Result, SnapshotError};
use super::layout::{SnapshotKind, file_path, manifest_path, parse_snapshot_dir_name};
use super::manifest::{
    DeltaBlock, FileEntry, GroupEntry, Manifest, OperatorStateEntry, is_referenced_file,
};
use super::store::open_store;
use bytes::{Buf, Bytes};
use futures::{StreamExt, TryStreamExt};
use keyshift_core::keygroup::KeyGroupRange;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions};
use std::collections::BTreeMap;
use std::sync::Arc;

/// The largest manifest read, and written ([`bounded_manifest_json`]): 32768 key groups with
/// their chains at the longest the chain policy lets them grow
/// ([`crate::runtime::incremental::MANIFEST_BLOCK_BUDGET`] blocks) take under half of it.
pub const MAX_MANIFEST_BYTES: u64 = 64 * 1024 * 1024;
/// Files read (or checked) at once by a restore or a verify.
const FILES_AT_ONCE: usize = 4;
/// Bytes per read while verifying a file.
const VERIFY_WINDOW: u64 = 8 * 1024 * 1024;

/// The field of `_manifest.json` that holds the manifest's own CRC-32C: the checksum of the
/// manifest's content as [`Manifest::to_json`] writes it (without this field).
/// [`commit_manifest`] writes it as the last field and [`read_manifest`] checks it, so a changed
/// byte anywhere in a manifest is found, also where the manifest still parses and adds up (a
/// digit of a source position, an offset or a checksum of a block). Manifests written before
/// this field existed have none and are read as before.
pub const MANIFEST_CHECKSUM_FIELD: &str = "manifestChecksum";

/// A manifest with its own checksum as the last field (see [`MANIFEST_CHECKSUM_FIELD`]).
#[derive(serde::Serialize)]
struct Sealed<'a> {
    #[serde(flatten)]
    manifest: &'a Manifest,
    #[serde(rename = "manifestChecksum")]
    checksum: Crc32c,
}

/// The checksum field of a manifest, if it has one.
#[derive(serde::Deserialize)]
struct Seal {
    #[serde(rename = "manifestChecksum", default)]
    checksum: Option<Crc32c>,
}

/// The bytes [`commit_manifest`] writes: the manifest as compact JSON with its own checksum
/// (see [`MANIFEST_CHECKSUM_FIELD`]) as the last field. (Manifests written before were pretty
/// JSON: read the same, with the same checksum.)
pub fn sealed_manifest_json(manifest: &Manifest) -> Result<Vec<u8>, serde_json::Error> {
    let checksum = manifest.content_checksum()?;
    serde_json::to_vec(&Sealed { manifest, checksum })
}

/// [`sealed_manifest_json`], refused when it is larger than `limit` (the bound every reader
/// holds a manifest to: [`MAX_MANIFEST_BYTES`]), so that no snapshot commits that no reader would
/// read. Pure.
pub fn bounded_manifest_json(manifest: &Manifest, path: &Path, limit: u64) -> Result<Vec<u8>> {
    let json = sealed_manifest_json(manifest).map_err(|source| SnapshotError::ManifestCorrupt {
        path: path.to_string(),
        source,
    })?;
    if json.len() as u64 > limit {
        return Err(SnapshotError::ManifestTooLargeToWrite {
            path: path.to_string(),
            size: json.len() as u64,
            limit,
            groups: manifest.max_parallelism,
            blocks: manifest.block_count(),
        });
    }
    Ok(json)
}

/// Parses the bytes of `_manifest.json` (at `path`, for errors): [`Manifest::from_json`], then
/// the manifest's own checksum, if it has one, must match its content.
pub fn parse_manifest(bytes: &[u8], path: &str) -> Result<Manifest> {
    let manifest = Manifest::from_json(bytes, path)?;
    let corrupt = |source| SnapshotError::ManifestCorrupt {
        path: path.to_owned(),
        source,
    };
    let seal: Seal = serde_json::from_slice(bytes).map_err(corrupt)?;
    if let Some(expected) = seal.checksum {
        let actual = manifest.content_checksum().map_err(corrupt)?;
        if actual != expected {
            return Err(SnapshotError::ManifestInconsistent {
                path: path.to_owned(),
                reason: format!(
                    "its content does not match its own checksum ({MANIFEST_CHECKSUM_FIELD} {expected}, content {actual}): it was changed or corrupted after it was written"
                ),
            });
        }
    }
    Ok(manifest)
}

/// Reads and checks the manifest of the snapshot in `dir`.
///
/// Errors: [`SnapshotError::ManifestMissing`] (no committed snapshot there),
/// [`SnapshotError::ManifestCorrupt`] (not JSON of the right shape, e.g. truncated),
/// [`SnapshotError::UnsupportedFormat`], [`SnapshotError::ManifestInconsistent`] (also when
/// its content does not match its own checksum, see [`MANIFEST_CHECKSUM_FIELD`]).
pub async fn read_manifest(store: &dyn ObjectStore, dir: &Path) -> Result<Manifest> {
    let path = manifest_path(dir);
    let read_error = |e| match e {
        object_store::Error::NotFound { .. } => SnapshotError::ManifestMissing {
            path: path.to_string(),
        },
        e => SnapshotError::store("read", &path, e),
    };
    let object = store.get(&path).await.map_err(read_error)?;
    // Sized by the object's metadata before a byte is buffered.
    if object.meta.size > MAX_MANIFEST_BYTES {
        return Err(SnapshotError::ManifestTooLarge {
            path: path.to_string(),
            size: object.meta.size,
            limit: MAX_MANIFEST_BYTES,
        });
    }
    let bytes = object.bytes().await.map_err(read_error)?;
    if bytes.len() as u64 > MAX_MANIFEST_BYTES {
        return Err(SnapshotError::ManifestTooLarge {
            path: path.to_string(),
            size: bytes.len() as u64,
            limit: MAX_MANIFEST_BYTES,
        });
    }
    parse_manifest(&bytes, path.as_ref())
}

/// Opens the store of a snapshot directory URL (e.g.
/// `s3://bucket/prefix/ns/job/savepoints/sp-7`) and reads its manifest.
///
/// A URL that follows the layout (`.../<job>/checkpoints/chk-<id>` or `.../savepoints/sp-<id>`)
/// opens the store at the job directory, so that the files of the job's other snapshots that an
/// incremental checkpoint reads are inside it (a `file://` store is rooted at its URL).
pub async fn open_snapshot(url: &str) -> Result<(Arc<dyn ObjectStore>, Path, Manifest)> {
    let (store, dir) = open_snapshot_dir(url)?;
    let manifest = read_manifest(store.as_ref(), &dir).await?;
    Ok((store, dir, manifest))
}

/// The store and directory of a snapshot URL, as [`open_snapshot`] opens them (at the job
/// directory when the URL follows the layout), without reading anything: for [`verify`] and
/// other readers of a snapshot that may be an incremental checkpoint.
pub fn open_snapshot_dir(url: &str) -> Result<(Arc<dyn ObjectStore>, Path)> {
    match split_layout_url(url) {
        Some((job, kind, id)) => {
            let (store, job_dir) = open_store(job)?;
            Ok((store, super::layout::snapshot_dir(&job_dir, kind, id)))
        }
        None => open_store(url),
    }
}

/// Splits `<job URL>/checkpoints/chk-<id>` (or `savepoints/sp-<id>`) into the job URL, the kind
/// and the id; `None` for any other URL (or one whose job part names no location).
fn split_layout_url(url: &str) -> Option<(&str, SnapshotKind, u64)> {
    let trimmed = url.trim().trim_end_matches('/');
    let (rest, name) = trimmed.rsplit_once('/')?;
    let (job, folder) = rest.rsplit_once('/')?;
    let kind = [SnapshotKind::Checkpoint, SnapshotKind::Savepoint]
        .into_iter()
        .find(|k| k.folder() == folder)?;
    let id = parse_snapshot_dir_name(kind, name)?;
    let after_scheme = job.split_once("://").map_or(job, |(_, r)| r);
    if after_scheme.trim_matches('/').is_empty() {
        return None;
    }
    Some((job, kind, id))
}

/// Commits the snapshot in `dir` by writing its manifest, create-only: after checking the manifest
/// and that every state file it names is in the store with the right size. A snapshot exists iff
/// its manifest exists, so this is the last write of a snapshot. The manifest carries its own
/// checksum ([`MANIFEST_CHECKSUM_FIELD`]).
///
/// A second commit of the same directory fails with [`SnapshotError::AlreadyExists`].
pub async fn commit_manifest(
    store: &dyn ObjectStore,
    dir: &Path,
    manifest: &Manifest,
) -> Result<()> {
    let path = manifest_path(dir);
    manifest
        .check()
        .map_err(|reason| SnapshotError::ManifestInconsistent {
            path: path.to_string(),
            reason,
        })?;
    check_files_present(store, dir, manifest).await?;
    let json = bounded_manifest_json(manifest, &path, MAX_MANIFEST_BYTES)?;
    let opts = PutOptions {
        mode: PutMode::Create,
        ..Default::default()
    };
    store
        .put_opts(&path, json.into(), opts)
        .await
        .map_err(|e| match e {
            object_store::Error::AlreadyExists { .. }
            | object_store::Error::Precondition { .. } => SnapshotError::AlreadyExists {
                path: path.to_string(),
            },
            e => SnapshotError::store("create-only write", &path, e),
        })?;
    Ok(())
}

/// Whether every state file the manifest of the snapshot in `dir` names is in the store at its
/// recorded size, its own and those it reads from earlier checkpoints (incremental): one HEAD per
/// file, no bytes read. [`SnapshotError::MissingFile`] or [`SnapshotError::SizeMismatch`] name
/// the first file that is not (a lost file, a truncated one, a shared file of a chain deleted);
/// checksums are checked as the blocks are read (a restore) or by [`verify`].
pub async fn check_files_present(
    store: &dyn ObjectStore,
    dir: &Path,
    manifest: &Manifest,
) -> Result<()> {
    // Chunks of joined futures, not a buffered stream: the stream's closure makes the callers'
    // futures (the orchestrator's pass) not provably `Send`.
    for chunk in manifest.files.chunks(FILES_AT_ONCE * 4) {
        futures::future::try_join_all(chunk.iter().map(|f| check_file_size(store, dir, f))).await?;
    }
    Ok(())
}

async fn check_file_size(store: &dyn ObjectStore, dir: &Path, f: &FileEntry) -> Result<()> {
    let path = file_path(dir, &f.name);
    let meta = store
        .head(&path)
        .await
        .map_err(|e| SnapshotError::store("head", &path, e))?;
    if meta.size != f.size {
        return Err(SnapshotError::SizeMismatch {
            path: path.to_string(),
            expected: f.size,
            actual: meta.size,
        });
    }
    Ok(())
}

/// One key group's state, as restored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoredGroup {
    /// The key group.
    pub group: u32,
    /// Its number of entries, as written.
    pub entries: u64,
    /// Its block, exactly as handed to the writer (empty for a group without state).
    pub bytes: Bytes,
    /// Its delta blocks (incremental checkpoints), in the order they apply over `bytes`.
    pub deltas: Vec<Bytes>,
}

/// Reads one key group's blocks (its first block and its deltas, incremental checkpoints) from
/// the snapshot in `dir` that `entry` describes, each checked against its length and checksum:
/// what a background compaction merges into one block.
pub async fn read_chain(
    store: &dyn ObjectStore,
    dir: &Path,
    entry: &GroupEntry,
) -> Result<(Bytes, Vec<Bytes>)> {
    let path = file_path(dir, &entry.file);
    let first = if entry.length == 0 {
        Bytes::new()
    } else {
        let buf = get_one_range(store, &path, entry.byte_range())
            .await
            .map_err(|e| SnapshotError::store("range read", &path, e))?;
        split_blocks(&path, entry.offset, std::slice::from_ref(entry), buf)?
            .pop()
            .map(|(_, b)| b)
            .unwrap_or_default()
    };
    let (_, mut deltas) = fetch_deltas(store, dir, std::slice::from_ref(entry)).await?;
    Ok((first, deltas.remove(&entry.group).unwrap_or_default()))
}

/// Fetches the delta blocks of `groups` (incremental checkpoints; adjacent blocks of one file
/// in one request), checking each block's length and checksum; returns the bytes fetched and
/// each group's deltas in order.
pub async fn fetch_deltas(
    store: &dyn ObjectStore,
    dir: &Path,
    groups: &[GroupEntry],
) -> Result<(u64, BTreeMap<u32, Vec<Bytes>>)> {
    // Per file: (range, [(group, delta index, block)]) of adjacent blocks.
    type Piece<'a> = (std::ops::Range<u64>, Vec<(u32, usize, &'a DeltaBlock)>);
    let mut by_file: BTreeMap<&str, Vec<Piece<'_>>> = BTreeMap::new();
    for g in groups {
        for (i, d) in g.deltas.iter().enumerate() {
            let pieces = by_file.entry(d.file.as_str()).or_default();
            match pieces.last_mut() {
                Some((r, blocks)) if r.end == d.offset => {
                    r.end += d.length;
                    blocks.push((g.group, i, d));
                }
                _ => pieces.push((d.byte_range(), vec![(g.group, i, d)])),
            }
        }
    }
    let mut read = 0u64;
    let mut out: BTreeMap<u32, Vec<(usize, Bytes)>> = BTreeMap::new();
    for (file, pieces) in by_file {
        let path = file_path(dir, file);
        let ranges: Vec<_> = pieces.iter().map(|(r, _)| r.clone()).collect();
        let data = store
            .get_ranges(&path, &ranges)
            .await
            .map_err(|e| SnapshotError::store("range read", &path, e))?;
        for ((range, blocks), buf) in pieces.iter().zip(data) {
            read += buf.len() as u64;
            for (group, i, d) in blocks {
                let (from, to) = (d.offset - range.start, d.offset - range.start + d.length);
                if (buf.len() as u64) < to {
                    return Err(SnapshotError::BlockLength {
                        path: path.to_string(),
                        group: *group,
                        expected: d.length,
                        actual: (buf.len() as u64).saturating_sub(from),
                    });
                }
                let block = buf.slice(from as usize..to as usize);
                let actual = Crc32c::of(&block);
                if actual != d.checksum {
                    return Err(SnapshotError::BlockChecksum {
                        path: path.to_string(),
                        group: *group,
                        expected: d.checksum.to_string(),
                        actual: actual.to_string(),
                    });
                }
                out.entry(*group).or_default().push((*i, block));
            }
        }
    }
    let out = out
        .into_iter()
        .map(|(g, mut blocks)| {
            blocks.sort_by_key(|(i, _)| *i);
            (g, blocks.into_iter().map(|(_, b)| b).collect())
        })
        .collect();
    Ok((read, out))
}

/// The state of a key-group range read back from a snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restore {
    /// Every group of the requested range, in order, empty ones included.
    pub groups: Vec<RestoredGroup>,
    /// Bytes fetched from the store: exactly the sum of the requested groups' block lengths.
    pub bytes_read: u64,
    /// Range requests issued (adjacent blocks of one file are fetched together).
    pub requests: usize,
}

/// Reads the key groups in `range` from the snapshot in `dir` (described by `manifest`): range
/// reads of exactly those blocks, adjacent blocks of a file coalesced into one request. Every
/// block's length and checksum is checked before anything is returned, so a restore is never
/// partial: any mismatch fails with an error naming the file and the group.
pub async fn read_groups(
    store: &dyn ObjectStore,
    dir: &Path,
    manifest: &Manifest,
    range: KeyGroupRange,
) -> Result<Restore> {
    let plan = manifest.plan_reads(range)?;
    let requests = plan.len();
    // Owned keys and requests keep the fetch futures `Send` for any caller (an HTTP handler).
    let mut by_file: BTreeMap<String, Vec<super::manifest::ReadRequest>> = BTreeMap::new();
    for req in &plan {
        by_file
            .entry(req.file.clone())
            .or_default()
            .push(req.clone());
    }

    // Fetch and check each file's requests; nothing is handed out until all succeed.
    let fetched: Vec<(u64, Vec<(u32, Bytes)>)> = futures::stream::iter(by_file)
        .map(|(file, reqs)| async move {
            let path = file_path(dir, &file);
            let ranges: Vec<_> = reqs.iter().map(|r| r.range.clone()).collect();
            let data = store
                .get_ranges(&path, &ranges)
                .await
                .map_err(|e| SnapshotError::store("range read", &path, e))?;
            let received: u64 = data.iter().map(|b| b.len() as u64).sum();
            let mut blocks = Vec::new();
            for (req, buf) in reqs.iter().zip(data) {
                let groups = &manifest.key_groups[req.groups.clone()];
                blocks.extend(split_blocks(&path, req.range.start, groups, buf)?);
            }
            Ok::<_, SnapshotError>((received, blocks))
        })
        .buffer_unordered(FILES_AT_ONCE)
        .try_collect()
        .await?;

    let in_range = &manifest.key_groups[range.start as usize..=range.end as usize];
    let (delta_bytes, mut deltas) = fetch_deltas(store, dir, in_range).await?;
    let bytes_read = fetched.iter().map(|(received, _)| received).sum::<u64>() + delta_bytes;
    let mut blocks: BTreeMap<u32, Bytes> = fetched.into_iter().flat_map(|(_, b)| b).collect();
    let groups = range
        .iter()
        .filter_map(|g| manifest.group(g))
        .map(|g| RestoredGroup {
            group: g.group,
            entries: g.entries,
            bytes: blocks.remove(&g.group).unwrap_or_default(),
            deltas: deltas.remove(&g.group).unwrap_or_default(),
        })
        .collect();
    Ok(Restore {
        groups,
        bytes_read,
        requests,
    })
}

/// Default upper bound of one range request of [`read_groups_stream`].
pub const STREAM_REQUEST_BYTES: u64 = 8 << 20;

/// One piece of a streamed restore ([`read_groups_stream`]): the blocks of consecutive
/// non-empty groups, each block's length and checksum checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoredChunk {
    /// The blocks, in group order (groups without state are left out).
    pub groups: Vec<RestoredGroup>,
    /// Bytes fetched for this piece (the sum of its blocks' lengths).
    pub bytes_read: u64,
}

/// Splits the range reads of `range` (see [`Manifest::plan_reads`]) at group boundaries into
/// requests of at most `request_bytes` each (a larger block is one request on its own).
pub fn plan_stream_reads(
    manifest: &Manifest,
    range: KeyGroupRange,
    request_bytes: u64,
) -> Result<Vec<super::manifest::ReadRequest>> {
    let limit = request_bytes.max(1);
    let mut out = Vec::new();
    for req in manifest.plan_reads(range)? {
        let mut piece: Option<super::manifest::ReadRequest> = None;
        for idx in req.groups.clone() {
            let Some(g) = manifest.key_groups.get(idx) else {
                break;
            };
            match piece.as_mut() {
                Some(p) if g.length == 0 || p.range.end - p.range.start + g.length <= limit => {
                    p.range.end = p.range.end.max(g.offset + g.length);
                    p.groups.end = idx + 1;
                }
                _ => {
                    out.extend(piece.take());
                    piece = Some(super::manifest::ReadRequest {
                        file: req.file.clone(),
                        range: g.byte_range(),
                        groups: idx..idx + 1,
                    });
                }
            }
        }
        out.extend(piece);
    }
    Ok(out)
}

/// Reads the key groups in `range` like [`read_groups`] (exactly their blocks' bytes), as a
/// stream of pieces in group order: requests of at most `request_bytes` (whole blocks), up to
/// `in_flight` of them fetched ahead of the consumer, so a caller can decode one piece while
/// the next ones are read. A piece is yielded only after each of its blocks' length and checksum
/// matched the manifest; the first mismatch ends the stream with an error naming the file and the
/// group. The stream does not make a restore all-or-nothing by itself: a caller must keep what it
/// decodes aside until the stream has ended without error (as the worker does).
pub fn read_groups_stream<'a>(
    store: &'a dyn ObjectStore,
    dir: &'a Path,
    manifest: &'a Manifest,
    range: KeyGroupRange,
    request_bytes: u64,
    in_flight: usize,
) -> Result<impl futures::Stream<Item = Result<RestoredChunk>> + Send + 'a> {
    let plan = plan_stream_reads(manifest, range, request_bytes)?;
    Ok(futures::stream::iter(plan)
        .map(move |req| async move {
            let path = file_path(dir, &req.file);
            let buf = get_one_range(store, &path, req.range.clone())
                .await
                .map_err(|e| SnapshotError::store("range read", &path, e))?;
            let groups = &manifest.key_groups[req.groups.clone()];
            let (delta_bytes, mut deltas) = fetch_deltas(store, dir, groups).await?;
            let bytes_read = buf.len() as u64 + delta_bytes;
            let mut blocks: BTreeMap<u32, Bytes> =
                split_blocks(&path, req.range.start, groups, buf)?
                    .into_iter()
                    .collect();
            Ok(RestoredChunk {
                groups: groups
                    .iter()
                    .filter(|g| g.stored_bytes() > 0)
                    .map(|g| RestoredGroup {
                        group: g.group,
                        entries: g.entries,
                        bytes: blocks.remove(&g.group).unwrap_or_default(),
                        deltas: deltas.remove(&g.group).unwrap_or_default(),
                    })
                    .collect(),
                bytes_read,
            })
        })
        .buffered(in_flight.max(1)))
}

/// Cuts a fetched buffer (starting at file offset `start`) into the given blocks, checking each
/// block's length and checksum.
fn split_blocks(
    path: &Path,
    start: u64,
    groups: &[GroupEntry],
    buf: Bytes,
) -> Result<Vec<(u32, Bytes)>> {
    let mut out = Vec::with_capacity(groups.len());
    for g in groups.iter().filter(|g| g.length > 0) {
        let from = g.offset - start;
        let to = from + g.length;
        let have = (buf.len() as u64).clamp(from, to);
        if have < to {
            return Err(SnapshotError::BlockLength {
                path: path.to_string(),
                group: g.group,
                expected: g.length,
                actual: have - from,
            });
        }
        let block = buf.slice(from as usize..to as usize);
        check_block(path, g, Crc32c::of(&block))?;
        out.push((g.group, block));
    }
    Ok(out)
}

fn check_block(path: &Path, g: &GroupEntry, actual: Crc32c) -> Result<()> {
    if actual != g.checksum {
        return Err(SnapshotError::BlockChecksum {
            path: path.to_string(),
            group: g.group,
            expected: g.checksum.to_string(),
            actual: actual.to_string(),
        });
    }
    Ok(())
}

/// Every operator-state section of the snapshot in `dir` ([`Manifest::operator_state`]), in
/// subtask order, each checked against its length and checksum before any is returned.
pub async fn read_operator_state(
    store: &dyn ObjectStore,
    dir: &Path,
    manifest: &Manifest,
) -> Result<Vec<Bytes>> {
    let mut out = Vec::with_capacity(manifest.operator_state.len());
    for chunk in manifest.operator_state.chunks(SECTIONS_AT_ONCE) {
        let reads: Vec<_> = chunk
            .iter()
            .map(|o| read_operator_section(store, dir, o))
            .collect();
        out.extend(futures::future::try_join_all(reads).await?);
    }
    Ok(out)
}

/// Operator-state sections read at once (small: one per old subtask).
const SECTIONS_AT_ONCE: usize = 16;

async fn read_operator_section(
    store: &dyn ObjectStore,
    dir: &Path,
    o: &OperatorStateEntry,
) -> Result<Bytes> {
    let path = file_path(dir, &o.file);
    let bytes = get_one_range(store, &path, o.offset..o.offset + o.length)
        .await
        .map_err(|e| SnapshotError::store("read", &path, e))?;
    let part = Part::OperatorState(o.subtask);
    if bytes.len() as u64 != o.length {
        return Err(part.length_error(&path, o.length, bytes.len() as u64));
    }
    let actual = Crc32c::of(&bytes);
    if actual != o.checksum {
        return Err(part.checksum_error(&path, o.checksum, actual));
    }
    Ok(bytes)
}

/// What [`verify`] checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyReport {
    /// The snapshot id.
    pub snapshot_id: u64,
    /// Checkpoint or savepoint.
    pub kind: SnapshotKind,
    /// State files checked (present, size, every block checksum, whole-file checksum).
    pub files: usize,
    /// Key groups checked (all of `0..maxParallelism`).
    pub groups: u32,
    /// Bytes read and checksummed.
    pub bytes_checked: u64,
    /// Keyed entries, per the manifest.
    pub total_keys: u64,
}

/// Fully checks the snapshot in `dir`: the manifest parses and is self-consistent (and matches the
/// directory's kind and id), every state file is present with the manifest's size, and every block
/// checksum and whole-file checksum matches. Files are streamed, so memory stays small. The first
/// problem found is returned as an error naming the file (and group).
pub async fn verify(store: &dyn ObjectStore, dir: &Path) -> Result<VerifyReport> {
    verify_files(store, dir, true).await
}

/// [`verify`], but of the files the snapshot wrote itself only: the files of earlier snapshots
/// an incremental checkpoint refers to are left out (`files` and `bytes_checked` count what was
/// checked). For a pre-staged rescale's stop checkpoint, whose referenced blocks the new workers
/// loaded and checked already.
pub async fn verify_written(store: &dyn ObjectStore, dir: &Path) -> Result<VerifyReport> {
    verify_files(store, dir, false).await
}

async fn verify_files(
    store: &dyn ObjectStore,
    dir: &Path,
    referenced: bool,
) -> Result<VerifyReport> {
    let manifest = read_manifest(store, dir).await?;
    // A directory named like a snapshot (chk-<id>, sp-<id>) must hold that snapshot.
    let name = dir.filename().unwrap_or_default();
    for kind in [SnapshotKind::Checkpoint, SnapshotKind::Savepoint] {
        if let Some(id) = parse_snapshot_dir_name(kind, name)
            && (kind != manifest.kind || id != manifest.snapshot_id)
        {
            return Err(SnapshotError::ManifestInconsistent {
                path: manifest_path(dir).to_string(),
                reason: format!(
                    "it describes {} {} but lies in directory {name}",
                    manifest.kind, manifest.snapshot_id
                ),
            });
        }
    }
    let files: Vec<_> = manifest
        .files
        .iter()
        .filter(|f| referenced || !super::manifest::is_referenced_file(&f.name))
        .collect();
    let checked: Vec<u64> = futures::stream::iter(&files)
        .map(|f| verify_file(store, dir, &manifest, f))
        .buffer_unordered(FILES_AT_ONCE)
        .try_collect()
        .await?;
    Ok(VerifyReport {
        snapshot_id: manifest.snapshot_id,
        kind: manifest.kind,
        files: files.len(),
        groups: manifest.max_parallelism,
        bytes_checked: checked.iter().sum(),
        total_keys: manifest.stats.total_keys,
    })
}

async fn verify_file(
    store: &dyn ObjectStore,
    dir: &Path,
    manifest: &Manifest,
    f: &FileEntry,
) -> Result<u64> {
    let path = file_path(dir, &f.name);
    let size_mismatch = |actual| SnapshotError::SizeMismatch {
        path: path.to_string(),
        expected: f.size,
        actual,
    };
    let meta = store
        .head(&path)
        .await
        .map_err(|e| SnapshotError::store("head", &path, e))?;
    if meta.size != f.size {
        return Err(size_mismatch(meta.size));
    }
    // Every block in this file, in file order (group order, a group's deltas in their order),
    // then the operator-state sections that follow them.
    let mut blocks: Vec<(Part, u64, u64, Crc32c)> = manifest
        .key_groups
        .iter()
        .flat_map(|g| {
            g.blocks()
                .filter(|(file, _, length, _)| *file == f.name && *length > 0)
                .map(|(_, offset, length, checksum)| {
                    (Part::Group(g.group), offset, length, checksum)
                })
        })
        .collect();
    blocks.extend(
        manifest
            .operator_state
            .iter()
            .filter(|o| o.file == f.name && o.length > 0)
            .map(|o| {
                (
                    Part::OperatorState(o.subtask),
                    o.offset,
                    o.length,
                    o.checksum,
                )
            }),
    );
    if is_referenced_file(&f.name) {
        // A file of an earlier snapshot: only the blocks this one uses are checked (the rest
        // may be state that later blocks replaced).
        let mut checked = 0u64;
        for (group, offset, length, checksum) in blocks {
            let buf = get_one_range(store, &path, offset..offset + length)
                .await
                .map_err(|e| SnapshotError::store("read", &path, e))?;
            if buf.len() as u64 != length {
                return Err(group.length_error(&path, length, buf.len() as u64));
            }
            let actual = Crc32c::of(&buf);
            if actual != checksum {
                return Err(group.checksum_error(&path, checksum, actual));
            }
            checked += length;
        }
        return Ok(checked);
    }
    // Read the file in large windows, two in flight: big sequential reads on every store, and
    // memory bounded by two windows per file.
    let windows = (0..f.size)
        .step_by(VERIFY_WINDOW as usize)
        .map(|start| start..(start + VERIFY_WINDOW).min(f.size));
    let mut stream = futures::stream::iter(windows)
        .map(|r| get_one_range(store, &path, r))
        .buffered(2);
    // One pass: every byte is hashed once, into its block's checksum; the blocks tile the file,
    // so the file's checksum is their combination.
    let (mut file_crc, mut block_hash) = (Crc32c::EMPTY, Crc32cHasher::new());
    let (mut pos, mut block) = (0u64, 0usize);
    while let Some(chunk) = stream.next().await {
        let mut chunk = chunk.map_err(|e| SnapshotError::store("read", &path, e))?;
        pos += chunk.len() as u64;
        if pos > f.size {
            return Err(size_mismatch(pos));
        }
        while chunk.has_remaining() {
            // The blocks tile the file (checked with the manifest), so one is always current.
            let Some(&(group, _, length, checksum)) = blocks.get(block) else {
                return Err(size_mismatch(pos));
            };
            let n = (length - block_hash.bytes_hashed()).min(chunk.len() as u64) as usize;
            block_hash.update(&chunk[..n]);
            chunk.advance(n);
            if block_hash.bytes_hashed() == length {
                let crc = block_hash.finish();
                if crc != checksum {
                    return Err(group.checksum_error(&path, checksum, crc));
                }
                file_crc = file_crc.combine(crc, length);
                block_hash = Crc32cHasher::new();
                block += 1;
            }
        }
    }
    if pos != f.size {
        return Err(size_mismatch(pos));
    }
    if block != blocks.len() {
        return Err(size_mismatch(pos));
    }
    let actual = file_crc;
    if actual != f.checksum {
        return Err(SnapshotError::FileChecksum {
            path: path.to_string(),
            expected: f.checksum.to_string(),
            actual: actual.to_string(),
        });
    }
    Ok(pos)
}

/// What a stretch of a state file holds, for the errors of [`verify`].
#[derive(Debug, Clone, Copy)]
enum Part {
    /// A block of this key group.
    Group(u32),
    /// The operator-state section of this subtask.
    OperatorState(u32),
}

impl Part {
    fn checksum_error(self, path: &Path, expected: Crc32c, actual: Crc32c) -> SnapshotError {
        match self {
            Part::Group(group) => SnapshotError::BlockChecksum {
                path: path.to_string(),
                group,
                expected: expected.to_string(),
                actual: actual.to_string(),
            },
            Part::OperatorState(subtask) => SnapshotError::OperatorStateDamaged {
                path: path.to_string(),
                subtask,
                reason: format!("has checksum {actual}, the manifest says {expected}"),
            },
        }
    }

    fn length_error(self, path: &Path, expected: u64, actual: u64) -> SnapshotError {
        match self {
            Part::Group(group) => SnapshotError::BlockLength {
                path: path.to_string(),
                group,
                expected,
                actual,
            },
            Part::OperatorState(subtask) => SnapshotError::OperatorStateDamaged {
                path: path.to_string(),
                subtask,
                reason: format!("read {actual} bytes, the manifest says {expected}"),
            },
        }
    }
}

/// One range of an object, through `get_ranges` (which the `file://` store implements without
/// zero-filling the buffer first; other stores answer it with the same request as `get_range`).
async fn get_one_range(
    store: &dyn ObjectStore,
    path: &Path,
    range: std::ops::Range<u64>,
) -> object_store::Result<Bytes> {
    let mut got = store.get_ranges(path, std::slice::from_ref(&range)).await?;
    match (got.pop(), got.is_empty()) {
        (Some(b), true) => Ok(b),
        (_, _) => Err(object_store::Error::Generic {
            store: "snapshot reader",
            source: format!("range {range:?} of {path}: the store did not return one piece").into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::manifest::{FileLayout, JobIdentity, SnapshotMeta};
    use keyshift_core::keygroup::Assignment;

    fn manifest() -> Manifest {
        let a = Assignment::new(2, 4).unwrap();
        let parts = (0..2)
            .map(|i| {
                let mut layout = FileLayout::new(a, i).unwrap();
                for g in a.range(i).iter() {
                    let block = vec![g as u8; 3 + g as usize];
                    layout
                        .push(g, block.len() as u64, Crc32c::of(&block), 2)
                        .unwrap();
                }
                layout.finish()
            })
            .collect();
        let meta = SnapshotMeta {
            job: JobIdentity {
                namespace: "ns".into(),
                name: "job".into(),
                job_fingerprint: "fp".into(),
                layout: None,
            },
            snapshot_id: 7,
            kind: SnapshotKind::Savepoint,
            completed_at: jiff::Timestamp::now(),
            state_schema: "keyshift.agg.v1".into(),
            source_positions: BTreeMap::from([(0, 10), (1, 20)]),
            source_partitions: BTreeMap::new(),
            watermark: None,
        };
        Manifest::assemble(meta, a, parts).unwrap()
    }

    #[test]
    fn a_manifest_carries_its_own_checksum() {
        let m = manifest();
        let sealed = sealed_manifest_json(&m).unwrap();
        let text = String::from_utf8(sealed.clone()).unwrap();
        let own = Crc32c::of(&m.to_json().unwrap());
        assert_eq!(m.content_checksum().unwrap(), own);
        assert!(text.starts_with("{\"formatVersion\":1,"), "{text}");
        assert!(
            text.ends_with(&format!(",\"manifestChecksum\":\"{own}\"}}")),
            "{text}"
        );
        assert_eq!(parse_manifest(&sealed, "p/_manifest.json").unwrap(), m);
        // Re-formatted (pretty, as manifests were written before), same content: accepted.
        let v: serde_json::Value = serde_json::from_slice(&sealed).unwrap();
        let pretty = serde_json::to_vec_pretty(&v).unwrap();
        assert_eq!(parse_manifest(&pretty, "p/_manifest.json").unwrap(), m);
        // Written before manifests carried a checksum: read as before.
        assert_eq!(
            parse_manifest(&m.to_json().unwrap(), "p/_manifest.json").unwrap(),
            m
        );
    }

    #[test]
    fn a_changed_digit_that_still_adds_up_is_refused() {
        let m = manifest();
        let text = String::from_utf8(sealed_manifest_json(&m).unwrap()).unwrap();
        // Partition 0's position 10 -> 11: valid JSON, a consistent manifest, another history.
        let flipped = text.replacen("\"0\":10", "\"0\":11", 1);
        assert_ne!(flipped, text);
        let lax = Manifest::from_json(flipped.as_bytes(), "p/_manifest.json").unwrap();
        assert_eq!(lax.source_positions[&0], 11);
        let err = parse_manifest(flipped.as_bytes(), "p/_manifest.json").unwrap_err();
        assert!(
            matches!(err, SnapshotError::ManifestInconsistent { .. }),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("p/_manifest.json") && msg.contains("own checksum"),
            "{msg}"
        );
        // A checksum that is not one is a corrupt manifest.
        let garbled = text.replace(
            &format!("\"{}\"}}", Crc32c::of(&m.to_json().unwrap())),
            "\"xyz\"}",
        );
        assert!(matches!(
            parse_manifest(garbled.as_bytes(), "p/_manifest.json"),
            Err(SnapshotError::ManifestCorrupt { .. })
        ));
    }

    /// The manifest of 32768 key groups with every chain at the longest the chain policy
    /// allows there, every number and name at its widest, stays under half of what a manifest
    /// may be; one above the bound is refused before it is written.
    #[test]
    fn the_widest_manifest_stays_well_under_its_bound_and_a_larger_one_is_refused() {
        use crate::runtime::incremental::ChainPolicy;
        use crate::snapshot::{DeltaBlock, FileEntry, GroupEntry};
        let groups = keyshift_core::keygroup::UPPER_BOUND_MAX_PARALLELISM;
        let deltas = ChainPolicy::deltas_cap(groups);
        let mut m = manifest();
        m.max_parallelism = groups;
        m.parallelism = 999;
        let wide = |i: u64| format!("checkpoints/chk-{}/state-998-of-999.bin", u64::MAX - i);
        m.key_groups = (0..groups)
            .map(|g| GroupEntry {
                group: g,
                file: "state-998-of-999.bin".into(),
                offset: u64::MAX / 3,
                length: u64::MAX / 3,
                checksum: Crc32c(u32::MAX),
                entries: u64::MAX / 3,
                deltas: (0..deltas as u64)
                    .map(|i| DeltaBlock {
                        file: wide(i),
                        offset: u64::MAX / 3,
                        length: u64::MAX / 3,
                        checksum: Crc32c(u32::MAX),
                        entries: u64::MAX / 3,
                    })
                    .collect(),
            })
            .collect();
        m.files = (0..deltas as u64)
            .map(|i| FileEntry {
                name: wide(i),
                size: u64::MAX / 3,
                checksum: Crc32c(u32::MAX),
            })
            .collect();
        let path = Path::from("ns/job/checkpoints/chk-7");
        let json = bounded_manifest_json(&m, &path, MAX_MANIFEST_BYTES).unwrap();
        assert!(
            (json.len() as u64) < MAX_MANIFEST_BYTES / 2,
            "{} bytes for {} blocks",
            json.len(),
            m.block_count()
        );
        assert_eq!(m.block_count(), u64::from(groups) * (deltas as u64 + 1));
        // The same manifest under a bound it does not fit: refused, naming the fix.
        let err = bounded_manifest_json(&m, &path, json.len() as u64 - 1).unwrap_err();
        assert!(
            matches!(err, SnapshotError::ManifestTooLargeToWrite { size, .. } if size == json.len() as u64),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains("chk-7") && msg.contains("maxDeltas"), "{msg}");
    }
}
