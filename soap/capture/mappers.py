"""Capture, stage 3: one operator call mapped to an op kind of docs/op_kinds.md (a `_Draft`), or to nothing.

Owns the mappers: `_MAPPERS` maps an aten op name to `mapper(builder, call, bound arguments)`, which
returns the kind, tensor inputs, parameters and attrs of the op, or None when the call's arguments do not
fit the kind (the builder then makes the call opaque). Each kind declares the aten names it is made from
(`OpDef.captured_from`, soap/registry.py); the builder asserts every draft against that declaration and
tests/test_op_kinds.py checks this table against all of them. A mapper asks the builder only what
`_Context` lists.

Parameters an op reads become its `params` under their local names (``weight``, ``bias``,
``weight_ih_l0``); the running statistics of a batch norm go to its attrs. A module captures in the mode
it is in (training by default): a batch norm in eval mode is opaque, a dropout in eval mode has ``p`` 0.

Loss. The loss function runs inside the traced wrapper, so its ops are in the graph after the model's.
``aten.cross_entropy_loss`` (any ``ignore_index``, ``label_smoothing`` and class weights) and
``aten.mse_loss`` with mean or sum reduction (and ``log_softmax`` followed by ``nll_loss``, which the
builder fuses) become one op of kind ``loss`` named ``loss``; any other op of the
loss function is named ``loss.<aten op name>`` (the reshapes of ``lm_cross_entropy`` are ``loss.reshape``
and ``loss.reshape_1``). A loss other than these ends in whatever ops compute it.

Imports torch, soap.opdef, soap.registry, `tracing`, `grouping` and `nodes`; must not import `builder` (it
reaches the builder through `_Context`), the simulator, the search, the runtime or soapflow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import fx

from soap.capture.grouping import _Call
from soap.capture.nodes import _aten_name, _axis, _is_getitem, _shape
from soap.capture.tracing import _Traced
from soap.opdef import pair
from soap.registry import POINTWISE_FNS

# aten op name → the `fn` of the elementwise op it becomes
_UNARY = {"relu": "relu", "gelu": "gelu", "tanh": "tanh", "sigmoid": "sigmoid", "silu": "silu",
          "neg": "neg", "exp": "exp", "rsqrt": "rsqrt", "clone": "identity", "alias": "identity",
          "contiguous": "identity"}

# the memory formats a copy may ask for and still be an identity: torch's enums, and the ints an aten
# schema's default holds (c10::MemoryFormat: 0 contiguous, 1 preserve)
_PLAIN_FORMATS = (None, 0, 1, torch.contiguous_format, torch.preserve_format)

_RESHAPES = {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "unsqueeze", "squeeze"}


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


class _Context(Protocol):
    """What a mapper may ask of the builder: the traced graph, which operands are parameters or
    activations, a parameter's local name, the fused losses and RMS norms, and the count of dropouts so
    far."""

    traced: _Traced
    fused: dict[fx.Node, fx.Node]
    fused_norms: dict[fx.Node, _Draft]
    num_dropouts: int
    num_draws: int

    def is_param(self, value: Any) -> bool: ...

    def is_act(self, value: Any) -> bool: ...

    def local_name(self, node: fx.Node, module: str | None) -> str: ...


def _spatial(value: Any, default: Sequence[int]) -> list[int]:
    """A spatial aten argument (kernel, stride, padding, dilation) as an ``[h, w]`` attr; `default` where
    the argument is None or empty (torch's "not given": a pooling stride then equals the kernel)."""
    if value is None or (isinstance(value, list | tuple) and len(value) == 0):
        return list(default)
    return list(pair(value))


# aten op name (`_aten_name`) → the mapper of its calls; filled once, at import, by `_maps`
_Mapper = Callable[[_Context, _Call, dict[str, Any]], _Draft | None]
_MAPPERS: dict[str, _Mapper] = {}


def _maps(*names: str) -> Callable[[_Mapper], _Mapper]:
    def register(fn: _Mapper) -> _Mapper:
        for name in names:
            assert name not in _MAPPERS, f"two mappers for aten {name}"
            _MAPPERS[name] = fn
        return fn
    return register


def _weights(b: _Context, **named: Any) -> dict[str, fx.Node] | None:
    """The named parameter operands (None values dropped), or None when one of them is not a parameter."""
    out = {}
    for name, value in named.items():
        if value is None:
            continue
        if not b.is_param(value):
            return None
        out[name] = value
    return out


@_maps("conv2d", "conv1d")
def _conv(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x, weight = a["input"], a["weight"]
    spatial = 2 if _aten_name(call.node) == "conv2d" else 1
    params = _weights(b, weight=weight, bias=a["bias"])
    if params is None or "weight" not in params or not b.is_act(x) or len(_shape(x)) != 2 + spatial:
        return None
    kernel, dilation = _shape(weight)[2:], _per_axis(a["dilation"], spatial, 1)
    padding = a["padding"]
    if isinstance(padding, str):
        if padding == "valid":
            padding = [0] * spatial
        else:
            totals = [d * (k - 1) for d, k in zip(dilation, kernel, strict=True)]
            if any(t % 2 for t in totals):
                return None
            padding = [t // 2 for t in totals]
    attrs = {"stride": _per_axis(a["stride"], spatial, 1), "padding": _per_axis(padding, spatial, 0),
             "dilation": dilation}
    if spatial == 1:  # conv1d's attrs are ints
        attrs = {k: v[0] for k, v in attrs.items()}
    return _Draft(kind=f"conv{spatial}d", inputs=[x], params=params, attrs={**attrs, "groups": int(a["groups"])})


@_maps("conv_transpose2d")
def _conv_transpose2d(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["input"]
    params = _weights(b, weight=a["weight"], bias=a["bias"])
    if params is None or "weight" not in params or not b.is_act(x) or len(_shape(x)) != 4:
        return None
    return _Draft(kind="conv_transpose2d", inputs=[x], params=params,
                  attrs={"stride": _per_axis(a["stride"], 2, 1), "padding": _per_axis(a["padding"], 2, 0),
                         "output_padding": _per_axis(a["output_padding"], 2, 0),
                         "dilation": _per_axis(a["dilation"], 2, 1), "groups": int(a["groups"])})


def _per_axis(value: Any, n: int, default: int) -> list[int]:
    """A spatial aten argument as one int per axis (`_spatial` for `n` axes)."""
    if n == 2:
        return _spatial(value, [default, default])
    if value is None or (isinstance(value, list | tuple) and len(value) == 0):
        return [default] * n
    values = [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]
    return values * n if len(values) == 1 else values


@_maps("linear")
def _linear(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["input"]
    params = _weights(b, weight=a["weight"], bias=a["bias"])
    if params is None or not b.is_act(x) or len(_shape(x)) < 2:
        return None
    return _Draft(kind="linear", inputs=[x], params=params)


@_maps("addmm")
def _addmm(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    """bias + x @ W: a linear whose weight is stored (in, out) (Hugging Face's ``Conv1D``, GPT-2), or, with
    three activations, a matmul adding its third input."""
    c, x, y = a["self"], a["mat1"], a["mat2"]
    if a["alpha"] != 1 or not b.is_act(x):
        return None
    if b.is_param(y) and a["beta"] == 1:
        params = _weights(b, weight=y, bias=c)
        if params is None or (c is not None and _shape(c) != _shape(y)[1:]):
            return None
        return _Draft(kind="linear", inputs=[x], params=params, attrs={"transposed": True})
    if not b.is_act(y) or not (a["beta"] == 0 or b.is_act(c)):
        return None
    return _matmul_draft([x, y], c=c, alpha=1, beta=a["beta"])


@_maps("batch_norm")
def _batch_norm(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
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


@_maps("upsample_nearest2d", "upsample_bilinear2d")
def _upsample(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    """Nearest or bilinear upsampling of a 4-D activation by whole factors (the output a whole multiple of
    the input, and the scale factors, where given, those multiples)."""
    x = a["input"] if "input" in a else a["self"]
    if not b.is_act(x) or len(_shape(x)) != 4:
        return None
    (h, w), (ho, wo) = _shape(x)[2:], call.node.meta["val"].shape[2:]
    if ho % h or wo % w:
        return None
    scale = [ho // h, wo // w]
    given = a.get("scale_factors") or [a.get("scales_h"), a.get("scales_w")]
    if any(f is not None and float(f) != float(k) for f, k in zip(given, scale, strict=True)):
        return None
    if _aten_name(call.node) == "upsample_nearest2d":
        return _Draft(kind="upsample", inputs=[x], attrs={"scale": scale})
    return _Draft(kind="upsample", inputs=[x],
                  attrs={"scale": scale, "mode": "bilinear", "align_corners": bool(a["align_corners"])})


@_maps("layer_norm")
def _layer_norm(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["input"]
    params = _weights(b, weight=a["weight"], bias=a["bias"])
    if params is None or not b.is_act(x):
        return None
    return _Draft(kind="layernorm", inputs=[x], params=params,
                  attrs={"normalized_shape": [int(s) for s in a["normalized_shape"]], "eps": float(a["eps"])})


@_maps("group_norm")
def _group_norm(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["input"]
    params = _weights(b, weight=a["weight"], bias=a["bias"])
    if params is None or not b.is_act(x) or len(_shape(x)) < 2:
        return None
    return _Draft(kind="groupnorm", inputs=[x], params=params,
                  attrs={"num_groups": int(a["num_groups"]), "eps": float(a["eps"])})


@_maps("instance_norm")
def _instance_norm(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    """An instance norm that normalizes with its input's statistics and keeps none: a group norm with one
    channel per group."""
    x = a["input"]
    params = _weights(b, weight=a["weight"], bias=a["bias"])
    if (params is None or not b.is_act(x) or len(_shape(x)) < 3 or not a["use_input_stats"]
            or a["running_mean"] is not None or a["running_var"] is not None):
        return None
    return _Draft(kind="groupnorm", inputs=[x], params=params,
                  attrs={"num_groups": int(_shape(x)[1]), "eps": float(a["eps"])})


@_maps("rms_norm")
def _rms_norm(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["input"]
    params = _weights(b, weight=a["weight"])
    if params is None or not b.is_act(x):
        return None
    eps = a["eps"]
    return _Draft(kind="rmsnorm", inputs=[x], params=params,
                  attrs={"normalized_shape": [int(s) for s in a["normalized_shape"]],
                         "eps": None if eps is None else float(eps)})


@_maps("embedding")
def _embedding(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    idx = a["indices"]
    params = _weights(b, weight=a["weight"])
    if not params or not b.is_act(idx) or a["scale_grad_by_freq"] or a["sparse"] or len(_shape(idx)) < 1:
        return None
    padding_idx = int(a["padding_idx"])
    return _Draft(kind="embedding", inputs=[idx], params=params,
                  attrs={"padding_idx": None if padding_idx < 0 else padding_idx})


def _table_lookup(b: _Context, a: dict[str, Any]) -> _Draft | None:
    """A parameter table indexed along its first axis by one tensor of ids (Swin's relative position bias
    table read through a constant index): the lookup of an embedding."""
    table, indices = a["self"], a["indices"]
    if (len(_shape(table)) != 2 or len(indices) != 1 or not b.is_act(indices[0])
            or indices[0].meta["val"].dtype != torch.int64):
        return None
    return _Draft(kind="embedding", inputs=[indices[0]], params={"weight": table}, attrs={"padding_idx": None})


_RECURRENT_PARAMS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")  # each layer's, in torch's order


def _recurrent_weights(b: _Context, call: _Call, a: dict[str, Any], num_states: int) -> dict[str, fx.Node] | None:
    """The parameters of a recurrent module's call (aten ``lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu``),
    or None where the call does not fit the recurrent kinds: an activation input [N, T, I], batch first,
    unidirectional, with biases, no projection (4 weights per layer), no dropout between layers in
    training, and `num_states` zero initial states made inside the call."""
    x, hx, weights = a.get("input"), a.get("hx"), a.get("params")
    layers = a.get("num_layers")
    states = hx if isinstance(hx, list | tuple) else [hx]
    if (not b.is_act(x) or len(states) != num_states or not isinstance(weights, list | tuple)
            or len(_shape(x)) != 3 or not a.get("batch_first") or a.get("bidirectional")
            or not a.get("has_biases") or len(weights) != 4 * layers
            or (a.get("dropout") and a.get("train") and layers > 1)
            or not all(h in call.factories and _aten_name(h) == "zeros" for h in states)
            or not all(b.is_param(w) for w in weights)):
        return None
    # by place, as the kinds name them: a layer of a bidirectional module (tracing's
    # `_bidirectional_recurrences`) runs as layer 0 whatever the module calls it
    return {f"{_RECURRENT_PARAMS[i % 4]}_l{i // 4}": w for i, w in enumerate(weights)}


@_maps("lstm")
def _lstm(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    if not isinstance(a.get("hx"), list | tuple) or (params := _recurrent_weights(b, call, a, 2)) is None:
        return None
    hidden = _shape(a["params"][1])[1]
    return _Draft(kind="lstm", inputs=[a["input"]], params=params,
                  attrs={"hidden_size": int(hidden), "num_layers": int(a["num_layers"])})


@_maps("gru", "rnn_tanh", "rnn_relu")
def _gru_rnn(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    if isinstance(a.get("hx"), list | tuple) or (params := _recurrent_weights(b, call, a, 1)) is None:
        return None
    name = _aten_name(call.node)
    attrs: dict[str, Any] = {"hidden_size": int(_shape(a["params"][1])[1]), "num_layers": int(a["num_layers"])}
    if name != "gru":
        attrs["nonlinearity"] = name.removeprefix("rnn_")
    return _Draft(kind="gru" if name == "gru" else "rnn", inputs=[a["input"]], params=params, attrs=attrs)


def _only_first_output(call: _Call) -> bool:
    """Whether nothing reads the call's outputs but the first (a pool's or ``max``'s indices)."""
    return all(not _is_getitem(u) or u.args[1] == 0 or not u.users for u in call.node.users)


@_maps("max_pool2d", "max_pool2d_with_indices")
def _max_pool2d(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    if not b.is_act(x) or len(_shape(x)) != 4 or not _only_first_output(call):
        return None
    kernel = _spatial(a["kernel_size"], [1, 1])
    val = call.node.meta["val"]
    return _Draft(kind="pool2d", inputs=[x], outputs=[val if isinstance(val, torch.Tensor) else val[0]],
                  out_index={0: 0},
                  attrs={"mode": "max", "kernel": kernel, "stride": _spatial(a["stride"], kernel),
                         "padding": _spatial(a["padding"], [0, 0]), "dilation": _spatial(a["dilation"], [1, 1]),
                         "ceil_mode": bool(a["ceil_mode"]), "count_include_pad": False})


@_maps("avg_pool2d")
def _avg_pool2d(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    if not b.is_act(x) or len(_shape(x)) != 4:
        return None
    kernel = _spatial(a["kernel_size"], [1, 1])
    attrs = {"mode": "avg", "kernel": kernel, "stride": _spatial(a["stride"], kernel),
             "padding": _spatial(a["padding"], [0, 0]), "dilation": [1, 1], "ceil_mode": bool(a["ceil_mode"]),
             "count_include_pad": bool(a["count_include_pad"])}
    if a["divisor_override"] is not None:
        attrs["divisor_override"] = int(a["divisor_override"])
    return _Draft(kind="pool2d", inputs=[x], attrs=attrs)


@_maps("adaptive_avg_pool2d", "adaptive_max_pool2d")
def _adaptive_pool2d(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    if not b.is_act(x) or len(_shape(x)) != 4 or not _only_first_output(call):
        return None
    val = call.node.meta["val"]
    out = val if isinstance(val, torch.Tensor) else val[0]
    return _Draft(kind="adaptive_pool2d", inputs=[x], outputs=[out], out_index={0: 0},
                  attrs={"mode": "avg" if _aten_name(call.node) == "adaptive_avg_pool2d" else "max",
                         "output_size": [int(s) for s in out.shape[-2:]]})


@_maps(*POINTWISE_FNS)
def _pointwise(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    name = _aten_name(call.node)
    values = {k: a[k] for k in POINTWISE_FNS[name]}
    if (not b.is_act(x) or not x.meta["val"].is_floating_point()
            or not all(v is None or _is_scalar(v) for v in values.values())):
        return None  # (clamp's bounds given as tensors)
    return _Draft(kind="elementwise", inputs=[x],
                  attrs={"fn": name, **{k: None if v is None else float(v) for k, v in values.items()}})


@_maps(*_UNARY)
def _unary(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    if not b.is_act(x) or a.get("memory_format") not in _PLAIN_FORMATS:
        return None
    fn = _UNARY[_aten_name(call.node)]
    attrs: dict[str, Any] = {"fn": fn}
    if fn == "gelu":
        attrs["approximate"] = a["approximate"]
    return _Draft(kind="elementwise", inputs=[x], attrs=attrs)


def _is_scalar(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _arith(b: _Context, fn: str, x: Any, y: Any) -> _Draft | None:
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


@_maps("to", "_to_copy", "type_as")
def _to(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    """A copy or conversion that keeps the dtype and the layout (``type_as`` a tensor of the same dtype
    included): an identity. A cast to another dtype stays opaque (it runs whole, and carries no FLOPs)."""
    x, val = a["self"], call.node.meta.get("val")
    if (not b.is_act(x) or not isinstance(val, torch.Tensor) or val.dtype != x.meta["val"].dtype
            or a.get("memory_format") not in _PLAIN_FORMATS or a.get("layout") not in (None, torch.strided)):
        return None
    return _Draft(kind="elementwise", inputs=[x], attrs={"fn": "identity"})


@_maps("add", "sub", "mul", "div")
def _binary(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    if call.node in b.fused_norms:
        return b.fused_norms[call.node]
    if a.get("alpha", 1) != 1 or a.get("rounding_mode") is not None:
        return None
    return _arith(b, _aten_name(call.node), a["self"], a["other"])


@_maps("maximum", "minimum")
def _extremum(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x, y = a["self"], a["other"]
    if not (b.is_act(x) and b.is_act(y)):
        return None
    return _Draft(kind="binary", inputs=[x, y], attrs={"fn": _aten_name(call.node)})


@_maps("rsub")
def _rsub(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    if a.get("alpha", 1) != 1:
        return None
    return _arith(b, "sub", a["other"], a["self"])


@_maps("pow")
def _pow(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x, exponent = a.get("self"), a.get("exponent")
    if not b.is_act(x) or not _is_scalar(exponent):
        return None
    return _Draft(kind="elementwise", inputs=[x], attrs={"fn": "pow_scalar", "scalar": exponent})


@_maps("masked_fill")
def _masked_fill(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x, mask, value = a["self"], a["mask"], a["value"]
    if not (b.is_act(x) and b.is_act(mask)) or not _is_scalar(value):
        return None
    return _Draft(kind="binary", inputs=[x, mask], attrs={"fn": "masked_fill", "value": value})


@_maps("where")
def _where(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    """``torch.where(mask, x, value)`` and ``torch.where(mask, value, x)`` of a scalar (T5's position bias
    masked with the dtype's minimum): x filled with the value where the mask is false, or true."""
    mask, keep, other = a["condition"], a["self"], a["other"]
    if not b.is_act(mask):
        return None
    if b.is_act(keep) and _is_scalar(other):
        return _Draft(kind="binary", inputs=[keep, mask], attrs={"fn": "where", "value": other})
    if _is_scalar(keep) and b.is_act(other):
        return _Draft(kind="binary", inputs=[other, mask], attrs={"fn": "masked_fill", "value": keep})
    return None


@_maps("mean", "sum", "amax", "amin", "max", "min", "linalg_vector_norm", "var", "std", "logsumexp")
def _reduce(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    """A reduction of an activation over some axes: sum and mean; amax, amin and the values of ``max`` or
    ``min`` along one axis (their indices unread); the vector norm (``F.normalize``, ``x.norm(dim=..)``);
    var and std; logsumexp."""
    x = a["self"]
    name = _aten_name(call.node)
    if not b.is_act(x) or a.get("dtype") is not None or not x.meta["val"].is_floating_point():
        return None
    if name in ("max", "min") and ("dim" not in a or not _only_first_output(call)):
        return None  # (the whole tensor's max, or the indices read too)
    ndim = len(_shape(x))
    dims = a.get("dim")
    dims = [dims] if isinstance(dims, int) else dims
    axes = list(range(ndim)) if not dims else sorted({_axis(int(d), ndim) for d in dims})
    attrs: dict[str, Any] = {"fn": _REDUCE_FNS.get(name, name), "axes": axes, "keepdim": bool(a.get("keepdim", False))}
    if name == "linalg_vector_norm":
        if not _is_scalar(a["ord"]):
            return None
        attrs["ord"] = float(a["ord"])
    elif name in ("var", "std"):
        correction = a["correction"] if "correction" in a else (1 if a.get("unbiased", True) else 0)
        attrs["correction"] = 1.0 if correction is None else float(correction)
    val = call.node.meta["val"]  # (max and min along an axis: values and indices, of which the values)
    return _Draft(kind="reduce", inputs=[x], attrs=attrs,
                  outputs=[val if isinstance(val, torch.Tensor) else val[0]], out_index={0: 0})


# aten reductions -> the reduce kind's `fn`, where the names differ
_REDUCE_FNS = {"linalg_vector_norm": "norm"}


@_maps("cat")
def _cat(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    ndim = len(call.node.meta["val"].shape)
    # torch.cat skips 1-D empty tensors whatever the others' shapes (a cache's empty start, as in Hugging
    # Face's DynamicCache); they add nothing, so they are not inputs
    tensors = [t for t in a["tensors"] if not (ndim > 1 and _shape(t) == (0,))]
    if not tensors or not all(b.is_act(t) for t in tensors):
        return None
    return _Draft(kind="concat", inputs=tensors, attrs={"axis": _axis(int(a["dim"]), ndim)})


@_maps("stack")
def _stack(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    tensors = list(a["tensors"])
    if not tensors or not all(b.is_act(t) for t in tensors):
        return None
    return _Draft(kind="stack", inputs=tensors,
                  attrs={"axis": _axis(int(a["dim"]), len(call.node.meta["val"].shape))})


@_maps("expand_as")
def _expand_as(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    """``x.expand_as(y)``: the expand of x to y's shape (y is read for its shape only)."""
    x = a["self"]
    if not b.is_act(x):
        return None
    return _Draft(kind="expand", inputs=[x], attrs={"shape": list(call.node.meta["val"].shape)})


@_maps("expand")
def _expand(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    attrs = {"shape": list(call.node.meta["val"].shape)}
    if b.is_param(x):  # a parameter expanded (a class token to the batch): read by the parts that need it
        return _Draft(kind="expand", inputs=[], params={"value": x}, attrs=attrs)
    if not b.is_act(x):
        return None
    return _Draft(kind="expand", inputs=[x], attrs=attrs)


@_maps("repeat_interleave")
def _repeat_interleave(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x, repeats, dim = a.get("self"), a.get("repeats"), a.get("dim")
    if not b.is_act(x) or not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1 or dim is None:
        return None
    return _Draft(kind="repeat", inputs=[x],
                  attrs={"axis": _axis(int(dim), len(_shape(x))), "repeats": int(repeats)})


@_maps("split", "split_with_sizes", "chunk")
def _split(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    if not b.is_act(x):
        return None
    axis = _axis(int(a["dim"]), len(_shape(x)))
    return _Draft(kind="split", inputs=[x],
                  attrs={"axis": axis, "sizes": [int(t.shape[axis]) for t in call.node.meta["val"]]})


@_maps("select")
def _select(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    if not b.is_act(x):
        return None
    shape = _shape(x)
    axis = _axis(int(a["dim"]), len(shape))
    index = _axis(int(a["index"]), shape[axis])
    return _Draft(kind="slice", inputs=[x],
                  attrs={"axis": axis, "start": index, "stop": index + 1, "step": 1, "squeeze": True})


@_maps("index")
def _index(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    """``x[..., idx, ...]`` with one index tensor, a constant of consecutive increasing integers (Falcon's
    ``qkv[..., [-2], :]``): a slice of that axis (squeezed for a 0-dim index), so it splits like any other.
    A parameter table indexed by ids is an embedding lookup (`_table_lookup`)."""
    x, indices = a["self"], a["indices"]
    if b.is_param(x):
        return _table_lookup(b, a)
    given = [i for i, t in enumerate(indices) if t is not None]
    if not b.is_act(x) or len(given) != 1:
        return None
    source = indices[given[0]]
    while isinstance(source, fx.Node) and _aten_name(source) in ("lift_fresh_copy", "detach", "detach_", "clone"):
        source = source.args[0]  # (how a constant tensor made in forward reaches its use)
    value = b.traced.constants.get(source) if isinstance(source, fx.Node) else None
    if value is None or value.dtype not in (torch.int64, torch.int32) or value.dim() > 1 or value.numel() < 1:
        return None
    axis, size = given[0], _shape(x)[given[0]]
    picked = [int(v) + size if int(v) < 0 else int(v) for v in value.reshape(-1)]
    if not all(0 <= v < size for v in picked) or picked != list(range(picked[0], picked[0] + len(picked))):
        return None
    return _Draft(kind="slice", inputs=[x], attrs={"axis": axis, "start": picked[0], "stop": picked[-1] + 1,
                                                   "step": 1, "squeeze": value.dim() == 0})


@_maps("slice")
def _slice(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
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
def _reshape(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    if not b.is_act(x):
        return None
    return _Draft(kind="reshape", inputs=[x], attrs={"shape": list(call.node.meta["val"].shape)})


@_maps("transpose", "permute", "t", "numpy_T")
def _transpose(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
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


def _matmul_draft(operands: list[Any], *, c: Any = None, alpha: Any = 1, beta: Any = 0,
                  transpose_a: bool = False, transpose_b: bool = False) -> _Draft | None:
    """A `matmul` op: alpha (a @ b) + beta c, a or b read transposed where asked; None where the
    operands' shapes do not fit the kind (leading axes equal, or b 2-D)."""
    x, y = operands
    sx, sy = _shape(x), _shape(y)
    if len(sx) < 2 or not (len(sy) == 2 or (len(sy) == len(sx) and sx[:-2] == sy[:-2])):
        return None
    attrs: dict[str, Any] = {}
    if transpose_a:
        attrs["transpose_a"] = True
    if transpose_b:
        attrs["transpose_b"] = True
    if alpha != 1:
        attrs["alpha"] = float(alpha)
    inputs = [x, y]
    if beta != 0:
        inputs.append(c)
        attrs["beta"] = float(beta)
    return _Draft(kind="matmul", inputs=inputs, attrs=attrs)


def transposed_weight(b: _Context, node: Any) -> fx.Node | None:
    """The 2-D parameter `node` transposes (``w.T``, ``w.t()``, ``w.transpose(0, 1)``, ``w.permute(1, 0)``),
    None where it is not such a transpose."""
    if not isinstance(node, fx.Node) or not node.args:
        return None
    w, name = node.args[0], _aten_name(node)
    if not b.is_param(w) or len(_shape(w)) != 2:
        return None
    if name in ("numpy_T", "t") or (name == "transpose" and sorted(int(d) % 2 for d in node.args[1:3]) == [0, 1]) \
            or (name == "permute" and [int(d) % 2 for d in node.args[1]] == [1, 0]):
        return w
    return None


def transposed_linear(b: _Context, node: fx.Node) -> fx.Node | None:
    """The parameter w where `node` is ``x @ w.T`` (`transposed_weight`) of an activation x of two or more
    dims, the transpose used only there: a linear; None otherwise."""
    if _aten_name(node) not in ("matmul", "mm") or len(node.args) != 2:
        return None
    x, y = node.args
    w = transposed_weight(b, y)
    return w if w is not None and b.is_act(x) and len(_shape(x)) >= 2 and len(y.users) == 1 else None


@_maps("matmul", "bmm", "mm")
def _matmul(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    """A product of two activations; ``x @ w.T`` of a parameter w (Falcon's linears) is a ``linear`` (the
    builder makes no op of the transpose, `_Builder.fuse_transposed_weights`)."""
    x = a["self"]
    y = a.get("other", a.get("mat2"))
    w = transposed_linear(b, call.node)
    if w is not None:
        return _Draft(kind="linear", inputs=[x], params={"weight": w})
    if not (b.is_act(x) and b.is_act(y)):
        return None
    return _matmul_draft([x, y])


@_maps("baddbmm")
def _baddbmm(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    """beta c + alpha (x @ y) over a batch of matrices (BLOOM's ALiBi scores): a matmul adding c."""
    c, x, y = a["self"], a["batch1"], a["batch2"]
    if not (b.is_act(x) and b.is_act(y)) or not (a["beta"] == 0 or b.is_act(c)):
        return None
    return _matmul_draft([x, y], c=c, alpha=a["alpha"], beta=a["beta"])


def _einsum_as_matmul(equation: str) -> tuple[bool, bool] | None:
    """(transpose_a, transpose_b) where the two-operand `equation` is a batched matrix product
    ``B..mk,B..kn->B..mn`` (either operand possibly transposed), else None."""
    if "->" not in equation or "." in equation:
        return None
    lhs, out = equation.replace(" ", "").split("->")
    ops = lhs.split(",")
    if len(ops) != 2 or any(len(set(t)) != len(t) for t in (*ops, out)):
        return None
    sa, sb = ops
    batch = [c for c in out if c in sa and c in sb]
    m = [c for c in sa if c in out and c not in sb]
    n = [c for c in sb if c in out and c not in sa]
    k = [c for c in sa if c in sb and c not in out]
    if len(m) != 1 or len(n) != 1 or len(k) != 1 or set(sa) | set(sb) != set(out) | set(k):
        return None
    lead = "".join(batch)
    if out != lead + m[0] + n[0] or sa not in (lead + m[0] + k[0], lead + k[0] + m[0]) or \
            sb not in (lead + k[0] + n[0], lead + n[0] + k[0]):
        return None
    return sa != lead + m[0] + k[0], sb != lead + k[0] + n[0]


@_maps("einsum")
def _einsum(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    operands = list(a["tensors"])
    layout = _einsum_as_matmul(str(a["equation"]))
    if layout is None or len(operands) != 2 or not all(b.is_act(t) for t in operands):
        return None
    sx, sy = _shape(operands[0]), _shape(operands[1])
    if len(sx) != len(sy) or sx[:-2] != sy[:-2]:
        return None
    return _matmul_draft(operands, transpose_a=layout[0], transpose_b=layout[1])


@_maps("softmax", "_softmax", "log_softmax", "_log_softmax")
def _softmax(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    # a `dtype` equal to the input's (BLOOM's `softmax(x, dim, dtype=float32)` on float32) changes nothing
    if not b.is_act(x) or a.get("dtype") not in (None, x.meta["val"].dtype) or a.get("half_to_float"):
        return None
    return _Draft(kind="softmax", inputs=[x],
                  attrs={"axis": _axis(int(a["dim"]), len(_shape(x))), "log": "log" in _aten_name(call.node)})


@_maps("topk")
def _topk(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    if not b.is_act(x) or not _shape(x):
        return None
    attrs: dict[str, Any] = {"k": int(a["k"]), "axis": _axis(int(a["dim"]), len(_shape(x)))}
    attrs |= {name: False for name in ("largest", "sorted") if not a[name]}  # (true: torch's default)
    return _Draft(kind="topk", inputs=[x], attrs=attrs, out_index={0: 0, 1: 1})


@_maps("experts")
def _experts(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    """soapflow::experts, the one call of a Hugging Face mixture of experts (soap/capture/experts.py)."""
    x, index, weights = a["x"], a["index"], a["weights"]
    if not all(b.is_act(v) for v in (x, index, weights)) or len(_shape(x)) != 2:
        return None
    params = _weights(b, w_gate=a["w_gate"], w_up=a["w_up"], w_out=a["w_out"], b_gate=a["b_gate"], b_up=a["b_up"],
                      b_out=a["b_out"])
    if params is None:
        return None
    return _Draft(kind="experts", inputs=[x, index, weights], params=params,
                  attrs={"act": a["act"], "transposed": bool(a["transposed"])})


@_maps("dropout", "feature_dropout")
def _dropout(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["input"]
    feature = _aten_name(call.node) == "feature_dropout"
    if not b.is_act(x) or (feature and len(_shape(x)) < 2):
        return None
    seed = b.num_dropouts
    b.num_dropouts += 1
    attrs: dict[str, Any] = {"p": float(a["p"]) if a["train"] else 0.0, "seed": seed}
    if feature:
        attrs["feature"] = True
    return _Draft(kind="dropout", inputs=[x], attrs=attrs)


@_maps("rand", "randn", "rand_like", "randn_like")
def _rand(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    """``torch.rand`` and ``torch.randn`` of a fixed shape, or like a tensor (stochastic depth draws one
    value per sample; a VAE's reparameterization ``randn_like(std)``): drawn as the runtime draws it, so
    that any split draws the unsplit values and the verifying reference the same. A ``_like`` draw reads
    only its tensor's shape: the op has no input."""
    val = call.node.meta["val"]
    if not val.is_floating_point() or val.dim() < 1:
        return None
    seed = b.num_draws
    b.num_draws += 1
    attrs: dict[str, Any] = {"seed": seed}
    if _aten_name(call.node).startswith("randn"):
        attrs["normal"] = True
    return _Draft(kind="random", inputs=[], attrs=attrs)


@_maps("flip")
def _flip(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    if not b.is_act(x):
        return None
    ndim = len(_shape(x))
    return _Draft(kind="flip", inputs=[x], attrs={"axes": sorted({_axis(int(d), ndim) for d in a["dims"]})})


@_maps("roll")
def _roll(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    """``x.roll(shifts, dims)`` along given axes (Swin's shifted windows); a roll of the flattened tensor
    (no dims) stays as it is."""
    x, shifts, dims = a["self"], list(a["shifts"]), list(a["dims"])
    if not b.is_act(x) or not dims or len(dims) != len(shifts):
        return None
    ndim = len(_shape(x))
    return _Draft(kind="roll", inputs=[x], attrs={"shifts": [int(v) for v in shifts],
                                                  "axes": [_axis(int(d), ndim) for d in dims]})


@_maps("pad", "constant_pad_nd")
def _pad(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    """Constant padding (or cropping) of an activation."""
    x, pad = a["self"], [int(p) for p in a["pad"]]
    if (not b.is_act(x) or a.get("mode", "constant") != "constant" or len(pad) % 2
            or len(pad) > 2 * len(_shape(x))):
        return None
    value = None if a["value"] is None else float(a["value"])
    return _Draft(kind="pad", inputs=[x], attrs={"pad": pad, "value": value})


@_maps("prelu", "_prelu_kernel")
def _prelu(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    """PReLU of an activation x[N, C, ..] with its weight, one per channel or a single one."""
    x, weight = a["self"], a["weight"]
    shape = _shape(x)
    if not (b.is_act(x) and b.is_param(weight)) or len(_shape(weight)) != 1 or len(shape) < 2 or (
            _shape(weight)[0] not in (1, shape[1])):
        return None
    return _Draft(kind="prelu", inputs=[x], params={"weight": weight})


@_maps("scaled_dot_product_attention")
def _attention(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    if not all(b.is_act(t) and len(_shape(t)) == 4 for t in (q, k, v)):
        return None
    # Dropout inside the fused kernel draws from torch's generator in the kernel's own order, so no part
    # could draw the unsplit op's mask (the `dropout` kind hashes global indices instead): p > 0 stays
    # opaque. (Tracing writes such calls out, `attention`; those it leaves, grouped-query ones, reach here.)
    if a["dropout_p"]:
        return None
    (n, hq, tq, _), (nk, hkv, tk, _), (nv, hv, tv, _) = _shape(q), _shape(k), _shape(v)
    if not n == nk == nv or hkv != hv or tk != tv:
        return None
    # grouped-query attention: k and v have fewer heads, each shared by hq / hkv query heads; one head
    # (multi-query attention, Falcon's) broadcasts over the query heads even without enable_gqa
    if hkv != hq and not (a["enable_gqa"] and hq % hkv == 0) and hkv != 1:
        return None
    inputs = [q, k, v]
    if mask is not None:
        # a boolean (True keeps a key) or additive mask broadcasting to the scores [N, heads, Tq, Tk];
        # torch refuses a mask together with is_causal
        shape = _shape(mask) if b.is_act(mask) else None
        if shape is None or a["is_causal"] or len(shape) > 4 or any(
                s not in (1, full) for s, full in zip(reversed(shape), (tk, tq, hq, n), strict=False)):
            return None
        inputs.append(mask)
    return _Draft(kind="attention", inputs=inputs,
                  attrs={"is_causal": bool(a["is_causal"]), "scale": a["scale"]})


# aten's reduction enum (at::Reduction) → the `reduction` attr of the loss kinds; 0 (none) is no loss kind
_REDUCTIONS = {1: "mean", 2: "sum"}


def _loss(b: _Context, fn: str, logits: Any, target: Any, reduction: int, weight: Any = None,
          **attrs: Any) -> _Draft | None:
    if not (b.is_act(logits) and b.is_act(target)) or reduction not in _REDUCTIONS:
        return None
    sl, st = _shape(logits), _shape(target)
    lt, tt = logits.meta["val"], target.meta["val"]
    if fn == "cross_entropy":
        ok = len(sl) >= 2 and st == sl[:1] + sl[2:] and lt.is_floating_point() and tt.dtype == torch.int64
        # class weights: a tensor the graph computes or holds (a buffer), one per class
        ok = ok and (weight is None or (b.is_act(weight) and _shape(weight) == sl[1:2]))
    else:
        ok = sl == st and len(sl) >= 1 and lt.is_floating_point() and tt.is_floating_point()
    inputs = [logits, target] + ([] if weight is None else [weight])
    return _Draft(kind="loss", inputs=inputs,
                  attrs={"fn": fn, "reduction": _REDUCTIONS[reduction], **attrs}) if ok else None


def _cross_entropy_attrs(ignore_index: int, label_smoothing: float) -> dict[str, Any]:
    """The attrs of a cross entropy's options, those at PyTorch's defaults left out (the kind's defaults)."""
    attrs: dict[str, Any] = {}
    if int(ignore_index) != -100:
        attrs["ignore_index"] = int(ignore_index)
    if float(label_smoothing):
        attrs["label_smoothing"] = float(label_smoothing)
    return attrs


@_maps("cross_entropy_loss")
def _cross_entropy(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    return _loss(b, "cross_entropy", a["self"], a["target"], a["reduction"], a["weight"],
                 **_cross_entropy_attrs(a["ignore_index"], a["label_smoothing"]))


@_maps("nll_loss", "nll_loss_nd")
def _nll_loss(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    logits = b.fused.get(call.node)
    if logits is None:
        return None
    return _loss(b, "cross_entropy", logits, a["target"], a["reduction"], a["weight"],
                 **_cross_entropy_attrs(a["ignore_index"], 0.0))


@_maps("mse_loss")
def _mse_loss(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    return _loss(b, "mse", a["self"], a["target"], a["reduction"])

