"""The structure of a graph that the search's moves use: which ops neighbour which, and which are copies.

Owns `neighbours`, `carried`, `Copies`, `copies_of` and `modules_of`.

- Neighbours of an op: the ops producing its inputs (in input order), then those consuming its outputs
  (in graph order), leaving out sources that exist everywhere (the batch, constants).
- Copies: a model built from repeated blocks (transformer layers, ResNet blocks, stacked LSTM layers)
  has ops that are the same op in another copy of the block. Two ops are copies of each other when their
  names are the same but for their numbers (``blocks.3.attn.qkv`` and ``blocks.7.attn.qkv``; ``lstm0``
  and ``lstm1``) and they are the same computation: the same kind, input and output shapes and dtypes,
  parameter shapes, and attributes other than names. Each *class* of two or more copies is listed in
  graph order; an op's *copy index* is the tuple of the numbers in its name, the same for all the ops of
  one copy of a block.
- Modules: the ops a module of the model computes (`Operator.module`, the ops of its submodules included),
  for every module with at least two of them; modules whose paths are the same but for their numbers
  (``h.3.attn`` and ``h.7.attn``) are copies of one another.

Pure functions of the graph; must not import torch, the runtime or soapflow.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from soap.config import ConfigError, ParallelConfig, param_replicas, repeat_refusal, validate
from soap.graph import Operator, OperatorGraph
from soap.opdef import full_box
from soap.registry import dims_of, op_def

_NUMBER = re.compile(r"\d+")


def neighbours(graph: OperatorGraph) -> dict[str, list[str]]:
    """Per op, its neighbours (module docstring), each once."""
    near: dict[str, list[str]] = {op.name: [] for op in graph}
    for op in graph:
        for ref in op.inputs:
            if not op_def(graph[ref.op].kind).everywhere and ref.op not in near[op.name]:
                near[op.name].append(ref.op)
    for op in graph:
        for ref in op.inputs:
            if not op_def(graph[ref.op].kind).everywhere and op.name not in near[ref.op]:
                near[ref.op].append(op.name)
    return near


def carried(graph: OperatorGraph, name: str, own: ParallelConfig, other: ParallelConfig,
            num_devices: int, *, other_op: str | None = None) -> ParallelConfig | None:
    """`other`'s layout (degrees and devices) carried over to op `name`, which keeps its own `recompute`,
    and its `shard` where still valid: the degrees of the dims the op also has (by name), on `other`'s
    devices; None where that is not a valid config of the op. Given the op `other` is a config of,
    `other_op`, a dim the op does not have by name carries over to the op's dim that indexes the same
    axis of the tensor between them where one op reads the other's output (`_edge_axes`: a linear's
    `out_features` to its loss's `d1`, which keeps that tensor in place), else to the op's dim that
    indexes the same axis of its output (an LSTM's time chunks, on its `seq`, to a dropout's `d1`). A
    layout whose devices repeat (micro-batches, chunks) carries over without the shard where the shard
    refuses them (`soap.config.repeat_refusal`)."""
    op = graph[name]
    dims = {d.name for d in dims_of(op)}
    by_axis = {d.out_axis: d.name for d in dims_of(op) if d.out_axis is not None}
    axis_of = {} if other_op is None else {d.name: d.out_axis for d in dims_of(graph[other_op])}
    across = {} if other_op is None else _edge_axes(graph, name, other_op)
    degrees: dict[str, int] = {}
    for d, g in other.degrees.items():
        mine = d if d in dims else across.get(d, by_axis.get(axis_of.get(d)))
        if mine is not None and mine not in degrees:
            degrees[mine] = g
    try:
        cfg = ParallelConfig(degrees=degrees, devices=other.devices, recompute=own.recompute)
        if own.shard > 1 and param_replicas(op, cfg) % own.shard == 0:
            sharded = cfg.replace(shard=own.shard)
            if len(set(cfg.devices)) == cfg.num_parts or repeat_refusal(op, sharded) is None:
                cfg = sharded
        validate(op, cfg, num_devices)
    except (ConfigError, ValueError):
        return None
    return cfg


def _edge_axes(graph: OperatorGraph, name: str, other_op: str) -> dict[str, str]:
    """Per dim of `other_op`, the dim of op `name` that indexes the same axis of the tensor between them
    (output 0 of one, read by the other; the first such input): the producer's dim indexes an axis of its
    output (`DimSpec.out_axis`), the consumer's an axis of its input (`_input_axes`). Empty where neither
    reads the other's output 0."""
    op, other = graph[name], graph[other_op]
    for consumer, producer, other_reads in ((op, other, False), (other, op, True)):
        slot = next((s for s, ref in enumerate(consumer.inputs) if ref.op == producer.name and ref.index == 0),
                    None)
        if slot is None:
            continue
        reads = _input_axes(consumer, slot)  # consumer dim -> input axis
        writes = {d.out_axis: d.name for d in dims_of(producer) if d.out_axis is not None}
        pairs = {c: writes[a] for c, a in reads.items() if a in writes}  # consumer dim -> producer dim
        return pairs if other_reads else {p: c for c, p in pairs.items()}
    return {}


def _input_axes(op: Operator, slot: int) -> dict[str, int]:
    """Per dim of `op` that splits its input `slot` along one axis (a part covering half the dim reads
    less of that axis of the input and all of the others), that axis."""
    definition, dims = op_def(op.kind), dims_of(op)
    full = full_box(dims)
    try:
        whole = definition.input_regions(op, full)[slot]
    except (NotImplementedError, IndexError, ValueError):
        return {}
    if whole is None:
        return {}
    out = {}
    for k, d in enumerate(dims):
        if d.size < 2:
            continue
        try:
            region = definition.input_regions(op, full[:k] + ((0, d.size // 2),) + full[k + 1:])[slot]
        except ValueError:  # the half is not a box of the input (a reshape that merges axes)
            continue
        changed = [] if region is None else [a for a, (r, w) in enumerate(zip(region, whole, strict=True)) if r != w]
        if len(changed) == 1:
            out[d.name] = changed[0]
    return out


def _attrs_key(attrs: Mapping[str, object]) -> str:
    # attributes that hold names of the model's tensors (running statistics, module paths) differ between
    # copies; the others (shapes, strides, flags) must match
    return repr(sorted((k, repr(v)) for k, v in attrs.items()
                       if not (isinstance(v, str) and _NUMBER.search(v) and "." in v)))


def _signature(op: Operator) -> tuple:
    return (op.kind, _NUMBER.sub("#", op.name),
            tuple((t.shape, t.dtype) for t in op.outputs),
            tuple(sorted((name, p.shape, p.dtype) for name, p in op.params.items())),
            _attrs_key(op.attrs))


@dataclass(frozen=True, slots=True)
class Copies:
    """`classes`: the classes of copies (module docstring), each a tuple of op names in graph order;
    `index`: per op of a class, its copy index."""

    classes: tuple[tuple[str, ...], ...]
    index: Mapping[str, tuple[int, ...]]

    def same_copy(self, name: str) -> dict[int, str]:
        """Per class (by position in `classes`), its op in the same copy as op `name` (where it has one)."""
        want = self.index[name]
        return {k: m for k, members in enumerate(self.classes) for m in members if self.index[m] == want}


def copies_of(graph: OperatorGraph, ops: set[str] | None = None) -> Copies:
    """The classes of copies among the ops of `graph` (or among `ops`), sources left out."""
    by_signature: dict[tuple, list[str]] = {}
    for op in graph:
        if op_def(op.kind).everywhere or (ops is not None and op.name not in ops):
            continue
        by_signature.setdefault(_signature(op), []).append(op.name)
    classes = tuple(tuple(names) for names in by_signature.values() if len(names) > 1)
    index = {name: tuple(int(n) for n in _NUMBER.findall(name)) for members in classes for name in members}
    return Copies(classes=classes, index=index)


def modules_of(graph: OperatorGraph, ops: set[str] | None = None) -> list[tuple[tuple[str, ...], ...]]:
    """The modules of `graph` (module docstring) as classes of copies: per class, the op names of each of
    its modules, in graph order (only the ops of `ops` where given, sources left out)."""
    members: dict[str, list[str]] = {}
    for op in graph:
        if op_def(op.kind).everywhere or (ops is not None and op.name not in ops) or not op.module:
            continue
        parts = op.module.split(".")
        for depth in range(1, len(parts) + 1):
            members.setdefault(".".join(parts[:depth]), []).append(op.name)
    classes: dict[str, list[tuple[str, ...]]] = {}
    for path, names in members.items():
        if len(names) >= 2:
            classes.setdefault(_NUMBER.sub("#", path), []).append(tuple(names))
    # a module holding the same ops as one of its submodules adds nothing
    seen: set[tuple[str, ...]] = set()
    out = []
    for modules in classes.values():
        if modules[0] not in seen:
            seen.update(modules)
            out.append(tuple(modules))
    return out


__all__ = ["Copies", "carried", "copies_of", "modules_of", "neighbours"]
