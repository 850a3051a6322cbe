#!/usr/bin/env bash
# The whole performance report in one command (docs/performance.md).
#
#   bash bench/run_report.sh [OUT_DIR] [--smoke] [--gpu-only]
#
# Builds what it runs in $FRACGPU_BUILD_DIR (default build/; configured with
# scripts/build.sh if it is not yet), then runs, each into its own folder of OUT_DIR (default
# <build dir>/report):
#   micro/  the driver-call microbenchmarks (bench/micro/run_micro.sh), if present,
#           with --callgrind where valgrind is installed (not with --smoke);
#   e2e/    the end-to-end workloads on the simulated driver (bench/e2e/run_e2e.sh);
#   daemon/ fracgpud's own CPU time, idle to 32 tenant processes, and 64
#           asleep (bench/e2e/daemon_cpu.sh);
#   many/   200 processes at once: started, run, exited, and killed
#           (bench/e2e/many_processes.sh);
#   gpu/    the real-GPU benchmark (bench/gpu/run_gpu.sh), only where
#           `nvidia-smi -L` finds a GPU.
# --smoke makes every part as short as it goes (what CI's smoke runs).
# --gpu-only builds nothing and runs only gpu/, from the build directory as it
# is: for a GPU machine without network or package manager, given a
# scripts/gpu_bundle.sh directory as $FRACGPU_BUILD_DIR. A build directory
# configured with -DFRACGPU_BUILD_BENCH=OFF (as gpu_bundle.sh does) is taken as
# --gpu-only without being asked.
# Prints each part's tables and where everything was written. Exit status: the
# first part that failed, else 0.
set -euo pipefail
cd "$(dirname "$0")/.."

out="" smoke=() gpu_only=0
for arg in "$@"; do
  case $arg in
    --smoke) smoke=(--smoke) ;;
    --gpu-only) gpu_only=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "run_report.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
    *) out=$arg ;;
  esac
done
build=${FRACGPU_BUILD_DIR:-build}
if ((gpu_only == 0)) && grep -qs '^FRACGPU_BUILD_BENCH:BOOL=OFF' "$build/CMakeCache.txt"; then
  echo "== $build was configured without the benchmarks (a scripts/gpu_bundle.sh directory?): GPU part only" >&2
  gpu_only=1
fi
if ((gpu_only)); then
  [[ -e $build/interpose/libfracgpu.so ]] ||
    { echo "run_report.sh: --gpu-only: no $build/interpose/libfracgpu.so (set FRACGPU_BUILD_DIR)" >&2; exit 2; }
else
  # Only what the report runs; cmake rebuilds what changed, fast when up to date.
  # simnvml: the stand-in NVML fracgpud meters with in the e2e runs (the
  # latency set's sampling one included); without it they would run without.
  # gputime_load: the hostile shapes' and daemon_cpu.sh's tenant load.
  targets=(e2e_workload gputime_load fracgpud fracgpu_cli fracgpu simcuda simnvml)
  if [[ ! -f $build/CMakeCache.txt ]]; then
    echo "== building into $build (scripts/build.sh)" >&2
    FRACGPU_BUILD_DIR=$build bash scripts/build.sh
  fi
  cmake --build "$build" -j "$(nproc)" --target "${targets[@]}" >/dev/null ||
    { echo "run_report.sh: building ${targets[*]} in $build failed" >&2; exit 2; }
fi
out=${out:-$build/report}
mkdir -p "$out"
out=$(realpath "$out")

status=0
part() {  # part NAME COMMAND...: runs one part, keeps the first failure's status
  local rc=0
  echo "== $1" >&2
  shift
  "$@" || rc=$?
  if ((rc != 0)); then
    echo "run_report.sh: that part exited $rc" >&2
    ((status != 0)) || status=$rc
  fi
}

{
  echo "Machine: $(lscpu | sed -n 's/^Model name: *//p' | head -n 1), $(nproc) CPUs, $(uname -sr)"
  echo "Date: $(date -u '+%Y-%m-%d %H:%M UTC'); commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo "Command: bash bench/run_report.sh${smoke:+ --smoke}$( ((gpu_only == 0)) || echo ' --gpu-only')"
} >"$out/machine.txt"
cat "$out/machine.txt"

if ((gpu_only)); then
  echo "== --gpu-only: microbenchmarks and end-to-end workloads (simulated driver) skipped" >&2
elif [[ ! -f bench/micro/run_micro.sh ]]; then
  echo "== no bench/micro/run_micro.sh: microbenchmarks skipped" >&2
elif ! cmake --build "$build" -j "$(nproc)" --target micro_driver_calls >/dev/null; then
  echo "run_report.sh: building micro_driver_calls failed: microbenchmarks skipped" >&2
  status=2
else
  # The docs' instruction counts come from --callgrind (about a minute more).
  micro_args=("${smoke[@]}")
  if ((${#smoke[@]} == 0)) && command -v valgrind >/dev/null; then
    micro_args+=(--callgrind)
  elif ((${#smoke[@]} == 0)); then
    echo "== no valgrind: microbenchmarks without instruction counts (--callgrind)" >&2
  fi
  part "driver-call microbenchmarks (simulated driver)" bash bench/micro/run_micro.sh "$build" "$out/micro" "${micro_args[@]}"
fi
((gpu_only)) || part "end-to-end workloads (simulated driver)" bash bench/e2e/run_e2e.sh "$build" "$out/e2e" "${smoke[@]}"
((gpu_only)) || part "the daemon's own CPU time (simulated driver)" bash bench/e2e/daemon_cpu.sh "$build" "$out/daemon" "${smoke[@]}"
((gpu_only)) || part "many processes at once (simulated driver)" bash bench/e2e/many_processes.sh "$build" "$out/many" "${smoke[@]}"
if nvidia-smi -L >/dev/null 2>&1; then
  gpu_args=()
  ((${#smoke[@]} == 0)) || gpu_args=(--seconds 3 --repeats 1)
  part "real GPU" bash bench/gpu/run_gpu.sh "$build" "$out/gpu" "${gpu_args[@]}"
else
  echo "== no NVIDIA GPU (nvidia-smi -L failed): real-GPU part skipped" >&2
  ((gpu_only == 0)) || status=2
fi
echo "== report written to $out (machine.txt; micro/, e2e/, daemon/, many/, gpu/ where run)" >&2
exit "$status"
