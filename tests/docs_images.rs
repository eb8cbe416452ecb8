//! Every picture under docs/ is a real drawing and is shown somewhere, and every image a
//! Markdown file shows exists: each `*.svg` under `docs/` parses as XML (strictly), has a
//! non-empty `<title>`, draws some shapes and is referenced from a Markdown file; each
//! `![..](path)` or `<img src="path">` in a Markdown file of the repository names a file that
//! exists.

mod svg_support;

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};

fn root() -> PathBuf {
    // At run time first: a test binary cargo reused from another checkout's build (a shared
    // target dir) would otherwise read, and here rewrite, that checkout's files.
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// Files under `dir` whose name ends with `ext`, skipping hidden and build directories.
fn files(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || name == "target" || name == "node_modules" {
            continue;
        }
        if path.is_dir() {
            files(&path, ext, out);
        } else if name.ends_with(ext) {
            out.push(path);
        }
    }
}

/// The image targets a Markdown text shows: `![alt](target "title")` and `<img src="target">`.
fn image_refs(markdown: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = markdown;
    while let Some(i) = rest.find("![") {
        rest = &rest[i + 2..];
        let Some(close) = rest.find("](") else { break };
        let after = &rest[close + 2..];
        if let Some(end) = after.find(')') {
            let target = after[..end].split_whitespace().next().unwrap_or_default();
            out.push(target.to_owned());
        }
    }
    let mut rest = markdown;
    while let Some(i) = rest.find("<img") {
        rest = &rest[i..];
        if let Some(s) = rest.find("src=\"") {
            let after = &rest[s + 5..];
            if let Some(end) = after.find('"') {
                out.push(after[..end].to_owned());
            }
        }
        rest = &rest[4..];
    }
    out
}

/// `target` relative to the Markdown file's directory, normalised (no `.` or `..`).
fn resolve(md: &Path, target: &str) -> PathBuf {
    let target = target.split('#').next().unwrap_or_default();
    let mut out = PathBuf::new();
    for c in md
        .parent()
        .unwrap_or(Path::new(""))
        .join(target)
        .components()
    {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

/// Every image reference of every Markdown file: (the file, the target, the resolved path).
fn references() -> Vec<(PathBuf, String, PathBuf)> {
    let mut mds = Vec::new();
    files(&root(), ".md", &mut mds);
    assert!(
        mds.iter().any(|p| p.ends_with("README.md")),
        "no Markdown found"
    );
    let mut out = Vec::new();
    for md in mds {
        let text = std::fs::read_to_string(&md).unwrap();
        for target in image_refs(&text) {
            let path = resolve(&md, &target);
            out.push((md.clone(), target, path));
        }
    }
    out
}

const SHAPES: [&str; 7] = [
    "rect", "line", "path", "circle", "ellipse", "polygon", "polyline",
];

/// What is wrong with one SVG file as a documentation picture.
fn picture_problems(svg: &str) -> Vec<String> {
    let elements = match svg_support::try_parse(svg) {
        Ok(e) => e,
        Err(e) => return vec![format!("does not parse: {e}")],
    };
    let mut out = Vec::new();
    if !elements
        .iter()
        .any(|e| e.name == "title" && !e.text.trim().is_empty())
    {
        out.push("has no <title> (or an empty one)".into());
    }
    // Beyond a background, a drawing has a few shapes and some text.
    let shapes = elements
        .iter()
        .filter(|e| SHAPES.contains(&e.name.as_str()))
        .count();
    if shapes < 3 {
        out.push(format!("draws {shapes} shapes: an empty picture"));
    }
    if !elements
        .iter()
        .any(|e| e.name == "text" && !e.text.trim().is_empty())
    {
        out.push("has no text".into());
    }
    out
}

#[test]
fn every_picture_under_docs_is_a_titled_drawing_shown_by_a_markdown_file() {
    let mut svgs = Vec::new();
    files(&root().join("docs"), ".svg", &mut svgs);
    assert!(svgs.len() >= 4, "pictures under docs/: {svgs:?}");
    let shown: BTreeSet<PathBuf> = references().into_iter().map(|(_, _, p)| p).collect();
    let mut problems = Vec::new();
    for path in &svgs {
        let rel = path.strip_prefix(root()).unwrap().display().to_string();
        let text = std::fs::read_to_string(path).unwrap();
        for p in picture_problems(&text) {
            problems.push(format!("{rel} {p}"));
        }
        if !shown.contains(path) {
            problems.push(format!(
                "{rel} is not shown by any Markdown file (README.md or docs/)"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_image_a_markdown_file_shows_exists() {
    let refs = references();
    assert!(
        refs.iter().any(|(md, _, _)| md.ends_with("README.md")),
        "README.md shows no picture"
    );
    let missing: Vec<String> = refs
        .iter()
        .filter(|(_, target, path)| !target.contains("://") && !path.is_file())
        .map(|(md, target, _)| format!("{} shows {target}, which does not exist", md.display()))
        .collect();
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}

#[test]
fn the_checks_catch_bad_pictures_and_references() {
    assert!(
        picture_problems("<svg><rect/>")
            .iter()
            .any(|p| p.contains("does not parse"))
    );
    let untitled =
        r#"<svg xmlns="http://www.w3.org/2000/svg"><rect/><rect/><rect/><text>x</text></svg>"#;
    assert_eq!(
        picture_problems(untitled),
        vec!["has no <title> (or an empty one)".to_owned()]
    );
    let empty = r#"<svg xmlns="http://www.w3.org/2000/svg"><title>t</title><rect/></svg>"#;
    assert!(
        picture_problems(empty)
            .iter()
            .any(|p| p.contains("empty picture"))
    );
    let good = r#"<svg xmlns="http://www.w3.org/2000/svg"><title>t</title><rect/><line/><path d="M0,0"/><text>a &amp; b</text></svg>"#;
    assert_eq!(picture_problems(good), Vec::<String>::new());
    assert_eq!(
        image_refs("a ![x](docs/a.svg) b ![y](../b.svg \"t\") <img src=\"c.png\" width=1>"),
        ["docs/a.svg", "../b.svg", "c.png"]
    );
    assert_eq!(
        resolve(Path::new("/r/docs/x.md"), "../a.svg"),
        PathBuf::from("/r/a.svg")
    );
    assert_eq!(
        resolve(Path::new("/r/README.md"), "docs/a.svg#x"),
        PathBuf::from("/r/docs/a.svg")
    );
}
