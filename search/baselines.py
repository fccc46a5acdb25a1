"""The baseline strategies: dp, mp, tp, expert and fsdp, each a plain function returning a `Strategy`, and
the parametric Megatron-LM layout `hybrid:tp=T[,pp=P][,microbatches=M][,shard=S][,ep=E][,recompute=none|full]`
(`parse_baseline` reads any baseline name). `mp` and `expert` run recurrent ops (LSTM, GRU, RNN) in time chunks,
8 by default (`mp:chunks=K`, `expert:chunks=K`, fewer where K does not divide the time steps; K = 1
keeps them whole): layers on different devices
then overlap on different chunks, FlexFlow's wavefront.

They are presets of the general method (per-op `ParallelConfig`s), not special cases: the simulator,
the search and the runtime treat them like any other strategy. Every baseline gives every op of any graph
a valid config for a topology of any size; where a preferred split does not fit an op (its dim does not
divide, or the kind cannot split that way) the op falls back to the next preference, ending at "whole on
one device". A baseline refuses the graph (`BaselineNotApplicable`, the message says why) where it would
not be what its name says: `dp` and `fsdp` where the batch does not divide over the devices (data
parallelism is then not defined), `tp` and `expert` where every op would fall back to one device (the
single-device layout under their name; `tp` where only the batch splits is dp, and runs), `hybrid` where
that is so within its tensor-parallel group, and
``mp:microbatches=M`` where M does not divide the batch (as `hybrid`).

Must not import torch or the runtime.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence

from search.space import cut_chunks, microbatched, sample_dim
from soap.config import ConfigError, ParallelConfig, param_replicas, parts, recompute_refusal, shardable, validate
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


def _batch_refusal(graph: OperatorGraph, parts_per_batch: int) -> int | None:
    """The batch (an input's sample dim) where it does not divide into `parts_per_batch` parts; None where
    every input's does."""
    for op in graph:
        if op.kind == "input":
            sample = _sample(op)
            if sample is not None and sample.size % parts_per_batch:
                return sample.size
    return None


def _several_devices(strategy: Strategy, num_devices: int, refusal: str) -> Strategy:
    """`strategy`, or `BaselineNotApplicable` with `refusal` where it runs every op on one device of several:
    every preferred split fell back to "whole on one device", and the baseline would be the single-device
    layout under its name."""
    if num_devices > 1 and len(strategy.devices_used()) == 1:
        raise BaselineNotApplicable(f"{refusal}: none does, so every op would run on one")
    return strategy


def dp(graph: OperatorGraph, topology: DeviceTopology) -> Strategy:
    """Data parallelism: every op split on its sample dim over all devices."""
    n = topology.num_devices
    batch = _batch_refusal(graph, n)
    if batch is not None:
        raise BaselineNotApplicable(f"dp needs the batch ({batch}) to divide over the {n} devices")
    return Strategy({op.name: _data_parallel(op, tuple(range(n))) for op in graph})


def _blocks(weights: Sequence[float], num_blocks: int) -> list[int]:
    """Block index per item: contiguous blocks whose weight sums are as even as a greedy cut makes them."""
    total = sum(weights) or 1.0
    out, acc = [], 0.0
    for w in weights:
        block = min(num_blocks - 1, int((acc + w / 2) / total * num_blocks))
        out.append(block)
        acc += w
    return out


def mp(graph: OperatorGraph, topology: DeviceTopology, *, chunks: int = 8, microbatches: int = 1) -> Strategy:
    """Pure model parallelism: ops whole, placed layer-wise in contiguous compute-balanced blocks; a
    recurrent op in `chunks` time chunks on its device (`chunked`), and the ops after it on the same
    device that keep its (sample, time) layout chunk by chunk too, so that consecutive blocks overlap
    on different chunks (a wavefront; no effect on models without recurrent ops). With `microbatches`
    M > 1 every other op runs its batch in M micro-batches on its device (`search.space.microbatched`;
    those that refuse repeated devices, or whose batch M does not divide, stay whole), so that the blocks
    pipeline on micro-batches (``mp:microbatches=M``; `BaselineNotApplicable` where M does not divide the
    batch, as in `hybrid`: micro-batches cut the batch)."""
    if microbatches > 1:
        batch = _batch_refusal(graph, microbatches)
        if batch is not None:
            raise BaselineNotApplicable(f"mp: the batch ({batch}) does not divide into {microbatches} micro-batches")
    weights = [op.fwd_flops + op.bwd_flops + (1.0 if op.params else 0.0) for op in graph]
    blocks = _blocks(weights, topology.num_devices)
    configs: dict[str, ParallelConfig] = {}
    for op, b in zip(graph, blocks, strict=True):
        cfg = chunked(op, ParallelConfig.single(b), chunks)
        if cfg.num_parts == 1 and not op.params:
            follow = _follow_chunks(op, graph, configs)
            cfg = follow if follow is not None and set(follow.devices) == {b} else cfg
        if cfg.num_parts == 1 and microbatches > 1 and not op_def(op.kind).everywhere and sample_dim(op):
            micro = microbatched(op, cfg, microbatches)
            try:
                validate(op, micro, topology.num_devices)
                cfg = micro
            except ConfigError:
                pass
        configs[op.name] = cfg
    return Strategy(configs)


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
    the layout) takes the reduction split instead (row parallel), so the pair needs one all-reduce; a
    mixture of experts splits every expert's inner units (Megatron-LM's expert tensor parallelism). Ops
    without weights keep their producer's layout where they can (through reshapes and transposes, so that
    the output projection after attention is row parallel), except attention, which splits on its heads;
    every other op runs data parallel. `BaselineNotApplicable` where no op then splits (no weight dim, no
    heads and not the batch divide over the devices). Where only the batch splits, tp is dp.
    """
    n = topology.num_devices
    return _several_devices(_tensor_parallel(graph, tuple(range(n))), n,
                            f"tp needs weights, attention heads or the batch to split over the {n} devices")


def _tensor_parallel(graph: OperatorGraph, devices: tuple[int, ...]) -> Strategy:
    """`tp` over `devices`."""
    configs: dict[str, ParallelConfig] = {}
    for op in graph:
        cfg = None
        if op.params:
            if op.kind == "linear":
                cfg = _follow(op, graph, configs, _dims_of_kind(op, DimKind.REDUCTION))
            elif op.kind == "experts":  # every expert split as an MLP is (its inner units)
                cfg = split(op, next(d for d in dims_of(op) if d.name == "inner"), devices)
            if cfg is None:
                cfg = next((c for c in (split(op, d, devices) for d in _dims_of_kind(op, DimKind.PARAMETER))
                            if c is not None), None)
        elif op.kind == "attention":
            cfg = split(op, next(d for d in dims_of(op) if d.name == "heads"), devices)
        if cfg is None and not op.params:
            cfg = _follow(op, graph, configs, [d for d in dims_of(op) if d.kind is not DimKind.REDUCTION])
        configs[op.name] = cfg if cfg is not None else _data_parallel(op, devices)
    return Strategy(configs)


def expert(graph: OperatorGraph, topology: DeviceTopology, *, chunks: int = 8) -> Strategy:
    """The "one weird trick" expert strategy (Krizhevsky 2014), extended to RNNs as in GNMT.

    Convolutions, pools and everything else data parallel; fully connected layers (linear) and embeddings model
    parallel (parameter split over all devices; in a recurrent model over the devices of a node, data parallel
    across nodes, as GNMT splits its softmax over a node's GPUs); recurrent layers (LSTM, GRU, RNN: ops with a
    carried dim) each placed whole on one device of a node (layer i on local device i mod devices-per-node),
    data parallel across nodes, each in `chunks` time chunks (`chunked`; where the time steps divide), and the
    ops between them that keep their (sample, time) layout split as they are, chunk by chunk on the same
    device, so that layer i + 1 runs chunk k while layer i runs chunk k + 1 (FlexFlow's wavefront over
    unrolled RNNs). `BaselineNotApplicable` where every op would then run on one device (no weights of a
    linear or embedding and no batch divide over the devices, and no two recurrent layers to place apart).
    """
    devices = tuple(range(topology.num_devices))
    nodes = sorted({d.node for d in topology.devices})
    per_node = [tuple(d.id for d in topology.devices if d.node == n) for n in nodes]
    # a recurrent model is data parallel across nodes, its fully connected layers model parallel within a
    # node (GNMT's softmax split over a node's GPUs), where the nodes are equal blocks of devices
    size = len(per_node[0])
    recurrent = any(_carried(op) is not None for op in graph) and all(
        p == tuple(range(k * size, (k + 1) * size)) for k, p in enumerate(per_node))
    configs: dict[str, ParallelConfig] = {}
    num_recurrent = 0
    for op in graph:
        cfg = None
        if op.kind in ("linear", "embedding"):
            within = per_node[0] if recurrent else devices
            cfg = next((c for c in (split(op, d, within) for d in _dims_of_kind(op, DimKind.PARAMETER))
                        if c is not None), None)
            if cfg is not None and recurrent:
                cfg = _with_sample(op, cfg, len(per_node), size)
        elif _carried(op) is not None:
            local = num_recurrent % min(len(p) for p in per_node)
            num_recurrent += 1
            across = tuple(p[local] for p in per_node)
            cfg = first_fit(op, [(_sample(op), across), (None, across)])
            cfg = chunked(op, cfg, chunks)
        elif not op.params:
            cfg = _follow_chunks(op, graph, configs)
        configs[op.name] = cfg if cfg is not None else _data_parallel(op, devices)
    _lead_in(graph, configs)
    return _several_devices(Strategy(configs), len(devices),
                            f"expert needs fully connected weights or the batch to split over the {len(devices)} "
                            f"devices, or recurrent layers to place on them")


def _lead_in(graph: OperatorGraph, configs: dict[str, ParallelConfig]) -> None:
    """Give the op feeding a chunked op (a dropout before the first LSTM), where it has no parameters and
    no other reader, the chunked op's devices, split on its sample dim like the chunks: its input then
    moves in one exchange before the wavefront starts, and the chunks read it where they run. (Split
    elsewhere, every chunk's exchange would involve devices that run later layers' chunks, which take
    part in it only once they reach it in the step's order: the layers would run one after another.)"""
    for op in graph:
        cfg = configs[op.name]
        if not op.inputs or len(set(cfg.devices)) == len(cfg.devices) or _carried(op) is None:
            continue
        producer = graph[op.inputs[0].op]
        pcfg = configs[producer.name]
        if (producer.params or op_def(producer.kind).everywhere or len(graph.consumers(producer.name)) > 1
                or len(set(pcfg.devices)) < len(pcfg.devices)):
            continue
        across = tuple(dict.fromkeys(cfg.devices))
        lead = split(producer, _sample(producer), across) if cfg.degree("sample") == len(across) else None
        if lead is not None:
            configs[producer.name] = lead


def _carried(op: Operator) -> DimSpec | None:
    return next((d for d in dims_of(op) if d.carried), None)


def chunked(op: Operator, cfg: ParallelConfig, chunks: int) -> ParallelConfig:
    """`cfg` with each of its parts cut into `chunks` chunks along the op's carried dim
    (`soap.opdef.DimSpec.carried`), run one after another on the part's device (the largest number up to
    `chunks` that divides the part's time steps; the layout is the search space's, `search.space.cut_chunks`);
    `cfg` itself where the op has no carried dim."""
    carried = _carried(op)
    if carried is None:
        return cfg
    steps = carried.size // cfg.degree(carried.name)
    chunks = max(g for g in range(1, min(chunks, steps) + 1) if steps % g == 0)
    return cfg if chunks == 1 else cut_chunks(op, cfg, carried.name, chunks)


def _follow_chunks(op: Operator, graph: OperatorGraph, configs: Mapping[str, ParallelConfig]) -> ParallelConfig | None:
    """For an op reading a chunked op (directly or through ops that followed one): the producer's layout
    on the op's dims with output axes 0 and 1 (sample and time), where every part then reads only what
    the producer's part on its device holds; None otherwise."""
    if not op.inputs or op.kind == "loss":
        return None
    producer = graph[op.inputs[0].op]
    pcfg = configs.get(producer.name)
    if pcfg is None or len(set(pcfg.devices)) == len(pcfg.devices):
        return None
    pdims = {d.out_axis: d for d in dims_of(producer) if d.out_axis is not None}
    dims = {d.out_axis: d for d in dims_of(op) if d.out_axis is not None}
    if not {0, 1} <= set(pdims) or not {0, 1} <= set(dims) or set(pcfg.degrees) - {pdims[0].name, pdims[1].name}:
        return None
    degrees = {dims[a].name: pcfg.degree(pdims[a].name) for a in (0, 1) if pcfg.degree(pdims[a].name) > 1}
    if not _allowed(op, degrees) or math.prod(degrees.values()) != len(pcfg.devices):
        return None
    cfg = ParallelConfig(degrees=degrees, devices=pcfg.devices)
    pentry, entry = op_def(producer.kind), op_def(op.kind)
    held = {c: pentry.output_region(producer, box, op.inputs[0].index)
            for c, (box, _) in enumerate(parts(producer, pcfg))}
    if all(_contains(held[c], entry.input_regions(op, box)[0]) for c, (box, _) in enumerate(parts(op, cfg))):
        return cfg
    return None


def _sharded(op: Operator, cfg: ParallelConfig, shard: int, shared: Mapping[str, tuple[str, ...]]) -> ParallelConfig:
    """`cfg` with its parameters sharded over `shard` of their replicas where that is allowed (the op has
    parameters, none frozen, that no other op shares, and `shard` divides their replica count); `cfg`
    otherwise."""
    if shard == 1 or not shardable(op, shared):
        return cfg
    if param_replicas(op, cfg) % shard:
        return cfg
    return cfg.replace(shard=shard)


def fsdp(graph: OperatorGraph, topology: DeviceTopology) -> Strategy:
    """Fully sharded data parallelism (ZeRO-3): `dp` with every op's parameters sharded over all their
    replicas (parameters shared by several ops, tied embeddings, stay replicated)."""
    n = topology.num_devices
    batch = _batch_refusal(graph, n)
    if batch is not None:
        raise BaselineNotApplicable(f"fsdp needs the batch ({batch}) to divide over the {n} devices")
    base = dp(graph, topology)
    shared = graph.shared_params()
    return Strategy({op.name: _sharded(op, base[op.name], param_replicas(op, base[op.name]), shared)
                     for op in graph})


def _branch_point(graph: OperatorGraph, op: Operator) -> bool:
    """Whether one of `op`'s outputs is read by two or more ops (counted per output: a split into q, k
    and v whose outputs are each read once is not a branch point; nor is the input of a fused projection
    that capture split per piece, whose pieces count as the one op they were)."""
    readers: dict[int, set[str]] = {}
    for consumer, _, index in graph.consumers(op.name):
        blocks = [p.fqn for p in graph[consumer].params.values() if p.offset]
        readers.setdefault(index, set()).add(blocks[0] if blocks else consumer)
    return any(len(ops) >= 2 for ops in readers.values())


def recompute_full(graph: OperatorGraph, strategy: Strategy) -> Strategy:
    """`strategy` with every op recomputing except the tensors a step keeps as checkpoints: the ops one of
    whose outputs is read by two or more ops (branch points: a residual stream, a block's input), the
    loss, and ops that cannot recompute.

    In a transformer that keeps the residual stream (each block's input and the sum after its attention)
    and recomputes the chains between them, the q, k, v split and the attention included (Megatron-LM's
    full recomputation keeps only each layer's input)."""
    configs = dict(strategy.configs)
    last = graph.ops[-1].name
    for op in graph:
        if op.name != last and not _branch_point(graph, op) and recompute_refusal(op) is None:
            configs[op.name] = configs[op.name].replace(recompute=True)
    return Strategy(configs)


def _with_sample(op: Operator, cfg: ParallelConfig, groups: int, group_size: int,
                 microbatches: int = 1) -> ParallelConfig | None:
    """`cfg` (a config over devices 0..group_size-1 of one group) replicated over `groups` consecutive
    groups of devices, group g taking the g-th contiguous block of the batch in `microbatches` contiguous
    micro-batches (a sample split `groups` x `microbatches` times finer, each group's devices repeated per
    micro-batch); None when the op cannot split its sample dim that far."""
    if groups == 1 and microbatches == 1:
        return cfg
    sample = _sample(op)
    if sample is None:
        return None
    names = [d.name for d in dims_of(op)]
    s = names.index(sample.name)
    inner = [cfg.degree(name) for name in names]
    k = inner[s]
    outer = list(inner)
    outer[s] = k * groups * microbatches
    degrees = {name: g for name, g in zip(names, outer, strict=True) if g > 1}
    if not _allowed(op, degrees):
        return None
    device_of = dict(zip(itertools.product(*(range(g) for g in inner)), cfg.devices, strict=True))
    devices = []
    for idx in itertools.product(*(range(g) for g in outer)):  # part order, as `soap.config.parts`
        block, local = divmod(idx[s], k)
        devices.append(block // microbatches * group_size + device_of[idx[:s] + (local,) + idx[s + 1:]])
    return ParallelConfig(degrees=degrees, devices=tuple(devices))


def _regrouped(op: Operator, cfg: ParallelConfig) -> Iterator[ParallelConfig]:
    """`cfg`'s devices, where `cfg` splits the op's sample dim over them, split on another attribute dim of
    the op instead (those the registry allows, in the op's dim order)."""
    sample = _sample(op)
    if sample is None or cfg.degree(sample.name) == 1:
        return
    for dim in _dims_of_kind(op, DimKind.ATTRIBUTE):
        alt = split(op, dim, cfg.devices)
        if alt is not None:
            yield alt


def _shifted(cfg: ParallelConfig, offset: int) -> ParallelConfig:
    return cfg if not offset else cfg.replace(devices=tuple(d + offset for d in cfg.devices))


def pipeline_stages(graph: OperatorGraph, stages: int) -> list[int]:
    """Stage index per op: `stages` runs of consecutive ops balanced by their compute (forward and backward
    FLOPs), as Megatron-LM's pipeline stages of consecutive layers."""
    return _blocks([op.fwd_flops + op.bwd_flops for op in graph], stages)


def hybrid(graph: OperatorGraph, topology: DeviceTopology, *, tp_size: int, shard: int = 1,
           recompute: str = "none", pp: int = 1, microbatches: int = 1, ep: int = 1) -> Strategy:
    """The Megatron-LM layout: data parallel over replicas of `pp` x `tp_size` consecutive devices, each
    replica's batch in `microbatches` micro-batches (its devices repeated); inside a replica, `pp`
    pipeline stages of consecutive ops (`pipeline_stages`), stage s on the replica's s-th group of
    `tp_size` devices, `tp` within the group; parameters sharded over `shard` of their replicas, and with
    ``recompute="full"`` the recomputation of `recompute_full`. Replicas outermost (Megatron-LM puts the
    pipeline outermost instead) keep every replica a block of devices, which a 512-device simulation
    times by one replica (`soap.lowering.find_replicas`); a stage's tensor-parallel group stays inside
    a node where tp divides its size either way. With `ep` > 1 (Megatron-LM's expert-model-parallel size),
    every mixture of experts (`experts` op) is split over its experts `ep` ways and over its tokens n / ep
    ways instead (`_expert_parallel`): each group of `ep` consecutive devices shares a slice of the tokens
    and holds all the experts between them."""
    n = topology.num_devices
    if pp < 1 or n % pp:
        raise BaselineNotApplicable(f"hybrid: pp={pp} does not divide the {n} devices")
    per_stage = n // pp
    if tp_size < 1 or per_stage % tp_size:
        raise BaselineNotApplicable(f"hybrid: tp={tp_size} does not divide the {per_stage} devices of a stage"
                                    if pp > 1 else f"hybrid: tp={tp_size} does not divide the {n} devices")
    groups = per_stage // tp_size
    if shard < 1 or groups % shard:
        raise BaselineNotApplicable(f"hybrid: shard={shard} does not divide the {groups} data-parallel "
                                    f"group(s) (tp={tp_size} over {n} devices"
                                    + (f" in {pp} stages)" if pp > 1 else ")"))
    if microbatches > 1 and shard > 1:
        raise BaselineNotApplicable("hybrid: micro-batches with shard > 1 are not built yet "
                                    "(a device runs one part of a sharded op)")
    if ep > 1 and (pp > 1 or microbatches > 1):
        raise BaselineNotApplicable("hybrid: ep with pipeline stages or micro-batches is not built yet")
    if ep > 1 and not any(op.kind == "experts" for op in graph):
        raise BaselineNotApplicable("hybrid: ep needs a mixture of experts (an experts op); the model has none")
    for op in graph:
        if op.kind == "input":
            sample = _sample(op)
            if sample is not None and sample.size % (groups * microbatches):
                raise BaselineNotApplicable(
                    f"hybrid: the batch ({sample.size}) does not divide over the {groups} data-parallel "
                    f"groups" + (f" x {microbatches} micro-batches" if microbatches > 1 else ""))
    inner = _several_devices(_tensor_parallel(graph, tuple(range(tp_size))), tp_size,
                             f"hybrid: tp={tp_size} needs weights, attention heads or the batch to split over a "
                             f"group of {tp_size} devices")
    shared = graph.shared_params()
    stage_of = pipeline_stages(graph, pp) if pp > 1 else [0] * len(graph.ops)
    working = {stage for op, stage in zip(graph, stage_of, strict=True) if op.fwd_flops + op.bwd_flops > 0}
    if pp > 1 and len(working) < pp:
        computing = sum(op.fwd_flops + op.bwd_flops > 0 for op in graph)
        raise BaselineNotApplicable(f"hybrid: pp={pp} leaves {pp - len(working)} of the {pp} stages with nothing to "
                                    f"compute (the model has {computing} ops that compute)")
    configs = {}
    for op, stage in zip(graph, stage_of, strict=True):
        local = _shifted(inner[op.name], stage * tp_size)  # the stage's group of the first replica
        cfg = _with_sample(op, local, groups, pp * tp_size, microbatches)
        if cfg is None:
            # the batch of a micro-batch does not split over the group: split another dim over it (the
            # sequence of a LayerNorm or a dropout, as Megatron-LM's sequence parallelism)
            cfg = next((c for c in (_with_sample(op, alt, groups, pp * tp_size, microbatches)
                                    for alt in _regrouped(op, local)) if c is not None), None)
        if cfg is None:
            cfg = local  # no sample dim: it runs in the first replica only
        if ep > 1 and op.kind == "experts":
            cfg = _expert_parallel(op, ep, n)
        configs[op.name] = _sharded(op, cfg, shard, shared)
    strategy = Strategy(configs)
    return recompute_full(graph, strategy) if recompute == "full" else strategy


def _expert_parallel(op: Operator, ep: int, n: int) -> ParallelConfig:
    """Experts op `op` split over its experts `ep` ways and its tokens n / ep ways over devices 0..n-1, the
    `ep` expert parts of a token slice on consecutive devices."""
    experts = next(d for d in dims_of(op) if d.name == "experts")
    sample = _sample(op)
    if n % ep:
        raise BaselineNotApplicable(f"hybrid: ep={ep} does not divide the {n} devices")
    if experts.size % ep:
        raise BaselineNotApplicable(f"hybrid: ep={ep} does not divide the {experts.size} experts of {op.name}")
    if sample is None or sample.size % (n // ep):
        raise BaselineNotApplicable(f"hybrid: the tokens of {op.name} do not divide over {n // ep} groups of {ep} "
                                    f"devices")
    degrees = {name: g for name, g in ((sample.name, n // ep), ("experts", ep)) if g > 1}
    return ParallelConfig(degrees=degrees, devices=tuple(range(n)))


BASELINES: dict[str, Callable[[OperatorGraph, DeviceTopology], Strategy]] = {
    "dp": dp, "mp": mp, "tp": tp, "expert": expert, "fsdp": fsdp,
}


class BaselineSpecError(ValueError):
    """A baseline name that is not one (a malformed ``hybrid:`` spec, say); the message says why."""


def parse_baseline(ref: str) -> Callable[[OperatorGraph, DeviceTopology], Strategy] | None:
    """The baseline function `ref` names (a key of `BASELINES`, ``mp:chunks=K,microbatches=M`` (either
    optional), ``expert:chunks=K``, or
    ``hybrid:tp=T[,pp=P][,microbatches=M][,shard=S][,ep=E][,recompute=none|full]``), None when `ref` names no
    baseline; `BaselineSpecError` for a malformed spec."""
    if ref in BASELINES:
        return BASELINES[ref]
    name, colon, spec = ref.partition(":")
    if colon and name in ("mp", "expert"):
        allowed = ("chunks", "microbatches") if name == "mp" else ("chunks",)
        usage = f"{name}:" + ",".join(f"{k}={'K' if k == 'chunks' else 'M'}" for k in allowed) + " (>= 1 each)"
        options: dict[str, int] = {}
        for item in spec.split(","):
            key, eq, value = (x.strip() for x in item.partition("="))
            if not eq or key not in allowed or key in options or not value.isdigit() or int(value) < 1:
                raise BaselineSpecError(f"malformed baseline {ref!r}: expected {usage}")
            options[key] = int(value)
        make = BASELINES[name]
        return lambda graph, topology: make(graph, topology, **options)
    if not ref.startswith("hybrid:"):
        return None
    usage = "hybrid:tp=T[,pp=P][,microbatches=M][,shard=S][,ep=E][,recompute=none|full]"
    fields: dict[str, str] = {}
    for item in ref[len("hybrid:"):].split(","):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise BaselineSpecError(f"malformed baseline {ref!r}: {item!r} is not key=value; expected {usage}")
        if key in fields:
            raise BaselineSpecError(f"malformed baseline {ref!r}: {key} given twice")
        fields[key] = value
    numeric = ("tp", "pp", "microbatches", "shard", "ep")
    unknown = sorted(set(fields) - {*numeric, "recompute"})
    if unknown:
        raise BaselineSpecError(f"malformed baseline {ref!r}: unknown key(s) {', '.join(unknown)}; expected {usage}")
    numbers = {}
    for key in numeric:
        if key in fields:
            if not fields[key].isdigit() or int(fields[key]) < 1:
                raise BaselineSpecError(f"malformed baseline {ref!r}: {key} must be a positive integer, "
                                        f"got {fields[key]!r}")
            numbers[key] = int(fields[key])
    if "tp" not in numbers:
        raise BaselineSpecError(f"malformed baseline {ref!r}: tp=T is required; expected {usage}")
    recompute = fields.get("recompute", "none")
    if recompute not in ("none", "full"):
        raise BaselineSpecError(f"malformed baseline {ref!r}: recompute must be none or full, got {recompute!r}")

    def make(graph: OperatorGraph, topology: DeviceTopology) -> Strategy:
        return hybrid(graph, topology, tp_size=numbers["tp"], shard=numbers.get("shard", 1), recompute=recompute,
                      pp=numbers.get("pp", 1), microbatches=numbers.get("microbatches", 1), ep=numbers.get("ep", 1))

    return make
