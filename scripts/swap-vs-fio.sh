#!/usr/bin/env bash
# Swapper figures next to fio on the same directory: the shapes of docs/BENCHMARKS.md,
# interleaved, three rounds each. Usage: scripts/swap-vs-fio.sh DIR [ROUNDS]
set -euo pipefail
dir=${1:?directory}
rounds=${2:-3}
bin=$(dirname "$0")/../build/bin/tensormem
mkdir -p "$dir"
fio_run() {  # name rw bs size -> GB/s
  local out
  out=$(fio --name="$1" --directory="$dir" --rw="$2" --bs="$3" --size="$4" --direct=1 \
        --ioengine=io_uring --iodepth=32 --output-format=json 2>/dev/null)
  python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; k="write" if j["write"]["io_bytes"] else "read"; print(round(j[k]["bw_bytes"]/1e9,3))' <<<"$out"
}
swap_run() {  # extra args -> json
  "$bin" swap-bench --dir "$dir" --json "$@"
}
for r in $(seq "$rounds"); do
  for shape in "4294967296 4294967296 1m" "2147483648 16777216 1m" "2147483648 1048576 1m" "2147483648 65536 64k"; do
    set -- $shape
    fw=$(fio_run w write "$3" "$1"); fr=$(fio_run w read "$3" "$1"); rm -f "$dir"/w.*
    # Tensors below 1 MiB are packed (--pack-below), as a user with many small tensors would.
    pack=(); [ "$2" -lt 1048576 ] && pack=(--pack-below 1048576)
    on=$(swap_run --bytes "$1" --tensor-bytes "$2" "${pack[@]}")
    off=$(swap_run --bytes "$1" --tensor-bytes "$2" --no-checksum "${pack[@]}")
    python3 - "$r" "$1" "$2" "$fw" "$fr" "$on" "$off" <<'PY'
import json, sys
r, total, tensor, fw, fr, on, off = sys.argv[1:]
on, off = json.loads(on), json.loads(off)
print(f"round {r} | {int(total)//int(tensor)} x {int(tensor)} B | fio w {fw} r {fr} | "
      f"crc on w {on['write_gbps']:.2f} (fresh {on['write_fresh_gbps']:.2f}) r {on['read_gbps']:.2f} | "
      f"crc off w {off['write_gbps']:.2f} (fresh {off['write_fresh_gbps']:.2f}) r {off['read_gbps']:.2f}")
PY
  done
  swap_run --bytes 2147483648 --tensor-bytes 67108864 --overlap 1 | python3 -c '
import json, sys
o = json.load(sys.stdin)["overlap"]
print("round", sys.argv[1], "| overlap ratio %.2f (swap-out alone %.2f s, compute alone %.2f s, together %.2f s)"
      % (o["ratio"], o["swap_alone_s"], o["compute_alone_s"], o["together_s"]))' "$r"
done
