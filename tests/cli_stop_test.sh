#!/bin/sh
# `tensormem plan` stopped by a signal: SIGINT (Ctrl-C) or SIGTERM ends the search, the best
# plan so far is validated, written and printed, and the exit status is 128 + the signal; a
# SIGINT the tool was started with ignored stays ignored. Prints PASS or what went wrong.
# Usage: cli_stop_test.sh TENSORMEM TRACE (a trace the planner does not solve to its bound)
set -u
cli=$1
trace=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail=0
now() { date +%s.%N; }
# run NAME SIGNAL DELAY ARGS...: starts the command with SIGNAL at its default action, sends
# it after DELAY seconds; sets rc and took (seconds from the signal to the end).
run() {
  name=$1 sig=$2 delay=$3
  shift 3
  env --default-signal="$sig" "$cli" "$@" >"$dir/$name.out" 2>"$dir/$name.err" &
  pid=$!
  sleep "$delay"
  sent=$(now)
  kill -s "$sig" "$pid"
  wait "$pid"
  rc=$?
  took=$(awk -v a="$sent" -v b="$(now)" 'BEGIN { printf "%.3f", b - a }')
}
expect() {  # expect NAME WHAT ACTUAL WANTED
  if [ "$3" != "$4" ]; then echo "FAIL $1: $2 is '$3', not '$4'; stderr: $(cat "$dir/$1.err")"; fail=1; fi
}
within() {  # within NAME SECONDS: the command ended that soon after the signal
  if ! awk -v t="$took" -v most="$2" 'BEGIN { exit !(t < most) }'; then
    echo "FAIL $1: ended $took s after the signal (the limit was 600 s)"; fail=1
  fi
}
# Ctrl-C at 10^5 synthetic buffers, a 600 s limit: the plan out, with every buffer, as JSON.
# (The signal comes 3 s in, so that the handler is in place even in a sanitized build on a
# busy machine: before it, the signal would end the process.)
n=100000
run int INT 3 plan --synthetic $n --time-limit 600 --json --out "$dir/int.csv"
expect int "exit status" "$rc" 130
within int 30
expect int stopped "$(grep -o '"stopped":[a-z]*' "$dir/int.out")" '"stopped":true'
expect int "rows written" "$(wc -l <"$dir/int.csv" | tr -d ' ')" $((n + 1))
grep -q 'plan: stopped by SIGINT after [0-9.]* s; the plan above is the best found by then (validated)' "$dir/int.err" ||
  { echo "FAIL int: stderr is '$(cat "$dir/int.err")'"; fail=1; }
# SIGTERM on a trace: the text report, validated.
run term TERM 3 plan "$trace" --time-limit 600
expect term "exit status" "$rc" 143
within term 30
grep -q '^validated    yes' "$dir/term.out" || { echo "FAIL term: no 'validated    yes' in: $(cat "$dir/term.out")"; fail=1; }
grep -q 'plan: stopped by SIGTERM' "$dir/term.err" || { echo "FAIL term: stderr is '$(cat "$dir/term.err")'"; fail=1; }
# Started with SIGINT ignored (an asynchronous command of a shell without job control): the
# signal changes nothing, the plan runs to its limit.
"$cli" plan "$trace" --time-limit 2 --json >"$dir/ignored.out" 2>"$dir/ignored.err" &
pid=$!
sleep 0.5
kill -s INT "$pid"
wait "$pid"
expect ignored "exit status" $? 0
expect ignored stopped "$(grep -o '"stopped":[a-z]*' "$dir/ignored.out")" '"stopped":false'
# The help says so.
"$cli" plan --help | grep -q 'Ctrl-C (SIGINT) or SIGTERM while planning stops the search' ||
  { echo "FAIL help: plan --help does not say what a signal does"; fail=1; }
[ $fail -eq 0 ] && echo PASS
