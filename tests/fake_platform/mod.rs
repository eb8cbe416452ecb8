//! A fake platform for the orchestration pass: an implementation of the
//! [`Workers`](keyshift::orchestrator::port::Workers) port whose workers are **real workers run
//! in-process** (the worker runtime of `keyshift::runtime::worker`, on loopback ports chosen by
//! the OS), each behind a small control-API proxy that can be told to fail on command.
//!
//! Each worker runs on a tokio runtime of its own, so that killing it ([`FakeWorkers::kill`]) or
//! deleting it drops every task it spawned (its sources, operator, data plane) at once, like the
//! end of a process. The proxy runs on the same runtime and dies with it.
//!
//! Faults ([`Faults`]) are programmed by the test at any time:
//! * `refuse_start_at = Some(n)`: workers of a run of parallelism `n` answer `POST /v1/start`
//!   with HTTP 503 (as a worker whose storage is not reachable does: a failure that may pass),
//!   so a rescale to `n` fails to restore;
//! * `refuse_start_for_good = true`: every worker answers `POST /v1/start` with HTTP 422 (a
//!   refusal no retry can cure);
//! * `fail_savepoints = true`: subtask 0 reports every savepoint triggered from then on as
//!   `Failed` (as a worker whose state upload failed does). The real worker did take the barrier
//!   (its sources are stopped if the savepoint stops them), so the orchestration must resume it.
//! * `refuse_triggers_of = Some(i)`: the proxy of subtask `i` answers every checkpoint trigger
//!   with HTTP 503 without passing it on, so a trigger reaches only the other workers.
//! * `pods_pending = true`: workers created from then on never start (their pods stay
//!   Pending).
//! * `refuse_creates = true`: creating workers fails for good (a quota).

#![allow(dead_code)]

use keyshift::keygroup::Assignment;
use keyshift::orchestrator::coordinator::WorkerEndpoint;
use keyshift::orchestrator::decide::{ObservedPod, PodPhase};
use keyshift::orchestrator::port::{Listed, PortError, Waker, Workers};
use keyshift::runtime::protocol::{CheckpointRequest, CheckpointStatus};
use keyshift::runtime::worker::{self, WorkerConfig};
use keyshift::snapshot::SnapshotKind;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What the fake's workers are told to get wrong. Shared by every worker (and its proxy).
#[derive(Debug, Default)]
pub struct Faults {
    /// Workers of runs of this parallelism refuse `POST /v1/start` (HTTP 503).
    pub refuse_start_at: Option<u32>,
    /// Every worker refuses `POST /v1/start` for good (HTTP 422, as one whose image lacks the
    /// job's program does) while this is set.
    pub refuse_start_for_good: bool,
    /// Subtask 0 reports every savepoint triggered while this is set as failed.
    pub fail_savepoints: bool,
    /// How many `/v1/start` calls were refused.
    pub starts_refused: u32,
    /// How many savepoints were made to fail (once per savepoint id).
    pub savepoints_failed: u32,
    /// Subtask 0 reports every periodic checkpoint triggered while this is set as failed.
    pub fail_checkpoints: bool,
    /// How many checkpoints were made to fail.
    pub checkpoints_failed: u32,
    /// The proxy of this subtask refuses checkpoint triggers (HTTP 503, not passed on).
    pub refuse_triggers_of: Option<u32>,
    /// Ids of the checkpoint triggers refused, in order.
    pub triggers_refused: Vec<u64>,
    /// Workers created while this is set never start: their pods stay Pending (no room on the
    /// nodes, say).
    pub pods_pending: bool,
    /// Creating workers is refused for good while this is set (a ResourceQuota, say).
    pub refuse_creates: bool,
    /// `GET /v1/checkpoints/{id}` requests the workers got (the coordinator asking for
    /// acknowledgements), and how many of them were long polls (`?waitMs=`).
    pub status_requests: u64,
    pub status_long_polls: u64,
}

/// One in-process worker: its runtime (its tasks and sockets live and die with it).
struct FakeWorker {
    runtime: Option<tokio::runtime::Runtime>,
    pod: ObservedPod,
    endpoint: WorkerEndpoint,
    max_parallelism: u32,
    killed: bool,
}

impl FakeWorker {
    /// Ends the worker as a killed process ends: every task and socket of it is gone.
    fn stop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for FakeWorker {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The fake platform. See the module documentation.
pub struct FakeWorkers {
    token: String,
    spec_hash: String,
    workers: BTreeMap<String, FakeWorker>,
    faults: Arc<Mutex<Faults>>,
    wake: Arc<tokio::sync::Notify>,
    /// Every worker name ever created, in order.
    pub created: Vec<String>,
    /// Every worker name ever deleted through the port, in order.
    pub deleted: Vec<String>,
    /// The programs workers created from now on carry (their image's).
    programs: keyshift::job::Programs,
}

impl FakeWorkers {
    /// A platform whose workers accept `token` and carry `spec_hash` (`settings::spec_hash` of
    /// the spec, or the job would look like it needs an upgrade).
    pub fn new(token: &str, spec_hash: String) -> Self {
        FakeWorkers {
            token: token.to_owned(),
            spec_hash,
            workers: BTreeMap::new(),
            faults: Arc::new(Mutex::new(Faults::default())),
            wake: Arc::new(tokio::sync::Notify::new()),
            created: Vec::new(),
            deleted: Vec::new(),
            programs: keyshift::job::Programs::default(),
        }
    }

    /// Workers created from now on carry `programs` (as pods of a new image would).
    pub fn set_programs(&mut self, programs: keyshift::job::Programs) {
        self.programs = programs;
    }

    /// The faults, to program (or read counters from).
    /// Workers created from now on carry `spec_hash` (as pods are labelled with the spec they
    /// are created for).
    pub fn set_spec_hash(&mut self, spec_hash: String) {
        self.spec_hash = spec_hash;
    }

    pub fn faults(&self) -> std::sync::MutexGuard<'_, Faults> {
        self.faults.lock().expect("faults lock")
    }

    /// Notified when a background step ends or workers were created or removed.
    pub fn woken(&self) -> Arc<tokio::sync::Notify> {
        self.wake.clone()
    }

    /// Names of the workers that exist (killed ones included until deleted).
    pub fn names(&self) -> Vec<String> {
        self.workers.keys().cloned().collect()
    }

    /// The control endpoints (through the proxy) of the live (started) workers, by subtask.
    pub fn live(&self) -> Vec<(u32, WorkerEndpoint)> {
        self.workers
            .values()
            .filter(|w| !w.killed && w.runtime.is_some())
            .map(|w| (w.pod.subtask, w.endpoint.clone()))
            .collect()
    }

    /// Kills the live worker of `subtask` (its process "exits"; it stays listed as exited until
    /// the orchestration deletes it). Returns its name.
    pub fn kill(&mut self, subtask: u32) -> Option<String> {
        self.kill_in(None, subtask)
    }

    /// [`FakeWorkers::kill`], of run `run` when given (else of any run).
    pub fn kill_in(&mut self, run: Option<&str>, subtask: u32) -> Option<String> {
        let w = self.workers.values_mut().find(|w| {
            !w.killed
                && w.runtime.is_some()
                && w.pod.subtask == subtask
                && run.is_none_or(|r| w.pod.run == r)
        })?;
        w.stop();
        w.killed = true;
        Some(w.pod.name.clone())
    }

    async fn spawn(
        &self,
        name: String,
        subtask: u32,
        parallelism: u32,
        token: &str,
    ) -> Result<FakeWorker, String> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name(format!("fake-{name}"))
            .enable_all()
            .build()
            .map_err(|e| format!("building the runtime of {name}: {e}"))?;
        let loopback = "127.0.0.1:0".parse().expect("loopback address");
        let config = WorkerConfig {
            control_addr: loopback,
            data_addr: loopback,
            token: token.to_owned(),
            programs: self.programs.clone(),
        };
        let faults = self.faults.clone();
        let bound = runtime.spawn(async move {
            let bound = worker::bind(config).await.map_err(|e| e.to_string())?;
            let proxy = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .map_err(|e| e.to_string())?;
            let proxy_addr = proxy.local_addr().map_err(|e| e.to_string())?;
            let upstream = format!("http://{}", bound.control_addr);
            let data = bound.data_addr.to_string();
            tokio::spawn(async move {
                if let Err(e) = bound.serve(std::future::pending()).await {
                    tracing::warn!(error = %e, "fake worker ended");
                }
            });
            let state = Arc::new(Proxy {
                upstream,
                subtask,
                parallelism,
                faults,
                failing: Mutex::new(BTreeSet::new()),
                http: reqwest::Client::builder()
                    .no_proxy()
                    .build()
                    .map_err(|e| e.to_string())?,
            });
            let app = axum::Router::new().fallback(forward).with_state(state);
            tokio::spawn(async move {
                let _ = axum::serve(proxy, app).await;
            });
            Ok::<_, String>((format!("http://{proxy_addr}"), data))
        });
        let (control, data) = bound.await.map_err(|e| format!("starting {name}: {e}"))??;
        Ok(FakeWorker {
            runtime: Some(runtime),
            pod: ObservedPod {
                name: name.clone(),
                run: String::new(),
                subtask,
                parallelism,
                phase: PodPhase::Running,
                ip: Some("127.0.0.1".into()),
                deleting: false,
                grace_deadline: None,
                worker: None,
                spec_hash: Some(self.spec_hash.clone()),
                unschedulable: None,
            },
            endpoint: WorkerEndpoint { control, data },
            max_parallelism: 0,
            killed: false,
        })
    }
}

#[async_trait::async_trait]
impl Workers for FakeWorkers {
    async fn observe(&mut self) -> Result<Vec<Listed>, PortError> {
        Ok(self
            .workers
            .values()
            .map(|w| {
                let mut pod = w.pod.clone();
                if w.killed {
                    pod.phase = PodPhase::Exited;
                }
                Listed {
                    pod,
                    endpoint: Some(w.endpoint.clone()),
                    max_parallelism: Some(w.max_parallelism),
                }
            })
            .collect())
    }

    async fn create(
        &mut self,
        run: &str,
        assignment: Assignment,
        subtasks: &[u32],
        token: &str,
    ) -> Result<(), PortError> {
        let parallelism = assignment.parallelism();
        if self.faults().refuse_creates {
            return Err(PortError::new(
                format!("creating the workers of run {run}"),
                "pods \"x\" is forbidden: exceeded quota: compute, requested: pods=1, used: pods=2, limited: pods=2",
                false,
            ));
        }
        let pending = self.faults().pods_pending;
        for &i in subtasks {
            let name = format!("{run}-{i}");
            if pending {
                let w = FakeWorker {
                    runtime: None,
                    pod: ObservedPod {
                        name: name.clone(),
                        run: run.to_owned(),
                        subtask: i,
                        parallelism,
                        phase: PodPhase::Pending,
                        ip: None,
                        deleting: false,
                        grace_deadline: None,
                        worker: None,
                        spec_hash: Some(self.spec_hash.clone()),
                        unschedulable: None,
                    },
                    endpoint: WorkerEndpoint {
                        control: "http://127.0.0.1:9".into(),
                        data: "127.0.0.1:9".into(),
                    },
                    max_parallelism: assignment.max_parallelism(),
                    killed: false,
                };
                self.workers.insert(name.clone(), w);
                self.created.push(name);
                continue;
            }
            let mut w = self
                .spawn(name.clone(), i, parallelism, token)
                .await
                .map_err(|e| PortError::new(format!("starting worker {name}"), e, true))?;
            w.pod.run = run.to_owned();
            w.max_parallelism = assignment.max_parallelism();
            self.workers.insert(name.clone(), w);
            self.created.push(name);
        }
        self.wake.notify_one();
        Ok(())
    }

    async fn delete(&mut self, names: &[String]) -> Result<(), PortError> {
        for n in names {
            if let Some(mut w) = self.workers.remove(n) {
                w.stop();
                self.deleted.push(n.clone());
            }
        }
        self.wake.notify_one();
        Ok(())
    }

    async fn token(&mut self) -> Result<String, PortError> {
        Ok(self.token.clone())
    }

    fn waker(&self) -> Waker {
        let wake = self.wake.clone();
        Arc::new(move || wake.notify_one())
    }
}

/// The control-API proxy in front of one worker.
struct Proxy {
    upstream: String,
    subtask: u32,
    parallelism: u32,
    faults: Arc<Mutex<Faults>>,
    /// Savepoint ids this worker reports as failed.
    failing: Mutex<BTreeSet<u64>>,
    http: reqwest::Client,
}

fn json(status: u16, body: &impl serde::Serialize) -> axum::response::Response {
    axum::response::Response::builder()
        .status(status)
        .header(axum::http::header::CONTENT_TYPE, "application/json")
        .body(axum::body::Body::from(
            serde_json::to_vec(body).unwrap_or_default(),
        ))
        .unwrap_or_default()
}

async fn forward(
    axum::extract::State(p): axum::extract::State<Arc<Proxy>>,
    req: axum::extract::Request,
) -> axum::response::Response {
    let (parts, body) = req.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, 64 << 20).await else {
        return json(400, &serde_json::json!({"error": "proxy: unreadable body"}));
    };
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |pq| pq.as_str())
        .to_owned();
    let post = parts.method == axum::http::Method::POST;
    if post && path == "/v1/start" {
        let mut f = p.faults.lock().expect("faults lock");
        if f.refuse_start_for_good {
            f.starts_refused += 1;
            return json(
                422,
                &serde_json::json!({"error": "spec.job.program.name \"nope\": this worker image has no such program (refusal injected by the fake platform)"}),
            );
        }
        if f.refuse_start_at == Some(p.parallelism) {
            f.starts_refused += 1;
            return json(
                503,
                &serde_json::json!({"error": format!(
                    "restore failure injected by the fake platform (parallelism {})",
                    p.parallelism
                )}),
            );
        }
    }
    if post
        && path == "/v1/checkpoints"
        && p.subtask == 0
        && let Ok(r) = serde_json::from_slice::<CheckpointRequest>(&bytes)
    {
        let mut f = p.faults.lock().expect("faults lock");
        let fail = match r.kind {
            SnapshotKind::Savepoint => f.fail_savepoints,
            SnapshotKind::Checkpoint => f.fail_checkpoints,
        };
        if fail && p.failing.lock().expect("failing lock").insert(r.id) {
            match r.kind {
                SnapshotKind::Savepoint => f.savepoints_failed += 1,
                SnapshotKind::Checkpoint => f.checkpoints_failed += 1,
            }
        }
    }
    if post
        && path == "/v1/checkpoints"
        && let Ok(r) = serde_json::from_slice::<CheckpointRequest>(&bytes)
        && r.kind == SnapshotKind::Checkpoint
    {
        let mut f = p.faults.lock().expect("faults lock");
        if f.refuse_triggers_of == Some(p.subtask) {
            f.triggers_refused.push(r.id);
            return json(
                503,
                &serde_json::json!({"error": "trigger refused by the fake platform"}),
            );
        }
    }
    let status_of = (!post)
        .then(|| path.strip_prefix("/v1/checkpoints/"))
        .flatten()
        .and_then(|rest| rest.split('?').next())
        .and_then(|id| id.parse::<u64>().ok());
    if status_of.is_some() {
        let mut f = p.faults.lock().expect("faults lock");
        f.status_requests += 1;
        if path.contains("?waitMs=") {
            f.status_long_polls += 1;
        }
    }
    if let Some(id) = status_of
        && p.failing.lock().expect("failing lock").contains(&id)
    {
        return json(
            200,
            &CheckpointStatus::Failed {
                error: "snapshot failure injected by the fake platform (state upload failed)"
                    .into(),
            },
        );
    }
    let mut out = p
        .http
        .request(parts.method.clone(), format!("{}{path}", p.upstream))
        .timeout(Duration::from_secs(60));
    for h in [
        axum::http::header::AUTHORIZATION,
        axum::http::header::CONTENT_TYPE,
    ] {
        if let Some(v) = parts.headers.get(&h) {
            out = out.header(h, v.clone());
        }
    }
    let resp = match out.body(bytes.to_vec()).send().await {
        Ok(r) => r,
        Err(e) => return json(502, &serde_json::json!({"error": format!("proxy: {e}")})),
    };
    let status = resp.status();
    let content_type = resp
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .cloned();
    let body = resp.bytes().await.unwrap_or_default();
    let mut builder = axum::response::Response::builder().status(status);
    if let Some(ct) = content_type {
        builder = builder.header(axum::http::header::CONTENT_TYPE, ct);
    }
    builder
        .body(axum::body::Body::from(body))
        .unwrap_or_default()
}
