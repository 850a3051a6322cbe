#!/usr/bin/env bash
# CI check of bench/gpu/run_gpu.sh without a GPU (CTest bench_gpu_harness):
# the whole script runs with stand-ins for nvidia-smi, nvcc (which "builds" a
# stand-in workload that sleeps and prints a result line), the CUPTI meter
# (the stand-in workload writes the meter's file when it is injected) and
# nvidia-cuda-mps-control, with fracgpud on the simulated driver and the real
# nvml_sampler on the stand-in NVML. Checks the run order, that every compute
# process got the calibrated kernel, that throughput runs had CUPTI off,
# GPU-time runs on and -nvml runs the meter injected instead, that fracgpu
# runs were preloaded, that the -nvml runs have a sampler log with a summary,
# that a failed MPS probe skips MPS without failing the run, and the tables
# and exit status 0. It checks no figure of a real GPU.
#
#   bash bench/gpu/harness_test.sh BUILD_DIR SIMCUDA_LIB_DIR WORK_DIR SIMNVML_LIB_DIR NVML_SAMPLER
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$1 simdir=$2 work=$3 simnvml=$4 real_sampler=$5
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
injected = os.environ.get("CUDA_INJECTION64_PATH", "")
if injected and os.environ.get("FRACGPU_CUPTI_OUT"):
    # What the CUPTI meter would write: busy 40% of every 100 ms bin of the window.
    first = start // 100_000_000
    bins = int(seconds * 10) + 1
    meter = {"tool": "stand-in", "pid": os.getpid(), "final": True, "kernels": 10, "dropped": 0,
             "gpu_time_ns": int(0.4 * seconds * 1e9), "bin_ns": 100_000_000, "first_bin": first,
             "busy_ns": [40_000_000] * bins}
    open(f"{os.environ['FRACGPU_CUPTI_OUT']}.{os.getpid()}.json", "w").write(json.dumps(meter) + "\n")
print(json.dumps({"mode": opt["--mode"], "kernels": 100, "seconds": seconds, "rate": 100.0 / seconds,
                  "iterations": int(opt.get("--iterations", 0)), "blocks": int(opt.get("--blocks", 0)),
                  "cupti": int(cupti), "gpu_time_s": 0.4 * seconds if cupti else None,
                  "gpu_fraction": 0.4 if cupti else None, "cupti_dropped": 0,
                  "preloaded": "libfracgpu" in os.environ.get("LD_PRELOAD", ""),
                  "injected": injected}))
EOF
# nvml_sampler on the stand-in NVML (fracgpud itself runs without NVML, as before).
cat >"$work/sampler" <<EOF
#!/usr/bin/env bash
LD_LIBRARY_PATH=$simnvml:$simdir exec "$real_sampler" "\$@"
EOF
: >"$work/fake-cupti-meter.so"
chmod +x "$work/bin/"* "$work/cuda/bin/nvcc" "$work/workload.py" "$work/sampler"

rc=0
PATH=$work/bin:$PATH CUDA_HOME=$work/cuda LD_LIBRARY_PATH=$simdir SIMCUDA_STATE=$work/simulated-gpu \
  FRACGPU_NVML_SAMPLER=$work/sampler FRACGPU_CUPTI_METER=$work/fake-cupti-meter.so \
  SIMCUDA_DEVICES="uuid=$uuid,name=Stand-in,mem=16GiB,ctx=64MiB" \
  bash "$here/run_gpu.sh" "$build" "$work/out" --seconds 1 --repeats 2 --workloads compute >"$work/log" 2>&1 || rc=$?
((rc == 0)) || { cat "$work/log" >&2; fail "run_gpu.sh exited $rc"; }
runs=$(cd "$work/out/runs" && echo *)
expected="01-compute-native 02-compute-fracgpu-1 03-compute-native 04-compute-fracgpu-1 05-compute-timeslice-2 \
06-compute-fracgpu-0.5-0.5 07-compute-fracgpu-0.25-0.75 08-compute-fracgpu-0.1-0.9 \
09-compute-fracgpu-0.5-0.5-gputime 10-compute-fracgpu-0.25-0.75-gputime 11-compute-fracgpu-0.1-0.9-gputime \
12-compute-fracgpu-0.5-0.5-nvml 13-compute-fracgpu-0.25-0.75-nvml 14-compute-fracgpu-0.1-0.9-nvml"
[[ $runs == "$expected" ]] || fail "runs: $runs; expected: $expected"
python3 - "$work/out/runs" "$work/fake-cupti-meter.so" <<'EOF' || fail "a process ran with the wrong options (above)"
import json, sys
from pathlib import Path
bad = 0
for d in sorted(Path(sys.argv[1]).iterdir()):
    nvml = d.name.endswith("-nvml")
    for f in d.glob("[ab].json"):  # not status.json
        r = json.loads(f.read_text().splitlines()[-1])
        want = {"iterations": 4321, "blocks": 99, "cupti": int(d.name.endswith("-gputime")),
                "preloaded": "fracgpu" in d.name, "injected": sys.argv[2] if nvml else ""}
        got = {k: r[k] for k in want}
        if got != want:
            print(f"{d.name}/{f.name}: {got}, expected {want}", file=sys.stderr)
            bad = 1
    # The sampler ran beside the -nvml runs only, and finished (its summary).
    log = d / "nvml-sampler.jsonl"
    if nvml != log.exists():
        print(f"{d.name}: nvml-sampler.jsonl {'missing' if nvml else 'there'}", file=sys.stderr)
        bad = 1
    elif nvml:
        rows = [json.loads(line) for line in log.read_text().splitlines()]
        s = rows[-1].get("summary", {})
        if "header" not in rows[0] or s.get("polls", 0) < 10 or "pu" not in s.get("calls", {}):
            print(f"{d.name}: nvml-sampler.jsonl: no header, summary or polls: {rows[0]} ... {s}", file=sys.stderr)
            bad = 1
sys.exit(bad)
EOF
grep -q '^MPS comparison: skipped: a first client failed under MPS (stand-in: no MPS server' "$work/out/gpu_table.md" ||
  fail "gpu_table.md does not say why MPS was skipped"
grep -q '^| compute | fracgpu-1 | 2/2 | 100.0 kernels/s | 1.0000 | 1.0000..1.0000 | >= 0.995 |' "$work/out/gpu_table.md" ||
  fail "gpu_table.md has no fracgpu-1 row of two runs"
grep -q '^all targets met, no run failed' "$work/out/gpu_table.md" || fail "gpu_table.md has no verdict"
# The meter's 0.4 of the window per process, halves of the GPU time used; NVML
# saw no process (the stand-in workload is no sim process): n/a.
grep -q '^| compute fracgpu-0.25-0.75 | a (0.25) | n/a | 0.4[0-9]* | n/a | n/a | 0.500 | n/a | n/a |' \
  "$work/out/gpu_table.md" || fail "gpu_table.md has no NVML-against-CUPTI row for 0.25/0.75 a"
grep -q '^| compute fracgpu-0.1-0.9 | nvmlDeviceGetProcessUtilization | [0-9]* | 1.000 |' "$work/out/gpu_table.md" ||
  fail "gpu_table.md has no sampling row for 0.1/0.9"
echo "bench_gpu_harness: ok"
