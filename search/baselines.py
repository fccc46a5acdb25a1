"""The baseline strategies: dp, mp, tp and expert, each a plain function returning a `Strategy`.

They are presets of the general method (per-op `ParallelConfig`s), not special cases: the simulator,
the search and the runtime treat them like any other strategy. Every baseline gives every op of any graph
a valid config for a topology of any size; where a preferred split does not fit an op (its dim does not
divide, or the kind cannot split that way) the op falls back to the next preference, ending at "whole on
one device". `dp` alone refuses graphs whose batch does not divide over the devices
(`BaselineNotApplicable`), since data parallelism is then not defined.

Must not import torch or the runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from soap.config import ParallelConfig, parts
from soap.graph import Operator, OperatorGraph
from soap.opdef import DimKind, DimSpec, Region
from soap.registry import dims_of, op_def
from soap.strategy import Strategy
from soap.topology import DeviceTopology


class BaselineNotApplicable(ValueError):
    """The baseline is not defined for this graph and topology (e.g. batch smaller than the devices)."""


def _allowed(op: Operator, degrees: dict[str, int]) -> bool:
    dims = {d.name: d for d in dims_of(op)}
    for name, degree in degrees.items():
        d = dims[name]
        if degree > 1 and (not d.splittable or d.size % degree):
            return False
    return op_def(op.kind).check(op, degrees) is None


def split(op: Operator, dim: DimSpec | None, devices: Sequence[int]) -> ParallelConfig | None:
    """`op` split along `dim` over `devices` (whole on devices[0] when dim is None), or None if invalid."""
    if dim is None or len(devices) == 1:
        return ParallelConfig.single(devices[0])
    degrees = {dim.name: len(devices)}
    if not _allowed(op, degrees):
        return None
    return ParallelConfig(degrees=degrees, devices=tuple(devices))


def first_fit(op: Operator, candidates: Sequence[tuple[DimSpec | None, Sequence[int]]]) -> ParallelConfig:
    """The first candidate (dim, devices) that is a valid split of `op`; whole on device 0 otherwise."""
    for dim, devices in candidates:
        cfg = split(op, dim, devices)
        if cfg is not None:
            return cfg
    return ParallelConfig.single(0)


def _dims_of_kind(op: Operator, kind: DimKind) -> list[DimSpec]:
    return [d for d in dims_of(op) if d.kind is kind and d.splittable]


def _sample(op: Operator) -> DimSpec | None:
    found = _dims_of_kind(op, DimKind.SAMPLE)
    return found[0] if found else None


def _data_parallel(op: Operator, devices: Sequence[int]) -> ParallelConfig:
    """Sample split over `devices`, else over the largest prefix it divides, else whole."""
    sample = _sample(op)
    if sample is None:
        return ParallelConfig.single(devices[0])
    for n in range(len(devices), 0, -1):
        if len(devices) % n == 0 and sample.size % n == 0:
            cfg = split(op, sample, devices[:n])
            if cfg is not None:
                return cfg
    return ParallelConfig.single(devices[0])


def dp(graph: OperatorGraph, topology: DeviceTopology) -> Strategy:
    """Data parallelism: every op split on its sample dim over all devices."""
    n = topology.num_devices
    devices = tuple(range(n))
    for op in graph:
        if op.kind == "input":
            sample = _sample(op)
            if sample is not None and sample.size % n:
                raise BaselineNotApplicable(
                    f"dp needs the batch ({sample.size}) to divide over the {n} devices")
    return Strategy({op.name: _data_parallel(op, devices) for op in graph})


def _blocks(weights: Sequence[float], num_blocks: int) -> list[int]:
    """Block index per item: contiguous blocks whose weight sums are as even as a greedy cut makes them."""
    total = sum(weights) or 1.0
    out, acc = [], 0.0
    for w in weights:
        block = min(num_blocks - 1, int((acc + w / 2) / total * num_blocks))
        out.append(block)
        acc += w
    return out


def mp(graph: OperatorGraph, topology: DeviceTopology) -> Strategy:
    """Pure model parallelism: ops whole, placed layer-wise in contiguous compute-balanced blocks."""
    weights = [op.fwd_flops + op.bwd_flops + (1.0 if op.params else 0.0) for op in graph]
    blocks = _blocks(weights, topology.num_devices)
    return Strategy({op.name: ParallelConfig.single(b) for op, b in zip(graph, blocks, strict=True)})


def _contains(outer: Region, inner: Region | None) -> bool:
    return inner is None or all(lo <= ilo and ihi <= hi for (lo, hi), (ilo, ihi) in zip(outer, inner, strict=True))


def _follow(op: Operator, graph: OperatorGraph, configs: dict[str, ParallelConfig],
            dims: Sequence[DimSpec]) -> ParallelConfig | None:
    """The first of `dims` whose split over the devices of the producer of `op`'s first input reads, on
    every device, only what the producer's part there holds (None if none does, or the producer is whole
    or holds partial sums).

    Keeps a tensor-parallel layout flowing through reshapes, transposes, elementwise ops and attention
    instead of gathering it, and finds the row-parallel split of a linear fed by a column-parallel one.
    """
    if not op.inputs:
        return None
    ref = op.inputs[0]
    producer = graph[ref.op]
    pcfg = configs.get(producer.name)
    if pcfg is None or pcfg.num_parts == 1:
        return None
    pentry = op_def(producer.kind)
    held: dict[int, Region] = {}
    for box, device in parts(producer, pcfg):
        if pentry.reduced(producer, box) or device in held:
            return None
        held[device] = pentry.output_region(producer, box, ref.index)
    entry = op_def(op.kind)
    for dim in dims:
        if not dim.splittable or dim.size % pcfg.num_parts:
            continue
        cfg = split(op, dim, pcfg.devices)
        if cfg is not None and all(_contains(held[device], entry.input_regions(op, box)[0])
                                   for box, device in parts(op, cfg)):
            return cfg
    return None


def tp(graph: OperatorGraph, topology: DeviceTopology) -> Strategy:
    """Tensor parallelism (Megatron-style): ops with weights split on a parameter dim over all devices.

    A linear whose input arrives split on the features (from a column-split linear, through ops that keep
    the layout) takes the reduction split instead (row parallel), so the pair needs one all-reduce. Ops
    without weights keep their producer's layout where they can (through reshapes and transposes, so that
    the output projection after attention is row parallel), except attention, which splits on its heads;
    every other op runs data parallel.
    """
    devices = tuple(range(topology.num_devices))
    configs: dict[str, ParallelConfig] = {}
    for op in graph:
        cfg = None
        if op.params:
            if op.kind == "linear":
                cfg = _follow(op, graph, configs, _dims_of_kind(op, DimKind.REDUCTION))
            if cfg is None:
                cfg = next((c for c in (split(op, d, devices) for d in _dims_of_kind(op, DimKind.PARAMETER))
                            if c is not None), None)
        elif op.kind == "attention":
            cfg = split(op, next(d for d in dims_of(op) if d.name == "heads"), devices)
        if cfg is None and not op.params:
            cfg = _follow(op, graph, configs, [d for d in dims_of(op) if d.kind is not DimKind.REDUCTION])
        configs[op.name] = cfg if cfg is not None else _data_parallel(op, devices)
    return Strategy(configs)


def expert(graph: OperatorGraph, topology: DeviceTopology) -> Strategy:
    """The "one weird trick" expert strategy (Krizhevsky 2014), extended to RNNs as in GNMT.

    Convolutions, pools and everything else data parallel; fully connected layers (linear) and embeddings
    model parallel (parameter split over all devices); LSTM layers each placed whole on one device of a
    node (layer i on local device i mod devices-per-node), data parallel across nodes.
    """
    devices = tuple(range(topology.num_devices))
    nodes = sorted({d.node for d in topology.devices})
    per_node = [tuple(d.id for d in topology.devices if d.node == n) for n in nodes]
    configs: dict[str, ParallelConfig] = {}
    num_lstm = 0
    for op in graph:
        cfg = None
        if op.kind in ("linear", "embedding"):
            cfg = next((c for c in (split(op, d, devices) for d in _dims_of_kind(op, DimKind.PARAMETER))
                        if c is not None), None)
        elif op.kind == "lstm":
            local = num_lstm % min(len(p) for p in per_node)
            num_lstm += 1
            across = tuple(p[local] for p in per_node)
            cfg = first_fit(op, [(_sample(op), across), (None, across)])
        configs[op.name] = cfg if cfg is not None else _data_parallel(op, devices)
    return Strategy(configs)


BASELINES: dict[str, Callable[[OperatorGraph, DeviceTopology], Strategy]] = {
    "dp": dp, "mp": mp, "tp": tp, "expert": expert,
}
