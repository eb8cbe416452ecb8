//! `keyshift-kubelet`: a small kubelet for tests. It runs pods as local processes so the operator
//! can be exercised against a real kube-apiserver without containers.
//!
//! What it does, as a real kubelet would (and no more):
//! * registers a Ready Node, renews its Lease and heartbeats its Ready condition;
//! * binds unscheduled pods to itself through the Binding subresource (no scheduler runs);
//! * runs each container of a bound pod as a process: an image whose repository ends in
//!   `keyshift` runs the locally built `keyshift` binary as the image's ENTRYPOINT
//!   (`/keyshift`) with the container's `args`; a `command` other than `/keyshift` is refused
//!   as containerd + runc refuse it in the `scratch` image (terminated, reason `StartError`,
//!   exit code 128: `keyshift` alone is "executable file not found in $PATH"); other images are
//!   refused with a waiting reason `ErrImagePull` and a message that says why;
//! * gives every pod its own address (added to the node's interface inside the test's network
//!   namespace), resolves env (literal values, fieldRef, secretKeyRef, configMapKeyRef,
//!   envFrom), and hands pods with a ServiceAccount a kubeconfig holding that account's token
//!   (`KUBECONFIG`), so RBAC applies as in a cluster;
//! * reports Running/Ready (httpGet/tcpSocket readiness probes), exit codes, restarts per
//!   restartPolicy with back-off, and finishes deletions (SIGTERM, grace period, SIGKILL).
//!
//! It is test support, not a product: no images, volumes, init containers or resource limits.

use anyhow::{Context, Result, bail};
use base64::Engine as _;
use clap::Parser;
use futures::StreamExt;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{
    Binding, ConfigMap, Container, ContainerState, ContainerStateRunning, ContainerStateTerminated,
    ContainerStateWaiting, ContainerStatus, Node, NodeAddress, NodeCondition, NodeStatus,
    ObjectReference, Pod, PodCondition, PodIP, PodStatus, Probe, Secret,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Config, ResourceExt};
use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Mutex, watch};
use tokio::time::{Instant, sleep};

#[derive(Parser, Debug)]
#[command(
    name = "keyshift-kubelet",
    about = "A process kubelet for keyshift's tests"
)]
struct Args {
    /// Kubeconfig of an identity allowed to manage nodes, leases, pods and pod bindings.
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: PathBuf,
    /// Directory for pod logs and per-pod files.
    #[arg(long)]
    state_dir: PathBuf,
    /// Node name to register.
    #[arg(long, default_value = "keyshift-node")]
    node_name: String,
    /// Node address (reported in the Node's status).
    #[arg(long, env = "KEYSHIFT_NODE_IP", default_value = "10.213.0.2")]
    node_ip: Ipv4Addr,
    /// Interface that pod addresses are added to (inside the test's network namespace).
    /// Empty: pods share the node address.
    #[arg(long, env = "KEYSHIFT_NETNS_IF", default_value = "")]
    interface: String,
    /// First pod address; later pods get the following addresses. Default: x.y.1.1 in the
    /// node address's /16 (10.213.0.2 -> 10.213.1.1), so a relocated test environment
    /// (`KEYSHIFT_SUBNET`) needs no second setting.
    #[arg(long)]
    pod_ip_start: Option<Ipv4Addr>,
    /// The binary that images whose repository ends in `keyshift` run. Default: `keyshift`
    /// beside this executable.
    #[arg(long, env = "KEYSHIFT_BIN")]
    keyshift_bin: Option<PathBuf>,
}

struct Kubelet {
    client: Client,
    node: String,
    node_ip: Ipv4Addr,
    interface: String,
    state_dir: PathBuf,
    keyshift_bin: PathBuf,
    api_server: String,
    ca_pem: Option<String>,
    ips: Mutex<IpPool>,
}

/// Pod address allocation: the next free address after `start`, released on pod removal.
struct IpPool {
    start: u32,
    used: BTreeMap<u32, String>,
}

impl IpPool {
    fn take(&mut self, uid: &str) -> Ipv4Addr {
        if let Some((&ip, _)) = self.used.iter().find(|(_, u)| *u == uid) {
            return Ipv4Addr::from(ip);
        }
        let mut ip = self.start;
        while self.used.contains_key(&ip) {
            ip += 1;
        }
        self.used.insert(ip, uid.to_owned());
        Ipv4Addr::from(ip)
    }

    fn release(&mut self, ip: Ipv4Addr) {
        self.used.remove(&u32::from(ip));
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    keyshift::telemetry::init(keyshift::telemetry::LogFormat::Text);
    keyshift::telemetry::install_crypto_provider();
    let args = Args::parse();
    let kubeconfig = kube::config::Kubeconfig::read_from(&args.kubeconfig)
        .with_context(|| format!("reading kubeconfig {}", args.kubeconfig.display()))?;
    // The CA pods need to trust the API server, as PEM.
    let ca_pem = match kubeconfig.clusters.first().and_then(|c| c.cluster.as_ref()) {
        Some(cluster) => match (
            &cluster.certificate_authority_data,
            &cluster.certificate_authority,
        ) {
            (Some(data), _) => Some(String::from_utf8(
                base64::engine::general_purpose::STANDARD
                    .decode(data)
                    .context("decoding certificate-authority-data")?,
            )?),
            (None, Some(path)) => Some(std::fs::read_to_string(path)?),
            (None, None) => None,
        },
        None => None,
    };
    let config =
        Config::from_custom_kubeconfig(kubeconfig, &kube::config::KubeConfigOptions::default())
            .await?;
    let api_server = config.cluster_url.to_string();
    let client = Client::try_from(config)?;
    let keyshift_bin = match args.keyshift_bin {
        Some(p) => p,
        None => std::env::current_exe()?
            .parent()
            .context("executable has no directory")?
            .join("keyshift"),
    };
    tokio::fs::create_dir_all(&args.state_dir).await?;
    let kubelet = Arc::new(Kubelet {
        client,
        node: args.node_name,
        node_ip: args.node_ip,
        interface: args.interface,
        state_dir: args.state_dir,
        keyshift_bin,
        api_server,
        ca_pem,
        ips: Mutex::new(IpPool {
            start: u32::from(
                args.pod_ip_start
                    .unwrap_or_else(|| default_pod_ip_start(args.node_ip)),
            ),
            used: BTreeMap::new(),
        }),
    });
    kubelet.register_node().await?;
    tokio::spawn(heartbeat(kubelet.clone()));

    let pods: HashMap<String, PodHandle> = HashMap::new();
    let pods = Arc::new(Mutex::new(pods));
    let watch_task = tokio::spawn(watch_pods(kubelet.clone(), pods.clone()));
    tokio::spawn(housekeeping(kubelet.clone(), pods.clone()));

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = term.recv() => {},
        r = watch_task => { tracing::error!(?r, "pod watch ended"); },
    }
    tracing::info!("stopping: terminating every pod process");
    let handles: Vec<PodHandle> = pods.lock().await.drain().map(|(_, h)| h).collect();
    for h in &handles {
        let _ = h.stop.send(Some(Duration::from_secs(5)));
    }
    for h in handles {
        if let Some(done) = h.done {
            let _ = tokio::time::timeout(Duration::from_secs(10), done).await;
        }
    }
    Ok(())
}

fn now() -> Time {
    Time(Timestamp::now())
}

impl Kubelet {
    fn node_status(&self) -> NodeStatus {
        let q = |s: &str| Quantity(s.to_owned());
        let capacity = BTreeMap::from([
            ("cpu".to_owned(), q("64")),
            ("memory".to_owned(), q("256Gi")),
            ("pods".to_owned(), q("500")),
        ]);
        NodeStatus {
            addresses: Some(vec![
                NodeAddress {
                    type_: "InternalIP".into(),
                    address: self.node_ip.to_string(),
                },
                NodeAddress {
                    type_: "Hostname".into(),
                    address: self.node.clone(),
                },
            ]),
            allocatable: Some(capacity.clone()),
            capacity: Some(capacity),
            conditions: Some(vec![NodeCondition {
                type_: "Ready".into(),
                status: "True".into(),
                reason: Some("KubeletReady".into()),
                message: Some("keyshift-kubelet is posting ready status".into()),
                last_heartbeat_time: Some(now()),
                last_transition_time: Some(now()),
            }]),
            ..Default::default()
        }
    }

    async fn register_node(&self) -> Result<()> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let node = Node {
            metadata: ObjectMeta {
                name: Some(self.node.clone()),
                labels: Some(BTreeMap::from([
                    ("kubernetes.io/hostname".to_owned(), self.node.clone()),
                    ("kubernetes.io/os".to_owned(), "linux".to_owned()),
                ])),
                ..Default::default()
            },
            ..Default::default()
        };
        match nodes.create(&PostParams::default(), &node).await {
            Ok(_) => tracing::info!(node = %self.node, "registered node"),
            Err(kube::Error::Api(e)) if e.code == 409 => {
                tracing::info!(node = %self.node, "node exists")
            }
            Err(e) => return Err(e.into()),
        }
        self.post_node_status().await
    }

    async fn post_node_status(&self) -> Result<()> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let patch = serde_json::json!({ "status": self.node_status() });
        nodes
            .patch_status(&self.node, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        Ok(())
    }

    async fn renew_lease(&self) -> Result<()> {
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), "kube-node-lease");
        let spec = LeaseSpec {
            holder_identity: Some(self.node.clone()),
            lease_duration_seconds: Some(40),
            renew_time: Some(MicroTime(Timestamp::now())),
            ..Default::default()
        };
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(self.node.clone()),
                ..Default::default()
            },
            spec: Some(spec),
        };
        leases
            .patch(
                &self.node,
                &PatchParams::apply("keyshift-kubelet").force(),
                &Patch::Apply(&lease),
            )
            .await?;
        Ok(())
    }
}

async fn heartbeat(k: Arc<Kubelet>) {
    loop {
        if let Err(e) = k.renew_lease().await {
            tracing::warn!(error = %e, "lease renewal failed");
        }
        if let Err(e) = k.post_node_status().await {
            tracing::warn!(error = %e, "node status update failed");
        }
        sleep(Duration::from_secs(10)).await;
    }
}

struct PodHandle {
    /// Send `Some(grace)` to stop the pod's processes.
    stop: watch::Sender<Option<Duration>>,
    /// Fires when the pod's processes are gone; taken when termination begins.
    done: Option<tokio::sync::oneshot::Receiver<()>>,
    /// When the handle was made: housekeeping leaves younger handles alone.
    since: Instant,
}

type PodMap = Arc<Mutex<HashMap<String, PodHandle>>>;

async fn watch_pods(k: Arc<Kubelet>, pods: PodMap) -> Result<()> {
    let api: Api<Pod> = Api::all(k.client.clone());
    let mut stream = watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    loop {
        match stream.next().await {
            None => return Ok(()),
            // The watcher re-lists after its back-off; the error is only worth a line.
            Some(Err(e)) => tracing::warn!(error = %e, "pod watch error (retrying)"),
            Some(Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod))) => {
                handle_pod(&k, &pods, pod).await;
            }
            Some(Ok(watcher::Event::Delete(pod))) => {
                // Gone from the API (force-deleted or finished): make sure nothing runs.
                if let Some(h) = pods.lock().await.remove(&pod.uid().unwrap_or_default()) {
                    let _ = h.stop.send(Some(Duration::ZERO));
                }
            }
            Some(Ok(watcher::Event::Init | watcher::Event::InitDone)) => {}
        }
    }
}

/// What a real kubelet's housekeeping does every few seconds: a pod on this node that is
/// terminating but whose deletion was never finished (a lost request, a missed event) is
/// finished now, and processes of pods that no longer exist are stopped.
async fn housekeeping(k: Arc<Kubelet>, pods: PodMap) {
    let api: Api<Pod> = Api::all(k.client.clone());
    loop {
        sleep(Duration::from_secs(5)).await;
        let started = Instant::now();
        let lp = kube::api::ListParams::default().fields(&format!("spec.nodeName={}", k.node));
        let list = match api.list(&lp).await {
            Ok(list) => list,
            Err(e) => {
                tracing::warn!(error = %e, "housekeeping: listing pods failed");
                continue;
            }
        };
        let mut seen = std::collections::HashSet::new();
        for pod in list.items {
            let uid = pod.uid().unwrap_or_default();
            seen.insert(uid);
            if pod.metadata.deletion_timestamp.is_some() {
                handle_pod(&k, &pods, pod).await;
            }
        }
        let mut map = pods.lock().await;
        let gone: Vec<String> = map
            .iter()
            .filter(|(uid, h)| !seen.contains(*uid) && h.since < started)
            .map(|(uid, _)| uid.clone())
            .collect();
        for uid in gone {
            if let Some(h) = map.remove(&uid) {
                tracing::info!(
                    uid,
                    "housekeeping: pod no longer exists, stopping its processes"
                );
                let _ = h.stop.send(Some(Duration::ZERO));
            }
        }
    }
}

async fn handle_pod(k: &Arc<Kubelet>, pods: &PodMap, pod: Pod) {
    let Some(spec) = pod.spec.as_ref() else {
        return;
    };
    let uid = pod.uid().unwrap_or_default();
    let name = pod.name_any();
    let ns = pod.namespace().unwrap_or_default();
    match spec.node_name.as_deref() {
        None | Some("") => {
            if pod.metadata.deletion_timestamp.is_none()
                && let Err(e) = k.bind(&ns, &name).await
            {
                tracing::warn!(pod = %name, namespace = %ns, error = %e, "binding failed");
            }
            return;
        }
        Some(n) if n != k.node => return,
        Some(_) => {}
    }
    let mut map = pods.lock().await;
    if pod.metadata.deletion_timestamp.is_some() {
        let grace = pod
            .metadata
            .deletion_grace_period_seconds
            .unwrap_or(30)
            .max(0) as u64;
        match map.get_mut(&uid) {
            // Terminating already: its waiter finishes the deletion once the processes are gone.
            Some(h) if h.done.is_none() => {}
            Some(h) => {
                let _ = h.stop.send(Some(Duration::from_secs(grace)));
                let done = h.done.take();
                let k = k.clone();
                let pods = pods.clone();
                tokio::spawn(async move {
                    if let Some(done) = done {
                        let _ = done.await;
                    }
                    k.finish_deletion(&ns, &name, &uid).await;
                    pods.lock().await.remove(&uid);
                });
            }
            // Nothing runs for it here (never started, or already stopped).
            None => {
                let k = k.clone();
                tokio::spawn(async move { k.finish_deletion(&ns, &name, &uid).await });
            }
        }
        return;
    }
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    if map.contains_key(&uid) || matches!(phase, Some("Succeeded") | Some("Failed")) {
        return;
    }
    let (stop, stop_rx) = watch::channel(None);
    let (done_tx, done) = tokio::sync::oneshot::channel();
    map.insert(
        uid.clone(),
        PodHandle {
            stop,
            done: Some(done),
            since: Instant::now(),
        },
    );
    let k = k.clone();
    tokio::spawn(async move {
        if let Err(e) = run_pod(&k, pod, stop_rx).await {
            tracing::error!(pod = %name, namespace = %ns, error = %format!("{e:#}"), "pod supervisor failed");
        }
        let _ = done_tx.send(());
    });
}

impl Kubelet {
    async fn bind(&self, ns: &str, name: &str) -> Result<()> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let binding = Binding {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                ..Default::default()
            },
            target: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(self.node.clone()),
                ..Default::default()
            },
        };
        match pods
            .create_subresource::<_, serde_json::Value>(
                "binding",
                name,
                &PostParams::default(),
                &binding,
            )
            .await
        {
            Ok(_) => {
                tracing::info!(pod = %name, namespace = %ns, node = %self.node, "bound");
                Ok(())
            }
            // Already bound (a watch event raced the binding): fine.
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Finishes a graceful deletion, as the kubelet does once the containers are gone. Retried
    /// until the pod is gone (or is another pod of the same name): a lost request must not leave
    /// a pod Terminating forever. Housekeeping calls it again if even this gives up.
    async fn finish_deletion(&self, ns: &str, name: &str, uid: &str) {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let mut dp = DeleteParams::default().grace_period(0);
        dp.preconditions = Some(kube::api::Preconditions {
            uid: Some(uid.to_owned()),
            resource_version: None,
        });
        for attempt in 0u32..20 {
            match pods.delete(name, &dp).await {
                Ok(_) => {
                    tracing::info!(pod = %name, namespace = %ns, "deletion finished");
                    return;
                }
                Err(kube::Error::Api(e)) if e.code == 404 => return,
                // 409: another pod now has the name (UID precondition), or a concurrent write.
                Err(kube::Error::Api(e)) if e.code == 409 => match pods.get_opt(name).await {
                    Ok(Some(p)) if p.uid().as_deref() == Some(uid) => {
                        tracing::info!(pod = %name, namespace = %ns, attempt, "finishing deletion: conflict, retrying");
                    }
                    Ok(_) => return,
                    Err(e) => {
                        tracing::warn!(pod = %name, namespace = %ns, attempt, error = %e, "finishing deletion: re-reading failed")
                    }
                },
                Err(e) => {
                    tracing::warn!(pod = %name, namespace = %ns, attempt, error = %e, "finishing deletion failed, retrying")
                }
            }
            sleep(Duration::from_millis(200 * u64::from(attempt.min(10) + 1))).await;
        }
        tracing::warn!(pod = %name, namespace = %ns, "finishing deletion: giving up for now (housekeeping retries)");
    }

    async fn patch_pod_status(&self, ns: &str, name: &str, status: &PodStatus) {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let patch = serde_json::json!({ "status": status });
        for attempt in 0..5 {
            match pods
                .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => return,
                Err(kube::Error::Api(e)) if e.code == 404 => return,
                Err(e) => {
                    tracing::warn!(pod = %name, namespace = %ns, attempt, error = %e, "pod status update failed");
                    sleep(Duration::from_millis(200 * (attempt + 1))).await;
                }
            }
        }
    }

    async fn add_address(&self, ip: Ipv4Addr) -> Result<()> {
        if self.interface.is_empty() {
            return Ok(());
        }
        let out = tokio::process::Command::new("ip")
            .args(["addr", "add", &format!("{ip}/32"), "dev", &self.interface])
            .output()
            .await
            .context("running `ip addr add`")?;
        if !out.status.success() && !String::from_utf8_lossy(&out.stderr).contains("File exists") {
            bail!(
                "ip addr add {ip}/32 dev {}: {}",
                self.interface,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    async fn remove_address(&self, ip: Ipv4Addr) {
        if self.interface.is_empty() {
            return;
        }
        let _ = tokio::process::Command::new("ip")
            .args(["addr", "del", &format!("{ip}/32"), "dev", &self.interface])
            .output()
            .await;
    }

    /// A kubeconfig holding a token of the pod's ServiceAccount, bound to the pod.
    async fn service_account_kubeconfig(&self, pod: &Pod, dir: &Path) -> Result<Option<PathBuf>> {
        let Some(spec) = pod.spec.as_ref() else {
            return Ok(None);
        };
        if spec.automount_service_account_token == Some(false) {
            return Ok(None);
        }
        let ns = pod.namespace().unwrap_or_default();
        let sa = spec
            .service_account_name
            .clone()
            .unwrap_or_else(|| "default".into());
        let sas: Api<k8s_openapi::api::core::v1::ServiceAccount> =
            Api::namespaced(self.client.clone(), &ns);
        let request = TokenRequest {
            spec: Some(TokenRequestSpec {
                audiences: None,
                attestations: None,
                expiration_seconds: Some(24 * 3600),
                bound_object_ref: Some(
                    k8s_openapi::api::authentication::v1::BoundObjectReference {
                        api_version: Some("v1".into()),
                        kind: Some("Pod".into()),
                        name: Some(pod.name_any()),
                        uid: pod.uid(),
                    },
                ),
            }),
            ..Default::default()
        };
        let token: TokenRequest = sas
            .create_subresource("token", &sa, &PostParams::default(), &request)
            .await
            .with_context(|| format!("requesting a token for ServiceAccount {ns}/{sa}"))?;
        let Some(status) = token.status else {
            bail!("token request for {ns}/{sa} returned no token");
        };
        let ca_path = dir.join("ca.crt");
        if let Some(ca) = &self.ca_pem {
            tokio::fs::write(&ca_path, ca).await?;
        }
        let kubeconfig = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "cluster", "cluster": {
                "server": self.api_server,
                "certificate-authority": ca_path,
            }}],
            "users": [{"name": sa, "user": {"token": status.token}}],
            "contexts": [{"name": "pod", "context": {"cluster": "cluster", "user": sa, "namespace": ns}}],
            "current-context": "pod",
        });
        let path = dir.join("kubeconfig");
        tokio::fs::write(&path, serde_json::to_vec_pretty(&kubeconfig)?).await?;
        Ok(Some(path))
    }

    /// Resolves a container's environment as the kubelet would.
    async fn container_env(
        &self,
        pod: &Pod,
        c: &Container,
        pod_ip: Ipv4Addr,
    ) -> Result<Vec<(String, String)>> {
        let ns = pod.namespace().unwrap_or_default();
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), &ns);
        let maps: Api<ConfigMap> = Api::namespaced(self.client.clone(), &ns);
        let mut env: Vec<(String, String)> = vec![
            ("HOSTNAME".into(), pod.name_any()),
            ("KUBERNETES_SERVICE_HOST".into(), self.node_ip.to_string()),
            ("KUBERNETES_SERVICE_PORT".into(), "6443".into()),
        ];
        for from in c.env_from.iter().flatten() {
            let prefix = from.prefix.clone().unwrap_or_default();
            if let Some(s) = &from.secret_ref {
                match secrets.get(&s.name).await {
                    Ok(secret) => {
                        for (k, v) in secret.data.unwrap_or_default() {
                            env.push((
                                format!("{prefix}{k}"),
                                String::from_utf8_lossy(&v.0).into(),
                            ));
                        }
                    }
                    Err(e) if s.optional != Some(true) => {
                        bail!("envFrom secret {}: {e}", s.name)
                    }
                    Err(_) => {}
                }
            }
            if let Some(m) = &from.config_map_ref {
                match maps.get(&m.name).await {
                    Ok(map) => {
                        for (k, v) in map.data.unwrap_or_default() {
                            env.push((format!("{prefix}{k}"), v));
                        }
                    }
                    Err(e) if m.optional != Some(true) => {
                        bail!("envFrom configMap {}: {e}", m.name)
                    }
                    Err(_) => {}
                }
            }
        }
        for var in c.env.iter().flatten() {
            let value = if let Some(v) = &var.value {
                v.clone()
            } else if let Some(from) = &var.value_from {
                if let Some(f) = &from.field_ref {
                    match f.field_path.as_str() {
                        "metadata.name" => pod.name_any(),
                        "metadata.namespace" => ns.clone(),
                        "metadata.uid" => pod.uid().unwrap_or_default(),
                        "spec.nodeName" => self.node.clone(),
                        "spec.serviceAccountName" => pod
                            .spec
                            .as_ref()
                            .and_then(|s| s.service_account_name.clone())
                            .unwrap_or_else(|| "default".into()),
                        "status.podIP" => pod_ip.to_string(),
                        "status.hostIP" => self.node_ip.to_string(),
                        other => {
                            if let Some(label) = other
                                .strip_prefix("metadata.labels['")
                                .and_then(|s| s.strip_suffix("']"))
                            {
                                pod.labels().get(label).cloned().unwrap_or_default()
                            } else if let Some(a) = other
                                .strip_prefix("metadata.annotations['")
                                .and_then(|s| s.strip_suffix("']"))
                            {
                                pod.annotations().get(a).cloned().unwrap_or_default()
                            } else {
                                bail!("unsupported fieldRef {other}")
                            }
                        }
                    }
                } else if let Some(s) = &from.secret_key_ref {
                    let secret = secrets
                        .get(&s.name)
                        .await
                        .with_context(|| format!("secret {} for env {}", s.name, var.name))?;
                    match secret.data.unwrap_or_default().get(&s.key) {
                        Some(v) => String::from_utf8_lossy(&v.0).into_owned(),
                        None if s.optional == Some(true) => continue,
                        None => bail!("secret {} has no key {}", s.name, s.key),
                    }
                } else if let Some(m) = &from.config_map_key_ref {
                    let map = maps
                        .get(&m.name)
                        .await
                        .with_context(|| format!("configMap {} for env {}", m.name, var.name))?;
                    match map.data.unwrap_or_default().get(&m.key) {
                        Some(v) => v.clone(),
                        None if m.optional == Some(true) => continue,
                        None => bail!("configMap {} has no key {}", m.name, m.key),
                    }
                } else {
                    bail!("unsupported valueFrom for env {}", var.name)
                }
            } else {
                String::new()
            };
            env.push((var.name.clone(), expand_vars(&value, &env)));
        }
        Ok(env)
    }
}

/// Kubernetes' `$(VAR)` expansion in values, commands and args.
fn expand_vars(text: &str, env: &[(String, String)]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("$(") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        match after.find(')') {
            Some(j) => {
                let name = &after[..j];
                match env.iter().rev().find(|(k, _)| k == name) {
                    Some((_, v)) => out.push_str(v),
                    None => {
                        out.push_str("$(");
                        out.push_str(name);
                        out.push(')');
                    }
                }
                rest = &after[j + 1..];
            }
            None => {
                out.push_str(&rest[i..]);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

/// The first pod address when none is given: x.y.1.1 in the node address's /16.
fn default_pod_ip_start(node_ip: Ipv4Addr) -> Ipv4Addr {
    let [a, b, _, _] = node_ip.octets();
    Ipv4Addr::new(a, b, 1, 1)
}

/// The repository part of an image reference (no tag or digest).
fn image_repository(image: &str) -> &str {
    let no_digest = image.split('@').next().unwrap_or(image);
    match no_digest.rfind(':') {
        Some(i) if !no_digest[i..].contains('/') => &no_digest[..i],
        _ => no_digest,
    }
}

/// Where the keyshift image holds its binary, run as its ENTRYPOINT: the only executable in
/// the image (a `scratch` image with no shell and no `PATH` entry for it).
const IMAGE_ENTRYPOINT: &str = "/keyshift";

/// Why a container cannot run here, in the words a real node uses.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Refusal {
    /// The container status reason: `ErrImagePull` (waiting) or `StartError` (terminated with
    /// exit code 128, as containerd reports a process runc could not exec).
    reason: &'static str,
    message: String,
}

/// The program and arguments a container runs, or why it cannot run here. Like a real node
/// running the keyshift image: no `command` runs the image's ENTRYPOINT (`/keyshift`) with
/// `args`; a `command` must name that file by its absolute path, as the image has no shell and
/// nothing on `PATH` (`keyshift` alone is refused as containerd + runc refuse it).
fn container_argv(
    c: &Container,
    keyshift_bin: &Path,
    env: &[(String, String)],
) -> Result<Vec<String>, Refusal> {
    let image = c.image.as_deref().unwrap_or("");
    if !image_repository(image).ends_with("keyshift") {
        return Err(Refusal {
            reason: "ErrImagePull",
            message: format!(
                "keyshift-kubelet runs only images whose repository ends in \"keyshift\" (the locally built binary); image {image:?} cannot run here"
            ),
        });
    }
    let mut argv = vec![keyshift_bin.display().to_string()];
    let command: Vec<String> = c
        .command
        .iter()
        .flatten()
        .map(|a| expand_vars(a, env))
        .collect();
    if let Some((first, rest)) = command.split_first() {
        if first != IMAGE_ENTRYPOINT {
            // runc looks a name without a slash up on PATH, and execs anything else as a path.
            let cause = if first.contains('/') {
                format!("exec: {first:?}: stat {first}: no such file or directory")
            } else {
                format!("exec: {first:?}: executable file not found in $PATH")
            };
            return Err(Refusal {
                reason: "StartError",
                message: format!(
                    "failed to create containerd task: failed to create shim task: OCI runtime create failed: runc create failed: unable to start container process: error during container init: {cause}: unknown (image {image:?} holds only {IMAGE_ENTRYPOINT})"
                ),
            });
        }
        argv.extend(rest.iter().cloned());
    }
    argv.extend(c.args.iter().flatten().map(|a| expand_vars(a, env)));
    Ok(argv)
}

fn waiting_state(waiting: ContainerStateWaiting) -> ContainerState {
    ContainerState {
        waiting: Some(waiting),
        ..Default::default()
    }
}

fn kill_group(pid: u32, signal: libc::c_int) {
    // SAFETY: kill(2) on a process group we created; no memory is shared.
    unsafe {
        libc::kill(-(pid as libc::pid_t), signal);
    }
}

/// Per-container run state.
struct Running {
    child: tokio::process::Child,
    started: Time,
    /// Held open for containers with `stdin: true`, as a real kubelet keeps the stream attached.
    _stdin: Option<tokio::process::ChildStdin>,
}

async fn probe_ok(probe: Option<&Probe>, ip: Ipv4Addr) -> bool {
    let Some(probe) = probe else { return true };
    if let Some(h) = &probe.http_get {
        let port = match &h.port {
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(p) => *p as u16,
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(_) => return false,
        };
        let path = h.path.clone().unwrap_or_else(|| "/".into());
        let fut = async {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut s = tokio::net::TcpStream::connect((ip, port)).await.ok()?;
            s.write_all(
                format!("GET {path} HTTP/1.1\r\nHost: {ip}:{port}\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await
            .ok()?;
            let mut buf = vec![0u8; 64];
            let n = s.read(&mut buf).await.ok()?;
            let line = String::from_utf8_lossy(&buf[..n]).to_string();
            let code: u16 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some((200..400).contains(&code))
        };
        return tokio::time::timeout(Duration::from_secs(2), fut)
            .await
            .ok()
            .flatten()
            .unwrap_or(false);
    }
    if let Some(t) = &probe.tcp_socket {
        if let k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(p) = t.port {
            return tokio::time::timeout(
                Duration::from_secs(2),
                tokio::net::TcpStream::connect((ip, p as u16)),
            )
            .await
            .is_ok_and(|r| r.is_ok());
        }
        return false;
    }
    // exec probes cannot run here; treat as passing.
    true
}

fn condition(type_: &str, ok: bool, since: &Time) -> PodCondition {
    PodCondition {
        type_: type_.into(),
        status: if ok { "True" } else { "False" }.into(),
        last_transition_time: Some(since.clone()),
        ..Default::default()
    }
}

/// Runs one pod until it ends or is stopped.
async fn run_pod(
    k: &Arc<Kubelet>,
    pod: Pod,
    mut stop: watch::Receiver<Option<Duration>>,
) -> Result<()> {
    let ns = pod.namespace().unwrap_or_default();
    let name = pod.name_any();
    let uid = pod.uid().unwrap_or_default();
    let Some(spec) = pod.spec.clone() else {
        return Ok(());
    };
    let restart_policy = spec
        .restart_policy
        .clone()
        .unwrap_or_else(|| "Always".into());
    let dir = k.state_dir.join("pods").join(format!("{ns}_{name}_{uid}"));
    tokio::fs::create_dir_all(&dir).await?;
    let pod_ip = k.ips.lock().await.take(&uid);
    let started_at = now();
    let result = supervise(
        k,
        &pod,
        &spec.containers,
        &restart_policy,
        &dir,
        pod_ip,
        &started_at,
        &mut stop,
    )
    .await;
    k.remove_address(pod_ip).await;
    k.ips.lock().await.release(pod_ip);
    if let Err(e) = &result {
        let status = PodStatus {
            phase: Some("Failed".into()),
            reason: Some("KubeletError".into()),
            message: Some(format!("{e:#}")),
            ..Default::default()
        };
        k.patch_pod_status(&ns, &name, &status).await;
    }
    result
}

#[allow(clippy::too_many_arguments)]
async fn supervise(
    k: &Arc<Kubelet>,
    pod: &Pod,
    containers: &[Container],
    restart_policy: &str,
    dir: &Path,
    pod_ip: Ipv4Addr,
    started_at: &Time,
    stop: &mut watch::Receiver<Option<Duration>>,
) -> Result<()> {
    let ns = pod.namespace().unwrap_or_default();
    let name = pod.name_any();
    let base_status = |phase: &str, statuses: Vec<ContainerStatus>, ready: bool| PodStatus {
        phase: Some(phase.into()),
        host_ip: Some(k.node_ip.to_string()),
        host_ips: Some(vec![k8s_openapi::api::core::v1::HostIP {
            ip: k.node_ip.to_string(),
        }]),
        pod_ip: Some(pod_ip.to_string()),
        pod_ips: Some(vec![PodIP {
            ip: pod_ip.to_string(),
        }]),
        start_time: Some(started_at.clone()),
        conditions: Some(vec![
            condition("PodScheduled", true, started_at),
            condition("Initialized", true, started_at),
            condition("ContainersReady", ready, started_at),
            condition("Ready", ready, started_at),
        ]),
        container_statuses: Some(statuses),
        ..Default::default()
    };

    // Resolve every container before starting any; refuse what cannot run here.
    let mut argvs = Vec::new();
    let mut envs = Vec::new();
    let sa_kubeconfig = k.service_account_kubeconfig(pod, dir).await?;
    for c in containers {
        let mut env = k.container_env(pod, c, pod_ip).await?;
        if let Some(path) = &sa_kubeconfig {
            env.push(("KUBECONFIG".into(), path.display().to_string()));
        }
        match container_argv(c, &k.keyshift_bin, &env) {
            Ok(argv) => argvs.push(argv),
            Err(refusal) => {
                let message = &refusal.message;
                tracing::warn!(pod = %name, namespace = %ns, %message, "refusing container");
                // A container runc could not exec has terminated with 128 (and the pod failed,
                // under restartPolicy Never); an image that cannot be pulled keeps the pod
                // Pending. Either way nothing here would ever change, so nothing is retried.
                let start_error = refusal.reason == "StartError";
                let terminated = ContainerStateTerminated {
                    exit_code: 128,
                    reason: Some(refusal.reason.into()),
                    message: Some(refusal.message.clone()),
                    started_at: Some(now()),
                    finished_at: Some(now()),
                    ..Default::default()
                };
                let failed = start_error && restart_policy == "Never";
                let statuses = containers
                    .iter()
                    .map(|other| {
                        let (state, last_state) = if other.name != c.name {
                            let waiting = ContainerStateWaiting {
                                reason: Some("ContainerCreating".into()),
                                message: None,
                            };
                            (waiting_state(waiting), None)
                        } else if failed {
                            let state = ContainerState {
                                terminated: Some(terminated.clone()),
                                ..Default::default()
                            };
                            (state, None)
                        } else if start_error {
                            let waiting = ContainerStateWaiting {
                                reason: Some("CrashLoopBackOff".into()),
                                message: Some(format!(
                                    "back-off restarting failed container {}",
                                    c.name
                                )),
                            };
                            let last = ContainerState {
                                terminated: Some(terminated.clone()),
                                ..Default::default()
                            };
                            (waiting_state(waiting), Some(last))
                        } else {
                            let waiting = ContainerStateWaiting {
                                reason: Some(refusal.reason.into()),
                                message: Some(refusal.message.clone()),
                            };
                            (waiting_state(waiting), None)
                        };
                        ContainerStatus {
                            name: other.name.clone(),
                            image: other.image.clone().unwrap_or_default(),
                            image_id: String::new(),
                            ready: false,
                            restart_count: 0,
                            state: Some(state),
                            last_state,
                            ..Default::default()
                        }
                    })
                    .collect();
                let phase = if failed { "Failed" } else { "Pending" };
                k.patch_pod_status(&ns, &name, &base_status(phase, statuses, false))
                    .await;
                if failed {
                    return Ok(());
                }
                // Wait until the pod is deleted.
                let _ = stop.changed().await;
                return Ok(());
            }
        }
        envs.push(env);
    }
    k.add_address(pod_ip).await?;

    let n = containers.len();
    let mut running: Vec<Option<Running>> = (0..n).map(|_| None).collect();
    let mut restarts = vec![0i32; n];
    let mut last_term: Vec<Option<ContainerStateTerminated>> = vec![None; n];
    let mut finished: Vec<Option<ContainerStateTerminated>> = vec![None; n];
    let mut next_start = vec![Instant::now(); n];
    let mut last_reported: Option<serde_json::Value> = None;

    let spawn = |i: usize| -> Result<Running> {
        let argv = &argvs[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(format!("{}.log", containers[i].name)))?;
        let mut cmd = tokio::process::Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .envs(envs[i].iter().map(|(a, b)| (a.as_str(), b.as_str())))
            .current_dir(dir)
            .stdin(if containers[i].stdin == Some(true) {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0)
            .kill_on_drop(true);
        if let Some(w) = &containers[i].working_dir {
            cmd.current_dir(w);
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {}", argv[0]))?;
        tracing::info!(pod = %name, namespace = %ns, container = %containers[i].name, pid = child.id(), "started");
        let stdin = child.stdin.take();
        Ok(Running {
            child,
            started: now(),
            _stdin: stdin,
        })
    };

    loop {
        // Start what should run.
        for i in 0..n {
            if running[i].is_none() && finished[i].is_none() && Instant::now() >= next_start[i] {
                running[i] = Some(spawn(i)?);
            }
        }
        // Observe readiness and exits.
        let mut all_ready = true;
        let mut statuses = Vec::with_capacity(n);
        for i in 0..n {
            let c = &containers[i];
            let mut state = ContainerState::default();
            let mut ready = false;
            if let Some(r) = running[i].as_mut() {
                if let Some(exit) = r.child.try_wait()? {
                    let code = exit.code().unwrap_or(128 + 9);
                    let term = ContainerStateTerminated {
                        exit_code: code,
                        reason: Some(if code == 0 { "Completed" } else { "Error" }.into()),
                        started_at: Some(r.started.clone()),
                        finished_at: Some(now()),
                        ..Default::default()
                    };
                    tracing::info!(pod = %name, namespace = %ns, container = %c.name, code, "exited");
                    running[i] = None;
                    let restart = match restart_policy {
                        "Always" => true,
                        "OnFailure" => code != 0,
                        _ => false,
                    };
                    if restart {
                        restarts[i] += 1;
                        let backoff = Duration::from_secs((1u64 << restarts[i].min(5)) as u64)
                            .min(Duration::from_secs(30));
                        next_start[i] = Instant::now() + backoff;
                        last_term[i] = Some(term.clone());
                        state.waiting = Some(ContainerStateWaiting {
                            reason: Some("CrashLoopBackOff".into()),
                            message: Some(format!(
                                "back-off {}s restarting failed container",
                                backoff.as_secs()
                            )),
                        });
                    } else {
                        finished[i] = Some(term);
                    }
                } else {
                    ready = probe_ok(c.readiness_probe.as_ref(), pod_ip).await;
                    state.running = Some(ContainerStateRunning {
                        started_at: Some(r.started.clone()),
                    });
                }
            } else if finished[i].is_none() {
                state.waiting = Some(ContainerStateWaiting {
                    reason: Some("CrashLoopBackOff".into()),
                    message: None,
                });
            }
            if let Some(t) = &finished[i] {
                state = ContainerState {
                    terminated: Some(t.clone()),
                    ..Default::default()
                };
            }
            all_ready &= ready;
            statuses.push(ContainerStatus {
                name: c.name.clone(),
                image: c.image.clone().unwrap_or_default(),
                image_id: format!("keyshift-kubelet://{}", k.keyshift_bin.display()),
                // The process id is the container id of a process kubelet.
                container_id: running[i]
                    .as_ref()
                    .and_then(|r| r.child.id())
                    .map(|pid| format!("process://{pid}")),
                ready,
                started: Some(state.running.is_some()),
                restart_count: restarts[i],
                state: Some(state),
                last_state: last_term[i].clone().map(|t| ContainerState {
                    terminated: Some(t),
                    ..Default::default()
                }),
                ..Default::default()
            });
        }
        let all_done = finished.iter().all(Option::is_some);
        let phase = if all_done {
            if finished.iter().flatten().all(|t| t.exit_code == 0) {
                "Succeeded"
            } else {
                "Failed"
            }
        } else {
            "Running"
        };
        let status = base_status(phase, statuses, all_ready && !all_done);
        // Report only changes (ignoring timestamps that do not change anyway).
        let value = serde_json::to_value(&status)?;
        if last_reported.as_ref() != Some(&value) {
            k.patch_pod_status(&ns, &name, &status).await;
            last_reported = Some(value);
        }
        if all_done {
            return Ok(());
        }
        tokio::select! {
            changed = stop.changed() => {
                let grace = if changed.is_ok() { (*stop.borrow()).unwrap_or_default() } else { Duration::ZERO };
                stop_all(&mut running, grace, &ns, &name).await;
                return Ok(());
            }
            _ = sleep(Duration::from_millis(500)) => {}
        }
    }
}

async fn stop_all(running: &mut [Option<Running>], grace: Duration, ns: &str, pod: &str) {
    for r in running.iter().flatten() {
        if let Some(pid) = r.child.id() {
            kill_group(pid, libc::SIGTERM);
        }
    }
    let deadline = Instant::now() + grace;
    for r in running.iter_mut().flatten() {
        let left = deadline.saturating_duration_since(Instant::now());
        if tokio::time::timeout(left, r.child.wait()).await.is_err() {
            if let Some(pid) = r.child.id() {
                tracing::info!(pod, namespace = ns, pid, "grace period over: SIGKILL");
                kill_group(pid, libc::SIGKILL);
            }
            let _ = r.child.wait().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repositories() {
        assert_eq!(image_repository("keyshift"), "keyshift");
        assert_eq!(
            image_repository("ghcr.io/acme/keyshift:0.1.0"),
            "ghcr.io/acme/keyshift"
        );
        assert_eq!(
            image_repository("localhost:5000/keyshift"),
            "localhost:5000/keyshift"
        );
        assert_eq!(image_repository("keyshift@sha256:abc"), "keyshift");
        assert_eq!(image_repository("busybox:1.36"), "busybox");
    }

    #[test]
    fn pod_addresses_follow_the_node_subnet() {
        assert_eq!(
            default_pod_ip_start(Ipv4Addr::new(10, 213, 0, 2)),
            Ipv4Addr::new(10, 213, 1, 1)
        );
        assert_eq!(
            default_pod_ip_start(Ipv4Addr::new(10, 214, 0, 2)),
            Ipv4Addr::new(10, 214, 1, 1)
        );
    }

    fn container(image: &str, command: Option<&[&str]>, args: &[&str]) -> Container {
        let strings = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        Container {
            name: "main".into(),
            image: Some(image.into()),
            command: command.map(strings),
            args: Some(strings(args)),
            ..Default::default()
        }
    }

    #[test]
    fn commands_run_as_a_real_node_runs_the_keyshift_image() {
        let bin = Path::new("/build/keyshift");
        let env = vec![("POD_IP".to_owned(), "10.213.1.1".to_owned())];
        // No command: the image's ENTRYPOINT runs with the args (what the operator's pods do).
        let c = container(
            "ghcr.io/keyshift/keyshift:0.1.0",
            None,
            &["worker", "--control-addr", "$(POD_IP):9090"],
        );
        assert_eq!(
            container_argv(&c, bin, &env).unwrap(),
            [
                "/build/keyshift",
                "worker",
                "--control-addr",
                "10.213.1.1:9090"
            ]
        );
        // The entrypoint by its absolute path.
        let c = container("keyshift:dev", Some(&["/keyshift", "--version"]), &[]);
        assert_eq!(
            container_argv(&c, bin, &env).unwrap(),
            ["/build/keyshift", "--version"]
        );
        // A bare name: the scratch image has nothing on PATH, so runc cannot find it.
        let c = container("keyshift:dev", Some(&["keyshift"]), &["worker"]);
        let refusal = container_argv(&c, bin, &env).unwrap_err();
        assert_eq!(refusal.reason, "StartError");
        assert!(
            refusal
                .message
                .contains(r#"exec: "keyshift": executable file not found in $PATH"#),
            "{}",
            refusal.message
        );
        // Any other path does not exist in the image.
        let c = container("keyshift:dev", Some(&["/usr/bin/keyshift"]), &[]);
        let refusal = container_argv(&c, bin, &env).unwrap_err();
        assert_eq!(refusal.reason, "StartError");
        assert!(
            refusal.message.contains(
                r#"exec: "/usr/bin/keyshift": stat /usr/bin/keyshift: no such file or directory"#
            ),
            "{}",
            refusal.message
        );
        // Other images cannot be pulled here at all.
        let c = container("busybox:1.36", Some(&["/keyshift"]), &[]);
        let refusal = container_argv(&c, bin, &env).unwrap_err();
        assert_eq!(refusal.reason, "ErrImagePull");
        assert!(
            refusal.message.contains("busybox:1.36"),
            "{}",
            refusal.message
        );
    }

    #[test]
    fn expansion() {
        let env = vec![("A".to_owned(), "x".to_owned())];
        assert_eq!(expand_vars("$(A)-$(B)", &env), "x-$(B)");
        assert_eq!(expand_vars("no vars", &env), "no vars");
    }
}
