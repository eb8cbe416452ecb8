//! What the tests of programs share: the `silence-alert` example's heartbeats, partitioned by
//! device and cut into phases of arrival, the alerts its sink published, and the oracle's alerts
//! compared with them.

#![allow(dead_code)]

use keyshift_examples::silence::{self, Alert, Fleet, Heartbeat};
use std::collections::BTreeMap;
use std::path::Path;

/// Heartbeats as the oracle takes them: (key, event time, heartbeat), in arrival order.
pub type Records = Vec<(String, i64, Heartbeat)>;

/// The fleet the tests run: 150 devices beating every 5 s of event time for 10 minutes, a
/// silence after one beat in 12, out of order by up to 2 s.
pub fn fleet() -> Fleet {
    Fleet {
        devices: 150,
        period_ms: 5_000,
        silence_ms: keyshift_examples::SILENCE_MS,
        duration_ms: 600_000,
        outage_every: 12,
        max_out_of_orderness: 2_000,
        seed: 3,
    }
}

/// The source partition (of `partitions`) a device's heartbeats go to: one per device, so that
/// they keep their order.
pub fn partition_of(device: &str, partitions: u64) -> u64 {
    device
        .rsplit('-')
        .next()
        .and_then(|d| d.parse::<u64>().ok())
        .unwrap_or(0)
        % partitions
}

/// The heartbeats of `fleet` in three phases of arrival, then one last heartbeat per partition
/// (of `partitions`) from a device of its own far in the future, which moves every partition's
/// watermark past every real device's last watch. Returns the phases and every record.
pub fn phases(fleet: &Fleet, partitions: u64) -> (Vec<Vec<Heartbeat>>, Records) {
    let mut records = fleet.records();
    let n = records.len();
    let end = fleet.duration_ms + 10 * fleet.silence_ms;
    for p in 0..partitions {
        // A device named to land in partition p.
        let device = format!("end-{}", p + 1_000 * partitions);
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

/// Every line the sink published under `out` (committed snapshots' output), as `T`s, sorted;
/// fails on a line that is not one.
pub fn published<T: serde::de::DeserializeOwned + Ord>(out: &Path) -> Vec<T> {
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
                alerts.push(serde_json::from_str(line).expect("a record per line"));
            }
        }
    }
    alerts.sort();
    alerts
}

/// Checks that what the sink published under `out` is exactly `want` (sorted): nothing missing,
/// nothing twice, nothing else.
pub fn assert_published<T>(out: &Path, want: &[T])
where
    T: serde::de::DeserializeOwned + Ord + std::fmt::Debug,
{
    let got: Vec<T> = published(out);
    assert_eq!(
        got.len(),
        want.len(),
        "published {} of {}",
        got.len(),
        want.len()
    );
    assert_eq!(got, want);
}

/// Checks that the alerts published under `outs` (one sink directory per run) are exactly
/// those of the watches `records` ended once event time reached `watermark` (the job's last
/// savepoint's): none missing, none twice, none unexpected.
pub fn assert_alerts(outs: &[&Path], records: &Records, silence_ms: i64, watermark: i64) {
    let want: Vec<Alert> = silence::expected(records, silence_ms)
        .into_iter()
        .filter(|a| a.last_heartbeat + silence_ms <= watermark)
        .collect();
    let mut got: Vec<Alert> = outs.iter().flat_map(|o| published::<Alert>(o)).collect();
    got.sort();
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
