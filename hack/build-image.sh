#!/usr/bin/env bash
# Build the keyshift container image from this checkout without a container daemon: a static
# release binary packed into a docker-archive tarball with the layout of the Dockerfile's final
# stage (tests/image.rs keeps the two in step):
#
#   /keyshift                            0755, the ENTRYPOINT
#   /tmp                                 1777
#   /etc/ssl/certs/ca-certificates.crt   0644, SSL_CERT_FILE
#   USER 65532:65532
#
# and, from the same build, the job template's image (crates/keyshift-job-template: its worker
# binary `threshold` as the ENTRYPOINT, the same layout otherwise; its Dockerfile's final stage),
# which the e2e tier runs as a user's own job image.
#
#   hack/build-image.sh        # prints IMAGE=<ref>, IMAGE_TAR=<file>, JOB_IMAGE=<ref> and
#                              # JOB_IMAGE_TAR=<file> on stdout
#
# The Dockerfile builds on Alpine (musl); here, without Alpine or the musl target, the binaries
# are the gnu target linked statically (`-C target-feature=+crt-static`, a static-pie). Before
# packing, each binary is run alone in the image's root filesystem as UID 65532 (`chroot`), which
# proves it needs nothing else from the image.
#
# Environment:
#   CARGO_TARGET_DIR         cargo's target dir (default ./target)
#   KEYSHIFT_IMAGE_REPO      image repository (default keyshift.local/keyshift)
#   KEYSHIFT_JOB_IMAGE_REPO  the template job's image repository (default keyshift.local/threshold)
#   KEYSHIFT_IMAGE_PROFILE   cargo profile (default release)
set -euo pipefail
exec 3>&1 1>&2

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
REPO="${KEYSHIFT_IMAGE_REPO:-keyshift.local/keyshift}"
JOB_REPO="${KEYSHIFT_JOB_IMAGE_REPO:-keyshift.local/threshold}"
PROFILE="${KEYSHIFT_IMAGE_PROFILE:-release}"
TRIPLE=x86_64-unknown-linux-gnu
CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt

log() { printf '[build-image] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[[ -s "$CA_BUNDLE" ]] || die "no CA bundle at $CA_BUNDLE (Debian's ca-certificates package)"

t0=$SECONDS
# --target keeps RUSTFLAGS off build scripts and proc macros (they run on the host). Both
# binaries in one build: they share every dependency, built once with the same features.
(cd "$ROOT" && OPENSSL_STATIC=1 LIBZ_SYS_STATIC=1 RUSTFLAGS="-C target-feature=+crt-static" CARGO_TARGET_DIR="$TARGET_DIR" \
  cargo build --locked --profile "$PROFILE" --target "$TRIPLE" -p keyshift -p keyshift-job-template --features keyshift/kafka,keyshift-job-template/kafka --bin keyshift --bin threshold) \
  || die "cargo build of the static binaries failed"
profile_dir="$PROFILE"; [[ "$PROFILE" == dev ]] && profile_dir=debug
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/Cargo.toml" | head -n1)"
out_dir="$TARGET_DIR/image"
mkdir -p "$out_dir"

# pack NAME REPO: the image of binary NAME (its ENTRYPOINT /NAME) as REPO:<version>-<sum>;
# prints the reference and the tarball's path, one a line.
pack() {
  local name="$1" repo="$2" bin sum ref out rootfs got
  bin="$TARGET_DIR/$TRIPLE/$profile_dir/$name"
  [[ -x "$bin" ]] || die "no binary at $bin"
  log "static binary $name: $bin ($(stat -c %s "$bin") bytes)"
  sum="$(sha256sum "$bin" | cut -c1-12)"
  ref="$repo:$version-$sum"
  out="$out_dir/$name-$version-$sum.tar"
  if [[ -s "$out" ]]; then
    log "cached: $out"
  else
    rootfs="$(mktemp -d)"
    chmod 0755 "$rootfs"
    install -D -m 0755 "$bin" "$rootfs/$name"
    install -d -m 1777 "$rootfs/tmp"
    install -D -m 0644 "$CA_BUNDLE" "$rootfs/etc/ssl/certs/ca-certificates.crt"
    # The binary alone in the image's filesystem, as the image's user: no libc, no loader.
    got="$(chroot --userspec=65532:65532 "$rootfs" "/$name" --version)" \
      || { rm -rf "$rootfs"; die "$name does not run alone in the image's root filesystem"; }
    log "in the image as 65532: $got"
    # Older tarballs of this checkout's builds are not needed any more.
    find "$out_dir" -maxdepth 1 -name "$name-*.tar" -delete
    "$ROOT/hack/pack-image.sh" --ref "$ref" --rootfs "$rootfs" --out "$out" \
      --entrypoint "/$name" --user 65532:65532 --env "SSL_CERT_FILE=$CA_BUNDLE" >&2 \
      || { rm -rf "$rootfs"; die "packing $name's image failed"; }
    rm -rf "$rootfs"
  fi
  printf '%s\n%s\n' "$ref" "$out"
}
{ read -r ref; read -r tar; } < <(pack keyshift "$REPO")
{ read -r job_ref; read -r job_tar; } < <(pack threshold "$JOB_REPO")
log "images in $((SECONDS - t0)) s"
echo "IMAGE=$ref" >&3
echo "IMAGE_TAR=$tar" >&3
echo "JOB_IMAGE=$job_ref" >&3
echo "JOB_IMAGE_TAR=$job_tar" >&3
