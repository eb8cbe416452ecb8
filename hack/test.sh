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

# The cluster for the e2e tier comes up in the background while the quick checks and the test build run
# (README, "How the suite spends its time"): hack/testenv.sh up builds the Go binaries of the
# control plane and the node from their pinned modules (cached after the first run), the image
# (the static release build: its own target triple, so it never waits for the debug build's
# lock), and starts the cluster. promtool first, for the monitoring check. On a fresh machine the
# Go module downloads and builds overlap the idle core of cargo's serial phases.
export KEYSHIFT_TESTENV_DIR="${KEYSHIFT_TESTENV_DIR:-$(mktemp -d /tmp/keyshift-e2e.XXXXXX)}"
LANES_DIR="$(mktemp -d /tmp/keyshift-lanes.XXXXXX)"
# Its exit status lands in testenv.rc whole (written aside, then renamed), so a reader never sees
# the file before it holds the status.
setsid bash -c 'hack/build-promtool.sh >/dev/null && hack/testenv.sh up >"$1/testenv.env"
  echo $? >"$1/testenv.rc.new" && mv "$1/testenv.rc.new" "$1/testenv.rc"' \
  testenv-up "$LANES_DIR" >"$LANES_DIR/testenv.log" 2>&1 </dev/null &
TESTENV_UP_PID=$!

# What the suite starts, each stopped by the one exit trap (a stop for a server not started yet
# is a no-op): the background `testenv up` and its cluster, the S3 servers, the Kafka broker.
S3_STATES_OWNED=()
s3_stop() {
  local rc=0 state
  for state in "${S3_STATES[@]}"; do
    KEYSHIFT_S3_STATE="$state" hack/s3-server.sh stop || rc=1
  done
  if ((${#S3_STATES_OWNED[@]})); then rm -rf -- "${S3_STATES_OWNED[@]}"; fi
  return $rc
}
S3_STATES=()
# The GCS and Azure Blob test servers start in the background (a first run builds fake-gcs-server
# from its Go module and installs Azurite from npm); each one's starter is a process group of its
# own, stopped first, and the server then by its state dir.
BLOB_SERVERS=(gcs azure)
BLOB_STARTERS=()
blob_stop() {
  local rc=0 name pid
  for pid in "${BLOB_STARTERS[@]}"; do
    kill -TERM -- "-$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  for name in "${BLOB_SERVERS[@]}"; do
    local state_var="KEYSHIFT_${name^^}_STATE"
    [[ -n "${!state_var:-}" ]] || continue
    hack/$name-server.sh stop || rc=1
    rm -rf -- "${!state_var}"
  done
  return $rc
}
KAFKA_STARTED=""
KAFKA_STATE_OWNED=""
kafka_stop() {
  [[ -n "$KAFKA_STARTED" ]] || return 0
  hack/kafka.sh stop || return 1
  if [[ -n "$KAFKA_STATE_OWNED" ]]; then rm -rf -- "$KEYSHIFT_KAFKA_STATE"; fi
}
testenv_stop() {
  # A background `up` still running is stopped first; `down` then removes whatever it started.
  kill -TERM -- "-$TESTENV_UP_PID" 2>/dev/null || true
  wait "$TESTENV_UP_PID" 2>/dev/null || true
  step "testenv down"
  hack/testenv.sh down
}
cleanup() {
  local rc=$?
  kafka_stop || rc=1
  s3_stop || rc=1
  blob_stop || rc=1
  testenv_stop || rc=1
  # Nothing may outlive the suite.
  if pgrep -f "$KEYSHIFT_TESTENV_DIR" >/dev/null; then
    echo "leftover processes:" >&2; pgrep -af "$KEYSHIFT_TESTENV_DIR" >&2; rc=1
  fi
  if [[ -e "$KEYSHIFT_TESTENV_DIR" ]]; then
    echo "leftover directory $KEYSHIFT_TESTENV_DIR" >&2; rc=1
  fi
  rm -rf -- "$LANES_DIR"
  exit $rc
}
trap cleanup EXIT

step "cargo fmt --check"
cargo fmt --all -- --check

# The layers (docs/architecture.md, "1. The parts"): the crates below the product build with no
# Kubernetes client, and the core with no I/O runtime. The compiler keeps the crates from importing
# upward; this keeps their dependency lists honest.
step "layers: what keyshift-core, keyshift-sdk and keyshift-runtime may depend on (cargo tree), and no module cycles"
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
# The SDK a job author depends on: pure like the core (its I/O is the runtime's).
layer_check keyshift-sdk 'kube|kube-client|kube-runtime|kube-core|k8s-openapi|tokio|object_store|axum|reqwest|rdkafka|keyshift-runtime|keyshift'
# And inside each crate, no modules that import each other (hack/module-cycles.py reads the
# imports; the tree before the workspace had one cycle through 27 modules).
python3 hack/module-cycles.py src crates/keyshift-runtime/src crates/keyshift-core/src crates/keyshift-sdk/src crates/keyshift-examples/src

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

step "S3 test servers (moto): one for the e2e operator suite, one for everything else"
# Each test server with a state dir of this run's own (unless given), so concurrent runs from other
# checkouts neither reuse nor stop each other's server. Two of them: tests/e2e_operator.rs pauses
# its server (an outage the operator must ride out), and the suites that run beside it must not
# see that outage. KEYSHIFT_S3_STATE is the e2e operator suite's (its Paused::s3 reads the pid).
if [[ -z "${KEYSHIFT_S3_STATE:-}" ]]; then
  KEYSHIFT_S3_STATE="$(mktemp -d /tmp/keyshift-s3.XXXXXX)"
  S3_STATES_OWNED+=("$KEYSHIFT_S3_STATE")
fi
export KEYSHIFT_S3_STATE
S3_OTHERS_STATE="$(mktemp -d /tmp/keyshift-s3.XXXXXX)"
S3_STATES_OWNED+=("$S3_OTHERS_STATE")
S3_STATES=("$KEYSHIFT_S3_STATE" "$S3_OTHERS_STATE")
eval "$(hack/s3-server.sh start)"
S3_OTHERS_ENV="$(KEYSHIFT_S3_STATE="$S3_OTHERS_STATE" hack/s3-server.sh start)"

step "GCS and Azure Blob test servers (fake-gcs-server with hack/gcs-xml-adapter.py; Azurite), started in the background"
# Each with a state dir of this run's own; their variables are taken before the tests start
# (await_blob_servers). They serve tests/snapshot.rs and tests/runtime_local.rs (docs/storage.md).
for name in "${BLOB_SERVERS[@]}"; do
  blob_state="$(mktemp -d "/tmp/keyshift-$name.XXXXXX")"
  export "KEYSHIFT_${name^^}_STATE=$blob_state"
  setsid bash -c 'hack/$1-server.sh start >"$2/$1.env.new" 2>"$2/$1.log"
    echo $? >"$2/$1.rc.new" && mv "$2/$1.rc.new" "$2/$1.rc"' \
    blob-start "$name" "$LANES_DIR" </dev/null &
  BLOB_STARTERS+=($!)
done
# await_blob_servers: waits for both, fails the suite if either did not start, takes their
# variables (GOOGLE_SERVICE_ACCOUNT_KEY, AZURE_STORAGE_*, KEYSHIFT_TEST_{GCS,AZURE}_URL).
await_blob_servers() {
  local name
  for name in "${BLOB_SERVERS[@]}"; do
    await_file "$LANES_DIR/$name.rc"
    cat "$LANES_DIR/$name.log" >&2
    if [[ "$(cat "$LANES_DIR/$name.rc")" != 0 ]]; then
      echo "hack/$name-server.sh start failed" >&2
      return 1
    fi
    eval "$(cat "$LANES_DIR/$name.env.new")"
  done
}

step "Kafka broker (hack/kafka.sh: Apache Kafka, KRaft, one node) for the Kafka tests"
# Its own state dir too; the tests restart it mid-run through hack/kafka.sh (KEYSHIFT_KAFKA_STATE),
# so the three Kafka suites run one after another (the lanes below).
if [[ -z "${KEYSHIFT_KAFKA_STATE:-}" ]]; then
  KEYSHIFT_KAFKA_STATE="$(mktemp -d /tmp/keyshift-kafka.XXXXXX)"
  KAFKA_STATE_OWNED=1
fi
export KEYSHIFT_KAFKA_STATE
# A second listener for the test cluster's pods (tests/e2e_kafka.rs), advertised at the host's
# side of the testenv's veth: hack/testenv.sh's HOST_IP, 10.$KEYSHIFT_SUBNET.0.1 (default 213).
export KEYSHIFT_KAFKA_POD_HOST="10.${KEYSHIFT_SUBNET:-213}.0.1"
KAFKA_STARTED=1
kafka_env="$(hack/kafka.sh start)"
eval "$kafka_env"

# ---- build once. Every tier below runs the executables of these two builds; nothing builds again.
# These builds and clippy run under `nice`: the release image `testenv up` builds in the background
# is on the suite's critical path (the e2e tier waits for the cluster), and they are not.
# The product binary (no features) first: tests/cli.rs checks it refuses the bench and test-only
# commands. It runs here, before the all-features build: both builds put their `keyshift` at the
# same path (the tests' CARGO_BIN_EXE_keyshift), and the all-features one must be there for the
# tiers below (the e2e operator needs the test hooks). A copy of the product binary is kept for
# the lab's check.
step "cargo test --test cli (default features: the product binary)"
nice -n 15 cargo test --locked --test cli
cp "${CARGO_TARGET_DIR:-target}/debug/keyshift" "$LANES_DIR/keyshift-product"

step "cargo test --workspace --all-features: build the test executables, and run the doc tests"
nice -n 15 cargo test --workspace --locked --all-features --no-run --message-format=json-render-diagnostics \
  | python3 hack/test-binaries.py >"$LANES_DIR/binaries.tsv"
nice -n 15 cargo test --workspace --locked --all-features --doc

declare -A TEST_EXE=() TEST_DIR=()
while IFS=$'\t' read -r label exe dir; do
  TEST_EXE[$label]="$exe"
  TEST_DIR[$label]="$dir"
done <"$LANES_DIR/binaries.tsv"

# t LABEL [ARGS...]: one test executable of the build above, as `cargo test` runs it (from its
# package's directory, with CARGO_MANIFEST_DIR set).
t() {
  local label="$1"; shift
  if [[ -z "${TEST_EXE[$label]:-}" ]]; then
    echo "no test executable '$label' in the build (hack/test-binaries.py)" >&2
    return 1
  fi
  (cd "${TEST_DIR[$label]}" && CARGO_MANIFEST_DIR="${TEST_DIR[$label]}" exec "${TEST_EXE[$label]}" "$@")
}

# job NAME CMD...: runs CMD with its output in a file of its own, then prints that output whole
# (no two jobs' lines interleave), with its verdict and time; a failure is recorded, and the lane
# goes on.
job() {
  local name="$1"; shift
  local log="$LANES_DIR/job-$name.log" t0=$SECONDS rc=0 verdict=ok
  "$@" >"$log" 2>&1 </dev/null || rc=$?
  if ((rc != 0)); then
    verdict="FAILED (exit $rc)"
    echo "$name" >>"$LANES_DIR/failed"
  fi
  {
    flock 9
    printf '\n--- [%s] %s: %s in %ss\n' "$(date +%T)" "$name" "$verdict" "$((SECONDS - t0))" >&2
    cat "$log" >&2
  } 9>"$LANES_DIR/print.lock"
  printf '%5ss  %s  %s\n' "$((SECONDS - t0))" "$name" "$verdict" >>"$LANES_DIR/times"
}

# await_file FILE: waits until FILE exists (the marker another lane or the background
# `testenv up` leaves when it is done).
await_file() {
  while [[ ! -e "$1" ]]; do sleep 1; done
}

# await_testenv: waits for the background `testenv up`, then takes its environment (kubeconfig,
# node, containerd, image tarball, subnet).
await_testenv() {
  await_file "$LANES_DIR/testenv.rc"
  if [[ "$(cat "$LANES_DIR/testenv.rc")" != 0 ]]; then
    echo "hack/testenv.sh up failed:" >&2
    tail -n 40 "$LANES_DIR/testenv.log" >&2
    return 1
  fi
  eval "$(cat "$LANES_DIR/testenv.env")"
  # shellcheck disable=SC1091
  source "$KEYSHIFT_TESTENV_DIR/env"
}

# lane NAME BODY: BODY (a function) in the background, its jobs one after another.
# Clippy records the workspace's Cargo.toml by its absolute path in every member crate's
# fingerprint (the member crates lie outside the root package), so a check made in another
# clone counts as stale once that clone is gone: with a build directory shared by clones
# (.ci/run), clippy reads the workspace through a link in that directory, re-pointed at this
# checkout, and what it checked in an earlier clone stays fresh (hack/ci-source-times.py).
CLIPPY_MANIFEST=()
if [[ -n "${CARGO_TARGET_DIR:-}" ]]; then
  mkdir -p "$CARGO_TARGET_DIR"
  ln -sfn "$PWD" "$CARGO_TARGET_DIR/checkout"
  CLIPPY_MANIFEST=(--manifest-path "$CARGO_TARGET_DIR/checkout/Cargo.toml")
fi

LANE_PIDS=()
lane() {
  local name="$1" body="$2"
  ( "$body" ) &
  LANE_PIDS+=($!)
  echo "lane $name: pid $!" >&2
}

# ---- the tiers, side by side. The cluster-free tiers and the e2e tier's suites run at once; the
# e2e suites share the cluster through a lock (tests/support: a test that takes the API server
# away holds it alone). Jobs that share a server run in one lane: the three Kafka suites (they
# restart the broker), and the e2e operator suite has the S3 server it pauses to itself.
step "tests: the cluster-free tiers and the e2e suites, side by side (each job's output follows it whole)"
await_blob_servers

unit_and_light() {
  eval "$S3_OTHERS_ENV"
  # Clippy in both feature sets (Cargo.toml [features]): all of them covers every line; the
  # default one is the product build, where code left behind by a gated-out feature (an unused
  # import or helper) fails. In a lane, not before the build: no other cargo runs here (the lanes
  # run the built executables), and the e2e tier's waits leave the cores room for it.
  job clippy-all-features nice -n 15 cargo clippy "${CLIPPY_MANIFEST[@]}" --workspace --all-targets --all-features --locked -- -D warnings
  job clippy-default-features nice -n 15 cargo clippy "${CLIPPY_MANIFEST[@]}" --workspace --all-targets --locked -- -D warnings
  touch "$LANES_DIR/clippy.done"
  local label
  for label in $(cut -f1 "$LANES_DIR/binaries.tsv" | sort); do
    case "$label" in
      e2e_*|runtime_local|programs_local|orchestrator_pass|faults|kafka_local|kafka_sink) ;;
      *) job "$label" t "$label" ;;
    esac
  done
  job monitoring hack/check-monitoring.sh
  job lab env KEYSHIFT_BIN="$LANES_DIR/keyshift-product" hack/lab-test.sh
}
local_heavy() {
  eval "$S3_OTHERS_ENV"
  job runtime_local t runtime_local
  touch "$LANES_DIR/runtime-local.done"
  job programs_local t programs_local
  job orchestrator_pass t orchestrator_pass
  job faults t faults
}
kafka_suites() {
  eval "$S3_OTHERS_ENV"
  # Not beside clippy's burst on both cores, nor beside runtime_local's worker processes: beside
  # either, tests/kafka_local.rs's source once missed its catch-up deadline after a broker
  # restart (with nothing to rebuild, everything else starts at once).
  await_file "$LANES_DIR/clippy.done"
  await_file "$LANES_DIR/runtime-local.done"
  job kafka_local t kafka_local
  job kafka_sink t kafka_sink
  await_testenv || { echo e2e_kafka >>"$LANES_DIR/failed"; return; }
  await_outage_test
  # One test at a time: the first restarts the broker mid-run, which the other must not meet.
  job e2e_kafka e2e e2e_kafka --test-threads=1
}
# The e2e suites print each test's time (libtest's --report-time, which needs RUSTC_BOOTSTRAP at
# run time only: nothing is compiled with it), so the lanes can be balanced from CI's log.
e2e() {
  local label="$1"; shift
  RUSTC_BOOTSTRAP=1 t "$label" --ignored -Z unstable-options --report-time "$@"
}
# The API server outage test takes the control plane from every other e2e test (tests/support's
# plane lock): it runs first, alone on the cluster, and the other e2e jobs wait for it
# (await_outage_test) instead of queueing behind it on the lock while long tests hold it shared.
OUTAGE_TEST=api_server_outages_are_retried_and_lose_nothing
await_outage_test() {
  await_file "$LANES_DIR/outage-test.done"
}
e2e_operator_suite() {
  await_testenv || { echo testenv >>"$LANES_DIR/failed"; touch "$LANES_DIR/outage-test.done"; return; }
  job e2e_operator_outage e2e e2e_operator --exact "$OUTAGE_TEST"
  touch "$LANES_DIR/outage-test.done"
  # The 200-pod ceiling scenario runs alone, after every lane: beside the other tests it loaded
  # the 2-core node so far (load average 100) that the kubelet took minutes to terminate pods.
  job e2e_operator e2e e2e_operator --test-threads=6 --skip scale_past_the_ceiling --skip "$OUTAGE_TEST"
}
e2e_others() {
  eval "$S3_OTHERS_ENV"
  await_testenv || { echo testenv >>"$LANES_DIR/failed"; return; }
  await_outage_test
  job e2e_helm e2e e2e_helm
  job e2e_cluster e2e e2e_cluster
  job e2e_leader e2e e2e_leader
  job image t image --ignored
}
lane "unit and light" unit_and_light
lane "local heavy" local_heavy
lane kafka kafka_suites
lane "e2e operator" e2e_operator_suite
lane "e2e others" e2e_others
for pid in "${LANE_PIDS[@]}"; do wait "$pid" || echo "lane $pid" >>"$LANES_DIR/failed"; done

echo >&2
echo "time per job (longest first):" >&2
sort -rn "$LANES_DIR/times" >&2
if [[ -s "$LANES_DIR/failed" ]]; then
  # Each failed job's panics again, short, at the end: a long log is often read from its tail.
  while read -r name; do
    log="$LANES_DIR/job-$name.log"
    [[ -f "$log" ]] || continue
    echo "--- why $name failed (its panics; the whole output is above):" >&2
    panics="$(grep -A 4 "panicked at" "$log" | head -n 60 || true)"
    if [[ -n "$panics" ]]; then echo "$panics" >&2; else tail -n 20 "$log" >&2; fi
  done <"$LANES_DIR/failed"
  echo "FAILED: $(tr '\n' ' ' <"$LANES_DIR/failed")" >&2
  exit 1
fi

step "e2e: the 200-pod ceiling scenario (alone)"
await_testenv
e2e e2e_operator --exact scale_past_the_ceiling_24_to_200_in_one_patch
