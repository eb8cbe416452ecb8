//! The `LocalJob` the rescale and throughput benches run: its manifest, and what it processed.

use crate::crd::StreamJob;
use crate::local::LocalJob;
use anyhow::{Context as _, Result};

/// What a bench job runs over its generator.
#[derive(Debug, Clone, Copy)]
pub(super) enum Operator<'a> {
    /// The built-in count, keyed by the generated key, of this key type.
    Count { key_type: &'a str },
    /// A program keyshift's worker carries, by name.
    Program(&'a str),
}

pub(super) fn job_manifest(
    name: &str,
    replicas: u32,
    max_parallelism: u32,
    generator: &str,
    operator: Operator<'_>,
    storage: &str,
) -> Result<StreamJob> {
    let operator = match operator {
        Operator::Count { key_type } => {
            format!(
                "key:\n      field: key\n      type: {key_type}\n    aggregation:\n      function: count"
            )
        }
        Operator::Program(name) => format!("program:\n      name: {name}"),
    };
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
    {operator}
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
