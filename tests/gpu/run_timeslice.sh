#!/usr/bin/env bash
# The real GPU's own time-slicing, measured: how long a context keeps the GPU
# while another has work (the slice), and what a switch between contexts
# costs (the gap). The simulated driver's time-slice model takes both as
# settings (SIMCUDA_TIMESLICE_US, SIMCUDA_SWITCH_US; defaults 1024 and 40 from
# public figures): this check puts a card's figures in their place.
#
#   bash tests/gpu/run_timeslice.sh BUILD_DIR [--out DIR] [--seconds S]
#
# Runs bench/gpu/timeslice_probe (BUILD_DIR/bench/gpu/timeslice_probe where
# scripts/gpu_bundle.sh --with-instruments built it and it runs here, else
# compiled now with nvcc, ~5 s) two at once, then three at once, each spinning
# S seconds (default 2) on GPU 0 reading the GPU's global timer, and lines
# their gaps up with bench/gpu/timeslice_report.py. Writes DIR (default
# ./timeslice-results): probe-<n>-<i>.json (each probe's log),
# timeslice-<n>.json (the figures) and prints, per run, the slice and switch
# gap (p10/p50/p90) and the matching SIMCUDA_* settings. No fracgpu in it:
# the driver alone.
# Then, where the CUPTI meter is at hand (BUILD_DIR/bench/gpu, else
# $FRACGPU_CUPTI_METER, else built by bench/gpu/build_tools.sh), a third run:
# two spinning probes and one that runs nothing (--idle), each with the
# meter asking for CUPTI 13.1's context-switch records
# (FRACGPU_CUPTI_CTX_SWITCH=1); bench/gpu/ctxswitch_report.py says whether
# they come on this driver and whether a process receives other processes'
# switches (ctxswitch.json, meter-*.json). CUPTI is the one the meter finds
# (its RUNPATH: the toolkit's), unless a directory with a newer
# libcupti.so.13 is named by $FRACGPU_CUPTI_LIB_DIR or is BUILD_DIR/bench/gpu/
# cupti (scripts/gpu_bundle.sh --with-instruments puts PyPI's 13.1 there).
# Without a meter, or with a CUPTI older than 13.1, that run says so and
# does not fail. Exit 0 when the two timing runs gave figures; 1 otherwise;
# 2 without a GPU or a way to build the probe.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
die() { echo "run_timeslice.sh: $*" >&2; exit 2; }
build="" out=timeslice-results seconds=2
while (($#)); do
  case $1 in
    --out) out=${2:?--out needs a value}; shift 2 ;;
    --seconds) seconds=${2:?--seconds needs a value}; shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option $1" ;;
    *) [[ -z $build ]] || die "unexpected argument $1"; build=$1; shift ;;
  esac
done
[[ -n $build ]] || die "usage: run_timeslice.sh BUILD_DIR [--out DIR] [--seconds S]"
[[ $seconds =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "--seconds takes a number of seconds, not $seconds"
command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 || die "no NVIDIA GPU here (nvidia-smi -L)"
mkdir -p "$out"

probe=$build/bench/gpu/timeslice_probe
if ! [[ -x $probe ]] || ! "$probe" --seconds 0.01 >/dev/null 2>&1; then
  probe=$out/timeslice_probe
  nvcc=""
  for c in "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" "$(command -v nvcc || true)" /usr/local/cuda/bin/nvcc; do
    if [[ -n $c && -x $c ]]; then nvcc=$c; break; fi
  done
  [[ -n $nvcc ]] || die "no usable timeslice_probe in $build/bench/gpu and no nvcc to build one"
  "$nvcc" -O2 -arch=native -o "$probe" "$root/bench/gpu/timeslice_probe.cu" 2>/dev/null ||
    "$nvcc" -O2 -arch=sm_90 -o "$probe" "$root/bench/gpu/timeslice_probe.cu" || die "nvcc failed"
fi

rc=0
for n in 2 3; do
  pids=()
  for ((i = 0; i < n; i++)); do
    "$probe" --seconds "$seconds" >"$out/probe-$n-$i.json" 2>"$out/probe-$n-$i.err" &
    pids+=($!)
  done
  ok=1
  for p in "${pids[@]}"; do wait "$p" || ok=0; done
  if ((!ok)); then
    echo "run_timeslice.sh: a probe of the $n-probe run failed:" >&2
    cat "$out"/probe-"$n"-*.err >&2
    rc=1
    continue
  fi
  echo "== $n probes at once"
  python3 "$root/bench/gpu/timeslice_report.py" --json "$out/timeslice-$n.json" "$out"/probe-"$n"-*.json || rc=1
done

# CUPTI's context-switch records (see the top). The bundle's CUPTI first:
# whether the meter links is judged with it on the path.
cupti_dir=${FRACGPU_CUPTI_LIB_DIR:-$build/bench/gpu/cupti}
libpath=${LD_LIBRARY_PATH:-}
[[ ! -e $cupti_dir/libcupti.so.13 ]] || libpath=$cupti_dir${libpath:+:$libpath}
links() { ! LD_LIBRARY_PATH=$libpath ldd "$1" 2>/dev/null | grep -q 'not found'; }
meter=${FRACGPU_CUPTI_METER:-$build/bench/gpu/libfracgpu_cupti_meter.so}
if [[ ! -e $meter ]] || ! links "$meter"; then
  bash "$root/bench/gpu/build_tools.sh" "$out/bin" 2>"$out/build_tools.log" || true
  meter=$out/bin/libfracgpu_cupti_meter.so
fi
echo "== CUPTI's context-switch records: two probes spinning, one idle"
if [[ ! -e $meter ]] || ! links "$meter"; then
  echo "no CUPTI meter here (build dir, \$FRACGPU_CUPTI_METER, build_tools.sh): not measured"
  exit "$rc"
fi
[[ ! -e $cupti_dir/libcupti.so.13 ]] || echo "CUPTI from $cupti_dir"
rm -f "$out"/ctx-*.json "$out"/meter-*.json
pids=()
for role in spin-0 spin-1 idle; do
  args=(--seconds "$seconds")
  [[ $role != idle ]] || args+=(--idle)
  env LD_LIBRARY_PATH="$libpath" CUDA_INJECTION64_PATH="$meter" FRACGPU_CUPTI_CTX_SWITCH=1 \
    FRACGPU_CUPTI_OUT="$out/meter-$role" "$probe" "${args[@]}" >"$out/ctx-$role.json" 2>"$out/ctx-$role.err" &
  pids+=($!)
done
ok=1
for p in "${pids[@]}"; do wait "$p" || ok=0; done
# The meter writes FRACGPU_CUPTI_OUT.<pid>.json (through a .json.tmp).
meter_of() { ls "$out"/meter-"$1".*.json 2>/dev/null | head -n 1; }
if ((!ok)) || [[ -z $(meter_of spin-0) || -z $(meter_of spin-1) || -z $(meter_of idle) ]]; then
  echo "a process of the CUPTI run failed, or a meter wrote nothing:"
  cat "$out"/ctx-*.err
  exit "$rc"
fi
python3 "$root/bench/gpu/ctxswitch_report.py" --json "$out/ctxswitch.json" \
  --spinner "$out/ctx-spin-0.json" "$(meter_of spin-0)" --spinner "$out/ctx-spin-1.json" "$(meter_of spin-1)" \
  --idle "$(meter_of idle)" || true
exit "$rc"
