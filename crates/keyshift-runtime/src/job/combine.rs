//! Combining before the shuffle: the remedy for a hot key in the built-in aggregation.
//!
//! A key with a large share of the records is one key group's, so one subtask's, at any
//! parallelism. Count, sum, min and max are associative and commutative, so a source can fold the
//! records of one key (and, windowed, one window) in each batch it reads into one partial result
//! before the shuffle; the keyed operator then merges partials into its state
//! ([`super::aggregate::KeyedAggregator::process_partials`]) instead of applying each record.
//!
//! Exact by construction, with no state of its own: a batch is read between two control
//! commands, so it never spans a checkpoint barrier, and everything combined from it is sent
//! before the next barrier goes out. A snapshot, a rescale or a failure therefore sees each
//! record either in a partial that reached the operator before the barrier or not at all, as
//! without combining. A partial carries how many records it stands for (its weight), so the
//! operator's record and late-record counts stay counts of records.
//!
//! Combining costs a hash probe per record. A batch that saves little (few repeated keys, as in
//! a uniform stream over many keys) makes the source send the next batches as plain records
//! (the operator applies both kinds), then try again ([`keyshift_core::combining`]).

use super::Record;
use super::aggregate::merge;
use keyshift_core::combining::Pacing;
use keyshift_core::record_key::KeyBuildHasher;
use keyshift_core::spec::AggregateFunction;
use keyshift_core::window::window_start;
use std::hash::BuildHasher;

/// Partial results of the built-in aggregation, in the order their keys first appeared: each
/// record's value is the partial accumulator of the `weight` records it stands for (count: how
/// many; sum: their sum; min, max: theirs), all of its key and (windowed) its window, and its
/// timestamp the latest of theirs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Partials {
    records: Vec<Record>,
    weights: Vec<u32>,
}

impl Partials {
    /// Room for `n` partials.
    pub fn with_capacity(n: usize) -> Partials {
        Partials {
            records: Vec::with_capacity(n),
            weights: Vec::with_capacity(n),
        }
    }

    /// Appends a partial standing for `weight` records.
    #[inline]
    pub fn push(&mut self, record: Record, weight: u32) {
        self.records.push(record);
        self.weights.push(weight);
    }

    /// The partials.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// No partials.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// How many records the partials stand for.
    pub fn inputs(&self) -> u64 {
        self.weights.iter().map(|w| u64::from(*w)).sum()
    }

    /// Each partial with its weight.
    pub fn iter(&self) -> impl Iterator<Item = (&Record, u32)> {
        self.records.iter().zip(self.weights.iter().copied())
    }

    /// Takes every partial out, leaving this empty (its capacity kept).
    pub fn drain(&mut self) -> impl Iterator<Item = (Record, u32)> + '_ {
        self.records.drain(..).zip(self.weights.drain(..))
    }

    /// Empties this, keeping its capacity.
    pub fn clear(&mut self) {
        self.records.clear();
        self.weights.clear();
    }
}

/// A source's combiner for one built-in aggregation.
#[derive(Debug)]
pub struct Combiner {
    function: AggregateFunction,
    window_size_ms: Option<i64>,
    /// Where each (key, window) of the batch being combined is in `out`.
    table: hashbrown::HashTable<u32>,
    /// Each partial's window start (0 unwindowed), beside `out`.
    windows: Vec<i64>,
    out: Partials,
    pacing: Pacing,
    hasher: KeyBuildHasher,
    combined: u64,
}

impl Combiner {
    /// A combiner for `function`, in tumbling windows of `window_size_ms` if given (positive).
    pub fn new(function: AggregateFunction, window_size_ms: Option<i64>) -> Combiner {
        Combiner {
            function,
            window_size_ms,
            table: hashbrown::HashTable::new(),
            windows: Vec::new(),
            out: Partials::default(),
            pacing: Pacing::default(),
            hasher: KeyBuildHasher::default(),
            combined: 0,
        }
    }

    /// A record as the partial of itself alone: a count's value is 1 (a count ignores the
    /// record's own value), the others' the record's.
    #[inline]
    fn alone(&self, mut record: Record) -> Record {
        if self.function == AggregateFunction::Count {
            record.value = 1;
        }
        record
    }

    /// Whether to combine the next batch ([`Pacing::attempt`]): a batch not combined is sent
    /// as plain records.
    pub fn attempt(&mut self) -> bool {
        self.pacing.attempt()
    }

    /// Combines `batch` (emptied, its capacity kept) into partials, returned until the next
    /// call. Every record is in exactly one of them.
    pub fn combine(&mut self, batch: &mut Vec<Record>) -> &mut Partials {
        self.out.clear();
        let n = batch.len();
        self.table.clear();
        self.windows.clear();
        let (f, size) = (self.function, self.window_size_ms);
        for r in batch.drain(..) {
            let r = self.alone(r);
            let window = size.map_or(0, |s| window_start(r.ts, s));
            let hash = self.hasher.hash_one((&r.key, window));
            let records = &self.out.records;
            let windows = &self.windows;
            let found = self.table.find(hash, |&i| {
                windows[i as usize] == window && records[i as usize].key == r.key
            });
            match found {
                Some(&i) => {
                    let i = i as usize;
                    let p = &mut self.out.records[i];
                    p.value = merge(f, p.value, r.value);
                    p.ts = p.ts.max(r.ts);
                    self.out.weights[i] += 1;
                }
                None => {
                    let i = self.out.len() as u32;
                    let hasher = &self.hasher;
                    self.table.insert_unique(hash, i, |&j| {
                        hasher.hash_one((&records[j as usize].key, windows[j as usize]))
                    });
                    self.windows.push(window);
                    self.out.push(r, 1);
                }
            }
        }
        self.combined += (n - self.out.len()) as u64;
        self.pacing.judge(n, self.out.len());
        &mut self.out
    }

    /// Records combined into another so far (the input records less the partials sent).
    pub fn combined(&self) -> u64 {
        self.combined
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::aggregate::{AggConfig, KeyedAggregator};
    use keyshift_core::keygroup::KeyGroupRange;
    use keyshift_core::record_key::RecordKey;
    use proptest::prelude::*;

    fn rec(key: &str, value: i64, ts: i64) -> Record {
        Record {
            key: RecordKey::string(key),
            value,
            ts,
        }
    }

    fn functions() -> impl Strategy<Value = AggregateFunction> {
        prop_oneof![
            Just(AggregateFunction::Count),
            Just(AggregateFunction::Sum),
            Just(AggregateFunction::Min),
            Just(AggregateFunction::Max),
        ]
    }

    #[test]
    fn a_hot_key_becomes_one_partial_per_batch() {
        let mut c = Combiner::new(AggregateFunction::Sum, None);
        let mut batch = vec![
            rec("hot", 3, 1),
            rec("a", 1, 2),
            rec("hot", 4, 5),
            rec("hot", -2, 3),
        ];
        let out: Vec<_> = c.combine(&mut batch).drain().collect();
        assert!(batch.is_empty());
        assert_eq!(out, vec![(rec("hot", 5, 5), 3), (rec("a", 1, 2), 1)]);
        assert_eq!(c.combined(), 2);
    }

    #[test]
    fn a_count_counts_records_not_their_values() {
        let mut c = Combiner::new(AggregateFunction::Count, None);
        let mut batch = vec![rec("k", 40, 1), rec("k", 7, 2), rec("j", 9, 3)];
        let out: Vec<_> = c.combine(&mut batch).drain().collect();
        assert_eq!(out, vec![(rec("k", 2, 2), 2), (rec("j", 1, 3), 1)]);
    }

    #[test]
    fn windows_are_combined_apart() {
        let mut c = Combiner::new(AggregateFunction::Max, Some(10));
        let mut batch = vec![
            rec("k", 1, 9),
            rec("k", 5, 10),
            rec("k", 2, 0),
            rec("k", 3, 19),
        ];
        let out: Vec<_> = c.combine(&mut batch).drain().collect();
        assert_eq!(out, vec![(rec("k", 2, 9), 2), (rec("k", 5, 19), 2)]);
    }

    #[test]
    fn a_batch_that_saves_little_passes_the_next_ones_through() {
        let mut c = Combiner::new(AggregateFunction::Count, None);
        let mut batch: Vec<Record> = (0..64).map(|i| rec(&format!("k{i}"), 9, 0)).collect();
        assert!(c.attempt());
        assert_eq!(c.combine(&mut batch).len(), 64);
        for _ in 0..keyshift_core::combining::PASS_BATCHES {
            assert!(!c.attempt(), "passed through");
        }
        assert!(c.attempt(), "tried again after the pass");
        let mut hot = vec![rec("hot", 9, 0); 64];
        assert_eq!(c.combine(&mut hot).len(), 1);
        assert!(c.attempt(), "a batch that saved enough keeps combining");
        assert_eq!(c.combined(), 63);
    }

    proptest! {
        /// Combining any batches and merging the partials gives the state, the fired windows,
        /// the record count and the late-record count of applying every record.
        #[test]
        fn combined_batches_aggregate_exactly_as_their_records(
            function in functions(),
            windowed in any::<bool>(),
            batches in proptest::collection::vec(
                proptest::collection::vec((0u8..6, -50i64..50, 0i64..100), 0..40),
                1..8,
            ),
            watermarks in proptest::collection::vec(0i64..120, 8),
        ) {
            let config = AggConfig {
                function,
                window_size_ms: windowed.then_some(10),
                max_parallelism: 128,
                state_payload_bytes: 0,
            };
            let batches: Vec<Vec<Record>> = batches
                .into_iter()
                .map(|b| b.into_iter().map(|(k, v, ts)| rec(&format!("k{k}"), v, ts)).collect())
                .collect();
            let mut plain = KeyedAggregator::new(config, KeyGroupRange { start: 0, end: 127 }).unwrap();
            let mut combined = KeyedAggregator::new(config, KeyGroupRange { start: 0, end: 127 }).unwrap();
            let mut c = Combiner::new(function, config.window_size_ms);
            for (b, wm) in batches.iter().zip(watermarks) {
                plain.process_batch(b).unwrap();
                if c.attempt() {
                    let mut copy = b.clone();
                    let partials = c.combine(&mut copy).clone();
                    prop_assert_eq!(partials.inputs(), b.len() as u64);
                    combined.process_partials(partials.iter()).unwrap();
                } else {
                    // Passed through as they are, beside partials.
                    combined.process_batch(b).unwrap();
                }
                prop_assert_eq!(plain.advance_watermark(wm), combined.advance_watermark(wm));
            }
            prop_assert_eq!(plain.results(), combined.results());
            prop_assert_eq!(plain.records_processed(), combined.records_processed());
            prop_assert_eq!(plain.late_records(), combined.late_records());
        }
    }
}
