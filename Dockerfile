# syntax=docker/dockerfile:1
#
# The keyshift image: the single static `keyshift` binary (operator, worker and CLI) on an empty
# base, running as UID/GID 65532. The Helm chart runs it as `keyshift operator ...`; the operator
# starts worker pods from the same image as `keyshift worker ...`.
#
#   docker build -t ghcr.io/keyshift/keyshift:0.1.0 .
#
# The build stage uses the official Rust image on Alpine, whose native target is musl, so the
# release binary is statically linked. The product build has the `kafka` feature: librdkafka is
# compiled from its bundled source by its configure script (make, perl, bash) against Alpine's
# static OpenSSL and zlib (OPENSSL_STATIC, LIBZ_SYS_STATIC), as hack/build-image.sh does on glibc.
# It builds for the platform it runs on; build on (or emulate) the target platform for other
# architectures. Not built in this project's CI: its machines have no container engine (CI builds
# the same binary, features and files with hack/build-image.sh; tests/image.rs keeps them equal).

ARG RUST_VERSION=1.95

FROM rust:${RUST_VERSION}-alpine AS build
# gcc + musl-dev: aws-lc-sys's C parts (aws-lc-rs is the TLS crypto provider of the Kubernetes
# and object-store clients; aws-lc-sys uses its plain cc build on x86_64/aarch64 musl).
# make, perl, bash, linux-headers and the static OpenSSL and zlib: librdkafka (feature kafka).
RUN apk add --no-cache gcc musl-dev ca-certificates make perl bash linux-headers \
    openssl-dev openssl-libs-static zlib-dev zlib-static
ENV OPENSSL_STATIC=1 LIBZ_SYS_STATIC=1
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY crates ./crates
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --features kafka --bin keyshift \
    && install -D -m 0755 target/release/keyshift /out/keyshift \
    && install -d -m 1777 /out/tmp \
    && install -D -m 0644 /etc/ssl/certs/ca-certificates.crt /out/etc/ssl/certs/ca-certificates.crt

FROM scratch
COPY --from=build /out/ /
ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
USER 65532:65532
# Proves at build time that the binary runs with no libc or shell in the image.
RUN ["/keyshift", "--version"]
ENTRYPOINT ["/keyshift"]
