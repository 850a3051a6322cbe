#!/usr/bin/env bash
# Builds bench/gpu/gpu_workload.cu (run_gpu.sh and the CTest bench_gpu_build
# call it).
#
#   bash bench/gpu/build_workload.sh OUTPUT [--arch ARCH]
#
# nvcc: $CUDA_HOME/bin/nvcc, else the one on PATH, else /usr/local/cuda/bin/nvcc.
# CUPTI's header and library are looked for in the toolkit nvcc belongs to
# (extras/CUPTI/ or the toolkit's own include/ and lib64/); the binary finds
# libcupti through its RUNPATH, so nothing else (PyTorch in particular) is
# given the toolkit's libraries through LD_LIBRARY_PATH. Without --arch it
# builds for the GPU of this machine (-arch=native) and, if that fails or nvcc
# finds no GPU (it then warns and uses its default arch), for sm_90 (H100; the
# embedded PTX also runs on newer GPUs).
# Exit 0: built; 2: no nvcc, no CUPTI or the compiler failed.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
die() { echo "build_workload.sh: $*" >&2; exit 2; }
output="" arch=""
while (($#)); do
  case $1 in
    --arch) arch=${2:?--arch needs a value}; shift 2 ;;
    -*) die "unknown option $1" ;;
    *) [[ -z $output ]] || die "unexpected argument $1"; output=$1; shift ;;
  esac
done
[[ -n $output ]] || die "usage: build_workload.sh OUTPUT [--arch ARCH]"

nvcc=""
for c in "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" "$(command -v nvcc || true)" /usr/local/cuda/bin/nvcc; do
  if [[ -n $c && -x $c ]]; then nvcc=$c; break; fi
done
[[ -n $nvcc ]] || die "no nvcc (looked at \$CUDA_HOME/bin, PATH, /usr/local/cuda/bin)"
cuda=$(dirname "$(dirname "$(realpath "$nvcc")")")
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
[[ -n $include && -n $libdir ]] || die "no CUPTI (cupti.h, libcupti.so) in the toolkit at $cuda"
# RUNPATH: this toolkit's CUPTI directory first, then where /usr/local/cuda
# keeps libcupti in the usual layouts (extras/CUPTI/lib64 up to CUDA 12,
# lib64, lib, targets/*/lib), as build_tools.sh gives the meter: one built
# on another machine (scripts/gpu_bundle.sh --with-instruments, whose toolkit
# may sit elsewhere) then still loads on the GPU machine, and run_gpu.sh need
# not spend 10-20 s of nvcc there. Directories that do not exist are skipped.
rpath=$libdir:/usr/local/cuda/extras/CUPTI/lib64:/usr/local/cuda/lib64:/usr/local/cuda/lib:/usr/local/cuda/targets/$(uname -m)-linux/lib

build() {  # build ARCH
  "$nvcc" -O2 -std=c++17 "-arch=$1" -o "$output" "$here/gpu_workload.cu" \
    -I"$include" -L"$libdir" "-l:$cupti_lib" -Xlinker "-rpath=$rpath"
}
mkdir -p "$(dirname "$output")"
if [[ -n $arch ]]; then
  echo "== building gpu_workload with $nvcc for $arch" >&2
  build "$arch" || die "nvcc failed"
elif build native 2>"$output.native.log" && ! grep -q 'Cannot find valid GPU' "$output.native.log"; then
  echo "== built gpu_workload with $nvcc for this machine's GPU (-arch=native)" >&2
else
  echo "== -arch=native did not find a GPU ($(tail -n 1 "$output.native.log")): building for sm_90" >&2
  build sm_90 || die "nvcc failed"
fi
rm -f "$output.native.log"
