"""DeepSpeed's own swap_tensor classes (its sources, unchanged) on tensormem's aio op, and
tensormem's AsyncTensorSwapper under DeepSpeed's SwapBufferManager. Run by
scripts/deepspeed-check.sh, which puts DeepSpeed's files on the path and patches its builder.

Usage: deepspeed_check_swappers.py FOLDER
"""
import os
import shutil
import sys
import tempfile

import torch
from deepspeed.ops.op_builder import AsyncIOBuilder
from deepspeed.runtime.swap_tensor.utils import SwapBufferManager, SwapBufferPool, swap_in_tensors
from deepspeed.runtime.swap_tensor.async_swapper import AsyncTensorSwapper as DeepSpeedSwapper
from tensormem.deepspeed import AsyncTensorSwapper as TensormemSwapper

aio = AsyncIOBuilder().load()
handle = aio.aio_handle(1048576, 8, False, True, 1)
print("handle:", type(handle).__module__, type(handle).__name__)
folder = tempfile.mkdtemp(dir=sys.argv[1] if len(sys.argv) > 1 else None)
dtype, align = torch.float32, 256

def run(swapper_class, name):
    mgr = SwapBufferManager(num_elems=1 << 16, count=4, dtype=dtype, aio_handle=handle)
    swapper = swapper_class(handle, align, None)
    expected = {}
    for step in range(3):
        assert not swapper.has_buffers()
        swapper.add_buffers(mgr.allocate_all(num_elems=1 << 16, dtype=dtype))
        for batch in range(8):
            tensors = [torch.randn(int(torch.randint(1, 40000, (1,)))) for _ in range(4)]
            paths = [os.path.join(folder, f"{name}_{step}_{batch}_{i}") for i in range(4)]
            swapper.swap_out_tensors(tensors, paths)
            for t, p in zip(tensors, paths):
                expected[p] = t.clone()
                t.zero_()
        mgr.free(swapper.release_buffers())
        assert len(mgr.free_buffer_index) == 4, mgr.free_buffer_index
    # Swap in as DeepSpeed does: async_pread of the aligned length, then wait.
    buffers = mgr.allocate_all(num_elems=1 << 16, dtype=dtype)
    for path, t in expected.items():
        aligned = -(-t.numel() // align) * align
        view = buffers[0].narrow(0, 0, aligned)
        swap_in_tensors(handle, [view], [path])
        assert handle.wait() == 1
        assert torch.equal(view[:t.numel()], t), path
    mgr.free(buffers)
    print(f"{name}: {len(expected)} tensors out through 4 pinned buffers and back: equal; buffers returned 4 of 4")

run(DeepSpeedSwapper, "deepspeed_swapper")
run(TensormemSwapper, "tensormem_swapper")

# DeepSpeed's SwapBufferPool both ways.
mgr = SwapBufferManager(num_elems=1 << 16, count=2, dtype=dtype, aio_handle=handle)
pool = SwapBufferPool(mgr.allocate_all(num_elems=1 << 16, dtype=dtype), aio_handle=handle)
originals = [torch.randn(1000 * (i + 1)) for i in range(6)]
for i, t in enumerate(originals):
    pool.insert_tensor(t, os.path.join(folder, f"pool{i}"), -(-t.numel() // align) * align)
pool.swap_out(handle)
for c in pool.get_compute_tensors():
    c.zero_()
pool.swap_in(handle)
assert all(torch.equal(c, t) for c, t in zip(pool.get_compute_tensors(), originals))
print("SwapBufferPool: swap_out + swap_in of 6 tensors: equal")
shutil.rmtree(folder)
