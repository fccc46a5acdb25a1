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
``aten.cross_entropy_loss`` and ``aten.mse_loss`` with mean reduction (and ``log_softmax`` followed by
``nll_loss``, which the builder fuses) become one op of kind ``loss`` named ``loss``; any other op of the
loss function is named ``loss.<aten op name>`` (the reshapes of ``lm_cross_entropy`` are ``loss.reshape``
and ``loss.reshape_1``). A loss other than these ends in whatever ops compute it.

Imports torch, soap.opdef, `tracing`, `grouping` and `nodes`; must not import `builder` (it reaches the
builder through `_Context`), the simulator, the search, the runtime or soapflow.
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

# aten op name → the `fn` of the elementwise op it becomes
_UNARY = {"relu": "relu", "gelu": "gelu", "tanh": "tanh", "sigmoid": "sigmoid", "silu": "silu",
          "neg": "neg", "exp": "exp", "clone": "identity", "alias": "identity", "contiguous": "identity"}

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
    activations, a parameter's local name, the fused losses, and the count of dropouts so far."""

    traced: _Traced
    fused: dict[fx.Node, fx.Node]
    num_dropouts: int

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


@_maps("conv2d")
def _conv2d(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x, weight = a["input"], a["weight"]
    params = _weights(b, weight=weight, bias=a["bias"])
    if params is None or "weight" not in params or not b.is_act(x) or len(_shape(x)) != 4:
        return None
    kernel, dilation = _shape(weight)[2:], _spatial(a["dilation"], [1, 1])
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
                  attrs={"stride": _spatial(a["stride"], [1, 1]), "padding": _spatial(padding, [0, 0]),
                         "dilation": dilation, "groups": int(a["groups"])})


@_maps("linear")
def _linear(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["input"]
    params = _weights(b, weight=a["weight"], bias=a["bias"])
    if params is None or not b.is_act(x) or len(_shape(x)) < 2:
        return None
    return _Draft(kind="linear", inputs=[x], params=params)


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


@_maps("layer_norm")
def _layer_norm(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["input"]
    params = _weights(b, weight=a["weight"], bias=a["bias"])
    if params is None or not b.is_act(x):
        return None
    return _Draft(kind="layernorm", inputs=[x], params=params,
                  attrs={"normalized_shape": [int(s) for s in a["normalized_shape"]], "eps": float(a["eps"])})


@_maps("embedding")
def _embedding(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    idx = a["indices"]
    params = _weights(b, weight=a["weight"])
    if not params or not b.is_act(idx) or a["scale_grad_by_freq"] or a["sparse"] or len(_shape(idx)) < 1:
        return None
    padding_idx = int(a["padding_idx"])
    return _Draft(kind="embedding", inputs=[idx], params=params,
                  attrs={"padding_idx": None if padding_idx < 0 else padding_idx})


@_maps("lstm")
def _lstm(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
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


@_maps(*_UNARY)
def _unary(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
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


@_maps("add", "sub", "mul", "div")
def _binary(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    if a.get("alpha", 1) != 1 or a.get("rounding_mode") is not None:
        return None
    return _arith(b, _aten_name(call.node), a["self"], a["other"])


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


@_maps("mean", "sum")
def _reduce(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    if not b.is_act(x) or a.get("dtype") is not None:
        return None
    ndim = len(_shape(x))
    dims = a.get("dim")
    axes = list(range(ndim)) if not dims else sorted({_axis(int(d), ndim) for d in dims})
    return _Draft(kind="reduce", inputs=[x],
                  attrs={"fn": _aten_name(call.node), "axes": axes, "keepdim": bool(a.get("keepdim", False))})


@_maps("cat")
def _cat(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    tensors = list(a["tensors"])
    if not tensors or not all(b.is_act(t) for t in tensors):
        return None
    return _Draft(kind="concat", inputs=tensors,
                  attrs={"axis": _axis(int(a["dim"]), len(call.node.meta["val"].shape))})


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


@_maps("matmul", "bmm", "mm")
def _matmul(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    y = a.get("other", a.get("mat2"))
    if not (b.is_act(x) and b.is_act(y)):
        return None
    sx, sy = _shape(x), _shape(y)
    if len(sx) < 2 or not (len(sy) == 2 or (len(sy) == len(sx) and sx[:-2] == sy[:-2])):
        return None
    return _Draft(kind="matmul", inputs=[x, y])


@_maps("softmax", "_softmax", "log_softmax", "_log_softmax")
def _softmax(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["self"]
    if not b.is_act(x) or a.get("dtype") is not None or a.get("half_to_float"):
        return None
    return _Draft(kind="softmax", inputs=[x],
                  attrs={"axis": _axis(int(a["dim"]), len(_shape(x))), "log": "log" in _aten_name(call.node)})


@_maps("dropout")
def _dropout(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    x = a["input"]
    if not b.is_act(x):
        return None
    seed = b.num_dropouts
    b.num_dropouts += 1
    return _Draft(kind="dropout", inputs=[x], attrs={"p": float(a["p"]) if a["train"] else 0.0, "seed": seed})


@_maps("scaled_dot_product_attention")
def _attention(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    q, k, v = a["query"], a["key"], a["value"]
    if not all(b.is_act(t) and len(_shape(t)) == 4 for t in (q, k, v)):
        return None
    if a["attn_mask"] is not None or a["dropout_p"] or a["enable_gqa"]:
        return None
    if not _shape(q)[:2] == _shape(k)[:2] == _shape(v)[:2] or _shape(k)[2] != _shape(v)[2]:
        return None
    return _Draft(kind="attention", inputs=[q, k, v],
                  attrs={"is_causal": bool(a["is_causal"]), "scale": a["scale"]})


def _loss(b: _Context, fn: str, logits: Any, target: Any) -> _Draft | None:
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
def _cross_entropy(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    if (a["weight"] is not None or a["reduction"] != 1 or a["ignore_index"] != -100
            or a["label_smoothing"] != 0):
        return None
    return _loss(b, "cross_entropy", a["self"], a["target"])


@_maps("nll_loss", "nll_loss_nd")
def _nll_loss(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    logits = b.fused.get(call.node)
    return None if logits is None else _loss(b, "cross_entropy", logits, a["target"])


@_maps("mse_loss")
def _mse_loss(b: _Context, call: _Call, a: dict[str, Any]) -> _Draft | None:
    return None if a["reduction"] != 1 else _loss(b, "mse", a["self"], a["target"])

