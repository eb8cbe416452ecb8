//! The template's job, as its own worker binary, under `keyshift local`'s orchestration: worker
//! processes of `threshold`, the real coordinator, snapshots on `file://`, the exactly-once
//! object-store sink, a rescale and a killed worker. The published output is compared with the
//! crossings computed from the input alone.

use keyshift::crd::StreamJob;
use keyshift::local::LocalJob;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

const THRESHOLD: i64 = 1_000;
const FILES: usize = 3;

/// Payments of `accounts` accounts, deterministic: (account index, amount, ts), in arrival
/// order; every tenth one has a non-positive amount (the job's filter drops it).
fn payments(n: usize, accounts: u64) -> Vec<(u64, i64, i64)> {
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    (0..n)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let amount = if i % 10 == 9 { -5 } else { (x % 90) as i64 + 1 };
            (x % accounts, amount, i as i64 * 10)
        })
        .collect()
}

fn line(account: u64, amount: i64, ts: i64) -> String {
    format!("{{\"account\":\"acct-{account}\",\"amount\":{amount},\"ts\":{ts}}}\n")
}

/// Appends payments to the partition files, each account in one file (its order kept).
fn append(dir: &Path, payments: &[(u64, i64, i64)]) {
    let mut files: BTreeMap<usize, String> = BTreeMap::new();
    for (a, amount, ts) in payments {
        files
            .entry(*a as usize % FILES)
            .or_default()
            .push_str(&line(*a, *amount, *ts));
    }
    for (f, text) in files {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(format!("part-{f}.jsonl")))
            .expect("open partition file");
        file.write_all(text.as_bytes()).expect("append");
    }
}

/// Per account, the payment at which its total of positive amounts first reaches the threshold.
fn oracle(payments: &[(u64, i64, i64)]) -> BTreeMap<String, (i64, i64)> {
    let mut totals: BTreeMap<u64, i64> = BTreeMap::new();
    let mut out = BTreeMap::new();
    for (a, amount, ts) in payments {
        if *amount <= 0 {
            continue;
        }
        let t = totals.entry(*a).or_insert(0);
        let before = *t;
        *t += amount;
        if before < THRESHOLD && *t >= THRESHOLD {
            out.insert(format!("acct-{a}"), (*t, *ts));
        }
    }
    out
}

/// Every line the sink published, per account; fails on an account published twice.
fn published(out: &Path) -> BTreeMap<String, (i64, i64)> {
    let mut seen = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(out) else {
        return seen;
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
            for l in text.lines() {
                let v: serde_json::Value = serde_json::from_str(l).expect("JSON line");
                let account = v["account"].as_str().expect("account").to_owned();
                let crossed = (
                    v["total"].as_i64().expect("total"),
                    v["ts"].as_i64().expect("ts"),
                );
                let before = seen.insert(account.clone(), crossed);
                assert!(before.is_none(), "{account} published twice");
            }
        }
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_template_job_runs_as_its_own_worker_binary_through_a_rescale_and_a_crash() {
    let dir = tempfile::tempdir().expect("temp dir");
    let input = dir.path().join("in");
    std::fs::create_dir_all(&input).expect("input dir");
    let out = dir.path().join("out");
    let spec: StreamJob = serde_yaml::from_str(&format!(
        "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata: {{name: threshold, namespace: test}}
spec:
  replicas: 2
  maxParallelism: 64
  job:
    program: {{name: threshold}}
    source:
      file: {{path: '{}'}}
    sink: {{type: objectStore, url: 'file://{}'}}
  state:
    checkpointInterval: 1h
",
        input.display(),
        out.display()
    ))
    .expect("manifest parses");
    let all = payments(12_000, 200);
    let third = all.len() / 3;
    append(&input, &all[..third]);
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_threshold"));
    let storage = format!("file://{}", dir.path().join("state").display());
    let mut local = LocalJob::new(&spec, storage, bin, dir.path().join("logs"))
        .await
        .expect("job prepares");
    local.launch(2, None).await.expect("launch");
    let settle = Duration::from_millis(1500);
    tokio::time::sleep(settle).await;
    local.checkpoint().await.expect("checkpoint");
    local.rescale(3).await.expect("rescale to 3");
    append(&input, &all[third..2 * third]);
    tokio::time::sleep(settle).await;
    local.checkpoint().await.expect("checkpoint at 3");
    append(&input, &all[2 * third..]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    local.kill_worker(0).await;
    local.recover(3).await.expect("recover");
    tokio::time::sleep(settle).await;
    local.shutdown().await.expect("stop with a savepoint");

    let want = oracle(&all);
    assert!(want.len() > 150, "{} accounts cross", want.len());
    assert_eq!(published(&out), want);
}
