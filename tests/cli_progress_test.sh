#!/bin/sh
# The progress line: shown when stderr is a terminal (a pseudo-terminal from script(1)),
# absent with --quiet and when stderr is a file. Prints PASS or what went wrong.
# Usage: cli_progress_test.sh TENSORMEM TRACE
set -u
cli=$1
trace=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail=0
check() {  # check NAME FILE PATTERN present|absent
  if grep -q "$3" "$2"; then found=present; else found=absent; fi
  if [ "$found" != "$4" ]; then echo "FAIL $1: '$3' is $found in: $(tail -c 300 "$2" | tr '\r' '|')"; fail=1; fi
}
# On a terminal: the planner's phase and ratio, the swap-bench rate, the demo's sections.
script -qec "$cli plan $trace --time-limit 1.5" "$dir/plan.tty" >/dev/null
check plan_tty "$dir/plan.tty" 'plan: [0-9]* buffers, .* x lower bound' present
check plan_report "$dir/plan.tty" 'validated    yes' present
# The line is blanked out (carriage return, as many spaces as it had, carriage return) before
# the report is printed.
tr '\r' '|' <"$dir/plan.tty" >"$dir/plan.flat"
check plan_cleared "$dir/plan.flat" 'x lower bound| \{40,\}|trace ' present
script -qec "$cli swap-bench --dir $dir --bytes 268435456 --tensor-bytes 8388608 --engine threads" "$dir/swap.tty" >/dev/null
check swap_tty "$dir/swap.tty" 'swap-bench: reading [0-9.]* [KMG]iB of 256.00 MiB ([0-9.]* GB/s)' present
script -qec "$cli demo --layers 2 --batch 2 --sequence 256 --plan-seconds 0.5" "$dir/demo.tty" >/dev/null
check demo_tty "$dir/demo.tty" 'demo: contiguous arena' present
# --quiet, before or after the command's name: no line.
script -qec "$cli --quiet plan $trace --time-limit 1.5" "$dir/quiet1.tty" >/dev/null
check quiet_before "$dir/quiet1.tty" 'plan: ' absent
check quiet_report "$dir/quiet1.tty" 'validated    yes' present
script -qec "$cli plan $trace --time-limit 1.5 -q" "$dir/quiet2.tty" >/dev/null
check quiet_after "$dir/quiet2.tty" 'plan: ' absent
# Not a terminal: nothing on stderr at all.
"$cli" plan "$trace" --time-limit 1.5 >"$dir/plan.out" 2>"$dir/plan.err"
if [ -s "$dir/plan.err" ]; then echo "FAIL pipe: stderr is not empty"; fail=1; fi
check pipe_report "$dir/plan.out" 'validated    yes' present
[ $fail -eq 0 ] && echo PASS
