#!/usr/bin/env bash
# Builds the NVML calibration's instruments where the build directory has none
# (a scripts/gpu_bundle.sh directory builds no benchmarks): run_gpu.sh and
# tests/gpu/run_sm_share.sh call it.
#
#   bash bench/gpu/build_tools.sh OUT_DIR
#
# OUT_DIR/nvml_sampler              bench/gpu/nvml_sampler.cpp (a C++ compiler only)
# OUT_DIR/libfracgpu_cupti_meter.so bench/gpu/cupti_meter.cpp, with CUPTI's header
#                                   and library from the CUDA toolkit (as
#                                   build_workload.sh finds them), found at run
#                                   time through its RUNPATH: that directory,
#                                   then /usr/local/cuda's usual ones (a meter
#                                   built on another machine, as by
#                                   scripts/gpu_bundle.sh --with-instruments,
#                                   still finds libcupti where that toolkit is
#                                   installed elsewhere)
# Time: ~3 s (two small compiles).
# The compiler: $CXX, else c++, else g++. Exit 0 when nvml_sampler was built
# (the meter is optional: its absence is printed), 2 otherwise.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
die() { echo "build_tools.sh: $*" >&2; exit 2; }
[[ $# -eq 1 ]] || die "usage: build_tools.sh OUT_DIR"
out=$1
mkdir -p "$out"

cxx=""
for c in "${CXX:-}" c++ g++; do
  if [[ -n $c ]] && command -v "$c" >/dev/null; then cxx=$c; break; fi
done
[[ -n $cxx ]] || die "no C++ compiler (\$CXX, c++, g++)"
"$cxx" -std=c++17 -O2 -Wall -o "$out/nvml_sampler" "$here/nvml_sampler.cpp" -I"$root/include" -ldl ||
  die "compiling nvml_sampler failed"
echo "== built $out/nvml_sampler" >&2

nvcc=""
for c in "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" "$(command -v nvcc || true)" /usr/local/cuda/bin/nvcc; do
  if [[ -n $c && -x $c ]]; then nvcc=$c; break; fi
done
cuda=${CUDA_HOME:-}
[[ -z $nvcc ]] || cuda=$(dirname "$(dirname "$(realpath "$nvcc")")")
[[ -n $cuda ]] || cuda=/usr/local/cuda
include="" libdir="" cupti_lib=""
for d in "$cuda/extras/CUPTI/include" "$cuda/include" "$cuda"/targets/*/include; do
  if [[ -f $d/cupti.h ]]; then include=$d; break; fi
done
for d in "$cuda/extras/CUPTI/lib64" "$cuda/lib64" "$cuda/lib" "$cuda"/targets/*/lib; do
  # The development link, else a versioned library alone (as some packages ship it).
  for lib in "$d"/libcupti.so "$d"/libcupti.so.[0-9]*; do
    if [[ -e $lib ]]; then libdir=$(realpath "$d") cupti_lib=${lib##*/}; break 2; fi
  done
done
if [[ -z $include || -z $libdir ]]; then
  echo "== no CUPTI (cupti.h, libcupti.so) in the toolkit at $cuda: no CUPTI meter" >&2
  exit 0
fi
rpath=$libdir:/usr/local/cuda/extras/CUPTI/lib64:/usr/local/cuda/lib64:/usr/local/cuda/targets/$(uname -m)-linux/lib
# cupti.h includes cuda.h: the toolkit's own include directory too.
if "$cxx" -std=c++17 -O2 -Wall -shared -fPIC -fvisibility=hidden -o "$out/libfracgpu_cupti_meter.so" \
  "$here/cupti_meter.cpp" -I"$include" -I"$cuda/include" -L"$libdir" "-l:$cupti_lib" -lpthread "-Wl,-rpath,$rpath"; then
  echo "== built $out/libfracgpu_cupti_meter.so (CUPTI from $libdir)" >&2
else
  rm -f "$out/libfracgpu_cupti_meter.so"
  echo "== compiling the CUPTI meter failed: no CUPTI meter" >&2
fi
