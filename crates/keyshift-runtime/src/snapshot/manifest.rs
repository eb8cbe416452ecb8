//! The manifest (`_manifest.json`, `formatVersion: 1`) and the pure format logic around it:
//! laying out a state file's key-group blocks, assembling a manifest from the subtasks' parts,
//! checking a manifest for self-consistency, and planning the range reads of a restore.
//!
//! Nothing here does I/O.

use super::checksum::Crc32c;
use super::error::{Result, SnapshotError};
use super::layout::{MANIFEST_FILE, SnapshotKind, state_file_name};
use jiff::Timestamp;
use keyshift_core::keygroup::{Assignment, KeyGroupRange};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

/// The newest manifest format this build writes and reads: 2 adds incremental checkpoints
/// (blocks in other snapshots' files, and per-group delta blocks). A self-contained snapshot is
/// still written as [`FULL_FORMAT_VERSION`], so older builds read it.
pub const FORMAT_VERSION: u32 = 2;
/// The format of a self-contained manifest (every block in its own files, no deltas).
pub const FULL_FORMAT_VERSION: u32 = 1;
/// The format of a manifest with operator-state sections ([`Manifest::operator_state`]); a
/// build that does not know them refuses it instead of restoring without them.
pub const OPERATOR_STATE_FORMAT_VERSION: u32 = 3;
/// The checksum algorithm of every block and file checksum in a v1 manifest.
pub const CHECKSUM_ALGORITHM: &str = "crc32c";

/// Which job a snapshot belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JobIdentity {
    /// Kubernetes namespace of the StreamJob.
    pub namespace: String,
    /// Name of the StreamJob.
    pub name: String,
    /// Caller-defined fingerprint of the job's logic (source, key, aggregation...), so a restore
    /// can refuse state written by an incompatible job.
    pub job_fingerprint: String,
    /// What the snapshot's keyed state means (absent in snapshots of older versions): a restore
    /// compares it with the job before anything stops.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<StateLayout>,
}

impl JobIdentity {
    /// Whether this is the StreamJob `namespace/name`'s (whatever its fingerprint and layout).
    pub fn is(&self, namespace: &str, name: &str) -> bool {
        self.namespace == namespace && self.name == name
    }
}

/// What a job's keyed state means: how keys are taken and hashed, and what each key's value
/// accumulates. Two jobs with the same layout can continue each other's state; any difference
/// means the state holds another history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StateLayout {
    /// The record field keys are taken from.
    pub key_field: String,
    /// How keys are hashed into key groups (`string`, `long`, `int`).
    pub key_type: String,
    /// The aggregate function (`count`, `sum`, `min`, `max`).
    pub function: String,
    /// The record field the aggregate reads (none for `count`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_field: Option<String>,
    /// The tumbling window's length in milliseconds (none for an all-time aggregate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_ms: Option<u64>,
    /// The program whose keyed step keeps the state (`spec.job.program.name`; none for the
    /// built-in aggregation, which the fields above describe: they are empty for a program,
    /// whose blocks name its step, key type and states themselves).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub program: Option<String>,
}

/// One difference between the layout a snapshot's state has and the layout a job expects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutChange {
    /// Which part of the layout differs, as the StreamJob field that sets it.
    pub field: &'static str,
    /// In the snapshot.
    pub snapshot: String,
    /// In the job.
    pub job: String,
    /// Whether the state can be restored anyway (an opt-in keeps it): false when the state's
    /// encoding cannot be read under the job's (another function or window).
    pub keepable: bool,
}

impl std::fmt::Display for LayoutChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} is {} in the snapshot, {} in the job",
            self.field, self.snapshot, self.job
        )
    }
}

impl StateLayout {
    /// Every difference between this (a snapshot's) layout and `job`'s, in a fixed order. Pure.
    pub fn changes(&self, job: &StateLayout) -> Vec<LayoutChange> {
        fn show(v: Option<impl ToString>) -> String {
            v.map_or_else(|| "unset".to_owned(), |v| format!("{:?}", v.to_string()))
        }
        let mut out = Vec::new();
        let mut diff = |field, snapshot: String, job: String, keepable| {
            if snapshot != job {
                out.push(LayoutChange {
                    field,
                    snapshot,
                    job,
                    keepable,
                });
            }
        };
        diff(
            "spec.job.program.name",
            show(self.program.as_ref()),
            show(job.program.as_ref()),
            false,
        );
        diff(
            "spec.job.key.field",
            show(Some(&self.key_field)),
            show(Some(&job.key_field)),
            true,
        );
        diff(
            "spec.job.key.type",
            show(Some(&self.key_type)),
            show(Some(&job.key_type)),
            true,
        );
        diff(
            "spec.job.aggregation.function",
            show(Some(&self.function)),
            show(Some(&job.function)),
            false,
        );
        diff(
            "spec.job.aggregation.field",
            show(self.value_field.as_ref()),
            show(job.value_field.as_ref()),
            true,
        );
        diff(
            "spec.job.window.size",
            self.window_ms.map_or("unset".into(), |w| format!("{w} ms")),
            job.window_ms.map_or("unset".into(), |w| format!("{w} ms")),
            false,
        );
        out
    }
}

/// Where one key group's state lives: a block of `length` bytes at `offset` in `file`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupEntry {
    /// The key group, `0..maxParallelism`.
    pub group: u32,
    /// The state file's name, relative to the snapshot directory.
    pub file: String,
    /// Byte offset of the block in the file.
    pub offset: u64,
    /// Byte length of the block (0 for a group with no state).
    pub length: u64,
    /// CRC-32C of the block's bytes.
    pub checksum: Crc32c,
    /// Number of keyed entries in the block (as reported by the writer); with `deltas`, the
    /// group's keys once they are applied.
    pub entries: u64,
    /// Incremental checkpoints (formatVersion 2): blocks written after the first one, each
    /// holding the keys of the group changed since the block before it, with their whole state.
    /// A restore applies them in order over the first block (a key in a later block replaces the
    /// same key's state). Empty: the first block is the whole group.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deltas: Vec<DeltaBlock>,
}

/// A delta block of a key group (see [`GroupEntry::deltas`]): `length` bytes at `offset` in
/// `file` (named like [`GroupEntry::file`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeltaBlock {
    /// The state file (see [`GroupEntry::file`]).
    pub file: String,
    /// Byte offset of the block in the file.
    pub offset: u64,
    /// Byte length of the block (never 0).
    pub length: u64,
    /// CRC-32C of the block's bytes.
    pub checksum: Crc32c,
    /// Keyed entries in this block.
    pub entries: u64,
}

impl DeltaBlock {
    /// The block's byte range in its file.
    pub fn byte_range(&self) -> Range<u64> {
        self.offset..self.offset + self.length
    }
}

impl GroupEntry {
    /// The block's byte range in its file.
    pub fn byte_range(&self) -> Range<u64> {
        self.offset..self.offset + self.length
    }

    /// Bytes a restore of this group reads: its block and its deltas.
    pub fn stored_bytes(&self) -> u64 {
        self.deltas
            .iter()
            .fold(self.length, |sum, d| sum.saturating_add(d.length))
    }

    /// Every block of the group in the order a restore applies them: `(file, offset, length,
    /// checksum)`; the first block may be empty.
    pub fn blocks(&self) -> impl Iterator<Item = (&str, u64, u64, Crc32c)> {
        std::iter::once((self.file.as_str(), self.offset, self.length, self.checksum)).chain(
            self.deltas
                .iter()
                .map(|d| (d.file.as_str(), d.offset, d.length, d.checksum)),
        )
    }
}

/// Whether a manifest's file name names a file of another snapshot of the same job (incremental
/// checkpoints): `checkpoints/chk-<id>/<name>` or `savepoints/sp-<id>/<name>`, relative to the
/// job directory. Plain names are files of the snapshot's own directory.
pub fn is_referenced_file(name: &str) -> bool {
    name.contains('/')
}

/// Splits a referenced file name (see [`is_referenced_file`]) into the snapshot it lies in and
/// its plain name; `None` unless it has exactly that form.
pub fn split_referenced_file(name: &str) -> Option<(SnapshotKind, u64, &str)> {
    let mut parts = name.split('/');
    let (folder, dir, file) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || !is_plain_file_name(file) {
        return None;
    }
    let kind = [SnapshotKind::Checkpoint, SnapshotKind::Savepoint]
        .into_iter()
        .find(|k| k.folder() == folder)?;
    let id = super::layout::parse_snapshot_dir_name(kind, dir)?;
    Some((kind, id, file))
}

/// The name by which a later snapshot refers to `file` of snapshot `kind`/`id` (already a
/// referenced name: kept as it is).
pub fn referenced_file_name(kind: SnapshotKind, id: u64, file: &str) -> String {
    if is_referenced_file(file) {
        return file.to_owned();
    }
    format!("{}/{file}", kind.relative_dir(id))
}

/// One state file of the snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FileEntry {
    /// File name relative to the snapshot directory.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// CRC-32C of the whole file.
    pub checksum: Crc32c,
}

/// Totals over the snapshot, plus free-form fields a writer may add.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Stats {
    /// Sum of all block lengths (= sum of file sizes).
    pub total_bytes: u64,
    /// Sum of all blocks' entry counts.
    pub total_keys: u64,
    /// Key groups holding at least one byte.
    pub non_empty_groups: u32,
    /// Bytes in the snapshot's own files (formatVersion 2; in a self-contained snapshot it is
    /// `totalBytes`): what the snapshot wrote.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub written_bytes: Option<u64>,
    /// Anything else (free-form), kept on read and re-written as is.
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

/// Where one subtask's operator-state section lies: the state a program's keyed step keeps per
/// subtask rather than per key ([`keyshift_sdk::operator_state`]), written whole with every
/// snapshot after the subtask's key groups, in a state file of the snapshot itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OperatorStateEntry {
    /// The subtask that wrote it.
    pub subtask: u32,
    /// The parallelism of the run that wrote it (a rewrite keeps the sections of the run it
    /// read, whatever its own parallelism).
    pub parallelism: u32,
    /// The state file it lies in (one of this snapshot's own).
    pub file: String,
    /// Byte offset in the file.
    pub offset: u64,
    /// Length in bytes.
    pub length: u64,
    /// CRC32C of the section's bytes.
    pub checksum: Crc32c,
}

/// The manifest of a committed snapshot. Its presence is what makes a snapshot exist.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    /// Always [`FORMAT_VERSION`] for manifests this build writes.
    pub format_version: u32,
    /// The job the snapshot belongs to.
    pub job: JobIdentity,
    /// The snapshot (checkpoint) id; unique per job and kind, increasing.
    pub snapshot_id: u64,
    /// Checkpoint or savepoint.
    pub kind: SnapshotKind,
    /// When the coordinator completed the snapshot (RFC 3339, UTC).
    pub completed_at: Timestamp,
    /// The key-group count.
    pub max_parallelism: u32,
    /// The parallelism the snapshot was taken at (one state file per subtask).
    pub parallelism: u32,
    /// Identity of the state encoding inside the blocks, e.g. `keyshift.agg.v1`.
    pub state_schema: String,
    /// Always [`CHECKSUM_ALGORITHM`].
    pub checksum_algorithm: String,
    /// Per source partition, the position to resume from (e.g. the next offset to read).
    pub source_positions: BTreeMap<u32, u64>,
    /// Per source partition (keyed like `sourcePositions`), its identity: for a file source the
    /// file's name relative to the source directory, so that a restore finds each position's
    /// file even when files were added or removed since. Empty when partitions are their
    /// indexes (the generator), and in manifests written before names were recorded.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub source_partitions: BTreeMap<u32, String>,
    /// The event-time watermark at the snapshot, in epoch milliseconds.
    pub watermark: Option<i64>,
    /// Totals.
    pub stats: Stats,
    /// Every state file, in subtask order.
    pub files: Vec<FileEntry>,
    /// Every key group `0..maxParallelism`, in group order.
    pub key_groups: Vec<GroupEntry>,
    /// One operator-state section per subtask of the run that wrote them, in subtask order;
    /// empty when the job keeps no operator state. A manifest with sections is
    /// [`OPERATOR_STATE_FORMAT_VERSION`], so a build that cannot restore them refuses it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub operator_state: Vec<OperatorStateEntry>,
}

/// What the coordinator knows about a snapshot besides the subtasks' files.
#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotMeta {
    /// The job.
    pub job: JobIdentity,
    /// The snapshot id.
    pub snapshot_id: u64,
    /// Checkpoint or savepoint.
    pub kind: SnapshotKind,
    /// Completion time (usually `Timestamp::now()` when the last ack arrived).
    pub completed_at: Timestamp,
    /// Identity of the state encoding, e.g. `keyshift.agg.v1`.
    pub state_schema: String,
    /// Per source partition, the position to resume from.
    pub source_positions: BTreeMap<u32, u64>,
    /// Per source partition, its name (file sources; empty for the generator). See
    /// [`Manifest::source_partitions`].
    pub source_partitions: BTreeMap<u32, String>,
    /// The watermark (epoch ms), if any.
    pub watermark: Option<i64>,
}

/// What one subtask acknowledges after writing its state file: the file and where each of its
/// key groups sits in it. Serialisable so it can travel over the control API.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SubtaskSnapshot {
    /// The subtask index.
    pub subtask: u32,
    /// The parallelism it ran at.
    pub parallelism: u32,
    /// The key-group count.
    pub max_parallelism: u32,
    /// The state file it wrote.
    pub file: FileEntry,
    /// Every group of its range, in order (empty groups have length 0).
    pub groups: Vec<GroupEntry>,
    /// Files of earlier snapshots its groups' blocks lie in (incremental checkpoints), named as
    /// [`referenced_file_name`] says, with their size and checksum.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub referenced: Vec<FileEntry>,
    /// The operator-state sections it wrote after its groups (one for a worker's own; a
    /// rewrite may place several in one file).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub operator_state: Vec<OperatorStateEntry>,
}

impl SubtaskSnapshot {
    /// Total keyed entries in the file.
    pub fn entries(&self) -> u64 {
        self.groups
            .iter()
            .fold(0u64, |sum, g| sum.saturating_add(g.entries))
    }
}

/// One range read of a restore: bytes `range` of `file`, holding the blocks of
/// `manifest.key_groups[groups]` (zero-length blocks in between included).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadRequest {
    /// The state file.
    pub file: String,
    /// The byte range to fetch.
    pub range: Range<u64>,
    /// Indices into `key_groups` (= group numbers) of the blocks inside `range`.
    pub groups: Range<usize>,
}

/// The pure part of writing one state file: assigns offsets to blocks as they come, fills the
/// gaps with empty groups and accumulates the file checksum from the block checksums.
#[derive(Debug, Clone)]
pub(crate) struct FileLayout {
    assignment: Assignment,
    subtask: u32,
    range: KeyGroupRange,
    file: String,
    next_group: u32,
    offset: u64,
    file_checksum: Crc32c,
    groups: Vec<GroupEntry>,
    referenced: BTreeMap<String, FileEntry>,
    operator_state: Vec<OperatorStateEntry>,
}

impl FileLayout {
    /// Starts the layout of `subtask`'s file.
    pub(crate) fn new(assignment: Assignment, subtask: u32) -> Result<Self> {
        if subtask >= assignment.parallelism() {
            return Err(SnapshotError::NoSuchSubtask {
                subtask,
                parallelism: assignment.parallelism(),
            });
        }
        let range = assignment.range(subtask);
        Ok(FileLayout {
            assignment,
            subtask,
            range,
            file: state_file_name(subtask, assignment.parallelism()),
            next_group: range.start,
            offset: 0,
            file_checksum: Crc32c::EMPTY,
            groups: Vec::with_capacity(range.len() as usize),
            referenced: BTreeMap::new(),
            operator_state: Vec::new(),
        })
    }

    /// The state file's name.
    pub(crate) fn file_name(&self) -> &str {
        &self.file
    }

    /// Checks that `group` may come next (inside the range, after the previous one).
    pub(crate) fn check_next(&self, group: u32) -> Result<()> {
        if group < self.next_group || group > self.range.end {
            return Err(SnapshotError::GroupOutOfOrder {
                subtask: self.subtask,
                range: self.range,
                group,
                next: self.next_group,
            });
        }
        Ok(())
    }

    /// Records the block of `group` (call [`check_next`](Self::check_next) first).
    pub(crate) fn push(
        &mut self,
        group: u32,
        length: u64,
        checksum: Crc32c,
        entries: u64,
    ) -> Result<()> {
        self.check_next(group)?;
        self.fill_empty_until(group);
        self.groups.push(GroupEntry {
            group,
            file: self.file.clone(),
            offset: self.offset,
            length,
            checksum,
            entries,
            deltas: Vec::new(),
        });
        self.offset += length;
        self.file_checksum = self.file_checksum.combine(checksum, length);
        self.next_group = group + 1;
        Ok(())
    }

    /// Records a group whose blocks lie (at least partly) in earlier snapshots' files: `prior`
    /// (its entry in the snapshot this one builds on, files named as [`referenced_file_name`]
    /// says, which lie in `files`), followed, if `delta` is given, by a new delta block
    /// `(length, checksum, entries in it)` at the next offset of this file; `keys` is the
    /// group's key count. Call [`check_next`](Self::check_next) first.
    pub(crate) fn push_on(
        &mut self,
        mut prior: GroupEntry,
        delta: Option<(u64, Crc32c, u64)>,
        keys: u64,
        files: &BTreeMap<String, FileEntry>,
    ) -> Result<()> {
        let group = prior.group;
        self.check_next(group)?;
        let mut names: Vec<&str> = prior.deltas.iter().map(|d| d.file.as_str()).collect();
        if prior.length > 0 || !prior.deltas.is_empty() {
            names.push(prior.file.as_str());
        }
        for name in names {
            let entry = files.get(name).filter(|_| is_referenced_file(name)).ok_or_else(|| {
                SnapshotError::Assemble(format!(
                    "key group {group} builds on file {name:?}, which is not a known file of an earlier snapshot"
                ))
            })?;
            self.referenced.insert(name.to_owned(), entry.clone());
        }
        self.fill_empty_until(group);
        if let Some((length, checksum, entries)) = delta.filter(|d| d.0 > 0) {
            prior.deltas.push(DeltaBlock {
                file: self.file.clone(),
                offset: self.offset,
                length,
                checksum,
                entries,
            });
            self.offset += length;
            self.file_checksum = self.file_checksum.combine(checksum, length);
        }
        prior.entries = keys;
        self.groups.push(prior);
        self.next_group = group + 1;
        Ok(())
    }

    /// Records an operator-state section written by `subtask` of `parallelism` at the next
    /// offset. The groups not pushed yet are empty: none may follow.
    pub(crate) fn push_operator_state(
        &mut self,
        subtask: u32,
        parallelism: u32,
        length: u64,
        checksum: Crc32c,
    ) {
        self.fill_empty_until(self.range.end + 1);
        self.operator_state.push(OperatorStateEntry {
            subtask,
            parallelism,
            file: self.file.clone(),
            offset: self.offset,
            length,
            checksum,
        });
        self.offset += length;
        self.file_checksum = self.file_checksum.combine(checksum, length);
    }

    fn fill_empty_until(&mut self, group: u32) {
        while self.next_group < group {
            self.groups.push(GroupEntry {
                group: self.next_group,
                file: self.file.clone(),
                offset: self.offset,
                length: 0,
                checksum: Crc32c::EMPTY,
                entries: 0,
                deltas: Vec::new(),
            });
            self.next_group += 1;
        }
    }

    /// Completes the layout: the groups not pushed are empty.
    pub(crate) fn finish(mut self) -> SubtaskSnapshot {
        self.fill_empty_until(self.range.end + 1);
        SubtaskSnapshot {
            subtask: self.subtask,
            parallelism: self.assignment.parallelism(),
            max_parallelism: self.assignment.max_parallelism(),
            file: FileEntry {
                name: self.file,
                size: self.offset,
                checksum: self.file_checksum,
            },
            groups: self.groups,
            referenced: self.referenced.into_values().collect(),
            operator_state: self.operator_state,
        }
    }
}

impl Manifest {
    /// Bytes of the files this snapshot wrote itself (an incremental checkpoint's delta; all of
    /// a self-contained snapshot), leaving out the files of earlier snapshots it refers to.
    pub fn written_bytes(&self) -> u64 {
        self.files
            .iter()
            .filter(|f| !is_referenced_file(&f.name))
            .map(|f| f.size)
            .sum()
    }

    /// Builds the manifest of a snapshot from the coordinator's metadata and every subtask's ack.
    ///
    /// Fails unless the parts are exactly one per subtask `0..parallelism`, all at the given
    /// assignment, together covering every key group once.
    pub fn assemble(
        meta: SnapshotMeta,
        assignment: Assignment,
        mut subtasks: Vec<SubtaskSnapshot>,
    ) -> Result<Manifest> {
        let (p, max_p) = (assignment.parallelism(), assignment.max_parallelism());
        subtasks.sort_by_key(|s| s.subtask);
        for s in &subtasks {
            if s.parallelism != p || s.max_parallelism != max_p {
                return Err(SnapshotError::Assemble(format!(
                    "subtask {} wrote at parallelism {}/maxParallelism {}, the snapshot is at {p}/{max_p}",
                    s.subtask, s.parallelism, s.max_parallelism
                )));
            }
        }
        let have: BTreeSet<u32> = subtasks.iter().map(|s| s.subtask).collect();
        if have.len() != subtasks.len() {
            return Err(SnapshotError::Assemble(
                "a subtask acknowledged twice".to_owned(),
            ));
        }
        let missing: Vec<u32> = (0..p).filter(|i| !have.contains(i)).collect();
        if !missing.is_empty() {
            return Err(SnapshotError::Assemble(format!(
                "subtasks {missing:?} have not acknowledged"
            )));
        }
        if let Some(extra) = have.iter().find(|i| **i >= p) {
            return Err(SnapshotError::Assemble(format!(
                "subtask {extra} does not exist at parallelism {p}"
            )));
        }

        let mut files = Vec::with_capacity(subtasks.len());
        let mut key_groups = Vec::with_capacity(max_p as usize);
        let mut referenced: BTreeMap<String, FileEntry> = BTreeMap::new();
        let mut operator_state = Vec::new();
        for s in subtasks {
            operator_state.extend(s.operator_state);
            files.push(s.file);
            key_groups.extend(s.groups);
            for f in s.referenced {
                match referenced.get(&f.name) {
                    Some(seen) if *seen != f => {
                        return Err(SnapshotError::Assemble(format!(
                            "subtasks describe file {} differently ({} bytes, {} and {} bytes, {})",
                            f.name, seen.size, seen.checksum, f.size, f.checksum
                        )));
                    }
                    _ => {
                        referenced.insert(f.name.clone(), f);
                    }
                }
            }
        }
        key_groups.sort_by_key(|g| g.group);
        let incremental = !referenced.is_empty() || key_groups.iter().any(|g| !g.deltas.is_empty());
        let written: u64 = files.iter().fold(0u64, |sum, f| sum.saturating_add(f.size));
        files.extend(referenced.into_values());
        let stats = Stats {
            // Saturating: an absurd count from a worker fails check() below, never panics.
            total_bytes: key_groups
                .iter()
                .fold(0u64, |sum, g| sum.saturating_add(g.stored_bytes())),
            total_keys: key_groups
                .iter()
                .fold(0u64, |sum, g| sum.saturating_add(g.entries)),
            non_empty_groups: key_groups.iter().filter(|g| g.stored_bytes() > 0).count() as u32,
            written_bytes: incremental.then_some(written),
            extra: BTreeMap::new(),
        };
        operator_state.sort_by_key(|o: &OperatorStateEntry| o.subtask);
        let manifest = Manifest {
            format_version: if !operator_state.is_empty() {
                OPERATOR_STATE_FORMAT_VERSION
            } else if incremental {
                FORMAT_VERSION
            } else {
                FULL_FORMAT_VERSION
            },
            job: meta.job,
            snapshot_id: meta.snapshot_id,
            kind: meta.kind,
            completed_at: meta.completed_at,
            max_parallelism: max_p,
            parallelism: p,
            state_schema: meta.state_schema,
            checksum_algorithm: CHECKSUM_ALGORITHM.to_owned(),
            source_positions: meta.source_positions,
            source_partitions: meta.source_partitions,
            watermark: meta.watermark,
            stats,
            files,
            key_groups,
            operator_state,
        };
        manifest.check().map_err(SnapshotError::Assemble)?;
        Ok(manifest)
    }

    /// Parses a manifest, checks its format version and its self-consistency. `path` names the
    /// manifest in errors.
    pub fn from_json(bytes: &[u8], path: &str) -> Result<Manifest> {
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Probe {
            format_version: Option<u32>,
        }
        let corrupt = |source| SnapshotError::ManifestCorrupt {
            path: path.to_owned(),
            source,
        };
        let probe: Probe = serde_json::from_slice(bytes).map_err(corrupt)?;
        match probe.format_version {
            Some(FULL_FORMAT_VERSION | FORMAT_VERSION | OPERATOR_STATE_FORMAT_VERSION) => {}
            Some(found) => {
                return Err(SnapshotError::UnsupportedFormat {
                    path: path.to_owned(),
                    found,
                    supported: OPERATOR_STATE_FORMAT_VERSION,
                });
            }
            None => {
                return Err(SnapshotError::ManifestInconsistent {
                    path: path.to_owned(),
                    reason: "formatVersion is missing".to_owned(),
                });
            }
        }
        let manifest: Manifest = serde_json::from_slice(bytes).map_err(corrupt)?;
        manifest
            .check()
            .map_err(|reason| SnapshotError::ManifestInconsistent {
                path: path.to_owned(),
                reason,
            })?;
        Ok(manifest)
    }

    /// The manifest as pretty JSON.
    pub fn to_json(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec_pretty(self)
    }

    /// The manifest's own checksum: the CRC-32C of [`Manifest::to_json`] (its canonical form,
    /// whatever form it is stored in), hashed as it is serialized, without the bytes.
    pub fn content_checksum(&self) -> Result<Crc32c, serde_json::Error> {
        let mut hasher = super::checksum::Crc32cHasher::new();
        serde_json::to_writer_pretty(&mut hasher, self)?;
        Ok(hasher.finish())
    }

    /// The validated assignment the snapshot was taken at.
    pub fn assignment(&self) -> Result<Assignment> {
        Ok(Assignment::new(
            i64::from(self.parallelism),
            i64::from(self.max_parallelism),
        )?)
    }

    /// The entry of key group `group`, if it is below `maxParallelism` (valid manifests list
    /// groups in order, so this is an index).
    pub fn group(&self, group: u32) -> Option<&GroupEntry> {
        self.key_groups
            .get(group as usize)
            .filter(|g| g.group == group)
    }

    /// The entry of the file named `name`.
    pub fn file(&self, name: &str) -> Option<&FileEntry> {
        self.files.iter().find(|f| f.name == name)
    }

    /// Sum of the block lengths (deltas included) of the groups in `range` (what a restore of
    /// that range reads).
    pub fn bytes_in(&self, range: KeyGroupRange) -> u64 {
        range
            .iter()
            .filter_map(|g| self.group(g))
            .map(GroupEntry::stored_bytes)
            .sum()
    }

    /// The state blocks the manifest names: each group's first block and its deltas.
    pub fn block_count(&self) -> u64 {
        self.key_groups
            .iter()
            .map(|g| 1 + g.deltas.len() as u64)
            .sum()
    }

    /// Whether every block lies in the snapshot's own files (formatVersion 1): it can be copied,
    /// moved or kept on its own.
    pub fn is_self_contained(&self) -> bool {
        self.files.iter().all(|f| !is_referenced_file(&f.name))
            && self.key_groups.iter().all(|g| g.deltas.is_empty())
    }

    /// The files of other snapshots this one needs (incremental checkpoints), as
    /// `(kind, id, plain file name)`.
    pub fn referenced_files(&self) -> Vec<(SnapshotKind, u64, &str)> {
        self.files
            .iter()
            .filter_map(|f| split_referenced_file(&f.name))
            .collect()
    }

    /// Checks the manifest's self-consistency; the reason names the first problem found.
    ///
    /// Every group `0..maxParallelism` is listed once, in order; every block names a listed file;
    /// each file's blocks tile it exactly in group order (so they are inside it and never overlap);
    /// the file checksum equals the combination of its block checksums; the stats add up.
    pub fn check(&self) -> std::result::Result<(), String> {
        if ![
            FULL_FORMAT_VERSION,
            FORMAT_VERSION,
            OPERATOR_STATE_FORMAT_VERSION,
        ]
        .contains(&self.format_version)
        {
            return Err(format!(
                "formatVersion {} is not {FULL_FORMAT_VERSION}, {FORMAT_VERSION} or {OPERATOR_STATE_FORMAT_VERSION}",
                self.format_version
            ));
        }
        if self.operator_state.is_empty() == (self.format_version == OPERATOR_STATE_FORMAT_VERSION)
        {
            return Err(format!(
                "formatVersion {} with {} operator-state sections: formatVersion {OPERATOR_STATE_FORMAT_VERSION} is exactly the manifests with sections",
                self.format_version,
                self.operator_state.len()
            ));
        }
        if self.checksum_algorithm != CHECKSUM_ALGORITHM {
            return Err(format!(
                "checksumAlgorithm {:?} is not {CHECKSUM_ALGORITHM:?}",
                self.checksum_algorithm
            ));
        }
        self.assignment().map_err(|e| e.to_string())?;
        keyshift_core::positions::check_partition_names(
            &self.source_positions,
            &self.source_partitions,
        )
        .map_err(|e| e.to_string())?;
        let max_p = self.max_parallelism as usize;

        // Every group exactly once, in order.
        let mut seen = vec![false; max_p];
        for g in &self.key_groups {
            let slot = seen
                .get_mut(g.group as usize)
                .ok_or_else(|| format!("key group {} is outside 0..{max_p}", g.group))?;
            if *slot {
                return Err(format!("key group {} is listed twice", g.group));
            }
            *slot = true;
        }
        if let Some(missing) = seen.iter().position(|s| !s) {
            return Err(format!("key group {missing} is missing"));
        }
        if let Some((i, g)) = self
            .key_groups
            .iter()
            .enumerate()
            .find(|(i, g)| g.group as usize != *i)
        {
            return Err(format!(
                "keyGroups must be in group order: entry {i} is group {}",
                g.group
            ));
        }

        // Files: unique names; plain (own files) or, in formatVersion 2, files of other
        // snapshots of the job.
        let own_dir = format!(
            "{}/{}{}/",
            self.kind.folder(),
            self.kind.dir_prefix(),
            self.snapshot_id
        );
        let mut cursor: BTreeMap<&str, (u64, Crc32c)> = BTreeMap::new();
        for f in &self.files {
            if is_referenced_file(&f.name) {
                if split_referenced_file(&f.name).is_none() || f.name.starts_with(&own_dir) {
                    return Err(format!(
                        "file name {:?} is not a plain file name in the snapshot directory, nor a file of another snapshot of the job (checkpoints/chk-<id>/<file> or savepoints/sp-<id>/<file>)",
                        f.name
                    ));
                }
                if self.format_version == FULL_FORMAT_VERSION {
                    return Err(format!(
                        "file {:?} lies in another snapshot, which formatVersion {FULL_FORMAT_VERSION} does not allow",
                        f.name
                    ));
                }
            } else if !is_plain_file_name(&f.name) {
                return Err(format!(
                    "file name {:?} is not a plain file name in the snapshot directory",
                    f.name
                ));
            }
            if cursor.insert(&f.name, (0, Crc32c::EMPTY)).is_some() {
                return Err(format!("file {} is listed twice", f.name));
            }
        }

        // Blocks, in group order (a group's deltas in their order), lie in their files in
        // order without overlaps; in the snapshot's own files they tile the file exactly.
        let mut written = 0u64;
        for g in &self.key_groups {
            if !g.deltas.is_empty() && self.format_version == FULL_FORMAT_VERSION {
                return Err(format!(
                    "key group {} has delta blocks, which formatVersion {FULL_FORMAT_VERSION} does not allow",
                    g.group
                ));
            }
            if g.length == 0 && !g.deltas.is_empty() {
                return Err(format!(
                    "key group {} has delta blocks over an empty first block",
                    g.group
                ));
            }
            for (n, (file, offset, length, checksum)) in g.blocks().enumerate() {
                let (pos, crc) = cursor.get_mut(file).ok_or_else(|| {
                    format!(
                        "key group {} names file {:?}, which is not in files",
                        g.group, file
                    )
                })?;
                let own = !is_referenced_file(file);
                if n > 0 && length == 0 {
                    return Err(format!("key group {} has an empty delta block", g.group));
                }
                if length == 0 && checksum != Crc32c::EMPTY {
                    return Err(format!(
                        "key group {} is empty but has checksum {}",
                        g.group, checksum
                    ));
                }
                if own && length == 0 && offset != *pos {
                    return Err(format!(
                        "key group {} starts at offset {offset} of {file}, expected {pos} (blocks must be contiguous, in group order, without overlaps)",
                        g.group
                    ));
                }
                if length == 0 {
                    continue;
                }
                if (own && offset != *pos) || offset < *pos {
                    let (expected, how) = if own {
                        (format!("{pos}"), "contiguous")
                    } else {
                        (format!("at least {pos}"), "in order")
                    };
                    return Err(format!(
                        "key group {} starts at offset {offset} of {file}, expected {expected} (blocks must be {how}, in group order, without overlaps)",
                        g.group
                    ));
                }
                *pos = offset
                    .checked_add(length)
                    .ok_or_else(|| format!("key group {} length overflows", g.group))?;
                if own {
                    *crc = crc.combine(checksum, length);
                }
            }
        }
        // Operator-state sections: one per subtask of one run, each after the groups of one of
        // the snapshot's own files, tiling on from them.
        let from = self.operator_state.first().map_or(0, |o| o.parallelism);
        for (i, o) in self.operator_state.iter().enumerate() {
            if o.subtask != i as u32 || o.parallelism != from {
                return Err(format!(
                    "operatorState entry {i} is subtask {} of {}: the entries must be subtasks 0..{from} of one run, in order",
                    o.subtask, o.parallelism
                ));
            }
            let Some((pos, crc)) = cursor
                .get_mut(o.file.as_str())
                .filter(|_| !is_referenced_file(&o.file))
            else {
                return Err(format!(
                    "the operator state of subtask {} names file {:?}, which is not one of the snapshot's own files",
                    o.subtask, o.file
                ));
            };
            if o.offset != *pos {
                return Err(format!(
                    "the operator state of subtask {} starts at offset {} of {}, expected {pos} (after the file's blocks, without gaps)",
                    o.subtask, o.offset, o.file
                ));
            }
            *pos = o
                .offset
                .checked_add(o.length)
                .ok_or_else(|| format!("the operator state of subtask {} overflows", o.subtask))?;
            *crc = crc.combine(o.checksum, o.length);
        }
        if self.operator_state.len() as u32 != from {
            return Err(format!(
                "operatorState has {} entries for a run of {from} subtasks",
                self.operator_state.len()
            ));
        }
        for f in &self.files {
            let (end, crc) = cursor[f.name.as_str()];
            if is_referenced_file(&f.name) {
                if end > f.size {
                    return Err(format!(
                        "blocks of {} end at byte {end}, but its size is {} (blocks outside the file)",
                        f.name, f.size
                    ));
                }
                continue;
            }
            written = written.saturating_add(f.size);
            if end != f.size {
                return Err(format!(
                    "blocks of {} end at byte {end}, but its size is {} (blocks outside the file or a gap)",
                    f.name, f.size
                ));
            }
            if crc != f.checksum {
                return Err(format!(
                    "checksum of {} is {}, but its blocks' checksums combine to {crc}",
                    f.name, f.checksum
                ));
            }
        }
        if let Some(w) = self.stats.written_bytes
            && w != written
        {
            return Err(format!(
                "stats say {w} bytes written, the snapshot's own files hold {written}"
            ));
        }

        // Checked: the counts are read from storage (found by tests/fuzz.rs).
        let total = |what: &str, f: fn(&GroupEntry) -> u64| {
            self.key_groups
                .iter()
                .try_fold(0u64, |sum, g| sum.checked_add(f(g)))
                .ok_or_else(|| format!("the key groups' {what} overflow"))
        };
        let total_bytes = total("lengths", GroupEntry::stored_bytes)?;
        let total_keys = total("entry counts", |g| g.entries)?;
        if self.stats.total_bytes != total_bytes || self.stats.total_keys != total_keys {
            return Err(format!(
                "stats say {} bytes and {} keys, the key groups add up to {total_bytes} bytes and {total_keys} keys",
                self.stats.total_bytes, self.stats.total_keys
            ));
        }
        Ok(())
    }

    /// The range reads that fetch exactly the blocks of `range`: blocks that are adjacent in the
    /// same file are coalesced into one request; empty groups cost nothing. The requests never
    /// overlap and their lengths add up to [`bytes_in(range)`](Self::bytes_in).
    ///
    /// `range` must be inside `0..maxParallelism` (see [`SnapshotError::RangeOutsideSnapshot`]).
    pub fn plan_reads(&self, range: KeyGroupRange) -> Result<Vec<ReadRequest>> {
        if range.is_empty() || range.end >= self.max_parallelism {
            return Err(SnapshotError::RangeOutsideSnapshot {
                range,
                max_parallelism: self.max_parallelism,
            });
        }
        let mut out: Vec<ReadRequest> = Vec::new();
        for idx in range.start as usize..=range.end as usize {
            let Some(g) = self.key_groups.get(idx) else {
                break;
            };
            if g.length == 0 {
                if let Some(last) = out.last_mut()
                    && last.file == g.file
                    && last.range.end == g.offset
                {
                    last.groups.end = idx + 1;
                }
                continue;
            }
            match out.last_mut() {
                Some(last) if last.file == g.file && last.range.end == g.offset => {
                    last.range.end = g.offset + g.length;
                    last.groups.end = idx + 1;
                }
                _ => out.push(ReadRequest {
                    file: g.file.clone(),
                    range: g.byte_range(),
                    groups: idx..idx + 1,
                }),
            }
        }
        Ok(out)
    }
}

fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && name != MANIFEST_FILE
        && !name.contains(['/', '\\', '#'])
        && !name.chars().any(char::is_control)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn meta(id: u64) -> SnapshotMeta {
        SnapshotMeta {
            job: JobIdentity {
                namespace: "ns".into(),
                name: "job".into(),
                job_fingerprint: "fp".into(),
                layout: None,
            },
            snapshot_id: id,
            kind: SnapshotKind::Checkpoint,
            completed_at: "2025-01-02T03:04:05.678Z".parse().unwrap(),
            state_schema: "keyshift.agg.v1".into(),
            source_positions: BTreeMap::from([(0, 10), (1, 20)]),
            source_partitions: BTreeMap::from([(0, "a.jsonl".into()), (1, "b.jsonl".into())]),
            watermark: Some(1_700_000_000_000),
        }
    }

    /// Lays out a snapshot whose group `g` has `lengths[g]` bytes (content derived from g).
    fn build(assignment: Assignment, lengths: &[u64]) -> Manifest {
        let subtasks = (0..assignment.parallelism())
            .map(|i| {
                let mut layout = FileLayout::new(assignment, i).unwrap();
                for g in assignment.range(i).iter() {
                    let len = lengths[g as usize];
                    if len > 0 {
                        let bytes = vec![g as u8; len as usize];
                        layout
                            .push(g, len, Crc32c::of(&bytes), u64::from(g % 3))
                            .unwrap();
                    }
                }
                layout.finish()
            })
            .collect();
        Manifest::assemble(meta(1), assignment, subtasks).unwrap()
    }

    #[test]
    fn assemble_and_round_trip() {
        let a = Assignment::new(3, 8).unwrap();
        let lengths = [5, 0, 7, 1, 0, 0, 9, 2];
        let m = build(a, &lengths);
        assert_eq!(m.files.len(), 3);
        assert_eq!(m.files[0].name, "state-0-of-3.bin");
        assert_eq!(m.files[0].size, 5 + 7);
        assert_eq!(m.stats.total_bytes, 24);
        assert_eq!(m.stats.non_empty_groups, 5);
        assert_eq!(m.group(2).unwrap().offset, 5);
        let json = m.to_json().unwrap();
        let text = String::from_utf8(json.clone()).unwrap();
        assert!(text.contains("\"formatVersion\": 1"));
        assert!(text.contains("\"completedAt\": \"2025-01-02T03:04:05.678Z\""));
        assert!(text.contains("\"jobFingerprint\": \"fp\""));
        let back = Manifest::from_json(&json, "x/_manifest.json").unwrap();
        assert_eq!(back, m);
    }

    /// A snapshot of 3 subtasks, each with groups and then an operator-state section of
    /// `sections[i]` bytes written by subtask `i` of `from`.
    fn with_sections(from: u32, sections: &[u64]) -> Result<Manifest> {
        let a = Assignment::new(3, 8).unwrap();
        let lengths = [5, 0, 7, 1, 0, 0, 9, 2];
        let subtasks = (0..3)
            .map(|i| {
                let mut layout = FileLayout::new(a, i).unwrap();
                for g in a.range(i).iter().filter(|g| lengths[*g as usize] > 0) {
                    let bytes = vec![g as u8; lengths[g as usize] as usize];
                    layout
                        .push(g, bytes.len() as u64, Crc32c::of(&bytes), 1)
                        .unwrap();
                }
                if let Some(len) = sections.get(i as usize) {
                    let bytes = vec![0xAB; *len as usize];
                    layout.push_operator_state(i, from, *len, Crc32c::of(&bytes));
                }
                layout.finish()
            })
            .collect();
        Manifest::assemble(meta(1), a, subtasks)
    }

    #[test]
    fn operator_state_sections_follow_the_groups_and_need_the_newer_format() {
        let m = with_sections(3, &[4, 0, 6]).unwrap();
        assert_eq!(m.format_version, OPERATOR_STATE_FORMAT_VERSION);
        assert_eq!(m.operator_state.len(), 3);
        assert_eq!(m.files[0].size, 5 + 7 + 4, "groups, then the section");
        assert_eq!(m.operator_state[0].offset, 12);
        assert_eq!(m.stats.total_bytes, 24, "sections are not key-group bytes");
        let json = m.to_json().unwrap();
        assert!(String::from_utf8_lossy(&json).contains("\"operatorState\""));
        assert_eq!(Manifest::from_json(&json, "x").unwrap(), m);
        // Without sections nothing changes: the format stays the older one.
        assert_eq!(
            with_sections(3, &[]).unwrap().format_version,
            FULL_FORMAT_VERSION
        );

        // A run's sections are all or nothing, of one run, and tile their files.
        let err = with_sections(3, &[4, 4]).unwrap_err().to_string();
        assert!(err.contains("2 entries for a run of 3"), "{err}");
        let mut bad = m.clone();
        bad.operator_state[1].parallelism = 2;
        assert!(bad.check().unwrap_err().contains("one run"));
        let mut bad = m.clone();
        bad.operator_state[2].offset += 1;
        assert!(bad.check().unwrap_err().contains("after the file's blocks"));
        let mut bad = m.clone();
        bad.operator_state[0].checksum = Crc32c(7);
        assert!(
            bad.check()
                .unwrap_err()
                .contains("checksum of state-0-of-3.bin")
        );
        let mut bad = m.clone();
        bad.format_version = FORMAT_VERSION;
        assert!(bad.check().unwrap_err().contains("operator-state sections"));
        let mut bad = m;
        bad.operator_state.clear();
        assert!(bad.check().is_err(), "format 3 without sections");
    }

    #[test]
    fn assemble_refuses_incomplete_or_mismatched_parts() {
        let a = Assignment::new(2, 4).unwrap();
        let part = |i| FileLayout::new(a, i).unwrap().finish();
        let err = Manifest::assemble(meta(1), a, vec![part(0)]).unwrap_err();
        assert!(
            err.to_string().contains("[1] have not acknowledged"),
            "{err}"
        );
        let err = Manifest::assemble(meta(1), a, vec![part(0), part(0), part(1)]).unwrap_err();
        assert!(err.to_string().contains("twice"), "{err}");
        let other = FileLayout::new(Assignment::new(2, 8).unwrap(), 1)
            .unwrap()
            .finish();
        let err = Manifest::assemble(meta(1), a, vec![part(0), other]).unwrap_err();
        assert!(err.to_string().contains("maxParallelism 8"), "{err}");
    }

    #[test]
    fn layout_refuses_out_of_order_groups() {
        let a = Assignment::new(2, 8).unwrap();
        assert!(FileLayout::new(a, 2).is_err());
        let mut l = FileLayout::new(a, 1).unwrap();
        assert!(l.push(3, 1, Crc32c::of(b"x"), 1).is_err()); // subtask 1 owns 4-7
        l.push(5, 1, Crc32c::of(b"x"), 1).unwrap();
        assert!(l.push(5, 1, Crc32c::of(b"x"), 1).is_err());
        assert!(l.push(8, 1, Crc32c::of(b"x"), 1).is_err());
        let s = l.finish();
        assert_eq!(
            s.groups.iter().map(|g| g.group).collect::<Vec<_>>(),
            [4, 5, 6, 7]
        );
        assert_eq!(s.groups[2].offset, 1);
    }

    #[test]
    fn check_detects_inconsistencies() {
        let a = Assignment::new(2, 4).unwrap();
        let m = build(a, &[3, 4, 0, 6]);
        let bad = |f: &dyn Fn(&mut Manifest), needle: &str| {
            let mut x = m.clone();
            f(&mut x);
            let reason = x.check().unwrap_err();
            assert!(reason.contains(needle), "{reason:?} lacks {needle:?}");
            let err = Manifest::from_json(&x.to_json().unwrap(), "p/_manifest.json").unwrap_err();
            assert!(err.to_string().contains("p/_manifest.json"), "{err}");
        };
        bad(&|m| m.key_groups[2].group = 1, "listed twice");
        bad(&|m| drop(m.key_groups.pop()), "missing");
        bad(&|m| m.key_groups[1].offset = 2, "offset 2");
        bad(&|m| m.key_groups[1].length = 5, "end at byte 8");
        bad(&|m| m.files[1].size = 100, "size is 100");
        bad(&|m| m.files[0].checksum = Crc32c(1), "combine");
        bad(&|m| m.key_groups[0].file = "nope".into(), "not in files");
        bad(&|m| m.files[0].name = "../x".into(), "plain file name");
        bad(&|m| m.parallelism = 5, "exceeds");
        bad(&|m| m.stats.total_keys += 1, "stats");
        bad(&|m| m.key_groups.swap(0, 1), "group order");
        bad(
            &|m| drop(m.source_partitions.remove(&1)),
            "sourcePartitions",
        );
        bad(
            &|m| drop(m.source_partitions.insert(1, "a.jsonl".into())),
            "\"a.jsonl\" for partitions 0 and 1",
        );
    }

    /// An incremental checkpoint: subtask 0 builds on checkpoint 1 (a delta on group 0, group 1
    /// unchanged), subtask 1 writes in full. It is formatVersion 2, round-trips, and its checks
    /// catch blocks outside or across another snapshot's file and unknown files.
    #[test]
    fn an_incremental_manifest_refers_to_earlier_files() {
        let a = Assignment::new(2, 4).unwrap();
        let first = build(a, &[3, 4, 0, 6]);
        assert_eq!(first.format_version, FULL_FORMAT_VERSION);
        assert!(first.is_self_contained());
        let rename = |name: &str| referenced_file_name(SnapshotKind::Checkpoint, 1, name);
        let files: BTreeMap<String, FileEntry> = first
            .files
            .iter()
            .map(|f| {
                let name = rename(&f.name);
                (name.clone(), FileEntry { name, ..f.clone() })
            })
            .collect();
        let prior = |g: u32| {
            let mut e = first.key_groups[g as usize].clone();
            e.file = rename(&e.file);
            e
        };
        let mut l0 = FileLayout::new(a, 0).unwrap();
        let delta = vec![9u8; 2];
        l0.push_on(prior(0), Some((2, Crc32c::of(&delta), 1)), 7, &files)
            .unwrap();
        l0.push_on(prior(1), None, 1, &files).unwrap();
        let s0 = l0.finish();
        assert_eq!(s0.file.size, 2);
        assert_eq!(s0.referenced.len(), 1);
        let mut l1 = FileLayout::new(a, 1).unwrap();
        l1.push(3, 5, Crc32c::of(&[1u8; 5]), 2).unwrap();
        let m = Manifest::assemble(meta(2), a, vec![s0, l1.finish()]).unwrap();
        assert_eq!(m.format_version, FORMAT_VERSION);
        assert!(!m.is_self_contained());
        assert_eq!(m.stats.written_bytes, Some(7));
        assert_eq!(m.stats.total_bytes, 3 + 2 + 4 + 5);
        assert_eq!(m.bytes_in(KeyGroupRange { start: 0, end: 0 }), 5);
        assert_eq!(m.key_groups[0].entries, 7);
        assert_eq!(
            m.referenced_files(),
            vec![(SnapshotKind::Checkpoint, 1, "state-0-of-2.bin")]
        );
        let back = Manifest::from_json(&m.to_json().unwrap(), "x/_manifest.json").unwrap();
        assert_eq!(back, m);
        let bad = |f: &dyn Fn(&mut Manifest), needle: &str| {
            let mut x = m.clone();
            f(&mut x);
            let reason = x.check().unwrap_err();
            assert!(reason.contains(needle), "{reason:?} lacks {needle:?}");
        };
        bad(&|m| m.key_groups[1].offset = 1, "at least");
        bad(&|m| m.key_groups[1].length = 40, "outside the file");
        bad(&|m| m.format_version = 1, "formatVersion 1 does not allow");
        bad(&|m| m.key_groups[0].deltas[0].offset = 1, "expected 0");
        bad(&|m| m.key_groups[0].deltas[0].length = 0, "empty delta");
        bad(&|m| m.stats.written_bytes = Some(1), "bytes written");
        bad(
            &|m| {
                let f = m.files.last_mut().unwrap();
                f.name = "checkpoints/chk-2/state-0-of-2.bin".into();
                m.key_groups[1].file = f.name.clone();
                m.key_groups[0].file = f.name.clone();
            },
            "not a plain file name",
        );
        bad(
            &|m| m.key_groups[1].file = "checkpoints/chk-1/other.bin".into(),
            "not in files",
        );
    }

    /// Manifests written before partition names were recorded still parse (index identity), and
    /// a manifest without names writes none.
    #[test]
    fn manifests_without_partition_names_parse() {
        let mut m = build(Assignment::new(2, 4).unwrap(), &[3, 4, 0, 6]);
        let text = String::from_utf8(m.to_json().unwrap()).unwrap();
        assert!(
            text.contains("\"sourcePartitions\": {\n    \"0\": \"a.jsonl\""),
            "{text}"
        );
        m.source_partitions.clear();
        let json = m.to_json().unwrap();
        assert!(
            !String::from_utf8(json.clone())
                .unwrap()
                .contains("sourcePartitions")
        );
        let back = Manifest::from_json(&json, "old/_manifest.json").unwrap();
        assert!(back.source_partitions.is_empty());
        assert_eq!(back.source_positions, BTreeMap::from([(0, 10), (1, 20)]));
    }

    /// Found by tests/fuzz.rs: entry counts that overflow when added are refused, not a panic.
    #[test]
    fn overflowing_entry_counts_are_inconsistent_not_a_panic() {
        let mut m = build(Assignment::new(2, 8).unwrap(), &[1, 2, 0, 3, 4, 0, 0, 5]);
        m.key_groups[0].entries = u64::MAX;
        m.key_groups[1].entries = u64::MAX;
        let err = m.check().unwrap_err();
        assert!(err.contains("overflow"), "{err}");
    }

    #[test]
    fn from_json_types_errors() {
        let err = Manifest::from_json(b"{\"formatVersion\": 1, \"job\": ", "a/_manifest.json")
            .unwrap_err();
        assert!(
            matches!(err, SnapshotError::ManifestCorrupt { .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("a/_manifest.json"));
        let err = Manifest::from_json(b"{\"formatVersion\": 4}", "a/_manifest.json").unwrap_err();
        assert!(matches!(
            err,
            SnapshotError::UnsupportedFormat { found: 4, .. }
        ));
    }

    #[test]
    fn plan_reads_coalesces_adjacent_blocks() {
        // p=2, maxP=8: file 0 holds groups 0-3, file 1 groups 4-7.
        let m = build(Assignment::new(2, 8).unwrap(), &[1, 2, 0, 3, 4, 0, 0, 5]);
        let plan = m.plan_reads(KeyGroupRange { start: 1, end: 6 }).unwrap();
        assert_eq!(
            plan,
            vec![
                ReadRequest {
                    file: "state-0-of-2.bin".into(),
                    range: 1..6,
                    groups: 1..4
                },
                ReadRequest {
                    file: "state-1-of-2.bin".into(),
                    range: 0..4,
                    groups: 4..7
                },
            ]
        );
        assert_eq!(m.bytes_in(KeyGroupRange { start: 1, end: 6 }), 9);
        assert!(
            m.plan_reads(KeyGroupRange { start: 5, end: 5 })
                .unwrap()
                .is_empty()
        );
        assert!(m.plan_reads(KeyGroupRange { start: 7, end: 8 }).is_err());
    }

    fn arb_snapshot() -> impl Strategy<Value = (Assignment, Vec<u64>, u32)> {
        (1u32..=64)
            .prop_flat_map(|max_p| (1u32..=max_p, Just(max_p)))
            .prop_flat_map(|(p, max_p)| {
                (
                    Just(Assignment::new(i64::from(p), i64::from(max_p)).unwrap()),
                    prop::collection::vec(prop_oneof![Just(0u64), 1u64..40], max_p as usize),
                    1u32..=max_p,
                )
            })
    }

    proptest! {
        /// Restoring at any new parallelism: each new subtask's plan reads exactly its groups'
        /// bytes, requests never overlap, and the plans of all new subtasks together read every
        /// byte of the snapshot exactly once.
        #[test]
        fn plans_read_exactly_the_requested_blocks((a, lengths, new_p) in arb_snapshot()) {
            let m = build(a, &lengths);
            prop_assert!(m.check().is_ok());
            let new = Assignment::new(i64::from(new_p), i64::from(a.max_parallelism())).unwrap();
            let mut covered: BTreeMap<String, Vec<Range<u64>>> = BTreeMap::new();
            let mut total = 0;
            for r in new.ranges() {
                let plan = m.plan_reads(r).unwrap();
                let read: u64 = plan.iter().map(|q| q.range.end - q.range.start).sum();
                let expected: u64 = r.iter().map(|g| lengths[g as usize]).sum();
                prop_assert_eq!(read, expected);
                prop_assert_eq!(m.bytes_in(r), expected);
                // At most one request per old file touched (a range intersects each old
                // subtask's contiguous range in one piece).
                let files: BTreeSet<&str> = plan.iter().map(|q| q.file.as_str()).collect();
                prop_assert_eq!(files.len(), plan.len());
                for q in &plan {
                    // The blocks listed tile the request exactly.
                    let mut pos = q.range.start;
                    for g in &m.key_groups[q.groups.clone()] {
                        prop_assert!(r.contains(g.group));
                        prop_assert_eq!(&g.file, &q.file);
                        prop_assert_eq!(g.offset, pos);
                        pos += g.length;
                    }
                    prop_assert_eq!(pos, q.range.end);
                    covered.entry(q.file.clone()).or_default().push(q.range.clone());
                }
                total += read;
            }
            prop_assert_eq!(total, m.stats.total_bytes);
            for (file, mut ranges) in covered {
                ranges.sort_by_key(|r| r.start);
                for w in ranges.windows(2) {
                    prop_assert!(w[0].end <= w[1].start, "overlap in {}", file);
                }
            }
        }

        /// Any single-field corruption of offsets or lengths of a non-trivial manifest is caught.
        #[test]
        fn check_catches_block_shifts((a, lengths, _p) in arb_snapshot(), pick in any::<prop::sample::Index>(), delta in 1u64..5) {
            let m = build(a, &lengths);
            let i = pick.index(m.key_groups.len());
            let mut shifted = m.clone();
            shifted.key_groups[i].offset += delta;
            prop_assert!(shifted.check().is_err());
            let mut longer = m.clone();
            longer.key_groups[i].length += delta;
            prop_assert!(longer.check().is_err());
        }
    }
}
