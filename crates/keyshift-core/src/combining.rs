//! When a source combines records before the shuffle (the built-in aggregation's and an SDK
//! window aggregate's pre-aggregation): every batch is tried, and a batch that saved less than
//! one record in [`WORTH`] makes the source send the next [`PASS_BATCHES`] batches as they are,
//! then try again. A stream without repeated keys pays for one batch in `PASS_BATCHES + 1`.

/// Batches sent uncombined after one that saved little.
pub const PASS_BATCHES: u32 = 16;
/// A batch is worth combining when it saves at least one record in this many.
pub const WORTH: usize = 8;

/// The pacing of one source's combining.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pacing {
    /// Batches still to send uncombined.
    passing: u32,
}

impl Pacing {
    /// Whether to combine the next batch (each call while passing counts one batch down).
    pub fn attempt(&mut self) -> bool {
        if self.passing > 0 {
            self.passing -= 1;
            return false;
        }
        true
    }

    /// Takes note that a combined batch of `inputs` records became `partials`.
    pub fn judge(&mut self, inputs: usize, partials: usize) {
        if inputs.saturating_sub(partials) * WORTH < inputs {
            self.passing = PASS_BATCHES;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_that_saves_little_passes_the_next_ones() {
        let mut p = Pacing::default();
        assert!(p.attempt());
        p.judge(64, 60);
        for _ in 0..PASS_BATCHES {
            assert!(!p.attempt());
        }
        assert!(p.attempt(), "tried again after the pass");
        p.judge(64, 56);
        assert!(p.attempt(), "one in eight saved is worth it");
    }
}
