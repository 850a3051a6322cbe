#!/usr/bin/env bash
# The main job, from a fresh Debian machine (as root, CUDA toolkit present):
# installs the dependencies, builds, starts fracgpud with examples/demo.toml,
# and runs a workload under the interposer as two tenants. On a machine
# without an NVIDIA GPU, everything runs on the simulated driver (a test
# double built with the tests), and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
build=$(realpath "${FRACGPU_BUILD_DIR:-build}")
run_dir=/tmp/fracgpu-demo
rm -rf "$run_dir" && mkdir -p "$run_dir"

if nvidia-smi -L >/dev/null 2>&1; then
  echo "== real GPU: $(nvidia-smi -L | head -n 1)"
else
  echo "== no NVIDIA GPU here: using the simulated driver (16 GiB, 256 MiB per context)"
  export LD_LIBRARY_PATH="$build/simcuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export SIMCUDA_STATE="$run_dir/simulated-gpu"
  export SIMCUDA_DEVICES="uuid=GPU-5eed0000-0000-4000-8000-000000000000,name=Simulated H100,mem=16GiB,ctx=256MiB"
fi

"$build/controller/fracgpud" --config examples/demo.toml 2>"$run_dir/fracgpud.log" &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null; wait $daemon 2>/dev/null || true' EXIT
for _ in $(seq 50); do [ -f "$run_dir/tenants/bob/usage" ] && break; sleep 0.1; done

as_tenant() {  # as_tenant NAME COMMAND...
  local tenant=$1; shift
  FRACGPU_TENANT=$tenant FRACGPU_RUN_DIR=$run_dir LD_PRELOAD="$build/interpose/libfracgpu.so" "$@"
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
echo "== daemon log"
cat "$run_dir/fracgpud.log"
