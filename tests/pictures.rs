//! The documentation's pictures are what the code draws from their data now: the architecture
//! diagram (src/pictures/architecture.rs), the rescale timeline (docs/data/rescale-timeline.json)
//! and the benchmark charts and summary table (docs/data/benchmarks.json). A difference fails;
//! `UPDATE_PICTURES=1 cargo test --all-features --test pictures` rewrites the committed files.

use keyshift::pictures::{architecture, charts, timeline};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    // At run time first: a test binary cargo reused from another checkout's build (a shared
    // target dir) would otherwise read, and here rewrite, that checkout's files.
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

fn updating() -> bool {
    std::env::var_os("UPDATE_PICTURES").is_some_and(|v| !v.is_empty())
}

/// Compares `path` (relative to the repository) with `expected`, or rewrites it when updating.
/// Returns what differs.
fn check(path: &str, expected: &str) -> Option<String> {
    let file = root().join(path);
    let committed = std::fs::read_to_string(&file).unwrap_or_default();
    if committed == expected {
        return None;
    }
    if updating() {
        std::fs::write(&file, expected).unwrap_or_else(|e| panic!("writing {path}: {e}"));
        return None;
    }
    let line = committed
        .lines()
        .zip(expected.lines())
        .position(|(a, b)| a != b)
        .map_or_else(|| "its length".to_owned(), |i| format!("line {}", i + 1));
    Some(format!(
        "{path} differs from what the code draws (first at {line}); run `UPDATE_PICTURES=1 cargo test --all-features --test pictures` to rewrite it, and commit the result"
    ))
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

fn assert_none(problems: Vec<String>) {
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_architecture_diagram_is_current() {
    let d = architecture::diagram();
    assert_none(architecture::problems(&d));
    assert_none(
        check("docs/architecture.svg", &architecture::render(&d))
            .into_iter()
            .collect(),
    );
}

#[test]
fn the_rescale_timeline_is_current() {
    let record: timeline::RescaleRecord =
        serde_json::from_str(&read("docs/data/rescale-timeline.json"))
            .expect("docs/data/rescale-timeline.json is a rescale record");
    assert!(!record.steps.is_empty(), "the record has no steps");
    assert!(record.pause_seconds() > 0.0 && record.raw_seconds() > 0.0);
    assert_none(
        check(
            "docs/rescale-timeline.svg",
            &timeline::timeline_svg(&record),
        )
        .into_iter()
        .collect(),
    );
}

const SUMMARY_START: &str =
    "<!-- summary: generated from docs/data/benchmarks.json by tests/pictures.rs -->\n";
const SUMMARY_END: &str = "<!-- end of summary -->\n";

#[test]
fn the_benchmark_charts_and_summary_are_current() {
    let data: charts::BenchData = serde_json::from_str(&read("docs/data/benchmarks.json"))
        .expect("docs/data/benchmarks.json holds the benchmark numbers");
    assert!(!data.charts.is_empty() && !data.summary.is_empty());
    let mut problems: Vec<String> = data
        .charts
        .iter()
        .filter_map(|c| {
            assert!(
                c.groups
                    .iter()
                    .all(|g| g.bars.iter().any(|b| b.ours) && g.bars.iter().any(|b| !b.ours)),
                "{}: every group sets ours beside a baseline of the same run",
                c.file
            );
            check(&format!("docs/{}", c.file), &charts::chart_svg(c))
        })
        .collect();

    // The summary table that opens docs/benchmarks.md, between its markers.
    let doc = read("docs/benchmarks.md");
    let start = doc
        .find(SUMMARY_START)
        .expect("docs/benchmarks.md has the summary start marker")
        + SUMMARY_START.len();
    let end = start
        + doc[start..]
            .find(SUMMARY_END)
            .expect("docs/benchmarks.md has the summary end marker");
    let table = charts::summary_table(&data);
    let mut rewritten = doc.clone();
    rewritten.replace_range(start..end, &table);
    problems.extend(check("docs/benchmarks.md", &rewritten));
    assert_none(problems);
}

/// The check itself: a changed picture is reported with the way to rewrite it.
#[test]
fn a_stale_picture_is_reported_with_the_fix() {
    if updating() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let rel = Path::new(dir.path()).join("x.svg");
    std::fs::write(&rel, "old").unwrap();
    let message = check(rel.to_str().unwrap(), "new").expect("a difference");
    assert!(message.contains("UPDATE_PICTURES=1"), "{message}");
    assert_eq!(check(rel.to_str().unwrap(), "old"), None);
}
