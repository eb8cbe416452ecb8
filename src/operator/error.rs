//! The operator's one error type: every variant names what failed, and has a kind (the label
//! of the reconcile-error metric, which also decides how soon the pass is retried).

use crate::orchestrator::pass::{ErrorKind, PassError};
use crate::orchestrator::port::PortError;
use std::net::SocketAddr;

/// Operator failures (a failed pass is retried after its kind's delay).
#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    #[error("kubernetes client configuration (kubeconfig or in-cluster): {0}")]
    ClientConfig(#[from] kube::config::InferConfigError),
    #[error("creating the kubernetes client: {0}")]
    Client(#[source] kube::Error),
    #[error("the StreamJob has no namespace or name: {0}")]
    Identify(#[from] super::desired::DesiredError),
    #[error("adding the cleanup finalizer: {0}")]
    AddFinalizer(#[source] kube::Error),
    #[error("running the cleanup finalizer: {0}")]
    Finalizer(String),
    #[error("removing the deleted job's pods: {0}")]
    Cleanup(#[source] PortError),
    #[error("reading the StreamJob: {0}")]
    ReadJob(#[source] kube::Error),
    #[error("writing the StreamJob's status: {0}")]
    WriteStatus(#[source] kube::Error),
    #[error("{0}")]
    Pass(#[from] PassError),
    #[error("metrics server on {addr}: {source}")]
    Metrics {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("leader election: {0}")]
    Leader(#[from] crate::leader::LeaderError),
    #[error("StreamJobSnapshot: {0}: {1}")]
    SnapshotApi(&'static str, #[source] kube::Error),
    #[error("StreamJobSnapshot: reading the snapshot: {0}")]
    SnapshotTask(String),
    #[error("StreamJobSnapshot storage: {0}")]
    SnapshotStorage(#[source] crate::offline::ToolError),
}

impl OperatorError {
    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        match self {
            OperatorError::Pass(e) => e.kind(),
            OperatorError::Identify(_) => ErrorKind::Config,
            OperatorError::SnapshotStorage(_) => ErrorKind::Storage,
            _ => ErrorKind::Platform,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_failed_action_and_have_a_kind() {
        let e = OperatorError::Pass(PassError::Create(PortError::new(
            "creating pod j-r-0",
            "forbidden: violates PodSecurity",
            true,
        )));
        assert_eq!(
            e.to_string(),
            "creating workers: creating pod j-r-0: forbidden: violates PodSecurity"
        );
        assert_eq!(e.kind(), ErrorKind::Platform);
        assert_eq!(e.kind().label(), "platform");
        let bug = OperatorError::Pass(PassError::Transition("outcome Stopped in step Done".into()));
        assert_eq!(bug.kind(), ErrorKind::Bug);
        assert!(bug.kind().retry_after() > e.kind().retry_after());
        let storage = OperatorError::Pass(PassError::FindSnapshot(
            crate::orchestrator::coordinator::CoordinatorError::Snapshot(
                crate::snapshot::SnapshotError::ManifestMissing {
                    path: "ns/j/checkpoints/chk-3".into(),
                },
            ),
        ));
        assert_eq!(storage.kind(), ErrorKind::Storage);
        assert!(
            storage
                .to_string()
                .starts_with("finding the snapshot to restore: ")
        );
    }
}
