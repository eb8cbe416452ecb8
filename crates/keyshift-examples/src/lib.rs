//! Example jobs on keyshift's SDK, jobs the built-in aggregation cannot express, each with an
//! oracle that computes its expected output independently of the SDK:
//!
//! * [`dedup`]: each event id's first occurrence, again once its TTL has run out;
//! * [`silence`]: an alert when a device sends no heartbeat for a while, once per silence.
//!
//! [`input`] generates their deterministic inputs.

pub mod dedup;
pub mod input;
pub mod silence;
