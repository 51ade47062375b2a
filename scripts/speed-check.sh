#!/usr/bin/env bash
# Every figure the allocators and the planner are judged by, from one build, one after the
# other: the O(1) allocator against the OffsetAllocator algorithm and best fit against the
# LazyAllocator structures (allocator_bench, pinned to one core when taskset exists), then
# `tensormem plan` under /usr/bin/time on the nine public traces, the synthetic family at
# 10^5 and 10^6 buffers and a 10^6-line trace file, each at --time-limit 1 and 10.
#
# usage: scripts/speed-check.sh [BUILD_DIR] [WORK_DIR]
#   BUILD_DIR  a build with bin/allocator_bench and bin/tensormem (default: build; run
#              `make bench` first)
#   WORK_DIR   where the 10^6-line trace is written (default: a temporary folder, removed)
# Prints Markdown tables. Takes about a minute and a half on 2 cores.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$root/build}"
py=/usr/bin/python3
for tool in "$build/bin/allocator_bench" "$build/bin/tensormem" /usr/bin/time "$py"; do
  if [[ ! -x "$tool" ]]; then
    echo "speed-check: $tool is missing (run 'make bench' for the build's tools)" >&2
    exit 2
  fi
done
if [[ $# -ge 2 ]]; then
  work="$2"
  mkdir -p "$work"
else
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
fi
pin=()
if command -v taskset >/dev/null; then pin=(taskset -c "$(($(nproc) - 1))"); fi

echo "## Online allocators ($(git -C "$root" describe --always --dirty 2>/dev/null || echo 'no git'), $(date -u +%F))"
echo
"${pin[@]}" "$build/bin/allocator_bench" --benchmark_filter='versus_baseline|versus_lazy' \
  --benchmark_format=json 2>/dev/null | "$py" -c '
import json, math, sys
rows = json.load(sys.stdin)["benchmarks"]
def show(kind, against):
    picked = [r for r in rows if r["name"].startswith(kind + "/")]
    if not picked:
        sys.exit("speed-check: allocator_bench printed no " + kind + " rows")
    print("| %s stream | ns per op | %s ns per op | ratio | HWM/LB | %s HWM/LB |" % (kind, against, against))
    print("|---|---:|---:|---:|---:|---:|")
    traces = []
    for r in picked:
        stream = r["name"].split("/")[1]
        print("| %s | %.1f | %.1f | %.3f | %.4f | %.4f |" % (stream, r["ns_per_op"], r["baseline_ns_per_op"],
              r["ratio_to_baseline"], r["high_water_over_lb"], r["baseline_high_water_over_lb"]))
        if stream != "W1":
            traces.append(r["ratio_to_baseline"])
    print()
    print("geometric mean of the trace ratios: %.3f" % math.exp(sum(map(math.log, traces)) / len(traces)))
    print()
show("versus_baseline", "OffsetAllocator")
show("versus_lazy", "LazyAllocator")
'

# One `tensormem plan` run: prints "| name | T | wall s | ratio | first plan s | peak RSS MiB |".
plan_row() {
  local name="$1" limit="$2"
  shift 2
  local out="$work/plan.json" timing="$work/time.txt"
  /usr/bin/time -f '%e %M' -o "$timing" "$build/bin/tensormem" --quiet plan "$@" --time-limit "$limit" --json >"$out"
  "$py" - "$name" "$limit" "$out" "$timing" <<'EOF'
import json, sys
name, limit, out, timing = sys.argv[1:]
r = json.load(open(out))
wall, rss_kib = open(timing).read().split()[-2:]
print("| %s | %s | %.2f | %.5f | %.2f | %.0f |" % (name, limit, float(wall), r["ratio"],
      r["first_plan_seconds"], int(rss_kib) / 1024))
EOF
}

echo "## Planner (wall from /usr/bin/time; ratio = arena / lower bound; every plan validated)"
echo
echo "The CLI's $("$build/bin/tensormem" --version | grep '^heap on huge pages') (TENSORMEM_HUGE_PAGES=0 turns it off)."
echo
echo "| input | T s | wall s | ratio | first plan s | peak RSS MiB |"
echo "|---|---:|---:|---:|---:|---:|"
for trace in "$root"/tests/data/traces/*.csv; do
  for limit in 1 10; do plan_row "$(basename "$trace" .csv)" "$limit" "$trace"; done
done
for n in 100000 1000000; do
  for limit in 1 10; do plan_row "synthetic $n" "$limit" --synthetic "$n"; done
done
# A 10^6-line trace file of the same family (seed 7), written by the first plan's replay and
# read back: reading and validating it count against the time limit.
"$build/bin/tensormem" --quiet plan --synthetic 1000000 --synthetic-seed 7 --time-limit 0 \
  --out "$work/synthetic_1m.csv" >/dev/null
for limit in 1 10; do plan_row "10^6-line file" "$limit" "$work/synthetic_1m.csv"; done
