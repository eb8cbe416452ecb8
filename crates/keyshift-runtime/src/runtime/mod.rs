//! The worker runtime: the control API contract, the data plane between subtasks, and the worker
//! process. The coordinator (the product crate's `coordinator`) drives workers through [`protocol`] only, so
//! it does not care whether they are local processes or pods.

pub mod checkpoint;
pub mod incremental;
pub mod ledger;
pub mod metrics;
pub mod prestage;
pub mod protocol;
pub mod restore;
pub mod shuffle;
pub mod signal;
pub mod worker;
