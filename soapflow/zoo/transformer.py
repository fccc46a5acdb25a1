"""The zoo's Transformer: a GPT-2-style decoder-only language model (Radford et al. 2019, as in nanoGPT).

Defaults are GPT-2 small (12 layers, d_model 768, 12 heads, context 1024, vocabulary 50257) with an untied
LM head, 163,037,184 parameters, trained on sequences of 256 tokens in batches of 8 (one training step
peaks at about 5 GB in one process; at 8 x 1024 it needs about 20 GB, more than a 24 GB machine running
two processes can give). Attention is PyTorch's fused kernel by default (`attention="sdpa"`:
`F.scaled_dot_product_attention(q, k, v, is_causal=True)`, one `attention` operator that keeps no
seq x seq scores), as almost every real model writes it; `attention="explicit"` writes it out instead
(`torch.matmul`, scale, additive causal mask from a non-persistent `[1, 1, seq, seq]` buffer, softmax,
matmul), so every matmul and the softmax are visible operators. Either way `Linear(d, 3d)` makes q, k and
v; no in-place ops and no shape-dependent Python branches. Positions are a model input (`positions[N, T]`
long, usually `0..T-1` in every row) looked up in a learned `nn.Embedding` of `context` rows, so the
position lookup is an ordinary operator splittable on the sample dim. Inputs must be exactly `seq` tokens
long. Dropout defaults to p=0 so that distributed and single-process training draw no random masks (with
SDPA and p > 0 the attention's own dropout makes it an opaque operator).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from soapflow.zoo.losses import lm_cross_entropy

ATTENTIONS = ("sdpa", "explicit")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on `x[N, T, d]`; heads are `[N, heads, T, d / heads]`.

    `attention` is ``sdpa`` (PyTorch's fused kernel) or ``explicit`` (matmuls, mask and softmax written
    out); both compute the same function.
    """

    def __init__(self, *, d_model: int, heads: int, seq: int, dropout: float, attention: str = "sdpa") -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model={d_model} is not divisible by heads={heads}")
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
        self.d_model = d_model
        self.heads = heads
        self.head_dim = d_model // heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.attention = attention
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_drop = nn.Dropout(p=dropout)
        self.resid_drop = nn.Dropout(p=dropout)
        if attention == "explicit":
            causal = torch.full((seq, seq), float("-inf")).triu(diagonal=1)
            self.register_buffer("mask", causal.view(1, 1, seq, seq), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(x).split(self.d_model, dim=2)
        q = q.reshape(n, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.reshape(n, t, self.heads, self.head_dim).transpose(1, 2)
        v = v.reshape(n, t, self.heads, self.head_dim).transpose(1, 2)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
            weights = torch.softmax(scores + self.mask, dim=-1)
            y = torch.matmul(self.attn_drop(weights), v)
        y = y.transpose(1, 2).reshape(n, t, d)
        return self.resid_drop(self.proj(y))


class FeedForward(nn.Module):
    """`Linear(d, 4d) → GELU (tanh approximation, as GPT-2) → Linear(4d, d)` on `x[N, T, d]`."""

    def __init__(self, *, d_model: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.gelu = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(p=dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm residual block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`."""

    def __init__(self, *, d_model: int, heads: int, seq: int, dropout: float, attention: str = "sdpa") -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model=d_model, heads=heads, seq=seq, dropout=dropout,
                                        attention=attention)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = FeedForward(d_model=d_model, dropout=dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """`(tokens[N, T], positions[N, T])` → next-token logits `[N, T, vocab]`; `context` (default `seq`)
    positions have an embedding."""

    def __init__(self, *, layers: int, d_model: int, heads: int, seq: int, vocab: int,
                 dropout: float, attention: str = "sdpa", context: int | None = None) -> None:
        super().__init__()
        context = seq if context is None else context
        if seq > context:
            raise ValueError(f"seq={seq} is longer than the context of {context} positions")
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(context, d_model)
        self.drop = nn.Dropout(p=dropout)
        self.blocks = nn.Sequential(*(Block(d_model=d_model, heads=heads, seq=seq, dropout=dropout,
                                            attention=attention) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(tokens) + self.wpe(positions))
        return self.lm_head(self.ln_f(self.blocks(x)))


def transformer(batch_size: int = 8, *, layers: int = 12, d_model: int = 768, heads: int = 12,
                seq: int = 256, context: int | None = 1024, vocab: int = 50257, dropout: float = 0.0,
                attention: str = "sdpa") -> tuple:
    """GPT on `(tokens[N, seq], positions[N, seq])`, next tokens `[N, seq]` as target (`lm_cross_entropy`).

    `context` is the number of learned positions, at least `seq` (None: `seq`); `attention` is ``sdpa`` or
    ``explicit``.
    The example batch lives on the meta device, so `positions` carries no values; real positions are
    `torch.arange(seq).expand(N, seq)`.
    """
    module = GPT(layers=layers, d_model=d_model, heads=heads, seq=seq, vocab=vocab, dropout=dropout,
                 attention=attention, context=None if context is None else max(seq, context))
    tokens = torch.empty(batch_size, seq, dtype=torch.long, device="meta")
    positions = torch.empty(batch_size, seq, dtype=torch.long, device="meta")
    target = torch.empty(batch_size, seq, dtype=torch.long, device="meta")
    return module, ((tokens, positions), target), lm_cross_entropy
