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
#   bash scripts/gpu_bundle.sh [DIR]      # default: build-gpu
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-gpu}
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
# The newest glibc symbol version each needs: the GPU machine's glibc must be
# at least that.
newest_glibc=$(objdump -T "${binaries[@]}" "$dir/interpose/libfracgpu.so" "$dir"/lib/*.so* 2>/dev/null |
  grep -o 'GLIBC_[0-9.]*' | sort -t. -k2,2n -k3,3n | tail -n 1)
echo "gpu bundle: $dir ($(du -sh "$dir" | cut -f1)), libraries: $(ls "$dir/lib" | tr '\n' ' ')"
echo "needs glibc >= ${newest_glibc#GLIBC_} on the GPU machine"
