"""Task graph planning (FlexFlow section 5): which tasks a strategy makes, on which resources, for how long.

Owns `GraphFacts` (what the task graph needs to know about an `OperatorGraph`, once), `KeySpace` (the
static task keys that order ties), and `Planner`, which turns one op's config into an `OpPlan` and one
edge's (producer config, consumer config) into an `EdgePlan`, with caches held by the planner itself.
The simulator (`simulator.engine`) instantiates plans as tasks. Must import only `soap`, numpy and
the stdlib.

Tasks of a strategy (times from the cost model and `simulator.comm`):

- per part of an op: a forward task and (when a gradient reaches the op) a backward task on its device;
  ops of kind ``input`` and ``constant`` have none (zero compute: the batch is loaded where its parts are,
  buffers are everywhere);
- per edge (producer output -> consumer input) and pair (producer part p, consumer part c) whose regions
  intersect: a dependency when p and c share a device, else the intersection travels. All the pieces of
  one edge that travel in one pass make ONE exchange task (`Comm.exchange`: the union of their routes,
  the largest latency plus the busiest link's bytes), after every sending part and before every receiving
  part, because that is what the runtime does: it packs them into one all-to-all per consumer op and
  pass (`runtime.collectives.exchange`; the simulator makes one per input edge). When the producer
  holds partial sums (a reduction dim is split, `OpDef.reduced`), every consumer part with two or more
  contributions gets a *reduce* task on its device (the partials travel to it, then one sum: a
  gather-then-add, not a reduce-scatter). Edges from ``constant`` and ``input`` ops
  (`OpDef.everywhere`: buffers every process holds, the batch its loader reads where it is needed) make
  nothing;
- backward mirrors forward: each consumer part sends the gradient of its intersection back to the
  producer part (across devices, again one exchange per edge); where consumer parts read overlapping
  regions (a split along a dim the input does not have, or halos), the gradients a producer part
  receives overlap and a reduce task adds them. A gradient edge exists when the consumer gets a gradient
  and the producer needs one (it or an ancestor has parameters; the tensor is floating point);
- per bucket and device group: one all-reduce of the parameter gradients whose part regions are
  replicated over exactly that group (`simulator.comm`: one ring task). Buckets are fixed ranges of the
  backward parameter order, `bucket_cap_bytes` of full-size parameters each (DDP's 25 MB), so that a
  change to one op touches only its own bucket's all-reduces;
- per part holding parameters: an optimizer update task after its backward task and its all-reduces.

Memory per device (an upper bound: no liveness analysis): parameters, their gradients and
`optimizer_copies` optimizer copies of every parameter region a part holds, plus the outputs of its
parts, the inputs it receives and the batch regions it reads (activations saved for backward).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping

import numpy as np

from simulator.comm import Comm, ms_to_ns
from simulator.costmodel import CostModel
from soap.config import ParallelConfig, parts
from soap.graph import DTYPE_BYTES, OperatorGraph
from soap.opdef import region_numel
from soap.registry import op_def
from soap.topology import DeviceTopology

# task categories
FWD, BWD, XFER, REDUCE, SYNC, UPDATE = range(6)
CATEGORY_NAMES = ("forward", "backward", "transfer", "reduce", "allreduce", "update")
# what a category counts as on the critical path
COMPUTE_CATS = frozenset({FWD, BWD, REDUCE, UPDATE})
COMM_CATS = frozenset({XFER})
SYNC_CATS = frozenset({SYNC})

# sub-slots of a key position: transfers into an op, then its reduce tasks, then its compute, then the
# all-reduces of the bucket that ends there
SUB_XFER, SUB_REDUCE, SUB_COMPUTE, SUB_SYNC = 0, 1, 2, 3
_FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})
DEFAULT_BUCKET_CAP_BYTES = 25 * 2**20


class Edge:
    """One use of a producer's output by a consumer's input slot."""

    __slots__ = ("id", "src", "out", "dst", "slot", "use", "grad", "elem")

    def __init__(self, id: int, src: int, out: int, dst: int, slot: int, use: int, grad: bool, elem: int):
        self.id, self.src, self.out, self.dst, self.slot, self.use = id, src, out, dst, slot, use
        self.grad, self.elem = grad, elem


class GraphFacts:
    """What the task graph needs to know about an `OperatorGraph`, computed once.

    `needs_bwd[i]`: a gradient reaches op i (it has parameters or a differentiable ancestor, and feeds
    the loss, i.e. it is a sink or a consumer needs its gradient). Buckets: ops with parameters and a
    backward, in backward order, `bucket_cap_bytes` of full-size parameters per bucket.
    """

    def __init__(self, graph: OperatorGraph, *, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES):
        if bucket_cap_bytes <= 0:
            raise ValueError(f"bucket_cap_bytes must be positive, got {bucket_cap_bytes}")
        self.graph = graph
        self.ops = graph.ops
        n = self.num_ops = len(graph.ops)
        self.index = {op.name: i for i, op in enumerate(graph.ops)}
        # sources (the batch, buffers): on every device for free, no tasks
        self.everywhere = [op_def(op.kind).everywhere for op in graph.ops]
        requires = [False] * n
        for i, op in enumerate(graph.ops):
            if self.everywhere[i]:
                continue
            requires[i] = bool(op.params) or any(
                requires[self.index[r.op]] and graph.tensor(r).dtype in _FLOAT_DTYPES for r in op.inputs)
        self.requires_grad = requires
        # per op, which inputs carry a gradient (the part's backward computes it): the cost database keys
        # on it, as `runtime.plan.needs_grad` decides it for the executor
        self.grad_inputs = [tuple(requires[self.index[r.op]] and graph.tensor(r).dtype in _FLOAT_DTYPES
                                  for r in op.inputs) for op in graph.ops]
        self.edges: list[Edge] = []
        self.in_edges: list[list[int]] = [[] for _ in range(n)]
        self.out_edges: list[list[int]] = [[] for _ in range(n)]
        needs = [False] * n
        uses = {op.name: graph.consumers(op.name) for op in graph.ops}
        for i in range(n - 1, -1, -1):
            op = graph.ops[i]
            if not requires[i]:
                continue
            cons = uses[op.name]
            needs[i] = not cons or any(needs[self.index[c]] and graph.ops[i].outputs[o].dtype in _FLOAT_DTYPES
                                       for c, _, o in cons)
        self.needs_bwd = needs
        for k, op in enumerate(graph.ops):
            for slot, ref in enumerate(op.inputs):
                j = self.index[ref.op]
                if self.everywhere[j]:
                    continue  # buffers exist on every device: no transfer, no dependency
                use = uses[ref.op].index((op.name, slot, ref.index))
                tensor = graph.ops[j].outputs[ref.index]
                grad = needs[k] and requires[j] and tensor.dtype in _FLOAT_DTYPES
                e = Edge(len(self.edges), j, ref.index, k, slot, use, grad, DTYPE_BYTES[tensor.dtype])
                self.edges.append(e)
                self.in_edges[k].append(e.id)
                self.out_edges[j].append(e.id)
        # static buckets in backward order
        self.bucket = [-1] * n
        self.bucket_cap_bytes = bucket_cap_bytes
        first_op: list[int] = []  # per bucket, the lowest op position in it (its backward ends last)
        filled = 0
        for i in range(n - 1, -1, -1):
            op = graph.ops[i]
            if not (needs[i] and op.params):
                continue
            b = filled // bucket_cap_bytes
            while len(first_op) <= b:
                first_op.append(i)
            first_op[b] = i
            self.bucket[i] = b
            filled += op.param_bytes
        self.bucket_first_op = first_op


class KeySpace:
    """Static task keys: unique integers, increasing along every data dependency, equal for the same task
    in every strategy that has it, so ready-time ties break the same way in full and delta simulation.

    A key packs (position, sub, e, a, b): position i is op i's forward, 2N-1-i its backward, 2N+i its
    update; sub orders exchanges < reduces < compute < all-reduces at a position; e is the input slot
    (forward), the consumer use (backward) or a hash of the device group (all-reduce); a and b are part
    indices (0 for an exchange, the group's first and last device for an all-reduce).
    """

    __slots__ = ("num_ops", "radix", "bits")

    def __init__(self, num_ops: int, num_devices: int):
        self.num_ops = num_ops
        self.radix = max(2, num_devices)
        top = (3 * num_ops + 1) * 8 * 65536 * self.radix * self.radix
        self.bits = top.bit_length()

    def make(self, pos: int, sub: int, e: int, a: int, b: int) -> int:
        r = self.radix
        return (((pos * 8 + sub) * 65536 + e) * r + a) * r + b

    def split(self, key: int) -> tuple[int, int, int, int, int]:
        r = self.radix
        key, b = divmod(key, r)
        key, a = divmod(key, r)
        key, e = divmod(key, 65536)
        pos, sub = divmod(key, 8)
        return pos, sub, e, a, b

    def fwd_pos(self, i: int) -> int:
        return i

    def bwd_pos(self, i: int) -> int:
        return 2 * self.num_ops - 1 - i

    def update_pos(self, i: int) -> int:
        return 2 * self.num_ops + i


def group_hash(group: tuple[int, ...]) -> int:
    """A 16-bit tag of a device group (the key field of its all-reduces); deterministic across runs."""
    return zlib.crc32(np.asarray(group, dtype=np.int64).tobytes()) & 0xFFFF


class OpPlan:
    """The tasks of one op under one config, before they get task ids.

    Per part c: `fwd_ns[c]`, `bwd_ns[c]` (empty lists when the op has no such tasks), keys, the regions of
    every output and input as arrays (parts, axes, 2), and `update` entries (part, ns, key). `sync` maps a
    device group to (parts whose gradients it all-reduces, bytes). `mem` maps device -> bytes.
    """

    __slots__ = ("devices", "num_parts", "fwd_ns", "bwd_ns", "fwd_keys", "bwd_keys", "out_regions",
                 "in_regions", "reduced", "sync", "update", "mem", "in_overlap")

    def __init__(self) -> None:
        self.devices: tuple[int, ...] = ()
        self.num_parts = 0
        self.fwd_ns: list[int] = []
        self.bwd_ns: list[int] = []
        self.fwd_keys: list[int] = []
        self.bwd_keys: list[int] = []
        self.out_regions: list[np.ndarray] = []
        self.in_regions: list[np.ndarray] = []
        self.reduced = False
        self.sync: dict[tuple[int, ...], tuple[tuple[int, ...], int]] = {}
        self.update: list[tuple[int, int, int]] = []
        self.mem: dict[int, int] = {}
        self.in_overlap: list[np.ndarray | None] = []  # per slot, lazily: do parts' input regions overlap


class EdgePlan:
    """The dependencies, transfers and reduce tasks of one edge under (producer config, consumer config).

    Forward entries: `fwd_dep` (p, c) on one device; `fwd_xfer` at most one exchange (sending parts p,
    receiving parts c, bytes, resources, ns, key); `fwd_reduce` (c, ns, key, device). Backward: `bwd_dep`
    (c, p); `bwd_xfer` at most one exchange (sending parts c, receiving parts p, bytes, resources, ns,
    key); `bwd_reduce` (p, ns, key, device). A reduce entry sits between the part's incoming data and
    the consuming compute task. `recv` maps device -> bytes received (memory); `moved` is bytes sent.
    """

    __slots__ = ("fwd_dep", "fwd_xfer", "fwd_reduce", "bwd_dep", "bwd_xfer", "bwd_reduce", "recv", "moved")

    def __init__(self) -> None:
        self.fwd_dep: list[tuple[int, int]] = []
        self.fwd_xfer: list[tuple[tuple[int, ...], tuple[int, ...], int, tuple[int, ...], int, int]] = []
        self.fwd_reduce: list[tuple[int, int, int, int]] = []
        self.bwd_dep: list[tuple[int, int]] = []
        self.bwd_xfer: list[tuple[tuple[int, ...], tuple[int, ...], int, tuple[int, ...], int, int]] = []
        self.bwd_reduce: list[tuple[int, int, int, int]] = []
        self.recv: dict[int, int] = {}
        self.moved = 0


def _regions(rows: list, num_parts: int, ndim: int) -> np.ndarray:
    return np.asarray(rows, dtype=np.int64).reshape(num_parts, ndim, 2)


def _overlap_matrix(regions: np.ndarray) -> np.ndarray:
    """(C, C) bool: do the regions of parts c1 != c2 overlap (diagonal False)."""
    lo = np.maximum(regions[:, None, :, 0], regions[None, :, :, 0])
    hi = np.minimum(regions[:, None, :, 1], regions[None, :, :, 1])
    nonempty = (regions[:, :, 1] > regions[:, :, 0]).all(axis=1)
    out = (hi > lo).all(axis=2) & nonempty[:, None] & nonempty[None, :]
    np.fill_diagonal(out, False)
    return out


class Planner:
    """Builds `OpPlan`s and `EdgePlan`s for one (graph, topology, cost model), caching both.

    The caches are keyed by (op, config) and (edge, producer config, consumer config) and hold pure
    functions of those, so they never change a result; they are cleared when they pass `cache_limit`
    entries to bound memory over long searches.
    """

    def __init__(self, facts: GraphFacts, topology: DeviceTopology, cost_model: CostModel, keys: KeySpace,
                 comm: Comm, *, optimizer_copies: int = 1, cache_limit: int = 200_000):
        if optimizer_copies < 0:
            raise ValueError(f"optimizer_copies must be >= 0, got {optimizer_copies}")
        self.facts = facts
        self.topology = topology
        self.cost_model = cost_model
        self.keys = keys
        self.comm = comm
        self.optimizer_copies = optimizer_copies
        self.cache_limit = cache_limit
        self._ops: dict[tuple[int, ParallelConfig], OpPlan] = {}
        self._edges: dict[tuple[int, ParallelConfig, ParallelConfig], EdgePlan] = {}

    # -- ops -------------------------------------------------------------------------------------------

    def op_plan(self, i: int, cfg: ParallelConfig) -> OpPlan:
        hit = self._ops.get((i, cfg))
        if hit is None:
            if len(self._ops) >= self.cache_limit:
                self._ops.clear()
            hit = self._ops[(i, cfg)] = self._make_op_plan(i, cfg)
        return hit

    def _make_op_plan(self, i: int, cfg: ParallelConfig) -> OpPlan:
        facts, keys = self.facts, self.keys
        op = facts.ops[i]
        entry = op_def(op.kind)
        plan = OpPlan()
        boxes_devices = parts(op, cfg)
        boxes = [b for b, _ in boxes_devices]
        plan.devices = cfg.devices
        n = plan.num_parts = len(boxes)
        plan.out_regions = [_regions([entry.output_region(op, b, o) for b in boxes], n, spec.ndim)
                            for o, spec in enumerate(op.outputs)]
        slots = len(op.inputs)
        rows: list[list] = [[] for _ in range(slots)]
        for b in boxes:
            regions = entry.input_regions(op, b)
            for s in range(slots):
                r = regions[s] if s < len(regions) else None
                ndim = len(op.attrs["input_shapes"][s]) if "input_shapes" in op.attrs else len(r or ())
                rows[s].append(r if r is not None else ((0, 0),) * ndim)
        plan.in_regions = [_regions(rows[s], n, len(rows[s][0]) if rows[s] else 0) for s in range(slots)]
        plan.in_overlap = [None] * slots
        plan.reduced = any(entry.reduced(op, b) for b in boxes)
        devices = [self.topology.devices[d] for d in cfg.devices]
        mem: dict[int, int] = {}
        if facts.everywhere[i]:
            plan.mem = mem
            return plan
        for b, dev in zip(boxes, devices, strict=True):
            out_bytes = sum(region_numel(entry.output_region(op, b, o)) * DTYPE_BYTES[spec.dtype]
                            for o, spec in enumerate(op.outputs))
            mem[dev.id] = mem.get(dev.id, 0) + out_bytes
        for s, ref in enumerate(op.inputs):
            # The batch moves nothing (`OpDef.everywhere`), but each device's loader holds what it reads.
            src = facts.ops[facts.index[ref.op]]
            if src.kind == "input":
                itemsize = DTYPE_BYTES[src.outputs[ref.index].dtype]
                for r, dev in zip(rows[s], devices, strict=True):
                    mem[dev.id] += region_numel(r) * itemsize
        fpos, bpos = keys.fwd_pos(i), keys.bwd_pos(i)
        needs_bwd = facts.needs_bwd[i]
        for c, (b, dev) in enumerate(zip(boxes, devices, strict=True)):
            fwd_ms, bwd_ms = self.cost_model.compute_ms(op, b, dev, facts.grad_inputs[i])
            plan.fwd_ns.append(ms_to_ns(fwd_ms))
            plan.fwd_keys.append(keys.make(fpos, SUB_COMPUTE, 0, c, 0))
            if needs_bwd:
                plan.bwd_ns.append(ms_to_ns(bwd_ms))
                plan.bwd_keys.append(keys.make(bpos, SUB_COMPUTE, 0, c, 0))
        if op.params:
            # parameter regions: memory, all-reduce groups (a region held by several parts), updates
            holders: dict[tuple[str, tuple], list[int]] = {}
            region_bytes: dict[tuple[str, tuple], int] = {}
            per_part = [0] * n
            for c, b in enumerate(boxes):
                for name, region in entry.param_regions(op, b).items():
                    nbytes = region_numel(region) * DTYPE_BYTES[op.params[name].dtype]
                    holders.setdefault((name, tuple(region)), []).append(c)
                    region_bytes[(name, tuple(region))] = nbytes
                    per_part[c] += nbytes
            copies = 1 + (1 + self.optimizer_copies if needs_bwd else 0)
            for c, dev in enumerate(devices):
                mem[dev.id] = mem.get(dev.id, 0) + copies * per_part[c]
            if needs_bwd:
                sync: dict[tuple[int, ...], tuple[set[int], int]] = {}
                for region_key, owners in holders.items():
                    if len(owners) < 2:
                        continue
                    group = tuple(sorted(cfg.devices[c] for c in owners))
                    members, nbytes = sync.get(group, (set(), 0))
                    sync[group] = (members | set(owners), nbytes + region_bytes[region_key])
                plan.sync = {g: (tuple(sorted(m)), nb) for g, (m, nb) in sorted(sync.items())}
                upos = keys.update_pos(i)
                for c, dev in enumerate(devices):
                    if per_part[c] > 0:
                        ns = ms_to_ns(self.cost_model.update_ms(op, per_part[c], dev))
                        plan.update.append((c, ns, keys.make(upos, SUB_COMPUTE, 0, c, 0)))
        plan.mem = mem
        return plan

    def _input_overlap(self, plan: OpPlan, slot: int) -> np.ndarray:
        found = plan.in_overlap[slot]
        if found is None:
            found = plan.in_overlap[slot] = _overlap_matrix(plan.in_regions[slot])
        return found

    # -- edges -----------------------------------------------------------------------------------------

    def edge_plan(self, eid: int, pcfg: ParallelConfig, ccfg: ParallelConfig) -> EdgePlan:
        hit = self._edges.get((eid, pcfg, ccfg))
        if hit is None:
            if len(self._edges) >= self.cache_limit:
                self._edges.clear()
            hit = self._edges[(eid, pcfg, ccfg)] = self._make_edge_plan(eid, pcfg, ccfg)
        return hit

    def _make_edge_plan(self, eid: int, pcfg: ParallelConfig, ccfg: ParallelConfig) -> EdgePlan:
        facts, keys = self.facts, self.keys
        edge = facts.edges[eid]
        prod = self.op_plan(edge.src, pcfg)
        cons = self.op_plan(edge.dst, ccfg)
        out = prod.out_regions[edge.out]
        inp = cons.in_regions[edge.slot]
        plan = EdgePlan()
        pdev, cdev = pcfg.devices, ccfg.devices
        if pdev == cdev and out.shape == inp.shape and np.array_equal(out, inp):
            # fast path: partitions line up part for part on the same devices
            pairs = [(c, c, 0) for c in range(cons.num_parts)]
        else:
            lo = np.maximum(out[:, None, :, 0], inp[None, :, :, 0])
            hi = np.minimum(out[:, None, :, 1], inp[None, :, :, 1])
            numel = np.clip(hi - lo, 0, None).prod(axis=2)
            if inp.shape[1]:
                numel = numel * (inp[None, :, :, 1] > inp[None, :, :, 0]).all(axis=2)
            ps, cs = np.nonzero(numel)
            pairs = list(zip(ps.tolist(), cs.tolist(), (numel[ps, cs] * edge.elem).tolist(), strict=True))
        fpos = keys.fwd_pos(edge.dst)
        contributions: dict[int, int] = {}
        moving: list[tuple[int, int, int]] = []
        for p, c, nbytes in pairs:
            contributions[c] = contributions.get(c, 0) + 1
            if pdev[p] == cdev[c]:
                plan.fwd_dep.append((p, c))
            else:
                moving.append((p, c, nbytes))
                plan.recv[cdev[c]] = plan.recv.get(cdev[c], 0) + nbytes
        if moving:
            plan.moved += sum(nbytes for _, _, nbytes in moving)
            plan.fwd_xfer.append(self._exchange(moving, pdev, cdev, keys.make(fpos, SUB_XFER, edge.slot, 0, 0)))
        if prod.reduced:
            inp_bytes = (np.clip(inp[:, :, 1] - inp[:, :, 0], 0, None).prod(axis=1) * edge.elem).tolist()
            for c in sorted(contributions):
                k = contributions[c]
                if k >= 2:
                    dev = self.topology.devices[cdev[c]]
                    ns = ms_to_ns(self.cost_model.reduce_ms(inp_bytes[c], k, dev))
                    plan.fwd_reduce.append((c, ns, keys.make(fpos, SUB_REDUCE, edge.slot, c, 0), cdev[c]))
                    plan.recv[cdev[c]] = plan.recv.get(cdev[c], 0) + inp_bytes[c]
        if edge.grad:
            bpos = keys.bwd_pos(edge.src)
            senders: dict[int, list[int]] = {}
            back: list[tuple[int, int, int]] = []
            for p, c, nbytes in pairs:
                senders.setdefault(p, []).append(c)
                if pdev[p] == cdev[c]:
                    plan.bwd_dep.append((c, p))
                else:
                    back.append((c, p, nbytes))
            if back:
                plan.moved += sum(nbytes for _, _, nbytes in back)
                plan.bwd_xfer.append(self._exchange(back, cdev, pdev, keys.make(bpos, SUB_XFER, edge.use, 0, 0)))
            multi = [p for p in sorted(senders) if len(senders[p]) >= 2]
            if multi:
                overlap = self._input_overlap(cons, edge.slot)
                out_bytes = (np.clip(out[:, :, 1] - out[:, :, 0], 0, None).prod(axis=1) * edge.elem).tolist()
                for p in multi:
                    cs = senders[p]
                    if overlap[np.ix_(cs, cs)].any():
                        dev = self.topology.devices[pdev[p]]
                        ns = ms_to_ns(self.cost_model.reduce_ms(out_bytes[p], len(cs), dev))
                        plan.bwd_reduce.append((p, ns, keys.make(bpos, SUB_REDUCE, edge.use, p, 0), pdev[p]))
        return plan

    def _exchange(self, pieces: list[tuple[int, int, int]], src_dev: tuple[int, ...], dst_dev: tuple[int, ...],
                  key: int) -> tuple[tuple[int, ...], tuple[int, ...], int, tuple[int, ...], int, int]:
        """The exchange entry of `pieces` (sending part, receiving part, bytes) of one edge and pass."""
        res, ns = self.comm.exchange([(src_dev[a], dst_dev[b], nbytes) for a, b, nbytes in pieces])
        return (tuple(sorted({a for a, _, _ in pieces})), tuple(sorted({b for _, b, _ in pieces})),
                sum(nbytes for _, _, nbytes in pieces), res, ns, key)

    # -- all-reduces -----------------------------------------------------------------------------------

    def sync_task(self, group: tuple[int, ...], bucket: int, nbytes: int) -> tuple[tuple[int, ...], int, int]:
        """(resources, ns, key) of the all-reduce of `nbytes` over `group` for `bucket`."""
        res, ns = self.comm.collective(group, nbytes)
        pos = self.keys.bwd_pos(self.facts.bucket_first_op[bucket])
        return res, ns, self.keys.make(pos, SUB_SYNC, group_hash(group), group[0], group[-1])


def total_mem(plans: Mapping[int, int], num_devices: int) -> list[int]:
    out = [0] * num_devices
    for d, b in plans.items():
        out[d] += b
    return out


__all__ = ["BWD", "CATEGORY_NAMES", "COMM_CATS", "COMPUTE_CATS", "Edge", "EdgePlan", "FWD", "GraphFacts",
           "KeySpace", "OpPlan", "Planner", "REDUCE", "SYNC", "SYNC_CATS", "UPDATE", "XFER", "group_hash",
           "math"]
