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
_warned = False


def problem() -> str:
    """Empty when resizes are held off during transfers, else why not."""
    _resolve()
    return _problem or ""


def _resolve() -> None:
    global _factory, _problem
    if _problem is not None:
        return
    from .model import torch_extension
    extension, why = torch_extension()
    if extension is None:
        _problem = f"{why}: a tensor resized in place while a transfer uses it is not refused"
        return
    _factory = extension.StorageSizeHold
    _problem = ""


def hold(storage):
    """What keeps ``storage`` alive until it is dropped, and holds its size meanwhile: a
    StorageSizeHold, or the storage itself where none can be taken (said once as a
    RuntimeWarning)."""
    global _warned
    _resolve()
    if _factory is None:
        if not _warned:
            _warned = True
            warnings.warn(_problem, RuntimeWarning, stacklevel=3)
        return storage
    return _factory(storage)
