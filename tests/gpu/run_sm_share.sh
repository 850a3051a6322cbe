#!/usr/bin/env bash
# GPU-time shares on a real NVIDIA GPU (issue 3; how they work: docs/sm-time.md).
#
#   bash tests/gpu/run_sm_share.sh [calibrate | latency] [BUILD_DIR] [--seconds N] [--size N]
#        [--kinds K[,K...]] [--sync-every N] [--no-three-tenants] [--no-launch-bound]
#        [--no-nvml] [--out DIR] [--inflight N]
#
# BUILD_DIR defaults to $FRACGPU_BUILD_DIR, else build/ (scripts/build.sh's);
# this script builds nothing. Needs one NVIDIA GPU (GPU 0 is used), PyTorch,
# and optionally pynvml (nvidia-ml-py) with accounting mode on (as root:
# nvidia-smi -i 0 -am 1) for the NVML measure. Takes about 7.5 minutes (below).
#
# With the workload in tests/gpu/sm_share_workload.py (fp16 matmuls that keep
# the GPU busy; kinds: matmul, or mixed = one large and 16 small kernels), it
#  1. runs each workload kind alone on GPU 0 without fracgpu: the baseline;
#  2. runs two tenants pinned to GPU 0 (devices = [0]) at 0.5/0.5, 0.25/0.75
#     and 0.1/0.9, then three at 0.2/0.3/0.5 (unless --no-three-tenants), for
#     N seconds (default 20) from a common start, with the default limit (the
#     share: a hard cap, so whoever finishes first hands the others no extra
#     time and the end of the window does not skew the shares);
#  3. runs the baselines again (clock or thermal drift);
# and prints a Markdown table: per tenant its configured share, its measured
# share of GPU time (NVML accounting if enabled, else throughput vs alone),
# its throughput vs alone, and fracgpu's own achieved_10s figure.
#  4. (unless --no-launch-bound) the launch-bound shapes of the simulated tests:
#     step10 and step50, one thread launching a ~10 us (50 us) kernel then
#     spinning 1.2x that on the CPU, nothing queued ahead; two such processes
#     without fracgpu, then two tenants at 0.5/0.5; four step50 processes,
#     then four tenants at 0.25; the mixed pair, step10 beside matmul, then
#     tenants at 0.5/0.5 with matmul's limit 1.0; a table of the GPU's busy
#     time with and without fracgpu, each one's share of the GPU time used
#     (NVML accounting needed) and the mixed pair's steps with and without.
# Unless --no-nvml, the CUPTI meter (bench/gpu/cupti_meter.cpp, injected with
# CUDA_INJECTION64_PATH; each process's kernel time) runs in every workload
# process but the launch-bound ones, and in the two-tenant splits nvml_sampler
# (bench/gpu/nvml_sampler.cpp) polls NVML every 2 ms over the window; the
# report adds, per split, NVML's integrated per-process estimate against
# CUPTI's GPU time and the throughput-known one, NVML's sampling period,
# NOT_FOUND fraction and PIDs per sample (figures only: the exit status does
# not depend on them). Both are taken from BUILD_DIR/bench/gpu, from
# $FRACGPU_NVML_SAMPLER / $FRACGPU_CUPTI_METER, or built into the results
# directory (bench/gpu/build_tools.sh: a C++ compiler, CUPTI from the CUDA
# toolkit; also where one named or found lacks a shared library here, as one
# built on another machine may); without them those figures are left out.
#
# `calibrate` runs the calibration of the stand-in NVML instead
# (docs/gpu-results.md, "Calibrating the stand-in NVML"; about 1.5 minutes):
# with the CUPTI meter in every workload process and nvml_sampler polling
# nvmlDeviceGetProcessUtilization, nvmlDeviceGetProcessesUtilizationInfo and
# nvmlDeviceGetSamples(GPU_UTILIZATION) every 2 ms for the window (--seconds,
# default 20), on the first workload kind of --kinds:
#   1. one process alone, without fracgpu (its time per iteration, CUPTI exact);
#   2. two processes without fracgpu (the driver's time-slicing; each one's GPU
#      time known from its throughput against alone);
#   3. two tenants at 0.25/0.75 under fracgpud (GPU time from CUPTI: one
#      tenant's kernels at a time).
# It prints each process's known GPU time beside CUPTI's and NVML's estimate,
# NVML's sampling figures per call, the summary lines to paste into
# docs/gpu-results.md and the suggested SIMNVML_SAMPLE_MS / SIMNVML_ATTRIB for
# tests/simnvml; the raw logs (nvml-sampler.jsonl: every poll's answers;
# cupti-<tenant>.<pid>.json) stay in the results directory. It needs
# nvml_sampler (exit 2 without it); exit 1 if a phase failed or its sampler
# gave no summary.
#
# `latency` runs inference beside training instead (issue 24, latency
# tenants; docs/performance.md, "Inference beside training (latency
# tenants)"; about 3 minutes at the default 20 s per run), with the workloads
# of bench/gpu/latency_workload.py: a decode-like tenant `inf` (requests every
# 10 ms +- 1 ms, each 16 steps of 4 fp16 [4, 4096] x [4096, 4096] matmuls,
# latency per request from its first launch to a CUDA event's synchronize)
# and a training tenant `train` (fp16 --size matmuls, --inflight, default
# 1000, iterations queued ahead):
#   1. the decode alone, the training alone, without fracgpu (the targets'
#      and the training's references);
#   2. the decode alone under fracgpud (gpus = 0.25, priority latency);
#   3. both without fracgpu (two processes);
#   4. both under fracgpud, both normal (inf 0.25, train 0.75 with limit 1.0:
#      it may use what the decode leaves);
#   5. both with inf at priority = "latency" (left out, and said so, if this
#      fracgpud refuses the key: fracgpud --check);
# and prints the table (latency_workload.py report; also latency_table.md in
# the results directory): decode p50/p99/p99.9, requests, each tenant's GPU
# time (the decode's from the CUPTI meter unless --no-nvml), the training's
# fraction of the time the decode leaves and its iterations/s, the issue's
# targets and whether each is met (exit 1 only if a run failed).
#
# Results go to a new directory (printed at the end) under --out DIR, else
# under /tmp.
#
# Time (estimated; never timed on a GPU): each run (a group of processes from
# a common start) is --seconds plus ~7 s: the processes' warm-up in parallel
# (PyTorch's import, CUDA context, cuBLAS: ~5 s), the 1 s to the common
# start, NVML accounting read after, the daemon's start and stop; the latency
# runs with training ~2 s more (its queue drains at the end). Before the runs
# ~10 s (PyTorch and NVML probes) and, without the instruments at hand, ~5 s
# to compile them (build_tools.sh). Runs: the shares 16 (2 kinds x 2
# baselines, 4 splits, 4 x 2 launch-bound), 5 with --kinds matmul
# --no-three-tenants --no-launch-bound; calibrate 3; latency 6 (5 where
# fracgpud refuses the priority key). Default 20 s: shares ~450 s, calibrate
# ~100 s, latency ~185 s; tests/gpu/run_all.sh --quick: shares at --seconds 11
# with the three options above ~105 s, latency at --seconds 10 ~120 s.
#
# Exit status: 0 every tenant within 5 points of its share; 1 one or more off
# by more, or a run failed; 2 could not run at all. 5 points is a smoke
# threshold for a real GPU (hand-over drains and context switches cost time
# that counts against the tenants, NVML's percentages are integers); the
# simulated-driver tests (tests/gputime_test.cpp) hold 2 points.
# Paste the output into docs/gpu-results.md; per-tenant JSON, fracgpu status
# and the daemon's logs are kept in the results directory printed at the end.
set -euo pipefail
cd "$(dirname "$0")/../.."

die() { echo "run_sm_share.sh: $*" >&2; exit 2; }

build=${FRACGPU_BUILD_DIR:-build}
run_seconds=20
size=8192
kinds=matmul,mixed
sync_every=8
three_tenants=1
launch_bound=1
nvml=1
calibrate=0
latency=0
inflight=1000
out_dir=""
poll_ms=2
if [[ ${1:-} == calibrate ]]; then calibrate=1; shift; fi
if [[ ${1:-} == latency ]]; then latency=1; shift; fi
while (($#)); do
  case $1 in
    --no-nvml) nvml=0; shift ;;
    --out) out_dir=${2:?--out needs a directory}; shift 2 ;;
    --seconds) run_seconds=${2:?--seconds needs a value}; shift 2 ;;
    --size) size=${2:?--size needs a value}; shift 2 ;;
    --kinds) kinds=${2:?--kinds needs a value}; shift 2 ;;
    --sync-every) sync_every=${2:?--sync-every needs a value}; shift 2 ;;
    --inflight) inflight=${2:?--inflight needs a value}; shift 2 ;;
    --no-three-tenants) three_tenants=0; shift ;;
    --no-launch-bound) launch_bound=0; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) build=$1; shift ;;
  esac
done
[[ $run_seconds =~ ^[0-9]+$ ]] || die "--seconds takes whole seconds, not $run_seconds"
[[ $inflight =~ ^[1-9][0-9]*$ ]] || die "--inflight takes a whole number above 0, not $inflight"
IFS=, read -r -a kind_list <<<"$kinds"
for kind in "${kind_list[@]}"; do
  [[ $kind =~ ^(matmul|mixed|step10|step50)$ ]] ||
    die "--kinds: unknown workload kind \"$kind\" (matmul, mixed, step10, step50)"
done

build=$(realpath "$build") || die "no build dir $build"
fracgpud=$build/controller/fracgpud
fracgpu=$build/controller/fracgpu
lib=$build/interpose/libfracgpu.so
work=tests/gpu/sm_share_workload.py
latency_work=bench/gpu/latency_workload.py
for f in "$fracgpud" "$fracgpu" "$lib"; do
  [[ -e $f ]] || die "$f not found: build first (bash scripts/build.sh) or name the build dir"
done
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: this check needs an NVIDIA GPU"
python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null ||
  die "PyTorch with CUDA is needed (python3 -c 'import torch; torch.cuda.is_available()' failed)"
((calibrate == 0 || latency == 0)) || die "calibrate or latency: one at a time"
((calibrate == 0 || nvml == 1)) || die "calibrate needs the NVML sampler: leave out --no-nvml"

# GPU 0 as nvidia-smi and fracgpud number GPUs (PCI bus order). The tenants
# select it by UUID, so their CUDA device 0 is that GPU whatever
# CUDA_VISIBLE_DEVICES was, and NVML is asked about the same GPU.
gpu_uuid=$(nvidia-smi -i 0 --query-gpu=uuid --format=csv,noheader)
compute_mode=$(nvidia-smi -i 0 --query-gpu=compute_mode --format=csv,noheader)
if [[ $compute_mode == Exclusive_Process ]]; then
  die "GPU 0 is in Exclusive_Process compute mode: tenants cannot share it"
fi

mkdir -p "${out_dir:-/tmp}" || die "cannot make --out $out_dir"
results=$(mktemp -d "$(realpath "${out_dir:-/tmp}")/fracgpu-sm-share-XXXXXX")
: >"$results/manifest.tsv"
daemon_pid=""
sampler_pid=""
tenant_pids=()
split_dirs=()

# Whether FILE's shared libraries all resolve here (one built elsewhere may
# name a CUPTI directory this machine lacks); true for what ldd cannot read.
links() { ! ldd "$1" 2>/dev/null | grep -q 'not found'; }
# The NVML calibration's instruments: named, from the build directory, or built.
sampler="" meter=""
if ((nvml)); then
  sampler=${FRACGPU_NVML_SAMPLER:-$build/bench/gpu/nvml_sampler}
  meter=${FRACGPU_CUPTI_METER:-$build/bench/gpu/libfracgpu_cupti_meter.so}
  if ! { [[ -x $sampler && -e $meter ]] && links "$sampler" && links "$meter"; } &&
    bash bench/gpu/build_tools.sh "$results/bin" 2>"$results/build_tools.log"; then
    if [[ ! -x $sampler ]] || ! links "$sampler"; then sampler=$results/bin/nvml_sampler; fi
    if [[ ! -e $meter ]] || ! links "$meter"; then meter=$results/bin/libfracgpu_cupti_meter.so; fi
  fi
  if [[ ! -x $sampler ]] || ! links "$sampler"; then
    ((calibrate == 0)) || die "no nvml_sampler (build dir, \$FRACGPU_NVML_SAMPLER, build_tools.sh: $(tail -n 2 "$results/build_tools.log" 2>/dev/null | tr '\n' ' '))"
    sampler=""
  fi
  if [[ ! -e $meter ]] || ! links "$meter"; then meter=""; fi
fi
# What run_group adds to a group's processes: "meter" (the CUPTI meter in
# each), "sampler" (nvml_sampler beside them); set by the caller.
group_tools=""

# Ends only what this script started: the current split's tenants and daemon.
stop_pids() {
  local pid
  for pid in "$@"; do kill -TERM "$pid" 2>/dev/null || true; done
  for _ in $(seq 50); do
    local alive=0
    for pid in "$@"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.1
  done
  for pid in "$@"; do kill -KILL "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
}
# shellcheck disable=SC2317 # reached through the EXIT trap
cleanup() {
  stop_pids "${tenant_pids[@]}"
  if [[ -n $sampler_pid ]]; then stop_pids "$sampler_pid"; fi
  if [[ -n $daemon_pid ]]; then stop_pids "$daemon_pid"; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Splits whose daemon never set their tenants up: no group ran, nothing for
# the report to count, so they fail the run here.
splits_not_run=()
splits_not_run_fail() {
  ((${#splits_not_run[@]} == 0)) && return 0
  echo "FAILED: ${#splits_not_run[@]} split(s) never ran (fracgpud did not set them up): ${splits_not_run[*]}"
  rc=1
}

now_ns() { python3 -c 'import time; print(time.clock_gettime_ns(time.CLOCK_MONOTONIC))'; }
sleep_until_ns() {
  python3 -c 'import sys, time; time.sleep(max(0.0, (int(sys.argv[1]) - time.clock_gettime_ns(time.CLOCK_MONOTONIC)) / 1e9))' "$1"
}

# run_group DIR RUN_DIR TENANT:SHARE:KIND[:PRIORITY]...
# Runs the workloads together from a common start, as tenants of the fracgpud
# on RUN_DIR, or without fracgpu when RUN_DIR is empty (KIND decode and train:
# bench/gpu/latency_workload.py's; DIR/tenants.tsv lists them). Leaves in DIR each
# tenant's JSON and stderr, NVML accounting, and (with fracgpu) fracgpu status
# taken one second before the window ends; with $group_tools, each tenant's
# CUPTI meter file (cupti-TENANT.PID.json) and nvml_sampler's log
# (nvml-sampler.jsonl, from the common start for the window). A failed tenant
# is reported and left for the report to count; the other groups still run.
run_group() {
  local dir=$1 run_dir=$2; shift 2
  local spec tenant share kind priority limit
  local -a names=() vars cmd
  mkdir -p "$dir"
  : >"$dir/tenants.tsv"
  tenant_pids=()
  for spec in "$@"; do
    IFS=: read -r tenant share kind priority limit <<<"$spec"
    printf '%s\t%s\t%s\t%s\n' "$tenant" "$share" "$kind" "$priority" >>"$dir/tenants.tsv"
    vars=(CUDA_VISIBLE_DEVICES="$gpu_uuid")
    if [[ -n $run_dir ]]; then
      vars+=(FRACGPU_TENANT="$tenant" FRACGPU_RUN_DIR="$run_dir" LD_PRELOAD="$lib")
    fi
    if [[ $group_tools == *meter* && -n $meter ]]; then
      vars+=(CUDA_INJECTION64_PATH="$meter" FRACGPU_CUPTI_OUT="$dir/cupti-$tenant")
    fi
    case $kind in
      decode) cmd=(python3 "$latency_work" decode --latency-file "$dir/$tenant.latencies") ;;
      train) cmd=(python3 "$latency_work" train --size "$size" --inflight "$inflight") ;;
      *) cmd=(python3 "$work" run --kind "$kind" --size "$size" --sync-every "$sync_every") ;;
    esac
    env "${vars[@]}" "${cmd[@]}" --seconds "$run_seconds" --ready-file "$dir/$tenant.ready" --start-file "$dir/start" \
      >"$dir/$tenant.json" 2>"$dir/$tenant.err" &
    tenant_pids+=("$!")
    names+=("$tenant")
    printf '%s\t%s\t%s\t%s\n' "$(basename "$dir")" "$tenant" "$share" "$kind" >>"$results/manifest.tsv"
  done

  # Start together only once every tenant has warmed up: importing PyTorch and
  # creating a context takes seconds, and a fixed delay would be a guess.
  local i deadline=$((SECONDS + 300))
  for i in "${!names[@]}"; do
    until [[ -s $dir/${names[i]}.ready ]]; do
      if ! kill -0 "${tenant_pids[i]}" 2>/dev/null || ((SECONDS >= deadline)); then
        echo "FAILED: ${names[i]} did not warm up ($(basename "$dir")); its stderr:"
        tail -n 20 "$dir/${names[i]}.err" || true
        stop_pids "${tenant_pids[@]}"
        tenant_pids=()
        return 0
      fi
      sleep 0.05
    done
  done
  if [[ $group_tools == *sampler* && -n $sampler ]]; then
    "$sampler" --gpu "$gpu_uuid" --interval-ms "$poll_ms" --seconds "$run_seconds" --start-file "$dir/start" \
      --out "$dir/nvml-sampler.jsonl" 2>"$dir/nvml-sampler.err" &
    sampler_pid=$!
  fi
  local start=$(($(now_ns) + 1000000000))
  echo "$start" >"$dir/start.tmp"
  mv "$dir/start.tmp" "$dir/start" # atomic: no tenant reads half a number

  if [[ -n $run_dir ]]; then
    # achieved_10s is the last 10 s: read it while the window still runs
    # (it covers the window for --seconds >= 11).
    sleep_until_ns $((start + (run_seconds - 1) * 1000000000))
    "$fracgpu" status --run-dir "$run_dir" --json >"$dir/status.json" 2>"$dir/status.err" ||
      echo "warning: fracgpu status --json failed ($(basename "$dir")): $(head -c 300 "$dir/status.err")"
    "$fracgpu" status --run-dir "$run_dir" >"$dir/status.txt" 2>&1 || true
  fi

  local rc pids=()
  for i in "${!names[@]}"; do
    rc=0
    wait "${tenant_pids[i]}" || rc=$?
    pids+=("${tenant_pids[i]}")
    if ((rc != 0)); then
      echo "FAILED: ${names[i]} exited with status $rc ($(basename "$dir")); its stderr:"
      tail -n 20 "$dir/${names[i]}.err" || true
    fi
  done
  tenant_pids=()
  if [[ -n $sampler_pid ]]; then
    # It ends on its own at the end of the window; 30 s later it hangs.
    for _ in $(seq 300); do kill -0 "$sampler_pid" 2>/dev/null || break; sleep 0.1; done
    stop_pids "$sampler_pid"
    sampler_pid=""
  fi
  # NVML reports a process's lifetime only after it has ended: ask now.
  python3 "$work" accounting --uuid "$gpu_uuid" "${pids[@]}" >"$dir/accounting.json" || true
}

# run_split SHARE[:KIND[:LIMIT]]...: tenants a, b, c... with these shares of
# GPU 0, each on KIND or else the next workload kind of --kinds in turn (and
# LIMIT where given, else the share), under a fresh fracgpud.
run_split() {
  local label dir run_dir i share kind limit
  local -a names=(a b c d e f g h) specs=()
  label=$(IFS=-; echo "$*" | tr ':' '_')
  dir=$results/split-$label
  run_dir=$results/run-$label
  mkdir -p "$dir" "$run_dir"
  split_dirs+=("$dir")
  {
    printf '[daemon]\nrun_dir = "%s"\nlog_level = "info"\n\n[[gpu]]\nindex = 0\n' "$run_dir"
    i=0
    for share in "$@"; do
      kind=${kind_list[i % ${#kind_list[@]}]} limit=""
      [[ $share == *:* ]] && kind=${share#*:} share=${share%%:*}
      [[ $kind == *:* ]] && limit=${kind#*:} kind=${kind%%:*}
      # No `limit` unless given: the default is the share (a hard cap), what
      # the share table assumes.
      printf '\n[[tenant]]\nname = "%s"\ngpus = %s\ndevices = [0]\n' "${names[i]}" "$share"
      [[ -z $limit ]] || printf 'limit = %s\n' "$limit"
      specs+=("${names[i]}:$share:$kind")
      i=$((i + 1))
    done
  } >"$run_dir/fracgpud.toml"
  echo "== split $* (${specs[*]}), $run_seconds s"

  "$fracgpud" --config "$run_dir/fracgpud.toml" 2>"$dir/fracgpud.log" &
  daemon_pid=$!
  # Ready when every tenant has its link to GPU 0's arbiter (gputime-0): a
  # tenant started before it would run with memory quotas only.
  local spec deadline=$((SECONDS + 20))
  for spec in "${specs[@]}"; do
    until [[ -e $run_dir/tenants/${spec%%:*}/gputime-0 ]]; do
      if ! kill -0 "$daemon_pid" 2>/dev/null || ((SECONDS >= deadline)); then
        echo "FAILED: fracgpud did not set up ${spec%%:*}'s GPU-time arbiter; its log:"
        cat "$dir/fracgpud.log"
        stop_pids "$daemon_pid"
        daemon_pid=""
        # No group ran, so the report's manifest has no row for it: counted here.
        splits_not_run+=("$*")
        return 0
      fi
      sleep 0.1
    done
  done

  run_group "$dir" "$run_dir" "${specs[@]}"
  stop_pids "$daemon_pid"
  daemon_pid=""
}

# latency_config RUN_DIR TENANT:SHARE:KIND[:PRIORITY[:LIMIT]]...: a config
# giving each TENANT its SHARE of GPU 0 and its PRIORITY and LIMIT where
# named, on stdout.
latency_config() {
  local run_dir=$1 spec tenant share kind priority limit
  shift
  printf '[daemon]\nrun_dir = "%s"\nlog_level = "info"\n\n[[gpu]]\nindex = 0\n' "$run_dir"
  for spec in "$@"; do
    IFS=: read -r tenant share kind priority limit <<<"$spec"
    printf '\n[[tenant]]\nname = "%s"\ngpus = %s\ndevices = [0]\n' "$tenant" "$share"
    [[ -z $priority ]] || printf 'priority = "%s"\n' "$priority"
    [[ -z $limit ]] || printf 'limit = %s\n' "$limit"
  done
}

# run_named_split GROUP TENANT:SHARE:KIND[:PRIORITY[:LIMIT]]...: these tenants under a
# fresh fracgpud, into $results/GROUP (the latency runs: named tenants, a
# priority each).
run_named_split() {
  local group=$1 dir run_dir spec deadline=$((SECONDS + 20))
  shift
  dir=$results/$group
  run_dir=$results/run-$group
  mkdir -p "$dir" "$run_dir"
  split_dirs+=("$dir")
  latency_config "$run_dir" "$@" >"$run_dir/fracgpud.toml"
  echo "== $group ($*), $run_seconds s"
  "$fracgpud" --config "$run_dir/fracgpud.toml" 2>"$dir/fracgpud.log" &
  daemon_pid=$!
  for spec in "$@"; do
    until [[ -e $run_dir/tenants/${spec%%:*}/gputime-0 ]]; do
      if ! kill -0 "$daemon_pid" 2>/dev/null || ((SECONDS >= deadline)); then
        echo "FAILED: fracgpud did not set up ${spec%%:*}'s GPU-time arbiter; its log:"
        cat "$dir/fracgpud.log"
        stop_pids "$daemon_pid"
        daemon_pid=""
        return 0
      fi
      sleep 0.1
    done
  done
  run_group "$dir" "$run_dir" "$@"
  stop_pids "$daemon_pid"
  daemon_pid=""
}

run_baselines() { # run_baselines before|after
  local kind
  for kind in $(printf '%s\n' "${kind_list[@]}" | awk '!seen[$0]++'); do
    echo "== $kind alone, without fracgpu ($1), $run_seconds s"
    run_group "$results/alone-$1-$kind" "" "$kind:alone:$kind"
  done
}

# The record: when, on what, with what.
if ((latency)); then
  echo "# Inference beside training on a real GPU: tests/gpu/run_sm_share.sh latency"
elif ((calibrate)); then
  echo "# NVML calibration on a real GPU: tests/gpu/run_sm_share.sh calibrate"
else
  echo "# GPU-time shares on a real GPU: tests/gpu/run_sm_share.sh"
fi
echo
echo "- date: $(date -u +%Y-%m-%dT%H:%MZ)"
echo "- GPU, driver: $(nvidia-smi -i 0 --query-gpu=name,driver_version --format=csv,noheader) ($gpu_uuid, compute mode $compute_mode)"
echo "- $(python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)')"
echo "- fracgpu: $(git describe --always --dirty 2>/dev/null || echo unknown), build $build"
if ((latency)); then
  echo "- workload: decode (bench/gpu/latency_workload.py defaults) beside training (size $size, $inflight in flight), $run_seconds s per run"
else
  echo "- workload: kinds $kinds, size $size, synchronize every $sync_every, $run_seconds s per run"
fi
python3 "$work" accounting --uuid "$gpu_uuid" >"$results/accounting-probe.json"
echo "- NVML accounting: $(python3 -c 'import json, sys; a = json.load(sys.stdin); print(a["state"], a["reason"])' <"$results/accounting-probe.json")"
# A sandbox may refuse the query: a warning only, never the end of the check.
others=$(nvidia-smi -i 0 --query-compute-apps=pid,process_name --format=csv,noheader 2>/dev/null) || others=
[[ -z $others ]] || echo "- WARNING: other processes use GPU 0 and will skew every figure: ${others//$'\n'/; }"
((run_seconds >= 11)) || echo "- WARNING: --seconds below 11: achieved_10s also covers time before the window"
if ((nvml)); then
  echo "- NVML sampler: ${sampler:-none (its figures are left out)}, every $poll_ms ms; CUPTI meter: ${meter:-none (CUPTI figures n/a)}"
fi
echo

if ((calibrate)); then
  kind=${kind_list[0]}
  group_tools="meter sampler"
  echo "== calibration 1/3: $kind alone, without fracgpu, $run_seconds s"
  run_group "$results/calib-alone" "" "a:alone:$kind"
  echo "== calibration 2/3: two $kind processes without fracgpu, $run_seconds s"
  run_group "$results/calib-pair" "" "a:pair:$kind" "b:pair:$kind"
  echo "== calibration 3/3: two tenants at 0.25/0.75 under fracgpud"
  run_split "0.25:$kind" "0.75:$kind"
  echo
  rc=0
  python3 "$work" calibration "$results" || rc=$?
  splits_not_run_fail
  echo
  echo "Raw logs (every poll of nvml_sampler, each process's CUPTI meter file) and per-process JSON: $results"
  exit "$rc"
fi

if ((latency)); then
  # The CUPTI meter gives the decode's GPU time; it costs every kernel a
  # little, in every run alike (none with --no-nvml).
  group_tools=""
  ((nvml == 0)) || group_tools="meter"
  # Does this fracgpud take a tenant's priority? Without the key, the run
  # that needs it is left out (and the table says so).
  latency_config "$results/probe" inf:0.25:decode:latency train:0.75:train >"$results/probe.toml"
  prio=":latency"
  mkdir -p "$results/probe"
  if ! probe=$("$fracgpud" --config "$results/probe.toml" --check 2>&1); then
    # shellcheck disable=SC2001 # a pattern per line (the file's name), not one substitution
    echo "this fracgpud refuses a tenant's priority: $(sed 's/^[^ ]*\.toml:[0-9]*: //' <<<"$probe" | head -n 1)" \
      >"$results/latency-skipped.txt"
    echo "- NOTE: $(cat "$results/latency-skipped.txt"); the runs with priority = \"latency\" are left out"
    prio=""
  fi
  echo "== the decode alone, without fracgpu, $run_seconds s"
  run_group "$results/latency-decode-alone" "" "inf:alone:decode"
  echo "== the training alone, without fracgpu, $run_seconds s"
  run_group "$results/latency-train-alone" "" "train:alone:train"
  run_named_split latency-decode-fracgpu-alone "inf:0.25:decode$prio"
  echo "== both, without fracgpu, $run_seconds s"
  run_group "$results/latency-native-2" "" "inf:pair:decode" "train:pair:train"
  # The training's limit is the whole GPU: it is to use what the decode leaves.
  run_named_split latency-fracgpu-normal "inf:0.25:decode" "train:0.75:train::1.0"
  [[ -z $prio ]] || run_named_split latency-fracgpu-latency "inf:0.25:decode:latency" "train:0.75:train::1.0"
  echo
  rc=0
  python3 "$latency_work" report "$results" || rc=$?
  echo
  echo "Details (per-tenant JSON, latencies and stderr, status, daemon logs): $results"
  exit "$rc"
fi

group_tools=""
((nvml == 0)) || group_tools="meter"

run_baselines before
((nvml == 0)) || group_tools="meter sampler"
run_split 0.5 0.5
run_split 0.25 0.75
run_split 0.1 0.9
((nvml == 0)) || group_tools="meter"
if ((three_tenants)); then run_split 0.2 0.3 0.5; fi
if ((launch_bound)); then
  group_tools=""  # launch-bound: CUPTI's cost per launch would change the shape
  for kind in step10 step50; do
    echo "== launch-bound $kind: two processes without fracgpu, $run_seconds s"
    run_group "$results/pair-native-$kind" "" "a:pair:$kind" "b:pair:$kind"
    run_split "0.5:$kind" "0.5:$kind"
  done
  echo "== launch-bound: four step50 processes without fracgpu, $run_seconds s"
  run_group "$results/pair-native-four-step50" "" a:pair:step50 b:pair:step50 c:pair:step50 d:pair:step50
  run_split 0.25:step50 0.25:step50 0.25:step50 0.25:step50
  echo "== the mixed pair: step10 beside matmul without fracgpu, $run_seconds s"
  run_group "$results/pair-native-mixed" "" a:pair:step10 b:pair:matmul
  run_split 0.5:step10 0.5:matmul:1.0
fi
((nvml == 0)) || group_tools="meter"
run_baselines after

echo
rc=0
python3 "$work" report "$results" --threshold 0.05 || rc=$?
splits_not_run_fail
echo
echo "## fracgpu status, one second before each split's window ended"
for dir in "${split_dirs[@]}"; do
  [[ -e $dir/status.txt ]] || continue
  echo
  echo "### $(basename "$dir")"
  echo '```'
  cat "$dir/status.txt"
  echo '```'
done
echo
echo "Details (per-tenant JSON and stderr, status, NVML accounting, daemon logs): $results"
exit "$rc"
