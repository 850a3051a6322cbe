#!/usr/bin/env python3
"""CI check of bench/gpu/latency_workload.py (CTest bench_gpu_latency_report)
on made-up results of `tests/gpu/run_sm_share.sh latency`, no GPU: the
table's figures and the targets computed from the decode alone (a met and a
missed target), GPU time from the CUPTI meter where there is one, the note
of a run left out; a tenant without a result exits 1. And the workload's
pure parts: the arrivals (the seeded sequence bench/e2e/e2e_workload.cpp
draws, within the jitter) and the nearest-rank percentiles.

  latency_report_test.py WORK_DIR
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOAD = HERE / "latency_workload.py"
sys.path.insert(0, str(HERE))
import latency_workload  # noqa: E402

START_NS = 5_000_000_000_000  # the common start (CLOCK_MONOTONIC ns), on a 100 ms bin edge


def decode(pid: int, p50: float, p99: float, p999: float, requests: int = 1000, late: int = 0,
           missed: int = 0) -> dict:
    return {"pid": pid, "workload": "decode", "seconds": 10.0, "requests": requests, "late": late, "missed": missed,
            "request_gpu_ms_alone": 1.5, "p50_ms": p50, "p99_ms": p99, "p999_ms": p999, "max_ms": p999}


def train(pid: int, rate: float) -> dict:
    return {"pid": pid, "workload": "train", "inflight": 1000, "iterations": int(rate * 10), "seconds": 10.0,
            "rate": rate}


def group(results: Path, name: str, tenants: list[tuple], fracgpu: bool = False) -> Path:
    """tenants: (tenant, share, kind, priority, result or None)."""
    d = results / name
    d.mkdir(parents=True)
    (d / "start").write_text(f"{START_NS}\n")
    if fracgpu:
        (d / "fracgpud.log").write_text("")
    lines = []
    for tenant, share, kind, priority, result in tenants:
        lines.append(f"{tenant}\t{share}\t{kind}\t{priority}\n")
        (d / f"{tenant}.json").write_text("" if result is None else json.dumps(result) + "\n")
    (d / "tenants.tsv").write_text("".join(lines))
    return d


def write_meter(d: Path, tenant: str, pid: int, fraction: float, seconds: float = 10.0) -> None:
    """A CUPTI meter file: busy `fraction` of every 100 ms bin of the window."""
    width = 100_000_000
    bins = int(seconds * 1e9) // width
    (d / f"cupti-{tenant}.{pid}.json").write_text(json.dumps(
        {"pid": pid, "bin_ns": width, "first_bin": START_NS // width, "busy_ns": [int(fraction * width)] * bins}))


def full_set(results: Path, failed: bool = False, skip_latency: bool = False) -> None:
    # Alone: p50 2.00, p99 3.00 -> targets p50 <= 2.10, p99 <= 5.30.
    group(results, "latency-decode-alone", [("inf", "alone", "decode", "", decode(11, 2.0, 3.0, 3.5))])
    group(results, "latency-train-alone", [("train", "alone", "train", "", train(12, 500.0))])
    group(results, "latency-decode-fracgpu-alone", [("inf", "0.25", "decode", "latency", decode(13, 2.05, 4.0, 4.2))],
          fracgpu=True)
    group(results, "latency-native-2", [("inf", "pair", "decode", "", decode(14, 900.0, 2000.0, 2000.0, 6, 4, 994)),
                                        ("train", "pair", "train", "", train(15, 499.0))])
    d = group(results, "latency-fracgpu-normal", [("inf", "0.25", "decode", "", decode(16, 2.2, 40.0, 60.0)),
                                                  ("train", "0.75", "train", "", train(17, 350.0))], fracgpu=True)
    write_meter(d, "inf", 16, 0.2)
    if skip_latency:
        (results / "latency-skipped.txt").write_text("this fracgpud refuses a tenant's priority: made up\n")
    else:
        group(results, "latency-fracgpu-latency",
              [("inf", "0.25", "decode", "latency", None if failed else decode(18, 2.08, 5.2, 6.0)),
               ("train", "0.75", "train", "", train(19, 380.0))], fracgpu=True)


def run_report(work: Path, name: str, **kw) -> tuple[int, str]:
    results = work / name
    shutil.rmtree(results, ignore_errors=True)
    results.mkdir(parents=True)
    full_set(results, **kw)
    p = subprocess.run([sys.executable, str(WORKLOAD), "report", str(results)], capture_output=True, text=True)
    table = (results / "latency_table.md").read_text() if (results / "latency_table.md").exists() else ""
    return p.returncode, table + p.stderr


def main() -> int:
    work = Path(sys.argv[1])
    failures = []

    def expect(name: str, rc: int, texts: list[str], **kw) -> None:
        got, table = run_report(work, name, **kw)
        missing = [t for t in texts if t not in table]
        if got != rc or missing:
            failures.append(f"{name}: exit {got} (expected {rc}); missing {missing}\n{table}")

    expect("pass", 0, [
        "p50 <= 2.10 ms, p99 <= 5.30 ms",
        "| - | decode alone, native | 2.00 | 3.00 | 3.50 | 1000 | 0.150 |  |  |  |  |  |",
        # 1000 requests x 1.5 ms alone over 10 s, no meter; met both.
        "| - | decode alone, fracgpu: inf 0.25 latency | 2.05 | 4.00 | 4.20 | 1000 | 0.150 |  |  |  | yes | yes |",
        "| b (1000 in flight) | both, native (2 processes) | 900.00 | 2000.00 | 2000.00 | 6 (4 late, 994 missed) "
        "| 0.001 | 0.998 | 0.999 | 499.0 | no | no |",
        # the meter's 0.2 of the window, not 1000 x 1.5 ms; training 350/500 = 0.7 of 0.8 left.
        "| b (1000 in flight) | both, fracgpu: inf 0.25 normal, train 0.75 normal | 2.20 | 40.00 | 60.00 | 1000 "
        "| 0.200 | 0.700 | 0.875 | 350.0 | no | no |",
        "| b (1000 in flight) | both, fracgpu: inf 0.25 latency, train 0.75 normal | 2.08 | 5.20 | 6.00 | 1000 "
        "| 0.150 | 0.760 | 0.894 | 380.0 | yes | yes |",
    ])
    expect("skipped", 0, ["Not measured: the run with priority = \"latency\" (this fracgpud refuses a tenant's "
                          "priority: made up)."], skip_latency=True)
    expect("failed", 1, ["| FAILED both, fracgpu: inf 0.25 latency, train 0.75 normal |", "1 run(s) FAILED"],
           failed=True)

    # The arrivals: the same for the same seed, k x period within the jitter.
    a = latency_workload.arrivals_ns(1, 10_000_000, 1_000_000, 1_000_000_000)
    if a != latency_workload.arrivals_ns(1, 10_000_000, 1_000_000, 1_000_000_000):
        failures.append("arrivals: two draws with seed 1 differ")
    if len(a) not in (100, 101) or any(abs(t - k * 10_000_000) > 1_000_000 and t != 0 for k, t in enumerate(a)):
        failures.append(f"arrivals: {len(a)} in 1 s, or one outside k x 10 ms +- 1 ms: {a[:5]}...")
    if a == latency_workload.arrivals_ns(2, 10_000_000, 1_000_000, 1_000_000_000):
        failures.append("arrivals: seeds 1 and 2 draw the same")
    if len({t % 10_000_000 for t in a[1:]}) < 50:
        failures.append("arrivals: the jitter hardly varies")
    # The first value of the sequence, as e2e_workload.cpp's splitmix64 gives it for seed 1.
    if latency_workload.splitmix64(1)[1] != 0x910A2DEC89025CC1:
        failures.append(f"splitmix64(1) = {latency_workload.splitmix64(1)[1]:#x}, not 0x910a2dec89025cc1")
    values = list(range(1, 1001))
    got = [latency_workload.percentile(values, p) for p in (0.5, 0.99, 0.999)]
    if got != [500, 990, 999] or latency_workload.percentile([7], 0.999) != 7:
        failures.append(f"nearest-rank percentiles of 1..1000: {got}, expected [500, 990, 999]")

    for f in failures:
        print(f"FAIL {f}", file=sys.stderr)
    print("latency_report_test: " + ("ok" if not failures else f"{len(failures)} failure(s)"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
