# shellcheck shell=bash disable=SC2154,SC2034 # $fracgpud, $build, $out, $work, $seconds, $pids, $tenants, $shares, $fracgpud_daemon_keys come from the caller; $daemon_pid, $name, $dir, $run_dir go to it
# Shell functions shared by the benchmark drivers (bench/e2e/run_e2e.sh,
# bench/gpu/run_gpu.sh). Source it; it expects $fracgpud to be set.

# require_built FILE...: each exists, or the caller's die() says to build.
require_built() {
  local f
  for f in "$@"; do
    [[ -e $f ]] || die "$f not found: build first (bash scripts/build.sh, with tests: the simulated driver)"
  done
}

# begin_simulated_work PREFIX: makes $out and makes it absolute, sets $work to
# a new directory /tmp/PREFIX-XXXXXX, puts the simulated driver of $build on
# LD_LIBRARY_PATH and its state (SIMCUDA_STATE) in $work.
begin_simulated_work() {
  mkdir -p "$out"
  out=$(realpath "$out")
  work=$(mktemp -d "/tmp/$1-XXXXXX")
  export LD_LIBRARY_PATH="$build/simcuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export SIMCUDA_STATE=$work/simulated-gpu
}

# begin_run LABEL WORKLOAD MODE: the next run, numbered so that reports keep
# the order runs were made in. Sets the caller's $name, $dir (its results,
# under $out/runs) and $run_dir (fracgpud's, under $work), creates both and
# writes $dir/run.txt, which the reports read.
runs=0
begin_run() {
  runs=$((runs + 1))
  name=$(printf '%02d-%s' "$runs" "$1")
  dir=$out/runs/$name
  run_dir=$work/$name
  mkdir -p "$dir" "$run_dir"
  printf 'workload=%s mode=%s seconds=%s\n' "$2" "$3" "$seconds" >"$dir/run.txt"
}

# wait_procs: waits for the caller's processes $pids (of tenants $tenants,
# with shares $shares; their output in $dir/OUT.out and OUT.err, OUT from
# $outs where set, else the tenant), writes $dir/procs.tsv (tenant, share,
# pid, exit status, OUT; what the reports read) and says which failed. One
# still running $seconds + 60 s after this is called, well past its run's
# window (a hostile tenant's load whose own garbage locked its tenant out,
# say), is stopped and counted as failed (status 124), so that one run
# cannot hold up the rest.
wait_procs() {
  local i rc stem whole=${seconds%%.*}
  local deadline=$((SECONDS + ${whole:-0} + 60))
  : >"$dir/procs.tsv"
  for i in "${!pids[@]}"; do
    rc=0
    while kill -0 "${pids[i]}" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
    if kill -0 "${pids[i]}" 2>/dev/null; then
      echo "$name: ${tenants[i]} still running a minute after its window: stopped" >&2
      stop "${pids[i]}"
      rc=124
    else
      wait "${pids[i]}" || rc=$?
    fi
    stem=${outs[i]:-${tenants[i]}}
    printf '%s\t%s\t%s\t%s\t%s\n' "${tenants[i]}" "${shares[i]}" "${pids[i]}" "$rc" "$stem" >>"$dir/procs.tsv"
    ((rc == 0)) || echo "$name: ${tenants[i]} exited $rc: $(tail -n 3 "$dir/$stem.err")" >&2
  done
  pids=()
  outs=()
}

# stop PID...: TERM, up to 3 s to exit, then KILL; reaps them. Only ever
# called with processes the calling script started.
stop() {
  local pid
  for pid in "$@"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "$@"; do
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
}

# end_runs_on_exit: when the caller exits (INT: status 130, TERM: 143), stops
# what it started, its processes $pids and its daemon $daemon_pid, and
# removes its $work directory.
end_runs_on_exit() {
  trap stop_runs_and_remove_work EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
}
# shellcheck disable=SC2317 # reached through the EXIT trap
stop_runs_and_remove_work() {
  stop "${pids[@]}"
  [[ -z $daemon_pid ]] || stop "$daemon_pid"
  rm -rf "$work"
}

# write_fracgpud_config RUN_DIR GPU_TABLE TENANT:SHARE[:PRIORITY[:LIMIT]]...: the
# config start_fracgpud runs with, on stdout.
write_fracgpud_config() {
  local run_dir=$1 gpu=$2 spec tenant share priority limit
  shift 2
  printf '[daemon]\nrun_dir = "%s"\nreap_interval_ms = 100\n' "$run_dir"
  [[ -z ${fracgpud_daemon_keys:-} ]] || printf '%s\n' "$fracgpud_daemon_keys"
  printf '\n[[gpu]]\n%s\n' "$gpu"
  for spec in "$@"; do
    IFS=: read -r tenant share priority limit <<<"$spec"
    printf '\n[[tenant]]\nname = "%s"\ngpus = %s\ndevices = [0]\n' "$tenant" "$share"
    [[ -z $priority ]] || printf 'priority = "%s"\n' "$priority"
    [[ -z $limit ]] || printf 'limit = %s\n' "$limit"
  done
}

# start_fracgpud DIR RUN_DIR GPU_TABLE TENANT:SHARE[:PRIORITY[:LIMIT]]...
# Writes DIR/fracgpud.toml (run dir RUN_DIR, the [[gpu]] table's keys
# GPU_TABLE, each TENANT given SHARE of that GPU and, where named, its
# `priority` (latency, normal, batch); the [daemon] table also gets
# the lines of $fracgpud_daemon_keys, if the caller set it), starts fracgpud with it
# (log: DIR/fracgpud.log; pid: $daemon_pid) and waits until every tenant's
# GPU-time arbiter is linked into its ledger. Returns 1 (with the log's tail)
# if that takes over 10 s.
start_fracgpud() {
  local dir=$1 run_dir=$2 gpu=$3 spec tenant share i
  shift 3
  write_fracgpud_config "$run_dir" "$gpu" "$@" >"$dir/fracgpud.toml"
  # fracgpud_env: extra environment for the daemon (the caller's array, if set).
  env ${fracgpud_env[@]+"${fracgpud_env[@]}"} "$fracgpud" --config "$dir/fracgpud.toml" 2>"$dir/fracgpud.log" &
  daemon_pid=$!
  for spec in "$@"; do
    tenant=${spec%%:*}
    for i in $(seq 100); do
      [[ -e $run_dir/tenants/$tenant/gputime-0 ]] && break
      if ! kill -0 "$daemon_pid" 2>/dev/null; then
        wait "$daemon_pid" || echo "fracgpud exited with status $?: $(tail -n 5 "$dir/fracgpud.log")" >&2
        daemon_pid=""
        return 1
      fi
      if ((i == 100)); then
        echo "fracgpud did not set up tenant $tenant in 10 s: $(tail -n 5 "$dir/fracgpud.log")" >&2
        return 1
      fi
      sleep 0.1
    done
  done
}
