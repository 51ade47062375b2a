"""From a PyTorch module to a planned arena: trace, plan, run (re-exported by tensormem.torch).

``trace(module, *inputs, training=False)`` records the module's aten-level operator graph
with ``functorch.make_fx`` (for ``training=True`` the forward, the loss -- the sum of the
outputs unless ``loss_fn`` is given -- and the backward that computes every parameter's
gradient) and turns it into buffers with lifetimes:

- Time steps are the graph's nodes in execution order; a buffer lives over
  ``[the step that creates it, the step after its last use)``.
- Aliasing comes from each op's schema (its alias annotations): an output annotated as an
  alias of an argument (``view``, ``t``, ``expand``, ``split``'s list, ``relu_``...) is the
  same buffer as that argument and extends its lifetime; an argument annotated as written
  (``add_``, ``relu_``) is a use; outputs without annotation are new buffers -- except
  ``_unsafe_view``, a view whose schema says nothing (the tests compare every value's storage
  at run time with these decisions). Ops whose output shape or value depends on the data
  (``nonzero``, ``item``) are refused: a plan would hold only for the traced inputs.
- Graph inputs and outputs live for the whole run. Parameters and module buffers are not
  activations: their bytes are reported apart (``param_bytes``) and never planned.

``plan_module`` plans the buffers in one arena (``tensormem.plan``), measures the eager peak
of the same call (through PyTorch's allocator hook, or from torch.profiler's memory events
where tensormem has no hook: bytes allocated minus bytes freed, at their highest), replays
the online best fit, and ``ModulePlan.run`` executes the traced graph with every activation
inside ONE preallocated arena tensor at its planned offset.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import operator
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.fx
from torch.nn.utils import stateless
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import _tensormem
from ._storage_hold import storage_of

# torch.func.functional_call from PyTorch 2.0 on (where the stateless one is deprecated).
_functional_call = getattr(getattr(torch, "func", None), "functional_call", None) or stateless.functional_call


class UnsupportedGraph(ValueError):
    """The module cannot be traced or planned; the message names the op or construct."""


@dataclass
class Buffer:
    """One activation buffer: bytes, lifetime [lower, upper) in graph steps."""
    id: int
    name: str          # the node that creates it
    nbytes: int
    lower: int
    upper: int
    kind: str          # "activation", "input" or "output"
    node: str = ""     # the node that creates it
    index: int = 0     # which of the node's outputs
    aliases: int = 0   # values (views, in-place results) that share it


@dataclass
class Graph:
    """A traced module: the aten graph and its activation buffers."""
    module: torch.fx.GraphModule
    buffers: List[Buffer]
    steps: int
    training: bool
    param_bytes: int            # parameters and module buffers (not planned)
    n_state: int                # leading placeholders that are parameters / module buffers
    node_buffers: Dict[str, List[Optional[int]]] = field(default_factory=dict)  # node -> buffer per output
    ops: Dict[str, int] = field(default_factory=dict)
    out_spec: object = None  # pytree structure of the call's result
    metas: Dict[str, list] = field(default_factory=dict)  # op node -> metadata per output
    # leaf of the flattened inputs -> the value that is not a tensor (a number, None...) the
    # trace took as it was (a numpy array, as a copy made when traced)
    constant_inputs: Dict[int, object] = field(default_factory=dict)
    in_spec: object = None  # pytree structure of the call's inputs (tuples, lists, dicts)
    input_names: List[str] = field(default_factory=list)  # of each leaf: "1", "1[0]", "0['x']"
    # module buffers the forward replaced by new tensors (``self.count = self.count + 1``):
    # the graph computes the new value but does not store it back into the module
    reassigned_buffers: List[str] = field(default_factory=list)
    # leaves of the flattened inputs that the graph writes in place (directly or through a
    # view): a planned run copies them back into the caller's tensors, as an eager call leaves them
    written_inputs: List[int] = field(default_factory=list)
    # parameters and module buffers (by position: parameters, then buffers, as traced) that
    # the graph writes in place, directly or through a view (``.data``, ``detach``)
    written_state: List[int] = field(default_factory=list)
    # what the traced call was specialized on (``_modes_of``): submodules' training modes,
    # the parameters a training step differentiates, CPU autocast
    modes: list = field(default_factory=list)
    # pairs (i, j) of input leaves that were one tensor in the traced call (the graph reads
    # both from one placeholder), and pairs of other input leaves whose memory overlapped
    same_inputs: List[Tuple[int, int]] = field(default_factory=list)
    shared_inputs: List[Tuple[int, int]] = field(default_factory=list)

    @property
    def activation_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def arrays(self):
        lower = np.array([b.lower for b in self.buffers], dtype=np.uint64)
        upper = np.array([b.upper for b in self.buffers], dtype=np.uint64)
        size = np.array([b.nbytes for b in self.buffers], dtype=np.uint64)
        return lower, upper, size

    def to_operator_graph(self):
        """The graph as tensormem's C++ OperatorGraph: one tensor per buffer (parameters are
        left out), one op per aten node, reading the buffers of its tensor arguments (a view
        reads its base) and producing the buffers it creates; ``derive_lifetimes`` of it
        gives the same lower bound as these buffers."""
        g = _tensormem.OperatorGraph()
        for b in self.buffers:  # outputs are activations read by a last "output" op
            g.add_tensor(b.name, b.nbytes, "input" if b.kind == "input" else "activation")
        for node in self.module.graph.nodes:
            if node.op != "call_function" or node.target is operator.getitem:
                continue
            reads = sorted({bid for a in node.all_input_nodes for bid in self.node_buffers.get(a.name, [])
                            if bid is not None})
            made = [bid for bid in self.node_buffers[node.name] if bid is not None and self.buffers[bid].node == node.name]
            reads = [bid for bid in reads if bid not in made]
            g.add_op(str(node.target), reads, made)
        g.add_op("output", [b.id for b in self.buffers if b.kind == "output"], [])
        return g

    def to_trace(self, path: str) -> None:
        """Writes the buffers as a trace CSV (``id,lower,upper,size``) for ``tensormem plan``."""
        _write_trace(path, ((b.name, b.lower, b.upper, b.nbytes) for b in self.buffers))


def _write_trace(path: str, rows) -> None:
    """Writes (id, lower, upper, size) rows as a trace CSV. A file already there is replaced
    only once the new one is whole (a full disk keeps it); an OSError names the path."""
    lines = ["id,lower,upper,size\n"]
    lines.extend(f"{name},{lower},{upper},{size}\n" for name, lower, upper, size in rows)
    _tensormem._write_file(path, "".join(lines))


def _flat_tensors(value) -> List:
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            out.extend(_flat_tensors(v))
        return out
    return [value]


def _is_meta(meta) -> bool:
    """A single tensor's metadata (TensorMetadata is itself a named tuple)."""
    return hasattr(meta, "shape") and hasattr(meta, "dtype")


def _metas(meta) -> list:
    """One entry per output of a node: its TensorMetadata, or None for a non-tensor."""
    if meta is None or _is_meta(meta):
        return [meta]
    return [m if _is_meta(m) else None for m in meta]


def _storage_bytes(meta) -> int:
    """Bytes a tensor of this shape, stride and dtype spans."""
    if meta is None:
        return 0
    return _span_elements(meta.shape, meta.stride) * torch.empty((), dtype=meta.dtype).element_size()


def _span_elements(shape, strides) -> int:
    """Elements from a strided tensor's first element to its last one, both included (0 for
    an empty one): 1 + sum((size - 1) * stride), strides not negative."""
    if any(int(n) == 0 for n in shape):
        return 0
    return 1 + sum((int(n) - 1) * int(st) for n, st in zip(shape, strides))


# Ops whose results share their input's storage although their schema carries no alias
# annotation (found by comparing storages at run time): the first argument is the base.
# The unsafe splits are how PyTorch's own recurrent layers (nn.LSTM, nn.GRU) cut their gates.
_UNANNOTATED_VIEWS = {"aten::_unsafe_view", "aten::unsafe_split", "aten::unsafe_split_with_sizes",
                      "aten::unsafe_chunk"}


def _alias_sources(op) -> List[Optional[int]]:
    """For each return of ``op``, the index of the argument whose buffer it is (a view or an
    in-place result), or None for a new buffer. Written arguments need nothing more: they
    are uses of their buffer like any argument."""
    schema = op._schema
    if schema.name in _UNANNOTATED_VIEWS:
        return [0]
    sources: List[Optional[int]] = []
    for r in schema.returns:
        ai = r.alias_info
        if ai is None:
            sources.append(None)
            continue
        # A List[Tensor] return carries its alias set on the elements, where the schema
        # object does not show it: then the one annotated argument is the base.
        sets = set(ai.before_set) | set(ai.after_set)
        candidates = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None
                      and (not sets or sets & (set(a.alias_info.before_set) | set(a.alias_info.after_set)))]
        if len(candidates) != 1:
            raise UnsupportedGraph(f"cannot tell which argument {schema.name} returns a view of")
        sources.append(candidates[0])
    return sources


def _indexes_by_integers(op, node: torch.fx.Node) -> bool:
    """``aten.index.Tensor`` whose index tensors are all integers: its result's shape follows
    from the shapes of its arguments (a boolean or byte mask makes it depend on the mask's
    values, which is why the op carries the dynamic-shape tag)."""
    if op is not torch.ops.aten.index.Tensor or len(node.args) < 2:
        return False
    metas = [i.meta.get("tensor_meta") if isinstance(i, torch.fx.Node) else None
             for i in node.args[1] if i is not None]
    return bool(metas) and all(m is not None and not m.dtype.is_floating_point and not m.dtype.is_complex
                               and m.dtype not in (torch.bool, torch.uint8) for m in metas)


def _schema_args(op, node: torch.fx.Node) -> list:
    schema = op._schema
    values = list(node.args) + [None] * (len(schema.arguments) - len(node.args))
    for i, a in enumerate(schema.arguments):
        if a.name in node.kwargs:
            values[i] = node.kwargs[a.name]
    return values


def _default_loss(module: torch.nn.Module, out):
    """The sum of every tensor the module returns, in tuples, lists and dicts alike."""
    tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if not tensors:
        raise UnsupportedGraph(f"{type(module).__name__} returns no tensor to make the default loss of; pass loss_fn")
    return sum(t.float().sum() for t in tensors)


def _loss_problem(loss) -> str:
    """What makes ``loss`` no loss to differentiate, or "" (a scalar floating-point tensor that
    requires a gradient; a tuple or list of them, whose gradients add up)."""
    if isinstance(loss, (tuple, list)) and loss:
        return next((p for p in map(_loss_problem, loss) if p), "")
    if not isinstance(loss, torch.Tensor):
        return f"a {type(loss).__name__}, not a tensor"
    if loss.numel() != 1:
        return f"a tensor of shape {tuple(loss.shape)}, not one value"
    if not (loss.is_floating_point() or loss.is_complex()):
        return f"a {loss.dtype} tensor, which has no gradient"
    if not loss.requires_grad:
        return "a tensor that does not depend on the parameters (detached, or computed without autograd)"
    return ""


def _grad_mode_of(training: bool):
    """Autograd on for a training step whatever the caller's mode (a plan asked for inside
    ``torch.no_grad()``, an evaluation loop), off for inference. Inside
    ``torch.inference_mode()`` no gradient can be taken at all: UnsupportedGraph says so."""
    if not training:
        return torch.no_grad()
    if torch.is_inference_mode_enabled():
        raise UnsupportedGraph("a training step cannot be traced inside torch.inference_mode(), where autograd is "
                               "off for good: plan it outside that block")
    return torch.enable_grad()


def _require_module(module) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"expected a torch.nn.Module, not {type(module).__name__} "
                        "(wrap a function with tensormem.model.capture)")


@contextlib.contextmanager
def _module_state_kept(module: torch.nn.Module):
    """Puts back what running ``module`` to trace or measure it changed: its buffers (batch
    norm's running statistics and counters, in place or reassigned) and the states of the
    random number generators (dropout), so that planning a model leaves it and the next
    training step as they were. Parameters are not copied here: the backward pass of the
    trace and the measurement leaves them and their gradients alone, and those the forward
    writes in place are ``_writes_kept``'s."""
    kept = []
    seen = set()
    for owner in module.modules():
        for name, b in owner._buffers.items():
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                kept.append((owner, name, b, b.detach().clone()))
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        for owner, name, b, saved in kept:
            _put_back(b, saved)
            owner._buffers[name] = b
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


@contextlib.contextmanager
def _writes_kept(module: torch.nn.Module, inputs: tuple, written: Optional[Graph], runs: str, stacklevel: int):
    """Puts back what the real runs of ``module`` (``runs``: a trace, an eager measurement)
    wrote in place into the input tensors (the leaves of ``inputs``: ``x.add_(1)``, a cache
    written at one position) and into its parameters (weight clipping, an embedding's
    ``max_norm``). They are copied once for this, for the time of the call: those that
    ``written`` (the graph of a trace on fake tensors, which changed nothing) says the
    forward writes; without that graph, every tensor input and no parameter. Yields a list
    to which the caller appends the graph of the real trace: a parameter or input it shows
    written that was not copied keeps the writes, and a RuntimeWarning names it. Module
    buffers are ``_module_state_kept``'s."""
    leaves = tree_flatten(list(inputs))[0]
    named = list(module.named_parameters())
    names, params = [k for k, _ in named], [p for _, p in named]
    kept_inputs = set(range(len(leaves)) if written is None else written.written_inputs)
    kept_params = set(written.written_state if written is not None else ()) & set(range(len(params)))
    kept = []
    seen = set()
    for t in [leaves[k] for k in sorted(kept_inputs)] + [params[i] for i in sorted(kept_params)]:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            kept.append((t, t.detach().clone()))
    real: List[Graph] = []
    try:
        yield real
    finally:
        for t, saved in kept:
            _put_back(t, saved)
    if real:
        g = real[0]
        changed = [names[i] for i in g.written_state if i < len(names) and i not in kept_params] + \
            [f"input {g.input_names[k]}" for k in g.written_inputs if k not in kept_inputs]
        if changed:
            import warnings
            warnings.warn(f"the forward writes {', '.join(changed)} in place and {runs} ran it: "
                          f"{'it keeps' if len(changed) == 1 else 'they keep'} the writes (plan_module with "
                          "check_memory=True traces on fake tensors first, sees such writes and puts them back)",
                          RuntimeWarning, stacklevel=stacklevel)


def _put_back(t: torch.Tensor, saved: torch.Tensor) -> None:
    """Gives tensor ``t`` the shape and values of its copy ``saved`` again, in place. An
    inference tensor (made under torch.inference_mode) is written in that mode, which alone
    allows it; one left unchanged is not written at all."""
    with torch.inference_mode() if t.is_inference() else torch.no_grad():
        if t.shape != saved.shape:  # resized in place: its old memory and size back
            t.set_(saved)
        elif not _equal_values(t, saved):
            t.copy_(saved)


def _equal_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal, False where it is not implemented (meta and sparse tensors)."""
    try:
        return torch.equal(a, b)
    except (NotImplementedError, RuntimeError):
        return False


def trace(module: torch.nn.Module, *example_inputs, training: bool = False,
          loss_fn: Optional[Callable] = None) -> Graph:
    """The operator graph of ``module(*example_inputs)`` and its activation buffers.

    ``training=True`` traces forward, loss (``loss_fn(output)``, by default the sum of every
    output) and backward (gradients of every parameter that requires one), as one graph.
    The trace runs the module; its buffers (batch norm's running statistics), the input
    tensors it changes in place and the random number generators are put back afterwards.
    A parameter the forward writes in place (weight clipping, an embedding's ``max_norm``)
    keeps that write, with a RuntimeWarning naming it (``plan_module`` puts such parameters
    back). Raises UnsupportedGraph naming the op or the construct that cannot be traced."""
    _require_module(module)
    with _module_state_kept(module), _writes_kept(module, example_inputs, None, "the trace", 4) as real:
        real.append(_trace(module, example_inputs, training, loss_fn, "real"))
        return real[0]


def activation_lower_bound(module: torch.nn.Module, *example_inputs, training: bool = False,
                           loss_fn: Optional[Callable] = None, alignment: int = 64) -> int:
    """The lower bound ``plan_module`` would report for the same call (the most activation
    bytes alive at one graph step, sizes rounded up to ``alignment``), found without running
    the model: the trace runs on fake tensors (shapes and dtypes only; the inputs' values are
    never read and no activation is allocated), so it takes about a second whatever the batch.
    It can come out slightly above the real trace's: a few fake kernels give a size to outputs
    the CPU kernels leave empty (batch norm's saved statistics in inference). An op without a
    fake kernel runs on real zero tensors of its shapes (PyTorch's fallback; the fused
    transformer layer of inference), with that op's time and memory. Raises
    UnsupportedGraph as ``trace`` does, also for an op that has no fake-tensor implementation
    in this PyTorch."""
    alignment = operator.index(alignment)
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, not {alignment}")
    return _lower_bound_of(_trace(module, example_inputs, training, loss_fn, "fake"), alignment)


def _lower_bound_of(g: Graph, alignment: int) -> int:
    lower, upper, size = g.arrays()
    return int(_tensormem.lower_bound(lower, upper, size, alignment))


def _trace(module: torch.nn.Module, example_inputs: tuple, training: bool, loss_fn: Optional[Callable],
           tracing_mode: str) -> Graph:
    _require_module(module)
    params = {k: v for k, v in module.named_parameters()}
    state = {**params, **{k: v for k, v in module.named_buffers()}}
    param_bytes = sum(v.numel() * v.element_size() for v in state.values())
    grad_params = [k for k, v in params.items() if v.requires_grad]
    if training and not grad_params:  # the backward pass would have nothing to differentiate
        raise UnsupportedGraph(f"cannot plan a training step of {type(module).__name__}: it has no parameter that "
                               f"requires a gradient ({len(params)} parameters); plan it with training=False")

    def loss_of(out):
        if loss_fn is None:
            return _default_loss(module, out)
        loss = loss_fn(out)
        problem = _loss_problem(loss)
        if problem:
            raise UnsupportedGraph(f"loss_fn returned {problem}: a training step needs a scalar floating-point "
                                   "tensor computed from the output (or a tuple or list of them)")
        return loss

    structure = []  # the structure the traced call returns (the graph returns its leaves)
    buffer_names = [k for k, _ in module.named_buffers()]
    given = {}
    reassigned = set()

    def buffer_attribute(name):
        owner, _, leaf = name.rpartition(".")
        return getattr(module.get_submodule(owner) if owner else module, leaf, None)

    def before_forward(_module, _args):
        given.update((k, buffer_attribute(k)) for k in buffer_names)

    def after_forward(_module, _args, _out):
        reassigned.update(k for k in buffer_names if buffer_attribute(k) is not given[k])

    def forward(state_values, *inputs):
        out = _functional_call(module, state_values, inputs)
        if training:
            loss = loss_of(out)
            grads = torch.autograd.grad(loss, [state_values[k] for k in grad_params], allow_unused=True)
            out = (loss, [g for g in grads if g is not None])
        structure.append(tree_flatten(out)[1])
        return out

    from functorch import make_fx
    grad_mode = _grad_mode_of(training)
    hooks = [] if isinstance(module, torch.jit.ScriptModule) else [  # (no hooks there; no trace either)
        module.register_forward_pre_hook(before_forward), module.register_forward_hook(after_forward)]
    try:
        with grad_mode:
            gm = make_fx(forward, tracing_mode=tracing_mode)(state, *example_inputs)
    except UnsupportedGraph:  # said in full already (a loss that is no loss)
        raise
    except Exception as e:  # data-dependent control flow, unsupported Python constructs
        raise UnsupportedGraph(f"cannot trace {type(module).__name__}: {type(e).__name__}: {e}") from e
    finally:
        for h in hooks:
            h.remove()
    try:
        g = _analyse(gm, len(state), param_bytes, training)
    except UnsupportedGraph:
        raise
    except Exception as e:
        if tracing_mode != "fake":
            raise
        # PyTorch 2 traces data-dependent sizes on fake tensors as symbols, which cannot be
        # read as numbers: no usable trace, as where PyTorch 1 stopped the trace itself.
        raise UnsupportedGraph(f"cannot trace {type(module).__name__}: {type(e).__name__}: {e}") from e
    g.reassigned_buffers = sorted(reassigned)
    g.out_spec = structure[-1]
    leaves, g.in_spec = tree_flatten(list(example_inputs))
    g.input_names = _leaf_names(list(example_inputs), len(leaves))
    g.constant_inputs = {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in enumerate(leaves)
                         if not isinstance(v, torch.Tensor)}
    same, g.shared_inputs = _input_sharing(leaves, list(state.values()))
    # make_fx gives one tensor object one placeholder (the other left without users): such
    # pairs the graph reads from one; a release that keeps two placeholders reads each
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    node_of = lambda k: placeholders[len(state) + k] if k < len(leaves) else placeholders[k - len(leaves)]  # noqa: E731
    g.same_inputs = [(i, j) for i, j in same if len(placeholders) != len(state) + len(leaves)
                     or not node_of(i).users or not node_of(j).users]
    g.modes = _modes_of(module, training)
    return g


def _modes_of(module: torch.nn.Module, training: bool) -> list:
    """What a traced graph holds besides shapes, as (kind, name, value): each submodule's
    training mode (dropout, batch norm's statistics), for a training step which parameters
    require a gradient (those it differentiates), and CPU autocast (the casts it made)."""
    modes = [("mode", name, m.training) for name, m in module.named_modules()]
    if training:
        modes += [("requires_grad", name, p.requires_grad) for name, p in module.named_parameters()]
    return modes + [("autocast", "cpu", _cpu_autocast())]


def _cpu_autocast():
    """CPU autocast's dtype where it is on, else None (PyTorch 2.4 and later ask by device,
    and warn that the CPU's own functions are deprecated)."""
    if hasattr(torch, "get_autocast_dtype"):
        return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
    return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None


def _check_modes(plan: "ModulePlan") -> None:
    """Refuses (``ValueError``) a run where the module or CPU autocast is not as when the
    graph was traced: the graph would compute the traced call, not the one asked for."""
    then, now = plan.graph.modes, plan.modes()
    if then == now:
        return
    if [(k, n) for k, n, _ in then] != [(k, n) for k, n, _ in now]:
        raise ValueError("ModulePlan.run: the module's submodules or parameters are not those it was traced with; "
                         "plan it again")
    kind, name, was, current = next((k, n, a, b) for (k, n, a), (_, _, b) in zip(then, now) if a != b)
    what = name or "the module"
    if kind == "mode":
        raise ValueError(f"ModulePlan.run: {what} is in {'eval' if was else 'training'} mode now; the plan was "
                         f"traced in {'training' if was else 'eval'} mode and its graph computes that call (dropout, "
                         f"batch norm's statistics): call .{'train' if was else 'eval'}() first, or plan again")
    if kind == "requires_grad":
        raise ValueError(f"ModulePlan.run: parameter {name} {'does not require' if was else 'requires'} a gradient "
                         f"now; the training step was traced {'with' if was else 'without'} its gradient: "
                         f"plan again")
    cast = "off" if was is None else f"on ({was})"
    raise ValueError(f"ModulePlan.run: CPU autocast is {'off' if current is None else f'on ({current})'} here; the "
                     f"plan was traced with it {cast}, and its graph holds the casts of that call: run it as traced, "
                     f"or plan again")


def _input_sharing(leaves: list, state: list = ()) -> Tuple[List[Tuple[int, int]], List[Tuple[int, int]]]:
    """Pairs (i, j), i < j, of tensors that are one tensor (the same memory, dtype, shape and
    strides: make_fx gives one placeholder to one tensor object given twice, or given as an
    input and held by the module), and pairs of others whose bytes in one storage intersect
    (a conservative test: interleaved views count as sharing). Indices count the input
    ``leaves`` first, then the module's ``state`` (its parameters and buffers); each pair
    holds an input (how the module's own tensors share memory is the module's business)."""
    spans = []
    for v in list(leaves) + list(state):
        spans.append(None)
        if not isinstance(v, torch.Tensor) or v.layout != torch.strided or not v.numel():
            continue
        address = storage_of(v).data_ptr()
        if not address:  # (no memory: a meta tensor)
            continue
        element = v.element_size()
        first = v.storage_offset() * element
        end = first + _span_elements(v.shape, v.stride()) * element
        spans[-1] = (address, first, end, (v.dtype, tuple(v.shape), tuple(v.stride())))
    by_address: Dict[int, List[int]] = {}
    for k in range(len(leaves), len(spans)):
        if spans[k] is not None:
            by_address.setdefault(spans[k][0], []).append(k)
    same, shared = [], []
    for i in range(len(leaves)):
        if spans[i] is None:
            continue
        address, first, end, form = spans[i]
        others = [j for j in range(i + 1, len(leaves)) if spans[j] is not None] + by_address.get(address, [])
        for j in others:
            address_j, first_j, end_j, form_j = spans[j]
            if address != address_j or end <= first_j or end_j <= first:
                continue
            (same if (first, form) == (first_j, form_j) else shared).append((i, j))
    return same, shared


def _leaf_names(inputs: list, count: int) -> List[str]:
    """The name of each leaf of ``tree_flatten(inputs)``, in its order: the input's position,
    then an index or key per level ("1", "1[0]", "0['x']"). Plain numbers where the inputs
    hold containers this does not know (``count`` leaves)."""
    names: List[str] = []

    def walk(v, name):
        if isinstance(v, (list, tuple)):
            for i, item in enumerate(v):
                walk(item, f"{name}[{i}]")
        elif isinstance(v, dict):
            for key, item in v.items():
                walk(item, f"{name}[{key!r}]")
        else:
            names.append(name)

    for i, v in enumerate(inputs):
        walk(v, str(i))
    return names if len(names) == count else [str(k) for k in range(count)]


def _same_constant(given, traced) -> bool:
    """Whether an input that is not a tensor equals the value the trace took (its type too:
    1 and 1.0 and True may trace differently). A numpy array is compared by dtype, shape and
    contents with the copy made when traced: the graph may hold numbers the trace read from
    it, so the same array changed in place since is another value."""
    if isinstance(traced, np.ndarray):
        return (isinstance(given, np.ndarray) and given.dtype == traced.dtype and given.shape == traced.shape
                and bool(np.array_equal(given, traced, equal_nan=given.dtype.kind in "fc")))
    if given is traced:
        return True
    try:
        return type(given) is type(traced) and bool(given == traced)
    except Exception:  # noqa: BLE001 - no truth value: not the same
        return False


def _analyse(gm: torch.fx.GraphModule, n_state: int, param_bytes: int, training: bool) -> Graph:
    nodes = list(gm.graph.nodes)
    steps = len(nodes)
    buffers: List[Buffer] = []
    node_buffers: Dict[str, List[Optional[int]]] = {}
    last_use: Dict[int, int] = {}
    ops: Dict[str, int] = {}

    def new_buffer(node, index, meta, kind, step) -> int:
        name = node.name if index == 0 else f"{node.name}.{index}"
        buffers.append(Buffer(len(buffers), name, _storage_bytes(meta), step, step + 1, kind, node.name, index))
        return len(buffers) - 1

    def use(value, step):
        for v in _flat_tensors(value):
            if isinstance(v, torch.fx.Node):
                for bid in node_buffers.get(v.name, []):
                    if bid is not None:
                        last_use[bid] = max(last_use.get(bid, step), step)

    # make_fx records metadata of single tensors only: a multi-output op's outputs take the
    # metadata of the getitem nodes that unpack them (an output nobody unpacks has none: the
    # op's caller drops it at once, so it is not planned).
    unpacked: Dict[str, Dict[int, object]] = {}
    for node in nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            unpacked.setdefault(node.args[0].name, {})[node.args[1]] = node.meta.get("tensor_meta")
    metas_of: Dict[str, list] = {}
    # Values the trace alone decides (constants, and what deterministic ops make of them; not
    # the inputs, the parameters or a random draw), and the buffers of such values that an op
    # on other values wrote into after all. An op whose output shape depends on its
    # arguments' values is planned only when those values are decided here.
    decided: set = set()
    overwritten: set = set()
    written_buffers: set = set()  # buffers an op writes in place (through any view of them)
    state_of: Dict[str, int] = {}  # parameter or module buffer placeholders and their views -> position
    written_state: set = set()
    input_placeholders: List[str] = []  # the placeholders of the call's input leaves, in order
    constants_decided = True  # until an op on other values writes into a graph constant

    def is_decided(value) -> bool:
        return all(v.name in decided and not any(b in overwritten for b in node_buffers.get(v.name, []))
                   for v in _flat_tensors(value) if isinstance(v, torch.fx.Node))

    placeholders = 0
    for step, node in enumerate(nodes):
        meta = node.meta.get("tensor_meta")
        if node.op == "placeholder":
            if placeholders < n_state:
                node_buffers[node.name] = [None]  # a parameter or module buffer
                state_of[node.name] = placeholders
            else:
                node_buffers[node.name] = [new_buffer(node, 0, meta, "input", 0)]
                input_placeholders.append(node.name)
            placeholders += 1
        elif node.op == "get_attr":
            node_buffers[node.name] = [None]  # a constant the traced code made, held by the graph
            if constants_decided:
                decided.add(node.name)
        elif node.op == "call_function" and node.target is operator.getitem:
            # Unpacking one output uses that output's buffer alone: the others of a
            # multi-output op (a norm's mean and rstd, say) are free from their last use.
            source, index = node.args
            bid = node_buffers[source.name][index]
            node_buffers[node.name] = [bid]
            if source.name in state_of:  # one view of a list of views of a parameter
                state_of[node.name] = state_of[source.name]
            if bid is not None:
                last_use[bid] = max(last_use.get(bid, step), step)
            if source.name in decided:
                decided.add(node.name)
        elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            op = node.target
            tags = set(getattr(op, "tags", ()))
            args = _schema_args(op, node)
            known = torch.Tag.nondeterministic_seeded not in tags and is_decided(args)
            if (torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags) \
                    and not known and not _indexes_by_integers(op, node):
                raise UnsupportedGraph(f"unsupported op {op} (node {node.name}): its output depends on the "
                                       "input values, so a plan made for these inputs would not hold for others")
            ops[str(op)] = ops.get(str(op), 0) + 1
            for a, arg in zip(op._schema.arguments, args):
                if a.alias_info is not None and a.alias_info.is_write:
                    for v in _flat_tensors(arg):
                        if isinstance(v, torch.fx.Node):
                            written_buffers.update(b for b in node_buffers.get(v.name, []) if b is not None)
                            if v.name in state_of:
                                written_state.add(state_of[v.name])
            sources = _alias_sources(op)
            for a in args:
                use(a, step)
            returns_list = len(op._schema.returns) == 1 and str(op._schema.returns[0].type) == "List[Tensor]"
            if meta is None and node.name in unpacked:
                count = max(unpacked[node.name]) + 1 if returns_list else len(op._schema.returns)
                metas = [unpacked[node.name].get(i) for i in range(count)]
            else:
                metas = _metas(meta)
            metas_of[node.name] = metas
            out: List[Optional[int]] = []
            for i, r_meta in enumerate(metas):
                source = sources[0] if returns_list else (sources[i] if i < len(sources) else None)
                if source is not None:
                    arg = args[source]
                    if not isinstance(arg, torch.fx.Node):
                        raise UnsupportedGraph(f"{op} (node {node.name}) returns a view of a non-tensor argument")
                    if arg.name in state_of:
                        state_of[node.name] = state_of[arg.name]
                    bid = node_buffers[arg.name][0]
                    if bid is not None:
                        buffers[bid].aliases += 1
                    out.append(bid)
                elif r_meta is None:
                    out.append(None)
                else:
                    out.append(new_buffer(node, i, r_meta, "activation", step))
            node_buffers[node.name] = out
            if known:
                decided.add(node.name)
            else:  # what it writes into is no longer decided
                for a, arg in zip(op._schema.arguments, args):
                    if a.alias_info is None or not a.alias_info.is_write:
                        continue
                    for v in _flat_tensors(arg):
                        if isinstance(v, torch.fx.Node) and v.name in decided:
                            written = [b for b in node_buffers.get(v.name, []) if b is not None]
                            if written:
                                overwritten.update(written)
                            else:  # a graph constant, read again later through views or new get_attr
                                decided.clear()  # nodes, which cannot be told apart: none stays decided
                                constants_decided = False
        elif node.op == "call_function":
            raise UnsupportedGraph(f"unsupported op {node.target} (node {node.name}): not an aten operator")
        elif node.op == "output":
            for v in _flat_tensors(node.args[0]):
                if isinstance(v, torch.fx.Node):
                    for bid in node_buffers.get(v.name, []):
                        if bid is not None:
                            last_use[bid] = steps
                            if buffers[bid].kind == "activation":
                                buffers[bid].kind = "output"
        else:
            raise UnsupportedGraph(f"unsupported node {node.op} {node.target}")
    for b in buffers:
        if b.kind == "input":
            b.lower, b.upper = 0, steps + 1
        elif b.kind == "output":
            b.upper = steps + 1
        else:
            b.upper = max(b.lower + 1, last_use.get(b.id, b.lower) + 1)
    written_inputs = [k for k, name in enumerate(input_placeholders) if node_buffers[name][0] in written_buffers]
    return Graph(gm, buffers, steps + 1, training, param_bytes, n_state, node_buffers, ops, metas=metas_of,
                 written_inputs=written_inputs, written_state=sorted(written_state))


# ----------------------------------------------------------------------------- planning

def _eager_peak(module, inputs, training: bool, loss_fn) -> Tuple[int, str]:
    """Highest live bytes of CPU tensor memory during one eager call, and how it was measured:
    exactly, through PyTorch's allocator hook (``capture``) where tensormem was built with it;
    otherwise from torch.profiler's own memory events, one per CPU allocation and free, summed
    in the order they happened. (Not from its per-op figures: the profiler nests ops by their
    microsecond time ranges, and where a child op's range ends after its parent's, both are
    given the child's allocation, so sums over them ran high at random.)"""
    from torch.profiler import ProfilerActivity, profile

    def call():
        out = module(*inputs)
        if training:
            loss = loss_fn(out) if loss_fn else _default_loss(module, out)
            torch.autograd.grad(loss, [p for p in module.parameters() if p.requires_grad], allow_unused=True)

    def run():
        with _grad_mode_of(training):
            call()

    try:  # exact: every allocation and free through PyTorch's allocator hook
        hook = _hook()
    except RuntimeError:
        hook = None
    if hook is not None:
        hook.start_capture()
        try:
            run()
        finally:
            events = hook.stop_capture()
        return Capture(events).peak, "allocator hook"
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    return _profiler_peak(prof.profiler.kineto_results.events()), "torch.profiler memory events"


def _profiler_peak(events) -> int:
    """Highest sum of the CPU ``[memory]`` events' bytes (positive: an allocation, negative: a
    free), taken in time order; events of the same time keep the profiler's order, which is
    the order they were recorded in. An event's time is ``start_ns()`` where the profiler
    gives it (PyTorch 2), else ``start_us()`` (PyTorch 1, which has no other)."""
    deltas = sorted(((_event_start_ns(e), e.nbytes()) for e in events
                     if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU),
                    key=lambda d: d[0])
    return _highest_running_sum(delta for _time, delta in deltas)


def _children(spec) -> int:
    """How many children a pytree spec has: ``num_children`` where PyTorch has it (2.x, where
    ``children_specs`` is deprecated), else ``len(children_specs)`` (1.13)."""
    count = getattr(spec, "num_children", None)
    if callable(count):
        count = count()
    return count if isinstance(count, int) else len(spec.children_specs)


def _event_start_ns(event) -> int:
    start_ns = getattr(event, "start_ns", None)
    return start_ns() if start_ns is not None else event.start_us() * 1000


def _highest_running_sum(deltas) -> int:
    """The highest of 0 and the running sums of ``deltas`` (bytes allocated, or freed when
    negative), in their order: the peak of live bytes."""
    return max(itertools.accumulate(deltas, initial=0))


def _available_memory_bytes() -> int:
    """MemAvailable of /proc/meminfo (what new allocations can get without swapping), at most
    what this process's memory cgroup leaves (its limit less its usage, inactive file cache
    counted as free) and the memory this process can have at all."""
    memory = min(_tensormem.physical_memory_bytes(), _tensormem.cgroup_memory_available_bytes())
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return min(memory, int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    return memory


def _check_activations_fit(module, inputs, training: bool, loss_fn, alignment: int,
                           compare: bool) -> Tuple[Optional[Exception], Optional[Graph]]:
    """Raises MemoryError where the activations' lower bound exceeds the memory available
    (with ``compare``; without it, only traces). Returns the fake-tensor trace's error where
    there is no such trace, else its graph."""
    try:
        fake = _trace(module, inputs, training, loss_fn, "fake")
        need = _lower_bound_of(fake, alignment)
    except Exception as e:  # whatever fails on fake tensors only skips the check, never the plan
        return e, None
    if not compare:
        return None, fake
    available = _available_memory_bytes()
    if need > available:
        raise MemoryError(f"a plan of its activations needs at least {_gib(need)} (their lower bound, traced on fake "
                          f"tensors), more than the {_gib(available)} of memory available")
    return None, fake


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _online_best_fit(buffers: Sequence[Buffer], alignment: int) -> int:
    """High-water mark of tensormem's online best fit replaying the buffers in time order
    (frees before allocations at equal times)."""
    a = _tensormem.BestFitAllocator(alignment=alignment)
    events = []
    for b in buffers:
        events.append((b.lower, 1, b.id))
        events.append((b.upper, 0, b.id))
    live = {}
    for _t, is_alloc, bid in sorted(events):
        if is_alloc:
            live[bid] = a.allocate(max(buffers[bid].nbytes, 1))
        else:
            a.deallocate(live.pop(bid))
    return a.peak


@dataclass
class ModulePlan:
    graph: Graph
    offsets: np.ndarray
    arena_bytes: int
    lower_bound: int
    eager_peak: Optional[int]  # None where the call's tensors are not all on the CPU (see eager_method)
    eager_method: str
    online_best_fit: int
    plan_seconds: float
    alignment: int
    strategy: str
    moved_ops: int = 0  # ops of the last run that computed outside their slot and were copied in
    placed_buffers: int = 0  # buffers of the last run found at their planned offset in the arena
    # (name, tensor) of the module's parameters and buffers, in the order the trace took them
    state: Optional[Callable[[], list]] = field(default=None, repr=False)
    # devices other than the CPU that the traced call's tensors were on ("cuda:0", "meta"):
    # the plan holds, but the eager peak was not measured and ``run`` is refused
    elsewhere: List[str] = field(default_factory=list)
    # what the module's call is specialized on now (``_modes_of``), read by ``run``
    modes: Optional[Callable[[], list]] = field(default=None, repr=False)

    def report(self) -> str:
        """A readable table: eager peak, planned arena, lower bound, online best fit."""
        mib = 1 << 20

        def row(name, value, note=""):
            if value is None:
                return f"  {name:<28} {'n/a':>10}      {'':>7}       {note}\n"
            ratio = value / self.lower_bound if self.lower_bound else float("nan")
            return f"  {name:<28} {value / mib:10.2f} MiB  {ratio:7.3f} x LB  {note}\n"

        g = self.graph
        text = (f"{'training step' if g.training else 'inference'}: {len(g.buffers)} activation buffers over "
                f"{g.steps} graph steps; parameters and module buffers {g.param_bytes / mib:.2f} MiB (not planned)\n")
        text += row("eager PyTorch peak", self.eager_peak, f"({self.eager_method})")
        text += row("online best fit", self.online_best_fit, f"(alignment {self.alignment})")
        text += row("planned arena", self.arena_bytes, f"({self.strategy}, {self.plan_seconds:.2f} s)")
        text += row("lower bound", self.lower_bound, "(most bytes alive at one step)")
        if self.arena_bytes and self.eager_peak is not None:
            text += f"  eager peak / planned arena: {self.eager_peak / self.arena_bytes:.3f}\n"
        return text

    def run(self, *inputs):
        """Runs the traced graph with every activation in one arena tensor at its planned
        offset; returns the graph's outputs, copied out so the arena can be reused: each
        buffer they lie in is copied once, and outputs that share memory in an eager call (a
        tensor returned twice, a view of another output) share their copy the same way. An
        input, a parameter or a module buffer returned is the caller's tensor itself, and a
        view of one is the same view of it, as in an eager call, also of an input given with
        other strides than the traced one (transposed, sliced); a view that cannot follow
        such an input's strides (one that flattens dimensions its layout does not keep
        together) comes back as a copy. A plan traced with an input whose elements share
        memory (``expand``) refuses an input whose values differ there (``ValueError``).

        Takes the inputs as ``plan_module`` took them: tensors of the traced shapes and
        dtypes, nested in the same tuples, lists and dicts. An input that is not a tensor is a
        constant of the plan: the same value and type (a numpy array: the same dtype, shape
        and contents as when traced). Anything else raises ``ValueError`` naming the input
        (``1['scale']``: the key "scale" of the second input). Other objects are compared
        with ``==``; what changes inside them after the trace is not seen.

        Buffers the module changes in place (batch norm's running statistics) change as in an
        eager call. The graph is the traced call's: a run in other training modes, with
        other parameters requiring a gradient (a training step) or under another CPU
        autocast is refused (``ValueError``); numbers the forward reads from Python
        attributes (a dropout's ``p``, a batch norm's ``momentum``) are the traced values, so
        a change to one needs a new plan. A forward that replaces a buffer by a new tensor (``self.n = self.n + 1``)
        is refused (``UnsupportedGraph``): the traced graph computes the value but does not
        store it in the module."""
        return _planned_run(self, inputs)


def plan_module(module: torch.nn.Module, *inputs, training: bool = False, time_limit: float = 10.0,
                alignment: int = 64, loss_fn: Optional[Callable] = None, check_memory: bool = True) -> ModulePlan:
    """Traces ``module(*inputs)`` and plans its activations in one arena. The alignment and
    the time limit are checked before the trace (``ValueError``).

    The trace and the eager measurement run the model; its buffers (batch norm's running
    statistics), the input tensors it changes in place and the random number generators are
    put back afterwards, so planning leaves the model, the inputs and the next training step
    as they were. Parameters the forward writes in place (weight clipping, an embedding's
    ``max_norm``) are found by the trace on fake tensors of the memory check, copied and put
    back too; with ``check_memory=False``, or where that trace fails, they keep the writes of
    planning and a RuntimeWarning names them. With ``check_memory`` (the
    default), a call whose plan could not fit in the memory available now (the lower bound of
    ``activation_lower_bound``, about a second on fake tensors, above /proc/meminfo's
    MemAvailable) raises MemoryError before the model runs, where running it would be ended
    by the kernel's out-of-memory killer. Eager PyTorch may need a little less than that
    bound (resnet18 at batch 3,000: 0.914 of it); ``check_memory=False`` runs the call
    anyway. Where the fake-tensor trace fails and the real one works, the check is skipped
    with a RuntimeWarning."""
    alignment = operator.index(alignment)
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, not {alignment}")
    if not (isinstance(time_limit, (int, float)) and time_limit >= 0):
        raise ValueError(f"time_limit must be a number of seconds >= 0, not {time_limit!r}")
    _require_module(module)
    with _module_state_kept(module):
        return _plan_module(module, inputs, training, time_limit, alignment, loss_fn, check_memory)


def _plan_module(module: torch.nn.Module, inputs: tuple, training: bool, time_limit: float, alignment: int,
                 loss_fn: Optional[Callable], check_memory: bool) -> ModulePlan:
    elsewhere = _devices_besides_cpu(module, inputs)
    unchecked, fake = _check_activations_fit(module, inputs, training, loss_fn, alignment, not elsewhere) \
        if check_memory else (None, None)
    with _writes_kept(module, inputs, fake, "planning (a trace and an eager measurement)", 5) as real:
        return _plan_traced(module, inputs, training, time_limit, alignment, loss_fn, unchecked, real, elsewhere,
                            check_memory)


def _devices_besides_cpu(module: torch.nn.Module, inputs: tuple) -> List[str]:
    """The devices other than the CPU that the parameters, module buffers and tensor inputs
    are on ("cuda:0", "meta"), sorted."""
    tensors = [*module.parameters(), *module.buffers(),
               *(t for t in tree_flatten(list(inputs))[0] if isinstance(t, torch.Tensor))]
    return sorted({str(t.device) for t in tensors if t.device.type != "cpu"})


def _plan_traced(module: torch.nn.Module, inputs: tuple, training: bool, time_limit: float, alignment: int,
                 loss_fn: Optional[Callable], unchecked: Optional[Exception], real: List[Graph], elsewhere: List[str],
                 check_memory: bool) -> ModulePlan:
    g = _trace(module, inputs, training, loss_fn, "real")
    real.append(g)
    import warnings
    if elsewhere and check_memory:
        warnings.warn(f"memory check skipped: tensors on {', '.join(elsewhere)}, and the check knows this "
                      "machine's memory only", RuntimeWarning, stacklevel=4)
    elif unchecked is not None:  # said once the real trace worked (where it fails too, its error says why)
        reason = (str(unchecked).splitlines() or [""])[0][:200]  # (some name a whole tensor)
        warnings.warn(f"memory check skipped: no trace on fake tensors ({reason})", RuntimeWarning, stacklevel=4)
    lower, upper, size = g.arrays()
    t0 = time.perf_counter()
    r = _tensormem.plan(lower, upper, size, time_limit=time_limit, alignment=alignment)
    seconds = time.perf_counter() - t0
    problem = _tensormem.validate(lower, upper, size, r["offsets"], r["arena_bytes"], alignment)
    if problem:
        raise RuntimeError(f"the planner produced an invalid plan: {problem}")
    if elsewhere:  # (the hook and the profiler's events see the CPU's memory only)
        eager_peak, eager_method = None, f"not measured: tensors on {', '.join(elsewhere)}, and it is measured " \
                                         "in CPU memory only"
    else:
        eager_peak, eager_method = _eager_peak(module, inputs, training, loss_fn)
    return ModulePlan(g, np.asarray(r["offsets"]), int(r["arena_bytes"]), int(r["lower_bound"]),
                      eager_peak, eager_method, _online_best_fit(g.buffers, alignment),
                      seconds, alignment, r["strategy"],
                      state=lambda: [*dict(module.named_parameters()).items(), *dict(module.named_buffers()).items()],
                      elsewhere=elsewhere, modes=lambda: _modes_of(module, training))


# ----------------------------------------------------------------------------- planned execution

def _out_overload(op):
    """The ``out=`` overload of ``op`` taking the same arguments plus one ``out``, or None."""
    packet = op.overloadpacket
    if "out" not in packet.overloads():
        return None
    candidate = packet.out
    names = [a.name for a in candidate._schema.arguments]
    if names != [a.name for a in op._schema.arguments] + ["out"]:
        return None
    return candidate


def _planned_run(plan: ModulePlan, inputs):
    g = plan.graph
    if plan.state is None:
        raise RuntimeError("ModulePlan.run needs the module's parameters: make the plan with plan_module()")
    if plan.elsewhere:
        raise ValueError(f"ModulePlan.run runs the graph in an arena in CPU memory; the plan was made for tensors on "
                         f"{', '.join(plan.elsewhere)}: plan the model and inputs on the CPU to run it")
    if g.reassigned_buffers:
        name = g.reassigned_buffers[0]
        raise UnsupportedGraph(f"ModulePlan.run: the module's forward replaces its buffer {name} by a new tensor "
                               f"(self.{name.rpartition('.')[2]} = ...), which the traced graph does not do, so a "
                               "planned run would leave the module behind an eager call; change the buffer in place "
                               "(add_, copy_) and plan again")
    if plan.modes is not None:
        _check_modes(plan)
    # Detached: the graph holds the backward ops itself, so nothing is to be recorded.
    named_state = plan.state()
    module_state = [t.detach() for _, t in named_state]
    placeholders = [n for n in g.module.graph.nodes if n.op == "placeholder"]
    # The module may have changed since it was planned: its parameters and buffers are read
    # now, and a kernel given another shape writes past its slot (PyTorch resizes the output).
    if len(module_state) != g.n_state:
        raise ValueError(f"ModulePlan.run: the module now has {len(module_state)} parameters and buffers, "
                         f"the plan was made for {g.n_state}; plan it again")
    for (name, t), node in zip(named_state, placeholders):
        meta = node.meta.get("tensor_meta")
        if meta is not None and (tuple(t.shape) != tuple(meta.shape) or t.dtype != meta.dtype):
            raise ValueError(f"ModulePlan.run: the module's {name} is now {tuple(t.shape)} {t.dtype}; the plan "
                             f"was made for {tuple(meta.shape)} {meta.dtype}; plan it again")
    traced_inputs = _children(g.in_spec) if g.in_spec is not None else len(placeholders) - g.n_state
    if len(inputs) != traced_inputs:
        raise ValueError(f"ModulePlan.run: {len(inputs)} inputs given, the traced call had {traced_inputs}")
    # The graph takes the inputs' leaves: tuples, lists and dicts are taken apart as the trace did.
    leaves, spec = tree_flatten(list(inputs))
    if g.in_spec is not None and spec != g.in_spec:
        raise ValueError(f"ModulePlan.run: the inputs are nested otherwise than in the traced call (tuples, lists, "
                         f"dicts and their keys): given {', '.join(_leaf_names(list(inputs), len(leaves)))}; "
                         f"the plan was made for {', '.join(g.input_names)}")
    inputs = leaves
    _check_input_sharing(g, inputs, named_state)
    misplaced = _misaligned_buffer(plan)
    if misplaced is not None:
        b, element, widest = misplaced
        raise ValueError(f"ModulePlan.run: buffer {b.name} holds {element}-byte elements but starts at byte "
                         f"{int(plan.offsets[b.id])} of the arena (alignment {plan.alignment}); plan with an "
                         f"alignment of {widest} or more to run it")
    arena = torch.empty(max(plan.arena_bytes, 1), dtype=torch.uint8)
    env: Dict[str, object] = {}
    moved = 0

    def slot(bid: int, meta) -> torch.Tensor:
        nbytes = g.buffers[bid].nbytes
        if nbytes == 0:
            return torch.empty(tuple(meta.shape), dtype=meta.dtype)
        raw = arena.narrow(0, int(plan.offsets[bid]), nbytes)
        return raw.view(meta.dtype).as_strided(tuple(meta.shape), tuple(meta.stride))

    def value(a):
        if isinstance(a, torch.fx.Node):
            return env[a.name]
        if isinstance(a, (list, tuple)):
            return type(a)(value(v) for v in a)
        return a

    placed = 0

    def check_placed(node_name: str):
        """Every buffer the node created sits at its planned offset in the arena."""
        nonlocal placed
        value = env[node_name]
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        for i, bid in enumerate(g.node_buffers[node_name]):
            if bid is None or g.buffers[bid].node != node_name or g.buffers[bid].nbytes == 0:
                continue
            if values[i].data_ptr() != arena.data_ptr() + int(plan.offsets[bid]):
                raise RuntimeError(f"buffer {g.buffers[bid].name} is not at its planned offset")
            placed += 1

    copies: Dict[int, torch.Tensor] = {}  # buffer -> its bytes copied out of the arena
    given: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # an input's buffer -> (caller's tensor, its slot)
    state_storages = {storage_of(t).data_ptr() for t in module_state if t.numel()}
    state_of = {id(d): t for d, (_, t) in zip(module_state, named_state)}

    def out_copy(arg, v):
        """The graph's outputs out of the arena: each activation buffer they lie in copied once,
        every output a view of its buffer's copy as it was of the slot, so outputs that share
        memory in an eager call (a tensor returned twice, a view of another output) share it
        here. An input returned (or a view of it) is the caller's tensor (a view of it), and a
        parameter or module buffer returned (or a view of it) is a view of the module's own,
        as in an eager call; anything else (a constant of the graph) a tensor of its own."""
        if isinstance(v, (list, tuple)) and isinstance(arg, (list, tuple)):
            return type(v)(out_copy(a, x) for a, x in zip(arg, v))
        if not isinstance(v, torch.Tensor):
            return v
        bids = g.node_buffers.get(arg.name, []) if isinstance(arg, torch.fx.Node) else []
        bid = bids[0] if len(bids) == 1 else None
        element = v.element_size()
        if bid in given:
            shared = _same_view_of(v, *given[bid])
            return v.clone() if shared is None else shared
        if v.numel() and storage_of(v).data_ptr() in state_storages:
            # the module's own tensor where returned whole; else a view of it (module_state's
            # tensors are the module's, detached)
            return state_of.get(id(v), v)
        if bid is None or g.buffers[bid].kind == "input" or not v.numel() or \
                v.data_ptr() - v.storage_offset() * element != arena.data_ptr():  # (not a view of the arena)
            return v.clone()
        start = int(plan.offsets[bid])
        if bid not in copies:
            copies[bid] = arena.narrow(0, start, g.buffers[bid].nbytes).clone()
        first = v.storage_offset() * element - start  # bytes from the buffer's start
        if first < 0 or first % element or copies[bid].numel() % element:
            return v.clone()
        return copies[bid].view(v.dtype).as_strided(tuple(v.shape), tuple(v.stride()), first // element)

    placeholder_index = 0
    written_back: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (caller's input, its slot)
    # Grad mode as when the graph was traced: some kernels read it, not their arguments (in
    # PyTorch 2.x the oneDNN LSTM layer makes the workspace its backward takes only while
    # gradients are enabled, and returns none otherwise). Nothing is recorded either way: no
    # tensor of the run requires a gradient.
    with torch.set_grad_enabled(g.training):
        for node in g.module.graph.nodes:
            meta = node.meta.get("tensor_meta")
            if node.op == "placeholder":
                if placeholder_index < g.n_state:
                    env[node.name] = module_state[placeholder_index]
                else:
                    k = placeholder_index - g.n_state
                    x = inputs[k]
                    name = g.input_names[k] if k < len(g.input_names) else str(k)
                    if k in g.constant_inputs:  # not a tensor: the graph holds the traced value
                        if not _same_constant(x, g.constant_inputs[k]):
                            raise ValueError(f"ModulePlan.run: input {name} is {x!r}; the plan was made for "
                                             f"{g.constant_inputs[k]!r}, which the trace took as a constant: "
                                             f"plan again for another value")
                        env[node.name] = x
                        placeholder_index += 1
                        continue
                    if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(meta.shape) or x.dtype != meta.dtype:
                        got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
                        raise ValueError(f"ModulePlan.run: input {name} is {got}; the plan was made for "
                                         f"{tuple(meta.shape)} {meta.dtype}")
                    dst = slot(g.node_buffers[node.name][0], meta)
                    _copy_into_slot(dst, x.detach(), name)
                    given[g.node_buffers[node.name][0]] = (x, dst)
                    env[node.name] = dst
                    check_placed(node.name)
                    if k in g.written_inputs:
                        written_back.append((x, dst))
                placeholder_index += 1
            elif node.op == "get_attr":
                constant = _graph_constant(g.module, node.target)
                env[node.name] = constant.detach() if isinstance(constant, torch.Tensor) else constant
            elif node.op == "call_function" and node.target is operator.getitem:
                env[node.name] = env[node.args[0].name][node.args[1]]
            elif node.op == "call_function":
                op = node.target
                args = [value(a) for a in node.args]
                kwargs = {k: value(v) for k, v in node.kwargs.items()}
                if op in _STORAGE_OFFSET_OPS:
                    _offset_into_slot(node, args, kwargs, g, plan.offsets)
                created = [(i, bid) for i, bid in enumerate(g.node_buffers[node.name])
                           if bid is not None and g.buffers[bid].node == node.name]
                if not created:  # views and in-place ops run on the arena's tensors directly
                    env[node.name] = op(*args, **kwargs)
                    continue
                metas = g.metas[node.name]
                single = len(op._schema.returns) == 1 and str(op._schema.returns[0].type) == "Tensor"
                meta = metas[0] if single else None
                out_op = _out_overload(op) if single else None
                if out_op is not None:
                    dst = slot(created[0][1], meta)
                    result = out_op(*args, **kwargs, out=dst)
                    if dst.numel() and result.data_ptr() != dst.data_ptr():
                        dst.copy_(result)
                        moved += 1
                    env[node.name] = dst
                    check_placed(node.name)
                    continue
                result = op(*args, **kwargs)  # no out= variant: compute, then move into the slot
                moved += 1
                if single:
                    dst = slot(created[0][1], meta)
                    dst.copy_(result)
                    env[node.name] = dst
                else:
                    placed_values = list(result)
                    for i, bid in created:
                        if not isinstance(result[i], torch.Tensor):
                            raise RuntimeError(f"ModulePlan.run: {op} (node {node.name}) returned no tensor as "
                                               f"output {i}, where the traced run made one")
                        dst = slot(bid, metas[i])
                        dst.copy_(result[i])
                        placed_values[i] = dst
                    env[node.name] = tuple(placed_values) if isinstance(result, tuple) else placed_values
                check_placed(node.name)
            elif node.op == "output":
                plan.moved_ops = moved
                plan.placed_buffers = placed
                result = _unflatten(g, out_copy(node.args[0], value(node.args[0])))
                for x, dst in written_back:  # what the graph wrote into an input, as in an eager call
                    with torch.inference_mode() if x.is_inference() else torch.no_grad():
                        x.copy_(dst)
                return result
    raise RuntimeError("the traced graph has no output")


# Ops whose `storage_offset` argument counts elements from the start of their input's
# storage: in the traced run that storage was the input's buffer alone, in a planned run it
# is the whole arena.
_STORAGE_OFFSET_OPS = (torch.ops.aten.as_strided.default, torch.ops.aten.as_strided_.default)


def _offset_into_slot(node: torch.fx.Node, args: list, kwargs: dict, g: Graph, offsets) -> None:
    """Moves an explicit storage offset of ``node`` (an op of _STORAGE_OFFSET_OPS) from its
    input buffer's own storage to that buffer's slot in the arena."""
    source = node.args[0]
    bid = g.node_buffers[source.name][0] if isinstance(source, torch.fx.Node) else None
    if bid is None:  # a parameter, a module buffer or a constant: its own storage, as traced
        return
    element = args[0].element_size()
    start = int(offsets[bid])  # a whole number of elements: checked before the run starts
    if "storage_offset" in kwargs and kwargs["storage_offset"] is not None:
        kwargs["storage_offset"] += start // element
    elif len(args) > 3 and args[3] is not None:
        args[3] += start // element


def _misaligned_buffer(plan: ModulePlan) -> Optional[Tuple[Buffer, int, int]]:
    """The first buffer whose planned offset is not a whole number of its elements (a tensor
    cannot start there), with its element size and the widest element of the graph; None
    when every buffer can be placed."""
    g = plan.graph
    first, widest = None, 1
    for node in g.module.graph.nodes:
        metas = [node.meta.get("tensor_meta")] if node.op == "placeholder" else g.metas.get(node.name)
        for i, bid in enumerate(g.node_buffers.get(node.name, []) if metas else []):
            if bid is None or g.buffers[bid].node != node.name or i >= len(metas) or metas[i] is None:
                continue
            element = torch.empty((), dtype=metas[i].dtype).element_size()
            widest = max(widest, element)
            if first is None and g.buffers[bid].nbytes and int(plan.offsets[bid]) % element:
                first = (g.buffers[bid], element)
    return None if first is None else (*first, widest)


def _check_input_sharing(g: Graph, inputs: list, named_state: list) -> None:
    """Refuses (``ValueError``) inputs whose sharing of memory, among themselves or with the
    module's parameters and buffers, the traced graph cannot replay: tensors that were one
    tensor when traced and are not now (the graph reads both from one of them), and, where
    the graph writes an input or the module's state in place, inputs that share memory in
    the traced call or now (the graph reads each input from a copy of its own, so a write
    through one is not seen through the other, as it is in an eager call)."""
    same_now, shared_now = _input_sharing(inputs, [t for _, t in named_state])
    names, count = g.input_names, len(inputs)

    def name(k: int) -> str:
        if k >= count:
            return f"the module's {named_state[k - count][0]}"
        return f"input {names[k] if k < len(names) else k}"
    for i, j in g.same_inputs:
        if (i, j) not in same_now:
            raise ValueError(f"ModulePlan.run: {name(i)} and {name(j)} were one tensor in the traced call, and the "
                             f"graph reads both from one of them: give one tensor for both, as then, or plan with "
                             f"tensors of their own")
    if not g.written_inputs and not g.written_state:
        return
    written = name(g.written_inputs[0]) if g.written_inputs else name(count + g.written_state[0])
    for when, pairs, remedy in (
            ("in the traced call", g.shared_inputs, "plan with tensors of their own (clone)"),
            ("here", shared_now + [p for p in same_now if p not in g.same_inputs],
             "give tensors of their own (clone), or plan with one tensor given for both")):
        if pairs:
            i, j = pairs[0]
            raise ValueError(f"ModulePlan.run: {name(i)} and {name(j)} share memory {when}, and the forward "
                             f"writes {written} in place: the graph reads each input from a copy of its own, so a "
                             f"write through one would not be seen through the other as in an eager call; {remedy}")


def _copy_into_slot(slot: torch.Tensor, x: torch.Tensor, name: str) -> None:
    """``slot`` <- ``x``, an input of the slot's shape and dtype. A slot laid out as an input
    traced with elements that share memory (``expand``, an overlapping ``as_strided``) holds
    fewer numbers than it has elements: ``x`` goes in element by element (copy_ refuses such
    a destination), and an ``x`` whose elements differ where the slot's share memory is
    refused (``ValueError``), where the run would otherwise compute with other values than
    ``x``'s."""
    if torch._debug_has_internal_overlap(slot) == 0:  # (0: no overlap; 1: overlap; 2: cannot tell)
        slot.copy_(x)
        return
    if not slot.numel():
        return
    span = _span_elements(slot.shape, slot.stride())
    memory = slot.as_strided((span,), (1,), slot.storage_offset())
    where = torch.arange(span).as_strided(tuple(slot.shape), tuple(slot.stride()), 0)
    memory[where.reshape(-1)] = x.reshape(-1)  # (elements that share memory: one of them written, checked below)
    if not torch.equal(slot, x):
        raise ValueError(f"ModulePlan.run: input {name} has different values in elements that share memory in the "
                         f"input the plan was traced with (strides {tuple(slot.stride())}: expanded or overlapping), "
                         f"which cannot hold them: plan again with a tensor of its own (x.contiguous()) or give an "
                         f"input laid out as that one")


def _same_view_of(v: torch.Tensor, caller: torch.Tensor, slot: torch.Tensor) -> Optional[torch.Tensor]:
    """``v``, a view of ``slot`` (the copy of the caller's input in the arena), as the same
    view of the caller's tensor: the caller's tensor itself where ``v`` is the whole slot.
    None where that view cannot be made: no elements, a view into another dtype that the
    caller's layout does not allow, or, where the caller's tensor is strided otherwise than
    the slot (laid out as the traced input), a view that walks across the slot's dimensions
    in a way the caller's strides cannot follow (``_restrided_view_of``)."""
    if v.data_ptr() == slot.data_ptr() and v.dtype == slot.dtype and tuple(v.shape) == tuple(slot.shape) \
            and tuple(v.stride()) == tuple(slot.stride()):
        return caller
    if not v.numel() or caller.dtype != slot.dtype:
        return None
    if tuple(caller.stride()) != tuple(slot.stride()):
        return _restrided_view_of(v, caller, slot)
    distance, element = v.data_ptr() - slot.data_ptr(), v.element_size()
    if distance % element:  # (torch's dtype views keep whole elements; kept against a wrong as_strided)
        return None
    try:
        base = caller.detach() if v.dtype == caller.dtype else caller.detach().view(v.dtype)
        return base.as_strided(tuple(v.shape), tuple(v.stride()), base.storage_offset() + distance // element)
    except RuntimeError:  # (a dtype view the layout refuses, or past the caller's storage)
        return None


def _restrided_view_of(v: torch.Tensor, caller: torch.Tensor, slot: torch.Tensor) -> Optional[torch.Tensor]:
    """``v``, a view of ``slot``, as the same view of ``caller``, a tensor of the slot's shape
    and dtype laid out with other strides (a transposed or sliced input where the trace had
    another layout). The slot's elements do not overlap (its strides, from the largest, each
    at least the next one's span), so an element's distance from the slot's first is a
    number whose digits, in the slot's dimensions from the outermost, are that element's
    index. Dimensions that both tensors keep together (a stride is the next one's times that
    one's size) are one digit, as PyTorch merges them for a ``view``. Where ``v``'s first
    element and each of its strides are such digits, and walking ``v`` to its last element
    along every dimension adds them without a carry, ``v`` takes the same steps in the
    caller's tensor: its strides there are the digits weighed by the caller's strides. A
    view that carries (one that flattens dimensions the caller's layout does not keep
    together) has no such form: None, and the run returns a copy, as a reshape of that
    tensor does. Only dtypes of the slot's element size (an eager call's ``view(dtype)``
    keeps the strides there); a dimension of one element keeps ``v``'s stride."""
    if v.element_size() != slot.element_size():
        return None
    dims = sorted((k for k in range(slot.dim()) if slot.shape[k] > 1), key=lambda k: -slot.stride(k))
    # digits: [the slot's stride, size, the caller's stride] of each, from the outermost
    groups: List[List[int]] = []
    for k in dims:
        stride, size, theirs = slot.stride(k), slot.shape[k], caller.stride(k)
        if groups and groups[-1][0] < stride * size:  # (overlapping elements: no digits)
            return None
        if groups and groups[-1][0] == stride * size and groups[-1][2] == theirs * size:
            groups[-1] = [stride, groups[-1][1] * size, theirs]
        else:
            groups.append([stride, size, theirs])
    if groups and groups[-1][0] < 1:
        return None

    def digits(n: int) -> Optional[List[int]]:
        if n < 0:
            return None
        out = []
        for stride, _, _ in groups:
            d, n = divmod(n, stride)
            out.append(d)
        return out if n == 0 else None

    def caller_steps(ds: List[int]) -> int:
        return sum(d * g[2] for d, g in zip(ds, groups))

    element = v.element_size()
    distance = v.data_ptr() - slot.data_ptr()
    first = digits(distance // element) if distance % element == 0 else None
    if first is None:
        return None
    reach = list(first)  # the digits of v's last element, with no carry
    strides = []
    for size, stride in zip(v.shape, v.stride()):
        step = digits(stride) if stride else [0] * len(groups)
        if size == 1 or step is None:
            if size > 1:
                return None
            strides.append(stride)  # (never stepped)
            continue
        reach = [r + (size - 1) * d for r, d in zip(reach, step)]
        strides.append(caller_steps(step))
    if any(r >= g[1] for r, g in zip(reach, groups)):
        return None
    try:
        base = caller.detach() if v.dtype == caller.dtype else caller.detach().view(v.dtype)
        return base.as_strided(tuple(v.shape), tuple(strides), caller.storage_offset() + caller_steps(first))
    except RuntimeError:  # (a dtype view the layout refuses)
        return None


def _graph_constant(gm: torch.fx.GraphModule, target: str):
    """The tensor a get_attr node names (``a.b`` walks submodules)."""
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _unflatten(g: Graph, out):
    """The graph's flat outputs in the structure the traced call returned."""
    leaves = tree_flatten(list(out) if isinstance(out, (list, tuple)) else [out])[0]
    return tree_unflatten(leaves, g.out_spec) if g.out_spec is not None else out


# ----------------------------------------------------------------------------- command line

def _refuse_beyond_memory(what: str, nbytes: int) -> None:
    """Before building anything: sizes whose parameters and inputs alone exceed the machine
    (``--layers 1000000000`` built layers until memory ran out)."""
    physical = _tensormem.physical_memory_bytes()
    if nbytes > physical:
        raise SystemExit(f"{what}: its parameters and inputs alone need {nbytes / 2**30:.1f} GiB, more than this "
                         f"machine's {physical / 2**30:.1f} GiB of memory")


def _example_model(name: str, batch: int, sequence: int, layers: int):
    """A torchvision model by name (random weights) and its inputs: a batch of 224 x 224
    images, of 16-frame clips for video models, of image pairs for optical flow; or "gpt": a
    GPT-style stack of pre-norm transformer blocks (hidden 768, 12 heads) over token ids."""
    if name == "gpt":
        # float32 parameters: embedding and head, and per block attention (4 x 768^2), MLP
        # (8 x 768^2) and their biases and norms; int64 token ids.
        _refuse_beyond_memory(f"gpt with {layers} layers, batch {batch}, sequence {sequence}",
                              4 * (2 * 50257 * 768 + layers * (12 * 768 * 768 + 13 * 768)) + 8 * batch * sequence)
        class GPT(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = torch.nn.Embedding(50257, 768)
                layer = torch.nn.TransformerEncoderLayer(768, 12, 3072, dropout=0.0, activation="gelu",
                                                         batch_first=True, norm_first=True)
                self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
                self.head = torch.nn.Linear(768, 50257, bias=False)

            def forward(self, ids):
                return self.head(self.blocks(self.embed(ids)))
        return GPT().eval(), (torch.randint(0, 50257, (batch, sequence)),)
    import inspect

    import torchvision
    try:
        builder = torchvision.models.get_model_builder(name)
    except (KeyError, ValueError, AttributeError) as e:
        raise SystemExit(f"unknown model '{name}': a torchvision model name (resnet50, vit_b_16...) or gpt") from e
    # Random weights, never a download: segmentation and detection builders otherwise fetch a
    # pretrained backbone even with weights=None.
    kwargs = {"weights": None}
    if "weights_backbone" in inspect.signature(builder).parameters:
        kwargs["weights_backbone"] = None
    if ".video." in builder.__module__:  # a clip of 16 frames (MViT's fixed input size)
        shapes = [(batch, 3, 16, 224, 224)]
    elif ".optical_flow." in builder.__module__:  # the flow between two frames
        shapes = [(batch, 3, 224, 224)] * 2
    else:
        shapes = [(batch, 3, 224, 224)]
    _refuse_beyond_memory(f"{name} at batch {batch}", sum(4 * math.prod(shape) for shape in shapes))
    return builder(**kwargs).eval(), tuple(torch.randn(shape) for shape in shapes)


def _positive_int(text: str) -> int:
    import argparse
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, not '{text[:40]}'")
    return value


def _seconds(text: str) -> float:
    import argparse
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0:  # also NaN
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, not '{text[:40]}'")
    return value


def _output_path(text: str) -> str:
    """An output file named on the command line: refused before any work when its folder is
    missing or not writable, or when it names a folder; a failure when it is written later
    (a full disk) still leaves the printed report."""
    import argparse
    if not text or "\0" in text:
        raise argparse.ArgumentTypeError("an empty path" if not text else f"the path {text!r} holds a NUL byte")
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"'{text}' is a folder")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write '{text}': the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write '{text}': permission denied")
    return text


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.dtype != y.dtype or x.shape != y.shape or x.layout != y.layout:
        return False
    if x.is_quantized:  # (a quantized tensor viewed as integers crashes PyTorch 1.13)
        return x.qscheme() == y.qscheme() and _same_bits(x.int_repr(), y.int_repr()) and \
            _same_bits(x.dequantize(), y.dequantize())
    if x.layout != torch.strided:  # sparse
        return _same_bits(x.to_dense(), y.to_dense())
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}
    flat_x, flat_y = x.detach().reshape(-1), y.detach().reshape(-1)
    # Bits, not values: -0.0 and 0.0 differ, a NaN equals the same NaN.
    return torch.equal(flat_x.view(as_int[x.element_size()]), flat_y.view(as_int[y.element_size()]))


def _tensor_pairs(a, b) -> Optional[List[Tuple[torch.Tensor, torch.Tensor]]]:
    """The tensors of ``a`` and ``b`` in pairs, leaf by leaf, when both have the same
    structure (tuples, lists and dicts) and equal leaves that are not tensors; else None."""
    leaves_a, shape_a = tree_flatten(a)
    leaves_b, shape_b = tree_flatten(b)
    if shape_a != shape_b:
        return None
    pairs = []
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            pairs.append((x, y))
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor) or x != y:
            return None
    return pairs


def _bitwise_equal(a, b) -> bool:
    """The same structure (tensor, or tuples, lists and dicts of them) with bitwise equal
    tensors and equal other leaves."""
    pairs = _tensor_pairs(a, b)
    return pairs is not None and all(_same_bits(x, y) for x, y in pairs)


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python3 -m tensormem.torch",
                                     description="Plan the activations of a PyTorch model in one arena.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="trace a model, plan it, print the report")
    p.add_argument("model", help="torchvision model name (resnet50, mobilenet_v3_large, vit_b_16...) or gpt")
    p.add_argument("--batch", type=_positive_int, default=1)
    p.add_argument("--training", action="store_true",
                   help="a training step of the model in training mode: forward, loss, backward")
    p.add_argument("--time-limit", type=_seconds, default=2.0, help="planner search budget, seconds (default 2)")
    p.add_argument("--sequence", type=_positive_int, default=128, help="gpt: tokens per sequence (default 128)")
    p.add_argument("--layers", type=_positive_int, default=12, help="gpt: transformer blocks (default 12)")
    p.add_argument("--svg", type=_output_path,
                   help="draw the plan: SVG, or an interactive page if the name ends in .html")
    p.add_argument("--trace", type=_output_path, help="write the buffers as a trace CSV (for tensormem plan / replay)")
    p.add_argument("--run", action="store_true",
                   help="also run the plan and compare with eager PyTorch (the output; with --training, the loss "
                        "and gradients); exit 1 when they differ")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model, inputs = _example_model(args.model, args.batch, args.sequence, args.layers)
    model.train(args.training)  # a training step with dropout's masks and batch norm's batch statistics
    t0 = time.perf_counter()
    try:
        plan = plan_module(model, *inputs, training=args.training, time_limit=args.time_limit)
    except UnsupportedGraph as e:  # e.g. a detection model's data-dependent control flow
        hint = ""
        if args.training and args.batch == 1 and "more than 1 value per channel when training" in str(e):
            hint = " (batch norm in training mode needs 2 or more values per channel: try --batch 2)"
        print(f"{parser.prog}: {args.model}: {e}{hint}", file=sys.stderr)
        return 1
    except MemoryError as e:  # refused before the model ran
        smaller = (["--batch"] if args.batch > 1 else []) + (["--sequence", "--layers"] if args.model == "gpt" else [])
        hint = f"; try a smaller {' or '.join(smaller)}" if smaller else ""
        print(f"{parser.prog}: {args.model} at batch {args.batch}: {e}{hint}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - t0
    print(f"{args.model}, batch {args.batch}: traced, measured and planned in {seconds:.1f} s")
    print(plan.report(), end="")
    try:
        if args.trace:
            plan.graph.to_trace(args.trace)
        if args.svg:
            lower, upper, size = plan.graph.arrays()
            _tensormem.write_plan_picture(args.svg, lower, upper, size, plan.offsets.astype(np.uint64),
                                          plan.arena_bytes, plan.lower_bound, f"{args.model} batch {args.batch}",
                                          [b.name for b in plan.graph.buffers])
    except OSError as e:  # an unwritable path: the report above stands
        print(f"{parser.prog}: {e}", file=sys.stderr)
        return 1
    if args.run:
        rng = torch.get_rng_state()
        out = plan.run(*inputs)
        torch.set_rng_state(rng)  # dropout and stochastic depth draw the same numbers in the eager call
        if args.training:  # the loss and the gradients, as the traced step returns them
            loss = _default_loss(model, model(*inputs))
            grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad], allow_unused=True)
            ref = (loss, [g for g in grads if g is not None])
        else:
            with torch.no_grad():
                ref = model(*inputs)
        what = "loss and gradients" if args.training else "output"
        if _bitwise_equal(out, ref):
            same = "bitwise equal to eager PyTorch's"
        else:
            difference = _largest_difference(out, ref)
            same = ("DIFFERENT from eager PyTorch's" if difference is None else
                    f"equal to eager PyTorch's within {difference:.1e} of the largest value (rounding)")
        print(f"planned run: {plan.placed_buffers} buffers at their offsets, {plan.moved_ops} ops moved into "
              f"their slot; {what} {same}")
        if same.startswith("DIFFERENT"):
            print(f"{parser.prog}: {args.model}: the planned run's {what} "
                  f"{'differ' if args.training else 'differs'} from eager PyTorch's", file=sys.stderr)
            return 1
    return 0


def _largest_difference(a, b) -> Optional[float]:
    """The largest difference between the floating-point tensors of ``a`` and ``b``, relative
    to the largest magnitude among all those of ``b``, when it is below 1e-4 (rounding: sums
    taken in another order, a kernel decomposed; a gradient that nearly cancels can differ by
    more than its own size), or None when it is above, or when they differ in structure,
    dtype, shape, where NaNs are, integer values or other leaves. Memory that two buffers of
    a wrong plan shared would change values by far more."""
    pairs = _tensor_pairs(a, b)
    if pairs is None:
        return None
    difference = scale = 0.0
    for x, y in pairs:
        if x.dtype != y.dtype or x.shape != y.shape:
            return None
        if not x.is_floating_point():  # integers, booleans: equal or not
            if not _same_bits(x, y):
                return None
            continue
        if not x.numel():
            continue
        if not torch.equal(x.isnan(), y.isnan()):
            return None
        scale = max(scale, y.nan_to_num(0.0).abs().max().item())
        difference = max(difference, (x - y).nan_to_num(0.0).abs().max().item())
    relative = difference / scale if scale > 0 else (0.0 if difference == 0 else math.inf)
    return relative if relative <= 1e-4 else None


# ----------------------------------------------------------------------------- capture

class Capture:
    """What an eager call allocated: one buffer per CPU tensor allocation, in the order
    PyTorch's allocator saw them (time = the index of the event); a buffer still alive when
    the call returned lives to the end."""

    def __init__(self, events):
        self.events = len(events)
        starts, self.lower, self.upper, self.size = {}, [], [], []
        for t, (ident, nbytes, is_alloc) in enumerate(events):
            if is_alloc:
                starts[ident] = (len(self.lower), t)
                self.lower.append(t)
                self.upper.append(len(events))
                self.size.append(int(nbytes))
            elif ident in starts:
                self.upper[starts[ident][0]] = t
        # the eager call's highest live bytes, exactly
        self.peak = _highest_running_sum(nbytes if is_alloc else -self.size[starts[ident][0]]
                                         for ident, nbytes, is_alloc in events)

    def arrays(self):
        to = lambda v: np.array(v, dtype=np.uint64)  # noqa: E731
        return to(self.lower), to(self.upper), to([max(s, 1) for s in self.size])

    def to_trace(self, path: str) -> None:
        """Writes the trace CSV that ``tensormem replay`` and ``tensormem plan`` read."""
        _write_trace(path, ((f"t{i}", lo, max(up, lo + 1), sz)
                            for i, (lo, up, sz) in enumerate(zip(self.lower, self.upper, self.size))))


def torch_extension():
    """(tensormem._tensormem_torch, "") where that extension is built for the PyTorch imported
    now, else (None, why not). c10's interfaces and the C++ ABI change between releases: an
    extension built for another release must not be used."""
    try:
        from . import _tensormem_torch
    except ImportError as e:
        return None, (f"tensormem's PyTorch extension is not built ({e}; it is built against the c10 headers "
                      f"of the PyTorch its interpreter imports: a PyPI wheel ships them, Debian's libtorch-dev "
                      f"provides them for python3-torch)")
    built_for = _tensormem_torch.TORCH_VERSION
    if built_for != torch.__version__:
        return None, (f"tensormem's PyTorch extension was built against PyTorch {built_for}, but this is "
                      f"PyTorch {torch.__version__}: rebuild tensormem with this PyTorch installed")
    return _tensormem_torch, ""


def _hook():
    extension, why = torch_extension()
    if extension is None:
        raise RuntimeError(f"PyTorch's allocator hook cannot be used: {why}")
    return extension


def capture(fn: Callable, *args, **kwargs) -> Tuple[object, Capture]:
    """Calls ``fn(*args, **kwargs)`` with every CPU tensor allocation and free recorded
    through PyTorch's own allocator hook (``c10::SetCPUAllocator``); returns (fn's result,
    the Capture). Only this process's CPU tensor memory is seen (not CUDA, not numpy)."""
    hook = _hook()
    hook.start_capture()
    try:
        result = fn(*args, **kwargs)
    finally:
        events = hook.stop_capture()
    return result, Capture(events)


def savings(source, alignment: int = 64, time_limit: float = 5.0) -> str:
    """What the buffers of a Capture (or a trace file) would need: the eager peak (a
    Capture's), an online best fit and the O(1) allocator replaying them, and the static
    plan, with the lower bound. Returns the table (and prints it)."""
    if isinstance(source, Capture):
        lower, upper, size = source.arrays()
        eager = source.peak
    else:
        t = _tensormem.read_trace(str(source))
        lower, upper, size, eager = t["lower"], t["upper"], t["size"], None
    events = sorted([(int(u), 0, i) for i, u in enumerate(upper)] + [(int(lo), 1, i) for i, lo in enumerate(lower)])

    def replay(allocator):
        live = {}
        for _t, is_alloc, i in events:
            if is_alloc:
                live[i] = allocator.allocate(int(size[i]))
            else:
                allocator.deallocate(live.pop(i))
        return allocator.peak

    best_fit = replay(_tensormem.BestFitAllocator(alignment=alignment))
    o1 = replay(_tensormem.TlsfAllocator(alignment=alignment))
    r = _tensormem.plan(lower, upper, size, time_limit=time_limit, alignment=alignment)
    lb = int(r["lower_bound"])
    mib = float(1 << 20)
    rows = [("eager PyTorch peak", eager), ("online best fit", best_fit), ("online O(1) (TLSF)", o1),
            ("static plan", int(r["arena_bytes"])), ("lower bound", lb)]
    text = f"{len(size)} buffers, alignment {alignment}\n"
    for name, value in rows:
        if value is None:
            continue
        # No bytes needed and none used is the bound met, as plan reports it.
        ratio = value / lb if lb else (1.0 if value == 0 else math.inf)
        text += f"  {name:<22} {value / mib:10.2f} MiB  {ratio:7.3f} x LB\n"
    print(text, end="")
    return text
