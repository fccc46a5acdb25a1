"""The forms of real models capture maps: attention as capture traces it (`soap.capture.attention`):
``nn.MultiheadAttention`` in its inputs' layout, SDPA with dropout written out; timm's packed heads and
sequence-first recurrences (`soap.capture.tracing`); blocks of parameters cut by slicing
(`soap.capture.builder`); activations kept by name (`soap.registry.POINTWISE_FNS`); group and instance
norms (the ``groupnorm`` kind), nearest and bilinear upsampling (``upsample``), 1-D convolutions (``conv1d``),
1-D pools and embedding bags; bidirectional recurrences, PReLU, GLU, pixel shuffles, channel dropout, cross
entropy ignoring targets and smoothing labels, explicit padding, an expanded parameter, a table read by index and
an in-place write through a flatten.
The forwards compute what PyTorch's compute, the graph keeps the batch on every op's first axis, data
parallelism needs no exchange, nothing is opaque, and runs match one process."""

from __future__ import annotations

import itertools
import random

import pytest
import runtime_cases as rc
import torch
import torch.nn.functional as F
from torch import nn

import soap.capture as capture_module
from runtime.kernels import counted_targets
from runtime.launch import launch
from search.baselines import parse_baseline
from simulator.engine import Simulator
from soap.capture import capture, default_loss
from soap.capture.attention import captured_attention
from soap.registry import dims_of
from soap.topology import load_topology

BATCH, LENGTH, SOURCE, WIDTH, HEADS = 3, 5, 4, 8, 2


def _masks(kind: str) -> dict:
    """Keyword arguments of one mask case for a query of LENGTH and keys of SOURCE."""
    causal = torch.triu(torch.ones(LENGTH, SOURCE, dtype=torch.bool), 1)
    padding = torch.zeros(BATCH, SOURCE, dtype=torch.bool)
    padding[0, -1] = True
    cases = {
        "none": {},
        "bool": {"attn_mask": causal},
        "float": {"attn_mask": torch.zeros(LENGTH, SOURCE).masked_fill(causal, float("-inf"))},
        "3d": {"attn_mask": torch.randn(BATCH * HEADS, LENGTH, SOURCE)},
        "padding": {"key_padding_mask": padding},
        "both": {"attn_mask": causal, "key_padding_mask": padding},
        "causal": {"attn_mask": causal, "is_causal": True},
    }
    return cases[kind]


@pytest.mark.parametrize("batch_first,separate,need_weights,average", [
    (True, False, False, True), (False, False, True, True), (True, True, True, False), (False, True, False, True)])
def test_forward_computes_what_pytorch_computes(batch_first, separate, need_weights, average):
    """Outputs, returned weights and every gradient agree with PyTorch's forward, for self- and
    cross-attention, packed and separate projections, both layouts and every kind of mask."""
    torch.manual_seed(0)
    kdim = 6 if separate else WIDTH
    m = nn.MultiheadAttention(WIDTH, HEADS, kdim=kdim, vdim=kdim, batch_first=batch_first).double()
    shape = (BATCH, LENGTH) if batch_first else (LENGTH, BATCH)
    source_shape = (BATCH, SOURCE) if batch_first else (SOURCE, BATCH)
    for kind in ("none", "bool", "float", "3d", "padding", "both", "causal"):
        masks = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                 for k, v in _masks(kind).items()}
        query = torch.randn(*shape, WIDTH, dtype=torch.float64, requires_grad=True)
        key = torch.randn(*source_shape, kdim, dtype=torch.float64, requires_grad=True)
        value = key if kind != "none" else torch.randn(*source_shape, kdim, dtype=torch.float64, requires_grad=True)
        results = []
        for patched in (False, True):
            m.zero_grad()
            for t in (query, key, value):
                t.grad = None
            with captured_attention() if patched else _nothing():
                out, weights = m(query, key, value, need_weights=need_weights, average_attn_weights=average,
                                 **masks)
            loss = out.square().sum() + (weights.sum() if weights is not None else 0)
            loss.backward()
            grads = [t.grad.clone() for t in (query, key, value)] + [p.grad.clone() for p in m.parameters()]
            results.append((out.detach(), None if weights is None else weights.detach(), grads))
        (out0, w0, g0), (out1, w1, g1) = results
        assert torch.allclose(out0, out1, atol=1e-12), kind
        assert (w0 is None) == (w1 is None) and (w0 is None or torch.allclose(w0, w1, atol=1e-12)), kind
        for a, b in zip(g0, g1, strict=True):
            assert torch.allclose(a, b, atol=1e-10), kind


@pytest.mark.parametrize("mask,causal,scale,kv_heads", [
    (None, True, None, HEADS), ("bool", False, 0.3, HEADS), ("float", False, None, 1), (None, False, None, 1)])
def test_written_out_attention_computes_what_sdpa_computes(mask, causal, scale, kv_heads):
    """Attention written out (what capture traces for SDPA with dropout) equals PyTorch's fused attention
    without dropout: outputs and gradients, causal (query shorter than keys too), boolean and float masks,
    a scale, one key and value head broadcast."""
    from soap.capture.attention import _written_out

    torch.manual_seed(0)
    q = torch.randn(BATCH, HEADS, LENGTH, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(BATCH, kv_heads, SOURCE + 2, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(BATCH, kv_heads, SOURCE + 2, 4, dtype=torch.float64, requires_grad=True)
    keep = torch.rand(LENGTH, SOURCE + 2) > 0.3
    keep[:, 0] = True
    given = {"bool": keep, "float": torch.randn(BATCH, 1, LENGTH, SOURCE + 2, dtype=torch.float64), None: None}[mask]
    additive = given if given is None or given.is_floating_point() else \
        torch.zeros(given.shape, dtype=torch.float64).masked_fill(~given, float("-inf"))
    got = _written_out(q, k, v, additive, 0.0, causal, scale)[0]
    expected = F.scaled_dot_product_attention(q, k.expand(-1, HEADS, -1, -1), v.expand(-1, HEADS, -1, -1),
                                              attn_mask=given, is_causal=causal, scale=scale)
    assert torch.allclose(got, expected, atol=1e-12)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    for a, b in zip(grads, torch.autograd.grad(expected.square().sum(), (q, k, v)), strict=True):
        assert torch.allclose(a, b, atol=1e-10)


class SdpaDropout(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (4, 4)).transpose(1, 2) for t in self.qkv(x).split(16, dim=-1))
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p, is_causal=True).transpose(1, 2).flatten(-2)


def test_sdpa_with_dropout_is_written_out():
    """SDPA with dropout p > 0 captures as matmuls, a softmax and a ``dropout`` op, nothing opaque; without
    dropout it stays one ``attention`` op."""
    dropped = capture(SdpaDropout(0.1), torch.empty(2, 6, 16), torch.empty(2, 6, 16))
    kinds = [op.kind for op in dropped]
    assert "opaque" not in kinds and "attention" not in kinds and kinds.count("matmul") == 2
    assert [op.attrs["p"] for op in dropped if op.kind == "dropout"] == [0.1]
    plain = capture(SdpaDropout(0.0), torch.empty(2, 6, 16), torch.empty(2, 6, 16))
    assert [op.kind for op in plain].count("attention") == 1 and "dropout" not in [op.kind for op in plain]


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_unsupported_calls_keep_pytorch_forward():
    """Unbatched inputs and ``add_bias_kv`` run PyTorch's own forward (and so compute what it computes);
    a call PyTorch refuses is refused with PyTorch's error."""
    torch.manual_seed(0)
    for m, x in ((nn.MultiheadAttention(WIDTH, HEADS), torch.randn(LENGTH, WIDTH)),
                 (nn.MultiheadAttention(WIDTH, HEADS, add_bias_kv=True), torch.randn(LENGTH, BATCH, WIDTH))):
        expected, _ = m(x, x, x)
        with captured_attention():
            got, _ = m(x, x, x)
        assert torch.equal(expected, got)
    original = nn.MultiheadAttention.forward
    m = nn.MultiheadAttention(WIDTH, HEADS)
    x = torch.randn(LENGTH, BATCH, WIDTH)
    with pytest.raises(RuntimeError, match="attn_mask"), captured_attention():
        m(x, x, x, is_causal=True, need_weights=False)
    with pytest.raises(AssertionError, match="key_padded_mask"), captured_attention():
        m(x, x, x, key_padding_mask=torch.zeros(BATCH, LENGTH + 1, dtype=torch.bool))
    assert nn.MultiheadAttention.forward is original


class Encoder(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.enc = nn.TransformerEncoderLayer(16, 4, 32, dropout=dropout, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.inp(x)))


def _encoder_graph(dropout: float = 0.0):
    return capture(Encoder(dropout), torch.empty(8, 10, 8), torch.empty(8, 10, 4))


def test_batch_first_attention_keeps_the_batch_first():
    """Every op of a batch-first encoder layer holds the batch (8) on its first axis; q, k and v are three
    linears over the three blocks of ``in_proj_weight``; the attention is one op; nothing is opaque."""
    graph = _encoder_graph()
    assert all(op.outputs[0].shape[0] == 8 for op in graph if op.kind != "loss"), [
        (op.name, op.outputs[0].shape) for op in graph if op.outputs[0].shape[:1] != (8,)]
    assert not [op.name for op in graph if op.kind == "opaque"]
    blocks = sorted(op.params["weight"].offset for op in graph if op.params.get("weight") is not None
                    and op.params["weight"].fqn == "enc.self_attn.in_proj_weight")
    assert blocks == [(0, 0), (16, 0), (32, 0)]
    assert [op.kind for op in graph].count("attention") == 1


def test_attention_dropout_is_a_dropout_op():
    """With dropout, the attention is written out and its dropout is a ``dropout`` op (numbered first:
    the layer's own dropouts come after it), so the runtime can draw its mask."""
    graph = _encoder_graph(dropout=0.1)
    dropouts = [op for op in graph if op.kind == "dropout"]
    assert dropouts[0].name == "enc.self_attn.dropout" and dropouts[0].attrs["p"] == 0.1
    assert [op.attrs["seed"] for op in dropouts] == list(range(len(dropouts)))
    assert not [op.name for op in graph if op.kind == "opaque"]


def test_data_parallel_attention_exchanges_nothing():
    """Data parallelism over the encoder layer issues gradient all-reduces only: no op between the
    attention's permutes is split by sequence any more."""
    graph = _encoder_graph()
    topology = load_topology("cpu-2")
    sim = Simulator(graph, topology)
    sim.full(parse_baseline("dp")(graph, topology))
    for rank in sim.collectives():
        assert set(rank) == {"all_reduce"}, rank


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, dropout=0.1, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, weights = self.attn(x, x, x)
        return self.head(out) + weights.mean()


def test_fx_fallback_traces_attention_alike(monkeypatch):
    """Where export fails, symbolic tracing stops at ``nn.MultiheadAttention`` (whose forward branches on
    its inputs) and runs it on fake tensors: the same graph."""
    exported = capture(SelfAttention(), torch.empty(8, 10, 16), torch.empty(8, 10, 4))

    def fail(*args, **kwargs):
        raise RuntimeError("export unavailable")

    monkeypatch.setattr(capture_module, "_trace_export", fail)
    traced = capture(SelfAttention(), torch.empty(8, 10, 16), torch.empty(8, 10, 4))
    assert "attention" not in [op.kind for op in traced] and "dropout" in [op.kind for op in traced]
    # (a model given `default_loss` explicitly, as the runtime's workloads are, traces on this path too)
    given = capture(SelfAttention(), torch.empty(8, 10, 16), torch.empty(8, 10, 4), default_loss)
    assert [op.to_dict() for op in given] == [op.to_dict() for op in traced]
    assert [op.kind for op in traced] == [op.kind for op in exported]
    assert [op.outputs for op in traced] == [op.outputs for op in exported]
    assert [op.params for op in traced] == [op.params for op in exported]


def test_parameter_blocks():
    """Each cut is a block of its parameter: the linears hold their rows of w and b, the add its block of
    b, the opaque cumsum w's last rows; the cuts make no op."""
    graph = capture(rc.Sliced(), torch.empty(4, 8), torch.empty(4, 4))
    linears = sorted((p.offset, p.shape, op.params["bias"].offset) for op in graph if op.kind == "linear"
                     for p in [op.params["weight"]] if p.fqn == "w")
    assert linears == [((0, 0), (8, 8), (0,)), ((8, 0), (8, 8), (8,)), ((16, 0), (8, 8), (16,))]
    assert [(p.fqn, p.offset) for op in graph if op.kind == "binary" for p in op.params.values()] == [("b", (8,))]
    opaque = [op for op in graph if op.kind == "opaque"]
    assert [op.attrs["target"] for op in opaque] == ["torch.ops.aten.cumsum.default"]
    assert list(opaque[0].params) == ["w@16,0"] and opaque[0].params["w@16,0"].offset == (16, 0)
    assert not [op for op in graph if op.kind == "opaque" and "split" in op.attrs["target"]]
    assert graph.num_params == sum(p.numel() for p in rc.Sliced().parameters())


def test_packed_heads_select_before_permute_and_split_the_projection():
    """timm's ``qkv.reshape(..., 3, heads, d).permute(2, 0, 3, 1, 4).unbind(0)``, and q, k, v read by index
    after a transpose: nothing opaque, every op holds the batch first, each qkv projection is three linears
    over its blocks, and data parallelism issues only all-reduces."""
    graph = rc.graph_of("packed")
    assert not [op.name for op in graph if op.kind == "opaque"]
    assert all(op.outputs[0].shape[0] == 4 for op in graph if op.kind != "loss")
    for fqn in ("qkv.weight", "qkv2.weight"):
        assert sorted(op.params["weight"].offset for op in graph if op.kind == "linear"
                      and op.params["weight"].fqn == fqn) == [(0, 0), (16, 0), (32, 0)]
    topology = load_topology("cpu-2")
    sim = Simulator(graph, topology)
    sim.full(parse_baseline("dp")(graph, topology))
    assert all(set(rank) == {"all_reduce"} for rank in sim.collectives())


class SharedPermute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.fc(x).reshape(x.shape[0], 3, 8).permute(1, 0, 2)
        a, b, c = t.unbind(0)
        return a * b + c + t.sum(0)


def test_permute_read_otherwise_stays():
    """A permute some op reads whole stays, its pieces read from it; the graph computes the model."""
    graph = capture(SharedPermute(), torch.empty(4, 8), torch.empty(4, 8))
    kinds = [op.kind for op in graph]
    assert kinds.count("transpose") == 1 and kinds.count("slice") == 3 and "opaque" not in kinds


def test_sequence_first_recurrences_run_batch_first():
    """A sequence-first LSTM then GRU (PyTorch's default layout) map to the recurrent kinds, batch first,
    between one transpose in and one out (the one between them undone); before, they were opaque."""
    graph = rc.graph_of("seqfirst")
    kinds = [op.kind for op in graph]
    assert "opaque" not in kinds and kinds.count("transpose") == 2
    assert graph["lstm"].outputs[0].shape == (4, 6, 16) and graph["gru"].inputs[0].op == "lstm"
    assert {op.module for op in graph if op.kind == "transpose"} == {""}


def test_activations_are_elementwise_ops():
    """Every activation of the MLP is an ``elementwise`` op naming its aten op and arguments: none opaque."""
    graph = rc.graph_of("activations")
    assert not [op.name for op in graph if op.kind == "opaque"]
    fns = [op.attrs["fn"] for op in graph if op.kind == "elementwise" and op.attrs["fn"] != "scale"]
    assert fns == ["leaky_relu", "hardswish", "hardtanh", "elu", "mish", "softplus", "selu", "celu",
                   "hardsigmoid", "hardtanh"]
    assert [op.attrs.get("min_val") for op in graph if op.attrs.get("fn") == "hardtanh"] == [0.0, -0.5]


def test_unet_norms_and_upsampling_are_splittable_ops():
    """GroupNorm and InstanceNorm are ``groupnorm`` ops (one channel per group for the instance norm), the
    nearest upsampling an ``upsample`` op, the transposed convolution a ``conv_transpose2d`` op: nothing
    opaque."""
    graph = rc.graph_of("unet")
    assert not [op.name for op in graph if op.kind == "opaque"]
    assert [(op.name, op.attrs["num_groups"]) for op in graph if op.kind == "groupnorm"] == [("gn", 4), ("inorm", 8)]
    assert [(op.name, tuple(op.attrs["scale"])) for op in graph if op.kind == "upsample"] == [("up", (2, 2))]
    assert [op.name for op in graph if op.kind == "conv_transpose2d"] == ["deconv"]


def test_conv1d_stack_is_conv1d_and_pool_ops():
    """Conv1d is a ``conv1d`` op; 1-D pools are the 2-D pool kinds over a height-1 view."""
    graph = rc.graph_of("tcn")
    assert [op.name for op in graph if op.kind == "conv1d"] == ["conv1", "conv2", "conv3"]
    assert [op.kind for op in graph if op.module in ("pool1", "pool2", "head") and op.kind.endswith("pool2d")] == [
        "pool2d", "pool2d", "adaptive_pool2d"]
    assert not [op.name for op in graph if op.kind == "opaque"]


def test_embedding_bags_are_embeddings_then_reductions():
    graph = rc.graph_of("bags")
    assert not [op.name for op in graph if op.kind == "opaque"]
    assert [(op.module, op.kind, op.attrs.get("fn")) for op in graph if op.module.endswith("_bag")] == [
        ("mean_bag", "embedding", None), ("mean_bag", "reduce", "mean"),
        ("sum_bag", "embedding", None), ("sum_bag", "reduce", "sum")]


def test_tagger_recurrences_and_loss():
    """The bidirectional LSTM and GRU of the tagger are one recurrent op per layer and direction with a ``dropout``
    op between the layers, nothing is opaque, and its label-smoothed cross entropy ignoring id 0 is one ``loss``
    op that counts the shifted target's ids but the ignored ones (`runtime.kernels.counted_targets`)."""
    graph = rc.graph_of("tagger")
    assert not [op.name for op in graph if op.kind == "opaque"]
    assert [op.kind for op in graph if op.kind in ("lstm", "gru")] == ["lstm"] * 4 + ["gru"] * 4
    assert [op.attrs["p"] for op in graph if op.kind == "dropout"] == [0.25, 0.2]  # between the layers
    (loss,) = [op for op in graph if op.kind == "loss"]
    assert (loss.attrs["ignore_index"], loss.attrs["label_smoothing"], loss.attrs["reduction"]) == (0, 0.1, "mean")
    target = torch.tensor([[0, 1, 0, 2, 3, 0]] * 4)
    whole = {op.name: target if op.attrs["role"] == "target" else torch.zeros(4, 6, dtype=torch.long)
             for op in graph if op.kind == "input"}
    assert graph[loss.inputs[2].op].kind == "constant"  # the class weights
    whole[loss.inputs[2].op] = torch.tensor([1.0, 2.0, 0.5, 1.0, 1.5])
    # ids 1..5 of each row, 1, 0, 2, 3, 0, count their weights: 2.0 + 0.5 + 1.0
    assert counted_targets(graph, loss, whole) == 4 * 3.5


def test_gated_and_shuffled_convolutions_and_bilinear_upsampling():
    """PReLU is a ``prelu`` op (one weight per channel, or one), the pixel shuffles and GLU are written out
    as reshapes, permutes, slices and a product, bilinear upsampling is an ``upsample`` op with its corners
    rule, and Dropout2d a ``dropout`` op drawing per channel: nothing opaque."""
    graph = rc.graph_of("superres")
    assert not [op.name for op in graph if op.kind == "opaque"]
    assert [(op.name, op.params["weight"].shape) for op in graph if op.kind == "prelu"] == [
        ("act1", (16,)), ("act2", (1,))]
    assert [op.kind for op in graph if op.module == "glu"] == ["slice", "slice", "elementwise", "binary"]
    assert [op.kind for op in graph if op.module == "shuffle"] == ["reshape", "transpose", "reshape"]
    graph = rc.graph_of("bilinear")
    assert not [op.name for op in graph if op.kind == "opaque"]
    assert [(op.attrs.get("mode"), op.attrs.get("align_corners")) for op in graph if op.kind == "upsample"] == [
        ("bilinear", False), ("bilinear", True)]
    assert [(op.attrs["p"], op.attrs.get("feature")) for op in graph if op.kind == "dropout"] == [(0.2, True)]


def test_vision_forms_pad_expand_a_parameter_and_look_up_a_table():
    """An explicit pad is a ``pad`` op, the class token's expand an ``expand`` op holding the parameter, the
    table read by a constant index an ``embedding`` op, the stochastic depths' ``torch.rand`` and
    ``bernoulli_`` each a ``random`` op (then a floor), the noise's ``randn_like`` a normal ``random`` op,
    and the in-place dropout through a flatten a ``dropout`` op reading the flatten: nothing opaque."""
    graph = rc.graph_of("vision")
    assert not [op.name for op in graph if op.kind == "opaque"]
    assert [tuple(op.attrs["pad"]) for op in graph if op.kind == "pad"] == [(0, 1, 0, 1)]
    (expand,) = [op for op in graph if op.kind == "expand"]
    assert not expand.inputs and expand.params["value"].fqn == "cls"
    (lookup,) = [op for op in graph if op.kind == "embedding"]
    assert lookup.params["weight"].fqn == "table" and graph[lookup.inputs[0].op].kind == "constant"
    (drop,) = [op for op in graph if op.kind == "dropout"]
    assert graph[drop.inputs[0].op].kind == "reshape" and drop.attrs["p"] == 0.1
    assert [(op.outputs[0].shape, op.attrs["seed"], op.attrs.get("normal")) for op in graph if op.kind == "random"] == [
        ((4, 1, 1), 0, None), ((4, 17, 8), 1, True), ((4, 1), 2, None)]
    assert [op.attrs["fn"] for op in graph if op.kind == "elementwise" and op.attrs["fn"] == "floor"] == ["floor"] * 2
    assert graph.num_params == sum(p.numel() for p in rc.VisionForms().parameters())


def test_statistics_are_reductions_and_pointwise_ops():
    """F.normalize, clamps, var, std, the max values, logsumexp, amax, a cosine similarity (written out), a
    square and an elementwise maximum map to the reduce, elementwise and binary kinds (the reductions that do
    not add up keep their axes whole): nothing opaque."""
    graph = rc.graph_of("statistics")
    assert not [op.name for op in graph if op.kind == "opaque"]
    reduces = {op.attrs["fn"]: op for op in graph if op.kind == "reduce"}
    assert {"norm", "var", "std", "max", "logsumexp", "amax", "mean"} <= set(reduces)
    assert not dims_of(reduces["norm"])[-1].splittable and dims_of(reduces["mean"])[-1].splittable
    assert [op.attrs["fn"] for op in graph if op.kind == "reduce" and op.module == ""].count("norm") == 2 + 1
    fns = {op.attrs["fn"] for op in graph if op.kind in ("elementwise", "binary")}
    assert {"clamp", "clamp_min", "clamp_max", "square", "maximum"} <= fns
    assert [(tuple(op.attrs["shifts"]), tuple(op.attrs["axes"])) for op in graph if op.kind == "roll"] == [((2,), (1,))]


# the models of the one launch below (tests/runtime_cases.py)
LAUNCHED = ("attention", "sliced", "packed", "seqfirst", "activations", "unet", "tcn", "bags", "tagger", "superres",
            "bilinear", "vision", "statistics")


@pytest.fixture(scope="module")
def forms_runs() -> list[dict]:
    """One 2-process launch: the attention model (dropout, masks, a cross-attention returning weights), the
    sliced model, the packed-heads model, the sequence-first LM, the activations MLP, the U-Net step, the
    temporal convolutions, the embedding bags, the bidirectional tagger (its loss ignoring id 0, which the
    synthetic targets hold), the super-resolution convolutions, the bilinear U-Net, the vision forms and the
    statistics under the baselines, a strategy drawn from the search's space and a random valid one, each verified
    against one process."""
    cases = [c for m in LAUNCHED for b in ("dp", "tp", "fsdp", "hybrid:tp=2")
             if (c := rc.baseline_case(m, b, 2)) is not None]
    for model, seed in itertools.product(LAUNCHED, range(2)):
        graph = rc.graph_of(model)
        # one draw from the search's own space (what it can emit), one from every valid config
        draw = rc.space_strategy if seed % 2 == 0 else rc.random_strategy
        cases.append(rc.train_case(f"{model}/random{seed}", model, draw(graph, 2, random.Random(seed)), graph))
    results = launch(rc.run_cases, 2, kwargs={"cases": cases}, timeout_s=60, wall_timeout_s=600, num_threads=1)
    return [cases, results[0]]


def test_forms_train_as_one_process(forms_runs):
    cases, results = forms_runs
    assert len(cases) >= 10 and [r["label"] for r in results] == [c["label"] for c in cases]
    bad = rc.failures(results, cases=cases, num_devices=2)
    assert not bad, "\n".join(bad)
    assert all(r["verify"]["passed"] for r in results)
