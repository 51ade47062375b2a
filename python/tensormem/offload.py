"""Optimizers whose state lives on disk: ``OffloadedAdamW``, ``OffloadedAdam``, ``OffloadedSGD``.

The moments (and, with ``offload_master=True``, an fp32 master copy of the parameters) live in
a swap space striped over ``swap_dirs`` (one folder per device, files under ``rank<r>/``). A
step streams sub-groups of about ``group_bytes`` parameter bytes through a prefetch pipeline
that never holds more than ``pinned_budget`` bytes of page-locked staging memory: group k+1 is
read while group k is updated by a vectorized C++ kernel and group k-1 is written back. The
update performs the same fp32 operations in the same order as ``torch.optim``'s single-tensor
(``foreach=False``) loops, fused multiply-adds where PyTorch's CPU kernels fuse them. Adam's
first moment is rounded as the installed PyTorch rounds it (``arithmetic="auto"``): 2.x averages
by ``lerp_``, 1.x by ``mul_`` then ``add_``; ``arithmetic="torch1"`` or ``"torch2"`` picks one.

Steps are atomic on disk: new state goes to a second generation of the files, committed only
when every group is written. A failed step (a full folder, an I/O error) raises
``OffloadError`` (an OSError with ``errno``, ``filename`` and ``tensor``) and leaves the
previous state committed; with ``offload_master=True`` (the default) the parameters are put
back to their values before the step, so the step can be retried. Should putting them back fail
too (memory running out again), the error's ``not_undone`` lists the parameters that may hold
the failed step's values (it is None otherwise), and ``restore_parameters()`` puts them back.
Ctrl-C during a step raises ``KeyboardInterrupt`` once the step is undone the same way (undoing
rereads the master copies of the sub-groups already updated: about as long as the step had run;
if the undoing fails, the error with ``not_undone`` is raised instead); without
the master copy only a step that has changed no parameter yet can be undone, so a later one runs
to its end first (the core's ``steps`` counts say which happened).

Where no thread can be started (a limit on threads), a step runs on the calling thread and
collects its own write-backs; ``last_stats["fallback"]`` says so (empty otherwise). The staging
buffers are page-locked; a user without CAP_IPC_LOCK may lock only RLIMIT_MEMLOCK bytes (often
8 MiB), less than two records of the default sub-groups: ``allow_unlocked=True`` then uses
unlocked memory for what the limit refuses (O_DIRECT needs no locked memory), reported in
``last_stats`` (``unlocked_slabs`` and ``fallback``); without it the optimizer's MemoryError
names ``group_bytes``.

``ZeroOffloadedOptimizer`` wraps one of them for ``torch.distributed``: each rank owns whole
parameters, gradients are reduced to their owner, the owner updates from its own swap folder
and broadcasts the new values (ZeRO stage 2 at parameter granularity).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import math
import numbers
import operator
import os
import sys
import time
import zlib
from typing import Dict, Iterable, List, Optional, Sequence, Union

import torch

from . import _storage_hold, _tensormem

OffloadError = _tensormem.OffloadError
simd_level = _tensormem.simd_level

_names = itertools.count()


def _default_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def torch_arithmetic(version: Optional[str] = None) -> str:
    """Whose rounding Adam and AdamW reproduce: "torch2" for PyTorch 2.x and later (the first
    moment by ``lerp_``), "torch1" before (``mul_`` then ``add_``). ``version``: PyTorch's,
    the installed one by default."""
    version = version or torch.__version__
    major = version.split(".")[0]
    if not major.isdigit():
        raise ValueError(f"cannot read PyTorch's major version from {version!r}")
    return "torch2" if int(major) >= 2 else "torch1"


# What a step reads of a parameter group: the values it steps with, and the flags it refuses
# (compared across ranks by ZeroOffloadedOptimizer, all of them).
_STEPPED_KEYS = ("lr", "weight_decay", "betas", "eps", "momentum", "dampening", "nesterov")
_REFUSED_FLAGS = ("amsgrad", "maximize")
_STEP_HYPERPARAMETERS = _STEPPED_KEYS + _REFUSED_FLAGS


@contextlib.contextmanager
def _counted_as_written(params: List[torch.Tensor]):
    """Counts a write of each parameter's values in its version, as torch.optim's in-place
    updates do, once the block ends, raising or not (a failed step's parameters may have been
    written and put back): autograd then refuses a backward through values saved before the
    step ("modified by an inplace operation") instead of computing with the new ones. The
    counts are made ready before the block, so that taking them cannot fail after it."""
    markers = [m for m in map(_storage_hold.write_marker, params) if m is not None]
    try:
        yield
    finally:
        for mark in markers:
            mark()


class _OffloadedOptimizer(torch.optim.Optimizer):
    _kind = "adamw"

    def __init__(self, params, defaults, *, swap_dirs: Sequence[Union[str, bytes, "os.PathLike"]], pinned_budget: int = 256 << 20,
                 group_bytes: int = 32 << 20, offload_master: bool = True, rank: Optional[int] = None,
                 stripe_bytes: int = 8 << 20, capacity_bytes: Optional[Sequence[int]] = None,
                 engine: str = "uring", rings: int = 1, simd: str = "auto", progress: bool = False,
                 arithmetic: str = "auto", allow_unlocked: bool = False):
        if isinstance(swap_dirs, (str, bytes, os.PathLike)):
            swap_dirs = [swap_dirs]
        if not swap_dirs:
            raise ValueError("swap_dirs: give at least one folder")
        super().__init__(params, defaults)
        self._params: List[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        if len({id(p) for p in self._params}) != len(self._params):
            raise ValueError("a parameter appears more than once")
        for i, p in enumerate(self._params):
            if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
                raise ValueError(f"parameter {i} must be a contiguous float32 CPU tensor, not "
                                 f"{p.dtype} on {p.device}{'' if p.is_contiguous() else ' (non-contiguous)'}")
        self._numels = [p.numel() for p in self._params]
        self.rank = _default_rank() if rank is None else operator.index(rank)
        self.progress = progress
        self.arithmetic = torch_arithmetic() if arithmetic == "auto" else arithmetic
        self._core = _tensormem.OffloadedOptimizer(
            [p.numel() for p in self._params], kind=self._kind, offload_master=offload_master,
            group_bytes=operator.index(group_bytes), pinned_budget=operator.index(pinned_budget),
            swap_dirs=[os.fsdecode(d) for d in swap_dirs], rank=self.rank, stripe_bytes=operator.index(stripe_bytes),
            capacity_bytes=list(capacity_bytes or []), engine=engine, rings=rings,
            name=f"{self._kind}-{os.getpid()}-{next(_names)}", simd=simd, arithmetic=self.arithmetic,
            allow_unlocked=allow_unlocked)
        with torch.no_grad():
            self._core.initialize([p.data_ptr() for p in self._params])
        self.last_stats: Dict[str, float] = {}
        self.totals = {"steps": 0, "seconds": 0.0, "io_wait_seconds": 0.0, "bytes_read": 0, "bytes_written": 0}

    def _check_params(self) -> List[torch.Tensor]:
        """The core reads and writes numel x 4 bytes at each parameter's address: the
        parameters must still be the tensors, sizes and layout it was made for (``p.data = ...``
        can give a parameter other memory of any size, dtype or layout). Returns a view of each
        parameter's memory (``p.data``, half the cost of ``p.detach()``), the memory checked:
        a step hands the core these views' addresses and holds them until the core returns, so
        that another thread giving a parameter other memory (``p.data = ...``), before the
        check's end or while the core runs without the GIL, changes neither what was checked
        nor what the core writes."""
        current = [p for g in self.param_groups for p in g["params"]]
        if len(current) != len(self._params) or any(a is not b for a, b in zip(current, self._params)):
            raise ValueError("param_groups no longer hold the parameters this optimizer was made for (one was "
                             "added, removed or replaced); make a new optimizer")
        views = [p.data for p in self._params]
        f32 = torch.float32  # dtypes are singletons; is_cpu and `is` keep this loop at about 0.2 us a parameter
        for i, (p, n) in enumerate(zip(views, self._numels)):
            if not p.is_cpu or p.dtype is not f32 or not p.is_contiguous() or p.numel() != n:
                raise ValueError(f"parameter {i} is now {p.numel()} elements of {p.dtype} on {p.device}"
                                 f"{'' if p.is_contiguous() else ' (non-contiguous)'}; this optimizer was made for "
                                 f"{n} contiguous float32 elements on the CPU: make a new optimizer")
        return views

    # -- torch.optim.Optimizer ---------------------------------------------------------------
    def _hyper(self, group) -> dict:
        for flag in _REFUSED_FLAGS:  # set in a group (or a state dict's) after construction
            if group.get(flag):
                raise ValueError(f"param_groups: {flag}={group[flag]!r} is not supported by the offloaded optimizers")
        return {k: group[k] for k in _STEPPED_KEYS if k in group}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        held = self._check_params()
        grads, keep, hyper = [], [], []
        for group in self.param_groups:
            h = self._hyper(group)
            for p in group["params"]:
                hyper.append(h)
                if p.grad is None:
                    grads.append(0)
                    continue
                if p.grad.is_sparse:
                    raise ValueError("sparse gradients are not supported")
                n = self._numels[len(grads)]  # as checked, whatever p.data is now
                if p.grad.numel() != n:
                    raise ValueError(f"parameter {len(grads)}: its gradient holds {p.grad.numel()} elements, "
                                     f"the parameter {n}")
                g = p.grad if p.grad.is_contiguous() and p.grad.dtype == torch.float32 else \
                    p.grad.to(torch.float32).contiguous()
                keep.append(g)
                grads.append(g.data_ptr())
        with _counted_as_written([p for p, g in zip(self._params, grads) if g]):  # (those without grad not stepped)
            stats = self._core.step([p.data_ptr() for p in held], grads, hyper)
        self.last_stats = stats
        self.totals["steps"] += 1
        for k in ("seconds", "io_wait_seconds", "bytes_read", "bytes_written"):
            self.totals[k] += stats[k]
        if self.progress:
            print(self.progress_line(), file=sys.stderr, flush=True)
        return loss

    @torch.no_grad()
    def restore_parameters(self) -> None:
        """Copies the committed master copy into the parameters: their values after the last
        step that succeeded (or as initialized or loaded). The way back after an
        ``OffloadError`` whose ``not_undone`` lists parameters: a failed step whose undoing
        failed too. Needs ``offload_master=True``; a failure may be retried."""
        held = self._check_params()
        with _counted_as_written(self._params):
            self._core.restore_parameters([p.data_ptr() for p in held])

    def progress_line(self) -> str:
        s = self.last_stats
        gbps = (s["bytes_read"] + s["bytes_written"]) / max(s["seconds"], 1e-9) / 1e9
        return (f"[rank {self.rank}] step {self.totals['steps']}: {s['seconds']:.3f} s, "
                f"read {s['bytes_read'] / 2**20:.1f} MiB, wrote {s['bytes_written'] / 2**20:.1f} MiB "
                f"({gbps:.2f} GB/s), waited on I/O {s['io_wait_seconds']:.3f} s, overlap {s['overlap_ratio']:.2f}, "
                f"pinned {s['pinned_bytes'] / 2**20:.0f} MiB (peak {s['pinned_high_water'] / 2**20:.0f} MiB)")

    def io_stats(self) -> dict:
        """The swap space and the pinned pool: bytes per folder, engine and fallbacks, pinned bytes."""
        return dict(self._core.stats())

    @property
    def simd(self) -> str:
        return self._core.simd

    def swap_files(self) -> List[str]:
        return list(self._core.paths())

    # -- state, streamed ---------------------------------------------------------------------
    def _state_fields(self) -> List[str]:
        return [f for f in self._core.fields if f != "master"]

    def state_dict(self) -> dict:
        """torch.optim's format (per-parameter tensors, so the whole state is in memory): use
        ``save_checkpoint`` for large models."""
        self._check_params()
        fields = list(self._core.fields)
        steps = self._core.steps
        state = {i: {"step": torch.tensor(float(steps[i]))} for i in range(len(self._params)) if steps[i] > 0}
        for i in state:
            for f in self._state_fields():
                state[i][f] = torch.empty_like(self._params[i], memory_format=torch.contiguous_format)
        groups = {g[0]: g[3] for g in self._core.groups}

        def take(index, record):
            for (param, poff, count, goff) in groups[index]:
                if param not in state:
                    continue
                for f in self._state_fields():
                    state[param][f].view(-1)[poff:poff + count].numpy()[:] = record[fields.index(f), goff:goff + count]

        self._core.visit(take, copy=False)  # take copies what it needs
        if self._kind == "sgd":  # torch keeps no buffer without momentum
            momentum = [g.get("momentum", 0) for g in self.param_groups for _ in g["params"]]
            for i in state:
                if momentum[i] == 0:
                    state[i]["momentum_buffer"] = None
        param_groups = []
        index = 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            param_groups.append(packed)
        return {"state": state, "param_groups": param_groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads torch.optim's format. Everything is checked before anything changes: a state
        of another size, a state for a parameter this optimizer does not have, an entry without
        one of the optimizer's fields (``None`` is taken as zeros, as torch's SGD writes it) or
        a step that is not a whole number >= 0 is a ``ValueError``, and the state and
        ``param_groups`` stay as they were; so they do when writing the state fails."""
        self._check_params()
        groups_in = state_dict["param_groups"]
        if len(groups_in) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(groups_in, self.param_groups)):
            raise ValueError("loaded state dict has a different number of parameter groups or parameters")
        state = state_dict["state"]
        steps = [0] * len(self._params)
        for i, s in state.items():
            if not isinstance(i, numbers.Integral) or not 0 <= i < len(self._params):
                raise ValueError(f"state for parameter {i!r}, but this optimizer has {len(self._params)} "
                                 f"parameters (0 to {len(self._params) - 1})")
            # torch's SGD keeps no step: a momentum buffer means the first step is behind it.
            if self._kind == "sgd" and "step" not in s:
                s = dict(s, step=0 if s.get("momentum_buffer") is None else 1)
            for f in ["step"] + self._state_fields():
                if f not in s:
                    raise ValueError(f"state of parameter {i} has no {f!r}")
            for f in self._state_fields():
                t = s[f]
                if t is not None and t.numel() != self._params[i].numel():
                    raise ValueError(f"state {f} of parameter {i} has {t.numel()} elements, "
                                     f"expected {self._params[i].numel()}")
            step = float(s["step"])
            if not (math.isfinite(step) and 0 <= step < 2**64 and step == int(step)):
                raise ValueError(f"state of parameter {i}: step must be a whole number >= 0, not {step}")
            steps[int(i)] = int(step)
        fields = list(self._core.fields)
        groups = {g[0]: g[3] for g in self._core.groups}

        def put(index, record):
            for (param, poff, count, goff) in groups[index]:
                s = state.get(param, {})
                if "master" in fields:
                    record[fields.index("master"), goff:goff + count] = \
                        self._params[param].detach().view(-1)[poff:poff + count].numpy()
                for f in self._state_fields():
                    t = s.get(f)
                    row = record[fields.index(f), goff:goff + count]
                    row[:] = 0 if t is None else t.detach().to(torch.float32).reshape(-1)[poff:poff + count].numpy()

        self._core.rewrite(put, steps, copy=False)  # put keeps no record
        for g, saved in zip(self.param_groups, groups_in):
            g.update({k: v for k, v in saved.items() if k != "params"})

    def save_checkpoint(self, path: Union[str, bytes, "os.PathLike"]) -> None:
        """Streams the committed state and the hyperparameters (``param_groups`` without the
        tensors) to one file at ``path``, never holding more than the pinned budget. The file is
        written to a new file in its folder (unnamed while it is written where the file system
        can, so a process killed while saving leaves nothing; then named
        ``path``.tensormem-tmp.<pid>.<n>, a name no file has, so nothing else there is
        touched), synced and renamed: an interrupted save leaves the previous checkpoint
        whole, state and hyperparameters together, and saves to one path from several
        processes at once each leave a whole file (the last one wins).
        A checkpoint that replaces a file keeps that file's permission bits (a new one is 0600).
        ``path`` may be a str or a path-like object (``pathlib.Path``). Anything but a regular
        file or a symbolic link (replaced, not followed) at ``path`` is refused with ``OSError``
        before anything is written."""
        path = os.fsdecode(path)  # str, bytes or path-like: a str, as os.listdir gives names
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        self._core.save(path, json.dumps({"param_groups": groups}, default=_json_number).encode())

    def load_checkpoint(self, path: Union[str, bytes, "os.PathLike"]) -> None:
        """Restores a checkpoint written by ``save_checkpoint`` for the same parameters and
        options: a file of other parameters, a truncated file or one whose checksum does not
        match is refused (``RuntimeError``) and the state stays as it was."""
        self._stage_checkpoint(os.fsdecode(path))()

    def _stage_checkpoint(self, path: str):
        """The first half of ``load_checkpoint``: reads and checks the file into the state's
        generation not in use, and the hyperparameters it holds; the optimizer is unchanged.
        Returns the second half, which makes them the optimizer's (no I/O). Anything that
        writes the state in between (a step) leaves nothing to commit (``RuntimeError``);
        ``self._core.drop_staged_load()`` forgets it."""
        note = self._core.stage_load(path)
        try:
            if note:
                groups = json.loads(note)["param_groups"]
            else:  # a checkpoint of an earlier version: the hyperparameters were in path.json
                try:
                    with open(path + ".json") as f:
                        groups = json.load(f)["param_groups"]
                except FileNotFoundError:
                    groups = None
        except BaseException:
            self._core.drop_staged_load()
            raise

        def commit():
            self._core.commit_load()
            if groups is None:
                return
            if len(groups) != len(self.param_groups):
                raise ValueError(f"checkpoint {path}: the state was loaded, but it holds the hyperparameters of "
                                 f"{len(groups)} parameter groups and this optimizer has {len(self.param_groups)}; "
                                 "param_groups were left as they were")
            for g, saved in zip(self.param_groups, groups):
                g.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
        return commit


def _json_number(value):
    """A hyperparameter the step reads as a number, saved as that number: a one-element
    tensor or numpy value as its item, any other object the step converts (one with
    ``__float__`` or ``__index__``: a Fraction, a Decimal) as ``float(value)``; anything else
    is json's TypeError."""
    if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy":
        try:
            return value.item()
        except (ValueError, RuntimeError):  # more than one element
            pass
    elif hasattr(type(value), "__float__") or hasattr(type(value), "__index__"):
        try:
            return float(value)
        except (TypeError, ValueError, OverflowError):
            pass
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _check_unsupported(**flags):
    for name, value in flags.items():
        if value:
            raise ValueError(f"{name}=True is not supported by the offloaded optimizers")


def _check_at_least_zero(**values):
    """The checks of ``torch.optim``'s constructors: a negative (or NaN) learning rate, epsilon,
    weight decay or momentum is refused rather than turned into a diverging step."""
    for name, value in values.items():
        if not 0.0 <= value:
            raise ValueError(f"{name} must be >= 0, not {value}")


def _check_betas(betas):
    betas = tuple(betas)
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), not {betas}")
    return betas


class OffloadedAdamW(_OffloadedOptimizer):
    """``torch.optim.AdamW`` with its state on disk (see the module documentation)."""
    _kind = "adamw"

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, maximize: bool = False, **offload):
        _check_unsupported(amsgrad=amsgrad, maximize=maximize)
        _check_at_least_zero(lr=lr, eps=eps, weight_decay=weight_decay)
        betas = _check_betas(betas)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), **offload)


class OffloadedAdam(OffloadedAdamW):
    """``torch.optim.Adam`` (L2 weight decay added to the gradient) with its state on disk."""
    _kind = "adam"

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, **offload):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **offload)


class OffloadedSGD(_OffloadedOptimizer):
    """``torch.optim.SGD`` with momentum, its momentum buffers on disk."""
    _kind = "sgd"

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, maximize: bool = False, **offload):
        _check_unsupported(maximize=maximize)
        _check_at_least_zero(lr=lr, momentum=momentum, weight_decay=weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov needs a positive momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov), **offload)


def _global_rank(dist, group, rank: int) -> int:
    """The global rank of ``group``'s member ``rank`` (``get_global_rank`` from PyTorch 2.0 on)."""
    if group is None:
        return rank
    convert = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank
    return convert(group, rank)


_ZERO_CHECKPOINT_FORMAT = "tensormem ZeroOffloadedOptimizer checkpoint 1"


class _NotSet:
    """A hyperparameter a group does not hold."""

    def __repr__(self) -> str:
        return "(not set)"


_ABSENT = _NotSet()


def _as_stepped(value):
    """A hyperparameter as a step reads it: a number (anything with ``__float__``: a bool, a
    0-d tensor, a numpy number) as its float, a tuple or list item by item, anything else by
    its type alone (the step refuses it on its owner; its repr may hold an address)."""
    if isinstance(value, (tuple, list)):
        return tuple(_as_stepped(v) for v in value)
    if value is _ABSENT:
        return value
    if isinstance(value, (str, bytes)):
        return f"<{type(value).__name__}>"
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):  # (RuntimeError: a tensor of more than one element)
        return f"<{type(value).__name__}>"


def _remove_if_there(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _hyperparameter_defaults(optimizer_class, kwargs) -> dict:
    """The hyperparameters ``optimizer_class`` takes by name (``lr``, ``betas``...), each with
    its default or the value in ``kwargs``."""
    import inspect
    named = inspect.signature(optimizer_class).parameters.values()
    return {p.name: kwargs.get(p.name, p.default) for p in named
            if p.name != "params" and p.kind == p.POSITIONAL_OR_KEYWORD and p.default is not p.empty}


class ZeroOffloadedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 2 at parameter granularity over ``torch.distributed``, on a group that
    carries CPU tensors (gloo; beside an NCCL default group, ``new_group(backend="gloo")``;
    an NCCL-only group is refused, ``ValueError``, NCCL moving CUDA tensors only): each
    rank owns whole parameters (largest first, to the least-loaded rank), gradients are
    summed onto their owner (``reduce``) and averaged, the owner steps its offloaded optimizer
    (swap files in ``<swap_dir>/rank<r>``, ``r`` the process's global rank) and broadcasts the
    new values to every rank. ``group`` may be any process group that holds this process;
    its members own the parameters. Every rank gives the same parameters (compared at
    construction: ``ValueError`` on every rank where their groups, order, shapes or dtypes
    differ).

    ``params`` takes parameter groups as ``torch.optim`` does (dicts with ``"params"`` and
    their own hyperparameters). ``param_groups`` holds every group on every rank, and a change
    to a group's hyperparameters (an ``lr_scheduler``'s, made alike on every rank) applies
    from the next step: each owner steps its parameters with their group's values (compared
    across the ranks at each step: ``ValueError`` on every rank where they differ, before
    anything changes). Groups
    cannot be added after construction (the owners are set then). The state is on the owners'
    disks: ``state_dict()`` raises; ``save_checkpoint`` / ``load_checkpoint`` save and load it,
    with the groups' hyperparameters."""

    def __init__(self, params, optimizer_class=OffloadedAdamW, group=None, **kwargs):
        import torch.distributed as dist
        if not dist.is_initialized():
            raise RuntimeError("ZeroOffloadedOptimizer needs torch.distributed.init_process_group first")
        self.group = group
        self.rank = dist.get_rank(group)  # within the group
        if self.rank < 0:
            raise RuntimeError(f"ZeroOffloadedOptimizer: this process (global rank {dist.get_rank()}) is not in the "
                               "process group it was given")
        self.world = dist.get_world_size(group)
        backend = str(dist.get_backend(group)).lower()
        if backend == "nccl":  # (torch 2's default "cpu:gloo,cuda:nccl" carries CPU tensors too)
            raise ValueError("ZeroOffloadedOptimizer exchanges CPU tensors (the parameters it offloads, their "
                             "gradients, its counts), which NCCL does not move: give it a gloo group, "
                             "group=torch.distributed.new_group(backend=\"gloo\")")
        # The parameters, on every rank or on none: a rank whose list torch.optim refuses (an
        # empty one) would leave the others waiting in the next collective, and ranks given
        # other parameters (a model built otherwise on one) would own, reduce and broadcast
        # tensors that do not match.
        self._constructed = False
        error = None
        try:
            super().__init__(params, _hyperparameter_defaults(optimizer_class, kwargs))
        except Exception as e:  # noqa: BLE001 - raised below, after every rank knows
            error = e
        self._constructed = True
        self._raise_if_any_failed(error, "made")
        self._check_same_parameters(dist)
        # reduce and broadcast name processes by their global ranks, also in a smaller group
        self._global = [_global_rank(dist, group, r) for r in range(self.world)]
        self.params = [p for g in self.param_groups for p in g["params"]]
        group_of = [i for i, g in enumerate(self.param_groups) for _ in g["params"]]
        load = [0] * self.world
        self.owner: List[int] = [0] * len(self.params)
        for i in sorted(range(len(self.params)), key=lambda i: -self.params[i].numel()):
            r = min(range(self.world), key=lambda r: (load[r], r))
            self.owner[i] = r
            load[r] += self.params[i].numel()
        # This rank's parameters in their groups (groups it owns nothing of left out), each
        # with its group's hyperparameters; _local_groups[j] is the group of local group j.
        mine, self._local_groups = [], []
        for i, g in enumerate(self.param_groups):
            owned = [p for p, r, gi in zip(self.params, self.owner, group_of) if r == self.rank and gi == i]
            if owned:
                mine.append({**{k: v for k, v in g.items() if k != "params"}, "params": owned})
                self._local_groups.append(i)
        # Made on every rank, or on none: a rank whose optimizer could not be made (a swap
        # folder missing there, bad options) would leave the others waiting in the first step.
        error = None
        try:
            self.local = optimizer_class(mine, rank=dist.get_rank(), **kwargs) if mine else None
        except Exception as e:  # noqa: BLE001 - raised below, after every rank knows
            error = e
        self._raise_if_any_failed(error, "made")

    def _check_same_parameters(self, dist) -> None:
        """Every rank was given the same parameters: as many groups, and in each the same
        shapes and dtypes in the same order (one all_gather of a line per rank); else
        ``ValueError`` on every rank, naming what each rank was given."""
        shapes = [[(tuple(p.shape), str(p.dtype)) for p in g["params"]] for g in self.param_groups]
        mine = (repr(shapes), f"{len(shapes)} group(s), {sum(map(len, shapes))} parameter(s) of "
                              f"{sum(p.numel() for g in self.param_groups for p in g['params'])} elements")
        every: List[Optional[tuple]] = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        if any(other[0] != mine[0] for other in every):
            told = "; ".join(f"rank {r}: {summary}" + ("" if layout == every[0][0] else " (not as rank 0's)")
                             for r, (layout, summary) in enumerate(every))
            raise ValueError(f"ZeroOffloadedOptimizer: the ranks were given different parameters ({told}); every "
                             f"rank gives the same parameters, in the same groups and order, with the same shapes "
                             f"and dtypes")

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_constructed", True):
            raise RuntimeError("ZeroOffloadedOptimizer: parameter groups cannot be added after construction "
                               "(each parameter's owner is chosen then); make a new optimizer")
        super().add_param_group(param_group)

    def state_dict(self) -> dict:
        raise NotImplementedError("ZeroOffloadedOptimizer: the state is on the owners' disks, not in a state "
                                  "dict; save it with save_checkpoint(path) and load it with load_checkpoint(path)")

    def load_state_dict(self, state_dict: dict) -> None:
        self.state_dict()  # raises, as above

    def _hyperparameters_to_local(self) -> None:
        """Each local group takes its group's hyperparameters as they are now."""
        if self.local is None:
            return
        for local, i in zip(self.local.param_groups, self._local_groups):
            local.update({k: v for k, v in self.param_groups[i].items() if k != "params"})

    def _stepped_values(self) -> List[str]:
        """Per group and hyperparameter a step reads, the value as the step reads it (a number
        as its float), written out: the same text on every rank exactly where the values are."""
        return [repr(_as_stepped(g.get(key, _ABSENT))) for g in self.param_groups for key in _STEP_HYPERPARAMETERS]

    def _refuse_other_hyperparameters(self, dist, values: List[str], differ: List[int]) -> None:
        """ValueError on every rank (each calls it: the maxima are the same everywhere), naming
        each group and hyperparameter that differ and every rank's value, before the step
        changes anything."""
        keys = len(_STEP_HYPERPARAMETERS)
        mine = [values[i] for i in differ]
        every: List[Optional[List[str]]] = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        named = "; ".join(f"group {i // keys} {_STEP_HYPERPARAMETERS[i % keys]!r}: " +
                          ", ".join(f"rank {r} {values[j]}" for r, values in enumerate(every))
                          for j, i in enumerate(differ))
        raise ValueError(f"ZeroOffloadedOptimizer: the ranks would step with other hyperparameters ({named}); "
                         f"every rank sets them alike (a scheduler stepped on every rank); nothing was stepped")

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    @torch.no_grad()
    def step(self, closure=None):
        import torch.distributed as dist
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # A parameter with no gradient on any rank (frozen, or not used this step) is left
        # alone, as torch.optim leaves one whose gradient is None: a zero gradient would
        # still move it (weight decay, the moments of earlier steps).
        # In the same collective, the hyperparameters each rank would step with: an owner steps
        # with its own rank's values, so ranks that differ (a scheduler stepped on one rank)
        # would train their parameters apart. Every rank sees the same maxima and refuses alike.
        # Each value goes as the CRC-32 of its text (the same on every rank exactly where the
        # values are, but for a collision, 1 in 2^32), its maximum and its least both taken.
        values = self._stepped_values()
        fingerprints = [float(zlib.crc32(v.encode())) for v in values]
        flags = [1.0 if p.grad is not None else 0.0 for p in self.params]
        both = torch.tensor(flags + fingerprints + [-f for f in fingerprints], dtype=torch.float64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        n, k = len(flags), len(fingerprints)
        differ = [i for i, (high, low) in enumerate(zip(both[n:n + k].tolist(), both[n + k:].tolist()))
                  if high != -low]
        if differ:
            self._refuse_other_hyperparameters(dist, values, differ)
        has_grad = both[:n] > 0
        for p, r, anywhere in zip(self.params, self.owner, has_grad.tolist()):
            if not anywhere:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.reduce(p.grad, dst=self._global[r], group=self.group)
            if r == self.rank:
                p.grad.div_(self.world)
        # A step that fails on its rank (a full disk, a parameter changed there) fails on every
        # rank, before any broadcast that would wait for that rank's values.
        def local_step():
            if self.local is not None:
                self._hyperparameters_to_local()
                self.local.step()

        self._on_every_rank("stepped", local_step)
        # Only what was stepped: a parameter no rank had a gradient for kept its value. The
        # others' new values are counted in their versions as the owner's step counts its own
        # (broadcast into p.data, whose version is its own, would count nothing).
        stepped = [(p, r) for p, r, anywhere in zip(self.params, self.owner, has_grad.tolist()) if anywhere]
        with _counted_as_written([p for p, r in stepped if r != self.rank]):
            for p, r in stepped:
                dist.broadcast(p.data, src=self._global[r], group=self.group)
        return loss

    def restore_parameters(self) -> None:
        """Puts the parameters this rank owns back from its master copy (see
        ``restore_parameters`` of the offloaded optimizers); the others are their owners' to
        restore. No collective: call it on the ranks whose step raised an error with
        ``not_undone``."""
        if self.local is not None:
            self.local.restore_parameters()

    def save_checkpoint(self, path: Union[str, bytes, "os.PathLike"]) -> None:
        """Saves every rank's optimizer as one checkpoint, committed by a small file at ``path``.

        Collective: every rank of the group calls it with the same ``path``, in a folder every
        rank reaches (a file system shared by the machines): where a rank does not see
        another's file once all have saved (each machine its own disk), the save fails on
        every rank (``FileNotFoundError`` naming that file) before anything is committed.
        Each rank that owns parameters saves its optimizer (``save_checkpoint``: state and
        hyperparameters) to ``<path>.<save>.rank<r>``, ``save`` a number drawn for this save
        and sent to every rank. Once every rank has saved, the group's rank 0 writes ``path`` (JSON: the
        save's number, the group's size, the owner of every parameter and the files) through a
        temporary file and a rename: that is the commit. Then it removes the files of the save
        ``path`` named before. A save that fails on any rank raises on every rank (that rank's
        own error; on the others ``RuntimeError`` "... could not be saved on N other rank(s)"),
        removes this save's files, and leaves the previous checkpoint whole and in use."""
        import secrets
        import torch.distributed as dist
        path = os.fsdecode(path)  # str, bytes or path-like: a str, as os.listdir gives names
        number = torch.tensor([secrets.randbits(62) if self.rank == 0 else 0], dtype=torch.int64)
        dist.broadcast(number, src=self._global[0], group=self.group)
        save = f"{number.item():016x}"
        mine = self._checkpoint_file(path, save, self.rank) if self.local is not None else None

        def remove_mine():
            if mine is not None:
                _remove_if_there(mine)

        self._on_every_rank("saved", lambda: mine is not None and self.local.save_checkpoint(mine), remove_mine)

        def all_seen():
            # Every rank sees every rank's file, as every rank's load will need: else the folder
            # is not on one file system for the group (each machine its own disk), and the
            # save, though each rank's file is whole, could never be loaded.
            for r in sorted(set(self.owner)):
                theirs = self._checkpoint_file(path, save, r)
                if r != self.rank and not os.path.isfile(theirs):
                    raise FileNotFoundError(errno.ENOENT, f"checkpoint {path}: rank {self.rank} does not see the file "
                                            f"rank {r} saved beside it; every rank saves by the same path, to a "
                                            f"folder on a file system the whole group reaches", theirs)

        self._on_every_rank("saved", all_seen, remove_mine)
        # The commit: rank 0 replaces the file at `path`; every rank learns whether it could.
        replaced: List[str] = []  # the files of the save `path` named before

        def commit():
            if self.rank != 0:
                return
            try:
                replaced.extend(self._checkpoint_files(path, self._read_manifest(path)).values())
            except (OSError, ValueError, KeyError, TypeError):
                pass  # none there, or not one of ours: no files of ours to remove
            files = {str(r): os.path.basename(self._checkpoint_file(path, save, r)) for r in sorted(set(self.owner))}
            manifest = {"format": _ZERO_CHECKPOINT_FORMAT, "save": save, "world": self.world, "owner": self.owner,
                        "files": files,
                        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]}
            _tensormem._write_file(path, json.dumps(manifest, indent=1, default=_json_number) + "\n")

        self._on_every_rank("committed", commit, remove_mine)
        new = set(self._checkpoint_file(path, save, r) for r in set(self.owner))
        for old in replaced:
            if old not in new:  # (the same number drawn twice: this save's own)
                _remove_if_there(old)

    def load_checkpoint(self, path: Union[str, bytes, "os.PathLike"]) -> None:
        """Loads a checkpoint written by ``save_checkpoint`` (collective: every rank of the
        group, the same ``path``), on every rank or on none. Every rank reads ``path`` and
        checks that it was saved by a group of this size with the same owner for every
        parameter and that each rank's file is there, and the ranks check that they read one
        save (``ValueError`` on every rank where a rank was given another path, to another
        save); then each rank reads and checks its file
        into the generation of its state not in use, its optimizer unchanged. Only once every
        rank has done so does each make it its state (no I/O). Where any rank fails (a missing
        or damaged file: its checksum does not match), every rank raises (that rank's own
        error, or ``RuntimeError`` on the others) and keeps the state it had. The groups'
        hyperparameters (``param_groups``) are set to those saved with it."""
        import torch.distributed as dist
        path = os.fsdecode(path)  # str, bytes or path-like: a str, as os.listdir gives names
        mine: List[str] = []  # this rank's file, once checked
        groups: List[dict] = []  # the groups' hyperparameters, as saved
        saves: List[str] = []  # the save's number

        def check():
            manifest = self._read_manifest(path)
            saves.append(manifest.get("save"))
            saved = manifest.get("param_groups", [])  # (none in a checkpoint saved before groups were kept)
            if not isinstance(saved, list) or not all(isinstance(g, dict) for g in saved):
                raise ValueError(f"{path} is not a checkpoint of ZeroOffloadedOptimizer.save_checkpoint")
            groups.extend(saved)
            if groups and len(groups) != len(self.param_groups):
                raise ValueError(f"checkpoint {path} holds {len(groups)} parameter groups; this optimizer has "
                                 f"{len(self.param_groups)}")
            if manifest["world"] != self.world or manifest["owner"] != self.owner:
                raise ValueError(f"checkpoint {path} was saved by a group of {manifest['world']} rank(s) owning "
                                 f"the parameters as {manifest['owner']}; this one has {self.world} owning them as "
                                 f"{self.owner}")
            if self.local is not None:
                file = self._checkpoint_files(path, manifest)[self.rank]
                if not os.path.isfile(file):
                    raise FileNotFoundError(f"checkpoint {path}: the file of rank {self.rank}, {file}, is missing")
                mine.append(file)

        self._on_every_rank("loaded", check)
        # One checkpoint on every rank: ranks given other paths (each its own copy, or
        # another save) would each load their own, and go on from states that do not belong
        # together. A save's number tells it (ranks may name one file by other paths).
        every: List[Optional[str]] = [None] * self.world
        dist.all_gather_object(every, str(saves[0]), group=self.group)
        if len(set(every)) > 1:
            raise ValueError(f"ZeroOffloadedOptimizer: the ranks were given the files of different saves to load "
                             f"({', '.join(f'rank {r}: save {n}' for r, n in enumerate(every))}); every rank loads "
                             f"one checkpoint, by the same path")
        commits = []  # this rank's second half, once its file is staged

        def drop():
            if commits:
                self.local._core.drop_staged_load()

        self._on_every_rank("loaded", lambda: mine and commits.append(self.local._stage_checkpoint(mine[0])), drop)
        self._on_every_rank("loaded", lambda: commits and commits[0]())
        for g, saved in zip(self.param_groups, groups):
            g.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})

    @staticmethod
    def _checkpoint_file(path: str, save: str, rank: int) -> str:
        return f"{path}.{save}.rank{rank}"

    @staticmethod
    def _read_manifest(path: str) -> dict:
        with open(path) as f:
            text = f.read()
        try:
            manifest = json.loads(text)
        except ValueError:
            manifest = None
        if not isinstance(manifest, dict) or manifest.get("format") != _ZERO_CHECKPOINT_FORMAT:
            raise ValueError(f"{path} is not a checkpoint of ZeroOffloadedOptimizer.save_checkpoint")
        return manifest

    @staticmethod
    def _checkpoint_files(path: str, manifest: dict) -> Dict[int, str]:
        folder = os.path.dirname(path)
        return {int(r): os.path.join(folder, name) for r, name in manifest["files"].items()}

    def _on_every_rank(self, what: str, call, cleanup=None) -> None:
        """Runs ``call()`` here; where it failed on any rank, raises on every rank (see
        ``_raise_if_any_failed``)."""
        error = None
        try:
            call()
        except Exception as e:  # noqa: BLE001 - raised below, after every rank knows
            error = e
        self._raise_if_any_failed(error, what, cleanup)

    def _raise_if_any_failed(self, error: Optional[BaseException], what: str, cleanup=None) -> None:
        """Counts the ranks where ``error`` is set (one all_reduce); re-raises this rank's
        error, or says on how many other ranks the optimizer could not be ``what``. Where any
        rank failed, ``cleanup()`` runs first on every rank."""
        import torch.distributed as dist
        failed = torch.tensor([0 if error is None else 1], dtype=torch.int64)
        dist.all_reduce(failed, group=self.group)
        if failed.item() and cleanup is not None:
            cleanup()
        if error is not None:
            raise error
        if failed.item():
            raise RuntimeError(f"ZeroOffloadedOptimizer: the offloaded optimizer could not be {what} on "
                               f"{failed.item()} other rank(s) of the group; their errors say why")

    @property
    def last_stats(self) -> dict:
        return self.local.last_stats if self.local is not None else {}
