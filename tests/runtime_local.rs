//! The runtime end to end on one machine: real `keyshift worker` processes, the real
//! coordinator, real snapshots on `file://` (and on S3 when `KEYSHIFT_TEST_S3_URL` is set).
//! Every check compares the state of a committed snapshot with the exact result computed
//! independently from the generator's definition (`job::expected_results`) at the snapshot's
//! source positions.

mod snapshot_support;
mod support;

use support::{AZURE, GCS, S3, cloud_url};

use keyshift::crd::StreamJob;
use keyshift::job::{self, AccValue, Expected};
use keyshift::keygroup::Key;
use keyshift::local::LocalJob;
use keyshift::snapshot;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_keyshift"))
}

fn job(yaml: &str) -> StreamJob {
    serde_yaml::from_str(yaml).expect("test manifest parses")
}

fn generator_job(
    name: &str,
    extra_source: &str,
    replicas: u32,
    max_p: u32,
    agg: &str,
) -> StreamJob {
    job(&format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {{name: {name}, namespace: test}}
spec:
  replicas: {replicas}
  maxParallelism: {max_p}
  job:
    source:
      generator: {{partitions: 6, keys: 3000, seed: 7, recordsPerSecond: 5000{extra_source}}}
    key: {{field: key, type: string}}
    aggregation: {agg}
  state:
    checkpointInterval: 1h
    retainedCheckpoints: 2
"
    ))
}

struct Env {
    _dir: tempfile::TempDir,
    storage: String,
    logs: PathBuf,
}

fn env(storage_override: Option<String>) -> Env {
    let dir = tempfile::tempdir().expect("temp dir");
    let storage = storage_override
        .unwrap_or_else(|| format!("file://{}", dir.path().join("state").display()));
    let logs = dir.path().join("logs");
    Env {
        _dir: dir,
        storage,
        logs,
    }
}

/// Every key's state in a committed snapshot (read through the real restore path), its source
/// positions and its manifest.
async fn read_state(
    url: &str,
) -> (
    BTreeMap<Key, AccValue>,
    BTreeMap<u32, u64>,
    snapshot::Manifest,
) {
    let s = snapshot_support::read_state(url).await;
    (s.values, s.positions, s.manifest)
}

/// Every key's scalar value in a committed snapshot, and its source positions.
async fn snapshot_state(url: &str) -> (BTreeMap<Key, i64>, BTreeMap<u32, u64>, snapshot::Manifest) {
    let s = snapshot_support::read_state(url).await;
    (s.scalars(), s.positions, s.manifest)
}

async fn assert_exact(spec: &StreamJob, url: &str) -> (BTreeMap<Key, i64>, BTreeMap<u32, u64>) {
    let (state, positions, manifest) = snapshot_state(url).await;
    let Expected::Global(expected) =
        job::expected_results(&spec.spec.job, &positions).expect("oracle runs")
    else {
        panic!("expected a global aggregate");
    };
    assert_eq!(
        positions.len(),
        6,
        "every partition has a position in {url}"
    );
    assert!(
        positions.values().all(|p| *p > 0),
        "every partition advanced: {positions:?}"
    );
    assert_eq!(state.len(), expected.len(), "key count in {url}");
    assert!(
        state == expected,
        "state in {url} differs from the exact expected result"
    );
    assert_eq!(manifest.stats.total_keys as usize, state.len());
    (state, positions)
}

async fn rescale_chain(storage: Option<String>) {
    let env = env(storage);
    let spec = generator_job("chain", "", 4, 128, "{function: count}");
    let mut local = LocalJob::new(&spec, env.storage.clone(), bin(), env.logs.clone())
        .await
        .expect("job prepares");
    local.launch(4, None).await.expect("launch at 4");
    tokio::time::sleep(Duration::from_millis(700)).await;
    let c = local.checkpoint().await.expect("checkpoint");
    assert_exact(&spec, &c.url).await;
    // Up and down, divisors and non-divisors of 128.
    for to in [8, 3, 1, 7] {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let r = local
            .rescale(to)
            .await
            .unwrap_or_else(|e| panic!("rescale to {to}: {e}"));
        assert_eq!(r.to, to);
        // Each new subtask read exactly its own groups: together, every byte once.
        assert_eq!(
            r.bytes_read, r.state_bytes,
            "rescale to {to} reads the state exactly once"
        );
        assert_exact(&spec, &r.savepoint).await;
        assert_eq!(local.parallelism(), Some(to));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let sp = local.shutdown().await.expect("stop with savepoint");
    let (state, positions) = assert_exact(&spec, &sp.url).await;
    // A count job: the total equals the records read, so no record was lost or applied twice.
    assert_eq!(
        state.values().sum::<i64>() as u64,
        positions.values().sum::<u64>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rescale_4_8_3_1_7_keeps_every_key_exact() {
    rescale_chain(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rescale_on_s3() {
    if let Some(url) = cloud_url(S3, "rescale") {
        rescale_chain(Some(url)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rescale_on_gcs() {
    if let Some(url) = cloud_url(GCS, "rescale") {
        rescale_chain(Some(url)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rescale_on_azure() {
    if let Some(url) = cloud_url(AZURE, "rescale") {
        rescale_chain(Some(url)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_key_and_refused_parallelism() {
    let env = env(None);
    // Zipf with exponent 2 over 3000 keys: the hottest key carries about 61% of the records.
    let spec = generator_job(
        "hot",
        ", distribution: zipf, zipfExponent: 2.0",
        3,
        128,
        "{function: count}",
    );
    let mut local = LocalJob::new(&spec, env.storage.clone(), bin(), env.logs.clone())
        .await
        .expect("job prepares");
    local.launch(3, None).await.expect("launch");
    tokio::time::sleep(Duration::from_millis(800)).await;
    // The sources combine the hot key's records before the shuffle (the built-in aggregation's
    // default): fewer records cross it than were read, and every one of them is counted.
    let status = local.status().await.expect("status");
    let read: u64 = status.iter().map(|w| w.records_in).sum();
    let combined: u64 = status.iter().map(|w| w.records_combined).sum();
    assert!(
        combined > 0 && combined < read,
        "{combined} of {read} records combined"
    );
    let r = local.rescale(2).await.expect("rescale 3 -> 2");
    let (state, _) = assert_exact(&spec, &r.savepoint).await;
    // Combined partials are exact through a killed worker's recovery as well.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let good = local.checkpoint().await.expect("checkpoint");
    tokio::time::sleep(Duration::from_millis(300)).await;
    local.kill_worker(0).await;
    let recovered = local.recover(2).await.expect("recover");
    assert_eq!(recovered.restored_from.as_deref(), Some(good.url.as_str()));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_exact(&spec, &local.checkpoint().await.expect("checkpoint").url).await;
    let total: i64 = state.values().sum();
    let (hot, max) = state.iter().max_by_key(|(_, v)| **v).expect("some key");
    assert_eq!(
        hot,
        &Key::String("key-0".into()),
        "rank 0 is the hottest key"
    );
    assert!(
        *max * 2 >= total,
        "the hot key carries at least half: {max} of {total}"
    );

    // A parallelism above the key-group ceiling is refused before anything stops.
    let e = local.rescale(200).await.expect_err("200 > 128 is refused");
    assert!(e.to_string().contains("128"), "{e}");
    assert_eq!(local.parallelism(), Some(2), "the job still runs at 2");
    let sp = local.shutdown().await.expect("stop");
    assert_exact(&spec, &sp.url).await;

    // 10 key groups at 16 subtasks is refused with the reason.
    let small = generator_job("small", "", 16, 10, "{function: count}");
    let e = keyshift::validation::validate(&small.spec, None).expect_err("refused");
    assert!(
        e.contains(keyshift::validation::MSG_REPLICAS_LE_MAXP),
        "{e}"
    );
    let e = LocalJob::new(&small, env.storage.clone(), bin(), env.logs.clone())
        .await
        .err()
        .expect("refused");
    assert!(e.to_string().contains("ceiling 10"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_restarts_from_the_last_checkpoint() {
    crash_and_recover(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_restarts_from_the_last_checkpoint_on_s3() {
    if let Some(url) = cloud_url(S3, "crash") {
        crash_and_recover(Some(url)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_restarts_from_the_last_checkpoint_on_gcs() {
    if let Some(url) = cloud_url(GCS, "crash") {
        crash_and_recover(Some(url)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_restarts_from_the_last_checkpoint_on_azure() {
    if let Some(url) = cloud_url(AZURE, "crash") {
        crash_and_recover(Some(url)).await;
    }
}

async fn crash_and_recover(storage: Option<String>) {
    let env = env(storage);
    let spec = generator_job("crash", "", 3, 128, "{function: sum, field: value}");
    let mut local = LocalJob::new(&spec, env.storage.clone(), bin(), env.logs.clone())
        .await
        .expect("job prepares");
    local.launch(3, None).await.expect("launch");
    tokio::time::sleep(Duration::from_millis(600)).await;
    let first = local.checkpoint().await.expect("checkpoint");
    assert!(
        first.manifest.is_self_contained(),
        "the first checkpoint is full"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The second one builds on the first (incremental checkpoints are on by default): what a
    // restart then restores.
    let good = local.checkpoint().await.expect("checkpoint");
    assert_eq!(
        good.manifest.format_version,
        snapshot::FORMAT_VERSION,
        "the second checkpoint is incremental"
    );
    assert!(!good.manifest.is_self_contained());
    assert_exact(&spec, &good.url).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    local.kill_worker(1).await;
    // A checkpoint with a dead worker fails and leaves the previous one usable.
    let failed = local.checkpoint().await;
    assert!(failed.is_err(), "a checkpoint without worker 1 must fail");
    assert_eq!(
        local.latest_snapshot().await.expect("listing"),
        Some(good.url.clone())
    );
    let (store, dir) = snapshot::open_snapshot_dir(&good.url).expect("store");
    snapshot::verify(store.as_ref(), &dir)
        .await
        .expect("the last good checkpoint verifies");
    assert!(
        local.failed_worker().is_some(),
        "the dead worker is noticed"
    );

    let r = local.recover(3).await.expect("recover");
    assert_eq!(r.restored_from.as_deref(), Some(good.url.as_str()));
    tokio::time::sleep(Duration::from_millis(600)).await;
    // The restored checkpoint is the base of the next one (whose groups are deltas or, where
    // most keys changed since, whole again: tests/incremental.rs checks which).
    let after = local
        .checkpoint()
        .await
        .expect("checkpoint after the restart");
    assert_exact(&spec, &after.url).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let sp = local.shutdown().await.expect("stop");
    assert!(
        sp.manifest.is_self_contained(),
        "savepoints are self-contained"
    );
    assert_exact(&spec, &sp.url).await;
}

/// `spec.state.incrementalCheckpoints: {enabled: false}` reaches the workers in the start
/// request: every checkpoint is written in full (self-contained, format version 1), and exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incremental_checkpoints_turned_off_in_the_spec_write_every_checkpoint_in_full() {
    let env = env(None);
    let mut spec = generator_job("full", "", 2, 128, "{function: count}");
    spec.spec.state.incremental_checkpoints = Some(keyshift::crd::IncrementalCheckpoints {
        enabled: false,
        max_deltas: None,
        max_delta_percent: None,
    });
    let mut local = LocalJob::new(&spec, env.storage.clone(), bin(), env.logs.clone())
        .await
        .expect("job prepares");
    local.launch(2, None).await.expect("launch");
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let c = local.checkpoint().await.expect("checkpoint");
        assert!(
            c.manifest.is_self_contained() && c.manifest.format_version < snapshot::FORMAT_VERSION,
            "checkpoint {} is written in full",
            c.url
        );
        assert_exact(&spec, &c.url).await;
    }
    local.shutdown().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_or_foreign_snapshots_are_refused() {
    let env = env(None);
    let spec = generator_job("corrupt", "", 2, 128, "{function: count}");
    let mut local = LocalJob::new(&spec, env.storage.clone(), bin(), env.logs.clone())
        .await
        .expect("job prepares");
    local.launch(2, None).await.expect("launch");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let sp = local.shutdown().await.expect("stop");

    // Another key-group count: refused with the rewrite hint.
    let other = generator_job("corrupt", "", 2, 256, "{function: count}");
    let mut wrong = LocalJob::new(
        &other,
        format!("{}-other", env.storage),
        bin(),
        env.logs.clone(),
    )
    .await
    .expect("prepares");
    let e = wrong
        .launch(2, Some(sp.url.clone()))
        .await
        .expect_err("refused");
    assert!(
        e.to_string()
            .contains("has 128 key groups but the job runs with 256"),
        "{e}"
    );

    // State this job does not declare (another schema) is refused unless explicitly allowed.
    let manifest_path = PathBuf::from(sp.url.trim_start_matches("file://")).join("_manifest.json");
    let original = std::fs::read_to_string(&manifest_path).expect("manifest");
    let foreign = original.replace("\"keyshift.agg.v1\"", "\"acme.sessions.v3\"");
    assert_ne!(foreign, original, "the manifest names its state schema");
    // Sealed with its own checksum again, as a writer of that schema would.
    let foreign = snapshot::Manifest::from_json(foreign.as_bytes(), "edited manifest")
        .expect("the edited manifest parses");
    let foreign = snapshot::sealed_manifest_json(&foreign).expect("manifest JSON");
    std::fs::write(&manifest_path, &foreign).expect("write");
    let e = local
        .launch(2, Some(sp.url.clone()))
        .await
        .expect_err("unknown state refused");
    assert!(e.to_string().contains("allowNonRestoredState"), "{e}");
    let mut allowed = spec.clone();
    allowed.spec.allow_non_restored_state = true;
    let mut lenient = LocalJob::new(
        &allowed,
        format!("{}-lenient", env.storage),
        bin(),
        env.logs.clone(),
    )
    .await
    .expect("prepares");
    let r = lenient
        .launch(2, Some(sp.url.clone()))
        .await
        .expect("allowed: starts without that state");
    assert_eq!(r.bytes_read(), 0, "nothing of the foreign state is read");
    lenient.stop().await;
    std::fs::write(&manifest_path, &original).expect("restore manifest");

    // A flipped byte in a state file: detected, named, nothing restored.
    let path = PathBuf::from(sp.url.trim_start_matches("file://")).join("state-1-of-2.bin");
    let mut bytes = std::fs::read(&path).expect("state file");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&path, &bytes).expect("write");
    let e = local
        .launch(2, Some(sp.url.clone()))
        .await
        .expect_err("corrupt state is refused");
    assert!(
        e.to_string().contains("state-1-of-2.bin"),
        "the error names the file: {e}"
    );
    let (store, dir) = snapshot::open_store(&sp.url).expect("store");
    let e = snapshot::verify(store.as_ref(), &dir)
        .await
        .expect_err("verify fails");
    assert!(e.to_string().contains("state-1-of-2.bin"), "{e}");
}

/// Adds the window rows of sink output (JSON lines) to `out`; a window seen twice fails the test.
fn add_window_rows(text: &str, out: &mut BTreeMap<Key, BTreeMap<i64, i64>>) {
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("sink line is JSON");
        let key = Key::String(v["key"].as_str().expect("string key").to_owned());
        let start = v["window"]["start"].as_i64().expect("window start");
        let value = v["value"].as_i64().expect("value");
        let prev = out.entry(key.clone()).or_default().insert(start, value);
        assert!(prev.is_none(), "window {start} of {key:?} emitted twice");
    }
}

/// Fired windows from the log sink of every worker run, keyed by key and window start; a window
/// that fired twice fails the test.
fn fired_windows(logs: &std::path::Path) -> BTreeMap<Key, BTreeMap<i64, i64>> {
    let mut out: BTreeMap<Key, BTreeMap<i64, i64>> = BTreeMap::new();
    for entry in std::fs::read_dir(logs).expect("log dir") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "out") {
            continue;
        }
        add_window_rows(&std::fs::read_to_string(&path).expect("read"), &mut out);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_open_across_a_rescale_closes_with_the_right_result() {
    let env = env(None);
    let spec = job("apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {name: windows, namespace: test}
spec:
  replicas: 2
  maxParallelism: 128
  job:
    source:
      generator: {partitions: 4, keys: 200, seed: 3, recordsPerSecond: 4000}
    key: {field: key}
    aggregation: {function: sum, field: value}
    window: {size: 1s, maxOutOfOrderness: 100ms}
    sink: {type: log}
  state:
    checkpointInterval: 1h
");
    let mut local = LocalJob::new(&spec, env.storage.clone(), bin(), env.logs.clone())
        .await
        .expect("job prepares");
    local.launch(2, None).await.expect("launch");
    // Rescale in the middle of a window (event time runs at wall-clock speed here).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let r = local.rescale(3).await.expect("rescale 2 -> 3");
    let (_, _, m) = snapshot_state_windows(&r.savepoint).await;
    assert!(
        m.watermark.is_some(),
        "the watermark is part of the savepoint"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let sp = local.shutdown().await.expect("stop");
    tokio::time::sleep(Duration::from_millis(300)).await;

    let (open, positions, manifest) = snapshot_state_windows(&sp.url).await;
    let seen = fired_windows(&env.logs);
    let fired: usize = seen.values().map(BTreeMap::len).sum();
    assert!(fired > 0, "some windows fired");
    // Windows still open at the end are in the savepoint; none of them fired already.
    let wm = manifest.watermark.expect("watermark");
    for start in open.values().flatten().map(|(start, _)| *start) {
        assert!(start + 1000 > wm, "an open window lies after the watermark");
    }
    assert_emitted_and_open_are_exact(&spec, seen, open, &positions, "fired");
}

/// The windows a job emitted plus those still open in its final savepoint are exactly the
/// expected windows at the savepoint's positions, and no window is both emitted and open.
fn assert_emitted_and_open_are_exact(
    spec: &StreamJob,
    mut seen: BTreeMap<Key, BTreeMap<i64, i64>>,
    open: BTreeMap<Key, Vec<(i64, i64)>>,
    positions: &BTreeMap<u32, u64>,
    emitted: &str,
) {
    for (key, windows) in open {
        for (start, acc) in windows {
            let prev = seen.entry(key.clone()).or_default().insert(start, acc);
            assert!(
                prev.is_none(),
                "window {start} of {key:?} both {emitted} and open"
            );
        }
    }
    let Expected::Windowed(expected) =
        job::expected_results(&spec.spec.job, positions).expect("oracle")
    else {
        panic!("expected windows");
    };
    assert!(
        seen == expected,
        "{emitted} + open windows differ from the exact expected windows"
    );
}

async fn snapshot_state_windows(
    url: &str,
) -> (
    BTreeMap<Key, Vec<(i64, i64)>>,
    BTreeMap<u32, u64>,
    snapshot::Manifest,
) {
    let s = snapshot_support::read_state(url).await;
    (s.windows(), s.positions, s.manifest)
}

/// `file://` URL of a local directory.
fn file_url(dir: &std::path::Path) -> String {
    format!("file://{}", dir.display())
}

/// Published (committed) sink output under the object-store sink's URL `sink`: per key and
/// window start, failing on a window published twice; and the snapshot ids that published.
async fn published_windows(sink: &str) -> (BTreeMap<Key, BTreeMap<i64, i64>>, Vec<u64>) {
    use futures::TryStreamExt;
    use object_store::ObjectStoreExt;
    let (store, base) = snapshot::open_store(sink).expect("sink store");
    let objects: Vec<_> = store
        .list(Some(&base))
        .try_collect()
        .await
        .expect("list the sink's output");
    let mut rows: BTreeMap<Key, BTreeMap<i64, i64>> = BTreeMap::new();
    let mut ids = Vec::new();
    for object in objects {
        let mut parts = object.location.prefix_match(&base).expect("under the sink");
        let Some(id) = parts
            .next()
            .and_then(|dir| dir.as_ref().strip_prefix("snap-")?.parse::<u64>().ok())
        else {
            continue; // `_staging/` and anything else beside the published output
        };
        if !ids.contains(&id) {
            ids.push(id);
        }
        let bytes = store
            .get(&object.location)
            .await
            .expect("get part")
            .bytes()
            .await
            .expect("read part");
        let text = std::str::from_utf8(&bytes).expect("UTF-8 part");
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).expect("JSON line");
            let key = Key::String(v["key"].as_str().expect("key").to_owned());
            let start = v["window"]["start"].as_i64().expect("window");
            let prev = rows
                .entry(key.clone())
                .or_default()
                .insert(start, v["value"].as_i64().expect("value"));
            assert!(prev.is_none(), "window {start} of {key:?} published twice");
        }
    }
    ids.sort_unstable();
    (rows, ids)
}

/// The files staged under the object-store sink at `out` (`_staging/snap-<id>/...`), by id.
fn staged_files(out: &std::path::Path) -> Vec<(u64, PathBuf)> {
    let mut found = Vec::new();
    let Ok(dirs) = std::fs::read_dir(out.join("_staging")) else {
        return found;
    };
    for dir in dirs {
        let dir = dir.expect("entry").path();
        let id = dir
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("snap-"))
            .and_then(|n| n.parse::<u64>().ok())
            .expect("a staged snapshot directory");
        for part in std::fs::read_dir(&dir).expect("parts") {
            let part = part.expect("part").path();
            if part.is_file() {
                found.push((id, part));
            }
        }
    }
    found
}

/// A windowed sum at parallelism 3 whose results go to an object-store sink at URL `sink`.
fn windowed_sink_job(name: &str, seed: u64, window: &str, sink: &str) -> StreamJob {
    job(&format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {{name: {name}, namespace: test}}
spec:
  replicas: 3
  maxParallelism: 128
  job:
    source:
      generator: {{partitions: 4, keys: 100, seed: {seed}, recordsPerSecond: 4000}}
    key: {{field: key}}
    aggregation: {{function: sum, field: value}}
    window: {{size: {window}}}
    sink: {{type: objectStore, url: '{sink}'}}
  state:
    checkpointInterval: 1h
"
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn object_store_sink_is_exactly_once_across_a_crash_and_a_rescale() {
    sink_exactly_once(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn object_store_sink_is_exactly_once_across_a_crash_and_a_rescale_on_s3() {
    if let Some(url) = cloud_url(S3, "sink") {
        sink_exactly_once(Some(url)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn object_store_sink_is_exactly_once_across_a_crash_and_a_rescale_on_gcs() {
    if let Some(url) = cloud_url(GCS, "sink") {
        sink_exactly_once(Some(url)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn object_store_sink_is_exactly_once_across_a_crash_and_a_rescale_on_azure() {
    if let Some(url) = cloud_url(AZURE, "sink") {
        sink_exactly_once(Some(url)).await;
    }
}

/// A windowed sum publishing to an object-store sink through a killed worker's recovery and a
/// rescale: only committed snapshots publish, and every window once. On `cloud` (a base URL) the
/// state and the sink both live there, the sink under `<cloud>/out`; else on the local disk.
async fn sink_exactly_once(cloud: Option<String>) {
    let sink = cloud.as_ref().map(|url| format!("{url}/out"));
    let env = env(cloud.map(|url| format!("{url}/state")));
    let sink = sink.unwrap_or_else(|| file_url(&env._dir.path().join("out")));
    let spec = windowed_sink_job("sink", 11, "500ms", &sink);
    let mut local = LocalJob::new(&spec, env.storage.clone(), bin(), env.logs.clone())
        .await
        .expect("job prepares");
    local.launch(3, None).await.expect("launch");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let good = local.checkpoint().await.expect("checkpoint");
    tokio::time::sleep(Duration::from_millis(800)).await;
    local.kill_worker(1).await;
    let failed = local.checkpoint().await;
    assert!(failed.is_err());
    let r = local.recover(3).await.expect("recover");
    assert_eq!(r.restored_from.as_deref(), Some(good.url.as_str()));
    tokio::time::sleep(Duration::from_millis(1200)).await;
    local.rescale(2).await.expect("rescale");
    tokio::time::sleep(Duration::from_millis(800)).await;
    let sp = local.shutdown().await.expect("stop");

    let (seen, ids) = published_windows(&sink).await;
    assert!(!seen.is_empty(), "output was published");
    // Only committed snapshots published output.
    let (store, base) = snapshot::open_store(&env.storage).expect("store");
    let job_dir = snapshot::job_dir(&base, "test", "sink");
    let committed: Vec<u64> = snapshot::list_snapshots(store.as_ref(), &job_dir)
        .await
        .expect("list")
        .iter()
        .map(|s| s.id)
        .collect();
    for id in &ids {
        assert!(
            committed.contains(id) || *id < *committed.iter().min().unwrap_or(&0),
            "output of uncommitted snapshot {id} is visible (committed: {committed:?})"
        );
    }
    let (open, positions, _) = snapshot_state_windows(&sp.url).await;
    assert_emitted_and_open_are_exact(&spec, seen, open, &positions, "published");
}

/// Checkpoints that fail on one subtask only while the job keeps running: `n` because one
/// subtask cannot stage its sink output, `n + 1` because another cannot write its state (each
/// made impossible by a directory where the object would go). What every subtask emitted before
/// them rides with the next committed checkpoint: every window is published exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sink_output_of_checkpoints_that_failed_on_one_subtask_rides_with_the_next_commit() {
    let env = env(None);
    let out = env._dir.path().join("out");
    let spec = windowed_sink_job("carry", 5, "300ms", &file_url(&out));
    let mut local = LocalJob::new(&spec, env.storage.clone(), bin(), env.logs.clone())
        .await
        .expect("job prepares");
    local.launch(3, None).await.expect("launch");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let first = local.checkpoint().await.expect("checkpoint");
    let n = first.id + 1;
    std::fs::create_dir_all(out.join(format!("_staging/snap-{n}/part-1-of-3.jsonl")))
        .expect("sink trap");
    let state = PathBuf::from(env.storage.trim_start_matches("file://"));
    std::fs::create_dir_all(state.join(format!(
        "test/carry/checkpoints/chk-{}/state-2-of-3.bin",
        n + 1
    )))
    .expect("state trap");
    for (id, subtask) in [(n, 1), (n + 1, 2)] {
        tokio::time::sleep(Duration::from_millis(700)).await;
        let e = local
            .checkpoint()
            .await
            .expect_err("a checkpoint that one subtask cannot take fails");
        assert!(
            e.to_string()
                .contains(&format!("snapshot {id} failed on subtask {subtask}")),
            "{e}"
        );
    }
    assert!(local.failed_worker().is_none(), "every worker kept running");
    tokio::time::sleep(Duration::from_millis(700)).await;
    let next = local
        .checkpoint()
        .await
        .expect("the next checkpoint commits");
    assert_eq!(next.id, n + 2);
    tokio::time::sleep(Duration::from_millis(700)).await;
    local.rescale(2).await.expect("rescale");
    tokio::time::sleep(Duration::from_millis(700)).await;
    let sp = local.shutdown().await.expect("stop");

    let (seen, ids) = published_windows(&file_url(&out)).await;
    assert!(
        !ids.contains(&n) && !ids.contains(&(n + 1)),
        "failed checkpoints publish nothing: {ids:?}"
    );
    assert!(ids.contains(&(n + 2)), "{ids:?}");
    let rows = std::fs::read_dir(out.join(format!("snap-{}", n + 2)))
        .expect("published parts")
        .map(|p| std::fs::read_to_string(p.expect("part").path()).expect("read"))
        .map(|t| t.lines().count())
        .sum::<usize>();
    assert!(
        rows > 0,
        "windows fired since {} ride with {}",
        first.id,
        n + 2
    );
    // What is staged at or below the newest published id is removed once it is published
    // (the failed checkpoints' rows rode with a later one): only the trap is left there.
    let newest = ids.iter().max().copied().unwrap_or(0);
    let left: Vec<_> = staged_files(&out)
        .into_iter()
        .filter(|(id, _)| *id <= newest)
        .collect();
    assert!(left.is_empty(), "staged output left behind: {left:?}");
    let (open, positions, _) = snapshot_state_windows(&sp.url).await;
    assert_emitted_and_open_are_exact(&spec, seen, open, &positions, "published");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_source_resumes_at_exact_byte_offsets_across_a_rescale() {
    file_source_rescale(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_source_on_s3_resumes_at_exact_byte_offsets_across_a_rescale() {
    if let Some(url) = cloud_url(S3, "file-source") {
        file_source_rescale(Some(url)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_source_on_gcs_resumes_at_exact_byte_offsets_across_a_rescale() {
    if let Some(url) = cloud_url(GCS, "file-source") {
        file_source_rescale(Some(url)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_source_on_azure_resumes_at_exact_byte_offsets_across_a_rescale() {
    if let Some(url) = cloud_url(AZURE, "file-source") {
        file_source_rescale(Some(url)).await;
    }
}

/// Where a file source's partitions are written: files in a local directory (appended to), or
/// objects under an object-store URL (each rewritten whole, longer, as an object grows).
enum Input {
    Dir(PathBuf),
    Objects {
        store: std::sync::Arc<dyn object_store::ObjectStore>,
        prefix: object_store::path::Path,
        contents: Vec<String>,
    },
}

impl Input {
    /// Lines `from..to` of every one of `partitions` partitions: long keys, values to sum.
    async fn write(&mut self, partitions: i64, from: i64, to: i64) {
        for p in 0..partitions {
            let lines: String = (from..to)
                .map(|i| {
                    format!(
                        "{{\"account\":{},\"amount\":{},\"ts\":{}}}\n",
                        (i * 7 + p) % 50,
                        i % 13,
                        i
                    )
                })
                .collect();
            let name = format!("part-{p}.jsonl");
            match self {
                Input::Dir(dir) => {
                    use std::io::Write;
                    std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(dir.join(&name))
                        .expect("open")
                        .write_all(lines.as_bytes())
                        .expect("write");
                }
                Input::Objects {
                    store,
                    prefix,
                    contents,
                } => {
                    use object_store::ObjectStoreExt;
                    let all = &mut contents[p as usize];
                    all.push_str(&lines);
                    let path = object_store::path::Path::from(format!("{prefix}/{name}"));
                    store
                        .put(&path, all.clone().into_bytes().into())
                        .await
                        .expect("put");
                }
            }
        }
    }

    /// Partition `p`'s length.
    fn len(&self, p: u32) -> u64 {
        match self {
            Input::Dir(dir) => std::fs::metadata(dir.join(format!("part-{p}.jsonl")))
                .expect("file")
                .len(),
            Input::Objects { contents, .. } => contents[p as usize].len() as u64,
        }
    }
}

/// A sum over three growing partitions of JSON lines, read from a local directory or, given a
/// cloud base URL, from objects there: rescaled 2 -> 3 and stopped, each snapshot's state is
/// exactly the records before its positions, and every line is read once.
async fn file_source_rescale(cloud: Option<String>) {
    let env = env(None);
    let (mut input, url) = match cloud {
        None => {
            let dir = env._dir.path().join("input");
            std::fs::create_dir_all(&dir).expect("input dir");
            (Input::Dir(dir.clone()), file_url(&dir))
        }
        Some(base) => {
            let url = format!("{base}/input");
            let (store, prefix) = snapshot::open_store(&url).expect("input store");
            let contents = vec![String::new(); 3];
            let input = Input::Objects {
                store,
                prefix,
                contents,
            };
            (input, url)
        }
    };
    input.write(3, 0, 2000).await;
    let spec = job(&format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {{name: files, namespace: test}}
spec:
  replicas: 2
  maxParallelism: 64
  job:
    source:
      file: {{path: '{url}'}}
    key: {{field: account, type: long}}
    aggregation: {{function: sum, field: amount}}
  state:
    checkpointInterval: 1h
"
    ));
    let mut local = LocalJob::new(&spec, env.storage.clone(), bin(), env.logs.clone())
        .await
        .expect("job prepares");
    local.launch(2, None).await.expect("launch");
    tokio::time::sleep(Duration::from_millis(800)).await;
    let r = local.rescale(3).await.expect("rescale 2 -> 3");
    let (state, positions, _) = snapshot_state(&r.savepoint).await;
    let Expected::Global(expected) =
        job::expected_results(&spec.spec.job, &positions).expect("oracle")
    else {
        panic!("global");
    };
    assert_eq!(state, expected);
    // The partitions grow while the job runs: the new lines are read exactly once (an object's
    // size is asked for about once a second while it is at its end).
    input.write(3, 2000, 3000).await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let sp = local.shutdown().await.expect("stop");
    let (state, positions, _) = snapshot_state(&sp.url).await;
    for p in 0..3u32 {
        assert_eq!(
            positions.get(&p),
            Some(&input.len(p)),
            "partition {p} was read to its end"
        );
    }
    let Expected::Global(expected) =
        job::expected_results(&spec.spec.job, &positions).expect("oracle")
    else {
        panic!("global");
    };
    assert_eq!(state, expected);
    let total: i64 = state.values().sum();
    assert_eq!(total, 3 * (0..3000i64).map(|i| i % 13).sum::<i64>());
}

/// `keyshift local` as a user runs it (the binary, a manifest file edited while it runs,
/// SIGINT), for the key-group ceiling scenario: a job at 24 subtasks with no maxParallelism (so
/// 128 groups by Flink's rule) is asked for 200.
struct LocalCli {
    child: std::process::Child,
    lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl LocalCli {
    fn start(manifest: &std::path::Path, state_dir: &std::path::Path) -> LocalCli {
        Self::start_with_env(manifest, state_dir, &[])
    }

    /// [`LocalCli::start`] with extra environment (test hooks), which its workers inherit.
    fn start_with_env(
        manifest: &std::path::Path,
        state_dir: &std::path::Path,
        envs: &[(&str, &str)],
    ) -> LocalCli {
        use std::io::BufRead;
        let mut child = std::process::Command::new(bin())
            .envs(envs.iter().copied())
            .args(["local", "--progress-every", "1", "--state-dir"])
            .arg(state_dir)
            .arg(manifest)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .expect("keyshift local starts");
        let out = child.stdout.take().expect("stdout");
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        LocalCli { child, lines }
    }

    /// The first line (from the start) that contains `needle`, waiting up to `timeout`.
    fn wait_line(&self, needle: &str, timeout: Duration) -> String {
        let start = std::time::Instant::now();
        loop {
            if let Some(l) = self
                .lines
                .lock()
                .unwrap()
                .iter()
                .find(|l| l.contains(needle))
            {
                return l.clone();
            }
            assert!(
                start.elapsed() < timeout,
                "no line with {needle:?} within {timeout:?}; output:\n{}",
                self.lines.lock().unwrap().join("\n")
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn count(&self, needle: &str) -> usize {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }

    /// SIGINT (Ctrl-C): stops with a savepoint; returns its URL once the process exited 0.
    fn interrupt(mut self) -> (String, LocalCli) {
        // SAFETY: kill(2) on our own child's pid.
        let rc = unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        assert_eq!(rc, 0, "SIGINT delivered");
        let line = self.wait_line("stopped with savepoint ", Duration::from_secs(180));
        let status = self.child.wait().expect("keyshift local exits");
        assert!(status.success(), "keyshift local exited with {status}");
        let url = line
            .split("stopped with savepoint ")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .expect("savepoint URL")
            .to_owned();
        (url, self)
    }
}

impl Drop for LocalCli {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn ceiling_manifest(replicas: u32, extra: &str) -> String {
    format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {{name: wide, namespace: test}}
spec:
  replicas: {replicas}{extra}
  job:
    source:
      generator: {{partitions: 24, keys: 3000, seed: 11, recordsPerSecond: 150, recordsPerPartition: 9000}}
    key: {{field: key, type: string}}
    aggregation: {{function: count}}
  state:
    checkpointInterval: 2s
"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_cli_raises_the_key_group_ceiling_from_24_to_200_in_one_edit() {
    let dir = tempfile::tempdir().expect("temp dir");
    let manifest = dir.path().join("wide.yaml");
    let state = dir.path().join("state");
    std::fs::write(&manifest, ceiling_manifest(24, "")).expect("manifest written");

    let cli = LocalCli::start(&manifest, &state);
    cli.wait_line("running at parallelism 24", Duration::from_secs(180));
    cli.wait_line("checkpoint 1 committed", Duration::from_secs(120));

    // Asking for 200 alone is refused with the one edit that works; nothing stops.
    std::fs::write(&manifest, ceiling_manifest(200, "")).expect("manifest edited");
    let refused = cli.wait_line("replicas 200 exceeds 128", Duration::from_secs(30));
    assert!(refused.contains("nothing was changed"), "{refused}");
    assert!(
        refused.contains("set `maxParallelism: 1024` and `replicas: 200`"),
        "{refused}"
    );
    let progress_before = cli.count("parallelism 24: ");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while cli.count("parallelism 24: ") < progress_before + 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the job kept running at 24"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(cli.count("rescaling"), 0, "no rescale was attempted");

    // The edit the guidance names, while the job runs: savepoint, rewrite, verify, restore.
    std::fs::write(&manifest, ceiling_manifest(200, "\n  maxParallelism: 1024"))
        .expect("manifest edited");
    cli.wait_line(
        "changing the key-group count 128 -> 1024 (parallelism 24 -> 200)",
        Duration::from_secs(30),
    );
    for step in [
        "step Verifying",
        "step Stopping",
        "step Rewriting",
        "step VerifyingRewrite",
        "step Restoring",
    ] {
        cli.wait_line(step, Duration::from_secs(120));
    }
    let rewrote = cli.wait_line("SavepointRewritten: ", Duration::from_secs(120));
    let (sp, target) = rewrote
        .split_once("SavepointRewritten: ")
        .and_then(|(_, rest)| rest.split_once(" rewritten to 1024 key groups as "))
        .map(|(sp, rest)| {
            (
                sp.to_owned(),
                rest.split_once(": ").map_or(rest, |(t, _)| t).to_owned(),
            )
        })
        .expect("the rewrite names its source and target");
    cli.wait_line("RewriteVerified: ", Duration::from_secs(120));
    // 200 worker processes start on 2 cores: minutes under load.
    cli.wait_line("running at parallelism 200", Duration::from_secs(600));
    let changed = cli.wait_line("KeyGroupsChanged: ", Duration::from_secs(30));
    assert!(changed.contains("reversible"), "{changed}");
    let (before, before_pos, m0) = snapshot_state(&sp).await;
    let (rewritten, rewritten_pos, m1) = snapshot_state(&target).await;
    assert_eq!((m0.max_parallelism, m1.max_parallelism), (128, 1024));
    assert_eq!(m1.parallelism, 200);
    assert!(!before.is_empty());
    assert!(before == rewritten, "the rewrite keeps every key's value");
    assert_eq!(before_pos, rewritten_pos, "and every source position");
    cli.wait_line("KeyGroupChangeIrreversible: ", Duration::from_secs(180));
    let (sp2, _cli) = cli.interrupt();
    let spec = job(&ceiling_manifest(200, "\n  maxParallelism: 1024"));
    let (after, after_pos, m2) = snapshot_state(&sp2).await;
    assert_eq!((m2.max_parallelism, m2.parallelism), (1024, 200));
    assert_eq!(after_pos.len(), 24, "every partition has a position");
    for (p, at) in &before_pos {
        assert!(
            after_pos[p] >= *at,
            "partition {p} went back: {at} -> {}",
            after_pos[p]
        );
    }
    let Expected::Global(expected) =
        job::expected_results(&spec.spec.job, &after_pos).expect("oracle runs")
    else {
        panic!("expected a global aggregate");
    };
    assert!(
        after == expected,
        "every key exact at 200 under 1024 groups"
    );
    // The original savepoint is untouched.
    let (again, again_pos, _) = snapshot_state(&sp).await;
    assert!(again == before && again_pos == before_pos);

    // Running again resumes the job's own newest state under 1024 groups.
    let cli = LocalCli::start(&manifest, &state);
    let resumed = cli.wait_line("resuming from ", Duration::from_secs(30));
    assert!(
        resumed.ends_with(&format!("resuming from {sp2}")),
        "resumed from its own newest snapshot {sp2}: {resumed}"
    );
    cli.wait_line("running at parallelism 200", Duration::from_secs(300));
    let (sp3, _cli) = cli.interrupt();
    let (last, last_pos, _) = snapshot_state(&sp3).await;
    for (p, at) in &after_pos {
        assert!(last_pos[p] >= *at, "partition {p} went back");
    }
    let Expected::Global(expected) =
        job::expected_results(&spec.spec.job, &last_pos).expect("oracle runs")
    else {
        panic!("expected a global aggregate");
    };
    assert!(last == expected, "every key exact after resuming");
}

/// A restore that outlasts the per-request control timeout still starts: `/v1/start` answers at
/// once and the coordinator polls `/v1/status` until the state is restored. Here the timeout is
/// 2 s and each worker's restore takes 5 s longer than its reads (test hooks); with a start that
/// answered only once restored, the run never started.
#[cfg(feature = "test-hooks")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_slower_than_the_control_request_timeout_still_starts() {
    use keyshift::failpoints::{CONTROL_REQUEST_ENV, SLOW_RESTORE_ENV};
    let dir = tempfile::tempdir().expect("temp dir");
    let manifest = dir.path().join("slow.yaml");
    let state = dir.path().join("state");
    std::fs::write(
        &manifest,
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {name: slow, namespace: test}
spec:
  replicas: 2
  job:
    source:
      generator: {partitions: 4, keys: 500, seed: 5, recordsPerSecond: 200}
    key: {field: key, type: string}
    aggregation: {function: count}
  state:
    checkpointInterval: 1s
",
    )
    .expect("manifest written");
    let cli = LocalCli::start(&manifest, &state);
    cli.wait_line("running at parallelism 2", Duration::from_secs(120));
    cli.wait_line("checkpoint 1 committed", Duration::from_secs(60));
    let (sp, cli) = cli.interrupt();
    drop(cli);

    let cli = LocalCli::start_with_env(
        &manifest,
        &state,
        &[(SLOW_RESTORE_ENV, "5000"), (CONTROL_REQUEST_ENV, "2000")],
    );
    cli.wait_line(&format!("resuming from {sp}"), Duration::from_secs(30));
    let started = cli.wait_line("started: ", Duration::from_secs(120));
    // "... running in <ms> ms, restored <g> key groups (<bytes> bytes) from <url>"
    let number_before = |unit: &str| -> u64 {
        let head = started.split(unit).next().expect("unit present");
        head.rsplit([' ', '('])
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no number before {unit:?} in {started}"))
    };
    assert!(
        number_before(" ms,") >= 5000,
        "the start waited out the slowed restore: {started}"
    );
    assert!(
        number_before(" bytes)") > 0,
        "state was restored: {started}"
    );
    assert!(started.ends_with(&format!("from {sp}")), "{started}");
    cli.wait_line("running at parallelism 2", Duration::from_secs(30));
    let (after, _cli) = cli.interrupt();
    let (state_after, positions, _) = snapshot_state(&after).await;
    assert!(!state_after.is_empty(), "the restored job kept its keys");
    let spec = job(&std::fs::read_to_string(&manifest).expect("manifest"));
    let Expected::Global(expected) =
        job::expected_results(&spec.spec.job, &positions).expect("oracle runs")
    else {
        panic!("expected a global aggregate");
    };
    assert!(
        state_after == expected,
        "every key exact after the slow restore"
    );
}

/// Appends JSON lines `from..to` to `dir/name` (long account keys, amounts to sum); `salt`
/// makes each file's records differ.
fn append_lines(dir: &std::path::Path, name: &str, from: i64, to: i64, salt: i64) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(name))
        .expect("open");
    for i in from..to {
        writeln!(
            f,
            "{{\"account\":{},\"amount\":{},\"ts\":{}}}",
            (i * 7 + salt) % 50,
            (i + salt) % 13,
            i
        )
        .expect("write");
    }
}

/// A sum over the JSON-lines files in `input`.
fn file_sum_job(name: &str, input: &std::path::Path) -> StreamJob {
    job(&format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {{name: {name}, namespace: test}}
spec:
  replicas: 2
  maxParallelism: 64
  job:
    source:
      file: {{path: 'file://{}'}}
    key: {{field: account, type: long}}
    aggregation: {{function: sum, field: amount}}
  state:
    checkpointInterval: 1h
",
        input.display()
    ))
}

/// Every file of `input` by name with its length.
fn file_lengths(input: &std::path::Path) -> BTreeMap<String, u64> {
    std::fs::read_dir(input)
        .expect("input dir")
        .map(|e| {
            let e = e.expect("entry");
            (
                e.file_name().into_string().expect("utf-8 name"),
                e.metadata().expect("metadata").len(),
            )
        })
        .collect()
}

/// A snapshot's positions by file name (its `sourcePartitions` beside `sourcePositions`).
fn positions_by_name(m: &snapshot::Manifest) -> BTreeMap<String, u64> {
    m.source_positions
        .iter()
        .map(|(p, o)| {
            let name = m
                .source_partitions
                .get(p)
                .unwrap_or_else(|| panic!("partition {p} has no name in the manifest"));
            (name.clone(), *o)
        })
        .collect()
}

/// Checkpoints until every file of `input` has been read to its end (by name), or a position is
/// past its file's end, then stops with a savepoint; returns its URL.
async fn read_to_end_and_suspend(local: &mut LocalJob, input: &std::path::Path) -> String {
    let want = file_lengths(input);
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let c = local.checkpoint().await.expect("checkpoint");
        let (_, _, m) = read_state(&c.url).await;
        let got = positions_by_name(&m);
        // An offset past its file's end never catches up: stop waiting (the sums will tell).
        let past_end = got
            .iter()
            .any(|(name, o)| want.get(name).is_some_and(|len| o > len));
        if got == want || past_end {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the files were not read to their ends: {got:?}, want {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    local.shutdown().await.expect("stop with savepoint").url
}

/// The exact sums over every record of every file now in `input`.
fn oracle_over_all_files(spec: &StreamJob, input: &std::path::Path) -> BTreeMap<Key, i64> {
    // The oracle reads partition i as the i-th file in name order.
    let ends: BTreeMap<u32, u64> = file_lengths(input)
        .values()
        .enumerate()
        .map(|(i, len)| (i as u32, *len))
        .collect();
    let Expected::Global(expected) = job::expected_results(&spec.spec.job, &ends).expect("oracle")
    else {
        panic!("global");
    };
    expected
}

/// Text of every worker log.
fn worker_logs(logs: &std::path::Path) -> String {
    let mut all = String::new();
    for e in std::fs::read_dir(logs).expect("log dir") {
        all.push_str(&std::fs::read_to_string(e.expect("entry").path()).unwrap_or_default());
    }
    all
}

/// Files added to the source directory between runs, with names that sort before the existing
/// ones (so every existing file's index shifts), are read from their start, and every existing
/// file resumes at its own offset, at the same or another parallelism: the final sums equal the
/// oracle over all records of all files, none skipped, none read twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_added_between_runs_are_read_once_and_the_others_resume_on_their_own_files() {
    let env = env(None);
    let input = env._dir.path().join("input");
    std::fs::create_dir_all(&input).expect("input dir");
    // Files of different lengths, so an offset applied to another file lands somewhere else.
    append_lines(&input, "part-1.jsonl", 0, 1500, 1);
    append_lines(&input, "part-2.jsonl", 0, 900, 2);
    append_lines(&input, "part-3.jsonl", 0, 1200, 3);
    let spec = file_sum_job("added", &input);
    let mut local = LocalJob::new(&spec, env.storage.clone(), bin(), env.logs.clone())
        .await
        .expect("job prepares");
    local.launch(2, None).await.expect("launch");
    let sp1 = read_to_end_and_suspend(&mut local, &input).await;
    let (_, _, m1) = read_state(&sp1).await;
    assert_eq!(
        m1.source_partitions.values().collect::<Vec<_>>(),
        ["part-1.jsonl", "part-2.jsonl", "part-3.jsonl"],
        "the savepoint names its partitions"
    );

    // Between runs: the files grow (the restored offsets are now inside them) and a file that
    // sorts first appears. Restore at another parallelism.
    append_lines(&input, "part-1.jsonl", 1500, 1800, 1);
    append_lines(&input, "part-3.jsonl", 1200, 1300, 3);
    append_lines(&input, "part-0.jsonl", 0, 700, 0);
    local
        .launch(3, Some(sp1.clone()))
        .await
        .expect("restore at 3 with a new file");
    let sp2 = read_to_end_and_suspend(&mut local, &input).await;
    let (state, _, m2) = read_state(&sp2).await;
    assert_eq!(m2.source_partitions.len(), 4);
    let expected = oracle_over_all_files(&spec, &input);
    let sums: BTreeMap<Key, i64> = state
        .into_iter()
        .map(|(k, v)| match v {
            AccValue::Scalar(x) => (k, x),
            AccValue::Windows(_) => panic!("unexpected windowed state"),
        })
        .collect();
    assert!(
        sums == expected,
        "after a file was added before the others, the sums equal the oracle over all files"
    );
    let logs = worker_logs(&env.logs);
    assert!(
        logs.contains("reading it from the start") && logs.contains("part-0.jsonl"),
        "the new file is logged"
    );

    // Again, back at 2: another file sorting before all others.
    append_lines(&input, "a-first.jsonl", 0, 450, 5);
    append_lines(&input, "part-2.jsonl", 900, 1000, 2);
    local
        .launch(2, Some(sp2))
        .await
        .expect("restore at 2 with another new file");
    let sp3 = read_to_end_and_suspend(&mut local, &input).await;
    let (state, _, m3) = snapshot_state(&sp3).await;
    assert_eq!(positions_by_name(&m3), file_lengths(&input));
    let expected = oracle_over_all_files(&spec, &input);
    assert_eq!(state.len(), expected.len());
    assert!(
        state == expected,
        "the sums equal the oracle over every record of every file"
    );
    let records: i64 = [(1, 1800), (2, 1000), (3, 1300), (0, 700), (5, 450)]
        .iter()
        .map(|(salt, n)| (0..*n).map(|i| (i + salt) % 13).sum::<i64>())
        .sum();
    assert_eq!(state.values().sum::<i64>(), records, "every record once");
}

/// A file that shrank below its restored offset is refused, naming the file: reading on from
/// that offset would skip or garble records. Removing the file instead restores without it
/// (its records up to the offset stay counted) and logs it as gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_shorter_than_its_restored_offset_is_refused_by_name() {
    let env = env(None);
    let input = env._dir.path().join("input");
    std::fs::create_dir_all(&input).expect("input dir");
    append_lines(&input, "part-0.jsonl", 0, 800, 0);
    append_lines(&input, "part-1.jsonl", 0, 1000, 1);
    append_lines(&input, "part-2.jsonl", 0, 600, 2);
    let spec = file_sum_job("shrunk", &input);
    let mut local = LocalJob::new(&spec, env.storage.clone(), bin(), env.logs.clone())
        .await
        .expect("job prepares");
    local.launch(2, None).await.expect("launch");
    let sp = read_to_end_and_suspend(&mut local, &input).await;
    // What part-1 contributed, before it goes.
    let (before, _, _) = snapshot_state(&sp).await;

    let part1 = input.join("part-1.jsonl");
    let full = std::fs::read(&part1).expect("read");
    std::fs::write(&part1, &full[..full.len() / 2]).expect("truncate");
    for p in [2, 3] {
        let e = local
            .launch(p, Some(sp.clone()))
            .await
            .expect_err("a shrunk file is refused");
        let text = e.to_string();
        assert!(
            text.contains("part-1.jsonl") && text.contains("shrank"),
            "the refusal names the file: {text}"
        );
    }

    // Without the file: the others resume at their offsets, nothing of part-1 is read again.
    std::fs::remove_file(&part1).expect("remove");
    append_lines(&input, "part-2.jsonl", 600, 700, 2);
    local
        .launch(2, Some(sp.clone()))
        .await
        .expect("restore without the file");
    let sp2 = read_to_end_and_suspend(&mut local, &input).await;
    let (after, _, _) = snapshot_state(&sp2).await;
    let mut expected = before;
    for i in 600..700i64 {
        *expected.entry(Key::Long((i * 7 + 2) % 50)).or_insert(0) += (i + 2) % 13;
    }
    assert!(
        after == expected,
        "the state is the savepoint's plus exactly the lines appended since"
    );
    assert!(
        worker_logs(&env.logs).contains("is gone"),
        "the removed file is logged"
    );
}

/// A run of worker processes driven by a coordinator of the test's own, so that the test can
/// also call each worker's control API (it knows the endpoints and the token).
struct OwnRun {
    workers: keyshift::local::harness::LocalWorkers,
    coordinator: keyshift::orchestrator::coordinator::Coordinator,
    endpoints: Vec<keyshift::orchestrator::coordinator::WorkerEndpoint>,
    token: String,
    http: reqwest::Client,
}

/// The key-group assignment of `spec` at its replicas.
fn own_assignment(spec: &StreamJob) -> keyshift::keygroup::Assignment {
    keyshift::keygroup::Assignment::new(
        i64::from(spec.spec.replicas),
        i64::from(spec.spec.max_parallelism.expect("maxParallelism")),
    )
    .expect("assignment")
}

/// A coordinator of `spec` (namespace `test`) for `endpoints`.
async fn own_coordinator(
    spec: &StreamJob,
    env: &Env,
    endpoints: &[keyshift::orchestrator::coordinator::WorkerEndpoint],
    token: &str,
) -> keyshift::orchestrator::coordinator::Coordinator {
    use keyshift::orchestrator::run;
    let name = spec.metadata.name.clone().expect("a name");
    run::coordinator(
        &spec.spec,
        &env.storage,
        run::identity("test", &name, &spec.spec),
        own_assignment(spec),
        endpoints.to_vec(),
        token.to_owned(),
        &run::sink_credentials_from_env(&spec.spec).expect("credentials"),
    )
    .await
    .expect("coordinator")
}

/// The start request of a fresh run of `spec` (namespace `test`) at its replicas, empty state.
fn own_template(spec: &StreamJob, env: &Env) -> keyshift::runtime::protocol::StartRequest {
    use keyshift::orchestrator::run;
    let name = spec.metadata.name.clone().expect("a name");
    let run_id = run::new_run_id().expect("run id");
    run::StartPlan {
        namespace: "test",
        name: &name,
        spec: &spec.spec,
        assignment: own_assignment(spec),
        storage: &env.storage,
        restore_from: None,
        run: &run_id,
        state_payload_bytes: 0,
    }
    .request()
    .expect("start request")
}

impl OwnRun {
    /// Starts `spec` (namespace `test`) at its replicas with empty state.
    async fn start(spec: &StreamJob, env: &Env) -> OwnRun {
        use keyshift::orchestrator::run;
        let assignment = own_assignment(spec);
        let token = run::new_token().expect("token");
        let mut workers = keyshift::local::harness::LocalWorkers::new(bin(), env.logs.clone());
        let endpoints = workers
            .spawn(assignment.parallelism(), &token, 1)
            .await
            .expect("workers spawn");
        let coordinator = own_coordinator(spec, env, &endpoints, &token).await;
        coordinator
            .start(&own_template(spec, env), Duration::from_secs(60))
            .await
            .expect("the run starts");
        OwnRun {
            workers,
            coordinator,
            endpoints,
            token,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .no_proxy()
                .build()
                .expect("client"),
        }
    }

    /// Posts `path` to worker `i`; the HTTP status.
    async fn post(&self, i: usize, path: &str, body: serde_json::Value) -> u16 {
        self.http
            .post(format!("{}{path}", self.endpoints[i].control))
            .bearer_auth(&self.token)
            .json(&body)
            .send()
            .await
            .expect("answered")
            .status()
            .as_u16()
    }

    /// Snapshot `id`'s status on worker `i`.
    async fn status_of(&self, i: usize, id: u64) -> keyshift::runtime::protocol::CheckpointStatus {
        self.http
            .get(format!("{}/v1/checkpoints/{id}", self.endpoints[i].control))
            .bearer_auth(&self.token)
            .send()
            .await
            .expect("checkpoint status answered")
            .json()
            .await
            .expect("a checkpoint status")
    }

    /// Every worker reports snapshot `id` failed with an error starting with `reason`.
    async fn assert_failed_everywhere(&self, id: u64, reason: &str) {
        for i in 0..self.endpoints.len() {
            let status = self.status_of(i, id).await;
            assert!(
                matches!(
                    &status,
                    keyshift::runtime::protocol::CheckpointStatus::Failed { error }
                        if error.starts_with(reason)
                ),
                "worker {i}: snapshot {id} is {status:?}, not {reason}"
            );
        }
    }

    async fn snapshot(
        &mut self,
        kind: snapshot::SnapshotKind,
    ) -> Result<
        keyshift::orchestrator::coordinator::Completed,
        keyshift::orchestrator::coordinator::CoordinatorError,
    > {
        self.coordinator
            .snapshot(
                kind,
                kind == snapshot::SnapshotKind::Savepoint,
                Duration::from_secs(30),
            )
            .await
    }
}

/// The trigger of snapshot 5 reached only worker 0 (as when a coordinator's trigger fails on the
/// others, or a coordinator died while triggering): its source's barrier reaches every keyed
/// operator, which blocks that input and waits for the barriers of 5 from the other sources,
/// which never come. The next checkpoint (6) supersedes 5 at every operator: it commits, with the
/// same worker processes, and its state and the final savepoint's are exact. Before, barrier 6
/// made every operator fail ("arrived while aligning barrier 5") and the job died. Then a
/// snapshot triggered on one worker and aborted on all through the control API, and a
/// coordinator that takes the workers over and continues above its id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trigger_that_reached_some_workers_is_superseded_by_the_next_checkpoint() {
    let env = env(None);
    let spec = generator_job("partial", "", 3, 128, "{function: count}");
    // An earlier coordinator's snapshot 5 left a directory: this coordinator's ids start at 6.
    let state = PathBuf::from(env.storage.trim_start_matches("file://"));
    let orphan = state.join("test/partial/checkpoints/chk-5");
    std::fs::create_dir_all(&orphan).expect("orphan dir");
    std::fs::write(orphan.join("state-0-of-3.bin"), b"x").expect("orphan file");
    let mut run = OwnRun::start(&spec, &env).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let trigger = |id: u64| serde_json::json!({"id": id, "kind": "checkpoint", "lastCommitted": 0});
    assert_eq!(run.post(0, "/v1/checkpoints", trigger(5)).await, 202);
    // Barrier 5 reaches every operator, which then holds back worker 0's records.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let c = run
        .snapshot(snapshot::SnapshotKind::Checkpoint)
        .await
        .expect("the next checkpoint commits");
    assert_eq!(c.id, 6);
    assert_exact(&spec, &c.url).await;
    run.assert_failed_everywhere(5, "aborted: superseded by snapshot 6")
        .await;
    assert_eq!(run.workers.exited(), None, "every worker kept running");
    // A trigger of 5 again (a slow retry) is ignored; one below it is refused.
    for (id, code) in [(5, 202), (4, 409)] {
        assert_eq!(
            run.post(1, "/v1/checkpoints", trigger(id)).await,
            code,
            "trigger of {id}"
        );
    }
    // Snapshot 100 is triggered on worker 0 only and aborted on every worker through the control
    // API (as by a coordinator that died in between): the operators stop aligning it. A
    // coordinator that takes the workers over continues above 100, which storage knows nothing
    // of, and its checkpoint commits.
    assert_eq!(run.post(0, "/v1/checkpoints", trigger(100)).await, 202);
    tokio::time::sleep(Duration::from_millis(300)).await;
    for i in 0..3 {
        assert_eq!(
            run.post(i, "/v1/checkpoints/100/abort", serde_json::Value::Null)
                .await,
            200
        );
    }
    run.assert_failed_everywhere(100, "aborted: snapshot 100 was abandoned")
        .await;
    run.coordinator = own_coordinator(&spec, &env, &run.endpoints, &run.token).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let c = run
        .snapshot(snapshot::SnapshotKind::Checkpoint)
        .await
        .expect("the checkpoint of the coordinator that took over commits");
    assert_eq!(c.id, 101);
    assert_exact(&spec, &c.url).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let sp = run
        .snapshot(snapshot::SnapshotKind::Savepoint)
        .await
        .expect("stop with a savepoint");
    let (state, positions) = assert_exact(&spec, &sp.url).await;
    assert_eq!(
        state.values().sum::<i64>() as u64,
        positions.values().sum::<u64>()
    );
    assert_eq!(run.workers.exited(), None);
    run.workers.stop_all().await;
}

/// A checkpoint that fails on one subtask (its state file is blocked by a directory) is aborted
/// on every worker: the others report it failed (aborted), none pending or completed; the next
/// checkpoint commits, and what the sink emitted meanwhile is published exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_that_failed_on_one_subtask_is_aborted_on_every_worker() {
    let env = env(None);
    let out = env._dir.path().join("out");
    let spec = windowed_sink_job("aborted", 9, "300ms", &file_url(&out));
    let mut run = OwnRun::start(&spec, &env).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let first = run
        .snapshot(snapshot::SnapshotKind::Checkpoint)
        .await
        .expect("checkpoint");
    let n = first.id + 1;
    let state = PathBuf::from(env.storage.trim_start_matches("file://"));
    std::fs::create_dir_all(
        state.join(format!("test/aborted/checkpoints/chk-{n}/state-2-of-3.bin")),
    )
    .expect("state trap");
    tokio::time::sleep(Duration::from_millis(700)).await;
    let e = run
        .snapshot(snapshot::SnapshotKind::Checkpoint)
        .await
        .expect_err("a checkpoint that one subtask cannot take fails");
    assert!(
        e.to_string()
            .contains(&format!("snapshot {n} failed on subtask 2")),
        "{e}"
    );
    // Subtask 2 keeps its own error; the others, whose state was written, report the abort.
    for i in 0..3 {
        let status = run.status_of(i, n).await;
        let reason = if i == 2 {
            "object store write"
        } else {
            "aborted"
        };
        assert!(
            matches!(
                &status,
                keyshift::runtime::protocol::CheckpointStatus::Failed { error }
                    if error.starts_with(reason)
            ),
            "worker {i}: snapshot {n} is {status:?}, not {reason}"
        );
    }
    assert_eq!(run.workers.exited(), None, "every worker kept running");
    tokio::time::sleep(Duration::from_millis(700)).await;
    let next = run
        .snapshot(snapshot::SnapshotKind::Checkpoint)
        .await
        .expect("the next checkpoint commits");
    assert_eq!(next.id, n + 1);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let sp = run
        .snapshot(snapshot::SnapshotKind::Savepoint)
        .await
        .expect("stop with a savepoint");
    run.workers.stop_all().await;
    let (seen, ids) = published_windows(&file_url(&out)).await;
    assert!(
        !ids.contains(&n),
        "the aborted checkpoint published nothing: {ids:?}"
    );
    assert!(ids.contains(&(n + 1)), "{ids:?}");
    let (open, positions, _) = snapshot_state_windows(&sp.url).await;
    assert_emitted_and_open_are_exact(&spec, seen, open, &positions, "published");
}

/// Sends `signal` (`-STOP`, `-CONT`) to process `pid`.
fn signal(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill {signal} {pid}");
}

/// A file appears in the source directory while a run starts, after subtask 0 listed the
/// directory and before subtask 1 did (subtask 1 is paused while the start requests go out): the
/// workers would read different partition lists (partition 1 would be `part-1.jsonl` for one and
/// the new file for the other: a file read twice, another never). The start is refused, naming
/// both lists' sizes; started again with the directory stable, the run reads every record of
/// every file exactly once. Before, the start succeeded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_whose_workers_listed_different_files_is_refused_and_a_stable_retry_is_exact() {
    use keyshift::orchestrator::run;
    let env = env(None);
    let input = env._dir.path().join("input");
    std::fs::create_dir_all(&input).expect("input dir");
    append_lines(&input, "part-0.jsonl", 0, 700, 0);
    append_lines(&input, "part-1.jsonl", 0, 900, 1);
    append_lines(&input, "part-2.jsonl", 0, 500, 2);
    let spec = file_sum_job("listing", &input);
    let token = run::new_token().expect("token");
    let mut workers = keyshift::local::harness::LocalWorkers::new(bin(), env.logs.clone());
    let endpoints = workers.spawn(2, &token, 1).await.expect("workers spawn");
    let paused = workers.pids()[1];
    let coordinator = own_coordinator(&spec, &env, &endpoints, &token).await;
    let template = own_template(&spec, &env);
    signal(paused, "-STOP");
    let (result, ()) = tokio::join!(
        coordinator.start(&template, Duration::from_secs(60)),
        async {
            // Subtask 0 lists three files; then one more appears, sorting among them.
            tokio::time::sleep(Duration::from_secs(2)).await;
            append_lines(&input, "part-0a.jsonl", 0, 400, 4);
            signal(paused, "-CONT");
        }
    );
    let text = result
        .expect_err("a start whose workers listed different files is refused")
        .to_string();
    assert!(
        text.contains("listed different source partitions")
            && text.contains("subtask 0 3 files")
            && text.contains("subtask 1 4 files"),
        "{text}"
    );
    workers.stop_all().await;

    // Started again, the directory stable: every record of every file once.
    let mut local = LocalJob::new(&spec, env.storage.clone(), bin(), env.logs.clone())
        .await
        .expect("job prepares");
    local.launch(2, None).await.expect("the retry starts");
    let sp = read_to_end_and_suspend(&mut local, &input).await;
    let (state, _, m) = snapshot_state(&sp).await;
    assert_eq!(positions_by_name(&m), file_lengths(&input));
    let expected = oracle_over_all_files(&spec, &input);
    assert!(
        state == expected,
        "the sums equal the oracle over every record of every file"
    );
}

/// `n` workers served by this test process (so that a test hook reaches each of them): their
/// endpoints, in subtask order. They run until the test's runtime ends.
#[cfg(feature = "test-hooks")]
async fn in_process_workers(
    n: u32,
    token: &str,
) -> Vec<keyshift::orchestrator::coordinator::WorkerEndpoint> {
    use keyshift::runtime::worker::{self, WorkerConfig};
    let loopback: std::net::SocketAddr = "127.0.0.1:0".parse().expect("loopback");
    let mut endpoints = Vec::new();
    for _ in 0..n {
        let bound = worker::bind(WorkerConfig {
            control_addr: loopback,
            data_addr: loopback,
            token: token.to_owned(),
            programs: Default::default(),
        })
        .await
        .expect("bind");
        endpoints.push(keyshift::orchestrator::coordinator::WorkerEndpoint {
            control: format!("http://{}", bound.control_addr),
            data: bound.data_addr.to_string(),
        });
        tokio::spawn(bound.serve(std::future::pending()));
    }
    endpoints
}

/// The checkpoint timeout: subtask 1's state write of one checkpoint takes longer than the
/// checkpoint's timeout (a test hook) while the others acknowledge it. The coordinator times
/// out naming subtask 1, aborts the checkpoint on every worker (each reports it failed,
/// aborted; none pending, none completed), nothing is committed, the job keeps running, and the
/// next checkpoint commits with every key exact.
#[cfg(feature = "test-hooks")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_one_worker_never_acknowledges_times_out_and_is_aborted_everywhere() {
    use keyshift::failpoints::slow_snapshots_of;
    use keyshift::orchestrator::run;
    use keyshift::runtime::protocol::{CheckpointStatus, WorkerState, WorkerStatus};
    let env = env(None);
    let spec = generator_job("stalled", "", 3, 128, "{function: count}");
    let token = run::new_token().expect("token");
    let endpoints = in_process_workers(3, &token).await;
    let mut coordinator = own_coordinator(&spec, &env, &endpoints, &token).await;
    coordinator
        .start(&own_template(&spec, &env), Duration::from_secs(60))
        .await
        .expect("the run starts");
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .no_proxy()
        .build()
        .expect("client");
    let get = |i: usize, path: String| {
        let http = http.clone();
        let url = format!("{}{path}", endpoints[i].control);
        let token = token.clone();
        async move {
            http.get(url)
                .bearer_auth(token)
                .send()
                .await
                .expect("answered")
                .text()
                .await
                .expect("a body")
        }
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let first = coordinator
        .snapshot(
            snapshot::SnapshotKind::Checkpoint,
            false,
            Duration::from_secs(30),
        )
        .await
        .expect("the first checkpoint commits");

    // Subtask 1 writes its state 6 s late; the checkpoint's timeout is 2 s.
    slow_snapshots_of("test", "stalled", 1, Some(Duration::from_secs(6)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stalled = first.id + 1;
    let e = coordinator
        .snapshot(
            snapshot::SnapshotKind::Checkpoint,
            false,
            Duration::from_secs(2),
        )
        .await
        .expect_err("a checkpoint that subtask 1 does not acknowledge in time fails");
    slow_snapshots_of("test", "stalled", 1, None);
    assert!(
        matches!(
            &e,
            keyshift::orchestrator::coordinator::CoordinatorError::SnapshotTimeout { id, missing, .. }
                if *id == stalled && missing.contains(&1)
        ),
        "{e}"
    );
    for i in 0..3 {
        let status: CheckpointStatus =
            serde_json::from_str(&get(i, format!("/v1/checkpoints/{stalled}")).await)
                .expect("a checkpoint status");
        assert!(
            matches!(&status, CheckpointStatus::Failed { error } if error.starts_with("aborted")),
            "worker {i}: snapshot {stalled} is {status:?}, not aborted"
        );
    }
    let state = PathBuf::from(env.storage.trim_start_matches("file://"));
    assert!(
        !state
            .join(format!(
                "test/stalled/checkpoints/chk-{stalled}/_manifest.json"
            ))
            .exists(),
        "nothing committed"
    );

    // The job keeps running, and the next checkpoint (once subtask 1's write is done) commits.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let next = coordinator
        .snapshot(
            snapshot::SnapshotKind::Checkpoint,
            false,
            Duration::from_secs(30),
        )
        .await
        .expect("the next checkpoint commits");
    assert_eq!(next.id, stalled + 1);
    assert_exact(&spec, &next.url).await;
    for i in 0..3 {
        let st: WorkerStatus =
            serde_json::from_str(&get(i, "/v1/status".into()).await).expect("a status");
        assert_eq!(st.state, WorkerState::Running, "worker {i}");
        // Still aborted after its write finished.
        let status: CheckpointStatus =
            serde_json::from_str(&get(i, format!("/v1/checkpoints/{stalled}")).await)
                .expect("a checkpoint status");
        assert!(
            matches!(&status, CheckpointStatus::Failed { .. }),
            "worker {i}: {status:?}"
        );
    }
}

/// A pre-staged rescale (`LocalJob::rescale_prestaged`) 4 -> 8 -> 3: the new workers load the
/// newest checkpoint while the old ones run, the old ones stop with an incremental checkpoint,
/// the new ones read only what they lack of it. Exact after each, the stop checkpoint restores
/// normally too, and the new run's checkpoints build on it.
async fn prestaged_chain(storage: Option<String>) {
    let env = env(storage);
    let spec = generator_job("prestaged", "", 4, 128, "{function: count}");
    let mut local = LocalJob::new(&spec, env.storage.clone(), bin(), env.logs.clone())
        .await
        .expect("job prepares");
    // Every key in the state first (30000 records a second over 3000 keys), then a light load
    // (120 a second), so that the deltas stay small against the state. The records do not
    // depend on the pace (but their timestamps, which a count does not read).
    local.launch(4, None).await.expect("launch at 4");
    tokio::time::sleep(Duration::from_millis(800)).await;
    let built = local.shutdown().await.expect("savepoint");
    if let Some(g) = local.spec.job.source.generator.as_mut() {
        g.records_per_second = Some(20);
    }
    local
        .launch(4, Some(built.url))
        .await
        .expect("launch at 4 under a light load");
    for to in [8, 3] {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let c = local.checkpoint().await.expect("checkpoint");
        assert_exact(&spec, &c.url).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        // Down: every catch-up round (each an incremental checkpoint of the old job whose delta
        // the new workers read).
        local.catch_up = if to == 3 {
            keyshift::runtime::prestage::CatchUp {
                max_rounds: 3,
                short_round: Duration::ZERO,
                shrink_percent: None,
            }
        } else {
            Default::default()
        };
        let r = local
            .rescale_prestaged(to)
            .await
            .unwrap_or_else(|e| panic!("pre-staged rescale to {to}: {e}"));
        assert_eq!(r.fallback, None, "no fallback to {to}");
        let pre = r.prestage.as_ref().expect("pre-staged");
        eprintln!(
            "pre-staged rescale to {to}: {} catch-up rounds",
            pre.catch_up_rounds
        );
        if to == 3 {
            assert_eq!(pre.catch_up_rounds, 3);
        }
        if pre.catch_up_rounds == 0 {
            assert_eq!(
                pre.base, c.url,
                "the new workers loaded the newest checkpoint"
            );
        } else {
            // They caught up with checkpoints of the old job taken after it.
            assert!(checkpoint_id(&pre.base) > checkpoint_id(&c.url));
        }
        assert!(pre.loaded_bytes > 0);
        assert_eq!(local.parallelism(), Some(to));
        // The stop checkpoint builds on the loaded one: it refers to its files.
        let (_, _, m) = snapshot::open_snapshot(&r.savepoint)
            .await
            .expect("manifest");
        assert_eq!(m.kind, snapshot::SnapshotKind::Checkpoint);
        assert!(
            !m.is_self_contained(),
            "the stop checkpoint writes only the delta"
        );
        assert!(
            pre.delta_bytes < r.state_bytes,
            "the stop checkpoint's own files ({}) are less than the state ({})",
            pre.delta_bytes,
            r.state_bytes
        );
        // Read through the normal restore path: exact.
        assert_exact(&spec, &r.savepoint).await;
        let (store, dir) = snapshot::open_snapshot_dir(&r.savepoint).expect("store");
        snapshot::verify(store.as_ref(), &dir)
            .await
            .expect("the stop checkpoint verifies");
        // The new run goes on exactly, and its checkpoints build on the stop checkpoint.
        tokio::time::sleep(Duration::from_millis(400)).await;
        let after = local.checkpoint().await.expect("checkpoint after");
        assert!(
            !after.manifest.is_self_contained(),
            "the new run's checkpoint builds on the stop checkpoint"
        );
        assert_exact(&spec, &after.url).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let sp = local.shutdown().await.expect("stop with savepoint");
    let (state, positions) = assert_exact(&spec, &sp.url).await;
    assert_eq!(
        state.values().sum::<i64>() as u64,
        positions.values().sum::<u64>(),
        "no record lost or applied twice"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prestaged_rescale_up_and_down_is_exact() {
    prestaged_chain(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prestaged_rescale_up_and_down_is_exact_on_s3() {
    if let Some(url) = cloud_url(S3, "prestaged") {
        prestaged_chain(Some(url)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prestaged_rescale_up_and_down_is_exact_on_gcs() {
    if let Some(url) = cloud_url(GCS, "prestaged") {
        prestaged_chain(Some(url)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prestaged_rescale_up_and_down_is_exact_on_azure() {
    if let Some(url) = cloud_url(AZURE, "prestaged") {
        prestaged_chain(Some(url)).await;
    }
}

/// A pre-staged rescale whose old worker (`old`) or new worker (`new`) is killed while the new
/// workers are pre-staged: the new workers are dropped and a normal restore happens, exactly.
async fn prestage_with_a_kill(name: &str, kill_old: bool) {
    let env = env(None);
    let spec = generator_job(name, "", 4, 128, "{function: sum, field: value}");
    let mut local = LocalJob::new(&spec, env.storage.clone(), bin(), env.logs.clone())
        .await
        .expect("job prepares");
    local.launch(4, None).await.expect("launch at 4");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let c = local.checkpoint().await.expect("checkpoint");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut p = local.prestage(8).await.expect("pre-staged");
    assert!(checkpoint_id(&p.base) >= checkpoint_id(&c.url));
    let base = p.base.clone();
    assert_eq!(p.loaded.len(), 8);
    if kill_old {
        local.kill_worker(2).await;
    } else {
        p.kill_worker(5).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = local.finish_prestaged(p).await.expect("the rescale ends");
    let why = r.fallback.as_deref().expect("it fell back");
    assert!(
        why.contains(if kill_old {
            "old subtask"
        } else {
            "new subtask 5"
        }),
        "{why}"
    );
    assert_eq!(local.parallelism(), Some(8));
    if kill_old {
        // The newest committed snapshot was restored.
        assert_eq!(r.savepoint, base);
    }
    assert_exact(&spec, &r.savepoint).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let after = local.checkpoint().await.expect("checkpoint after");
    assert_exact(&spec, &after.url).await;
    let sp = local.shutdown().await.expect("stop with savepoint");
    assert_exact(&spec, &sp.url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prestaged_rescale_with_a_killed_old_worker_falls_back_exactly() {
    prestage_with_a_kill("prestage-old", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prestaged_rescale_with_a_killed_new_worker_falls_back_exactly() {
    prestage_with_a_kill("prestage-new", false).await;
}

/// Windows fired between the checkpoint the new workers loaded and the stop checkpoint leave
/// the state by a delta (their keys' windows removed): a pre-staged rescale in the middle of
/// windows fires each window exactly once, with the exact result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prestaged_rescale_across_fired_windows_emits_each_window_once_and_exactly() {
    let env = env(None);
    let spec = job("apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {name: prestaged-windows, namespace: test}
spec:
  replicas: 2
  maxParallelism: 128
  job:
    source:
      generator: {partitions: 4, keys: 3000, seed: 5, recordsPerSecond: 60}
    key: {field: key}
    aggregation: {function: sum, field: value}
    window: {size: 1s, maxOutOfOrderness: 100ms}
    sink: {type: log}
  state:
    checkpointInterval: 1h
");
    let mut local = LocalJob::new(&spec, env.storage.clone(), bin(), env.logs.clone())
        .await
        .expect("job prepares");
    local.launch(2, None).await.expect("launch");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let c = local.checkpoint().await.expect("checkpoint");
    // At least one window fires between the loaded checkpoint and the stop checkpoint.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let r = local.rescale_prestaged(3).await.expect("pre-staged 2 -> 3");
    assert_eq!(r.fallback, None);
    let pre = r.prestage.as_ref().expect("pre-staged");
    assert!(checkpoint_id(&pre.base) >= checkpoint_id(&c.url));
    let (_, _, m) = snapshot::open_snapshot(&r.savepoint)
        .await
        .expect("manifest");
    assert!(!m.is_self_contained(), "the stop checkpoint is a delta");
    assert!(
        m.watermark > c.manifest.watermark.map(|w| w + 1000),
        "a window fired in between"
    );
    // Groups took the delta over what they loaded (not only whole again).
    let applied: Vec<(u64, u64)> = worker_logs(&env.logs)
        .lines()
        .filter(|l| l.contains("reading only the delta"))
        .map(|l| {
            let field = |name: &str| {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix(name))
                    .and_then(|v| v.trim_matches(|c: char| !c.is_ascii_digit()).parse().ok())
                    .unwrap_or_else(|| panic!("{name} in {l}"))
            };
            (field("groups="), field("replaced="))
        })
        .collect();
    assert_eq!(applied.len(), 3, "every new subtask started pre-staged");
    assert!(
        applied.iter().any(|(groups, replaced)| groups > replaced),
        "some group applied a delta over its loaded state: {applied:?}"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let sp = local.shutdown().await.expect("stop");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (open, positions, _) = snapshot_state_windows(&sp.url).await;
    let seen = fired_windows(&env.logs);
    assert!(
        seen.values().map(BTreeMap::len).sum::<usize>() > 0,
        "some windows fired"
    );
    assert_emitted_and_open_are_exact(&spec, seen, open, &positions, "fired");
}

/// The id of a checkpoint URL (`.../checkpoints/chk-<id>`).
fn checkpoint_id(url: &str) -> u64 {
    url.rsplit('/')
        .next()
        .and_then(|d| snapshot::parse_snapshot_dir_name(snapshot::SnapshotKind::Checkpoint, d))
        .unwrap_or_else(|| panic!("{url} is no checkpoint"))
}

/// A program job over the generator, at parallelism 2, running program `program`.
fn program_manifest(program: &str) -> String {
    format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {{name: refused, namespace: test}}
spec:
  replicas: 2
  job:
    program: {{name: {program}}}
    source:
      generator: {{partitions: 2, keys: 100, seed: 3, recordsPerSecond: 200}}
    sink: {{type: log}}
  state:
    checkpointInterval: 2s
"
    )
}

/// `keyshift local` started on a job naming a program its workers do not carry, once it said
/// the start was refused (that line): its directory (the manifest `refused.yaml`, the state
/// directory `state`) and the running command.
fn refused_local_cli() -> (tempfile::TempDir, LocalCli, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let manifest = dir.path().join("refused.yaml");
    std::fs::write(&manifest, program_manifest("no-such-program")).expect("manifest written");
    let cli = LocalCli::start(&manifest, &dir.path().join("state"));
    let refused = cli.wait_line("StartRefused: ", Duration::from_secs(120));
    (dir, cli, refused)
}

/// `keyshift local` on a job its workers refuse for good (a program their binary does not
/// carry): it says so once, with what the binary carries, starts nothing again while the
/// manifest stays as it is (no retry loop), and runs once the manifest is fixed.
#[test]
fn local_cli_stalls_on_a_start_refused_for_good_and_runs_once_the_manifest_is_fixed() {
    let (dir, cli, refused) = refused_local_cli();
    let (manifest, state) = (dir.path().join("refused.yaml"), dir.path().join("state"));
    assert!(
        refused.contains("\"no-such-program\"") && refused.contains("count"),
        "names the program and what the workers carry: {refused}"
    );
    assert!(refused.contains("No retry can change that"), "{refused}");
    // Long enough for several retries under the old backoff (1 s, 2 s, 4 s ...).
    std::thread::sleep(Duration::from_secs(8));
    assert_eq!(cli.count("StartRefused: "), 1, "said once");
    assert_eq!(cli.count("StartFailed"), 0, "and not retried");
    let worker_logs = || {
        std::fs::read_dir(state.join("logs"))
            .map(|d| {
                d.filter_map(Result::ok)
                    .filter(|e| e.file_name().to_string_lossy().ends_with(".log"))
                    .count()
            })
            .unwrap_or(0)
    };
    assert_eq!(
        worker_logs(),
        2,
        "the refused run's two workers, and no other"
    );

    std::fs::write(&manifest, program_manifest("count")).expect("manifest fixed");
    cli.wait_line("running at parallelism 2", Duration::from_secs(120));
    assert_eq!(worker_logs(), 4, "one more run");
    cli.wait_line("checkpoint 1 committed", Duration::from_secs(60));
    let (_, _cli) = cli.interrupt();
}

/// Ctrl-C while a refused job runs nothing stops `keyshift local` at once.
#[test]
fn local_cli_stops_at_once_on_ctrl_c_when_nothing_runs() {
    let (_dir, mut cli, _) = refused_local_cli();
    let sent = std::time::Instant::now();
    // SAFETY: kill(2) on our own child's pid.
    let rc = unsafe { libc::kill(cli.child.id() as i32, libc::SIGINT) };
    assert_eq!(rc, 0, "SIGINT delivered");
    cli.wait_line("stopped (nothing was running", Duration::from_secs(10));
    let status = cli.child.wait().expect("keyshift local exits");
    assert!(status.success(), "keyshift local exited with {status}");
    assert!(
        sent.elapsed() < Duration::from_secs(10),
        "stopped in {:?}",
        sent.elapsed()
    );
}
