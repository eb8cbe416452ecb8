//! The `StreamJobSnapshot` custom resource (`keyshift.dev/v1alpha1`): one savepoint of a
//! StreamJob as an object to list, keep, restore from and delete.
//!
//! Creating one asks the job's operator pass for a savepoint (the job keeps running), or, with
//! spec.path, records a snapshot that already exists. Its status says where the snapshot is,
//! how large, at which key-group count, whether it checked out and whether the job still needs
//! it. Deleting it disposes of the snapshot's files (spec.deletionPolicy) once no job needs
//! them; a StreamJob's spec.snapshotRetention deletes the oldest ones it no longer needs.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A savepoint of a StreamJob, taken when this resource is created (or an existing snapshot
/// recorded with spec.path).
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "keyshift.dev",
    version = "v1alpha1",
    kind = "StreamJobSnapshot",
    plural = "streamjobsnapshots",
    shortname = "sjsnap",
    category = "keyshift",
    namespaced,
    status = "StreamJobSnapshotStatus",
    doc = "A savepoint of a StreamJob as a resource. Create one to take a savepoint of the running job without stopping it (or set spec.path to record an existing snapshot); name it in the job's spec.restoreFrom to restore from it; delete it to dispose of its files (spec.deletionPolicy). A snapshot the job still needs is never disposed of.",
    printcolumn = r#"{"name":"Job","type":"string","description":"The StreamJob (spec.jobName)","jsonPath":".spec.jobName"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","description":"Pending, Ready or Failed","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Size","type":"integer","description":"Bytes of state (status.sizeBytes)","jsonPath":".status.sizeBytes"}"#,
    printcolumn = r#"{"name":"Groups","type":"integer","description":"Key-group count (status.maxParallelism)","jsonPath":".status.maxParallelism"}"#,
    printcolumn = r#"{"name":"In use","type":"boolean","description":"Whether the job still needs it (status.inUse): it is then not disposed of","jsonPath":".status.inUse"}"#,
    printcolumn = r#"{"name":"Path","type":"string","priority":1,"description":"URL of the snapshot directory (status.path)","jsonPath":".status.path"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct StreamJobSnapshotSpec {
    /// The StreamJob (in this namespace) whose savepoint this is. Fixed once created.
    pub job_name: String,

    /// Record an existing snapshot instead of taking one: the URL of a committed savepoint or
    /// checkpoint directory (one holding `_manifest.json`), e.g.
    /// `s3://bucket/prefix/ns/job/savepoints/sp-7`. Unset (the default): the job takes a
    /// savepoint for this resource. Fixed once created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,

    /// What deleting this resource does to the snapshot's files (see [`DeletionPolicy`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deletion_policy: Option<DeletionPolicy>,
}

/// What deleting this resource does to the snapshot's files: `Delete` disposes of them (its
/// manifest first, then its files; files that newer incremental checkpoints still read stay
/// until those go), `Retain` keeps them in storage. Default: `Delete` for a savepoint this
/// resource took, `Retain` for one it recorded (spec.path). Either way a snapshot the job still
/// needs (status.inUse) is not disposed of: the deletion waits until it is no longer needed, or
/// until this is set to `Retain`.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum DeletionPolicy {
    /// Dispose of the snapshot's files with the resource.
    Delete,
    /// Keep the files in storage.
    Retain,
}

impl StreamJobSnapshotSpec {
    /// The deletion policy in force: the field, else `Delete` for a taken savepoint and
    /// `Retain` for a recorded one.
    pub fn effective_deletion_policy(&self) -> DeletionPolicy {
        self.deletion_policy.unwrap_or(if self.path.is_some() {
            DeletionPolicy::Retain
        } else {
            DeletionPolicy::Delete
        })
    }
}

/// The observed state of a StreamJobSnapshot.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StreamJobSnapshotStatus {
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Lifecycle phase (see [`SnapshotPhase`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<SnapshotPhase>,
    /// URL of the snapshot directory. Name this resource (or this URL) in a StreamJob's
    /// spec.restoreFrom to restore from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// `savepoint`, or `checkpoint` for a recorded checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>")]
    pub kind: Option<keyshift_runtime::snapshot::SnapshotKind>,
    /// The snapshot's id in its job's history.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<i64>,
    /// When the snapshot completed (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time: Option<String>,
    /// The parallelism it was taken at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallelism: Option<i32>,
    /// Its key-group count: a job restores it at this maxParallelism (or after `keyshift
    /// savepoint rewrite`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_parallelism: Option<i32>,
    /// Bytes of keyed state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<i64>,
    /// Keys it holds state for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys: Option<i64>,
    /// Whether every file of the snapshot is present with the size and checksum its manifest
    /// names (checked once, when it became Ready).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verified: Option<bool>,
    /// Whether a job still needs it (it is its job's newest checkpoint or snapshot or pinned by
    /// a transition in flight, while that job exists, or a StreamJob's spec.restoreFrom names
    /// it): such a snapshot is neither disposed of nor retired by spec.snapshotRetention.
    /// Refreshed every few minutes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_use: Option<bool>,
    /// Why the job still needs it, in words (empty when it does not).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub in_use_reasons: Vec<String>,
    /// What the snapshot is waiting for, or why it failed, in one line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Conditions: Ready (True once the snapshot exists and can be restored).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// Lifecycle phase: `Pending` (the job has not taken it yet), `Ready` (it exists and can be
/// restored) or `Failed` (a recorded spec.path that is no snapshot, or one that does not check
/// out).
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum SnapshotPhase {
    /// Waiting for the job to take it.
    Pending,
    /// The snapshot exists and can be restored.
    Ready,
    /// It cannot become Ready (see the message); delete it.
    Failed,
}

impl std::fmt::Display for SnapshotPhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SnapshotPhase::Pending => "Pending",
            SnapshotPhase::Ready => "Ready",
            SnapshotPhase::Failed => "Failed",
        })
    }
}

/// How many of a job's StreamJobSnapshots to keep: the snapshot controller deletes the
/// oldest Ready ones beyond `keep`, and any older than `maxAge`, unless the job still needs
/// them (status.inUse). Deleting one disposes of its files or keeps them as its
/// spec.deletionPolicy says.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotRetention {
    /// Keep at most this many Ready snapshots of the job (the newest), at least 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep: Option<i32>,
    /// Delete Ready snapshots older than this (a duration such as 168h; units: ms, s, m, h).
    /// The newest snapshot is kept whatever its age.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_age: Option<String>,
}
