#!/usr/bin/env bash
# A real Azure Blob server on 127.0.0.1 for the storage tests: Azurite (Microsoft's emulator),
# installed from its npm package (pinned below) into a cache outside the repo.
#
#   eval "$(hack/azure-server.sh start)"   # installs it if needed, starts it, creates the
#                                          # container, prints the env exports (stdout)
#   hack/azure-server.sh install           # only installs it (prints its path)
#   cargo test --test snapshot             # the Azure scenarios now run against it
#   hack/azure-server.sh stop
#
# The exports are what a user of `az://` sets too (AZURE_STORAGE_ACCOUNT_NAME and
# AZURE_STORAGE_ACCOUNT_KEY: Azurite's well-known development account, which it checks every
# request's Shared Key signature against), plus the two that point the client at an emulator
# (AZURE_STORAGE_USE_EMULATOR, AZURITE_BLOB_STORAGE_URL) and an `az://container/prefix` URL.
#
# `start` is idempotent: a server already running from this state dir is reused.
# Settings (env): KEYSHIFT_AZURE_STATE (state dir, default ${TMPDIR:-/tmp}/keyshift-azure),
# KEYSHIFT_AZURE_CONTAINER (default keyshift-test), KEYSHIFT_AZURE_PORT (default: a free port),
# KEYSHIFT_CACHE (where the package is installed, default ~/.cache/keyshift).
set -euo pipefail

VERSION=3.37.0
state="${KEYSHIFT_AZURE_STATE:-${TMPDIR:-/tmp}/keyshift-azure}"
container="${KEYSHIFT_AZURE_CONTAINER:-keyshift-test}"
host=127.0.0.1
CACHE="${KEYSHIFT_CACHE:-$HOME/.cache/keyshift}"
PREFIX="$CACHE/azurite-$VERSION"
BIN="$PREFIX/node_modules/.bin/azurite-blob"
# Azurite's development account (public, the same in every Azurite and in Microsoft's docs).
ACCOUNT=devstoreaccount1
KEY='Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=='
PIDS=(pid)
PREPARE=install
# shellcheck source=hack/test-server-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/test-server-lib.sh"

log() { printf 'azure-server: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

exports() {
  local port="$1"
  cat <<EOF
export AZURE_STORAGE_ACCOUNT_NAME=${ACCOUNT}
export AZURE_STORAGE_ACCOUNT_KEY=${KEY}
export AZURE_STORAGE_USE_EMULATOR=true
export AZURITE_BLOB_STORAGE_URL=http://${host}:${port}
export KEYSHIFT_TEST_AZURE_URL=az://${container}/keyshift-tests
EOF
}

install() {
  [[ -x "$BIN" ]] && return
  command -v npm >/dev/null || die "npm not found (Azurite is a Node.js package)"
  mkdir -p "$CACHE"
  exec 9>"$CACHE/.install-azurite.lock"
  flock 9
  [[ -x "$BIN" ]] && return
  log "installing azurite@$VERSION into $PREFIX"
  local start=$SECONDS
  rm -rf "$PREFIX.tmp"
  npm install --prefix "$PREFIX.tmp" --no-audit --no-fund --omit=dev --silent "azurite@$VERSION" >&2 \
    || die "npm install azurite@$VERSION failed"
  rm -rf "$PREFIX"
  mv "$PREFIX.tmp" "$PREFIX"
  log "installed in $((SECONDS - start)) s"
}

# blob METHOD PORT PATH QUERY: the HTTP status of a Shared Key signed request to the Blob
# service (PATH after the account, QUERY without '?').
blob() {
  local method="$1" port="$2" path="$3" query="$4" headers
  # The Shared Key signature of the request (enough of the scheme for container calls without
  # a body): its headers, one "Name: value" per line.
  headers="$(python3 - "$method" "$path" "$query" "$ACCOUNT" "$KEY" <<'EOF'
import base64, hashlib, hmac, sys
from email.utils import formatdate
method, path, query, account, key = sys.argv[1:6]
headers = {"x-ms-date": formatdate(usegmt=True), "x-ms-version": "2021-08-06"}
resource = f"/{account}/{account}/{path}"
for pair in sorted(p for p in query.split("&") if p):
    name, _, value = pair.partition("=")
    resource += f"\n{name}:{value}"
canonical = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()))
sign = "\n".join([method] + [""] * 11) + "\n" + canonical + resource
mac = hmac.new(base64.b64decode(key), sign.encode(), hashlib.sha256).digest()
headers["Authorization"] = f"SharedKey {account}:{base64.b64encode(mac).decode()}"
print("\n".join(f"{k}: {v}" for k, v in headers.items()))
EOF
)"
  local args=()
  mapfile -t args <<<"$headers"
  http_status "$method" "http://${host}:${port}/${ACCOUNT}/${path}${query:+?$query}" "" "${args[@]}"
}

start() {
  mkdir -p "$state"
  reuse && return
  install
  local port="${KEYSHIFT_AZURE_PORT:-$(free_port)}"
  # setsid: its own session, so the caller's job control or Ctrl-C does not take it down.
  # --skipApiVersionCheck: the client may speak a newer service version than this Azurite knows.
  setsid "$BIN" --blobHost "$host" --blobPort "$port" --inMemoryPersistence \
    --skipApiVersionCheck --silent \
    >"$state/server.log" 2>&1 </dev/null &
  echo $! >"$state/pid"
  echo "$port" >"$state/port"
  # Listing containers answers 200 once the server is up and our signature is accepted.
  await_up "Azurite on ${host}:${port}" lists "$port"
  local code
  code="$(blob PUT "$port" "$container" "restype=container")"
  if [[ "$code" != 201 && "$code" != 409 ]]; then
    log "creating container ${container} failed (HTTP ${code}); log in $state/server.log"
    stop
    exit 1
  fi
  log "Azurite $VERSION on ${host}:${port} (pid $(cat "$state/pid")), container ${container}"
  exports "$port"
}

# lists PORT: whether a signed listing of the containers answers 200.
lists() {
  [[ "$(blob GET "$1" "" "comp=list")" == 200 ]]
}

prepare() {
  install
  echo "AZURITE_BLOB=$BIN"
}

server_main "$@"
