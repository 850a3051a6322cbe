#!/usr/bin/env bash
# Builds what the real-GPU checks need (tests/gpu/, bench/gpu/) into one
# self-contained build directory that can be copied to a GPU machine that has
# no package manager or network: the daemon, the CLI and libfracgpu.so, with
# the shared libraries the daemon and CLI need (fmt, spdlog, toml++, the C++
# runtime) beside them in DIR/lib, found through RUNPATH=$ORIGIN/../lib. The
# layout is a build directory's (DIR/controller/fracgpud, DIR/interpose/
# libfracgpu.so), so every GPU script takes DIR as its build directory.
# libfracgpu.so itself needs nothing but glibc (checked by the test suite).
#
#   bash scripts/gpu_bundle.sh [--with-instruments] [--arch ARCH] [DIR]   # default: build-gpu
#
# --with-instruments also builds, into DIR/bench/gpu/ (where the GPU scripts
# look first), what they would otherwise compile on the GPU machine, each
# time, in its time: ~5 s per run of tests/gpu/run_sm_share.sh and of
# bench/gpu/run_gpu.sh's NVML pass, ~10-20 s of nvcc per bench/gpu/run_gpu.sh:
#   nvml_sampler, libfracgpu_cupti_meter.so  bench/gpu/build_tools.sh (a C++
#                     compiler; CUPTI from the CUDA toolkit, e.g. /usr/local/cuda)
#   gpu_workload      bench/gpu/build_workload.sh --arch ARCH (default sm_90:
#                     H100 and H200; its PTX also runs on newer GPUs);
#                     tests/gpu/run_all.sh hands it to run_gpu.sh
#                     ($FRACGPU_GPU_WORKLOAD).
#   timeslice_probe   bench/gpu/timeslice_probe.cu, nvcc --arch ARCH
#                     (tests/gpu/run_timeslice.sh).
#   cupti/libcupti.so.13  CUPTI 13.1 from PyPI's nvidia-cuda-cupti (pip
#                     download, ~7 MB): the context-switch records
#                     run_timeslice.sh asks for came with CUPTI 13.1, newer
#                     than this project's toolkit (the oldest that has them,
#                     for the widest range of drivers). Left out, with a
#                     message, where PyPI cannot be reached.
# and into DIR/tests/, from a second build with the tests (DIR-probes/, only
# these two targets), the loads of tests/gpu/run_hostile.sh, which cannot be
# built on the GPU machine without the build's packages:
#   gputime_load, usage_attacker
# The CUPTI meter and gpu_workload find libcupti through a RUNPATH that names
# this machine's toolkit directory (printed at the end; the meter's also
# /usr/local/cuda's usual ones). Where the GPU machine has it elsewhere, or
# its GPU cannot run gpu_workload, the scripts see it (ldd; a 0.2 s run) and
# compile their own there, as without the option.
#
# Prints DIR's size and the paths the GPU checks read from it, with their
# size: DIR also holds the build's object files, so where what can be taken
# to the GPU machine is limited, take only those paths.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="" instruments=0 arch=sm_90
while (($#)); do
  case $1 in
    --with-instruments) instruments=1; shift ;;
    --arch) arch=${2:?--arch needs a value (e.g. sm_90)}; shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu_bundle: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) [[ -z $dir ]] || { echo "gpu_bundle: unexpected argument $1" >&2; exit 2; }; dir=$1; shift ;;
  esac
done
dir=${dir:-build-gpu}
bash scripts/install-deps.sh
# The rpath reaches the linker verbatim: $ORIGIN is the directory of the binary.
FRACGPU_BUILD_DIR=$dir bash scripts/build.sh -DCMAKE_BUILD_TYPE=Release -DFRACGPU_BUILD_TESTS=OFF \
  -DFRACGPU_BUILD_BENCH=OFF "-DCMAKE_BUILD_RPATH=\$ORIGIN/../lib"
mkdir -p "$dir/lib"
binaries=("$dir/controller/fracgpud" "$dir/controller/fracgpu")
# Everything they load but glibc's own libraries and the dynamic loader.
ldd "${binaries[@]}" | awk '/=> \// {print $3}' | sort -u |
  grep -Ev '/(libc|libm|libdl|librt|libpthread|ld-linux[^/]*)\.so' |
  while read -r so; do cp -L "$so" "$dir/lib/"; done
for b in "${binaries[@]}" "$dir/interpose/libfracgpu.so"; do
  runpath=$(readelf -d "$b" | awk '/RUNPATH|RPATH/ {print $NF}')
  case $b in
    *libfracgpu.so) ;;
    *) [[ $runpath == *'$ORIGIN/../lib'* ]] || { echo "gpu_bundle: $b has no \$ORIGIN/../lib runpath ($runpath)" >&2; exit 1; } ;;
  esac
done
# CUPTI 13.1's library from PyPI into DIR (nothing but a message where it
# cannot be had).
fetch_cupti_13_1() {
  local into=$1 tmp whl
  tmp=$(mktemp -d)
  if timeout 120 python3 -m pip download --quiet --no-deps --dest "$tmp" "nvidia-cuda-cupti>=13.1,<13.2" >/dev/null 2>&1 &&
    whl=$(ls "$tmp"/nvidia_cuda_cupti-*.whl 2>/dev/null | head -n 1) && [[ -n $whl ]] &&
    python3 -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
name = next(n for n in z.namelist() if n.endswith("/libcupti.so.13"))
open(sys.argv[2], "wb").write(z.read(name))' "$whl" "$tmp/libcupti.so.13"; then
    mkdir -p "$into"
    mv "$tmp/libcupti.so.13" "$into/"
    echo "gpu bundle: CUPTI $(basename "$whl" | cut -d- -f2) from PyPI in $into"
  else
    echo "gpu bundle: PyPI's nvidia-cuda-cupti could not be had: run_timeslice.sh will use the GPU machine's CUPTI"
  fi
  rm -rf "$tmp"
}
instrument_files=()
if ((instruments)); then
  mkdir -p "$dir/bench/gpu"
  # nvml_sampler or nothing (exit 2); the meter only where CUPTI is found.
  bash bench/gpu/build_tools.sh "$dir/bench/gpu"
  bash bench/gpu/build_workload.sh "$dir/bench/gpu/gpu_workload" --arch "$arch"
  nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  "$nvcc" -O2 -arch="$arch" -o "$dir/bench/gpu/timeslice_probe" bench/gpu/timeslice_probe.cu
  for f in nvml_sampler libfracgpu_cupti_meter.so gpu_workload timeslice_probe; do
    [[ ! -e $dir/bench/gpu/$f ]] || instrument_files+=("$dir/bench/gpu/$f")
  done
  fetch_cupti_13_1 "$dir/bench/gpu/cupti"
  probes=${dir%/}-probes
  cmake -S . -B "$probes" -DCMAKE_BUILD_TYPE=Release -DCUDAToolkit_ROOT=/usr/local/cuda \
    "-DCMAKE_BUILD_RPATH=\$ORIGIN/../lib" >/dev/null
  cmake --build "$probes" -j "$(nproc)" --target gputime_load usage_attacker
  mkdir -p "$dir/tests"
  cp "$probes/tests/gputime_load" "$probes/tests/usage_attacker" "$dir/tests/"
  instrument_files+=("$dir/tests/gputime_load" "$dir/tests/usage_attacker")
fi
# The newest glibc symbol version each needs: the GPU machine's glibc must be
# at least that.
newest_glibc=$(objdump -T "${binaries[@]}" "$dir/interpose/libfracgpu.so" "$dir"/lib/*.so* \
  ${instrument_files[@]+"${instrument_files[@]}"} 2>/dev/null |
  grep -o 'GLIBC_[0-9.]*' | sort -t. -k2,2n -k3,3n | tail -n 1)
echo "gpu bundle: $dir ($(du -sh "$dir" | cut -f1)), libraries: $(ls "$dir/lib" | tr '\n' ' ')"
echo "needs glibc >= ${newest_glibc#GLIBC_} on the GPU machine"
needed=("${binaries[@]}" "$dir/interpose/libfracgpu.so" "$dir/lib")
[[ ! -d $dir/bench/gpu ]] || needed+=("$dir/bench/gpu")
[[ ! -d $dir/tests ]] || needed+=("$dir/tests")
echo "what the GPU checks read from it ($(du -shc "${needed[@]}" | tail -n 1 | cut -f1)): ${needed[*]}"
for f in ${instrument_files[@]+"${instrument_files[@]}"}; do
  echo "  $f$(readelf -d "$f" 2>/dev/null | awk '/RUNPATH|RPATH/ {printf ", runpath %s", $NF}')"
done
if ((instruments)) && [[ ! -e $dir/bench/gpu/libfracgpu_cupti_meter.so ]]; then
  echo "no CUPTI meter (no CUPTI in the toolkit here): the GPU scripts will try to build one there"
fi
