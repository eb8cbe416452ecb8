#!/usr/bin/env python3
"""The test executables of a `cargo test --no-run --message-format=json...` build, one per line.

    cargo test --no-run --message-format=json-render-diagnostics ... | hack/test-binaries.py > list

Each line: `TARGET<TAB>EXECUTABLE<TAB>PACKAGE_DIR`, where TARGET is the test target's name for
integration tests (`tests/NAME.rs`) and `unit:CRATE` / `bin:NAME` for the unit tests of a
library or binary. hack/test.sh runs these executables itself, several at once, from
PACKAGE_DIR with `CARGO_MANIFEST_DIR` set, as `cargo test` would.
"""

import json
import sys
from pathlib import Path


def main() -> int:
    seen = set()
    for line in sys.stdin:
        line = line.strip()
        if not line.startswith("{"):
            continue
        msg = json.loads(line)
        if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
            continue
        if not msg.get("profile", {}).get("test"):
            continue
        target = msg["target"]
        kinds = target["kind"]
        name = target["name"]
        if "test" in kinds:
            label = name
        elif "bin" in kinds:
            label = f"bin:{name}"
        else:
            label = f"unit:{name}"
        if label in seen:
            print(f"test-binaries: two executables for {label}", file=sys.stderr)
            return 1
        seen.add(label)
        package_dir = Path(msg["manifest_path"]).parent
        print(f"{label}\t{msg['executable']}\t{package_dir}")
    if not seen:
        print("test-binaries: no test executables in cargo's output", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
