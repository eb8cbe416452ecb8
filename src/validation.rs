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

/// The ServiceAccount a worker pod runs as when spec.podTemplate.serviceAccountName is unset:
/// always allowed by a [`PodPolicy`].
pub const DEFAULT_SERVICE_ACCOUNT: &str = "default";

/// What the operator lets a StreamJob ask for beyond the spec's own rules: which images
/// (spec.image) and ServiceAccounts (spec.podTemplate.serviceAccountName) its workers may run
/// with. An empty list allows any. The operator's own worker image (used when spec.image is
/// unset) and the namespace's `default` ServiceAccount are always allowed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodPolicy {
    /// spec.image must start with one of these (write them up to a `/`, `:` or `@`, e.g.
    /// `registry.example.com/streaming/`, or a prefix also admits look-alike registries).
    pub allowed_image_prefixes: Vec<String>,
    /// spec.podTemplate.serviceAccountName must be one of these.
    pub allowed_service_accounts: Vec<String>,
}

/// A job the operator's [`PodPolicy`] refuses: names the field, what is allowed, and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error(
        "spec.image `{image}` is not allowed here: this operator runs only images starting with {allowed}; use such an image, remove spec.image to run the operator's worker image, or ask the cluster admin to extend policy.allowedImagePrefixes"
    )]
    ImageNotAllowed { image: String, allowed: String },
    #[error(
        "spec.podTemplate.serviceAccountName `{account}` is not allowed here: this operator runs workers only as {allowed} (or the namespace's default); name one of them, remove the field to use the default ServiceAccount, or ask the cluster admin to extend policy.allowedServiceAccounts"
    )]
    ServiceAccountNotAllowed { account: String, allowed: String },
}

impl PolicyError {
    /// The reason of the Stalled condition.
    pub fn reason(&self) -> keyshift_core::reason::Reason {
        use keyshift_core::reason::Reason;
        match self {
            PolicyError::ImageNotAllowed { .. } => Reason::ImageNotAllowed,
            PolicyError::ServiceAccountNotAllowed { .. } => Reason::ServiceAccountNotAllowed,
        }
    }
}

fn quoted_list(items: &[String]) -> String {
    items
        .iter()
        .map(|i| format!("`{i}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether `policy` lets `spec` run; `worker_image` is the operator's own worker image (the one
/// used when spec.image is unset), always allowed.
pub fn check_pod_policy(
    spec: &StreamJobSpec,
    policy: &PodPolicy,
    worker_image: &str,
) -> Result<(), PolicyError> {
    if let Some(image) = &spec.image
        && !policy.allowed_image_prefixes.is_empty()
        && image != worker_image
        && !policy
            .allowed_image_prefixes
            .iter()
            .any(|p| !p.is_empty() && image.starts_with(p.as_str()))
    {
        return Err(PolicyError::ImageNotAllowed {
            image: image.clone(),
            allowed: quoted_list(&policy.allowed_image_prefixes),
        });
    }
    if let Some(account) = spec
        .pod_template
        .as_ref()
        .and_then(|t| t.service_account_name.as_ref())
        && !policy.allowed_service_accounts.is_empty()
        && account != DEFAULT_SERVICE_ACCOUNT
        && !policy.allowed_service_accounts.contains(account)
    {
        return Err(PolicyError::ServiceAccountNotAllowed {
            account: account.clone(),
            allowed: quoted_list(&policy.allowed_service_accounts),
        });
    }
    Ok(())
}

/// Object store URL schemes `object_store` understands.
pub const STORAGE_SCHEMES: &[&str] = &[
    "file", "memory", "s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "adl", "http", "https",
];

const DURATION_RE: &str = "^([0-9]+(ms|s|m|h))+$";

fn url_rule() -> String {
    format!("^({})://.+$", STORAGE_SCHEMES.join("|"))
}

/// One CEL rule: where in the schema it sits, the expression, and the message.
struct CelRule {
    /// Property path from the root schema; empty is the root; `[]` steps into an array's items.
    path: &'static [&'static str],
    rule: String,
    message: &'static str,
    /// A field the failure is reported against (relative to `path`).
    field_path: Option<&'static str>,
    /// A CEL expression for a message built from the object (the API server falls back to
    /// `message` if it cannot evaluate it).
    message_expression: Option<String>,
}

fn rules() -> Vec<CelRule> {
    let r = |path, rule: &str, message, field_path| CelRule {
        path,
        rule: rule.to_owned(),
        message,
        field_path,
        message_expression: None,
    };
    vec![
        r(&["spec", "replicas"], "self >= 1", MSG_REPLICAS_MIN, None),
        r(
            &["spec", "maxParallelism"],
            "self >= 1 && self <= 32768",
            MSG_MAXP_RANGE,
            None,
        ),
        r(
            &["spec"],
            "!has(self.maxParallelism) || self.replicas <= self.maxParallelism",
            MSG_REPLICAS_LE_MAXP,
            Some(".replicas"),
        ),
        r(
            &["spec"],
            "!has(self.keyGroupPolicy) || self.keyGroupPolicy != 'Strict' || !has(self.maxParallelism) || self.replicas < 1 || self.maxParallelism % self.replicas == 0",
            MSG_STRICT_DIVISOR,
            Some(".replicas"),
        ),
        CelRule {
            message_expression: Some(render_cel(&ceiling_guidance_parts())),
            ..r(
                &[],
                "!has(self.status) || !has(self.status.maxParallelism) || self.spec.replicas <= self.status.maxParallelism || (has(self.spec.maxParallelism) && self.spec.maxParallelism != self.status.maxParallelism)",
                MSG_REPLICAS_LE_PINNED,
                Some(".spec.replicas"),
            )
        },
        r(
            &[],
            "!has(self.status) || !has(self.status.maxParallelism) || !has(self.spec.keyGroupPolicy) || self.spec.keyGroupPolicy != 'Strict' || self.spec.replicas < 1 || has(self.spec.maxParallelism) || self.status.maxParallelism % self.spec.replicas == 0",
            MSG_STRICT_DIVISOR,
            Some(".spec.replicas"),
        ),
        r(
            &["spec", "state", "storage"],
            &format!("self.matches('{}')", url_rule()),
            MSG_STORAGE_URL,
            None,
        ),
        r(
            &["spec", "restoreFrom"],
            &format!("self.matches('{}')", url_rule()),
            MSG_RESTORE_URL,
            None,
        ),
        r(
            &["spec", "state", "checkpointInterval"],
            &format!("self.matches('{DURATION_RE}')"),
            MSG_CHECKPOINT_INTERVAL,
            None,
        ),
        r(
            &["spec", "state", "checkpointTimeout"],
            &format!(
                "self.matches('{DURATION_RE}') && duration(self) >= duration('1s') && duration(self) <= duration('24h')"
            ),
            MSG_CHECKPOINT_TIMEOUT,
            None,
        ),
        r(
            &["spec", "state", "savepointTimeout"],
            &format!(
                "self.matches('{DURATION_RE}') && duration(self) >= duration('1s') && duration(self) <= duration('24h')"
            ),
            MSG_SAVEPOINT_TIMEOUT,
            None,
        ),
        r(
            &["spec", "state", "prestageTimeout"],
            &format!(
                "self.matches('{DURATION_RE}') && duration(self) >= duration('1s') && duration(self) <= duration('24h')"
            ),
            MSG_PRESTAGE_TIMEOUT,
            None,
        ),
        r(
            &["spec", "state", "retainedCheckpoints"],
            "self >= 1",
            MSG_RETAINED,
            None,
        ),
        r(
            &["spec", "state", "incrementalCheckpoints", "maxDeltas"],
            &format!(
                "self >= {} && self <= {}",
                MAX_DELTAS_BOUNDS.start(),
                MAX_DELTAS_BOUNDS.end()
            ),
            MSG_INCREMENTAL_MAX_DELTAS,
            None,
        ),
        r(
            &["spec", "state", "incrementalCheckpoints", "maxDeltaPercent"],
            &format!(
                "self >= {} && self <= {}",
                MAX_DELTA_PERCENT_BOUNDS.start(),
                MAX_DELTA_PERCENT_BOUNDS.end()
            ),
            MSG_INCREMENTAL_DELTA_PERCENT,
            None,
        ),
        r(
            &["spec", "state", "restoreTimeout"],
            &format!(
                "self.matches('{DURATION_RE}') && duration(self) >= duration('30s') && duration(self) <= duration('24h')"
            ),
            MSG_RESTORE_TIMEOUT,
            None,
        ),
        r(
            &["spec", "job", "window", "size"],
            &format!("self.matches('{DURATION_RE}')"),
            MSG_WINDOW_SIZE,
            None,
        ),
        r(
            &["spec", "job", "window", "maxOutOfOrderness"],
            &format!("self.matches('{DURATION_RE}')"),
            MSG_OUT_OF_ORDERNESS,
            None,
        ),
        r(
            &["spec", "job", "source"],
            "(has(self.generator) ? 1 : 0) + (has(self.file) ? 1 : 0) + (has(self.kafka) ? 1 : 0) == 1",
            MSG_SOURCE_ONE_OF,
            None,
        ),
        r(
            &["spec", "job", "source", "kafka", "bootstrapServers"],
            &format!("self.matches('{KAFKA_BOOTSTRAP_RE}')"),
            MSG_KAFKA_SOURCE_BOOTSTRAP,
            None,
        ),
        r(
            &["spec", "job", "source", "kafka", "topics"],
            &format!("size(self) >= 1 && self.all(t, t.matches('{KAFKA_TOPIC_RE}'))"),
            MSG_KAFKA_SOURCE_TOPICS,
            None,
        ),
        r(
            &["spec", "job", "source", "kafka"],
            "!has(self.startingPosition) || self.startingPosition != 'timestamp' || (has(self.startingTimestamp) && self.startingTimestamp >= 0)",
            MSG_KAFKA_STARTING_TIMESTAMP,
            Some(".startingTimestamp"),
        ),
        r(
            &["spec", "job", "source", "kafka", "idleTimeout"],
            &format!("self.matches('{DURATION_RE}')"),
            MSG_KAFKA_IDLE_TIMEOUT,
            None,
        ),
        r(
            &["spec", "job", "source", "kafka", "metadataRefreshInterval"],
            &format!("self.matches('{DURATION_RE}') && duration(self) >= duration('1s')"),
            MSG_KAFKA_REFRESH,
            None,
        ),
        r(
            &["spec", "job", "source", "kafka", "properties"],
            &format!(
                "self.all(k, !(k in [{}]))",
                cel_list(&[KAFKA_SOURCE_RESERVED, KAFKA_SECRET_PROPERTIES])
            ),
            MSG_KAFKA_SOURCE_PROPERTIES,
            None,
        ),
        r(
            &["spec", "job", "source", "kafka", "credentials"],
            KAFKA_CREDENTIALS_RULE,
            MSG_KAFKA_SOURCE_CREDENTIALS,
            None,
        ),
        r(
            &["spec", "job", "sink"],
            "(has(self.type) && self.type == 'kafka') == has(self.kafka)",
            MSG_KAFKA_SINK_REQUIRED,
            Some(".kafka"),
        ),
        r(
            &["spec", "job", "sink", "kafka", "bootstrapServers"],
            &format!("self.matches('{KAFKA_BOOTSTRAP_RE}')"),
            MSG_KAFKA_SINK_BOOTSTRAP,
            None,
        ),
        r(
            &["spec", "job", "sink", "kafka", "topic"],
            &format!("self.matches('{KAFKA_TOPIC_RE}')"),
            MSG_KAFKA_SINK_TOPIC,
            None,
        ),
        r(
            &["spec", "job", "sink", "kafka", "properties"],
            &format!(
                "self.all(k, !(k in [{}]))",
                cel_list(&[KAFKA_SINK_RESERVED, KAFKA_SECRET_PROPERTIES])
            ),
            MSG_KAFKA_SINK_PROPERTIES,
            None,
        ),
        r(
            &["spec", "job", "sink", "kafka", "credentials"],
            KAFKA_CREDENTIALS_RULE,
            MSG_KAFKA_SINK_CREDENTIALS,
            None,
        ),
        r(
            &["spec", "job", "source", "generator", "partitions"],
            "self >= 1 && self <= 65536",
            MSG_PARTITIONS,
            None,
        ),
        r(
            &["spec", "job", "source", "generator", "keys"],
            "self >= 1 && self <= 1000000000000",
            MSG_KEYS,
            None,
        ),
        r(
            &["spec", "job", "key", "field"],
            "size(self) > 0",
            MSG_KEY_FIELD,
            None,
        ),
        r(
            &["spec", "job", "aggregation"],
            "self.function == 'count' || has(self.field)",
            MSG_AGG_FIELD,
            Some(".field"),
        ),
        r(
            &["spec", "job", "sink"],
            "!has(self.type) || self.type != 'objectStore' || has(self.url)",
            MSG_SINK_URL,
            Some(".url"),
        ),
        r(
            &["spec", "podTemplate", "volumes"],
            &format!("self.all(v, v.name != '{SCRATCH_VOLUME}')"),
            MSG_TMP_VOLUME,
            None,
        ),
        r(
            &["spec", "podTemplate", "volumeMounts"],
            &format!("self.all(m, !m.mountPath.matches('^{SCRATCH_PATH}/*$'))"),
            MSG_TMP_MOUNT,
            None,
        ),
        r(
            &["spec", "podTemplate"],
            "!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes) && self.volumes.exists(v, v.name == m.name))",
            MSG_MOUNT_VOLUME,
            Some(".volumeMounts"),
        ),
        r(
            &["spec", "podTemplate", "env"],
            &format!(
                "self.all(e, !(e.name in [{}]))",
                RESERVED_ENV
                    .iter()
                    .map(|n| format!("'{n}'"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            MSG_RESERVED_ENV,
            None,
        ),
    ]
}

/// A CEL list literal of the names.
fn cel_list(lists: &[&[&str]]) -> String {
    lists
        .iter()
        .flat_map(|l| l.iter())
        .map(|n| format!("'{n}'"))
        .collect::<Vec<_>>()
        .join(", ")
}

const KAFKA_CREDENTIALS_RULE: &str = "size(self.secretName) > 0 && (has(self.sasl) || has(self.tls)) && (!has(self.tls) || has(self.tls.certKey) == has(self.tls.keyKey))";

/// String fields that CEL rules read get a length bound, so the API server's cost estimate of a
/// regex match stays within budget.
const BOUNDED_STRINGS: &[(&[&str], i64)] = &[
    (&["spec", "state", "storage"], 2048),
    (&["spec", "restoreFrom"], 2048),
    (&["spec", "state", "checkpointInterval"], 64),
    (&["spec", "state", "checkpointTimeout"], 64),
    (&["spec", "state", "savepointTimeout"], 64),
    (&["spec", "state", "restoreTimeout"], 64),
    (&["spec", "state", "prestageTimeout"], 64),
    (&["spec", "job", "window", "size"], 64),
    (&["spec", "job", "window", "maxOutOfOrderness"], 64),
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

/// Where the key-group ceiling of a job's state came from, for status.maxParallelismOrigin.
pub fn ceiling_origin(source: CeilingSource, replicas: i32) -> String {
    match source {
        CeilingSource::Spec => "set by spec.maxParallelism".into(),
        CeilingSource::Default | CeilingSource::Pinned => format!(
            "Flink's default for the {replicas} replicas the job first ran with, as spec.maxParallelism was not set"
        ),
    }
}

/// The origin recorded when the ceiling comes from a snapshot named by spec.restoreFrom.
pub fn ceiling_origin_snapshot(url: &str) -> String {
    let url: String = url.chars().take(400).collect();
    format!("the key-group count of {url}, restored through spec.restoreFrom")
}

/// The origin recorded when a managed change of spec.maxParallelism restored `url` (its
/// rewritten savepoint, or the original one when the change was undone).
pub fn ceiling_origin_change(url: &str) -> String {
    let url: String = url.chars().take(400).collect();
    format!("the key-group count of {url}, restored by a managed change of spec.maxParallelism")
}

/// spec.restoreFrom names a snapshot of `groups` key groups while spec.maxParallelism is `spec_g`.
pub fn restore_from_mismatch(url: &str, groups: u32, spec_g: i32) -> String {
    format!(
        "spec.restoreFrom {url} has {groups} key groups (its maxParallelism) but spec.maxParallelism is {spec_g}: set spec.maxParallelism to {groups} (or remove it) to restore from it"
    )
}

/// What the guidance for a scale past the pinned key-group ceiling says about one job.
#[derive(Debug, Clone, Copy)]
pub struct CeilingContext<'a> {
    /// metadata.name of the StreamJob.
    pub name: &'a str,
    /// The refused spec.replicas.
    pub replicas: i32,
    /// status.maxParallelism.
    pub ceiling: i32,
    /// status.maxParallelismOrigin.
    pub origin: Option<&'a str>,
}

/// A piece of the ceiling guidance: rendered in Rust for the operator's Stalled condition and as
/// a CEL `messageExpression` for the API server, so both say the same words.
enum Part {
    Text(&'static str),
    Name,
    Replicas,
    Ceiling,
    Origin,
    Suggested,
}

const ORIGIN_UNKNOWN: &str = "fixed at the job's first snapshot";

fn ceiling_guidance_parts() -> Vec<Part> {
    use Part::*;
    vec![
        Text("spec.replicas "),
        Replicas,
        Text(" exceeds "),
        Ceiling,
        Text(", the key-group ceiling of this job's state (status.maxParallelism: "),
        Origin,
        Text(
            "); nothing was changed and the job keeps running as it was. To run more subtasks, raise the ceiling in the same change: `kubectl patch streamjob ",
        ),
        Name,
        Text(" --type merge -p '{\"spec\":{\"maxParallelism\":"),
        Suggested,
        Text(",\"replicas\":"),
        Replicas,
        Text(
            "}}'`. keyshift then stops the job with a savepoint, rewrites it to the new key-group count, verifies every key and restores it at the new parallelism; the original savepoint is kept, and setting maxParallelism back to ",
        ),
        Ceiling,
        Text(" before the new run's first checkpoint restores it"),
    ]
}

fn render(parts: &[Part], c: &CeilingContext<'_>, out: &mut String) {
    for part in parts {
        match part {
            Part::Text(t) => out.push_str(t),
            Part::Name => out.push_str(c.name),
            Part::Replicas => out.push_str(&c.replicas.to_string()),
            Part::Ceiling => out.push_str(&c.ceiling.to_string()),
            Part::Origin => out.push_str(c.origin.unwrap_or(ORIGIN_UNKNOWN)),
            Part::Suggested => out.push_str(
                &keygroup::suggested_max_parallelism(c.replicas.max(1) as u32).to_string(),
            ),
        }
    }
}

/// The guidance for `replicas` above the pinned key-group ceiling: what the ceiling is, where it
/// came from, that nothing was changed, and the one edit that raises it.
pub fn ceiling_guidance(c: &CeilingContext<'_>) -> String {
    let mut out = String::new();
    render(&ceiling_guidance_parts(), c, &mut out);
    out
}

/// The context of the guidance from a job's status.
pub fn ceiling_context<'a>(
    name: &'a str,
    spec: &StreamJobSpec,
    status: &'a StreamJobStatus,
    ceiling: i32,
) -> CeilingContext<'a> {
    CeilingContext {
        name,
        replicas: spec.replicas,
        ceiling,
        origin: status.max_parallelism_origin.as_deref(),
    }
}

fn cel_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for ch in text.chars() {
        match ch {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The suggested key-group count as CEL: the same numbers as `suggested_max_parallelism`.
fn cel_suggested() -> String {
    let mut expr = String::from("32768");
    let mut g = 16384u32;
    while g >= 128 {
        expr = format!("(4 * self.spec.replicas <= {g} ? {g} : {expr})");
        g /= 2;
    }
    expr
}

/// The parts as one CEL `format` call: a single format string and its arguments. (Concatenating
/// `string(int)` results makes the API server's cost estimate treat every piece as unbounded;
/// `format` is estimated from its arguments.)
fn render_cel(parts: &[Part]) -> String {
    let mut format = String::new();
    let mut args: Vec<String> = Vec::new();
    for part in parts {
        let (placeholder, arg) = match part {
            Part::Text(t) => {
                format.push_str(&t.replace('%', "%%"));
                continue;
            }
            Part::Name => ("%s", "self.metadata.name".to_owned()),
            Part::Replicas => ("%d", "self.spec.replicas".to_owned()),
            Part::Ceiling => ("%d", "self.status.maxParallelism".to_owned()),
            Part::Origin => (
                "%s",
                format!(
                    "(has(self.status.maxParallelismOrigin) ? self.status.maxParallelismOrigin : {})",
                    cel_string(ORIGIN_UNKNOWN)
                ),
            ),
            Part::Suggested => ("%d", cel_suggested()),
        };
        format.push_str(placeholder);
        args.push(arg);
    }
    format!("{}.format([{}])", cel_string(&format), args.join(", "))
}

fn schema_at<'a>(root: &'a mut JSONSchemaProps, path: &[&str]) -> Option<&'a mut JSONSchemaProps> {
    path.iter().try_fold(root, |node, name| {
        if *name == "[]" {
            match node.items.as_mut()? {
                JSONSchemaPropsOrArray::Schema(items) => Some(items.as_mut()),
                JSONSchemaPropsOrArray::Schemas(_) => None,
            }
        } else {
            node.properties.as_mut()?.get_mut(*name)
        }
    })
}

/// Attaches the CEL rules and string and list bounds to a StreamJob root schema. Panics in tests (not at
/// run time) if a path is missing: the rule table and the Rust types must agree.
pub(crate) fn attach_cel_rules(root: &mut JSONSchemaProps) {
    for rule in rules() {
        let node = schema_at(root, rule.path);
        debug_assert!(node.is_some(), "no schema at {:?}", rule.path);
        if let Some(node) = node {
            node.x_kubernetes_validations
                .get_or_insert_with(Vec::new)
                .push(ValidationRule {
                    rule: rule.rule,
                    message: Some(rule.message.to_owned()),
                    message_expression: rule.message_expression,
                    field_path: rule.field_path.map(str::to_owned),
                    ..Default::default()
                });
        }
    }
    let mut set = |table: &[(&[&str], i64)],
                   field: fn(&mut JSONSchemaProps) -> &mut Option<i64>| {
        for (path, max) in table {
            let node = schema_at(root, path);
            debug_assert!(node.is_some(), "no schema at {path:?}");
            if let Some(node) = node {
                *field(node) = Some(*max);
            }
        }
    };
    set(BOUNDED_STRINGS, |n| &mut n.max_length);
    set(BOUNDED_LISTS, |n| &mut n.max_items);
    set(BOUNDED_MAPS, |n| &mut n.max_properties);
}

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
    {
        fail(MSG_RESTORE_URL);
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

/// Where the key-group count of a job comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CeilingSource {
    /// Pinned in status at the job's first snapshot.
    Pinned,
    /// Set in spec.maxParallelism.
    Spec,
    /// Derived from spec.replicas by Flink's default rule (not yet pinned).
    Default,
}

/// What the operator (or `keyshift local`) concludes about a valid spec.
#[derive(Debug, Clone, PartialEq)]
pub struct Analysis {
    pub assignment: Assignment,
    pub ceiling_source: CeilingSource,
    pub skew: Skew,
    /// Subtasks that will read no source partition (they still own key groups).
    pub idle_subtasks: u32,
    /// The source's partition count, when known (see [`snapshot_partitions`]).
    pub source_partitions: Option<u32>,
}

/// Problems only visible with the derived key-group count; each becomes a Stalled condition.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AnalysisError {
    #[error(
        "spec.replicas {replicas} exceeds the key-group ceiling {ceiling} ({source_text}): lower replicas to at most {ceiling}, or raise the ceiling offline with `keyshift savepoint rewrite <savepoint> --max-parallelism <G> --to <url>` and restore from the rewritten savepoint"
    )]
    AboveCeiling {
        replicas: i32,
        ceiling: u32,
        source_text: &'static str,
    },
    #[error(
        "spec.replicas {replicas} does not divide the key-group count {ceiling} and spec.keyGroupPolicy is Strict: {summary}; choose one of those divisors or set keyGroupPolicy: Warn"
    )]
    StrictNonDivisor {
        replicas: i32,
        ceiling: u32,
        summary: String,
    },
    #[error("{0}")]
    Bounds(#[from] BoundsError),
}

/// The partition count recorded with the newest of the job's latest checkpoint and savepoint,
/// if it recorded one ([`crate::crd::SnapshotRef::source_partitions`]).
pub fn snapshot_partitions(status: &StreamJobStatus) -> Option<u32> {
    [&status.last_checkpoint, &status.last_savepoint]
        .into_iter()
        .flatten()
        .max_by_key(|s| s.id)
        .and_then(|s| s.source_partitions)
        .and_then(|n| u32::try_from(n).ok())
}

/// Resolves the key-group count and checks what CEL cannot: the derived default ceiling, Strict
/// against it, skew and idle subtasks.
pub fn analyse(
    spec: &StreamJobSpec,
    status: Option<&StreamJobStatus>,
) -> Result<Analysis, AnalysisError> {
    let pinned = status.and_then(|s| s.max_parallelism);
    let (ceiling, ceiling_source) = match (pinned, spec.max_parallelism) {
        // A count other than the pinned one is where the job goes (a managed change of the
        // key-group count, or a restore of a rewritten savepoint).
        (Some(p), Some(g)) if g != p => (i64::from(g), CeilingSource::Spec),
        (Some(p), _) => (i64::from(p), CeilingSource::Pinned),
        (None, Some(g)) => (i64::from(g), CeilingSource::Spec),
        (None, None) => (
            i64::from(keygroup::default_max_parallelism(
                spec.replicas.max(1) as u32
            )),
            CeilingSource::Default,
        ),
    };
    let assignment = match Assignment::new(i64::from(spec.replicas), ceiling) {
        Ok(a) => a,
        Err(BoundsError::ParallelismAboveCeiling {
            max_parallelism, ..
        }) => {
            return Err(AnalysisError::AboveCeiling {
                replicas: spec.replicas,
                ceiling: max_parallelism,
                source_text: match ceiling_source {
                    CeilingSource::Pinned => {
                        "pinned in status.maxParallelism at the job's first snapshot"
                    }
                    CeilingSource::Spec => "set in spec.maxParallelism",
                    CeilingSource::Default => "derived by default from spec.replicas",
                },
            });
        }
        Err(e) => return Err(e.into()),
    };
    let skew = assignment.skew();
    if spec.key_group_policy == KeyGroupPolicy::Strict && !skew.divides {
        return Err(AnalysisError::StrictNonDivisor {
            replicas: spec.replicas,
            ceiling: assignment.max_parallelism(),
            summary: skew.summary(),
        });
    }
    // The generator's partitions are its spec's; a file or Kafka source's are what its latest
    // snapshot listed (the brokers' metadata for Kafka), unknown before the first one.
    let partitions = spec
        .job
        .source
        .generator
        .as_ref()
        .map(|g| g.partitions.max(0) as u32)
        .or_else(|| status.and_then(snapshot_partitions));
    let idle_subtasks = partitions.map_or(0, |n| assignment.parallelism().saturating_sub(n));
    Ok(Analysis {
        source_partitions: partitions,
        assignment,
        ceiling_source,
        skew,
        idle_subtasks,
    })
}

/// The StreamJob CRD, with the CEL validation rules attached and `status` defaulted to
/// `{observedGeneration: UNOBSERVED_GENERATION}`.
pub fn crd() -> CustomResourceDefinition {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSON;
    let mut crd = StreamJob::crd();
    for version in &mut crd.spec.versions {
        if let Some(schema) = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
        {
            attach_cel_rules(schema);
            if let Some(status) = schema.properties.as_mut().and_then(|p| p.get_mut("status")) {
                status.default = Some(JSON(
                    serde_json::json!({ "observedGeneration": UNOBSERVED_GENERATION }),
                ));
            }
        }
    }
    crd
}

/// The CRD as YAML, as `keyshift crd` prints it and `crds/` holds it.
pub fn crd_yaml() -> Result<String, serde_yaml::Error> {
    serde_yaml::to_string(&crd())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::JobSpec;
    use crate::fixtures::job;
    use keyshift_core::reason::Reason;

    fn policy(images: &[&str], accounts: &[&str]) -> PodPolicy {
        PodPolicy {
            allowed_image_prefixes: images.iter().map(|s| (*s).to_owned()).collect(),
            allowed_service_accounts: accounts.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    fn with(image: Option<&str>, account: Option<&str>) -> StreamJobSpec {
        let mut spec = job().spec;
        spec.image = image.map(str::to_owned);
        spec.pod_template
            .get_or_insert_with(Default::default)
            .service_account_name = account.map(str::to_owned);
        spec
    }

    const OPERATOR_IMAGE: &str = "ghcr.io/keyshift/keyshift:0.1.0";

    #[test]
    fn an_empty_policy_allows_any_image_and_service_account() {
        let spec = with(Some("evil.example/miner:latest"), Some("cluster-admin-sa"));
        assert_eq!(
            check_pod_policy(&spec, &PodPolicy::default(), OPERATOR_IMAGE),
            Ok(())
        );
    }

    #[test]
    fn images_must_start_with_an_allowed_prefix() {
        let p = policy(
            &["registry.example.com/streaming/", "ghcr.io/keyshift/"],
            &[],
        );
        for ok in [
            None,
            Some("registry.example.com/streaming/clicks:3"),
            Some("ghcr.io/keyshift/keyshift@sha256:abc"),
        ] {
            assert_eq!(
                check_pod_policy(&with(ok, None), &p, OPERATOR_IMAGE),
                Ok(()),
                "{ok:?}"
            );
        }
        for bad in [
            "registry.example.com/other/clicks:3",
            "registry.example.com.evil.example/streaming/x",
            "docker.io/library/busybox",
            "",
        ] {
            let err = check_pod_policy(&with(Some(bad), None), &p, OPERATOR_IMAGE).unwrap_err();
            assert_eq!(err.reason(), Reason::ImageNotAllowed, "{bad}");
            assert_eq!(
                err,
                PolicyError::ImageNotAllowed {
                    image: bad.to_owned(),
                    allowed: "`registry.example.com/streaming/`, `ghcr.io/keyshift/`".to_owned()
                }
            );
            let msg = err.to_string();
            assert!(
                msg.starts_with(&format!("spec.image `{bad}` is not allowed")),
                "{msg}"
            );
            assert!(msg.contains("remove spec.image"), "{msg}");
            assert!(msg.contains("policy.allowedImagePrefixes"), "{msg}");
        }
        // The operator's own worker image is allowed even when named explicitly.
        let p = policy(&["registry.example.com/streaming/"], &[]);
        assert_eq!(
            check_pod_policy(&with(Some(OPERATOR_IMAGE), None), &p, OPERATOR_IMAGE),
            Ok(())
        );
        // An empty prefix in the list admits nothing by itself.
        let p = policy(&[""], &[]);
        assert!(check_pod_policy(&with(Some("x/y"), None), &p, OPERATOR_IMAGE).is_err());
    }

    #[test]
    fn service_accounts_must_be_listed_or_the_default() {
        let p = policy(&[], &["stream-workers"]);
        for ok in [None, Some("stream-workers"), Some("default")] {
            assert_eq!(
                check_pod_policy(&with(None, ok), &p, OPERATOR_IMAGE),
                Ok(()),
                "{ok:?}"
            );
        }
        let err =
            check_pod_policy(&with(None, Some("ci-deployer")), &p, OPERATOR_IMAGE).unwrap_err();
        assert_eq!(err.reason(), Reason::ServiceAccountNotAllowed);
        assert_eq!(
            err.to_string(),
            "spec.podTemplate.serviceAccountName `ci-deployer` is not allowed here: this operator runs workers only as `stream-workers` (or the namespace's default); name one of them, remove the field to use the default ServiceAccount, or ask the cluster admin to extend policy.allowedServiceAccounts"
        );
        // A job without a pod template at all runs as the default.
        let mut spec = job().spec;
        spec.pod_template = None;
        assert_eq!(check_pod_policy(&spec, &p, OPERATOR_IMAGE), Ok(()));
        // The image is checked first, both lists apply.
        let p = policy(&["ok/"], &["stream-workers"]);
        let err =
            check_pod_policy(&with(Some("bad/x"), Some("bad")), &p, OPERATOR_IMAGE).unwrap_err();
        assert_eq!(err.reason(), Reason::ImageNotAllowed);
    }

    #[test]
    fn the_job_rules_alone_say_what_the_manifest_s_validation_says() {
        let mut spec = job().spec;
        assert_eq!(validate_job(&spec.job), Ok(()));
        spec.replicas = 0;
        // Rules outside spec.job are not the job's.
        assert_eq!(validate_job(&spec.job), Ok(()));
        let generator = spec.job.source.generator.as_mut().expect("a generator job");
        generator.partitions = 0;
        generator.keys = MAX_GENERATOR_KEYS + 1;
        spec.job.sink.sink_type = crate::crd::SinkType::ObjectStore;
        spec.job.sink.url = None;
        spec.job.key.field = String::new();
        let job_errors = validate_job(&spec.job).unwrap_err().0;
        assert_eq!(
            job_errors,
            [MSG_PARTITIONS, MSG_KEYS, MSG_KEY_FIELD, MSG_SINK_URL]
        );
        let all = validate(&spec, None).unwrap_err().0;
        assert_eq!(
            all,
            [
                MSG_REPLICAS_MIN,
                MSG_PARTITIONS,
                MSG_KEYS,
                MSG_KEY_FIELD,
                MSG_SINK_URL
            ]
        );
    }

    fn kafka_job() -> JobSpec {
        let mut spec = job().spec.job;
        spec.source.generator = None;
        spec.source.kafka = Some(crate::crd::KafkaSource {
            bootstrap_servers: "kafka-0.kafka:9092,10.0.0.1:9093".into(),
            topics: vec!["orders".into(), "orders.v2_eu-1".into()],
            key_from: Default::default(),
            timestamp_field: None,
            starting_position: Default::default(),
            starting_timestamp: None,
            group_id: None,
            idle_timeout: Some("30s".into()),
            metadata_refresh_interval: Some("1m".into()),
            properties: [("fetch.max.bytes".to_owned(), "1048576".to_owned())].into(),
            credentials: None,
        });
        spec
    }

    fn kafka_sink() -> crate::crd::KafkaSink {
        crate::crd::KafkaSink {
            bootstrap_servers: "k:9092".into(),
            topic: "counts".into(),
            delivery_guarantee: Default::default(),
            transactional_id_prefix: None,
            properties: Default::default(),
            credentials: None,
        }
    }

    #[test]
    fn a_kafka_source_is_one_of_the_sources_and_its_fields_are_checked() {
        let ok = kafka_job();
        assert_eq!(validate_job(&ok), Ok(()));
        let mut both = ok.clone();
        both.source.generator = job().spec.job.source.generator;
        assert_eq!(validate_job(&both).unwrap_err().0, [MSG_SOURCE_ONE_OF]);

        let mut bad = ok.clone();
        let k = bad.source.kafka.as_mut().unwrap();
        k.bootstrap_servers = "kafka:9092, other:9092".into();
        k.topics = vec!["ok".into(), "not/ok".into()];
        k.starting_position = crate::crd::KafkaStartingPosition::Timestamp;
        k.idle_timeout = Some("30".into());
        k.metadata_refresh_interval = Some("500ms".into());
        k.properties
            .insert("enable.auto.commit".into(), "true".into());
        k.credentials = Some(crate::crd::KafkaCredentials {
            secret_name: "creds".into(),
            sasl: None,
            tls: Some(crate::crd::KafkaTls {
                ca_key: None,
                cert_key: Some("tls.crt".into()),
                key_key: None,
            }),
        });
        assert_eq!(
            validate_job(&bad).unwrap_err().0,
            [
                MSG_KAFKA_SOURCE_BOOTSTRAP,
                MSG_KAFKA_SOURCE_TOPICS,
                MSG_KAFKA_STARTING_TIMESTAMP,
                MSG_KAFKA_IDLE_TIMEOUT,
                MSG_KAFKA_REFRESH,
                MSG_KAFKA_SOURCE_PROPERTIES,
                MSG_KAFKA_SOURCE_CREDENTIALS,
            ]
        );
        let mut secret = ok.clone();
        secret
            .source
            .kafka
            .as_mut()
            .unwrap()
            .properties
            .insert("sasl.password".into(), "x".into());
        assert_eq!(
            validate_job(&secret).unwrap_err().0,
            [MSG_KAFKA_SOURCE_PROPERTIES]
        );
        let mut none = ok;
        none.source.kafka.as_mut().unwrap().topics.clear();
        assert_eq!(
            validate_job(&none).unwrap_err().0,
            [MSG_KAFKA_SOURCE_TOPICS]
        );
    }

    #[test]
    fn a_kafka_sink_needs_its_type_and_its_fields() {
        let mut j = kafka_job();
        j.sink.sink_type = crate::crd::SinkType::Kafka;
        assert_eq!(validate_job(&j).unwrap_err().0, [MSG_KAFKA_SINK_REQUIRED]);
        j.sink.kafka = Some(kafka_sink());
        assert_eq!(validate_job(&j), Ok(()));
        j.sink.sink_type = crate::crd::SinkType::Log;
        assert_eq!(validate_job(&j).unwrap_err().0, [MSG_KAFKA_SINK_REQUIRED]);
        j.sink.sink_type = crate::crd::SinkType::Kafka;
        let k = j.sink.kafka.as_mut().unwrap();
        k.bootstrap_servers = "nohostport".into();
        k.topic = String::new();
        k.properties.insert("transactional.id".into(), "x".into());
        k.credentials = Some(crate::crd::KafkaCredentials {
            secret_name: "creds".into(),
            sasl: None,
            tls: None,
        });
        assert_eq!(
            validate_job(&j).unwrap_err().0,
            [
                MSG_KAFKA_SINK_BOOTSTRAP,
                MSG_KAFKA_SINK_TOPIC,
                MSG_KAFKA_SINK_PROPERTIES,
                MSG_KAFKA_SINK_CREDENTIALS,
            ]
        );
    }

    #[test]
    fn bootstrap_lists_and_topic_names_follow_the_cel_rules() {
        for ok in [
            "k:9092",
            "a:1,b:65535",
            "[::1]:9092",
            "k.ns.svc.cluster.local:9092",
        ] {
            assert!(valid_bootstrap(ok), "{ok}");
        }
        for bad in [
            "", "k", "k:", ":9092", "k:123456", "a:1,", "a:1 ,b:2", "k:90a",
        ] {
            assert!(!valid_bootstrap(bad), "{bad}");
        }
        assert!(valid_topic("a.b_c-D9"));
        assert!(valid_topic(&"t".repeat(249)));
        assert!(!valid_topic(&"t".repeat(250)));
        assert!(!valid_topic("a b"));
        assert!(!valid_topic(""));
    }

    #[test]
    fn a_kafka_job_s_idle_subtasks_come_from_its_latest_snapshot_s_partitions() {
        let mut spec = job().spec;
        spec.job = kafka_job();
        spec.replicas = 6;
        spec.max_parallelism = Some(64);
        // Unknown before the first snapshot: no subtask is reported idle.
        let a = analyse(&spec, None).unwrap();
        assert_eq!((a.source_partitions, a.idle_subtasks), (None, 0));
        let snap = |id, n| crate::crd::SnapshotRef {
            id,
            source_partitions: n,
            ..Default::default()
        };
        let mut status = StreamJobStatus {
            last_checkpoint: Some(snap(7, Some(4))),
            last_savepoint: Some(snap(5, Some(2))),
            ..Default::default()
        };
        let a = analyse(&spec, Some(&status)).unwrap();
        assert_eq!((a.source_partitions, a.idle_subtasks), (Some(4), 2));
        // The newest snapshot counts (a savepoint taken after the checkpoint).
        status.last_savepoint = Some(snap(8, Some(8)));
        let a = analyse(&spec, Some(&status)).unwrap();
        assert_eq!((a.source_partitions, a.idle_subtasks), (Some(8), 0));
    }
}
