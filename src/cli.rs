//! The `keyshift` command line. Rendering is kept in pure functions so tests can check the
//! machine-readable contract without spawning the binary.

use crate::output::{Output, PlanOutput, yaml};
use crate::telemetry::{self, LogFormat};
use clap::{CommandFactory, Parser, Subcommand};
use keyshift_core::keygroup::{
    self, Assignment, BoundsError, Key, KeyType, RescalePlan, Skew, key_group_for_key,
};
use serde::Serialize;
use serde_json::json;
use std::fmt::Write as _;
use std::io::{BufRead, Write};
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "keyshift",
    version,
    about = "Run stateful keyed stream jobs on Kubernetes and rescale them by moving key groups",
    long_about = "keyshift runs stateful keyed stream jobs and rescales them by moving key groups \
                  through an object store instead of replaying history. Key-group math is \
                  bit-for-bit Apache Flink's."
)]
pub struct Cli {
    /// Log line format (logs go to stderr).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = keyshift_core::worker_pod::ENV_LOG_FORMAT)]
    pub log_format: LogFormat,

    #[command(subcommand)]
    pub command: Command,
}

/// The command line run as `kubectl-keyshift` (kubectl's plugin): the `job` commands at the top,
/// so `kubectl keyshift status X` is `keyshift job status X`.
#[derive(Parser, Debug)]
#[command(
    name = "kubectl keyshift",
    bin_name = "kubectl keyshift",
    version,
    about = "Act on keyshift StreamJobs in the cluster: status, savepoint, suspend, resume, scale, plan, version",
    after_help = JOB_EXAMPLES
)]
pub struct PluginCli {
    /// Log line format (logs go to stderr).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = keyshift_core::worker_pod::ENV_LOG_FORMAT)]
    pub log_format: LogFormat,

    #[command(flatten)]
    pub job: crate::client::JobArgs,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Show the key-group assignment and skew for a parallelism, and what a rescale moves.
    #[command(after_help = PLAN_EXAMPLES)]
    Plan(PlanArgs),
    /// Show which key group (and subtask) keys land in.
    #[command(after_help = KEYGROUP_EXAMPLES)]
    Keygroup(KeygroupArgs),
    /// Print the CustomResourceDefinitions (StreamJob, StreamJobSnapshot) as YAML.
    #[command(after_help = CRD_EXAMPLES)]
    Crd(CrdArgs),
    /// Offline tools for checkpoints and savepoints: list, inspect, verify, dump, rewrite,
    /// dispose.
    #[command(
        long_about = crate::savepoint::SAVEPOINT_LONG_ABOUT,
        after_help = crate::savepoint::SAVEPOINT_EXAMPLES
    )]
    Savepoint(crate::savepoint::SavepointArgs),
    /// Run a StreamJob manifest on this machine, no cluster: workers as local processes, state
    /// in a local directory. Edit `replicas` in the file to rescale; Ctrl-C stops with a
    /// savepoint and running again resumes from it.
    #[command(after_help = LOCAL_EXAMPLES)]
    Local(LocalArgs),
    /// Run one subtask of a job (started and driven by the operator or `keyshift local` through
    /// its control API).
    Worker(WorkerArgs),
    /// Measure the runtime against raw baselines taken in the same run: snapshot I/O, rescale
    /// pause, throughput (see docs/benchmarks.md; build with --release --features bench).
    #[cfg(feature = "bench")]
    Bench(crate::bench::BenchArgs),
    /// Run the Kubernetes operator: reconcile StreamJobs into worker pods, checkpoint them and
    /// rescale them through savepoints.
    #[command(after_help = OPERATOR_EXAMPLES)]
    Operator(OperatorArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell) to stdout.
    #[command(after_help = COMPLETION_EXAMPLES)]
    Completion(CompletionArgs),
    /// Check that HTTP endpoints answer with a 2xx status (retrying until --timeout), e.g.
    /// every ready pod behind a Service: the chart's `helm test` runs it against the operator.
    #[command(after_help = PROBE_EXAMPLES)]
    Probe(ProbeArgs),
    /// Act on a StreamJob in the cluster: status, savepoint, suspend, resume, scale, plan,
    /// version. kubectl runs the same commands as `kubectl keyshift ...` when this binary is on
    /// the PATH as `kubectl-keyshift`.
    #[command(after_help = JOB_EXAMPLES)]
    Job(crate::client::JobArgs),
}

const JOB_EXAMPLES: &str = "Examples:
  # The job on one screen
  keyshift job status clicks -n team-a
  # As a kubectl plugin: the same binary under the plugin's name, on the PATH
  ln -s \"$(command -v keyshift)\" ~/.local/bin/kubectl-keyshift
  kubectl keyshift savepoint clicks -n team-a
  kubectl keyshift scale clicks -n team-a --replicas 6 --wait
  # Completion of `kubectl keyshift ...` (kubectl 1.26 or later) runs this name
  ln -s \"$(command -v keyshift)\" ~/.local/bin/kubectl_complete-keyshift";

/// `keyshift probe`.
#[derive(clap::Args, Debug)]
pub struct ProbeArgs {
    /// URLs to GET (http://HOST:PORT/PATH); with --service, paths (/readyz) to GET on each of
    /// its ready endpoints.
    #[arg(required = true)]
    pub targets: Vec<String>,
    /// Resolve the paths against this Service's ready endpoints (its EndpointSlices, read with
    /// the pod's ServiceAccount), pod to pod: no Service proxy or DNS needed.
    #[arg(long)]
    pub service: Option<String>,
    /// Namespace of --service (default: the pod's own, or the kubeconfig's).
    #[arg(long, env = "POD_NAMESPACE")]
    pub namespace: Option<String>,
    /// Port of --service, by name or endpoint port number.
    #[arg(long, default_value = "metrics")]
    pub port: String,
    /// Seconds to keep retrying until every target answers.
    #[arg(long, default_value_t = 60)]
    pub timeout: u64,
}

const PROBE_EXAMPLES: &str = "Examples:
  # The operator answers on every ready pod of its metrics Service (what `helm test` runs)
  keyshift probe --service keyshift-metrics --port metrics /readyz /metrics
  # Plain URLs
  keyshift probe http://127.0.0.1:8080/healthz --timeout 10";

/// `keyshift completion SHELL`.
#[derive(clap::Args, Debug)]
pub struct CompletionArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

const PLAN_EXAMPLES: &str = "Examples:
  # Key groups per subtask at parallelism 6 of 128 key groups, and the skew
  keyshift plan -p 6 -g 128
  # Which key groups move when a job at parallelism 4 is rescaled to 6
  keyshift plan -p 6 --from-parallelism 4 -g 128
  # The same as a document for programs (-o json or -o yaml)
  keyshift plan -p 6 --from-parallelism 4 -g 128 -o yaml";

const KEYGROUP_EXAMPLES: &str = "Examples:
  # The key group and owning subtask of two keys
  keyshift keygroup -g 128 -p 4 user-17 user-42
  # Keys from stdin, one JSON object per line
  printf 'user-17\\nuser-42\\n' | keyshift keygroup -g 128 -p 4 -o json
  # Keys hashed as Java longs
  keyshift keygroup -g 128 --key-type long 42 -7";

const CRD_EXAMPLES: &str = "Examples:
  # Install or update the CRDs
  keyshift crd | kubectl apply --server-side -f -
  # Only the StreamJobSnapshot CRD
  keyshift crd streamjobsnapshot";

#[derive(clap::Args, Debug)]
pub struct CrdArgs {
    /// Only this CRD (default: both, as one YAML stream).
    #[arg(value_enum)]
    pub kind: Option<CrdKind>,
}

/// One of keyshift's CustomResourceDefinitions.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrdKind {
    /// `streamjobs.keyshift.dev` (crds/streamjob.yaml).
    Streamjob,
    /// `streamjobsnapshots.keyshift.dev` (crds/streamjobsnapshot.yaml).
    Streamjobsnapshot,
}

const LOCAL_EXAMPLES: &str = "Examples:
  # Run the sample job; edit `replicas` in the file to rescale, Ctrl-C to stop with a savepoint
  keyshift local config/samples/generator-count.yaml
  # State somewhere else, a progress line every 10 s
  keyshift local job.yaml --state-dir /var/tmp/keyshift-state --progress-every 10
  # Then look at what it left
  keyshift savepoint list file://$PWD/keyshift-state/default/clicks";

const OPERATOR_EXAMPLES: &str = "Examples:
  # In the cluster (the Helm chart passes these): watch two namespaces, default storage on S3
  keyshift operator --namespaces team-a,team-b --default-storage s3://bucket/keyshift
  # From a workstation against the current kubeconfig, without leader election
  keyshift operator --leader-elect=false --metrics-addr 127.0.0.1:8080";

const COMPLETION_EXAMPLES: &str = "Examples:
  # bash, this shell only
  source <(keyshift completion bash)
  # zsh, for good (a directory on $fpath)
  keyshift completion zsh > \"${fpath[1]}/_keyshift\"
  # fish, for good
  keyshift completion fish > ~/.config/fish/completions/keyshift.fish";

#[derive(clap::Args, Debug)]
pub struct OperatorArgs {
    /// Namespaces to watch, comma-separated (default: all).
    #[arg(long, value_delimiter = ',', env = "KEYSHIFT_NAMESPACES")]
    pub namespaces: Vec<String>,
    /// Snapshot storage URL for jobs that set no spec.state.storage.
    #[arg(long, env = "KEYSHIFT_DEFAULT_STORAGE")]
    pub default_storage: Option<String>,
    /// Address of `/metrics`, `/healthz` and `/readyz`.
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub metrics_addr: std::net::SocketAddr,
    /// Worker image for jobs that set no spec.image.
    #[arg(long, env = "KEYSHIFT_IMAGE", default_value = "keyshift:dev")]
    pub worker_image: String,
    /// Reconcile only while holding the leader-election Lease (`--leader-elect=false` to run
    /// without).
    #[arg(
        long,
        default_value_t = true,
        action = clap::ArgAction::Set,
        num_args = 0..=1,
        default_missing_value = "true"
    )]
    pub leader_elect: bool,
    /// Name of the leader-election Lease.
    #[arg(long, default_value = "keyshift-operator")]
    pub lease_name: String,
    /// Namespace of the leader-election Lease.
    #[arg(long, env = "POD_NAMESPACE")]
    pub lease_namespace: Option<String>,
    /// Reconcile passes that may run at once (per watched namespace; 0: unbounded). A burst of
    /// changes then waits in the queue instead of piling up at the API server. A pass only
    /// reads and writes Kubernetes objects: checkpoints, savepoints, their verification and
    /// the workers' restore run in the background and hold no slot.
    #[arg(long, env = "KEYSHIFT_MAX_CONCURRENT_RECONCILES", default_value_t = 32)]
    pub max_concurrent_reconciles: u16,
    /// Create a NetworkPolicy per job: only the job's workers reach its data port, only the
    /// operator's pods (and --network-policy-metrics-from) its control port.
    /// `--network-policy=false` for clusters whose CNI does not enforce policies, or whose
    /// policies you manage yourself.
    #[arg(
        long,
        env = "KEYSHIFT_NETWORK_POLICY",
        default_value_t = true,
        action = clap::ArgAction::Set,
        num_args = 0..=1,
        default_missing_value = "true"
    )]
    pub network_policy: bool,
    /// Labels of the operator's own pods, `key=value` comma-separated: the NetworkPolicy admits
    /// pods with all of them to the workers' control port.
    #[arg(
        long,
        env = "KEYSHIFT_OPERATOR_POD_LABELS",
        value_delimiter = ',',
        value_parser = label_pair,
        default_value = crate::operator::desired::DEFAULT_OPERATOR_POD_LABELS
    )]
    pub operator_pod_labels: Vec<(String, String)>,
    /// Namespace of the operator's own pods (the chart passes it through the downward API);
    /// unset: the NetworkPolicy admits operator pods of the job's own namespace.
    #[arg(long, env = "POD_NAMESPACE")]
    pub operator_namespace: Option<String>,
    /// More peers admitted to the workers' control port, which also serves their `/metrics`: a
    /// JSON list of NetworkPolicy peers, e.g.
    /// `[{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"monitoring"}}}]`.
    #[arg(
        long,
        env = "KEYSHIFT_NETWORK_POLICY_METRICS_FROM",
        value_parser = network_policy_peers
    )]
    pub network_policy_metrics_from: Option<Peers>,
    /// Image prefixes a StreamJob's spec.image must start with, comma-separated (e.g.
    /// `registry.example.com/streaming/`; end each with `/`, `:` or `@`). Empty: any image. A
    /// job outside the list is refused (Stalled, reason ImageNotAllowed) before any pod exists.
    #[arg(long, env = "KEYSHIFT_ALLOWED_IMAGE_PREFIXES", value_delimiter = ',')]
    pub allowed_image_prefixes: Vec<String>,
    /// ServiceAccounts a StreamJob's spec.podTemplate.serviceAccountName may name,
    /// comma-separated (the namespace's `default` is always allowed). Empty: any. A job outside
    /// the list is refused (Stalled, reason ServiceAccountNotAllowed) before any pod exists.
    #[arg(long, env = "KEYSHIFT_ALLOWED_SERVICE_ACCOUNTS", value_delimiter = ',')]
    pub allowed_service_accounts: Vec<String>,
}

/// Non-empty, trimmed items of a comma-separated list.
fn list_items(items: Vec<String>) -> Vec<String> {
    items
        .into_iter()
        .map(|i| i.trim().to_owned())
        .filter(|i| !i.is_empty())
        .collect()
}

/// NetworkPolicy peers given on the command line.
#[derive(Debug, Clone, PartialEq)]
pub struct Peers(pub Vec<k8s_openapi::api::networking::v1::NetworkPolicyPeer>);

/// `key=value` (a label).
fn label_pair(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_owned(), v.trim().to_owned())),
        _ => Err(format!("`{s}` is not a label: write key=value")),
    }
}

/// A JSON list of NetworkPolicy peers (empty text: none).
fn network_policy_peers(s: &str) -> Result<Peers, String> {
    if s.trim().is_empty() {
        return Ok(Peers(Vec::new()));
    }
    serde_json::from_str(s)
        .map(Peers)
        .map_err(|e| format!("not a JSON list of NetworkPolicy peers: {e}"))
}

#[derive(clap::Args, Debug)]
pub struct LocalArgs {
    /// The StreamJob manifest (YAML).
    pub manifest: std::path::PathBuf,
    /// Where snapshots and worker logs go (used when the manifest sets no spec.state.storage).
    #[arg(long, default_value = "keyshift-state")]
    pub state_dir: std::path::PathBuf,
    /// Seconds between progress lines.
    #[arg(long, default_value_t = 2)]
    pub progress_every: u64,
    /// The binary the workers run (as `BINARY worker ...`): a job's own worker binary, built on
    /// keyshift's runtime, that carries the program the manifest names (default: this
    /// keyshift, which carries the example programs).
    #[arg(long)]
    pub worker_bin: Option<std::path::PathBuf>,
}

#[derive(clap::Args, Debug)]
pub struct WorkerArgs {
    /// Address of the control API.
    #[arg(long, default_value = "0.0.0.0:9090")]
    pub control_addr: std::net::SocketAddr,
    /// Address of the data plane (records between subtasks).
    #[arg(long, default_value = "0.0.0.0:9091")]
    pub data_addr: std::net::SocketAddr,
    /// Bearer token the control API requires.
    #[arg(long, env = "KEYSHIFT_TOKEN", hide_env_values = true)]
    pub token: String,
}

#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// Parallelism (number of subtasks) to plan for.
    #[arg(long, short = 'p', allow_negative_numbers = true)]
    pub parallelism: i64,
    /// Key-group count (max parallelism). Default: Flink's rule applied to the parallelism the
    /// job started at (--from-parallelism if given, else --parallelism).
    #[arg(long, short = 'g', allow_negative_numbers = true)]
    pub max_parallelism: Option<i64>,
    /// Current parallelism: also show which key groups move in a rescale from it.
    #[arg(long, allow_negative_numbers = true)]
    pub from_parallelism: Option<i64>,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value_t = PlanOutput::Table)]
    pub output: PlanOutput,
    /// The job's state size in MiB, if known: the table warns when the key-group count would
    /// make tiny groups of it.
    #[arg(long)]
    pub state_mib: Option<u64>,
}

#[derive(clap::Args, Debug)]
pub struct KeygroupArgs {
    /// Key-group count (max parallelism).
    #[arg(long, short = 'g', allow_negative_numbers = true)]
    pub max_parallelism: i64,
    /// Parallelism: also show the subtask owning each key.
    #[arg(long, short = 'p', allow_negative_numbers = true)]
    pub parallelism: Option<i64>,
    /// How keys are hashed (Java String, Long or Integer hashCode).
    #[arg(long, value_enum, default_value_t = KeyType::String)]
    pub key_type: KeyType,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
    pub output: Output,
    /// Keys. Without any, keys are read from stdin, one per line (an empty line is the empty
    /// string key).
    pub keys: Vec<String>,
}

/// Errors the CLI reports (one line, non-zero exit).
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("{0}")]
    Bounds(#[from] BoundsError),
    #[error(
        "{bounds} (the ceiling was derived by Flink's default rule from parallelism {base}; pass --max-parallelism if the job's ceiling differs)"
    )]
    DefaultCeiling { bounds: BoundsError, base: i64 },
    #[error("{0}")]
    Plan(#[from] keygroup::PlanError),
    #[error("line {line}: {source}")]
    KeyOnLine {
        line: usize,
        source: keygroup::KeyParseError,
    },
    #[error("{0}")]
    Key(#[from] keygroup::KeyParseError),
    #[error("reading keys from stdin: {0}")]
    Stdin(std::io::Error),
    #[error("writing output: {0}")]
    Stdout(std::io::Error),
    #[error("rendering YAML: {0}")]
    Yaml(#[from] serde_yaml::Error),
    #[error("{0}")]
    Local(#[from] Box<crate::local::LocalError>),
    #[error("{0}")]
    Worker(#[from] Box<crate::runtime::worker::WorkerError>),
    #[error("{0}")]
    Operator(#[from] Box<crate::operator::OperatorError>),
    #[error("{0}")]
    Leader(#[from] crate::leader::LeaderError),
    #[error("starting the async runtime: {0}")]
    Runtime(std::io::Error),
    #[error(transparent)]
    Savepoint(#[from] crate::offline::ToolError),
    #[error("probe: {0}")]
    Probe(#[from] crate::probe::ProbeError),
    #[error("{0}")]
    Job(#[from] crate::client::ClientError),
    #[cfg(feature = "bench")]
    #[error("bench: {0:#}")]
    Bench(anyhow::Error),
}

/// Entry point of the binary.
pub fn main() -> ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let program = args
        .first()
        .map(std::path::Path::new)
        .and_then(std::path::Path::file_name)
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .to_owned();
    if program == crate::client::PLUGIN_COMPLETION_NAME {
        return complete_plugin(args.get(1..).unwrap_or_default());
    }
    let cli = if program == crate::client::PLUGIN_NAME {
        let plugin = PluginCli::parse_from(args);
        Cli {
            log_format: plugin.log_format,
            command: Command::Job(plugin.job),
        }
    } else {
        Cli::parse_from(args)
    };
    telemetry::init(cli.log_format);
    telemetry::install_crypto_provider();
    match run(cli.command, cli.log_format) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command, log_format: LogFormat) -> Result<(), CliError> {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    match command {
        Command::Plan(args) => {
            let text = plan(&args)?;
            out.write_all(text.as_bytes()).map_err(CliError::Stdout)
        }
        Command::Keygroup(args) => keygroup_cmd(&args, &mut out),
        Command::Crd(args) => {
            let yaml = match args.kind {
                Some(CrdKind::Streamjob) => crate::validation::crd_yaml()?,
                Some(CrdKind::Streamjobsnapshot) => crate::validation::snapshot_crd_yaml()?,
                None => format!(
                    "{}---\n{}",
                    crate::validation::crd_yaml()?,
                    crate::validation::snapshot_crd_yaml()?
                ),
            };
            out.write_all(yaml.as_bytes()).map_err(CliError::Stdout)
        }
        Command::Local(args) => {
            drop(out);
            let bin = match args.worker_bin {
                Some(bin) => bin,
                None => std::env::current_exe().map_err(CliError::Runtime)?,
            };
            let opts = crate::local::LocalOptions {
                manifest: args.manifest,
                state_dir: args.state_dir,
                bin,
                progress_every: std::time::Duration::from_secs(args.progress_every.max(1)),
            };
            tokio_runtime()?
                .block_on(crate::local::run_cli(opts))
                .map_err(Box::new)?;
            Ok(())
        }
        Command::Worker(args) => {
            drop(out);
            let programs = programs().map_err(|e| {
                CliError::Worker(Box::new(crate::runtime::worker::WorkerError::Fatal(
                    e.to_string(),
                )))
            })?;
            let config = crate::runtime::worker::WorkerConfig::new(
                args.control_addr,
                args.data_addr,
                args.token,
                programs,
            )
            .map_err(|e| CliError::Worker(Box::new(e)))?;
            tokio_runtime()?
                .block_on(crate::runtime::worker::run(config))
                .map_err(Box::new)?;
            Ok(())
        }
        Command::Operator(args) => {
            drop(out);
            let config = crate::operator::OperatorConfig {
                namespaces: args
                    .namespaces
                    .into_iter()
                    .filter(|n| !n.is_empty())
                    .collect(),
                default_storage: args.default_storage,
                metrics_addr: args.metrics_addr,
                worker_image: args.worker_image,
                worker_log_format: log_format,
                max_concurrent_reconciles: args.max_concurrent_reconciles,
                pod_policy: crate::validation::PodPolicy {
                    allowed_image_prefixes: list_items(args.allowed_image_prefixes),
                    allowed_service_accounts: list_items(args.allowed_service_accounts),
                },
                network_policy: args.network_policy.then(|| {
                    crate::operator::desired::NetworkPolicyConfig {
                        operator_namespace: args.operator_namespace.filter(|n| !n.is_empty()),
                        operator_pod_labels: args.operator_pod_labels.into_iter().collect(),
                        metrics_from: args
                            .network_policy_metrics_from
                            .map(|p| p.0)
                            .unwrap_or_default(),
                    }
                }),
                leader: match (args.leader_elect, args.lease_namespace) {
                    (false, _) => None,
                    (true, Some(ns)) => Some(crate::leader::LeaderConfig::new(
                        ns,
                        args.lease_name,
                        crate::leader::LeaderConfig::default_identity(),
                    )),
                    (true, None) => {
                        return Err(CliError::Leader(crate::leader::LeaderError::Config(
                            "leader election needs --lease-namespace (or POD_NAMESPACE); pass --leader-elect=false to run without".into(),
                        )));
                    }
                },
            };
            tokio_runtime()?
                .block_on(crate::operator::run(config))
                .map_err(Box::new)?;
            Ok(())
        }
        Command::Savepoint(args) => Ok(crate::savepoint::run(args, &mut out)?),
        Command::Completion(args) => {
            let mut buf = Vec::new();
            completion(args.shell, &mut buf);
            out.write_all(&buf).map_err(CliError::Stdout)
        }
        Command::Probe(args) => {
            let config = crate::probe::ProbeConfig {
                targets: args.targets,
                service: args.service.map(|name| crate::probe::ServiceTarget {
                    name,
                    namespace: args.namespace.filter(|n| !n.is_empty()),
                    port: args.port,
                }),
                timeout: std::time::Duration::from_secs(args.timeout),
                request_timeout: std::time::Duration::from_secs(5),
            };
            let answered = tokio_runtime()?.block_on(crate::probe::probe(&config))?;
            let mut text = answered.join("\n");
            text.push('\n');
            out.write_all(text.as_bytes()).map_err(CliError::Stdout)
        }
        Command::Job(args) => {
            let render_plan = |live: crate::client::LivePlan, output| {
                plan(&PlanArgs {
                    parallelism: live.to,
                    max_parallelism: Some(live.max_parallelism),
                    from_parallelism: Some(live.from),
                    output,
                    state_mib: live.state_bytes.map(|b| b >> 20),
                })
                .map_err(|e| crate::client::ClientError::Refused(e.to_string()))
            };
            tokio_runtime()?.block_on(crate::client::run(
                &args.cluster,
                args.command,
                render_plan,
                &mut out,
            ))?;
            Ok(())
        }
        #[cfg(feature = "bench")]
        Command::Bench(args) => {
            drop(out);
            crate::bench::run(args).map_err(CliError::Bench)
        }
    }
}

/// Answers kubectl's completion request for `kubectl keyshift ...` (cobra's protocol: one
/// candidate per line, then `:<directive>`).
fn complete_plugin(words: &[std::ffi::OsString]) -> ExitCode {
    let words: Vec<String> = words
        .iter()
        .map(|w| w.to_string_lossy().into_owned())
        .collect();
    let mut command = Cli::command();
    let Some(job) = command.find_subcommand_mut("job") else {
        return ExitCode::FAILURE;
    };
    let job = job.clone();
    let answer = match crate::client::complete::need(&job, &words) {
        crate::client::complete::Need::Candidates(c) => c,
        crate::client::complete::Need::Jobs { cluster, prefix } => {
            let names = tokio_runtime()
                .ok()
                .and_then(|rt| {
                    rt.block_on(crate::client::complete::job_names(&cluster))
                        .ok()
                })
                .unwrap_or_default();
            crate::client::complete::starting_with(names, &prefix)
        }
    };
    print!("{}", crate::client::complete::cobra_answer(&answer));
    ExitCode::SUCCESS
}

fn tokio_runtime() -> Result<tokio::runtime::Runtime, CliError> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(CliError::Runtime)
}

/// Writes the completion script of `keyshift` for `shell`.
pub fn completion(shell: clap_complete::Shell, out: &mut Vec<u8>) {
    clap_complete::generate(shell, &mut Cli::command(), "keyshift", out);
}

/// The key-group count for a plan and whether it was derived by default.
fn resolve_ceiling(args: &PlanArgs) -> Result<(i64, bool), CliError> {
    match args.max_parallelism {
        Some(g) => Ok((g, false)),
        None => {
            let base = args.from_parallelism.unwrap_or(args.parallelism);
            if base < 1 {
                return Err(BoundsError::ParallelismTooSmall(base).into());
            }
            let base = u32::try_from(base).unwrap_or(u32::MAX);
            Ok((i64::from(keygroup::default_max_parallelism(base)), true))
        }
    }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct SubtaskRow {
    index: u32,
    key_groups: [u32; 2],
    count: u32,
}

/// Renders `keyshift plan` (table, JSON or SVG) or explains which bound is violated.
pub fn plan(args: &PlanArgs) -> Result<String, CliError> {
    let (g, defaulted) = resolve_ceiling(args)?;
    let default_base = args.from_parallelism.unwrap_or(args.parallelism);
    let to = Assignment::new(args.parallelism, g).map_err(|e| match e {
        BoundsError::ParallelismAboveCeiling { .. } if defaulted => CliError::DefaultCeiling {
            bounds: e,
            base: default_base,
        },
        e => e.into(),
    })?;
    let from = args
        .from_parallelism
        .map(|q| Assignment::new(q, g))
        .transpose()?;
    let rescale = from.map(|f| keygroup::rescale_plan(f, to)).transpose()?;
    let skew = to.skew();
    match args.output {
        PlanOutput::Json => {
            Ok(plan_json(&to, defaulted, &skew, rescale.as_ref()).to_string() + "\n")
        }
        PlanOutput::Yaml => Ok(yaml(&plan_json(&to, defaulted, &skew, rescale.as_ref()))?),
        PlanOutput::Table => {
            let mut table = plan_table(&to, defaulted, default_base, &skew, rescale.as_ref());
            if let Some(note) = args.state_mib.and_then(|m| {
                keygroup::tiny_groups(to.max_parallelism(), m.saturating_mul(1 << 20))
            }) {
                table.push_str(&format!("\nnote: {note}\n"));
            }
            Ok(table)
        }
        PlanOutput::Svg => Ok(crate::plan_svg::plan_svg(
            &to,
            from.as_ref().zip(rescale.as_ref()),
        )),
    }
}

fn plan_json(
    to: &Assignment,
    defaulted: bool,
    skew: &Skew,
    rescale: Option<&RescalePlan>,
) -> serde_json::Value {
    let subtasks: Vec<SubtaskRow> = to
        .ranges()
        .iter()
        .enumerate()
        .map(|(i, r)| SubtaskRow {
            index: i as u32,
            key_groups: [r.start, r.end],
            count: r.len(),
        })
        .collect();
    let mut v = json!({
        "maxParallelism": to.max_parallelism(),
        "maxParallelismDefaulted": defaulted,
        "parallelism": to.parallelism(),
        "subtasks": subtasks,
        "divides": skew.divides,
        "skew": skew.ratio,
        "minGroups": skew.min_groups,
        "maxGroups": skew.max_groups,
        "busiestSubtasks": skew.busiest_subtasks,
        "lightestSubtasks": skew.lightest_subtasks,
        "nearestDivisors": [skew.divisor_below, skew.divisor_above],
        "summary": skew.summary(),
    });
    if let Some(plan) = rescale {
        let moves: Vec<_> = plan
            .subtasks
            .iter()
            .map(|s| {
                json!({
                    "index": s.index,
                    "keyGroups": [s.key_groups.start, s.key_groups.end],
                    "pairedWith": s.paired_with,
                    "movedGroups": s.moved_groups,
                    "reads": s.reads.iter().map(|r| json!({
                        "from": r.from,
                        "keyGroups": [r.key_groups.start, r.key_groups.end],
                        "count": r.count,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        v["rescale"] = json!({
            "fromParallelism": plan.from_parallelism,
            "toParallelism": plan.to_parallelism,
            "movedGroups": plan.moved_groups,
            "movedFraction": plan.moved_fraction,
            "subtasks": moves,
        });
    }
    v
}

fn plan_table(
    to: &Assignment,
    defaulted: bool,
    default_base: i64,
    skew: &Skew,
    rescale: Option<&RescalePlan>,
) -> String {
    let mut s = String::new();
    let g = to.max_parallelism();
    if defaulted {
        let _ = writeln!(
            s,
            "max parallelism: {g} (defaulted by Flink's rule for parallelism {default_base}: \
             min(max(nextPowerOfTwo(p + p/2), 128), 32768); pass --max-parallelism to choose)"
        );
    } else {
        let _ = writeln!(s, "max parallelism: {g}");
    }
    let _ = writeln!(s, "parallelism:     {}", to.parallelism());
    let _ = writeln!(s);
    match rescale {
        None => {
            let _ = writeln!(s, "{:>7}  {:>11}  {:>5}", "SUBTASK", "KEY GROUPS", "COUNT");
            for (i, r) in to.ranges().iter().enumerate() {
                let _ = writeln!(s, "{i:>7}  {:>11}  {:>5}", r.to_string(), r.len());
            }
        }
        Some(plan) => {
            let _ = writeln!(
                s,
                "{:>7}  {:>11}  {:>5}  {:>6}  {:>5}  READS FROM (old subtask: groups)",
                "SUBTASK", "KEY GROUPS", "COUNT", "PAIRED", "MOVED"
            );
            for st in &plan.subtasks {
                let reads: Vec<String> = st
                    .reads
                    .iter()
                    .map(|r| format!("{}: {}", r.from, r.key_groups))
                    .collect();
                let paired = st
                    .paired_with
                    .map_or_else(|| "-".to_owned(), |p| p.to_string());
                let _ = writeln!(
                    s,
                    "{:>7}  {:>11}  {:>5}  {:>6}  {:>5}  {}",
                    st.index,
                    st.key_groups.to_string(),
                    st.key_groups.len(),
                    paired,
                    st.moved_groups,
                    reads.join(", ")
                );
            }
            let _ = writeln!(s);
            let _ = writeln!(
                s,
                "rescale {} -> {}: {} of {} key groups ({:.1}%) change owner when each new subtask \
                 replaces the old subtask it overlaps most",
                plan.from_parallelism,
                plan.to_parallelism,
                plan.moved_groups,
                g,
                plan.moved_fraction * 100.0
            );
        }
    }
    let _ = writeln!(s);
    let _ = writeln!(s, "skew: {}", skew.summary());
    s
}

/// Runs `keyshift keygroup`, writing one line per key as soon as it is computed.
fn keygroup_cmd(args: &KeygroupArgs, out: &mut impl Write) -> Result<(), CliError> {
    // Validate the pair up front so a bad bound is reported before reading any key.
    let assignment = match args.parallelism {
        Some(p) => Some(Assignment::new(p, args.max_parallelism)?),
        None => {
            Assignment::new(1, args.max_parallelism)?;
            None
        }
    };
    let g = args.max_parallelism as u32;
    let mut emit = |key: Key| -> Result<(), CliError> {
        let line = keygroup_line(&key, g, assignment.as_ref(), args.output)?;
        out.write_all(line.as_bytes()).map_err(CliError::Stdout)
    };
    if args.keys.is_empty() {
        let stdin = std::io::stdin();
        for (n, line) in stdin.lock().lines().enumerate() {
            let line = line.map_err(CliError::Stdin)?;
            let text = line.strip_suffix('\r').unwrap_or(&line);
            let key = Key::parse(text, args.key_type).map_err(|source| CliError::KeyOnLine {
                line: n + 1,
                source,
            })?;
            emit(key)?;
        }
    } else {
        for text in &args.keys {
            emit(Key::parse(text, args.key_type)?)?;
        }
    }
    Ok(())
}

/// One output of `keyshift keygroup` for one key: a line (with its newline) for a table or
/// JSON, a document starting with `---` for YAML.
pub fn keygroup_line(
    key: &Key,
    max_parallelism: u32,
    assignment: Option<&Assignment>,
    output: Output,
) -> Result<String, CliError> {
    let group = key_group_for_key(key, max_parallelism);
    let subtask = assignment.map(|a| a.owner(group));
    let document = || {
        let mut v = json!({ "key": key, "keyGroup": group });
        if let Some(s) = subtask {
            v["subtask"] = json!(s);
        }
        v
    };
    Ok(match output {
        Output::Json => document().to_string() + "\n",
        Output::Yaml => format!("---\n{}", yaml(&document())?),
        Output::Table => match subtask {
            Some(s) => format!("{key}\t{group}\t{s}\n"),
            None => format!("{key}\t{group}\n"),
        },
    })
}

/// The programs keyshift's own worker carries: the example jobs of `keyshift-examples` (and,
/// with the `bench` feature, the benchmarks' programs).
pub fn programs() -> Result<crate::job::Programs, crate::job::program::ProgramsError> {
    #[cfg_attr(not(feature = "bench"), expect(unused_mut))]
    let mut carried = keyshift_examples::programs();
    #[cfg(feature = "bench")]
    carried.extend(crate::bench::programs());
    carried
        .into_iter()
        .try_fold(crate::job::Programs::new(), |programs, (name, job)| {
            programs.with(name, job)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(p: i64, g: Option<i64>, from: Option<i64>, output: PlanOutput) -> PlanArgs {
        PlanArgs {
            parallelism: p,
            max_parallelism: g,
            from_parallelism: from,
            output,
            state_mib: None,
        }
    }

    #[test]
    fn plan_warns_of_tiny_groups_when_the_state_size_is_given() {
        let mut a = args(200, Some(1024), None, PlanOutput::Table);
        assert!(!plan(&a).unwrap().contains("tiny groups"));
        a.state_mib = Some(16);
        let t = plan(&a).unwrap();
        assert!(
            t.contains("note: 1024 key groups over 16777216 bytes of state make tiny groups"),
            "{t}"
        );
        a.state_mib = Some(1024);
        assert!(!plan(&a).unwrap().contains("tiny groups"));
    }

    #[test]
    fn plan_json_contract() {
        let text = plan(&args(100, Some(128), None, PlanOutput::Json)).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["maxParallelism"], 128);
        assert_eq!(v["maxParallelismDefaulted"], false);
        assert_eq!(v["parallelism"], 100);
        assert_eq!(v["divides"], false);
        assert_eq!(v["skew"], 2.0);
        assert_eq!(v["nearestDivisors"], json!([64, 128]));
        let subtasks = v["subtasks"].as_array().unwrap();
        assert_eq!(subtasks.len(), 100);
        assert_eq!(subtasks[0]["index"], 0);
        let total: u64 = subtasks.iter().map(|s| s["count"].as_u64().unwrap()).sum();
        assert_eq!(total, 128);
        assert_eq!(subtasks[99]["keyGroups"][1], 127);
        assert!(v.get("rescale").is_none());
    }

    #[test]
    fn plan_defaults_from_the_starting_parallelism() {
        let v: serde_json::Value =
            serde_json::from_str(&plan(&args(8, None, Some(4), PlanOutput::Json)).unwrap())
                .unwrap();
        assert_eq!(v["maxParallelism"], 128);
        assert_eq!(v["maxParallelismDefaulted"], true);
        assert_eq!(v["rescale"]["movedGroups"], 64);
        assert_eq!(v["rescale"]["subtasks"].as_array().unwrap().len(), 8);
        let table = plan(&args(8, None, Some(4), PlanOutput::Table)).unwrap();
        assert!(
            table.contains("defaulted by Flink's rule for parallelism 4"),
            "{table}"
        );
        assert!(table.contains("64 of 128 key groups (50.0%)"), "{table}");
    }

    #[test]
    fn plan_table_explains_skew() {
        let table = plan(&args(100, Some(128), None, PlanOutput::Table)).unwrap();
        assert!(table.contains(
            "28 subtasks own 2 groups and 72 own 1: the busiest carries 2.00x the lightest; \
             divisors of 128 near 100: 64, 128"
        ));
        assert!(table.contains("0-1"));
    }

    #[test]
    fn plan_skew_agrees_in_number() {
        let table = plan(&args(3, Some(4), None, PlanOutput::Table)).unwrap();
        assert!(
            table.contains("skew: 1 subtask owns 2 groups and 2 own 1:"),
            "{table}"
        );
        let table = plan(&args(3, Some(5), None, PlanOutput::Table)).unwrap();
        assert!(
            table.contains("skew: 2 subtasks own 2 groups and 1 owns 1:"),
            "{table}"
        );
    }

    #[test]
    fn yaml_is_the_json_document() {
        for output in [PlanOutput::Json, PlanOutput::Yaml] {
            let text = plan(&args(6, Some(128), Some(4), output)).unwrap();
            let v: serde_json::Value = match output {
                PlanOutput::Json => serde_json::from_str(&text).unwrap(),
                _ => serde_yaml::from_str(&text).unwrap(),
            };
            assert_eq!(v["rescale"]["fromParallelism"], 4, "{output:?}: {text}");
        }
        let json: serde_json::Value =
            serde_json::from_str(&plan(&args(6, Some(128), Some(4), PlanOutput::Json)).unwrap())
                .unwrap();
        let yaml: serde_json::Value =
            serde_yaml::from_str(&plan(&args(6, Some(128), Some(4), PlanOutput::Yaml)).unwrap())
                .unwrap();
        assert_eq!(json, yaml);
    }

    #[test]
    fn completion_scripts_name_the_subcommands() {
        for shell in [
            clap_complete::Shell::Bash,
            clap_complete::Shell::Zsh,
            clap_complete::Shell::Fish,
        ] {
            let mut buf = Vec::new();
            completion(shell, &mut buf);
            let script = String::from_utf8(buf).unwrap();
            for sub in [
                "plan",
                "keygroup",
                "local",
                "savepoint",
                "operator",
                "completion",
            ] {
                assert!(script.contains(sub), "{shell}: no {sub}");
            }
            assert!(script.contains("rewrite"), "{shell}: no nested subcommands");
        }
    }

    #[test]
    fn plan_refuses_bounds_with_the_fix() {
        let e = plan(&args(0, Some(128), None, PlanOutput::Table)).unwrap_err();
        assert!(e.to_string().contains("at least 1"), "{e}");
        let e = plan(&args(200, Some(128), None, PlanOutput::Table)).unwrap_err();
        assert!(
            e.to_string().contains("exceeds the key-group ceiling"),
            "{e}"
        );
        let e = plan(&args(4, Some(40000), None, PlanOutput::Table)).unwrap_err();
        assert!(e.to_string().contains("upper bound 32768"), "{e}");
        // A job started at 24 has the default ceiling 128, so 200 is refused.
        let e = plan(&args(200, None, Some(24), PlanOutput::Table)).unwrap_err();
        assert!(
            e.to_string().contains("ceiling (max parallelism) 128"),
            "{e}"
        );
        // ... naming the managed change and the suggested count.
        assert!(
            e.to_string()
                .contains("set spec.maxParallelism to the new count together with replicas"),
            "{e}"
        );
        assert!(e.to_string().contains("e.g. 1024"), "{e}");
    }

    #[test]
    fn keygroup_json_line() {
        let a = Assignment::new(4, 128).unwrap();
        let key = Key::String("hello".into());
        let line = keygroup_line(&key, 128, Some(&a), Output::Json).unwrap();
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        let group = key_group_for_key(&key, 128);
        assert_eq!(v["key"], "hello");
        assert_eq!(v["keyGroup"], group);
        assert_eq!(v["subtask"], a.owner(group));
        let v: serde_json::Value =
            serde_json::from_str(&keygroup_line(&Key::Long(-5), 128, None, Output::Json).unwrap())
                .unwrap();
        assert_eq!(v["key"], -5);
        assert!(v.get("subtask").is_none());
    }

    fn parse(args: &[&str]) -> OperatorArgs {
        match Cli::try_parse_from(args) {
            Ok(Cli {
                command: Command::Operator(a),
                ..
            }) => a,
            other => panic!("{args:?}: {other:?}"),
        }
    }

    #[test]
    fn operator_leader_election_flags() {
        let a = parse(&["keyshift", "operator"]);
        assert!(a.leader_elect);
        assert_eq!(a.lease_name, "keyshift-operator");
        assert!(parse(&["keyshift", "operator", "--leader-elect"]).leader_elect);
        assert!(!parse(&["keyshift", "operator", "--leader-elect=false"]).leader_elect);
        let a = parse(&[
            "keyshift",
            "operator",
            "--lease-name=l",
            "--lease-namespace=ns",
            "--namespaces=a,b",
        ]);
        assert_eq!(
            (a.lease_name.as_str(), a.lease_namespace.as_deref()),
            ("l", Some("ns"))
        );
        assert_eq!(a.namespaces, ["a", "b"]);
    }

    #[test]
    fn operator_network_policy_flags() {
        let a = parse(&["keyshift", "operator"]);
        assert!(a.network_policy);
        assert_eq!(
            a.operator_pod_labels,
            [
                ("app.kubernetes.io/name".to_owned(), "keyshift".to_owned()),
                (
                    "app.kubernetes.io/component".to_owned(),
                    "operator".to_owned()
                )
            ]
        );
        assert_eq!(a.network_policy_metrics_from, None);
        assert!(!parse(&["keyshift", "operator", "--network-policy=false"]).network_policy);
        let a = parse(&[
            "keyshift",
            "operator",
            "--operator-pod-labels=app.kubernetes.io/instance=ks,app.kubernetes.io/name=keyshift",
            "--operator-namespace=keyshift-system",
            r#"--network-policy-metrics-from=[{"namespaceSelector":{"matchLabels":{"team":"obs"}}}]"#,
        ]);
        assert_eq!(
            a.operator_pod_labels[0],
            ("app.kubernetes.io/instance".to_owned(), "ks".to_owned())
        );
        assert_eq!(a.operator_pod_labels.len(), 2);
        assert_eq!(a.operator_namespace.as_deref(), Some("keyshift-system"));
        let peers = a.network_policy_metrics_from.unwrap().0;
        assert_eq!(
            peers[0]
                .namespace_selector
                .as_ref()
                .unwrap()
                .match_labels
                .as_ref()
                .unwrap()["team"],
            "obs"
        );
        let a = parse(&[
            "keyshift",
            "operator",
            "--allowed-image-prefixes=registry.example.com/streaming/, ghcr.io/keyshift/,",
            "--allowed-service-accounts=stream-workers",
        ]);
        assert_eq!(
            list_items(a.allowed_image_prefixes),
            ["registry.example.com/streaming/", "ghcr.io/keyshift/"]
        );
        assert_eq!(list_items(a.allowed_service_accounts), ["stream-workers"]);
        let a = parse(&["keyshift", "operator", "--allowed-image-prefixes="]);
        assert!(list_items(a.allowed_image_prefixes).is_empty());
        for bad in [
            "--operator-pod-labels=app",
            "--operator-pod-labels==x",
            "--network-policy-metrics-from={\"podSelector\":{}}",
        ] {
            let err = Cli::try_parse_from(["keyshift", "operator", bad]).unwrap_err();
            assert_eq!(
                err.kind(),
                clap::error::ErrorKind::ValueValidation,
                "{bad}: {err}"
            );
        }
    }
}
