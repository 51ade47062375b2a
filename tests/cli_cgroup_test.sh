#!/bin/sh
# The library in a container whose memory cgroup allows less than the machine has (a 64 MiB
# limit on a child cgroup made here): physical_memory_bytes() is the cgroup's limit, so that
# `tensormem plan --synthetic 1000000` and `swap-bench` refuse what the cgroup cannot hold
# instead of being ended by the out-of-memory killer. Needs root and a writable cgroup v1
# memory hierarchy or cgroup v2 with the memory controller; otherwise prints SKIP and why.
# `tensormem demo` in a cgroup of 256 MiB swaps what a quarter of it holds (it was killed: it
# budgeted a quarter of the machine and mapped slabs of 256 MiB). Prints PASS or what went wrong.
# Usage: cli_cgroup_test.sh TENSORMEM PYTHON_PACKAGE_DIR [sanitized]
#   sanitized: the build is instrumented (several times the memory): the demo is left out
set -u
cli=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
python_dir=$2
sanitized=${3:-}
limit=67108864
fail=0
expect() {  # expect NAME OUTPUT PATTERN
  if ! printf '%s\n' "$2" | grep -q -- "$3"; then
    echo "FAIL $1: no line matches '$3' in:"; printf '%s\n' "$2" | sed 's/^/  /'; fail=1
  fi
}

# The folder of this process's memory cgroup: v1's "memory" line and mount, else v2's.
own=""
file=""
v1_path=$(awk -F: '$2 ~ /(^|,)memory(,|$)/ {print $3; exit}' /proc/self/cgroup)
v1_mount=$(awk '{for (i = 1; i <= NF; ++i) if ($i == "-") { if ($(i+1) == "cgroup" && $(i+3) ~ /(^|,)memory(,|$)/) print $5; break }}' /proc/self/mountinfo | head -n 1)
v2_path=$(awk -F: '$1 == "0" && $2 == "" {print $3; exit}' /proc/self/cgroup)
v2_mount=$(awk '{for (i = 1; i <= NF; ++i) if ($i == "-") { if ($(i+1) == "cgroup2") print $5; break }}' /proc/self/mountinfo | head -n 1)
if [ -n "$v1_path" ] && [ -n "$v1_mount" ] && [ -w "$v1_mount$v1_path" ]; then
  own="$v1_mount$v1_path"; file=memory.limit_in_bytes
elif [ -n "$v2_mount" ] && [ -w "$v2_mount$v2_path" ] && grep -qw memory "$v2_mount$v2_path/cgroup.controllers" 2>/dev/null &&
     grep -qw memory "$v2_mount$v2_path/cgroup.subtree_control" 2>/dev/null; then
  own="$v2_mount$v2_path"; file=memory.max
fi
if [ -z "$own" ]; then
  echo "SKIP: no memory cgroup this process may make a child in (v1 '$v1_mount$v1_path', v2 '$v2_mount$v2_path')"
  exit 77
fi
group="$own/tensormem-test-$$"
if ! mkdir "$group" 2>/dev/null || ! echo $limit > "$group/$file" 2>/dev/null; then
  rmdir "$group" 2>/dev/null
  echo "SKIP: cannot make a limited cgroup in $own"
  exit 77
fi
trap 'rmdir "$group" 2>/dev/null' EXIT
inside() {  # runs a command inside the limited cgroup
  sh -c 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"' sh "$group" "$@"
}

# 1. The library's view of the memory, through the Python module where this build has one.
if ls "$python_dir"/tensormem/_tensormem.*.so >/dev/null 2>&1; then
  out=$(inside env PYTHONPATH="$python_dir" /usr/bin/python3 -c 'import tensormem; print(tensormem.physical_memory_bytes())' 2>&1)
  expect "physical_memory_bytes in the cgroup" "$out" "^$limit\$"
  # What the cgroup leaves drops by what the process writes (16 MiB) and stays below the
  # limit less it. (PyTorch, which tensormem.model imports, does not fit in 64 MiB.)
  out=$(inside env PYTHONPATH="$python_dir" /usr/bin/python3 -c '
import tensormem
limit = tensormem.cgroup_memory_limit_bytes()
before = tensormem.cgroup_memory_available_bytes()
ballast = b"\x01" * (16 << 20)
after = tensormem.cgroup_memory_available_bytes()
print("left", before - after >= 15 << 20, after <= limit - (16 << 20), before <= limit)
' 2>&1)
  expect "cgroup_memory_available_bytes in the cgroup" "$out" "^left True True True\$"
  # An allocator's reserve makes its nodes: 3,000,000 blocks (108 MB for the O(1) allocator)
  # are refused in 64 MiB (the interpreter was ended by the out-of-memory killer).
  out=$(inside env PYTHONPATH="$python_dir" /usr/bin/python3 -c '
import tensormem
for cls in (tensormem.TlsfAllocator, tensormem.BestFitAllocator):
    try:
        cls().reserve(3_000_000)
        print("reserved")
    except MemoryError as e:
        print("refused", e)
' 2>&1)
  rc=$?
  [ $rc = 0 ] || { echo "FAIL reserve: exit $rc (137 is the out-of-memory killer)"; fail=1; }
  expect "reserve in the cgroup" "$out" "^refused TlsfAllocator.reserve: 3000000 blocks need about 108000000 bytes of memory (about 36 a block), more than the $limit bytes this process can have\$"
  expect "reserve in the cgroup" "$out" "^refused BestFitAllocator.reserve: 3000000 blocks need about [0-9]* bytes of memory (about [0-9]* a block), more than the $limit bytes"
else
  echo "note: no Python module in $python_dir (this build has none): its check is left out"
fi

# 2. 10^6 buffers need about 153 MiB to plan: refused (it was killed at the cgroup's limit).
out=$(inside "$cli" plan --synthetic 1000000 2>&1)
rc=$?
[ $rc = 1 ] || { echo "FAIL plan: exit $rc (137 is the out-of-memory killer)"; fail=1; }
expect "plan" "$out" "1000000 buffers need about 152.59 MiB of memory to plan (about 160 bytes a buffer), more than this machine's 64.00 MiB"

# 2b. A trace file of 10^6 lines: refused by plan and replay before it is read (reading it
# alone passed 64 MiB).
work=$(mktemp -d)
awk 'BEGIN { print "id,lower,upper,size"; for (i = 0; i < 999999; ++i) printf "b%d,%d,%d,4096\n", i, i, i + 2 }' > "$work/big.csv"
out=$(inside "$cli" plan "$work/big.csv" 2>&1)
rc=$?
[ $rc = 1 ] || { echo "FAIL plan of a file: exit $rc (137 is the out-of-memory killer)"; fail=1; }
expect "plan of a file" "$out" "big.csv: 1000000 lines need about 152.59 MiB of memory to plan"
out=$(inside "$cli" replay "$work/big.csv" 2>&1)
rc=$?
[ $rc = 1 ] || { echo "FAIL replay of a file: exit $rc (137 is the out-of-memory killer)"; fail=1; }
expect "replay of a file" "$out" "replay: .*big.csv: 1000000 lines need about 133.51 MiB of memory to replay (about 140 bytes a buffer), more than this machine's 64.00 MiB"
rm -rf "$work"

# 3. A smaller plan still runs in it.
out=$(inside "$cli" plan --synthetic 10000 --time-limit 0 2>&1)
rc=$?
[ $rc = 0 ] || { echo "FAIL small plan: exit $rc"; fail=1; }
expect "small plan" "$out" "validated    yes"

# 4. swap-bench holds its tensors in locked memory: more than half the cgroup is refused.
work=$(mktemp -d)
out=$(inside "$cli" swap-bench --dir "$work" --bytes 50331648 --tensor-bytes 1048576 2>&1)
rc=$?
rm -rf "$work"
[ $rc = 1 ] || { echo "FAIL swap-bench: exit $rc"; fail=1; }
expect "swap-bench" "$out" "more than half of this machine's 64.00 MiB"

# 4b. The demo's contiguous arena and the patterns its tensors are checked against: 200
# layers need about 237 MiB, refused before the graph is built.
out=$(inside "$cli" demo --layers 200 2>&1)
rc=$?
[ $rc = 1 ] || { echo "FAIL demo --layers 200: exit $rc (137 is the out-of-memory killer)"; fail=1; }
expect "demo --layers 200" "$out" "demo: --layers 200: the contiguous arena section needs 236.99 MiB (its 118.49 MiB arena, 5 % over the most bytes its script holds at once, and as much again for the patterns its tensors are checked against), more than this machine's 64.00 MiB; lower --layers"

# 5. The demo in 256 MiB: the swap section budgets a quarter of the cgroup, not of the machine.
if [ -z "$sanitized" ]; then
  echo $((4 * limit)) > "$group/$file"
  work=$(mktemp -d)
  out=$(cd "$work" && TMPDIR="$work" inside "$cli" demo 2>&1)
  rc=$?
  rm -rf "$work"
  [ $rc = 0 ] || { echo "FAIL demo: exit $rc (137 is the out-of-memory killer)"; fail=1; }
  expect "demo" "$out" "the budget is 64.00 MiB: a quarter of this machine's memory, 256.00 MiB"
  expect "demo" "$out" "contents intact"
else
  echo "note: an instrumented build: the demo's check is left out"
fi

[ $fail = 0 ] && echo PASS
exit $fail
