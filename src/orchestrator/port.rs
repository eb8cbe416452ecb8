//! The narrow port between the orchestration and the platform its workers run on. The pass
//! ([`super::pass`]) decides and executes over this trait only; the operator implements it with
//! pods (the operator's `pods` module), `keyshift local` with processes (local mode's `processes`),
//! and the cluster-free tests with a fake.

use super::decide::ObservedPod;
use crate::crd::KafkaCredentials;
use crate::job::kafka::{Credentials, Role};
use crate::orchestrator::coordinator::WorkerEndpoint;
use keyshift_core::keygroup::Assignment;
use std::sync::Arc;

/// A platform operation that failed, named by what was being done.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{what}: {message}")]
pub struct PortError {
    /// What the platform was asked to do ("listing the job's pods", "starting worker 3", ...).
    pub what: String,
    pub message: String,
    /// The platform's own API refused or could not be reached (retry soon), as opposed to
    /// something about the job itself.
    pub transient: bool,
}

impl PortError {
    pub fn new(what: impl Into<String>, message: impl ToString, transient: bool) -> Self {
        PortError {
            what: what.into(),
            message: message.to_string(),
            transient,
        }
    }
}

/// One worker of the job as the platform sees it (its own state is asked by the pass).
#[derive(Debug, Clone)]
pub struct Listed {
    /// The worker (`worker` is `None` here: the pass asks each worker's control API).
    pub pod: ObservedPod,
    /// Where it listens, once it has an address.
    pub endpoint: Option<WorkerEndpoint>,
    /// The key-group count its run was started under, when recorded.
    pub max_parallelism: Option<u32>,
}

/// Wakes the job's driver when a background step ends.
pub type Waker = Arc<dyn Fn() + Send + Sync>;

/// Where and how a job's workers run.
#[async_trait::async_trait]
pub trait Workers: Send {
    /// The job's workers, of every run, now.
    async fn observe(&mut self) -> Result<Vec<Listed>, PortError>;

    /// Creates the workers `subtasks` of run `run` (of `assignment.parallelism()` subtasks),
    /// accepting `token` on their control API.
    async fn create(
        &mut self,
        run: &str,
        assignment: Assignment,
        subtasks: &[u32],
        token: &str,
    ) -> Result<(), PortError>;

    /// Removes these workers (by [`ObservedPod::name`]); a worker already gone is no error.
    async fn delete(&mut self, names: &[String]) -> Result<(), PortError>;

    /// The job's control token, from its source of truth (created on first use). The pass
    /// caches it, and asks again before it creates workers (so a deleted Secret is recreated
    /// before a worker needs it).
    async fn token(&mut self) -> Result<String, PortError>;

    /// What wakes the job's driver when a background step ends.
    fn waker(&self) -> Waker;

    /// The Kafka credentials `creds` names, for a client of `role` that the orchestration itself
    /// runs (the exactly-once sink's publisher runs beside the coordinator). By default from this
    /// process's environment, under the names the workers get them ([`Credentials::from_env`]):
    /// `keyshift local` passes its environment to its workers as well. The operator reads the
    /// job's Secret instead.
    async fn kafka_credentials(
        &mut self,
        role: Role,
        creds: &KafkaCredentials,
    ) -> Result<Credentials, PortError> {
        Credentials::from_env(role, Some(creds)).map_err(|e| {
            PortError::new(
                format!(
                    "reading the Kafka credentials of Secret {}",
                    creds.secret_name
                ),
                e,
                false,
            )
        })
    }
}
