#!/usr/bin/env bash
# End-to-end benchmark on the simulated driver (docs/performance.md, "Workloads
# end to end").
#
#   bash bench/e2e/run_e2e.sh BUILD_DIR OUT_DIR [--smoke] [--seconds N] [--held]
#        [--sample-ms N] [--charging held|measured] [--guard-ms N] [--realistic]
#        [--only workloads|latency|hostile] [--sched timeslice|queue] [--attrib instant|last]
#
# fracgpud runs with the stand-in NVML (BUILD_DIR/simnvml), which measures each
# process's GPU time from the simulated driver, exactly, on every call; --held
# leaves NVML out, as on a node without NVML (GPU time held, one tenant at a
# time; the option is older than, and not the same as, --charging held, which
# keeps NVML). --sample-ms N makes the stand-in sample as the real one does:
# every N ms (SIMNVML_SAMPLE_MS=N), each sample naming the process on the GPU
# at its instant (SIMNVML_ATTRIB=instant), in fracgpud's environment only.
# --charging writes `gpu_time_charging = "held"|"measured"` into the [daemon]
# table of each generated config (only when given: otherwise the daemon's
# default; runs/*/status.json's "charging" says which it used). --sched picks
# the simulated driver's model (SIMCUDA_SCHED: timeslice, its default, where
# processes take turns in 1024 us slices as on a GPU; queue, one first-come
# queue of every process's kernels). --attrib picks which process a sampling
# stand-in NVML names in each sample (SIMNVML_ATTRIB: instant, the default, the
# one resident at the sampling instant; last, the one that ran last in the
# period). --realistic
# runs the whole set twice, with --sample-ms 167 and 1000, into
# OUT_DIR/sample-167ms and OUT_DIR/sample-1000ms (other options passed on).
#
# For each workload of bench/e2e/e2e_workload.cpp (launch-bound, compute-bound,
# allocation-heavy, and the interactive step loop with 10 us and 50 us kernels:
# step10, step50, one thread launching with CPU work between launches, nothing
# queued ahead) it runs, each for N seconds (default 10; --smoke: 1 s and
# fewer runs, what CI runs):
#   - native: one process on the simulated GPU, no interposer;
#   - fracgpu alone: the same under libfracgpu.so as the only tenant (gpus = 1);
#   - native, 2 processes: what the driver's own time-slicing gives;
#   - fracgpu, tenants with shares: 0.5/0.5 (each workload), 0.2/0.3/0.5 and
#     0.1/0.9 (compute);
#   - four step50 processes natively, and as four 0.25 tenants; step10 beside
#     compute natively, and as 0.5 / 0.5 tenants with the compute one's limit
#     1.0 (the mixed pair); compute alone as a 0.3 tenant capped at 0.3;
# and the cheat: a tenant `cheat` (mode=cheat: 2 ms kernels, none on the GPU
# from --guard-ms, default 8, before each sampling instant of the stand-in
# NVML, k x the sampling period of CLOCK_MONOTONIC (--sample-ms; 167 without
# it), until 1 ms after) beside an honest compute-bound tenant `honest`: two
# processes without fracgpu, and two 0.5 tenants with it (also in --smoke).
# Two more hostile shapes, each as two processes without fracgpu and as two
# 0.5 tenants with it (--smoke: timed with fracgpu only), run by
# tests/probe/gputime_load:
#   - timed: the long kernel timed between samples (`cheat`: 1 ms after each
#     sampling instant one 50 us kernel, then one kernel that ends --guard-ms
#     before the next instant, waited for) beside `honest` (1 ms kernels);
#   - flood: two light step loops (50 us kernels, 60 us of host work, 3.2 ms
#     queued at most), `light` and `flood`; from 2 s on, `flood` launches
#     20 ms kernels back to back, 100 ms queued ahead;
#   - slice (not in --smoke): `flood` as above, lengthening its contexts'
#     time slice to 10 ms when its flood starts (gputime_load
#     flood_slice_us), beside `light`.
# And the cheat beside a light step50 tenant `light` (dodge; not in --smoke):
# a pair that may hold the GPU side by side. And (not in --smoke) a hostile
# tenant `cheat` whose container runs a load of 1 ms kernels and an attack
# beside it (bench/e2e/tenant_attack.sh), beside `honest` (1 ms kernels),
# each as two tenants without fracgpu and as two 0.5 tenants with it:
#   - processes without the interposer (root only: the tenant's container is
#     a mount namespace holding its tenant directory): plain (a second load),
#     chain (only short-lived processes, one per sampling period, each gone
#     2 ms after its sample), chain-gated (the load and the chain),
#     bypass-dodge (the load and a process that stays off the GPU around
#     each sampling instant), and bypass-dodge-terminate (the same, fracgpud
#     with audit_action = "terminate" and audit_interval = "1s");
#   - its own usage file written (tests/usage_attacker): false-drain (its
#     load's slot says it drained every grant at once), and garbage in every
#     word: past-times, own-pid, contexts.
# A second table, e2e_sharing.md: for every workload (and the cheat), the GPU's
# busy time and each tenant's share of the GPU time used, two processes
# without fracgpu beside two 0.5 tenants with it, and what fracgpu charged
# each tenant (its status's used_ns over the run).
# samples every tenant's device time from the simulated driver every 250 ms
# (the ground truth), and writes to OUT_DIR: e2e_table.md (printed), CSVs,
# e2e_shares.svg, and runs/<run>/ with each process's output, the daemon's log
# and `fracgpu status --json` (status_begin.json near the start, status.json
# near the end).
#
# The latency set (issue 24; docs/performance.md, "Inference beside training
# (latency tenants)"): an inference tenant `inf` (e2e_workload mode=inference:
# bursts of 20 x 100 us kernels arriving every 10 ms +- 1 ms, one thread, each
# burst's latency from its first launch to its synchronize) beside a training
# tenant `train` (mode=training, 2 ms kernels), in two shapes: (a) one kernel
# in flight (launch, synchronize, launch...), (b) 1000 in flight (queued
# ahead, as PyTorch does). Its runs:
#   - inference alone, native (the reference of the targets);
#   - inference alone under fracgpu: the only tenant, with what it has in the
#     latency run (gpus = 0.25, priority latency): what fracgpu's cap and
#     pacing cost it with no neighbour; once for both shapes (nothing in it
#     depends on the shape);
#   - per shape: the pair as two native processes; the pair under fracgpu,
#     both normal (inf 0.25, train 0.75 with limit 1.0: it may use what the
#     inference leaves); the pair with inf priority latency;
#   - training that pushes (not in --smoke), natively and beside the
#     inference at latency: split4 and split8, 2 ms kernels with 2 s queued
#     ahead in 4 (8) processes of the training tenant; prefix, one process
#     queuing 100 x 10 us kernels, then 10 x 20 ms, in a loop (gputime_load).
# A fracgpud that refuses `priority` in a config (checked first with
# fracgpud --check) leaves the runs that need it out, said in the table.
# The fracgpu runs of the set always sample with the realistic stand-in NVML
# (SIMNVML_SAMPLE_MS=--sample-ms, else 167; SIMNVML_ATTRIB=instant): exact
# per-call figures would be kinder to the pacing than a real GPU's. Each run
# lasts --seconds (default 10; --smoke: 2 s, shape b only). Writes
# e2e_latency.md (printed) and e2e_latency.csv: per run, the inference's
# p50/p99/p99.9 burst latency, bursts, each tenant's GPU time (the simulated
# driver's ground truth, as the other runs), the training's fraction of the
# time the inference leaves, and the issue's targets from the native alone
# run (p50 <= 1.05 x alone, p99 <= 1.10 x alone + 2 ms) and whether each is
# met (figures only: the exit status does not depend on them).
# --only runs one set: workloads (everything above the latency set),
# latency, or hostile (the cheats of the workloads set alone: the
# phase-locked cheat beside a compute-bound and a light tenant, the long
# kernel timed between samples, the light tenant beside a flood and beside
# a flood of a lengthened slice, and the hostile containers; their tables
# are the workloads set's). Exit 0 when every run succeeded.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "run_e2e.sh: $*" >&2; exit 2; }

build="" out="" smoke=0 seconds="" held=0 sample_ms="" charging="" guard_ms=8 realistic=0 only=""
sched=timeslice attrib=instant
pass_on=()  # options for --realistic's runs
while (($#)); do
  case $1 in
    --smoke) smoke=1; pass_on+=("$1"); shift ;;
    --held) held=1; pass_on+=("$1"); shift ;;
    --realistic) realistic=1; shift ;;
    --seconds) seconds=${2:?--seconds needs a value}; pass_on+=("$1" "$2"); shift 2 ;;
    --sample-ms) sample_ms=${2:?--sample-ms needs a value}; shift 2 ;;
    --charging) charging=${2:?--charging needs a value}; pass_on+=("$1" "$2"); shift 2 ;;
    --guard-ms) guard_ms=${2:?--guard-ms needs a value}; pass_on+=("$1" "$2"); shift 2 ;;
    --only) only=${2:?--only needs a value}; pass_on+=("$1" "$2"); shift 2 ;;
    --sched) sched=${2:?--sched needs a value}; pass_on+=("$1" "$2"); shift 2 ;;
    --attrib) attrib=${2:?--attrib needs a value}; pass_on+=("$1" "$2"); shift 2 ;;
    -h | --help) usage; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) if [[ -z $build ]]; then build=$1; elif [[ -z $out ]]; then out=$1; else die "unexpected argument $1"; fi; shift ;;
  esac
done
[[ -n $build && -n $out ]] || { usage >&2; exit 2; }
[[ -z $only || $only == workloads || $only == latency || $only == hostile ]] ||
  die "--only takes workloads, latency or hostile, not $only"
# The latency set's runs: a few hundred bursts even in the smoke.
latency_seconds=${seconds:-$((smoke ? 2 : 10))}
seconds=${seconds:-$((smoke ? 1 : 10))}
[[ $seconds =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "--seconds takes a number of seconds, not $seconds"
[[ -z $sample_ms || $sample_ms =~ ^[1-9][0-9]*$ ]] || die "--sample-ms takes a whole number of ms above 0, not $sample_ms"
[[ -z $charging || $charging == held || $charging == measured ]] || die "--charging takes held or measured, not $charging"
[[ $guard_ms =~ ^[0-9]+$ ]] || die "--guard-ms takes a whole number of ms, not $guard_ms"
[[ $sched == timeslice || $sched == queue ]] || die "--sched takes timeslice or queue, not $sched"
[[ $attrib == instant || $attrib == last ]] || die "--attrib takes instant or last, not $attrib"
((!held || !realistic)) || die "--realistic samples with the stand-in NVML: not with --held (no NVML)"
[[ -z $sample_ms ]] || ((!held)) || die "--sample-ms is the stand-in NVML's: not with --held (no NVML)"
[[ -z $sample_ms ]] || ((!realistic)) || die "--realistic sets --sample-ms itself (167, then 1000)"

if ((realistic)); then
  # The whole set at each realistic sampling period, one output folder each.
  mkdir -p "$out"
  rc=0
  for period in 167 1000; do
    echo "== --sample-ms $period (its tables: $out/sample-${period}ms.log)" >&2
    bash "$0" "$build" "$out/sample-${period}ms" --sample-ms "$period" ${pass_on[@]+"${pass_on[@]}"} \
      >"$out/sample-${period}ms.log" || {
      r=$?
      ((rc)) || rc=$r
      echo "run_e2e.sh: --sample-ms $period exited $r" >&2
    }
  done
  for period in 167 1000; do
    echo
    echo "== SIMNVML_SAMPLE_MS=$period ($out/sample-${period}ms)"
    tables=0
    for f in e2e_table e2e_sharing e2e_latency; do
      [[ -s $out/sample-${period}ms/$f.md ]] || continue
      ((tables == 0)) || echo
      cat "$out/sample-${period}ms/$f.md"
      tables=$((tables + 1))
    done
    ((tables)) || echo "(no table: the runs failed; see above)"
  done
  exit "$rc"
fi
# The cheat dodges the sampling instants of this period (exact mode has none:
# it keeps the realistic default's, so its pattern is the same).
cheat_period_ms=${sample_ms:-167}

build=$(realpath "$build") || die "no build dir $1"
workload=$build/bench/e2e/e2e_workload
load=$build/tests/gputime_load  # the hostile shapes' workload
fracgpud=$build/controller/fracgpud
fracgpu=$build/controller/fracgpu
lib=$build/interpose/libfracgpu.so
simdir=$build/simcuda
for f in "$workload" "$load" "$build/tests/usage_attacker" "$fracgpud" "$fracgpu" "$lib" "$simdir/libcuda.so.1"; do
  [[ -e $f ]] || die "$f not found: build first (bash scripts/build.sh, with tests: the simulated driver)"
done
py() { python3 "$here/e2e.py" "$@"; }
# shellcheck source=bench/e2e/fracgpu_run.sh
source "$here/fracgpu_run.sh"

mkdir -p "$out"
out=$(realpath "$out")
rm -rf "$out/runs" && mkdir -p "$out/runs"
# Run dirs and the simulated GPU's state live under /tmp: short paths, and
# nothing of them is a result.
work=$(mktemp -d /tmp/fracgpu-e2e-XXXXXX)
export LD_LIBRARY_PATH="$simdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fracgpud_env=()
((held)) || fracgpud_env=(LD_LIBRARY_PATH="$build/simnvml:$LD_LIBRARY_PATH")
[[ -z $sample_ms ]] || fracgpud_env+=(SIMNVML_SAMPLE_MS="$sample_ms" SIMNVML_ATTRIB="$attrib")
# Extra [daemon] keys of each generated config (fracgpu_run.sh).
fracgpud_daemon_keys=""
[[ -z $charging ]] || fracgpud_daemon_keys="gpu_time_charging = \"$charging\""
export SIMCUDA_STATE=$work/simulated-gpu
export SIMCUDA_SCHED=$sched
uuid=GPU-e2e00000-0000-4000-8000-000000000000
export SIMCUDA_DEVICES="uuid=$uuid,name=Simulated H100,mem=16GiB,ctx=64MiB"

daemon_pid=""
pids=()
end_runs_on_exit

# The e2e_workload arguments of a workload name: stepN is mode=step with N us
# kernels; cheat dodges the sampling instants of $cheat_period_ms; training-a
# and training-b are the training's shapes (1 and 1000 kernels in flight).
workload_args() {
  case $1 in
    step*) echo "mode=step kernel_us=${1#step}" ;;
    training-a) echo "mode=training inflight=1" ;;
    training-b) echo "mode=training inflight=1000" ;;
    cheat) echo "mode=cheat period_ms=$cheat_period_ms guard_ms=$guard_ms" ;;
    *) echo "mode=$1" ;;
  esac
}

# The gputime_load arguments of a hostile shape's workload (load-NAME).
load_args() {
  case $1 in
    load-timed) echo "devices=0 kernels_us=50 timed_ms=$cheat_period_ms guard_ms=$guard_ms" ;;
    load-compute) echo "devices=0 kernels_us=1000" ;;
    load-light) echo "devices=0 kernels_us=50 host_us=60 ahead_us=3200" ;;
    load-flood) echo "devices=0 kernels_us=50,20000 host_us=60 ahead_us=3200 flood_after_ms=2000" ;;
    load-train) echo "devices=0 kernels_us=2000 ahead_us=2000000" ;;
    load-prefix)
      local kernels
      kernels=$(printf '10,%.0s' $(seq 100))$(printf '20000,%.0s' $(seq 10))
      echo "devices=0 kernels_us=${kernels%,} ahead_us=2000000"
      ;;
    *) die "no workload $1" ;;
  esac
}

# The command line of a workload: e2e_workload's, gputime_load's for load-*,
# or for attack-KIND a hostile tenant's load and attack (tenant_attack.sh).
workload_command() {
  case $1 in
    # A process may set its own contexts' time slice whenever it likes
    # (docs/sm-time.md, "A tenant that lengthens its own slice"): this one
    # does when its flood starts, so that nothing before gives it away.
    load-slice) echo "$load $(load_args load-flood) flood_slice_us=10000" ;;
    load-*) echo "$load $(load_args "$1")" ;;
    attack-*) echo "bash $here/tenant_attack.sh ${1#attack-} $build $cheat_period_ms $guard_ms" ;;
    *) echo "$workload $(workload_args "$1")" ;;
  esac
}

# status_at NS FILE: `fracgpu status --json` into FILE at CLOCK_MONOTONIC NS
# (FILE.ns: when it was read).
status_at() {
  python3 -c 'import sys, time; time.sleep(max(0.0, (int(sys.argv[1]) - time.clock_gettime_ns(time.CLOCK_MONOTONIC)) / 1e9))' "$1"
  py now >"$2.ns"
  "$fracgpu" status --run-dir "$run_dir" --json >"$2" 2>&1 || true
}

# run NAME WORKLOAD MODE TENANT[:SHARE[:WORKLOAD[:PRIORITY[:LIMIT[:COUNT]]]]]...
# MODE native: each TENANT is one process without the interposer. MODE
# fracgpu: a fresh fracgpud whose config gives each TENANT its SHARE of GPU 0
# (and its PRIORITY and LIMIT, where named), one process each (COUNT
# processes, where named: their output in TENANT.out, TENANT.2.out, ...),
# from a common start. A
# TENANT's own WORKLOAD replaces the run's (run.txt then says
# mix=TENANT:WORKLOAD,...). $run_set, when set, goes to run.txt as set=
# (the report keeps the latency set's runs out of the workloads' tables).
run() {
  local name dir run_dir wl=$2 mode=$3 spec tenant share twl priority limit count k stem mix="" prio="" limits=""
  begin_run "$1" "$wl" "$mode"
  shift 3
  for spec in "$@"; do
    IFS=: read -r tenant share twl priority limit count <<<"$spec"
    [[ -z $twl ]] || mix+="${mix:+,}$tenant:$twl"
    [[ -z $priority ]] || prio+="${prio:+,}$tenant:$priority"
    [[ -z $limit ]] || limits+="${limits:+,}$tenant:$limit"
  done
  [[ -z $mix ]] || printf 'mix=%s\n' "$mix" >>"$dir/run.txt"
  [[ -z $prio ]] || printf 'priority=%s\n' "$prio" >>"$dir/run.txt"
  [[ -z $limits ]] || printf 'limit=%s\n' "$limits" >>"$dir/run.txt"
  [[ -z ${run_set:-} ]] || printf 'set=%s\n' "$run_set" >>"$dir/run.txt"
  # A tenant with processes the sampler cannot follow (a chain of short-lived
  # ones): its GPU time is the device's less everyone else's.
  [[ -z ${run_rest:-} ]] || printf 'rest=%s\n' "$run_rest" >>"$dir/run.txt"
  if [[ $mode == fracgpu ]]; then
    local -a daemon_specs=()
    for spec in "$@"; do
      IFS=: read -r tenant share twl priority limit count <<<"$spec"
      daemon_specs+=("$tenant:$share:$priority:$limit")
    done
    start_fracgpud "$dir" "$run_dir" "uuid = \"$uuid\""$'\n'"context_memory = \"64MiB\"" "${daemon_specs[@]}" || exit 1
  fi
  # A common start, after every process has had time to create its context.
  local start=$(($(py now) + 700000000)) tenants=() shares=() procs=()
  pids=()
  outs=()
  for spec in "$@"; do
    IFS=: read -r tenant share twl priority limit count <<<"$spec"
    local -a vars=() extra=()
    if [[ $mode == fracgpu ]]; then
      vars=(FRACGPU_TENANT="$tenant" FRACGPU_RUN_DIR="$run_dir" LD_PRELOAD="$lib")
    fi
    # Every burst's latency, for a look beyond the percentiles.
    [[ ${twl:-$wl} != inference ]] || extra=(latency_file="$dir/$tenant.latencies")
    for ((k = 1; k <= ${count:-1}; k++)); do
      stem=$tenant
      ((k == 1)) || stem=$tenant.$k
      # shellcheck disable=SC2046 # the workload's arguments are words on purpose
      env "${vars[@]}" $(workload_command "${twl:-$wl}") ${extra[@]+"${extra[@]}"} seconds="$seconds" start_ns="$start" \
        >"$dir/$stem.out" 2>"$dir/$stem.err" &
      pids+=("$!")
      tenants+=("$tenant")
      shares+=("${share:-}")
      outs+=("$stem")
      procs+=("$!:$tenant")
    done
  done
  py sample --lib "$simdir/libcuda.so.1" --start-ns "$start" --seconds "$seconds" --out "$dir/samples.csv" \
    "${procs[@]}" &
  local sampler=$!
  if [[ $mode == fracgpu ]]; then
    # Where the report's figures begin (1 s in; half-way for shorter runs)
    # and near the end of the window: the daemon's own figures (what it
    # charged each tenant: the change of used_ns between the two).
    local ms
    ms=$(python3 -c 'import sys; print(int(float(sys.argv[1]) * 1000))' "$seconds")
    status_at "$((start + (ms < 2000 ? ms / 2 : 1000) * 1000000))" "$dir/status_begin.json"
    status_at "$((start + ms * 900000))" "$dir/status.json"
  fi
  wait_procs
  wait "$sampler" || echo "run_e2e.sh: $name: the sampler failed" >&2
  if [[ -n $daemon_pid ]]; then
    stop "$daemon_pid"
    daemon_pid=""
  fi
  echo "  $name done" >&2
}

if [[ $only != latency ]]; then
  echo "== end-to-end workloads on the simulated driver, $seconds s each, into $out" >&2
  wls="launch step10 step50 compute alloc"
  [[ $only != hostile ]] || wls=""
  for wl in $wls; do
    run "$wl-native" "$wl" native a
    run "$wl-fracgpu-alone" "$wl" fracgpu a:1
    if ((smoke)); then
      [[ $wl != compute ]] || run "$wl-fracgpu-0.5-0.5" "$wl" fracgpu a:0.5 b:0.5
      continue
    fi
    run "$wl-native-2" "$wl" native a b
    run "$wl-fracgpu-0.5-0.5" "$wl" fracgpu a:0.5 b:0.5
    if [[ $wl == compute ]]; then
      run "$wl-fracgpu-0.2-0.3-0.5" "$wl" fracgpu a:0.2 b:0.3 c:0.5
      run "$wl-fracgpu-0.1-0.9" "$wl" fracgpu a:0.1 b:0.9
    fi
  done
  if ((!smoke)) && [[ $only != hostile ]]; then
    # The side-by-side shapes beyond pairs: four light tenants of 0.25; a
    # light tenant beside a compute-bound one that may use what it leaves
    # (limit 1.0); and a cap alone (limit = share = 0.3).
    run step50-native-4 step50 native a b c d
    run step50-fracgpu-0.25x4 step50 fracgpu a:0.25 b:0.25 c:0.25 d:0.25
    run mixed-native-2 step10 native a b::compute
    run mixed-fracgpu-0.5-0.5 step10 fracgpu a:0.5 b:0.5:compute::1.0
    run compute-fracgpu-cap-0.3 compute fracgpu a:0.3:::0.3
  fi
  # The cheat beside an honest compute-bound tenant, without fracgpu and with it.
  run cheat-native-2 cheat native cheat::cheat honest::compute
  run cheat-fracgpu-0.5-0.5 cheat fracgpu cheat:0.5:cheat honest:0.5:compute
  ((smoke)) || run timed-native-2 timed native cheat::load-timed honest::load-compute
  run timed-fracgpu-0.5-0.5 timed fracgpu cheat:0.5:load-timed honest:0.5:load-compute
  if ((!smoke)); then
    run flood-native-2 flood native light::load-light flood::load-flood
    run flood-fracgpu-0.5-0.5 flood fracgpu light:0.5:load-light flood:0.5:load-flood
    run slice-native-2 slice native light::load-light flood::load-slice
    run slice-fracgpu-0.5-0.5 slice fracgpu light:0.5:load-light flood:0.5:load-slice
    # The phase-locked cheat beside a light tenant: a pair that may hold the
    # GPU side by side, where the cheat's timing must buy nothing either.
    run dodge-native-2 dodge native cheat::cheat light::step50
    run dodge-fracgpu-0.5-0.5 dodge fracgpu cheat:0.5:cheat light:0.5:step50
    # The hostile tenants of a container (tenant_attack.sh) beside `honest`
    # (1 ms kernels): processes without the interposer (a plain one, a chain
    # of short-lived ones alone and beside its load, one that dodges the
    # sampling instants: that one's defence is the bypass audit's terminate,
    # run here with audit_interval = "1s" so that the run shows the rest of
    # it), and its own usage file written (the false drain, and garbage).
    # Those without the interposer need a mount namespace: root only.
    attacks="false-drain past-times own-pid contexts"
    if ((EUID == 0)); then
      attacks="plain chain chain-gated bypass-dodge $attacks"
    else
      echo "run_e2e.sh: the attacks without the interposer need root (a tenant's mount namespace): left out" >&2
    fi
    # The attacking tenant's processes are the wrapper's children, which the
    # sampler does not follow: its GPU time is the device's less `honest`'s.
    run_rest=cheat
    for kind in $attacks; do
      run "$kind-native-2" "$kind" native "cheat::attack-$kind" honest::load-compute
      run "$kind-fracgpu-0.5-0.5" "$kind" fracgpu "cheat:0.5:attack-$kind" honest:0.5:load-compute
      if [[ $kind == bypass-dodge ]]; then
        run "$kind-terminate-native-2" "$kind-terminate" native "cheat::attack-$kind" honest::load-compute
        fracgpud_daemon_keys="${fracgpud_daemon_keys:+$fracgpud_daemon_keys$'\n'}audit_action = \"terminate\""$'\n'"audit_interval = \"1s\"" \
          run "$kind-terminate-fracgpu-0.5-0.5" "$kind-terminate" fracgpu "cheat:0.5:attack-$kind" honest:0.5:load-compute
      fi
    done
    run_rest=""
  fi
fi

# nvml_text SAMPLE_MS: how fracgpud's NVML was set up, for a table's head.
nvml_text() {
  if ((held)); then
    echo "no NVML (--held), simulated driver's model: $sched (SIMCUDA_SCHED)"
  elif [[ -n $1 ]]; then
    echo "stand-in NVML sampling every $1 ms (SIMNVML_SAMPLE_MS=$1, SIMNVML_ATTRIB=$attrib), simulated driver's model: $sched (SIMCUDA_SCHED)"
  else
    echo "stand-in NVML, exact (no sampling), simulated driver's model: $sched (SIMCUDA_SCHED)"
  fi
}
if [[ -n $charging ]]; then
  charging_text="gpu_time_charging = $charging"
else
  charging_text="gpu_time_charging not set (the daemon's default)"
fi
machine="$(date -u +%Y-%m-%d), $(lscpu | sed -n 's/^Model name: *//p' | head -n 1), $(nproc) CPUs"

rc=0
latency_skipped=""
if [[ $only != workloads && $only != hostile ]]; then
  # The latency set samples as a real GPU's NVML does (see the head).
  latency_sample_ms=${sample_ms:-167}
  if ((!held)); then
    fracgpud_env=(LD_LIBRARY_PATH="$build/simnvml:$LD_LIBRARY_PATH" SIMNVML_SAMPLE_MS="$latency_sample_ms"
      SIMNVML_ATTRIB="$attrib")
  else
    latency_sample_ms=""
  fi
  workload_seconds=$seconds
  seconds=$latency_seconds
  run_set=latency
  # Does this fracgpud take a tenant's priority? (The key is newer than this
  # harness's other runs: without it, the runs that need it are left out.)
  mkdir -p "$work/probe"
  write_fracgpud_config "$work/probe" "uuid = \"$uuid\"" inf:0.25:latency train:0.75 >"$work/probe.toml"
  if ! probe=$(env ${fracgpud_env[@]+"${fracgpud_env[@]}"} "$fracgpud" --config "$work/probe.toml" --check 2>&1); then
    # shellcheck disable=SC2001 # a pattern per line (the file's name), not one substitution
    latency_skipped="this fracgpud refuses a tenant's priority: $(sed 's/^[^ ]*\.toml:[0-9]*: //' <<<"$probe" | head -n 1 | cut -c 1-160)"
    echo "run_e2e.sh: the runs with priority = \"latency\" are left out: $latency_skipped" >&2
  fi
  prio=":latency"
  [[ -z $latency_skipped ]] || prio=""  # alone under fracgpu: normal, said in the table
  shapes="a b"
  ((!smoke)) || shapes=b
  echo "== latency tenants: inference beside training on the simulated driver, $seconds s each, into $out" >&2
  run latency-inference-native latency native inf::inference
  run latency-inference-fracgpu-alone latency fracgpu "inf:0.25:inference$prio"
  for shape in $shapes; do
    run "latency-$shape-native-2" "latency-$shape" native inf::inference "train::training-$shape"
    run "latency-$shape-fracgpu-normal" "latency-$shape" fracgpu inf:0.25:inference "train:0.75:training-$shape::1.0"
    [[ -n $latency_skipped ]] ||
      run "latency-$shape-fracgpu-latency" "latency-$shape" fracgpu inf:0.25:inference:latency \
        "train:0.75:training-$shape::1.0"
  done
  if ((!smoke)); then
    # Training that pushes: 2 s queued ahead in 4 and 8 processes of one
    # tenant, and one process that trains a per-launch estimate down with
    # 10 us kernels, then queues 20 ms ones (gputime_load).
    for n in 4 8; do
      run "latency-split$n-native-$((n + 1))" "latency-split$n" native inf::inference "train::load-train:::$n"
      [[ -n $latency_skipped ]] ||
        run "latency-split$n-fracgpu-latency" "latency-split$n" fracgpu inf:0.25:inference:latency \
          "train:0.75:load-train::1.0:$n"
    done
    run latency-prefix-native-2 latency-prefix native inf::inference train::load-prefix
    [[ -n $latency_skipped ]] ||
      run latency-prefix-fracgpu-latency latency-prefix fracgpu inf:0.25:inference:latency train:0.75:load-prefix::1.0
  fi
  run_set=""
  seconds=$workload_seconds
  {
    echo "Simulated driver (tests/simcuda), $machine; $latency_seconds s per run"
    echo "fracgpud: $(nvml_text "$latency_sample_ms"); $charging_text"
    echo
  } >"$out/e2e_latency.head"
  latency_args=()
  [[ -z $latency_skipped ]] || latency_args=(--skipped "$latency_skipped")
  py latency "$out" ${latency_args[@]+"${latency_args[@]}"} || rc=$?
  cat "$out/e2e_latency.head" "$out/e2e_latency.md" >"$out/e2e_latency.tmp" && mv "$out/e2e_latency.tmp" "$out/e2e_latency.md"
  rm -f "$out/e2e_latency.head"
  echo "== wrote $out/e2e_latency.md, e2e_latency.csv" >&2
fi

if [[ $only != latency ]]; then
  {
    echo "Simulated driver (tests/simcuda), $machine; $seconds s per run"
    echo "fracgpud: $(nvml_text "$sample_ms"); $charging_text; cheat: period $cheat_period_ms ms, guard $guard_ms ms"
    echo
  } >"$out/e2e_table.head"
  [[ $only == workloads || $only == hostile ]] || echo
  py report "$out" || { r=$?; ((rc)) || rc=$r; }
  for f in e2e_table e2e_sharing; do
    cat "$out/e2e_table.head" "$out/$f.md" >"$out/$f.tmp" && mv "$out/$f.tmp" "$out/$f.md"
  done
  rm -f "$out/e2e_table.head"
  echo "== wrote $out/e2e_table.md, e2e_sharing.md, e2e_runs.csv, e2e_summary.csv, e2e_shares.csv, e2e_shares.svg" >&2
fi
exit "$rc"
