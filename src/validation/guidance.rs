//! The words of the ceiling guidance and of status.maxParallelismOrigin: rendered in Rust for the
//! operator's conditions and as CEL for the API server, so both say the same.

use super::*;

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
pub(super) enum Part {
    Text(&'static str),
    Name,
    Replicas,
    Ceiling,
    Origin,
    Suggested,
}

pub(super) const ORIGIN_UNKNOWN: &str = "fixed at the job's first snapshot";

pub(super) fn ceiling_guidance_parts() -> Vec<Part> {
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

pub(super) fn render(parts: &[Part], c: &CeilingContext<'_>, out: &mut String) {
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
