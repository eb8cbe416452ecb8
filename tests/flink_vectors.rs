//! Bit-for-bit agreement with Apache Flink: `tests/data/flink_vectors.json` is produced by running
//! Flink's own `KeyGroupRangeAssignment` and `MathUtils` (see `hack/flink-vectors.sh`).

use keyshift::keygroup::{
    Assignment, Key, default_max_parallelism, key_group_for_hash, key_group_for_key, murmur_hash,
};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct KeyCase<K> {
    key: K,
    max_parallelism: u32,
    key_group: u32,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Vectors {
    flink_version: String,
    murmur: Vec<(i32, i32)>,
    string_keys: Vec<KeyCase<String>>,
    long_keys: Vec<KeyCase<i64>>,
    int_keys: Vec<KeyCase<i32>>,
    key_hash_groups: Vec<(i32, u32, u32)>,
    operator_index: Vec<(u32, u32, u32, u32)>,
    ranges: Vec<(u32, u32, u32, u32, u32)>,
    default_max_parallelism: Vec<(u32, u32)>,
}

fn vectors() -> Vectors {
    // The run-time CARGO_MANIFEST_DIR (set by `cargo test`): a binary reused from another
    // checkout's build cache still reads this checkout's file.
    let root = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    let text = std::fs::read_to_string(root.join("tests/data/flink_vectors.json"))
        .expect("tests/data/flink_vectors.json is part of the repository");
    serde_json::from_str(&text).expect("flink_vectors.json parses")
}

#[test]
fn vectors_are_from_flink() {
    let v = vectors();
    assert!(!v.flink_version.is_empty());
    // Every section is populated, so a truncated file cannot pass silently.
    assert!(v.murmur.len() >= 50);
    assert!(v.string_keys.len() >= 400);
    assert!(v.long_keys.len() >= 100 && v.int_keys.len() >= 100);
    assert!(v.operator_index.len() >= 1000 && v.ranges.len() >= 500);
}

#[test]
fn murmur_matches_flink() {
    for (input, expected) in vectors().murmur {
        assert_eq!(murmur_hash(input), expected, "murmur({input})");
    }
}

#[test]
fn key_groups_match_flink() {
    let v = vectors();
    for c in &v.string_keys {
        let got = key_group_for_key(&Key::String(c.key.clone()), c.max_parallelism);
        assert_eq!(
            got, c.key_group,
            "string key {:?} at {}",
            c.key, c.max_parallelism
        );
    }
    for c in &v.long_keys {
        let got = key_group_for_key(&Key::Long(c.key), c.max_parallelism);
        assert_eq!(
            got, c.key_group,
            "long key {} at {}",
            c.key, c.max_parallelism
        );
    }
    for c in &v.int_keys {
        let got = key_group_for_key(&Key::Int(c.key), c.max_parallelism);
        assert_eq!(
            got, c.key_group,
            "int key {} at {}",
            c.key, c.max_parallelism
        );
    }
    for (hash, g, expected) in v.key_hash_groups {
        assert_eq!(key_group_for_hash(hash, g), expected, "hash {hash} at {g}");
    }
}

#[test]
fn operator_index_and_ranges_match_flink() {
    let v = vectors();
    for (g, p, group, expected) in v.operator_index {
        let a = Assignment::new(i64::from(p), i64::from(g)).unwrap();
        assert_eq!(
            a.owner(group),
            expected,
            "owner of group {group} at p={p} g={g}"
        );
    }
    for (g, p, index, start, end) in v.ranges {
        let a = Assignment::new(i64::from(p), i64::from(g)).unwrap();
        let r = a.range(index);
        assert_eq!(
            (r.start, r.end),
            (start, end),
            "range of {index} at p={p} g={g}"
        );
    }
}

#[test]
fn default_max_parallelism_matches_flink() {
    for (p, expected) in vectors().default_max_parallelism {
        assert_eq!(default_max_parallelism(p), expected, "default for p={p}");
    }
}
