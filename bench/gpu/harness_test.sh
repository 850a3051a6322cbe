#!/usr/bin/env bash
# CI check of bench/gpu/run_gpu.sh without a GPU (CTest bench_gpu_harness):
# the whole script runs with stand-ins for nvidia-smi, nvcc (which "builds" a
# stand-in workload that sleeps and prints a result line), and
# nvidia-cuda-mps-control, and with fracgpud on the simulated driver. Checks
# the run order, that every compute process got the calibrated kernel, that
# throughput runs had CUPTI off and GPU-time runs on, that fracgpu runs were
# preloaded, that a failed MPS probe skips MPS without failing the run, and
# the table and exit status 0. It checks no figure of a real GPU.
#
#   bash bench/gpu/harness_test.sh BUILD_DIR SIMCUDA_LIB_DIR WORK_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$1 simdir=$2 work=$3
fail() { echo "bench_gpu_harness: $*" >&2; exit 1; }
rm -rf "$work"
mkdir -p "$work/bin" "$work/cuda/bin" "$work/cuda/include" "$work/cuda/lib64"
work=$(realpath "$work")
uuid=GPU-be0c0000-0000-4000-8000-000000000000
: >"$work/cuda/include/cupti.h"
: >"$work/cuda/lib64/libcupti.so"

cat >"$work/bin/nvidia-smi" <<EOF
#!/usr/bin/env bash
case "\$*" in
  -L) echo "GPU 0: Stand-in (UUID: $uuid)" ;;
  *uuid*) echo "$uuid" ;;
  *compute_mode*) echo Default ;;
  *name,driver_version*) echo "Stand-in GPU, 0.0" ;;
  *) exit 1 ;;
esac
EOF
# The MPS control daemon "starts"; its clients fail (see the workload).
printf '#!/usr/bin/env bash\nexit 0\n' >"$work/bin/nvidia-cuda-mps-control"
cat >"$work/cuda/bin/nvcc" <<EOF
#!/usr/bin/env bash
while ((\$#)); do if [[ \$1 == -o ]]; then out=\$2; fi; shift; done
cp "$work/workload.py" "\$out"
EOF
cat >"$work/workload.py" <<'EOF'
#!/usr/bin/env python3
import json, os, sys, time
args, opt, flags = sys.argv[1:], {}, set()
while args:
    if args[0] in ("--no-cupti", "--calibrate"):
        flags.add(args.pop(0))
    else:
        opt[args[0]] = args[1]
        del args[:2]
if os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
    sys.exit("stand-in: no MPS server")
if "--calibrate" in flags:
    print(json.dumps({"iterations": 4321, "blocks": 99, "kernel_ms": 5.0, "sms": 12}))
    sys.exit(0)
open(opt["--ready-file"], "w").write("ready\n")
start = 0
while not start:
    try:
        start = int(open(opt["--start-file"]).read().strip() or 0)
    except (FileNotFoundError, ValueError):
        time.sleep(0.01)
while time.clock_gettime_ns(time.CLOCK_MONOTONIC) < start:
    time.sleep(0.001)
seconds = float(opt["--seconds"])
time.sleep(seconds)
cupti = "--no-cupti" not in flags
print(json.dumps({"mode": opt["--mode"], "kernels": 100, "seconds": seconds, "rate": 100.0 / seconds,
                  "iterations": int(opt.get("--iterations", 0)), "blocks": int(opt.get("--blocks", 0)),
                  "cupti": int(cupti), "gpu_time_s": 0.4 * seconds if cupti else None,
                  "gpu_fraction": 0.4 if cupti else None, "cupti_dropped": 0,
                  "preloaded": "libfracgpu" in os.environ.get("LD_PRELOAD", "")}))
EOF
chmod +x "$work/bin/"* "$work/cuda/bin/nvcc" "$work/workload.py"

rc=0
PATH=$work/bin:$PATH CUDA_HOME=$work/cuda LD_LIBRARY_PATH=$simdir SIMCUDA_STATE=$work/simulated-gpu \
  SIMCUDA_DEVICES="uuid=$uuid,name=Stand-in,mem=16GiB,ctx=64MiB" \
  bash "$here/run_gpu.sh" "$build" "$work/out" --seconds 1 --repeats 2 --workloads compute >"$work/log" 2>&1 || rc=$?
((rc == 0)) || { cat "$work/log" >&2; fail "run_gpu.sh exited $rc"; }
runs=$(cd "$work/out/runs" && echo *)
expected="01-compute-native 02-compute-fracgpu-1 03-compute-native 04-compute-fracgpu-1 05-compute-timeslice-2 \
06-compute-fracgpu-0.5-0.5 07-compute-fracgpu-0.25-0.75 08-compute-fracgpu-0.1-0.9 \
09-compute-fracgpu-0.5-0.5-gputime 10-compute-fracgpu-0.25-0.75-gputime 11-compute-fracgpu-0.1-0.9-gputime"
[[ $runs == "$expected" ]] || fail "runs: $runs; expected: $expected"
python3 - "$work/out/runs" <<'EOF' || fail "a process ran with the wrong options (above)"
import json, sys
from pathlib import Path
bad = 0
for d in sorted(Path(sys.argv[1]).iterdir()):
    for f in d.glob("[ab].json"):  # not status.json
        r = json.loads(f.read_text().splitlines()[-1])
        want = {"iterations": 4321, "blocks": 99, "cupti": int(d.name.endswith("-gputime")),
                "preloaded": "fracgpu" in d.name}
        got = {k: r[k] for k in want}
        if got != want:
            print(f"{d.name}/{f.name}: {got}, expected {want}", file=sys.stderr)
            bad = 1
sys.exit(bad)
EOF
grep -q '^MPS comparison: skipped: a first client failed under MPS (stand-in: no MPS server' "$work/out/gpu_table.md" ||
  fail "gpu_table.md does not say why MPS was skipped"
grep -q '^| compute | fracgpu-1 | 2/2 | 100.0 kernels/s | 1.0000 | 1.0000..1.0000 | >= 0.995 |' "$work/out/gpu_table.md" ||
  fail "gpu_table.md has no fracgpu-1 row of two runs"
grep -q '^all targets met, no run failed' "$work/out/gpu_table.md" || fail "gpu_table.md has no verdict"
echo "bench_gpu_harness: ok"
