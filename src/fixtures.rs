//! Fixtures shared by the crate's unit tests (compiled only for them).

use crate::crd::{StreamJob, StreamJobSpec};

/// A valid job named `clicks` in namespace `ns`.
pub(crate) fn job() -> StreamJob {
    let spec: StreamJobSpec = serde_yaml::from_str(
        "replicas: 4
maxParallelism: 128
job:
  source: {generator: {partitions: 4, keys: 100}}
  key: {field: key}
  aggregation: {function: count}
state: {credentialsSecret: s3creds}
podTemplate: {labels: {team: a}, nodeSelector: {disk: ssd}}
",
    )
    .unwrap();
    let mut j = StreamJob::new("clicks", spec);
    j.metadata.namespace = Some("ns".into());
    j.metadata.uid = Some("u-1".into());
    j
}
