//! How long each long step of a run may take before it counts as failed: the defaults, and the
//! job's own timeouts from its spec within their bounds. Pure.

use std::time::Duration;

/// Workers of a starting run restore their key groups and connect to each other.
pub const START: Duration = Duration::from_secs(180);
/// A periodic checkpoint, trigger to commit (spec.state.checkpointTimeout by default).
pub const CHECKPOINT: Duration = Duration::from_secs(120);
/// A savepoint (a rescale's, an upgrade's, a triggered one), trigger to commit
/// (spec.state.savepointTimeout by default).
pub const SAVEPOINT: Duration = Duration::from_secs(300);

/// The new workers of a pre-staged rescale are created, scheduled and loaded
/// (spec.state.prestageTimeout by default).
pub const PRESTAGE: Duration = Duration::from_secs(120);

/// How long the new workers of a pre-staged rescale may take to be ready:
/// spec.state.prestageTimeout within its bounds, else [`PRESTAGE`].
pub fn prestage(spec: &crate::crd::StreamJobSpec) -> Duration {
    configured(spec.state.prestage_timeout.as_deref()).unwrap_or(PRESTAGE)
}

/// The job's checkpoint timeout: spec.state.checkpointTimeout within its bounds, else
/// [`CHECKPOINT`].
pub fn checkpoint(spec: &crate::crd::StreamJobSpec) -> Duration {
    configured(spec.state.checkpoint_timeout.as_deref()).unwrap_or(CHECKPOINT)
}

/// The job's savepoint timeout: spec.state.savepointTimeout within its bounds, else
/// [`SAVEPOINT`].
pub fn savepoint(spec: &crate::crd::StreamJobSpec) -> Duration {
    configured(spec.state.savepoint_timeout.as_deref()).unwrap_or(SAVEPOINT)
}

/// How long starting a run may take, restores included: spec.state.restoreTimeout within
/// its bounds, else [`START`].
pub fn start(spec: &crate::crd::StreamJobSpec) -> Duration {
    configured_within(
        spec.state.restore_timeout.as_deref(),
        crate::validation::RESTORE_TIMEOUT_BOUNDS,
    )
    .unwrap_or(START)
}

fn configured(text: Option<&str>) -> Option<Duration> {
    configured_within(text, crate::validation::TIMEOUT_BOUNDS)
}

fn configured_within(
    text: Option<&str>,
    bounds: std::ops::RangeInclusive<Duration>,
) -> Option<Duration> {
    let d = keyshift_core::duration::parse_duration(text?)?;
    Some(d.clamp(*bounds.start(), *bounds.end()))
}
