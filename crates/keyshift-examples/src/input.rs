//! Deterministic inputs for the examples: records in event-time order, each displaced by less
//! than half the bounded out-of-orderness, so no record is ever late.

/// splitmix64: a deterministic, well-mixed sequence from a seed.
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A seeded stream of pseudo-random numbers.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 = splitmix64(self.0);
        self.0 % n.max(1)
    }
}

/// Reorders `records` (sorted by event time) by displacing each by a jitter below
/// `max_out_of_orderness / 2` ms, stably; returns them in arrival order.
pub fn jitter<T>(
    records: Vec<(i64, T)>,
    max_out_of_orderness: i64,
    rng: &mut Rng,
) -> Vec<(i64, T)> {
    let half = (max_out_of_orderness / 2).max(1) as u64;
    let mut keyed: Vec<(i64, usize, (i64, T))> = records
        .into_iter()
        .enumerate()
        .map(|(i, r)| (r.0 + rng.below(half) as i64, i, r))
        .collect();
    keyed.sort_by_key(|(arrival, i, _)| (*arrival, *i));
    keyed.into_iter().map(|(_, _, r)| r).collect()
}
