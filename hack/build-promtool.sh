#!/usr/bin/env bash
# Build promtool (github.com/prometheus/prometheus/cmd/promtool) and hack/monitoring-check (the
# chart's dashboard and alert checker, on Prometheus' promql parser and rulefmt) from the Go
# module in hack/monitoring-check/, which pins the Prometheus module (go.mod, go.sum; promtool is
# its `tool`). Binaries are cached by the go.mod/go.sum/main.go digest.
#
#   hack/build-promtool.sh      # build what is missing; prints PROMTOOL=<path> and MONITORING_CHECK=<path>
#
# Progress and timings go to stderr. The first build compiles promtool's whole dependency tree
# (its service discovery pulls in client-go and cloud SDKs): minutes on a loaded 2-core machine;
# Go's build cache and the binaries' cache make later runs instant.
#
# Environment:
#   KEYSHIFT_CACHE         cache root (default ~/.cache/keyshift)
#   KEYSHIFT_BUILD_JOBS    go build -p value (default 2)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="$ROOT/hack/monitoring-check"
CACHE="${KEYSHIFT_CACHE:-$HOME/.cache/keyshift}"
JOBS="${KEYSHIFT_BUILD_JOBS:-2}"

log() { printf '[build-promtool] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# shellcheck source=hack/go-env.sh
source "$ROOT/hack/go-env.sh"
export CGO_ENABLED=0

VERSION="$(sed -n 's/^[[:space:]]*github.com\/prometheus\/prometheus \(v[^ ]*\).*/\1/p' "$SRC/go.mod")"
[[ -n "$VERSION" ]] || die "no github.com/prometheus/prometheus requirement in $SRC/go.mod"
# The module's v0.3MM.P is Prometheus 3.MM.P (what `promtool --version` reports).
MINOR="${VERSION#v0.}"; PATCH="${MINOR#*.}"; MINOR="${MINOR%%.*}"
[[ "$MINOR" =~ ^3[0-9][0-9]$ ]] || die "unexpected Prometheus module version $VERSION"
APP_VERSION="3.$((10#${MINOR:1})).$PATCH"
DIGEST="$(cat "$SRC/go.mod" "$SRC/go.sum" "$SRC/main.go" | sha256sum | cut -c1-16)"
BIN="$CACHE/bin/promtool-$VERSION-$DIGEST"
mkdir -p "$CACHE/bin"

exec 9>"$CACHE/.build-promtool.lock"
flock 9

ok() {
  [[ -x "$BIN/promtool" && -x "$BIN/monitoring-check" ]] || return 1
  local out
  out="$("$BIN/promtool" --version 2>/dev/null)" || return 1
  grep -q "version $APP_VERSION " <<<"$out"
}

if ok; then
  log "promtool $APP_VERSION and monitoring-check: cached in $BIN"
else
  start=$SECONDS
  tmp="$BIN.tmp.$$"
  rm -rf -- "$tmp"
  mkdir -p "$tmp"
  # Build in the module (read-only: go.sum is committed); promtool is the module's `tool`.
  (
    cd "$SRC"
    "$GO" build -mod=readonly -p "$JOBS" -trimpath -o "$tmp/monitoring-check" .
    log "monitoring-check built ($((SECONDS - start)) s)"
    # promtool's version string, as Prometheus' own build stamps it.
    "$GO" build -mod=readonly -p "$JOBS" -trimpath \
      -ldflags "-X github.com/prometheus/common/version.Version=$APP_VERSION -X github.com/prometheus/common/version.Branch=HEAD -X github.com/prometheus/common/version.Revision=$VERSION" \
      -o "$tmp/promtool" github.com/prometheus/prometheus/cmd/promtool
  )
  rm -rf -- "$BIN"
  mv -- "$tmp" "$BIN"
  ok || die "the promtool in $BIN does not report version $APP_VERSION"
  log "promtool $APP_VERSION (module $VERSION) built in $((SECONDS - start)) s"
fi
echo "PROMTOOL=$BIN/promtool"
echo "MONITORING_CHECK=$BIN/monitoring-check"
