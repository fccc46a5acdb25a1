"""What the search needs from the simulator: the cost of a strategy, and of a one-op change to it.

Owns `Cost` (simulated iteration time plus memory feasibility), the `Evaluator` protocol the MCMC chains
drive (`start` a strategy, `propose` one op's new config, then `accept` or `reject` it), and
`SimulatorEvaluators`, the picklable factory that builds evaluators on the simulator (`simulator/`), with
delta simulation (default) or with a full simulation per proposal (to measure what delta buys). The
factory carries the caller's training setup (`soap.setup.TrainSetup`) to every `Simulator` it builds, in
this process or in the search's worker processes.

Tests plug in their own evaluators (a fixed-cost model makes chains hand-checkable). Must not import
torch, the runtime or soapflow.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from simulator.engine import Simulator
from soap.config import ParallelConfig
from soap.graph import OperatorGraph
from soap.lowering import Replicas
from soap.setup import TrainSetup
from soap.strategy import Strategy
from soap.topology import DeviceTopology


@dataclass(frozen=True, slots=True, kw_only=True)
class Cost:
    """The simulated cost of one strategy.

    `time_ms` is the simulated iteration time; `peak_memory_bytes` the largest per-device peak, and
    `memory_excess_bytes` the largest amount by which a device's peak exceeds its capacity (0 when the
    strategy fits: `feasible`). Not `exact`: `time_ms` is only a lower bound, the proposal having been
    decided without timing it (`DeltaEvaluator.propose_many`).
    """

    time_ms: float
    feasible: bool = True
    peak_memory_bytes: float = 0.0
    memory_excess_bytes: float = 0.0
    exact: bool = True

    def __post_init__(self) -> None:
        if not self.time_ms >= 0:
            raise ValueError(f"time_ms must be >= 0, got {self.time_ms}")
        if self.feasible and self.memory_excess_bytes > 0:
            raise ValueError(f"a feasible cost cannot exceed memory by {self.memory_excess_bytes} bytes")

    @property
    def value(self) -> float:
        """The search objective: the iteration time, infinite when the strategy does not fit in memory."""
        return self.time_ms if self.feasible else math.inf


class Evaluator(Protocol):
    """Costs a current strategy and one-op changes to it (delta simulation where the simulator has it).

    After `start`, each `propose` must be followed by exactly one `accept` (the change becomes current)
    or `reject` (the current strategy stays).
    """

    def start(self, strategy: Strategy) -> Cost: ...

    def propose(self, op: str, cfg: ParallelConfig) -> Cost: ...

    def accept(self) -> None: ...

    def reject(self) -> None: ...


class EvaluatorFactory(Protocol):
    """Builds one evaluator per chain; must pickle (chains run in worker processes with `jobs` > 1). A
    search of replicas (`search.mcmc.search`'s `replicas`) asks for evaluators of one replica by passing
    `replicas`; a factory that cannot simulate that way need not take it. One that can says so with a true
    `simulates_replicas` attribute: a search of every strategy then may search replicas first (its replica
    phase)."""

    def __call__(self, graph: OperatorGraph, topology: DeviceTopology, **kwargs: Any) -> Evaluator: ...


class FullEvaluator:
    """An `Evaluator` over any full-strategy cost function: every proposal is costed from scratch."""

    def __init__(self, cost_of: Any):
        self._cost_of = cost_of
        self._current: Strategy | None = None
        self._pending: Strategy | None = None

    def start(self, strategy: Strategy) -> Cost:
        self._current, self._pending = strategy, None
        return self._cost_of(strategy)

    def propose(self, op: str, cfg: ParallelConfig) -> Cost:
        assert self._current is not None and self._pending is None, "propose needs start, then accept/reject"
        self._pending = self._current.with_config(op, cfg)
        return self._cost_of(self._pending)

    def accept(self) -> None:
        assert self._pending is not None
        self._current, self._pending = self._pending, None

    def reject(self) -> None:
        assert self._pending is not None
        self._pending = None


# On an evaluator without `propose_many`, a move over more ops than this is costed by one full simulation
# (`start`) rather than op by op: each op's proposal re-times everything after it.
MAX_DELTA_OPS = 2
# On a `DeltaEvaluator`, a move over more than this share of the graph's ops is costed by a full simulation
# on its spare simulator: replacing that many ops' tasks one by one costs more than building every task
# afresh (GPT-2 medium on a100-4x8, 540 ops: 537 ops changed took 1.1-2.7 s by delta against 0.9-1.6 s in
# full; 24 to 48 ops, 60-100 ms against 0.2-0.7 s).
WHOLE_SHARE = 0.25


class Move:
    """A proposal over one op or several (`search.moves`), pending on an evaluator started on `current`:
    its `cost`, then exactly one `accept()` (the changed strategy becomes the evaluator's current one) or
    `reject()` (`current` stays). On a `DeltaEvaluator` it is one delta simulation
    (`Simulator.propose_many`: every op's tasks replaced, one replay), or, over more than `WHOLE_SHARE`
    of the graph's ops, a full simulation on its spare simulator (`DeltaEvaluator.trial`: accepted, the
    spare becomes current; rejected, nothing is simulated again). On another evaluator, up to
    `MAX_DELTA_OPS` ops it is costed op by op (all but the last made current, the last proposed; a
    rejection undoes them op by op), beyond that by `start` of the changed strategy (rejected, a `start`
    of `current`)."""

    def __init__(self, evaluator: Evaluator, current: Strategy, changes: Mapping[str, ParallelConfig],
                 limit_ms: float = math.inf):
        """`limit_ms`: on a `DeltaEvaluator`, what the caller will reject anyway (a strategy that does not
        fit, or slower than `limit_ms`) may be costed inexactly (`DeltaEvaluator.propose_many`)."""
        assert changes, "a move changes at least one op"
        self._evaluator, self._current = evaluator, current
        self.strategy = current.with_configs(changes)
        delta = isinstance(evaluator, DeltaEvaluator)
        self._trial = delta and len(changes) > WHOLE_SHARE * len(evaluator.sim.graph)
        self._one = delta and not self._trial
        self._whole = not delta and len(changes) > MAX_DELTA_OPS
        if self._trial:
            self.cost = evaluator.trial(self.strategy, changes, limit_ms)
            return
        if self._one:
            self.cost = evaluator.propose_many(changes, limit_ms)
            return
        if self._whole:
            self.cost = evaluator.start(self.strategy)
            return
        *self._first, (last, last_cfg) = changes.items()
        for name, cfg in self._first:
            evaluator.propose(name, cfg)
            evaluator.accept()
        self.cost = evaluator.propose(last, last_cfg)

    def accept(self) -> None:
        if self._trial:
            self._evaluator.adopt()
        elif not self._whole:
            self._evaluator.accept()

    def reject(self) -> None:
        if self._trial:
            return  # the evaluator's current simulator never left `current`
        if self._one:
            self._evaluator.reject()
            return
        if self._whole:
            self._evaluator.start(self._current)
            return
        self._evaluator.reject()
        for name, _ in reversed(self._first):
            self._evaluator.propose(name, self._current[name])
            self._evaluator.accept()


def simulated_cost(sim: Simulator) -> Cost:
    """The `Cost` of the simulator's state (the pending proposal, if there is one)."""
    return Cost(time_ms=sim.iteration_time_ms, feasible=sim.feasible,
                peak_memory_bytes=float(max(sim.peak_memory_bytes, default=0)),
                memory_excess_bytes=float(sim.memory_excess_bytes))


class DeltaEvaluator:
    """An `Evaluator` on the simulator's delta simulation: a proposal re-times only what it changes;
    `propose_many` changes several ops in one proposal (one replay).

    `trial(strategy)` costs a whole strategy on a spare simulator (`Simulator.twin`, sharing the plan
    caches) while `sim` stays on the current one; `adopt()` makes the trial current (the two swap).

    A proposal (or trial) that does not fit in memory is known not to from the plans alone
    (`Simulator.peek_peaks`), so its tasks are made, and it is timed, only if it is accepted all the same
    (a search whose current strategy does not fit either accepts a smaller excess); so is a trial whose
    compute on one device alone is slower than the caller's limit (`Simulator.work_bound_ms`)."""

    def __init__(self, sim: Simulator):
        self.sim = sim
        self._spare: Simulator | None = None
        # a proposal, or a trial's strategy, decided from its plans: made (and timed) only if accepted
        self._unbuilt: Mapping[str, ParallelConfig] | None = None
        self._unbuilt_trial: Strategy | None = None

    def trial(self, strategy: Strategy, changes: Mapping[str, ParallelConfig] | None = None,
              limit_ms: float = math.inf) -> Cost:
        """The cost of `strategy`; `changes`: it is the current strategy with those changed (only they are
        validated, as by `propose_many`). Exact unless it does not fit, or (given `changes`) its compute on
        one device alone exceeds `limit_ms` (`Simulator.work_bound_ms`: its time that lower bound): both are
        known from the plans, and the strategy is built only if it is adopted all the same."""
        self._unbuilt = self._unbuilt_trial = None
        if self._spare is None:
            self._spare = self.sim.twin()
        sim = self.sim
        # decided from the current simulator's plans where its checks are the full build's (under
        # replicas, on a topology that repeats itself replica by replica: `Simulator.replica_refusal`)
        if changes is not None and (sim.replicas is None or not sim.replica_refusal()):
            peaks = sim.peek_peaks(changes)
            cost = _unfit_cost(sim, peaks)
            if cost is None and limit_ms < math.inf:
                bound = sim.work_bound_ms(changes)
                if bound > limit_ms:
                    cost = Cost(time_ms=bound, peak_memory_bytes=float(max(peaks)), exact=False)
            if cost is not None:
                self._unbuilt_trial = strategy
                return cost
        for name, cfg in (changes or {}).items():
            self._spare.check_config(name, cfg)
        self._spare.build(strategy, validated=changes is not None)
        return simulated_cost(self._spare)

    def adopt(self) -> None:
        assert self._spare is not None, "adopt needs a trial"
        if self._unbuilt_trial is not None:
            self._spare.build(self._unbuilt_trial, validated=True)
            self._unbuilt_trial = None
        self.sim, self._spare = self._spare, self.sim

    def start(self, strategy: Strategy) -> Cost:
        self.sim.build(strategy)
        return simulated_cost(self.sim)

    def propose(self, op: str, cfg: ParallelConfig) -> Cost:
        self.sim.propose(op, cfg)
        return simulated_cost(self.sim)

    def propose_many(self, changes: Mapping[str, ParallelConfig], limit_ms: float = math.inf) -> Cost:
        """The cost of changing every op of `changes` at once. Exact when the changed strategy fits and may
        be no slower than `limit_ms`; otherwise it is decided without timing anything and its cost is not
        `exact`: a strategy that does not fit, from the plans alone (its time 0: not timed; its tasks are
        made only if it is accepted all the same), or one whose work on one device or link alone exceeds
        `limit_ms` (`Simulator.time_bound_ms`: its time that lower bound; its replay runs only if it is
        accepted all the same). Else the replay runs, and stops as soon as it shows the step longer than
        `limit_ms` (`Simulator.time_within_ms`): the cost is then not `exact` either, its time a lower
        bound above `limit_ms`."""
        sim = self.sim
        self._unbuilt = self._unbuilt_trial = None
        cost = _unfit_cost(sim, sim.peek_peaks(changes))
        if cost is not None:
            self._unbuilt = changes
            return cost
        sim.propose_many(changes, lazy=True)
        bound = sim.time_bound_ms
        if bound <= limit_ms:
            bound, exact = sim.time_within_ms(limit_ms)
            if exact:
                return simulated_cost(sim)
        return Cost(time_ms=bound, peak_memory_bytes=float(max(sim.peak_memory_bytes)), exact=False)

    def accept(self) -> None:
        if self._unbuilt is not None:
            self.sim.propose_many(self._unbuilt, lazy=True)
            self._unbuilt = None
        self.sim.accept()

    def reject(self) -> None:
        if self._unbuilt is not None:
            self._unbuilt = None
            return
        self.sim.reject()


def _unfit_cost(sim: Simulator, peaks: tuple[int, ...]) -> Cost | None:
    """The cost of a strategy with per-device `peaks` that does not fit on `sim`'s devices (not timed:
    time 0, not `exact`); None where it fits."""
    excess = sim.excess_of(peaks)
    if not excess:
        return None
    return Cost(time_ms=0.0, feasible=False, peak_memory_bytes=float(max(peaks)), memory_excess_bytes=float(excess),
                exact=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulatorEvaluators:
    """The search's default `EvaluatorFactory`: one `Simulator` per chain, with delta simulation, or
    (`delta=False`) a full simulation of every proposal. `cost_model` and `setup` None are the
    simulator's defaults."""

    cost_model: Any = None
    delta: bool = True
    setup: TrainSetup | None = None
    simulates_replicas: ClassVar[bool] = True  # (`EvaluatorFactory`)

    def __call__(self, graph: OperatorGraph, topology: DeviceTopology, *,
                 replicas: Replicas | None = None) -> Evaluator:
        """`replicas`: a simulator of replica 0 of strategies made of those replicas (`Simulator`'s); its
        proposals raise `NotReplicable` where they leave them. `ValueError` (one line) where the topology
        does not repeat itself replica by replica (`Simulator.replica_refusal`)."""
        sim = Simulator(graph, topology, self.cost_model, setup=self.setup, replicas=replicas)
        refusal = sim.replica_refusal() if replicas is not None else ""
        if refusal:
            raise ValueError(f"no search of {replicas.count} replicas of {replicas.size} devices on "
                             f"{topology.name}: {refusal}")
        if self.delta:
            return DeltaEvaluator(sim)

        def full(strategy: Strategy) -> Cost:
            sim.full(strategy)
            return simulated_cost(sim)

        return FullEvaluator(full)
