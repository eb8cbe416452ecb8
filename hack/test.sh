#!/usr/bin/env bash
# The whole test suite: formatting, lints, unit/property/integration tests, and the end-to-end
# suite against a real kube-apiserver + etcd (built from source by hack/ on first use).
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*" >&2; }

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy --all-targets -D warnings"
cargo clippy --all-targets --locked -- -D warnings

step "S3 test server (moto) for the snapshot tests"
eval "$(hack/s3-server.sh start)"
trap 'hack/s3-server.sh stop || true' EXIT

step "cargo test"
cargo test --locked

# ---- end to end: a real control plane (etcd, kube-apiserver, kube-controller-manager built from
# source by hack/build-control-plane.sh on first use) and our process kubelet.
step "cargo build --bins"
cargo build --locked --bins
TARGET="${CARGO_TARGET_DIR:-$PWD/target}"
export KEYSHIFT_KUBELET="$TARGET/debug/keyshift-kubelet"
export KEYSHIFT_TESTENV_DIR="${KEYSHIFT_TESTENV_DIR:-$(mktemp -d /tmp/keyshift-e2e.XXXXXX)}"

cleanup() {
  local rc=$?
  hack/s3-server.sh stop || rc=1
  step "testenv down"
  hack/testenv.sh down || rc=1
  # Nothing may outlive the suite.
  if pgrep -f "$KEYSHIFT_TESTENV_DIR" >/dev/null; then
    echo "leftover processes:" >&2; pgrep -af "$KEYSHIFT_TESTENV_DIR" >&2; rc=1
  fi
  if [[ -e "$KEYSHIFT_TESTENV_DIR" ]]; then
    echo "leftover directory $KEYSHIFT_TESTENV_DIR" >&2; rc=1
  fi
  exit $rc
}
trap cleanup EXIT

step "testenv up"
eval "$(hack/testenv.sh up)"

step "e2e tests"
cargo test --locked --test e2e_cluster --test e2e_operator -- --ignored --test-threads=4
