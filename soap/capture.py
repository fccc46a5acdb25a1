"""Capture: a PyTorch module and an example batch become an `OperatorGraph` (DESIGN.md section 3).

Owns the translation from torch programs to the op kinds of ``docs/op_kinds.md``: tracing, grouping into
operators, naming, shapes, FLOPs and bytes. The only module of `soap` that imports torch; it must not
import the simulator, the search or the runtime.

Method. The module and its loss are wrapped in one `nn.Module` (``model`` and ``loss_fn``) and traced with
`torch.export.export` (non-strict, training IR, not decomposed further) on fake tensors, so neither the
batch nor activations ever take real memory. Where export fails, `torch.fx.symbolic_trace` with the
standard leaf modules traces the model instead and each traced call is lowered to the same training-IR
aten ops with `make_fx(pre_dispatch=True)`, so both paths feed one grouping and mapping step and give the
same op kinds and names. Grouping follows ``nn_module_stack``: every call of a standard torch.nn leaf
module (`LEAF_MODULES`) whose aten ops reduce to one op becomes one operator named by the module path
(a second call of the same module gets ``_1``, ...); any other aten op becomes its own operator named
``<path of the module whose forward made the call>.<aten op name>`` (``layer1.0.add``, ``flatten``,
``layer1.0.relu_1``), numbered in graph order, so the same model always gives the same names. ``getitem``
of a multi-output op folds into `TensorRef(op, index)`. Parameters an op reads become its `params` with
their state-dict names; buffers an op reads become ``constant`` ops, except the running statistics of a
batch norm, which go to its attrs. Every op with tensor inputs records their shapes in the attr
``input_shapes``. A module captures in the mode it is in (training by default); a batch norm in eval
mode is opaque, a dropout in eval mode has ``p`` 0. `nn.Identity` emits no aten op and so leaves no
operator.

Loss. The loss function runs inside the traced wrapper, so its ops are in the graph after the model's.
``aten.cross_entropy_loss`` and ``aten.mse_loss`` with mean reduction (and ``log_softmax`` followed by
``nll_loss``) become one op of kind ``loss`` named ``loss``; any other op of the loss function is named
``loss.<aten op name>`` (the reshapes of ``lm_cross_entropy`` are ``loss.reshape`` and
``loss.reshape_1``). A loss other than these ends in whatever ops compute it.

Opaque ops. An aten op no kind fits is an ``opaque`` op that runs whole on one device. Its attrs say
what to call: ``target`` is a dotted name resolvable from the top-level package by attribute access
(``torch.ops.aten.cumsum.default``, or ``_operator.getitem`` for a non-aten callable); ``args`` (a list) and
``kwargs`` (a dict) are the call's arguments, JSON-encoded: a tensor is ``{"input": i}`` (the op's i-th
input), a parameter ``{"param": name}`` (``op.params[name]``), a dtype ``{"dtype": "float32"}``, a device
``{"device": null}`` (use the rank's device), a layout or memory format ``{"torch": "strided"}`` (an
attribute of `torch`), and anything else that is not a number, string, bool, None or list
``{"repr": "..."}``. Tensor outputs are the op's outputs in order (non-tensor entries of a tuple
result are left out). Capture never writes ``target`` ``module``: a leaf-module call that fits no kind is
still one aten call (its parameters named relative to the module), which says exactly what ran.
`Operator.module` is the path of the module the op came from.

FLOPs and bytes. Forward FLOPs of conv2d, linear, matmul, attention and opaque ops come from
`torch.utils.flop_counter.FlopCounterMode` running the aten op on the fake tensors, and their backward
FLOPs from the same counter running autograd on those fake tensors (gradients for parameters and for
float inputs not produced by an ``input`` or ``constant`` op). Where the counter reports nothing we use
our own formulas: LSTM ``8 N T H (I + H)`` per layer (4 gates, an input and a hidden matmul per step,
2 FLOPs per multiply-add), attention ``4 N heads Tq Tk head_dim``; elementwise and binary 1 per output
element, batch norm and layer norm 5, softmax and cross entropy 5, mse 3, reduce 1 per input element,
pooling one per window element, data movement 0. Their backward is 2x forward for ops with parameters
and 1x for the others. Bytes: forward is the element bytes of inputs, outputs and parameters; backward is
twice that; an ``input`` op moves its output once, a ``constant`` op is free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import operator
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.utils import _pytree as pytree

from soap.graph import DTYPE_BYTES, Operator, OperatorGraph, ParamSpec, TensorRef, TensorSpec

__all__ = ["LEAF_MODULES", "capture"]

LEAF_MODULES: tuple[type[nn.Module], ...] = (
    nn.Conv2d, nn.Linear, nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm, nn.Embedding, nn.LSTM,
    nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.ReLU, nn.GELU, nn.Tanh,
    nn.Sigmoid, nn.SiLU, nn.Dropout, nn.Softmax, nn.Flatten, nn.Identity,
)

_MODEL = "model"
_LOSS_SCOPE = "loss"
_UNARY = {"relu": "relu", "gelu": "gelu", "tanh": "tanh", "sigmoid": "sigmoid", "silu": "silu",
          "neg": "neg", "exp": "exp", "clone": "identity", "alias": "identity", "contiguous": "identity"}
_RESHAPES = {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "unsqueeze", "squeeze"}
_FACTORIES = {"zeros", "ones", "empty", "full"}
_COUNTED_KINDS = {"conv2d", "linear", "matmul", "attention", "opaque"}


def capture(module: nn.Module, inputs: torch.Tensor | tuple[torch.Tensor, ...], target: torch.Tensor,
            loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None, *, name: str = "",
            batch_size: int | None = None) -> OperatorGraph:
    """The operator graph of one training step of `module` on `inputs` with loss `loss_fn(output, target)`.

    `inputs` (the forward's positional arguments) and `target` may live on the meta device; only their
    shapes and dtypes are read. `loss_fn` defaults to cross entropy over the last axis for integer
    targets and mean squared error otherwise. `batch_size` defaults to the first axis of the first input.
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"capture needs an nn.Module, got {type(module).__name__}")
    tensors = tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError(f"inputs must be a tensor or a non-empty tuple of tensors, got {_describe(inputs)}")
    if not isinstance(target, torch.Tensor):
        raise ValueError(f"target must be a tensor, got {type(target).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if batch_size is None:
        if tensors[0].dim() == 0:
            raise ValueError("the first input is a scalar; pass batch_size explicitly")
        batch_size = int(tensors[0].shape[0])
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    for t in (*tensors, target):
        _dtype_name(t.dtype)

    wrapper = _WithLoss(module, loss_fn or _default_loss(target))
    fake_mode = torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)
    device = _device_of(module, tensors[0])
    with fake_mode:
        fake_inputs = tuple(torch.empty(t.shape, dtype=t.dtype, device=device) for t in tensors)
        fake_target = torch.empty(target.shape, dtype=target.dtype, device=device)
    with _quiet(), torch.enable_grad():
        try:
            traced = _trace_export(wrapper, fake_inputs, fake_target)
        except Exception as export_error:
            try:
                traced = _trace_fx(wrapper, fake_inputs, fake_target, fake_mode)
            except Exception as fx_error:
                raise ValueError(
                    f"cannot capture {type(module).__name__}: torch.export failed "
                    f"({type(export_error).__name__}: {_first_line(export_error)}) and torch.fx failed "
                    f"({type(fx_error).__name__}: {_first_line(fx_error)})") from fx_error
        ops = _Builder(traced, wrapper).build()
    return OperatorGraph(ops, name=name, batch_size=batch_size)


def _default_loss(target: torch.Tensor) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """Mean squared error for float targets; cross entropy over the last axis of the output otherwise."""
    if target.is_floating_point():
        return F.mse_loss
    return F.cross_entropy if target.dim() == 1 else _flat_cross_entropy


def _flat_cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


class _WithLoss(nn.Module):
    """`model` and its loss as one module, so that one trace holds the whole training step's forward."""

    def __init__(self, model: nn.Module, loss_fn: Callable) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, inputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.model(*inputs), target)


def _describe(value: Any) -> str:
    if isinstance(value, tuple | list):
        return f"{type(value).__name__} of ({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [""])[0][:300]


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"tensors of dtype {name} are not supported; supported: {', '.join(DTYPE_BYTES)}")
    return name


def _device_of(module: nn.Module, first: torch.Tensor) -> torch.device:
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu") if first.device.type == "meta" else first.device


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


# --------------------------------------------------------------------------------------------------
# Tracing: both paths produce a `_Traced`, an aten graph in the training IR.


@dataclasses.dataclass(slots=True)
class _Traced:
    """Aten call nodes in topological order, and what each placeholder is.

    `params` and `buffers` map placeholders to the state-dict names in the captured module (the
    wrapper's ``model.`` prefix removed); `user_inputs` are the inputs then the target.
    """

    nodes: list[fx.Node]
    user_inputs: list[fx.Node]
    params: dict[fx.Node, str]
    buffers: dict[fx.Node, str]


def _model_fqn(fqn: str) -> str:
    return fqn.removeprefix(f"{_MODEL}.")


def _trace_export(wrapper: _WithLoss, inputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> _Traced:
    from torch.export.graph_signature import InputKind

    program = torch.export.export(wrapper, (inputs, target), strict=False)
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    params: dict[fx.Node, str] = {}
    buffers: dict[fx.Node, str] = {}
    user_inputs: list[fx.Node] = []
    for spec in program.graph_signature.input_specs:
        node = placeholders[spec.arg.name]
        if spec.kind == InputKind.PARAMETER:
            params[node] = _model_fqn(spec.target)
        elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            buffers[node] = _model_fqn(spec.target)
        elif spec.kind == InputKind.USER_INPUT:
            user_inputs.append(node)
    nodes = [n for n in program.graph.nodes if n.op == "call_function"]
    return _Traced(nodes=nodes, user_inputs=user_inputs, params=params, buffers=buffers)


class _LeafTracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return _is_leaf(m)


def _trace_fx(wrapper: _WithLoss, inputs: tuple[torch.Tensor, ...], target: torch.Tensor,
              fake_mode: Any) -> _Traced:
    """symbolic_trace with leaf modules, then each call lowered to training-IR aten ops by make_fx."""
    from torch.fx._symbolic_trace import PH

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
    nodes = [n for n in out.nodes if n.op == "call_function"]
    return _Traced(nodes=nodes, user_inputs=user_inputs, params=params, buffers=buffers)


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
    fake_mode = torch._guards.detect_fake_mode(values)
    with fake_mode or contextlib.nullcontext():
        eager = call(*values)
    if not any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(eager)):
        return eager
    sub = make_fx(call, pre_dispatch=True)(*values)
    sub_inputs = [n for n in sub.graph.nodes if n.op == "placeholder"]
    before = len(out.nodes)
    result = out.graph_copy(sub.graph, dict(zip(sub_inputs, [flat[i] for i in slots], strict=True)))
    for node in itertools.islice(reversed(out.nodes), len(out.nodes) - before):
        node.meta["nn_module_stack"] = stack
    return result


# --------------------------------------------------------------------------------------------------
# Grouping: aten nodes into calls, one per operator.


@dataclasses.dataclass(slots=True)
class _Call:
    """One operator to emit: its main aten node, the module path scoping its name, and (for a whole
    leaf-module call) the module path and the factory nodes (LSTM zero states) folded into it."""

    node: fx.Node
    scope: str
    in_loss: bool
    module: str | None = None
    factories: tuple[fx.Node, ...] = ()


def _aten_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._opname.rstrip("_") or target._opname
    return getattr(target, "__name__", "op").strip("_") or "op"


def _is_getitem(node: fx.Node) -> bool:
    return node.target is operator.getitem and isinstance(node.args[0], fx.Node)


def _group(traced: _Traced, root: nn.Module) -> list[_Call]:
    leaf_of_path: dict[str, bool] = {}

    def model_paths(node: fx.Node) -> list[tuple[str, str]]:
        """(stack key, module path in the model) for each module on the node's stack, outermost first."""
        paths = []
        for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items():
            if path == _MODEL or path.startswith(f"{_MODEL}."):
                paths.append((key, path))
        return paths

    def leaf_key(node: fx.Node) -> tuple[str, str] | None:
        for key, path in model_paths(node):
            if path not in leaf_of_path:
                leaf_of_path[path] = _is_leaf(root.get_submodule(path))
            if leaf_of_path[path]:
                return key, _model_fqn(path) if path != _MODEL else ""
        return None

    groups: list[tuple[tuple[str, str] | None, list[fx.Node]]] = []
    for node in traced.nodes:
        if _is_getitem(node):
            continue
        leaf = leaf_key(node)
        if leaf is not None and groups and groups[-1][0] == leaf:
            groups[-1][1].append(node)
        else:
            groups.append((leaf, [node]))

    calls = []
    for leaf, nodes in groups:
        live = [n for n in nodes if n.users]
        paths = model_paths(nodes[0])
        in_loss = not paths
        scope = _LOSS_SCOPE if in_loss else (_model_fqn(paths[-1][1]) if paths[-1][1] != _MODEL else "")
        if leaf is None:
            calls += [_Call(node=n, scope=scope, in_loss=in_loss) for n in live]
            continue
        members = set(nodes)
        factories = tuple(n for n in live if _aten_name(n) in _FACTORIES
                          and not any(isinstance(a, fx.Node) for a in n.args)
                          and all(u in members for u in n.users))
        mains = [n for n in live if n not in factories]
        if len(mains) == 1:
            calls.append(_Call(node=mains[0], scope=leaf[1], in_loss=False, module=leaf[1],
                               factories=factories))
        else:
            calls += [_Call(node=n, scope=leaf[1], in_loss=False) for n in live]
    return calls


# --------------------------------------------------------------------------------------------------
# Building operators.


@dataclasses.dataclass(slots=True)
class _Draft:
    """What a mapper decided for a call: kind, tensor inputs, parameters (local name → placeholder),
    attrs, and the outputs (the node's tensors unless given; `out_index` maps result index → output)."""

    kind: str
    inputs: list[fx.Node]
    attrs: dict[str, Any] = dataclasses.field(default_factory=dict)
    params: dict[str, fx.Node] = dataclasses.field(default_factory=dict)
    outputs: list[torch.Tensor] | None = None
    out_index: dict[int, int] | None = None


def _bind(node: fx.Node) -> dict[str, Any] | None:
    """The node's arguments by schema name, defaults filled in; None for a non-aten target."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return None
    bound = {}
    positional = list(node.args)
    for arg in node.target._schema.arguments:
        if positional and not arg.kwarg_only:
            bound[arg.name] = positional.pop(0)
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        else:
            bound[arg.name] = arg.default_value if arg.has_default_value() else None
    return bound


def _tensors_of(value: Any) -> list[tuple[int, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        return [(0, value)]
    if isinstance(value, tuple | list):
        return [(i, v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    return []


class _Builder:
    """Emits operators for a traced graph in order: inputs first, constants just before their first use."""

    def __init__(self, traced: _Traced, root: nn.Module) -> None:
        self.traced = traced
        self.root = root
        self.ops: list[Operator] = []
        self.by_name: dict[str, Operator] = {}
        self.counts: dict[str, int] = {}
        self.refs: dict[fx.Node, TensorRef] = {}
        self.no_grad: set[str] = set()
        self.num_dropouts = 0
        self.fused: dict[fx.Node, fx.Node] = {}
        self.fake_mode = next((n.meta["val"].fake_mode for n in traced.user_inputs
                               if hasattr(n.meta.get("val"), "fake_mode")), None)

    def build(self) -> list[Operator]:
        count = len(self.traced.user_inputs)
        for i, node in enumerate(self.traced.user_inputs):
            role = "target" if i == count - 1 else "input"
            name = "target" if role == "target" else f"input{i}"
            spec = _spec(node.meta["val"])
            self.add(Operator(name=self.unique(name), kind="input", outputs=(spec,),
                              attrs={"position": i, "role": role}, fwd_bytes=float(spec.nbytes)))
            self.refs[node] = TensorRef(op=self.ops[-1].name)
            self.no_grad.add(self.ops[-1].name)
        calls = _group(self.traced, self.root)
        skipped = self.fuse_losses(calls)
        for call in calls:
            if call.node not in skipped:
                self.emit(call)
        return self.ops

    # names and references

    def unique(self, base: str) -> str:
        n = self.counts.get(base, 0)
        name = base if n == 0 else f"{base}_{n}"
        while name in self.by_name:
            n += 1
            name = f"{base}_{n}"
        self.counts[base] = n + 1
        return name

    def add(self, op: Operator) -> None:
        self.ops.append(op)
        self.by_name[op.name] = op

    def ref(self, node: fx.Node) -> TensorRef:
        if node not in self.refs and node in self.traced.buffers:
            fqn = self.traced.buffers[node]
            self.add(Operator(name=self.unique(fqn), kind="constant", outputs=(_spec(node.meta["val"]),),
                              attrs={"fqn": fqn}, module=fqn.rpartition(".")[0]))
            self.refs[node] = TensorRef(op=self.ops[-1].name)
            self.no_grad.add(self.ops[-1].name)
        assert node in self.refs, f"{node.name} is used before it is produced"
        return self.refs[node]

    def is_param(self, value: Any) -> bool:
        return isinstance(value, fx.Node) and value in self.traced.params

    def is_act(self, value: Any) -> bool:
        """A tensor computed in the graph, a batch tensor or a buffer: anything but a parameter."""
        return (isinstance(value, fx.Node) and value not in self.traced.params
                and isinstance(value.meta.get("val"), torch.Tensor))

    def local_name(self, node: fx.Node, module: str | None) -> str:
        """A parameter's name relative to the leaf module making the call, else its full name."""
        fqn = self.traced.params[node]
        return fqn[len(module) + 1:] if module and fqn.startswith(f"{module}.") else fqn

    # emitting

    def fuse_losses(self, calls: list[_Call]) -> set[fx.Node]:
        """log_softmax whose only use is an nll_loss over classes: one cross-entropy loss op."""
        skipped = set()
        for call in calls:
            node, a = call.node, _bind(call.node)
            if a is None or _aten_name(node) not in ("nll_loss", "nll_loss_nd"):
                continue
            logp = a["self"]
            la = _bind(logp) if isinstance(logp, fx.Node) else None
            if (la is not None and _aten_name(logp) in ("log_softmax", "_log_softmax")
                    and len(logp.users) == 1 and _shape(logp) is not None and len(_shape(logp)) == 2
                    and la["dim"] in (1, -1) and la.get("dtype") is None
                    and a["weight"] is None and a["reduction"] == 1 and a["ignore_index"] == -100):
                self.fused[node] = logp.args[0]
                skipped.add(logp)
        return skipped

    def emit(self, call: _Call) -> None:
        node = call.node
        bound = _bind(node)
        if bound is not None and _aten_name(node) == "broadcast_tensors" and all(
                self.is_act(x) and _shape(x) == tuple(t.shape)
                for x, t in zip(bound["tensors"], node.meta["val"], strict=True)):
            for user in node.users:
                if _is_getitem(user):
                    self.refs[user] = self.ref(bound["tensors"][user.args[1]])
            return
        draft = None
        if bound is not None and isinstance(node.meta.get("val"), torch.Tensor | tuple | list):
            mapper = _MAPPERS.get(_aten_name(node))
            if mapper is not None:
                draft = mapper(self, call, bound)
        if draft is None:
            for factory in call.factories:
                self.emit(_Call(node=factory, scope=call.scope, in_loss=call.in_loss))
            draft = self.opaque(call)
        if draft is None:
            return
        if draft.kind == "loss" and call.in_loss:
            base = "loss"
        elif call.module is not None and call.module:
            base = call.module
        else:
            base = f"{call.scope}.{_aten_name(node)}" if call.scope else _aten_name(node)
        inputs = tuple(self.ref(n) for n in draft.inputs)
        params = {k: ParamSpec(shape=tuple(p.meta["val"].shape), fqn=self.traced.params[p],
                               dtype=_dtype_name(p.meta["val"].dtype)) for k, p in draft.params.items()}
        if draft.outputs is None:
            pairs = _tensors_of(node.meta["val"])
            draft.outputs = [t for _, t in pairs]
            draft.out_index = {i: j for j, (i, _) in enumerate(pairs)}
        outputs = tuple(_spec(t) for t in draft.outputs)
        if inputs:
            draft.attrs["input_shapes"] = [list(self.tensor(r).shape) for r in inputs]
        op = Operator(name=self.unique(base), kind=draft.kind, inputs=inputs, outputs=outputs,
                      params=params, attrs=draft.attrs,
                      module=(call.module if call.module is not None else
                              ("" if call.in_loss else call.scope)))
        fwd_flops, bwd_flops = self.flops(call, op)
        in_bytes = sum(self.tensor(r).nbytes for r in inputs)
        fwd_bytes = float(in_bytes + sum(t.nbytes for t in outputs) + op.param_bytes)
        op = dataclasses.replace(op, fwd_flops=float(fwd_flops), bwd_flops=float(bwd_flops),
                                 fwd_bytes=fwd_bytes, bwd_bytes=2.0 * fwd_bytes)
        self.add(op)
        if isinstance(node.meta["val"], torch.Tensor):
            self.refs[node] = TensorRef(op=op.name)
        else:
            index = draft.out_index if draft.out_index is not None else {i: i for i in range(len(outputs))}
            for user in node.users:
                if _is_getitem(user) and user.args[1] in index:
                    self.refs[user] = TensorRef(op=op.name, index=index[user.args[1]])

    def opaque(self, call: _Call) -> _Draft | None:
        node = call.node
        if not _tensors_of(node.meta.get("val")):
            return None
        draft = _Draft(kind="opaque", inputs=[])

        def encode(value: Any) -> Any:
            if isinstance(value, fx.Node):
                if self.is_param(value):
                    local = self.local_name(value, call.module)
                    draft.params[local] = value
                    return {"param": local}
                if isinstance(value.meta.get("val"), torch.Tensor):
                    if value not in draft.inputs:
                        draft.inputs.append(value)
                    return {"input": draft.inputs.index(value)}
                return encode(value.meta.get("val"))
            if value is None or isinstance(value, bool | int | float | str):
                return value
            if isinstance(value, tuple | list):
                return [encode(v) for v in value]
            if isinstance(value, torch.dtype):
                return {"dtype": str(value).removeprefix("torch.")}
            if isinstance(value, torch.device):
                return {"device": None}
            if isinstance(value, torch.layout | torch.memory_format):
                return {"torch": str(value).removeprefix("torch.")}
            return {"repr": repr(value)}

        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            qualname = f"torch.ops.{target.namespace}.{target._opname}.{target._overloadname}"
        else:
            module = getattr(target, "__module__", None) or "builtins"
            qualname = f"{module}.{getattr(target, '__qualname__', target)}"
        draft.attrs = {"target": qualname, "args": [encode(a) for a in node.args],
                       "kwargs": {k: encode(v) for k, v in node.kwargs.items()}}
        return draft

    # FLOPs

    def flops(self, call: _Call, op: Operator) -> tuple[float, float]:
        if op.kind == "lstm":
            n, t, features = self.tensor(op.inputs[0]).shape
            hidden, layers = op.attrs["hidden_size"], op.attrs["num_layers"]
            fwd = sum(8 * n * t * hidden * ((features if k == 0 else hidden) + hidden) for k in range(layers))
            return fwd, 2.0 * fwd
        if op.kind in _COUNTED_KINDS:
            counted = self.count(call)
            if counted is not None and counted[0] > 0:
                return counted
            if op.kind == "attention":
                n, heads, tq, head_dim = self.tensor(op.inputs[0]).shape
                tk = self.tensor(op.inputs[1]).shape[2]
                fwd = 4.0 * n * heads * tq * tk * head_dim
                return fwd, 2.0 * fwd
            if counted is not None:
                return counted
        fwd = self.formula_flops(op)
        return fwd, (2.0 if op.params else 1.0) * fwd

    def tensor(self, ref: TensorRef) -> TensorSpec:
        return self.by_name[ref.op].outputs[ref.index]

    def formula_flops(self, op: Operator) -> float:
        out = sum(t.numel for t in op.outputs)
        first_in = self.tensor(op.inputs[0]).numel if op.inputs else 0
        if op.kind in ("elementwise", "binary", "dropout"):
            return float(out)
        if op.kind in ("batchnorm", "layernorm", "softmax"):
            return 5.0 * out
        if op.kind == "loss":
            return (5.0 if op.attrs["fn"] == "cross_entropy" else 3.0) * first_in
        if op.kind == "reduce":
            return float(first_in)
        if op.kind == "pool2d":
            return float(out * math.prod(op.attrs["kernel"]))
        if op.kind == "adaptive_pool2d":
            return float(first_in)
        return 0.0

    def count(self, call: _Call) -> tuple[float, float] | None:
        """(forward, backward) FLOPs of the call's aten op by FlopCounterMode on fake tensors."""
        from torch.utils.flop_counter import FlopCounterMode

        node = call.node
        leaves: list[torch.Tensor] = []
        factories = set(call.factories)

        def fake(value: Any) -> Any:
            if isinstance(value, fx.Node):
                val = value.meta.get("val")
                if not isinstance(val, torch.Tensor):
                    return val
                producer = self.refs.get(value)
                needs_grad = (value in self.traced.params or
                              (val.is_floating_point() and value not in factories
                               and value not in self.traced.buffers
                               and (producer is None or producer.op not in self.no_grad)))
                val = val.detach()
                if needs_grad:
                    val = val.requires_grad_(True)
                    leaves.append(val)
                return val
            if isinstance(value, tuple | list):
                return type(value)(fake(v) for v in value)
            return value

        if self.fake_mode is None:
            return None
        try:
            with self.fake_mode, FlopCounterMode(display=False) as counter:
                result = node.target(*fake(node.args), **{k: fake(v) for k, v in node.kwargs.items()})
                fwd = counter.get_total_flops()
                outs = [t for t in pytree.tree_leaves(result)
                        if isinstance(t, torch.Tensor) and t.requires_grad]
                if leaves and outs:
                    torch.autograd.grad(outs, leaves, [torch.ones_like(t) for t in outs], allow_unused=True)
                bwd = counter.get_total_flops() - fwd
        except Exception:
            return None
        return float(fwd), float(bwd)


def _spec(value: torch.Tensor) -> TensorSpec:
    return TensorSpec(shape=tuple(value.shape), dtype=_dtype_name(value.dtype))


def _shape(value: Any) -> tuple[int, ...] | None:
    val = value.meta.get("val") if isinstance(value, fx.Node) else value
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _axis(axis: int, ndim: int) -> int:
    return axis + ndim if axis < 0 else axis


def _pair(value: Any, default: list[int]) -> list[int]:
    if value is None or (isinstance(value, list | tuple) and len(value) == 0):
        return list(default)
    if isinstance(value, int):
        return [value, value]
    value = [int(v) for v in value]
    return value * 2 if len(value) == 1 else value


# --------------------------------------------------------------------------------------------------
# Mappers: aten op name → function(builder, call, bound arguments) → _Draft, or None for opaque.

_Mapper = Callable[[_Builder, _Call, dict[str, Any]], _Draft | None]
_MAPPERS: dict[str, _Mapper] = {}


def _maps(*names: str) -> Callable[[_Mapper], _Mapper]:
    def register(fn: _Mapper) -> _Mapper:
        for name in names:
            _MAPPERS[name] = fn
        return fn
    return register


def _weights(b: _Builder, **named: Any) -> dict[str, fx.Node] | None:
    """The named parameter operands (None values dropped), or None when one of them is not a parameter."""
    out = {}
    for name, value in named.items():
        if value is None:
            continue
        if not b.is_param(value):
            return None
        out[name] = value
    return out


@_maps("conv2d")
def _conv2d(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x, weight = a["input"], a["weight"]
    params = _weights(b, weight=weight, bias=a["bias"])
    if params is None or "weight" not in params or not b.is_act(x) or len(_shape(x)) != 4:
        return None
    kernel, dilation = _shape(weight)[2:], _pair(a["dilation"], [1, 1])
    padding = a["padding"]
    if isinstance(padding, str):
        if padding == "valid":
            padding = [0, 0]
        else:
            totals = [d * (k - 1) for d, k in zip(dilation, kernel, strict=True)]
            if any(t % 2 for t in totals):
                return None
            padding = [t // 2 for t in totals]
    return _Draft(kind="conv2d", inputs=[x], params=params,
                  attrs={"stride": _pair(a["stride"], [1, 1]), "padding": _pair(padding, [0, 0]),
                         "dilation": dilation, "groups": int(a["groups"])})


@_maps("linear")
def _linear(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["input"]
    params = _weights(b, weight=a["weight"], bias=a["bias"])
    if params is None or not b.is_act(x) or len(_shape(x)) < 2:
        return None
    return _Draft(kind="linear", inputs=[x], params=params)


@_maps("batch_norm")
def _batch_norm(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["input"]
    params = _weights(b, weight=a["weight"], bias=a["bias"])
    stats = [a["running_mean"], a["running_var"]]
    if (params is None or not b.is_act(x) or len(_shape(x)) < 2 or not a["training"]
            or any(s is not None and s not in b.traced.buffers for s in stats)):
        return None
    fqns = [None if s is None else b.traced.buffers[s] for s in stats]
    return _Draft(kind="batchnorm", inputs=[x], params=params,
                  attrs={"eps": float(a["eps"]), "momentum": a["momentum"],
                         "running_mean": fqns[0], "running_var": fqns[1]})


@_maps("layer_norm")
def _layer_norm(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["input"]
    params = _weights(b, weight=a["weight"], bias=a["bias"])
    if params is None or not b.is_act(x):
        return None
    return _Draft(kind="layernorm", inputs=[x], params=params,
                  attrs={"normalized_shape": [int(s) for s in a["normalized_shape"]], "eps": float(a["eps"])})


@_maps("embedding")
def _embedding(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    idx = a["indices"]
    params = _weights(b, weight=a["weight"])
    if not params or not b.is_act(idx) or a["scale_grad_by_freq"] or a["sparse"] or len(_shape(idx)) < 1:
        return None
    padding_idx = int(a["padding_idx"])
    return _Draft(kind="embedding", inputs=[idx], params=params,
                  attrs={"padding_idx": None if padding_idx < 0 else padding_idx})


@_maps("lstm")
def _lstm(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x, hx, weights = a.get("input"), a.get("hx"), a.get("params")
    layers = a.get("num_layers")
    if (not b.is_act(x) or not isinstance(hx, list | tuple) or not isinstance(weights, list | tuple)
            or len(_shape(x)) != 3 or not a.get("batch_first") or a.get("bidirectional")
            or not a.get("has_biases") or len(weights) != 4 * layers
            or (a.get("dropout") and a.get("train") and layers > 1)
            or not all(h in call.factories and _aten_name(h) == "zeros" for h in hx)
            or not all(b.is_param(w) for w in weights)):
        return None
    params = {b.local_name(w, call.module): w for w in weights}
    hidden = _shape(weights[1])[1]
    return _Draft(kind="lstm", inputs=[x], params=params,
                  attrs={"hidden_size": int(hidden), "num_layers": int(layers)})


def _only_first_output(call: _Call) -> bool:
    return all(not _is_getitem(u) or u.args[1] == 0 for u in call.node.users)


@_maps("max_pool2d", "max_pool2d_with_indices")
def _max_pool2d(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    if not b.is_act(x) or len(_shape(x)) != 4 or not _only_first_output(call):
        return None
    kernel = _pair(a["kernel_size"], [1, 1])
    val = call.node.meta["val"]
    return _Draft(kind="pool2d", inputs=[x], outputs=[val if isinstance(val, torch.Tensor) else val[0]],
                  out_index={0: 0},
                  attrs={"mode": "max", "kernel": kernel, "stride": _pair(a["stride"], kernel),
                         "padding": _pair(a["padding"], [0, 0]), "dilation": _pair(a["dilation"], [1, 1]),
                         "ceil_mode": bool(a["ceil_mode"]), "count_include_pad": False})


@_maps("avg_pool2d")
def _avg_pool2d(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    if not b.is_act(x) or len(_shape(x)) != 4:
        return None
    kernel = _pair(a["kernel_size"], [1, 1])
    attrs = {"mode": "avg", "kernel": kernel, "stride": _pair(a["stride"], kernel),
             "padding": _pair(a["padding"], [0, 0]), "dilation": [1, 1], "ceil_mode": bool(a["ceil_mode"]),
             "count_include_pad": bool(a["count_include_pad"])}
    if a["divisor_override"] is not None:
        attrs["divisor_override"] = int(a["divisor_override"])
    return _Draft(kind="pool2d", inputs=[x], attrs=attrs)


@_maps("adaptive_avg_pool2d", "adaptive_max_pool2d")
def _adaptive_pool2d(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    if not b.is_act(x) or len(_shape(x)) != 4 or not _only_first_output(call):
        return None
    val = call.node.meta["val"]
    out = val if isinstance(val, torch.Tensor) else val[0]
    return _Draft(kind="adaptive_pool2d", inputs=[x], outputs=[out], out_index={0: 0},
                  attrs={"mode": "avg" if _aten_name(call.node) == "adaptive_avg_pool2d" else "max",
                         "output_size": [int(s) for s in out.shape[-2:]]})


@_maps(*_UNARY)
def _unary(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    if not b.is_act(x) or a.get("memory_format") not in (None, torch.contiguous_format,
                                                           torch.preserve_format):
        return None
    fn = _UNARY[_aten_name(call.node)]
    attrs: dict[str, Any] = {"fn": fn}
    if fn == "gelu":
        attrs["approximate"] = a["approximate"]
    return _Draft(kind="elementwise", inputs=[x], attrs=attrs)


def _is_scalar(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _arith(b: _Builder, fn: str, x: Any, y: Any) -> _Draft | None:
    """`fn(x, y)` for fn in add, sub, mul, div, with tensors or one Python scalar."""
    if b.is_act(x) and _is_scalar(y):
        if fn == "add":
            return _Draft(kind="elementwise", inputs=[x], attrs={"fn": "add_scalar", "scalar": y})
        if fn == "sub":
            return _Draft(kind="elementwise", inputs=[x], attrs={"fn": "add_scalar", "scalar": -y})
        if fn == "mul":
            return _Draft(kind="elementwise", inputs=[x], attrs={"fn": "scale", "scalar": y})
        if fn == "div" and y != 0:
            return _Draft(kind="elementwise", inputs=[x], attrs={"fn": "scale", "scalar": 1.0 / y})
        return None
    if _is_scalar(x) and b.is_act(y):
        if fn in ("add", "mul"):
            return _arith(b, fn, y, x)
        if fn == "sub":
            return _Draft(kind="elementwise", inputs=[y], attrs={"fn": "rsub_scalar", "scalar": x})
        return None
    if b.is_act(x) and b.is_act(y):
        return _Draft(kind="binary", inputs=[x, y], attrs={"fn": fn})
    for position, (p, other) in enumerate(((x, y), (y, x))):
        if b.is_param(p) and b.is_act(other):
            return _Draft(kind="binary", inputs=[other], params={"other": p},
                          attrs={"fn": fn, "param_operand": position})
    return None


@_maps("add", "sub", "mul", "div")
def _binary(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    if a.get("alpha", 1) != 1 or a.get("rounding_mode") is not None:
        return None
    return _arith(b, _aten_name(call.node), a["self"], a["other"])


@_maps("rsub")
def _rsub(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    if a.get("alpha", 1) != 1:
        return None
    return _arith(b, "sub", a["other"], a["self"])


@_maps("pow")
def _pow(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x, exponent = a.get("self"), a.get("exponent")
    if not b.is_act(x) or not _is_scalar(exponent):
        return None
    return _Draft(kind="elementwise", inputs=[x], attrs={"fn": "pow_scalar", "scalar": exponent})


@_maps("masked_fill")
def _masked_fill(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x, mask, value = a["self"], a["mask"], a["value"]
    if not (b.is_act(x) and b.is_act(mask)) or not _is_scalar(value):
        return None
    return _Draft(kind="binary", inputs=[x, mask], attrs={"fn": "masked_fill", "value": value})


@_maps("mean", "sum")
def _reduce(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    if not b.is_act(x) or a.get("dtype") is not None:
        return None
    ndim = len(_shape(x))
    dims = a.get("dim")
    axes = list(range(ndim)) if not dims else sorted({_axis(int(d), ndim) for d in dims})
    return _Draft(kind="reduce", inputs=[x],
                  attrs={"fn": _aten_name(call.node), "axes": axes, "keepdim": bool(a.get("keepdim", False))})


@_maps("cat")
def _cat(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    tensors = list(a["tensors"])
    if not tensors or not all(b.is_act(t) for t in tensors):
        return None
    return _Draft(kind="concat", inputs=tensors,
                  attrs={"axis": _axis(int(a["dim"]), len(call.node.meta["val"].shape))})


@_maps("split", "split_with_sizes", "chunk")
def _split(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    if not b.is_act(x):
        return None
    axis = _axis(int(a["dim"]), len(_shape(x)))
    return _Draft(kind="split", inputs=[x],
                  attrs={"axis": axis, "sizes": [int(t.shape[axis]) for t in call.node.meta["val"]]})


@_maps("select")
def _select(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    if not b.is_act(x):
        return None
    shape = _shape(x)
    axis = _axis(int(a["dim"]), len(shape))
    index = _axis(int(a["index"]), shape[axis])
    return _Draft(kind="slice", inputs=[x],
                  attrs={"axis": axis, "start": index, "stop": index + 1, "step": 1, "squeeze": True})


@_maps("slice")
def _slice(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    if not b.is_act(x):
        return None
    shape = _shape(x)
    axis = _axis(int(a["dim"]), len(shape))
    size = shape[axis]

    def clamp(v: int | None, default: int) -> int:
        if v is None:
            return default
        v = v + size if v < 0 else v
        return min(max(v, 0), size)

    start = clamp(a["start"], 0)
    return _Draft(kind="slice", inputs=[x],
                  attrs={"axis": axis, "start": start, "stop": max(clamp(a["end"], size), start),
                         "step": int(a["step"]), "squeeze": False})


@_maps(*_RESHAPES)
def _reshape(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    if not b.is_act(x):
        return None
    return _Draft(kind="reshape", inputs=[x], attrs={"shape": list(call.node.meta["val"].shape)})


@_maps("transpose", "permute", "t", "numpy_T")
def _transpose(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    if not b.is_act(x):
        return None
    ndim = len(_shape(x))
    perm = list(range(ndim))
    name = _aten_name(call.node)
    if name == "transpose":
        i, j = _axis(int(a["dim0"]), ndim), _axis(int(a["dim1"]), ndim)
        perm[i], perm[j] = perm[j], perm[i]
    elif name == "permute":
        perm = [_axis(int(d), ndim) for d in a["dims"]]
    else:
        perm.reverse()
    return _Draft(kind="transpose", inputs=[x], attrs={"perm": perm})


@_maps("matmul", "bmm", "mm")
def _matmul(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    y = a.get("other", a.get("mat2"))
    if not (b.is_act(x) and b.is_act(y)):
        return None
    sx, sy = _shape(x), _shape(y)
    if len(sx) < 2 or not (len(sy) == 2 or (len(sy) == len(sx) and sx[:-2] == sy[:-2])):
        return None
    return _Draft(kind="matmul", inputs=[x, y])


@_maps("softmax", "_softmax", "log_softmax", "_log_softmax")
def _softmax(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    if not b.is_act(x) or a.get("dtype") is not None or a.get("half_to_float"):
        return None
    return _Draft(kind="softmax", inputs=[x],
                  attrs={"axis": _axis(int(a["dim"]), len(_shape(x))), "log": "log" in _aten_name(call.node)})


@_maps("dropout")
def _dropout(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["input"]
    if not b.is_act(x):
        return None
    seed = b.num_dropouts
    b.num_dropouts += 1
    return _Draft(kind="dropout", inputs=[x], attrs={"p": float(a["p"]) if a["train"] else 0.0, "seed": seed})


@_maps("scaled_dot_product_attention")
def _attention(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    q, k, v = a["query"], a["key"], a["value"]
    if not all(b.is_act(t) and len(_shape(t)) == 4 for t in (q, k, v)):
        return None
    if a["attn_mask"] is not None or a["dropout_p"] or a["enable_gqa"]:
        return None
    if not _shape(q)[:2] == _shape(k)[:2] == _shape(v)[:2] or _shape(k)[2] != _shape(v)[2]:
        return None
    return _Draft(kind="attention", inputs=[q, k, v],
                  attrs={"is_causal": bool(a["is_causal"]), "scale": a["scale"]})


def _loss(b: _Builder, fn: str, logits: Any, target: Any) -> _Draft | None:
    if not (b.is_act(logits) and b.is_act(target)):
        return None
    sl, st = _shape(logits), _shape(target)
    lt, tt = logits.meta["val"], target.meta["val"]
    if fn == "cross_entropy":
        ok = len(sl) >= 2 and st == sl[:1] + sl[2:] and lt.is_floating_point() and tt.dtype == torch.int64
    else:
        ok = sl == st and len(sl) >= 1 and lt.is_floating_point() and tt.is_floating_point()
    return _Draft(kind="loss", inputs=[logits, target], attrs={"fn": fn, "reduction": "mean"}) if ok else None


@_maps("cross_entropy_loss")
def _cross_entropy(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    if (a["weight"] is not None or a["reduction"] != 1 or a["ignore_index"] != -100
            or a["label_smoothing"] != 0):
        return None
    return _loss(b, "cross_entropy", a["self"], a["target"])


@_maps("nll_loss", "nll_loss_nd")
def _nll_loss(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    logits = b.fused.get(call.node)
    return None if logits is None else _loss(b, "cross_entropy", logits, a["target"])


@_maps("mse_loss")
def _mse_loss(b: _Builder, call: _Call, a: dict[str, Any]) -> _Draft | None:
    return None if a["reduction"] != 1 else _loss(b, "mse", a["self"], a["target"])
