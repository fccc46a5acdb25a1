"""Small Hugging Face models as soapflow model functions (`path/to/file.py:function`, see the README).

GPT-2, Llama (grouped-query attention, RMSNorm, rotary embeddings) and BERT (masked LM), and the wider
corpus of GPT-NeoX (Pythia), OPT, BLOOM, Mistral, Qwen2, Phi, Gemma, RoBERTa, BART and T5
(encoder-decoders), ViT, Swin and MobileNetV2 (image classification), Mixtral (mixture of experts) and
Falcon (multi-query attention), from tiny configs with random initialization: nothing is downloaded. Each
function takes the global batch and returns `(module, (inputs, target), loss_fn)`: the module maps token
ids `[N, T]` to logits `[N, T, vocab]`, the target is `[N, T]` token ids, the loss cross entropy over all
positions (the image models map images `[N, 3, 32, 32]` to class logits `[N, 10]` against labels `[N]`).
Attention uses PyTorch's fused kernel (`attn_implementation="sdpa"`) and every dropout is 0 (GPT-2 takes a
`dropout` for its residual, embedding and attention dropouts: attention with dropout captures written out,
`soap/capture/attention.py`; MobileNetV2 keeps its classifier's dropout).
Needs the optional extra `hf` (`pip install 'soapflow[hf]'`).
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


def gpt2(batch_size: int = 4, *, seq: int = SEQ, width: int = 64, heads: int = 4, dropout: float = 0.0) -> tuple:
    """GPT-2: 2 layers, width 64, 4 heads (its `Conv1D` linears are `addmm`), every dropout `dropout`."""
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(n_layer=2, n_embd=width, n_head=heads, vocab_size=VOCAB, n_positions=32, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                        attn_implementation="sdpa")
    return _example(AutoModelForCausalLM.from_config(config), batch_size, seq)


def gpt2_wide(batch_size: int = 2, *, seq: int = SEQ) -> tuple:
    """GPT-2: 2 layers, width 512, 8 heads, at a small batch: its weights outweigh its activations, so
    splitting attention heads and the MLP's parameters beats data parallelism (the corpus leaves it out)."""
    return gpt2(batch_size, seq=seq, width=512, heads=8)


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


_LM = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa")
"""What every causal LM config below shares: the vocabulary, special tokens and the fused attention."""


def _causal_lm(config) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config)


def gpt_neox(batch_size: int = 4, *, seq: int = SEQ) -> tuple:
    """GPT-NeoX (Pythia): 2 layers, width 64, 4 heads, partial rotary, parallel attention and MLP."""
    from transformers import GPTNeoXConfig

    config = GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           max_position_embeddings=32, attention_dropout=0.0, hidden_dropout=0.0, **_LM)
    return _example(_causal_lm(config), batch_size, seq)


def opt(batch_size: int = 4, *, seq: int = SEQ) -> tuple:
    """OPT: 2 layers, width 64, 4 heads, learned positions offset by 2."""
    from transformers import OPTConfig

    config = OPTConfig(hidden_size=64, ffn_dim=128, word_embed_proj_dim=64, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
                       layerdrop=0.0, **_LM)
    return _example(_causal_lm(config), batch_size, seq)


def bloom(batch_size: int = 4, *, seq: int = SEQ) -> tuple:
    """BLOOM: 2 layers, width 64, 4 heads, ALiBi position biases (no fused attention in HF)."""
    from transformers import BloomConfig

    lm = {k: v for k, v in _LM.items() if k != "attn_implementation"}
    config = BloomConfig(hidden_size=64, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0, **lm)
    return _example(_causal_lm(config), batch_size, seq)


def mistral(batch_size: int = 4, *, seq: int = SEQ) -> tuple:
    """Mistral: Llama-like, 2 layers, width 64, 4 query heads over 2 kv heads, sliding window 8."""
    from transformers import MistralConfig

    config = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=32, sliding_window=8, **_LM)
    return _example(_causal_lm(config), batch_size, seq)


def qwen2(batch_size: int = 4, *, seq: int = SEQ) -> tuple:
    """Qwen2: 2 layers, width 64, 4 query heads over 2 kv heads, biased q/k/v projections."""
    from transformers import Qwen2Config

    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=32, **_LM)
    return _example(_causal_lm(config), batch_size, seq)


def phi(batch_size: int = 4, *, seq: int = SEQ) -> tuple:
    """Phi: 2 layers, width 64, 4 heads, partial rotary, parallel attention and MLP, gelu_new."""
    from transformers import PhiConfig

    config = PhiConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       max_position_embeddings=32, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, **_LM)
    return _example(_causal_lm(config), batch_size, seq)


def gemma(batch_size: int = 4, *, seq: int = SEQ) -> tuple:
    """Gemma: 2 layers, width 64, 4 query heads of 16 over 1 kv head, (1 + w) RMSNorm, scaled embeddings."""
    from transformers import GemmaConfig

    config = GemmaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=16, max_position_embeddings=32, **_LM)
    return _example(_causal_lm(config), batch_size, seq)


def falcon(batch_size: int = 4, *, seq: int = SEQ) -> tuple:
    """Falcon: 2 layers, width 64, 4 query heads over 1 kv head (multi-query attention, broadcast by SDPA),
    linears written ``x @ w.T``, k and v indexed out of the fused projection."""
    from transformers import FalconConfig

    config = FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=1,
                          max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0, **_LM)
    return _example(_causal_lm(config), batch_size, seq)


def mixtral(batch_size: int = 4, *, seq: int = SEQ) -> tuple:
    """Mixtral: 2 layers, width 64, 4 query heads over 2 kv heads, 4 experts routed top-2."""
    from transformers import MixtralConfig

    config = MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=32, router_jitter_noise=0.0, **_LM)
    return _example(_causal_lm(config), batch_size, seq)


class LogitsAndRouterLoss(nn.Module):
    """A Hugging Face mixture of experts called on token ids, returning its logits and its load-balancing
    loss (``output_router_logits``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(input_ids=ids, output_router_logits=True)
        return out.logits, out.aux_loss


def lm_and_router_loss(output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    """The language-model loss plus the load-balancing loss at Mixtral's coefficient, 0.02."""
    logits, router_loss = output
    return lm_cross_entropy(logits, target) + 0.02 * router_loss


def mixtral_balanced(batch_size: int = 4, *, seq: int = SEQ) -> tuple:
    """Mixtral (as `mixtral`) trained with its load-balancing loss: the router's probabilities and picks over
    the whole batch (how many tokens each expert gets) enter the loss."""
    module, example, _ = mixtral(batch_size, seq=seq)
    return LogitsAndRouterLoss(module.model), example, lm_and_router_loss


def qwen2_moe(batch_size: int = 4, *, seq: int = SEQ) -> tuple:
    """Qwen2-MoE: 2 layers, width 64, 4 query heads over 2 kv heads, 4 experts routed top-2 beside a shared
    expert scaled by a sigmoid gate."""
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
                            **_LM)
    return _example(_causal_lm(config), batch_size, seq)


def deepseek_v3(batch_size: int = 4, *, seq: int = SEQ) -> tuple:
    """DeepSeek-V3: 2 layers, width 64, multi-head latent attention (kv rank 16), 4 routed experts (top-2 by
    sigmoid scores with a bias) beside a shared expert; its router's group masks stay opaque (no FLOPs)."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                              n_group=1, topk_group=1, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None,
                              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=32, **_LM)
    return _example(_causal_lm(config), batch_size, seq)


def roberta(batch_size: int = 4, *, seq: int = SEQ) -> tuple:
    """RoBERTa masked LM: 2 layers, width 64, 4 heads, positions counted from the padding index."""
    from transformers import RobertaConfig, RobertaForMaskedLM

    config = RobertaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           vocab_size=VOCAB, max_position_embeddings=40, pad_token_id=1, bos_token_id=0,
                           eos_token_id=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                           attn_implementation="sdpa")
    return _example(RobertaForMaskedLM(config), batch_size, seq)


def bart(batch_size: int = 4, *, seq: int = SEQ) -> tuple:
    """BART: encoder-decoder, 2 + 2 layers, width 64, 4 heads; the decoder reads the ids shifted right."""
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                        max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                        encoder_layerdrop=0.0, decoder_layerdrop=0.0, vocab_size=VOCAB, pad_token_id=1,
                        bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
                        attn_implementation="sdpa")
    return _example(BartForConditionalGeneration(config), batch_size, seq)


class ShiftedSeq2Seq(nn.Module):
    """A Hugging Face encoder-decoder that needs its decoder's ids (T5): the ids shifted right, as T5 makes
    them from labels."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, decoder_input_ids=self.model._shift_right(ids)).logits


def t5(batch_size: int = 4, *, seq: int = SEQ) -> tuple:
    """T5: encoder-decoder, 2 + 2 layers, width 64, 4 heads, relative position buckets (the bias masked by
    `torch.where`), T5's RMS-style layer norm, the decoder reading the ids shifted right."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, dropout_rate=0.0,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    module, example, loss = _example(T5ForConditionalGeneration(config), batch_size, seq)
    return ShiftedSeq2Seq(module.model), example, loss


class ClassLogitsOf(nn.Module):
    """A Hugging Face image classifier called on pixels alone, returning its class logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixels).logits


def vit(batch_size: int = 4, *, image: int = 32) -> tuple:
    """ViT image classification: 32x32 images in 8x8 patches (16 tokens + CLS), 2 layers, width 64, 10 classes."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       image_size=image, patch_size=8, num_labels=10, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    pixels = torch.empty(batch_size, 3, image, image, device="meta")
    labels = torch.empty(batch_size, dtype=torch.long, device="meta")
    return ClassLogitsOf(ViTForImageClassification(config)), (pixels, labels), lm_cross_entropy


def swin(batch_size: int = 4, *, image: int = 32) -> tuple:
    """Swin image classification: 32x32 images in 4x4 patches, 2 stages of 2 windowed attention blocks
    (windows of 4, padded to them, shifted in the second block of a stage: a relative position bias table
    read by a constant index), patch merging, stochastic depth at its default rate (drawn by ``torch.rand``),
    10 classes."""
    from transformers import SwinConfig, SwinForImageClassification

    config = SwinConfig(image_size=image, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4,
                        num_labels=10, drop_path_rate=0.1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    pixels = torch.empty(batch_size, 3, image, image, device="meta")
    labels = torch.empty(batch_size, dtype=torch.long, device="meta")
    return ClassLogitsOf(SwinForImageClassification(config)), (pixels, labels), lm_cross_entropy


def mobilenet_v2(batch_size: int = 4, *, image: int = 32) -> tuple:
    """MobileNetV2 image classification (TensorFlow-style padding: explicit pads before the convolutions;
    an in-place dropout through a flatten before the classifier), a quarter of the channels, 10 classes."""
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    config = MobileNetV2Config(image_size=image, depth_multiplier=0.25, num_labels=10, classifier_dropout_prob=0.1)
    pixels = torch.empty(batch_size, 3, image, image, device="meta")
    labels = torch.empty(batch_size, dtype=torch.long, device="meta")
    return ClassLogitsOf(MobileNetV2ForImageClassification(config)), (pixels, labels), lm_cross_entropy


MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert, "gpt_neox": gpt_neox, "opt": opt, "bloom": bloom,
          "mistral": mistral, "qwen2": qwen2, "phi": phi, "gemma": gemma, "roberta": roberta, "bart": bart,
          "vit": vit, "mixtral": mixtral, "mixtral_balanced": mixtral_balanced, "qwen2_moe": qwen2_moe,
          "deepseek_v3": deepseek_v3, "falcon": falcon, "swin": swin, "mobilenet_v2": mobilenet_v2, "t5": t5}
