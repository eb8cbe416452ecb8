//! One run of a job: a set of workers at one parallelism, coordinated by one [`Coordinator`].
//! Everything about a run that does not depend on where its workers live is built here: the
//! coordinator (with the job's sink and retention), the start request, the job's identity in its
//! snapshots, the control token, the run id, and the timeouts of each long step.

use super::settings::{fingerprint, layout};
use crate::crd::{SinkType, StreamJobSpec};
use crate::orchestrator::coordinator::{Coordinator, CoordinatorError, WorkerEndpoint};
use crate::runtime::protocol::StartRequest;
use crate::snapshot::{self, JobIdentity};
use keyshift_core::keygroup::Assignment;
use keyshift_core::reason::Reason;
use std::collections::BTreeMap;

/// Failures of the OS random number generator (no weaker source is ever used instead).
#[derive(Debug, thiserror::Error)]
#[error("the operating system's random number generator failed: {0}")]
pub struct RandomError(String);

fn random_hex(bytes: usize) -> Result<String, RandomError> {
    let mut buf = vec![0u8; bytes];
    getrandom::fill(&mut buf).map_err(|e| RandomError(e.to_string()))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// A fresh control token: 128 bits from the OS RNG, hex. Guards a run's control API (and is never
/// part of a run id, which travels in clear on the data plane).
pub fn new_token() -> Result<String, RandomError> {
    random_hex(16)
}

/// A fresh run id: 24 bits from the OS RNG, hex (6 characters, so that pod names stay short).
/// Names one set of workers; carries no secret.
pub fn new_run_id() -> Result<String, RandomError> {
    random_hex(3)
}

/// The run id workers of a run present to each other on the data plane: the job and the run.
pub fn data_plane_run_id(name: &str, run: &str) -> String {
    format!("{name}-{run}")
}

/// The job as its snapshots name it.
pub fn identity(namespace: &str, name: &str, spec: &StreamJobSpec) -> JobIdentity {
    JobIdentity {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        job_fingerprint: fingerprint(spec),
        layout: Some(layout(spec)),
    }
}

/// Why the state of a snapshot written by `snapshot` must not be restored into this job, if it
/// must not: another job's (unless spec.allowRestoreFromAnotherJob), or state whose layout
/// differs from the job's (unless spec.allowStateLayoutChange, and only for differences that can
/// be kept). Snapshots of older versions record no layout and are not compared. Pure.
pub fn restore_refusal(
    namespace: &str,
    name: &str,
    spec: &StreamJobSpec,
    url: &str,
    snapshot: &JobIdentity,
) -> Option<(Reason, String)> {
    if !snapshot.is(namespace, name) && !spec.allow_restore_from_another_job {
        return Some((
            Reason::SnapshotOfAnotherJob,
            format!(
                "{url} holds the state of StreamJob {}/{}, not of {namespace}/{name}; refusing to restore another job's history. Set spec.allowRestoreFromAnotherJob: true if this job is meant to continue it",
                snapshot.namespace, snapshot.name
            ),
        ));
    }
    let changes = snapshot.layout.as_ref()?.changes(&layout(spec));
    if changes.is_empty() || (spec.allow_state_layout_change && changes.iter().all(|c| c.keepable))
    {
        return None;
    }
    let what = changes
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ");
    let how = if changes.iter().all(|c| c.keepable) {
        "Revert the change, set spec.upgradeMode: stateless to start empty, or set spec.allowStateLayoutChange: true to keep the old state beside the new (its keys stay as they are)"
    } else {
        "Revert the change, or set spec.upgradeMode: stateless to start empty (state under another aggregate function or window cannot be kept)"
    };
    Some((
        Reason::StateLayoutChanged,
        format!(
            "the state in {url} was written by another version of this job's logic ({what}); restoring it would mix two histories. {how}"
        ),
    ))
}

/// Where the job's object-store sink publishes, if it has one.
pub fn sink_url(spec: &StreamJobSpec) -> Option<&str> {
    match spec.job.sink.sink_type {
        SinkType::ObjectStore => spec.job.sink.url.as_deref(),
        SinkType::Log | SinkType::Kafka => None,
    }
}

/// What a resume restores, and which newer snapshots it had to pass over.
#[derive(Debug, Default)]
pub struct Restorable {
    /// The snapshot to restore, if any.
    pub url: Option<String>,
    /// The job identity its manifest records, when it is one of the job's own snapshots (read
    /// while looking for it; `None` for spec.restoreFrom).
    pub job: Option<JobIdentity>,
    /// Snapshots of the job's current history newer than `url` that cannot be restored (a
    /// manifest that cannot be used, a state file missing or of another size; never deleted;
    /// reported in a condition and an Event), newest first.
    pub skipped: Vec<snapshot::UnreadableSnapshot>,
}

/// What a run restores when it resumes the job's own history: the newest of the job's
/// snapshots under its key-group count after the history a restore replaced
/// ([`crate::snapshot::newest_snapshot`], passing over newer ones whose manifest is corrupt),
/// else `spec.restoreFrom`, else nothing.
///
/// `unrestorable`: snapshots (by URL, with why) that a restore found it cannot restore (a
/// block that does not match its checksum): passed over like those the listing finds lacking.
pub async fn latest_restorable(
    spec: &StreamJobSpec,
    storage: &str,
    namespace: &str,
    name: &str,
    max_parallelism: u32,
    replaced_up_to: Option<u64>,
    unrestorable: &BTreeMap<String, String>,
) -> Result<Restorable, CoordinatorError> {
    let newest = crate::snapshot::newest_snapshot_except(
        storage,
        namespace,
        name,
        Some(max_parallelism),
        replaced_up_to,
        unrestorable,
    )
    .await?;
    let (url, job) = match newest.found {
        Some((url, info)) => (Some(url), Some(info.job)),
        None => (spec.restore_from.clone(), None),
    };
    Ok(Restorable {
        url,
        job,
        skipped: newest.skipped,
    })
}

/// Where the Rewriting step of a key-group change writes: the job's next snapshot id, as a
/// savepoint (so that a resume before the new run's first checkpoint finds it as the job's
/// newest snapshot under the new count).
pub async fn rewrite_target(
    storage: &str,
    ns: &str,
    name: &str,
) -> Result<String, CoordinatorError> {
    let (store, base) = snapshot::open_store(storage)?;
    let job_dir = snapshot::job_dir(&base, ns, name);
    let id = crate::snapshot::next_snapshot_id(store.as_ref(), &job_dir).await?;
    Ok(crate::snapshot::snapshot_url(
        storage,
        ns,
        name,
        snapshot::SnapshotKind::Savepoint,
        id,
    ))
}

/// Rewrites savepoint `source` into `target` under `groups` key groups at `parallelism`, with
/// `memory` bytes of budget and spill files in `spill` (the system temp directory if `None`):
/// the Rewriting step of a key-group change. `Ok(None)`: the target had already committed (a
/// restarted orchestrator; its verification follows anyway).
pub async fn rewrite_savepoint(
    source: &str,
    target: &str,
    groups: u32,
    parallelism: u32,
    memory: usize,
    spill: Option<std::path::PathBuf>,
) -> Result<Option<crate::offline::RewriteReport>, crate::offline::ToolError> {
    let mut opts = crate::offline::RewriteOptions::new(groups);
    opts.parallelism = Some(parallelism);
    opts.memory_budget = memory;
    opts.temp_dir = spill;
    match crate::offline::rewrite::rewrite(source, target, opts).await {
        Ok(report) => Ok(Some(report)),
        Err(crate::offline::ToolError::TargetExists { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Verifies a rewritten savepoint down to every key and compares it with its source
/// ([`check_rewrite`](super::ceiling::check_rewrite)): the VerifyingRewrite step. What was
/// checked, or why it must not be restored.
pub async fn verify_rewrite(
    source: &str,
    target: &str,
    groups: u32,
    parallelism: u32,
) -> Result<String, String> {
    let src = snapshot::open_snapshot(source)
        .await
        .map_err(|e| format!("reading the source savepoint: {e}"))?
        .2;
    let loc = crate::offline::open_location(target).map_err(|e| e.to_string())?;
    let outcome = crate::offline::verify_keys(&loc)
        .await
        .map_err(|e| e.to_string())?;
    if !outcome.ok() {
        return Err(outcome.problems.join("; "));
    }
    let dst = snapshot::open_snapshot(target)
        .await
        .map_err(|e| e.to_string())?
        .2;
    let decoded: u64 = outcome.files.iter().map(|f| f.keys_checked).sum();
    super::ceiling::check_rewrite(&src, &dst, groups, parallelism, decoded)
}

/// What pre-staging a run's new workers did ([`prestage`]).
#[derive(Debug)]
pub struct Prestaged {
    /// The checkpoint they loaded last (the stop checkpoint builds on it).
    pub base: String,
    /// What each loaded, bytes summed over every round, in subtask order.
    pub loaded: Vec<crate::runtime::protocol::StartResponse>,
    /// How long the first load and then each catch-up round took (what
    /// [`crate::runtime::prestage::CatchUp::again_after`] decided on).
    pub rounds: Vec<std::time::Duration>,
    /// Checkpoints of the running job taken for the pre-stage, in order (for the caller's
    /// records).
    pub checkpoints: Vec<crate::orchestrator::coordinator::Completed>,
}

impl Prestaged {
    /// Bytes the new workers read in all.
    pub fn loaded_bytes(&self) -> u64 {
        self.loaded.iter().map(|r| r.bytes_read).sum()
    }

    /// Catch-up rounds after the first load.
    pub fn catch_up_rounds(&self) -> u32 {
        u32::try_from(self.rounds.len().saturating_sub(1)).unwrap_or(u32::MAX)
    }
}

/// Pre-stages the workers `new` coordinates (see [`crate::runtime::prestage`]) beside the
/// running job that `old` coordinates, the same way on every platform: they load their key
/// groups from the job's newest committed checkpoint under `groups` key groups (after
/// `replaced_up_to`, the history a restore replaced; the running job takes one first when its
/// newest snapshot is not a checkpoint), then, while `catch_up` says so, the running job takes an
/// incremental checkpoint and they read only its delta (the rounds' durations decide:
/// [`crate::runtime::prestage::CatchUp::again_after`]). `template` is the new run's start
/// request (its `restore_from` is set here); each load may take `timeout`, each catch-up
/// checkpoint `checkpoint_timeout`.
#[allow(clippy::too_many_arguments)]
pub async fn prestage(
    checkpoint_timeout: std::time::Duration,
    (storage, namespace, name): (&str, &str, &str),
    groups: u32,
    replaced_up_to: Option<u64>,
    old: &mut Coordinator,
    new: &Coordinator,
    template: &StartRequest,
    catch_up: crate::runtime::prestage::CatchUp,
    timeout: std::time::Duration,
) -> Result<Prestaged, CoordinatorError> {
    use crate::snapshot::SnapshotKind;
    let newest =
        crate::snapshot::newest_snapshot(storage, namespace, name, Some(groups), replaced_up_to)
            .await?
            .found;
    let mut checkpoints = Vec::new();
    let mut base = match newest {
        Some((url, info)) if info.kind == SnapshotKind::Checkpoint => url,
        _ => {
            let c = old
                .snapshot(SnapshotKind::Checkpoint, false, checkpoint_timeout)
                .await?;
            let url = c.url.clone();
            checkpoints.push(c);
            url
        }
    };
    let mut request = template.clone();
    request.restore_from = Some(base.clone());
    let round = std::time::Instant::now();
    let mut loaded = new.prestage(&request, timeout).await?;
    let mut rounds = vec![round.elapsed()];
    while catch_up.again_after(&rounds) {
        let round = std::time::Instant::now();
        let c = old
            .snapshot(SnapshotKind::Checkpoint, false, checkpoint_timeout)
            .await?;
        request.restore_from = Some(c.url.clone());
        let more = new.prestage(&request, timeout).await?;
        for (l, m) in loaded.iter_mut().zip(more) {
            l.bytes_read += m.bytes_read;
        }
        rounds.push(round.elapsed());
        tracing::debug!(
            round = rounds.len() - 1,
            ms = round.elapsed().as_millis() as u64,
            delta_bytes = c.manifest.written_bytes(),
            "catch-up round"
        );
        base = c.url.clone();
        checkpoints.push(c);
    }
    Ok(Prestaged {
        base,
        loaded,
        rounds,
        checkpoints,
    })
}

/// The snapshots a resume passed over, each with why: `chk-7 (state file ... is missing); ...`.
/// Pure.
pub fn skipped_names(skipped: &[snapshot::UnreadableSnapshot]) -> String {
    skipped
        .iter()
        .map(|u| format!("{}{} ({})", u.kind.dir_prefix(), u.id, u.error))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Why restoring snapshot `id` of this job (at `url`) must not go ahead: the sink `sink` has
/// published the output of snapshots up to `published` > `id`, which the records after `id`
/// would publish again, and spec.allowRepublishingOutput is not set. Pure.
pub fn going_back_refusal(
    url: &str,
    id: u64,
    published: Option<u64>,
    sink: &str,
    spec: &StreamJobSpec,
) -> Option<(Reason, String)> {
    let newest = published.filter(|p| *p > id)?;
    if spec.allow_republishing_output {
        return None;
    }
    Some((
        Reason::OutputWouldRepeat,
        format!(
            "restoring {url} (snapshot {id}) would go back past sink output already published: {sink} holds the output of snapshots up to {newest}, and the records after snapshot {id} would be processed again and their results published again (readers would see the results of snapshots {} to {newest} twice). The job does not go back by itself: restore a snapshot at or after {newest} (or the lost files of the one passed over), or set spec.allowRepublishingOutput: true to go back anyway",
            id + 1
        ),
    ))
}

/// What a condition and an Event say about snapshots a resume passed over. Pure.
pub fn skipped_message(skipped: &[snapshot::UnreadableSnapshot], restored: Option<&str>) -> String {
    let names = skipped_names(skipped);
    format!(
        "passed over {} that cannot be restored: {names}; restored {} instead. Nothing was deleted: check the bad snapshot with `keyshift savepoint verify`, and dispose of it once it is no longer needed",
        keyshift_core::text::count(skipped.len() as u64, "snapshot"),
        restored.unwrap_or("nothing")
    )
}

/// The coordinator of a run: snapshots in `storage`, the job's retention, its sink attached (so
/// every committed snapshot's output is published, on every platform). `sink_credentials`: what
/// the publisher of an exactly-once Kafka sink logs in with (the platform reads them,
/// `port::Workers::kafka_credentials`; [`sink_credentials_from_env`] off any platform).
pub async fn coordinator(
    spec: &StreamJobSpec,
    storage: &str,
    identity: JobIdentity,
    assignment: Assignment,
    workers: Vec<WorkerEndpoint>,
    token: String,
    sink_credentials: &crate::job::kafka::Credentials,
) -> Result<Coordinator, CoordinatorError> {
    #[cfg(feature = "kafka")]
    let job = (identity.namespace.clone(), identity.name.clone());
    let coordinator = Coordinator::new(
        storage,
        identity,
        assignment,
        workers,
        token,
        spec.state.retained_checkpoints.max(1) as usize,
    )
    .await?
    .with_sink(sink_url(spec))?;
    // An exactly-once Kafka sink: the workers stage, the coordinator produces after each commit.
    #[cfg(feature = "kafka")]
    if let Some(k) = &spec.job.sink.kafka
        && crate::job::kafka::sink::stages(&spec.job.sink)
    {
        let publisher =
            crate::job::kafka::sink::KafkaPublisher::from_spec(k, &job.0, &job.1, sink_credentials);
        return Ok(coordinator.with_kafka_sink(publisher));
    }
    #[cfg(not(feature = "kafka"))]
    let _ = sink_credentials;
    Ok(coordinator)
}

/// The Kafka sink's credentials a coordinator needs ([`coordinator`]), from this process's
/// environment under the workers' names (`keyshift local` and its harness pass the same
/// environment to their workers). None when the job has no Kafka sink with credentials.
pub fn sink_credentials_from_env(
    spec: &StreamJobSpec,
) -> Result<crate::job::kafka::Credentials, crate::job::kafka::MissingCredential> {
    let creds = spec
        .job
        .sink
        .kafka
        .as_ref()
        .and_then(|k| k.credentials.as_ref());
    crate::job::kafka::Credentials::from_env(crate::job::kafka::Role::Sink, creds)
}

/// Whether the job's coordinator publishes sink output after each commit (an object-store sink,
/// or an exactly-once Kafka sink), so that the `SinkPublished` condition applies.
pub fn publishes_sink(spec: &StreamJobSpec) -> bool {
    sink_url(spec).is_some() || crate::job::kafka::sink::stages(&spec.job.sink)
}

/// What a run's workers are started with (the coordinator fills in each subtask and the peers).
pub struct StartPlan<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub spec: &'a StreamJobSpec,
    pub assignment: Assignment,
    pub storage: &'a str,
    pub restore_from: Option<String>,
    /// The run's id (see [`new_run_id`]).
    pub run: &'a str,
    /// Opaque bytes kept with each key's state (benchmarks; 0 otherwise).
    pub state_payload_bytes: usize,
}

impl StartPlan<'_> {
    /// The start request template.
    /// The request, with a fresh data-plane secret for the run.
    pub fn request(&self) -> Result<StartRequest, RandomError> {
        Ok(StartRequest {
            protocol: crate::runtime::protocol::PROTOCOL_VERSION,
            namespace: self.namespace.to_owned(),
            name: self.name.to_owned(),
            job: self.spec.job.clone(),
            subtask: 0,
            parallelism: self.assignment.parallelism(),
            max_parallelism: self.assignment.max_parallelism(),
            peers: Vec::new(),
            storage: self.storage.to_owned(),
            restore_from: self.restore_from.clone(),
            allow_non_restored_state: self.spec.allow_non_restored_state,
            state_payload_bytes: self.state_payload_bytes,
            run_id: data_plane_run_id(self.name, self.run),
            data_secret: crate::runtime::protocol::RunSecret(new_token()?),
            incremental: crate::runtime::incremental::ChainSettings::from_spec(
                self.spec.state.incremental_checkpoints.as_ref(),
            ),
            // Set by the coordinator's start, which knows how long it waits.
            ready_timeout_secs: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pods carry the spec hash in a label and snapshots the fingerprint: both stay what they
    /// were for the same spec.
    #[test]
    fn the_spec_hash_and_the_job_fingerprint_keep_their_values() {
        let spec = job("image: registry.example/keyshift:1.2");
        assert_eq!(
            crate::orchestrator::settings::spec_hash(&spec),
            "13cc790f97ee5ddd"
        );
        assert_eq!(fingerprint(&spec), "99bbc2078d3c77bb");
    }

    #[test]
    fn tokens_and_run_ids_are_fresh_hex_and_run_ids_carry_no_token() {
        let a = new_token().unwrap();
        let b = new_token().unwrap();
        assert_eq!(a.len(), 32);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b, "two tokens from the OS RNG were equal");
        let run = new_run_id().unwrap();
        assert_eq!(run.len(), 6);
        let wire = data_plane_run_id("job", &run);
        assert!(
            !wire.contains(&a),
            "the data-plane run id carries the token"
        );
        assert_eq!(wire, format!("job-{run}"));
    }

    fn job(extra: &str) -> StreamJobSpec {
        serde_yaml::from_str(&format!(
            "replicas: 2\njob: {{source: {{generator: {{partitions: 2}}}}, key: {{field: user}}, aggregation: {{function: count}}}}\n{extra}"
        ))
        .unwrap()
    }

    #[test]
    fn a_restore_behind_published_output_is_refused_unless_opted_in() {
        let url = "s3://b/ns/j/savepoints/sp-4";
        let spec = job("");
        // Nothing published, or nothing beyond the snapshot: it goes ahead.
        for published in [None, Some(2), Some(4)] {
            assert_eq!(
                going_back_refusal(url, 4, published, "s3://b/out", &spec),
                None
            );
        }
        let (reason, message) = going_back_refusal(url, 4, Some(9), "s3://b/out", &spec).unwrap();
        assert_eq!(reason, Reason::OutputWouldRepeat);
        for needle in [
            url,
            "s3://b/out",
            "snapshots 5 to 9 twice",
            "spec.allowRepublishingOutput: true",
        ] {
            assert!(message.contains(needle), "{needle}: {message}");
        }
        let allowed = job("allowRepublishingOutput: true");
        assert_eq!(
            going_back_refusal(url, 4, Some(9), "s3://b/out", &allowed),
            None
        );
    }

    #[test]
    fn a_restore_is_refused_for_another_job_or_another_layout_unless_opted_in() {
        let url = "s3://b/ns/j/savepoints/sp-1";
        let spec = job("");
        let own = identity("ns", "j", &spec);
        assert_eq!(restore_refusal("ns", "j", &spec, url, &own), None);
        // Snapshots of older versions record no layout.
        let old = JobIdentity {
            layout: None,
            ..own.clone()
        };
        assert_eq!(
            restore_refusal("ns", "j", &job("allowStateLayoutChange: false"), url, &old),
            None
        );
        // Another job, or the same name in another namespace.
        for (ns, name) in [("ns", "other"), ("team-b", "j")] {
            let (reason, message) = restore_refusal(ns, name, &spec, url, &own).unwrap();
            assert_eq!(reason, Reason::SnapshotOfAnotherJob);
            assert!(
                message.contains("ns/j") && message.contains("allowRestoreFromAnotherJob"),
                "{message}"
            );
            let allowed = job("allowRestoreFromAnotherJob: true");
            assert_eq!(
                restore_refusal(ns, name, &allowed, url, &identity("ns", "j", &allowed)),
                None
            );
        }
        // Another key field or type: refused, keepable with the opt-in.
        let mut changed = spec.clone();
        changed.job.key.as_mut().expect("a key").field = "account".into();
        changed.job.key.as_mut().expect("a key").key_type = keyshift_core::keygroup::KeyType::Long;
        let (reason, message) = restore_refusal("ns", "j", &changed, url, &own).unwrap();
        assert_eq!(reason, Reason::StateLayoutChanged);
        for needle in [
            r#"spec.job.key.field is "user" in the snapshot, "account" in the job"#,
            r#"spec.job.key.type is "string" in the snapshot, "long" in the job"#,
            "allowStateLayoutChange: true",
            "upgradeMode: stateless",
            url,
        ] {
            assert!(message.contains(needle), "{needle:?} in {message}");
        }
        changed.allow_state_layout_change = true;
        assert_eq!(restore_refusal("ns", "j", &changed, url, &own), None);
        // Another function or window: never kept.
        for extra in ["", "allowStateLayoutChange: true"] {
            let mut sum = job(extra);
            sum.job
                .aggregation
                .as_mut()
                .expect("an aggregation")
                .function = crate::crd::AggregateFunction::Sum;
            sum.job.aggregation.as_mut().expect("an aggregation").field = Some("amount".into());
            let (_, message) = restore_refusal("ns", "j", &sum, url, &own).unwrap();
            assert!(
                message.contains("spec.job.aggregation.function")
                    && message.contains("cannot be kept"),
                "{message}"
            );
            let mut windowed = job(extra);
            windowed.job.window = Some(crate::crd::WindowSpec {
                size: "1m".into(),
                max_out_of_orderness: None,
            });
            let (_, message) = restore_refusal("ns", "j", &windowed, url, &own).unwrap();
            assert!(
                message
                    .contains("spec.job.window.size is unset in the snapshot, 60000 ms in the job"),
                "{message}"
            );
        }
    }
}
