//! The operator under test for the e2e tiers: `keyshift operator` as a host process against the
//! test cluster (`hack/testenv.sh`), and the kubectl-driven waits the tests share (Ready, a
//! rescale, a suspend), with what a failed wait prints.
#![allow(dead_code)]

use crate::support::*;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where a test keeps its storage and operator log: inside the test control plane's directory,
/// which `hack/testenv.sh down` removes, so nothing outlives the suite.
pub fn scratch_dir() -> std::path::PathBuf {
    std::env::var_os("KEYSHIFT_TESTENV_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
}

/// The operator process; killed when dropped.
pub struct Operator {
    pub child: Child,
    pub log: std::path::PathBuf,
    /// Its default storage: a prefix of its own on the S3 test server.
    pub storage: String,
}

impl Operator {
    pub fn start(ns: &str, storage_dir: &std::path::Path) -> Operator {
        Operator::start_env(ns, storage_dir, None)
    }

    /// Starts the operator; `pause_at` sets the test-only hook that makes it exit (code 3) when
    /// it finds that rescale step recorded in status, before acting on it.
    pub fn start_env(ns: &str, storage_dir: &std::path::Path, pause_at: Option<&str>) -> Operator {
        Operator::start_envs(
            ns,
            storage_dir,
            pause_at
                .map(|s| ("KEYSHIFT_TEST_PAUSE_AFTER_STEP", s))
                .as_slice(),
        )
    }

    /// Starts the operator with extra environment variables (settings, or test-only hooks). Its
    /// log goes next to `storage_dir`, whose name also names its storage prefix on S3; the
    /// namespace gets the S3 credentials Secret the test jobs name.
    pub fn start_envs(ns: &str, storage_dir: &std::path::Path, envs: &[(&str, &str)]) -> Operator {
        assert!(
            !envs.iter().any(|(k, _)| k.starts_with("KEYSHIFT_TEST_"))
                || cfg!(feature = "test-hooks"),
            "the operator's test hooks need `cargo test --features test-hooks` (hack/test.sh uses --all-features)"
        );
        let tag = storage_dir
            .file_name()
            .and_then(|n| n.to_str())
            .expect("a named storage dir");
        let storage = s3_storage(tag);
        if !kubectl(&["get", "secret", S3_SECRET, "-n", ns]).ok {
            s3_secret(ns);
        }
        let log = storage_dir.with_extension("operator.log");
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("operator log");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_keyshift"));
        cmd.envs(envs.iter().copied());
        let child = cmd
            .args([
                "operator",
                "--namespaces",
                ns,
                "--default-storage",
                &storage,
                "--worker-image",
                &image(),
                "--metrics-addr",
                "127.0.0.1:0",
                // A host process for one test namespace: no Lease (a restarted operator would
                // otherwise wait for its predecessor's Lease to expire).
                "--leader-elect=false",
            ])
            .env("KUBECONFIG", kubeconfig())
            .env("RUST_LOG", "info,keyshift=debug")
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log fd"))
            .stderr(out)
            .spawn()
            .expect("keyshift operator starts");
        Operator {
            child,
            log,
            storage,
        }
    }

    /// Waits until the process exits on its own; its exit code.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let start = Instant::now();
        loop {
            match self.child.try_wait().expect("operator process") {
                Some(status) => return status.code(),
                None if start.elapsed() > timeout => panic!(
                    "the operator did not exit within {timeout:?}; log: {}",
                    self.log.display()
                ),
                None => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn wait_ready(ns: &str, name: &str, log: &std::path::Path) {
    wait_ready_within(ns, name, log, 120);
}

pub fn wait_ready_within(ns: &str, name: &str, log: &std::path::Path, seconds: u32) {
    let r = kubectl(&[
        "wait",
        "-n",
        ns,
        "--for=condition=Ready",
        &format!("sj/{name}"),
        &format!("--timeout={seconds}s"),
    ]);
    if !r.ok {
        panic!(
            "sj/{name} not Ready: {}{}\n{}",
            r.stdout,
            r.stderr,
            diagnostics(ns, name, log)
        );
    }
}

/// The job's status, its pods, the operator's last log lines and the test kubelet's lines
/// about the namespace: what a failed wait prints.
pub fn diagnostics(ns: &str, name: &str, log: &std::path::Path) -> String {
    let status = kubectl(&["get", "-n", ns, &format!("sj/{name}"), "-o", "yaml"]).stdout;
    let pods = kubectl(&["get", "pods", "-n", ns, "-o", "wide"]).stdout;
    let tail: String = std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .rev()
        .take(40)
        .collect::<Vec<_>>()
        .join("\n");
    // The kubelet's lines about this namespace's pods (testenv keeps its log).
    let kubelet: String = std::env::var_os("KEYSHIFT_TESTENV_DIR")
        .map(|d| std::path::PathBuf::from(d).join("logs/kubelet.log"))
        .and_then(|p| std::fs::read_to_string(p).ok())
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(ns))
        .rev()
        .take(30)
        .collect::<Vec<_>>()
        .join("\n");
    format!(
        "{status}\n{pods}\noperator log (newest first):\n{tail}\nkubelet log for {ns} (newest first):\n{kubelet}"
    )
}

/// `kubectl delete sj/NAME`, which must finish (finalizer done) within a minute.
pub fn delete_job(ns: &str, name: &str, log: &std::path::Path) {
    let r = kubectl(&["delete", "-n", ns, &format!("sj/{name}"), "--timeout=60s"]);
    if !r.ok {
        panic!(
            "sj/{name} not deleted: {}{}\n{}",
            r.stdout,
            r.stderr,
            diagnostics(ns, name, log)
        );
    }
}

/// The id of the job's last checkpoint in status (0 before the first).
pub fn checkpoint_id(ns: &str, name: &str) -> i64 {
    get(ns, name, "{.status.lastCheckpoint.id}")
        .parse()
        .unwrap_or(0)
}

pub fn get(ns: &str, name: &str, path: &str) -> String {
    jsonpath(ns, &format!("sj/{name}"), path)
}

pub fn worker_pods(ns: &str, name: &str) -> Vec<String> {
    each(
        ns,
        &["pods", "-l", &format!("keyshift.dev/job={name}")],
        "{.metadata.name}",
    )
}

pub fn scale(ns: &str, name: &str, to: i32, log: &std::path::Path) {
    let t = Instant::now();
    kubectl_ok(&[
        "scale",
        "-n",
        ns,
        &format!("sj/{name}"),
        &format!("--replicas={to}"),
    ]);
    wait_ready(ns, name, log);
    assert_eq!(
        get(ns, name, "{.status.replicas}"),
        to.to_string(),
        "kubectl wait returned before the rescale finished"
    );
    assert_eq!(get(ns, name, "{.status.rescale.step}"), "Done");
    assert_eq!(worker_pods(ns, name).len(), to as usize);
    eprintln!(
        "rescaled to {to} in {:?}: {}",
        t.elapsed(),
        get(ns, name, "{.status.rescale}")
    );
}

/// Kills the container of job `name`'s second worker (SIGKILL through containerd), then waits
/// until the job has restarted from its last checkpoint at the same parallelism: every worker
/// pod replaced, Ready again.
pub fn kill_a_worker(ns: &str, name: &str, log: &std::path::Path) {
    let before = worker_pods(ns, name);
    kill_container(ns, &before[1]);
    wait_for(Duration::from_secs(90), || {
        let now = worker_pods(ns, name);
        now.len() == before.len() && now.iter().all(|p| !before.contains(p))
    });
    wait_ready(ns, name, log);
}

pub fn set_suspend(ns: &str, name: &str, suspend: bool, log: &std::path::Path) {
    set_suspend_within(ns, name, suspend, log, 120);
}

/// [`set_suspend`], waiting up to `seconds` for Ready (a job of hundreds of pods on the test's
/// one small node: the kubelet takes minutes to tear them all down).
pub fn set_suspend_within(
    ns: &str,
    name: &str,
    suspend: bool,
    log: &std::path::Path,
    seconds: u32,
) {
    kubectl_ok(&[
        "patch",
        "-n",
        ns,
        &format!("sj/{name}"),
        "--type=merge",
        "-p",
        &format!("{{\"spec\":{{\"suspend\":{suspend}}}}}"),
    ]);
    wait_ready_within(ns, name, log, seconds);
    let phase = get(ns, name, "{.status.phase}");
    assert_eq!(phase, if suspend { "Suspended" } else { "Running" });
    if suspend {
        wait_for(Duration::from_secs(30), || worker_pods(ns, name).is_empty());
    }
}

/// A test's namespace, storage directory and operator (the CRD installed first).
pub fn setup(namespace: &str, tag: &str) -> (Namespace, std::path::PathBuf, Operator) {
    ensure_crd();
    let ns = Namespace::new(namespace);
    let dir = scratch_dir().join(format!("keyshift-e2e-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("storage dir");
    let op = Operator::start(&ns.0, &dir);
    (ns, dir, op)
}

/// A keyed count over a generator (`generator` is its flow mapping's fields), checkpointing
/// every 2 s; `spec_extra` goes right after `replicas`.
pub fn count_job_yaml(name: &str, replicas: i32, spec_extra: &str, generator: &str) -> String {
    format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata:
  name: {name}
spec:
  replicas: {replicas}{spec_extra}
  job:
    source:
      generator: {{{generator}}}
    key: {{field: key, type: string}}
    aggregation: {{function: count}}
  state:
    checkpointInterval: 2s
    credentialsSecret: {S3_SECRET}
  # The test node has 2 CPUs for up to 200 workers at once: requests far below the default.
  resources:
    requests: {{cpu: 5m, memory: 32Mi}}
"
    )
}
