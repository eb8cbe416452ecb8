//! keyshift: a Kubernetes operator and runtime for stateful keyed stream jobs that rescales them
//! by moving key groups through an object store.
//!
//! The pure core (key-group math, validation, planning) has no I/O; the CLI, operator and worker
//! sit around it.

pub mod bench;
pub mod bench_operator;
pub mod cli;
pub mod coordinator;
pub mod crd;
pub mod job;
pub mod keygroup;
pub mod leader;
pub mod local;
pub mod operator;
pub mod orchestrator;
pub mod runtime;
pub mod sink;
pub mod snapshot;
pub mod telemetry;
pub mod tools;
pub mod validation;
