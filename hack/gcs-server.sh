#!/usr/bin/env bash
# A real GCS-protocol server on 127.0.0.1 for the storage tests: fake-gcs-server, built from its Go
# module (github.com/fsouza/fake-gcs-server, pinned below) and cached outside the repo, behind
# hack/gcs-xml-adapter.py, which serves the XML API's uploads that fake-gcs-server lacks (object
# puts, copies and multipart uploads, which object_store's GCS client writes with) by turning
# each into the JSON API call that does the same on the server, preconditions included.
#
#   eval "$(hack/gcs-server.sh start)"   # builds it if needed, starts it, creates the bucket,
#                                        # prints the env exports (stdout) for the tests
#   hack/gcs-server.sh build             # only builds it (prints its path)
#   cargo test --test snapshot           # the GCS scenarios now run against it
#   hack/gcs-server.sh stop
#
# The exports are what a user of `gs://` sets too: GOOGLE_SERVICE_ACCOUNT_KEY, a service account
# key as JSON (here one whose `gcs_base_url` points at the server and whose `disable_oauth` skips
# the token exchange, which the emulator does not serve), and a `gs://bucket/prefix` URL.
#
# `start` is idempotent: a server already running from this state dir is reused.
# Settings (env): KEYSHIFT_GCS_STATE (state dir, default ${TMPDIR:-/tmp}/keyshift-gcs),
# KEYSHIFT_GCS_BUCKET (default keyshift-test), KEYSHIFT_GCS_PORT (default: a free port),
# KEYSHIFT_CACHE (where the binary is cached, default ~/.cache/keyshift).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODULE=github.com/fsouza/fake-gcs-server
VERSION=v1.56.1
state="${KEYSHIFT_GCS_STATE:-${TMPDIR:-/tmp}/keyshift-gcs}"
bucket="${KEYSHIFT_GCS_BUCKET:-keyshift-test}"
host=127.0.0.1
CACHE="${KEYSHIFT_CACHE:-$HOME/.cache/keyshift}"
BIN="$CACHE/bin/fake-gcs-server-$VERSION/fake-gcs-server"
PIDS=(pid adapter.pid)
PREPARE=build
# shellcheck source=hack/test-server-lib.sh
source "$ROOT/hack/test-server-lib.sh"

log() { printf 'gcs-server: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

exports() {
  local port="$1"
  cat <<EOF
export GOOGLE_SERVICE_ACCOUNT_KEY='{"gcs_base_url": "http://${host}:${port}", "disable_oauth": true, "client_email": "", "private_key": "", "private_key_id": ""}'
export KEYSHIFT_TEST_GCS_URL=gs://${bucket}/keyshift-tests
EOF
}

build() {
  [[ -x "$BIN" ]] && return
  # shellcheck source=hack/go-env.sh
  source "$ROOT/hack/go-env.sh"
  mkdir -p "$(dirname "$BIN")"
  exec 9>"$CACHE/.build-fake-gcs-server.lock"
  flock 9
  [[ -x "$BIN" ]] && return
  log "building $MODULE@$VERSION -> $BIN"
  local start=$SECONDS
  CGO_ENABLED=0 GOBIN="$(dirname "$BIN")/.tmp" "$GO" install -trimpath "$MODULE@$VERSION" >&2 \
    || die "go install $MODULE@$VERSION failed"
  mv "$(dirname "$BIN")/.tmp/fake-gcs-server" "$BIN"
  rmdir "$(dirname "$BIN")/.tmp"
  log "built in $((SECONDS - start)) s"
}

prepare() {
  build
  echo "FAKE_GCS_SERVER=$BIN"
}

start() {
  mkdir -p "$state"
  reuse && return
  build
  local port="${KEYSHIFT_GCS_PORT:-$(free_port)}" inner
  inner="$(free_port)"
  # setsid: its own session, so the caller's job control or Ctrl-C does not take it down.
  setsid "$BIN" -scheme http -host "$host" -port "$inner" -backend memory \
    -public-host "${host}:${inner}" -external-url "http://${host}:${inner}" -log-level warn \
    >"$state/server.log" 2>&1 </dev/null &
  echo $! >"$state/pid"
  setsid python3 "$ROOT/hack/gcs-xml-adapter.py" "$port" "$inner" \
    >"$state/adapter.log" 2>&1 </dev/null &
  echo $! >"$state/adapter.pid"
  echo "$port" >"$state/port"
  await_up "fake-gcs-server on ${host}:${port}" answers "http://${host}:${port}/storage/v1/b"
  local code
  code="$(http_status POST "http://${host}:${port}/storage/v1/b" "{\"name\": \"${bucket}\"}")"
  if [[ "$code" != 200 && "$code" != 409 ]]; then
    log "creating bucket ${bucket} failed (HTTP ${code}); logs in $state"
    stop
    exit 1
  fi
  log "fake-gcs-server $VERSION on ${host}:${port} (pid $(cat "$state/pid")), bucket ${bucket}"
  exports "$port"
}

server_main "$@"
