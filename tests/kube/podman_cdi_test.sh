#!/usr/bin/env bash
# Runs a container with fracgpu claims' CDI devices in podman and checks,
# inside it, what a tenant container must see (docs/kubernetes.md,
# docs/security.md): LD_PRELOAD naming the interposer, which is there and
# read-only; FRACGPU_UNMANAGED, and no FRACGPU_TENANT_DIR; each claim's
# tenant directory read-only at /run/fracgpu/claims/<claim UID> with exactly
# the host directory's files; its usage file alone writable; nothing else of
# the run dir. With several claims, every claim's directory is there: no
# claim's mounts replaced another's.
#
# Usage: podman_cdi_test.sh [--spec-dir DIR --id CDI_ID [--id CDI_ID...] | --broken-spec | --two-claims]
#   --spec-dir, --id: a CDI spec dir and devices the kubelet plugin wrote
#     (e.g. /var/run/cdi and gpu.fracgpu.io/claim=<uid>). Without them the
#     test writes a spec of the plugin's shape for a made-up claim.
#   --broken-spec: that made-up spec with the tenant directory mounted
#     read-write; succeeds only if the checks reject it (they can fail).
#   --two-claims: two made-up claims' specs, both given to one container.
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

spec_dir= cdi_ids=() broken=false claims=1
while [[ $# -gt 0 ]]; do
  case $1 in
    --spec-dir) spec_dir=$2; shift 2 ;;
    --id) cdi_ids+=("$2"); shift 2 ;;
    --broken-spec) broken=true; shift ;;
    --two-claims) claims=2; shift ;;
    *) echo "usage: $0 [--spec-dir DIR --id CDI_ID [--id CDI_ID...] | --broken-spec | --two-claims]" >&2; exit 2 ;;
  esac
done
[[ -z $spec_dir && ${#cdi_ids[@]} -eq 0 ]] || [[ -n $spec_dir && ${#cdi_ids[@]} -gt 0 ]] ||
  fail "--spec-dir and --id go together"
[[ ($broken == false && $claims == 1) || -z $spec_dir ]] || fail "--broken-spec and --two-claims make their own specs"

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

# ---- The specs: the plugin's, or of its shape (k8s contract) ----
if [[ -z $spec_dir ]]; then
  spec_dir=$tmp/cdi
  mkdir -p "$spec_dir" "$tmp/lib"
  # Another tenant's directory beside them: the container must not see it.
  mkdir -p "$tmp/run/tenants/dra-other" && printf 'secret\n' >"$tmp/run/tenants/dra-other/usage"
  printf 'not a real interposer\n' >"$tmp/lib/libfracgpu.so"
  tenant_mode=ro
  $broken && tenant_mode=rw
  for uid in 0f6b2c1e-8d4a-4c55-9a61-3f2b7c9e0d14 7c3a9e52-1b6d-4f08-8e27-5d4c1a2b3f60; do
    [[ ${#cdi_ids[@]} -lt $claims ]] || break
    tenant_dir=$tmp/run/tenants/dra-$uid
    mkdir -p "$tenant_dir"
    printf 'policy\n' >"$tenant_dir/policy"
    printf 'usage\n' >"$tenant_dir/usage"
    cdi_ids+=("gpu.fracgpu.io/claim=$uid")
    cat >"$spec_dir/gpu.fracgpu.io-claim_$uid.json" <<EOF
{
  "cdiVersion": "0.6.0",
  "kind": "gpu.fracgpu.io/claim",
  "devices": [{
    "name": "$uid",
    "containerEdits": {
      "env": ["LD_PRELOAD=/usr/lib/fracgpu/libfracgpu.so", "FRACGPU_UNMANAGED=deny"],
      "mounts": [
        {"hostPath": "$tenant_dir", "containerPath": "/run/fracgpu/claims/$uid", "options": ["$tenant_mode", "nosuid", "nodev", "bind"]},
        {"hostPath": "$tenant_dir/usage", "containerPath": "/run/fracgpu/claims/$uid/usage",
         "options": ["rw", "nosuid", "nodev", "bind"]},
        {"hostPath": "$tmp/lib/libfracgpu.so", "containerPath": "/usr/lib/fracgpu/libfracgpu.so",
         "options": ["ro", "nosuid", "nodev", "bind"]}
      ]
    }
  }]
}
EOF
  done
fi
[[ -d $spec_dir ]] || fail "$spec_dir is not a directory"
# Each device's claim directory, from the spec naming it: "<name in
# /run/fracgpu/claims> <host directory>" lines; the specs' newest version.
spec_version=$(python3 - "$spec_dir" "$tmp/claims.txt" "${cdi_ids[@]}" <<'PY'
import json, pathlib, re, sys
spec_dir, out, ids = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
version, lines = [0, 0, 0], []
for cdi_id in ids:
    kind, _, name = cdi_id.partition("=")
    for path in sorted(spec_dir.glob("*.json")):
        spec = json.loads(path.read_text())
        device = [d for d in spec.get("devices", []) if d.get("name") == name]
        if spec.get("kind") != kind or not device:
            continue
        version = max(version, [int(x) for x in spec.get("cdiVersion", "0.0.0").split(".")])
        mounts = device[0].get("containerEdits", {}).get("mounts", [])
        dirs = [m for m in mounts if re.fullmatch(r"/run/fracgpu/claims/[^/]+", m.get("containerPath", ""))]
        if len(dirs) != 1:
            sys.exit(f"{path}: {cdi_id} mounts no directory at /run/fracgpu/claims/<name>")
        lines.append(dirs[0]["containerPath"].rsplit("/", 1)[1] + " " + dirs[0]["hostPath"])
        break
    else:
        sys.exit(f"no spec in {spec_dir} has device {cdi_id}")
pathlib.Path(out).write_text("".join(line + "\n" for line in lines))
print(".".join(map(str, version)))
PY
) || fail "the specs of ${cdi_ids[*]}"

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
echo "claims-dir $(ls -A /run/fracgpu/claims | tr "\n" " ")"
# Writable: opened for appending, nothing written (test -w is always true
# for root in busybox, read-only mount or not).
writable() { (: >>"$1") 2>/dev/null; }
cat "$LD_PRELOAD" >/dev/null && echo "library readable"
writable "$LD_PRELOAD" && echo "library writable"
for dir in /run/fracgpu/claims/*; do
  name=${dir##*/}
  echo "tenant-dir $name $(ls -A "$dir" | tr "\n" " ")"
  writable "$dir/usage" && echo "usage writable $name"
  writable "$dir/policy" && echo "policy writable $name"
  writable "$dir/planted" && echo "tenant-dir writable $name"
done
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
  ' _ "$dir" "${runtime[@]}" run "${run_opts[@]}" "${devices[@]}" "$image" /bin/sh -c "$inside"
}
devices=()
for id in "${cdi_ids[@]}"; do devices+=(--device "$id"); done

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
  if $newer_than_podman_reads && grep -q '"annotations"' "$spec_dir"/*.json; then
    skip "podman $(podman --version | awk '{print $3}') cannot read CDI spec version $spec_version, and the spec" \
         "uses annotations (0.6.0), so it cannot be checked as 0.5.0"
  fi
  if $newer_than_podman_reads; then
    echo "note: podman $(podman --version | awk '{print $3}') cannot read CDI spec version $spec_version" \
         "(\"$(tail -1 "$tmp/err.log")\"); checking the same spec as version 0.5.0, which has the same container edits"
    mkdir -p "$tmp/cdi-0.5.0"
    for spec_file in "$spec_dir"/*.json; do
      sed 's/"cdiVersion": *"[^"]*"/"cdiVersion": "0.5.0"/' "$spec_file" >"$tmp/cdi-0.5.0/$(basename "$spec_file")"
    done
    run_in_podman "$tmp/cdi-0.5.0" >"$tmp/out.log" 2>"$tmp/err.log" ||
      { cat "$tmp/err.log"; fail "podman run ${devices[*]} (specs as 0.5.0)"; }
  else
    cat "$tmp/err.log"; fail "podman run ${devices[*]}"
  fi
fi
cat "$tmp/out.log"

out=$tmp/out.log
problems=()
expect() { grep -qxF -- "$1" "$out" || problems+=("expected \"$1\""); }
refuse() { ! grep -qxF -- "$1" "$out" || problems+=("\"$1\""); }
expect "env LD_PRELOAD=/usr/lib/fracgpu/libfracgpu.so"
expect "env FRACGPU_TENANT_DIR="
expect "env FRACGPU_UNMANAGED=deny"
expect "mount /usr/lib/fracgpu/libfracgpu.so ro"
expect "library readable"
refuse "library writable"
expect "run-dir claims "
expect "claims-dir $(cut -d' ' -f1 "$tmp/claims.txt" | LC_ALL=C sort | tr '\n' ' ')"
while read -r name host_tenant_dir; do
  expect "mount /run/fracgpu/claims/$name ro"
  expect "mount /run/fracgpu/claims/$name/usage rw"
  expect "usage writable $name"
  refuse "policy writable $name"
  refuse "tenant-dir writable $name"
  expect "tenant-dir $name $(LC_ALL=C ls -A "$host_tenant_dir" | tr '\n' ' ')"
done <"$tmp/claims.txt"
[[ $(grep -c "^mount " "$out") -eq $((2 * ${#cdi_ids[@]} + 1)) ]] ||
  problems+=("mounts under /run/fracgpu other than the specs' (2 per claim, and the interposer)")

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
echo "podman run ${devices[*]}: environment and mounts as a tenant container needs them"
