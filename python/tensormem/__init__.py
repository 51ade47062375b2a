"""tensormem: tensor memory planning, arenas, pinned memory and swapping.

The compiled core lives in ``tensormem._tensormem``; ``tensormem.torch`` adds the PyTorch
front ends (a DeepSpeed-compatible ContiguousMemoryAllocator and AsyncTensorSwapper).
Errors map to Python exceptions: MemoryError (out of memory, lock limit), ValueError (misuse,
malformed traces), OSError (system errors, with errno), ForkedChildError (a RuntimeError: an
object that runs threads of its own, used in a child process forked after it was made).
"""

from ._tensormem import (  # noqa: F401
    GROWING,
    MAX_QUEUE_DEPTH,
    SWAP_BLOCK_ALIGNMENT,
    IO_ENGINES,
    Allocation,
    BestFitAllocator,
    ContiguousArena,
    ForkedChildError,
    MemoryView,
    OperatorGraph,
    PinnedBuffer,
    PinnedPool,
    TensorSwapper,
    TlsfAllocator,
    __version__,
    cgroup_memory_available_bytes,
    cgroup_memory_limit_bytes,
    cuda_built,
    cuda_unavailable_reason,
    derive_lifetimes,
    lower_bound,
    make_transformer_step,
    physical_memory_bytes,
    plan,
    read_trace,
    validate,
    write_plan_picture,
)

__all__ = [
    "GROWING", "MAX_QUEUE_DEPTH", "SWAP_BLOCK_ALIGNMENT", "IO_ENGINES", "Allocation", "BestFitAllocator",
    "ContiguousArena", "ForkedChildError", "MemoryView", "OperatorGraph",
    "derive_lifetimes", "make_transformer_step", "PinnedBuffer", "PinnedPool", "TensorSwapper", "TlsfAllocator",
    "__version__", "cgroup_memory_available_bytes", "cgroup_memory_limit_bytes", "cuda_built", "cuda_unavailable_reason", "lower_bound", "physical_memory_bytes", "plan",
    "read_trace", "validate", "write_plan_picture",
]
