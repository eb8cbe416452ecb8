//! Fixtures shared by the crate's unit tests (compiled only for them).

use crate::crd::{StreamJob, StreamJobSpec};

/// The repository root. `cargo test` (and hack/test.sh) set `CARGO_MANIFEST_DIR` when they run
/// a test, so a test executable that cargo reused from another checkout's build (CI keeps one
/// build directory for every clone) reads this checkout's files, not the one it was built in.
pub(crate) fn repo_root() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

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
