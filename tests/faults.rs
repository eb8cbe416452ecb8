//! Storage faults around snapshots, with real components: real `keyshift worker` processes and
//! the real coordinator (`LocalJob`), real snapshots on S3 (the test server of
//! `hack/s3-server.sh`, reached through a fault-injecting relay) and on `file://` (a small
//! tmpfs filled to the last byte).
//!
//! * Restore under object-store faults: transient errors and cut-off reads are retried and the
//!   start succeeds; persistent errors, cut-off or short reads and corrupted bytes fail the start
//!   with an error naming the file, and no worker runs with part of the state; with the faults
//!   gone the same snapshot restores and every key is exact.
//! * Verify under the same faults (`snapshot::verify`, the operator's Verifying step, and
//!   `keyshift savepoint verify`): never a good result from a failed or short read; the error
//!   names the file.
//! * A full disk during a checkpoint: the checkpoint fails, the job keeps running, the last good
//!   snapshot stays intact and restorable, nothing uncommitted counts as committed; once there is
//!   space again the next checkpoint commits and every key is exact.
//!
//! Every exactness check compares a committed snapshot's state with the result computed from
//! the generator's definition (`job::expected_results`) at the snapshot's source positions.

mod faults_support;
mod snapshot_support;

use faults_support::{Fault, FaultyS3, Tmpfs, flip_digit_after};
use keyshift::crd::StreamJob;
use keyshift::job::{self, Expected};
use keyshift::keygroup::Key;
use keyshift::local::LocalJob;
use keyshift::runtime::protocol::WorkerState;
use keyshift::snapshot;
use object_store::ObjectStoreExt;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_keyshift"))
}

/// A keyed count over a generator: 6 partitions, 3000 keys, 128 key groups.
fn count_job(name: &str, replicas: u32) -> StreamJob {
    serde_yaml::from_str(&format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {{name: {name}, namespace: test}}
spec:
  replicas: {replicas}
  maxParallelism: 128
  job:
    source:
      generator: {{partitions: 6, keys: 3000, seed: 11, recordsPerSecond: 5000}}
    key: {{field: key, type: string}}
    aggregation: {{function: count}}
  state:
    checkpointInterval: 1h
    retainedCheckpoints: 2
"
    ))
    .expect("test manifest parses")
}

/// The relay every S3 test of this process goes through, or `None` when no S3 test server is
/// configured. `AWS_ENDPOINT` of this process (and so of the workers and tools it starts) is
/// pointed at the relay the first time.
fn s3_relay(test: &str) -> Option<&'static FaultyS3> {
    static RELAY: OnceLock<Option<FaultyS3>> = OnceLock::new();
    let relay = RELAY
        .get_or_init(|| {
            std::env::var("KEYSHIFT_TEST_S3_URL").ok()?;
            let upstream = std::env::var("AWS_ENDPOINT").ok()?;
            let relay = FaultyS3::start(upstream.trim_start_matches("http://"));
            // SAFETY: set once, before this process opens any S3 store or starts any worker (every
            // S3 test calls this first); the other tests read no AWS variable.
            unsafe { std::env::set_var("AWS_ENDPOINT", relay.url()) };
            Some(relay)
        })
        .as_ref();
    if relay.is_none() {
        eprintln!(
            "SKIPPED {test}: set KEYSHIFT_TEST_S3_URL and AWS_ENDPOINT (eval \"$(hack/s3-server.sh start)\"; hack/test.sh starts it)"
        );
    }
    relay
}

/// A storage URL of its own on the S3 test server; the tag (unique per test and process) is in
/// every object path, so faults can be aimed at one test's objects.
fn s3_storage(tag: &str) -> String {
    let s3 = std::env::var("KEYSHIFT_TEST_S3_URL").expect("KEYSHIFT_TEST_S3_URL");
    format!("{}/{tag}", s3.trim_end_matches('/'))
}

/// Every key's count in a committed snapshot (read through the real restore path) and its
/// source positions.
async fn snapshot_state(url: &str) -> (BTreeMap<Key, i64>, BTreeMap<u32, u64>) {
    let s = snapshot_support::read_state(url).await;
    (s.scalars(), s.positions)
}

/// Asserts that the snapshot at `url` holds exactly the oracle's counts at its positions.
async fn assert_exact(spec: &StreamJob, url: &str) {
    let (state, positions) = snapshot_state(url).await;
    assert_eq!(
        positions.len(),
        6,
        "every partition has a position in {url}"
    );
    assert!(
        positions.values().all(|p| *p > 0),
        "every partition advanced: {positions:?}"
    );
    let Expected::Global(expected) =
        job::expected_results(&spec.spec.job, &positions).expect("oracle runs")
    else {
        panic!("expected a global aggregate");
    };
    assert_eq!(state.len(), expected.len(), "key count in {url}");
    assert!(
        state == expected,
        "state in {url} differs from the exact result"
    );
    // A count: the total equals the records read, none lost or counted twice.
    assert_eq!(
        state.values().sum::<i64>() as u64,
        positions.values().sum::<u64>()
    );
}

/// Asserts that a start failed without leaving anything running.
fn assert_not_running(local: &LocalJob, what: &str) {
    assert_eq!(
        local.parallelism(),
        None,
        "{what}: no run after a failed start"
    );
    assert!(
        local.worker_pids().is_empty(),
        "{what}: every worker of the failed start is gone"
    );
}

/// Restores through transient errors, slow answers and a couple of cut-off reads; refuses
/// persistent errors, cut-off and short reads and corrupted bytes (naming the file, nothing left
/// running, though the other subtask had read its part); then, with the faults gone, restores
/// the same savepoint and is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_under_object_store_faults_is_exact_or_refused() {
    let test = "restore_under_object_store_faults";
    let Some(relay) = s3_relay(test) else { return };
    let tag = format!("faults-restore-{}", std::process::id());
    let logs = tempfile::tempdir().expect("temp dir");
    let spec = count_job("restore", 2);
    let mut local = LocalJob::new(&spec, s3_storage(&tag), bin(), logs.path().to_owned())
        .await
        .expect("job prepares");
    local.launch(2, None).await.expect("launch");
    tokio::time::sleep(Duration::from_millis(600)).await;
    let sp = local.shutdown().await.expect("stop with a savepoint");
    assert_exact(&spec, &sp.url).await;
    let total_bytes = sp.manifest.stats.total_bytes;
    let total_keys = sp.manifest.stats.total_keys;
    let sp_dir = format!("/savepoints/sp-{}/", sp.id);
    let file1 = [tag.as_str(), sp_dir.as_str(), "state-1-of-2.bin"];
    let file0 = [tag.as_str(), sp_dir.as_str(), "state-0-of-2.bin"];
    let state_files = [tag.as_str(), sp_dir.as_str(), "/state-"];
    let restored_everything = |r: &keyshift::local::LaunchReport, what: &str| {
        assert_eq!(
            r.bytes_read(),
            total_bytes,
            "{what}: every state byte read once"
        );
        let keys: u64 = r.responses.iter().map(|s| s.keys_restored).sum();
        assert_eq!(keys, total_keys, "{what}: every key restored");
    };

    // Transient errors (503 three times, then 500 twice) on one state file, and twice on the
    // manifest: retried, the start succeeds at a new parallelism (two new subtasks read that
    // file).
    let manifest = [tag.as_str(), sp_dir.as_str(), "_manifest.json"];
    let e503 = relay.inject("GET", &file1, Fault::Status(503), 3);
    let e500 = relay.inject("GET", &file1, Fault::Status(500), 2);
    let manifest503 = relay.inject("GET", &manifest, Fault::Status(503), 2);
    let r = local
        .launch(3, Some(sp.url.clone()))
        .await
        .expect("a start through transient errors succeeds");
    assert_eq!(
        (e503.count(), e500.count(), manifest503.count()),
        (3, 2, 2),
        "every error was answered"
    );
    restored_everything(&r, "transient errors");
    local.stop().await;

    // Slow answers: the first reads of the state files are held back 1.5 s each.
    let slow = relay.inject(
        "GET",
        &state_files,
        Fault::Delay(Duration::from_millis(1500)),
        2,
    );
    let t = Instant::now();
    let r = local
        .launch(2, Some(sp.url.clone()))
        .await
        .expect("a start through slow reads succeeds");
    assert_eq!(slow.count(), 2);
    assert!(
        t.elapsed() >= Duration::from_millis(1500),
        "the slow reads were waited for"
    );
    restored_everything(&r, "slow reads");
    local.stop().await;

    // Two reads cut off mid-body: the store client reads the rest again.
    let cut = relay.inject("GET", &file1, Fault::Truncate, 2);
    let r = local
        .launch(2, Some(sp.url.clone()))
        .await
        .expect("a start through two cut-off reads succeeds");
    assert_eq!(cut.count(), 2);
    restored_everything(&r, "cut-off reads");
    local.stop().await;

    // Faults that do not go away: the start fails, the error names the file, and nothing runs,
    // although subtask 0 read its own file in full.
    let refused: [(&str, Fault, &[&str]); 4] = [
        ("corrupted bytes", Fault::Corrupt, &["checksum"]),
        ("short range reads", Fault::Short, &["bytes"]),
        ("reads cut off every time", Fault::Truncate, &[]),
        ("a store answering 503", Fault::Status(503), &["503"]),
    ];
    for (what, fault, words) in refused {
        let read0 = relay.forwarded("GET", &file0);
        // Subtask 1's first read fails only after a while, so subtask 0's read (started beside
        // it) is through before the start fails, even on a loaded machine; later reads fail at once.
        let first = relay.inject(
            "GET",
            &file1,
            Fault::After(Duration::from_secs(3), Box::new(fault.clone())),
            1,
        );
        let faulty = relay.inject("GET", &file1, fault, usize::MAX);
        let t = Instant::now();
        let e = local
            .launch(2, Some(sp.url.clone()))
            .await
            .expect_err(what)
            .to_string();
        relay.clear(&tag);
        eprintln!("{what}: refused in {:?}: {e}", t.elapsed());
        assert!(
            first.count() + faulty.count() >= 1,
            "{what}: the fault was injected"
        );
        assert!(
            e.contains("state-1-of-2.bin"),
            "{what}: the error names the file: {e}"
        );
        for w in words {
            assert!(e.contains(w), "{what}: the error says {w:?}: {e}");
        }
        // Subtask 0's read runs beside subtask 1's failing one; on a loaded machine it may
        // still be on its way when the start has already failed.
        let deadline = Instant::now() + Duration::from_secs(5);
        while relay.forwarded("GET", &file0) <= read0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            relay.forwarded("GET", &file0) > read0,
            "{what}: subtask 0 read its part"
        );
        assert_not_running(&local, what);
    }

    // A manifest changed in transit (one digit of a source position: still JSON, still adds up)
    // is refused by its own checksum, before any state is read.
    let state_reads = relay.forwarded("GET", &state_files);
    let flipped = relay.inject(
        "GET",
        &manifest,
        Fault::FlipDigitAfter("\"0\":".into()),
        usize::MAX,
    );
    let e = local
        .launch(2, Some(sp.url.clone()))
        .await
        .expect_err("a manifest changed in transit is refused")
        .to_string();
    relay.clear(&tag);
    assert!(flipped.count() >= 1, "the manifest was changed");
    assert!(
        e.contains("_manifest.json") && e.contains("checksum"),
        "{e}"
    );
    assert_not_running(&local, "a manifest changed in transit");
    assert_eq!(
        relay.forwarded("GET", &state_files),
        state_reads,
        "no state was read from a snapshot whose manifest is corrupt"
    );

    // The faults are gone: the same savepoint restores, and the job runs on exactly.
    let r = local
        .launch(2, Some(sp.url.clone()))
        .await
        .expect("the savepoint restores once the store is healthy");
    restored_everything(&r, "healthy store");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let c = local.checkpoint().await.expect("checkpoint");
    assert_exact(&spec, &c.url).await;
    local.stop().await;
}

/// Runs `keyshift savepoint verify URL`: (success, stdout + stderr).
fn verify_cli(url: &str) -> (bool, String) {
    let out = std::process::Command::new(bin())
        .args(["savepoint", "verify", url])
        .output()
        .expect("keyshift runs");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// Verify under faults, both the operator's check (`snapshot::verify`) and the full
/// `keyshift savepoint verify`: errors, cut-off, short and corrupted reads are never a good
/// result and name the file; transient faults are retried and the result is complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_never_passes_a_failed_or_short_read() {
    let test = "verify_never_passes_a_failed_or_short_read";
    let Some(relay) = s3_relay(test) else { return };
    let tag = format!("faults-verify-{}", std::process::id());
    let logs = tempfile::tempdir().expect("temp dir");
    let spec = count_job("verify", 2);
    let mut local = LocalJob::new(&spec, s3_storage(&tag), bin(), logs.path().to_owned())
        .await
        .expect("job prepares");
    local.launch(2, None).await.expect("launch");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let sp = local.shutdown().await.expect("stop with a savepoint");
    let total_bytes = sp.manifest.stats.total_bytes;
    let (store, dir) = snapshot::open_store(&sp.url).expect("store");
    let sp_dir = format!("/savepoints/sp-{}/", sp.id);
    let file1 = [tag.as_str(), sp_dir.as_str(), "state-1-of-2.bin"];

    let report = snapshot::verify(store.as_ref(), &dir)
        .await
        .expect("the savepoint verifies");
    assert_eq!(report.bytes_checked, total_bytes);
    let (ok, out) = verify_cli(&sp.url);
    assert!(ok && out.contains("OK: 2 files"), "{out}");

    let bad: [(&str, Fault); 4] = [
        ("corrupted bytes", Fault::Corrupt),
        ("short range reads", Fault::Short),
        ("reads cut off every time", Fault::Truncate),
        ("a store answering 500", Fault::Status(500)),
    ];
    for (what, fault) in bad {
        let faulty = relay.inject("GET", &file1, fault.clone(), usize::MAX);
        let e = snapshot::verify(store.as_ref(), &dir)
            .await
            .expect_err(what)
            .to_string();
        assert!(faulty.count() >= 1, "{what}: the fault was injected");
        assert!(
            e.contains("state-1-of-2.bin"),
            "{what}: names the file: {e}"
        );
        let (ok, out) = verify_cli(&sp.url);
        relay.clear(&tag);
        eprintln!("{what}: verify: {e}\nkeyshift savepoint verify:\n{out}");
        assert!(!ok, "{what}: keyshift savepoint verify fails: {out}");
        assert!(!out.contains("OK:"), "{what}: no good result: {out}");
        assert!(
            out.lines()
                .any(|l| l.contains("FAIL") && l.contains("state-1-of-2.bin")),
            "{what}: the failure names the file: {out}"
        );
    }
    // A failing HEAD of a state file is no good result either.
    relay.inject("HEAD", &file1, Fault::Status(403), usize::MAX);
    let e = snapshot::verify(store.as_ref(), &dir)
        .await
        .expect_err("a state file that cannot be looked at")
        .to_string();
    assert!(e.contains("state-1-of-2.bin"), "{e}");
    let (ok, out) = verify_cli(&sp.url);
    relay.clear(&tag);
    assert!(
        !ok && !out.contains("OK:") && out.contains("state-1-of-2.bin"),
        "{out}"
    );

    // Transient faults: retried, and everything is checked.
    let hits = [
        relay.inject("GET", &file1, Fault::Status(503), 2),
        relay.inject("GET", &file1, Fault::Truncate, 1),
    ];
    let report = snapshot::verify(store.as_ref(), &dir)
        .await
        .expect("verify through transient faults");
    assert_eq!(report.bytes_checked, total_bytes);
    assert_eq!(hits.iter().map(|h| h.count()).sum::<usize>(), 3);
    let hits = [
        relay.inject("GET", &file1, Fault::Status(503), 2),
        relay.inject("GET", &file1, Fault::Truncate, 1),
    ];
    let (ok, out) = verify_cli(&sp.url);
    assert!(ok && out.contains("OK: 2 files"), "{out}");
    assert_eq!(hits.iter().map(|h| h.count()).sum::<usize>(), 3);
}

/// Files under `dir` whose name contains `needle`, relative to `dir`.
fn files_containing(dir: &Path, needle: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else if e.file_name().to_string_lossy().contains(needle) {
                out.push(p.strip_prefix(dir).unwrap_or(&p).display().to_string());
            }
        }
    }
    out.sort();
    out
}

/// A full disk during checkpoints (`file://` on a 16 MiB tmpfs): first no room for the state
/// files, then room for them but not for the manifest. Each checkpoint fails, the job keeps
/// running, the last good checkpoint stays the newest committed one, verifies and holds the
/// exact state, and no partial file is left behind. With the space back, the next checkpoint
/// commits exactly, retention removes the failed attempts, and the job restores from its
/// savepoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_fails_the_checkpoint_and_keeps_the_last_good_one() {
    let Some(fs) = Tmpfs::mount(16 << 20) else {
        eprintln!(
            "SKIPPED a_full_disk_fails_the_checkpoint_and_keeps_the_last_good_one: mounting a tmpfs needs root"
        );
        return;
    };
    let state = fs.path().join("state");
    let storage = format!("file://{}", state.display());
    let logs = tempfile::tempdir().expect("temp dir");
    let spec = count_job("full", 2);
    let mut local = LocalJob::new(&spec, storage.clone(), bin(), logs.path().to_owned())
        .await
        .expect("job prepares");
    local.launch(2, None).await.expect("launch");
    tokio::time::sleep(Duration::from_millis(600)).await;
    let good = local.checkpoint().await.expect("first checkpoint");
    let good_dir = PathBuf::from(good.url.trim_start_matches("file://"));
    let filler = fs.path().join("filler");

    // Room for the state files but not for the manifest: its pages, and those of the state
    // files, with one page of slack for state that grew.
    let page = 4096u64;
    let pages = |n: u64| n.div_ceil(page) * page;
    let manifest_len = std::fs::metadata(good_dir.join("_manifest.json"))
        .expect("manifest")
        .len();
    let state_len: u64 = good.manifest.files.iter().map(|f| pages(f.size)).sum();
    assert!(
        pages(manifest_len) >= 3 * page,
        "the manifest spans pages ({manifest_len} bytes)"
    );
    let partial_room = state_len + page;

    for (what, room) in [
        ("no room at all", 0),
        ("no room for the manifest", partial_room),
    ] {
        let avail = fs.available();
        let written = fs.fill(&filler, avail.saturating_sub(room));
        assert!(written > 0, "{what}: the filler took the space");
        tokio::time::sleep(Duration::from_millis(300)).await;
        let e = local
            .checkpoint()
            .await
            .expect_err(&format!("{what}: a checkpoint on a full disk fails"))
            .to_string();
        eprintln!("{what}: checkpoint failed: {e}");
        assert!(
            e.contains("No space left on device") || e.contains("os error 28"),
            "{what}: the error says the disk is full: {e}"
        );
        // The job keeps running.
        let statuses = local.status().await.expect("status");
        assert!(
            statuses.iter().all(|s| s.state == WorkerState::Running),
            "{what}: every worker runs on: {statuses:?}"
        );
        assert!(local.failed_worker().is_none(), "{what}: no worker died");
        if room == 0 {
            // A stop-with-savepoint (a rescale's first step) fails too, and the sources it
            // stopped at its barrier read on.
            let e = local
                .savepoint(true)
                .await
                .expect_err("a savepoint on a full disk fails")
                .to_string();
            assert!(e.contains("os error 28"), "{e}");
            let read = |st: &[keyshift::runtime::protocol::WorkerStatus]| {
                st.iter().map(|s| s.records_in).sum::<u64>()
            };
            let before = read(&local.status().await.expect("status"));
            tokio::time::sleep(Duration::from_millis(300)).await;
            let statuses = local.status().await.expect("status");
            assert!(
                statuses.iter().all(|s| s.state == WorkerState::Running),
                "{what}: the sources were resumed: {statuses:?}"
            );
            assert!(read(&statuses) > before, "{what}: the sources read on");
        }
        // The last good checkpoint is still the newest committed snapshot, intact and exact.
        assert_eq!(
            local.latest_snapshot().await.expect("listing"),
            Some(good.url.clone()),
            "{what}: the last good checkpoint is the newest committed one"
        );
        let (store, dir) = snapshot::open_store(&good.url).expect("store");
        snapshot::verify(store.as_ref(), &dir)
            .await
            .expect("the last good checkpoint verifies");
        assert_exact(&spec, &good.url).await;
        // Nothing uncommitted looks committed, and no partial file is left behind.
        let manifests = files_containing(&state, "_manifest.json");
        assert_eq!(
            manifests.len(),
            1,
            "{what}: only the good checkpoint has a manifest: {manifests:?}"
        );
        let staging = files_containing(&state, "#");
        assert!(
            staging.is_empty(),
            "{what}: partial files left: {staging:?}"
        );
        std::fs::remove_file(&filler).expect("free the space");
    }

    // Space again: the next checkpoint commits, exactly; retention removes the failed attempts.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let next = local
        .checkpoint()
        .await
        .expect("a checkpoint with space commits");
    assert!(
        next.id > good.id + 2,
        "ids of failed attempts are not reused"
    );
    assert_exact(&spec, &next.url).await;
    assert_eq!(
        local.latest_snapshot().await.expect("listing"),
        Some(next.url.clone())
    );
    // Retention removed the failed attempts: only the committed checkpoints remain (a write
    // that failed on the full disk left no empty directory either).
    let checkpoints = state.join("test/full/checkpoints");
    let mut dirs: Vec<String> = std::fs::read_dir(&checkpoints)
        .expect("checkpoints dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    dirs.sort();
    let mut kept = vec![format!("chk-{}", good.id), format!("chk-{}", next.id)];
    kept.sort();
    assert_eq!(dirs, kept, "only committed checkpoints remain");

    // And the job comes back from its savepoint, exactly.
    let sp = local.shutdown().await.expect("stop with a savepoint");
    assert_exact(&spec, &sp.url).await;
    local
        .launch(2, Some(sp.url.clone()))
        .await
        .expect("restart from the savepoint");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let after = local
        .checkpoint()
        .await
        .expect("checkpoint after the restart");
    assert_exact(&spec, &after.url).await;
    local.stop().await;
}

/// A manifest with one changed digit on disk (partition 0's source position: it still parses
/// and adds up) is refused, naming it, by a start, by `snapshot::verify` and by
/// `keyshift savepoint verify`; a resume's scan sets it apart, and the job comes back exactly
/// from the newest good snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_manifest_is_refused_not_restored() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let storage = format!("file://{}", tmp.path().join("state").display());
    let spec = count_job("manifest", 2);
    let mut local = LocalJob::new(&spec, storage.clone(), bin(), tmp.path().join("logs"))
        .await
        .expect("job prepares");
    local.launch(2, None).await.expect("launch");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let good = local.checkpoint().await.expect("checkpoint");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let sp = local.shutdown().await.expect("stop with a savepoint");
    let path = PathBuf::from(sp.url.trim_start_matches("file://")).join("_manifest.json");
    let mut bytes = std::fs::read(&path).expect("manifest");
    assert!(
        flip_digit_after(&mut bytes, b"\"0\":"),
        "the manifest holds partition 0's position"
    );
    std::fs::write(&path, &bytes).expect("write");

    let e = local
        .launch(2, Some(sp.url.clone()))
        .await
        .expect_err("a corrupted manifest is not restored")
        .to_string();
    assert!(
        e.contains("_manifest.json") && e.contains("checksum"),
        "{e}"
    );
    assert_not_running(&local, "a corrupted manifest");
    let (store, dir) = snapshot::open_store(&sp.url).expect("store");
    let e = snapshot::verify(store.as_ref(), &dir)
        .await
        .expect_err("verify refuses it")
        .to_string();
    assert!(e.contains("_manifest.json"), "{e}");
    let (ok, out) = verify_cli(&sp.url);
    assert!(!ok && out.contains("_manifest.json"), "{out}");

    // What a resume sees: the savepoint set apart, the checkpoint as the newest good snapshot.
    let (store, base) = snapshot::open_store(&storage).expect("store");
    let scan = snapshot::scan_snapshots(
        store.as_ref(),
        &snapshot::job_dir(&base, "test", "manifest"),
    )
    .await
    .expect("scan");
    assert_eq!(
        scan.unreadable.iter().map(|u| u.id).collect::<Vec<_>>(),
        vec![sp.id]
    );
    assert_eq!(scan.snapshots.iter().map(|s| s.id).max(), Some(good.id));
    local
        .launch(2, Some(good.url.clone()))
        .await
        .expect("the good checkpoint restores");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let c = local.checkpoint().await.expect("checkpoint");
    assert_exact(&spec, &c.url).await;
    local.stop().await;
}

/// A state file that goes up in parts (the path of states over one part) on a disk that fills
/// up mid-file: the write fails with ENOSPC and leaves neither the file nor a partial staging
/// file; with the space back, the same file is written whole and reads back block for block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_file_upload_that_fills_the_disk_leaves_nothing() {
    let Some(fs) = Tmpfs::mount(4 << 20) else {
        eprintln!(
            "SKIPPED a_state_file_upload_that_fills_the_disk_leaves_nothing: mounting a tmpfs needs root"
        );
        return;
    };
    let url = format!("file://{}", fs.path().join("state").display());
    let (store, base) = snapshot::open_store(&url).expect("store");
    let dir = base.clone().join("test/upload/checkpoints/chk-1");
    let assignment = keyshift::keygroup::Assignment::new(1, 8).expect("assignment");
    let blocks: Vec<bytes::Bytes> = (0..8u8).map(|g| vec![g; 256 << 10].into()).collect();
    let write = |store: std::sync::Arc<dyn snapshot::ObjectStore>| {
        let (dir, blocks) = (dir.clone(), blocks.clone());
        async move {
            // 64 KiB parts: a multipart upload from the first block on.
            let mut w =
                snapshot::SnapshotWriter::new(store, &dir, assignment, 0)?.with_parts(64 << 10, 2);
            for (g, b) in blocks.into_iter().enumerate() {
                w.write_group(g as u32, b, 1).await?;
            }
            w.finish().await
        }
    };
    // 1 MiB of room for a 2 MiB file.
    let filler = fs.path().join("filler");
    fs.fill(&filler, fs.available().saturating_sub(1 << 20));
    let e = write(store.clone())
        .await
        .expect_err("a state file larger than the free space fails")
        .to_string();
    assert!(e.contains("os error 28"), "{e}");
    assert!(
        e.contains("state-0-of-1.bin"),
        "the error names the file: {e}"
    );
    assert_eq!(
        files_containing(fs.path(), "state-0-of-1.bin"),
        Vec::<String>::new(),
        "no file and no partial staging file is left"
    );
    std::fs::remove_file(&filler).expect("free the space");
    let written = write(store.clone())
        .await
        .expect("with space the file is written");
    assert_eq!(written.file.size, 8 * (256 << 10));
    let path = dir.clone().join("state-0-of-1.bin");
    for (g, entry) in written.groups.iter().enumerate() {
        let got = store
            .get_range(&path, entry.byte_range())
            .await
            .expect("range read");
        assert_eq!(got, blocks[g], "block {g} reads back");
    }
}
