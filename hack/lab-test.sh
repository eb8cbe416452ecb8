#!/usr/bin/env bash
# The browser test of the key-group lab (docs/lab/index.html): headless Chromium opens the page
# from file:// and tests/lab/lab-test.mjs drives it over the DevTools protocol (Node's standard
# library only, no npm packages): the ranges and moves shown for known inputs, every Flink vector
# of tests/data/flink_vectors.json through the page's key-group math, plans against
# `keyshift plan -o json`, the orbit toy's buttons, and no console error or request off file://.
# Closes with "lab: N passed, M failed"; exits non-zero when a check failed.
#
#   hack/lab-test.sh [--screenshot FILE.png]
#
# KEYSHIFT_BIN: the keyshift binary to compare with (default: `cargo build --bin keyshift`'s).
# KEYSHIFT_CHROMIUM: the browser (default /usr/bin/chromium, Debian's package, installed when
# missing: apt-get needs root, as CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."

CHROMIUM="${KEYSHIFT_CHROMIUM:-/usr/bin/chromium}"
if [[ ! -x "$CHROMIUM" && "$CHROMIUM" == /usr/bin/chromium ]]; then
  echo "lab test: installing Debian's chromium" >&2
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >&2
fi
if ! command -v node >/dev/null; then
  echo "lab test: installing Debian's nodejs" >&2
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs >&2
fi

if [[ -z "${KEYSHIFT_BIN:-}" ]]; then
  cargo build --locked --quiet --bin keyshift
  target_dir="$(cargo metadata --format-version 1 --no-deps --locked |
    node -e 'let s = ""; process.stdin.on("data", (d) => (s += d)).on("end", () => console.log(JSON.parse(s).target_directory))')"
  KEYSHIFT_BIN="$target_dir/debug/keyshift"
fi

exec node tests/lab/lab-test.mjs --chromium "$CHROMIUM" --keyshift "$KEYSHIFT_BIN" "$@"
