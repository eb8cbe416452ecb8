//! The coordinator's tests, and helpers other modules' tests use (`identity`, `commit`).

use super::start::check_partition_lists;
use super::*;
use crate::job::staging::{Committed, StagingSink, WriterId};
use crate::sink::testing::Flaky;
use crate::snapshot::restore_source;

#[test]
fn a_start_whose_workers_listed_different_partitions_is_refused_naming_both_lists() {
    let names = |n: usize| -> Vec<String> { (0..n).map(|i| format!("part-{i}")).collect() };
    let accepted = |lists: Vec<Option<Vec<String>>>| -> Vec<StartAccepted> {
        lists
            .into_iter()
            .map(|l| StartAccepted {
                source_partitions: l.map(|l| PartitionList::of(&l)),
                ..StartAccepted::default()
            })
            .collect()
    };
    // Generator runs (no lists) and file runs that agree start.
    assert!(check_partition_lists(&accepted(vec![None, None])).is_ok());
    assert!(check_partition_lists(&[]).is_ok());
    assert!(check_partition_lists(&accepted(vec![Some(names(3)); 3])).is_ok());
    // One more file, the same count with another name, or no list at all: refused.
    let e = check_partition_lists(&accepted(vec![
        Some(names(3)),
        Some(names(3)),
        Some(names(4)),
    ]))
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with("the workers listed different source partitions: subtask 0 3 files")
            && e.contains("subtask 2 4 files"),
        "{e}"
    );
    let mut renamed = names(3);
    renamed[1] = "part-1b".into();
    let e = check_partition_lists(&accepted(vec![Some(names(3)), Some(renamed)]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("subtask 1 3 files"), "{e}");
    let e = check_partition_lists(&accepted(vec![Some(names(2)), None]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("subtask 1 no partition list"), "{e}");
}

#[test]
fn start_progress_sums_what_each_worker_accepted_reported_and_restored() {
    let accepted = [(100, 4), (60, 3), (40, 2)].map(|(bytes_total, groups_total)| StartAccepted {
        bytes_total,
        groups_total,
        source_partitions: None,
    });
    let none = StartProgress::sum(&accepted, &[None; 3], &[None, None, None]);
    assert_eq!(
        none,
        StartProgress {
            bytes_read: 0,
            bytes_total: 200,
            groups_read: 0,
            groups_total: 9,
            subtasks_done: 0,
            subtasks: 3,
        }
    );
    let reported = [
        Some(RestoreProgress {
            bytes_read: 50,
            bytes_total: 100,
            groups_read: 2,
            groups_total: 4,
        }),
        None,
        None,
    ];
    let done = [
        None,
        Some(StartResponse {
            groups_restored: 3,
            keys_restored: 10,
            bytes_read: 60,
            restore_ms: 1,
            ..Default::default()
        }),
        None,
    ];
    assert_eq!(
        StartProgress::sum(&accepted, &reported, &done),
        StartProgress {
            bytes_read: 110,
            bytes_total: 200,
            groups_read: 5,
            groups_total: 9,
            subtasks_done: 1,
            subtasks: 3,
        }
    );
}

pub(crate) fn identity(name: &str) -> JobIdentity {
    JobIdentity {
        namespace: "team".into(),
        name: name.into(),
        job_fingerprint: "f".into(),
        layout: None,
    }
}

fn assignment() -> Assignment {
    Assignment::new(1, 8).unwrap()
}

/// Writes and commits snapshot `id` of `job` (one subtask, 8 key groups) in `storage`;
/// returns its URL.
pub(crate) async fn commit(
    storage: &str,
    job: &JobIdentity,
    kind: SnapshotKind,
    id: u64,
) -> String {
    let (store, base) = snapshot::open_store(storage).unwrap();
    let dir = snapshot::snapshot_dir(
        &snapshot::job_dir(&base, &job.namespace, &job.name),
        kind,
        id,
    );
    let blocks = (0..8).map(|g| (g, bytes::Bytes::from_static(b"x"), 1));
    let ack = snapshot::write_subtask_state(store.clone(), &dir, assignment(), 0, blocks)
        .await
        .unwrap();
    let meta = SnapshotMeta {
        job: job.clone(),
        snapshot_id: id,
        kind,
        completed_at: Timestamp::now(),
        state_schema: crate::job::AGG_SCHEMA.into(),
        source_positions: Default::default(),
        source_partitions: Default::default(),
        watermark: None,
    };
    let manifest = Manifest::assemble(meta, assignment(), vec![ack]).unwrap();
    snapshot::commit_manifest(store.as_ref(), &dir, &manifest)
        .await
        .unwrap();
    snapshot_url(storage, &job.namespace, &job.name, kind, id)
}

/// Stages one row (value `id`) for snapshot `id`, as subtask 0 of 1 would.
async fn stage(sink: &Flaky, id: u64) {
    let mut staging = StagingSink::new(WriterId {
        subtask: 0,
        parallelism: 1,
    });
    staging.emit(&[crate::job::ResultRow {
        key: crate::job::RecordKey::int(1),
        window: None,
        value: id as i64,
    }]);
    let out = staging.on_barrier(id, Committed::Through(0)).unwrap();
    crate::sink::stage(sink, &Path::from("out"), &out)
        .await
        .unwrap();
}

/// The published part of snapshot `id`, if any.
async fn published(sink: &Flaky, id: u64) -> Option<String> {
    let path = Path::from(format!("out/snap-{id}/part-0-of-1.jsonl"));
    let bytes = sink.get(&path).await.ok()?.bytes().await.ok()?;
    Some(String::from_utf8_lossy(&bytes).into_owned())
}

async fn coordinator(storage: &str, job: &str, sink: &Arc<Flaky>) -> Coordinator {
    Coordinator::new(
        storage,
        identity(job),
        assignment(),
        Vec::new(),
        "token".into(),
        2,
    )
    .await
    .unwrap()
    .with_sink_store(sink.clone(), Path::from("out"))
}

fn row(id: u64) -> String {
    format!("{{\"key\":1,\"value\":{id}}}\n")
}

#[tokio::test]
async fn a_failed_publish_is_retried_after_each_later_commit_in_id_order() {
    let sink = Arc::new(Flaky::default());
    let mut c = coordinator("memory://coord-retry", "retry", &sink).await;
    for id in 1..=3 {
        stage(&sink, id).await;
    }
    sink.fail_puts("out/snap-1/", 2);
    c.committed(1).await;
    let backlog = c.publish_backlog();
    assert_eq!(backlog.pending, [1]);
    assert!(
        backlog
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("injected")),
        "{backlog:?}"
    );
    // Still failing: 2 waits behind 1, so no reader sees 2 before 1.
    c.committed(2).await;
    assert_eq!(c.publish_backlog().pending, [1, 2]);
    assert_eq!(published(&sink, 2).await, None);
    assert_eq!(sink.failures_left(), 0);
    // The store is back: the next commit publishes all three, once each.
    c.committed(3).await;
    assert_eq!(c.publish_backlog(), PublishBacklog::default());
    for id in 1..=3 {
        assert_eq!(published(&sink, id).await, Some(row(id)), "snapshot {id}");
    }
    assert_eq!(c.last_committed, 3);
    // An explicit retry with nothing pending does nothing.
    c.publish_pending().await.unwrap();
    assert!(!c.publish_backlog().is_behind());
}

#[tokio::test]
async fn ids_continue_above_storage_and_sink_and_the_newest_commit_is_known() {
    let storage = "memory://coord-ids";
    let job = identity("ids");
    commit(storage, &job, SnapshotKind::Checkpoint, 1).await;
    commit(storage, &job, SnapshotKind::Savepoint, 2).await;
    // An aborted checkpoint 3: a directory without a manifest.
    let (store, base) = snapshot::open_store(storage).unwrap();
    let orphan = snapshot::snapshot_dir(
        &snapshot::job_dir(&base, "team", "ids"),
        SnapshotKind::Checkpoint,
        3,
    );
    store
        .put(&orphan.join("state-0-of-1.bin"), b"x".to_vec().into())
        .await
        .unwrap();
    let sink = Arc::new(Flaky::default());
    let mut c = coordinator(storage, "ids", &sink).await;
    assert_eq!((c.next_id, c.last_committed), (4, 2));
    // The sink has output of ids this storage does not know (its storage was wiped).
    stage(&sink, 9).await;
    c.prepare().await.unwrap();
    assert_eq!(c.next_id, 10);
}

#[tokio::test]
async fn a_commit_in_doubt_is_resolved_before_the_next_trigger() {
    let storage = "memory://coord-doubt";
    let job = identity("doubt");
    let sink = Arc::new(Flaky::default());
    let mut c = coordinator(storage, "doubt", &sink).await;
    // 1 was written after all, 2 was not.
    commit(storage, &job, SnapshotKind::Checkpoint, 1).await;
    stage(&sink, 1).await;
    stage(&sink, 2).await;
    c.in_doubt.insert(1, SnapshotKind::Checkpoint);
    c.in_doubt.insert(2, SnapshotKind::Checkpoint);
    c.prepare().await.unwrap();
    assert!(c.in_doubt.is_empty());
    assert_eq!(c.last_committed, 1);
    assert_eq!(published(&sink, 1).await, Some(row(1)));
    assert_eq!(published(&sink, 2).await, None);
}

fn start_request(restore_from: Option<String>) -> StartRequest {
    StartRequest {
        protocol: keyshift_runtime::runtime::protocol::PROTOCOL_VERSION,
        namespace: "team".into(),
        name: "mine".into(),
        job: serde_yaml::from_str(
            "{source: {generator: {partitions: 1, keys: 1, seed: 1}}, key: {field: key}, aggregation: {function: count}}",
        )
        .unwrap(),
        subtask: 0,
        parallelism: 1,
        max_parallelism: 8,
        peers: Vec::new(),
        storage: String::new(),
        restore_from,
        allow_non_restored_state: false,
        state_payload_bytes: 0,
        run_id: "r".into(),
        data_secret: RunSecret("s".into()),
        incremental: Default::default(),
        ready_timeout_secs: None,
    }
}

#[tokio::test]
async fn a_start_publishes_what_it_restores_only_for_the_job_s_own_snapshot() {
    let storage = "memory://coord-restore";
    let mine = identity("mine");
    let sink = Arc::new(Flaky::default());
    // Ours: checkpoint 2 and savepoint 3 committed, never published (crash after commit);
    // checkpoint 4 staged but never committed.
    commit(storage, &mine, SnapshotKind::Checkpoint, 2).await;
    let own = commit(storage, &mine, SnapshotKind::Savepoint, 3).await;
    for id in [2, 3, 4] {
        stage(&sink, id).await;
    }
    // Another job's savepoint with id 4.
    let theirs = commit(storage, &identity("theirs"), SnapshotKind::Savepoint, 4).await;

    let c = coordinator(storage, "mine", &sink).await;
    c.start(&start_request(Some(theirs)), Duration::from_secs(1))
        .await
        .unwrap();
    for id in [2, 3, 4] {
        assert_eq!(published(&sink, id).await, None, "snapshot {id}");
    }
    c.start(&start_request(None), Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(published(&sink, 3).await, None);

    // Restoring our own savepoint publishes it and the committed checkpoint before it, not
    // the uncommitted 4; a failure is pending, not a failed start.
    sink.fail_puts("out/snap-2/", 1);
    c.start(&start_request(Some(own.clone())), Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(c.publish_backlog().pending, [2, 3]);
    c.start(&start_request(Some(own)), Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(c.publish_backlog(), PublishBacklog::default());
    assert_eq!(published(&sink, 2).await, Some(row(2)));
    assert_eq!(published(&sink, 3).await, Some(row(3)));
    assert_eq!(published(&sink, 4).await, None);
}

#[tokio::test]
async fn a_coordinator_catches_up_on_what_a_crashed_predecessor_left_unpublished() {
    let storage = "memory://coord-adopt";
    let job = identity("adopt");
    let sink = Arc::new(Flaky::default());
    for id in 1..=3 {
        commit(storage, &job, SnapshotKind::Checkpoint, id).await;
        stage(&sink, id).await;
    }
    stage(&sink, 4).await; // staged, not committed
    let before = coordinator(storage, "adopt", &sink).await;
    before.publish(1).await.unwrap();
    // The predecessor crashed after committing 2 and 3. Its successor adopts the workers
    // and publishes at once.
    let c = coordinator(storage, "adopt", &sink).await;
    sink.fail_puts("out/snap-3/", 1);
    let e = c.publish_committed().await.unwrap_err();
    assert!(e.to_string().contains("injected"), "{e}");
    assert_eq!(c.publish_backlog().pending, [3]);
    assert_eq!(published(&sink, 2).await, Some(row(2)));
    assert_eq!(
        c.publish_committed().await.unwrap(),
        PublishBacklog::default()
    );
    assert_eq!(published(&sink, 3).await, Some(row(3)));
    assert_eq!(published(&sink, 4).await, None);
    assert_eq!(
        c.publish_committed().await.unwrap(),
        PublishBacklog::default()
    );
}

#[tokio::test]
async fn the_first_commit_of_a_coordinator_publishes_what_an_earlier_one_left() {
    let storage = "memory://coord-first-commit";
    let job = identity("first");
    let sink = Arc::new(Flaky::default());
    for id in 1..=3 {
        commit(storage, &job, SnapshotKind::Checkpoint, id).await;
        stage(&sink, id).await;
    }
    coordinator(storage, "first", &sink)
        .await
        .publish(1)
        .await
        .unwrap();
    // Took over running workers without being told: its first commit (4) publishes 2 and
    // 3 with it, in id order.
    let mut c = coordinator(storage, "first", &sink).await;
    commit(storage, &job, SnapshotKind::Checkpoint, 4).await;
    stage(&sink, 4).await;
    sink.fail_puts("out/snap-2/", 1);
    c.committed(4).await;
    assert_eq!(c.publish_backlog().pending, [2, 3, 4]);
    assert_eq!(published(&sink, 3).await, None, "3 waits behind 2");
    commit(storage, &job, SnapshotKind::Checkpoint, 5).await;
    stage(&sink, 5).await;
    c.committed(5).await;
    assert_eq!(c.publish_backlog(), PublishBacklog::default());
    for id in 1..=5 {
        assert_eq!(published(&sink, id).await, Some(row(id)), "snapshot {id}");
    }
}

#[tokio::test]
async fn a_restore_from_outside_the_namespace_never_shows_the_storage_error() {
    let storage = "memory://restore-src/state";
    let own = format!("{storage}/team-a/j/savepoints/sp-9");
    let err = restore_source(&own, storage, "team-a").await.unwrap_err();
    assert!(
        err.contains("not found"),
        "own path: the storage's words help: {err}"
    );
    let foreign = format!("{storage}/team-b/j/savepoints/sp-9");
    let err = restore_source(&foreign, storage, "team-a")
        .await
        .unwrap_err();
    assert!(
        !err.contains("not found") && !err.contains("_manifest.json not"),
        "{err}"
    );
    assert!(
        err.contains("operator's log") && err.contains(&foreign),
        "{err}"
    );
}

/// Serves one HTTP answer: `head` (status line and headers), then `body` in 1 MiB writes.
async fn answer_once(head: String, body: Vec<u8>) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await.unwrap();
        let mut request = [0u8; 4096];
        let _ = conn.read(&mut request).await;
        let _ = conn.write_all(head.as_bytes()).await;
        for part in body.chunks(1 << 20) {
            if conn.write_all(part).await.is_err() {
                return;
            }
        }
    });
    format!("http://{addr}")
}

#[tokio::test]
async fn a_worker_answer_larger_than_the_bound_is_refused_unread() {
    let dir = tempfile::tempdir().unwrap();
    let storage = format!("file://{}", dir.path().display());
    let over = MAX_WORKER_ANSWER_BYTES + 1;
    // Declared too large: refused before anything is read.
    let declared = answer_once(
        format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {over}\r\n\r\n"
        ),
        b"{}".to_vec(),
    )
    .await;
    // Streamed without a length, past the bound.
    let streamed = answer_once(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n".to_owned(),
        vec![b' '; over as usize],
    )
    .await;
    for control in [declared, streamed] {
        let c = Coordinator::new(
            &storage,
            identity("big"),
            Assignment::new(1, 128).unwrap(),
            vec![WorkerEndpoint {
                control: control.clone(),
                data: "127.0.0.1:1".into(),
            }],
            "token".into(),
            2,
        )
        .await
        .unwrap();
        let e = c.status().await.expect_err("refused").to_string();
        assert!(
            e.contains("larger than") && e.contains("refused"),
            "{control}: {e}"
        );
    }
}

/// What a scripted worker does with one request.
#[derive(Clone)]
enum Scripted {
    /// Closes the connection without an answer.
    Drop,
    /// Answers this status at once.
    Answer(CheckpointStatus),
}

/// A worker that answers its requests in turn as `script` says (one connection each; the last
/// entry repeats), recording the request lines.
async fn scripted_worker(script: Vec<Scripted>) -> (String, Arc<std::sync::Mutex<Vec<String>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    tokio::spawn(async move {
        for n in 0.. {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            let mut request = [0u8; 4096];
            let read = conn.read(&mut request).await.unwrap_or(0);
            let line = String::from_utf8_lossy(&request[..read])
                .lines()
                .next()
                .unwrap_or_default()
                .to_owned();
            log.lock().unwrap().push(line);
            match script[n.min(script.len() - 1)].clone() {
                Scripted::Drop => drop(conn),
                Scripted::Answer(status) => {
                    let body = serde_json::to_vec(&status).unwrap();
                    let head = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        body.len()
                    );
                    let _ = conn.write_all(head.as_bytes()).await;
                    let _ = conn.write_all(&body).await;
                }
            }
        }
    });
    (format!("http://{addr}"), seen)
}

async fn one_worker_coordinator(storage: &str, control: String) -> Coordinator {
    Coordinator::new(
        storage,
        identity("acks"),
        Assignment::new(1, 128).unwrap(),
        vec![WorkerEndpoint {
            control,
            data: "127.0.0.1:1".into(),
        }],
        "token".into(),
        2,
    )
    .await
    .unwrap()
}

/// A subtask's acknowledgement is long-polled (`waitMs` on every request); one failed request
/// is asked again, a second in a row fails the wait; a worker that answers `pending` at once (an
/// older one, which does not hold the poll) is asked again; a deadline passed is no answer.
#[tokio::test]
async fn acknowledgements_are_long_polled_and_survive_one_failed_request() {
    let dir = tempfile::tempdir().unwrap();
    let storage = format!("file://{}", dir.path().display());
    let failed = || {
        Scripted::Answer(CheckpointStatus::Failed {
            error: "disk full".into(),
        })
    };
    let pending = Scripted::Answer(CheckpointStatus::Pending);
    let far = Instant::now() + Duration::from_secs(30);

    // One dropped request, then the worker's answer: the answer counts.
    let (url, seen) = scripted_worker(vec![Scripted::Drop, failed()]).await;
    let c = one_worker_coordinator(&storage, url).await;
    match c.await_ack(0, 7, far).await {
        Err(CoordinatorError::SnapshotFailed { id, subtask, error }) => {
            assert_eq!((id, subtask, error.as_str()), (7, 0, "disk full"));
        }
        other => panic!("{other:?}"),
    }
    let lines = seen.lock().unwrap().clone();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(
        lines
            .iter()
            .all(|l| l.starts_with("GET /v1/checkpoints/7?waitMs=")),
        "{lines:?}"
    );

    // Two in a row: the transport's error.
    let (url, seen) = scripted_worker(vec![Scripted::Drop]).await;
    let c = one_worker_coordinator(&storage, url).await;
    match c.await_ack(0, 7, far).await {
        Err(CoordinatorError::Worker { subtask: 0, .. }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(seen.lock().unwrap().len(), 2);

    // Pending at once, twice, then done: asked three times.
    let (url, seen) = scripted_worker(vec![pending.clone(), pending.clone(), failed()]).await;
    let c = one_worker_coordinator(&storage, url).await;
    assert!(matches!(
        c.await_ack(0, 7, far).await,
        Err(CoordinatorError::SnapshotFailed { .. })
    ));
    assert_eq!(seen.lock().unwrap().len(), 3);

    // Pending until the deadline: no acknowledgement, and no error.
    let (url, _) = scripted_worker(vec![pending]).await;
    let c = one_worker_coordinator(&storage, url).await;
    let soon = Instant::now() + Duration::from_millis(200);
    assert!(matches!(c.await_ack(0, 7, soon).await, Ok(None)));
}
