#!/usr/bin/env bash
# tests/gpu/run_hostile.sh on the simulated driver, so that the real-GPU
# check is known to run before a GPU is at hand: the simulated driver and the
# stand-in NVML sampling every 167 ms, a stand-in nvidia-smi (beside this
# script), and the simulated libcuda.so.1 as the driver ($FRACGPU_LIBCUDA).
#
#   run_hostile.sh BUILD_DIR [run_hostile.sh's options]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$(realpath "$1")
shift
work=$(mktemp -d /tmp/fracgpu-gpu-sim-XXXXXX)
trap 'rm -rf "$work"' EXIT
export SIMULATED_GPU_UUID=GPU-51a17ed0-0000-4000-8000-000000000000
export SIMULATED_LIBCUDA=$build/simcuda/libcuda.so.1 FRACGPU_LIBCUDA=$build/simcuda/libcuda.so.1
export SIMCUDA_STATE=$work/gpu SIMCUDA_DEVICES="uuid=$SIMULATED_GPU_UUID,name=Simulated H100,mem=16GiB,ctx=64MiB"
export SIMNVML_SAMPLE_MS=167 SIMNVML_ATTRIB=instant
export LD_LIBRARY_PATH="$build/simnvml${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$here:$PATH"
unset CUDA_VISIBLE_DEVICES
bash "$here/../run_hostile.sh" "$build" --out "$work" "$@"
