#!/usr/bin/env bash
# Every real-GPU check, or some of them, one after another, each one's output
# kept in OUT_DIR/<check>.log with the machine's description on top. For a GPU
# machine with PyTorch but no package manager: build there, or bring a build
# directory made elsewhere with scripts/gpu_bundle.sh.
#
#   bash tests/gpu/run_all.sh BUILD_DIR OUT_DIR [CHECK ...]
#
# CHECK (default: all, about 27 minutes in all, calibrate first):
#   calibrate tests/gpu/run_sm_share.sh calibrate  NVML's samples against CUPTI:
#           the stand-in NVML's settings; raw logs in OUT_DIR/calibration (~2 min)
#   memory  tests/gpu/run_memory_checks.sh   memory quotas, PyTorch and JAX   (~2 min)
#   nvml    tests/gpu/run_nvml_checks.sh     nvidia-smi inside a tenant      (~1 min)
#   share   tests/gpu/run_sm_share.sh        GPU-time shares                  (~5 min)
#   bench   bench/gpu/run_gpu.sh             throughput against native, MPS   (~13 min)
#   latency tests/gpu/run_sm_share.sh latency  a decode tenant beside training:
#           its latency percentiles, natively and under fracgpu         (~3 min)
# Exit status: the number of checks that failed (0: all passed); 2 at once
# when there is no GPU.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 64
[[ $# -ge 2 ]] || { echo "usage: run_all.sh BUILD_DIR OUT_DIR [calibrate|memory|nvml|share|bench|latency ...]" >&2; exit 64; }
build=$(realpath "$1") || exit 64
out=$2
shift 2
checks=("$@")
[[ ${#checks[@]} -gt 0 ]] || checks=(calibrate memory nvml share bench latency)
mkdir -p "$out"
out=$(realpath "$out")
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "run_all.sh: no NVIDIA GPU here (nvidia-smi -L failed): these checks need one" >&2
  exit 2
fi

machine() {
  date -u +"date: %Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  python3 -c 'import torch; print("torch:", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -n 1
  echo "fracgpu: $(git describe --always --dirty 2>/dev/null || echo unknown), build $build"
}

failed=0
for check in "${checks[@]}"; do
  case $check in
    calibrate) cmd=(bash tests/gpu/run_sm_share.sh calibrate "$build" --out "$out/calibration") ;;
    memory) cmd=(env FRACGPU_BUILD_DIR="$build" bash tests/gpu/run_memory_checks.sh) ;;
    nvml) cmd=(env FRACGPU_BUILD_DIR="$build" bash tests/gpu/run_nvml_checks.sh) ;;
    share) cmd=(bash tests/gpu/run_sm_share.sh "$build" --out "$out/share") ;;
    bench) cmd=(bash bench/gpu/run_gpu.sh "$build" "$out/bench") ;;
    latency) cmd=(bash tests/gpu/run_sm_share.sh latency "$build" --out "$out/latency") ;;
    *) echo "unknown check: $check" >&2; exit 64 ;;
  esac
  log=$out/$check.log
  { machine; echo "command: ${cmd[*]}"; echo; } >"$log"
  echo "== $check: ${cmd[*]} (log: $log)"
  if "${cmd[@]}" >>"$log" 2>&1; then
    echo "== $check: passed"
  else
    echo "== $check: FAILED (exit $?)"
    failed=$((failed + 1))
  fi
  tail -n 40 "$log"
done
exit "$failed"
