#!/usr/bin/env python3
"""Table of the real-GPU benchmark (bench/gpu/run_gpu.sh). Standard library only.

  gpu_report.py OUT_DIR

Reads OUT_DIR/runs/*/ (run.txt, procs.tsv, one JSON line per process) and
writes gpu_table.md (printed) and gpu_runs.csv. Per run: throughput summed
over its processes against one process alone without fracgpu ("native"), and
each process's GPU time from CUPTI over the window (its achieved share).
Targets (the issue's): fracgpu with one tenant >= 99.5% of native; two 0.5
tenants together >= 97% of one process alone. Exit 1 if a target is missed
or a run failed.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))
from e2e import fmt_rate, fmt_ratio, markdown_table, parse_kv, write_csv  # noqa: E402

TARGET_ALONE = 0.995
TARGET_HALVES = 0.97


def main() -> int:
    out = Path(sys.argv[1])
    runs = []
    for d in sorted((out / "runs").iterdir()):
        if not (d / "run.txt").exists():
            continue
        meta = parse_kv((d / "run.txt").read_text())
        procs = []
        for line in (d / "procs.tsv").read_text().splitlines():
            tenant, share, _pid, rc = line.split("\t")
            text = (d / f"{tenant}.json").read_text().strip() if (d / f"{tenant}.json").exists() else ""
            try:
                result = json.loads(text.splitlines()[-1]) if text else {}
            except json.JSONDecodeError:
                result = {}
            procs.append({"tenant": tenant, "share": share, "rc": int(rc), "ok": int(rc) == 0 and bool(result),
                          **result})
        runs.append({"name": d.name, **meta, "procs": procs})

    native = {r["workload"]: r["procs"][0]["rate"] for r in runs
              if r["mode"] == "native" and len(r["procs"]) == 1 and r["procs"][0]["ok"]}
    rows, csv_rows, misses, failed = [], [], [], 0
    for r in runs:
        ok = all(p["ok"] for p in r["procs"])
        failed += not ok
        total = sum(p.get("rate", 0) for p in r["procs"])
        base = native.get(r["workload"])
        ratio = total / base if base and ok else None
        target = ""
        if r["mode"] == "fracgpu" and [p["share"] for p in r["procs"]] == ["1"]:
            target = f">= {TARGET_ALONE}"
            if ratio is None or ratio < TARGET_ALONE:
                misses.append(r["name"])
        elif r["mode"] == "fracgpu" and [p["share"] for p in r["procs"]] == ["0.5", "0.5"]:
            target = f">= {TARGET_HALVES}"
            if ratio is None or ratio < TARGET_HALVES:
                misses.append(r["name"])
        shares = "; ".join(
            p["tenant"] + (f" ({p['share']})" if p["share"] else "") + f": {p.get('gpu_fraction', 0):.3f}"
            for p in r["procs"])
        unit = "iterations/s" if r["workload"] == "torch" else "kernels/s"
        rows.append([r["workload"], r["name"].split("-", 2)[-1], ("" if ok else "FAILED ") + f"{fmt_rate(total)} {unit}",
                     fmt_ratio(ratio), target, shares])
        for p in r["procs"]:
            csv_rows.append({"run": r["name"], "workload": r["workload"], "mode": r["mode"], "tenant": p["tenant"],
                             "share": p["share"], "exit": p["rc"], "rate": p.get("rate", ""),
                             "seconds": p.get("seconds", ""), "gpu_time_s": p.get("gpu_time_s", ""),
                             "gpu_fraction": p.get("gpu_fraction", ""), "vs_native_run": fmt_ratio(ratio)})
    write_csv(out / "gpu_runs.csv", csv_rows, ["run", "workload", "mode", "tenant", "share", "exit", "rate",
                                               "seconds", "gpu_time_s", "gpu_fraction", "vs_native_run"])
    text = markdown_table(["workload", "run", "throughput (sum)", "vs native alone", "target",
                           "GPU time / window per process (CUPTI)"], rows)
    verdict = ("all targets met" if not misses and not failed else
               f"targets missed: {', '.join(misses) or 'none'}; failed runs: {failed}")
    (out / "gpu_table.md").write_text(text + "\n\n" + verdict + "\n")
    print(text + "\n\n" + verdict)
    return 1 if misses or failed else 0


if __name__ == "__main__":
    sys.exit(main())
