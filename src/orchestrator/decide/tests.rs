use super::*;
use crate::crd::{RescaleStatus, StreamJob};
use crate::orchestrator::settings::spec_hash;

/// A job that rescales by stop-and-restore (the pre-staged steps have tests of their own).
fn spec(replicas: i32) -> StreamJobSpec {
    let mut j = crate::fixtures::job();
    j.spec.replicas = replicas;
    j.spec.rescale_strategy = RescaleStrategy::StopAndRestore;
    j.spec
}

fn status() -> StreamJobStatus {
    StreamJobStatus {
        max_parallelism: Some(128),
        ..Default::default()
    }
}

fn now() -> Timestamp {
    Timestamp::from_second(1_000_000).unwrap()
}

fn obs(pods: Vec<ObservedPod>, active: Option<(&str, u32)>) -> Observed {
    Observed {
        now: now(),
        pods,
        active: active.map(|(r, p)| ActiveRun {
            run: r.into(),
            parallelism: p,
        }),
        last_snapshot_at: Some(now()),
        backoff_until: None,
        change_retry_at: None,
        new_run: "new".into(),
        name: "clicks".into(),
        pending_restore: None,
        upgrade_refused: None,
        start_refused: None,
        savepoint_request: None,
    }
}

fn pods(run: &str, p: u32, phase: PodPhase, worker: Option<WorkerState>) -> Vec<ObservedPod> {
    (0..p)
        .map(|i| ObservedPod {
            name: format!("j-{run}-{i}"),
            run: run.into(),
            subtask: i,
            parallelism: p,
            phase,
            ip: (phase == PodPhase::Running).then(|| format!("10.0.0.{i}")),
            deleting: false,
            grace_deadline: None,
            worker,
            spec_hash: None,
            unschedulable: None,
        })
        .collect()
}

fn rescaling(step: Step, savepoint: Option<&str>) -> StreamJobStatus {
    StreamJobStatus {
        rescale: Some(RescaleStatus {
            from: 4,
            to: 8,
            step,
            started: "t".into(),
            savepoint: savepoint.map(str::to_owned),
            ..Default::default()
        }),
        ..status()
    }
}

#[test]
fn new_job_pins_then_creates_pods_then_waits_then_starts() {
    let s = spec(4);
    let a = decide(&s, &StreamJobStatus::default(), &obs(vec![], None));
    assert_eq!(
        a,
        Action::PinMaxParallelism {
            groups: 128,
            origin: "set by spec.maxParallelism".into()
        }
    );
    let a = decide(&s, &status(), &obs(vec![], None));
    assert_eq!(
        a,
        Action::CreatePods {
            run: "new".into(),
            parallelism: 4,
            subtasks: vec![0, 1, 2, 3]
        }
    );
    let mut some = pods("r", 4, PodPhase::Pending, None);
    some.remove(1);
    let a = decide(&s, &status(), &obs(some, None));
    assert_eq!(
        a,
        Action::CreatePods {
            run: "r".into(),
            parallelism: 4,
            subtasks: vec![1]
        }
    );
    let a = decide(
        &s,
        &status(),
        &obs(pods("r", 4, PodPhase::Pending, None), None),
    );
    assert!(matches!(a, Action::Wait { .. }), "{a:?}");
    let a = decide(
        &s,
        &status(),
        &obs(
            pods("r", 4, PodPhase::Running, Some(WorkerState::Idle)),
            None,
        ),
    );
    assert_eq!(
        a,
        Action::Start {
            run: "r".into(),
            parallelism: 4,
            restore: Restore::Latest
        }
    );
}

#[test]
fn after_a_rolled_back_rescale_a_recovery_brings_the_job_up_at_the_old_parallelism() {
    let s = spec(8);
    let mut st = rescaling(Step::RolledBack, Some("sp-3"));
    st.replicas = Some(4);
    if let Some(r) = st.rescale.as_mut() {
        r.rolled_back = Some("restore failed".into());
    }
    let a = decide(&s, &st, &obs(vec![], None));
    assert_eq!(
        a,
        Action::CreatePods {
            run: "new".into(),
            parallelism: 4,
            subtasks: vec![0, 1, 2, 3]
        }
    );
    assert_eq!(recovery_parallelism(&st, 8, false), 4);
    // Another parallelism asked for since, a pending restoreFrom, a rescale that succeeded,
    // or a job that no longer ran at the old parallelism: the desired one.
    assert_eq!(recovery_parallelism(&st, 6, false), 6);
    assert_eq!(recovery_parallelism(&st, 8, true), 8);
    let mut done = st.clone();
    if let Some(r) = done.rescale.as_mut() {
        r.step = Step::Done;
    }
    assert_eq!(recovery_parallelism(&done, 8, false), 8);
    let mut moved = st.clone();
    moved.replicas = Some(8);
    assert_eq!(recovery_parallelism(&moved, 8, false), 8);
}

#[test]
fn default_ceiling_is_pinned_from_replicas() {
    let mut s = spec(200);
    s.max_parallelism = None;
    let a = decide(&s, &StreamJobStatus::default(), &obs(vec![], None));
    assert_eq!(
        a,
        Action::PinMaxParallelism {
            groups: 512,
            origin: "Flink's default for the 200 replicas the job first ran with, as spec.maxParallelism was not set".into()
        }
    );
}

#[test]
fn running_job_checkpoints_when_due_and_idles_otherwise() {
    let s = spec(4);
    let running = pods("r", 4, PodPhase::Running, Some(WorkerState::Running));
    let mut o = obs(running, Some(("r", 4)));
    let a = decide(&s, &status(), &o);
    assert!(matches!(a, Action::Idle { requeue } if requeue <= Duration::from_secs(30)));
    o.last_snapshot_at = Some(now() - jiff::SignedDuration::from_secs(31));
    assert_eq!(decide(&s, &status(), &o), Action::Checkpoint);
}

#[test]
fn a_snapshot_time_from_a_clock_ahead_of_ours_does_not_hold_checkpoints_back() {
    let s = spec(4);
    let running = pods("r", 4, PodPhase::Running, Some(WorkerState::Running));
    let mut st = status();
    st.last_checkpoint = Some(crate::crd::SnapshotRef {
        id: 7,
        path: "file:///s/chk-7".into(),
        // A previous leader's clock, an hour ahead.
        time: (now() + jiff::SignedDuration::from_hours(1)).to_string(),
        parallelism: 4,
        size_bytes: None,
        source_partitions: None,
        snapshot: None,
    });
    let started = now() - jiff::SignedDuration::from_secs(40);
    let mut o = obs(running, Some(("r", 4)));
    o.last_snapshot_at = last_snapshot_at(&st, Some(started), now());
    assert_eq!(o.last_snapshot_at, Some(started));
    assert_eq!(decide(&s, &st, &o), Action::Checkpoint);
    // A time in the past is used as it is.
    let recent = now() - jiff::SignedDuration::from_secs(5);
    if let Some(c) = st.last_checkpoint.as_mut() {
        c.time = recent.to_string();
    }
    o.last_snapshot_at = last_snapshot_at(&st, Some(started), now());
    assert_eq!(o.last_snapshot_at, Some(recent));
    assert!(matches!(decide(&s, &st, &o), Action::Idle { .. }));
}

#[test]
fn operator_restart_adopts_running_workers() {
    let s = spec(4);
    let a = decide(
        &s,
        &status(),
        &obs(
            pods("r", 4, PodPhase::Running, Some(WorkerState::Running)),
            None,
        ),
    );
    assert_eq!(
        a,
        Action::Adopt {
            run: "r".into(),
            parallelism: 4
        }
    );
}

#[test]
fn a_scale_begins_a_rescale_and_each_step_follows_from_status() {
    let running = pods("r", 4, PodPhase::Running, Some(WorkerState::Running));
    let a = decide(&spec(8), &status(), &obs(running.clone(), Some(("r", 4))));
    assert_eq!(
        a,
        Action::BeginRescale {
            from: 4,
            to: 8,
            prestage: None
        }
    );

    let st = rescaling(Step::Savepointing, None);
    assert_eq!(
        decide(&spec(8), &st, &obs(running.clone(), Some(("r", 4)))),
        Action::Savepoint
    );
    // Operator restarted while savepointing: adopt the old workers (possibly stopped).
    let stopped = pods("r", 4, PodPhase::Running, Some(WorkerState::Stopped));
    assert_eq!(
        decide(&spec(8), &st, &obs(stopped, None)),
        Action::Adopt {
            run: "r".into(),
            parallelism: 4
        }
    );

    let st = rescaling(Step::Verifying, Some("file:///s/sp-3"));
    assert_eq!(
        decide(&spec(8), &st, &obs(running.clone(), None)),
        Action::Verify {
            url: "file:///s/sp-3".into()
        }
    );

    let st = rescaling(Step::Stopping, Some("file:///s/sp-3"));
    assert_eq!(
        decide(&spec(8), &st, &obs(running.clone(), None)),
        Action::DeletePods {
            reason: Reason::Stopping
        }
    );
    let mut going = running.clone();
    for (i, p) in going.iter_mut().enumerate() {
        p.deleting = true;
        // Grace periods ending 20 s ago (pod 0) to 5 s from now (pod 3).
        p.grace_deadline = Some(now() - jiff::SignedDuration::from_secs(20 - 8 * i as i64));
    }
    let Action::Wait { reason } = decide(&spec(8), &st, &obs(going.clone(), None)) else {
        panic!("terminating pods are waited for");
    };
    assert_eq!(reason, "waiting for 4 old pod(s) to terminate");
    // A pod 45 s past its grace period (its node is gone, say) is named, with the way out.
    going[2].grace_deadline = Some(now() - jiff::SignedDuration::from_secs(45));
    let Action::Wait { reason } = decide(&spec(8), &st, &obs(going, None)) else {
        panic!("terminating pods are waited for");
    };
    assert!(
        reason.starts_with("waiting for 4 old pod(s) to terminate; pod j-r-2 is 45s past"),
        "{reason}"
    );
    assert!(
        reason.contains("kubectl delete pod j-r-2 --grace-period=0 --force"),
        "{reason}"
    );
    assert_eq!(
        decide(&spec(8), &st, &obs(vec![], None)),
        Action::Advance(Outcome::Stopped)
    );

    let st = rescaling(Step::Restoring, Some("file:///s/sp-3"));
    assert_eq!(
        decide(&spec(8), &st, &obs(vec![], None)),
        Action::CreatePods {
            run: "new".into(),
            parallelism: 8,
            subtasks: (0..8).collect()
        }
    );
    assert_eq!(
        decide(
            &spec(8),
            &st,
            &obs(
                pods("n", 8, PodPhase::Running, Some(WorkerState::Idle)),
                None
            )
        ),
        Action::Start {
            run: "n".into(),
            parallelism: 8,
            restore: Restore::Url("file:///s/sp-3".into())
        }
    );
    // Started, but the operator died before recording Done: adopt, then finish.
    let up = pods("n", 8, PodPhase::Running, Some(WorkerState::Running));
    assert_eq!(
        decide(&spec(8), &st, &obs(up.clone(), None)),
        Action::Adopt {
            run: "n".into(),
            parallelism: 8
        }
    );
    assert_eq!(
        decide(&spec(8), &st, &obs(up, Some(("n", 8)))),
        Action::FinishRescale
    );
}

#[test]
fn a_failed_worker_restarts_the_run_and_backoff_delays_it() {
    let s = spec(4);
    let mut running = pods("r", 4, PodPhase::Running, Some(WorkerState::Running));
    running[2].phase = PodPhase::Exited;
    let a = decide(&s, &status(), &obs(running, Some(("r", 4))));
    assert!(matches!(a, Action::Recover { .. }), "{a:?}");
    let mut o = obs(vec![], None);
    o.backoff_until = Some(now() + jiff::SignedDuration::from_secs(4));
    assert!(matches!(decide(&s, &status(), &o), Action::Idle { .. }));
    // Stopped pods of a broken run are removed before a new run is created.
    let mut broken = pods("r", 4, PodPhase::Running, Some(WorkerState::Idle));
    broken[0].phase = PodPhase::Exited;
    assert!(matches!(
        decide(&s, &status(), &obs(broken, None)),
        Action::DeletePods { .. }
    ));
}

#[test]
fn a_start_refused_for_good_stalls_instead_of_starting_again() {
    let s = spec(4);
    let refusal = StartRefusal {
        reason: Reason::StartRefused,
        message: "worker 0 refused: spec.job.program.name \"nope\"".to_owned(),
        parallelism: None,
    };
    // Without the refusal, a job with no run brings workers up; with it, it stalls and starts
    // nothing, backoff or not, and also in the middle of a rescale whose new run was refused.
    let fresh = decide(&s, &status(), &obs(vec![], None));
    assert!(!matches!(fresh, Action::Stall { .. }), "{fresh:?}");
    let mut o = obs(vec![], None);
    o.start_refused = Some(refusal.clone());
    let stalled = Action::Stall {
        reason: refusal.reason,
        message: refusal.message.clone(),
    };
    assert_eq!(decide(&s, &status(), &o), stalled);
    let mut rescaling = status();
    rescaling.rescale = Some(RescaleStatus {
        from: 2,
        to: 4,
        step: Step::Restoring,
        ..Default::default()
    });
    assert_eq!(decide(&s, &rescaling, &o), stalled);
    // A run that is up (adopted, say) is left to run: the refusal was of a start.
    let running = pods("r", 4, PodPhase::Running, Some(WorkerState::Running));
    let mut up = obs(running, Some(("r", 4)));
    up.start_refused = Some(refusal);
    let a = decide(&s, &status(), &up);
    assert!(!matches!(a, Action::Stall { .. }), "{a:?}");
}

#[test]
fn a_rescale_refused_for_good_is_not_begun_again_and_the_old_parallelism_still_recovers() {
    // Spec 4; the rescale 2 -> 4 rolled back (its new run refused the state for good).
    let s = spec(4);
    let mut rolled_back = status();
    rolled_back.replicas = Some(2);
    rolled_back.rescale = Some(RescaleStatus {
        from: 2,
        to: 4,
        step: Step::RolledBack,
        rolled_back: Some("refused".into()),
        ..Default::default()
    });
    let refusal = StartRefusal {
        reason: Reason::StartRefused,
        message: "operator state \"totals\" declares no redistribution".to_owned(),
        parallelism: Some(4),
    };
    // Running at 2: without the refusal the rescale begins again; with it, it does not, and
    // the job goes on (a checkpoint is due).
    let running = pods("r", 2, PodPhase::Running, Some(WorkerState::Running));
    let mut up = obs(running.clone(), Some(("r", 2)));
    assert!(matches!(
        decide(&s, &rolled_back, &up),
        Action::BeginRescale { from: 2, to: 4, .. }
    ));
    up.start_refused = Some(refusal.clone());
    let a = decide(&s, &rolled_back, &up);
    assert!(
        !matches!(a, Action::BeginRescale { .. } | Action::Stall { .. }),
        "{a:?}"
    );
    // The old run lost: it is brought back at 2, not stalled.
    let mut down = obs(vec![], None);
    down.start_refused = Some(refusal.clone());
    let a = decide(&s, &rolled_back, &down);
    assert!(!matches!(a, Action::Stall { .. }), "{a:?}");
    // A refusal of the parallelism it would start at stalls.
    down.start_refused = Some(StartRefusal {
        parallelism: Some(2),
        ..refusal
    });
    assert!(matches!(
        decide(&s, &rolled_back, &down),
        Action::Stall { .. }
    ));
}

#[test]
fn a_new_process_adopts_the_run_a_refused_change_left_running() {
    // Spec 4; the pre-staged rescale 2 -> 4 was abandoned (its new workers refused the state)
    // and the old run goes on. A new operator process reads the refusal from status: it
    // coordinates the running workers again rather than stalling with them uncoordinated,
    // and begins no rescale.
    let s = spec(4);
    let mut abandoned = status();
    abandoned.replicas = Some(2);
    abandoned.rescale = Some(RescaleStatus {
        from: 2,
        to: 4,
        step: Step::Abandoned,
        ..Default::default()
    });
    let mut o = obs(
        pods("r", 2, PodPhase::Running, Some(WorkerState::Running)),
        None,
    );
    o.start_refused = Some(StartRefusal {
        reason: Reason::StartRefused,
        message: "operator state \"totals\" declares no redistribution".to_owned(),
        parallelism: Some(4),
    });
    assert_eq!(
        decide(&s, &abandoned, &o),
        Action::Adopt {
            run: "r".into(),
            parallelism: 2
        }
    );
    // Workers at the refused parallelism are not adopted into a refused start: they go, and
    // the job comes back at the parallelism it ran at.
    o.pods = pods("n", 4, PodPhase::Running, Some(WorkerState::Running));
    let a = decide(&s, &abandoned, &o);
    assert!(
        matches!(a, Action::DeletePods { .. } | Action::DeleteRun { .. }),
        "{a:?}"
    );
    // The run ended since: it comes back at the parallelism it ran at, from its newest
    // snapshot (and is then Stalled on the change as before).
    o.pods.clear();
    assert_eq!(
        decide(&s, &abandoned, &o),
        Action::CreatePods {
            run: o.new_run.clone(),
            parallelism: 2,
            subtasks: vec![0, 1],
        }
    );
    // An upgrade refused at the parallelism the job ran at: nothing to come back at; the
    // stall no longer says the job runs on.
    let s = spec(2);
    abandoned.rescale = Some(RescaleStatus {
        from: 2,
        to: 2,
        step: Step::Abandoned,
        upgrade_mode: Some(UpgradeMode::Savepoint),
        ..Default::default()
    });
    o.start_refused = o.start_refused.take().map(|r| StartRefusal {
        parallelism: Some(2),
        ..r
    });
    match decide(&s, &abandoned, &o) {
        Action::Stall { message, .. } => {
            assert!(message.contains("has ended since"), "{message}");
            assert!(!message.contains("runs on"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn above_the_pinned_ceiling_stalls_without_touching_workers() {
    let s = spec(200);
    let st = StreamJobStatus {
        max_parallelism: Some(128),
        ..Default::default()
    };
    let running = pods("r", 24, PodPhase::Running, Some(WorkerState::Running));
    match decide(&s, &st, &obs(running, Some(("r", 24)))) {
        Action::Stall { reason, message } => {
            assert_eq!(reason, Reason::AboveKeyGroupCeiling);
            assert!(
                message.starts_with("spec.replicas 200 exceeds 128, the key-group ceiling"),
                "{message}"
            );
            assert!(message.contains("nothing was changed"), "{message}");
            // The one edit that raises it: 4x200 -> 1024 groups with the replicas.
            assert!(
                message.contains(
                    "kubectl patch streamjob clicks --type merge -p '{\"spec\":{\"maxParallelism\":1024,\"replicas\":200}}'"
                ),
                "{message}"
            );
            assert!(
                message.contains("the original savepoint is kept"),
                "{message}"
            );
            assert!(!message.contains("Note:"), "no state size known: {message}");
        }
        a => panic!("{a:?}"),
    }
    // With the state's size known, tiny groups are warned about.
    let st = StreamJobStatus {
        max_parallelism: Some(128),
        max_parallelism_origin: Some("set by spec.maxParallelism".into()),
        last_checkpoint: Some(crate::crd::SnapshotRef {
            size_bytes: Some(1 << 20),
            ..Default::default()
        }),
        ..Default::default()
    };
    let (reason, message) = check_spec("clicks", &s, &st).unwrap_err();
    assert_eq!(reason, Reason::AboveKeyGroupCeiling);
    assert!(
        message.contains("(status.maxParallelism: set by spec.maxParallelism)"),
        "{message}"
    );
    assert!(
        message.contains("Note: 1024 key groups over 1048576 bytes of state make tiny groups"),
        "{message}"
    );
    // The derived default ceiling (no spec.maxParallelism) is reported with its origin.
    let mut s = spec(200);
    s.max_parallelism = None;
    let st = StreamJobStatus::default();
    let a = check_spec("clicks", &s, &st);
    assert!(a.is_ok(), "default ceiling follows replicas: {a:?}");
}

fn pending(url: &str, groups: u32) -> Option<Result<PendingRestore, (Reason, String)>> {
    Some(Ok(PendingRestore {
        url: url.into(),
        max_parallelism: groups,
    }))
}

#[test]
fn a_new_restore_from_on_a_running_job_savepoints_then_restores_it() {
    // The 24 -> 200 path: the job runs at 24 under 128 groups; the spec now names a savepoint
    // rewritten to 1024 groups, with maxParallelism 1024 and replicas 200.
    let mut s = spec(200);
    s.max_parallelism = Some(1024);
    s.restore_from = Some("file:///x/sp-3-mp1024".into());
    let running = pods("r", 24, PodPhase::Running, Some(WorkerState::Running));
    let mut o = obs(running, Some(("r", 24)));
    o.pending_restore = pending("file:///x/sp-3-mp1024", 1024);
    assert_eq!(
        decide(&s, &status(), &o),
        Action::BeginRestore {
            from: 24,
            to: 200,
            url: "file:///x/sp-3-mp1024".into(),
            max_parallelism: 1024
        }
    );
    // Its Restoring step restores the named snapshot, not the savepoint it took.
    let mut st = rescaling(Step::Restoring, Some("file:///x/sp-4"));
    if let Some(r) = st.rescale.as_mut() {
        r.from = 24;
        r.to = 200;
        r.restore_from = Some("file:///x/sp-3-mp1024".into());
        r.max_parallelism = Some(1024);
    }
    let idle = pods("n", 200, PodPhase::Running, Some(WorkerState::Idle));
    assert_eq!(
        decide(&s, &st, &obs(idle.clone(), None)),
        Action::Start {
            run: "n".into(),
            parallelism: 200,
            restore: Restore::Url("file:///x/sp-3-mp1024".into())
        }
    );
    // Rolled back: the old parallelism comes back from the job's own savepoint.
    if let Some(r) = st.rescale.as_mut() {
        r.rolled_back = Some("failed".into());
    }
    let old = pods("n", 24, PodPhase::Running, Some(WorkerState::Idle));
    assert_eq!(
        decide(&s, &st, &obs(old, None)),
        Action::Start {
            run: "n".into(),
            parallelism: 24,
            restore: Restore::Url("file:///x/sp-4".into())
        }
    );
}

#[test]
fn a_suspended_job_resumes_from_a_new_restore_from() {
    let mut s = spec(200);
    s.max_parallelism = Some(1024);
    s.restore_from = Some("file:///x/sp-3-mp1024".into());
    let st = StreamJobStatus {
        phase: Some(crate::crd::Phase::Suspended),
        replicas: Some(0),
        ..status()
    };
    let mut o = obs(
        pods("n", 200, PodPhase::Running, Some(WorkerState::Idle)),
        None,
    );
    o.pending_restore = pending("file:///x/sp-3-mp1024", 1024);
    assert_eq!(
        decide(&s, &st, &o),
        Action::Start {
            run: "n".into(),
            parallelism: 200,
            restore: Restore::Url("file:///x/sp-3-mp1024".into())
        }
    );
    // Without the pending restore (already used) the same spec resumes its own state.
    let st = StreamJobStatus {
        max_parallelism: Some(1024),
        ..st
    };
    let o = obs(
        pods("n", 200, PodPhase::Running, Some(WorkerState::Idle)),
        None,
    );
    assert_eq!(
        decide(&s, &st, &o),
        Action::Start {
            run: "n".into(),
            parallelism: 200,
            restore: Restore::Latest
        }
    );
}

#[test]
fn an_unusable_restore_from_stalls_and_stops_nothing() {
    let mut s = spec(200);
    s.max_parallelism = Some(512);
    s.restore_from = Some("file:///x/sp-3-mp1024".into());
    let running = pods("r", 24, PodPhase::Running, Some(WorkerState::Running));
    let mut o = obs(running, Some(("r", 24)));
    o.pending_restore = pending("file:///x/sp-3-mp1024", 1024);
    match decide(&s, &status(), &o) {
        Action::Stall { reason, message } => {
            assert_eq!(reason, Reason::RestoreFromKeyGroupMismatch);
            assert!(message.contains("has 1024 key groups"), "{message}");
            assert!(
                message.contains("set spec.maxParallelism to 1024"),
                "{message}"
            );
        }
        a => panic!("{a:?}"),
    }
    o.pending_restore = Some(Err((Reason::RestoreFromUnusable, "cannot read it".into())));
    assert_eq!(
        decide(&s, &status(), &o),
        Action::Stall {
            reason: Reason::RestoreFromUnusable,
            message: "cannot read it".into()
        }
    );
    // A new job pins the snapshot's count, not Flink's default for its replicas.
    let mut s = spec(200);
    s.max_parallelism = None;
    s.restore_from = Some("file:///x/sp-3-mp1024".into());
    let mut o = obs(vec![], None);
    o.pending_restore = pending("file:///x/sp-3-mp1024", 1024);
    assert!(matches!(
        decide(&s, &StreamJobStatus::default(), &o),
        Action::PinMaxParallelism { groups: 1024, .. }
    ));
}

#[test]
fn a_job_created_suspended_is_suspended_and_ready() {
    let mut s = spec(2);
    s.suspend = true;
    assert_eq!(
        decide(&s, &status(), &obs(vec![], None)),
        Action::MarkSuspended
    );
    let st = StreamJobStatus {
        phase: Some(crate::crd::Phase::Suspended),
        replicas: Some(0),
        ..status()
    };
    assert!(matches!(
        decide(&s, &st, &obs(vec![], None)),
        Action::Idle { .. }
    ));
    assert!(crate::orchestrator::status::is_ready(
        &s,
        &st,
        &crate::orchestrator::status::Progress::default()
    ));
}

#[test]
fn suspend_is_a_rescale_to_zero() {
    let mut s = spec(4);
    s.suspend = true;
    let running = pods("r", 4, PodPhase::Running, Some(WorkerState::Running));
    assert_eq!(
        decide(&s, &status(), &obs(running, Some(("r", 4)))),
        Action::BeginRescale {
            from: 4,
            to: 0,
            prestage: None
        }
    );
    let mut st = rescaling(Step::Restoring, Some("u"));
    if let Some(r) = st.rescale.as_mut() {
        r.to = 0;
    }
    assert_eq!(decide(&s, &st, &obs(vec![], None)), Action::FinishRescale);
    let suspended = StreamJobStatus {
        phase: Some(crate::crd::Phase::Suspended),
        replicas: Some(0),
        ..status()
    };
    assert!(matches!(
        decide(&s, &suspended, &obs(vec![], None)),
        Action::Idle { .. }
    ));
}

#[test]
fn a_failed_restore_rolls_back_to_the_old_parallelism_from_the_same_savepoint() {
    let st = rescaling(Step::Restoring, Some("file:///s/sp-3"));
    let r = st.rescale.clone().unwrap();
    assert_eq!(rollback_on_restore_failure(&r), Some(4));
    // Rolled back: restore the old parallelism (4) from the same savepoint.
    let mut rolled = st.clone();
    rolled.rescale.as_mut().unwrap().rolled_back = Some("restore failed".into());
    let r = rolled.rescale.clone().unwrap();
    assert_eq!(restore_target(&r), 4);
    // A second failure (at the old parallelism) retries, it does not roll back again.
    assert_eq!(rollback_on_restore_failure(&r), None);
    assert_eq!(
        decide(&spec(8), &rolled, &obs(vec![], None)),
        Action::CreatePods {
            run: "new".into(),
            parallelism: 4,
            subtasks: (0..4).collect()
        }
    );
    assert_eq!(
        decide(
            &spec(8),
            &rolled,
            &obs(
                pods("n", 4, PodPhase::Running, Some(WorkerState::Idle)),
                None
            )
        ),
        Action::Start {
            run: "n".into(),
            parallelism: 4,
            restore: Restore::Url("file:///s/sp-3".into())
        }
    );
    let up = pods("n", 4, PodPhase::Running, Some(WorkerState::Running));
    assert_eq!(
        decide(&spec(8), &rolled, &obs(up, Some(("n", 4)))),
        Action::FinishRescale
    );
    // Not in Restoring, or a suspend/resume without an old run: no rollback.
    let st = rescaling(Step::Stopping, Some("u"));
    assert_eq!(rollback_on_restore_failure(&st.rescale.unwrap()), None);
    let mut st = rescaling(Step::Restoring, Some("u"));
    st.rescale.as_mut().unwrap().from = 0;
    assert_eq!(rollback_on_restore_failure(&st.rescale.unwrap()), None);
}

#[test]
fn a_new_savepoint_nonce_takes_one_savepoint_without_stopping() {
    let mut s = spec(4);
    let running = pods("r", 4, PodPhase::Running, Some(WorkerState::Running));
    let o = obs(running.clone(), Some(("r", 4)));
    // No nonce: nothing to trigger.
    assert!(matches!(decide(&s, &status(), &o), Action::Idle { .. }));
    s.savepoint_trigger_nonce = Some(7);
    assert_eq!(
        decide(&s, &status(), &o),
        Action::TriggerSavepoint {
            trigger: SavepointTrigger::Nonce(7)
        }
    );
    // Recorded: nothing more until the nonce changes.
    let done = StreamJobStatus {
        last_savepoint_nonce: Some(7),
        ..status()
    };
    assert!(matches!(decide(&s, &done, &o), Action::Idle { .. }));
    s.savepoint_trigger_nonce = Some(8);
    assert_eq!(
        decide(&s, &done, &o),
        Action::TriggerSavepoint {
            trigger: SavepointTrigger::Nonce(8)
        }
    );
    // After a failed attempt, the retry waits for the backoff.
    let mut later = o.clone();
    later.backoff_until = Some(now() + jiff::SignedDuration::from_secs(2));
    assert!(matches!(decide(&s, &done, &later), Action::Idle { .. }));
    // A rescale takes precedence (its savepoint is newer anyway).
    let o8 = obs(running, Some(("r", 4)));
    assert_eq!(
        decide(&spec(8), &done, &o8),
        Action::BeginRescale {
            from: 4,
            to: 8,
            prestage: None
        }
    );
}

#[test]
fn a_snapshot_resource_takes_a_savepoint_after_the_nonce_and_only_while_the_job_runs() {
    let mut s = spec(4);
    let running = pods("r", 4, PodPhase::Running, Some(WorkerState::Running));
    let mut o = obs(running.clone(), Some(("r", 4)));
    o.savepoint_request = Some("before-upgrade".into());
    assert_eq!(
        decide(&s, &status(), &o),
        Action::TriggerSavepoint {
            trigger: SavepointTrigger::Snapshot("before-upgrade".into())
        }
    );
    // A nonce not yet acted on goes first; the request waits for the next pass.
    s.savepoint_trigger_nonce = Some(3);
    assert_eq!(
        decide(&s, &status(), &o),
        Action::TriggerSavepoint {
            trigger: SavepointTrigger::Nonce(3)
        }
    );
    // After a failure, the request waits for the backoff like the nonce.
    s.savepoint_trigger_nonce = None;
    let mut later = o.clone();
    later.backoff_until = Some(now() + jiff::SignedDuration::from_secs(2));
    assert!(matches!(decide(&s, &status(), &later), Action::Idle { .. }));
    // A rescale goes first; nothing is taken for the request while no run is coordinated.
    assert!(matches!(
        decide(&spec(8), &status(), &o),
        Action::BeginRescale { .. }
    ));
    let mut stopped = obs(Vec::new(), None);
    stopped.savepoint_request = Some("before-upgrade".into());
    assert!(!matches!(
        decide(&s, &status(), &stopped),
        Action::TriggerSavepoint { .. }
    ));
}

fn upgrading(mode: UpgradeMode, step: Step, savepoint: Option<&str>) -> StreamJobStatus {
    let mut st = rescaling(step, savepoint);
    if let Some(r) = st.rescale.as_mut() {
        r.from = 4;
        r.to = 4;
        r.upgrade_mode = Some(mode);
    }
    st
}

#[test]
fn a_changed_job_or_image_upgrades_in_the_spec_upgrade_mode() {
    let mut s = spec(4);
    let mut running = pods("r", 4, PodPhase::Running, Some(WorkerState::Running));
    // Pods without the label (older operators) are not upgraded.
    assert!(matches!(
        decide(&s, &status(), &obs(running.clone(), Some(("r", 4)))),
        Action::Idle { .. }
    ));
    for p in &mut running {
        p.spec_hash = Some(spec_hash(&s));
    }
    assert!(matches!(
        decide(&s, &status(), &obs(running.clone(), Some(("r", 4)))),
        Action::Idle { .. }
    ));
    s.image = Some("keyshift:v2".into());
    assert_ne!(spec_hash(&s), spec_hash(&spec(4)));
    for mode in [
        UpgradeMode::Savepoint,
        UpgradeMode::LastState,
        UpgradeMode::Stateless,
    ] {
        s.upgrade_mode = mode;
        assert_eq!(
            decide(&s, &status(), &obs(running.clone(), Some(("r", 4)))),
            Action::BeginUpgrade {
                parallelism: 4,
                mode,
                prestage: None,
            }
        );
        // Pre-staged (the default strategy) whenever it keeps the state: the new spec's
        // workers load it before the job stops.
        let mut pre = s.clone();
        pre.rescale_strategy = RescaleStrategy::Prestage;
        let o = obs(running.clone(), Some(("r", 4)));
        assert_eq!(
            decide(&pre, &status(), &o),
            Action::BeginUpgrade {
                parallelism: 4,
                mode,
                prestage: (mode != UpgradeMode::Stateless).then(|| o.new_run.clone()),
            }
        );
        // Refused for good at this parallelism (its state does not fit the new spec): not
        // begun again while the spec stays.
        let mut refused = o.clone();
        refused.start_refused = Some(StartRefusal {
            reason: Reason::StartRefused,
            message: "state \"count\" changed".into(),
            parallelism: Some(4),
        });
        assert!(
            !matches!(
                decide(&pre, &status(), &refused),
                Action::BeginUpgrade { .. }
            ),
            "{mode:?}"
        );
    }
    // Backoff after a failed attempt delays the next one.
    let mut o = obs(running.clone(), Some(("r", 4)));
    o.backoff_until = Some(now() + jiff::SignedDuration::from_secs(2));
    assert!(matches!(decide(&s, &status(), &o), Action::Idle { .. }));

    // Each mode restores from its own source once the old pods are gone.
    let idle = pods("n", 4, PodPhase::Running, Some(WorkerState::Idle));
    let cases = [
        (
            upgrading(
                UpgradeMode::Savepoint,
                Step::Restoring,
                Some("file:///s/sp-9"),
            ),
            Restore::Url("file:///s/sp-9".into()),
        ),
        (
            upgrading(UpgradeMode::LastState, Step::Restoring, None),
            Restore::Latest,
        ),
        // A pre-staged last-state upgrade recorded its stop checkpoint: that one, not
        // whichever checkpoint is newest by then.
        (
            upgrading(
                UpgradeMode::LastState,
                Step::Restoring,
                Some("file:///s/ck-7"),
            ),
            Restore::Url("file:///s/ck-7".into()),
        ),
        (
            upgrading(UpgradeMode::Stateless, Step::Restoring, None),
            Restore::Empty,
        ),
    ];
    for (st, restore) in cases {
        assert_eq!(
            decide(&s, &st, &obs(idle.clone(), None)),
            Action::Start {
                run: "n".into(),
                parallelism: 4,
                restore
            }
        );
    }
    // last-state and stateless skip the savepoint: Stopping deletes the running pods.
    let st = upgrading(UpgradeMode::LastState, Step::Stopping, None);
    assert_eq!(
        decide(&s, &st, &obs(running, None)),
        Action::DeletePods {
            reason: Reason::Stopping
        }
    );
}

#[allow(dead_code)]
fn _uses(_: StreamJob) {}

fn changing(step: Step) -> crate::crd::RescaleStatus {
    crate::crd::RescaleStatus {
        from: 24,
        to: 200,
        step,
        max_parallelism: Some(1024),
        from_max_parallelism: Some(128),
        savepoint: Some("file:///s/sp-3".into()),
        rewritten: Some("file:///s/sp-4".into()),
        ..Default::default()
    }
}

fn changed(point_of_no_return: Option<i64>) -> crate::crd::KeyGroupChangeStatus {
    crate::crd::KeyGroupChangeStatus {
        from_max_parallelism: 128,
        to_max_parallelism: 1024,
        from_replicas: 24,
        original_savepoint: "file:///s/sp-3".into(),
        rewritten_savepoint: "file:///s/sp-4".into(),
        point_of_no_return,
        ..Default::default()
    }
}

#[test]
fn a_new_max_parallelism_on_a_running_job_begins_a_key_group_change() {
    let mut s = spec(200);
    s.max_parallelism = Some(1024);
    let running = pods("r", 24, PodPhase::Running, Some(WorkerState::Running));
    assert_eq!(
        decide(&s, &status(), &obs(running.clone(), Some(("r", 24)))),
        Action::BeginKeyGroupChange {
            from: 24,
            to: 200,
            groups: 1024,
            running: true
        }
    );
    // At the same parallelism too (only the count changes).
    s.replicas = 24;
    assert!(matches!(
        decide(&s, &status(), &obs(running.clone(), Some(("r", 24)))),
        Action::BeginKeyGroupChange {
            from: 24,
            to: 24,
            groups: 1024,
            ..
        }
    ));
    // Not while a spec.restoreFrom is pending: that restore sets the count.
    let mut o = obs(running, Some(("r", 24)));
    o.pending_restore = pending("file:///s/other", 1024);
    assert!(matches!(
        decide(&s, &status(), &o),
        Action::BeginRestore {
            max_parallelism: 1024,
            ..
        }
    ));
    // A stopped job: its newest snapshot is rewritten before anything runs.
    assert_eq!(
        decide(&s, &status(), &obs(Vec::new(), None)),
        Action::BeginKeyGroupChange {
            from: 0,
            to: 24,
            groups: 1024,
            running: false
        }
    );
}

#[test]
fn setting_the_count_back_before_the_point_of_no_return_restores_the_original() {
    let mut s = spec(24);
    s.max_parallelism = Some(128);
    let st = StreamJobStatus {
        max_parallelism: Some(1024),
        key_group_change: Some(changed(None)),
        ..Default::default()
    };
    let running = pods("r", 200, PodPhase::Running, Some(WorkerState::Running));
    assert_eq!(
        decide(&s, &st, &obs(running.clone(), Some(("r", 200)))),
        Action::BeginRestore {
            from: 200,
            to: 24,
            url: "file:///s/sp-3".into(),
            max_parallelism: 128
        }
    );
    // Past it, the current state is rewritten back instead (nothing it produced is lost).
    let st = StreamJobStatus {
        key_group_change: Some(changed(Some(7))),
        ..st
    };
    assert!(matches!(
        decide(&s, &st, &obs(running, Some(("r", 200)))),
        Action::BeginKeyGroupChange {
            groups: 128,
            running: true,
            ..
        }
    ));
}

#[test]
fn the_steps_of_a_key_group_change_act_in_order() {
    let mut s = spec(200);
    s.max_parallelism = Some(1024);
    let at = |step| StreamJobStatus {
        max_parallelism: Some(128),
        rescale: Some(changing(step)),
        ..Default::default()
    };
    assert_eq!(
        decide(&s, &at(Step::Stopping), &obs(Vec::new(), None)),
        Action::Advance(Outcome::StoppedForRewrite)
    );
    assert_eq!(
        decide(&s, &at(Step::Rewriting), &obs(Vec::new(), None)),
        Action::Rewrite {
            source: "file:///s/sp-3".into(),
            target: "file:///s/sp-4".into(),
            groups: 1024,
            parallelism: 200
        }
    );
    assert_eq!(
        decide(&s, &at(Step::VerifyingRewrite), &obs(Vec::new(), None)),
        Action::VerifyRewrite {
            source: "file:///s/sp-3".into(),
            target: "file:///s/sp-4".into()
        }
    );
    // The rewritten savepoint is restored at the new parallelism...
    match decide(&s, &at(Step::Restoring), &obs(Vec::new(), None)) {
        Action::CreatePods { parallelism, .. } => assert_eq!(parallelism, 200),
        a => panic!("{a:?}"),
    }
    let up = pods("new", 200, PodPhase::Running, Some(WorkerState::Idle));
    match decide(&s, &at(Step::Restoring), &obs(up, None)) {
        Action::Start {
            parallelism,
            restore,
            ..
        } => {
            assert_eq!(parallelism, 200);
            assert_eq!(restore, Restore::Url("file:///s/sp-4".into()));
        }
        a => panic!("{a:?}"),
    }
    // ... or, rolled back, the original at the old parallelism.
    let mut back = at(Step::Restoring);
    if let Some(r) = back.rescale.as_mut() {
        r.rolled_back = Some("the rewrite failed".into());
    }
    let up = pods("new", 24, PodPhase::Running, Some(WorkerState::Idle));
    match decide(&s, &back, &obs(up, None)) {
        Action::Start {
            parallelism,
            restore,
            ..
        } => {
            assert_eq!(parallelism, 24);
            assert_eq!(restore, Restore::Url("file:///s/sp-3".into()));
        }
        a => panic!("{a:?}"),
    }
    // Setting the count back while the rewrite runs rolls the change back.
    s.max_parallelism = Some(128);
    s.replicas = 24;
    for step in [Step::Rewriting, Step::VerifyingRewrite] {
        assert!(
            matches!(
                decide(&s, &at(step), &obs(Vec::new(), None)),
                Action::RollBackRewrite { .. }
            ),
            "{step}"
        );
    }
    // A failed restore of the new run rolls back even at the same parallelism.
    let mut same = changing(Step::Restoring);
    same.to = 24;
    assert_eq!(rollback_on_restore_failure(&same), Some(24));
    let mut plain = same.clone();
    plain.from_max_parallelism = None;
    assert_eq!(rollback_on_restore_failure(&plain), None);
}

/// A pre-staged rescale 4 -> 8 in `step`, its new run "new" asked for at `now()`.
fn prestaging(step: Step) -> StreamJobStatus {
    let mut st = rescaling(step, Some("s3://b/ns/j/checkpoints/chk-9"));
    if let Some(r) = st.rescale.as_mut() {
        r.prestage = Some(crate::crd::PrestageStatus {
            run: "new".into(),
            since: now().to_string(),
            ..Default::default()
        });
    }
    st
}

fn prestage_spec() -> StreamJobSpec {
    let mut s = spec(8);
    s.rescale_strategy = RescaleStrategy::Prestage;
    s
}

fn later(mut o: Observed, secs: i64) -> Observed {
    o.now += jiff::SignedDuration::from_secs(secs);
    o
}

#[test]
fn rescales_are_prestaged_by_default() {
    let j = crate::fixtures::job();
    assert_eq!(j.spec.rescale_strategy, RescaleStrategy::Prestage);
    let yaml = serde_yaml::to_string(&j.spec).unwrap();
    assert!(
        !yaml.contains("rescaleStrategy"),
        "the default is not written"
    );
    let mut s = j.spec.clone();
    s.rescale_strategy = RescaleStrategy::StopAndRestore;
    let yaml = serde_yaml::to_string(&s).unwrap();
    assert!(yaml.contains("rescaleStrategy: StopAndRestore"), "{yaml}");
}

#[test]
fn a_prestage_rescale_begins_at_prestaging_but_a_suspend_does_not() {
    let old = pods("old", 4, PodPhase::Running, Some(WorkerState::Running));
    let st = StreamJobStatus {
        replicas: Some(4),
        ..status()
    };
    let a = decide(&prestage_spec(), &st, &obs(old.clone(), Some(("old", 4))));
    assert_eq!(
        a,
        Action::BeginRescale {
            from: 4,
            to: 8,
            prestage: Some("new".into())
        }
    );
    let mut suspend = prestage_spec();
    suspend.suspend = true;
    let a = decide(&suspend, &st, &obs(old, Some(("old", 4))));
    assert_eq!(
        a,
        Action::BeginRescale {
            from: 4,
            to: 0,
            prestage: None
        }
    );
}

#[test]
fn prestaging_creates_waits_loads_and_falls_back_when_late() {
    let s = prestage_spec();
    let st = prestaging(Step::Prestaging);
    let old = pods("old", 4, PodPhase::Running, Some(WorkerState::Running));
    let with = |new: Vec<ObservedPod>| {
        let mut all = old.clone();
        all.extend(new);
        obs(all, Some(("old", 4)))
    };
    assert_eq!(
        decide(&s, &st, &with(vec![])),
        Action::CreatePods {
            run: "new".into(),
            parallelism: 8,
            subtasks: (0..8).collect()
        }
    );
    let pending = pods("new", 8, PodPhase::Pending, None);
    assert!(matches!(
        decide(&s, &st, &with(pending.clone())),
        Action::Wait { reason } if reason.contains("8 of 8 new worker pod(s) not running")
    ));
    // spec.state.prestageTimeout (2m by default) passed: fall back, the job still runs.
    match decide(&s, &st, &later(with(pending), 120)) {
        Action::FallBack { message } => {
            assert!(message.contains("prestageTimeout (120s)"), "{message}");
            assert!(message.contains("not running yet"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    let idle = pods("new", 8, PodPhase::Running, Some(WorkerState::Idle));
    assert_eq!(
        decide(&s, &st, &with(idle.clone())),
        Action::Prestage {
            run: "new".into(),
            parallelism: 8
        }
    );
    // A pod the scheduler cannot place: no need to wait for the timeout.
    let mut unplaced = pods("new", 8, PodPhase::Pending, None);
    unplaced[4].unschedulable = Some("0/1 nodes are available: 1 Insufficient cpu.".into());
    assert!(matches!(
        decide(&s, &st, &with(unplaced)),
        Action::FallBack { message } if message.contains("(subtask 4) cannot be scheduled: 0/1 nodes")
    ));
    let loading = pods("new", 8, PodPhase::Running, Some(WorkerState::Restoring));
    assert!(matches!(
        decide(&s, &st, &with(loading)),
        Action::Wait { reason } if reason.contains("loading")
    ));
    let mut exited = idle.clone();
    exited[3].phase = PodPhase::Exited;
    assert!(matches!(
        decide(&s, &st, &with(exited)),
        Action::FallBack { message } if message.contains("subtask 3") && message.contains("exited")
    ));
    // An old worker lost: the rescale is abandoned (the job recovers as it would anyway).
    let mut broken = old.clone();
    broken[1].phase = PodPhase::Exited;
    broken.extend(idle.clone());
    assert!(matches!(
        decide(&s, &st, &obs(broken, Some(("old", 4)))),
        Action::Abandon { .. }
    ));
    // After an operator restart: the old workers are adopted, the new ones left aside.
    let mut all = old.clone();
    all.extend(idle);
    assert_eq!(
        decide(&s, &st, &obs(all, None)),
        Action::Adopt {
            run: "old".into(),
            parallelism: 4
        }
    );
}

#[test]
fn a_prestaged_job_stops_only_with_every_new_worker_loaded() {
    let s = prestage_spec();
    let st = prestaging(Step::Savepointing);
    let old = pods("old", 4, PodPhase::Running, Some(WorkerState::Running));
    let with = |new: Vec<ObservedPod>| {
        let mut all = old.clone();
        all.extend(new);
        obs(all, Some(("old", 4)))
    };
    let loaded = pods("new", 8, PodPhase::Running, Some(WorkerState::Prestaged));
    assert_eq!(decide(&s, &st, &with(loaded.clone())), Action::Savepoint);
    let mut silent = loaded.clone();
    silent[2].worker = None;
    assert!(matches!(
        decide(&s, &st, &with(silent.clone())),
        Action::Wait { reason } if reason.contains("subtask 2")
    ));
    assert!(matches!(
        decide(&s, &st, &later(with(silent), 121)),
        Action::FallBack { .. }
    ));
    let mut restarted = loaded.clone();
    restarted[5].worker = Some(WorkerState::Idle);
    assert!(matches!(
        decide(&s, &st, &with(restarted)),
        Action::FallBack { message } if message.contains("subtask 5") && message.contains("before the job stopped")
    ));
    // Fallen back: the savepoint is taken as in a stop-and-restore, and the new workers go.
    let mut fell = st.clone();
    if let Some(r) = fell.rescale.as_mut() {
        r.fallback = Some("late".into());
    }
    assert_eq!(
        decide(&s, &fell, &with(loaded.clone())),
        Action::DeleteRun {
            run: "new".into(),
            reason: Reason::PrestageFellBack
        }
    );
    let mut going = loaded;
    for p in &mut going {
        p.deleting = true;
    }
    assert_eq!(decide(&s, &fell, &with(going)), Action::Savepoint);
}

#[test]
fn a_prestaged_rescale_removes_only_the_old_workers_then_starts_the_new_ones() {
    let s = prestage_spec();
    let old = pods("old", 4, PodPhase::Running, Some(WorkerState::Stopped));
    let loaded = pods("new", 8, PodPhase::Running, Some(WorkerState::Prestaged));
    let mut all = old.clone();
    all.extend(loaded.clone());
    let st = prestaging(Step::Stopping);
    assert_eq!(
        decide(&s, &st, &obs(all, None)),
        Action::DeleteAllBut { keep: "new".into() }
    );
    assert_eq!(
        decide(&s, &st, &obs(loaded.clone(), None)),
        Action::Advance(Outcome::Stopped)
    );
    let st = prestaging(Step::Restoring);
    assert_eq!(
        decide(&s, &st, &obs(loaded.clone(), None)),
        Action::Start {
            run: "new".into(),
            parallelism: 8,
            restore: Restore::Url("s3://b/ns/j/checkpoints/chk-9".into())
        }
    );
    let mut lost = loaded;
    lost.remove(6);
    assert!(matches!(
        decide(&s, &st, &obs(lost, None)),
        Action::FallBack { message } if message.contains("subtask 6") && message.contains("before their start")
    ));
}

#[test]
fn a_start_waiting_for_an_unschedulable_pod_says_why() {
    let s = spec(2);
    let mut waiting = pods("r", 2, PodPhase::Pending, None);
    let a = decide(&s, &status(), &obs(waiting.clone(), None));
    assert_eq!(
        a,
        Action::Wait {
            reason: "2 of 2 worker pod(s) not running yet".into()
        }
    );
    waiting[1].unschedulable = Some("0/1 nodes are available: 1 Too many pods.".into());
    let a = decide(&s, &status(), &obs(waiting, None));
    assert_eq!(
        a,
        Action::Wait {
            reason: "2 of 2 worker pod(s) not running yet; pod j-r-1 cannot be scheduled: 0/1 nodes are available: 1 Too many pods.".into()
        }
    );
}
