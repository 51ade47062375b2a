#!/bin/sh
# Every command's output written to a full device (/dev/full) is an error with a non-zero exit
# status, not a success with the result lost; the same commands into /dev/null succeed.
# Prints PASS or what went wrong.
# Usage: cli_full_output_test.sh TENSORMEM TRACE
set -u
cli=$1
trace=$2
fail=0
check() {  # check REASON ARGS...: one command, its output first to /dev/full, then to /dev/null
  want="tensormem: cannot write the standard output$1"
  shift
  out=$("$cli" "$@" 2>&1 >/dev/full)
  rc=$?
  if [ "$rc" != 1 ] || [ "$out" != "$want" ]; then echo "FAIL $*: rc=$rc '$out'"; fail=1; fi
  "$cli" "$@" >/dev/null 2>&1 || { echo "FAIL $*: exit $? into /dev/null"; fail=1; }
}
reason=": No space left on device"
check "$reason" plan "$trace" --time-limit 0 --json
check "$reason" plan "$trace" --time-limit 0
check "$reason" replay "$trace" --allocator o1 --json
check "$reason" demo --layers 1
check "$reason" arena --help
# The version is flushed as it is printed (std::endl), and the standard I/O library keeps no
# reason once a flush has failed: the error says only what failed.
check "" --version
[ "$fail" = 0 ] && echo PASS
