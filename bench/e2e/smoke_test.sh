#!/usr/bin/env bash
# CI smoke of the end-to-end benchmark (CTest bench_e2e_smoke): one-second
# runs, and the latency set's two-second ones (training shape b); checks that
# every run succeeded and did work, and that the tables, the CSVs and the
# plot were written. It checks no performance figure (not the latency
# targets either): benchmarks are not tests.
#
#   bash bench/e2e/smoke_test.sh BUILD_DIR OUT_DIR
set -euo pipefail
build=$1 out=$2
fail() { echo "bench_e2e_smoke: $*" >&2; exit 1; }

rm -rf "$out"
bash "$(dirname "$0")/run_e2e.sh" "$build" "$out" --smoke || fail "run_e2e.sh --smoke exited $?"
for f in e2e_table.md e2e_sharing.md e2e_runs.csv e2e_summary.csv e2e_shares.csv e2e_shares.svg \
  e2e_latency.md e2e_latency.csv; do
  [[ -s $out/$f ]] || fail "$out/$f is missing or empty"
done
# One row per process: launch, step10, step50 and alloc native + alone, compute
# native + alone + 2 tenants, the cheat and its honest neighbour without
# fracgpu and as 2 tenants, the timed cheat and its neighbour as 2 tenants
# (gputime_load: its launches are its work).
rows=$(($(wc -l <"$out/e2e_runs.csv") - 1))
((rows == 18)) || fail "e2e_runs.csv has $rows process rows, expected 18"
grep -q '^| timed | fracgpu: cheat=0.5 (load-timed), honest=0.5 (load-compute) | cheat [0-9.]* launches/s; honest [0-9.]* launches/s |' \
  "$out/e2e_table.md" || fail "the table has no timed row with launch rates"
# Every process exited 0 and did work (columns: ... exit=7, ops=8).
awk -F, 'NR > 1 && ($7 != 0 || $8 <= 0) { bad = 1; print "bad row: " $0 } END { exit bad }' "$out/e2e_runs.csv" >&2 ||
  fail "a workload failed or did nothing"
# The two tenants' share lines were drawn.
[[ $(grep -c '<polyline' "$out/e2e_shares.svg") -ge 2 ]] || fail "e2e_shares.svg has no tenant lines"
grep -q '^| compute | fracgpu: a=0.5, b=0.5 |' "$out/e2e_table.md" || fail "the table has no 0.5/0.5 row"
grep -q '^| cheat (cheat: cheat, honest: compute) | [0-9.]* | [0-9.]* | cheat [0-9.]*, honest [0-9.]* | cheat [0-9.]*, honest [0-9.]* |' \
  "$out/e2e_sharing.md" || fail "e2e_sharing.md has no cheat row with figures with and without fracgpu"
# The latency set: the inference alone (native, under fracgpu), then shape b
# as two processes, two normal tenants and, where this fracgpud takes a
# tenant's priority, with the inference at latency (the table says when not).
lat_rows=$(($(wc -l <"$out/e2e_latency.csv") - 1))
if grep -q '^Not measured: the runs with priority' "$out/e2e_latency.md"; then want=4; else want=5; fi
((lat_rows == want)) || fail "e2e_latency.csv has $lat_rows runs, expected $want"
# Sane figures in every run (columns read by name): it succeeded, measured
# bursts, p50 <= p99 <= p99.9 above 0, the inference's GPU time in [0, 1],
# and a training that completed kernels where it ran.
python3 - "$out/e2e_latency.csv" <<'PY' || fail "e2e_latency.csv has a failed run or figures out of range"
import csv, sys
bad = 0
for r in csv.DictReader(open(sys.argv[1])):
    ok = (r["ok"] == "1" and int(r["bursts"] or 0) > 0
          and 0 < float(r["p50_ms"]) <= float(r["p99_ms"]) <= float(r["p999_ms"])
          and 0 <= float(r["inf_share"]) <= 1
          and (r["label"].startswith("inference alone") or float(r["train_rate"] or 0) > 0))
    if not ok:
        bad = 1
        print("bad latency row:", r, file=sys.stderr)
sys.exit(bad)
PY
for label in 'inference alone, native' 'inference alone, fracgpu: inf 0.25' 'both, native (2 processes)' \
  'both, fracgpu: inf 0.25 normal, train 0.75 normal'; do
  grep -qF "| $label" "$out/e2e_latency.md" || fail "e2e_latency.md has no row \"$label\""
done
grep -q '^Targets from the inference alone without fracgpu (p50 [0-9.]* ms, p99 [0-9.]* ms): p50 <= 1.05 x' \
  "$out/e2e_latency.md" || fail "e2e_latency.md has no targets"
echo "bench_e2e_smoke: ok"
