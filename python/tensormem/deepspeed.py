"""DeepSpeed drop-ins on tensormem: the aio op, pinned tensors, and the swapping classes.

``AsyncIOBuilder().load()`` returns an object with DeepSpeed's ``aio_handle``, ``aio_read``,
``aio_write`` and ``deepspeed_memcpy``, built on tensormem's io_uring engine: nothing to
compile, and every request's result is checked. ``patch()`` makes DeepSpeed's own
``AsyncIOBuilder`` load this one, so DeepSpeed's NVMe offload runs on tensormem unchanged.

Files are raw bytes, exactly what DeepSpeed writes (no header, any offset; a write creates
the file with mode 0600 and never truncates it). Differences from DeepSpeed's op, all on the
side of not losing data:

- A failed operation raises: ``OSError`` (errno, path) when it cannot be queued (missing
  directory, a read past the end of the file); ``AIOError`` (an ``OSError`` carrying every
  failure) from ``wait()`` or a synchronous call when an I/O failed or came up short
  (ENOSPC, EIO, a file that shrank). DeepSpeed prints and returns -1, or loses the error.
- Any CPU tensor works directly (O_DIRECT when its address, offset and size are multiples
  of 4096, the page cache otherwise); other tensors (CUDA, non-contiguous) go through a
  bounce copy, written back by ``wait()`` for reads that succeeded (a failed read leaves
  its tensor as it was; a copy that fails, into a tensor resized meanwhile, is raised after
  the others are made). Meta and sparse tensors, and reads into a view whose elements share
  memory (``expand``), are refused with ``ValueError`` before any I/O.
- ``intra_op_parallelism`` is the number of io_uring rings, each driven by its own thread;
  an operation's ``block_size`` requests are dealt out to them in turn (DeepSpeed splits it
  in equal parts, which must divide evenly; here any size works). ``single_submit`` and
  ``overlap_events`` are kept and reported: tensormem's engine always hands each request to
  the kernel as it is cut and reaps completions on the rings' threads while more are
  queued, which measured fastest on the disks tried (batched submission let the block layer
  merge requests and lowered the queue depth the device saw).
- ``get_alignment()`` is 4096, the O_DIRECT alignment tensormem uses.
"""

from __future__ import annotations

import errno
import operator
import os
import threading
import warnings
import types
from typing import List, Optional, Sequence, Tuple

import torch
import torch.utils.dlpack

from . import _storage_hold, _tensormem
from .torch import AllocatorAssertion, ArenaFull, ContiguousMemoryAllocator  # noqa: F401

__all__ = [
    "AIOError", "AllocatorAssertion", "ArenaFull", "ContiguousMemoryAllocator", "AsyncIOBuilder", "aio_handle", "aio_read", "aio_write", "deepspeed_memcpy",
    "new_cpu_locked_tensor", "free_cpu_locked_tensor", "is_pinned", "patch", "allow_unlocked",
    "AsyncTensorSwapper", "SwapperAssertion", "ASYNC_SWAPPER_WAIT_TIMER",
]


class AIOError(OSError):
    """Operations failed. ``errno``/``filename`` are the first failure's; ``errors`` lists
    ``(path, errno, message)`` for every failed operation and ``completed`` counts the
    operations the wait finished (failed ones included)."""

    def __init__(self, errors: List[Tuple[str, int, str]], completed: int):
        path, code, message = errors[0]
        more = f" (and {len(errors) - 1} more failed operations)" if len(errors) > 1 else ""
        super().__init__(code, message + more, path)
        self.errors = errors
        self.completed = completed


# ----------------------------------------------------------------------------- pinned tensors

def _address(tensor: torch.Tensor) -> int:
    """Where a tensor's bytes start (an empty tensor's data_ptr() is 0: its storage's)."""
    if tensor.numel():
        return tensor.data_ptr()
    return _storage_hold.storage_of(tensor).data_ptr() + tensor.storage_offset() * tensor.element_size()


class _PinnedTensors:
    """Page-locked CPU tensors from a tensormem pool, process-wide as DeepSpeed's manager is.

    A tensor keeps its memory alive: ``free`` forgets it at once (and returns False for a
    tensor it does not manage, as DeepSpeed does), and the bytes go back to the pool when the
    last view of the tensor is gone, so no live tensor ever points at reused memory.

    Per process, as DeepSpeed's: a child forked from a process that used it makes a pool of
    its own at its first allocation (the inherited pool's memory is not locked in a child, and
    refuses to allocate there), and takes a new lock (another thread of the parent may have
    held the old one at the fork). Inherited tensors stay usable and can be freed."""

    # The pool's words for its fallback, and the knob that allows it here (DeepSpeed's callers
    # pass no options).
    _POOL_HINT = ", or allow the unlocked fallback"
    _HINT = (", or allow unlocked memory where the limit refuses (TENSORMEM_ALLOW_UNLOCKED=1 in the environment, "
             "or tensormem.deepspeed.allow_unlocked(True))")

    def __init__(self):
        self._lock = threading.Lock()
        # Where RLIMIT_MEMLOCK refuses to lock (a user without CAP_IPC_LOCK): unlocked memory,
        # with a RuntimeWarning, instead of MemoryError.
        self.allow_unlocked = os.environ.get("TENSORMEM_ALLOW_UNLOCKED", "") == "1"
        self._warned_unlocked = 0  # unlocked slabs already warned of
        self._pool: Optional[_tensormem.PinnedPool] = None
        self._pool_pid = 0  # the process that made _pool
        self._pool_allows_unlocked = False  # the allow_unlocked _pool was made with
        self._regions = {}  # start address -> (end address, PinnedBuffer)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork_in_child)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()

    def alloc(self, num_elem: int, dtype: torch.dtype) -> torch.Tensor:
        num_elem = int(num_elem)
        if num_elem < 0:
            raise ValueError(f"new_cpu_locked_tensor: num_elem must be >= 0, not {num_elem}")
        nbytes = num_elem * torch.empty((), dtype=dtype).element_size()
        register = torch.cuda.is_available()
        if register and torch.cuda._is_in_bad_fork():
            raise RuntimeError("new_cpu_locked_tensor: this process was forked from one that had initialised CUDA, "
                               "which a forked child cannot use, so its memory cannot be pinned for CUDA (as "
                               "torch's pin_memory cannot here); start it with the 'spawn' method instead")
        with self._lock:
            if self._pool is None or self._pool_pid != os.getpid() or \
                    self._pool_allows_unlocked != self.allow_unlocked:
                self._pool = _tensormem.PinnedPool(allow_unlocked_fallback=self.allow_unlocked)
                self._pool_pid = os.getpid()
                self._pool_allows_unlocked = self.allow_unlocked
                self._warned_unlocked = 0
            try:
                buffer = self._pool.allocate(max(nbytes, 1))
            except MemoryError as e:
                words = str(e)
                if not words.endswith(self._POOL_HINT):
                    raise
                raise MemoryError(f"new_cpu_locked_tensor: {words[:-len(self._POOL_HINT)]}{self._HINT}") from None
            start = buffer.address
            self._regions[start] = (start + nbytes, buffer)
            unlocked = self._pool.stats()["unlocked_fallbacks"]
            newly_unlocked, self._warned_unlocked = unlocked > self._warned_unlocked, unlocked
        if newly_unlocked:
            warnings.warn(f"new_cpu_locked_tensor: {nbytes} bytes could not be page-locked (RLIMIT_MEMLOCK): "
                          f"unlocked memory, as TENSORMEM_ALLOW_UNLOCKED / allow_unlocked(True) allows "
                          f"({unlocked} unlocked slab(s) so far)", RuntimeWarning, stacklevel=3)
        tensor = torch.utils.dlpack.from_dlpack(buffer)[:nbytes].view(dtype)
        assert _address(tensor) == start
        if register:  # let torch know the memory is pinned
            try:
                error = int(torch.cuda.cudart().cudaHostRegister(start, max(nbytes, 1), 0))
                if error != 0:
                    raise MemoryError(f"new_cpu_locked_tensor: cudaHostRegister of {nbytes} bytes failed "
                                      f"with CUDA error {error}")
            except BaseException:  # (also CUDA that cannot start, Ctrl-C): the bytes go back to the pool
                with self._lock:
                    del self._regions[start]
                del tensor, buffer  # (not held by the traceback's frame)
                raise
        return tensor

    def free(self, tensor: torch.Tensor) -> bool:
        with self._lock:
            entry = self._regions.pop(_address(tensor), None)
        # In a child forked after CUDA started, the registration is the parent's CUDA's, which
        # the child cannot reach: it is forgotten here, as the child's copy of the memory is.
        if entry is not None and torch.cuda.is_available() and not torch.cuda._is_in_bad_fork():
            torch.cuda.cudart().cudaHostUnregister(_address(tensor))
        return entry is not None

    def is_managed(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type != "cpu":
            return False
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        with self._lock:
            return any(base <= start and end <= limit for base, (limit, _buffer) in self._regions.items())

    def stats(self) -> dict:
        with self._lock:
            return {} if self._pool is None else self._pool.stats()


_PINNED = _PinnedTensors()


def allow_unlocked(allowed: bool = True) -> None:
    """Whether ``new_cpu_locked_tensor`` may hand out unlocked memory where RLIMIT_MEMLOCK
    refuses to lock (a user without CAP_IPC_LOCK): each time it does, a RuntimeWarning says so.
    Off by default (MemoryError instead); ``TENSORMEM_ALLOW_UNLOCKED=1`` in the environment turns
    it on at import. Applies to the tensors made after the call."""
    if not isinstance(allowed, bool):
        raise TypeError(f"allow_unlocked: expected True or False, not {allowed!r}")
    _PINNED.allow_unlocked = allowed


def new_cpu_locked_tensor(num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D page-locked CPU tensor of ``num_elem`` elements of ``example_tensor``'s dtype,
    4096-aligned (uninitialised, as DeepSpeed's is), registered with CUDA where CUDA is
    available. MemoryError when it cannot be locked; RuntimeError, before anything is taken,
    in a child forked from a process that had initialised CUDA (as torch's pin_memory)."""
    return _PINNED.alloc(num_elem, example_tensor.dtype)


def free_cpu_locked_tensor(tensor: torch.Tensor) -> bool:
    """Forgets a tensor from ``new_cpu_locked_tensor``; False when it is not one."""
    return _PINNED.free(tensor)


def is_pinned(tensor: torch.Tensor) -> bool:
    """True for a torch-pinned tensor or a view inside one of ``new_cpu_locked_tensor``'s."""
    try:
        if tensor.is_pinned():
            return True
    except RuntimeError:  # torch without CUDA may refuse to answer
        pass
    return _PINNED.is_managed(tensor)


# ----------------------------------------------------------------------------- the handle

def _positive(name: str, value) -> int:
    value = operator.index(value)  # 1.5 or "8" is a TypeError, as in DeepSpeed's own handle
    if value <= 0:
        raise ValueError(f"aio_handle: {name} must be positive, not {value}")
    return value


def _async_and_offset(method: str, args, kwargs) -> Tuple[bool, int]:
    """DeepSpeed names the fourth parameter of pread/pwrite ``async`` (a Python keyword):
    it comes positionally or as ``**{"async": ...}``."""
    if len(args) > 2:
        raise TypeError(f"{method}() takes at most 5 positional arguments")
    values = dict(zip(("async", "file_offset"), args))
    for key, value in kwargs.items():
        if key not in ("async", "async_op", "file_offset"):
            raise TypeError(f"{method}() got an unexpected keyword argument '{key}'")
        key = "async" if key == "async_op" else key
        if key in values:
            raise TypeError(f"{method}() got multiple values for argument '{key}'")
        values[key] = value
    if "async" not in values:
        raise TypeError(f"{method}() missing required argument: 'async'")
    return _flag(method, "async", values["async"]), operator.index(values.get("file_offset", 0))


def _flag(method: str, name: str, value) -> bool:
    """A bool argument as DeepSpeed's pybind11 binding converts it: True, False, None or an
    object with ``__bool__`` (1, 0.0, a one-element tensor); a string or a list is a
    TypeError there, and here, rather than a truth value."""
    if value is None or hasattr(type(value), "__bool__"):
        return bool(value)
    raise TypeError(f"{method}(): {name} must be a bool, not {type(value).__name__} {value!r:.40}")


class aio_handle:  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's ``aio_handle`` on tensormem's io_uring engine (see the module's notes).

    ``read``/``write`` are synchronous and separate from the queue; ``pread``/``pwrite``
    queue an operation and, unless asynchronous, wait for every queued one and return how
    many completed; ``async_*`` return 0 and ``wait()`` returns the count. Tensors stay
    referenced by the handle until the wait that completes them. Ctrl-C interrupts a wait
    (``KeyboardInterrupt``) without collecting anything: the operations go on and the next
    wait (of the queue, or of ``read``/``write`` for theirs) collects them."""

    def __init__(self, block_size: int = 1048576, queue_depth: int = 128, single_submit: bool = False,
                 overlap_events: bool = False, intra_op_parallelism: int = 1):
        self._block_size = _positive("block_size", block_size)
        self._queue_depth = _positive("queue_depth", queue_depth)
        self._intra_op_parallelism = _positive("intra_op_parallelism", intra_op_parallelism)
        self._single_submit = _flag("aio_handle", "single_submit", single_submit)
        self._overlap_events = _flag("aio_handle", "overlap_events", overlap_events)
        self._io = _tensormem.AsyncFileIO(block_bytes=self._block_size, queue_depth=self._queue_depth,
                                          rings=self._intra_op_parallelism)
        self._sync_io: Optional[_tensormem.AsyncFileIO] = None
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()  # read/write: one at a time, apart from the queue
        self._pid = os.getpid()
        self._keep: list = []        # tensors the queued operations use
        self._sync_keep: list = []   # read/write's: more than one only after an interrupted wait

    # DeepSpeed's getters
    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._intra_op_parallelism

    def get_alignment(self) -> int:
        return 4096

    # operations
    @staticmethod
    def _staged(tensor: torch.Tensor, read: bool):
        """(the tensor the bytes move through, the tensor to copy it back into or None)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"aio_handle: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.layout != torch.strided:
            raise ValueError(f"aio_handle: tensors must be dense (strided), not {tensor.layout}")
        if tensor.device.type == "meta":  # a read would complete and its bytes go nowhere
            raise ValueError("aio_handle: a tensor on meta has no memory to read into or write from")
        if read and torch._debug_has_internal_overlap(tensor) == 1:  # copy_ would refuse it after the read
            raise ValueError("aio_handle: elements of the tensor to read into share memory (an expanded "
                             "view); read into a tensor of its own")
        # A conjugate or negative view's memory holds its values unconjugated or negated: it
        # is staged like a tensor off the CPU (the copy and copy_ apply the view).
        if tensor.device.type == "cpu" and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg():
            return tensor, None
        if read:
            return torch.empty(tensor.shape, dtype=tensor.dtype), tensor
        return tensor.detach().to("cpu", copy=True).contiguous(), None

    def _queue(self, io, read: bool, tensor: torch.Tensor, filename, validate: bool, file_offset: int):
        validate = _flag("aio_handle", "validate", validate)
        staged, destination = self._staged(tensor, read)
        nbytes = staged.numel() * staged.element_size()
        path = os.fspath(filename)
        # The storage is held with the tensor from before the I/O starts: a tensor given other
        # memory before the wait (`t.set_(...)`, `p.data = ...`) would otherwise free the memory
        # the I/O uses; and its size, so that a resize_ that would free it raises instead.
        held = _storage_hold.hold(_storage_hold.storage_of(staged))
        if read:
            # A read into the tensor itself changes its values in place: counted in its version
            # once queued, as an in-place operation's (a staged read's copy_ counts its own).
            marker = _storage_hold.write_marker(staged) if destination is None else None
            ticket = io.read(staged.data_ptr(), nbytes, path, operator.index(file_offset), validate)
            if marker is not None:
                marker()
        else:
            ticket = io.write(staged.data_ptr(), nbytes, path, operator.index(file_offset), validate)
        return ticket, staged, destination, held

    @staticmethod
    def _finish(io, keep: list) -> int:
        """Waits for every operation queued on ``io`` (``keep`` holds their tensors), then
        empties ``keep`` and copies each staged read that succeeded back into its tensor. A
        failed read's tensor is left as it was: its staging copy holds no file data. Ctrl-C
        (KeyboardInterrupt) ends the wait and collects nothing: the operations go on, their
        tensors held in ``keep``, and the next wait collects them."""
        completed, errors = io.wait()
        queued = keep[:]
        keep.clear()
        failed = {ticket for _, _, _, ticket in errors}
        copy_failure = None
        for ticket, staged, destination, _ in queued:
            if destination is not None and ticket not in failed:
                try:  # a tensor resized since its read was queued: the others still get their bytes
                    with torch.no_grad():  # (into a parameter too, as a read into one's own memory)
                        destination.copy_(staged)
                except Exception as e:  # noqa: BLE001 - raised below, after every copy
                    copy_failure = copy_failure or e
        if errors:
            raise AIOError([(path, err, message) for path, err, message, _ in errors], completed)
        if copy_failure is not None:
            raise copy_failure
        return completed

    def _refuse_a_forked_child(self) -> None:
        """In a child forked after the handle was made, raises tensormem.ForkedChildError
        before taking a lock: a thread of the parent may have held it at the fork (a wait in
        progress), and the child's copy would stay taken."""
        if os.getpid() != self._pid:
            self._io.pending()  # raises ForkedChildError, naming both processes

    def _sync(self, read: bool, buffer, filename, validate, file_offset) -> int:
        self._refuse_a_forked_child()
        with self._sync_lock:
            if self._sync_io is None:
                self._sync_io = _tensormem.AsyncFileIO(block_bytes=self._block_size, queue_depth=self._queue_depth)
            self._sync_keep.append(self._queue(self._sync_io, read, buffer, filename, validate, file_offset))
            self._finish(self._sync_io, self._sync_keep)
        return 0

    def read(self, buffer: torch.Tensor, filename: str, validate: bool, file_offset: int = 0) -> int:
        """Synchronous read of ``buffer``'s bytes at ``file_offset``; 0 (as DeepSpeed)."""
        return self._sync(True, buffer, filename, validate, file_offset)

    def write(self, buffer: torch.Tensor, filename: str, validate: bool, file_offset: int = 0) -> int:
        """Synchronous write of ``buffer``'s bytes at ``file_offset``; 0 (as DeepSpeed)."""
        return self._sync(False, buffer, filename, validate, file_offset)

    def _parallel(self, read: bool, buffer, filename, validate, is_async: bool, file_offset: int) -> int:
        self._refuse_a_forked_child()
        with self._lock:
            self._keep.append(self._queue(self._io, read, buffer, filename, validate, file_offset))
        return 0 if is_async else self.wait()

    def pread(self, buffer: torch.Tensor, filename: str, validate: bool, *args, **kwargs) -> int:
        """``pread(buffer, filename, validate, async, file_offset=0)``."""
        is_async, file_offset = _async_and_offset("pread", args, kwargs)
        return self._parallel(True, buffer, filename, validate, is_async, file_offset)

    def pwrite(self, buffer: torch.Tensor, filename: str, validate: bool, *args, **kwargs) -> int:
        """``pwrite(buffer, filename, validate, async, file_offset=0)``."""
        is_async, file_offset = _async_and_offset("pwrite", args, kwargs)
        return self._parallel(False, buffer, filename, validate, is_async, file_offset)

    def sync_pread(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self._parallel(True, buffer, filename, False, False, file_offset)

    def sync_pwrite(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self._parallel(False, buffer, filename, False, False, file_offset)

    def async_pread(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self._parallel(True, buffer, filename, False, True, file_offset)

    def async_pwrite(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self._parallel(False, buffer, filename, False, True, file_offset)

    def wait(self) -> int:
        """Waits for every queued operation; returns how many completed. Raises AIOError
        (after all have completed) when any failed."""
        self._refuse_a_forked_child()
        with self._lock:
            return self._finish(self._io, self._keep)

    # pinned tensors
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        return new_cpu_locked_tensor(num_elem, example_tensor)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        return free_cpu_locked_tensor(tensor)

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        return is_pinned(buffer)

    # tensormem extras
    def stats(self) -> dict:
        """Counts of the queued path: operations, bytes, O_DIRECT and buffered, the engine."""
        return self._io.stats()


def aio_read(buffer: torch.Tensor, filename: str, block_size: int, queue_depth: int, single_submit: bool,
             overlap_events: bool, validate: bool) -> int:
    """One synchronous read of the whole buffer from the start of the file; 0."""
    return aio_handle(block_size, queue_depth, single_submit, overlap_events).read(buffer, filename, validate)


def aio_write(buffer: torch.Tensor, filename: str, block_size: int, queue_depth: int, single_submit: bool,
              overlap_events: bool, validate: bool) -> int:
    """One synchronous write of the whole buffer at the start of the file; 0."""
    return aio_handle(block_size, queue_depth, single_submit, overlap_events).write(buffer, filename, validate)


def deepspeed_memcpy(dest: torch.Tensor, src: torch.Tensor) -> int:
    """dest <- src (same number of bytes); 0. A copy of the bytes, as DeepSpeed's: into a
    tensor that requires grad too (a parameter), counted in dest's version as copy_ counts it."""
    if dest.numel() * dest.element_size() != src.numel() * src.element_size():
        raise ValueError(f"deepspeed_memcpy: {dest.numel() * dest.element_size()} bytes in dest, "
                         f"{src.numel() * src.element_size()} in src")
    with torch.no_grad():
        dest.copy_(src.reshape(dest.shape) if dest.dtype == src.dtype else src.view(dest.dtype).reshape(dest.shape))
    return 0


_OPS = types.SimpleNamespace(aio_handle=aio_handle, aio_read=aio_read, aio_write=aio_write,
                             deepspeed_memcpy=deepspeed_memcpy)


class AsyncIOBuilder:
    """DeepSpeed's op builder for the aio op: ``load()`` returns tensormem's, nothing is built."""

    BUILD_VAR = "DS_BUILD_AIO"
    NAME = "async_io"

    def __init__(self, name: Optional[str] = None):
        self.name = name or self.NAME

    def absolute_name(self) -> str:
        return "tensormem.deepspeed"

    def is_compatible(self, verbose: bool = False) -> bool:
        return True  # io_uring, or the thread engine where io_uring is unavailable

    def load(self, verbose: bool = True):
        return _OPS


def patch() -> bool:
    """Makes DeepSpeed's ``AsyncIOBuilder`` (every reference to the class, including those
    imported before this call) load tensormem's aio op. False when DeepSpeed is not
    importable, True once patched."""
    try:
        import deepspeed.ops.op_builder as op_builder  # noqa: F401
    except ImportError:
        return False
    classes = {op_builder.AsyncIOBuilder}
    try:
        from deepspeed.ops.op_builder import async_io  # the defining module, where present
        classes.add(async_io.AsyncIOBuilder)
    except ImportError:
        pass
    for cls in classes:
        cls.load = AsyncIOBuilder.load
        cls.is_compatible = AsyncIOBuilder.is_compatible
    return True


# ----------------------------------------------------------------------------- the swapper

ASYNC_SWAPPER_WAIT_TIMER = "async_swap_gradient_wait"


class SwapperAssertion(AssertionError, ValueError):
    """Misuse DeepSpeed's AsyncTensorSwapper would assert on, with a clearer message."""


class _Staging:
    """One of the caller's pinned buffers, filled with aligned tensors before being written."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        self.used = 0
        self.entries: list = []  # (view written, path, elements of the tensor)

    def reset(self) -> None:
        self.used = 0
        self.entries = []


class AsyncTensorSwapper:
    """DeepSpeed's ``AsyncTensorSwapper(aio_handle, numel_alignment, timers)``: gradients out
    to raw files through the caller's pinned buffers.

    ``swap_out_tensors`` copies each tensor into the current buffer (padded with zeros to a
    multiple of ``numel_alignment`` elements, so no stale bytes reach the files) and returns:
    the caller may reuse its tensors at once. A full buffer is written with ``async_pwrite``
    and filling goes on in the next free one; only when no buffer is free does the call wait
    for the writes in flight. ``release_buffers`` writes what is left, waits, and returns the
    caller's buffer objects. Each file holds the tensor's elements and the padding, what
    DeepSpeed's swap-in reads. Works on this module's ``aio_handle`` or DeepSpeed's.

    A write refused when it is queued (a missing folder, a bad path) does not stop the other
    tensors of its buffer: all are queued, and ``AIOError`` names every refused path (raised
    by the call that queued the buffer, or by ``release_buffers`` after every write ended).

    tensormem's own ``tensormem.torch.AsyncTensorSwapper`` (on ``TensorSwapper``) is the
    recommended path where DeepSpeed compatibility is not needed: it checksums every block
    (CRC-32C, checked on swap-in), replaces files atomically, and swaps in as well as out.
    """

    def __init__(self, aio_handle, numel_alignment: int, timers=None):
        numel_alignment = operator.index(numel_alignment)  # 1.5 is a TypeError, not 1
        if numel_alignment <= 0:
            raise SwapperAssertion(f"AsyncTensorSwapper: numel_alignment must be positive, not {numel_alignment}")
        self.aio_handle = aio_handle
        self.numel_alignment = numel_alignment
        self.timers = timers
        self.dtype: Optional[torch.dtype] = None
        self.max_numel = 0
        self.num_elements_swapped = 0
        self._buffers: List[torch.Tensor] = []
        self._staging: List[_Staging] = []
        self._free: List[int] = []
        self._filling: Optional[int] = None
        self._in_flight: List[int] = []
        self._pending_ops = 0
        self._timer_names: set = set()

    def has_buffers(self) -> bool:
        return len(self._buffers) > 0

    def add_buffers(self, buffer_list: Sequence[torch.Tensor]) -> None:
        if self._buffers:
            raise SwapperAssertion("add_buffers: the swapper has buffers already; release_buffers first")
        buffers = list(buffer_list)
        if not buffers:
            raise SwapperAssertion("add_buffers: no buffers given")
        pinned = getattr(self.aio_handle, "is_pinned", is_pinned)
        for i, b in enumerate(buffers):
            if b.dim() != 1 or not b.is_contiguous():
                raise SwapperAssertion(f"add_buffers: buffer {i} is not a contiguous 1-D tensor")
            if not pinned(b):
                raise SwapperAssertion(f"add_buffers: buffer {i} is not page-locked "
                                       "(use aio_handle.new_cpu_locked_tensor)")
            if b.dtype != buffers[0].dtype:
                raise SwapperAssertion(f"add_buffers: buffer {i} is {b.dtype}, buffer 0 {buffers[0].dtype}")
        self.dtype = buffers[0].dtype
        self._buffers = buffers
        self._staging = [_Staging(b) for b in buffers]
        self._free = list(range(len(buffers)))
        self.max_numel = max(b.numel() for b in buffers)
        self._timer_names = set()

    def get_timer_names(self) -> List[str]:
        return list(self._timer_names)

    def release_buffers(self) -> List[torch.Tensor]:
        """Writes what is buffered, waits for every write, returns the buffers given."""
        try:
            self._flush()
        finally:
            buffers = self._buffers
            self._buffers, self._staging, self._free, self._in_flight = [], [], [], []
            self._filling, self._pending_ops, self.dtype = None, 0, None
            self.num_elements_swapped = 0
        return buffers

    def swap_out_tensors(self, tensor_list: Sequence[torch.Tensor], path_list: Sequence[str]) -> None:
        tensors, paths = list(tensor_list), list(path_list)
        if len(tensors) != len(paths):
            raise SwapperAssertion(f"swap_out_tensors: {len(tensors)} tensors but {len(paths)} paths")
        for tensor, path in zip(tensors, paths):
            self._swap_out(tensor, path)

    # ------------------------------------------------------------------------------------

    def _aligned(self, numel: int) -> int:
        return -(-numel // self.numel_alignment) * self.numel_alignment

    def _swap_out(self, tensor: torch.Tensor, path: str) -> None:
        if not self._buffers:
            raise SwapperAssertion("swap_out_tensors: no buffers; add_buffers first")
        numel = tensor.numel()
        aligned = self._aligned(numel)
        if aligned > self.max_numel:
            raise SwapperAssertion(f"swap_out_tensors: a tensor of {numel} elements ({aligned} aligned) "
                                   f"does not fit in a buffer of {self.max_numel}")
        if self._filling is not None:
            current = self._staging[self._filling]
            if current.used + aligned > current.buffer.numel():
                refused = self._queue_filling()
                if refused:  # the other tensors of that buffer are being written
                    raise AIOError(refused, 0)
        if self._filling is None:
            if not self._free:
                self._wait_in_flight()  # back-pressure: every buffer is being written
            self._filling = self._free.pop()
        staging = self._staging[self._filling]
        if staging.used + aligned > staging.buffer.numel():  # buffers of different sizes
            raise SwapperAssertion(f"swap_out_tensors: {aligned} elements do not fit in an empty buffer of "
                                   f"{staging.buffer.numel()}")
        view = staging.buffer.narrow(0, staging.used, aligned)
        view.narrow(0, 0, numel).copy_(tensor.detach().reshape(-1))
        if aligned > numel:
            view.narrow(0, numel, aligned - numel).zero_()
        staging.entries.append((view, os.fspath(path), numel))
        staging.used += aligned

    def _queue_filling(self) -> List[Tuple[str, int, str]]:
        """Queues a write per tensor of the filled buffer. A write refused at queuing (a
        missing folder, a bad path) does not stop the others: every tensor is tried, and the
        refused ones are returned as (path, errno, message) for the caller to raise."""
        index, self._filling = self._filling, None
        self._in_flight.append(index)
        staging = self._staging[index]
        queued, refused = [], []
        for entry in staging.entries:
            view, path, _numel = entry
            try:
                if self.aio_handle.async_pwrite(view, path) != 0:
                    raise OSError(errno.EIO, "async_pwrite refused the write", path)
            except (OSError, ValueError) as e:
                why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
                refused.append((path, getattr(e, "errno", None) or errno.EINVAL, why))
                continue
            queued.append(entry)
            self._pending_ops += 1
        staging.entries = queued  # counted as swapped once written
        return refused

    def _wait_in_flight(self) -> None:
        if self.timers:
            self.timers(ASYNC_SWAPPER_WAIT_TIMER).start()
        ended = False  # every write in flight ended, whether or not it failed
        try:
            try:
                completed = self.aio_handle.wait()
            except AIOError:
                ended = True
                raise
            ended = True
            if completed != self._pending_ops:
                raise SwapperAssertion(f"wait completed {completed} writes, {self._pending_ops} were queued")
        finally:
            if self.timers:
                self.timers(ASYNC_SWAPPER_WAIT_TIMER).stop()
            self._timer_names.add(ASYNC_SWAPPER_WAIT_TIMER)
            # The buffers are free again once their writes ended, failed or not. A wait that
            # ended otherwise (Ctrl-C) leaves them in flight: the next wait collects them.
            if ended:
                for index in self._in_flight:
                    self.num_elements_swapped += sum(n for _v, _p, n in self._staging[index].entries)
                    self._staging[index].reset()
                    self._free.append(index)
                self._in_flight, self._pending_ops = [], 0

    def _flush(self) -> None:
        """Queues the filling buffer and waits for every write, even when some were refused
        (the buffers are never handed back while a write from them is in flight); then raises
        AIOError naming every tensor that was not written."""
        refused = self._queue_filling() if self._filling is not None else []
        failed: List[Tuple[str, int, str]] = []
        completed = 0
        if self._in_flight:
            try:
                self._wait_in_flight()
            except AIOError as e:
                failed, completed = e.errors, e.completed
        if refused or failed:
            raise AIOError(refused + failed, completed)
