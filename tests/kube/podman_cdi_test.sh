#!/usr/bin/env bash
# Runs a container with a fracgpu claim's CDI device in podman and checks,
# inside it, what a tenant container must see (docs/kubernetes.md,
# docs/security.md): LD_PRELOAD naming the interposer, which is there and
# read-only; FRACGPU_TENANT_DIR and FRACGPU_UNMANAGED; the tenant's directory
# read-only at /run/fracgpu/tenant with exactly the host directory's files;
# its usage file alone writable; nothing else of the run dir.
#
# Usage: podman_cdi_test.sh [--spec-dir DIR --id CDI_ID | --broken-spec]
#   --spec-dir, --id: a CDI spec dir and device the kubelet plugin wrote
#     (e.g. /var/run/cdi and gpu.fracgpu.io/claim=<uid>). Without them the
#     test writes a spec of the plugin's shape for a made-up claim.
#   --broken-spec: that made-up spec with the tenant directory mounted
#     read-write; succeeds only if the checks reject it (they can fail).
#
# Needs root, podman, busybox-static (the container's image is made from it:
# no registry is reached) and mount namespaces. The spec directory is shown
# to podman alone, through a private mount of /run/cdi (and /etc/cdi), so the
# host's CDI specs are neither read nor changed. Exit 77 (skipped) when
# something it needs is missing, saying what.
set -euo pipefail
SKIP=77
skip() { echo "SKIPPED: $*"; exit "$SKIP"; }
fail() { echo "FAIL: $*" >&2; exit 1; }

spec_dir= cdi_id= broken=false
while [[ $# -gt 0 ]]; do
  case $1 in
    --spec-dir) spec_dir=$2; shift 2 ;;
    --id) cdi_id=$2; shift 2 ;;
    --broken-spec) broken=true; shift ;;
    *) echo "usage: $0 [--spec-dir DIR --id CDI_ID | --broken-spec]" >&2; exit 2 ;;
  esac
done
[[ -z $spec_dir && -z $cdi_id ]] || [[ -n $spec_dir && -n $cdi_id ]] || fail "--spec-dir and --id go together"
[[ $broken == false || -z $spec_dir ]] || fail "--broken-spec makes its own spec"

[[ $(id -u) -eq 0 ]] || skip "needs root (rootful podman, mount namespaces)"
command -v podman >/dev/null || skip "podman is not installed (Debian: apt-get install podman)"
# The image holds nothing but busybox: it must not need a dynamic loader.
busybox=
for candidate in /bin/busybox /usr/bin/busybox; do
  if [[ -x $candidate ]] && ! readelf -l "$candidate" 2>/dev/null | grep -q "program interpreter"; then
    busybox=$candidate
    break
  fi
done
[[ -n $busybox ]] || skip "a static busybox is not installed (Debian: apt-get install busybox-static)"
unshare --mount --propagation private true 2>/dev/null || skip "cannot make a mount namespace here"

tmp=$(mktemp -d /tmp/fracgpu-podman-cdi-XXXXXX)
image=localhost/fracgpu-cdi-test:$(basename "$tmp" | tr 'A-Z' 'a-z' | tr -dc 'a-z0-9-')
created_mountpoints=()
cleanup() {
  podman rmi -f "$image" >/dev/null 2>&1 || true
  for d in "${created_mountpoints[@]}"; do rmdir "$d" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT

# ---- The spec: the plugin's, or one of its shape (k8s contract) ----
if [[ -z $spec_dir ]]; then
  uid=0f6b2c1e-8d4a-4c55-9a61-3f2b7c9e0d14
  tenant_dir=$tmp/run/tenants/dra-$uid
  mkdir -p "$tenant_dir" "$tmp/lib"
  printf 'policy\n' >"$tenant_dir/policy"
  printf 'usage\n' >"$tenant_dir/usage"
  # Another tenant's directory beside it: the container must not see it.
  mkdir -p "$tmp/run/tenants/dra-other" && printf 'secret\n' >"$tmp/run/tenants/dra-other/usage"
  printf 'not a real interposer\n' >"$tmp/lib/libfracgpu.so"
  spec_dir=$tmp/cdi
  cdi_id=gpu.fracgpu.io/claim=$uid
  tenant_mode=ro
  $broken && tenant_mode=rw
  mkdir -p "$spec_dir"
  cat >"$spec_dir/gpu.fracgpu.io-claim_$uid.json" <<EOF
{
  "cdiVersion": "0.6.0",
  "kind": "gpu.fracgpu.io/claim",
  "devices": [{
    "name": "$uid",
    "containerEdits": {
      "env": ["LD_PRELOAD=/usr/lib/fracgpu/libfracgpu.so", "FRACGPU_TENANT_DIR=/run/fracgpu/tenant",
              "FRACGPU_UNMANAGED=deny"],
      "mounts": [
        {"hostPath": "$tenant_dir", "containerPath": "/run/fracgpu/tenant", "options": ["$tenant_mode", "nosuid", "nodev", "bind"]},
        {"hostPath": "$tenant_dir/usage", "containerPath": "/run/fracgpu/tenant/usage",
         "options": ["rw", "nosuid", "nodev", "bind"]},
        {"hostPath": "$tmp/lib/libfracgpu.so", "containerPath": "/usr/lib/fracgpu/libfracgpu.so",
         "options": ["ro", "nosuid", "nodev", "bind"]}
      ]
    }
  }]
}
EOF
fi
[[ -d $spec_dir ]] || fail "$spec_dir is not a directory"
# The device's host tenant directory and the version, from the spec naming it.
read -r spec_file spec_version host_tenant_dir < <(python3 - "$spec_dir" "$cdi_id" <<'PY'
import json, pathlib, sys
spec_dir, cdi_id = pathlib.Path(sys.argv[1]), sys.argv[2]
kind, _, name = cdi_id.partition("=")
for path in sorted(spec_dir.glob("*.json")):
    spec = json.loads(path.read_text())
    if spec.get("kind") != kind:
        continue
    for device in spec.get("devices", []):
        if device.get("name") == name:
            mounts = device.get("containerEdits", {}).get("mounts", [])
            tenant = [m["hostPath"] for m in mounts if m.get("containerPath") == "/run/fracgpu/tenant"]
            print(path, spec.get("cdiVersion"), tenant[0] if tenant else "-")
            sys.exit(0)
sys.exit(f"no spec in {spec_dir} has device {cdi_id}")
PY
) || fail "the spec of $cdi_id"
[[ $host_tenant_dir != - ]] || fail "$spec_file: $cdi_id mounts nothing at /run/fracgpu/tenant"

# ---- The image: a static busybox, imported from a local tarball ----
mkdir -p "$tmp/rootfs/bin" "$tmp/rootfs/proc" "$tmp/rootfs/sys" "$tmp/rootfs/dev" "$tmp/rootfs/etc" "$tmp/rootfs/tmp"
cp "$busybox" "$tmp/rootfs/bin/busybox"
for applet in sh true cat ls env test grep touch echo tr; do ln -s busybox "$tmp/rootfs/bin/$applet"; done
tar -C "$tmp/rootfs" -cf "$tmp/rootfs.tar" .
podman import "$tmp/rootfs.tar" "$image" >/dev/null 2>"$tmp/import.log" || { cat "$tmp/import.log"; skip "podman import failed"; }

# Lowered file and process limits: podman's defaults raise them, which a
# container runtime without CAP_SYS_RESOURCE cannot do ("setrlimit
# RLIMIT_NOFILE: Operation not permitted").
run_opts=(--rm --pull=never --network=none --ulimit nofile=1024:1024 --ulimit nproc=1024:1024)
# The runtime: podman's default, else runc (crun 1.8 refuses hosts whose
# cgroup v2 hierarchy has controllers beside v1 ones: "cgroups in hybrid
# mode not supported").
runtime=()
if ! podman run "${run_opts[@]}" "$image" /bin/true >"$tmp/probe.log" 2>&1; then
  if command -v runc >/dev/null && podman --runtime runc run "${run_opts[@]}" "$image" /bin/true >"$tmp/probe-runc.log" 2>&1; then
    runtime=(--runtime runc)
    echo "note: podman's default runtime cannot run a container here ($(tail -1 "$tmp/probe.log")); using runc"
  else
    skip "podman cannot run a container here: $(tail -1 "$tmp/probe.log") $(tail -1 "$tmp/probe-runc.log" 2>/dev/null || true)"
  fi
fi

# What the container reports: its environment, its mounts under
# /run/fracgpu and of the interposer, what it can list, read and write.
inside='
echo "env LD_PRELOAD=$LD_PRELOAD"
echo "env FRACGPU_TENANT_DIR=$FRACGPU_TENANT_DIR"
echo "env FRACGPU_UNMANAGED=$FRACGPU_UNMANAGED"
grep -E " (/run/fracgpu[^ ]*|$LD_PRELOAD) " /proc/mounts | while read -r _ path _ options _; do echo "mount $path ${options%%,*}"; done
echo "run-dir $(ls -A /run/fracgpu | tr "\n" " ")"
echo "tenant-dir $(ls -A /run/fracgpu/tenant | tr "\n" " ")"
# Writable: opened for appending, nothing written (test -w is always true
# for root in busybox, read-only mount or not).
writable() { (: >>"$1") 2>/dev/null; }
cat "$LD_PRELOAD" >/dev/null && echo "library readable"
writable "$LD_PRELOAD" && echo "library writable"
writable /run/fracgpu/tenant/usage && echo "usage writable"
writable /run/fracgpu/tenant/policy && echo "policy writable"
writable /run/fracgpu/tenant/planted && echo "tenant-dir writable"
true
'

# In a private mount namespace: /run/cdi (= /var/run/cdi) shows only the spec
# under test, /etc/cdi nothing.
run_in_podman() {
  local dir=$1
  for d in /run/cdi /etc/cdi; do
    if [[ ! -d $d ]]; then mkdir -p "$d"; created_mountpoints+=("$d"); fi
  done
  unshare --mount --propagation private bash -euo pipefail -c '
    mount -t tmpfs -o size=1m,mode=0755 fracgpu-cdi-test /run/cdi
    mount -t tmpfs -o size=1m,mode=0755 fracgpu-cdi-test /etc/cdi
    cp "$1"/*.json /run/cdi/
    shift
    exec podman "$@"
  ' _ "$dir" "${runtime[@]}" run "${run_opts[@]}" --device "$cdi_id" "$image" /bin/sh -c "$inside"
}

if ! run_in_podman "$spec_dir" >"$tmp/out.log" 2>"$tmp/err.log"; then
  # podman's CDI library may predate the spec's version (Debian 12's podman
  # 4.3 reads up to 0.5.0). The mounts and environment are the same in 0.5.0
  # as long as the spec uses nothing newer (annotations came in 0.6.0): then
  # run that, and say so.
  newer_than_podman_reads=false
  if grep -q "unresolvable CDI devices" "$tmp/err.log" &&
     [[ $(printf '%s\n' 0.5.0 "$spec_version" | sort -V | tail -1) != 0.5.0 ]]; then
    newer_than_podman_reads=true
  fi
  if $newer_than_podman_reads && grep -q '"annotations"' "$spec_file"; then
    skip "podman $(podman --version | awk '{print $3}') cannot read CDI spec version $spec_version, and the spec" \
         "uses annotations (0.6.0), so it cannot be checked as 0.5.0"
  fi
  if $newer_than_podman_reads; then
    echo "note: podman $(podman --version | awk '{print $3}') cannot read CDI spec version $spec_version" \
         "(\"$(tail -1 "$tmp/err.log")\"); checking the same spec as version 0.5.0, which has the same container edits"
    mkdir -p "$tmp/cdi-0.5.0"
    sed 's/"cdiVersion": *"[^"]*"/"cdiVersion": "0.5.0"/' "$spec_file" >"$tmp/cdi-0.5.0/$(basename "$spec_file")"
    run_in_podman "$tmp/cdi-0.5.0" >"$tmp/out.log" 2>"$tmp/err.log" ||
      { cat "$tmp/err.log"; fail "podman run --device $cdi_id (spec as 0.5.0)"; }
  else
    cat "$tmp/err.log"; fail "podman run --device $cdi_id"
  fi
fi
cat "$tmp/out.log"

out=$tmp/out.log
problems=()
expect() { grep -qxF -- "$1" "$out" || problems+=("expected \"$1\""); }
refuse() { ! grep -qxF -- "$1" "$out" || problems+=("\"$1\""); }
expect "env LD_PRELOAD=/usr/lib/fracgpu/libfracgpu.so"
expect "env FRACGPU_TENANT_DIR=/run/fracgpu/tenant"
expect "env FRACGPU_UNMANAGED=deny"
expect "mount /run/fracgpu/tenant ro"
expect "mount /run/fracgpu/tenant/usage rw"
expect "mount /usr/lib/fracgpu/libfracgpu.so ro"
expect "library readable"
refuse "library writable"
expect "usage writable"
refuse "policy writable"
refuse "tenant-dir writable"
expect "run-dir tenant "
expect "tenant-dir $(LC_ALL=C ls -A "$host_tenant_dir" | tr '\n' ' ')"
[[ $(grep -c "^mount " "$out") -eq 3 ]] || problems+=("mounts under /run/fracgpu other than the three of the spec")

if $broken; then
  printf '%s\n' "${problems[@]}" | grep -q "policy writable" ||
    fail "a spec mounting the tenant directory read-write was not rejected (problems: ${problems[*]:-none})"
  echo "a spec mounting the tenant directory read-write is rejected: ${problems[*]}"
  exit 0
fi
if [[ ${#problems[@]} -gt 0 ]]; then
  printf 'FAIL: inside the container: %s\n' "${problems[@]}" >&2
  exit 1
fi
echo "podman run --device $cdi_id: environment and mounts as a tenant container needs them"
