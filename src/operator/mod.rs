//! `keyshift operator`: a kube-rs controller for StreamJobs.
//!
//! Pure steps — [`decide::check_spec`] (validate), [`desired`] (the pods and Secret a job owns),
//! [`decide::decide`] (the one next action from spec, status and what is observed),
//! [`status::finish`] (phase and conditions) — around a thin I/O shell ([`reconcile`]) that
//! reads the world, executes the action with the shared [`crate::coordinator::Coordinator`],
//! and writes status with server-side apply under one field manager.
//!
//! The rescale protocol (`DESIGN.md` §4) is a state machine whose step lives in
//! `status.rescale.step` and is written before the step acts: Savepointing -> Verifying ->
//! Stopping -> Restoring -> Done, or Abandoned (the job keeps its old parallelism). A suspend is
//! the same machine with target parallelism 0. A restarted operator resumes from status: it
//! re-adopts running workers (their state lives in the worker processes), re-takes a savepoint
//! that was not recorded, re-verifies, and finishes deleting or starting pods.

pub mod decide;
pub mod desired;
pub mod metrics;
pub mod reconcile;
pub mod status;

pub use reconcile::{Context, OperatorConfig, OperatorError, run};
