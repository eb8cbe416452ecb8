#!/usr/bin/env bash
# Build times of two commits, measured in the same run and alternating (docs/benchmarks.md, "Build
# times of the workspace"): a cold `cargo build --bin keyshift`, a cold
# `cargo test --workspace --all-features --no-run`, and the rebuild after touching one runtime file
# and one operator file (twice each). Each commit builds in a git worktree of this repository with a
# fresh CARGO_TARGET_DIR (two at a time, under $BENCH_BUILD_DIR, removed at the end).
#
#   hack/bench-build.sh BEFORE_REV BEFORE_RUNTIME_FILE AFTER_REV AFTER_RUNTIME_FILE [OPERATOR_FILE]
#
# e.g. hack/bench-build.sh c173c46 src/runtime/worker.rs HEAD \
#        crates/keyshift-runtime/src/runtime/worker/operator.rs src/operator/controller.rs
set -euo pipefail
if (($# < 4)); then
  sed -n '2,11p' "$0" >&2
  exit 2
fi
repo="$(cd "$(dirname "$0")/.." && pwd)"
declare -A rev=([before]="$1" [after]="$3") runtime=([before]="$2" [after]="$4")
operator="${5:-src/operator/controller.rs}"
dir="${BENCH_BUILD_DIR:-$(mktemp -d /tmp/keyshift-bench-build.XXXXXX)}"
cleanup() {
  for w in before after; do git -C "$repo" worktree remove --force "$dir/$w" 2>/dev/null || true; done
  rm -rf -- "$dir"
}
trap cleanup EXIT
for w in before after; do
  git -C "$repo" worktree add -q --detach "$dir/$w" "${rev[$w]}"
done

# timed LABEL WHICH CMD...: prints "LABEL WHICH seconds".
timed() {
  local label="$1" w="$2" start end
  shift 2
  start=$(date +%s.%N)
  (cd "$dir/$w" && CARGO_TARGET_DIR="$dir/target-$w" "$@" --locked -q >/dev/null)
  end=$(date +%s.%N)
  printf '%s %s %.1f\n' "$label" "$w" "$(echo "$end - $start" | bc)"
}
fresh() { rm -rf -- "$dir/target-before" "$dir/target-after"; }

echo "machine: $(nproc) cpus, load $(cut -d' ' -f1-3 /proc/loadavg); before ${rev[before]} ($(git -C "$repo" rev-parse --short "${rev[before]}")), after ${rev[after]} ($(git -C "$repo" rev-parse --short "${rev[after]}"))"
fresh
timed cold-binary after cargo build --bin keyshift
timed cold-binary before cargo build --bin keyshift
for round in 1 2; do
  for w in after before; do
    echo "// touched by hack/bench-build.sh" >>"$dir/$w/${runtime[$w]}"
    timed "rebuild-runtime-file-$round" "$w" cargo build --bin keyshift
    git -C "$dir/$w" checkout -q -- "${runtime[$w]}"
    timed "rebuild-reverted-$round" "$w" cargo build --bin keyshift >/dev/null
    echo "// touched by hack/bench-build.sh" >>"$dir/$w/$operator"
    timed "rebuild-operator-file-$round" "$w" cargo build --bin keyshift
    git -C "$dir/$w" checkout -q -- "$operator"
    timed "rebuild-reverted-$round" "$w" cargo build --bin keyshift >/dev/null
  done
done
fresh
timed cold-tests before cargo test --workspace --all-features --no-run
timed cold-tests after cargo test --workspace --all-features --no-run
