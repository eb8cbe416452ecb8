//! StreamJob validation, in two places with one set of messages:
//!
//! * CEL rules (`x-kubernetes-validations`) attached to the CRD, so the API server refuses a bad
//!   `kubectl apply` or `kubectl scale` before anything stops;
//! * [`validate`], the same rules in pure Rust for places without an API server (`keyshift local`,
//!   tests) and as a second line of defence in the operator.
//!
//! [`analyse`] goes further than the API server can (the derived default key-group count, skew,
//! idle subtasks) and reports what the operator turns into conditions.

use crate::crd::{
    KeyGroupPolicy, PodTemplateOverrides, StreamJob, StreamJobSpec, StreamJobStatus,
    UNOBSERVED_GENERATION,
};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    JSONSchemaProps, JSONSchemaPropsOrArray, ValidationRule,
};
use keyshift_core::duration::parse_duration;
use keyshift_core::keygroup::{self, Assignment, BoundsError, Skew};
use keyshift_core::spec::{
    KAFKA_SECRET_PROPERTIES, KAFKA_SINK_RESERVED, KAFKA_SOURCE_RESERVED, MAX_DELTA_PERCENT_BOUNDS,
    MAX_DELTAS_BOUNDS,
};
use keyshift_core::worker_pod::{RESERVED_ENV, SCRATCH_PATH, SCRATCH_VOLUME};
use kube::CustomResourceExt;

pub use keyshift_core::rules::*;

mod analysis;
mod cel;
mod guidance;
mod isolation;
mod policy;
#[cfg(test)]
mod tests;

pub use self::analysis::*;
use self::cel::*;
pub use self::guidance::*;
pub use self::isolation::*;
pub use self::policy::*;

/// Object store URL schemes `object_store` understands.
pub const STORAGE_SCHEMES: &[&str] = &[
    "file", "memory", "s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "adl", "http", "https",
];

/// String fields that CEL rules read get a length bound, so the API server's cost estimate of a
/// regex match stays within budget.
const BOUNDED_STRINGS: &[(&[&str], i64)] = &[
    (&["spec", "state", "storage"], 2048),
    (&["spec", "restoreFrom"], 2048),
    (&["spec", "snapshotRetention", "maxAge"], 64),
    (&["spec", "state", "checkpointInterval"], 64),
    (&["spec", "state", "checkpointTimeout"], 64),
    (&["spec", "state", "savepointTimeout"], 64),
    (&["spec", "state", "restoreTimeout"], 64),
    (&["spec", "state", "prestageTimeout"], 64),
    (&["spec", "job", "window", "size"], 64),
    (&["spec", "job", "window", "maxOutOfOrderness"], 64),
    (&["spec", "job", "program", "name"], 63),
    (&["spec", "job", "program", "maxOutOfOrderness"], 64),
    (
        &["spec", "job", "source", "kafka", "bootstrapServers"],
        4096,
    ),
    (&["spec", "job", "source", "kafka", "topics", "[]"], 249),
    (&["spec", "job", "source", "kafka", "idleTimeout"], 64),
    (
        &["spec", "job", "source", "kafka", "metadataRefreshInterval"],
        64,
    ),
    (
        &[
            "spec",
            "job",
            "source",
            "kafka",
            "credentials",
            "secretName",
        ],
        253,
    ),
    (&["spec", "job", "sink", "kafka", "bootstrapServers"], 4096),
    (&["spec", "job", "sink", "kafka", "topic"], 249),
    (
        &["spec", "job", "sink", "kafka", "credentials", "secretName"],
        253,
    ),
    // Read by the pinned-ceiling rule's message expression.
    (&["status", "maxParallelismOrigin"], 512),
    (&["status", "lastSavepoint", "path"], 2048),
    (&["status", "restoredFrom"], 2048),
    // Read by the spec.podTemplate rules (names as Kubernetes bounds them: a volume name is a
    // DNS label; a mount names a volume).
    (&["spec", "podTemplate", "volumes", "[]", "name"], 63),
    (&["spec", "podTemplate", "volumeMounts", "[]", "name"], 63),
    (
        &["spec", "podTemplate", "volumeMounts", "[]", "mountPath"],
        4096,
    ),
    (&["spec", "podTemplate", "env", "[]", "name"], 256),
];

/// Lists that CEL rules iterate get an item bound, for the same reason.
const BOUNDED_LISTS: &[(&[&str], i64)] = &[
    (&["spec", "podTemplate", "volumes"], 64),
    (&["spec", "podTemplate", "volumeMounts"], 64),
    (&["spec", "podTemplate", "env"], 128),
    (
        &["spec", "job", "source", "kafka", "topics"],
        MAX_KAFKA_TOPICS as i64,
    ),
];

/// Maps that CEL rules iterate get a property bound, for the same reason.
const BOUNDED_MAPS: &[(&[&str], i64)] = &[
    (&["spec", "job", "source", "kafka", "properties"], 256),
    (&["spec", "job", "sink", "kafka", "properties"], 256),
];

fn bound(path: &[&str], table: &[(&[&str], i64)]) -> usize {
    table
        .iter()
        .find(|(p, _)| *p == path)
        .map_or(usize::MAX, |(_, max)| *max as usize)
}

/// The API server's schema messages for the bounds on spec.podTemplate (item counts and the
/// lengths of the strings the CEL rules read).
fn pod_template_bounds(t: &PodTemplateOverrides, fail: &mut impl FnMut(&str)) {
    let too_many = |field: &str, n: usize, fail: &mut dyn FnMut(&str)| {
        let max = bound(&["spec", "podTemplate", field], BOUNDED_LISTS);
        if n > max {
            fail(&format!(
                "spec.podTemplate.{field}: Too many: {n}: must have at most {max} items"
            ));
        }
    };
    too_many("volumes", t.volumes.len(), fail);
    too_many("volumeMounts", t.volume_mounts.len(), fail);
    too_many("env", t.env.len(), fail);
    let too_long = |field: &str, i: usize, prop: &str, value: &str, fail: &mut dyn FnMut(&str)| {
        let max = bound(&["spec", "podTemplate", field, "[]", prop], BOUNDED_STRINGS);
        if value.len() > max {
            fail(&format!(
                "spec.podTemplate.{field}[{i}].{prop}: Too long: may not be more than {max} bytes"
            ));
        }
    };
    for (i, v) in t.volumes.iter().enumerate() {
        too_long("volumes", i, "name", &v.name, fail);
    }
    for (i, m) in t.volume_mounts.iter().enumerate() {
        too_long("volumeMounts", i, "name", &m.name, fail);
        too_long("volumeMounts", i, "mountPath", &m.mount_path, fail);
    }
    for (i, e) in t.env.iter().enumerate() {
        too_long("env", i, "name", &e.name, fail);
    }
}

/// The spec.podTemplate rules (the CEL rules above, in Rust).
fn pod_template_rules(t: &PodTemplateOverrides, fail: &mut impl FnMut(&str)) {
    if t.volumes.iter().any(|v| v.name == SCRATCH_VOLUME) {
        fail(MSG_TMP_VOLUME);
    }
    // The CEL rule's `^/tmp/*$`: /tmp with any number of trailing slashes.
    if t.volume_mounts.iter().any(|m| {
        m.mount_path
            .strip_prefix(SCRATCH_PATH)
            .is_some_and(|rest| rest.bytes().all(|b| b == b'/'))
    }) {
        fail(MSG_TMP_MOUNT);
    }
    if t.volume_mounts
        .iter()
        .any(|m| !t.volumes.iter().any(|v| v.name == m.name))
    {
        fail(MSG_MOUNT_VOLUME);
    }
    if t.env
        .iter()
        .any(|e| RESERVED_ENV.contains(&e.name.as_str()))
    {
        fail(MSG_RESERVED_ENV);
    }
}

/// A Kubernetes object name (a DNS subdomain: lowercase alphanumerics, `-` and `.`, at most
/// 253 characters), as [`OBJECT_NAME_RE`] matches it.
pub fn is_object_name(s: &str) -> bool {
    let label = |l: &str| {
        !l.is_empty()
            && l.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    s.len() <= 253 && s.split('.').all(label)
}

/// How spec.restoreFrom names its snapshot: a URL, or a StreamJobSnapshot by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestoreSource<'a> {
    /// The snapshot directory's URL.
    Url(&'a str),
    /// A StreamJobSnapshot in the job's namespace.
    Snapshot(&'a str),
}

/// What spec.restoreFrom's `value` names: a StreamJobSnapshot when it has no `://`.
pub fn restore_source(value: &str) -> RestoreSource<'_> {
    if value.contains("://") {
        RestoreSource::Url(value)
    } else {
        RestoreSource::Snapshot(value)
    }
}

fn valid_url(url: &str) -> bool {
    url.split_once("://")
        .is_some_and(|(scheme, rest)| STORAGE_SCHEMES.contains(&scheme) && !rest.is_empty())
        && url.len() <= 2048
}

/// The CEL rules in pure Rust, with the same messages; `status` is the object's current status.
/// No rule compares a spec with the previous one: a change of `spec.maxParallelism` is carried
/// out as a managed rewrite of the job's state (README: "Raising the key-group ceiling").
pub fn validate(
    spec: &StreamJobSpec,
    status: Option<&StreamJobStatus>,
) -> Result<(), ValidationErrors> {
    let mut errors = Vec::new();
    // The API server reports a message once per failing rule; the Rust mirror reports each
    // message once.
    let mut fail = |m: &str| {
        if !errors.iter().any(|e: &String| e == m) {
            errors.push(m.to_owned());
        }
    };

    if spec.replicas < 1 {
        fail(MSG_REPLICAS_MIN);
    }
    if let Some(g) = spec.max_parallelism {
        if !(1..=32768).contains(&g) {
            fail(MSG_MAXP_RANGE);
        }
        if spec.replicas > g {
            fail(MSG_REPLICAS_LE_MAXP);
        }
        if spec.key_group_policy == KeyGroupPolicy::Strict
            && spec.replicas >= 1
            && g % spec.replicas != 0
        {
            fail(MSG_STRICT_DIVISOR);
        }
    }
    if let Some(pinned) = status.and_then(|s| s.max_parallelism) {
        // A spec.maxParallelism other than the pinned one is the job's next ceiling (the rules
        // above check replicas against it).
        let changing = spec.max_parallelism.is_some_and(|g| g != pinned);
        if spec.replicas > pinned && !changing {
            fail(MSG_REPLICAS_LE_PINNED);
        }
        if spec.key_group_policy == KeyGroupPolicy::Strict
            && spec.replicas >= 1
            && spec.max_parallelism.is_none()
            && pinned % spec.replicas != 0
        {
            fail(MSG_STRICT_DIVISOR);
        }
    }
    if let Some(storage) = &spec.state.storage
        && !valid_url(storage)
    {
        fail(MSG_STORAGE_URL);
    }
    if let Some(restore) = &spec.restore_from
        && !valid_url(restore)
        && !is_object_name(restore)
    {
        fail(MSG_RESTORE_URL);
    }
    if let Some(retention) = &spec.snapshot_retention {
        if retention.keep.is_some_and(|k| k < 1) {
            fail(MSG_RETENTION_KEEP);
        }
        if retention
            .max_age
            .as_ref()
            .is_some_and(|a| a.len() > 64 || parse_duration(a).is_none())
        {
            fail(MSG_RETENTION_MAX_AGE);
        }
    }
    if spec.state.checkpoint_interval.len() > 64
        || parse_duration(&spec.state.checkpoint_interval).is_none()
    {
        fail(MSG_CHECKPOINT_INTERVAL);
    }
    for (value, message, bounds) in [
        (
            &spec.state.checkpoint_timeout,
            MSG_CHECKPOINT_TIMEOUT,
            TIMEOUT_BOUNDS,
        ),
        (
            &spec.state.savepoint_timeout,
            MSG_SAVEPOINT_TIMEOUT,
            TIMEOUT_BOUNDS,
        ),
        (
            &spec.state.restore_timeout,
            MSG_RESTORE_TIMEOUT,
            RESTORE_TIMEOUT_BOUNDS,
        ),
        (
            &spec.state.prestage_timeout,
            MSG_PRESTAGE_TIMEOUT,
            TIMEOUT_BOUNDS,
        ),
    ] {
        if let Some(text) = value
            && (text.len() > 64 || !parse_duration(text).is_some_and(|d| bounds.contains(&d)))
        {
            fail(message);
        }
    }
    if spec.state.retained_checkpoints < 1 {
        fail(MSG_RETAINED);
    }
    if let Some(inc) = &spec.state.incremental_checkpoints {
        if inc
            .max_deltas
            .is_some_and(|n| !MAX_DELTAS_BOUNDS.contains(&n))
        {
            fail(MSG_INCREMENTAL_MAX_DELTAS);
        }
        if inc
            .max_delta_percent
            .is_some_and(|n| !MAX_DELTA_PERCENT_BOUNDS.contains(&n))
        {
            fail(MSG_INCREMENTAL_DELTA_PERCENT);
        }
    }

    job_rules(&spec.job, &mut fail);
    if let Some(template) = &spec.pod_template {
        pod_template_bounds(template, &mut fail);
        pod_template_rules(template, &mut fail);
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(ValidationErrors(errors))
    }
}

/// The StreamJob CRD, with the CEL validation rules attached and `status` defaulted to
/// `{observedGeneration: UNOBSERVED_GENERATION}`.
pub fn crd() -> CustomResourceDefinition {
    let mut crd = StreamJob::crd();
    for version in &mut crd.spec.versions {
        if let Some(schema) = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
        {
            attach_cel_rules(schema);
            default_status(schema);
        }
    }
    crd
}

/// The CRD as YAML, as `keyshift crd` prints it and `crds/` holds it.
pub fn crd_yaml() -> Result<String, serde_yaml::Error> {
    serde_yaml::to_string(&crd())
}

/// The StreamJobSnapshot CRD, with its CEL rules attached and `status` defaulted as the
/// StreamJob's is (so kstatus reads a new snapshot as in progress, not current).
pub fn snapshot_crd() -> CustomResourceDefinition {
    let mut crd = crate::crd::StreamJobSnapshot::crd();
    for version in &mut crd.spec.versions {
        if let Some(schema) = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
        {
            attach_snapshot_rules(schema);
            default_status(schema);
        }
    }
    crd
}

/// Defaults `status` to `{observedGeneration: UNOBSERVED_GENERATION}`: until the operator
/// writes one, kstatus (Flux) and the Argo CD check read the object as in progress.
fn default_status(schema: &mut JSONSchemaProps) {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSON;
    if let Some(status) = schema.properties.as_mut().and_then(|p| p.get_mut("status")) {
        status.default = Some(JSON(
            serde_json::json!({ "observedGeneration": UNOBSERVED_GENERATION }),
        ));
    }
}

/// The StreamJobSnapshot CRD as YAML (`crds/streamjobsnapshot.yaml`).
pub fn snapshot_crd_yaml() -> Result<String, serde_yaml::Error> {
    serde_yaml::to_string(&snapshot_crd())
}
