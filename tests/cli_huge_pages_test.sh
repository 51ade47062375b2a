#!/bin/sh
# The CLI runs itself again with glibc.malloc.hugetlb=1 where the kernel gives transparent huge
# pages on request (mode "madvise"), says so in --version and plan --json, keeps reading a
# pipe it was given, and leaves the choice to TENSORMEM_HUGE_PAGES=0 and to a GLIBC_TUNABLES
# that sets the tunable, and goes on when it cannot run itself again. Prints PASS or what went wrong.
# Usage: cli_huge_pages_test.sh TENSORMEM TRACE
set -u
cli=$1
trace=$2
fail=0
expect() {  # expect NAME ACTUAL WANTED
  if [ "$2" != "$3" ]; then echo "FAIL $1: '$2', expected '$3'"; fail=1; fi
}
status() { "$cli" --version | sed -n 's/^heap on huge pages: //p'; }
mode=$(sed -n 's/.*\[\(.*\)\].*/\1/p' /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)
case "$mode" in
  madvise) want="on (GLIBC_TUNABLES: glibc.malloc.hugetlb=1)" ;;
  always) want="on (transparent huge pages: always)" ;;
  "") want="off (transparent huge pages: not available)" ;;
  *) want="off (transparent huge pages: $mode)" ;;
esac
echo "transparent huge pages: ${mode:-not available}"
expect default "$(status)" "$want"
expect switch_off "$(TENSORMEM_HUGE_PAGES=0 status)" "off (TENSORMEM_HUGE_PAGES=0)"
expect tunable_0 "$(GLIBC_TUNABLES=glibc.malloc.hugetlb=0 status)" "off (GLIBC_TUNABLES: glibc.malloc.hugetlb=0)"
if [ "$mode" = madvise ]; then
  # The caller's other tunables are kept beside the one added.
  expect other_tunables "$(GLIBC_TUNABLES=glibc.malloc.check=0 status)" "$want"
  # Without /proc (a private mount namespace, where one is permitted) it cannot run itself
  # again: it goes on, once, and says why.
  if unshare -m true 2>/dev/null; then
    hidden=$(unshare -m sh -c "mount -t tmpfs none /proc && '$cli' --version" | sed -n 's/^heap on huge pages: //p')
    expect no_proc "$hidden" "off (could not run /proc/self/exe again: No such file or directory)"
  else
    echo "no mount namespace here: the run without /proc is not checked"
  fi
fi
# A trace on a pipe is read by the run that plans it, whole.
out=$(cat "$trace" | "$cli" --quiet plan /dev/stdin --time-limit 0.5 --json)
case "$out" in
  *"\"heap_huge_pages\":\"$want\""*) ;;
  *) echo "FAIL plan_json: $out"; fail=1 ;;
esac
lines=$(($(wc -l <"$trace") - 1))
case "$out" in
  *"\"buffers\":$lines,"*) ;;
  *) echo "FAIL plan_pipe: expected $lines buffers in $out"; fail=1 ;;
esac
[ $fail -eq 0 ] && echo PASS
