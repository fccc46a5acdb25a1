"""The simulator: task graph instantiation, full and delta simulation, accept/reject, memory totals.

Owns `Simulator`. It builds the tasks of a strategy from `simulator.taskgraph` plans and times them; on
a change of one op (or of several in one proposal, `propose_many`: op by op) it replaces only that op's
tasks, the transfers of its edges and its update tasks, edits the all-reduces of its bucket (and, where
devices repeat, the round order's edges that change, once per proposal), and re-times only what can
have changed, by one replay. Must import only `soap` (and the stdlib, numpy): never torch, the
runtime or the search.

Semantics (exact, so that delta equals full). Times are integer nanoseconds. A task's ready time is the
latest end of its data predecessors (0 without any). Every resource (device or link) runs its tasks one at
a time in the order of (ready time, static key) (`KeySpace`: unique, increasing along data edges); a task
starts at max(ready, end of the previous task on each of its resources in that order): a multi-link
transfer or an all-reduce waits for all its links. Since keys increase along data edges and durations are
>= 0, (ready, key) is a topological order of data plus resource edges, so the full simulation is Kahn's
algorithm with a heap on (ready, key) where each task takes the current last end of its resources.

Rounds. Where an op runs in several rounds (devices repeat, or chunks hand their state between devices),
the round order's edges (`simulator.taskgraph`'s task list; `simulator.roundwalk`, `_walk_rounds`) are
predecessors like data edges, walked from the step's order on every change (they depend on every op's
config): again from the last walk, only from the changed ops' items until it is back on its old track,
where the order is unchanged, else from scratch; a proposal cuts and adds only the edges that differ.
One may lead to a smaller key (a later round of an earlier op): that keeps (ready, key) a topological
order unless the task before it lasts 0 ns, so a state with such an edge (`_unsorted`) is replayed whole
by the next delta.

Delta. The processing order of a simulation is sorted by (ready, key). After a change, let K0 be the
smallest of: the old (ready, key) of every removed task and of every surviving task whose predecessors
or duration changed, and, for every new task whose predecessors are all old, (latest end of those, key).
Every task before K0 in the old order keeps its times (its inputs are unchanged and come before it), and
every task at or after K0 comes after it in the new order (the first task whose times change is one of
those seeds; over several ops, K0 is the smallest over all of them, old meaning before the first), so
replaying Kahn's algorithm from K0 -- from the resources' state at K0, over the old
suffix plus the new tasks -- gives exactly the full simulation's times. The replay is the O(tasks) part,
proportional to the part of the iteration after the change. `propose` keeps an undo journal, so
`reject` restores the previous state (tasks, edges, times, orders) without simulating.

Speed. A priority (ready, key) is one int, ``(ready << _sh) | (key << _TID_BITS) | task id``, so the heap
compares plain ints and the popped entry names its task; `_rk` keeps each task's priority (the order
of the last simulation). The replay counts the inputs a suffix task still waits for by scanning the
successors of the prefix (the shorter side of the cut, about a fifth of the tasks for a random op), and
the journal keeps whole copies of the old times and order (a list copy costs far less than the replay).
On inception_v3 under data parallelism a random proposal replays about 80% of the tasks (everything
after the changed op shifts), so delta beats full by skipping the task-graph build and the timeline, not
by re-timing less: see benchmarks/simulator_speed.py. A replay with a limit (`time_within_ms`: the
search rejects anything slower) stops as soon as it proves the step longer: a resource runs one task
at a time, so when a task on resource x ends at e, x ends no sooner than e plus the work x has left
(kept per resource during the replay); past the limit, that lower bound is the answer and the times
and order go back to before the replay, which runs again if the proposal's time is read after all.
A proposal that makes the step slower early in the forward pass is rejected after replaying little
more than the changed op. Memory needs no task: `peek_peaks` tells a proposal's peaks from its plans
before any task is made (a search rejects one that does not fit without making its tasks); nor does
`work_bound_ms`, each device's compute over a whole strategy (a search rejects a whole-strategy trial
slower than its limit on that alone).

Replicas. A simulator of one replica (`replicas`, `simulate`'s symmetry) times replica 0 of a strategy
made of identical replicas; its delta proposals must keep the strategy so (`_check_replica_change`,
before anything changes: the configs, the lowered edges and parameter units, the all-reduce groups, and
once a topology that repeats itself replica by replica, `replica_refusal`), else `NotReplicable`. Bytes
moved count every replica's.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from heapq import heapify, heappop, heappush
from typing import NamedTuple

from simulator.comm import NO_OVERHEAD, Comm
from simulator.costmodel import AnalyticalCostModel, CostModel
from simulator.roundwalk import RoundWalk, walk_rounds
from simulator.taskgraph import (
    BWD,
    COMM_CATS,
    COMPUTE_CATS,
    FWD,
    REDUCE,
    STEP_END,
    SUB_COMPUTE,
    SUB_SYNC,
    SUB_XFER,
    SYNC,
    UPDATE,
    XFER,
    EdgePlan,
    Exchange,
    KeySpace,
    OpPlan,
    ParamPlan,
    Planner,
    Reduce,
    SyncShare,
)
from simulator.timeline import Timeline
from soap.config import ConfigError, ParallelConfig, validate
from soap.graph import OperatorGraph
from soap.lowering import (
    EdgeStep,
    GradFlow,
    Item,
    NotReplicable,
    OpStep,
    Replicas,
    StepPlan,
    find_replicas,
    flight_savings,
    interleaves,
    lower,
    repeats,
    step_order,
)
from soap.setup import TrainSetup
from soap.strategy import Strategy, StrategyError, validate_strategy
from soap.topology import DeviceTopology

_NEW = 1 << 400  # the priority of a task not yet simulated: after every real one
_TID_BITS = 28  # task ids below 2**28 (a priority carries its task id in its low bits)
_ORDERS_KEPT = 64  # step orders a simulator remembers (`_step_order`) before it forgets them
_FITS_KEPT = 200_000  # (op, config) pairs a simulator remembers as checked (`check_config`) before it forgets them

Link = tuple[int, int]
SyncId = tuple[tuple[int, ...], int]  # (device group, bucket)


def _ns_limit(limit_ms: float) -> int:
    """The largest whole ns count whose time in ms (ns / 1e6, as `iteration_time_ms` reads it) is at most
    `limit_ms`: a step of more ns is longer than `limit_ms` however ms round (`_NEW` for no limit)."""
    if limit_ms == math.inf:
        return _NEW
    n = math.floor(limit_ms * 1e6)
    while (n + 1) / 1e6 <= limit_ms:
        n += 1
    while n / 1e6 > limit_ms:
        n -= 1
    return n


class _Unit:
    """The tasks of an op (forward, backward: per part; `carry`: per chunk whose state moves from another
    device, its forward and backward transfer tasks, as `OpPlan.carry_xfers`), of an edge (forward,
    backward: its exchange tasks, as `EdgePlan.fwd_xfer` and `bwd_xfer`), or of a parameter unit's
    updates, and the data edges the unit made (undone exactly when the unit is replaced); an edge's
    `step`, the lowering it was made from."""

    __slots__ = ("tids", "links", "fwd", "bwd", "by_device", "carry", "step")

    def __init__(self, tids: list[int], links: list[Link], fwd: list[int] | None = None,
                 bwd: list[int] | None = None, by_device: dict[int, int] | None = None,
                 carry: dict[int, tuple[int, int | None]] | None = None, step: EdgeStep | None = None):
        self.tids, self.links = tids, links
        self.fwd, self.bwd, self.by_device, self.carry = fwd, bwd, by_device, carry
        self.step = step


class _Sync:
    """One all-reduce task (per device group and bucket) and, per parameter unit taking part, its share
    and the edges into and out of the task. It outlives changes to its members: a proposal edits its
    edges and duration in place."""

    __slots__ = ("tid", "members", "links")

    def __init__(self, tid: int, members: dict[int, SyncShare], links: dict[int, list[Link]]):
        self.tid, self.members, self.links = tid, members, links


class _SyncEdit(NamedTuple):
    """An all-reduce a proposal edited, as it was: enough for `reject` to restore it."""

    sid: SyncId
    sync: _Sync
    preds: list[int]
    succs: list[int]
    dur: int
    nbytes: int
    members: dict[int, SyncShare]
    links: dict[int, list[Link]]


class _Journal:
    """What `propose` changed, for `reject` to undo it (`noop`: the proposal changed nothing): per op
    changed, a journal of its own in `steps` (its units, edges, all-reduces, memory); for the whole
    proposal, the round order's edges and the old times and order of the replay."""

    __slots__ = ("noop", "op", "cfg", "plan", "params", "old_len", "mem", "moved", "iteration", "dead",
                 "removed", "gone", "synced", "cut", "ended", "added", "links", "new_syncs", "order", "end", "rk",
                 "cuts", "res_tails", "rounds", "walk", "round_cut", "unsorted", "flight", "steps", "busy", "k0",
                 "replayed")

    def __init__(self, *, noop: bool = False):
        self.noop = noop


class Simulator:
    """Full and delta simulation of strategies for one (graph, topology, cost model, training setup).

    Typical use (the search)::

        sim = Simulator(graph, topology, cost_model, setup=setup)
        sim.full(strategy)                  # -> Timeline; `strategy` becomes current
        t_ms = sim.propose("fc1", cfg)      # delta: iteration time with fc1 changed to cfg
        sim.accept()  # or sim.reject()     # keep the change, or restore the previous state cheaply

    While a proposal is pending, `strategy`, `iteration_time_ms`, `feasible`, `peak_memory_bytes`,
    `memory_excess_bytes` and `timeline()` describe it; otherwise the current state. Instances share
    nothing; the caches they hold are pure functions of (graph, setup, topology, cost model).
    """

    def __init__(self, graph: OperatorGraph, topology: DeviceTopology, cost_model: CostModel | None = None, *,
                 setup: TrainSetup | None = None, replicas: Replicas | None = None):
        self.graph = graph
        self.replicas = replicas
        self.topology = topology
        self.setup = setup if setup is not None else TrainSetup()
        self.cost_model: CostModel = cost_model if cost_model is not None else AnalyticalCostModel()
        dtype = self.setup.compute_dtype
        for device in topology.devices:
            if dtype not in device.peak_flops:
                raise ValueError(f"precision {self.setup.precision} computes in {dtype}, which device {device.id} "
                                 f"({device.kind}) does not run (it has {', '.join(device.peak_flops)})")
        self.flow = GradFlow(graph, self.setup)
        self.keys = KeySpace(len(graph), topology.num_devices)
        self.comm = Comm(topology, getattr(self.cost_model, "comm_overhead", NO_OVERHEAD))
        self.planner = Planner(self.flow, topology, self.cost_model, self.keys, self.comm, replicas=replicas)
        self.num_devices = topology.num_devices
        # the devices whose tasks are simulated (replica 0's under `replicas`): the first tasks of every
        # build are their step ends, task id = device (`simulator.taskgraph`'s docstring)
        self._num_ends = replicas.size if replicas is not None else self.num_devices
        self.num_resources = self.num_devices + len(topology.links)
        self.capacity = [d.memory_bytes for d in topology.devices]
        self._kb = self.keys.bits
        self._sh = self._kb + _TID_BITS  # a priority is (ready << _sh) | (key << _TID_BITS) | task id
        self._configs: list[ParallelConfig] | None = None
        self._journal: _Journal | None = None
        self._routes_refusal: str | None = None  # `replica_refusal`, once known
        self._fits: set[tuple[int, ParallelConfig]] = set()  # (op position, config)s `check_config` passed
        self._orders: dict[tuple, tuple[Item, ...]] = {}  # `_step_order`'s orders

    def twin(self) -> Simulator:
        """Another simulator of the same graph, topology, cost model and setup, sharing what this one
        remembers (plans, routes and exchanges, checked configs, step orders: pure functions of those): a
        second state, say to try a whole strategy while this one keeps the current."""
        twin = object.__new__(Simulator)
        for name in ("graph", "replicas", "topology", "setup", "cost_model", "flow", "keys", "comm", "planner",
                     "num_devices", "_num_ends", "num_resources", "capacity", "_kb", "_sh", "_routes_refusal", "_fits",
                     "_orders"):
            setattr(twin, name, getattr(self, name))
        twin._configs = None
        twin._journal = None
        return twin

    # -- public API ----------------------------------------------------------------------------------

    @property
    def strategy(self) -> Strategy:
        """The strategy of the state described (the proposal while one is pending)."""
        self._need_state()
        return Strategy({op.name: cfg for op, cfg in zip(self.graph.ops, self._configs, strict=True)})

    @property
    def iteration_time_ms(self) -> float:
        self._need_state()
        self._settle()
        return self._iteration_ns / 1e6

    def time_within_ms(self, limit_ms: float) -> tuple[float, bool]:
        """(`iteration_time_ms`, True) where it is at most `limit_ms`; where it is longer, either that or
        (a lower bound above `limit_ms`, False): the replay of a lazy pending proposal stops as soon as
        some resource's work left after its last task so far shows the step longer (`_run`), and runs
        again when a time is read or the proposal is accepted."""
        self._need_state()
        stopped = self._settle(_ns_limit(limit_ms))
        if stopped:
            return stopped / 1e6, False
        return self._iteration_ns / 1e6, True

    @property
    def time_bound_ms(self) -> float:
        """A lower bound on `iteration_time_ms` known without timing anything: the most work any one
        resource (device or link) has, since a resource runs its tasks one at a time. Exact times of a
        lazy proposal (`propose_many(lazy=True)`) are only timed when read."""
        self._need_state()
        return max(self._busy, default=0) / 1e6

    @property
    def peak_memory_bytes(self) -> tuple[int, ...]:
        """Per device, what it keeps plus its largest transient (`soap.lowering`'s memory rule)."""
        self._need_state()
        return self._peaks(self._flight)

    def _peaks(self, flight: Mapping[int, int]) -> tuple[int, ...]:
        """Per device, what it keeps plus its largest transient less what the round order saves (`flight`)."""
        peak = [m + t - flight.get(d, 0) for d, (m, t) in enumerate(zip(self._mem, self._tmax, strict=True))]
        return tuple(peak if self.replicas is None else self.replicas.spread(peak))

    @property
    def memory_excess_bytes(self) -> int:
        """The largest amount by which a device's peak exceeds its capacity (0 when feasible)."""
        self._need_state()
        return self.excess_of(self.peak_memory_bytes)

    def excess_of(self, peaks: tuple[int, ...]) -> int:
        """The largest amount by which per-device `peaks` exceed the devices' capacities (0 when they fit)."""
        return max(0, max(p - c for p, c in zip(peaks, self.capacity, strict=True)))

    @property
    def feasible(self) -> bool:
        return self.memory_excess_bytes == 0

    @property
    def num_tasks(self) -> int:
        self._need_state()
        self._settle()
        return len(self._order)

    @property
    def pending(self) -> bool:
        return self._journal is not None

    def full(self, strategy: Strategy, *, validated: bool = False) -> Timeline:
        """Simulate `strategy` from scratch; it becomes the current state (a pending proposal is dropped).
        `validated`: the caller has checked the strategy already (`validate_strategy`, and under `replicas`
        that every op is laid out as them, `soap.lowering.repeats`; else `NotReplicable`)."""
        self.build(strategy, validated=validated)
        return self.timeline()

    def build(self, strategy: Strategy, *, validated: bool = False) -> None:
        """`full` without making its `Timeline` (the critical path and the task lists): what a search that
        only reads the cost needs."""
        if not validated:
            validate_strategy(self.graph, strategy, self.num_devices)
            if self.replicas is not None:
                for i, op in enumerate(self.graph.ops):
                    self._check_layout(i, strategy[op.name])
        self._journal = None
        self._build([strategy[op.name] for op in self.graph.ops])

    def propose(self, op: str, cfg: ParallelConfig) -> float:
        """Change `op` to `cfg` by delta simulation; returns the new iteration time in ms.

        Must be followed by `accept` or `reject` before the next `propose` (`StrategyError` when `cfg`
        does not fit the op or the topology).
        """
        return self.propose_many({op: cfg})

    def propose_many(self, changes: Mapping[str, ParallelConfig], *, lazy: bool = False) -> float | None:
        """Change several ops at once (op -> config) by one delta simulation: every op's tasks are
        replaced, then one replay re-times everything from the earliest point any of them can change.
        Returns the new iteration time in ms; `accept` or `reject` as after `propose`. Nothing changes
        when a config is refused (`StrategyError`) or an op is unknown (`ValueError`).

        `lazy`: only replace the tasks and return None; the replay runs when a time is first read
        (`iteration_time_ms`, `timeline`, `num_tasks`) or on `accept`, and never when the proposal is
        rejected first. Memory (`peak_memory_bytes`, `feasible`) and `time_bound_ms` need no replay:
        a search rejects on them alone what they already rule out.

        Under `replicas` the changed strategy must still be those replicas (`NotReplicable`, nothing
        changed, where it is not, or where the topology does not repeat itself replica by replica:
        `_check_replica_change`)."""
        self._need_state()
        if self._journal is not None:
            raise RuntimeError("a proposal is pending: accept() or reject() it first")
        items = self._checked_changes(changes)
        if items:
            self._delta(items)
        else:
            self._journal = _Journal(noop=True)
        if lazy:
            return None
        self._settle()
        return self._iteration_ns / 1e6

    def peek_peaks(self, changes: Mapping[str, ParallelConfig]) -> tuple[int, ...]:
        """`peak_memory_bytes` as it would be with the ops of `changes` given their configs, known from the
        plans alone (the memory rule needs no task): nothing is built, timed or changed. Refuses what
        `propose_many` refuses (`StrategyError`, `ValueError`, `NotReplicable`), checked the same way. A
        search rejects a proposal that does not fit on this alone, without making its tasks."""
        self._need_state()
        if self._journal is not None:
            raise RuntimeError("a proposal is pending: accept() or reject() it first")
        items = self._checked_changes(changes)
        if not items:
            return self.peak_memory_bytes
        flow, planner = self.flow, self.planner
        ops = [i for i, _ in items]
        units, edges = self._touched(ops)
        saved = list(self._mem), self._trans, list(self._tmax)
        self._trans = [dict(counts) for counts in self._trans]
        try:
            rounds = self._rounds - self._hold(ops, units, edges, -1)
            with self._configured(items):
                rounds += self._hold(ops, units, edges, 1)
                flight: dict[int, int] = {}
                if rounds and interleaves(self.setup):  # the order's savings, from the changed steps (`_walk_rounds`)
                    steps = [planner.op_plan(i, cfg).step for i, cfg in enumerate(self._configs)]
                    changed = set(edges)
                    edge_steps = [self._edge_plan(e).step if e in changed else unit.step
                                  for e, unit in enumerate(self._edge_units)]
                    flight = flight_savings(flow, steps, edge_steps, self._step_order(steps, edge_steps))
            return self._peaks(flight)
        finally:
            self._mem, self._trans, self._tmax = saved

    def _hold(self, ops: list[int], units: list[int], edges: list[int], sign: int) -> int:
        """Add (`sign` 1) or take out (-1) the memory that op positions `ops`, parameter units `units` and
        edges `edges` hold under the current configs (`peek_peaks`); returns how many of the ops run in
        several rounds."""
        rounds = 0
        for i in ops:
            plan = self.planner.op_plan(i, self._configs[i])
            self._add_mem(plan.mem, sign)
            self._add_transient(plan.transient, sign)
            rounds += plan.step.num_rounds > 1
        for u in units:
            self._add_mem(self._param_plan(u).mem, sign)
        for e in edges:
            self._add_mem(self._edge_plan(e).recv, sign)
        return rounds

    def work_bound_ms(self, changes: Mapping[str, ParallelConfig]) -> float:
        """A lower bound on the step time with the ops of `changes` given their configs, from the plans
        alone: the most compute any one device has (its parts' forward and backward, its updates), which it
        runs one at a time (`time_bound_ms` counts every task, transfers and all-reduces too, but needs the
        tasks made). Nothing is built, timed or changed; `changes` must have passed `peek_peaks`. Over many
        ops (a whole-strategy trial) it costs a fraction of a full build."""
        self._need_state()
        flow, planner = self.flow, self.planner
        work = [0] * self.num_devices
        with self._configured((flow.index[name], cfg) for name, cfg in changes.items()):
            for i, cfg in enumerate(self._configs):
                plan = planner.op_plan(i, cfg)
                for d, ns in zip(plan.devices, plan.fwd_ns, strict=False):
                    work[d] += ns
                for d, ns in zip(plan.devices, plan.bwd_ns, strict=False):
                    work[d] += ns
            for u in range(len(flow.units)):
                for x in self._param_plan(u).updates:
                    work[x.device] += x.ns
        return max(work, default=0) / 1e6

    @contextmanager
    def _configured(self, items: Iterable[tuple[int, ParallelConfig]]) -> Iterator[None]:
        """Op position -> config `items` in `_configs` while the block runs (what the plan lookups read),
        the old configs back after."""
        saved = []
        try:
            for i, cfg in items:
                saved.append((i, self._configs[i]))
                self._configs[i] = cfg
            yield
        finally:
            for i, cfg in reversed(saved):
                self._configs[i] = cfg

    def _touched(self, ops: Iterable[int]) -> tuple[list[int], list[int]]:
        """The parameter units and the edges (each once, in order) of op positions `ops`: what a change of
        their configs re-lowers beside them."""
        flow = self.flow
        ops = list(ops)
        units = sorted({flow.unit[i] for i in ops if flow.unit[i] >= 0})
        return units, sorted({e for i in ops for e in flow.in_edges[i] + flow.out_edges[i]})

    def _checked_changes(self, changes: Mapping[str, ParallelConfig]) -> list[tuple[int, ParallelConfig]]:
        """The (op position, config) pairs of `changes` that change the strategy, after every check a
        change needs (`check_config`; a config the simulator refuses; under `replicas`,
        `_check_replica_change`), before anything changes."""
        items = []
        for op, cfg in changes.items():
            i = self.check_config(op, cfg)
            if cfg != self._configs[i]:
                self.planner.op_plan(i, cfg)  # (cached) a config the simulator refuses, before anything changes
                items.append((i, cfg))
        if items and self.replicas is not None:
            self._check_replica_change(items)
        return items

    def check_config(self, op: str, cfg: ParallelConfig) -> int:
        """The position of op `op`, after checking `cfg` fits it and the topology (`ValueError` for an
        unknown op, `StrategyError` for a config `soap.config.validate` refuses, under `replicas`
        `NotReplicable` for one not laid out as them): what a change of one op needs checked, the rest of
        the strategy having been checked already."""
        i = self.flow.index.get(op)
        if i is None:
            raise ValueError(f"no operator named {op!r} in graph {self.graph.name!r}")
        if (i, cfg) in self._fits:
            return i
        try:
            validate(self.graph.ops[i], cfg, self.num_devices)
        except ConfigError as exc:
            raise StrategyError(str(exc)) from None
        if self.replicas is not None:
            self._check_layout(i, cfg)
        if len(self._fits) >= _FITS_KEPT:
            self._fits.clear()
        self._fits.add((i, cfg))
        return i

    def accept(self) -> None:
        if self._journal is None:
            raise RuntimeError("no pending proposal to accept")
        self._settle()
        self._journal = None
        if self._dead > len(self._order):  # replaced tasks pile up in the arrays: compact now and then
            self._build(list(self._configs))

    def reject(self) -> None:
        if self._journal is None:
            raise RuntimeError("no pending proposal to reject")
        if not self._journal.noop:
            self._undo(self._journal)
        self._journal = None

    def delta(self, op: str, cfg: ParallelConfig) -> Timeline:
        """`propose` then `accept`: the timeline of the current strategy with `op` changed to `cfg`."""
        self.propose(op, cfg)
        self.accept()
        return self.timeline()

    def step_plan(self) -> StepPlan:
        """The `StepPlan` the state described times (lowered afresh: what the runtime would execute; under
        `replicas`, replica 0's)."""
        return lower(self.graph, self.strategy, self.setup, self.num_devices, flow=self.flow,
                     replicas=self.replicas)

    def collectives(self) -> list[dict[str, dict[str, int]]]:
        """Per device, per kind, the count and bytes of the collectives of one step (`StepPlan.collectives`)."""
        out = self.step_plan().collectives()
        return out if self.replicas is None else self.replicas.spread(out)

    def timeline(self) -> Timeline:
        """The `Timeline` of the state described (the pending proposal if there is one)."""
        self._need_state()
        self._settle()
        critical = self._critical_path()
        split = [0, 0, 0]
        for t in critical:
            c = self._cat[t]
            if c in COMPUTE_CATS:
                shard_ns = self._shard_ns(self._key[t])  # sharded parameters' collectives inside the task
                split[0] += self._dur[t] - shard_ns
                split[1] += shard_ns
            else:
                split[1 if c in COMM_CATS else 2] += self._dur[t]
        links = [f"link {link.id}: {link.src} -> {link.dst} ({link.kind})" for link in self.topology.links]
        end, dur = self._end, self._dur
        return Timeline(name=self.graph.name, num_devices=self.num_devices, link_names=links,
                        iteration_ns=self._iteration_ns, path_ns=(split[0], split[1], split[2]),
                        bytes_moved=self._moved, peak_memory=list(self.peak_memory_bytes), capacity=self.capacity,
                        order=list(self._order), keys=list(self._key), cats=list(self._cat),
                        res=list(self._res), start=[e - d for e, d in zip(end, dur, strict=True)],
                        end=list(end), nbytes=list(self._nbytes), namer=self.task_name, critical_path=critical,
                        replicas=1 if self.replicas is None else self.replicas.count)

    def _shard_ns(self, key: int) -> int:
        """Of a compute task (by key), the ns its part spends in the all-gathers and reduce-scatter of
        sharded parameters (`OpPlan.shard_ns`; 0 for any other task)."""
        pos, sub, _, c, state = self.keys.split(key)
        n = self.flow.num_ops
        if sub != SUB_COMPUTE or state or pos >= 2 * n:
            return 0
        shard_ns = self._plans[pos if pos < n else 2 * n - 1 - pos].shard_ns
        return shard_ns[c][pos >= n] if shard_ns else 0

    def task_name(self, key: int) -> str:
        """A readable name for a task key (traces, task records)."""
        flow = self.flow
        pos, sub, e, a, b = self.keys.split(key)
        n = flow.num_ops
        if pos < n:
            op = flow.ops[pos]
            if sub == SUB_COMPUTE:
                return f"{op.name} state [{a}] ->" if b else f"{op.name} fwd[{a}]"
            src = op.inputs[e].op
            if sub == SUB_XFER:
                return f"{src} -> {op.name}" + (f" round {a}" if a else "")
            return f"{op.name} sum input {e} [{a}]"
        if pos < 2 * n:
            op = flow.ops[2 * n - 1 - pos]
            if sub == SUB_COMPUTE:
                return f"grad {op.name} state [{a}] ->" if b else f"{op.name} bwd[{a}]"
            if sub == SUB_SYNC:
                bucket = flow.bucket_first_op.index(2 * n - 1 - pos)
                return f"allreduce bucket {bucket} devices {a}..{b}"
            consumer = self.graph.consumers(op.name)[e][0]
            if sub == SUB_XFER:
                return f"grad {consumer} -> {op.name}" + (f" round {a}" if a else "")
            return f"{op.name} sum grads [{a}]"
        if pos == 2 * n and sub < SUB_COMPUTE:
            return f"step end[device {a}]" if sub == SUB_XFER else "overflow check"
        return f"{flow.ops[pos - 2 * n].name} update[device {a}]"

    # -- building ------------------------------------------------------------------------------------

    def _need_state(self) -> None:
        if self._configs is None:
            raise RuntimeError("no strategy simulated yet: call full(strategy) first")

    def _settle(self, limit: int = _NEW) -> int:
        """Run the replay of a lazy pending proposal (`propose_many`), if it has not run yet; 0, or where
        it stopped, the step being longer than `limit` ns, the lower bound on the step that showed it
        (`_replay`: the proposal stays unreplayed)."""
        j = self._journal
        if j is not None and not j.noop and not j.replayed:
            stopped = self._replay(j.k0, j.old_len, j, limit)
            if stopped:
                return stopped
            j.replayed = True
        return 0

    def _build(self, configs: list[ParallelConfig]) -> None:
        """Instantiate every task of `configs` and simulate from scratch."""
        flow, planner = self.flow, self.planner
        self._dur: list[int] = []
        self._key: list[int] = []
        self._kt: list[int] = []  # (key << _TID_BITS) | task id: the heap priority at ready time 0
        self._res: list[tuple[int, ...]] = []
        self._cat: list[int] = []
        self._nbytes: list[int] = []
        self._preds: list[list[int]] = []
        self._succs: list[list[int]] = []
        self._alive: list[bool] = []
        self._end: list[int] = []
        self._rk: list[int] = []
        self._busy = [0] * self.num_resources  # per resource, the durations of its live tasks
        self._dead = 0
        self._configs = configs
        self._plans: list[OpPlan] = [planner.op_plan(i, cfg) for i, cfg in enumerate(configs)]
        self._params: list[ParamPlan] = [self._param_plan(u) for u in range(len(flow.units))]
        links: list[Link] = []
        self._add_step_ends(links)
        self._op_units = [self._add_op_unit(i, links) for i in range(flow.num_ops)]
        self._update_units = [self._add_update_unit(u, links) for u in range(len(flow.units))]
        self._edge_units = [self._add_edge_unit(e, links) for e in range(len(flow.edges))]
        self._syncs: dict[SyncId, _Sync] = {}
        members: dict[SyncId, dict[int, SyncShare]] = {}
        for u, plan in enumerate(self._params):
            for sid, share in plan.sync.items():
                members.setdefault(sid, {})[u] = share
        for sid in sorted(members):
            self._syncs[sid] = self._new_sync(sid, members[sid], links)
        self._rounds = sum(plan.step.num_rounds > 1 for plan in self._plans)
        self._walk, _, made = self._walk_rounds()
        links += made
        self._unsorted = self._walk is not None and self._walk.num_unsorting > 0
        self._apply(links)
        self._mem = [0] * self.num_devices
        self._trans: list[dict[int, int]] = [{} for _ in range(self.num_devices)]  # bytes -> how many parts
        self._tmax = [0] * self.num_devices
        self._moved = 0
        for plan in self._plans:
            self._add_mem(plan.mem, 1)
            self._add_transient(plan.transient, 1)
            self._moved += plan.moved * (1 if self.replicas is None else self.replicas.count)
        for plan in self._params:
            self._add_mem(plan.mem, 1)
        for e in range(len(flow.edges)):
            ep = self._edge_plan(e)
            self._add_mem(ep.recv, 1)
            self._moved += ep.moved * (1 if self.replicas is None else self.replicas.count)
        for sync in self._syncs.values():
            self._moved += self._nbytes[sync.tid]
        if self.replicas is not None:
            self._check_replicas()
        self._simulate_all()

    def _check_replicas(self) -> None:
        """Raise `NotReplicable` unless timing replica 0 alone is exact. The whole step is then invariant
        under the shift of every device by one replica (d -> d + size, modulo the device count), so every
        task starts when its counterpart in replica 0 does: every device is the same device as its
        counterpart; every all-reduce's group is its own shift (a task of the replica plan, it waits for
        replica 0's devices as for all others); and every exchange of every replica takes as long as
        replica 0's on links no other replica's exchanges use (the exchange of an edge, pass and round is one
        task over every replica's pieces, as long as replica 0's share of it when their links are apart)."""
        rep, n = self.replicas, self.num_devices
        unlike = self._unlike_device()
        if unlike:
            raise NotReplicable(unlike)
        for group, _ in self._syncs:
            self._check_group(group)
        if not self.replica_refusal():
            return  # every exchange among a replica's devices is exact on such a topology (`replica_refusal`)
        owner: dict[int, int] = {}  # link resource -> the replica whose exchanges use it
        passes = []
        for e, edge in enumerate(self.flow.edges):
            step = self._edge_plan(e).step
            pdev = self._plans[edge.src].step.devices
            cdev = self._plans[edge.dst].step.devices
            for _, _, ks in step.exchanges:
                pairs = [(pdev[p], cdev[c], nb) for p, c, nb, _ in map(step.pieces.__getitem__, ks)]
                passes += [pairs] + ([[(b, a, nb) for a, b, nb in pairs]] if edge.grad else [])
        for plan in self._plans:  # the carries between devices
            dev = plan.step.devices
            for p, c, fwd, back in plan.carry_xfers:
                nb = fwd.nbytes
                passes += [[(dev[p], dev[c], nb)]] + ([[(dev[c], dev[p], nb)]] if back is not None else [])
        for pieces in passes:
            ns = None
            for g in range(rep.count):
                res, t = self.comm.exchange([(a + g * rep.size, b + g * rep.size, nb) for a, b, nb in pieces])
                if ns is not None and t != ns:
                    raise NotReplicable(f"an exchange of replica {g} takes longer than replica 0's")
                ns = t
                for r in res:
                    if r >= n and owner.setdefault(r, g) != g:
                        raise NotReplicable("two replicas' exchanges share a link")

    def _check_layout(self, i: int, cfg: ParallelConfig) -> None:
        """Raise `NotReplicable` unless `cfg` lays op position `i` out as the replicas (an op that computes
        nothing always is)."""
        rep, flow = self.replicas, self.flow
        if not flow.everywhere[i] and not repeats(flow.ops[i], cfg, rep):
            raise NotReplicable(f"{flow.ops[i].name}: the config is not {rep.count} replicas of {rep.size} devices")

    def _check_group(self, group: tuple[int, ...]) -> None:
        """Raise `NotReplicable` unless the all-reduce over `group` is its own shift by one replica (the
        same in every replica)."""
        if {(d + self.replicas.size) % self.num_devices for d in group} != set(group):
            raise NotReplicable(f"the all-reduce over {group[:4]}.. is not the same in every replica")

    def _check_replica_change(self, items: list[tuple[int, ParallelConfig]]) -> None:
        """Raise `NotReplicable`, changing nothing, unless timing replica 0 alone stays exact with op
        position -> config `items` changed (each laid out as the replicas: `check_config` checks that
        first): the edges and parameter units the change touches lower as replicas
        (their plans, cached, are what `_change` uses next) with every all-reduce group its own shift, and
        the topology is one that repeats itself replica by replica (`replica_refusal`, checked once):
        then every exchange of any strategy of replicas is exact, which `_check_replicas` checks one by
        one after a full build."""
        refusal = self.replica_refusal()
        if refusal:
            raise NotReplicable(refusal)
        units, edges = self._touched(i for i, _ in items)
        with self._configured(items):
            for e in edges:
                self._edge_plan(e)
            for u in units:
                for group, _ in self._param_plan(u).sync:
                    self._check_group(group)

    def _unlike_device(self) -> str:
        """Which device differs from its counterpart in replica 0 ('' where none does)."""
        rep, devices = self.replicas, self.topology.devices
        for d in range(self.num_devices):
            a, b = devices[d], devices[d % rep.size]
            if (a.kind, dict(a.peak_flops), a.memory_bandwidth_gbps, a.memory_bytes) != (
                    b.kind, dict(b.peak_flops), b.memory_bandwidth_gbps, b.memory_bytes):
                return f"device {d} differs from device {d % rep.size}"
        return ""

    def replica_refusal(self) -> str:
        """Under `replicas`, why this simulator cannot make delta proposals ('' where it can; found once):
        the topology does not repeat itself replica by replica (`_replica_routes`)."""
        if self._routes_refusal is None:
            self._routes_refusal = self._replica_routes()
        return self._routes_refusal

    def _replica_routes(self) -> str:
        """Why the topology does not repeat itself replica by replica ('' where it does): every device of
        replica g is the same device as its counterpart in replica 0, and the shift by g replicas maps the
        routes among replica 0's devices link for link onto those among replica g's (one map per g, onto
        links of the same bandwidth), with no link on the routes of two replicas. An exchange among a
        replica's devices (the only kind `soap.lowering` lowers under replicas) then takes as long in
        every replica, on links no other replica's exchanges use."""
        rep, n, comm = self.replicas, self.num_devices, self.comm
        unlike = self._unlike_device()
        if unlike:
            return unlike
        owner: dict[int, int] = {}  # link resource -> the replica whose routes use it
        for g in range(rep.count):
            shift = g * rep.size
            onto: dict[int, int] = {}
            for a in range(rep.size):
                for b in range(rep.size):
                    if a == b:
                        continue
                    res0, lat0, bw0 = comm.route(a, b)
                    res, lat, bw = comm.route(a + shift, b + shift)
                    if len(res) != len(res0) or lat != lat0 or bw != bw0:
                        return f"the route {a + shift} -> {b + shift} differs from {a} -> {b}"
                    for r0, r in zip(res0, res, strict=True):
                        if r0 < n:
                            if r != r0 + shift:
                                return f"the route {a + shift} -> {b + shift} differs from {a} -> {b}"
                        elif onto.setdefault(r0, r) != r or comm.link_gbps(r0) != comm.link_gbps(r):
                            return f"the route {a + shift} -> {b + shift} differs from {a} -> {b}"
                        elif owner.setdefault(r, g) != g:
                            return f"replicas {owner[r]} and {g} share a link"
        return ""

    def _apply(self, links: list[Link]) -> None:
        succs, preds = self._succs, self._preds
        for u, v in links:
            succs[u].append(v)
            preds[v].append(u)

    def _add_mem(self, table: Mapping[int, int], sign: int) -> None:
        mem = self._mem
        for d, b in table.items():
            mem[d] += sign * b

    def _add_transient(self, table: Mapping[int, int], sign: int) -> None:
        """Add (`sign` 1) or take out (-1) one op's transients (device -> bytes), keeping each device's
        largest in `_tmax`."""
        for d, b in table.items():
            counts = self._trans[d]
            n = counts.get(b, 0) + sign
            if n:
                counts[b] = n
            else:
                del counts[b]
            if sign > 0:
                self._tmax[d] = max(self._tmax[d], b)
            elif not n and b == self._tmax[d]:
                self._tmax[d] = max(counts, default=0)

    def _edge_plan(self, e: int) -> EdgePlan:
        edge = self.flow.edges[e]
        return self.planner.edge_plan(e, self._configs[edge.src], self._configs[edge.dst])

    def _param_plan(self, u: int) -> ParamPlan:
        return self.planner.param_plan(u, [self._configs[i] for i in self.flow.units[u]])

    def _new_tasks(self, durs: list[int], keys: list[int], res: list[tuple[int, ...]], cat: int,
                   nbytes: list[int] | None = None) -> list[int]:
        t0 = len(self._dur)
        n = len(durs)
        self._dur += durs
        self._key += keys
        assert t0 + n < 1 << _TID_BITS, "too many tasks"
        self._kt += [(k << _TID_BITS) | t for t, k in enumerate(keys, t0)]
        self._res += res
        self._cat += [cat] * n
        self._nbytes += nbytes if nbytes is not None else [0] * n
        self._preds += [[] for _ in range(n)]
        self._succs += [[] for _ in range(n)]
        self._alive += [True] * n
        self._end += [0] * n
        self._rk += [_NEW] * n
        busy = self._busy
        for d, rs in zip(durs, res, strict=True):
            for x in rs:
                busy[x] += d
        return list(range(t0, t0 + n))

    def _add_step_ends(self, links: list[Link]) -> None:
        """The step end of every simulated device (task id = device) and, under loss scaling, the overflow
        check after them all (`simulator.taskgraph`'s docstring); `_update_after`: per device, the task its
        updates wait for."""
        n, keys = self._num_ends, self.keys
        self._new_tasks([0] * n, [keys.step_end(d) for d in range(n)], [()] * n, STEP_END)
        self._update_after = list(range(n))
        if self.setup.loss_scaling:
            _, ns = self.comm.collective(tuple(range(self.num_devices)), 4)  # one float32 flag, every rank
            (check,) = self._new_tasks([ns], [keys.overflow_check()], [()], SYNC)
            links += [(d, check) for d in range(n)]
            self._update_after = [check] * n

    def _add_op_unit(self, i: int, links: list[Link]) -> _Unit:
        plan = self._plans[i]
        dev = plan.devices
        res = [(d,) for d in dev]
        fwd = self._new_tasks(plan.fwd_ns, plan.fwd_keys, res[:len(plan.fwd_ns)], FWD) if plan.fwd_ns else []
        bwd = self._new_tasks(plan.bwd_ns, plan.bwd_keys, res[:len(plan.bwd_ns)], BWD) if plan.bwd_ns else []
        mine = list(zip(fwd, bwd, strict=False))
        # the device's step end waits for each part's last pass: a forward without a backward, and a
        # backward that passes no gradient on (the edges link the others that need it, `_add_pass`)
        sink = not any(self.flow.grad_inputs[i])
        mine += [(t, dev[c]) for c, t in enumerate(bwd + fwd[len(bwd):]) if sink or c >= len(bwd)]
        for p, c in plan.carries:  # a chunk after the chunk whose state it starts from; backward back
            mine += [(fwd[p], fwd[c])] + ([(bwd[c], bwd[p])] if bwd else [])
        tids = fwd + bwd
        carry = None
        if plan.carry_xfers:  # the same, through the state's transfer between their devices
            xfers = [x[2] for x in plan.carry_xfers] + [x[3] for x in plan.carry_xfers if x[3] is not None]
            new = self._new_tasks([x.ns for x in xfers], [x.key for x in xfers], [x.resources for x in xfers], XFER,
                                  [x.nbytes for x in xfers])
            tids += new
            carry = {}
            n = len(plan.carry_xfers)
            for k, (p, c, _, back) in enumerate(plan.carry_xfers):
                mine += [(fwd[p], new[k]), (new[k], fwd[c]), (new[k], dev[p])]  # (the sender's step end)
                if back is not None:
                    mine += [(bwd[c], new[n + k]), (new[n + k], bwd[p]), (new[n + k], dev[c])]
                carry[c] = (new[k], new[n + k] if back is not None else None)
        links += mine
        return _Unit(tids, mine, fwd, bwd, carry=carry)

    def _add_update_unit(self, u: int, links: list[Link]) -> _Unit | None:
        plan = self._params[u]
        if not plan.updates:
            return None
        tids = self._new_tasks([x.ns for x in plan.updates], [x.key for x in plan.updates],
                               [(x.device,) for x in plan.updates], UPDATE)
        after = self._update_after
        mine = [(after[x.device], t) for x, t in zip(plan.updates, tids, strict=True)]
        links += mine
        return _Unit(tids, mine, by_device={x.device: t for x, t in zip(plan.updates, tids, strict=True)})

    def _add_edge_unit(self, e: int, links: list[Link]) -> _Unit:
        edge = self.flow.edges[e]
        ep = self._edge_plan(e)
        prod, cons = self._op_units[edge.src], self._op_units[edge.dst]
        mine: list[Link] = []
        tids: list[int] = []
        fwd = self._add_pass(ep.fwd_dep, ep.fwd_xfer, ep.fwd_reduce, prod.fwd, cons.fwd, mine, tids, False)
        bwd = []
        if edge.grad:
            bwd = self._add_pass(ep.bwd_dep, ep.bwd_xfer, ep.bwd_reduce, cons.bwd, prod.bwd, mine, tids, True)
        links += mine
        return _Unit(tids, mine, fwd, bwd, step=ep.step)

    def _add_pass(self, deps: list[tuple[int, int]], xfers: list[Exchange], reduces: list[Reduce],
                  src: list[int], dst: list[int], mine: list[Link], tids: list[int], ends: bool) -> list[int]:
        """The tasks and data edges of one pass of an edge, from the tasks `src` of the sending parts to
        the tasks `dst` of the receiving parts (a reduce task, where there is one, stands before its
        part's task and receives in its place): each exchange (one per consumer round) after the parts
        that send its pieces and before those that receive them, and before its senders' step ends.
        `ends` (the backward pass): a sending part that neither sends in an exchange nor feeds a part on
        its own device (either way it reaches its step end through them) links to its step end, so
        that each backward task reaches its device's step end with about one edge per device and
        step, not one per task. Returns the exchange tasks."""
        target = dst
        if reduces:
            target = list(dst)
            red = self._new_tasks([r.ns for r in reduces], [r.key for r in reduces], [(r.device,) for r in reduces],
                                  REDUCE)
            tids += red
            for r, t in zip(reduces, red, strict=True):
                mine.append((t, dst[r.part]))
                target[r.part] = t
        if src:
            mine += [(src[p], target[c]) for p, c in deps]
            if ends:
                reached = {p for p, _ in deps}.union(*(xfer.senders for xfer in xfers))
                mine += [(t, self._res[t][0]) for p, t in enumerate(src) if p not in reached]
        if not xfers:
            return []
        new = self._new_tasks([x.ns for x in xfers], [x.key for x in xfers], [x.resources for x in xfers], XFER,
                              [x.nbytes for x in xfers])
        tids += new
        res = self._res
        for xfer, t in zip(xfers, new, strict=True):
            if src:
                mine += [(src[p], t) for p in xfer.senders]
                mine += [(t, d) for d in {res[src[p]][0] for p in xfer.senders}]  # the senders' step ends
            mine += [(t, target[c]) for c in xfer.receivers]
        return new

    def _sync_figures(self, sid: SyncId, members: Mapping[int, SyncShare]) -> tuple[tuple[int, ...], int, int, int]:
        """(resources, ns, key, bytes on the wire) of an all-reduce with `members`."""
        group, bucket = sid
        nbytes = sum(share.nbytes for share in members.values())
        res, ns, key = self.planner.sync_task(group, bucket, nbytes)
        return res, ns, key, 2 * (len(group) - 1) * nbytes  # each device sends 2(n-1)/n of the buffer

    def _sync_links(self, u: int, tid: int, share: SyncShare) -> list[Link]:
        units = self._op_units
        return [(units[i].bwd[c], tid) for i, c in share.holders]

    def _new_sync(self, sid: SyncId, members: dict[int, SyncShare], links: list[Link]) -> _Sync:
        """A new all-reduce task with `members`, and its edges: from the parts of each member, to the step
        end of every device of its group (under replicas, of replica 0's: the others are not simulated)."""
        res, ns, key, wire = self._sync_figures(sid, members)
        (tid,) = self._new_tasks([ns], [key], [res], SYNC, [wire])
        mine = {u: self._sync_links(u, tid, members[u]) for u in sorted(members)}
        for group_links in mine.values():
            links += group_links
        links += [(tid, d) for d in sid[0] if d < self._num_ends]
        return _Sync(tid, members, mine)

    def _walk_rounds(self, changed: Iterable[int] | None = None) -> tuple[RoundWalk | None, list[Link], list[Link]]:
        """The round order's walk (`simulator.roundwalk`) of the state's configs and tasks, the edges of the
        last walk it cuts and those it adds; None (every edge cut) while every op runs in one round.
        `changed`: the op positions a proposal changed since the last walk (the walk goes again only from
        their items, and those of the ops their output edges feed); None: walked from scratch. Also sets
        the order's `soap.lowering.flight_savings` (`_flight`)."""
        old = self._walk if changed is not None else None
        if not self._rounds:
            self._flight = {}
            return None, [] if old is None else old.all_links(), []
        flow = self.flow
        steps = [plan.step for plan in self._plans]
        edges = [unit.step for unit in self._edge_units]
        order = self._step_order(steps, edges)
        self._flight = flight_savings(flow, steps, edges, order) if interleaves(self.setup) else {}
        if changed is not None:
            changed = set(changed)
            changed |= {flow.edges[e].dst for i in list(changed) for e in flow.out_edges[i]}
        dur, key = self._dur, self._key

        def unsorting(links: list[Link]) -> int:
            """How many of order edges `links` may break the invariant that the simulation processes tasks
            in increasing (ready, key): an order edge may go to a smaller key (an earlier op's later round),
            and a task of zero duration before it could then make both ready at once. Delta simulation
            replays the whole step while one may (`_unsorted`; rare: every real task takes time)."""
            return sum(1 for a, v in links if not dur[a] and key[a] > key[v])

        return walk_rounds(order, steps, edges, self._op_units, self._edge_units, flow, self._res, unsorting,
                           old, changed or ())

    def _step_order(self, steps: list[OpStep], edges: list[EdgeStep]) -> tuple[Item, ...]:
        """`soap.lowering.step_order`, remembered by what it reads: every op's rounds and carries, every
        edge's round pairs, and under 1F1B (a list schedule over the devices) every op's devices. A move
        that leaves them alone (most: an op of one round stays one round) finds the order made."""
        key = (tuple((s.rounds, s.carry_from) for s in steps), tuple(e.round_pairs for e in edges),
               tuple(s.devices for s in steps) if self.setup.schedule != "gpipe" else ())
        order = self._orders.get(key)
        if order is None:
            if len(self._orders) >= _ORDERS_KEPT:
                self._orders.clear()
            order = self._orders[key] = step_order(self.flow, steps, edges)
        return order

    # -- simulation ----------------------------------------------------------------------------------

    def _simulate_all(self) -> None:
        self._order: list[int] = []
        self._res_tids: list[list[int]] = [[] for _ in range(self.num_resources)]
        preds, kt = self._preds, self._kt
        indeg = list(map(len, preds))
        heap = [kt[t] for t, c in enumerate(indeg) if not c]
        heapify(heap)
        last_end = [0] * self.num_resources
        self._run(heap, indeg, [0] * len(preds), last_end, list(self._busy))
        self._iteration_ns = max(last_end)

    def _run(self, heap: list[int], indeg: list[int], rdy: list[int], last_end: list[int], left: list[int],
             limit: int = _NEW) -> int:
        """Kahn's algorithm from `heap` in priority order, (ready << _sh) | key-and-id (plain ints, so the
        heap compares one int per step): the hot loop of every simulation. `left`: per resource, the work
        of the tasks still to run on it. A resource runs one task at a time, so once a task on resource x
        ends at e, x ends no sooner than e + left[x]; when that exceeds `limit` (ns) the run stops and
        returns it (a lower bound on the step, above `limit`), else it runs to the end and returns 0."""
        sh = self._sh
        mask = (1 << _TID_BITS) - 1
        dur, kt, res, succs = self._dur, self._kt, self._res, self._succs
        end, rk, res_tids = self._end, self._rk, self._res_tids
        order_add = self._order.append
        while heap:
            prio = heappop(heap)
            t = prio & mask
            s = prio >> sh
            rs = res[t]
            d = dur[t]
            if len(rs) == 1:
                x = rs[0]
                if last_end[x] > s:
                    s = last_end[x]
                e = s + d
                last_end[x] = e
                res_tids[x].append(t)
                r = left[x] - d
                left[x] = r
                if e + r > limit:
                    return e + r
            else:
                for x in rs:
                    if last_end[x] > s:
                        s = last_end[x]
                e = s + d
                for x in rs:
                    last_end[x] = e
                    res_tids[x].append(t)
                    r = left[x] - d
                    left[x] = r
                    if e + r > limit:
                        return e + r
            end[t] = e
            rk[t] = prio
            order_add(t)
            for u in succs[t]:
                c = indeg[u]
                if c == 1:  # the last input: ready now
                    r = rdy[u]
                    heappush(heap, ((r if r > e else e) << sh) | kt[u])
                else:
                    indeg[u] = c - 1
                    if rdy[u] < e:
                        rdy[u] = e
        return 0

    # -- delta ---------------------------------------------------------------------------------------

    def _delta(self, items: list[tuple[int, ParallelConfig]]) -> None:
        """Change op position -> config `items` one by one (`_change`), update the round order's edges
        once, then re-time by one replay from the earliest point any of it can change (module docstring)."""
        old_len = len(self._dur)
        move = _Journal()
        move.steps = []
        move.old_len, move.busy = old_len, list(self._busy)
        k0 = _NEW
        links: list[Link] = []  # every edge the changes add
        for i, cfg in items:
            j = _Journal()
            k0 = min(k0, self._change(i, cfg, j, old_len))
            links += j.links
            move.steps.append(j)
        # the round order's edges: those that changed (edges of new tasks are all new)
        move.walk, move.unsorted, move.flight = self._walk, self._unsorted, self._flight
        self._walk, move.round_cut, move.links = self._walk_rounds(i for i, _ in items)
        if move.round_cut:
            k0 = self._unlink(move.round_cut, old_len, k0)
        if move.links:
            self._apply(move.links)
            links += move.links
        self._unsorted = self._walk is not None and self._walk.num_unsorting > 0
        # the earliest point anything can change: an old task with a new predecessor, a new task whose
        # predecessors are all old
        alive, end, rk, preds, sh, kt = self._alive, self._end, self._rk, self._preds, self._sh, self._kt
        for _, v in links:
            if v < old_len and rk[v] < k0:
                k0 = rk[v]
        for t in range(old_len, len(self._dur)):
            if not alive[t]:
                continue  # added by one change, taken out by a later one
            ready = 0
            for p in preds[t]:
                if p >= old_len:
                    break
                if end[p] > ready:
                    ready = end[p]
            else:
                c = (ready << sh) | kt[t]
                if c < k0:
                    k0 = c
        if move.unsorted:
            k0 = 0  # the old order may not be sorted by (ready, key): replay everything
        move.k0, move.replayed = k0, False  # the replay: `_settle`
        self._journal = move

    def _unlink(self, pairs: list[Link], old_len: int, k0: int) -> int:
        """Cut edges `pairs` where their ends live on; returns the smaller of `k0` and the earliest
        priority a cut target may now have (the replay starts no later): its old one, or its priority with
        the old predecessors it keeps (those that replay come before it anyway, and new ones replay; the
        others keep their ends). A kept predecessor that ends after `k0`'s ready time shows the target no
        earlier than `k0`: the scan stops there (a step end has a predecessor per task of its device)."""
        alive, preds, succs, rk, end, sh, kt = (self._alive, self._preds, self._succs, self._rk, self._end, self._sh,
                                               self._kt)
        for a, v in pairs:
            if alive[a]:
                succs[a].remove(v)
            if alive[v]:
                preds[v].remove(a)
                if rk[v] < k0:
                    k0 = rk[v]
                late = k0 >> sh
                ready = 0
                for p in preds[v]:
                    if p < old_len and alive[p] and end[p] > ready:
                        ready = end[p]
                        if ready > late:
                            break
                else:
                    c = (ready << sh) | kt[v]
                    if c < k0:
                        k0 = c
        return k0

    def _change(self, i: int, cfg: ParallelConfig, j: _Journal, old_len: int) -> int:
        """Replace op `i`'s units (its tasks, the exchanges of its edges, its parameter unit's updates) and
        edit its all-reduces for config `cfg`, recording in `j` what `_undo_change` needs; returns the
        earliest old priority that changed (old: before the first change of the proposal, `old_len` tasks)."""
        flow = self.flow
        u = flow.unit[i]
        old_plan = self._plans[i]
        edges = flow.in_edges[i] + flow.out_edges[i]
        j.op, j.cfg, j.plan, j.old_len = i, self._configs[i], old_plan, len(self._dur)
        j.params = self._params[u] if u >= 0 else None
        j.mem, j.moved, j.iteration, j.dead = list(self._mem), self._moved, self._iteration_ns, self._dead
        j.rounds = self._rounds
        self._configs[i] = cfg
        new_plan = self.planner.op_plan(i, cfg)
        new_params = self._param_plan(u) if u >= 0 else None
        self._configs[i] = j.cfg
        sids = sorted(set(j.params.sync if j.params else ()) | set(new_params.sync if new_params else ()))
        alive, rk, preds, succs = self._alive, self._rk, self._preds, self._succs
        self._account(old_plan, j.params, edges, sids, -1)
        # 1. take out the op's units (tasks die; edges to surviving tasks are cut)
        removed = [("op", i, self._op_units[i])]
        if u >= 0:
            removed.append(("update", u, self._update_units[u]))
        removed += [("edge", e, self._edge_units[e]) for e in edges]
        removed = [r for r in removed if r[2] is not None]
        k0 = _NEW
        gone: set[int] = set()
        busy, dur, res = self._busy, self._dur, self._res
        for _, _, unit in removed:
            for t in unit.tids:
                alive[t] = False
                for x in res[t]:
                    busy[x] -= dur[t]
                if rk[t] < k0:
                    k0 = rk[t]
            gone.update(unit.tids)
        for _, _, unit in removed:
            k0 = self._unlink(unit.links, old_len, k0)
        # the all-reduces the unit takes part in: edited in place (its edges out, its new ones in below)
        synced: list[_SyncEdit] = []
        cut: list[Link] = []  # edges from surviving tasks into an edited all-reduce
        ended: list[Link] = []  # edges from a removed all-reduce to the step ends
        for sid in sids:
            sync = self._syncs.get(sid)
            if sync is None:
                continue
            t = sync.tid
            synced.append(_SyncEdit(sid, sync, preds[t], succs[t], self._dur[t], self._nbytes[t], dict(sync.members),
                                    dict(sync.links)))
            if rk[t] < k0:
                k0 = rk[t]
            # new list objects: the journal keeps the old ones for `reject`
            preds[t] = [p for p in preds[t] if alive[p]]
            succs[t] = [v for v in succs[t] if alive[v]]
            sync.members.pop(u, None)
            for a, v in sync.links.pop(u, ()):
                # the unit's other ops keep their tasks: cut their edges into the all-reduce by hand
                if v == t and alive[a]:
                    preds[t].remove(a)
                    succs[a].remove(t)
                    cut.append((a, t))
            if not sync.members and sid not in new_params.sync:
                alive[t] = False
                for x in res[t]:
                    busy[x] -= dur[t]
                gone.add(t)
                del self._syncs[sid]
                for v in succs[t]:  # the step ends it fed (its own lists come back whole on `reject`)
                    preds[v].remove(t)
                    ended.append((t, v))
        self._dead += len(gone)
        j.removed, j.gone, j.synced, j.cut, j.ended = removed, gone, synced, cut, ended
        # 2. put in the new units
        self._configs[i] = cfg
        self._plans[i] = new_plan
        self._rounds += (new_plan.step.num_rounds > 1) - (old_plan.step.num_rounds > 1)
        links: list[Link] = []
        added = [("op", i, self._add_op_unit(i, links))]
        self._op_units[i] = added[0][2]
        if u >= 0:
            self._params[u] = new_params
            self._update_units[u] = self._add_update_unit(u, links)
            if self._update_units[u] is not None:
                added.append(("update", u, self._update_units[u]))
        for e in edges:
            self._edge_units[e] = self._add_edge_unit(e, links)
            added.append(("edge", e, self._edge_units[e]))
        new_syncs = []
        for sid, share in (new_params.sync.items() if new_params else ()):
            sync = self._syncs.get(sid)
            if sync is None:
                sync = self._syncs[sid] = self._new_sync(sid, {u: share}, links)
                new_syncs.append(sid)
            else:
                sync.members[u] = share
                sync.links[u] = self._sync_links(u, sync.tid, share)
                links += sync.links[u]
        for edit in synced:
            if edit.sync.members:  # duration and bytes follow the membership (the key and the group do not)
                _, ns, _, wire = self._sync_figures(edit.sid, edit.sync.members)
                for x in res[edit.sync.tid]:
                    busy[x] += ns - dur[edit.sync.tid]
                self._dur[edit.sync.tid] = ns
                self._nbytes[edit.sync.tid] = wire
        j.added, j.links, j.new_syncs = added, links, new_syncs
        self._apply(links)
        self._account(new_plan, new_params, edges, sids, 1)
        return k0

    def _account(self, plan: OpPlan, params: ParamPlan | None, edges: list[int], sids: list[SyncId],
                 sign: int) -> None:
        """Add (`sign` 1) or take out (-1) the memory and bytes of an op's units and its unit's all-reduces."""
        copies = sign * (1 if self.replicas is None else self.replicas.count)  # (bytes of every replica)
        self._add_mem(plan.mem, sign)
        self._add_transient(plan.transient, sign)
        self._moved += copies * plan.moved
        if params is not None:
            self._add_mem(params.mem, sign)
        for e in edges:
            ep = self._edge_plan(e)
            self._add_mem(ep.recv, sign)
            self._moved += copies * ep.moved
        for sid in sids:
            sync = self._syncs.get(sid)
            if sync is not None:
                self._moved += sign * self._nbytes[sync.tid]

    def _replay(self, k0: int, old_len: int, j: _Journal, limit: int = _NEW) -> int:
        """Re-simulate every task at or after `k0` (old order) plus the new ones (module docstring).

        The old times and order are kept whole for `reject` (list copies are cheap next to the replay).
        Counting the predecessors a suffix task still waits for scans the successors of the prefix, the
        shorter side of the cut. Returns 0, or, where the replay shows the step longer than `limit` ns
        before its end, the lower bound that shows it (`_run`), with the times and order as they were
        before the replay (`j` not replayed)."""
        order, rk, end, alive, preds, succs = self._order, self._rk, self._end, self._alive, self._preds, self._succs
        dur, res = self._dur, self._res
        rk_of = rk.__getitem__
        pos = bisect_left(order, k0, key=rk_of)
        j.order, j.end, j.rk = order, end[:old_len], rk[:old_len]
        self._order = order[:pos]
        # the resources' state at the cut, and the work each has left after it (every task taken out by
        # the proposal comes after the cut: the cut is no later than its old place)
        last_end = [0] * self.num_resources
        left = [0] * self.num_resources
        cuts = []
        res_tails = []
        for x, lst in enumerate(self._res_tids):
            c = bisect_left(lst, k0, key=rk_of)
            cuts.append(c)
            if c < len(lst):
                tail = lst[c:]
                res_tails.append((x, tail))
                left[x] = sum([dur[t] for t in tail if alive[t]])
                del lst[c:]
            if c:
                last_end[x] = end[lst[c - 1]]
        j.cuts, j.res_tails = cuts, res_tails
        n = len(dur)
        new = [t for t in range(old_len, n) if alive[t]]
        for t in new:
            for x in res[t]:
                left[x] += dur[t]
        indeg = list(map(len, preds))
        rdy = [0] * n
        sh, kt = self._sh, self._kt
        heap = []
        for t in self._order:
            e = end[t]
            for u in succs[t]:
                if rk[u] >= k0:
                    c = indeg[u] - 1
                    indeg[u] = c
                    if rdy[u] < e:
                        rdy[u] = e
                    if not c:
                        heap.append(u)
        # tasks without predecessors have ready time 0: after the cut only new ones, unless it is at time 0
        sources = new if k0 >> sh else [t for t in order[pos:] if alive[t]] + new
        heap += [t for t in sources if not preds[t]]
        heap = [(rdy[t] << sh) | kt[t] for t in heap]
        heapify(heap)
        stopped = self._run(heap, indeg, rdy, last_end, left, limit)
        if stopped:
            self._restore_times(j, n - old_len)
            return stopped
        self._iteration_ns = max(last_end)
        killed = sum(t < old_len for step in j.steps for t in step.gone)  # old tasks the proposal took out
        assert len(self._order) == len(order) - killed + len(new), "a task of the suffix was never ready"
        return 0

    def _restore_times(self, j: _Journal, num_new: int) -> None:
        """The times and order from before the replay of proposal `j`; the `num_new` tasks it added (still
        there) back to not simulated."""
        self._end, self._rk, self._order = j.end + [0] * num_new, j.rk + [_NEW] * num_new, j.order
        res_tids = self._res_tids
        for x, c in enumerate(j.cuts):
            del res_tids[x][c:]
        for x, tail in j.res_tails:
            res_tids[x] += tail

    def _undo(self, j: _Journal) -> None:
        """Restore the state before proposal `j`: its round order's edges, each change (the last first),
        the old times and order."""
        succs, preds, alive = self._succs, self._preds, self._alive
        for a, v in j.links:
            succs[a].remove(v)
            preds[v].remove(a)
        for a, v in j.round_cut:
            if alive[a]:
                succs[a].append(v)
            if alive[v]:
                preds[v].append(a)
        self._walk, self._unsorted, self._flight = j.walk, j.unsorted, j.flight
        for step in reversed(j.steps):
            self._undo_change(step)
        self._busy = j.busy
        if not j.replayed:  # times and order never changed: only the new tasks' entries go
            del self._end[j.old_len:]
            del self._rk[j.old_len:]
            return
        self._restore_times(j, 0)

    def _undo_change(self, j: _Journal) -> None:
        """Undo one `_change` (the proposal's later changes undone already)."""
        old_len = j.old_len
        succs, preds, alive = self._succs, self._preds, self._alive
        kept = {edit.sync.tid for edit in j.synced}  # their edge lists come back whole below
        for a, v in j.links:
            if a < old_len and a not in kept:
                succs[a].remove(v)
            if v < old_len and v not in kept:
                preds[v].remove(a)
        for lst in (self._dur, self._key, self._kt, self._res, self._cat, self._nbytes, self._preds, self._succs,
                    self._alive):
            del lst[old_len:]
        gone = j.gone
        for t in gone:
            alive[t] = True
        for _, _, unit in j.removed:
            for a, v in unit.links:
                if a not in gone:
                    succs[a].append(v)
                if v not in gone:
                    preds[v].append(a)
        for a, t in j.cut:  # the all-reduce's own lists come back whole below
            succs[a].append(t)
        for t, v in j.ended:
            preds[v].append(t)
        self._rounds = j.rounds
        for sid in j.new_syncs:
            del self._syncs[sid]
        for edit in j.synced:
            t = edit.sync.tid
            preds[t], succs[t] = edit.preds, edit.succs
            self._dur[t], self._nbytes[t] = edit.dur, edit.nbytes
            edit.sync.members, edit.sync.links = edit.members, edit.links
            self._syncs[edit.sid] = edit.sync
        u = self.flow.unit[j.op]
        if u >= 0:
            self._update_units[u] = None
            self._params[u] = j.params
        for kind, ident, unit in j.removed:
            if kind == "op":
                self._op_units[ident] = unit
            elif kind == "update":
                self._update_units[ident] = unit
            else:
                self._edge_units[ident] = unit
        self._configs[j.op] = j.cfg
        self._add_transient(self._plans[j.op].transient, -1)
        self._add_transient(j.plan.transient, 1)
        self._plans[j.op] = j.plan
        self._mem = j.mem
        self._moved = j.moved
        self._iteration_ns = j.iteration
        self._dead = j.dead

    # -- critical path -------------------------------------------------------------------------------

    def _critical_path(self) -> list[int]:
        """From the last task to end (largest (end, key)) back to time 0, each step to an input (data
        predecessor or previous task on a resource) that ended exactly at the start; ties to the larger
        key. Last task first."""
        order = self._order
        if not order:
            return []
        end, dur, key, rk = self._end, self._dur, self._key, self._rk
        t = max(order, key=lambda u: (end[u], key[u]))
        path = [t]
        while end[t] - dur[t] > 0:
            s = end[t] - dur[t]
            best = -1
            for p in self._preds[t]:
                if end[p] == s and (best < 0 or key[p] > key[best]):
                    best = p
            for x in self._res[t]:
                lst = self._res_tids[x]
                idx = lst.index(t) if self._unsorted else bisect_left(lst, rk[t], key=rk.__getitem__)
                if idx:
                    q = lst[idx - 1]
                    if end[q] == s and (best < 0 or key[q] > key[best]):
                        best = q
            assert best >= 0, "a task started late with nothing to wait for"
            t = best
            path.append(t)
        return path


def simulate(graph: OperatorGraph, strategy: Strategy, topology: DeviceTopology,
             cost_model: CostModel | None = None, *, setup: TrainSetup | None = None,
             symmetry: bool = True) -> Timeline:
    """Simulate one training iteration of `graph` under `strategy` on `topology` (analytical costs and the
    default `TrainSetup` unless given).

    With `symmetry`, a strategy made of R identical replicas (`soap.lowering.find_replicas`: data
    parallelism, `hybrid:tp=T` and the like) is simulated by its replica 0 alone where that is exact
    (`Simulator._check_replicas`), with the same iteration time, per-device memory and bytes moved as
    the whole; the timeline's tasks are then replica 0's (`Timeline.replicas` says R)."""
    return simulator_of(graph, strategy, topology, cost_model, setup=setup, symmetry=symmetry)[1]


def simulator_of(graph: OperatorGraph, strategy: Strategy, topology: DeviceTopology,
                 cost_model: CostModel | None = None, *, setup: TrainSetup | None = None,
                 symmetry: bool = True) -> tuple[Simulator, Timeline]:
    """`simulate`, with the `Simulator` that ran it (of one replica where `Timeline.replicas` > 1)."""
    validate_strategy(graph, strategy, topology.num_devices)
    replicas = find_replicas(graph, strategy, topology.num_devices) if symmetry else None
    if replicas is not None:
        sim = Simulator(graph, topology, cost_model, setup=setup, replicas=replicas)
        try:
            return sim, sim.full(strategy, validated=True)
        except NotReplicable:
            pass
    sim = Simulator(graph, topology, cost_model, setup=setup)
    return sim, sim.full(strategy, validated=True)


__all__ = ["BWD", "FWD", "REDUCE", "SYNC", "Simulator", "UPDATE", "XFER", "simulate", "simulator_of"]
