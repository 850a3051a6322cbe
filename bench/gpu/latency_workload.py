#!/usr/bin/env python3
"""Inference beside training on a real GPU (issue 24, latency tenants): the
workloads and the report of `tests/gpu/run_sm_share.sh latency`
(docs/performance.md, "Inference beside training (latency tenants)"). The
simulated-driver version is bench/e2e/run_e2e.sh --only latency; this one
prints its table in the same shape.

  latency_workload.py decode --seconds S (--start-ns NS | --start-file F) [--ready-file F]
                             [--batch 4] [--hidden 4096] [--layers 4] [--steps 16]
                             [--period-ms 10] [--jitter-ms 1] [--seed 1] [--latency-file F]
      A decode-like service: requests arrive at k x period + uniform(-jitter,
      +jitter) from the start (independent per request, from the seed: the
      same arrivals in every run); each runs `steps` decode steps of `layers`
      fp16 matmuls [batch, hidden] x [hidden, hidden] (a small batch: the
      weights are read once per step, as in a language model's decode) from
      one thread. A request's latency: CLOCK_MONOTONIC from before its first
      launch to after the synchronize on a CUDA event recorded after its last
      kernel. A request whose arrival has passed when the one before ends
      starts at once (late; its latency still counts from its first launch);
      none starts after the window (missed). Prints one JSON line: requests,
      late, missed, p50_ms, p99_ms, p999_ms, max_ms (nearest rank), and the
      GPU time of one request alone (CUDA events around a warm-up request).
  latency_workload.py train --seconds S (--start-ns NS | --start-file F) [--ready-file F]
                            [--size 8192] [--inflight 1000]
      A training loop's matmuls (fp16 size x size, the output fed back),
      `inflight` iterations kept queued ahead as PyTorch lets a loop run ahead
      of the GPU: before launching iteration i it waits for the CUDA event
      recorded after iteration i - inflight. Prints one JSON line:
      iterations (completed in the window), seconds, rate.
  latency_workload.py report RESULTS_DIR
      The table of run_sm_share.sh latency's results directory (groups
      latency-*: see run_sm_share.sh): per run the decode's p50/p99/p99.9
      request latency, its requests, each tenant's GPU time, the training's
      fraction of the time the decode leaves and its iterations/s, and the
      issue's targets (from the decode alone without fracgpu: p50 <= 1.05 x,
      p99 <= 1.10 x + 2 ms) and whether each is met. Exit 1 if a run failed
      (a missed target does not count: these are figures).

GPU time on a real GPU, without trusting fracgpu: the decode's from the CUPTI
meter (cupti-inf.PID.json, when run_sm_share.sh injected it), else its
requests x one request's GPU time alone (a lower bound where neighbours slow
its kernels); the training's is its throughput against the training alone
(fracgpu gives the GPU to one tenant at a time, so an iteration costs the same
GPU time shared or alone; without fracgpu the driver's time-slicing makes it
an estimate).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "e2e"))
from e2e import latency_targets, markdown_table  # noqa: E402  (the simulated version's targets and table)

MASK64 = (1 << 64) - 1


def now_ns() -> int:
    # CLOCK_MONOTONIC explicitly: the runner and every tenant compare the same clock.
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def splitmix64(state: int) -> tuple[int, int]:
    """(new state, next value): the sequence e2e_workload's inference uses,
    so the arrivals are the same on both for the same seed."""
    state = (state + 0x9E3779B97F4A7C15) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)


def arrivals_ns(seed: int, period_ns: int, jitter_ns: int, window_ns: int) -> list[int]:
    """Arrival offsets from the start of every request in the window
    (k x period + uniform[-jitter, +jitter], clamped at 0)."""
    out, state, k = [], seed, 0
    while True:
        jitter = 0
        if jitter_ns:
            state, z = splitmix64(state)
            jitter = z % (2 * jitter_ns + 1) - jitter_ns
        offset = max(0, k * period_ns + jitter)
        if offset >= window_ns:
            return out
        out.append(offset)
        k += 1


def percentile(sorted_values: list[float], p: float) -> float | None:
    """Nearest rank: the smallest value with at least p of them at or below it."""
    if not sorted_values:
        return None
    rank = min(max(math.ceil(p * len(sorted_values)), 1), len(sorted_values))
    return sorted_values[rank - 1]


def latency_summary(latencies_ms: list[float]) -> dict:
    s = sorted(latencies_ms)
    return {"p50_ms": percentile(s, 0.50), "p99_ms": percentile(s, 0.99), "p999_ms": percentile(s, 0.999),
            "max_ms": s[-1] if s else None}


def wait_for_start(args) -> int:
    """The common start: given, or read from --start-file once the runner has
    seen every tenant ready (it writes the file atomically)."""
    if args.start_ns is not None:
        return args.start_ns
    while True:
        try:
            text = Path(args.start_file).read_text().strip()
            if text:
                return int(text)
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.005)


def sleep_until(ns: int) -> None:
    # Sleep to 2 ms before, then spin: arrivals land within ~0.1 ms.
    while (left := ns - now_ns()) > 2_000_000:
        time.sleep((left - 2_000_000) / 1e9)
    while now_ns() < ns:
        pass


def ready(args) -> None:
    if args.ready_file:
        Path(args.ready_file).write_text(f"{os.getpid()}\n")


def common(torch) -> dict:
    return {"pid": os.getpid(), "tenant": os.environ.get("FRACGPU_TENANT"),
            "under_fracgpu": "libfracgpu" in os.environ.get("LD_PRELOAD", ""),
            "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}


def decode(args) -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit("torch.cuda.is_available() is False: no CUDA device for the workload")
    f16 = torch.float16
    weights = [torch.randn(args.hidden, args.hidden, device="cuda", dtype=f16) / math.sqrt(args.hidden)
               for _ in range(args.layers)]
    # Two activation buffers, each step's output feeding the next: no
    # allocation in the loop, and no kernel can be skipped.
    x = [torch.randn(args.batch, args.hidden, device="cuda", dtype=f16),
         torch.empty(args.batch, args.hidden, device="cuda", dtype=f16)]
    done = torch.cuda.Event()
    begin_t, end_t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def request() -> None:
        for _ in range(args.steps):
            for w in weights:
                torch.matmul(x[0], w, out=x[1])
                x.reverse()
        done.record()
        done.synchronize()

    # Warm-up (cuBLAS handle and kernel selection), then one request timed
    # on the GPU alone: the cost the report multiplies by the requests.
    for _ in range(3):
        request()
    begin_t.record()
    request()
    end_t.record()
    end_t.synchronize()
    request_gpu_ms = begin_t.elapsed_time(end_t)
    ready(args)

    start = wait_for_start(args)
    window = int(args.seconds * 1e9)
    arrivals = arrivals_ns(args.seed, int(args.period_ms * 1e6), int(args.jitter_ms * 1e6), window)
    sleep_until(start)
    end = start + window
    latencies, late, missed = [], 0, 0
    for k, offset in enumerate(arrivals):
        at = start + offset
        now = now_ns()
        if now >= end:
            missed += 1
            continue
        if now < at:
            sleep_until(at)
        elif k:
            late += 1
        t0 = now_ns()
        request()
        latencies.append((now_ns() - t0) / 1e6)
    if args.latency_file:
        Path(args.latency_file).write_text("".join(f"{v:.4f}\n" for v in latencies))
    print(json.dumps({**common(torch), "workload": "decode", "batch": args.batch, "hidden": args.hidden,
                      "layers": args.layers, "steps": args.steps, "period_ms": args.period_ms,
                      "jitter_ms": args.jitter_ms, "seconds": args.seconds, "requests": len(latencies),
                      "late": late, "missed": missed, "request_gpu_ms_alone": request_gpu_ms,
                      **latency_summary(latencies)}))


def train(args) -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit("torch.cuda.is_available() is False: no CUDA device for the workload")
    f16 = torch.float16
    a = torch.randn(args.size, args.size, device="cuda", dtype=f16) / math.sqrt(args.size)
    b = torch.randn(args.size, args.size, device="cuda", dtype=f16)
    c = torch.empty(args.size, args.size, device="cuda", dtype=f16)
    ring = [torch.cuda.Event() for _ in range(args.inflight)]
    for _ in range(3):
        torch.matmul(a, b, out=c)
        b, c = c, b
    torch.cuda.synchronize()
    ready(args)

    start = wait_for_start(args)
    sleep_until(start)
    end = start + int(args.seconds * 1e9)
    launched = completed = 0
    while now_ns() < end:
        slot = ring[launched % args.inflight]
        if launched >= args.inflight:
            slot.synchronize()  # iteration launched - inflight is done
            completed += 1
        torch.matmul(a, b, out=c)
        b, c = c, b
        slot.record()
        launched += 1
    stopped = now_ns()
    # Iterations still in the ring that completed in the window count too.
    for i in range(max(0, launched - args.inflight), launched):
        if not ring[i % args.inflight].query():
            break  # in stream order: the later ones are not done either
        completed += 1
    torch.cuda.synchronize()  # nothing of ours left on the GPU for the next run
    seconds = (stopped - start) / 1e9
    print(json.dumps({**common(torch), "workload": "train", "size": args.size, "inflight": args.inflight,
                      "iterations": completed, "seconds": seconds, "rate": completed / seconds}))


# ---------------------------------------------------------------------------
# report

# The runs of run_sm_share.sh latency, in its order: group name -> label.
GROUPS = {
    "latency-decode-alone": "decode alone, native",
    "latency-train-alone": "training alone, native",
    "latency-decode-fracgpu-alone": "decode alone, fracgpu",
    "latency-native-2": "both, native (2 processes)",
    "latency-fracgpu-normal": "both, fracgpu",
    "latency-fracgpu-latency": "both, fracgpu",
}


def load_json(path: Path) -> dict | None:
    try:
        text = path.read_text().strip().splitlines()
        return json.loads(text[-1]) if text else None
    except (OSError, ValueError):
        return None


def meter_busy_s(group: Path, tenant: str, pid, start_ns: int | None, seconds: float) -> float | None:
    """The CUPTI meter's GPU time of one process over the window, if it ran."""
    if start_ns is None or pid is None:
        return None
    sys.path.insert(0, str(HERE))
    import nvml_cupti

    meter = nvml_cupti.find_meter(group, f"cupti-{tenant}", pid)
    return nvml_cupti.meter_busy_s(meter, start_ns, start_ns + int(seconds * 1e9)) if meter else None


def read_group(results: Path, name: str) -> dict | None:
    d = results / name
    if not d.is_dir():
        return None
    tenants = {}
    for line in (d / "tenants.tsv").read_text().splitlines() if (d / "tenants.tsv").exists() else []:
        tenant, share, kind, priority = (line.split("\t") + ["", "", "", ""])[:4]
        tenants[tenant] = {"share": share, "kind": kind, "priority": priority,
                           "result": load_json(d / f"{tenant}.json")}
    try:
        start_ns = int((d / "start").read_text().strip())
    except (OSError, ValueError):
        start_ns = None
    return {"name": name, "dir": d, "tenants": tenants, "start_ns": start_ns,
            "fracgpu": (d / "fracgpud.log").exists()}


def fmt(x, spec=".3f") -> str:
    return "" if x is None else format(x, spec)


def report(results: Path) -> int:
    groups = {name: g for name in GROUPS if (g := read_group(results, name)) is not None}
    if not groups:
        print(f"latency_workload.py: no latency-* groups under {results}", file=sys.stderr)
        return 2
    alone = groups.get("latency-decode-alone")
    alone_result = alone["tenants"].get("inf", {}).get("result") if alone else None
    p50_target, p99_target = latency_targets(alone_result)
    train_alone = groups.get("latency-train-alone")
    train_alone_result = train_alone["tenants"].get("train", {}).get("result") if train_alone else None
    train_ref = train_alone_result.get("rate") if train_alone_result else None
    rows, failed = [], 0
    for name, g in groups.items():
        inf, tr = g["tenants"].get("inf"), g["tenants"].get("train")
        ok = all(t["result"] is not None for t in g["tenants"].values()) and bool(g["tenants"])
        failed += not ok
        label = GROUPS[name]
        if g["fracgpu"]:
            label += ": " + ", ".join(f"{t} {v['share']} {v['priority'] or 'normal'}" for t, v in g["tenants"].items())
        r = inf["result"] if inf and inf["result"] else {}
        t = tr["result"] if tr and tr["result"] else {}
        seconds = r.get("seconds") or t.get("seconds")
        inf_share = None
        if r and seconds:
            busy = meter_busy_s(g["dir"], "inf", r.get("pid"), g["start_ns"], seconds)
            if busy is None and r.get("request_gpu_ms_alone") is not None:
                busy = r["requests"] * r["request_gpu_ms_alone"] / 1e3
            inf_share = busy / seconds if busy is not None else None
        train_share = t["rate"] / train_ref if t and train_ref else None
        left = train_share / (1 - inf_share) if train_share is not None and inf_share is not None and inf_share < 1 \
            else None
        met = []
        for key, target in (("p50_ms", p50_target), ("p99_ms", p99_target)):
            if target is None or not r or r.get(key) is None or name == "latency-decode-alone":
                met.append("")
            else:
                met.append("yes" if r[key] <= target else "no")
        requests = ""
        if r:
            requests = str(r["requests"])
            if r.get("late") or r.get("missed"):
                requests += f" ({r['late']} late, {r['missed']} missed)"
        shape = "-"
        if t:
            shape = "a" if t.get("inflight") == 1 else f"b ({t.get('inflight')} in flight)"
        rows.append([shape, ("" if ok else "FAILED ") + label, fmt(r.get("p50_ms"), ".2f"),
                     fmt(r.get("p99_ms"), ".2f"), fmt(r.get("p999_ms"), ".2f"), requests, fmt(inf_share),
                     fmt(train_share), fmt(left), fmt(t.get("rate"), ".1f") if t else "", *met])
    text = markdown_table(
        ["training shape", "run", "decode p50 (ms)", "p99 (ms)", "p99.9 (ms)", "requests", "decode GPU time",
         "training GPU time", "training / time decode leaves", "training iterations/s", "p50 target met",
         "p99 target met"], rows)
    notes = []
    if p50_target is not None:
        notes.append(f"Targets from the decode alone without fracgpu (p50 {alone_result['p50_ms']:.2f} ms, "
                     f"p99 {alone_result['p99_ms']:.2f} ms): p50 <= {p50_target:.2f} ms, p99 <= {p99_target:.2f} ms.")
    else:
        notes.append("No targets: the decode alone without fracgpu did not run or failed.")
    notes.append("Shapes: a = the training synchronizes every iteration; b = it keeps iterations queued ahead "
                 "(--inflight). GPU time: the decode's from "
                 "the CUPTI meter where it ran, else requests x one request's GPU time alone; the training's: its "
                 "iterations/s against the training alone.")
    skipped = results / "latency-skipped.txt"
    if skipped.exists():
        notes.append(f"Not measured: the run with priority = \"latency\" ({skipped.read_text().strip()}).")
    print(text + "\n\n" + "\n".join(notes))
    (results / "latency_table.md").write_text(text + "\n\n" + "\n".join(notes) + "\n")
    if failed:
        print(f"\n{failed} run(s) FAILED: see {results}/latency-*/*.err", file=sys.stderr)
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("decode", "train"):
        p = sub.add_parser(name)
        p.add_argument("--seconds", type=float, required=True)
        start = p.add_mutually_exclusive_group(required=True)
        start.add_argument("--start-ns", type=int)
        start.add_argument("--start-file")
        p.add_argument("--ready-file")
        if name == "decode":
            p.add_argument("--batch", type=int, default=4)
            p.add_argument("--hidden", type=int, default=4096)
            p.add_argument("--layers", type=int, default=4)
            p.add_argument("--steps", type=int, default=16)
            p.add_argument("--period-ms", type=float, default=10.0)
            p.add_argument("--jitter-ms", type=float, default=1.0)
            p.add_argument("--seed", type=int, default=1)
            p.add_argument("--latency-file")
        else:
            p.add_argument("--size", type=int, default=8192)
            p.add_argument("--inflight", type=int, default=1000)
    r = sub.add_parser("report")
    r.add_argument("results")
    args = ap.parse_args()
    if args.cmd == "decode":
        decode(args)
        return 0
    if args.cmd == "train":
        if args.inflight < 1:
            ap.error("--inflight must be 1 or more")
        train(args)
        return 0
    return report(Path(args.results))


if __name__ == "__main__":
    sys.exit(main())
