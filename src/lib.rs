//! keyshift: a Kubernetes operator and runtime for stateful keyed stream jobs that rescales them
//! by moving key groups through an object store.
//!
//! The pure core (key-group math, validation, planning) has no I/O; the CLI, operator and worker
//! sit around it.
//!
//! # Cargo features
//!
//! None is on by default, and the product build (the release binary and the image) has neither:
//!
//! * `bench`: the benchmarks, `bench/` (`keyshift bench ...`; with `kafka` also
//!   `keyshift bench kafka`) and
//!   `savepoint::bench` (`keyshift savepoint bench-rewrite`). Implies `test-hooks`, because
//!   `keyshift bench operator` runs its own binary as the operator with a test-only hook set.
//! * `test-hooks`: test-only fault injection, the orchestration's `KEYSHIFT_TEST_*` environment
//!   hooks (`failpoints`). The test suite (hack/test.sh) builds with it.

#[cfg(feature = "bench")]
pub mod bench;
pub use keyshift_runtime::{backoff, failpoints, job, offline, runtime, sink, snapshot};

pub mod cli;
pub mod client;
pub mod crd;
#[cfg(test)]
pub(crate) mod fixtures;
pub use keyshift_core::keygroup;
pub mod leader;
pub mod local;
pub mod operator;
pub mod orchestrator;
pub mod output;
pub mod pictures;
pub mod plan_svg;
pub mod probe;
pub mod savepoint;
pub mod svg;
pub mod telemetry;
pub use keyshift_core::text;
pub mod validation;
