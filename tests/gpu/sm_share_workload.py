#!/usr/bin/env python3
"""Workload and helpers for tests/gpu/run_sm_share.sh, the real-GPU check of
GPU-time shares (docs/sm-time.md).

  sm_share_workload.py run --seconds S (--start-ns NS | --start-file F) [--ready-file F]
                           [--kind matmul|mixed|step10|step50] [--size N] [--sync-every K]
      Saturate CUDA device 0 with PyTorch for S seconds from a common start
      time (CLOCK_MONOTONIC, in ns) and print one JSON line.
  sm_share_workload.py accounting --uuid GPU-... [PID ...]
      NVML per-process accounting of processes that have ended, as JSON
      (with no PID: only whether accounting can be read at all).
  sm_share_workload.py report RESULTS_DIR [--threshold 0.05]
      The Markdown tables for run_sm_share.sh's results directory; exit 1 if
      any tenant's measured share is off by more than the threshold. Groups
      with an nvml_sampler log add NVML's estimates against the CUPTI meter
      (bench/gpu/nvml_cupti.py); those figures leave the exit status alone.
  sm_share_workload.py calibration RESULTS_DIR
      The tables of run_sm_share.sh calibrate: per phase (one process alone,
      two without fracgpu, two tenants at 0.25/0.75) each process's known GPU
      time, CUPTI's and NVML's estimate, NVML's sampling figures, the summary
      lines to paste into docs/gpu-results.md and the suggested
      SIMNVML_SAMPLE_MS / SIMNVML_ATTRIB. Exit 1 if a phase failed or its
      sampler gave no summary.

How a tenant's share of GPU time is measured without trusting fracgpu:

- NVML accounting (when pynvml is installed and the GPU's accounting mode is
  on, which takes root: nvidia-smi -i 0 -am 1). For each process the driver
  records the percentage of its lifetime during which one or more of its
  kernels ran, and that lifetime. Busy time = percentage x lifetime; the share
  is busy time over the workload's measured window. The driver reports the
  lifetime only once the process has ended (it reads 0 while it runs), so the
  runner asks after the tenants exit (`accounting`), not the workload itself.
  Busy time outside the window (the warm-up: a few kernels) is negligible; the
  integer percentage costs up to about 1.5 points over a 20 s window.
- Throughput against the same workload alone on the GPU (always reported).
  fracgpu gives the GPU to one process at a time, so each kernel takes the
  same GPU time whoever else is on the GPU, and iterations/s shared over
  iterations/s alone is the fraction of the time the tenant held the GPU.
  Hand-over costs (drain, context switch) count against the tenant, so the
  shares of one split add up to a little under 1.

The workload is "saturating": it keeps the GPU's queue full (it synchronizes
only every --sync-every iterations), so the GPU is busy whenever the tenant
holds it and both measures read the time fracgpu charges. The baseline runs
alone report NVML's busy fraction; below ~0.95 the workload does not saturate
this GPU and the NVML shares read low (raise --size).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def nvml_cupti():
    """bench/gpu/nvml_cupti.py (the NVML-against-CUPTI analysis), imported on use."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent / "bench" / "gpu"))
    import nvml_cupti as module

    return module


def now_ns() -> int:
    # CLOCK_MONOTONIC explicitly: the runner and every tenant compare the same clock.
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


# ---------------------------------------------------------------------------
# run: the workload


def make_step(torch, kind: str, size: int):
    """One iteration's kernel launches. Buffers are allocated once (out=) so the
    loop launches kernels and nothing else: no allocator traffic, no host work
    that would leave the GPU idle while the tenant holds it."""
    if kind.startswith("step"):
        return make_launch_bound_step(torch, int(kind[len("step"):]))
    f16 = torch.float16  # tensor cores on every GPU since Volta
    a = torch.randn(size, size, device="cuda", dtype=f16)
    b = torch.randn(size, size, device="cuda", dtype=f16)
    c = torch.empty(size, size, device="cuda", dtype=f16)
    if kind == "matmul":

        def step():
            torch.matmul(a, b, out=c)

        return step
    # mixed: one large kernel then 16 small ones, so fracgpu's slices end in
    # either kind (what the simulated tests vary with 50 us vs 50 ms kernels).
    # The large matmul gives the CPU time to queue the small ones, so the queue
    # stays full.
    small = max(size // 4, 256)
    sa = torch.randn(small, small, device="cuda", dtype=f16)
    sb = torch.randn(small, small, device="cuda", dtype=f16)
    sc = torch.empty(small, small, device="cuda", dtype=f16)

    def step():
        torch.matmul(a, b, out=c)
        for _ in range(16):
            torch.matmul(sa, sb, out=sc)

    return step


def make_launch_bound_step(torch, kernel_us: int):
    """stepN: an interactive loop (inference, a notebook): one kernel of about N
    us (torch.cuda._sleep, calibrated here), then 1.2 N us of host work (a
    busy spin, as a Python loop is): the GPU waits for the CPU, nothing is
    queued ahead. Alone such a tenant keeps the GPU about 0.75 busy; the
    check is whether two of them at 0.5 keep it busy together (docs/sm-time.md,
    measured mode)."""
    # Cycles per microsecond: time a long sleep kernel with events.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    cycles = max(1, int(10_000_000 / (start.elapsed_time(end) * 1000) * kernel_us))
    host_ns = kernel_us * 1200

    def step():
        torch.cuda._sleep(cycles)
        until = now_ns() + host_ns
        while now_ns() < until:
            pass

    return step


def wait_for_start(args) -> int:
    """The common start time: given, or read from --start-file once the runner
    has seen every tenant ready (it writes the file atomically)."""
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


def run(args) -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit("torch.cuda.is_available() is False: no CUDA device for the workload")
    step = make_step(torch, args.kind, args.size)
    # Warm up outside the measured window: context creation, cuBLAS handle
    # and kernel selection, first allocations.
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    if args.ready_file:
        Path(args.ready_file).write_text(f"{os.getpid()}\n")

    start_ns = wait_for_start(args)
    # Sleep to 2 ms before the start, then spin: tenants start within ~0.1 ms.
    while (left := start_ns - now_ns()) > 2_000_000:
        time.sleep((left - 2_000_000) / 1e9)
    while now_ns() < start_ns:
        pass
    t0 = now_ns()
    late_s = (t0 - start_ns) / 1e9  # > 0 only if the warm-up ended after the start
    deadline = t0 + int(args.seconds * 1e9)
    iterations = 0
    longest_ns = 0
    prev = t0
    while True:
        for _ in range(args.sync_every):
            step()
        # Bounded queue: the window ends at most one batch after the deadline,
        # and only completed batches are counted.
        torch.cuda.synchronize()
        iterations += args.sync_every
        now = now_ns()
        longest_ns = max(longest_ns, now - prev)  # long batches = waits for the GPU
        prev = now
        if now >= deadline:
            break
    wall_s = (now - t0) / 1e9
    print(
        json.dumps(
            {
                "pid": os.getpid(),
                "tenant": os.environ.get("FRACGPU_TENANT"),
                "under_fracgpu": "libfracgpu" in os.environ.get("LD_PRELOAD", ""),
                "kind": args.kind,
                "size": args.size,
                "sync_every": args.sync_every,
                "gpu": torch.cuda.get_device_name(0),
                "torch": torch.__version__,
                "start_ns": start_ns,
                "late_start_s": round(late_s, 6),
                "iterations": iterations,
                "wall_s": wall_s,
                "per_s": iterations / wall_s,
                "longest_batch_s": longest_ns / 1e9,
                # Independent GPU time: NVML accounting, read by the runner once
                # this process has ended (`accounting`); throughput: per_s
                # against the same workload alone (`report`).
            }
        ),
        flush=True,
    )


# ---------------------------------------------------------------------------
# accounting: NVML per-process accounting


def nvml_handle(pynvml, uuid: str):
    try:
        return pynvml.nvmlDeviceGetHandleByUUID(uuid)
    except (TypeError, AttributeError):  # older nvidia-ml-py wants bytes
        return pynvml.nvmlDeviceGetHandleByUUID(uuid.encode())


def accounting(uuid: str, pids: list[int], settle_s: float = 5.0) -> dict:
    """{"state": "enabled"|"disabled"|"unavailable", "reason": ..., "pids": {...}}.
    Never raises: the throughput measure does not depend on it."""
    try:
        import pynvml
    except ImportError:
        return {"state": "unavailable", "reason": "pynvml is not installed (pip install nvidia-ml-py)"}
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError and friends
        return {"state": "unavailable", "reason": f"nvmlInit failed: {e}"}
    try:
        handle = nvml_handle(pynvml, uuid)
        if pynvml.nvmlDeviceGetAccountingMode(handle) != pynvml.NVML_FEATURE_ENABLED:
            return {
                "state": "disabled",
                "reason": f"accounting mode is off on {uuid}; as root: nvidia-smi -i {uuid} -am 1",
            }
        out = {}
        for pid in pids:
            # A process that just exited may still read as running for a moment,
            # and its time reads 0 until the driver has closed its record.
            deadline = time.monotonic() + settle_s
            while True:
                try:
                    s = pynvml.nvmlDeviceGetAccountingStats(handle, pid)
                except Exception as e:  # NVMLError_NotFound: no record for this pid
                    out[str(pid)] = {"error": str(e)}
                    break
                if not s.isRunning or time.monotonic() >= deadline:
                    out[str(pid)] = {
                        "gpu_utilization_pct": int(s.gpuUtilization),
                        "time_ms": int(s.time),
                        "is_running": bool(s.isRunning),
                        "busy_s": s.gpuUtilization / 100 * s.time / 1000,
                    }
                    break
                time.sleep(0.1)
        return {"state": "enabled", "reason": "", "pids": out}
    except Exception as e:  # NotSupported (e.g. MIG), NoPermission, ...
        return {"state": "unavailable", "reason": f"NVML accounting: {e}"}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


# ---------------------------------------------------------------------------
# report: the Markdown tables


def load_json(path: Path):
    """A file as JSON (fracgpu status: pretty-printed), else its last line as
    JSON (a workload's output), else None (missing, empty, not JSON)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    for candidate in (text, text.splitlines()[-1] if text else ""):
        try:
            return json.loads(candidate)
        except ValueError:
            pass
    return None


def nvml_busy_share(acct, result):
    """Busy time by NVML accounting over the measured window, or None."""
    if not acct or acct.get("state") != "enabled" or not result:
        return None
    rec = acct.get("pids", {}).get(str(result["pid"]))
    if not rec or "error" in rec or rec["is_running"] or rec["time_ms"] <= 0:
        return None
    return rec["busy_s"] / result["wall_s"]


def achieved_10s(status, tenant):
    """tenants[].gpus[0].gpu_time.achieved_10s_ppm as a fraction, or None when
    the status, the tenant, gpu_time or the field is missing."""
    for t in (status or {}).get("tenants", []):
        if t.get("name") == tenant and t.get("gpus"):
            ppm = (t["gpus"][0].get("gpu_time") or {}).get("achieved_10s_ppm")
            return None if ppm is None else ppm / 1e6
    return None


def tenant_limit(status, tenant):
    for t in (status or {}).get("tenants", []):
        if t.get("name") == tenant and t.get("gpus"):
            g = t["gpus"][0]
            return g.get("share_ppm"), g.get("limit_ppm")
    return None, None


def fmt(x, spec=".3f"):
    return "n/a" if x is None else format(x, spec)


def launch_bound_shape(members) -> str | None:
    """The launch-bound shape a group runs, or None: a pair of one step kind,
    four tenants of one, or the mixed pair (a step tenant beside matmul)."""
    kinds = sorted(kind for _, _, kind in members)
    if not any(k.startswith("step") for k in kinds):
        return None
    if len(set(kinds)) == 1:
        return kinds[0] if len(kinds) == 2 else f"{len(kinds)} x {kinds[0]}"
    steps = [k for k in kinds if k.startswith("step")]
    if len(kinds) == 2 and len(steps) == 1 and "matmul" in kinds:
        return f"mixed: {steps[0]} beside matmul"
    return "other"


def launch_bound_table(results: Path, groups: dict, group_files, notes: list) -> None:
    """Launch-bound shapes (--launch-bound): for each, the GPU's busy time (NVML
    accounting, summed over the processes) and each one's share of the GPU time
    used, the processes without fracgpu beside the tenants with it; for the
    mixed pair also the step tenant's iterations/s with against without. The
    issue's targets: busy with >= 0.95 x without (the mixed pair: busy >= 0.97,
    at most 0.963 at a 40 us context switch, docs/performance.md), the step
    tenant's steps >= 0.9 x without."""
    rows = {}
    for group, members in groups.items():
        shape = launch_bound_shape(members)
        if shape is None:
            continue
        acct, _ = group_files(group)
        results_of = [load_json(results / group / f"{tenant}.json") for tenant, _, _ in members]
        busy = [nvml_busy_share(acct, r) for r in results_of]
        steps = [r["per_s"] for r, (_, _, kind) in zip(results_of, members) if r and kind.startswith("step")]
        side = "without" if members[0][1] == "pair" else "with"
        rows.setdefault(shape, {})[side] = (busy, steps[0] if len(steps) == 1 else None)
    if not rows:
        return
    print("\n## Launch-bound shapes: GPU busy and shares of the GPU time used (NVML accounting)\n")
    print("| shape | GPU busy without fracgpu | GPU busy with | with / without | shares of used, without "
          "| shares of used, with | step tenant's steps, with / without |")
    print("|---|---|---|---|---|---|---|")
    for shape, sides in rows.items():
        cells, totals = [], []
        for side in ("without", "with"):
            b = sides.get(side, ([None], None))[0]
            ok = all(x is not None for x in b)
            totals.append(sum(b) if ok else None)
            cells.append(" / ".join(fmt(x / sum(b)) for x in b) if ok and sum(b) > 0 else "n/a")
        ratio = totals[1] / totals[0] if None not in totals and totals[0] > 0 else None
        steps = [sides.get(side, (None, None))[1] for side in ("without", "with")]
        step_ratio = steps[1] / steps[0] if None not in steps and steps[0] > 0 else None
        print(f"| {shape} | {fmt(totals[0])} | {fmt(totals[1])} | {fmt(ratio)} | {cells[0]} | {cells[1]} "
              f"| {fmt(step_ratio) if shape.startswith('mixed') else ''} |")
        if None in totals:
            notes.append(f"{shape}: launch-bound shapes need NVML accounting (nvidia-smi -i 0 -am 1)")


def read_manifest(results: Path) -> dict[str, list]:
    """manifest.tsv: group, tenant, share ("alone" / "pair" for runs without
    fracgpu), kind; groups in run order."""
    groups: dict[str, list] = {}
    for line in (results / "manifest.tsv").read_text().splitlines():
        if line:
            group, tenant, share, kind = line.split("\t")
            groups.setdefault(group, []).append((tenant, share, kind))
    return groups


def nvml_procs(results: Path, group: str, members: list, baseline: dict, known: str = "throughput") -> list[dict]:
    """Each member of a group as nvml_cupti.compare takes it: pid and measured
    window from its JSON, its CUPTI meter file, and the GPU time known without
    NVML: `throughput` = iterations/s over the same workload's alone rate x
    the window (fracgpu or the driver gives the GPU to one process at a time,
    so each kernel takes as long as alone); `cupti` = the meter's figure."""
    mod = nvml_cupti()
    d = results / group
    procs = []
    for tenant, share, kind in members:
        r = load_json(d / f"{tenant}.json") or {}
        lo = int(r["start_ns"] + r.get("late_start_s", 0) * 1e9) if "start_ns" in r else None
        hi = lo + int(r["wall_s"] * 1e9) if lo is not None and "wall_s" in r else None
        p = {"tenant": tenant, "share": share, "kind": kind, "pid": r.get("pid"), "lo_ns": lo, "hi_ns": hi,
             "meter": mod.find_meter(d, f"cupti-{tenant}", r.get("pid")), "known_s": None, "known_by": None,
             "result": r}
        if known == "throughput" and r and kind in baseline:
            p["known_s"], p["known_by"] = r["per_s"] / baseline[kind] * r["wall_s"], "throughput"
        procs.append(p)
    if known == "cupti":
        for p in procs:
            busy = mod.meter_busy_s(p["meter"], p["lo_ns"], p["hi_ns"]) if p["lo_ns"] and p["hi_ns"] else None
            p["known_s"], p["known_by"] = busy, "CUPTI" if busy is not None else None
    return procs


def nvml_section(results: Path, groups: dict, baseline: dict, notes: list) -> None:
    """NVML's estimates against the CUPTI meter, for the groups with a sampler log."""
    mod = nvml_cupti()
    comparisons, samplings = [], []
    for group, members in groups.items():
        d = results / group
        if not (d / "nvml-sampler.jsonl").exists():
            continue
        label = "/".join(share for _, share, _ in members)
        sampler = mod.read_sampler(d / "nvml-sampler.jsonl")
        rows, run_notes = mod.compare(nvml_procs(results, group, members, baseline), sampler)
        comparisons.append((label, rows))
        samplings.append((label, sampler))
        notes += [f"{label} (NVML/CUPTI, not counted): {n}" for n in run_notes]
    if not comparisons:
        return
    print("\n## NVML against the CUPTI meter (nvml_sampler every 2 ms over the window)\n")
    print("Known GPU time = throughput vs alone x window; NVML estimate = sum of smUtil x sample period per "
          "PID (bench/gpu/nvml_cupti.py; docs/gpu-results.md, \"Calibrating the stand-in NVML\").\n")
    print("\n".join(mod.comparison_table(comparisons)))
    print()
    print("\n".join(mod.sampling_table(samplings)))


def calibration(results: Path) -> int:
    """run_sm_share.sh calibrate's report (see the module's doc)."""
    mod = nvml_cupti()
    groups = read_manifest(results)
    failures, notes = [], []
    alone_rates: dict[str, float] = {}
    for group, members in groups.items():
        for tenant, share, kind in members:
            r = load_json(results / group / f"{tenant}.json")
            if share == "alone" and r:
                alone_rates[kind] = r["per_s"]
    comparisons, samplings, sharing, others, pastes = [], [], [], [], []
    for group, members in groups.items():
        d = results / group
        shares = [share for _, share, _ in members]
        if shares == ["alone"]:
            phase, known = "alone, without fracgpu", "cupti"
        elif set(shares) == {"pair"}:
            phase, known = f"{len(members)} processes without fracgpu", "throughput"
        else:
            phase, known = f"tenants at {'/'.join(shares)} under fracgpu", "cupti"
        procs = nvml_procs(results, group, members, alone_rates, known)
        for p in procs:
            if not p["result"]:
                failures.append(f"{phase}: {p['tenant']} gave no result (see {d / p['tenant']}.err)")
            elif p["known_s"] is None and known == "cupti" and p["kind"] in alone_rates:
                # No meter: throughput instead.
                r = p["result"]
                p["known_s"], p["known_by"] = r["per_s"] / alone_rates[p["kind"]] * r["wall_s"], "throughput"
        sampler = mod.read_sampler(d / "nvml-sampler.jsonl")
        if sampler["summary"] is None:
            failures.append(f"{phase}: {sampler['error']} (see {d / 'nvml-sampler.err'})")
        rows, run_notes = mod.compare(procs, sampler)
        notes += [f"{phase}: {n}" for n in run_notes]
        comparisons.append((phase, rows))
        samplings.append((phase, sampler))
        (sharing if len(members) > 1 else others).append(sampler["summary"])
        tenants = {str(p["pid"]): p["tenant"] for p in procs if p["pid"] is not None}
        pastes += mod.paste_lines(phase, sampler, tenants)
        shares_line = "; ".join(f"{r['tenant']}: known {fmt(r['known_used'])} ({r.get('known_by') or 'n/a'}), "
                                f"CUPTI {fmt(r['cupti_used'])}, NVML {fmt(r['nvml_used'])}" for r in rows)
        pastes.append(f"  - shares of the GPU time used: {shares_line}")

    print("## NVML calibration: each process's GPU time, known and as NVML integrates it\n")
    print("Known GPU time: alone and under fracgpu from the CUPTI meter (one process's kernels at a time); "
          "without fracgpu from throughput against alone (a CUPTI interval there also covers the other "
          "process's time slices). NVML estimate: sum of smUtil x sample period per PID of "
          "nvmlDeviceGetProcessUtilization, polled every 2 ms.\n")
    print("\n".join(mod.comparison_table(comparisons)))
    print("\n## NVML's sampling, per phase and call\n")
    print("\n".join(mod.sampling_table(samplings)))
    print("\n## Lines for docs/gpu-results.md (\"Calibrating the stand-in NVML\")\n")
    print("\n".join(pastes))
    print("\n## Suggested settings of the stand-in NVML (tests/simnvml)\n")
    print("```")
    print("\n".join(mod.suggest([s for s in sharing if s], [s for s in others if s])))
    print("```")
    print()
    for n in dict.fromkeys(notes):
        print(f"note: {n}")
    for f in failures:
        print(f"FAIL: {f}")
    return 1 if failures else 0


def report(results: Path, threshold: float) -> int:
    # manifest.tsv: group, tenant, share ("alone" for a baseline run), kind.
    rows = [line.split("\t") for line in (results / "manifest.tsv").read_text().splitlines() if line]
    groups: dict[str, list] = {}
    for group, tenant, share, kind in rows:
        groups.setdefault(group, []).append((tenant, share, kind))

    def group_files(group):
        d = results / group
        return load_json(d / "accounting.json"), load_json(d / "status.json")

    notes, failures = [], []
    # Whether NVML accounting could be read, asked once before the runs.
    nvml_state = load_json(results / "accounting-probe.json") or {"state": "unavailable", "reason": "not queried"}

    # Baselines: each kind alone, before and after the splits (drift = clocks, heat).
    alone: dict[str, list] = {}
    alone_busy: dict[str, list] = {}
    for group, members in groups.items():
        for tenant, share, kind in members:
            if share != "alone":
                continue
            acct, _ = group_files(group)
            r = load_json(results / group / f"{tenant}.json")
            if r:
                alone.setdefault(kind, []).append(r["per_s"])
                b = nvml_busy_share(acct, r)
                if b is not None:
                    alone_busy.setdefault(kind, []).append(b)
            else:
                alone.setdefault(kind, [])
                failures.append(f"baseline {group}: the workload failed (see {results / group / tenant}.err)")
    baseline = {k: statistics.mean(v) for k, v in alone.items() if v}

    print("## Baselines: each workload alone on the GPU, without fracgpu\n")
    print("| workload | iterations/s (runs) | drift | NVML busy share alone |")
    print("|---|---|---|---|")
    for kind, v in alone.items():
        drift = (v[-1] - v[0]) / v[0] if len(v) > 1 else None
        busy = statistics.mean(alone_busy[kind]) if alone_busy.get(kind) else None
        runs = ", ".join(f"{x:.1f}" for x in v) or "failed"
        print(f"| {kind} | {runs} | {fmt(drift, '+.1%')} | {fmt(busy)} |")
        if drift is not None and abs(drift) > 0.03:
            notes.append(f"{kind}: throughput alone drifted {drift:+.1%} between the first and the last baseline "
                         "(clocks or temperature); throughput shares carry that uncertainty")
        if busy is not None and busy < 0.95:
            notes.append(f"{kind}: NVML busy share alone is {busy:.3f}: the workload does not saturate this GPU, "
                         "so NVML-measured shares read low (raise --size)")

    print("\n## Shares: tenants pinned to GPU 0, limit = share\n")
    if nvml_state.get("state") == "enabled":
        print("Measured share: **NVML accounting** (busy time = gpuUtilization x lifetime, over the "
              "measured window); throughput vs alone shown beside it.\n")
    else:
        print(f"Measured share: **throughput vs alone** (NVML accounting {nvml_state.get('state')}: "
              f"{nvml_state.get('reason')}).\n")
    print("| split | tenant | workload | share | measured share | by | throughput vs alone "
          "| fracgpu achieved_10s | off (points) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for group, members in groups.items():
        # Runs without fracgpu, and the launch-bound shapes (judged in their
        # own table: such tenants use less than their share by design).
        if members[0][1] in ("alone", "pair") or launch_bound_shape(members) is not None:
            continue
        label = "/".join(share for _, share, _ in members)
        acct, status = group_files(group)
        sums = {"share": 0.0, "measured": 0.0, "tput": 0.0, "achieved": 0.0}
        complete = {"measured": True, "tput": True, "achieved": True}
        for tenant, share_s, kind in members:
            share = float(share_s)
            r = load_json(results / group / f"{tenant}.json")
            tput = r["per_s"] / baseline[kind] if r and kind in baseline else None
            busy = nvml_busy_share(acct, r)
            measured, by = (busy, "NVML") if busy is not None else (tput, "throughput")
            got = achieved_10s(status, tenant)
            off = None if measured is None else round((measured - share) * 100, 1) + 0.0  # no "-0.0"
            print(f"| {label} | {tenant} | {kind} | {share:.2f} | {fmt(measured)} | "
                  f"{by if measured is not None else 'failed'} | {fmt(tput)} | {fmt(got)} | {fmt(off, '+.1f')} |")
            sums["share"] += share
            for key, val in (("measured", measured), ("tput", tput), ("achieved", got)):
                if val is None:
                    complete[key] = False
                else:
                    sums[key] += val
            if measured is None:
                failures.append(f"{label} {tenant}: no measurement (see {results / group / tenant}.err)")
            elif abs(measured - share) > threshold:
                failures.append(f"{label} {tenant}: measured {measured:.3f} against a share of {share:.2f} "
                                f"({off:+.1f} points, more than {threshold * 100:.0f})")
            if busy is not None and tput is not None and abs(busy - tput) > threshold:
                notes.append(f"{label} {tenant}: NVML ({busy:.3f}) and throughput ({tput:.3f}) disagree by more "
                             f"than {threshold * 100:.0f} points: kernels ran slower or faster than alone, or the "
                             "GPU idled while the tenant held it")
            if r and r["late_start_s"] > 0.25:
                notes.append(f"{label} {tenant}: started {r['late_start_s']:.2f} s late (slow warm-up)")
            share_ppm, limit_ppm = tenant_limit(status, tenant)
            if limit_ppm is not None and share_ppm is not None and limit_ppm != share_ppm:
                notes.append(f"{label} {tenant}: limit_ppm {limit_ppm} is not the share {share_ppm}: "
                             "the cap is not the default this check assumes")
            if status is not None and got is None:
                notes.append(f"{label} {tenant}: fracgpu status --json has no "
                             "tenants[].gpus[].gpu_time.achieved_10s_ppm")
        total = {k: (fmt(v) if complete.get(k, True) else "n/a") for k, v in sums.items()}
        print(f"| {label} | (sum) | | {sums['share']:.2f} | {total['measured']} | | {total['tput']} "
              f"| {total['achieved']} | |")

    launch_bound_table(results, groups, group_files, notes)
    nvml_section(results, groups, baseline, notes)
    print()
    for n in dict.fromkeys(notes):  # de-duplicated, in order
        print(f"note: {n}")
    for f in failures:
        print(f"FAIL: {f}")
    if notes or failures:
        print()
    if failures:
        print(f"{len(failures)} failure(s); threshold {threshold * 100:.0f} points (a smoke threshold on a real "
              "GPU; the simulated-driver tests hold 2).")
        return 1
    print(f"Every tenant within {threshold * 100:.0f} points of its share.")
    return 0


# ---------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the saturating workload")
    r.add_argument("--seconds", type=float, required=True, help="length of the measured window")
    start = r.add_mutually_exclusive_group(required=True)
    start.add_argument("--start-ns", type=int, help="common start, CLOCK_MONOTONIC ns")
    start.add_argument("--start-file", help="file that will hold the common start (CLOCK_MONOTONIC ns)")
    r.add_argument("--ready-file", help="written once warmed up")
    r.add_argument("--kind", choices=("matmul", "mixed", "step10", "step50"), default="matmul")
    r.add_argument("--size", type=int, default=8192, help="matrix size (fp16 SIZE x SIZE)")
    r.add_argument("--sync-every", type=int, default=8, help="iterations between synchronizations")
    a = sub.add_parser("accounting", help="NVML accounting of ended processes, as JSON")
    a.add_argument("--uuid", required=True, help="the GPU, as nvidia-smi --query-gpu=uuid prints it")
    a.add_argument("pids", type=int, nargs="*")
    rep = sub.add_parser("report", help="Markdown tables of a run_sm_share.sh results directory")
    rep.add_argument("results", type=Path)
    rep.add_argument("--threshold", type=float, default=0.05, help="largest allowed |measured - share|")
    cal = sub.add_parser("calibration", help="the tables of run_sm_share.sh calibrate")
    cal.add_argument("results", type=Path)
    args = p.parse_args()
    if args.cmd == "run":
        run(args)
    elif args.cmd == "accounting":
        print(json.dumps(accounting(args.uuid, args.pids)))
    elif args.cmd == "calibration":
        sys.exit(calibration(args.results))
    else:
        sys.exit(report(args.results, args.threshold))


if __name__ == "__main__":
    main()
