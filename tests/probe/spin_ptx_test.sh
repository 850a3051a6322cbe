#!/usr/bin/env bash
# gputime_load kernels=ptx's spin kernel (kSpinPtx) assembles: ptxas from the
# CUDA toolkit, for the H100/H200's sm_90 and for sm_75 (the oldest GPU
# CUDA 13 builds for). Exit 77 (skipped) without ptxas. No GPU is needed.
#
#   spin_ptx_test.sh SOURCE_DIR [PTXAS]
set -euo pipefail
src=$1
ptxas=${2:-/usr/local/cuda/bin/ptxas}
[[ -x $ptxas ]] || { echo "SKIPPED: no ptxas at $ptxas"; exit 77; }
work=$(mktemp -d /tmp/fracgpu-spin-XXXXXX)
trap 'rm -rf "$work"' EXIT
python3 - "$src/tests/probe/gputime_load.cpp" "$work/spin.ptx" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
m = re.search(r'kSpinPtx\[\] = R"\((.*?)\)";', text, re.S)
assert m, "no kSpinPtx in gputime_load.cpp"
open(sys.argv[2], "w").write(m.group(1))
PY
for arch in sm_90 sm_75; do
  "$ptxas" -arch="$arch" -v "$work/spin.ptx" -o "$work/spin-$arch.cubin" 2>&1 | grep -i "fracgpu_spin\|error" || true
  [[ -s $work/spin-$arch.cubin ]] || { echo "FAIL: ptxas -arch=$arch" >&2; exit 1; }
done
echo "PASS: the spin kernel assembles for sm_90 and sm_75"
