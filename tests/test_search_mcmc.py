"""The MCMC search on a fixed-cost model: acceptance rule, budgets, determinism, memory, no-fit errors.

`ToyCost` is the null implementation of the simulator for these tests: a hand-checkable sum of per-device
compute (FLOPs over a fixed rate), a transfer per edge whose two configs differ, a gradient all-reduce per
replicated parameter, and per-device memory (weights x4 for gradients and optimizer state, plus the op's
output part). The same tests run on the real simulator in `test_search_simulated.py`.
"""

from __future__ import annotations

import gc
import json
import math
import random

import pytest
from test_search_fixtures import GRAPHS

from search import mcmc
from search import moves as search_moves
from search.evaluate import Cost, FullEvaluator
from search.mcmc import NoFeasibleStrategy, _Chain, _run_chains, recompute_starts, search
from search.moves import Moves
from search.space import ConfigSpace
from search.workers import ChainSpec, WorkerJob, to_plain
from soap.config import recompute_refusal, validate
from soap.opdef import DimKind
from soap.registry import dims_of
from soap.strategy import Strategy
from soap.topology import load_topology, read_topology

FLOPS_PER_MS = 1e10
BYTES_PER_MS = 1e8
OP_OVERHEAD_MS = 1e-3


class ToyCost:
    def __init__(self, graph, topology):
        self.graph, self.topology = graph, topology
        self.capacity = min(d.memory_bytes for d in topology.devices)

    def __call__(self, strategy: Strategy) -> Cost:
        busy = [0.0] * self.topology.num_devices
        memory = [0.0] * self.topology.num_devices
        comm_ms = 0.0
        for op in self.graph:
            cfg = strategy[op.name]
            dims = {d.name: d for d in dims_of(op)}
            shards = math.prod(g for k, g in cfg.degrees.items() if dims[k].kind is not DimKind.SAMPLE)
            replicas = cfg.num_parts // shards
            for d in cfg.devices:
                busy[d] += (op.fwd_flops + op.bwd_flops) / cfg.num_parts / FLOPS_PER_MS + OP_OVERHEAD_MS
                memory[d] += 4 * op.param_bytes / shards + op.output.nbytes / cfg.num_parts
            if replicas > 1:
                comm_ms += 2 * op.param_bytes / shards * (replicas - 1) / replicas / BYTES_PER_MS
            for ref in op.inputs:
                if strategy[ref.op] != cfg:
                    comm_ms += self.graph.tensor(ref).nbytes / BYTES_PER_MS
        peak = max(memory)
        return Cost(time_ms=max(busy) + comm_ms, feasible=peak <= self.capacity, peak_memory_bytes=peak,
                    memory_excess_bytes=max(0.0, peak - self.capacity))


class ToyEvaluators:
    """Picklable factory (module level), so `jobs` > 1 can ship it to worker processes."""

    def __call__(self, graph, topology):
        return FullEvaluator(ToyCost(graph, topology))


def tiny_memory_topology(tmp_path, memory_gb: float, devices: int = 4):
    doc = {"format": "soapflow.topology/1", "name": "tiny",
           "devices": [{"id": i, "kind": "p100", "node": 0, "memory_gb": memory_gb} for i in range(devices)],
           "links": [{"src": f"gpu{i}", "dst": f"gpu{j}", "kind": "nvlink", "spec": "nvlink1"}
                     for i in range(devices) for j in range(i + 1, devices)]}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(doc))
    return read_topology(path)


def _run(graph_name="mlp", topology="p100-4x4", **kw):
    kw.setdefault("max_proposals", 600)
    return search(GRAPHS[graph_name](), load_topology(topology), evaluators=ToyEvaluators(), **kw)


def test_budgets_must_be_positive():
    for kw in ({"budget_s": 0}, {"budget_s": -1.0}, {"max_proposals": 0}, {"max_proposals": -5}, {}):
        with pytest.raises(ValueError, match="budget"):
            search(GRAPHS["mlp"](), load_topology("cpu-2"), evaluators=ToyEvaluators(), **kw)
    with pytest.raises(ValueError, match="jobs"):
        _run(jobs=0)


@pytest.mark.parametrize("graph_name", sorted(GRAPHS))
def test_finds_at_least_the_best_baseline(graph_name: str):
    result = _run(graph_name, max_proposals=1500)
    best_baseline = min(ms for ms in result.baseline_ms().values() if ms is not None)
    assert result.best_cost.feasible
    assert result.best_cost.time_ms <= best_baseline
    assert ToyCost(GRAPHS[graph_name](), load_topology("p100-4x4"))(result.best) == result.best_cost
    graph = GRAPHS[graph_name]()
    for op in graph:
        validate(op, result.best[op.name], 16)
    idx = [h[0] for h in result.history]
    assert idx == sorted(idx) and [h[2] for h in result.history] == sorted((h[2] for h in result.history),
                                                                          reverse=True)
    # the chains' last improvement, then tidied (`search.tidy`: never slower, sometimes faster)
    assert result.history[-1][2] >= result.best_cost.time_ms
    assert {c.name for c in result.chains} >= {"dp", "expert", "random0"}


def test_search_beats_data_parallel_on_the_mlp():
    result = _run("mlp", topology="cpu-2", max_proposals=1000)
    assert result.best_cost.time_ms < 0.8 * result.baseline_ms()["dp"]


def test_same_seed_same_result():
    a, b = _run(seed=5), _run(seed=5)
    assert a.best == b.best and a.best_cost == b.best_cost
    assert [h[0] for h in a.history] == [h[0] for h in b.history]
    assert [(c.name, c.num_proposals, c.num_accepted, c.best_ms) for c in a.chains] == \
        [(c.name, c.num_proposals, c.num_accepted, c.best_ms) for c in b.chains]
    assert a.num_proposals == b.num_proposals <= 600


def test_the_chains_collect_cycles_less_often_and_leave_the_thresholds_as_they_were(monkeypatch):
    seen = []
    real = search_moves.Moves.propose

    def recording(self, rng, current):
        seen.append(gc.get_threshold())
        return real(self, rng, current)

    monkeypatch.setattr(search_moves.Moves, "propose", recording)
    before = gc.get_threshold()
    assert before != mcmc.CHAIN_GC_THRESHOLDS
    _run("mlp", max_proposals=50)
    assert seen and set(seen) == {mcmc.CHAIN_GC_THRESHOLDS}
    assert gc.get_threshold() == before


def test_moves_that_change_nothing_are_counted_apart(monkeypatch):
    """Every third move changes nothing: it counts as a proposal, as a null one, and not among those costed."""
    calls = []
    real = search_moves.Moves.propose

    def every_third_null(self, rng, current):
        calls.append(1)
        changes = real(self, rng, current)
        return {} if len(calls) % 3 == 0 else changes

    monkeypatch.setattr(search_moves.Moves, "propose", every_third_null)
    result = _run("mlp", max_proposals=300)
    nulls = sum(c.num_null for c in result.chains)
    assert nulls >= len(calls) // 3 and sum(c.num_proposals for c in result.chains) == result.num_proposals
    assert result.costed_per_s == pytest.approx((result.num_proposals - nulls) / result.search_s)
    assert result.costed_per_s < result.proposals_per_s


def test_jobs_do_not_change_the_result():
    one, two = _run("cnn", seed=2, jobs=1), _run("cnn", seed=2, jobs=2)
    assert one.best == two.best and one.best_cost == two.best_cost
    assert one.num_proposals == two.num_proposals
    assert [c.best_ms for c in one.chains] == [c.best_ms for c in two.chains]


def test_time_budget_stops_the_search():
    result = _run("cnn", max_proposals=None, budget_s=1.0)
    assert result.elapsed_s < 3.0 and result.num_proposals > 0
    # on a loaded machine the baselines may spend the whole budget: then the random chain is not started
    assert all(c.stop in ("time", "stalled", "not started: time") for c in result.chains)
    assert any(c.stop in ("time", "stalled") for c in result.chains)


def test_stalled_chains_stop_at_half_their_budget():
    result = _run("mlp", topology="cpu-2", max_proposals=4000)
    for chain in result.chains:
        assert chain.stop in ("stalled", "proposals")
    assert result.num_proposals < 4000  # cpu-2 mlp converges fast: chains stop early


def test_out_of_memory_proposals_are_rejected(tmp_path):
    graph = GRAPHS["mlp"]()  # 4 x 16.8 MB of weights x 4 per replica: dp needs ~70 MB per device
    topo = tiny_memory_topology(tmp_path, memory_gb=0.04)
    accepted: list[Cost] = []
    space = ConfigSpace(graph, topo)
    start = search_baseline(graph, topo, "tp")
    toy = ToyCost(graph, topo)
    assert toy(start).feasible and not toy(search_baseline(graph, topo, "dp")).feasible
    chain = _Chain("tp", start, FullEvaluator(toy), Moves(graph, space), random.Random(0),
                   beta_per_ms=100 / toy(start).time_ms, beta_scale=100, max_proposals=None)
    for _ in range(2000):
        # the cost of every accepted proposal (a move over several ops included, whose evaluator makes all
        # but its last op current on the way)
        before = chain.num_accepted
        chain.step()
        if chain.num_accepted > before:
            accepted.append(chain.cost)
    assert accepted and all(c.feasible for c in accepted)
    result = search(graph, topo, evaluators=ToyEvaluators(), max_proposals=800)
    assert result.best_cost.feasible and result.best_cost.peak_memory_bytes <= 0.04e9
    assert result.baseline_ms()["dp"] is None and result.baselines["dp"] is not None
    assert not result.baselines["dp"].feasible


def search_baseline(graph, topo, name):
    from search.baselines import BASELINES

    return BASELINES[name](graph, topo)


def test_infeasible_start_walks_to_a_feasible_strategy(tmp_path):
    graph = GRAPHS["mlp"]()
    topo = tiny_memory_topology(tmp_path, memory_gb=0.04)
    toy = ToyCost(graph, topo)
    start = search_baseline(graph, topo, "dp")
    assert not toy(start).feasible
    chain = _Chain("dp", start, FullEvaluator(toy), Moves(graph, ConfigSpace(graph, topo)), random.Random(0),
                   beta_per_ms=0.0, beta_scale=100, max_proposals=None)
    excess = [chain.cost.memory_excess_bytes]
    for _ in range(3000):
        chain.step()
        excess.append(chain.cost.memory_excess_bytes if not chain.cost.feasible else 0.0)
    assert chain.best_cost.feasible and chain.beta > 0
    assert excess == sorted(excess, reverse=True)  # never walks uphill while infeasible


def test_dp_not_applicable_still_searches():
    graph = GRAPHS["cnn"](batch=8)  # 8 samples over 16 devices: data parallelism is not defined
    result = search(graph, load_topology("p100-4x4"), evaluators=ToyEvaluators(), max_proposals=400)
    assert result.baseline_ms()["dp"] is None and result.baselines["dp"] is None
    assert "dp" in result.baseline_errors and "batch" in result.baseline_errors["dp"]
    assert "dp" not in {c.name for c in result.chains}
    assert result.best_cost.feasible


def test_no_feasible_strategy_names_the_smallest_need(tmp_path):
    topo = tiny_memory_topology(tmp_path, memory_gb=1e-6)  # 1 kB per device
    with pytest.raises(NoFeasibleStrategy, match=r"smallest peak memory need .* is [0-9.]+ [MGk]?B"):
        search(GRAPHS["mlp"](), topo, evaluators=ToyEvaluators(), max_proposals=200)


def test_acceptance_follows_metropolis_hastings():
    """A move from 10 ms to 10 ms x (1 + f) is accepted with probability exp(-k f); downhill always."""
    graph, topo = GRAPHS["mlp"](), load_topology("cpu-2")

    class Fixed(FullEvaluator):
        def __init__(self):
            super().__init__(lambda s: Cost(time_ms=10.0))

    for new_ms, expected in ((10.1, math.exp(-1)), (10.3, math.exp(-3)), (9.0, 1.0), (10.0, 1.0)):
        chain = _Chain("x", search_baseline(graph, topo, "dp"), Fixed(), Moves(graph, ConfigSpace(graph, topo)),
                       random.Random(1), beta_per_ms=100 / 10.0, beta_scale=100, max_proposals=None)
        # the limit is drawn before the proposal is costed (`_limit`), as the chain's `step` does
        rate = sum(chain._accept(Cost(time_ms=new_ms), chain._limit()) for _ in range(4000)) / 4000
        assert abs(rate - expected) < 0.025, (new_ms, rate, expected)
    assert not chain._accept(Cost(time_ms=1.0, feasible=False, memory_excess_bytes=1.0), chain._limit())


def test_progress_is_reported():
    seen = []
    result = _run("mlp", max_proposals=300, progress=seen.append)
    assert seen and all({"proposals", "proposals_per_s", "elapsed_s", "best_ms"} <= set(p) for p in seen)
    # the first report comes once the baselines are simulated: no proposals yet, the best baseline's time
    best_baseline = min(ms for ms in result.baseline_ms().values() if ms is not None)
    assert seen[0]["proposals"] == 0 and seen[0]["best_ms"] == best_baseline
    assert all(p["proposals_per_s"] >= 0 for p in seen)
    assert [p["best_ms"] for p in seen] == sorted((p["best_ms"] for p in seen), reverse=True)


class SlowFlat(FullEvaluator):
    """Every strategy costs the same (nothing ever improves) and each costing takes 1 ms."""

    def __init__(self):
        super().__init__(self._cost)

    @staticmethod
    def _cost(strategy):
        import time

        time.sleep(1e-3)
        return Cost(time_ms=10.0)


class SlowFlatEvaluators:
    def __call__(self, graph, topology):
        return SlowFlat()


def test_time_budget_stops_when_the_best_stalls_for_half_the_budget():
    """Nothing beats the baselines: the search stops about half-way through its time budget."""
    result = search(GRAPHS["mlp"](), load_topology("p100-4x4"), evaluators=SlowFlatEvaluators(), budget_s=2.0)
    assert all(c.stop == "stalled" for c in result.chains)
    assert 0.9 <= result.elapsed_s < 1.8, result.elapsed_s
    assert result.num_proposals > 0 and result.best_source in ("dp", "mp", "tp", "expert", "fsdp")


class CountingEvaluators:
    """Evaluators of `cost(graph, topology)` (default `ToyCost`) that count how many strategies are
    simulated from scratch (`start`)."""

    def __init__(self, cost=ToyCost):
        self.starts, self.cost = 0, cost

    def __call__(self, graph, topology):
        factory = self

        class Counting(FullEvaluator):
            def start(self, strategy):
                factory.starts += 1
                return super().start(strategy)

        return Counting(self.cost(graph, topology))


def without_stage_moves(monkeypatch):
    """No stage or spread moves (`search.moves.STAGE_SHARE`, `SPREAD_SHARE`): on the MLP every other move
    changes one op, so that a test can count the strategies simulated from scratch (a move over more than
    two ops is one) or let every accepted change take one step of a fake walk."""
    monkeypatch.setattr(search_moves, "STAGE_SHARE", 0.0)
    monkeypatch.setattr(search_moves, "SPREAD_SHARE", 0.0)


def test_chains_from_baselines_reuse_the_baselines_simulations(monkeypatch):
    without_stage_moves(monkeypatch)
    evaluators = CountingEvaluators()
    result = search(GRAPHS["mlp"](), load_topology("p100-4x4"), evaluators=evaluators, max_proposals=100,
                    random_chains=2)
    # five baselines, then only the two random starts: the baselines' chains take over their evaluators
    # (a baseline fits: the recomputing starts are not simulated)
    assert {"dp", "expert", "random0", "random1"} <= {c.name for c in result.chains}
    assert evaluators.starts == 5 + 2


class SlowStartEvaluators:
    """Every strategy costs 10 ms, and simulating one from scratch (`start`) takes 0.2 s."""

    def __call__(self, graph, topology):
        class SlowStart(FullEvaluator):
            def start(self, strategy):
                import time

                time.sleep(0.2)
                return super().start(strategy)

        return SlowStart(lambda s: Cost(time_ms=10.0))


def test_chains_are_not_started_past_the_time_budget():
    """Simulating the four baselines spends the budget: the random chain is not started, the baselines'
    chains (which reuse the baselines' simulations) still run, and the search ends near its budget."""
    result = search(GRAPHS["mlp"](), load_topology("p100-4x4"), evaluators=SlowStartEvaluators(), budget_s=0.5)
    stops = {c.name: c.stop for c in result.chains}
    assert stops["random0"] == "not started: time"
    assert result.elapsed_s < 1.3 and result.best_source in ("dp", "mp", "tp", "expert", "fsdp")


class FakeClock:
    """Stands in for the `time` module in `search.mcmc`: a monotonic clock that moves only when told."""

    def __init__(self):
        self.now_s = 0.0

    def monotonic(self) -> float:
        return self.now_s


class LongWalk:
    """An `Evaluator` on which fitting in memory is a long walk away: the start exceeds memory by `steps`
    bytes, every accepted change takes one byte off, every strategy takes 10 ms, and costing a change
    takes `step_s` seconds of `clock`."""

    def __init__(self, clock: FakeClock, *, steps: int, step_s: float):
        self.clock, self.steps, self.step_s = clock, steps, step_s
        self.excess = self.pending = steps

    @staticmethod
    def _cost(excess: int) -> Cost:
        return Cost(time_ms=10.0, feasible=excess == 0, peak_memory_bytes=1000.0 + excess,
                    memory_excess_bytes=float(excess))

    def start(self, strategy):
        self.excess = self.steps
        return self._cost(self.excess)

    def propose(self, op, cfg):
        self.clock.now_s += self.step_s
        self.pending = max(self.excess - 1, 0)
        return self._cost(self.pending)

    def accept(self):
        self.excess = self.pending

    def reject(self):
        pass


@pytest.mark.parametrize("budget_s, max_proposals", [(1.0, None), (None, 200)])
def test_early_stops_count_a_shrinking_memory_excess_as_progress(monkeypatch, budget_s, max_proposals):
    """Fitting is 70 accepted changes away, 0.01 s each: the walk outlasts half of either budget (the
    stall limit of either early stop) but not the budget itself. Both early stops count a shrinking
    memory excess as progress while nothing known fits, so the chain walks on until its strategy fits."""
    clock = FakeClock()
    monkeypatch.setattr(mcmc, "time", clock)
    without_stage_moves(monkeypatch)
    graph, topo = GRAPHS["mlp"](), load_topology("cpu-2")
    spec = ChainSpec(name="dp", start=to_plain(search_baseline(graph, topo, "dp")), seed="walk",
                     max_proposals=max_proposals)
    job = WorkerJob(graph=graph.to_dict(), topology=topo,
                    evaluators=lambda g, t: LongWalk(clock, steps=70, step_s=0.01), chains=[spec],
                    budget_s=budget_s, stall_s=None if budget_s is None else budget_s / 2, offset_s=0.0,
                    beta_per_ms=0.0, beta_scale=100.0, best_ms=math.inf)
    [chain] = _run_chains(job, graph, None)["chains"]
    assert chain["best_cost"].feasible, chain["report"]
    if budget_s:  # it ran to the end of the budget, not stalled at half of it
        assert chain["report"].stop == "time" and clock.now_s == pytest.approx(budget_s)


class RecomputeFits:
    """A cost on which a strategy fits in memory only when every op but the loss that can recompute does
    (the excess: the output bytes of those that do not); each recomputing op adds 1 ms to 10 ms. With
    `fits_anyway`, everything fits."""

    def __init__(self, graph, topology, *, fits_anyway: bool = False):
        self.graph, self.fits_anyway = graph, fits_anyway

    def __call__(self, strategy: Strategy) -> Cost:
        kept = sum(op.output.nbytes for op in self.graph.ops[:-1]
                   if not strategy[op.name].recompute and recompute_refusal(op) is None)
        time_ms = 10.0 + sum(cfg.recompute for cfg in strategy.configs.values())
        if self.fits_anyway or not kept:
            return Cost(time_ms=time_ms, peak_memory_bytes=1.0)
        return Cost(time_ms=time_ms, feasible=False, peak_memory_bytes=1.0 + kept, memory_excess_bytes=kept)


def test_chains_also_start_from_a_recomputing_strategy_that_beats_the_baselines(monkeypatch):
    """On more than one device the candidates are the Megatron layouts with full recomputation (tp within
    a node and tp 1, parameters replicated or sharded over all data-parallel groups) and fsdp with full
    recomputation, those the graph admits, each strategy once; when no baseline fits, one chain starts
    from the closest of them to fitting."""
    without_stage_moves(monkeypatch)
    graph, topo = GRAPHS["mlp"](), load_topology("p100-4x4")  # 4 nodes of 4 devices
    starts = recompute_starts(graph, topo)
    # fsdp with full recomputation is hybrid:tp=1,shard=16 with full recomputation here: listed once
    assert [name for name, _ in starts] == ["hybrid:tp=4,recompute=full", "hybrid:tp=4,shard=4,recompute=full",
                                            "hybrid:tp=1,recompute=full", "hybrid:tp=1,shard=16,recompute=full"]
    assert all(any(cfg.recompute for cfg in s.configs.values()) for _, s in starts)
    assert any(cfg.shard > 1 for cfg in starts[1][1].configs.values())
    # 8 samples: tp 1 over 16 devices (16 data-parallel groups) and fsdp do not divide the batch
    small = GRAPHS["cnn"](batch=8)
    assert [name for name, _ in recompute_starts(small, topo)] == ["hybrid:tp=4,recompute=full",
                                                                   "hybrid:tp=4,shard=4,recompute=full"]
    assert recompute_starts(graph, load_topology("cpu-1")) == []
    assert [name for name, _ in recompute_starts(graph, load_topology("cpu-2"))] == [
        "hybrid:tp=2,recompute=full", "hybrid:tp=1,recompute=full", "hybrid:tp=1,shard=2,recompute=full"]

    # only full recomputation fits: no baseline does, every candidate does (all equally fast: the first)
    evaluators = CountingEvaluators(RecomputeFits)
    result = search(graph, topo, evaluators=evaluators, max_proposals=300)
    assert [c.name for c in result.chains] == ["dp", "expert", "hybrid:tp=4,recompute=full", "random0"]
    assert result.best_cost.feasible and result.history[0][0] == 0
    # the candidates' chain takes over its evaluator; one more tidies the best, a chain's (`search.tidy`)
    assert result.best_source.startswith("chain") and evaluators.starts == 5 + 4 + 1 + 1
    # everything fits and recomputation only costs time: the candidates are not even simulated
    evaluators = CountingEvaluators(lambda g, t: RecomputeFits(g, t, fits_anyway=True))
    result = search(graph, topo, evaluators=evaluators, max_proposals=300)
    assert [c.name for c in result.chains] == ["dp", "expert", "random0"]
    assert evaluators.starts == 5 + 1 + result.best_source.startswith("chain")
