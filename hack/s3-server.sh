#!/usr/bin/env bash
# A real S3-protocol server on 127.0.0.1 for the snapshot tests (moto's server, from PyPI).
#
#   eval "$(hack/s3-server.sh start)"   # installs moto[server] if needed, starts it, creates the
#                                       # bucket, prints the env exports (stdout) for the tests
#   cargo test --test snapshot          # the S3 scenarios now run against it
#   hack/s3-server.sh stop
#
# `start` is idempotent: a server already running from this state dir is reused.
# Settings (env): KEYSHIFT_S3_STATE (state dir, default ${TMPDIR:-/tmp}/keyshift-s3),
# KEYSHIFT_S3_BUCKET (default keyshift-test; moto needs 3+ characters), KEYSHIFT_S3_PORT
# (default: a free port), KEYSHIFT_S3_HOST (address to serve on, default 127.0.0.1; e.g. the host side
# of the test network, 10.213.0.1, after `hack/testenv.sh up`, so pods reach it too).
set -euo pipefail

state="${KEYSHIFT_S3_STATE:-${TMPDIR:-/tmp}/keyshift-s3}"
bucket="${KEYSHIFT_S3_BUCKET:-keyshift-test}"
host="${KEYSHIFT_S3_HOST:-127.0.0.1}"
python="${PYTHON:-python3}"

log() { printf 's3-server: %s\n' "$*" >&2; }

exports() {
  local port="$1"
  cat <<EOF
export AWS_ENDPOINT=http://${host}:${port}
export AWS_ALLOW_HTTP=true
export AWS_ACCESS_KEY_ID=test
export AWS_SECRET_ACCESS_KEY=test
export AWS_REGION=us-east-1
export KEYSHIFT_TEST_S3_URL=s3://${bucket}/keyshift-tests
EOF
}

running() {
  [[ -f "$state/pid" ]] && kill -0 "$(cat "$state/pid")" 2>/dev/null
}

ensure_moto() {
  if "$python" -c 'import moto.server, flask, flask_cors' 2>/dev/null; then
    return
  fi
  log "installing moto[server] with pip"
  "$python" -m pip install --quiet --disable-pip-version-check 'moto[server]' >&2
}

free_port() {
  "$python" -c 'import socket, sys; s=socket.socket(); s.bind((sys.argv[1], 0)); print(s.getsockname()[1])' "$host"
}

# HTTP status of a request to the server (no signing: moto accepts unsigned requests).
http() {
  local method="$1" url="$2"
  "$python" - "$method" "$url" <<'EOF'
import sys, urllib.request, urllib.error
req = urllib.request.Request(sys.argv[2], method=sys.argv[1])
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
  ensure_moto
  local port="${KEYSHIFT_S3_PORT:-$(free_port)}"
  # setsid: its own session, so the caller's job control or Ctrl-C does not take it down.
  setsid "$python" -m moto.server -H "$host" -p "$port" >"$state/server.log" 2>&1 < /dev/null &
  echo $! >"$state/pid"
  echo "$port" >"$state/port"
  local deadline=$((SECONDS + 60))
  until [[ "$(http GET "http://${host}:${port}/")" == 200 ]]; do
    if ! running; then
      log "moto server exited; log follows"
      cat "$state/server.log" >&2
      exit 1
    fi
    if ((SECONDS > deadline)); then
      log "moto server did not answer on ${host}:${port} within 60 s; log in $state/server.log"
      stop
      exit 1
    fi
    sleep 0.3
  done
  local code
  code="$(http PUT "http://${host}:${port}/${bucket}")"
  if [[ "$code" != 200 && "$code" != 409 ]]; then
    log "creating bucket ${bucket} failed (HTTP ${code}); log in $state/server.log"
    stop
    exit 1
  fi
  log "moto S3 server on ${host}:${port} (pid $(cat "$state/pid")), bucket ${bucket}"
  exports "$port"
}

stop() {
  if running; then
    local pid
    pid="$(cat "$state/pid")"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
    log "stopped (pid $pid)"
  fi
  rm -f "$state/pid" "$state/port"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  env)
    running || { log "not running"; exit 1; }
    exports "$(cat "$state/port")"
    ;;
  *)
    echo "usage: $0 start|stop|env" >&2
    exit 2
    ;;
esac
