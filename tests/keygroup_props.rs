//! Properties of the key-group assignment over the whole valid domain.

use keyshift::keygroup::*;
use proptest::prelude::*;

fn pair() -> impl Strategy<Value = (u32, u32)> {
    (1u32..=UPPER_BOUND_MAX_PARALLELISM).prop_flat_map(|g| (1u32..=g.min(2048), Just(g)))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn ranges_partition_the_groups((p, g) in pair()) {
        let a = Assignment::new(i64::from(p), i64::from(g)).unwrap();
        let ranges = a.ranges();
        prop_assert_eq!(ranges.len() as u32, p);
        let mut next = 0u32;
        for (i, r) in ranges.iter().enumerate() {
            // Contiguous, disjoint, non-empty, in order.
            prop_assert_eq!(r.start, next);
            prop_assert!(r.start <= r.end);
            next = r.end + 1;
            // The owner of every group in the range is the range's subtask.
            prop_assert_eq!(a.owner(r.start), i as u32);
            prop_assert_eq!(a.owner(r.end), i as u32);
        }
        prop_assert_eq!(next, g);
    }

    #[test]
    fn every_group_agrees_with_its_range((p, g) in (1u32..=300).prop_flat_map(|g| (1u32..=g, Just(g)))) {
        let a = Assignment::new(i64::from(p), i64::from(g)).unwrap();
        for group in 0..g {
            prop_assert!(a.range(a.owner(group)).contains(group));
        }
        let s = a.skew();
        prop_assert!(s.max_groups - s.min_groups <= 1);
        prop_assert_eq!(s.busiest_subtasks * s.max_groups + if s.divides { 0 } else { s.lightest_subtasks * s.min_groups }, g);
        prop_assert!(g % s.divisor_below == 0 && g % s.divisor_above == 0);
        prop_assert!(s.divisor_below <= p && p <= s.divisor_above);
    }

    #[test]
    fn a_keys_group_never_depends_on_parallelism(key in ".*", g in 1u32..=32768, p1 in 1u32..=32768, p2 in 1u32..=32768) {
        let key = Key::String(key);
        let group = key_group_for_key(&key, g);
        prop_assert!(group < g);
        let (p1, p2) = (p1.min(g), p2.min(g));
        let a1 = Assignment::new(i64::from(p1), i64::from(g)).unwrap();
        let a2 = Assignment::new(i64::from(p2), i64::from(g)).unwrap();
        // The group is a function of the key and g alone; only its owner changes.
        prop_assert!(a1.range(a1.owner_of_key(&key)).contains(group));
        prop_assert!(a2.range(a2.owner_of_key(&key)).contains(group));
    }

    #[test]
    fn rescale_reads_cover_each_new_range((p1, g) in pair(), p2 in 1u32..=2048) {
        let p2 = p2.min(g);
        let from = Assignment::new(i64::from(p1), i64::from(g)).unwrap();
        let to = Assignment::new(i64::from(p2), i64::from(g)).unwrap();
        let plan = rescale_plan(from, to).unwrap();
        let mut paired = std::collections::HashSet::new();
        for s in &plan.subtasks {
            let covered: u32 = s.reads.iter().map(|r| r.count).sum();
            prop_assert_eq!(covered, s.key_groups.len());
            for r in &s.reads {
                prop_assert!(from.range(r.from).intersect(&s.key_groups) == Some(r.key_groups));
            }
            if let Some(o) = s.paired_with {
                prop_assert!(paired.insert(o), "old subtask {} paired twice", o);
            }
        }
        prop_assert!(plan.moved_groups <= g);
        if p1 == p2 {
            prop_assert_eq!(plan.moved_groups, 0);
        }
    }
}
