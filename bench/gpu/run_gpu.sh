#!/usr/bin/env bash
# Real-GPU benchmark (docs/performance.md, "Real GPU"). Needs one NVIDIA GPU
# (GPU 0 is used, nothing else should run on it), the CUDA toolkit (nvcc,
# CUPTI) and, for the torch workload, PyTorch.
#
#   bash bench/gpu/run_gpu.sh BUILD_DIR OUT_DIR [--seconds N] [--workloads compute,launch,torch]
#
# Builds bench/gpu/gpu_workload.cu with nvcc into OUT_DIR/bin, then for each
# workload (compute: long kernels; launch: a stream of tiny kernels; torch:
# a PyTorch matmul loop), each run N seconds (default 15) from a common start:
#   native        one process, no interposer
#   fracgpu-1     one tenant with gpus = 1 under libfracgpu.so
#   timeslice-2   two processes, no interposer: the driver's time-slicing
#   fracgpu-0.5-0.5 (every workload), fracgpu-0.25-0.75 and fracgpu-0.1-0.9
#                 (compute): two tenants with these shares, default limit
#   mps-50-50     two processes under MPS with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50,
#                 where nvidia-cuda-mps-control can be started (skipped otherwise)
# Each process measures its own GPU time with CUPTI (never fracgpu's figures).
# Prints a Markdown table with the targets (one tenant >= 99.5% of native
# throughput; two 0.5 tenants together >= 97% of one process alone) and writes
# gpu_table.md, gpu_runs.csv and runs/ (each process's JSON and stderr).
# Exit 0: targets met; 1: a target missed or a run failed; 2: could not run.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
die() { echo "run_gpu.sh: $*" >&2; exit 2; }
# shellcheck source=bench/e2e/fracgpu_run.sh
source "$here/../e2e/fracgpu_run.sh"

build="" out="" seconds=15 workloads=compute,launch,torch
while (($#)); do
  case $1 in
    --seconds) seconds=${2:?--seconds needs a value}; shift 2 ;;
    --workloads) workloads=${2:?--workloads needs a value}; shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) if [[ -z $build ]]; then build=$1; elif [[ -z $out ]]; then out=$1; else die "unexpected argument $1"; fi; shift ;;
  esac
done
[[ -n $build && -n $out ]] || die "usage: run_gpu.sh BUILD_DIR OUT_DIR [--seconds N] [--workloads ...]"
[[ $seconds =~ ^[0-9]+$ ]] || die "--seconds takes whole seconds, not $seconds"
build=$(realpath "$build") || die "no build dir $build"
fracgpud=$build/controller/fracgpud
fracgpu=$build/controller/fracgpu
lib=$build/interpose/libfracgpu.so
for f in "$fracgpud" "$fracgpu" "$lib"; do
  [[ -e $f ]] || die "$f not found: build first (bash scripts/build.sh)"
done
nvidia-smi -L >/dev/null 2>&1 || die "nvidia-smi -L failed: this benchmark needs an NVIDIA GPU"
cuda=${CUDA_HOME:-/usr/local/cuda}
IFS=, read -r -a wl_list <<<"$workloads"
for wl in "${wl_list[@]}"; do
  case $wl in
    compute | launch) ;;
    torch) python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null ||
      die "--workloads torch needs PyTorch with CUDA (leave it out with --workloads compute,launch)" ;;
    *) die "--workloads: unknown workload \"$wl\" (compute, launch, torch)" ;;
  esac
done

mkdir -p "$out/bin"
out=$(realpath "$out")
rm -rf "$out/runs" && mkdir -p "$out/runs"
echo "== building gpu_workload with $cuda/bin/nvcc" >&2
"$cuda/bin/nvcc" -O2 -std=c++17 -o "$out/bin/gpu_workload" "$here/gpu_workload.cu" \
  -L"$cuda/lib64" -L"$cuda/extras/CUPTI/lib64" -I"$cuda/extras/CUPTI/include" -lcupti ||
  die "nvcc failed"
export LD_LIBRARY_PATH="$cuda/lib64:$cuda/extras/CUPTI/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

gpu_uuid=$(nvidia-smi -i 0 --query-gpu=uuid --format=csv,noheader)
[[ $(nvidia-smi -i 0 --query-gpu=compute_mode --format=csv,noheader) != Exclusive_Process ]] ||
  die "GPU 0 is in Exclusive_Process compute mode: processes cannot share it"
work=$(mktemp -d /tmp/fracgpu-gpu-bench-XXXXXX)
daemon_pid="" mps_started=0
pids=()
mps_quit() {
  echo quit | CUDA_MPS_PIPE_DIRECTORY=$work/mps-pipe nvidia-cuda-mps-control >/dev/null 2>&1 || true
  mps_started=0
}
# shellcheck disable=SC2317 # reached through the EXIT trap
cleanup() {
  stop "${pids[@]}"
  [[ -z $daemon_pid ]] || stop "$daemon_pid"
  ((mps_started == 0)) || mps_quit
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
now_ns() { python3 -c 'import time; print(time.clock_gettime_ns(time.CLOCK_MONOTONIC))'; }

workload_cmd() {  # workload_cmd WORKLOAD: the command line, without the start options
  case $1 in
    torch) echo python3 "$here/torch_workload.py" --seconds "$seconds" ;;
    *) echo "$out/bin/gpu_workload" --mode "$1" --seconds "$seconds" ;;
  esac
}

# group NAME WORKLOAD KIND TENANT[:SHARE]...   KIND: native | fracgpu | mps
group() {
  local name dir run_dir wl=$2 kind=$3 spec tenant share i
  begin_run "$1" "$wl" "$kind"
  shift 3
  if [[ $kind == fracgpu ]]; then
    start_fracgpud "$dir" "$run_dir" "uuid = \"$gpu_uuid\"" "$@" || exit 1
  fi
  local -a tenants=() shares=() vars cmd
  read -r -a cmd <<<"$(workload_cmd "$wl")"
  pids=()
  for spec in "$@"; do
    IFS=: read -r tenant share <<<"$spec"
    vars=(CUDA_VISIBLE_DEVICES="$gpu_uuid")
    case $kind in
      fracgpu) vars+=(FRACGPU_TENANT="$tenant" FRACGPU_RUN_DIR="$run_dir" LD_PRELOAD="$lib") ;;
      mps) vars+=(CUDA_MPS_PIPE_DIRECTORY="$work/mps-pipe" CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="$share") ;;
    esac
    env "${vars[@]}" "${cmd[@]}" --ready-file "$dir/$tenant.ready" --start-file "$dir/start" \
      >"$dir/$tenant.json" 2>"$dir/$tenant.err" &
    pids+=("$!")
    tenants+=("$tenant")
    shares+=("${share:-}")
  done
  # Start together once all have warmed up (PyTorch takes seconds to start).
  local deadline=$((SECONDS + 300))
  for i in "${!tenants[@]}"; do
    until [[ -s $dir/${tenants[i]}.ready ]]; do
      if ! kill -0 "${pids[i]}" 2>/dev/null || ((SECONDS >= deadline)); then
        echo "run_gpu.sh: $name: ${tenants[i]} did not warm up: $(tail -n 5 "$dir/${tenants[i]}.err")" >&2
        break 2
      fi
      sleep 0.05
    done
  done
  echo $(($(now_ns) + 500000000)) >"$dir/start.tmp" && mv "$dir/start.tmp" "$dir/start"
  if [[ $kind == fracgpu ]]; then
    sleep $((seconds * 9 / 10))
    "$fracgpu" status --run-dir "$run_dir" --json >"$dir/status.json" 2>&1 || true
  fi
  wait_procs
  if [[ -n $daemon_pid ]]; then stop "$daemon_pid"; daemon_pid=""; fi
  echo "  $name done" >&2
}

echo "== $(nvidia-smi -i 0 --query-gpu=name,driver_version --format=csv,noheader), $seconds s per run, into $out" >&2
for wl in "${wl_list[@]}"; do
  group "$wl-native" "$wl" native a
  group "$wl-fracgpu-1" "$wl" fracgpu a:1
  group "$wl-timeslice-2" "$wl" native a b
  group "$wl-fracgpu-0.5-0.5" "$wl" fracgpu a:0.5 b:0.5
  if [[ $wl == compute ]]; then
    group "$wl-fracgpu-0.25-0.75" "$wl" fracgpu a:0.25 b:0.75
    group "$wl-fracgpu-0.1-0.9" "$wl" fracgpu a:0.1 b:0.9
  fi
done
# MPS last: while its control daemon runs, every CUDA process on the GPU goes through it.
if command -v nvidia-cuda-mps-control >/dev/null &&
  mkdir -p "$work/mps-pipe" "$work/mps-log" &&
  CUDA_MPS_PIPE_DIRECTORY=$work/mps-pipe CUDA_MPS_LOG_DIRECTORY=$work/mps-log nvidia-cuda-mps-control -d; then
  mps_started=1
  for wl in "${wl_list[@]}"; do group "$wl-mps-50-50" "$wl" mps a:50 b:50; done
  mps_quit
else
  echo "run_gpu.sh: nvidia-cuda-mps-control could not be started: no MPS comparison" >&2
fi
{
  echo "$(nvidia-smi -i 0 --query-gpu=name,driver_version --format=csv,noheader), $(date -u +%Y-%m-%d), $seconds s per run"
  echo
} >"$out/gpu_table.head"
rc=0
python3 "$here/gpu_report.py" "$out" || rc=$?
cat "$out/gpu_table.head" "$out/gpu_table.md" >"$out/gpu_table.tmp" && mv "$out/gpu_table.tmp" "$out/gpu_table.md"
rm -f "$out/gpu_table.head"
echo "== wrote $out/gpu_table.md and gpu_runs.csv" >&2
exit "$rc"
