"""The model zoo: canonical parameter counts, meta example batches, real forward passes of small versions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from soapflow import zoo
from soapflow.zoo.cnn import alexnet, resnet18, resnet50, resnet101
from soapflow.zoo.inception import inception_v3
from soapflow.zoo.mlp import mlp
from soapflow.zoo.rnn import nmt, rnnlm, rnntc
from soapflow.zoo.transformer import transformer

CANONICAL_PARAMS = {
    "alexnet": 61_100_840,
    "resnet18": 11_689_512,
    "resnet50": 25_557_032,
    "resnet101": 44_549_160,
    "inception_v3": 23_834_568,
}

SMALL_RNN = {"hidden": 32, "embed": 16, "vocab": 64, "steps": 8}


def _num_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _as_tuple(inputs) -> tuple[torch.Tensor, ...]:
    return inputs if isinstance(inputs, tuple) else (inputs,)


def _real_like(t: torch.Tensor, high: int) -> torch.Tensor:
    """A CPU tensor of `t`'s shape and dtype: ids in [0, high) for integer dtypes, normal floats otherwise."""
    if t.dtype == torch.long:
        return torch.randint(0, high, t.shape)
    return torch.randn(t.shape)


def _default_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if target.dtype == torch.long:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
    return F.mse_loss(output, target)


def _forward(result: tuple, *, high: int, positions: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the built module on real random tensors of the example shapes; return (output, loss)."""
    module, (inputs, target) = result[0], result[1]
    loss_fn = result[2] if len(result) == 3 else _default_loss
    real = tuple(_real_like(t, high) for t in _as_tuple(inputs))
    if positions:
        tokens, pos = real
        real = (tokens, torch.arange(pos.shape[1]).expand(pos.shape))
    real_target = _real_like(target, high)
    output = module(*real)
    return output, loss_fn(output, real_target)


@pytest.mark.parametrize("name", sorted(CANONICAL_PARAMS))
def test_canonical_parameter_counts(name):
    module = zoo.get(name).build(2)[0]
    assert _num_params(module) == CANONICAL_PARAMS[name]


def test_zoo_names_and_defaults():
    assert list(zoo.ZOO) == ["mlp", "alexnet", "resnet18", "resnet50", "resnet101", "inception_v3",
                             "rnntc", "rnnlm", "nmt", "transformer"]
    for name, entry in zoo.ZOO.items():
        assert entry.name == name
        assert entry.description and "\n" not in entry.description
    assert zoo.get("alexnet").default_batch == 256
    assert zoo.get("transformer").default_batch == 8
    assert {zoo.get(n).default_batch for n in ("mlp", "resnet50", "inception_v3", "nmt")} == {64}


@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_every_entry_builds_with_meta_batch(name):
    result = zoo.get(name).build(2)
    assert len(result) in (2, 3)
    module, (inputs, target) = result[0], result[1]
    assert isinstance(module, torch.nn.Module)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in module.parameters())
    for t in (*_as_tuple(inputs), target):
        assert t.device.type == "meta"
        assert t.shape[0] == 2
    if len(result) == 3:
        assert callable(result[2])


def test_huge_batch_costs_nothing():
    _, (images, labels) = alexnet(4096)
    assert images.shape == (4096, 3, 224, 224) and images.is_meta
    assert labels.dtype == torch.long and labels.is_meta


def test_get_unknown_names_the_known_models():
    with pytest.raises(ValueError, match="unknown model 'nope'; known: mlp, alexnet, .*transformer"):
        zoo.get("nope")


def test_zoo_model_rejects_nonpositive_batch():
    with pytest.raises(ValueError, match="default_batch"):
        zoo.ZooModel(name="x", build=mlp, default_batch=0, description="x")


def test_mlp_forward():
    result = mlp(3, sizes=(8, 16, 12, 4))
    assert _num_params(result[0]) == (8 * 16 + 16) + (16 * 12 + 12) + (12 * 4 + 4)
    output, loss = _forward(result, high=1)
    assert output.shape == (3, 4)
    assert torch.isfinite(loss)


@pytest.mark.parametrize(("builder", "image_size"), [(alexnet, 224), (resnet18, 224), (resnet50, 224),
                                                      (resnet101, 224), (inception_v3, 299)])
def test_cnn_forward(builder, image_size):
    torch.manual_seed(0)
    result = builder(2, num_classes=10, image_size=image_size)
    assert result[1][0].shape == (2, 3, image_size, image_size)
    with torch.no_grad():
        output, loss = _forward(result, high=10)
    assert output.shape == (2, 10)
    assert torch.isfinite(loss)


def test_rnntc_forward():
    result = rnntc(3, **SMALL_RNN, num_classes=5)
    module = result[0]
    assert [type(m).__name__ for m in module.lstms] == ["LSTM"] * 4
    assert all(m.num_layers == 1 and m.batch_first for m in module.lstms)
    output, loss = _forward(result, high=5)
    assert output.shape == (3, 5)
    assert torch.isfinite(loss)


def test_rnnlm_forward():
    result = rnnlm(3, **SMALL_RNN)
    assert len(result[0].lstms) == 2
    assert result[1][0].dtype == result[1][1].dtype == torch.long
    output, loss = _forward(result, high=64)
    assert output.shape == (3, 8, 64)
    assert torch.isfinite(loss)


def test_nmt_forward():
    result = nmt(3, **SMALL_RNN)
    module = result[0]
    assert len(module.encoder) == len(module.decoder) == 4
    assert all(m.num_layers == 1 and m.batch_first for m in (*module.encoder, *module.decoder))
    (src, tgt_in), target = result[1]
    assert src.shape == tgt_in.shape == target.shape == (3, 8)
    output, loss = _forward(result, high=64)
    assert output.shape == (3, 8, 64)
    assert torch.isfinite(loss)


def test_rnn_canonical_sizes():
    module, (tokens, _), _ = rnnlm(2)
    assert tokens.shape == (2, 40)
    lstm = 4 * (1024 * 1024 + 1024 * 1024 + 2 * 1024)
    assert _num_params(module) == 32768 * 1024 + 2 * lstm + (1024 * 32768 + 32768)


def test_transformer_small_forward_and_causality():
    torch.manual_seed(0)
    result = transformer(2, layers=2, d_model=64, heads=4, seq=16, vocab=128)
    module = result[0]
    (tokens, positions), target = result[1]
    assert tokens.shape == positions.shape == target.shape == (2, 16)
    assert tokens.dtype == positions.dtype == torch.long
    output, loss = _forward(result, high=128, positions=True)
    assert output.shape == (2, 16, 128)
    assert torch.isfinite(loss)

    x = torch.randint(0, 128, (1, 16))
    y = x.clone()
    y[0, -1] = (x[0, -1] + 1) % 128
    pos = torch.arange(16).expand(1, 16)
    with torch.no_grad():
        a, b = module(x, pos), module(y, pos)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_transformer_is_gpt2_small_by_default():
    module, ((tokens, positions), _), _ = transformer(1)
    assert _num_params(module) == 124_439_808 + 50257 * 768
    assert module.lm_head.bias is None
    # 1024 learned positions, trained on 256 tokens: the default batch fits a 24 GB machine twice
    assert module.wpe.num_embeddings == 1024 and tokens.shape == positions.shape == (1, 256)
    assert all(block.attn.attention == "sdpa" for block in module.blocks)


def test_transformer_sdpa_and_explicit_attention_agree():
    torch.manual_seed(0)
    sdpa = transformer(2, layers=2, d_model=32, heads=4, seq=8, vocab=64)[0]
    explicit = transformer(2, layers=2, d_model=32, heads=4, seq=8, vocab=64, attention="explicit")[0]
    explicit.load_state_dict(sdpa.state_dict())
    tokens, positions = torch.randint(0, 64, (2, 8)), torch.arange(8).expand(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(sdpa(tokens, positions), explicit(tokens, positions))
    with pytest.raises(ValueError, match="attention must be one of sdpa, explicit"):
        transformer(1, layers=1, d_model=16, heads=2, seq=4, vocab=8, attention="flash")


def test_dropout_defaults_to_zero():
    small = (alexnet(1), inception_v3(1), rnntc(1, **SMALL_RNN), rnnlm(1, **SMALL_RNN), nmt(1, **SMALL_RNN),
             transformer(1, layers=1, d_model=16, heads=2, seq=4, vocab=8))
    for result in small:
        module = result[0]
        rates = [m.p for m in module.modules() if isinstance(m, torch.nn.Dropout)]
        assert rates and all(p == 0.0 for p in rates)
