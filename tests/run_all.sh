#!/usr/bin/env bash
# The whole test suite, from a fresh machine: dependencies, build, CTest
# (unit, end-to-end on the simulated driver, ThreadSanitizer).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
cd "${FRACGPU_BUILD_DIR:-build}"
ctest --output-on-failure --timeout 300 -j 2
