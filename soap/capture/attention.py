"""Capture, stage 1 (with `tracing`): attention traced the way the graph can split it.

Two forwards change while capture traces (`captured_attention`), and the verifying reference runs under
the same ones (runtime.train), so that its attention dropout draws the runtime's masks; without dropout
each computes what PyTorch's computes, to rounding (tests/test_capture_forms.py).

``F.scaled_dot_product_attention`` with dropout. The fused kernel draws its dropout mask from torch's
generator in its own order, which no part of a split op could reproduce, so capture would leave it opaque
(whole on one device; Hugging Face models call it so in training, GPT-2 with ``attn_pdrop`` 0.1). With
``dropout_p`` > 0 it is written out instead, as PyTorch's math backend computes it: scores of q scaled by
``scale`` (default 1/sqrt(head features)) and k, the causal mask and ``attn_mask`` (a boolean one: True
keeps) added as ``-inf``, softmax, a dropout op, the weighted sum of v. Key and value heads must equal
the query heads or be one (multi-query, broadcast); grouped-query attention with dropout stays opaque.

``nn.MultiheadAttention``, in the layout of its inputs.

PyTorch's ``MultiheadAttention`` computes in the sequence-first layout: with ``batch_first`` it transposes
its inputs to (sequence, batch, features), and before its output projection it flattens (sequence, batch)
into one axis, sequence outermost. Captured as it runs, the ops between those transposes hold the sequence
on their first axis, which capture's kinds name the sample axis, and the flattened axis follows neither:
data parallelism would split those ops by sequence and exchange activations around every attention.

So while capture traces, the class gets a forward that computes the same function in the layout the
caller passed, with nothing flattened across the batch:

- q, k and v are three ``linear`` ops over their blocks of the packed ``in_proj_weight`` and
  ``in_proj_bias`` (or over ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight``), as capture makes of a
  fused projection (`fused`);
- each is viewed per head and permuted to (batch, heads, sequence, head features), attended, permuted
  back, merged per head and projected by ``out_proj``;
- the attention is one ``scaled_dot_product_attention`` where the module asks for no weights (written out
  as above where it draws dropout); where it asks for weights it is written out, and the weights, after
  dropout and averaged over heads unless asked otherwise, are returned as PyTorch returns them;
- the masks are merged as PyTorch merges them: a boolean mask is ``-inf`` where True, the key padding
  mask broadcasts over heads and queries, and ``is_causal`` (PyTorch's hint that ``attn_mask`` is causal)
  is the attention's causal flag where the attention is one op and no key padding mask is merged.

What it leaves to PyTorch's own forward: unbatched (2-D) inputs, ``add_bias_kv``, ``add_zero_attn``, and
the calls PyTorch refuses (a mask of the wrong size, ``is_causal`` without ``attn_mask``), so that
PyTorch's own error speaks. Those trace as before.

Imports torch only.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["captured_attention"]


@contextlib.contextmanager
def captured_attention() -> Iterator[None]:
    """Within the block, ``F.scaled_dot_product_attention`` with dropout is written out and
    ``nn.MultiheadAttention`` (and subclasses that keep its forward) computes in the layout of its inputs
    (module docstring)."""
    original = nn.MultiheadAttention.forward
    fused = F.scaled_dot_product_attention

    def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
             dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
             enable_gqa: bool = False) -> torch.Tensor:
        if dropout_p > 0.0 and query.dim() >= 3 and key.shape[-3] in (1, query.shape[-3]) and \
                value.shape[-3] == key.shape[-3] and not (is_causal and attn_mask is not None):
            mask = _additive(attn_mask, query.dtype, keeps=True)
            return _written_out(query, key, value, mask, dropout_p, is_causal, scale)[0]
        return fused(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                     scale=scale, enable_gqa=enable_gqa)

    def forward(self: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not _supported(self, query, key, value, key_padding_mask, attn_mask, is_causal):
            return original(self, query, key, value, key_padding_mask=key_padding_mask,
                            need_weights=need_weights, attn_mask=attn_mask,
                            average_attn_weights=average_attn_weights, is_causal=is_causal)
        return _forward(self, query, key, value, key_padding_mask, need_weights, attn_mask,
                        average_attn_weights, is_causal)

    nn.MultiheadAttention.forward = forward
    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        nn.MultiheadAttention.forward = original
        F.scaled_dot_product_attention = fused


def _supported(m: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None, is_causal: bool) -> bool:
    if is_causal and attn_mask is None:  # PyTorch asks for the mask with its hint
        return False
    if not (query.dim() == key.dim() == value.dim() == 3) or m.bias_k is not None or m.bias_v is not None \
            or m.add_zero_attn:
        return False
    b = 0 if m.batch_first else 1
    batch, length, source = query.shape[b], query.shape[1 - b], key.shape[1 - b]
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (batch, source):
        return False
    if attn_mask is not None and attn_mask.dim() == 3:
        return tuple(attn_mask.shape) == (batch * m.num_heads, length, source)
    return attn_mask is None or tuple(attn_mask.shape) == (length, source)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype, *, keeps: bool = False) -> torch.Tensor | None:
    """A boolean mask as an additive one, ``-inf`` where it masks out (where True: MultiheadAttention's
    convention; with `keeps`, where False: SDPA's); a float mask as it is."""
    if mask is None or mask.is_floating_point():
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        mask.logical_not() if keeps else mask, float("-inf"))


def _forward(m: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             key_padding_mask: torch.Tensor | None, need_weights: bool, attn_mask: torch.Tensor | None,
             average_attn_weights: bool, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    b = 0 if m.batch_first else 1  # the batch axis of the inputs and the output
    heads, width = m.num_heads, m.embed_dim
    if m._qkv_same_embed_dim:
        weights = [m.in_proj_weight[i * width:(i + 1) * width] for i in range(3)]
    else:
        weights = [m.q_proj_weight, m.k_proj_weight, m.v_proj_weight]
    biases = [None] * 3 if m.in_proj_bias is None else [m.in_proj_bias[i * width:(i + 1) * width] for i in range(3)]
    # (batch, heads, sequence, head features) from the caller's layout
    to_heads = (0, 2, 1, 3) if b == 0 else (1, 2, 0, 3)
    q, k, v = (F.linear(x, w, bias).unflatten(-1, (heads, m.head_dim)).permute(*to_heads)
               for x, w, bias in zip((query, key, value), weights, biases, strict=True))
    batch, length, source = q.shape[0], q.shape[2], k.shape[2]
    p = m.dropout if m.training else 0.0

    padding = _additive(key_padding_mask, q.dtype)
    causal = is_causal and padding is None and not need_weights
    mask = None if causal else _additive(attn_mask, q.dtype)
    if mask is not None:
        mask = mask.view(batch, heads, length, source) if mask.dim() == 3 else mask.view(1, 1, length, source)
    if padding is not None:
        padding = padding.view(batch, 1, 1, source)
        mask = padding if mask is None else mask + padding

    attention_weights = None
    if need_weights:
        out, probs = _written_out(q, k, v, mask, p, False, None)
        attention_weights = probs.mean(dim=1) if average_attn_weights else probs
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal)
    back = (0, 2, 1, 3) if b == 0 else (2, 0, 1, 3)
    out = out.permute(*back).flatten(-2)
    return F.linear(out, m.out_proj.weight, m.out_proj.bias), attention_weights


def _written_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, p: float,
                 is_causal: bool, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, attention probabilities after dropout) of attention written out (module docstring); `mask`
    additive; the causal mask keeps the lower-left triangle from the top-left corner, as the fused
    attention's does."""
    scores = torch.matmul(q * (scale if scale is not None else math.sqrt(1.0 / q.shape[-1])), k.transpose(-2, -1))
    if is_causal:
        length, source = q.shape[-2], k.shape[-2]
        scores = scores + _additive(torch.ones(length, source, dtype=torch.bool, device=q.device).tril(), q.dtype,
                                    keeps=True)
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1)
    if p > 0.0:
        probs = F.dropout(probs, p=p)
    return torch.matmul(probs, v), probs
