//! The orchestration pass (`orchestrator::pass::run_pass`) driven whole, without a cluster:
//! real workers run in-process on loopback behind a fake platform ([`fake_platform`]) that fails
//! on command, snapshots go to an in-memory object store, status lives in memory. A driver runs
//! passes the way `keyshift local` does (at once after a status change, woken when a background
//! step ends) with a pass budget and deadlines, so no test can hang.
//!
//! Every pass of every test is checked against the step table: a transition's step only changes
//! by a legal `step::next` transition, one step per pass, each change with its Event. Every test
//! ends by suspending the job and comparing the state in its final savepoint with the exact
//! result computed independently from the generator (`job::expected_results`).

mod fake_platform;
mod snapshot_support;

use fake_platform::FakeWorkers;
use keyshift::crd::{Phase, RescaleStatus, StreamJob, StreamJobSpec, StreamJobStatus};
#[cfg(feature = "test-hooks")]
use keyshift::failpoints;
use keyshift::job::{self, Expected};
use keyshift::keygroup::Key;
use keyshift::operator::metrics::OperatorMetrics;
use keyshift::orchestrator::pass::{
    self, ErrorKind, JobMemory, PassInput, PassOutput, PendingEvent, Shell, run_pass,
};
use keyshift::orchestrator::step::{self, ALL_OUTCOMES, Step};
use keyshift::orchestrator::{settings, status};
use keyshift::runtime::protocol::WorkerState;
use keyshift::snapshot;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

const NS: &str = "test";
const TOKEN: &str = "fake-platform-token";
/// The longest the driver waits between passes (the real requeues are longer; a pass may come
/// at any time, as a watch event would bring it).
const MAX_WAIT: Duration = Duration::from_millis(50);
/// Passes one drive may take before the test fails (a pass loop that makes no progress).
const PASS_BUDGET: u32 = 3000;
/// The whole test, whatever happens.
const TEST_TIMEOUT: Duration = Duration::from_secs(90);

fn spec(name: &str, replicas: u32, checkpoint_interval: &str) -> StreamJobSpec {
    let yaml = format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {{name: {name}, namespace: {NS}}}
spec:
  replicas: {replicas}
  maxParallelism: 32
  # The stop-and-restore steps; pre-staged rescales have tests of their own below.
  rescaleStrategy: StopAndRestore
  job:
    source:
      generator: {{partitions: 6, keys: 500, seed: 11, recordsPerSecond: 2000}}
    key: {{field: key, type: string}}
    aggregation: {{function: count}}
    sink: {{type: objectStore, url: 'memory://{name}/sink'}}
  state:
    checkpointInterval: {checkpoint_interval}
    retainedCheckpoints: 2
"
    );
    let job: StreamJob = serde_yaml::from_str(&yaml).expect("test manifest parses");
    job.spec
}

/// Runs a test body with a wall-clock limit.
async fn bounded(body: impl Future<Output = ()>) {
    let started = Instant::now();
    tokio::time::timeout(TEST_TIMEOUT, body)
        .await
        .unwrap_or_else(|_| panic!("the test did not finish within {TEST_TIMEOUT:?}"));
    eprintln!("test body took {} ms", started.elapsed().as_millis());
}

/// Whether `before -> after` (one pass) is a legal change of a transition's record, with the
/// Events the change must come with.
fn check_change(
    before: Option<&RescaleStatus>,
    after: Option<&RescaleStatus>,
    events: &[PendingEvent],
) -> Result<(), String> {
    let has = |reason: &str| events.iter().any(|e| e.reason == reason);
    let Some(a) = after else {
        return match before {
            None => Ok(()),
            Some(b) => Err(format!(
                "the record of the transition in {} vanished",
                b.step
            )),
        };
    };
    let same = before.filter(|b| b.started == a.started);
    match same {
        None => {
            if let Some(b) = before
                && b.step.active()
            {
                return Err(format!(
                    "a new transition began while one was in {}",
                    b.step
                ));
            }
            // A key-group change of a stopped job starts by verifying its newest snapshot.
            let first = match a.upgrade_mode {
                _ if a.rewrites() && a.step == Step::Verifying => Step::Verifying,
                _ if a.prestage.is_some() => Step::Prestaging,
                None => Step::Savepointing,
                Some(mode) => step::Step::first_of_upgrade(mode),
            };
            if a.step != first {
                return Err(format!("a new transition began at {}, not {first}", a.step));
            }
        }
        Some(b) if b.step != a.step => {
            let legal = ALL_OUTCOMES
                .iter()
                .any(|o| step::next(b.step, *o) == Ok(a.step));
            if !legal {
                return Err(format!(
                    "{} -> {} is no transition of the step table",
                    b.step, a.step
                ));
            }
        }
        Some(_) => {}
    }
    let changed_to = |s: Step| a.step == s && same.is_none_or(|b| b.step != s);
    let pairs: [(bool, &str); 7] = [
        (
            a.fallback.is_some() && same.is_some_and(|b| b.fallback.is_none()),
            "PrestageFellBack",
        ),
        (
            changed_to(Step::Savepointing) && a.prestaged().is_some(),
            "Prestaged",
        ),
        (changed_to(Step::Abandoned), "RescaleAbandoned"),
        (changed_to(Step::RolledBack), "RescaleRolledBack"),
        (
            a.rolled_back.is_some() && same.is_some_and(|b| b.rolled_back.is_none()),
            if a.rewrites() {
                "KeyGroupChangeRolledBack"
            } else {
                "RescaleRollingBack"
            },
        ),
        (
            changed_to(Step::Done) && a.to > 0 && a.upgrade_mode.is_none(),
            "Rescaled",
        ),
        (
            changed_to(Step::Done) && a.upgrade_mode.is_some() && a.rolled_back.is_none(),
            "Upgraded",
        ),
    ];
    for (happened, reason) in pairs {
        if happened != has(reason) {
            return Err(format!(
                "step {} (was {:?}): event {reason} {}",
                a.step,
                same.map(|b| b.step),
                if happened {
                    "missing"
                } else {
                    "without its change"
                }
            ));
        }
    }
    if changed_to(Step::Done) && a.to == 0 && !has("Suspended") {
        return Err("suspended without a Suspended event".into());
    }
    Ok(())
}

/// Drives passes over one job on the fake platform.
struct Driver {
    name: String,
    spec: StreamJobSpec,
    status: StreamJobStatus,
    mem: JobMemory,
    workers: FakeWorkers,
    woken: Arc<tokio::sync::Notify>,
    metrics: OperatorMetrics,
    http: reqwest::Client,
    storage: String,
    /// Every Event, with when its pass ended.
    events: Vec<(Instant, PendingEvent)>,
    /// The steps each transition (by its start time) was seen in, in order.
    steps: Vec<(String, Vec<Step>)>,
    passes: u32,
    wait: Duration,
    /// The requeue the last pass asked for.
    requeue: Option<Duration>,
}

impl Driver {
    fn new(name: &str, replicas: u32, checkpoint_interval: &str) -> Driver {
        let spec = spec(name, replicas, checkpoint_interval);
        let workers = FakeWorkers::new(TOKEN, settings::spec_hash(&spec));
        Driver {
            name: name.to_owned(),
            woken: workers.woken(),
            workers,
            spec,
            status: StreamJobStatus::default(),
            mem: JobMemory::default(),
            metrics: OperatorMetrics::new(),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(3))
                .no_proxy()
                .build()
                .expect("http client"),
            storage: format!("memory://{name}/state"),
            events: Vec::new(),
            steps: Vec::new(),
            passes: 0,
            wait: Duration::ZERO,
            requeue: None,
        }
    }

    /// The condition `type_` when it is True: (reason, message).
    fn condition(&self, type_: &str) -> Option<(String, String)> {
        self.status
            .conditions
            .iter()
            .find(|c| c.type_ == type_ && c.status == "True")
            .map(|c| (c.reason.clone(), c.message.clone()))
    }

    fn step(&self) -> Option<Step> {
        self.status.rescale.as_ref().map(|r| r.step)
    }

    fn rescale(&self) -> RescaleStatus {
        self.status
            .rescale
            .clone()
            .expect("a transition is recorded")
    }

    /// Running at `p` with nothing in flight.
    fn running_at(&self, p: i32) -> bool {
        self.status.phase == Some(Phase::Running)
            && self.status.replicas == Some(p)
            && self.step().is_none_or(|s| !s.active())
            && self.mem.coordinating()
            && self.workers.live().len() == p as usize
    }

    fn events_named(&self, reason: &str) -> Vec<&(Instant, PendingEvent)> {
        self.events
            .iter()
            .filter(|(_, e)| e.reason == reason)
            .collect()
    }

    fn event_log(&self) -> String {
        self.events
            .iter()
            .map(|(_, e)| {
                format!(
                    "  {}{}: {}",
                    if e.warning { "warning " } else { "" },
                    e.reason,
                    e.note
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The orchestrator restarts: what it remembers (its coordinator, backoff, token) is gone;
    /// status and the workers stay.
    fn restart(&mut self) {
        assert!(
            !self.mem.background_running(),
            "restarting while a background step runs would leave its thread acting"
        );
        self.mem = JobMemory::default();
    }

    /// Waits (without passes) until the background step that runs, if any, has ended: its
    /// outcome then waits in the memory a restart loses, as in a crash right after the work.
    async fn await_background(&mut self, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.mem.background_running() {
            assert!(Instant::now() < deadline, "{what} did not end");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// One pass; its result checked against the step table and recorded.
    async fn pass(&mut self) {
        self.passes += 1;
        self.workers.set_spec_hash(settings::spec_hash(&self.spec));
        let before = self.status.clone();
        let out = run_pass(
            PassInput {
                namespace: NS,
                name: &self.name,
                spec: &self.spec,
                status: before.clone(),
                storage: self.storage.clone(),
                generation: None,
                savepoint_request: None,
            },
            &mut self.mem,
            Shell {
                workers: &mut self.workers,
                metrics: &self.metrics,
                http: &self.http,
            },
        )
        .await;
        match out {
            Ok(PassOutput {
                status,
                events,
                requeue,
            }) => {
                if let Err(e) =
                    check_change(before.rescale.as_ref(), status.rescale.as_ref(), &events)
                {
                    panic!(
                        "pass {} broke the step table: {e}\nevents of the pass: {events:#?}\nstatus before: {:#?}\nafter: {:#?}",
                        self.passes, before.rescale, status.rescale
                    );
                }
                if let Some(r) = &status.rescale {
                    match self.steps.last_mut() {
                        Some((started, seen)) if *started == r.started => {
                            if seen.last() != Some(&r.step) {
                                seen.push(r.step);
                            }
                        }
                        _ => self.steps.push((r.started.clone(), vec![r.step])),
                    }
                }
                self.requeue = Some(requeue);
                let now = Instant::now();
                self.events.extend(events.into_iter().map(|e| (now, e)));
                self.wait = if status != before {
                    Duration::from_millis(5)
                } else {
                    requeue
                };
                self.status = status;
            }
            Err(e) => {
                self.requeue = None;
                assert_ne!(e.kind(), ErrorKind::Bug, "pass {}: {e}", self.passes);
                eprintln!("pass {} failed: {e}", self.passes);
                self.wait = Duration::from_millis(100);
            }
        }
    }

    /// Drives passes until `done` holds (checked after each pass), at most `timeout`.
    async fn until(&mut self, what: &str, timeout: Duration, done: impl Fn(&Driver) -> bool) {
        let deadline = Instant::now() + timeout;
        let first = self.passes;
        loop {
            self.pass().await;
            if done(self) {
                return;
            }
            if Instant::now() > deadline || self.passes - first > PASS_BUDGET {
                panic!(
                    "{}: not {what} within {timeout:?} ({} passes)\nstatus: {:#?}\nevents:\n{}",
                    self.name,
                    self.passes - first,
                    self.status,
                    self.event_log()
                );
            }
            self.sleep().await;
        }
    }

    /// Drives passes for `duration`, checking `invariant` after each.
    async fn for_a_while(&mut self, duration: Duration, invariant: impl Fn(&Driver)) {
        let end = Instant::now() + duration;
        while Instant::now() < end {
            self.pass().await;
            invariant(self);
            self.sleep().await;
        }
    }

    async fn sleep(&self) {
        let wait = self.wait.min(MAX_WAIT);
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = self.woken.notified() => {}
        }
    }

    async fn until_running(&mut self, p: i32) {
        self.until(&format!("running at {p}"), Duration::from_secs(20), |d| {
            d.running_at(p)
        })
        .await;
    }

    /// The records the coordinated run's workers processed, and whether any is stopped.
    async fn progress(&mut self) -> (u64, bool) {
        let st = self
            .mem
            .coordinator()
            .expect("a run is coordinated")
            .status()
            .await
            .expect("worker status");
        (
            st.iter().map(|s| s.records_processed).sum(),
            st.iter().any(|s| s.state == WorkerState::Stopped),
        )
    }

    /// The job processes records (its sources are not stopped): polled with a deadline.
    /// Kills worker 0 and checks that the restart is refused (a StartFailed warning whose
    /// message holds every one of `needles`) and that no run starts for a while.
    async fn restart_is_refused(&mut self, needles: &[&str]) {
        let started_before = self.events_named("Started").len();
        let failed_before = self.events_named("StartFailed").len();
        self.workers.kill(0).expect("worker 0 exists");
        self.until("refused", Duration::from_secs(20), |d| {
            d.events_named("StartFailed").len() > failed_before
        })
        .await;
        let refused = &self.events_named("StartFailed")[failed_before].1;
        assert!(refused.warning);
        for needle in needles {
            assert!(refused.note.contains(needle), "{needle}: {}", refused.note);
        }
        self.for_a_while(Duration::from_secs(3), |d| {
            assert_eq!(
                d.events_named("Started").len(),
                started_before,
                "a run started without the job's state:\n{}",
                d.event_log()
            );
        })
        .await;
        assert_ne!(self.status.phase, Some(Phase::Running));
    }

    /// Waits for the job to stall with `StartRefused` and checks that its message holds every
    /// one of `needles` and that no start is made again for a while (no StartFailed, no other
    /// StartRefused, no Started).
    async fn stalls_refused_without_retry(&mut self, needles: &[&str]) {
        let started = self.events_named("Started").len();
        self.until("stalled", Duration::from_secs(30), |d| {
            d.condition("Stalled")
                .is_some_and(|(r, _)| r == "StartRefused")
        })
        .await;
        let (_, message) = self.condition("Stalled").expect("Stalled");
        for needle in needles.iter().chain(&["No retry can change that"]) {
            assert!(message.contains(needle), "{needle:?} in {message}");
        }
        self.for_a_while(Duration::from_secs(3), |d| {
            assert_eq!(d.events_named("StartRefused").len(), 1, "{}", d.event_log());
            assert!(
                d.events_named("StartFailed").is_empty(),
                "retried: {}",
                d.event_log()
            );
            assert_eq!(d.events_named("Started").len(), started, "started");
        })
        .await;
    }

    /// After a refusal, the spec changes (to `replicas`): the job runs again and the refusal's
    /// stall is gone.
    async fn runs_again_at(&mut self, replicas: i32) {
        self.spec.replicas = replicas;
        self.until_running(replicas).await;
        assert!(
            self.condition("Stalled")
                .is_none_or(|(r, _)| r != "StartRefused")
        );
        self.assert_processing().await;
    }

    async fn assert_processing(&mut self) {
        let (first, _) = self.progress().await;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (now, stopped) = self.progress().await;
            assert!(!stopped, "a worker's sources are still stopped");
            if now > first {
                return;
            }
            assert!(Instant::now() < deadline, "no record processed in 10 s");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Suspends the job with a savepoint and checks the state in it is exact.
    async fn suspend_and_check(&mut self) {
        self.spec.suspend = true;
        self.until("suspended", Duration::from_secs(20), |d| {
            d.status.phase == Some(Phase::Suspended)
                && d.step() == Some(Step::Done)
                && d.workers.names().is_empty()
        })
        .await;
        assert_eq!(self.events_named("Suspended").len(), 1);
        let sp = self.rescale().savepoint.expect("the suspend's savepoint");
        assert_eq!(
            self.status.last_savepoint.as_ref().map(|s| s.path.as_str()),
            Some(sp.as_str())
        );
        assert_exact(&self.spec, &sp).await;
        assert_eq!(
            self.steps.last().map(|(_, s)| s.as_slice()),
            Some(
                &[
                    Step::Savepointing,
                    Step::Verifying,
                    Step::Stopping,
                    Step::Restoring,
                    Step::Done
                ][..]
            ),
            "the suspend went through every step, each recorded in status"
        );
    }
}

/// Every key's count in a committed snapshot, and its source positions.
async fn snapshot_state(url: &str) -> (BTreeMap<Key, i64>, BTreeMap<u32, u64>) {
    let s = snapshot_support::read_state(url).await;
    (s.scalars(), s.positions)
}

/// The state in snapshot `url` is exactly the count of every key over the records before its
/// source positions; returns the records those positions cover.
async fn assert_exact(spec: &StreamJobSpec, url: &str) -> u64 {
    let (state, positions) = snapshot_state(url).await;
    let Expected::Global(expected) =
        job::expected_results(&spec.job, &positions).expect("oracle runs")
    else {
        panic!("expected a global aggregate");
    };
    assert_eq!(
        positions.len(),
        6,
        "every partition has a position in {url}"
    );
    assert!(
        positions.values().all(|p| *p > 0),
        "every partition advanced: {positions:?}"
    );
    assert_eq!(state.len(), expected.len(), "key count in {url}");
    assert!(
        state == expected,
        "state in {url} differs from the exact expected result"
    );
    let total: i64 = state.values().sum();
    assert_eq!(total as u64, positions.values().sum::<u64>());
    total as u64
}

/// A savepoint that fails abandons the rescale: warning Event, the job keeps running at its
/// old parallelism on the same workers (resumed), and the rescale is retried only after the
/// backoff, then succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn savepoint_failure_abandons_keeps_running_and_retries_after_backoff() {
    bounded(async {
        let mut d = Driver::new("sp-fails", 2, "1h");
        d.until_running(2).await;
        let workers_before = d.workers.names();
        d.workers.faults().fail_savepoints = true;
        d.spec.replicas = 3;
        d.until("abandoned", Duration::from_secs(20), |d| {
            d.step() == Some(Step::Abandoned)
        })
        .await;
        let abandoned_at = Instant::now();
        assert_eq!(d.workers.faults().savepoints_failed, 1);
        let abandoned = d.events_named("RescaleAbandoned");
        assert_eq!(abandoned.len(), 1, "{}", d.event_log());
        assert!(abandoned[0].1.warning);
        assert!(
            abandoned[0]
                .1
                .note
                .contains("injected by the fake platform"),
            "{}",
            abandoned[0].1.note
        );
        // phase: see `abandoned_rescale_reports_the_job_running` (it stays Rescaling).
        assert_eq!(d.status.replicas, Some(2));
        assert_eq!(
            d.workers.names(),
            workers_before,
            "the workers were touched"
        );
        assert!(d.workers.deleted.is_empty());
        assert!(
            d.status
                .conditions
                .iter()
                .any(|c| c.reason == "RescaleAbandoned"),
            "{:#?}",
            d.status.conditions
        );
        d.assert_processing().await;

        // Not retried during the backoff (1 s after the first failure).
        d.workers.faults().fail_savepoints = false;
        d.for_a_while(Duration::from_millis(600), |d| {
            assert_eq!(
                d.step(),
                Some(Step::Abandoned),
                "retried during the backoff"
            );
            assert_eq!(d.events_named("RescaleStarted").len(), 1);
        })
        .await;
        d.until("rescaled to 3", Duration::from_secs(20), |d| {
            d.step() == Some(Step::Done) && d.running_at(3)
        })
        .await;
        let started = d.events_named("RescaleStarted");
        assert_eq!(started.len(), 2);
        let retry_after = started[1].0 - abandoned_at;
        assert!(
            retry_after >= Duration::from_millis(900),
            "retried {retry_after:?} after the abandon"
        );
        assert_eq!(d.events_named("Rescaled").len(), 1);
        assert!(
            !d.status
                .conditions
                .iter()
                .any(|c| c.reason == "RescaleAbandoned" && c.status == "True"),
            "the failure stays reported after the rescale succeeded: {:#?}",
            d.status.conditions
        );
        let sp = d.rescale().savepoint.expect("the rescale's savepoint");
        assert_exact(&d.spec, &sp).await;
        d.suspend_and_check().await;
    })
    .await;
}

/// After an abandoned rescale the job runs at its old parallelism, and its phase says so
/// (`Running`, not the `Rescaling` of the last active step); with the edit reverted it stays so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_rescale_reports_the_job_running() {
    bounded(async {
        let mut d = Driver::new("abandoned-phase", 2, "1h");
        d.until_running(2).await;
        d.workers.faults().fail_savepoints = true;
        d.spec.replicas = 3;
        d.until("abandoned", Duration::from_secs(20), |d| {
            d.step() == Some(Step::Abandoned)
        })
        .await;
        // The edit is reverted: the job runs as its spec asks.
        d.spec.replicas = 2;
        d.for_a_while(Duration::from_secs(2), |_| {}).await;
        assert_eq!(
            (d.status.phase, d.status.replicas),
            (Some(Phase::Running), Some(2)),
            "conditions: {:#?}",
            d.status.conditions
        );
    })
    .await;
}

/// A start the workers refuse for good (HTTP 422) stalls the job with their reason: no retry
/// while the spec stays as it is, and a start again once it changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_refused_for_good_stalls_until_the_spec_changes() {
    bounded(async {
        let mut d = Driver::new("refused-for-good", 2, "1h");
        d.workers.faults().refuse_start_for_good = true;
        d.stalls_refused_without_retry(&["this worker image has no such program"])
            .await;
        assert!(d.workers.faults().starts_refused >= 1);
        // The image is fixed (here: the workers stop refusing) and the spec changes.
        d.workers.faults().refuse_start_for_good = false;
        d.runs_again_at(3).await;
    })
    .await;
}

/// [`spec`]'s job with the `count` program keyshift's image carries (keyshift_examples::count)
/// instead of the built-in count.
fn count_program_spec(name: &str, replicas: u32) -> StreamJobSpec {
    let mut spec = spec(name, replicas, "1h");
    spec.job.key = None;
    spec.job.aggregation = None;
    spec.job.program = Some(keyshift::crd::ProgramSpec {
        name: "count".into(),
        max_out_of_orderness: None,
        combine: None,
    });
    spec
}

/// The `count` program's next release as a careless author would write it: its state `count`
/// declared at version 2, with no migration from version 1.
mod count_at_version_2 {
    use keyshift_examples::count::Keyed;
    use keyshift_sdk::prelude::*;

    struct Count;

    impl KeyedProcessFunction for Count {
        type Key = String;
        type In = Keyed;
        type Out = (String, u64);
        type State = ValueHandle<u64>;

        fn declare(&self, states: &mut Declarations) -> Result<Self::State, DeclarationError> {
            states.value(ValueStateDescriptor::new("count").version(2))
        }

        fn process(
            &mut self,
            _record: Keyed,
            count: &Self::State,
            ctx: &mut Context<'_, String, (String, u64)>,
        ) -> keyshift_sdk::Result<()> {
            let n = ctx.value(count).get()?.unwrap_or(0) + 1;
            ctx.value(count).set(n)?;
            Ok(())
        }
    }

    /// The job, as `keyshift_examples::count::job` but for its state's version.
    pub fn job() -> Job {
        Job::json_lines::<Keyed>("count", "records", |r| r.ts)
            .key_by(|r| r.key.clone())
            .process("count", || Count)
            .to_json_lines("counts")
    }
}

/// The `count` program as a release that also counts, per subtask, the records it saw in an
/// operator list state that declares no redistribution.
mod count_with_unsplittable_totals {
    use keyshift_examples::count::Keyed;
    use keyshift_sdk::prelude::*;

    struct Count;

    impl KeyedProcessFunction for Count {
        type Key = String;
        type In = Keyed;
        type Out = (String, u64);
        type State = (ValueHandle<u64>, OperatorListHandle<u64>);

        fn declare(&self, states: &mut Declarations) -> Result<Self::State, DeclarationError> {
            Ok((
                states.value(ValueStateDescriptor::new("count"))?,
                states.operator_list(OperatorListStateDescriptor::new("totals"))?,
            ))
        }

        fn process(
            &mut self,
            _record: Keyed,
            (count, totals): &Self::State,
            ctx: &mut Context<'_, String, (String, u64)>,
        ) -> keyshift_sdk::Result<()> {
            let n = ctx.value(count).get()?.unwrap_or(0) + 1;
            ctx.value(count).set(n)?;
            let seen = ctx
                .operator_list(totals)
                .get()?
                .first()
                .copied()
                .unwrap_or(0);
            ctx.operator_list(totals).update(&[seen + 1])?;
            Ok(())
        }
    }

    pub fn job() -> Job {
        Job::json_lines::<Keyed>("count", "records", |r| r.ts)
            .key_by(|r| r.key.clone())
            .process("count", || Count)
            .to_json_lines("counts")
    }
}

/// A rescale of a program whose operator state declares no redistribution: the new run's
/// workers refuse its state, the rescale rolls back to the old parallelism (the job runs on),
/// and the job is Stalled naming the state and the choices, with no second attempt while the
/// spec stays; setting the replicas back clears it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rescale_the_operator_state_cannot_follow_rolls_back_and_stalls_naming_the_state() {
    unsplittable_rescale(false).await;
}

/// The same rescale pre-staged: the new workers refuse the state while they load it, before
/// the old run stops (no savepoint, no rollback); the rescale is abandoned and the job runs on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prestaged_rescale_the_operator_state_cannot_follow_is_refused_before_the_job_stops() {
    unsplittable_rescale(true).await;
}

async fn unsplittable_rescale(prestage: bool) {
    bounded(async {
        let name = if prestage {
            "unsplittable-prestaged"
        } else {
            "unsplittable"
        };
        let mut d = Driver::new(name, 2, "1h");
        d.spec = count_program_spec(name, 2);
        if prestage {
            d.spec.rescale_strategy = keyshift::crd::RescaleStrategy::Prestage;
        }
        d.workers
            .set_programs(image_with_count(count_with_unsplittable_totals::job()));
        d.until_running(2).await;
        d.assert_processing().await;

        d.spec.replicas = 3;
        d.until("refused and stalled", Duration::from_secs(30), |d| {
            d.running_at(2)
                && d.condition("Stalled")
                    .is_some_and(|(r, _)| r == "StartRefused")
        })
        .await;
        let (_, message) = d.condition("Stalled").expect("Stalled");
        for needle in [
            "operator state \"totals\" declares no redistribution",
            "split",
            "union",
            "broadcast",
            "keep the parallelism at 2",
            "runs on at parallelism 2",
        ] {
            assert!(message.contains(needle), "{needle:?} in {message}");
        }
        if prestage {
            // Refused while the old run went on: it never stopped.
            assert_eq!(
                d.events_named("RescaleAbandoned").len(),
                1,
                "{}",
                d.event_log()
            );
            assert!(
                d.events_named("SavepointTaken").is_empty(),
                "{}",
                d.event_log()
            );
            assert!(
                d.events_named("RescaleRollingBack").is_empty(),
                "{}",
                d.event_log()
            );
            assert_eq!(d.events_named("Started").len(), 1, "{}", d.event_log());
        } else {
            assert_eq!(
                d.events_named("RescaleRollingBack").len(),
                1,
                "{}",
                d.event_log()
            );
        }
        // Past the rescale's backoff: not tried again, and the job keeps processing.
        let not_tried_again = |d: &Driver| {
            assert_eq!(
                d.events_named("RescaleStarted").len(),
                1,
                "{}",
                d.event_log()
            );
            assert!(d.workers.live().len() == 2);
        };
        d.for_a_while(Duration::from_secs(12), not_tried_again)
            .await;
        d.assert_processing().await;
        let kept = d.status.start_refused.clone().expect("status.startRefused");
        assert_eq!(
            (kept.reason.as_str(), kept.parallelism),
            ("StartRefused", Some(3))
        );

        // A new operator process (a restart, another leader) reads the refusal from status:
        // it adopts the running job and does not try the change again either.
        d.restart();
        d.for_a_while(Duration::from_secs(12), not_tried_again)
            .await;
        assert!(
            d.condition("Stalled")
                .is_some_and(|(r, m)| r == "StartRefused" && m.contains("\"totals\"")),
            "{:?}",
            d.condition("Stalled")
        );
        d.assert_processing().await;

        // The old run dies: it comes back at 2 (the parallelism it ran at), not at the refused
        // 3, and the job is Stalled on the change as before.
        let before = d.workers.names();
        d.workers.kill(0).expect("worker 0 exists");
        d.until("back at 2", Duration::from_secs(30), |d| {
            d.running_at(2)
                && d.workers.names() != before
                && d.condition("Stalled").is_some_and(|(r, m)| {
                    r == "StartRefused" && m.contains("runs on at parallelism 2")
                })
        })
        .await;
        assert_eq!(
            d.events_named("RescaleStarted").len(),
            1,
            "{}",
            d.event_log()
        );
        d.assert_processing().await;

        // The replicas set back: the stall clears, the job runs at 2.
        d.spec.replicas = 2;
        d.until("no longer stalled", Duration::from_secs(20), |d| {
            d.running_at(2) && d.condition("Stalled").is_none()
        })
        .await;
        assert_eq!(d.status.start_refused, None);
        d.assert_processing().await;
    })
    .await;
}

/// An upgrade that keeps the state (`savepoint` or `last-state`) is pre-staged (the default
/// strategy): the new spec's workers load the state while the job runs. A new image whose
/// program cannot read the state (its `count` declared at version 2 without a migration) is
/// refused while they load, before the job stops: no snapshot, the same workers run on, Stalled
/// StartRefused naming the state, and no second attempt while the spec stays. A compatible image
/// then upgrades, pre-staged, and the job runs on exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prestaged_upgrade_whose_image_cannot_read_the_state_is_refused_before_the_job_stops() {
    prestaged_upgrade_refused_then_fixed(keyshift::crd::UpgradeMode::Savepoint).await;
}

/// The same for a `last-state` upgrade: it stops with a checkpoint of what changed since the
/// new workers loaded, never a savepoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prestaged_last_state_upgrade_whose_image_cannot_read_the_state_is_refused_before_the_job_stops()
 {
    prestaged_upgrade_refused_then_fixed(keyshift::crd::UpgradeMode::LastState).await;
}

async fn prestaged_upgrade_refused_then_fixed(mode: keyshift::crd::UpgradeMode) {
    bounded(async {
        let name = match mode {
            keyshift::crd::UpgradeMode::LastState => "upgrade-checked-last",
            _ => "upgrade-checked",
        };
        let mut d = Driver::new(name, 2, "1h");
        d.spec = count_program_spec(name, 2);
        d.spec.rescale_strategy = keyshift::crd::RescaleStrategy::Prestage;
        d.spec.upgrade_mode = mode;
        d.workers
            .set_programs(image_with_count(keyshift_examples::count::job()));
        d.until_running(2).await;
        d.assert_processing().await;
        let workers = d.workers.names();

        // The next image's `count` reads its state at version 2 and declares no migration.
        d.workers
            .set_programs(image_with_count(count_at_version_2::job()));
        d.spec.image = Some("keyshift:next".into());
        d.until("refused and stalled", Duration::from_secs(30), |d| {
            d.running_at(2)
                && d.condition("Stalled")
                    .is_some_and(|(r, _)| r == "StartRefused")
        })
        .await;
        let (_, message) = d.condition("Stalled").expect("Stalled");
        for needle in ["state \"count\" changed", "runs on at parallelism 2"] {
            assert!(message.contains(needle), "{needle:?} in {message}");
        }
        assert_eq!(
            d.events_named("UpgradeStarted").len(),
            1,
            "{}",
            d.event_log()
        );
        assert_eq!(
            d.events_named("RescaleAbandoned").len(),
            1,
            "{}",
            d.event_log()
        );
        assert!(
            d.events_named("SavepointTaken").is_empty(),
            "{}",
            d.event_log()
        );
        assert_eq!(d.workers.names(), workers, "the job never stopped");
        d.for_a_while(Duration::from_secs(12), |d| {
            assert_eq!(
                d.events_named("UpgradeStarted").len(),
                1,
                "{}",
                d.event_log()
            );
        })
        .await;
        d.assert_processing().await;

        // A compatible image: the upgrade goes through, pre-staged.
        d.workers
            .set_programs(image_with_count(keyshift_examples::count::job()));
        d.spec.image = Some("keyshift:fixed".into());
        d.until("upgraded", Duration::from_secs(60), |d| {
            d.step() == Some(Step::Done) && d.running_at(2) && d.condition("Stalled").is_none()
        })
        .await;
        let r = d.rescale();
        assert!(r.prestaged().is_some(), "the upgrade was pre-staged: {r:?}");
        assert_eq!(r.fallback, None);
        assert_eq!(r.upgrade_mode, Some(mode));
        // A savepoint upgrade keeps its savepoint; a last-state one took none (its stop
        // snapshot is a checkpoint, and the new workers started from it).
        assert_eq!(
            d.status.last_savepoint.is_some(),
            mode == keyshift::crd::UpgradeMode::Savepoint,
            "{:?} / {:?}",
            d.status.last_savepoint,
            r.savepoint
        );
        if mode == keyshift::crd::UpgradeMode::LastState {
            let stop = r
                .savepoint
                .clone()
                .expect("the stop checkpoint was recorded");
            assert_eq!(
                d.status.last_checkpoint.as_ref().map(|c| c.path.as_str()),
                Some(stop.as_str())
            );
        }
        assert_eq!(d.events_named("Upgraded").len(), 1, "{}", d.event_log());
        d.assert_processing().await;
    })
    .await;
}

/// An image carrying `count` as `job` builds it.
fn image_with_count(job: keyshift_sdk::dataflow::Job) -> keyshift::job::Programs {
    keyshift::job::Programs::new()
        .with("count", job)
        .expect("a valid program")
}

/// A restart whose new workers find, while restoring, that the snapshot's state does not fit
/// their program (a new image whose state declaration changed without a migration) stalls the
/// job with the workers' reason (StartRefused, naming the state), as a start refused at the
/// request does: no retry while nothing changes, a start again once the image is fixed and
/// the spec changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_the_changed_program_cannot_read_stalls_instead_of_retrying() {
    bounded(async {
        let name = "changed-state";
        let mut d = Driver::new(name, 2, "1h");
        d.spec = count_program_spec(name, 2);
        d.workers.set_spec_hash(settings::spec_hash(&d.spec));
        d.workers
            .set_programs(image_with_count(keyshift_examples::count::job()));
        d.until_running(2).await;
        d.assert_processing().await;
        d.spec.savepoint_trigger_nonce = Some(1);
        d.until("savepoint taken", Duration::from_secs(20), |d| {
            d.status.last_savepoint_nonce == Some(1)
        })
        .await;

        // The next image's `count` reads its state at version 2 and declares no migration.
        d.workers
            .set_programs(image_with_count(count_at_version_2::job()));
        d.workers.kill(0).expect("worker 0 exists");
        d.stalls_refused_without_retry(&["state \"count\" changed", "Declarations::migrate"])
            .await;

        // The image is fixed, and the spec changes: the job starts from its savepoint again.
        d.workers
            .set_programs(image_with_count(keyshift_examples::count::job()));
        d.runs_again_at(3).await;
    })
    .await;
}

/// Restoring at the new parallelism fails: the old parallelism is restored from the same
/// savepoint (RescaleRollingBack, then RolledBack), and the rescale is retried later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_failure_rolls_back_to_the_old_parallelism_and_retries_later() {
    bounded(async {
        let mut d = Driver::new("restore-fails", 2, "1h");
        d.until_running(2).await;
        d.workers.faults().refuse_start_at = Some(3);
        d.spec.replicas = 3;
        d.until("rolled back", Duration::from_secs(30), |d| {
            d.step() == Some(Step::RolledBack) && d.running_at(2)
        })
        .await;
        let rolled_back_at = Instant::now();
        assert!(d.workers.faults().starts_refused >= 1);
        let r = d.rescale();
        let sp = r.savepoint.clone().expect("the rescale's savepoint");
        assert!(r.rolled_back.is_some());
        for reason in ["RescaleRollingBack", "RescaleRolledBack"] {
            let e = d.events_named(reason);
            assert_eq!(e.len(), 1, "{reason}\n{}", d.event_log());
            assert!(e[0].1.warning, "{reason} is a warning");
        }
        let started = d.events_named("Started");
        let last = &started.last().expect("a Started event").1;
        assert!(
            last.note.contains(&sp) && last.note.contains("2 workers"),
            "the rollback did not restore the old parallelism from the same savepoint {sp}: {}",
            last.note
        );
        assert_eq!(
            d.steps.last().map(|(_, s)| s.last()),
            Some(Some(&Step::RolledBack))
        );
        assert_exact(&d.spec, &sp).await;
        d.assert_processing().await;

        // Retried, but not at once.
        d.workers.faults().refuse_start_at = None;
        d.until("rescaled to 3", Duration::from_secs(30), |d| {
            d.step() == Some(Step::Done) && d.running_at(3)
        })
        .await;
        let starts = d.events_named("RescaleStarted");
        assert_eq!(starts.len(), 2);
        let retry_after = starts[1].0 - rolled_back_at;
        assert!(
            retry_after >= Duration::from_millis(9_500),
            "retried {retry_after:?} after the rollback"
        );
        d.suspend_and_check().await;
    })
    .await;
}

/// The orchestrator restarts as soon as `step` is recorded (before the step acts, like the
/// end-to-end tests' pause hook): a fresh orchestrator resumes from status and the workers,
/// finishes the rescale, and the state is exact.
async fn restart_in(step: Step, name: &str) {
    bounded(async {
        let mut d = Driver::new(name, 2, "1h");
        d.until_running(2).await;
        d.spec.replicas = 3;
        d.until(&format!("in {step}"), Duration::from_secs(20), |d| {
            d.step() == Some(step)
        })
        .await;
        d.restart();
        d.until(
            "rescaled to 3 after a restart",
            Duration::from_secs(30),
            |d| d.step() == Some(Step::Done) && d.running_at(3),
        )
        .await;
        let steps = &d.steps.last().expect("the rescale").1;
        assert_eq!(
            steps,
            &[
                Step::Savepointing,
                Step::Verifying,
                Step::Stopping,
                Step::Restoring,
                Step::Done
            ],
            "{}",
            d.event_log()
        );
        assert!(d.events_named("RescaleAbandoned").is_empty());
        assert!(d.events_named("RescaleRollingBack").is_empty());
        let sp = d.rescale().savepoint.expect("the rescale's savepoint");
        assert_exact(&d.spec, &sp).await;
        d.assert_processing().await;
        d.suspend_and_check().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_in_savepointing_resumes_and_finishes() {
    restart_in(Step::Savepointing, "restart-sp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_in_verifying_resumes_and_finishes() {
    restart_in(Step::Verifying, "restart-verify").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_in_stopping_resumes_and_finishes() {
    restart_in(Step::Stopping, "restart-stop").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_in_restoring_resumes_and_finishes() {
    restart_in(Step::Restoring, "restart-restore").await;
}

/// The orchestrator dies after `step`'s background work ended but before a pass recorded its
/// outcome (the savepoint is committed and the sources are stopped at its barrier; or the new run
/// is started): a fresh orchestrator resumes from status and the workers, and the state is exact.
async fn restart_unrecorded(step: Step, name: &str) {
    bounded(async {
        let mut d = Driver::new(name, 2, "1h");
        d.until_running(2).await;
        d.spec.replicas = 3;
        d.until(
            &format!("{step} in the background"),
            Duration::from_secs(20),
            |d| d.step() == Some(step) && d.requeue == Some(pass::requeue::BACKGROUND_BACKSTOP),
        )
        .await;
        d.await_background(&format!("{step}'s work")).await;
        // Its outcome waits in the memory that is now lost.
        d.restart();
        d.until(
            "rescaled to 3 after a restart",
            Duration::from_secs(30),
            |d| d.step() == Some(Step::Done) && d.running_at(3),
        )
        .await;
        assert!(
            d.events_named("RescaleAbandoned").is_empty(),
            "{}",
            d.event_log()
        );
        assert!(d.events_named("RescaleRollingBack").is_empty());
        let sp = d.rescale().savepoint.expect("the rescale's savepoint");
        assert_exact(&d.spec, &sp).await;
        d.assert_processing().await;
        d.suspend_and_check().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_after_an_unrecorded_savepoint_resumes_and_finishes() {
    restart_unrecorded(Step::Savepointing, "unrecorded-sp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_after_an_unrecorded_start_resumes_and_finishes() {
    restart_unrecorded(Step::Restoring, "unrecorded-start").await;
}

/// The orchestrator restarts while the new run's workers exist but were not started yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_in_restoring_with_new_workers_created_resumes_and_finishes() {
    bounded(async {
        let mut d = Driver::new("restart-created", 2, "1h");
        d.until_running(2).await;
        d.spec.replicas = 3;
        d.until(
            "in Restoring with 3 new workers",
            Duration::from_secs(20),
            |d| {
                d.step() == Some(Step::Restoring)
                    && d.workers.names().len() == 3
                    && !d.mem.coordinating()
            },
        )
        .await;
        let created = d.workers.names();
        d.restart();
        d.until(
            "rescaled to 3 after a restart",
            Duration::from_secs(30),
            |d| d.step() == Some(Step::Done) && d.running_at(3),
        )
        .await;
        assert_eq!(d.workers.names(), created, "the new workers were replaced");
        let sp = d.rescale().savepoint.expect("the rescale's savepoint");
        assert_exact(&d.spec, &sp).await;
        d.suspend_and_check().await;
    })
    .await;
}

/// A worker killed while the job runs: WorkerFailed, the job restarts from its last
/// checkpoint on new workers, and the state is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_worker_recovers_from_the_last_checkpoint() {
    bounded(async {
        let mut d = Driver::new("killed", 2, "1s");
        d.until_running(2).await;
        d.until("checkpointed", Duration::from_secs(20), |d| {
            d.status.last_checkpoint.is_some()
        })
        .await;
        let old = d.workers.names();
        let killed = d.workers.kill(1).expect("worker 1 exists");
        d.until("failed over", Duration::from_secs(20), |d| {
            !d.events_named("WorkerFailed").is_empty()
        })
        .await;
        let cp = d.status.last_checkpoint.clone().expect("a checkpoint").path;
        let failed = d.events_named("WorkerFailed");
        assert!(failed[0].1.warning);
        assert!(failed[0].1.note.contains(&killed), "{}", failed[0].1.note);
        let starts_before = d.events_named("Started").len();
        d.until_running(2).await;
        assert!(
            d.workers.names().iter().all(|n| !old.contains(n)),
            "the job runs on new workers"
        );
        let started = d.events_named("Started");
        assert_eq!(started.len(), starts_before + 1, "{}", d.event_log());
        let note = &started.last().expect("Started").1.note;
        assert!(
            note.contains(&cp),
            "the restart did not restore the last checkpoint {cp}: {note}"
        );
        assert!(d.step().is_none(), "a recovery is no transition");
        assert_exact(&d.spec, &cp).await;
        d.assert_processing().await;
        d.suspend_and_check().await;
    })
    .await;
}

/// The checker every pass goes through rejects what the step table forbids (so the tests above
/// would notice), and a plain rescale records every step in status, in table order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passes_follow_the_step_table() {
    let r = |step: Step| RescaleStatus {
        from: 1,
        to: 2,
        step,
        started: "t0".into(),
        ..Default::default()
    };
    let ev = |reason: &str| PendingEvent {
        warning: false,
        reason: reason.into(),
        note: String::new(),
    };
    // Legal.
    for (a, b) in [
        (Step::Savepointing, Step::Verifying),
        (Step::Verifying, Step::Stopping),
        (Step::Stopping, Step::Restoring),
        (Step::Restoring, Step::Restoring),
    ] {
        check_change(Some(&r(a)), Some(&r(b)), &[]).unwrap();
    }
    check_change(
        Some(&r(Step::Restoring)),
        Some(&r(Step::Done)),
        &[ev("Rescaled")],
    )
    .unwrap();
    check_change(
        Some(&r(Step::Verifying)),
        Some(&r(Step::Abandoned)),
        &[ev("RescaleAbandoned")],
    )
    .unwrap();
    check_change(None, Some(&r(Step::Savepointing)), &[]).unwrap();
    // Illegal: skipped steps, going back, abandoning after the stop, a lost record, a step
    // change without its Event, an Event without its change.
    for (a, b) in [
        (Step::Savepointing, Step::Stopping),
        (Step::Verifying, Step::Savepointing),
        (Step::Stopping, Step::Abandoned),
        (Step::Restoring, Step::Abandoned),
        (Step::Done, Step::Restoring),
    ] {
        assert!(
            check_change(Some(&r(a)), Some(&r(b)), &[ev("RescaleAbandoned")]).is_err(),
            "{a} -> {b}"
        );
    }
    assert!(check_change(Some(&r(Step::Restoring)), None, &[]).is_err());
    assert!(check_change(None, Some(&r(Step::Stopping)), &[]).is_err());
    assert!(check_change(Some(&r(Step::Restoring)), Some(&r(Step::Done)), &[]).is_err());
    assert!(
        check_change(
            Some(&r(Step::Stopping)),
            Some(&r(Step::Stopping)),
            &[ev("RescaleAbandoned")]
        )
        .is_err()
    );

    bounded(async {
        let mut d = Driver::new("table", 1, "1h");
        d.until_running(1).await;
        d.spec.replicas = 2;
        d.until("rescaled to 2", Duration::from_secs(20), |d| {
            d.step() == Some(Step::Done) && d.running_at(2)
        })
        .await;
        assert_eq!(
            d.steps,
            vec![(
                d.rescale().started,
                vec![
                    Step::Savepointing,
                    Step::Verifying,
                    Step::Stopping,
                    Step::Restoring,
                    Step::Done
                ]
            )]
        );
        let r = d.rescale();
        for s in [
            Step::Savepointing,
            Step::Verifying,
            Step::Stopping,
            Step::Restoring,
        ] {
            assert!(
                r.step_seconds.contains_key(s.as_str()),
                "no time for {s}: {:?}",
                r.step_seconds
            );
        }
        d.suspend_and_check().await;
    })
    .await;
}

/// A job whose status records committed snapshots never starts empty: with every snapshot gone
/// from storage, the restart after a worker failure is refused (StartFailed, saying what to do)
/// and retried with backoff, and no run starts without the state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_with_recorded_snapshots_never_restarts_empty() {
    bounded(async {
        let mut d = Driver::new("lost-snapshots", 2, "1s");
        d.until_running(2).await;
        d.until("checkpointed", Duration::from_secs(20), |d| {
            d.status.last_checkpoint.is_some()
        })
        .await;
        // Every object of the job is lost.
        let (store, base) = keyshift::snapshot::open_store(&d.storage).expect("store");
        let all: Vec<_> = futures::TryStreamExt::try_collect(store.list(Some(&base)))
            .await
            .expect("listing");
        assert!(!all.is_empty());
        for meta in all {
            object_store::ObjectStoreExt::delete(store.as_ref(), &meta.location)
                .await
                .expect("delete");
        }
        d.restart_is_refused(&["refusing to start empty", "upgradeMode: stateless"])
            .await;
    })
    .await;
}

/// A resume falls back past any snapshot it cannot restore, not only past an unreadable
/// manifest: with the newest savepoint's state file lost, the restart after a worker failure
/// would go back past that savepoint's published output, so it stalls (OutputWouldRepeat,
/// naming the snapshot, the sink and the edit that confirms it) and starts nothing until
/// spec.allowRepublishingOutput is set; then it restores the one before (an
/// UnreadableSnapshotSkipped Event names the lost file); with every
/// snapshot's state lost, it refuses to start (StartFailed names each snapshot and why) and no
/// run starts without the state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_falls_back_past_snapshots_whose_state_is_lost_and_never_starts_empty() {
    bounded(async {
        let mut d = Driver::new("lost-files", 2, "1h");
        d.until_running(2).await;
        let mut savepoints = Vec::new();
        for nonce in 1..=2 {
            d.spec.savepoint_trigger_nonce = Some(nonce);
            d.until("savepoint taken", Duration::from_secs(20), |d| {
                d.status.last_savepoint_nonce == Some(nonce)
            })
            .await;
            savepoints.push(d.status.last_savepoint.clone().expect("a savepoint").path);
        }
        let (store, _) = keyshift::snapshot::open_store(&d.storage).expect("store");
        let lose = |url: &str| {
            let store = store.clone();
            let (_, dir) = keyshift::snapshot::open_store(url).expect("snapshot dir");
            async move {
                let files: Vec<_> = futures::TryStreamExt::try_collect(store.list(Some(&dir)))
                    .await
                    .expect("listing");
                let mut lost = 0;
                for meta in files {
                    if meta.location.as_ref().ends_with(".bin") {
                        object_store::ObjectStoreExt::delete(store.as_ref(), &meta.location)
                            .await
                            .expect("delete");
                        lost += 1;
                    }
                }
                assert!(lost > 0, "no state file under {dir}");
            }
        };
        lose(&savepoints[1]).await;
        let started_before = d.events_named("Started").len();
        d.workers.kill(0).expect("worker 0 exists");
        // The resume would go back past sp-2's published output: it waits for the one edit
        // that confirms it, and nothing starts meanwhile.
        d.until("refused", Duration::from_secs(30), |d| {
            d.condition("Stalled").is_some()
        })
        .await;
        let (reason, message) = d.condition("Stalled").expect("Stalled");
        assert_eq!(reason, "OutputWouldRepeat", "{message}");
        for needle in [
            savepoints[0].as_str(),
            "memory://lost-files/sink",
            "allowRepublishingOutput: true",
        ] {
            assert!(message.contains(needle), "{needle}: {message}");
        }
        d.for_a_while(Duration::from_secs(2), |d| {
            assert_eq!(d.events_named("Started").len(), started_before);
        })
        .await;
        d.spec.allow_republishing_output = true;
        d.until("restarted", Duration::from_secs(30), |d| {
            d.events_named("Started").len() > started_before
        })
        .await;
        let started = &d.events_named("Started").last().expect("Started").1.note;
        assert!(started.contains(&savepoints[0]), "{started}");
        let skipped = d.events_named("UnreadableSnapshotSkipped");
        let note = &skipped.last().expect("the skipped snapshot is said").1.note;
        assert!(
            note.contains(&format!(
                "sp-{}",
                savepoints[1].rsplit("sp-").next().unwrap_or("")
            )) && note.contains("is missing"),
            "{note}"
        );
        d.assert_processing().await;

        // Every snapshot's state lost: nothing is restorable, and nothing starts.
        let (_, base) = keyshift::snapshot::open_store(&d.storage).expect("store");
        let all: Vec<_> = futures::TryStreamExt::try_collect(store.list(Some(&base)))
            .await
            .expect("listing");
        for meta in all {
            if meta.location.as_ref().ends_with(".bin") {
                object_store::ObjectStoreExt::delete(store.as_ref(), &meta.location)
                    .await
                    .expect("delete");
            }
        }
        d.restart_is_refused(&[
            "none of the job's snapshots",
            "is missing",
            "upgradeMode: stateless",
        ])
        .await;
    })
    .await;
}

/// A snapshot whose files are all there but one of whose blocks no longer matches its checksum
/// is found by the restore itself: the start fails (StartFailed says the snapshot cannot be
/// restored), and the next attempt passes over it to the snapshot before (an
/// UnreadableSnapshotSkipped Event names it and the checksum), instead of retrying it forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_falls_back_past_a_snapshot_whose_block_is_corrupt() {
    bounded(async {
        let mut d = Driver::new("corrupt-block", 2, "1h");
        // Going back past the corrupt savepoint's published output is confirmed up front.
        d.spec.allow_republishing_output = true;
        d.until_running(2).await;
        let mut savepoints = Vec::new();
        for nonce in 1..=2 {
            d.assert_processing().await;
            d.spec.savepoint_trigger_nonce = Some(nonce);
            d.until("savepoint taken", Duration::from_secs(20), |d| {
                d.status.last_savepoint_nonce == Some(nonce)
            })
            .await;
            savepoints.push(d.status.last_savepoint.clone().expect("a savepoint").path);
        }
        // Every state file of the newest savepoint: the same size, other bytes.
        let (store, dir) = keyshift::snapshot::open_store(&savepoints[1]).expect("store");
        let files: Vec<_> = futures::TryStreamExt::try_collect(store.list(Some(&dir)))
            .await
            .expect("listing");
        let mut flipped = 0;
        for meta in files {
            if !meta.location.as_ref().ends_with(".bin") || meta.size == 0 {
                continue;
            }
            let bytes = object_store::ObjectStoreExt::get(store.as_ref(), &meta.location)
                .await
                .expect("get")
                .bytes()
                .await
                .expect("bytes");
            let other: Vec<u8> = bytes.iter().map(|b| b ^ 0xff).collect();
            object_store::ObjectStoreExt::put(store.as_ref(), &meta.location, other.into())
                .await
                .expect("put");
            flipped += 1;
        }
        assert!(flipped > 0, "no state to corrupt under {dir}");
        let started_before = d.events_named("Started").len();
        let failed_before = d.events_named("StartFailed").len();
        d.workers.kill(0).expect("worker 0 exists");
        d.until("restarted", Duration::from_secs(60), |d| {
            d.events_named("Started").len() > started_before
        })
        .await;
        let failed = &d.events_named("StartFailed")[failed_before..];
        let first = &failed
            .first()
            .expect("the corrupt restore failed first")
            .1
            .note;
        assert!(
            first.contains("cannot be restored")
                && first.contains(&savepoints[1])
                && first.contains("passes over"),
            "{first}"
        );
        let started = &d.events_named("Started").last().expect("Started").1.note;
        assert!(started.contains(&savepoints[0]), "{started}");
        let skipped = d.events_named("UnreadableSnapshotSkipped");
        let note = &skipped.last().expect("the skipped snapshot is said").1.note;
        assert!(note.contains("checksum"), "{note}");
        d.assert_processing().await;
    })
    .await;
}

/// A restoreFrom of the job's own snapshot never publishes a result twice by itself: the
/// savepoint the running job stops with before restoring its newest savepoint publishes nothing
/// (the records after the restored snapshot are processed again and published once, by the new
/// run); a restoreFrom of a snapshot older than the sink's published output is refused before
/// anything stops (Stalled OutputWouldRepeat, the same workers running) until
/// spec.allowRepublishingOutput confirms it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_from_never_goes_back_past_published_output_by_itself() {
    bounded(async {
        let mut d = Driver::new("own-restore", 2, "1h");
        d.until_running(2).await;
        d.assert_processing().await;
        d.spec.savepoint_trigger_nonce = Some(1);
        d.until("savepoint taken", Duration::from_secs(20), |d| {
            d.status.last_savepoint_nonce == Some(1)
        })
        .await;
        let first = d.status.last_savepoint.clone().expect("a savepoint");
        d.assert_processing().await;
        let (store, base) =
            keyshift::snapshot::open_store("memory://own-restore/sink").expect("sink");
        let published = |store: std::sync::Arc<dyn object_store::ObjectStore>,
                         base: object_store::path::Path| async move {
            let listing = store
                .list_with_delimiter(Some(&base))
                .await
                .expect("sink listing");
            let mut ids: Vec<u64> = listing
                .common_prefixes
                .iter()
                .filter_map(|p| p.filename()?.strip_prefix("snap-")?.parse().ok())
                .collect();
            ids.sort_unstable();
            ids
        };
        assert_eq!(
            published(store.clone(), base.clone()).await,
            vec![first.id as u64]
        );

        // The newest savepoint: nothing published after it, so the restore goes ahead, and the
        // savepoint the job stops with holds its output back.
        d.spec.restore_from = Some(first.path.clone());
        d.until("restored", Duration::from_secs(30), |d| {
            d.step() == Some(Step::Done)
                && d.status.restored_from.as_deref() == Some(first.path.as_str())
                && d.running_at(2)
        })
        .await;
        let held = d.rescale().savepoint.expect("the transition's savepoint");
        d.assert_processing().await;
        d.spec.savepoint_trigger_nonce = Some(2);
        d.until("savepoint taken", Duration::from_secs(20), |d| {
            d.status.last_savepoint_nonce == Some(2)
        })
        .await;
        let after = d.status.last_savepoint.clone().expect("a savepoint");
        let ids = published(store.clone(), base.clone()).await;
        assert_eq!(ids, vec![first.id as u64, after.id as u64], "held {held}");

        // Older than what the sink published: refused before anything stops.
        let workers = d.workers.names();
        d.spec.restore_from = Some(held.clone());
        d.until("refused", Duration::from_secs(20), |d| {
            d.condition("Stalled").is_some()
        })
        .await;
        let (reason, message) = d.condition("Stalled").expect("Stalled");
        assert_eq!(reason, "OutputWouldRepeat", "{message}");
        for needle in [
            held.as_str(),
            "memory://own-restore/sink",
            "nothing was stopped",
            "allowRepublishingOutput: true",
        ] {
            assert!(message.contains(needle), "{needle}: {message}");
        }
        d.for_a_while(Duration::from_secs(2), |d| {
            assert_eq!(d.workers.names(), workers, "nothing stopped");
        })
        .await;
        d.spec.allow_republishing_output = true;
        d.until("restored the older one", Duration::from_secs(30), |d| {
            d.step() == Some(Step::Done)
                && d.status.restored_from.as_deref() == Some(held.as_str())
                && d.running_at(2)
        })
        .await;
        assert!(d.condition("Stalled").is_none());
    })
    .await;
}

/// A restore from spec.restoreFrom replaces the job's history: a worker that dies right after the
/// restored run started (before its first checkpoint commits) restarts from spec.restoreFrom
/// again, never from the job's older own snapshots (the transition's savepoint holds the state
/// the restore replaced).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_right_after_a_restore_from_does_not_bring_back_the_replaced_history() {
    bounded(async {
        let mut d = Driver::new("restore-crash", 2, "1h");
        d.until_running(2).await;
        // A savepoint to restore later, then more history after it.
        d.spec.savepoint_trigger_nonce = Some(1);
        d.until("savepoint taken", Duration::from_secs(20), |d| {
            d.status.last_savepoint_nonce == Some(1)
        })
        .await;
        let target = d.status.last_savepoint.clone().expect("a savepoint").path;
        d.assert_processing().await;
        d.spec.restore_from = Some(target.clone());
        d.until("restored", Duration::from_secs(30), |d| {
            d.step() == Some(Step::Done) && d.status.restored_from.as_deref() == Some(&target)
        })
        .await;
        let replaced = d
            .rescale()
            .savepoint
            .clone()
            .expect("the transition's savepoint");
        assert_ne!(replaced, target);
        assert!(d.status.replaced_history_up_to.is_some(), "{:?}", d.status);
        // Before the restored run commits anything of its own, a worker dies.
        let started_before = d.events_named("Started").len();
        d.workers.kill(0).expect("worker 0 exists");
        d.until("restarted", Duration::from_secs(30), |d| {
            d.events_named("Started").len() > started_before
        })
        .await;
        let started = &d.events_named("Started").last().expect("Started").1.note;
        let committed_since = d
            .status
            .last_checkpoint
            .as_ref()
            .filter(|c| d.status.replaced_history_up_to.is_some_and(|b| c.id > b))
            .map(|c| c.path.clone());
        match committed_since {
            // The restored run checkpointed before the kill: that is its own new history.
            Some(cp) => assert!(started.contains(&cp), "{started}"),
            None => assert!(
                started.contains(&target) && !started.contains(&replaced),
                "the restart brought back the replaced history: {started}"
            ),
        }
    })
    .await;
}

/// A changed key (or any other part of what the state means) is refused before anything stops:
/// the running job keeps its workers and keeps checkpointing, Stalled names the field and the
/// fix. A change of the aggregate function is refused even with the opt-in; a key change with
/// the opt-in (spec.allowStateLayoutChange) is upgraded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_key_is_refused_before_anything_stops() {
    bounded(async {
        let mut d = Driver::new("layout", 2, "1s");
        d.until_running(2).await;
        d.until("checkpointed", Duration::from_secs(20), |d| {
            d.status.last_checkpoint.is_some()
        })
        .await;
        let workers = d.workers.names();
        d.spec.job.key.as_mut().expect("a key").field = "value".into();
        d.spec.job.key.as_mut().expect("a key").key_type = keyshift::keygroup::KeyType::Long;
        d.until("refused", Duration::from_secs(20), |d| {
            d.condition("Stalled").is_some()
        })
        .await;
        let (reason, message) = d.condition("Stalled").expect("Stalled");
        assert_eq!(reason, "StateLayoutChanged");
        for needle in [
            "spec.job.key.field",
            "spec.job.key.type",
            "allowStateLayoutChange",
            "upgradeMode: stateless",
            "keeps running",
        ] {
            assert!(message.contains(needle), "{needle:?} in {message}");
        }
        assert_eq!(d.events_named("StateLayoutChanged").len(), 1);
        let checkpoint = d.status.last_checkpoint.as_ref().map_or(0, |c| c.id);
        d.for_a_while(Duration::from_secs(3), |d| {
            assert!(
                d.status.rescale.is_none(),
                "an upgrade began: {:?}",
                d.status.rescale
            );
        })
        .await;
        assert_eq!(d.workers.names(), workers, "the workers kept running");
        // A checkpoint after the refusal (within the window above on a quiet machine; a loaded
        // CI runner may take longer to cut one).
        d.until(
            "the job keeps checkpointing",
            Duration::from_secs(30),
            |d| d.status.last_checkpoint.as_ref().map_or(0, |c| c.id) > checkpoint,
        )
        .await;
        assert_eq!(d.workers.names(), workers, "the workers kept running");
        assert_eq!(
            d.events_named("StateLayoutChanged").len(),
            1,
            "one Event:\n{}",
            d.event_log()
        );
        // Another function cannot be kept, opt-in or not.
        d.spec.allow_state_layout_change = true;
        d.spec
            .job
            .aggregation
            .as_mut()
            .expect("an aggregation")
            .function = keyshift::crd::AggregateFunction::Sum;
        d.spec
            .job
            .aggregation
            .as_mut()
            .expect("an aggregation")
            .field = Some("value".into());
        d.until("refused again", Duration::from_secs(20), |d| {
            d.condition("Stalled")
                .is_some_and(|(_, m)| m.contains("spec.job.aggregation.function"))
        })
        .await;
        let (_, message) = d.condition("Stalled").expect("Stalled");
        assert!(message.contains("cannot be kept"), "{message}");
        assert!(d.status.rescale.is_none());
        // Back to count: the key change alone is kept with the opt-in.
        d.spec
            .job
            .aggregation
            .as_mut()
            .expect("an aggregation")
            .function = keyshift::crd::AggregateFunction::Count;
        d.spec
            .job
            .aggregation
            .as_mut()
            .expect("an aggregation")
            .field = None;
        d.until("upgraded", Duration::from_secs(30), |d| {
            d.step() == Some(Step::Done) && d.running_at(2) && d.condition("Stalled").is_none()
        })
        .await;
        assert_ne!(d.workers.names(), workers, "upgraded to new workers");
    })
    .await;
}

/// A suspended job whose key changed is not resumed from its old state: the start is refused
/// (the snapshot stays), and resuming after the change is reverted continues exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspended_job_with_a_changed_key_does_not_resume_its_old_state() {
    bounded(async {
        let mut d = Driver::new("layout-resume", 2, "1s");
        d.until_running(2).await;
        d.spec.suspend = true;
        d.until("suspended", Duration::from_secs(30), |d| {
            d.status.phase == Some(Phase::Suspended)
        })
        .await;
        d.spec.job.key.as_mut().expect("a key").field = "ts".into();
        d.spec.suspend = false;
        d.until("refused", Duration::from_secs(20), |d| {
            !d.events_named("StateLayoutChanged").is_empty()
        })
        .await;
        let refused = &d.events_named("StateLayoutChanged")[0].1;
        assert!(refused.warning);
        assert!(
            refused.note.contains("spec.job.key.field"),
            "{}",
            refused.note
        );
        assert!(d.events_named("Started").len() <= 1, "{}", d.event_log());
        d.spec.job.key.as_mut().expect("a key").field = "key".into();
        d.until_running(2).await;
        d.assert_processing().await;
        d.spec.suspend = true;
        d.until("suspended again", Duration::from_secs(30), |d| {
            d.status.phase == Some(Phase::Suspended) && d.workers.names().is_empty()
        })
        .await;
        let sp = d.status.last_savepoint.clone().expect("a savepoint").path;
        assert_exact(&d.spec, &sp).await;
    })
    .await;
}

/// spec.restoreFrom naming another job's snapshot is refused (nothing starts) unless the spec
/// says so (spec.allowRestoreFromAnotherJob), and then continues that job's state exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restoring_another_jobs_snapshot_needs_the_opt_in() {
    bounded(async {
        let mut first = Driver::new("first", 2, "1h");
        first.until_running(2).await;
        first.spec.suspend = true;
        first
            .until("suspended", Duration::from_secs(30), |d| {
                d.status.phase == Some(Phase::Suspended)
            })
            .await;
        let sp = first
            .status
            .last_savepoint
            .clone()
            .expect("a savepoint")
            .path;
        let mut second = Driver::new("second", 2, "1h");
        second.spec.job = first.spec.job.clone();
        second.spec.job.sink.url = Some("memory://second/sink".into());
        second.spec.restore_from = Some(sp.clone());
        second
            .until("refused", Duration::from_secs(20), |d| {
                d.condition("Stalled").is_some()
            })
            .await;
        let (reason, message) = second.condition("Stalled").expect("Stalled");
        assert_eq!(reason, "SnapshotOfAnotherJob");
        assert!(
            message.contains("test/first") && message.contains("allowRestoreFromAnotherJob"),
            "{message}"
        );
        assert!(second.workers.names().is_empty(), "nothing started");
        second.spec.allow_restore_from_another_job = true;
        second.until_running(2).await;
        let started = &second
            .events_named("Started")
            .last()
            .expect("Started")
            .1
            .note;
        assert!(started.contains(&sp), "{started}");
    })
    .await;
}

/// Recovery survives a corrupt manifest: a worker dies after the job's newest snapshot was
/// corrupted, and the job comes back from the newest good one, says so (condition
/// NewestSnapshotRestored False and a warning Event naming the bad snapshot), deletes nothing,
/// and ends exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_passes_over_a_corrupt_snapshot_and_says_so() {
    bounded(async {
        let mut d = Driver::new("bad-manifest", 2, "1h");
        // Going back past the bad savepoint's published output is confirmed up front (without
        // it the resume stalls: a_restart_falls_back_past_snapshots_whose_state_is_lost...).
        d.spec.allow_republishing_output = true;
        d.until_running(2).await;
        let mut savepoints = Vec::new();
        for nonce in [1, 2] {
            d.spec.savepoint_trigger_nonce = Some(nonce);
            d.until("savepoint taken", Duration::from_secs(20), |d| {
                d.status.last_savepoint_nonce == Some(nonce)
            })
            .await;
            savepoints.push(d.status.last_savepoint.clone().expect("a savepoint").path);
            d.assert_processing().await;
        }
        let (good, bad) = (&savepoints[0], &savepoints[1]);
        let (store, dir) = snapshot::open_store(bad).expect("store");
        let manifest = snapshot::manifest_path(&dir);
        object_store::ObjectStoreExt::put(
            store.as_ref(),
            &manifest,
            object_store::PutPayload::from_static(b"{\"formatVersion\": 1, \"job\": "),
        )
        .await
        .expect("corrupt the manifest");
        let started_before = d.events_named("Started").len();
        d.workers.kill(0).expect("worker 0 exists");
        d.until("recovered", Duration::from_secs(30), |d| {
            d.events_named("Started").len() > started_before && d.running_at(2)
        })
        .await;
        let started = &d.events_named("Started").last().expect("Started").1.note;
        assert!(
            started.contains(good.as_str()),
            "restored the good one: {started}"
        );
        let skipped = d.events_named("UnreadableSnapshotSkipped");
        assert_eq!(skipped.len(), 1, "{}", d.event_log());
        assert!(skipped[0].1.warning);
        let sp = bad.rsplit('/').next().expect("a directory name");
        assert!(skipped[0].1.note.contains(sp), "{}", skipped[0].1.note);
        let cond = d
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == "NewestSnapshotRestored")
            .expect("the condition");
        assert_eq!(
            (cond.status.as_str(), cond.reason.as_str()),
            ("False", "UnreadableSnapshotSkipped")
        );
        assert!(
            cond.message.contains(sp) && cond.message.contains("Nothing was deleted"),
            "{}",
            cond.message
        );
        object_store::ObjectStoreExt::head(store.as_ref(), &manifest)
            .await
            .expect("the bad snapshot is still there");
        d.suspend_and_check().await;
    })
    .await;
}

/// Checkpoints that keep failing leave the job running on its workers and show in the
/// CheckpointsHealthy condition (with the last error and the checkpoint that stays usable);
/// the first commit after them makes it healthy again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_checkpoints_show_in_a_condition_and_the_job_keeps_running() {
    bounded(async {
        let mut d = Driver::new("cp-failing", 2, "1s");
        d.until_running(2).await;
        d.until("checkpointed", Duration::from_secs(20), |d| {
            d.status.last_checkpoint.is_some()
                && d.condition("CheckpointsHealthy")
                    .is_some_and(|(r, _)| r == "Checkpointing")
        })
        .await;
        let workers = d.workers.names();
        let good = d.status.last_checkpoint.clone().expect("a checkpoint");
        d.workers.faults().fail_checkpoints = true;
        d.until("unhealthy", Duration::from_secs(30), |d| {
            d.status
                .conditions
                .iter()
                .any(|c| c.type_ == "CheckpointsHealthy" && c.status == "False")
        })
        .await;
        let c = d
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == "CheckpointsHealthy")
            .expect("condition");
        assert_eq!(c.reason, "CheckpointsFailing");
        assert!(
            c.message.contains("injected by the fake platform"),
            "{}",
            c.message
        );
        assert!(c.message.contains("checkpointTimeout"), "{}", c.message);
        assert!(d.workers.faults().checkpoints_failed >= 2);
        assert_eq!(d.workers.names(), workers, "the job kept its workers");
        assert_eq!(d.status.phase, Some(Phase::Running));
        let last = d.status.last_checkpoint.clone().expect("a checkpoint");
        assert!(c.message.contains(&last.path), "{}", c.message);
        assert!(last.id >= good.id);
        d.workers.faults().fail_checkpoints = false;
        d.until("healthy again", Duration::from_secs(30), |d| {
            d.condition("CheckpointsHealthy")
                .is_some_and(|(r, _)| r == "Checkpointing")
        })
        .await;
        d.suspend_and_check().await;
    })
    .await;
}

/// The coordinator's traffic grows with the workers, not with time: each checkpoint's
/// acknowledgements cost about one long poll per worker, also when a subtask takes 400 ms to
/// write its state (test hooks; before, every worker was asked every 20 ms until it answered:
/// some 20 requests per such checkpoint).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_costs_about_one_status_request_per_worker() {
    bounded(async {
        let mut d = Driver::new("cp-polls", 3, "1s");
        keyshift::failpoints::slow_snapshots_of(
            NS,
            "cp-polls",
            1,
            Some(Duration::from_millis(400)),
        );
        d.until_running(3).await;
        d.until("checkpointed", Duration::from_secs(20), |d| {
            d.status.last_checkpoint.is_some()
        })
        .await;
        let first = d.status.last_checkpoint.as_ref().map_or(0, |c| c.id);
        let before = d.workers.faults().status_requests;
        d.until("five more checkpoints", Duration::from_secs(30), |d| {
            d.status
                .last_checkpoint
                .as_ref()
                .is_some_and(|c| c.id >= first + 5)
        })
        .await;
        let last = d.status.last_checkpoint.as_ref().map_or(0, |c| c.id);
        let (all, long_polls) = {
            let f = d.workers.faults();
            (f.status_requests, f.status_long_polls)
        };
        let requests = all - before;
        let checkpoints = u64::try_from(last - first).unwrap_or(0);
        assert!(checkpoints >= 5);
        assert_eq!(all, long_polls, "every one a long poll");
        // One per worker and checkpoint, and at most one more for a checkpoint in flight.
        assert!(
            requests <= 3 * (checkpoints + 1),
            "{requests} status requests for {checkpoints} checkpoints of 3 workers"
        );
        assert!(requests >= 3 * checkpoints, "{requests} for {checkpoints}");
        keyshift::failpoints::slow_snapshots_of(NS, "cp-polls", 1, None);
        d.suspend_and_check().await;
    })
    .await;
}

/// A checkpoint trigger that reaches only some workers (the proxy of subtask 1 refuses it) is
/// aborted on every worker: no keyed operator keeps aligning it (before, the next trigger made
/// every operator fail and the job restart), the job keeps running on the same workers, every
/// worker reports the checkpoint aborted, the next checkpoint commits, and the state is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trigger_that_reaches_only_some_workers_is_aborted_and_the_next_checkpoint_commits() {
    bounded(async {
        let mut d = Driver::new("cp-partial", 3, "1s");
        d.until_running(3).await;
        d.until("checkpointed", Duration::from_secs(20), |d| {
            d.status.last_checkpoint.is_some()
        })
        .await;
        let workers = d.workers.names();
        d.workers.faults().refuse_triggers_of = Some(1);
        d.until("a trigger refused", Duration::from_secs(30), |d| {
            !d.workers.faults().triggers_refused.is_empty()
        })
        .await;
        d.workers.faults().refuse_triggers_of = None;
        let refused = d.workers.faults().triggers_refused[0];
        d.until(
            "checkpointed after the refused trigger",
            Duration::from_secs(30),
            |d| {
                d.status
                    .last_checkpoint
                    .as_ref()
                    .is_some_and(|c| c.id > refused as i64)
            },
        )
        .await;
        assert_eq!(d.workers.names(), workers, "the job kept its workers");
        assert_eq!(d.status.phase, Some(Phase::Running));
        for (subtask, endpoint) in d.workers.live() {
            let status: keyshift::runtime::protocol::CheckpointStatus = d
                .http
                .get(format!("{}/v1/checkpoints/{refused}", endpoint.control))
                .bearer_auth(TOKEN)
                .send()
                .await
                .expect("checkpoint status")
                .json()
                .await
                .expect("a checkpoint status");
            assert!(
                matches!(
                    &status,
                    keyshift::runtime::protocol::CheckpointStatus::Failed { error }
                        if error.starts_with("aborted")
                ),
                "subtask {subtask}: checkpoint {refused} is {status:?}"
            );
        }
        d.assert_processing().await;
        d.suspend_and_check().await;
    })
    .await;
}

/// A restore that runs shows its progress in status while it runs (status.restore and the
/// Reconciling condition's message), for a recovery's restore and for a rescale's; status shows
/// a new value at most every `pass::RESTORE_STATUS_EVERY`, and nothing of it once the run
/// started. The restores are slowed by the test hook (after their state is read).
#[cfg(feature = "test-hooks")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_restore_shows_its_progress_in_status() {
    use keyshift::failpoints::slow_restores_of;
    const NAME: &str = "restore-progress";

    /// Drives passes until `done`, recording every value status.restore took and when.
    async fn watch_restore(
        d: &mut Driver,
        what: &str,
        done: impl Fn(&Driver) -> bool,
    ) -> Vec<(Instant, keyshift::crd::RestoreStatus)> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut seen: Vec<(Instant, keyshift::crd::RestoreStatus)> = Vec::new();
        loop {
            d.pass().await;
            if let Some(r) = &d.status.restore
                && seen.last().is_none_or(|(_, last)| last != r)
            {
                seen.push((Instant::now(), r.clone()));
            }
            if done(d) {
                return seen;
            }
            assert!(
                Instant::now() < deadline,
                "not {what} within 30 s\nstatus: {:#?}",
                d.status
            );
            d.sleep().await;
        }
    }

    bounded(async {
        let mut d = Driver::new(NAME, 2, "1s");
        d.until_running(2).await;
        d.until("checkpointed", Duration::from_secs(20), |d| {
            d.status.last_checkpoint.is_some()
        })
        .await;
        slow_restores_of(NS, NAME, Some(Duration::from_secs(4)));

        // A recovery: the newest checkpoint is restored.
        d.workers.kill(0).expect("worker 0 exists");
        d.until("restoring", Duration::from_secs(30), |d| {
            d.status.restore.is_some()
        })
        .await;
        let r = d.status.restore.clone().expect("status.restore");
        let from = r.snapshot.clone().expect("the snapshot restored");
        assert!(from.contains("/checkpoints/chk-"), "{r:?}");
        assert_eq!(r.subtasks, 2, "{r:?}");
        assert!(r.subtasks_done < 2, "{r:?}");
        assert!(r.bytes_total > 0 && r.bytes_read <= r.bytes_total, "{r:?}");
        assert!(r.key_groups_total > 0 && r.key_groups_total <= 32, "{r:?}");
        let (reason, message) = d.condition("Reconciling").expect("Reconciling");
        assert_eq!(reason, "Restoring", "{message}");
        assert!(
            message.contains(&from)
                && message.contains("restoring: ")
                && message.contains(" read (")
                && message.contains(&format!("{}/2 subtasks done", r.subtasks_done)),
            "{message}"
        );
        assert!(d.condition("Ready").is_none(), "Ready while restoring");
        let seen = watch_restore(&mut d, "running again", |d| d.running_at(2)).await;
        assert!(d.status.restore.is_none(), "{:?}", d.status.restore);
        assert!(d.condition("Reconciling").is_none());
        for pair in seen.windows(2) {
            let apart = pair[1].0 - pair[0].0;
            assert!(
                apart >= pass::RESTORE_STATUS_EVERY - Duration::from_millis(100),
                "status.restore changed {apart:?} after the last change: {seen:#?}"
            );
        }
        let started = &d.events_named("Started").last().expect("Started").1.note;
        assert!(started.contains(&from), "{started}");

        // A rescale: its Restoring step shows the progress.
        d.spec.replicas = 3;
        d.until("restoring at 3", Duration::from_secs(30), |d| {
            d.status.restore.is_some() && d.step() == Some(Step::Restoring)
        })
        .await;
        let r = d.status.restore.clone().expect("status.restore");
        assert_eq!(r.snapshot, d.rescale().savepoint, "{r:?}");
        assert_eq!(r.subtasks, 3, "{r:?}");
        let (reason, message) = d.condition("Reconciling").expect("Reconciling");
        assert_eq!(reason, "Restoring", "{message}");
        assert!(
            message.starts_with("rescaling 2 -> 3: step Restoring")
                && message.contains(": restoring: ")
                && message.contains("/3 subtasks done"),
            "{message}"
        );
        watch_restore(&mut d, "rescaled", |d| {
            d.step() == Some(Step::Done) && d.running_at(3)
        })
        .await;
        assert!(d.status.restore.is_none(), "{:?}", d.status.restore);
        slow_restores_of(NS, NAME, None);
        d.suspend_and_check().await;
    })
    .await;
}

/// The newest snapshot a recovery restored, from its Started Event.
fn restored_by_last_start(d: &Driver) -> String {
    d.events_named("Started")
        .last()
        .expect("a Started event")
        .1
        .note
        .clone()
}

/// A rescale whose new parallelism fails to restore rolls back to the old one from the
/// rescale's savepoint. A worker that dies then, before the next checkpoint commits, restarts
/// the job from that savepoint (the newest snapshot), never from the checkpoints taken before
/// the rescale (the state before the rollback); one that dies after the next checkpoint restarts
/// it from that checkpoint. The state stays exact throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_a_rollback_restores_the_newest_snapshot() {
    bounded(async {
        let mut d = Driver::new("rollback-crash", 2, "1s");
        d.until_running(2).await;
        d.until("checkpointed", Duration::from_secs(20), |d| {
            d.status.last_checkpoint.is_some()
        })
        .await;
        d.workers.faults().refuse_start_at = Some(3);
        d.spec.replicas = 3;
        // No checkpoint commits after the rollback until the first crash.
        d.until("restoring at 3", Duration::from_secs(30), |d| {
            d.step() == Some(Step::Restoring)
        })
        .await;
        d.workers.faults().fail_checkpoints = true;
        d.until("rolled back", Duration::from_secs(30), |d| {
            d.step() == Some(Step::RolledBack) && d.running_at(2)
        })
        .await;
        let sp = d.rescale().savepoint.expect("the rescale's savepoint");
        let before = d.status.last_checkpoint.clone().expect("a checkpoint");
        assert!(restored_by_last_start(&d).contains(&sp));
        // The edit is reverted (the rescale is not retried) and 3 would work again.
        d.spec.replicas = 2;
        d.workers.faults().refuse_start_at = None;
        d.assert_processing().await;

        // A crash before the next checkpoint: the savepoint is the newest snapshot.
        let started = d.events_named("Started").len();
        d.workers.kill(1).expect("worker 1 exists");
        d.until("recovered", Duration::from_secs(30), |d| {
            d.events_named("Started").len() > started && d.running_at(2)
        })
        .await;
        let note = restored_by_last_start(&d);
        assert!(
            note.contains(&sp) && !note.contains(&before.path),
            "the recovery after the rollback restored {note}, not the rescale's savepoint {sp}"
        );
        assert_exact(&d.spec, &sp).await;

        // A crash after the next checkpoint: that checkpoint is the newest snapshot.
        d.workers.faults().fail_checkpoints = false;
        let sp_id: i64 = sp
            .rsplit("sp-")
            .next()
            .and_then(|id| id.parse().ok())
            .expect("a savepoint id");
        d.until(
            "checkpointed after the rollback",
            Duration::from_secs(30),
            |d| {
                d.status
                    .last_checkpoint
                    .as_ref()
                    .is_some_and(|c| c.id > sp_id)
            },
        )
        .await;
        let checkpoint = d.status.last_checkpoint.clone().expect("a checkpoint");
        let started = d.events_named("Started").len();
        d.workers.kill(0).expect("worker 0 exists");
        d.until("recovered again", Duration::from_secs(30), |d| {
            d.events_named("Started").len() > started && d.running_at(2)
        })
        .await;
        let note = restored_by_last_start(&d);
        let newest = d.status.last_checkpoint.clone().expect("a checkpoint");
        assert!(
            note.contains(&newest.path) && newest.id >= checkpoint.id,
            "the recovery restored {note}, not the newest checkpoint {}",
            newest.path
        );
        assert_exact(&d.spec, &newest.path).await;
        d.suspend_and_check().await;
    })
    .await;
}

/// A restore from spec.restoreFrom at a new parallelism fails and rolls back (the job runs at
/// the old parallelism from the transition's savepoint, its own history). A worker that dies
/// then, with the spec still asking for the restore, never brings the job back silently on its
/// own history (the state the restore is to replace): only spec.restoreFrom is started, and a
/// crash of that run before its first checkpoint restores spec.restoreFrom again. Exact state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_a_rolled_back_restore_from_restores_only_the_restore_source() {
    bounded(async {
        let mut d = Driver::new("restore-from-rollback", 2, "1s");
        d.until_running(2).await;
        d.spec.savepoint_trigger_nonce = Some(1);
        d.until("savepoint taken", Duration::from_secs(20), |d| {
            d.status.last_savepoint_nonce == Some(1)
        })
        .await;
        let target = d.status.last_savepoint.clone().expect("a savepoint");
        d.until("checkpointed after it", Duration::from_secs(20), |d| {
            d.status
                .last_checkpoint
                .as_ref()
                .is_some_and(|c| c.id > target.id)
        })
        .await;
        d.workers.faults().refuse_start_at = Some(3);
        d.spec.replicas = 3;
        d.spec.restore_from = Some(target.path.clone());
        // It goes back past the checkpoints published after it: confirmed.
        d.spec.allow_republishing_output = true;
        d.until("restoring at 3", Duration::from_secs(30), |d| {
            d.step() == Some(Step::Restoring)
        })
        .await;
        d.workers.faults().fail_checkpoints = true;
        d.until("rolled back", Duration::from_secs(30), |d| {
            d.step() == Some(Step::RolledBack) && d.running_at(2)
        })
        .await;
        let sp = d.rescale().savepoint.expect("the transition's savepoint");
        assert!(restored_by_last_start(&d).contains(&sp));
        assert_eq!(d.status.restored_from, None);

        // A crash while the spec still asks for the restore at 3 (which still fails).
        let started = d.events_named("Started").len();
        let refused = d.workers.faults().starts_refused;
        d.workers.kill(0).expect("worker 0 exists");
        d.until("a start refused", Duration::from_secs(30), |d| {
            d.workers.faults().starts_refused > refused
        })
        .await;
        d.for_a_while(Duration::from_secs(2), |d| {
            assert_eq!(
                d.events_named("Started").len(),
                started,
                "a run started while the restore at 3 fails:\n{}",
                d.event_log()
            );
        })
        .await;
        d.workers.faults().refuse_start_at = None;
        d.until("restored", Duration::from_secs(40), |d| {
            d.running_at(3) && d.status.restored_from.as_deref() == Some(&target.path)
        })
        .await;
        let note = restored_by_last_start(&d);
        assert!(note.contains(&target.path), "{note}");
        let replaced = d.status.replaced_history_up_to.expect("replaced history");
        let sp_id: i64 = sp
            .rsplit("sp-")
            .next()
            .and_then(|id| id.parse().ok())
            .expect("a savepoint id");
        assert!(replaced >= sp_id, "{replaced} < {sp_id}");

        // Its first checkpoints fail; a crash restores spec.restoreFrom again.
        let started = d.events_named("Started").len();
        d.workers.kill(2).expect("worker 2 exists");
        d.until("recovered", Duration::from_secs(30), |d| {
            d.events_named("Started").len() > started && d.running_at(3)
        })
        .await;
        let note = restored_by_last_start(&d);
        assert!(
            note.contains(&target.path) && !note.contains(&sp),
            "the recovery restored {note}, not spec.restoreFrom {}",
            target.path
        );
        d.workers.faults().fail_checkpoints = false;
        assert_exact(&d.spec, &target.path).await;
        d.suspend_and_check().await;
    })
    .await;
}

/// An orchestrator that restarts while the spec changed finds the old run's workers stale and
/// coordinates them under the identity of the job's newest snapshot. A corrupt manifest of the
/// newest snapshot is passed over there as a resume passes over it (the newest good one names
/// the job), so the workers are adopted and the upgrade goes on, instead of every pass failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_workers_are_adopted_past_a_corrupt_newest_snapshot() {
    bounded(async {
        let mut d = Driver::new("adopt-bad-manifest", 2, "1h");
        d.until_running(2).await;
        let mut savepoints = Vec::new();
        for nonce in [1, 2] {
            d.spec.savepoint_trigger_nonce = Some(nonce);
            d.until("savepoint taken", Duration::from_secs(20), |d| {
                d.status.last_savepoint_nonce == Some(nonce)
            })
            .await;
            savepoints.push(d.status.last_savepoint.clone().expect("a savepoint").path);
        }
        let (store, dir) = snapshot::open_store(&savepoints[1]).expect("store");
        object_store::ObjectStoreExt::put(
            store.as_ref(),
            &snapshot::manifest_path(&dir),
            object_store::PutPayload::from_static(b"{\"formatVersion\": 1, \"job\": "),
        )
        .await
        .expect("corrupt the manifest");
        let workers = d.workers.names();
        d.restart();
        if let Some(g) = d.spec.job.source.generator.as_mut() {
            g.records_per_second = Some(2500);
        }
        d.until("adopted", Duration::from_secs(20), |d| d.mem.coordinating())
            .await;
        assert_eq!(d.workers.names(), workers, "the old run was adopted");
        d.until("upgraded", Duration::from_secs(30), |d| {
            d.step() == Some(Step::Done) && d.running_at(2)
        })
        .await;
        assert_ne!(d.workers.names(), workers, "upgraded to new workers");
    })
    .await;
}

/// A rescale rolled back, and the spec still asks for the parallelism that failed to restore
/// (which still fails). A worker that dies then does not keep the job down while that
/// parallelism fails: the job comes back at the parallelism it ran at, from the newest snapshot
/// (the rescale's savepoint), and the rescale is retried from the running job after its backoff
/// (it succeeds once the new parallelism can start). Exact state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_a_rollback_brings_the_job_back_at_the_parallelism_that_ran() {
    bounded(async {
        let mut d = Driver::new("rollback-crash-stay", 2, "1h");
        d.until_running(2).await;
        d.workers.faults().refuse_start_at = Some(3);
        d.spec.replicas = 3;
        d.until("rolled back", Duration::from_secs(30), |d| {
            d.step() == Some(Step::RolledBack) && d.running_at(2)
        })
        .await;
        let sp = d.rescale().savepoint.expect("the rescale's savepoint");
        let started = d.events_named("Started").len();
        d.workers.kill(1).expect("worker 1 exists");
        d.until("back at 2", Duration::from_secs(20), |d| {
            d.events_named("Started").len() > started && d.running_at(2)
        })
        .await;
        let note = restored_by_last_start(&d);
        assert!(note.contains(&sp), "{note}");
        assert_exact(&d.spec, &sp).await;
        d.assert_processing().await;
        d.workers.faults().refuse_start_at = None;
        d.until("rescaled to 3", Duration::from_secs(40), |d| {
            d.step() == Some(Step::Done) && d.running_at(3)
        })
        .await;
        d.suspend_and_check().await;
    })
    .await;
}

// ---- A managed change of the key-group count (spec.maxParallelism) ----

/// Every step of a key-group change of a running job, in order.
const CHANGE_STEPS: [Step; 7] = [
    Step::Savepointing,
    Step::Verifying,
    Step::Stopping,
    Step::Rewriting,
    Step::VerifyingRewrite,
    Step::Restoring,
    Step::Done,
];

/// The key-group count of the snapshot at `url`.
async fn groups_of(url: &str) -> u32 {
    snapshot::open_snapshot(url)
        .await
        .expect("snapshot opens")
        .2
        .max_parallelism
}

/// A job at parallelism 2 under 32 key groups asked for 128 groups at parallelism 3.
async fn changing(name: &str) -> Driver {
    let mut d = Driver::new(name, 2, "1h");
    d.until_running(2).await;
    assert_eq!(d.status.max_parallelism, Some(32));
    d.spec.max_parallelism = Some(128);
    d.spec.replicas = 3;
    d
}

/// After a key-group change to 128 at parallelism 3: the original savepoint holds the exact
/// state under 32 groups, the rewritten one the same state under 128, the job runs from it.
async fn assert_changed(d: &mut Driver) {
    assert_eq!(d.status.max_parallelism, Some(128));
    let r = d.rescale();
    assert_eq!(r.from_max_parallelism, Some(32));
    assert!(r.rolled_back.is_none(), "{}", d.event_log());
    let original = r.savepoint.clone().expect("the change's savepoint");
    let rewritten = r.rewritten.clone().expect("the rewritten savepoint");
    assert_ne!(original, rewritten);
    assert_eq!(groups_of(&original).await, 32, "the original is untouched");
    assert_eq!(groups_of(&rewritten).await, 128);
    let before = assert_exact(&d.spec, &original).await;
    let after = assert_exact(&d.spec, &rewritten).await;
    assert_eq!(before, after, "the rewrite covers the same records");
    assert_eq!(
        snapshot_state(&original).await,
        snapshot_state(&rewritten).await,
        "every key's value and every source position carried over"
    );
    let keys = snapshot_state(&original).await.0.len() as i64;
    // Unset when the orchestrator restarted after the rewrite committed.
    if let Some(k) = r.rewritten_keys {
        assert_eq!(k, keys, "{r:?}");
    }
    let change = d
        .status
        .key_group_change
        .clone()
        .expect("the change is recorded");
    assert_eq!(change.original_savepoint, original);
    assert_eq!(change.rewritten_savepoint, rewritten);
    assert_eq!(
        (change.from_max_parallelism, change.to_max_parallelism),
        (32, 128)
    );
    for reason in [
        "KeyGroupChangeStarted",
        "SavepointRewritten",
        "RewriteVerified",
        "KeyGroupsChanged",
    ] {
        assert!(
            !d.events_named(reason).is_empty(),
            "no {reason} event:\n{}",
            d.event_log()
        );
    }
    let started = d.events_named("Started");
    let last = &started.last().expect("a Started event").1;
    assert!(
        last.note.contains(&rewritten) && last.note.contains("3 workers"),
        "{}",
        last.note
    );
}

/// One edit of spec.maxParallelism (with the replicas wanted) runs savepoint -> rewrite ->
/// verify -> restore; every key and position carries over; the change is reversible until the
/// new run's first snapshot commits, and status says so, then says what undoing would lose.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_group_change_rewrites_the_state_and_keeps_every_key() {
    bounded(async {
        let mut d = changing("kg-change").await;
        d.until("changed", Duration::from_secs(30), |d| {
            d.step() == Some(Step::Done) && d.running_at(3)
        })
        .await;
        assert_eq!(
            d.steps.last().map(|(_, s)| s.as_slice()),
            Some(&CHANGE_STEPS[..]),
            "{}",
            d.event_log()
        );
        assert_changed(&mut d).await;
        let change = d.status.key_group_change.clone().expect("recorded");
        assert_eq!(change.point_of_no_return, None);
        assert!(
            change.message.starts_with("reversible"),
            "{}",
            change.message
        );
        let r = d.rescale();
        for s in &CHANGE_STEPS[..6] {
            assert!(r.step_seconds.contains_key(s.as_str()), "{s}: {r:?}");
        }
        // The original savepoint is pinned while the change can be undone.
        let pins = pass::in_use(&d.spec, &d.status, &d.storage, NS, &d.name);
        assert!(
            pins.iter()
                .any(|p| change.original_savepoint.ends_with(&p.path)),
            "{pins:?}"
        );
        d.assert_processing().await;

        // The new run's first committed snapshot is the point of no return.
        d.spec.savepoint_trigger_nonce = Some(1);
        d.until(
            "past the point of no return",
            Duration::from_secs(20),
            |d| {
                d.status
                    .key_group_change
                    .as_ref()
                    .is_some_and(|c| c.point_of_no_return.is_some())
            },
        )
        .await;
        let change = d.status.key_group_change.clone().expect("recorded");
        assert!(change.message.contains("would lose"), "{}", change.message);
        assert_eq!(d.events_named("KeyGroupChangeIrreversible").len(), 1);
        let pins = pass::in_use(&d.spec, &d.status, &d.storage, NS, &d.name);
        assert!(
            !pins
                .iter()
                .any(|p| change.original_savepoint.ends_with(&p.path)),
            "{pins:?}"
        );
        d.suspend_and_check().await;
    })
    .await;
}

/// Setting spec.maxParallelism back before the point of no return restores the original
/// savepoint at the old parallelism and key-group count, exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undoing_a_key_group_change_restores_the_original_savepoint() {
    bounded(async {
        let mut d = changing("kg-undo").await;
        d.until("changed", Duration::from_secs(30), |d| {
            d.step() == Some(Step::Done) && d.running_at(3)
        })
        .await;
        let original = d.rescale().savepoint.expect("the change's savepoint");
        d.spec.max_parallelism = Some(32);
        d.spec.replicas = 2;
        d.until("undone", Duration::from_secs(30), |d| {
            d.step() == Some(Step::Done) && d.running_at(2) && d.status.max_parallelism == Some(32)
        })
        .await;
        let r = d.rescale();
        assert_eq!(r.restore_from.as_deref(), Some(original.as_str()));
        assert_eq!(d.status.key_group_change, None, "the change is forgotten");
        assert!(
            d.events_named("KeyGroupsChanged")
                .iter()
                .any(|(_, e)| e.note.contains("undone")),
            "{}",
            d.event_log()
        );
        let started = d.events_named("Started");
        assert!(
            started
                .last()
                .is_some_and(|(_, e)| e.note.contains(&original)),
            "{}",
            d.event_log()
        );
        // spec.restoreFrom was never set: nothing is recorded as restored from it.
        assert_eq!(d.status.restored_from, None);
        d.assert_processing().await;
        d.suspend_and_check().await;
    })
    .await;
}

/// The orchestrator restarts as soon as a key-group change records `step`: a fresh one resumes
/// it from status and the state is exact.
async fn change_restart_in(step: Step, name: &str) {
    bounded(async {
        let mut d = changing(name).await;
        d.until(&format!("in {step}"), Duration::from_secs(30), |d| {
            d.step() == Some(step)
        })
        .await;
        // A background step of the step may be running: let it end first (its outcome is then
        // lost with the memory, as in a crash after the work).
        d.await_background(&format!("{step}'s work")).await;
        d.restart();
        d.until("changed after a restart", Duration::from_secs(30), |d| {
            d.step() == Some(Step::Done) && d.running_at(3)
        })
        .await;
        assert_eq!(
            d.steps.last().map(|(_, s)| s.as_slice()),
            Some(&CHANGE_STEPS[..]),
            "{}",
            d.event_log()
        );
        assert_changed(&mut d).await;
        d.suspend_and_check().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_in_rewriting_resumes_the_key_group_change() {
    change_restart_in(Step::Rewriting, "kg-restart-rewrite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_in_verifying_rewrite_resumes_the_key_group_change() {
    change_restart_in(Step::VerifyingRewrite, "kg-restart-verify").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_in_stopping_resumes_the_key_group_change() {
    change_restart_in(Step::Stopping, "kg-restart-stop").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_in_restoring_resumes_the_key_group_change() {
    change_restart_in(Step::Restoring, "kg-restart-restore").await;
}

/// The orchestrator dies after the rewrite committed but before a pass recorded it: the next
/// one finds the committed target, verifies it and goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_after_an_unrecorded_rewrite_resumes_the_key_group_change() {
    bounded(async {
        let mut d = changing("kg-unrecorded").await;
        d.until(
            "rewriting in the background",
            Duration::from_secs(30),
            |d| {
                d.step() == Some(Step::Rewriting)
                    && d.requeue == Some(pass::requeue::BACKGROUND_BACKSTOP)
            },
        )
        .await;
        d.await_background("the rewrite").await;
        d.restart();
        d.until("changed after a restart", Duration::from_secs(30), |d| {
            d.step() == Some(Step::Done) && d.running_at(3)
        })
        .await;
        assert!(
            d.events_named("SavepointRewritten")
                .iter()
                .any(|(_, e)| e.note.contains("already committed")),
            "{}",
            d.event_log()
        );
        assert_changed(&mut d).await;
        d.suspend_and_check().await;
    })
    .await;
}

/// A rewrite that fails (its memory budget, or a corrupt rewritten block found by the
/// verification) rolls the change back: the original savepoint is restored at the old
/// parallelism under the old key-group count, exactly, and status says why.
#[cfg(feature = "test-hooks")]
async fn a_failed_rewrite_rolls_back(name: &str, fault: failpoints::RewriteFault, why: &str) {
    bounded(async {
        failpoints::rewrite_fault_of(NS, name, Some(fault));
        let mut d = changing(name).await;
        d.until("rolled back", Duration::from_secs(30), |d| {
            d.step() == Some(Step::RolledBack) && d.running_at(2)
        })
        .await;
        failpoints::rewrite_fault_of(NS, name, None);
        assert_eq!(
            d.status.max_parallelism,
            Some(32),
            "back at the old ceiling"
        );
        let r = d.rescale();
        let why_recorded = r.rolled_back.clone().expect("why it rolled back");
        assert!(why_recorded.contains(why), "{why_recorded}");
        let original = r.savepoint.clone().expect("the change's savepoint");
        assert_eq!(groups_of(&original).await, 32);
        let events = d.events_named("KeyGroupChangeRolledBack");
        assert_eq!(events.len(), 1, "{}", d.event_log());
        assert!(events[0].1.warning);
        assert_eq!(d.status.key_group_change, None);
        // Not Ready (the spec still asks for the new count): Reconciling says what happened.
        let (reason, message) = d
            .condition("Reconciling")
            .unwrap_or_else(|| panic!("Reconciling: {:#?}", d.status.conditions));
        assert_eq!(reason, "KeyGroupChangeRolledBack", "{message}");
        assert!(message.contains("original savepoint"), "{message}");
        assert_exact(&d.spec, &original).await;
        d.assert_processing().await;
        // Not retried at once: the job keeps running at its old ceiling.
        d.for_a_while(Duration::from_millis(500), |d| {
            assert_eq!(d.step(), Some(Step::RolledBack));
        })
        .await;
        d.spec.max_parallelism = Some(32);
        d.spec.replicas = 2;
        d.suspend_and_check().await;
    })
    .await;
}

#[cfg(feature = "test-hooks")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewrite_over_its_memory_budget_rolls_back() {
    a_failed_rewrite_rolls_back(
        "kg-memory",
        failpoints::RewriteFault::MemoryBudget(64),
        "more than half its memory budget",
    )
    .await;
}

#[cfg(feature = "test-hooks")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_rewrite_fails_verification_and_rolls_back() {
    a_failed_rewrite_rolls_back(
        "kg-corrupt",
        failpoints::RewriteFault::CorruptOutput,
        "failed verification",
    )
    .await;
}

/// A suspended job whose key-group count is changed has its newest snapshot rewritten before it
/// resumes (no savepoint to take: it starts by verifying the snapshot).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspended_job_is_rewritten_before_it_resumes() {
    bounded(async {
        let mut d = Driver::new("kg-suspended", 2, "1h");
        d.until_running(2).await;
        d.spec.suspend = true;
        d.until("suspended", Duration::from_secs(20), |d| {
            d.status.phase == Some(Phase::Suspended) && d.workers.names().is_empty()
        })
        .await;
        let suspended_at = d.rescale().savepoint.expect("the suspend's savepoint");
        d.spec.suspend = false;
        d.spec.max_parallelism = Some(128);
        d.spec.replicas = 3;
        d.until("changed", Duration::from_secs(30), |d| {
            d.step() == Some(Step::Done) && d.running_at(3)
        })
        .await;
        assert_eq!(
            d.steps.last().map(|(_, s)| s.as_slice()),
            Some(&CHANGE_STEPS[1..]),
            "{}",
            d.event_log()
        );
        assert_eq!(
            d.rescale().savepoint.as_deref(),
            Some(suspended_at.as_str())
        );
        assert_changed(&mut d).await;
        // The first suspend's Event is not the one checked next.
        d.events.retain(|(_, e)| e.reason != "Suspended");
        d.suspend_and_check().await;
    })
    .await;
}

// --- Pre-staged rescales (spec.rescaleStrategy: Prestage) ---

/// Every step of a pre-staged rescale that used its new workers.
const PRESTAGE_STEPS: [Step; 6] = [
    Step::Prestaging,
    Step::Savepointing,
    Step::Verifying,
    Step::Stopping,
    Step::Restoring,
    Step::Done,
];

/// A driver whose job rescales with pre-staged workers, running at `replicas`.
async fn prestaging(name: &str, replicas: u32) -> Driver {
    prestaging_every(name, replicas, "1h").await
}

/// [`prestaging`], checkpointing every `interval`.
async fn prestaging_every(name: &str, replicas: u32, interval: &str) -> Driver {
    let mut d = Driver::new(name, replicas, interval);
    // Few of the keys change between two snapshots taken a moment apart: a delta is a small
    // part of the state (once most keys have been seen).
    if let Some(g) = d.spec.job.source.generator.as_mut() {
        g.keys = 2_000;
        g.records_per_second = Some(1000);
    }
    d.spec.state.incremental_checkpoints = Some(keyshift::crd::IncrementalCheckpoints {
        enabled: true,
        max_deltas: None,
        max_delta_percent: Some(400),
    });
    d.spec.rescale_strategy = keyshift::crd::RescaleStrategy::Prestage;
    d.until_running(replicas as i32).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while d.progress().await.0 < 4_000 {
        assert!(
            Instant::now() < deadline,
            "4000 records not processed in 20 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    d
}

/// Rescales to `to` and checks the pre-stage was used: every step in order, the job runs on the
/// pre-staged workers (none replaced), which loaded the state while the job ran, and the stop
/// checkpoint (what they applied) is exact and wrote less than the state.
async fn rescale_prestaged(d: &mut Driver, to: i32) {
    d.spec.replicas = to;
    d.until(
        &format!("pre-staged rescale to {to}"),
        Duration::from_secs(40),
        |d| d.step() == Some(Step::Done) && d.running_at(to),
    )
    .await;
    let r = d.rescale();
    assert_eq!(
        d.steps.last().map(|(_, s)| s.as_slice()),
        Some(&PRESTAGE_STEPS[..]),
        "{}",
        d.event_log()
    );
    assert_eq!(r.fallback, None, "{}", d.event_log());
    let p = r.prestage.clone().expect("the pre-stage is recorded");
    let mut names = d.workers.names();
    names.sort();
    let want: Vec<String> = (0..to).map(|i| format!("{}-{i}", p.run)).collect();
    assert_eq!(names, want, "the job runs on its pre-staged workers");
    assert!(p.loaded_bytes.unwrap_or_default() > 0, "{p:?}");
    let stop = r.savepoint.clone().expect("the stop checkpoint");
    assert!(stop.contains("/checkpoints/"), "{stop}");
    let state = snapshot::open_snapshot(&stop)
        .await
        .expect("the stop checkpoint opens")
        .2
        .stats
        .total_bytes as i64;
    let delta = p.delta_bytes.expect("the stop checkpoint's delta");
    assert_eq!(
        r.bytes_to_read,
        Some(delta),
        "the new workers read the delta"
    );
    assert!(
        delta < state,
        "the stop checkpoint wrote {delta} bytes of {state}: {p:?}\n{}",
        d.event_log()
    );
    assert_eq!(d.events_named("Prestaged").len(), d.steps_prestaged());
    assert_exact(&d.spec, &stop).await;
    d.assert_processing().await;
}

impl Driver {
    /// Transitions that went through Prestaging and used their new workers.
    fn steps_prestaged(&self) -> usize {
        self.steps
            .iter()
            .filter(|(_, s)| s.first() == Some(&Step::Prestaging) && s.contains(&Step::Verifying))
            .count()
    }
}

/// Up and down with pre-staged workers: exact state, each rescale on the workers that loaded it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prestaged_rescale_up_and_down_keeps_every_key() {
    bounded(async {
        let mut d = prestaging("pre-updown", 2).await;
        rescale_prestaged(&mut d, 3).await;
        rescale_prestaged(&mut d, 1).await;
        assert!(d.events_named("PrestageFellBack").is_empty());
        d.suspend_and_check().await;
    })
    .await;
}

/// The orchestrator restarts as soon as each step of a pre-staged rescale is recorded: the
/// fresh one coordinates the old workers again (Prestaging, Savepointing), and goes on with the
/// same pre-staged workers to an exact state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_in_any_step_of_a_prestaged_rescale_resumes_it() {
    bounded(async {
        let mut d = prestaging("pre-restart", 2).await;
        let mut to = 2;
        for step in &PRESTAGE_STEPS[..5] {
            to = if to == 2 { 3 } else { 2 };
            d.spec.replicas = to;
            d.until(&format!("in {step}"), Duration::from_secs(30), |d| {
                d.step() == Some(*step)
            })
            .await;
            let r = d.rescale();
            if r.savepoint.is_some() {
                // After the stop checkpoint: only its delta is to be read.
                let delta = r.prestage.as_ref().and_then(|p| p.delta_bytes);
                assert!(delta.is_some(), "in {step}: {r:?}");
                assert_eq!(r.bytes_to_read, delta, "in {step}");
            }
            d.await_background(step.as_str()).await;
            d.restart();
            rescale_prestaged(&mut d, to).await;
        }
        assert!(d.events_named("PrestageFellBack").is_empty());
        assert!(d.events_named("RescaleAbandoned").is_empty());
        d.suspend_and_check().await;
    })
    .await;
}

/// A new worker killed while pre-staged (before the job stops), or right before its start
/// (after the old workers are gone): the rescale falls back to a stop-and-restore, says so, and
/// the state is exact either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_prestaged_worker_falls_back_to_stop_and_restore() {
    bounded(async {
        let mut d = prestaging("pre-lost", 2).await;
        for (to, step) in [(3, Step::Savepointing), (2, Step::Restoring)] {
            d.spec.replicas = to;
            d.until(&format!("in {step}"), Duration::from_secs(30), |d| {
                d.step() == Some(step) && d.rescale().prestaged().is_some()
            })
            .await;
            d.await_background(step.as_str()).await;
            let run = d.rescale().prestage.expect("pre-stage").run;
            let killed = d
                .workers
                .kill_in(Some(&run), 1)
                .expect("a pre-staged worker");
            let falls_before = d.events_named("PrestageFellBack").len();
            d.until(&format!("rescaled to {to}"), Duration::from_secs(40), |d| {
                d.step() == Some(Step::Done) && d.running_at(to)
            })
            .await;
            let r = d.rescale();
            let why = r.fallback.clone().expect("the fallback is recorded");
            assert!(why.contains("subtask 1"), "{why}");
            let falls = d.events_named("PrestageFellBack");
            assert_eq!(falls.len(), falls_before + 1, "{}", d.event_log());
            assert!(falls[falls_before].1.warning);
            assert!(
                d.workers.names().iter().all(|n| !n.starts_with(&run)),
                "{killed}: the pre-staged workers are gone"
            );
            let sp = r.savepoint.expect("the rescale's snapshot");
            assert_exact(&d.spec, &sp).await;
            d.assert_processing().await;
        }
        d.suspend_and_check().await;
    })
    .await;
}

/// New workers that cannot start (pods stay Pending): after spec.state.prestageTimeout the
/// rescale falls back to stop-and-restore while the job keeps running, and finishes once pods
/// can start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_workers_that_never_start_make_the_rescale_fall_back_in_time() {
    bounded(async {
        let mut d = prestaging("pre-pending", 2).await;
        d.spec.state.prestage_timeout = Some("1s".into());
        d.workers.faults().pods_pending = true;
        d.spec.replicas = 3;
        d.until("fallen back", Duration::from_secs(20), |d| {
            !d.events_named("PrestageFellBack").is_empty()
        })
        .await;
        let why = d.rescale().fallback.expect("the fallback");
        assert!(why.contains("prestageTimeout (1s)"), "{why}");
        assert!(
            d.condition(status::RECONCILING)
                .is_some_and(|(_, m)| m.contains("fell back to stop-and-restore")),
            "{:?}",
            d.status.conditions
        );
        d.workers.faults().pods_pending = false;
        d.until("rescaled to 3", Duration::from_secs(40), |d| {
            d.step() == Some(Step::Done) && d.running_at(3)
        })
        .await;
        let sp = d.rescale().savepoint.expect("the savepoint");
        assert!(sp.contains("/savepoints/"), "a stop-and-restore: {sp}");
        assert_exact(&d.spec, &sp).await;
        d.suspend_and_check().await;
    })
    .await;
}

/// An old worker killed while the new ones are pre-staged: the rescale is abandoned (the new
/// workers go), and the job recovers from its last checkpoint at the new parallelism, exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_worker_lost_while_prestaging_abandons_and_recovers() {
    bounded(async {
        let mut d = prestaging_every("pre-oldlost", 2, "1s").await;
        d.until("checkpointed", Duration::from_secs(20), |d| {
            d.status.last_checkpoint.is_some()
        })
        .await;
        let old_run = d.mem.run_id().expect("a coordinated run").to_owned();
        d.spec.replicas = 3;
        d.until("pre-staging", Duration::from_secs(20), |d| {
            d.step() == Some(Step::Prestaging)
        })
        .await;
        d.workers.kill_in(Some(&old_run), 0).expect("an old worker");
        d.until("abandoned", Duration::from_secs(20), |d| {
            !d.events_named("RescaleAbandoned").is_empty()
        })
        .await;
        // The recovery brings the job up at the parallelism asked for, from its last
        // checkpoint; the pre-staged workers are gone.
        d.until("running at 3", Duration::from_secs(60), |d| d.running_at(3))
            .await;
        let run = d.rescale().prestage.expect("the pre-stage").run;
        assert!(
            d.workers.names().iter().all(|n| !n.starts_with(&run)),
            "{}",
            d.event_log()
        );
        let before = d.status.last_checkpoint.clone().map(|c| c.id);
        d.until("checkpointed at 3", Duration::from_secs(20), |d| {
            d.status.last_checkpoint.as_ref().map(|c| c.id) != before
        })
        .await;
        let cp = d.status.last_checkpoint.clone().expect("a checkpoint").path;
        assert_exact(&d.spec, &cp).await;
        d.assert_processing().await;
        d.suspend_and_check().await;
    })
    .await;
}

/// Creating the new workers is refused for good (a quota): the rescale falls back at once,
/// without waiting for spec.state.prestageTimeout, and finishes once pods can be created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_workers_refused_by_a_quota_make_the_rescale_fall_back_at_once() {
    bounded(async {
        let mut d = prestaging("pre-quota", 2).await;
        d.workers.faults().refuse_creates = true;
        d.spec.replicas = 3;
        let asked = Instant::now();
        d.until("fallen back", Duration::from_secs(20), |d| {
            !d.events_named("PrestageFellBack").is_empty()
        })
        .await;
        assert!(
            asked.elapsed() < Duration::from_secs(10),
            "fell back after {:?}, not at once",
            asked.elapsed()
        );
        let why = d.rescale().fallback.expect("the fallback");
        assert!(why.contains("exceeded quota"), "{why}");
        d.workers.faults().refuse_creates = false;
        d.until("rescaled to 3", Duration::from_secs(40), |d| {
            d.step() == Some(Step::Done) && d.running_at(3)
        })
        .await;
        let sp = d.rescale().savepoint.expect("the savepoint");
        assert_exact(&d.spec, &sp).await;
        d.suspend_and_check().await;
    })
    .await;
}
