//! The SDK's errors: what a state access, a user function or a restore can fail with.

use crate::key::KeyDecodeError;
use crate::serializer::SerializeError;
use keyshift_core::redistribution::RedistributionError;

/// A state access that failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    /// A value of state `state` did not (de)serialize.
    #[error("state {state:?}: {source}")]
    Serialize {
        state: String,
        #[source]
        source: SerializeError,
    },
    /// The state backend failed (a disk backend's I/O).
    #[error("state backend: {0}")]
    Backend(String),
    /// A handle used with an operator that did not declare it (a handle of another function).
    #[error("state {0:?} is not declared by this function: declare it in `open`")]
    Undeclared(String),
}

/// What a job's function returns when it fails: a state access, or the author's own error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    State(#[from] StateError),
    /// The function's own failure: the worker stops, and the job restarts from its last
    /// snapshot.
    #[error("{0}")]
    User(Box<dyn std::error::Error + Send + Sync>),
}

impl Error {
    /// Wraps the author's error.
    pub fn user(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Error::User(e.into())
    }
}

/// The result of a job's function.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A key-group block that cannot be restored into this operator. Nothing of it is installed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    #[error("state block too short ({len} bytes): not a keyshift key-group block")]
    TooShort { len: usize },
    #[error("bad magic {found:02x?}: not a keyshift key-group block")]
    BadMagic { found: [u8; 4] },
    #[error(
        "checksum mismatch (stored {stored:08x}, computed {computed:08x}): the block is corrupt"
    )]
    Checksum { stored: u32, computed: u32 },
    #[error("unsupported block format version {0} (this build reads version 1)")]
    UnsupportedVersion(u16),
    #[error(
        "state schema {0:?} is not an SDK job's (this build's SDK reads \"keyshift.sdk.v1\"): the snapshot was written by another job"
    )]
    UnknownSchema(String),
    #[error("malformed block: {0}")]
    Malformed(&'static str),
    #[error("entry {entry}: key: {source}")]
    Key {
        entry: u64,
        #[source]
        source: KeyDecodeError,
    },
    #[error(
        "block of key group {block} offered for group {expected}: the snapshot's layout does not match"
    )]
    WrongGroup { block: u32, expected: u32 },
    #[error(
        "key {key} in the block of group {group} belongs to group {actual}: the block was written under another key-group count or is corrupt"
    )]
    KeyInWrongGroup {
        key: String,
        group: u32,
        actual: u32,
    },
    #[error(
        "the snapshot was written under {block} key groups, this job runs {job}: rewrite it first (keyshift savepoint rewrite)"
    )]
    MaxParallelism { block: u32, job: u32 },
    #[error(
        "the snapshot belongs to operator {block:?}, this step is {job:?}: an operator's uid must stay the same across releases"
    )]
    Operator { block: String, job: String },
    #[error(
        "the snapshot's keys are {block}, this job keys by {job}: the key definition changed; start the changed job from no snapshot, or key it as before"
    )]
    KeyType { block: String, job: String },
    #[error(
        "state {name:?} is in the snapshot but this job does not declare it: declare it again, or drop it by name (Declarations::drop_state)"
    )]
    UndeclaredState { name: String },
    #[error(
        "state {name:?} changed: the snapshot has {block}, this job declares {job}; a state's kind and TTL must stay, and another version or serializer needs a migration from it (Declarations::migrate, or migrate_operator for an operator state) or a new name"
    )]
    StateChanged {
        name: String,
        block: String,
        job: String,
    },
    #[error("a value in the block does not deserialize as its state's type: {0}")]
    Undecodable(String),
    #[error("a delta block came first for group {0}: a chain starts with a full block")]
    DeltaFirst(u32),
    /// The operator state cannot be given to this run (see [`RedistributionError`]).
    #[error(transparent)]
    Redistribution(#[from] RedistributionError),
    /// The snapshot's operator-state sections are not one per subtask of one run, as
    /// (subtask, parallelism).
    #[error(
        "the snapshot's operator-state sections are {found:?} (subtask, parallelism): a snapshot holds one section for every subtask of the run that wrote it"
    )]
    OperatorStateSections { found: Vec<(u32, u32)> },
    /// The state backend failed while installing the group (a disk backend's I/O): the block
    /// is sound, a retry may succeed.
    #[error("installing the group's state: {0}")]
    Backend(StateError),
}

impl BlockError {
    /// Whether the block is sound but its state does not fit this job (another job's, another
    /// key-group count, a step's uid, the key type or a state declaration changed): no retry
    /// of the same job can restore it, only a changed job can. Anything else means the block
    /// itself is damaged.
    pub fn refuses_the_job(&self) -> bool {
        match self {
            BlockError::UnknownSchema(_)
            | BlockError::MaxParallelism { .. }
            | BlockError::Operator { .. }
            | BlockError::KeyType { .. }
            | BlockError::UndeclaredState { .. }
            | BlockError::StateChanged { .. }
            | BlockError::Undecodable(_)
            | BlockError::Redistribution(_) => true,
            BlockError::TooShort { .. }
            | BlockError::BadMagic { .. }
            | BlockError::Checksum { .. }
            | BlockError::UnsupportedVersion(_)
            | BlockError::Malformed(_)
            | BlockError::Key { .. }
            | BlockError::WrongGroup { .. }
            | BlockError::KeyInWrongGroup { .. }
            | BlockError::DeltaFirst(_)
            | BlockError::OperatorStateSections { .. }
            | BlockError::Backend(_) => false,
        }
    }
}
