//! The `LocalJob` the rescale and throughput benches run: its manifest, and what it processed.

use crate::crd::StreamJob;
use crate::local::LocalJob;
use anyhow::{Context as _, Result};

pub(super) fn job_manifest(
    name: &str,
    replicas: u32,
    max_parallelism: u32,
    generator: &str,
    key_type: &str,
    storage: &str,
) -> Result<StreamJob> {
    let yaml = format!(
        r#"apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata:
  name: {name}
  namespace: bench
spec:
  replicas: {replicas}
  maxParallelism: {max_parallelism}
  state:
    storage: {storage}
    retainedCheckpoints: 1
  job:
    source:
      generator: {generator}
    key:
      field: key
      type: {key_type}
    aggregation:
      function: count
    sink:
      type: log
"#
    );
    let job: StreamJob = serde_yaml::from_str(&yaml).context("bench job manifest")?;
    crate::validation::validate(&job.spec, None)
        .map_err(|e| anyhow::anyhow!("bench job manifest: {e}"))?;
    Ok(job)
}

pub(super) async fn processed(local: &mut LocalJob) -> Result<(u64, u64)> {
    let st = local.status().await?;
    Ok((
        st.iter().map(|s| s.records_processed).sum(),
        st.iter().map(|s| s.keys).sum(),
    ))
}
