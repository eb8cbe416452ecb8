//! Retry delays: the schedule of every retry loop, built with backon and jittered.
//!
//! Jitter keeps things that fail together (every job of an operator when the API server or the
//! object store is down, the peers of a run connecting to one another, two operator replicas
//! racing for a Lease) from retrying in lockstep. Each delay is the policy's deterministic value
//! plus a uniform random extra of up to as much again (backon's jitter), so it is never shorter
//! than the plain schedule and at most twice it. The randomness is backon's (fastrand, seeded per
//! process): jitter needs no secrecy, secrets come from `getrandom`.

use backon::{BackoffBuilder, ConstantBuilder, ExponentialBuilder};
use std::time::Duration;

/// The first delay of a job whose reconcile passes fail in a row.
pub const PASS_FAILURE_MIN: Duration = Duration::from_secs(1);
/// The largest plain delay of a job whose passes keep failing (the 7th failure and later).
pub const PASS_FAILURE_MAX: Duration = Duration::from_secs(64);

/// How long a job waits after `failures` passes in a row failed (`failures` >= 1; 0 counts as 1):
/// 1 s, 2 s, 4 s, ... doubling up to 64 s, each plus up to as much again of jitter.
pub fn pass_failure(failures: u32) -> Duration {
    let retry = failures.saturating_sub(1).min(6) as usize;
    ExponentialBuilder::default()
        .with_min_delay(PASS_FAILURE_MIN)
        .with_max_delay(PASS_FAILURE_MAX)
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
        .build()
        .nth(retry)
        .unwrap_or(PASS_FAILURE_MAX)
}

/// Connecting to a peer of the run that is not listening yet (it is starting): 20 ms doubling up
/// to 200 ms, jittered, without end (the caller's deadline bounds the attempts).
pub fn peer_connect() -> impl Iterator<Item = Duration> {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(20))
        .with_max_delay(Duration::from_millis(200))
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
        .build()
}

/// A fixed retry delay, jittered: `delay` plus up to as much again.
pub fn jittered(delay: Duration) -> Duration {
    ConstantBuilder::default()
        .with_delay(delay)
        .with_jitter()
        .build()
        .next()
        .unwrap_or(delay)
}

/// A retry delay of at most `max`, jittered: between half of it and it. For loops whose plain
/// delay is also a bound (a leader renewing its Lease must not wait longer).
pub fn jittered_within(max: Duration) -> Duration {
    jittered(max / 2).min(max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// Every delay lies in [plain, 2 x plain] (the top only by rounding); the samples are not all
    /// equal (jitter is on).
    fn assert_jittered(plain: Duration, samples: &[Duration]) {
        for d in samples {
            assert!(
                *d >= plain && *d <= plain * 2,
                "{d:?} is outside [{plain:?}, {:?}]",
                plain * 2
            );
        }
        let distinct: BTreeSet<_> = samples.iter().collect();
        assert!(distinct.len() > 1, "no jitter in {samples:?}");
    }

    #[test]
    fn pass_failure_doubles_from_one_second_to_the_cap_with_jitter() {
        for failures in 0..12u32 {
            let plain = Duration::from_secs(1 << failures.saturating_sub(1).min(6));
            let samples: Vec<Duration> = (0..64).map(|_| pass_failure(failures)).collect();
            assert_jittered(plain, &samples);
        }
        assert_jittered(
            PASS_FAILURE_MAX,
            &(0..64).map(|_| pass_failure(u32::MAX)).collect::<Vec<_>>(),
        );
    }

    #[test]
    fn peer_connect_doubles_to_its_cap_and_never_ends() {
        let plain = [20, 40, 80, 160, 200, 200, 200, 200].map(Duration::from_millis);
        let runs: Vec<Vec<Duration>> = (0..64)
            .map(|_| peer_connect().take(1000).collect())
            .collect();
        assert!(runs.iter().all(|r| r.len() == 1000), "it gave up");
        for (i, plain) in plain.iter().enumerate() {
            let samples: Vec<Duration> = runs.iter().map(|r| r[i]).collect();
            assert_jittered(*plain, &samples);
        }
        let last: Vec<Duration> = runs.iter().map(|r| r[999]).collect();
        assert_jittered(Duration::from_millis(200), &last);
    }

    #[test]
    fn jittered_adds_up_to_as_much_again() {
        for plain in [1, 100, 3_000, 30_000].map(Duration::from_millis) {
            let samples: Vec<Duration> = (0..64).map(|_| jittered(plain)).collect();
            assert_jittered(plain, &samples);
        }
        assert_eq!(jittered(Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn jittered_within_stays_between_half_and_the_bound() {
        for max in [2, 100, 1_000, 5_000].map(Duration::from_millis) {
            let samples: Vec<Duration> = (0..64).map(|_| jittered_within(max)).collect();
            assert_jittered(max / 2, &samples);
            assert!(samples.iter().all(|d| *d <= max), "{samples:?}");
        }
    }
}
