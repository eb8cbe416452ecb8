//! Worker processes on this machine: how one is spawned (loopback addresses, its log files, its
//! lifetime tied to ours) and stopped, and the process platform — the
//! [`Workers`](crate::orchestrator::port::Workers) port `keyshift local` runs the shared
//! orchestration over.

use super::LocalError;
use crate::orchestrator::coordinator::WorkerEndpoint;
use crate::orchestrator::decide::{ObservedPod, PodPhase};
use crate::orchestrator::port::{Listed, PortError, Waker, Workers};
use keyshift_core::keygroup::Assignment;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

/// How long a spawned worker may take to report its addresses.
const ANNOUNCE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a stopped worker may take to exit after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// Starts one worker process on loopback; `stem` names its log files in `log_dir`
/// (`<stem>.log`: its logs, `<stem>.out`: the log sink's output). `index` is only for errors.
pub async fn spawn_worker(
    bin: &Path,
    log_dir: &Path,
    token: &str,
    stem: &str,
    index: usize,
) -> Result<(Child, WorkerEndpoint), LocalError> {
    let spawn_err = |reason: String| LocalError::Spawn { index, reason };
    tokio::fs::create_dir_all(log_dir)
        .await
        .map_err(|e| spawn_err(format!("creating {}: {e}", log_dir.display())))?;
    let log_path = log_dir.join(format!("{stem}.log"));
    let log = std::fs::File::create(&log_path)
        .map_err(|e| spawn_err(format!("creating {}: {e}", log_path.display())))?;
    let mut command = Command::new(bin);
    command
        .args([
            "worker",
            "--control-addr",
            "127.0.0.1:0",
            "--data-addr",
            "127.0.0.1:0",
        ])
        .env("KEYSHIFT_TOKEN", token)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        // Own process group: a Ctrl-C at the terminal reaches only `keyshift local`, which then
        // stops the workers with a savepoint.
        .process_group(0)
        .kill_on_drop(true);
    die_with_parent(&mut command);
    let mut child = command
        .spawn()
        .map_err(|e| spawn_err(format!("{}: {e}", bin.display())))?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| spawn_err("no stdout".into()))?;
    let mut lines = BufReader::with_capacity(1 << 16, stdout).lines();
    let first = tokio::time::timeout(ANNOUNCE_TIMEOUT, lines.next_line())
        .await
        .map_err(|_| {
            spawn_err(format!(
                "did not report its addresses within {}s",
                ANNOUNCE_TIMEOUT.as_secs()
            ))
        })?
        .map_err(|e| spawn_err(e.to_string()))?
        .ok_or_else(|| spawn_err(format!("exited at once; see {}", log_path.display())))?;
    let addrs: serde_json::Value =
        serde_json::from_str(&first).map_err(|e| spawn_err(format!("{first:?}: {e}")))?;
    let (Some(control), Some(data)) = (addrs["control"].as_str(), addrs["data"].as_str()) else {
        return Err(spawn_err(format!(
            "no control or data address in {first:?}"
        )));
    };
    let endpoint = WorkerEndpoint {
        control: format!("http://{control}"),
        data: data.to_owned(),
    };
    // The rest of stdout is the log sink's output, copied as is in large writes (not a write
    // per line: a checkpoint may emit a line for every key).
    let out_path = log_dir.join(format!("{stem}.out"));
    tokio::spawn(async move {
        if let Ok(mut f) = tokio::fs::File::create(&out_path).await {
            let mut rest = lines.into_inner();
            let _ = tokio::io::copy_buf(&mut rest, &mut f).await;
            let _ = f.flush().await;
        }
    });
    Ok((child, endpoint))
}

/// Stops a worker (SIGTERM, then SIGKILL after [`STOP_GRACE`]) and waits until it is gone.
pub async fn stop_worker(mut child: Child) {
    if let Some(pid) = child.id() {
        // SAFETY: kill(2) with a pid we spawned; no memory is shared.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGTERM);
        }
    }
    if tokio::time::timeout(STOP_GRACE, child.wait())
        .await
        .is_err()
    {
        let _ = child.kill().await;
    }
}

/// A worker of `keyshift local` is killed when its launcher dies (killed, or crashed), so no
/// worker outlives it. Linux only; elsewhere workers are stopped on a normal exit only.
fn die_with_parent(command: &mut Command) {
    #[cfg(target_os = "linux")]
    // SAFETY: the closure runs in the forked child before exec and only makes the
    // async-signal-safe prctl(2) call.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    #[cfg(not(target_os = "linux"))]
    let _ = command;
}

/// One worker process of the job.
struct Process {
    child: Child,
    pod: ObservedPod,
    endpoint: WorkerEndpoint,
    max_parallelism: u32,
}

/// The process platform: the job's workers are child processes of `keyshift local`.
pub struct ProcessWorkers {
    bin: PathBuf,
    log_dir: PathBuf,
    token: String,
    /// `settings::spec_hash` of the spec new workers are created for.
    spec_hash: String,
    processes: BTreeMap<String, Process>,
    wake: Arc<tokio::sync::Notify>,
}

impl ProcessWorkers {
    pub fn new(bin: PathBuf, log_dir: PathBuf, token: String, spec_hash: String) -> Self {
        ProcessWorkers {
            bin,
            log_dir,
            token,
            spec_hash,
            processes: BTreeMap::new(),
            wake: Arc::new(tokio::sync::Notify::new()),
        }
    }

    /// New workers are created for this spec (an edited manifest).
    pub fn set_spec_hash(&mut self, hash: String) {
        self.spec_hash = hash;
    }

    /// Notified when a background step ends.
    pub fn woken(&self) -> Arc<tokio::sync::Notify> {
        self.wake.clone()
    }

    /// Whether any worker process is left.
    pub fn is_empty(&self) -> bool {
        self.processes.is_empty()
    }

    /// Process ids of the workers.
    pub fn pids(&self) -> Vec<u32> {
        self.processes
            .values()
            .filter_map(|p| p.child.id())
            .collect()
    }

    /// Stops every worker at once (a second Ctrl-C).
    pub async fn stop_all(&mut self) {
        let all = std::mem::take(&mut self.processes);
        futures::future::join_all(all.into_values().map(|p| stop_worker(p.child))).await;
    }
}

#[async_trait::async_trait]
impl Workers for ProcessWorkers {
    async fn observe(&mut self) -> Result<Vec<Listed>, PortError> {
        Ok(self
            .processes
            .values_mut()
            .map(|p| {
                let mut pod = p.pod.clone();
                pod.phase = match p.child.try_wait() {
                    Ok(Some(_)) => PodPhase::Exited,
                    Ok(None) => PodPhase::Running,
                    Err(_) => PodPhase::Unknown,
                };
                Listed {
                    pod,
                    endpoint: Some(p.endpoint.clone()),
                    max_parallelism: Some(p.max_parallelism),
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
        // Spawned at once: each waits for its process to announce its addresses.
        let (bin, log_dir) = (&self.bin, &self.log_dir);
        let spawned = futures::future::join_all(subtasks.iter().map(|&i| {
            let stem = format!("run-{run}-worker-{i}");
            async move {
                let name = format!("{run}-{i}");
                spawn_worker(bin, log_dir, token, &stem, i as usize)
                    .await
                    .map(|(child, endpoint)| (i, child, endpoint))
                    .map_err(|e| PortError::new(format!("starting worker {name}"), e, true))
            }
        }))
        .await;
        let mut failed = None;
        for result in spawned {
            let (i, child, endpoint) = match result {
                Ok(w) => w,
                Err(e) => {
                    failed.get_or_insert(e);
                    continue;
                }
            };
            let name = format!("{run}-{i}");
            let pod = ObservedPod {
                name: name.clone(),
                run: run.to_owned(),
                subtask: i,
                parallelism,
                phase: PodPhase::Running,
                ip: Some("127.0.0.1".into()),
                deleting: false,
                grace_deadline: None,
                worker: None,
                spec_hash: Some(self.spec_hash.clone()),
                unschedulable: None,
            };
            self.processes.insert(
                name,
                Process {
                    child,
                    pod,
                    endpoint,
                    max_parallelism: assignment.max_parallelism(),
                },
            );
        }
        if let Some(e) = failed {
            return Err(e);
        }
        // The workers are up (they announced their addresses): the next pass may go on now.
        self.wake.notify_one();
        Ok(())
    }

    async fn delete(&mut self, names: &[String]) -> Result<(), PortError> {
        let gone: Vec<Process> = names
            .iter()
            .filter_map(|n| self.processes.remove(n))
            .collect();
        futures::future::join_all(gone.into_iter().map(|p| stop_worker(p.child))).await;
        // They are gone (not just asked to go): the next pass may go on now.
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
