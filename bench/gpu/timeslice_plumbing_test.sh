#!/usr/bin/env bash
# tests/gpu/run_timeslice.sh's plumbing, without a GPU: a stand-in
# nvidia-smi, and a stand-in timeslice_probe that sleeps instead of spinning
# and writes, as the injected CUPTI meter would, the meter's file. Checks
# that the two timing runs and the CUPTI run find their files and report:
# once with records that an idle process receives (verdict "yes"), once
# with a CUPTI that refuses the kind (verdict "unknown"), each exit 0.
#
#   bash bench/gpu/timeslice_plumbing_test.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "timeslice_plumbing_test: $*" >&2; exit 1; }

mkdir -p "$work/bin" "$work/build/bench/gpu"
printf '#!/bin/sh\necho "GPU 0: stand-in"\n' >"$work/bin/nvidia-smi"
# The meter is only named (CUDA_INJECTION64_PATH): the stand-in probe does its part.
: >"$work/build/bench/gpu/libfracgpu_cupti_meter.so"
cat >"$work/build/bench/gpu/timeslice_probe" <<'EOF'
#!/usr/bin/env python3
import json, os, sys, time
args = sys.argv[1:]
idle = "--idle" in args
pid = os.getpid()
t0 = time.monotonic_ns()
time.sleep(0.05)
t1 = time.monotonic_ns()
if idle:
    print(json.dumps({"pid": pid, "idle": True}))
else:
    # A window a second wider each side than the sleep, as the meter's below:
    # probes that python starts tens of ms apart on a loaded host still share
    # most of it (with the sleep's window alone, three sometimes shared too
    # little for the report, which then failed the run).
    start, end = t0 - 10**9, t1 + 10**9
    gaps = [[start + i * 2000000, start + i * 2000000 + 1000000] for i in range((end - start) // 2000000)]
    print(json.dumps({"pid": pid, "start_ns": start, "end_ns": end, "gap_ns": 3000, "overflow": False, "gaps": gaps}))
out = os.environ.get("FRACGPU_CUPTI_OUT")
if out and os.environ.get("FRACGPU_CUPTI_CTX_SWITCH") == "1" and os.environ.get("CUDA_INJECTION64_PATH"):
    refused = os.environ.get("STAND_IN_CUPTI_REFUSES") == "1"
    # Two records (out, in) for each of a spinner's gaps: what a CUPTI that
    # shows every process's switches gives the idle one.
    switches = 2 * ((t1 - t0 + 2 * 10**9) // 2000000)
    events = [] if refused else [[t0 + 1000 + i * 1000, 9, 1 + i % 2] for i in range(switches)]
    cs = {"enabled": not refused, "records": len(events), "own_contexts": [1], "contexts": {}, "events": events}
    if refused:
        cs["error"] = "CUPTI (API version 130001) refused the context-switch records: CUPTI_ERROR_INVALID_KIND"
    # Spin windows wide enough to overlap whatever the start order was.
    meter = {"pid": pid, "first_start_mono_ns": None if idle else t0 - 10**9,
             "last_end_mono_ns": None if idle else t1 + 10**9, "ctx_switch": cs}
    with open(f"{out}.{pid}.json", "w") as f:
        f.write(json.dumps(meter))
EOF
chmod +x "$work/bin/nvidia-smi" "$work/build/bench/gpu/timeslice_probe"

run() {
  PATH="$work/bin:$PATH" bash "$root/tests/gpu/run_timeslice.sh" "$work/build" --out "$work/out-$1" --seconds 0.05 \
    >"$work/$1.log" 2>&1 || fail "$1: run_timeslice.sh exited $? ($(tail -n 5 "$work/$1.log"))"
}
run sees
grep -q "== 2 probes at once" "$work/sees.log" || fail "no two-probe run: $(cat "$work/sees.log")"
grep -q "a process sees other processes' switches: yes" "$work/sees.log" || fail "no verdict: $(cat "$work/sees.log")"
[[ -s $work/out-sees/ctxswitch.json ]] || fail "no ctxswitch.json"
STAND_IN_CUPTI_REFUSES=1 run refuses
grep -q "a process sees other processes' switches: unknown: CUPTI here does not give the records" "$work/refuses.log" ||
  fail "no refusal: $(cat "$work/refuses.log")"
echo "timeslice_plumbing_test: ok"
