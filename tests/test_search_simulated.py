"""The search on the real simulator: delta simulation gives the search exactly what full simulation gives,
the result is never worse than the best baseline, and chains in worker processes agree with one process."""

from __future__ import annotations

import pytest
from test_search_fixtures import GRAPHS

from search.evaluate import SimulatorEvaluators
from search.mcmc import search
from simulator.engine import simulate
from soap.topology import load_topology


def _search(graph_name: str, topology: str, **kw):
    kw.setdefault("max_proposals", 240)
    return search(GRAPHS[graph_name](), load_topology(topology), **kw)


@pytest.mark.parametrize("graph_name, topology", [("mlp", "p100-2x2"), ("cnn", "p100-2x2"), ("rnn", "cpu-2")])
def test_delta_and_full_simulation_give_the_same_search(graph_name, topology):
    delta = _search(graph_name, topology, evaluators=SimulatorEvaluators(delta=True), seed=1)
    full = _search(graph_name, topology, evaluators=SimulatorEvaluators(delta=False), seed=1)
    assert delta.best == full.best and delta.best_cost == full.best_cost
    assert [(c.name, c.num_proposals, c.num_accepted, c.best_ms) for c in delta.chains] == \
        [(c.name, c.num_proposals, c.num_accepted, c.best_ms) for c in full.chains]
    # the reported cost is the full simulation's of the strategy returned
    graph, topo = GRAPHS[graph_name](), load_topology(topology)
    assert simulate(graph, delta.best, topo).iteration_time_ms == delta.best_cost.time_ms
    best_baseline = min(ms for ms in delta.baseline_ms().values() if ms is not None)
    assert delta.best_cost.time_ms <= best_baseline


def test_worker_processes_agree_with_one_process():
    one = _search("mlp", "p100-2x2", evaluators=SimulatorEvaluators(), seed=4, jobs=1)
    two = _search("mlp", "p100-2x2", evaluators=SimulatorEvaluators(), seed=4, jobs=2)
    assert one.best == two.best and one.best_cost == two.best_cost
    assert one.num_proposals == two.num_proposals


def test_search_beats_data_parallel_on_the_mlp_with_the_simulator():
    result = _search("mlp", "cpu-2", evaluators=SimulatorEvaluators(), max_proposals=400)
    assert result.best_cost.time_ms < result.baseline_ms()["dp"]
