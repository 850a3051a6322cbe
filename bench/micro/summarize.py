#!/usr/bin/env python3
"""Summarizes run_micro.sh's runs: ns added per driver call by libfracgpu.so.

    summarize.py OUT_DIR [--smoke] [--clock=cpu|real]

Reads OUT_DIR/json/pair<i>-<mode>.json (Google Benchmark JSON; mode is
native, solo or shared), OUT_DIR/status.json (fracgpu status --json after the
runs) and, if present, OUT_DIR/callgrind/*. Writes OUT_DIR/micro.csv
(micro-real.csv with --clock=real; callgrind.csv) and prints markdown tables.

Times are the calling thread's CPU time per call (Google Benchmark's
cpu_time, CLOCK_THREAD_CPUTIME_ID) unless --clock=real: on a loaded machine
wall time also counts the time the thread was not running, which swamps a few
ns; CPU time does not (cache and frequency effects of the load remain).

Added ns per benchmark: for each pair, median over repetitions interposed minus
median over repetitions native; the figure is the median of those paired
differences, so a drift of the machine between pairs cancels.

Exits 1 if a run is not what it claims to be (the calls did not reach the
interposer, or did without it; the shared tenant never held its GPU; a
benchmark is missing or failed). Missing a target is reported, not an error:
benchmarks are not tests.
"""
import csv
import glob
import json
import os
import re
import statistics
import sys

# (label, benchmark, interposed mode, target ns added or None)
ROWS = [
    ("cuLaunchKernel, GPU not shared", "cuLaunchKernel", "solo", 20),
    ("cuLaunchKernel, GPU shared, held", "cuLaunchKernel", "shared", 20),
    ("cuMemAlloc_v2 + cuMemFree_v2", "cuMemAlloc_v2+cuMemFree_v2", "solo", 100),
    ("cuMemGetInfo_v2", "cuMemGetInfo_v2", "solo", None),
    ("cuGetProcAddress_v2(cuMemAlloc)", "cuGetProcAddress_v2", "solo", None),
    ("cuGetProcAddress_v2(cuCtxGetDevice), not hooked", "cuGetProcAddress_v2_unhooked", "solo", None),
    ("cuCtxGetDevice (pass-through)", "cuCtxGetDevice", "solo", 5),
    ("dlsym(libcuda, cuMemAlloc_v2)", "dlsym", "solo", None),
    ("dlsym(libcuda, cuCtxGetDevice), not hooked", "dlsym_unhooked", "solo", None),
]
EXPECTED_REACH = {"native": "libcuda.so.1", "solo": "libfracgpu.so", "shared": "libfracgpu.so"}
EXPECTED_TENANT = {"native": "", "solo": "solo", "shared": "shared"}


def fail(message):
    print(f"summarize.py: {message}", file=sys.stderr)
    sys.exit(1)


def load_run(path, mode, clock):
    """{benchmark: [real ns per iteration, one per repetition]} of one run."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"{path}: {e}")
    context = data.get("context", {})
    if context.get("calls_reach") != EXPECTED_REACH[mode]:
        fail(f"{path}: driver calls reached {context.get('calls_reach')!r}, expected {EXPECTED_REACH[mode]!r}")
    if context.get("tenant", "") != EXPECTED_TENANT[mode]:
        fail(f"{path}: ran as tenant {context.get('tenant')!r}, expected {EXPECTED_TENANT[mode]!r}")
    times = {}
    for b in data.get("benchmarks", []):
        if b.get("run_type", "iteration") != "iteration":
            continue
        name = b.get("run_name", b["name"])
        if b.get("error_occurred"):
            fail(f"{path}: {name}: {b.get('error_message', 'error')}")
        scale = {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}[b.get("time_unit", "ns")]
        times.setdefault(name, []).append(b[f"{clock}_time"] * scale)
    return times


def load_pairs(out_dir, clock):
    """[{mode: {benchmark: median ns}}] per pair, in pair order."""
    pairs = {}
    for path in glob.glob(os.path.join(out_dir, "json", "pair*-*.json")):
        m = re.fullmatch(r"pair(\d+)-(native|solo|shared)\.json", os.path.basename(path))
        if m is None:
            continue
        runs = load_run(path, m.group(2), clock)
        pairs.setdefault(int(m.group(1)), {})[m.group(2)] = {k: statistics.median(v) for k, v in runs.items()}
    if not pairs:
        fail(f"no runs in {out_dir}/json")
    return [pairs[i] for i in sorted(pairs)]


def check_status(out_dir):
    """The settings were what the rows say: solo's GPU unshared, shared's held."""
    path = os.path.join(out_dir, "status.json")
    try:
        with open(path) as f:
            tenants = {t["name"]: t for t in json.load(f)["tenants"]}
    except (OSError, ValueError, KeyError) as e:
        fail(f"{path}: {e}")
    for name in ("solo", "shared"):
        if name not in tenants or not tenants[name]["gpus"]:
            fail(f"{path}: tenant {name} missing")
    shared = tenants["shared"]["gpus"][0].get("gpu_time")
    if not shared or shared.get("tenants_sharing") != 2 or shared.get("slices", 0) < 1:
        fail(f"{path}: tenant shared did not hold a GPU shared by 2 tenants: gpu_time = {shared}")
    # Unmetered: its GPU has one tenant, and no process of it ever waited
    # for or was handed the GPU.
    solo = tenants["solo"]["gpus"][0].get("gpu_time")
    if solo and (solo.get("tenants_sharing", 1) > 1 or solo.get("slices", 0) > 0):
        fail(f"{path}: tenant solo's launches were metered: gpu_time = {solo}")


def summarize_times(out_dir, smoke, clock):
    pairs = load_pairs(out_dir, clock)
    lines = []
    for label, bench, mode, target in ROWS:
        natives, interposed, added = [], [], []
        for p in pairs:
            if bench not in p.get("native", {}) or bench not in p.get(mode, {}):
                fail(f"benchmark {bench} missing from a native or {mode} run")
            natives.append(p["native"][bench])
            interposed.append(p[mode][bench])
            added.append(p[mode][bench] - p["native"][bench])
        add = statistics.median(added)
        if smoke:
            verdict = "smoke"
        elif target is None:
            verdict = ""
        else:
            verdict = "met" if add <= target else "MISSED"
        lines.append({
            "benchmark": label,
            "native_ns": round(statistics.median(natives), 1),
            "interposed_ns": round(statistics.median(interposed), 1),
            "added_ns": round(add, 1),
            "added_min_ns": round(min(added), 1),
            "added_max_ns": round(max(added), 1),
            "pairs": len(pairs),
            "target_ns": "" if target is None else target,
            "verdict": verdict,
            "clock": clock,
        })
    csv_name = "micro.csv" if clock == "cpu" else f"micro-{clock}.csv"
    with open(os.path.join(out_dir, csv_name), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(lines[0]))
        w.writeheader()
        w.writerows(lines)
    print("| call | native ns | interposed ns | added ns (median) | added, min..max over pairs | target | |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in lines:
        target = f"<= {r['target_ns']}" if r["target_ns"] != "" else "-"
        print(f"| {r['benchmark']} | {r['native_ns']:.1f} | {r['interposed_ns']:.1f} | {r['added_ns']:.1f} | "
              f"{r['added_min_ns']:.1f}..{r['added_max_ns']:.1f} | {target} | {r['verdict']} |")
    print(f"\n{len(pairs)} pairs; {clock} time per call; each run's figure is the median of its repetitions.")


def callgrind_total(path):
    """Instructions (Ir) in one callgrind dump: its 'summary:' or 'totals:' line."""
    with open(path) as f:
        for line in f:
            if line.startswith("summary:") or line.startswith("totals:"):
                return int(line.split()[1])
    fail(f"{path}: no summary line")


def summarize_callgrind(out_dir):
    """Dumps are <mode>.<pid>.<n>-<thread>; the main thread (-01) only."""
    root = os.path.join(out_dir, "callgrind")
    if not os.path.isdir(root):
        return
    with open(os.path.join(root, "iterations")) as f:
        iterations = int(f.read())
    per_call = {}  # (mode, benchmark) -> Ir per call
    for path in glob.glob(os.path.join(root, "*.*.*-01")):
        mode = os.path.basename(path).split(".")[0]
        trigger = None
        with open(path) as f:
            for line in f:
                if line.startswith("desc: Trigger:"):
                    trigger = line.split("Client Request:", 1)[-1].strip()
                    break
        if trigger:
            per_call[(mode, trigger)] = callgrind_total(path) / iterations
    lines = []
    for label, bench, mode, _ in ROWS:
        if (mode, bench) not in per_call or ("native", bench) not in per_call:
            fail(f"callgrind: no dump for {bench} ({mode} and native)")
        native, inter = per_call[("native", bench)], per_call[(mode, bench)]
        lines.append({"benchmark": label, "native_ir": round(native, 1), "interposed_ir": round(inter, 1),
                      "added_ir": round(inter - native, 1)})
    with open(os.path.join(out_dir, "callgrind.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(lines[0]))
        w.writeheader()
        w.writerows(lines)
    print(f"\nInstructions per call (callgrind, main thread, {iterations} calls each):\n")
    print("| call | native Ir | interposed Ir | added Ir |")
    print("|---|---:|---:|---:|")
    for r in lines:
        print(f"| {r['benchmark']} | {r['native_ir']:.1f} | {r['interposed_ir']:.1f} | {r['added_ir']:.1f} |")


def main():
    if len(sys.argv) < 2:
        fail("usage: summarize.py OUT_DIR [--smoke] [--clock=cpu|real]")
    out_dir = sys.argv[1]
    smoke, clock = False, "cpu"
    for arg in sys.argv[2:]:
        if arg == "--smoke":
            smoke = True
        elif arg in ("--clock=cpu", "--clock=real"):
            clock = arg.split("=")[1]
        else:
            fail(f"unknown argument {arg}")
    check_status(out_dir)
    summarize_times(out_dir, smoke, clock)
    if clock == "cpu":
        summarize_callgrind(out_dir)


if __name__ == "__main__":
    main()
