"""PyTorch front ends: DeepSpeed's ContiguousMemoryAllocator and AsyncTensorSwapper, done
without their defects.

``ContiguousMemoryAllocator(size, dtype, device)`` keeps tensors in one tensormem arena of
``size`` elements. Tensors it returns are views of that arena; when a defragmentation moves
them, every returned tensor object and every assigned ``param.data`` is re-pointed at the new
place with the same values before ``allocate_tensor`` returns (as DeepSpeed does, but also for
tensors that have no param). A released tensor's param is detached (set to an empty tensor)
so it cannot point into memory that is handed out again.
"""

from __future__ import annotations

import time
import weakref
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.utils.dlpack

from . import _tensormem


class ContiguousMemoryAllocator:
    """DeepSpeed's ``ContiguousMemoryAllocator`` on a tensormem arena (CPU memory)."""

    def __init__(self, size: int, dtype: torch.dtype, device="cpu", policy: str = "minimal"):
        device = torch.device(device)
        if device.type != "cpu":
            raise NotImplementedError(
                f"tensormem.torch.ContiguousMemoryAllocator supports CPU tensors; got {device}")
        self.dtype = dtype
        self.device = device
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.total_size = int(size)
        self._arena = _tensormem.ContiguousArena(self.total_size * self.itemsize,
                                                 alignment=self.itemsize, policy=policy)
        raw = torch.utils.dlpack.from_dlpack(self._arena.buffer())  # uint8, no copy
        self.buffer = raw.view(dtype)
        self._tensors: Dict[int, torch.Tensor] = {}   # id -> the tensor handed out
        self._numel: Dict[int, int] = {}
        self._params: Dict[int, List[tuple]] = {}     # id -> [(weakref(param), shape)]
        self._ids: Dict[int, int] = {}                # data_ptr -> id

    # DeepSpeed's API ------------------------------------------------------------------

    def allocate_tensor(self, size: int) -> torch.Tensor:
        """A tensor of ``size`` elements inside the buffer (defragments first if needed)."""
        size = int(size)
        tensor_id, offset = self._arena.allocate(size * self.itemsize)
        self._apply_moves()
        if size == 0:
            tensor = torch.empty(0, dtype=self.dtype)
        else:
            tensor = self.buffer.narrow(0, offset // self.itemsize, size)
            self._ids[tensor.data_ptr()] = tensor_id
        tensor.ds_tensormem_id = tensor_id  # noqa: attribute for release_tensor of empty tensors
        self._tensors[tensor_id] = tensor
        self._numel[tensor_id] = size
        return tensor

    def release_tensor(self, tensor: torch.Tensor) -> None:
        tensor_id = getattr(tensor, "ds_tensormem_id", None)
        if tensor_id is None:
            tensor_id = self._ids.get(tensor.data_ptr())
        if tensor_id is None or tensor_id not in self._tensors:
            raise ValueError("release_tensor: this tensor was not allocated here or was released")
        self.release_tensor_with_id(tensor_id)

    def release_tensor_with_id(self, tensor_id: int) -> None:
        if tensor_id not in self._tensors:
            raise ValueError(f"release_tensor_with_id: unknown or released id {tensor_id}")
        self._arena.release(tensor_id)
        tensor = self._tensors.pop(tensor_id)
        self._numel.pop(tensor_id)
        if tensor.numel() != 0:
            self._ids.pop(tensor.data_ptr(), None)
        for ref, _shape in self._params.pop(tensor_id, []):
            param = ref()
            if param is not None:  # detach: never let a param point into reused memory
                param.data = torch.empty(0, dtype=self.dtype)

    def assign_to_param(self, tensor: torch.Tensor, param: torch.Tensor, numel: int, shape) -> None:
        tensor_id = getattr(tensor, "ds_tensormem_id", None)
        if tensor_id not in self._tensors:
            raise ValueError("assign_to_param: tensor is not live in this allocator")
        if numel > tensor.numel():
            raise ValueError(f"assign_to_param: numel {numel} exceeds the tensor's {tensor.numel()}")
        param.data = tensor.narrow(0, 0, numel).view(shape)
        self._params.setdefault(tensor_id, []).append((weakref.ref(param), tuple(shape)))

    def print_allocation(self, resolution: int = 200) -> None:
        print(self._arena.print_allocation(resolution))

    def allocation_svg(self, path: Optional[str] = None) -> str:
        """The map as an SVG picture (each tensor by offset, its id and size as a tooltip);
        also written to `path` when one is given."""
        svg = self._arena.allocation_svg()
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(svg)
        return svg

    def max_allocated(self) -> int:
        """Most elements in use at once."""
        return self._arena.max_allocated() // self.itemsize

    # tensormem extras -----------------------------------------------------------------

    def stats(self) -> dict:
        return self._arena.stats()

    def _apply_moves(self) -> None:
        for tensor_id, offset in self._arena.take_moves():
            tensor = self._tensors.get(tensor_id)
            if tensor is None or tensor.numel() == 0:
                continue
            self._ids.pop(tensor.data_ptr(), None)
            numel = self._numel[tensor_id]
            tensor.data = self.buffer.narrow(0, offset // self.itemsize, numel)
            self._ids[tensor.data_ptr()] = tensor_id
            for ref, shape in self._params.get(tensor_id, []):
                param = ref()
                if param is not None:
                    count = int(np.prod(shape)) if len(shape) else 1
                    param.data = tensor.data.narrow(0, 0, count).view(shape)


class AsyncTensorSwapper:
    """DeepSpeed's ``AsyncTensorSwapper`` with swap-in, on tensormem's io_uring swapper.

    ``add_buffers`` takes pinned staging capacity from a tensormem pool (the tensors given are
    only used for their total size); ``swap_out_tensors`` queues writes and returns at once;
    ``wait``/``synchronize`` report per-tensor results; ``swap_in_tensors`` reads back into
    existing CPU tensors and verifies checksums.
    """

    def __init__(self, aio_handle=None, numel_alignment: int = 1024, timers=None,
                 queue_depth: int = 32, block_bytes: int = 1 << 20, engine: str = "uring"):
        self.numel_alignment = numel_alignment
        self._pool = _tensormem.PinnedPool()
        self._queue_depth = queue_depth
        self._block_bytes = block_bytes
        self._engine = engine
        self._staging = 8
        self._swapper: Optional[_tensormem.TensorSwapper] = None
        self._pending: List[tuple] = []  # (ticket, tensors kept alive until their I/O ends)
        self._timers: Dict[str, float] = {"swap_out": 0.0, "swap_in": 0.0, "wait": 0.0}
        self.results: List[dict] = []

    def _ensure(self) -> _tensormem.TensorSwapper:
        if self._swapper is None:
            self._swapper = _tensormem.TensorSwapper(
                self._pool, queue_depth=self._queue_depth, block_bytes=self._block_bytes,
                staging_buffers=self._staging, engine=self._engine)
        return self._swapper

    def add_buffers(self, buffer_list: Sequence[torch.Tensor]) -> None:
        total = sum(t.numel() * t.element_size() for t in buffer_list)
        self._staging = max(2, total // self._block_bytes)

    def release_buffers(self) -> List[torch.Tensor]:
        self.synchronize()
        self._swapper = None
        return []

    def get_timer_names(self) -> List[str]:
        return list(self._timers)

    @staticmethod
    def _as_array(tensor: torch.Tensor) -> np.ndarray:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("tensors must be contiguous CPU tensors")
        return tensor.detach().view(torch.uint8).numpy() if tensor.numel() else np.empty(0, np.uint8)

    def swap_out_tensors(self, tensor_list: Sequence[torch.Tensor], path_list: Sequence[str]) -> None:
        start = time.perf_counter()
        arrays = [self._as_array(t) for t in tensor_list]
        ticket = self._ensure().swap_out(arrays, [str(p) for p in path_list])
        self._pending.append((ticket, arrays))
        self._timers["swap_out"] += time.perf_counter() - start

    def swap_in_tensors(self, path_list: Sequence[str], tensor_list: Sequence[torch.Tensor]) -> None:
        start = time.perf_counter()
        arrays = [self._as_array(t) for t in tensor_list]
        ticket = self._ensure().swap_in([str(p) for p in path_list], arrays)
        self._pending.append((ticket, arrays))
        self._timers["swap_in"] += time.perf_counter() - start

    def synchronize(self) -> List[dict]:
        """Waits for every queued transfer; returns (and keeps in ``results``) one dict per
        tensor; raises OSError for the first failure after all have completed."""
        start = time.perf_counter()
        results: List[dict] = []
        for ticket, _arrays in self._pending:
            results.extend(self._ensure().wait(ticket))
        self._pending.clear()
        self._timers["wait"] += time.perf_counter() - start
        self.results = results
        for r in results:
            if r["error"]:
                raise OSError(r["error"], r["message"])
        return results

    wait = synchronize

    def stats(self) -> dict:
        return self._ensure().stats()

    def timer(self, name: str) -> float:
        return self._timers[name]
