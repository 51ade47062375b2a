#!/bin/sh
# The CLI, the CUDA resources and the Python module with the CUDA toolkit's folder hidden (an
# empty directory bound over it in a private mount namespace), as on a machine without the
# CUDA runtime: everything loads and runs, and the CUDA resources say why they cannot be used.
# Usage: no_cuda_runtime_test.sh CUDA_DIR CLI TESTS TRACE [PYTHONPATH]
# Exit 77 (skipped) where a mount namespace is not permitted (it needs root).
set -eu
cuda=$1 cli=$2 tests=$3 trace=$4 pypath=${5:-}
if ! unshare -m true 2>/dev/null; then
  echo "SKIP: no permission for a private mount namespace (needs root)"
  exit 77
fi
empty=$(mktemp -d)
trap 'rmdir "$empty"' EXIT
unshare -m sh -eu -c '
  mount --bind "$1" "$2"
  if ls "$2"/lib*/libcudart* >/dev/null 2>&1; then echo "FAIL: the CUDA runtime is still visible"; exit 1; fi
  if ldd "$3" | grep -q "not found"; then ldd "$3"; echo "FAIL: the CLI misses a library"; exit 1; fi
  version=$("$3" --version)
  echo "$version"
  echo "$version" | grep -q "CUDA resources: unavailable (" || { echo "FAIL: no reason given"; exit 1; }
  "$3" plan "$4" --time-limit 1 --json | grep -q "\"arena_bytes\":" || { echo "FAIL: plan"; exit 1; }
  "$5" --gtest_filter="cuda.*" --gtest_brief=1
  if [ -n "$6" ]; then
    PYTHONPATH="$6" /usr/bin/python3 -c "
import numpy as np
import tensormem
assert tensormem.cuda_built()
why = tensormem.cuda_unavailable_reason()
assert why, \"a CUDA device was reported with the runtime hidden\"
pool = tensormem.PinnedPool(slab_bytes=1 << 20)
b = pool.allocate(4096)
np.frombuffer(b, dtype=np.uint8)[:] = 7
assert bytes(b)[:3] == bytes([7, 7, 7])
b.free()
print(\"python: import tensormem works;\", why)
"
  fi
  echo "PASS"
' sh "$empty" "$cuda" "$cli" "$trace" "$tests" "$pypath"
