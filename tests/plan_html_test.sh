#!/bin/sh
# The interactive plan page in headless Chromium: every buffer drawn, the largest one shown
# on hover with its id, size and lifetime, the wheel zooms; a screenshot is kept. The page's
# functions are checked from inside it (plan_html_check.js) on three plans.
# A trace of zero-byte buffers is titled at 1.0000 x its (zero) lower bound, as `plan` says.
# Usage: plan_html_test.sh TENSORMEM TRACE SCREENSHOT.png ZERO_BYTE_TRACE   (prints PASS or FAIL lines)
set -u
cli=$1
trace=$2
shot=$3
zero_trace=$4
browser=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$browser" ]; then
  echo "SKIP: no chromium here (make test installs Debian's chromium)"
  exit 77
fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
chrome() {
  timeout 120 "$browser" --headless --no-sandbox --disable-gpu --disable-dev-shm-usage \
    --user-data-dir="$dir/profile" "$@" 2>>"$dir/chromium.log"
}
fail=0
"$cli" plan "$trace" --time-limit 1 --html "$dir/plan.html" >/dev/null || { echo "FAIL: plan"; exit 1; }
# The expectations, from the trace itself: the buffer count and the largest buffer by area.
buffers=$(awk -F, 'NR > 1 && NF >= 4 { n++ } END { print n }' "$trace")
largest=$(awk -F, 'NR > 1 && NF >= 4 { a = $4 * ($3 - $2); if (a > best) { best = a; line = $1 " | " $4 " bytes" ; life = "lifetime [" $2 ", " $3 ")" } }
                   END { print line "~" life }' "$trace")
id_size=${largest%~*}
lifetime=${largest#*~}

chrome --dump-dom "file://$dir/plan.html" >"$dir/dom.html"
drawn=$(sed -n 's/.*<span id="drawn">\([0-9]*\)<.*/\1/p' "$dir/dom.html")
if [ "$drawn" != "$buffers" ]; then echo "FAIL drawn: '$drawn' buffers drawn, the trace has $buffers"; fail=1; fi

# The page's script checked from inside (culling, ticks, units, hit test, mapping) by
# plan_html_check.js, appended as a second script, on this plan and on a plan of
# random buffers with shared edges.
check_page() {  # PAGE NAME
  sed 's#</body></html>#<script>#' "$1" >"$dir/check_$2.html"
  cat "$(dirname "$0")/plan_html_check.js" >>"$dir/check_$2.html"
  printf '</script></body></html>\n' >>"$dir/check_$2.html"
  chrome --dump-dom "file://$dir/check_$2.html" >"$dir/check_$2_dom.html"
  result=$(sed -n 's/.*<div id="check">\([^<]*\)<.*/\1/p' "$dir/check_$2_dom.html")
  case "$result" in
    "CHECK PASS "*) echo "$2: ${result#CHECK }" ;;
    *) echo "FAIL $2 page check: ${result:-no result}"; fail=1 ;;
  esac
}
check_page "$dir/plan.html" plan
awk 'BEGIN { srand(7); print "id,lower,upper,size"
             for (i = 0; i < 300; ++i) { l = int(rand() * 40); print "b" i "," l "," l + 1 + int(rand() * 12) "," 1 + int(rand() * 5) * 4096 } }' >"$dir/random.csv"
"$cli" plan "$dir/random.csv" --time-limit 0 --html "$dir/random.html" >/dev/null || { echo "FAIL: plan of random.csv"; exit 1; }
check_page "$dir/random.html" random

chrome --dump-dom "file://$dir/plan.html#selftest" >"$dir/selftest.html"
said=$(sed -n 's/.*<div id="selftest"[^>]*>\([^<]*\)<.*/\1/p' "$dir/selftest.html")
echo "page says: $said"
case "$said" in
  *"hover: $id_size ("*"$lifetime"*) ;;
  *) echo "FAIL hover: expected '$id_size' and '$lifetime'"; fail=1 ;;
esac
# Zoom: the time span shrinks and fewer (or as many) buffers are drawn.
echo "$said" | awk -v n="$buffers" '{
  if (match($0, /time span [0-9.e+]+ to [0-9.e+]+/) == 0) { print "FAIL zoom: no span"; exit }
  split(substr($0, RSTART + 10, RLENGTH - 10), s, " to ");
  if (!(s[2] < s[1])) print "FAIL zoom: span " s[1] " to " s[2];
  match($0, /drawn [0-9]+ to [0-9]+/); split(substr($0, RSTART + 6, RLENGTH - 6), d, " to ");
  if (d[1] != n || d[2] > d[1]) print "FAIL zoom: drawn " d[1] " to " d[2] }' | tee "$dir/zoom"
[ -s "$dir/zoom" ] && fail=1

"$cli" plan "$zero_trace" --time-limit 0 --html "$dir/zero.html" >/dev/null || { echo "FAIL: plan of $zero_trace"; exit 1; }
chrome --dump-dom "file://$dir/zero.html" >"$dir/zero_dom.html"
grep -q 'lower bound 0 B (1.0000 x)' "$dir/zero_dom.html" || { echo "FAIL zero: title is not at 1.0000 x"; fail=1; }
check_page "$dir/zero.html" zero

rm -f "$shot"
chrome --screenshot="$shot" --window-size=1280,720 "file://$dir/plan.html#selftest" >/dev/null
if [ "$(head -c 4 "$shot" 2>/dev/null | od -An -c | tr -d ' ')" != "211PNG" ] || [ "$(wc -c <"$shot")" -lt 5000 ]; then
  echo "FAIL screenshot: $shot is not a PNG of a drawn page"; tail -5 "$dir/chromium.log"; fail=1
fi
[ $fail -eq 0 ] && echo "PASS (screenshot $shot)"
