//! The snapshot storage layer end to end on `memory://`, `file://` and, when their URLs are set,
//! real servers of each cloud protocol: S3 (`KEYSHIFT_TEST_S3_URL`, `hack/s3-server.sh`), GCS
//! (`KEYSHIFT_TEST_GCS_URL`, `hack/gcs-server.sh`) and Azure Blob (`KEYSHIFT_TEST_AZURE_URL`,
//! `hack/azure-server.sh`).

mod support;

use bytes::Bytes;
use jiff::Timestamp;
use keyshift::keygroup::{Assignment, KeyGroupRange};
use keyshift::snapshot::*;
use object_store::{ObjectStoreExt, PutPayload};
use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use support::{AZURE, Cloud, GCS, S3, cloud_url};

const MAX_P: u32 = 128;

/// Deterministic block of group `g` in snapshot `seed`; some groups are empty, sizes vary.
fn block(g: u32, seed: u64) -> Bytes {
    if g % 7 == 3 {
        return Bytes::new();
    }
    let len = 1 + (u64::from(g) * 7919 + seed * 31) % 3000;
    let mut x = u64::from(g) << 32 ^ seed ^ 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect::<Vec<u8>>()
        .into()
}

fn entries(g: u32) -> u64 {
    u64::from(g % 5) + 1
}

fn meta(id: u64, kind: SnapshotKind) -> SnapshotMeta {
    SnapshotMeta {
        job: JobIdentity {
            namespace: "team-a".into(),
            name: "clicks".into(),
            job_fingerprint: "sha256:abc".into(),
            layout: None,
        },
        snapshot_id: id,
        kind,
        completed_at: Timestamp::now(),
        state_schema: "keyshift.agg.v1".into(),
        source_positions: BTreeMap::from([(0, 1000 + id), (1, 2000 + id), (2, 3)]),
        source_partitions: BTreeMap::from([
            (0, "part-a.jsonl".into()),
            (1, "part-b.jsonl".into()),
            (2, "part-c.jsonl".into()),
        ]),
        watermark: Some(1_700_000_000_000 + id as i64),
    }
}

struct Backend {
    store: Arc<dyn ObjectStore>,
    base: Path,
    label: &'static str,
    _tmp: Option<tempfile::TempDir>,
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

fn unique(tag: &str) -> String {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!(
        "{tag}-{}-{n}-{}",
        std::process::id(),
        Timestamp::now().as_microsecond()
    )
}

fn memory() -> Backend {
    let (store, base) = open_store(&format!("memory://{}/keyshift", unique("mem"))).unwrap();
    Backend {
        store,
        base,
        label: "memory",
        _tmp: None,
    }
}

fn file() -> Backend {
    let tmp = tempfile::tempdir().unwrap();
    let url = format!("file://{}/store", tmp.path().display());
    let (store, base) = open_store(&url).unwrap();
    Backend {
        store,
        base,
        label: "file",
        _tmp: Some(tmp),
    }
}

/// A fresh prefix on `cloud`'s test server, or `None` (with a message) when it is not running.
fn cloud(cloud: Cloud) -> Option<Backend> {
    let url = cloud_url(cloud, &unique("run"))?;
    let (store, base) = open_store(&url).unwrap();
    Some(Backend {
        store,
        base,
        label: cloud.label,
        _tmp: None,
    })
}

/// Writes a snapshot at parallelism `p` (every subtask concurrently) and commits it.
async fn write_snapshot(
    b: &Backend,
    job: &Path,
    kind: SnapshotKind,
    id: u64,
    p: u32,
) -> (Path, Manifest) {
    let a = Assignment::new(i64::from(p), i64::from(MAX_P)).unwrap();
    let dir = snapshot_dir(job, kind, id);
    let acks = futures::future::join_all((0..p).map(|i| {
        let (store, dir) = (b.store.clone(), dir.clone());
        async move {
            let blocks = a.range(i).iter().map(|g| (g, block(g, id), entries(g)));
            write_subtask_state(store, &dir, a, i, blocks).await
        }
    }))
    .await
    .into_iter()
    .collect::<Result<Vec<_>>>()
    .unwrap();
    let manifest = Manifest::assemble(meta(id, kind), a, acks).unwrap();
    commit_manifest(b.store.as_ref(), &dir, &manifest)
        .await
        .unwrap();
    (dir, manifest)
}

async fn round_trip(b: &Backend) {
    let job = job_dir(&b.base, "team-a", "clicks");
    let (dir, written) = write_snapshot(b, &job, SnapshotKind::Savepoint, 42, 4).await;

    let m = read_manifest(b.store.as_ref(), &dir).await.unwrap();
    assert_eq!(m, written);
    assert_eq!(m.files.len(), 4);
    assert_eq!(m.key_groups.len(), MAX_P as usize);
    assert_eq!(m.source_positions[&1], 2042);
    assert_eq!(
        m.source_partitions[&1], "part-b.jsonl",
        "names stored beside positions"
    );
    assert_eq!(m.watermark, Some(1_700_000_000_042));
    let expected_total: u64 = (0..MAX_P).map(|g| block(g, 42).len() as u64).sum();
    assert_eq!(m.stats.total_bytes, expected_total);
    assert_eq!(m.stats.total_keys, (0..MAX_P).map(entries).sum::<u64>());

    let report = verify(b.store.as_ref(), &dir).await.unwrap();
    assert_eq!(report.bytes_checked, expected_total, "{}", b.label);
    assert_eq!(report.files, 4);

    // Restore at p=3, p=8 and p=4: each new subtask reads exactly its own groups.
    for new_p in [3u32, 8, 4] {
        let new = Assignment::new(i64::from(new_p), i64::from(MAX_P)).unwrap();
        let mut total_read = 0;
        for i in 0..new_p {
            let r = new.range(i);
            let restored = read_groups(b.store.as_ref(), &dir, &m, r).await.unwrap();
            let groups: Vec<u32> = restored.groups.iter().map(|g| g.group).collect();
            assert_eq!(groups, r.iter().collect::<Vec<_>>());
            for g in &restored.groups {
                assert_eq!(g.bytes, block(g.group, 42), "{} group {}", b.label, g.group);
                assert_eq!(g.entries, entries(g.group));
            }
            let own: u64 = r.iter().map(|g| m.group(g).unwrap().length).sum();
            assert_eq!(
                restored.bytes_read, own,
                "{} p={new_p} subtask {i}",
                b.label
            );
            // One request per old file the range touches (adjacent blocks coalesced).
            let old = Assignment::new(4, i64::from(MAX_P)).unwrap();
            let touched = (0..4)
                .filter(|o| old.range(*o).intersect(&r).is_some())
                .count();
            assert!(
                restored.requests <= touched,
                "{} requests",
                restored.requests
            );
            total_read += restored.bytes_read;
        }
        assert_eq!(total_read, expected_total);
    }

    // A single group, and the open_snapshot(url) entry point on shared/persistent stores.
    let one = read_groups(
        b.store.as_ref(),
        &dir,
        &m,
        KeyGroupRange { start: 5, end: 5 },
    )
    .await
    .unwrap();
    assert_eq!(one.bytes_read, block(5, 42).len() as u64);
    assert_eq!(one.requests, 1);
    let err = read_groups(
        b.store.as_ref(),
        &dir,
        &m,
        KeyGroupRange {
            start: 0,
            end: MAX_P,
        },
    )
    .await
    .unwrap_err();
    assert!(matches!(err, SnapshotError::RangeOutsideSnapshot { .. }));
}

async fn create_only(b: &Backend) {
    let job = job_dir(&b.base, "ns", "once");
    let (dir, m) = write_snapshot(b, &job, SnapshotKind::Checkpoint, 1, 2).await;
    let err = commit_manifest(b.store.as_ref(), &dir, &m)
        .await
        .unwrap_err();
    assert!(
        matches!(err, SnapshotError::AlreadyExists { .. }),
        "{}: {err:?}",
        b.label
    );
    assert!(err.to_string().contains("_manifest.json"), "{err}");
    // A different manifest for the same id is refused too, and the original stays.
    let mut other = m.clone();
    other.source_positions.insert(9, 9);
    other.source_partitions.insert(9, "part-z.jsonl".into());
    let err = commit_manifest(b.store.as_ref(), &dir, &other)
        .await
        .unwrap_err();
    assert!(matches!(err, SnapshotError::AlreadyExists { .. }));
    assert_eq!(read_manifest(b.store.as_ref(), &dir).await.unwrap(), m);

    // A job with nothing stored lists nothing and retains nothing.
    let empty = job_dir(&b.base, "ns", "nothing-here");
    assert!(
        list_snapshots(b.store.as_ref(), &empty)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        latest_checkpoint(b.store.as_ref(), &empty)
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(
        retain(b.store.as_ref(), &empty, 3).await.unwrap(),
        RetentionReport::default()
    );

    // A manifest naming a file that was never written is not committed.
    let dir2 = snapshot_dir(&job, SnapshotKind::Checkpoint, 2);
    let err = commit_manifest(b.store.as_ref(), &dir2, &m)
        .await
        .unwrap_err();
    assert!(matches!(err, SnapshotError::MissingFile { .. }), "{err:?}");
    assert!(matches!(
        read_manifest(b.store.as_ref(), &dir2).await,
        Err(SnapshotError::ManifestMissing { .. })
    ));
}

/// Reads `path`, lets `f` change the bytes, writes them back.
async fn tamper(b: &Backend, path: &Path, f: impl FnOnce(&mut Vec<u8>)) {
    let mut data = b
        .store
        .get(path)
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap()
        .to_vec();
    f(&mut data);
    b.store.put(path, PutPayload::from(data)).await.unwrap();
}

/// The whole range owned by old subtask 1 at p=2 (its file: state-1-of-2.bin).
const FILE1_GROUPS: KeyGroupRange = KeyGroupRange {
    start: 64,
    end: 127,
};

async fn corruption(b: &Backend) {
    let job = job_dir(&b.base, "ns", "corrupt");
    let file_name = "state-1-of-2.bin";

    // Truncated state file.
    let (dir, m) = write_snapshot(b, &job, SnapshotKind::Checkpoint, 1, 2).await;
    let path = dir.clone().join(file_name);
    tamper(b, &path, |d| d.truncate(d.len() - 10)).await;
    let err = verify(b.store.as_ref(), &dir).await.unwrap_err();
    assert!(matches!(err, SnapshotError::SizeMismatch { .. }), "{err:?}");
    assert!(err.to_string().contains(file_name), "{err}");
    let err = read_groups(b.store.as_ref(), &dir, &m, FILE1_GROUPS)
        .await
        .unwrap_err();
    assert!(err.to_string().contains(file_name), "{}: {err}", b.label);
    // The intact file still restores.
    read_groups(
        b.store.as_ref(),
        &dir,
        &m,
        KeyGroupRange { start: 0, end: 63 },
    )
    .await
    .unwrap();

    // One flipped byte inside group 70's block.
    let (dir, m) = write_snapshot(b, &job, SnapshotKind::Checkpoint, 2, 2).await;
    let path = dir.clone().join(file_name);
    let g70 = m.group(70).unwrap().clone();
    assert!(g70.length > 0);
    tamper(b, &path, |d| {
        d[(g70.offset + g70.length / 2) as usize] ^= 0x10
    })
    .await;
    let err = verify(b.store.as_ref(), &dir).await.unwrap_err();
    assert!(
        matches!(err, SnapshotError::BlockChecksum { group: 70, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains(file_name), "{err}");
    let err = read_groups(b.store.as_ref(), &dir, &m, FILE1_GROUPS)
        .await
        .unwrap_err();
    assert!(
        matches!(err, SnapshotError::BlockChecksum { group: 70, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains(file_name), "{err}");
    // Groups around it are fine.
    read_groups(
        b.store.as_ref(),
        &dir,
        &m,
        KeyGroupRange {
            start: 71,
            end: 127,
        },
    )
    .await
    .unwrap();

    // Missing state file.
    let (dir, m) = write_snapshot(b, &job, SnapshotKind::Checkpoint, 3, 2).await;
    b.store.delete(&dir.clone().join(file_name)).await.unwrap();
    let err = verify(b.store.as_ref(), &dir).await.unwrap_err();
    assert!(matches!(err, SnapshotError::MissingFile { .. }), "{err:?}");
    assert!(err.to_string().contains(file_name), "{err}");
    let err = read_groups(b.store.as_ref(), &dir, &m, FILE1_GROUPS)
        .await
        .unwrap_err();
    assert!(matches!(err, SnapshotError::MissingFile { .. }), "{err:?}");
    assert!(err.to_string().contains(file_name), "{err}");

    // Corrupt (truncated) manifest, and garbage in place of it.
    let (dir, _m) = write_snapshot(b, &job, SnapshotKind::Checkpoint, 4, 2).await;
    let mpath = manifest_path(&dir);
    tamper(b, &mpath, |d| d.truncate(d.len() / 2)).await;
    let err = read_manifest(b.store.as_ref(), &dir).await.unwrap_err();
    assert!(
        matches!(err, SnapshotError::ManifestCorrupt { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("_manifest.json"), "{err}");
    let err = verify(b.store.as_ref(), &dir).await.unwrap_err();
    assert!(err.to_string().contains("_manifest.json"), "{err}");
    tamper(b, &mpath, |d| *d = b"\x00\x01not json".to_vec()).await;
    let err = read_manifest(b.store.as_ref(), &dir).await.unwrap_err();
    assert!(
        matches!(err, SnapshotError::ManifestCorrupt { .. }),
        "{err:?}"
    );

    // A manifest that parses but lies (a block length changed) is inconsistent.
    let (dir, _m) = write_snapshot(b, &job, SnapshotKind::Checkpoint, 5, 2).await;
    let mpath = manifest_path(&dir);
    tamper(b, &mpath, |d| {
        let mut m: serde_json::Value = serde_json::from_slice(d).unwrap();
        let len = m["keyGroups"][0]["length"].as_u64().unwrap();
        m["keyGroups"][0]["length"] = (len + 1).into();
        *d = serde_json::to_vec(&m).unwrap();
    })
    .await;
    let err = verify(b.store.as_ref(), &dir).await.unwrap_err();
    assert!(
        matches!(err, SnapshotError::ManifestInconsistent { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("_manifest.json"), "{err}");

    // A manifest copied into another snapshot's directory is refused by verify.
    let (dir, m) = write_snapshot(b, &job, SnapshotKind::Checkpoint, 6, 2).await;
    let elsewhere = snapshot_dir(&job, SnapshotKind::Savepoint, 6);
    for f in &m.files {
        let data = b
            .store
            .get(&dir.clone().join(f.name.as_str()))
            .await
            .unwrap();
        let data = data.bytes().await.unwrap();
        b.store
            .put(&elsewhere.clone().join(f.name.as_str()), data.into())
            .await
            .unwrap();
    }
    commit_manifest(b.store.as_ref(), &elsewhere, &m)
        .await
        .unwrap();
    let err = verify(b.store.as_ref(), &elsewhere).await.unwrap_err();
    assert!(err.to_string().contains("lies in directory sp-6"), "{err}");
}

async fn retention(b: &Backend) {
    let job = job_dir(&b.base, "ns", "retained");
    for id in [1, 2, 4, 5, 6] {
        write_snapshot(b, &job, SnapshotKind::Checkpoint, id, 2).await;
    }
    for id in [2, 3] {
        write_snapshot(b, &job, SnapshotKind::Savepoint, id, 3).await;
    }
    // Aborted checkpoint 3 (state written, never committed) and in-progress checkpoint 8.
    let a = Assignment::new(2, i64::from(MAX_P)).unwrap();
    for id in [3, 8] {
        let dir = snapshot_dir(&job, SnapshotKind::Checkpoint, id);
        let blocks = a.range(0).iter().map(|g| (g, block(g, id), 1));
        write_subtask_state(b.store.clone(), &dir, a, 0, blocks)
            .await
            .unwrap();
    }

    let listed = list_snapshots(b.store.as_ref(), &job).await.unwrap();
    let ids: Vec<(SnapshotKind, u64)> = listed.iter().map(|s| (s.kind, s.id)).collect();
    use SnapshotKind::*;
    assert_eq!(
        ids,
        [
            (Checkpoint, 1),
            (Checkpoint, 2),
            (Checkpoint, 4),
            (Checkpoint, 5),
            (Checkpoint, 6),
            (Savepoint, 2),
            (Savepoint, 3)
        ]
    );
    assert_eq!(listed[5].parallelism, 3);
    assert_eq!(listed[0].max_parallelism, MAX_P);
    assert!(listed[0].total_bytes > 0);
    let latest = latest_checkpoint(b.store.as_ref(), &job)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(latest.id, 6);

    let report = retain(b.store.as_ref(), &job, 2).await.unwrap();
    assert_eq!(report.kept, [6, 5]);
    assert_eq!(report.deleted, [1, 2, 4]);
    assert_eq!(report.orphans_deleted, [3]);
    // 3 deleted checkpoints x (manifest + 2 files) + the orphan's file.
    assert_eq!(report.objects_deleted, 3 * 3 + 1);

    let ids: Vec<(SnapshotKind, u64)> = list_snapshots(b.store.as_ref(), &job)
        .await
        .unwrap()
        .iter()
        .map(|s| (s.kind, s.id))
        .collect();
    assert_eq!(
        ids,
        [
            (Checkpoint, 5),
            (Checkpoint, 6),
            (Savepoint, 2),
            (Savepoint, 3)
        ]
    );
    for id in [1, 2, 3, 4] {
        let dir = snapshot_dir(&job, Checkpoint, id);
        let left: Vec<_> = futures::TryStreamExt::try_collect::<Vec<_>>(b.store.list(Some(&dir)))
            .await
            .unwrap();
        assert!(left.is_empty(), "{}: chk-{id} left {left:?}", b.label);
    }
    // The in-progress checkpoint newer than every committed one is left alone.
    let in_progress = snapshot_dir(&job, Checkpoint, 8).join("state-0-of-2.bin");
    b.store.head(&in_progress).await.unwrap();
    // Kept snapshots are intact.
    for (kind, id) in [
        (Checkpoint, 5),
        (Checkpoint, 6),
        (Savepoint, 2),
        (Savepoint, 3),
    ] {
        verify(b.store.as_ref(), &snapshot_dir(&job, kind, id))
            .await
            .unwrap();
    }
    // Idempotent.
    let again = retain(b.store.as_ref(), &job, 2).await.unwrap();
    assert_eq!(again.deleted, Vec::<u64>::new());
    assert_eq!(again.orphans_deleted, Vec::<u64>::new());
    // keep 0 still keeps the newest.
    let zero = retain(b.store.as_ref(), &job, 0).await.unwrap();
    assert_eq!(zero.kept, [6]);
    assert_eq!(zero.deleted, [5]);
}

/// A corrupt manifest (the newest checkpoint's) and one too large to be a manifest: a scan
/// reports both and lists the good ones, the strict listing refuses, and retention neither counts
/// nor deletes them (so the last good checkpoint is never deleted because of a bad newer one).
async fn unreadable_manifests(b: &Backend) {
    use SnapshotKind::*;
    let job = job_dir(&b.base, "ns", "bad-manifest");
    for id in [1, 2, 3, 4] {
        write_snapshot(b, &job, Checkpoint, id, 2).await;
    }
    let newest = manifest_path(&snapshot_dir(&job, Checkpoint, 4));
    tamper(b, &newest, |m| m.truncate(m.len() / 2)).await;
    let big = manifest_path(&snapshot_dir(&job, Checkpoint, 2));
    let huge = vec![b' '; MAX_MANIFEST_BYTES as usize + 1];
    b.store.put(&big, PutPayload::from(huge)).await.unwrap();

    let scan = scan_snapshots(b.store.as_ref(), &job).await.unwrap();
    let good: Vec<u64> = scan.snapshots.iter().map(|s| s.id).collect();
    assert_eq!(good, [1, 3], "{}", b.label);
    let bad: Vec<u64> = scan.unreadable.iter().map(|u| u.id).collect();
    assert_eq!(bad, [2, 4]);
    assert!(
        scan.unreadable[0].error.contains("more than"),
        "{}",
        scan.unreadable[0].error
    );
    assert!(
        scan.unreadable[1].error.contains("corrupt"),
        "{}",
        scan.unreadable[1].error
    );
    let err = list_snapshots(b.store.as_ref(), &job).await.unwrap_err();
    assert!(err.is_bad_manifest(), "{err}");
    let err = read_manifest(b.store.as_ref(), &snapshot_dir(&job, Checkpoint, 2))
        .await
        .unwrap_err();
    assert!(
        matches!(err, SnapshotError::ManifestTooLarge { .. }),
        "{err}"
    );

    let report = retain(b.store.as_ref(), &job, 1).await.unwrap();
    assert_eq!(report.kept, [3], "the newest good checkpoint is kept");
    assert_eq!(report.unreadable_kept, [4, 2]);
    assert_eq!(report.deleted, [1]);
    verify(b.store.as_ref(), &snapshot_dir(&job, Checkpoint, 3))
        .await
        .unwrap();
    b.store
        .head(&newest)
        .await
        .expect("the bad one is not deleted");
}

/// Big blocks through the multipart path with small parts; bounded parts in flight.
async fn multipart(b: &Backend, part_size: usize) {
    let job = job_dir(&b.base, "ns", "big");
    let dir = snapshot_dir(&job, SnapshotKind::Checkpoint, 1);
    let a = Assignment::new(1, 16).unwrap();
    let mut w = SnapshotWriter::new(b.store.clone(), &dir, a, 0)
        .unwrap()
        .with_parts(part_size, 2);
    let mut blocks = BTreeMap::new();
    // ~2.3 parts of data spread over uneven blocks, one bigger than a part, some empty.
    for g in [0u32, 1, 4, 5, 9, 15] {
        let len = match g {
            1 => part_size + part_size / 3,
            _ => part_size / 5 + g as usize,
        };
        let data: Bytes = (0..len)
            .map(|i| (i as u32 ^ g.wrapping_mul(2_654_435_761)) as u8)
            .collect::<Vec<u8>>()
            .into();
        blocks.insert(g, data.clone());
        w.write_group(g, data, u64::from(g)).await.unwrap();
    }
    // Out of order is refused and poisons nothing already written.
    assert!(matches!(
        w.write_group(3, Bytes::from_static(b"x"), 1).await,
        Err(SnapshotError::GroupOutOfOrder { group: 3, .. })
    ));
    let ack = w.finish().await.unwrap();
    let size: usize = blocks.values().map(Bytes::len).sum();
    assert_eq!(ack.file.size, size as u64);
    let mut meta = meta(1, SnapshotKind::Checkpoint);
    meta.source_positions.clear();
    meta.source_partitions.clear();
    meta.watermark = None;
    let m = Manifest::assemble(meta, a, vec![ack]).unwrap();
    commit_manifest(b.store.as_ref(), &dir, &m).await.unwrap();
    assert_eq!(
        verify(b.store.as_ref(), &dir).await.unwrap().bytes_checked,
        size as u64
    );
    let restored = read_groups(
        b.store.as_ref(),
        &dir,
        &m,
        KeyGroupRange { start: 1, end: 9 },
    )
    .await
    .unwrap();
    assert_eq!(restored.requests, 1);
    for g in restored.groups {
        assert_eq!(g.bytes, blocks.get(&g.group).cloned().unwrap_or_default());
    }
}

/// A snapshot whose subtasks write an operator-state section after their groups: it verifies,
/// its sections read back in subtask order, and a flipped byte in one is found by a verify and a
/// read, named, as a snapshot that cannot be restored; the key groups still read.
async fn operator_state_sections(b: &Backend) {
    let job = job_dir(&b.base, "ns", "operator-state");
    let a = Assignment::new(3, i64::from(MAX_P)).unwrap();
    let dir = snapshot_dir(&job, SnapshotKind::Checkpoint, 5);
    let section = |i: u32| Bytes::from(vec![0x40 + i as u8; 100 + i as usize]);
    let mut acks = Vec::new();
    for i in 0..3 {
        let mut w = SnapshotWriter::new(b.store.clone(), &dir, a, i).unwrap();
        for g in a.range(i).iter() {
            w.write_group(g, block(g, 5), entries(g)).await.unwrap();
        }
        w.write_operator_state(i, 3, section(i)).await.unwrap();
        acks.push(w.finish().await.unwrap());
    }
    let manifest = Manifest::assemble(meta(5, SnapshotKind::Checkpoint), a, acks).unwrap();
    assert_eq!(manifest.format_version, OPERATOR_STATE_FORMAT_VERSION);
    commit_manifest(b.store.as_ref(), &dir, &manifest)
        .await
        .unwrap();
    verify(b.store.as_ref(), &dir).await.unwrap();
    let read = read_operator_state(b.store.as_ref(), &dir, &manifest)
        .await
        .unwrap();
    assert_eq!(read, (0..3).map(section).collect::<Vec<_>>());

    let o = &manifest.operator_state[1];
    let path = dir.clone().join(o.file.as_str());
    let at = o.offset as usize + 7;
    tamper(b, &path, |d| d[at] ^= 1).await;
    let err = verify(b.store.as_ref(), &dir).await.unwrap_err();
    assert!(
        matches!(err, SnapshotError::OperatorStateDamaged { subtask: 1, .. }),
        "{}: {err:?}",
        b.label
    );
    let err = read_operator_state(b.store.as_ref(), &dir, &manifest)
        .await
        .unwrap_err();
    assert!(err.is_unrestorable(), "{err}");
    assert!(
        err.to_string().contains("operator state of subtask 1"),
        "{err}"
    );
    read_groups(b.store.as_ref(), &dir, &manifest, a.range(1))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_operator_state_sections() {
    operator_state_sections(&memory()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_operator_state_sections() {
    operator_state_sections(&file()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_round_trip() {
    round_trip(&memory()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_round_trip() {
    let b = file();
    let root = b._tmp.as_ref().unwrap().path().join("store");
    round_trip(&b).await;
    // The layout on disk is the documented one.
    let dir = root.join("team-a/clicks/savepoints/sp-42");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "_manifest.json",
            "state-0-of-4.bin",
            "state-1-of-4.bin",
            "state-2-of-4.bin",
            "state-3-of-4.bin"
        ]
    );
    let url = format!("file://{}", dir.display());
    let (_store, _dir, m) = open_snapshot(&url).await.unwrap();
    assert_eq!(m.snapshot_id, 42);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_create_only() {
    create_only(&memory()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_create_only() {
    create_only(&file()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_corruption_detected() {
    corruption(&memory()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_corruption_detected() {
    corruption(&file()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_retention() {
    retention(&memory()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_retention() {
    retention(&file()).await;
}

#[tokio::test]
async fn memory_unreadable_manifests() {
    unreadable_manifests(&memory()).await;
}

#[tokio::test]
async fn file_unreadable_manifests() {
    unreadable_manifests(&file()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_multipart() {
    multipart(&memory(), 64 * 1024).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_multipart() {
    multipart(&file(), 64 * 1024).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_urls_share_one_store() {
    let name = unique("shared");
    let b = memory();
    drop(b);
    let (store, base) = open_store(&format!("memory://{name}/x")).unwrap();
    let b = Backend {
        store,
        base,
        label: "memory",
        _tmp: None,
    };
    let job = job_dir(&b.base, "ns", "j");
    let (dir, m) = write_snapshot(&b, &job, SnapshotKind::Savepoint, 9, 2).await;
    let url = format!("memory://{name}/{dir}");
    let (_store, _dir, again) = open_snapshot(&url).await.unwrap();
    assert_eq!(again, m);
}

/// Every scenario against a cloud protocol's test server.
async fn all_scenarios(c: Cloud) {
    let Some(_) = cloud(c) else { return };
    let fresh = || cloud(c).expect("the server's URL is set");
    round_trip(&fresh()).await;
    create_only(&fresh()).await;
    corruption(&fresh()).await;
    retention(&fresh()).await;
    unreadable_manifests(&fresh()).await;
    // S3 and GCS (XML API) parts must be at least 5 MiB (all but the last).
    multipart(&fresh(), 5 * 1024 * 1024).await;
}

/// Every scenario against a real S3-protocol server (moto; see hack/s3-server.sh).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_all_scenarios() {
    all_scenarios(S3).await;
}

/// Every scenario against a real GCS-protocol server (fake-gcs-server; see hack/gcs-server.sh).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gcs_all_scenarios() {
    all_scenarios(GCS).await;
}

/// Every scenario against a real Azure Blob server (Azurite; see hack/azure-server.sh).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn azure_all_scenarios() {
    all_scenarios(AZURE).await;
}

/// Throughput of the write and range-read paths on file:// against raw `std::fs` with fsync, for
/// 2 MiB blocks (128 groups) and 8 KiB blocks (32768 groups). Size: KEYSHIFT_BENCH_MIB (256).
/// Run with `cargo test --release --test snapshot -- --ignored --nocapture throughput`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run explicitly"]
async fn throughput_file() {
    let mib: usize = std::env::var("KEYSHIFT_BENCH_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    for max_p in [128u32, 32768] {
        bench_file(mib, max_p).await;
    }
}

async fn bench_file(mib: usize, max_p: u32) {
    use std::time::Instant;
    let total = mib << 20;
    let per_group = total / max_p as usize;
    let data: Vec<Bytes> = (0..max_p)
        .map(|g| Bytes::from(vec![(g as u8).wrapping_mul(31) ^ 0x5a; per_group]))
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    let mbps = |secs: f64| (total as f64 / (1 << 20) as f64) / secs;
    let (store, base) = open_store(&format!("file://{}/store", tmp.path().display())).unwrap();
    let a = Assignment::new(1, i64::from(max_p)).unwrap();
    let all = KeyGroupRange {
        start: 0,
        end: max_p - 1,
    };

    const ROUNDS: u64 = 4;
    // Alternate raw and keyshift runs and keep each one's best, so that a shared, noisy machine
    // affects both alike.
    let mut best = [f64::MAX; 5];
    for round in 0..ROUNDS {
        let raw = tmp.path().join("raw.bin");
        let raw_write = || {
            let t = Instant::now();
            let file = std::fs::File::create(&raw).unwrap();
            let mut f = std::io::BufWriter::with_capacity(1 << 20, file);
            for d in &data {
                f.write_all(d).unwrap();
            }
            f.into_inner().unwrap().sync_all().unwrap();
            t.elapsed().as_secs_f64()
        };
        // Raw: one file, buffered sequential writes, fsync (first in even rounds, last in odd).
        if round % 2 == 0 {
            best[0] = best[0].min(raw_write());
        }
        // keyshift: one subtask writes every group into its state file.
        let dir = snapshot_dir(
            &job_dir(&base, "ns", "bench"),
            SnapshotKind::Checkpoint,
            round,
        );
        let t = Instant::now();
        let blocks = data
            .iter()
            .enumerate()
            .map(|(g, d)| (g as u32, d.clone(), 1));
        let ack = write_subtask_state(store.clone(), &dir, a, 0, blocks)
            .await
            .unwrap();
        best[1] = best[1].min(t.elapsed().as_secs_f64());
        if round % 2 == 1 {
            best[0] = best[0].min(raw_write());
        }
        let m = Manifest::assemble(meta(round, SnapshotKind::Checkpoint), a, vec![ack]).unwrap();
        commit_manifest(store.as_ref(), &dir, &m).await.unwrap();

        let t = Instant::now();
        let back = std::fs::read(&raw).unwrap();
        assert_eq!(back.len(), total);
        best[2] = best[2].min(t.elapsed().as_secs_f64());
        drop(back);

        // Restore of every group: range read, length and checksum checks.
        let t = Instant::now();
        let restored = read_groups(store.as_ref(), &dir, &m, all).await.unwrap();
        assert_eq!(restored.bytes_read, total as u64);
        best[3] = best[3].min(t.elapsed().as_secs_f64());
        drop(restored);

        let t = Instant::now();
        verify(store.as_ref(), &dir).await.unwrap();
        best[4] = best[4].min(t.elapsed().as_secs_f64());

        std::fs::remove_file(&raw).unwrap();
        retain(store.as_ref(), &job_dir(&base, "ns", "bench"), 1)
            .await
            .unwrap();
    }
    let [raw_write, ks_write, raw_read, ks_read, ks_verify] = best;
    let _ = writeln!(
        std::io::stderr(),
        "{mib} MiB in {max_p} blocks of {} KiB on file:// (best of {ROUNDS}): raw write+fsync {:.0} MB/s, keyshift write {:.0} MB/s ({:.2}x); raw read {:.0} MB/s, keyshift range read+check {:.0} MB/s ({:.2}x); verify {:.0} MB/s",
        per_group >> 10,
        mbps(raw_write),
        mbps(ks_write),
        raw_write / ks_write,
        mbps(raw_read),
        mbps(ks_read),
        raw_read / ks_read,
        mbps(ks_verify),
    );
}

/// A store whose multipart part uploads fail after `ok_parts` parts, to check the writer's failure
/// handling; records whether the upload was aborted.
#[derive(Debug)]
struct FailingParts {
    inner: object_store::memory::InMemory,
    ok_parts: usize,
    aborted: Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Display for FailingParts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FailingParts")
    }
}

#[derive(Debug)]
struct FailingUpload {
    inner: Box<dyn object_store::MultipartUpload>,
    left: usize,
    aborted: Arc<std::sync::atomic::AtomicBool>,
}

#[async_trait::async_trait]
impl object_store::MultipartUpload for FailingUpload {
    fn put_part(&mut self, data: PutPayload) -> object_store::UploadPart {
        if self.left == 0 {
            return Box::pin(async {
                Err(object_store::Error::Generic {
                    store: "FailingParts",
                    source: "injected part failure".into(),
                })
            });
        }
        self.left -= 1;
        self.inner.put_part(data)
    }
    async fn complete(&mut self) -> object_store::Result<object_store::PutResult> {
        self.inner.complete().await
    }
    async fn abort(&mut self) -> object_store::Result<()> {
        self.aborted.store(true, Ordering::SeqCst);
        self.inner.abort().await
    }
}

#[async_trait::async_trait]
impl ObjectStore for FailingParts {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: object_store::PutOptions,
    ) -> object_store::Result<object_store::PutResult> {
        self.inner.put_opts(location, payload, opts).await
    }
    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: object_store::PutMultipartOptions,
    ) -> object_store::Result<Box<dyn object_store::MultipartUpload>> {
        let inner = self.inner.put_multipart_opts(location, opts).await?;
        Ok(Box::new(FailingUpload {
            inner,
            left: self.ok_parts,
            aborted: self.aborted.clone(),
        }))
    }
    async fn get_opts(
        &self,
        location: &Path,
        options: object_store::GetOptions,
    ) -> object_store::Result<object_store::GetResult> {
        self.inner.get_opts(location, options).await
    }
    fn delete_stream(
        &self,
        locations: futures::stream::BoxStream<'static, object_store::Result<Path>>,
    ) -> futures::stream::BoxStream<'static, object_store::Result<Path>> {
        self.inner.delete_stream(locations)
    }
    fn list(
        &self,
        prefix: Option<&Path>,
    ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>> {
        self.inner.list(prefix)
    }
    async fn list_with_delimiter(
        &self,
        prefix: Option<&Path>,
    ) -> object_store::Result<object_store::ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }
    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: object_store::CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_upload_is_typed_aborted_and_poisons_the_writer() {
    let aborted = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let store: Arc<dyn ObjectStore> = Arc::new(FailingParts {
        inner: object_store::memory::InMemory::new(),
        ok_parts: 1,
        aborted: aborted.clone(),
    });
    let dir = Path::from("ns/j/checkpoints/chk-1");
    let a = Assignment::new(1, 8).unwrap();
    let mut w = SnapshotWriter::new(store.clone(), &dir, a, 0)
        .unwrap()
        .with_parts(64 * 1024, 1);
    let big = Bytes::from(vec![1u8; 256 * 1024]);
    let mut failure = None;
    for g in 0..8 {
        if let Err(e) = w.write_group(g, big.clone(), 1).await {
            failure = Some(e);
            break;
        }
    }
    // The failure surfaces at a later write (parts upload in the background) or at finish.
    let err = match failure {
        Some(e) => e,
        None => w.finish().await.unwrap_err(),
    };
    assert!(
        matches!(err, SnapshotError::Store { .. }),
        "{err:?} should be a store error"
    );
    assert!(err.to_string().contains("state-0-of-1.bin"), "{err}");
    assert!(aborted.load(Ordering::SeqCst), "the upload was not aborted");
    // Nothing was published.
    assert!(
        store
            .head(&dir.clone().join("state-0-of-1.bin"))
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writer_refuses_use_after_failure() {
    let aborted = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let store: Arc<dyn ObjectStore> = Arc::new(FailingParts {
        inner: object_store::memory::InMemory::new(),
        ok_parts: 0,
        aborted,
    });
    let a = Assignment::new(1, 8).unwrap();
    let mut w = SnapshotWriter::new(store, &Path::from("d"), a, 0)
        .unwrap()
        .with_parts(1024, 1);
    let block = Bytes::from(vec![1u8; 100 * 1024]);
    let mut errors = Vec::new();
    for g in 0..4 {
        if let Err(e) = w.write_group(g, block.clone(), 1).await {
            errors.push(e);
        }
    }
    assert!(
        matches!(errors.first(), Some(SnapshotError::Store { .. })),
        "{errors:?}"
    );
    assert!(
        errors[1..]
            .iter()
            .all(|e| matches!(e, SnapshotError::WriterFailed { .. })),
        "{errors:?}"
    );
    assert!(matches!(
        w.finish().await,
        Err(SnapshotError::WriterFailed { .. })
    ));
}
