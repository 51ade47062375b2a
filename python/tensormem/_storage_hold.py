"""Holds a torch storage's size while a transfer uses its memory.

``t.resize_(n)`` to more bytes than ``t``'s storage has frees the storage's memory and takes
new memory. A swap-out or swap-in of ``t`` in flight would then read or write freed memory
(a crash, or bytes in another tensor). While a hold lives, such a resize raises
RuntimeError instead ("Trying to resize storage that is not resizable"). The hold sets
c10's StorageImpl resizable flag through tensormem's PyTorch extension, built against the
c10 of the PyTorch its interpreter imports; where that extension is missing or was built for
another PyTorch release, nothing is held and ``problem()`` says why."""

from __future__ import annotations

import warnings
from typing import Optional

_factory = None
_problem: Optional[str] = None
_warned = ""  # the reason last warned of

# An extension that is there but could not be loaded for want of memory (the loader's words
# for an mmap that failed): loading it is tried again at the next transfer, so that the holds
# come back with the memory instead of staying off for the rest of the process.
_OUT_OF_MEMORY = ("failed to map segment", "cannot allocate memory", "Cannot allocate memory")


def problem() -> str:
    """Empty when resizes are held off during transfers, else why not."""
    return _resolve()


def _resolve() -> str:
    global _factory, _problem
    if _problem is not None:
        return _problem
    from .model import torch_extension
    extension, why = torch_extension()
    if extension is None:
        problem = f"{why}: a tensor resized in place while a transfer uses it is not refused"
        if any(words in why for words in _OUT_OF_MEMORY):
            return problem  # (not kept: tried again)
        _problem = problem
        return problem
    _factory = extension.StorageSizeHold
    _problem = ""
    return _problem


def storage_of(tensor):
    """The tensor's storage (PyTorch 2.x deprecates the typed storage() that 1.x alone has)."""
    return tensor.untyped_storage() if hasattr(tensor, "untyped_storage") else tensor.storage()


def hold(storage):
    """What keeps ``storage`` alive until it is dropped, and holds its size meanwhile: a
    StorageSizeHold, or the storage itself where none can be taken (said as a RuntimeWarning,
    once per reason)."""
    global _warned
    why = _resolve()
    if _factory is None:
        if _warned != why:
            _warned = why
            warnings.warn(why, RuntimeWarning, stacklevel=3)
        return storage
    return _factory(storage)


def write_marker(tensor):
    """What counts one in-place change of ``tensor``'s values, as PyTorch's in-place operations
    count theirs: a call that adds one to its version counter (``tensor._version``, shared with
    its views and ``detach()``), after which autograd refuses a backward that would read the
    values it saved before ("one of the variables needed for gradient computation has been
    modified by an inplace operation") instead of computing with the new ones. Made before
    the change (a zero-element view copied onto itself: no memory is read or written), so
    that counting it after cannot fail for the tensor's sake; None for an inference tensor,
    which keeps no counter."""
    if tensor.is_inference():
        return None
    view = tensor.detach().as_strided((0,), (1,))
    return lambda: view.copy_(view)


def mark_written(tensor) -> None:
    """Counts one in-place change of ``tensor``'s values now (``write_marker``, made and taken
    at once: for a write that has already happened and cannot be undone)."""
    mark = write_marker(tensor)
    if mark is not None:
        mark()
