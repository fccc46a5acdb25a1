"""Shared helpers of the simulator tests: hand-built graphs, random valid configs, data-parallel strategies.

`Net` appends ops in topological order with the attrs capture records (``input_shapes``) and the usual
FLOP formulas (2 per multiply-add forward, twice that backward), so analytical costs are plausible. The
few tests at the bottom check the helpers themselves.
"""

from __future__ import annotations

import math
import random

from soap.config import ParallelConfig, validate
from soap.graph import Operator, OperatorGraph, ParamSpec, TensorRef, TensorSpec
from soap.registry import dims_of, op_def
from soap.strategy import Strategy
from soap.topology import DeviceTopology

F32 = 4


class Net:
    """A graph under construction; every method returns the new op's name."""

    def __init__(self, name: str, batch: int):
        self.name, self.batch = name, batch
        self.ops: list[Operator] = []
        self.shapes: dict[str, tuple[int, ...]] = {}

    def add(self, name: str, kind: str, inputs: list[str], shape: tuple[int, ...], *,
            params: dict[str, tuple[int, ...]] | None = None, attrs: dict | None = None, flops: float = 0.0,
            dtype: str = "float32") -> str:
        in_shapes = [list(self.shapes[i]) for i in inputs]
        specs = {k: ParamSpec(shape=s, fqn=f"{name}.{k}") for k, s in (params or {}).items()}
        moved = (sum(math.prod(s) for s in in_shapes) + math.prod(shape) + sum(p.numel for p in specs.values())) * F32
        self.ops.append(Operator(
            name=name, kind=kind, inputs=tuple(TensorRef(op=i) for i in inputs),
            outputs=(TensorSpec(shape=shape, dtype=dtype),), params=specs,
            attrs={**(attrs or {}), "input_shapes": in_shapes}, module=name,
            fwd_flops=float(flops), bwd_flops=2.0 * flops, fwd_bytes=float(moved), bwd_bytes=2.0 * moved))
        self.shapes[name] = shape
        return name

    def input(self, name: str, shape: tuple[int, ...], *, role: str = "input", dtype: str = "float32") -> str:
        position = sum(op.kind == "input" for op in self.ops)
        return self.add(name, "input", [], shape, attrs={"position": position, "role": role}, dtype=dtype)

    def linear(self, name: str, x: str, out: int, *, bias: bool = True) -> str:
        shape = self.shapes[x]
        rows = math.prod(shape[:-1])
        params = {"weight": (out, shape[-1])} | ({"bias": (out,)} if bias else {})
        return self.add(name, "linear", [x], (*shape[:-1], out), params=params,
                        flops=2.0 * rows * shape[-1] * out)

    def relu(self, name: str, x: str) -> str:
        return self.add(name, "elementwise", [x], self.shapes[x], attrs={"fn": "relu"},
                        flops=math.prod(self.shapes[x]))

    def add2(self, name: str, a: str, b: str) -> str:
        return self.add(name, "binary", [a, b], self.shapes[a], attrs={"fn": "add"}, flops=math.prod(self.shapes[a]))

    def conv(self, name: str, x: str, out: int, *, kernel: int = 3, stride: int = 1, padding: int = 1) -> str:
        n, c, h, w = self.shapes[x]
        ho, wo = (h + 2 * padding - kernel) // stride + 1, (w + 2 * padding - kernel) // stride + 1
        return self.add(name, "conv2d", [x], (n, out, ho, wo),
                        params={"weight": (out, c, kernel, kernel), "bias": (out,)},
                        attrs={"stride": [stride, stride], "padding": [padding, padding], "dilation": [1, 1],
                               "groups": 1},
                        flops=2.0 * n * out * ho * wo * c * kernel * kernel)

    def batchnorm(self, name: str, x: str) -> str:
        c = self.shapes[x][1]
        return self.add(name, "batchnorm", [x], self.shapes[x], params={"weight": (c,), "bias": (c,)},
                        attrs={"eps": 1e-5, "momentum": 0.1, "running_mean": None, "running_var": None},
                        flops=5 * math.prod(self.shapes[x]))

    def pool(self, name: str, x: str, *, kernel: int = 2) -> str:
        n, c, h, w = self.shapes[x]
        return self.add(name, "pool2d", [x], (n, c, h // kernel, w // kernel),
                        attrs={"mode": "max", "kernel": [kernel, kernel], "stride": [kernel, kernel],
                               "padding": [0, 0], "dilation": [1, 1], "ceil_mode": False,
                               "count_include_pad": True},
                        flops=math.prod(self.shapes[x]))

    def concat(self, name: str, xs: list[str], axis: int = 1) -> str:
        shape = list(self.shapes[xs[0]])
        shape[axis] = sum(self.shapes[x][axis] for x in xs)
        return self.add(name, "concat", xs, tuple(shape), attrs={"axis": axis})

    def flatten(self, name: str, x: str) -> str:
        shape = self.shapes[x]
        out = (shape[0], math.prod(shape[1:]))
        return self.add(name, "reshape", [x], out, attrs={"shape": list(out)})

    def mse(self, name: str, x: str, target: str) -> str:
        return self.add(name, "loss", [x, target], (), attrs={"fn": "mse", "reduction": "mean"},
                        flops=3 * math.prod(self.shapes[x]))

    def cross_entropy(self, name: str, x: str, target: str) -> str:
        return self.add(name, "loss", [x, target], (), attrs={"fn": "cross_entropy", "reduction": "mean"},
                        flops=5 * math.prod(self.shapes[x]))

    def graph(self) -> OperatorGraph:
        return OperatorGraph(self.ops, name=self.name, batch_size=self.batch)


def mlp(batch: int = 64, sizes: tuple[int, ...] = (256, 512, 512, 256)) -> OperatorGraph:
    """input -> (linear -> relu)* -> linear -> mse."""
    net = Net("mlp", batch)
    x = net.input("x", (batch, sizes[0]))
    for i, b in enumerate(sizes[1:]):
        x = net.linear(f"fc{i}", x, b)
        if i < len(sizes) - 2:
            x = net.relu(f"relu{i}", x)
    y = net.input("y", (batch, sizes[-1]), role="target")
    net.mse("loss", x, y)
    return net.graph()


def chain(batch: int = 64, width: int = 128, depth: int = 8) -> OperatorGraph:
    """A synthetic chain of linear / relu / residual adds (the simulator-speed stand-in graph)."""
    net = Net(f"chain{depth}", batch)
    x = net.input("x", (batch, width))
    for i in range(depth):
        h = net.linear(f"fc{i}", x, width)
        h = net.relu(f"relu{i}", h)
        x = net.add2(f"add{i}", x, h) if i % 2 else h
    y = net.input("y", (batch, width), role="target")
    net.mse("loss", x, y)
    return net.graph()


def small_cnn(batch: int = 16, channels: int = 8, size: int = 16, classes: int = 10) -> OperatorGraph:
    """conv-bn-relu, two branches concatenated, pool, linear, cross entropy: halos, concat, reshape."""
    net = Net("small_cnn", batch)
    x = net.input("x", (batch, 3, size, size))
    x = net.relu("relu0", net.batchnorm("bn0", net.conv("conv0", x, channels)))
    a = net.relu("relu_a", net.conv("conv_a", x, channels, kernel=1, padding=0))
    b = net.relu("relu_b", net.conv("conv_b", x, channels))
    x = net.pool("pool", net.concat("cat", [a, b]))
    x = net.linear("fc", net.flatten("flatten", x), classes)
    y = net.input("y", (batch,), role="target", dtype="int64")
    net.cross_entropy("loss", x, y)
    return net.graph()


def data_parallel(graph: OperatorGraph, devices: tuple[int, ...]) -> Strategy:
    """Every op split on `sample` over `devices` where it divides; else on as many as divide; else whole."""
    configs = {}
    for op in graph:
        dims = {d.name: d for d in dims_of(op)}
        cfg = ParallelConfig.single(devices[0])
        sample = dims.get("sample")
        if sample is not None and sample.splittable:
            for n in range(len(devices), 1, -1):
                if len(devices) % n == 0 and sample.size % n == 0:
                    cfg = ParallelConfig(degrees={"sample": n}, devices=devices[:n])
                    break
        configs[op.name] = cfg
    return Strategy(configs)


def random_config(op: Operator, num_devices: int, rng: random.Random) -> ParallelConfig:
    """A random valid config: degrees dividing their dims whose product divides the device count, on a
    random contiguous device block."""
    if op_def(op.kind).everywhere:
        return ParallelConfig.single(rng.randrange(num_devices))
    dims = [d for d in dims_of(op) if d.splittable]
    for _ in range(50):
        degrees: dict[str, int] = {}
        budget = num_devices
        for d in rng.sample(dims, len(dims)):
            options = [g for g in range(1, budget + 1) if budget % g == 0 and d.size % g == 0]
            g = rng.choice(options)
            if g > 1:
                degrees[d.name] = g
                budget //= g
        if op_def(op.kind).check(op, degrees) is not None:
            continue
        parts = math.prod(degrees.values())
        first = rng.randrange(num_devices - parts + 1)
        cfg = ParallelConfig(degrees=degrees, devices=tuple(range(first, first + parts)))
        validate(op, cfg, num_devices)
        return cfg
    return ParallelConfig.single(rng.randrange(num_devices))


def random_strategy(graph: OperatorGraph, topology: DeviceTopology, rng: random.Random) -> Strategy:
    return Strategy({op.name: random_config(op, topology.num_devices, rng) for op in graph})


# -- checks of the helpers -----------------------------------------------------------------------------


def test_helpers_build_valid_graphs_and_configs():
    rng = random.Random(0)
    for graph in (mlp(), chain(), small_cnn()):
        assert graph.ops[-1].kind == "loss"
        for op in graph:
            for _ in range(5):
                validate(op, random_config(op, 8, rng), 8)
        for op in graph:
            validate(op, data_parallel(graph, tuple(range(4)))[op.name], 4)
