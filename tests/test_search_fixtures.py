"""Hand-built operator graphs for the search tests (no capture, no torch), and checks that they are sound.

`GraphBuilder` records `input_shapes` on every op as capture does and estimates FLOPs and bytes with the
usual formulas (2 FLOPs per multiply-add forward, twice that backward), so simulated costs are plausible.
"""

from __future__ import annotations

import math

import pytest

from soap.config import ParallelConfig, validate
from soap.graph import Operator, OperatorGraph, ParamSpec, TensorRef, TensorSpec
from soap.registry import dims_of

F32 = 4  # bytes per float32


def two_hubs_topology(tmp_path):
    """Four p100s on two hubs joined by one link, devices 0 and 2 on one, 1 and 3 on the other: the
    replicas (0, 1) and (2, 3) of two devices each exchange over that one link."""
    import json

    from soap.topology import read_topology

    doc = {"format": "soapflow.topology/1", "name": "two-hubs",
           "devices": [{"id": i, "kind": "p100", "node": 0} for i in range(4)],
           "links": [{"src": f"gpu{i}", "dst": "hubA" if i % 2 == 0 else "hubB", "kind": "pcie",
                      "spec": "pcie3-x16"} for i in range(4)]
           + [{"src": "hubA", "dst": "hubB", "kind": "pcie", "spec": "pcie3-x16"}]}
    path = tmp_path / "two-hubs.json"
    path.write_text(json.dumps(doc))
    return read_topology(path)


class GraphBuilder:
    """Appends ops in topological order; `add` returns the op name for chaining."""

    def __init__(self, name: str, batch: int):
        self.name, self.batch = name, batch
        self.ops: list[Operator] = []
        self._shapes: dict[str, tuple[int, ...]] = {}

    def add(self, name: str, kind: str, inputs: list[str], shape: tuple[int, ...], *,
            params: dict[str, tuple[int, ...]] | None = None, attrs: dict | None = None,
            flops: float = 0.0, dtype: str = "float32", extra: tuple[tuple[int, ...], ...] = ()) -> str:
        in_shapes = [list(self._shapes[i]) for i in inputs]
        specs = {k: ParamSpec(shape=s, fqn=f"{name}.{k}") for k, s in (params or {}).items()}
        moved = (sum(math.prod(s) for s in in_shapes) + math.prod(shape)
                 + sum(p.numel for p in specs.values())) * F32
        self.ops.append(Operator(
            name=name, kind=kind, inputs=tuple(TensorRef(op=i) for i in inputs),
            outputs=(TensorSpec(shape=shape, dtype=dtype), *(TensorSpec(shape=e) for e in extra)), params=specs,
            attrs={**(attrs or {}), "input_shapes": in_shapes}, module=name,
            fwd_flops=float(flops), bwd_flops=2.0 * flops, fwd_bytes=float(moved), bwd_bytes=2.0 * moved))
        self._shapes[name] = shape
        return name

    def input(self, name: str, shape: tuple[int, ...], *, role: str = "input", dtype: str = "float32") -> str:
        position = sum(op.kind == "input" for op in self.ops)
        return self.add(name, "input", [], shape, attrs={"position": position, "role": role}, dtype=dtype)

    def linear(self, name: str, x: str, out: int) -> str:
        shape = self._shapes[x]
        n = math.prod(shape[:-1])
        return self.add(name, "linear", [x], (*shape[:-1], out),
                        params={"weight": (out, shape[-1]), "bias": (out,)}, flops=2.0 * n * shape[-1] * out)

    def relu(self, name: str, x: str) -> str:
        return self.add(name, "elementwise", [x], self._shapes[x], attrs={"fn": "relu"},
                        flops=math.prod(self._shapes[x]))

    def conv(self, name: str, x: str, out: int, *, kernel: int = 3, stride: int = 1, padding: int = 1) -> str:
        n, c, h, w = self._shapes[x]
        ho, wo = (h + 2 * padding - kernel) // stride + 1, (w + 2 * padding - kernel) // stride + 1
        return self.add(name, "conv2d", [x], (n, out, ho, wo),
                        params={"weight": (out, c, kernel, kernel), "bias": (out,)},
                        attrs={"stride": [stride, stride], "padding": [padding, padding],
                               "dilation": [1, 1], "groups": 1},
                        flops=2.0 * n * out * ho * wo * c * kernel * kernel)

    def batchnorm(self, name: str, x: str) -> str:
        c = self._shapes[x][1]
        return self.add(name, "batchnorm", [x], self._shapes[x], params={"weight": (c,), "bias": (c,)},
                        attrs={"eps": 1e-5, "momentum": 0.1, "running_mean": None, "running_var": None},
                        flops=5 * math.prod(self._shapes[x]))

    def pool(self, name: str, x: str, *, kernel: int = 2) -> str:
        n, c, h, w = self._shapes[x]
        return self.add(name, "pool2d", [x], (n, c, h // kernel, w // kernel),
                        attrs={"mode": "max", "kernel": [kernel, kernel], "stride": [kernel, kernel],
                               "padding": [0, 0], "dilation": [1, 1], "ceil_mode": False,
                               "count_include_pad": True},
                        flops=math.prod(self._shapes[x]))

    def flatten(self, name: str, x: str) -> str:
        shape = self._shapes[x]
        out = (shape[0], math.prod(shape[1:]))
        return self.add(name, "reshape", [x], out, attrs={"shape": list(out)})

    def loss(self, logits: str, target: str, *, fn: str = "cross_entropy") -> str:
        return self.add("loss", "loss", [logits, target], (), attrs={"fn": fn, "reduction": "mean"},
                        flops=3 * math.prod(self._shapes[logits]))

    def build(self) -> OperatorGraph:
        return OperatorGraph(self.ops, name=self.name, batch_size=self.batch)


def mlp(batch: int = 64, sizes: tuple[int, ...] = (1024, 4096, 1024)) -> OperatorGraph:
    """input -> (linear -> relu)* -> linear -> mse loss, like the zoo's mlp."""
    b = GraphBuilder("mlp", batch)
    x = b.input("x", (batch, sizes[0]))
    for i, out in enumerate(sizes[1:]):
        x = b.linear(f"fc{i}", x, out)
        if i < len(sizes) - 2:
            x = b.relu(f"relu{i}", x)
    t = b.input("target", (batch, sizes[-1]), role="target")
    b.loss(x, t, fn="mse")
    return b.build()


def cnn(batch: int = 64, channels: int = 32, image: int = 32, classes: int = 16) -> OperatorGraph:
    """Two conv-bn-relu-pool blocks, flatten, two linear layers, cross entropy."""
    b = GraphBuilder("cnn", batch)
    x = b.input("x", (batch, 3, image, image))
    for i, c in enumerate((channels, 2 * channels)):
        x = b.conv(f"conv{i}", x, c)
        x = b.batchnorm(f"bn{i}", x)
        x = b.relu(f"relu{i}", x)
        x = b.pool(f"pool{i}", x)
    x = b.flatten("flatten", x)
    x = b.linear("fc0", x, 256)
    x = b.relu("relu_fc", x)
    x = b.linear("fc1", x, classes)
    t = b.input("target", (batch,), role="target", dtype="int64")
    b.loss(x, t)
    return b.build()


def rnn(batch: int = 64, vocab: int = 512, hidden: int = 128, steps: int = 8) -> OperatorGraph:
    """Embedding, two LSTM layers, a linear decoder over the vocabulary, cross entropy per token."""
    b = GraphBuilder("rnn", batch)
    x = b.input("tokens", (batch, steps), dtype="int64")
    x = b.add("embed", "embedding", [x], (batch, steps, hidden), params={"weight": (vocab, hidden)},
              attrs={"padding_idx": None}, flops=batch * steps * hidden)
    for i in range(2):
        x = b.add(f"lstm{i}", "lstm", [x], (batch, steps, hidden),
                  params={"weight_ih_l0": (4 * hidden, hidden), "weight_hh_l0": (4 * hidden, hidden),
                          "bias_ih_l0": (4 * hidden,), "bias_hh_l0": (4 * hidden,)},
                  attrs={"hidden_size": hidden, "num_layers": 1},
                  extra=((1, batch, hidden), (1, batch, hidden)),
                  flops=2.0 * batch * steps * 8 * hidden * hidden)
    x = b.linear("decoder", x, vocab)
    x = b.add("logits", "reshape", [x], (batch * steps, vocab), attrs={"shape": [batch * steps, vocab]})
    t = b.input("target", (batch * steps,), role="target", dtype="int64")
    b.loss(x, t)
    return b.build()


GRAPHS = {"mlp": mlp, "cnn": cnn, "rnn": rnn}


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_fixture_graphs_fit_the_registry(name: str):
    graph = GRAPHS[name]()
    for op in graph:
        dims_of(op)
        validate(op, ParallelConfig.single(0))
