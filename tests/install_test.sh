#!/usr/bin/env bash
# `cmake --install` into a temporary prefix: checks the layout, starts the
# installed fracgpud on the simulated driver, runs the installed `fracgpu
# status` against it, and checks the container recipes (check_recipes.py)
# against that install and the daemon's run dir.
# Usage: install_test.sh BUILD_DIR SOURCE_DIR SIMCUDA_DIR
set -euo pipefail
build=$1 source=$2 simcuda=$3
tmp=$(mktemp -d /tmp/fracgpu-install-XXXXXX)
daemon=
cleanup() {
  if [[ -n $daemon ]]; then kill "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

prefix=$tmp/prefix
cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" || { cat "$tmp/install.log"; fail "cmake --install"; }

for f in bin/fracgpud bin/fracgpu; do [[ -x $prefix/$f ]] || fail "$f missing or not executable"; done
for f in lib/fracgpu/libfracgpu.so share/fracgpu/fracgpud.toml share/fracgpu/ld.so.preload \
         lib/systemd/system/fracgpud.service share/fracgpu/k8s/fracgpud-daemonset.yaml share/fracgpu/k8s/tenant-pod.yaml; do
  [[ -f $prefix/$f ]] || fail "$f missing"
done
[[ ! -e $prefix/sbin ]] || fail "sbin/ exists: fracgpud belongs in bin/"
# Every installed file is in the manifest (what an uninstall, `xargs rm <
# install_manifest.txt`, removes): the files made at install time too.
missing=$(comm -23 <(find "$prefix" -type f | sort) <(sort -u "$build/install_manifest.txt"))
[[ -z $missing ]] || fail "installed but not in install_manifest.txt: $missing"
[[ $(cat "$prefix/share/fracgpu/ld.so.preload") == "$prefix/lib/fracgpu/libfracgpu.so" ]] ||
  fail "ld.so.preload does not name the installed library"
unit=$prefix/lib/systemd/system/fracgpud.service
grep -qx "ExecStart=$prefix/bin/fracgpud --config /etc/fracgpu/fracgpud.toml" "$unit" || fail "ExecStart in $unit"
grep -qx "RuntimeDirectory=fracgpu" "$unit" || fail "the unit does not create /run/fracgpu"
grep -qx "RuntimeDirectoryPreserve=yes" "$unit" || fail "the unit would delete the ledgers at every stop"
! grep -q '^RestrictRealtime=yes' "$unit" || fail "the unit keeps the schedulers from real-time priority"
# ProtectKernelModules keeps the driver from loading nvidia-uvm at cuInit.
! grep -q '^ProtectKernelModules=yes' "$unit" || grep -q '^ExecStartPre=-+.*nvidia-modprobe -u' "$unit" ||
  fail "the unit forbids loading nvidia-uvm and does not load it first"
! grep -q '@' "$unit" || fail "unsubstituted @VAR@ in $unit"
if command -v systemd-analyze >/dev/null && systemd-analyze --version >/dev/null 2>&1; then
  # Unknown keys and values systemd cannot parse (it only warns about them).
  systemd-analyze verify "$unit" >"$tmp/verify.log" 2>&1 || true
  ! grep -qi "unknown\|failed to parse\|invalid" "$tmp/verify.log" || { cat "$tmp/verify.log"; fail "systemd-analyze verify"; }
fi
# Installed binaries must not depend on the build tree.
if ldd "$prefix/bin/fracgpud" "$prefix/bin/fracgpu" | grep -q "$build"; then fail "installed binaries link the build tree"; fi

export LD_LIBRARY_PATH=$simcuda SIMCUDA_DEVICES="name=Sim A,mem=16GiB,ctx=64MiB;name=Sim B,mem=16GiB,ctx=64MiB"
unset SIMCUDA_STATE

# The installed example config is valid on a 16 GiB GPU.
"$prefix/bin/fracgpud" --config "$prefix/share/fracgpu/fracgpud.toml" --check >"$tmp/check.log" 2>&1 ||
  { cat "$tmp/check.log"; fail "the installed example config does not pass --check"; }

run=$tmp/run
cat >"$tmp/fracgpud.toml" <<EOF
[daemon]
run_dir = "$run"
reap_interval_ms = 50
metrics_address = "off"
[[gpu]]
index = 0
[[tenant]]
name = "alice"
gpus = 0.5
EOF
"$prefix/bin/fracgpud" --config "$tmp/fracgpud.toml" >"$tmp/daemon.log" 2>&1 &
daemon=$!
for _ in $(seq 1 200); do
  if "$prefix/bin/fracgpu" status --run-dir "$run" >"$tmp/status.txt" 2>&1 && grep -q "alive" "$tmp/status.txt" &&
     grep -q "alice" "$tmp/status.txt"; then break; fi
  sleep 0.05
done
grep -q "daemon:  alive (pid $daemon" "$tmp/status.txt" || { cat "$tmp/status.txt" "$tmp/daemon.log"; fail "installed fracgpu status"; }
grep -q "alice.*granted.*0.5" "$tmp/status.txt" || { cat "$tmp/status.txt"; fail "alice's grant in fracgpu status"; }
"$prefix/bin/fracgpu" status --json --run-dir "$run" | python3 -c '
import json, sys
s = json.load(sys.stdin)
assert s["daemon"]["alive"], s["daemon"]
assert [t["name"] for t in s["tenants"]] == ["alice"], s["tenants"]
assert s["placement"]["tenants"]["alice"] == "policy", s["placement"]
' || fail "installed fracgpu status --json"

python3 "$source/tests/check_recipes.py" --source "$source" --prefix "$prefix" --run-dir "$run" \
  --toml-out "$tmp/configmap.toml" || fail "container recipes"
# The recipes as they used to be, with the tenant directory mounted
# read-write: rejected, in the docker recipes and in the pod alike.
bad=$tmp/bad-recipes
mkdir -p "$bad/docs" "$bad/examples/k8s"
sed 's|/run/fracgpu/tenant:ro|/run/fracgpu/tenant|' "$source/docs/containers.md" >"$bad/docs/containers.md"
cp "$source"/examples/k8s/*.yaml "$bad/examples/k8s/"
python3 - "$bad/examples/k8s/tenant-pod.yaml" <<'PY'
import sys
path = sys.argv[1]
text = open(path).read()
rw = text.replace("mountPath: /run/fracgpu/tenant\n          readOnly: true\n", "mountPath: /run/fracgpu/tenant\n")
assert rw != text, "the pod no longer mounts its tenant directory as this test expects"
open(path, "w").write(rw)
PY
if python3 "$source/tests/check_recipes.py" --source "$bad" --prefix "$prefix" --run-dir "$run" \
     --toml-out "$tmp/bad-configmap.toml" >"$tmp/bad-recipes.log" 2>&1; then
  cat "$tmp/bad-recipes.log"; fail "check_recipes.py accepted a read-write tenant directory"
fi
for where in "docs/containers.md: docker run" "tenant-pod.yaml: container train"; do
  grep -q "$where: the tenant's directory is mounted read-write at /run/fracgpu/tenant" "$tmp/bad-recipes.log" ||
    { cat "$tmp/bad-recipes.log"; fail "check_recipes.py did not reject a read-write tenant directory in $where"; }
done
# The ConfigMap's node config is valid (on one simulated GPU, index 0).
sed "s|^run_dir = .*|run_dir = \"$tmp/run-cm\"|" "$tmp/configmap.toml" >"$tmp/configmap-local.toml"
"$prefix/bin/fracgpud" --config "$tmp/configmap-local.toml" --check >"$tmp/cm-check.log" 2>&1 ||
  { cat "$tmp/cm-check.log"; fail "the DaemonSet's ConfigMap does not pass fracgpud --check"; }
echo "install layout, installed daemon and CLI, container recipes: ok"
