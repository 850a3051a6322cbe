#!/usr/bin/env bash
# GPU-time shares on a real NVIDIA GPU: two PyTorch tenants on GPU 0 at
# 0.5/0.5, 0.25/0.75 and 0.1/0.9 (limit = share, the default hard cap).
# Each tenant's GPU-time share is measured independently of fracgpu, by its
# throughput against the same workload alone on the GPU, and compared with
# the daemon's own achieved_10s figure. Needs the project built
# (scripts/build.sh) and PyTorch. Prints a Markdown table; record it in
# docs/gpu-results.md with the date, GPU and driver printed at the top.
# Exit status: the number of tenants more than 5 points off their share
# (a smoke threshold: the simulated-driver tests hold 2 points).
set -uo pipefail
cd "$(dirname "$0")/../.."
build=$(realpath "${FRACGPU_BUILD_DIR:-build}")
seconds=${SECONDS_PER_RUN:-20}
size=${MATMUL_SIZE:-4096}
work=tests/gpu/sm_share_workload.py
failures=0

echo "== $(date -u +%Y-%m-%dT%H:%MZ)"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'

now_ns() { python3 -c 'import time; print(time.clock_gettime_ns(time.CLOCK_MONOTONIC))'; }
per_s() { python3 -c 'import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])["per_s"])'; }

echo "== alone, without fracgpu ($seconds s)"
alone=$(python3 $work "$(now_ns)" "$seconds" "$size" | per_s)
echo "alone: $alone matmuls/s"

echo
echo "| split | tenant | share | throughput share (vs alone) | daemon achieved_10s |"
echo "|---|---|---|---|---|"
for split in "0.5 0.5" "0.25 0.75" "0.1 0.9"; do
  read -r share_a share_b <<<"$split"
  run_dir=$(mktemp -d /tmp/fracgpu-sm-XXXXXX)
  cat >"$run_dir/fracgpud.toml" <<TOML
[daemon]
run_dir = "$run_dir"

[[gpu]]
index = 0

[[tenant]]
name = "a"
gpus = $share_a
devices = [0]

[[tenant]]
name = "b"
gpus = $share_b
devices = [0]
TOML
  "$build/controller/fracgpud" --config "$run_dir/fracgpud.toml" 2>"$run_dir/fracgpud.log" &
  daemon=$!
  for _ in $(seq 100); do [ -e "$run_dir/tenants/b/gputime-0" ] && break; sleep 0.1; done
  start=$(( $(now_ns) + 5000000000 ))  # both past start-up and warm-up by then
  for t in a b; do
    FRACGPU_TENANT=$t FRACGPU_RUN_DIR=$run_dir LD_PRELOAD=$build/interpose/libfracgpu.so \
      python3 $work "$start" "$seconds" "$size" >"$run_dir/$t.json" &
  done
  sleep $((5 + seconds - 3))  # the last 10 s window is inside the run
  status=$("$build/controller/fracgpu" status --run-dir "$run_dir" --json)
  wait $(jobs -p | grep -v "^$daemon$") 2>/dev/null
  for t in a b; do
    share=$([ $t = a ] && echo "$share_a" || echo "$share_b")
    got=$(per_s <"$run_dir/$t.json")
    ratio=$(python3 -c "print(f'{$got / $alone:.3f}')")
    achieved=$(python3 -c "
import json,sys
s=json.loads(sys.argv[1]); t=[t for t in s['tenants'] if t['name']=='$t'][0]
g=t['gpus'][0].get('gpu_time') or {}
print(f\"{g['achieved_10s_ppm']/1e6:.3f}\" if 'achieved_10s_ppm' in g else 'n/a')" "$status")
    echo "| $split | $t | $share | $ratio | $achieved |"
    off=$(python3 -c "print(int(abs($ratio - $share) > 0.05))")
    failures=$((failures + off))
  done
  kill -TERM $daemon; wait $daemon 2>/dev/null
  rm -rf "$run_dir"
done
echo
echo "== $failures tenant(s) more than 5 points off"
exit $failures
