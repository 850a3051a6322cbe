#!/usr/bin/env bash
# Configures and builds into ${FRACGPU_BUILD_DIR:-build}. Extra arguments go to cmake.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${FRACGPU_BUILD_DIR:-build}
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCUDAToolkit_ROOT=/usr/local/cuda "$@" >/dev/null
cmake --build "$build" -j "$(nproc)"
