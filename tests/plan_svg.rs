//! `keyshift plan -o svg`: the picture is well-formed XML, draws exactly the plan of
//! crates/keyshift-core/src/keygroup.rs (one range per subtask and strip, the moved groups marked), and the pictures
//! committed under docs/ are what the binary renders now and are referenced from the docs.

mod svg_support;

use keyshift::keygroup::{Assignment, rescale_plan};
use keyshift::plan_svg::plan_svg;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use svg_support::{Element, parse};

/// The pictures under docs/ and the `keyshift` arguments that draw them. Regenerate with e.g.
/// `cargo run -- plan -g 128 -p 8 --from-parallelism 4 -o svg > docs/plan-4-to-8.svg`.
const PICTURES: &[(&str, &[&str])] = &[
    (
        "docs/plan-4-to-8.svg",
        &[
            "plan",
            "-g",
            "128",
            "-p",
            "8",
            "--from-parallelism",
            "4",
            "-o",
            "svg",
        ],
    ),
    (
        "docs/plan-3-to-5.svg",
        &[
            "plan",
            "-g",
            "128",
            "-p",
            "5",
            "--from-parallelism",
            "3",
            "-o",
            "svg",
        ],
    ),
];

fn asg(p: i64, g: i64) -> Assignment {
    Assignment::new(p, g).unwrap()
}

/// The range rects of one strip, by subtask.
fn ranges<'a>(elements: &'a [Element], strip: &str) -> BTreeMap<u32, Vec<&'a Element>> {
    let mut by_subtask: BTreeMap<u32, Vec<&Element>> = BTreeMap::new();
    for e in elements
        .iter()
        .filter(|e| e.class() == Some("range") && e.attr("data-strip") == strip)
    {
        assert_eq!(e.name, "rect");
        by_subtask.entry(e.num("data-subtask")).or_default().push(e);
    }
    by_subtask
}

/// Checks one strip against the assignment: one rect per subtask, its first and last group and
/// count, and its width in proportion to the count.
fn check_strip(elements: &[Element], strip: &str, a: &Assignment) {
    let by_subtask = ranges(elements, strip);
    assert_eq!(by_subtask.len() as u32, a.parallelism(), "{strip} strip");
    let total_width: f64 = by_subtask
        .values()
        .map(|v| v[0].attr("width").parse::<f64>().unwrap())
        .sum();
    for (i, range) in a.ranges().iter().enumerate() {
        let rects = &by_subtask[&(i as u32)];
        assert_eq!(rects.len(), 1, "{strip} strip, subtask {i}: one rect");
        let r = rects[0];
        assert_eq!(
            (r.num("data-start"), r.num("data-end"), r.num("data-groups")),
            (range.start, range.end, range.len()),
            "{strip} strip, subtask {i}"
        );
        let width: f64 = r.attr("width").parse().unwrap();
        let expected = total_width * f64::from(range.len()) / f64::from(a.max_parallelism());
        assert!(
            (width - expected).abs() < 0.02,
            "{strip} strip, subtask {i}: width {width}, expected {expected}"
        );
    }
}

#[test]
fn an_assignment_draws_one_range_per_subtask_and_its_group_counts() {
    for (p, g) in [(3, 128), (4, 128), (100, 128), (1, 1), (7, 32768)] {
        let a = asg(p, g);
        let elements = parse(&plan_svg(&a, None));
        check_strip(&elements, "new", &a);
        assert!(ranges(&elements, "old").is_empty());
        assert!(!elements.iter().any(|e| e.class() == Some("moved")));
        // Skew: one bar per subtask carrying its group count.
        let bars: Vec<&Element> = elements
            .iter()
            .filter(|e| e.class() == Some("bar"))
            .collect();
        assert_eq!(bars.len() as u32, a.parallelism());
        for (bar, range) in bars.iter().zip(a.ranges()) {
            assert_eq!(bar.num("data-groups"), range.len());
        }
        let skew = elements
            .iter()
            .find(|e| e.class() == Some("skew"))
            .expect("the skew line");
        assert_eq!(skew.name, "text");
    }
}

#[test]
fn a_rescale_draws_both_strips_and_marks_exactly_the_moved_groups() {
    for (q, p, g) in [
        (4, 8, 128),
        (3, 5, 128),
        (8, 4, 128),
        (7, 7, 128),
        (24, 200, 1024),
        (1, 2, 2),
    ] {
        let (from, to) = (asg(q, g), asg(p, g));
        let plan = rescale_plan(from, to).unwrap();
        let elements = parse(&plan_svg(&to, Some((&from, &plan))));
        check_strip(&elements, "old", &from);
        check_strip(&elements, "new", &to);
        let moved: Vec<&Element> = elements
            .iter()
            .filter(|e| e.class() == Some("moved"))
            .collect();
        let marked: u32 = moved.iter().map(|m| m.num("data-groups")).sum();
        assert_eq!(marked, plan.moved_groups, "{q} -> {p} at {g}");
        // Each mark lies inside its new subtask's range and outside the old range it replaces,
        // and marks never overlap.
        let mut seen = std::collections::BTreeSet::new();
        for m in &moved {
            let st = &plan.subtasks[m.num("data-subtask") as usize];
            let (start, end) = (m.num("data-start"), m.num("data-end"));
            assert_eq!(m.num("data-groups"), end - start + 1);
            assert!(st.key_groups.contains(start) && st.key_groups.contains(end));
            let kept = st.paired_with.map(|o| from.range(o));
            for group in start..=end {
                assert!(
                    !kept.is_some_and(|k| k.contains(group)),
                    "group {group} stays"
                );
                assert!(seen.insert(group), "group {group} marked twice");
            }
            assert_eq!(from.owner(start), m.num("data-from"));
        }
    }
}

fn root() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

fn keyshift(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_keyshift"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_binary_renders_the_library_picture() {
    let (from, to) = (asg(4, 128), asg(8, 128));
    let plan = rescale_plan(from, to).unwrap();
    assert_eq!(
        keyshift(&[
            "plan",
            "-g",
            "128",
            "-p",
            "8",
            "--from-parallelism",
            "4",
            "-o",
            "svg"
        ]),
        plan_svg(&to, Some((&from, &plan)))
    );
    assert_eq!(
        keyshift(&["plan", "-g", "128", "-p", "3", "-o", "svg"]),
        plan_svg(&asg(3, 128), None)
    );
}

#[test]
fn committed_pictures_are_current_and_referenced() {
    let root = root();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    for (path, args) in PICTURES {
        let committed =
            std::fs::read_to_string(root.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(
            committed == keyshift(args),
            "{path} is stale: regenerate it with `cargo run -- {} > {path}`",
            args.join(" ")
        );
        assert!(readme.contains(path), "README.md does not show {path}");
    }
    // Every plan picture under docs/ is one of the checked ones.
    for entry in std::fs::read_dir(root.join("docs")).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if name.starts_with("plan-") && name.ends_with(".svg") {
            let path = format!("docs/{name}");
            assert!(
                PICTURES.iter().any(|(p, _)| *p == path),
                "{path} is not checked against the binary: add it to PICTURES"
            );
        }
    }
}
