# Sourced by the test servers' scripts (hack/s3-server.sh, hack/gcs-server.sh,
# hack/azure-server.sh, hack/kafka.sh): what every one of them does alike. A script sets `state` (its state
# dir), `PIDS` (the pid files there, one per process it starts, "pid" first) and defines `log`,
# `exports PORT` (the variables it prints for the tests) and `start`; it may set `PREPARE` to a
# command name that runs its `prepare` (building or installing the server) alone.

# free_port [HOST]: a TCP port that is free on HOST (default 127.0.0.1) now.
free_port() {
  python3 -c 'import socket, sys; s=socket.socket(); s.bind((sys.argv[1], 0)); print(s.getsockname()[1])' \
    "${1:-127.0.0.1}"
}

# http_status METHOD URL [JSON [HEADER...]]: the HTTP status of a request (0: no answer), with a
# JSON body unless JSON is empty, and each HEADER given as "Name: value".
http_status() {
  python3 - "$@" <<'PY'
import sys, urllib.request, urllib.error
method, url = sys.argv[1:3]
body = sys.argv[3].encode() if len(sys.argv) > 3 and sys.argv[3] else None
req = urllib.request.Request(url, data=body, method=method)
if body:
    req.add_header("Content-Type", "application/json")
elif method in ("PUT", "POST"):
    req.add_header("Content-Length", "0")
for header in sys.argv[4:]:
    name, _, value = header.partition(": ")
    req.add_header(name, value)
try:
    with urllib.request.urlopen(req, timeout=5) as r:
        print(r.status)
except urllib.error.HTTPError as e:
    print(e.code)
except Exception:
    print(0)
PY
}

# answers URL: whether an unsigned GET of URL answers 200.
answers() {
  [[ "$(http_status GET "$1")" == 200 ]]
}

# running: whether every process the pid files record is alive.
running() {
  local f
  for f in "${PIDS[@]}"; do
    [[ -f "$state/$f" ]] && kill -0 "$(cat "$state/$f")" 2>/dev/null || return 1
  done
}

# reuse: when the server already runs from this state dir, says so and prints its exports.
reuse() {
  running || return 1
  log "already running (pid $(cat "$state/pid"), port $(cat "$state/port"))"
  exports "$(cat "$state/port")"
}

# await_up NAME CHECK...: waits up to 60 s until the command CHECK... succeeds; if a process
# of the server dies first or the time runs out, prints the server's logs, stops it, exits 1.
await_up() {
  local name="$1" deadline=$((SECONDS + 60))
  shift
  until "$@"; do
    if ! running; then
      log "$name exited; its logs follow"
      cat "$state"/*.log >&2 || true
      stop
      exit 1
    fi
    if ((SECONDS > deadline)); then
      log "$name did not answer within 60 s; logs in $state"
      stop
      exit 1
    fi
    sleep 0.3
  done
}

# stop_with SIGNAL SECONDS: stops every recorded process (SIGNAL, then KILL after SECONDS) and
# forgets it.
stop_with() {
  local sig="$1" seconds="$2" f pid
  for f in "${PIDS[@]}"; do
    [[ -f "$state/$f" ]] || continue
    pid="$(cat "$state/$f")"
    if kill -0 "$pid" 2>/dev/null; then
      kill "-$sig" "$pid" 2>/dev/null || true
      for _ in $(seq $((seconds * 10))); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
      done
      kill -9 "$pid" 2>/dev/null || true
      log "stopped (pid $pid, SIG$sig)"
    fi
    rm -f "$state/$f"
  done
  rm -f "$state/port"
}

# stop: stop_with TERM 5.
stop() {
  stop_with TERM 5
}

# server_main "$@": the script's command line: start | stop | env [| $PREPARE].
server_main() {
  if [[ -n "${PREPARE:-}" && "${1:-}" == "$PREPARE" ]]; then
    prepare
    return
  fi
  case "${1:-}" in
    start) start ;;
    stop) stop ;;
    env)
      running || { log "not running"; exit 1; }
      exports "$(cat "$state/port")"
      ;;
    *)
      echo "usage: $0 start|stop|env${PREPARE:+|$PREPARE}" >&2
      exit 2
      ;;
  esac
}
