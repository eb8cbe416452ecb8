//! Key-group math, bit-for-bit compatible with Apache Flink's `KeyGroupRangeAssignment`.
//!
//! A key is hashed (Java `hashCode`), mixed with Flink's murmur finaliser and reduced modulo the
//! key-group count (the *max parallelism*). The key -> group mapping therefore never depends on the
//! parallelism; only the group -> subtask mapping does, and it assigns every subtask one contiguous,
//! inclusive range of groups.
//!
//! Everything here is pure: no I/O, no allocation beyond the returned values.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The largest key-group count Flink (and keyshift) accepts.
pub const UPPER_BOUND_MAX_PARALLELISM: u32 = 1 << 15;
/// The floor of the default key-group count derivation.
pub const DEFAULT_LOWER_BOUND_MAX_PARALLELISM: u32 = 1 << 7;

/// Errors from the bounds `1 <= parallelism <= maxParallelism <= 32768`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BoundsError {
    #[error(
        "parallelism must be at least 1 (got {0}): set it to the number of parallel subtasks, 1 or more"
    )]
    ParallelismTooSmall(i64),
    #[error(
        "max parallelism must be at least 1 (got {0}): set it to the key-group count, between 1 and {UPPER_BOUND_MAX_PARALLELISM}"
    )]
    MaxParallelismTooSmall(i64),
    #[error(
        "max parallelism {0} is above the upper bound {UPPER_BOUND_MAX_PARALLELISM}: choose a key-group count between 1 and {UPPER_BOUND_MAX_PARALLELISM}"
    )]
    MaxParallelismTooLarge(i64),
    #[error(
        "parallelism {parallelism} exceeds the key-group ceiling (max parallelism) {max_parallelism}: lower the parallelism to at most {max_parallelism}, or use a larger max parallelism (for a job with state, set spec.maxParallelism to the new count together with replicas: keyshift rewrites the job's state to it; a power of two at least 4x the parallelism, e.g. {}, is suggested)", suggested_max_parallelism(u32::try_from(*parallelism).unwrap_or(u32::MAX))
    )]
    ParallelismAboveCeiling {
        parallelism: i64,
        max_parallelism: u32,
    },
}

/// Flink's `MathUtils.murmurHash(int)`: the murmur3 mixing of one 32-bit block with its finaliser,
/// folded to a non-negative value.
#[inline]
pub fn murmur_hash(code: i32) -> i32 {
    let mut h = code;
    h = h.wrapping_mul(0xcc9e_2d51_u32 as i32);
    h = h.rotate_left(15);
    h = h.wrapping_mul(0x1b87_3593);
    h = h.rotate_left(13);
    h = h.wrapping_mul(5).wrapping_add(0xe654_6b64_u32 as i32);
    h ^= 4;
    h = bit_mix(h);
    if h >= 0 {
        h
    } else if h != i32::MIN {
        -h
    } else {
        0
    }
}

/// Flink's `MathUtils.bitMix`, murmur3's 32-bit finaliser (`>>>` is a logical shift).
fn bit_mix(mut h: i32) -> i32 {
    h ^= ((h as u32) >> 16) as i32;
    h = h.wrapping_mul(0x85eb_ca6b_u32 as i32);
    h ^= ((h as u32) >> 13) as i32;
    h = h.wrapping_mul(0xc2b2_ae35_u32 as i32);
    h ^= ((h as u32) >> 16) as i32;
    h
}

/// Java's `String.hashCode()`: `h = 31*h + c` over the UTF-16 code units.
pub fn java_string_hash(s: &str) -> i32 {
    s.encode_utf16()
        .fold(0i32, |h, c| h.wrapping_mul(31).wrapping_add(i32::from(c)))
}

/// Java's `Long.hashCode()`: `(int)(v ^ (v >>> 32))`.
pub fn java_long_hash(v: i64) -> i32 {
    (v ^ ((v as u64) >> 32) as i64) as i32
}

/// Java's `Integer.hashCode()`: the value itself.
pub fn java_int_hash(v: i32) -> i32 {
    v
}

/// The type a key field is hashed as; it decides which Java `hashCode` applies.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, schemars::JsonSchema,
)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum KeyType {
    /// UTF-8 text, hashed over its UTF-16 code units like `java.lang.String`.
    #[default]
    String,
    /// A 64-bit signed integer, hashed like `java.lang.Long`.
    Long,
    /// A 32-bit signed integer, hashed like `java.lang.Integer`.
    Int,
}

impl fmt::Display for KeyType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KeyType::String => "string",
            KeyType::Long => "long",
            KeyType::Int => "int",
        })
    }
}

/// A typed key value.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Key {
    Long(i64),
    Int(i32),
    String(String),
}

/// A key given as text could not be read as the declared type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("key {text:?} is not a valid {key_type} key: {reason}")]
pub struct KeyParseError {
    pub text: String,
    pub key_type: KeyType,
    pub reason: String,
}

impl Key {
    /// Reads a key from its text form as the given type.
    pub fn parse(text: &str, key_type: KeyType) -> Result<Key, KeyParseError> {
        let err = |reason: String| KeyParseError {
            text: text.to_owned(),
            key_type,
            reason,
        };
        match key_type {
            KeyType::String => Ok(Key::String(text.to_owned())),
            KeyType::Long => text
                .trim()
                .parse::<i64>()
                .map(Key::Long)
                .map_err(|e| err(e.to_string())),
            KeyType::Int => text
                .trim()
                .parse::<i32>()
                .map(Key::Int)
                .map_err(|e| err(e.to_string())),
        }
    }

    /// The key's Java `hashCode`.
    pub fn java_hash(&self) -> i32 {
        match self {
            Key::String(s) => java_string_hash(s),
            Key::Long(v) => java_long_hash(*v),
            Key::Int(v) => java_int_hash(*v),
        }
    }

    pub fn key_type(&self) -> KeyType {
        match self {
            Key::String(_) => KeyType::String,
            Key::Long(_) => KeyType::Long,
            Key::Int(_) => KeyType::Int,
        }
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Key::String(s) => f.write_str(s),
            Key::Long(v) => write!(f, "{v}"),
            Key::Int(v) => write!(f, "{v}"),
        }
    }
}

/// Flink's `computeKeyGroupForKeyHash`: `murmur(hash) % maxParallelism`.
///
/// `max_parallelism` must be at least 1 (see [`Assignment`] for a validated pair).
#[inline]
pub fn key_group_for_hash(hash: i32, max_parallelism: u32) -> u32 {
    debug_assert!(max_parallelism >= 1);
    // murmur_hash is non-negative, so the remainder is too.
    (murmur_hash(hash) as u32) % max_parallelism.max(1)
}

/// The key group of a key under `max_parallelism` groups.
pub fn key_group_for_key(key: &Key, max_parallelism: u32) -> u32 {
    key_group_for_hash(key.java_hash(), max_parallelism)
}

/// Flink's `computeDefaultMaxParallelism`:
/// `min(max(roundUpToPowerOfTwo(p + p/2), 128), 32768)`.
pub fn default_max_parallelism(parallelism: u32) -> u32 {
    let wanted = u64::from(parallelism) + u64::from(parallelism / 2);
    let pow2 = wanted.max(1).next_power_of_two();
    pow2.clamp(
        u64::from(DEFAULT_LOWER_BOUND_MAX_PARALLELISM),
        u64::from(UPPER_BOUND_MAX_PARALLELISM),
    ) as u32
}

/// The key-group count to suggest when a job must grow to `parallelism`: a power of two at
/// least 4x the parallelism (room to grow again, and every power-of-two parallelism divides it),
/// never below Flink's lower bound of 128 nor above 32768.
pub fn suggested_max_parallelism(parallelism: u32) -> u32 {
    (u64::from(parallelism) * 4).next_power_of_two().clamp(
        u64::from(DEFAULT_LOWER_BOUND_MAX_PARALLELISM),
        u64::from(UPPER_BOUND_MAX_PARALLELISM),
    ) as u32
}

/// Below this many bytes of state per key group on average, groups are "tiny": each costs a
/// block header, a manifest entry and a checksum, and a restore reads them in more, smaller
/// pieces, for no gain in how finely state can move.
pub const TINY_GROUP_BYTES: u64 = 64 * 1024;

/// A warning when `groups` key groups would split `state_bytes` of state into tiny groups
/// (see [`TINY_GROUP_BYTES`]), naming the average and the largest count that avoids it. Pure.
pub fn tiny_groups(groups: u32, state_bytes: u64) -> Option<String> {
    if groups == 0 || state_bytes / u64::from(groups) >= TINY_GROUP_BYTES {
        return None;
    }
    let avg = state_bytes / u64::from(groups);
    Some(format!(
        "{groups} key groups over {state_bytes} bytes of state make tiny groups of {avg} bytes on average (below {TINY_GROUP_BYTES}): harmless but wasteful; a smaller power of two still at least the parallelism you need keeps groups larger"
    ))
}

/// How a snapshot writes one key group (incremental checkpoints): the one answer the built-in
/// aggregation's state and the SDK's state backends both give for each owned group at a cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupMode {
    /// The whole group.
    Full,
    /// Only what changed (entries written or deleted) after cut `since`: a delta over the
    /// snapshot taken at that cut.
    Delta { since: u32 },
    /// Nothing: the group has not changed since the snapshot it builds on.
    Unchanged,
}

/// An inclusive, non-empty range of key groups `[start, end]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KeyGroupRange {
    pub start: u32,
    pub end: u32,
}

impl KeyGroupRange {
    /// The number of groups in the range.
    pub fn len(&self) -> u32 {
        self.end - self.start + 1
    }

    /// Ranges built by this module are never empty; kept for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.end < self.start
    }

    pub fn contains(&self, group: u32) -> bool {
        self.start <= group && group <= self.end
    }

    /// The overlap of two ranges, if any.
    pub fn intersect(&self, other: &KeyGroupRange) -> Option<KeyGroupRange> {
        let start = self.start.max(other.start);
        let end = self.end.min(other.end);
        (start <= end).then_some(KeyGroupRange { start, end })
    }

    pub fn iter(&self) -> std::ops::RangeInclusive<u32> {
        self.start..=self.end
    }
}

impl fmt::Display for KeyGroupRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.start, self.end)
    }
}

/// A validated `(parallelism, maxParallelism)` pair: `1 <= p <= maxP <= 32768`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Assignment {
    parallelism: u32,
    max_parallelism: u32,
}

impl Assignment {
    /// Checks the bounds. Arguments are wide so that values straight from a user (negative, huge)
    /// get the message that names the bound rather than a conversion error.
    pub fn new(parallelism: i64, max_parallelism: i64) -> Result<Self, BoundsError> {
        if max_parallelism < 1 {
            return Err(BoundsError::MaxParallelismTooSmall(max_parallelism));
        }
        if max_parallelism > i64::from(UPPER_BOUND_MAX_PARALLELISM) {
            return Err(BoundsError::MaxParallelismTooLarge(max_parallelism));
        }
        if parallelism < 1 {
            return Err(BoundsError::ParallelismTooSmall(parallelism));
        }
        let max_parallelism = max_parallelism as u32;
        if parallelism > i64::from(max_parallelism) {
            return Err(BoundsError::ParallelismAboveCeiling {
                parallelism,
                max_parallelism,
            });
        }
        Ok(Assignment {
            parallelism: parallelism as u32,
            max_parallelism,
        })
    }

    pub fn parallelism(&self) -> u32 {
        self.parallelism
    }

    pub fn max_parallelism(&self) -> u32 {
        self.max_parallelism
    }

    /// Flink's `computeOperatorIndexForKeyGroup`: `group * p / maxP`.
    pub fn owner(&self, group: u32) -> u32 {
        (u64::from(group) * u64::from(self.parallelism) / u64::from(self.max_parallelism)) as u32
    }

    /// The subtask owning a key.
    pub fn owner_of_key(&self, key: &Key) -> u32 {
        self.owner(key_group_for_key(key, self.max_parallelism))
    }

    /// Flink's `computeKeyGroupRangeForOperatorIndex` (inclusive end).
    pub fn range(&self, subtask: u32) -> KeyGroupRange {
        let (p, g, i) = (
            u64::from(self.parallelism),
            u64::from(self.max_parallelism),
            u64::from(subtask),
        );
        KeyGroupRange {
            // Flink writes this as `(i*g + p - 1) / p`.
            start: (i * g).div_ceil(p) as u32,
            end: (((i + 1) * g - 1) / p) as u32,
        }
    }

    /// Every subtask's range, in subtask order.
    pub fn ranges(&self) -> Vec<KeyGroupRange> {
        (0..self.parallelism).map(|i| self.range(i)).collect()
    }

    /// Whether the parallelism divides the key-group count (every subtask owns the same number).
    pub fn divides(&self) -> bool {
        self.max_parallelism.is_multiple_of(self.parallelism)
    }

    /// How evenly groups spread over subtasks.
    pub fn skew(&self) -> Skew {
        let (g, p) = (self.max_parallelism, self.parallelism);
        let min_groups = g / p;
        let heavy = g % p;
        let max_groups = if heavy == 0 {
            min_groups
        } else {
            min_groups + 1
        };
        let (below, above) = nearest_divisors(g, p);
        Skew {
            max_parallelism: g,
            parallelism: p,
            min_groups,
            max_groups,
            busiest_subtasks: if heavy == 0 { p } else { heavy },
            lightest_subtasks: if heavy == 0 { p } else { p - heavy },
            ratio: f64::from(max_groups) / f64::from(min_groups),
            divides: heavy == 0,
            divisor_below: below,
            divisor_above: above,
        }
    }
}

/// The largest divisor of `g` that is `<= p` and the smallest that is `>= p` (equal to `p` when it
/// divides `g`). `p` must be in `1..=g`, so both exist (1 and `g` divide `g`).
pub fn nearest_divisors(g: u32, p: u32) -> (u32, u32) {
    let below = (1..=p.min(g))
        .rev()
        .find(|d| g.is_multiple_of(*d))
        .unwrap_or(1);
    let above = (p.max(1)..=g).find(|d| g.is_multiple_of(*d)).unwrap_or(g);
    (below, above)
}

/// The spread of key groups over subtasks.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Skew {
    pub max_parallelism: u32,
    pub parallelism: u32,
    /// Groups owned by the lightest subtask.
    pub min_groups: u32,
    /// Groups owned by the busiest subtask.
    pub max_groups: u32,
    /// How many subtasks own `max_groups`.
    pub busiest_subtasks: u32,
    /// How many subtasks own `min_groups`.
    pub lightest_subtasks: u32,
    /// `max_groups / min_groups`: the busiest subtask's share relative to the lightest.
    pub ratio: f64,
    /// Whether the parallelism divides the key-group count.
    pub divides: bool,
    /// Largest divisor of the key-group count not above the parallelism.
    pub divisor_below: u32,
    /// Smallest divisor of the key-group count not below the parallelism.
    pub divisor_above: u32,
}

impl Skew {
    /// The skew in words, e.g. "28 subtasks own 2 groups and 72 own 1: the busiest carries 2.00x
    /// the lightest; divisors of 128 near 100: 64, 128".
    pub fn summary(&self) -> String {
        if self.divides {
            format!(
                "{} divides {} evenly: every subtask owns {} group{} (no skew)",
                self.parallelism,
                self.max_parallelism,
                self.min_groups,
                plural(self.min_groups)
            )
        } else {
            format!(
                "{} subtask{} own{} {} group{} and {} own{} {}: the busiest carries {:.2}x the lightest; divisors of {} near {}: {}, {}",
                self.busiest_subtasks,
                plural(self.busiest_subtasks),
                verb_s(self.busiest_subtasks),
                self.max_groups,
                plural(self.max_groups),
                self.lightest_subtasks,
                verb_s(self.lightest_subtasks),
                self.min_groups,
                self.ratio,
                self.max_parallelism,
                self.parallelism,
                self.divisor_below,
                self.divisor_above
            )
        }
    }
}

fn plural(n: u32) -> &'static str {
    crate::text::plural(u64::from(n))
}

/// The verb's ending for a count as its subject: "1 owns", "2 own".
fn verb_s(n: u32) -> &'static str {
    if n == 1 { "s" } else { "" }
}

/// Groups one new subtask reads from one old subtask during a rescale.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RangeRead {
    /// The old subtask whose snapshot holds the groups.
    pub from: u32,
    pub key_groups: KeyGroupRange,
    pub count: u32,
}

/// What one new subtask needs during a rescale.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SubtaskPlan {
    pub index: u32,
    pub key_groups: KeyGroupRange,
    /// Old subtasks (and their groups) this subtask reads from, in group order.
    pub reads: Vec<RangeRead>,
    /// The old subtask this one takes the place of (largest overlap, one-to-one), if any.
    pub paired_with: Option<u32>,
    /// Groups this subtask owns that its paired old subtask did not.
    pub moved_groups: u32,
}

/// A rescale from one parallelism to another under a fixed key-group count.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RescalePlan {
    pub max_parallelism: u32,
    pub from_parallelism: u32,
    pub to_parallelism: u32,
    pub subtasks: Vec<SubtaskPlan>,
    /// Groups that change owner when every new subtask replaces the old subtask it overlaps most
    /// (one-to-one; what a runtime that keeps local state would do).
    pub moved_groups: u32,
    /// `moved_groups / max_parallelism`.
    pub moved_fraction: f64,
}

/// Plans a rescale `from -> to`. Both assignments must share the key-group count.
pub fn rescale_plan(from: Assignment, to: Assignment) -> Result<RescalePlan, PlanError> {
    if from.max_parallelism != to.max_parallelism {
        return Err(PlanError::MaxParallelismChanged {
            from: from.max_parallelism,
            to: to.max_parallelism,
        });
    }
    let old = from.ranges();
    let new = to.ranges();

    // Every (new, old) overlap. Ranges are contiguous and sorted, so a two-pointer walk finds them
    // in O(p1 + p2).
    let mut reads: Vec<Vec<RangeRead>> = vec![Vec::new(); new.len()];
    let (mut i, mut j) = (0usize, 0usize);
    while i < old.len() && j < new.len() {
        if let Some(overlap) = old[i].intersect(&new[j]) {
            reads[j].push(RangeRead {
                from: i as u32,
                key_groups: overlap,
                count: overlap.len(),
            });
        }
        if old[i].end <= new[j].end {
            i += 1;
        } else {
            j += 1;
        }
    }

    // One-to-one pairing by largest overlap; ties go to the lower new, then the lower old index.
    let mut candidates: Vec<(u32, u32, u32)> = reads
        .iter()
        .enumerate()
        .flat_map(|(n, rs)| rs.iter().map(move |r| (r.count, n as u32, r.from)))
        .collect();
    candidates.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let mut paired_new: Vec<Option<(u32, u32)>> = vec![None; new.len()];
    let mut old_taken = vec![false; old.len()];
    for (count, n, o) in candidates {
        if paired_new[n as usize].is_none() && !old_taken[o as usize] {
            paired_new[n as usize] = Some((o, count));
            old_taken[o as usize] = true;
        }
    }

    let subtasks: Vec<SubtaskPlan> = new
        .iter()
        .zip(reads)
        .zip(paired_new)
        .enumerate()
        .map(|(index, ((range, reads), paired))| SubtaskPlan {
            index: index as u32,
            key_groups: *range,
            reads,
            paired_with: paired.map(|(o, _)| o),
            moved_groups: range.len() - paired.map_or(0, |(_, kept)| kept),
        })
        .collect();
    let moved_groups = subtasks.iter().map(|s| s.moved_groups).sum::<u32>();
    Ok(RescalePlan {
        max_parallelism: to.max_parallelism,
        from_parallelism: from.parallelism,
        to_parallelism: to.parallelism,
        moved_fraction: f64::from(moved_groups) / f64::from(to.max_parallelism),
        subtasks,
        moved_groups,
    })
}

/// A rescale plan that cannot be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error(
        "the key-group count cannot change in a rescale ({from} -> {to}): rewrite the savepoint offline with `keyshift savepoint rewrite --max-parallelism {to}`"
    )]
    MaxParallelismChanged { from: u32, to: u32 },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asg(p: i64, g: i64) -> Assignment {
        Assignment::new(p, g).unwrap()
    }

    #[test]
    fn java_hashes_follow_the_jdk() {
        // Independent of Flink: the JDK's definitions, evaluated by hand.
        assert_eq!(java_string_hash(""), 0);
        assert_eq!(java_string_hash("a"), 97);
        assert_eq!(java_string_hash("ab"), 97 * 31 + 98);
        // A supplementary character is two UTF-16 code units.
        let s = "\u{1F600}";
        let units: Vec<u16> = s.encode_utf16().collect();
        assert_eq!(units.len(), 2);
        assert_eq!(
            java_string_hash(s),
            i32::from(units[0]) * 31 + i32::from(units[1])
        );
        assert_eq!(java_long_hash(1), 1);
        assert_eq!(java_long_hash(1 << 32), 1);
        assert_eq!(java_long_hash(-1), 0);
        assert_eq!(java_int_hash(-7), -7);
    }

    #[test]
    fn default_max_parallelism_rule() {
        assert_eq!(default_max_parallelism(1), 128);
        assert_eq!(default_max_parallelism(24), 128);
        assert_eq!(default_max_parallelism(85), 128);
        assert_eq!(default_max_parallelism(86), 256);
        assert_eq!(default_max_parallelism(200), 512);
        assert_eq!(default_max_parallelism(21845), 32768);
        assert_eq!(default_max_parallelism(u32::MAX), 32768);
    }

    #[test]
    fn bounds_are_enforced_with_named_fixes() {
        assert!(matches!(
            Assignment::new(0, 128),
            Err(BoundsError::ParallelismTooSmall(0))
        ));
        assert!(matches!(
            Assignment::new(1, 40000),
            Err(BoundsError::MaxParallelismTooLarge(40000))
        ));
        let err = Assignment::new(200, 128).unwrap_err();
        assert!(err.to_string().contains("at most 128"), "{err}");
        assert!(Assignment::new(32768, 32768).is_ok());
        assert!(Assignment::new(1, 1).is_ok());
    }

    #[test]
    fn skew_at_100_of_128() {
        let s = asg(100, 128).skew();
        assert_eq!((s.busiest_subtasks, s.max_groups), (28, 2));
        assert_eq!((s.lightest_subtasks, s.min_groups), (72, 1));
        assert_eq!(s.ratio, 2.0);
        assert!(!s.divides);
        assert_eq!((s.divisor_below, s.divisor_above), (64, 128));
        assert_eq!(
            s.summary(),
            "28 subtasks own 2 groups and 72 own 1: the busiest carries 2.00x the lightest; divisors of 128 near 100: 64, 128"
        );
        // The ranges agree with the summary.
        let counts: Vec<u32> = asg(100, 128).ranges().iter().map(|r| r.len()).collect();
        assert_eq!(counts.iter().filter(|&&c| c == 2).count(), 28);
        assert_eq!(counts.iter().filter(|&&c| c == 1).count(), 72);
    }

    #[test]
    fn doubling_moves_half() {
        let plan = rescale_plan(asg(8, 128), asg(16, 128)).unwrap();
        assert_eq!(plan.moved_groups, 64);
        assert_eq!(plan.moved_fraction, 0.5);
        // Every new subtask reads from exactly one old subtask.
        assert!(plan.subtasks.iter().all(|s| s.reads.len() == 1));
        let plan = rescale_plan(asg(4, 128), asg(8, 128)).unwrap();
        assert_eq!(plan.moved_groups, 64);
    }

    #[test]
    fn same_parallelism_moves_nothing() {
        let plan = rescale_plan(asg(7, 128), asg(7, 128)).unwrap();
        assert_eq!(plan.moved_groups, 0);
    }

    #[test]
    fn rescale_refuses_a_new_group_count() {
        assert!(rescale_plan(asg(4, 128), asg(8, 256)).is_err());
    }

    #[test]
    fn key_parse_reports_type() {
        assert_eq!(Key::parse("42", KeyType::Long).unwrap(), Key::Long(42));
        let e = Key::parse("x", KeyType::Int).unwrap_err();
        assert!(e.to_string().contains("not a valid int key"));
        assert_eq!(
            Key::parse("", KeyType::String).unwrap(),
            Key::String(String::new())
        );
    }

    #[test]
    fn tiny_groups_warns_only_below_the_threshold() {
        assert_eq!(tiny_groups(1024, 1024 * TINY_GROUP_BYTES), None);
        let w = tiny_groups(1024, 1024 * TINY_GROUP_BYTES - 1).unwrap();
        assert!(w.contains("1024 key groups"), "{w}");
        assert!(
            w.contains(&format!("{} bytes on average", TINY_GROUP_BYTES - 1)),
            "{w}"
        );
        assert_eq!(tiny_groups(0, 10), None);
        assert!(tiny_groups(128, 0).is_some());
    }
}
