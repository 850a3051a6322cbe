#!/usr/bin/env bash
# End-to-end benchmark on the simulated driver (docs/performance.md, "Workloads
# end to end").
#
#   bash bench/e2e/run_e2e.sh BUILD_DIR OUT_DIR [--smoke] [--seconds N]
#
#   bash bench/e2e/run_e2e.sh BUILD_DIR OUT_DIR --held   (fracgpud without NVML)
#
# fracgpud runs with the stand-in NVML (BUILD_DIR/simnvml), which measures each
# process's GPU time from the simulated driver: GPU time is charged as used
# (measured mode, docs/sm-time.md); --held leaves NVML out (time held, one
# tenant at a time), as on a node without NVML.
#
# For each workload of bench/e2e/e2e_workload.cpp (launch-bound, compute-bound,
# allocation-heavy, and the interactive step loop with 10 us and 50 us kernels:
# step10, step50, one thread launching with CPU work between launches, nothing
# queued ahead) it runs, each for N seconds (default 10; --smoke: 1 s and
# fewer runs, what CI runs):
#   - native: one process on the simulated GPU, no interposer;
#   - fracgpu alone: the same under libfracgpu.so as the only tenant (gpus = 1);
#   - native, 2 processes: what the driver's own time-slicing gives;
#   - fracgpu, tenants with shares: 0.5/0.5 (each workload), 0.2/0.3/0.5 and
#     0.1/0.9 (compute);
# and a second table, e2e_sharing.md: for every workload, the GPU's busy time
# and each tenant's share of the GPU time used, two processes without fracgpu
# beside two 0.5 tenants with it.
# samples every tenant's device time from the simulated driver every 250 ms
# (the ground truth), and writes to OUT_DIR: e2e_table.md (printed), CSVs,
# e2e_shares.svg, and runs/<run>/ with each process's output, the daemon's log
# and `fracgpu status --json`. Exit 0 when every run succeeded.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "run_e2e.sh: $*" >&2; exit 2; }

build="" out="" smoke=0 seconds="" held=0
while (($#)); do
  case $1 in
    --smoke) smoke=1; shift ;;
    --held) held=1; shift ;;
    --seconds) seconds=${2:?--seconds needs a value}; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) if [[ -z $build ]]; then build=$1; elif [[ -z $out ]]; then out=$1; else die "unexpected argument $1"; fi; shift ;;
  esac
done
[[ -n $build && -n $out ]] || { usage >&2; exit 2; }
seconds=${seconds:-$((smoke ? 1 : 10))}
[[ $seconds =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "--seconds takes a number of seconds, not $seconds"

build=$(realpath "$build") || die "no build dir $1"
workload=$build/bench/e2e/e2e_workload
fracgpud=$build/controller/fracgpud
fracgpu=$build/controller/fracgpu
lib=$build/interpose/libfracgpu.so
simdir=$build/simcuda
for f in "$workload" "$fracgpud" "$fracgpu" "$lib" "$simdir/libcuda.so.1"; do
  [[ -e $f ]] || die "$f not found: build first (bash scripts/build.sh, with tests: the simulated driver)"
done
py() { python3 "$here/e2e.py" "$@"; }
# shellcheck source=bench/e2e/fracgpu_run.sh
source "$here/fracgpu_run.sh"

mkdir -p "$out"
out=$(realpath "$out")
rm -rf "$out/runs" && mkdir -p "$out/runs"
# Run dirs and the simulated GPU's state live under /tmp: short paths, and
# nothing of them is a result.
work=$(mktemp -d /tmp/fracgpu-e2e-XXXXXX)
export LD_LIBRARY_PATH="$simdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fracgpud_env=()
((held)) || fracgpud_env=(LD_LIBRARY_PATH="$build/simnvml:$LD_LIBRARY_PATH")
export SIMCUDA_STATE=$work/simulated-gpu
uuid=GPU-e2e00000-0000-4000-8000-000000000000
export SIMCUDA_DEVICES="uuid=$uuid,name=Simulated H100,mem=16GiB,ctx=64MiB"

daemon_pid=""
pids=()
# Ends only what this script started.
# shellcheck disable=SC2317 # reached through the EXIT trap
cleanup() {
  stop "${pids[@]}"
  [[ -z $daemon_pid ]] || stop "$daemon_pid"
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The e2e_workload arguments of a workload name: stepN is mode=step with N us kernels.
workload_args() {
  case $1 in
    step*) echo "mode=step kernel_us=${1#step}" ;;
    *) echo "mode=$1" ;;
  esac
}

# run NAME WORKLOAD MODE TENANT[:SHARE]...
# MODE native: each TENANT is one process without the interposer. MODE
# fracgpu: a fresh fracgpud whose config gives each TENANT its SHARE of GPU 0,
# one process each, from a common start.
run() {
  local name dir run_dir wl=$2 mode=$3 spec tenant share i
  begin_run "$1" "$wl" "$mode"
  shift 3
  if [[ $mode == fracgpu ]]; then
    start_fracgpud "$dir" "$run_dir" "uuid = \"$uuid\""$'\n'"context_memory = \"64MiB\"" "$@" || exit 1
  fi
  # A common start, after every process has had time to create its context.
  local start=$(($(py now) + 700000000)) tenants=() shares=() procs=()
  pids=()
  for spec in "$@"; do
    IFS=: read -r tenant share <<<"$spec"
    local -a vars=()
    if [[ $mode == fracgpu ]]; then
      vars=(FRACGPU_TENANT="$tenant" FRACGPU_RUN_DIR="$run_dir" LD_PRELOAD="$lib")
    fi
    # shellcheck disable=SC2046 # the workload's arguments are words on purpose
    env "${vars[@]}" "$workload" $(workload_args "$wl") seconds="$seconds" start_ns="$start" \
      >"$dir/$tenant.out" 2>"$dir/$tenant.err" &
    pids+=("$!")
    tenants+=("$tenant")
    shares+=("${share:-}")
    procs+=("$!:$tenant")
  done
  py sample --lib "$simdir/libcuda.so.1" --start-ns "$start" --seconds "$seconds" --out "$dir/samples.csv" \
    "${procs[@]}" &
  local sampler=$!
  if [[ $mode == fracgpu ]]; then
    # Near the end of the window: the daemon's own achieved-share figures.
    python3 -c 'import sys, time; time.sleep(max(0.0, (int(sys.argv[1]) - time.clock_gettime_ns(time.CLOCK_MONOTONIC)) / 1e9))' \
      "$((start + ${seconds%.*} * 900000000))"
    "$fracgpu" status --run-dir "$run_dir" --json >"$dir/status.json" 2>&1 || true
  fi
  wait_procs
  wait "$sampler" || echo "run_e2e.sh: $name: the sampler failed" >&2
  if [[ -n $daemon_pid ]]; then
    stop "$daemon_pid"
    daemon_pid=""
  fi
  echo "  $name done" >&2
}

echo "== end-to-end workloads on the simulated driver, $seconds s each, into $out" >&2
for wl in launch step10 step50 compute alloc; do
  run "$wl-native" "$wl" native a
  run "$wl-fracgpu-alone" "$wl" fracgpu a:1
  if ((smoke)); then
    [[ $wl == compute ]] && run "$wl-fracgpu-0.5-0.5" "$wl" fracgpu a:0.5 b:0.5
    continue
  fi
  run "$wl-native-2" "$wl" native a b
  run "$wl-fracgpu-0.5-0.5" "$wl" fracgpu a:0.5 b:0.5
  if [[ $wl == compute ]]; then
    run "$wl-fracgpu-0.2-0.3-0.5" "$wl" fracgpu a:0.2 b:0.3 c:0.5
    run "$wl-fracgpu-0.1-0.9" "$wl" fracgpu a:0.1 b:0.9
  fi
done
{
  echo "Simulated driver (tests/simcuda), $(date -u +%Y-%m-%d), $(lscpu | sed -n 's/^Model name: *//p' | head -n 1), $(nproc) CPUs; $seconds s per run"
  echo
} >"$out/e2e_table.head"
rc=0
py report "$out" || rc=$?
cat "$out/e2e_table.head" "$out/e2e_table.md" >"$out/e2e_table.tmp" && mv "$out/e2e_table.tmp" "$out/e2e_table.md"
rm -f "$out/e2e_table.head"
echo "== wrote $out/e2e_table.md, e2e_sharing.md, e2e_runs.csv, e2e_summary.csv, e2e_shares.csv, e2e_shares.svg" >&2
exit "$rc"
