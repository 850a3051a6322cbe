#!/usr/bin/env python3
"""Sampler and report of the end-to-end benchmark (bench/e2e/run_e2e.sh).
Standard library only.

  e2e.py now
      CLOCK_MONOTONIC in ns (the clock the workloads' start_ns uses).
  e2e.py sample --lib LIBCUDA --start-ns NS --seconds S [--interval 0.25] --out CSV PID:TENANT...
      Every interval from start_ns until start_ns + S (+ one interval), the
      simulated driver's device time per process (simcuda_busy_ns) and in
      total (simcuda_device_busy_ns) of device 0: the ground truth, what the
      simulated GPU ran, never what fracgpu believes it gave.
  e2e.py watch --lib LIBCUDA --fracgpu FRACGPU --run-dir DIR --start-ns NS --seconds S PID:TENANT...
      For examples/demo.sh: at every whole second from 1 s after start_ns to
      S s, each tenant's achieved share as fracgpu reports it (`fracgpu status
      --json`, its 1 s figure) and the simulated driver's device time of its
      processes; then prints a table: each tenant's configured share, the
      mean of fracgpu's 1 s figures, and the ground truth over the same span.
  e2e.py report OUT_DIR
      Reads OUT_DIR/runs/*/ (written by run_e2e.sh) and writes
      e2e_runs.csv (one row per process), e2e_summary.csv (one row per run),
      e2e_shares.csv (each tenant's achieved share over time), e2e_shares.svg
      (its plot), e2e_table.md and e2e_sharing.md (both printed too). The
      latency set's runs (run.txt set=latency) are left to `latency`.
  e2e.py latency OUT_DIR [--skipped REASON]
      The latency set (issue 24: an inference tenant `inf` beside a training
      tenant `train`): writes e2e_latency.csv and e2e_latency.md (printed
      too): per run the inference's burst latency percentiles, its and the
      training's GPU time (ground truth), the training's fraction of the time
      the inference leaves, and the issue's targets, computed from the
      inference alone without fracgpu. REASON: why runs of the set are
      missing (said under the table).

Achieved share of a tenant over a window = device time its processes were
credited in the window / the window's length. The simulated driver credits a
kernel when it is launched, so a window can be off by the work a process
queues ahead (compute: 20 ms); the plotted trailing 1 s window bounds that
to 2 points.

Charged share of a tenant (fracgpu runs): the change of its `used_ns` (the
GPU time fracgpu charged it) between the two `fracgpu status --json` snapshots
run_e2e.sh takes (status_begin.json, status.json, each with a .ns file: when
it was read) over the time between them: fracgpu's own belief, beside the
ground truth.
"""
from __future__ import annotations

import argparse
import csv
import ctypes
import html
import json
import sys
import time
from pathlib import Path

WINDOW_S = 1.0       # the plotted and reported achieved-share window
SKIP_S = 1.0         # the first second (start-up, first hand-overs) is left out of the figures


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


# --------------------------------------------------------------------------
# the simulated driver's counters, and PID:TENANT arguments


def sim_counters(path):
    """simcuda_busy_ns(device, pid) and simcuda_device_busy_ns(device) from the simulated driver at `path`."""
    lib = ctypes.CDLL(path)
    busy = lib.simcuda_busy_ns
    busy.restype, busy.argtypes = ctypes.c_uint64, [ctypes.c_int, ctypes.c_int]
    device_busy = lib.simcuda_device_busy_ns
    device_busy.restype, device_busy.argtypes = ctypes.c_uint64, [ctypes.c_int]
    return busy, device_busy


def parse_procs(specs):
    """["PID:TENANT", ...] -> [(pid, tenant), ...]"""
    procs = []
    for spec in specs:
        pid, _, tenant = spec.partition(":")
        procs.append((int(pid), tenant))
    return procs


# --------------------------------------------------------------------------
# sample


def cmd_sample(args) -> int:
    busy, device_busy = sim_counters(args.lib)
    procs = parse_procs(args.procs)
    interval = int(args.interval * 1e9)
    end = args.start_ns + int(args.seconds * 1e9) + interval
    t = args.start_ns
    with open(args.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t_s", "pid", "tenant", "busy_ns", "device_busy_ns"])
        while t <= end:
            delay = (t - now_ns()) / 1e9
            if delay > 0:
                time.sleep(delay)
            dev = device_busy(0)
            for pid, tenant in procs:
                w.writerow([f"{(t - args.start_ns) / 1e9:.3f}", pid, tenant, busy(0, pid), dev])
            t += interval
    return 0


# --------------------------------------------------------------------------
# watch (examples/demo.sh)


def cmd_watch(args) -> int:
    import subprocess

    busy, device_busy = sim_counters(args.lib)
    procs = parse_procs(args.procs)
    tenants = list(dict.fromkeys(t for _, t in procs))

    def truth():
        return {t: sum(busy(0, p) for p, pt in procs if pt == t) for t in tenants}, device_busy(0)

    def status():
        r = subprocess.run([args.fracgpu, "status", "--run-dir", args.run_dir, "--json"],
                           capture_output=True, text=True, check=False)
        try:
            doc = json.loads(r.stdout)
        except ValueError:
            return {}
        out = {}
        for t in doc.get("tenants", []):
            for g in t.get("gpus", []):
                if g.get("entry") == 0:
                    out[t.get("name")] = g
        return out

    def sleep_until(ns):
        delay = (ns - now_ns()) / 1e9
        if delay > 0:
            time.sleep(delay)

    if args.seconds < 2:
        print("e2e.py watch: --seconds must be 2 or more", file=sys.stderr)
        return 2
    second = 1_000_000_000
    first = args.start_ns + second
    last = args.start_ns + int(args.seconds) * second
    sleep_until(first)
    busy0, dev0 = truth()
    achieved: dict[str, list[int]] = {t: [] for t in tenants}
    entries: dict = {}
    t = first + second
    while t <= last:
        sleep_until(t)
        entries = status() or entries
        for tenant in tenants:
            g = entries.get(tenant) or {}
            if isinstance(g.get("gpu_time"), dict):
                achieved[tenant].append(int(g["gpu_time"]["achieved_1s_ppm"]))
        if t == last:
            busy1, dev1 = truth()
        t += second
    span = (last - first) / 1e9
    rows = [["tenant", "share", "achieved (fracgpu status)", "ground truth (simulated driver)"]]
    charging = set()
    for tenant in tenants:
        g = entries.get(tenant) or {}
        share = f"{g['share_ppm'] / 1e6:.2f}" if "share_ppm" in g else "?"
        if isinstance(g.get("gpu_time"), dict):
            charging.add(g["gpu_time"].get("charging", "?"))
        got = achieved[tenant]
        fracgpu = f"{sum(got) / len(got) / 1e6:.3f}" if got else "-"
        used = (busy1[tenant] - busy0[tenant]) / 1e9
        rows.append([tenant, share, fracgpu, f"{used / span:.3f} ({used:.2f} s of {span:.0f} s)"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print(f"GPU busy (simulated driver): {(dev1 - dev0) / 1e9 / span:.3f}; "
          f"fracgpu charges GPU time as: {', '.join(sorted(charging)) or '?'}; "
          f"figures from 1 s to {args.seconds} s after the start "
          f"(fracgpu's: the mean of its 1 s figure, read every second)")
    return 0


# --------------------------------------------------------------------------
# generic writers (also used by bench/gpu/gpu_report.py)


def parse_kv(line: str) -> dict:
    """key=value pairs of one line (the workloads' result line)."""
    out = {}
    for part in line.split():
        key, eq, value = part.partition("=")
        if eq:
            out[key] = value
    return out


def write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def fmt_ratio(x) -> str:
    return "" if x is None else f"{x:.3f}"


def fmt_rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 10000 else f"{x:.1f}"


COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]


def svg_panels(panels: list[dict], title: str, y_label: str, columns: int = 2) -> str:
    """Line plots in a grid. Each panel: title, series [(label, [(x, y)...])],
    targets [(label, y)] drawn dashed in the series' colour, x_max, y_max."""
    pw, ph, margin_l, margin_t, gap = 430, 250, 55, 40, 30
    rows = (len(panels) + columns - 1) // columns
    width = columns * (pw + gap) + 20
    height = margin_t + rows * (ph + gap + 40) + 20
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14">{html.escape(title)}</text>']
    for i, p in enumerate(panels):
        ox = 10 + (i % columns) * (pw + gap) + margin_l
        oy = margin_t + (i // columns) * (ph + gap + 40) + 20
        w, h = pw - margin_l, ph - 40
        x_max = p.get("x_max") or 1.0
        y_max = p.get("y_max") or 1.0

        def sx(x, ox=ox, w=w, x_max=x_max):
            return ox + w * min(max(x / x_max, 0.0), 1.0)

        def sy(y, oy=oy, h=h, y_max=y_max):
            return oy + h * (1 - min(max(y / y_max, 0.0), 1.0))

        out.append(f'<text x="{ox + w / 2}" y="{oy - 6}" text-anchor="middle" font-size="12">'
                   f'{html.escape(p["title"])}</text>')
        out.append(f'<rect x="{ox}" y="{oy}" width="{w}" height="{h}" fill="none" stroke="#444"/>')
        for k in range(6):  # y grid: 0, 0.2, ... of y_max
            y = y_max * k / 5
            out.append(f'<line x1="{ox}" y1="{sy(y):.1f}" x2="{ox + w}" y2="{sy(y):.1f}" stroke="#ddd"/>')
            out.append(f'<text x="{ox - 4}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:.1f}</text>')
        step = max(1, round(x_max / 6))
        x = 0
        while x <= x_max + 1e-9:
            out.append(f'<text x="{sx(x):.1f}" y="{oy + h + 14}" text-anchor="middle">{x:g}</text>')
            x += step
        out.append(f'<text x="{ox + w / 2}" y="{oy + h + 28}" text-anchor="middle">time (s)</text>')
        out.append(f'<text x="{ox - 40}" y="{oy + h / 2}" text-anchor="middle" '
                   f'transform="rotate(-90 {ox - 40} {oy + h / 2})">{html.escape(y_label)}</text>')
        for j, (label, points) in enumerate(p["series"]):
            colour = COLOURS[j % len(COLOURS)]
            if points:
                pts = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
                out.append(f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="1.6"/>')
            # Legend in a row under the axis, where no line can hide it.
            lx, ly = ox + 90 * j, oy + h + 44
            out.append(f'<line x1="{lx}" y1="{ly - 4}" x2="{lx + 18}" y2="{ly - 4}" '
                       f'stroke="{colour}" stroke-width="2"/>')
            out.append(f'<text x="{lx + 22}" y="{ly}">{html.escape(label)}</text>')
        for j, (label, y) in enumerate(p.get("targets", [])):
            colour = COLOURS[j % len(COLOURS)]
            out.append(f'<line x1="{ox}" y1="{sy(y):.1f}" x2="{ox + w}" y2="{sy(y):.1f}" stroke="{colour}" '
                       f'stroke-dasharray="5,4" stroke-width="1"/>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------
# report


def read_run(d: Path) -> dict:
    meta = parse_kv((d / "run.txt").read_text())
    meta["seconds"] = float(meta["seconds"])
    procs = []
    with open(d / "procs.tsv") as f:  # tenant, share, pid, exit status[, output's name] (fracgpu_run.sh)
        for line in f:
            tenant, share, pid, rc, *rest = line.rstrip("\n").split("\t")
            stem = rest[0] if rest else tenant
            out = (d / f"{stem}.out").read_text().strip() if (d / f"{stem}.out").exists() else ""
            kv = parse_kv(out.splitlines()[-1]) if out else {}
            if out and "rate" not in kv:
                # gputime_load (the hostile shapes): a line each, launches_0= among them.
                for line in out.splitlines():
                    kv.update(parse_kv(line))
                if "launches_0" in kv:
                    kv.update(ops=kv["launches_0"], seconds=str(meta["seconds"]), unit="launches/s",
                              rate=str(int(kv["launches_0"]) / meta["seconds"]))
            procs.append({"tenant": tenant, "share": share, "pid": int(pid), "rc": int(rc),
                          "ok": bool(kv) and int(rc) == 0, "rate": float(kv.get("rate", 0)),
                          "ops": int(kv.get("ops", 0)), "seconds": float(kv.get("seconds", 0)),
                          "unit": kv.get("unit", ""), "kv": kv})
    samples: dict[str, list[tuple[float, int, int]]] = {}  # tenant -> [(t, busy summed, device busy)]
    if (d / "samples.csv").exists():
        by_t: dict[float, dict] = {}
        with open(d / "samples.csv") as f:
            for r in csv.DictReader(f):
                t = float(r["t_s"])
                slot = by_t.setdefault(t, {"device": int(r["device_busy_ns"]), "tenants": {}})
                slot["tenants"][r["tenant"]] = slot["tenants"].get(r["tenant"], 0) + int(r["busy_ns"])
        rest = meta.get("rest")  # a tenant whose processes come and go too fast to sample (run_e2e.sh)
        for t in sorted(by_t):
            if rest:
                slot = by_t[t]
                slot["tenants"][rest] = slot["device"] - sum(b for name, b in slot["tenants"].items() if name != rest)
            for tenant, b in by_t[t]["tenants"].items():
                samples.setdefault(tenant, []).append((t, b, by_t[t]["device"]))
    # Tenants with a workload of their own (run.txt's mix=TENANT:WORKLOAD,...).
    mix = dict(part.partition(":")[::2] for part in meta.get("mix", "").split(",") if part)
    return {"dir": d.name, **meta, "mix": mix, "procs": procs, "samples": samples,
            "charged": charged_shares(d)}


def read_status(path: Path):
    """(CLOCK_MONOTONIC ns it was read at, {tenant: (used_ns, charging)} of
    GPU entry 0) of a status snapshot, or None."""
    try:
        at = int(Path(str(path) + ".ns").read_text().strip())
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    out = {}
    for t in doc.get("tenants", []):
        for g in t.get("gpus", []):
            time_ = g.get("gpu_time")
            if g.get("entry") == 0 and isinstance(time_, dict):
                out[t.get("name")] = (int(time_.get("used_ns", 0)), time_.get("charging", ""))
    return at, out


def charged_shares(d: Path) -> dict:
    """tenant -> (charged share between the two snapshots, charging mode)."""
    begin, end = read_status(d / "status_begin.json"), read_status(d / "status.json")
    if begin is None or end is None or end[0] <= begin[0]:
        return {}
    out = {}
    for tenant, (used, charging) in end[1].items():
        if tenant in begin[1]:
            out[tenant] = ((used - begin[1][tenant][0]) / (end[0] - begin[0]), charging)
    return out


def windows(series: list[tuple[float, int, int]], width: float) -> list[tuple[float, float]]:
    """(t, busy fraction over the trailing `width`) for each sample at least `width` in."""
    out = []
    j = 0
    for i, (t, b, _) in enumerate(series):
        while j + 1 < i and t - series[j + 1][0] >= width - 1e-6:
            j += 1
        if j < i and t - series[j][0] >= width - 1e-6:
            out.append((t, (b - series[j][1]) / ((t - series[j][0]) * 1e9)))
    return out


def share_figures(series, seconds: float):
    """Mean achieved share over [SKIP_S, seconds] and the min/max of the
    trailing 1 s windows ending in it; also the device's busy fraction."""
    skip = min(SKIP_S, seconds / 2)  # short (smoke) runs keep their second half
    inside = [s for s in series if skip - 1e-6 <= s[0] <= seconds + 1e-6]
    if len(inside) < 2:
        return None, None, None, None
    a, b = inside[0], inside[-1]
    span = (b[0] - a[0]) * 1e9
    mean = (b[1] - a[1]) / span
    busy = (b[2] - a[2]) / span
    ws = [y for t, y in windows(series, WINDOW_S) if skip + WINDOW_S - 1e-6 <= t <= seconds + 1e-6]
    return mean, (min(ws) if ws else None), (max(ws) if ws else None), busy


def cmd_report(args) -> int:
    out = Path(args.out_dir)
    runs = [read_run(d) for d in sorted((out / "runs").iterdir()) if (d / "run.txt").exists()]
    runs = [r for r in runs if r.get("set") != "latency"]
    if not runs:
        print(f"e2e.py: no runs under {out / 'runs'}", file=sys.stderr)
        return 2
    # Reference throughputs per workload: one process alone, native and under fracgpu.
    ref = {}
    for r in runs:
        if len(r["procs"]) == 1 and r["procs"][0]["ok"]:
            ref[(r["workload"], r["mode"])] = r["procs"][0]["rate"]

    proc_rows, summary_rows, share_rows, table, panels = [], [], [], [], []
    # Sharing, side by side: per workload, two processes without fracgpu and
    # two 0.5 tenants with it: (GPU busy, [each tenant's share of the time used]).
    sharing: dict[str, dict[str, tuple]] = {}
    failed = 0
    for r in runs:
        total = sum(p["rate"] for p in r["procs"])
        ok = all(p["ok"] for p in r["procs"])
        failed += not ok
        native = ref.get((r["workload"], "native"))
        alone = ref.get((r["workload"], "fracgpu"))
        vs_native = total / native if native and ok else None
        vs_alone = total / alone if alone and ok and r["mode"] == "fracgpu" and len(r["procs"]) > 1 else None
        tenants = []
        for p in r["procs"]:
            if p["tenant"] not in [t for t, _ in tenants]:
                tenants.append((p["tenant"], p.get("share", "")))
        busy_fraction = None
        shares_text = []
        for tenant, share in tenants:
            mean, lo, hi, busy = share_figures(r["samples"].get(tenant, []), r["seconds"])
            busy_fraction = busy if busy is not None else busy_fraction
            if mean is not None:
                rng = f" ({lo:.3f}–{hi:.3f})" if lo is not None else ""
                shares_text.append(f"{tenant}{f' ({share})' if share else ''}: {mean:.3f}{rng}")
            for t, y in windows(r["samples"].get(tenant, []), WINDOW_S):
                if t > r["seconds"] + 1e-6:
                    break  # past the end: the processes have stopped
                share_rows.append({"run": r["dir"], "tenant": tenant, "share": share, "t_s": f"{t:.2f}",
                                   "achieved_1s": f"{y:.4f}"})
            for p in r["procs"]:
                if p["tenant"] == tenant:
                    proc_rows.append({"run": r["dir"], "workload": r["workload"], "mode": r["mode"],
                                      "tenant": tenant, "share": share, "pid": p["pid"], "exit": p.get("rc"),
                                      "ops": p["ops"], "seconds": p["seconds"], "rate": f"{p['rate']:.1f}",
                                      "unit": p["unit"], "achieved_share": "" if mean is None else f"{mean:.4f}"})
        if len(tenants) == 2 and busy_fraction and (r["mode"] == "native" or all(s == "0.5" for _, s in tenants)):
            used, charged = [], []
            for tenant, _ in tenants:
                mean = share_figures(r["samples"].get(tenant, []), r["seconds"])[0]
                used.append(f"{tenant} {mean / busy_fraction:.3f}" if mean is not None else f"{tenant} -")
                if tenant in r["charged"]:
                    share, charging = r["charged"][tenant]
                    charged.append((charging, f"{tenant} {share:.3f}"))
            text = ""
            if charged:
                modes = sorted({c for c, _ in charged})
                text = f"{'/'.join(m or '?' for m in modes)}: " + ", ".join(t for _, t in charged)
            sharing.setdefault(r["workload"], {})[r["mode"]] = (busy_fraction, used, text)
        unit = r["procs"][0]["unit"] if r["procs"] else ""
        summary_rows.append({"run": r["dir"], "workload": r["workload"], "mode": r["mode"],
                             "processes": len(r["procs"]), "ok": int(ok), "total_rate": f"{total:.1f}",
                             "unit": unit, "vs_native_alone": fmt_ratio(vs_native),
                             "vs_fracgpu_alone": fmt_ratio(vs_alone),
                             "gpu_busy": fmt_ratio(busy_fraction)})
        label = "native" if r["mode"] == "native" else "fracgpu"
        mix = r["mix"]

        def named(t, s, mix=mix):
            return (f"{t}={s}" if s else t) + (f" ({mix[t]})" if t in mix else "")

        who = ", ".join(named(t, s) for t, s in tenants)
        if mix:  # tenants running different workloads: a rate each
            rates = "; ".join(f"{p['tenant']} {fmt_rate(p['rate'])} {p['unit']}" for p in r["procs"])
        else:
            rates = f"{fmt_rate(total)} {unit}"
        table.append([r["workload"], f"{label}: {who}" if r["mode"] == "fracgpu" or len(tenants) > 1 else label,
                      ("" if ok else "FAILED ") + rates, fmt_ratio(vs_native),
                      fmt_ratio(vs_alone), fmt_ratio(busy_fraction), "; ".join(shares_text)])
        # Plotted: runs of several processes that use the GPU (the allocation
        # workload's kernels take well under 1% of it: nothing to see).
        if len(tenants) > 1 and (busy_fraction or 0) > 0.05:
            panels.append({"title": f"{r['workload']}, {label}: " + " / ".join(
                f"{t} {s}" if s else t for t, s in tenants),
                "series": [(f"{t} ({s})" if s else t, [(x, y) for x, y in windows(r["samples"].get(t, []), WINDOW_S)
                                                       if x <= r["seconds"] + 1e-6])
                           for t, s in tenants],
                "targets": [(t, float(s)) for t, s in tenants if s],
                "x_max": r["seconds"], "y_max": 1.0})

    write_csv(out / "e2e_runs.csv", proc_rows, ["run", "workload", "mode", "tenant", "share", "pid", "exit", "ops",
                                                "seconds", "rate", "unit", "achieved_share"])
    write_csv(out / "e2e_summary.csv", summary_rows, ["run", "workload", "mode", "processes", "ok", "total_rate",
                                                      "unit", "vs_native_alone", "vs_fracgpu_alone", "gpu_busy"])
    write_csv(out / "e2e_shares.csv", share_rows, ["run", "tenant", "share", "t_s", "achieved_1s"])
    stamp = time.strftime("%Y-%m-%d", time.gmtime())
    (out / "e2e_shares.svg").write_text(svg_panels(
        panels, f"Achieved share of GPU time, trailing 1 s window (simulated driver, {stamp}); dashed: configured share",
        "share of GPU time"))
    text = markdown_table(
        ["workload", "run", "throughput (sum)", "vs native alone", "vs fracgpu alone", "GPU busy",
         f"achieved share: mean from {SKIP_S:g} s (1 s windows min–max)"], table)
    (out / "e2e_table.md").write_text(text + "\n")
    print(text)
    side = []
    mixes = {r["workload"]: r["mix"] for r in runs if r["mix"]}
    for workload, modes in sharing.items():
        n, f = modes.get("native"), modes.get("fracgpu")
        label = workload
        if workload in mixes:
            label += " (" + ", ".join(f"{t}: {w}" for t, w in mixes[workload].items()) + ")"
        side.append([label, fmt_ratio(n[0]) if n else "", fmt_ratio(f[0]) if f else "",
                     ", ".join(n[1]) if n else "", ", ".join(f[1]) if f else "", f[2] if f else ""])
    sharing_text = markdown_table(
        ["workload", "GPU busy, 2 processes without fracgpu", "GPU busy, 2 tenants of 0.5",
         "share of the GPU time used, without", "share of the GPU time used, with (0.5 each)",
         "charged by fracgpu (charging: fraction of wall time)"], side)
    (out / "e2e_sharing.md").write_text(sharing_text + "\n")
    print()
    print(sharing_text)
    if failed:
        print(f"\n{failed} run(s) FAILED: see {out / 'runs'}/*/*.err", file=sys.stderr)
    return 1 if failed else 0


# --------------------------------------------------------------------------
# latency (issue 24: an inference tenant beside a training tenant)

P50_TARGET_FACTOR = 1.05        # p50 <= 1.05 x p50 alone
P99_TARGET_FACTOR = 1.10        # p99 <= 1.10 x p99 alone + 2 ms
P99_TARGET_SLACK_MS = 2.0


def latency_targets(alone: dict | None):
    """(p50 target, p99 target) in ms from the inference alone's result
    line (its key=value pairs), or (None, None) without it."""
    try:
        return (P50_TARGET_FACTOR * float(alone["p50_ms"]),
                P99_TARGET_FACTOR * float(alone["p99_ms"]) + P99_TARGET_SLACK_MS)
    except (TypeError, KeyError, ValueError):
        return None, None


def latency_waits(d: Path, tenant: str) -> str:
    """fracgpu's own figures of a latency tenant's waits for the GPU (its
    status near the end of the run: wait p50 / p99 in ms), or ""."""
    try:
        doc = json.loads((d / "status.json").read_text())
    except (OSError, ValueError):
        return ""
    for t in doc.get("tenants", []):
        for g in t.get("gpus", []):
            time_ = g.get("gpu_time")
            if t.get("name") == tenant and g.get("entry") == 0 and isinstance(time_, dict) \
                    and "wait_p99_ns" in time_:
                return f"{time_.get('wait_p50_ns', 0) / 1e6:.2f} / {time_['wait_p99_ns'] / 1e6:.2f}"
    return ""


def latency_row(r: dict, targets, d: Path) -> dict:
    """One run of the latency set as the table's and the CSV's fields."""
    procs = {p["tenant"]: p for p in r["procs"]}
    inf, train = procs.get("inf"), procs.get("train")
    trains = [p for p in r["procs"] if p["tenant"] == "train"]  # the training may run in several processes
    prio = dict(part.partition(":")[::2] for part in r.get("priority", "").split(",") if part)
    shape = r["workload"].partition("-")[2]
    if r["mode"] == "native":
        label = "inference alone, native" if train is None else f"both, native ({len(r['procs'])} processes)"
    else:
        limits = dict(part.partition(":")[::2] for part in r.get("limit", "").split(",") if part)
        who = ", ".join(f"{p['tenant']} {p['share']} {prio.get(p['tenant'], 'normal')}"
                        + (f" limit {limits[p['tenant']]}" if p["tenant"] in limits else "")
                        + (f" ({len(trains)} processes)" if p["tenant"] == "train" and len(trains) > 1 else "")
                        for p in procs.values())
        label = f"{'inference alone' if train is None else 'both'}, fracgpu: {who}"
    row = {"run": r["dir"], "shape": shape, "label": label, "mode": r["mode"], "seconds": r["seconds"],
           "ok": int(all(p["ok"] for p in r["procs"]))}
    kv = inf["kv"] if inf else {}
    for key in ("bursts", "late", "missed", "p50_ms", "p99_ms", "p999_ms", "max_ms"):
        row[key] = kv.get(key, "")
    inf_share = train_share = busy = None
    if inf is not None:
        inf_share, _, _, busy = share_figures(r["samples"].get("inf", []), r["seconds"])
    if train is not None:
        train_share = share_figures(r["samples"].get("train", []), r["seconds"])[0]
        row["train_rate"] = f"{sum(p['rate'] for p in trains):.1f}"
    row["inf_share"] = fmt_ratio(inf_share)
    row["train_share"] = fmt_ratio(train_share)
    row["gpu_busy"] = fmt_ratio(busy)
    left = None
    if train_share is not None and inf_share is not None and inf_share < 1:
        left = train_share / (1 - inf_share)
    row["train_of_left"] = fmt_ratio(left)
    row["fracgpu_wait_ms"] = latency_waits(d, "inf") if r["mode"] == "fracgpu" else ""
    p50_target, p99_target = targets
    row["p50_target_ms"] = "" if p50_target is None else f"{p50_target:.3f}"
    row["p99_target_ms"] = "" if p99_target is None else f"{p99_target:.3f}"
    for key, target in (("p50", p50_target), ("p99", p99_target)):
        try:
            row[f"{key}_met"] = "" if target is None else ("yes" if float(row[f"{key}_ms"]) <= target else "no")
        except ValueError:  # no figure: the inference failed
            row[f"{key}_met"] = ""
    return row


def cmd_latency(args) -> int:
    out = Path(args.out_dir)
    runs = [read_run(d) for d in sorted((out / "runs").iterdir()) if (d / "run.txt").exists()]
    runs = [r for r in runs if r.get("set") == "latency"]
    if not runs:
        print(f"e2e.py: no runs of the latency set under {out / 'runs'}", file=sys.stderr)
        return 2
    alone = next((r for r in runs if r["mode"] == "native" and len(r["procs"]) == 1
                  and r["procs"][0]["ok"]), None)
    targets = latency_targets(alone["procs"][0]["kv"] if alone else None)
    rows = [latency_row(r, targets, out / "runs" / r["dir"]) for r in runs]
    for row in rows:
        if alone is not None and row["run"] == alone["dir"]:
            row["p50_met"] = row["p99_met"] = ""  # the reference itself
    write_csv(out / "e2e_latency.csv", rows,
              ["run", "shape", "label", "mode", "seconds", "ok", "bursts", "late", "missed", "p50_ms", "p99_ms",
               "p999_ms", "max_ms", "inf_share", "train_share", "train_of_left", "train_rate", "gpu_busy", "fracgpu_wait_ms",
               "p50_target_ms", "p99_target_ms", "p50_met", "p99_met"])

    def ms(x):
        return f"{float(x):.2f}" if x != "" else ""

    table = []
    for row in rows:
        bursts = row["bursts"]
        if bursts and (row["late"] not in ("", "0") or row["missed"] not in ("", "0")):
            bursts += f" ({row['late']} late, {row['missed']} missed)"
        table.append([row["shape"] or "-", ("" if row["ok"] else "FAILED ") + row["label"], ms(row["p50_ms"]),
                      ms(row["p99_ms"]), ms(row["p999_ms"]), bursts, row["inf_share"], row["train_share"],
                      row["train_of_left"], row.get("train_rate", ""), row["fracgpu_wait_ms"],
                      row["p50_met"], row["p99_met"]])
    text = markdown_table(
        ["training shape", "run", "inference p50 (ms)", "p99 (ms)", "p99.9 (ms)", "bursts",
         "inference GPU time", "training GPU time", "training / time inference leaves", "training kernels/s",
         "fracgpu's wait p50 / p99 (ms)", "p50 target met", "p99 target met"], table)
    notes = []
    p50_target, p99_target = targets
    if p50_target is not None:
        kv = alone["procs"][0]["kv"]
        notes.append(f"Targets from the inference alone without fracgpu (p50 {float(kv['p50_ms']):.2f} ms, "
                     f"p99 {float(kv['p99_ms']):.2f} ms): p50 <= {P50_TARGET_FACTOR:g} x p50 alone = "
                     f"{p50_target:.2f} ms; p99 <= {P99_TARGET_FACTOR:g} x p99 alone + {P99_TARGET_SLACK_MS:g} ms "
                     f"= {p99_target:.2f} ms.")
    else:
        notes.append("No targets: the inference alone without fracgpu did not run or failed.")
    notes.append("Shapes: a = the training launches, synchronizes, launches (1 kernel of 2 ms in flight); "
                 "b = 1000 in flight; split4, split8 = 2 ms kernels, 2 s of them queued ahead, in 4 (8) "
                 "processes of the training tenant; prefix = one process queuing 100 x 10 us, then "
                 "10 x 20 ms, in a loop (it trains a per-launch estimate down, then floods); their kernels/s "
                 "are launches per second of the run, queued or run. GPU time: fraction of the window (from "
                 f"{SKIP_S:g} s; half-way in shorter runs) the simulated driver ran each tenant's kernels. "
                 "Percentiles: nearest rank over the bursts (below 1000 bursts, p99.9 is the largest). "
                 "fracgpu's wait: a latency tenant's waits for the GPU as fracgpu publishes them (`fracgpu "
                 "status --json` near the end of the run), its own figures beside the measured latency.")
    if args.skipped:
        notes.append(f"Not measured: the runs with priority = \"latency\" ({args.skipped}).")
    text += "\n\n" + "\n".join(notes)
    (out / "e2e_latency.md").write_text(text + "\n")
    print(text)
    failed = sum(1 for row in rows if not row["ok"])
    if failed:
        print(f"\n{failed} run(s) of the latency set FAILED: see {out / 'runs'}/*/*.err", file=sys.stderr)
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("now")
    s = sub.add_parser("sample")
    s.add_argument("--lib", required=True)
    s.add_argument("--start-ns", type=int, required=True)
    s.add_argument("--seconds", type=float, required=True)
    s.add_argument("--interval", type=float, default=0.25)
    s.add_argument("--out", required=True)
    s.add_argument("procs", nargs="+", metavar="PID:TENANT")
    w = sub.add_parser("watch")
    w.add_argument("--lib", required=True)
    w.add_argument("--fracgpu", required=True)
    w.add_argument("--run-dir", required=True)
    w.add_argument("--start-ns", type=int, required=True)
    w.add_argument("--seconds", type=int, required=True)
    w.add_argument("procs", nargs="+", metavar="PID:TENANT")
    r = sub.add_parser("report")
    r.add_argument("out_dir")
    lat = sub.add_parser("latency")
    lat.add_argument("out_dir")
    lat.add_argument("--skipped", default="")
    args = ap.parse_args()
    if args.cmd == "now":
        print(now_ns())
        return 0
    if args.cmd == "watch":
        return cmd_watch(args)
    if args.cmd == "latency":
        return cmd_latency(args)
    return cmd_sample(args) if args.cmd == "sample" else cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())
