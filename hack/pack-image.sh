#!/usr/bin/env bash
# Pack a directory into a single-layer container image, without a container daemon: a
# docker-archive tarball (manifest.json + image config + layer tar), which
# `ctr -n k8s.io images import` loads into containerd.
#
#   hack/pack-image.sh --ref REF --rootfs DIR --out FILE.tar \
#       [--entrypoint PATH] [--user UID:GID] [--env K=V]...
#
# The layer holds DIR's files with their modes, owned by 0:0, with mtime 0 and sorted names,
# so the same inputs give a byte-identical archive. Prints the image's config digest.
set -euo pipefail

ref="" rootfs="" out="" entrypoint="" user=""
envs=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --ref) ref="$2"; shift 2 ;;
    --rootfs) rootfs="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --entrypoint) entrypoint="$2"; shift 2 ;;
    --user) user="$2"; shift 2 ;;
    --env) envs+=("$2"); shift 2 ;;
    *) echo "pack-image: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -n "$ref" && -d "$rootfs" && -n "$out" ]] || { echo "pack-image: --ref, --rootfs DIR and --out are required" >&2; exit 2; }

# JSON string literal of $1 (the values here are paths, refs and K=V words).
json_str() {
  local s="${1//\\/\\\\}"
  s="${s//\"/\\\"}"
  printf '"%s"' "$s"
}

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# The layer: every entry of rootfs, without a leading "./".
entries=()
while IFS= read -r -d '' e; do entries+=("${e#./}"); done < <(cd "$rootfs" && find . -mindepth 1 -maxdepth 1 -print0 | sort -z)
tar -C "$rootfs" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 --format=posix \
  --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
  -cf "$work/layer.tar" "${entries[@]}"
diff_id="$(sha256sum "$work/layer.tar" | cut -d' ' -f1)"

env_json=""
for e in "${envs[@]}"; do env_json+="${env_json:+,}$(json_str "$e")"; done
config="{\"architecture\":\"amd64\",\"os\":\"linux\",\"config\":{"
config+="\"Env\":[${env_json}]"
[[ -n "$entrypoint" ]] && config+=",\"Entrypoint\":[$(json_str "$entrypoint")]"
[[ -n "$user" ]] && config+=",\"User\":$(json_str "$user")"
config+="},\"rootfs\":{\"type\":\"layers\",\"diff_ids\":[\"sha256:$diff_id\"]},"
config+="\"history\":[{\"created_by\":\"keyshift hack/pack-image.sh\"}]}"
printf '%s' "$config" >"$work/config.json"
config_id="$(sha256sum "$work/config.json" | cut -d' ' -f1)"

mkdir -p "$work/archive/$diff_id"
mv "$work/layer.tar" "$work/archive/$diff_id/layer.tar"
mv "$work/config.json" "$work/archive/$config_id.json"
printf '[{"Config":"%s.json","RepoTags":[%s],"Layers":["%s/layer.tar"]}]' \
  "$config_id" "$(json_str "$ref")" "$diff_id" >"$work/archive/manifest.json"
tar -C "$work/archive" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 \
  -cf "$out.tmp" manifest.json "$config_id.json" "$diff_id"
mv "$out.tmp" "$out"
echo "sha256:$config_id"
