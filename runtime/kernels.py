"""Partitioned kernels: compute one part of one op with plain torch calls.

Owns `KERNELS`, the part kernels by the name each registry kind gives in `OpDef.kernel` (every kind but
`input`, `constant` and `opaque`, whose `OpDef.run_specially` says how the runtime runs them), with
`compute_part` to call them (`compute_chunk` for a chunk along a carried dim, which starts from the
state of the chunk before it and returns its own), `run_opaque` (the whole-op call of an `opaque` op)
and `constant_value` (a `constant` op's value: a buffer, or what its recipe computes). A part receives
exactly the tensors of the regions its registry entry names (`input_regions`, `param_regions`,
`buffer_regions`) and returns its outputs shaped as `output_region`; halos, padding, masks and partial
sums are derived from the same entry, so the simulator's regions and the runtime's computation cannot
disagree. Everything here is autograd-friendly: no in-place op touches an input or a parameter
(batchnorm's running statistics, which are buffers, are the one thing updated in place).

Imports `soap` and torch; must not import the simulator or the search.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from soap.capture.experts import mixture
from soap.graph import Operator, OperatorGraph, TensorRef
from soap.opdef import Box, Range, Region, full_box, input_shape, pair
from soap.registry import POINTWISE_FNS, dims_of, op_def

Tensor = torch.Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class _Context:
    """What a kernel needs besides its regions: the mode, the part's buffers, the training step."""

    training: bool
    buffers: Mapping[str, Tensor] = field(default_factory=dict)
    step: int = 0
    # the initial state of a chunk along a carried dim (`soap.opdef.DimSpec.carried`): the final state of
    # the chunk before it; None: zeros
    state: tuple[Tensor, ...] | None = None
    # a cross-entropy mean's count of the whole target's entries that are not ignored (`counted_targets`);
    # None: this part's own (right for a part holding the whole target)
    counted: int | float | None = None
    # the dtype of the values a kernel makes from nothing (``random``); None: the graph's
    dtype: torch.dtype | None = None


Kernel = Callable[[Operator, Box, Sequence[Tensor | None], Mapping[str, Tensor], _Context],
                  tuple[Tensor, ...]]


def compute_part(op: Operator, box: Box, inputs: Sequence[Tensor | None], params: Mapping[str, Tensor], *,
                 training: bool = True, buffers: Mapping[str, Tensor] | None = None,
                 step: int = 0, check: bool = True, counted: int | float | None = None,
                 dtype: torch.dtype | None = None) -> tuple[Tensor, ...]:
    """The outputs of part `box` of `op`, each shaped as `output_region(op, box, i)`.

    `inputs` holds one tensor per entry of `input_regions(op, box)` (None where that is None), `params`
    the slices `param_regions(op, box)` names, `buffers` the slices `buffer_regions(op, box)` names
    (batchnorm's running statistics; updated in place in training; with momentum None also
    `num_batches_tracked`, already counting this batch). Where the box covers part of a dim without an
    output axis the outputs are partial sums. `training` switches dropout and batchnorm; `step` varies the
    dropout mask from one training step to the next. `check` asserts the output shapes against the
    registry (the runtime checks the first step only: the shapes do not change between steps). `counted`:
    for a cross-entropy mean (`soap.registry.counts_targets`), how many entries of the whole target are not
    ignored (`counted_targets`); None counts this part's own, which is right only for a part holding the
    whole target. `dtype`: the dtype of values a kernel makes from no input (``random``), where the run's
    differs from the graph's.
    """
    return compute_chunk(op, box, inputs, params, training=training, buffers=buffers, step=step, check=check,
                         counted=counted, dtype=dtype)[0]


def compute_chunk(op: Operator, box: Box, inputs: Sequence[Tensor | None], params: Mapping[str, Tensor], *,
                  state: Sequence[Tensor] | None = None, training: bool = True,
                  buffers: Mapping[str, Tensor] | None = None, step: int = 0, check: bool = True,
                  counted: int | float | None = None, dtype: torch.dtype | None = None
                  ) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """`compute_part` of a chunk along the op's carried dim (`soap.opdef.DimSpec.carried`): it starts from
    `state`, the final state of the chunk before it (None: zeros), and returns (its outputs, its final
    state). The kernel of a kind with a carried dim returns its outputs followed by its final state; the
    other kernels' final state is empty. Autograd connects both: the gradient of `state` is what the
    chunk before adds to the gradient of its final state."""
    entry = op_def(op.kind)
    kernel = KERNELS.get(entry.kernel)
    if kernel is None:
        raise ValueError(f"op {op.name!r}: kind {op.kind!r} has no partitioned kernel ({entry.run_specially})")
    ctx = _Context(training=training, buffers=dict(buffers or {}), step=step,
                   state=None if state is None else tuple(state), counted=counted, dtype=dtype)
    everything = kernel(op, box, inputs, params, ctx)
    outputs, final = everything[:len(op.outputs)], everything[len(op.outputs):]
    if not check:
        return outputs, final
    for i, out in enumerate(outputs):
        expected = _shape(entry.output_region(op, box, i))
        assert tuple(out.shape) == expected, (op.name, i, tuple(out.shape), expected)
    return outputs, final


def run_opaque(op: Operator, module: torch.nn.Module | None, inputs: Sequence[Tensor],
               params: Mapping[str, Tensor] | None = None) -> tuple[Tensor, ...]:
    """Run an `opaque` op whole: call `module` (the leaf submodule at `op.module`) when `attrs["target"]`
    is ``module``, else the function the qualified name in `target` names.

    The arguments follow `attrs["args"]` and `attrs["kwargs"]`, encoded as capture writes them (see
    docs/op_kinds.md): ``{"input": i}`` is tensor input i, ``{"param": name}`` the parameter `name` of
    `params`, ``{"dtype": name}`` a torch dtype, ``{"device": None}`` the inputs' device, ``{"torch": name}``
    an attribute of torch (a layout or memory format), anything else a literal; with no `args` the inputs
    are passed in order. Tensor outputs come back as a tuple, in order.
    """
    target = op.attrs.get("target", "module")
    fn: Callable[..., Any]
    if target == "module":
        if module is None:
            raise ValueError(f"opaque op {op.name!r} calls its module, but none was given")
        fn = module
    else:
        fn = _resolve(str(target))
    bound = _bindings(op, inputs[0].device if inputs else None)
    bound["input"] = lambda i: inputs[int(i)]
    bound["param"] = lambda name: (params or {})[str(name)]
    args = _fill(op.attrs["args"], bound) if "args" in op.attrs else list(inputs)
    kwargs = {k: _fill(v, bound) for k, v in op.attrs.get("kwargs", {}).items()}
    result = fn(*args, **kwargs)
    if isinstance(result, Tensor):
        return (result,)
    return tuple(r for r in _flatten(result) if isinstance(r, Tensor))


def constant_value(op: Operator, tensors: Mapping[str, Tensor], *,
                   cast: Callable[[Tensor], Tensor] = lambda t: t) -> Tensor:
    """The value of a `constant` op: the buffer its `fqn` names in `tensors` (every parameter and buffer
    of the model by fully qualified name), or what its `recipe` computes (soap/capture/builder.py: calls
    whose tensor arguments are earlier steps, buffers or literals). `cast` applies to the buffers a recipe
    reads, as to the model's own (a float64 run computes from float64 buffers)."""
    if "recipe" not in op.attrs:
        return tensors[op.attrs["fqn"]]
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    values: list[Any] = []
    bound = _bindings(op, device)
    bound["step"] = lambda i: values[int(i)]
    bound["buffer"] = lambda fqn: cast(tensors[str(fqn)])
    bound["literal"] = lambda lit: torch.tensor(list(lit["values"]), dtype=getattr(torch, str(lit["dtype"])),
                                                device=device).reshape([int(s) for s in lit["shape"]])
    for step in op.attrs["recipe"]:
        fn = _resolve(str(step["target"]))
        values.append(fn(*_fill(step["args"], bound), **{k: _fill(v, bound) for k, v in step["kwargs"].items()}))
    value = values[-1]
    assert isinstance(value, Tensor) and tuple(value.shape) == op.outputs[0].shape, (op.name, op.outputs[0])
    return value


def _bindings(op: Operator, device: torch.device | None) -> dict[str, Callable[[Any], Any]]:
    """How `_fill` decodes the encoded arguments every call template may hold (docs/op_kinds.md)."""

    def unrepresentable(text: str) -> Any:
        raise ValueError(f"op {op.name!r} has an argument capture could not encode: {text}")

    return {"dtype": lambda name: getattr(torch, str(name)), "device": lambda _: device,
            "torch": lambda name: getattr(torch, str(name)), "repr": unrepresentable}


def _fill(template: Any, bound: Mapping[str, Callable[[Any], Any]]) -> Any:
    """A call argument decoded: a one-key dict whose key `bound` knows is replaced by its value."""
    if isinstance(template, Mapping) and len(template) == 1 and next(iter(template)) in bound:
        key, value = next(iter(template.items()))
        return bound[key](value)
    if isinstance(template, (list, tuple)):
        return [_fill(t, bound) for t in template]
    return template


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flatten(v)]
    return [value]


def _resolve(qualified: str) -> Callable[..., Any]:
    """The object a dotted name names: the longest importable module prefix, then attributes."""
    parts = qualified.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ValueError(f"cannot resolve function {qualified!r}")


# ---------------------------------------------------------------- helpers


def _shape(region: Region) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in region)


def _pads(need: Range, have: Range) -> tuple[int, int]:
    """Rows to add before and after `have` (what was read, clipped to the tensor) to cover `need`."""
    if have[1] <= have[0]:
        return (need[1] - need[0], 0)
    return (have[0] - need[0], need[1] - have[1])


def _pad_window(x: Tensor, need: tuple[Range, Range], have: tuple[Range, Range], value: float) -> Tensor:
    """x (the clipped input region) padded on the sides where the window ran past the tensor border."""
    top, bottom = _pads(need[0], have[0])
    left, right = _pads(need[1], have[1])
    if top == bottom == left == right == 0:
        return x
    return F.pad(x, (left, right, top, bottom), value=value)


def _symmetric_pads(need: tuple[Range, Range], have: tuple[Range, Range]) -> tuple[int, int] | None:
    """(rows, columns) of padding when the window runs equally far past both borders of each axis (a
    part that covers the whole height and width): the kernel's own padding then does it without the
    copy of an explicit pad (and its backward). None when the padding is one-sided (a halo part)."""
    top, bottom = _pads(need[0], have[0])
    left, right = _pads(need[1], have[1])
    if have[0][1] <= have[0][0] or have[1][1] <= have[1][0] or top != bottom or left != right:
        return None
    return (top, left)


# ---------------------------------------------------------------- layers with weights


def _conv2d(op, box, inputs, params, ctx):
    entry = op_def(op.kind)
    (region,) = entry.input_regions(op, box)
    need, have = entry.needed_window(op, box), (region[2], region[3])
    padding = _symmetric_pads(need, have)
    x = inputs[0] if padding is not None else _pad_window(inputs[0], need, have, 0.0)
    weight = params["weight"]
    # a part holds whole groups or lies inside one: its group count follows from the channel counts
    groups = x.shape[1] // weight.shape[1]
    return (F.conv2d(x, weight, params.get("bias"), stride=pair(op.attrs.get("stride", 1)),
                     padding=padding or 0, dilation=pair(op.attrs.get("dilation", 1)), groups=groups),)


def _conv_transpose2d(op, box, inputs, params, ctx):
    # the part's input rows transposed-convolved without padding (row 0 at output row in_lo * stride -
    # padding), then the part's own rows kept (zeros where no input row reaches: output padding)
    (region,) = op_def(op.kind).input_regions(op, box)
    a, x, weight = op.attrs, inputs[0], params["weight"]
    stride, padding, dilation = pair(a.get("stride", 1)), pair(a.get("padding", 0)), pair(a.get("dilation", 1))
    groups = int(a.get("groups", 1))  # (with groups > 1 its channels are never split)
    if all(hi > lo for lo, hi in region[2:]):
        y = F.conv_transpose2d(x, weight, None, stride=stride, groups=groups, dilation=dilation)
    else:
        y = x.new_zeros((x.shape[0], weight.shape[1] * groups, 0, 0))
    pads, firsts = [], []
    for axis, (out, got, s, p) in enumerate(zip(box[2:4], region[2:], stride, padding, strict=True)):
        start = out[0] - (got[0] * s - p)  # where the part's first row lies in y
        pads.append((max(0, -start), max(0, start + out[1] - out[0] - y.shape[2 + axis])))
        firsts.append(start + pads[-1][0])  # ... and in y once padded
    if any(pads[0]) or any(pads[1]):
        y = F.pad(y, (*pads[1], *pads[0]))
    top, left = firsts
    y = y[:, :, top:top + box[2][1] - box[2][0], left:left + box[3][1] - box[3][0]]
    bias = params.get("bias")
    return (y if bias is None else y + bias.view(1, -1, 1, 1),)


def _conv1d(op, box, inputs, params, ctx):
    entry = op_def(op.kind)
    (region,) = entry.input_regions(op, box)
    (need,) = entry.needed_window(op, box)
    x, weight = inputs[0], params["weight"]
    before, after = _pads(need, region[2])
    if before or after:
        x = F.pad(x, (before, after))
    return (F.conv1d(x, weight, params.get("bias"), stride=int(op.attrs.get("stride", 1)),
                     dilation=int(op.attrs.get("dilation", 1)), groups=x.shape[1] // weight.shape[1]),)


def _linear(op, box, inputs, params, ctx):
    weight = params["weight"]
    if op.attrs.get("transposed", False):
        weight = weight.t()  # stored [in, out] (Conv1D)
    return (F.linear(inputs[0], weight, params.get("bias")),)


def _matmul(op, box, inputs, params, ctx):
    a, b = inputs[0], inputs[1]
    if op.attrs.get("transpose_a", False):
        a = a.transpose(-2, -1)
    if op.attrs.get("transpose_b", False):
        b = b.transpose(-2, -1)
    y = torch.matmul(a, b)
    alpha = op.attrs.get("alpha", 1.0)
    if alpha != 1.0:
        y = y * alpha
    if len(inputs) > 2 and inputs[2] is not None:
        # the parts with the first k chunk add c (the others read no region of it)
        beta = op.attrs.get("beta", 1.0)
        y = y + (inputs[2] if beta == 1.0 else beta * inputs[2])
    return (y,)


def _batchnorm(op, box, inputs, params, ctx):
    mean, var = ctx.buffers.get("running_mean"), ctx.buffers.get("running_var")
    momentum = op.attrs.get("momentum", 0.1)
    if momentum is None and ctx.training and "num_batches_tracked" in ctx.buffers:
        momentum = 1.0 / float(ctx.buffers["num_batches_tracked"])
    return (F.batch_norm(inputs[0], mean, var, params.get("weight"), params.get("bias"),
                         training=ctx.training or mean is None, momentum=momentum or 0.0,
                         eps=float(op.attrs.get("eps", 1e-5))),)


# On a half-precision input (bf16, fp16) norms and softmax compute in float32 and return the input's dtype,
# as torch.autocast runs them. The RMS norm, written out, always does (as Hugging Face's norms cast): its
# sum of squares overflows in fp16 above 256. Layer norm and softmax do on the CPU, whose half-precision
# kernels lose accuracy in backward (a bf16 layer norm's weight and bias gradients: 2-3% of their size off
# float64 natively, 0.2-0.5% in float32; a layer norm's bias gradient was 25% off under bf16 tp). CUDA's
# kernels accumulate in float32 (PyTorch's accumulate type), where the casts would only add memory
# traffic; that is PyTorch's design, not measured here.
_HALF = (torch.float16, torch.bfloat16)


def _wide(t: Tensor | None, *, cpu_only: bool = False) -> Tensor | None:
    """`t` in float32 where it is half precision (on the CPU only, with `cpu_only`), else `t`."""
    if t is None or t.dtype not in _HALF or (cpu_only and t.device.type != "cpu"):
        return t
    return t.float()


def _layernorm(op, box, inputs, params, ctx):
    shape = [int(s) for s in op.attrs["normalized_shape"]]
    x = inputs[0]
    weight, bias = params.get("weight"), params.get("bias")
    return (F.layer_norm(_wide(x, cpu_only=True), shape, _wide(weight, cpu_only=True), _wide(bias, cpu_only=True),
                         eps=float(op.attrs.get("eps", 1e-5))).to(x.dtype),)


def _groupnorm(op, box, inputs, params, ctx):
    x = inputs[0]
    weight, bias = params.get("weight"), params.get("bias")
    return (F.group_norm(_wide(x, cpu_only=True), int(op.attrs["num_groups"]), _wide(weight, cpu_only=True),
                         _wide(bias, cpu_only=True), eps=float(op.attrs.get("eps", 1e-5))).to(x.dtype),)


def _rmsnorm(op, box, inputs, params, ctx):
    # written out as Hugging Face's LlamaRMSNorm computes it (the normalization in float32, back to the
    # input's dtype before the weight), so that a fused hand-written norm gives the model's own rounding
    x = inputs[0]
    axes = tuple(range(x.ndim - len(op.attrs["normalized_shape"]), x.ndim))
    eps = op.attrs.get("eps")
    eps = torch.finfo(x.dtype).eps if eps is None else float(eps)
    wide = _wide(x)
    y = (wide * torch.rsqrt(wide.pow(2).mean(axes, keepdim=True) + eps)).to(x.dtype)
    weight = params.get("weight")
    offset = float(op.attrs.get("offset") or 0.0)
    if weight is None:
        return (y,)
    return (weight * y,) if not offset else (y * (offset + weight),)


def _embedding(op, box, inputs, params, ctx):
    idx, weight = inputs[0], params["weight"]
    lo, hi = box[-1]
    vocab = op.params["weight"].shape[0]
    pad = op.attrs.get("padding_idx")
    if pad is not None:
        pad = int(pad) + vocab if int(pad) < 0 else int(pad)
        pad = pad - lo if lo <= pad < hi else None
    if (lo, hi) == (0, vocab):
        return (F.embedding(idx, weight, padding_idx=pad),)
    inside = (idx >= lo) & (idx < hi)
    local = torch.where(inside, idx - lo, torch.zeros_like(idx))
    return (F.embedding(local, weight, padding_idx=pad) * inside.unsqueeze(-1).to(weight.dtype),)


def _recurrent_flat(op, params) -> tuple[list[Tensor], bool]:
    """The parameters of a recurrent op (lstm, gru, rnn) in the order torch's recurrent functions take
    them: per layer weight_ih, weight_hh and, with biases, bias_ih, bias_hh; and whether it has biases."""
    has_bias = "bias_ih_l0" in params
    flat = []
    for k in range(int(op.attrs["num_layers"])):
        flat += [params[f"weight_ih_l{k}"], params[f"weight_hh_l{k}"]]
        if has_bias:
            flat += [params[f"bias_ih_l{k}"], params[f"bias_hh_l{k}"]]
    return flat, has_bias


def _lstm(op, box, inputs, params, ctx):
    x = inputs[0]
    layers, hidden = int(op.attrs["num_layers"]), int(op.attrs["hidden_size"])
    flat, has_bias = _recurrent_flat(op, params)
    if ctx.state is None:
        h0 = c0 = x.new_zeros(layers, x.shape[0], hidden)
    else:
        h0, c0 = ctx.state
    out, h_n, c_n = torch.lstm(x, (h0, c0), flat, has_bias, layers, 0.0, ctx.training, False, True)
    if box[1][1] != op.outputs[0].shape[1]:
        # not the last chunk: h_n and c_n are the next chunk's state, none of the op's outputs
        return (out, h_n[:0], c_n[:0], h_n, c_n)
    return (out, h_n, c_n, h_n, c_n)


def _gru_or_rnn(fn: Callable[..., tuple[Tensor, Tensor]]) -> Kernel:
    """The kernel of a recurrent kind whose state is h alone (gru, rnn), running torch's `fn` (torch.gru,
    torch.rnn_tanh or torch.rnn_relu) from the chunk's initial h (zeros for the first chunk)."""
    def kernel(op, box, inputs, params, ctx):
        x = inputs[0]
        layers, hidden = int(op.attrs["num_layers"]), int(op.attrs["hidden_size"])
        flat, has_bias = _recurrent_flat(op, params)
        (h0,) = (x.new_zeros(layers, x.shape[0], hidden),) if ctx.state is None else ctx.state
        out, h_n = fn(x, h0, flat, has_bias, layers, 0.0, ctx.training, False, True)
        if box[1][1] != op.outputs[0].shape[1]:
            return (out, h_n[:0], h_n)  # not the last chunk: h_n is the next chunk's state, not an output
        return (out, h_n, h_n)
    return kernel


_gru = _gru_or_rnn(torch.gru)


def _rnn(op, box, inputs, params, ctx):
    fn = {"tanh": _rnn_tanh, "relu": _rnn_relu}.get(op.attrs["nonlinearity"])
    if fn is None:
        raise ValueError(f"op {op.name!r}: unknown rnn nonlinearity {op.attrs['nonlinearity']!r}")
    return fn(op, box, inputs, params, ctx)


_rnn_tanh = _gru_or_rnn(torch.rnn_tanh)
_rnn_relu = _gru_or_rnn(torch.rnn_relu)


def _attention(op, box, inputs, params, ctx):
    q, k, v = inputs[:3]
    mask = inputs[3] if len(inputs) > 3 else None
    causal = bool(op.attrs.get("is_causal", False))
    if causal and box[2][0] > 0:
        # the part's query rows are global rows [lo, hi); causal is top-left aligned, as in torch, so a
        # part from row 0 is causal itself, and a later one needs the mask of its rows
        lo, hi = box[2]
        rows = torch.arange(lo, hi, device=q.device)
        mask, causal = rows[:, None] >= torch.arange(k.shape[2], device=q.device)[None, :], False
    # the part's query heads are whole groups of its kv heads, or lie inside one (Attention.check)
    return (F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=op.attrs.get("scale"),
                                           enable_gqa=k.shape[1] != q.shape[1]),)


# ---------------------------------------------------------------- pooling


def _upsample(op, box, inputs, params, ctx):
    entry = op_def(op.kind)
    (region,) = entry.input_regions(op, box)
    x = inputs[0]
    if op.attrs.get("mode", "nearest") == "nearest":
        # the part's input rows upsampled, then the rows of the part's box (a split may fall inside a row's
        # copies)
        s, t = (int(f) for f in op.attrs["scale"])
        y = F.interpolate(x, scale_factor=(s, t), mode="nearest")
        top, left = box[2][0] - region[2][0] * s, box[3][0] - region[3][0] * t
        return (y[:, :, top:top + box[2][1] - box[2][0], left:left + box[3][1] - box[3][0]],)
    # bilinear: along each spatial axis, every output row of the box blends the two input rows around its
    # source coordinate, computed as torch computes it (in float32 for float32, bfloat16 and float16 inputs)
    opmath = torch.float64 if x.dtype == torch.float64 else torch.float32
    n_in = input_shape(op, 0)[2:]
    for axis in (0, 1):
        (lo, hi), start, n = box[2 + axis], region[2 + axis][0], n_in[axis]
        s = int(op.attrs["scale"][axis])
        rows = torch.arange(lo, hi, dtype=opmath, device=x.device)
        if op.attrs.get("align_corners"):
            u = rows * ((n - 1) / (n * s - 1) if n * s > 1 else 0.0)
        else:
            u = ((rows + 0.5) * (1.0 / s) - 0.5).clamp(min=0.0)
        lower = u.floor().to(torch.int64).clamp(max=n - 1)
        upper = torch.where(lower < n - 1, lower + 1, lower)
        lam = (u - lower.to(opmath)).clamp(0.0, 1.0).to(x.dtype)
        view = [1, 1, 1, 1]
        view[2 + axis] = hi - lo
        lam = lam.view(view)
        a, b = x.index_select(2 + axis, lower - start), x.index_select(2 + axis, upper - start)
        x = a + (b - a) * lam
    return (x,)


def _pool2d(op, box, inputs, params, ctx):
    entry = op_def(op.kind)
    a = op.attrs
    (region,) = entry.input_regions(op, box)
    need, have = entry.needed_window(op, box), (region[2], region[3])
    kernel = pair(a["kernel"])
    stride = pair(a.get("stride") or a["kernel"])
    if a.get("mode", "max") == "max":
        # -inf padding never wins a max, so the explicit pad acts like torch's implicit one (which
        # allows at most half a kernel)
        padding = _symmetric_pads(need, have)
        if padding is not None and all(2 * p <= k for p, k in zip(padding, kernel, strict=True)):
            return (F.max_pool2d(inputs[0], kernel, stride, padding, pair(a.get("dilation", 1))),)
        x = _pad_window(inputs[0], need, have, -math.inf)
        return (F.max_pool2d(x, kernel, stride, 0, pair(a.get("dilation", 1))),)
    x = _pad_window(inputs[0], need, have, 0.0)
    total = F.avg_pool2d(x, kernel, stride, 0, divisor_override=1)
    if a.get("divisor_override"):
        return (total / float(a["divisor_override"]),)
    # torch divides by the window's overlap with [-padding, size + padding) (count_include_pad) or with
    # the tensor itself; count that overlap the same way, over the part's global rows and columns
    size = input_shape(op, 0)[2:]
    padding = pair(a.get("padding", 0))
    masks = []
    for (lo, hi), n, p in zip(need, size, padding, strict=True):
        rows = torch.arange(lo, hi, device=x.device)
        first, last = (-p, n + p) if a.get("count_include_pad", True) else (0, n)
        masks.append((rows >= first) & (rows < last))
    inside = (masks[0][:, None] & masks[1][None, :]).to(x.dtype)[None, None]
    count = F.avg_pool2d(inside, kernel, stride, 0, divisor_override=1)
    return (total / count,)


def _adaptive_pool2d(op, box, inputs, params, ctx):
    size = op.outputs[0].shape[2:]
    if op.attrs.get("mode", "avg") == "max":
        return (F.adaptive_max_pool2d(inputs[0], size),)
    return (F.adaptive_avg_pool2d(inputs[0], size),)


# ---------------------------------------------------------------- pointwise and shape ops

_UNARY: dict[str, Callable[[Tensor, Mapping[str, Any]], Tensor]] = {
    "relu": lambda x, a: F.relu(x),
    "gelu": lambda x, a: F.gelu(x, approximate=a.get("approximate") or "none"),
    "tanh": lambda x, a: torch.tanh(x),
    "sigmoid": lambda x, a: torch.sigmoid(x),
    "silu": lambda x, a: F.silu(x),
    "neg": lambda x, a: -x,
    "exp": lambda x, a: torch.exp(x),
    "rsqrt": lambda x, a: torch.rsqrt(x),
    "identity": lambda x, a: x,
    "scale": lambda x, a: x * a["scalar"],
    "add_scalar": lambda x, a: x + a["scalar"],
    "pow_scalar": lambda x, a: x ** a["scalar"],
    "rsub_scalar": lambda x, a: a["scalar"] - x,
}


def _elementwise(op, box, inputs, params, ctx):
    fn = op.attrs["fn"]
    if fn in POINTWISE_FNS:
        return (getattr(torch.ops.aten, fn).default(inputs[0], *(op.attrs[k] for k in POINTWISE_FNS[fn])),)
    if fn not in _UNARY:
        raise ValueError(f"op {op.name!r}: unknown elementwise fn {fn!r}; known: {', '.join(_UNARY)}")
    return (_UNARY[fn](inputs[0], op.attrs),)


def _binary(op, box, inputs, params, ctx):
    operands = list(inputs)
    if "other" in params:
        operands.insert(int(op.attrs.get("param_operand", 1)), params["other"])
    a, b = operands
    fn = op.attrs["fn"]
    if fn == "add":
        return (a + b,)
    if fn == "sub":
        return (a - b,)
    if fn == "mul":
        return (a * b,)
    if fn == "div":
        return (a / b,)
    if fn == "masked_fill":
        # masked_fill broadcasts the mask to a only; the registry's regions broadcast both ways
        return (torch.where(b, torch.as_tensor(op.attrs["value"], dtype=a.dtype, device=a.device), a),)
    if fn in ("maximum", "minimum"):
        return ((torch.maximum if fn == "maximum" else torch.minimum)(a, b),)
    if fn == "where":
        return (torch.where(b, a, torch.as_tensor(op.attrs["value"], dtype=a.dtype, device=a.device)),)
    raise ValueError(f"op {op.name!r}: unknown binary fn {fn!r}")


def _reduce(op, box, inputs, params, ctx):
    entry = op_def(op.kind)
    axes = entry.reduce_axes(op)
    x, keepdim, fn = inputs[0], bool(op.attrs.get("keepdim", False)), op.attrs.get("fn", "sum")
    if fn in ("sum", "mean"):
        y = torch.sum(x, dim=axes, keepdim=keepdim)
        if fn == "mean":
            shape = input_shape(op, 0)
            y = y / math.prod(shape[a] for a in axes)
        return (y,)
    if fn in ("max", "min"):  # the values along one axis (their gradient goes to the index torch picks)
        (axis,) = axes
        return ((torch.max if fn == "max" else torch.min)(x, dim=axis, keepdim=keepdim).values,)
    if fn in ("amax", "amin"):
        return ((torch.amax if fn == "amax" else torch.amin)(x, dim=axes, keepdim=keepdim),)
    if fn == "norm":
        return (torch.linalg.vector_norm(x, ord=float(op.attrs.get("ord", 2.0)), dim=axes, keepdim=keepdim),)
    if fn in ("var", "std"):
        return ((torch.var if fn == "var" else torch.std)(x, dim=axes, correction=op.attrs.get("correction", 1.0),
                                                           keepdim=keepdim),)
    if fn == "logsumexp":
        return (torch.logsumexp(x, dim=axes, keepdim=keepdim),)
    raise ValueError(f"op {op.name!r}: unknown reduce fn {fn!r}")


def _concat(op, box, inputs, params, ctx):
    return (torch.cat(list(inputs), dim=op_def(op.kind).axis(op)),)


def _stack(op, box, inputs, params, ctx):
    return (torch.stack(list(inputs), dim=op_def(op.kind).axis(op)),)


def _expand(op, box, inputs, params, ctx):
    x = inputs[0] if inputs else params["value"]
    return (x.expand(_shape(tuple(box))),)


def _repeat(op, box, inputs, params, ctx):
    axis, repeats = int(op.attrs["axis"]), int(op.attrs["repeats"])
    lo, hi = box[axis]
    # the region starts at the row repeated into global row lo
    return (inputs[0].repeat_interleave(repeats, dim=axis).narrow(axis, lo - (lo // repeats) * repeats, hi - lo),)


def _split(op, box, inputs, params, ctx):
    sizes = [int(s) for s in op.attrs["sizes"]]
    return tuple(torch.split(inputs[0], sizes, dim=op_def(op.kind).axis(op)))


def _slice(op, box, inputs, params, ctx):
    x, axis = inputs[0], op_def(op.kind).axis(op)
    # the region starts at the first selected row, so the part takes every step-th row from 0
    index = [slice(None)] * x.ndim
    index[axis] = slice(0, None, int(op.attrs.get("step") or 1))
    y = x[tuple(index)]
    return (y.select(axis, 0) if op.attrs.get("squeeze", False) else y,)


def _reshape(op, box, inputs, params, ctx):
    return (inputs[0].reshape(_shape(op_def(op.kind).output_region(op, box, 0))),)


def _transpose(op, box, inputs, params, ctx):
    return (inputs[0].permute([int(p) for p in op.attrs["perm"]]),)


def _softmax(op, box, inputs, params, ctx):
    fn = F.log_softmax if op.attrs.get("log", False) else F.softmax
    x = inputs[0]
    return (fn(_wide(x, cpu_only=True), dim=int(op.attrs["axis"])).to(x.dtype),)


def _topk(op, box, inputs, params, ctx):
    return tuple(torch.topk(inputs[0], int(op.attrs["k"]), dim=int(op.attrs["axis"]),
                            largest=bool(op.attrs.get("largest", True)), sorted=bool(op.attrs.get("sorted", True))))


def _experts(op, box, inputs, params, ctx):
    # the held experts [lo, hi) of the routed ones (tokens routed elsewhere add 0) and the held inner range:
    # partial sums either way
    x, index, weights = inputs
    return (mixture(x, index, weights, params.get("w_gate"), params["w_up"], params["w_out"], params.get("b_gate"),
                    params.get("b_up"), params.get("b_out"), act=str(op.attrs["act"]),
                    transposed=bool(op.attrs["transposed"]), first=box[1][0]),)


_M32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) of int64 values in [0, 2**32)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def _hashed(region: Region, shape: Sequence[int], salt: int, seed: int, step: int,
            device: torch.device | str) -> Tensor:
    """A 32-bit hash (int64 in [0, 2**32)) of each element of `region` of a tensor of `shape`, from its
    global flat index, `salt` (one per kind of draw), the seed and the step."""
    strides = [math.prod(shape[a + 1:]) for a in range(len(shape))]
    flat = torch.zeros((), dtype=torch.int64, device=device)
    for a, ((lo, hi), stride) in enumerate(zip(region, strides, strict=True)):
        view = [1] * len(region)
        view[a] = hi - lo
        flat = flat + (torch.arange(lo, hi, dtype=torch.int64, device=device) * stride).view(view)
    key = (seed * 0x9E3779B1 + step * 0x85EBCA6B + salt) & _M32
    h = _mix32((flat & _M32) ^ key)
    return _mix32(h ^ (((flat >> 32) + key) & _M32))


def dropout_keep(region: Region, shape: Sequence[int], *, p: float, seed: int, step: int,
                 device: torch.device | str = "cpu") -> Tensor:
    """The keep mask (bool) of `region` of a tensor of `shape`: a hash of each element's global flat
    index, the seed and the step, so every split of the tensor draws the same mask."""
    return _hashed(region, shape, 0x632BE5AB, seed, step, device) >= round(p * 2**32)


def uniform_draws(region: Region, shape: Sequence[int], *, seed: int, step: int, dtype: torch.dtype,
                  device: torch.device | str = "cpu") -> Tensor:
    """Uniform values in [0, 1) of `region` of a tensor of `shape` (the ``random`` kind, and the verifying
    reference's ``torch.rand``): a hash of each element's global index, the seed and the step, so every
    split draws the same values."""
    h = _hashed(region, shape, 0x2545F491, seed, step, device)
    # as many bits as the dtype holds exactly (its significand's), so that no value rounds up to 1
    bits = min(32, 1 - round(math.log2(torch.finfo(dtype).eps)))
    return ((h >> (32 - bits)).to(torch.float64) / 2**bits).to(dtype)


def normal_draws(region: Region, shape: Sequence[int], *, seed: int, step: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> Tensor:
    """Standard normal values of `region` of a tensor of `shape` (the ``random`` kind with `normal`, and the
    verifying reference's ``torch.randn``): the Box-Muller transform of two hashes of each element's global
    index, the seed and the step, so every split draws the same values."""
    u1 = 1.0 - _hashed(region, shape, 0x7F4A7C15, seed, step, device).to(torch.float64) / 2**32  # in (0, 1]
    u2 = _hashed(region, shape, 0x1B873593, seed, step, device).to(torch.float64) / 2**32
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * math.pi * u2)).to(dtype)


def dropped(x: Tensor, region: Region, shape: Sequence[int], *, p: float, seed: int, step: int,
            feature: bool = False) -> Tensor:
    """`x`, the `region` of a tensor of `shape`, with dropout `p` > 0 applied as `dropout_keep` draws it
    (the kept elements scaled by 1 / (1 - p)); `feature`: one draw per (sample, channel), over the first two
    axes, kept or dropped whole (``feature_dropout``)."""
    if p >= 1.0:
        return x * 0.0
    if feature:
        keep = dropout_keep(region[:2], shape[:2], p=p, seed=seed, step=step, device=x.device)
        keep = keep.view(*keep.shape, *[1] * (x.dim() - 2))
    else:
        keep = dropout_keep(region, shape, p=p, seed=seed, step=step, device=x.device)
    return x * keep.to(x.dtype) / (1.0 - p)


def _dropout(op, box, inputs, params, ctx):
    x, p = inputs[0], float(op.attrs.get("p", 0.5))
    if not ctx.training or p == 0.0:
        return (x,)
    return (dropped(x, tuple(box), op.outputs[0].shape, p=p, seed=int(op.attrs.get("seed") or 0), step=ctx.step,
                    feature=bool(op.attrs.get("feature"))),)


def _random(op, box, inputs, params, ctx):
    spec = op.outputs[0]
    draw = normal_draws if op.attrs.get("normal") else uniform_draws
    return (draw(tuple(box), spec.shape, seed=int(op.attrs.get("seed") or 0), step=ctx.step,
                 dtype=ctx.dtype or getattr(torch, spec.dtype)),)


def _flip(op, box, inputs, params, ctx):
    return (inputs[0].flip([int(a) for a in op.attrs["axes"]]),)


def _roll(op, box, inputs, params, ctx):
    # along an axis whose rows wrap around its end the part reads the axis whole (`Roll.input_regions`): roll
    # it and keep the box's rows; elsewhere the rows read are the box's, in order
    x, shape = inputs[0], op.outputs[0].shape
    for a, shift in op_def(op.kind).shifts(op).items():
        lo, hi = box[a]
        if (lo - shift) % shape[a] + hi - lo > shape[a]:
            x = x.roll(shift, a).narrow(a, lo, hi - lo)
    return (x,)


def _pad(op, box, inputs, params, ctx):
    # the input rows this part holds (taken out of the region read, which may hold an unused row), then
    # the padding around them
    entry = op_def(op.kind)
    (region,) = entry.input_regions(op, box)
    before = entry.before(op)
    take, pads = [], []
    for axis, ((lo, hi), (start, _)) in enumerate(zip(box, region, strict=True)):
        a, b = entry.source_range(op, axis, lo, hi)
        take.append(slice(a - start, b - start))
        left = a + before[axis] - lo if b > a else hi - lo
        pads.append((left, hi - lo - left - (b - a)))
    value = op.attrs.get("value")
    flat = [n for pair in reversed(pads) for n in pair]
    return (F.pad(inputs[0][tuple(take)], flat, value=0.0 if value is None else float(value)),)


def _prelu(op, box, inputs, params, ctx):
    return (F.prelu(inputs[0], params["weight"]),)


def _loss(op, box, inputs, params, ctx):
    logits, target, *weights = inputs
    a = op.attrs
    mean = a.get("reduction", "mean") == "mean"
    if a["fn"] == "cross_entropy":
        ignore = int(a.get("ignore_index", -100))
        weight = weights[0].detach().to(logits.dtype) if weights else None  # (torch takes no gradient for it)
        total = F.cross_entropy(logits, target, weight=weight, reduction="sum", ignore_index=ignore,
                                label_smoothing=float(a.get("label_smoothing") or 0.0))
        if mean:
            # every part divides by the count over the whole target, so the parts' values sum to the mean (a
            # Python number: a tensor divisor would be saved for the backward as well)
            count = ctx.counted if ctx.counted is not None else target_count(target, ignore, weight)
            total = total / count if count else total * math.nan  # nothing counted: nan, as in PyTorch
        return (total,)
    if a["fn"] != "mse":
        raise ValueError(f"op {op.name!r}: unknown loss fn {a['fn']!r}")
    total = F.mse_loss(logits, target, reduction="sum")
    if mean:
        # every part divides by the full count, so the parts' values sum to the global mean
        total = total / math.prod(input_shape(op, 0))
    return (total,)


def counted_targets(graph: OperatorGraph, op: Operator, whole: Mapping[str, Tensor], *,
                    step: int = 0) -> int | float:
    """How many entries of the whole target of the cross-entropy `loss` op `op` are not its `ignore_index` (with class
    weights, the sum of their weights): what its mean divides by (`soap.registry.counts_targets`). `whole`: the
    whole output of each `input` and `constant` op by name (every rank holds the global batch). The ops between them
    and the target (reshapes, the slice that shifts a language model's labels, ...) are computed whole here, on
    integer ids; a target computed by an op with parameters, or an opaque one, is a `ValueError`."""
    values: dict[str, tuple[Tensor, ...]] = {}

    def value(ref: TensorRef) -> Tensor:
        if ref.op in whole:
            return whole[ref.op]
        if ref.op not in values:
            producer = graph[ref.op]
            if producer.kind == "opaque" or producer.params or op_def(producer.kind).buffer_regions(
                    producer, full_box(dims_of(producer))):
                raise ValueError(f"the target of loss {op.name!r} is computed by {producer.name!r} (kind "
                                 f"{producer.kind}), which the count of its ignored entries cannot run whole")
            box = full_box(dims_of(producer))
            regions = op_def(producer.kind).input_regions(producer, box)
            inputs = [None if region is None else value(r)[tuple(slice(lo, hi) for lo, hi in region)]
                      for r, region in zip(producer.inputs, regions, strict=True)]
            values[ref.op] = compute_part(producer, box, inputs, {}, step=step)
        return values[ref.op][ref.index]

    weight = value(op.inputs[2]) if len(op.inputs) > 2 else None
    return target_count(value(op.inputs[1]), int(op.attrs.get("ignore_index", -100)), weight)


def target_count(target: Tensor, ignore: int, weight: Tensor | None = None) -> int | float:
    """What a cross-entropy mean over `target` divides by: its entries that are not `ignore`, or with class
    weights the sum of their classes' weights."""
    counted = target[target != ignore]
    return int(counted.numel()) if weight is None else float(weight.double()[counted].sum())


# The part kernel of each kind, by the name its `OpDef.kernel` gives (tests/test_op_kinds.py checks that the
# names match the registry both ways).
KERNELS: dict[str, Kernel] = {
    "conv2d": _conv2d, "conv1d": _conv1d, "conv_transpose2d": _conv_transpose2d, "linear": _linear,
    "matmul": _matmul, "batchnorm": _batchnorm,
    "layernorm": _layernorm, "groupnorm": _groupnorm, "rmsnorm": _rmsnorm, "embedding": _embedding,
    "lstm": _lstm, "gru": _gru,
    "rnn": _rnn, "attention": _attention, "pool2d": _pool2d, "upsample": _upsample,
    "adaptive_pool2d": _adaptive_pool2d,
    "elementwise": _elementwise, "binary": _binary, "reduce": _reduce, "concat": _concat, "stack": _stack,
    "split": _split, "slice": _slice, "reshape": _reshape, "expand": _expand, "repeat": _repeat,
    "transpose": _transpose, "softmax": _softmax, "dropout": _dropout, "loss": _loss, "flip": _flip,
    "pad": _pad, "prelu": _prelu, "random": _random, "roll": _roll, "topk": _topk, "experts": _experts,
}
