//! What the snapshot controller does with a StreamJobSnapshot, decided without I/O: the next
//! step for one snapshot, the request the job's pass takes next, the snapshots a retention
//! policy retires, and the status a snapshot's manifest gives.

use crate::crd::{
    SnapshotPhase, SnapshotRetention, StreamJob, StreamJobSnapshot, StreamJobSnapshotStatus,
};
use crate::snapshot::Manifest;
use jiff::{SignedDuration, Timestamp};
use keyshift_core::duration::parse_duration;
use keyshift_core::reason::Reason;
use kube::ResourceExt;

/// The next step for one snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Read the snapshot at `url` (its manifest, then every file) and record it Ready:
    /// `taken` when the job took it for this resource, else spec.path recorded.
    Record { url: String, taken: bool },
    /// Ready: refresh whether the job still needs it, and apply the job's retention.
    Refresh { url: String },
    /// Waiting for the job (phase Pending); `wake` when the job's pass should look now.
    Wait { message: String, wake: bool },
    /// Failed for good: nothing more to do.
    Nothing,
}

/// The next step for `snap`, whose job is `job` (absent: none of that name exists).
pub fn next(snap: &StreamJobSnapshot, job: Option<&StreamJob>) -> Next {
    let status = snap.status.clone().unwrap_or_default();
    match (status.phase, status.path) {
        (Some(SnapshotPhase::Ready), Some(url)) => return Next::Refresh { url },
        (Some(SnapshotPhase::Failed), _) => return Next::Nothing,
        _ => {}
    }
    if let Some(url) = &snap.spec.path {
        return Next::Record {
            url: url.clone(),
            taken: false,
        };
    }
    let job_name = &snap.spec.job_name;
    let Some(job) = job else {
        return Next::Wait {
            message: format!(
                "waiting for the StreamJob {job_name}, which does not exist in this namespace, to take the savepoint"
            ),
            wake: false,
        };
    };
    let name = snap.name_any();
    let job_status = job.status.clone().unwrap_or_default();
    if let Some(taken) = job_status
        .last_savepoint
        .as_ref()
        .filter(|s| s.snapshot.as_deref() == Some(name.as_str()))
    {
        return Next::Record {
            url: taken.path.clone(),
            taken: true,
        };
    }
    let failure = job_status
        .conditions
        .iter()
        .find(|c| {
            c.reason == Reason::SavepointFailed.as_str()
                && c.message
                    .contains(&format!("StreamJobSnapshot {name} failed"))
        })
        .map(|c| c.message.clone());
    if let Some(failure) = failure {
        return Next::Wait {
            message: format!("the job's savepoint for it failed and is retried: {failure}"),
            wake: true,
        };
    }
    let phase = job_status
        .phase
        .map_or_else(|| "not started".to_owned(), |p| format!("{p:?}"));
    if job.spec.suspend || job_status.phase != Some(crate::crd::Phase::Running) {
        return Next::Wait {
            message: format!(
                "waiting for the StreamJob {job_name} to run (it is {phase}): a savepoint is taken of a running job"
            ),
            wake: true,
        };
    }
    Next::Wait {
        message: format!("waiting for the StreamJob {job_name} to take the savepoint"),
        wake: true,
    }
}

/// The snapshot the job's next pass takes a savepoint for: the oldest of the job's snapshots
/// that waits for one, once the one the job took last (status.lastSavepoint.snapshot) is
/// recorded Ready on its resource (so that no result is overwritten before it is recorded).
pub fn savepoint_request<'a>(
    job: &StreamJob,
    snapshots: impl IntoIterator<Item = &'a StreamJobSnapshot>,
) -> Option<String> {
    let job_name = job.name_any();
    let namespace = job.namespace();
    let last = job
        .status
        .as_ref()
        .and_then(|s| s.last_savepoint.as_ref())
        .and_then(|s| s.snapshot.clone());
    let mut waiting: Vec<&StreamJobSnapshot> = Vec::new();
    for s in snapshots {
        if s.spec.job_name != job_name || s.namespace() != namespace {
            continue;
        }
        let phase = s.status.as_ref().and_then(|st| st.phase);
        if last.as_deref() == Some(s.name_any().as_str()) {
            if phase != Some(SnapshotPhase::Ready) && phase != Some(SnapshotPhase::Failed) {
                // Taken, not yet recorded: the next request waits for it.
                return None;
            }
            continue;
        }
        if s.spec.path.is_none()
            && s.metadata.deletion_timestamp.is_none()
            && phase != Some(SnapshotPhase::Ready)
            && phase != Some(SnapshotPhase::Failed)
        {
            waiting.push(s);
        }
    }
    waiting
        .into_iter()
        .min_by_key(|s| (s.metadata.creation_timestamp.clone(), s.name_any()))
        .map(ResourceExt::name_any)
}

/// One Ready snapshot of a job, as retention sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kept {
    pub name: String,
    /// When the snapshot completed.
    pub time: Timestamp,
    /// The job still needs it.
    pub in_use: bool,
}

/// The snapshots `retention` deletes at `now`: beyond the newest `keep`, or older than
/// `maxAge` (the newest is kept whatever its age); never one in use. Newest first.
pub fn retire(kept: &[Kept], retention: &SnapshotRetention, now: Timestamp) -> Vec<String> {
    let mut by_age: Vec<&Kept> = kept.iter().collect();
    by_age.sort_by(|a, b| b.time.cmp(&a.time).then_with(|| a.name.cmp(&b.name)));
    let keep = retention
        .keep
        .and_then(|k| usize::try_from(k.max(1)).ok())
        .unwrap_or(usize::MAX);
    let max_age = retention
        .max_age
        .as_deref()
        .and_then(parse_duration)
        .and_then(|d| SignedDuration::try_from(d).ok());
    by_age
        .iter()
        .enumerate()
        .filter(|(i, k)| {
            let beyond = *i >= keep;
            let too_old = *i > 0 && max_age.is_some_and(|a| now.duration_since(k.time) > a);
            !k.in_use && (beyond || too_old)
        })
        .map(|(_, k)| k.name.clone())
        .collect()
}

/// Sets the snapshot's conditions for its phase (set first) in the kstatus convention, as a
/// StreamJob's: `Ready` True once Ready; `Reconciling` True while Pending; `Stalled` True once
/// Failed (a recorded path that is no snapshot cannot become Ready). Flux and `kubectl wait`
/// read them, and Argo CD through docs/gitops/streamjob-health.lua.
pub fn set_conditions(
    status: &mut StreamJobSnapshotStatus,
    reason: Reason,
    message: &str,
    generation: Option<i64>,
    now: Timestamp,
) {
    use crate::orchestrator::status::{READY, RECONCILING, STALLED, set_condition};
    for (kind, holds) in [
        (READY, SnapshotPhase::Ready),
        (RECONCILING, SnapshotPhase::Pending),
        (STALLED, SnapshotPhase::Failed),
    ] {
        let on = status.phase == Some(holds);
        let words = if on || kind == READY { message } else { "" };
        set_condition(
            &mut status.conditions,
            kind,
            on,
            reason.as_str(),
            words,
            generation,
            now,
        );
    }
    status.observed_generation = generation;
}

/// The Ready status of a snapshot read from its manifest (`verified`: every file checked out).
pub fn ready_status(url: &str, manifest: &Manifest, verified: bool) -> StreamJobSnapshotStatus {
    StreamJobSnapshotStatus {
        phase: Some(SnapshotPhase::Ready),
        path: Some(url.to_owned()),
        kind: Some(manifest.kind),
        id: i64::try_from(manifest.snapshot_id).ok(),
        time: Some(manifest.completed_at.to_string()),
        parallelism: i32::try_from(manifest.parallelism).ok(),
        max_parallelism: i32::try_from(manifest.max_parallelism).ok(),
        size_bytes: i64::try_from(manifest.stats.total_bytes).ok(),
        keys: i64::try_from(manifest.stats.total_keys).ok(),
        verified: Some(verified),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{Phase, SnapshotRef, StreamJobSnapshotSpec, StreamJobSpec, StreamJobStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn snap(name: &str, job: &str, created_secs: i64) -> StreamJobSnapshot {
        let mut s = StreamJobSnapshot::new(
            name,
            StreamJobSnapshotSpec {
                job_name: job.into(),
                path: None,
                deletion_policy: None,
            },
        );
        s.metadata.namespace = Some("ns".into());
        s.metadata.creation_timestamp = Some(Time(
            Timestamp::from_second(1_700_000_000 + created_secs).unwrap_or(Timestamp::UNIX_EPOCH),
        ));
        s
    }

    fn with_phase(mut s: StreamJobSnapshot, phase: SnapshotPhase) -> StreamJobSnapshot {
        s.status = Some(StreamJobSnapshotStatus {
            phase: Some(phase),
            path: Some(format!(
                "file:///s/ns/j/savepoints/sp-{}",
                s.name_any().len()
            )),
            ..Default::default()
        });
        s
    }

    fn job(phase: Option<Phase>, last_for: Option<&str>) -> StreamJob {
        let spec: StreamJobSpec = serde_yaml::from_str(
            "replicas: 2\njob:\n  source:\n    generator: {partitions: 2, keys: 10}\n  key: {field: key}\n  aggregation: {function: count}\n",
        )
        .unwrap_or_else(|e| panic!("spec: {e}"));
        let mut j = StreamJob::new("j", spec);
        j.metadata.namespace = Some("ns".into());
        j.status = Some(StreamJobStatus {
            phase,
            last_savepoint: last_for.map(|n| SnapshotRef {
                id: 3,
                path: "file:///s/ns/j/savepoints/sp-3".into(),
                snapshot: Some(n.into()),
                ..Default::default()
            }),
            ..Default::default()
        });
        j
    }

    #[test]
    fn a_new_snapshot_waits_for_its_job_then_records_what_the_job_took_for_it() {
        let s = snap("a", "j", 0);
        assert!(matches!(
            next(&s, None),
            Next::Wait { wake: false, ref message } if message.contains("does not exist")
        ));
        assert!(matches!(
            next(&s, Some(&job(Some(Phase::Suspended), None))),
            Next::Wait { wake: true, ref message } if message.contains("Suspended")
        ));
        assert!(matches!(
            next(&s, Some(&job(Some(Phase::Running), None))),
            Next::Wait { wake: true, .. }
        ));
        // Another snapshot's savepoint is not this one's.
        assert!(matches!(
            next(&s, Some(&job(Some(Phase::Running), Some("b")))),
            Next::Wait { .. }
        ));
        assert_eq!(
            next(&s, Some(&job(Some(Phase::Running), Some("a")))),
            Next::Record {
                url: "file:///s/ns/j/savepoints/sp-3".into(),
                taken: true
            }
        );
        let ready = with_phase(s.clone(), SnapshotPhase::Ready);
        assert!(matches!(next(&ready, None), Next::Refresh { .. }));
        let failed = with_phase(s, SnapshotPhase::Failed);
        assert_eq!(next(&failed, None), Next::Nothing);
    }

    #[test]
    fn a_recorded_path_is_read_whatever_the_job_does() {
        let mut s = snap("a", "gone", 0);
        s.spec.path = Some("s3://b/ns/j/savepoints/sp-1".into());
        assert_eq!(
            next(&s, None),
            Next::Record {
                url: "s3://b/ns/j/savepoints/sp-1".into(),
                taken: false
            }
        );
        assert_eq!(
            s.spec.effective_deletion_policy(),
            crate::crd::DeletionPolicy::Retain
        );
        s.spec.path = None;
        assert_eq!(
            s.spec.effective_deletion_policy(),
            crate::crd::DeletionPolicy::Delete
        );
    }

    #[test]
    fn requests_go_oldest_first_one_at_a_time() {
        let j = job(Some(Phase::Running), None);
        let older = snap("zz-older", "j", 0);
        let newer = snap("aa-newer", "j", 10);
        let other_job = snap("other", "k", -10);
        let mut recorded = snap("rec", "j", -20);
        recorded.spec.path = Some("file:///x/savepoints/sp-1".into());
        let ready = with_phase(snap("done", "j", -30), SnapshotPhase::Ready);
        let all = [&newer, &older, &other_job, &recorded, &ready];
        assert_eq!(
            savepoint_request(&j, all.iter().copied()),
            Some("zz-older".into())
        );
        // The job took one for zz-older, not yet recorded: the next waits.
        let j = job(Some(Phase::Running), Some("zz-older"));
        assert_eq!(savepoint_request(&j, all.iter().copied()), None);
        // Recorded Ready: the next one.
        let older = with_phase(older, SnapshotPhase::Ready);
        let all = [&newer, &older, &other_job, &recorded, &ready];
        assert_eq!(
            savepoint_request(&j, all.iter().copied()),
            Some("aa-newer".into())
        );
        // Being deleted: not taken.
        let mut deleting = newer.clone();
        deleting.metadata.deletion_timestamp = deleting.metadata.creation_timestamp.clone();
        assert_eq!(savepoint_request(&j, [&older, &deleting]), None);
    }

    fn kept(name: &str, age_h: i64, in_use: bool, now: Timestamp) -> Kept {
        Kept {
            name: name.into(),
            time: now - SignedDuration::from_hours(age_h),
            in_use,
        }
    }

    #[test]
    fn conditions_follow_the_phase_in_the_kstatus_convention() {
        let now = Timestamp::from_second(1_800_000_000).unwrap_or(Timestamp::UNIX_EPOCH);
        let of = |st: &StreamJobSnapshotStatus, kind: &str| {
            st.conditions
                .iter()
                .find(|c| c.type_ == kind)
                .map(|c| (c.status.clone(), c.reason.clone()))
        };
        let t = |r: Reason| Some(("True".to_owned(), r.as_str().to_owned()));
        let f = |r: Reason| Some(("False".to_owned(), r.as_str().to_owned()));
        let mut st = StreamJobSnapshotStatus {
            phase: Some(SnapshotPhase::Pending),
            ..Default::default()
        };
        set_conditions(&mut st, Reason::SnapshotPending, "waiting", Some(1), now);
        assert_eq!(of(&st, "Ready"), f(Reason::SnapshotPending));
        assert_eq!(of(&st, "Reconciling"), t(Reason::SnapshotPending));
        assert_eq!(of(&st, "Stalled"), f(Reason::SnapshotPending));
        assert_eq!(st.observed_generation, Some(1));
        st.phase = Some(SnapshotPhase::Ready);
        set_conditions(&mut st, Reason::SnapshotReady, "taken", Some(1), now);
        assert_eq!(of(&st, "Ready"), t(Reason::SnapshotReady));
        assert_eq!(of(&st, "Reconciling"), f(Reason::SnapshotReady));
        st.phase = Some(SnapshotPhase::Failed);
        set_conditions(
            &mut st,
            Reason::SnapshotUnusable,
            "no manifest",
            Some(2),
            now,
        );
        assert_eq!(of(&st, "Ready"), f(Reason::SnapshotUnusable));
        assert_eq!(of(&st, "Stalled"), t(Reason::SnapshotUnusable));
        assert_eq!(st.conditions.len(), 3);
    }

    #[test]
    fn retention_keeps_the_newest_and_never_one_in_use() {
        let now = Timestamp::from_second(1_800_000_000).unwrap_or(Timestamp::UNIX_EPOCH);
        let all = [
            kept("d", 30, false, now),
            kept("a", 1, false, now),
            kept("c", 20, true, now),
            kept("b", 10, false, now),
        ];
        let keep = |k| SnapshotRetention {
            keep: Some(k),
            max_age: None,
        };
        assert_eq!(retire(&all, &keep(2), now), ["d"], "c is in use");
        assert_eq!(retire(&all, &keep(1), now), ["b", "d"]);
        assert!(retire(&all, &keep(4), now).is_empty());
        assert!(retire(&all, &SnapshotRetention::default(), now).is_empty());
        let age = SnapshotRetention {
            keep: None,
            max_age: Some("15h".into()),
        };
        assert_eq!(retire(&all, &age, now), ["d"]);
        // The newest stays whatever its age.
        let old = [kept("x", 100, false, now), kept("y", 200, false, now)];
        assert_eq!(retire(&old, &age, now), ["y"]);
        // keep 0 (refused by validation) keeps one all the same.
        assert_eq!(retire(&old, &keep(0), now), ["y"]);
    }
}
