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
trap 'hack/s3-server.sh stop' EXIT

step "cargo test"
cargo test --locked
