//! TEST ONLY: hooks the end-to-end tests and benchmarks use to drive the orchestration into
//! paths that are hard to reach otherwise. Compiled in only with the `test-hooks` cargo feature;
//! without it every hook is inert and reads no environment.

use crate::crd::StreamJobStatus;

/// Makes the orchestrator exit at a recorded transition step.
pub const PAUSE_AFTER_STEP_ENV: &str = "KEYSHIFT_TEST_PAUSE_AFTER_STEP";
/// Makes a rescale's restore fail at one parallelism.
pub const FAIL_RESTORE_ENV: &str = "KEYSHIFT_TEST_FAIL_RESTORE_AT";
/// Opaque bytes the workers keep with each key's state (benchmarks).
pub const STATE_PAYLOAD_ENV: &str = "KEYSHIFT_TEST_STATE_PAYLOAD_BYTES";

/// With `KEYSHIFT_TEST_PAUSE_AFTER_STEP=<Step>` (one of `Savepointing`, `Verifying`,
/// `Stopping`, `Restoring`), the process exits with code 3 as soon as a pass finds that step
/// recorded in a job's status.rescale.step, before acting on it: the step is in status, its
/// work is not done. The end-to-end tests use it to kill the operator deterministically inside
/// each step and check that a fresh operator resumes from status.
pub fn pause_at_step(name: &str, status: &StreamJobStatus) {
    #[cfg(feature = "test-hooks")]
    {
        let Ok(want) = std::env::var(PAUSE_AFTER_STEP_ENV) else {
            return;
        };
        if status
            .rescale
            .as_ref()
            .is_some_and(|r| r.step.active() && r.step.as_str() == want)
        {
            tracing::warn!(job = %name, step = %want, "{PAUSE_AFTER_STEP_ENV}: exiting inside the step (test only)");
            std::process::exit(3);
        }
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = (name, status);
}

/// With `KEYSHIFT_TEST_FAIL_RESTORE_AT=<N>`, starting the new run of a rescale to parallelism N
/// fails as if its restore had failed (the workers are not started), so the end-to-end tests
/// can drive the rollback deterministically.
pub fn fail_restore_at(parallelism: u32) -> bool {
    #[cfg(feature = "test-hooks")]
    {
        std::env::var(FAIL_RESTORE_ENV).is_ok_and(|v| v.trim() == parallelism.to_string())
    }
    #[cfg(not(feature = "test-hooks"))]
    {
        let _ = parallelism;
        false
    }
}

/// With `KEYSHIFT_TEST_STATE_PAYLOAD_BYTES=<N>`, workers keep N opaque bytes with each key's
/// state (`StartRequest::state_payload_bytes`), so `keyshift bench operator rescale` can build
/// large state from a small generator.
pub fn state_payload_bytes() -> usize {
    #[cfg(feature = "test-hooks")]
    {
        std::env::var(STATE_PAYLOAD_ENV).map_or(0, |v| v.trim().parse().unwrap_or(0))
    }
    #[cfg(not(feature = "test-hooks"))]
    {
        0
    }
}
