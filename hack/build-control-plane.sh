#!/usr/bin/env bash
# Build a real Kubernetes control plane (kube-apiserver, kube-controller-manager,
# kube-scheduler), the kubelet, and etcd from their upstream Go modules, at
# pinned versions, and cache the binaries outside the repo. (The rest of the
# node -- containerd, runc, CNI plugins -- is hack/build-node.sh.)
#
#   hack/build-control-plane.sh          # build what is missing, print the bin dirs
#
# Output (stdout, one per line):  K8S_BIN=<dir>  and  ETCD_BIN=<dir>
# Progress and timings go to stderr.
#
# How it works (see shared DESIGN.md section 6):
#   * k8s.io/kubernetes is not meant to be consumed as a module: its go.mod
#     requires every staging module (k8s.io/api, k8s.io/apiserver, ...) at
#     v0.0.0 and replaces it with ./staging/src/... . Replace directives of a
#     dependency are ignored, so we generate a throwaway "tools" module that
#     requires k8s.io/kubernetes and replaces each staging module with its
#     published tag (v0.X.Y for v1.X.Y). The staging list is read from the
#     exact go.mod of the pinned version (downloaded from the module proxy).
#   * etcd's main package is the module root go.etcd.io/etcd/server/v3;
#     `go install pkg@version` refuses it (it has replace directives), but a
#     wrapper module that requires it builds fine.
#   * Version information is injected with -ldflags -X, like upstream's
#     hack/lib/version.sh, so that /version reports the real version (Helm's
#     kubeVersion checks rely on it).
#
# The generated modules live in $KEYSHIFT_CACHE/src/; Go's module and build
# caches stay in their default locations so they persist between runs.
#
# Environment:
#   KEYSHIFT_CACHE         cache root (default ~/.cache/keyshift)
#   KEYSHIFT_K8S_VERSION   default v1.37.2
#   KEYSHIFT_ETCD_VERSION  default v3.7.3
#   KEYSHIFT_BUILD_JOBS    go build -p value (default 2)
set -euo pipefail

K8S_VERSION="${KEYSHIFT_K8S_VERSION:-v1.37.2}"
ETCD_VERSION="${KEYSHIFT_ETCD_VERSION:-v3.7.3}"
CACHE="${KEYSHIFT_CACHE:-$HOME/.cache/keyshift}"
JOBS="${KEYSHIFT_BUILD_JOBS:-2}"

K8S_BIN="$CACHE/bin/k8s-$K8S_VERSION"
ETCD_BIN="$CACHE/bin/etcd-$ETCD_VERSION"
K8S_TOOLS=(kube-apiserver kube-controller-manager kube-scheduler kubelet)

log() { printf '[build-control-plane] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# Find a Go toolchain: $GO, `go` on PATH, or the usual install location.
if [[ -z "${GO:-}" ]]; then
  if command -v go >/dev/null 2>&1; then GO="$(command -v go)"
  elif [[ -x /usr/local/go/bin/go ]]; then GO=/usr/local/go/bin/go
  else die "no Go toolchain found (set GO=/path/to/go)"; fi
fi

# Never let Go download another toolchain; build static binaries; don't stamp
# VCS info of whatever directory we happen to be in.
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-buildvcs=false"

mkdir -p "$CACHE/bin" "$CACHE/src"

# Serialise concurrent invocations (e.g. two `testenv.sh up` at once).
exec 9>"$CACHE/.build-control-plane.lock"
flock 9

# --- cache checks ----------------------------------------------------------------

# k8s binaries are valid if each one runs and prints "Kubernetes <version>".
k8s_ok() {
  local t out
  for t in "${K8S_TOOLS[@]}"; do
    [[ -x "$K8S_BIN/$t" ]] || return 1
    out="$("$K8S_BIN/$t" --version 2>/dev/null)" || return 1
    [[ "$out" == "Kubernetes $K8S_VERSION" ]] || return 1
  done
}

# etcd is valid if `etcd --version` prints "etcd Version: X.Y.Z".
etcd_ok() {
  [[ -x "$ETCD_BIN/etcd" ]] || return 1
  local out
  # Capture first: `etcd --version | grep -q` can fail under pipefail (SIGPIPE).
  out="$("$ETCD_BIN/etcd" --version 2>/dev/null)" || return 1
  grep -qx "etcd Version: ${ETCD_VERSION#v}" <<<"$out"
}

# Path of the go.mod of module $1 at version $2 in the module cache (downloads it).
modfile_of() {
  "$GO" mod download -json "$1@$2" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p'
}
# Release time of module $1 at version $2 (used as a reproducible build date).
modtime_of() {
  "$GO" list -m -json "$1@$2" | sed -n 's/^[[:space:]]*"Time": "\(.*\)",\{0,1\}$/\1/p'
}

# --- kube-apiserver + kube-controller-manager ------------------------------------

build_k8s() {
  local start=$SECONDS
  local minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
  local patch="${K8S_VERSION##*.}"
  local staging_version="v0.$minor.$patch"
  local dir="$CACHE/src/k8s-tools-$K8S_VERSION"

  log "building ${K8S_TOOLS[*]} $K8S_VERSION (staging $staging_version) in $dir"
  local upstream_mod
  upstream_mod="$(modfile_of k8s.io/kubernetes "$K8S_VERSION")"
  [[ -f "$upstream_mod" ]] || die "could not download go.mod of k8s.io/kubernetes@$K8S_VERSION"

  # Staging modules: the `k8s.io/<name> => ./staging/src/k8s.io/<name>` lines.
  local staging
  staging="$(sed -n 's#^[[:space:]]*\(k8s\.io/[A-Za-z0-9._-]*\)[[:space:]]*=>[[:space:]]*\./staging/.*#\1#p' "$upstream_mod" | sort -u)"
  [[ -n "$staging" ]] || die "found no staging replace lines in $upstream_mod"
  log "  $(wc -l <<<"$staging") staging modules"
  local go_directive
  go_directive="$(sed -n 's/^go \([0-9.]*\)$/\1/p' "$upstream_mod")"

  rm -rf "$dir"; mkdir -p "$dir"
  {
    echo "// Generated by keyshift hack/build-control-plane.sh; throwaway."
    echo "module keyshift.invalid/k8s-tools"
    echo
    echo "go ${go_directive:-1.26.0}"
    echo
    echo "require k8s.io/kubernetes $K8S_VERSION"
    echo
    echo "tool ("
    local t; for t in "${K8S_TOOLS[@]}"; do echo "	k8s.io/kubernetes/cmd/$t"; done
    echo ")"
    echo
    echo "replace ("
    local m; while read -r m; do echo "	$m => $m $staging_version"; done <<<"$staging"
    echo ")"
  } >"$dir/go.mod"

  local t0=$SECONDS
  (cd "$dir" && "$GO" mod tidy) || die "go mod tidy failed in $dir"
  log "  go mod tidy: $((SECONDS - t0)) s"

  local build_date
  build_date="$(modtime_of k8s.io/kubernetes "$K8S_VERSION")"
  [[ -n "$build_date" ]] || build_date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  # Same variables upstream's hack/lib/version.sh sets. The module proxy does
  # not tell the git commit, so gitCommit is set empty (instead of the
  # "$Format:%H$" placeholder); "archive" is the tree state upstream uses for
  # builds from a source archive. buildDate is the module's release time, so
  # rebuilds are byte-identical.
  local ldflags="-s -w" pkg
  for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
    ldflags+=" -X $pkg.gitVersion=$K8S_VERSION"
    ldflags+=" -X $pkg.gitCommit="
    ldflags+=" -X $pkg.gitMajor=1"
    ldflags+=" -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitTreeState=archive"
    ldflags+=" -X $pkg.buildDate=$build_date"
  done

  local out="$K8S_BIN.tmp.$$"
  rm -rf "$out"; mkdir -p "$out"
  local pkgs=(); for t in "${K8S_TOOLS[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$t"); done
  t0=$SECONDS
  (cd "$dir" && "$GO" build -trimpath -p "$JOBS" -ldflags "$ldflags" -o "$out/" "${pkgs[@]}") \
    || { rm -rf "$out"; die "go build of ${K8S_TOOLS[*]} failed"; }
  log "  go build: $((SECONDS - t0)) s"

  rm -rf "$K8S_BIN"; mv "$out" "$K8S_BIN"
  k8s_ok || die "built binaries in $K8S_BIN do not report Kubernetes $K8S_VERSION"
  log "  done in $((SECONDS - start)) s -> $K8S_BIN"
}

# --- etcd ----------------------------------------------------------------------------

build_etcd() {
  local start=$SECONDS
  local dir="$CACHE/src/etcd-tools-$ETCD_VERSION"
  log "building etcd $ETCD_VERSION in $dir"
  local etcd_mod
  etcd_mod="$(modfile_of go.etcd.io/etcd/server/v3 "$ETCD_VERSION")"
  [[ -f "$etcd_mod" ]] || die "could not download go.mod of go.etcd.io/etcd/server/v3@$ETCD_VERSION"
  local go_directive
  go_directive="$(sed -n 's/^go \([0-9.]*\)$/\1/p' "$etcd_mod")"

  rm -rf "$dir"; mkdir -p "$dir"
  cat >"$dir/go.mod" <<EOF
// Generated by keyshift hack/build-control-plane.sh; throwaway.
module keyshift.invalid/etcd-tools

go ${go_directive:-1.26.0}

require go.etcd.io/etcd/server/v3 $ETCD_VERSION

tool go.etcd.io/etcd/server/v3
EOF
  local t0=$SECONDS
  (cd "$dir" && "$GO" mod tidy) || die "go mod tidy failed in $dir"
  log "  go mod tidy: $((SECONDS - t0)) s"

  local out="$ETCD_BIN.tmp.$$"
  rm -rf "$out"; mkdir -p "$out"
  t0=$SECONDS
  (cd "$dir" && "$GO" build -trimpath -p "$JOBS" \
      -ldflags "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=$ETCD_VERSION" \
      -o "$out/etcd" go.etcd.io/etcd/server/v3) \
    || { rm -rf "$out"; die "go build of etcd failed"; }
  log "  go build: $((SECONDS - t0)) s"

  rm -rf "$ETCD_BIN"; mv "$out" "$ETCD_BIN"
  etcd_ok || die "built etcd in $ETCD_BIN does not report $ETCD_VERSION"
  log "  done in $((SECONDS - start)) s -> $ETCD_BIN"
}

# --- main ----------------------------------------------------------------------------

total=$SECONDS
if etcd_ok; then log "etcd $ETCD_VERSION: cached in $ETCD_BIN"; else build_etcd; fi
if k8s_ok; then log "kubernetes $K8S_VERSION: cached in $K8S_BIN"; else build_k8s; fi
log "total: $((SECONDS - total)) s"

echo "K8S_BIN=$K8S_BIN"
echo "ETCD_BIN=$ETCD_BIN"
