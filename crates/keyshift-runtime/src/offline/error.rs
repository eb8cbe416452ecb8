//! Typed errors of the savepoint tools. Every message names the snapshot, file, key group or key
//! it is about and, where there is one, the fix.

use crate::job::CodecError;
use crate::snapshot::SnapshotError;
use keyshift_core::keygroup::BoundsError;
use std::path::PathBuf;

/// Shorthand for results of the tools.
pub type Result<T, E = ToolError> = std::result::Result<T, E>;

/// Everything that can go wrong in `keyshift savepoint ...`.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    /// The snapshot layer failed (missing or corrupt manifest, missing or corrupt file, store
    /// error...). Its message names the object.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),

    /// One new key group of a rewrite holds more than its memory budget allows (a group's block
    /// is built in memory). Nothing was written to the target.
    #[error(
        "the rewrite needs {needed} bytes in memory for {groups} at once, more than half its memory budget of {budget} bytes; nothing was written to the target. Raise the budget (--memory-mib, or KEYSHIFT_REWRITE_MEMORY for the operator and keyshift local), or choose a key-group count that spreads this hot key group's keys less unevenly"
    )]
    MemoryBudget {
        groups: String,
        needed: u64,
        budget: u64,
    },

    /// A key-group block does not decode.
    #[error("state file {file}: key group {group}: {source}")]
    Block {
        file: String,
        group: u32,
        #[source]
        source: CodecError,
    },

    /// A program's key-group block does not decode or does not belong where the manifest
    /// puts it.
    #[error("state file {file}: key group {group}: {source}")]
    ProgramBlock {
        file: String,
        group: u32,
        #[source]
        source: keyshift_sdk::BlockError,
    },

    /// A program's operator-state section does not decode.
    #[error("the operator state of subtask {subtask}: {source}")]
    OperatorState {
        subtask: u32,
        #[source]
        source: keyshift_sdk::BlockError,
    },

    /// A program's state could not be re-bucketed (a block that does not decode, or blocks
    /// that disagree on the step or its states).
    #[error("rewriting a program's state: {0}")]
    ProgramRewrite(#[source] keyshift_sdk::BlockError),

    /// A block's header (or entry count) contradicts the manifest.
    #[error(
        "state file {file}: key group {group}: the block says {what} is {block}, the manifest says {manifest}"
    )]
    BlockMismatch {
        file: String,
        group: u32,
        what: &'static str,
        block: String,
        manifest: String,
    },

    /// Blocks of one snapshot disagree on the operator's shape (function, window).
    #[error(
        "state file {file}: key group {group}: the block has {what} {found}, but key group {first_group} has {expected}; a snapshot holds one operator's state"
    )]
    MixedBlocks {
        file: String,
        group: u32,
        what: &'static str,
        found: String,
        first_group: u32,
        expected: String,
    },

    /// A key is stored in a group it does not hash to.
    #[error(
        "state file {file}: key group {group}: key {key} belongs to key group {actual} under maxParallelism {max_parallelism} (the block is corrupt or was written under another key-group count)"
    )]
    KeyInWrongGroup {
        file: String,
        group: u32,
        key: String,
        actual: u32,
        max_parallelism: u32,
    },

    /// A URL that must name a snapshot directory inside a job directory does not.
    #[error(
        "{url} is not a snapshot directory of a job: expected STORAGE/NAMESPACE/JOB/checkpoints/chk-<id> or STORAGE/NAMESPACE/JOB/savepoints/sp-<id>{hint}"
    )]
    NotSnapshotUrl { url: String, hint: &'static str },

    /// The rewrite target already holds a committed snapshot.
    #[error(
        "the target {url} already holds a committed snapshot ({path} exists): choose another target (e.g. a new savepoints/sp-<id>), or dispose of that snapshot first"
    )]
    TargetExists { url: String, path: String },

    /// The rewrite target is named like a checkpoint.
    #[error(
        "the target {url} is a checkpoint directory: a rewrite writes a savepoint, so name the target .../savepoints/sp-<id> (checkpoints are deleted by retention)"
    )]
    TargetIsCheckpoint { url: String },

    /// Rewrite parameters out of bounds.
    #[error("{what}: {source}")]
    Bounds {
        what: String,
        #[source]
        source: BoundsError,
    },

    /// The snapshot is still needed by its job.
    #[error("refusing to dispose of {url}: {reasons}. Pass --force to delete it anyway")]
    InUse { url: String, reasons: String },

    /// A snapshot directory without a manifest (uncommitted, or a disposal that was interrupted).
    #[error(
        "{url} has no manifest but {} (an uncommitted snapshot, possibly still being written, or an interrupted disposal): pass --force to delete them",
        keyshift_core::text::count(*.objects as u64, "leftover object")
    )]
    Uncommitted { url: String, objects: usize },

    /// Nothing at the URL.
    #[error("there is no snapshot at {url}: no manifest and no files")]
    NothingThere { url: String },

    /// Objects remained after a disposal.
    #[error(
        "{url}: {} still there after deleting, e.g. {example}",
        if *.remaining == 1 { "1 object is".to_owned() } else { format!("{} objects are", .remaining) }
    )]
    NotDeleted {
        url: String,
        remaining: usize,
        example: String,
    },

    /// The in-use marker cannot be read; disposal refuses rather than guess.
    #[error(
        "in-use marker {path} is unreadable ({reason}): fix or delete it, or pass --force to dispose anyway"
    )]
    MarkerCorrupt { path: String, reason: String },

    /// A local temporary (spill) file failed.
    #[error(
        "temporary file {path}: {source}. Point --temp-dir at a local directory with space for the state"
    )]
    Spill {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// An entry too large for the spill format (4 GiB).
    #[error("state file {file}: key group {group}: an entry of {len} bytes is too large to move")]
    EntryTooLarge {
        file: String,
        group: u32,
        len: usize,
    },

    /// The rewrite lost or invented keys (a bug; the target is not committed).
    #[error(
        "rewrite wrote {written} keys but read {read} (the source manifest says {manifest}); nothing was committed"
    )]
    KeyCount {
        read: u64,
        written: u64,
        manifest: u64,
    },

    /// A `--key-groups` value cannot be read.
    #[error("--key-groups {text:?}: {reason} (use A-B, inclusive, or a single group A)")]
    BadRange { text: String, reason: String },

    /// `verify` found problems (listed in its report).
    #[error("{url}: verification failed with {}", keyshift_core::text::count(*.problems as u64, "problem"))]
    VerifyFailed { url: String, problems: usize },

    /// Writing to stdout (or another output) failed.
    #[error("writing output: {0}")]
    Output(#[source] std::io::Error),

    /// A report could not be rendered as a document (`rendering JSON: ...`, `rendering YAML: ...`).
    #[error("{0}")]
    Render(String),

    /// The async runtime could not start.
    #[error("cannot start the async runtime: {0}")]
    Runtime(#[source] std::io::Error),

    /// A background task panicked or was cancelled.
    #[error("internal error: a background task failed: {0}")]
    Task(String),

    /// A benchmark (`keyshift savepoint bench-rewrite`) could not set up its input.
    #[error("benchmark: {0}")]
    Bench(String),
}

impl ToolError {
    /// Maps an I/O error on a local spill or scratch file at `path`.
    pub fn spill(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> ToolError {
        let path = path.into();
        move |source| ToolError::Spill { path, source }
    }
}

impl From<tokio::task::JoinError> for ToolError {
    fn from(e: tokio::task::JoinError) -> Self {
        ToolError::Task(e.to_string())
    }
}
