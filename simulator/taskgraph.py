"""Task graph planning (FlexFlow section 5): the timed tasks of a step plan's pieces.

Owns `KeySpace` (the static task keys that order ties), the timed plan entries (`OpPlan`, `EdgePlan`,
`ParamPlan` and their `Exchange`, `Reduce`, `Update` and `SyncShare` entries) and `Planner`, which lowers
one op's config, one edge's (producer config, consumer config) or one parameter unit's configs with
`soap.lowering` and prices the result with the cost model and `simulator.comm`, caching each. What a
step does comes from the lowering alone (`soap.lowering`'s docstring states its rules); this module only
adds durations, resources and keys. The simulator (`simulator.engine`) instantiates plans as tasks. Must
import only `soap`, numpy and the stdlib.

Tasks of a step plan:

- per part of an op: a forward task and (when the op runs backward) a backward task on its device; ops
  of kind ``input`` and ``constant`` have none (zero compute: the batch is loaded where its parts are,
  buffers are everywhere). Parts of one op on one device (its rounds, `OpStep.rounds`: micro-batches)
  are separate tasks that queue on the device like any others. A chunk along a carried dim
  (`OpStep.carry_from`: an LSTM split in time) waits for the forward of the chunk it starts from, whose
  backward waits for its own (`OpPlan.carries`). When the two run on different devices
  (`OpStep.carry_moves`) a transfer task stands between them in each pass (`OpPlan.carry_xfers`: one
  exchange of the state's bytes, `Comm.exchange`, from the source chunk's device to the chunk's in
  forward, back in backward), part of the op's own tasks. A recomputing part's
  backward task includes its forward again. A sharded part's forward task includes the all-gather of its parameters
  and its backward task the second all-gather and the reduce-scatter of their gradient, collectives over
  its shard group (`simulator.comm`), since the runtime issues them synchronously around the part's
  compute (no prefetch); they do not occupy the links as separate tasks, so their contention with
  concurrent exchanges is not modeled, but their time counts as communication in the critical path's
  split (`OpPlan.shard_ns`) and their ring traffic in the bytes moved;
- per edge, pass and consumer round: pieces between parts on one device are dependencies; the pieces of
  one exchange (`EdgeStep.exchanges`: those that cross devices into the consumer parts of one round)
  make ONE exchange task (`Comm.exchange`: the union of their routes, the largest latency plus the
  busiest link's bytes), after the parts that send its pieces and before the parts that receive them, as
  the runtime's one all-to-all per exchange and pass: in forward from producer parts to the consumer
  parts of round r, in backward from the consumer parts of round r back to the producer parts, so a
  micro-batch waits only for what it reads. Without repeated devices that is one exchange per edge and
  pass. A consumer part that adds two or more partial sums gets a *reduce* task on its device before its
  compute (`EdgeStep.sums`), and so does a producer part that adds overlapping gradients
  (`EdgeStep.grad_sums`);
- per bucket and device group: one all-reduce (`simulator.comm`: one task, ring or tree) of the gradients
  of its entries, after the backward of every part holding them (every round of a device's parts);
- per device, a *step end* task (no duration, no resource) after everything the device's rank does
  before its optimizer step, as the runtime steps once its walk of the step's order is over, its sends
  have left and every all-reduce it takes part in has finished: every backward task on the device (and
  forward task of an op that runs no backward), every exchange it sends in and every all-reduce over it;
  under loss scaling (`TrainSetup.loss_scaling`) one *overflow check* after every device's step end: the
  runtime's all-reduce of the overflow flag over every rank (a latency, on no resource);
- per parameter unit and device: an optimizer update task after the device's step end (under loss
  scaling, after the overflow check), so the updates never overlap the backward or the all-reduces;
- the round order (edges built by `simulator.engine`, since they depend on every op's config): on each
  device, the tasks of an op's rounds but the first it runs in each pass (its parts, and the exchanges
  of its input edges for those rounds) wait for the task before them in the device's share of the
  step's order (`soap.lowering.step_order`, forward and backward items interleaved under 1F1B), as the
  runtime walks that
  order with blocking all-to-alls (an exchange is in the share of every device that sends or receives
  in it). Without them a device would run every round of a stage's first op (all ready at once) before
  the first round of the next, and a pipeline would never overlap its stages. The first round of each
  pass, and ops without repeated devices, keep the plain ready order.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from simulator.comm import ALLGATHER, REDUCE_SCATTER, Comm, ms_to_ns
from simulator.costmodel import CostModel
from soap.config import ParallelConfig
from soap.lowering import EdgeStep, GradFlow, OpStep, ParamStep, Replicas, lower_edge, lower_op, lower_params
from soap.strategy import StrategyError
from soap.topology import DeviceTopology

# task categories
FWD, BWD, XFER, REDUCE, SYNC, UPDATE, STEP_END = range(7)
CATEGORY_NAMES = ("forward", "backward", "transfer", "reduce", "allreduce", "update", "step end")
# what a category counts as on the critical path
COMPUTE_CATS = frozenset({FWD, BWD, REDUCE, UPDATE})
COMM_CATS = frozenset({XFER})
SYNC_CATS = frozenset({SYNC, STEP_END})

# sub-slots of a key position: transfers into an op, then its reduce tasks, then its compute, then the
# all-reduces of the bucket that ends there
SUB_XFER, SUB_REDUCE, SUB_COMPUTE, SUB_SYNC = 0, 1, 2, 3
# the most rounds of one op (so parts on one device: micro-batches, chunks) the task keys have room for
MAX_ROUNDS = 1 << 16


class KeySpace:
    """Static task keys: unique integers, increasing along every data dependency, equal for the same task
    in every strategy that has it, so ready-time ties break the same way in full and delta simulation.

    A key packs (position, sub, e, a, b): position i is op i's forward, 2N-1-i its backward, 2N+i the
    update of the parameter unit whose first op is i, and position 2N also holds the step ends (sub 0)
    and the overflow check (sub 1), before every update (sub 2); sub orders exchanges < reduces <
    compute < all-reduces at a position; e is the input slot (forward), the consumer use (backward) or a hash of the
    device group (all-reduce); a is a part index (compute, reduce), the consumer round (an exchange), the
    device (an update) or the group's first device (an all-reduce); b is the group's last device for an
    all-reduce, 1 for the transfer of a carry between chunks on two devices (a compute key right after
    that of the part it leaves: forward (i, compute, 0, source part, 1), backward (2N-1-i, compute,
    n-1-c, c, 1) for chunk c of n parts, between the keys of the chunk's and its source's backward), else
    0. A part index runs below num_devices x `MAX_ROUNDS` (an op runs at most `MAX_ROUNDS` rounds, so
    parts on one device), so that is the radix of a; without repeated devices every a is
    below num_devices and keys order as (position, sub, e, a, b) whatever the radices.
    """

    __slots__ = ("num_ops", "radix", "part_radix", "bits")

    def __init__(self, num_ops: int, num_devices: int):
        self.num_ops = num_ops
        self.radix = max(2, num_devices)
        self.part_radix = self.radix * MAX_ROUNDS
        top = (3 * num_ops + 1) * 8 * 65536 * self.part_radix * self.radix
        self.bits = top.bit_length()

    def make(self, pos: int, sub: int, e: int, a: int, b: int) -> int:
        return (((pos * 8 + sub) * 65536 + e) * self.part_radix + a) * self.radix + b

    def split(self, key: int) -> tuple[int, int, int, int, int]:
        key, b = divmod(key, self.radix)
        key, a = divmod(key, self.part_radix)
        key, e = divmod(key, 65536)
        pos, sub = divmod(key, 8)
        return pos, sub, e, a, b

    def fwd_pos(self, i: int) -> int:
        return i

    def bwd_pos(self, i: int) -> int:
        return 2 * self.num_ops - 1 - i

    def update_pos(self, i: int) -> int:
        return 2 * self.num_ops + i

    def step_end(self, device: int) -> int:
        """The key of `device`'s step end: after every forward, backward, exchange and all-reduce key."""
        return self.make(2 * self.num_ops, SUB_XFER, 0, device, 0)

    def overflow_check(self) -> int:
        """The key of the overflow check: after every step end, before every update."""
        return self.make(2 * self.num_ops, SUB_REDUCE, 0, 0, 0)


def group_hash(group: tuple[int, ...]) -> int:
    """A 16-bit tag of a device group (the key field of its all-reduces); deterministic across runs."""
    return zlib.crc32(np.asarray(group, dtype=np.int64).tobytes()) & 0xFFFF


class Exchange(NamedTuple):
    """The exchange task of one edge, pass and consumer round: the sending and receiving parts, bytes on
    the wire, the links it occupies, its duration and key."""

    senders: tuple[int, ...]
    receivers: tuple[int, ...]
    nbytes: int
    resources: tuple[int, ...]
    ns: int
    key: int


class Reduce(NamedTuple):
    """A reduce task: part `part` on `device` adds up its contributions before its compute."""

    part: int
    ns: int
    key: int
    device: int


class Update(NamedTuple):
    """An optimizer update task of a parameter unit on `device`."""

    device: int
    ns: int
    key: int


class SyncShare(NamedTuple):
    """What one parameter unit puts into one all-reduce: the (op position, part) pairs whose backward it
    waits for and its bytes."""

    holders: tuple[tuple[int, int], ...]
    nbytes: int


class OpPlan:
    """The timed tasks of one op under one config: `step` (the lowering), per part the forward and
    backward durations and keys (empty lists when the op has no such tasks), `mem` (device -> bytes
    kept for backward), `transient` (device -> the largest bytes a part holds only while it runs),
    `carries` ((part, part that starts from its state) per chunk after the first along a carried dim on
    the same device: dependencies, forward from the first to the second, backward back), `carry_xfers`
    ((part, chunk that starts from its state, forward transfer, backward transfer or None) per chunk
    whose source is on another device) and `moved` (bytes those transfers and the parts' shard
    collectives move, both passes); `shard_ns` (per part, the ns of its forward and of its backward that
    are the all-gathers and reduce-scatter of sharded parameters, run inside the part's task; empty
    when unsharded)."""

    __slots__ = ("step", "devices", "fwd_ns", "bwd_ns", "fwd_keys", "bwd_keys", "mem", "transient", "carries",
                 "carry_xfers", "moved", "shard_ns")

    def __init__(self, step: OpStep):
        self.step = step
        self.devices = step.devices
        self.fwd_ns: list[int] = []
        self.bwd_ns: list[int] = []
        self.fwd_keys: list[int] = []
        self.bwd_keys: list[int] = []
        self.mem: dict[int, int] = {}
        self.transient: dict[int, int] = {}
        self.carries: list[tuple[int, int]] = []
        self.carry_xfers: list[tuple[int, int, Exchange, Exchange | None]] = []
        self.moved = 0
        self.shard_ns: list[tuple[int, int]] = []


class EdgePlan:
    """The timed tasks of one edge: dependencies (producer part, consumer part) on one device, the exchange
    tasks of each pass (one per consumer round that receives pieces, in round order; backward: sending
    consumer parts, receiving producer parts) and its reduce tasks, `recv` (device -> bytes it receives
    and adds up or keeps, `EdgeStep.mem_bytes`) and `moved` (bytes crossing devices, both passes)."""

    __slots__ = ("step", "fwd_dep", "fwd_xfer", "fwd_reduce", "bwd_dep", "bwd_xfer", "bwd_reduce", "recv",
                 "moved")

    def __init__(self, step: EdgeStep):
        self.step = step
        self.fwd_dep: list[tuple[int, int]] = []
        self.fwd_xfer: list[Exchange] = []
        self.fwd_reduce: list[Reduce] = []
        self.bwd_dep: list[tuple[int, int]] = []
        self.bwd_xfer: list[Exchange] = []
        self.bwd_reduce: list[Reduce] = []
        self.recv: Mapping[int, int] = step.mem_bytes
        self.moved = step.moved_bytes


class ParamPlan:
    """The timed tasks of one parameter unit: `updates`, `sync` ((group, bucket) -> `SyncShare`: all-
    reduces over two or more devices) and `mem` (device -> parameter, gradient and optimizer-state bytes)."""

    __slots__ = ("step", "updates", "sync", "mem")

    def __init__(self, step: ParamStep):
        self.step = step
        self.updates: list[Update] = []
        self.sync: dict[tuple[tuple[int, ...], int], SyncShare] = {}
        self.mem: Mapping[int, int] = step.memory_bytes


class Planner:
    """Lowers and prices the pieces of step plans for one (graph, setup, topology, cost model), caching
    them.

    The caches are keyed by (op, config), (edge, producer config, consumer config) and (unit, configs of
    its ops) and hold pure functions of those, so they never change a result; they are cleared when they
    pass `cache_limit` entries to bound memory over long searches. Copies of an op (`GradFlow.op_class`:
    the same computation, as in every layer of a transformer) share their lowering, and, under a cost
    model that prices by computation (its `by_computation` attribute true), their priced plan: the copy's
    plan is the first one's with its own task keys. So are copies of an edge (`GradFlow.edge_class`).
    A search's tied move over every layer then lowers and prices each new config once.
    """

    def __init__(self, flow: GradFlow, topology: DeviceTopology, cost_model: CostModel, keys: KeySpace,
                 comm: Comm, *, cache_limit: int = 200_000, replicas: Replicas | None = None):
        self.flow = flow
        self.replicas = replicas
        self.topology = topology
        self.cost_model = cost_model
        self.keys = keys
        self.comm = comm
        self.cache_limit = cache_limit
        self._ops: dict[tuple[int, ParallelConfig], OpPlan] = {}
        self._edges: dict[tuple[int, ParallelConfig, ParallelConfig], EdgePlan] = {}
        self._params: dict[tuple[int, tuple[ParallelConfig, ...]], ParamPlan] = {}
        # per (class, config(s)): the first plan made (priced by computation) or lowering (otherwise)
        self._share = bool(getattr(cost_model, "by_computation", False))
        self._op_firsts: dict[tuple[int, ParallelConfig], OpPlan | OpStep] = {}
        self._edge_firsts: dict[tuple[int, ParallelConfig, ParallelConfig], EdgePlan | EdgeStep] = {}

    def _cached(self, cache: dict, key, make):
        hit = cache.get(key)
        if hit is None:
            if len(cache) >= self.cache_limit:
                cache.clear()
            hit = cache[key] = make()
        return hit

    # -- ops -------------------------------------------------------------------------------------------

    def op_plan(self, i: int, cfg: ParallelConfig) -> OpPlan:
        return self._cached(self._ops, (i, cfg), lambda: self._make_op_plan(i, cfg))

    def _make_op_plan(self, i: int, cfg: ParallelConfig) -> OpPlan:
        flow = self.flow
        first_key = (flow.op_class[i], cfg)
        first = self._op_firsts.get(first_key)
        if isinstance(first, OpPlan):  # a copy's plan, priced by computation: only the keys differ
            plan = OpPlan(first.step.for_op(i))
            for name in ("fwd_ns", "bwd_ns", "mem", "transient", "carries", "carry_xfers", "moved", "shard_ns"):
                setattr(plan, name, getattr(first, name))
            return self._key_op(plan, i)
        step = first.for_op(i) if first is not None else lower_op(flow, i, cfg, self.replicas)
        plan = OpPlan(step)
        if not flow.everywhere[i]:
            self._price_op(plan, i)
        self._keep(self._op_firsts, first_key, plan if self._share else step)
        return self._key_op(plan, i)

    def _price_op(self, plan: OpPlan, i: int) -> None:
        """Fill in `plan`'s durations, memory and carries (task keys: `_key_op`)."""
        step = plan.step
        op = self.flow.ops[i]
        if step.num_rounds > MAX_ROUNDS:
            raise StrategyError(f"op {op.name!r} runs in {step.num_rounds} rounds; the simulator "
                                f"times at most {MAX_ROUNDS}")
        for d, nbytes, extra in zip(step.devices, step.activation_bytes, step.transient_bytes, strict=True):
            plan.mem[d] = plan.mem.get(d, 0) + nbytes
            if extra:
                plan.transient[d] = max(plan.transient.get(d, 0), extra)
        grads = self.flow.grad_inputs[i]
        for c, (b, d) in enumerate(zip(step.boxes, step.devices, strict=True)):
            fwd_ms, bwd_ms = self.cost_model.compute_ms(op, b, self.topology.devices[d], grads)
            fwd_ns, bwd_ns = ms_to_ns(fwd_ms), ms_to_ns(bwd_ms)
            if step.recompute:
                bwd_ns += fwd_ns  # the forward again, right before the backward
            group = step.shard_groups[c] if step.shard_groups else ()
            if len(group) > 1:
                # the runtime gathers synchronously before each pass and reduce-scatters after backward
                gather = self.comm.collective(group, step.gather_bytes[c], ALLGATHER)[1]
                gathers = (3 if step.recompute else 2) if step.runs_bwd else 1
                scatter = self.comm.collective(group, step.scatter_bytes[c], REDUCE_SCATTER)[1] if step.runs_bwd else 0
                bwd_shard = gather * (gathers - 1) + scatter
                fwd_ns += gather
                bwd_ns += bwd_shard
                if not plan.shard_ns:
                    plan.shard_ns = [(0, 0)] * len(step.devices)
                plan.shard_ns[c] = (gather, bwd_shard)
                # a ring all-gather or reduce-scatter: each member sends (n - 1) / n of the buffer
                n = len(group)
                plan.moved += (gathers * step.gather_bytes[c] + step.scatter_bytes[c]) * (n - 1) // n
            plan.fwd_ns.append(fwd_ns)
            if step.runs_bwd:
                plan.bwd_ns.append(bwd_ns)
        moves = {c for c, _, _ in step.carry_moves}
        plan.carries = [(p, c) for c, p in enumerate(step.carry_from) if p is not None and c not in moves]
        dev = step.devices
        for c, p, nbytes in step.carry_moves:
            fwd = self._exchange([(p, c, nbytes)], dev, dev, 0)
            bwd = self._exchange([(c, p, nbytes)], dev, dev, 0) if step.runs_bwd else None
            plan.carry_xfers.append((p, c, fwd, bwd))
            plan.moved += nbytes * (2 if step.runs_bwd else 1)

    def _key_op(self, plan: OpPlan, i: int) -> OpPlan:
        """Set the keys of op `i`'s tasks in `plan` (priced for it or for a copy of it)."""
        keys, step = self.keys, plan.step
        fpos, bpos = keys.fwd_pos(i), keys.bwd_pos(i)
        n = step.num_parts
        # chunks: the backward of a chunk runs before the one it starts from, so their keys count down the
        # parts in the field before the part (keys increase along every dependency)
        chunked = any(p is not None for p in step.carry_from)
        plan.fwd_keys = [keys.make(fpos, SUB_COMPUTE, 0, c, 0) for c in range(len(plan.fwd_ns))]
        plan.bwd_keys = [keys.make(bpos, SUB_COMPUTE, n - 1 - c if chunked else 0, c, 0)
                         for c in range(len(plan.bwd_ns))]
        plan.carry_xfers = [(p, c, fwd._replace(key=keys.make(fpos, SUB_COMPUTE, 0, p, 1)),
                             None if bwd is None else bwd._replace(key=keys.make(bpos, SUB_COMPUTE, n - 1 - c, c, 1)))
                            for p, c, fwd, bwd in plan.carry_xfers]
        return plan

    def _keep(self, firsts: dict, key, value) -> None:
        if len(firsts) >= self.cache_limit:
            firsts.clear()
        firsts[key] = value

    # -- edges -----------------------------------------------------------------------------------------

    def edge_plan(self, eid: int, pcfg: ParallelConfig, ccfg: ParallelConfig) -> EdgePlan:
        return self._cached(self._edges, (eid, pcfg, ccfg), lambda: self._make_edge_plan(eid, pcfg, ccfg))

    def _make_edge_plan(self, eid: int, pcfg: ParallelConfig, ccfg: ParallelConfig) -> EdgePlan:
        flow = self.flow
        edge = flow.edges[eid]
        first_key = (flow.edge_class[eid], pcfg, ccfg)
        first = self._edge_firsts.get(first_key)
        if isinstance(first, EdgePlan):  # a copy's plan: only the keys differ
            plan = EdgePlan(first.step.for_edge(eid))
            for name in ("fwd_dep", "fwd_xfer", "fwd_reduce", "bwd_dep", "bwd_xfer", "bwd_reduce"):
                setattr(plan, name, getattr(first, name))
            return self._key_edge(plan, eid)
        prod, cons = self.op_plan(edge.src, pcfg), self.op_plan(edge.dst, ccfg)
        step = first.for_edge(eid) if first is not None else lower_edge(flow, eid, prod.step, cons.step, self.replicas)
        plan = EdgePlan(step)
        self._price_edge(plan, edge, prod.devices, cons.devices)
        self._keep(self._edge_firsts, first_key, plan if self._share else step)
        return self._key_edge(plan, eid)

    def _price_edge(self, plan: EdgePlan, edge, pdev: tuple[int, ...], cdev: tuple[int, ...]) -> None:
        """Fill in `plan`'s dependencies, exchanges and reduces (task keys: `_key_edge`)."""
        step = plan.step
        moving = set(step.moving)
        plan.fwd_dep = [(p, c) for k, (p, c, _, _) in enumerate(step.pieces) if k not in moving]
        # (round, its pieces as (producer part, consumer part, bytes)) per exchange
        exchanges = [[(p, c, nb) for p, c, nb, _ in map(step.pieces.__getitem__, ks)] for _, _, ks in step.exchanges]
        plan.fwd_xfer = [self._exchange(pieces, pdev, cdev, 0) for pieces in exchanges]
        for c, k, nbytes in step.sums:
            dev = self.topology.devices[cdev[c]]
            plan.fwd_reduce.append(Reduce(c, ms_to_ns(self.cost_model.reduce_ms(nbytes, k, dev)), 0, cdev[c]))
        if step.grad:
            plan.bwd_dep = [(c, p) for p, c in plan.fwd_dep]
            plan.bwd_xfer = [self._exchange([(c, p, nb) for p, c, nb in pieces], cdev, pdev, 0)
                             for pieces in exchanges]
            for p, k, nbytes in step.grad_sums:
                dev = self.topology.devices[pdev[p]]
                plan.bwd_reduce.append(Reduce(p, ms_to_ns(self.cost_model.reduce_ms(nbytes, k, dev)), 0, pdev[p]))

    def _key_edge(self, plan: EdgePlan, eid: int) -> EdgePlan:
        """Set the keys of edge `eid`'s tasks in `plan` (priced for it or for a copy of it)."""
        keys, edge, step = self.keys, self.flow.edges[eid], plan.step
        fpos = keys.fwd_pos(edge.dst)
        rounds = [r for r, _, _ in step.exchanges]
        plan.fwd_xfer = [x._replace(key=keys.make(fpos, SUB_XFER, edge.slot, r, 0))
                         for x, r in zip(plan.fwd_xfer, rounds, strict=True)]
        plan.fwd_reduce = [x._replace(key=keys.make(fpos, SUB_REDUCE, edge.slot, x.part, 0)) for x in plan.fwd_reduce]
        if step.grad:
            bpos = keys.bwd_pos(edge.src)
            plan.bwd_xfer = [x._replace(key=keys.make(bpos, SUB_XFER, edge.use, r, 0))
                             for x, r in zip(plan.bwd_xfer, rounds, strict=True)]
            plan.bwd_reduce = [x._replace(key=keys.make(bpos, SUB_REDUCE, edge.use, x.part, 0))
                               for x in plan.bwd_reduce]
        return plan

    def _exchange(self, pieces: list[tuple[int, int, int]], src_dev: tuple[int, ...], dst_dev: tuple[int, ...],
                  key: int) -> Exchange:
        """The exchange task of `pieces` (sending part, receiving part, bytes) of one edge, pass and round (or
        of one carry and pass)."""
        res, ns = self.comm.exchange([(src_dev[a], dst_dev[b], nbytes) for a, b, nbytes in pieces])
        return Exchange(tuple(sorted({a for a, _, _ in pieces})), tuple(sorted({b for _, b, _ in pieces})),
                        sum(nbytes for _, _, nbytes in pieces), res, ns, key)

    # -- parameter units -------------------------------------------------------------------------------

    def param_plan(self, u: int, cfgs: Sequence[ParallelConfig]) -> ParamPlan:
        """The plan of unit `u` under `cfgs`, the configs of its ops (`GradFlow.units[u]`) in order."""
        cfgs = tuple(cfgs)
        return self._cached(self._params, (u, cfgs), lambda: self._make_param_plan(u, cfgs))

    def _make_param_plan(self, u: int, cfgs: tuple[ParallelConfig, ...]) -> ParamPlan:
        flow, keys = self.flow, self.keys
        members = flow.units[u]
        steps = {i: self.op_plan(i, cfg).step for i, cfg in zip(members, cfgs, strict=True)}
        step = lower_params(flow, u, steps, self.replicas)
        plan = ParamPlan(step)
        upos = keys.update_pos(flow.unit_first[u])
        passes = flow.setup.update_passes
        for d in sorted(step.update_bytes):
            ns = ms_to_ns(self.cost_model.update_ms(step.update_bytes[d], self.topology.devices[d], passes))
            plan.updates.append(Update(d, ns, keys.make(upos, SUB_COMPUTE, 0, d, 0)))
        shares: dict[tuple[tuple[int, ...], int], tuple[set, int]] = {}
        for e in step.sync:
            if len(e.group) < 2:
                continue  # overlapping shards on one device: added where they are
            holders, nbytes = shares.get((e.group, e.bucket), (set(), 0))
            shares[(e.group, e.bucket)] = (holders | set(e.holders), nbytes + e.nbytes)
        plan.sync = {sid: SyncShare(tuple(sorted(h)), nb) for sid, (h, nb) in sorted(shares.items())}
        return plan

    # -- all-reduces -----------------------------------------------------------------------------------

    def sync_task(self, group: tuple[int, ...], bucket: int, nbytes: int) -> tuple[tuple[int, ...], int, int]:
        """(resources, ns, key) of the all-reduce of `nbytes` over `group` for `bucket`."""
        res, ns = self.comm.collective(group, nbytes)
        pos = self.keys.bwd_pos(self.flow.bucket_first_op[bucket])
        return res, ns, self.keys.make(pos, SUB_SYNC, group_hash(group), group[0], group[-1])


__all__ = ["BWD", "CATEGORY_NAMES", "COMM_CATS", "COMPUTE_CATS", "EdgePlan", "Exchange", "FWD", "KeySpace",
           "MAX_ROUNDS", "OpPlan", "ParamPlan", "Planner", "REDUCE", "Reduce", "STEP_END", "SYNC", "SYNC_CATS",
           "SyncShare", "UPDATE", "Update", "XFER", "group_hash"]
