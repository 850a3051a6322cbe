#!/usr/bin/env bash
# The DaemonSet's image, built and run as an admin would (docs/kubernetes.md,
# "The image"): a Debian 12 base made from Debian's archive with debootstrap
# and imported into podman (no registry), the two wheels the Containerfile
# needs fetched beforehand into deploy/wheels/, then
#   podman build --build-arg DEBIAN_IMAGE=localhost/debian:bookworm -f deploy/Containerfile .
# and, inside the image: fracgpud --version, fracgpu-kubelet-plugin --help,
# and the fracgpud container's start script from deploy/daemonset.yaml with a
# stand-in nvidia-smi (a GPU listed: the node config written and fracgpud
# started on it; a UUID of an unexpected form: refused). Prints the image's
# size and the time each step took.
#
# Usage: image_build_test.sh SOURCE_DIR VERSION
# Exit 77 (skipped) only when podman or debootstrap is missing, the source
# is not a git checkout, or Debian's archive or PyPI cannot be reached; any
# other failure fails.
set -euo pipefail
src=$1
version=$2
skip() { echo "SKIPPED: $*"; exit 77; }
command -v podman >/dev/null || skip "no podman"
command -v debootstrap >/dev/null || skip "no debootstrap (scripts/install-deps.sh installs it)"
# The build context is the tracked source (below): it needs a git checkout.
git -C "$src" rev-parse --git-dir >/dev/null 2>&1 || skip "$src is not a git checkout (or git is missing): no tracked source to build from"
work=$(mktemp -d /tmp/fracgpu-image-XXXXXX)
base=localhost/debian:bookworm
image=localhost/fracgpu:image-test-$$
cleanup() {
  podman rmi -f "$image" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
seconds() { echo $(( $(date +%s) - $1 )); }

t=$(date +%s)
if ! podman image exists "$base"; then
  debootstrap --variant=minbase bookworm "$work/rootfs" http://deb.debian.org/debian >"$work/debootstrap.log" 2>&1 ||
    { tail -5 "$work/debootstrap.log"; skip "debootstrap of bookworm from deb.debian.org failed (no archive?)"; }
  tar -C "$work/rootfs" -c . | podman import - "$base" >/dev/null
  rm -rf "$work/rootfs"
fi
echo "base $base: $(seconds "$t") s"

# The build context: the tracked source, as a clean checkout has it.
t=$(date +%s)
mkdir "$work/ctx"
git -C "$src" ls-files -z | (cd "$src" && tar --null -T - -c) | tar -C "$work/ctx" -x
wheel_arg() { sed -n "s/^ARG $1=//p" "$src/deploy/Containerfile"; }
python3 -m pip download -q --no-deps -d "$work/ctx/deploy/wheels" "$(wheel_arg CMAKE_WHEEL)" \
  "$(wheel_arg CUDA_RUNTIME_WHEEL)" >"$work/pip.log" 2>&1 || { cat "$work/pip.log"; skip "the wheels cannot be fetched"; }
echo "context and wheels: $(seconds "$t") s"

t=$(date +%s)
(cd "$work/ctx" && podman build --pull=never --build-arg "DEBIAN_IMAGE=$base" -f deploy/Containerfile -t "$image" .) \
  >"$work/build.log" 2>&1 || { tail -40 "$work/build.log"; fail "podman build"; }
echo "build: $(seconds "$t") s"
size=$(podman image inspect --format '{{.Size}}' "$image")
echo "image size: $size bytes ($(( size / 1000000 )) MB)"

# Limits the sandboxes this runs in allow (podman's defaults may be above them).
run=(podman run --rm --pull=never --network=none --ulimit nofile=1024:1024 --ulimit nproc=1024:1024)
out=$("${run[@]}" "$image" fracgpud --version) || fail "fracgpud --version"
[ "$out" = "fracgpud $version" ] || fail "fracgpud --version printed '$out', not 'fracgpud $version'"
"${run[@]}" "$image" fracgpu-kubelet-plugin --help >"$work/plugin-help" || fail "fracgpu-kubelet-plugin --help"
grep -q -- "--node-name" "$work/plugin-help" || fail "fracgpu-kubelet-plugin --help names no --node-name"
"${run[@]}" "$image" fracgpu --help >/dev/null || fail "fracgpu --help"
"${run[@]}" "$image" test -f /usr/lib/fracgpu/libfracgpu.so || fail "no /usr/lib/fracgpu/libfracgpu.so"

# The fracgpud container's start script, as the DaemonSet runs it.
python3 - "$src/deploy/daemonset.yaml" "$work/start.sh" <<'PY'
import sys, yaml
ds = next(d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d.get("kind") == "DaemonSet")
c = next(c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "fracgpud")
assert c["command"][:4] == ["bash", "-euo", "pipefail", "-c"], c["command"][:4]
open(sys.argv[2], "w").write(c["command"][4])
PY
mkdir -p "$work/etc" "$work/node" "$work/bin"
printf '[daemon]\nrun_dir = "/run/fracgpu"\nmetrics_address = "off"\n' >"$work/etc/fracgpud.toml"
start() {  # $1: what the stand-in nvidia-smi prints
  printf '#!/bin/sh\necho "%s"\n' "$1" >"$work/bin/nvidia-smi"
  chmod +x "$work/bin/nvidia-smi"
  rm -f "$work/node/fracgpud.toml"
  "${run[@]}" -v "$work/bin/nvidia-smi:/usr/local/bin/nvidia-smi:ro" -v "$work/start.sh:/start.sh:ro" \
    -v "$work/etc:/etc/fracgpu:ro" -v "$work/node:/var/lib/fracgpu-node" \
    -e FRACGPU_BASE_CONFIG=/etc/fracgpu/fracgpud.toml -e FRACGPU_NODE_CONFIG=/var/lib/fracgpu-node/fracgpud.toml \
    "$image" bash -euo pipefail /start.sh >"$work/start.log" 2>&1
}
uuid=GPU-0badc0de-0000-4000-8000-000000000001
rc=0; start "$uuid" || rc=$?
grep -q "uuid = \"$uuid\"" "$work/node/fracgpud.toml" || fail "the start script wrote no [[gpu]] for $uuid"
# No NVIDIA runtime here, so no driver: fracgpud refuses the GPU the config names, by file and line (exit 2).
[ "$rc" = 2 ] && grep -q "fracgpud.toml:[0-9]*: \[\[gpu\]\] uuid \"$uuid\"" "$work/start.log" ||
  { cat "$work/start.log"; fail "fracgpud did not start on the written config and name it (exit $rc)"; }
rc=0; start 'GPU-bad;rm -rf /' || rc=$?
[ "$rc" = 1 ] && grep -q "nvidia-smi listed a GPU UUID of an unexpected form" "$work/start.log" ||
  { cat "$work/start.log"; fail "an odd UUID from nvidia-smi was not refused (exit $rc)"; }
[ ! -e "$work/node/fracgpud.toml" ] || fail "the start script left a config after refusing"
echo "PASS: the image builds ($(( size / 1000000 )) MB), its binaries run, the start script's checks hold"
