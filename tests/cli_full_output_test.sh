#!/bin/sh
# Every command's output written to a full device (/dev/full) is an error with a non-zero exit
# status, not a success with the result lost; the same commands into /dev/null succeed. An
# output file (--out, --svg, --html) that cannot be written whole keeps the file there.
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

# A plan written over an earlier one past the file-size limit (ulimit -f, in KiB blocks; the
# signal ignored so that the write fails with EFBIG): the error, and the earlier plan as it was.
dir=$(mktemp -d) || exit 1
trap 'rm -rf "$dir"' EXIT
for option in --out --svg --html; do
  "$cli" plan "$trace" --time-limit 0 "$option" "$dir/old" >/dev/null 2>&1 || { echo "FAIL $option: first write"; fail=1; }
  printf 'x' >"$dir/old"  # one byte: any new text is longer than the limit below
  out=$( (trap '' XFSZ; ulimit -f 1; exec "$cli" plan "$trace" --time-limit 0 "$option" "$dir/old") 2>&1 >/dev/null)
  rc=$?
  case "$out" in
    *"cannot write $dir/old: File too large"*) ;;
    *) echo "FAIL $option past the size limit: rc=$rc '$out'"; fail=1 ;;
  esac
  [ "$rc" = 1 ] || { echo "FAIL $option past the size limit: rc=$rc"; fail=1; }
  [ "$(cat "$dir/old")" = x ] || { echo "FAIL $option past the size limit: the earlier file changed"; fail=1; }
  [ "$(ls -A "$dir")" = old ] || { echo "FAIL $option past the size limit: left $(ls -A "$dir")"; fail=1; }
done
[ "$fail" = 0 ] && echo PASS
