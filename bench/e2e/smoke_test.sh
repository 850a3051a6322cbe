#!/usr/bin/env bash
# CI smoke of the end-to-end benchmark (CTest bench_e2e_smoke): one-second
# runs; checks that every run succeeded and did work, and that the table, the
# CSVs and the plot were written. It checks no performance figure: benchmarks
# are not tests.
#
#   bash bench/e2e/smoke_test.sh BUILD_DIR OUT_DIR
set -euo pipefail
build=$1 out=$2
fail() { echo "bench_e2e_smoke: $*" >&2; exit 1; }

rm -rf "$out"
bash "$(dirname "$0")/run_e2e.sh" "$build" "$out" --smoke || fail "run_e2e.sh --smoke exited $?"
for f in e2e_table.md e2e_sharing.md e2e_runs.csv e2e_summary.csv e2e_shares.csv e2e_shares.svg; do
  [[ -s $out/$f ]] || fail "$out/$f is missing or empty"
done
# One row per process: launch, step10, step50 and alloc native + alone, compute
# native + alone + 2 tenants, the cheat and its honest neighbour without
# fracgpu and as 2 tenants.
rows=$(($(wc -l <"$out/e2e_runs.csv") - 1))
((rows == 16)) || fail "e2e_runs.csv has $rows process rows, expected 16"
# Every process exited 0 and did work (columns: ... exit=7, ops=8).
awk -F, 'NR > 1 && ($7 != 0 || $8 <= 0) { bad = 1; print "bad row: " $0 } END { exit bad }' "$out/e2e_runs.csv" >&2 ||
  fail "a workload failed or did nothing"
# The two tenants' share lines were drawn.
[[ $(grep -c '<polyline' "$out/e2e_shares.svg") -ge 2 ]] || fail "e2e_shares.svg has no tenant lines"
grep -q '^| compute | fracgpu: a=0.5, b=0.5 |' "$out/e2e_table.md" || fail "the table has no 0.5/0.5 row"
grep -q '^| cheat (cheat: cheat, honest: compute) | [0-9.]* | [0-9.]* | cheat [0-9.]*, honest [0-9.]* | cheat [0-9.]*, honest [0-9.]* |' \
  "$out/e2e_sharing.md" || fail "e2e_sharing.md has no cheat row with figures with and without fracgpu"
echo "bench_e2e_smoke: ok"
