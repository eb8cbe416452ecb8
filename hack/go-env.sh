# Sourced by the hack/build-*.sh scripts that build Go modules: finds the Go toolchain and
# settles how it builds. Expects `die` to be defined.

# Find a Go toolchain: $GO, `go` on PATH, or the usual install location.
if [[ -z "${GO:-}" ]]; then
  if command -v go >/dev/null 2>&1; then GO="$(command -v go)"
  elif [[ -x /usr/local/go/bin/go ]]; then GO=/usr/local/go/bin/go
  else die "no Go toolchain found (set GO=/path/to/go)"; fi
fi

# Never let Go download another toolchain; don't stamp VCS info of whatever directory we happen
# to be in.
export GOTOOLCHAIN=local GOFLAGS="-buildvcs=false"

# Path of the go.mod of module $1 at version $2 in the module cache (downloads it).
modfile_of() {
  "$GO" mod download -json "$1@$2" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p'
}
