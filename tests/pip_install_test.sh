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
if ! (cd "$tmp/src" && "$python" -m pip install --no-build-isolation --no-index --no-deps \
        --target "$tmp/site" . >"$tmp/pip.log" 2>&1); then
  tail -40 "$tmp/pip.log"
  echo "FAIL: pip install"
  exit 1
fi
grep "Successfully installed" "$tmp/pip.log"
cd /
PYTHONPATH="$tmp/site" "$python" - "$tmp/site" <<'PY'
import sys
import tensormem

site = sys.argv[1]
assert tensormem.__file__.startswith(site), tensormem.__file__
assert tensormem._tensormem.__file__.startswith(site), tensormem._tensormem.__file__
# The installed module works: a plan of three buffers, validated.
lower, upper, size = [0, 1, 2], [2, 3, 4], [100, 50, 100]
result = tensormem.plan(lower, upper, size, time_limit=0.1)
assert result["arena_bytes"] == result["lower_bound"] == 150, result
assert tensormem.validate(lower, upper, size, result["offsets"], result["arena_bytes"]) == "", result
print("tensormem", tensormem.__version__, "from", tensormem.__file__, "arena", result["arena_bytes"])
PY
echo PASS
