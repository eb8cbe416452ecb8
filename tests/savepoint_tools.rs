//! The savepoint tools as a library, on `memory://` and `file://` stores, against snapshots built
//! from real operator state (see `savepoint_support`).

mod savepoint_support;

use keyshift::crd::{AggregateFunction, KeyDistribution};
use keyshift::job::{AggConfig, KeyedAggregator, StateValue};
use keyshift::keygroup::{Assignment, Key, KeyType, key_group_for_key};
use keyshift::offline::{self, RewriteOptions, ToolError, open_location};
use keyshift::snapshot::{
    Manifest, ObjectStore, SnapshotKind, manifest_path, read_groups, read_manifest,
};
use object_store::ObjectStoreExt;
use savepoint_support::*;
use serde_json::Value;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

/// Dumps a snapshot into parsed JSON lines.
async fn dump_lines(url: &str, range: Option<&str>) -> Vec<Value> {
    let loc = open_location(url).unwrap();
    let range = range.map(|r| offline::parse_key_groups(r).unwrap());
    let mut out = Vec::new();
    let summary = offline::dump::dump(&loc, range, &mut out).await.unwrap();
    let lines: Vec<Value> = String::from_utf8(out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(summary.keys, lines.len() as u64);
    lines
}

/// A dump line without its key group, as a comparable string (the set of these must survive a
/// rewrite unchanged).
fn without_group(v: &Value) -> String {
    let mut v = v.clone();
    v.as_object_mut().unwrap().remove("keyGroup");
    v.to_string()
}

fn key_of(v: &Value) -> Key {
    match v["keyType"].as_str().unwrap() {
        "string" => Key::String(v["key"].as_str().unwrap().to_owned()),
        "long" => Key::Long(v["key"].as_i64().unwrap()),
        "int" => Key::Int(v["key"].as_i64().unwrap() as i32),
        t => panic!("key type {t}"),
    }
}

/// Restores every new subtask of `assignment` from the snapshot at `url` through
/// `KeyedAggregator::restore_group` and returns every key's state.
async fn restore_all(
    url: &str,
    assignment: Assignment,
    shape: &JobShape,
    window_ms: Option<i64>,
) -> HashMap<Key, StateValue> {
    let loc = open_location(url).unwrap();
    let manifest = read_manifest(loc.store.as_ref(), &loc.dir).await.unwrap();
    let config = AggConfig {
        function: shape.function,
        window_size_ms: window_ms,
        max_parallelism: assignment.max_parallelism(),
        state_payload_bytes: shape.payload,
    };
    let mut state = HashMap::new();
    for range in assignment.ranges() {
        let mut op = KeyedAggregator::new(config, range).unwrap();
        let restored = read_groups(loc.store.as_ref(), &loc.dir, &manifest, range)
            .await
            .unwrap();
        for g in restored.groups {
            if !g.bytes.is_empty() {
                op.restore_group(g.group, &g.bytes).unwrap();
            }
        }
        for (k, v) in state_of(std::slice::from_ref(&op)) {
            assert!(state.insert(k, v).is_none());
        }
    }
    state
}

async fn objects_under(store: &dyn ObjectStore, dir: &keyshift::snapshot::Path) -> Vec<String> {
    use futures::TryStreamExt;
    let mut v: Vec<String> = store
        .list(Some(dir))
        .map_ok(|m| format!("{} {}", m.location, m.size))
        .try_collect()
        .await
        .unwrap();
    v.sort();
    v
}

async fn manifest_bytes(url: &str) -> Vec<u8> {
    let loc = open_location(url).unwrap();
    loc.store
        .get(&manifest_path(&loc.dir))
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap()
        .to_vec()
}

/// The rewrite round trip for one job shape and one (G', P') on one store.
async fn round_trip(job_url: &str, shape: JobShape, new_g: u32, new_p: Option<u32>, budget: usize) {
    let window_ms = shape.window.map(|w| {
        keyshift_core::duration::parse_duration(w)
            .map(|d| d.as_millis() as i64)
            .unwrap()
    });
    let src = build(job_url, shape).await;
    assert!(src.state.len() > 100, "the job produced state");
    let before = dump_lines(&src.url, None).await;
    let src_manifest_before = manifest_bytes(&src.url).await;
    let src_loc = open_location(&src.url).unwrap();
    let src_objects = objects_under(src_loc.store.as_ref(), &src_loc.dir).await;

    let target = format!("{job_url}/savepoints/sp-9");
    let mut opts = RewriteOptions::new(new_g);
    opts.parallelism = new_p;
    opts.memory_budget = budget;
    let progress = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = progress.clone();
    opts.progress = Some(Arc::new(move |p: &offline::Progress| {
        seen.lock().unwrap().push((p.phase, p.done, p.total));
    }));
    let report = offline::rewrite::rewrite(&src.url, &target, opts)
        .await
        .unwrap();
    let p = new_p.unwrap_or(src.shape.parallelism);
    assert_eq!(report.keys, src.state.len() as u64);
    assert_eq!(report.bytes_read, src.manifest.stats.total_bytes);
    assert_eq!((report.max_parallelism, report.parallelism), (new_g, p));
    assert!(report.mb_per_sec() > 0.0 && report.keys_per_sec() > 0.0);
    if budget < 1 << 20 {
        // A small budget spreads the state over many buckets.
        assert!(report.buckets >= 8, "{report:?}");
        assert!(
            report.largest_bucket_bytes <= (budget / 4) as u64,
            "{report:?}"
        );
    }
    let phases: BTreeSet<_> = progress
        .lock()
        .unwrap()
        .iter()
        .map(|(ph, ..)| *ph)
        .collect();
    assert_eq!(phases.len(), 2, "progress from both passes");

    // The new manifest: same job, positions and watermark; new groups and parallelism; a note.
    let loc = open_location(&target).unwrap();
    let m: Manifest = read_manifest(loc.store.as_ref(), &loc.dir).await.unwrap();
    assert_eq!(m.job, src.manifest.job);
    assert_eq!(m.kind, SnapshotKind::Savepoint);
    assert_eq!(m.snapshot_id, 9);
    assert_eq!(m.max_parallelism, new_g);
    assert_eq!(m.parallelism, p);
    assert_eq!(m.files.len(), p as usize);
    assert_eq!(m.source_positions, src.manifest.source_positions);
    assert_eq!(m.watermark, src.manifest.watermark);
    assert_eq!(m.state_schema, src.manifest.state_schema);
    assert_eq!(m.stats.total_keys, src.manifest.stats.total_keys);
    let note = &m.stats.extra["rewrittenFrom"];
    assert_eq!(note["url"], Value::from(src.url.clone()));
    assert_eq!(
        note["maxParallelism"],
        Value::from(src.shape.max_parallelism)
    );
    assert_eq!(note["snapshotId"], Value::from(1));

    // Per-key values identical (as sets), every key in its Flink group for G'.
    let after = dump_lines(&target, None).await;
    let set = |lines: &[Value]| lines.iter().map(without_group).collect::<BTreeSet<_>>();
    assert_eq!(after.len(), before.len());
    assert_eq!(set(&after), set(&before));
    for line in &after {
        let key = key_of(line);
        assert_eq!(
            line["keyGroup"].as_u64().unwrap() as u32,
            key_group_for_key(&key, new_g),
            "{line}"
        );
    }
    // Group order in the dump: non-decreasing.
    let groups: Vec<u64> = after
        .iter()
        .map(|l| l["keyGroup"].as_u64().unwrap())
        .collect();
    assert!(groups.windows(2).all(|w| w[0] <= w[1]));

    // Every new subtask restores its range through the operator, state exactly as before.
    let new = Assignment::new(i64::from(p), i64::from(new_g)).unwrap();
    let restored = restore_all(&target, new, &src.shape, window_ms).await;
    assert_eq!(restored.len(), src.state.len());
    assert!(restored == src.state, "restored state differs");

    // The new snapshot verifies; the source is untouched.
    let v = offline::verify_keys(&loc).await.unwrap();
    assert!(v.ok(), "{:?}", v.problems);
    assert_eq!(v.keys_checked, src.state.len() as u64);
    assert_eq!(manifest_bytes(&src.url).await, src_manifest_before);
    assert_eq!(
        objects_under(src_loc.store.as_ref(), &src_loc.dir).await,
        src_objects
    );
    assert!(offline::verify_keys(&src_loc).await.unwrap().ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewrite_round_trip_count_string_keys_memory_and_file() {
    // 128 -> 256 groups (a multiple), parallelism kept.
    round_trip(&memory_job(), JobShape::default(), 256, None, 64 << 20).await;
    let (_tmp, job) = file_job();
    // 128 -> 100 groups (not a divisor), parallelism 4 -> 3, a tiny memory budget (many buckets).
    let shape = JobShape {
        payload: 200,
        keys: 8_000,
        records_per_partition: 6_000,
        ..JobShape::default()
    };
    round_trip(&job, shape, 100, Some(3), 256 << 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewrite_round_trip_windowed_and_numeric_keys() {
    // Windowed sum over long keys, 64 -> 300 groups at parallelism 5.
    let shape = JobShape {
        function: AggregateFunction::Sum,
        window: Some("2s"),
        key_type: KeyType::Long,
        max_parallelism: 64,
        parallelism: 2,
        ..JobShape::default()
    };
    round_trip(&memory_job(), shape, 300, Some(5), 64 << 20).await;
    // Max over int keys, shrinking 128 -> 8 groups at parallelism 8 -> 2.
    let (_tmp, job) = file_job();
    let shape = JobShape {
        function: AggregateFunction::Max,
        key_type: KeyType::Int,
        parallelism: 8,
        ..JobShape::default()
    };
    round_trip(&job, shape, 8, Some(2), 64 << 20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewrite_refuses_an_existing_target_and_bad_bounds() {
    let job = memory_job();
    let src = build(&job, JobShape::default()).await;
    let target = format!("{job}/savepoints/sp-2");
    offline::rewrite::rewrite(&src.url, &target, RewriteOptions::new(256))
        .await
        .unwrap();
    let committed = manifest_bytes(&target).await;
    let err = offline::rewrite::rewrite(&src.url, &target, RewriteOptions::new(512))
        .await
        .unwrap_err();
    assert!(matches!(err, ToolError::TargetExists { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("sp-2") && msg.contains("already holds a committed snapshot"),
        "{msg}"
    );
    assert_eq!(manifest_bytes(&target).await, committed, "target untouched");
    // The source itself is a committed target too.
    let err = offline::rewrite::rewrite(&src.url, &src.url, RewriteOptions::new(256))
        .await
        .unwrap_err();
    assert!(matches!(err, ToolError::TargetExists { .. }), "{err:?}");
    // A checkpoint directory is not a valid target.
    let err = offline::rewrite::rewrite(
        &src.url,
        &format!("{job}/checkpoints/chk-5"),
        RewriteOptions::new(256),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, ToolError::TargetIsCheckpoint { .. }),
        "{err:?}"
    );
    // The source's parallelism (4) does not fit 2 groups.
    let err = offline::rewrite::rewrite(
        &src.url,
        &format!("{job}/savepoints/sp-3"),
        RewriteOptions::new(2),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("--parallelism"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewrite_refuses_corrupt_input_naming_the_file_and_writes_nothing() {
    let (_tmp, job) = file_job();
    let src = build(&job, JobShape::default()).await;
    let file = local(&src.url).join("state-2-of-4.bin");
    let mut bytes = std::fs::read(&file).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let target = format!("{job}/savepoints/sp-7");
    let err = offline::rewrite::rewrite(&src.url, &target, RewriteOptions::new(256))
        .await
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("state-2-of-4.bin") && msg.contains("checksum"),
        "{msg}"
    );
    // No manifest, no state file: the target directory was never even created.
    assert!(!local(&target).exists(), "nothing written");
    let loc = offline::open_location_for_write(&target).unwrap();
    assert!(!loc.is_committed().await.unwrap(), "no target manifest");
    assert!(
        objects_under(loc.store.as_ref(), &loc.dir).await.is_empty(),
        "nothing written"
    );

    // A block whose checksums are right but which holds a key of another group (a snapshot
    // written under another key-group count, or a bug) is refused too, naming file and key.
    let forged = forge_wrong_group_snapshot(&memory_job()).await;
    let err =
        offline::rewrite::rewrite(&forged, &format!("{forged}-out"), RewriteOptions::new(256))
            .await
            .unwrap_err();
    assert!(matches!(err, ToolError::KeyInWrongGroup { .. }), "{err:?}");
    assert!(err.to_string().contains("state-0-of-1.bin"), "{err}");
}

/// A one-subtask snapshot at 8 groups whose group 0 block holds a key of another group
/// (block header, CRC-32 and CRC-32C all consistent).
async fn forge_wrong_group_snapshot(job_url: &str) -> String {
    use keyshift::job::AccValue;
    use keyshift::job::state_codec::{BlockInfo, encode_entries};
    use keyshift::snapshot::{SnapshotWriter, commit_manifest, open_store, snapshot_dir};
    let max_p = 8;
    let stranger = (0..)
        .map(|i| Key::String(format!("k{i}")))
        .find(|k| key_group_for_key(k, max_p) != 0)
        .unwrap();
    let value = StateValue {
        acc: AccValue::Scalar(1),
        payload: vec![],
    };
    let info = BlockInfo {
        function: AggregateFunction::Count,
        window_size_ms: None,
        max_parallelism: max_p,
        key_group: 0,
    };
    let (block, n) = encode_entries(&info, [(&stranger, &value)]);
    let (store, job_dir) = open_store(job_url).unwrap();
    let dir = snapshot_dir(&job_dir, SnapshotKind::Savepoint, 1);
    let a = Assignment::new(1, i64::from(max_p)).unwrap();
    let mut w = SnapshotWriter::new(store.clone(), &dir, a, 0).unwrap();
    w.write_group(0, block.into(), n).await.unwrap();
    let ack = w.finish().await.unwrap();
    let m = Manifest::assemble(
        meta(SnapshotKind::Savepoint, 1, jiff::Timestamp::now()),
        a,
        vec![ack],
    )
    .unwrap();
    commit_manifest(store.as_ref(), &dir, &m).await.unwrap();
    // verify names the key and the file too.
    let loc = open_location(&format!("{job_url}/savepoints/sp-1")).unwrap();
    let v = offline::verify_keys(&loc).await.unwrap();
    assert!(!v.ok());
    assert!(
        v.problems[0].contains("state-0-of-1.bin") && v.problems[0].contains(&stranger.to_string()),
        "{:?}",
        v.problems
    );
    format!("{job_url}/savepoints/sp-1")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_shows_the_hot_key_of_a_zipf_job() {
    // Count over a Zipf-skewed stream: key-0 (rank 0) is the hottest.
    let shape = JobShape {
        distribution: KeyDistribution::Zipf,
        zipf_exponent: Some(1.2),
        keys: 2_000,
        ..JobShape::default()
    };
    let src = build(&memory_job(), shape).await;
    let report = offline::inspect::inspect(&open_location(&src.url).unwrap(), 5)
        .await
        .unwrap();
    let hot = &report.top_keys_by_value[0];
    assert_eq!(
        hot.key,
        Key::String("key-0".into()),
        "{:?}",
        report.top_keys_by_value
    );
    let expected_max = src
        .state
        .values()
        .map(|v| match v.acc {
            keyshift::job::AccValue::Scalar(x) => x,
            _ => unreachable!(),
        })
        .max()
        .unwrap();
    assert_eq!(hot.value, Some(expected_max));
    assert_eq!(hot.key_group, key_group_for_key(&hot.key, 128));
    assert_eq!(report.top_keys_by_value.len(), 5);
    assert!(
        report
            .top_keys_by_value
            .windows(2)
            .all(|w| w[0].value >= w[1].value)
    );
    // The rest of the report adds up.
    assert_eq!(report.function, Some(AggregateFunction::Count));
    assert_eq!(report.max_parallelism, 128);
    assert_eq!(report.parallelism, 4);
    assert_eq!(report.groups.len(), 128);
    assert_eq!(
        report.groups.iter().map(|g| g.keys).sum::<u64>(),
        src.state.len() as u64
    );
    assert_eq!(
        report.groups.iter().map(|g| g.bytes).sum::<u64>(),
        src.manifest.stats.total_bytes
    );
    assert_eq!(
        report.subtasks.iter().map(|s| s.keys).sum::<u64>(),
        src.state.len() as u64
    );
    assert_eq!(report.subtasks[1].key_groups, [32, 63]);
    assert_eq!(report.source_positions, src.manifest.source_positions);
    assert_eq!(report.largest_groups[0].bytes, report.group_bytes.max);

    // Windowed count over long keys: the hot key has the most open windows and the largest
    // count, so it is also the largest key by state bytes.
    let shape = JobShape {
        distribution: KeyDistribution::Zipf,
        zipf_exponent: Some(1.2),
        keys: 2_000,
        key_type: KeyType::Long,
        window: Some("5s"),
        ..JobShape::default()
    };
    let src = build(&memory_job(), shape).await;
    let report = offline::inspect::inspect(&open_location(&src.url).unwrap(), 3)
        .await
        .unwrap();
    assert_eq!(report.window_size_ms, Some(5000));
    assert_eq!(
        report.largest_keys[0].key,
        Key::Long(0),
        "{:?}",
        report.largest_keys
    );
    assert_eq!(report.top_keys_by_value[0].key, Key::Long(0));
    assert!(report.largest_keys[0].windows >= 1);
    assert!(report.watermark.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dump_restricts_to_key_groups_and_verify_reports_per_file() {
    let job = memory_job();
    let src = build(&job, JobShape::default()).await;
    let all = dump_lines(&src.url, None).await;
    assert_eq!(all.len(), src.state.len());
    let some = dump_lines(&src.url, Some("10-20")).await;
    assert!(!some.is_empty() && some.len() < all.len());
    assert!(
        some.iter()
            .all(|l| (10..=20).contains(&l["keyGroup"].as_u64().unwrap()))
    );
    let expected = all
        .iter()
        .filter(|l| (10..=20).contains(&l["keyGroup"].as_u64().unwrap()))
        .count();
    assert_eq!(some.len(), expected);
    let loc = open_location(&src.url).unwrap();
    let mut sink = Vec::new();
    let err = offline::dump::dump(
        &loc,
        Some(offline::parse_key_groups("100-200").unwrap()),
        &mut sink,
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("0-127"), "{err}");

    // Two broken files are both reported; the good ones are checked in full.
    let store = loc.store.clone();
    for (name, cut) in [("state-1-of-4.bin", 10usize), ("state-3-of-4.bin", 0)] {
        let path = loc.dir.clone().join(name);
        let bytes = store.get(&path).await.unwrap().bytes().await.unwrap();
        if cut == 0 {
            store.delete(&path).await.unwrap();
        } else {
            store
                .put(&path, bytes.slice(..bytes.len() - cut).into())
                .await
                .unwrap();
        }
    }
    let v = offline::verify_keys(&loc).await.unwrap();
    assert_eq!(v.problems.len(), 2, "{:?}", v.problems);
    assert!(v.problems[0].contains("state-1-of-4.bin") && v.problems[0].contains("bytes"));
    assert!(v.problems[1].contains("state-3-of-4.bin") && v.problems[1].contains("missing"));
    assert_eq!(v.files[0].problem, None);
    assert!(v.files[0].keys_checked > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispose_refuses_what_the_job_needs_and_removes_the_rest() {
    use jiff::{SignedDuration, Timestamp};
    let (_tmp, job) = file_job();
    let (ops, positions, wm) = run_job(&JobShape::default());
    let t0 = Timestamp::now() - SignedDuration::from_hours(1);
    let mut urls = HashMap::new();
    for (kind, id, mins) in [
        (SnapshotKind::Checkpoint, 1, 0),
        (SnapshotKind::Savepoint, 1, 5),
        (SnapshotKind::Checkpoint, 2, 10),
        (SnapshotKind::Savepoint, 2, 20),
        (SnapshotKind::Savepoint, 3, 30),
    ] {
        let (url, _) = write_snapshot(
            &job,
            kind,
            id,
            t0 + SignedDuration::from_mins(mins),
            &ops,
            &positions,
            wm,
        )
        .await;
        urls.insert((kind, id), url);
    }
    let listing = offline::list_job(&job).await.unwrap();
    assert_eq!(listing.snapshots.len(), 5);
    let used: Vec<(&str, Vec<&str>)> = listing
        .snapshots
        .iter()
        .map(|r| (r.path.as_str(), r.in_use.iter().map(|u| u.rule).collect()))
        .collect();
    assert_eq!(
        used,
        [
            ("checkpoints/chk-1", vec![]),
            ("checkpoints/chk-2", vec!["newestCheckpoint"]),
            ("savepoints/sp-1", vec![]),
            ("savepoints/sp-2", vec![]),
            ("savepoints/sp-3", vec!["newestSnapshot"]),
        ]
    );
    let no = offline::DisposeOptions::default();
    let force = offline::DisposeOptions {
        force: true,
        dry_run: false,
    };

    // The newest checkpoint and the newest snapshot are refused.
    for key in [(SnapshotKind::Checkpoint, 2), (SnapshotKind::Savepoint, 3)] {
        let err = offline::dispose(&urls[&key], no).await.unwrap_err();
        assert!(matches!(err, ToolError::InUse { .. }), "{err:?}");
        assert!(err.to_string().contains("--force"), "{err}");
        assert!(
            open_location(&urls[&key])
                .unwrap()
                .is_committed()
                .await
                .unwrap()
        );
    }
    // A snapshot pinned by the marker is refused; an unreadable marker refuses everything.
    let loc = open_location(&urls[&(SnapshotKind::Savepoint, 2)]).unwrap();
    let job_dir = loc.job_dir.clone().unwrap();
    let marker = offline::InUseMarker::new(vec![offline::InUseEntry {
        path: "savepoints/sp-2".into(),
        holder: Some("operator".into()),
        reason: Some("spec.restoreFrom".into()),
    }]);
    offline::write_in_use(loc.store.as_ref(), &job_dir, &marker)
        .await
        .unwrap();
    assert_eq!(
        offline::read_in_use(loc.store.as_ref(), &job_dir)
            .await
            .unwrap(),
        Some(marker)
    );
    let err = offline::dispose(&urls[&(SnapshotKind::Savepoint, 2)], no)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("spec.restoreFrom"), "{err}");
    std::fs::write(local(&job).join(offline::IN_USE_FILE), b"{not json").unwrap();
    let err = offline::dispose(&urls[&(SnapshotKind::Savepoint, 1)], no)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("_in_use.json"), "{err}");
    std::fs::remove_file(local(&job).join(offline::IN_USE_FILE)).unwrap();

    // An older snapshot goes completely: a dry run first deletes nothing.
    let old = &urls[&(SnapshotKind::Savepoint, 1)];
    let dry = offline::dispose(
        old,
        offline::DisposeOptions {
            force: false,
            dry_run: true,
        },
    )
    .await
    .unwrap();
    assert!(dry.dry_run && dry.committed && dry.objects == 5);
    assert!(local(old).join("_manifest.json").exists());
    let done = offline::dispose(old, no).await.unwrap();
    assert_eq!(done.objects, 5, "manifest and four state files");
    assert!(done.forced_over.is_empty());
    let old_loc = offline::open_location_for_write(old).unwrap();
    assert!(
        objects_under(old_loc.store.as_ref(), &old_loc.dir)
            .await
            .is_empty()
    );
    assert!(!local(old).exists(), "directory gone");
    let err = offline::verify_keys(&old_loc).await.unwrap_err();
    assert!(err.to_string().contains("not found"), "{err}");
    assert_eq!(offline::list_job(&job).await.unwrap().snapshots.len(), 4);
    // Disposing it again: nothing there.
    assert!(matches!(
        offline::dispose(old, no).await.unwrap_err(),
        ToolError::NothingThere { .. }
    ));

    // --force overrides, and says what it overrode.
    let newest = &urls[&(SnapshotKind::Savepoint, 3)];
    let done = offline::dispose(newest, force).await.unwrap();
    assert_eq!(done.forced_over.len(), 1);
    assert!(!local(newest).exists());

    // An uncommitted directory (a crashed snapshot) needs --force.
    let orphan = local(&job).join("checkpoints/chk-9");
    std::fs::create_dir_all(&orphan).unwrap();
    std::fs::write(orphan.join("state-0-of-1.bin"), b"partial").unwrap();
    let url = format!("{job}/checkpoints/chk-9");
    assert!(matches!(
        offline::dispose(&url, no).await.unwrap_err(),
        ToolError::Uncommitted { .. }
    ));
    let done = offline::dispose(&url, force).await.unwrap();
    assert!(!done.committed && done.objects == 1);
    assert!(!orphan.exists());
    // A URL outside the layout cannot be judged.
    let err = offline::dispose(&format!("{job}/elsewhere"), no)
        .await
        .unwrap_err();
    assert!(matches!(err, ToolError::NotSnapshotUrl { .. }), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_shows_unreadable_manifests_instead_of_failing() {
    let job = memory_job();
    let src = build(&job, JobShape::default()).await;
    let (_, _) = write_snapshot(
        &job,
        SnapshotKind::Checkpoint,
        4,
        jiff::Timestamp::now(),
        &run_job(&JobShape::default()).0,
        &src.manifest.source_positions,
        None,
    )
    .await;
    let loc = open_location(&format!("{job}/checkpoints/chk-4")).unwrap();
    loc.store
        .put(
            &manifest_path(&loc.dir),
            b"{\"formatVersion\": 1, \"job".to_vec().into(),
        )
        .await
        .unwrap();
    let listing = offline::list_job(&job).await.unwrap();
    assert_eq!(listing.snapshots.len(), 2);
    let chk = &listing.snapshots[0];
    assert_eq!(chk.kind, SnapshotKind::Checkpoint);
    assert!(chk.error.as_deref().unwrap().contains("corrupt"), "{chk:?}");
    assert_eq!(listing.snapshots[1].keys, Some(src.state.len() as u64));
    assert_eq!(listing.snapshots[1].max_parallelism, Some(128));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_snapshot_rewrites_inspects_and_dumps() {
    let job = memory_job();
    let shape = JobShape::default();
    let options = keyshift::job::JobOptions {
        state_payload_bytes: 0,
    };
    let compiled = keyshift::job::compile(&spec(&shape), 128, &options).unwrap();
    let ops: Vec<KeyedAggregator> = Assignment::new(2, 128)
        .unwrap()
        .ranges()
        .into_iter()
        .map(|r| compiled.new_aggregator(r).unwrap())
        .collect();
    let (url, m) = write_snapshot(
        &job,
        SnapshotKind::Checkpoint,
        3,
        jiff::Timestamp::now(),
        &ops,
        &Default::default(),
        None,
    )
    .await;
    assert_eq!(m.stats.total_keys, 0);
    let target = format!("{job}/savepoints/sp-4");
    let r = offline::rewrite::rewrite(&url, &target, RewriteOptions::new(16))
        .await
        .unwrap();
    assert_eq!((r.keys, r.bytes_written), (0, 0));
    assert!(dump_lines(&target, None).await.is_empty());
    let report = offline::inspect::inspect(&open_location(&target).unwrap(), 3)
        .await
        .unwrap();
    assert_eq!(report.function, None);
    assert!(report.largest_keys.is_empty());
    assert!(
        offline::verify_keys(&open_location(&target).unwrap())
            .await
            .unwrap()
            .ok()
    );
}
