"""`search.tidy`: ops whose layout matches none of their neighbours' take a neighbour's where the predicted
time does not grow, and keep theirs where it would."""

from __future__ import annotations

import functools

import pytest
import runtime_cases as rc

from search import mcmc
from search.evaluate import Cost, FullEvaluator, SimulatorEvaluators
from search.structure import neighbours
from search.tidy import tidy
from soap.config import ParallelConfig
from soap.graph import OperatorGraph
from soap.registry import op_def
from soap.strategy import Strategy
from soap.topology import DeviceTopology, load_topology


def _layout(cfg: ParallelConfig) -> tuple:
    return (tuple(sorted(cfg.degrees.items())), cfg.devices)


def _outliers(graph, strategy: Strategy) -> set[str]:
    """Ops (not sources) whose layout matches none of their neighbours' (producers and consumers)."""
    near: dict[str, set[str]] = {op.name: set() for op in graph}
    for op in graph:
        for ref in op.inputs:
            if not op_def(graph[ref.op].kind).everywhere:
                near[op.name].add(ref.op)
                near[ref.op].add(op.name)
    return {n for n, others in near.items() if others and not op_def(graph[n].kind).everywhere
            and _layout(strategy[n]) not in {_layout(strategy[o]) for o in others}}


@functools.cache
def searched() -> tuple[OperatorGraph, DeviceTopology, Strategy]:
    """The RNN language model on 4 x 4 devices: the best strategy of a short search, untidied."""
    graph, topology = rc.graph_of("rnnlm"), load_topology("p100-4x4")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mcmc, "tidy", lambda graph, strategy, evaluator, num_devices, deadline: (strategy,
                                                                                      evaluator.start(strategy)))
        result = mcmc.search(graph, topology, evaluators=SimulatorEvaluators(), max_proposals=2000, seed=2)
    assert result.best_source.startswith("chain"), "a chain's best, which the search tidies"
    return graph, topology, result.best


@functools.cache
def with_outlier() -> tuple[OperatorGraph, DeviceTopology, Strategy, str]:
    """The searched strategy with one outlier more than the search left (whatever that was: the chain's
    path changes with its moves), and its name: an op in the middle of the graph whose layout one of its
    neighbours has, moved to a device of its own, where the exchanges in and out of it cost time that its
    neighbours' layout does not."""
    graph, topology, strategy = searched()
    near = neighbours(graph)
    inner = [op.name for op in graph if not op_def(op.kind).everywhere and len(near[op.name]) >= 2
             and op.name not in _outliers(graph, strategy)]
    name = inner[len(inner) // 2]
    spare = max(set(range(topology.num_devices)) - set(strategy[name].devices))
    moved = strategy.with_config(name, ParallelConfig.single(spare))
    assert name in _outliers(graph, moved)
    return graph, topology, moved, name


def test_tidy_gives_outliers_their_neighbours_layout_where_the_predicted_time_does_not_grow():
    graph, topology, strategy, planted = with_outlier()
    evaluators = SimulatorEvaluators()
    before = evaluators(graph, topology).start(strategy)
    tidied, cost = tidy(graph, strategy, evaluators(graph, topology), num_devices=topology.num_devices)
    # the cost is the simulator's for the strategy returned, and no worse than before
    again = evaluators(graph, topology).start(tidied)
    assert cost == again and cost.feasible and cost.time_ms <= before.time_ms
    assert len(_outliers(graph, tidied)) < len(_outliers(graph, strategy))
    assert planted not in _outliers(graph, tidied)
    # only outliers changed
    assert {n for n in strategy.configs if tidied[n] != strategy[n]} <= _outliers(graph, strategy)


def test_the_search_tidies_the_best_a_chain_found(monkeypatch):
    graph, topology, untidied = searched()
    calls = []

    def spy(graph, strategy, evaluator, num_devices, deadline):
        assert deadline is None, "under a proposal budget alone, tidying runs to the end"
        calls.append((strategy, tidy(graph, strategy, evaluator, num_devices=num_devices)))
        return calls[-1][1]

    monkeypatch.setattr(mcmc, "tidy", spy)
    evaluators = SimulatorEvaluators()
    result = mcmc.search(graph, topology, evaluators=evaluators, max_proposals=2000, seed=2)
    # the chain's best (the same as the search found without tidying), tidied, is what the search returns
    assert [strategy for strategy, _ in calls] == [untidied]
    assert (result.best, result.best_cost) == calls[0][1]
    assert calls[0][1] == tidy(graph, untidied, evaluators(graph, topology), num_devices=topology.num_devices)


def test_tidy_keeps_an_outlier_where_its_neighbours_layout_is_slower_or_does_not_fit():
    graph, topology, messy, _ = with_outlier()
    outliers = _outliers(graph, messy)

    def slower(strategy: Strategy) -> Cost:  # any change makes it slower
        return Cost(time_ms=1.0 if strategy == messy else 2.0)

    same, cost = tidy(graph, messy, FullEvaluator(slower), num_devices=topology.num_devices)
    assert same == messy and cost.time_ms == 1.0

    def unfit(strategy: Strategy) -> Cost:  # any change is faster but does not fit
        if strategy == messy:
            return Cost(time_ms=1.0)
        return Cost(time_ms=0.5, feasible=False, peak_memory_bytes=2.0, memory_excess_bytes=1.0)

    same, _ = tidy(graph, messy, FullEvaluator(unfit), num_devices=topology.num_devices)
    assert same == messy

    def by_outliers(strategy: Strategy) -> Cost:  # fewer outliers are faster: every one is tidied
        return Cost(time_ms=float(len(_outliers(graph, strategy))))

    tidied, cost = tidy(graph, messy, FullEvaluator(by_outliers), num_devices=topology.num_devices)
    assert outliers and cost.time_ms < len(outliers) and cost.time_ms == len(_outliers(graph, tidied))


def test_tidy_tries_no_move_after_its_deadline(monkeypatch):
    graph, topology, messy, _ = with_outlier()
    outliers = _outliers(graph, messy)
    costed: list[Strategy] = []

    def by_outliers(strategy: Strategy) -> Cost:  # fewer outliers are faster: every try is a move
        costed.append(strategy)
        return Cost(time_ms=float(len(_outliers(graph, strategy))))

    # a deadline already passed: the strategy as it was, with its cost
    same, cost = tidy(graph, messy, FullEvaluator(by_outliers), num_devices=topology.num_devices, deadline=0.0)
    assert same == messy and cost.time_ms == len(outliers) and costed == [messy]
    # a clock that ticks once per look: tries stop at the deadline, and what moved before it stays
    clock = iter(range(10**6))
    monkeypatch.setattr("search.tidy.time.monotonic", lambda: next(clock))
    costed.clear()
    tidied, cost = tidy(graph, messy, FullEvaluator(by_outliers), num_devices=topology.num_devices, deadline=1)
    assert len(costed) == 1 + 1, "the start, then one try per tick before the deadline"
    assert cost.time_ms == len(_outliers(graph, tidied)) < len(outliers)
    unlimited, _ = tidy(graph, messy, FullEvaluator(by_outliers), num_devices=topology.num_devices)
    assert len(_outliers(graph, unlimited)) < len(_outliers(graph, tidied))


def test_under_a_time_budget_the_search_gives_tidying_the_rest_of_it_or_a_share(monkeypatch):
    # chains that stopped early leave tidying the rest of the budget; chains that used it all, a share more
    assert mcmc.tidy_deadline(100.0, 50.0, 120.0) == 150.0
    assert mcmc.tidy_deadline(100.0, 50.0, 149.0) == 149.0 + mcmc.TIDY_SHARE * 50.0
    assert mcmc.tidy_deadline(100.0, None, 149.0) is None
    # the search passes it: both budgets, the proposals run out first (a chain's best, as in `searched`)
    graph, topology = rc.graph_of("rnnlm"), load_topology("p100-4x4")
    seen = []

    def spy(graph, strategy, evaluator, num_devices, deadline):
        seen.append((deadline, mcmc.time.monotonic()))
        return strategy, evaluator.start(strategy)

    monkeypatch.setattr(mcmc, "tidy", spy)
    start = mcmc.time.monotonic()
    result = mcmc.search(graph, topology, evaluators=SimulatorEvaluators(), max_proposals=2000, budget_s=900.0,
                         seed=2)
    assert result.best_source.startswith("chain") and len(seen) == 1
    deadline, now = seen[0]
    assert start + 900.0 <= deadline <= now + 900.0
