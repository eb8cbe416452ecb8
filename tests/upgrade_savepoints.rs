//! Savepoints written by earlier releases (tests/data/savepoints/<commit>/) restore into this
//! build, and the job continues from them exactly: the built-in job's totals and a program's
//! published output, after more input, equal the oracles' over all the input, old and new.

mod programs_support;

use keyshift::crd::StreamJob;
use keyshift::local::LocalJob;
use keyshift_examples::dedup::{self, Event};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_keyshift"))
}

fn fixtures(release: &str) -> PathBuf {
    // The checkout the test runs in (a reused test executable reads this checkout's fixtures).
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
        .join("tests/data/savepoints")
        .join(release)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("create dir");
    for entry in std::fs::read_dir(from).expect("read fixture dir") {
        let entry = entry.expect("entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("file type").is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy fixture file");
        }
    }
}

/// Appends `lines` to partition file `file` of `dir`.
fn append(dir: &Path, file: u32, lines: &[String]) {
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(dir.join(format!("part-{file}.jsonl")))
        .expect("open partition file");
    for l in lines {
        writeln!(f, "{l}").expect("append");
    }
}

/// Every JSON line of the partition files in `dir`, file by file.
fn lines(dir: &Path) -> Vec<serde_json::Value> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("input dir")
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    files
        .iter()
        .flat_map(|f| {
            std::fs::read_to_string(f)
                .expect("read input")
                .lines()
                .map(|l| serde_json::from_str(l).expect("a JSON line"))
                .collect::<Vec<serde_json::Value>>()
        })
        .collect()
}

/// The job `name` of the fixtures' namespace over `input`, its state in `storage`, restoring
/// `from`; `job` is its `spec.job` lines after the source.
fn spec(name: &str, input: &Path, storage: &str, from: &str, job: &str) -> StreamJob {
    serde_yaml::from_str(&format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {{name: {name}, namespace: fixtures}}
spec:
  replicas: 2
  maxParallelism: 16
  restoreFrom: '{from}'
  job:
    source:
      file: {{path: 'file://{}'}}
{job}
  state:
    storage: '{storage}'
    checkpointInterval: 1h
",
        input.display()
    ))
    .expect("test manifest parses")
}

const SETTLE: Duration = Duration::from_millis(1500);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_built_in_jobs_savepoint_of_b883330_restores_and_continues_exactly() {
    let dir = tempfile::tempdir().expect("temp dir");
    let fx = fixtures("b883330");
    let input = dir.path().join("in");
    copy_dir(&fx.join("in-sum"), &input);
    copy_dir(&fx.join("state"), &dir.path().join("state"));
    let storage = format!("file://{}", dir.path().join("state").display());
    let from = format!("{storage}/fixtures/fixture-sum/savepoints/sp-1");
    let job = "    key: {field: key}\n    aggregation: {function: sum, field: value}";
    let spec = spec("fixture-sum", &input, &storage, &from, job);
    let mut local = LocalJob::new(&spec, storage.clone(), bin(), dir.path().join("logs"))
        .await
        .expect("job prepares");
    let restored = local
        .launch(2, Some(from.clone()))
        .await
        .expect("the earlier release's savepoint restores");
    assert_eq!(restored.restored_from.as_deref(), Some(from.as_str()));
    // More input: old keys and new ones, in both partitions.
    for file in 0..2 {
        let more: Vec<String> = (0..50)
            .map(|i| {
                format!(
                    r#"{{"key":"k-{}","value":{i},"ts":{}}}"#,
                    (i * 7) % 60,
                    500_000 + i
                )
            })
            .collect();
        append(&input, file, &more);
    }
    tokio::time::sleep(SETTLE).await;
    let sp = local.shutdown().await.expect("stop with a savepoint");

    let mut want: BTreeMap<String, i64> = BTreeMap::new();
    for l in lines(&input) {
        let key = l["key"].as_str().expect("key").to_owned();
        *want.entry(key).or_default() += l["value"].as_i64().expect("value");
    }
    let loc = keyshift::offline::open_location(&sp.url).expect("savepoint location");
    let mut dumped = Vec::new();
    keyshift::offline::dump::dump(&loc, None, &mut dumped)
        .await
        .expect("dump");
    let got: BTreeMap<String, i64> = String::from_utf8(dumped)
        .expect("UTF-8")
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("a JSON line"))
        .map(|l| {
            (
                l["key"].as_str().expect("key").to_owned(),
                l["value"].as_i64().expect("value"),
            )
        })
        .collect();
    assert!(want.len() > 40, "old keys and new ones: {}", want.len());
    assert_eq!(got, want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dedup_programs_savepoint_of_b883330_restores_and_publishes_each_first_delivery_once() {
    let dir = tempfile::tempdir().expect("temp dir");
    let fx = fixtures("b883330");
    let input = dir.path().join("in");
    let out = dir.path().join("out");
    copy_dir(&fx.join("in-dedup"), &input);
    copy_dir(&fx.join("out-dedup"), &out);
    copy_dir(&fx.join("state"), &dir.path().join("state"));
    let storage = format!("file://{}", dir.path().join("state").display());
    let from = format!("{storage}/fixtures/fixture-dedup/savepoints/sp-1");
    let job = format!(
        "    program: {{name: dedup, maxOutOfOrderness: 2s}}\n    sink: {{type: objectStore, url: 'file://{}'}}",
        out.display()
    );
    let spec = spec("fixture-dedup", &input, &storage, &from, &job);
    let mut local = LocalJob::new(&spec, storage.clone(), bin(), dir.path().join("logs"))
        .await
        .expect("job prepares");
    local
        .launch(2, Some(from.clone()))
        .await
        .expect("the earlier release's savepoint restores");
    // More deliveries, each id in its own partition (by its number), later in event time: some
    // ids seen within their TTL (not published again), some after it, some new.
    let before = lines(&input);
    let last = before
        .iter()
        .filter_map(|l| l["ts"].as_i64())
        .max()
        .expect("input");
    for file in 0..2u32 {
        let more: Vec<String> = (0..60u32)
            .filter(|i| i % 2 == file)
            .map(|i| {
                let ts = last + 1_000 + i64::from(i) * 400;
                format!(r#"{{"id":"evt-{}","ts":{ts},"delivery":1}}"#, i + 30)
            })
            .collect();
        append(&input, file, &more);
    }
    tokio::time::sleep(SETTLE).await;
    local.shutdown().await.expect("stop with a savepoint");

    // The oracle over every delivery, old and new, in arrival order (each id's deliveries are
    // in one partition file, in event-time order).
    let mut records: Vec<(String, i64, Event)> = lines(&input)
        .into_iter()
        .map(|l| {
            let e: Event = serde_json::from_value(l).expect("an event");
            (e.id.clone(), e.ts, e)
        })
        .collect();
    records.sort_by_key(|(_, ts, _)| *ts);
    let want = dedup::expected(&records, keyshift_examples::DEDUP_TTL.as_millis() as i64);
    assert!(want.len() > 60, "{} first deliveries", want.len());
    programs_support::assert_published::<Event>(&out, &want);
}
