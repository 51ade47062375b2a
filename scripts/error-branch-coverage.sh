#!/usr/bin/env bash
# Which error branches no test reaches: builds the library, the tool, the tests and the Python
# module with gcc's --coverage (-O0, CUDA off), runs the tests of that build (the C++ suite,
# the command-line tests and the Python suite, python.pytest), and lists every line of the
# library, the module and the tool that throws (or matches PATTERN) and never ran, with the
# count of such lines.
#
# usage: scripts/error-branch-coverage.sh [BUILD_DIR] [PATTERN]
#   BUILD_DIR  the coverage build (default: build-coverage); made or brought up to date
#   PATTERN    a Python regular expression for the lines to count (default: \bthrow\b)
# Takes about ten minutes on 2 cores.
#
# Known blind spots: a test's child process that ends with _exit, or runs as another user
# (the memory-lock tests run as nobody), writes no counts, so the lines only such children
# reach are listed although a test reaches them. install.consumer and python.pip_install are
# left out: they build and link their own copies without --coverage.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$(realpath -m "${1:-$root/build-coverage}")"
pattern="${2:-\\bthrow\\b}"
py=/usr/bin/python3

cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS="-O0 --coverage" \
  -DCMAKE_EXE_LINKER_FLAGS=--coverage -DCMAKE_SHARED_LINKER_FLAGS=--coverage \
  -DTENSORMEM_CUDA=OFF -DTENSORMEM_PYTHON=ON >/dev/null
cmake --build "$build" -j "$(nproc)"
find "$build" -name '*.gcda' -delete
(cd "$build" && ctest -j "$(nproc)" --timeout 1200 -E '^(install[.]consumer|python[.]pip_install)$' >"$build/ctest.log" 2>&1) ||
  echo "error-branch-coverage: some tests failed (see $build/ctest.log); counting what ran" >&2

out="$build/gcov"
rm -rf "$out"
mkdir -p "$out/all"
cd "$out"
# One gcov run per object, its reports renamed after the object: a header's lines are
# counted in every object that includes it, and a line ran if it ran in any of them.
find "$build" -name '*.gcda' | while read -r data; do
  gcov -p -r -s "$root" -o "$(dirname "$data")" "$data" >/dev/null 2>&1 || true
  for report in *.gcov; do
    [[ -e "$report" ]] || continue
    mv "$report" "all/$(basename "$data" .gcda)__$report"
  done
done
"$py" - "$out/all" "$pattern" <<'EOF'
import collections, glob, os, re, sys
reports, pattern = sys.argv[1], re.compile(sys.argv[2])
ran = collections.defaultdict(dict)
text = {}
for report in glob.glob(os.path.join(reports, "*.gcov")):
    source = report.split("__", 1)[1][:-len(".gcov")].replace("#", "/")
    if not source.startswith(("src/", "include/", "tools/")):
        continue
    with open(report, errors="replace") as f:
        for line in f:
            m = re.match(r"\s*([^:]+):\s*(\d+):(.*)", line)
            if not m or int(m.group(2)) == 0 or m.group(1).strip() == "-":
                continue
            count, number = m.group(1).strip(), int(m.group(2))
            text[(source, number)] = m.group(3)
            ran[source][number] = ran[source].get(number, False) or count[0] not in "#="
matching = [(s, n) for s in sorted(ran) for n in sorted(ran[s]) if pattern.search(text[(s, n)])]
never = [(s, n) for s, n in matching if not ran[s][n]]
for s, n in never:
    print(f"{s}:{n}: {text[(s, n)].strip()}")
print(f"{len(never)} of {len(matching)} lines matching {pattern.pattern} never ran")
EOF
