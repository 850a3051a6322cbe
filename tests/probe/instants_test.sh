#!/usr/bin/env bash
# gputime_load instants=nvml learns the driver's sampling instants as a tenant
# on a real GPU would, from the timestamps of nvmlDeviceGetSamples: against
# the stand-in NVML sampling every 300 ms (its instants: multiples of 300 ms
# of CLOCK_MONOTONIC), a dodging load told a wrong period (167 ms) must print
# the true period and a phase of 0 (within 2 ms), while another load keeps
# the simulated GPU busy so the ring holds samples; and from then on no
# per-process sample names it (nvmlDeviceGetProcessUtilization), while the
# other load's are there. Then the same learning under the interposer, whose
# NVML shows a tenant none of the device's samples: the load reads them
# through a helper process started without it, as a hostile tenant's
# container can.
#
#   instants_test.sh BUILD_DIR
set -euo pipefail
build=$1
work=$(mktemp -d /tmp/fracgpu-instants-XXXXXX)
busy_pid=""
trap '[[ -z $busy_pid ]] || kill "$busy_pid" 2>/dev/null || true; rm -rf "$work"' EXIT
export LD_LIBRARY_PATH="$build/simcuda:$build/simnvml${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SIMCUDA_STATE=$work/gpu SIMCUDA_SCHED=timeslice SIMNVML_SAMPLE_MS=300 SIMNVML_ATTRIB=instant
export SIMCUDA_DEVICES="uuid=GPU-1a570000-0000-4000-8000-000000000000,name=Simulated H100,mem=16GiB,ctx=64MiB"
unset CUDA_VISIBLE_DEVICES
"$build/tests/gputime_load" devices=0 kernels_us=1000 seconds=5 >"$work/busy.out" 2>&1 &
busy_pid=$!
sleep 1.5  # a few samples in the ring
"$build/tests/gputime_load" devices=0 kernels_us=1000 dodge_ms=167 guard_ms=8 instants=nvml seconds=3 \
  >"$work/dodger.out" 2>&1 &
dodger_pid=$!
sleep 0.8  # learned (read at its first step), then 2.2 s of dodging: 7 samples
named=$(python3 - "$build/simnvml/libnvidia-ml.so.1" "$dodger_pid" "$busy_pid" <<'PY'
import ctypes, sys, time
nvml = ctypes.CDLL(sys.argv[1])
dodger, busy = int(sys.argv[2]), int(sys.argv[3])
class Sample(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("timeStamp", ctypes.c_ulonglong), ("smUtil", ctypes.c_uint),
                ("memUtil", ctypes.c_uint), ("encUtil", ctypes.c_uint), ("decUtil", ctypes.c_uint)]
assert nvml.nvmlInit_v2() == 0
dev = ctypes.c_void_p()
assert nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(dev)) == 0
since = time.time_ns() // 1000
time.sleep(2.1)
samples = (Sample * 64)()
count = ctypes.c_uint(64)
rc = nvml.nvmlDeviceGetProcessUtilization(dev, samples, ctypes.byref(count), ctypes.c_ulonglong(since))
pids = {samples[i].pid for i in range(count.value)} if rc == 0 else set()
print(("dodger " if dodger in pids else "") + ("busy" if busy in pids else ""))
PY
)
wait "$dodger_pid" || { cat "$work/dodger.out" >&2; echo "FAIL: the dodging load failed" >&2; exit 1; }
out=$(cat "$work/dodger.out")
echo "$out"
echo "named by the samples while it dodged: ${named:-nobody}"
[[ $named == busy ]] || { echo "FAIL: expected only the busy load named, got '$named'" >&2; exit 1; }
period=$(sed -n 's/^instants_period_us=//p' <<<"$out")
phase=$(sed -n 's/^instants_phase_us=//p' <<<"$out")
[[ -n $period && -n $phase ]] || { echo "FAIL: no instants learned" >&2; exit 1; }
((period >= 297000 && period <= 303000)) || { echo "FAIL: period $period us, not 300000" >&2; exit 1; }
((phase <= 2000 || phase >= period - 2000)) || { echo "FAIL: phase $phase us, not 0" >&2; exit 1; }
grep -q '^launches_0=[1-9]' <<<"$out" || { echo "FAIL: the dodging load launched nothing" >&2; exit 1; }
echo "PASS: period $period us, phase $phase us"

# Under the interposer (no tenant: it passes every call through, but the load
# cannot know that and reads the ring through its helper all the same).
out=$(LD_PRELOAD="$build/interpose/libfracgpu.so" FRACGPU_UNMANAGED=passthrough "$build/tests/gputime_load" devices=0 \
  kernels_us=1000 dodge_ms=167 guard_ms=8 instants=nvml seconds=1.5 2>&1) ||
  { echo "$out" >&2; echo "FAIL: the dodging load under the interposer failed" >&2; exit 1; }
echo "$out"
period=$(sed -n 's/^instants_period_us=//p' <<<"$out")
phase=$(sed -n 's/^instants_phase_us=//p' <<<"$out")
[[ -n $period && -n $phase ]] || { echo "FAIL: no instants learned under the interposer" >&2; exit 1; }
((period >= 297000 && period <= 303000)) || { echo "FAIL: under the interposer, period $period us" >&2; exit 1; }
((phase <= 2000 || phase >= period - 2000)) || { echo "FAIL: under the interposer, phase $phase us" >&2; exit 1; }
echo "PASS under the interposer: period $period us, phase $phase us"
