//! Programs (jobs written with keyshift's SDK) on the runtime, end to end on one machine: real
//! `keyshift worker` processes running a program keyshift's image carries, the real
//! coordinator, snapshots on `file://`, output through the exactly-once object-store sink.
//! Every check compares the published output with an oracle computed from the input alone
//! (`keyshift_examples`), through rescales, a killed worker, incremental checkpoints and a
//! pre-staged rescale.

use keyshift::crd::StreamJob;
use keyshift::local::LocalJob;
use keyshift_examples::silence::{self, Alert, Fleet, Heartbeat};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_keyshift"))
}

/// Source partition files of the heartbeats: one per `files`, each device in one of them (so
/// that its heartbeats keep their order), appended in phases.
struct Input {
    dir: PathBuf,
    files: u64,
}

impl Input {
    fn file_of(&self, device: &str) -> PathBuf {
        let n: u64 = device
            .rsplit('-')
            .next()
            .and_then(|d| d.parse().ok())
            .unwrap_or(0);
        self.dir.join(format!("part-{}.jsonl", n % self.files))
    }

    fn append(&self, beats: &[Heartbeat]) {
        let mut by_file: BTreeMap<PathBuf, Vec<u8>> = BTreeMap::new();
        for b in beats {
            let out = by_file.entry(self.file_of(&b.device)).or_default();
            serde_json::to_writer(&mut *out, b).expect("heartbeat serializes");
            out.push(b'\n');
        }
        for (path, bytes) in by_file {
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .expect("open partition file");
            f.write_all(&bytes).expect("append");
        }
    }
}

fn silence_job(name: &str, input: &Path, out: &Path, replicas: u32) -> StreamJob {
    serde_yaml::from_str(&format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {{name: {name}, namespace: test}}
spec:
  replicas: {replicas}
  maxParallelism: 128
  job:
    program: {{name: silence-alert, maxOutOfOrderness: 2s}}
    source:
      file: {{path: '{}'}}
    sink: {{type: objectStore, url: 'file://{}'}}
  state:
    checkpointInterval: 1h
",
        input.display(),
        out.display()
    ))
    .expect("test manifest parses")
}

/// Every line the sink published (committed snapshots' output), as alerts; fails on a line
/// that is not one.
fn published(out: &Path) -> Vec<Alert> {
    let mut alerts = Vec::new();
    let Ok(entries) = std::fs::read_dir(out) else {
        return alerts;
    };
    for entry in entries {
        let dir = entry.expect("entry").path();
        if !dir
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("snap-"))
        {
            continue;
        }
        for part in std::fs::read_dir(&dir).expect("parts") {
            let text = std::fs::read_to_string(part.expect("part").path()).expect("read part");
            for line in text.lines() {
                alerts.push(serde_json::from_str(line).expect("an alert per line"));
            }
        }
    }
    alerts.sort();
    alerts
}

/// The heartbeats of `fleet` in three phases of arrival, and one last heartbeat per partition
/// file from a device of its own far in the future, which moves every partition's watermark
/// past every real device's last watch.
/// Heartbeats as the oracle takes them: (key, event time, heartbeat), in arrival order.
type Records = Vec<(String, i64, Heartbeat)>;

fn phases(fleet: &Fleet, input: &Input) -> (Vec<Vec<Heartbeat>>, Records) {
    let mut records = fleet.records();
    let n = records.len();
    let end = fleet.duration_ms + 10 * fleet.silence_ms;
    for f in 0..input.files {
        // A device named to land in partition file f.
        let device = format!("end-{}", f + 1_000 * input.files);
        records.push((device.clone(), end, Heartbeat { device, ts: end }));
    }
    let beats: Vec<Heartbeat> = records.iter().map(|(_, _, b)| b.clone()).collect();
    let phases = vec![
        beats[..n / 3].to_vec(),
        beats[n / 3..2 * n / 3].to_vec(),
        beats[2 * n / 3..n].to_vec(),
        beats[n..].to_vec(),
    ];
    (phases, records)
}

/// The alerts a silence watch must have emitted once event time reached `watermark`: the
/// oracle's, of the watches that ended by then.
fn expected(records: &[(String, i64, Heartbeat)], silence_ms: i64, watermark: i64) -> Vec<Alert> {
    silence::expected(records, silence_ms)
        .into_iter()
        .filter(|a| a.last_heartbeat + silence_ms <= watermark)
        .collect()
}

const SETTLE: Duration = Duration::from_millis(1500);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silence_alert_program_fires_each_alert_once_through_rescales_and_a_killed_worker() {
    let dir = tempfile::tempdir().expect("temp dir");
    let input = Input {
        dir: dir.path().join("in"),
        files: 4,
    };
    std::fs::create_dir_all(&input.dir).expect("input dir");
    let out = dir.path().join("out");
    let storage = format!("file://{}", dir.path().join("state").display());
    let fleet = Fleet {
        devices: 150,
        period_ms: 5_000,
        silence_ms: keyshift_examples::SILENCE_MS,
        duration_ms: 600_000,
        outage_every: 12,
        max_out_of_orderness: 2_000,
        seed: 3,
    };
    let (phases, records) = phases(&fleet, &input);
    input.append(&phases[0]);
    let spec = silence_job("silence", &input.dir, &out, 2);
    let mut local = LocalJob::new(&spec, storage, bin(), dir.path().join("logs"))
        .await
        .expect("job prepares");
    local.launch(2, None).await.expect("launch");
    tokio::time::sleep(SETTLE).await;
    let first = local.checkpoint().await.expect("first checkpoint");
    assert_eq!(first.manifest.state_schema, keyshift::job::PROGRAM_SCHEMA);
    assert_eq!(
        first
            .manifest
            .job
            .layout
            .as_ref()
            .and_then(|l| l.program.as_deref()),
        Some("silence-alert")
    );

    // Records after the checkpoint, then a worker killed: the job recovers from the
    // checkpoint, replays them, and publishes nothing twice.
    input.append(&phases[1]);
    tokio::time::sleep(SETTLE).await;
    local.kill_worker(1).await;
    assert!(local.checkpoint().await.is_err(), "a worker is gone");
    let r = local.recover(2).await.expect("recover");
    assert_eq!(r.restored_from.as_deref(), Some(first.url.as_str()));
    tokio::time::sleep(SETTLE).await;
    // An incremental checkpoint, then up to 3 with the state moved by key group.
    let second = local.checkpoint().await.expect("second checkpoint");
    assert!(second.id > first.id);
    assert!(
        second
            .manifest
            .key_groups
            .iter()
            .any(|g| !g.deltas.is_empty()),
        "the checkpoint after the recovery builds on the one it recovered from"
    );
    local.rescale(3).await.expect("rescale to 3");
    input.append(&phases[2]);
    tokio::time::sleep(SETTLE).await;
    // Down to 1, pre-staged: the new worker loads its groups before the old ones stop.
    local.checkpoint().await.expect("third checkpoint");
    let pre = local
        .rescale_prestaged(1)
        .await
        .expect("pre-staged rescale to 1");
    assert_eq!(pre.fallback, None, "the pre-stage was used");
    assert!(pre.prestage.is_some());
    input.append(&phases[3]);
    tokio::time::sleep(SETTLE).await;
    let sp = local.shutdown().await.expect("stop with a savepoint");

    // The savepoint tools check a program's blocks: every key in the group it belongs to.
    let loc = keyshift::offline::open_location(&sp.url).expect("savepoint location");
    let v = keyshift::offline::verify_keys(&loc).await.expect("verify");
    assert!(v.ok(), "{:?}", v.problems);
    assert!(v.keys_checked > 150, "{} entries checked", v.keys_checked);

    let watermark = sp
        .manifest
        .watermark
        .expect("the savepoint has a watermark");
    assert!(
        watermark >= fleet.duration_ms + fleet.silence_ms,
        "event time passed every watch (watermark {watermark})"
    );
    let want = expected(&records, fleet.silence_ms, watermark);
    let got = published(&out);
    assert!(want.len() > 100, "{} alerts expected", want.len());
    let mut seen = BTreeMap::new();
    for a in &got {
        *seen.entry(a).or_insert(0u32) += 1;
    }
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "alerts published twice: {twice:?}");
    let missing: Vec<_> = want.iter().filter(|a| !seen.contains_key(a)).collect();
    let extra: Vec<_> = got.iter().filter(|a| !want.contains(a)).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{} alerts missing (e.g. {:?}), {} not expected (e.g. {:?})",
        missing.len(),
        missing.first(),
        extra.len(),
        extra.first()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_program_the_image_does_not_carry_is_refused_naming_the_ones_it_does() {
    let dir = tempfile::tempdir().expect("temp dir");
    let input = dir.path().join("in");
    std::fs::create_dir_all(&input).expect("input dir");
    std::fs::write(input.join("p.jsonl"), "{\"device\":\"d\",\"ts\":1}\n").expect("input");
    let out = dir.path().join("out");
    let yaml = serde_yaml::to_string(&silence_job("nope", &input, &out, 1))
        .expect("serializes")
        .replace("silence-alert", "sessionize");
    let spec: StreamJob = serde_yaml::from_str(&yaml).expect("parses");
    let storage = format!("file://{}", dir.path().join("state").display());
    let mut local = LocalJob::new(&spec, storage, bin(), dir.path().join("logs"))
        .await
        .expect("job prepares");
    let err = local
        .launch(1, None)
        .await
        .expect_err("no such program")
        .to_string();
    assert!(
        err.contains("sessionize") && err.contains("dedup, silence-alert"),
        "{err}"
    );
}
