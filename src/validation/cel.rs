//! The CEL rules (`x-kubernetes-validations`) and length bounds attached to the CRD's schema, so
//! the API server refuses a bad `kubectl apply` or `kubectl scale` with the messages [`validate`]
//! gives.

use super::*;

pub(super) const DURATION_RE: &str = "^([0-9]+(ms|s|m|h))+$";

pub(super) fn url_rule() -> String {
    format!("^({})://.+$", STORAGE_SCHEMES.join("|"))
}

/// One CEL rule: where in the schema it sits, the expression, and the message.
pub(super) struct CelRule {
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

pub(super) fn rules() -> Vec<CelRule> {
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
            &format!(
                "self.matches('{}') || (size(self) <= 253 && self.matches('{OBJECT_NAME_RE}'))",
                url_rule()
            ),
            MSG_RESTORE_URL,
            None,
        ),
        r(
            &["spec", "snapshotRetention", "keep"],
            "self >= 1",
            MSG_RETENTION_KEEP,
            None,
        ),
        r(
            &["spec", "snapshotRetention", "maxAge"],
            &format!("self.matches('{DURATION_RE}')"),
            MSG_RETENTION_MAX_AGE,
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
            &["spec", "job"],
            "has(self.program) ? !(has(self.key) || has(self.aggregation) || has(self.window)) : (has(self.key) && has(self.aggregation))",
            MSG_JOB_LOGIC,
            None,
        ),
        r(
            &["spec", "job", "program", "name"],
            &format!("size(self) <= 63 && self.matches('{PROGRAM_NAME_RE}')"),
            MSG_PROGRAM_NAME,
            None,
        ),
        r(
            &["spec", "job", "program", "maxOutOfOrderness"],
            &format!("self.matches('{DURATION_RE}')"),
            MSG_PROGRAM_OUT_OF_ORDERNESS,
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
pub(super) fn cel_list(lists: &[&[&str]]) -> String {
    lists
        .iter()
        .flat_map(|l| l.iter())
        .map(|n| format!("'{n}'"))
        .collect::<Vec<_>>()
        .join(", ")
}

pub(super) const KAFKA_CREDENTIALS_RULE: &str = "size(self.secretName) > 0 && (has(self.sasl) || has(self.tls)) && (!has(self.tls) || has(self.tls.certKey) == has(self.tls.keyKey))";

pub(super) fn cel_string(text: &str) -> String {
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
pub(super) fn cel_suggested() -> String {
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
pub(super) fn render_cel(parts: &[Part]) -> String {
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

pub(super) fn schema_at<'a>(
    root: &'a mut JSONSchemaProps,
    path: &[&str],
) -> Option<&'a mut JSONSchemaProps> {
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
    attach(root, rules(), BOUNDED_STRINGS, BOUNDED_LISTS, BOUNDED_MAPS);
}

/// The StreamJobSnapshot's rules: its spec names a job and a snapshot, both fixed once created.
fn snapshot_rules() -> Vec<CelRule> {
    let r = |path, rule: String, message| CelRule {
        path,
        rule,
        message,
        field_path: None,
        message_expression: None,
    };
    vec![
        r(
            &["spec", "jobName"],
            format!("self.matches('{OBJECT_NAME_RE}')"),
            MSG_SNAPSHOT_JOB_NAME,
        ),
        r(
            &["spec", "path"],
            format!("self.matches('{}')", url_rule()),
            MSG_SNAPSHOT_PATH,
        ),
        r(
            &["spec"],
            "self.jobName == oldSelf.jobName && has(self.path) == has(oldSelf.path) && (!has(self.path) || self.path == oldSelf.path)".to_owned(),
            MSG_SNAPSHOT_FIXED,
        ),
    ]
}

/// Attaches the StreamJobSnapshot's rules and length bounds to its CRD's root schema.
pub(crate) fn attach_snapshot_rules(root: &mut JSONSchemaProps) {
    attach(
        root,
        snapshot_rules(),
        &[(&["spec", "jobName"], 253), (&["spec", "path"], 2048)],
        &[],
        &[],
    );
}

fn attach(
    root: &mut JSONSchemaProps,
    rules: Vec<CelRule>,
    strings: &[(&[&str], i64)],
    lists: &[(&[&str], i64)],
    maps: &[(&[&str], i64)],
) {
    for rule in rules {
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
    set(strings, |n| &mut n.max_length);
    set(lists, |n| &mut n.max_items);
    set(maps, |n| &mut n.max_properties);
}
