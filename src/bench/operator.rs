//! `keyshift bench operator ...`: benchmarks of the operator process against a real API server
//! (the test control plane of `hack/testenv.sh`; `hack/bench-operator.sh` brings one up, runs
//! both and tears it down).
//!
//! * `jobs`: many suspended StreamJobs. Peak and settled RSS of the `keyshift operator`
//!   process, the duration of every reconcile pass (p50/p90/p99/max, from the operator's JSON
//!   log: it logs each pass's exact duration at debug level under the target
//!   `keyshift::reconcile_pass`), and the operator's CPU use once everything has settled.
//! * `rescale`: `kubectl scale` of a job holding large keyed state (the workers keep
//!   `--payload` bytes per key through the bench-only `KEYSHIFT_TEST_STATE_PAYLOAD_BYTES`) until
//!   the job is Ready at the new parallelism, with the per-step durations the operator records in
//!   `status.rescale.stepSeconds`, against a raw write + fsync + read of the same bytes measured
//!   in the same run on the same disk.
//!
//! The operator is the real binary (`keyshift operator`, this executable) run as a child
//! process, as `tests/e2e_operator.rs` runs it. Results: `docs/benchmarks.md`.

use super::measure::{context_line, cpu_time, filler, loadavg, memory_kib, raw_read, raw_write};
use crate::crd::StreamJob;
use crate::operator::desired;
use crate::orchestrator::status::reports_ready;
use crate::runtime::protocol::WorkerStatus;
use anyhow::{Context as _, Result, bail};
use clap::{Args, Subcommand};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Namespace, Pod, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use std::io::{BufRead, Read, Seek};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Target of the operator's per-pass timing log line (see `reconcile_outer`).
const PASS_TARGET: &str = "keyshift::reconcile_pass";
/// Field manager of the objects this benchmark writes.
const MANAGER: &str = "keyshift-bench";

#[derive(Args, Debug)]
pub struct OperatorBench {
    #[command(subcommand)]
    pub command: OperatorBenchCommand,
}

#[derive(Subcommand, Debug)]
pub enum OperatorBenchCommand {
    /// Many suspended StreamJobs: operator RSS, reconcile pass durations, idle CPU.
    Jobs(JobsBench),
    /// `kubectl scale` to Ready with large keyed state, per step, against raw write + read.
    Rescale(OperatorRescaleBench),
}

#[derive(Args, Debug)]
pub struct JobsBench {
    /// StreamJobs to create (all `suspend: true`).
    #[arg(long, default_value_t = 500)]
    pub jobs: usize,
    /// Create requests in flight at once.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Seconds of the idle measurement once everything has settled.
    #[arg(long, default_value_t = 60)]
    pub idle_seconds: u64,
    /// Spec changes per second in the trickle phase (each job's spec is changed once; 0 skips
    /// the phase).
    #[arg(long, default_value_t = 25.0)]
    pub touch_rate: f64,
    /// Seconds to wait for all jobs to be reconciled.
    #[arg(long, default_value_t = 600)]
    pub timeout: u64,
    /// Directory for the operator's storage and log (default: $KEYSHIFT_TESTENV_DIR, else the
    /// system temp dir); a fresh subdirectory is used and removed afterwards unless --keep.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Keep the operator log and storage.
    #[arg(long)]
    pub keep: bool,
}

#[derive(Args, Debug)]
pub struct OperatorRescaleBench {
    /// State size in MiB (about 400 bytes per key with the default payload).
    #[arg(long, default_value_t = 256)]
    pub state_mib: u64,
    /// Parallelism before the rescale.
    #[arg(long, default_value_t = 4)]
    pub from: u32,
    /// Parallelism after (`kubectl scale --replicas`).
    #[arg(long, default_value_t = 8)]
    pub to: u32,
    /// Key groups.
    #[arg(long, default_value_t = 128)]
    pub max_parallelism: u32,
    /// Opaque bytes of state per key (KEYSHIFT_TEST_STATE_PAYLOAD_BYTES for the operator).
    #[arg(long, default_value_t = 360)]
    pub payload: usize,
    /// Rounds of the raw baseline (best kept).
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Seconds to wait for the state to be built and for each rescale.
    #[arg(long, default_value_t = 900)]
    pub timeout: u64,
    /// Directory for storage and logs (default: $KEYSHIFT_TESTENV_DIR, else the system temp
    /// dir; a local filesystem: the raw baseline runs there); removed afterwards unless --keep.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Keep the snapshots and the operator log.
    #[arg(long)]
    pub keep: bool,
}

pub async fn run(args: OperatorBench) -> Result<()> {
    crate::telemetry::install_crypto_provider();
    match args.command {
        OperatorBenchCommand::Jobs(a) => jobs_bench(a).await,
        OperatorBenchCommand::Rescale(a) => rescale_bench(a).await,
    }
}

// ---------------------------------------------------------------------------------------------
// Shared: the cluster side, the operator process, its log.

async fn client() -> Result<Client> {
    Client::try_default()
        .await
        .context("no Kubernetes client: set KUBECONFIG (hack/bench-operator.sh does)")
}

/// Installs the StreamJob CRD (server-side apply of `keyshift crd`) and waits until it serves.
async fn ensure_crd(client: &Client) -> Result<()> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = crate::validation::crd();
    let name = crd.name_any();
    crds.patch(
        &name,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(&crd),
    )
    .await
    .context("applying the StreamJob CRD")?;
    let established = kube::runtime::wait::conditions::is_crd_established();
    tokio::time::timeout(
        Duration::from_secs(60),
        kube::runtime::wait::await_condition(crds, &name, established),
    )
    .await
    .context("the CRD was not established within 60 s")??;
    Ok(())
}

async fn create_namespace(client: &Client, name: &str) -> Result<()> {
    let nss: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}
    }))?;
    nss.create(&PostParams::default(), &ns)
        .await
        .with_context(|| format!("creating namespace {name}"))?;
    // The StreamJob API needs the default ServiceAccount only for pods; wait for nothing else.
    Ok(())
}

fn work_dir(dir: &Option<PathBuf>, what: &str) -> Result<PathBuf> {
    let base = dir
        .clone()
        .or_else(|| std::env::var_os("KEYSHIFT_TESTENV_DIR").map(PathBuf::from))
        .unwrap_or_else(std::env::temp_dir);
    let run = base.join(format!("bench-operator-{what}-{}", std::process::id()));
    std::fs::create_dir_all(&run).with_context(|| format!("creating {}", run.display()))?;
    Ok(std::fs::canonicalize(&run)?)
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// `keyshift operator` (this executable) as a child process with JSON logs; killed on drop.
struct OperatorProcess {
    child: Child,
    log: PathBuf,
    metrics: String,
}

impl OperatorProcess {
    fn start(ns: &str, storage: &str, log: PathBuf, envs: &[(&str, String)]) -> Result<Self> {
        let port = free_port()?;
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("{}", log.display()))?;
        let child = Command::new(std::env::current_exe()?)
            .args([
                "--log-format",
                "json",
                "operator",
                "--namespaces",
                ns,
                "--default-storage",
                storage,
                "--metrics-addr",
                &format!("127.0.0.1:{port}"),
                "--leader-elect=false",
            ])
            .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
            .env("RUST_LOG", format!("info,{PASS_TARGET}=debug"))
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .context("starting keyshift operator")?;
        Ok(OperatorProcess {
            child,
            log,
            metrics: format!("http://127.0.0.1:{port}"),
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Fails with the end of the log if the process has exited.
    fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "keyshift operator exited ({status}); its log ends with:\n{}",
                tail(&self.log, 30)
            );
        }
        Ok(())
    }

    /// Waits until `/readyz` answers 200 (the controllers watch).
    async fn wait_ready(&mut self, http: &reqwest::Client) -> Result<()> {
        let t = Instant::now();
        loop {
            self.check_alive()?;
            if let Ok(r) = http.get(format!("{}/readyz", self.metrics)).send().await
                && r.status().is_success()
            {
                return Ok(());
            }
            if t.elapsed() > Duration::from_secs(60) {
                bail!("the operator was not ready within 60 s");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Bytes of log written so far (a mark to split passes into phases).
    fn mark(&self) -> u64 {
        std::fs::metadata(&self.log).map_or(0, |m| m.len())
    }

    /// Every reconcile pass logged between two marks.
    fn passes(&self, from: u64, to: u64) -> Result<Vec<PassRecord>> {
        let mut f = std::fs::File::open(&self.log)?;
        f.seek(std::io::SeekFrom::Start(from))?;
        let reader = std::io::BufReader::new(f.take(to.saturating_sub(from)));
        let mut out = Vec::new();
        for line in reader.lines() {
            out.extend(parse_pass(&line?));
        }
        Ok(out)
    }

    /// Reconcile passes counted by the operator's own histogram (`/metrics`), as a check.
    async fn histogram_count(&self, http: &reqwest::Client) -> Option<u64> {
        let text = http
            .get(format!("{}/metrics", self.metrics))
            .send()
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix("keyshift_operator_reconcile_duration_seconds_count "))
            .and_then(|v| v.trim().parse().ok())
    }
}

impl Drop for OperatorProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A reconcile pass from one JSON log line of the operator, if the line is one.
fn parse_pass(line: &str) -> Option<PassRecord> {
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    if v["target"] != PASS_TARGET {
        return None;
    }
    Some(PassRecord {
        seconds: v["seconds"].as_f64()?,
        ok: v["ok"].as_bool().unwrap_or(true),
        job: v["job"].as_str().unwrap_or_default().to_owned(),
        reason: v["span"]["object.reason"]
            .as_str()
            .unwrap_or("?")
            .to_owned(),
    })
}

struct PassRecord {
    seconds: f64,
    ok: bool,
    job: String,
    /// Why the controller ran the pass (kube-runtime's `object.reason` span field).
    reason: String,
}

/// How many passes ran for each reason.
fn reasons(passes: &[PassRecord]) -> std::collections::BTreeMap<&str, usize> {
    let mut out = std::collections::BTreeMap::new();
    for p in passes {
        *out.entry(p.reason.as_str()).or_default() += 1;
    }
    out
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (p * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

/// One row of the pass-duration table.
/// The 1-minute load average now.
fn load1() -> String {
    loadavg()
        .split_whitespace()
        .next()
        .unwrap_or("?")
        .to_owned()
}

fn pass_row(phase: &str, passes: &[PassRecord], wall: Duration, load: &str) -> String {
    let mut s: Vec<f64> = passes.iter().map(|p| p.seconds * 1000.0).collect();
    s.sort_by(f64::total_cmp);
    let jobs: std::collections::HashSet<&str> = passes.iter().map(|p| p.job.as_str()).collect();
    let errors = passes.iter().filter(|p| !p.ok).count();
    let ms = |v: f64| {
        if v.is_nan() {
            "-".to_owned()
        } else {
            format!("{v:.1} ms")
        }
    };
    format!(
        "| {phase} | {load} | {:.1} s | {} | {} | {errors} | {} | {} | {} | {} | {} |",
        wall.as_secs_f64(),
        s.len(),
        jobs.len(),
        ms(percentile(&s, 0.50)),
        ms(percentile(&s, 0.90)),
        ms(percentile(&s, 0.99)),
        ms(s.last().copied().unwrap_or(f64::NAN)),
        if s.is_empty() {
            "-".to_owned()
        } else {
            format!("{:.1}", s.len() as f64 / wall.as_secs_f64().max(1e-9))
        }
    )
}

fn mib_of_kib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// The pid of a test control plane component (`$KEYSHIFT_TESTENV_DIR/pids/NAME.pid`).
fn testenv_pid(name: &str) -> Option<u32> {
    let dir = std::env::var_os("KEYSHIFT_TESTENV_DIR")?;
    let text =
        std::fs::read_to_string(Path::new(&dir).join("pids").join(format!("{name}.pid"))).ok()?;
    text.split_whitespace().next()?.parse().ok()
}

/// Runs an API call, retrying what a loaded test control plane fails with a 5xx or 429 (e.g.
/// "resource quota evaluation timed out") up to 4 times, after 0.5 s, 1 s, 2 s and 4 s, each
/// jittered (backon).
async fn retry<T, F, Fut>(what: &str, call: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = kube::Result<T>>,
{
    use backon::Retryable;
    let policy = backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(500))
        .with_factor(2.0)
        .with_max_times(4)
        .with_jitter();
    call.retry(policy)
        .when(|e| matches!(e, kube::Error::Api(s) if s.code >= 500 || s.code == 429))
        .notify(|e, _| {
            if let kube::Error::Api(s) = e {
                println!("  {what}: {} {}; retrying", s.code, s.message);
            }
        })
        .await
        .with_context(|| what.to_owned())
}

fn job_from_yaml(yaml: &str) -> Result<StreamJob> {
    serde_yaml::from_str(yaml).context("bench job manifest")
}

// ---------------------------------------------------------------------------------------------
// jobs: many suspended StreamJobs

fn suspended_job(name: &str) -> Result<StreamJob> {
    job_from_yaml(&format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata:
  name: {name}
spec:
  replicas: 2
  maxParallelism: 128
  suspend: true
  job:
    source:
      generator: {{partitions: 4, keys: 1000, seed: 1}}
    key: {{field: key, type: string}}
    aggregation: {{function: count}}
  state:
    checkpointInterval: 30s
"
    ))
}

/// Waits until the operator logs no reconcile pass for `quiet`, at most `limit`; the new mark.
async fn wait_quiet(
    op: &mut OperatorProcess,
    from: u64,
    quiet: Duration,
    limit: Duration,
) -> Result<u64> {
    let t = Instant::now();
    let mut last = op.passes(from, op.mark())?.len();
    let mut since = Instant::now();
    loop {
        op.check_alive()?;
        tokio::time::sleep(Duration::from_millis(250)).await;
        let mark = op.mark();
        let n = op.passes(from, mark)?.len();
        if n != last {
            last = n;
            since = Instant::now();
        } else if since.elapsed() >= quiet || t.elapsed() >= limit {
            return Ok(mark);
        }
    }
}

/// The operator has written status for the job's current generation (Ready may be False: see
/// docs/benchmarks.md on jobs created suspended).
fn is_reconciled(job: &StreamJob) -> bool {
    let generation = job.metadata.generation;
    job.status.as_ref().is_some_and(|s| {
        s.observed_generation == generation
            && s.conditions.iter().any(|c| {
                c.type_ == crate::orchestrator::status::READY && c.observed_generation == generation
            })
    })
}

fn phases(jobs: &[StreamJob]) -> std::collections::BTreeMap<String, usize> {
    let mut out = std::collections::BTreeMap::new();
    for j in jobs {
        let phase = j
            .status
            .as_ref()
            .and_then(|s| s.phase)
            .map_or("none".to_owned(), |p| format!("{p:?}"));
        *out.entry(phase).or_default() += 1;
    }
    out
}

type Stamps = std::sync::Arc<std::sync::Mutex<std::collections::HashMap<(String, i64), Instant>>>;

/// Watches the namespace's StreamJobs and stamps when status first shows each (job,
/// generation) reconciled: with the time each change was sent, the end-to-end latency a user
/// sees (change accepted -> status reflects it), queueing in the controller included.
fn watch_reconciled(api: Api<StreamJob>) -> (Stamps, tokio::task::JoinHandle<()>) {
    use kube::runtime::WatchStreamExt;
    let seen: Stamps = Default::default();
    let stamps = seen.clone();
    let task = tokio::spawn(async move {
        let mut events =
            std::pin::pin!(kube::runtime::watcher(api, Default::default()).applied_objects());
        while let Some(ev) = events.next().await {
            let Ok(job) = ev else { continue };
            if is_reconciled(&job) {
                let key = (job.name_any(), job.metadata.generation.unwrap_or_default());
                let mut m = stamps.lock().unwrap_or_else(|p| p.into_inner());
                m.entry(key).or_insert_with(Instant::now);
            }
        }
    });
    (seen, task)
}

/// End-to-end latencies (ms, sorted) of the changes sent at `sent` for `generation`.
fn latencies(sent: &[(String, Instant)], generation: i64, seen: &Stamps) -> Vec<f64> {
    let m = seen.lock().unwrap_or_else(|p| p.into_inner());
    let mut out: Vec<f64> = sent
        .iter()
        .filter_map(|(name, t)| {
            m.get(&(name.clone(), generation))
                .map(|s| s.saturating_duration_since(*t).as_secs_f64() * 1000.0)
        })
        .collect();
    out.sort_by(f64::total_cmp);
    out
}

fn latency_row(phase: &str, ms: &[f64], expected: usize) -> String {
    format!(
        "| {phase} | {} of {expected} | {:.0} ms | {:.0} ms | {:.0} ms | {:.0} ms |",
        ms.len(),
        percentile(ms, 0.50),
        percentile(ms, 0.90),
        percentile(ms, 0.99),
        ms.last().copied().unwrap_or(f64::NAN)
    )
}

/// Waits until the operator has written status for every job's current generation.
async fn wait_all_reconciled(
    op: &mut OperatorProcess,
    jobs: &Api<StreamJob>,
    n: usize,
    timeout: Duration,
) -> Result<Instant> {
    let t = Instant::now();
    let mut last_print = Instant::now();
    loop {
        op.check_alive()?;
        let list = jobs.list(&ListParams::default()).await?;
        let done = list.items.iter().filter(|j| is_reconciled(j)).count();
        let ready = list.items.iter().filter(|j| reports_ready(j)).count();
        if done >= n {
            println!(
                "  all {n} reconciled after {:.1} s ({ready} Ready=True; phases {:?})",
                t.elapsed().as_secs_f64(),
                phases(&list.items)
            );
            return Ok(Instant::now());
        }
        if t.elapsed() > timeout {
            bail!("only {done} of {n} StreamJobs reconciled after {timeout:?}");
        }
        if last_print.elapsed() > Duration::from_secs(10) {
            last_print = Instant::now();
            println!(
                "  {done} of {n} reconciled ({ready} Ready=True) after {:.0} s",
                t.elapsed().as_secs_f64()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn jobs_bench(args: JobsBench) -> Result<()> {
    let ctx_start = context_line();
    let client = client().await?;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?;
    ensure_crd(&client).await?;
    let ns = format!("bench-jobs-{}", std::process::id());
    create_namespace(&client, &ns).await?;
    let run = work_dir(&args.dir, "jobs")?;
    let storage = format!("file://{}", run.join("store").display());
    println!(
        "keyshift bench operator jobs: {} suspended StreamJobs in namespace {ns} ({} creates in flight), then {} s idle, then one spec change per job at {}/s; operator log {}",
        args.jobs,
        args.concurrency,
        args.idle_seconds,
        args.touch_rate,
        run.join("operator.log").display()
    );
    println!("machine: {ctx_start}");

    let mut op = OperatorProcess::start(&ns, &storage, run.join("operator.log"), &[])?;
    op.wait_ready(&http).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let pid = op.pid();
    let (_, rss_empty) = memory_kib(pid);

    // Phase 1: create every job (burst) and wait until all are reconciled.
    let api: Api<StreamJob> = Api::namespaced(client.clone(), &ns);
    let (seen, watch_task) = watch_reconciled(api.clone());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mark0 = op.mark();
    let cpu0 = cpu_time(pid);
    let t0 = Instant::now();
    let names: Vec<String> = (0..args.jobs).map(|i| format!("job-{i:04}")).collect();
    let created_at: Vec<(String, Instant)> = futures::stream::iter(names.iter().map(|n| {
        let api = api.clone();
        async move {
            let job = suspended_job(n)?;
            let sent = Instant::now();
            retry(&format!("creating sj/{n}"), || async {
                match api.create(&PostParams::default(), &job).await {
                    // A retried create whose first attempt went through after all.
                    Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
                    r => r.map(drop),
                }
            })
            .await?;
            anyhow::Ok((n.clone(), sent))
        }
    }))
    .buffer_unordered(args.concurrency.max(1))
    .try_collect()
    .await?;
    let created = t0.elapsed();
    println!(
        "created {} StreamJobs in {:.1} s",
        args.jobs,
        created.as_secs_f64()
    );
    let all_ready =
        wait_all_reconciled(&mut op, &api, args.jobs, Duration::from_secs(args.timeout))
            .await?
            .duration_since(t0);
    println!(
        "all reconciled {:.1} s after the first create",
        all_ready.as_secs_f64()
    );
    let mark1 = wait_quiet(
        &mut op,
        mark0,
        Duration::from_secs(5),
        Duration::from_secs(60),
    )
    .await?;
    let settle_wall = t0.elapsed();
    let load_create = load1();
    let cpu_settle = cpu_time(pid).saturating_sub(cpu0);
    let create_passes = op.passes(mark0, mark1)?;
    let (hwm_after_create, rss_after_create) = memory_kib(pid);

    // Phase 2: idle, everything settled.
    let api_pid = testenv_pid("kube-apiserver");
    let etcd_pid = testenv_pid("etcd");
    let cp_cpu = |pid: Option<u32>| pid.map(cpu_time);
    let (a0, e0) = (cp_cpu(api_pid), cp_cpu(etcd_pid));
    let cpu_idle0 = cpu_time(pid);
    let t_idle = Instant::now();
    tokio::time::sleep(Duration::from_secs(args.idle_seconds)).await;
    op.check_alive()?;
    let idle_wall = t_idle.elapsed();
    let load_idle = load1();
    let idle_cpu = cpu_time(pid).saturating_sub(cpu_idle0);
    let (a1, e1) = (cp_cpu(api_pid), cp_cpu(etcd_pid));
    let mark2 = op.mark();
    let idle_passes = op.passes(mark1, mark2)?;
    let (_, rss_idle) = memory_kib(pid);
    let pct = |cpu: Duration| 100.0 * cpu.as_secs_f64() / idle_wall.as_secs_f64().max(1e-9);
    let cp_line = match (a0.zip(a1), e0.zip(e1)) {
        (Some((a0, a1)), Some((e0, e1))) => format!(
            "; meanwhile kube-apiserver {:.1}% and etcd {:.1}% of one CPU",
            pct(a1.saturating_sub(a0)),
            pct(e1.saturating_sub(e0))
        ),
        _ => String::new(),
    };
    println!(
        "idle {:.0} s: operator CPU {:.3} s = {:.2}% of one CPU, {} reconcile passes{cp_line}",
        idle_wall.as_secs_f64(),
        idle_cpu.as_secs_f64(),
        pct(idle_cpu),
        idle_passes.len()
    );

    // Phase 3: a trickle of spec changes, one per job (each bumps the generation: a pass that
    // writes status, then the pass its own status write triggers).
    let mut touch = None;
    if args.touch_rate > 0.0 {
        let cpu_t0 = cpu_time(pid);
        let t = Instant::now();
        let gap = Duration::from_secs_f64(1.0 / args.touch_rate);
        let patch = serde_json::json!({"spec": {"state": {"checkpointInterval": "45s"}}});
        let mut sent = Vec::new();
        for (i, n) in names.iter().enumerate() {
            let due = t + gap.mul_f64(i as f64);
            tokio::time::sleep_until(due.into()).await;
            sent.push((n.clone(), Instant::now()));
            retry(&format!("changing sj/{n}"), || async {
                api.patch(n, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
            })
            .await?;
        }
        wait_all_reconciled(&mut op, &api, args.jobs, Duration::from_secs(args.timeout)).await?;
        let mark3 = wait_quiet(
            &mut op,
            mark2,
            Duration::from_secs(5),
            Duration::from_secs(60),
        )
        .await?;
        touch = Some((
            op.passes(mark2, mark3)?,
            t.elapsed(),
            cpu_time(pid).saturating_sub(cpu_t0),
            latencies(&sent, 2, &seen),
            load1(),
        ));
    }
    watch_task.abort();
    let create_latency = latencies(&created_at, 1, &seen);

    let (hwm, rss_end) = memory_kib(pid);
    let histogram = op.histogram_count(&http).await;
    let logged = op.passes(0, op.mark())?.len();
    let ctx_end = loadavg();
    drop(op);
    if args.keep {
        println!("kept {}", run.display());
    } else {
        let _ = std::fs::remove_dir_all(&run);
    }

    println!();
    println!(
        "reconcile passes logged {logged}, counted by the operator's histogram {}",
        histogram.map_or("?".into(), |n| n.to_string())
    );
    println!("machine at the end: load average {ctx_end}");
    println!("passes by trigger: create {:?}", reasons(&create_passes));
    println!("passes by trigger: idle {:?}", reasons(&idle_passes));
    if let Some((passes, _, _, _, _)) = &touch {
        println!("passes by trigger: spec change {:?}", reasons(passes));
    }
    println!();
    println!(
        "| phase | load (1 min) at its end | wall | passes | jobs | errors | p50 | p90 | p99 | max | passes/s |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    println!(
        "{}",
        pass_row(
            &format!("create {} (burst) until settled", args.jobs),
            &create_passes,
            settle_wall,
            &load_create
        )
    );
    println!(
        "{}",
        pass_row("idle (settled)", &idle_passes, idle_wall, &load_idle)
    );
    if let Some((passes, wall, _, _, load)) = &touch {
        println!(
            "{}",
            pass_row(
                &format!("spec change, {}/s", args.touch_rate),
                passes,
                *wall,
                load
            )
        );
    }
    println!();
    println!(
        "| end to end: change sent -> status shows it reconciled (watch) | jobs | p50 | p90 | p99 | max |"
    );
    println!("| --- | --- | --- | --- | --- | --- |");
    println!(
        "{}",
        latency_row(
            &format!("create {} (burst)", args.jobs),
            &create_latency,
            args.jobs
        )
    );
    if let Some((_, _, _, ms, _)) = &touch {
        println!(
            "{}",
            latency_row(
                &format!("spec change, {}/s", args.touch_rate),
                ms,
                args.jobs
            )
        );
    }
    println!();
    println!("| operator | value |");
    println!("| --- | --- |");
    println!("| RSS with no jobs | {:.1} MiB |", mib_of_kib(rss_empty));
    println!(
        "| RSS after {} jobs settled (peak so far) | {:.1} MiB ({:.1} MiB) |",
        args.jobs,
        mib_of_kib(rss_after_create),
        mib_of_kib(hwm_after_create)
    );
    println!(
        "| RSS after the idle phase / at the end | {:.1} MiB / {:.1} MiB |",
        mib_of_kib(rss_idle),
        mib_of_kib(rss_end)
    );
    println!("| **peak RSS (VmHWM)** | **{:.1} MiB** |", mib_of_kib(hwm));
    println!(
        "| time to create {} / all reconciled | {:.1} s / {:.1} s |",
        args.jobs,
        created.as_secs_f64(),
        all_ready.as_secs_f64()
    );
    println!(
        "| CPU from first create to settled | {:.2} s over {:.1} s |",
        cpu_settle.as_secs_f64(),
        settle_wall.as_secs_f64()
    );
    println!(
        "| **idle CPU** ({:.0} s, settled) | **{:.3} s = {:.2}% of one CPU** |",
        idle_wall.as_secs_f64(),
        idle_cpu.as_secs_f64(),
        pct(idle_cpu)
    );
    if let Some((_, wall, cpu, _, _)) = &touch {
        println!(
            "| CPU during the spec changes | {:.2} s over {:.1} s |",
            cpu.as_secs_f64(),
            wall.as_secs_f64()
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// rescale: kubectl scale with large keyed state

fn kubectl_scale(ns: &str, name: &str, to: u32) -> Result<()> {
    let out = Command::new("kubectl")
        .args([
            "scale",
            "-n",
            ns,
            &format!("sj/{name}"),
            &format!("--replicas={to}"),
        ])
        .output()
        .context("running kubectl (is it installed, is KUBECONFIG set?)")?;
    if !out.status.success() {
        bail!(
            "kubectl scale failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Status of every running worker of the job, through its control API (pod IPs are reachable
/// from the host in the test environment).
async fn worker_status(
    client: &Client,
    http: &reqwest::Client,
    ns: &str,
    name: &str,
) -> Result<Vec<WorkerStatus>> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let secret = secrets.get(&desired::secret_name(name)).await?;
    let token = secret
        .data
        .as_ref()
        .and_then(|d| d.get(desired::TOKEN_KEY))
        .map(|b| String::from_utf8_lossy(&b.0).into_owned())
        .context("control token")?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let list = pods
        .list(&ListParams::default().labels(&desired::selector(name)))
        .await?;
    let mut out = Vec::new();
    for p in list
        .items
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
    {
        let Some(ip) = p.status.as_ref().and_then(|s| s.pod_ip.clone()) else {
            continue;
        };
        let url = format!("http://{ip}:{}/v1/status", desired::CONTROL_PORT);
        let st: WorkerStatus = http
            .get(&url)
            .bearer_auth(&token)
            .send()
            .await
            .with_context(|| format!("GET {url}"))?
            .error_for_status()?
            .json()
            .await?;
        out.push(st);
    }
    Ok(out)
}

async fn wait_job(
    op: &mut OperatorProcess,
    api: &Api<StreamJob>,
    name: &str,
    timeout: Duration,
    done: impl Fn(&StreamJob) -> bool,
) -> Result<StreamJob> {
    let t = Instant::now();
    loop {
        op.check_alive()?;
        let job = api.get(name).await?;
        if done(&job) {
            return Ok(job);
        }
        if t.elapsed() > timeout {
            bail!(
                "sj/{name} not there after {timeout:?}: status {}",
                serde_json::to_string(&job.status).unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn rescale_bench(args: OperatorRescaleBench) -> Result<()> {
    let ctx_start = context_line();
    let client = client().await?;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    ensure_crd(&client).await?;
    let ns = format!("bench-rescale-{}", std::process::id());
    create_namespace(&client, &ns).await?;
    let run = work_dir(&args.dir, "rescale")?;
    // The workers run as pods on the test node and reach the same directory through a hostPath
    // volume at the same path (the bench namespace enforces no Pod Security level), so the
    // operator (a host process) and the workers share one file:// store, as on one machine.
    let store = run.join("store");
    std::fs::create_dir_all(&store)?;
    std::fs::set_permissions(&store, std::os::unix::fs::PermissionsExt::from_mode(0o777))?;
    let storage = format!("file://{}", store.display());
    let name = "big";
    // About 40 bytes of key and accumulator per key besides the payload (as in `bench rescale`).
    let keys = ((args.state_mib << 20) / (args.payload as u64 + 40)).max(1);
    let partitions = args.from.max(args.to);
    let per_key = (keys as f64).ln() + 2.0;
    let per_partition = ((keys as f64 * per_key) / f64::from(partitions)).ceil() as u64;
    let total_records = per_partition * u64::from(partitions);
    println!(
        "keyshift bench operator rescale: {} MiB target, {keys} string keys x {} B payload, kubectl scale {} -> {} of {} key groups; {total_records} records over {partitions} partitions; namespace {ns}, in {}",
        args.state_mib,
        args.payload,
        args.from,
        args.to,
        args.max_parallelism,
        run.display()
    );
    println!("machine: {ctx_start}");

    let mut op = OperatorProcess::start(
        &ns,
        &storage,
        run.join("operator.log"),
        &[(
            "KEYSHIFT_TEST_STATE_PAYLOAD_BYTES",
            args.payload.to_string(),
        )],
    )?;
    op.wait_ready(&http).await?;
    let api: Api<StreamJob> = Api::namespaced(client.clone(), &ns);
    let job = job_from_yaml(&format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata:
  name: {name}
spec:
  replicas: {from}
  maxParallelism: {g}
  job:
    source:
      generator: {{partitions: {partitions}, keys: {keys}, seed: 7, recordsPerPartition: {per_partition}}}
    key: {{field: key, type: string}}
    aggregation: {{function: count}}
    sink: {{type: log}}
  state:
    checkpointInterval: 1h
  podTemplate:
    volumes:
    - name: store
      hostPath: {{path: {store}, type: Directory}}
    volumeMounts:
    - name: store
      mountPath: {store}
",
        from = args.from,
        g = args.max_parallelism,
        store = store.display(),
    ))?;
    api.create(&PostParams::default(), &job).await?;
    let timeout = Duration::from_secs(args.timeout);
    let from = args.from as i32;
    wait_job(&mut op, &api, name, timeout, |j| {
        reports_ready(j) && j.status.as_ref().and_then(|s| s.replicas) == Some(from)
    })
    .await?;

    // Build the state: every record processed.
    let t_build = Instant::now();
    let mut last_print = Instant::now();
    loop {
        op.check_alive()?;
        let st = worker_status(&client, &http, &ns, name).await?;
        let n: u64 = st.iter().map(|s| s.records_processed).sum();
        if st.len() == args.from as usize && n >= total_records {
            println!(
                "state built in {:.1} s: {n} records, {} keys",
                t_build.elapsed().as_secs_f64(),
                st.iter().map(|s| s.keys).sum::<u64>()
            );
            break;
        }
        if t_build.elapsed() > timeout {
            bail!("{n} of {total_records} records processed after {timeout:?}");
        }
        if last_print.elapsed() > Duration::from_secs(10) {
            last_print = Instant::now();
            println!("  building state: {n} of {total_records} records");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;

    // The rescale: kubectl scale, then poll until Ready at the new parallelism.
    let load_before = loadavg();
    let (_, op_rss_before) = memory_kib(op.pid());
    let wall0 = jiff::Timestamp::now();
    let t0 = Instant::now();
    kubectl_scale(&ns, name, args.to)?;
    let kubectl_took = t0.elapsed();
    let to = args.to as i32;
    let done = wait_job(&mut op, &api, name, timeout, |j| {
        let s = j.status.as_ref();
        reports_ready(j)
            && s.and_then(|s| s.replicas) == Some(to)
            && s.and_then(|s| s.rescale.as_ref())
                .is_some_and(|r| r.step == keyshift_core::step::Step::Done && r.to == to)
    })
    .await?;
    let total = t0.elapsed();
    let load_after_rescale = loadavg();
    let status = done.status.clone().unwrap_or_default();
    let r = status.rescale.clone().unwrap_or_default();
    let state_bytes = status
        .last_savepoint
        .as_ref()
        .and_then(|s| s.size_bytes)
        .unwrap_or_default()
        .max(0) as u64;
    let reaction = r
        .started
        .parse::<jiff::Timestamp>()
        .ok()
        .and_then(|s| Duration::try_from(s.duration_since(wall0)).ok());
    let after = worker_status(&client, &http, &ns, name).await?;
    let keys_after: u64 = after.iter().map(|s| s.keys).sum();
    let (op_hwm, _) = memory_kib(op.pid());
    drop(op);

    // Raw baseline in the same directory (same disk), best of N.
    let chunks = filler(state_bytes);
    let raw_path = run.join("raw.bin");
    let (mut best_w, mut best_r, mut best_sum) = (Duration::MAX, Duration::MAX, Duration::MAX);
    for _ in 0..args.rounds.max(1) {
        let w = raw_write(&raw_path, &chunks)?.wall;
        let rd = raw_read(&raw_path, state_bytes)?.wall;
        best_w = best_w.min(w);
        best_r = best_r.min(rd);
        best_sum = best_sum.min(w + rd);
    }
    drop(chunks);
    let _ = std::fs::remove_file(&raw_path);
    if args.keep {
        println!("kept {}", run.display());
    } else {
        let _ = std::fs::remove_dir_all(&run);
    }

    let steps: Vec<(String, f64)> = keyshift_core::step::ALL_STEPS
        .iter()
        .filter(|s| s.active())
        .filter_map(|s| r.step_seconds.get(s.as_str()).map(|v| (s.to_string(), *v)))
        .collect();
    let step_sum: f64 = steps.iter().map(|(_, v)| v).sum();
    let raw = best_sum.as_secs_f64();
    let ratio = |v: f64| v / raw.max(1e-9);
    println!();
    println!(
        "rescale {} -> {}: kubectl scale returned after {:.2} s, Ready after {:.2} s; savepoint {} ({} bytes); {} key groups moved, {} bytes read by the new workers; {keys_after} keys held after (expected {keys})",
        r.from,
        r.to,
        kubectl_took.as_secs_f64(),
        total.as_secs_f64(),
        r.savepoint.as_deref().unwrap_or("?"),
        state_bytes,
        r.groups_moved.unwrap_or_default(),
        r.bytes_to_read.unwrap_or_default()
    );
    println!(
        "raw baseline (best of {}): write + fsync {:.2} s + read {:.2} s = {:.2} s",
        args.rounds.max(1),
        best_w.as_secs_f64(),
        best_r.as_secs_f64(),
        raw
    );
    println!(
        "operator RSS {:.1} MiB before the scale, peak (VmHWM) {:.1} MiB",
        mib_of_kib(op_rss_before),
        mib_of_kib(op_hwm)
    );
    println!(
        "machine: load average {load_before} before the scale, {load_after_rescale} at Ready, {} at the end",
        loadavg()
    );
    println!();
    println!(
        "| `kubectl scale` {} -> {}, {:.0} MiB ({} keys) | seconds | / raw write+read ({:.2} s) |",
        r.from,
        r.to,
        state_bytes as f64 / f64::from(1u32 << 20),
        keys,
        raw
    );
    println!("| --- | --- | --- |");
    if let Some(d) = reaction {
        println!(
            "| kubectl scale until the operator records Savepointing | {:.2} | |",
            d.as_secs_f64()
        );
    }
    for (s, v) in &steps {
        println!("| step {s} | {v:.2} | {:.2} |", ratio(*v));
    }
    println!(
        "| sum of the steps | {step_sum:.2} | **{:.2}** |",
        ratio(step_sum)
    );
    println!(
        "| **kubectl scale to Ready** | **{:.2}** | **{:.2}** |",
        total.as_secs_f64(),
        ratio(total.as_secs_f64())
    );
    println!(
        "| raw write + fsync / read of the same bytes | {:.2} / {:.2} | 1.00 |",
        best_w.as_secs_f64(),
        best_r.as_secs_f64()
    );
    if keys_after != keys {
        println!("WARNING: {keys_after} keys held after the rescale, expected {keys}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.50), 50.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&v, 1.0), 100.0);
        assert_eq!(percentile(&[7.0], 0.99), 7.0);
        assert!(percentile(&[], 0.5).is_nan());
    }

    #[test]
    fn parses_the_operators_pass_lines_only() {
        let pass = r#"{"timestamp":"2026-01-01T00:00:00.000000Z","level":"DEBUG","message":"reconcile pass","namespace":"ns","job":"job-0001","seconds":0.0125,"ok":true,"target":"keyshift::reconcile_pass","span":{"object.reason":"object updated","name":"reconciling object"}}"#;
        let p = parse_pass(pass).expect("a pass line");
        assert_eq!(
            (p.job.as_str(), p.reason.as_str()),
            ("job-0001", "object updated")
        );
        assert!((p.seconds - 0.0125).abs() < 1e-12 && p.ok);
        let other = r#"{"timestamp":"x","level":"DEBUG","message":"decided","target":"keyshift::operator::reconcile"}"#;
        assert!(parse_pass(other).is_none());
        assert!(parse_pass("not json").is_none());
    }
}
