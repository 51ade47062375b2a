#!/usr/bin/env bash
# Runs DeepSpeed's own code against tensormem.deepspeed, from a DeepSpeed source checkout:
# its ContiguousMemoryAllocator tests (import changed to tensormem's), its swap_tensor classes
# on tensormem's aio handle, and its NVMe benchmark. DeepSpeed's package needs Python modules
# Debian lacks, so its files run inside a stand-in `deepspeed` package made here (rank 0, a
# logger, a CPU accelerator, an op builder whose load() fails until patch() redirects it).
# With --build-op, also builds DeepSpeed's async_io op (needs libaio-dev and libtorch-dev)
# and runs bench/aio_handle_bench.py with it beside tensormem's handle.
#
# Usage: scripts/deepspeed-check.sh DEEPSPEED_SRC WORK_DIR [--build-op]
set -euo pipefail
ds=$(cd "$1" && pwd)
work=$2
build_op=${3:-}
here=$(cd "$(dirname "$0")/.." && pwd)
python=/usr/bin/python3
pypath=$here/build/python
stub=$(mktemp -d)
trap 'rm -rf "$stub"' EXIT
mkdir -p "$work"

pkg=$stub/deepspeed
mkdir -p "$pkg"/{comm,utils,accelerator,ops/aio,ops/op_builder,runtime/swap_tensor,runtime/zero}
touch "$pkg"/__init__.py "$pkg"/runtime/__init__.py "$pkg"/runtime/zero/__init__.py \
      "$pkg"/runtime/swap_tensor/__init__.py "$pkg"/ops/__init__.py "$pkg"/utils/__init__.py
printf 'def get_rank():\n    return 0\n' > "$pkg"/comm/__init__.py
printf 'import logging\nlogger = logging.getLogger("deepspeed")\n' > "$pkg"/utils/logging.py
cat > "$pkg"/accelerator/__init__.py <<'PY'
class _CPU:
    def device_count(self):
        return 0

    def pin_memory(self, t):
        return t


def get_accelerator():
    return _CPU()
PY
cat > "$pkg"/ops/op_builder/__init__.py <<'PY'
class AsyncIOBuilder:  # as an install without the libaio op: load() fails
    NAME = "async_io"

    def is_compatible(self, verbose=False):
        return False

    def load(self, verbose=True):
        raise RuntimeError("the async_io op is not built")


class UtilsBuilder:
    def load(self, verbose=True):
        raise RuntimeError("the utils op is not built")
PY
printf 'from ..op_builder import AsyncIOBuilder\n' > "$pkg"/ops/aio/__init__.py
# DeepSpeed's own files, unchanged.
cp "$ds"/deepspeed/runtime/swap_tensor/utils.py "$ds"/deepspeed/runtime/swap_tensor/async_swapper.py \
   "$pkg"/runtime/swap_tensor/
cp -r "$ds"/deepspeed/io "$pkg"/io
# The one line a user adds: DeepSpeed's builder loads tensormem's op.
printf 'import tensormem.deepspeed\ntensormem.deepspeed.patch()\n' > "$stub"/sitecustomize.py
export PYTHONPATH=$stub:$pypath

echo "== DeepSpeed's ContiguousMemoryAllocator tests, import changed to tensormem.deepspeed (10 runs)"
sed 's/^from deepspeed.runtime.zero.contiguous_memory_allocator import/from tensormem.deepspeed import/' \
    "$ds"/deepspeed/runtime/zero/test.py > "$stub"/zero_test.py
for i in $(seq 10); do "$python" "$stub"/zero_test.py > "$stub"/zero.log 2>&1 || { tail -5 "$stub"/zero.log; exit 1; }; done
echo "passed 10 of 10"

echo "== DeepSpeed's swap_tensor classes on tensormem's handle"
"$python" "$here"/scripts/deepspeed_check_swappers.py "$work"

echo "== DeepSpeed's NVMe benchmark (test_ds_aio.py), aio_handle engine"
cd "$ds"/csrc/aio/py_test
for extra in "" "--read" "--validate" "--read --validate --io_parallel 2" "--single_submit --sequential_requests"; do
  echo "-- $extra"
  PYTHONPATH=$PYTHONPATH:. "$python" test_ds_aio.py --folder "$work" --io_size 1G --block_size 1M \
      --queue_depth 32 --loops 3 --engine aio_handle $extra 2>&1 | grep -E "E2E .* Speed|Error|Traceback"
done
rm -f "$work"/_aio_*

if [ "$build_op" = "--build-op" ]; then
  echo "== DeepSpeed's async_io op, built as a torch extension, beside tensormem's handle"
  op_build=$work/ds_aio_build
  mkdir -p "$op_build"
  "$python" - "$ds" "$op_build" <<'PY'
import sys, torch.utils.cpp_extension as ce
ds, out = sys.argv[1], sys.argv[2]
names = ["aio/py_lib/deepspeed_py_io_handle.cpp", "aio/py_lib/deepspeed_py_aio.cpp",
         "aio/py_lib/deepspeed_py_aio_handle.cpp", "aio/py_lib/deepspeed_aio_thread.cpp",
         "aio/common/deepspeed_aio_utils.cpp", "aio/common/deepspeed_aio_common.cpp",
         "aio/common/deepspeed_aio_types.cpp", "aio/py_lib/deepspeed_cpu_op.cpp",
         "aio/py_lib/deepspeed_aio_op_desc.cpp", "aio/py_lib/deepspeed_py_copy.cpp",
         "pin_memory/deepspeed_pin_tensor.cpp", "pin_memory/page_alloc.cpp", "aio/py_lib/py_ds_aio.cpp"]
ce.load(name="async_io_op", sources=[f"{ds}/csrc/{n}" for n in names], build_directory=out,
        extra_include_paths=["/usr/include/torch/csrc/api/include"] +
                            [f"{ds}/csrc/{d}" for d in ("aio/py_lib", "aio/common", "pin_memory", "includes")],
        extra_cflags=["-O2", "-std=c++17", "-Wno-reorder"], extra_ldflags=["-laio"], verbose=False)
PY
  "$python" "$here"/bench/aio_handle_bench.py --dir "$work" --rounds 5 --deepspeed-op "$op_build"/async_io_op.so
fi
