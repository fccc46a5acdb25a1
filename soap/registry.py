"""The op registry: one `OpDef` entry per op kind (see `soap/opdef.py` for what an entry answers).

Owns every kind in `docs/op_kinds.md`, each defined once: its iteration dims, how a part's box maps to the
regions of its outputs, inputs, parameters and buffers, its FLOPs formula, the aten ops capture maps to
it and the name of its runtime kernel (what each of these means: `OpDef` in soap/opdef.py). Shapes of
inputs come from the ``input_shapes`` attr that capture records on every op (an `Operator` holds only
its output specs).

FLOPs formulas (forward; `OpDef.backward_flops` is twice that for ops with parameters, once for the others):
LSTM ``8 N T H (I + H)`` per layer (4 gates, an input and a hidden matmul per step, 2 FLOPs per
multiply-add), GRU ``6 N T H (I + H) + 10 N T H`` per layer (3 gates, and the elementwise of its equations),
RNN ``2 N T H (I + H)`` per layer, attention ``2 N heads Tq Tk (head_dim + value_dim)`` (the two matmuls;
backward twice that); elementwise, binary and dropout 1 per output element, batch norm, layer norm and
softmax 5, RMS norm 4, cross entropy 5 and mse 3 per logit, reduce and adaptive pooling 1 per input element,
pooling one per window element, data movement (concat, stack, expand, repeat, ...) 0. Convolution, linear,
matmul, attention and opaque ops are `flops_counted`: capture counts them with torch.

Pure Python: must not import torch, the simulator, the search or the runtime.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

from soap.graph import DTYPE_BYTES, Operator
from soap.opdef import (
    Box,
    DimKind,
    DimSpec,
    OpDef,
    Range,
    Region,
    clip_range,
    full_box,
    full_region,
    input_shape,
    pair,
    part_boxes,
    region_numel,
    window_range,
)

REGISTRY: dict[str, OpDef] = {}


def register(entry: OpDef) -> OpDef:
    assert entry.kind and entry.kind not in REGISTRY, entry.kind
    REGISTRY[entry.kind] = entry
    return entry


def op_def(kind: str) -> OpDef:
    try:
        return REGISTRY[kind]
    except KeyError:
        raise ValueError(f"unknown op kind {kind!r}; known: {', '.join(sorted(REGISTRY))}") from None


def dims_of(op: Operator) -> tuple[DimSpec, ...]:
    return op_def(op.kind).dims(op)


# ---------------------------------------------------------------- shared helpers


def axis_name(axis: int) -> str:
    """The dim name of an output axis that has no better name: `sample` for axis 0, else `d{axis}`."""
    return "sample" if axis == 0 else f"d{axis}"


def axis_dims(shape: Sequence[int], *, fixed: Sequence[int] = (), first: int = 0) -> list[DimSpec]:
    """One dim per axis of `shape` (output axis = position), named by `axis_name(first + position)`.

    Axes in `fixed` (positions) are not splittable. Axis 0 is of kind sample, the others attribute.
    """
    out = []
    for a, size in enumerate(shape):
        name = axis_name(first + a)
        kind = DimKind.SAMPLE if first + a == 0 else DimKind.ATTRIBUTE
        out.append(DimSpec(name=name, kind=kind, size=size, out_axis=a, splittable=a not in fixed))
    return out


def _norm_axis(axis: int, ndim: int) -> int:
    return axis + ndim if axis < 0 else axis


def output_numel(op: Operator) -> int:
    """Elements of all outputs of `op`, the unit of the per-element FLOPs formulas."""
    return sum(t.numel for t in op.outputs)


def first_input_numel(op: Operator) -> int:
    """Elements of tensor input 0 of `op` (0 without tensor inputs)."""
    return math.prod(input_shape(op, 0)) if op.inputs else 0


def broadcast_region(in_shape: Sequence[int], out_region: Region) -> Region:
    """The region of a broadcasting operand of shape `in_shape` read for `out_region` of the result.

    The operand's axes align with the result's trailing axes; an axis of size 1 is read whole.
    """
    lead = len(out_region) - len(in_shape)
    return tuple((0, 1) if size == 1 else out_region[lead + a] for a, size in enumerate(in_shape))


class _AxisOp(OpDef):
    """Ops whose iteration dims are exactly the axes of output 0 (`sample`, `d1`, ...), all splittable
    unless `fixed_axes` says otherwise, and whose one input has the output's shape."""

    def fixed_axes(self, op: Operator) -> tuple[int, ...]:
        return ()

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        shape = op.outputs[0].shape
        fixed = [_norm_axis(a, len(shape)) for a in self.fixed_axes(op)]
        return tuple(axis_dims(shape, fixed=fixed))

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        return (tuple(box),)


# ---------------------------------------------------------------- sources


class Input(OpDef):
    """A tensor of the example batch. attrs: `position`, `role` (`input` or `target`).

    dims: `sample` (axis 0), `d1`.. (attribute), all splittable. Reads nothing. Every process's data
    loader reads the region of the batch that its consumer parts need, so the batch exists on every device
    for free (`everywhere`): feeding an op never moves data between devices, whatever the op's split.
    """

    kind = "input"
    captured_specially = "one op per tensor of the example batch, the loss target last"
    run_specially = "fed: every rank holds the global batch and reads the region each part needs"
    everywhere = True

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        return tuple(axis_dims(op.outputs[0].shape))

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        return ()

    def flops(self, op: Operator) -> float:
        return 0.0  # a source: computes nothing


class Constant(OpDef):
    """A buffer of the model (attr `fqn`), or a value computed from buffers, literals and factories alone
    (attr `recipe`: the calls that compute it, soap/capture/builder.py); every process holds or computes
    it, so it exists on every device for free.

    dims: `d0`, `d1`.. (attribute), none splittable.
    """

    kind = "constant"
    captured_specially = ("one op per buffer an op reads, just before its first use (a batch norm's "
                          "running statistics go to its attrs instead), and one per value folded from "
                          "shape-only computations (aranges, masks, position ids) that an op reads")
    run_specially = "fed: every rank holds the model's buffers whole"
    everywhere = True

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        return tuple(DimSpec(name=f"d{a}", kind=DimKind.ATTRIBUTE, size=s, out_axis=a, splittable=False)
                     for a, s in enumerate(op.outputs[0].shape))

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        return ()

    def flops(self, op: Operator) -> float:
        return 0.0  # a source: computes nothing


# ---------------------------------------------------------------- layers with weights


class Conv2d(OpDef):
    """y[N, Co, Ho, Wo] = conv2d(x[N, Ci, H, W], weight[Co, Ci/groups, kh, kw]) + bias[Co].

    attrs: `stride`, `padding`, `dilation` ([h, w] each), `groups`.
    dims: `sample`; `out_channels` (parameter: shards weight rows and bias; with groups > 1 only in
    chunks that hold whole groups or lie inside one); `height`, `width` (attribute: the input region is
    the window range clipped to the tensor, so neighbours' rows are read as a halo); `in_channels`
    (reduction, splittable only when groups == 1: parts hold partial sums, the first chunk adds the bias).
    """

    kind = "conv2d"
    captured_from = ("conv2d",)
    kernel = "conv2d"
    flops_counted = True

    # the output's spatial axes, in order (a subclass with fewer spatial axes names its own)
    spatial: tuple[str, ...] = ("height", "width")

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        n, co, *sizes = op.outputs[0].shape
        groups = int(op.attrs.get("groups", 1))
        ci = op.params["weight"].shape[1] * groups
        return (
            DimSpec(name="sample", kind=DimKind.SAMPLE, size=n, out_axis=0),
            DimSpec(name="out_channels", kind=DimKind.PARAMETER, size=co, out_axis=1),
            *(DimSpec(name=name, kind=DimKind.ATTRIBUTE, size=size, out_axis=2 + i)
              for i, (name, size) in enumerate(zip(self.spatial, sizes, strict=True))),
            DimSpec(name="in_channels", kind=DimKind.REDUCTION, size=ci, out_axis=None,
                    splittable=groups == 1),
        )

    def check(self, op: Operator, degrees: Mapping[str, int]) -> str | None:
        reason = super().check(op, degrees)
        groups = int(op.attrs.get("groups", 1))
        degree = degrees.get("out_channels", 1)
        if reason is None and groups > 1 and degree > 1:
            per_group = op.outputs[0].shape[1] // groups
            chunk = op.outputs[0].shape[1] // degree
            if chunk % per_group and per_group % chunk:
                reason = (f"{op.kind} with groups={groups} cannot split 'out_channels' {degree} ways: "
                          f"chunks of {chunk} channels straddle groups of {per_group}")
        return reason

    def needed_window(self, op: Operator, box: Box) -> tuple[Range, Range]:
        """The unclipped input rows and columns of the part; the kernel pads the clipped remainder."""
        (kh, kw), a = op.params["weight"].shape[2:], op.attrs
        sh, sw = pair(a.get("stride", 1))
        ph, pw = pair(a.get("padding", 0))
        dh, dw = pair(a.get("dilation", 1))
        return (window_range(box[2], kernel=kh, stride=sh, padding=ph, dilation=dh),
                window_range(box[3], kernel=kw, stride=sw, padding=pw, dilation=dw))

    def _reduction(self, box: Box) -> Range:
        """The part's range of the `in_channels` dim."""
        return box[2 + len(self.spatial)]

    def _in_channels(self, op: Operator, box: Box) -> Range:
        groups = int(op.attrs.get("groups", 1))
        if groups == 1:
            return self._reduction(box)
        per_out = op.outputs[0].shape[1] // groups
        per_in = op.params["weight"].shape[1]
        lo, hi = box[1]
        return ((lo // per_out) * per_in, ((hi - 1) // per_out + 1) * per_in)

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        h, w = input_shape(op, 0)[2:]
        rows, cols = self.needed_window(op, box)
        return ((box[0], self._in_channels(op, box), clip_range(rows, h), clip_range(cols, w)),)

    def param_regions(self, op: Operator, box: Box) -> dict[str, Region]:
        cin_lo, cin_hi = box[4] if int(op.attrs.get("groups", 1)) == 1 else (0, op.params["weight"].shape[1])
        kh, kw = op.params["weight"].shape[2:]
        regions = {"weight": (box[1], (cin_lo, cin_hi), (0, kh), (0, kw))}
        if "bias" in op.params and box[4][0] == 0:
            regions["bias"] = (box[1],)
        return regions

    def flops(self, op: Operator) -> float | None:
        return None  # no formula: the counter's figures stand


def _transposed_rows(out: Range, *, kernel: int, stride: int, padding: int, dilation: int, size: int) -> Range:
    """The input rows of a transposed convolution whose windows reach output rows `out` (input row i adds
    to output rows i*stride - padding + j*dilation, j < kernel), clipped to [0, size)."""
    lo = -(-(out[0] + padding - (kernel - 1) * dilation) // stride)
    hi = (out[1] - 1 + padding) // stride + 1
    return clip_range((lo, hi), size) if out[1] > out[0] else (0, 0)


class ConvTranspose2d(OpDef):
    """y[N, Co, Ho, Wo] = conv_transpose2d(x[N, Ci, H, W], weight[Ci, Co/groups, kh, kw]) + bias[Co].

    attrs: `stride`, `padding`, `output_padding`, `dilation` ([h, w] each), `groups`.
    dims: `sample`; `out_channels` (parameter: shards weight columns and bias; only with groups 1);
    `height`, `width` (attribute: a part reads the input rows whose windows reach its rows, computes their
    output and keeps its own rows); `in_channels` (reduction, only with groups 1: parts hold partial sums,
    the first chunk adds the bias).
    """

    kind = "conv_transpose2d"
    captured_from = ("conv_transpose2d",)
    kernel = "conv_transpose2d"
    flops_counted = True

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        n, co, ho, wo = op.outputs[0].shape
        whole = int(op.attrs.get("groups", 1)) == 1
        return (DimSpec(name="sample", kind=DimKind.SAMPLE, size=n, out_axis=0),
                DimSpec(name="out_channels", kind=DimKind.PARAMETER, size=co, out_axis=1, splittable=whole),
                DimSpec(name="height", kind=DimKind.ATTRIBUTE, size=ho, out_axis=2),
                DimSpec(name="width", kind=DimKind.ATTRIBUTE, size=wo, out_axis=3),
                DimSpec(name="in_channels", kind=DimKind.REDUCTION, size=op.params["weight"].shape[0],
                        out_axis=None, splittable=whole))

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        a, (h, w) = op.attrs, input_shape(op, 0)[2:]
        (kh, kw), (sh, sw) = op.params["weight"].shape[2:], pair(a.get("stride", 1))
        (ph, pw), (dh, dw) = pair(a.get("padding", 0)), pair(a.get("dilation", 1))
        return ((box[0], box[4], _transposed_rows(box[2], kernel=kh, stride=sh, padding=ph, dilation=dh, size=h),
                 _transposed_rows(box[3], kernel=kw, stride=sw, padding=pw, dilation=dw, size=w)),)

    def param_regions(self, op: Operator, box: Box) -> dict[str, Region]:
        per_group, kh, kw = op.params["weight"].shape[1:]
        columns = box[1] if int(op.attrs.get("groups", 1)) == 1 else (0, per_group)
        regions = {"weight": (box[4], columns, (0, kh), (0, kw))}
        if "bias" in op.params and box[4][0] == 0:
            regions["bias"] = (box[1],)
        return regions

    def flops(self, op: Operator) -> float | None:
        return None  # no formula: the counter's figures stand


class Conv1d(Conv2d):
    """y[N, Co, Lo] = conv1d(x[N, Ci, L], weight[Co, Ci/groups, k]) + bias[Co].

    attrs: `stride`, `padding`, `dilation` (one int each), `groups`.
    dims: `sample`; `out_channels` (parameter, as conv2d's); `length` (attribute: the input region is the
    window range clipped to the tensor, neighbours' positions read as a halo); `in_channels` (reduction,
    as conv2d's).
    """

    kind = "conv1d"
    captured_from = ("conv1d",)
    kernel = "conv1d"
    spatial = ("length",)

    def needed_window(self, op: Operator, box: Box) -> tuple[Range]:
        """The unclipped input positions of the part; the kernel pads the clipped remainder."""
        a = op.attrs
        return (window_range(box[2], kernel=op.params["weight"].shape[2], stride=int(a.get("stride", 1)),
                             padding=int(a.get("padding", 0)), dilation=int(a.get("dilation", 1))),)

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        (window,) = self.needed_window(op, box)
        return ((box[0], self._in_channels(op, box), clip_range(window, input_shape(op, 0)[2])),)

    def param_regions(self, op: Operator, box: Box) -> dict[str, Region]:
        cin = box[3] if int(op.attrs.get("groups", 1)) == 1 else (0, op.params["weight"].shape[1])
        regions = {"weight": (box[1], cin, (0, op.params["weight"].shape[2]))}
        if "bias" in op.params and box[3][0] == 0:
            regions["bias"] = (box[1],)
        return regions


class Linear(OpDef):
    """y[N.., out] = x[N.., in] @ W[out, in]^T + b[out]; with attr `transposed` W is stored [in, out]
    (y = b + x @ W: ``addmm`` of Hugging Face's ``Conv1D``, GPT-2).

    dims: `sample` (axis 0), `d1`.. (middle axes, attribute), `out_features` (parameter: shards W's out
    axis and b), `in_features` (reduction: shards x columns and W's in axis; parts hold partial sums, and
    only the part with the first `in_features` chunk adds the bias).
    """

    kind = "linear"
    captured_from = ("linear", "addmm", "matmul", "mm")  # matmul, mm: x @ w.T of a parameter w
    kernel = "linear"
    flops_counted = True

    def in_features(self, op: Operator) -> int:
        return op.params["weight"].shape[0 if op.attrs.get("transposed", False) else 1]

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        shape = op.outputs[0].shape
        out = [DimSpec(name="sample", kind=DimKind.SAMPLE, size=shape[0], out_axis=0)]
        out += [DimSpec(name=f"d{a}", kind=DimKind.ATTRIBUTE, size=shape[a], out_axis=a)
                for a in range(1, len(shape) - 1)]
        out.append(DimSpec(name="out_features", kind=DimKind.PARAMETER, size=shape[-1],
                           out_axis=len(shape) - 1))
        out.append(DimSpec(name="in_features", kind=DimKind.REDUCTION, size=self.in_features(op),
                           out_axis=None))
        return tuple(out)

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        return (tuple(box[:-2]) + (box[-1],),)

    def param_regions(self, op: Operator, box: Box) -> dict[str, Region]:
        out_rng, in_rng = box[-2], box[-1]
        regions = {"weight": (in_rng, out_rng) if op.attrs.get("transposed", False) else (out_rng, in_rng)}
        if "bias" in op.params and in_rng[0] == 0:
            regions["bias"] = (out_rng,)
        return regions

    def flops(self, op: Operator) -> float | None:
        return None  # no formula: the counter's figures stand


class Matmul(OpDef):
    """y[.., M, N] = `alpha` (a[.., M, K] @ b[.., K, N]) + `beta` c (torch.matmul, bmm, einsum products,
    baddbmm, addmm of activations; leading axes broadcast, b may be 2-D).

    attrs (each only where it applies): `transpose_a` (a is stored [.., K, M]), `transpose_b` (b is
    stored [.., N, K]), `alpha` (default 1), `beta` with a third input c broadcasting to y.
    dims: leading axes `sample`, `d1`..; `m`, `n` (attribute); `k` (reduction: parts hold partial sums,
    and only the parts with the first `k` chunk read and add c). Without leading axes `m` is of kind
    sample (the rows of a 2-D product are its batch).
    """

    kind = "matmul"
    captured_from = ("matmul", "bmm", "mm", "baddbmm", "einsum", "addmm")
    kernel = "matmul"
    flops_counted = True

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        shape = op.outputs[0].shape
        nd = len(shape)
        out = axis_dims(shape[:-2])
        out.append(DimSpec(name="m", kind=DimKind.SAMPLE if nd == 2 else DimKind.ATTRIBUTE,
                           size=shape[-2], out_axis=nd - 2))
        out.append(DimSpec(name="n", kind=DimKind.ATTRIBUTE, size=shape[-1], out_axis=nd - 1))
        k = input_shape(op, 0)[-2 if op.attrs.get("transpose_a", False) else -1]
        out.append(DimSpec(name="k", kind=DimKind.REDUCTION, size=k, out_axis=None))
        return tuple(out)

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        lead, m, n, k = tuple(box[:-3]), box[-3], box[-2], box[-1]
        a_shape, b_shape = input_shape(op, 0), input_shape(op, 1)
        a = (k, m) if op.attrs.get("transpose_a", False) else (m, k)
        b = (n, k) if op.attrs.get("transpose_b", False) else (k, n)
        regions: tuple[Region | None, ...] = (broadcast_region(a_shape[:-2], lead) + a,
                                              broadcast_region(b_shape[:-2], lead) + b)
        if len(op.inputs) > 2:
            regions += (broadcast_region(input_shape(op, 2), lead + (m, n)) if k[0] == 0 else None,)
        return regions

    def flops(self, op: Operator) -> float | None:
        return None  # no formula: the counter's figures stand


class BatchNorm(OpDef):
    """y = batch_norm(x[N, C, ..]) with affine `weight`, `bias` [C] (either may be absent).

    attrs: `eps`, `momentum`, `running_mean`, `running_var` (buffer fqns or None).
    dims: `sample` (parts normalize with their local statistics, like DDP); `channels` (parameter:
    shards weight, bias and the running statistics); the spatial axes `d2`.. are not splittable.
    """

    kind = "batchnorm"
    captured_from = ("batch_norm",)
    kernel = "batchnorm"

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        shape = op.outputs[0].shape
        out = [DimSpec(name="sample", kind=DimKind.SAMPLE, size=shape[0], out_axis=0),
               DimSpec(name="channels", kind=DimKind.PARAMETER, size=shape[1], out_axis=1)]
        out += [DimSpec(name=f"d{a}", kind=DimKind.ATTRIBUTE, size=shape[a], out_axis=a, splittable=False)
                for a in range(2, len(shape))]
        return tuple(out)

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        return (tuple(box),)

    def param_regions(self, op: Operator, box: Box) -> dict[str, Region]:
        return {name: (box[1],) for name in op.params}

    def buffer_regions(self, op: Operator, box: Box) -> dict[str, Region]:
        return {name: (box[1],) for name in ("running_mean", "running_var") if op.attrs.get(name)}

    def flops(self, op: Operator) -> float:
        return 5.0 * output_numel(op)


class LayerNorm(_AxisOp):
    """y = layer_norm(x, `normalized_shape`, weight, bias, `eps`); weight and bias optional.

    dims: leading axes `sample`, `d1`.. splittable; the normalized (trailing) axes not splittable.
    """

    kind = "layernorm"
    captured_from = ("layer_norm",)
    kernel = "layernorm"

    def fixed_axes(self, op: Operator) -> tuple[int, ...]:
        nd = len(op.outputs[0].shape)
        return tuple(range(nd - len(op.attrs["normalized_shape"]), nd))

    def flops(self, op: Operator) -> float:
        return 5.0 * output_numel(op)


class GroupNorm(OpDef):
    """y = group_norm(x[N, C, ..], `num_groups`, weight, bias, `eps`): each sample's channels in
    `num_groups` consecutive groups, each normalized over its channels and the spatial axes; affine
    `weight`, `bias` [C] optional (read whole). Also an instance norm without running statistics
    (`num_groups` = C).

    dims: `sample` splittable; `channels` and the spatial axes `d2`.. not splittable (a group's
    statistics span them).
    """

    kind = "groupnorm"
    captured_from = ("group_norm", "instance_norm")
    kernel = "groupnorm"

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        shape = op.outputs[0].shape
        out = [DimSpec(name="sample", kind=DimKind.SAMPLE, size=shape[0], out_axis=0),
               DimSpec(name="channels", kind=DimKind.ATTRIBUTE, size=shape[1], out_axis=1, splittable=False)]
        out += [DimSpec(name=f"d{a}", kind=DimKind.ATTRIBUTE, size=shape[a], out_axis=a, splittable=False)
                for a in range(2, len(shape))]
        return tuple(out)

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        return (tuple(box),)

    def flops(self, op: Operator) -> float:
        return 5.0 * output_numel(op)


class RMSNorm(_AxisOp):
    """y = x / sqrt(mean(x^2 over the normalized axes) + `eps`) * (`offset` + weight) (F.rms_norm, and the
    hand-written Llama and Gemma patterns capture fuses); attrs `normalized_shape`, `eps` (None: the dtype's
    machine epsilon, as torch), `offset` (0 when absent; Gemma's 1); weight optional.

    dims: leading axes `sample`, `d1`.. splittable; the normalized (trailing) axes not splittable.
    """

    kind = "rmsnorm"
    # mul: the last op of the hand-written pattern, which capture fuses (soap/capture/builder.py)
    captured_from = ("rms_norm", "mul")
    kernel = "rmsnorm"

    def fixed_axes(self, op: Operator) -> tuple[int, ...]:
        nd = len(op.outputs[0].shape)
        return tuple(range(nd - len(op.attrs["normalized_shape"]), nd))

    def flops(self, op: Operator) -> float:
        return 4.0 * output_numel(op)  # square, sum, scale by the root, weight


class Embedding(OpDef):
    """y[N.., D] = weight[V, D][idx[N..]]. attrs: `padding_idx` (None or a row). Also a parameter indexed
    by a tensor of ids along its first axis (``table[index]``: Swin's relative position bias).

    dims: `sample`, `d1`.. (the index axes); `embedding_dim` (parameter: shards weight columns);
    `vocab` (reduction: a part holds weight rows [lo, hi) and gives 0 for ids outside them).
    """

    kind = "embedding"
    captured_from = ("embedding", "index")  # (index: a parameter table read by ids)
    kernel = "embedding"

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        shape = op.outputs[0].shape
        out = axis_dims(shape[:-1])
        out.append(DimSpec(name="embedding_dim", kind=DimKind.PARAMETER, size=shape[-1],
                           out_axis=len(shape) - 1))
        out.append(DimSpec(name="vocab", kind=DimKind.REDUCTION, size=op.params["weight"].shape[0],
                           out_axis=None))
        return tuple(out)

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        return (tuple(box[:-2]),)

    def param_regions(self, op: Operator, box: Box) -> dict[str, Region]:
        return {"weight": (box[-1], box[-2])}

    def flops(self, op: Operator) -> float:
        return 0.0  # a gather: data movement


class Experts(OpDef):
    """A mixture of experts' feed-forward: y[T, H] = sum over slots j of weights[t, j] times expert
    index[t, j] of x[t], from tokens x[T, H], the experts each token is routed to, index[T, k] (int64), and
    their weights[T, k]. Expert e: act(x @ w_gate[e]^T + b_gate[e]) * (x @ w_up[e]^T + b_up[e]) with a
    gate, else act(x @ w_up[e]^T + b_up[e]); then @ w_out[e]^T + b_out[e]. params `w_gate` (optional),
    `w_up` [E, I, H], `w_out` [E, H, I] (stored [E, H, I] and [E, I, H] with `transposed`), optionally
    `b_gate`, `b_up` [E, I], `b_out` [E, H]; attrs `act`, `transposed`. Capture makes it from Hugging
    Face's experts modules (soap/capture/experts.py), the gate and up weights two blocks of their stacked
    ``gate_up_proj``.

    dims: `sample` (the tokens, axis 0); `experts` (reduction: a part holds experts [lo, hi), runs the
    tokens routed to them and adds 0 for the others: expert parallelism); `inner` (reduction: a part holds
    inner units [lo, hi) of every held expert, the rows of `w_gate` and `w_up` and the columns of `w_out`,
    as Megatron-LM splits an MLP: expert tensor parallelism; only the first adds `b_out`). Parts of either
    hold partial sums. Which tokens an expert gets is known only at run time: FLOPs and saved activations
    assume the routing spreads the T k (token, slot) pairs evenly over the experts.
    """

    kind = "experts"
    captured_from = ("experts",)  # soapflow::experts, the call of soap/capture/experts.py
    kernel = "experts"

    def widths(self, op: Operator) -> tuple[int, int, int]:
        """(E, I, H): experts, their inner width, the tokens' width."""
        e, a, b = op.params["w_up"].shape
        return (e, b, a) if op.attrs.get("transposed", False) else (e, a, b)

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        e, inner, _ = self.widths(op)
        return (DimSpec(name="sample", kind=DimKind.SAMPLE, size=op.outputs[0].shape[0], out_axis=0),
                DimSpec(name="experts", kind=DimKind.REDUCTION, size=e, out_axis=None),
                DimSpec(name="inner", kind=DimKind.REDUCTION, size=inner, out_axis=None))

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        return tuple((box[0], (0, input_shape(op, i)[1])) for i in range(3))

    def param_regions(self, op: Operator, box: Box) -> dict[str, Region]:
        _, experts, inner = box
        h = self.widths(op)[2]
        rows, cols = ((0, h), inner) if op.attrs.get("transposed", False) else (inner, (0, h))
        regions = {name: (experts, rows, cols) for name in ("w_gate", "w_up") if name in op.params}
        regions["w_out"] = (experts, cols, rows)
        regions |= {name: (experts, inner) for name in ("b_gate", "b_up") if name in op.params}
        if "b_out" in op.params and inner[0] == 0:
            regions["b_out"] = (experts, (0, h))
        return regions

    def products(self, op: Operator) -> int:
        """The products each expert runs: gate, up and down (3), or up and down without a gate (2)."""
        return 3 if "w_gate" in op.params else 2

    def routed_pairs(self, op: Operator, box: Box) -> float:
        """The (token, slot) pairs part `box` runs on average: its tokens' pairs, its share of the experts."""
        (t0, t1), (e0, e1), _ = box
        return (t1 - t0) * input_shape(op, 1)[1] * (e1 - e0) / self.widths(op)[0]

    def flops(self, op: Operator) -> float:
        _, inner, h = self.widths(op)
        projections = self.products(op)
        pairs = self.routed_pairs(op, full_box(self.dims(op)))
        # the products, the activation (and the gate's product), the weighting, the sum over slots
        return pairs * (2.0 * projections * inner * h + (projections - 1) * inner + 2.0 * h)

    def saved_bytes(self, op: Operator, box: Box) -> int:
        # per routed pair: the gathered token, the projections' outputs, the activation, the output row
        i0, i1 = box[2]
        h = self.widths(op)[2]
        per_pair = 2 * h + self.products(op) * (i1 - i0)
        return int(self.routed_pairs(op, box) * per_pair) * DTYPE_BYTES[op.outputs[0].dtype]


class _Recurrent(OpDef):
    """The shared shape of the recurrent kinds (`lstm`, `gru`, `rnn`): out[N, T, H] and the final states
    [L, N, H] = cell(x[N, T, I]) run over time, batch first, from a zero initial state, with torch's
    parameters `weight_ih_l{k}`, `weight_hh_l{k}`, `bias_ih_l{k}`, `bias_hh_l{k}` and attrs `hidden_size`,
    `num_layers`.

    dims: `sample` (splittable; axis 0 of out, axis 1 of each final state); `seq` carried
    (`DimSpec.carried`: split into time chunks, chunk k starting from the final state of every layer of
    chunk k-1, moved to it from another device); `hidden` not splittable (every gate reads all of hidden). A
    chunk reads x[:, t0:t1] and writes out[:, t0:t1]; only the last chunk holds the final states (the
    others hold empty regions of them), so their consumers read them from the last chunks. The carried
    state is `num_states` tensors [L, N, H] of the part's samples.
    """

    # gate blocks per layer (rows of weight_ih_l{k} are gates * H) and state tensors per layer
    gates: int = 0
    num_states: int = 0
    # values the equations keep for backward per layer, step, sample and hidden unit, the layer's own
    # output included (the last layer's is the op's output, kept anyway): each kind says which
    saved_per_layer: int = 0

    def saved_bytes(self, op: Operator, box: Box) -> int:
        (n0, n1), (t0, t1) = box[0], box[1]
        layers, hidden = int(op.attrs["num_layers"]), int(op.attrs["hidden_size"])
        values = self.saved_per_layer * layers - 1
        return values * (n1 - n0) * (t1 - t0) * hidden * DTYPE_BYTES[op.outputs[0].dtype]

    def carry_shapes(self, op: Operator, box: Box) -> tuple[tuple[int, ...], ...]:
        (n0, n1) = box[0]
        layers, hidden = int(op.attrs["num_layers"]), int(op.attrs["hidden_size"])
        return ((layers, n1 - n0, hidden),) * self.num_states

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        n, t, h = op.outputs[0].shape
        return (DimSpec(name="sample", kind=DimKind.SAMPLE, size=n, out_axis=0),
                DimSpec(name="seq", kind=DimKind.ATTRIBUTE, size=t, out_axis=1, splittable=False, carried=True),
                DimSpec(name="hidden", kind=DimKind.PARAMETER, size=h, out_axis=2, splittable=False))

    def output_region(self, op: Operator, box: Box, index: int = 0) -> Region:
        if index == 0:
            return tuple(box)
        layers = op.outputs[index].shape[0]
        if box[1][1] != op.outputs[0].shape[1]:
            return ((0, 0), box[0], box[2])  # not the last chunk: no final state
        return ((0, layers), box[0], box[2])

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        return ((box[0], box[1], (0, op.params["weight_ih_l0"].shape[1])),)

    def matmul_flops(self, op: Operator) -> float:
        """2 gates N T H (I + H) over the layers: per step an input and a hidden matmul for each gate
        block, 2 FLOPs per multiply-add; layers after the first read the hidden state of the one below
        (I = H)."""
        n, t, features = input_shape(op, 0)
        hidden, layers = op.attrs["hidden_size"], op.attrs["num_layers"]
        return float(sum(2 * self.gates * n * t * hidden * ((features if k == 0 else hidden) + hidden)
                         for k in range(layers)))


class LSTM(_Recurrent):
    """out[N, T, H], h_n[L, N, H], c_n[L, N, H] = LSTM(x[N, T, I]) (batch first, zero initial state).

    params: `weight_ih_l{k}`, `weight_hh_l{k}`, `bias_ih_l{k}`, `bias_hh_l{k}`; attrs: `hidden_size`,
    `num_layers`. dims: `sample` (splittable; axis 0 of out, axis 1 of h_n and c_n); `seq` carried
    (`DimSpec.carried`: split into time chunks, chunk k starting from the final (h, c) of every layer of
    chunk k-1, moved to it from another device); `hidden` not splittable (every gate reads all of hidden). A chunk
    reads x[:, t0:t1] and writes out[:, t0:t1]; only the last chunk holds h_n and c_n (the others hold
    empty regions of them), so their consumers read them from the last chunks. The carried state is
    (h, c) of every layer: 2 L N H elements of the part's samples.
    """

    kind = "lstm"
    captured_from = ("lstm",)
    kernel = "lstm"
    gates = 4
    num_states = 2  # (h, c)

    # the four gate activations, the cell state and its tanh, and the layer's output (7 L - 1 values).
    # Kernels may keep more: torch's CPU kernel (oneDNN) keeps a workspace about 2.5 times this.
    saved_per_layer = 7

    def flops(self, op: Operator) -> float:
        # 8 N T H (I + H) per layer: 4 gates, an input and a hidden matmul per step, 2 FLOPs per
        # multiply-add; layers after the first read the hidden state of the one below (I = H)
        return self.matmul_flops(op)


class GRU(_Recurrent):
    """out[N, T, H], h_n[L, N, H] = GRU(x[N, T, I]) (torch.nn.GRU: batch first, zero initial state).

    params: `weight_ih_l{k}` [3H, I], `weight_hh_l{k}` [3H, H], `bias_ih_l{k}`, `bias_hh_l{k}` [3H] (gates
    r, z, n as torch orders them); attrs: `hidden_size`, `num_layers`. dims: `sample` (splittable; axis 0
    of out, axis 1 of h_n); `seq` carried (`DimSpec.carried`: chunk k starts from the final h of every
    layer of chunk k-1; there is no cell state); `hidden` not splittable. A chunk reads x[:, t0:t1] and
    writes out[:, t0:t1]; only the last chunk holds h_n (the others an empty region of it). The carried
    state is h of every layer: L N H elements of the part's samples.
    """

    kind = "gru"
    captured_from = ("gru",)
    kernel = "gru"
    gates = 3
    num_states = 1  # h

    # the gate activations r, z and n, the hidden projection W_hn h + b_hn (r's gradient reads it), and
    # the layer's output, which is also each step's h_{t-1}: 5 L - 1 values
    saved_per_layer = 5

    def flops(self, op: Operator) -> float:
        # 6 N T H (I + H) per layer (3 gates, an input and a hidden matmul per step, 2 FLOPs per
        # multiply-add; I = H after the first layer) plus 10 N T H of elementwise per layer: adding the
        # input and hidden projections of r and z (2), their sigmoids (2), r times the hidden projection
        # of n, its sum with the input projection and the tanh (3), h' = n + z (h - n) (3)
        n, t, _ = input_shape(op, 0)
        elementwise = 10 * n * t * op.attrs["hidden_size"] * op.attrs["num_layers"]
        return self.matmul_flops(op) + float(elementwise)


class RNN(_Recurrent):
    """out[N, T, H], h_n[L, N, H] = RNN(x[N, T, I]) (torch.nn.RNN, h' = f(W_ih x + b_ih + W_hh h + b_hh)
    with f tanh or relu: batch first, zero initial state).

    params: `weight_ih_l{k}` [H, I], `weight_hh_l{k}` [H, H], `bias_ih_l{k}`, `bias_hh_l{k}` [H]; attrs:
    `hidden_size`, `num_layers`, `nonlinearity` (`tanh` or `relu`). dims: `sample` (splittable; axis 0 of
    out, axis 1 of h_n); `seq` carried (`DimSpec.carried`: chunk k starts from the final h of every layer
    of chunk k-1); `hidden` not splittable. A chunk reads x[:, t0:t1] and writes out[:, t0:t1]; only the
    last chunk holds h_n (the others an empty region of it). The carried state is h of every layer: L N H
    elements of the part's samples.
    """

    kind = "rnn"
    captured_from = ("rnn_tanh", "rnn_relu")
    kernel = "rnn"
    gates = 1
    num_states = 1  # h

    # tanh's and relu's gradients read their output, which is the layer's output and each step's
    # h_{t-1}: L - 1 values
    saved_per_layer = 1

    def flops(self, op: Operator) -> float:
        # 2 N T H (I + H) per layer: an input and a hidden matmul per step, 2 FLOPs per multiply-add;
        # I = H after the first layer
        return self.matmul_flops(op)


class Attention(OpDef):
    """o[N, Hq, Tq, dv] = softmax(q k^T * scale + mask) v, fused (F.scaled_dot_product_attention), with
    q [N, Hq, Tq, d], k [N, Hkv, Tk, d], v [N, Hkv, Tk, dv].

    inputs: q, k, v, and optionally the mask: boolean (True keeps a key) or float (added to the scores), of
    a shape that broadcasts to the scores [N, Hq, Tq, Tk]. attrs: `is_causal` (top-left aligned, as torch;
    never with a mask), `scale` (None = 1/sqrt(d)). Grouped-query (and multi-query) attention: k and v
    may have fewer heads Hkv, dividing Hq; query head h reads kv head h // (Hq / Hkv).
    dims: `sample`; `heads` (attribute: a part reads its query heads, the kv heads of their groups and its
    heads of the mask, so q, k and v split on heads need no communication); `seq` (attribute, the query
    rows: a part reads its rows of q and of the mask and all of k and v; its causal mask starts at its
    first row); `head_dim` (the output's dv) not splittable. The kernel is fused: it keeps no Tq x Tk
    scores, so a part keeps its output and each query row's log-sum-exp.
    """

    kind = "attention"
    captured_from = ("scaled_dot_product_attention",)
    kernel = "attention"
    flops_counted = True

    def saved_bytes(self, op: Operator, box: Box) -> int:
        # the fused kernel keeps each query row's log-sum-exp of the scores (float32 at least) and its
        # mask made additive, in the op's dtype: the causal mask of a part that does not start at row 0,
        # or the mask input's region (counted whatever its dtype: a float one is kept as it is)
        (n0, n1), (h0, h1), (s0, s1) = box[0], box[1], box[2]
        itemsize = DTYPE_BYTES[op.outputs[0].dtype]
        saved = (n1 - n0) * (h1 - h0) * (s1 - s0) * max(DTYPE_BYTES["float32"], itemsize)
        if op.attrs.get("is_causal", False) and s0 > 0:
            saved += (s1 - s0) * input_shape(op, 1)[2] * itemsize
        elif len(op.inputs) > 3:
            saved += region_numel(self.input_regions(op, box)[3]) * itemsize
        return saved

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        n, heads, t, hd = op.outputs[0].shape
        return (DimSpec(name="sample", kind=DimKind.SAMPLE, size=n, out_axis=0),
                DimSpec(name="heads", kind=DimKind.ATTRIBUTE, size=heads, out_axis=1),
                DimSpec(name="seq", kind=DimKind.ATTRIBUTE, size=t, out_axis=2),
                DimSpec(name="head_dim", kind=DimKind.ATTRIBUTE, size=hd, out_axis=3, splittable=False))

    def group(self, op: Operator) -> int:
        """Query heads per kv head (1 without grouped-query attention)."""
        return input_shape(op, 0)[1] // input_shape(op, 1)[1]

    def check(self, op: Operator, degrees: Mapping[str, int]) -> str | None:
        """With grouped-query attention a heads split must keep each group of query heads with its kv
        head: every part holds whole groups, or lies inside one group."""
        reason = super().check(op, degrees)
        degree, group = degrees.get("heads", 1), self.group(op)
        if reason is None and degree > 1 and group > 1:
            heads = op.outputs[0].shape[1]
            chunk = heads // degree
            if chunk % group and group % chunk:
                reason = (f"attention with {heads} query heads in groups of {group} per kv head cannot split "
                          f"'heads' {degree} ways: chunks of {chunk} heads straddle groups")
        return reason

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        q, k, v = (input_shape(op, i) for i in range(3))
        n, h, s = box[0], box[1], box[2]
        group = self.group(op)
        kv = (h[0] // group, (h[1] - 1) // group + 1)
        regions: tuple[Region | None, ...] = (
            (n, h, s, (0, q[3])), (n, kv, (0, k[2]), (0, k[3])), (n, kv, (0, v[2]), (0, v[3])))
        if len(op.inputs) > 3:
            regions += (broadcast_region(input_shape(op, 3), (n, h, s, (0, k[2]))),)
        return regions

    def flops(self, op: Operator) -> float:
        # q k^T and the product with v: 2 N heads Tq Tk d and 2 N heads Tq Tk dv
        n, heads, tq, head_dim = input_shape(op, 0)
        tk, value_dim = input_shape(op, 1)[2], input_shape(op, 2)[3]
        return 2.0 * n * heads * tq * tk * (head_dim + value_dim)

    def backward_flops(self, op: Operator, fwd_flops: float) -> float:
        return 2.0 * fwd_flops  # the gradients of q, k and v: twice the two matmuls


# ---------------------------------------------------------------- pooling


def _image_dims(op: Operator) -> tuple[DimSpec, ...]:
    """`sample`, `channels`, `height`, `width` of an [N, C, H, W] output, every one splittable."""
    n, c, ho, wo = op.outputs[0].shape
    return (DimSpec(name="sample", kind=DimKind.SAMPLE, size=n, out_axis=0),
            DimSpec(name="channels", kind=DimKind.ATTRIBUTE, size=c, out_axis=1),
            DimSpec(name="height", kind=DimKind.ATTRIBUTE, size=ho, out_axis=2),
            DimSpec(name="width", kind=DimKind.ATTRIBUTE, size=wo, out_axis=3))


class Pool2d(OpDef):
    """y[N, C, Ho, Wo] = max or average pooling of x[N, C, H, W].

    attrs: `mode` (`max`/`avg`), `kernel`, `stride`, `padding`, `dilation` ([h, w] each), `ceil_mode`,
    `count_include_pad`, `divisor_override` (optional).
    dims: `sample`, `channels` (attribute), `height`, `width` (attribute: the input region is the window
    range clipped to the tensor, so neighbours' rows are read as a halo).
    """

    kind = "pool2d"
    captured_from = ("max_pool2d", "max_pool2d_with_indices", "avg_pool2d")
    kernel = "pool2d"

    def saved_bytes(self, op: Operator, box: Box) -> int:
        # a max pool keeps the index of each output's maximum (int64)
        if op.attrs.get("mode", "max") != "max":
            return 0
        return region_numel(self.output_region(op, box)) * DTYPE_BYTES["int64"]

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        return _image_dims(op)

    def needed_window(self, op: Operator, box: Box) -> tuple[Range, Range]:
        """The unclipped input rows and columns of the part; the kernel pads the clipped remainder."""
        a = op.attrs
        (kh, kw), (sh, sw) = pair(a["kernel"]), pair(a.get("stride") or a["kernel"])
        (ph, pw), (dh, dw) = pair(a.get("padding", 0)), pair(a.get("dilation", 1))
        return (window_range(box[2], kernel=kh, stride=sh, padding=ph, dilation=dh),
                window_range(box[3], kernel=kw, stride=sw, padding=pw, dilation=dw))

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        h, w = input_shape(op, 0)[2:]
        rows, cols = self.needed_window(op, box)
        return ((box[0], box[1], clip_range(rows, h), clip_range(cols, w)),)

    def flops(self, op: Operator) -> float:
        return float(output_numel(op) * math.prod(op.attrs["kernel"]))


# how near a whole number a bilinear source coordinate may fall for its rounding to decide the rows it
# blends (the kernel computes coordinates in float32 for float32 inputs): closer, a row more is read
_COORD_SLACK = 1e-3


class Upsample(OpDef):
    """y[N, C, H*s, W*t] = upsampling of x[N, C, H, W] by whole factors `scale` [s, t]; `mode` `nearest`
    (output row r copies input row r // s; where absent) or `bilinear` with `align_corners`.

    Bilinear output row r blends input rows floor(u) and floor(u) + 1 at u = (r + 0.5) / s - 0.5 (clamped
    to 0), or u = r (H - 1) / (H s - 1) with `align_corners`; columns likewise.

    dims: `sample`, `channels`, `height`, `width` (attribute; a part reads the input rows its rows are made
    of, the rows a split falls between read by both neighbours).
    """

    kind = "upsample"
    captured_from = ("upsample_nearest2d", "upsample_bilinear2d")
    kernel = "upsample"

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        return _image_dims(op)

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        return ((box[0], box[1], *(self.source_range(op, axis, *rows) for axis, rows in enumerate(box[2:]))),)

    def source_coord(self, op: Operator, axis: int, row: int) -> float:
        """Bilinear: the source coordinate u of output row `row` along spatial `axis` (0: height, 1: width)."""
        s, n = int(op.attrs["scale"][axis]), input_shape(op, 0)[2 + axis]
        if op.attrs.get("align_corners"):
            return row * (n - 1) / (n * s - 1) if n * s > 1 else 0.0
        return max((row + 0.5) / s - 0.5, 0.0)

    def source_range(self, op: Operator, axis: int, lo: int, hi: int) -> Range:
        """The input rows that output rows [lo, hi) along spatial `axis` are made of: the rows they copy
        (nearest), or the two rows around each one's source coordinate (bilinear; widened by a row where
        the coordinate is within `_COORD_SLACK` of a whole number, as the kernel computes it in the
        input's precision)."""
        s, n = int(op.attrs["scale"][axis]), input_shape(op, 0)[2 + axis]
        if op.attrs.get("mode", "nearest") == "nearest" or hi <= lo:
            return lo // s, max(-(-hi // s), lo // s)
        first, last = self.source_coord(op, axis, lo), self.source_coord(op, axis, hi - 1)
        return max(math.floor(first - _COORD_SLACK), 0), min(math.floor(last + _COORD_SLACK) + 2, n)

    def flops(self, op: Operator) -> float:
        return float(output_numel(op)) * (1 if op.attrs.get("mode", "nearest") == "nearest" else 8)


class AdaptivePool2d(OpDef):
    """y[N, C, Ho, Wo] = adaptive max or average pooling of x[N, C, H, W]. attrs: `mode`, `output_size`.

    dims: `sample`, `channels` (attribute); `d2`, `d3` (spatial) not splittable (windows overlap unevenly).
    """

    kind = "adaptive_pool2d"
    captured_from = ("adaptive_avg_pool2d", "adaptive_max_pool2d")
    kernel = "adaptive_pool2d"

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        n, c, ho, wo = op.outputs[0].shape
        return (DimSpec(name="sample", kind=DimKind.SAMPLE, size=n, out_axis=0),
                DimSpec(name="channels", kind=DimKind.ATTRIBUTE, size=c, out_axis=1),
                DimSpec(name="d2", kind=DimKind.ATTRIBUTE, size=ho, out_axis=2, splittable=False),
                DimSpec(name="d3", kind=DimKind.ATTRIBUTE, size=wo, out_axis=3, splittable=False))

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        h, w = input_shape(op, 0)[2:]
        return ((box[0], box[1], (0, h), (0, w)),)

    def flops(self, op: Operator) -> float:
        return float(first_input_numel(op))


# ---------------------------------------------------------------- pointwise and shape ops


# the aten pointwise ops an elementwise op may name as its `fn`, each with its scalar arguments in schema
# order (capture's mapper and the runtime's kernel read this one table)
POINTWISE_FNS: dict[str, tuple[str, ...]] = {
    "leaky_relu": ("negative_slope",), "hardtanh": ("min_val", "max_val"), "elu": ("alpha", "scale", "input_scale"),
    "celu": ("alpha",), "softplus": ("beta", "threshold"), "selu": (), "mish": (), "hardswish": (),
    "hardsigmoid": (), "abs": (), "sqrt": (), "log": (), "sin": (), "cos": (), "reciprocal": (), "erf": (),
    "floor": (), "ceil": (), "trunc": (), "sign": (), "square": (), "clamp": ("min", "max"), "clamp_min": ("min",),
    "clamp_max": ("max",),
}


class Elementwise(_AxisOp):
    """y = fn(x) elementwise. attrs: `fn` in relu, gelu (`approximate`), tanh, sigmoid, silu, neg, exp,
    rsqrt, identity (also a copy or a ``to`` that keeps the dtype), scale (x * `scalar`), add_scalar
    (x + `scalar`), pow_scalar (x ** `scalar`), rsub_scalar (`scalar` - x); or the name of an aten
    pointwise op of `POINTWISE_FNS` (leaky_relu, hardtanh, elu, ...), its scalar arguments as attrs by
    their schema names (`negative_slope`, `min_val` and `max_val`, ...).

    dims: `sample`, `d1`.. all splittable.
    """

    kind = "elementwise"
    # the scalar forms of the arithmetic ops (x + 2.0) are elementwise; their tensor forms are binary
    captured_from = ("relu", "gelu", "tanh", "sigmoid", "silu", "neg", "exp", "rsqrt", "clone", "alias",
                     "contiguous", "to", "_to_copy", "type_as", "add", "sub", "mul", "div", "rsub", "pow",
                     *POINTWISE_FNS)
    kernel = "elementwise"

    def output_is_view(self, op: Operator) -> bool:
        return op.attrs.get("fn") == "identity"  # the kernel returns its input

    def flops(self, op: Operator) -> float:
        return float(output_numel(op))


class PReLU(_AxisOp):
    """y = max(0, x) + `weight` * min(0, x), the weight one value per channel (axis 1 of x[N, C, ..]) or
    one value for all (`nn.PReLU`'s `num_parameters`).

    dims: `sample`, `d1`.. all splittable; a part reads the weights of its channels (all of a single one).
    """

    kind = "prelu"
    captured_from = ("prelu", "_prelu_kernel")
    kernel = "prelu"

    def param_regions(self, op: Operator, box: Box) -> dict[str, Region]:
        (size,) = op.params["weight"].shape
        return {"weight": (box[1],) if size > 1 else ((0, 1),)}

    def flops(self, op: Operator) -> float:
        return 2.0 * output_numel(op)


class Binary(OpDef):
    """y = fn(a, b) with broadcasting. attrs: `fn` in add, sub, mul, div, maximum, minimum, masked_fill
    (`value` where the bool mask b is true, a elsewhere), where (a where b is true, `value` elsewhere);
    `param_operand` (0 or 1) when one operand is the parameter `other` (the op then has one tensor input).

    dims: the output axes `sample`, `d1`.., all splittable; an operand's broadcast axes are read whole.
    """

    kind = "binary"
    captured_from = ("add", "sub", "mul", "div", "rsub", "maximum", "minimum", "masked_fill", "where")
    kernel = "binary"

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        return tuple(axis_dims(op.outputs[0].shape))

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        return tuple(broadcast_region(input_shape(op, i), tuple(box)) for i in range(len(op.inputs)))

    def param_regions(self, op: Operator, box: Box) -> dict[str, Region]:
        return {name: broadcast_region(p.shape, tuple(box)) for name, p in op.params.items()}

    def flops(self, op: Operator) -> float:
        return float(output_numel(op))


class Reduce(OpDef):
    """y = `fn` of x over `axes` (empty = all axes), keeping them as size 1 when `keepdim`: `fn` in sum,
    mean, amax, amin, max and min (the values along one axis), norm (the vector norm of order `ord`), var
    and std (with `correction`), logsumexp.

    dims, named by input axis: axis 0 is `sample` (kind sample), the other kept axes `d{axis}`
    (attribute), the other reduced axes `r{axis}` (reduction). A reduced dim has no output axis: for sum
    and mean a part covering part of it holds partial sums (for a mean every part divides by the full
    count); for the other fns it is not splittable (their parts do not add up).
    """

    kind = "reduce"
    captured_from = ("mean", "sum", "amax", "amin", "max", "min", "linalg_vector_norm", "var", "std", "logsumexp")
    kernel = "reduce"

    def reduce_axes(self, op: Operator) -> tuple[int, ...]:
        """The reduced axes of the input, non-negative and sorted."""
        nd = len(input_shape(op, 0))
        axes = op.attrs.get("axes") or range(nd)
        return tuple(sorted(_norm_axis(int(a), nd) for a in axes))

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        shape = input_shape(op, 0)
        axes = self.reduce_axes(op)
        keepdim = bool(op.attrs.get("keepdim", False))
        summed = op.attrs.get("fn", "sum") in ("sum", "mean")
        out, next_out = [], 0
        for a, size in enumerate(shape):
            reduced = a in axes
            out_axis = None if reduced else (a if keepdim else next_out)
            next_out += not reduced
            name = "sample" if a == 0 else (f"r{a}" if reduced else f"d{a}")
            kind = DimKind.SAMPLE if a == 0 else (DimKind.REDUCTION if reduced else DimKind.ATTRIBUTE)
            out.append(DimSpec(name=name, kind=kind, size=size, out_axis=out_axis,
                               splittable=not reduced or summed))
        return tuple(out)

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        return (tuple(box),)

    def flops(self, op: Operator) -> float:
        return float(first_input_numel(op))


class _Join(OpDef):
    """Ops that join their inputs along attr `axis` of the output: every output axis is a dim, that one not
    splittable; data movement, no FLOPs."""

    def axis(self, op: Operator) -> int:
        return _norm_axis(int(op.attrs["axis"]), len(op.outputs[0].shape))

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        return tuple(axis_dims(op.outputs[0].shape, fixed=(self.axis(op),)))

    def flops(self, op: Operator) -> float:
        return 0.0  # data movement


class Concat(_Join):
    """y = cat(x0, x1, .., dim=`axis`). A 1-D empty input (which torch.cat skips whatever the others'
    shapes; capture leaves them out) is read whole.

    dims: the output axes `sample`, `d1`..; the concat axis is not splittable.
    """

    kind = "concat"
    captured_from = ("cat",)
    kernel = "concat"

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        axis = self.axis(op)
        out = []
        for i in range(len(op.inputs)):
            shape = input_shape(op, i)
            if len(shape) != len(box):
                out.append(full_region(shape))
                continue
            region = list(box)
            region[axis] = (0, shape[axis])
            out.append(tuple(region))
        return tuple(out)


class Stack(_Join):
    """y = stack(x0, x1, .., dim=`axis`): inputs of one shape along a new axis.

    dims: the output axes `sample`, `d1`..; the new axis is not splittable.
    """

    kind = "stack"
    captured_from = ("stack",)
    kernel = "stack"

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        axis = self.axis(op)
        region = tuple(box[:axis]) + tuple(box[axis + 1:])
        return tuple(region for _ in op.inputs)


class Expand(OpDef):
    """y = x.expand(`shape`): x's axes of size 1 (and new leading axes) repeated to `shape` (a view in torch,
    as in the ``repeat_kv`` of grouped-query attention: ``k[:, :, None].expand(..)`` then a reshape). x is
    the op's input, or its parameter `value` (a ViT's class token expanded to the batch), then it has no input.

    dims: the output axes `sample`, `d1`.., all splittable; a part reads x's one row along an expanded axis.
    """

    kind = "expand"
    captured_from = ("expand", "expand_as")
    kernel = "expand"

    def output_is_view(self, op: Operator) -> bool:
        return True

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        return tuple(axis_dims(op.outputs[0].shape))

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        return (broadcast_region(input_shape(op, 0), tuple(box)),) if op.inputs else ()

    def param_regions(self, op: Operator, box: Box) -> dict[str, Region]:
        return {name: broadcast_region(p.shape, tuple(box)) for name, p in op.params.items()}

    def flops(self, op: Operator) -> float:
        return 0.0  # data movement


class Repeat(OpDef):
    """y = x.repeat_interleave(`repeats`, dim=`axis`): every row of x along `axis` repeated in place,
    y[.., i, ..] = x[.., i // repeats, ..] (the other ``repeat_kv`` of grouped-query attention).

    dims: the output axes `sample`, `d1`.., all splittable; a part reads the rows of x its rows repeat.
    """

    kind = "repeat"
    captured_from = ("repeat_interleave",)
    kernel = "repeat"

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        return tuple(axis_dims(op.outputs[0].shape))

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        axis, repeats = int(op.attrs["axis"]), int(op.attrs["repeats"])
        region = list(box)
        lo, hi = box[axis]
        region[axis] = (lo // repeats, (hi - 1) // repeats + 1)
        return (tuple(region),)

    def flops(self, op: Operator) -> float:
        return 0.0  # data movement


class Split(OpDef):
    """y0, y1, .. = split(x, `sizes`, dim=`axis`): one output per size.

    dims: the axes of x (`sample`, `d1`..; output i has the same axes); the split axis is not splittable.
    """

    kind = "split"
    captured_from = ("split", "split_with_sizes", "chunk")
    kernel = "split"

    def output_is_view(self, op: Operator) -> bool:
        return True

    def axis(self, op: Operator) -> int:
        return _norm_axis(int(op.attrs["axis"]), len(op.outputs[0].shape))

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        axis = self.axis(op)
        shape = list(op.outputs[0].shape)
        shape[axis] = sum(int(s) for s in op.attrs["sizes"])
        return tuple(axis_dims(shape, fixed=(axis,)))

    def output_region(self, op: Operator, box: Box, index: int = 0) -> Region:
        region = list(box)
        region[self.axis(op)] = (0, int(op.attrs["sizes"][index]))
        return tuple(region)

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        return (tuple(box),)

    def flops(self, op: Operator) -> float:
        return 0.0  # data movement


class Slice(OpDef):
    """y = x[.., `start`:`stop`:`step`, ..] along `axis`; with `squeeze` the axis is dropped (x[.., start]).

    dims: the output axes `sample`, `d1`..; the sliced axis (when kept) is not splittable.
    """

    kind = "slice"
    captured_from = ("select", "slice", "index")
    kernel = "slice"

    def output_is_view(self, op: Operator) -> bool:
        return True

    def axis(self, op: Operator) -> int:
        nd = len(op.outputs[0].shape) + bool(op.attrs.get("squeeze", False))
        return _norm_axis(int(op.attrs["axis"]), nd)

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        fixed = () if op.attrs.get("squeeze", False) else (self.axis(op),)
        return tuple(axis_dims(op.outputs[0].shape, fixed=fixed))

    def read_range(self, op: Operator) -> Range:
        """The rows of the sliced axis the op reads (first to last selected, step included)."""
        axis, a = self.axis(op), op.attrs
        start = int(a.get("start") or 0)
        if start < 0:
            start += input_shape(op, 0)[axis]
        count = 1 if a.get("squeeze", False) else op.outputs[0].shape[axis]
        step = int(a.get("step") or 1)
        return (start, start + (count - 1) * step + 1) if count else (start, start)

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        axis = self.axis(op)
        region = list(box)
        if op.attrs.get("squeeze", False):
            region.insert(axis, self.read_range(op))
        else:
            region[axis] = self.read_range(op)
        return (tuple(region),)

    def flops(self, op: Operator) -> float:
        return 0.0  # data movement


def _suffix_products(shape: Sequence[int]) -> list[int]:
    out = [1]
    for s in reversed(shape):
        out.append(out[-1] * s)
    return out[::-1]


def _range_as_box(rng: Range, radices: Sequence[int]) -> list[Range] | None:
    """A range of flat indices over the mixed radix `radices` as a box (one range per digit), or None."""
    lo, hi = rng
    strides = _suffix_products(radices)
    for t in range(len(radices) - 1, -1, -1):
        s, c = strides[t + 1], radices[t]
        if lo % s == 0 and hi % s == 0 and lo // (s * c) == (hi - 1) // (s * c):
            box = [(d, d + 1) for d in ((lo // strides[j + 1]) % radices[j] for j in range(t))]
            box.append(((lo // s) % c, ((hi - 1) // s) % c + 1))
            box += [(0, radices[j]) for j in range(t + 1, len(radices))]
            return box
    return None


def _box_as_range(box: Sequence[Range], radices: Sequence[int]) -> Range | None:
    """A box over the mixed radix `radices` as one range of flat indices, or None when not contiguous."""
    ranged = False
    for (lo, hi), c in zip(box, radices, strict=True):
        if ranged and (lo, hi) != (0, c):
            return None
        ranged = ranged or hi - lo > 1
    strides = _suffix_products(radices)
    first = sum(lo * strides[j + 1] for j, (lo, _) in enumerate(box))
    last = sum((hi - 1) * strides[j + 1] for j, (_, hi) in enumerate(box))
    return (first, last + 1)


def reshape_region(in_shape: Sequence[int], out_shape: Sequence[int], out_region: Region) -> Region | None:
    """The box of x[in_shape] holding exactly the elements of `out_region` of x.reshape(out_shape).

    None when those elements do not form a box of the input. Axes are grouped between the flat strides
    both shapes share; inside a group both shapes are refined to a common mixed radix (when one exists)
    and the region is carried through it; a group without one moves only whole.
    """
    if math.prod(in_shape) == 0:
        return full_region(tuple(in_shape))
    out_s, in_s = _suffix_products(out_shape), _suffix_products(in_shape)
    cuts = sorted(set(out_s) & set(in_s), reverse=True)
    result: list[Range] = [(0, 1) if s == 1 else (0, 0) for s in in_shape]
    for c_hi, c_lo in zip(cuts, cuts[1:], strict=False):
        out_axes = [a for a in range(len(out_shape))
                    if out_shape[a] > 1 and out_s[a] <= c_hi and out_s[a + 1] >= c_lo]
        in_axes = [a for a in range(len(in_shape))
                   if in_shape[a] > 1 and in_s[a] <= c_hi and in_s[a + 1] >= c_lo]
        bounds = sorted({v for v in out_s + in_s if c_lo <= v <= c_hi}, reverse=True)
        if any(b % nb for b, nb in zip(bounds, bounds[1:], strict=False)):
            if any(out_region[a] != (0, out_shape[a]) for a in out_axes):
                return None
            for a in in_axes:
                result[a] = (0, in_shape[a])
            continue
        # fine axes of the common radix, each named by its upper bound
        fine: dict[int, Range] = {}
        for a in out_axes:
            spanned = [b for b in bounds if out_s[a + 1] < b <= out_s[a]]
            radices = [b // nb for b, nb in zip(bounds, bounds[1:], strict=False) if b in spanned]
            box = _range_as_box(out_region[a], radices)
            if box is None:
                return None
            fine.update(zip(spanned, box, strict=True))
        for a in in_axes:
            spanned = [b for b in bounds if in_s[a + 1] < b <= in_s[a]]
            radices = [b // nb for b, nb in zip(bounds, bounds[1:], strict=False) if b in spanned]
            rng = _box_as_range([fine[b] for b in spanned], radices)
            if rng is None:
                return None
            result[a] = rng
    return tuple(result)


@functools.lru_cache(maxsize=4096)
def _reshape_split_refusal(in_shape: tuple[int, ...], out_shape: tuple[int, ...],
                           split: tuple[tuple[str, int], ...]) -> str | None:
    """Why splitting the reshape `in_shape` -> `out_shape` by `split` (dim, degree) is refused, or None:
    a part whose output box is not a box of the input. Cached: the blocks of a model repeat their shapes."""
    for box in part_boxes(tuple(axis_dims(out_shape)), dict(split)):
        if reshape_region(in_shape, out_shape, box) is None:
            return (f"reshape {list(in_shape)} -> {list(out_shape)} split {dict(split)} has a part "
                    f"{list(box)} that is not a box of the input")
    return None


class Reshape(OpDef):
    """y = x.reshape(`shape`) (view, flatten, unflatten, squeeze, unsqueeze).

    dims: the output axes `sample`, `d1`..; a split is allowed only where every part's output box holds
    exactly the elements of a box of x (so the part reshapes its input region alone).
    """

    kind = "reshape"
    captured_from = ("view", "reshape", "_unsafe_view", "flatten", "unflatten", "unsqueeze", "squeeze")
    kernel = "reshape"

    def output_is_view(self, op: Operator) -> bool:
        return True

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        return tuple(axis_dims(op.outputs[0].shape))

    def check(self, op: Operator, degrees: Mapping[str, int]) -> str | None:
        reason = super().check(op, degrees)
        if reason is None and any(g > 1 for g in degrees.values()):
            split = tuple(sorted((k, g) for k, g in degrees.items() if g > 1))
            reason = _reshape_split_refusal(tuple(input_shape(op, 0)), tuple(op.outputs[0].shape), split)
        return reason

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        region = reshape_region(input_shape(op, 0), op.outputs[0].shape, tuple(box))
        if region is None:
            raise ValueError(f"op {op.name!r}: reshape part {list(box)} is not a box of its input")
        return (region,)

    def flops(self, op: Operator) -> float:
        return 0.0  # data movement


class Transpose(OpDef):
    """y = x.permute(`perm`): output axis i is input axis perm[i].

    dims: the output axes `sample`, `d1`.., all splittable.
    """

    kind = "transpose"
    captured_from = ("transpose", "permute", "t", "numpy_T")
    kernel = "transpose"

    def output_is_view(self, op: Operator) -> bool:
        return True

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        return tuple(axis_dims(op.outputs[0].shape))

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        perm = [_norm_axis(int(p), len(box)) for p in op.attrs["perm"]]
        region: list[Range] = [(0, 0)] * len(box)
        for out_axis, in_axis in enumerate(perm):
            region[in_axis] = box[out_axis]
        return (tuple(region),)

    def flops(self, op: Operator) -> float:
        return 0.0  # data movement


class Flip(_AxisOp):
    """y = x.flip(`axes`): along each axis of `axes`, output row r is input row n - 1 - r.

    dims: the output axes `sample`, `d1`.., all splittable: a part reads the mirror image of its rows
    along the flipped axes (the reverse direction of a bidirectional recurrence runs between two flips of
    the time axis).
    """

    kind = "flip"
    captured_from = ("flip",)
    kernel = "flip"

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        shape = op.outputs[0].shape
        flipped = {_norm_axis(int(a), len(shape)) for a in op.attrs["axes"]}
        return (tuple((shape[a] - hi, shape[a] - lo) if a in flipped else (lo, hi)
                      for a, (lo, hi) in enumerate(box)),)

    def flops(self, op: Operator) -> float:
        return 0.0  # data movement


class Roll(_AxisOp):
    """y = x.roll(`shifts`, `axes`): along each rolled axis, output row r is input row (r - shift) mod n
    (Swin's shifted windows).

    dims: the output axes `sample`, `d1`.., all splittable: along a rolled axis a part reads the rows its
    rows come from, or the whole axis where they wrap around its end.
    """

    kind = "roll"
    captured_from = ("roll",)
    kernel = "roll"

    def shifts(self, op: Operator) -> dict[int, int]:
        """Per rolled axis, its shift (in [0, n))."""
        shape = op.outputs[0].shape
        out: dict[int, int] = {}
        for axis, shift in zip(op.attrs["axes"], op.attrs["shifts"], strict=True):
            a = _norm_axis(int(axis), len(shape))
            out[a] = (out.get(a, 0) + int(shift)) % shape[a]
        return out

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        shape, shifts = op.outputs[0].shape, self.shifts(op)
        region = []
        for a, (lo, hi) in enumerate(box):
            start = (lo - shifts.get(a, 0)) % shape[a]
            region.append((start, start + hi - lo) if start + hi - lo <= shape[a] else (0, shape[a]))
        return (tuple(region),)

    def flops(self, op: Operator) -> float:
        return 0.0  # data movement


class Pad(_AxisOp):
    """y = x padded with `value` (constant padding): `pad` lists (before, after) counts from the last axis
    backwards, as `F.pad` takes them; negative counts crop.

    dims: the output axes `sample`, `d1`.., all splittable: a part reads the input rows its rows hold
    (`source_range`; a part wholly in the padding reads one row it does not use, so that no region is
    empty) and fills the rest with `value`.
    """

    kind = "pad"
    captured_from = ("pad", "constant_pad_nd")
    kernel = "pad"

    def before(self, op: Operator) -> list[int]:
        """Per axis, the rows added before it (negative: cropped)."""
        shape, pad = op.outputs[0].shape, [int(p) for p in op.attrs["pad"]]
        out = [0] * len(shape)
        for k in range(len(pad) // 2):
            out[len(shape) - 1 - k] = pad[2 * k]
        return out

    def source_range(self, op: Operator, axis: int, lo: int, hi: int) -> Range:
        """The input rows output rows [lo, hi) along `axis` hold (an empty range where they are all padding)."""
        n, before = input_shape(op, 0)[axis], self.before(op)[axis]
        first = min(max(lo - before, 0), n)
        return first, max(min(hi - before, n), first)

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        shape = input_shape(op, 0)
        region = []
        for axis, (lo, hi) in enumerate(box):
            a, b = self.source_range(op, axis, lo, hi)
            region.append((a, b) if b > a else (min(a, shape[axis] - 1), min(a, shape[axis] - 1) + 1))
        return (tuple(region),)

    def flops(self, op: Operator) -> float:
        return 0.0  # data movement


class Softmax(_AxisOp):
    """y = softmax(x, `axis`) (log_softmax when `log`).

    dims: the output axes `sample`, `d1`..; `axis` is not splittable.
    """

    kind = "softmax"
    captured_from = ("softmax", "_softmax", "log_softmax", "_log_softmax")
    kernel = "softmax"

    def fixed_axes(self, op: Operator) -> tuple[int, ...]:
        return (int(op.attrs["axis"]),)

    def flops(self, op: Operator) -> float:
        return 5.0 * output_numel(op)


class TopK(OpDef):
    """values, indices = torch.topk(x, `k`, `axis`, `largest`, `sorted`): outputs 0 (x's dtype) and 1
    (int64) of equal shape, x's with `k` along `axis`. attrs `largest` and `sorted` default true.

    dims: the output axes `sample`, `d1`..; `axis` is not splittable (a part reads it whole).
    """

    kind = "topk"
    captured_from = ("topk",)
    kernel = "topk"

    def axis(self, op: Operator) -> int:
        return _norm_axis(int(op.attrs["axis"]), len(op.outputs[0].shape))

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        return tuple(axis_dims(op.outputs[0].shape, fixed=[self.axis(op)]))

    def output_region(self, op: Operator, box: Box, index: int = 0) -> Region:
        if index not in (0, 1):
            raise NotImplementedError(f"topk has no output {index}")
        return tuple(box)

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        region = list(box)
        region[self.axis(op)] = (0, input_shape(op, 0)[self.axis(op)])
        return (tuple(region),)

    def flops(self, op: Operator) -> float:
        return float(first_input_numel(op)) * max(1.0, math.log2(max(int(op.attrs["k"]), 1)))


class Random(_AxisOp):
    """y = uniform draws in [0, 1) of the output's shape (``torch.rand``: stochastic depth's per-sample
    draw), or standard normal ones with `normal` (``torch.randn``: a VAE's reparameterization); attr
    `seed`. Reads nothing.

    dims: `sample`, `d1`.. all splittable: each value is a hash of its global index, the seed and the
    training step (`runtime.kernels.uniform_draws`), so any split draws the unsplit values.
    """

    kind = "random"
    captured_from = ("rand", "randn", "rand_like", "randn_like")
    kernel = "random"

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        return ()

    def flops(self, op: Operator) -> float:
        return float(output_numel(op))


class Dropout(_AxisOp):
    """y = x * mask / (1 - `p`) in training, x in evaluation; attrs `p`, `seed`, `feature` (true: one draw
    per sample and channel, kept or dropped whole: `nn.Dropout1d`/`2d`/`3d`, aten's ``feature_dropout``).

    dims: `sample`, `d1`.. all splittable: the mask is a hash of the global element index (of the
    (sample, channel) index for `feature`), the seed and the step, so any split draws the unsplit mask.
    """

    kind = "dropout"
    captured_from = ("dropout", "feature_dropout")
    kernel = "dropout"

    def output_is_view(self, op: Operator) -> bool:
        return float(op.attrs.get("p", 0.5)) == 0.0  # at p = 0 the kernel returns its input

    def saved_bytes(self, op: Operator, box: Box) -> int:
        # the keep mask, in the output's dtype, which the product saves
        if self.output_is_view(op) or float(op.attrs.get("p", 0.5)) >= 1.0:
            return 0
        region = self.output_region(op, box)
        return region_numel(region[:2] if op.attrs.get("feature") else region) * DTYPE_BYTES[op.outputs[0].dtype]

    def flops(self, op: Operator) -> float:
        return float(output_numel(op))


class Loss(OpDef):
    """The scalar mean (or sum, `reduction`) loss of logits against target. attrs: `fn`, `reduction`;
    for cross entropy `ignore_index` (-100 where absent: PyTorch's default) and `label_smoothing` (0 where
    absent), and a third input, the class weights (C), where it has them (read whole by every part).

    `cross_entropy`: logits (N, C, d2..), target (N, d2..) int64; `mse`: logits and target of one shape. dims (none
    has an output axis: parts hold partial sums of the loss, each dividing by the full count): `sample` (sample
    kind); `d1`.. (for mse) or `d2`.. (for cross entropy) attribute; `classes` (axis 1 of cross entropy) not
    splittable. The mean of cross entropy divides by the number of targets that are not `ignore_index` (with class
    weights, by the sum of their classes' weights: `counts_targets`), which only the whole target tells: that count
    is the data's, handed to every part with the step's batch (as a data loader counts the tokens of a padded
    batch), not a value the plan moves.
    """

    kind = "loss"
    # cross_entropy_loss, mse_loss, and nll_loss of a log_softmax over classes (fused into one op)
    captured_from = ("cross_entropy_loss", "mse_loss", "nll_loss", "nll_loss_nd")
    kernel = "loss"

    def saved_bytes(self, op: Operator, box: Box) -> int:
        # cross entropy keeps the log-probabilities of its logits region and the count it divides by (a
        # scalar), in the loss's own dtype
        if op.attrs["fn"] != "cross_entropy":
            return 0
        return (region_numel(self.input_regions(op, box)[0]) + 1) * DTYPE_BYTES[op.outputs[0].dtype]

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        shape = input_shape(op, 0)
        ce = op.attrs["fn"] == "cross_entropy"
        out = []
        for a, size in enumerate(shape):
            if ce and a == 1:
                out.append(DimSpec(name="classes", kind=DimKind.ATTRIBUTE, size=size, out_axis=None,
                                   splittable=False))
            else:
                kind = DimKind.SAMPLE if a == 0 else DimKind.ATTRIBUTE
                out.append(DimSpec(name=axis_name(a), kind=kind, size=size, out_axis=None))
        return tuple(out)

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        target = tuple(box[:1]) + tuple(box[2:]) if op.attrs["fn"] == "cross_entropy" else tuple(box)
        if len(op.inputs) > 2:  # the class weights, whole
            return (tuple(box), target, ((0, input_shape(op, 2)[0]),))
        return (tuple(box), target)

    def flops(self, op: Operator) -> float:
        per = 3.0
        if op.attrs["fn"] == "cross_entropy":
            per = 6.0 if op.attrs.get("label_smoothing") else 5.0
        return per * first_input_numel(op)


def counts_targets(op: Operator) -> bool:
    """Whether `op` is a loss that divides by the number of its targets that count (a cross-entropy mean:
    those that are not `ignore_index`), which its parts are handed (`runtime.kernels.compute_part`'s
    `counted`)."""
    return op.kind == "loss" and op.attrs.get("fn") == "cross_entropy" and op.attrs.get("reduction", "mean") == "mean"


class Opaque(OpDef):
    """An op the registry does not know: it runs whole on one device. attrs: `target` (``module`` for a
    leaf-module call, else a qualified function name), `args` (template, see docs/op_kinds.md).

    dims: the axes of output 0 (`sample`, `d1`..), none splittable. Reads every input and parameter whole.
    """

    kind = "opaque"
    captured_specially = ("any other aten call that makes a tensor, or one whose mapper turns its arguments "
                          "down: one call of that aten op")
    run_specially = "run whole on one device by runtime.kernels.run_opaque, which calls the attrs' target"
    flops_counted = True

    def dims(self, op: Operator) -> tuple[DimSpec, ...]:
        shape = op.outputs[0].shape
        return tuple(axis_dims(shape, fixed=range(len(shape))))

    def output_region(self, op: Operator, box: Box, index: int = 0) -> Region:
        return full_region(op.outputs[index].shape)

    def input_regions(self, op: Operator, box: Box) -> tuple[Region | None, ...]:
        return tuple(full_region(input_shape(op, i)) for i in range(len(op.inputs)))

    def flops(self, op: Operator) -> float | None:
        return None  # no formula: the counter's figures stand


for _entry in (Input(), Constant(), Conv2d(), Conv1d(), ConvTranspose2d(), Linear(), Matmul(), BatchNorm(),
               LayerNorm(), GroupNorm(), RMSNorm(), Embedding(), LSTM(), GRU(), RNN(), Attention(), Pool2d(),
               Upsample(), AdaptivePool2d(), Elementwise(), Binary(), Reduce(), Concat(), Stack(), Split(), Slice(),
               Reshape(), Expand(), Repeat(), Transpose(), Flip(), Roll(), Pad(), PReLU(), Softmax(), TopK(),
               Random(), Dropout(), Loss(), Experts(), Opaque()):
    register(_entry)
