//! The deterministic generator source.
//!
//! Record `n` of partition `k` is a pure function of `(seed, k, n)`, so every process (a worker
//! replaying from a restored position, the oracle, a test) computes the same record without
//! coordination:
//!
//! ```text
//! GAMMA   = 0x9e3779b97f4a7c15
//! mix(z)  = splitmix64's finaliser
//! base(k) = mix(seed ^ mix((k + 1) * GAMMA))
//! h(k, n) = mix(base(k) + (n + 1) * GAMMA)                 (all arithmetic wrapping, u64)
//! key     = uniform: key index floor(h * keys / 2^64)
//!           zipf:    rank r with cdf[r-1] <= u < cdf[r], u = (h >> 11) / 2^53,
//!                    cdf over weights 1/(r+1)^s; rank 0 (key index 0) is the hottest key
//! value   = 1 + (mix2(h) >> 32) % 100                        (1..=100)
//! ts      = n * 1000 / recordsPerSecond  when recordsPerSecond is set, else n   (milliseconds)
//! ```
//!
//! Key index `i` becomes `"key-<i>"` (string), `i` (long) or `i as i32` (int). Timestamps never
//! decrease within a partition, so with the bounded-out-of-orderness watermark no generated
//! record is ever late: windowed results are exact whatever the interleaving of partitions.
//!
//! String keys come from a table built once, on first use (up to [`MAX_KEY_TABLE`] keys; a worker
//! whose partitions are all finished never builds it), so a record costs no
//! allocation; each key caches its Java hash, so routing a record to its key group is a murmur
//! mix, not a pass over the string. Pacing (`recordsPerSecond`) is the caller's job:
//! [`Generator::due_records`] says how many records of a partition are due after a given time.

use super::record::{Record, RecordKey};
use keyshift_core::keygroup::KeyType;
use keyshift_core::spec::{GeneratorSource, KeyDistribution};
use std::sync::{Arc, OnceLock};

/// The largest number of string keys kept in the pre-built key table; beyond it string keys
/// are formatted per record (slower, still correct).
pub const MAX_KEY_TABLE: u64 = 1 << 24;
/// The largest number of keys a Zipf distribution supports (its CDF table is 8 bytes a key).
pub const MAX_ZIPF_KEYS: u64 = 1 << 23;

const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// splitmix64's output function.
#[inline(always)]
pub fn splitmix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A generator spec that cannot run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GeneratorError {
    #[error("generator partitions must be between 1 and {max} (got {got})", max = u32::MAX)]
    Partitions { got: i64 },
    #[error("generator keys must be at least 1 (got {0})")]
    Keys(i64),
    #[error(
        "generator keys {keys} exceed the int key range: int keys are 0..2^31, use key type long"
    )]
    TooManyIntKeys { keys: u64 },
    #[error(
        "a zipf generator supports at most {MAX_ZIPF_KEYS} keys (got {keys}): use fewer keys or the uniform distribution"
    )]
    TooManyZipfKeys { keys: u64 },
    #[error("zipfExponent must be a finite number >= 0 (got {0})")]
    ZipfExponent(f64),
    #[error("recordsPerSecond must be at least 1 when set (got {0})")]
    RecordsPerSecond(i64),
    #[error("recordsPerPartition must be at least 0 when set (got {0})")]
    RecordsPerPartition(i64),
}

/// The Zipf sampler: a CDF over ranks plus a guide table that maps `floor(u * m)` to the first
/// rank whose CDF exceeds `j / m`, so a draw is a short binary search.
#[derive(Debug)]
pub struct Zipf {
    cdf: Vec<f64>,
    guide: Vec<u32>,
}

impl Zipf {
    /// Zipf over `keys` ranks (at least one) with exponent `s`: rank `r` (0-based) has
    /// probability proportional to `(r + 1)^-s`.
    pub fn new(keys: usize, s: f64) -> Zipf {
        let mut cdf = Vec::with_capacity(keys);
        let mut total = 0.0f64;
        for r in 0..keys {
            total += ((r + 1) as f64).powf(-s);
            cdf.push(total);
        }
        for c in &mut cdf {
            *c /= total;
        }
        if let Some(last) = cdf.last_mut() {
            *last = 1.0;
        }
        let m = keys.clamp(1, 1 << 22);
        let mut guide = Vec::with_capacity(m + 1);
        let mut r = 0usize;
        for j in 0..m {
            let threshold = j as f64 / m as f64;
            while r + 1 < keys && cdf[r] <= threshold {
                r += 1;
            }
            guide.push(r as u32);
        }
        guide.push((keys - 1) as u32);
        Zipf { cdf, guide }
    }

    /// The probability of rank `r`.
    pub fn share(&self, r: usize) -> f64 {
        self.cdf[r] - r.checked_sub(1).map_or(0.0, |q| self.cdf[q])
    }

    /// The rank for a uniform `u` in `[0, 1)`.
    #[inline]
    pub fn rank(&self, u: f64) -> u64 {
        let m = self.guide.len() - 1;
        let j = ((u * m as f64) as usize).min(m - 1);
        let lo = self.guide[j] as usize;
        let hi = (self.guide[j + 1] as usize + 1).min(self.cdf.len());
        let within = self.cdf[lo..hi].partition_point(|&c| c <= u);
        (lo + within).min(self.cdf.len() - 1) as u64
    }
}

#[derive(Debug, Clone)]
enum Dist {
    Uniform,
    Zipf(Arc<Zipf>),
}

/// The deterministic, partitioned generator. Cheap to clone (tables are shared).
#[derive(Debug, Clone)]
pub struct Generator {
    partitions: u32,
    keys: u64,
    seed: u64,
    key_type: KeyType,
    dist: Dist,
    /// The string keys by index, when `key_type` is string and `keys <= MAX_KEY_TABLE`; built on
    /// first use and shared by clones.
    table: Option<Arc<OnceLock<Arc<[RecordKey]>>>>,
    records_per_partition: Option<u64>,
    records_per_second: Option<u64>,
}

impl Generator {
    /// Builds the generator (and its key and CDF tables) from the spec and the key type.
    pub fn new(spec: &GeneratorSource, key_type: KeyType) -> Result<Generator, GeneratorError> {
        let partitions = u32::try_from(spec.partitions)
            .ok()
            .filter(|p| *p >= 1)
            .ok_or(GeneratorError::Partitions {
                got: i64::from(spec.partitions),
            })?;
        if spec.keys < 1 {
            return Err(GeneratorError::Keys(spec.keys));
        }
        let keys = spec.keys as u64;
        if key_type == KeyType::Int && keys > 1 << 31 {
            return Err(GeneratorError::TooManyIntKeys { keys });
        }
        let dist = match spec.distribution {
            KeyDistribution::Uniform => Dist::Uniform,
            KeyDistribution::Zipf => {
                let s = spec.zipf_exponent.unwrap_or(1.0);
                if !s.is_finite() || s < 0.0 {
                    return Err(GeneratorError::ZipfExponent(s));
                }
                if keys > MAX_ZIPF_KEYS {
                    return Err(GeneratorError::TooManyZipfKeys { keys });
                }
                Dist::Zipf(Arc::new(Zipf::new(keys as usize, s)))
            }
        };
        let records_per_second = match spec.records_per_second {
            None => None,
            Some(r) if r >= 1 => Some(r as u64),
            Some(r) => return Err(GeneratorError::RecordsPerSecond(r)),
        };
        let records_per_partition = match spec.records_per_partition {
            None => None,
            Some(r) if r >= 0 => Some(r as u64),
            Some(r) => return Err(GeneratorError::RecordsPerPartition(r)),
        };
        let table = (key_type == KeyType::String && keys <= MAX_KEY_TABLE)
            .then(|| Arc::new(OnceLock::new()));
        Ok(Generator {
            partitions,
            keys,
            seed: spec.seed as u64,
            key_type,
            dist,
            table,
            records_per_partition,
            records_per_second,
        })
    }

    /// Number of partitions.
    pub fn partitions(&self) -> u32 {
        self.partitions
    }

    /// Number of distinct keys.
    pub fn keys(&self) -> u64 {
        self.keys
    }

    /// The key type records carry.
    pub fn key_type(&self) -> KeyType {
        self.key_type
    }

    /// Records per second per partition the caller should pace to, if any.
    pub fn records_per_second(&self) -> Option<u64> {
        self.records_per_second
    }

    /// The sequence number at which a partition ends (exclusive), if it is bounded.
    pub fn end(&self) -> Option<u64> {
        self.records_per_partition
    }

    /// How many records of a partition are due `elapsed_ms` after it started, when paced
    /// (`None` when unpaced): record `n` is due once `elapsed_ms >= ts(n)`.
    pub fn due_records(&self, elapsed_ms: u64) -> Option<u64> {
        self.records_per_second.map(|r| {
            let due = (u128::from(elapsed_ms) * u128::from(r)) / 1000 + 1;
            let due = due.min(u128::from(u64::MAX)) as u64;
            self.records_per_partition.map_or(due, |end| due.min(end))
        })
    }

    /// The string key table, built on first use.
    #[inline]
    fn table(&self) -> Option<&[RecordKey]> {
        self.table
            .as_ref()
            .map(|t| &**t.get_or_init(|| (0..self.keys).map(string_key).collect()))
    }

    /// The key with index `i` (`0..keys`).
    pub fn key_for_index(&self, i: u64) -> RecordKey {
        match self.key_type {
            KeyType::Long => RecordKey::long(i as i64),
            KeyType::Int => RecordKey::int(i as i32),
            KeyType::String => match self.table() {
                Some(t) if (i as usize) < t.len() => t[i as usize].clone(),
                _ => string_key(i),
            },
        }
    }

    #[inline(always)]
    fn base(&self, partition: u32) -> u64 {
        splitmix64(self.seed ^ splitmix64((u64::from(partition) + 1).wrapping_mul(GAMMA)))
    }

    #[inline(always)]
    fn key_index_of_hash(&self, h: u64) -> u64 {
        match &self.dist {
            Dist::Uniform => ((u128::from(h) * u128::from(self.keys)) >> 64) as u64,
            Dist::Zipf(z) => z.rank((h >> 11) as f64 * (1.0 / (1u64 << 53) as f64)),
        }
    }

    #[inline(always)]
    fn ts_of(&self, seq: u64) -> i64 {
        match self.records_per_second {
            None => seq as i64,
            Some(r) => ((u128::from(seq) * 1000) / u128::from(r)).min(i64::MAX as u128) as i64,
        }
    }

    #[inline(always)]
    fn make(&self, table: Option<&[RecordKey]>, h: u64, seq: u64) -> Record {
        let i = self.key_index_of_hash(h);
        let key = match (self.key_type, table) {
            (KeyType::Long, _) => RecordKey::long(i as i64),
            (KeyType::Int, _) => RecordKey::int(i as i32),
            (KeyType::String, Some(t)) => t[i as usize].clone(),
            (KeyType::String, None) => string_key(i),
        };
        let v = (h ^ (h >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9) >> 32;
        Record {
            key,
            value: 1 + (v % 100) as i64,
            ts: self.ts_of(seq),
        }
    }

    /// The key index (`0..keys`, equal to the Zipf rank) of record `seq` of `partition`.
    pub fn key_index(&self, partition: u32, seq: u64) -> u64 {
        self.key_index_of_hash(self.hash(partition, seq))
    }

    /// Record `seq` of `partition`: a pure function of the seed, the partition and `seq`
    /// (it ignores `recordsPerPartition`; see [`Generator::fill`] for the bounded stream).
    pub fn record(&self, partition: u32, seq: u64) -> Record {
        self.make(self.table(), self.hash(partition, seq), seq)
    }

    /// The same record as [`Generator::record`], made without building the key table (a
    /// string key of its own unless the table is built already): for a look at one record,
    /// where building a table of every key would cost as much as the job's first batch.
    pub fn sample(&self, partition: u32, seq: u64) -> Record {
        let built = self.table.as_ref().and_then(|t| t.get()).map(|t| &**t);
        self.make(built, self.hash(partition, seq), seq)
    }

    #[inline(always)]
    fn hash(&self, partition: u32, seq: u64) -> u64 {
        splitmix64(
            self.base(partition)
                .wrapping_add(seq.wrapping_add(1).wrapping_mul(GAMMA)),
        )
    }

    /// Appends up to `max` records of `partition` starting at `from_seq`, stopping at the end of
    /// a bounded partition; returns how many were appended (the next position is
    /// `from_seq + returned`). Partitions outside `0..partitions()` are empty.
    pub fn fill(&self, partition: u32, from_seq: u64, out: &mut Vec<Record>, max: usize) -> usize {
        if partition >= self.partitions {
            return 0;
        }
        let end = self.records_per_partition.unwrap_or(u64::MAX);
        let n = end.saturating_sub(from_seq).min(max as u64) as usize;
        out.reserve(n);
        let base = self.base(partition);
        let mut state = base.wrapping_add(from_seq.wrapping_add(1).wrapping_mul(GAMMA));
        let table = if n > 0 { self.table() } else { None };
        for seq in from_seq..from_seq + n as u64 {
            out.push(self.make(table, splitmix64(state), seq));
            state = state.wrapping_add(GAMMA);
        }
        n
    }
}

fn string_key(i: u64) -> RecordKey {
    RecordKey::string(format!("key-{i}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn spec(keys: i64, dist: KeyDistribution) -> GeneratorSource {
        GeneratorSource {
            partitions: 4,
            keys,
            seed: 42,
            distribution: dist,
            zipf_exponent: None,
            records_per_second: None,
            records_per_partition: None,
        }
    }

    #[test]
    fn same_seed_same_records_and_partitions_differ() {
        for kt in [KeyType::String, KeyType::Long, KeyType::Int] {
            let a = Generator::new(&spec(1000, KeyDistribution::Uniform), kt).unwrap();
            let b = Generator::new(&spec(1000, KeyDistribution::Uniform), kt).unwrap();
            let (mut ra, mut rb) = (Vec::new(), Vec::new());
            a.fill(1, 0, &mut ra, 500);
            b.fill(1, 0, &mut rb, 500);
            assert_eq!(ra, rb);
            // fill agrees with the pure per-record function, from any start.
            for (i, r) in ra.iter().enumerate() {
                assert_eq!(*r, a.record(1, i as u64));
            }
            let mut tail = Vec::new();
            a.fill(1, 123, &mut tail, 10);
            assert_eq!(tail[..], ra[123..133]);
            // Another partition gives a different sequence.
            let mut other = Vec::new();
            a.fill(2, 0, &mut other, 500);
            let same = ra
                .iter()
                .zip(&other)
                .filter(|(x, y)| x.key == y.key)
                .count();
            // Independent uniform draws over 1000 keys agree with probability 1/1000.
            assert!(same < 10, "{same} of 500 keys equal across partitions");
            // A different seed differs too.
            let mut s2 = spec(1000, KeyDistribution::Uniform);
            s2.seed = 43;
            let c = Generator::new(&s2, kt).unwrap();
            let mut rc = Vec::new();
            c.fill(1, 0, &mut rc, 500);
            assert_ne!(ra, rc);
        }
    }

    #[test]
    fn a_sample_is_the_record_without_building_the_key_table() {
        let g = Generator::new(&spec(5000, KeyDistribution::Uniform), KeyType::String).unwrap();
        let built = |g: &Generator| g.table.as_ref().is_some_and(|t| t.get().is_some());
        let samples: Vec<Record> = (0..50).map(|seq| g.sample(seq as u32 % 3, seq)).collect();
        assert!(!built(&g), "a sample built the key table");
        let records: Vec<Record> = (0..50).map(|seq| g.record(seq as u32 % 3, seq)).collect();
        assert!(built(&g));
        assert_eq!(samples, records);
        // Once the table is built, a sample shares its keys.
        assert_eq!(g.sample(1, 7), g.record(1, 7));
    }

    #[test]
    fn keys_values_and_timestamps_follow_the_contract() {
        let mut s = spec(50, KeyDistribution::Uniform);
        s.records_per_second = Some(250);
        s.records_per_partition = Some(2000);
        let g = Generator::new(&s, KeyType::String).unwrap();
        let mut out = Vec::new();
        assert_eq!(g.fill(0, 1990, &mut out, 100), 10, "bounded partition ends");
        assert_eq!(g.fill(0, 2000, &mut out, 100), 0);
        assert_eq!(g.fill(9, 0, &mut out, 100), 0, "no partition 9");
        out.clear();
        g.fill(3, 0, &mut out, 2000);
        let mut seen = std::collections::HashSet::new();
        for (n, r) in out.iter().enumerate() {
            assert!((1..=100).contains(&r.value));
            assert_eq!(r.ts, n as i64 * 1000 / 250);
            let text = r.key.to_string();
            let i: u64 = text.strip_prefix("key-").unwrap().parse().unwrap();
            assert!(i < 50);
            seen.insert(i);
        }
        assert_eq!(seen.len(), 50, "2000 uniform draws cover 50 keys");
        assert!(out.windows(2).all(|w| w[0].ts <= w[1].ts));
        // Pacing: record n is due at ts(n).
        assert_eq!(g.due_records(0), Some(1));
        assert_eq!(g.due_records(1000), Some(251));
        assert_eq!(g.due_records(10_000_000), Some(2000));
        let l = Generator::new(&spec(50, KeyDistribution::Uniform), KeyType::Long).unwrap();
        assert_eq!(l.due_records(5), None);
        assert_eq!(l.record(0, 7).ts, 7);
        assert_eq!(
            l.record(0, 7).key,
            RecordKey::long(l.key_index(0, 7) as i64)
        );
    }

    #[test]
    fn uniform_is_roughly_flat() {
        let g = Generator::new(&spec(10, KeyDistribution::Uniform), KeyType::Long).unwrap();
        let mut counts = [0u64; 10];
        for seq in 0..100_000 {
            counts[g.key_index(0, seq) as usize] += 1;
        }
        // Expected 10_000 each, sd = sqrt(100000 * 0.1 * 0.9) ~ 95; allow 6 sd.
        for c in counts {
            assert!((9_430..=10_570).contains(&c), "{counts:?}");
        }
    }

    #[test]
    fn zipf_rank_zero_is_hottest_and_follows_power_law() {
        for s in [0.8f64, 1.0, 1.5] {
            let mut sp = spec(1000, KeyDistribution::Zipf);
            sp.zipf_exponent = Some(s);
            let g = Generator::new(&sp, KeyType::Int).unwrap();
            let n = 400_000u64;
            let mut counts = vec![0u64; 1000];
            for p in 0..2 {
                for seq in 0..n / 2 {
                    counts[g.key_index(p, seq) as usize] += 1;
                }
            }
            let max_rank = (0..1000).max_by_key(|&r| counts[r]).unwrap();
            assert_eq!(max_rank, 0, "s={s}");
            // P(rank r) = (r+1)^-s / H; compare the first ranks to the exact expectation with a
            // 5-sigma binomial tolerance.
            let h: f64 = (1..=1000).map(|k| (k as f64).powf(-s)).sum();
            for r in [0usize, 1, 2, 4, 9, 99] {
                let p = ((r + 1) as f64).powf(-s) / h;
                let expected = p * n as f64;
                let sd = (n as f64 * p * (1.0 - p)).sqrt();
                let got = counts[r] as f64;
                assert!(
                    (got - expected).abs() <= 5.0 * sd + 1.0,
                    "s={s} rank {r}: got {got}, expected {expected:.0} +- {sd:.0}"
                );
            }
            // Ratio between rank 1 and rank 2 is about 2^s.
            let ratio = counts[0] as f64 / counts[1] as f64;
            assert!(
                (ratio / 2f64.powf(s) - 1.0).abs() < 0.05,
                "s={s} ratio {ratio}"
            );
        }
    }

    #[test]
    fn zipf_never_leaves_the_key_range() {
        let g = Zipf::new(3, 2.0);
        for u in [0.0, 0.5, 0.999_999_999, 1.0 - f64::EPSILON] {
            assert!(g.rank(u) < 3);
        }
        assert_eq!(g.rank(0.0), 0);
        let one = Zipf::new(1, 1.0);
        assert_eq!(one.rank(0.7), 0);
    }

    #[test]
    fn bad_specs_are_typed_errors() {
        let mut s = spec(10, KeyDistribution::Uniform);
        s.partitions = 0;
        assert!(matches!(
            Generator::new(&s, KeyType::Long),
            Err(GeneratorError::Partitions { got: 0 })
        ));
        let s = spec(0, KeyDistribution::Uniform);
        assert!(matches!(
            Generator::new(&s, KeyType::Long),
            Err(GeneratorError::Keys(0))
        ));
        let mut s = spec(10, KeyDistribution::Zipf);
        s.zipf_exponent = Some(f64::NAN);
        assert!(Generator::new(&s, KeyType::Long).is_err());
        let s = spec(1 << 32, KeyDistribution::Uniform);
        assert!(matches!(
            Generator::new(&s, KeyType::Int),
            Err(GeneratorError::TooManyIntKeys { .. })
        ));
        // Long keys beyond the table size need no table.
        assert!(Generator::new(&s, KeyType::Long).is_ok());
    }
}
