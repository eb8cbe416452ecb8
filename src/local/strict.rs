//! Strict field validation of a `keyshift local` manifest, as the API server does it for
//! `kubectl apply` (`--validate=strict`, kubectl's default): every field the StreamJob CRD's
//! schema does not declare is refused, named by its path. The walk runs over the very schema
//! `keyshift crd` prints (so it sees what the API server sees), plus `ObjectMeta`'s schema for
//! `metadata`, which the API server decodes itself.

use serde_json::Value;

/// The paths of the fields of `manifest` that neither the StreamJob CRD's schema nor
/// `ObjectMeta` declares, in the API server's notation (`spec.replicsa`,
/// `spec.job.source.generator.partitons`, `spec.podTemplate.volumes[0].nmae`, a top-level
/// `replicas`), sorted.
pub fn unknown_fields(manifest: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let Value::Object(top) = manifest else {
        return out;
    };
    let crd = crd_schema();
    let meta = object_meta_schema();
    for (key, value) in top {
        match key.as_str() {
            "apiVersion" | "kind" => {}
            "metadata" => walk(value, &meta, key, &mut out),
            _ => match crd.get("properties").and_then(|p| p.get(key)) {
                Some(schema) => walk(value, schema, key, &mut out),
                None => out.push(key.clone()),
            },
        }
    }
    out.sort();
    out
}

/// The message the API server gives for `fields` (the shape of its strict decoding error):
/// `StreamJob in version "v1alpha1" cannot be handled as a StreamJob: strict decoding error:
/// unknown field "spec.replicsa", unknown field "spec.job.sources"`.
pub fn strict_decoding_message(fields: &[String]) -> String {
    let kind = <crate::crd::StreamJob as kube::Resource>::kind(&());
    let version = <crate::crd::StreamJob as kube::Resource>::version(&());
    let list: Vec<String> = fields
        .iter()
        .map(|f| format!("unknown field \"{f}\""))
        .collect();
    format!(
        "{kind} in version \"{version}\" cannot be handled as a {kind}: strict decoding error: {}",
        list.join(", ")
    )
}

/// The CRD's `openAPIV3Schema` as JSON (`Null` if it had none, which never happens: the
/// derive always generates one).
fn crd_schema() -> Value {
    crate::validation::crd()
        .spec
        .versions
        .into_iter()
        .find_map(|v| v.schema.and_then(|s| s.open_api_v3_schema))
        .and_then(|s| serde_json::to_value(s).ok())
        .unwrap_or(Value::Null)
}

/// `ObjectMeta`'s schema, inlined as in a CRD.
fn object_meta_schema() -> Value {
    let generator = schemars::generate::SchemaSettings::openapi3()
        .with(|s| {
            s.inline_subschemas = true;
            s.meta_schema = None;
        })
        .into_generator();
    generator
        .into_root_schema_for::<k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>()
        .to_value()
}

/// Collects the undeclared fields under `value` (at `path`) against its structural `schema`.
fn walk(value: &Value, schema: &Value, path: &str, out: &mut Vec<String>) {
    match value {
        Value::Object(fields) => {
            let properties = schema.get("properties").and_then(Value::as_object);
            let additional = schema.get("additionalProperties");
            let open = schema
                .get("x-kubernetes-preserve-unknown-fields")
                .and_then(Value::as_bool)
                == Some(true)
                || additional == Some(&Value::Bool(true));
            // Only an object schema prunes fields; anything else (int-or-string, a type
            // mismatch) is the typed decoding's business.
            let object = properties.is_some()
                || additional.is_some()
                || schema.get("type").and_then(Value::as_str) == Some("object");
            for (key, v) in fields {
                let child = format!("{path}.{key}");
                if let Some(s) = properties.and_then(|p| p.get(key)) {
                    walk(v, s, &child, out);
                } else if let Some(s) = additional.filter(|a| a.is_object()) {
                    walk(v, s, &child, out);
                } else if object && !open {
                    out.push(child);
                }
            }
        }
        Value::Array(items) => {
            if let Some(s) = schema.get("items") {
                for (i, v) in items.iter().enumerate() {
                    walk(v, s, &format!("{path}[{i}]"), out);
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unknown(yaml: &str) -> Vec<String> {
        unknown_fields(&serde_yaml::from_str(yaml).unwrap())
    }

    const GOOD: &str = "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata:
  name: clicks
  labels: {team: a}
spec:
  replicas: 2
  job:
    source:
      generator: {partitions: 4, keys: 100}
    key: {field: key, type: string}
    aggregation: {function: count}
    sink: {type: log}
";

    #[test]
    fn a_declared_manifest_has_no_unknown_fields() {
        assert_eq!(unknown(GOOD), Vec::<String>::new());
    }

    #[test]
    fn every_sample_is_declared() {
        let dir = crate::fixtures::repo_root().join("config/samples");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let text = std::fs::read_to_string(&path).unwrap();
            for doc in serde_yaml::Deserializer::from_str(&text) {
                let v = <Value as serde::Deserialize>::deserialize(doc).unwrap();
                assert_eq!(
                    unknown_fields(&v),
                    Vec::<String>::new(),
                    "{}",
                    path.display()
                );
                seen += 1;
            }
        }
        assert!(seen >= 4, "{seen} samples");
    }

    #[test]
    fn typos_are_named_with_their_paths() {
        let yaml = GOOD
            .replace("  replicas: 2", "  replicsa: 2")
            .replace("  name: clicks", "  nmae: clicks")
            .replace("generator: {partitions: 4,", "generator: {partitons: 4,")
            .replace("kind: StreamJob", "kind: StreamJob\nspce: {}");
        assert_eq!(
            unknown(&yaml),
            [
                "metadata.nmae",
                "spce",
                "spec.job.source.generator.partitons",
                "spec.replicsa"
            ]
        );
    }

    #[test]
    fn the_message_has_the_api_servers_shape() {
        assert_eq!(
            strict_decoding_message(&["spec.replicsa".into(), "spce".into()]),
            "StreamJob in version \"v1alpha1\" cannot be handled as a StreamJob: strict decoding \
             error: unknown field \"spec.replicsa\", unknown field \"spce\""
        );
    }
}
