#!/usr/bin/env python3
"""CI check of bench/gpu/gpu_report.py (CTest bench_gpu_report) on made-up
results, no GPU: a passing set exits 0; a missed target, a failed process, a
daemon that did not start, dropped CUPTI records and a kernel of another size
each exit 1; a failed MPS run is listed but does not count.

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


def write_run(runs: Path, n: int, config: str, procs: list[dict], mode: str = "fracgpu", repeat: int = 1,
              gputime: int = 0, workload: str = "compute") -> None:
    """One run folder as run_gpu.sh writes it. procs: tenant, share, rate, and
    optionally rc, fraction, dropped, kernel (iterations, blocks)."""
    d = runs / f"{n:02d}-{workload}-{config}{'-gputime' if gputime else ''}"
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
                  **p.get("kernel", KERNEL), "cupti": gputime, "gpu_time_s": None if frac is None else frac * 15,
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

    for f in failures:
        print(f"bench_gpu_report: {f}", file=sys.stderr)
    if not failures:
        print("bench_gpu_report: ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
