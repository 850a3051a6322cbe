#!/usr/bin/env python3
"""NVML's per-process samples against the CUPTI meter: the analysis shared by
the real-GPU harnesses (bench/gpu/gpu_report.py, tests/gpu/sm_share_workload.py)
and the calibration of the stand-in NVML (docs/gpu-results.md, "Calibrating
the stand-in NVML"). Standard library only.

  nvml_cupti.py summary LOG...   the lines to paste into docs/gpu-results.md
                                 for nvml_sampler logs

Inputs:
- an nvml_sampler log (bench/gpu/nvml_sampler.cpp): JSON lines, a header,
  one line per poll, and a {"summary": ...} line last; per call ("pu":
  nvmlDeviceGetProcessUtilization, "pui": nvmlDeviceGetProcessesUtilizationInfo,
  "gs": nvmlDeviceGetSamples) the NOT_FOUND fraction, the gaps between distinct
  sample stamps (the sampling period), PIDs per sample, and per PID the
  integrated estimate sum(smUtil/100 x period covered) and its fraction of
  the time polled (span_s);
- a CUPTI meter file per process (bench/gpu/cupti_meter.cpp,
  PREFIX.<pid>.json): the union of the process's kernel intervals per 100 ms
  bin of CLOCK_MONOTONIC, clipped here to the measured window.

A CUPTI kernel interval includes time in which another process's context held
the GPU (time-slicing) or ran beside it (MPS): CUPTI shares are GPU time only
where one process's kernels run at a time (fracgpu tenants). Where the
fractions of one run add up to more than OVERLAP the table says so.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

CALLS = {
    "pu": "nvmlDeviceGetProcessUtilization",
    "pui": "nvmlDeviceGetProcessesUtilizationInfo",
    "gs": "nvmlDeviceGetSamples(GPU_UTILIZATION)",
}
OVERLAP = 1.01      # CUPTI fractions of one run adding up above this overlapped
ONE_PID = 0.95      # share of samples naming one PID for "instant" attribution


def fmt(x, spec=".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def read_sampler(path: Path) -> dict:
    """{"header": ..., "summary": ..., "error": None} or with "error" saying
    why there is no usable summary (missing file, not JSON, no summary line,
    the sampler's own error)."""
    out = {"header": None, "summary": None, "error": None, "path": str(path)}
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        out["error"] = f"no sampler log ({e.strerror})"
        return out
    for line in (lines[:1] + lines[-1:]) if lines else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        out["header"] = row.get("header", out["header"])
        out["summary"] = row.get("summary", out["summary"])
    if out["summary"] is None:
        out["error"] = "the sampler log has no summary (the sampler did not finish)"
    elif out["summary"].get("error"):
        out["error"] = f"nvml_sampler: {out['summary']['error']}"
        out["summary"] = None
    return out


def find_meter(directory: Path, prefix: str, pid) -> dict | None:
    """The meter file PREFIX.<pid>.json in directory: the one of that pid, else
    the only one there is (a workload that exec'd), else None."""
    found = {}
    for f in sorted(directory.glob(f"{prefix}.*.json")):
        try:
            found[f.name[len(prefix) + 1:-len(".json")]] = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
    if pid is not None and str(pid) in found:
        return found[str(pid)]
    return next(iter(found.values())) if len(found) == 1 else None


def meter_busy_s(meter: dict | None, lo_ns: int, hi_ns: int) -> float | None:
    """GPU time (s) of the meter's bins inside [lo_ns, hi_ns) of CLOCK_MONOTONIC;
    a bin cut by the window counts in proportion to the part inside (busy
    time is taken as spread evenly over the bin: at most one bin's error at
    each end)."""
    if not meter or meter.get("error") or "busy_ns" not in meter or hi_ns <= lo_ns:
        return None
    width = int(meter.get("bin_ns") or 100_000_000)
    busy = 0.0
    for i, ns in enumerate(meter["busy_ns"]):
        b0 = (int(meter["first_bin"]) + i) * width
        overlap = min(b0 + width, hi_ns) - max(b0, lo_ns)
        if overlap > 0:
            busy += ns * overlap / width
    return busy / 1e9


def call_summary(summary: dict | None, call: str) -> dict | None:
    c = ((summary or {}).get("calls") or {}).get(call)
    return c if c and c.get("available") and c.get("enabled", True) else None


def histogram_text(h: dict | None) -> str:
    if not h:
        return "none"
    return ", ".join(f"{k}: {v}" for k, v in sorted(h.items(), key=lambda kv: int(kv[0])))


def period_text(c: dict | None) -> str:
    p = (c or {}).get("period_ms") or {}
    if not p.get("n"):
        return "n/a"
    return f"{p['min']:.1f}/{p['median']:.1f}/{p['max']:.1f}"


def one_pid_share(c: dict | None) -> float | None:
    """Share of the new samples that named exactly one PID, or None without any."""
    h = (c or {}).get("pids_per_sample") or {}
    total = sum(h.values())
    return h.get("1", 0) / total if total else None


# ---------------------------------------------------------------------------
# Per run: each process's CUPTI GPU time and NVML estimate


def compare(procs: list[dict], sampler: dict) -> tuple[list[dict], list[str]]:
    """procs: dicts with tenant, share, pid, lo_ns, hi_ns, meter (or None) and
    optionally known_s/known_by (GPU time known otherwise, e.g. throughput x
    the time per iteration alone). Returns rows (adds window_s, cupti_s,
    cupti_frac, nvml_s, nvml_frac, pui_frac, and the shares of the GPU time
    used: cupti_used, nvml_used, known_used) and notes."""
    notes = []
    summary = sampler.get("summary")
    if sampler.get("error"):
        notes.append(sampler["error"])
    pu, pui = call_summary(summary, "pu"), call_summary(summary, "pui")
    rows = []
    for p in procs:
        r = dict(p)
        r["window_s"] = (p["hi_ns"] - p["lo_ns"]) / 1e9 if p.get("hi_ns") and p.get("lo_ns") else None
        meter = p.get("meter")
        r["cupti_s"] = meter_busy_s(meter, p["lo_ns"], p["hi_ns"]) if r["window_s"] else None
        r["cupti_frac"] = r["cupti_s"] / r["window_s"] if r["cupti_s"] is not None else None
        if meter is None:
            notes.append(f"{p['tenant']}: no CUPTI meter file")
        elif meter.get("error"):
            notes.append(f"{p['tenant']}: CUPTI meter: {meter['error']}")
        elif int(meter.get("dropped") or 0) > 0:
            notes.append(f"{p['tenant']}: the CUPTI meter lost {meter['dropped']} records (GPU time reads low)")
        elif not meter.get("final"):
            notes.append(f"{p['tenant']}: the CUPTI meter's file is not the final one (the process did not exit "
                         "normally): up to its last second is missing")
        rec = ((pu or {}).get("pids") or {}).get(str(p.get("pid")))
        r["nvml_s"] = rec["estimate_s"] if rec else (0.0 if pu and pu.get("primed") else None)
        r["nvml_frac"] = (rec or {}).get("fraction") if rec else (0.0 if r["nvml_s"] == 0.0 else None)
        rec_i = ((pui or {}).get("pids") or {}).get(str(p.get("pid")))
        r["pui_frac"] = (rec_i or {}).get("fraction") if rec_i else None
        rows.append(r)
    for key, used in (("cupti_frac", "cupti_used"), ("nvml_frac", "nvml_used"), ("known_s", "known_used")):
        vals = [r.get(key) for r in rows]
        total = sum(vals) if vals and all(v is not None for v in vals) else None
        for r in rows:
            r[used] = r[key] / total if total else None
    fracs = [r["cupti_frac"] for r in rows]
    if len(rows) > 1 and all(f is not None for f in fracs) and sum(fracs) > OVERLAP:
        notes.append(f"CUPTI fractions add up to {sum(fracs):.3f} > 1: the processes' kernels overlapped in time "
                     "(time-slicing or MPS), so CUPTI does not give their GPU time here")
    return rows, notes


def comparison_table(runs: list[tuple[str, list[dict]]]) -> list[str]:
    """runs: (label, rows from compare). Markdown lines."""
    out = ["| run | tenant (share) | known GPU time / window | CUPTI GPU time / window | NVML estimate / window "
           "| known share of used | CUPTI share of used | NVML share of used | NVML - CUPTI share (points) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for label, rows in runs:
        for r in rows:
            known = None if r.get("known_s") is None or not r.get("window_s") else r["known_s"] / r["window_s"]
            known_txt = fmt(known) + (f" ({r['known_by']})" if known is not None and r.get("known_by") else "")
            diff = None
            if r["nvml_used"] is not None and r["cupti_used"] is not None:
                diff = round((r["nvml_used"] - r["cupti_used"]) * 100, 1) + 0.0
            out.append(f"| {label} | {r['tenant']} ({r['share']}) | {known_txt} | {fmt(r['cupti_frac'])} "
                       f"| {fmt(r['nvml_frac'])} | {fmt(r['known_used'])} | {fmt(r['cupti_used'])} "
                       f"| {fmt(r['nvml_used'])} | {fmt(diff, '+.1f')} |")
    return out


def sampling_table(runs: list[tuple[str, dict]]) -> list[str]:
    """runs: (label, read_sampler result). One row per run and call."""
    out = ["| run | call | calls | NOT_FOUND | samples | sample period ms min/median/max | PIDs per sample "
           "| PIDs with smUtil > 0 per sample | call us median/max |",
           "|---|---|---|---|---|---|---|---|---|"]
    for label, sampler in runs:
        summary = sampler.get("summary")
        if summary is None:
            out.append(f"| {label} | - | {sampler.get('error') or 'no summary'} | | | | | | |")
            continue
        for call, name in CALLS.items():
            c = (summary.get("calls") or {}).get(call) or {}
            if not c.get("enabled", True):
                continue
            if not c.get("available"):
                out.append(f"| {label} | {name} | not available ({c.get('why', '?')}) | | | | | | |")
                continue
            cu = c.get("call_us") or {}
            per_sample = "-" if call == "gs" else histogram_text(c.get("pids_per_sample"))
            busy = "-" if call == "gs" else histogram_text(c.get("busy_pids_per_sample"))
            out.append(f"| {label} | {name} | {c.get('calls')} | {fmt(c.get('not_found_fraction'))} "
                       f"| {c.get('samples')} | {period_text(c)} | {per_sample} | {busy} "
                       f"| {fmt(cu.get('median'), '.0f')}/{fmt(cu.get('max'), '.0f')} |")
    return out


def paste_lines(label: str, sampler: dict, tenants: dict | None = None) -> list[str]:
    """The summary lines of one sampler log for docs/gpu-results.md. tenants:
    pid -> name, to name the PIDs."""
    summary = sampler.get("summary")
    if summary is None:
        return [f"- {label}: {sampler.get('error') or 'no summary'}"]
    gap = summary.get("poll_gap_ms") or {}
    out = [f"- {label}: GPU {summary.get('name')} (driver {summary.get('driver')}), {summary.get('polls')} polls "
           f"every {summary.get('interval_ms')} ms over {summary.get('seconds')} s (poll gap ms min/median/max "
           f"{fmt(gap.get('min'), '.1f')}/{fmt(gap.get('median'), '.1f')}/{fmt(gap.get('max'), '.1f')}, "
           f"{summary.get('missed_slots')} slots missed)"]
    for call, name in CALLS.items():
        c = (summary.get("calls") or {}).get(call) or {}
        if not c.get("enabled", True):
            continue
        if not c.get("available"):
            out.append(f"  - {name}: not available ({c.get('why', '?')})")
            continue
        line = (f"  - {name}: NOT_FOUND {fmt(c.get('not_found_fraction'))} of {c.get('calls')} calls; "
                f"{c.get('samples')} samples, period ms min/median/max {period_text(c)}")
        if call == "gs":
            line += f"; device busy {fmt(c.get('busy_s'))} s over {fmt(c.get('span_s'))} s"
        else:
            line += (f"; PIDs per sample {histogram_text(c.get('pids_per_sample'))} "
                     f"(with smUtil > 0: {histogram_text(c.get('busy_pids_per_sample'))})")
            ests = [f"{(tenants or {}).get(pid, 'pid ' + pid)} {v['estimate_s']:.3f} s ({fmt(v.get('fraction'))}"
                    + (f"; uncapped {v['uncapped_s']:.3f} s)" if "uncapped_s" in v else ")")
                    for pid, v in (c.get("pids") or {}).items()]
            line += f"; estimates over the {fmt(c.get('span_s'))} s polled: {', '.join(ests) or 'none'}"
            if c.get("stale") or c.get("garbage"):
                line += f"; stale records {c.get('stale')}, smUtil > 100: {c.get('garbage')}"
        out.append(line)
    return out


def suggest(sharing: list[dict], others: list[dict] = ()) -> list[str]:
    """The stand-in's knobs from sampler summaries: SIMNVML_SAMPLE_MS = the
    median gap between distinct per-process sample stamps (the median over the
    runs' medians; the device-wide nvmlDeviceGetSamples where no per-process
    call gave samples); SIMNVML_ATTRIB = instant when (nearly) every new
    sample of the runs where two processes shared the GPU (`sharing`) named
    one PID. (The stand-in's `last` also names one PID per sample: telling the
    two apart needs who ran at each sampling instant, which these figures do
    not give.)"""
    lines = []
    medians, source = [], None
    for call in ("pu", "pui", "gs"):
        for s in list(sharing) + list(others):
            c = call_summary(s, call)
            if c and (c.get("period_ms") or {}).get("n"):
                medians.append(c["period_ms"]["median"])
        if medians:
            source = CALLS[call]
            break
    if medians:
        ms = statistics.median(medians)
        lines.append(f"SIMNVML_SAMPLE_MS={max(1, round(ms))}  # median gap between distinct sample stamps of "
                     f"{source}: {ms:.1f} ms (runs: {', '.join(f'{m:.1f}' for m in medians)})")
    else:
        lines.append("SIMNVML_SAMPLE_MS: no suggestion: no call returned two distinct sample stamps")
    hist: dict[str, int] = {}
    for s in sharing:
        c = call_summary(s, "pu") or call_summary(s, "pui")
        for k, v in ((c or {}).get("pids_per_sample") or {}).items():
            hist[k] = hist.get(k, 0) + v
    total = sum(hist.values())
    if not total:
        lines.append("SIMNVML_ATTRIB: no suggestion: no per-process sample while two processes shared the GPU")
    elif hist.get("1", 0) / total >= ONE_PID:
        lines.append(f"SIMNVML_ATTRIB=instant  # {hist.get('1', 0)} of {total} samples named one PID while two "
                     "processes shared the GPU (one PID per sample; `last` would look the same here)")
    else:
        lines.append(f"SIMNVML_ATTRIB: not one PID per sample: PIDs per sample {histogram_text(hist)} over {total} "
                     "samples while two processes shared the GPU; the stand-in has no mode for that (instant and "
                     "last both name one PID)")
    return lines


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[1] != "summary":
        print(__doc__, file=sys.stderr)
        return 2
    for path in sys.argv[2:]:
        print("\n".join(paste_lines(path, read_sampler(Path(path)))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
