#!/usr/bin/env bash
# A real GCS-protocol server on 127.0.0.1 for the storage tests: fake-gcs-server, built from its Go
# module (github.com/fsouza/fake-gcs-server, pinned below) and cached outside the repo, behind
# hack/gcs-xml-adapter.py, which serves the XML API's uploads that fake-gcs-server lacks (object
# puts, copies and multipart uploads, which object_store's GCS client writes with) by turning
# each into the JSON API call that does the same on the server, preconditions included.
#
#   eval "$(hack/gcs-server.sh start)"   # builds it if needed, starts it, creates the bucket,
#                                        # prints the env exports (stdout) for the tests
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

log() { printf 'gcs-server: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

exports() {
  local port="$1"
  cat <<EOF
export GOOGLE_SERVICE_ACCOUNT_KEY='{"gcs_base_url": "http://${host}:${port}", "disable_oauth": true, "client_email": "", "private_key": "", "private_key_id": ""}'
export KEYSHIFT_TEST_GCS_URL=gs://${bucket}/keyshift-tests
EOF
}

running() {
  [[ -f "$state/pid" && -f "$state/adapter.pid" ]] && kill -0 "$(cat "$state/pid")" 2>/dev/null \
    && kill -0 "$(cat "$state/adapter.pid")" 2>/dev/null
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

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# HTTP status of a request (method, url, optional JSON body).
http() {
  python3 - "$@" <<'EOF'
import sys, urllib.request, urllib.error
body = sys.argv[3].encode() if len(sys.argv) > 3 else None
req = urllib.request.Request(sys.argv[2], data=body, method=sys.argv[1],
                             headers={"Content-Type": "application/json"} if body else {})
try:
    with urllib.request.urlopen(req, timeout=5) as r:
        print(r.status)
except urllib.error.HTTPError as e:
    print(e.code)
except Exception:
    print(0)
EOF
}

start() {
  mkdir -p "$state"
  if running; then
    log "already running (pid $(cat "$state/pid"), port $(cat "$state/port"))"
    exports "$(cat "$state/port")"
    return
  fi
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
  local deadline=$((SECONDS + 60))
  until [[ "$(http GET "http://${host}:${port}/storage/v1/b")" == 200 ]]; do
    if ! running; then
      log "fake-gcs-server or its adapter exited; logs follow"
      cat "$state/server.log" "$state/adapter.log" >&2
      stop
      exit 1
    fi
    if ((SECONDS > deadline)); then
      log "fake-gcs-server did not answer on ${host}:${port} within 60 s; log in $state/server.log"
      stop
      exit 1
    fi
    sleep 0.3
  done
  local code
  code="$(http POST "http://${host}:${port}/storage/v1/b" "{\"name\": \"${bucket}\"}")"
  if [[ "$code" != 200 && "$code" != 409 ]]; then
    log "creating bucket ${bucket} failed (HTTP ${code}); log in $state/server.log"
    stop
    exit 1
  fi
  log "fake-gcs-server $VERSION on ${host}:${port} (pid $(cat "$state/pid")), bucket ${bucket}"
  exports "$port"
}

stop() {
  local f pid
  for f in pid adapter.pid; do
    [[ -f "$state/$f" ]] || continue
    pid="$(cat "$state/$f")"
    if kill -0 "$pid" 2>/dev/null; then
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 50); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
      done
      kill -9 "$pid" 2>/dev/null || true
      log "stopped (pid $pid)"
    fi
  done
  rm -f "$state/pid" "$state/adapter.pid" "$state/port"
}

case "${1:-}" in
  build) build; echo "FAKE_GCS_SERVER=$BIN" ;;
  start) start ;;
  stop) stop ;;
  env)
    running || { log "not running"; exit 1; }
    exports "$(cat "$state/port")"
    ;;
  *)
    echo "usage: $0 build|start|stop|env" >&2
    exit 2
    ;;
esac
