"""Shared helpers of the runtime tests: small models, strategies (hand-written and random), and the worker
that runs many training cases in one launch (a launch costs seconds, so each test launches once).

Not a test module itself; the worker processes import it by name, so everything they call is module-level.
"""

from __future__ import annotations

import functools
import random
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from runtime.materialize import Pieces, piece_of, record, replay
from runtime.train import (
    TrainOptions,
    Workload,
    integer_highs,
    make_optimizer,
    reference_train,
    synthetic_batch,
    train_rank,
)
from soap.capture import capture
from soap.config import ConfigError, ParallelConfig, param_replicas, recompute_refusal, shardable, validate
from soap.graph import Operator, OperatorGraph
from soap.opdef import DimKind
from soap.registry import dims_of, op_def
from soap.setup import TrainSetup
from soap.strategy import Strategy
from soapflow import zoo
from soapflow.models import default_loss
from soapflow.zoo.losses import lm_cross_entropy

# Float32 runs agree with one process to about 1e-7; the tests allow 1e-5 (docs/runtime.md).
TOL = 1e-5
DEFAULT_OPTIONS = TrainOptions(steps=3, setup=TrainSetup(lr=0.05), verify=True)


# ---------------------------------------------------------------------- models


class SmallCNN(nn.Module):
    """conv(3->8, 3x3) - relu - conv(8->8, 3x3) - relu - maxpool 2 - flatten - fc1 - relu - fc2, with an
    optional residual add around the second conv and optional BatchNorm after each conv."""

    def __init__(self, *, residual: bool = False, batchnorm: bool = False, size: int = 8, classes: int = 4):
        super().__init__()
        self.residual = residual
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8) if batchnorm else nn.Identity()
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8) if batchnorm else nn.Identity()
        self.relu2 = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(8 * (size // 2) ** 2, 16)
        self.relu3 = nn.ReLU()
        self.fc2 = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(x))
        if self.residual:
            y = y + x
        x = self.pool(self.relu2(y))
        return self.fc2(self.relu3(self.fc1(torch.flatten(x, 1))))


class HandRMSNorm(nn.Module):
    """RMS norm written out as Hugging Face's LlamaRMSNorm writes it (capture fuses it into `rmsnorm`)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """Rotary position tables (cos, sin) from a buffer of inverse frequencies, under no_grad, as Llama."""

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class GQAttention(nn.Module):
    """Grouped-query attention with rotary positions and an explicit boolean mask; k and v reach the
    query heads by `repeat`: ``expand`` (Llama's repeat_kv), ``interleave`` (repeat_interleave) or ``gqa``
    (SDPA's enable_gqa)."""

    def __init__(self, d: int, heads: int, kv_heads: int, repeat: str) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.repeat = heads, kv_heads, d // heads, repeat
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q = self.q_proj(x).view(n, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(n, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(n, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        if self.repeat == "expand":
            k = k[:, :, None].expand(n, self.kv_heads, rep, t, self.head_dim).reshape(n, self.heads, t, -1)
            v = v[:, :, None].expand(n, self.kv_heads, rep, t, self.head_dim).reshape(n, self.heads, t, -1)
        elif self.repeat == "interleave":
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.repeat == "gqa")
        return self.o_proj(y.transpose(1, 2).reshape(n, t, d))


class LlamaLike(nn.Module):
    """A small Llama written with torch.nn only: token embedding tied to the LM head, rotary positions and
    a causal mask built from the sequence length (capture folds both into constants), pre-norm blocks
    with hand-written RMS norms, grouped-query attention (one layer per way of repeating k and v) and a
    SwiGLU MLP, and a final `nn.RMSNorm`."""

    def __init__(self, *, vocab: int = 32, d: int = 16, heads: int = 4, kv_heads: int = 2,
                 repeats: tuple[str, ...] = ("expand", "interleave", "gqa")) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.rotary = Rotary(d // heads)
        self.layers = nn.ModuleList()
        for repeat in repeats:
            block = nn.Module()
            block.norm1, block.norm2 = HandRMSNorm(d), HandRMSNorm(d)
            block.attn = GQAttention(d, heads, kv_heads, repeat)
            block.gate, block.up = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False)
            block.down = nn.Linear(2 * d, d, bias=False)
            self.layers.append(block)
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        positions = torch.arange(t, device=ids.device)
        cos, sin = self.rotary(positions[None])
        mask = positions[None, :] <= positions[:, None]
        x = self.embed(ids)
        for block in self.layers:
            x = x + block.attn(block.norm1(x), cos, sin, mask)
            h = block.norm2(x)
            x = x + block.down(F.silu(block.gate(h)) * block.up(h))
        return self.lm_head(self.norm(x))


class AttentionMix(nn.Module):
    """``nn.MultiheadAttention`` as users write it: an encoder layer (batch first, dropout, a causal mask
    with the ``is_causal`` hint and a key padding mask), then a sequence-first cross-attention with its own
    key and value widths whose averaged weights the output reads, then attention called directly with
    dropout and a causal mask."""

    def __init__(self, width: int = 16, heads: int = 2, seq: int = 6, dropout: float = 0.1):
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.enc = nn.TransformerEncoderLayer(width, heads, 32, dropout=dropout, batch_first=True)
        self.mem = nn.Linear(8, 12)
        self.cross = nn.MultiheadAttention(width, heads, kdim=12, vdim=12)
        self.out = nn.Linear(width, 4)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[:2]
        padding = torch.zeros(batch, seq, dtype=x.dtype, device=x.device).masked_fill(
            torch.arange(seq, device=x.device) == seq - 1, float("-inf"))
        h = self.enc(self.inp(x), src_mask=self.causal, src_key_padding_mask=padding, is_causal=True)
        m = self.mem(x).transpose(0, 1)
        c, w = self.cross(h.transpose(0, 1), m, m)
        heads = h.unflatten(-1, (2, -1)).transpose(1, 2)
        a = F.scaled_dot_product_attention(heads, heads, heads, dropout_p=0.1 if self.training else 0.0,
                                           is_causal=True).transpose(1, 2).flatten(-2)
        return self.out(c.transpose(0, 1) + a) + w.mean(-1, keepdim=True)


class Sliced(nn.Module):
    """Parameters cut by split, chunk, slicing, narrow and an identity slice: blocks read by linears, by
    an add and by an op capture leaves opaque."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(24, 8) / 3)
        self.b = nn.Parameter(torch.randn(24) / 3)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wq, _, wv = self.w.split(8)
        bq, bk, bv = self.b.chunk(3)
        q = F.linear(x, wq, bq)
        k = F.linear(x, self.w[8:16], self.b.narrow(0, 8, 8))
        v = F.linear(x, wv[:, :], bv)
        return self.head(torch.tanh(q) * k + v + bk) + torch.cumsum(self.w[-8:], 0).sum()


class PackedHeads(nn.Module):
    """Attention as timm's vision transformers write it: one qkv linear reshaped to (batch, tokens, 3,
    heads, head features), permuted to put q, k, v first and unbound; then a second block reading q, k, v
    by index after a transpose."""

    def __init__(self, width: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.qkv2 = nn.Linear(width, 3 * width)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        h = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, tokens, width))
        qkv2 = self.qkv2(h).view(batch, tokens, 3, self.heads, -1).transpose(1, 2)
        a = F.scaled_dot_product_attention(qkv2[:, 0].transpose(1, 2), qkv2[:, 1].transpose(1, 2),
                                           qkv2[:, 2].transpose(1, 2), is_causal=True)
        return self.head(h + a.transpose(1, 2).flatten(-2))


def packed_build(batch: int) -> Workload:
    torch.manual_seed(0)
    return Workload(module=PackedHeads(), inputs=(torch.empty(batch, 6, 16, device="meta"),),
                    target=torch.empty(batch, 6, 4, device="meta"), loss_fn=default_loss)


class SequenceFirstLM(nn.Module):
    """A language model as PyTorch's word-language-model example writes it: token ids (time, batch), an
    LSTM and a GRU sequence first (their default layout)."""

    def __init__(self, vocab: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, 8)
        self.lstm = nn.LSTM(8, 16, 2)
        self.gru = nn.GRU(16, 16)
        self.out = nn.Linear(16, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.emb(ids))
        h, _ = self.gru(h)
        return self.out(h)


def sequence_first_build(batch: int, steps: int = 6) -> Workload:
    torch.manual_seed(0)
    return Workload(module=SequenceFirstLM(), inputs=(torch.empty(steps, batch, dtype=torch.long, device="meta"),),
                    target=torch.empty(steps, batch, dtype=torch.long, device="meta"), loss_fn=lm_cross_entropy)


class Activations(nn.Module):
    """An MLP through the activations capture keeps by name (`soap.registry.POINTWISE_FNS`)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.acts = nn.ModuleList([nn.Sequential(nn.LeakyReLU(0.1), nn.Hardswish()),
                                   nn.Sequential(nn.ReLU6(), nn.ELU(0.5), nn.Mish()),
                                   nn.Sequential(nn.Softplus(2.0), nn.SELU(), nn.CELU(0.7)),
                                   nn.Sequential(nn.Hardsigmoid(), nn.Hardtanh(-0.5, 0.5))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, act in zip(self.layers, self.acts, strict=True):
            x = act(layer(x)) * 4
        return x


class SmallUNet(nn.Module):
    """A U-Net step as diffusion and segmentation nets write it: a GroupNorm'd convolution, down by max
    pooling, an affine InstanceNorm'd convolution, up by nearest upsampling and by a transposed
    convolution, and the skip added."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.gn = nn.GroupNorm(4, 8)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.inorm = nn.InstanceNorm2d(8, affine=True)
        self.up = nn.Upsample(scale_factor=2)
        self.deconv = nn.ConvTranspose2d(8, 8, 3, stride=2, padding=1, output_padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.gn(self.conv1(x)))
        low = F.relu(self.inorm(self.conv2(self.pool(h))))
        return self.fc((self.up(low) + self.deconv(low) + h).mean((2, 3)))


class SmallTCN(nn.Module):
    """A temporal convolution stack as audio models write it: padded, strided, grouped and dilated Conv1d
    with 1-D max, average and adaptive pooling."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(4, 8, 3, padding="same")
        self.pool1 = nn.MaxPool1d(3, 2, padding=1)
        self.conv2 = nn.Conv1d(8, 8, 3, stride=2, padding=1, groups=2)
        self.conv3 = nn.Conv1d(8, 8, 3, dilation=2, bias=False)
        self.pool2 = nn.AvgPool1d(2)
        self.head = nn.AdaptiveAvgPool1d(1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool1(F.gelu(self.conv1(x)))
        h = self.pool2(self.conv3(F.gelu(self.conv2(h))))
        return self.fc(self.head(h).flatten(1))


def tcn_build(batch: int) -> Workload:
    torch.manual_seed(0)
    return Workload(module=SmallTCN(), inputs=(torch.empty(batch, 4, 32, device="meta"),),
                    target=torch.empty(batch, 4, device="meta"), loss_fn=default_loss)


class Bags(nn.Module):
    """Recommendation-style pooled embeddings: a mean and a sum ``nn.EmbeddingBag`` over the same ids,
    concatenated into a linear."""

    def __init__(self):
        super().__init__()
        self.mean_bag = nn.EmbeddingBag(32, 8)
        self.sum_bag = nn.EmbeddingBag(32, 8, mode="sum")
        self.fc = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.mean_bag(ids), self.sum_bag(ids)], dim=1))


def bags_build(batch: int) -> Workload:
    torch.manual_seed(0)
    return Workload(module=Bags(), inputs=(torch.empty(batch, 5, dtype=torch.long, device="meta"),),
                    target=torch.empty(batch, 4, device="meta"), loss_fn=default_loss)


class Tagger(nn.Module):
    """A sequence tagger as NLP code writes it: a bidirectional two-layer LSTM, batch first, then a
    bidirectional two-layer GRU, sequence first, whose final states also feed the head, both with dropout
    between their layers; trained with a label-smoothed cross entropy that ignores id 0 (`tagger_loss`)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.lstm = nn.LSTM(8, 8, num_layers=2, batch_first=True, bidirectional=True, dropout=0.25)
        self.gru = nn.GRU(16, 6, num_layers=2, bidirectional=True, dropout=0.2)
        self.head = nn.Linear(12, 5)
        self.state_head = nn.Linear(12, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(ids))
        out, h = self.gru(out.transpose(0, 1))
        return self.head(out.transpose(0, 1)) + self.state_head(h[-2:].transpose(0, 1).flatten(1)).unsqueeze(1)


def tagger_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Each position predicts the next tag: the logits but the last against the tags but the first, id 0
    ignored (padding), smoothed labels, weighted classes."""
    weight = torch.tensor([1.0, 2.0, 0.5, 1.0, 1.5], dtype=logits.dtype, device=logits.device)
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), target[:, 1:], weight=weight, ignore_index=0,
                           label_smoothing=0.1)


def tagger_build(batch: int) -> Workload:
    torch.manual_seed(0)
    return Workload(module=Tagger(), inputs=(torch.empty(batch, 6, dtype=torch.long, device="meta"),),
                    target=torch.empty(batch, 6, dtype=torch.long, device="meta"), loss_fn=tagger_loss)


class SuperResolution(nn.Module):
    """Super-resolution and gated convolutions: per-channel and single PReLU, PixelShuffle up,
    PixelUnshuffle down, a GLU over channels."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.act1 = nn.PReLU(16)
        self.shuffle = nn.PixelShuffle(2)
        self.act2 = nn.PReLU()
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.unshuffle = nn.PixelUnshuffle(2)
        self.glu = nn.GLU(dim=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act2(self.shuffle(self.act1(self.conv1(x))))
        h = self.glu(self.unshuffle(self.conv2(h)))
        return self.fc(h.mean((2, 3)))


def super_resolution_build(batch: int) -> Workload:
    torch.manual_seed(0)
    return Workload(module=SuperResolution(), inputs=(torch.empty(batch, 3, 6, 6, device="meta"),),
                    target=torch.empty(batch, 4, device="meta"), loss_fn=default_loss)


class BilinearUNet(nn.Module):
    """A segmentation U-Net step: channel dropout, down by pooling, up by bilinear upsampling with and
    without aligned corners."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.drop = nn.Dropout2d(0.2)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear")
        self.up_corners = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(F.relu(self.conv1(x)))
        low = F.relu(self.conv2(self.pool(h)))
        return self.fc((self.up(low) + self.up_corners(low) + h).mean((2, 3)))


def bilinear_unet_build(batch: int) -> Workload:
    torch.manual_seed(0)
    return Workload(module=BilinearUNet(), inputs=(torch.empty(batch, 3, 10, 10, device="meta"),),
                    target=torch.empty(batch, 4, device="meta"), loss_fn=default_loss)


class VisionForms(nn.Module):
    """What vision models port from TensorFlow and ViT: "same" padding by an explicit pad before a strided
    convolution, a class token parameter expanded to the batch, a position bias table read through a constant
    index (Swin's relative position bias), stochastic depth drawn by ``torch.rand`` (Hugging Face) and by
    ``bernoulli_`` (timm), normal noise by ``torch.randn_like``, and an in-place dropout through a flatten view
    (MobileNetV2's classifier)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2)
        self.cls = nn.Parameter(torch.randn(1, 1, 8))
        self.table = nn.Parameter(torch.randn(30, 8))
        self.register_buffer("index", torch.arange(17).flip(0) + 3, persistent=False)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(0.1, inplace=True)
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv2(F.pad(F.relu(self.conv1(x)), (0, 1, 0, 1)))
        tokens = torch.cat([self.cls.expand(x.shape[0], -1, -1), h.flatten(2).transpose(1, 2)], 1)
        tokens = tokens + self.table[self.index]
        # stochastic depth as Hugging Face writes it: one draw per sample
        keep = torch.floor(0.8 + torch.rand((x.shape[0], 1, 1), dtype=x.dtype, device=x.device))
        tokens = tokens.div(0.8) * keep
        # noise as a VAE's reparameterization draws it
        tokens = tokens + 0.1 * torch.randn_like(tokens)
        pooled = self.drop(torch.flatten(self.pool(h), 1))
        # and as timm writes it
        pooled = pooled * pooled.new_empty((x.shape[0], 1)).bernoulli_(0.75).div_(0.75)
        return self.fc(torch.cat([tokens.mean(1), pooled], 1))


def vision_forms_build(batch: int) -> Workload:
    torch.manual_seed(0)
    return Workload(module=VisionForms(), inputs=(torch.empty(batch, 3, 8, 8, device="meta"),),
                    target=torch.empty(batch, 4, device="meta"), loss_fn=default_loss)


class Statistics(nn.Module):
    """What contrastive heads and hand-written norms compute: an L2-normalized embedding, a clamp, a
    standardization by var and std, a softmax shifted by the max values, logsumexp, a cosine similarity, a
    roll, a square, an elementwise maximum and an expand_as."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.normalize(self.fc1(x), dim=-1).clamp(-0.4, 0.4) * 3
        h = (h - h.mean(-1, keepdim=True)) / (h.var(-1, keepdim=True, correction=0) + 1e-5).sqrt()
        h = h + h.std(-1, keepdim=True)
        h = h - h.max(-1, keepdim=True).values.expand_as(h) + h.logsumexp(-1, keepdim=True)
        h = h + F.cosine_similarity(h, h.flip(1), dim=-1).unsqueeze(-1) + h.roll(2, 1)
        return self.fc2(torch.maximum(h.square().clamp_max(2.0), h) - h.amax(-1, keepdim=True))


def statistics_build(batch: int) -> Workload:
    torch.manual_seed(0)
    return Workload(module=Statistics(), inputs=(torch.empty(batch, 5, 8, device="meta"),),
                    target=torch.empty(batch, 5, 4, device="meta"), loss_fn=default_loss)


def unet_build(batch: int) -> Workload:
    torch.manual_seed(0)
    return Workload(module=SmallUNet(), inputs=(torch.empty(batch, 3, 8, 8, device="meta"),),
                    target=torch.empty(batch, 4, device="meta"), loss_fn=default_loss)


def activations_build(batch: int) -> Workload:
    torch.manual_seed(0)
    return Workload(module=Activations(), inputs=(torch.empty(batch, 8, device="meta"),),
                    target=torch.empty(batch, 8, device="meta"), loss_fn=default_loss)


def sliced_build(batch: int) -> Workload:
    torch.manual_seed(0)
    return Workload(module=Sliced(), inputs=(torch.empty(batch, 8, device="meta"),),
                    target=torch.empty(batch, 4, device="meta"), loss_fn=default_loss)


def attention_build(batch: int, seq: int = 6) -> Workload:
    torch.manual_seed(0)
    return Workload(module=AttentionMix(seq=seq), inputs=(torch.empty(batch, seq, 8, device="meta"),),
                    target=torch.empty(batch, seq, 4, device="meta"), loss_fn=default_loss)


def llama_build(batch: int, seq: int = 8) -> Workload:
    torch.manual_seed(0)
    return Workload(module=LlamaLike(), inputs=(torch.empty(batch, seq, dtype=torch.long, device="meta"),),
                    target=torch.empty(batch, seq, dtype=torch.long, device="meta"),
                    loss_fn=lm_cross_entropy)


def zoo_build(name: str, batch: int, **sizes: Any) -> Workload:
    torch.manual_seed(0)
    result = zoo.ZOO[name].build(batch, **sizes)
    module, (inputs, target) = result[0], result[1]
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    return Workload(module=module, inputs=inputs, target=target,
                    loss_fn=result[2] if len(result) == 3 else default_loss)


def frozen_build(build: Callable[[], Workload], prefixes: tuple[str, ...]) -> Workload:
    """`build()`'s workload with the parameters whose names start with one of `prefixes` frozen
    (``requires_grad`` False), as a fine-tuning run freezes part of a model."""
    w = build()
    for name, p in w.module.named_parameters():
        if name.startswith(prefixes):
            p.requires_grad_(False)
    return w


def cnn_build(batch: int, residual: bool = False, batchnorm: bool = False, size: int = 8) -> Workload:
    torch.manual_seed(0)
    return Workload(module=SmallCNN(residual=residual, batchnorm=batchnorm, size=size),
                    inputs=(torch.empty(batch, 3, size, size, device="meta"),),
                    target=torch.empty(batch, dtype=torch.long, device="meta"), loss_fn=default_loss)


MODELS: dict[str, Callable[[], Workload]] = {
    "mlp": functools.partial(zoo_build, "mlp", 8, sizes=(16, 32, 16)),
    "cnn": functools.partial(cnn_build, 4),
    "rescnn": functools.partial(cnn_build, 4, residual=True),
    "bncnn": functools.partial(cnn_build, 4, residual=True, batchnorm=True),
    "rnnlm": functools.partial(zoo_build, "rnnlm", 4, hidden=16, embed=8, vocab=32, steps=4),
    # the RNN LM with GRU layers (`grus.0`, `grus.1`) and with plain RNN layers (`rnns.0`, `rnns.1`)
    "grulm": functools.partial(zoo_build, "rnnlm", 4, hidden=16, embed=8, vocab=32, steps=4, cell="gru"),
    "rnnlm_tanh": functools.partial(zoo_build, "rnnlm", 4, hidden=16, embed=8, vocab=32, steps=4, cell="rnn_tanh"),
    "rnnlm_relu": functools.partial(zoo_build, "rnnlm", 4, hidden=16, embed=8, vocab=32, steps=4, cell="rnn_relu"),
    "nmt": functools.partial(zoo_build, "nmt", 4, hidden=16, embed=8, vocab=32, steps=4, layers=2),
    "transformer": functools.partial(zoo_build, "transformer", 4, layers=2, d_model=16, heads=2, seq=8,
                                     context=None, vocab=32),
    "transformer_explicit": functools.partial(zoo_build, "transformer", 4, layers=2, d_model=16, heads=2, seq=8,
                                              context=None, vocab=32, attention="explicit"),
    "llama": functools.partial(llama_build, 4),
    "attention": functools.partial(attention_build, 4),
    "sliced": functools.partial(sliced_build, 4),
    "packed": functools.partial(packed_build, 4),
    "seqfirst": functools.partial(sequence_first_build, 4),
    "activations": functools.partial(activations_build, 4),
    "unet": functools.partial(unet_build, 4),
    "tcn": functools.partial(tcn_build, 4),
    "bags": functools.partial(bags_build, 4),
    "tagger": functools.partial(tagger_build, 4),
    "superres": functools.partial(super_resolution_build, 4),
    "bilinear": functools.partial(bilinear_unet_build, 4),
    "vision": functools.partial(vision_forms_build, 4),
    "statistics": functools.partial(statistics_build, 4),
    # frozen parameters: a frozen first layer (no backward before the second), and a transformer with frozen
    # position embeddings, a frozen attention (its fused qkv split into blocks) and a frozen MLP between
    # trainable ops (their backward computes only their inputs' gradients)
    "mlp_frozen": functools.partial(frozen_build, functools.partial(zoo_build, "mlp", 8, sizes=(16, 32, 16)),
                                    ("layers.0.",)),
    "transformer_frozen": functools.partial(
        frozen_build, functools.partial(zoo_build, "transformer", 4, layers=2, d_model=16, heads=2, seq=8,
                                        context=None, vocab=32), ("wpe.", "blocks.0.mlp.", "blocks.1.attn.")),
    # Verified in float64: its BatchNorm stack at a tiny batch makes float32 results differ by more than
    # 1e-5 between any two summation orders (float64 agrees to about 1e-14).
    "resnet18": functools.partial(zoo_build, "resnet18", 8, num_classes=4, image_size=64),
}


def capture_workload(build: Callable[[], Workload]) -> OperatorGraph:
    w = build()
    return capture(w.module, w.inputs, w.target, w.loss_fn, name="test", batch_size=w.inputs[0].shape[0])


# ---------------------------------------------------------------------- materialization


def named(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters(remove_duplicate=False)),
            **dict(module.named_buffers(remove_duplicate=False))}


def whole_pieces(module: nn.Module) -> list:
    return [(fqn, tuple((0, s) for s in t.shape), None) for fqn, t in module.named_parameters(remove_duplicate=False)]


def same_as_eager(build, wanted_of, seed: int = 3) -> Pieces:
    """Materialize `wanted_of(module)` from a recorded build and compare with an eager build from `seed`;
    the generator must end where the eager build leaves it."""
    torch.manual_seed(seed)
    eager = named(build().module)
    after_eager = torch.rand(4)
    torch.manual_seed(seed)
    construction = record(build)
    module = construction.value.module
    assert all(t.is_meta for t in module.parameters()), "the recorded build is not on the meta device"
    wanted = wanted_of(module)
    pieces = replay(construction, module, wanted)
    assert torch.equal(torch.rand(4), after_eager), "the random generator is not where an eager build leaves it"
    for fqn, region, chunk in wanted:
        assert torch.equal(pieces.piece(fqn, region, chunk), piece_of(eager[fqn], region, chunk)), (fqn, region, chunk)
    for fqn, value in pieces.items():
        assert torch.equal(value, eager[fqn]), fqn
    assert set(pieces) == {n for n, _ in build().module.named_buffers(remove_duplicate=False)}
    return pieces



# ---------------------------------------------------------------------- strategies


def configs(strategy: Strategy) -> dict[str, dict[str, Any]]:
    return {name: cfg.to_dict() for name, cfg in strategy.items()}


def _degree_choices(op: Operator, num_devices: int) -> list[dict[str, int]]:
    """Every degree assignment whose product divides `num_devices` and that the op kind allows."""
    divisors = [g for g in range(1, num_devices + 1) if num_devices % g == 0]
    out: list[dict[str, int]] = [{}]
    for d in dims_of(op):
        if not d.splittable:
            continue
        grown = []
        for degrees in out:
            used = 1
            for g in degrees.values():
                used *= g
            for g in divisors:
                if g > 1 and d.size % g == 0 and num_devices % (used * g) == 0:
                    grown.append(degrees | {d.name: g})
        out += grown
    return [deg for deg in out if op_def(op.kind).check(op, deg) is None]


def random_strategy(graph: OperatorGraph, num_devices: int, rng: random.Random) -> Strategy:
    """Every op gets a uniformly drawn valid config: any allowed degrees, on a random device subset in a
    random order (so layouts change between ops, across device sets, and with partial sums), recomputing
    or not where it may, its parameters sharded over a random divisor of their replicas where it may."""
    out = {}
    shared = graph.shared_params()
    for op in graph:
        degrees = rng.choice(_degree_choices(op, num_devices))
        count = 1
        for g in degrees.values():
            count *= g
        cfg = ParallelConfig(degrees=degrees, devices=tuple(rng.sample(range(num_devices), count)))
        if recompute_refusal(op) is None:
            cfg = cfg.replace(recompute=rng.random() < 0.5)
        if shardable(op, shared):
            replicas = param_replicas(op, cfg)
            cfg = cfg.replace(shard=rng.choice([d for d in range(1, replicas + 1) if replicas % d == 0]))
        validate(op, cfg, num_devices)
        out[op.name] = cfg
    return Strategy(out)


def mixed_cnn_strategy(graph: OperatorGraph) -> Strategy:
    """The hand-written mixed strategy of the brief, on `SmallCNN` over 2 devices:

    conv1 sample-split on (0, 1); conv2 height-split on (1, 0) (halo rows cross ranks); the relus whole on
    device 1 and 0 (different device sets); fc1 parameter-split (out_features) on (0, 1); fc2
    reduction-split (in_features, partial sums) on (1, 0); everything else data parallel.
    """
    special = {
        "conv1": ParallelConfig(degrees={"sample": 2}, devices=(0, 1)),
        "conv2": ParallelConfig(degrees={"height": 2}, devices=(1, 0)),
        "relu1": ParallelConfig.single(1),
        "relu2": ParallelConfig.single(0),
        "fc1": ParallelConfig(degrees={"out_features": 2}, devices=(0, 1)),
        "fc2": ParallelConfig(degrees={"in_features": 2}, devices=(1, 0)),
    }
    missing = set(special) - {op.name for op in graph}
    assert not missing, f"SmallCNN's graph lacks {missing}"
    out = {}
    for op in graph:
        cfg = special.get(op.name)
        if cfg is None:
            sample = next((d for d in dims_of(op) if d.name == "sample" and d.splittable and d.size % 2 == 0),
                          None)
            cfg = (ParallelConfig(degrees={"sample": 2}, devices=(0, 1)) if sample is not None
                   else ParallelConfig.single(0))
        validate(op, cfg, 2)
        out[op.name] = cfg
    return Strategy(out)


# ---------------------------------------------------------------------- micro-batches (repeated devices)


def _sample_dim(op: Operator):
    return next((d for d in dims_of(op) if d.kind == DimKind.SAMPLE and d.splittable), None)


def sample_split(op: Operator, devices: tuple[int, ...]) -> ParallelConfig:
    """`op` split on its sample dim into one part per entry of `devices` (repeats: micro-batches), or whole
    on the first device where it has no sample dim that many parts divide; sources on device 0."""
    sample = _sample_dim(op)
    if op_def(op.kind).everywhere or sample is None or sample.size % len(devices):
        return ParallelConfig.single(0 if op_def(op.kind).everywhere else devices[0])
    return ParallelConfig(degrees={sample.name: len(devices)}, devices=devices)


def micro_dp_strategy(graph: OperatorGraph, num_devices: int, microbatches: int) -> Strategy:
    """Data parallelism with `microbatches` micro-batches per device: every op sample-split into
    num_devices x microbatches parts on (0, .., 0, 1, .., 1, ...), each device's block of the batch in
    consecutive micro-batches."""
    devices = tuple(d for d in range(num_devices) for _ in range(microbatches))
    return Strategy({op.name: sample_split(op, devices) for op in graph})


def pipeline_strategy(graph: OperatorGraph, num_devices: int, microbatches: int) -> Strategy:
    """A GPipe pipeline: the ops that compute cut into `num_devices` stages of consecutive ops (equal
    counts), stage s on device s, every op sample-split into `microbatches` micro-batches on it."""
    live = [op for op in graph if not op_def(op.kind).everywhere]
    stage = {op.name: k * num_devices // len(live) for k, op in enumerate(live)}
    return Strategy({op.name: sample_split(op, (stage.get(op.name, 0),) * microbatches) for op in graph})


def repeated_strategy(graph: OperatorGraph, num_devices: int, rng: random.Random, *, p: float = 0.75) -> Strategy:
    """A valid random strategy (`random_strategy`) in which each op, with probability `p`, keeps its
    degrees, perhaps with its sample split made 2 or 4 times finer, and draws the device of every part
    with replacement (so devices repeat, across any split: micro-batches, several parameter blocks or
    partial sums on one device), recomputing with probability 1/4, never sharding; where
    `soap.config.validate` refuses that (running statistics), the op keeps its drawn config."""
    base = random_strategy(graph, num_devices, rng)
    out = {}
    for op in graph:
        cfg = base[op.name]
        if not op_def(op.kind).everywhere and rng.random() < p:
            degrees = dict(cfg.degrees)
            sample = _sample_dim(op)
            grow = rng.choice([1, 2, 4])
            if sample is not None and sample.size % (degrees.get(sample.name, 1) * grow) == 0:
                degrees[sample.name] = degrees.get(sample.name, 1) * grow
            count = 1
            for g in degrees.values():
                count *= g
            drawn = ParallelConfig(degrees=degrees, devices=tuple(rng.randrange(num_devices) for _ in range(count)),
                                   recompute=rng.random() < 0.25)
            for candidate in (drawn, drawn.replace(recompute=False)):
                try:
                    validate(op, candidate, num_devices)
                except ConfigError:
                    continue
                cfg = candidate
                break
        out[op.name] = cfg
    return Strategy(out)


def _divisors(n: int) -> list[int]:
    return [g for g in range(1, n + 1) if n % g == 0]


def chunked(op: Operator, sample_devices: tuple[int, ...], chunks: int, *, hand_over: int = 0,
            num_devices: int = 1) -> ParallelConfig:
    """`op` (with a carried dim) split on its sample dim over `sample_devices` (one per sample range) and
    into `chunks` chunks along its carried dim, the chunks of each sample range on its device; with
    `hand_over` h > 0, chunk k of a range on the device k // h after its own (modulo `num_devices`): the
    state moves to the next device every h chunks."""
    carried = next(d for d in dims_of(op) if d.carried)
    degrees = {"sample": len(sample_devices), carried.name: chunks}
    devices = tuple((d + k // hand_over) % num_devices if hand_over else d
                    for d in sample_devices for k in range(chunks))
    return ParallelConfig(degrees=degrees, devices=devices)


def follow_chunks(op: Operator, producer: ParallelConfig, axis_dims: tuple[str, str]) -> ParallelConfig | None:
    """`op` split like a chunked LSTM `producer`: its dims `axis_dims` (sample, time) with the producer's
    `sample` and `seq` degrees on the same devices, or None where they do not divide."""
    dims = {d.name: d for d in dims_of(op)}
    if any(name not in dims for name in axis_dims):
        return None
    cfg = ParallelConfig(degrees={axis_dims[0]: producer.degree("sample"), axis_dims[1]: producer.degree("seq")},
                         devices=producer.devices)
    try:
        validate(op, cfg)
    except ConfigError:
        return None
    return cfg


def wavefront_strategy(graph: OperatorGraph, num_devices: int, chunks: int, *, samples: int = 1,
                       hand_over: int = 0) -> Strategy:
    """FlexFlow's wavefront: recurrent op k (in graph order) on device k mod `num_devices` (sample range s
    of `samples` on the next devices), each in `chunks` time chunks (with `hand_over` h > 0, moving on to
    the next device every h chunks: `chunked`); the ops after each one that keep its (sample, time)
    layout (dropouts) follow it, chunk by chunk; everything else whole on device 0."""
    out: dict[str, ParallelConfig] = {}
    last: ParallelConfig | None = None
    k = 0
    for op in graph:
        cfg = None
        if any(d.carried for d in dims_of(op)):
            cfg = chunked(op, tuple((k + s) % num_devices for s in range(samples)), chunks, hand_over=hand_over,
                          num_devices=num_devices)
            k += 1
        elif last is not None and op.kind == "dropout":
            cfg = follow_chunks(op, last, ("sample", "d1"))
        out[op.name] = cfg or ParallelConfig.single(0)
        if cfg is not None:
            last = cfg
        validate(op, out[op.name], num_devices)
    return Strategy(out)


def chunked_strategy(graph: OperatorGraph, num_devices: int, rng: random.Random) -> Strategy:
    """A random strategy with repeated devices (`repeated_strategy`) in which every op with a carried dim
    is split into 2 or more chunks along it (and on its sample dim at random), each sample range's chunks
    on one random device half the time, else each chunk on a random device (the state moving between
    devices), recomputing with probability 0.3, and each dropout after it follows it half the time."""
    base = repeated_strategy(graph, num_devices, rng)
    out = dict(base.configs)
    last = None
    for op in graph:
        carried = next((d for d in dims_of(op) if d.carried), None)
        if carried is not None:
            samples = rng.choice([g for g in _divisors(op.outputs[0].shape[0]) if g <= num_devices])
            chunks = rng.choice([g for g in _divisors(carried.size) if g > 1])
            last = out[op.name] = chunked(op, tuple(rng.randrange(num_devices) for _ in range(samples)), chunks)
            if rng.random() < 0.5:
                last = out[op.name] = last.replace(devices=tuple(rng.randrange(num_devices) for _ in last.devices))
            if rng.random() < 0.3:
                last = out[op.name] = last.replace(recompute=True)
            validate(op, last, num_devices)
        elif last is not None and op.kind == "dropout" and rng.random() < 0.5:
            out[op.name] = follow_chunks(op, last, ("sample", "d1")) or out[op.name]
    return Strategy(out)


def repeats(strategy: Strategy) -> int:
    """How many ops of `strategy` run two or more parts on one device."""
    return sum(len(set(cfg.devices)) < len(cfg.devices) for cfg in strategy.configs.values())


# ---------------------------------------------------------------------- the worker


def ddp_train(rank: int, world_size: int, *, build: Callable[[], Workload], options: TrainOptions
              ) -> dict[str, torch.Tensor]:
    """Train with torch's DistributedDataParallel on the same synthetic batches (rank r takes the r-th
    equal chunk of the batch); returns the final parameters."""
    dtype = torch.float64 if options.dtype == "float64" else torch.float32
    torch.manual_seed(options.seed)
    w = build()
    module = w.module.to(dtype)
    model = nn.parallel.DistributedDataParallel(module)
    optimizer = make_optimizer(list(model.parameters()), options.setup)
    graph = capture_workload(build)
    highs = integer_highs(graph, module)
    n = len(w.inputs)
    for step in range(options.steps):
        batch = synthetic_batch(w.example, step=step, seed=options.seed, highs=highs, dtype=dtype)
        mine = [t.chunk(world_size, dim=0)[rank] for t in batch]
        optimizer.zero_grad(set_to_none=True)
        w.loss_fn(model(*mine[:n]), mine[n]).backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def run_cases(rank: int, world_size: int, *, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run each case in order on this rank; a case is {"label", "kind": "train" or "ddp", ...}.

    "train": `train_rank` with verification (the result's `verify`, on rank 0). "ddp": DDP training and,
    on rank 0, the single-process chunked-BatchNorm reference, compared parameter by parameter.
    """
    out = []
    for case in cases:
        start = time.perf_counter()
        try:
            if case["kind"] == "train":
                r = train_rank(rank, world_size, build=case["build"], graph=case["graph"],
                               strategy=case["strategy"], options=case["options"])
                out.append({"label": case["label"], "verify": r.get("verify"), "losses": r["losses"],
                            "collectives": r["collectives"], "seconds": time.perf_counter() - start})
            else:
                params = ddp_train(rank, world_size, build=case["build"], options=case["options"])
                result: dict[str, Any] = {"label": case["label"], "seconds": 0.0}
                if rank == 0:
                    graph = OperatorGraph.from_dict(case["graph"])
                    _, ref, _ = reference_train(case["build"], graph, case["strategy"], case["options"])
                    result["max_param_rel_diff"] = max(
                        float((params[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in params)
                result["seconds"] = time.perf_counter() - start
                out.append(result)
                dist.barrier()
        except Exception:
            traceback.print_exc()
            raise RuntimeError(f"case {case['label']} failed on rank {rank}") from None
    return out


def train_case(label: str, model: str, strategy: Strategy, graph: OperatorGraph, *,
               options: TrainOptions | None = None) -> dict[str, Any]:
    return {"label": label, "kind": "train", "build": MODELS[model], "graph": graph.to_dict(),
            "strategy": configs(strategy), "options": options or DEFAULT_OPTIONS}


def space_strategy(graph: OperatorGraph, num_devices: int, rng: random.Random) -> Strategy:
    """A uniformly drawn point of the search's own proposal space (`search.space.ConfigSpace`): the
    strategies the MCMC can actually emit (contiguous or node-aligned device sets)."""
    from search.space import ConfigSpace
    from soap.topology import load_topology

    space = ConfigSpace(graph, load_topology(f"cpu-{num_devices}"))
    base = Strategy({op.name: ParallelConfig.single(0) for op in graph})
    return space.random_strategy(rng, base)


@functools.cache
def graph_of(model: str) -> OperatorGraph:
    """The captured graph of a test model (captured once per test session: capture takes about a second)."""
    return capture_workload(MODELS[model])


def baseline_case(model: str, name: str, num_devices: int, **kwargs: Any) -> dict[str, Any] | None:
    """A case for baseline `name` (dp, mp, tp, expert, fsdp, hybrid:...), or None where it does not apply to
    the model."""
    from search.baselines import BaselineNotApplicable, parse_baseline
    from soap.topology import load_topology

    graph = graph_of(model)
    try:
        strategy = parse_baseline(name)(graph, load_topology(f"cpu-{num_devices}"))
    except BaselineNotApplicable:
        return None
    return train_case(f"{model}/{name}", model, strategy, graph, **kwargs)


def planned_collectives(case: dict[str, Any], num_devices: int) -> list[dict[str, dict[str, int]]]:
    """What the simulator says a train case's step issues per rank (`Simulator.collectives`, from the
    step plan), on the `cpu-N` topology the run uses."""
    from simulator.engine import Simulator
    from soap.topology import load_topology

    graph = OperatorGraph.from_dict(case["graph"])
    strategy = Strategy({name: ParallelConfig.from_dict(c) for name, c in case["strategy"].items()})
    sim = Simulator(graph, load_topology(f"cpu-{num_devices}"), setup=case["options"].setup)
    sim.full(strategy)
    return sim.collectives()


def _counts(collectives: list[dict[str, dict[str, int]]]) -> list[dict[str, int]]:
    return [{kind: v["count"] for kind, v in rank.items()} for rank in collectives]


def run_one_process(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run `cases` in this process as rank 0 of 1 (one intra-op thread, as a launched rank), assert that
    every one matches (`failures`), and return the results."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = run_cases(0, 1, cases=cases)
    finally:
        torch.set_num_threads(threads)
    bad = failures(results, cases=cases, num_devices=1)
    assert not bad, "\n".join(bad)
    return results


def failures(results: list[dict[str, Any]], tol: float = TOL, cases: list[dict[str, Any]] | None = None,
             num_devices: int = 2) -> list[str]:
    """One line per case of rank 0's `results` that differs from its reference by more than `tol`, or
    (given the `cases`) whose collectives, as the runtime issued them, are not the planned ones."""
    bad = []
    for i, r in enumerate(results):
        if cases is not None and cases[i]["kind"] == "train":
            planned = planned_collectives(cases[i], num_devices)
            issued = r["collectives"]
            if cases[i]["options"].dtype != "float32":
                # the plan counts bytes in the graph's dtypes; a float64 run moves twice the floats' bytes
                planned, issued = _counts(planned), _counts(issued)
            if issued != planned:
                bad.append(f"{r['label']}: collectives issued {issued} != planned {planned}")
        if "verify" in r and r["verify"] is None:
            continue
        if "verify" in r:
            v = r["verify"]
            if not v["passed"]:
                bad.append(f"{r['label']}: loss {v['max_loss_rel_diff']:.3g}, param {v['max_param_rel_diff']:.3g} "
                           f"({v['worst_param']}), nan {v['nan_params']}, not held {v['params_not_held']}")
        elif not r["max_param_rel_diff"] <= tol:
            bad.append(f"{r['label']}: DDP vs chunked-BatchNorm reference {r['max_param_rel_diff']:.3g}")
    return bad


def small_mlp(batch_size: int = 8) -> tuple:
    """The zoo MLP at test size (16-32-16), as a model function for `soapflow.runner.run`."""
    return zoo.ZOO["mlp"].build(batch_size, sizes=(16, 32, 16))


def small_transformer(batch_size: int = 4) -> tuple:
    return zoo.ZOO["transformer"].build(batch_size, layers=2, d_model=16, heads=2, seq=8, context=None, vocab=32)


# ---------------------------------------------------------------------- training under a memory cap


def peak_train(rank: int, world_size: int, **kwargs: Any) -> dict[str, Any]:
    """`train_rank`, with `peak_bytes`: the most tensor bytes this rank held at once from the start (its
    build included) to the end of training (`runtime.memory.track_peak`); verification, whose
    single-process reference holds the whole model by design, is not counted."""
    import runtime.train as train
    from runtime.memory import track_peak
    tracking = track_peak()
    peak = tracking.__enter__()
    gather = train._gather_params

    stopped = []

    def stop_then_gather(*args: Any, **kw: Any) -> Any:
        if not stopped:  # (verification gathers the parameters, then the first step's gradients)
            tracking.__exit__(None, None, None)
            stopped.append(True)
        return gather(*args, **kw)

    train._gather_params = stop_then_gather
    try:
        result = train_rank(rank, world_size, **kwargs)
    finally:
        train._gather_params = gather
    return result | {"peak_bytes": peak.peak_bytes}


def built_whole(build: Callable[[], Workload]) -> Workload:
    """`build()`, refusing the meta device (reads a value): the runtime then builds the model whole."""
    if torch.empty(1).is_meta:
        float(torch.empty(1).sum())
    return build()
