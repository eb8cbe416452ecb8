//! docs/troubleshooting.md lists exactly the condition types and the reasons the code writes:
//! every `Reason` (crates/keyshift-core/src/reason.rs) and every condition type
//! (`status::ALL_CONDITIONS`) has a row, and no row names anything else.

use keyshift::orchestrator::reason::Reason;
use keyshift::orchestrator::status::ALL_CONDITIONS;
use std::collections::BTreeSet;

/// The first cell (a `code` name) of every table row in the section headed `heading`.
fn names(doc: &str, heading: &str) -> Vec<String> {
    let start = doc
        .find(&format!("\n## {heading}\n"))
        .unwrap_or_else(|| panic!("docs/troubleshooting.md has no section {heading}"));
    let section = &doc[start + 1..];
    let end = section[3..].find("\n## ").map_or(section.len(), |i| i + 3);
    section[..end]
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split_once('`').map(|(name, _)| name.to_owned()))
        .collect()
}

fn compare(documented: &[String], code: &[&str], what: &str) {
    let doc: BTreeSet<&str> = documented.iter().map(String::as_str).collect();
    assert_eq!(
        doc.len(),
        documented.len(),
        "a {what} is listed twice: {documented:?}"
    );
    let code: BTreeSet<&str> = code.iter().copied().collect();
    let missing: Vec<_> = code.difference(&doc).collect();
    let extra: Vec<_> = doc.difference(&code).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "docs/troubleshooting.md and the code disagree on {what}s: written by the code but not documented: {missing:?}; documented but not in the code: {extra:?}"
    );
}

fn doc() -> String {
    // The checkout the test runs in (a binary reused from another checkout's build would read
    // that one's file).
    let root = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    std::fs::read_to_string(root.join("docs/troubleshooting.md")).expect("docs/troubleshooting.md")
}

#[test]
fn every_condition_type_is_documented_and_no_other() {
    compare(
        &names(&doc(), "Condition types"),
        &ALL_CONDITIONS,
        "condition type",
    );
}

#[test]
fn every_reason_is_documented_and_no_other() {
    let code: Vec<&str> = Reason::ALL.iter().map(|r| r.as_str()).collect();
    compare(&names(&doc(), "Reasons"), &code, "reason");
}

#[test]
fn the_comparison_catches_a_missing_and_an_extra_row() {
    let text = "x\n## Reasons\n\n| reason | a |\n| --- | --- |\n| `Running` | x |\n| `Bogus` | y |\n\n## Next\n| `Other` | z |\n";
    assert_eq!(names(text, "Reasons"), ["Running", "Bogus"]);
    let result = std::panic::catch_unwind(|| {
        compare(&names(text, "Reasons"), &["Running", "Stopping"], "reason")
    });
    let message = *result
        .expect_err("a mismatch fails")
        .downcast::<String>()
        .unwrap();
    assert!(
        message.contains("\"Stopping\"") && message.contains("\"Bogus\""),
        "{message}"
    );
}
