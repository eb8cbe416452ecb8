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
#   hack/build-image.sh        # prints IMAGE=<ref> and IMAGE_TAR=<file> on stdout
#
# The Dockerfile builds on Alpine (musl); here, without Alpine or the musl target, the binary is
# the gnu target linked statically (`-C target-feature=+crt-static`, a static-pie). Before
# packing, the binary is run alone in the image's root filesystem as UID 65532 (`chroot`), which
# proves it needs nothing else from the image.
#
# Environment:
#   CARGO_TARGET_DIR         cargo's target dir (default ./target)
#   KEYSHIFT_IMAGE_REPO      image repository (default keyshift.local/keyshift)
#   KEYSHIFT_IMAGE_PROFILE   cargo profile (default release)
set -euo pipefail
exec 3>&1 1>&2

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
REPO="${KEYSHIFT_IMAGE_REPO:-keyshift.local/keyshift}"
PROFILE="${KEYSHIFT_IMAGE_PROFILE:-release}"
TRIPLE=x86_64-unknown-linux-gnu
CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt

log() { printf '[build-image] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[[ -s "$CA_BUNDLE" ]] || die "no CA bundle at $CA_BUNDLE (Debian's ca-certificates package)"

t0=$SECONDS
# --target keeps RUSTFLAGS off build scripts and proc macros (they run on the host).
(cd "$ROOT" && OPENSSL_STATIC=1 LIBZ_SYS_STATIC=1 RUSTFLAGS="-C target-feature=+crt-static" CARGO_TARGET_DIR="$TARGET_DIR" \
  cargo build --locked --profile "$PROFILE" --target "$TRIPLE" --features kafka --bin keyshift) \
  || die "cargo build of the static binary failed"
profile_dir="$PROFILE"; [[ "$PROFILE" == dev ]] && profile_dir=debug
bin="$TARGET_DIR/$TRIPLE/$profile_dir/keyshift"
[[ -x "$bin" ]] || die "no binary at $bin"
log "static binary in $((SECONDS - t0)) s: $bin ($(stat -c %s "$bin") bytes)"

version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/Cargo.toml" | head -n1)"
sum="$(sha256sum "$bin" | cut -c1-12)"
ref="$REPO:$version-$sum"
out_dir="$TARGET_DIR/image"
out="$out_dir/keyshift-$version-$sum.tar"
if [[ -s "$out" ]]; then
  log "cached: $out"
else
  mkdir -p "$out_dir"
  rootfs="$(mktemp -d)"
  chmod 0755 "$rootfs"
  trap 'rm -rf "$rootfs"' EXIT
  install -D -m 0755 "$bin" "$rootfs/keyshift"
  install -d -m 1777 "$rootfs/tmp"
  install -D -m 0644 "$CA_BUNDLE" "$rootfs/etc/ssl/certs/ca-certificates.crt"
  # The binary alone in the image's filesystem, as the image's user: no libc, no loader.
  got="$(chroot --userspec=65532:65532 "$rootfs" /keyshift --version)" \
    || die "the binary does not run alone in the image's root filesystem"
  log "in the image as 65532: $got"
  # Older tarballs of this checkout's builds are not needed any more.
  find "$out_dir" -maxdepth 1 -name 'keyshift-*.tar' -delete
  "$ROOT/hack/pack-image.sh" --ref "$ref" --rootfs "$rootfs" --out "$out" \
    --entrypoint /keyshift --user 65532:65532 --env "SSL_CERT_FILE=$CA_BUNDLE" >&2
fi
echo "IMAGE=$ref" >&3
echo "IMAGE_TAR=$out" >&3
