//! The one next action a decision asks of the I/O shell.

use super::*;

/// The one next thing to do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// The spec cannot be run as is: say so (Stalled), leave the workers as they are.
    Stall { reason: Reason, message: String },
    /// Record the key-group count (and where it came from) in status before anything is
    /// snapshotted.
    PinMaxParallelism { groups: u32, origin: String },
    /// Record a new rescale in status (step Savepointing; with `prestage`, the run id of its
    /// new workers, step Prestaging); nothing else happens in this pass.
    BeginRescale {
        from: u32,
        to: u32,
        prestage: Option<String>,
    },
    /// Pre-stage the new workers of run `run` (all running and idle or pre-staged) beside the
    /// running job: they load their key groups from its newest checkpoint and catch up (in the
    /// background); on success record step Savepointing.
    Prestage { run: String, parallelism: u32 },
    /// A pre-staged rescale cannot use its new workers: record why (status.rescale.fallback)
    /// and go on as a stop-and-restore.
    FallBack { message: String },
    /// Delete the pods of run `run` only (a pre-staged rescale's new workers that are not
    /// used).
    DeleteRun { run: String, reason: Reason },
    /// Delete every pod of the job except those of run `keep` (the Stopping step of a
    /// pre-staged rescale: the old workers go, the new ones stay).
    DeleteAllBut { keep: String },
    /// spec.job or spec.image changed: record an upgrade at the same parallelism in status
    /// (step Savepointing for `savepoint`, Stopping otherwise), pre-staged by the new run
    /// `prestage` when one is named (step Prestaging: the new workers, of the new spec, load
    /// the state while the job runs, and refuse it before the job stops if it does not fit).
    BeginUpgrade {
        parallelism: u32,
        mode: UpgradeMode,
        prestage: Option<String>,
    },
    /// spec.restoreFrom changed on a running job: record a transition (step Savepointing, so
    /// the current state is kept in a savepoint) whose new run restores `url` at `to`, under
    /// `max_parallelism` key groups.
    BeginRestore {
        from: u32,
        to: u32,
        url: String,
        max_parallelism: u32,
    },
    /// spec.maxParallelism differs from the pinned key-group count: record a key-group change
    /// from parallelism `from` to `to` under `groups` key groups. With the job `running`, its
    /// first step takes a savepoint; otherwise the newest snapshot is the one rewritten, and
    /// the change starts by verifying it.
    BeginKeyGroupChange {
        from: u32,
        to: u32,
        groups: u32,
        running: bool,
    },
    /// Rewrite savepoint `source` into `target` under `groups` key groups at `parallelism`
    /// (in the background); on success record step VerifyingRewrite.
    Rewrite {
        source: String,
        target: String,
        groups: u32,
        parallelism: u32,
    },
    /// Verify the rewritten savepoint `target` down to every key, and its key count against
    /// `source`'s; on success record step Restoring.
    VerifyRewrite { source: String, target: String },
    /// A key-group change cannot go on (or spec.maxParallelism was set back): restore the
    /// original savepoint at the old parallelism and key-group count.
    RollBackRewrite { message: String },
    /// Take a savepoint stopping the sources; on success record step Verifying with its URL.
    Savepoint,
    /// Verify the recorded savepoint; on success record step Stopping.
    Verify { url: String },
    /// Delete every pod of the job (stopping a run; a rescale's Stopping step).
    DeletePods { reason: Reason },
    /// A step's work is done (nothing ran in the background): record the step that follows.
    Advance(Outcome),
    /// Give up the rescale in flight: the job keeps (or returns to) its old parallelism.
    Abandon { message: String },
    /// Create the missing pods of a run.
    CreatePods {
        run: String,
        parallelism: u32,
        subtasks: Vec<u32>,
    },
    /// Pods are on their way (scheduled, starting, or workers booting).
    Wait { reason: String },
    /// Start the workers of a run whose pods are all running.
    Start {
        run: String,
        parallelism: u32,
        restore: Restore,
    },
    /// The workers of this run already run (operator restarted): coordinate them again.
    Adopt { run: String, parallelism: u32 },
    /// A worker of the running job failed: stop the run so it restarts from the last
    /// checkpoint.
    Recover { message: String },
    /// A rescale's new run is up: record step Done and the new parallelism.
    FinishRescale,
    /// Take a periodic checkpoint.
    Checkpoint,
    /// A savepoint asked for while the job runs (spec.savepointTriggerNonce, or a
    /// StreamJobSnapshot): take it without stopping the job, then record who asked.
    TriggerSavepoint { trigger: SavepointTrigger },
    /// spec.suspend and nothing runs: record phase Suspended at parallelism 0.
    MarkSuspended,
    /// Nothing to do until this much time has passed (or something changes).
    Idle { requeue: Duration },
}

/// Who asked for a savepoint of the running job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SavepointTrigger {
    /// spec.savepointTriggerNonce differs from status.lastSavepointNonce: recorded there once
    /// taken.
    Nonce(i64),
    /// A StreamJobSnapshot of this name waits for its savepoint: recorded in
    /// status.lastSavepoint.snapshot once taken.
    Snapshot(String),
}

impl std::fmt::Display for SavepointTrigger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SavepointTrigger::Nonce(n) => write!(f, "savepointTriggerNonce {n}"),
            SavepointTrigger::Snapshot(name) => write!(f, "StreamJobSnapshot {name}"),
        }
    }
}
