#!/usr/bin/env python3
"""CI check of bench/e2e/latency_model.py (CTest bench_latency_model): the
model reproduces what its docs rest on. Without hand-over costs, running
every training kernel leaves the training all the GPU the bursts leave and
makes the median burst wait half a kernel; hand-over costs take from the
training; refused kernels shorten the wait and cost the training; and the
clairvoyant bound leaves the training more than the grid-aware policy does,
both within the median's target.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import latency_model as m  # noqa: E402

failures = []


def check(what, ok):
    if not ok:
        failures.append(what)
    print(("ok   " if ok else "FAIL ") + what)


p50, p99, share = m.simulate("work-conserving", 0, 0, 0, bursts=5000)
check(f"work-conserving, no costs: training {share:.3f} of the leftover is all of it", abs(share - 1) < 0.005)
check(f"work-conserving, no costs: median wait {p50:.3f} ms is about half a kernel",
      abs(p50 - m.KERNEL / 2) < 0.15)
check(f"work-conserving, no costs: p99 wait {p99:.3f} ms is under one kernel", p99 <= m.KERNEL)

_, _, costly = m.simulate("work-conserving", 0, 0.05, 0.17, bursts=5000)
check(f"hand-over costs take from the training ({costly:.3f} < {share:.3f})", costly < share)

g50, _, gshare = m.simulate("grid-aware", 0.65, 0, 0, bursts=5000)
check(f"grid-aware: a shorter median ({g50:.3f} < {p50:.3f} ms) for less training ({gshare:.3f})",
      g50 < p50 / 4 and gshare < share)

c50, _, cshare = m.simulate("clairvoyant", 0.95, 0, 0, bursts=5000)
check(f"clairvoyant ({c50:.3f} ms, {cshare:.3f}) does better than grid-aware for the training",
      c50 <= m.ALONE_P50 * 0.05 and cshare > gshare)

sys.exit(1 if failures else 0)
