//! keyshift's worker runtime: what runs inside a worker, and the snapshot format it writes. It
//! depends on keyshift-core and an object store, never on a Kubernetes client or the operator, so
//! a job binary can link it alone.
//!
//! * [`runtime`]: the worker process (control API, sources, key-group shuffle, keyed operator,
//!   barrier alignment, checkpoints, restore, pre-stage, metrics).
//! * [`job`]: the job's dataflow, pure: records, the generator, file and Kafka sources, the keyed
//!   aggregation with per-key-group state blocks, watermarks, result rows.
//! * [`snapshot`]: state files and manifests in any `object_store` URL.
//! * [`sink`]: the exactly-once object-store sink's staging and publish.
//! * [`offline`]: operations on snapshots without a running job (list, inspect, verify every key,
//!   dump, rewrite to another key-group count, dispose; the in-use marker).
//! * [`telemetry`]: log output.
//! * [`backoff`]: every retry's delays.
//!
//! A job's own worker binary is its programs handed to [`runtime::worker::main`]:
//!
//! ```no_run
//! use keyshift_runtime::job::Programs;
//! # fn job() -> keyshift_sdk::dataflow::Job { unimplemented!() }
//! fn main() -> std::process::ExitCode {
//!     match Programs::new().with("my-job", job()) {
//!         Ok(programs) => keyshift_runtime::runtime::worker::main(programs),
//!         Err(e) => {
//!             eprintln!("{e}");
//!             std::process::ExitCode::FAILURE
//!         }
//!     }
//! }
//! ```
//! * [`failpoints`]: test-only fault injection (inert without the `test-hooks` feature).
//!
//! # Cargo features
//!
//! * `kafka`: the Kafka source and sink (librdkafka, built from source).
//! * `test-hooks`: the failpoints.

pub mod backoff;
pub mod failpoints;
pub mod job;
pub mod offline;
pub mod runtime;
pub mod sink;
pub mod snapshot;
pub mod telemetry;
