//! Operator state across a change of parallelism: how the entries a step kept per subtask (not
//! per key) are given to the subtasks of the next run.
//!
//! Keyed state moves with its key groups. State a subtask keeps for itself (a per-subtask
//! buffer, a running total, the bookkeeping of a connection) has no key, so it cannot be split by
//! key: the step declares how its entries are redistributed (Flink's operator state), or the
//! rescale is refused.
//!
//! * [`Redistribution::Split`]: the entries of every old subtask, in subtask order, are divided
//!   into contiguous runs, one per new subtask, whose sizes differ by at most one (Flink's
//!   even-split list state). Every entry lands on exactly one subtask.
//! * [`Redistribution::Union`]: every new subtask gets every entry (Flink's union list state);
//!   the step picks what it needs.
//! * [`Redistribution::Broadcast`]: one value that every subtask holds the same copy of; every
//!   new subtask gets that copy. Copies that differ are refused, never resolved by picking one.
//! * undeclared (`None`): the job restores at the parallelism the state was written at, and a
//!   rescale is refused with [`RedistributionError::Undeclared`], which names the state and the
//!   choices ("half of a total is not a meaningful half").
//!
//! At the parallelism the state was written at, every subtask gets back exactly its own entries,
//! whatever the declaration: a restore is not a redistribution.
//!
//! Source positions follow the union rule: every subtask reads the positions of every partition
//! and keeps those of the partitions it is assigned ([`crate::positions`]).
//!
//! [`entries_for`] is pure.

use std::fmt;

/// How a step's operator state is given to the subtasks of a run at another parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Redistribution {
    /// Entries divided in contiguous, even runs over the new subtasks.
    Split,
    /// Every new subtask gets every entry.
    Union,
    /// One value, the same on every subtask, replicated to every new subtask.
    Broadcast,
}

impl Redistribution {
    /// The byte a snapshot records it by (0 is "undeclared").
    pub fn code(redistribution: Option<Redistribution>) -> u8 {
        match redistribution {
            None => 0,
            Some(Redistribution::Split) => 1,
            Some(Redistribution::Union) => 2,
            Some(Redistribution::Broadcast) => 3,
        }
    }

    /// The declaration a snapshot's byte records (`None` inside: undeclared; outer `None`: not a
    /// known byte).
    pub fn from_code(code: u8) -> Option<Option<Redistribution>> {
        Some(match code {
            0 => None,
            1 => Some(Redistribution::Split),
            2 => Some(Redistribution::Union),
            3 => Some(Redistribution::Broadcast),
            _ => return None,
        })
    }
}

impl fmt::Display for Redistribution {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Redistribution::Split => "split",
            Redistribution::Union => "union",
            Redistribution::Broadcast => "broadcast",
        })
    }
}

/// Operator state that cannot be given to the new run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RedistributionError {
    /// A rescale of a state that declares no redistribution.
    #[error(
        "operator state {state:?} declares no redistribution, so its entries on {from} subtasks cannot be given to {to}: declare how (split: the entries are divided between the subtasks; union: every subtask gets all of them; broadcast: one value, the same on every subtask), or keep the parallelism at {from}"
    )]
    Undeclared {
        /// The state's name.
        state: String,
        /// The parallelism it was written at.
        from: u32,
        /// The parallelism of the new run.
        to: u32,
    },
    /// A broadcast state whose copies differ between the old subtasks.
    #[error(
        "broadcast state {state:?} holds a different value on subtask {subtask} than on subtask 0, so no copy can be given to the new subtasks: a broadcast state must be written with the same value on every subtask (declare it split or union to keep per-subtask values)"
    )]
    BroadcastDiffers {
        /// The state's name.
        state: String,
        /// The first old subtask whose copy differs from subtask 0's.
        subtask: u32,
    },
}

/// The entries of `state` (declared `how`) that `subtask` of a run of `parallelism` subtasks
/// gets, from `old`: the entries of each subtask of the run that wrote them, in subtask order.
pub fn entries_for<T: Clone + PartialEq>(
    state: &str,
    how: Option<Redistribution>,
    old: &[Vec<T>],
    parallelism: u32,
    subtask: u32,
) -> Result<Vec<T>, RedistributionError> {
    let from = old.len() as u32;
    if from == 0 {
        return Ok(Vec::new());
    }
    if from == parallelism {
        return Ok(old[subtask as usize].clone());
    }
    match how {
        None => Err(RedistributionError::Undeclared {
            state: state.to_owned(),
            from,
            to: parallelism,
        }),
        Some(Redistribution::Union) => Ok(old.concat()),
        Some(Redistribution::Split) => {
            let all: Vec<&T> = old.iter().flatten().collect();
            let n = all.len() as u64;
            let (p, s) = (u64::from(parallelism.max(1)), u64::from(subtask));
            let (start, end) = ((s * n / p) as usize, ((s + 1) * n / p) as usize);
            Ok(all[start..end].iter().map(|t| (*t).clone()).collect())
        }
        Some(Redistribution::Broadcast) => {
            if let Some(differs) = old.iter().position(|copy| copy != &old[0]) {
                return Err(RedistributionError::BroadcastDiffers {
                    state: state.to_owned(),
                    subtask: differs as u32,
                });
            }
            Ok(old[0].clone())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn all<T: Clone + PartialEq>(
        how: Option<Redistribution>,
        old: &[Vec<T>],
        p: u32,
    ) -> Result<Vec<Vec<T>>, RedistributionError> {
        (0..p).map(|s| entries_for("s", how, old, p, s)).collect()
    }

    #[test]
    fn a_split_divides_the_entries_in_order_and_evenly() {
        let old = vec![vec![1, 2, 3, 4, 5], vec![6]];
        assert_eq!(
            all(Some(Redistribution::Split), &old, 3).unwrap(),
            vec![vec![1, 2], vec![3, 4], vec![5, 6]]
        );
        assert_eq!(
            all(Some(Redistribution::Split), &old, 4).unwrap(),
            vec![vec![1], vec![2, 3], vec![4], vec![5, 6]]
        );
    }

    #[test]
    fn the_same_parallelism_gives_each_subtask_its_own_entries() {
        let old = vec![vec![1, 2, 3, 4, 5], vec![6]];
        for how in [
            None,
            Some(Redistribution::Split),
            Some(Redistribution::Union),
            Some(Redistribution::Broadcast),
        ] {
            assert_eq!(all(how, &old, 2).unwrap(), old, "{how:?}");
        }
    }

    #[test]
    fn a_rescale_of_an_undeclared_state_names_it_and_the_choices() {
        let err = entries_for("totals", None, &[vec![1], vec![2]], 3, 0).unwrap_err();
        assert_eq!(
            err,
            RedistributionError::Undeclared {
                state: "totals".into(),
                from: 2,
                to: 3
            }
        );
        let msg = err.to_string();
        for word in ["\"totals\"", "split", "union", "broadcast", "at 2"] {
            assert!(msg.contains(word), "{msg}");
        }
    }

    #[test]
    fn a_broadcast_replicates_its_copy_and_refuses_copies_that_differ() {
        let same = vec![vec![7], vec![7], vec![7]];
        assert_eq!(
            all(Some(Redistribution::Broadcast), &same, 2).unwrap(),
            vec![vec![7], vec![7]]
        );
        let differ = vec![vec![7], vec![7], vec![8]];
        assert_eq!(
            entries_for("rules", Some(Redistribution::Broadcast), &differ, 2, 1).unwrap_err(),
            RedistributionError::BroadcastDiffers {
                state: "rules".into(),
                subtask: 2
            }
        );
    }

    #[test]
    fn codes_round_trip() {
        for how in [
            None,
            Some(Redistribution::Split),
            Some(Redistribution::Union),
            Some(Redistribution::Broadcast),
        ] {
            assert_eq!(
                Redistribution::from_code(Redistribution::code(how)),
                Some(how)
            );
        }
        assert_eq!(Redistribution::from_code(4), None);
    }

    proptest! {
        #[test]
        fn a_split_gives_every_entry_to_exactly_one_subtask_in_order(
            old in prop::collection::vec(prop::collection::vec(any::<u16>(), 0..20), 1..9),
            p in 1u32..12,
        ) {
            let new = all(Some(Redistribution::Split), &old, p).unwrap();
            prop_assert_eq!(new.len(), p as usize);
            if old.len() as u32 != p {
                // In order: the concatenation is unchanged.
                prop_assert_eq!(new.concat(), old.concat());
                let sizes: Vec<usize> = new.iter().map(Vec::len).collect();
                let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
                prop_assert!(max - min <= 1, "{:?}", sizes);
            } else {
                prop_assert_eq!(new, old);
            }
        }

        #[test]
        fn a_union_gives_every_subtask_every_entry(
            old in prop::collection::vec(prop::collection::vec(any::<u16>(), 0..20), 1..9),
            p in 1u32..12,
        ) {
            prop_assume!(old.len() as u32 != p);
            for entries in all(Some(Redistribution::Union), &old, p).unwrap() {
                prop_assert_eq!(&entries, &old.concat());
            }
        }

        #[test]
        fn a_rescale_there_and_back_keeps_every_split_entry(
            old in prop::collection::vec(prop::collection::vec(any::<u16>(), 0..20), 1..9),
            p in 1u32..12,
        ) {
            let there = all(Some(Redistribution::Split), &old, p).unwrap();
            let back = all(Some(Redistribution::Split), &there, old.len() as u32).unwrap();
            prop_assert_eq!(back.concat(), old.concat());
        }
    }
}
