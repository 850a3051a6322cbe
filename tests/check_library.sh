#!/usr/bin/env bash
# libfracgpu.so links neither libcuda nor NVML, and exports exactly the hooked
# entry points of the .def lists given (hooks.def, nvml_hooks.def) and dlsym.
# Usage: check_library.sh LIB DEF...
set -euo pipefail
lib=$1
shift
defs=("$@")
status=0
needed=$(readelf -d "$lib" | awk '/NEEDED/ {print $5}' | tr -d '[]')
echo "NEEDED: $needed"
if echo "$needed" | grep -Eq 'libcuda|libnvidia-ml|libstdc\+\+'; then
  echo "FAIL: links a library it must load at run time (or the C++ runtime)"; status=1
fi
exported=$(nm -D --defined-only "$lib" | awk '{print $3}' | sort)
expected=$( (sed -n 's/^FRACGPU_\(NVML_\)\{0,1\}HOOK(\([A-Za-z0-9_]*\),.*/\2/p' "${defs[@]}"; echo dlsym) | sort)
if [ "$exported" != "$expected" ]; then
  echo "FAIL: exports differ from ${defs[*]} + dlsym:"
  diff <(echo "$expected") <(echo "$exported") || true
  status=1
fi
echo "exports: $(echo "$exported" | wc -l) symbols"
[ $status -eq 0 ] && echo "1 passed, 0 failed" || echo "0 passed, 1 failed"
exit $status
