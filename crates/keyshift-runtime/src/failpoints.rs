//! TEST ONLY: failpoints the end-to-end tests and benchmarks use to drive the orchestration and
//! the workers into paths that are hard to reach otherwise. Compiled in only with the `test-hooks`
//! cargo feature; without it every failpoint is inert and reads no environment. A bottom-level
//! module: it knows steps and snapshots, nothing of the orchestrator or the operator.

use keyshift_core::step::Step;

/// Makes the orchestrator exit at a recorded transition step.
pub const PAUSE_AFTER_STEP_ENV: &str = "KEYSHIFT_TEST_PAUSE_AFTER_STEP";
/// Makes a rescale's restore fail at one parallelism.
pub const FAIL_RESTORE_ENV: &str = "KEYSHIFT_TEST_FAIL_RESTORE_AT";
/// Opaque bytes the workers keep with each key's state (benchmarks).
pub const STATE_PAYLOAD_ENV: &str = "KEYSHIFT_TEST_STATE_PAYLOAD_BYTES";

/// With `KEYSHIFT_TEST_PAUSE_AFTER_STEP=<Step>` (one of `Savepointing`, `Verifying`,
/// `Stopping`, `Restoring`), the process exits with code 3 as soon as a pass finds that step
/// recorded in a job's status.rescale.step (`step`), before acting on it: the step is in status,
/// its work is not done. The end-to-end tests use it to kill the operator deterministically
/// inside each step and check that a fresh operator resumes from status.
pub fn pause_at_step(name: &str, step: Option<Step>) {
    #[cfg(feature = "test-hooks")]
    {
        let Ok(want) = std::env::var(PAUSE_AFTER_STEP_ENV) else {
            return;
        };
        if step.is_some_and(|s| s.active() && s.as_str() == want) {
            tracing::warn!(job = %name, step = %want, "{PAUSE_AFTER_STEP_ENV}: exiting inside the step (test only)");
            std::process::exit(3);
        }
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = (name, step);
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

/// The directory whose files name the Kafka topics a test stalls ([`kafka_fetch_stalled`]).
pub const KAFKA_STALL_DIR: &str = "keyshift-test-kafka-stall";

/// While a file named `topic` exists in [`KAFKA_STALL_DIR`] under the system's temporary
/// directory, the Kafka source reads nothing from that topic's partitions, as a consumer that
/// stopped fetching would (the stall watchdog's test). Topics are unique per test, so no
/// environment is needed.
pub fn kafka_fetch_stalled(topic: &str) -> bool {
    #[cfg(feature = "test-hooks")]
    {
        std::env::temp_dir()
            .join(KAFKA_STALL_DIR)
            .join(topic)
            .exists()
    }
    #[cfg(not(feature = "test-hooks"))]
    {
        let _ = topic;
        false
    }
}

/// Makes a worker's restore take longer.
pub const SLOW_RESTORE_ENV: &str = "KEYSHIFT_TEST_SLOW_RESTORE_MS";
/// Shortens the coordinator's per-request timeout to the workers' control API.
pub const CONTROL_REQUEST_ENV: &str = "KEYSHIFT_TEST_CONTROL_REQUEST_MS";

/// With `KEYSHIFT_TEST_SLOW_RESTORE_MS=<ms>` in a worker's environment, its restore from a
/// snapshot takes `ms` longer (after the state is read, before the subtask runs), so a test can
/// make a restore outlast the control requests' timeout. Workers run in a test's own process
/// (the fake platform) are slowed per job instead, by [`slow_restores_of`].
pub async fn slow_restore(namespace: &str, name: &str) {
    #[cfg(feature = "test-hooks")]
    {
        let of_job = SLOW_RESTORES
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&(namespace.to_owned(), name.to_owned()))
            .copied();
        let delay = env_ms(SLOW_RESTORE_ENV)
            .map(std::time::Duration::from_millis)
            .or(of_job);
        if let Some(delay) = delay {
            tracing::warn!(
                job = %format!("{namespace}/{name}"),
                ms = delay.as_millis() as u64,
                "slowing the restore (test only)"
            );
            tokio::time::sleep(delay).await;
        }
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = (namespace, name);
}

/// Restores of job `namespace/name` by workers of this process take `delay` longer (`None`:
/// no longer), like [`SLOW_RESTORE_ENV`] for a whole worker process: for tests whose workers
/// run in their own process, where an environment variable would slow every test's workers.
pub fn slow_restores_of(namespace: &str, name: &str, delay: Option<std::time::Duration>) {
    #[cfg(feature = "test-hooks")]
    {
        let mut slow = SLOW_RESTORES
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let job = (namespace.to_owned(), name.to_owned());
        match delay {
            Some(d) => slow.insert(job, d),
            None => slow.remove(&job),
        };
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = (namespace, name, delay);
}

#[cfg(feature = "test-hooks")]
static SLOW_RESTORES: std::sync::Mutex<
    std::collections::BTreeMap<(String, String), std::time::Duration>,
> = std::sync::Mutex::new(std::collections::BTreeMap::new());

/// The coordinator's timeout of one control request: `KEYSHIFT_TEST_CONTROL_REQUEST_MS=<ms>` if
/// set (test only), else `default`.
pub fn control_request_timeout(default: std::time::Duration) -> std::time::Duration {
    #[cfg(feature = "test-hooks")]
    {
        env_ms(CONTROL_REQUEST_ENV).map_or(default, std::time::Duration::from_millis)
    }
    #[cfg(not(feature = "test-hooks"))]
    {
        default
    }
}

#[cfg(feature = "test-hooks")]
fn env_ms(var: &str) -> Option<u64> {
    std::env::var(var).ok().and_then(|v| v.trim().parse().ok())
}

/// Subtask `subtask` of job `namespace/name`, run by a worker in this process, takes `delay`
/// longer to write each snapshot's state (`None`: no longer), so that a test can make one
/// worker miss a checkpoint's timeout while the others acknowledge it. A write under way when
/// the delay is lifted still takes it.
pub fn slow_snapshots_of(
    namespace: &str,
    name: &str,
    subtask: u32,
    delay: Option<std::time::Duration>,
) {
    #[cfg(feature = "test-hooks")]
    {
        let mut slow = SLOW_SNAPSHOTS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let key = (namespace.to_owned(), name.to_owned(), subtask);
        match delay {
            Some(d) => slow.insert(key, d),
            None => slow.remove(&key),
        };
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = (namespace, name, subtask, delay);
}

/// Delays the state write of snapshot `id` by subtask `subtask` of job `namespace/name` as
/// [`slow_snapshots_of`] asked (not at all by default).
pub async fn slow_snapshot(namespace: &str, name: &str, subtask: u32, id: u64) {
    #[cfg(feature = "test-hooks")]
    {
        let delay = SLOW_SNAPSHOTS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&(namespace.to_owned(), name.to_owned(), subtask))
            .copied();
        if let Some(delay) = delay {
            tracing::warn!(
                job = %format!("{namespace}/{name}"),
                subtask,
                id,
                ms = delay.as_millis() as u64,
                "slowing the snapshot's state write (test only)"
            );
            tokio::time::sleep(delay).await;
        }
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = (namespace, name, subtask, id);
}

#[cfg(feature = "test-hooks")]
static SLOW_SNAPSHOTS: std::sync::Mutex<
    std::collections::BTreeMap<(String, String, u32), std::time::Duration>,
> = std::sync::Mutex::new(std::collections::BTreeMap::new());

/// A fault a test injects into the rewrite of a key-group change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RewriteFault {
    /// The rewrite runs with this memory budget (bytes) instead of the configured one.
    MemoryBudget(usize),
    /// A byte of the rewritten savepoint's first state file is flipped once it committed, so
    /// that its verification fails.
    CorruptOutput,
}

/// Makes the rewrites of job `namespace/name` in this process meet `fault` (`None`: none).
/// Operators run as their own process take [`CORRUPT_REWRITE_ENV`] instead.
pub fn rewrite_fault_of(namespace: &str, name: &str, fault: Option<RewriteFault>) {
    #[cfg(feature = "test-hooks")]
    {
        let mut faults = REWRITE_FAULTS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let job = (namespace.to_owned(), name.to_owned());
        match fault {
            Some(f) => faults.insert(job, f),
            None => faults.remove(&job),
        };
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = (namespace, name, fault);
}

/// With `KEYSHIFT_TEST_CORRUPT_REWRITE=1`, every rewrite's output is corrupted once it
/// committed ([`RewriteFault::CorruptOutput`]).
pub const CORRUPT_REWRITE_ENV: &str = "KEYSHIFT_TEST_CORRUPT_REWRITE";

/// The fault injected into rewrites of job `namespace/name`, if any.
pub fn rewrite_fault(namespace: &str, name: &str) -> Option<RewriteFault> {
    #[cfg(feature = "test-hooks")]
    {
        if std::env::var(CORRUPT_REWRITE_ENV).is_ok_and(|v| v.trim() == "1") {
            return Some(RewriteFault::CorruptOutput);
        }
        REWRITE_FAULTS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&(namespace.to_owned(), name.to_owned()))
            .copied()
    }
    #[cfg(not(feature = "test-hooks"))]
    {
        let _ = (namespace, name);
        None
    }
}

#[cfg(feature = "test-hooks")]
static REWRITE_FAULTS: std::sync::Mutex<
    std::collections::BTreeMap<(String, String), RewriteFault>,
> = std::sync::Mutex::new(std::collections::BTreeMap::new());

/// Flips one byte in the middle of the first state file of the snapshot at `url` (for
/// [`RewriteFault::CorruptOutput`]).
pub async fn corrupt_snapshot(url: &str) -> Result<(), String> {
    use object_store::ObjectStoreExt;
    let (store, dir, manifest) = crate::snapshot::open_snapshot(url)
        .await
        .map_err(|e| e.to_string())?;
    let Some(file) = manifest.files.iter().find(|f| f.size > 0) else {
        return Err("no state file to corrupt".into());
    };
    let path = dir.clone().join(file.name.as_str());
    let mut bytes = store
        .get(&path)
        .await
        .map_err(|e| e.to_string())?
        .bytes()
        .await
        .map_err(|e| e.to_string())?
        .to_vec();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x5a;
    store
        .put(&path, bytes.into())
        .await
        .map_err(|e| e.to_string())?;
    tracing::warn!(%url, file = %file.name, "corrupted a byte of the rewritten savepoint (test only)");
    Ok(())
}
