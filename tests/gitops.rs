//! GitOps health of a StreamJob, judged by the tools' own code: `hack/gitops-health` computes
//! kstatus (`sigs.k8s.io/cli-utils`, what Flux uses) and runs the Argo CD health check we ship
//! (`docs/gitops/streamjob-health.lua`, in gopher-lua as Argo CD runs it) on StreamJob documents
//! whose status is written by the operator's own status code (`orchestrator::status::finish`, the
//! one writer of phase and conditions), at each step of a job's life. The e2e counterpart on a
//! live cluster is `gitops_health_through_apply_scale_suspend_refused_restore_and_stall` in
//! tests/e2e_operator.rs.

mod support;

use k8s_openapi::jiff::Timestamp;
use keyshift::crd::{Phase, RescaleStatus, StreamJob, StreamJobSpec, StreamJobStatus};
use keyshift::orchestrator::pass::stalled_status;
use keyshift::orchestrator::reason::Reason;
use keyshift::orchestrator::status::{Progress, finish};
use keyshift::orchestrator::step::Step;
use support::*;

/// The sample job (config/samples/generator-count.yaml: 4 replicas, 128 key groups).
fn sample() -> StreamJob {
    let text = std::fs::read_to_string(root().join("config/samples/generator-count.yaml"))
        .expect("the sample manifest");
    let mut job: StreamJob = serde_yaml::from_str(&text).expect("a StreamJob");
    job.metadata.namespace = Some("gitops".into());
    job.metadata.uid = Some("0b6f3c1e-2d4a-4f7e-9a51-7c0d2e8f1a93".into());
    job
}

/// The status the API server fills in from the CRD's default before the operator wrote one.
fn crd_default_status() -> StreamJobStatus {
    let crd = keyshift::validation::crd();
    let default = crd
        .spec
        .versions
        .iter()
        .find_map(|v| {
            v.schema
                .as_ref()?
                .open_api_v3_schema
                .as_ref()?
                .properties
                .as_ref()?
                .get("status")?
                .default
                .clone()
        })
        .expect("the CRD defaults status");
    serde_json::from_value(default.0).expect("a StreamJobStatus")
}

/// The job at metadata.generation `generation` with `spec` and `status`, as the API server
/// returns it.
fn document(spec: &StreamJobSpec, generation: i64, status: Option<&StreamJobStatus>) -> String {
    let mut job = sample();
    job.spec = spec.clone();
    job.metadata.generation = Some(generation);
    job.status = status.cloned();
    serde_json::to_string(&job).expect("StreamJob JSON")
}

/// The status the operator's pass writes for `spec` at `generation` after `progress`.
fn pass(
    spec: &StreamJobSpec,
    generation: i64,
    status: &mut StreamJobStatus,
    progress: &Progress,
) -> GitopsHealth {
    let analysis = keyshift::validation::analyse(spec, Some(status)).ok();
    finish(
        spec,
        Some(generation),
        status,
        analysis.as_ref(),
        progress,
        Timestamp::now(),
    );
    gitops_health_of_json(&document(spec, generation, Some(status)))
}

fn expect(h: &GitopsHealth, kstatus: &str, argocd: &str, message: &str) {
    assert_gitops_health(h, "StreamJob", kstatus, argocd, message);
}

#[test]
fn health_through_start_rescale_suspend_and_resume() {
    let mut spec = sample().spec;
    // Applied, before the operator's first status write: the API server returns the CRD's
    // default status, which kstatus reads as a generation not observed yet.
    let h = gitops_health_of_json(&document(&spec, 1, Some(&crd_default_status())));
    expect(
        &h,
        "InProgress",
        "Progressing",
        "Waiting for the keyshift operator to report",
    );
    assert!(
        h.kstatus
            .1
            .contains("generation is 1, but latest observed generation is 0"),
        "{h:?}"
    );

    // The first pass pins the key groups and starts the workers: in progress.
    let mut st = StreamJobStatus {
        max_parallelism: Some(128),
        ..Default::default()
    };
    let starting = Progress {
        note: Some((
            "Starting".into(),
            "waiting for 4 worker pod(s) to start".into(),
        )),
        ..Default::default()
    };
    let h = pass(&spec, 1, &mut st, &starting);
    expect(
        &h,
        "InProgress",
        "Progressing",
        "waiting for 4 worker pod(s)",
    );
    assert!(h.kstatus.1.contains("waiting for 4 worker pod(s)"), "{h:?}");

    // Running at the requested parallelism.
    st.replicas = Some(4);
    let running = Progress {
        phase: Some(Phase::Running),
        ..Default::default()
    };
    let h = pass(&spec, 1, &mut st, &running);
    expect(&h, "Current", "Healthy", "running at parallelism 4");

    // `kubectl scale --replicas=8`: generation 2, which the operator has not seen yet.
    spec.replicas = 8;
    let h = gitops_health_of_json(&document(&spec, 2, Some(&st)));
    expect(&h, "InProgress", "Progressing", "generation 2");
    assert!(
        h.kstatus
            .1
            .contains("generation is 2, but latest observed generation is 1"),
        "{h:?}"
    );

    // The rescale, step by step.
    for step in [
        Step::Savepointing,
        Step::Verifying,
        Step::Stopping,
        Step::Restoring,
    ] {
        st.rescale = Some(RescaleStatus {
            from: 4,
            to: 8,
            step,
            ..Default::default()
        });
        let h = pass(&spec, 2, &mut st, &Progress::default());
        expect(
            &h,
            "InProgress",
            "Progressing",
            &format!("rescaling 4 -> 8: step {step}"),
        );
    }
    // Done: running at 8.
    if let Some(r) = st.rescale.as_mut() {
        r.step = Step::Done;
    }
    st.replicas = Some(8);
    let h = pass(&spec, 2, &mut st, &running);
    expect(&h, "Current", "Healthy", "running at parallelism 8");

    // A rescale whose restore failed rolled back and is retried: still in progress (the
    // operator keeps trying; kstatus has no state between InProgress and Failed).
    spec.replicas = 6;
    if let Some(r) = st.rescale.as_mut() {
        (r.from, r.to, r.step) = (8, 6, Step::RolledBack);
    }
    let retrying = Progress {
        failure: Some((
            "RestoreFailed".into(),
            "restoring at parallelism 6 failed: worker 2 exited".into(),
        )),
        ..Default::default()
    };
    let h = pass(&spec, 3, &mut st, &retrying);
    expect(&h, "InProgress", "Progressing", "worker 2 exited");
    spec.replicas = 8;

    // Suspend: the savepoint and the workers' removal are in progress, then it is suspended.
    spec.suspend = true;
    st.rescale = Some(RescaleStatus {
        from: 8,
        to: 0,
        step: Step::Savepointing,
        ..Default::default()
    });
    let h = pass(&spec, 4, &mut st, &Progress::default());
    expect(&h, "InProgress", "Progressing", "suspending 8 -> 0");
    if let Some(r) = st.rescale.as_mut() {
        r.step = Step::Done;
    }
    st.replicas = Some(0);
    let suspended = Progress {
        phase: Some(Phase::Suspended),
        ..Default::default()
    };
    let h = pass(&spec, 4, &mut st, &suspended);
    expect(&h, "Current", "Suspended", "suspended with a savepoint");

    // Resumed.
    spec.suspend = false;
    let h = pass(&spec, 5, &mut st, &starting);
    expect(&h, "InProgress", "Progressing", "Starting");
    st.replicas = Some(8);
    let h = pass(&spec, 5, &mut st, &running);
    expect(&h, "Current", "Healthy", "running at parallelism 8");
}

#[test]
fn a_refused_restore_and_a_spec_that_cannot_run_are_failed_and_degraded() {
    let spec = sample().spec;
    let mut st = StreamJobStatus {
        max_parallelism: Some(128),
        replicas: Some(4),
        ..Default::default()
    };
    let running = Progress {
        phase: Some(Phase::Running),
        ..Default::default()
    };
    assert_eq!(pass(&spec, 1, &mut st, &running).kstatus.0, "Current");

    // spec.restoreFrom names a snapshot that cannot be read: refused, nothing stopped.
    let mut restore = spec.clone();
    restore.restore_from = Some("s3://bucket/gitops/clicks/savepoints/sp-404".into());
    let st2 = stalled_status(
        &restore,
        Some(2),
        &st,
        Reason::RestoreFromUnusable,
        "no snapshot at s3://bucket/gitops/clicks/savepoints/sp-404; nothing was stopped",
    );
    let h = gitops_health_of_json(&document(&restore, 2, Some(&st2)));
    expect(
        &h,
        "Failed",
        "Degraded",
        "RestoreFromUnusable: no snapshot at",
    );
    assert!(h.kstatus.1.contains("nothing was stopped"), "{h:?}");

    // More replicas than key groups: Stalled until the spec is fixed.
    let mut wide = spec.clone();
    wide.replicas = 200;
    let stall = Progress {
        stalled: Some((
            "AboveKeyGroupCeiling".into(),
            "parallelism 200 exceeds the key-group ceiling (max parallelism) 128".into(),
        )),
        ..Default::default()
    };
    let h = pass(&wide, 3, &mut st, &stall);
    expect(
        &h,
        "Failed",
        "Degraded",
        "AboveKeyGroupCeiling: parallelism 200",
    );

    // Fixed: back to 4, running again.
    let h = pass(&spec, 4, &mut st, &running);
    expect(&h, "Current", "Healthy", "running at parallelism 4");

    // A job that never ran and cannot (no storage): Failed phase, Failed in kstatus.
    let st3 = stalled_status(
        &spec,
        Some(1),
        &StreamJobStatus::default(),
        Reason::NoStorage,
        "no spec.state.storage and the operator has no --default-storage",
    );
    assert_eq!(st3.phase, Some(Phase::Failed));
    let h = gitops_health_of_json(&document(&spec, 1, Some(&st3)));
    expect(&h, "Failed", "Degraded", "NoStorage");
}

/// The argocd-cm snippet in docs/gitops.md carries the shipped script verbatim.
#[test]
fn the_docs_argocd_cm_snippet_is_the_shipped_script() {
    let doc = std::fs::read_to_string(root().join("docs/gitops.md")).expect("docs/gitops.md");
    let script =
        std::fs::read_to_string(argocd_health_script()).expect("docs/gitops/streamjob-health.lua");
    let key = "resource.customizations.health.keyshift.dev_StreamJob: |";
    let start = doc
        .find(key)
        .unwrap_or_else(|| panic!("docs/gitops.md has no `{key}`"));
    let embedded: String = doc[start + key.len()..]
        .lines()
        .skip(1)
        .take_while(|l| !l.starts_with("```"))
        .map(|l| format!("{}\n", l.strip_prefix("    ").unwrap_or(l)))
        .collect();
    assert_eq!(
        embedded.trim_end(),
        script.trim_end(),
        "docs/gitops.md's argocd-cm snippet differs from docs/gitops/streamjob-health.lua"
    );
}

/// A StreamJobSnapshot's health by the same tools, its conditions set by the snapshot
/// controller's own code (`operator::snapshot::set_conditions`) and Argo CD running the same
/// check as for a StreamJob: in progress as created (the CRD's default status) and while it
/// waits for its job, current once Ready, failed when it cannot become Ready.
#[test]
fn a_snapshot_is_in_progress_until_ready_and_failed_when_it_cannot_be() {
    use keyshift::crd::{SnapshotPhase, StreamJobSnapshot, StreamJobSnapshotStatus};
    use keyshift::operator::snapshot::set_conditions;
    let crd = keyshift::validation::snapshot_crd();
    let default = crd.spec.versions[0]
        .schema
        .as_ref()
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .and_then(|s| s.properties.as_ref()?.get("status")?.default.clone())
        .expect("the CRD defaults status");
    let mut snap: StreamJobSnapshot = serde_yaml::from_str(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJobSnapshot
metadata: {name: before-upgrade, namespace: gitops, generation: 1}
spec: {jobName: clicks}
",
    )
    .expect("a StreamJobSnapshot");
    let health = |snap: &StreamJobSnapshot| {
        gitops_health_of_json(&serde_json::to_string(snap).expect("JSON"))
    };
    let expect = |h: &GitopsHealth, kstatus: &str, argocd: &str, message: &str| {
        assert_gitops_health(h, "StreamJobSnapshot", kstatus, argocd, message);
    };
    snap.status = Some(serde_json::from_value(default.0).expect("a status"));
    expect(
        &health(&snap),
        "InProgress",
        "Progressing",
        "Waiting for the keyshift operator",
    );
    let now = Timestamp::now();
    let mut status = StreamJobSnapshotStatus {
        phase: Some(SnapshotPhase::Pending),
        ..Default::default()
    };
    let waiting = "waiting for the StreamJob clicks to take the savepoint";
    set_conditions(&mut status, Reason::SnapshotPending, waiting, Some(1), now);
    snap.status = Some(status.clone());
    expect(&health(&snap), "InProgress", "Progressing", waiting);
    status.phase = Some(SnapshotPhase::Ready);
    let taken = "savepoint taken by StreamJob clicks";
    set_conditions(&mut status, Reason::SnapshotReady, taken, Some(1), now);
    snap.status = Some(status.clone());
    expect(&health(&snap), "Current", "Healthy", taken);
    status.phase = Some(SnapshotPhase::Failed);
    let unusable = "s3://b/ns/clicks/savepoints/sp-9 cannot be restored";
    set_conditions(
        &mut status,
        Reason::SnapshotUnusable,
        unusable,
        Some(1),
        now,
    );
    snap.status = Some(status);
    expect(&health(&snap), "Failed", "Degraded", unusable);
}
