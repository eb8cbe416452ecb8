#!/usr/bin/env bash
# The operator benchmarks (docs/benchmarks.md, "Operator: ..."): brings up a test control plane
# of its own (hack/testenv.sh: control plane and a real node running this checkout's image), runs `keyshift bench operator jobs`
# and/or `keyshift bench operator rescale` (src/bench/operator.rs) from a release build with
# `--features bench` (the product build has no bench commands) against it, and tears it down on
# exit.
#
#   hack/bench-operator.sh                  # both, default sizes (500 jobs; 256 MiB, 4 -> 8)
#   hack/bench-operator.sh jobs [ARGS...]   # e.g. --jobs 1000 --idle-seconds 120
#   hack/bench-operator.sh rescale [ARGS...] # e.g. --state-mib 1024 --from 2 --to 4
#
# Results go to stdout (Markdown tables at the end of each part). Needs root (network
# namespace), like hack/test.sh. The environment's names default to ones of its own so it runs
# beside `hack/test.sh` (which uses the testenv defaults); override with the usual variables:
# KEYSHIFT_SUBNET (215), KEYSHIFT_NETNS (keyshift-bench), KEYSHIFT_VETH_HOST (ksbench0),
# KEYSHIFT_TESTENV_DIR (a fresh /tmp/keyshift-bench-env.XXXXXX). The build goes to
# $CARGO_TARGET_DIR (default ./target); KEYSHIFT_BENCH_BIN=/path/to/keyshift runs another build
# of keyshift (e.g. an older commit's, for a before/after comparison; one with the bench
# commands) as driver and operator.
set -euo pipefail
cd "$(dirname "$0")/.."

what="${1:-all}"
[[ $# -gt 0 ]] && shift
case "$what" in
  all | jobs | rescale) ;;
  *) echo "usage: $0 [all|jobs|rescale] [ARGS for keyshift bench operator ...]" >&2; exit 2 ;;
esac
if [[ "$what" == all && $# -gt 0 ]]; then
  echo "$0: extra arguments need 'jobs' or 'rescale' first" >&2
  exit 2
fi

step() { printf '\n==> %s\n' "$*" >&2; }

export KEYSHIFT_SUBNET="${KEYSHIFT_SUBNET:-215}"
export KEYSHIFT_NETNS="${KEYSHIFT_NETNS:-keyshift-bench}"
export KEYSHIFT_VETH_HOST="${KEYSHIFT_VETH_HOST:-ksbench0}"

step "cargo build --release --features bench (keyshift)"
cargo build --locked --release --features bench --bin keyshift
TARGET="${CARGO_TARGET_DIR:-$PWD/target}"
BIN="${KEYSHIFT_BENCH_BIN:-$TARGET/release/keyshift}"

export KEYSHIFT_TESTENV_DIR="${KEYSHIFT_TESTENV_DIR:-$(mktemp -d /tmp/keyshift-bench-env.XXXXXX)}"
cleanup() {
  local rc=$?
  step "testenv down"
  hack/testenv.sh down || rc=1
  if pgrep -f "$KEYSHIFT_TESTENV_DIR" >/dev/null; then
    echo "leftover processes:" >&2; pgrep -af "$KEYSHIFT_TESTENV_DIR" >&2; rc=1
  fi
  exit $rc
}
trap cleanup EXIT

step "testenv up (subnet 10.$KEYSHIFT_SUBNET.0.0/16, netns $KEYSHIFT_NETNS, state $KEYSHIFT_TESTENV_DIR)"
testenv_env="$(hack/testenv.sh up)"
# KUBECONFIG, and KEYSHIFT_IMAGE: the operator starts workers from this checkout's image
# (with KEYSHIFT_BENCH_BIN, the operator is that build, its workers still this checkout's).
eval "$testenv_env"
# kubectl's discovery cache of this control plane only.
export KUBECACHEDIR="$KEYSHIFT_TESTENV_DIR/kubectl-cache"

echo "machine: $(nproc) cpus, load average $(cut -d' ' -f1-3 /proc/loadavg), commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo '+dirty')"
if [[ "$what" == all || "$what" == jobs ]]; then
  step "keyshift bench operator jobs $*"
  "$BIN" bench operator jobs "$@"
fi
if [[ "$what" == all || "$what" == rescale ]]; then
  step "keyshift bench operator rescale $*"
  "$BIN" bench operator rescale "$@"
fi
echo "machine at the end: load average $(cut -d' ' -f1-3 /proc/loadavg)"
