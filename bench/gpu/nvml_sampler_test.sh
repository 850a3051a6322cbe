#!/usr/bin/env bash
# CI smoke test of bench/gpu/nvml_sampler (CTest bench_gpu_nvml_sampler), no
# GPU: a saturating load (tests/probe/gputime_load) runs on a simulated GPU
# while nvml_sampler polls the stand-in NVML (tests/simnvml) every 2 ms for
# about 1 s. Checks that every line of the log is JSON, header first and
# summary last, that the load's PID is in the summary of
# nvmlDeviceGetProcessUtilization with an integrated estimate of about the
# time sampled, the GPU named by UUID, and the failures (no library: exit 1
# with a summary saying why; a bad option: exit 2). A second run with
# SIMNVML_SAMPLE_MS=20 (the stand-in's realistic sampling, where it has it) is
# only checked to parse: the test does not depend on that mode.
#
#   bash bench/gpu/nvml_sampler_test.sh SAMPLER LOAD SIMCUDA_DIR SIMNVML_DIR WORK_DIR
set -euo pipefail
sampler=$1 load=$2 simcuda=$3 simnvml=$4 work=$5
fail() { echo "bench_gpu_nvml_sampler: $*" >&2; exit 1; }
rm -rf "$work"
mkdir -p "$work"
work=$(realpath "$work")
uuid=GPU-5a000000-0000-4000-8000-00000000c0de
export SIMCUDA_STATE=$work/simulated-gpu SIMCUDA_DEVICES="uuid=$uuid,name=Sampled,mem=16GiB,ctx=64MiB"
unset SIMNVML_SAMPLE_MS SIMNVML_ATTRIB SIMNVML_FAULTS

load_pid=""
# shellcheck disable=SC2317 # reached through the EXIT trap
cleanup() {
  if [[ -n $load_pid ]]; then kill "$load_pid" 2>/dev/null || true; wait "$load_pid" 2>/dev/null || true; fi
}
trap cleanup EXIT
LD_LIBRARY_PATH=$simcuda "$load" devices=0 kernels_us=1000 seconds=8 >"$work/load.out" 2>&1 &
load_pid=$!
# The load is on the GPU once the stand-in lists it (it holds its context's memory).
for _ in $(seq 100); do
  LD_LIBRARY_PATH=$simnvml:$simcuda "$sampler" --gpu 0 --seconds 0.05 --calls pu --out "$work/probe.jsonl" 2>/dev/null
  grep -q "\"pid\": $load_pid," "$work/probe.jsonl" && break
  kill -0 "$load_pid" 2>/dev/null || { cat "$work/load.out" >&2; fail "the load exited early"; }
  sleep 0.05
done

check() {  # check LOG [PID MIN_FRACTION]: the log's lines and summary
  python3 - "$@" <<'EOF'
import json, sys
path = sys.argv[1]
lines = open(path).read().splitlines()
rows = [json.loads(line) for line in lines]  # every line is JSON
assert rows and "header" in rows[0], "no header first"
assert "summary" in rows[-1], "no summary last"
polls = [r for r in rows if "poll" in r]
s = rows[-1]["summary"]
assert s["polls"] == len(polls), (s["polls"], len(polls))
for key in ("poll_gap_ms", "calls"):
    assert key in s, key
pu = s["calls"]["pu"]
for key in ("calls", "not_found_fraction", "rc", "period_ms", "pids_per_sample", "pids", "samples"):
    assert key in pu, key
assert all("pu" in p and "rc" in p["pu"] and "records" in p["pu"] for p in polls), "a poll lacks pu"
if len(sys.argv) > 2:
    pid, low = sys.argv[2], float(sys.argv[3])
    assert len(polls) >= 50, f"only {len(polls)} polls in 1 s at 2 ms"
    assert pu["not_found_fraction"] < 0.5, pu
    rec = pu["pids"].get(pid)
    assert rec is not None, f"pid {pid} not in {list(pu['pids'])}"
    assert low <= rec["fraction"] <= 1.05, f"pid {pid}: estimate {rec['estimate_s']} s over {pu['span_s']} s"
    assert abs(rec["estimate_s"] - rec["fraction"] * pu["span_s"]) < 1e-3
digest = {k: (v.get("samples"), v.get("period_ms", {}).get("median"), v.get("not_found_fraction"))
          for k, v in s["calls"].items() if v.get("available")}
print(f"{path}: {len(polls)} polls; (samples, median period ms, NOT_FOUND) per call: {digest}")
EOF
}

LD_LIBRARY_PATH=$simnvml:$simcuda "$sampler" --gpu 0 --seconds 1 --interval-ms 2 --out "$work/log.jsonl" \
  2>"$work/log.err" || { cat "$work/log.err" >&2; fail "nvml_sampler exited $?"; }
# A saturating load alone: busy nearly all the time (0.5: slack for a loaded 2-core runner).
check "$work/log.jsonl" "$load_pid" 0.5 || fail "log.jsonl (above)"
grep -q 'nvml_sampler: nvmlDeviceGetProcessUtilization: ' "$work/log.err" || fail "no digest on stderr"

LD_LIBRARY_PATH=$simnvml:$simcuda "$sampler" --gpu "$uuid" --seconds 0.2 --out "$work/uuid.jsonl" 2>/dev/null ||
  fail "nvml_sampler --gpu $uuid failed"
check "$work/uuid.jsonl" >/dev/null || fail "uuid.jsonl"
grep -q "\"uuid\": \"$uuid\"" "$work/uuid.jsonl" || fail "--gpu $uuid: not that GPU"

SIMNVML_SAMPLE_MS=20 LD_LIBRARY_PATH=$simnvml:$simcuda "$sampler" --gpu 0 --seconds 1 --out "$work/sampled.jsonl" \
  2>/dev/null || fail "nvml_sampler with SIMNVML_SAMPLE_MS=20 failed"
check "$work/sampled.jsonl" || fail "sampled.jsonl"

rc=0
"$sampler" --gpu 0 --seconds 0.1 --lib "$work/no-such-libnvidia-ml.so" --out "$work/nolib.jsonl" 2>/dev/null || rc=$?
((rc == 1)) || fail "a missing library: exit $rc, expected 1"
python3 -c 'import json, sys; s = json.loads(open(sys.argv[1]).read().splitlines()[-1])["summary"]; assert "dlopen" in s["error"]' \
  "$work/nolib.jsonl" || fail "a missing library: no summary saying why"
rc=0
"$sampler" --gpu 0 --interval-ms 0 >/dev/null 2>&1 || rc=$?
((rc == 2)) || fail "--interval-ms 0: exit $rc, expected 2"
echo "bench_gpu_nvml_sampler: ok"
