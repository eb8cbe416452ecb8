//! `keyshift job ...`, which kubectl runs as `kubectl keyshift ...` (the same binary installed as
//! `kubectl-keyshift`): a live StreamJob's status on one screen, a savepoint, suspend, resume,
//! scale and plan against the job as it runs, and the client's and operators' versions.
//!
//! Every command acts through the StreamJob's spec, as `kubectl patch` would, or, for a
//! savepoint, by creating a StreamJobSnapshot (the operator does the work and reports in
//! status), so nothing here needs more rights than editing the job and creating snapshots.
//! What is shown is built by pure functions ([`view`], [`complete`]); this module holds the I/O.

pub mod complete;
pub mod view;

use crate::crd::{
    Phase, SnapshotPhase, StreamJob, StreamJobSnapshot, StreamJobSnapshotSpec,
    StreamJobSnapshotStatus,
};
use crate::orchestrator::status::reports_ready;
use crate::output::{Output, PlanOutput, render};
use clap::Subcommand;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The program name kubectl looks for on `PATH` to run `kubectl keyshift ...`.
pub const PLUGIN_NAME: &str = "kubectl-keyshift";
/// The program name kubectl (1.26 and later) runs to complete `kubectl keyshift ...`.
pub const PLUGIN_COMPLETION_NAME: &str = "kubectl_complete-keyshift";

/// `keyshift job`.
#[derive(clap::Args, Debug)]
pub struct JobArgs {
    #[command(flatten)]
    pub cluster: ClusterArgs,
    #[command(subcommand)]
    pub command: JobCommand,
}

/// Which cluster and namespace, as kubectl's flags of the same names.
#[derive(clap::Args, Debug, Default, Clone, PartialEq, Eq)]
pub struct ClusterArgs {
    /// Namespace of the job (default: the kubeconfig context's, else `default`).
    #[arg(long, short = 'n', global = true)]
    pub namespace: Option<String>,
    /// Kubeconfig context (default: the current context).
    #[arg(long, global = true)]
    pub context: Option<String>,
    /// Kubeconfig file (default: `$KUBECONFIG`, then `~/.kube/config`, then the pod's
    /// ServiceAccount).
    #[arg(long, global = true)]
    pub kubeconfig: Option<PathBuf>,
}

/// How long a command waits for the operator, and whether it does.
#[derive(clap::Args, Debug, Clone)]
pub struct WaitArgs {
    /// Longest wait for the operator to finish (`30s`, `5m`, `1h`).
    #[arg(long, default_value = "5m", value_parser = duration)]
    pub timeout: Duration,
}

#[derive(Subcommand, Debug)]
pub enum JobCommand {
    /// The job on one screen: phase, workers, conditions, last checkpoint and savepoint, the
    /// rescale in progress (or the last), how its state is spread and its source's lag.
    #[command(after_help = STATUS_EXAMPLES)]
    Status {
        /// The StreamJob (none: every StreamJob of the namespace, a line each).
        name: Option<String>,
        /// Output format.
        #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Take a savepoint of the running job without stopping it: creates a StreamJobSnapshot
    /// (its spec is not edited), waits for it and prints its path.
    #[command(after_help = SAVEPOINT_EXAMPLES)]
    Savepoint {
        /// The StreamJob.
        name: String,
        /// Name of the StreamJobSnapshot (default: generated, `<job>-<random>`).
        #[arg(long)]
        snapshot: Option<String>,
        /// Output format of the savepoint taken: its path (table), or the StreamJobSnapshot's
        /// status (json, yaml).
        #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
        output: Output,
        /// Wait for the savepoint (`--wait=false`: only ask for it).
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
        wait: bool,
        #[command(flatten)]
        wait_args: WaitArgs,
    },
    /// Stop the job with a savepoint (spec.suspend: true); its pods go, its state stays.
    Suspend {
        /// The StreamJob.
        name: String,
        /// Wait until the job is Suspended.
        #[arg(long)]
        wait: bool,
        #[command(flatten)]
        wait_args: WaitArgs,
    },
    /// Start a suspended job again from its savepoint (spec.suspend: false).
    Resume {
        /// The StreamJob.
        name: String,
        /// Wait until the job is Ready.
        #[arg(long)]
        wait: bool,
        #[command(flatten)]
        wait_args: WaitArgs,
    },
    /// Rescale the job (spec.replicas): prints what moves, then the operator moves it.
    #[command(after_help = SCALE_EXAMPLES)]
    Scale {
        /// The StreamJob.
        name: String,
        /// The new parallelism.
        #[arg(long)]
        replicas: i32,
        /// Wait until the job is Ready at the new parallelism.
        #[arg(long)]
        wait: bool,
        #[command(flatten)]
        wait_args: WaitArgs,
    },
    /// `keyshift plan` against the live job: its key-group count, the parallelism it runs at and
    /// its state size, to --to (default: spec.replicas).
    Plan {
        /// The StreamJob.
        name: String,
        /// The parallelism to plan for.
        #[arg(long)]
        to: Option<i64>,
        /// Output format.
        #[arg(long, short = 'o', value_enum, default_value_t = PlanOutput::Table)]
        output: PlanOutput,
    },
    /// This client's version and that of each keyshift operator the cluster runs (Deployments
    /// labelled app.kubernetes.io/name=keyshift, as the chart installs them).
    Version {
        /// Output format.
        #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
        output: Output,
    },
}

const STATUS_EXAMPLES: &str = "Examples:
  kubectl keyshift status clicks -n team-a
  # Every job of the namespace, a line each
  kubectl keyshift status -n team-a
  # The same as a document for programs
  kubectl keyshift status clicks -n team-a -o json";

const SAVEPOINT_EXAMPLES: &str = "Examples:
  # Take a savepoint and print its path
  kubectl keyshift savepoint clicks -n team-a
  # Ask for one, named, and return at once (`kubectl get sjsnap` shows it when taken)
  kubectl keyshift savepoint clicks -n team-a --snapshot before-upgrade --wait=false";

const SCALE_EXAMPLES: &str = "Examples:
  # Rescale to 6 workers and wait until the job is Ready at 6
  kubectl keyshift scale clicks -n team-a --replicas 6 --wait";

fn duration(s: &str) -> Result<Duration, String> {
    keyshift_core::duration::parse_duration(s)
        .ok_or_else(|| format!("`{s}` is not a duration: write e.g. 30s, 5m or 1h"))
}

/// What the job commands report (one line, non-zero exit).
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("reading the kubeconfig: {0}")]
    Kubeconfig(#[from] kube::config::KubeconfigError),
    #[error("finding the cluster: {0}")]
    Infer(#[from] kube::config::InferConfigError),
    #[error("connecting to the cluster: {0}")]
    Connect(#[source] kube::Error),
    #[error("streamjob {name} not found in namespace {namespace}")]
    NotFound { namespace: String, name: String },
    #[error("{action} streamjob {name}: {message}")]
    Api {
        action: &'static str,
        name: String,
        message: String,
    },
    #[error("listing {what} in namespace {namespace}: {message}")]
    List {
        what: &'static str,
        namespace: String,
        message: String,
    },
    #[error("{0}")]
    Refused(String),
    #[error(
        "{kind} {name}: {what} not reached within {seconds} s; it says: {message} (see `kubectl describe {kind} {name}`)"
    )]
    Timeout {
        kind: &'static str,
        name: String,
        what: &'static str,
        seconds: u64,
        message: String,
    },
    #[error("writing output: {0}")]
    Output(#[from] std::io::Error),
    #[error(transparent)]
    Render(#[from] crate::output::RenderError),
}

/// The cluster client and the namespace the commands act in.
pub struct Cluster {
    pub client: Client,
    pub namespace: String,
}

impl Cluster {
    /// Connects as kubectl would with the same flags.
    pub async fn connect(args: &ClusterArgs) -> Result<Cluster, ClientError> {
        let options = KubeConfigOptions {
            context: args.context.clone(),
            ..KubeConfigOptions::default()
        };
        let config = match (&args.kubeconfig, &args.context) {
            (Some(path), _) => {
                Config::from_custom_kubeconfig(Kubeconfig::read_from(path)?, &options).await?
            }
            (None, Some(_)) => Config::from_kubeconfig(&options).await?,
            (None, None) => Config::infer().await?,
        };
        let namespace = args
            .namespace
            .clone()
            .unwrap_or_else(|| config.default_namespace.clone());
        let client = Client::try_from(config).map_err(ClientError::Connect)?;
        Ok(Cluster { client, namespace })
    }

    fn jobs(&self) -> Api<StreamJob> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// The job, or a clear "not found".
    pub async fn job(&self, name: &str) -> Result<StreamJob, ClientError> {
        self.jobs()
            .get_opt(name)
            .await
            .map_err(|e| api_error("reading", name, e))?
            .ok_or_else(|| ClientError::NotFound {
                namespace: self.namespace.clone(),
                name: name.to_owned(),
            })
    }

    fn snapshot_api(&self) -> Api<StreamJobSnapshot> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// Every StreamJob of the namespace.
    pub async fn all_jobs(&self) -> Result<Vec<StreamJob>, ClientError> {
        self.list(self.jobs(), "streamjobs").await
    }

    /// Every StreamJobSnapshot of the namespace.
    pub async fn snapshots(&self) -> Result<Vec<StreamJobSnapshot>, ClientError> {
        self.list(self.snapshot_api(), "streamjobsnapshots").await
    }

    /// Every object `api` lists (`what` names them in an error).
    async fn list<K>(&self, api: Api<K>, what: &'static str) -> Result<Vec<K>, ClientError>
    where
        K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        let list = api
            .list(&ListParams::default())
            .await
            .map_err(|e| ClientError::List {
                what,
                namespace: self.namespace.clone(),
                message: api_message(e),
            })?;
        Ok(list.items)
    }

    /// Merge-patches the job's spec; the job as the API server stored it.
    async fn patch_spec(
        &self,
        name: &str,
        spec: serde_json::Value,
    ) -> Result<StreamJob, ClientError> {
        let patch = serde_json::json!({ "spec": spec });
        self.jobs()
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(|e| api_error("patching", name, e))
    }

    /// Merge-patches the job's spec; with `wait`, then waits until the operator has acted on
    /// that spec and `there` holds (`what` names it in a timeout). Whether it waited.
    async fn change(
        &self,
        name: &str,
        spec: serde_json::Value,
        wait: bool,
        (what, wait_args): (&'static str, &WaitArgs),
        there: impl Fn(&StreamJob) -> bool,
    ) -> Result<bool, ClientError> {
        let generation = self.patch_spec(name, spec).await?.metadata.generation;
        if wait {
            self.wait(name, what, wait_args.timeout, |job| {
                Ok((observed(job, generation) && there(job)).then_some(()))
            })
            .await?;
        }
        Ok(wait)
    }

    /// Creates a StreamJobSnapshot of job `job` (named `name`, else `<job>-<random>`); its name.
    async fn create_snapshot(&self, job: &str, name: Option<&str>) -> Result<String, ClientError> {
        let mut snapshot = StreamJobSnapshot::new(
            name.unwrap_or_default(),
            StreamJobSnapshotSpec {
                job_name: job.to_owned(),
                path: None,
                deletion_policy: None,
            },
        );
        if name.is_none() {
            snapshot.metadata.name = None;
            snapshot.metadata.generate_name = Some(format!("{job}-"));
        }
        let created = self
            .snapshot_api()
            .create(&PostParams::default(), &snapshot)
            .await
            .map_err(|e| api_error("creating a StreamJobSnapshot of", job, e))?;
        Ok(created.metadata.name.unwrap_or_default())
    }

    /// Polls the StreamJobSnapshot `name` every second until it is Ready (its status) or Failed
    /// (an error with its message), printing each new message to stderr.
    async fn wait_snapshot(
        &self,
        name: &str,
        timeout: Duration,
    ) -> Result<StreamJobSnapshotStatus, ClientError> {
        let api = self.snapshot_api();
        let fetch = async || {
            let snapshot = api
                .get(name)
                .await
                .map_err(|e| api_error("reading the StreamJobSnapshot", name, e))?;
            let status = snapshot.status.unwrap_or_default();
            let message = status.message.clone().unwrap_or_default();
            match status.phase {
                Some(SnapshotPhase::Ready) => Ok(Polled::Done(status)),
                Some(SnapshotPhase::Failed) => Err(ClientError::Refused(format!(
                    "streamjobsnapshot {name} failed: {message}"
                ))),
                _ => Ok(Polled::Waiting(message)),
            }
        };
        poll(("streamjobsnapshot", name), "the savepoint", timeout, fetch).await
    }

    /// Polls the job every second until `done` says it is there (`Some(result)`), printing each
    /// new status message to stderr, or fails after `timeout` with the job's last message.
    async fn wait<T>(
        &self,
        name: &str,
        what: &'static str,
        timeout: Duration,
        mut done: impl FnMut(&StreamJob) -> Result<Option<T>, ClientError>,
    ) -> Result<T, ClientError> {
        let fetch = async || {
            let job = self.job(name).await?;
            Ok(match done(&job)? {
                Some(result) => Polled::Done(result),
                None => Polled::Waiting(
                    job.status
                        .as_ref()
                        .and_then(|s| s.message.clone())
                        .unwrap_or_default(),
                ),
            })
        };
        poll(("streamjob", name), what, timeout, fetch).await
    }
}

/// One look at what [`poll`] waits for.
enum Polled<T> {
    Done(T),
    /// Not yet; what the object says.
    Waiting(String),
}

/// Calls `fetch` every second until it is [`Polled::Done`] (or fails), printing each new message
/// of `object` (its kind and name) to stderr, or fails after `timeout` with its last message.
async fn poll<T>(
    (kind, name): (&'static str, &str),
    what: &'static str,
    timeout: Duration,
    mut fetch: impl AsyncFnMut() -> Result<Polled<T>, ClientError>,
) -> Result<T, ClientError> {
    let start = Instant::now();
    let mut shown = String::new();
    loop {
        match fetch().await? {
            Polled::Done(result) => return Ok(result),
            Polled::Waiting(message) => {
                if message != shown && !message.is_empty() {
                    eprintln!("{name}: {message}");
                    shown = message;
                }
            }
        }
        if start.elapsed() >= timeout {
            return Err(ClientError::Timeout {
                kind,
                name: name.to_owned(),
                what,
                seconds: timeout.as_secs(),
                message: shown,
            });
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

fn api_error(action: &'static str, name: &str, e: kube::Error) -> ClientError {
    ClientError::Api {
        action,
        name: name.to_owned(),
        message: api_message(e),
    }
}

/// What the API server said (its Status message), or the error.
fn api_message(e: kube::Error) -> String {
    match e {
        kube::Error::Api(status) => status.message,
        e => e.to_string(),
    }
}

/// The numbers `keyshift plan` needs, read from a live job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LivePlan {
    pub from: i64,
    pub to: i64,
    pub max_parallelism: i64,
    pub state_bytes: Option<u64>,
}

/// What `plan` plans for `job`: from the parallelism that runs to `to` (default spec.replicas),
/// over its pinned key-group count. Pure.
pub fn live_plan(job: &StreamJob, to: Option<i64>) -> Result<LivePlan, ClientError> {
    let name = job.metadata.name.as_deref().unwrap_or_default();
    let status = job.status.as_ref();
    let max_parallelism = status
        .and_then(|s| s.max_parallelism)
        .or(job.spec.max_parallelism)
        .ok_or_else(|| {
            ClientError::Refused(format!(
                "streamjob {name} has no key-group count yet (the operator pins it when the job first starts); plan offline with `keyshift plan -p N -g G`"
            ))
        })?;
    Ok(LivePlan {
        from: i64::from(status.and_then(|s| s.replicas).unwrap_or(job.spec.replicas)),
        to: to.unwrap_or(i64::from(job.spec.replicas)),
        max_parallelism: i64::from(max_parallelism),
        state_bytes: status
            .and_then(|s| s.state_distribution.as_ref())
            .map(|d| d.total_bytes.max(0) as u64),
    })
}

/// One line on what a rescale of `job` to `replicas` moves, when its key-group count is known.
/// Pure.
pub fn scale_summary(job: &StreamJob, replicas: i32) -> Option<String> {
    let plan = live_plan(job, Some(i64::from(replicas))).ok()?;
    use keyshift_core::keygroup::{Assignment, rescale_plan};
    let from = Assignment::new(plan.from, plan.max_parallelism).ok()?;
    let to = Assignment::new(plan.to, plan.max_parallelism).ok()?;
    let moves = rescale_plan(from, to).ok()?;
    Some(format!(
        "{} -> {} workers: {} of {} key groups change subtask",
        plan.from, plan.to, moves.moved_groups, plan.max_parallelism
    ))
}

/// A keyshift operator the cluster runs.
#[derive(Serialize, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct OperatorVersion {
    pub namespace: String,
    pub name: String,
    /// Its chart's app.kubernetes.io/version label.
    pub version: Option<String>,
    pub image: Option<String>,
    pub ready_replicas: i32,
}

/// `version`'s document.
#[derive(Serialize, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Versions {
    pub client: ClientVersion,
    pub operators: Vec<OperatorVersion>,
    /// Why no operator is listed, when none is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub operators_note: Option<String>,
}

#[derive(Serialize, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClientVersion {
    pub version: &'static str,
    pub protocol: u32,
}

impl Versions {
    fn text(&self) -> String {
        let mut s = format!(
            "client: keyshift {} (worker protocol {})\n",
            self.client.version, self.client.protocol
        );
        for o in &self.operators {
            s.push_str(&format!(
                "operator {}/{}: {} ({}, {} ready)\n",
                o.namespace,
                o.name,
                o.version.as_deref().unwrap_or("version unknown"),
                o.image.as_deref().unwrap_or("no image"),
                o.ready_replicas
            ));
        }
        if let Some(note) = &self.operators_note {
            s.push_str(&format!("operator: {note}\n"));
        }
        s
    }
}

const OPERATOR_SELECTOR: &str = "app.kubernetes.io/name=keyshift";

/// The operators' Deployments: in every namespace if the user may list them there, else in
/// the namespace of the flags.
async fn operators(cluster: &Cluster) -> (Vec<OperatorVersion>, Option<String>) {
    let lp = ListParams::default().labels(OPERATOR_SELECTOR);
    let all: Api<Deployment> = Api::all(cluster.client.clone());
    let listed = match all.list(&lp).await {
        Ok(list) => Ok(list),
        Err(_) => Api::<Deployment>::namespaced(cluster.client.clone(), &cluster.namespace)
            .list(&lp)
            .await
            .map_err(api_message),
    };
    match listed {
        Ok(list) => {
            let found: Vec<OperatorVersion> = list.items.iter().map(operator_version).collect();
            let note = found
                .is_empty()
                .then(|| format!("no Deployment labelled {OPERATOR_SELECTOR} (the chart's) found"));
            (found, note)
        }
        Err(message) => (
            Vec::new(),
            Some(format!("cannot list Deployments: {message}")),
        ),
    }
}

fn operator_version(d: &Deployment) -> OperatorVersion {
    OperatorVersion {
        namespace: d.metadata.namespace.clone().unwrap_or_default(),
        name: d.metadata.name.clone().unwrap_or_default(),
        version: d
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("app.kubernetes.io/version").cloned()),
        image: d
            .spec
            .template
            .spec
            .as_ref()
            .and_then(|p| p.containers.first())
            .and_then(|c| c.image.clone()),
        ready_replicas: d
            .status
            .as_ref()
            .and_then(|s| s.ready_replicas)
            .unwrap_or(0),
    }
}

/// Whether the operator has acted on the spec of `generation`.
fn observed(job: &StreamJob, generation: Option<i64>) -> bool {
    let seen = job.status.as_ref().and_then(|s| s.observed_generation);
    match (seen, generation) {
        (Some(seen), Some(generation)) => seen >= generation,
        (_, None) => true,
        (None, Some(_)) => false,
    }
}

/// Runs a job command; writes what it prints to `out`. `render_plan` is `keyshift plan`'s
/// rendering (the command line's), given the live job's numbers.
pub async fn run(
    cluster: &ClusterArgs,
    command: JobCommand,
    render_plan: impl FnOnce(LivePlan, PlanOutput) -> Result<String, ClientError>,
    out: &mut impl Write,
) -> Result<(), ClientError> {
    let cluster = Cluster::connect(cluster).await?;
    match command {
        JobCommand::Status {
            name: Some(name),
            output,
        } => {
            let job = cluster.job(&name).await?;
            let now = Timestamp::now();
            let snapshots = match cluster.snapshots().await {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("(the job's StreamJobSnapshots are not shown: {e})");
                    Vec::new()
                }
            };
            let view = view::JobView::new(&job, now).with_snapshots(&snapshots, now);
            out.write_all(render(&view, output, |v| v.text(now))?.as_bytes())?;
        }
        JobCommand::Status { name: None, output } => {
            let jobs = cluster.all_jobs().await?;
            let now = Timestamp::now();
            let views: Vec<view::JobView<'_>> =
                jobs.iter().map(|j| view::JobView::new(j, now)).collect();
            let table = |views: &Vec<view::JobView<'_>>| match views.is_empty() {
                true => format!("no StreamJobs in namespace {}\n", cluster.namespace),
                false => view::jobs_table(views, now),
            };
            out.write_all(render(&views, output, table)?.as_bytes())?;
        }
        JobCommand::Savepoint {
            name,
            snapshot,
            output,
            wait,
            wait_args,
        } => {
            let job = cluster.job(&name).await?;
            let phase = job.status.as_ref().and_then(|s| s.phase);
            if job.spec.suspend || phase == Some(Phase::Suspended) {
                return Err(ClientError::Refused(format!(
                    "streamjob {name} is suspended: it was stopped with a savepoint (status.lastSavepoint); resume it to take another"
                )));
            }
            let created = cluster.create_snapshot(&name, snapshot.as_deref()).await?;
            eprintln!("streamjobsnapshot/{created} created");
            if !wait {
                writeln!(
                    out,
                    "streamjobsnapshot/{created}: savepoint of {name} requested"
                )?;
                return Ok(());
            }
            let taken = cluster.wait_snapshot(&created, wait_args.timeout).await?;
            out.write_all(
                render(&taken, output, |t| {
                    format!("{}\n", t.path.as_deref().unwrap_or_default())
                })?
                .as_bytes(),
            )?;
        }
        JobCommand::Suspend {
            name,
            wait,
            wait_args,
        } => {
            let suspended = |job: &StreamJob| {
                job.status.as_ref().and_then(|s| s.phase) == Some(Phase::Suspended)
            };
            let spec = serde_json::json!({ "suspend": true });
            let line = match cluster
                .change(
                    &name,
                    spec,
                    wait,
                    ("phase Suspended", &wait_args),
                    suspended,
                )
                .await?
            {
                true => format!("streamjob {name} suspended"),
                false => format!("streamjob {name}: suspend requested"),
            };
            writeln!(out, "{line}")?;
        }
        JobCommand::Resume {
            name,
            wait,
            wait_args,
        } => {
            let spec = serde_json::json!({ "suspend": false });
            let line = match cluster
                .change(&name, spec, wait, ("Ready", &wait_args), reports_ready)
                .await?
            {
                true => format!("streamjob {name} resumed and Ready"),
                false => format!("streamjob {name}: resume requested"),
            };
            writeln!(out, "{line}")?;
        }
        JobCommand::Scale {
            name,
            replicas,
            wait,
            wait_args,
        } => {
            let job = cluster.job(&name).await?;
            if let Some(summary) = scale_summary(&job, replicas) {
                writeln!(out, "streamjob {name}: {summary}")?;
            }
            let at_replicas = |job: &StreamJob| {
                reports_ready(job) && job.status.as_ref().and_then(|s| s.replicas) == Some(replicas)
            };
            let spec = serde_json::json!({ "replicas": replicas });
            let what = ("Ready at the new parallelism", &wait_args);
            let line = match cluster.change(&name, spec, wait, what, at_replicas).await? {
                true => format!("streamjob {name} Ready at {replicas} workers"),
                false => {
                    format!("streamjob {name}: scaled to {replicas} (the operator rescales it)")
                }
            };
            writeln!(out, "{line}")?;
        }
        JobCommand::Plan { name, to, output } => {
            let plan = live_plan(&cluster.job(&name).await?, to)?;
            out.write_all(render_plan(plan, output)?.as_bytes())?;
        }
        JobCommand::Version { output } => {
            let (operators, operators_note) = operators(&cluster).await;
            let versions = Versions {
                client: ClientVersion {
                    version: env!("CARGO_PKG_VERSION"),
                    protocol: crate::runtime::protocol::PROTOCOL_VERSION,
                },
                operators,
                operators_note,
            };
            out.write_all(render(&versions, output, Versions::text)?.as_bytes())?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(extra_spec: &str, status: &str) -> StreamJob {
        serde_yaml::from_str(&format!(
            r#"
apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {{name: clicks, namespace: team-a, generation: 3}}
spec:
  replicas: 6
  {extra_spec}
  job:
    source: {{generator: {{partitions: 4, keys: 10}}}}
    key: {{field: key}}
    aggregation: {{function: count}}
    sink: {{type: log}}
status: {status}
"#
        ))
        .unwrap()
    }

    #[tokio::test]
    async fn a_poll_ends_when_done_or_names_the_object_and_its_last_words_at_the_timeout() {
        let mut looks = 0;
        let done = poll(
            ("streamjob", "clicks"),
            "Ready",
            Duration::from_secs(30),
            async || {
                looks += 1;
                Ok(if looks < 2 {
                    Polled::Waiting("starting".into())
                } else {
                    Polled::Done(looks)
                })
            },
        )
        .await;
        assert!(matches!(done, Ok(2)), "{done:?}");
        let late = poll(
            ("streamjobsnapshot", "before-upgrade"),
            "the savepoint",
            Duration::ZERO,
            async || {
                Ok(Polled::<()>::Waiting(
                    "waiting for the StreamJob clicks".into(),
                ))
            },
        )
        .await
        .map_err(|e| e.to_string());
        assert_eq!(
            late,
            Err("streamjobsnapshot before-upgrade: the savepoint not reached within 0 s; it says: waiting for the StreamJob clicks (see `kubectl describe streamjobsnapshot before-upgrade`)".to_owned())
        );
    }

    #[test]
    fn a_live_plan_runs_from_the_running_parallelism_over_the_pinned_groups() {
        let j = job(
            "",
            "{replicas: 4, maxParallelism: 128, stateDistribution: {snapshotId: 1, parallelism: 4, totalBytes: 4096, totalKeys: 10, busiestSubtask: 0, busiestSubtaskBytes: 1, busiestSubtaskKeys: 1, meanSubtaskBytes: 1, meanSubtaskKeys: 1, bytesSkew: '1.0', largestKeyGroup: 0, largestKeyGroupBytes: 1, largestKeyGroupKeys: 1, summary: s}}",
        );
        assert_eq!(
            live_plan(&j, None).unwrap(),
            LivePlan {
                from: 4,
                to: 6,
                max_parallelism: 128,
                state_bytes: Some(4096)
            }
        );
        assert_eq!(live_plan(&j, Some(8)).unwrap().to, 8);
        let summary = scale_summary(&j, 8).unwrap();
        assert!(summary.starts_with("4 -> 8 workers: "), "{summary}");
        assert!(
            summary.ends_with(" of 128 key groups change subtask"),
            "{summary}"
        );
    }

    #[test]
    fn a_job_not_started_has_no_plan_unless_its_spec_pins_the_groups() {
        let e = live_plan(&job("", "{}"), None).unwrap_err().to_string();
        assert!(e.contains("no key-group count yet"), "{e}");
        assert!(e.contains("keyshift plan -p N -g G"), "{e}");
        let pinned = live_plan(&job("maxParallelism: 60", "{}"), Some(5)).unwrap();
        assert_eq!((pinned.from, pinned.to, pinned.max_parallelism), (6, 5, 60));
        assert_eq!(scale_summary(&job("", "{}"), 3), None);
    }

    #[test]
    fn the_operator_has_acted_on_a_generation_once_status_says_so() {
        assert!(!observed(&job("", "{}"), Some(3)));
        assert!(!observed(&job("", "{observedGeneration: 2}"), Some(3)));
        assert!(observed(&job("", "{observedGeneration: 3}"), Some(3)));
        assert!(observed(&job("", "{}"), None));
    }

    #[test]
    fn an_operator_deployment_gives_its_chart_version_image_and_readiness() {
        let d: Deployment = serde_yaml::from_str(
            r#"
metadata: {name: keyshift, namespace: keyshift, labels: {app.kubernetes.io/version: "0.1.0"}}
spec:
  selector: {matchLabels: {a: b}}
  template: {spec: {containers: [{name: operator, image: "keyshift:0.1.0"}]}}
status: {readyReplicas: 2}
"#,
        )
        .unwrap();
        let v = operator_version(&d);
        assert_eq!(v.version.as_deref(), Some("0.1.0"));
        assert_eq!(v.image.as_deref(), Some("keyshift:0.1.0"));
        assert_eq!(v.ready_replicas, 2);
        let versions = Versions {
            client: ClientVersion {
                version: "9.9.9",
                protocol: 4,
            },
            operators: vec![v],
            operators_note: None,
        };
        assert_eq!(
            versions.text(),
            "client: keyshift 9.9.9 (worker protocol 4)\noperator keyshift/keyshift: 0.1.0 (keyshift:0.1.0, 2 ready)\n"
        );
    }
}
