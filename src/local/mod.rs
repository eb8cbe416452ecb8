//! `keyshift local`: a StreamJob on one machine, no cluster. Workers are local processes on
//! loopback, state lives in a local directory (or any object store URL), and the job is driven by
//! the same orchestration pass as on Kubernetes ([`crate::orchestrator::pass`]) over the process
//! platform ([`processes::ProcessWorkers`]): the same steps, rollback, recovery and backoff.
//! Status lives in memory; the job's snapshots carry everything a restart needs.

pub mod harness;
pub mod processes;
pub mod strict;

pub use harness::{LaunchReport, LocalJob, LocalWorkers, Prestage, PrestageReport, RescaleReport};

use crate::crd::{Phase, StreamJob, StreamJobSpec, StreamJobStatus};
use crate::operator::metrics::OperatorMetrics;
use crate::orchestrator::coordinator::CoordinatorError;
use crate::orchestrator::pass::{self, JobMemory, PassInput, PendingEvent, Shell};
use crate::orchestrator::run;
use crate::orchestrator::settings;
use crate::snapshot;
use crate::validation;
use keyshift_core::keygroup::{self, Assignment};
use keyshift_core::reason::Reason;
use keyshift_core::step::Step;
use keyshift_core::text;
use processes::ProcessWorkers;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Failures of a local run.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a StreamJob manifest: {reason}")]
    Parse { path: PathBuf, reason: String },
    /// Fields the CRD does not declare (a typo): refused as `kubectl apply` refuses them.
    #[error("{path}: {}", strict::strict_decoding_message(.fields))]
    UnknownFields { path: PathBuf, fields: Vec<String> },
    #[error("{path} is invalid:\n{errors}")]
    Invalid { path: PathBuf, errors: String },
    #[error("{0}")]
    Analysis(#[from] validation::AnalysisError),
    #[error("starting worker {index}: {reason}")]
    Spawn { index: usize, reason: String },
    #[error(transparent)]
    Coordinator(#[from] CoordinatorError),
    #[error(transparent)]
    Snapshot(#[from] snapshot::SnapshotError),
    #[error("{0}")]
    Bounds(#[from] keygroup::BoundsError),
    #[error("{0}")]
    RestoreFrom(String),
    #[error(transparent)]
    Random(#[from] crate::orchestrator::run::RandomError),
    #[error(transparent)]
    Credentials(#[from] crate::job::kafka::MissingCredential),
    #[error("rescale {from} -> {to} failed at step {step}: {reason}; {outcome}")]
    Rescale {
        from: u32,
        to: u32,
        step: &'static str,
        reason: String,
        outcome: String,
    },
}

/// Reads and checks a manifest file the way the API server would (same messages), strict
/// field validation included: a field the CRD does not declare is refused, not ignored.
pub fn load_manifest(path: &Path) -> Result<StreamJob, LocalError> {
    let text = std::fs::read_to_string(path).map_err(|source| LocalError::Read {
        path: path.to_owned(),
        source,
    })?;
    let value: serde_json::Value = serde_yaml::from_str(&text).map_err(|e| LocalError::Parse {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    let fields = strict::unknown_fields(&value);
    if !fields.is_empty() {
        return Err(LocalError::UnknownFields {
            path: path.to_owned(),
            fields,
        });
    }
    let job: StreamJob = serde_yaml::from_str(&text).map_err(|e| LocalError::Parse {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    validation::validate(&job.spec, None).map_err(|e| LocalError::Invalid {
        path: path.to_owned(),
        errors: e.to_string(),
    })?;
    if let Some(validation::RestoreSource::Snapshot(name)) = job
        .spec
        .restore_from
        .as_deref()
        .map(validation::restore_source)
    {
        return Err(LocalError::Invalid {
            path: path.to_owned(),
            errors: format!(
                "spec.restoreFrom names the StreamJobSnapshot {name}, a resource only a cluster has: give keyshift local the snapshot's URL instead (on the cluster: kubectl get streamjobsnapshot {name} -o jsonpath='{{.status.path}}')"
            ),
        });
    }
    Ok(job)
}

/// The job's namespace and name (`default` and `job` when the manifest has none).
pub fn job_names(job: &StreamJob) -> (String, String) {
    let namespace = job
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let name = job.metadata.name.clone().unwrap_or_else(|| "job".into());
    (namespace, name)
}

/// The status a local job resumes with (status is not kept between runs; the snapshots are):
/// the key-group count of spec.restoreFrom's snapshot if set (a savepoint rewritten to a new
/// count raises the ceiling), else the one of the job's newest snapshot, else none yet (the
/// first pass pins the spec's). spec.restoreFrom counts as restored once the job has a snapshot
/// of its own under that count, so the job resumes its own newest state.
pub async fn resume_status(
    spec: &StreamJobSpec,
    storage: &str,
    namespace: &str,
    name: &str,
) -> Result<StreamJobStatus, LocalError> {
    let mut status = StreamJobStatus::default();
    match &spec.restore_from {
        Some(url) => {
            let (groups, _) = snapshot::restore_source(url, storage, namespace)
                .await
                .map_err(LocalError::RestoreFrom)?;
            if let Some(g) = spec.max_parallelism
                && g as u32 != groups
            {
                return Err(LocalError::RestoreFrom(validation::restore_from_mismatch(
                    url, groups, g,
                )));
            }
            status.max_parallelism = Some(groups as i32);
            status.max_parallelism_origin = Some(validation::ceiling_origin_snapshot(url));
            let own =
                snapshot::newest_snapshot(storage, namespace, name, Some(groups), None).await?;
            if own.found.is_some() {
                status.restored_from = Some(url.clone());
            }
        }
        None => {
            let newest = snapshot::newest_snapshot(storage, namespace, name, None, None).await?;
            if let Some((url, s)) = newest.found {
                status.max_parallelism = Some(s.max_parallelism as i32);
                status.max_parallelism_origin = Some(validation::ceiling_origin_snapshot(&url));
            }
        }
    }
    Ok(status)
}

/// What `keyshift local` says when an edit asks for more subtasks than the key-group ceiling
/// without raising it: nothing changes, and the one edit that raises it.
pub fn local_ceiling_guidance(
    manifest: &Path,
    running: u32,
    replicas: i32,
    ceiling: u32,
) -> String {
    let g = keygroup::suggested_max_parallelism(replicas.max(1) as u32);
    format!(
        "replicas {replicas} exceeds {ceiling}, the key-group ceiling of this job's state (fixed by its first snapshot); nothing was changed and the job keeps running at parallelism {running}. To run more subtasks, raise the ceiling in the same edit: set `maxParallelism: {g}` and `replicas: {replicas}` in {}; keyshift local then stops the job with a savepoint, rewrites it to {g} key groups, verifies every key and restores it (the original savepoint is kept; setting maxParallelism back to {ceiling} before the new run's first checkpoint restores it)",
        manifest.display()
    )
}

/// Ctrl-C, or SIGTERM (`kill`, a service manager): both stop the job with a savepoint.
async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// The storage URL of a local run: the spec's, else `file://<state dir>`.
pub fn storage_url(spec: &StreamJobSpec, state_dir: &Path) -> Result<String, LocalError> {
    if let Some(s) = &spec.state.storage {
        return Ok(s.clone());
    }
    std::fs::create_dir_all(state_dir).map_err(|source| LocalError::Read {
        path: state_dir.to_owned(),
        source,
    })?;
    let abs = std::fs::canonicalize(state_dir).map_err(|source| LocalError::Read {
        path: state_dir.to_owned(),
        source,
    })?;
    Ok(format!("file://{}", abs.display()))
}

/// Options of `keyshift local`.
#[derive(Debug, Clone)]
pub struct LocalOptions {
    pub manifest: PathBuf,
    pub state_dir: PathBuf,
    /// The `keyshift` binary the workers run (default: this executable).
    pub bin: PathBuf,
    /// Seconds between progress lines.
    pub progress_every: Duration,
}

fn say(line: impl std::fmt::Display) {
    println!("[keyshift local] {line}");
}

fn rate(n: u64, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64().max(1e-9)
}

/// What the driver says about a pass: the lines a user reads, from what changed in status and
/// the pass's Events.
fn narrate(before: &StreamJobStatus, after: &StreamJobStatus, events: &[PendingEvent]) {
    for e in events {
        // Said below, from status, in the words `keyshift local` has always used.
        const SAID_FROM_STATUS: [Reason; 7] = [
            Reason::Started,
            Reason::Rescaled,
            Reason::RescaleStarted,
            Reason::Suspending,
            Reason::Suspended,
            Reason::CreatedPods,
            Reason::DeletingPods,
        ];
        match e.reason.as_str() {
            r if SAID_FROM_STATUS.iter().any(|s| r == *s) => {}
            _ if e.warning => say(format_args!("warning: {}: {}", e.reason, e.note)),
            _ => say(format_args!("{}: {}", e.reason, e.note)),
        }
        if e.reason == Reason::Started {
            say(format_args!("started: {}", e.note));
        }
    }
    if let Some(c) = &after.last_checkpoint
        && before.last_checkpoint.as_ref().map(|b| b.id) != Some(c.id)
    {
        say(format_args!(
            "checkpoint {} committed ({})",
            c.id,
            text::count(c.size_bytes.unwrap_or_default().max(0) as u64, "byte")
        ));
    }
    if let Some(r) = &after.restore
        && before.restore.as_ref() != Some(r)
    {
        say(format_args!(
            "{} from {}",
            r.summary,
            r.snapshot.as_deref().unwrap_or("nothing")
        ));
    }
    let was = before.rescale.as_ref();
    if let Some(r) = &after.rescale
        && was.is_none_or(|w| w.started != r.started || w.step != r.step)
    {
        let new = was.is_none_or(|w| w.started != r.started);
        match r.step {
            _ if new && r.rewrites() => say(format_args!(
                "changing the key-group count {} -> {} (parallelism {} -> {}): savepoint, rewrite, verify, restore ...",
                r.from_max_parallelism.unwrap_or_default(),
                r.max_parallelism.unwrap_or_default(),
                r.from,
                r.to
            )),
            step if r.rewrites() && step.active() => say(format_args!("step {step}")),
            _ if new && r.to > 0 && r.upgrade_mode.is_none() => {
                say(format_args!("rescaling {} -> {} ...", r.from, r.to));
            }
            _ if new && r.upgrade_mode.is_some() => say(format_args!(
                "upgrading (the manifest's job changed) at parallelism {} ...",
                r.to
            )),
            Step::Done if r.to > 0 => {
                let total: f64 = r.step_seconds.values().sum();
                say(format_args!(
                    "rescaled {} -> {} in {:.0} ms: {} moved, {} of state read ({}); savepoint {}",
                    r.from,
                    r.to,
                    total * 1000.0,
                    text::count(
                        r.groups_moved.unwrap_or_default().max(0) as u64,
                        "key group"
                    ),
                    text::count(r.bytes_to_read.unwrap_or_default().max(0) as u64, "byte"),
                    pass::step_times(r),
                    r.savepoint.as_deref().unwrap_or("none")
                ));
            }
            Step::Abandoned | Step::RolledBack => say(format_args!(
                "{} {} -> {}: {}",
                if r.step == Step::Abandoned {
                    "gave up the change"
                } else {
                    "rolled back the change"
                },
                r.from,
                r.to,
                after
                    .conditions
                    .iter()
                    .find(|c| c.reason == Reason::RescaleAbandoned
                        || c.reason == Reason::RescaleRolledBack)
                    .map_or("see the warning above", |c| c.message.as_str())
            )),
            _ => {}
        }
    }
    if after.phase == Some(Phase::Running)
        && let Some(p) = after.replicas
        && (before.phase != Some(Phase::Running) || before.replicas != Some(p))
    {
        say(format_args!("running at parallelism {p}"));
        if let Some(g) = after.max_parallelism {
            print_groups(p.max(0) as u32, g.max(1) as u32);
        }
    }
}

/// `keyshift local MANIFEST`: runs the job with the shared orchestration over local processes —
/// checkpoints, applies edits of the file (replicas as rescales, the job as upgrades), recovers
/// from worker failures — and on Ctrl-C suspends it with a savepoint (a second Ctrl-C stops the
/// workers at once).
pub async fn run_cli(opts: LocalOptions) -> Result<(), LocalError> {
    let job = load_manifest(&opts.manifest)?;
    let (namespace, name) = job_names(&job);
    let storage = storage_url(&job.spec, &opts.state_dir)?;
    let log_dir = opts.state_dir.join("logs");
    let mut spec = job.spec.clone();
    let mut status = resume_status(&spec, &storage, &namespace, &name).await?;
    let groups = match status.max_parallelism {
        Some(g) => g.max(1) as u32,
        None => validation::analyse(&spec, Some(&status))?
            .assignment
            .max_parallelism(),
    };
    say(format_args!(
        "job {namespace}/{name}: {}, {}, state in {storage}, worker logs in {}",
        text::count(spec.replicas.max(0) as u64, "subtask"),
        text::count(u64::from(groups), "key group"),
        log_dir.display()
    ));
    let resume = match &spec.restore_from {
        Some(url) if status.restored_from.as_ref() != Some(url) => Some(Some(url.clone())),
        _ => {
            let found = run::latest_restorable(
                &spec,
                &storage,
                &namespace,
                &name,
                groups,
                None,
                &Default::default(),
            )
            .await?;
            if found.job.is_none() && !found.skipped.is_empty() {
                // The pass refuses to start it (StartError::NothingRestorable) and says why.
                say(format_args!(
                    "warning: none of the job's snapshots can be restored: {}",
                    run::skipped_names(&found.skipped)
                ));
                None
            } else {
                if !found.skipped.is_empty() {
                    say(format_args!(
                        "warning: {}",
                        run::skipped_message(&found.skipped, found.url.as_deref())
                    ));
                }
                Some(found.url)
            }
        }
    };
    match &resume {
        Some(Some(url)) => say(format_args!("resuming from {url}")),
        Some(None) => say("no snapshot yet: starting empty"),
        None => {}
    }

    let token = run::new_token().map_err(|e| LocalError::Spawn {
        index: 0,
        reason: e.to_string(),
    })?;
    let mut workers =
        ProcessWorkers::new(opts.bin.clone(), log_dir, token, settings::spec_hash(&spec));
    let woken = workers.woken();
    let metrics = OperatorMetrics::new();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(3))
        .build()
        .unwrap_or_default();
    let mut mem = JobMemory::default();
    let mut progress_tick = tokio::time::interval_at(
        tokio::time::Instant::now() + opts.progress_every,
        opts.progress_every,
    );
    let mut manifest_tick = tokio::time::interval(Duration::from_millis(500));
    let mut mtime = std::fs::metadata(&opts.manifest)
        .and_then(|m| m.modified())
        .ok();
    let mut last = (Instant::now(), 0u64);
    let mut stopping = false;
    let mut next = tokio::time::Instant::now();
    let ctrl_c = stop_signal();
    tokio::pin!(ctrl_c);
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(next) => {}
            _ = woken.notified() => {}
            _ = &mut ctrl_c => {
                if stopping {
                    say("stopping at once: the workers are killed; the newest committed snapshot stays usable");
                    workers.stop_all().await;
                    return Ok(());
                }
                stopping = true;
                spec.suspend = true;
                say("stopping with a savepoint (Ctrl-C or SIGTERM; again to stop at once) ...");
                ctrl_c.set(stop_signal());
            }
            _ = progress_tick.tick() => {
                if let Some(c) = mem.coordinator()
                    && let Ok(st) = c.status().await
                {
                    let total: u64 = st.iter().map(|s| s.records_processed).sum();
                    let keys: u64 = st.iter().map(|s| s.keys).sum();
                    let now = Instant::now();
                    // A new run counts from zero.
                    let since = if total >= last.1 { last.1 } else { 0 };
                    let rps = rate(total - since, now - last.0);
                    last = (now, total);
                    let bp: u64 = st.iter().map(|s| s.backpressure_ms).sum();
                    let checkpoint = st.iter().filter_map(|s| s.last_checkpoint).min();
                    say(progress_line(st.len(), total, rps, keys, bp, checkpoint));
                }
                continue;
            }
            _ = manifest_tick.tick() => {
                let now = std::fs::metadata(&opts.manifest).and_then(|m| m.modified()).ok();
                if now == mtime || stopping {
                    continue;
                }
                mtime = now;
                let edited = match load_manifest(&opts.manifest) {
                    Ok(j) => j,
                    Err(e) => { say(format_args!("ignoring the edit: {e}")); continue; }
                };
                if let Err(e) = validation::analyse(&edited.spec, Some(&status)) {
                    let running = status.replicas.unwrap_or_default().max(0) as u32;
                    let ceiling = status.max_parallelism.unwrap_or_default().max(0) as u32;
                    if matches!(e, validation::AnalysisError::AboveCeiling { .. }) {
                        say(local_ceiling_guidance(&opts.manifest, running, edited.spec.replicas, ceiling));
                    } else {
                        say(format_args!("ignoring the edit: {e}"));
                    }
                    continue;
                }
                if edited.spec == spec {
                    continue;
                }
                spec = edited.spec;
                workers.set_spec_hash(settings::spec_hash(&spec));
            }
        }
        let before = status.clone();
        let out = pass::run_pass(
            PassInput {
                namespace: &namespace,
                name: &name,
                spec: &spec,
                status: status.clone(),
                storage: storage.clone(),
                generation: None,
                savepoint_request: None,
            },
            &mut mem,
            Shell {
                workers: &mut workers,
                metrics: &metrics,
                http: &http,
            },
        )
        .await;
        match out {
            Ok(out) => {
                narrate(&before, &out.status, &out.events);
                // A recorded step is acted on at once: unlike the API server, nothing here has
                // to catch up with the write first.
                let requeue = if out.status != before {
                    out.requeue.min(Duration::from_millis(10))
                } else {
                    out.requeue
                };
                status = out.status;
                next = tokio::time::Instant::now() + requeue;
            }
            Err(e) => {
                say(format_args!("{e}; retrying"));
                next =
                    tokio::time::Instant::now() + crate::backoff::jittered(e.kind().retry_after());
            }
        }
        if stopping && status.phase == Some(Phase::Suspended) && workers.is_empty() {
            match &status.last_savepoint {
                Some(sp)
                    if status
                        .rescale
                        .as_ref()
                        .is_some_and(|r| r.step == Step::Done) =>
                {
                    say(format_args!(
                        "stopped with savepoint {} ({} bytes); run the same command again to resume",
                        sp.path,
                        sp.size_bytes.unwrap_or_default()
                    ));
                }
                _ => say("stopped (nothing was running, so no savepoint was taken)"),
            }
            return Ok(());
        }
    }
}

/// The periodic progress line of a running job, e.g. `parallelism 4: 195349 records
/// (20010/s), 10000 keys, backpressure 129 ms, last checkpoint 3`.
fn progress_line(
    parallelism: usize,
    records: u64,
    records_per_sec: f64,
    keys: u64,
    backpressure_ms: u64,
    checkpoint: Option<u64>,
) -> String {
    format!(
        "parallelism {parallelism}: {} ({records_per_sec:.0}/s), {}, backpressure {backpressure_ms} ms, {}",
        text::count(records, "record"),
        text::count(keys, "key"),
        checkpoint.map_or_else(
            || "no checkpoint yet".to_owned(),
            |c| format!("last checkpoint {c}")
        )
    )
}

fn print_groups(parallelism: u32, max_parallelism: u32) {
    if let Ok(a) = Assignment::new(i64::from(parallelism), i64::from(max_parallelism)) {
        let ranges: Vec<String> = a.ranges().iter().map(|r| r.to_string()).collect();
        say(format_args!(
            "key groups per subtask: {} ({})",
            ranges.join(" "),
            a.skew().summary()
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::orchestrator::coordinator::tests::{commit, identity};
    use crate::snapshot::SnapshotKind;

    #[test]
    fn progress_reads_as_words() {
        assert_eq!(
            progress_line(4, 195_349, 20_010.4, 10_000, 129, Some(3)),
            "parallelism 4: 195349 records (20010/s), 10000 keys, backpressure 129 ms, last checkpoint 3"
        );
        let line = progress_line(1, 1, 0.4, 1, 0, None);
        assert_eq!(
            line,
            "parallelism 1: 1 record (0/s), 1 key, backpressure 0 ms, no checkpoint yet"
        );
        assert!(!line.contains("Some(") && !line.contains("None"));
    }

    /// What a resume of `job` (8 key groups) in `storage` finds to restore.
    async fn own_restorable(
        spec: &crate::crd::StreamJobSpec,
        storage: &str,
        job: &crate::snapshot::JobIdentity,
    ) -> run::Restorable {
        run::latest_restorable(
            spec,
            storage,
            &job.namespace,
            &job.name,
            8,
            None,
            &Default::default(),
        )
        .await
        .unwrap()
    }

    /// A corrupt manifest of the newest snapshot does not stop `keyshift local` from resuming:
    /// the key-group count comes from the newest good snapshot, as the resume itself passes over
    /// the bad one.
    #[tokio::test]
    async fn a_resume_passes_over_a_corrupt_newest_snapshot() {
        let storage = "memory://local-resume-corrupt/state";
        let job = identity("j");
        let good = commit(storage, &job, SnapshotKind::Checkpoint, 1).await;
        let bad = commit(storage, &job, SnapshotKind::Savepoint, 2).await;
        let (store, dir) = snapshot::open_store(&bad).unwrap();
        object_store::ObjectStoreExt::put(
            store.as_ref(),
            &snapshot::manifest_path(&dir),
            object_store::PutPayload::from_static(b"{\"formatVersion\": 1, \"job\": "),
        )
        .await
        .unwrap();
        let spec = crate::fixtures::job().spec;
        let status = resume_status(&spec, storage, &job.namespace, &job.name)
            .await
            .expect("the resume passes over the corrupt manifest");
        assert_eq!(status.max_parallelism, Some(8));
        assert_eq!(
            status.max_parallelism_origin,
            Some(validation::ceiling_origin_snapshot(&good))
        );
        let found = own_restorable(&spec, storage, &job).await;
        assert_eq!(found.url.as_deref(), Some(good.as_str()));
        assert_eq!(found.job, Some(job.clone()));
        assert_eq!(found.skipped.len(), 1);
    }

    /// A resume passes over snapshots whose manifest reads but whose state cannot be restored
    /// (a state file lost, one truncated), newest first, names each with why, and finds nothing
    /// when nothing is restorable (it never starts empty by itself: the pass refuses that).
    #[tokio::test]
    async fn a_resume_passes_over_snapshots_whose_state_files_are_lost_or_truncated() {
        use object_store::ObjectStoreExt;
        let storage = "memory://local-resume-lost/state";
        let job = identity("j");
        let good = commit(storage, &job, SnapshotKind::Checkpoint, 1).await;
        let lost = commit(storage, &job, SnapshotKind::Checkpoint, 2).await;
        let cut = commit(storage, &job, SnapshotKind::Savepoint, 3).await;
        let file = |url: &str| {
            let (store, dir) = snapshot::open_store(url).unwrap();
            (store, dir.join(snapshot::state_file_name(0, 1).as_str()))
        };
        let (store, path) = file(&lost);
        store.delete(&path).await.unwrap();
        let (store, path) = file(&cut);
        store
            .put(&path, object_store::PutPayload::from_static(b"x"))
            .await
            .unwrap();
        let spec = crate::fixtures::job().spec;
        let found = own_restorable(&spec, storage, &job).await;
        assert_eq!(found.url.as_deref(), Some(good.as_str()));
        let why: Vec<(u64, &str)> = found
            .skipped
            .iter()
            .map(|u| (u.id, u.error.as_str()))
            .collect();
        assert_eq!(why.len(), 2, "{why:?}");
        assert_eq!(why[0].0, 3);
        assert!(
            why[0].1.contains("has 1 bytes, the manifest says"),
            "{why:?}"
        );
        assert_eq!(why[1].0, 2);
        assert!(why[1].1.contains("is missing"), "{why:?}");
        let message = run::skipped_message(&found.skipped, found.url.as_deref());
        assert!(
            message.contains("sp-3") && message.contains("chk-2") && message.contains(&good),
            "{message}"
        );
        // The last one lost too: nothing to restore, and all three named.
        let (store, path) = file(&good);
        store.delete(&path).await.unwrap();
        let found = own_restorable(&spec, storage, &job).await;
        assert_eq!(found.url, spec.restore_from);
        assert_eq!(found.job, None);
        assert_eq!(found.skipped.len(), 3);
    }
}
