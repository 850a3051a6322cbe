#!/usr/bin/env python3
"""CI check of bench/gpu/gpu_report.py (CTest bench_gpu_report) on made-up
results, no GPU: a passing set exits 0; a missed target, a failed process, a
daemon that did not start, dropped CUPTI records and a kernel of another size
each exit 1; a failed MPS run is listed but does not count. The -nvml runs
(nvml_sampler log, CUPTI meter files): the NVML-against-CUPTI table and the
sampling table; a missing meter or sampler log is listed, not counted. And
bench/gpu/nvml_cupti.py on its own: clipping the meter's bins to a window,
the overlap note, the suggested SIMNVML_SAMPLE_MS / SIMNVML_ATTRIB.

  report_test.py WORK_DIR
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPORT = Path(__file__).resolve().parent / "gpu_report.py"
KERNEL = {"iterations": 90000, "blocks": 1056}
sys.path.insert(0, str(REPORT.parent))
import nvml_cupti  # noqa: E402

START_NS = 5_000_000_000_000  # the runs' common start (CLOCK_MONOTONIC ns), on a 100 ms bin edge


def sampler_summary(pids: dict, period=(133.0, 140.0, 167.0), not_found=0.993, per_sample=None,
                    busy_per_sample=None, span=15.0) -> dict:
    """An nvml_sampler summary: pids: pid -> estimated seconds over `span`."""
    per_sample = per_sample if per_sample is not None else {"1": 105}
    pu = {"function": "nvmlDeviceGetProcessUtilization", "enabled": True, "available": True, "calls": 7500,
          "not_found_fraction": not_found, "rc": {"0": 52, "6": 7448}, "call_us": {"n": 7500, "min": 20.0,
          "median": 41.0, "max": 900.0}, "primed": True, "samples": sum(per_sample.values()), "span_s": span,
          "stale": 0, "garbage": 0, "period_ms": {"n": 105, "min": period[0], "median": period[1], "max": period[2]},
          "pids_per_sample": per_sample, "busy_pids_per_sample": busy_per_sample or per_sample,
          "pids": {str(p): {"records": 50, "estimate_s": est, "fraction": est / span, "mean_sm": 99.0}
                   for p, est in pids.items()}}
    return {"gpu": "GPU-x", "name": "Made-up GPU", "driver": "999.1", "interval_ms": 2.0, "seconds": span,
            "polls": 7500, "missed_slots": 3, "poll_gap_ms": {"n": 7499, "min": 1.9, "median": 2.0, "max": 3.1},
            "calls": {"pu": pu, "pui": {"function": "nvmlDeviceGetProcessesUtilizationInfo", "enabled": True,
                                        "available": False, "why": "the library does not export it"},
                      "gs": {"function": "nvmlDeviceGetSamples", "enabled": True, "available": True, "calls": 7500,
                             "not_found_fraction": 0.99, "rc": {"0": 75, "6": 7425},
                             "call_us": {"n": 1, "min": 5.0, "median": 5.0, "max": 5.0}, "primed": True,
                             "samples": 106, "span_s": span, "period_ms": {"n": 106, "min": 140.0, "median": 141.0,
                                                                           "max": 142.0}, "busy_s": 14.9}}}


def write_sampler(d: Path, summary: dict) -> None:
    polls = [{"poll": 0, "mono_ns": START_NS, "real_us": 1, "pu": {"rc": 6, "us": 40.0, "last_seen": 0,
                                                                   "records": []}}]
    lines = [{"header": {"tool": "nvml_sampler", "gpu": "GPU-x"}}] + polls + [{"summary": summary}]
    (d / "nvml-sampler.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def write_meter(d: Path, tenant: str, pid: int, fraction: float, seconds: float = 15.0, shift_ns: int = 0) -> None:
    """A CUPTI meter file: busy `fraction` of every 100 ms bin of the window,
    plus a busy second before it (the warm-up, outside the window)."""
    bins = int(seconds * 10)
    busy = [100_000_000] * 10 + [int(fraction * 100_000_000)] * bins
    meter = {"tool": "fracgpu cupti_meter", "pid": pid, "final": True, "kernels": 1000, "dropped": 0,
             "gpu_time_ns": sum(busy), "bin_ns": 100_000_000,
             "first_bin": (START_NS + shift_ns) // 100_000_000 - 10, "busy_ns": busy}
    (d / f"cupti-{tenant}.{pid}.json").write_text(json.dumps(meter) + "\n")


def nvml_run(runs: Path, n: int, config: str, fractions: tuple, nvml_s: tuple, meters: bool = True,
             sampler: bool = True) -> None:
    """A -nvml run: two tenants of shares from `config`, CUPTI meter files with
    these fractions of the window, a sampler log with these NVML estimates."""
    shares = config.split("-")[1:]
    procs = [{"tenant": t, "share": sh, "rate": 100.0} for t, sh in zip("ab", shares)]
    write_run(runs, n, config, procs, gputime="nvml")
    d = runs / f"{n:02d}-compute-{config}-nvml"
    (d / "start").write_text(f"{START_NS}\n")
    if sampler:
        write_sampler(d, sampler_summary({1000 + n: nvml_s[0], 2000 + n: nvml_s[1]}))
    for t, frac, pid in zip("ab", fractions, (1000 + n, 2000 + n)):
        if meters:
            write_meter(d, t, pid, frac)
    # The workload's own pid: a's is 1000 + n (write_run), b's made 2000 + n here.
    for t, pid in (("a", 1000 + n), ("b", 2000 + n)):
        f = d / f"{t}.json"
        r = json.loads(f.read_text())
        r["pid"] = pid
        f.write_text(json.dumps(r) + "\n")


def write_run(runs: Path, n: int, config: str, procs: list[dict], mode: str = "fracgpu", repeat: int = 1,
              gputime=0, workload: str = "compute") -> None:
    """One run folder as run_gpu.sh writes it. procs: tenant, share, rate, and
    optionally rc, fraction, dropped, kernel (iterations, blocks). gputime: 0,
    1 or "nvml"."""
    suffix = {0: "", 1: "-gputime", "nvml": "-nvml"}[gputime]
    d = runs / f"{n:02d}-{workload}-{config}{suffix}"
    d.mkdir(parents=True)
    (d / "run.txt").write_text(f"workload={workload} mode={mode} seconds=15\n"
                               f"config={config} repeat={repeat} gputime={gputime}\n")
    tsv = []
    for p in procs:
        rc = p.get("rc", 0)
        tsv.append(f"{p['tenant']}\t{p.get('share', '')}\t{1000 + n}\t{rc}")
        (d / f"{p['tenant']}.err").write_text("" if rc == 0 else "gpu_workload: an error\n")
        if rc != 0:
            continue
        frac = p.get("fraction")
        result = {"mode": workload, "kernels": int(p["rate"] * 15), "seconds": 15.0, "rate": p["rate"],
                  **p.get("kernel", KERNEL), "cupti": int(gputime == 1),
                  "gpu_time_s": None if frac is None else frac * 15,
                  "gpu_fraction": frac, "cupti_dropped": p.get("dropped", 0), "pid": 1000 + n}
        (d / f"{p['tenant']}.json").write_text(json.dumps(result) + "\n")
    (d / "procs.tsv").write_text("".join(line + "\n" for line in tsv))


def passing_set(runs: Path, alone: float = 199.0, halves: float = 196.0) -> int:
    """native and fracgpu-1 alternated three times, the other runs once; returns the next run number."""
    n = 0
    for r, native in enumerate([200.0, 201.0, 199.5], start=1):
        write_run(runs, n := n + 1, "native", [{"tenant": "a", "rate": native}], mode="native", repeat=r)
        write_run(runs, n := n + 1, "fracgpu-1", [{"tenant": "a", "share": "1", "rate": alone}], repeat=r)
    write_run(runs, n := n + 1, "timeslice-2", [{"tenant": "a", "rate": 100.0}, {"tenant": "b", "rate": 100.5}],
              mode="native")
    write_run(runs, n := n + 1, "fracgpu-0.5-0.5", [{"tenant": "a", "share": "0.5", "rate": halves / 2},
                                                    {"tenant": "b", "share": "0.5", "rate": halves / 2}])
    write_run(runs, n := n + 1, "fracgpu-0.5-0.5", [{"tenant": "a", "share": "0.5", "rate": 97.0, "fraction": 0.49},
                                                    {"tenant": "b", "share": "0.5", "rate": 97.0, "fraction": 0.48}],
              gputime=1)
    write_run(runs, n := n + 1, "mps-50-50", [{"tenant": "a", "share": "50", "rc": 1},
                                              {"tenant": "b", "share": "50", "rate": 110.0}], mode="mps")
    return n + 1


def run_report(work: Path, name: str, build) -> tuple[int, str]:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    build(out / "runs")
    p = subprocess.run([sys.executable, str(REPORT), str(out)], capture_output=True, text=True)
    if p.stderr:
        print(f"{name}: stderr: {p.stderr}", file=sys.stderr)
    table = (out / "gpu_table.md").read_text() if (out / "gpu_table.md").exists() else ""
    if not (out / "gpu_runs.csv").exists():
        table += "\n(no gpu_runs.csv)"
    return p.returncode, table


def nvml_cupti_checks(work: Path) -> list[str]:
    """nvml_cupti.py's pieces on their own."""
    failures = []

    def check(what: str, ok: bool, got) -> None:
        if not ok:
            failures.append(f"nvml_cupti: {what}: got {got}")

    d = work / "nvml_cupti"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    # 0.3 of every bin of the 15 s window, the busy second before it left out;
    # a window cutting bins: half of the warm-up's last (busy) bin and half of
    # the window's first (0.3 busy).
    write_meter(d, "a", 7, 0.3, seconds=15.0)
    meter = nvml_cupti.find_meter(d, "cupti-a", 7)
    got = nvml_cupti.meter_busy_s(meter, START_NS, START_NS + 15 * 10**9)
    check("busy over the window", got is not None and abs(got - 4.5) < 1e-9, got)
    got = nvml_cupti.meter_busy_s(meter, START_NS - 50_000_000, START_NS + 50_000_000)
    check("busy over a window cutting bins", got is not None and abs(got - (0.05 + 0.015)) < 1e-9, got)
    check("meter by pid", nvml_cupti.find_meter(d, "cupti-a", 8) is not None, "the only file, another pid")
    write_meter(d, "a", 8, 0.3)
    check("two meters, unknown pid", nvml_cupti.find_meter(d, "cupti-a", 9) is None, "a guess")

    # Overlap: time-sliced processes each read nearly the whole window.
    procs = [{"tenant": t, "share": "pair", "pid": p, "lo_ns": START_NS, "hi_ns": START_NS + 15 * 10**9,
              "meter": {"bin_ns": 100_000_000, "first_bin": START_NS // 100_000_000, "busy_ns": [95_000_000] * 150,
                        "final": True, "dropped": 0}} for t, p in (("a", 1), ("b", 2))]
    sampler = {"summary": sampler_summary({1: 7.0, 2: 7.6}), "error": None}
    rows, notes = nvml_cupti.compare(procs, sampler)
    check("overlap note", any("overlapped" in n for n in notes), notes)
    check("NVML shares of used", abs(rows[0]["nvml_used"] - 7.0 / 14.6) < 1e-9, rows[0])

    # Suggestions: one PID per sample, period from the per-process call.
    one = sampler_summary({1: 7.0, 2: 7.6}, period=(120.0, 139.0, 170.0), per_sample={"1": 99, "2": 1})
    other = sampler_summary({1: 7.0}, period=(130.0, 143.0, 150.0))
    lines = nvml_cupti.suggest([one], [other])
    check("SIMNVML_SAMPLE_MS", lines[0].startswith("SIMNVML_SAMPLE_MS=141  #"), lines)
    check("SIMNVML_ATTRIB instant", lines[1].startswith("SIMNVML_ATTRIB=instant  #"), lines)
    both = sampler_summary({1: 7.0, 2: 7.6}, per_sample={"2": 100})
    lines = nvml_cupti.suggest([both])
    check("SIMNVML_ATTRIB not instant", lines[1].startswith("SIMNVML_ATTRIB: not one PID per sample: PIDs per "
                                                            "sample 2: 100"), lines)
    silent = sampler_summary({}, per_sample={})
    silent["calls"]["pu"]["period_ms"] = {"n": 0, "min": None, "median": None, "max": None}
    lines = nvml_cupti.suggest([silent])
    check("period from nvmlDeviceGetSamples when no per-process sample",
          lines[0].startswith("SIMNVML_SAMPLE_MS=141  #") and "nvmlDeviceGetSamples" in lines[0], lines)
    check("no attribution without samples", lines[1].startswith("SIMNVML_ATTRIB: no suggestion"), lines)
    paste = nvml_cupti.paste_lines("split", {"summary": one, "error": None}, {"1": "a"})
    check("paste lines", any("a 7.000 s (0.467)" in x and "PIDs per sample 1: 99, 2: 1" in x for x in paste), paste)
    return failures


def main() -> int:
    work = Path(sys.argv[1])
    failures = []

    def expect(name: str, build, rc: int, *texts: str) -> None:
        got, table = run_report(work, name, build)
        missing = [t for t in texts if t not in table]
        if got != rc or missing:
            failures.append(f"{name}: exit {got} (expected {rc}); missing {missing}\n{table}")

    expect("pass", passing_set, 0,
           "all targets met, no run failed", "| compute | fracgpu-1 | 3/3 | 199.0 kernels/s | 0.9950 | 0.9900..0.9975 |",
           "| compute | fracgpu-0.5-0.5 | 1/1 | 196.0 kernels/s | 0.9800 |", "a (0.5): 0.490; b (0.5): 0.480",
           "MPS comparison failed (not counted in the exit status)")
    expect("miss", lambda runs: passing_set(runs, alone=198.0, halves=190.0), 1,
           "targets missed: compute fracgpu-1, compute fracgpu-0.5-0.5; failed runs: 0")

    def failed_process(runs: Path) -> None:
        n = passing_set(runs)
        write_run(runs, n, "timeslice-2", [{"tenant": "a", "rc": 1}, {"tenant": "b", "rate": 100.0}], mode="native")
    expect("failed-process", failed_process, 1, "failed runs: 1", "a: exit 1 (gpu_workload: an error)")

    def daemon_failed(runs: Path) -> None:
        n = passing_set(runs)
        write_run(runs, n, "fracgpu-0.1-0.9", [{"tenant": "a", "share": "0.1", "rc": 125},
                                               {"tenant": "b", "share": "0.9", "rc": 125}])
    expect("daemon-failed", daemon_failed, 1, "failed runs: 1", "| compute | fracgpu-0.1-0.9 | 0/1 | FAILED |")

    def dropped(runs: Path) -> None:
        n = passing_set(runs)
        write_run(runs, n, "fracgpu-0.1-0.9", [
            {"tenant": "a", "share": "0.1", "rate": 20.0, "fraction": 0.1, "dropped": 3},
            {"tenant": "b", "share": "0.9", "rate": 178.0, "fraction": 0.89}], gputime=1)
    expect("cupti-dropped", dropped, 1, "a: 3 CUPTI records dropped")

    def other_kernel(runs: Path) -> None:
        n = passing_set(runs)
        write_run(runs, n, "fracgpu-0.25-0.75", [
            {"tenant": "a", "share": "0.25", "rate": 60.0, "kernel": {"iterations": 80000, "blocks": 1056}},
            {"tenant": "b", "share": "0.75", "rate": 140.0, "kernel": {"iterations": 80000, "blocks": 1056}}])
    expect("other-kernel", other_kernel, 1, "kernel 80000 iterations x 1056 blocks, not 90000 x 1056")

    def overlap(runs: Path) -> None:
        n = passing_set(runs)
        write_run(runs, n, "fracgpu-0.1-0.9", [
            {"tenant": "a", "share": "0.1", "rate": 20.0, "fraction": 0.6},
            {"tenant": "b", "share": "0.9", "rate": 178.0, "fraction": 0.9}], gputime=1)
    expect("overlap", overlap, 0, "(sum 1.500 > 1: kernels overlapped, not shares)")

    def with_nvml(runs: Path) -> None:
        n = passing_set(runs)
        nvml_run(runs, n, "fracgpu-0.25-0.75", (0.245, 0.735), (3.9, 11.1))
        nvml_run(runs, n + 1, "fracgpu-0.1-0.9", (0.098, 0.88), (1.8, 13.2), meters=False)
        nvml_run(runs, n + 2, "fracgpu-0.5-0.5", (0.49, 0.49), (7.4, 7.4), sampler=False)
    expect("nvml", with_nvml, 0, "all targets met, no run failed",
           "| compute | fracgpu-0.25-0.75 (NVML vs CUPTI meter) | 1/1 |",
           # 0.245 and 0.735 of the window: 0.25 / 0.75 of the GPU time used; NVML 3.9 / 11.1 s of 15 s.
           "| compute fracgpu-0.25-0.75 | a (0.25) | n/a | 0.245 | 0.260 | n/a | 0.250 | 0.260 | +1.0 |",
           "| compute fracgpu-0.25-0.75 | b (0.75) | n/a | 0.735 | 0.740 | n/a | 0.750 | 0.740 | -1.0 |",
           "| compute fracgpu-0.1-0.9 | a (0.1) | n/a | n/a | 0.120 | n/a | n/a | 0.120 | n/a |",
           "| compute fracgpu-0.25-0.75 | nvmlDeviceGetProcessUtilization | 7500 | 0.993 | 105 | 133.0/140.0/167.0 "
           "| 1: 105 | 1: 105 | 41/900 |",
           "| compute fracgpu-0.25-0.75 | nvmlDeviceGetProcessesUtilizationInfo | not available (the library does "
           "not export it) |",
           "| compute fracgpu-0.5-0.5 | - | no sampler log (No such file or directory) |",
           "- NVML/CUPTI (not counted in the exit status): 12-compute-fracgpu-0.1-0.9-nvml: a: no CUPTI meter file",
           "- NVML/CUPTI (not counted in the exit status): 13-compute-fracgpu-0.5-0.5-nvml: no sampler log")

    failures += nvml_cupti_checks(work)
    for f in failures:
        print(f"bench_gpu_report: {f}", file=sys.stderr)
    if not failures:
        print("bench_gpu_report: ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
