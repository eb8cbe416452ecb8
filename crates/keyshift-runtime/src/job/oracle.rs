//! The oracle: exact expected results for given source positions, computed by a plain loop over
//! the source, independently of the operator, the shuffle and the state codec.
//!
//! End-to-end tests run a job (rescaling it on the way), collect what its sink committed plus
//! what is still open, and compare with [`expected_results`]. With a window the oracle assumes no
//! record is late, which holds for the generator (timestamps never decrease within a partition);
//! for a file source it holds when the files are in event-time order per partition within the
//! configured out-of-orderness.

use super::result::ResultRow;
use super::{JobError, SourceKind, compile};
use keyshift_core::keygroup::Key;
use keyshift_core::spec::{AggregateFunction, JobSpec};
use std::collections::BTreeMap;

/// Expected per-key results.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expected {
    /// All-time aggregate per key.
    Global(BTreeMap<Key, i64>),
    /// Per key, window start -> aggregate.
    Windowed(BTreeMap<Key, BTreeMap<i64, i64>>),
}

/// Two rows for the same key (and window) when building [`Expected`] from operator output.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "duplicate result for key {key} window {window:?}: a window fired twice or two subtasks own one key"
)]
pub struct DuplicateRow {
    /// The key.
    pub key: Key,
    /// The window start, if windowed.
    pub window: Option<i64>,
}

impl Expected {
    /// Collects operator output (from any number of subtasks) into the oracle's shape. Each key
    /// (and window) must appear once.
    pub fn from_rows(
        windowed: bool,
        rows: impl IntoIterator<Item = ResultRow>,
    ) -> Result<Expected, DuplicateRow> {
        if windowed {
            let mut m: BTreeMap<Key, BTreeMap<i64, i64>> = BTreeMap::new();
            for r in rows {
                let start = r.window.map_or(i64::MIN, |w| w.start);
                let key = r.key.to_key();
                if m.entry(key.clone())
                    .or_default()
                    .insert(start, r.value)
                    .is_some()
                {
                    return Err(DuplicateRow {
                        key,
                        window: Some(start),
                    });
                }
            }
            Ok(Expected::Windowed(m))
        } else {
            let mut m = BTreeMap::new();
            for r in rows {
                let key = r.key.to_key();
                if m.insert(key.clone(), r.value).is_some() {
                    return Err(DuplicateRow { key, window: None });
                }
            }
            Ok(Expected::Global(m))
        }
    }

    /// Number of keys.
    pub fn keys(&self) -> usize {
        match self {
            Expected::Global(m) => m.len(),
            Expected::Windowed(m) => m.len(),
        }
    }
}

fn fold(f: AggregateFunction, acc: Option<i64>, v: i64) -> i64 {
    match (f, acc) {
        (AggregateFunction::Count, None) => 1,
        (AggregateFunction::Count, Some(c)) => c.wrapping_add(1),
        (AggregateFunction::Sum, None) => v,
        (AggregateFunction::Sum, Some(s)) => s.wrapping_add(v),
        (AggregateFunction::Min, None) => v,
        (AggregateFunction::Min, Some(m)) => m.min(v),
        (AggregateFunction::Max, None) => v,
        (AggregateFunction::Max, Some(m)) => m.max(v),
    }
}

/// The exact aggregate per key (and window) over records `0..positions[p]` of every partition
/// `p` listed (generator: sequence numbers, clamped to a bounded partition's end; file source:
/// byte offsets at line starts). Partitions not listed contribute nothing.
pub fn expected_results(
    spec: &JobSpec,
    positions: &BTreeMap<u32, u64>,
) -> Result<Expected, JobError> {
    let job = compile(spec, 128, &Default::default())?;
    let f = match &job.logic {
        super::Logic::Aggregate(config) => config.function,
        super::Logic::Program { name, .. } => return Err(JobError::NotAggregate(name.clone())),
    };
    let size = job.window_size_ms;
    let mut global: BTreeMap<Key, i64> = BTreeMap::new();
    let mut windowed: BTreeMap<Key, BTreeMap<i64, i64>> = BTreeMap::new();
    let mut apply = |key: Key, value: i64, ts: i64| match size {
        None => {
            let e = global.get(&key).copied();
            global.insert(key, fold(f, e, value));
        }
        Some(size) => {
            let start = ts.div_euclid(size).checked_mul(size).unwrap_or(i64::MIN);
            let w = windowed.entry(key).or_default();
            let e = w.get(&start).copied();
            w.insert(start, fold(f, e, value));
        }
    };
    match &job.source {
        SourceKind::Generator(g) => {
            for (&p, &end) in positions {
                if p >= g.partitions() {
                    continue;
                }
                let end = g.end().map_or(end, |e| e.min(end));
                for seq in 0..end {
                    let r = g.record(p, seq);
                    apply(r.key.to_key(), r.value, r.ts);
                }
            }
        }
        SourceKind::File(src) => {
            for (&p, &end) in positions {
                let mut offset = 0;
                while offset < end {
                    let mut out = Vec::new();
                    let b = src.read_batch(p, offset, &mut out, 1)?;
                    if b.next_offset > end || b.records == 0 {
                        break;
                    }
                    for r in out {
                        apply(r.key.to_key(), r.value, r.ts);
                    }
                    offset = b.next_offset;
                }
            }
        }
        // The oracle replays only sources it can read deterministically; a Kafka test computes
        // its totals from the records it produced.
        #[cfg(feature = "kafka")]
        SourceKind::Kafka(_) => return Err(JobError::OracleKafka),
    }
    Ok(match size {
        None => Expected::Global(global),
        Some(_) => Expected::Windowed(windowed),
    })
}
