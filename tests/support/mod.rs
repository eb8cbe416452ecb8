//! Helpers for the integration tests: the test control plane (`hack/testenv.sh`), driven with
//! `kubectl` as a user would.
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The repository root: `cargo test` sets `CARGO_MANIFEST_DIR` when it runs a test, so a test
/// binary that cargo reused from another checkout's build cache still reads this checkout's files.
pub fn root() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// Every end-to-end test shares one control plane, and hack/test.sh runs the e2e test binaries
/// side by side: a test that takes the API server away holds the plane exclusively, so no other
/// test, in this binary or another, sees its outage. The lock is a pair of `flock`s in the test
/// control plane's directory: `plane.gate`, which a waiting exclusive holder keeps so that new
/// shared holders queue behind it (as a writer-preferring RwLock would), and `plane.lock`.
pub struct Plane {
    _gate: Option<std::fs::File>,
    _plane: std::fs::File,
}

fn plane_file(name: &str) -> std::fs::File {
    let dir = std::env::var_os("KEYSHIFT_TESTENV_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let path = dir.join(name);
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("plane lock {}: {e}", path.display()))
}

fn locked(file: std::fs::File, exclusive: bool, what: &str) -> std::fs::File {
    let got = if exclusive {
        file.lock()
    } else {
        file.lock_shared()
    };
    got.unwrap_or_else(|e| panic!("flock on {what}: {e}"));
    file
}

/// The control plane, shared with the other tests that leave the API server up.
pub fn shared_plane() -> Plane {
    let gate = locked(plane_file("plane.gate"), true, "plane.gate");
    let plane = locked(plane_file("plane.lock"), false, "plane.lock");
    drop(gate);
    Plane {
        _gate: None,
        _plane: plane,
    }
}

/// The control plane alone, for a test that takes the API server away.
pub fn exclusive_plane() -> Plane {
    let gate = locked(plane_file("plane.gate"), true, "plane.gate");
    let plane = locked(plane_file("plane.lock"), true, "plane.lock");
    Plane {
        _gate: Some(gate),
        _plane: plane,
    }
}

/// The kubeconfig of the running test control plane; panics with the fix when there is none.
pub fn kubeconfig() -> PathBuf {
    match std::env::var_os("KUBECONFIG") {
        Some(p) if Path::new(&p).exists() => PathBuf::from(p),
        _ => panic!(
            "no test control plane: run `hack/test.sh`, or `eval \"$(hack/testenv.sh up)\"` before `cargo test -- --ignored`"
        ),
    }
}

/// The result of one kubectl call.
pub struct Kubectl {
    pub ok: bool,
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

fn finish(out: Output) -> Kubectl {
    Kubectl {
        ok: out.status.success(),
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Runs `kubectl ARGS`, optionally feeding `stdin`.
pub fn kubectl_in(args: &[&str], stdin: Option<&str>) -> Kubectl {
    let mut cmd = Command::new("kubectl");
    // A discovery cache of this control plane only, so a stale one from an earlier run (same
    // address) cannot hide the CRD.
    if let Some(dir) = std::env::var_os("KEYSHIFT_TESTENV_DIR") {
        cmd.env("KUBECACHEDIR", Path::new(&dir).join("kubectl-cache"));
    }
    let mut child = cmd
        .args(args)
        .env("KUBECONFIG", kubeconfig())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kubectl is installed");
    let mut input = child.stdin.take().expect("stdin is piped");
    if let Some(text) = stdin {
        input
            .write_all(text.as_bytes())
            .expect("writing kubectl stdin");
    }
    drop(input);
    finish(child.wait_with_output().expect("kubectl runs"))
}

pub fn kubectl(args: &[&str]) -> Kubectl {
    kubectl_in(args, None)
}

/// Runs kubectl and panics with its output unless it succeeds.
pub fn kubectl_ok(args: &[&str]) -> String {
    let r = kubectl(args);
    assert!(r.ok, "kubectl {args:?} failed: {}{}", r.stdout, r.stderr);
    r.stdout
}

/// Applies YAML from a string.
pub fn apply(ns: &str, yaml: &str) -> Kubectl {
    kubectl_in(&["apply", "-n", ns, "-f", "-"], Some(yaml))
}

/// A namespace for one test, deleted (in the background) when dropped.
pub struct Namespace(pub String);

impl Namespace {
    pub fn new(name: &str) -> Namespace {
        // A StreamJob left by an earlier run whose operator is gone would hold the namespace in
        // Terminating forever through its finalizer.
        let left = kubectl(&["get", "streamjobs", "-n", name, "-o", "name"]);
        for job in left.stdout.lines().filter(|l| !l.is_empty()) {
            let _ = kubectl(&[
                "patch",
                "-n",
                name,
                job,
                "--type=merge",
                "-p",
                r#"{"metadata":{"finalizers":null}}"#,
            ]);
        }
        let _ = kubectl(&[
            "delete",
            "namespace",
            name,
            "--wait=true",
            "--ignore-not-found",
        ]);
        kubectl_ok(&["create", "namespace", name]);
        // Every test namespace enforces Pod Security `restricted`, as locked-down clusters do:
        // the API server refuses a pod that does not meet it.
        kubectl_ok(&[
            "label",
            "namespace",
            name,
            "pod-security.kubernetes.io/enforce=restricted",
            "pod-security.kubernetes.io/enforce-version=latest",
        ]);
        // The ServiceAccount controller creates `default`; pods need it.
        wait_for(Duration::from_secs(60), || {
            kubectl(&["get", "serviceaccount", "default", "-n", name]).ok
        });
        Namespace(name.to_owned())
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = kubectl(&["delete", "namespace", &self.0, "--wait=false"]);
    }
}

/// Polls `f` until it is true or panics after `timeout`.
pub fn wait_for(timeout: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < timeout,
            "condition not met within {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// `kubectl get` of one JSONPath.
pub fn jsonpath(ns: &str, what: &str, path: &str) -> String {
    kubectl(&["get", "-n", ns, what, "-o", &format!("jsonpath={path}")]).stdout
}

/// `field` (a JSONPath such as `{.metadata.name}`) of each object `kubectl get -n ns LIST...`
/// lists (`LIST`: a kind and selectors, e.g. `["pods", "-l", "app=x"]`), one line each.
pub fn each(ns: &str, list: &[&str], field: &str) -> Vec<String> {
    let jsonpath = format!("jsonpath={{range .items[*]}}{field}{{\"\\n\"}}{{end}}");
    let mut args = vec!["get", "-n", ns];
    args.extend_from_slice(list);
    args.extend_from_slice(&["-o", &jsonpath]);
    kubectl_ok(&args).lines().map(str::to_owned).collect()
}

/// Installs the CRD from `crds/` (once per test process) and waits until it is Established.
pub fn ensure_crd() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let crds = root().join("crds");
        kubectl_ok(&[
            "apply",
            "--server-side",
            "--force-conflicts",
            "-f",
            crds.to_str().unwrap_or("crds"),
        ]);
    });
    // `kubectl wait` fails outright while the CRD has no conditions yet, so poll.
    wait_for(Duration::from_secs(60), || {
        kubectl(&[
            "get",
            "crd/streamjobs.keyshift.dev",
            "-o",
            "jsonpath={.status.conditions[?(@.type==\"Established\")].status}",
        ])
        .stdout
            == "True"
    });
}

/// The helm binary: `KEYSHIFT_HELM` (set by `hack/test.sh`), else the one `hack/get-helm.sh`
/// caches. Panics with the fix when there is none.
pub fn helm_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("KEYSHIFT_HELM").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let cache = std::env::var_os("KEYSHIFT_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/keyshift")))
        .expect("HOME or KEYSHIFT_CACHE is set");
    let p = cache.join("bin/helm-v4.1.4/helm");
    assert!(
        p.exists(),
        "no helm: run hack/get-helm.sh or set KEYSHIFT_HELM"
    );
    p
}

/// Runs `helm ARGS` against the test control plane, from the repository root, with helm's
/// own cache, config and data kept in the test environment's directory.
pub fn helm(args: &[&str]) -> Kubectl {
    let mut cmd = Command::new(helm_bin());
    if let Some(dir) = std::env::var_os("KEYSHIFT_TESTENV_DIR") {
        let dir = Path::new(&dir);
        cmd.env("HELM_CACHE_HOME", dir.join("helm/cache"))
            .env("HELM_CONFIG_HOME", dir.join("helm/config"))
            .env("HELM_DATA_HOME", dir.join("helm/data"))
            .env("KUBECACHEDIR", dir.join("kubectl-cache"));
    }
    let out = cmd
        .current_dir(root())
        .args(args)
        .env("KUBECONFIG", kubeconfig())
        .output()
        .expect("helm runs");
    finish(out)
}

/// What the API server answers when it could not finish a request in time (a loaded test
/// machine): nothing was done, and the same request may be sent again.
const API_SERVER_TIMEOUTS: [&str; 3] = [
    "Timeout: request did not complete within requested timeout",
    "the server was unable to return a response in the time allotted",
    "etcdserver: request timed out",
];

/// `kubectl ARGS` with this build's binary on the PATH as the plugin (`kubectl-keyshift`) and as
/// its completion (`kubectl_complete-keyshift`), as a user installs it.
pub fn kubectl_plugin(args: &[&str]) -> Kubectl {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let dir = std::env::var_os("KEYSHIFT_TESTENV_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir)
            .join(format!("keyshift-plugin-bin-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("plugin dir");
        for name in ["kubectl-keyshift", "kubectl_complete-keyshift"] {
            let link = dir.join(name);
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_keyshift"), &link).expect("link");
        }
        dir
    });
    let path = format!(
        "{}:{}",
        dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new("kubectl")
        .args(args)
        .env("PATH", path)
        .env("KUBECONFIG", kubeconfig())
        .output()
        .expect("kubectl runs");
    finish(out)
}

pub fn plugin_ok(args: &[&str]) -> String {
    let r = kubectl_plugin(args);
    assert!(r.ok, "kubectl {args:?} failed: {}{}", r.stdout, r.stderr);
    r.stdout
}

/// Runs helm and panics with its output unless it succeeds. A command the API server timed out
/// is sent again (up to three times in all), as a user would: the timeout says nothing of the
/// chart, and helm installs CRDs before it records a release, so an install that timed out
/// there left no release behind.
pub fn helm_ok(args: &[&str]) -> String {
    let mut attempts = Vec::new();
    loop {
        let r = helm(args);
        if r.ok {
            return r.stdout;
        }
        let timed_out = API_SERVER_TIMEOUTS.iter().any(|t| r.stderr.contains(t));
        attempts.push(format!("{}{}", r.stdout, r.stderr));
        assert!(
            timed_out && attempts.len() < 3,
            "helm {args:?} failed: {}",
            attempts.join("\n-- then --\n")
        );
        std::thread::sleep(Duration::from_secs(5));
    }
}

/// `keyshift savepoint rewrite SP --max-parallelism G --to TARGET`, which must succeed.
pub fn rewrite_savepoint(sp: &str, groups: u32, target: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_keyshift"))
        .args([
            "savepoint",
            "rewrite",
            sp,
            "--max-parallelism",
            &groups.to_string(),
            "--to",
            target,
        ])
        .output()
        .expect("rewrite runs");
    assert!(
        out.status.success(),
        "rewrite failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The keyshift image the test node runs (`hack/testenv.sh up` builds and imports it).
pub fn image() -> String {
    std::env::var("KEYSHIFT_IMAGE")
        .ok()
        .filter(|i| !i.is_empty())
        .expect("KEYSHIFT_IMAGE (hack/testenv.sh up prints it)")
}

/// The job template's image (crates/keyshift-job-template, its worker binary `threshold`), as
/// `hack/build-image.sh` built it and `hack/testenv.sh up` imported it into the node: a user's
/// own job image.
pub fn job_image() -> String {
    std::env::var("KEYSHIFT_JOB_IMAGE")
        .ok()
        .filter(|i| !i.is_empty())
        .expect("KEYSHIFT_JOB_IMAGE (hack/testenv.sh up writes it into its env file)")
}

/// The host's side of the test network's veth pair, 10.<KEYSHIFT_SUBNET>.0.1 (hack/testenv.sh's
/// layout; subnet 213 unless the environment names another): the address pods reach the host at.
pub fn host_veth_ip() -> std::net::Ipv4Addr {
    let subnet: u8 = std::env::var("KEYSHIFT_SUBNET")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(213);
    std::net::Ipv4Addr::new(10, subnet, 0, 1)
}

/// A TCP relay on the host side of the test network's veth pair (10.<KEYSHIFT_SUBNET>.0.1,
/// which pods reach through the node's bridge) to `target` on the host's loopback; runs until
/// the test process ends.
pub fn relay_to(target: &str) -> std::net::SocketAddr {
    use std::net::{TcpListener, TcpStream};
    let listener = TcpListener::bind((host_veth_ip(), 0))
        .expect("relay binds on the host side of the veth pair");
    let addr = listener.local_addr().expect("relay address");
    let target = target.to_owned();
    std::thread::spawn(move || {
        for conn in listener.incoming().map_while(Result::ok) {
            let Ok(upstream) = TcpStream::connect(&target) else {
                continue;
            };
            let pipe = |mut from: TcpStream, mut to: TcpStream| {
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from, &mut to);
                    let _ = to.shutdown(std::net::Shutdown::Write);
                });
            };
            if let (Ok(a), Ok(b)) = (conn.try_clone(), upstream.try_clone()) {
                pipe(a, upstream);
                pipe(b, conn);
            }
        }
    });
    addr
}

/// The S3 test server (`hack/s3-server.sh`, on the host's loopback) as pods reach it: through
/// one relay per test process on the host side of the veth pair.
pub fn s3_endpoint_for_pods() -> String {
    static RELAY: std::sync::OnceLock<std::net::SocketAddr> = std::sync::OnceLock::new();
    let relay = RELAY.get_or_init(|| {
        let endpoint = std::env::var("AWS_ENDPOINT").expect("AWS_ENDPOINT (hack/s3-server.sh)");
        relay_to(endpoint.trim_start_matches("http://"))
    });
    format!("http://{relay}")
}

/// Name of the Secret `s3_secret` creates.
pub const S3_SECRET: &str = "s3creds";

/// Creates Secret `s3creds` in `ns` with the S3 test server's settings as pods reach it
/// (`AWS_ENDPOINT` through the relay, keys, region), for `spec.state.credentialsSecret` or a
/// pod's `envFrom`.
pub fn s3_secret(ns: &str) {
    s3_secret_with_endpoint(ns, S3_SECRET, &s3_endpoint_for_pods());
}

/// Creates Secret `name` in `ns` like [`s3_secret`], with pods reaching S3 at `endpoint` (a
/// relay of the test's own, say).
pub fn s3_secret_with_endpoint(ns: &str, name: &str, endpoint: &str) {
    let mut args: Vec<String> = ["create", "secret", "generic", name, "-n", ns]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.push(format!("--from-literal=AWS_ENDPOINT={endpoint}"));
    for k in [
        "AWS_ALLOW_HTTP",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_REGION",
    ] {
        args.push(format!(
            "--from-literal={k}={}",
            std::env::var(k).unwrap_or_default()
        ));
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    kubectl_ok(&args);
}

/// A cloud protocol's test server (hack/test.sh starts one of each): its label, the variable
/// that holds its base URL, and the script that starts it (and prints that variable).
#[derive(Clone, Copy)]
pub struct Cloud {
    pub label: &'static str,
    pub url_var: &'static str,
    pub script: &'static str,
}

/// S3 (moto).
pub const S3: Cloud = Cloud {
    label: "S3",
    url_var: "KEYSHIFT_TEST_S3_URL",
    script: "hack/s3-server.sh",
};
/// GCS (fake-gcs-server behind our XML-upload adapter).
pub const GCS: Cloud = Cloud {
    label: "GCS",
    url_var: "KEYSHIFT_TEST_GCS_URL",
    script: "hack/gcs-server.sh",
};
/// Azure Blob (Azurite).
pub const AZURE: Cloud = Cloud {
    label: "Azure",
    url_var: "KEYSHIFT_TEST_AZURE_URL",
    script: "hack/azure-server.sh",
};

/// A URL of its own on `cloud`'s test server for `tag` (unique per test process), or `None`
/// (with a message naming the server to start) when the server is not running.
pub fn cloud_url(cloud: Cloud, tag: &str) -> Option<String> {
    let Ok(url) = std::env::var(cloud.url_var) else {
        // Straight to stderr, so that it shows even when the test harness captures output.
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED {tag} on {}: {} is not set (start the server with `eval \"$({} start)\"`; hack/test.sh starts it)",
            cloud.label,
            cloud.url_var,
            cloud.script,
        );
        return None;
    };
    Some(format!(
        "{}/{tag}-{}",
        url.trim_end_matches('/'),
        std::process::id()
    ))
}

/// A storage URL of its own on the S3 test server for `tag` (unique per test process).
pub fn s3_storage(tag: &str) -> String {
    cloud_url(S3, tag).expect("the S3 test server (hack/s3-server.sh)")
}

/// The runtime's ID of a pod's first container (`containerd://ID` in its status).
pub fn container_id(ns: &str, pod: &str) -> String {
    let id = jsonpath(
        ns,
        &format!("pod/{pod}"),
        "{.status.containerStatuses[0].containerID}",
    );
    id.strip_prefix("containerd://")
        .unwrap_or_else(|| panic!("pod {pod}: a containerd container, got {id:?}"))
        .to_owned()
}

/// Runs `ctr ARGS` against the test node's containerd (namespace `k8s.io`) and returns its
/// stdout; panics with its stderr unless it succeeds.
pub fn ctr(args: &[&str]) -> String {
    let bin = std::env::var("KEYSHIFT_CONTAINERD_BIN").expect("KEYSHIFT_CONTAINERD_BIN (testenv)");
    let sock =
        std::env::var("KEYSHIFT_CONTAINERD_SOCK").expect("KEYSHIFT_CONTAINERD_SOCK (testenv)");
    let out = Command::new(Path::new(&bin).join("ctr"))
        .args(["--address", &sock, "-n", "k8s.io"])
        .args(args)
        .output()
        .expect("ctr runs");
    assert!(
        out.status.success(),
        "ctr {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Kills a pod's container with SIGKILL through the node's containerd, as an OOM kill or a
/// crash would end it: the kubelet reports it terminated (exit 137).
pub fn kill_container(ns: &str, pod: &str) {
    ctr(&["tasks", "kill", "-s", "SIGKILL", &container_id(ns, pod)]);
}

/// Object names under `url` (any `object_store` URL), relative to it.
pub fn list_objects(url: &str) -> Vec<String> {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        use futures::TryStreamExt;
        let (store, prefix) = keyshift::snapshot::open_store(url).expect("object store");
        let objects: Vec<object_store::ObjectMeta> =
            store.list(Some(&prefix)).try_collect().await.expect("list");
        let base = format!("{prefix}/");
        objects
            .into_iter()
            .map(|o| o.location.to_string().trim_start_matches(&base).to_owned())
            .collect()
    })
}

/// The published sink output under `url`: `(snapshot id, part name, JSON lines)`, in snapshot
/// id order (staged parts are not output).
pub fn published_parts(url: &str) -> Vec<(u64, String, String)> {
    let mut parts: Vec<(u64, String)> = list_objects(url)
        .into_iter()
        .filter_map(|name| {
            let (dir, part) = name.split_once('/')?;
            let id = dir.strip_prefix("snap-")?.parse().ok()?;
            Some((id, part.to_owned()))
        })
        .collect();
    parts.sort();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        use object_store::ObjectStoreExt;
        let (store, base) = keyshift::snapshot::open_store(url).expect("sink store");
        let mut out = Vec::new();
        for (id, part) in parts {
            let path = base
                .clone()
                .join(format!("snap-{id}").as_str())
                .join(part.as_str());
            let bytes = store
                .get(&path)
                .await
                .expect("published part")
                .bytes()
                .await
                .expect("part body");
            out.push((id, part, String::from_utf8(bytes.to_vec()).expect("UTF-8")));
        }
        out
    })
}

/// Tags the test image under `reference` in the node's containerd, as a registry would serve a
/// new release of it (the upgrade tests roll out "new" images).
pub fn tag_image(reference: &str) {
    ctr(&["images", "tag", "--force", &image(), reference]);
}

/// The GitOps health tool (`hack/gitops-health`): `KEYSHIFT_GITOPS_HEALTH` (set by `hack/test.sh`),
/// else what `hack/build-gitops-health.sh` builds or finds in its cache.
pub fn gitops_health_bin() -> PathBuf {
    static BIN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(p) = std::env::var_os("KEYSHIFT_GITOPS_HEALTH").filter(|p| !p.is_empty()) {
            return PathBuf::from(p);
        }
        let out = Command::new(root().join("hack/build-gitops-health.sh"))
            .stderr(Stdio::inherit())
            .output()
            .expect("hack/build-gitops-health.sh runs");
        assert!(out.status.success(), "hack/build-gitops-health.sh failed");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let path = stdout
            .lines()
            .find_map(|l| l.strip_prefix("GITOPS_HEALTH="))
            .expect("GITOPS_HEALTH=<path> on stdout");
        PathBuf::from(path)
    })
    .clone()
}

/// A StreamJob's health as Flux (kstatus) and Argo CD (our Lua health check) see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GitopsHealth {
    /// kstatus' status (`InProgress`, `Current`, `Failed`, ...) and message.
    pub kstatus: (String, String),
    /// The Argo CD health check's `hs.status` and `hs.message`.
    pub argocd: (String, String),
}

/// The Argo CD health check we ship.
pub fn argocd_health_script() -> PathBuf {
    root().join("docs/gitops/streamjob-health.lua")
}

fn gitops_health(args: &[&str], stdin: Option<&str>) -> GitopsHealth {
    let script = argocd_health_script();
    let mut child = Command::new(gitops_health_bin())
        .arg("--lua")
        .arg(&script)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("gitops-health starts");
    let mut input = child.stdin.take().expect("stdin is piped");
    if let Some(text) = stdin {
        input.write_all(text.as_bytes()).expect("writing its stdin");
    }
    drop(input);
    let out = child.wait_with_output().expect("gitops-health runs");
    assert!(
        out.status.success(),
        "gitops-health {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("gitops-health JSON");
    let pair = |k: &str| {
        (
            v[k]["status"].as_str().unwrap_or_default().to_owned(),
            v[k]["message"].as_str().unwrap_or_default().to_owned(),
        )
    };
    GitopsHealth {
        kstatus: pair("kstatus"),
        argocd: pair("argocd"),
    }
}

/// The health of a StreamJob given as its JSON document.
pub fn gitops_health_of_json(json: &str) -> GitopsHealth {
    gitops_health(&[], Some(json))
}

/// The health of the live StreamJob `ns/name` on the test control plane (read by the tool's own
/// client).
pub fn gitops_health_of(ns: &str, name: &str) -> GitopsHealth {
    let kubeconfig = kubeconfig();
    let kubeconfig = kubeconfig.to_str().expect("a UTF-8 kubeconfig path");
    gitops_health(
        &["--kubeconfig", kubeconfig, "-n", ns, "--name", name],
        None,
    )
}

/// `h` is `kstatus` in Flux's terms and `argocd` in Argo CD's, Argo CD's message says `message`,
/// and the two tools agree as docs/gitops.md's table says; `what` names the object in a failure.
pub fn assert_gitops_health(
    h: &GitopsHealth,
    what: &str,
    kstatus: &str,
    argocd: &str,
    message: &str,
) {
    assert_eq!(
        (h.kstatus.0.as_str(), h.argocd.0.as_str()),
        (kstatus, argocd),
        "{what}: {h:?}"
    );
    assert!(
        h.argocd.1.contains(message),
        "{what}: Argo CD's message should say {message:?}: {h:?}"
    );
    assert_gitops_agree(h, argocd == "Suspended");
}

/// The Argo CD health docs/gitops.md's table pairs with a kstatus result: Failed is Degraded,
/// InProgress is Progressing, Current is Healthy (Suspended for a suspended job). Panics when the
/// two tools disagree.
pub fn assert_gitops_agree(h: &GitopsHealth, suspended: bool) {
    let expected = match h.kstatus.0.as_str() {
        "Failed" => "Degraded",
        "InProgress" => "Progressing",
        "Current" if suspended => "Suspended",
        "Current" => "Healthy",
        other => panic!("kstatus {other} is not in docs/gitops.md's table: {h:?}"),
    };
    assert_eq!(
        h.argocd.0, expected,
        "Argo CD disagrees with kstatus: {h:?}"
    );
}

/// Parses the metrics endpoint at `url` with Prometheus' reference parser (`prometheus_client`
/// for Python, installed by hack/test.sh) through tests/monitoring/check_exposition.py, which
/// also checks names and types against Prometheus' conventions (counters end in `_total`, base
/// units, nothing in milliseconds, no `job`/`instance` label); returns each family's type by
/// name, and panics with the parser's or the checker's complaint.
pub fn check_exposition(url: &str) -> std::collections::BTreeMap<String, String> {
    let script = root().join("tests/monitoring/check_exposition.py");
    let out = std::process::Command::new("python3")
        .arg(&script)
        .arg(url)
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{url} failed Prometheus' parser or the naming checks:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(n, t)| (n.to_owned(), t.to_owned()))
        .collect()
}
