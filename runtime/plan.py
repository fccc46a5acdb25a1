"""The execution plan: what every rank computes, sends, receives and synchronizes, derived once.

Owns `Transfer`, `EdgePlan`, `SyncEntry` and `Plan` (built by `build_plan(graph, strategy)`): for every op
its parts, for every input edge the point-to-point transfers from producer parts to consumer parts, which
tensors carry gradients, and which parameter shards are replicated over which device sets (gradient
synchronization). The plan is a pure function of the graph and the strategy, so every rank derives the
same one and the sends and receives of the SPMD interpreter match without negotiation.

Device `d` of the strategy is global rank `d`. Regions are in global tensor coordinates, half-open.

Pure Python: imports `soap` only (no torch, no simulator, no search, no soapflow).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from soap.config import parts
from soap.graph import OperatorGraph, TensorRef
from soap.opdef import Box, Region, intersect, region_numel
from soap.registry import op_def
from soap.strategy import Strategy

FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})


@dataclass(frozen=True, slots=True, kw_only=True)
class Transfer:
    """One piece of a tensor moving from a producer part to a consumer part (possibly on the same rank).

    `region` is the piece in global coordinates of the tensor; it lies inside the producer part's output
    region and inside the consumer part's input region.
    """

    src: int
    dst: int
    src_part: int
    dst_part: int
    region: Region


@dataclass(frozen=True, slots=True, kw_only=True)
class EdgePlan:
    """Input `slot` of consumer op `op`, reading output `ref.index` of `ref.op`.

    `regions[p]` is the input region consumer part `p` reads (None: the part does not read this input);
    `src_regions[j]` is the region of the tensor producer part `j` outputs.
    `reduced` says the producer parts hold partial sums that the consumer adds up. `local` says every rank
    holds the whole tensor itself (a constant or the batch): no transfers. `needs_grad` says a gradient
    flows back.
    """

    op: str
    slot: int
    ref: TensorRef
    regions: tuple[Region | None, ...]
    src_regions: tuple[Region, ...]
    transfers: tuple[Transfer, ...]
    reduced: bool
    local: bool
    needs_grad: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncEntry:
    """A parameter gradient to all-reduce over `group` (sorted ranks) once backward is past `ready_after`.

    `region` is the shard (None: the full parameter, used when the parameter's shards on different ranks
    overlap without being equal, so each holder contributes a full-size buffer).
    """

    fqn: str
    region: Region | None
    group: tuple[int, ...]
    ready_after: str
    numel: int
    dtype: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """Everything the interpreter needs, identical on every rank."""

    parts: Mapping[str, tuple[tuple[Box, int], ...]]
    edges: Mapping[str, tuple[EdgePlan, ...]]
    needs_grad: Mapping[TensorRef, bool]
    shards: Mapping[str, Mapping[Region, tuple[int, ...]]]
    param_shapes: Mapping[str, tuple[int, ...]]
    sync: tuple[SyncEntry, ...]
    groups: tuple[tuple[int, ...], ...]
    loss_op: str
    num_devices: int

    def local_part(self, op: str, rank: int) -> int | None:
        """Index of the part of `op` that runs on `rank` (devices of a config are distinct: at most one)."""
        for i, (_, device) in enumerate(self.parts[op]):
            if device == rank:
                return i
        return None

    def ranks_of(self, op: str) -> tuple[int, ...]:
        return tuple(device for _, device in self.parts[op])


def needs_grad(graph: OperatorGraph) -> dict[TensorRef, bool]:
    """Which tensors carry a gradient: floating outputs of ops downstream of some parameter."""
    out: dict[TensorRef, bool] = {}
    for op in graph:
        if op.kind in ("input", "constant"):
            upstream = False
        else:
            upstream = bool(op.params) or any(out[r] for r in op.inputs)
        for i, spec in enumerate(op.outputs):
            out[TensorRef(op=op.name, index=i)] = upstream and spec.dtype in FLOAT_DTYPES
    return out


def _as_region(region) -> Region | None:
    return None if region is None else tuple((int(lo), int(hi)) for lo, hi in region)


def _edge(graph: OperatorGraph, strategy: Strategy, op_parts: Mapping[str, tuple[tuple[Box, int], ...]],
          consumer: str, slot: int, ref: TensorRef, needs_grad: bool) -> EdgePlan:
    cons = graph[consumer]
    prod = graph[ref.op]
    cdef, pdef = op_def(cons.kind), op_def(prod.kind)
    regions = tuple(_as_region(cdef.input_regions(cons, box)[slot]) for box, _ in op_parts[consumer])
    # A constant (a buffer) and an input (the batch) exist on every process (`OpDef.everywhere`): reading
    # them never moves data.
    local = pdef.everywhere
    pparts = op_parts[ref.op]
    reduced_flags = [pdef.reduced(prod, box) for box, _ in pparts]
    reduced = any(reduced_flags)
    assert reduced == all(reduced_flags), f"{prod.name}: some parts hold partial sums and some do not"
    out_regions = tuple(_as_region(pdef.output_region(prod, box, ref.index)) for box, _ in pparts)
    transfers: list[Transfer] = []
    if not local:
        for p, ((_, dst), want) in enumerate(zip(op_parts[consumer], regions, strict=True)):
            if want is None or region_numel(want) == 0:
                continue
            pieces: dict[Region, list[int]] = {}
            for j, have in enumerate(out_regions):
                piece = intersect(have, want)
                if piece is not None:
                    pieces.setdefault(piece, []).append(j)
            for piece, sources in pieces.items():
                if not reduced and len(sources) > 1:
                    # Identical non-partial pieces are replicas of one value: read one, preferring a
                    # local copy. Its gradient then goes to that replica only; the replicas' other
                    # gradient contributions still meet in the parameter all-reduce and input adjoints.
                    local_src = [j for j in sources if pparts[j][1] == dst]
                    sources = local_src[:1] or sources[:1]
                for j in sources:
                    transfers.append(Transfer(src=pparts[j][1], dst=dst, src_part=j, dst_part=p,
                                              region=piece))
            if not reduced:
                covered = sum(region_numel(piece) for piece in pieces)
                assert covered == region_numel(want), (
                    f"{consumer} input {slot}: producer {prod.name} parts cover {covered} of "
                    f"{region_numel(want)} elements of region {want}")
    return EdgePlan(op=consumer, slot=slot, ref=ref, regions=regions, src_regions=out_regions,
                    transfers=tuple(transfers),
                    reduced=reduced, local=local, needs_grad=needs_grad)


def _pairwise_equal_or_disjoint(regions: list[Region]) -> bool:
    return all(a == b or intersect(a, b) is None for i, a in enumerate(regions) for b in regions[i + 1:])


def build_plan(graph: OperatorGraph, strategy: Strategy, num_devices: int) -> Plan:
    """The plan for `graph` under `strategy` on `num_devices` ranks (the strategy is already validated)."""
    op_parts = {op.name: tuple(parts(op, strategy[op.name])) for op in graph}
    grad_needed = needs_grad(graph)
    edges = {
        op.name: tuple(_edge(graph, strategy, op_parts, op.name, slot, ref, grad_needed[ref])
                       for slot, ref in enumerate(op.inputs))
        for op in graph
    }
    # Parameter shards: (fqn, region) -> ranks holding it; the backward pass finishes a parameter's
    # gradient at its earliest user in forward order (backward walks the ops in reverse).
    shards: dict[str, dict[Region, set[int]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    first_user: dict[str, str] = {}
    for op in graph:
        entry = op_def(op.kind)
        for box, device in op_parts[op.name]:
            for name, region in entry.param_regions(op, box).items():
                spec = op.params[name]
                shards.setdefault(spec.fqn, {}).setdefault(_as_region(region), set()).add(device)
                shapes[spec.fqn] = spec.shape
                dtypes[spec.fqn] = spec.dtype
                first_user.setdefault(spec.fqn, op.name)
    sync: list[SyncEntry] = []
    for op in reversed(graph.ops):
        for fqn in sorted(f for f, user in first_user.items() if user == op.name):
            regions = sorted(shards[fqn])
            if _pairwise_equal_or_disjoint(regions):
                for region in regions:
                    group = tuple(sorted(shards[fqn][region]))
                    if len(group) > 1:
                        sync.append(SyncEntry(fqn=fqn, region=region, group=group, ready_after=op.name,
                                              numel=region_numel(region), dtype=dtypes[fqn]))
            else:
                # Even on one rank: two overlapping shards there must each see the other's gradient.
                group = tuple(sorted(set().union(*shards[fqn].values())))
                full = tuple((0, s) for s in shapes[fqn])
                sync.append(SyncEntry(fqn=fqn, region=None, group=group, ready_after=op.name,
                                      numel=region_numel(full), dtype=dtypes[fqn]))
    groups = tuple(sorted({e.group for e in sync if len(e.group) > 1}))
    loss = graph.ops[-1]
    assert loss.outputs[0].numel == 1, f"the last op {loss.name!r} must be the scalar loss"
    return Plan(parts=op_parts, edges=edges, needs_grad=grad_needed,
                shards={f: {r: tuple(sorted(d)) for r, d in regs.items()} for f, regs in shards.items()},
                param_shapes=shapes, sync=tuple(sync), groups=groups, loss_op=loss.name,
                num_devices=num_devices)
