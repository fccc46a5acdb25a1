"""The search on the real simulator: delta simulation gives the search exactly what full simulation gives,
the result is never worse than the best baseline, and chains in worker processes agree with one process."""

from __future__ import annotations

import math

import pytest
from test_search_fixtures import GRAPHS, two_hubs_topology

from search import mcmc
from search.evaluate import SimulatorEvaluators
from search.mcmc import NoFeasibleStrategy, search
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


def tight_transformer_case(tmp_path):
    """The transformer of the runtime cases, and a node of 4 p100 whose memory (the third value, bytes) lies
    between what every baseline (fsdp included) needs on 4 devices and what fsdp with full recomputation
    needs."""
    import json

    import runtime_cases as rc

    from search.baselines import BASELINES, fsdp, recompute_full
    from soap.topology import read_topology

    graph = rc.graph_of("transformer")
    big = load_topology("p100-2x2")
    peaks = {name: max(simulate(graph, make(graph, big), big).peak_memory_bytes) for name, make in BASELINES.items()}
    lean = max(simulate(graph, recompute_full(graph, fsdp(graph, big)), big).peak_memory_bytes)
    cap = (lean + min(peaks.values())) / 2
    assert lean < cap < min(peaks.values())
    doc = {"format": "soapflow.topology/1", "name": "small",
           "devices": [{"id": i, "kind": "p100", "node": 0, "memory_gb": cap / 1e9} for i in range(4)],
           "links": [{"src": f"gpu{i}", "dst": f"gpu{j}", "kind": "nvlink", "spec": "nvlink1"}
                     for i in range(4) for j in range(i + 1, 4)]}
    (tmp_path / "small.json").write_text(json.dumps(doc))
    return graph, read_topology(tmp_path / "small.json"), cap


def test_chains_from_infeasible_baselines_reach_feasible_strategies_with_recompute_and_shard(tmp_path,
                                                                                            monkeypatch):
    """Memory between what every baseline (fsdp included) needs and what fsdp with full recomputation needs: those
    baselines are infeasible, and the search still reports a feasible strategy (recomputing or sharding),
    never an infeasible one. A recomputing start fits, so the search knows a feasible strategy before its
    first proposal: at least as early, and as fast, as chains from the baselines and a random start alone
    (without the replica phase, which `test_a_replica_phase_comes_first_where_no_baseline_fits` checks)."""
    graph, topo, cap = tight_transformer_case(tmp_path)
    result = search(graph, topo, evaluators=SimulatorEvaluators(), max_proposals=600, seed=3, replica_phase=False)
    assert result.best_cost.feasible and result.best_cost.peak_memory_bytes <= cap
    assert any(cfg.recompute or cfg.shard > 1 for cfg in result.best.configs.values())
    first_fit, _, first_ms = result.history[0]  # no baseline fits: the first entry is the first fit found
    assert first_fit == 0 and first_ms < math.inf
    recomputing = [c for c in result.chains if c.name.endswith("recompute=full")]
    assert len(recomputing) == 1 and recomputing[0].start_ms == first_ms

    monkeypatch.setattr(mcmc, "recompute_starts", lambda graph, topology: [])
    try:
        without = search(graph, topo, evaluators=SimulatorEvaluators(), max_proposals=600, seed=3,
                         replica_phase=False)
        without_fit = without.history[0][0]
    except NoFeasibleStrategy:  # (with seeds 0 to 2, 600 proposals find none)
        without_fit = math.inf
    # the recomputing start reaches a feasible strategy sooner, and the chains improve on it
    assert first_fit < without_fit and result.best_cost.time_ms < first_ms


def test_a_replica_phase_comes_first_where_no_baseline_fits(tmp_path):
    """Where no baseline fits, a search of every strategy first searches one replica per device with its
    share of the proposal budget (`REPLICA_PHASE_SHARE`; its chains reported under "4 replicas: ..."),
    then starts one more chain from that phase's best: the result is no slower than the phase's best,
    fits, and is timed as the plain full simulation times it; the proposals are the phase's and the
    chains', within the budget.
    Where a baseline fits, with `replica_phase=False` or on devices that differ, there is no phase."""
    import json

    from search.baselines import BASELINES
    from soap.topology import read_topology

    graph, topo, cap = tight_transformer_case(tmp_path)
    result = search(graph, topo, evaluators=SimulatorEvaluators(), max_proposals=600, seed=3)
    assert result.replica_phase == 4 and result.replicas == 1
    phase = search(graph, topo, evaluators=SimulatorEvaluators(), max_proposals=int(600 * mcmc.REPLICA_PHASE_SHARE),
                   seed=3, replicas=4)
    phased = [c for c in result.chains if c.name.startswith("4 replicas: ")]
    assert [c.name for c in phased] == [f"4 replicas: {c.name}" for c in phase.chains]
    assert sum(c.num_proposals for c in phased) == phase.num_proposals == result.replica_phase_proposals
    assert result.num_proposals == sum(c.num_proposals for c in result.chains) <= 600
    [after] = [c for c in result.chains if c.name == "best of 4 replicas"]
    assert after.start_ms == phase.best_cost.time_ms
    assert result.best_cost.feasible and result.best_cost.peak_memory_bytes <= cap
    assert result.best_cost.time_ms <= phase.best_cost.time_ms
    assert simulate(graph, result.best, topo, symmetry=False).iteration_time_ms == result.best_cost.time_ms
    # the history: the phase's improvements, then the chains' that improve on them
    assert [h[2] for h in result.history[:len(phase.history)]] == [h[2] for h in phase.history]
    assert all(a[0] <= b[0] and a[2] > b[2] for a, b in zip(result.history, result.history[1:], strict=False))
    without = search(graph, topo, evaluators=SimulatorEvaluators(), max_proposals=600, seed=3, replica_phase=False)
    assert without.replica_phase == 0 and not any(c.name.startswith("4 replicas") for c in without.chains)
    fits = _search("mlp", "cpu-2", evaluators=SimulatorEvaluators(), max_proposals=100)
    assert fits.replica_phase == 0
    # devices that differ (one with more memory) are not replicas of one another: no phase, and no error
    doc = json.loads((tmp_path / "small.json").read_text())
    doc["devices"][3]["memory_gb"] *= 2
    (tmp_path / "mixed.json").write_text(json.dumps(doc))
    mixed = read_topology(tmp_path / "mixed.json")
    assert not any(simulate(graph, make(graph, mixed), mixed).feasible for make in BASELINES.values())
    unlike = search(graph, mixed, evaluators=SimulatorEvaluators(), max_proposals=200, seed=3)
    assert unlike.replica_phase == 0 and unlike.best_cost.feasible


class _CountedStarts:
    """`SimulatorEvaluators` that logs, in order, "replica" for each evaluator of one replica it makes and
    the strategy of each start of an evaluator of every device."""

    simulates_replicas = True

    def __init__(self) -> None:
        self.inner = SimulatorEvaluators()
        self.log: list = []

    def __call__(self, graph, topology, *, replicas=None):
        evaluator = self.inner(graph, topology, replicas=replicas)
        if replicas is not None:
            self.log.append("replica")
            return evaluator
        start = evaluator.start

        def counted(strategy):
            self.log.append(strategy)
            return start(strategy)

        evaluator.start = counted
        return evaluator


def test_the_replica_phase_simulates_no_reference_again(tmp_path):
    """The replica phase takes the costs of the references its search simulated in full (baselines,
    recomputing starts) instead of simulating them again: between its first and last evaluator of one
    replica, nothing is simulated on every device, and its result is that of a search of replicas that
    simulates them itself."""
    graph, topo, _ = tight_transformer_case(tmp_path)
    counted = _CountedStarts()
    result = search(graph, topo, evaluators=counted, max_proposals=200, seed=3)
    assert result.replica_phase == 4
    first = counted.log.index("replica")
    last = len(counted.log) - 1 - counted.log[::-1].index("replica")
    references = [s for s in counted.log[:first] if s != "replica"]
    assert len(references) >= 2 and all(s == "replica" for s in counted.log[first:last + 1])
    phase = search(graph, topo, evaluators=SimulatorEvaluators(), max_proposals=int(200 * mcmc.REPLICA_PHASE_SHARE),
                   seed=3, replicas=4)
    phased = [c for c in result.chains if c.name.startswith("4 replicas: ")]
    assert [(c.name, c.start_ms, c.best_ms) for c in phased] == [
        (f"4 replicas: {c.name}", c.start_ms, c.best_ms) for c in phase.chains]


@pytest.mark.parametrize("graph_name, topology, replicas", [("rnn", "p100-2x2", 2), ("rnn", "a100-2x4", 2),
                                                            ("mlp", "a100-2x4", 4)])
def test_a_search_of_replicas_finds_replicas_timed_as_in_full(graph_name, topology, replicas):
    """`replicas`: every chain's states are strategies of that many replicas, each simulated by one of
    them; what a chain returns is such a strategy, its cost that of the plain full simulation, and the
    result is no slower than the best baseline; with worker processes the search is the same."""
    from soap.lowering import find_replicas

    graph, topo = GRAPHS[graph_name](), load_topology(topology)
    result = _search(graph_name, topology, evaluators=SimulatorEvaluators(), replicas=replicas, seed=2)
    assert result.replicas == replicas
    # on the LSTM a chain beats every baseline; on the MLP tensor parallelism (no replicas) stays the best
    assert result.best_source.startswith("chain") == (graph_name == "rnn")
    if result.best_source.startswith("chain"):  # (a baseline need not be made of replicas)
        found = find_replicas(graph, result.best, topo.num_devices)
        assert found is not None and found.count % replicas == 0
    assert simulate(graph, result.best, topo, symmetry=False).iteration_time_ms == result.best_cost.time_ms
    assert result.best_cost.time_ms <= min(ms for ms in result.baseline_ms().values() if ms is not None)
    assert sum(c.num_accepted for c in result.chains) > 0
    two = _search(graph_name, topology, evaluators=SimulatorEvaluators(), replicas=replicas, seed=2, jobs=2)
    assert two.best == result.best and two.best_cost == result.best_cost


@pytest.mark.parametrize("replicas", [1, 3, 16, True])
def test_a_search_of_replicas_needs_a_count_that_divides_the_devices(replicas):
    with pytest.raises(ValueError, match="replicas must be a count of at least 2 that divides the 8 devices"):
        _search("mlp", "a100-2x4", evaluators=SimulatorEvaluators(), replicas=replicas)


def test_a_search_of_replicas_refuses_a_topology_whose_replicas_share_links(tmp_path):
    """Two hubs joined by one link, devices 0 and 2 on one, 1 and 3 on the other: two replicas (0, 1) and
    (2, 3) would exchange over that one link, so no delta simulation of one replica is exact there: the
    search says so in one line before it searches."""
    with pytest.raises(ValueError, match="no search of 2 replicas of 2 devices on two-hubs: .*share a link"):
        search(GRAPHS["mlp"](), two_hubs_topology(tmp_path), evaluators=SimulatorEvaluators(), replicas=2,
               max_proposals=20)


def test_no_replica_phase_where_an_op_cannot_be_laid_out_as_replicas():
    """An op whose sample dim does not split into one replica per device (here the batch of 2 over 4 devices;
    in Hugging Face models a position table of batch 1, or an opaque op): the phase is skipped, and the
    search goes on over every strategy instead of failing."""
    from soapflow.api import capture_model

    graph, topo = capture_model("mlp", batch_size=2)[1], load_topology("cpu-4")
    with pytest.raises(ValueError, match="cannot be laid out as 4 replicas"):
        search(graph, topo, evaluators=SimulatorEvaluators(), max_proposals=10, seed=0, replicas=4)
    assert mcmc._replica_phase(graph, topo, evaluators=SimulatorEvaluators(), budget_s=None, max_proposals=20,
                               seed=0, jobs=1, beta_scale=mcmc.DEFAULT_BETA_SCALE, random_chains=1, progress=None,
                               simulated=()) is None
