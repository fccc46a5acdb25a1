"""Property tests of the op registry and the partitioned kernels, one case per op kind (and variants).

For every splittable dim (a few degrees, and pairs of dims) the parts' output regions tile each output,
the parts computed from exactly the regions the registry names stitch back to the unsplit result and to a
plain torch reference (values and gradients, float64), and dims that cannot be split are refused by
`validate` with a message naming the op and the dim.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runtime.kernels import compute_chunk, compute_part, dropout_keep, run_opaque, target_count
from soap.config import ConfigError, ParallelConfig, parts, validate
from soap.graph import DTYPE_BYTES, Operator, OperatorGraph, ParamSpec, TensorRef, TensorSpec
from soap.opdef import Box, Region, carry_sources, full_box
from soap.registry import POINTWISE_FNS, REGISTRY, counts_targets, dims_of, op_def, reshape_region

DTYPE = torch.float64
Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One op to split: its full inputs, parameters and buffers, and a plain torch reference.

    The output specs come from running the reference, so attrs and shapes cannot disagree.
    `reference` None means there is no torch equivalent (dropout): the full-box part is the reference.
    """

    id: str
    kind: str
    inputs: tuple[torch.Tensor, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    params: Tensors = field(default_factory=dict)
    buffers: Tensors = field(default_factory=dict)
    reference: Callable[..., Any] | None = None
    training: bool = True
    like: torch.Tensor | None = None  # without a reference or inputs (`random`): a tensor of the output's spec

    def op(self) -> Operator:
        outputs = (self.reference_outputs() if self.reference is not None else
                   (self.like,) if self.like is not None else (self.inputs[0],))
        return Operator(
            name=f"op_{self.id}", kind=self.kind,
            inputs=tuple(TensorRef(op=f"x{i}") for i in range(len(self.inputs))),
            outputs=tuple(TensorSpec(shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."))
                          for t in outputs),
            params={k: ParamSpec(shape=tuple(v.shape), fqn=f"m.{k}") for k, v in self.params.items()},
            attrs={**self.attrs, "input_shapes": [list(t.shape) for t in self.inputs]})

    def reference_outputs(self, inputs=None, params=None) -> tuple[torch.Tensor, ...]:
        assert self.reference is not None
        out = self.reference(*(self.inputs if inputs is None else inputs),
                             **(self.params if params is None else params))
        return out if isinstance(out, tuple) else (out,)


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 17 * len(shape) + sum(shape))
    return torch.randn(*shape, generator=g, dtype=DTYPE)


def _ints(high: int, *shape: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, shape, generator=g)


def _ignoring(high: int, *shape: int) -> torch.Tensor:
    """Class ids in [0, `high`) with every third one -100, the ignored index."""
    ids = _ints(high, *shape)
    ids.view(-1)[::3] = -100
    return ids


def _routed(tokens: int, experts: int, k: int) -> torch.Tensor:
    """Per token `k` distinct experts of `experts`, as a router's top-k picks them."""
    g = torch.Generator().manual_seed(5)
    return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])


def _dense_experts(x, index, weights, w_gate, w_up, w_out, b_gate=None, b_up=None, b_out=None, *, act,
                   transposed):
    """A mixture of experts the plain way: every expert on every token, then each token's routed ones
    picked and weighted (the reference for the `experts` kind, which runs only the routed pairs)."""
    def product(h, w, b):
        return h @ (w if transposed else w.T) + (0 if b is None else b)

    outs = []
    for e in range(w_up.shape[0]):
        up = product(x, w_up[e], None if b_up is None else b_up[e])
        h = act(up) if w_gate is None else act(product(x, w_gate[e], None if b_gate is None else b_gate[e])) * up
        outs.append(product(h, w_out[e], None if b_out is None else b_out[e]))
    every = torch.stack(outs)  # [E, T, H]
    rows = torch.arange(x.shape[0])
    return sum(weights[:, j, None] * every[index[:, j], rows] for j in range(index.shape[1]))


def _conv(case_id: str, x_shape, w_shape, *, stride=1, padding=0, dilation=1, groups=1, bias=True) -> Case:
    params = {"weight": _rand(*w_shape, seed=2)}
    if bias:
        params["bias"] = _rand(w_shape[0], seed=3)
    pair = lambda v: [v, v] if isinstance(v, int) else list(v)  # noqa: E731
    return Case(id=case_id, kind="conv2d", inputs=(_rand(*x_shape),), params=params,
                attrs={"stride": pair(stride), "padding": pair(padding), "dilation": pair(dilation),
                       "groups": groups},
                reference=lambda x, weight, bias=None: F.conv2d(x, weight, bias, stride, padding, dilation,
                                                                groups))


def _conv1d(case_id: str, x_shape, w_shape, *, stride=1, padding=0, dilation=1, groups=1, bias=True) -> Case:
    params = {"weight": _rand(*w_shape, seed=2)}
    if bias:
        params["bias"] = _rand(w_shape[0], seed=3)
    return Case(id=case_id, kind="conv1d", inputs=(_rand(*x_shape),), params=params,
                attrs={"stride": stride, "padding": padding, "dilation": dilation, "groups": groups},
                reference=lambda x, weight, bias=None: F.conv1d(x, weight, bias, stride, padding, dilation, groups))


def _deconv(case_id: str, x_shape, w_shape, *, stride=1, padding=0, output_padding=0, dilation=1, groups=1,
            bias=True) -> Case:
    params = {"weight": _rand(*w_shape, seed=2)}
    if bias:
        params["bias"] = _rand(w_shape[1] * groups, seed=3)
    pair = lambda v: [v, v] if isinstance(v, int) else list(v)  # noqa: E731
    return Case(id=case_id, kind="conv_transpose2d", inputs=(_rand(*x_shape),), params=params,
                attrs={"stride": pair(stride), "padding": pair(padding), "output_padding": pair(output_padding),
                       "dilation": pair(dilation), "groups": groups},
                reference=lambda x, weight, bias=None: F.conv_transpose2d(x, weight, bias, stride, padding,
                                                                          output_padding, groups, dilation))


def _pool(case_id: str, x_shape, *, mode, kernel, stride, padding=0, dilation=1, ceil_mode=False,
          count_include_pad=True) -> Case:
    if mode == "max":
        ref = lambda x: F.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode=ceil_mode)  # noqa: E731
    else:
        ref = lambda x: F.avg_pool2d(x, kernel, stride, padding, ceil_mode=ceil_mode,  # noqa: E731
                                     count_include_pad=count_include_pad)
    return Case(id=case_id, kind="pool2d", inputs=(_rand(*x_shape),), reference=ref,
                attrs={"mode": mode, "kernel": [kernel] * 2, "stride": [stride] * 2, "padding": [padding] * 2,
                       "dilation": [dilation] * 2, "ceil_mode": ceil_mode,
                       "count_include_pad": count_include_pad})


def _recurrent_case(case_id: str, kind: str, module: torch.nn.Module, **attrs: Any) -> Case:
    """An op of a recurrent kind (lstm, gru, rnn) with the parameters of `module` (batch first, input 3
    features, 4 samples, 5 steps), checked against the module itself; outputs out, h_n (and c_n)."""
    module = module.to(DTYPE)
    params = {k: v.detach().clone() for k, v in module.named_parameters()}

    def ref(x, **weights):
        out, state = torch.func.functional_call(module, weights, (x,))
        return (out, *state) if isinstance(state, tuple) else (out, state)

    return Case(id=case_id, kind=kind, inputs=(_rand(4, 5, 3),), params=params, reference=ref,
                attrs={"hidden_size": module.hidden_size, "num_layers": module.num_layers, **attrs})


def _lstm_case() -> Case:
    torch.manual_seed(0)
    return _recurrent_case("lstm", "lstm", torch.nn.LSTM(3, 6, num_layers=2, batch_first=True))


def _gru_case() -> Case:
    torch.manual_seed(1)
    return _recurrent_case("gru", "gru", torch.nn.GRU(3, 6, num_layers=2, batch_first=True))


def _rnn_case(nonlinearity: str, num_layers: int) -> Case:
    torch.manual_seed(2)
    module = torch.nn.RNN(3, 6, num_layers=num_layers, nonlinearity=nonlinearity, batch_first=True)
    return _recurrent_case(f"rnn-{nonlinearity}", "rnn", module, nonlinearity=nonlinearity)


# the recurrent cases by id (the LSTM carries (h, c), the others h)
RECURRENT = {"lstm": _lstm_case, "gru": _gru_case, "rnn-tanh": functools.partial(_rnn_case, "tanh", 2),
             "rnn-relu": functools.partial(_rnn_case, "relu", 1)}


def _cases() -> list[Case]:
    mask = torch.rand(1, 1, 5, 5, generator=torch.Generator().manual_seed(4)) > 0.5
    # an attention mask per sample and query row that keeps each query's own key (no row masks all keys)
    keep = (torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(5)) > 0.5) | torch.eye(6, dtype=torch.bool)
    bn_buffers = {"running_mean": _rand(6, seed=5), "running_var": _rand(6, seed=6).abs() + 0.5}
    cases = [
        _conv("conv2d", (4, 4, 8, 8), (6, 4, 3, 3), padding=1),
        _conv("conv2d-strided-dilated", (2, 4, 11, 10), (4, 4, 3, 3), stride=2, padding=2, dilation=2),
        _conv("conv2d-alexnet", (2, 3, 35, 35), (4, 3, 11, 11), stride=4, padding=2, bias=False),
        _conv("conv2d-grouped", (2, 8, 6, 6), (8, 2, 3, 3), padding=1, groups=4),
        _conv("conv2d-1x1-pad", (2, 3, 4, 4), (4, 3, 1, 1), padding=1),
        _deconv("conv_transpose2d", (2, 4, 5, 4), (4, 6, 3, 3), stride=2, padding=1, output_padding=1),
        _deconv("conv_transpose2d-plain", (2, 3, 4, 5), (3, 4, 2, 2), stride=2, bias=False),
        _deconv("conv_transpose2d-dilated", (2, 4, 4, 4), (4, 2, 3, 3), stride=3, padding=2, dilation=2,
                output_padding=(1, 2)),
        _deconv("conv_transpose2d-grouped", (2, 4, 3, 3), (4, 3, 3, 3), stride=1, padding=1, groups=2),
        _conv1d("conv1d", (4, 4, 12), (6, 4, 3), padding=1),
        _conv1d("conv1d-strided-dilated", (2, 4, 15), (4, 4, 3), stride=2, padding=2, dilation=2, bias=False),
        _conv1d("conv1d-grouped", (2, 8, 9), (8, 2, 5), padding=2, groups=4),
        Case(id="linear", kind="linear", inputs=(_rand(4, 3, 8),),
             params={"weight": _rand(6, 8, seed=2), "bias": _rand(6, seed=3)}, reference=F.linear),
        Case(id="linear-transposed", kind="linear", inputs=(_rand(6, 8),),
             params={"weight": _rand(8, 5, seed=2), "bias": _rand(5, seed=3)}, attrs={"transposed": True},
             reference=lambda x, weight, bias: torch.addmm(bias, x, weight)),
        Case(id="matmul", kind="matmul", inputs=(_rand(2, 3, 4, 6), _rand(2, 3, 6, 5, seed=1)),
             reference=torch.matmul),
        Case(id="matmul-broadcast", kind="matmul", inputs=(_rand(2, 1, 4, 6), _rand(3, 6, 4, seed=1)),
             reference=torch.matmul),
        Case(id="matmul-2d", kind="matmul", inputs=(_rand(4, 6), _rand(6, 2, seed=1)),
             reference=torch.matmul),
        Case(id="matmul-transposed-b", kind="matmul", inputs=(_rand(2, 3, 4, 6), _rand(2, 3, 5, 6, seed=1)),
             attrs={"transpose_b": True}, reference=lambda a, b: a @ b.transpose(-2, -1)),
        Case(id="matmul-transposed-a", kind="matmul", inputs=(_rand(2, 6, 4), _rand(2, 6, 5, seed=1)),
             attrs={"transpose_a": True}, reference=lambda a, b: a.transpose(-2, -1) @ b),
        Case(id="matmul-baddbmm", kind="matmul",
             inputs=(_rand(2, 4, 6), _rand(2, 6, 5, seed=1), _rand(2, 1, 5, seed=2)),
             attrs={"alpha": 0.5, "beta": 1.0},
             reference=lambda a, b, c: torch.baddbmm(c, a, b, alpha=0.5, beta=1.0)),
        Case(id="matmul-addmm", kind="matmul", inputs=(_rand(4, 6), _rand(6, 5, seed=1), _rand(5, seed=2)),
             attrs={"beta": 2.0}, reference=lambda a, b, c: torch.addmm(c, a, b, beta=2.0)),
        Case(id="batchnorm-eval", kind="batchnorm", inputs=(_rand(4, 6, 3, 3),),
             params={"weight": _rand(6, seed=2), "bias": _rand(6, seed=3)}, buffers=bn_buffers,
             attrs={"eps": 1e-5, "momentum": 0.1, "running_mean": "bn.running_mean",
                    "running_var": "bn.running_var"},
             training=False,
             reference=lambda x, weight, bias: F.batch_norm(x, bn_buffers["running_mean"],
                                                            bn_buffers["running_var"], weight, bias,
                                                            training=False, eps=1e-5)),
        Case(id="batchnorm1d-train", kind="batchnorm", inputs=(_rand(4, 6),),
             params={"weight": _rand(6, seed=2), "bias": _rand(6, seed=3)},
             attrs={"eps": 1e-5, "momentum": 0.1, "running_mean": None, "running_var": None},
             reference=lambda x, weight, bias: F.batch_norm(x, None, None, weight, bias, training=True)),
        Case(id="layernorm", kind="layernorm", inputs=(_rand(4, 5, 8),),
             params={"weight": _rand(8, seed=2), "bias": _rand(8, seed=3)},
             attrs={"normalized_shape": [8], "eps": 1e-5},
             reference=lambda x, weight, bias: F.layer_norm(x, [8], weight, bias, 1e-5)),
        Case(id="upsample", kind="upsample", inputs=(_rand(2, 3, 3, 4),), attrs={"scale": [2, 3]},
             reference=lambda x: F.interpolate(x, scale_factor=(2, 3), mode="nearest")),
        Case(id="upsample-bilinear", kind="upsample", inputs=(_rand(2, 3, 5, 4),),
             attrs={"scale": [2, 3], "mode": "bilinear", "align_corners": False},
             reference=lambda x: F.interpolate(x, scale_factor=(2, 3), mode="bilinear", align_corners=False)),
        Case(id="upsample-bilinear-corners", kind="upsample", inputs=(_rand(2, 3, 5, 3),),
             attrs={"scale": [3, 2], "mode": "bilinear", "align_corners": True},
             reference=lambda x: F.interpolate(x, scale_factor=(3, 2), mode="bilinear", align_corners=True)),
        Case(id="groupnorm", kind="groupnorm", inputs=(_rand(4, 6, 3, 5),),
             params={"weight": _rand(6, seed=2), "bias": _rand(6, seed=3)}, attrs={"num_groups": 3, "eps": 1e-5},
             reference=lambda x, weight, bias: F.group_norm(x, 3, weight, bias, 1e-5)),
        Case(id="instancenorm", kind="groupnorm", inputs=(_rand(4, 6, 7),), attrs={"num_groups": 6, "eps": 1e-5},
             reference=lambda x: F.instance_norm(x, eps=1e-5)),
        Case(id="rmsnorm", kind="rmsnorm", inputs=(_rand(4, 5, 8),), params={"weight": _rand(8, seed=2)},
             attrs={"normalized_shape": [8], "eps": 1e-6},
             reference=lambda x, weight: F.rms_norm(x, [8], weight, 1e-6)),
        Case(id="rmsnorm-2d-no-weight", kind="rmsnorm", inputs=(_rand(4, 3, 6),),
             attrs={"normalized_shape": [3, 6], "eps": None}, reference=lambda x: F.rms_norm(x, [3, 6])),
        Case(id="embedding", kind="embedding", inputs=(_ints(12, 4, 6),), params={"weight": _rand(12, 6)},
             attrs={"padding_idx": 0},
             reference=lambda idx, weight: F.embedding(idx, weight, padding_idx=0)),
        *(make() for make in RECURRENT.values()),
        Case(id="attention-causal", kind="attention",
             inputs=(_rand(2, 3, 6, 4), _rand(2, 3, 6, 4, seed=1), _rand(2, 3, 6, 4, seed=2)),
             attrs={"is_causal": True, "scale": None},
             reference=lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        Case(id="attention-cross", kind="attention",
             inputs=(_rand(2, 2, 4, 4), _rand(2, 2, 5, 4, seed=1), _rand(2, 2, 5, 3, seed=2)),
             attrs={"is_causal": False, "scale": 0.3},
             reference=lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.3)),
        Case(id="attention-causal-short-queries", kind="attention",
             inputs=(_rand(2, 2, 4, 4), _rand(2, 2, 6, 4, seed=1), _rand(2, 2, 6, 4, seed=2)),
             attrs={"is_causal": True, "scale": None},
             reference=lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        Case(id="attention-mask-bool", kind="attention",
             inputs=(_rand(2, 4, 6, 4), _rand(2, 4, 6, 4, seed=1), _rand(2, 4, 6, 4, seed=2), keep),
             attrs={"is_causal": False, "scale": None},
             reference=lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)),
        Case(id="attention-mask-float", kind="attention",
             inputs=(_rand(2, 4, 6, 4), _rand(2, 4, 6, 4, seed=1), _rand(2, 4, 6, 4, seed=2), _rand(4, 6, 6, seed=3)),
             attrs={"is_causal": False, "scale": 0.4},
             reference=lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.4)),
        Case(id="attention-gqa", kind="attention",
             inputs=(_rand(2, 4, 6, 4), _rand(2, 2, 6, 4, seed=1), _rand(2, 2, 6, 4, seed=2), keep),
             attrs={"is_causal": False, "scale": None},
             reference=lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)),
        Case(id="attention-mqa-causal", kind="attention",
             inputs=(_rand(2, 4, 6, 4), _rand(2, 1, 6, 4, seed=1), _rand(2, 1, 6, 4, seed=2)),
             attrs={"is_causal": True, "scale": None},
             reference=lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)),
        _pool("pool2d-max", (2, 3, 8, 8), mode="max", kernel=3, stride=2, padding=1),
        _pool("pool2d-max-ceil-dilated", (2, 2, 9, 9), mode="max", kernel=2, stride=2, dilation=2,
              ceil_mode=True),
        _pool("pool2d-max-alexnet", (2, 2, 13, 13), mode="max", kernel=3, stride=2),
        _pool("pool2d-avg", (2, 3, 8, 8), mode="avg", kernel=3, stride=2, padding=1),
        _pool("pool2d-avg-exclude-pad", (2, 3, 8, 8), mode="avg", kernel=3, stride=1, padding=1,
              count_include_pad=False),
        _pool("pool2d-avg-ceil", (1, 2, 10, 10), mode="avg", kernel=3, stride=2, padding=1, ceil_mode=True),
        Case(id="adaptive_pool2d-avg", kind="adaptive_pool2d", inputs=(_rand(2, 4, 7, 7),),
             attrs={"mode": "avg", "output_size": [3, 3]},
             reference=lambda x: F.adaptive_avg_pool2d(x, (3, 3))),
        Case(id="adaptive_pool2d-max", kind="adaptive_pool2d", inputs=(_rand(2, 4, 7, 7),),
             attrs={"mode": "max", "output_size": [2, 3]},
             reference=lambda x: F.adaptive_max_pool2d(x, (2, 3))),
        Case(id="binary-add-broadcast", kind="binary", inputs=(_rand(4, 1, 6), _rand(3, 1, seed=1)),
             attrs={"fn": "add"}, reference=torch.add),
        Case(id="binary-mul-param", kind="binary", inputs=(_rand(4, 5),), params={"other": _rand(5, seed=1)},
             attrs={"fn": "mul", "param_operand": 1}, reference=lambda x, other: x * other),
        Case(id="binary-sub-param-first", kind="binary", inputs=(_rand(4, 5),),
             params={"other": _rand(4, 1, seed=1)}, attrs={"fn": "sub", "param_operand": 0},
             reference=lambda x, other: other - x),
        Case(id="binary-maximum", kind="binary", inputs=(_rand(4, 6), _rand(1, 6, seed=1)),
             attrs={"fn": "maximum"}, reference=torch.maximum),
        Case(id="binary-minimum", kind="binary", inputs=(_rand(4, 6), _rand(4, 6, seed=1)),
             attrs={"fn": "minimum"}, reference=torch.minimum),
        Case(id="binary-div", kind="binary", inputs=(_rand(4, 6), _rand(4, 6, seed=1).abs() + 1),
             attrs={"fn": "div"}, reference=torch.div),
        Case(id="binary-masked_fill", kind="binary", inputs=(_rand(2, 3, 5, 5), mask),
             attrs={"fn": "masked_fill", "value": -1e9},
             reference=lambda a, m: a.masked_fill(m, -1e9)),
        # T5's position bias [1, heads, T, T] kept where the mask [N, 1, T, T] is true: both operands broadcast
        Case(id="binary-where", kind="binary", inputs=(_rand(1, 3, 5, 5), torch.rand(2, 1, 5, 5) > 0.3),
             attrs={"fn": "where", "value": -3.0}, reference=lambda a, m: torch.where(m, a, -3.0)),
        Case(id="reduce-sum", kind="reduce", inputs=(_rand(4, 5, 6),), attrs={"fn": "sum", "axes": [1]},
             reference=lambda x: x.sum(1)),
        # the reductions whose parts do not add up: their reduced axes stay whole
        Case(id="reduce-amax", kind="reduce", inputs=(_rand(4, 5, 6),), attrs={"fn": "amax", "axes": [1, 2]},
             reference=lambda x: x.amax((1, 2))),
        Case(id="reduce-max-values", kind="reduce", inputs=(_rand(4, 5, 6),),
             attrs={"fn": "max", "axes": [2], "keepdim": True}, reference=lambda x: x.max(2, keepdim=True).values),
        Case(id="reduce-norm", kind="reduce", inputs=(_rand(4, 5, 6),),
             attrs={"fn": "norm", "axes": [2], "keepdim": True, "ord": 2.0},
             reference=lambda x: torch.linalg.vector_norm(x, dim=2, keepdim=True)),
        Case(id="reduce-var", kind="reduce", inputs=(_rand(4, 5, 6),),
             attrs={"fn": "var", "axes": [2], "correction": 0.0}, reference=lambda x: x.var(2, correction=0)),
        Case(id="reduce-std", kind="reduce", inputs=(_rand(4, 5, 6),),
             attrs={"fn": "std", "axes": [1], "correction": 1.0}, reference=lambda x: x.std(1)),
        Case(id="reduce-logsumexp", kind="reduce", inputs=(_rand(4, 5, 6),),
             attrs={"fn": "logsumexp", "axes": [2], "keepdim": True}, reference=lambda x: x.logsumexp(2, keepdim=True)),
        Case(id="reduce-mean-keepdim", kind="reduce", inputs=(_rand(4, 5, 6),),
             attrs={"fn": "mean", "axes": [0, -1], "keepdim": True},
             reference=lambda x: x.mean((0, -1), keepdim=True)),
        Case(id="reduce-mean-all", kind="reduce", inputs=(_rand(4, 6),), attrs={"fn": "mean", "axes": []},
             reference=lambda x: x.mean()),
        Case(id="concat", kind="concat", inputs=(_rand(4, 2, 3), _rand(4, 5, 3, seed=1)), attrs={"axis": 1},
             reference=lambda a, b: torch.cat([a, b], 1)),
        Case(id="concat-legacy-empty", kind="concat", inputs=(_rand(0), _rand(4, 3, seed=1)), attrs={"axis": 1},
             reference=lambda e, x: torch.cat([e, x], 1)),
        Case(id="stack", kind="stack", inputs=(_rand(4, 3), _rand(4, 3, seed=1), _rand(4, 3, seed=2)),
             attrs={"axis": 1}, reference=lambda a, b, c: torch.stack([a, b, c], 1)),
        Case(id="expand", kind="expand", inputs=(_rand(2, 1, 3, 1),), attrs={"shape": [2, 4, 3, 6]},
             reference=lambda x: x.expand(2, 4, 3, 6)),
        Case(id="expand-new-axes", kind="expand", inputs=(_rand(3, 1),), attrs={"shape": [2, 3, 4]},
             reference=lambda x: x.expand(2, 3, 4)),
        Case(id="repeat", kind="repeat", inputs=(_rand(2, 3, 4),), attrs={"axis": 1, "repeats": 2},
             reference=lambda x: x.repeat_interleave(2, dim=1)),
        Case(id="split", kind="split", inputs=(_rand(4, 6, 12),), attrs={"axis": -1, "sizes": [4, 4, 4]},
             reference=lambda x: tuple(x.split(4, -1))),
        Case(id="split-uneven", kind="split", inputs=(_rand(4, 5, 2),), attrs={"axis": 1, "sizes": [2, 3]},
             reference=lambda x: tuple(x.split([2, 3], 1))),
        Case(id="slice-step", kind="slice", inputs=(_rand(4, 7, 6),),
             attrs={"axis": 1, "start": 1, "stop": 6, "step": 2, "squeeze": False},
             reference=lambda x: x[:, 1:6:2]),
        Case(id="slice-select-last", kind="slice", inputs=(_rand(4, 7, 6),),
             attrs={"axis": 1, "start": -1, "stop": None, "step": 1, "squeeze": True},
             reference=lambda x: x[:, -1]),
        Case(id="reshape-heads", kind="reshape", inputs=(_rand(4, 6, 8),), attrs={"shape": [4, 6, 2, 4]},
             reference=lambda x: x.reshape(4, 6, 2, 4)),
        Case(id="reshape-flatten", kind="reshape", inputs=(_rand(4, 3, 2, 2),), attrs={"shape": [4, 12]},
             reference=lambda x: x.reshape(4, 12)),
        Case(id="reshape-no-common-radix", kind="reshape", inputs=(_rand(2, 4, 6),),
             attrs={"shape": [2, 6, 4]}, reference=lambda x: x.reshape(2, 6, 4)),
        Case(id="reshape-merge-batch", kind="reshape", inputs=(_rand(4, 3, 5),), attrs={"shape": [12, 5]},
             reference=lambda x: x.reshape(12, 5)),
        Case(id="transpose", kind="transpose", inputs=(_rand(4, 3, 5, 2),), attrs={"perm": [0, 2, 1, 3]},
             reference=lambda x: x.permute(0, 2, 1, 3)),
        Case(id="softmax", kind="softmax", inputs=(_rand(4, 5, 6),), attrs={"axis": -1, "log": False},
             reference=lambda x: F.softmax(x, -1)),
        Case(id="softmax-log", kind="softmax", inputs=(_rand(4, 5, 6),), attrs={"axis": 1, "log": True},
             reference=lambda x: F.log_softmax(x, 1)),
        Case(id="dropout", kind="dropout", inputs=(_rand(4, 6, 5),), attrs={"p": 0.3, "seed": 7}),
        Case(id="dropout-feature", kind="dropout", inputs=(_rand(4, 6, 5, 3),),
             attrs={"p": 0.3, "seed": 7, "feature": True}),
        Case(id="roll", kind="roll", inputs=(_rand(3, 7, 6, 2),), attrs={"shifts": [-3, 2], "axes": [1, 2]},
             reference=lambda x: x.roll((-3, 2), (1, 2))),
        Case(id="pad", kind="pad", inputs=(_rand(3, 4, 5, 2),), attrs={"pad": [0, 1, 2, 3, 1, 0], "value": 0.5},
             reference=lambda x: F.pad(x, [0, 1, 2, 3, 1, 0], value=0.5)),
        Case(id="pad-crop", kind="pad", inputs=(_rand(3, 6, 5),), attrs={"pad": [-1, 4, 2, -2], "value": None},
             reference=lambda x: F.pad(x, [-1, 4, 2, -2])),
        Case(id="random", kind="random", inputs=(), attrs={"seed": 3}, like=torch.empty(4, 3, 5, dtype=DTYPE)),
        Case(id="random-normal", kind="random", inputs=(), attrs={"seed": 3, "normal": True},
             like=torch.empty(4, 3, 5, dtype=DTYPE)),
        Case(id="flip", kind="flip", inputs=(_rand(4, 6, 5),), attrs={"axes": [1, 2]},
             reference=lambda x: x.flip([1, 2])),
        Case(id="prelu", kind="prelu", inputs=(_rand(4, 6, 3, 2),), params={"weight": _rand(6, seed=2)},
             reference=lambda x, weight: F.prelu(x, weight)),
        Case(id="prelu-one", kind="prelu", inputs=(_rand(4, 6),), params={"weight": _rand(1, seed=2)},
             reference=lambda x, weight: F.prelu(x, weight)),
        Case(id="topk", kind="topk", inputs=(_rand(6, 3, 8),), attrs={"k": 3, "axis": 2},
             reference=lambda x: torch.topk(x, 3, dim=2)),
        Case(id="topk-smallest-axis1", kind="topk", inputs=(_rand(6, 8, 4),),
             attrs={"k": 2, "axis": 1, "largest": False},
             reference=lambda x: torch.topk(x, 2, dim=1, largest=False)),
        # Mixtral's experts: 4 experts, each token routed to 2, gated
        Case(id="experts-gated", kind="experts",
             inputs=(_rand(8, 6), _routed(8, 4, 2), _rand(8, 2, seed=3).softmax(-1)),
             params={"w_gate": _rand(4, 4, 6, seed=4), "w_up": _rand(4, 4, 6, seed=8), "w_out": _rand(4, 6, 4, seed=5)},
             attrs={"act": "silu", "transposed": False},
             reference=lambda x, i, w, w_gate, w_up, w_out: _dense_experts(x, i, w, w_gate, w_up, w_out, act=F.silu,
                                                                          transposed=False)),
        # weights stored [E, in, out], with biases, no gate (GPT-style experts), top-1 of 2
        Case(id="experts-transposed-biased", kind="experts",
             inputs=(_rand(6, 4), _routed(6, 2, 1), _rand(6, 1, seed=3)),
             params={"w_up": _rand(2, 4, 6, seed=4), "w_out": _rand(2, 6, 4, seed=5), "b_up": _rand(2, 6, seed=6),
                     "b_out": _rand(2, 4, seed=7)},
             attrs={"act": "gelu_tanh", "transposed": True},
             reference=lambda x, i, w, w_up, w_out, b_up, b_out: _dense_experts(
                 x, i, w, None, w_up, w_out, None, b_up, b_out, act=lambda v: F.gelu(v, approximate="tanh"),
                 transposed=True)),
        # gated, transposed, every bias
        Case(id="experts-gated-transposed-biased", kind="experts",
             inputs=(_rand(4, 4), _routed(4, 2, 2), _rand(4, 2, seed=3)),
             params={"w_gate": _rand(2, 4, 2, seed=4), "w_up": _rand(2, 4, 2, seed=8), "w_out": _rand(2, 2, 4, seed=5),
                     "b_gate": _rand(2, 2, seed=9), "b_up": _rand(2, 2, seed=6), "b_out": _rand(2, 4, seed=7)},
             attrs={"act": "relu", "transposed": True},
             reference=lambda x, i, w, w_gate, w_up, w_out, b_gate, b_up, b_out: _dense_experts(
                 x, i, w, w_gate, w_up, w_out, b_gate, b_up, b_out, act=F.relu, transposed=True)),
        Case(id="loss-cross_entropy", kind="loss", inputs=(_rand(8, 5), _ints(5, 8)),
             attrs={"fn": "cross_entropy", "reduction": "mean"}, reference=F.cross_entropy),
        Case(id="loss-cross_entropy-nd", kind="loss", inputs=(_rand(4, 5, 6), _ints(5, 4, 6)),
             attrs={"fn": "cross_entropy", "reduction": "mean"}, reference=F.cross_entropy),
        Case(id="loss-mse", kind="loss", inputs=(_rand(8, 6), _rand(8, 6, seed=1)),
             attrs={"fn": "mse", "reduction": "mean"}, reference=F.mse_loss),
        # ignored targets (padding, -100 by default) are left out of the mean's count, which every part
        # takes from the whole target; label smoothing adds each sample's mean over classes
        Case(id="loss-cross_entropy-ignored-smoothed", kind="loss", inputs=(_rand(4, 5, 6), _ignoring(5, 4, 6)),
             attrs={"fn": "cross_entropy", "reduction": "mean", "ignore_index": -100, "label_smoothing": 0.1},
             reference=lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1)),
        # class weights: the mean divides by the sum of the counted targets' weights
        Case(id="loss-cross_entropy-weighted", kind="loss",
             inputs=(_rand(4, 5, 6), _ignoring(5, 4, 6), _rand(5, seed=4).abs() + 0.5),
             attrs={"fn": "cross_entropy", "reduction": "mean", "label_smoothing": 0.1},
             reference=lambda x, t, w: F.cross_entropy(x, t, weight=w.detach(), label_smoothing=0.1)),
        Case(id="loss-cross_entropy-ignore-3-sum", kind="loss", inputs=(_rand(8, 5), _ints(5, 8)),
             attrs={"fn": "cross_entropy", "reduction": "sum", "ignore_index": 3, "label_smoothing": 0.0},
             reference=lambda x, t: F.cross_entropy(x, t, ignore_index=3, reduction="sum")),
        Case(id="loss-mse-sum", kind="loss", inputs=(_rand(8, 6), _rand(8, 6, seed=1)),
             attrs={"fn": "mse", "reduction": "sum"}, reference=lambda x, t: F.mse_loss(x, t, reduction="sum")),
    ]
    for fn, extra, ref in [
        ("relu", {}, F.relu), ("gelu", {"approximate": "tanh"}, lambda x: F.gelu(x, approximate="tanh")),
        ("tanh", {}, torch.tanh), ("sigmoid", {}, torch.sigmoid), ("silu", {}, F.silu),
        ("neg", {}, torch.neg), ("exp", {}, torch.exp), ("rsqrt", {}, torch.rsqrt),
        ("identity", {}, lambda x: x * 1),
        ("scale", {"scalar": 0.5}, lambda x: x * 0.5), ("add_scalar", {"scalar": 2.0}, lambda x: x + 2.0),
        ("pow_scalar", {"scalar": 2.0}, lambda x: x ** 2.0),
        ("rsub_scalar", {"scalar": 1.0}, lambda x: 1.0 - x),
        # the aten pointwise ops kept by name (`POINTWISE_FNS`), against the torch.nn modules users write
        ("leaky_relu", {"negative_slope": 0.2}, nn.LeakyReLU(0.2)),
        ("hardtanh", {"min_val": 0.0, "max_val": 6.0}, nn.ReLU6()),
        ("elu", {"alpha": 0.5, "scale": 1.0, "input_scale": 1.0}, nn.ELU(0.5)),
        ("celu", {"alpha": 0.7}, nn.CELU(0.7)), ("softplus", {"beta": 2.0, "threshold": 1.0}, nn.Softplus(2.0, 1.0)),
        ("selu", {}, nn.SELU()), ("mish", {}, nn.Mish()), ("hardswish", {}, nn.Hardswish()),
        ("hardsigmoid", {}, nn.Hardsigmoid()), ("abs", {}, torch.abs), ("sqrt", {}, torch.sqrt),
        ("log", {}, torch.log), ("sin", {}, torch.sin), ("cos", {}, torch.cos), ("reciprocal", {}, torch.reciprocal),
        ("erf", {}, torch.erf), ("floor", {}, torch.floor), ("ceil", {}, torch.ceil), ("trunc", {}, torch.trunc),
        ("sign", {}, torch.sign), ("square", {}, torch.square),
        ("clamp", {"min": -0.5, "max": 0.8}, lambda x: x.clamp(-0.5, 0.8)),
        ("clamp_min", {"min": 1e-3}, lambda x: x.clamp_min(1e-3)),
        ("clamp_max", {"max": 0.2}, lambda x: x.clamp_max(0.2)),
    ]:
        x = _rand(4, 6).abs() + 0.5 if fn in ("rsqrt", "sqrt", "log", "reciprocal") else _rand(4, 6)
        x = x * 3 if fn in POINTWISE_FNS and x.min() < 0 else x  # across the kinks (ReLU6's 6, softplus's 1)
        cases.append(Case(id=f"elementwise-{fn}", kind="elementwise", inputs=(x,),
                          attrs={"fn": fn, **extra}, reference=ref))
    return cases


CASES = _cases()
SOURCE_OPS = [
    Operator(name="op_input", kind="input", outputs=(TensorSpec(shape=(8, 6)),),
             attrs={"position": 0, "role": "input"}),
    Operator(name="op_constant", kind="constant", outputs=(TensorSpec(shape=(1, 1, 4, 4)),),
             attrs={"fqn": "mask"}),
    Operator(name="op_opaque", kind="opaque", inputs=(TensorRef(op="x0"),),
             outputs=(TensorSpec(shape=(4, 5)),),
             attrs={"target": "torch.cumsum", "args": [{"input": 0}, 1], "input_shapes": [[4, 5]]}),
]
ALL_OPS = [c.op() for c in CASES] + SOURCE_OPS


def test_every_kind_is_covered():
    documented = {"input", "constant", "conv2d", "conv1d", "conv_transpose2d", "linear", "matmul", "batchnorm",
                  "layernorm", "groupnorm", "rmsnorm", "embedding", "lstm", "gru", "rnn", "attention", "pool2d",
                  "upsample", "adaptive_pool2d", "elementwise", "binary", "reduce", "concat", "stack", "split",
                  "slice", "reshape", "expand", "repeat", "transpose", "flip", "roll", "pad", "prelu", "softmax",
                  "topk", "random", "dropout", "loss", "experts", "opaque"}
    assert set(REGISTRY) == documented
    assert {op.kind for op in ALL_OPS} == documented
    for kind, entry in REGISTRY.items():
        assert entry.kind == kind and "dims" in (type(entry).__doc__ or ""), kind
    covered = {c.attrs["fn"] for c in CASES if c.kind == "elementwise"}
    assert set(POINTWISE_FNS) <= covered, set(POINTWISE_FNS) - covered


# ---------------------------------------------------------------- configs


def _degree_sets(op: Operator) -> list[dict[str, int]]:
    """A few degrees per splittable dim and a couple of pairs of dims, those the entry allows."""
    dims = [d for d in dims_of(op) if d.splittable and d.size > 1]
    out: list[dict[str, int]] = []
    for d in dims:
        out += [{d.name: g} for g in [g for g in (2, 3, 4, d.size) if d.size % g == 0 and g > 1][:3]]
    for a, b in list(itertools.combinations(dims, 2))[:4]:
        ga = next((g for g in (2, 3) if a.size % g == 0), None)
        gb = next((g for g in (2, 3) if b.size % g == 0), None)
        if ga and gb:
            out.append({a.name: ga, b.name: gb})
    unique = {tuple(sorted(d.items())): d for d in out}.values()
    return [d for d in unique if op_def(op.kind).check(op, d) is None]


def _parts(op: Operator, degrees: dict[str, int]) -> list[Box]:
    n = math.prod(degrees.values())
    carried = math.prod(degrees.get(d.name, 1) for d in dims_of(op) if d.carried)
    # the chunks along a carried dim run on one device
    cfg = ParallelConfig(degrees=degrees, devices=tuple(range(n)))
    cfg = cfg.replace(devices=tuple(d // carried for d in cfg.devices))
    validate(op, cfg, num_devices=n)
    return [box for box, _ in parts(op, cfg)]


def _index(region: Region) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in region)


def _op_id(op: Operator) -> str:
    return op.name.removeprefix("op_")


# ---------------------------------------------------------------- (1) regions tile the outputs


@pytest.mark.parametrize("op", ALL_OPS, ids=_op_id)
def test_output_regions_tile(op):
    entry = op_def(op.kind)
    dims = dims_of(op)
    for degrees in [{}, *_degree_sets(op)]:
        boxes = _parts(op, degrees)
        repeats = math.prod(degrees.get(d.name, 1) for d in dims if d.out_axis is None)
        for index, spec in enumerate(op.outputs):
            count = np.zeros(spec.shape, dtype=np.int64)
            by_rest: dict[tuple, set] = {}
            for box in boxes:
                region = entry.output_region(op, box, index)
                assert len(region) == len(spec.shape)
                assert all(0 <= lo < hi <= s for (lo, hi), s in zip(region, spec.shape, strict=True)), region
                count[_index(region)] += 1
                rest = tuple(rng for d, rng in zip(dims, box, strict=True) if d.out_axis is not None)
                by_rest.setdefault(rest, set()).add(region)
            assert (count == repeats).all(), (degrees, index)
            # parts that differ only along dims without an output axis produce the same region
            assert all(len(regions) == 1 for regions in by_rest.values()), degrees
            assert entry.reduced(op, boxes[0]) == (repeats > 1)


# ---------------------------------------------------------------- (2) parts stitch to the reference


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(t.is_floating_point())


def _stitch(case: Case, op: Operator, boxes: list[Box], inputs, params, buffers) -> list[torch.Tensor]:
    entry = op_def(op.kind)
    outs = [torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype)) for spec in op.outputs]
    # a cross-entropy mean's parts divide by the count over the whole target, which the runtime hands them
    counted = target_count(inputs[1].detach(), int(op.attrs.get("ignore_index", -100)),
                           inputs[2].detach() if len(inputs) > 2 else None) if counts_targets(op) else None
    for box in boxes:
        regions = entry.input_regions(op, box)
        assert len(regions) == len(inputs)
        part_inputs = [None if r is None else x[_index(r)] for x, r in zip(inputs, regions, strict=True)]
        part_params = {k: params[k][_index(r)] for k, r in entry.param_regions(op, box).items()}
        part_buffers = {k: buffers[k][_index(r)] for k, r in entry.buffer_regions(op, box).items()}
        results = compute_part(op, box, part_inputs, part_params, training=case.training,
                               buffers=part_buffers, counted=counted)
        assert len(results) == len(op.outputs)
        for i, y in enumerate(results):
            region = entry.output_region(op, box, i)
            if region:
                outs[i] = outs[i].index_put(_region_indices(region), y, accumulate=True)
            else:
                outs[i] = outs[i] + y
    return outs


def _region_indices(region: Region) -> tuple[torch.Tensor, ...]:
    return torch.meshgrid(*[torch.arange(lo, hi) for lo, hi in region], indexing="ij")


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = float(want.detach().abs().max()) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(scale, 1e-12), msg=what)


def _grads(outs, leaves, seed: int = 9):
    weights = [_rand(*o.shape, seed=seed + i) if o.ndim else torch.tensor(1.5, dtype=DTYPE)
               for i, o in enumerate(outs)]
    total = sum((o * w).sum() for o, w in zip(outs, weights, strict=True))
    wanted = [t for t in leaves if t.requires_grad]
    return torch.autograd.grad(total, wanted, allow_unused=True) if wanted else ()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_parts_stitch_to_reference(case):
    op = case.op()
    torch.manual_seed(0)
    buffers = {k: v.clone() for k, v in case.buffers.items()}
    inputs = [_leaf(x) for x in case.inputs]
    params = {k: _leaf(v) for k, v in case.params.items()}
    full = _stitch(case, op, [full_box(dims_of(op))], inputs, params, buffers)
    if case.reference is not None:
        ref = case.reference_outputs(inputs, params)
        for i, (got, want) in enumerate(zip(full, ref, strict=True)):
            _assert_close(got, want, f"{case.id}: full box, output {i}")
    want_grads = _grads(full, [*inputs, *params.values()])
    configs = _degree_sets(op)
    assert configs or not any(d.splittable and d.size > 1 for d in dims_of(op))
    local_stats = case.kind == "batchnorm" and case.training
    for degrees in configs:
        if local_stats and "sample" in degrees:
            continue  # local statistics: tested against per-chunk batch norm below
        outs = _stitch(case, op, _parts(op, degrees), inputs, params, buffers)
        for i, (got, want) in enumerate(zip(outs, full, strict=True)):
            _assert_close(got, want, f"{case.id} {degrees}: output {i}")
        for j, (got, want) in enumerate(zip(_grads(outs, [*inputs, *params.values()]), want_grads,
                                            strict=True)):
            if want is not None:
                _assert_close(got, want, f"{case.id} {degrees}: gradient {j}")


def test_batchnorm_sample_split_uses_local_statistics():
    case = next(c for c in CASES if c.id == "batchnorm1d-train")
    op = case.op()
    x, w, b = case.inputs[0], case.params["weight"], case.params["bias"]
    outs = _stitch(case, op, _parts(op, {"sample": 2, "channels": 2}), [x], dict(case.params), {})
    want = torch.cat([F.batch_norm(chunk, None, None, w, b, training=True) for chunk in x.chunk(2)])
    _assert_close(outs[0], want, "batchnorm sample split")


def test_batchnorm_updates_running_statistics_of_its_channels():
    x = _rand(8, 4, 3, 3)
    op = Operator(name="bn", kind="batchnorm", inputs=(TensorRef(op="x"),),
                  outputs=(TensorSpec(shape=x.shape, dtype="float64"),),
                  params={"weight": ParamSpec(shape=(4,), fqn="bn.weight"),
                          "bias": ParamSpec(shape=(4,), fqn="bn.bias")},
                  attrs={"eps": 1e-5, "momentum": 0.1, "running_mean": "bn.running_mean",
                         "running_var": "bn.running_var", "input_shapes": [list(x.shape)]})
    mean, var = torch.zeros(4, dtype=DTYPE), torch.ones(4, dtype=DTYPE)
    entry = op_def("batchnorm")
    for box in _parts(op, {"channels": 2}):
        bufs = {k: {"running_mean": mean, "running_var": var}[k][_index(r)]
                for k, r in entry.buffer_regions(op, box).items()}
        sl = _index(entry.param_regions(op, box)["weight"])
        compute_part(op, box, [x[_index(entry.input_regions(op, box)[0])]],
                     {"weight": torch.ones(4, dtype=DTYPE)[sl], "bias": torch.zeros(4, dtype=DTYPE)[sl]},
                     buffers=bufs)
    want_mean, want_var = torch.zeros(4, dtype=DTYPE), torch.ones(4, dtype=DTYPE)
    F.batch_norm(x, want_mean, want_var, training=True, momentum=0.1)
    _assert_close(mean, want_mean, "running mean")
    _assert_close(var, want_var, "running var")


def test_dropout_mask_is_the_same_for_every_split_and_changes_per_step():
    x = torch.ones(64, 50, dtype=DTYPE)
    op = Operator(name="drop", kind="dropout", inputs=(TensorRef(op="x"),),
                  outputs=(TensorSpec(shape=(64, 50), dtype="float64"),), attrs={"p": 0.25, "seed": 3})
    full = compute_part(op, ((0, 64), (0, 50)), [x], {})[0]
    dropped = float((full == 0).double().mean())
    assert abs(dropped - 0.25) < 0.03
    assert set(full.unique().tolist()) == {0.0, 1 / 0.75}
    top = compute_part(op, ((0, 32), (10, 50)), [x[:32, 10:]], {})[0]
    assert torch.equal(top, full[:32, 10:])
    other_step = compute_part(op, ((0, 64), (0, 50)), [x], {}, step=1)[0]
    assert not torch.equal(other_step, full)
    assert torch.equal(compute_part(op, ((0, 64), (0, 50)), [x], {}, training=False)[0], x)
    keep = dropout_keep(((0, 2),), (2,), p=0.0, seed=0, step=0)
    assert keep.all()


def test_random_draws_are_uniform_the_same_for_every_split_and_the_references():
    """A ``random`` op draws values in [0, 1) with mean about 1/2 (standard normal ones with ``normal``),
    the same for every split, new each step; the verifying reference's ``torch.rand`` and ``torch.randn_like``
    (`runtime.train`) draw the values of the op of their seed."""
    from runtime.train import _RuntimeDropout

    op = Operator(name="draw", kind="random", inputs=(), outputs=(TensorSpec(shape=(64, 1, 50), dtype="float32"),),
                  attrs={"seed": 1})
    full = compute_part(op, full_box(dims_of(op)), [], {}, step=2)[0]
    assert full.dtype == torch.float32 and 0 <= float(full.min()) and float(full.max()) < 1
    assert abs(float(full.double().mean()) - 0.5) < 0.03
    assert torch.equal(compute_part(op, ((8, 40), (0, 1), (10, 50)), [], {}, step=2)[0], full[8:40, :, 10:])
    assert not torch.equal(compute_part(op, full_box(dims_of(op)), [], {}, step=3)[0], full)
    normal = Operator(name="noise", kind="random", inputs=(),
                      outputs=(TensorSpec(shape=(64, 1, 50), dtype="float32"),), attrs={"seed": 2, "normal": True})
    noise = compute_part(normal, full_box(dims_of(normal)), [], {}, step=2)[0]
    assert abs(float(noise.double().mean())) < 0.05 and abs(float(noise.double().std()) - 1) < 0.05
    with _RuntimeDropout(num_ops=0, masked=False, step=2, num_draws=3):
        first, second, third = torch.rand(3), torch.rand((64, 1, 50)), torch.randn_like(full)
    assert first.shape == (3,) and torch.equal(second, full) and torch.equal(third, noise)


def test_feature_dropout_keeps_or_drops_whole_channels():
    """``feature``: each (sample, channel) is kept or dropped whole, the same for every split."""
    x = torch.ones(16, 24, 5, 3, dtype=DTYPE)
    op = Operator(name="drop", kind="dropout", inputs=(TensorRef(op="x"),),
                  outputs=(TensorSpec(shape=(16, 24, 5, 3), dtype="float64"),),
                  attrs={"p": 0.25, "seed": 3, "feature": True})
    full = compute_part(op, full_box(dims_of(op)), [x], {})[0]
    per_channel = full.flatten(2)
    assert torch.equal(per_channel.amin(2), per_channel.amax(2))  # whole channels
    assert 0.1 < float((full[:, :, 0, 0] == 0).double().mean()) < 0.4
    part = compute_part(op, ((4, 12), (6, 24), (1, 4), (0, 3)), [x[4:12, 6:, 1:4]], {})[0]
    assert torch.equal(part, full[4:12, 6:, 1:4])


# ---------------------------------------------------------------- (3) dims that cannot be split


def _unsplittable(op: Operator) -> list[tuple[str, int]]:
    out = []
    for d in dims_of(op):
        if not d.splittable and not d.carried and d.size > 1:
            out.append((d.name, next(g for g in range(2, d.size + 1) if d.size % g == 0)))
    return out


UNSPLITTABLE = [(op, name, g) for op in ALL_OPS for name, g in _unsplittable(op)]


@pytest.mark.parametrize(("op", "dim", "degree"), UNSPLITTABLE,
                         ids=[f"{_op_id(op)}-{dim}" for op, dim, _ in UNSPLITTABLE])
def test_unsplittable_dims_are_refused(op, dim, degree):
    cfg = ParallelConfig(degrees={dim: degree}, devices=tuple(range(degree)))
    with pytest.raises(ConfigError) as info:
        validate(op, cfg, num_devices=degree)
    assert repr(op.name) in str(info.value) and repr(dim) in str(info.value)


def test_unsplittable_dims_of_documented_kinds():
    expected = {
        "lstm": {"seq", "hidden"}, "gru": {"seq", "hidden"}, "rnn-tanh": {"seq", "hidden"},
        "rnn-relu": {"seq", "hidden"}, "attention-causal": {"head_dim"}, "attention-gqa": {"head_dim"},
        "rmsnorm": {"d2"}, "rmsnorm-2d-no-weight": {"d1", "d2"}, "stack": {"d1"}, "expand": set(),
        "repeat": set(), "linear-transposed": set(), "matmul-baddbmm": set(), "softmax": {"d2"},
        "softmax-log": {"d1"}, "layernorm": {"d2"}, "concat": {"d1"}, "split": {"d2"},
        "slice-step": {"d1"}, "slice-select-last": set(), "adaptive_pool2d-avg": {"d2", "d3"},
        "batchnorm-eval": {"d2", "d3"}, "loss-cross_entropy": {"classes"}, "loss-mse": set(),
        "conv2d-grouped": {"in_channels"}, "conv2d": set(), "opaque": {"sample", "d1"},
        "constant": {"d0", "d1", "d2", "d3"}, "input": set(),
    }
    ops = {_op_id(op): op for op in ALL_OPS}
    for op_id, names in expected.items():
        assert {d.name for d in dims_of(ops[op_id]) if not d.splittable} == names, op_id


# ---------------------------------------------------------------- (3b) carried dims: chunks in time


def _lstm_op() -> Operator:
    return next(op for op in ALL_OPS if _op_id(op) == "lstm")


@pytest.mark.parametrize("case_id", list(RECURRENT))
def test_recurrent_chunks_have_time_regions_and_only_the_last_holds_the_final_state(case_id):
    """Chunk k of a recurrent op (LSTM, GRU, RNN) split 2 x 5 (sample x seq) reads and writes time
    [k, k + 1); the final states (h_n, and c_n for the LSTM) are held by the last chunk of each sample
    range only; chunk k starts from chunk k - 1 of its range, which hands it h (and c) of every layer."""
    op = next(op for op in ALL_OPS if _op_id(op) == case_id)
    entry = op_def(op.kind)
    layers = op.attrs["num_layers"]
    assert [d.name for d in dims_of(op) if d.carried] == ["seq"]
    assert len(op.outputs) == (3 if op.kind == "lstm" else 2)
    boxes = _parts(op, {"sample": 2, "seq": 5})
    assert carry_sources(dims_of(op), {"sample": 2, "seq": 5}) == (None, 0, 1, 2, 3, None, 5, 6, 7, 8)
    assert carry_sources(dims_of(op), {"sample": 2}) == (None, None)
    for c, box in enumerate(boxes):
        s, k = divmod(c, 5)
        assert entry.output_region(op, box, 0) == ((2 * s, 2 * s + 2), (k, k + 1), (0, 6))
        assert entry.input_regions(op, box) == (((2 * s, 2 * s + 2), (k, k + 1), (0, 3)),)
        final = ((0, layers), (2 * s, 2 * s + 2), (0, 6)) if k == 4 else ((0, 0), (2 * s, 2 * s + 2), (0, 6))
        assert all(entry.output_region(op, box, i) == final for i in range(1, len(op.outputs)))
        assert entry.carry_shapes(op, box) == ((layers, 2, 6),) * (len(op.outputs) - 1)
        assert entry.carry_bytes(op, box) == (len(op.outputs) - 1) * layers * 2 * 6 * DTYPE_BYTES[op.outputs[0].dtype]


def test_chunks_may_run_on_any_devices_but_not_sharded():
    """The chunks of a sample range run on one device or on several (the state moves); a sharded op does
    not run in chunks (`carry_refusal`), even on distinct devices."""
    op = _lstm_op()
    validate(op, ParallelConfig(degrees={"seq": 5}, devices=(1,) * 5), num_devices=2)
    validate(op, ParallelConfig(degrees={"sample": 2, "seq": 5}, devices=(1,) * 5 + (0,) * 5), num_devices=2)
    validate(op, ParallelConfig(degrees={"seq": 5}, devices=(0, 0, 1, 1, 1)), num_devices=2)
    validate(op, ParallelConfig(degrees={"sample": 2, "seq": 5}, devices=(0, 1) * 5), num_devices=2)
    with pytest.raises(ConfigError, match="a sharded op .shard 5. cannot run in chunks along its carried dim"):
        validate(op, ParallelConfig(degrees={"seq": 5}, devices=(0, 1, 2, 3, 4), shard=5), num_devices=5)
    validate(op, ParallelConfig(degrees={"sample": 2}, devices=(0, 1), shard=2), num_devices=2)


@pytest.mark.parametrize("case_id", list(RECURRENT))
@pytest.mark.parametrize("degrees", [{"seq": 5}, {"sample": 2, "seq": 5}, {"sample": 4, "seq": 5}])
def test_recurrent_chunks_carrying_their_state_stitch_to_reference(degrees, case_id):
    """Each chunk starts from the final state of the one before it (`compute_chunk`): the outputs, the
    final states and every gradient equal the whole op's (LSTM, GRU, RNN; the whole op's equal torch's
    module, `test_parts_match_reference`); starting a chunk from zeros instead does not."""
    case = RECURRENT[case_id]()
    op = case.op()
    entry = op_def(op.kind)
    inputs = [_leaf(x) for x in case.inputs]
    params = {k: _leaf(v) for k, v in case.params.items()}
    full = _stitch(case, op, [full_box(dims_of(op))], inputs, params, {})
    want_grads = _grads(full, [*inputs, *params.values()])

    def stitched(carry: bool) -> list[torch.Tensor]:
        outs = [torch.zeros(spec.shape, dtype=DTYPE) for spec in op.outputs]
        finals: dict[int, tuple[torch.Tensor, ...]] = {}
        boxes = _parts(op, degrees)
        for c, (box, prev) in enumerate(zip(boxes, carry_sources(dims_of(op), degrees), strict=True)):
            (region,) = entry.input_regions(op, box)
            state = finals[prev] if carry and prev is not None else None
            results, finals[c] = compute_chunk(op, box, [inputs[0][_index(region)]], params, state=state)
            for i, y in enumerate(results):
                outs[i] = outs[i].index_put(_region_indices(entry.output_region(op, box, i)), y, accumulate=True)
        return outs

    outs = stitched(True)
    for i, (got, want) in enumerate(zip(outs, full, strict=True)):
        _assert_close(got, want, f"{degrees}: output {i}")
    for j, (got, want) in enumerate(zip(_grads(outs, [*inputs, *params.values()]), want_grads, strict=True)):
        _assert_close(got, want, f"{degrees}: gradient {j}")
    assert not torch.allclose(stitched(False)[0], full[0])


@pytest.mark.parametrize(("op_id", "degrees", "message"), [
    ("reshape-flatten", {"d1": 4}, "not a box of the input"),
    ("reshape-heads", {"d3": 2}, "not a box of the input"),
    ("reshape-no-common-radix", {"d1": 2}, "not a box of the input"),
])
def test_reshape_refuses_splits_whose_parts_are_not_input_boxes(op_id, degrees, message):
    op = next(op for op in ALL_OPS if _op_id(op) == op_id)
    with pytest.raises(ConfigError, match=message):
        validate(op, ParallelConfig(degrees=degrees, devices=tuple(range(math.prod(degrees.values())))))


def test_reshape_allows_aligned_splits():
    ops = {_op_id(op): op for op in ALL_OPS}
    assert op_def("reshape").check(ops["reshape-flatten"], {"d1": 3}) is None
    assert op_def("reshape").check(ops["reshape-heads"], {"d2": 2, "sample": 2}) is None
    assert op_def("reshape").check(ops["reshape-merge-batch"], {"sample": 4}) is None
    assert op_def("reshape").check(ops["reshape-merge-batch"], {"sample": 6}) is not None


def test_reshape_regions_match_brute_force():
    """Against numpy on random shape pairs: a region is returned only when it is exactly the input box
    holding the part's elements in the same order; refusals (None) are rare and only ever conservative."""
    rng = np.random.default_rng(0)

    def factors(total: int) -> list[int]:
        out = []
        while total > 1:
            d = int(rng.choice([d for d in range(2, total + 1) if total % d == 0]))
            out.append(d)
            total //= d
        if rng.random() < 0.3:
            out.insert(int(rng.integers(len(out) + 1)), 1)
        return out or [1]

    found = refused = 0
    for _ in range(1500):
        total = int(rng.choice([8, 12, 16, 24, 30, 36, 48]))
        in_shape, out_shape = factors(total), factors(total)
        box = []
        for size in out_shape:
            lo = int(rng.integers(size))
            box.append((0, size) if rng.random() < 0.4 else (lo, int(rng.integers(lo + 1, size + 1))))
        elements = np.arange(total).reshape(out_shape)[_index(tuple(box))].ravel()
        coords = np.unravel_index(elements, in_shape)
        bound = tuple((int(c.min()), int(c.max()) + 1) for c in coords)
        is_box = np.array_equal(np.arange(total).reshape(in_shape)[_index(bound)].ravel(), elements)
        got = reshape_region(in_shape, out_shape, tuple(box))
        if got is not None:
            assert is_box and got == bound, (in_shape, out_shape, box, got, bound)
            found += 1
        elif is_box:
            refused += 1
    assert refused < 0.1 * found


def test_grouped_conv_refuses_out_channel_chunks_that_straddle_groups():
    case = _conv("g", (2, 6, 4, 4), (6, 3, 3, 3), padding=1, groups=2)
    op = case.op()
    assert op_def("conv2d").check(op, {"out_channels": 2}) is None
    with pytest.raises(ConfigError, match="straddle"):
        validate(op, ParallelConfig(degrees={"out_channels": 3}, devices=(0, 1, 2)))


# ---------------------------------------------------------------- (4) halos


def test_conv_height_split_reads_a_halo():
    h = 8
    op = _conv("halo", (2, 3, h, h), (4, 3, 3, 3), padding=1).op()
    entry = op_def("conv2d")
    boxes = _parts(op, {"height": 2})
    rows = [entry.input_regions(op, box)[0][2] for box in boxes]
    assert rows == [(0, h // 2 + 1), (h // 2 - 1, h)]
    assert [entry.input_regions(op, box)[0][3] for box in boxes] == [(0, h), (0, h)]


def test_pool_width_split_reads_a_halo():
    case = next(c for c in CASES if c.id == "pool2d-max")
    op = case.op()
    boxes = _parts(op, {"width": 2})
    assert [op_def("pool2d").input_regions(op, box)[0][3] for box in boxes] == [(0, 4), (3, 8)]


# ---------------------------------------------------------------- kinds the runtime feeds itself


def test_sources_are_everywhere_and_read_nothing():
    # Buffers every process holds and the batch its loader reads where needed: no transfers feed ops.
    assert op_def("constant").everywhere and op_def("input").everywhere
    assert not op_def("linear").everywhere
    for op in SOURCE_OPS[:2]:
        assert op_def(op.kind).input_regions(op, full_box(dims_of(op))) == ()
        with pytest.raises(ValueError, match="no partitioned kernel"):
            compute_part(op, full_box(dims_of(op)), [], {})


def test_run_opaque_calls_the_target():
    op = SOURCE_OPS[2]
    x = _rand(4, 5)
    (y,) = run_opaque(op, None, [x])
    _assert_close(y, torch.cumsum(x, 1), "opaque function")
    module = torch.nn.Softplus()
    leaf = Operator(name="sp", kind="opaque", inputs=(TensorRef(op="x"),),
                    outputs=(TensorSpec(shape=(4, 5)),),
                    attrs={"target": "module", "input_shapes": [[4, 5]]})
    _assert_close(run_opaque(leaf, module, [x])[0], F.softplus(x), "opaque module")
    assert op_def("opaque").input_regions(op, full_box(dims_of(op))) == (((0, 4), (0, 5)),)
    # the encoding capture writes: an aten overload, a tensor argument, a dtype keyword
    aten = Operator(name="cs", kind="opaque", inputs=(TensorRef(op="x"),),
                    outputs=(TensorSpec(shape=(4, 5)),),
                    attrs={"target": "torch.ops.aten.cumsum.default", "args": [{"input": 0}, 0],
                           "kwargs": {"dtype": {"dtype": "float32"}}, "input_shapes": [[4, 5]]})
    (y,) = run_opaque(aten, None, [x])
    assert y.dtype == torch.float32
    _assert_close(y, torch.cumsum(x, 0).float(), "opaque aten op")


def test_missing_input_shapes_is_a_clear_error():
    op = Operator(name="l", kind="loss", inputs=(TensorRef(op="a"), TensorRef(op="b")),
                  outputs=(TensorSpec(shape=()),), attrs={"fn": "mse", "reduction": "mean"})
    with pytest.raises(ValueError, match="input_shapes"):
        dims_of(op)


# ---------------------------------------------------------------- attention


def test_grouped_query_attention_keeps_each_group_with_its_kv_head():
    q, kv = _rand(1, 6, 4, 2), _rand(1, 2, 4, 2, seed=1)
    op = Case(id="gqa", kind="attention", inputs=(q, kv, kv), attrs={"is_causal": False, "scale": None},
              reference=lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)).op()
    entry = op_def("attention")
    # groups of 3 query heads per kv head: parts of 3 heads hold one group, parts of 1 head lie in one
    assert entry.check(op, {"heads": 2}) is None and entry.check(op, {"heads": 6}) is None
    with pytest.raises(ConfigError, match="straddle"):
        validate(op, ParallelConfig(degrees={"heads": 3}, devices=(0, 1, 2)))
    boxes = _parts(op, {"heads": 6})
    assert [entry.input_regions(op, box)[1][1] for box in boxes] == [(0, 1)] * 3 + [(1, 2)] * 3
    assert [entry.input_regions(op, box)[1][1] for box in _parts(op, {"heads": 2})] == [(0, 1), (1, 2)]


def test_causal_attention_part_offsets_its_mask_by_its_first_query_row():
    """A part holding query rows [3, 6) sees keys [0, row] for each of its rows, as the whole op does; a
    mask starting at its own row 0 (SDPA's is_causal on the part) would hide keys those rows see."""
    case = next(c for c in CASES if c.id == "attention-causal")
    op = case.op()
    q, k, v = case.inputs
    box = ((0, 2), (0, 3), (3, 6), (0, 4))
    part = compute_part(op, box, [q[:, :, 3:6], k, v], {})[0]
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    _assert_close(part, whole[:, :, 3:6], "causal part")
    assert not torch.allclose(part, F.scaled_dot_product_attention(q[:, :, 3:6], k, v, is_causal=True))


def test_fused_attention_keeps_its_output_and_row_statistics_for_backward():
    """The step plan's activation bytes of an attention part are its output's and its rows' log-sum-exp
    (float32), never N x H x Tq x Tk scores; a causal part after the first keeps its rows of the mask."""
    from soap.lowering import lower
    from soap.setup import TrainSetup
    from soap.strategy import Strategy

    n, h, t, d = 2, 4, 64, 8
    spec = TensorSpec(shape=(n, h, t, d))
    shape = [n, h, t, d]
    ops = [Operator(name="x", kind="input", outputs=(spec,), attrs={"position": 0, "role": "input"}),
           Operator(name="e", kind="elementwise", inputs=(TensorRef(op="x"),), outputs=(spec,),
                    attrs={"fn": "identity"}),
           Operator(name="attn", kind="attention", inputs=(TensorRef(op="e"),) * 3, outputs=(spec,),
                    attrs={"is_causal": True, "scale": None, "input_shapes": [shape] * 3}),
           Operator(name="target", kind="input", outputs=(spec,), attrs={"position": 1, "role": "target"}),
           Operator(name="loss", kind="loss", inputs=(TensorRef(op="attn"), TensorRef(op="target")),
                    outputs=(TensorSpec(shape=()),), attrs={"fn": "mse", "reduction": "mean"})]
    graph = OperatorGraph(ops, batch_size=n)
    single = {op.name: ParallelConfig.single(0) for op in graph}
    for degrees in ({}, {"seq": 2}, {"heads": 2}):
        cfg = ParallelConfig(degrees=degrees, devices=tuple(range(max(1, len(degrees) * 2))))
        plan = lower(graph, Strategy({**single, "attn": cfg}), TrainSetup(), 2)
        step = plan.ops[graph.position("attn")]
        parts = len(step.activation_bytes)
        mask = [(box[2][0] > 0) * (box[2][1] - box[2][0]) * t * 4 for box in step.boxes]
        assert step.activation_bytes == tuple((spec.nbytes + n * h * t * 4) // parts + m for m in mask)
    assert op_def("attention").flops(graph["attn"]) == 2.0 * n * h * t * t * (d + d)


# ---------------------------------------------------------------- (5) memory facts agree with the kernels


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_output_is_view_says_what_the_kernel_returns(case):
    """An entry says its outputs are views exactly where the kernel returns views of input 0 (the memory
    model then counts no bytes for them), over the whole box and a split."""
    op = case.op()
    entry = op_def(op.kind)
    splits = [] if case.kind == "batchnorm" else _degree_sets(op)[:2]  # (one row per channel fails to train)
    for degrees in [{}, *splits]:
        for box in _parts(op, degrees):
            regions = entry.input_regions(op, box)
            inputs = [None if r is None else x[_index(r)] for x, r in zip(case.inputs, regions, strict=True)]
            params = {k: case.params[k][_index(r)] for k, r in entry.param_regions(op, box).items()}
            buffers = {k: case.buffers[k][_index(r)].clone() for k, r in entry.buffer_regions(op, box).items()}
            outs = compute_part(op, box, inputs, params, training=case.training, buffers=buffers)
            base = inputs[0].untyped_storage().data_ptr() if inputs and inputs[0] is not None else None
            views = [o.untyped_storage().data_ptr() == base for o in outs]
            assert all(views) == entry.output_is_view(op) and any(views) == all(views), (case.id, degrees)


def _saved_beyond(fn, tensors) -> int:
    """Bytes autograd saves for `fn(*tensors)`'s backward in storages that are neither its inputs nor its
    outputs (each storage once)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = fn(*leaves)
    known = {t.untyped_storage().data_ptr() for t in [*leaves, *(outs if isinstance(outs, tuple) else (outs,))]}
    return sum(n for p, n in seen.items() if p not in known)


def test_saved_bytes_are_what_autograd_saves_beyond_inputs_and_outputs():
    """Cross entropy keeps its log-probabilities, a max pool its int64 indices, dropout its mask and the
    fused attention its rows' log-sum-exp: what torch's autograd saves besides the op's own tensors, for
    the part boxes the registry gives. (The LSTM's figure is what its equations need; torch's kernels keep
    a workspace of their own size, so it is checked against the formula, not a kernel.)"""
    def op(kind, inputs, outputs, **attrs):
        return Operator(name=kind, kind=kind, inputs=tuple(TensorRef(op=f"x{i}") for i in range(len(inputs))),
                        outputs=tuple(TensorSpec(shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."))
                                      for t in outputs),
                        attrs={**attrs, "input_shapes": [list(t.shape) for t in inputs]})

    logits, target = _rand(6, 5, 3), torch.randint(0, 5, (6, 3))
    loss = op("loss", [logits, target], [torch.zeros((), dtype=DTYPE)], fn="cross_entropy", reduction="mean")
    x = _rand(2, 3, 8, 8)
    pool = op("pool2d", [x], [F.max_pool2d(x, 2)], mode="max", kernel=[2, 2], stride=[2, 2], padding=[0, 0])
    drop = op("dropout", [x], [x], p=0.25, seed=1)
    q = _rand(2, 4, 6, 8)
    attn = op("attention", [q, q, q], [q], is_causal=False, scale=None)
    causal = op("attention", [q, q, q], [q], is_causal=True, scale=None)
    keep = torch.rand(2, 1, 6, 6) > 0.3
    masked = op("attention", [q, q, q, keep], [q], is_causal=False, scale=None)
    for o, inputs in ((loss, [logits, target]), (pool, [x]), (drop, [x]), (attn, [q, q, q]), (causal, [q, q, q]),
                      (masked, [q, q, q, keep])):
        entry = op_def(o.kind)
        for degrees in [{}, *_degree_sets(o)[:2]]:
            for box in _parts(o, degrees):
                regions = entry.input_regions(o, box)
                parts_in = [t[_index(r)].contiguous() for t, r in zip(inputs, regions, strict=True)]
                got = _saved_beyond(lambda *ts, o=o, box=box: compute_part(o, box, list(ts), {}, training=True),
                                    parts_in)
                assert entry.saved_bytes(o, box) == got, (o.kind, degrees, box)
    assert op_def("dropout").saved_bytes(op("dropout", [x], [x], p=0.0), full_box(dims_of(drop))) == 0
    h = 16
    lstm = Operator(name="lstm", kind="lstm", inputs=(TensorRef(op="x0"),),
                    outputs=(TensorSpec(shape=(4, 5, h)), TensorSpec(shape=(2, 4, h)), TensorSpec(shape=(2, 4, h))),
                    params={"weight_ih_l0": ParamSpec(shape=(4 * h, 3), fqn="w")},
                    attrs={"hidden_size": h, "num_layers": 2, "input_shapes": [[4, 5, 3]]})
    # per step, sample and unit: 6 values in each of the 2 layers, and the first layer's output
    assert op_def("lstm").saved_bytes(lstm, ((0, 2), (0, 5), (0, h))) == (6 * 2 + 1) * 2 * 5 * h * 4
    # GRU: r, z, n and the hidden projection of n in each layer, and the first layer's output; RNN: the
    # first layer's output (tanh and relu read their outputs); per chunk in time, the chunk's steps
    for kind, per_step in (("gru", 4 * 2 + 1), ("rnn", 1)):
        rec = Operator(name=kind, kind=kind, inputs=(TensorRef(op="x0"),),
                       outputs=(TensorSpec(shape=(4, 5, h)), TensorSpec(shape=(2, 4, h))),
                       params={"weight_ih_l0": ParamSpec(shape=(h, 3), fqn="w")},
                       attrs={"hidden_size": h, "num_layers": 2, "input_shapes": [[4, 5, 3]]})
        assert op_def(kind).saved_bytes(rec, ((0, 2), (0, 5), (0, h))) == per_step * 2 * 5 * h * 4
        chunks = _parts(rec, {"sample": 2, "seq": 5})
        assert sum(op_def(kind).saved_bytes(rec, box) for box in chunks) == per_step * 4 * 5 * h * 4


def test_recurrent_flops_formulas():
    """Forward FLOPs per layer (I = H above the first): LSTM 8 N T H (I + H); GRU 6 N T H (I + H) plus
    10 N T H of elementwise; RNN 2 N T H (I + H); backward twice the forward (they have parameters).
    The examples: N 4, T 5, I 3, H 6."""
    ops = {_op_id(op): op for op in ALL_OPS}
    per_layer = [4 * 5 * 6 * (3 + 6), 4 * 5 * 6 * (6 + 6)]
    assert op_def("lstm").flops(ops["lstm"]) == 8 * sum(per_layer)
    assert op_def("gru").flops(ops["gru"]) == 6 * sum(per_layer) + 2 * 10 * 4 * 5 * 6
    assert op_def("rnn").flops(ops["rnn-tanh"]) == 2 * sum(per_layer)
    assert op_def("rnn").flops(ops["rnn-relu"]) == 2 * per_layer[0]
    for op in (ops["gru"], ops["rnn-tanh"]):
        fwd = op_def(op.kind).flops(op)
        assert op_def(op.kind).backward_flops(op, fwd) == 2 * fwd


def test_a_config_unpickled_in_another_process_hashes_as_that_process_makes_it():
    """A config keeps its hash (plan caches hash configs millions of times in a search), and a string's
    hash differs between processes: one pickled here and unpickled under another hash seed must equal and
    hash like the same config made there (spawned search workers and runtime ranks receive configs so)."""
    cfg = ParallelConfig(degrees={"sample": 2, "out_features": 2}, devices=(0, 1, 2, 3), recompute=True)
    script = ("import pickle, sys\n"
              "from soap.config import ParallelConfig\n"
              "got = pickle.loads(sys.stdin.buffer.read())\n"
              "made = ParallelConfig(degrees={'sample': 2, 'out_features': 2}, devices=(0, 1, 2, 3), recompute=True)\n"
              "print(got == made, hash(got) == hash(made), len({got, made}))\n")
    outs = set()
    for seed in ("1", "2"):
        run = subprocess.run([sys.executable, "-c", script], input=pickle.dumps(cfg), capture_output=True,
                             timeout=60, env={**os.environ, "PYTHONHASHSEED": seed}, check=True)
        outs.add(run.stdout.decode().strip())
    assert outs == {"True True 1"}


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case_id", ["layernorm", "rmsnorm", "softmax", "softmax-log"])
def test_norms_and_softmax_compute_half_precision_inputs_in_float32(case_id, half):
    """As autocast runs them: on the CPU (the RMS norm on any device) a half-precision input's norm or
    softmax is the float32 computation cast back to the input's dtype (the RMS norm before its weight, as
    Hugging Face's norms cast), so that an fp16 RMS norm of activations above 256, whose sum of squares
    overflows in fp16, stays finite."""
    case = next(c for c in CASES if c.id == case_id)
    x = case.inputs[0] * 300  # squares above fp16's largest number
    op = case.op()
    (got,) = compute_part(op, full_box(dims_of(op)), [x.to(half)], {k: v.to(half) for k, v in case.params.items()})
    assert got.dtype == half and bool(torch.isfinite(got).all())
    if case.kind == "rmsnorm":
        wide = x.to(half).float()
        y = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)).to(half)
        want = case.params["weight"].to(half) * y
    else:
        want, = case.reference_outputs([x.to(half).float()], {k: v.to(half).float() for k, v in case.params.items()})
        want = want.to(half)
    assert torch.equal(got, want), (got - want).abs().max()
