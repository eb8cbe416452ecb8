//! Property-driven fuzzing of everything that parses bytes from storage or the network: the
//! snapshot manifest (as bytes and as mutated JSON fields, then verified and read against the
//! store it names), state blocks, and the JSON-lines file reader. Each property starts from a
//! corpus (a real snapshot written by the job, and the files in `tests/data/fuzz/`) and mutates it;
//! the run is bounded (`FUZZ_CASES` per property, `PROPTEST_CASES` overrides) so it runs in CI.
//! Nothing may panic, allocate by an unchecked length, or accept a block whose bytes do not match
//! its manifest; a failing case is saved by proptest in `tests/fuzz.proptest-regressions` and replayed
//! first on every later run (commit it with the fix).
//!
//! Shuffle frames are fuzzed beside their private decoder (`runtime::shuffle` unit tests).

mod savepoint_support;

use bytes::Bytes;
use keyshift::job::state_codec;
use keyshift::job::{FieldMapping, FileSourceError, FileSourceReader};
use keyshift::keygroup::{KeyGroupRange, KeyType};
use keyshift::snapshot::{self, Manifest, manifest_path, open_store};
use object_store::{ObjectStoreExt, PutPayload};
use proptest::prelude::*;
use savepoint_support::{JobShape, build, memory_job};
use serde_json::Value;
use std::sync::OnceLock;

const FUZZ_CASES: u32 = 256;

fn config(cases: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cases);
    ProptestConfig {
        cases,
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::Direct(
                // Leaked once per config: the persistence wants a `&'static str`.
                Box::leak(
                    root()
                        .join("tests/fuzz.proptest-regressions")
                        .to_string_lossy()
                        .into_owned()
                        .into_boxed_str(),
                ),
            ),
        )),
        ..ProptestConfig::default()
    }
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime")
    })
}

/// The corpus snapshot: a real job's savepoint (p=2, 16 groups) in a memory store.
struct Corpus {
    url: String,
    manifest_json: Vec<u8>,
    blocks: Vec<Bytes>,
}

fn corpus() -> &'static Corpus {
    static C: OnceLock<Corpus> = OnceLock::new();
    C.get_or_init(|| {
        runtime().block_on(async {
            let shape = JobShape {
                keys: 200,
                partitions: 2,
                records_per_partition: 500,
                records_per_second: None,
                max_parallelism: 16,
                parallelism: 2,
                window: Some("1s"),
                ..JobShape::default()
            };
            let built = build(&memory_job(), shape).await;
            let (store, dir) = open_store(&built.url).expect("store");
            let manifest_json = store
                .get(&manifest_path(&dir))
                .await
                .expect("manifest")
                .bytes()
                .await
                .expect("bytes")
                .to_vec();
            let restore = snapshot::read_groups(
                store.as_ref(),
                &dir,
                &built.manifest,
                KeyGroupRange { start: 0, end: 15 },
            )
            .await
            .expect("the corpus snapshot reads");
            let blocks = restore.groups.into_iter().map(|g| g.bytes).collect();
            Corpus {
                url: built.url,
                manifest_json,
                blocks,
            }
        })
    })
}

/// A byte-level mutation: flip, set, insert, delete or truncate.
#[derive(Debug, Clone)]
enum Edit {
    Flip(usize, u8),
    Set(usize, u8),
    Insert(usize, Vec<u8>),
    Delete(usize, usize),
    Truncate(usize),
}

fn edits() -> impl Strategy<Value = Vec<Edit>> {
    let edit = prop_oneof![
        (any::<usize>(), 1u8..=255).prop_map(|(i, b)| Edit::Flip(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Edit::Set(i, b)),
        (
            any::<usize>(),
            proptest::collection::vec(any::<u8>(), 1..16)
        )
            .prop_map(|(i, v)| Edit::Insert(i, v)),
        (any::<usize>(), 1usize..64).prop_map(|(i, n)| Edit::Delete(i, n)),
        any::<usize>().prop_map(Edit::Truncate),
    ];
    proptest::collection::vec(edit, 1..6)
}

fn apply(mut data: Vec<u8>, edits: &[Edit]) -> Vec<u8> {
    for e in edits {
        let n = data.len().max(1);
        match e {
            Edit::Flip(i, b) if !data.is_empty() => data[i % n] ^= b,
            Edit::Set(i, b) if !data.is_empty() => data[i % n] = *b,
            Edit::Insert(i, v) => {
                let at = i % (data.len() + 1);
                data.splice(at..at, v.iter().copied());
            }
            Edit::Delete(i, k) if !data.is_empty() => {
                let at = i % n;
                let end = (at + k).min(data.len());
                data.drain(at..end);
            }
            Edit::Truncate(i) => data.truncate(i % (data.len() + 1)),
            _ => {}
        }
    }
    data
}

/// Every numeric leaf of a JSON document, as a path of keys and indices.
fn numeric_paths(v: &Value, path: &mut Vec<Value>, out: &mut Vec<Vec<Value>>) {
    match v {
        Value::Number(_) => out.push(path.clone()),
        Value::Object(m) => {
            for (k, child) in m {
                path.push(Value::String(k.clone()));
                numeric_paths(child, path, out);
                path.pop();
            }
        }
        Value::Array(a) => {
            for (i, child) in a.iter().enumerate() {
                path.push(Value::from(i));
                numeric_paths(child, path, out);
                path.pop();
            }
        }
        _ => {}
    }
}

fn leaf<'a>(v: &'a mut Value, path: &[Value]) -> Option<&'a mut Value> {
    path.iter().try_fold(v, |v, step| match step {
        Value::String(k) => v.get_mut(k.as_str()),
        Value::Number(i) => v.get_mut(i.as_u64()? as usize),
        _ => None,
    })
}

fn wild_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::from(0u64)),
        Just(Value::from(u64::MAX)),
        Just(Value::from(i64::MIN)),
        Just(Value::from(u32::MAX as u64 + 1)),
        Just(Value::from(1u64 << 40)),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (0u64..4096).prop_map(Value::from),
        Just(serde_json::json!(1.5)),
    ]
}

/// Writes `manifest` as the corpus snapshot's manifest in a copy of its store directory, then
/// verifies and reads it: an error is fine, a panic or a wrong block is not.
async fn verify_and_read(bytes: Vec<u8>) {
    let c = corpus();
    let (store, dir) = open_store(&c.url).expect("store");
    // A fresh snapshot directory (named like the corpus one) holding the same state files and
    // the mutated manifest.
    let tmp = snapshot::Path::from(format!(
        "fuzz/{}/savepoints/sp-1",
        savepoint_support::unique("m")
    ));
    let listing: Vec<_> = futures::TryStreamExt::try_collect(store.list(Some(&dir)))
        .await
        .expect("list");
    for meta in listing {
        let name = meta.location.filename().expect("a file name").to_owned();
        if name == "_manifest.json" {
            continue;
        }
        let data = store
            .get(&meta.location)
            .await
            .expect("get")
            .bytes()
            .await
            .expect("bytes");
        store
            .put(&tmp.clone().join(name.as_str()), PutPayload::from(data))
            .await
            .expect("put");
    }
    store
        .put(&manifest_path(&tmp), PutPayload::from(bytes.clone()))
        .await
        .expect("put manifest");
    let verified = snapshot::verify(store.as_ref(), &tmp).await;
    let manifest = match Manifest::from_json(&bytes, "fuzz") {
        Ok(m) => m,
        Err(_) => {
            assert!(
                verified.is_err(),
                "verify accepted a manifest that does not parse"
            );
            return;
        }
    };
    for range in [
        KeyGroupRange { start: 0, end: 15 },
        KeyGroupRange { start: 3, end: 9 },
        KeyGroupRange { start: 15, end: 15 },
    ] {
        if let Ok(restore) = snapshot::read_groups(store.as_ref(), &tmp, &manifest, range).await {
            // Whatever reads must be exactly what the manifest says, checksummed.
            for g in restore.groups {
                let entry = manifest
                    .key_groups
                    .iter()
                    .find(|e| e.group == g.group)
                    .expect("a restored group is in the manifest");
                assert_eq!(g.bytes.len() as u64, entry.length);
            }
        }
    }
}

fn mapping(key_type: KeyType) -> FieldMapping {
    FieldMapping {
        key_field: "key".into(),
        key_type,
        value_field: Some("value".into()),
        timestamp_field: Some("ts".into()),
    }
}

/// The repository root: the `CARGO_MANIFEST_DIR` the test runs with (a test executable reused
/// from another checkout's build reads this checkout's files), else the one it was built in.
fn root() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

fn corpus_files() -> Vec<Vec<u8>> {
    let dir = root().join("tests/data/fuzz");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("tests/data/fuzz")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "the JSON-lines corpus is empty");
    files
        .iter()
        .map(|p| std::fs::read(p).expect("read"))
        .collect()
}

/// Reads `data` as one partition file from `start` to its end: every position handed out is the
/// start of a line (or the end), and every error names a line start at or after the position.
fn read_all(data: &[u8], key_type: KeyType, start: u64) {
    let tmp = tempfile::tempdir().expect("tempdir");
    std::fs::write(tmp.path().join("p0.jsonl"), data).expect("write");
    let reader = FileSourceReader::open(tmp.path(), Some(mapping(key_type))).expect("open");
    let line_start = |o: u64| o == 0 || o as usize >= data.len() || data[o as usize - 1] == b'\n';
    let mut offset = start.min(data.len() as u64);
    let mut out = Vec::new();
    for _ in 0..data.len() + 2 {
        match reader.read_batch(0, offset, &mut out, 3) {
            Ok(batch) => {
                assert!(batch.next_offset >= offset && batch.next_offset <= data.len() as u64);
                if line_start(offset) {
                    assert!(
                        line_start(batch.next_offset),
                        "position {} mid-line",
                        batch.next_offset
                    );
                }
                if batch.at_end || batch.next_offset == offset {
                    return;
                }
                offset = batch.next_offset;
            }
            Err(FileSourceError::Malformed { offset: at, .. }) => {
                assert!(
                    at >= offset && at <= data.len() as u64,
                    "error at {at}, read from {offset}"
                );
                return;
            }
            Err(e) => panic!("unexpected error kind: {e}"),
        }
    }
    panic!("the reader did not reach the end");
}

proptest! {
    #![proptest_config(config(FUZZ_CASES))]

    #[test]
    fn manifest_bytes_never_panic(e in edits()) {
        let bytes = apply(corpus().manifest_json.clone(), &e);
        let _ = Manifest::from_json(&bytes, "fuzz");
    }

    #[test]
    fn arbitrary_bytes_are_never_a_manifest(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        prop_assert!(Manifest::from_json(&bytes, "fuzz").is_err());
    }

    #[test]
    fn state_blocks_never_panic(which in any::<usize>(), e in edits()) {
        let c = corpus();
        let block = apply(c.blocks[which % c.blocks.len()].to_vec(), &e);
        let _ = state_codec::decode_group(&block);
        let _ = state_codec::decode_header(&block);
    }

    #[test]
    fn json_lines_never_panic_and_positions_stay_on_line_starts(
        which in any::<usize>(),
        e in edits(),
        long in any::<bool>(),
        start in any::<u64>(),
    ) {
        let files = corpus_files();
        let data = apply(files[which % files.len()].clone(), &e);
        let key_type = if long { KeyType::Long } else { KeyType::String };
        read_all(&data, key_type, 0);
        // From anywhere (a position that is not a line start is never handed out, but a
        // corrupt snapshot could name one): no panic.
        read_all(&data, key_type, start % (data.len() as u64 + 1));
    }
}

proptest! {
    #![proptest_config(config(FUZZ_CASES / 4))]

    /// Any numeric field of a real manifest set to a wild value (offsets, lengths, sizes, group
    /// ids, parallelism, positions): parsing, verifying and reading never panic or allocate by
    /// the wild value, and anything read matches the manifest.
    #[test]
    fn manifest_fields_set_to_wild_values_are_refused_or_read_exactly(
        picks in proptest::collection::vec((any::<usize>(), wild_number()), 1..4),
    ) {
        let mut doc: Value = serde_json::from_slice(&corpus().manifest_json).expect("json");
        let mut paths = Vec::new();
        numeric_paths(&doc, &mut Vec::new(), &mut paths);
        for (i, value) in picks {
            let path = &paths[i % paths.len()];
            if let Some(slot) = leaf(&mut doc, path) {
                *slot = value;
            }
        }
        let bytes = serde_json::to_vec(&doc).expect("json");
        runtime().block_on(verify_and_read(bytes));
    }
}
