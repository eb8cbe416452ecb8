//! `keyshift operator`: a kube-rs controller for StreamJobs.
//!
//! The orchestration itself — validate, decide the one next action, execute it, derive phase
//! and conditions — is the platform-neutral [`crate::orchestrator`]; this module is its pod
//! platform and its Kubernetes shell, one room per role:
//!
//! - [`controller`]: the controllers (one per watched namespace), finalizer, error policy;
//! - [`context`]: settings, client, Event recorder, per-job memory, wakers;
//! - [`apply`]: one pass (read the job, run the orchestration pass, write status and Events);
//! - [`pods`]: the [`crate::orchestrator::port::Workers`] port over pods, the token Secret and
//!   the job's NetworkPolicy (applied before a run's pods);
//! - [`desired`]: the pods, Secret and NetworkPolicy a job owns (pure);
//! - [`error`]: the one error type, with a kind per failure;
//! - [`metrics`]: Prometheus metrics and the `/metrics` server;
//! - [`snapshot`]: the StreamJobSnapshot controller (records, in-use, retention, disposal).
//!
//! The transition protocol (a state machine whose step lives in `status.rescale.step` and is
//! written before the step acts) is described in `docs/architecture.md`. A restarted operator
//! resumes from status: it re-adopts running workers (their state lives in the worker
//! processes), re-takes a savepoint that was not recorded, re-verifies, and finishes deleting or
//! starting pods.

mod apply;
pub mod context;
pub mod controller;
pub mod desired;
pub mod error;
pub mod metrics;
pub mod pods;
pub mod snapshot;

pub use context::{Context, OperatorConfig};
pub use controller::{run, run_controllers};
pub use error::OperatorError;
