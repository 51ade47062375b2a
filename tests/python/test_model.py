"""tensormem.torch.trace / plan_module / ModulePlan.run on real PyTorch modules.

Oracles: the storages the graph's values really use (one run of the traced graph, values
dropped after their last use as eager code drops them) decide aliasing and lifetimes; eager
PyTorch decides outputs and gradients."""

import contextlib
import os
import re
import sys
import time
import warnings

import pytest
import torch
import torchvision

from tensormem.torch import UnsupportedGraph, plan_module, trace


def storage_of(t):
    if not isinstance(t, torch.Tensor) or not t.numel():
        return None
    return (t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()).data_ptr()


def observe(graph, module, inputs):
    """Runs the traced graph node by node, dropping each value after its last user. Returns
    {(node, index): storage} of every tensor value, per step the storages referenced, and the
    storages of the graph's constants."""
    gm = graph.module
    nodes = list(gm.graph.nodes)
    last_user = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last_user[a.name] = i
    state = [t.detach() for t in [*dict(module.named_parameters()).values(), *dict(module.named_buffers()).values()]]
    feed = iter([*state, *inputs])
    env, storages, alive, constants = {}, {}, [], set()
    keep = []  # every value stays referenced here, so no address is reused by a later tensor
    with torch.set_grad_enabled(graph.training):  # as traced; nothing requires a gradient
        for i, n in enumerate(nodes):
            if n.op == "placeholder":
                env[n.name] = next(feed)
            elif n.op == "get_attr":  # a constant the traced code made
                env[n.name] = getattr(gm, n.target)
                constants.add(storage_of(env[n.name]))
            elif n.op == "output":
                pass
            else:
                args = torch.fx.node.map_arg(n.args, lambda a: env[a.name])
                kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: env[a.name])
                env[n.name] = n.target(*args, **kwargs)
            value = env.get(n.name)
            keep.append(value)
            values = list(value) if isinstance(value, (list, tuple)) else [value]
            for k, v in enumerate(values):
                storages[(n.name, k)] = storage_of(v)
            # Storages referenced at this step by single tensor values (a tuple of outputs is
            # unpacked by getitem nodes, which are values of their own).
            alive.append({storage_of(v) for v in env.values() if isinstance(v, torch.Tensor)} - {None})
            for name in [k for k in env if last_user.get(k, -1) <= i and k != n.name or
                         (k == n.name and last_user.get(k, -1) < i)]:
                del env[name]
    return storages, alive, constants


def check_against_runtime(module, *inputs, training=False):
    graph = trace(module, *inputs, training=training)
    storages, alive, constants = observe(graph, module, inputs)
    state_storages = {storage_of(t) for t in [*module.parameters(), *module.buffers()]} | constants
    by_buffer = {}
    for node, bids in graph.node_buffers.items():
        for k, bid in enumerate(bids):
            s = storages.get((node, k))
            if s is None:
                continue
            if bid is None:  # a parameter, a module buffer, a view of one, or an output nobody unpacks
                metas = graph.metas.get(node)
                unused = metas is not None and (k >= len(metas) or metas[k] is None)
                assert s in state_storages or unused, f"{node}[{k}] is not planned but holds activation bytes"
                continue
            by_buffer.setdefault(bid, set()).add(s)
    owners = {}
    for bid, ss in by_buffer.items():
        assert len(ss) == 1, f"buffer {graph.buffers[bid].name}: its values use {len(ss)} storages"
        s = ss.pop()
        assert s not in owners, f"buffers {graph.buffers[owners.get(s)].name} and {graph.buffers[bid].name} share a storage"
        owners[s] = bid
        b = graph.buffers[bid]
        steps = [i for i, live in enumerate(alive) if s in live]
        if b.kind == "activation":
            node_index = [i for i, n in enumerate(graph.module.graph.nodes) if n.name == b.node][0]
            single = len(graph.node_buffers[b.node]) == 1
            assert steps[-1] == b.upper - 1, f"{b.name}: last alive at step {steps[-1]}, planned until {b.upper}"
            assert (steps[0] == b.lower) if single else (steps[0] >= b.lower), f"{b.name}: first alive {steps[0]}"
            assert node_index == b.lower
        else:  # inputs and outputs stay to the end
            assert b.lower <= steps[0] and steps[-1] <= b.upper - 1
            assert steps[-1] == len(alive) - 1 or b.kind == "input"  # outputs: held by the output node
    return graph


class AliasNet(torch.nn.Module):
    """In-place ReLU, view chains, split/chunk pieces, a multi-output op, an output view."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 32)
        self.relu = torch.nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.relu(self.lin(x))                    # relu_ writes the linear's output
        v = h.view(4, 2, 32).transpose(1, 2).unsqueeze(0)  # a chain of views
        a, b = torch.split(h, 4)                     # list of views
        c = torch.chunk(h, 2, dim=1)[1]
        a.add_(1.0)                                  # in-place through a view of h
        vals, idx = torch.topk(c, 3, dim=1)          # two fresh outputs
        out = torch.cat([a, b], dim=1) * v.sum()
        return out, vals, idx, out[:, :5]            # an output that views another


def _counted_linear(calls: list):
    """A Linear whose every forward (real or on fake tensors) appends to ``calls``: a
    refusal made before any trace leaves ``calls`` empty."""
    class Counted(torch.nn.Linear):
        def forward(self, x):
            calls.append(1)
            return super().forward(x)
    return Counted


def test_aliases_and_lifetimes_match_the_runtime_storages():
    torch.manual_seed(0)
    graph = check_against_runtime(AliasNet(), torch.randn(8, 16))
    views = sum(b.aliases for b in graph.buffers)
    assert views >= 6  # relu_, view, transpose, unsqueeze, split, chunk, add_, slice...
    assert any(op.startswith("aten.relu_") for op in graph.ops)


@pytest.mark.parametrize("training", [False, True])
def test_torchvision_and_transformer_lifetimes(training):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    for module, x in ((torchvision.models.resnet18(weights=None).eval(), torch.randn(1, 3, 32, 32)),
                      (torch.nn.TransformerEncoder(layer, 2).eval(), torch.randn(2, 8, 32))):
        check_against_runtime(module, x, training=training)


class FirstOutput(torch.nn.Module):
    """A module's first output alone (a recurrent layer's sequence, without its states)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)[0]


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("onednn", [False, True])
def test_recurrent_layers_plan_their_gates_as_views(training, onednn):
    """Without oneDNN, nn.LSTM and nn.GRU cut their gates with aten.unsafe_split, whose schema
    does not mark the pieces as views: each piece is the gates' buffer, not a buffer of its
    own. With it, PyTorch 2.x runs each LSTM layer as one op (aten.mkldnn_rnn_layer), whose
    workspace for the backward exists only while gradients are enabled."""
    torch.manual_seed(0)
    with torch.backends.mkldnn.flags(enabled=onednn):
        for layer in (torch.nn.LSTM(8, 16, 2, batch_first=True), torch.nn.GRU(8, 16, 2, batch_first=True)):
            module, x = FirstOutput(layer), torch.randn(2, 5, 8)
            graph = check_against_runtime(module, x, training=training)
            split = any(op.startswith("aten.unsafe_split") for op in graph.ops)
            fused = any(op.startswith("aten.mkldnn_rnn_layer") for op in graph.ops)
            assert split if not onednn else split or fused
            planned_equals_eager(module, x, training)


# Kernels that read the grad mode rather than their arguments, as PyTorch 2.x's oneDNN LSTM
# layer does: it makes the workspace its backward takes only while gradients are enabled,
# and returns an undefined tensor (None) otherwise. The second returns its second output
# while `_second_output["made"]` is set.
_probe_library = torch.library.Library("tensormem_test", "DEF")
_probe_library.define("grad_mode_probe(Tensor x) -> (Tensor, Tensor)")
_probe_library.impl("grad_mode_probe", lambda x: (x * 2, x + 1 if torch.is_grad_enabled() else None), "CPU")
_second_output = {"made": True}
_probe_library.define("switched_probe(Tensor x) -> (Tensor, Tensor)")
_probe_library.impl("switched_probe", lambda x: (x * 2, x + 1 if _second_output["made"] else None), "CPU")


class GradModeNet(torch.nn.Module):
    def __init__(self, op=None):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))
        self.op = op or torch.ops.tensormem_test.grad_mode_probe

    def forward(self, x):
        a, b = self.op(x)
        return a * self.w + (a if b is None else b) * self.w.sin()


@pytest.mark.parametrize("training", [False, True])
def test_a_planned_run_keeps_the_grad_mode_of_its_trace(training):
    torch.manual_seed(0)
    module, x = GradModeNet(), torch.randn(3, 4, requires_grad=True)
    graph = check_against_runtime(module, x, training=training)
    assert graph.ops["tensormem_test.grad_mode_probe.default"] == 1
    planned_equals_eager(module, x, training)
    plan = plan_module(module, x, training=training, time_limit=1)
    with torch.no_grad():
        quiet = plan.run(x)
        assert not torch.is_grad_enabled()  # the caller's mode, as it was
    out = plan.run(x)
    assert torch.is_grad_enabled()
    for a, b in zip((out[1] if training else [out]), (quiet[1] if training else [quiet])):
        assert torch.equal(a, b)  # the run's own mode, whatever the caller's
        assert not a.requires_grad and a.grad_fn is None  # nothing was recorded


def test_an_op_that_returns_no_tensor_where_the_trace_had_one_is_named():
    torch.manual_seed(0)
    module, x = GradModeNet(torch.ops.tensormem_test.switched_probe), torch.randn(3, 4)
    plan = plan_module(module, x, training=True, time_limit=1)
    try:
        _second_output["made"] = False
        with pytest.raises(RuntimeError, match=r"tensormem_test.switched_probe.default \(node switched_probe\w*\) "
                                               r"returned no tensor as output 1, where the traced run made one"):
            plan.run(x)
    finally:
        _second_output["made"] = True
    planned_equals_eager(module, x, training=True)


class NormNet(torch.nn.Module):
    """Norms whose aten ops return the statistics beside the result (native_group_norm,
    native_layer_norm): at inference nobody uses them after the op."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.group = torch.nn.GroupNorm(2, 8)
        self.layer = torch.nn.LayerNorm(6)

    def forward(self, x):
        return torch.relu(self.layer(self.group(self.conv(x))))


@pytest.mark.parametrize("training", [False, True])
def test_each_output_of_a_multi_output_op_lives_to_its_own_last_use(training):
    torch.manual_seed(0)
    module, x = NormNet().eval(), torch.randn(2, 3, 8, 8)
    graph = check_against_runtime(module, x, training=training)
    assert any(op.startswith("aten.native_layer_norm") for op in graph.ops)
    planned_equals_eager(module, x, training)


@pytest.mark.parametrize("training", [False, True])
def test_a_swin_transformer_indexes_constants_and_strides_into_its_slots(training):
    """Swin indexes its relative position table with integer tensors (aten.index.Tensor, an op
    tagged dynamic-shape only because a boolean mask would make it so), holds tensors its
    forward made as graph constants (get_attr), and its backward takes as_strided views at
    explicit storage offsets, which count from the start of a buffer's slot in the arena."""
    torch.manual_seed(0)
    module = torchvision.models.SwinTransformer(patch_size=[4, 4], embed_dim=8, depths=[2], num_heads=[2],
                                                window_size=[4, 4], num_classes=10).eval()
    x = torch.randn(1, 3, 32, 32)
    graph = check_against_runtime(module, x, training=training)
    assert "aten.index.Tensor" in graph.ops
    assert any(n.op == "get_attr" for n in graph.module.graph.nodes)
    if training:
        assert any(n.target is torch.ops.aten.as_strided.default and len(n.args) > 3
                   for n in graph.module.graph.nodes)
    planned_equals_eager(module, x, training)


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, n: int, scale=None):
        y = self.lin(x) * n
        return y if scale is None else y * scale


def test_inputs_that_are_not_tensors_are_constants_of_the_plan():
    """A number or None among the inputs is taken by the trace as it is: the planned run
    takes that same value and refuses another, of another type or a tensor in its place
    (it used to fail with an AttributeError on the input's missing tensor metadata)."""
    module = _Scaled().eval()
    x = torch.randn(4, 8)
    plan = plan_module(module, x, 3, None, time_limit=1)
    with torch.no_grad():
        assert torch.allclose(plan.run(x, 3, None), module(x, 3))
        plan_with_scale = plan_module(module, x, 2, 0.5, time_limit=1)
        assert torch.allclose(plan_with_scale.run(x, 2, 0.5), module(x, 2, 0.5))
    for args, shown in [((x, 4, None), "input 1 is 4; the plan was made for 3"),
                        ((x, 3.0, None), "input 1 is 3.0; the plan was made for 3"),
                        ((x, 3, 2.0), "input 2 is 2.0; the plan was made for None"),
                        ((x, torch.tensor(3), None), "input 1 is tensor\\(3\\); the plan was made for 3")]:
        with pytest.raises(ValueError, match=shown + ", which the trace took as a constant"):
            plan.run(*args)


class _Nested(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, pair, batch):
        return self.lin(pair[0]) * pair[1] + batch["x"] * batch["scale"]


def test_nested_inputs_run_as_they_were_traced():
    """Tuples, lists and dicts among the inputs: the trace takes them apart, and the planned
    run takes them as they were given (it used to count the leaves, so that only a call with
    every leaf spread out ran). Another nesting or another key is refused naming the leaves,
    and a changed number inside a dict by its path."""
    module = _Nested().eval()
    pair = (torch.randn(4, 8), torch.randn(4, 8))
    batch = {"x": torch.randn(4, 8), "scale": 2.0}
    plan = plan_module(module, pair, batch, time_limit=1)
    with torch.no_grad():
        assert torch.allclose(plan.run(pair, batch), module(pair, batch))
        other = ([torch.randn(4, 8), torch.randn(4, 8)], {"x": torch.randn(4, 8), "scale": 2.0})
        with pytest.raises(ValueError, match="nested otherwise"):
            plan.run(*other)  # a list where a tuple was traced
        other = (tuple(other[0]), other[1])
        assert torch.allclose(plan.run(*other), module(*other))
    with pytest.raises(ValueError, match="3 inputs given, the traced call had 2"):
        plan.run(*pair, batch)
    with pytest.raises(ValueError, match=r"given 0\[0\], 0\[1\], 1\['y'\], 1\['scale'\]; the plan was made "
                                         r"for 0\[0\], 0\[1\], 1\['x'\], 1\['scale'\]"):
        plan.run(pair, {"y": batch["x"], "scale": 2.0})
    with pytest.raises(ValueError, match=r"input 1\['scale'\] is 3.0; the plan was made for 2.0"):
        plan.run(pair, {"x": batch["x"], "scale": 3.0})
    with pytest.raises(ValueError, match=r"input 0\[1\] is \(4, 7\)"):
        plan.run((pair[0], torch.randn(4, 7)), batch)


class _FromArray(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, weights):
        return self.lin(x) * float(weights.sum())  # a number read from the array when traced


def test_a_numpy_input_is_a_constant_compared_by_contents():
    """A numpy array among the inputs is a constant of the plan, compared by dtype, shape and
    contents with a copy made when traced: an equal array runs (it used to be refused, having
    no single truth value), and the same array changed in place is refused (it used to run
    with the number the trace had read from it: a silently wrong result)."""
    np = pytest.importorskip("numpy")
    module = _FromArray().eval()
    x = torch.randn(4, 8)
    weights = np.ones(3, dtype=np.float32)
    plan = plan_module(module, x, weights, time_limit=1)
    with torch.no_grad():
        assert torch.allclose(plan.run(x, weights), module(x, weights))
        equal = weights.copy()
        assert torch.allclose(plan.run(x, equal), module(x, equal))
        nan_plan = plan_module(module, x, np.array([1.0, np.nan]), time_limit=1)
        assert torch.equal(torch.isnan(nan_plan.run(x, np.array([1.0, np.nan]))), torch.ones(4, 8, dtype=torch.bool))
    weights[1] = 5.0
    with pytest.raises(ValueError, match=r"input 1 is array\(\[1., 5., 1.\].*made for array\(\[1., 1., 1.\]"):
        plan.run(x, weights)
    for other in [np.ones(3, dtype=np.float64), np.ones(4, dtype=np.float32), np.ones((1, 3), dtype=np.float32)]:
        with pytest.raises(ValueError, match="which the trace took as a constant"):
            plan.run(x, other)
    with pytest.raises(ValueError, match=r"nested otherwise.*given 0, 1\[0\], 1\[1\], 1\[2\]; the plan was made "
                                         r"for 0, 1$"):
        plan.run(x, [1.0, 1.0, 1.0])


def test_a_training_step_without_a_parameter_to_train_is_refused_by_name():
    frozen = torch.nn.Linear(8, 8).requires_grad_(False)
    for module, count in [(torch.nn.ReLU(), 0), (frozen, 2)]:
        with pytest.raises(UnsupportedGraph, match=f"training step of {type(module).__name__}: it has no parameter "
                                                   f"that requires a gradient \\({count} parameters\\)"):
            plan_module(module, torch.randn(4, 8), training=True, time_limit=1)
    assert plan_module(frozen, torch.randn(4, 8), time_limit=1).arena_bytes > 0


def test_integer_indexing_is_planned_and_a_boolean_mask_is_refused():
    class Gather(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("order", torch.tensor([2, 0, 1]))

        def forward(self, x):
            return x[:, self.order] * 2

    class Mask(torch.nn.Module):
        def forward(self, x):
            return x[x > 0]  # as many elements as are positive

    torch.manual_seed(0)
    planned_equals_eager(Gather(), torch.randn(4, 3), training=False)
    with pytest.raises(UnsupportedGraph, match="aten.index.Tensor.*depends on the input values"):
        trace(Mask(), torch.randn(5))


def test_a_value_dependent_shape_is_planned_when_the_trace_alone_decides_the_values():
    # MViT's positional encoding: repeat_interleave by an int becomes aten.repeat_interleave of
    # a counts tensor that the trace makes from constants (empty, fill_), so its output shape
    # is the same for every input.
    class Repeated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = torch.nn.Parameter(torch.randn(4, 3))

        def forward(self, x):
            return x + torch.repeat_interleave(self.pos, 5, dim=0)

    class CountsFromInput(torch.nn.Module):
        def forward(self, x, counts):
            return torch.repeat_interleave(x, counts, dim=0)

    class ConstantOverwritten(torch.nn.Module):  # a decided tensor written with input values
        def forward(self, x):
            counts = torch.ones(3, dtype=torch.long)
            counts.add_(x[:3].abs().long())
            return torch.repeat_interleave(counts)

    class ConstantViewOverwritten(torch.nn.Module):  # the same through a view of the counts
        def forward(self, x):
            counts = torch.ones(3, dtype=torch.long)
            counts[1:].add_(x[:2].abs().long())
            return torch.repeat_interleave(counts)

    class LiteralOverwritten(torch.nn.Module):  # a constant the graph holds, through a view
        def forward(self, x):
            counts = torch.tensor([1, 1, 1])
            counts[1:].add_(x[:2].abs().long())
            return torch.repeat_interleave(counts)

    class AttributeOverwritten(torch.nn.Module):  # a plain tensor attribute: a graph constant
        def __init__(self):
            super().__init__()
            self.counts = torch.ones(3, dtype=torch.long)

        def forward(self, x):
            self.counts[1:].add_(x[:2].abs().long())
            return torch.repeat_interleave(self.counts)

    class AttributeViewOverwritten(AttributeOverwritten):  # a view taken before the write
        def forward(self, x):
            counts = self.counts[:]
            self.counts[1:].add_(x[:2].abs().long())
            return torch.repeat_interleave(counts)

    class RandomCounts(torch.nn.Module):  # made without the inputs, but not the same each run
        def forward(self, x):
            return torch.repeat_interleave(x, torch.randint(1, 4, (x.shape[0],)), dim=0)

    torch.manual_seed(0)
    for training in (False, True):
        planned_equals_eager(Repeated(), torch.randn(20, 3), training=training)
    for module, inputs in ((CountsFromInput(), (torch.randn(3, 2), torch.tensor([1, 2, 3]))),
                           (ConstantOverwritten(), (torch.randn(5) * 3,)),
                           (ConstantViewOverwritten(), (torch.randn(5) * 3,)),
                           (LiteralOverwritten(), (torch.randn(5) * 3,)),
                           (AttributeOverwritten(), (torch.randn(5) * 3,)),
                           (AttributeViewOverwritten(), (torch.randn(5) * 3,)),
                           (RandomCounts(), (torch.randn(3, 2),))):
        with pytest.raises(UnsupportedGraph, match="aten.repeat_interleave.Tensor.*depends on the input values"):
            trace(module, *inputs)


@contextlib.contextmanager
def eager_as_traced(graph):
    """Eager inference on the path the trace took. PyTorch 2.x's tracer records the unfused
    ops of nn.TransformerEncoderLayer, where eager inference takes its fused fast path: the
    same function, but not the same roundings."""
    mha = getattr(torch.backends, "mha", None)
    fused = any(op.startswith(("aten._transformer_encoder_layer_fwd", "aten._native_multi_head_attention"))
                for op in graph.ops)
    if fused or mha is None or not hasattr(mha, "set_fastpath_enabled"):
        yield
        return
    before = mha.get_fastpath_enabled()
    mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        mha.set_fastpath_enabled(before)


def planned_equals_eager(module, x, training):
    plan = plan_module(module, x, training=training, time_limit=2)
    assert plan.arena_bytes >= plan.lower_bound > 0
    assert plan.arena_bytes <= plan.online_best_fit
    out = plan.run(x)
    if training:
        loss = module(x).float().sum()
        grads = torch.autograd.grad(loss, [p for p in module.parameters() if p.requires_grad])
        assert torch.equal(out[0], loss.detach())
        assert len(out[1]) == len(grads)
        for a, b in zip(out[1], grads):
            assert torch.equal(a, b)  # bitwise: the same kernels on the same values
    else:
        with torch.no_grad():
            eager = module(x)
            with eager_as_traced(plan.graph):
                assert torch.equal(out, module(x))
            assert torch.allclose(out, eager, rtol=1e-5, atol=1e-6)
    # Every buffer with bytes was found at its planned offset inside the one arena tensor.
    assert plan.placed_buffers == sum(1 for b in plan.graph.buffers if b.nbytes)
    assert "planned arena" in plan.report() and "eager PyTorch peak" in plan.report()
    return plan


@pytest.mark.parametrize("training", [False, True])
def test_planned_execution_equals_eager(training):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    cases = [
        (torchvision.models.resnet18(weights=None).eval(), torch.randn(2, 3, 32, 32)),
        (torchvision.models.mobilenet_v3_small(weights=None).eval(), torch.randn(2, 3, 32, 32)),
        (torch.nn.TransformerEncoder(layer, 2).eval(), torch.randn(2, 8, 32)),
    ]
    for module, x in cases:
        plan = planned_equals_eager(module, x, training)
        assert plan.moved_ops >= 0


def test_activation_bytes_is_the_sum_of_the_buffers_sizes():
    # Linear(16, 32) then ReLU on 8 rows of float32, inference: the input (8 x 16), the
    # linear's output and the ReLU's (8 x 32 each); parameters are not buffers.
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU())
    graph = trace(m, torch.randn(8, 16))
    assert [b.nbytes for b in graph.buffers] == [8 * 16 * 4, 8 * 32 * 4, 8 * 32 * 4]
    assert graph.activation_bytes == 8 * 16 * 4 + 2 * 8 * 32 * 4
    trained = trace(m, torch.randn(8, 16), training=True)
    assert trained.activation_bytes == sum(b.nbytes for b in trained.buffers)
    assert trained.activation_bytes > graph.activation_bytes  # the backward's buffers


def test_to_trace_reads_back(tmp_path):
    import tensormem
    graph = trace(torchvision.models.mobilenet_v3_small(weights=None).eval(), torch.randn(1, 3, 32, 32))
    path = tmp_path / "m.csv"
    graph.to_trace(str(path))
    lower, upper, size = graph.arrays()
    back = tensormem.read_trace(str(path))
    assert list(back["lower"]) == list(lower) and list(back["upper"]) == list(upper)
    assert list(back["size"]) == list(size)
    assert tensormem.lower_bound(lower, upper, size) == tensormem.lower_bound(back["lower"], back["upper"], back["size"])


def test_to_trace_that_cannot_be_written_whole_keeps_the_file_there(tmp_path):
    # Past the largest file this process may write (a full disk fails it the same way): the
    # error names the file, the trace written before stays, no other file is left.
    import errno
    from file_limits import file_size_limit
    small = trace(torch.nn.Linear(4, 4).eval(), torch.randn(1, 4))
    big = trace(torchvision.models.mobilenet_v3_small(weights=None).eval(), torch.randn(1, 3, 32, 32))
    path = tmp_path / "m.csv"
    small.to_trace(str(path))
    before = path.read_bytes()
    with file_size_limit(len(before) + 1), pytest.raises(OSError) as info:
        big.to_trace(str(path))
    assert info.value.errno == errno.EFBIG and f"cannot write {path}" in str(info.value)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["m.csv"]
    big.to_trace(str(path))
    assert len(path.read_bytes()) > len(before) + 1


def test_training_sums_every_tensor_of_a_dict_output_and_refuses_an_output_without_one():
    # Segmentation models return {"out": ..., "aux": ...}: the default loss is the sum of every
    # tensor in it (it used to see none in a dict, and the trace failed on an int loss).
    from torch.utils._pytree import tree_flatten

    class Heads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(6, 8)
            self.out = torch.nn.Linear(8, 3)
            self.aux = torch.nn.Linear(8, 2)

        def forward(self, x):
            h = torch.relu(self.body(x))
            return {"out": self.out(h), "aux": [self.aux(h), h.mean()]}

    class Nothing(torch.nn.Module):  # a parameter to train, and an output with no tensor
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, x):
            return {"count": 3}

    torch.manual_seed(0)
    module, x = Heads(), torch.randn(4, 6)
    plan = plan_module(module, x, training=True, time_limit=1)
    loss, grads = plan.run(x)
    eager = sum(t.float().sum() for t in tree_flatten(module(x))[0])
    expected = torch.autograd.grad(eager, list(module.parameters()))
    assert torch.equal(loss, eager.detach()) and len(grads) == len(expected) == 6
    for a, b in zip(grads, expected):
        assert torch.equal(a, b)
    assert plan.arena_bytes >= plan.lower_bound > 0
    with pytest.raises(UnsupportedGraph, match="Nothing returns no tensor to make the default loss of; pass loss_fn"):
        trace(Nothing(), torch.randn(2), training=True)


def test_misuse_gives_clear_errors():
    class Branchy(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow
                return x * 2
            return x - 1

    with pytest.raises(UnsupportedGraph, match="Branchy.*data-dependent control flow"):
        trace(Branchy(), torch.randn(4))

    class Nonzero(torch.nn.Module):
        def forward(self, x):
            return torch.nonzero(x > 0)  # output shape depends on the values

    with pytest.raises(UnsupportedGraph, match="aten.nonzero.default"):
        trace(Nonzero(), torch.randn(4))

    # A function is not a module; bad planner arguments are refused before the trace runs.
    with pytest.raises(TypeError, match="expected a torch.nn.Module, not function"):
        trace(lambda x: x * 2, torch.randn(4))
    calls = []
    Counted = _counted_linear(calls)

    for kwargs, error, message in [({"alignment": 3}, ValueError, "alignment must be a power of two, not 3"),
                                   ({"alignment": 0}, ValueError, "not 0"),
                                   ({"alignment": 2.5}, TypeError, "cannot be interpreted as an integer"),
                                   ({"time_limit": float("nan")}, ValueError, "time_limit must be .* not nan"),
                                   ({"time_limit": -1}, ValueError, "not -1")]:
        with pytest.raises(error, match=message):
            plan_module(Counted(4, 4), torch.randn(2, 4), **kwargs)
    assert calls == []
    assert plan_module(Counted(4, 4), torch.randn(2, 4), alignment=128, time_limit=0.5).alignment == 128


def test_command_line(tmp_path):
    import os
    import subprocess
    import sys

    import tensormem
    page, csv = tmp_path / "plan.html", tmp_path / "plan.csv"
    r = subprocess.run([sys.executable, "-m", "tensormem.torch", "plan", "mobilenet_v3_small", "--batch", "1",
                        "--time-limit", "1", "--svg", str(page), "--trace", str(csv), "--run"],
                       capture_output=True, text=True, env=os.environ, timeout=300)
    assert r.returncode == 0, r.stderr
    for line in ("mobilenet_v3_small, batch 1", "eager PyTorch peak", "planned arena", "lower bound",
                 "output bitwise equal"):
        assert line in r.stdout, r.stdout
    assert "<canvas" in page.read_text()
    assert len(tensormem.read_trace(str(csv))["size"]) > 100
    bad = subprocess.run([sys.executable, "-m", "tensormem.torch", "plan", "no_such_model"],
                         capture_output=True, text=True, env=os.environ, timeout=120)
    assert bad.returncode != 0 and "unknown model 'no_such_model'" in bad.stderr


@pytest.mark.parametrize("args, message", [
    (["--batch", "0"], "--batch: must be a whole number >= 1, not '0'"),
    (["--batch", "-2"], "--batch: must be a whole number >= 1, not '-2'"),
    (["--sequence", "0"], "--sequence: must be a whole number >= 1, not '0'"),
    (["--layers", "1.5"], "--layers: must be a whole number >= 1, not '1.5'"),
    (["--time-limit", "-1"], "--time-limit: must be a number of seconds >= 0, not '-1'"),
    (["--time-limit", "nan"], "--time-limit: must be a number of seconds >= 0, not 'nan'"),
])
def test_command_line_refuses_bad_numbers_before_any_work(args, message, capsys):
    from tensormem.model import main
    with pytest.raises(SystemExit) as e:
        main(["plan", "gpt"] + args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_command_line_builds_models_without_any_download_and_compares_dict_outputs(tmp_path, monkeypatch, capsys):
    # A segmentation model: with weights=None alone, its builder fetches a pretrained backbone;
    # its output is a dict of tensors. Any connection attempt fails the test, network or not.
    import socket

    from tensormem.model import main

    def no_network(*args, **kwargs):
        raise AssertionError("the command line tried to open a connection")
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    code = main(["plan", "lraspp_mobilenet_v3_large", "--time-limit", "0", "--run"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "output bitwise equal" in out and "planned arena" in out
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("args, message", [
    (["gpt", "--layers", "1000000000"], r"gpt with 1000000000 layers, batch 1, sequence 128: its parameters and inputs "
                                        r"alone need [0-9.]+ GiB, more than this machine's [0-9.]+ GiB of memory"),
    (["resnet18", "--batch", "100000000"], r"resnet18 at batch 100000000: its parameters and inputs alone need"),
    (["mvit_v1_b", "--batch", "1000000"], r"mvit_v1_b at batch 1000000: .* more than this machine's"),
])
def test_command_line_refuses_sizes_past_the_machines_memory_before_building(args, message):
    """Checked before the model is built: 10^9 layers were built until memory ran out."""
    from tensormem.model import main
    start = time.perf_counter()
    with pytest.raises(SystemExit, match=message):
        main(["plan"] + args)
    assert time.perf_counter() - start < 10


def test_command_line_reports_activations_past_the_machines_memory_in_one_line(capsys):
    """Parameters and inputs fit, the activations do not: the trace fails on one line, exit 1."""
    from tensormem.model import main
    assert main(["plan", "gpt", "--layers", "1", "--sequence", "100000000"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    # PyTorch 1.13 cannot trace it on fake tensors, and the real trace runs out of memory;
    # PyTorch 2 traces it on fake tensors, and the bound is refused before anything runs.
    assert len(err) == 1 and (("gpt: cannot trace GPT:" in err[0] and "can't allocate memory" in err[0]) or
                              re.search(r"gpt at batch 1: a plan of its activations needs at least [0-9.]+ GiB .*; "
                                        r"try a smaller --sequence or --layers$", err[0])), err


def test_command_line_names_a_model_it_cannot_trace_in_one_line(capsys):
    from tensormem.model import main
    model = "fasterrcnn_mobilenet_v3_large_320_fpn"  # its control flow depends on the values
    assert main(["plan", model, "--time-limit", "0"]) == 1
    out, err = capsys.readouterr()
    # PyTorch 1.13 stops the trace at the control flow; PyTorch 2 traces it, and nonzero's
    # output size (which depends on the values) is refused.
    assert (err.startswith(f"python3 -m tensormem.torch: {model}: cannot trace FasterRCNN:") and
            "data-dependent control flow" in err) or \
        err.startswith(f"python3 -m tensormem.torch: {model}: unsupported op aten.nonzero.default (node nonzero): "
                       "its output depends on the input values"), err
    assert "Traceback" not in err and err.count("\n") == 1
    assert "try --batch" not in err  # the hint belongs to batch norm's training failure alone
    assert out == ""


def test_command_line_drives_optical_flow_with_two_frames_and_video_with_a_clip(capsys):
    from tensormem.model import _example_model, main
    assert main(["plan", "raft_small", "--time-limit", "0", "--run"]) == 0  # a list of flows
    out, err = capsys.readouterr()
    assert "output bitwise equal" in out, err
    _model, inputs = _example_model("raft_small", 2, 0, 0)
    assert [tuple(x.shape) for x in inputs] == [(2, 3, 224, 224)] * 2
    for video in ("r3d_18", "mvit_v2_s", "s3d"):
        _model, inputs = _example_model(video, 1, 0, 0)
        assert [tuple(x.shape) for x in inputs] == [(1, 3, 16, 224, 224)]
    _model, inputs = _example_model("resnet18", 3, 0, 0)
    assert [tuple(x.shape) for x in inputs] == [(3, 3, 224, 224)]


def test_bitwise_equal_compares_structure_dtype_and_bits():
    from collections import OrderedDict

    from tensormem.model import _bitwise_equal
    a = torch.arange(4.0)
    assert _bitwise_equal(OrderedDict(out=a, aux=(a, 3)), OrderedDict(out=a.clone(), aux=(a.clone(), 3)))
    assert not _bitwise_equal(OrderedDict(out=a), OrderedDict(aux=a))              # other keys
    assert not _bitwise_equal((a, a), [a, a])                                      # tuple against list
    assert not _bitwise_equal(a, a.to(torch.float64))                              # same values, other dtype
    assert not _bitwise_equal(a, a.to(torch.int64))
    assert not _bitwise_equal(a, torch.tensor([0.0, 1.0, 2.0, 3.0000002]))         # one bit apart
    assert not _bitwise_equal((a, 3), (a, 4))                                      # a non-tensor leaf
    assert not _bitwise_equal((a, 3), (a, a))
    assert not _bitwise_equal(torch.tensor([-0.0]), torch.tensor([0.0]))            # equal values, other bits
    nan = torch.tensor([float("nan"), 1.0])
    assert _bitwise_equal(nan, nan.clone())                                        # the same bits
    assert not _bitwise_equal(a, a.reshape(2, 2))                                  # other shape
    for t in (torch.tensor([True, False]), torch.arange(3, dtype=torch.int16), torch.tensor([1 + 2j]),
              torch.arange(6.0).reshape(2, 3).t()):                                # not contiguous
        other = ~t if t.dtype == torch.bool else t + 1
        assert other.dtype == t.dtype and _bitwise_equal(t, t.clone()) and not _bitwise_equal(t, other)
    q = torch.quantize_per_tensor(torch.arange(4.0), 0.5, 1, torch.quint8)
    assert _bitwise_equal(q, q.clone())
    assert not _bitwise_equal(q, torch.quantize_per_tensor(torch.arange(4.0), 0.25, 1, torch.quint8))
    assert not _bitwise_equal(q, torch.quantize_per_tensor(torch.arange(4.0) + 1, 0.5, 1, torch.quint8))
    sparse = torch.tensor([[0.0, 1.0], [2.0, 0.0]]).to_sparse()
    assert _bitwise_equal(sparse, sparse.clone()) and not _bitwise_equal(sparse, (sparse * 2).coalesce())
    assert not _bitwise_equal(sparse, sparse.to_dense())


def test_command_line_refuses_an_output_it_cannot_write_before_tracing(capsys, monkeypatch, tmp_path):
    import tensormem.model as model
    monkeypatch.setattr(model, "_example_model", lambda *a: pytest.fail("the model was built"))
    folder = tmp_path / "a-folder"
    folder.mkdir()
    for option in ("--trace", "--svg"):
        for path, why in (("/nonexistent-dir/out.csv", "the folder /nonexistent-dir does not exist"),
                          (str(folder), "is a folder"), ("", "an empty path"), ("x\0y", "holds a NUL byte")):
            with pytest.raises(SystemExit) as e:
                model.main(["plan", "gpt", option, path])
            assert e.value.code == 2
            err = capsys.readouterr().err
            assert why in err and f"argument {option}" in err and "Traceback" not in err, err


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to user nobody needs root")
def test_command_line_refuses_a_folder_it_may_not_write_to():
    """As user nobody, who may not write to / (root may write anywhere). A forked child drops
    to nobody and runs the command line with the modules already loaded, so that it needs no
    right to read the checkout; its stderr comes back through a pipe."""
    import pwd
    from tensormem.model import main
    nobody = pwd.getpwnam("nobody")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            os.close(read_end)
            os.dup2(write_end, 2)
            sys.stderr = os.fdopen(2, "w", closefd=False)
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            main(["plan", "gpt", "--svg", "/tensormem-plan.svg"])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 98
        except BaseException:  # noqa: B902 - anything else is a failure the parent reports
            code = 97
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as r:
        err = r.read()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 2, (status, err)
    assert "cannot write '/tensormem-plan.svg': permission denied" in err and "Traceback" not in err, err
    assert not os.path.exists("/tensormem-plan.svg")


def test_command_line_names_an_output_that_fails_when_written_and_keeps_the_report(capsys):
    from tensormem.model import main
    for option in ("--trace", "--svg"):
        code = main(["plan", "gpt", "--layers", "1", "--sequence", "8", "--time-limit", "0",
                     option, "/dev/full"])  # writable, and every write fails with ENOSPC
        out, err = capsys.readouterr()
        assert code == 1
        assert "planned arena" in out
        assert "/dev/full" in err and "Traceback" not in err, err


@pytest.mark.parametrize("training", [False, True])
def test_the_cpp_graph_front_end_derives_the_same_lower_bound(training):
    import tensormem
    torch.manual_seed(0)
    for module, x in ((torchvision.models.mobilenet_v3_small(weights=None).eval(), torch.randn(1, 3, 32, 32)),
                      (torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0,
                                                                                    batch_first=True), 2).eval(),
                       torch.randn(2, 8, 32))):
        graph = trace(module, x, training=training)
        life = tensormem.derive_lifetimes(graph.to_operator_graph())
        assert len(life["size"]) == len(graph.buffers)
        assert tensormem.lower_bound(*graph.arrays()) == \
            tensormem.lower_bound(life["lower"], life["upper"], life["size"])


def test_operator_graph_and_the_transformer_step():
    import tensormem
    g = tensormem.make_transformer_step(layers=2, hidden=64, heads=4, sequence=16, batch=2, vocabulary=100)
    assert any(role == "weight" for _name, _bytes, role in g.tensors)
    life = tensormem.derive_lifetimes(g)
    r = tensormem.plan(life["lower"], life["upper"], life["size"], time_limit=1)
    assert r["arena_bytes"] == r["lower_bound"] and life["weight_bytes"] > 0 and life["steps"] == len(g.ops)
    h = tensormem.OperatorGraph()
    a = h.add_tensor("a", 100, "input")
    b = h.add_tensor("b", 50)
    h.add_op("f", [a], [b])
    assert tensormem.derive_lifetimes(h)["steps"] == 1
    with pytest.raises(ValueError, match="role must be"):
        h.add_tensor("c", 1, "scratch")
    with pytest.raises(ValueError):
        h.add_op("g", [7], [])


def test_run_refuses_inputs_the_plan_was_not_made_for():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU()).eval()
    plan = plan_module(model, torch.randn(2, 8), time_limit=0.5)
    with pytest.raises(ValueError, match=r"input 0 is \(1, 8\).*made for \(2, 8\)"):
        plan.run(torch.randn(1, 8))  # copy_ would broadcast it silently
    with pytest.raises(ValueError, match="torch.float64"):
        plan.run(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="2 inputs given"):
        plan.run(torch.randn(2, 8), torch.randn(2, 8))
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(plan.run(x), model(x))


def test_run_refuses_a_module_changed_since_it_was_planned():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.BatchNorm1d(4)).eval()
    x = torch.randn(2, 8)
    plan = plan_module(model, x, time_limit=0.5)
    weight, bias = model[0].weight, model[0].bias
    with torch.no_grad():
        assert torch.equal(plan.run(x), model(x))
    # Wider: PyTorch resized the output slot and the error came from a later kernel.
    model[0].weight = torch.nn.Parameter(torch.randn(16, 8))
    with pytest.raises(ValueError, match=r"module's 0.weight is now \(16, 8\) torch.float32; the plan was made "
                                         r"for \(4, 8\) torch.float32"):
        plan.run(x)
    model[0].weight = torch.nn.Parameter(weight.detach().double())
    with pytest.raises(ValueError, match="0.weight is now .* torch.float64"):
        plan.run(x)
    model[2].running_mean = torch.zeros(5)
    model[0].weight = weight
    with pytest.raises(ValueError, match=r"2.running_mean is now \(5,\)"):
        plan.run(x)
    model[2].running_mean = torch.zeros(4)
    model[0].bias = None  # one parameter fewer: it used to be reported as an input too many
    with pytest.raises(ValueError, match="module now has .* parameters and buffers, the plan was made for"):
        plan.run(x)
    model[0].bias = bias
    with torch.no_grad():
        assert torch.equal(plan.run(x), model(x))


def test_run_refuses_a_plan_whose_offsets_split_an_element():
    """An alignment below the element size packs tighter, and the plan is valid as bytes, but
    a float32 tensor cannot start at an odd byte: run says so instead of failing inside torch."""

    class Mixed(torch.nn.Module):
        def forward(self, x):
            return (x * 2).sum() + x[:3].to(torch.int8).float().sum()

    torch.manual_seed(0)
    x = torch.randn(5)
    tight = plan_module(Mixed(), x, alignment=1, time_limit=0.5)
    assert any(int(tight.offsets[b.id]) % 4 for b in tight.graph.buffers if b.nbytes % 4 == 0 and b.nbytes)
    with pytest.raises(ValueError, match=r"holds 4-byte elements but starts at byte \d+ .*alignment of 4 or more"):
        tight.run(x)
    assert torch.equal(plan_module(Mixed(), x, alignment=4, time_limit=0.5).run(x), Mixed()(x))


def hook_or_skip():
    try:
        from tensormem import _tensormem_torch  # noqa: F401
    except ImportError:
        pytest.skip("built without PyTorch's allocator hook (its PyTorch has no c10 headers: libtorch-dev for Debian's)")


def test_the_hook_is_built_for_the_pytorch_it_runs_with(monkeypatch):
    """The build asks its interpreter's PyTorch for its c10 (python/CMakeLists.txt); a hook
    of another release is refused before it is installed."""
    hook_or_skip()
    from tensormem import _tensormem_torch
    from tensormem.torch import capture
    assert _tensormem_torch.TORCH_VERSION == torch.__version__
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    with pytest.raises(RuntimeError, match=rf"built against PyTorch {re.escape(_tensormem_torch.TORCH_VERSION)}, "
                                           r"but this is PyTorch 9\.9\.9: rebuild tensormem"):
        capture(lambda: torch.empty(8))
    assert not _tensormem_torch.capturing()


def test_capture_records_every_cpu_allocation_and_free(tmp_path):
    """An oracle made of known tensors: sizes, order, frees and the peak are exactly these."""
    hook_or_skip()
    from tensormem.torch import capture, savings

    def work():
        a = torch.empty(1000, dtype=torch.uint8)       # 1000 bytes
        b = torch.empty(250, dtype=torch.float32)      # 1000 bytes
        del a
        c = torch.empty(4096, dtype=torch.uint8)       # peak: b + c = 5096
        del c
        return b                                        # alive when the call returns

    result, cap = capture(work)
    assert result.numel() == 250
    assert cap.size == [1000, 1000, 4096] and cap.peak == 5096
    assert cap.lower == [0, 1, 3] and cap.upper == [2, cap.events, 4] and cap.events == 5
    path = tmp_path / "cap.csv"
    cap.to_trace(str(path))
    text = savings(str(path), alignment=1, time_limit=0.5)
    assert "static plan" in text and "lower bound" in text
    # Tensors made during the capture and freed after it are not recorded afterwards, and
    # PyTorch has its allocator back.
    del result
    _, again = capture(lambda: torch.ones(10))
    assert again.size == [40]


def test_capture_matches_the_traced_plan_of_a_model():
    hook_or_skip()
    from tensormem.torch import capture, savings
    model = torchvision.models.mobilenet_v3_small(weights=None).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        out, cap = capture(model, x)
    assert out.shape == (1, 1000) and len(cap.size) > 50
    plan = plan_module(model, x, time_limit=1)
    assert plan.eager_method == "allocator hook" and plan.eager_peak == cap.peak
    assert plan.lower_bound <= cap.peak + x.numel() * 4  # the plan's arena also holds the input
    text = savings(cap, alignment=64, time_limit=1)
    assert "eager PyTorch peak" in text


def test_savings_of_a_capture_without_tensors_is_the_bound_met():
    hook_or_skip()
    from tensormem.torch import capture, savings
    _, cap = capture(lambda: None)
    assert cap.size == [] and cap.peak == 0
    text = savings(cap, alignment=64, time_limit=0.1)
    assert text.startswith("0 buffers") and "nan" not in text
    assert text.count("1.000 x LB") == 5, text


def test_capture_inside_a_capture_is_refused():
    hook_or_skip()
    from tensormem.torch import capture

    def inner():
        with pytest.raises(RuntimeError, match="already running"):
            capture(lambda: torch.ones(3))
        return torch.ones(5)

    out, cap = capture(inner)
    assert out.numel() == 5 and 20 in cap.size
    _, after = capture(lambda: torch.ones(2))  # the hook was handed back and works again
    assert after.size == [8]


def test_capture_under_a_cpu_allocator_of_higher_priority_is_refused_and_can_be_tried_again(tmp_path):
    """A library that set PyTorch's CPU allocator at a higher priority keeps it: capture says
    so, records nothing and leaves no capture running (the next one is refused the same way,
    not as one already running). In a child: the priority cannot be taken back."""
    hook_or_skip()
    import shutil
    import subprocess
    import torch.utils.cpp_extension as ext
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++ to build the library that sets the allocator")
    source = tmp_path / "take.cpp"
    source.write_text("#include <c10/core/CPUAllocator.h>\n"
                      'extern "C" void take_cpu_allocator() { c10::SetCPUAllocator(c10::GetDefaultCPUAllocator(), 1); }\n')
    library = tmp_path / "take.so"
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    subprocess.run([compiler, "-std=c++17", "-shared", "-fPIC", *(f"-I{d}" for d in ext.include_paths()), str(source),
                    "-o", str(library), f"-L{torch_lib}", "-lc10", f"-Wl,-rpath,{torch_lib}"], check=True)
    child = f"""
import ctypes, torch
from tensormem import _tensormem_torch
from tensormem.torch import capture
ctypes.CDLL({str(library)!r}).take_cpu_allocator()
for _ in range(2):
    try:
        capture(lambda: torch.ones(3))
    except RuntimeError as e:
        print("refused:", e)
    assert not _tensormem_torch.capturing()
assert torch.ones(4).sum().item() == 4
"""
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["refused: PyTorch kept its CPU allocator (a higher-priority one is set)"] * 2, r.stdout


# ----------------------------------------------------------------------------- memory check

class CountedCalls(torch.nn.Module):
    """A wrapped module whose real (not fake) forward calls are counted."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.real_calls = 0

    def forward(self, x):
        if not isinstance(x, torch._subclasses.FakeTensor):
            self.real_calls += 1
        return self.inner(x)


@pytest.mark.parametrize("training", [False, True])
def test_the_activation_bound_on_fake_tensors_is_the_plans_bound(training):
    """Within 0.2 % of (and not below) the lower bound of the real trace: the fake kernels
    size batch norm's saved statistics, which the CPU kernels leave empty in inference."""
    from tensormem.torch import activation_lower_bound
    torch.manual_seed(0)
    for module, x in ((torchvision.models.resnet18(weights=None).eval(), torch.randn(2, 3, 64, 64)),
                      (torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True).eval(),
                       torch.randn(2, 16, 64))):
        counted = CountedCalls(module)
        bound = activation_lower_bound(counted, x, training=training)
        assert counted.real_calls == 0  # nothing ran on real tensors
        plan = plan_module(module, x, training=training, time_limit=0)
        assert plan.lower_bound <= bound <= plan.lower_bound * 1.002, (type(module).__name__, bound, plan.lower_bound)
    with pytest.raises(ValueError, match="power of two"):
        activation_lower_bound(module, x, alignment=48)


def test_the_activation_bound_of_a_batch_past_the_memory_takes_seconds():
    """10^5 images as a view of one (no memory): about 10^5 times the bound of one image (the
    activations scale with the batch, the input, a view of one image, does not), found
    without running anything."""
    from tensormem.torch import activation_lower_bound
    module = torchvision.models.resnet18(weights=None).eval()
    one = torch.randn(1, 3, 224, 224)
    start = time.perf_counter()
    bound = activation_lower_bound(module, one.expand(100_000, 3, 224, 224))
    assert time.perf_counter() - start < 30
    single = activation_lower_bound(module, one)
    assert 90_000 * single <= bound <= 100_000 * single and bound > 500 * 2**30, (bound, single)


def test_plan_module_refuses_a_plan_past_the_available_memory_before_running_the_model(monkeypatch):
    import tensormem.model as model
    from tensormem.torch import activation_lower_bound
    torch.manual_seed(0)
    module = CountedCalls(torchvision.models.resnet18(weights=None).eval())
    x = torch.randn(2, 3, 64, 64)
    bound = activation_lower_bound(module, x)
    monkeypatch.setattr(model, "_available_memory_bytes", lambda: bound - 1)
    with pytest.raises(MemoryError, match=r"a plan of its activations needs at least [0-9.]+ MiB \(their lower "
                                          r"bound, traced on fake tensors\), more than the [0-9.]+ MiB of memory"):
        plan_module(module, x, time_limit=0)
    assert module.real_calls == 0
    plan = plan_module(module, x, time_limit=0, check_memory=False)  # the caller's choice: run anyway
    assert plan.lower_bound <= bound and module.real_calls > 0
    monkeypatch.setattr(model, "_available_memory_bytes", lambda: bound)  # exactly enough
    assert plan_module(module, x, time_limit=0).lower_bound == plan.lower_bound


def test_available_memory_is_what_the_cgroup_leaves_where_that_is_least(monkeypatch):
    """A container whose cgroup is nearly full: the memory check counts what the cgroup
    leaves (its limit less usage), not the machine's MemAvailable nor the limit alone."""
    import tensormem
    import tensormem.model as model
    real = model._available_memory_bytes()
    assert 0 < real <= min(tensormem.physical_memory_bytes(), tensormem.cgroup_memory_available_bytes())
    monkeypatch.setattr(model._tensormem, "cgroup_memory_available_bytes", lambda: 12345)
    assert model._available_memory_bytes() == 12345
    monkeypatch.setattr(model._tensormem, "cgroup_memory_available_bytes", lambda: 2**64 - 1)  # no limit
    assert 12345 < model._available_memory_bytes() <= tensormem.physical_memory_bytes()


def test_plan_module_says_when_it_cannot_check_the_memory():
    """An op without a fake-tensor kernel (repeat_interleave by a tensor of counts): the real
    trace plans it, with a warning that the memory was not checked; none when not asked."""
    import warnings

    class Repeated(torch.nn.Module):
        def forward(self, x):
            return torch.repeat_interleave(x, torch.tensor([1, 2]), dim=0) * 2

    x = torch.randn(2, 3)
    skipped = r"memory check skipped: no trace on fake tensors \(cannot trace Repeated"
    with pytest.warns(RuntimeWarning, match=skipped) as w:
        plan = plan_module(Repeated(), x, time_limit=0)
    assert w[0].filename == __file__  # the warning points at the caller's line
    assert plan.lower_bound > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan_module(Repeated(), x, time_limit=0, check_memory=False)


def test_any_failure_of_the_fake_trace_skips_the_check_and_never_the_plan(monkeypatch):
    import tensormem.model as model

    def broken(*args, **kwargs):
        raise KeyError("a fake-tensor failure of some other kind")

    monkeypatch.setattr(model, "_lower_bound_of", broken)  # after the trace on fake tensors
    module, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    with pytest.warns(RuntimeWarning, match="memory check skipped: no trace on fake tensors .*some other kind"):
        plan = plan_module(module, x, time_limit=0)
    assert plan.lower_bound > 0


def test_command_line_refuses_a_batch_whose_plan_passes_the_memory_in_one_line(capsys):
    """Parameters and inputs fit (one 1-layer gpt, 8 MB of token ids), the attention of 10^6
    tokens does not: refused in one line before the model runs (a batch of 4,000 resnet50
    images was ended by the out-of-memory killer)."""
    from tensormem.model import main
    start = time.perf_counter()
    assert main(["plan", "gpt", "--layers", "1", "--sequence", "1000000", "--training"]) == 1
    assert time.perf_counter() - start < 60
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert re.fullmatch(r"python3 -m tensormem.torch: gpt at batch 1: a plan of its activations needs at least "
                        r"[0-9.]+ GiB \(their lower bound, traced on fake tensors\), more than the [0-9.]+ GiB of "
                        r"memory available; try a smaller --sequence or --layers\n", err), err
    # At a batch above 1 the batch is named first; a model without those knobs names the batch alone.
    assert main(["plan", "gpt", "--layers", "1", "--sequence", "500000", "--batch", "2", "--training"]) == 1
    assert capsys.readouterr().err.endswith("; try a smaller --batch or --sequence or --layers\n")



class _StatefulModel(torch.nn.Module):
    """Batch norm (running statistics updated in place), dropout (random numbers) and a
    counter buffer, updated in place or, with ``replace``, replaced by a new tensor."""

    def __init__(self, replace=False):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.drop = torch.nn.Dropout(0.5)
        self.register_buffer("calls", torch.zeros(1))
        self.replace = replace

    def forward(self, x):
        if self.replace:
            self.calls = self.calls + 1
        else:
            self.calls.add_(1)
        return self.drop(self.norm(self.linear(x)))


@pytest.mark.parametrize("replace", [False, True])
@pytest.mark.parametrize("training", [False, True])
def test_planning_leaves_the_models_buffers_and_random_numbers_as_they_were(training, replace):
    torch.manual_seed(5)
    model = _StatefulModel(replace).train()
    x = torch.randn(4, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls_buffer = model.calls
    rng = torch.get_rng_state()
    plan = plan_module(model, x, training=training, time_limit=0.5)
    trace(model, x, training=training)
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k in before:  # batch norm's statistics and counter, the counter
        assert torch.equal(after[k], before[k]), k
    assert model.calls is calls_buffer  # the module's own tensor, also where the forward replaced it
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    if replace:  # the graph would not store the new counter: the run is refused, nothing changed
        with pytest.raises(UnsupportedGraph, match=r"replaces its buffer calls by a new tensor.*in place"):
            plan.run(x)
        assert torch.equal(model.calls, before["calls"])
        return
    # A planned run is a real step: it changes the buffers once, as an eager call does.
    reference = _StatefulModel().train()
    reference.load_state_dict(before)
    plan.run(x)
    reference(x)
    for k, v in reference.state_dict().items():
        assert torch.allclose(model.state_dict()[k], v, atol=1e-6), k


class _AddToInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x, y):
        x.add_(1.0)  # the input itself
        return self.linear(x) * y


class _CacheWrite(torch.nn.Module):
    """A key/value cache written at one position (through a view of the input), then read."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 6)

    def forward(self, cache, k, pos: int):
        cache[pos] = self.proj(k)
        return cache.sum(0)


class _DictInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 3)

    def forward(self, batch):
        batch["h"][:, 1:].relu_()  # a view of one entry of a dict input, in place
        return self.linear(batch["h"] @ batch["w"])


_WRITTEN_INPUTS = {
    "add_": (_AddToInput, lambda: (torch.randn(3, 4), torch.randn(3, 4))),
    "cache": (_CacheWrite, lambda: (torch.zeros(5, 6), torch.randn(6), 2)),
    "dict": (_DictInputs, lambda: ({"h": torch.randn(4, 5), "w": torch.randn(5, 2)},)),
}


def _tensor_leaves(inputs):
    return [t for t in torch.utils._pytree.tree_flatten(list(inputs))[0] if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("check_memory", [True, False])
@pytest.mark.parametrize("case, training", [("add_", False), ("add_", True), ("cache", False), ("dict", False),
                                            ("dict", True)])
def test_inputs_written_in_place_are_kept_by_planning_and_written_by_a_run(case, training, check_memory):
    # Eager code that writes into its inputs (a cache, x.add_) leaves them written: a planned
    # run does the same, and planning (which runs the module twice) leaves them as they were.
    # (Not the cache in training: its write carries a gradient, and eager code could not run
    # two steps on one cache tensor either.)
    make, inputs_of = _WRITTEN_INPUTS[case]
    torch.manual_seed(11)
    model = make()
    inputs = inputs_of()
    given = [t.clone() for t in _tensor_leaves(inputs)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every written input was copied and put back: nothing to warn of
        plan = plan_module(model, *inputs, training=training, time_limit=0.2, check_memory=check_memory)
        trace(model, *inputs, training=training)
    for t, before in zip(_tensor_leaves(inputs), given):
        assert torch.equal(t, before)  # planning and tracing left the caller's inputs alone
    assert plan.graph.written_inputs  # the graph knows which input it writes

    eager_inputs = torch.utils._pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, inputs)
    expected = model(*eager_inputs)
    out = plan.run(*inputs)
    if training:  # (loss, gradients): the loss is the sum of the output
        expected, out = expected.sum(), out[0]
    assert torch.allclose(out, expected, atol=1e-5)
    for t, e in zip(_tensor_leaves(inputs), _tensor_leaves(eager_inputs)):
        assert torch.allclose(t, e, atol=1e-6)  # written as the eager call wrote its copies
    changed = [not torch.equal(t, before) for t, before in zip(_tensor_leaves(inputs), given)]
    assert any(changed)


class _WritesItsParameters(torch.nn.Module):
    """Writes its parameters in place in the forward: halved under no_grad, raised through
    ``.data``, and an embedding's rows renormalized (``max_norm``)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((6,), 4.0))
        self.v = torch.nn.Parameter(torch.ones(6))
        self.embedding = torch.nn.Embedding(5, 6, max_norm=1.0)

    def forward(self, x, index):
        with torch.no_grad():
            self.w.mul_(0.5)
        self.v.data.add_(1.0)
        return x * self.w * self.v + self.embedding(index).sum(0)


@pytest.mark.parametrize("training", [False, True])
def test_parameters_the_forward_writes_are_put_back_by_planning(training):
    torch.manual_seed(3)
    model = _WritesItsParameters()
    inputs = (torch.randn(6), torch.tensor([1, 3]))
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the trace on fake tensors saw the writes: nothing to warn of
        plan = plan_module(model, *inputs, training=training, time_limit=0.2)
    assert sorted(plan.graph.written_state) == [0, 1, 2]  # w, v, the embedding's weight
    for k, v in model.named_parameters():
        assert torch.equal(v.detach(), before[k]), k
    # A planned run is a real call: it writes them once, as an eager call of a copy does.
    reference = _WritesItsParameters()
    reference.load_state_dict(model.state_dict())
    expected = reference(*inputs)
    out = plan.run(*inputs)
    if training:
        expected, out = expected.sum(), out[0]
    assert torch.allclose(out, expected, atol=1e-5)
    for (k, v), r in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(v.detach(), r.detach()), k
        if k != "embedding.weight":  # (rows 1 and 3 renormalized: already at max_norm after the first)
            assert not torch.equal(v.detach(), before[k]), k


def test_parameters_written_where_no_fake_trace_ran_are_named_in_a_warning():
    model = _WritesItsParameters()
    inputs = (torch.randn(6), torch.tensor([1, 3]))
    w = model.w.detach().clone()
    with pytest.warns(RuntimeWarning, match=r"writes w, v, embedding.weight in place and planning .* ran it: they "
                                            r"keep the writes") as record:
        plan_module(model, *inputs, check_memory=False, time_limit=0.2)
    assert record[0].filename == __file__
    assert torch.equal(model.w.detach(), w * 0.25)  # the trace's write and the eager measurement's
    with pytest.warns(RuntimeWarning, match=r"writes w, v, embedding.weight in place and the trace ran it") as record:
        trace(model, *inputs)
    assert record[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a model that writes no parameter: no warning
        plan_module(torch.nn.Linear(6, 6), torch.randn(2, 6), check_memory=False, time_limit=0.2)
        trace(torch.nn.Linear(6, 6), torch.randn(2, 6))


class _SharedOutputs(torch.nn.Module):
    def forward(self, x):
        y = x * 2
        z = x + 1
        return y, y, y[1:], y.t(), {"bits": y.view(torch.int32), "z": z, "z_again": [z.sum(1), z]}


def test_outputs_share_memory_in_a_run_exactly_where_they_do_in_an_eager_call():
    x = torch.randn(4, 4)
    plan = plan_module(_SharedOutputs(), x, time_limit=0.2)
    flat = lambda out: torch.utils._pytree.tree_flatten(out)[0]  # noqa: E731
    expected, got = flat(_SharedOutputs()(x)), flat(plan.run(x))
    assert len(got) == len(expected) == 8
    for e, o in zip(expected, got):
        assert torch.equal(o, e) and o.stride() == e.stride()
    shares = lambda ts: [[storage_of(a) == storage_of(b) for b in ts] for a in ts]  # noqa: E731
    assert shares(got) == shares(expected)
    assert not all(all(row) for row in shares(got))  # (y's and z's memory apart)
    # and apart from the arena of the next run
    again = flat(plan.run(x))
    assert all(storage_of(a) != storage_of(b) for a in again for b in got)
    got[0].fill_(7.0)  # written through one output, seen through the others of its buffer
    assert torch.equal(got[2], torch.full((3, 4), 7.0)) and bool((got[4] == torch.full((4, 4), 7.0).view(torch.int32)).all())


class _ReturnsItsInputsAndState(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4))
        self.register_buffer("count", torch.zeros(4))

    def forward(self, x, y):
        y.add_(1.0)
        self.count.add_(1.0)
        return (x, x[1:], x.t(), {"bits": x.view(torch.int32), "w": self.weight, "wt": self.weight.t()},
                y, y[0], self.count, self.count[2:], x @ self.weight)


def test_inputs_and_module_state_returned_by_a_run_are_the_callers_tensors_as_in_an_eager_call():
    # An input, a parameter or a module buffer returned, or a view of one, is that tensor (or
    # that view of it) in an eager call; a planned run returned a copy of each, so a write
    # through the output, or to the input after the call, was not seen through the other.
    import copy
    model, x, y = _ReturnsItsInputsAndState(), torch.randn(5, 4)[1:], torch.randn(4, 4)  # (x not at its storage's start)
    eager_model, eager_x, eager_y = copy.deepcopy(model), x.clone(), y.clone()
    plan = plan_module(model, x, y, time_limit=0.2)
    flat = lambda out: torch.utils._pytree.tree_flatten(out)[0]  # noqa: E731
    with torch.no_grad():
        expected = flat(eager_model(eager_x, eager_y))
    got = flat(plan.run(x, y))
    assert len(got) == len(expected) == 11
    for e, o in zip(expected, got):
        assert torch.equal(o, e) and o.stride() == e.stride() and o.dtype == e.dtype
    sources = lambda m, a, b: (a, b, m.weight, m.count)  # noqa: E731
    relation = lambda outs, ts: [[storage_of(o) == storage_of(t) for t in ts] for o in outs]  # noqa: E731
    identity = lambda outs, ts: [[o is t for t in ts] for o in outs]  # noqa: E731
    assert relation(got, sources(model, x, y)) == relation(expected, sources(eager_model, eager_x, eager_y))
    assert identity(got, sources(model, x, y)) == identity(expected, sources(eager_model, eager_x, eager_y))
    assert sum(map(any, identity(got, sources(model, x, y)))) == 4  # x, weight, y and count returned whole
    assert not any(relation(got[-1:], sources(model, x, y))[0])  # x @ weight: memory of its own
    # Views at their places: written through the caller's tensors, seen through the outputs.
    with torch.no_grad():
        x[1, 2] = 5.0
        model.count[3] = 9.0
        model.weight[0, 1] = 3.0
    assert got[1][0, 2] == 5.0 and got[2][2, 1] == 5.0 and got[3][1, 2] == torch.tensor(5.0).view(torch.int32)
    assert got[9][1] == 9.0 and got[5][1, 0] == 3.0
    # A caller's input laid out otherwise than the traced one is returned itself, and its
    # parts are the same parts of it (the views of any layout: the test below).
    x_t = torch.randn(4, 4).t()
    got = flat(plan.run(x_t, torch.randn(4, 4)))
    assert got[0] is x_t and torch.equal(got[1], x_t[1:]) and storage_of(got[1]) == storage_of(x_t)
    assert got[1].stride() == x_t[1:].stride() and got[1].data_ptr() == x_t[1:].data_ptr()


class _AddToSecondInput(torch.nn.Module):
    def forward(self, x, y):
        y.add_(1.0)
        return x * y


def test_with_a_trace_on_fake_tensors_planning_copies_only_the_inputs_the_forward_writes():
    # The copy that puts inputs back costs their bytes: with the fake trace's graph, only
    # the written ones are copied (and put back); without it, every tensor input.
    import tensormem.model as model
    fake = model._trace(_AddToInput(), (torch.zeros(3, 4), torch.zeros(3, 4)), False, None, "fake")
    assert fake.written_inputs == [0]
    for graph, y_put_back in ((fake, False), (None, True)):
        x, y = torch.zeros(3, 4), torch.zeros(3, 4)
        with model._writes_kept(torch.nn.Module(), (x, y), graph, "this test", 2):
            x.add_(1.0)
            y.add_(1.0)  # not written by this forward: with the graph, not copied, so not put back
        assert torch.equal(x, torch.zeros(3, 4))
        assert torch.equal(y, torch.zeros(3, 4)) == y_put_back
    # Where the real trace writes more than the fake one showed, what was not copied is named.
    x, y = torch.zeros(3, 4), torch.zeros(3, 4)
    with pytest.warns(RuntimeWarning, match=r"writes input 1 in place and this test ran it: it keeps the writes"):
        with model._writes_kept(torch.nn.Module(), (x, y), fake, "this test", 2) as real:
            real.append(model._trace(_AddToSecondInput(), (x, y), False, None, "fake"))


@pytest.mark.parametrize("where", ["model and inputs", "inputs"])
def test_a_call_off_the_cpu_is_planned_but_not_measured_or_run_in_cpu_memory(where, monkeypatch):
    # The meta device stands for any device but the CPU (a GPU): the plan's sizes hold there,
    # while the memory check, the eager peak and the run know CPU memory only. Before, the
    # eager peak read 0 bytes ("eager peak / planned arena: 0.000") and the check compared
    # the device's activations with this machine's memory.
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    if where == "model and inputs":
        model = model.to("meta")
    x = torch.randn(16, 64, device="meta")
    import tensormem.model
    try:
        model(x)
    except RuntimeError as e:  # PyTorch 2 refuses a CPU weight with a meta input, eagerly too
        assert "meta" in str(e)
        with pytest.raises(UnsupportedGraph, match=r"cannot trace Sequential: RuntimeError: .*meta"):
            plan_module(model, x, time_limit=0.2)
        return
    monkeypatch.setattr(tensormem.model, "_available_memory_bytes", lambda: 0)  # no CPU memory left to compare with
    with pytest.warns(RuntimeWarning, match=r"memory check skipped: tensors on meta, and the check knows this "
                                            r"machine's memory only") as record:
        plan = plan_module(model, x, time_limit=0.2)
    assert record[0].filename == __file__
    assert plan.elsewhere == ["meta"]
    assert plan.arena_bytes >= plan.lower_bound >= 16 * 64 * 4  # the sizes are the device's as much as the CPU's
    assert plan.eager_peak is None and "not measured: tensors on meta" in plan.eager_method
    report = plan.report()
    assert re.search(r"eager PyTorch peak +n/a +\(not measured: tensors on meta", report), report
    assert "eager peak / planned arena" not in report
    with pytest.raises(ValueError, match=r"arena in CPU memory; the plan was made for tensors on meta"):
        plan.run(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no check asked for: nothing skipped to warn of
        assert plan_module(model, x, time_limit=0.2, check_memory=False).eager_peak is None
    # Where the trace on fake tensors works (it does not on meta tensors; it does on a GPU's),
    # its bound is still not compared with the CPU's memory: a CPU model said to be elsewhere.
    cpu_model, cpu_x = torch.nn.Linear(64, 64), torch.randn(16, 64)
    with pytest.raises(MemoryError):
        plan_module(cpu_model, cpu_x, time_limit=0.2)
    monkeypatch.setattr(tensormem.model, "_devices_besides_cpu", lambda module, inputs: ["cuda:0"])
    with pytest.warns(RuntimeWarning, match=r"memory check skipped: tensors on cuda:0"):
        plan = plan_module(cpu_model, cpu_x, time_limit=0.2)
    assert plan.eager_peak is None and plan.elsewhere == ["cuda:0"]


def test_a_run_writes_no_input_the_graph_only_reads():
    model = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    plan = plan_module(model, x, time_limit=0.2)
    assert plan.graph.written_inputs == []
    version = x._version
    plan.run(x)
    assert x._version == version  # not even rewritten with its own values


@pytest.mark.parametrize("in_inference_mode", [False, True])
def test_a_model_made_under_inference_mode_is_planned_and_left_as_it_was(in_inference_mode):
    # Its buffers are inference tensors: PyTorch lets them change only inside inference
    # mode, so they are put back there, and not written at all where nothing changed them.
    with torch.inference_mode():
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    model.train(in_inference_mode)  # batch norm updates its statistics only where that is allowed
    x = torch.randn(4, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.inference_mode() if in_inference_mode else contextlib.nullcontext():
        plan = plan_module(model, x, time_limit=0.2)
    assert plan.arena_bytes > 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("kind", ["meta", "sparse"])
def test_buffers_that_cannot_be_compared_do_not_stop_the_plan(kind):
    # torch.equal has no meta or sparse kernel: such buffers are put back without comparing.
    class WithAux(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)
            aux = torch.zeros(3, device="meta") if kind == "meta" else torch.eye(3).to_sparse()
            self.register_buffer("aux", aux)

        def forward(self, x):
            return self.linear(x)

    model = WithAux()
    aux = model.aux
    plan = plan_module(model, torch.randn(4, 8), time_limit=0.2)
    assert plan.arena_bytes > 0
    assert model.aux is aux and model.aux.device.type == aux.device.type
    if kind == "sparse":
        assert torch.equal(model.aux.to_dense(), torch.eye(3))


def test_a_scripted_module_is_refused_as_untraceable():
    scripted = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)))
    with pytest.raises(UnsupportedGraph, match="cannot trace RecursiveScriptModule"):
        plan_module(scripted, torch.randn(4, 8), time_limit=0.2)
    with pytest.raises(UnsupportedGraph, match="cannot trace RecursiveScriptModule"):
        trace(scripted, torch.randn(4, 8))


def test_command_line_runs_a_training_step_in_training_mode_and_compares_its_gradients(capsys, monkeypatch):
    # squeezenet's dropout draws random numbers: the eager step gets the planned run's.
    import tensormem.model as model_module
    modes = []
    plan_module_of = model_module.plan_module

    def recording(module, *args, **kwargs):
        modes.append(module.training)
        return plan_module_of(module, *args, **kwargs)
    monkeypatch.setattr(model_module, "plan_module", recording)
    assert model_module.main(["plan", "squeezenet1_1", "--batch", "1", "--training", "--time-limit", "0",
                              "--run"]) == 0
    out, err = capsys.readouterr()
    assert modes == [True], modes
    assert "loss and gradients bitwise equal to eager PyTorch's" in out, out + err
    assert model_module.main(["plan", "squeezenet1_1", "--batch", "1", "--time-limit", "0", "--run"]) == 0
    assert modes == [True, False]
    assert "output bitwise equal to eager PyTorch's" in capsys.readouterr().out


def test_command_line_exits_1_when_the_planned_run_differs(capsys, monkeypatch):
    import tensormem.model as model_module
    run = model_module.ModulePlan.run
    monkeypatch.setattr(model_module.ModulePlan, "run", lambda plan, *inputs: run(plan, *inputs) * 1.01)
    assert model_module.main(["plan", "squeezenet1_1", "--batch", "1", "--time-limit", "0", "--run"]) == 1
    out, err = capsys.readouterr()
    assert "output DIFFERENT from eager PyTorch's" in out
    assert err.strip() == "python3 -m tensormem.torch: squeezenet1_1: the planned run's output differs from eager " \
                          "PyTorch's"


def test_the_largest_difference_tolerates_rounding_only():
    from tensormem.model import _largest_difference
    ref = (torch.tensor(4.0), [torch.tensor([20.0, -3.0]), torch.tensor([1e-7, 0.0])])
    rounded = (torch.tensor(4.0), [torch.tensor([20.0, -3.0001]), torch.tensor([2e-6, 0.0])])
    assert _largest_difference(rounded, ref) == pytest.approx(1e-4 / 20, rel=1e-2)  # of the largest value
    wrong = (torch.tensor(4.0), [torch.tensor([20.0, -3.0]), torch.tensor([0.5, 0.0])])
    assert _largest_difference(wrong, ref) is None
    assert _largest_difference((torch.tensor(4.0), [ref[1][0]]), ref) is None  # another structure
    assert _largest_difference(torch.tensor([1, 2]), torch.tensor([1, 3])) is None  # integers: exact
    assert _largest_difference(torch.tensor([float("nan")]), torch.tensor([1.0])) is None
    assert _largest_difference(torch.zeros(2), torch.zeros(2)) == 0.0
    assert _largest_difference((torch.tensor(1.0),), (1.0,)) is None  # a tensor against a number
    assert _largest_difference(torch.zeros(2), torch.zeros(1)) is None  # other shapes (broadcastable)
    assert _largest_difference(torch.zeros(2), torch.zeros(2, dtype=torch.float64)) is None  # other dtypes


def test_a_training_step_is_planned_whatever_the_callers_grad_mode():
    # Asked for inside torch.no_grad() (an evaluation loop), the training step is still traced
    # and measured with autograd on; inside inference mode, where no gradient can be taken,
    # it is refused in one clear line, before anything runs.
    import warnings
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    x = torch.randn(4, 8)
    with torch.no_grad():
        plan = plan_module(model, x, training=True, time_limit=0.2)
        graph = trace(model, x, training=True)
        assert not torch.is_grad_enabled()
    assert graph.training and len(graph.buffers) == len(plan.graph.buffers)
    loss, grads = plan.run(x)
    reference = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    assert len(grads) == 4 and all(torch.allclose(g, r) for g, r in zip(grads, reference))
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no "memory check skipped" on the way
        with pytest.raises(UnsupportedGraph, match=r"^a training step cannot be traced inside torch\.inference_mode"):
            plan_module(model, x, training=True)


@pytest.mark.parametrize("loss_fn, problem", [
    (lambda out: out, r"a tensor of shape \(4, 2\), not one value"),
    (lambda out: 3.0, r"a float, not a tensor"),
    (lambda out: out.argmax(), r"a torch\.int64 tensor, which has no gradient"),
    (lambda out: out.sum().detach(), r"a tensor that does not depend on the parameters"),
    (lambda out: (out.sum(), out), r"a tensor of shape \(4, 2\)"),
])
def test_a_loss_fn_that_returns_no_loss_is_named_as_such(loss_fn, problem):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with pytest.raises(UnsupportedGraph, match=r"^loss_fn returned " + problem):
        plan_module(model, torch.randn(4, 8), training=True, loss_fn=loss_fn, time_limit=0)


def test_a_loss_fn_may_return_several_losses():
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    plan = plan_module(model, x, training=True, loss_fn=lambda out: (out.sum(), out.pow(2).mean()), time_limit=0)
    (total, mean_square), grads = plan.run(x)
    out = model(x)
    reference = torch.autograd.grad((out.sum(), out.pow(2).mean()), list(model.parameters()))
    assert torch.allclose(total, out.sum()) and torch.allclose(mean_square, out.pow(2).mean())
    assert all(torch.allclose(g, r) for g, r in zip(grads, reference))


def test_command_line_says_what_batch_a_training_step_with_batch_norm_needs(capsys):
    # deeplabv3's pooling branch normalizes one value per channel at batch 1: a real training
    # step fails there in PyTorch too, and the command line says which batch works.
    from tensormem.model import main
    assert main(["plan", "deeplabv3_mobilenet_v3_large", "--training", "--time-limit", "0"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Expected more than 1 value per channel when training" in err, err
    assert err.rstrip().endswith("(batch norm in training mode needs 2 or more values per channel: try --batch 2)")


def test_value_dependent_ops_besides_indexing_are_refused_by_name():
    """Only ``aten.index.Tensor`` with integer indices is looked into; any other op whose output
    shape depends on the values is refused with its name, whatever its arguments are."""

    class Selected(torch.nn.Module):
        def forward(self, x):
            return torch.masked_select(x, x > 0)  # two tensor arguments, neither a list

    class Nonzero(torch.nn.Module):
        def forward(self, x):
            return torch.nonzero(x)

    for module, name in ((Selected(), "aten.masked_select"), (Nonzero(), "aten.nonzero")):
        with pytest.raises(UnsupportedGraph, match=f"{name}.*depends on the input values"):
            trace(module, torch.randn(6))


def test_an_unpacked_output_of_a_multi_output_op_is_as_decided_as_the_op():
    """Values unpacked from a multi-output op on constants are decided by the trace (planned
    when they set a shape); from an op on the inputs they are not (refused)."""

    class SortedConstant(torch.nn.Module):
        def forward(self, x):
            counts, _ = torch.sort(torch.tensor([2, 1, 3]))
            return torch.repeat_interleave(x, counts, dim=0)

    class SortedInput(torch.nn.Module):
        def forward(self, x):
            counts, _ = torch.sort(x[:, 0].abs().long() + 1)
            return torch.repeat_interleave(x, counts, dim=0)

    torch.manual_seed(0)
    x = torch.randn(3, 4)
    plan = planned_equals_eager(SortedConstant(), x, training=False)
    assert plan.run(x).shape == (6, 4)
    with pytest.raises(UnsupportedGraph, match="aten.repeat_interleave.*depends on the input values"):
        trace(SortedInput(), x)


def test_a_write_into_one_decided_value_leaves_the_others_decided():
    """An op on the inputs that writes into a decided value (a constant made in forward, or
    batch norm's running statistics, which are module state) undecides that value alone."""

    class OneOverwritten(torch.nn.Module):
        def forward(self, x):
            kept = torch.full((3,), 2, dtype=torch.long)
            counts = torch.ones(3, dtype=torch.long)
            counts.add_(x[:3, 0].abs().long())
            return torch.repeat_interleave(x, kept, dim=0) * counts.sum()

    class StatisticsWritten(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.BatchNorm1d(4)

        def forward(self, x):
            kept = torch.full((3,), 2, dtype=torch.long)
            return torch.repeat_interleave(self.norm(x), kept, dim=0)

    torch.manual_seed(0)
    x = torch.randn(3, 4)
    planned_equals_eager(OneOverwritten(), x, training=False)
    graph = trace(StatisticsWritten().train(), x)  # running_mean_ and the counter written in place
    assert any(op.startswith("aten.native_batch_norm") for op in graph.ops), graph.ops


def test_a_call_of_a_python_function_in_the_graph_is_refused_as_not_aten():
    from tensormem.model import _analyse

    class Plain(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x) + 1

    gm = torch.fx.symbolic_trace(Plain())  # torch.relu as a Python callable, not an aten overload
    with pytest.raises(UnsupportedGraph, match="unsupported op .*relu.*not an aten operator"):
        _analyse(gm, 0, 0, False)


def test_the_activation_bound_refuses_an_alignment_before_any_trace():
    from tensormem.torch import activation_lower_bound
    calls = []
    Counted = _counted_linear(calls)

    for alignment in (0, -64, 3, 48):
        with pytest.raises(ValueError, match=f"alignment must be a power of two, not {alignment}"):
            activation_lower_bound(Counted(4, 4), torch.randn(2, 4), alignment=alignment)
    assert calls == []
    assert activation_lower_bound(Counted(4, 4), torch.randn(2, 4), alignment=1) > 0


def test_run_refuses_an_input_placed_across_an_element():
    """The check covers the inputs' slots (placeholders), not only the ops' outputs."""
    torch.manual_seed(0)
    x = torch.randn(5)
    plan = plan_module(torch.nn.ReLU(), x, alignment=1, time_limit=0.2)
    (inp,) = [b for b in plan.graph.buffers if b.kind == "input"]
    plan.offsets[inp.id] += 2  # as a plan of other buffers could place it: valid bytes, split elements
    plan.arena_bytes += 2
    with pytest.raises(ValueError, match=rf"buffer {inp.name} holds 4-byte elements but starts at byte "):
        plan.run(x)


def test_the_eager_peak_without_the_hook_is_the_hooks_figure_from_the_profiler(monkeypatch):
    """Where tensormem has no allocator hook, torch.profiler's memory events give the eager
    peak: the hook's exact figure, every time (the profiler's per-op sums ran high at random
    where it nested a child op outside its parent)."""
    hook_or_skip()
    import tensormem.model as model

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    cases = [(mlp, torch.randn(32, 64), False), (mlp, torch.randn(32, 64), True),
             (torchvision.models.resnet18(weights=None).eval(), torch.randn(1, 3, 32, 32), False)]
    exact = [plan_module(m, x, training=t, time_limit=0) for m, x, t in cases]
    assert {p.eager_method for p in exact} == {"allocator hook"}

    def no_hook():
        raise RuntimeError("PyTorch's allocator hook cannot be used: (test)")

    monkeypatch.setattr(model, "_hook", no_hook)
    for _ in range(5):
        for (m, x, t), e in zip(cases, exact):
            p = plan_module(m, x, training=t, time_limit=0)
            assert p.eager_method == "torch.profiler memory events"
            assert p.eager_peak == e.eager_peak, (type(m).__name__, t, p.eager_peak, e.eager_peak)
    assert "(torch.profiler memory events)" in p.report()


def test_a_fake_trace_whose_sizes_cannot_be_read_is_no_trace(monkeypatch):
    """PyTorch 2 traces data-dependent sizes on fake tensors as symbols, and reading one as a
    number raises (GuardOnDataDependentSymNode) after the trace: that fake trace is refused
    as one that failed (UnsupportedGraph "cannot trace ..."), so the memory check is skipped
    with the reason; the same error from a real trace is a fault of the analysis and comes
    out as it is."""
    import tensormem.model as model

    class SymbolicSize(Exception):
        pass

    def analyse(*_args, **_kwargs):
        raise SymbolicSize("Could not extract specialized integer from data-dependent expression u0")

    monkeypatch.setattr(model, "_analyse", analyse)
    module, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    with pytest.raises(UnsupportedGraph, match=r"^cannot trace Linear: SymbolicSize: Could not extract"):
        model._trace(module, (x,), False, None, "fake")
    with pytest.raises(SymbolicSize):
        model._trace(module, (x,), False, None, "real")
    unchecked, fake = model._check_activations_fit(module, (x,), False, None, 1, True)
    assert fake is None and str(unchecked).startswith("cannot trace Linear: SymbolicSize")


def test_a_pytree_spec_is_counted_without_the_deprecated_attribute_where_there_is_another():
    """PyTorch 1.13's TreeSpec has children_specs only; PyTorch 2 has num_children and
    deprecates children_specs (a FutureWarning at every planned run)."""
    from torch.utils._pytree import tree_flatten
    from tensormem.model import _children

    assert _children(tree_flatten(((1, 2), 3, [4]))[1]) == 3

    class Release2:
        num_children = 4

        @property
        def children_specs(self):
            raise AssertionError("deprecated attribute read")

    class Method(Release2):
        def num_children(self):
            return 5

    class Release1:
        children_specs = [None] * 6

    assert (_children(Release2()), _children(Method()), _children(Release1())) == (4, 5, 6)


def test_the_profiler_peak_reads_event_times_of_either_pytorch_release():
    """PyTorch 1 gives a profiler event's start in microseconds (start_us), PyTorch 2 in
    nanoseconds (start_ns, with no start_us): the peak is the same from either, the events
    taken in time order (equal times in the profiler's order)."""
    from tensormem.model import _profiler_peak

    class Event:
        def __init__(self, us, nbytes, name="[memory]", device=torch.autograd.DeviceType.CPU):
            self._us, self._nbytes, self._name, self._device = us, nbytes, name, device

        def nbytes(self):
            return self._nbytes

        def name(self):
            return self._name

        def device_type(self):
            return self._device

    class Release1(Event):
        def start_us(self):
            return self._us

    class Release2(Event):
        def start_ns(self):
            return self._us * 1000 + 7

    # Listed out of time order: in order, +100 +50 -100 +80 (peak 150), where the listed
    # order's sums would reach 230; an op's event and another device's do not count.
    timeline = [(3, 80, "[memory]", None), (1, 50, "[memory]", None), (0, 100, "[memory]", None),
                (2, -100, "[memory]", None), (1, 999, "aten::add", None), (2, 999, "[memory]", "CUDA")]
    for release in (Release1, Release2):
        events = [release(us, n, name, torch.autograd.DeviceType.CUDA if device else torch.autograd.DeviceType.CPU)
                  for us, n, name, device in timeline]
        assert _profiler_peak(events) == 150, release.__name__
    # Equal times keep the profiler's order: a free recorded before an allocation of its time.
    same = [(0, 100, "[memory]", None), (5, -100, "[memory]", None), (5, 60, "[memory]", None)]
    for release in (Release1, Release2):
        assert _profiler_peak([release(us, n, name) for us, n, name, _ in same]) == 100


def test_sizes_print_in_mebibytes_below_a_gibibyte_and_in_gibibytes_from_it():
    from tensormem.model import _gib
    assert _gib(2**30 - 2**20) == "1023.0 MiB"
    assert _gib(2**30) == "1.0 GiB"
    assert _gib(3 * 2**29) == "1.5 GiB"


def test_an_explicit_storage_offset_given_by_keyword_moves_into_the_slot():
    """make_fx passes as_strided's storage offset by position; a graph that names it (as other
    PyTorch releases may) has it moved into the buffer's slot the same way."""

    class Strided(torch.nn.Module):
        def forward(self, x):
            y = x * 2
            return torch.as_strided(y, (2, 2), (1, 2), 3) * 1

    torch.manual_seed(0)
    x = torch.randn(8)
    for by_keyword in (False, True):
        plan = plan_module(Strided(), torch.randn(8), time_limit=0.2)
        node = next(n for n in plan.graph.module.graph.nodes if n.target is torch.ops.aten.as_strided.default)
        assert node.args[3] == 3 and not node.kwargs
        if by_keyword:
            node.args, node.kwargs = node.args[:3], {"storage_offset": 3}
        (y,) = [b for b in plan.graph.buffers if b.node == "mul"]
        assert int(plan.offsets[y.id]) > 0  # the input takes the arena's first bytes: the offset must move
        assert torch.equal(plan.run(x), Strided()(x))


def test_a_planned_run_counts_only_the_ops_whose_results_it_had_to_move():
    """An op with an ``out=`` overload writes straight into its slot; one without (layer norm's
    three outputs) computes elsewhere and is moved in, and only those are counted."""
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    for module, moved in ((torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)), 0),
                          (torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64)), 1)):
        plan = planned_equals_eager(module.eval(), x, training=False)
        assert plan.moved_ops == moved, (plan.graph.ops, plan.moved_ops)


class _ReturnsViewsOfItsInput(torch.nn.Module):
    def forward(self, x):
        return (x.permute(2, 0, 1), x[:, 1], x[..., ::2], x.transpose(0, 2)[1:], x.unsqueeze(1), x[0].t(),
                x.diagonal(dim1=1, dim2=2), x.narrow(2, 1, 2), x.reshape(-1), x.view(torch.int32),
                *x.chunk(2, dim=2), x.unsqueeze(0).expand(3, 2, 3, 4), x[1, 2, 3], x + 1)


_LAYOUTS = {"contiguous": lambda: torch.randn(2, 3, 4), "permuted": lambda: torch.randn(4, 2, 3).permute(1, 2, 0),
            "stepped": lambda: torch.randn(2, 3, 8)[..., ::2], "offset": lambda: torch.randn(3, 3, 4)[1:],
            "expanded": lambda: torch.randn(3, 4).expand(2, 3, 4),
            "permuted part": lambda: torch.randn(4, 2, 3, 2)[..., 1].permute(1, 2, 0),
            "window": lambda: torch.randn(2, 10, 10)[:, 3:6, 2:6],
            "overlapping": lambda: torch.randn(20).as_strided((2, 3, 4), (6, 2, 1))}


@pytest.mark.parametrize("traced", ["contiguous", "permuted", "stepped", "window", "expanded", "overlapping"])
@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_views_of_an_input_laid_out_otherwise_than_traced_are_its_views_as_in_an_eager_call(traced, layout):
    # Traced with one layout, run with another: each output that is a view of the input both
    # in an eager call with it and in the traced call (where the trace copied, as a reshape
    # of a permuted tensor does, the graph copies) is the same view of the caller's tensor
    # (the same memory, strides and values); any other output is memory of its own. Before,
    # every part of an input laid out otherwise than traced came back as a copy.
    model, example = _ReturnsViewsOfItsInput(), _LAYOUTS[traced]()
    plan = plan_module(model, example, time_limit=0.2)
    x = _LAYOUTS[layout]()
    if traced in ("expanded", "overlapping") and layout != traced:
        # The plan's slot holds fewer numbers than the input has: refused, where the run
        # computed with other values than the input's (overlapping) or raised PyTorch's
        # error for a copy into such memory (expanded).
        with pytest.raises(ValueError, match=r"input 0 has different values in elements that share memory"):
            plan.run(x)
        return
    got = plan.run(x)
    with torch.no_grad():
        expected = model(x)
        when_traced = model(example)
    assert len(got) == len(expected) == 15
    aliased = 0
    for i, (o, e, t) in enumerate(zip(got, expected, when_traced)):
        assert torch.equal(o, e) and o.dtype == e.dtype, i
        shares = storage_of(e) == storage_of(x) and storage_of(t) == storage_of(example)
        assert (storage_of(o) == storage_of(x)) == shares, (i, traced, layout)
        if shares:
            aliased += 1
            # (the stride of a dimension of one element walks nothing: an eager op's choice)
            steps = lambda u: [st for n, st in zip(u.shape, u.stride()) if n > 1]  # noqa: E731
            assert (o.data_ptr(), steps(o)) == (e.data_ptr(), steps(e)), (i, traced, layout)
    # every output but x + 1 and, where either layout keeps no dimensions together, the reshape
    viewed = traced in ("contiguous", "stepped") and layout in ("contiguous", "offset", "stepped")
    assert aliased == 13 + viewed


@pytest.mark.parametrize("traced", ["expanded", "overlapping"])
def test_an_input_that_fits_a_trace_with_shared_elements_runs_with_parts_of_its_own(traced):
    # Values equal wherever the traced input's elements share memory (that input made
    # contiguous, laid out otherwise): taken, and the run computes with them. Its parts come
    # back as copies: in the slot a part cannot be told from another over the same memory.
    model, example = _ReturnsViewsOfItsInput(), _LAYOUTS[traced]()
    plan = plan_module(model, example, time_limit=0.2)
    x = example.contiguous()
    got = plan.run(x)
    with torch.no_grad():
        expected = model(x)
    assert all(torch.equal(o, e) for o, e in zip(got, expected))
    assert not any(storage_of(o) == storage_of(x) for o in got)


class _WritesFirstReadsSecond(torch.nn.Module):
    def forward(self, x, y):
        x.add_(1.0)
        return y * 2


class _ReadsBoth(torch.nn.Module):
    def forward(self, x, y):
        return x * 2 + y


def _run_or_refusal(plan, *inputs):
    try:
        return plan.run(*inputs)
    except ValueError as e:
        return str(e)


def test_inputs_that_share_memory_run_as_in_an_eager_call_or_are_refused():
    # The graph reads each input from a copy of its own, and make_fx gives one tensor given
    # twice one placeholder: a planned run gave other results than the eager call, silently,
    # where the inputs shared memory otherwise than when traced.
    def fresh():
        return torch.zeros(4), torch.zeros(4)
    writes, reads = _WritesFirstReadsSecond(), _ReadsBoth()
    z = torch.zeros(8)
    separate = {m: plan_module(m, *fresh(), time_limit=0.2) for m in (writes, reads)}
    one = torch.zeros(4)
    once = {m: plan_module(m, one, one, time_limit=0.2) for m in (writes, reads)}
    overlapped = {m: plan_module(m, z[:4], z[2:6], time_limit=0.2) for m in (writes, reads)}
    cases = {  # plan, inputs -> the refusal's words, or None where the run must equal the eager call
        ("separate", "separate"): None, ("separate", "one"): "share memory here",
        ("separate", "overlapping"): "share memory here", ("one", "one"): None,
        ("one", "separate"): "were one tensor in the traced call", ("one", "overlapping"): "were one tensor",
        ("overlapped", "separate"): "share memory in the traced call",
        ("overlapped", "overlapping"): "share memory in the traced call",
        ("separate", "adjacent"): None, ("one", "adjacent"): "were one tensor",  # (touching, not sharing)
        ("separate", "same start"): "share memory here", ("one", "same start"): "were one tensor",
    }
    plans = {"separate": separate, "one": once, "overlapped": overlapped}
    for (planned, given), refusal in cases.items():
        for m in (writes, reads):
            def inputs():
                if given == "separate":
                    return [torch.arange(4.0), torch.arange(4.0) + 10]
                base = torch.arange(8.0)
                return {"one": [base[:4], base[:4]], "overlapping": [base[:4], base[2:6]],
                        "adjacent": [base[:4], base[4:]], "same start": [base[:4], base[::2]]}[given]
            got_inputs, eager_inputs = inputs(), inputs()
            got = _run_or_refusal(plans[planned][m], *got_inputs)
            # a refusal where the graph writes an input (or reads two as one); the same
            # inputs without a write run, since each copy holds the values read
            must_refuse = refusal is not None and (m is writes or planned == "one")
            if must_refuse:
                assert isinstance(got, str) and refusal in got, (planned, given, type(m).__name__, got)
                assert torch.equal(got_inputs[0], eager_inputs[0])  # nothing written before the refusal
                continue
            with torch.no_grad():
                expected = m(*eager_inputs)
            assert not isinstance(got, str), (planned, given, type(m).__name__, got)
            assert torch.equal(got, expected), (planned, given, type(m).__name__)
            assert all(torch.equal(a, b) for a, b in zip(got_inputs, eager_inputs)), (planned, given)


def test_self_attention_planned_with_one_tensor_runs_self_attention_only():
    # nn.MultiheadAttention called as self-attention (query, key and value one tensor) and
    # planned so: run so it equals the eager call; given three tensors (cross-attention),
    # refused rather than computed from the query alone.
    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(16, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    plan = plan_module(attention, x, x, x, time_limit=0.2)
    with torch.no_grad():
        expected = attention(x, x, x)
    got = plan.run(x, x, x)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, expected))
    with pytest.raises(ValueError, match=r"input 0 and input 1 were one tensor in the traced call"):
        plan.run(x, torch.randn(2, 5, 16), torch.randn(2, 5, 16))


def test_a_run_in_another_mode_than_traced_is_refused():
    # The graph holds what the traced call did in its modes: a run after .train() or
    # .eval(), with other parameters frozen for a training step, or under another CPU
    # autocast gave that call's results, not the eager call's, silently.
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 4))
    x = torch.randn(4, 8)
    m.eval()
    plan = plan_module(m, x, time_limit=0.2)
    m.train()
    with pytest.raises(ValueError, match=r"the module is in training mode now; the plan was traced in eval mode"):
        plan.run(x)
    m.eval()
    m[2].train()
    with pytest.raises(ValueError, match=r"^ModulePlan.run: 2 is in training mode now.*call .eval\(\) first"):
        plan.run(x)
    m.eval()
    with torch.no_grad():
        assert torch.equal(plan.run(x), m(x))
    # a training step: the parameters it differentiates
    step = plan_module(m, x, training=True, time_limit=0.2)
    m[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"parameter 0.weight does not require a gradient now; the training step "
                                         r"was traced with its gradient"):
        step.run(x)
    m[0].weight.requires_grad_(True)
    step.run(x)
    m.add_module("extra", torch.nn.Identity())
    with pytest.raises(ValueError, match=r"submodules or parameters are not those it was traced with"):
        step.run(x)
    del m.extra
    # CPU autocast: the graph holds the traced call's casts
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = plan_module(m, x, time_limit=0.2)
        got = cast.run(x)
        with torch.no_grad():
            expected = m(x)
    assert got.dtype == expected.dtype == torch.bfloat16 and torch.equal(got, expected)
    with pytest.raises(ValueError, match=r"CPU autocast is off here; the plan was traced with it on \(torch.bfloat16\)"):
        cast.run(x)
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            pytest.raises(ValueError, match=r"CPU autocast is on \(torch.bfloat16\) here; the plan was traced with it off"):
        plan.run(x)


def test_cpu_autocast_is_read_as_either_pytorch_release_asks(monkeypatch):
    # PyTorch 2.4 and later ask by device and warn that is_autocast_cpu_enabled and
    # get_autocast_cpu_dtype are deprecated; 1.13 has only those.
    import tensormem.model as model
    assert model._cpu_autocast() is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model._cpu_autocast() == torch.bfloat16

    def deprecated(*_args):
        raise AssertionError("the deprecated CPU autocast function was called")
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda device: {"cpu": torch.float16}[device], raising=False)
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device: {"cpu": True}[device])
    monkeypatch.setattr(torch, "get_autocast_cpu_dtype", deprecated)
    monkeypatch.setattr(torch, "is_autocast_cpu_enabled", deprecated)
    assert model._cpu_autocast() == torch.float16


class _ScalesByItsWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.w


class _WritesItsInputReadsItsWeight(_ScalesByItsWeight):
    def forward(self, x):
        x.add_(1.0)
        return self.w * 2


class _CountsAndDoubles(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(4))

    def forward(self, x):
        self.count.add_(1.0)
        return x * 2


def test_inputs_that_share_memory_with_the_modules_own_tensors_run_as_traced_or_are_refused():
    # make_fx gives a parameter given as the input one placeholder, the input's: traced so,
    # a run with another input computed x * x for x * w. And a run whose input is the
    # parameter the forward reads, of a forward that writes its input, read the parameter
    # before the write that the eager call sees through it.
    m = _ScalesByItsWeight()
    plan = plan_module(m, m.w, time_limit=0.2)
    with pytest.raises(ValueError, match=r"input 0 and the module's w were one tensor in the traced call"):
        plan.run(torch.full((4,), 3.0))
    with torch.no_grad():
        assert torch.equal(plan.run(m.w), m(m.w))
    m = _WritesItsInputReadsItsWeight()
    plan = plan_module(m, torch.zeros(4), time_limit=0.2)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"input 0 and the module's w share memory here, and the forward "
                                             r"writes input 0 in place"):
            plan.run(m.w)
        assert torch.equal(m.w, torch.ones(4))  # refused before anything was written
        x = torch.zeros(4)
        assert torch.equal(plan.run(x), m(torch.zeros(4))) and torch.equal(x, torch.ones(4))
    # The module's own buffer written, the input its memory: the eager call reads it after
    # the write.
    m = _CountsAndDoubles()
    plan = plan_module(m, torch.zeros(4), time_limit=0.2)
    with pytest.raises(ValueError, match=r"input 0 and the module's count share memory here, and the forward "
                                         r"writes the module's count in place"):
        plan.run(m.count)
    assert torch.equal(m.count, torch.zeros(4))


def test_two_views_alike_traced_are_two_inputs_of_the_graph():
    # Two tensor objects over the same memory, alike (base[:4] twice): make_fx gives each a
    # placeholder of its own, and the graph reads each, so a run with two tensors of their
    # own is the eager call's (one tensor object given twice is one placeholder: the test above).
    base = torch.arange(8.0)
    plan = plan_module(_ReadsBoth(), base[:4], base[:4], time_limit=0.2)
    x, y = torch.arange(4.0), torch.arange(4.0) + 10
    with torch.no_grad():
        assert torch.equal(plan.run(x, y), _ReadsBoth()(x, y))
