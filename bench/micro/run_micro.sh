#!/usr/bin/env bash
# Driver-call microbenchmarks: the ns libfracgpu.so adds per call, on the
# simulated driver (docs/performance.md, "Driver calls").
#
#   bench/micro/run_micro.sh BUILD_DIR OUT_DIR [--smoke] [--pairs=N] [--callgrind[=N]]
#
# Starts fracgpud on a private run directory with two simulated GPUs: tenant
# "solo" alone on GPU 0 (its launches are not metered: gate word 0) and
# tenants "shared" and "other" at 0.5 each, limit 1.0, on GPU 1 (only
# "shared" runs, so it holds the GPU and its launches take the slow path
# about once per ms). Then, for each pair, runs micro_driver_calls natively,
# as "solo" and as "shared" (launches only) under LD_PRELOAD, and
# summarize.py subtracts. Writes OUT_DIR/micro.csv and prints a table.
#
# Figures are the calling thread's CPU time per call (see summarize.py);
# wall-clock figures follow, and go to OUT_DIR/micro-real.csv.
#
#   --smoke        one iteration of each benchmark, one pair: checks that it
#                  all runs (CI), the timings mean nothing
#   --pairs=N      native/interposed pairs (default 5)
#   --callgrind=N  also count instructions per call under callgrind, N calls
#                  each (default 20000); OUT_DIR/callgrind.csv
set -euo pipefail

usage() { echo "usage: $0 BUILD_DIR OUT_DIR [--smoke] [--pairs=N] [--callgrind[=N]]" >&2; exit 2; }
[ $# -ge 2 ] || usage
build=$(realpath "$1")
out=$2
shift 2
smoke=0 pairs=5 callgrind=0
for arg in "$@"; do
  case $arg in
    --smoke) smoke=1 pairs=1 ;;
    --pairs=*) pairs=${arg#--pairs=} ;;
    --callgrind) callgrind=20000 ;;
    --callgrind=*) callgrind=${arg#--callgrind=} ;;
    *) usage ;;
  esac
done

here=$(cd "$(dirname "$0")" && pwd)
bin=$build/bench/micro/micro_driver_calls
lib=$build/interpose/libfracgpu.so
for f in "$bin" "$lib" "$build/controller/fracgpud" "$build/controller/fracgpu" "$build/simcuda/libcuda.so.1"; do
  [ -e "$f" ] || { echo "$0: $f not found: build the micro_driver_calls target first" >&2; exit 1; }
done
if [ "$callgrind" != 0 ] && ! command -v valgrind >/dev/null; then
  echo "$0: --callgrind needs valgrind (apt-get install valgrind)" >&2
  exit 1
fi

mkdir -p "$out"
rm -rf "$out/json" "$out/callgrind" "$out/micro.csv" "$out/callgrind.csv" "$out/status.json"
mkdir -p "$out/json"
run=$(mktemp -d /tmp/fracgpu-micro-XXXXXX)
daemon=
cleanup() {
  if [ -n "$daemon" ]; then
    kill -TERM "$daemon" 2>/dev/null || true
    wait "$daemon" 2>/dev/null || true
  fi
  rm -rf "$run"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

uuid0=GPU-00000000-0000-4000-8000-00000000c0de
uuid1=GPU-00000000-0000-4000-8000-00000001c0de
export LD_LIBRARY_PATH="$build/simcuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# No SIMCUDA_STATE: each process gets a private simulated driver with these
# same GPUs (same UUIDs, so the ledger entries match). A shared state would
# add the sim's own cross-process locking (fcntl system calls on every
# allocation) to both sides of each difference: noise, not interposer cost.
unset SIMCUDA_STATE
export SIMCUDA_DEVICES="uuid=$uuid0,mem=16GiB,ctx=64MiB;uuid=$uuid1,mem=16GiB,ctx=64MiB"
cat >"$run/fracgpud.toml" <<EOF
[daemon]
run_dir = "$run"
reap_interval_ms = 200

[[gpu]]
uuid = "$uuid0"
context_memory = "64MiB"

[[gpu]]
uuid = "$uuid1"
context_memory = "64MiB"

[[tenant]]
name = "solo"
gpus = 1
devices = [0]

[[tenant]]
name = "shared"
gpus = 0.5
limit = 1.0
devices = [1]

[[tenant]]
name = "other"
gpus = 0.5
limit = 1.0
devices = [1]
EOF

"$build/controller/fracgpud" --config "$run/fracgpud.toml" 2>"$out/fracgpud.log" &
daemon=$!
for _ in $(seq 300); do  # up to 30 s: CI machines can be slow to start it
  [ -f "$run/tenants/solo/usage" ] && [ -e "$run/tenants/shared/gputime-0" ] && break
  kill -0 "$daemon" 2>/dev/null || { echo "$0: fracgpud exited:" >&2; cat "$out/fracgpud.log" >&2; exit 1; }
  sleep 0.1
done
[ -e "$run/tenants/shared/gputime-0" ] || { echo "$0: fracgpud did not set up the tenants" >&2; exit 1; }

if [ "$smoke" = 1 ]; then
  # 0 s minimum: Google Benchmark 1.7 then stops after its first iteration.
  timing=(--benchmark_min_time=0 --benchmark_repetitions=1)
else
  timing=(--benchmark_min_time=0.2 --benchmark_repetitions=5)
fi

# run MODE PAIR: one run of the binary, its JSON in $out/json.
bench() {
  local mode=$1 pair=$2 args=()
  local json=$out/json/pair$pair-$mode.json
  case $mode in
    native) args=(env -u LD_PRELOAD -u FRACGPU_TENANT "$bin" --micro_device=0) ;;
    solo) args=(env LD_PRELOAD="$lib" FRACGPU_TENANT=solo FRACGPU_RUN_DIR="$run" "$bin" --micro_device=0) ;;
    # The shared tenant's one GPU is the node's GPU 1, its process's device 0
    # (a tenant's process sees only its GPUs, numbered from 0).
    shared) args=(env LD_PRELOAD="$lib" FRACGPU_TENANT=shared FRACGPU_RUN_DIR="$run" "$bin" --micro_device=0
                  --benchmark_filter='^cuLaunchKernel$') ;;
  esac
  if ! "${args[@]}" "${timing[@]}" --benchmark_out="$json" --benchmark_out_format=json \
       >"$out/json/pair$pair-$mode.log" 2>&1; then
    echo "$0: the $mode run failed:" >&2
    cat "$out/json/pair$pair-$mode.log" >&2
    exit 1
  fi
}

# Alternate, so that a change in the machine's load between runs lands on
# both sides of a pair's difference rather than on one.
for pair in $(seq "$pairs"); do
  for mode in native solo shared; do bench "$mode" "$pair"; done
done
"$build/controller/fracgpu" status --json --run-dir "$run" >"$out/status.json"

if [ "$callgrind" != 0 ]; then
  mkdir -p "$out/callgrind"
  echo "$callgrind" >"$out/callgrind/iterations"
  for mode in native solo shared; do
    case $mode in
      native) env=(env -u LD_PRELOAD -u FRACGPU_TENANT) device=0 only=() ;;
      solo) env=(env LD_PRELOAD="$lib" FRACGPU_TENANT=solo FRACGPU_RUN_DIR="$run") device=0 only=() ;;
      shared) env=(env LD_PRELOAD="$lib" FRACGPU_TENANT=shared FRACGPU_RUN_DIR="$run") device=0
              only=(--micro_only=cuLaunchKernel) ;;
    esac
    # One dump per benchmark and thread (the client requests in the binary
    # name them); summarize.py reads the main thread's.
    "${env[@]}" valgrind --tool=callgrind --separate-threads=yes \
      --callgrind-out-file="$out/callgrind/$mode.%p" "$bin" --micro_device="$device" \
      --micro_callgrind="$callgrind" "${only[@]}" >"$out/callgrind/$mode.log" 2>&1 ||
      { echo "$0: callgrind $mode run failed:" >&2; cat "$out/callgrind/$mode.log" >&2; exit 1; }
  done
fi

smoke_flag=()
[ "$smoke" = 1 ] && smoke_flag=(--smoke)
echo "Driver calls, simulated driver: $(date -u '+%Y-%m-%d %H:%M UTC'), $(lscpu | sed -n 's/^Model name: *//p' | head -n 1), $(nproc) CPUs"
python3 "$here/summarize.py" "$out" "${smoke_flag[@]}"
if [ "$smoke" = 0 ]; then
  echo
  echo "The same runs in wall-clock time (includes time the thread was preempted):"
  python3 "$here/summarize.py" "$out" --clock=real
fi
