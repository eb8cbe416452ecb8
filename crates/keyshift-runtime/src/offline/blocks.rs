//! Streaming a snapshot's key-group blocks in group order with bounded memory, and checking each
//! block against the manifest.
//!
//! The blocks of the requested groups are fetched as large range reads ("windows" of adjacent
//! blocks of one file, up to [`WINDOW_BYTES`], a larger block alone) by a background task that
//! keeps two windows in flight; every block's length and CRC-32C are checked against the
//! manifest before it is handed out. Memory is bounded by a few windows (or the largest block).

use super::error::{Result, ToolError};
use crate::job::state_codec::BlockHeader;
use crate::snapshot::{Crc32c, GroupEntry, Manifest, ObjectStore, Path, SnapshotError};
use bytes::Bytes;
use futures::StreamExt;
use keyshift_core::spec::AggregateFunction;
use object_store::ObjectStoreExt;
use std::ops::Range;
use std::sync::Arc;
use tokio::sync::mpsc;

/// Target size of one range read.
pub const WINDOW_BYTES: u64 = 16 * 1024 * 1024;
/// Range reads in flight (and fetched windows queued) per stream.
const WINDOWS_IN_FLIGHT: usize = 2;

/// One key group's block, checked against its manifest entry.
#[derive(Debug, Clone)]
pub struct Block {
    /// The key group.
    pub group: u32,
    /// The state file holding it.
    pub file: Arc<str>,
    /// Entries per the manifest.
    pub entries: u64,
    /// The block's bytes.
    pub bytes: Bytes,
}

/// One range read: adjacent non-empty blocks of one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    /// The file.
    pub file: Arc<str>,
    /// Its byte range.
    pub range: Range<u64>,
    /// The groups inside, in order (indices into the manifest's `keyGroups`).
    pub groups: Vec<u32>,
}

/// Plans the range reads fetching the non-empty blocks of `groups` (in the given order, which
/// callers keep increasing), coalescing blocks adjacent in one file up to `max` bytes a read.
pub fn plan_windows(
    manifest: &Manifest,
    groups: impl IntoIterator<Item = u32>,
    max: u64,
) -> Vec<Window> {
    let mut out: Vec<Window> = Vec::new();
    for g in groups {
        let Some(e) = manifest.group(g) else { continue };
        if e.length == 0 {
            continue;
        }
        match out.last_mut() {
            Some(w)
                if *w.file == *e.file
                    && w.range.end == e.offset
                    && w.range.end - w.range.start + e.length <= max =>
            {
                w.range.end += e.length;
                w.groups.push(g);
            }
            _ => out.push(Window {
                file: Arc::from(e.file.as_str()),
                range: e.byte_range(),
                groups: vec![g],
            }),
        }
    }
    out
}

/// Fetches the windows in order in a background task, two in flight, and hands out their checked
/// blocks. The stream ends after the first error (which it yields).
pub fn read_windows(
    store: Arc<dyn ObjectStore>,
    dir: Path,
    manifest: Arc<Manifest>,
    windows: Vec<Window>,
) -> mpsc::Receiver<Result<Vec<Block>, SnapshotError>> {
    let (tx, rx) = mpsc::channel(WINDOWS_IN_FLIGHT);
    tokio::spawn(async move {
        let mut fetches = futures::stream::iter(windows)
            .map(|w| fetch_window(store.as_ref(), &dir, &manifest, w))
            .buffered(WINDOWS_IN_FLIGHT);
        while let Some(result) = fetches.next().await {
            let failed = result.is_err();
            if tx.send(result).await.is_err() || failed {
                return;
            }
        }
    });
    rx
}

async fn fetch_window(
    store: &dyn ObjectStore,
    dir: &Path,
    manifest: &Manifest,
    w: Window,
) -> Result<Vec<Block>, SnapshotError> {
    let path = crate::snapshot::file_path(dir, &w.file);
    let data = store
        .get_range(&path, w.range.clone())
        .await
        .map_err(|e| SnapshotError::store("range read", &path, e))?;
    let mut blocks = split_window(&path, manifest, &w, data)?;
    // Groups of an incremental checkpoint with delta blocks: merged into one block each, so
    // that every tool sees a group as one block of its whole state.
    let chained: Vec<GroupEntry> = w
        .groups
        .iter()
        .filter_map(|g| manifest.group(*g))
        .filter(|e| !e.deltas.is_empty())
        .cloned()
        .collect();
    if chained.is_empty() {
        return Ok(blocks);
    }
    let (_, mut deltas) = crate::snapshot::fetch_deltas(store, dir, &chained).await?;
    for b in &mut blocks {
        if let Some(d) = deltas.remove(&b.group) {
            let (merged, entries) =
                crate::job::state_codec::merge_chain(&b.bytes, &d).map_err(|e| {
                    SnapshotError::ChainUnreadable {
                        path: path.to_string(),
                        group: b.group,
                        reason: e.to_string(),
                    }
                })?;
            b.bytes = Bytes::from(merged);
            b.entries = entries;
        }
    }
    Ok(blocks)
}

/// Cuts a fetched window into its blocks, checking each block's length and CRC-32C.
fn split_window(
    path: &Path,
    manifest: &Manifest,
    w: &Window,
    data: Bytes,
) -> Result<Vec<Block>, SnapshotError> {
    let mut out = Vec::with_capacity(w.groups.len());
    for &g in &w.groups {
        let Some(e) = manifest.group(g) else { continue };
        let from = e.offset - w.range.start;
        let to = from + e.length;
        if (data.len() as u64) < to {
            return Err(SnapshotError::BlockLength {
                path: path.to_string(),
                group: g,
                expected: e.length,
                actual: (data.len() as u64).saturating_sub(from),
            });
        }
        let bytes = data.slice(from as usize..to as usize);
        let actual = Crc32c::of(&bytes);
        if actual != e.checksum {
            return Err(SnapshotError::BlockChecksum {
                path: path.to_string(),
                group: g,
                expected: e.checksum.to_string(),
                actual: actual.to_string(),
            });
        }
        out.push(Block {
            group: g,
            file: w.file.clone(),
            entries: e.entries,
            bytes,
        });
    }
    Ok(out)
}

/// The operator shape every block of a snapshot shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// The aggregate function.
    pub function: AggregateFunction,
    /// The tumbling window size, if windowed.
    pub window_size_ms: Option<i64>,
    /// The first group seen with this shape (for messages).
    pub first_group: u32,
}

/// Checks a decoded block header against the manifest entry and the shape of the blocks seen
/// before (recording it at the first block).
pub fn check_header(
    manifest: &Manifest,
    entry: &GroupEntry,
    header: &BlockHeader,
    shape: &mut Option<Shape>,
) -> Result<()> {
    let mismatch = |what, block: String, manifest: String| ToolError::BlockMismatch {
        file: entry.file.clone(),
        group: entry.group,
        what,
        block,
        manifest,
    };
    if header.schema != manifest.state_schema {
        return Err(mismatch(
            "the state schema",
            format!("{:?}", header.schema),
            format!("{:?}", manifest.state_schema),
        ));
    }
    if header.info.max_parallelism != manifest.max_parallelism {
        return Err(mismatch(
            "maxParallelism",
            header.info.max_parallelism.to_string(),
            manifest.max_parallelism.to_string(),
        ));
    }
    if header.info.key_group != entry.group {
        return Err(mismatch(
            "the key group",
            header.info.key_group.to_string(),
            entry.group.to_string(),
        ));
    }
    if header.entries != entry.entries {
        return Err(mismatch(
            "the entry count",
            header.entries.to_string(),
            entry.entries.to_string(),
        ));
    }
    match shape {
        None => {
            *shape = Some(Shape {
                function: header.info.function,
                window_size_ms: header.info.window_size_ms,
                first_group: entry.group,
            });
        }
        Some(s) => {
            let mixed = |what, found: String, expected: String| ToolError::MixedBlocks {
                file: entry.file.clone(),
                group: entry.group,
                what,
                found,
                first_group: s.first_group,
                expected,
            };
            if s.function != header.info.function {
                return Err(mixed(
                    "aggregate function",
                    super::function_name(header.info.function),
                    super::function_name(s.function),
                ));
            }
            if s.window_size_ms != header.info.window_size_ms {
                return Err(mixed(
                    "window size",
                    super::window_words(header.info.window_size_ms),
                    super::window_words(s.window_size_ms),
                ));
            }
        }
    }
    Ok(())
}

/// Runs CPU-heavy or blocking work off the async workers.
pub async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    Ok(tokio::task::spawn_blocking(f).await?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::{FileEntry, JobIdentity, SnapshotKind, Stats};
    use std::collections::BTreeMap;

    fn manifest(lengths: &[(u64, &str)]) -> Manifest {
        let mut offsets: BTreeMap<&str, u64> = BTreeMap::new();
        let key_groups = lengths
            .iter()
            .enumerate()
            .map(|(g, (len, file))| {
                let off = offsets.entry(file).or_insert(0);
                let e = GroupEntry {
                    group: g as u32,
                    file: (*file).to_owned(),
                    offset: *off,
                    length: *len,
                    checksum: Crc32c::EMPTY,
                    entries: 0,
                    deltas: Vec::new(),
                };
                *off += len;
                e
            })
            .collect();
        Manifest {
            format_version: 1,
            job: JobIdentity {
                namespace: "n".into(),
                name: "j".into(),
                job_fingerprint: String::new(),
                layout: None,
            },
            snapshot_id: 1,
            kind: SnapshotKind::Savepoint,
            completed_at: jiff::Timestamp::now(),
            max_parallelism: lengths.len() as u32,
            parallelism: 2,
            state_schema: "s".into(),
            checksum_algorithm: "crc32c".into(),
            source_positions: BTreeMap::new(),
            source_partitions: BTreeMap::new(),
            watermark: None,
            stats: Stats::default(),
            files: offsets
                .iter()
                .map(|(f, size)| FileEntry {
                    name: (*f).to_owned(),
                    size: *size,
                    checksum: Crc32c::EMPTY,
                })
                .collect(),
            key_groups,
            operator_state: Vec::new(),
        }
    }

    #[test]
    fn windows_coalesce_adjacent_blocks_up_to_the_limit() {
        let m = manifest(&[(5, "a"), (0, "a"), (7, "a"), (20, "a"), (3, "b"), (4, "b")]);
        let w = plan_windows(&m, 0..6, 12);
        let got: Vec<(&str, Range<u64>, Vec<u32>)> = w
            .iter()
            .map(|w| (&*w.file, w.range.clone(), w.groups.clone()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("a", 0..12, vec![0, 2]),
                ("a", 12..32, vec![3]),
                ("b", 0..7, vec![4, 5]),
            ]
        );
        let w = plan_windows(&m, [2, 4], 100);
        assert_eq!(w.len(), 2);
        assert!(plan_windows(&m, [1], 100).is_empty());
    }
}
