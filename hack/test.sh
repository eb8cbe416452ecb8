#!/usr/bin/env bash
# The whole test suite: formatting, lints, unit/property/integration tests, and the end-to-end
# suite against a real kube-apiserver + etcd (built from source by hack/ on first use).
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> [%s, %ss in] %s\n' "$(date +%T)" "$SECONDS" "$*" >&2; }

# Prometheus' reference parser checks the metrics endpoints (tests/metrics_exposition.rs and the
# e2e tests, through tests/monitoring/check_exposition.py).
python3 -c 'import prometheus_client' 2>/dev/null || python3 -m pip install --quiet 'prometheus_client>=0.20'
# PyYAML reads values.yaml for the chart README's values table (hack/chart-values-table.py).
python3 -c 'import yaml' 2>/dev/null || python3 -m pip install --quiet 'PyYAML>=6'
# The `kafka` feature builds librdkafka from source against OpenSSL and zlib (their headers and
# pkg-config), and hack/kafka.sh resolves the broker's jars with Maven and runs them on Java 17+.
missing_debs=()
for deb in libssl-dev zlib1g-dev pkg-config maven; do
  dpkg -s "$deb" >/dev/null 2>&1 || missing_debs+=("$deb")
done
if ((${#missing_debs[@]})); then
  apt-get update -qq && apt-get install -y -qq "${missing_debs[@]}" >/dev/null
fi
# Helm for the chart checks (tests/chart.rs) and the e2e suite; cached after the first run.
KEYSHIFT_HELM="$(hack/get-helm.sh)"
export KEYSHIFT_HELM="${KEYSHIFT_HELM#HELM=}"
# The GitOps health tool (hack/gitops-health: kstatus from sigs.k8s.io/cli-utils, the Argo CD
# health check docs/gitops/streamjob-health.lua in gopher-lua), built from its pinned Go modules and
# cached by source hash: tests/gitops.rs runs it on StreamJob documents our status code wrote, and
# the e2e step on live jobs (e2e_operator's gitops_health_* test).
KEYSHIFT_GITOPS_HEALTH="$(hack/build-gitops-health.sh)"
export KEYSHIFT_GITOPS_HEALTH="${KEYSHIFT_GITOPS_HEALTH#GITOPS_HEALTH=}"

# The Go binaries (promtool and the monitoring checker first, then the cluster's: control plane,
# kubelet, containerd, runc, CNI, crictl) build in the
# background while the Rust tiers run, so on a fresh machine their module downloads and the idle
# core of cargo's serial phases overlap; `testenv up` waits for them (the build scripts take a
# lock and find their cache). On a warm machine both finish in about a second.
PREBUILD_LOG="$(mktemp /tmp/keyshift-prebuild.XXXXXX)"
setsid bash -c 'hack/build-promtool.sh >/dev/null && hack/build-control-plane.sh >/dev/null && hack/build-node.sh >/dev/null' \
  >"$PREBUILD_LOG" 2>&1 </dev/null &
PREBUILD_PID=$!
prebuild_stop() {
  kill -TERM -- "-$PREBUILD_PID" 2>/dev/null || true
  rm -f -- "$PREBUILD_LOG"
}
trap prebuild_stop EXIT

step "cargo fmt --check"
cargo fmt --all -- --check

# Both feature sets (Cargo.toml [features]): all of them covers every line; the default one is
# the product build, where code left behind by a gated-out feature (an unused import or helper)
# fails. The second pass re-checks only the workspace's crates (dependencies have the same features).
step "cargo clippy --workspace --all-targets --all-features -D warnings"
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings
step "cargo clippy --workspace --all-targets -D warnings (default features: the product build)"
cargo clippy --workspace --all-targets --locked -- -D warnings

# The layers (docs/architecture.md, "1. The parts"): the crates below the product build with no
# Kubernetes client, and the core with no I/O runtime. The compiler keeps the crates from importing
# upward; this keeps their dependency lists honest.
step "layers: what keyshift-core and keyshift-runtime may depend on (cargo tree), and no module cycles"
layer_check() {
  local crate="$1" forbidden="$2" found
  found="$(cargo tree --locked -p "$crate" -e normal --all-features --prefix none \
    | awk '{print $1}' | sort -u | grep -E -x "$forbidden" || true)"
  if [[ -n "$found" ]]; then
    echo "$crate depends on $(echo "$found" | tr '\n' ' ')(allowed nowhere below the product crate)" >&2
    return 1
  fi
}
layer_check keyshift-runtime 'kube|kube-client|kube-runtime|kube-core|k8s-openapi|clap'
layer_check keyshift-core 'kube|kube-client|kube-runtime|kube-core|k8s-openapi|tokio|object_store|axum|reqwest|rdkafka'
# And inside each crate, no modules that import each other (hack/module-cycles.py reads the
# imports; the tree before the workspace had one cycle through 27 modules).
python3 hack/module-cycles.py src crates/keyshift-runtime/src crates/keyshift-core/src

step "helm lint --strict (default values and each charts/keyshift/ci/*.yaml)"
"$KEYSHIFT_HELM" lint --strict charts/keyshift
for values in charts/keyshift/ci/*.yaml; do
  "$KEYSHIFT_HELM" lint --strict charts/keyshift -f "$values"
done

# The chart README's values table is generated from values.yaml and values.schema.json; this
# fails when it is stale (naming the command that regenerates it) or a schema key has no
# description.
step "chart README values table up to date (hack/chart-values-table.py --check)"
python3 hack/chart-values-table.py --check

step "S3 test server (moto) for the snapshot tests"
# A state dir of this run's own (unless given), so concurrent runs from other checkouts neither
# reuse nor stop each other's server.
S3_STATE_OWNED=""
if [[ -z "${KEYSHIFT_S3_STATE:-}" ]]; then
  KEYSHIFT_S3_STATE="$(mktemp -d /tmp/keyshift-s3.XXXXXX)"
  S3_STATE_OWNED=1
fi
export KEYSHIFT_S3_STATE
s3_stop() {
  hack/s3-server.sh stop || return 1
  if [[ -n "$S3_STATE_OWNED" ]]; then rm -rf -- "$KEYSHIFT_S3_STATE"; fi
}
trap 's3_stop || true; prebuild_stop' EXIT
eval "$(hack/s3-server.sh start)"

step "Kafka broker (hack/kafka.sh: Apache Kafka, KRaft, one node) for tests/kafka_local.rs"
# Its own state dir too; the tests restart it mid-run through hack/kafka.sh (KEYSHIFT_KAFKA_STATE).
KAFKA_STATE_OWNED=""
if [[ -z "${KEYSHIFT_KAFKA_STATE:-}" ]]; then
  KEYSHIFT_KAFKA_STATE="$(mktemp -d /tmp/keyshift-kafka.XXXXXX)"
  KAFKA_STATE_OWNED=1
fi
export KEYSHIFT_KAFKA_STATE
# A second listener for the test cluster's pods (tests/e2e_operator.rs), advertised at the host's
# side of the testenv's veth: hack/testenv.sh's HOST_IP, 10.$KEYSHIFT_SUBNET.0.1 (default 213).
export KEYSHIFT_KAFKA_POD_HOST="10.${KEYSHIFT_SUBNET:-213}.0.1"
kafka_stop() {
  hack/kafka.sh stop || return 1
  if [[ -n "$KAFKA_STATE_OWNED" ]]; then rm -rf -- "$KEYSHIFT_KAFKA_STATE"; fi
}
trap 'kafka_stop || true; s3_stop || true; prebuild_stop' EXIT
kafka_env="$(hack/kafka.sh start)"
eval "$kafka_env"

# Includes tests/chart.rs: `helm template` with default and CI values, checked for the RBAC
# contract (no wildcards, Roles only in namespaced mode), restricted pod security, refused values
# and the chart's CRD being crds/streamjob.yaml. With all features: the benchmarks' own tests
# run, and the e2e tier below reuses this build (its operator needs the test hooks).
# Also the documentation checks: tests/pictures.rs (the committed pictures under docs/ are what
# src/pictures/ draws from docs/data/), tests/docs_images.rs (every picture parses, has a title
# and shapes and is shown; every shown image exists), tests/docs_reasons.rs (docs/troubleshooting.md
# lists exactly the condition types and reasons of the code).
step "cargo test --workspace --all-features"
cargo test --workspace --locked --all-features

# The product binary (no features): tests/cli.rs checks it refuses the bench and test-only
# commands (the run above checked that the features' build has them).
step "cargo test --test cli (default features: the product binary)"
cargo test --locked --test cli

# The chart's monitoring objects with Prometheus' own tools, built from the Prometheus Go module
# (hack/build-promtool.sh; the background build above has usually finished it): the dashboard's
# JSON and every PromQL expression in it and in the alerts parse, use only metrics keyshift
# exposes (tests/monitoring/metric-names.txt, checked against the code by the cargo tests above),
# `promtool check rules`, and `promtool test rules` proving each alert fires on its condition and
# not on healthy series.
step "chart monitoring: dashboard and alerts (hack/check-monitoring.sh: promtool)"
hack/check-monitoring.sh

# The key-group lab (docs/lab/) in headless Chromium (installed from Debian when missing): its
# numbers against Flink's vectors and `keyshift plan -o json` (the binary just built), its buttons,
# no console errors.
step "browser test of docs/lab (hack/lab-test.sh)"
hack/lab-test.sh

# ---- end to end: a real cluster -- etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler and a real node (kubelet, containerd, runc, CNI), all built from their upstream
# Go modules by hack/build-control-plane.sh and hack/build-node.sh on first use -- running the
# keyshift image built from this checkout (hack/build-image.sh: the product build, with the Kafka
# client). tests/e2e_kafka.rs runs a Kafka job there against the broker started above (its pods'
# listener).
# The operator under test is a host process, `CARGO_BIN_EXE_keyshift` of the e2e tier's own
# (all-features) build.
export KEYSHIFT_TESTENV_DIR="${KEYSHIFT_TESTENV_DIR:-$(mktemp -d /tmp/keyshift-e2e.XXXXXX)}"

cleanup() {
  local rc=$?
  prebuild_stop
  kafka_stop || rc=1
  s3_stop || rc=1
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
# The background build's outcome: testenv up builds whatever is still missing, with its errors.
if ! wait "$PREBUILD_PID"; then
  echo "background build of the cluster binaries failed (testenv up retries it):" >&2
  tail -n 20 "$PREBUILD_LOG" >&2 || true
fi
# Assigned first: `eval "$(...)"` alone would not stop the suite when `up` fails.
testenv_env="$(hack/testenv.sh up)"
eval "$testenv_env"
# Everything the tests read about the environment (node, containerd, image tarball, subnet).
# shellcheck disable=SC1091
source "$KEYSHIFT_TESTENV_DIR/env"

step "e2e tests"
cargo test --locked --all-features --test image --test e2e_cluster --test e2e_helm --test e2e_leader --test e2e_operator --test e2e_kafka -- --ignored --test-threads=4 --skip scale_past_the_ceiling
# The 200-pod ceiling scenario alone: beside the other tests it loaded the 2-core node so far (load
# average 100) that the kubelet took minutes to terminate pods and three tests timed out waiting.
step "e2e: the 200-pod ceiling scenario"
cargo test --locked --all-features --test e2e_operator -- --ignored scale_past_the_ceiling
