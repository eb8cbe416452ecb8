#!/usr/bin/env bash
# Regenerate tests/data/flink_vectors.json: reference vectors for Flink's
# key-group math computed by the real Apache Flink classes
# (KeyGroupRangeAssignment from flink-runtime, MathUtils from flink-core).
#
# Requires: JDK 11+ (javac/java) and Maven with access to Maven Central.
# Jars are resolved into the local Maven repository and copied to a scratch
# dir under target/ (git-ignored); nothing binary is written into the repo.
#
# Usage: hack/flink-vectors.sh [OUTPUT]   (OUTPUT defaults to
#        tests/data/flink_vectors.json; "-" prints the JSON to stdout)
# Env:   FLINK_VERSION (default 1.20.3), BUILD_DIR (default target/flink-vectors)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FLINK_VERSION="${FLINK_VERSION:-1.20.3}"
BUILD_DIR="${BUILD_DIR:-$ROOT/target/flink-vectors}"
OUT="${1:-$ROOT/tests/data/flink_vectors.json}"
DEP_PLUGIN="org.apache.maven.plugins:maven-dependency-plugin:3.8.1"

# Minimal set needed to load and run KeyGroupRangeAssignment + MathUtils.
ARTIFACTS=(
  "org.apache.flink:flink-core:${FLINK_VERSION}"
  "org.apache.flink:flink-runtime:${FLINK_VERSION}"
)

LIB="$BUILD_DIR/lib-$FLINK_VERSION"
CLASSES="$BUILD_DIR/classes-$FLINK_VERSION"
mkdir -p "$LIB"
rm -rf "$CLASSES"
mkdir -p "$CLASSES"

for a in "${ARTIFACTS[@]}"; do
  IFS=: read -r _g art ver <<<"$a"
  if [[ ! -f "$LIB/$art-$ver.jar" ]]; then
    echo "fetching $a" >&2
    if ! log="$(mvn -q -B -Dstyle.color=never "$DEP_PLUGIN:copy" \
        -Dartifact="$a" -DoutputDirectory="$LIB" 2>&1)"; then
      echo "$log" >&2
      echo "error: could not fetch $a" >&2
      exit 1
    fi
  fi
done

CP="$LIB/*"
javac -nowarn -encoding UTF-8 -d "$CLASSES" -cp "$CP" "$ROOT/hack/flink-vectors/FlinkVectors.java"

if [[ "$OUT" == "-" ]]; then
  java -cp "$CLASSES:$CP" FlinkVectors "$FLINK_VERSION"
else
  mkdir -p "$(dirname "$OUT")"
  tmp="$(mktemp "$OUT.XXXXXX")"
  trap 'rm -f "$tmp"' EXIT
  java -cp "$CLASSES:$CP" FlinkVectors "$FLINK_VERSION" >"$tmp"
  mv "$tmp" "$OUT"
  trap - EXIT
  echo "wrote $OUT ($(wc -c <"$OUT") bytes, Flink $FLINK_VERSION)" >&2
fi
