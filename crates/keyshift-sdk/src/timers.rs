//! Timers per key: stored as entries of their key's state (so they are snapshotted, restored,
//! moved by a rescale and re-hashed by a ceiling change with it), and indexed by time in the
//! operator's memory so that firing does not scan the state. The index is rebuilt from a
//! group's entries when the group is restored.

use crate::error::StateError;
use crate::key::decode_key;
use crate::state::{EVENT_TIMERS, KeyScope, PROCESSING_TIMERS, StateId, TimeDomain};
use std::collections::BTreeSet;

/// A timer's time as an entry's user key: big-endian with the sign bit flipped, so that byte
/// order is time order.
pub(crate) fn time_key(ts: i64) -> [u8; 8] {
    ((ts as u64) ^ (1 << 63)).to_be_bytes()
}

fn time_of(key: &[u8]) -> Option<i64> {
    let b: [u8; 8] = key.try_into().ok()?;
    Some((u64::from_be_bytes(b) ^ (1 << 63)) as i64)
}

pub(crate) fn state_id(domain: TimeDomain) -> StateId {
    match domain {
        TimeDomain::EventTime => EVENT_TIMERS,
        TimeDomain::ProcessingTime => PROCESSING_TIMERS,
    }
}

/// A registered timer: its time, its key's group index and byte form.
pub(crate) type Pending = (i64, usize, Vec<u8>);

/// The operator's timer index, one ordered set per clock.
#[derive(Debug, Default)]
pub struct Timers {
    event: BTreeSet<Pending>,
    processing: BTreeSet<Pending>,
}

impl Timers {
    fn set(&mut self, domain: TimeDomain) -> &mut BTreeSet<Pending> {
        match domain {
            TimeDomain::EventTime => &mut self.event,
            TimeDomain::ProcessingTime => &mut self.processing,
        }
    }

    pub(crate) fn register(
        &mut self,
        scope: &mut KeyScope<'_>,
        domain: TimeDomain,
        ts: i64,
    ) -> Result<(), StateError> {
        let key = scope.key.get().into_owned();
        if self.set(domain).insert((ts, scope.group, key)) {
            scope.timer_put(state_id(domain), &time_key(ts))?;
        }
        Ok(())
    }

    pub(crate) fn delete(
        &mut self,
        scope: &mut KeyScope<'_>,
        domain: TimeDomain,
        ts: i64,
    ) -> Result<(), StateError> {
        let key = scope.key.get().into_owned();
        if self.set(domain).remove(&(ts, scope.group, key)) {
            scope.many_delete(state_id(domain), Some(&time_key(ts)))?;
        }
        Ok(())
    }

    /// Takes the earliest timer of `domain` due at `now`, if any.
    pub(crate) fn pop_due(&mut self, domain: TimeDomain, now: i64) -> Option<Pending> {
        let set = self.set(domain);
        match set.first() {
            Some((ts, _, _)) if *ts <= now => set.pop_first(),
            _ => None,
        }
    }

    /// A timer entry's clock and what indexes it; `None` if `entry` is not a timer.
    fn parse(group: usize, entry: &[u8]) -> Option<(TimeDomain, Pending)> {
        let (_, n) = decode_key(entry).ok()?;
        let id = entry
            .get(n..n + 2)
            .map(|b| u16::from_be_bytes([b[0], b[1]]))?;
        let domain = match id {
            EVENT_TIMERS => TimeDomain::EventTime,
            PROCESSING_TIMERS => TimeDomain::ProcessingTime,
            _ => return None,
        };
        let ts = entry.get(n + 2..).and_then(time_of)?;
        Some((domain, (ts, group, entry[..n].to_vec())))
    }

    /// Indexes a timer entry of group `group` found in restored state; false if `entry` is
    /// not a timer.
    pub(crate) fn index_entry(&mut self, group: usize, entry: &[u8]) -> bool {
        match Self::parse(group, entry) {
            Some((domain, timer)) => {
                self.set(domain).insert(timer);
                true
            }
            None => false,
        }
    }

    /// Forgets a timer entry of group `group` a restored delta deleted (it fired or was
    /// deleted after the state it was restored with); false if `entry` is not a timer.
    pub(crate) fn forget_entry(&mut self, group: usize, entry: &[u8]) -> bool {
        match Self::parse(group, entry) {
            Some((domain, timer)) => self.set(domain).remove(&timer),
            None => false,
        }
    }

    /// Forgets the timers of group `group` (their entries go with the group's state).
    pub(crate) fn forget_group(&mut self, group: usize) {
        self.event.retain(|t| t.1 != group);
        self.processing.retain(|t| t.1 != group);
    }

    /// Registered timers of each clock.
    pub fn len(&self) -> (usize, usize) {
        (self.event.len(), self.processing.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn time_keys_sort_like_times(a in any::<i64>(), b in any::<i64>()) {
            prop_assert_eq!(a.cmp(&b), time_key(a).cmp(&time_key(b)));
            prop_assert_eq!(time_of(&time_key(a)), Some(a));
        }
    }
}
