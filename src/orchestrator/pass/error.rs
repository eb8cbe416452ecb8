//! The errors of a pass: each names the action that failed and has a kind, the label of the
//! reconcile-error metric that also decides how soon the pass is retried.

use super::*;

/// A failed pass, named by what it was doing.
#[derive(Debug, thiserror::Error)]
pub enum PassError {
    #[error("reading the job's control token: {0}")]
    Token(#[source] PortError),
    #[error("observing the job's workers: {0}")]
    Observe(#[source] PortError),
    #[error("creating workers: {0}")]
    Create(#[source] PortError),
    #[error("removing workers: {0}")]
    Delete(#[source] PortError),
    #[error("coordinating running workers again (adopting them): {0}")]
    Adopt(#[source] CoordinatorError),
    #[error("finding the snapshot to restore: {0}")]
    FindSnapshot(#[source] CoordinatorError),
    #[error("preparing the start of a run: {0}")]
    Start(#[source] CoordinatorError),
    #[error("computing the key-group assignment: {0}")]
    Bounds(#[from] keygroup::BoundsError),
    #[error("rescale state machine: {0}")]
    Transition(String),
    #[error("making a run id: {0}")]
    Random(#[from] RandomError),
    #[error("reading the credentials of the Kafka sink's publisher: {0}")]
    Credentials(#[source] PortError),
}

/// What kind of failure a pass had: the label of the reconcile-error metric, and what decides
/// how soon it is retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The platform (the Kubernetes API, process spawning) refused or was unreachable.
    Platform,
    /// Snapshot storage could not be read.
    Storage,
    /// A worker's control API failed.
    Workers,
    /// The job's settings cannot work (bounds).
    Config,
    /// A bug: an outcome the state machine does not allow.
    Bug,
}

impl ErrorKind {
    /// Every kind (the metric's label values; a deleted job's series are removed for each).
    pub const ALL: [ErrorKind; 5] = [
        ErrorKind::Platform,
        ErrorKind::Storage,
        ErrorKind::Workers,
        ErrorKind::Config,
        ErrorKind::Bug,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            ErrorKind::Platform => "platform",
            ErrorKind::Storage => "storage",
            ErrorKind::Workers => "workers",
            ErrorKind::Config => "config",
            ErrorKind::Bug => "bug",
        }
    }

    /// How soon a pass that failed this way is tried again.
    pub fn retry_after(self) -> Duration {
        match self {
            ErrorKind::Platform | ErrorKind::Workers => Duration::from_secs(3),
            ErrorKind::Storage => Duration::from_secs(10),
            ErrorKind::Config | ErrorKind::Bug => Duration::from_secs(30),
        }
    }
}

fn coordinator_kind(e: &CoordinatorError) -> ErrorKind {
    match e {
        CoordinatorError::Snapshot(_) | CoordinatorError::Sink(_) => ErrorKind::Storage,
        _ => ErrorKind::Workers,
    }
}

impl PassError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            PassError::Token(_)
            | PassError::Observe(_)
            | PassError::Create(_)
            | PassError::Delete(_)
            | PassError::Random(_) => ErrorKind::Platform,
            PassError::Adopt(e) | PassError::FindSnapshot(e) | PassError::Start(e) => {
                coordinator_kind(e)
            }
            PassError::Credentials(e) if e.transient => ErrorKind::Platform,
            PassError::Bounds(_) | PassError::Credentials(_) => ErrorKind::Config,
            PassError::Transition(_) => ErrorKind::Bug,
        }
    }
}
