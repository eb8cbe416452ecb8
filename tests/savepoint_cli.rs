//! `keyshift savepoint ...` as a user runs it: exit codes, messages naming files, JSON output.

mod pty_support;
mod savepoint_support;

use keyshift::keygroup::{Key, key_group_for_key};
use savepoint_support::*;
use serde_json::Value;
use std::collections::BTreeSet;
use std::process::{Command, Output};

fn keyshift(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_keyshift"))
        .args(args)
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn ok(args: &[&str]) -> String {
    let out = keyshift(args);
    assert!(
        out.status.success(),
        "{args:?} failed: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// Runs and expects exit code 1 with `needle` on stderr.
fn fails(args: &[&str], needle: &str) -> Output {
    let out = keyshift(args);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{args:?}: {}",
        text(&out.stdout)
    );
    assert!(
        text(&out.stderr).contains(needle),
        "{args:?}: stderr lacks {needle:?}: {}",
        text(&out.stderr)
    );
    out
}

fn build_file_job(shape: JobShape) -> (tempfile::TempDir, String, Built) {
    let (tmp, job) = file_job();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let built = rt.block_on(build(&job, shape));
    (tmp, job, built)
}

#[test]
fn every_subcommand_has_help() {
    let out = ok(&["savepoint", "--help"]);
    for sub in ["list", "inspect", "verify", "dump", "rewrite", "dispose"] {
        assert!(out.contains(sub), "savepoint --help lists {sub}");
        let help = ok(&["savepoint", sub, "--help"]);
        assert!(
            help.contains("Usage:") && help.len() > 300,
            "{sub} --help: {help}"
        );
    }
    assert!(!out.contains("bench-rewrite"), "the benchmark is hidden");
    assert!(ok(&["savepoint", "rewrite", "--help"]).contains("--max-parallelism"));
    assert!(ok(&["savepoint", "dispose", "--help"]).contains("_in_use.json"));
}

#[test]
fn verify_exit_codes_for_flipped_truncated_and_missing_files() {
    let (_tmp, _job, built) = build_file_job(JobShape::default());
    let url = built.url.as_str();
    let good = ok(&["savepoint", "verify", url]);
    assert!(good.contains("OK: 4 files"), "{good}");
    let v: Value = serde_json::from_str(&ok(&["savepoint", "verify", url, "-o", "json"])).unwrap();
    assert_eq!(v["problems"], Value::Array(vec![]));
    assert_eq!(v["keysChecked"], built.state.len());

    let dir = local(url);
    let corrupt = |name: &str, f: &dyn Fn(&mut Vec<u8>)| {
        let path = dir.join(name);
        let original = std::fs::read(&path).unwrap();
        let mut bytes = original.clone();
        f(&mut bytes);
        std::fs::write(&path, &bytes).unwrap();
        original
    };

    // A flipped byte.
    let original = corrupt("state-1-of-4.bin", &|b| {
        let i = b.len() / 3;
        b[i] ^= 1;
    });
    let out = fails(
        &["savepoint", "verify", url],
        "verification failed with 1 problem",
    );
    let report = text(&out.stdout);
    assert!(
        report.contains("FAIL  state-1-of-4.bin") && report.contains("checksum"),
        "{report}"
    );
    assert!(report.contains("ok    state-0-of-4.bin"), "{report}");
    std::fs::write(dir.join("state-1-of-4.bin"), original).unwrap();
    ok(&["savepoint", "verify", url]);

    // A truncated file.
    let original = corrupt("state-2-of-4.bin", &|b| b.truncate(b.len() - 7));
    let out = fails(&["savepoint", "verify", url], "1 problem");
    let report = text(&out.stdout);
    assert!(
        report.contains("state-2-of-4.bin") && report.contains("truncated"),
        "{report}"
    );
    std::fs::write(dir.join("state-2-of-4.bin"), original).unwrap();

    // A missing file (JSON output names it too).
    std::fs::remove_file(dir.join("state-3-of-4.bin")).unwrap();
    let out = fails(&["savepoint", "verify", url, "-o", "json"], "1 problem");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let problem = v["problems"][0].as_str().unwrap();
    assert!(
        problem.contains("state-3-of-4.bin") && problem.contains("missing"),
        "{problem}"
    );

    // No snapshot at all.
    fails(
        &["savepoint", "verify", &format!("{}/savepoints/sp-99", _job)],
        "not found",
    );
}

#[test]
fn list_inspect_dump_rewrite_dispose_through_the_binary() {
    let (_tmp, job, built) = build_file_job(JobShape::default());
    let src = built.url.as_str();

    // list
    let table = ok(&["savepoint", "list", &job]);
    assert!(
        table.contains("savepoint") && table.contains("newestSnapshot"),
        "{table}"
    );
    let v: Value = serde_json::from_str(&ok(&["savepoint", "list", &job, "-o", "json"])).unwrap();
    let rows = v["snapshots"].as_array().unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["kind"], "savepoint");
    assert_eq!(rows[0]["id"], 1);
    assert_eq!(rows[0]["parallelism"], 4);
    assert_eq!(rows[0]["maxParallelism"], 128);
    assert_eq!(rows[0]["bytes"], built.manifest.stats.total_bytes);
    assert_eq!(rows[0]["url"], Value::from(src));

    // inspect
    let table = ok(&["savepoint", "inspect", src, "--top", "3"]);
    for needle in [
        "max parallelism:  128",
        "parallelism:      4",
        "32-63",
        "largest keys by count",
        "source positions: 0=4000 1=4000 2=4000",
    ] {
        assert!(table.contains(needle), "inspect lacks {needle:?}:\n{table}");
    }
    let v: Value = serde_json::from_str(&ok(&["savepoint", "inspect", src, "-o", "json"])).unwrap();
    assert_eq!(v["groups"].as_array().unwrap().len(), 128);
    assert_eq!(v["totalKeys"], built.state.len());
    assert_eq!(v["function"], "count");

    // dump, restricted
    let lines = ok(&["savepoint", "dump", src, "--key-groups", "0-9"]);
    let parsed: Vec<Value> = lines
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(!parsed.is_empty());
    for l in &parsed {
        let g = l["keyGroup"].as_u64().unwrap();
        assert!(g <= 9);
        let key = Key::String(l["key"].as_str().unwrap().to_owned());
        assert_eq!(u64::from(key_group_for_key(&key, 128)), g);
        assert_eq!(l["keyType"], "string");
        assert!(l["value"].as_i64().unwrap() >= 1);
    }
    fails(
        &["savepoint", "dump", src, "--key-groups", "9-1"],
        "start is after the end",
    );

    // rewrite, then the result verifies and dumps the same values at the new groups
    let target = format!("{job}/savepoints/sp-2");
    let out = keyshift(&[
        "savepoint",
        "rewrite",
        src,
        "--max-parallelism",
        "512",
        "--to",
        &target,
        "--parallelism",
        "6",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("MB/s") && stdout.contains("keys/s"),
        "{stdout}"
    );
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("scatter") && stderr.contains("assemble"),
        "{stderr}"
    );
    ok(&["savepoint", "verify", &target]);
    let before: BTreeSet<String> = ok(&["savepoint", "dump", src])
        .lines()
        .map(strip_group)
        .collect();
    let after_text = ok(&["savepoint", "dump", &target]);
    let after: BTreeSet<String> = after_text.lines().map(strip_group).collect();
    assert_eq!(before, after);
    assert_eq!(after.len(), built.state.len());
    fails(
        &["savepoint", "rewrite", src, "-g", "512", "--to", &target],
        "already holds a committed snapshot",
    );
    fails(
        &[
            "savepoint",
            "rewrite",
            src,
            "-g",
            "40000",
            "--to",
            &format!("{job}/savepoints/sp-3"),
        ],
        "upper bound 32768",
    );
    let inspected = ok(&["savepoint", "inspect", &target]);
    assert!(
        inspected.contains("rewritten from:   file://"),
        "{inspected}"
    );

    // dispose: sp-2 is now the newest snapshot; sp-1 may go.
    fails(&["savepoint", "dispose", &target], "newest snapshot");
    let out = ok(&["savepoint", "dispose", src]);
    assert!(
        out.contains("deleted") && out.contains("manifest first"),
        "{out}"
    );
    assert!(!local(src).exists());
    let v: Value = serde_json::from_str(&ok(&["savepoint", "list", &job, "-o", "json"])).unwrap();
    assert_eq!(v["snapshots"].as_array().unwrap().len(), 1);
    let out = ok(&["savepoint", "dispose", &target, "--force", "-o", "json"]);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["forcedOver"].as_array().unwrap().len(), 1);
    assert_eq!(v["objects"], 7, "manifest and six state files");
    assert!(ok(&["savepoint", "list", &job]).contains("no committed snapshots"));
}

fn strip_group(line: &str) -> String {
    let mut v: Value = serde_json::from_str(line).unwrap();
    v.as_object_mut().unwrap().remove("keyGroup");
    v.to_string()
}

/// A file source's partition names (`sourcePartitions`): `inspect` shows each beside its
/// position, `rewrite` carries them into the new savepoint, `verify` and `dump` are unaffected;
/// names that do not fit the positions make the manifest inconsistent.
#[test]
fn file_partition_names_are_shown_and_carried_by_rewrite() {
    let (_tmp, job, built) = build_file_job(JobShape::default());
    let src = built.url.as_str();
    let manifest = local(src).join("_manifest.json");
    let mut m: Value = serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    assert!(
        m.get("sourcePartitions").is_none(),
        "the generator has none"
    );
    let names = serde_json::json!({"0": "a.jsonl", "1": "b.jsonl", "2": "c.jsonl"});
    m["sourcePartitions"] = names.clone();
    // Edited by hand: without its own checksum, as manifests from before the field are read.
    assert!(
        m.as_object_mut()
            .unwrap()
            .remove("manifestChecksum")
            .is_some()
    );
    std::fs::write(&manifest, serde_json::to_vec_pretty(&m).unwrap()).unwrap();

    let table = ok(&["savepoint", "inspect", src, "--top", "3"]);
    for needle in [
        "source positions: 3 files",
        "   0  a.jsonl  4000",
        "   2  c.jsonl  4000",
    ] {
        assert!(table.contains(needle), "inspect lacks {needle:?}:\n{table}");
    }
    let v: Value = serde_json::from_str(&ok(&["savepoint", "inspect", src, "-o", "json"])).unwrap();
    assert_eq!(v["sourcePartitions"], names);
    assert_eq!(v["sourcePositions"]["1"], 4000);
    ok(&["savepoint", "verify", src]);
    assert_eq!(
        ok(&["savepoint", "dump", src]).lines().count(),
        built.state.len()
    );

    let target = format!("{job}/savepoints/sp-2");
    ok(&[
        "savepoint",
        "rewrite",
        src,
        "--max-parallelism",
        "256",
        "--to",
        &target,
    ]);
    ok(&["savepoint", "verify", &target]);
    let rewritten: Value =
        serde_json::from_slice(&std::fs::read(local(&target).join("_manifest.json")).unwrap())
            .unwrap();
    assert_eq!(
        rewritten["sourcePartitions"], names,
        "rewrite carries names"
    );
    assert_eq!(rewritten["sourcePositions"], m["sourcePositions"]);
    assert!(ok(&["savepoint", "inspect", &target]).contains("   1  b.jsonl  4000"));

    // A name missing for a position: refused as inconsistent, naming the field.
    m["sourcePartitions"] = serde_json::json!({"0": "a.jsonl", "1": "b.jsonl"});
    std::fs::write(&manifest, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    fails(&["savepoint", "inspect", src], "sourcePartitions");
}

/// Whether two documents are the same, floats within 1e-12 relative (serde_json's default float
/// parser may be one ulp off the exact value, which the YAML parser reads).
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w)))
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(v, w)| same(v, w))
        }
        (Value::Number(x), Value::Number(y)) if x.is_f64() || y.is_f64() => {
            let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            (x - y).abs() <= 1e-12 * x.abs().max(y.abs())
        }
        _ => a == b,
    }
}

/// The YAML of `-o yaml` parsed back into a JSON value.
fn yaml_value(text: &str) -> Value {
    serde_yaml::from_str(text).unwrap_or_else(|e| panic!("not YAML ({e}):\n{text}"))
}

/// Every subcommand with `-o json` also has `-o yaml`: the same document, as YAML.
#[test]
fn yaml_output_is_the_json_document() {
    let (_tmp, job, built) = build_file_job(JobShape::default());
    let src = built.url.as_str();
    for args in [
        vec!["savepoint", "list", job.as_str()],
        vec!["savepoint", "inspect", src, "--top", "3"],
        vec!["savepoint", "verify", src],
        vec!["savepoint", "dispose", src, "--dry-run", "--force"],
    ] {
        let json: Value =
            serde_json::from_str(&ok(&[&args[..], &["-o", "json"]].concat())).unwrap();
        let yaml = yaml_value(&ok(&[&args[..], &["-o", "yaml"]].concat()));
        assert!(same(&yaml, &json), "{args:?}:\n{yaml}\n{json}");
        assert!(json.as_object().is_some_and(|o| !o.is_empty()), "{args:?}");
    }
    // rewrite: two runs, so only the timings may differ.
    let run = |n: u32, output: &str| -> String {
        ok(&[
            "savepoint",
            "rewrite",
            src,
            "-g",
            "256",
            "--to",
            &format!("{job}/savepoints/sp-{n}"),
            "-q",
            "-o",
            output,
        ])
    };
    let json: Value = serde_json::from_str(&run(2, "json")).unwrap();
    let yaml = yaml_value(&run(3, "yaml"));
    let keys = |v: &Value| v.as_object().unwrap().keys().cloned().collect::<Vec<_>>();
    assert_eq!(keys(&yaml), keys(&json));
    for field in [
        "keys",
        "maxParallelism",
        "parallelism",
        "bytesRead",
        "source",
    ] {
        assert_eq!(yaml[field], json[field], "{field}");
    }
}

/// Piped (not a terminal), `verify`, `dump` and `rewrite` draw no progress bar: no escape byte
/// anywhere, and `dump`'s stdout is only its JSON lines.
#[test]
fn no_escapes_through_a_pipe() {
    let (_tmp, job, built) = build_file_job(JobShape::default());
    let src = built.url.as_str();
    let target = format!("{job}/savepoints/sp-2");
    for args in [
        vec!["savepoint", "verify", src],
        vec!["savepoint", "dump", src],
        vec![
            "savepoint",
            "rewrite",
            src,
            "-g",
            "64",
            "--to",
            target.as_str(),
        ],
        vec!["savepoint", "inspect", src],
    ] {
        let out = keyshift(&args);
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        assert!(
            !out.stdout.contains(&0x1b) && !out.stderr.contains(&0x1b),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
    let dumped = ok(&["savepoint", "dump", src]);
    assert!(
        dumped
            .lines()
            .all(|l| serde_json::from_str::<Value>(l).is_ok())
    );
}

/// On a terminal, `rewrite` and `verify` draw a progress bar on stderr (redrawn in place, so
/// escapes); under `NO_COLOR` they fall back to plain lines, with no escape.
#[test]
fn progress_bars_on_a_terminal_only() {
    let (_tmp, job, built) = build_file_job(JobShape::default());
    let src = built.url.as_str();
    let run = |args: &[&str], no_color: bool| -> Vec<u8> {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_keyshift"));
        // A terminal that draws (the pseudo-terminal below is one), whatever TERM the suite
        // itself runs under (CI may have none, or `dumb`).
        cmd.args(args).env_remove("NO_COLOR").env("TERM", "xterm");
        if no_color {
            cmd.env("NO_COLOR", "1");
        }
        let master = pty_support::stderr_on_terminal(&mut cmd);
        let mut child = cmd.stdout(std::process::Stdio::piped()).spawn().unwrap();
        drop(cmd);
        let stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut out = Vec::new();
            std::io::Read::read_to_end(&mut { stdout }, &mut out).unwrap();
            out
        });
        let err = pty_support::read_terminal(master);
        assert!(child.wait().unwrap().success(), "{args:?}: {}", text(&err));
        reader.join().unwrap();
        err
    };
    let to = |n: u32| format!("{job}/savepoints/sp-{n}");
    let (t2, t3) = (to(2), to(3));
    let bar = run(
        &["savepoint", "rewrite", src, "-g", "64", "--to", &t2],
        false,
    );
    assert!(bar.contains(&0x1b), "a bar is drawn: {}", text(&bar));
    let plain = run(
        &["savepoint", "rewrite", src, "-g", "64", "--to", &t3],
        true,
    );
    assert!(!plain.contains(&0x1b), "NO_COLOR: {}", text(&plain));
    assert!(text(&plain).contains("assemble"), "{}", text(&plain));
    let bar = run(&["savepoint", "verify", src], false);
    assert!(bar.contains(&0x1b), "a bar is drawn: {}", text(&bar));
    assert!(!run(&["savepoint", "verify", src], true).contains(&0x1b));
}
