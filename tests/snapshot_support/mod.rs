//! A committed snapshot's state as the tests read it: through the real restore path, subtask by
//! subtask over the manifest's own assignment (as restoring workers read it). One reader for every
//! tier (the local runtime, the orchestrator pass, the fault tests and the e2e suite).
#![allow(dead_code)]

use keyshift::job::{self, AccValue};
use keyshift::keygroup::Key;
use keyshift::snapshot;
use std::collections::BTreeMap;

/// Every key's state in a snapshot, its source positions and its manifest.
pub struct SnapshotState {
    pub values: BTreeMap<Key, AccValue>,
    pub positions: BTreeMap<u32, u64>,
    pub manifest: snapshot::Manifest,
}

/// Reads the snapshot at `url`. Fails the test on a key found in two groups, and when the keys
/// read differ in number from the count the manifest records.
pub async fn read_state(url: &str) -> SnapshotState {
    let (store, dir, manifest) = snapshot::open_snapshot(url).await.expect("snapshot opens");
    let all = manifest.assignment().expect("manifest assignment");
    let mut values = BTreeMap::new();
    for i in 0..all.parallelism() {
        let restored = snapshot::read_groups(store.as_ref(), &dir, &manifest, all.range(i))
            .await
            .expect("groups read");
        for g in restored.groups.iter().filter(|g| !g.bytes.is_empty()) {
            // An incremental checkpoint's group: its block and its deltas, merged.
            let block = if g.deltas.is_empty() {
                g.bytes.to_vec()
            } else {
                job::state_codec::merge_chain(&g.bytes, &g.deltas)
                    .expect("chain merges")
                    .0
            };
            for (key, value) in job::decode_group(&block).expect("block decodes").entries {
                assert!(
                    values.insert(key, value.acc).is_none(),
                    "a key in two groups in {url}"
                );
            }
        }
    }
    assert_eq!(
        manifest.stats.total_keys as usize,
        values.len(),
        "the manifest of {url} counts the keys its blocks hold"
    );
    let positions = manifest.source_positions.clone();
    SnapshotState {
        values,
        positions,
        manifest,
    }
}

/// [`read_state`] for synchronous test code (the e2e suite).
pub fn read_state_blocking(url: &str) -> SnapshotState {
    tokio::runtime::Runtime::new()
        .expect("runtime")
        .block_on(read_state(url))
}

impl SnapshotState {
    /// Every key's scalar value (a count or sum); fails on windowed state.
    pub fn scalars(&self) -> BTreeMap<Key, i64> {
        self.values
            .iter()
            .map(|(k, acc)| match acc {
                AccValue::Scalar(v) => (k.clone(), *v),
                AccValue::Windows(_) => panic!("unexpected windowed state"),
            })
            .collect()
    }

    /// Every key's open windows (start, value); fails on scalar state.
    pub fn windows(&self) -> BTreeMap<Key, Vec<(i64, i64)>> {
        self.values
            .iter()
            .map(|(k, acc)| match acc {
                AccValue::Windows(w) => (k.clone(), w.clone()),
                AccValue::Scalar(_) => panic!("unexpected scalar state"),
            })
            .collect()
    }
}
