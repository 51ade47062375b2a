#!/bin/sh
# A file name is any bytes but '/' and NUL. The commands read and write files so named, and
# their JSON stays JSON (UTF-8): each byte of a name that is not UTF-8 is U+FFFD there.
# Prints PASS or what went wrong.
# Usage: cli_file_names_test.sh TENSORMEM TRACE
set -u
cli=$1
trace=$2
fail=0
dir=$(mktemp -d) || exit 1
trap 'rm -rf "$dir"' EXIT
name=$(printf '%s/t\377.csv' "$dir")       # 0xFF: never in UTF-8
shown=$(printf '%s/t\357\277\275.csv' "$dir")  # U+FFFD in UTF-8
cp "$trace" "$name" || exit 1
for command in "plan --time-limit 0" "replay --allocator o1"; do
  # shellcheck disable=SC2086  # the command's words
  out=$("$cli" $command "$name" --json 2>&1)
  rc=$?
  case "$out" in
    "{"*"\"trace\":\"$shown\""*"}") ;;
    *) echo "FAIL $command --json: rc=$rc '$out'"; fail=1 ;;
  esac
  [ "$rc" = 0 ] || { echo "FAIL $command --json: exit $rc"; fail=1; }
done
for option in --out --svg --html; do
  written=$(printf '%s/p\377%s' "$dir" "$option")
  "$cli" plan "$name" --time-limit 0 "$option" "$written" >/dev/null 2>&1 || { echo "FAIL plan $option"; fail=1; }
  [ -s "$written" ] || { echo "FAIL plan $option: nothing written"; fail=1; }
done
out=$("$cli" plan "$dir/missing$(printf '\377')" --time-limit 0 2>&1)
rc=$?
case "$out" in
  *"missing"*"No such file or directory"*) ;;
  *) echo "FAIL a missing file: rc=$rc '$out'"; fail=1 ;;
esac
[ "$rc" != 0 ] || { echo "FAIL a missing file: exit 0"; fail=1; }
[ "$fail" = 0 ] && echo PASS
