#!/usr/bin/env bash
# CI check of `tests/gpu/run_sm_share.sh latency` without a GPU (CTest
# bench_gpu_latency): the whole subcommand on the simulated driver, with a
# stand-in for nvidia-smi and one for PyTorch whose matmul launches one
# simulated kernel (25 us for the decode's small matrices, 2 ms for the
# training's large ones; through ctypes, so fracgpu's interposer sees it) and
# whose CUDA events are the simulated driver's, and which writes the CUPTI
# meter's file itself when the meter is injected (CUPTI needs a real driver).
# Checks the exit status, each run's results, and the table's rows, figures
# and targets. It checks no figure of a real GPU, and not whether the targets
# are met.
#
#   bash bench/gpu/latency_test.sh BUILD_DIR SIMCUDA_LIB_DIR SIMNVML_LIB_DIR WORK_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$(realpath "$1") simcuda=$(realpath "$2") simnvml=$(realpath "$3") work=$4
fail() { echo "bench_gpu_latency: $*" >&2; exit 1; }
rm -rf "$work"
mkdir -p "$work/bin" "$work/py/torch"
work=$(realpath "$work")
uuid=GPU-5a000000-0000-4000-8000-000000001a7e

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
"""Stand-in for PyTorch on the simulated driver: matmul launches one kernel
(25 us below 1024 rows, else 2 ms), events are the driver's."""
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
    dev, ctx, mod = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
    _ok(_cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    _ok(_cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    _ok(_cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    _ok(_cu.cuModuleLoadData(ctypes.byref(mod), b"simulated"), "cuModuleLoadData")
    for us in (25, 2000):
        f = ctypes.c_void_p()
        _ok(_cu.cuModuleGetFunction(ctypes.byref(f), mod, f"sleep_{us}us".encode()), "cuModuleGetFunction")
        _st[us] = f
    if os.environ.get("CUDA_INJECTION64_PATH") and os.environ.get("FRACGPU_CUPTI_OUT"):
        _st["launches"] = []
        atexit.register(_write_meter)


def _write_meter():
    # The CUPTI meter's file, from the launch times: each kernel's length
    # counted in the 100 ms bin of CLOCK_MONOTONIC it was launched in.
    bins = {}
    for t, ns in _st["launches"]:
        bins[t // 100_000_000] = bins.get(t // 100_000_000, 0) + ns
    first = min(bins, default=0)
    busy = [bins.get(b, 0) for b in range(first, max(bins) + 1)] if bins else []
    meter = {"tool": "stand-in", "pid": os.getpid(), "final": True, "kernels": len(_st["launches"]), "dropped": 0,
             "gpu_time_ns": sum(busy), "bin_ns": 100_000_000, "first_bin": first, "busy_ns": busy}
    with open(f"{os.environ['FRACGPU_CUPTI_OUT']}.{os.getpid()}.json", "w") as out:
        out.write(json.dumps(meter) + "\n")


class _Tensor:
    def __init__(self, rows):
        self.rows = rows

    def __truediv__(self, other):
        return self


def randn(*shape, **kwargs):
    _init()
    return _Tensor(shape[0])


empty = randn


def matmul(a, b, out=None):
    us = 25 if a.rows < 1024 else 2000
    _ok(_cu.cuLaunchKernel(_st[us], 1, 1, 1, 32, 1, 1, 0, None, None, None), "cuLaunchKernel")
    if "launches" in _st:
        _st["launches"].append((time.clock_gettime_ns(time.CLOCK_MONOTONIC), us * 1000))


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

    class Event:
        def __init__(self, enable_timing=False):
            _init()
            self.e = ctypes.c_void_p()
            _ok(_cu.cuEventCreate(ctypes.byref(self.e), 0 if enable_timing else 2), "cuEventCreate")

        def record(self):
            _ok(_cu.cuEventRecord(self.e, None), "cuEventRecord")

        def synchronize(self):
            _ok(_cu.cuEventSynchronize(self.e), "cuEventSynchronize")

        def query(self):
            return _cu.cuEventQuery(self.e) == 0

        def elapsed_time(self, end):
            ms = ctypes.c_float()
            _ok(_cu.cuEventElapsedTime(ctypes.byref(ms), self.e, end.e), "cuEventElapsedTime")
            return ms.value
EOF

# A fake meter path (the stand-in PyTorch writes the meter's file itself) and
# sampler (the latency runs do not start it).
: >"$work/fake-cupti-meter.so"
printf '#!/bin/sh\nexit 0\n' >"$work/bin/fake-nvml-sampler" && chmod +x "$work/bin/fake-nvml-sampler"
rc=0
env -u SIMNVML_SAMPLE_MS -u SIMNVML_ATTRIB -u SIMNVML_FAULTS \
  PATH="$work/bin:$PATH" PYTHONPATH="$work/py" LD_LIBRARY_PATH="$simnvml:$simcuda" \
  SIMCUDA_STATE="$work/simulated-gpu" SIMCUDA_DEVICES="uuid=$uuid,name=Stand-in,mem=16GiB,ctx=64MiB" \
  FRACGPU_CUPTI_METER="$work/fake-cupti-meter.so" FRACGPU_NVML_SAMPLER="$work/bin/fake-nvml-sampler" \
  bash "$here/../../tests/gpu/run_sm_share.sh" latency "$build" --seconds 2 --inflight 100 --out "$work/out" \
  >"$work/log" 2>&1 || rc=$?
((rc == 0)) || { cat "$work/log" >&2; fail "run_sm_share.sh latency exited $rc"; }
results=$(echo "$work"/out/fracgpu-sm-share-*)
[[ -d $results ]] || fail "no results directory under --out ($results)"
[[ -s $results/latency_table.md ]] || fail "no latency_table.md in $results"
groups=(latency-decode-alone latency-train-alone latency-decode-fracgpu-alone latency-native-2 latency-fracgpu-normal)
if [[ -e $results/latency-skipped.txt ]]; then
  grep -qF 'Not measured: the run with priority = "latency"' "$results/latency_table.md" ||
    fail "a run was left out, and the table does not say so"
else
  groups+=(latency-fracgpu-latency)
fi
for g in "${groups[@]}"; do
  for f in "$results/$g"/*.json; do
    [[ $f == */cupti-* ]] || [[ -s $f ]] || fail "$g: $(basename "$f") is empty (see $g/*.err)"
  done
  [[ $g == latency-train-alone ]] || [[ -s $results/$g/inf.latencies ]] || fail "$g: no request latencies"
done
ls "$results"/latency-fracgpu-normal/cupti-inf.*.json >/dev/null 2>&1 || fail "no CUPTI meter file of inf"
# Every row with figures: the percentiles in order, GPU time in [0, 1], the
# training's iterations where it ran; the targets computed.
python3 - "$results/latency_table.md" "${#groups[@]}" <<'EOF' || { cat "$work/log" >&2; fail "the table (above)"; }
import sys
lines = open(sys.argv[1]).read().splitlines()
rows = [[c.strip() for c in line.split("|")[1:-1]] for line in lines if line.startswith("| ") and not line.startswith("| training shape")]
assert len(rows) == int(sys.argv[2]), f"{len(rows)} rows, expected {sys.argv[2]}"
for r in rows:
    assert not r[1].startswith("FAILED"), r
    if r[1].startswith("training alone"):
        assert float(r[9]) > 0, r
        continue
    p50, p99, p999 = float(r[2]), float(r[3]), float(r[4])
    assert 0 < p50 <= p99 <= p999, r
    assert int(r[5].split()[0]) > 0 and 0 <= float(r[6]) <= 1, r
    if r[1].startswith("both"):
        assert float(r[9]) > 0 and 0 <= float(r[7]) <= 1 and r[10] in ("yes", "no") and r[11] in ("yes", "no"), r
assert any(line.startswith("Targets from the decode alone without fracgpu (p50 ") for line in lines), lines
EOF
echo "bench_gpu_latency: ok"
