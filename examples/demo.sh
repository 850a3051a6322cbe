#!/usr/bin/env bash
# The main job, from a fresh Debian machine (as root, CUDA toolkit present):
# installs the dependencies, builds, starts fracgpud with examples/demo.toml,
# and runs a workload under the interposer as two tenants: memory quotas
# first, then GPU time (both tenants' compute-bound kernels at once, ~7 s;
# each tenant's achieved share of GPU time beside its configured share, as
# fracgpu reports it and as the simulated driver measured it). On a machine
# without an NVIDIA GPU, everything runs on the simulated driver (a test
# double, tests/simcuda, built here without the tests), and says so; fracgpud
# then gets the stand-in NVML (tests/simnvml), sampling every 167 ms as the
# real one does. On a real GPU the GPU-time part shows `fracgpu status` only:
# its ground truth is the simulated driver's, and the project builds no
# GPU-time load for a real GPU.
# It installs and builds only what it runs (scripts/install-deps.sh --demo),
# into its own build directory, build-demo/ (or $FRACGPU_DEMO_BUILD_DIR):
# no tests, benchmarks or Kubernetes parts; tests/run_all.sh does the full
# install and build.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh --demo
simulated=1
if nvidia-smi -L >/dev/null 2>&1; then simulated=0; fi
build=$(realpath -m "${FRACGPU_DEMO_BUILD_DIR:-build-demo}")
targets=(fracgpud fracgpu_cli fracgpu quota_demo)
simulator=OFF
if ((simulated)); then targets+=(simcuda simnvml e2e_workload); simulator=ON; fi
# -O2 without debug info: the quickest to build of the usual optimized builds.
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_FLAGS_RELEASE=-O2 -DNDEBUG" \
  -DCUDAToolkit_ROOT=/usr/local/cuda \
  -DFRACGPU_BUILD_TESTS=OFF -DFRACGPU_BUILD_BENCH=OFF -DFRACGPU_BUILD_KUBE=OFF \
  -DFRACGPU_BUILD_SIMULATOR=$simulator >/dev/null
cmake --build "$build" -j "$(nproc)" --target "${targets[@]}"
run_dir=/tmp/fracgpu-demo
rm -rf "$run_dir" && mkdir -p "$run_dir"

daemon_env=()
if ((simulated == 0)); then
  echo "== real GPU: $(nvidia-smi -L | head -n 1)"
else
  echo "== no NVIDIA GPU here: using the simulated driver (16 GiB, 256 MiB per context)"
  export LD_LIBRARY_PATH="$build/simcuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export SIMCUDA_STATE="$run_dir/simulated-gpu"
  export SIMCUDA_DEVICES="uuid=GPU-5eed0000-0000-4000-8000-000000000000,name=Simulated H100,mem=16GiB,ctx=256MiB"
  # The daemon alone gets the stand-in NVML, sampling like the real one.
  daemon_env=(LD_LIBRARY_PATH="$build/simnvml:$LD_LIBRARY_PATH" SIMNVML_SAMPLE_MS=167)
fi

env ${daemon_env[@]+"${daemon_env[@]}"} "$build/controller/fracgpud" --config examples/demo.toml 2>"$run_dir/fracgpud.log" &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null; wait $daemon 2>/dev/null || true' EXIT
for _ in $(seq 50); do [ -f "$run_dir/tenants/bob/usage" ] && break; sleep 0.1; done
if ! kill -0 "$daemon" 2>/dev/null || [ ! -f "$run_dir/tenants/bob/usage" ]; then
  echo "fracgpud did not start (its log, $run_dir/fracgpud.log, follows)" >&2
  cat "$run_dir/fracgpud.log" >&2
  exit 1
fi

# FRACGPU_UNMANAGED=deny: should a tenant's ledger be missing after all, its
# processes are refused the GPU rather than run without limits.
as_tenant() {  # as_tenant NAME COMMAND...
  local tenant=$1; shift
  FRACGPU_TENANT=$tenant FRACGPU_RUN_DIR=$run_dir FRACGPU_UNMANAGED=deny LD_PRELOAD="$build/interpose/libfracgpu.so" "$@"
}

echo "== alice (gpus = 0.25): one process fills its quota and holds it"
as_tenant alice "$build/examples/quota_demo" 1024 4 &
first=$!
sleep 1.5
echo "== alice, a second process: shares what the first left"
as_tenant alice "$build/examples/quota_demo" 256
echo "== fracgpu status, while alice's first process holds its memory"
"$build/controller/fracgpu" status --run-dir "$run_dir"
wait $first
echo "== bob (gpus = 0.5)"
as_tenant bob "$build/examples/quota_demo" 1024

# GPU time: both tenants at once, compute-bound (5 ms kernels back to back,
# bench/e2e/e2e_workload.cpp), from a common start.
workload=$build/bench/e2e/e2e_workload
if ((simulated)) && [[ -x $workload ]]; then
  seconds=7
  echo "== GPU time: alice (gpus = 0.25) and bob (gpus = 0.5) both run compute-bound kernels, $seconds s"
  e2e() { python3 bench/e2e/e2e.py "$@"; }
  start=$(($(e2e now) + 700000000))
  procs=()
  for tenant in alice bob; do
    # env execs the workload: $! is its PID, as the simulated driver knows it.
    env FRACGPU_TENANT="$tenant" FRACGPU_RUN_DIR="$run_dir" LD_PRELOAD="$build/interpose/libfracgpu.so" \
      "$workload" mode=compute seconds="$seconds" start_ns="$start" >"$run_dir/$tenant-gputime.out" &
    procs+=("$!:$tenant")
  done
  # Every second: fracgpu's figure and the simulated driver's device time.
  e2e watch --lib "$build/simcuda/libcuda.so.1" --fracgpu "$build/controller/fracgpu" --run-dir "$run_dir" \
    --start-ns "$start" --seconds "$seconds" "${procs[@]}"
  for p in "${procs[@]}"; do wait "${p%%:*}"; done
  echo "   (the last quarter of the GPU stays idle: a tenant's limit defaults to its share, a hard cap)"
elif ((simulated)); then
  echo "== GPU time: skipped: $workload is not built (a build without the benchmarks)"
else
  echo "== GPU time: not run on a real GPU: the demo checks achieved shares against the simulated"
  echo "   driver's record of each process's GPU time (its ground truth), which a real GPU does not"
  echo "   keep, and the project builds no GPU-time load for a real GPU."
  echo "   Run any CUDA program as a tenant (FRACGPU_TENANT=alice FRACGPU_RUN_DIR=$run_dir"
  echo "   LD_PRELOAD=$build/interpose/libfracgpu.so PROGRAM) and fracgpu status shows its GPU time"
  echo "   (columns 1S, 10S, GPU TIME); as it is now:"
  "$build/controller/fracgpu" status --run-dir "$run_dir"
fi
echo "== daemon log"
cat "$run_dir/fracgpud.log"
