#!/usr/bin/env bash
# One hostile tenant of bench/e2e: its load (1 ms kernels back to back,
# tests/probe/gputime_load) and an attack beside it, as processes of one
# container.
#
#   tenant_attack.sh KIND BUILD_DIR PERIOD_MS GUARD_MS seconds=S start_ns=T
#
# KIND:
#   plain        the load, and a second one without the interposer
#   chain        only a chain of short-lived processes without the interposer,
#                one after the other, each running 1 ms kernels until 2 ms past
#                the next sampling instant (multiples of PERIOD_MS of
#                CLOCK_MONOTONIC), then gone (gputime_load exit_at_ms)
#   chain-gated  the load and the chain
#   bypass-dodge the load, and a process without the interposer that stays off
#                the GPU from GUARD_MS before each sampling instant until 1 ms
#                after it (gputime_load dodge_ms)
#   false-drain  the load, and usage_attacker kind=false-drain on its slot
#   past-times, own-pid, contexts
#                the load, and usage_attacker's garbage of that kind in the
#                tenant's usage file, 1,000 rounds a second
#
# Under fracgpu (FRACGPU_RUN_DIR and FRACGPU_TENANT set, as run_e2e.sh's run
# sets them; the load runs under the LD_PRELOAD it was given) the whole
# tenant of the shapes with processes without the interposer runs in a mount
# namespace of its own that holds its tenant directory, as a container does
# (root only: unshare): that is how fracgpud tells whose such a process is.
# $TENANT_ATTACK_LOAD_ARGS, where set, goes to every gputime_load of the
# tenant (tests/gpu/run_hostile.sh: "kernels=ptx spin_per_us=R instants=nvml"
# on a real GPU).
# The usage attacker writes the tenant's usage file through its own mapping,
# as any process of the container can. Without fracgpu the same
# processes run plain, and the usage attacks have nothing to write: the load
# alone.
set -euo pipefail
[[ $# -ge 4 ]] || { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }
kind=$1 build=$2 period_ms=$3 guard_ms=$4
shift 4
seconds=10 start_ns=""
for arg; do
  case $arg in
    seconds=*) seconds=${arg#*=} ;;
    start_ns=*) start_ns=${arg#*=} ;;
    *) echo "tenant_attack.sh: unexpected argument $arg" >&2; exit 2 ;;
  esac
done
case $kind in
  plain | chain | chain-gated | bypass-dodge | false-drain | past-times | own-pid | contexts) ;;
  *) echo "tenant_attack.sh: no attack $kind" >&2; exit 2 ;;
esac
load=$build/tests/gputime_load attacker=$build/tests/usage_attacker
read -r -a load_extra <<<"${TENANT_ATTACK_LOAD_ARGS:-}"
load_cmd=("$load" ${load_extra[@]+"${load_extra[@]}"})
gated=0
[[ -z ${FRACGPU_RUN_DIR:-} || -z ${FRACGPU_TENANT:-} ]] || gated=1
tenant_dir=${FRACGPU_RUN_DIR:-}/tenants/${FRACGPU_TENANT:-}

if ((gated)) && [[ $kind == plain || $kind == chain* || $kind == bypass-* ]] && [[ -z ${TENANT_ATTACK_CONTAINED:-} ]]; then
  # The container: a mount namespace whose only tie to fracgpu is its tenant
  # directory, mounted (here, onto itself). The usage attacks need none:
  # every process of theirs runs the interposer, which names its tenant.
  ((EUID == 0)) || { echo "tenant_attack.sh: a tenant's own mount namespace needs root" >&2; exit 2; }
  # shellcheck disable=SC2016 # expanded by the inner bash, from its arguments
  exec unshare --mount --propagation private -- env TENANT_ATTACK_CONTAINED=1 \
    bash -c 'mount --bind "$1" "$1" && exec bash "$0" "${@:2}"' "$0" "$tenant_dir" "$kind" "$build" "$period_ms" \
    "$guard_ms" "$@"
fi

pids=() bypass_pid=""
trap 'kill ${pids[@]+"${pids[@]}"} $bypass_pid 2>/dev/null || true' EXIT
at_start=()
[[ -z $start_ns ]] || at_start=(start_ns="$start_ns")
# A process without the interposer (the container's LD_PRELOAD taken off).
plain() { env -u LD_PRELOAD "$@"; }

load_pid=""
if [[ $kind != chain ]]; then
  "${load_cmd[@]}" devices=0 kernels_us=1000 seconds="$seconds" ${at_start[@]+"${at_start[@]}"} &
  load_pid=$!
  pids+=("$!")
fi
case $kind in
  plain)
    plain "${load_cmd[@]}" devices=0 kernels_us=1000 seconds="$seconds" ${at_start[@]+"${at_start[@]}"} >/dev/null &
    pids+=("$!")
    ;;
  chain | chain-gated)
    # From the start, one link after the other for `seconds` (whole seconds,
    # rounded up; bash's clock), the first one waiting for the start.
    (
      first=("${at_start[@]}")
      SECONDS=0
      limit=$(python3 -c 'import math, sys; print(math.ceil(float(sys.argv[1])) + 1)' "$seconds")
      links=0
      while ((SECONDS < limit)); do
        plain "${load_cmd[@]}" devices=0 kernels_us=1000 exit_at_ms="$period_ms" exit_after_ms=2 ${first[@]+"${first[@]}"} \
          >/dev/null 2>&1 || true
        first=()
        links=$((links + 1))
      done
      echo "chain_links=$links"
    ) &
    pids+=("$!")
    ;;
  bypass-dodge)
    plain "${load_cmd[@]}" devices=0 kernels_us=1000 seconds="$seconds" dodge_ms="$period_ms" guard_ms="$guard_ms" \
      ${at_start[@]+"${at_start[@]}"} >/dev/null &
    bypass_pid=$!
    ;;
  *)
    if ((gated)); then
      plain "$attacker" dir="$tenant_dir" kind="$kind" pid="$load_pid" seconds="$seconds" ${at_start[@]+"${at_start[@]}"} >&2 &
      pids+=("$!")
    fi
    ;;
esac
# The load's own output is this tenant's (run_e2e.sh reads launches_0=).
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
if [[ -n ${bypass_pid:-} ]]; then
  # The bypass audit's terminate SIGKILLs it: said, and no failure of the run.
  status=0
  wait "$bypass_pid" || status=$?
  if ((status == 128 + 9)); then echo "bypass=killed"; elif ((status)); then rc=$status; else echo "bypass=ran"; fi
fi
pids=()
exit "$rc"
