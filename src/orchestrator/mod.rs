//! The orchestration both platforms share: how a run of a job is built (its coordinator, its
//! start request, its identities and timeouts). `keyshift operator` (pods) and `keyshift local`
//! (processes) build runs only through here, so they cannot drift apart.

pub mod ceiling;
pub mod coordinator;
pub mod decide;
pub mod pass;
pub mod port;
pub use keyshift_core::reason;
pub mod run;
pub mod settings;
pub mod status;
pub mod timeouts;
pub use keyshift_core::step;
