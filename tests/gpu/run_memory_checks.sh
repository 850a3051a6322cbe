#!/usr/bin/env bash
# Memory quotas on a real NVIDIA GPU: a tenant with 0.5 of GPU 0 under the
# interposer, checked with PyTorch (plain and with expandable segments, the
# VMM path), CUDA graphs' allocation nodes, two processes sharing the quota,
# and JAX's preallocation.
# Needs the project built (scripts/build.sh) and PyTorch; JAX is optional.
# Prints a report; record it in docs/gpu-results.md with date, GPU, driver.
# Time (estimated; never timed on a GPU): about 50 s, most of it the start of
# its nine short PyTorch/JAX processes (~5 s each, one after another).
set -uo pipefail
cd "$(dirname "$0")/../.."
build=$(realpath "${FRACGPU_BUILD_DIR:-build}")
run_dir=$(mktemp -d /tmp/fracgpu-gpu-XXXXXX)
check=tests/gpu/check_memory_quota.py
failures=0

echo "== $(date -u +%Y-%m-%dT%H:%MZ)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'

cat >"$run_dir/fracgpud.toml" <<TOML
[daemon]
run_dir = "$run_dir"
log_level = "info"

[[gpu]]
index = 0
context_memory = "512MiB"

[[tenant]]
name = "half"
gpus = 0.5
TOML
"$build/controller/fracgpud" --config "$run_dir/fracgpud.toml" 2>"$run_dir/fracgpud.log" &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null; wait $daemon 2>/dev/null' EXIT
for _ in $(seq 50); do [ -f "$run_dir/tenants/half/policy" ] && break; sleep 0.1; done

export FRACGPU_TENANT=half FRACGPU_RUN_DIR=$run_dir LD_PRELOAD=$build/interpose/libfracgpu.so
quota=$("$build/controller/fracgpu" status --run-dir "$run_dir" --json |
  python3 -c 'import json,sys; s=json.load(sys.stdin); t=[t for t in s["tenants"] if t["name"]=="half"][0]; print(t["gpus"][0]["memory_quota"])')
echo "== quota: $quota bytes"

step() { echo "== $1"; shift; "$@" || { echo "FAILED: $*"; failures=$((failures + 1)); }; }
# The plain caching allocator even where the environment configures another.
step "PyTorch, caching allocator" env -u PYTORCH_ALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF python3 $check torch "$quota"
# PyTorch 2.8+ reads PYTORCH_ALLOC_CONF first and PYTORCH_CUDA_ALLOC_CONF as a
# deprecated alias (it warns); 2.9.1 took expandable_segments only from the
# old name (pytorch/pytorch#183387). Both, so that any version takes it; the
# check confirms that PyTorch's segments really are expandable.
step "PyTorch, expandable segments (cuMemCreate)" \
  env PYTORCH_ALLOC_CONF=expandable_segments:True PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
  python3 $check torch "$quota"
step "CUDA graph allocation nodes (driver API)" python3 $check graph "$quota"

echo "== two processes of one tenant share the quota"
python3 $check hold $((quota * 6 / 10)) 20 >"$run_dir/holder.out" 2>&1 &
holder=$!
# Until it holds its 60% (PyTorch takes seconds to start: a fixed wait would
# be a guess, too short on a cold machine), at most 60 s; it then holds 20 s.
for _ in $(seq 600); do
  grep -q holding "$run_dir/holder.out" && break
  kill -0 $holder 2>/dev/null || break
  sleep 0.1
done
cat "$run_dir/holder.out"
grep -q holding "$run_dir/holder.out" || { echo "FAILED: the first process did not start holding"; failures=$((failures + 1)); }
python3 $check fit $((quota * 6 / 10)); [ $? -eq 3 ] && echo "ok: second process refused 60%" || { echo "FAILED: second process got 60% too"; failures=$((failures + 1)); }
python3 $check fit $((quota * 2 / 10)) && echo "ok: second process got 20%" || { echo "FAILED: 20% refused"; failures=$((failures + 1)); }
"$build/controller/fracgpu" status --run-dir "$run_dir"
kill $holder 2>/dev/null; wait $holder 2>/dev/null

if python3 -c 'import jax' 2>/dev/null; then
  # JAX's defaults (preallocate 75 % of what the driver says is total, BFC
  # allocator), whatever this machine's environment sets.
  step "JAX, default preallocation" \
    env -u XLA_PYTHON_CLIENT_PREALLOCATE -u XLA_PYTHON_CLIENT_MEM_FRACTION -u XLA_PYTHON_CLIENT_ALLOCATOR \
    python3 $check jax "$quota"
else
  echo "== JAX not installed: skipped"
fi
echo "== daemon log"; cat "$run_dir/fracgpud.log"
echo "== $failures failure(s)"
exit $((failures > 0))
