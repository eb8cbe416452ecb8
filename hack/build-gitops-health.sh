#!/usr/bin/env bash
# Build hack/gitops-health (the GitOps health tool: kstatus from sigs.k8s.io/cli-utils and the
# Argo CD health check run in gopher-lua, the Lua VM Argo CD uses) and cache the binary outside
# the repo, keyed by the hash of the tool's sources, so an edit rebuilds it and an unchanged tree
# costs a hash.
#
#   hack/build-gitops-health.sh     # prints GITOPS_HEALTH=<path to the binary> on stdout
#
# The module versions are pinned in hack/gitops-health/go.mod and go.sum; Go's module and build
# caches stay in their default locations.
#
# Environment:
#   KEYSHIFT_CACHE   cache root (default ~/.cache/keyshift)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="$ROOT/hack/gitops-health"
CACHE="${KEYSHIFT_CACHE:-$HOME/.cache/keyshift}"

log() { printf '[build-gitops-health] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# shellcheck source=hack/go-env.sh
source "$ROOT/hack/go-env.sh"
export CGO_ENABLED=0

hash="$(cd "$SRC" && cat go.mod go.sum ./*.go | sha256sum | cut -c1-16)"
OUT_DIR="$CACHE/bin/gitops-health-$hash"
BIN="$OUT_DIR/gitops-health"

mkdir -p "$CACHE/bin"
exec 9>"$CACHE/.build-gitops-health.lock"
flock 9

if [[ -x "$BIN" ]]; then
  log "cached at $BIN"
else
  log "building $SRC -> $BIN"
  start=$SECONDS
  mkdir -p "$OUT_DIR"
  (cd "$SRC" && "$GO" build -trimpath -o "$BIN.tmp" .) || die "go build failed"
  mv "$BIN.tmp" "$BIN"
  log "built in $((SECONDS - start)) s"
fi
# It runs: --lua is required, so a bare call must fail with that message.
if out="$("$BIN" 2>&1)" || [[ "$out" != *"--lua SCRIPT is required"* ]]; then
  die "$BIN does not run as expected: $out"
fi
echo "GITOPS_HEALTH=$BIN"
