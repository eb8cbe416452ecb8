//! A StreamJob's spec as a pass acts on it, read once per pass: the parallelism it asks for, its
//! checkpoint interval and step timeouts (durations parsed, within their bounds, and the defaults
//! where the spec leaves them out or, in a spec the rules refuse, gets them wrong: a rescale in
//! flight still finishes) and the hash its workers carry; and, for the few places that need
//! them (a run's identity, a restore's refusal), the job's fingerprint and state layout. Pure.
//! Besides the rules (`validation`), which parse a spec to refuse it, this is the one place the
//! orchestrator parses one.

use super::timeouts;
use crate::crd::StreamJobSpec;
use crate::snapshot::StateLayout;
use keyshift_core::hash::fnv;
use std::time::Duration;

/// The spec's values a pass acts on ([`JobSettings::read`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobSettings {
    /// The parallelism the spec asks for (0 while suspended).
    pub desired_parallelism: u32,
    /// How often a checkpoint is due (default 30 s; never below 1 s).
    pub checkpoint_interval: Duration,
    /// How long each long step may take.
    pub timeouts: StepTimeouts,
    /// What the worker pods depend on besides their parallelism ([`spec_hash`]).
    pub spec_hash: String,
}

/// How long each long step of a run may take before it counts as failed ([`timeouts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepTimeouts {
    /// Starting a run, restores included (spec.state.restoreTimeout).
    pub start: Duration,
    /// A periodic checkpoint, trigger to commit (spec.state.checkpointTimeout).
    pub checkpoint: Duration,
    /// A savepoint, trigger to commit (spec.state.savepointTimeout).
    pub savepoint: Duration,
    /// The new workers of a pre-staged rescale are ready (spec.state.prestageTimeout).
    pub prestage: Duration,
}

impl JobSettings {
    /// Reads `spec` (any spec: what the rules refuse falls back to the defaults).
    pub fn read(spec: &StreamJobSpec) -> JobSettings {
        JobSettings {
            desired_parallelism: desired_parallelism(spec),
            checkpoint_interval: checkpoint_interval(spec),
            timeouts: StepTimeouts::read(spec),
            spec_hash: spec_hash(spec),
        }
    }
}

impl StepTimeouts {
    /// The job's step timeouts: its own within their bounds, else the defaults.
    pub fn read(spec: &StreamJobSpec) -> StepTimeouts {
        StepTimeouts {
            start: timeouts::start(spec),
            checkpoint: timeouts::checkpoint(spec),
            savepoint: timeouts::savepoint(spec),
            prestage: timeouts::prestage(spec),
        }
    }
}

/// The parallelism the spec asks for (0 while suspended).
pub fn desired_parallelism(spec: &StreamJobSpec) -> u32 {
    if spec.suspend {
        0
    } else {
        spec.replicas.max(1) as u32
    }
}

/// The checkpoint interval (default 30 s; never below 1 s).
pub fn checkpoint_interval(spec: &StreamJobSpec) -> Duration {
    keyshift_core::duration::parse_duration(&spec.state.checkpoint_interval)
        .unwrap_or(Duration::from_secs(30))
        .max(Duration::from_secs(1))
}

/// What the worker pods depend on besides their parallelism: the job and the image. Pods carry
/// it as a label; a running job whose pods carry another value is upgraded.
pub fn spec_hash(spec: &StreamJobSpec) -> String {
    fnv(serde_json::to_string(&(&spec.job, &spec.image))
        .unwrap_or_default()
        .as_bytes())
}

/// Identity of a job's dataflow, recorded in snapshots (a stable hash of `spec.job`).
pub fn fingerprint(spec: &StreamJobSpec) -> String {
    fnv(serde_json::to_string(&spec.job)
        .unwrap_or_default()
        .as_bytes())
}

/// What the job's keyed state means (recorded in its snapshots, compared on every restore).
pub fn layout(spec: &StreamJobSpec) -> StateLayout {
    let job = &spec.job;
    let function = job
        .aggregation
        .as_ref()
        .and_then(|a| serde_json::to_value(a.function).ok())
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default();
    StateLayout {
        key_field: job
            .key
            .as_ref()
            .map(|k| k.field.clone())
            .unwrap_or_default(),
        key_type: job
            .key
            .as_ref()
            .map(|k| k.key_type.to_string())
            .unwrap_or_default(),
        function,
        value_field: job.aggregation.as_ref().and_then(|a| a.field.clone()),
        window_ms: job
            .window
            .as_ref()
            .and_then(|w| keyshift_core::duration::parse_duration(&w.size))
            .map(|d| d.as_millis() as u64),
        program: job.program.as_ref().map(|p| p.name.clone()),
    }
}

/// The schema of the key-group blocks of the job `identity` names: a program's or the built-in
/// aggregation's (by its layout; a snapshot of an older version, without one, is the
/// aggregation's).
pub fn state_schema(identity: &crate::snapshot::JobIdentity) -> &'static str {
    match identity.layout.as_ref().and_then(|l| l.program.as_ref()) {
        Some(_) => crate::job::PROGRAM_SCHEMA,
        None => crate::job::AGG_SCHEMA,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_the_parsed_spec_with_defaults_for_what_it_leaves_out_or_gets_wrong() {
        let mut spec = crate::fixtures::job().spec;
        spec.state.checkpoint_interval = "5s".into();
        spec.state.savepoint_timeout = Some("2m".into());
        let s = JobSettings::read(&spec);
        assert_eq!(s.desired_parallelism, 4);
        assert_eq!(s.checkpoint_interval, Duration::from_secs(5));
        assert_eq!(s.timeouts.savepoint, Duration::from_secs(120));
        assert_eq!(s.timeouts.checkpoint, timeouts::CHECKPOINT);
        assert_eq!(s.timeouts.start, timeouts::START);
        assert_eq!(s.timeouts.prestage, timeouts::PRESTAGE);
        spec.state.checkpoint_interval = "soon".into();
        spec.suspend = true;
        let s = JobSettings::read(&spec);
        assert_eq!(s.checkpoint_interval, Duration::from_secs(30));
        assert_eq!(s.desired_parallelism, 0);
        spec.state.checkpoint_interval = "10ms".into();
        assert_eq!(
            JobSettings::read(&spec).checkpoint_interval,
            Duration::from_secs(1)
        );
    }

    #[test]
    fn the_hash_follows_the_job_and_the_image_and_the_fingerprint_only_the_job() {
        let spec = crate::fixtures::job().spec;
        let base = JobSettings::read(&spec);
        let mut image = spec.clone();
        image.image = Some("other:1".into());
        let other = JobSettings::read(&image);
        assert_ne!(other.spec_hash, base.spec_hash);
        assert_eq!(fingerprint(&image), fingerprint(&spec));
        let mut replicas = spec.clone();
        replicas.replicas = 8;
        assert_eq!(JobSettings::read(&replicas).spec_hash, base.spec_hash);
    }
}
