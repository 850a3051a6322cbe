#!/usr/bin/env bash
# CI check of `tests/gpu/run_sm_share.sh calibrate` without a GPU (CTest
# bench_gpu_calibrate): the whole calibration runs on the simulated driver,
# with a stand-in for nvidia-smi, a stand-in for PyTorch whose matmul launches
# one 1 ms kernel on the simulated GPU (through ctypes, so fracgpu's
# interposer and fracgpud's NVML meter see it as a real workload) and which
# writes the CUPTI meter's file itself when the meter is injected (from its
# launch times: CUPTI needs a real driver), fracgpud on the stand-in NVML and
# the real nvml_sampler. Checks the exit status, the three phases' raw logs,
# the tables, the lines to paste and the suggested settings, and that NVML's
# shares (the stand-in measures them exactly unless SIMNVML_SAMPLE_MS is set)
# are close to the known ones. It checks no figure of a real GPU.
#
#   bash bench/gpu/calibrate_test.sh BUILD_DIR SIMCUDA_LIB_DIR SIMNVML_LIB_DIR WORK_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$(realpath "$1") simcuda=$(realpath "$2") simnvml=$(realpath "$3") work=$4
fail() { echo "bench_gpu_calibrate: $*" >&2; exit 1; }
rm -rf "$work"
mkdir -p "$work/bin" "$work/py/torch"
work=$(realpath "$work")
uuid=GPU-5a000000-0000-4000-8000-00000000ca1b

cat >"$work/bin/nvidia-smi" <<EOF
#!/usr/bin/env bash
case "\$*" in
  -L) echo "GPU 0: Stand-in (UUID: $uuid)" ;;
  *query-gpu=uuid*) echo "$uuid" ;;
  *compute_mode*) echo Default ;;
  *name,driver_version*) echo "Stand-in GPU, 0.0" ;;
  *query-compute-apps*) ;;
  *) exit 1 ;;
esac
EOF
chmod +x "$work/bin/nvidia-smi"
cat >"$work/py/torch/__init__.py" <<'EOF'
"""Stand-in for PyTorch on the simulated driver: matmul launches one 1 ms kernel."""
import atexit, ctypes, json, os, time

__version__ = "0.0-stand-in"
float16 = "float16"
version = type("version", (), {"cuda": "simulated"})
_cu = ctypes.CDLL("libcuda.so.1")
_st = {}


def _ok(r, what):
    if r != 0:
        raise RuntimeError(f"{what}: CUresult {r}")


def _init():
    if _st:
        return
    _ok(_cu.cuInit(0), "cuInit")
    dev, ctx, mod, f = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    _ok(_cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    _ok(_cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    _ok(_cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    _ok(_cu.cuModuleLoadData(ctypes.byref(mod), b"simulated"), "cuModuleLoadData")
    _ok(_cu.cuModuleGetFunction(ctypes.byref(f), mod, b"sleep_1000us"), "cuModuleGetFunction")
    _st["f"] = f
    if os.environ.get("CUDA_INJECTION64_PATH") and os.environ.get("FRACGPU_CUPTI_OUT"):
        _st["launches"] = []
        atexit.register(_write_meter)


def _write_meter():
    # The CUPTI meter's file, from the launch times (1 ms each, counted in
    # the 100 ms bin of CLOCK_MONOTONIC they were launched in).
    bins = {}
    for t in _st["launches"]:
        bins[t // 100_000_000] = bins.get(t // 100_000_000, 0) + 1_000_000
    first = min(bins, default=0)
    busy = [bins.get(b, 0) for b in range(first, max(bins) + 1)] if bins else []
    meter = {"tool": "stand-in", "pid": os.getpid(), "final": True, "kernels": len(_st["launches"]), "dropped": 0,
             "gpu_time_ns": sum(busy), "bin_ns": 100_000_000, "first_bin": first, "busy_ns": busy}
    with open(f"{os.environ['FRACGPU_CUPTI_OUT']}.{os.getpid()}.json", "w") as out:
        out.write(json.dumps(meter) + "\n")


def randn(*args, **kwargs):
    _init()
    return object()


empty = randn


def matmul(a, b, out=None):
    _ok(_cu.cuLaunchKernel(_st["f"], 1, 1, 1, 32, 1, 1, 0, None, None, None), "cuLaunchKernel")
    if "launches" in _st:
        _st["launches"].append(time.clock_gettime_ns(time.CLOCK_MONOTONIC))


class cuda:
    @staticmethod
    def is_available():
        try:
            _init()
            return True
        except Exception:
            return False

    @staticmethod
    def synchronize():
        _ok(_cu.cuCtxSynchronize(), "cuCtxSynchronize")

    @staticmethod
    def get_device_name(index=0):
        return "Stand-in"
EOF

# A fake meter path: the stand-in PyTorch writes the meter's file itself.
: >"$work/fake-cupti-meter.so"
rc=0
env -u SIMNVML_SAMPLE_MS -u SIMNVML_ATTRIB -u SIMNVML_FAULTS \
  PATH="$work/bin:$PATH" PYTHONPATH="$work/py" LD_LIBRARY_PATH="$simnvml:$simcuda" \
  SIMCUDA_STATE="$work/simulated-gpu" SIMCUDA_DEVICES="uuid=$uuid,name=Stand-in,mem=16GiB,ctx=64MiB" \
  FRACGPU_CUPTI_METER="$work/fake-cupti-meter.so" \
  bash "$here/../../tests/gpu/run_sm_share.sh" calibrate "$build" --seconds 3 --out "$work/out" >"$work/log" 2>&1 ||
  rc=$?
((rc == 0)) || { cat "$work/log" >&2; fail "run_sm_share.sh calibrate exited $rc"; }
results=$(echo "$work"/out/fracgpu-sm-share-*)
[[ -d $results ]] || fail "no results directory under --out ($results)"
for d in calib-alone calib-pair split-0.25_matmul-0.75_matmul; do
  [[ -s $results/$d/nvml-sampler.jsonl ]] || fail "no raw sampler log in $d"
  ls "$results/$d"/cupti-a.*.json >/dev/null 2>&1 || fail "no CUPTI meter file of a in $d"
done
for text in '## NVML calibration: each process' "## NVML's sampling, per phase and call" \
  '## Lines for docs/gpu-results.md' '- 2 processes without fracgpu: GPU Stand-in' \
  '  - nvmlDeviceGetProcessUtilization: NOT_FOUND ' 'SIMNVML_SAMPLE_MS=' 'SIMNVML_ATTRIB' \
  '| tenants at 0.25/0.75 under fracgpu | a (0.25) | 0.2'; do
  grep -qF -- "$text" "$work/log" || { cat "$work/log" >&2; fail "the output has no \"$text\""; }
done
# Known, CUPTI and NVML shares of the GPU time used, per process: within 10
# points of each other (the stand-in's exact mode measures what ran).
python3 - "$work/log" <<'EOF' || { cat "$work/log" >&2; fail "shares apart (above)"; }
import sys
rows = [line.split("|")[1:-1] for line in open(sys.argv[1]) if line.startswith("| ") and "(CUPTI)" in line
        or line.startswith("| 2 processes") and "(throughput)" in line]
assert len(rows) == 5, f"{len(rows)} rows of processes, expected 5"
for r in rows:
    known, cupti, nvml = (float(r[i]) for i in (5, 6, 7))
    assert abs(known - cupti) <= 0.10 and abs(nvml - known) <= 0.10, f"{r}: known {known}, CUPTI {cupti}, NVML {nvml}"
EOF
echo "bench_gpu_calibrate: ok"
