"""Small Hugging Face models as soapflow model functions (`path/to/file.py:function`, see the README).

GPT-2, Llama (grouped-query attention, RMSNorm, rotary embeddings) and BERT (masked LM) from tiny configs
with random initialization: nothing is downloaded. Each function takes the global batch and returns
`(module, (inputs, target), loss_fn)`: the module maps token ids `[N, T]` to logits `[N, T, vocab]`, the
target is `[N, T]` token ids, the loss cross entropy over all positions. Attention uses PyTorch's fused
kernel (`attn_implementation="sdpa"`) and every dropout is 0, as soapflow captures attention only without
dropout. Needs the optional extra `hf` (`pip install 'soapflow[hf]'`).
"""

from __future__ import annotations

import torch
from torch import nn

from soapflow.zoo.losses import lm_cross_entropy

VOCAB = 128
SEQ = 16


class LogitsOf(nn.Module):
    """A Hugging Face model called on token ids alone, returning its logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits


def _example(module: nn.Module, batch_size: int, seq: int) -> tuple:
    ids = torch.empty(batch_size, seq, dtype=torch.long, device="meta")
    target = torch.empty(batch_size, seq, dtype=torch.long, device="meta")
    return LogitsOf(module), (ids, target), lm_cross_entropy


def gpt2(batch_size: int = 4, *, seq: int = SEQ) -> tuple:
    """GPT-2: 2 layers, width 64, 4 heads (its `Conv1D` linears are `addmm`)."""
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        attn_implementation="sdpa")
    return _example(AutoModelForCausalLM.from_config(config), batch_size, seq)


def llama(batch_size: int = 4, *, seq: int = SEQ) -> tuple:
    """Llama: 2 layers, width 64, 4 query heads sharing 2 kv heads, RMSNorm, rotary positions."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0, attn_implementation="sdpa")
    return _example(AutoModelForCausalLM.from_config(config), batch_size, seq)


def bert(batch_size: int = 4, *, seq: int = SEQ) -> tuple:
    """BERT masked LM: 2 layers, width 64, 4 heads."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        vocab_size=VOCAB, max_position_embeddings=32, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    return _example(BertForMaskedLM(config), batch_size, seq)


MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert}
