#!/bin/sh
# The CLI where the machine limits it. `tensormem demo`: without the right to lock its memory it swaps
# from unlocked memory and says so; without a usable temporary folder it skips the swap
# section, says why and prints the rest; with little free space it swaps only what fits in
# half of it; a failed transfer is reported after the rest and fails the command, and no
# swap folder is left behind; where its swapper's threads cannot start it skips the swap
# section. `tensormem swap-bench` refuses a run that needs more free space
# than its folder has, before it writes anything, and stops at the memory-lock limit unless
# --allow-unlocked lets it run from unlocked memory (said). Prints PASS or what went wrong.
# Usage: cli_limits_test.sh TENSORMEM
set -u
cli=$1
fail=0
small="demo --layers 2 --batch 2 --sequence 256 --plan-seconds 0"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
chmod 1777 "$work"
cp "$cli" "$work/tensormem" && chmod 755 "$work/tensormem"
expect() {  # expect NAME OUTPUT PATTERN
  if ! printf '%s\n' "$2" | grep -q -- "$3"; then
    echo "FAIL $1: no line matches '$3' in:"; printf '%s\n' "$2" | sed 's/^/  /'; fail=1
  fi
}

# 1. Locked memory limited to 1 MiB and, when root, as user nobody (no CAP_IPC_LOCK).
if [ "$(id -u)" = 0 ]; then
  as_user="setpriv --reuid=65534 --regid=65534 --clear-groups"
else
  as_user=""
fi
out=$(TMPDIR=$work prlimit --memlock=1048576:1048576 $as_user "$work/tensormem" $small 2>&1)
rc=$?
[ $rc = 0 ] || { echo "FAIL unlocked: exit status $rc"; fail=1; }
expect unlocked "$out" "could not be page-locked (RLIMIT_MEMLOCK is 1.00 MiB"
expect unlocked_intact "$out" "contents intact"
expect unlocked_plan "$out" "offline plan"
#    `tensormem swap-bench` there stops at the limit's error, which names --allow-unlocked; with
#    it, the run goes on from unlocked memory and says so.
bench="swap-bench --dir $work --bytes 8388608 --tensor-bytes 2097152"
out=$(prlimit --memlock=1048576:1048576 $as_user "$work/tensormem" $bench 2>&1)
rc=$?
[ $rc = 1 ] || { echo "FAIL bench_locked: exit status $rc"; fail=1; }
expect bench_locked "$out" "^tensormem: pinned_host_resource: cannot lock .*RLIMIT_MEMLOCK is 1048576 bytes.*(here: --allow-unlocked)$"
out=$(prlimit --memlock=1048576:1048576 $as_user "$work/tensormem" $bench --allow-unlocked 2>&1)
rc=$?
[ $rc = 0 ] || { echo "FAIL bench_unlocked: exit status $rc"; fail=1; }
expect bench_unlocked "$out" "^memory: [1-9][0-9]* slab(s) could not be page-locked (RLIMIT_MEMLOCK is 1.00 MiB.*the tensors and staging used unlocked memory"
expect bench_unlocked_rates "$out" "^write [0-9.]* GB/s (fresh files [0-9.]* GB/s), read [0-9.]* GB/s"
out=$(prlimit --memlock=1048576:1048576 $as_user "$work/tensormem" $bench --allow-unlocked --json 2>&1)
expect bench_unlocked_json "$out" '"unlocked_slabs":[1-9]'
#    `tensormem pinned-bench` measures locked memory: the error says it has no fallback.
out=$(prlimit --memlock=1048576:1048576 $as_user "$work/tensormem" pinned-bench --pool-pairs 10 --mlock-pairs 10 2>&1)
rc=$?
[ $rc = 1 ] || { echo "FAIL pinned_bench_locked: exit status $rc"; fail=1; }
expect pinned_bench_locked "$out" "RLIMIT_MEMLOCK is 1048576 bytes.*run with CAP_IPC_LOCK (pinned-bench measures page-locked memory, so it has no unlocked fallback)$"

# 2. No temporary folder, and one where no folder can be made: the swap section is skipped
#    with the reason, the report is whole and the status is 0.
out=$(TMPDIR=$work/missing "$work/tensormem" $small 2>&1)
rc=$?
[ $rc = 0 ] || { echo "FAIL missing_tmp: exit status $rc"; fail=1; }
expect missing_tmp "$out" "swap: skipped: no temporary directory (No such file or directory); set TMPDIR"
expect missing_tmp_plan "$out" "online O(1)"
out=$(TMPDIR=/proc "$work/tensormem" $small --json 2>&1)
expect proc_tmp "$out" '"skipped": "cannot create a folder in /proc ('

# 3. Half the free space of a 6 MiB file system holds some of the tensors, not all.
if [ "$(id -u)" = 0 ] && unshare -m true 2>/dev/null; then
  mkdir "$work/small"
  out=$(unshare -m sh -c "mount -t tmpfs -o size=6m none '$work/small' && TMPDIR='$work/small' '$work/tensormem' $small" 2>&1)
  rc=$?
  [ $rc = 0 ] || { echo "FAIL small_disk: exit status $rc"; fail=1; }
  expect small_disk "$out" "swap: [1-8] of layer 0's 9 saved activations (.* of .*; the budget is 3.00 MiB: half the free space of $work/small, 6.00 MiB)"
  expect small_disk_intact "$out" "contents intact"
  out=$(unshare -m sh -c "mount -t tmpfs -o size=8m none '$work/small' && { '$work/tensormem' swap-bench --dir '$work/small' --bytes 8388608 --tensor-bytes 1048576; rc=\$?; ls -A '$work/small'; exit \$rc; }" 2>&1)
  rc=$?
  [ $rc = 1 ] || { echo "FAIL swap_bench_small_disk: exit status $rc"; fail=1; }
  expect swap_bench_small_disk "$out" "^tensormem: --bytes 8388608: the run needs up to 16.00 MiB of free space in $work/small (its files and their next versions), 8.00 MiB available; lower --bytes"
  if printf '%s\n' "$out" | grep -q tensormem-swap-bench; then echo "FAIL swap_bench_small_disk: a folder was made"; fail=1; fi
else
  echo "no mount namespace here: the small file systems are not checked"
fi
# 4. Files limited to 1 MiB (SIGXFSZ ignored, so writes past it fail with EFBIG): the report is
#    whole, names the file that failed, and the status is not 0.
out=$(sh -c "trap '' XFSZ; TMPDIR='$work' prlimit --fsize=1048576 '$work/tensormem' $small" 2>&1)
rc=$?
[ $rc != 0 ] || { echo "FAIL file_too_large: exit status 0"; fail=1; }
expect file_too_large "$out" "contents not checked: a transfer failed"
expect file_too_large_named "$out" "^  failed: write to $work/tensormem-demo-.*/l0\..* failed: File too large"
expect file_too_large_plan "$out" "online best-fit"
expect file_too_large_status "$out" "^tensormem: demo: a swap transfer failed"
# 5. Threads limited (RLIMIT_NPROC: the process and two more, as a user id of its own, since
#    root is not held to it): the swapper's threads cannot start, so the swap section is
#    skipped with the reason, the report is whole and the status is 0. Before, the demo
#    printed only the swapper's error and failed.
if [ "$(id -u)" = 0 ]; then
  user=$((1500000000 + $$ % 1000000))
  out=$(TMPDIR=$work prlimit --nproc=3:3 setpriv --reuid=$user --regid=$user --clear-groups "$work/tensormem" $small 2>&1)
  rc=$?
  [ $rc = 0 ] || { echo "FAIL threads: exit status $rc"; fail=1; }
  expect threads "$out" "^swap: skipped: tensor_swapper: cannot start a thread (a limit on threads or processes"
  expect threads_plan "$out" "online best-fit"
else
  echo "not root: the limit on threads is not checked (it counts every task of this user)"
fi
left=$(ls "$work" | grep tensormem-demo-)
[ -z "$left" ] || { echo "FAIL leftover: the demo left $left in $work"; fail=1; }
[ $fail = 0 ] && echo PASS
exit $fail
