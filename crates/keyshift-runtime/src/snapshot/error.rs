//! The snapshot layer's typed errors. Every message names the object (URL, file, group) it is about
//! and, where there is one, the fix.

use keyshift_core::keygroup::{BoundsError, KeyGroupRange};

/// Shorthand for results of this module.
pub type Result<T, E = SnapshotError> = std::result::Result<T, E>;

/// Everything that can go wrong storing, committing, reading or checking a snapshot.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The storage URL could not be parsed or names no usable location.
    #[error("storage URL {url:?} is invalid: {reason}. {hint}")]
    InvalidUrl {
        url: String,
        reason: String,
        hint: &'static str,
    },

    /// The storage URL has a scheme this build does not store snapshots in.
    #[error(
        "storage URL {url:?} has unsupported scheme {scheme:?}: use file:///absolute/dir, s3://bucket/prefix, gs://bucket/prefix, az://container/prefix (or abfss://), or memory://name for tests"
    )]
    UnsupportedScheme { url: String, scheme: String },

    /// The object store client for a URL could not be configured.
    #[error("cannot open object store for {url:?}: {source}. {hint}")]
    StoreConfig {
        url: String,
        hint: &'static str,
        #[source]
        source: object_store::Error,
    },

    /// A local directory for a `file://` store could not be created.
    #[error(
        "cannot create local snapshot directory {path:?} for {url:?}: {source}. Create it, or point the storage URL at a writable directory"
    )]
    CreateDir {
        url: String,
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A create-only write found the object already there (a manifest committed twice).
    #[error(
        "{path} already exists: a snapshot with this id was already committed; use a new snapshot id (manifests are create-only)"
    )]
    AlreadyExists { path: String },

    /// The snapshot has no manifest: it was never committed (or was deleted).
    #[error("{path} not found: there is no committed snapshot at this location")]
    ManifestMissing { path: String },

    /// The manifest is not valid JSON of the expected shape (e.g. truncated or corrupted).
    #[error("{path} is corrupt: {source}")]
    ManifestCorrupt {
        path: String,
        #[source]
        source: serde_json::Error,
    },

    /// The manifest object is larger than any manifest this build writes (32768 key groups fit
    /// in a few MiB): it is not read.
    #[error(
        "{path} is {size} bytes, more than the {limit} bytes a manifest can be: not a manifest this build wrote (corrupt or foreign); it was not read"
    )]
    ManifestTooLarge { path: String, size: u64, limit: u64 },

    /// A manifest about to be committed is larger than any reader reads
    /// ([`super::MAX_MANIFEST_BYTES`]): the snapshot is not committed.
    #[error(
        "{path} would be {size} bytes, more than the {limit} bytes a manifest can be ({groups} key groups, {blocks} state blocks): the snapshot was not committed, the last committed one stays. Lower spec.state.incrementalCheckpoints.maxDeltas (shorter chains) or the key-group count"
    )]
    ManifestTooLargeToWrite {
        path: String,
        size: u64,
        limit: u64,
        groups: u32,
        blocks: u64,
    },

    /// The manifest was written in a format this build does not read.
    #[error(
        "{path} has formatVersion {found}, this build reads formatVersion 1 to {supported}: use a keyshift version that supports it"
    )]
    UnsupportedFormat {
        path: String,
        found: u32,
        supported: u32,
    },

    /// The manifest parsed but contradicts itself (missing or duplicate groups, overlapping blocks,
    /// blocks outside their file, bad parallelism...).
    #[error("{path} is inconsistent: {reason}")]
    ManifestInconsistent { path: String, reason: String },

    /// Snapshot parts handed to the coordinator do not form a whole snapshot.
    #[error("cannot assemble manifest: {0}")]
    Assemble(String),

    /// A state file the manifest names is not in the store.
    #[error("state file {path} is missing")]
    MissingFile { path: String },

    /// A state file's size differs from the manifest (e.g. truncated).
    #[error(
        "state file {path} has {actual} bytes, the manifest says {expected} (truncated or replaced)"
    )]
    SizeMismatch {
        path: String,
        expected: u64,
        actual: u64,
    },

    /// A key-group block read back shorter or longer than the manifest says.
    #[error(
        "state file {path}: key group {group} read {actual} bytes, the manifest says {expected} (truncated file?)"
    )]
    BlockLength {
        path: String,
        group: u32,
        expected: u64,
        actual: u64,
    },

    /// A key-group block's bytes do not match its checksum.
    #[error(
        "state file {path}: key group {group} checksum is {actual}, the manifest says {expected} (corrupted)"
    )]
    BlockChecksum {
        path: String,
        group: u32,
        expected: String,
        actual: String,
    },

    /// The blocks of a key group's chain (incremental checkpoints) cannot be merged into one.
    #[error("state file {path}: key group {group}'s blocks cannot be merged: {reason}")]
    ChainUnreadable {
        path: String,
        group: u32,
        reason: String,
    },

    /// A whole state file does not match its checksum.
    #[error("state file {path}: checksum is {actual}, the manifest says {expected} (corrupted)")]
    FileChecksum {
        path: String,
        expected: String,
        actual: String,
    },

    /// A writer was handed a group outside its range or out of order.
    #[error(
        "key group {group} cannot be written by subtask {subtask} (range {range}): groups must be inside the subtask's range and strictly increasing (next allowed: {next})"
    )]
    GroupOutOfOrder {
        subtask: u32,
        range: KeyGroupRange,
        group: u32,
        next: u32,
    },

    /// An operator-state section read back shorter, longer or other than its checksum says.
    #[error(
        "state file {path}: the operator state of subtask {subtask} {reason} (truncated or corrupted)"
    )]
    OperatorStateDamaged {
        path: String,
        subtask: u32,
        reason: String,
    },

    /// A writer is used after one of its operations failed.
    #[error("the writer of {path} already failed: write the state file again from the start")]
    WriterFailed { path: String },

    /// A subtask index is not below the parallelism.
    #[error(
        "subtask {subtask} does not exist at parallelism {parallelism}: subtasks are 0..{parallelism}"
    )]
    NoSuchSubtask { subtask: u32, parallelism: u32 },

    /// A requested key-group range lies outside the snapshot's key groups.
    #[error("key-group range {range} is outside the snapshot's groups 0-{last} (maxParallelism {max_parallelism})", last = .max_parallelism.saturating_sub(1))]
    RangeOutsideSnapshot {
        range: KeyGroupRange,
        max_parallelism: u32,
    },

    /// Parallelism / max parallelism out of bounds.
    #[error(transparent)]
    Bounds(#[from] BoundsError),

    /// The job's in-use marker does not parse, or is of another format.
    #[error(
        "in-use marker {path} is unreadable ({reason}): fix or delete it (the operator writes it again on its next pass)"
    )]
    InUseMarkerCorrupt { path: String, reason: String },

    /// The object store failed an operation.
    #[error("object store {op} of {path} failed: {source}")]
    Store {
        op: &'static str,
        path: String,
        #[source]
        source: object_store::Error,
    },
}

impl SnapshotError {
    /// Whether this is a manifest whose contents cannot be used (corrupt, inconsistent, too
    /// large), as opposed to one that is missing, of a newer format, or unreachable.
    pub fn is_bad_manifest(&self) -> bool {
        matches!(
            self,
            SnapshotError::ManifestCorrupt { .. }
                | SnapshotError::ManifestInconsistent { .. }
                | SnapshotError::ManifestTooLarge { .. }
        )
    }

    /// Whether this says the snapshot cannot be restored (its manifest cannot be used, or a
    /// state file it names is missing, of another size, or holds a block that does not match
    /// its checksum), as opposed to a store that cannot be reached.
    pub fn is_unrestorable(&self) -> bool {
        self.is_bad_manifest()
            || matches!(
                self,
                SnapshotError::ManifestMissing { .. }
                    | SnapshotError::MissingFile { .. }
                    | SnapshotError::SizeMismatch { .. }
                    | SnapshotError::BlockLength { .. }
                    | SnapshotError::BlockChecksum { .. }
                    | SnapshotError::FileChecksum { .. }
                    | SnapshotError::ChainUnreadable { .. }
                    | SnapshotError::OperatorStateDamaged { .. }
            )
    }

    /// Wraps an object-store error for `op` on `path`, mapping not-found to [`SnapshotError::MissingFile`].
    pub fn store(op: &'static str, path: impl ToString, source: object_store::Error) -> Self {
        match source {
            object_store::Error::NotFound { .. } => SnapshotError::MissingFile {
                path: path.to_string(),
            },
            source => SnapshotError::Store {
                op,
                path: path.to_string(),
                source,
            },
        }
    }
}
