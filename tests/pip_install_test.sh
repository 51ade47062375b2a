#!/bin/sh
# `pip install .` as a user runs it: from a copy of the source tree (the files git tracks,
# or all of it outside a checkout), offline (--no-index), with the build tools the system
# has (--no-build-isolation), into a scratch folder; then the package imports from there and
# works. Prints PASS, or what failed.
# Usage: pip_install_test.sh SOURCE_DIR PYTHON
set -eu
src=$1
python=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/src"
if git -C "$src" rev-parse --git-dir >/dev/null 2>&1; then
  (cd "$src" && git ls-files -co --exclude-standard | tar -T - -cf -) | tar -xf - -C "$tmp/src"
else
  (cd "$src" && tar --exclude='./build*' -cf - .) | tar -xf - -C "$tmp/src"
fi
# The build must use the pybind11 the building interpreter imports (pip's, in an isolated
# build), not one CMake finds on its own: a copy of the system's, first on PYTHONPATH, stands
# in for it and must be the one in the CMake cache.
shadow=$(PYTHONPATH= "$python" -c 'import os, pybind11; print(os.path.dirname(pybind11.__file__))')
mkdir "$tmp/shadow"
cp -rL "$shadow" "$tmp/shadow/pybind11"
if ! (cd "$tmp/src" && PYTHONPATH="$tmp/shadow${PYTHONPATH:+:$PYTHONPATH}" "$python" -m pip install \
        --no-build-isolation --no-index --no-deps --target "$tmp/site" . >"$tmp/pip.log" 2>&1); then
  tail -40 "$tmp/pip.log"
  echo "FAIL: pip install"
  exit 1
fi
grep "Successfully installed" "$tmp/pip.log"
cache=$(find "$tmp/src/build-pip" -name CMakeCache.txt | head -1)
if ! grep -qxE "pybind11_DIR:[A-Z]+=$tmp/shadow/pybind11/share/cmake/pybind11" "$cache"; then
  grep "^pybind11_DIR" "$cache" || true
  echo "FAIL: the build did not use the pybind11 the interpreter imports"
  exit 1
fi
cd /
PYTHONPATH="$tmp/site" "$python" - "$tmp/site" <<'PY'
import sys
import tensormem

site = sys.argv[1]
assert tensormem.__file__.startswith(site), tensormem.__file__
assert tensormem._tensormem.__file__.startswith(site), tensormem._tensormem.__file__
import pybind11
assert tensormem._tensormem.PYBIND11_VERSION == pybind11.__version__, tensormem._tensormem.PYBIND11_VERSION
assert tensormem._tensormem.numpy_abi_problem() == ""  # this numpy is read correctly
# The installed module works: a plan of three buffers, validated.
lower, upper, size = [0, 1, 2], [2, 3, 4], [100, 50, 100]
result = tensormem.plan(lower, upper, size, time_limit=0.1)
assert result["arena_bytes"] == result["lower_bound"] == 150, result
assert tensormem.validate(lower, upper, size, result["offsets"], result["arena_bytes"]) == "", result
print("tensormem", tensormem.__version__, "from", tensormem.__file__, "arena", result["arena_bytes"])
PY
echo PASS
