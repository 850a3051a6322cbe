#!/usr/bin/env bash
# Many processes at once: how long N tenant processes take to start, run and
# exit under the interposer, against the same N without it, and how long
# fracgpud takes to give back everything N processes held when all of them
# are killed at once (SIGKILL: no exit path of theirs runs). Users of other
# GPU-sharing layers report lock hangs and slow starts with hundreds of
# processes, and usage that stays behind after a kill.
#
#   bash bench/e2e/many_processes.sh BUILD_DIR OUT_DIR [--processes N] [--smoke]
#
# One simulated GPU, two tenants at 0.5 with N/2 processes each (a tenant
# runs at most 256 at once), held charging, no NVML, the harness's
# reap_interval_ms = 100 (the default is 200). Each process is a
# gputime_load: 1 ms kernels, 2 ms queued ahead.
#  - start: the N processes started together, each launching for 0.5 s; the
#    time until the last has exited, and how many failed. Then the same
#    without LD_PRELOAD (the simulated driver alone, no daemon in the way).
#  - kill: the N processes started together to launch for a minute; once
#    `fracgpu status` shows every one of them holding its context, all are
#    killed with SIGKILL at once; the time until `fracgpu status` shows no
#    process and no memory held (polled every 20 ms).
# Default N: 200. --smoke: N = 16 (CTest bench_many_processes_smoke: every
# process exits 0 and everything is given back; no time is checked). Writes
# OUT_DIR/many_processes.md (the table) and many_processes.csv.
# shellcheck disable=SC2034,SC2154 # fracgpud_env goes to fracgpu_run.sh; $dir, $run_dir come from its begin_run
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
die() { echo "many_processes.sh: $*" >&2; exit 2; }
(($# >= 2)) || die "usage: many_processes.sh BUILD_DIR OUT_DIR [--processes N] [--smoke]"
build=$(realpath "$1") || die "no build dir $1"
out=$2
shift 2
processes=200
while (($#)); do
  case $1 in
    --processes) processes=${2:?--processes needs a number}; shift 2 ;;
    --smoke) processes=16; shift ;;
    *) die "unknown option $1" ;;
  esac
done
[[ $processes =~ ^[1-9][0-9]*$ && $processes -ge 2 && $processes -le 512 ]] ||
  die "--processes takes 2 to 512 (two tenants of at most 256), not $processes"

fracgpud=$build/controller/fracgpud
cli=$build/controller/fracgpu
load=$build/tests/gputime_load
lib=$build/interpose/libfracgpu.so
# shellcheck source=bench/e2e/fracgpu_run.sh
source "$here/fracgpu_run.sh"
require_built "$fracgpud" "$cli" "$load" "$lib" "$build/simcuda/libcuda.so.1"
begin_simulated_work fracgpu-many
uuid=GPU-3a000000-0000-4000-8000-000000000000
export SIMCUDA_DEVICES="uuid=$uuid,name=Simulated H100,mem=80GiB,ctx=64MiB"
seconds=0.5
daemon_pid=""
pids=()
end_runs_on_exit

now_ms() { echo $(($(date +%s%N) / 1000000)); }

# start_all PRELOAD(yes|no) SECONDS: N loads, half per tenant, into $pids.
start_all() {
  local preload=$1 run_s=$2 i
  local env_preload=()
  [[ $preload == yes ]] && env_preload=(LD_PRELOAD="$lib")
  for i in $(seq "$processes"); do
    env FRACGPU_TENANT="t$((i % 2 + 1))" FRACGPU_RUN_DIR="$run_dir" ${env_preload[@]+"${env_preload[@]}"} \
      "$load" devices=0 kernels_us=1000 ahead_us=2000 seconds="$run_s" >/dev/null 2>>"$dir/loads.err" &
    pids+=("$!")
  done
}

# wait_all: waits for $pids; sets $failed to how many exited other than 0.
wait_all() {
  local pid
  failed=0
  for pid in "${pids[@]}"; do wait "$pid" || failed=$((failed + 1)); done
  pids=()
}

# held: "PROCESSES BYTES HOLDING" as `fracgpu status` lists them for both
# tenants: processes (running, or dead and not yet reclaimed), the bytes
# they hold, and how many hold some. "-1 -1 -1" if it cannot tell.
held() {
  "$cli" status --json --run-dir "$run_dir" 2>/dev/null | python3 -c '
import json, sys
s = json.load(sys.stdin)
procs = [p for t in s.get("tenants", []) for p in t.get("processes", [])]
print(len(procs), sum(p.get("total_bytes", 0) for p in procs), sum(1 for p in procs if p.get("total_bytes", 0) > 0))' ||
    echo "-1 -1 -1"
}

begin_run "many-$processes" many-processes fracgpu
start_fracgpud "$dir" "$run_dir" "uuid = \"$uuid\""$'\n'"context_memory = \"64MiB\"" t1:0.5 t2:0.5 || exit 1

# start, without and with the interposer, after an untimed round without
# it (so that neither timed round is the first to load the programs)
start_all no "$seconds"
wait_all
t0=$(now_ms)
start_all no "$seconds"
wait_all
native_ms=$(($(now_ms) - t0)) native_failed=$failed
t0=$(now_ms)
start_all yes "$seconds"
wait_all
fracgpu_ms=$(($(now_ms) - t0)) fracgpu_failed=$failed

# kill
start_all yes 60
deadline=$((SECONDS + 60 + processes / 4))
holding=0
while ((SECONDS < deadline)); do
  read -r _ _ holding < <(held)
  ((holding >= processes)) && break
  sleep 0.1
done
((holding >= processes)) || die "only $holding of $processes processes held a context within $((60 + processes / 4)) s"
t0=$(now_ms)
exec 3>&2 2>/dev/null  # the shell's "Killed" line for each of them
kill -KILL "${pids[@]}"
for pid in "${pids[@]}"; do wait "$pid" || true; done
exec 2>&3 3>&-
pids=()
left_procs=-1 left_bytes=-1
reclaim_deadline=$((SECONDS + 30))
while ((SECONDS < reclaim_deadline)); do
  read -r left_procs left_bytes _ < <(held)
  ((left_procs == 0 && left_bytes == 0)) && break
  sleep 0.02
done
reclaim_ms=$(($(now_ms) - t0))
((left_procs == 0 && left_bytes == 0)) || reclaim_ms=never
stop "$daemon_pid"
daemon_pid=""

printf 'processes,seconds_each,native_ms,native_failed,fracgpu_ms,fracgpu_failed,killed_reclaimed_ms,left_processes,left_bytes\n' \
  >"$out/many_processes.csv"
printf '%s,%s,%s,%s,%s,%s,%s,%s,%s\n' "$processes" "$seconds" "$native_ms" "$native_failed" "$fracgpu_ms" \
  "$fracgpu_failed" "$reclaim_ms" "$left_procs" "$left_bytes" >>"$out/many_processes.csv"
{
  echo "$processes processes at once, $(date -u +%Y-%m-%d), $(nproc) CPUs ($(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo)),"
  echo "fracgpu $(git -C "$here" describe --always --dirty 2>/dev/null || echo unknown), simulated driver, each launching for ${seconds} s:"
  echo
  echo "| processes | all exited, without fracgpu (ms) | failed | with fracgpu (ms) | failed | all killed at once: everything given back after (ms) |"
  echo "|---|---|---|---|---|---|"
  echo "| $processes | $native_ms | $native_failed | $fracgpu_ms | $fracgpu_failed | $reclaim_ms |"
} >"$out/many_processes.md"
cat "$out/many_processes.md"
((native_failed == 0 && fracgpu_failed == 0)) || die "$native_failed without and $fracgpu_failed with fracgpu failed: $(tail -n 3 "$dir/loads.err")"
[[ $reclaim_ms != never ]] || die "$left_procs processes and $left_bytes bytes still held 30 s after the kill"
