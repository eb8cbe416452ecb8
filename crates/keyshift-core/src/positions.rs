//! Source positions across runs: which current partition a snapshot's position belongs to.
//!
//! A snapshot keeps, per source partition index, the position to resume from
//! (`sourcePositions`) and, for a file source, the partition's identity: its file name relative to
//! the source directory (`sourcePartitions`, keyed like the positions). The directory may have
//! changed between the snapshot and the restore — a file added or removed shifts the indexes of
//! the files after it in name order — so a restore matches positions **by name**:
//!
//! * a file in the snapshot that is still there keeps its position, whatever its index now;
//! * a file that is new starts at 0 ([`PositionRemap::new`]);
//! * a file that is gone is reported ([`PositionRemap::gone`]): its records were read up to its
//!   position, there is nothing to restore for it.
//!
//! A snapshot without names (the generator, whose partitions are their indexes, and manifests
//! written before names were recorded) restores **by index**, as before; with a file source the
//! caller should warn when the partition counts differ ([`PositionRemap::count_changed`]), as the
//! files may then have shifted.
//!
//! [`remap_positions`] is pure; the worker logs its report and checks the positions against the
//! files (a file shorter than its position is refused, see
//! [`FileSourceError::Shrunk`](super::FileSourceError::Shrunk)).

use std::collections::BTreeMap;

/// A snapshot's partition names that do not fit its positions.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PositionsError {
    /// Names are recorded, but not for exactly the partitions that have positions.
    #[error(
        "sourcePartitions names partitions {names:?} but sourcePositions has partitions {positions:?}: each partition with a position needs exactly one name"
    )]
    Mismatch {
        /// Partition indexes with a name.
        names: Vec<u32>,
        /// Partition indexes with a position.
        positions: Vec<u32>,
    },
    /// Two partitions carry the same name.
    #[error("sourcePartitions names {name:?} for partitions {first} and {second}")]
    Duplicate {
        /// The name.
        name: String,
        /// The first partition with it.
        first: u32,
        /// The second partition with it.
        second: u32,
    },
    /// A name is empty.
    #[error("sourcePartitions has an empty name for partition {partition}")]
    Empty {
        /// The partition.
        partition: u32,
    },
}

/// Checks that recorded partition names fit the positions: none at all (index identity), or one
/// non-empty, distinct name for every partition that has a position.
pub fn check_partition_names(
    positions: &BTreeMap<u32, u64>,
    names: &BTreeMap<u32, String>,
) -> Result<(), PositionsError> {
    if names.is_empty() {
        return Ok(());
    }
    if !names.keys().eq(positions.keys()) {
        return Err(PositionsError::Mismatch {
            names: names.keys().copied().collect(),
            positions: positions.keys().copied().collect(),
        });
    }
    let mut seen: BTreeMap<&str, u32> = BTreeMap::new();
    for (&partition, name) in names {
        if name.is_empty() {
            return Err(PositionsError::Empty { partition });
        }
        if let Some(first) = seen.insert(name.as_str(), partition) {
            return Err(PositionsError::Duplicate {
                name: name.clone(),
                first,
                second: partition,
            });
        }
    }
    Ok(())
}

/// The partitions of the source as it is now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CurrentPartitions<'a> {
    /// Partitions identified by their index only (the generator): this many.
    Indexed(u32),
    /// Partitions identified by name (the file source): partition `i` is `names[i]`.
    Named(&'a [String]),
}

impl CurrentPartitions<'_> {
    /// How many partitions there are.
    pub fn count(&self) -> u32 {
        match self {
            CurrentPartitions::Indexed(n) => *n,
            CurrentPartitions::Named(names) => names.len() as u32,
        }
    }

    fn name(&self, index: u32) -> Option<&str> {
        match self {
            CurrentPartitions::Indexed(_) => None,
            CurrentPartitions::Named(names) => names.get(index as usize).map(String::as_str),
        }
    }
}

/// How a snapshot's positions were matched to the current partitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatchedBy {
    /// By partition name (the snapshot recorded names, and the source has them).
    Name,
    /// By partition index (the snapshot recorded no names, or the source has none).
    Index,
}

/// A current partition the snapshot has no position for: it starts at 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewPartition {
    /// Its index now.
    pub index: u32,
    /// Its name (file sources).
    pub name: Option<String>,
}

/// A snapshot partition that is not in the current source: its position is not restored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GonePartition {
    /// Its index in the snapshot.
    pub index: u32,
    /// Its name in the snapshot, if recorded.
    pub name: Option<String>,
    /// The position it had been read to.
    pub position: u64,
}

/// The snapshot's positions laid onto the current partitions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PositionRemap {
    /// Position per current partition index; a partition not listed starts at 0.
    pub positions: BTreeMap<u32, u64>,
    /// How partitions were matched.
    pub matched_by: MatchedBy,
    /// Current partitions without a position in the snapshot, in index order.
    pub new: Vec<NewPartition>,
    /// Snapshot partitions that are not in the current source, in snapshot index order.
    pub gone: Vec<GonePartition>,
    /// Matched by index and the partition counts differ: `(in the snapshot, now)`.
    pub count_changed: Option<(u32, u32)>,
}

/// Lays a snapshot's positions (`positions`, with the partition names it recorded in `names`,
/// possibly none) onto the `current` partitions. See the [module docs](self).
///
/// Matches by name when the snapshot recorded names and the source has them; by index otherwise.
/// Fails only when `names` does not fit `positions` ([`check_partition_names`]).
pub fn remap_positions(
    positions: &BTreeMap<u32, u64>,
    names: &BTreeMap<u32, String>,
    current: CurrentPartitions<'_>,
) -> Result<PositionRemap, PositionsError> {
    check_partition_names(positions, names)?;
    let count = current.count();
    let mut out = PositionRemap {
        positions: BTreeMap::new(),
        matched_by: MatchedBy::Index,
        new: Vec::new(),
        gone: Vec::new(),
        count_changed: None,
    };
    match current {
        CurrentPartitions::Named(now) if !names.is_empty() => {
            out.matched_by = MatchedBy::Name;
            let index_now: BTreeMap<&str, u32> = now
                .iter()
                .enumerate()
                .map(|(i, n)| (n.as_str(), i as u32))
                .collect();
            for (&old, name) in names {
                let position = positions.get(&old).copied().unwrap_or(0);
                match index_now.get(name.as_str()) {
                    Some(&i) => {
                        out.positions.insert(i, position);
                    }
                    None => out.gone.push(GonePartition {
                        index: old,
                        name: Some(name.clone()),
                        position,
                    }),
                }
            }
        }
        _ => {
            for (&old, &position) in positions {
                if old < count {
                    out.positions.insert(old, position);
                } else {
                    out.gone.push(GonePartition {
                        index: old,
                        name: names.get(&old).cloned(),
                        position,
                    });
                }
            }
            let before = positions.len() as u32;
            if !positions.is_empty() && before != count {
                out.count_changed = Some((before, count));
            }
        }
    }
    // A snapshot without positions (nothing was read yet) makes nothing "new".
    if !positions.is_empty() {
        out.new = (0..count)
            .filter(|i| !out.positions.contains_key(i))
            .map(|index| NewPartition {
                index,
                name: current.name(index).map(str::to_owned),
            })
            .collect();
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    fn indexed<T: Clone>(list: &[T]) -> BTreeMap<u32, T> {
        list.iter()
            .enumerate()
            .map(|(i, v)| (i as u32, v.clone()))
            .collect()
    }

    #[test]
    fn a_file_added_before_the_others_keeps_every_offset_on_its_file() {
        let positions = indexed(&[100u64, 200, 300]);
        let before = indexed(&names(&["b.jsonl", "c.jsonl", "d.jsonl"]));
        let now = names(&["a.jsonl", "b.jsonl", "c.jsonl", "d.jsonl"]);
        let r = remap_positions(&positions, &before, CurrentPartitions::Named(&now)).unwrap();
        assert_eq!(r.matched_by, MatchedBy::Name);
        assert_eq!(r.positions, BTreeMap::from([(1, 100), (2, 200), (3, 300)]));
        assert_eq!(
            r.new,
            vec![NewPartition {
                index: 0,
                name: Some("a.jsonl".into())
            }]
        );
        assert!(r.gone.is_empty());
        assert_eq!(r.count_changed, None);
    }

    #[test]
    fn a_removed_file_is_reported_gone_and_the_rest_move_up() {
        let positions = indexed(&[10u64, 20, 30]);
        let before = indexed(&names(&["a", "b", "c"]));
        let now = names(&["a", "c"]);
        let r = remap_positions(&positions, &before, CurrentPartitions::Named(&now)).unwrap();
        assert_eq!(r.positions, BTreeMap::from([(0, 10), (1, 30)]));
        assert_eq!(
            r.gone,
            vec![GonePartition {
                index: 1,
                name: Some("b".into()),
                position: 20
            }]
        );
        assert!(r.new.is_empty());
    }

    #[test]
    fn snapshots_without_names_restore_by_index_and_say_when_the_count_changed() {
        let positions = indexed(&[10u64, 20, 30]);
        let none = BTreeMap::new();
        let now = names(&["a", "b"]);
        let r = remap_positions(&positions, &none, CurrentPartitions::Named(&now)).unwrap();
        assert_eq!(r.matched_by, MatchedBy::Index);
        assert_eq!(r.positions, BTreeMap::from([(0, 10), (1, 20)]));
        assert_eq!(r.count_changed, Some((3, 2)));
        assert_eq!(r.gone.len(), 1);
        assert_eq!(r.gone[0].index, 2);

        let now = names(&["a", "b", "c", "d"]);
        let r = remap_positions(&positions, &none, CurrentPartitions::Named(&now)).unwrap();
        assert_eq!(r.count_changed, Some((3, 4)));
        assert_eq!(
            r.new,
            vec![NewPartition {
                index: 3,
                name: Some("d".into())
            }]
        );

        // The generator: same count, identity.
        let r = remap_positions(&positions, &none, CurrentPartitions::Indexed(3)).unwrap();
        assert_eq!(r.positions, positions);
        assert_eq!((r.count_changed, r.new.len(), r.gone.len()), (None, 0, 0));
    }

    #[test]
    fn no_positions_means_nothing_new() {
        let now = names(&["a", "b"]);
        let r = remap_positions(
            &BTreeMap::new(),
            &BTreeMap::new(),
            CurrentPartitions::Named(&now),
        )
        .unwrap();
        assert!(r.positions.is_empty() && r.new.is_empty() && r.gone.is_empty());
        assert_eq!(r.count_changed, None);
    }

    #[test]
    fn names_that_do_not_fit_the_positions_are_refused() {
        let positions = indexed(&[1u64, 2]);
        let now = names(&["a", "b"]);
        let cur = CurrentPartitions::Named(&now);
        let one = BTreeMap::from([(0, "a".to_owned())]);
        assert!(matches!(
            remap_positions(&positions, &one, cur),
            Err(PositionsError::Mismatch { .. })
        ));
        let dup = indexed(&names(&["a", "a"]));
        let e = remap_positions(&positions, &dup, cur).unwrap_err();
        assert_eq!(
            e,
            PositionsError::Duplicate {
                name: "a".into(),
                first: 0,
                second: 1
            }
        );
        let empty = indexed(&names(&["a", ""]));
        assert_eq!(
            remap_positions(&positions, &empty, cur),
            Err(PositionsError::Empty { partition: 1 })
        );
    }

    /// A directory listing before and after: files drawn from a small pool, each with a length.
    fn listings() -> impl Strategy<Value = (BTreeMap<String, u64>, Vec<String>)> {
        (
            proptest::collection::btree_map("[a-f]{1,2}", 0u64..1000, 0..8),
            proptest::collection::btree_set("[a-f]{1,2}", 0..8),
        )
            .prop_map(|(before, now)| (before, now.into_iter().collect()))
    }

    proptest! {
        /// Whatever was added or removed: every file still there gets exactly its own position,
        /// every other current file starts at 0 and is reported new, every vanished file is
        /// reported gone with its position, and nothing else is restored.
        #[test]
        fn remap_by_name_is_exact((before, now) in listings()) {
            let old_names: Vec<String> = before.keys().cloned().collect();
            let positions = indexed(&before.values().copied().collect::<Vec<_>>());
            let recorded = indexed(&old_names);
            let r = remap_positions(&positions, &recorded, CurrentPartitions::Named(&now)).unwrap();
            let expect_by_name = if before.is_empty() { MatchedBy::Index } else { MatchedBy::Name };
            prop_assert_eq!(r.matched_by, expect_by_name);
            for (i, name) in now.iter().enumerate() {
                let i = i as u32;
                match before.get(name) {
                    Some(&p) => prop_assert_eq!(r.positions.get(&i), Some(&p)),
                    None => {
                        prop_assert!(!r.positions.contains_key(&i));
                        prop_assert_eq!(
                            r.new.iter().any(|n| n.index == i && n.name.as_deref() == Some(name)),
                            !before.is_empty()
                        );
                    }
                }
            }
            prop_assert!(r.positions.keys().all(|i| (*i as usize) < now.len()));
            let gone: Vec<(String, u64)> = r.gone.iter()
                .map(|g| (g.name.clone().unwrap_or_default(), g.position)).collect();
            let want: Vec<(String, u64)> = before.iter()
                .filter(|(n, _)| !now.contains(n))
                .map(|(n, p)| (n.clone(), *p)).collect();
            prop_assert_eq!(gone, want);
            prop_assert_eq!(r.positions.len() + r.gone.len(), before.len());
            prop_assert_eq!(r.count_changed, None);
        }
    }
}
