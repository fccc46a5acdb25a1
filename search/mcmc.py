"""The strategy search: Metropolis-Hastings MCMC over strategies, as in FlexFlow (SysML 2019, section 5).

Owns `search` (the stage `search` of capture -> validate -> simulate -> search -> export -> execute), its
result `SearchResult`, `NoFeasibleStrategy`, the recomputing and expert-parallel chain starts
(`recompute_starts`, `expert_starts`), one Markov chain (`_Chain`) and the loop that steps a worker's
chains (`_run_chains`). The worker processes themselves are `search.workers`.

The method:

- target p(S) ∝ exp(-β·cost(S)), cost = simulated iteration time (ms), infinite when a device runs out of
  memory; a proposal is a move of `search.moves`: mostly a uniformly drawn op given a uniformly drawn
  valid config, or an eighth of the time its micro-batch count changed (devices repeated, rounds), or
  half the rest for an op with recompute or shard choices, its current layout with those redrawn, or
  for an op with a chunk dim (an LSTM's time steps) an eighth of the time its chunk count changed
  (`search.space`); and, beside those, moves over several ops that follow the model's
  structure (the same config for every copy of an op in repeated blocks, one block's layout for all the
  copies, a neighbour's layout for one op, an op's drawn layout for its neighbours too, one micro-batch
  count for a whole pipeline stage), each
  counted as one proposal (`search.evaluate.Move`: one delta simulation, or one full simulation over more
  than a quarter of the ops). A proposal S' is accepted with
  min(1, exp(β·(cost(S) - cost(S')))); one that does not fit in memory is always rejected. A chain whose
  current strategy does not fit (a random start) walks downhill on the memory excess until it fits, then
  follows the rule above. The rule is applied as a limit drawn before the proposal is costed (accept when
  cost(S') <= cost(S) - ln(u)/β, u uniform): a proposal that does not fit, or whose lower bound
  (`simulator.engine.Simulator.time_bound_ms`) exceeds the limit, is rejected without being timed, and
  the replay of one that is timed stops as soon as it shows the step longer than the limit
  (`Simulator.time_within_ms`).
- β = k / cost_ref with k = `beta_scale` (default 100) and cost_ref the best feasible baseline's time
  (else the chain's first feasible cost): a proposal 1% slower than the current strategy is accepted
  with probability e^-1 ≈ 0.37, 5% slower with e^-5 ≈ 0.007, whatever the model's time scale. Every
  chain uses the same β, so chains from different starts sample the same distribution.
- every baseline of `BASELINES` (dp, mp, tp, expert, fsdp; dp and fsdp skipped where they are not
  defined) is simulated first and the best of them seeds the running best, so the result is never worse
  than the best baseline. Chains start, in this order, from dp, expert, the best baseline when it is
  neither (when none fits, the one with the least memory excess), then, when no baseline fits (on more
  than one device), from the closest (`_closeness`: the fastest that fits, else the least memory
  excess) of the recomputing strategies of `recompute_starts` if it is closer than every baseline, so
  that a model that fits only with recomputation, sharded parameters and tensor parallelism has a
  chain that starts feasible or close to it. Those candidates are ``hybrid:tp=T,recompute=full`` and
  ``hybrid:tp=T,shard=S,recompute=full`` with S = devices / T (the parameters sharded over all
  data-parallel groups), for T = the devices of the smallest node and T = 1, then fsdp with full
  recomputation (``fsdp+recompute=full``); a spec whose tp, shard or batch does not divide is skipped.
  They are simulated in full after the baselines (those the time budget leaves time for), but are not
  baselines: they are not in `SearchResult.baselines`. Where a baseline fits, recomputation only costs
  time and the chains are as they were; a single chain from the candidates (not one each) keeps the
  other chains' shares of the proposal budget from thinning. A model with mixtures of experts
  (`experts` ops) also gets one chain from the closest of its expert-parallel layouts (`expert_starts`:
  ``hybrid:tp=1,ep=E`` with E the largest count above 1 dividing the devices of the smallest node and
  every experts op's experts, and ``hybrid:tp=1,ep=E,shard=S`` with S = devices / E; each also with full
  recomputation where no baseline fits), simulated likewise: splitting every layer's experts at once is
  a basin that single-op and tied moves from data parallelism rarely reach. Last come `random_chains`
  random strategies. A start equal to an earlier one is dropped.
- budgets: a time budget (`budget_s`, wall clock for the whole search, baselines included) and/or a
  proposal budget (`max_proposals`, split evenly over the chains). The search also stops early when it
  has made no progress for half the budget. Progress has one definition (`_closeness`): a strategy
  closer to the goal than any seen, where one that fits is closer than any that does not, one that
  fits is closer the faster it is and one that does not the smaller its memory excess. So while
  nothing known fits, a shrinking memory excess is progress; once something fits, only a faster
  fitting strategy is. Under a time budget the search stops when what it knows (the best baseline and
  the chains; with `jobs` > 1, what each worker knows) has made no progress for half the time budget;
  under a proposal budget, each chain stops when it has made no progress itself for half its
  proposals (per chain, so that the result does not depend on how chains are grouped into workers). A
  chain whose start would need a full simulation after the time budget is spent (large graphs on many
  devices) is not started.
- `jobs` > 1 runs the chains in that many worker processes (each chain whole in one worker; a worker
  steps its chains round-robin, as the search itself does with `jobs` 1). With a proposal budget only,
  the result depends on the seed alone, not on `jobs` or the machine's speed: each chain draws from its
  own `random.Random` seeded by (seed, chain name). A time budget makes the number of proposals, hence
  the result, depend on speed.
- a best strategy found by a chain is tidied before it is returned (`search.tidy`): ops whose layout
  matches none of their neighbours' take a neighbour's where the predicted time does not grow. Under a
  time budget, tidying tries no move after the budget's end or, when the chains used it all,
  `TIDY_SHARE` of the budget after they stopped (so a search takes at most about 1.1 times its
  budget); under a proposal budget alone it runs to the end (the result depends on the seed alone).
- `replicas` R: the chains search only strategies made of R identical replicas of devices / R devices
  each (`soap.lowering.repeats`; `search.space.ConfigSpace`'s `replicas`), and every chain's evaluator
  simulates one replica (`evaluators(..., replicas=...)`; `simulator.engine.Simulator`'s delta under
  replicas), a fraction of the tasks. The baselines are still simulated and still seed the best; a
  chain starts only from a start made of those replicas (dp, a reference of `hybrid:tp=T` with T within
  a replica, the recomputing starts likewise), the random chain draws its configs from that space, and
  a proposal the simulator refuses (`NotReplicable`: an exchange or all-reduce that would leave replica
  0) is rejected. The best is tidied within the replicas too.
- the replica phase: where no baseline fits (a model that fits only with recomputation or sharded
  parameters) a search of every strategy on more than one device first searches the strategies of one
  replica per device (`replicas` = the device count: data parallelism with each op's recomputation,
  sharding and micro-batches searched), with `REPLICA_PHASE_SHARE` of the budgets left after the starts
  (a time budget's seconds, or a proposal budget's proposals), and one more chain (``best of N
  replicas``) starts from that phase's best, after the recomputing one. Its proposals are many times
  cheaper (one device's tasks), so it finds the memory choices per op that such a model needs sooner
  than chains over every strategy do (GPT 1.7B on 32 A100s: `benchmarks/search_scale.py`); the chains
  after it may still leave its layouts (pipelines, tensor parallelism). The search hands the phase the
  costs of the references it simulated in full (`simulated`), so the phase simulates only its own starts
  (one replica each). Half, not less: with a third of a 30 s budget the phase found nothing that fits for
  ResNet-101 on k80-16x4 where half finds one (`benchmarks/search_quality.py`). The phase's chains are reported
  as ``N replicas: NAME``, its proposals and history come first in the result's (`SearchResult`'s
  `replica_phase` is N), and its best stands where the time left no chain to start from it. Off with
  `replica_phase=False`, where an evaluator factory cannot simulate replicas (`simulates_replicas`), or
  where it refuses one-device replicas on the topology (`Simulator.replica_refusal`: devices that differ in
  kind, speed or memory).
- every chain costs proposals with its own `Evaluator` (delta simulation: only the changed op's tasks
  are re-timed). Each baseline is simulated by an evaluator of its own; with `jobs` 1 a chain that
  starts from a baseline takes over that evaluator instead of simulating its start again.

Must not import torch, the runtime or soapflow.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import random
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from search.baselines import BASELINES, BaselineNotApplicable, fsdp, parse_baseline, recompute_full
from search.evaluate import Cost, Evaluator, EvaluatorFactory, Move
from search.moves import Moves
from search.space import ConfigSpace
from search.tidy import tidy
from search.workers import ChainSpec, Progress, WorkerJob, from_plain, run_workers, to_plain
from soap.graph import OperatorGraph
from soap.lowering import NotReplicable, Replicas
from soap.registry import dims_of
from soap.strategy import Strategy
from soap.topology import DeviceTopology

DEFAULT_BETA_SCALE = 100.0
REPLICA_PHASE_SHARE = 0.5  # of the budgets left after the starts, the replica phase's (module docstring)
TIDY_SHARE = 0.1  # of a time budget, the least tidying gets after the chains (module docstring)
PROGRESS_INTERVAL_S = 0.5


class NoFeasibleStrategy(ValueError):
    """No strategy the search saw fits in device memory; the message names the smallest need it saw."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChainReport:
    """One chain: where it started, the best it reached, how many proposals it made and accepted, and how
    many of them changed nothing (`num_null`: a move that drew the current configs, or configs outside the
    space; accepted without a simulation, and counted among the proposals)."""

    name: str
    start_ms: float  # inf when the start does not fit in memory
    best_ms: float
    num_proposals: int
    num_accepted: int
    stop: str  # proposals, time, stalled, "not started: time" (the time budget was spent before its start)
    num_null: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchResult:
    """The best strategy and how the search got there.

    `baselines` maps every baseline name to its `Cost`, or None where the baseline is not defined for the
    graph (`baseline_errors` says why). `history` lists [proposal index, elapsed_s, best_ms] each time the
    best improved, starting with the best baseline at index 0; with `jobs` > 1 the index counts all
    workers' proposals, the others' interpolated from their rates.
    """

    best: Strategy
    best_cost: Cost
    best_source: str
    baselines: Mapping[str, Cost | None]
    baseline_errors: Mapping[str, str]
    chains: tuple[ChainReport, ...]
    num_proposals: int
    elapsed_s: float
    search_s: float
    beta_per_ms: float
    history: tuple[tuple[int, float, float], ...]
    replicas: int = 1  # the chains searched strategies of this many replicas (`search`'s `replicas`)
    replica_phase: int = 0  # replicas of the replica phase that came first (module docstring), 0: none
    replica_phase_proposals: int = 0  # of `num_proposals`, the replica phase's

    @property
    def proposals_per_s(self) -> float:
        return self.num_proposals / self.search_s if self.search_s > 0 else 0.0

    @property
    def costed_per_s(self) -> float:
        """Proposals per second that changed the strategy (`ChainReport.num_null` left out)."""
        costed = self.num_proposals - sum(c.num_null for c in self.chains)
        return costed / self.search_s if self.search_s > 0 else 0.0

    def baseline_ms(self) -> dict[str, float | None]:
        """Baseline name -> simulated iteration time, None where not applicable or out of memory."""
        return {name: (c.time_ms if c is not None and c.feasible else None)
                for name, c in self.baselines.items()}


# ---------------------------------------------------------------------------------------------- one chain


class _Chain:
    """One Markov chain: its current strategy and cost (mirrored in its evaluator), its best, its stats."""

    def __init__(self, name: str, start: Strategy, evaluator: Evaluator, moves: Moves,
                 rng: random.Random, beta_per_ms: float, beta_scale: float, max_proposals: int | None,
                 start_cost: Cost | None = None):
        """`start_cost` given: `evaluator` has already been started on `start` (and costed it so)."""
        self.name, self.evaluator, self.moves, self.rng = name, evaluator, moves, rng
        self.max_proposals = max_proposals
        self.current = start
        self.cost = start_cost if start_cost is not None else evaluator.start(start)
        self.start_cost = self.cost
        self.best, self.best_cost = start, self.cost
        # β comes from the best baseline; without a feasible one, from the chain's first feasible cost
        self.beta_scale = beta_scale
        self.beta = beta_per_ms
        if self.beta == 0.0 and self.cost.feasible:
            self.beta = _beta_per_ms(beta_scale, self.cost.time_ms)
        self.num_proposals = self.num_accepted = self.num_null = 0
        self.closest = _closeness(self.cost)  # the closest the chain has been to the goal
        self.progressed_at = 0  # proposal count when `closest` last dropped
        self.min_peak = (self.cost.peak_memory_bytes, name)
        self.stop = ""

    def step(self) -> bool:
        """Make one proposal (a move of `search.moves`, over one op or several); True when the chain made
        progress (`_closeness` of what it accepted dropped below the closest it had been)."""
        changes = self.moves.propose(self.rng, self.current)
        self.num_proposals += 1
        if not changes:
            self.num_null += 1
            return False  # the null move: accepted, nothing to simulate
        limit = self._limit()
        try:
            move = Move(self.evaluator, self.current, changes, limit)
        except NotReplicable:
            return False  # the replicas' simulator leaves out what they do not make: rejected, unchanged
        cost = move.cost
        if cost.peak_memory_bytes < self.min_peak[0]:
            self.min_peak = (cost.peak_memory_bytes, self.name)
        if not self._accept(cost, limit):
            move.reject()
            return False
        move.accept()
        self.current, self.cost = move.strategy, cost
        self.num_accepted += 1
        if cost.value < self.best_cost.value:
            self.best, self.best_cost = self.current, cost
        if _closeness(cost) < self.closest:
            self.closest, self.progressed_at = _closeness(cost), self.num_proposals
            return True
        return False

    def _limit(self) -> float:
        """The slowest time a proposal from a current strategy that fits may have and be accepted, drawn
        before the proposal is costed: Metropolis accepts a change of Δ ms with probability
        min(1, exp(-β Δ)), i.e. when Δ <= -ln(u) / β for u uniform in [0, 1). Knowing it first lets the
        evaluator skip timing a proposal whose lower bound already exceeds it. Infinite while the current
        strategy does not fit (time does not decide then) or β is 0."""
        if not self.cost.feasible or self.beta == 0.0:
            return math.inf
        u = self.rng.random()
        return self.cost.time_ms - math.log(u) / self.beta if u > 0 else math.inf

    def _accept(self, new: Cost, limit: float) -> bool:
        cur = self.cost
        if not cur.feasible:
            if new.feasible:
                if self.beta == 0.0:
                    self.beta = _beta_per_ms(self.beta_scale, new.time_ms)
                return True
            return new.memory_excess_bytes <= cur.memory_excess_bytes
        if not new.feasible:
            return False
        return new.time_ms <= limit


def _beta_per_ms(beta_scale: float, cost_ref_ms: float) -> float:
    return beta_scale / cost_ref_ms if cost_ref_ms > 0 else 0.0


def _closeness(cost: Cost) -> tuple[int, float]:
    """How far `cost` is from the goal, lower is closer: a strategy that fits by its time (ms), before any
    that does not, by its memory excess (bytes). The search's one definition of progress, for both early
    stops: a new low of the closeness seen, per chain under a proposal budget, per worker under a time
    budget."""
    return (0, cost.time_ms) if cost.feasible else (1, cost.memory_excess_bytes)


# ----------------------------------------------------------------------------------- running the chains


# At its default thresholds (700, 10, 10) Python's cycle collector runs a young collection every 700
# allocations and, every hundred of those (as the long-lived objects grow by a quarter), a full one over
# every live object, the chains' plan caches included, while the chains' garbage is almost all freed by
# reference counting. With young collections 70 times rarer, and full ones rarer still, the chains run
# 1.05-1.25x faster (GPT-2 medium on a100-4x8, every space; the same proposals).
CHAIN_GC_THRESHOLDS = (50_000, 20, 100)


@contextmanager
def _fewer_collections() -> Iterator[None]:
    """Run the chains under `CHAIN_GC_THRESHOLDS`, the thresholds before restored after."""
    before = gc.get_threshold()
    gc.set_threshold(*CHAIN_GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*before)


@_fewer_collections()
def _run_chains(job: WorkerJob, graph: OperatorGraph, report: Progress | None) -> dict[str, Any]:
    """Step the job's chains round-robin until each has stopped; the worker's part of the result."""
    t0 = time.monotonic()
    moves = Moves(graph, ConfigSpace(graph, job.topology, job.replicas), [from_plain(r) for r in job.references])
    chains = []
    events: list[tuple[int, float, float]] = []  # (worker proposals, elapsed_s, chain best ms)
    total = 0
    unstarted: list[ChainReport] = []
    for spec in job.chains:
        evaluator, cost = job.started.pop(spec.name, (None, None))
        if evaluator is None and job.budget_s is not None and time.monotonic() - t0 >= job.budget_s:
            # starting it would be a full simulation past the time budget (large graphs on many devices)
            unstarted.append(ChainReport(name=spec.name, start_ms=math.inf, best_ms=math.inf, num_proposals=0,
                                         num_accepted=0, stop="not started: time"))
            continue
        evaluator = evaluator or _evaluator(job.evaluators, graph, job.topology, job.replicas)
        chain = _Chain(spec.name, from_plain(spec.start), evaluator, moves, random.Random(spec.seed), job.beta_per_ms,
                       job.beta_scale, spec.max_proposals, start_cost=cost)
        events.append((total, job.offset_s + time.monotonic() - t0, chain.best_cost.value))
        chains.append(chain)
    best_ms = min((c.best_cost.value for c in chains), default=math.inf)
    # Under a time budget the worker stops when the closest it knows (the best baseline's, its chains')
    # has not dropped for `stall_s`, counted from when its chains are set up (the first moment it knows one).
    known = min([c.closest for c in chains] + [(0, job.best_ms) if math.isfinite(job.best_ms) else (1, math.inf)])
    known_s = time.monotonic() - t0
    last_report = -math.inf
    active = chains if moves.space.ops else []
    for c in chains:
        c.stop = "" if moves.space.ops else "nothing to propose"
    while active:
        still = []
        now = time.monotonic() - t0
        for chain in active:
            best_before = chain.best_cost.value
            progressed = chain.step()
            total += 1
            now = time.monotonic() - t0
            if chain.best_cost.value < best_before:
                events.append((total, job.offset_s + now, chain.best_cost.value))
            if progressed and chain.closest < known:
                known, known_s = chain.closest, now
            if chain.max_proposals is not None and chain.num_proposals >= chain.max_proposals:
                chain.stop = "proposals"
            elif chain.max_proposals is not None and \
                    chain.num_proposals - chain.progressed_at >= max(1, chain.max_proposals // 2):
                chain.stop = "stalled"
            elif job.budget_s is not None and now >= job.budget_s:
                chain.stop = "time"
            elif job.stall_s is not None and now - known_s >= job.stall_s:
                chain.stop = "stalled"
            else:
                still.append(chain)
        active = still
        worker_best = min(c.best_cost.value for c in chains)
        if report is not None and (worker_best < best_ms or now - last_report >= PROGRESS_INTERVAL_S):
            best_ms, last_report = worker_best, now
            report({"proposals": total, "elapsed_s": job.offset_s + now, "best_ms": best_ms})
    elapsed = time.monotonic() - t0
    return {
        "chains": [{
            "report": ChainReport(name=c.name, start_ms=c.start_cost.value, best_ms=c.best_cost.value,
                                  num_proposals=c.num_proposals, num_accepted=c.num_accepted, stop=c.stop,
                                  num_null=c.num_null),
            "best": to_plain(c.best) if job.plain else c.best,
            "best_cost": c.best_cost,
            "min_peak": c.min_peak,
        } for c in chains] + [{"report": r, "best": None, "best_cost": Cost(time_ms=0.0, feasible=False),
                               "min_peak": (math.inf, r.name)} for r in unstarted],
        "events": events,
        "num_proposals": total,
        "start_s": job.offset_s,
        "elapsed_s": elapsed,
    }


# -------------------------------------------------------------------------------------------- the search


def check_budgets(*, budget_s: float | None, max_proposals: int | None, jobs: int = 1) -> None:
    """`ValueError` (one line) for budgets the search refuses; callers run it before any slow work."""
    if budget_s is None and max_proposals is None:
        raise ValueError("the search needs a time budget or a proposal budget")
    if budget_s is not None and not budget_s > 0:
        raise ValueError(f"the search budget must be > 0 seconds, got {budget_s:g}")
    if max_proposals is not None and max_proposals <= 0:
        raise ValueError(f"the proposal budget must be > 0, got {max_proposals}")
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")


def search(graph: OperatorGraph, topology: DeviceTopology, *, evaluators: EvaluatorFactory,
           budget_s: float | None = None, max_proposals: int | None = None, seed: int = 0, jobs: int = 1,
           beta_scale: float = DEFAULT_BETA_SCALE, random_chains: int = 1, replicas: int | None = None,
           replica_phase: bool = True, progress: Progress | None = None,
           simulated: tuple[tuple[Strategy, Cost], ...] = ()) -> SearchResult:
    """Find a fast strategy for `graph` on `topology` that fits in memory (see the module docstring).

    At least one budget is needed; `ValueError` for a budget <= 0, `jobs` < 1 or `random_chains` < 0,
    `NoFeasibleStrategy` when nothing the search saw fits in memory. `replicas`: the chains search only
    strategies made of that many replicas (module docstring; `ValueError` where the graph or the topology
    has none). `replica_phase`: in a search of every strategy where no baseline fits, search strategies of
    one replica per device first (module docstring; False: never). `progress` (optional) is called
    with {proposals, proposals_per_s, elapsed_s, best_ms} once the baselines are simulated (proposals 0,
    best_ms the best baseline's, inf if none fits), then on improvements and about twice a second.
    `simulated`: (strategy, cost) pairs already simulated in full on `topology`; a search of replicas
    takes a reference's cost from there instead of simulating it again where no chain can start from it
    (the replica phase hands over the baselines and recomputing starts of its search).
    """
    check_budgets(budget_s=budget_s, max_proposals=max_proposals, jobs=jobs)
    if random_chains < 0:
        raise ValueError(f"random_chains must be >= 0, got {random_chains}")
    if not beta_scale > 0:
        raise ValueError(f"beta_scale must be > 0, got {beta_scale}")
    t0 = time.monotonic()
    rep = replica_layout(topology, replicas)
    space = ConfigSpace(graph, topology, rep)

    # Baselines, simulated in full: they seed the best and the chains.
    strategies: dict[str, Strategy] = {}
    costs: dict[str, Cost | None] = {}
    errors: dict[str, str] = {}
    probes: dict[str, tuple[Evaluator, Cost]] = {}  # one evaluator per simulated start, reused by its chain
    for name, make in BASELINES.items():
        try:
            strategies[name] = make(graph, topology)
        except BaselineNotApplicable as exc:
            costs[name], errors[name] = None, str(exc)
            continue
        probe, costs[name] = _probe(evaluators, graph, topology, strategies[name], space, simulated)
        if probe is not None:
            probes[name] = (probe, costs[name])
    feasible = {n: c for n, c in costs.items() if c is not None and c.feasible}
    best_baseline = min(feasible, key=lambda n: feasible[n].time_ms) if feasible else None
    beta = _beta_per_ms(beta_scale, feasible[best_baseline].time_ms) if best_baseline else 0.0

    starts = [n for n in ("dp", "expert") if n in strategies]
    if best_baseline is None and costs:
        # nothing fits: also start from the baseline closest to fitting
        best_baseline = min((n for n, c in costs.items() if c is not None),
                            key=lambda n: costs[n].memory_excess_bytes, default=None)
        closest, best_baseline = best_baseline, None
        if closest is not None and closest not in starts:
            starts.append(closest)
    elif best_baseline is not None and best_baseline not in starts:
        starts.append(best_baseline)
    # The layout starts, simulated in full like the baselines while the time budget lasts: where no baseline
    # fits, one chain from the closest recomputing one if it is closer than every baseline; for mixtures of
    # experts, one from the closest expert-parallel one.
    layouts: dict[str, Strategy] = {}
    layout_costs: dict[str, Cost] = {}
    closest_baseline = min((_closeness(c) for c in costs.values() if c is not None), default=(1, math.inf))
    for always, family in ((False, [] if feasible else recompute_starts(graph, topology)),
                           (True, expert_starts(graph, topology, recompute=not feasible))):
        for name, strategy in family:
            if budget_s is not None and time.monotonic() - t0 >= budget_s:
                break
            layouts[name] = strategy
            probe, layout_costs[name] = _probe(evaluators, graph, topology, strategy, space, simulated)
            if probe is not None:
                probes[name] = (probe, layout_costs[name])
        closest = min((n for n, _ in family if n in layout_costs), key=lambda n: _closeness(layout_costs[n]),
                      default=None)
        if closest is not None and closest not in starts and (always or _closeness(layout_costs[closest])
                                                              < closest_baseline):
            starts.append(closest)
    strategies_and_starts = strategies | layouts
    # No baseline fits: a search of one replica per device first, whose best one more chain starts from.
    phase, phase_start = None, time.monotonic() - t0
    if replica_phase and rep is None and not feasible and getattr(evaluators, "simulates_replicas", False):
        phase = _replica_phase(graph, topology, evaluators=evaluators, seed=seed, jobs=jobs, beta_scale=beta_scale,
                               random_chains=random_chains, progress=progress,
                               budget_s=None if budget_s is None else budget_s - phase_start,
                               max_proposals=max_proposals,
                               simulated=tuple((strategies[n], c) for n, c in costs.items() if c is not None)
                               + tuple((layouts[n], c) for n, c in layout_costs.items()))
    if phase is not None:
        name = f"best of {phase.replicas} replicas"
        starts.append(name)
        strategies_and_starts[name] = phase.best
        probes[name] = _probe(evaluators, graph, topology, phase.best, space, ())
    named: list[tuple[str, Strategy]] = []
    for name in starts:
        if all(strategies_and_starts[name] != s for _, s in named) and space.holds(strategies_and_starts[name]):
            named.append((name, strategies_and_starts[name]))
    rng = random.Random(f"soapflow.search/{seed}/random-starts")
    base = strategies["expert"]  # (a random start redraws every op it does not leave out: `space.ops`)
    named += [(f"random{i}", space.random_strategy(rng, base)) for i in range(random_chains)]
    per_chain = [None] * len(named)
    if max_proposals is not None:
        q, r = divmod(max_proposals - (phase.num_proposals if phase is not None else 0), len(named))
        per_chain = [q + (i < r) for i in range(len(named))]
    specs = [ChainSpec(name=n, start=to_plain(s), seed=f"soapflow.search/{seed}/{n}", max_proposals=k)
             for (n, s), k in zip(named, per_chain, strict=True) if k is None or k > 0]

    references = [to_plain(s) for s in (strategies | layouts).values()]
    offset = time.monotonic() - t0
    if progress is not None:
        if phase is not None:  # the chains' proposals go on from the phase's, their best from its best
            progress = _after_phase(progress, phase)
        progress = _with_rate(progress, offset if phase is None else offset - phase.search_s)
        progress({"proposals": 0, "elapsed_s": offset,
                  "best_ms": feasible[best_baseline].time_ms if best_baseline else math.inf})
    left = None if budget_s is None else max(budget_s - offset, 0.0)
    jobs = min(jobs, len(specs))
    groups = [specs[i::jobs] for i in range(jobs)]
    work = [WorkerJob(graph=graph.to_dict(), topology=topology, evaluators=evaluators, chains=g,
                       budget_s=left, stall_s=None if budget_s is None else budget_s / 2, offset_s=offset,
                       beta_per_ms=beta, beta_scale=beta_scale,
                       best_ms=feasible[best_baseline].time_ms if best_baseline else math.inf,
                       plain=jobs > 1, references=references, replicas=rep) for g in groups]
    if jobs == 1:  # the baselines' evaluators cannot cross a process boundary, but in process they can
        work[0].started = {s.name: probes[s.name] for s in specs if s.name in probes}
    probes.clear()  # evaluators no chain starts from (their simulations can be large) are let go
    if jobs == 1:
        outcomes = [_run_chains(work[0], graph, progress)]
    else:
        outcomes = run_workers(work, _run_chains, progress)
    search_s = max((o["elapsed_s"] for o in outcomes), default=0.0)

    # The best: baselines first (ties keep the baseline), then chains in start order.
    best_name = best_baseline
    best = strategies[best_baseline] if best_baseline else None
    best_cost = feasible[best_baseline] if best_baseline else None
    reports = []
    if phase is not None:  # (its best stands even where the time left no chain to start from it)
        best_name, best, best_cost = f"{phase.replicas} replicas: {phase.best_source}", phase.best, phase.best_cost
        reports += [dataclasses.replace(c, name=f"{phase.replicas} replicas: {c.name}") for c in phase.chains]
    min_peak = min(((c.peak_memory_bytes, n) for n, c in costs.items() if c is not None),
                   default=(math.inf, ""))
    order = {s.name: i for i, s in enumerate(specs)}
    # Workers hold every jobs-th chain: put them back in start order, so that ties break alike for any jobs.
    chains = sorted((c for o in outcomes for c in o["chains"]), key=lambda c: order[c["report"].name])
    for chain in chains:
        reports.append(chain["report"])
        min_peak = min(min_peak, chain["min_peak"])
        cost = chain["best_cost"]
        if cost.feasible and (best_cost is None or cost.time_ms < best_cost.time_ms):
            best_name, best_cost = f"chain {chain['report'].name}", cost
            best = chain["best"] if isinstance(chain["best"], Strategy) else from_plain(chain["best"])
    if best is None or best_cost is None:
        raise NoFeasibleStrategy(_no_fit_message(topology, min_peak))
    if best_name != best_baseline:  # a chain's leftovers take their neighbours' layouts (`search.tidy`)
        best, best_cost = tidy(graph, best, _evaluator(evaluators, graph, topology, rep),
                               num_devices=topology.num_devices, deadline=tidy_deadline(t0, budget_s, time.monotonic()))
    history = _merge_history(outcomes, feasible[best_baseline].time_ms if best_baseline else math.inf, offset)
    num_proposals = sum(o["num_proposals"] for o in outcomes)
    if phase is not None:
        history = _after_phase_history(phase, phase_start, history)
        num_proposals += phase.num_proposals
        search_s += phase.search_s
    return SearchResult(
        best=best, best_cost=best_cost, best_source=best_name, baselines=MappingProxyType(costs),
        baseline_errors=MappingProxyType(errors), chains=tuple(reports),
        num_proposals=num_proposals, elapsed_s=time.monotonic() - t0,
        search_s=search_s, beta_per_ms=beta, history=history, replicas=1 if rep is None else rep.count,
        replica_phase=0 if phase is None else phase.replicas,
        replica_phase_proposals=0 if phase is None else phase.num_proposals)


def _replica_phase(graph: OperatorGraph, topology: DeviceTopology, *, evaluators: EvaluatorFactory,
                   budget_s: float | None, max_proposals: int | None, seed: int, jobs: int, beta_scale: float,
                   random_chains: int, progress: Progress | None,
                   simulated: tuple[tuple[Strategy, Cost], ...]) -> SearchResult | None:
    """The replica phase of a search (module docstring) with what is left of its budgets `budget_s` and
    `max_proposals`: a search of one replica per device with `REPLICA_PHASE_SHARE` of them (`simulated`:
    the search's references simulated in full so far, not simulated again); None where
    there is none (one device, too little budget left, a factory that refuses such replicas on `topology`,
    an op that cannot be laid out as them) or it found nothing that fits."""
    n = topology.num_devices
    share_s = None if budget_s is None else REPLICA_PHASE_SHARE * budget_s
    share = None if max_proposals is None else int(REPLICA_PHASE_SHARE * max_proposals)
    if n < 2 or (share_s is not None and share_s <= 0) or share == 0:
        return None
    try:  # (`SimulatorEvaluators` refuses, in one line, devices that differ from one another)
        _evaluator(evaluators, graph, topology, replica_layout(topology, n))
    except ValueError:
        return None
    try:
        return search(graph, topology, evaluators=evaluators, budget_s=share_s, max_proposals=share, seed=seed,
                      jobs=jobs, beta_scale=beta_scale, random_chains=random_chains, replicas=n, progress=progress,
                      simulated=simulated)
    except NoFeasibleStrategy:
        return None
    except ValueError:  # an op that cannot be laid out as one replica per device (`ConfigSpace`): no phase
        return None


def _after_phase(progress: Progress, phase: SearchResult) -> Progress:
    """`progress` of the chains after the replica phase `phase`: their proposals counted on from the
    phase's, their best no worse than its best."""
    def report(p: Mapping[str, Any]) -> None:
        progress({**p, "proposals": p["proposals"] + phase.num_proposals,
                  "best_ms": min(p["best_ms"], phase.best_cost.time_ms)})

    return report


def _after_phase_history(phase: SearchResult, start_s: float, history: tuple[tuple[int, float, float], ...]
                         ) -> tuple[tuple[int, float, float], ...]:
    """The history of a search whose replica phase `phase` began `start_s` into it and whose chains then
    made `history`: the phase's improvements (their times from the search's start), then the chains'
    (their proposal indices counted on from the phase's) that improve on them."""
    out = [(n, round(t + start_s, 6), ms) for n, t, ms in phase.history]
    best = out[-1][2] if out else math.inf
    for n, t, ms in history:
        if ms < best:
            best = ms
            out.append((n + phase.num_proposals, t, ms))
    return tuple(out)


def replica_layout(topology: DeviceTopology, replicas: int | None) -> Replicas | None:
    """The `Replicas` of a search of `replicas` replicas on `topology` (None: a search of every strategy);
    `ValueError` (one line) where the count does not divide the devices into replicas of two or more."""
    if replicas is None:
        return None
    n = topology.num_devices
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 2 or n % replicas:
        raise ValueError(f"replicas must be a count of at least 2 that divides the {n} devices, got {replicas!r}")
    return Replicas(count=replicas, size=n // replicas)


def _evaluator(evaluators: EvaluatorFactory, graph: OperatorGraph, topology: DeviceTopology,
               replicas: Replicas | None) -> Evaluator:
    """A new evaluator from `evaluators`: of one of `replicas` where given (`EvaluatorFactory`)."""
    return evaluators(graph, topology) if replicas is None else evaluators(graph, topology, replicas=replicas)


def _probe(evaluators: EvaluatorFactory, graph: OperatorGraph, topology: DeviceTopology, strategy: Strategy,
           space: ConfigSpace, simulated: tuple[tuple[Strategy, Cost], ...]) -> tuple[Evaluator | None, Cost]:
    """An evaluator started on a reference `strategy`, and its cost: of one replica where the search is one
    of replicas (`space.replicas`) and `strategy` is made of them and simulates so (a chain may start from
    it), else of every device. In a search of replicas, a strategy not made of them (no chain starts from
    it) whose cost `simulated` holds has that cost and no evaluator."""
    if space.replicas is not None:
        if space.holds(strategy):
            probe = _evaluator(evaluators, graph, topology, space.replicas)
            try:
                return probe, probe.start(strategy)
            except NotReplicable:
                pass
        else:
            known = next((cost for s, cost in simulated if s == strategy), None)
            if known is not None:
                return None, known
    probe = evaluators(graph, topology)
    return probe, probe.start(strategy)


def tidy_deadline(start: float, budget_s: float | None, now: float) -> float | None:
    """When tidying must stop (module docstring), for a search started at `start` with time budget
    `budget_s` whose chains stopped at `now` (`time.monotonic()` values); None without a time budget."""
    return None if budget_s is None else max(start + budget_s, now + TIDY_SHARE * budget_s)


def recompute_starts(graph: OperatorGraph, topology: DeviceTopology) -> list[tuple[str, Strategy]]:
    """The candidate recomputing chain starts (see the module docstring) as (name, strategy), each
    strategy once; none on one device."""
    n = topology.num_devices
    if n == 1:
        return []
    per_node = min(Counter(d.node for d in topology.devices).values())
    specs = []
    for tp_size in dict.fromkeys((per_node, 1)):
        specs.append(f"hybrid:tp={tp_size},recompute=full")
        if n % tp_size == 0 and n // tp_size > 1:
            specs.append(f"hybrid:tp={tp_size},shard={n // tp_size},recompute=full")
    makers = [(spec, parse_baseline(spec)) for spec in specs]
    makers.append(("fsdp+recompute=full", lambda g, t: recompute_full(g, fsdp(g, t))))
    return _layouts(graph, topology, makers)


def expert_starts(graph: OperatorGraph, topology: DeviceTopology, *, recompute: bool) -> list[tuple[str, Strategy]]:
    """The expert-parallel chain starts (module docstring) as (name, strategy), each strategy once; none
    for a graph without `experts` ops, or where no expert count above 1 divides both every experts op's
    experts and the devices of the smallest node. `recompute`: also each with full recomputation."""
    counts = {d.size for op in graph if op.kind == "experts" for d in dims_of(op) if d.name == "experts"}
    per_node = min(Counter(d.node for d in topology.devices).values())
    n = topology.num_devices
    ep = max((e for e in range(2, per_node + 1) if per_node % e == 0 and n % e == 0
              and all(c % e == 0 for c in counts)), default=1)
    if not counts or ep == 1:
        return []
    specs = [f"hybrid:tp=1,ep={ep}"] + ([f"hybrid:tp=1,ep={ep},shard={n // ep}"] if n > ep else [])
    specs += [f"{spec},recompute=full" for spec in specs] if recompute else []
    return _layouts(graph, topology, [(spec, parse_baseline(spec)) for spec in specs])


def _layouts(graph: OperatorGraph, topology: DeviceTopology, makers: list) -> list[tuple[str, Strategy]]:
    """(name, strategy) for each (name, maker) of `makers` whose layout applies, each strategy once."""
    starts: list[tuple[str, Strategy]] = []
    for name, make in makers:
        try:
            strategy = make(graph, topology)
        except BaselineNotApplicable:
            continue  # tp, ep, shard or the batch does not divide
        if all(strategy != s for _, s in starts):
            starts.append((name, strategy))
    return starts


def _with_rate(progress: Progress, offset_s: float) -> Progress:
    """`progress` with `proposals_per_s` added: proposals over the seconds since the chains started."""
    def report(p: Mapping[str, Any]) -> None:
        chains_s = p["elapsed_s"] - offset_s
        progress({**p, "proposals_per_s": p["proposals"] / chains_s if chains_s > 0 else 0.0})

    return report


def _merge_history(outcomes: list[dict[str, Any]], baseline_ms: float,
                   offset_s: float) -> tuple[tuple[int, float, float], ...]:
    """Improvements of the overall best as (proposal index over all workers, elapsed_s, best_ms)."""
    history: list[tuple[int, float, float]] = []
    best = baseline_ms
    if math.isfinite(best):
        history.append((0, round(offset_s, 6), best))
    tagged = sorted((t, w, n, ms) for w, o in enumerate(outcomes) for n, t, ms in o["events"])
    for t, w, n, ms in tagged:
        if ms < best:
            best = ms
            others = 0
            for v, o in enumerate(outcomes):
                if v != w:
                    rate = o["num_proposals"] / o["elapsed_s"] if o["elapsed_s"] > 0 else 0.0
                    others += min(o["num_proposals"], int(rate * max(t - o["start_s"], 0.0)))
            history.append((n + others, round(t, 6), ms))
    return tuple(history)


def _no_fit_message(topology: DeviceTopology, min_peak: tuple[float, str]) -> str:
    need, source = min_peak
    capacity = min(d.memory_bytes for d in topology.devices)
    return (f"no strategy fits in device memory on {topology.name} ({_gb(capacity)} per device): the "
            f"smallest peak memory need the search saw is {_gb(need)} on one device ({source}); use a "
            f"smaller batch, more devices or devices with more memory")


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g} GB" if math.isfinite(n) else "unknown"
