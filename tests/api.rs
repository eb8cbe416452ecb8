//! The StreamJob API: the committed CRD, the samples, and the Rust mirror of the CEL rules.

use keyshift::crd::{StreamJob, StreamJobSpec, StreamJobStatus};
use keyshift::validation::{self, *};
use keyshift_core::duration::parse_duration;

/// The repository root: `cargo test` sets `CARGO_MANIFEST_DIR` when it runs a test, so a test
/// binary that cargo reused from another checkout's build cache still reads this checkout's files.
fn root() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// The root OpenAPI schema of the CRD's (only) version.
fn root_schema(
    crd: &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
) -> &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSONSchemaProps {
    crd.spec.versions[0]
        .schema
        .as_ref()
        .unwrap()
        .open_api_v3_schema
        .as_ref()
        .unwrap()
}

#[test]
fn committed_crd_matches_the_generated_one() {
    let committed = std::fs::read_to_string(root().join("crds/streamjob.yaml"))
        .expect("crds/streamjob.yaml exists");
    let generated = crd_yaml().unwrap();
    assert!(
        committed == generated,
        "crds/streamjob.yaml is stale: run `cargo run -- crd streamjob > crds/streamjob.yaml && cp crds/streamjob.yaml charts/keyshift/crds/`"
    );
    let committed = std::fs::read_to_string(root().join("crds/streamjobsnapshot.yaml"))
        .expect("crds/streamjobsnapshot.yaml exists");
    assert!(
        committed == snapshot_crd_yaml().unwrap(),
        "crds/streamjobsnapshot.yaml is stale: run `cargo run -- crd streamjobsnapshot > crds/streamjobsnapshot.yaml && cp crds/streamjobsnapshot.yaml charts/keyshift/crds/`"
    );
}

/// Every property under `schema` (through nested objects, array items and map values) that
/// has no description, by its path.
fn undescribed(schema: &serde_json::Value, path: &str, out: &mut Vec<String>) {
    if let Some(props) = schema["properties"].as_object() {
        for (name, prop) in props {
            let p = format!("{path}.{name}");
            if prop["description"]
                .as_str()
                .is_none_or(|d| d.trim().is_empty())
            {
                out.push(p.clone());
            }
            undescribed(prop, &p, out);
        }
    }
    if schema["items"].is_object() {
        undescribed(&schema["items"], &format!("{path}[]"), out);
    }
    if schema["additionalProperties"].is_object() {
        undescribed(&schema["additionalProperties"], &format!("{path}{{}}"), out);
    }
    for key in ["anyOf", "oneOf", "allOf"] {
        for s in schema[key].as_array().into_iter().flatten() {
            undescribed(s, path, out);
        }
    }
}

/// `kubectl explain streamjob...` is complete: every property of the committed CRD (what the
/// API server serves) has a description. A field without a doc comment fails here by its path.
#[test]
fn kubectl_explain_describes_every_property() {
    let text = std::fs::read_to_string(root().join("crds/streamjobsnapshot.yaml")).expect("crd");
    let crd: serde_json::Value = serde_yaml::from_str(&text).expect("the CRD is YAML");
    let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    assert!(
        schema["description"]
            .as_str()
            .is_some_and(|d| !d.is_empty())
    );
    let mut missing = Vec::new();
    undescribed(schema, "streamjobsnapshot", &mut missing);
    assert!(
        missing.is_empty(),
        "`kubectl explain` shows no description for {missing:?}; add a doc comment to each field in src/crd/snapshot.rs"
    );
    let text = std::fs::read_to_string(root().join("crds/streamjob.yaml")).expect("crd");
    let crd: serde_json::Value = serde_yaml::from_str(&text).expect("the CRD is YAML");
    let versions = crd["spec"]["versions"].as_array().expect("versions");
    assert!(!versions.is_empty());
    for v in versions {
        let schema = &v["schema"]["openAPIV3Schema"];
        assert!(
            schema["description"]
                .as_str()
                .is_some_and(|d| !d.is_empty()),
            "the kind itself is described"
        );
        let mut missing = Vec::new();
        undescribed(schema, "streamjob", &mut missing);
        assert!(
            missing.is_empty(),
            "`kubectl explain` shows no description for {} propert{} of {}: {missing:?}; add a doc comment to each field in src/crd/mod.rs and regenerate with `cargo run -- crd streamjob > crds/streamjob.yaml && cp crds/streamjob.yaml charts/keyshift/crds/`",
            missing.len(),
            if missing.len() == 1 { "y" } else { "ies" },
            v["name"]
        );
        // The walk reaches deep: a podTemplate volume's fields and the status conditions.
        let mut all = Vec::new();
        undescribed(&strip_descriptions(schema.clone()), "streamjob", &mut all);
        for deep in [
            "streamjob.spec.podTemplate.volumes[].configMap.name",
            "streamjob.status.conditions[].reason",
            "streamjob.status.rescale.stepSeconds",
            "streamjob.status.message",
        ] {
            assert!(all.iter().any(|p| p == deep), "the walk visits {deep}");
        }
    }
}

fn strip_descriptions(mut v: serde_json::Value) -> serde_json::Value {
    match &mut v {
        serde_json::Value::Object(m) => {
            if m.get("description").is_some_and(|d| d.is_string()) {
                m.remove("description");
            }
            for x in m.values_mut() {
                *x = strip_descriptions(x.take());
            }
        }
        serde_json::Value::Array(a) => {
            for x in a.iter_mut() {
                *x = strip_descriptions(x.take());
            }
        }
        _ => {}
    }
    v
}

/// `kubectl get streamjobs` shows the current step, the age of the last checkpoint and a short
/// message, each from a status field the schema declares.
#[test]
fn printer_columns_show_step_checkpoint_age_and_message() {
    let crd = crd();
    let v = &crd.spec.versions[0];
    let columns = v.additional_printer_columns.as_ref().expect("columns");
    let find = |name: &str| {
        columns
            .iter()
            .find(|c| c.name == name)
            .unwrap_or_else(|| panic!("column {name}"))
    };
    let step = find("Step");
    assert_eq!(
        (step.json_path.as_str(), step.type_.as_str()),
        (".status.step", "string")
    );
    let cp = find("Checkpoint");
    assert_eq!(
        (cp.json_path.as_str(), cp.type_.as_str()),
        (".status.lastCheckpoint.time", "date"),
        "a date column shows the age"
    );
    let msg = find("Message");
    assert_eq!(
        (msg.json_path.as_str(), msg.type_.as_str()),
        (".status.message", "string")
    );
    for c in [step, cp, msg] {
        assert!(
            c.priority.unwrap_or(0) == 0,
            "{} shows without -o wide",
            c.name
        );
        assert!(c.description.as_deref().is_some_and(|d| !d.is_empty()));
    }
    // Every column's path (without filters) names a field of the schema (metadata is the
    // API server's, not in it).
    let schema = serde_json::to_value(root_schema(&crd)).unwrap();
    for c in columns
        .iter()
        .filter(|c| !c.json_path.starts_with(".metadata."))
    {
        // Filters such as [?(@.type=="Ready")] become [] (they hold dots of their own).
        let mut path = String::new();
        let mut depth = 0;
        for ch in c.json_path.chars() {
            match ch {
                '[' => {
                    if depth == 0 {
                        path.push('[');
                    }
                    depth += 1;
                }
                ']' => {
                    depth -= 1;
                    if depth == 0 {
                        path.push(']');
                    }
                }
                _ if depth == 0 => path.push(ch),
                _ => {}
            }
        }
        let mut node = &schema;
        for part in path.trim_start_matches('.').split('.') {
            let field = part.split('[').next().unwrap_or(part);
            node = &node["properties"][field];
            if part.contains('[') {
                node = &node["items"];
            }
            assert!(
                node.is_object(),
                "column {} path {} is in the schema",
                c.name,
                c.json_path
            );
        }
    }
    // The status carries them.
    let status: StreamJobStatus = serde_json::from_value(serde_json::json!({
        "step": "Stopping",
        "message": "rescaling 4 -> 8: step Stopping",
    }))
    .unwrap();
    assert_eq!(status.step.map(|s| s.as_str()), Some("Stopping"));
    assert_eq!(
        status.message.as_deref(),
        Some("rescaling 4 -> 8: step Stopping")
    );
}

#[test]
fn crd_has_scale_status_and_every_rule() {
    let crd = crd();
    assert_eq!(crd.spec.group, "keyshift.dev");
    assert_eq!(crd.spec.names.short_names, Some(vec!["sj".to_owned()]));
    let v = &crd.spec.versions[0];
    let sub = v.subresources.as_ref().unwrap();
    assert!(sub.status.is_some());
    let scale = sub.scale.as_ref().unwrap();
    assert_eq!(scale.spec_replicas_path, ".spec.replicas");
    assert_eq!(scale.status_replicas_path, ".status.replicas");
    assert_eq!(
        scale.label_selector_path.as_deref(),
        Some(".status.selector")
    );
    let json = serde_json::to_string(&crd).unwrap();
    for message in [
        MSG_REPLICAS_MIN,
        MSG_MAXP_RANGE,
        MSG_REPLICAS_LE_MAXP,
        MSG_REPLICAS_LE_PINNED,
        MSG_STRICT_DIVISOR,
        MSG_STORAGE_URL,
        MSG_RESTORE_URL,
        MSG_RETENTION_KEEP,
        MSG_RETENTION_MAX_AGE,
        MSG_CHECKPOINT_INTERVAL,
        MSG_WINDOW_SIZE,
        MSG_OUT_OF_ORDERNESS,
        MSG_RETAINED,
        MSG_INCREMENTAL_MAX_DELTAS,
        MSG_INCREMENTAL_DELTA_PERCENT,
        MSG_RESTORE_TIMEOUT,
        MSG_SOURCE_ONE_OF,
        MSG_AGG_FIELD,
        MSG_PARTITIONS,
        MSG_KEYS,
        MSG_CHECKPOINT_TIMEOUT,
        MSG_SAVEPOINT_TIMEOUT,
        MSG_SINK_URL,
        MSG_KEY_FIELD,
        MSG_TMP_VOLUME,
        MSG_TMP_MOUNT,
        MSG_MOUNT_VOLUME,
        MSG_RESERVED_ENV,
    ] {
        let quoted = serde_json::to_string(message).unwrap();
        assert!(json.contains(&quoted), "CRD lacks rule message {message:?}");
    }
    // The pinned-ceiling rule builds its message from the object (ceiling, origin, the exact
    // rewrite commands), and the status strings it reads are bounded for CEL's cost estimate.
    let schema = root_schema(&crd);
    let pinned = schema
        .x_kubernetes_validations
        .as_ref()
        .unwrap()
        .iter()
        .find(|r| r.message.as_deref() == Some(MSG_REPLICAS_LE_PINNED))
        .expect("pinned-ceiling rule");
    let expr = pinned
        .message_expression
        .as_deref()
        .expect("messageExpression");
    for piece in [
        "self.status.maxParallelism",
        ".format([",
        "self.status.maxParallelismOrigin",
        "self.metadata.name",
        "maxParallelism",
    ] {
        assert!(
            expr.contains(piece),
            "messageExpression lacks {piece}: {expr}"
        );
    }
    let status = &schema.properties.as_ref().unwrap()["status"];
    let sp = &status.properties.as_ref().unwrap()["lastSavepoint"];
    assert_eq!(
        sp.properties.as_ref().unwrap()["path"].max_length,
        Some(2048)
    );
    assert_eq!(
        status.properties.as_ref().unwrap()["maxParallelismOrigin"].max_length,
        Some(512)
    );
    // Every spec field is documented (it becomes `kubectl explain`).
    let spec = &schema.properties.as_ref().unwrap()["spec"];
    for (name, prop) in spec.properties.as_ref().unwrap() {
        assert!(
            prop.description.as_deref().is_some_and(|d| d.len() > 10),
            "spec.{name} has no description"
        );
    }
}

/// spec.podTemplate's schema is Kubernetes' own (k8s-openapi), every field is documented, and
/// what the CEL rules iterate is bounded for the API server's cost estimate.
#[test]
fn pod_template_schema_is_the_kubernetes_one_and_documented() {
    let crd = crd();
    let schema = root_schema(&crd);
    let spec = &schema.properties.as_ref().unwrap()["spec"];
    let template = &spec.properties.as_ref().unwrap()["podTemplate"];
    let props = template.properties.as_ref().unwrap();
    for name in [
        "labels",
        "annotations",
        "nodeSelector",
        "serviceAccountName",
        "volumes",
        "volumeMounts",
        "env",
        "tolerations",
        "affinity",
        "topologySpreadConstraints",
        "priorityClassName",
        "imagePullSecrets",
    ] {
        let prop = props
            .get(name)
            .unwrap_or_else(|| panic!("spec.podTemplate.{name} is missing"));
        assert!(
            prop.description.as_deref().is_some_and(|d| d.len() > 20),
            "spec.podTemplate.{name} has no description"
        );
    }
    assert_eq!(props.len(), 12, "{:?}", props.keys().collect::<Vec<_>>());
    let items = |name: &str| {
        match props[name].items.as_ref().unwrap() {
        k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSONSchemaPropsOrArray::Schema(s) => (**s).clone(),
        other => panic!("{name}: {other:?}"),
    }
    };
    // The real Kubernetes schemas, not free-form objects.
    let volume = items("volumes");
    let vprops = volume.properties.as_ref().unwrap();
    for source in [
        "configMap",
        "secret",
        "persistentVolumeClaim",
        "csi",
        "emptyDir",
    ] {
        assert!(vprops.contains_key(source), "volumes[] lacks {source}");
    }
    assert_eq!(volume.required.as_deref(), Some(&["name".to_owned()][..]));
    assert_eq!(volume.x_kubernetes_preserve_unknown_fields, None);
    assert_eq!(vprops["name"].max_length, Some(63));
    let mount = items("volumeMounts");
    assert_eq!(
        mount.properties.as_ref().unwrap()["mountPath"].max_length,
        Some(4096)
    );
    let env = items("env");
    assert!(env.properties.as_ref().unwrap().contains_key("valueFrom"));
    assert_eq!(
        env.properties.as_ref().unwrap()["name"].max_length,
        Some(256)
    );
    assert_eq!(props["volumes"].max_items, Some(64));
    assert_eq!(props["volumeMounts"].max_items, Some(64));
    assert_eq!(props["env"].max_items, Some(128));
    let affinity = props["affinity"].properties.as_ref().unwrap();
    assert!(affinity.contains_key("nodeAffinity") && affinity.contains_key("podAntiAffinity"));
    let spread = items("topologySpreadConstraints");
    assert!(spread.properties.as_ref().unwrap().contains_key("maxSkew"));
    let toleration = items("tolerations");
    assert!(
        toleration
            .properties
            .as_ref()
            .unwrap()
            .contains_key("effect")
    );
    // The default requests are documented where `kubectl explain` shows them.
    let resources = spec.properties.as_ref().unwrap()["resources"]
        .description
        .clone()
        .unwrap();
    assert!(
        resources.contains("100m") && resources.contains("128Mi"),
        "{resources}"
    );
}

fn samples() -> Vec<(String, StreamJob)> {
    let dir = root().join("config/samples");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let text = std::fs::read_to_string(&path).unwrap();
            let job: StreamJob = serde_yaml::from_str(&text)
                .unwrap_or_else(|e| panic!("{} does not parse: {e}", path.display()));
            out.push((path.display().to_string(), job));
        }
    }
    out
}

#[test]
fn samples_parse_and_validate() {
    let samples = samples();
    assert!(samples.len() >= 2, "expected at least two samples");
    let mut sources = (false, false, false);
    // Each sample is its own StreamJob: applied together (as the e2e tier does), two with one
    // name would be one object.
    let mut names = std::collections::BTreeMap::new();
    for (path, job) in samples {
        let name = job.metadata.name.clone().unwrap_or_default();
        if let Some(other) = names.insert(name.clone(), path.clone()) {
            panic!("{path} and {other} both name the StreamJob {name:?}");
        }
        validate(&job.spec, None).unwrap_or_else(|e| panic!("{path}: {e}"));
        analyse(&job.spec, None).unwrap_or_else(|e| panic!("{path}: {e}"));
        sources.0 |= job.spec.job.source.generator.is_some();
        sources.1 |= job.spec.job.source.file.is_some();
        sources.2 |= job.spec.job.source.kafka.is_some();
    }
    assert!(
        sources.0 && sources.1 && sources.2,
        "samples cover generator, file and kafka sources"
    );
}

/// The sample for a locked-down cluster: S3 with a Secret, a private CA from a ConfigMap, and
/// placement; its pods carry all of it on top of the restricted pod.
#[test]
fn restricted_s3_sample_uses_the_pod_template() {
    let (_, job) = samples()
        .into_iter()
        .find(|(p, _)| p.ends_with("restricted-s3.yaml"))
        .expect("config/samples/restricted-s3.yaml");
    let mut job = job;
    let spec = &job.spec;
    assert!(spec.state.storage.as_deref().unwrap().starts_with("s3://"));
    assert!(spec.state.credentials_secret.is_some());
    let t = spec.pod_template.as_ref().unwrap();
    assert!(t.volumes.iter().any(|v| v.config_map.is_some()));
    assert!(t.volume_mounts.iter().all(|m| m.read_only == Some(true)));
    let cert = t.env.iter().find(|e| e.name == "SSL_CERT_FILE").unwrap();
    let mount = &t.volume_mounts[0].mount_path;
    assert!(cert.value.as_deref().unwrap().starts_with(mount.as_str()));
    assert!(!t.tolerations.is_empty());
    assert!(!t.topology_spread_constraints.is_empty());
    assert!(t.priority_class_name.is_some());

    job.metadata.namespace = Some("streaming".into());
    job.metadata.uid = Some("u-1".into());
    let a = keyshift::keygroup::Assignment::new(4, 128).unwrap();
    let pod = keyshift::operator::desired::pod(
        &job,
        "r1",
        0,
        a,
        "keyshift:dev",
        keyshift::telemetry::LogFormat::Text,
    )
    .unwrap();
    let ps = pod.spec.unwrap();
    assert_eq!(ps.priority_class_name.as_deref(), Some("streaming"));
    assert_eq!(ps.volumes.unwrap().len(), 2);
    let c = &ps.containers[0];
    assert_eq!(c.volume_mounts.as_ref().unwrap().len(), 2);
    assert_eq!(
        c.resources.as_ref().unwrap().requests.as_ref().unwrap()["cpu"].0,
        "500m"
    );
}

fn base() -> StreamJobSpec {
    samples()
        .into_iter()
        .find(|(p, _)| p.ends_with("generator-count.yaml"))
        .unwrap()
        .1
        .spec
}

fn fails_with(spec: &StreamJobSpec, status: Option<&StreamJobStatus>, msg: &str) {
    match validate(spec, status) {
        Ok(()) => panic!("expected {msg:?}, got no error"),
        Err(e) => assert!(e.contains(msg), "expected {msg:?}, got {e}"),
    }
}

#[test]
fn each_rule_refuses_with_its_message() {
    let mut s = base();
    s.replicas = 0;
    fails_with(&s, None, MSG_REPLICAS_MIN);

    let mut s = base();
    s.max_parallelism = Some(40000);
    fails_with(&s, None, MSG_MAXP_RANGE);

    let mut s = base();
    s.replicas = 200;
    fails_with(&s, None, MSG_REPLICAS_LE_MAXP);

    let mut s = base();
    s.key_group_policy = keyshift::crd::KeyGroupPolicy::Strict;
    s.replicas = 3;
    fails_with(&s, None, MSG_STRICT_DIVISOR);

    // maxParallelism may change: the operator rewrites the job's state to the new count.
    let mut s = base();
    s.max_parallelism = Some(256);
    validate(&s, None).unwrap();

    let pinned = StreamJobStatus {
        max_parallelism: Some(128),
        ..Default::default()
    };
    let mut s = base();
    s.max_parallelism = None;
    s.replicas = 200;
    fails_with(&s, Some(&pinned), MSG_REPLICAS_LE_PINNED);
    s.replicas = 3;
    s.key_group_policy = keyshift::crd::KeyGroupPolicy::Strict;
    fails_with(&s, Some(&pinned), MSG_STRICT_DIVISOR);
    // Another count than the pinned one is a managed change: replicas may then exceed the
    // pinned count (not the new one), and Strict is checked against the new count.
    let mut s = base();
    s.max_parallelism = Some(1024);
    s.replicas = 200;
    validate(&s, Some(&pinned)).unwrap();
    s.max_parallelism = Some(64);
    s.replicas = 3;
    validate(&s, Some(&pinned)).unwrap();
    s.replicas = 100;
    fails_with(&s, Some(&pinned), MSG_REPLICAS_LE_MAXP);

    for bad in ["bucket/prefix", "ftp://x/y", "s3://", "/var/lib/keyshift"] {
        let mut s = base();
        s.state.storage = Some(bad.into());
        fails_with(&s, None, MSG_STORAGE_URL);
    }
    let mut s = base();
    s.restore_from = Some("savepoints/sp-1".into());
    fails_with(&s, None, MSG_RESTORE_URL);
    for bad in ["Before", "-x", "a..b", "x_y"] {
        s.restore_from = Some(bad.into());
        fails_with(&s, None, MSG_RESTORE_URL);
    }
    // A StreamJobSnapshot's name.
    s.restore_from = Some("before-upgrade.v2".into());
    validate(&s, None).unwrap();
    let mut s = base();
    s.snapshot_retention = Some(keyshift::crd::SnapshotRetention {
        keep: Some(0),
        max_age: None,
    });
    fails_with(&s, None, MSG_RETENTION_KEEP);
    s.snapshot_retention = Some(keyshift::crd::SnapshotRetention {
        keep: Some(1),
        max_age: Some("7d".into()),
    });
    fails_with(&s, None, MSG_RETENTION_MAX_AGE);
    s.snapshot_retention = Some(keyshift::crd::SnapshotRetention {
        keep: Some(3),
        max_age: Some("168h".into()),
    });
    validate(&s, None).unwrap();

    for bad in ["", "10", "5 s", "1d", "s", "-5s", "1.5s"] {
        let mut s = base();
        s.state.checkpoint_interval = bad.into();
        fails_with(&s, None, MSG_CHECKPOINT_INTERVAL);
    }
    let mut s = base();
    s.state.retained_checkpoints = 0;
    fails_with(&s, None, MSG_RETAINED);
    let chain = |max_deltas, max_delta_percent| {
        let mut s = base();
        s.state.incremental_checkpoints = Some(keyshift::crd::IncrementalCheckpoints {
            enabled: true,
            max_deltas,
            max_delta_percent,
        });
        s
    };
    for bad in [0, 65, 1000] {
        fails_with(&chain(Some(bad), None), None, MSG_INCREMENTAL_MAX_DELTAS);
    }
    for bad in [0, 9, 401] {
        fails_with(&chain(None, Some(bad)), None, MSG_INCREMENTAL_DELTA_PERCENT);
    }
    for (d, p) in [(1, 10), (64, 400), (16, 50)] {
        assert!(validate(&chain(Some(d), Some(p)), None).is_ok());
    }
    for bad in ["0s", "29s", "25h", "30", "later"] {
        let mut s = base();
        s.state.restore_timeout = Some(bad.into());
        fails_with(&s, None, MSG_RESTORE_TIMEOUT);
    }
    for good in ["30s", "10m", "24h"] {
        let mut s = base();
        s.state.restore_timeout = Some(good.into());
        assert!(
            validate(&s, None).is_ok(),
            "restoreTimeout {good} is accepted"
        );
    }
    let mut s = base();
    s.state.restore_timeout = Some("10m".into());
    assert_eq!(
        keyshift::orchestrator::timeouts::start(&s),
        std::time::Duration::from_secs(600)
    );

    let mut s = base();
    s.job.source.file = Some(keyshift::crd::FileSource {
        path: "file:///in".into(),
        timestamp_field: None,
    });
    fails_with(&s, None, MSG_SOURCE_ONE_OF);

    let mut s = base();
    s.job.aggregation.as_mut().expect("an aggregation").function =
        keyshift::crd::AggregateFunction::Sum;
    fails_with(&s, None, MSG_AGG_FIELD);

    // Timeouts are durations within 1s..24h.
    for bad in ["0s", "500ms", "25h", "2", "soon"] {
        let mut s = base();
        s.state.checkpoint_timeout = Some(bad.into());
        fails_with(&s, None, MSG_CHECKPOINT_TIMEOUT);
        let mut s = base();
        s.state.savepoint_timeout = Some(bad.into());
        fails_with(&s, None, MSG_SAVEPOINT_TIMEOUT);
    }
    let mut s = base();
    s.state.checkpoint_timeout = Some("1s".into());
    s.state.savepoint_timeout = Some("24h".into());
    validate(&s, None).unwrap();
    assert_eq!(
        keyshift::orchestrator::timeouts::checkpoint(&s),
        std::time::Duration::from_secs(1)
    );
    assert_eq!(
        keyshift::orchestrator::timeouts::savepoint(&base()),
        keyshift::orchestrator::timeouts::SAVEPOINT
    );

    // The generator is bounded: no partition count or key count beyond what a job can hold.
    for (partitions, keys, message) in [
        (0, 10, Some(MSG_PARTITIONS)),
        (MAX_GENERATOR_PARTITIONS + 1, 10, Some(MSG_PARTITIONS)),
        (4, 0, Some(MSG_KEYS)),
        (4, MAX_GENERATOR_KEYS + 1, Some(MSG_KEYS)),
        (MAX_GENERATOR_PARTITIONS, MAX_GENERATOR_KEYS, None),
    ] {
        let mut s = base();
        let g = s
            .job
            .source
            .generator
            .as_mut()
            .expect("base has a generator");
        (g.partitions, g.keys) = (partitions, keys);
        match message {
            Some(message) => fails_with(&s, None, message),
            None => validate(&s, None).unwrap(),
        }
    }
}

fn with_template(yaml: &str) -> StreamJobSpec {
    let mut s = base();
    s.pod_template = Some(serde_yaml::from_str(yaml).unwrap());
    s
}

#[test]
fn pod_template_rules_refuse_with_their_messages() {
    let ok = with_template(
        "volumes: [{name: ca, configMap: {name: corp-ca}}, {name: scratch2, emptyDir: {}}]
volumeMounts:
- {name: ca, mountPath: /etc/ca, readOnly: true}
- {name: scratch2, mountPath: /tmp/more}
- {name: ca, mountPath: /tmpx}
env:
- {name: SSL_CERT_FILE, value: /etc/ca/ca.crt}
- {name: KEYSHIFT_ENCODE_THREADS, value: '2'}
- {name: MY_POD_IP, valueFrom: {fieldRef: {fieldPath: status.podIP}}}
",
    );
    validate(&ok, None).unwrap();

    let s = with_template("volumes: [{name: tmp, emptyDir: {medium: Memory}}]");
    fails_with(&s, None, MSG_TMP_VOLUME);

    for path in ["/tmp", "/tmp/", "/tmp//"] {
        let s = with_template(&format!(
            "volumes: [{{name: data, emptyDir: {{}}}}]\nvolumeMounts: [{{name: data, mountPath: '{path}'}}]"
        ));
        fails_with(&s, None, MSG_TMP_MOUNT);
    }

    let s = with_template(
        "volumes: [{name: ca, configMap: {name: corp-ca}}]\nvolumeMounts: [{name: cert, mountPath: /etc/ca}]",
    );
    fails_with(&s, None, MSG_MOUNT_VOLUME);
    let s = with_template("volumeMounts: [{name: cert, mountPath: /etc/ca}]");
    fails_with(&s, None, MSG_MOUNT_VOLUME);

    for name in ["POD_IP", "KEYSHIFT_TOKEN", "KEYSHIFT_SUBTASK"] {
        let s = with_template(&format!("env: [{{name: {name}, value: x}}]"));
        fails_with(&s, None, MSG_RESERVED_ENV);
        assert!(MSG_RESERVED_ENV.contains(name));
    }
    // Every variable the operator sets is reserved.
    assert_eq!(
        keyshift::operator::desired::RESERVED_ENV,
        ["POD_IP", "KEYSHIFT_TOKEN", "KEYSHIFT_SUBTASK"]
    );

    // The schema's bounds, with the API server's words.
    let many: Vec<String> = (0..65)
        .map(|i| format!("{{name: v{i}, emptyDir: {{}}}}"))
        .collect();
    let s = with_template(&format!("volumes: [{}]", many.join(", ")));
    fails_with(
        &s,
        None,
        "spec.podTemplate.volumes: Too many: 65: must have at most 64 items",
    );
    let s = with_template(&format!(
        "volumes: [{{name: {}, emptyDir: {{}}}}]",
        "v".repeat(64)
    ));
    fails_with(
        &s,
        None,
        "spec.podTemplate.volumes[0].name: Too long: may not be more than 63 bytes",
    );
}

#[test]
fn durations_follow_the_cel_regex() {
    assert_eq!(parse_duration("30s").unwrap().as_secs(), 30);
    assert_eq!(parse_duration("1h30m").unwrap().as_secs(), 5400);
    assert_eq!(parse_duration("500ms").unwrap().as_millis(), 500);
    assert_eq!(parse_duration("1m5s").unwrap().as_secs(), 65);
    assert!(parse_duration("1mss").is_none());
    assert!(parse_duration("99999999999999999999h").is_none());
}

#[test]
fn analysis_reports_what_cel_cannot() {
    // Strict with the derived default ceiling (128 for 3 replicas): 3 does not divide it.
    let mut s = base();
    s.max_parallelism = None;
    s.replicas = 3;
    s.key_group_policy = keyshift::crd::KeyGroupPolicy::Strict;
    validate(&s, None).unwrap();
    let e = analyse(&s, None).unwrap_err();
    assert!(
        e.to_string().contains("divisors of 128 near 3: 2, 4"),
        "{e}"
    );

    // 24 -> 200 with the default ceiling pinned: refused with the rewrite guidance.
    let pinned = StreamJobStatus {
        max_parallelism: Some(128),
        ..Default::default()
    };
    let mut s = base();
    s.max_parallelism = None;
    s.replicas = 200;
    let e = analyse(&s, Some(&pinned)).unwrap_err();
    let text = e.to_string();
    assert!(text.contains("ceiling 128"), "{text}");
    assert!(text.contains("pinned in status.maxParallelism"), "{text}");
    assert!(text.contains("keyshift savepoint rewrite"), "{text}");

    // More subtasks than partitions: idle subtasks are counted.
    let mut s = base();
    s.replicas = 8;
    let a = analyse(&s, None).unwrap();
    assert_eq!(a.idle_subtasks, 4);
    assert_eq!(a.ceiling_source, validation::CeilingSource::Spec);
    assert!(a.skew.divides);
}
