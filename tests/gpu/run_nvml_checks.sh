#!/usr/bin/env bash
# NVML inside the tenant on a real NVIDIA GPU: nvidia-smi run under the
# interposer as tenant "alice" (0.5 of GPU 0) must show alice's quota as the
# GPU's memory, alice's usage (both of her processes) as used, and only her
# processes; bob's process on the same GPU must not appear. The same query
# without the interposer must show everyone (the sanity check). With root and
# unshare(1), it also runs alice's process and nvidia-smi inside a new PID
# namespace (what a container is) and checks the listed PID is the one
# inside it, not the host's. Last, with bob's load running and alice idle:
# nvidia-smi's utilization.gpu as alice is about 0 (not the device's), and as
# bob about what `fracgpu status` says he used.
# Needs the project built (scripts/build.sh) and PyTorch. Prints a report;
# record it in docs/gpu-results.md with date, GPU and driver.
# Time (estimated; never timed on a GPU): about 45 s, mostly the start of its
# five PyTorch processes (~5 s each), nvidia-smi's calls (~0.5 s each) and
# the 8 s of bob's load (and its start) before the utilization is read.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
build=$(realpath "${FRACGPU_BUILD_DIR:-build}")
run_dir=$(mktemp -d /tmp/fracgpu-nvml-XXXXXX)
check=tests/gpu/check_memory_quota.py
lib=$build/interpose/libfracgpu.so
failures=0
holders=()

fail() { echo "FAILED: $*"; failures=$((failures + 1)); }
ok() { echo "ok: $*"; }

echo "== $(date -u +%Y-%m-%dT%H:%MZ)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

cat >"$run_dir/fracgpud.toml" <<TOML
[daemon]
run_dir = "$run_dir"
log_level = "info"

[[gpu]]
index = 0
context_memory = "512MiB"

[[tenant]]
name = "alice"
gpus = 0.5

[[tenant]]
name = "bob"
gpus = 0.25
TOML
"$build/controller/fracgpud" --config "$run_dir/fracgpud.toml" 2>"$run_dir/fracgpud.log" &
daemon=$!
cleanup() {
  for h in "${holders[@]}"; do kill "$h" 2>/dev/null; done
  kill -TERM "$daemon" 2>/dev/null
  wait 2>/dev/null
}
trap cleanup EXIT
for _ in $(seq 200); do [ -f "$run_dir/tenants/bob/policy" ] && break; sleep 0.1; done

# as TENANT CMD...: run CMD under the interposer as TENANT.
as() {
  local tenant=$1
  shift
  env FRACGPU_TENANT="$tenant" FRACGPU_RUN_DIR="$run_dir" LD_PRELOAD="$lib" "$@"
}
# hold TENANT BYTES: a PyTorch process of TENANT holding BYTES; sets $held,
# the process's own PID: started through env(1) directly, which execs it (a
# shell function run in the background would leave $! a subshell's PID).
hold() {
  local out=$run_dir/hold.$RANDOM
  env FRACGPU_TENANT="$1" FRACGPU_RUN_DIR="$run_dir" LD_PRELOAD="$lib" python3 $check hold "$2" 600 >"$out" 2>&1 &
  held=$!
  holders+=("$held")
  # Up to 30 s for PyTorch to start; not a moment longer once the process is gone.
  for _ in $(seq 300); do
    grep -q holding "$out" && return 0
    kill -0 "$held" 2>/dev/null || break
    sleep 0.1
  done
  fail "$1's process did not start holding: $(cat "$out")"
}
status_json() { "$build/controller/fracgpu" status --run-dir "$run_dir" --json; }
# tenant_field TENANT EXPR: a Python expression over t (the tenant's JSON).
tenant_field() {
  status_json | python3 -c "import json,sys; t=[t for t in json.load(sys.stdin)['tenants'] if t['name']=='$1'][0]; print($2)"
}
# number X: X is a whole number (what nvidia-smi or status printed may not be:
# "[N/A]", an error; in arithmetic that would end the script).
number() { [[ $1 =~ ^[0-9]+$ ]]; }
# near A B: A and B (MiB) are numbers that differ by at most 2 (nvidia-smi
# rounds to MiB).
near() { number "$1" && number "$2" && [ $(($1 > $2 ? $1 - $2 : $2 - $1)) -le 2 ]; }

hold alice $((1 << 30)); alice1=$held
hold alice $((512 << 20)); alice2=$held
hold bob $((256 << 20)); bob1=$held
sleep 1
"$build/controller/fracgpu" status --run-dir "$run_dir"

quota_b=$(tenant_field alice "t['gpus'][0]['memory_quota']" || true)
used_b=$(tenant_field alice "t['gpus'][0]['memory_used']" || true)
if ! number "$quota_b" || ! number "$used_b"; then
  fail "fracgpu status gave no quota or usage for alice ('$quota_b', '$used_b'); daemon log:"
  cat "$run_dir/fracgpud.log"
  echo "== $failures failure(s)"
  exit 1
fi
quota_mib=$((quota_b >> 20))
used_mib=$((used_b >> 20))
echo "== alice: quota $quota_mib MiB, ledger usage $used_mib MiB; her processes $alice1 $alice2, bob's $bob1"

echo "== nvidia-smi as alice"
as alice nvidia-smi

echo "== nvidia-smi --query-gpu=memory.total,memory.used as alice"
line=$(as alice nvidia-smi -i 0 --query-gpu=memory.total,memory.used --format=csv,noheader,nounits | tr -d ' ')
echo "$line"
total=${line%%,*}
used=${line##*,}
if near "$total" "$quota_mib"; then ok "memory.total $total MiB is the quota"; else fail "memory.total $total MiB, quota $quota_mib MiB"; fi
if near "$used" "$used_mib"; then ok "memory.used $used MiB is alice's usage"; else fail "memory.used $used MiB, alice uses $used_mib MiB"; fi

# First without the interposer: whether this machine's driver lists this PID
# namespace's processes at all. In a container or a sandbox (gVisor) it may
# list none of them, or others' PIDs: which processes a tenant is shown can
# then not be judged here, and the listing checks are skipped, said so,
# rather than failed.
echo "== nvidia-smi --query-compute-apps without the interposer (everyone, real figures)"
real=$(nvidia-smi -i 0 --query-compute-apps=pid,used_memory --format=csv,noheader,nounits | tr -d ' ')
echo "$real"
seen=0
for p in $alice1 $alice2 $bob1; do echo "$real" | grep -q "^$p," && seen=$((seen + 1)); done
if ((seen == 0)); then
  echo "SKIPPED (not counted): without the interposer nvidia-smi lists none of the processes started here" \
    "($alice1 $alice2 $bob1): this machine's driver does not report this PID namespace's processes" \
    "(a container or a sandbox), so the per-process listings below cannot be judged"
else
  echo "$real" | grep -q "^$bob1," || fail "without the interposer bob's process is not listed: the check itself is off"

  echo "== nvidia-smi --query-compute-apps as alice"
  apps=$(as alice nvidia-smi -i 0 --query-compute-apps=pid,used_memory --format=csv,noheader,nounits | tr -d ' ')
  echo "$apps"
  pids=$(echo "$apps" | cut -d, -f1 | grep -E '^[0-9]+$' | sort -n | tr '\n' ' ')
  want=$(printf '%s\n' "$alice1" "$alice2" | sort -n | tr '\n' ' ')
  if [ "$pids" = "$want" ]; then ok "exactly alice's processes: $pids"; else fail "listed [$pids], alice's are [$want]"; fi
  echo "$apps" | grep -q "^$bob1," && fail "bob's process $bob1 is shown to alice"
  for p in $alice1 $alice2; do
    shown=$(echo "$apps" | awk -F, -v p="$p" '$1 == p {print $2}')
    charged=$(tenant_field alice "sum(c['bytes'] for q in t['processes'] if q['host_pid'] == $p for c in q['charges']) >> 20" || true)
    if [ -n "$shown" ] && near "$shown" "$charged"; then ok "process $p: $shown MiB, as charged"; else fail "process $p: shown '${shown}' MiB, charged $charged MiB"; fi
  done
fi

if ((seen == 0)); then
  echo "== PID namespace check skipped (nvidia-smi lists none of this machine's processes, above)"
elif [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && ! unshare --pid --fork --mount-proc true 2>/dev/null; then
  # Root, yet no new PID namespace (a sandbox or a container without
  # CAP_SYS_ADMIN): nothing to check, rather than a failure of fracgpu's.
  echo "== PID namespace check skipped (unshare --pid --fork --mount-proc fails here: $(unshare --pid --fork --mount-proc true 2>&1 | head -n 1))"
elif [ "$(id -u)" = 0 ] && command -v unshare >/dev/null; then
  echo "== in a PID namespace (as a container): alice's process and nvidia-smi inside"
  inside=$(as alice unshare --pid --fork --mount-proc bash -c '
      python3 '"$check"' hold $((128 << 20)) 600 > '"$run_dir"'/ns.out 2>&1 & h=$!
      for _ in $(seq 300); do grep -q holding '"$run_dir"'/ns.out && break; sleep 0.1; done
      echo "inside_pid=$h"
      nvidia-smi -i 0 --query-compute-apps=pid,used_memory --format=csv,noheader,nounits
      nvidia-smi
      kill $h')
  echo "$inside"
  h=$(echo "$inside" | sed -n 's/^inside_pid=//p')
  listed=$(echo "$inside" | grep -E '^ *[0-9]+, *[0-9]+ *$' | cut -d, -f1 | tr -d ' ' | tr '\n' ' ')
  if [ "$listed" = "$h " ]; then ok "inside the namespace: only its own process, by its namespace PID $h"
  else fail "inside the namespace: listed [$listed], expected [$h ] (alice's processes outside are counted in used, not listed)"; fi
else
  echo "== PID namespace check skipped (needs root and unshare)"
fi

# GPU-Util inside a tenant is the tenant's own GPU time (docs/architecture.md,
# "NVML inside the tenant"): with bob's load running and alice's processes
# idle, alice reads about 0 and bob about what `fracgpu status` says he used.
echo "== utilization.gpu: alice idle, bob saturating"
workload=$(dirname "$check")/sm_share_workload.py
now_ns=$(python3 -c 'import time; print(time.clock_gettime_ns(time.CLOCK_MONOTONIC))')
env FRACGPU_TENANT=bob FRACGPU_RUN_DIR="$run_dir" LD_PRELOAD="$lib" \
  python3 "$workload" run --seconds 12 --start-ns "$now_ns" >"$run_dir/bob-load.out" 2>&1 &
holders+=("$!")
# PyTorch takes ~5 s to start; the figures are read with ~3 s of load behind them.
sleep 8
# An argument list, not a shell function: `as` runs its command through env(1).
# shellcheck disable=SC2054 # the commas belong to nvidia-smi's arguments
util=(nvidia-smi -i 0 --query-gpu=utilization.gpu,utilization.memory --format=csv,noheader,nounits)
device_util=$("${util[@]}" | tr -d ' '); alice_util=$(as alice "${util[@]}" | tr -d ' ')
bob_util=$(as bob "${util[@]}" | tr -d ' ')
bob_ppm=$(tenant_field bob "t['gpus'][0]['gpu_time']['achieved_1s_ppm'] if t['gpus'][0]['gpu_time'] else -1")
echo "device $device_util, alice $alice_util, bob $bob_util (gpu,memory %); bob used ${bob_ppm} ppm over 1 s"
if ! number "${device_util%%,*}" || ! number "${alice_util%%,*}" || ! number "${bob_util%%,*}" ||
  ! [[ $bob_ppm =~ ^-?[0-9]+$ ]]; then
  fail "a utilization figure is not a number (device '$device_util', alice '$alice_util', bob '$bob_util'," \
    "status '$bob_ppm')"
elif ((${device_util%%,*} < 50)); then
  echo "SKIPPED (not counted): bob's load did not show in the device's figure: $(cat "$run_dir/bob-load.out")"
else
  if ((${alice_util%%,*} <= 2)); then ok "alice reads her own ${alice_util%%,*} %, not the device's ${device_util%%,*} %"
  else fail "alice reads ${alice_util%%,*} % with her processes idle (device ${device_util%%,*} %)"; fi
  bob_pct=$(((bob_ppm + 5000) / 10000))
  if ((bob_ppm >= 0)) && (( ${bob_util%%,*} >= bob_pct - 10 && ${bob_util%%,*} <= bob_pct + 10 )); then
    ok "bob reads ${bob_util%%,*} %, fracgpu status $bob_pct %"
  else fail "bob reads ${bob_util%%,*} %, fracgpu status $bob_pct % (${bob_ppm} ppm)"; fi
fi

echo "== daemon log"; cat "$run_dir/fracgpud.log"
echo "== $failures failure(s)"
exit $((failures > 0))
