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
PIDS=(pid)
# shellcheck source=hack/test-server-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/test-server-lib.sh"

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

ensure_moto() {
  if "$python" -c 'import moto.server, flask, flask_cors' 2>/dev/null; then
    return
  fi
  log "installing moto[server] with pip"
  "$python" -m pip install --quiet --disable-pip-version-check 'moto[server]' >&2
}

start() {
  mkdir -p "$state"
  reuse && return
  ensure_moto
  local port="${KEYSHIFT_S3_PORT:-$(free_port "$host")}"
  # setsid: its own session, so the caller's job control or Ctrl-C does not take it down.
  setsid "$python" -m moto.server -H "$host" -p "$port" >"$state/server.log" 2>&1 < /dev/null &
  echo $! >"$state/pid"
  echo "$port" >"$state/port"
  await_up "moto server on ${host}:${port}" answers "http://${host}:${port}/"
  local code
  code="$(http_status PUT "http://${host}:${port}/${bucket}")"
  if [[ "$code" != 200 && "$code" != 409 ]]; then
    log "creating bucket ${bucket} failed (HTTP ${code}); log in $state/server.log"
    stop
    exit 1
  fi
  log "moto S3 server on ${host}:${port} (pid $(cat "$state/pid")), bucket ${bucket}"
  exports "$port"
}

server_main "$@"
