#!/usr/bin/env bash
# Real-GPU benchmark (docs/performance.md, "Real GPU"). Needs one NVIDIA GPU
# (GPU 0 is used, nothing else should run on it), the CUDA toolkit (nvcc,
# CUPTI) and, for the torch workload, PyTorch. Works from a build directory or
# a scripts/gpu_bundle.sh directory.
#
#   bash bench/gpu/run_gpu.sh BUILD_DIR OUT_DIR [--seconds N] [--repeats N]
#                             [--workloads compute,launch,torch[,step10,step50]]
#                             [--passes throughput,gputime,nvml] [--half-split-only] [--no-mps]
#
# Builds bench/gpu/gpu_workload.cu (build_workload.sh) into OUT_DIR/bin, or
# takes $FRACGPU_GPU_WORKLOAD (one built beforehand: scripts/gpu_bundle.sh
# --with-instruments; tests/gpu/run_all.sh names BUILD_DIR/bench/gpu/
# gpu_workload) if a 0.2 s launch run of it succeeds here (it may be built for
# another GPU, or name a CUPTI directory this machine lacks), and
# sizes the compute kernel once, alone on the GPU (gpu_workload --calibrate:
# OUT_DIR/calibration.json); every compute process of every run gets the same
# --iterations and --blocks. Then for each workload (compute: long kernels;
# launch: a stream of tiny kernels; torch: a PyTorch matmul loop; step10,
# step50, asked for by name: an interactive loop, one ~10 us (50 us) kernel then
# 1.2x that of CPU work, nothing queued ahead, where timeslice-2 beside
# fracgpu-0.5-0.5 shows what sharing costs launch-bound tenants), each run N
# seconds (default 15) from a common start, in this order:
#   native, fracgpu-1   alternated, --repeats times each (default 3): one
#                 process without the interposer / one tenant with gpus = 1
#   timeslice-2   two processes, no interposer: the driver's time-slicing
#   fracgpu-0.5-0.5 (every workload), fracgpu-0.25-0.75 and fracgpu-0.1-0.9
#                 (compute): two tenants with these shares, default limit
# all without CUPTI (throughput); then the fracgpu runs with two tenants once
# more with CUPTI on (GPU time per process: a share only where one process's
# kernels run at a time, which fracgpu ensures and time-slicing and MPS do not);
# then once more (`…-nvml`) with the workload's own CUPTI off and instead
#   the CUPTI meter (cupti_meter.cpp, CUDA_INJECTION64_PATH) in each process
#   and nvml_sampler polling NVML beside them every 2 ms for the window: NVML's
#   integrated per-process estimate against CUPTI's GPU time, NVML's sampling
#   period, NOT_FOUND fraction and PIDs per sample (docs/gpu-results.md,
#   "Calibrating the stand-in NVML"); the two are taken from BUILD_DIR/bench/gpu
#   or built into OUT_DIR/bin (build_tools.sh), or named by
#   $FRACGPU_NVML_SAMPLER / $FRACGPU_CUPTI_METER; without a meter those runs
#   have NVML only;
# and last
#   mps-50-50     two processes under MPS with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50,
#                 if nvidia-cuda-mps-control starts and a first client runs
#                 under it (skipped otherwise; its failures are not counted).
# Shorter (tests/gpu/run_all.sh --quick):
#   --passes LIST     which passes of the two-tenant fracgpu runs: throughput
#                     (CUPTI off), gputime (CUPTI on), nvml (meter and sampler);
#                     default all three. Without nvml the instruments are
#                     neither looked for nor built.
#   --half-split-only the two-tenant runs at 0.5/0.5 only: compute's 0.25/0.75
#                     and 0.1/0.9 are left out (tests/gpu/run_sm_share.sh
#                     measures those shares).
#   --no-mps          no MPS comparison.
# A run whose fracgpud does not start is recorded as failed; the rest go on.
# Time (estimated; never timed on a GPU): each run is --seconds plus ~2 s
# (CUDA context, common start, daemon; ~5 s more for torch: PyTorch's start).
# Runs per workload: 2 x --repeats, 1 time-slicing, splits x passes (splits:
# 3 for compute, else 1; 1 with --half-split-only), 1 MPS. Before them: nvcc
# (~10-20 s; ~1 s for the probe of a $FRACGPU_GPU_WORKLOAD that runs),
# build_tools.sh (~5 s, the nvml pass only, without instruments in the build
# directory) and the kernel's sizing (~2 s). By default 39 runs of 15 s, about
# 12.5 minutes; with --workloads compute,launch --repeats 2 --seconds 4
# --passes throughput --half-split-only --no-mps (run_all.sh --quick) 12 runs
# of 4 s, about 1.5 minutes.
# Prints a Markdown table with the targets (medians: fracgpu-1 >= 99.5% of
# native; two 0.5 tenants together >= 97% of native) and writes
# gpu_table.md, gpu_runs.csv and runs/ (each process's JSON and stderr; in the
# -nvml runs also nvml-sampler.jsonl and cupti-<tenant>.<pid>.json).
# Exit 0: targets met; 1: a target missed or a run failed; 2: could not run
# (no GPU, no build, no nvcc).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
die() { echo "run_gpu.sh: $*" >&2; exit 2; }
# shellcheck source=bench/e2e/fracgpu_run.sh
source "$here/../e2e/fracgpu_run.sh"

build="" out="" seconds=15 repeats=3 workloads=compute,launch,torch passes=throughput,gputime,nvml
half_only=0 mps=1
while (($#)); do
  case $1 in
    --seconds) seconds=${2:?--seconds needs a value}; shift 2 ;;
    --repeats) repeats=${2:?--repeats needs a value}; shift 2 ;;
    --workloads) workloads=${2:?--workloads needs a value}; shift 2 ;;
    --passes) passes=${2:?--passes needs a value}; shift 2 ;;
    --half-split-only) half_only=1; shift ;;
    --no-mps) mps=0; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) if [[ -z $build ]]; then build=$1; elif [[ -z $out ]]; then out=$1; else die "unexpected argument $1"; fi; shift ;;
  esac
done
[[ -n $build && -n $out ]] || die "usage: run_gpu.sh BUILD_DIR OUT_DIR [--seconds N] [--repeats N] [--workloads ...]"
[[ $seconds =~ ^[0-9]+$ && $seconds -gt 0 ]] || die "--seconds takes whole seconds above 0, not $seconds"
[[ $repeats =~ ^[0-9]+$ && $repeats -gt 0 ]] || die "--repeats takes a whole number above 0, not $repeats"
build=$(realpath "$build") || die "no build dir $build"
fracgpud=$build/controller/fracgpud
fracgpu=$build/controller/fracgpu
lib=$build/interpose/libfracgpu.so
for f in "$fracgpud" "$fracgpu" "$lib"; do
  [[ -e $f ]] || die "$f not found: build first (bash scripts/build.sh, or scripts/gpu_bundle.sh elsewhere)"
done
nvidia-smi -L >/dev/null 2>&1 ||
  die "no NVIDIA GPU here (nvidia-smi -L failed): this benchmark needs one; nothing was run"
IFS=, read -r -a pass_list <<<"$passes"
for pass in "${pass_list[@]}"; do
  [[ $pass =~ ^(throughput|gputime|nvml)$ ]] || die "--passes: unknown pass \"$pass\" (throughput, gputime, nvml)"
done
# group()'s GPUTIME of each pass asked for (0: CUPTI off, 1: on, nvml), in
# this order whatever the order given.
gputime_passes=()
[[ ,$passes, != *,throughput,* ]] || gputime_passes+=(0)
[[ ,$passes, != *,gputime,* ]] || gputime_passes+=(1)
[[ ,$passes, != *,nvml,* ]] || gputime_passes+=(nvml)
((${#gputime_passes[@]} > 0)) || die "--passes names no pass (throughput, gputime, nvml)"
IFS=, read -r -a wl_list <<<"$workloads"
for wl in "${wl_list[@]}"; do
  case $wl in
    compute | launch | step10 | step50) ;;
    torch) python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null ||
      die "--workloads torch needs PyTorch with CUDA (leave it out with --workloads compute,launch)" ;;
    *) die "--workloads: unknown workload \"$wl\" (compute, launch, torch, step10, step50)" ;;
  esac
done

mkdir -p "$out/bin"
out=$(realpath "$out")
rm -rf "$out/runs" "$out/calibration.json" && mkdir -p "$out/runs"
# Whether FILE's shared libraries all resolve here (one built elsewhere may
# name a CUPTI directory this machine lacks); true for what ldd cannot read.
links() { ! ldd "$1" 2>/dev/null | grep -q 'not found'; }
# libcupti is found through the binary's RUNPATH: nothing here sets
# LD_LIBRARY_PATH, so PyTorch loads its own CUDA libraries.
workload=$out/bin/gpu_workload
if [[ -n ${FRACGPU_GPU_WORKLOAD:-} ]]; then
  # A probe costs a CUDA context (~1 s); compiling, 10-20 s.
  if [[ -x $FRACGPU_GPU_WORKLOAD ]] && links "$FRACGPU_GPU_WORKLOAD" &&
    timeout 60 "$FRACGPU_GPU_WORKLOAD" --mode launch --seconds 0.2 --no-cupti >/dev/null 2>"$out/bin/prebuilt-probe.err"; then
    workload=$(realpath "$FRACGPU_GPU_WORKLOAD")
    echo "== gpu_workload: $workload (built beforehand; it runs here)" >&2
  else
    echo "run_gpu.sh: \$FRACGPU_GPU_WORKLOAD ($FRACGPU_GPU_WORKLOAD) is missing, lacks a library or failed a 0.2 s run here ($(tail -n 1 "$out/bin/prebuilt-probe.err" 2>/dev/null)): building one" >&2
  fi
fi
if [[ $workload == "$out/bin/gpu_workload" ]]; then
  bash "$here/build_workload.sh" "$out/bin/gpu_workload" || exit 2
fi
# The NVML calibration's instruments (the nvml pass only): named, from the
# build directory, or built here.
sampler="" meter=""
if [[ " ${gputime_passes[*]} " == *" nvml "* ]]; then
  sampler=${FRACGPU_NVML_SAMPLER:-$build/bench/gpu/nvml_sampler}
  meter=${FRACGPU_CUPTI_METER:-$build/bench/gpu/libfracgpu_cupti_meter.so}
  if ! { [[ -x $sampler && -e $meter ]] && links "$sampler" && links "$meter"; } &&
    bash "$here/build_tools.sh" "$out/bin"; then
    if [[ ! -x $sampler ]] || ! links "$sampler"; then sampler=$out/bin/nvml_sampler; fi
    if [[ ! -e $meter ]] || ! links "$meter"; then meter=$out/bin/libfracgpu_cupti_meter.so; fi
  fi
  if [[ ! -x $sampler ]] || ! links "$sampler"; then
    echo "run_gpu.sh: no nvml_sampler: the -nvml runs have no NVML log" >&2
    sampler=""
  fi
  if [[ ! -e $meter ]] || ! links "$meter"; then
    echo "run_gpu.sh: no CUPTI meter: the -nvml runs have no CUPTI figure" >&2
    meter=""
  fi
fi
sampler_ms=2

gpu_uuid=$(nvidia-smi -i 0 --query-gpu=uuid --format=csv,noheader) || die "nvidia-smi gave no UUID for GPU 0"
[[ $(nvidia-smi -i 0 --query-gpu=compute_mode --format=csv,noheader) != Exclusive_Process ]] ||
  die "GPU 0 is in Exclusive_Process compute mode: processes cannot share it"
work=$(mktemp -d /tmp/fracgpu-gpu-bench-XXXXXX)
daemon_pid="" sampler_pid="" mps_started=0
pids=()
mps_quit() {
  echo quit | CUDA_MPS_PIPE_DIRECTORY=$work/mps-pipe nvidia-cuda-mps-control >/dev/null 2>&1 || true
  mps_started=0
}
# shellcheck disable=SC2317 # reached through the EXIT trap
cleanup() {
  stop "${pids[@]}"
  [[ -z $sampler_pid ]] || stop "$sampler_pid"
  [[ -z $daemon_pid ]] || stop "$daemon_pid"
  ((mps_started == 0)) || mps_quit
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
now_ns() { python3 -c 'import time; print(time.clock_gettime_ns(time.CLOCK_MONOTONIC))'; }

# The compute kernel's size, once for all runs, on the idle GPU.
kernel_args=()
if [[ ,$workloads, == *,compute,* ]]; then
  CUDA_VISIBLE_DEVICES=$gpu_uuid "$workload" --mode compute --calibrate >"$out/calibration.json" ||
    die "calibrating the compute kernel failed"
  read -r iterations blocks < <(python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); print(c["iterations"], c["blocks"])' "$out/calibration.json")
  kernel_args=(--iterations "$iterations" --blocks "$blocks")
  echo "== compute kernel: $(cat "$out/calibration.json")" >&2
fi

workload_cmd() {  # workload_cmd WORKLOAD GPUTIME: the command line, without the start options
  local profile=()
  case $1 in
    torch)
      [[ $2 == 1 ]] || profile=(--no-profiler)
      echo python3 "$here/torch_workload.py" --seconds "$seconds" "${profile[@]}" ;;
    *)
      [[ $2 == 1 ]] || profile=(--no-cupti)
      if [[ $1 == compute ]]; then profile+=("${kernel_args[@]}"); fi
      if [[ $1 == step* ]]; then
        echo "$workload" --mode step --kernel-us "${1#step}" --seconds "$seconds" "${profile[@]}"
        return
      fi
      echo "$workload" --mode "$1" --seconds "$seconds" "${profile[@]}" ;;
  esac
}

# group CONFIG WORKLOAD KIND REPEAT GPUTIME TENANT[:SHARE]...
#   KIND: native | fracgpu | mps; GPUTIME: 1 = CUPTI (the profiler) on;
#   nvml = the workload's own CUPTI off, the CUPTI meter injected and
#   nvml_sampler beside the processes
group() {
  local name dir run_dir config=$1 wl=$2 kind=$3 repeat=$4 gputime=$5 spec tenant share i suffix=""
  case $gputime in 1) suffix=-gputime ;; nvml) suffix=-nvml ;; esac
  begin_run "$wl-$config$suffix" "$wl" "$kind"
  printf 'config=%s repeat=%s gputime=%s\n' "$config" "$repeat" "$gputime" >>"$dir/run.txt"
  shift 5
  local -a tenants=() shares=() vars cmd
  if [[ $kind == fracgpu ]] && ! start_fracgpud "$dir" "$run_dir" "uuid = \"$gpu_uuid\"" "$@"; then
    # Recorded as failed (exit 125, the reason in each tenant's .err); the rest go on.
    echo "run_gpu.sh: $name: fracgpud did not start (log: $dir/fracgpud.log): run recorded as failed" >&2
    [[ -z $daemon_pid ]] || stop "$daemon_pid"
    daemon_pid=""
    : >"$dir/procs.tsv"
    for spec in "$@"; do
      IFS=: read -r tenant share <<<"$spec"
      echo "fracgpud did not start (see fracgpud.log)" >"$dir/$tenant.err"
      printf '%s\t%s\t-\t125\n' "$tenant" "${share:-}" >>"$dir/procs.tsv"
    done
    return 0
  fi
  read -r -a cmd <<<"$(workload_cmd "$wl" "$gputime")"
  pids=()
  for spec in "$@"; do
    IFS=: read -r tenant share <<<"$spec"
    vars=(CUDA_VISIBLE_DEVICES="$gpu_uuid")
    case $kind in
      fracgpu) vars+=(FRACGPU_TENANT="$tenant" FRACGPU_RUN_DIR="$run_dir" LD_PRELOAD="$lib") ;;
      mps) vars+=(CUDA_MPS_PIPE_DIRECTORY="$work/mps-pipe" CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="$share") ;;
    esac
    if [[ $gputime == nvml && -n $meter ]]; then
      vars+=(CUDA_INJECTION64_PATH="$meter" FRACGPU_CUPTI_OUT="$dir/cupti-$tenant")
    fi
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
  if [[ $gputime == nvml && -n $sampler ]]; then
    # From the common start, for the window (it waits for the start file).
    "$sampler" --gpu "$gpu_uuid" --interval-ms "$sampler_ms" --seconds "$seconds" --start-file "$dir/start" \
      --out "$dir/nvml-sampler.jsonl" 2>"$dir/nvml-sampler.err" &
    sampler_pid=$!
  fi
  echo $(($(now_ns) + 500000000)) >"$dir/start.tmp" && mv "$dir/start.tmp" "$dir/start"
  if [[ $kind == fracgpu ]]; then
    sleep $((seconds * 9 / 10))
    "$fracgpu" status --run-dir "$run_dir" --json >"$dir/status.json" 2>&1 || true
  fi
  wait_procs
  if [[ -n $sampler_pid ]]; then
    # It ends on its own at the end of the window; more than 30 s later it hangs.
    for _ in $(seq 300); do kill -0 "$sampler_pid" 2>/dev/null || break; sleep 0.1; done
    stop "$sampler_pid"
    sampler_pid=""
  fi
  if [[ -n $daemon_pid ]]; then stop "$daemon_pid"; daemon_pid=""; fi
  echo "  $name done" >&2
}

echo "== $(nvidia-smi -i 0 --query-gpu=name,driver_version --format=csv,noheader), $seconds s per run, into $out" >&2
for wl in "${wl_list[@]}"; do
  # Alternated, so that a drift of the machine over time falls on both sides.
  for ((r = 1; r <= repeats; r++)); do
    group native "$wl" native "$r" 0 a
    group fracgpu-1 "$wl" fracgpu "$r" 0 a:1
  done
  group timeslice-2 "$wl" native 1 0 a b
  shares_runs=("a:0.5 b:0.5")
  [[ $wl != compute ]] || ((half_only)) || shares_runs+=("a:0.25 b:0.75" "a:0.1 b:0.9")
  for gputime in "${gputime_passes[@]}"; do
    for spec in "${shares_runs[@]}"; do
      read -r -a tenant_specs <<<"$spec"
      group "fracgpu-${tenant_specs[0]#a:}-${tenant_specs[1]#b:}" "$wl" fracgpu 1 "$gputime" "${tenant_specs[@]}"
    done
  done
done
# MPS last: while its control daemon runs, every CUDA process on the GPU goes
# through it. `nvidia-cuda-mps-control -d` returns before a server exists, so
# a short client must run under it first.
mps_note="not run"
if ((mps == 0)); then
  mps_note="skipped: --no-mps"
elif ! command -v nvidia-cuda-mps-control >/dev/null; then
  mps_note="skipped: no nvidia-cuda-mps-control"
elif ! mkdir -p "$work/mps-pipe" "$work/mps-log" ||
  ! CUDA_MPS_PIPE_DIRECTORY=$work/mps-pipe CUDA_MPS_LOG_DIRECTORY=$work/mps-log nvidia-cuda-mps-control -d; then
  mps_note="skipped: nvidia-cuda-mps-control -d failed"
else
  mps_started=1
  if timeout 120 env CUDA_VISIBLE_DEVICES="$gpu_uuid" CUDA_MPS_PIPE_DIRECTORY="$work/mps-pipe" \
    "$workload" --mode launch --seconds 1 --no-cupti >"$out/mps-probe.json" 2>"$out/mps-probe.err"; then
    mps_note="run"
    for wl in "${wl_list[@]}"; do group mps-50-50 "$wl" mps 1 0 a:50 b:50; done
  else
    mps_note="skipped: a first client failed under MPS ($(tail -n 1 "$out/mps-probe.err" || true); server log: $(tail -n 2 "$work/mps-log/server.log" 2>/dev/null | tr '\n' ' ' || true))"
  fi
  mps_quit
fi
echo "== MPS comparison: $mps_note" >&2
{
  echo "$(nvidia-smi -i 0 --query-gpu=name,driver_version --format=csv,noheader), $(date -u +%Y-%m-%d), $seconds s per run, native and fracgpu-1 $repeats times each (alternated)"
  [[ ! -s $out/calibration.json ]] || echo "Compute kernel (sized once, alone): $(cat "$out/calibration.json")"
  echo "MPS comparison: $mps_note"
  echo
} >"$out/gpu_table.head"
rc=0
python3 "$here/gpu_report.py" "$out" || rc=$?
cat "$out/gpu_table.head" "$out/gpu_table.md" >"$out/gpu_table.tmp" && mv "$out/gpu_table.tmp" "$out/gpu_table.md"
rm -f "$out/gpu_table.head"
echo "== wrote $out/gpu_table.md and gpu_runs.csv" >&2
exit "$rc"
