"""Capture (`soap/capture/`): op kinds, names, shapes, parameters, FLOPs, opaque ops, the fx fallback,
fingerprints, and every zoo model.

Shapes are checked against a real forward pass of the same module on a small real batch; capture itself
only ever sees meta tensors here.
"""

from __future__ import annotations

import re
import time
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import soap.capture as capture_module
from soap.capture import capture
from soap.graph import OperatorGraph

OP_KINDS_DOC = Path(__file__).resolve().parents[1] / "docs" / "op_kinds.md"


def meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def leaf_output_shapes(module: nn.Module, *inputs: torch.Tensor) -> dict[str, tuple[int, ...]]:
    """Output shape of every leaf-module call in a real forward pass, keyed as capture names ops."""
    shapes: dict[str, tuple[int, ...]] = {}
    hooks = []
    for path, sub in module.named_modules():
        if path and capture_module._is_leaf(sub):
            def record(mod, args, out, path=path):
                out = out[0] if isinstance(out, tuple) else out
                name = path if path not in shapes else f"{path}_{sum(k.startswith(path) for k in shapes)}"
                shapes[name] = tuple(out.shape)
            hooks.append(sub.register_forward_hook(record))
    with torch.no_grad():
        module(*inputs)
    for h in hooks:
        h.remove()
    return shapes


def check_common(graph: OperatorGraph, module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
    """Param total, loss last, leaf-module output shapes equal to a real forward pass."""
    assert graph.num_params == sum(p.numel() for p in module.parameters())
    assert graph.ops[-1].kind == "loss" and graph.ops[-1].name == "loss"
    assert graph.ops[-1].outputs[0].shape == ()
    for name, shape in leaf_output_shapes(module, *inputs).items():
        if name not in graph and f"{name}.a" in graph:  # a fused projection split per piece
            pieces = [op.outputs[0].shape for op in graph if op.name.rpartition(".")[0] == name]
            assert {p[:-1] for p in pieces} == {shape[:-1]} and sum(p[-1] for p in pieces) == shape[-1], name
            continue
        assert graph[name].outputs[0].shape == shape, name
    for op in graph:
        if op.inputs:
            shapes = [list(s) for s in op.attrs["input_shapes"]]
            assert [list(graph.tensor(r).shape) for r in op.inputs] == shapes


class MLP(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, width)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def test_mlp_ops_names_shapes_and_flops():
    model, x, y = MLP(), torch.randn(4, 16), torch.randn(4, 8)
    graph = capture(model, meta_like(x), meta_like(y), name="mlp")
    assert [(op.name, op.kind) for op in graph] == [
        ("input0", "input"), ("target", "input"), ("fc1", "linear"), ("act", "elementwise"),
        ("fc2", "linear"), ("loss", "loss")]
    assert graph.batch_size == 4 and graph.name == "mlp"
    assert dict(graph["input0"].attrs) == {"position": 0, "role": "input"}
    assert dict(graph["target"].attrs) == {"position": 1, "role": "target"}
    assert {k: p.fqn for k, p in graph["fc1"].params.items()} == {"weight": "fc1.weight", "bias": "fc1.bias"}
    assert graph["act"].attrs["fn"] == "relu"
    assert graph["loss"].attrs["fn"] == "mse" and graph["loss"].attrs["reduction"] == "mean"
    assert [r.op for r in graph["loss"].inputs] == ["fc2", "target"]
    check_common(graph, model, (x,))
    # fc1 reads the batch, which needs no gradient: its backward is the weight gradient alone.
    assert graph["fc1"].fwd_flops == 2 * 4 * 16 * 32 == graph["fc1"].bwd_flops
    assert graph["fc2"].bwd_flops == 2 * graph["fc2"].fwd_flops == 2 * (2 * 4 * 32 * 8)
    op = graph["fc2"]
    assert op.fwd_bytes == 4 * (4 * 32 + 4 * 8 + 32 * 8 + 8) and op.bwd_bytes == 2 * op.fwd_bytes


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding="same")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.conv2(out) + x)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 5, stride=2, padding=2)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.block = Block(8)
        self.avg = nn.AdaptiveAvgPool2d((2, 2))
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block(self.pool(self.stem(x)))
        x = F.avg_pool2d(x, 2, ceil_mode=True)
        return self.fc(torch.flatten(self.avg(x), 1))


def test_cnn_residual_batchnorm_pool_flatten():
    model, x, y = SmallCNN(), torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    tracked = model.block.bn1.num_batches_tracked.clone()
    graph = capture(model, meta_like(x), meta_like(y))
    assert [(op.name, op.kind) for op in graph] == [
        ("input0", "input"), ("target", "input"), ("stem", "conv2d"), ("pool", "pool2d"),
        ("block.conv1", "conv2d"), ("block.bn1", "batchnorm"), ("block.relu", "elementwise"),
        ("block.conv2", "conv2d"), ("block.add", "binary"), ("block.relu_1", "elementwise"),
        ("avg_pool2d", "pool2d"), ("avg", "adaptive_pool2d"), ("flatten", "reshape"), ("fc", "linear"),
        ("loss", "loss")]
    assert torch.equal(model.block.bn1.num_batches_tracked, tracked)
    check_common(graph, model, (x,))
    stem = graph["stem"]
    assert {k: list(v) if isinstance(v, tuple) else v for k, v in stem.attrs.items() if k != "input_shapes"} \
        == {"stride": [2, 2], "padding": [2, 2], "dilation": [1, 1], "groups": 1}
    assert set(stem.params) == {"weight", "bias"} and set(graph["block.conv1"].params) == {"weight"}
    assert list(graph["block.conv2"].attrs["padding"]) == [1, 1]
    bn = graph["block.bn1"].attrs
    assert (bn["running_mean"], bn["running_var"], bn["eps"]) == ("block.bn1.running_mean",
                                                                  "block.bn1.running_var", 1e-5)
    pool = graph["pool"].attrs
    assert (pool["mode"], list(pool["kernel"]), list(pool["stride"]), list(pool["padding"])) == (
        "max", [3, 3], [2, 2], [1, 1])
    avg = graph["avg_pool2d"].attrs
    assert (avg["mode"], list(avg["stride"]), avg["ceil_mode"]) == ("avg", [2, 2], True)
    assert [r.op for r in graph["block.add"].inputs] == ["block.conv2", "pool"]
    assert graph["flatten"].outputs[0].shape == (2, 32) and list(graph["flatten"].attrs["shape"]) == [2, 32]
    assert graph["loss"].attrs["fn"] == "cross_entropy"
    assert graph["stem"].fwd_flops == 2 * 2 * 8 * 16 * 16 * 3 * 5 * 5
    assert graph["block.relu"].fwd_flops == 2 * 8 * 8 * 8


class LSTMLM(nn.Module):
    def __init__(self, vocab: int = 50, embed: int = 12, hidden: int = 16) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embedding(tokens))
        return self.decoder(out)


def lm_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def test_lstm_language_model():
    model = LSTMLM()
    x, y = torch.randint(0, 50, (3, 7)), torch.randint(0, 50, (3, 7))
    graph = capture(model, meta_like(x), meta_like(y), lm_loss)
    assert [(op.name, op.kind) for op in graph] == [
        ("input0", "input"), ("target", "input"), ("embedding", "embedding"), ("lstm", "lstm"),
        ("decoder", "linear"), ("loss.reshape", "reshape"), ("loss.reshape_1", "reshape"), ("loss", "loss")]
    check_common(graph, model, (x,))
    lstm = graph["lstm"]
    assert [t.shape for t in lstm.outputs] == [(3, 7, 16), (1, 3, 16), (1, 3, 16)]
    assert {k: p.fqn for k, p in lstm.params.items()} == {
        k: f"lstm.{k}" for k in ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0")}
    assert (lstm.attrs["hidden_size"], lstm.attrs["num_layers"]) == (16, 1)
    assert lstm.fwd_flops == 8 * 3 * 7 * 16 * (12 + 16) and lstm.bwd_flops == 2 * lstm.fwd_flops
    assert graph["embedding"].inputs[0].op == "input0" and graph["embedding"].attrs["padding_idx"] is None
    assert graph["input0"].outputs[0].dtype == "int64"
    assert graph["loss.reshape"].outputs[0].shape == (21, 50)
    assert [r.op for r in graph["loss"].inputs] == ["loss.reshape", "loss.reshape_1"]


class RecurrentLM(nn.Module):
    """Embedding, a torch.nn recurrent module `cell` (GRU or RNN) and a decoder over the vocabulary."""

    def __init__(self, cell: type[nn.Module], vocab: int = 50, embed: int = 12, hidden: int = 16, **kw) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.rnn = cell(embed, hidden, batch_first=True, **kw)
        self.decoder = nn.Linear(hidden * (2 if kw.get("bidirectional") else 1), vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embedding(tokens))
        return self.decoder(out)


@pytest.mark.parametrize(("cell", "kw", "kind", "attrs", "flops"), [
    # GRU: 6 N T H (I + H) + 10 N T H per layer; RNN: 2 N T H (I + H) per layer (I = H above the first)
    (nn.GRU, {}, "gru", {}, 6 * 3 * 7 * 16 * (12 + 16) + 10 * 3 * 7 * 16),
    (nn.GRU, {"num_layers": 2}, "gru", {}, 6 * 3 * 7 * 16 * (12 + 16 + 32) + 2 * 10 * 3 * 7 * 16),
    (nn.RNN, {}, "rnn", {"nonlinearity": "tanh"}, 2 * 3 * 7 * 16 * (12 + 16)),
    (nn.RNN, {"num_layers": 2, "nonlinearity": "relu"}, "rnn", {"nonlinearity": "relu"},
     2 * 3 * 7 * 16 * (12 + 16 + 32)),
], ids=["gru", "gru-2-layers", "rnn-tanh", "rnn-relu-2-layers"])
def test_gru_and_rnn_language_models(cell, kw, kind, attrs, flops):
    """nn.GRU and nn.RNN (tanh or relu) become one op of kind gru or rnn, with torch's parameter names,
    outputs out [N, T, H] and h_n [L, N, H], and their zero initial state folded in."""
    model = RecurrentLM(cell, **kw)
    x, y = torch.randint(0, 50, (3, 7)), torch.randint(0, 50, (3, 7))
    graph = capture(model, meta_like(x), meta_like(y), lm_loss)
    assert [(op.name, op.kind) for op in graph] == [
        ("input0", "input"), ("target", "input"), ("embedding", "embedding"), ("rnn", kind),
        ("decoder", "linear"), ("loss.reshape", "reshape"), ("loss.reshape_1", "reshape"), ("loss", "loss")]
    check_common(graph, model, (x,))
    op = graph["rnn"]
    layers = kw.get("num_layers", 1)
    assert [t.shape for t in op.outputs] == [(3, 7, 16), (layers, 3, 16)]
    assert {k: p.fqn for k, p in op.params.items()} == {
        f"{k}{n}": f"rnn.{k}{n}" for n in range(layers)
        for k in ("weight_ih_l", "weight_hh_l", "bias_ih_l", "bias_hh_l")}
    wanted = {"hidden_size": 16, "num_layers": layers, **attrs}
    assert {k: v for k, v in op.attrs.items() if k != "input_shapes"} == wanted
    assert op.fwd_flops == flops and op.bwd_flops == 2 * flops


@pytest.mark.parametrize(("cell", "kind"), [(nn.LSTM, "lstm"), (nn.GRU, "gru"), (nn.RNN, "rnn")])
def test_bidirectional_recurrences_run_one_op_per_layer_and_direction(cell, kind):
    """A bidirectional two-layer module is four one-layer recurrences, each holding its own layer and
    direction's parameters; the reverse ones read and write through a flip of the time axis, each layer's
    directions are concatenated, and the whole graph has the module's FLOPs."""
    model = RecurrentLM(cell, num_layers=2, bidirectional=True)
    x, y = torch.randint(0, 50, (3, 7)), torch.randint(0, 50, (3, 7))
    graph = capture(model, meta_like(x), meta_like(y), lm_loss)
    recurrences = [op for op in graph if op.kind == kind]
    assert [op.name for op in recurrences] == ["rnn", "rnn_1", "rnn_2", "rnn_3"]
    assert [op.params["weight_ih_l0"].fqn for op in recurrences] == [
        "rnn.weight_ih_l0", "rnn.weight_ih_l0_reverse", "rnn.weight_ih_l1", "rnn.weight_ih_l1_reverse"]
    assert all(op.attrs["num_layers"] == 1 and op.outputs[0].shape == (3, 7, 16) for op in recurrences)
    flips = [op for op in graph if op.kind == "flip"]
    assert [(op.inputs[0].op, tuple(op.attrs["axes"])) for op in flips] == [
        ("embedding", (1,)), ("rnn_1", (1,)), ("cat", (1,)), ("rnn_3", (1,))]
    assert [[r.op for r in op.inputs] for op in graph if op.kind == "concat"] == [
        ["rnn", "flip_1"], ["rnn_2", "flip_3"]]
    assert graph.num_params == sum(p.numel() for p in model.parameters())
    assert not [op.name for op in graph if op.kind == "opaque"]


@pytest.mark.parametrize(("cell", "kind", "kw", "layers"), [
    (nn.RNN, "rnn", {"num_layers": 3}, 3), (nn.LSTM, "lstm", {"bidirectional": True, "num_layers": 2}, 4)])
def test_dropout_between_layers_runs_layer_by_layer(cell, kind, kw, layers):
    """In training, a stacked recurrence with dropout between its layers is one op per layer (and
    direction) with a ``dropout`` op after each layer but the last; in evaluation it has no dropout (and is
    one op where it is not bidirectional)."""
    x, y = torch.randint(0, 50, (3, 7)), torch.randint(0, 50, (3, 7))
    model = RecurrentLM(cell, dropout=0.4, **kw)
    graph = capture(model, meta_like(x), meta_like(y), lm_loss)
    assert [op.kind for op in graph if op.kind in (kind, "dropout")].count(kind) == layers
    assert [op.attrs["p"] for op in graph if op.kind == "dropout"] == [0.4] * (kw["num_layers"] - 1)
    assert not [op.name for op in graph if op.kind == "opaque"]
    graph = capture(model.eval(), meta_like(x), meta_like(y), lm_loss)
    assert not [op for op in graph if op.kind == "dropout"] and [op.kind for op in graph].count(kind) == (
        layers if kw.get("bidirectional") else 1)


@pytest.mark.parametrize(("cell", "kw"), [(nn.GRU, {"bias": False}), (nn.LSTM, {"proj_size": 8})],
                         ids=["gru-no-bias", "lstm-proj"])
def test_recurrent_modules_outside_the_kinds_stay_opaque(cell, kw):
    """What the recurrent kinds do not cover (no biases, an LSTM's projection) runs whole as an opaque op."""
    model = RecurrentLM(cell, **kw)
    if kw.get("proj_size"):
        model.decoder = nn.Linear(kw["proj_size"], 50)
    x, y = torch.randint(0, 50, (3, 7)), torch.randint(0, 50, (3, 7))
    graph = capture(model, meta_like(x), meta_like(y), lm_loss)
    assert graph["rnn"].kind == "opaque"
    assert not {"lstm", "gru", "rnn"} & {op.kind for op in graph}


def test_default_loss_flattens_sequence_logits():
    model = LSTMLM()
    graph = capture(model, torch.empty(2, 5, dtype=torch.long, device="meta"),
                    torch.empty(2, 5, dtype=torch.long, device="meta"))
    assert [op.kind for op in graph.ops[-3:]] == ["reshape", "reshape", "loss"]


class TinyAttention(nn.Module):
    """Self-attention written with matmul, softmax and transposes, then again with F.sdpa."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.scale = nn.Parameter(torch.ones(d))
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (z.view(n, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        weights = torch.softmax(q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5, dim=-1)
        y = (weights @ v).permute(0, 2, 1, 3).reshape(n, t, d)
        z = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(n, t, d)
        return self.proj((y + z) * self.scale).mean(dim=1)


def test_attention_block():
    model, x, y = TinyAttention(), torch.randn(2, 5, 16), torch.randn(2, 16)
    graph = capture(model, meta_like(x), meta_like(y))
    kinds = {op.name: op.kind for op in graph}
    check_common(graph, model, (x,))
    # the fused projection and its chunk became one linear per piece over its block of the weight
    assert "chunk" not in graph and "qkv" not in graph
    pieces = [graph[f"qkv.{c}"] for c in "abc"]
    assert [(op.kind, op.outputs[0].shape) for op in pieces] == [("linear", (2, 5, 16))] * 3
    assert [(p.params["weight"].offset, p.params["bias"].offset) for p in pieces] == [
        ((0, 0), (0,)), ((16, 0), (16,)), ((32, 0), (32,))]
    assert {p.params["weight"].whole_shape for p in pieces} == {(48, 16)}
    views = [graph[name] for name in ("view", "view_1", "view_2")]
    assert [(op.inputs[0].op, op.inputs[0].index) for op in views] == [(f"qkv.{c}", 0) for c in "abc"]
    assert kinds["matmul"] == "matmul" and kinds["matmul_1"] == "matmul"
    assert graph["matmul"].outputs[0].shape == (2, 2, 5, 5)
    assert list(graph["transpose_3"].attrs["perm"]) == [0, 1, 3, 2]
    assert dict(graph["div"].attrs)["fn"] == "scale"
    assert graph["softmax"].attrs["axis"] == 3 and not graph["softmax"].attrs["log"]
    assert list(graph["permute"].attrs["perm"]) == [0, 2, 1, 3]
    attention = graph["scaled_dot_product_attention"]
    assert attention.kind == "attention" and attention.attrs["is_causal"] and attention.attrs["scale"] is None
    assert attention.fwd_flops > 0
    assert kinds["add"] == "binary"
    mul = graph["mul"]
    assert mul.kind == "binary" and mul.params["other"].fqn == "scale" and mul.attrs["param_operand"] == 1
    assert len(mul.inputs) == 1
    assert kinds["mean"] == "reduce" and list(graph["mean"].attrs["axes"]) == [1]


@torch.library.custom_op("soapflow_test::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


@double.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class WithUnknownOps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return double(torch.cumsum(self.fc(x), dim=1)).to(torch.float64).float()


def test_unknown_ops_become_opaque():
    model, x, y = WithUnknownOps(), torch.randn(3, 6), torch.randn(3, 6)
    graph = capture(model, meta_like(x), meta_like(y))
    cumsum, custom = graph["cumsum"], graph["double"]
    assert cumsum.kind == custom.kind == "opaque"
    assert cumsum.attrs["target"] == "torch.ops.aten.cumsum.default"
    assert [dict(a) if isinstance(a, dict | type(cumsum.attrs)) else a for a in cumsum.attrs["args"]] == [
        {"input": 0}, 1]
    assert custom.attrs["target"] == "torch.ops.soapflow_test.double.default"
    casts = [op for op in graph if op.kind == "opaque" and op.name.startswith("to")]
    assert casts and dict(casts[0].attrs["args"][1]) == {"dtype": "float64"}
    assert graph.ops[-1].kind == "loss"
    kernels = pytest.importorskip("runtime.kernels")
    value = model.fc(x)
    for op in (cumsum, custom, *casts):
        (value,) = kernels.run_opaque(op, None, [value])
    assert torch.allclose(value, model(x))


def test_repeated_module_calls_get_numbered_names():
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.relu = nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.relu(self.fc(self.relu(x))))

    graph = capture(Twice(), torch.empty(2, 4, device="meta"), torch.empty(2, 4, device="meta"))
    assert [op.name for op in graph][2:-1] == ["relu", "fc", "relu_1", "fc_1"]
    assert graph["fc"].params["weight"].fqn == graph["fc_1"].params["weight"].fqn == "fc.weight"
    assert graph.num_params == 20


def test_fingerprint_is_stable_and_sees_widths():
    x, y = torch.empty(4, 16, device="meta"), torch.empty(4, 8, device="meta")
    first = capture(MLP(32), x, y)
    assert capture(MLP(32), x, y).fingerprint == first.fingerprint
    assert capture(MLP(48), x, y).fingerprint != first.fingerprint
    assert capture(MLP(32), torch.empty(8, 16), torch.empty(8, 8)).fingerprint != first.fingerprint


def test_meta_and_real_inputs_agree_and_huge_meta_batches_are_free():
    model = SmallCNN()
    real = capture(model, torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,)))
    meta = capture(model, torch.empty(2, 3, 32, 32, device="meta"), torch.empty(2, dtype=torch.long,
                                                                                  device="meta"))
    assert real.fingerprint == meta.fingerprint
    # 4096 x 3 x 299 x 299 float32 is 4.4 GB, and every activation larger still.
    start = time.perf_counter()
    huge = capture(model, torch.empty(4096, 3, 299, 299, device="meta"),
                   torch.empty(4096, dtype=torch.long, device="meta"))
    assert time.perf_counter() - start < 20
    assert huge.batch_size == 4096 and huge["stem"].outputs[0].shape == (4096, 8, 150, 150)


def test_meta_module():
    with torch.device("meta"):
        model = MLP()
    graph = capture(model, torch.empty(4, 16, device="meta"), torch.empty(4, 8, device="meta"))
    assert graph.num_params == sum(p.numel() for p in model.parameters())


def test_fx_fallback_gives_the_same_graph(monkeypatch):
    cases = [(MLP(), torch.empty(4, 16), torch.empty(4, 8), None),
             (SmallCNN(), torch.empty(2, 3, 32, 32), torch.empty(2, dtype=torch.long), None),
             (LSTMLM(), torch.empty(2, 5, dtype=torch.long), torch.empty(2, 5, dtype=torch.long), lm_loss),
             (TinyAttention(), torch.empty(2, 5, 16), torch.empty(2, 16), None)]
    exported = [capture(m, x, y, loss) for m, x, y, loss in cases]

    def fail(*args, **kwargs):
        raise RuntimeError("export unavailable")

    monkeypatch.setattr(capture_module, "_trace_export", fail)
    for (m, x, y, loss), graph in zip(cases, exported, strict=True):
        traced = capture(m, x, y, loss)
        assert [op.to_dict() for op in traced] == [op.to_dict() for op in graph]
        assert traced.fingerprint == graph.fingerprint


def test_capture_leaves_the_models_buffers_as_they_were(monkeypatch):
    """A forward writing its buffers (refused) leaves them untouched, on either path: symbolic tracing runs
    in-place ops on real buffers, which capture puts back, values and objects."""

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("count", torch.zeros(4))
            self.register_buffer("scale", torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.count.add_(1)
            self.scale = self.scale * 2
            return self.fc(x) + self.count + self.scale

    def fail(*args, **kwargs):
        raise RuntimeError("export unavailable")

    for fx_only in (False, True):
        if fx_only:
            monkeypatch.setattr(capture_module, "_trace_export", fail)
        model = Counting()
        count, scale = model.count, model.scale
        with pytest.raises(ValueError, match="writes its buffer 'count'"):
            capture(model, torch.empty(2, 4), torch.empty(2, 4))
        assert model.count is count and model.scale is scale
        assert torch.equal(count, torch.zeros(4)) and torch.equal(scale, torch.ones(4))


def test_untraceable_model_is_a_clear_error():
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) if x.sum() > 0 else x

    with pytest.raises(ValueError, match="torch.export failed .* torch.fx failed"):
        capture(DataDependent(), torch.empty(2, 4, device="meta"), torch.empty(2, 4, device="meta"))


def test_bad_arguments():
    x, y = torch.empty(2, 16, device="meta"), torch.empty(2, 8, device="meta")
    with pytest.raises(ValueError, match="nn.Module"):
        capture(lambda t: t, x, y)
    with pytest.raises(ValueError, match="inputs must be a tensor"):
        capture(MLP(), [x, 3], y)
    with pytest.raises(ValueError, match="inputs must be a tensor"):
        capture(MLP(), (), y)
    with pytest.raises(ValueError, match="target must be a tensor"):
        capture(MLP(), x, 3)
    with pytest.raises(ValueError, match="loss_fn must be callable"):
        capture(MLP(), x, y, "mse")
    with pytest.raises(ValueError, match="batch_size must be positive"):
        capture(MLP(), x, y, batch_size=0)
    with pytest.raises(ValueError, match="complex64"):
        capture(MLP(), torch.empty(2, 16, dtype=torch.complex64, device="meta"), y)


def documented_kinds() -> set[str]:
    return set(re.findall(r"^\| `(\w+)` \|", OP_KINDS_DOC.read_text(), flags=re.MULTILINE))


def test_every_zoo_model_captures():
    zoo = pytest.importorskip("soapflow.zoo")
    kinds = documented_kinds()
    assert {"conv2d", "lstm", "opaque", "loss"} <= kinds
    for name, entry in zoo.ZOO.items():
        built = entry.build(2)
        module, (inputs, target) = built[0], built[1]
        loss = built[2] if len(built) == 3 else None
        graph = capture(module, inputs, target, loss, name=name, batch_size=2)
        assert graph.num_params == sum(p.numel() for p in module.parameters()), name
        assert {op.kind for op in graph} <= kinds, (name, {op.kind for op in graph} - kinds)
        assert graph.ops[-1].kind == "loss", name
        assert not [op.name for op in graph if op.kind == "opaque"], name
        assert graph.total_flops > 0


# ---------------------------------------------------------------- real-model patterns


def test_llama_like_model_captures_real_kinds_and_folds_shape_only_values():
    """Rotary tables (a buffer under no_grad), a causal mask and positions built from the sequence length
    fold into constants; hand-written and nn.RMSNorm norms are `rmsnorm` ops named after their modules;
    repeat_kv by expand or repeat_interleave and SDPA's enable_gqa are `expand`, `repeat` and grouped-query
    `attention` ops; the tied embedding and LM head share one parameter."""
    rc = pytest.importorskip("runtime_cases")
    w = rc.llama_build(4)
    graph = capture(w.module, w.inputs, w.target, w.loss_fn)
    ids = torch.randint(0, 32, (4, 8))
    check_common(graph, w.module, (ids,))
    assert not [op.name for op in graph if op.kind == "opaque"]
    norms = [op.name for op in graph if op.kind == "rmsnorm"]
    assert norms == [f"layers.{i}.norm{j}" for i in range(3) for j in (1, 2)] + ["norm"]
    assert graph["layers.0.norm1"].attrs["eps"] == 1e-6
    # x.to(float32) of a float32 x is x itself, which the residual reads too: an identity op stays
    cast = graph[graph["layers.0.norm1"].inputs[0].op]
    assert cast.kind == "elementwise" and cast.attrs["fn"] == "identity" and cast.inputs[0].op == "embed"
    attention = [op for op in graph if op.kind == "attention"]
    assert [[list(s) for s in op.attrs["input_shapes"]] for op in attention] == [
        [[4, 4, 8, 4], [4, 4, 8, 4], [4, 4, 8, 4], [8, 8]],
        [[4, 4, 8, 4], [4, 4, 8, 4], [4, 4, 8, 4], [8, 8]],
        [[4, 4, 8, 4], [4, 2, 8, 4], [4, 2, 8, 4], [8, 8]]]
    assert {op.kind for op in graph if op.module.startswith("layers.0.attn")} >= {"expand"}
    assert {op.kind for op in graph if op.module.startswith("layers.1.attn")} >= {"repeat"}
    assert graph["embed"].params["weight"].fqn == graph["lm_head"].params["weight"].fqn
    constants = {op.name: op for op in graph if op.kind == "constant"}
    assert constants and all("recipe" in op.attrs for op in constants.values())
    mask = next(op for op in constants.values() if op.outputs[0].dtype == "bool")
    kernels = pytest.importorskip("runtime.kernels")
    tensors = {**dict(w.module.named_parameters()), **dict(w.module.named_buffers())}
    assert torch.equal(kernels.constant_value(mask, tensors), torch.ones(8, 8, dtype=torch.bool).tril())
    cos = kernels.constant_value(constants["layers.0.attn.unsqueeze"], tensors)
    with torch.no_grad():
        want = w.module.rotary(torch.arange(8)[None])[0][:, None]
    torch.testing.assert_close(cos, want)
    # no step of any recipe reads the batch or a parameter, and the recipes are JSON
    assert OperatorGraph.from_dict(graph.to_dict()).fingerprint == graph.fingerprint


def test_single_process_run_of_a_graph_with_folded_constants_equals_pytorch():
    rc = pytest.importorskip("runtime_cases")
    train = pytest.importorskip("runtime.train")
    graph = rc.graph_of("llama")
    single = {op.name: {"degrees": {}, "devices": [0]} for op in graph}
    result = train.train_rank(0, 1, build=rc.MODELS["llama"], graph=graph.to_dict(), strategy=single,
                              options=train.TrainOptions(steps=2, verify=True))
    assert result["verify"]["passed"], result["verify"]


class MatmulPatterns(nn.Module):
    """GPT-2's Conv1D (addmm with the weight stored [in, out]), baddbmm, einsum products, stack, F.rms_norm,
    a cat with an empty 1-D tensor, and in-place ops and views."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 12))
        self.bias = nn.Parameter(torch.randn(12))
        self.norm = nn.Parameter(torch.ones(12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        h = torch.addmm(self.bias, x.view(-1, 8), self.weight).view(n, t, 12)
        h = F.rms_norm(h, (12,), self.norm, 1e-5)
        k = h.view(n, t, 3, 4).transpose(1, 2)
        scores = torch.einsum("bhqd,bhkd->bhqk", k, k)
        mixed = torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), k)
        flat = mixed.transpose(1, 2).reshape(n * t, 12)
        hh = torch.stack([flat, flat * 2.0], dim=1).sum(1).view(n, t, 12)
        scaled = torch.baddbmm(hh[:, :, :t], hh, hh.transpose(1, 2), alpha=0.5)
        out = torch.cat([torch.tensor([]), scaled.reshape(n, -1)], dim=1)
        y = out.clone()
        y.mul_(2.0)
        return y.unfold(1, t, t).sum(-1)


def test_matmul_patterns_map_to_linear_and_matmul():
    model, x = MatmulPatterns(), torch.randn(2, 3, 8)
    y = torch.randn(2, 3)
    graph = capture(model, meta_like(x), meta_like(y))
    kinds = {op.name: op.kind for op in graph}
    addmm = graph["addmm"]
    assert addmm.kind == "linear" and addmm.attrs["transposed"]
    assert {k: p.fqn for k, p in addmm.params.items()} == {"weight": "weight", "bias": "bias"}
    assert [d.name for d in __import__("soap.registry").registry.dims_of(addmm)] == [
        "sample", "out_features", "in_features"]
    assert kinds["rms_norm"] == "rmsnorm" and graph["rms_norm"].attrs["eps"] == 1e-5
    assert kinds["einsum"] == kinds["einsum_1"] == "matmul"
    assert graph["einsum"].attrs["transpose_b"] and "transpose_b" not in graph["einsum_1"].attrs
    assert kinds["stack"] == "stack" and graph["stack"].attrs["axis"] == 1
    baddbmm = graph["baddbmm"]
    assert baddbmm.kind == "matmul" and len(baddbmm.inputs) == 3
    assert (baddbmm.attrs["alpha"], baddbmm.attrs["beta"]) == (0.5, 1.0)
    # the empty tensor torch.cat skips is no input; the in-place mul and the unfold view still capture
    assert kinds["cat"] == "concat" and len(graph["cat"].inputs) == 1
    assert kinds["unfold"] == "opaque"
    for op in graph:  # every op's regions work (the concat entry's used to fail on empty inputs)
        entry = __import__("soap.registry").registry.op_def(op.kind)
        entry.input_regions(op, tuple((0, d.size) for d in entry.dims(op)))
    train = pytest.importorskip("runtime.train")
    workload = train.Workload(module=model, inputs=(meta_like(x),), target=meta_like(y),
                              loss_fn=F.mse_loss)
    result = train.train_rank(0, 1, build=lambda: workload, graph=graph.to_dict(),
                              strategy={op.name: {"degrees": {}, "devices": [0]} for op in graph},
                              options=train.TrainOptions(steps=1, verify=True))
    assert result["verify"]["max_loss_rel_diff"] < 1e-6


def test_attention_with_masks_grouped_queries_and_dropout():
    class Attn(nn.Module):
        def __init__(self, dropout: float = 0.0) -> None:
            super().__init__()
            self.dropout = dropout
            self.q, self.kv = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n, t, _ = x.shape
            q = self.q(x).view(n, t, 4, 2).transpose(1, 2)
            k, v = self.kv(x).view(n, t, 2, 4).transpose(1, 2).chunk(2, dim=-1)
            bias = torch.zeros(t, t).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True, dropout_p=self.dropout)
            return y.transpose(1, 2).reshape(n, t, 8)

    x = torch.empty(2, 5, 8, device="meta")
    graph = capture(Attn(), x, torch.empty(2, 5, 8, device="meta"))
    attention = graph["scaled_dot_product_attention"]
    assert attention.kind == "attention" and not attention.attrs["is_causal"]
    assert [list(s) for s in attention.attrs["input_shapes"]] == [[2, 4, 5, 2], [2, 2, 5, 2], [2, 2, 5, 2], [5, 5]]
    mask = graph[attention.inputs[3].op]
    assert mask.kind == "constant" and mask.outputs[0].dtype == "float32"
    assert attention.fwd_flops > 0
    # SDPA's own dropout draws a mask no part can reproduce: the call stays opaque
    dropped = capture(Attn(dropout=0.1), x, torch.empty(2, 5, 8, device="meta"))
    assert dropped["scaled_dot_product_attention"].kind == "opaque"


class InPlaceWrites(nn.Module):
    """BART's shift_tokens_right (writes through slice and select views of `new_zeros`, then `masked_fill_`)
    and an in-place add through a view of an activation."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.fc = nn.Linear(6, 6)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1].clone()
        shifted[:, 0] = 3
        shifted.masked_fill_(shifted == 5, 1)
        h = self.fc(self.embed(shifted))
        h[:, 0] += 1.0
        return h


def test_in_place_writes_are_captured_out_of_place_and_train_as_in_pytorch():
    model, ids, y = InPlaceWrites(), torch.randint(0, 10, (2, 5)), torch.randn(2, 5, 6)
    graph = capture(model, meta_like(ids), meta_like(y))
    targets = {op.attrs.get("target", "") for op in graph if op.kind == "opaque"}
    assert not [t for t in targets if t.split(".")[-2].endswith("_")], targets  # no in-place op is left
    assert {"torch.ops.aten.slice_scatter.default", "torch.ops.aten.select_scatter.default"} <= targets
    assert graph["embed"].inputs[0].op == "masked_fill"  # the embedding reads the written ids
    train = pytest.importorskip("runtime.train")
    workload = train.Workload(module=model, inputs=(meta_like(ids),), target=meta_like(y), loss_fn=F.mse_loss)
    result = train.train_rank(0, 1, build=lambda: workload, graph=graph.to_dict(),
                              strategy={op.name: {"degrees": {}, "devices": [0]} for op in graph},
                              options=train.TrainOptions(steps=2, verify=True))
    assert result["verify"]["passed"], result["verify"]


def test_a_view_read_after_an_in_place_write_to_its_base_is_a_clear_error():
    class StaleView(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2.0
            first = y[:, 0]
            y.add_(1.0)
            return first.unsqueeze(1) + y

    x = torch.empty(2, 3, device="meta")
    with pytest.raises(ValueError, match="taken before an in-place"):
        capture(StaleView(), x, x)


class BufferWrite(nn.Module):
    """A hand-written running mean: a buffer written in forward, by an in-place op or an assignment."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.norm = nn.BatchNorm1d(6)
        self.stats = nn.Module()
        self.stats.register_buffer("ema", torch.zeros(6))
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.fc(x))
        with torch.no_grad():
            if self.how == "in-place":
                self.stats.ema.mul_(0.9).add_(0.1 * h.mean(0))
            elif self.how == "slice":
                self.stats.ema[:2] = h.mean(0)[:2]
            elif self.how == "assign":
                self.stats.ema = 0.9 * self.stats.ema + 0.1 * h.mean(0)
        return h - self.stats.ema


@pytest.mark.parametrize("path", ["export", "fx"])
def test_a_forward_writing_a_buffer_is_refused_but_batchnorm_statistics_are_kept(monkeypatch, path):
    x, y = torch.empty(8, 4, device="meta"), torch.empty(8, 6, device="meta")
    if path == "fx":
        def fail(*args, **kwargs):
            raise RuntimeError("export unavailable")

        monkeypatch.setattr(capture_module, "_trace_export", fail)
    # the fx tracer cannot trace an assignment of a traced value to a buffer: it fails as untraceable
    for how in ("in-place", "slice") if path == "fx" else ("in-place", "slice", "assign"):
        with pytest.raises(ValueError, match=r"writes its buffer 'stats\.ema' .*cannot carry buffer updates") as err:
            capture(BufferWrite(how), x, y)
        assert "\n" not in str(err.value)
    graph = capture(BufferWrite("read only").train(), x, y)
    assert graph["norm"].kind == "batchnorm"
    assert (graph["norm"].attrs["running_mean"], graph["norm"].attrs["running_var"]) == (
        "norm.running_mean", "norm.running_var")
    capture(SmallCNN().train(), torch.empty(2, 3, 32, 32), torch.empty(2, dtype=torch.long))


class _DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> dict:
        return {"logits": self.fc(x)}


class _BranchOnValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if h.sum() > 0:
            return h
        return -h


def test_unusable_models_are_refused_saying_what_to_do():
    x, target = torch.empty(4, 8, device="meta"), torch.empty(4, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match="returns a dict, not a tensor, and no loss was given") as info:
        capture(_DictOut(), x, target)
    assert "torch.fx" not in str(info.value)  # the cause, not the two tracers' symptoms
    capture(_DictOut(), x, target, lambda out, t: F.cross_entropy(out["logits"], t))  # with a loss it captures
    with pytest.raises(ValueError, match="branches on a tensor's value.*torch.where"):
        capture(_BranchOnValue(), torch.randn(4, 8), torch.zeros(4, dtype=torch.long))


class _TransposedWeights(nn.Module):
    """Linears written as ``x @ w.T`` (Falcon's), ``x @ w.t()`` and ``x @ w.transpose(0, 1)``."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(12, 8))
        self.w2 = nn.Parameter(torch.randn(12, 12))
        self.w3 = nn.Parameter(torch.randn(4, 12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x @ self.w1.T)
        h = torch.relu(h @ self.w2.t())
        return h @ self.w3.transpose(0, 1)


def test_a_product_with_a_transposed_parameter_is_a_linear():
    graph = capture(_TransposedWeights(), torch.empty(4, 3, 8, device="meta"),
                    torch.empty(4, 3, dtype=torch.long, device="meta"))
    linears = [op for op in graph if op.kind == "linear"]
    assert [op.params["weight"].fqn for op in linears] == ["w1", "w2", "w3"]
    assert all(not op.attrs.get("transposed") for op in linears)
    assert not [op.name for op in graph if op.kind in ("opaque", "transpose", "matmul")]
    assert [op.outputs[0].shape for op in linears] == [(4, 3, 12), (4, 3, 12), (4, 3, 4)]
    assert all(op.bwd_flops == 2 * op.fwd_flops for op in linears[1:])  # the input's and the weight's gradients


class _MultiQuery(nn.Module):
    """Multi-query attention as Falcon writes it: one k and v head broadcast over the query heads by SDPA
    itself (no enable_gqa), with an explicit mask."""

    def __init__(self, d: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.q, self.kv = nn.Linear(d, d), nn.Linear(d, 2 * self.head_dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q = self.q(x).view(n, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(n, t, 1, 2 * self.head_dim).transpose(1, 2).split(self.head_dim, dim=-1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(n, t, d)


def test_one_key_value_head_broadcast_by_sdpa_is_an_attention():
    from runtime.kernels import KERNELS

    module, x = _MultiQuery(), torch.randn(2, 5, 16)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    graph = capture(module, (x, mask), torch.randn(2, 5, 16))
    (op,) = [op for op in graph if op.kind == "attention"]
    assert not [o.name for o in graph if o.kind == "opaque"]
    q = torch.randn(2, 4, 5, 4)
    k, v = torch.randn(2, 1, 5, 4), torch.randn(2, 1, 5, 4)
    box = tuple((0, n) for n in op.outputs[0].shape)
    (out,) = KERNELS["attention"](op, box, (q, k, v, mask), {}, types.SimpleNamespace(training=True, step=0))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


class _ConstantIndex(nn.Module):
    """Indexing by constant integer tensors: one element kept as an axis (Falcon's ``qkv[..., [-2], :]``),
    one element dropping the axis, and two elements that are not consecutive."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x[:, :, torch.tensor([-2])]  # [N, T, 1, D]
        b = x[:, :, torch.tensor(1)]  # [N, T, D]
        c = x[:, :, torch.tensor([0, 2])]  # [N, T, 2, D]
        return a.sum(2) + b + c.sum(2)


def test_a_constant_index_of_consecutive_elements_is_a_slice():
    x = torch.randn(2, 3, 4, 5)
    graph = capture(_ConstantIndex(), x, torch.randn(2, 3, 5))
    slices = [op for op in graph if op.kind == "slice"]
    assert [(op.attrs["start"], op.attrs["stop"], op.attrs["squeeze"]) for op in slices] == [(2, 3, False),
                                                                                          (1, 2, True)]
    assert len([op for op in graph if op.kind == "opaque"]) == 1  # [0, 2] picks two apart: left opaque


class _CastWeights(nn.Module):
    """A router as DeepSeek writes it: its float32 weight cast to float32 before the product, and a
    bfloat16 copy of another weight (a real cast, kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 8))
        self.v = nn.Parameter(torch.randn(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        same = F.linear(x.float(), self.w.type(torch.float32))
        other = F.linear(x.bfloat16(), self.v.to(torch.bfloat16)).float()
        return same + other


def test_a_cast_of_a_parameter_to_its_own_dtype_is_the_parameter():
    graph = capture(_CastWeights(), torch.empty(6, 8, device="meta"), torch.empty(6, 4, device="meta"))
    linears = [op for op in graph if op.kind == "linear"]
    assert [op.params["weight"].fqn for op in linears] == ["w"]
    held = [op.params["v"].fqn for op in graph if op.kind == "opaque" and "v" in op.params]
    assert held == ["v"]  # (the bfloat16 copy: one opaque cast holding it)
