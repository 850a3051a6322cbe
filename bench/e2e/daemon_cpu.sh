#!/usr/bin/env bash
# What fracgpud itself costs the node: its CPU time (user and system) and
# how often its threads wake, while tenants share one simulated GPU, from
# none at all to 32 processes. The daemon runs as in bench/e2e/run_e2e.sh
# (held charging, the stand-in NVML sampling every 167 ms); each tenant
# process is a gputime_load under the interposer.
#
#   bash bench/e2e/daemon_cpu.sh BUILD_DIR OUT_DIR [--seconds N] [--asleep N] [--smoke]
#
# Shapes (tenants x processes each, at equal shares): idle (2 tenants, no
# process), 1of2 (2 tenants with `limit = 1.0`, one saturating process of
# the first: a GPU running one tenant's work, which may use all of it),
# 2x1, 4x2 and 8x4 saturating (2 ms kernels queued 2 ms ahead),
# 8x4 launch-bound (50 us kernels, 60 us of CPU work after each), 2x32
# asleep (64 processes that launched for 0.2 s, then launch nothing: a
# node's idle notebooks and servers; --asleep N: N processes, half each);
# then idle, 8x4 saturating and the asleep shape again with no NVML (held
# charging unaudited): the
# stand-in NVML computes its samples inside the daemon's process, so the
# difference is the meter's share, at the stand-in's cost, not the real
# NVML's (unknown until a GPU). Each is
# measured over N seconds (default 10) after 2 s of warm-up (asleep: 6 s and
# a second per 32 processes, for all of them to have started), from
# /proc/<fracgpud>/task/*/stat and status; the tenant processes' wakeups
# (all their threads: the interposer's pacer among them) too. --smoke: idle and 2x1 only, 1 s
# each (CTest bench_daemon_cpu_smoke: the harness works; no figure is
# checked). Writes OUT_DIR/daemon_cpu.md (the table) and daemon_cpu.csv.
# The tenant processes share the host's CPUs with the daemon: on a host with
# fewer cores than processes the figures include the daemon's waits for a
# CPU (its scheduler thread runs at real-time priority where it may).
# shellcheck disable=SC2034,SC2154 # fracgpud_env goes to fracgpu_run.sh; $dir, $run_dir come from its begin_run
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
die() { echo "daemon_cpu.sh: $*" >&2; exit 2; }
(($# >= 2)) || die "usage: daemon_cpu.sh BUILD_DIR OUT_DIR [--seconds N] [--asleep N] [--smoke]"
build=$(realpath "$1") || die "no build dir $1"
out=$2
shift 2
seconds=10 smoke=0 asleep=64
while (($#)); do
  case $1 in
    --seconds) seconds=${2:?--seconds needs a number}; shift 2 ;;
    --asleep) asleep=${2:?--asleep needs a number}; shift 2 ;;
    --smoke) smoke=1 seconds=1; shift ;;
    *) die "unknown option $1" ;;
  esac
done
[[ $seconds =~ ^[1-9][0-9]*$ ]] || die "--seconds takes a whole number of seconds, not $seconds"
[[ $asleep =~ ^[1-9][0-9]*$ && $asleep -ge 2 && $asleep -le 512 ]] || die "--asleep takes 2 to 512 processes, not $asleep"

fracgpud=$build/controller/fracgpud
load=$build/tests/gputime_load
lib=$build/interpose/libfracgpu.so
# shellcheck source=bench/e2e/fracgpu_run.sh
source "$here/fracgpu_run.sh"
require_built "$fracgpud" "$load" "$lib" "$build/simcuda/libcuda.so.1" "$build/simnvml/libnvidia-ml.so.1"
begin_simulated_work fracgpu-daemon-cpu
with_nvml=(LD_LIBRARY_PATH="$build/simnvml:$LD_LIBRARY_PATH" SIMNVML_SAMPLE_MS=167 SIMNVML_ATTRIB=instant)
uuid=GPU-dc000000-0000-4000-8000-000000000000
export SIMCUDA_DEVICES="uuid=$uuid,name=Simulated H100,mem=16GiB,ctx=64MiB"

daemon_pid=""
pids=()
end_runs_on_exit

hz=$(getconf CLK_TCK)
# cpu_of PID: "user_ticks system_ticks wakeups" summed over its threads
# (wakeups: voluntary context switches, each a sleep the thread woke from).
cpu_of() {
  local task user=0 sys=0 wakes=0 stat
  for task in /proc/"$1"/task/*; do
    stat=$(cat "$task/stat" 2>/dev/null) || continue
    stat=${stat##*) }  # the fields after the command name
    read -r -a f <<<"$stat"
    user=$((user + f[11])) sys=$((sys + f[12]))
    wakes=$((wakes + $(awk '/^voluntary_ctxt_switches/ {print $2}' "$task/status" 2>/dev/null || echo 0)))
  done
  echo "$user $sys $wakes"
}

# wakeups_of PID...: voluntary context switches of all their threads.
wakeups_of() {
  local pid wakes total=0
  for pid in "$@"; do
    read -r _ _ wakes < <(cpu_of "$pid")
    total=$((total + wakes))
  done
  echo "$total"
}

if ((smoke)); then shapes=("idle 2 0 - yes" "2x1 2 1 saturating yes"); else
  shapes=("idle 2 0 - yes" "1of2 2 1 alone yes" "2x1 2 1 saturating yes" "4x2 4 2 saturating yes" "8x4 8 4 saturating yes"
    "8x4 8 4 launch-bound yes" "2x$((asleep / 2)) 2 $((asleep / 2)) asleep yes" "idle 2 0 - no"
    "8x4 8 4 saturating no" "2x$((asleep / 2)) 2 $((asleep / 2)) asleep no")
fi
printf 'shape,tenants,processes,kind,nvml,seconds,user_ms_per_s,system_ms_per_s,cpu_percent_of_a_core,wakeups_per_s,tenant_wakeups_per_s\n' \
  >"$out/daemon_cpu.csv"
for shape in "${shapes[@]}"; do
  read -r label tenants per kind nvml <<<"$shape"
  begin_run "$label" daemon-cpu fracgpu
  if [[ $nvml == yes ]]; then fracgpud_env=("${with_nvml[@]}"); else fracgpud_env=(); fi
  specs=()
  share=$(awk -v n="$tenants" 'BEGIN { printf "%.4f", 1 / n }')
  limit=""
  [[ $kind != alone ]] || limit=1.0
  for t in $(seq "$tenants"); do specs+=("t$t:$share${limit:+::$limit}"); done
  start_fracgpud "$dir" "$run_dir" "uuid = \"$uuid\""$'\n'"context_memory = \"64MiB\"" "${specs[@]}" || exit 1
  case $kind in
    saturating | alone) args=(kernels_us=2000 ahead_us=2000) ;;
    launch-bound) args=(kernels_us=50 host_us=60) ;;
    # 0.2 s of launches, then asleep past the measurement (pause_ms only
    # applies with something to resume: 1 ms of it, never reached).
    asleep) args=(kernels_us=50 "pause_ms=$(((seconds + 30) * 1000)),1") ;;
    *) args=() ;;
  esac
  # Many processes starting on a small host take a while: the asleep shapes
  # wait longer for all of them to be asleep before measuring.
  run_s=$((seconds + 4)) warm=2
  [[ $kind == asleep ]] && run_s=0.2 warm=$((6 + asleep / 32))
  users=$tenants
  [[ $kind != alone ]] || users=1  # one tenant at work, the others configured and away
  for t in $(seq "$users"); do
    for _ in $(seq "$per"); do
      env FRACGPU_TENANT="t$t" FRACGPU_RUN_DIR="$run_dir" LD_PRELOAD="$lib" "$load" devices=0 "${args[@]}" \
        seconds="$run_s" >/dev/null 2>>"$dir/loads.err" &
      pids+=("$!")
    done
  done
  sleep "$warm"
  read -r u0 s0 w0 < <(cpu_of "$daemon_pid")
  tw0=$(wakeups_of ${pids[@]+"${pids[@]}"})
  t0=$(date +%s%N)
  sleep "$seconds"
  read -r u1 s1 w1 < <(cpu_of "$daemon_pid")
  tw1=$(wakeups_of ${pids[@]+"${pids[@]}"})
  t1=$(date +%s%N)
  stop "${pids[@]}"
  pids=()
  stop "$daemon_pid"
  daemon_pid=""
  awk -v l="$label" -v t="$tenants" -v p=$((users * per)) -v k="$kind" -v n="$nvml" -v hz="$hz" -v ns=$((t1 - t0)) \
    -v u=$((u1 - u0)) -v s=$((s1 - s0)) -v w=$((w1 - w0)) -v tw=$((tw1 - tw0)) 'BEGIN {
      sec = ns / 1e9; user = u * 1000 / hz / sec; sys = s * 1000 / hz / sec
      printf "%s,%d,%d,%s,%s,%.1f,%.1f,%.1f,%.1f,%.0f,%.0f\n", l, t, p, k, n, sec, user, sys, (user + sys) / 10, w / sec, tw / sec }' \
    >>"$out/daemon_cpu.csv"
done

{
  echo "fracgpud's own CPU time, $(date -u +%Y-%m-%d), $(nproc) CPUs ($(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo)),"
  echo "fracgpu $(git -C "$here" describe --always --dirty 2>/dev/null || echo unknown), ${seconds} s per shape, held charging, stand-in NVML at 167 ms where used:"
  echo
  echo "| shape | tenants | processes | their load | NVML | daemon user (ms/s) | system (ms/s) | % of one core | wakeups/s | tenant processes' wakeups/s |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
  awk -F, 'NR > 1 { printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $7, $8, $9, $10, $11 }' "$out/daemon_cpu.csv"
} >"$out/daemon_cpu.md"
cat "$out/daemon_cpu.md"
