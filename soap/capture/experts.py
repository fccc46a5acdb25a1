"""Capture, stage 1 (with `tracing`): a Hugging Face mixture of experts traced as one ``experts`` call.

Hugging Face's sparse mixture-of-experts layers (Mixtral, Qwen-MoE, OLMoE, ...) keep their experts'
weights as stacked tensors, ``gate_up_proj`` [E, 2I, H] (or ``up_proj`` [E, I, H] without a gate) and
``down_proj`` [E, H, I], and route each token to its top-k experts. Their forward sorts the tokens by
expert and runs grouped matrix products whose row counts depend on the routing: traced, that is a sort,
a histogram, a cumulative sum, index gathers and a grouped product that torch's FLOP counter does not
know, all opaque (whole on one device, priced at no FLOPs).

While capture traces (`experts_as_one_call`), each such module that fits (the default gate: the
activation of the first half of ``gate_up_proj``'s output times its second half, concatenated layout,
optional biases, either weight layout, no expert parallelism of Hugging Face's own, no post-expert norm,
an activation among `_ACTIVATIONS`) computes through one custom op, ``soapflow::experts``, instead. Its
schema names the tokens [T, H], the routed experts [T, k] and their weights [T, k], and the stacked
weights, ``gate_up_proj`` passed as its gate and up halves (two blocks of the one parameter, so that
an inner range of both is a box of each); capture maps it to the ``experts`` kind, which splits by
token, by expert and by inner unit (soap/registry.py). The op's own computation (`mixture`, also the
runtime's kernel) is what Hugging Face's computes: each routed (token, slot) pair through its expert,
scaled by its weight, in the weight's dtype, summed over the k slots in slot order and cast back to the
tokens' dtype. A module that does not fit keeps its own forward.

Imports torch only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# activation name (the ``experts`` kind's `act` attr) -> the function
_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu,
}


def activation(name: str) -> Callable[[Tensor], Tensor]:
    """The activation an ``experts`` op names (`act`)."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown experts activation {name!r}; known: {', '.join(_ACTIVATIONS)}") from None


def mixture(x: Tensor, index: Tensor, weights: Tensor, w_gate: Tensor | None, w_up: Tensor, w_out: Tensor,
            b_gate: Tensor | None = None, b_up: Tensor | None = None, b_out: Tensor | None = None, *, act: str,
            transposed: bool, first: int = 0) -> Tensor:
    """sum over slots j of weights[t, j] * expert_{index[t, j]}(x[t]), for the experts the stacked weights
    hold: experts first, first + 1, ... (`first` > 0 or fewer experts than the routing knows: a part
    holding some experts, whose sum over the parts is the whole). Slots routed to other experts add 0.

    An expert e: act(x @ w_gate[e]^T + b_gate[e]) * (x @ w_up[e]^T + b_up[e]) with a gate (`w_gate` not
    None), else act(x @ w_up[e]^T + b_up[e]); then @ w_out[e]^T + b_out[e] (each bias optional; the
    weights stored [E, I, H] and [E, H, I], or [E, H, I] and [E, I, H] `transposed`). Weights holding a
    range of the inner width give partial sums of the output as well. Every held expert runs, on no rows
    where none is routed to it, so that each gets a gradient (zero) as in torch.
    """
    fn = activation(act)
    tokens, k = index.shape
    slots = index.reshape(-1)
    scale = weights.reshape(-1)
    dtype = torch.promote_types(w_up.dtype, scale.dtype)
    out = torch.zeros(tokens * k, x.shape[-1], dtype=dtype, device=x.device)

    def product(h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        h = h @ (w if transposed else w.T)
        return h if b is None else h + b

    for j in range(w_up.shape[0]):
        rows = (slots == first + j).nonzero().squeeze(1)
        h = x[rows // k].to(w_up.dtype)
        up = product(h, w_up[j], None if b_up is None else b_up[j])
        if w_gate is not None:
            h = fn(product(h, w_gate[j], None if b_gate is None else b_gate[j])) * up
        else:
            h = fn(up)
        h = product(h, w_out[j], None if b_out is None else b_out[j])
        out = out.index_put((rows,), h * scale[rows, None])
    return out.view(tokens, k, -1).sum(dim=1).to(x.dtype)


@torch.library.custom_op("soapflow::experts", mutates_args=())
def _experts_op(x: Tensor, index: Tensor, weights: Tensor, w_gate: Tensor | None, w_up: Tensor, w_out: Tensor,
                b_gate: Tensor | None, b_up: Tensor | None, b_out: Tensor | None, act: str, transposed: bool) -> Tensor:
    return mixture(x, index, weights, w_gate, w_up, w_out, b_gate, b_up, b_out, act=act, transposed=transposed)


@_experts_op.register_fake
def _(x: Tensor, index: Tensor, weights: Tensor, w_gate: Tensor | None, w_up: Tensor, w_out: Tensor,
      b_gate: Tensor | None, b_up: Tensor | None, b_out: Tensor | None, act: str, transposed: bool) -> Tensor:
    return x.new_empty(x.shape)


def _activation_name(module: Any) -> str | None:
    """The name in `_ACTIVATIONS` of the function `module` computes, tried on a range of values; None if
    none matches."""
    if not callable(module):
        return None
    probe = torch.linspace(-6.0, 6.0, 241, dtype=torch.float64)
    try:
        with torch.no_grad():
            got = module(probe)
    except Exception:
        return None
    for name, fn in _ACTIVATIONS.items():
        if isinstance(got, Tensor) and got.shape == probe.shape and torch.allclose(got, fn(probe), atol=1e-9):
            return name
    return None


def _fits(module: nn.Module) -> dict[str, Any] | None:
    """What the one call needs of a Hugging Face experts module (the module docstring's conditions), or
    None where it does not fit."""
    needed = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "_is_expert_parallel", "down_proj")
    if not all(hasattr(module, name) for name in needed):
        return None
    gate = getattr(type(module), "_apply_gate", None)
    if (module._is_expert_parallel or getattr(module, "has_post_expert_norm", False) or not module.is_concatenated
            or getattr(gate, "__name__", "") != "_default_apply_gate"):
        return None
    act = _activation_name(getattr(module, "act_fn", None))
    if act is None:
        return None
    w_in = "gate_up_proj" if module.has_gate else "up_proj"
    if not isinstance(getattr(module, w_in, None), nn.Parameter):
        return None
    return {"act": act, "gated": bool(module.has_gate), "transposed": bool(module.is_transposed),
            "bias": bool(module.has_bias)}


def _one_call(module: nn.Module, how: dict[str, Any], traced: bool) -> Callable[..., Tensor]:
    def forward(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        # the gate and up halves of a stacked input projection: blocks of the one parameter
        if how["gated"]:
            w_gate, w_up = module.gate_up_proj.chunk(2, dim=2 if how["transposed"] else 1)
            b_gate, b_up = module.gate_up_proj_bias.chunk(2, dim=1) if how["bias"] else (None, None)
        else:
            w_gate, w_up = None, module.up_proj
            b_gate, b_up = None, module.up_proj_bias if how["bias"] else None
        b_out = module.down_proj_bias if how["bias"] else None
        if traced:
            return _experts_op(hidden_states, top_k_index, top_k_weights, w_gate, w_up, module.down_proj, b_gate,
                               b_up, b_out, how["act"], how["transposed"])
        return mixture(hidden_states, top_k_index, top_k_weights, w_gate, w_up, module.down_proj, b_gate, b_up,
                       b_out, act=how["act"], transposed=how["transposed"])

    return forward


@contextmanager
def experts_as_one_call(model: nn.Module, *, traced: bool = True) -> Iterator[None]:
    """Within the block, every Hugging Face experts module of `model` that fits computes through the one
    ``soapflow::experts`` call (module docstring); with `traced` False through `mixture` itself, as the
    runtime's kernel does (the verifying reference: under autocast its products then run in the compute
    dtype as the run's do, where Hugging Face's grouped products are not autocast and run in float32)."""
    patched = []
    for module in model.modules():
        how = _fits(module)
        if how is not None:
            patched.append((module, module.__dict__.get("forward")))
            module.forward = _one_call(module, how, traced)
    try:
        yield
    finally:
        for module, own in patched:
            if own is None:
                del module.forward
            else:
                module.forward = own
