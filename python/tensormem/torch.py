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

import operator
import time
import weakref
from types import MappingProxyType
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.utils.dlpack

from . import _tensormem
from .offload import (OffloadError, OffloadedAdam, OffloadedAdamW, OffloadedSGD,  # noqa: F401
                      ZeroOffloadedOptimizer)
from .model import (Buffer, Capture, Graph, ModulePlan, UnsupportedGraph, activation_lower_bound,  # noqa: F401
                    capture, plan_module, savings, trace)
from . import _storage_hold


def size_hold_problem() -> str:
    """Empty when a tensor that a transfer uses (``TensorSwapper``, ``AsyncTensorSwapper``,
    ``tensormem.deepspeed.aio_handle``, until the wait) cannot be resized in place to more
    bytes than its storage has: ``resize_`` then raises RuntimeError instead of freeing the
    memory the transfer reads or writes. Otherwise why not (tensormem's PyTorch extension is
    missing or built for another PyTorch); the first transfer of a torch tensor warns it."""
    return _storage_hold.problem()


class AllocatorAssertion(AssertionError, ValueError):
    """Misuse DeepSpeed's allocator would assert on (an unknown or released tensor, a view,
    a second param): an AssertionError as there, and a ValueError, with a clearer message."""


class ArenaFull(AssertionError, MemoryError):
    """Not enough free elements in the buffer (DeepSpeed asserts; also a MemoryError)."""


class _CallableInt(int):
    """An int that may also be called: DeepSpeed's ``max_allocated`` attribute shadows its
    method, so its code reads ``mem.max_allocated`` and older code calls it."""

    def __call__(self) -> int:
        return int(self)


class ContiguousMemoryAllocator:
    """DeepSpeed's ``ContiguousMemoryAllocator`` (its observable contract) on a tensormem
    arena of ``size`` elements of ``dtype``, on the CPU or (``device="cuda"``) CUDA device 0.

    As DeepSpeed: the buffer starts zeroed; a tensor's id is ``id(tensor)``;
    ``assign_to_param`` sets ``param.contiguous_tensor_id``; ``max_allocated``,
    ``total_free``, ``largest_contiguous``, ``count`` are ints kept current and
    ``tensor_map``, ``tensor_ids``, ``tensor_addresses``, ``tensor_sizes``,
    ``contiguous_sizes``, ``id_to_params`` read-only mappings (addresses in elements).
    Beyond DeepSpeed: a defragmentation moves as few bytes as possible (``policy="full"``
    slides everything down as DeepSpeed does) and re-points every returned tensor and every
    assigned param, with or without a param; a view of a tensor is refused by
    ``release_tensor`` (DeepSpeed frees memory it cannot account for); a released tensor's
    params are detached (set to an empty tensor); errors say what is wrong.
    """

    def __init__(self, size: int, dtype: torch.dtype, device="cpu", policy: str = "minimal"):
        device = torch.device(device)
        if device.type not in ("cpu", "cuda") or (device.type == "cuda" and device.index not in (None, 0)):
            raise NotImplementedError(
                "tensormem.torch.ContiguousMemoryAllocator keeps tensors on the CPU or CUDA device 0; "
                f"{device} is not supported")
        self.dtype = dtype
        self.device = device
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.total_size = operator.index(size)  # TypeError for 10.5, as torch.zeros(10.5) in DeepSpeed
        if self.total_size < 0:
            raise ValueError(f"size must be >= 0 elements, not {self.total_size}")
        if self.total_size * self.itemsize >= 2**64:
            raise ValueError(f"size {self.total_size} elements of {self.itemsize} bytes ({dtype}) is "
                             f"{self.total_size * self.itemsize} bytes, more than 2^64 - 1")
        # CUDA: the arena's memory comes from tensormem's CUDA resource and defragmentation
        # moves by device copies; RuntimeError says why when no device can be used.
        self._arena = _tensormem.ContiguousArena(self.total_size * self.itemsize, alignment=self.itemsize,
                                                 policy=policy, device=device.type)
        raw = torch.utils.dlpack.from_dlpack(self._arena.buffer())  # uint8, no copy
        self.buffer = raw.view(dtype)
        self.buffer.zero_()  # as DeepSpeed's torch.zeros
        self.count = 0
        self._tensors: Dict[int, torch.Tensor] = {}    # id(tensor) -> the tensor handed out
        self._arena_ids: Dict[int, int] = {}           # id(tensor) -> arena id
        self._by_arena_id: Dict[int, int] = {}         # arena id -> id(tensor)
        self._params: Dict[int, List[tuple]] = {}      # id(tensor) -> [(weakref(param), shape)]

    # DeepSpeed's API ------------------------------------------------------------------

    def allocate_tensor(self, size: int) -> torch.Tensor:
        """A tensor of ``size`` elements inside the buffer (defragments first if needed)."""
        size = operator.index(size)
        if size < 0:
            raise AllocatorAssertion(f"allocate_tensor: size must be >= 0, not {size}")
        if size > self.total_free:
            raise ArenaFull(f"allocate_tensor({size}): only {self.total_free} of {self.total_size} "
                            f"elements are free")
        try:
            arena_id, offset = self._arena.allocate(size * self.itemsize)
        except MemoryError as e:
            raise ArenaFull(str(e)) from None
        self._apply_moves()
        if size == 0:
            tensor = self.buffer.narrow(0, 0, 0)
        else:
            tensor = self.buffer.narrow(0, offset // self.itemsize, size)
        tid = id(tensor)
        self._tensors[tid] = tensor
        self._arena_ids[tid] = arena_id
        self._by_arena_id[arena_id] = tid
        self.count += 1
        return tensor

    def release_tensor(self, tensor: torch.Tensor) -> None:
        tid = id(tensor)
        if self._tensors.get(tid) is not tensor:
            raise AllocatorAssertion(
                "release_tensor: not a tensor allocate_tensor returned here, or already released "
                "(a view or slice of one? release the tensor itself)")
        self.release_tensor_with_id(tid)

    def release_tensor_with_id(self, tensor_id: int) -> None:
        if tensor_id not in self._tensors:
            raise AllocatorAssertion(f"release_tensor_with_id: invalid tensor id {tensor_id} "
                                     "(unknown here or already released)")
        arena_id = self._arena_ids.pop(tensor_id)
        self._arena.release(arena_id)
        del self._by_arena_id[arena_id]
        del self._tensors[tensor_id]
        for ref, _shape in self._params.pop(tensor_id, []):
            param = ref()
            if param is not None:  # detach: never let a param point into reused memory
                param.data = torch.empty(0, dtype=self.dtype, device=self.device)

    def assign_to_param(self, tensor: torch.Tensor, param: torch.Tensor, numel: int, shape) -> None:
        tid = id(tensor)
        if self._tensors.get(tid) is not tensor:
            raise AllocatorAssertion("assign_to_param: no such tensor allocated by this allocator")
        if numel > tensor.numel():
            raise AllocatorAssertion(f"assign_to_param: numel {numel} exceeds the tensor's {tensor.numel()}")
        if tid in self._params:
            raise AllocatorAssertion("assign_to_param: this tensor has already been assigned to a param")
        param.data = tensor.narrow(0, 0, numel).view(shape)
        param.contiguous_tensor_id = tid
        self._params[tid] = [(weakref.ref(param), tuple(param.data.shape))]  # -1 resolved

    def print_allocation(self, resolution: int = 200) -> None:
        print(self._arena.print_allocation(resolution))

    @property
    def max_allocated(self) -> int:
        """Most elements in use at once (an int; calling it works too)."""
        return _CallableInt(self._arena.max_allocated() // self.itemsize)

    @property
    def total_free(self) -> int:
        return self.total_size - self._arena.stats()["used_bytes"] // self.itemsize

    @property
    def largest_contiguous(self) -> int:
        return self._arena.stats()["largest_free_bytes"] // self.itemsize

    @property
    def tensor_map(self) -> Mapping[int, torch.Tensor]:
        return MappingProxyType(self._tensors)

    def _addresses(self) -> Dict[int, int]:
        base = self.buffer.data_ptr()
        return {tid: (t.data_ptr() - base) // self.itemsize for tid, t in self._tensors.items() if t.numel()}

    @property
    def tensor_addresses(self) -> Mapping[int, int]:
        """id -> address (elements); tensors of zero elements occupy no address."""
        return MappingProxyType(self._addresses())

    @property
    def tensor_ids(self) -> Mapping[int, int]:
        return MappingProxyType({address: tid for tid, address in self._addresses().items()})

    @property
    def tensor_sizes(self) -> Mapping[int, int]:
        return MappingProxyType({address: self._tensors[tid].numel() for tid, address in self._addresses().items()})

    @property
    def contiguous_sizes(self) -> Mapping[int, int]:
        """Free holes: address -> elements."""
        holes, cursor = {}, 0
        for address, size in sorted(self.tensor_sizes.items()):
            if address > cursor:
                holes[cursor] = address - cursor
            cursor = address + size
        if cursor < self.total_size:
            holes[cursor] = self.total_size - cursor
        return MappingProxyType(holes)

    @property
    def id_to_params(self) -> Mapping[int, List[torch.Tensor]]:
        return MappingProxyType({tid: [p for p in (ref() for ref, _ in refs) if p is not None]
                                 for tid, refs in self._params.items()})

    # tensormem extras -----------------------------------------------------------------

    def allocation_svg(self, path: Optional[str] = None) -> str:
        """The map as an SVG picture (each tensor by offset, its id and size as a tooltip);
        also written to `path` when one is given."""
        svg = self._arena.allocation_svg()
        if path is not None:
            _tensormem._write_file(path, svg)  # a failed write keeps the file there
        return svg

    def stats(self) -> dict:
        return self._arena.stats()

    def _apply_moves(self) -> None:
        """Points each moved tensor, and the parameter assigned to it, at its new place. The
        old place holds other bytes now, so a view made before (one autograd saved for a
        backward: a linear layer's ``weight.t()``) no longer holds the tensor's values: the
        move is counted in the tensor's and the parameter's versions, as an in-place change,
        so that such a backward is refused ("modified by an inplace operation") instead of
        reading those bytes."""
        for arena_id, offset in self._arena.take_moves():
            tid = self._by_arena_id.get(arena_id)
            tensor = self._tensors.get(tid) if tid is not None else None
            if tensor is None or tensor.numel() == 0:
                continue
            tensor.data = self.buffer.narrow(0, offset // self.itemsize, tensor.numel())
            _storage_hold.mark_written(tensor)
            for ref, shape in self._params.get(tid, []):
                param = ref()
                if param is not None:
                    count = int(np.prod(shape)) if len(shape) else 1
                    param.data = tensor.data.narrow(0, 0, count).view(shape)
                    _storage_hold.mark_written(param)


class AsyncTensorSwapper:
    """DeepSpeed's ``AsyncTensorSwapper`` with swap-in, on tensormem's io_uring swapper.

    ``add_buffers`` takes pinned staging capacity from a tensormem pool (the tensors given are
    only used for their total size); ``swap_out_tensors`` queues writes and returns at once;
    ``wait``/``synchronize`` report per-tensor results; ``swap_in_tensors`` reads back into
    existing CPU tensors and verifies checksums.
    """

    def __init__(self, aio_handle=None, numel_alignment: int = 1024, timers=None,
                 queue_depth: int = 32, block_bytes: int = 1 << 20, engine: str = "uring"):
        # Checked here, not when the first transfer makes the swapper.
        queue_depth, block_bytes = operator.index(queue_depth), operator.index(block_bytes)
        numel_alignment = operator.index(numel_alignment)
        if numel_alignment <= 0:
            raise ValueError(f"numel_alignment must be positive, not {numel_alignment}")
        if not 1 <= queue_depth <= _tensormem.MAX_QUEUE_DEPTH:
            raise ValueError(f"queue_depth must be 1 to {_tensormem.MAX_QUEUE_DEPTH}, not {queue_depth}")
        if block_bytes <= 0 or block_bytes % _tensormem.SWAP_BLOCK_ALIGNMENT:
            raise ValueError(f"block_bytes must be a positive multiple of {_tensormem.SWAP_BLOCK_ALIGNMENT}, "
                             f"not {block_bytes}")
        if engine not in _tensormem.IO_ENGINES:
            raise ValueError(f"engine must be {' or '.join(map(repr, _tensormem.IO_ENGINES))}, not {engine!r}")
        self.numel_alignment = numel_alignment
        self._pool = _tensormem.PinnedPool()
        self._queue_depth = queue_depth
        self._block_bytes = block_bytes
        self._engine = engine
        self._staging = 8
        self._swapper: Optional[_tensormem.TensorSwapper] = None
        self._pending: List[int] = []  # tickets not yet waited for (TensorSwapper holds their tensors)
        self._collected: List[dict] = []  # results of tickets a synchronize collected before Ctrl-C
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
    def _checked(tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected torch tensors, not {type(tensor).__name__} "
                            "(swap_out_tensors takes tensors then paths, swap_in_tensors paths then tensors)")
        if tensor.layout != torch.strided:
            raise ValueError(f"tensors must be dense (strided), not {tensor.layout}")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("tensors must be contiguous CPU tensors")
        # The tensor itself: TensorSwapper holds it with its storage until the wait, and fails a
        # swap-in into one given other memory meanwhile.
        return tensor

    def swap_out_tensors(self, tensor_list: Sequence[torch.Tensor], path_list: Sequence[str]) -> None:
        start = time.perf_counter()
        tensors = [self._checked(t) for t in tensor_list]
        self._pending.append(self._ensure().swap_out(tensors, [str(p) for p in path_list]))
        self._timers["swap_out"] += time.perf_counter() - start

    def swap_in_tensors(self, path_list: Sequence[str], tensor_list: Sequence[torch.Tensor]) -> None:
        start = time.perf_counter()
        tensors = [self._checked(t) for t in tensor_list]
        self._pending.append(self._ensure().swap_in([str(p) for p in path_list], tensors))
        self._timers["swap_in"] += time.perf_counter() - start

    def synchronize(self) -> List[dict]:
        """Waits for every queued transfer; returns (and keeps in ``results``) one dict per
        tensor; raises OSError for the first failure after all have completed. Ctrl-C raises
        KeyboardInterrupt; the transfers go on, and the next call returns every result, those
        collected before the interruption included."""
        start = time.perf_counter()
        try:
            # Ctrl-C (KeyboardInterrupt) may end any wait: tickets collected before it are
            # kept with their results, the rest stay pending, and the next call goes on.
            while self._pending:
                self._collected.extend(self._ensure().wait(self._pending[0]))
                self._pending.pop(0)
        finally:
            self._timers["wait"] += time.perf_counter() - start
        results, self._collected = self._collected, []
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


if __name__ == "__main__":
    import sys

    from tensormem.model import main

    sys.exit(main())
