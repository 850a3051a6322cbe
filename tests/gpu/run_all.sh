#!/usr/bin/env bash
# Every real-GPU check, or some of them, one after another, each one's output
# kept in OUT_DIR/<check>.log with the machine's description on top. For a GPU
# machine with PyTorch but no package manager: build there, or bring a build
# directory made elsewhere with scripts/gpu_bundle.sh (with --with-instruments,
# so that nothing needs compiling on the GPU machine).
#
#   bash tests/gpu/run_all.sh [--quick] [--deadline-s N] [--dry-run] BUILD_DIR OUT_DIR [CHECK ...]
#
# CHECK (default: all, in this order: the most valuable first, so that what a
# deadline leaves out is missed least), with its estimated wall time in full |
# with --quick:
#   calibrate tests/gpu/run_sm_share.sh calibrate: NVML's samples against
#             CUPTI, the stand-in NVML's settings (every simulated GPU-time
#             test rests on them; its first two phases need nothing of fracgpu
#             to work); raw logs in OUT_DIR/calibration.
#             3 runs of 20 s either way                          100 s | 100 s
#   timeslice tests/gpu/run_timeslice.sh: the driver's own slice length and
#             context-switch gap (two, then three processes spinning on the
#             GPU's global timer), the simulated driver's time-slice model's
#             settings; then whether CUPTI's context-switch records show a
#             process the others' switches. 3 runs of 2 s, ~5 s of nvcc
#             without the bundle's probe                         25 s |  25 s
#   memory    tests/gpu/run_memory_checks.sh: memory quotas under PyTorch and
#             JAX, the cheapest whole test of the interposer on a real driver.
#             9 short processes, one after another                50 s |  50 s
#   share     tests/gpu/run_sm_share.sh: GPU-time shares 0.5/0.5, 0.25/0.75,
#             0.1/0.9 (full: also 0.2/0.3/0.5, the mixed kind, launch-bound
#             shapes). 16 runs of 20 s | 5 runs of 11 s          450 s | 105 s
#   hostile   tests/gpu/run_hostile.sh: bench/e2e's hostile containers (a
#             bypass, a chain of short-lived processes, a dodging bypass,
#             the false drain, garbage in the usage file) beside an honest
#             0.5 tenant, without and with fracgpu; the honest tenant's
#             share of the GPU time used. Needs a build with the tests
#             (gputime_load, usage_attacker); root for the bypasses.
#             19 runs of 10 s | 5 runs of 5 s                    250 s |  45 s
#   nvml      tests/gpu/run_nvml_checks.sh: nvidia-smi inside a tenant.
#             5 PyTorch processes, ~11 nvidia-smi calls           45 s |  45 s
#   latency   tests/gpu/run_sm_share.sh latency: a decode tenant beside
#             training, natively and under fracgpu.
#             6 runs of 20 s | 10 s                              185 s | 120 s
#   bench     bench/gpu/run_gpu.sh: throughput of one tenant and of two 0.5
#             tenants against native (compute; launch: the launch overhead),
#             time-slicing (full: also PyTorch, the CUPTI and NVML passes,
#             0.25/0.75, 0.1/0.9, MPS). Last: the longest, and its figures
#             mean little where the checks before it fail.
#             39 runs of 15 s | 12 runs of 4 s                   750 s |  90 s
#   In all: about 30 minutes in full; about 9.7 minutes (580 s) with --quick.
# How the estimates are made (on an idle H100/H200, warm page cache; none has
# been timed yet): a run is its window plus the start of its processes, which
# start in parallel (PyTorch: import, CUDA context, cuBLAS, ~5 s; a CUDA
# binary ~1.5 s), a 0.5-1 s common start, the daemon's start and stop, NVML
# accounting read after. Each run_sm_share.sh (calibrate, share, latency)
# adds ~10 s (PyTorch and NVML probes) and, without the instruments in
# BUILD_DIR/bench/gpu, ~5 s to compile them; bench compiles gpu_workload.cu
# with nvcc (~10-20 s) unless BUILD_DIR/bench/gpu/gpu_workload runs here, and
# in full the instruments too where they are missing. The first PyTorch
# process on a fresh machine may take 10-20 s more (cold page cache). Each
# check's log ends with the time it took: correct these figures from them.
#
# --quick        every check cut to what a first run on a GPU needs, all
#                eight in about 10 minutes: calibrate as in full (20 s windows, NVML
#                polled every 2 ms); share --seconds 11 --kinds matmul
#                --no-three-tenants --no-launch-bound (the three two-tenant
#                splits between two baselines; at 11 s fracgpu's achieved_10s
#                still covers only the window); latency --seconds 10 (all six
#                runs, ~1000 requests each); bench --workloads compute,launch
#                --repeats 2 --seconds 4 --passes throughput --half-split-only
#                --no-mps (native against one tenant and two 0.5 tenants, and
#                time-slicing); hostile --seconds 5 --kinds bypass-dodge,
#                false-drain; memory and nvml as in full (short already).
# --deadline-s N every check is to end within N s of this script's start: one
#                whose estimate does not fit in what is left is skipped (said
#                so here and in OUT_DIR/<check>.log; neither passed nor
#                failed) and the next ones are still tried; one still running
#                at N s is stopped (SIGTERM to it and its processes, SIGKILL
#                10 s later) and counts as failed. Without it nothing is
#                skipped or stopped.
# --dry-run      prints each check's command and estimate (with --deadline-s,
#                which would fit if each took its estimate) and runs nothing;
#                needs no GPU.
#
# At the end: one line per check (passed / FAILED / skipped, with its time and
# estimate), also written to OUT_DIR/summary.txt.
# Exit status: the number of checks that failed (0: all that ran passed); 2
# at once when there is no GPU; 64 on a bad argument.
set -uo pipefail
# BUILD_DIR and OUT_DIR as given, relative to where this was started; the
# checks run from the repository's root.
started_in=$PWD
cd "$(dirname "$0")/../.." || exit 64
usage() {
  echo "usage: run_all.sh [--quick] [--deadline-s N] [--dry-run] BUILD_DIR OUT_DIR [calibrate|timeslice|memory|share|hostile|nvml|latency|bench ...]" >&2
  exit 64
}
quick=0 deadline="" dry_run=0
args=()
while (($#)); do
  case $1 in
    --quick) quick=1; shift ;;
    --deadline-s)
      deadline=${2:-}
      [[ $deadline =~ ^[1-9][0-9]*$ ]] || { echo "run_all.sh: --deadline-s takes whole seconds above 0" >&2; usage; }
      shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "run_all.sh: unknown option $1" >&2; usage ;;
    *) args+=("$1"); shift ;;
  esac
done
[[ ${#args[@]} -ge 2 ]] || usage
build=$(cd "$started_in" && realpath "${args[0]}") || exit 64
out=${args[1]}
[[ $out == /* ]] || out=$started_in/$out
checks=("${args[@]:2}")
[[ ${#checks[@]} -gt 0 ]] || checks=(calibrate timeslice memory share hostile nvml latency bench)

# Estimated wall time per check, in seconds (derived in the header).
declare -A estimate_full=([calibrate]=100 [timeslice]=25 [memory]=50 [share]=450 [hostile]=250 [nvml]=45 [latency]=185
  [bench]=750)
declare -A estimate_quick=([calibrate]=100 [timeslice]=25 [memory]=50 [share]=105 [hostile]=45 [nvml]=45 [latency]=120
  [bench]=90)

# command_for CHECK: sets cmd to the check's command line.
command_for() {
  local -a opts=()
  case $1 in
    calibrate)
      ((quick == 0)) || opts=(--seconds 20)
      cmd=(bash tests/gpu/run_sm_share.sh calibrate "$build" --out "$out/calibration" "${opts[@]}") ;;
    timeslice) cmd=(bash tests/gpu/run_timeslice.sh "$build" --out "$out/timeslice") ;;
    memory) cmd=(env FRACGPU_BUILD_DIR="$build" bash tests/gpu/run_memory_checks.sh) ;;
    nvml) cmd=(env FRACGPU_BUILD_DIR="$build" bash tests/gpu/run_nvml_checks.sh) ;;
    share)
      ((quick == 0)) || opts=(--seconds 11 --kinds matmul --no-three-tenants --no-launch-bound)
      cmd=(bash tests/gpu/run_sm_share.sh "$build" --out "$out/share" "${opts[@]}") ;;
    hostile)
      ((quick == 0)) || opts=(--seconds 5 --kinds "bypass-dodge,false-drain")
      cmd=(bash tests/gpu/run_hostile.sh "$build" --out "$out/hostile" "${opts[@]}") ;;
    bench)
      ((quick == 0)) ||
        opts=(--workloads "compute,launch" --repeats 2 --seconds 4 --passes throughput --half-split-only --no-mps)
      cmd=(bash bench/gpu/run_gpu.sh "$build" "$out/bench" "${opts[@]}")
      # A gpu_workload built beforehand (gpu_bundle.sh --with-instruments):
      # run_gpu.sh tries it and compiles its own only if it does not run here.
      if [[ -z ${FRACGPU_GPU_WORKLOAD:-} && -x $build/bench/gpu/gpu_workload ]]; then
        cmd=(env FRACGPU_GPU_WORKLOAD="$build/bench/gpu/gpu_workload" "${cmd[@]}")
      fi ;;
    latency)
      ((quick == 0)) || opts=(--seconds 10)
      cmd=(bash tests/gpu/run_sm_share.sh latency "$build" --out "$out/latency" "${opts[@]}") ;;
    *) echo "run_all.sh: unknown check: $1" >&2; return 1 ;;
  esac
}
estimate_for() {
  if ((quick)); then echo "${estimate_quick[$1]}"; else echo "${estimate_full[$1]}"; fi
}
# Every name checked before anything runs: a typo must not cost a run.
for check in "${checks[@]}"; do command_for "$check" || usage; done

if ((dry_run)); then
  planned=0
  for check in "${checks[@]}"; do
    command_for "$check"
    est=$(estimate_for "$check")
    fit=""
    if [[ -n $deadline ]]; then
      if ((planned + est <= deadline)); then fit=" (would fit: ends by ~$((planned + est)) s)"
      else fit=" (would be skipped: $((deadline - planned)) s left)"; est=0; fi
    fi
    planned=$((planned + est))
    echo "$check: ~$(estimate_for "$check") s$fit: ${cmd[*]}"
  done
  echo "in all: ~$planned s${deadline:+ of --deadline-s $deadline}"
  exit 0
fi

mkdir -p "$out"
out=$(realpath "$out")
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "run_all.sh: no NVIDIA GPU here (nvidia-smi -L failed): these checks need one" >&2
  exit 2
fi

# The machine's description, asked once (importing PyTorch takes seconds);
# each log gets it with its own date.
machine_lines=$(
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  python3 -c 'import torch; print("torch:", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -n 1
  echo "fracgpu: $(git describe --always --dirty 2>/dev/null || echo unknown), build $build"
  # Programs built with CUDA 13 (the instruments of a bundle made with it)
  # need the 580 driver or newer; the checks then compile their own.
  driver_major=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 | cut -d. -f1)
  if [[ $driver_major =~ ^[0-9]+$ ]] && ((driver_major < 580)); then
    echo "note: driver $driver_major is older than 580: CUDA 13 programs of the build will not run; the checks" \
      "compile their own where nvcc is found, and timeslice and bench fail without it"
  fi
)
machine() {
  date -u +"date: %Y-%m-%d %H:%M UTC"
  echo "$machine_lines"
}

# Each check runs in a process group of its own (setsid; timeout makes one
# too): a signal to this script ends the running check and everything it
# started (tenants, daemon, sampler) before this script exits.
session=()
if command -v setsid >/dev/null; then session=(setsid -w); fi
child=""
# shellcheck disable=SC2317 # reached through the traps
forward() {
  if [[ -n $child ]]; then
    kill -TERM -- "-$child" 2>/dev/null || kill -TERM "$child" 2>/dev/null
    wait "$child" 2>/dev/null
  fi
  exit "$1"
}
trap 'forward 130' INT
trap 'forward 143' TERM
trap 'forward 129' HUP

failed=0
summary=()
for check in "${checks[@]}"; do
  command_for "$check"
  est=$(estimate_for "$check")
  log=$out/$check.log
  { machine; echo "command: ${cmd[*]}"; echo; } >"$log"
  runner=()
  if [[ -n $deadline ]]; then
    left=$((deadline - SECONDS))
    if ((est > left)); then
      why="skipped: would not fit (estimate $est s, $((left > 0 ? left : 0)) s left of --deadline-s $deadline)"
      echo "$why" >>"$log"
      echo "== $check: $why"
      summary+=("$(printf '%-9s %s' "$check" "$why")")
      continue
    fi
    # At the deadline timeout signals its whole process group: the check's
    # script and its tenants, daemon and sampler.
    runner=(timeout --kill-after=10 "$left")
  fi
  echo "== $check: ${cmd[*]} (log: $log; estimate $est s)"
  started=$SECONDS
  rc=0
  # In the background, so that the traps above run while it does.
  "${session[@]}" "${runner[@]}" "${cmd[@]}" >>"$log" 2>&1 &
  child=$!
  wait "$child" || rc=$?
  child=""
  took=$((SECONDS - started))
  if ((rc == 0)); then
    result="passed ($took s; estimate $est s)"
  elif [[ -n $deadline ]] && ((rc == 124 || rc == 137)); then
    result="FAILED: stopped at the deadline ($took s; estimate $est s)"
  else
    result="FAILED (exit $rc; $took s; estimate $est s)"
  fi
  ((rc == 0)) || failed=$((failed + 1))
  echo "run_all.sh: $check $result" >>"$log"
  echo "== $check: $result"
  summary+=("$(printf '%-9s %s' "$check" "$result")")
  tail -n 40 "$log"
done
echo
mode=full
((quick == 0)) || mode=--quick
echo "== summary: $SECONDS s in all ($mode${deadline:+, --deadline-s $deadline})"
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
exit "$failed"
