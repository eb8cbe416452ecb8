//! The `keyshift` binary as a user runs it: exit codes, stdin handling, machine-readable output.

mod pty_support;

use std::io::Write;
use std::process::{Command, Output, Stdio};

fn keyshift(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_keyshift"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    if let Some(text) = stdin {
        input.write_all(text.as_bytes()).unwrap();
    }
    drop(input);
    child.wait_with_output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn version_and_help() {
    let out = keyshift(&["--version"], None);
    assert!(out.status.success());
    assert!(text(&out.stdout).contains(env!("CARGO_PKG_VERSION")));
    for sub in ["plan", "keygroup", "crd"] {
        let out = keyshift(&[sub, "--help"], None);
        assert!(out.status.success(), "{sub} --help");
        assert!(text(&out.stdout).contains("Usage:"), "{sub} --help");
    }
}

#[test]
fn plan_bounds_exit_non_zero_with_the_fix() {
    for (args, needle) in [
        (vec!["plan", "-p", "0", "-g", "128"], "at least 1"),
        (vec!["plan", "-p", "-3", "-g", "128"], "at least 1"),
        (vec!["plan", "-p", "200", "-g", "128"], "at most 128"),
        (vec!["plan", "-p", "4", "-g", "40000"], "upper bound 32768"),
        (
            vec!["plan", "-p", "200", "--from-parallelism", "24"],
            "derived by Flink's default rule from parallelism 24",
        ),
    ] {
        let out = keyshift(&args, None);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(
            text(&out.stderr).contains(needle),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn plan_json_is_one_object() {
    let out = keyshift(
        &[
            "plan",
            "-p",
            "16",
            "--from-parallelism",
            "8",
            "-g",
            "128",
            "-o",
            "json",
        ],
        None,
    );
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["rescale"]["movedGroups"], 64);
    assert_eq!(v["rescale"]["movedFraction"], 0.5);
    assert_eq!(v["divides"], true);
}

#[test]
fn keygroup_reads_stdin_in_order() {
    let out = keyshift(
        &["keygroup", "-g", "128", "-p", "4", "-o", "json"],
        Some("hello\n\nuser-1\n"),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines: Vec<serde_json::Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[0]["key"], "hello");
    assert_eq!(lines[1]["key"], "");
    assert_eq!(lines[2]["key"], "user-1");
    for l in &lines {
        let g = l["keyGroup"].as_u64().unwrap();
        assert!(g < 128);
        // Subtask 0 owns 0-31, 1 owns 32-63 ...
        assert_eq!(l["subtask"].as_u64().unwrap(), g / 32);
    }
}

#[test]
fn keygroup_refuses_bad_keys_with_the_line() {
    let out = keyshift(
        &["keygroup", "-g", "128", "--key-type", "long"],
        Some("1\n2\nthree\n"),
    );
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("line 3"),
        "{}",
        text(&out.stderr)
    );
    // Earlier keys were already printed.
    assert_eq!(text(&out.stdout).lines().count(), 2);
}

/// The benchmarks and the test-only commands are in a build exactly when its features are: the
/// product build (no features: `cargo build --release`, the image) refuses them as unknown
/// subcommands, a build with `--features bench` or `--features test-hooks` runs them.
/// `cargo test` checks whichever build it made; hack/test.sh runs this test both without
/// features and with all of them.
#[test]
fn bench_and_test_only_commands_exist_only_with_their_features() {
    let bench = cfg!(feature = "bench");
    // The command line, whether its build has it, and the subcommand refused otherwise.
    for (args, present, unknown) in [
        (&["bench", "--help"][..], bench, "bench"),
        (&["bench", "snapshot", "--help"], bench, "bench"),
        (&["bench", "operator", "rescale", "--help"], bench, "bench"),
        (
            &["savepoint", "bench-rewrite", "--help"],
            bench,
            "bench-rewrite",
        ),
    ] {
        let out = keyshift(args, None);
        let stderr = text(&out.stderr);
        if present {
            assert!(
                out.status.success() && text(&out.stdout).contains("Usage:"),
                "{args:?} runs with the feature: {stderr}"
            );
        } else {
            assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
            assert!(
                stderr.contains(&format!("unrecognized subcommand '{unknown}'")),
                "{args:?} is unknown without the feature: {stderr}"
            );
        }
    }
    let help = text(&keyshift(&["--help"], None).stdout);
    let listed = |sub: &str| {
        help.lines()
            .any(|l| l.split_whitespace().next() == Some(sub))
    };
    assert!(listed("plan") && listed("operator"), "{help}");
    assert_eq!(listed("bench"), bench, "{help}");
    assert!(
        keyshift(&["leader-demo", "--help"], None).status.code() == Some(2),
        "the old demo command is gone"
    );
}

#[test]
fn crd_prints_yaml() {
    let out = keyshift(&["crd"], None);
    assert!(out.status.success());
    let both = text(&out.stdout);
    assert!(both.starts_with("apiVersion: apiextensions.k8s.io/v1"));
    let names: Vec<String> = serde_yaml::Deserializer::from_str(&both)
        .map(|d| {
            let v = <serde_json::Value as serde::Deserialize>::deserialize(d).expect("YAML");
            v["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    assert_eq!(
        names,
        ["streamjobs.keyshift.dev", "streamjobsnapshots.keyshift.dev"]
    );
    let one = keyshift(&["crd", "streamjobsnapshot"], None);
    assert!(one.status.success());
    assert!(text(&one.stdout).contains("name: streamjobsnapshots.keyshift.dev"));
    assert!(!text(&one.stdout).contains("name: streamjobs.keyshift.dev"));
}

/// A worker stops at once on SIGTERM and exits 0, as a container's PID 1 must (the kernel gives
/// PID 1 no default action for SIGTERM, so without a handler a deleted pod would wait out its
/// whole grace period before the kubelet's SIGKILL).
#[test]
fn worker_exits_on_sigterm() {
    use std::io::BufRead;
    let mut child = Command::new(env!("CARGO_BIN_EXE_keyshift"))
        .args([
            "worker",
            "--control-addr",
            "127.0.0.1:0",
            "--data-addr",
            "127.0.0.1:0",
        ])
        .env("KEYSHIFT_TOKEN", "a-test-token-of-enough-length")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Its first stdout line says it listens: the signal handler is installed by then.
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.contains("\"control\""), "{line}");
    // SAFETY: kill(2) on the child this test started.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            start.elapsed() < std::time::Duration::from_secs(10),
            "the worker did not stop on SIGTERM"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(0), "exits 0, not killed by the signal");
}

const LOCAL_MANIFEST: &str = "apiVersion: keyshift.dev/v1alpha1
kind: StreamJob
metadata:
  name: typo
spec:
  replicas: 2
  job:
    source:
      generator: {partitions: 4, keys: 100}
    key: {field: key, type: string}
    aggregation: {function: count}
    sink: {type: log}
";

/// Runs `keyshift local` on `manifest` (the text), which it must refuse: it exits 1 within
/// 20 s and starts nothing (its state directory is not created). Its stderr.
fn local_refusal(manifest: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("job.yaml");
    let state = dir.path().join("state");
    std::fs::write(&path, manifest).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_keyshift"))
        .args([
            "local",
            path.to_str().unwrap(),
            "--state-dir",
            state.to_str().unwrap(),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > std::time::Duration::from_secs(20) {
            // SIGTERM twice: `keyshift local` stops its workers at once.
            for _ in 0..2 {
                // SAFETY: kill(2) on the child this test started.
                unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
                std::thread::sleep(std::time::Duration::from_millis(500));
            }
            let out = child.wait_with_output().unwrap();
            panic!(
                "the job started despite the refusal:\n{manifest}\n{}",
                text(&out.stdout)
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{manifest}\n{err}");
    assert!(!state.exists(), "nothing started: {err}");
    err
}

/// `keyshift local` refuses a manifest with fields the CRD does not declare, as `kubectl apply`
/// does (strict field validation), naming every one by its path; nothing starts.
#[test]
fn local_refuses_unknown_fields_like_the_api_server() {
    for (edit, fields) in [
        (
            ("kind: StreamJob", "kind: StreamJob\nspce: {replicas: 2}"),
            vec!["spce"],
        ),
        (("  replicas: 2", "  replicsa: 2"), vec!["spec.replicsa"]),
        (
            ("    source:\n", "    source:\n      fle: {path: /tmp}\n"),
            vec!["spec.job.source.fle"],
        ),
        (
            ("keys: 100}", "keys: 100, sed: 4}\n    windw: {size: 1m}"),
            vec!["spec.job.source.generator.sed", "spec.job.windw"],
        ),
    ] {
        let err = local_refusal(&LOCAL_MANIFEST.replace(edit.0, edit.1));
        let listed: Vec<String> = fields
            .iter()
            .map(|f| format!("unknown field \"{f}\""))
            .collect();
        assert!(
            err.contains(&format!(
                "StreamJob in version \"v1alpha1\" cannot be handled as a StreamJob: strict decoding error: {}",
                listed.join(", ")
            )),
            "{edit:?}: {err}"
        );
    }
}

/// `keyshift local` refuses a spec.restoreFrom that names a StreamJobSnapshot (a cluster's
/// resource), saying to give the snapshot's URL; nothing starts.
#[test]
fn local_refuses_a_restore_from_a_snapshot_resource() {
    let err = local_refusal(&LOCAL_MANIFEST.replace(
        "  replicas: 2",
        "  replicas: 2\n  restoreFrom: before-upgrade",
    ));
    assert!(
        err.contains("spec.restoreFrom names the StreamJobSnapshot before-upgrade")
            && err.contains("the snapshot's URL"),
        "{err}"
    );
}

/// What a worker writes to stderr from its start to its stop on SIGTERM, with stderr on a
/// terminal (a pseudo-terminal) or a pipe, and `NO_COLOR` as given.
fn worker_stderr(no_color: Option<&str>, terminal: bool) -> Vec<u8> {
    use std::io::{BufRead, Read};
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_keyshift"));
    cmd.args([
        "worker",
        "--control-addr",
        "127.0.0.1:0",
        "--data-addr",
        "127.0.0.1:0",
    ])
    .env("KEYSHIFT_TOKEN", "a-test-token-of-enough-length")
    .env_remove("NO_COLOR")
    .env_remove("KEYSHIFT_LOG_FORMAT")
    .env("RUST_LOG", "info")
    .stdin(Stdio::null())
    .stdout(Stdio::piped());
    if let Some(v) = no_color {
        cmd.env("NO_COLOR", v);
    }
    let master = if terminal {
        Some(pty_support::stderr_on_terminal(&mut cmd))
    } else {
        cmd.stderr(Stdio::piped());
        None
    };
    let mut child = cmd.spawn().unwrap();
    // Our copy of the terminal's other end closes here, so reading it ends with the child.
    drop(cmd);
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    // SAFETY: kill(2) on the child this test started.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let out = match master {
        Some(m) => pty_support::read_terminal(m),
        None => {
            let mut out = Vec::new();
            child.stderr.take().unwrap().read_to_end(&mut out).unwrap();
            out
        }
    };
    child.wait().unwrap();
    assert!(
        String::from_utf8_lossy(&out).contains("worker stopping"),
        "{}",
        String::from_utf8_lossy(&out)
    );
    out
}

/// Log lines carry colour only on a terminal, and not even there under `NO_COLOR` (any
/// non-empty value, per no-color.org); through a pipe there is never an escape byte.
#[test]
fn logs_colour_only_on_a_terminal_without_no_color() {
    const ESC: u8 = 0x1b;
    assert!(
        worker_stderr(None, true).contains(&ESC),
        "a terminal gets colour (the test sees it)"
    );
    for value in ["1", "true"] {
        let out = worker_stderr(Some(value), true);
        assert!(
            !out.contains(&ESC),
            "NO_COLOR={value}: {}",
            String::from_utf8_lossy(&out)
        );
    }
    assert!(
        worker_stderr(Some(""), true).contains(&ESC),
        "NO_COLOR= (empty) does not count"
    );
    assert!(
        !worker_stderr(None, false).contains(&ESC),
        "a pipe gets no colour"
    );
}

/// `keyshift completion SHELL` prints a script for the shell that knows the subcommands.
#[test]
fn completion_scripts_for_each_shell() {
    for (shell, marker) in [
        ("bash", "complete -F"),
        ("zsh", "#compdef keyshift"),
        ("fish", "complete -c keyshift"),
    ] {
        let out = keyshift(&["completion", shell], None);
        assert!(out.status.success(), "{shell}: {}", text(&out.stderr));
        let script = text(&out.stdout);
        assert!(script.contains(marker), "{shell}: {script}");
        for sub in [
            "plan",
            "keygroup",
            "local",
            "savepoint",
            "operator",
            "rewrite",
        ] {
            assert!(script.contains(sub), "{shell} script lacks {sub}");
        }
    }
    assert_eq!(
        keyshift(&["completion", "tcsh"], None).status.code(),
        Some(2)
    );
}

/// `-o yaml` is the document of `-o json`, as YAML: `plan` one document, `keygroup` one per key.
#[test]
fn yaml_output_of_plan_and_keygroup() {
    let plan = |o: &str| {
        let out = keyshift(
            &[
                "plan",
                "-p",
                "6",
                "--from-parallelism",
                "4",
                "-g",
                "128",
                "-o",
                o,
            ],
            None,
        );
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    let json: serde_json::Value = serde_json::from_str(&plan("json")).unwrap();
    let yaml: serde_json::Value = serde_yaml::from_str(&plan("yaml")).unwrap();
    assert_eq!(yaml, json);
    assert_eq!(yaml["rescale"]["toParallelism"], 6);

    let keys = "user-17\nuser-42\n\n";
    let run = |o: &str| {
        let out = keyshift(&["keygroup", "-g", "128", "-p", "4", "-o", o], Some(keys));
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    let json: Vec<serde_json::Value> = run("json")
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let yaml: Vec<serde_json::Value> = serde_yaml::Deserializer::from_str(&run("yaml"))
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect();
    assert_eq!(json.len(), 3);
    assert_eq!(yaml, json);
}

/// Every command users run shows examples under `--help` (and `-h`).
#[test]
fn help_shows_examples() {
    for args in [
        vec!["plan"],
        vec!["keygroup"],
        vec!["local"],
        vec!["operator"],
        vec!["completion"],
        vec!["savepoint"],
        vec!["savepoint", "list"],
        vec!["savepoint", "inspect"],
        vec!["savepoint", "verify"],
        vec!["savepoint", "dump"],
        vec!["savepoint", "rewrite"],
        vec!["savepoint", "dispose"],
    ] {
        for flag in ["--help", "-h"] {
            let out = keyshift(&[&args[..], &[flag]].concat(), None);
            assert!(out.status.success(), "{args:?} {flag}");
            let help = text(&out.stdout);
            let examples = help
                .split_once("Examples:")
                .map(|(_, e)| e)
                .unwrap_or_else(|| panic!("{args:?} {flag} has no examples:\n{help}"));
            let command = format!("keyshift {}", args.join(" "));
            let runs = examples
                .lines()
                .filter(|l| {
                    l.trim_start().starts_with(&command) || l.contains(&format!("| {command}"))
                })
                .count();
            assert!(
                runs >= 2,
                "{args:?} {flag}: {runs} examples of `{command}`:\n{examples}"
            );
        }
    }
}

/// A real HTTP server on loopback for `keyshift probe`: `/ok` answers 200, `/down` 503, and
/// `/later` 503 to its first two requests, then 200.
fn probe_server() -> String {
    use std::io::{BufRead, BufReader};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        let mut later = 0;
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().expect("clone"));
            let mut request = String::new();
            if reader.read_line(&mut request).is_err() {
                continue;
            }
            // Skip the headers.
            let mut line = String::new();
            while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
                line.clear();
            }
            let path = request.split_whitespace().nth(1).unwrap_or_default();
            let status = match path {
                "/ok" => "200 OK",
                "/later" => {
                    later += 1;
                    if later > 2 {
                        "200 OK"
                    } else {
                        "503 Service Unavailable"
                    }
                }
                _ => "503 Service Unavailable",
            };
            let _ = stream.write_all(
                format!("HTTP/1.1 {status}\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
                    .as_bytes(),
            );
        }
    });
    format!("http://{addr}")
}

#[test]
fn probe_passes_only_when_every_url_answers() {
    let base = probe_server();
    let ok = format!("{base}/ok");
    let later = format!("{base}/later");
    let out = keyshift(&["probe", &ok, &later, "--timeout", "20"], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains(&format!("{ok}: 200 OK")) && stdout.contains(&format!("{later}: 200 OK")),
        "{stdout}"
    );

    // One URL that keeps failing fails the probe, named with its status.
    let down = format!("{base}/down");
    let out = keyshift(&["probe", &ok, &down, "--timeout", "2"], None);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("not every target answered within 2 s")
            && stderr.contains(&format!("{down}: 503 Service Unavailable")),
        "{stderr}"
    );
    assert!(
        !stderr.contains(&format!("{ok}:")),
        "only failures are listed: {stderr}"
    );

    // Nothing listening.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr")
    };
    let url = format!("http://{closed}/readyz");
    let out = keyshift(&["probe", &url, "--timeout", "1"], None);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains(&url), "{}", text(&out.stderr));

    // A path without --service is refused before anything is dialled.
    let out = keyshift(&["probe", "/readyz", "--timeout", "1"], None);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("\"/readyz\" is not an http:// or https:// URL"),
        "{}",
        text(&out.stderr)
    );
}

/// The binary under kubectl's plugin names: `kubectl-keyshift ARGS` is `keyshift job ARGS`, and
/// `kubectl_complete-keyshift WORDS` answers in cobra's completion protocol. Without a cluster,
/// a job command fails with one line that says it found none.
#[test]
fn the_kubectl_plugin_names() {
    let dir = std::env::temp_dir().join(format!("keyshift-cli-plugin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let run = |name: &str, args: &[&str]| {
        let link = dir.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_keyshift"), &link).unwrap();
        Command::new(&link)
            .args(args)
            .env("KUBECONFIG", dir.join("no-such-kubeconfig"))
            .env_remove("KUBERNETES_SERVICE_HOST")
            .output()
            .unwrap()
    };
    let help = run("kubectl-keyshift", &["--help"]);
    assert!(help.status.success(), "{}", text(&help.stderr));
    let help = text(&help.stdout);
    assert!(
        help.contains("Usage: kubectl keyshift [OPTIONS] <COMMAND>"),
        "{help}"
    );
    for sub in [
        "status",
        "savepoint",
        "suspend",
        "resume",
        "scale",
        "plan",
        "version",
    ] {
        assert!(help.contains(sub), "plugin help lacks {sub}: {help}");
    }
    let complete = run("kubectl_complete-keyshift", &["s"]);
    assert!(complete.status.success());
    let complete = text(&complete.stdout);
    assert!(complete.starts_with("status\t"), "{complete}");
    assert!(complete.ends_with("\n:4\n"), "{complete}");
    let failed = run("kubectl-keyshift", &["status", "clicks"]);
    assert_eq!(failed.status.code(), Some(1));
    let stderr = text(&failed.stderr);
    assert!(
        stderr.starts_with("error: ") && stderr.contains("kubeconfig"),
        "{stderr}"
    );
    assert!(failed.stdout.is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}
