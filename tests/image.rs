//! The image the tests run (`hack/build-image.sh`, imported into the test node by
//! `hack/testenv.sh up`) is the image the Dockerfile builds: the same files with the same modes,
//! the same ENTRYPOINT, USER and ENV. Run by `hack/test.sh` with the e2e suite
//! (`KEYSHIFT_IMAGE_TAR` names the tarball).

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// What an image says about itself: its files (path -> mode bits, `d` prefix for directories)
/// and its config.
#[derive(Debug, PartialEq, Eq)]
struct Layout {
    files: BTreeMap<String, String>,
    entrypoint: Vec<String>,
    user: String,
    env: Vec<String>,
}

/// The final stage of the Dockerfile: `ENV`, `USER` and `ENTRYPOINT` of the stage after the last
/// `FROM`, and the files the build stage puts in `/out/` (`install -D -m MODE SRC /out/PATH`,
/// `install -d -m MODE /out/PATH`), which the final stage copies to `/`.
fn dockerfile_layout(text: &str) -> Layout {
    let mut files = BTreeMap::new();
    // Joined continuation lines, so an `install` after `&& \` is one command.
    let joined = text.replace("\\\n", " ");
    for line in joined.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        for (i, w) in words.iter().enumerate() {
            if *w != "install" {
                continue;
            }
            let args = &words[i + 1..];
            let dir = args.first() == Some(&"-d");
            let mode = args
                .iter()
                .position(|a| *a == "-m")
                .and_then(|m| args.get(m + 1))
                .expect("install -m MODE");
            let dest = args
                .iter()
                .find(|a| a.starts_with("/out/"))
                .expect("install into /out/");
            let path = dest.trim_start_matches("/out/").to_owned();
            let mode = mode.trim_start_matches('0');
            files.insert(
                path,
                if dir {
                    format!("d{mode}")
                } else {
                    mode.to_owned()
                },
            );
        }
    }
    let lines: Vec<&str> = text.lines().collect();
    let last_from = lines
        .iter()
        .rposition(|l| l.starts_with("FROM "))
        .expect("a FROM line");
    let final_stage = &lines[last_from..];
    let directive = |name: &str| -> Vec<String> {
        final_stage
            .iter()
            .filter_map(|l| l.strip_prefix(name))
            .map(|rest| rest.trim().to_owned())
            .collect()
    };
    let entrypoint: Vec<String> = serde_json::from_str(
        directive("ENTRYPOINT ")
            .last()
            .expect("an ENTRYPOINT in exec form"),
    )
    .expect("ENTRYPOINT is a JSON array");
    Layout {
        files,
        entrypoint,
        user: directive("USER ").last().cloned().unwrap_or_default(),
        env: directive("ENV "),
    }
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("command runs");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

/// Mode bits of `ls -l`-style permissions (`-rwxr-xr-x` -> 755, `drwxrwxrwt` -> d1777).
fn mode_of(perms: &str) -> String {
    let b: Vec<char> = perms.chars().collect();
    assert_eq!(b.len(), 10, "permissions {perms:?}");
    let mut mode = 0u32;
    let mut special = 0u32;
    for (i, c) in b[1..].iter().enumerate() {
        let bit = 1 << (8 - i);
        match c {
            'r' | 'w' | 'x' => mode |= bit,
            's' => {
                mode |= bit;
                special |= if i == 2 { 4 } else { 2 };
            }
            't' => {
                mode |= bit;
                special |= 1;
            }
            'S' => special |= if i == 2 { 4 } else { 2 },
            'T' => special |= 1,
            _ => {}
        }
    }
    let octal = if special > 0 {
        format!("{special}{mode:03o}")
    } else {
        format!("{mode:o}")
    };
    if b[0] == 'd' {
        format!("d{octal}")
    } else {
        octal
    }
}

/// What the docker-archive tarball holds: its one layer's files and its config.
fn image_layout(tar: &Path) -> Layout {
    let tarball = tar.to_str().expect("utf-8 path");
    let manifest: serde_json::Value = serde_json::from_str(&run(Command::new("tar").args([
        "-xOf",
        tarball,
        "manifest.json",
    ])))
    .expect("manifest.json");
    let entry = &manifest[0];
    let config_name = entry["Config"].as_str().expect("Config");
    let layers = entry["Layers"].as_array().expect("Layers");
    assert_eq!(layers.len(), 1, "one layer: {manifest}");
    let config: serde_json::Value = serde_json::from_str(&run(Command::new("tar").args([
        "-xOf",
        tarball,
        config_name,
    ])))
    .expect("image config");
    let layer = layers[0].as_str().expect("layer name");
    let dir = tempfile::tempdir().expect("temp dir");
    run(Command::new("tar")
        .args(["-xf", tarball, "-C"])
        .arg(dir.path())
        .arg(layer));
    let listing = run(Command::new("tar")
        .args(["--numeric-owner", "-tvf"])
        .arg(dir.path().join(layer)));
    let mut files = BTreeMap::new();
    for line in listing.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let (perms, owner, path) = (words[0], words[1], words[words.len() - 1]);
        assert_eq!(owner, "0/0", "files are root's, read by UID 65532: {line}");
        let path = path.trim_end_matches('/');
        // Parent directories the Dockerfile creates implicitly (install -D).
        if perms.starts_with('d') && path != "tmp" {
            continue;
        }
        files.insert(path.to_owned(), mode_of(perms));
    }
    let c = &config["config"];
    let strings = |v: &serde_json::Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    Layout {
        files,
        entrypoint: strings(&c["Entrypoint"]),
        user: c["User"].as_str().unwrap_or_default().to_owned(),
        env: strings(&c["Env"]),
    }
}

#[test]
fn the_dockerfile_layout_is_read_from_its_final_stage() {
    let layout = dockerfile_layout(
        &std::fs::read_to_string(support::root().join("Dockerfile")).expect("Dockerfile"),
    );
    assert_eq!(layout.entrypoint, ["/keyshift"]);
    assert_eq!(layout.user, "65532:65532");
    assert_eq!(
        layout.files.get("keyshift").map(String::as_str),
        Some("755")
    );
    assert_eq!(layout.files.get("tmp").map(String::as_str), Some("d1777"));
    assert_eq!(mode_of("-rwxr-xr-x"), "755");
    assert_eq!(mode_of("drwxrwxrwt"), "d1777");
    assert_eq!(mode_of("-rw-r--r--"), "644");
}

/// The tarball `var` names (hack/testenv.sh up writes it into its env file) against the final
/// stage of `dockerfile` (relative to the repository root).
fn assert_image_is_dockerfile_image(var: &str, dockerfile: &str) {
    let tar = std::env::var_os(var)
        .unwrap_or_else(|| panic!("{var} (hack/testenv.sh up prints it into its env file)"));
    let want = dockerfile_layout(
        &std::fs::read_to_string(support::root().join(dockerfile)).expect("Dockerfile"),
    );
    let got = image_layout(Path::new(&tar));
    assert_eq!(
        got, want,
        "hack/build-image.sh and {dockerfile}'s final stage disagree"
    );
}

#[test]
#[ignore = "needs the image tarball (hack/test.sh builds it; KEYSHIFT_IMAGE_TAR)"]
fn the_tested_image_is_the_dockerfile_image() {
    assert_image_is_dockerfile_image("KEYSHIFT_IMAGE_TAR", "Dockerfile");
}

/// The job template's image, which the e2e tier runs as a user's own job image.
#[test]
#[ignore = "needs the image tarball (hack/test.sh builds it; KEYSHIFT_JOB_IMAGE_TAR)"]
fn the_tested_job_image_is_the_templates_dockerfile_image() {
    assert_image_is_dockerfile_image(
        "KEYSHIFT_JOB_IMAGE_TAR",
        "crates/keyshift-job-template/Dockerfile",
    );
}

/// The `--features` of a `cargo build` command in `text` (continuation lines joined), in order.
fn build_features(text: &str) -> Vec<String> {
    let joined = text.replace("\\\n", " ");
    let line = joined
        .lines()
        .find(|l| l.contains("cargo build"))
        .expect("a cargo build command");
    let words: Vec<&str> = line.split_whitespace().collect();
    let mut features: Vec<String> = words
        .windows(2)
        .filter(|w| w[0] == "--features")
        .flat_map(|w| w[1].split(','))
        .map(str::to_owned)
        .collect();
    features.sort();
    features
}

/// The binaries of the images the tests run and the Dockerfiles' are built with the same cargo
/// features (the Kafka client included), against static OpenSSL and zlib in both: keyshift's
/// (the script's `keyshift/` features) and the job template's (its `keyshift-job-template/`
/// features).
#[test]
fn the_dockerfile_and_the_test_image_build_the_same_features() {
    let root = support::root();
    let read = |p: &str| std::fs::read_to_string(root.join(p)).expect(p);
    let dockerfile = read("Dockerfile");
    let template = read("crates/keyshift-job-template/Dockerfile");
    let script = read("hack/build-image.sh");
    let test = build_features(&script);
    let of = |package: &str| -> Vec<String> {
        test.iter()
            .filter_map(|f| f.strip_prefix(package))
            .map(str::to_owned)
            .collect()
    };
    let (product, job) = (of("keyshift/"), of("keyshift-job-template/"));
    assert_eq!(
        build_features(&dockerfile),
        product,
        "Dockerfile vs hack/build-image.sh"
    );
    assert_eq!(
        build_features(&template),
        job,
        "the template's Dockerfile vs hack/build-image.sh"
    );
    assert!(product.contains(&"kafka".to_owned()), "{product:?}");
    assert!(job.contains(&"kafka".to_owned()), "{job:?}");
    for text in [&dockerfile, &template, &script] {
        assert!(text.contains("OPENSSL_STATIC=1") && text.contains("LIBZ_SYS_STATIC=1"));
    }
}
