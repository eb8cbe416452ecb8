#!/usr/bin/env python3
"""Let a fresh clone reuse CI's build directory: source files keep the age of their content.

    hack/ci-source-times.py restore TARGET_DIR   # before the first cargo command
    hack/ci-source-times.py record TARGET_DIR    # after every test passed

Cargo decides whether a workspace crate is fresh by comparing its source files' modification
times with its last build. A fresh clone gives every file the time of the clone, so each CI run
rebuilt every crate of the workspace (and re-ran both clippy passes) even when nothing changed.
Cargo's content-hash freshness (`-Z checksum-freshness`) is not available on a stable toolchain.

`record` writes the Git blob id of every tracked file into TARGET_DIR after a CI run in which
every build and test passed (and only if no tracked file differs from HEAD), so every build unit in TARGET_DIR that CI uses was built from those
contents. `restore` reads that record and removes it at once (a run that fails or is killed
leaves no record, and the next run rebuilds from scratch as before); then every tracked file
whose content is the recorded one gets a modification time in the past, and every file that
changed, or is new, keeps the time of the clone, so cargo rebuilds exactly what depends on it.
If a cargo command line in the scripts that run cargo for CI changed (another feature set, a new
target), nothing is restored: a build unit the recorded run did not use may be older than the
record. Other edits of those scripts (the order of the tests) keep the restore.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

RECORD = "keyshift-ci-sources.json"
# 2001-01-01T00:00:00Z: older than any build in the directory.
PAST = 978307200
# Files whose cargo command lines decide which build units a CI run uses.
TOOLING = (".ci/run", "hack/test.sh", "hack/build-image.sh", "hack/testenv.sh", "hack/lab-test.sh")


def cargo_lines(text: str) -> list[str]:
    """The lines of a script that name cargo (its commands and their arguments), trimmed."""
    return sorted(
        line.strip()
        for line in text.splitlines()
        if "cargo " in line and not line.strip().startswith("#")
    )


def blob_text(blob: str | None) -> str | None:
    """A blob's text from this clone's object database (None when it is not there)."""
    if blob is None:
        return None
    out = subprocess.run(["git", "cat-file", "blob", blob], capture_output=True)
    return out.stdout.decode("utf-8", "replace") if out.returncode == 0 else None


def tooling_changed(before: dict[str, str], now: dict[str, str]) -> list[str]:
    """The tooling files whose cargo command lines differ from the recorded run's."""
    changed = []
    for path in TOOLING:
        if now.get(path) == before.get(path):
            continue
        old, new = blob_text(before.get(path)), blob_text(now.get(path))
        if old is None or new is None or cargo_lines(old) != cargo_lines(new):
            changed.append(path)
    return changed


def tracked() -> dict[str, str]:
    out = subprocess.run(
        ["git", "ls-files", "-s", "-z"], check=True, capture_output=True
    ).stdout.decode("utf-8", "surrogateescape")
    blobs = {}
    for entry in out.split("\0"):
        if not entry:
            continue
        meta, path = entry.split("\t", 1)
        mode, blob, _stage = meta.split()
        if mode.startswith("120"):  # a symlink: its target's time is its own
            continue
        blobs[path] = blob
    return blobs


def restore(target: Path) -> int:
    record = target / RECORD
    try:
        recorded = json.loads(record.read_text())
    except FileNotFoundError:
        print("ci-source-times: no record of a passing run in the build directory; cargo builds what it must")
        return 0
    except (OSError, ValueError) as e:
        print(f"ci-source-times: unreadable record ({e}); ignored")
        recorded = None
    record.unlink(missing_ok=True)
    if not isinstance(recorded, dict) or not isinstance(recorded.get("files"), dict):
        return 0
    before = recorded["files"]
    now = tracked()
    changed_tooling = tooling_changed(before, now)
    if changed_tooling:
        print(f"ci-source-times: the cargo commands of {', '.join(changed_tooling)} changed since the recorded run; every file keeps the time of the clone")
        return 0
    same = [p for p, blob in now.items() if before.get(p) == blob]
    for path in same:
        os.utime(path, (PAST, PAST), follow_symlinks=False)
    print(
        f"ci-source-times: {len(same)} of {len(now)} tracked files unchanged since the last passing run"
        f" ({recorded.get('commit', '?')[:12]}); {len(now) - len(same)} changed or new"
    )
    return 0


def record(target: Path) -> int:
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], check=True, capture_output=True, text=True
    ).stdout.strip()
    if dirty:
        # The build read contents that no blob id names; a later run could not tell them apart.
        print(f"ci-source-times: tracked files differ from HEAD, no record written:\n{dirty}")
        return 0
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    target.mkdir(parents=True, exist_ok=True)
    tmp = target / (RECORD + ".new")
    tmp.write_text(json.dumps({"commit": commit, "files": tracked()}))
    tmp.replace(target / RECORD)
    return 0


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] not in ("restore", "record"):
        print(__doc__, file=sys.stderr)
        return 2
    os.chdir(Path(__file__).resolve().parent.parent)
    target = Path(sys.argv[2])
    return restore(target) if sys.argv[1] == "restore" else record(target)


if __name__ == "__main__":
    sys.exit(main())
