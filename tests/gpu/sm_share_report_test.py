#!/usr/bin/env python3
"""tests/gpu/run_sm_share.sh's report (sm_share_workload.py report) on made-up
results, without a GPU: the shares of saturating tenants are judged against
their shares (one 8 points off: exit 1), the launch-bound shapes only in their
own table (their tenants use less than their shares by design), with each
shape's busy time with and without fracgpu and the mixed pair's steps.

    sm_share_report_test.py WORK_DIR
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

here = Path(__file__).resolve().parent
work = Path(sys.argv[1])
failures = []


def check(what, ok, detail=""):
    print(("PASS" if ok else "FAIL") + f": {what}" + (f" ({detail})" if detail and not ok else ""))
    if not ok:
        failures.append(what)


def make(results: Path, off: float) -> None:
    """A results directory: matmul alone, a 0.5/0.5 split (tenant a `off` from
    its share), and the launch-bound shapes without and with fracgpu."""
    if results.exists():
        shutil.rmtree(results)
    results.mkdir(parents=True)
    (results / "accounting-probe.json").write_text(json.dumps({"state": "enabled"}))
    manifest = []
    pid = [1000]

    def group(name, tenants):
        """tenants: (tenant, share, kind, per_s, busy share of the 10 s window)"""
        d = results / name
        d.mkdir()
        acct = {"state": "enabled", "pids": {}}
        for tenant, share, kind, per_s, busy in tenants:
            pid[0] += 1
            (d / f"{tenant}.json").write_text(json.dumps(
                {"pid": pid[0], "kind": kind, "per_s": per_s, "wall_s": 10.0, "late_start_s": 0.0}))
            acct["pids"][str(pid[0])] = {"busy_s": busy * 10.0, "is_running": False, "time_ms": 10000}
            manifest.append(f"{name}\t{tenant}\t{share}\t{kind}")
        (d / "accounting.json").write_text(json.dumps(acct))

    group("baseline-before", [("a", "alone", "matmul", 100.0, 0.99)])
    group("split-0.5-0.5", [("a", "0.5", "matmul", 50.0, 0.5 + off), ("b", "0.5", "matmul", 49.0, 0.49)])
    group("pair-native-step10", [("a", "pair", "step10", 1000.0, 0.47), ("b", "pair", "step10", 1000.0, 0.47)])
    group("split-0.5_step10-0.5_step10", [("a", "0.5", "step10", 980.0, 0.43), ("b", "0.5", "step10", 990.0, 0.43)])
    group("pair-native-four-step50", [(t, "pair", "step50", 300.0, 0.24) for t in "abcd"])
    group("split-four", [(t, "0.25", "step50", 290.0, 0.23) for t in "abcd"])
    group("pair-native-mixed", [("a", "pair", "step10", 800.0, 0.44), ("b", "pair", "matmul", 52.0, 0.52)])
    group("split-mixed", [("a", "0.5", "step10", 760.0, 0.42), ("b", "0.5", "matmul", 53.0, 0.53)])
    (results / "manifest.tsv").write_text("\n".join(manifest) + "\n")


def report(results: Path):
    p = subprocess.run([sys.executable, str(here / "sm_share_workload.py"), "report", str(results)],
                       capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


make(work / "within", off=0.01)
rc, out = report(work / "within")
print(out)
check("within 5 points, launch-bound tenants below their shares: exit 0", rc == 0, f"exit {rc}")
check("the launch-bound tenants are not in the share table", "| 0.5/0.5 | a | step10" not in out)
check("a pair of step10 (each 7 points under its share): busy 0.940 without, 0.860 with, ratio 0.915",
      "| step10 | 0.940 | 0.860 | 0.915 | 0.500 / 0.500 | 0.500 / 0.500 |  |" in out)
check("four step50 tenants: busy 0.960 without, 0.920 with",
      "| 4 x step50 | 0.960 | 0.920 | 0.958 |" in out)
check("the mixed pair: busy 0.960 / 0.950, its step tenant's steps 760 against 800 (0.950)",
      "| mixed: step10 beside matmul | 0.960 | 0.950 | 0.990 | 0.458 / 0.542 | 0.442 / 0.558 | 0.950 |" in out)

make(work / "off", off=0.08)
rc, out = report(work / "off")
check("a saturating tenant 8 points off its share: exit 1", rc == 1, f"exit {rc}")
check("... and said so", "FAIL: 0.5/0.5 a: measured 0.580" in out, out[-600:])

sys.exit(1 if failures else 0)
