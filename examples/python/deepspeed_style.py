"""Replacing DeepSpeed's ContiguousMemoryAllocator and AsyncTensorSwapper with tensormem.

Run after `make build`:  PYTHONPATH=build/python /usr/bin/python3 examples/python/deepspeed_style.py
"""

import tempfile

import torch

from tensormem.torch import AsyncTensorSwapper, ContiguousMemoryAllocator

# A ZeRO-3-style parameter buffer of 1024 fp16 elements.
allocator = ContiguousMemoryAllocator(1024, torch.half, "cpu")
params = [torch.nn.Parameter(torch.empty(0, dtype=torch.half)) for _ in range(4)]
tensors = []
for i, param in enumerate(params):
    t = allocator.allocate_tensor(256)
    t.copy_(torch.full((256,), float(i)))
    allocator.assign_to_param(t, param, 256, (16, 16))
    tensors.append(t)
allocator.print_allocation(resolution=32)

# Release two partitions: 512 elements are free, but in two holes of 256.
allocator.release_tensor(tensors[0])
allocator.release_tensor(tensors[2])
allocator.print_allocation(resolution=32)

# A 512-element request defragments; params 1 and 3 follow their tensors.
big = allocator.allocate_tensor(512)
allocator.print_allocation(resolution=32)
intact = bool(torch.all(params[1] == 1)) and bool(torch.all(params[3] == 3))
print("defragmentations:", allocator.stats()["defragmentations"],
      "bytes moved:", allocator.stats()["bytes_moved"])
print("values intact after defragmentation:", intact)
print("released params are detached:", params[0].numel() == 0 and params[2].numel() == 0)
print("max allocated (elements):", allocator.max_allocated())

# Optimizer state out to disk and back.
with tempfile.TemporaryDirectory() as directory:
    swapper = AsyncTensorSwapper()
    state = [torch.randn(100_000), torch.randn(33_333)]
    saved = [s.clone() for s in state]
    paths = [f"{directory}/exp_avg.swp", f"{directory}/exp_avg_sq.swp"]
    swapper.swap_out_tensors(state, paths)
    swapper.synchronize()          # now the tensors' memory may be reused
    for s in state:
        s.zero_()
    swapper.swap_in_tensors(paths, state)
    swapper.synchronize()
    print("swap round trip intact:", all(torch.equal(a, b) for a, b in zip(state, saved)))
    print("swapper:", {k: v for k, v in swapper.stats().items() if k in ("engine", "direct", "checksums")})
