//! The `StreamJob` custom resource (`keyshift.dev/v1alpha1`).
//!
//! The Rust types are the source of the CRD schema: every doc comment below becomes a field
//! description (`kubectl explain`). The CRD document, with the CEL rules the API server enforces
//! attached, is `validation::crd()`: the rule table lives there and is also mirrored in
//! pure Rust.

use k8s_openapi::api::core::v1::{
    Affinity, EnvVar, LocalObjectReference, ResourceRequirements, Toleration,
    TopologySpreadConstraint, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub use keyshift_core::keygroup::KeyType;

mod snapshot;
pub use snapshot::*;

/// The desired state of a keyed stream job: what it computes, at which parallelism, and where its
/// state lives.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "keyshift.dev",
    version = "v1alpha1",
    kind = "StreamJob",
    plural = "streamjobs",
    shortname = "sj",
    category = "keyshift",
    namespaced,
    status = "StreamJobStatus",
    doc = "A stateful keyed stream job run by keyshift. Change spec.replicas (or `kubectl scale`) to rescale it: keyshift stops it with a savepoint, moves key groups through the object store and restarts it at the new parallelism without losing state.",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    printcolumn = r#"{"name":"Desired","type":"integer","description":"Requested parallelism (spec.replicas)","jsonPath":".spec.replicas"}"#,
    printcolumn = r#"{"name":"Running","type":"integer","description":"Parallelism the job is running at","jsonPath":".status.replicas"}"#,
    printcolumn = r#"{"name":"MaxP","type":"integer","description":"Key-group count (max parallelism), pinned at the first snapshot","jsonPath":".status.maxParallelism"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","description":"Lifecycle phase","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","description":"Whether the job runs at the requested spec","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Balanced","type":"string","priority":1,"description":"Whether key groups spread evenly over subtasks","jsonPath":".status.conditions[?(@.type==\"KeyGroupsBalanced\")].status"}"#,
    printcolumn = r#"{"name":"Step","type":"string","description":"Step of the rescale or upgrade in progress (status.step)","jsonPath":".status.step"}"#,
    printcolumn = r#"{"name":"Checkpoint","type":"date","description":"Time since the last completed checkpoint (status.lastCheckpoint.time)","jsonPath":".status.lastCheckpoint.time"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    printcolumn = r#"{"name":"Message","type":"string","description":"What the job is doing, in one short line (status.message; the Ready condition has all of it)","jsonPath":".status.message"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct StreamJobSpec {
    /// Parallelism: the number of worker subtasks (one pod each). Must be between 1 and the
    /// key-group count (maxParallelism). Ideally a divisor of it, so every subtask owns the same
    /// number of key groups. Changing it rescales the running job (also through `kubectl scale`).
    pub replicas: i32,

    /// Key-group count (Flink's max parallelism): the ceiling for replicas, between 1 and 32768.
    /// A key's group is `murmur(hash(key)) % maxParallelism`, so it is fixed for the life of the
    /// job's state: when unset it defaults to Flink's rule `min(max(nextPowerOfTwo(1.5 *
    /// replicas), 128), 32768)` and is pinned in status.maxParallelism at the first snapshot.
    /// Choose it explicitly (a power of two, 4-8x the largest parallelism you foresee). It cannot
    /// be changed afterwards except by restoring from a savepoint rewritten with `keyshift
    /// savepoint rewrite`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_parallelism: Option<i32>,

    /// What to do when replicas does not divide the key-group count: `Warn` (default) runs with
    /// the skew and reports it in the KeyGroupsBalanced condition; `Strict` refuses such a value.
    #[serde(default)]
    pub key_group_policy: KeyGroupPolicy,

    /// Container image of the workers. Defaults to the operator's worker image (its own image:
    /// the keyshift binary runs both). Powerful: the image's code runs in every worker pod with
    /// the job's control token, its storage credentials (spec.state.credentialsSecret) and its
    /// ServiceAccount, so whoever may edit StreamJobs may run any code there. An operator
    /// started with allowed image prefixes (chart value policy.allowedImagePrefixes) refuses a
    /// job whose image starts with none of them (condition Stalled, reason ImageNotAllowed)
    /// before it creates any pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,

    /// The dataflow: source, key, aggregation, optional window and sink.
    pub job: JobSpec,

    /// Where and how often state is snapshotted.
    #[serde(default)]
    pub state: StateSpec,

    /// How a change of image or job is rolled out: `savepoint` (default: stop with a savepoint
    /// and restore from it), `last-state` (restore from the latest checkpoint, no new
    /// savepoint) or `stateless` (start empty; existing state is not used). With
    /// rescaleStrategy `Prestage`, the default, `savepoint` and `last-state` upgrades first
    /// bring workers of the new spec up beside the running job to load its newest checkpoint,
    /// so a state the new image cannot read is refused before the job stops; the ready workers
    /// then start from the savepoint (`savepoint`) or from a stop checkpoint that writes only
    /// what changed since they loaded (`last-state`).
    #[serde(default)]
    pub upgrade_mode: UpgradeMode,

    /// How a change of spec.replicas is carried out. `Prestage` (default): the new workers start
    /// beside the old ones and load their key groups from the newest checkpoint while the job
    /// keeps running; then the job stops with a checkpoint that writes only what changed since,
    /// which the new workers apply before they resume (the pause grows with the changes, not
    /// the state). Pre-staged workers read no source and emit nothing. Needs room for both sets
    /// of workers for a while: when a new pod cannot be scheduled or is refused (a quota), or
    /// the new workers are not ready within spec.state.prestageTimeout, the rescale falls back
    /// to stop-and-restore (a condition and an Event say so). `StopAndRestore`: the job stops
    /// with a savepoint of its whole state and the new workers read it back (no second set of
    /// workers; the pause grows with the state). Suspends, restores and key-group changes always
    /// stop and restore; an upgrade that keeps the state pre-stages its new workers (see
    /// upgradeMode). A rescale or upgrade whose new workers
    /// refuse the state for good (an operator state that declares no redistribution, a state
    /// declaration the new image cannot read) is abandoned before the job stops: it runs on,
    /// Stalled with the reason, until the spec changes.
    #[serde(default, skip_serializing_if = "RescaleStrategy::is_default")]
    pub rescale_strategy: RescaleStrategy,

    /// Stop the job with a savepoint and remove its pods while true; resume from that savepoint
    /// when set back to false.
    #[serde(default)]
    pub suspend: bool,

    /// Change this to any new value to take a savepoint of the running job without stopping it.
    /// A StreamJobSnapshot does the same without editing the job (so a GitOps tool sees no
    /// drift) and keeps the savepoint as a resource to list, restore from and delete.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub savepoint_trigger_nonce: Option<i64>,

    /// Start the job from this snapshot instead of its own latest state: the URL of a savepoint
    /// or checkpoint directory, e.g. `s3://bucket/prefix/ns/job/savepoints/sp-7`, or the name
    /// of a Ready StreamJobSnapshot in the job's namespace (a value without `://`; the job
    /// waits, Stalled with reason SnapshotNotReady, while it is missing or not Ready, and that
    /// snapshot counts as in use). Acted on once per snapshot URL (recorded in
    /// status.restoredFrom): setting a new value on a running job takes a
    /// savepoint of the current state, stops the workers and restarts them from this snapshot; on
    /// a suspended job it applies at resume. A snapshot rewritten to a larger key-group count
    /// (`keyshift savepoint rewrite --max-parallelism G`) raises the job's ceiling: set
    /// maxParallelism to G in the same change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_from: Option<String>,

    /// How many of the job's StreamJobSnapshots to keep: the oldest Ready ones beyond
    /// `keep`, and those older than `maxAge`, are deleted (their files disposed of or kept as
    /// each one's spec.deletionPolicy says), except any the job still needs. Unset: every one
    /// is kept until deleted by hand.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_retention: Option<SnapshotRetention>,

    /// Allow restoring from a snapshot that holds state this job does not declare (it is
    /// dropped). Off by default, so a mistaken job change does not silently lose state.
    #[serde(default)]
    pub allow_non_restored_state: bool,

    /// Allow restoring state written under another key (spec.job.key.field or key.type) or
    /// another aggregation field. Off by default: such state holds another history (keys of the
    /// old kind stay in it beside the new ones), so a restore is refused before anything stops,
    /// naming what changed. A change of the aggregate function or the window is always refused;
    /// to start over with empty state instead, use `upgradeMode: stateless`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_state_layout_change: bool,

    /// Allow spec.restoreFrom to name a snapshot of another StreamJob (another name or
    /// namespace). Off by default, so a mistyped URL cannot make this job continue someone
    /// else's history.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_restore_from_another_job: bool,

    /// Allow a restore to go back past sink output already published: the records after the
    /// restored snapshot are processed again and their results published again, so readers of
    /// the sink see them twice. Off by default: a restore of one of the job's own snapshots
    /// older than the newest output its sink published (a spec.restoreFrom of an older
    /// savepoint, or a resume whose newer snapshots cannot be restored) is refused before
    /// anything stops (Stalled, reason OutputWouldRepeat), naming the snapshot and the output
    /// that would repeat.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_republishing_output: bool,

    /// Compute resources of each worker container. Default when unset: requests of cpu `100m`
    /// and memory `128Mi` and no limits (so the pods schedule on a namespace with a
    /// LimitRange or ResourceQuota that requires requests); set `resources: {}` for no requests
    /// at all. Like spec.podTemplate, a change applies to the pods of the job's next start
    /// (rescale, upgrade, restart or resume); on its own it does not restart the workers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,

    /// Extra metadata, placement, volumes and environment for the worker pods. The operator
    /// owns the rest of the pod: the worker container runs the image's entrypoint with the
    /// `worker` arguments, and the pod meets Pod Security `restricted` (non-root UID/GID 65532,
    /// no privilege escalation, all capabilities dropped, seccomp RuntimeDefault, read-only
    /// root filesystem with an emptyDir volume named `tmp` at /tmp, no service-account token).
    /// A change applies to the pods of the job's next start (rescale, upgrade, restart or
    /// resume); on its own it does not restart the workers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_template: Option<PodTemplateOverrides>,
}

pub use keyshift_core::spec::*;

/// Extra metadata, placement, volumes and environment for worker pods.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodTemplateOverrides {
    /// Labels added to every worker pod.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Annotations added to every worker pod.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Node selector of every worker pod.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// ServiceAccount the worker pods run as (they need no Kubernetes API access, and no token
    /// is mounted). Default: the namespace's default ServiceAccount. Powerful: any
    /// ServiceAccount of the namespace may be named, and a projected token volume in
    /// spec.podTemplate.volumes would hand its API rights (and its cloud identity, where
    /// workload identity maps one) to the job's code. An operator started with allowed service
    /// accounts (chart value policy.allowedServiceAccounts) refuses any other name (condition
    /// Stalled, reason ServiceAccountNotAllowed) before it creates any pod; the namespace's
    /// `default` is always allowed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_name: Option<String>,
    /// Volumes added to every worker pod (Kubernetes pod volumes: configMap, secret,
    /// persistentVolumeClaim, csi, ...), e.g. a ConfigMap holding a private CA bundle for S3, or
    /// a PersistentVolumeClaim for a `file://` source, sink or state directory. Mount them with
    /// volumeMounts. The name `tmp` is reserved for the operator's scratch emptyDir at /tmp. At
    /// most 64.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<Volume>,
    /// Where the worker container mounts volumes from `volumes` (each must name one of them).
    /// The root filesystem is read-only: a writable `file://` path needs a volume mounted here.
    /// /tmp is taken by the operator's scratch emptyDir. At most 64.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_mounts: Vec<VolumeMount>,
    /// Extra environment variables of the worker container, after the operator's own (so
    /// `$(POD_IP)` can be referenced); they take precedence over the keys of
    /// spec.state.credentialsSecret. For example `SSL_CERT_FILE` pointing at a CA bundle
    /// mounted from a volume: the S3, GCS and Azure clients then trust that file's
    /// certificates instead of the image's bundle (AWS_CA_BUNDLE is not read), or
    /// `KEYSHIFT_ENCODE_THREADS`. The names the operator sets itself (POD_IP, KEYSHIFT_TOKEN,
    /// KEYSHIFT_SUBTASK) are refused. At most 128.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
    /// Tolerations of every worker pod, to run them on tainted (e.g. dedicated) nodes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Node and pod (anti-)affinity of every worker pod. Worker pods carry the label
    /// `keyshift.dev/job: <job name>`, e.g. to spread a job's workers over nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// Topology spread constraints of every worker pod; select a job's workers with the label
    /// `keyshift.dev/job: <job name>` (for example, spread them over
    /// `topology.kubernetes.io/zone`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub topology_spread_constraints: Vec<TopologySpreadConstraint>,
    /// PriorityClass of every worker pod. Default: the cluster's default priority.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    /// Secrets (in the job's namespace) holding registry credentials to pull a private
    /// spec.image.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<LocalObjectReference>,
}

/// The observed state of a StreamJob.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StreamJobStatus {
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// A start the workers refused for good (their image cannot run the spec, or cannot read
    /// the state at the asked parallelism), kept so that no operator process (after a restart,
    /// or a new leader) tries it again until the spec changes. The Stalled condition says why
    /// and what to do.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_refused: Option<StartRefusedStatus>,
    /// Lifecycle phase: Pending, Running, Rescaling, Upgrading, Suspended or Failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    /// The parallelism the job is running at (the scale subresource's status replicas).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
    /// Label selector of the job's worker pods (the scale subresource's selector).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// The key-group count, pinned before the first snapshot. Fixed for the life of the job's
    /// state; replicas may not exceed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_parallelism: Option<i32>,
    /// Where status.maxParallelism came from, in words: spec.maxParallelism, Flink's default
    /// rule for the replicas the job first ran with, or the snapshot named by spec.restoreFrom.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_parallelism_origin: Option<String>,
    /// The spec.restoreFrom the job was last started from. A spec.restoreFrom that differs
    /// from it is a request to restart from that snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restored_from: Option<String>,
    /// The StreamJobSnapshot spec.restoreFrom named when the job was started from
    /// status.restoredFrom (its URL), so that the job does not wait for that resource again
    /// once it is gone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restored_from_snapshot: Option<String>,
    /// Set when the job was started from spec.restoreFrom: the largest id among the job's own
    /// snapshots at that moment. Those snapshots hold the history the restore replaced; the job
    /// never resumes from them (a crash before the restored run's first checkpoint restores
    /// spec.restoreFrom again, not the old state).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replaced_history_up_to: Option<i64>,
    /// How the state of the latest snapshot is spread over subtasks and key groups (updated
    /// after every checkpoint and savepoint), so a hot subtask, group or key is visible.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_distribution: Option<StateDistribution>,
    /// How key groups are spread over the running subtasks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_groups: Option<KeyGroupsStatus>,
    /// The latest completed checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_checkpoint: Option<SnapshotRef>,
    /// The latest completed savepoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_savepoint: Option<SnapshotRef>,
    /// The rescale or upgrade in progress (or the last one), step by step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rescale: Option<RescaleStatus>,
    /// The step of the rescale or upgrade in progress (Savepointing, Verifying, Stopping,
    /// Rewriting, VerifyingRewrite or Restoring; status.rescale has the whole transition); absent when none runs. The STEP
    /// column of `kubectl get streamjobs`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>")]
    pub step: Option<keyshift_core::step::Step>,
    /// What the job is doing, in one line of at most 80 characters: the Ready condition's
    /// message, shortened (the condition holds all of it). The MESSAGE column of `kubectl get
    /// streamjobs`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The restore of the run being started (a rescale's or upgrade's new run, a rollback, a
    /// recovery or resume), while it runs: how much of its snapshot the workers have read so
    /// far. Updated every few seconds; removed once the run started or its start failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore: Option<RestoreStatus>,
    /// The spec.savepointTriggerNonce the operator last acted on: when the spec's nonce differs
    /// (and the job runs), a savepoint is taken without stopping the job and recorded in
    /// lastSavepoint, then this is set to the spec's value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_savepoint_nonce: Option<i64>,
    /// The last managed change of the key-group count (spec.maxParallelism): where the job's
    /// state came from, whether the change can still be undone by setting spec.maxParallelism
    /// back, and what undoing it later would lose. Kept until the next such change; nothing
    /// it names is deleted automatically.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_group_change: Option<KeyGroupChangeStatus>,
    /// What the job's source reports from its brokers (a Kafka source): its consumer lag.
    /// Absent for other sources and while the job does not run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<SourceStatus>,
    /// Conditions in the kstatus convention: Ready, Reconciling, Stalled, plus KeyGroupsBalanced.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// The job's source as its brokers see it.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SourceStatus {
    /// The consumer lag of a Kafka source over every partition, from the running subtasks'
    /// last measurements (each measures its own partitions every 2 s; status shows them at
    /// every pass, at most 30 s apart while the job runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag: Option<SourceLagStatus>,
}

/// A Kafka source's consumer lag, summed over its partitions.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SourceLagStatus {
    /// Records behind: the sum over the partitions of the partition's high watermark (the
    /// offset the next record written gets, as the brokers report it) minus the source's
    /// position in it (the next offset it reads).
    pub records: i64,
    /// Seconds behind: the most of any partition. A partition read to its end is 0 behind;
    /// otherwise it is now minus the later of the record timestamp of the newest record read
    /// from it and the last time it was measured read to its end, which bounds from above how
    /// long its oldest unread record has waited. Absent while no partition's is known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seconds: Option<i64>,
    /// Partitions measured.
    pub partitions: i32,
    /// Partitions with records behind.
    pub partitions_behind: i32,
    /// The partition with the most records behind (`<topic>/<partition>`), when any is behind.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub furthest_behind: Option<String>,
    /// When the oldest of the measurements summed was taken (RFC 3339).
    pub measured: String,
    /// The lag in words.
    pub summary: String,
}

/// A managed change of the key-group count, once its new run is up.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KeyGroupChangeStatus {
    /// The key-group count before the change.
    pub from_max_parallelism: i32,
    /// The key-group count after it.
    pub to_max_parallelism: i32,
    /// The parallelism the job ran at before the change.
    pub from_replicas: i32,
    /// The savepoint taken before the change, under the old key-group count: never modified
    /// or deleted by keyshift.
    pub original_savepoint: String,
    /// The savepoint rewritten from it to the new key-group count (the new run restored it).
    pub rewritten_savepoint: String,
    /// When the new run started (RFC 3339).
    pub finished: String,
    /// The first checkpoint the new run committed (its id): from then on the job has state
    /// and output the original savepoint does not hold. Unset while the change is reversible.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub point_of_no_return: Option<i64>,
    /// When that checkpoint committed (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub point_of_no_return_time: Option<String>,
    /// What setting spec.maxParallelism back does now, in words.
    pub message: String,
}

/// A run's restore in progress, summed over its subtasks.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RestoreStatus {
    /// The snapshot being restored (unset: the run starts with empty state).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// When the start began (RFC 3339).
    pub started: String,
    /// Bytes of state read so far, over all subtasks.
    pub bytes_read: i64,
    /// Bytes of state the subtasks read in all.
    pub bytes_total: i64,
    /// Key groups read so far, over all subtasks.
    pub key_groups_read: i64,
    /// Key groups the subtasks read in all.
    pub key_groups_total: i64,
    /// Subtasks whose restore is done.
    pub subtasks_done: i32,
    /// Subtasks of the run being started.
    pub subtasks: i32,
    /// The progress in words, as the Reconciling condition shows it.
    pub summary: String,
}

/// Lifecycle phase of a StreamJob.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum Phase {
    /// Accepted, workers not yet running.
    Pending,
    /// Workers run at the requested parallelism.
    Running,
    /// Moving to a new parallelism (see status.rescale).
    Rescaling,
    /// Rolling out a new image or job (see status.rescale).
    Upgrading,
    /// Stopped with a savepoint (spec.suspend).
    Suspended,
    /// Cannot run until the spec or environment is fixed (see the Stalled condition).
    Failed,
}

/// Key-group spread over the running subtasks.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KeyGroupsStatus {
    /// The spread in words.
    pub summary: String,
    /// Inclusive key-group range of each subtask, in subtask order, e.g. `0-31`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranges: Vec<String>,
    /// Groups of the lightest subtask.
    pub min_groups: i32,
    /// Groups of the busiest subtask.
    pub max_groups: i32,
    /// Busiest subtask's groups divided by the lightest's, as a decimal string (e.g. `2.00`).
    pub skew: String,
}

/// How a snapshot's state is spread: the busiest subtask against the mean, and the largest key
/// group (a group with much state and few keys holds a hot key).
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StateDistribution {
    /// The snapshot these numbers come from.
    pub snapshot_id: i64,
    /// The parallelism it was taken at.
    pub parallelism: i32,
    /// Bytes of keyed state in the snapshot.
    pub total_bytes: i64,
    /// Keys in the snapshot.
    pub total_keys: i64,
    /// The subtask holding the most bytes.
    pub busiest_subtask: i32,
    /// Bytes held by the busiest subtask.
    pub busiest_subtask_bytes: i64,
    /// Keys held by the busiest subtask.
    pub busiest_subtask_keys: i64,
    /// Mean bytes per subtask.
    pub mean_subtask_bytes: i64,
    /// Mean keys per subtask.
    pub mean_subtask_keys: i64,
    /// The busiest subtask's bytes divided by the mean, as a decimal string (`1.00` is even).
    pub bytes_skew: String,
    /// The key group holding the most bytes.
    pub largest_key_group: i32,
    /// Bytes of the largest key group.
    pub largest_key_group_bytes: i64,
    /// Keys in the largest key group.
    pub largest_key_group_keys: i64,
    /// The spread in words.
    pub summary: String,
}

/// A completed snapshot.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotRef {
    /// Snapshot id (increasing per job).
    pub id: i64,
    /// URL of the snapshot directory (holds `_manifest.json`).
    pub path: String,
    /// When it completed (RFC 3339).
    pub time: String,
    /// The parallelism it was taken at.
    pub parallelism: i32,
    /// Total bytes of state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<i64>,
    /// Source partitions the snapshot holds positions for, when the source lists them at run
    /// time (the files of a file source, the topic-partitions of a Kafka source as the brokers
    /// reported them): the partition count behind AllSubtasksHavePartitions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_partitions: Option<i32>,
    /// The StreamJobSnapshot this savepoint was taken for, when one asked for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
}

/// Progress of a rescale or stateful upgrade.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RescaleStatus {
    /// Parallelism before.
    pub from: i32,
    /// Parallelism after.
    pub to: i32,
    /// Current step: Prestaging, Savepointing, Verifying, Stopping, Rewriting, VerifyingRewrite,
    /// Restoring, Done, Abandoned or RolledBack.
    #[schemars(with = "String")]
    pub step: keyshift_core::step::Step,
    /// When the rescale started (RFC 3339).
    pub started: String,
    /// Key groups that change owner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub groups_moved: Option<i32>,
    /// Bytes the new subtasks read from the savepoint: its size once it is taken (for a
    /// pre-staged rescale, only what its stop checkpoint wrote: the new subtasks loaded the
    /// rest while the job ran, see prestage.loadedBytes), then the bytes they actually read
    /// once they run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_to_read: Option<i64>,
    /// The savepoint the rescale takes (and restores from, unless restoreFrom is set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub savepoint: Option<String>,
    /// Set when this transition restarts the job from spec.restoreFrom: the snapshot the new
    /// workers restore (the savepoint above only keeps the state the job had).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_from: Option<String>,
    /// The key-group count after this transition, when it changes it (a restore from a
    /// rewritten savepoint).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_parallelism: Option<i32>,
    /// Set when this transition changes the key-group count itself (spec.maxParallelism
    /// changed): the count before. The savepoint is rewritten from it to maxParallelism.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_max_parallelism: Option<i32>,
    /// The rewritten savepoint (under maxParallelism key groups) that the new run restores;
    /// recorded before the Rewriting step writes it. The savepoint above is only read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rewritten: Option<String>,
    /// Keys the rewrite moved into the new key groups (equal to the savepoint's key count).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rewritten_keys: Option<i64>,
    /// State bytes the rewrite read from the savepoint and wrote to the rewritten one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rewritten_bytes: Option<i64>,
    /// Seconds spent in each completed step.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub step_seconds: BTreeMap<String, f64>,
    /// Set when restoring at `to` failed: why. The rescale then restores the old parallelism
    /// (`from`) from the same savepoint and ends in step RolledBack.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rolled_back: Option<String>,
    /// Set when this is an upgrade (a change of spec.job or spec.image at the same
    /// parallelism), rolled out in this spec.upgradeMode: `savepoint` goes through every step,
    /// `last-state` and `stateless` start at Stopping (no savepoint) and restore the latest
    /// checkpoint or nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upgrade_mode: Option<UpgradeMode>,
    /// Set when this rescale pre-stages its new workers (spec.rescaleStrategy `Prestage`): the
    /// new run and what it loaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prestage: Option<PrestageStatus>,
    /// Set when a pre-staged rescale fell back to stop-and-restore: why. The pre-staged workers
    /// were removed; the rescale goes on by the savepoint's steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<String>,
}

/// A start refused for good (status.startRefused).
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StartRefusedStatus {
    /// A hash of the spec it was refused for: any edit of the spec ends the refusal.
    pub spec_hash: String,
    /// The reason of the Stalled condition it sets (e.g. StartRefused).
    pub reason: String,
    /// The workers' message: what they refused, and the fix.
    pub message: String,
    /// The parallelism of the refused change of a running job (the job runs on at its own);
    /// unset when any start is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallelism: Option<i32>,
}

/// The new workers of a pre-staged rescale (status.rescale.prestage).
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PrestageStatus {
    /// The run id of the new workers (their pods carry it).
    pub run: String,
    /// When their pods were first asked for (RFC 3339): spec.state.prestageTimeout counts from
    /// here.
    pub since: String,
    /// The checkpoint the new workers loaded last (the stop checkpoint builds on it), once they
    /// have.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<String>,
    /// Bytes the new workers read while the job kept running (the first load and every
    /// catch-up).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loaded_bytes: Option<i64>,
    /// Catch-up rounds after the first load: each an incremental checkpoint of the running job
    /// whose delta the new workers read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub catch_up_rounds: Option<i32>,
    /// Bytes the stop checkpoint wrote itself (the delta since `base`), once taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta_bytes: Option<i64>,
}

impl RescaleStatus {
    /// The pre-stage of this rescale while it is in use (not fallen back).
    pub fn prestaged(&self) -> Option<&PrestageStatus> {
        self.prestage.as_ref().filter(|_| self.fallback.is_none())
    }

    /// The run id of this rescale's pre-staged workers, fallen back or not (their pods are
    /// never taken for the old run's).
    pub fn prestage_run(&self) -> Option<&str> {
        self.prestage.as_ref().map(|p| p.run.as_str())
    }

    /// Whether this transition changes the key-group count by rewriting its savepoint.
    pub fn rewrites(&self) -> bool {
        self.from_max_parallelism.is_some()
    }
}

/// The status.observedGeneration a StreamJob has before the operator first wrote its status:
/// the CRD's default for `status`, which the API server fills in whenever it returns an object
/// without one. Generations start at 1, so kstatus (Flux) and `kubectl wait` judge a job just
/// applied as not yet observed (InProgress) rather than as a resource without conditions
/// (Current) until the operator reports on it (docs/gitops.md).
pub const UNOBSERVED_GENERATION: i64 = 0;
