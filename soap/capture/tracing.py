"""Capture, stage 1: a module and its loss become an aten graph in the training IR (`_Traced`).

Owns the wrapper that puts the model and its loss in one module (`_WithLoss`, with the default loss), the
standard leaf modules (`LEAF_MODULES`, `_is_leaf`) and the two tracing paths. `torch.export.export`
(non-strict, training IR, not decomposed further) traces the wrapper on fake tensors, so neither the batch
nor activations ever take real memory. Where export fails, `torch.fx.symbolic_trace` with the leaf modules
traces it instead and each traced call is lowered to the same training-IR aten ops with
`make_fx(pre_dispatch=True)`, so both paths feed one grouping and mapping step and give the same op kinds
and names. Either way every aten node carries the ``nn_module_stack`` that grouping reads, and
placeholders are told apart as batch tensors, parameters and buffers by their state-dict names; the values
of the constant tensors export lifts out of the forward (``torch.tensor([])`` in a model's code) are kept,
so that capture can fold what they compute into constants.

Wrappers. The training IR wraps code run under ``torch.no_grad()`` or with autocast switched off in a
higher-order op (``wrap_with_set_grad_enabled``, ``wrap_with_autocast``) whose body is a subgraph, the
way Hugging Face rotary embeddings compute their tables. `_inline_wrappers` replaces each such wrapper by
its body's aten ops, so they map to op kinds (or fold into constants) like any others; outputs of a body
run without gradients pass through ``aten.detach``, which keeps that meaning.

Pieces before permutes. ``unbind`` becomes one ``select`` per piece, and a ``permute`` (or ``transpose``)
whose every reader is a ``select`` is replaced, per reader, by the ``select`` of the axis it permuted there
and then the permute of the axes left (none where they keep their order): ``qkv.permute(2, 0, 3, 1,
4).unbind(0)`` (timm's attention) becomes ``qkv.select(2, i).permute(0, 2, 1, 3)``. The values are the
same; the batch stays on the first axis of every op, where capture's kinds look for it, and q, k and v are
each one select of the qkv projection, which `fused` splits into three linears (`_selects_first`).

Recurrences batch first. A sequence-first ``nn.LSTM``, ``nn.GRU`` or ``nn.RNN`` (PyTorch's default,
``batch_first=False``) runs batch first between two transposes that belong to the calling module, so that
it maps to the recurrent kinds (batch first) instead of staying opaque (`_batch_first_recurrences`).

Dropout between layers. A stacked ``nn.LSTM``, ``nn.GRU`` or ``nn.RNN`` with dropout between its layers
computes layer by layer in training while capture traces (`soap.capture.recurrent`); what that forward
makes besides the recurrences (the dropouts, the final states' concatenation) belongs to the calling
module, so that each layer is a call of its own (`_recurrences_apart`).

Bidirectional recurrences. A bidirectional ``nn.LSTM``, ``nn.GRU`` or ``nn.RNN`` runs as one
unidirectional recurrence per layer and direction: the reverse direction
on the time-flipped input, its output flipped back (``flip`` ops), the two outputs concatenated for the
next layer, the final states concatenated in torch's order (`_bidirectional_recurrences`). Each
recurrence maps to a recurrent kind and splits by sample or runs in time chunks like any other.

Written out. ``nn.GLU`` is the product of its first half and the sigmoid of its second (two slices, a
sigmoid, a product); ``nn.PixelShuffle`` and ``nn.PixelUnshuffle`` are a reshape, a permute and a reshape;
``F.cosine_similarity`` of two tensors of one shape is norms, clamps, quotients, a product and a sum
(`_written_out`), so each splits instead of staying opaque.

Pools in 2-D. A 1-D max, average or adaptive average pooling of x[N, C, L] becomes the 2-D one of
``x.unsqueeze(2)`` then a squeeze, so that it maps to the pool kinds (`_pools_in_2d`).

Bags as embeddings. A sum or mean ``nn.EmbeddingBag`` of ids [N, L] (equal bags, no per-sample weights)
becomes the embedding of the ids then the sum or mean over the bag axis, so that it maps to the
``embedding`` and ``reduce`` kinds (`_bags_as_embeddings`); a max bag, or bags given by offsets, stay
opaque.

Casts of parameters. A cast of a parameter (or a buffer) to the dtype and device it already has is the
parameter itself (`_placeholder_casts_dropped`), so that the op reading it holds the parameter instead of
staying opaque: DeepSeek's router computes ``F.linear(x.float(), self.weight.float())``.

In-place writes. The training IR keeps a model's in-place ops (``shifted[:, 1:] = ids[:, :-1]`` is a
``slice`` then ``copy_``; ``masked_fill_``, ``fill_``, ``add_``, ...). `_functionalize` rewrites each into
its out-of-place form and, where it wrote through a chain of ``slice``, ``select`` or ``diagonal`` views,
scatters the new values back into the viewed tensor (``slice_scatter``, ...); through a view holding every
element of its base once (a reshape, flatten, squeeze or permute: MobileNetV2's in-place dropout of a
flattened tensor), the new values reshaped or permuted back are the base's (`_WHOLE_VIEWS`); later readers
of the written tensor read the new value. ``bernoulli_(p)`` (timm's drop path, on a ``new_empty`` tensor)
has no out-of-place overload: it becomes floor(u + p) of a ``rand`` u of the target's shape, 1 with
probability p, which draws as ``torch.rand`` does (`_written_value`). So capture sees values, never
aliases. A write through any other view, or a view taken before the write and read after it, is refused
with a clear error rather than captured wrong. ``detach_`` (an annotation on lifted constants) stays as it
is. The model's buffers the forward writes, in place or by assignment, are listed in
`_Traced.buffer_writes` for the builder to refuse (or keep, for BatchNorm): the rewrite gives later
readers the new value within the step only.

Imports torch and `recurrent` (the recurrent modules it rewrites); must not import the later capture stages
(`grouping`, `mappers`, `builder`), the simulator, the search, the runtime or soapflow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import operator
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.utils import _pytree as pytree

from soap.capture.recurrent import RECURRENT_MODULES

# the aten recurrences of the recurrent modules, and those modules' qualified names (as module stacks hold them)
_RECURRENT_OPS = (torch.ops.aten.lstm.input, torch.ops.aten.gru.input, torch.ops.aten.rnn_tanh.input,
                  torch.ops.aten.rnn_relu.input)
_RECURRENT_CLASSES = frozenset(f"{cls.__module__}.{cls.__qualname__}" for cls in RECURRENT_MODULES)

LEAF_MODULES: tuple[type[nn.Module], ...] = (
    nn.Conv2d, nn.Conv1d, nn.ConvTranspose2d, nn.Linear, nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm, nn.RMSNorm,
    nn.Embedding, nn.LSTM, nn.GRU, nn.RNN, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d,
    nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.Dropout, nn.Softmax, nn.Flatten, nn.Identity, nn.GroupNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LeakyReLU, nn.ReLU6, nn.Hardtanh, nn.ELU, nn.SELU,
    nn.CELU, nn.Softplus, nn.Mish, nn.Hardswish, nn.Hardsigmoid, nn.Upsample, nn.PReLU, nn.Dropout1d, nn.Dropout2d,
    nn.Dropout3d, nn.PixelShuffle, nn.PixelUnshuffle, nn.GLU,
)


# The wrapper's attribute holding the model: state-dict names and module paths start with it.
_MODEL = "model"


class ModelOutputError(ValueError):
    """The model's output is not what the default loss takes (a tensor): the model needs a loss of its own."""


def default_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """The loss of a model given none: mean squared error for float targets, cross entropy over the last
    axis of the output otherwise. An output that is not a tensor (a dict, a tuple) raises
    `ModelOutputError`."""
    return _default_loss(target)(output, target)


def _default_loss(target: torch.Tensor) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """`default_loss` for targets like `target`, chosen before tracing (a traced target is a proxy)."""
    fn = F.mse_loss if target.is_floating_point() else F.cross_entropy if target.dim() == 1 else _flat_cross_entropy

    def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
        if not isinstance(output, torch.Tensor | fx.Proxy):  # (a proxy: the output while torch.fx traces)
            raise ModelOutputError(
                f"the model returns a {type(output).__name__}, not a tensor, and no loss was given: return a "
                f"loss function that takes the model's output and the target as well (the model function's "
                f"third value)")
        return fn(output, target)

    return loss


def _flat_cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


@dataclasses.dataclass(slots=True)
class _BufferWrites:
    """Buffers written while tracing, by state-dict name. Not a plain dict attribute of the wrapper:
    torch.export puts back the module's dict and list attributes after tracing."""

    by_name: dict[str, str] = dataclasses.field(default_factory=dict)


class _WithLoss(nn.Module):
    """`model` and its loss as one module, so that one trace holds the whole training step's forward.

    `writes` collects the model's buffers the forward replaced or changed in place as it ran while tracing
    (state-dict name -> how), which the traced graph cannot show: an assignment ``self.b = ...`` under
    torch.export, an in-place op on a buffer that torch.fx ran eagerly rather than traced."""

    def __init__(self, model: nn.Module, loss_fn: Callable) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.writes = _BufferWrites()

    def forward(self, inputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        before = {name: (b, b._version) for name, b in self.model.named_buffers(remove_duplicate=False)}
        output = self.model(*inputs)
        for name, b in self.model.named_buffers(remove_duplicate=False):
            if name not in before or before[name][0] is not b:
                self.writes.by_name.setdefault(name, "an assignment")
            elif b._version != before[name][1]:
                self.writes.by_name.setdefault(name, "an in-place op")
        return self.loss_fn(output, target)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence the warnings and error logs torch emits while tracing (a failed export logs tracebacks)."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def _is_leaf(module: nn.Module) -> bool:
    return any(isinstance(module, cls) and type(module).forward is cls.forward for cls in LEAF_MODULES)


@dataclasses.dataclass(slots=True)
class _Traced:
    """Aten call nodes in topological order, and what each placeholder is.

    `params` and `buffers` map placeholders to the state-dict names in the captured module (the
    wrapper's ``model.`` prefix removed); `user_inputs` are the inputs then the target. `constants` holds
    the values of the lifted constant tensors among the buffers (export's ``lifted_tensor_0``, ...).
    `buffer_writes` names the model's buffers the forward writes (state-dict name -> the op or how) and
    that the rewrite of in-place writes turned into values read within the step only.
    """

    nodes: list[fx.Node]
    user_inputs: list[fx.Node]
    params: dict[fx.Node, str]
    buffers: dict[fx.Node, str]
    constants: dict[fx.Node, torch.Tensor] = dataclasses.field(default_factory=dict)
    buffer_writes: dict[str, str] = dataclasses.field(default_factory=dict)


def _model_fqn(fqn: str) -> str:
    return fqn.removeprefix(f"{_MODEL}.")


def _trace_export(wrapper: _WithLoss, inputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> _Traced:
    from torch.export.graph_signature import InputKind

    program = torch.export.export(wrapper, (inputs, target), strict=False)
    _inline_wrappers(program.graph_module)
    written = _functionalize(program.graph)
    _rewrite_forms(program.graph)
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    params: dict[fx.Node, str] = {}
    buffers: dict[fx.Node, str] = {}
    constants: dict[fx.Node, torch.Tensor] = {}
    user_inputs: list[fx.Node] = []
    for spec in program.graph_signature.input_specs:
        node = placeholders[spec.arg.name]
        if spec.kind == InputKind.PARAMETER:
            params[node] = _model_fqn(spec.target)
        elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            buffers[node] = _model_fqn(spec.target)
            value = program.constants.get(spec.target) if spec.kind == InputKind.CONSTANT_TENSOR else None
            if isinstance(value, torch.Tensor) and not isinstance(value, torch._subclasses.FakeTensor):
                constants[node] = value
        elif spec.kind == InputKind.USER_INPUT:
            user_inputs.append(node)
    nodes = [n for n in program.graph.nodes if n.op == "call_function"]
    return _Traced(nodes=nodes, user_inputs=user_inputs, params=params, buffers=buffers, constants=constants,
                   buffer_writes=_buffer_writes(wrapper, written, buffers))


def _buffer_writes(wrapper: _WithLoss, written: dict[fx.Node, str], buffers: dict[fx.Node, str]) -> dict[str, str]:
    """The model's buffers the traced forward writes: those `_functionalize` rewrote writes to, then those
    the wrapper saw change while the forward ran."""
    writes = {buffers[n]: op for n, op in written.items() if n in buffers}
    return writes | {_model_fqn(k): v for k, v in wrapper.writes.by_name.items() if _model_fqn(k) not in writes}


def _wrapped(node: fx.Node) -> tuple[bool, fx.Node, tuple] | None:
    """(gradients enabled, body attribute node, body arguments) of a wrapper `_inline_wrappers` inlines."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return None
    name = node.target.name()
    if name == "wrap_with_set_grad_enabled":
        return bool(node.args[0]), node.args[1], tuple(node.args[2:])
    if name == "wrap_with_autocast" and node.args[2] is False:
        # (device_type, dtype, enabled, cache_enabled, body, *args): with autocast off the body runs as is
        return True, node.args[4], tuple(node.args[5:])
    return None


def _inline_wrappers(gm: fx.GraphModule) -> None:
    """Replace every grad-mode or autocast-off wrapper in `gm` by its body's nodes, in place (nested
    wrappers first); a body run without gradients gets an ``aten.detach`` on each tensor output."""
    for node in list(gm.graph.nodes):
        wrapped = _wrapped(node)
        if wrapped is None:
            continue
        grad, body_attr, args = wrapped
        body = getattr(gm, body_attr.target)
        _inline_wrappers(body)
        graph = gm.graph
        env: dict[fx.Node, Any] = dict(zip([n for n in body.graph.nodes if n.op == "placeholder"], args,
                                           strict=True))
        outputs: Any = ()
        with graph.inserting_before(node):
            for b in body.graph.nodes:
                if b.op == "placeholder":
                    continue
                if b.op == "output":
                    outputs = fx.node.map_arg(b.args[0], env.__getitem__)
                    break
                if b.op == "get_attr":
                    name = f"_inlined_{len(list(gm.named_children()))}_{b.target}"
                    setattr(gm, name, getattr(body, b.target))
                    env[b] = graph.get_attr(name)
                    continue
                env[b] = graph.node_copy(b, env.__getitem__)
                env[b].meta.setdefault("nn_module_stack", node.meta.get("nn_module_stack"))
            outputs = list(outputs) if isinstance(outputs, tuple | list) else [outputs]
            if not grad:
                for i, out in enumerate(outputs):
                    if isinstance(out, fx.Node) and isinstance(out.meta.get("val"), torch.Tensor):
                        detached = graph.call_function(torch.ops.aten.detach.default, (out,))
                        detached.meta = {**out.meta, "val": out.meta["val"].detach()}
                        outputs[i] = detached
        for user in list(node.users):
            assert user.target is operator.getitem, (node.name, user.name)
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        if not body_attr.users:
            graph.erase_node(body_attr)


_SCATTER_OF_VIEW = {
    torch.ops.aten.slice.Tensor: torch.ops.aten.slice_scatter.default,
    torch.ops.aten.select.int: torch.ops.aten.select_scatter.default,
    torch.ops.aten.diagonal.default: torch.ops.aten.diagonal_scatter.default,
}
"""View op -> the op writing a view's new values back into its base: ``scatter(base, values, *view_args)``."""

_WHOLE_VIEWS = frozenset({
    torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.flatten.using_ints,
    torch.ops.aten.unflatten.int, torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim,
    torch.ops.aten.squeeze.dims, torch.ops.aten.squeeze.default, torch.ops.aten.permute.default,
    torch.ops.aten.transpose.int, torch.ops.aten.t.default, torch.ops.aten.alias.default,
})
"""Views holding every element of their base once (reshapes and permutes): values written through one
are the base's new values, reshaped or permuted back (`_whole_view_back`)."""


def _whole_view_back(view: fx.Node, values: fx.Node) -> tuple[Any, tuple, dict]:
    """The op, arguments and keyword arguments laying `values` (the new values of `view`, one of
    `_WHOLE_VIEWS`) out as the view's base: the inverse permutation, or a reshape to the base's shape."""
    perm = _permutation(view)
    if perm is not None:
        inverse = [0] * len(perm)
        for out_axis, in_axis in enumerate(perm):
            inverse[in_axis] = out_axis
        return torch.ops.aten.permute.default, (values, inverse), {}
    if view.target is torch.ops.aten.t.default and view.meta["val"].dim() == 2:
        return torch.ops.aten.t.default, (values,), {}
    return torch.ops.aten.reshape.default, (values, list(view.args[0].meta["val"].shape)), {}


def _writes_first_argument(node: fx.Node) -> bool:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    arguments = node.target._schema.arguments
    return bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write


def _is_view(node: Any) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function"
            and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view)


def _out_of_place(target: torch._ops.OpOverload) -> torch._ops.OpOverload:
    packet = getattr(torch.ops.aten, target._schema.name.split("::")[-1].rstrip("_"), None)
    overload = getattr(packet, target._overloadname, None) if packet is not None else None
    arguments = overload._schema.arguments if overload is not None else ()
    if not arguments or (arguments[0].alias_info is not None and arguments[0].alias_info.is_write):
        raise ValueError(f"the in-place op {target} has no out-of-place form to capture it with")
    return overload


def _written_value(graph: fx.Graph, node: fx.Node) -> tuple[fx.Node, fx.Node]:
    """The node holding the values in-place `node` writes, and the last node inserted after `node` (or
    `node`): its out-of-place op, or for ``copy_`` (whose out-of-place ``copy`` has no derivative) the
    source, cast to the target's dtype and expanded to its shape where they differ; for ``bernoulli_(p)``
    (timm's drop path) floor(u + p) of a uniform draw u of the target's shape (``rand``), which is 1 with
    probability p, so that it draws as ``torch.rand`` does (the ``random`` kind)."""
    if node.target is torch.ops.aten.bernoulli_.float:
        aten, val = torch.ops.aten, node.meta["val"]
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        add, stack = _Appender(graph, node, _fake_mode(node)), node.meta.get("nn_module_stack")
        drawn = add(aten.rand.default, ([int(n) for n in val.shape],), stack, dtype=val.dtype, device=val.device,
                    pin_memory=False)
        value = add(aten.floor.default, (add(aten.add.Tensor, (drawn, float(p)), stack),), stack)
        return value, value
    if node.target is not torch.ops.aten.copy_.default:
        with graph.inserting_after(node):
            value = graph.call_function(_out_of_place(node.target), node.args, node.kwargs)
        value.meta = dict(node.meta)
        return value, value
    target, source = node.args[0], node.args[1]
    want, value = target.meta["val"], source
    if not isinstance(source, fx.Node):
        raise ValueError("an in-place copy_ from a non-tensor cannot be captured")
    anchor = node
    if source.meta["val"].dtype != want.dtype:
        with graph.inserting_after(anchor):
            value = anchor = graph.call_function(torch.ops.aten._to_copy.default, (value,), {"dtype": want.dtype})
        value.meta = {**node.meta, "val": source.meta["val"].to(want.dtype)}
    if tuple(source.meta["val"].shape) != tuple(want.shape):
        with graph.inserting_after(anchor):
            value = anchor = graph.call_function(torch.ops.aten.expand.default, (value, list(want.shape)))
        value.meta = {**node.meta, "val": want}
    return value, anchor


def _rewrite_forms(graph: fx.Graph) -> None:
    """The rewrites that keep values and give the graph the forms capture's kinds split (the module
    docstring's pieces before permutes, recurrences apart, batch first and one direction at a time, what is
    written out, pools in 2-D, bags as embeddings and casts of parameters)."""
    _selects_first(graph)
    _recurrences_apart(graph)
    _batch_first_recurrences(graph)
    _bidirectional_recurrences(graph)
    _written_out(graph)
    _pools_in_2d(graph)
    _bags_as_embeddings(graph)
    _placeholder_casts_dropped(graph)


def _placeholder_casts_dropped(graph: fx.Graph) -> None:
    """Replace, in place, a cast of a placeholder (a parameter, a buffer) to the dtype and device it has
    by the placeholder itself (DeepSeek's router reads ``self.weight.type(torch.float32)`` of a float32
    weight): the value is the same, and the op reading it then holds the parameter (the module docstring's
    casts of parameters)."""
    aten = torch.ops.aten
    for node in list(graph.nodes):
        if (node.op != "call_function" or node.target not in (aten.to.dtype, aten._to_copy.default)
                or not isinstance(node.args[0], fx.Node) or node.args[0].op != "placeholder"):
            continue
        before, after = node.args[0].meta.get("val"), node.meta.get("val")
        if (not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor) or before.dtype != after.dtype
                or before.device != after.device or set(node.kwargs) - {"dtype", "layout", "device"}):
            continue
        node.replace_all_uses_with(node.args[0])
        graph.erase_node(node)


def _fake_mode(node: fx.Node) -> Any:
    """The fake mode `node`'s value was traced under (a context that does nothing where there is none), for
    computing the values of nodes a rewrite adds."""
    return torch._guards.detect_fake_mode([node.meta["val"]]) or contextlib.nullcontext()


def _selects_first(graph: fx.Graph) -> None:
    """Rewrite, in place, ``unbind`` into one ``select`` per piece, and a ``select`` of a ``permute`` (or
    ``transpose``) whose every reader selects into the ``select`` of the permuted axis then the permute
    of what is left (the module docstring's rule)."""
    aten = torch.ops.aten
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.unbind.int:
            continue
        users = list(node.users)
        if not users or not all(u.target is operator.getitem for u in users):
            continue
        x, dim = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        for u in users:
            with graph.inserting_before(u):
                piece = graph.call_function(aten.select.int, (x, dim, u.args[1]))
            piece.meta = {**node.meta, "val": u.meta["val"]}
            u.replace_all_uses_with(piece)
            graph.erase_node(u)
        graph.erase_node(node)
    for node in list(graph.nodes):
        perm = _permutation(node)
        users = list(node.users)
        if perm is None or not users or not all(u.target is aten.select.int and u.args[0] is node for u in users):
            continue
        x = node.args[0]
        mode = _fake_mode(x)
        for u in users:
            axis = int(u.args[1]) % len(perm)
            kept = [q - (q > perm[axis]) for j, q in enumerate(perm) if j != axis]
            with graph.inserting_before(u):
                piece = moved = graph.call_function(aten.select.int, (x, perm[axis], u.args[2]))
                if kept != sorted(kept):
                    moved = graph.call_function(aten.permute.default, (piece, kept))
            with mode:
                piece.meta = {**u.meta, "val": x.meta["val"].select(perm[axis], u.args[2])}
            if moved is not piece:
                moved.meta = dict(u.meta)
            u.replace_all_uses_with(moved)
            graph.erase_node(u)
        graph.erase_node(node)


def _batch_first_recurrences(graph: fx.Graph) -> None:
    """Rewrite, in place, each sequence-first ``lstm``, ``gru``, ``rnn_tanh`` or ``rnn_relu`` (PyTorch's
    default layout, (time, batch, features)) into a batch-first one between two transposes (the module
    docstring's rule); the transposes belong to the module that called the recurrent module."""
    aten, recurrent = torch.ops.aten, _RECURRENT_OPS
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in recurrent or len(node.args) != 9 or node.args[8]:
            continue
        x = node.args[0]
        if x.meta["val"].dim() != 3:
            continue
        stack = dict(node.meta.get("nn_module_stack") or {})
        outer = {k: v for k, v in list(stack.items())[:-1]}
        mode = _fake_mode(x)
        undone = x.target is aten.transpose.int and sorted(int(d) % 3 for d in x.args[1:3]) == [0, 1] \
            and len(x.users) == 1  # (the previous recurrence's output, back to sequence first: undone)
        if undone:
            swapped = x.args[0]
        else:
            first = node  # the module call's first node (its initial states come before the recurrence)
            while first.prev.op == "call_function" and first.prev.meta.get("nn_module_stack") == stack:
                first = first.prev
            with graph.inserting_before(first):
                swapped = graph.call_function(aten.transpose.int, (x, 0, 1))
        with mode:
            if not undone:
                swapped.meta = {"val": x.meta["val"].transpose(0, 1), "nn_module_stack": outer}
            out = node.meta["val"][0].transpose(0, 1).contiguous()
        node.args = (swapped, *node.args[1:8], True)
        if undone:
            graph.erase_node(x)
        node.meta["val"] = (out, *node.meta["val"][1:])
        for user in list(node.users):
            if user.target is operator.getitem and user.args[1] == 0:
                user.meta["val"] = out
                with graph.inserting_after(user):
                    back = graph.call_function(aten.transpose.int, (user, 0, 1))
                with mode:
                    back.meta = {"val": out.transpose(0, 1), "nn_module_stack": outer}
                user.replace_all_uses_with(back, delete_user_cb=lambda u, back=back: u is not back)


class _Appender:
    """Adds nodes to a graph one after the other from `after`, each with its value computed under `mode`
    and the module stack it is given."""

    def __init__(self, graph: fx.Graph, after: fx.Node, mode: Any):
        self.graph, self.cursor, self.mode = graph, after, mode

    def __call__(self, target: Any, args: tuple, module_stack: dict, **kwargs: Any) -> fx.Node:
        with self.graph.inserting_after(self.cursor):
            self.cursor = self.graph.call_function(target, args, kwargs)
        with self.mode:
            vals = [a.meta["val"] if isinstance(a, fx.Node) else
                    [v.meta["val"] for v in a] if isinstance(a, list) and a and isinstance(a[0], fx.Node) else a
                    for a in args]
            self.cursor.meta = {"val": target(*vals, **kwargs), "nn_module_stack": module_stack}
        return self.cursor


def _recurrences_apart(graph: fx.Graph) -> None:
    """Give the calling module, in place, every node a recurrent module's call makes besides its
    recurrences, their outputs and the zero states they start from: the dropouts between the layers and
    the final states' concatenation of a module run layer by layer (`soap.capture.recurrent`), so that
    each layer's recurrence is one call of the module of its own."""
    aten, recurrent = torch.ops.aten, _RECURRENT_OPS
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if node.op != "call_function" or not stack:
            continue
        cls = list(stack.values())[-1][1]
        name = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
        if name not in _RECURRENT_CLASSES or node.target in recurrent or (
                node.target is operator.getitem and node.args[0].target in recurrent) or (
                node.target is aten.zeros.default and all(u.target in recurrent for u in node.users)):
            continue
        node.meta["nn_module_stack"] = dict(list(stack.items())[:-1])


def _bidirectional_recurrences(graph: fx.Graph) -> None:
    """Rewrite, in place, each batch-first bidirectional ``lstm``, ``gru``, ``rnn_tanh`` or ``rnn_relu``
    from zero states into one unidirectional recurrence per layer and direction (the module docstring's
    rule): the reverse one runs on the time-flipped input and its output is flipped back, the directions'
    outputs are concatenated for the next layer, and the final states are the concatenation of each
    one's. The recurrences stay the module's (each from its own zero states); flips and concatenations
    belong to the calling module, so each recurrence is one call of the module."""
    aten, recurrent = torch.ops.aten, _RECURRENT_OPS
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in recurrent or len(node.args) != 9:
            continue
        x, hx, weights, biases, layers, dropout, train, bidirectional, batch_first = node.args
        states = list(hx) if isinstance(hx, list | tuple) else [hx]
        if (not bidirectional or not batch_first or not biases or len(weights) != 8 * layers
                or (dropout and train and layers > 1)
                or not all(isinstance(h, fx.Node) and h.target is aten.zeros.default and len(h.users) == 1
                           for h in states)
                or any(u.target is not operator.getitem for u in node.users)):
            continue
        stack = dict(node.meta.get("nn_module_stack") or {})
        outer = {k: v for k, v in list(stack.items())[:-1]}
        mode = _fake_mode(x)
        n, hidden = x.meta["val"].shape[0], weights[1].meta["val"].shape[1]
        ends: list[list[fx.Node]] = [[] for _ in states]  # per state, each layer's and direction's final one
        add = _Appender(graph, node, mode)
        layer_in = x
        for layer in range(layers):
            outs = []
            for direction in (0, 1):
                source = add(aten.flip.default, (layer_in, [1]), outer) if direction else layer_in
                zeros = [add(aten.zeros.default, ([1, n, hidden],), stack, **h.kwargs) for h in states]
                first = 8 * layer + 4 * direction
                run = add(node.target, (source, zeros if isinstance(hx, list | tuple) else zeros[0],
                                        list(weights[first:first + 4]), True, 1, 0.0, train, False, True), stack)
                pieces = [add(operator.getitem, (run, i), stack) for i in range(1 + len(states))]
                for k in range(len(states)):
                    ends[k].append(pieces[1 + k])
                outs.append(add(aten.flip.default, (pieces[0], [1]), outer) if direction else pieces[0])
            layer_in = add(aten.cat.default, (outs, 2), outer)
        finals = [add(aten.cat.default, (ends[k], 0), outer) for k in range(len(states))]
        for user in list(node.users):
            user.replace_all_uses_with(layer_in if user.args[1] == 0 else finals[user.args[1] - 1])
            graph.erase_node(user)
        graph.erase_node(node)
        for h in states:
            graph.erase_node(h)
        for final in finals:
            if not final.users:
                graph.erase_node(final)


def _written_out(graph: fx.Graph) -> None:
    """Rewrite, in place, ``glu``, ``pixel_shuffle``, ``pixel_unshuffle`` and ``cosine_similarity`` into
    the ops that compute them (the module docstring's rule): x.glu(d) = a * sigmoid(b) for the halves a, b
    of x along d; the shuffles a reshape, a permute and a reshape; the cosine similarity of x and y (of one
    shape) the sum of x / max(|x|, eps) * y / max(|y|, eps) along its axis."""
    aten = torch.ops.aten
    for node in list(graph.nodes):
        if node.op != "call_function" or node.kwargs or node.target not in (
                aten.glu.default, aten.pixel_shuffle.default, aten.pixel_unshuffle.default,
                aten.cosine_similarity.default):
            continue
        x = node.args[0]
        if not isinstance(x, fx.Node):
            continue
        shape = list(x.meta["val"].shape)
        # the nodes that compute it go just before it, in its module
        add, stack = _Appender(graph, node.prev, _fake_mode(x)), node.meta.get("nn_module_stack")
        if node.target is aten.cosine_similarity.default:
            y = node.args[1]
            if not isinstance(y, fx.Node) or list(y.meta["val"].shape) != shape or not shape:
                continue  # (operands that broadcast: left as they are)
            dim = int(node.args[2]) % len(shape) if len(node.args) > 2 else 1 % len(shape)
            eps = float(node.args[3]) if len(node.args) > 3 else 1e-8
            units = []  # each operand over its norm along `dim`, clamped below by eps (PyTorch's)
            for t in (x, y):
                norm = add(aten.linalg_vector_norm.default, (t, 2, [dim]), stack)
                clamped = add(aten.clamp_min.default, (norm, eps), stack)
                units.append(add(aten.div.Tensor, (t, add(aten.unsqueeze.default, (clamped, dim), stack)), stack))
            value = add(aten.sum.dim_IntList, (add(aten.mul.Tensor, tuple(units), stack), [dim]), stack)
        elif node.target is aten.glu.default:
            dim = int(node.args[1]) % len(shape) if len(node.args) > 1 else len(shape) - 1
            half = shape[dim] // 2
            first = add(aten.slice.Tensor, (x, dim, 0, half), stack)
            gate = add(aten.sigmoid.default, (add(aten.slice.Tensor, (x, dim, half, 2 * half), stack),), stack)
            value = add(aten.mul.Tensor, (first, gate), stack)
        else:
            if len(shape) != 4:
                continue
            n, c, h, w = shape
            r = int(node.args[1])
            if node.target is aten.pixel_shuffle.default:
                split, perm, merged = [n, c // (r * r), r, r, h, w], [0, 1, 4, 2, 5, 3], [n, c // (r * r), h * r, w * r]
            else:
                split, perm, merged = [n, c, h // r, r, w // r, r], [0, 1, 3, 5, 2, 4], [n, c * r * r, h // r, w // r]
            permuted = add(aten.permute.default, (add(aten.reshape.default, (x, split), stack), perm), stack)
            value = add(aten.reshape.default, (permuted, merged), stack)
        node.replace_all_uses_with(value)
        graph.erase_node(node)


def _pools_in_2d(graph: fx.Graph) -> None:
    """Rewrite, in place, each 1-D max, average or adaptive average pooling of x[N, C, L] into the 2-D one
    of x.unsqueeze(2) (height 1) then a squeeze: the same values, pooled by the pool kinds (the module
    docstring's rule)."""
    aten = torch.ops.aten

    def two_d(node: fx.Node) -> tuple[Any, tuple] | None:
        a = list(node.args)
        if node.target is aten.max_pool1d.default:  # (x, kernel, stride, padding, dilation, ceil_mode)
            a += [[], [0], [1], False][len(a) - 2:]
            kernel = list(a[1])
            return aten.max_pool2d.default, ([1, *kernel], [1, *(a[2] or kernel)], [0, *a[3]], [1, *a[4]], a[5])
        if node.target is aten.avg_pool1d.default:  # (x, kernel, stride, padding, ceil_mode, count_include_pad)
            a += [[], [0], False, True][len(a) - 2:]
            kernel = list(a[1])
            return aten.avg_pool2d.default, ([1, *kernel], [1, *(a[2] or kernel)], [0, *a[3]], a[4], a[5])
        if node.target is aten.adaptive_avg_pool1d.default:
            return aten.adaptive_avg_pool2d.default, ([1, *a[1]],)
        return None

    for node in list(graph.nodes):
        found = two_d(node) if node.op == "call_function" and not node.kwargs else None
        x = node.args[0] if found else None
        if found is None or not isinstance(x, fx.Node) or x.meta["val"].dim() != 3:
            continue
        target, args = found
        mode = _fake_mode(x)
        with graph.inserting_before(node):
            tall = graph.call_function(aten.unsqueeze.default, (x, 2))
            pooled = graph.call_function(target, (tall, *args))
            flat = graph.call_function(aten.squeeze.dim, (pooled, 2))
        with mode:
            tall.meta = {**node.meta, "val": x.meta["val"].unsqueeze(2)}
            pooled.meta = {**node.meta, "val": target(tall.meta["val"], *args)}
        flat.meta = dict(node.meta)
        node.replace_all_uses_with(flat)
        graph.erase_node(node)


def _bags_as_embeddings(graph: fx.Graph) -> None:
    """Rewrite, in place, each sum or mean ``embedding_bag`` of equal bags (an ``nn.EmbeddingBag`` given
    ids [N, L]: the flattened ids and offsets ``arange(0, N * L, L)``) into the embedding of the ids then
    the sum or mean over the bag axis (the module docstring's rule)."""
    aten = torch.ops.aten
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (aten.embedding_bag.default,
                                                                aten.embedding_bag.padding_idx):
            continue
        a = [*node.args, *([None] * (9 - len(node.args)))]
        weight, flat, offsets, scale_grad, mode, sparse, per_sample, last_offset, padding = a
        x = flat.args[0] if isinstance(flat, fx.Node) and flat.target in (aten.reshape.default,
                                                                           aten.view.default) else None
        if (x is None or node.kwargs or mode not in (0, 1) or scale_grad or sparse or per_sample is not None
                or last_offset or padding not in (None, -1) or x.meta["val"].dim() != 2):
            continue
        n, length = x.meta["val"].shape
        if not (isinstance(offsets, fx.Node) and offsets.target is aten.arange.start_step
                and list(offsets.args[:3]) == [0, n * length, length]):
            continue
        outs = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
        if any(u.target is not operator.getitem or (u.args[1] != 0 and u.users) for u in node.users):
            continue
        mode_fn = (aten.sum.dim_IntList, aten.mean.dim)[mode]
        mode = _fake_mode(x)
        with graph.inserting_before(node):
            looked = graph.call_function(aten.embedding.default, (weight, x))
            bagged = graph.call_function(mode_fn, (looked, [1]))
        with mode:
            looked.meta = {**node.meta, "val": aten.embedding.default(weight.meta["val"], x.meta["val"])}
            bagged.meta = {**node.meta, "val": mode_fn(looked.meta["val"], [1])}
        for u in outs:
            u.replace_all_uses_with(bagged)
        for u in list(node.users):
            graph.erase_node(u)
        graph.erase_node(node)
        for dead in (flat, offsets):
            if not dead.users:
                graph.erase_node(dead)


def _permutation(node: fx.Node) -> list[int] | None:
    """The axes order of a ``permute`` or ``transpose`` node, else None."""
    if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor):
        return None
    ndim = node.meta["val"].dim()
    if node.target is torch.ops.aten.permute.default:
        return [int(d) % ndim for d in node.args[1]]
    if node.target is torch.ops.aten.transpose.int:
        a, b = int(node.args[1]) % ndim, int(node.args[2]) % ndim
        perm = list(range(ndim))
        perm[a], perm[b] = perm[b], perm[a]
        return perm
    return None


def _functionalize(graph: fx.Graph) -> dict[fx.Node, str]:
    """Rewrite every in-place write of `graph` out of place (the module docstring's rules), in place;
    returns the placeholders written (through views or directly), each with the first op writing it."""
    written_inputs: dict[fx.Node, str] = {}
    for node in list(graph.nodes):
        if not _writes_first_argument(node) or node.target is torch.ops.aten.detach_.default:
            continue
        later = set()
        cursor = node.next
        while cursor.op != "root":
            later.add(cursor)
            cursor = cursor.next
        target = node.args[0]
        value, anchor = _written_value(graph, node)
        # write the new values back through the chain of views, innermost first
        written, new, chain = target, value, [target]
        while _is_view(written):
            base = written.args[0]
            scatter = _SCATTER_OF_VIEW.get(written.target)
            if scatter is not None:
                back, args, kwargs = scatter, (base, new, *written.args[1:]), dict(written.kwargs)
            elif written.target in _WHOLE_VIEWS:
                # a view holding every element of its base once: its new values, laid out as the base
                back, args, kwargs = _whole_view_back(written, new)
            else:
                raise ValueError(f"an in-place {node.target} writes through a {written.target} view, which "
                                 f"capture cannot write back; write the value out of place instead")
            with graph.inserting_after(anchor):
                new = anchor = graph.call_function(back, args, kwargs)
            new.meta = {**node.meta, "val": base.meta.get("val")}
            written = base
            chain.append(written)
        aliases = [u for u in written.users if _is_view(u) and u not in later and u is not target] + chain[1:-1]
        stale = [a.name for a in aliases if any(r in later for r in a.users)]
        if stale:
            raise ValueError(f"a view ({stale[0]}) taken before an in-place {node.target} is read after it; "
                             f"capture cannot follow the alias")
        for user in list(target.users):
            if user in later:
                user.replace_input_with(target, value)
        if written is not target:
            for user in list(written.users):
                if user in later:
                    user.replace_input_with(written, new)
        if written.op == "placeholder":
            written_inputs.setdefault(written, str(node.target.overloadpacket))
        node.replace_all_uses_with(value)
        graph.erase_node(node)
    return written_inputs


class _LeafTracer(fx.Tracer):
    """Symbolic tracing that stops at the leaf modules and at ``nn.MultiheadAttention``, whose forward
    branches on its arguments' shapes (it is then run on fake tensors like a leaf's call)."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return _is_leaf(m) or isinstance(m, nn.MultiheadAttention)


def _trace_fx(wrapper: _WithLoss, inputs: tuple[torch.Tensor, ...], target: torch.Tensor,
              fake_mode: Any) -> _Traced:
    """symbolic_trace with leaf modules, then each call lowered to training-IR aten ops by make_fx."""
    from torch.fx._symbolic_trace import PH

    with _buffers_restored(wrapper):
        graph = _LeafTracer().trace(wrapper, concrete_args={"inputs": tuple(PH for _ in inputs), "target": PH})
    out = fx.Graph()
    params: dict[fx.Node, str] = {}
    buffers: dict[fx.Node, str] = {}
    by_fqn: dict[str, fx.Node] = {}

    def state_placeholder(fqn: str, tensor: torch.Tensor, table: dict[fx.Node, str]) -> fx.Node:
        node = out.placeholder(f"s{len(by_fqn)}")
        node.meta["val"] = fake_mode.from_tensor(tensor, static_shapes=True)
        table[node] = _model_fqn(fqn)
        by_fqn[fqn] = node
        return node

    for fqn, p in wrapper.named_parameters():
        state_placeholder(fqn, p, params)
    for fqn, b in wrapper.named_buffers():
        state_placeholder(fqn, b, buffers)
    user_inputs = []
    for i, t in enumerate((*inputs, target)):
        node = out.placeholder(f"u{i}")
        node.meta["val"] = t
        user_inputs.append(node)

    env: dict[fx.Node, Any] = {}
    placeholders = iter(user_inputs)
    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = next(placeholders)
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
        if node.op == "output":
            out.output(args[0])
            break
        stack = dict(node.meta.get("nn_module_stack") or {})
        if node.op == "get_attr":
            if node.target not in by_fqn:
                state_placeholder(node.target, _get_attr(wrapper, node.target), buffers)
            env[node] = by_fqn[node.target]
        elif node.op == "call_module":
            module = wrapper.get_submodule(node.target)
            state = {k: by_fqn[f"{node.target}.{k}"]
                     for k, _ in (*module.named_parameters(), *module.named_buffers())}
            key = next(reversed(stack)) if stack else node.target
            stack = {**{k: v for k, v in stack.items() if k != key}, f"{key}@{node.name}": (node.target, "")}
            env[node] = _inline(out, _call_module(module), (state, *args), kwargs, stack)
        elif (node.op == "call_function" and node.target is operator.getitem
              and not isinstance(args[0], fx.Node)):
            env[node] = args[0][args[1]]
        elif node.op == "call_method":
            env[node] = _inline(out, _call_method(node.target), args, kwargs, stack)
        else:
            env[node] = _inline(out, node.target, args, kwargs, stack)
    written = _functionalize(out)
    _rewrite_forms(out)
    nodes = [n for n in out.nodes if n.op == "call_function"]
    return _Traced(nodes=nodes, user_inputs=user_inputs, params=params, buffers=buffers,
                   buffer_writes=_buffer_writes(wrapper, written, buffers))


@contextlib.contextmanager
def _buffers_restored(root: nn.Module) -> Iterator[None]:
    """Symbolic tracing runs a forward's in-place ops on buffers eagerly (a buffer is a real tensor there,
    not a proxy) and its assignments for real: afterwards each buffer is put back, object and values, so
    that capturing never changes the model (the wrapper has recorded the writes by then)."""
    saved = [(owner, name, b, b._version, b.detach().clone())
             for owner in root.modules() for name, b in owner._buffers.items() if b is not None]
    try:
        yield
    finally:
        with torch.no_grad():
            for owner, name, b, version, values in saved:
                owner._buffers[name] = b
                if b._version != version:
                    b.copy_(values)


def _get_attr(root: nn.Module, target: str) -> torch.Tensor:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _call_module(module: nn.Module) -> Callable:
    def call(state: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        return torch.func.functional_call(module, state, args, kwargs)
    return call


def _call_method(method: str) -> Callable:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, method)(*args, **kwargs)
    return call


def _inline(out: fx.Graph, fn: Callable, args: tuple, kwargs: dict, stack: dict) -> Any:
    """Append the aten ops of `fn(*args, **kwargs)` to `out`; returns the result with nodes for tensors."""
    from torch.fx.experimental.proxy_tensor import make_fx

    flat, spec = pytree.tree_flatten((args, kwargs))
    slots = [i for i, x in enumerate(flat) if isinstance(x, fx.Node)]

    def call(*tensors: torch.Tensor) -> Any:
        items = list(flat)
        for i, t in zip(slots, tensors, strict=True):
            items[i] = t
        a, k = pytree.tree_unflatten(items, spec)
        return fn(*a, **k)

    values = [flat[i].meta["val"] for i in slots]
    versions = [v._version for v in values]
    fake_mode = torch._guards.detect_fake_mode(values)
    with fake_mode or contextlib.nullcontext():
        eager = call(*values)
    # a call returning no tensor still counts where it wrote one of its arguments (``x[:, :8] = 0``)
    if (not any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(eager))
            and all(v._version == n for v, n in zip(values, versions, strict=True))):
        return eager
    sub = make_fx(call, pre_dispatch=True)(*values)
    _inline_wrappers(sub)
    sub_inputs = [n for n in sub.graph.nodes if n.op == "placeholder"]
    before = len(out.nodes)
    result = out.graph_copy(sub.graph, dict(zip(sub_inputs, [flat[i] for i in slots], strict=True)))
    for node in itertools.islice(reversed(out.nodes), len(out.nodes) - before):
        node.meta["nn_module_stack"] = stack
    return result

