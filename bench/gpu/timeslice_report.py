#!/usr/bin/env python3
"""The GPU's time slice and context-switch gap, from timeslice_probe logs.

    timeslice_report.py LOG [LOG ...] [--json OUT]
    timeslice_report.py --self-test

Each LOG is one timeslice_probe's JSON line (processes that spun at the same
time). A probe's residency is the time between its gaps; lined up on the GPU's
global clock (one clock for every context), the residencies of all probes in
the window where all of them spun give:
  slice   how long a context keeps the GPU while another has work (the median
          of the interior residencies: the first and last are cut by the window)
  switch  the gap between one context's residency ending and the next one's
          starting (nobody's residency covers it)
  turns   the fraction of consecutive residencies that belong to different
          processes (1.0: strict alternation)
and prints the simulated driver's settings that match (SIMCUDA_TIMESLICE_US,
SIMCUDA_SWITCH_US). --self-test builds logs from the simulated driver's model
(with a global clock that ticks in 1 us, and jitter) and checks that the
report recovers its settings. Exit 0; 1 when the logs cannot tell (too few
residencies in the shared window); 64 on bad input.
"""
import argparse
import json
import random
import statistics
import sys


def runs_of(log):
    """[(start, end)] residencies of one probe: between its gaps."""
    edges = [log["start_ns"]]
    for a, b in log["gaps"]:
        edges.extend([a, b])
    edges.append(log["end_ns"])
    return [(edges[i], edges[i + 1]) for i in range(0, len(edges), 2) if edges[i + 1] > edges[i]]


def quantile(xs, q):
    xs = sorted(xs)
    if not xs:
        return None
    i = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[i]


def analyse(logs):
    if len(logs) < 2:
        raise ValueError("needs the logs of at least two probes that spun at once")
    lo = max(l["start_ns"] for l in logs)
    hi = min(l["end_ns"] for l in logs)
    if hi <= lo:
        raise ValueError("the probes did not spin at the same time")
    timeline = []
    for l in logs:
        for a, b in runs_of(l):
            if b <= lo or a >= hi:
                continue
            timeline.append((max(a, lo), min(b, hi), l["pid"], a < lo or b > hi))
    timeline.sort()
    # Interior residencies: neither cut by the shared window nor the first or
    # last of the window (those are cut too).
    inner = [r for r in timeline[1:-1] if not r[3]]
    slices = [b - a for a, b, _, _ in inner]
    switches, turns = [], 0
    for prev, cur in zip(timeline, timeline[1:]):
        if prev[2] != cur[2]:
            turns += 1
            switches.append(max(0, cur[0] - prev[1]))
    if len(slices) < 10 or len(switches) < 10:
        raise ValueError(f"too few residencies in the shared window ({len(slices)} slices, {len(switches)} switches)")
    window = hi - lo
    resident = {}
    for a, b, pid, _ in timeline:
        resident[pid] = resident.get(pid, 0) + (b - a)
    return {
        "probes": len(logs),
        "window_ns": window,
        "slice_ns": {"p10": quantile(slices, 0.1), "p50": statistics.median(slices), "p90": quantile(slices, 0.9),
                     "n": len(slices)},
        "switch_ns": {"p10": quantile(switches, 0.1), "p50": statistics.median(switches),
                      "p90": quantile(switches, 0.9), "n": len(switches)},
        "turns": turns / max(1, len(timeline) - 1),
        "resident_share": {str(pid): ns / window for pid, ns in sorted(resident.items())},
        "busy": sum(resident.values()) / window,
        "overflow": any(l.get("overflow") for l in logs),
    }


def simulate(processes, slice_ns, switch_ns, seconds, tick_ns=1000, jitter_ns=300, seed=1):
    """Probe logs of `processes` spinning at once on the simulated driver's
    time-slice model (round robin, slice_ns turns, switch_ns between), their
    start staggered, read through a global clock that ticks every tick_ns."""
    rnd = random.Random(seed)
    t0 = 10_000_000_000
    starts = [t0 + i * 3_000_000 for i in range(processes)]
    ends = [s + int(seconds * 1e9) for s in starts]
    residency = {i: [] for i in range(processes)}
    t, cur = starts[0], 0
    while t < max(ends):
        active = [i for i in range(processes) if starts[i] <= t < ends[i]]
        if not active:
            t = min(s for s in starts if s > t)
            continue
        if cur not in active:
            cur = active[0]
        others = [i for i in active if i != cur]
        if others:
            end = min(t + slice_ns + rnd.randint(-jitter_ns, jitter_ns), ends[cur])
        else:  # alone until its end or the next probe's start (then a fresh slice)
            end = min([ends[cur]] + [s for s in starts if s > t])
        if residency[cur] and residency[cur][-1][1] == t:
            t = residency[cur].pop()[0]  # still resident: one residency
        residency[cur].append((t, end))
        t = end
        if others:
            later = [i for i in others if i > cur]
            cur = later[0] if later else others[0]
            t += switch_ns + rnd.randint(0, jitter_ns)
    tick = lambda x: x // tick_ns * tick_ns  # noqa: E731
    logs = []
    for i in range(processes):
        runs = residency[i]
        gaps = [[tick(a[1]), tick(b[0])] for a, b in zip(runs, runs[1:]) if b[0] - a[1] > 3000]
        logs.append({"pid": 1000 + i, "start_ns": tick(starts[i]), "end_ns": tick(ends[i]), "gap_ns": 3000,
                     "overflow": False, "gaps": gaps})
    return logs


def self_test():
    failures = 0
    for processes, slice_ns, switch_ns in [(2, 1_024_000, 40_000), (3, 1_024_000, 90_000), (2, 2_048_000, 25_000)]:
        r = analyse(simulate(processes, slice_ns, switch_ns, seconds=0.5))
        got_slice, got_switch = r["slice_ns"]["p50"], r["switch_ns"]["p50"]
        ok = abs(got_slice - slice_ns) <= 2000 and abs(got_switch - switch_ns) <= 2000 and r["turns"] > 0.99
        print(f"{processes} probes, slice {slice_ns} ns, switch {switch_ns} ns: found slice {got_slice:.0f}, "
              f"switch {got_switch:.0f}, turns {r['turns']:.3f}: {'ok' if ok else 'WRONG'}")
        failures += not ok
    # One probe alone is not a measurement.
    try:
        analyse(simulate(1, 1_024_000, 40_000, seconds=0.5))
        print("a single probe was accepted: WRONG")
        failures += 1
    except ValueError as e:
        print(f"a single probe is refused: {e}")
    return 1 if failures else 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="*")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--self-test", action="store_true")
    a = p.parse_args()
    if a.self_test:
        return self_test()
    if not a.logs:
        p.print_usage(sys.stderr)
        return 64
    logs = []
    for path in a.logs:
        try:
            with open(path) as f:
                line = next((x for x in f if x.startswith("{")), None)
            if line is None:
                raise ValueError("no JSON line")
            logs.append(json.loads(line))
        except (OSError, ValueError) as e:
            print(f"timeslice_report.py: {path}: {e}", file=sys.stderr)
            return 64
    try:
        r = analyse(logs)
    except ValueError as e:
        print(f"timeslice_report.py: {e}", file=sys.stderr)
        return 1
    s, w = r["slice_ns"], r["switch_ns"]
    print(f"{r['probes']} probes over {r['window_ns'] / 1e6:.1f} ms: slice p50 {s['p50'] / 1e3:.1f} us "
          f"(p10 {s['p10'] / 1e3:.1f}, p90 {s['p90'] / 1e3:.1f}, {s['n']} residencies); switch gap p50 "
          f"{w['p50'] / 1e3:.1f} us (p10 {w['p10'] / 1e3:.1f}, p90 {w['p90'] / 1e3:.1f}); turns {r['turns']:.3f}; "
          f"GPU resident {r['busy']:.3f} of the window" + ("; a probe's gap buffer overflowed" if r["overflow"] else ""))
    print(f"simulated driver: SIMCUDA_TIMESLICE_US={round(s['p50'] / 1e3)} SIMCUDA_SWITCH_US={round(w['p50'] / 1e3)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
