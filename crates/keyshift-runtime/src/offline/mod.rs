//! Offline operations on snapshots, the library under the `keyshift savepoint list | inspect |
//! verify | dump | rewrite | dispose` command (the product crate's `savepoint` module) and under
//! the operator's managed key-group change (which rewrites and verifies a savepoint) and in-use
//! marker.
//!
//! Everything here works on a snapshot in an object store without a running job: it reads the
//! manifest and the key-group blocks through the snapshot layer ([`crate::snapshot`]) and decodes
//! blocks with the self-describing block format ([`crate::job::state_codec`]), so no job spec is
//! needed.
//!
//! | command | library entry point |
//! | --- | --- |
//! | `list STORAGE/NS/JOB` | [`list_job`] -> [`JobListing`] |
//! | `inspect URL` | [`inspect()`](inspect::inspect) -> [`InspectReport`] |
//! | `verify URL` | [`verify_keys`] -> [`VerifyOutcome`] |
//! | `dump URL [--key-groups A-B]` | [`dump()`](dump::dump) (JSON lines, see [`DumpLine`]) |
//! | `rewrite URL --max-parallelism G --to URL2` | [`rewrite()`](rewrite::rewrite) -> [`RewriteReport`]; the algorithm is in [`rewrite`] |
//! | `dispose URL [--force]` | [`dispose()`](retention::dispose) -> [`DisposeReport`]; the "still needed" rules and the in-use marker contract are in [`retention`] |
//!
//! `URL` is a snapshot directory, e.g. `file:///var/lib/keyshift/default/clicks/savepoints/sp-7`
//! or `s3://bucket/prefix/default/clicks/checkpoints/chk-42` (credentials as for
//! [`open_store`](crate::snapshot::open_store)).
//!
//! All reads are streamed (range reads of at most 16 MiB windows, two in flight) and every block is
//! checked against the manifest's CRC-32C before it is decoded, so the tools never act on corrupt
//! bytes and their memory does not grow with the state.

mod blocks;
pub mod dump;
mod error;
pub mod inspect;
mod location;
pub mod retention;
pub mod rewrite;
pub mod verify;

pub use blocks::blocking;
pub use dump::{DumpLine, DumpSummary, dump_with_progress, parse_key_groups};
pub use error::{Result, ToolError};
pub use inspect::{GroupSize, InspectReport, KeyStat, OperatorStateSummary, SubtaskShare};
pub use location::{SnapshotLocation, open_location, open_location_for_write, split_snapshot_url};
pub use retention::{
    DisposeOptions, DisposeReport, IN_USE_FILE, InUseEntry, InUseMarker, InUseReason, JobListing,
    Listed, dispose, list_job, read_in_use, write_in_use,
};
pub use rewrite::{Phase, Progress, RewriteOptions, RewriteReport, Timings};
pub use verify::{FileCheck, VerifyOutcome, verify_keys, verify_keys_with_progress};

/// How far a long offline pass (verify, dump) has got: `done` of `total` units (bytes for
/// `verify`, key groups for `dump`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Advance {
    /// Units done so far.
    pub done: u64,
    /// Units in all.
    pub total: u64,
}

/// An aggregate function as the manifest spells it (`count`, `sum`, ...).
pub fn function_name(f: keyshift_core::spec::AggregateFunction) -> String {
    serde_json::to_value(f)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// A window size as people read it: `60000 ms`, or `none` without a window.
pub fn window_words(ms: Option<i64>) -> String {
    ms.map_or_else(|| "none".to_owned(), |w| format!("{w} ms"))
}

#[cfg(test)]
mod words_tests {
    use super::*;

    #[test]
    fn no_debug_forms() {
        assert_eq!(
            function_name(keyshift_core::spec::AggregateFunction::Count),
            "count"
        );
        assert_eq!(window_words(Some(60_000)), "60000 ms");
        assert_eq!(window_words(None), "none");
    }
}
