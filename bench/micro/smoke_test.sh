#!/usr/bin/env bash
# CI smoke for the driver-call microbenchmarks: one iteration of each, one
# native/interposed pair. Checks that everything runs, reaches the driver or
# the interposer as each run claims (summarize.py), and that the CSV has a
# row with timings for every benchmark. The timings themselves mean nothing.
#   smoke_test.sh BUILD_DIR OUT_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bash "$here/run_micro.sh" "$1" "$2" --smoke
python3 -B - "$2/micro.csv" "$here/summarize.py" <<'PY'  # -B: no __pycache__ in the source tree
import csv, importlib.util, sys
spec = importlib.util.spec_from_file_location("summarize", sys.argv[2])
summarize = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summarize)
with open(sys.argv[1]) as f:
    rows = {r["benchmark"]: r for r in csv.DictReader(f)}
expected = [label for label, _, _, _ in summarize.ROWS]
missing = [label for label in expected if label not in rows]
if missing or len(rows) != len(expected):
    sys.exit(f"micro.csv: missing {missing}, has {sorted(rows)}")
for label in expected:
    if not (float(rows[label]["native_ns"]) > 0 and float(rows[label]["interposed_ns"]) > 0):
        sys.exit(f"micro.csv: {label}: no timing: {rows[label]}")
print(f"micro.csv: all {len(expected)} benchmarks present")
PY
