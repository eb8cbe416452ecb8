//! keyshift's pure core, the bottom layer of the workspace: everything here is logic over values,
//! with no I/O, no async runtime and no Kubernetes client, so the worker runtime, the operator and
//! the command-line tools all build on it and it depends on none of them.
//!
//! * [`keygroup`]: key -> key group -> subtask, bit for bit Apache Flink's
//!   `KeyGroupRangeAssignment`, and the skew of an assignment.
//! * [`spec`]: the job-level spec types (`spec.job`, `spec.state`, the rescale and upgrade
//!   policies), embedded in the operator's `StreamJob` resource and sent to the workers.
//! * [`step`]: the steps of a rescale or upgrade and the transitions between them.
//! * [`reason`]: the reasons of conditions and Events.
//! * [`rules`]: every spec rule's message, and the rules of `spec.job` ([`rules::validate_job`]).
//! * [`combining`]: when a source combines records before the shuffle.
//! * [`positions`]: source positions by partition name, merged and split over subtasks.
//! * [`window`]: which tumbling window a timestamp is in.
//! * [`text`]: small helpers for messages people read.
//! * [`duration`]: the one parser of the spec's durations (`30s`, `1h30m`).
//! * [`hash`]: the stable hash behind fingerprints and spec hashes.
//! * [`worker_pod`]: the worker pod's contract with the operator (ports, reserved environment,
//!   scratch volume).

pub mod combining;
pub mod duration;
pub mod hash;
pub mod keygroup;
pub mod positions;
pub mod reason;
pub mod record_key;
pub mod redistribution;
pub mod rules;
pub mod spec;
pub mod step;
pub mod text;
pub mod window;
pub mod worker_pod;
