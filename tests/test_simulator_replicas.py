"""Simulation by replicas (`soap.lowering.find_replicas`, `simulator.engine.simulate`): a strategy made of
identical replicas is timed by its replica 0 alone, and that is exact: the same iteration time, per-device
memory, bytes moved and collectives as the plain simulation of every device, or it falls back to it."""

from __future__ import annotations

import random

import pytest
import runtime_cases as rc
from test_search_fixtures import two_hubs_topology

from search.baselines import BaselineNotApplicable, parse_baseline
from simulator.engine import Simulator, simulate, simulator_of
from soap.config import ParallelConfig
from soap.lowering import NotReplicable, Replicas, find_replicas
from soap.strategy import Strategy
from soap.topology import load_topology

BASELINES = ("dp", "fsdp", "hybrid:tp=2", "hybrid:tp=2,shard=2", "hybrid:tp=2,recompute=full", "hybrid:tp=4",
             "tp", "expert")
CASES = [(model, topo) for model in ("mlp", "transformer", "rescnn", "rnnlm", "llama")
         for topo in ("p100-2x2", "a100-2x4", "cpu-4")]


@pytest.mark.parametrize(("model", "topology"), CASES)
def test_simulating_one_replica_equals_simulating_every_device(model, topology):
    graph, topo = rc.graph_of(model), load_topology(topology)
    quotients, ran = 0, set()
    for name in BASELINES:
        try:
            strategy = parse_baseline(name)(graph, topo)
        except BaselineNotApplicable:
            continue
        ran.add(name)
        plain_sim, plain = simulator_of(graph, strategy, topo, symmetry=False)
        sim, timeline = simulator_of(graph, strategy, topo)
        assert plain.replicas == 1
        assert timeline.iteration_time_ms == plain.iteration_time_ms, name
        assert timeline.peak_memory_bytes == plain.peak_memory_bytes, name
        assert timeline.bytes_moved == plain.bytes_moved, name
        assert timeline.feasible == plain.feasible
        assert sim.collectives() == plain_sim.collectives(), name
        if timeline.replicas > 1:
            quotients += 1
            assert timeline.num_tasks < plain.num_tasks
    # data parallelism, where the batch divides over the devices, is R replicas of one device
    assert quotients >= 1 or "dp" not in ran


def test_replicas_of_data_parallelism_and_of_tensor_parallel_groups():
    graph, topo = rc.graph_of("transformer"), load_topology("p100-2x2")
    assert find_replicas(graph, parse_baseline("dp")(graph, topo), 4) == Replicas(count=4, size=1)
    assert find_replicas(graph, parse_baseline("hybrid:tp=2")(graph, topo), 4) == Replicas(count=2, size=2)
    # a layout with no sample split, or one on devices that do not repeat, has no replicas
    assert find_replicas(graph, parse_baseline("mp")(graph, topo), 4) is None
    shuffled = {op.name: ParallelConfig(degrees={"sample": 2}, devices=(1, 0)) for op in graph}
    assert find_replicas(graph, Strategy(shuffled), 4) is None
    assert Replicas(count=3, size=2).expand((1,)) == (1, 3, 5)


def _falls_back(graph, strategy, topo, replicas: Replicas, reason: str) -> None:
    """`strategy` is `replicas`, the simulator of one replica refuses it for `reason`, and `simulate`
    runs the plain simulation instead."""
    assert find_replicas(graph, strategy, topo.num_devices) == replicas
    with pytest.raises(NotReplicable, match=reason):
        Simulator(graph, topo, replicas=replicas).full(strategy)
    timeline = simulate(graph, strategy, topo)
    plain = simulate(graph, strategy, topo, symmetry=False)
    assert timeline.replicas == 1
    assert timeline.num_tasks == plain.num_tasks and timeline.iteration_time_ms == plain.iteration_time_ms


def test_sharded_chunks_that_would_leave_replica_0_make_fewer_replicas():
    """hybrid:tp=2,shard=2 on a100-2x4: as 4 replicas of 2 devices, the chunks of a sharded layer would be
    all-reduced among devices of other replicas only, which replica 0's plan would leave out (a simulator
    of 4 replicas refuses it); it is 2 replicas of 4 devices, timed exactly."""
    graph, topo = rc.graph_of("mlp"), load_topology("a100-2x4")
    strategy = parse_baseline("hybrid:tp=2,shard=2")(graph, topo)
    with pytest.raises(NotReplicable, match="not 4 replicas of 2 devices"):
        Simulator(graph, topo, replicas=Replicas(count=4, size=2)).full(strategy)
    assert find_replicas(graph, strategy, topo.num_devices) == Replicas(count=2, size=4)
    timeline = simulate(graph, strategy, topo)
    plain = simulate(graph, strategy, topo, symmetry=False)
    assert timeline.replicas == 2 and timeline.num_tasks < plain.num_tasks
    assert timeline.iteration_time_ms == plain.iteration_time_ms
    assert timeline.peak_memory_bytes == plain.peak_memory_bytes


REPLICA_DELTA_CASES = [("transformer", "p100-2x2", 2, "dp", 40), ("transformer", "a100-2x4", 2, "hybrid:tp=2", 40),
                       ("mlp", "a100-2x4", 4, "hybrid:tp=2", 40), ("llama", "p100-2x2", 2, "hybrid:tp=2", 30),
                       ("rescnn", "p100-2x2", 2, "dp", 30), ("rnnlm", "p100-2x2", 2, "dp", 30)]


@pytest.mark.parametrize(("model", "topology", "count", "start", "proposals"), REPLICA_DELTA_CASES)
def test_delta_on_one_replica_equals_the_plain_full_simulation(model, topology, count, start, proposals):
    """A chain of the replica space's proposals (`search.moves` over `ConfigSpace(replicas=...)`), each
    simulated by delta on one replica and, for comparison, in full on every device: the same iteration
    time, memory per device and bytes moved; rejected proposals leave the state as it was."""
    from search.moves import Moves
    from search.space import ConfigSpace

    graph, topo = rc.graph_of(model), load_topology(topology)
    replicas = Replicas(count=count, size=topo.num_devices // count)
    current = parse_baseline(start)(graph, topo)
    moves = Moves(graph, ConfigSpace(graph, topo, replicas), [current])
    sim, plain = Simulator(graph, topo, replicas=replicas), Simulator(graph, topo)
    sim.full(current)
    rng = random.Random(f"replica-delta/{model}/{topology}")
    simulated = 0
    for k in range(proposals):
        changes = moves.propose(rng, current)
        if not changes:
            continue
        proposed = current.with_configs(changes)
        assert find_replicas(graph, proposed, topo.num_devices) is not None
        peeked = sim.peek_peaks(changes)
        t_ms = sim.propose_many(changes)
        full = plain.full(proposed)
        simulated += 1
        assert peeked == tuple(full.peak_memory_bytes), f"proposal {k}: {changes}"
        assert t_ms == full.iteration_time_ms, f"proposal {k}: {changes}"
        assert tuple(sim.peak_memory_bytes) == tuple(full.peak_memory_bytes), f"proposal {k}"
        assert sim.timeline().bytes_moved == full.bytes_moved, f"proposal {k}"
        if rng.random() < 0.5:
            sim.accept()
            current = proposed
        else:
            sim.reject()
            assert sim.strategy == current
            assert sim.iteration_time_ms == plain.full(current).iteration_time_ms
    assert simulated >= proposals // 3


def test_a_replica_simulator_refuses_proposals_that_leave_its_replicas():
    graph, topo = rc.graph_of("mlp"), load_topology("cpu-4")
    strategy = parse_baseline("dp")(graph, topo)
    sim = Simulator(graph, topo, replicas=find_replicas(graph, strategy, 4))
    before = sim.full(strategy).iteration_time_ms
    with pytest.raises(NotReplicable, match="not 4 replicas"):
        sim.propose(graph.ops[2].name, ParallelConfig.single(0))
    assert not sim.pending and sim.strategy == strategy and sim.iteration_time_ms == before
    # nor does it build a whole strategy that is not those replicas
    with pytest.raises(NotReplicable, match="not 4 replicas"):
        sim.twin().full(parse_baseline("mp")(graph, topo))


def test_replicas_whose_exchanges_share_a_link_fall_back_to_the_plain_simulation(tmp_path):
    """Two hubs joined by one link, devices 0 and 2 on one, 1 and 3 on the other: under hybrid:tp=2 the
    replicas (0, 1) and (2, 3) exchange over that one link, so replica 0 alone would time its exchanges
    without the other's: the simulation is the plain one (and equals it)."""
    graph, topo = rc.graph_of("mlp"), two_hubs_topology(tmp_path)
    strategy = parse_baseline("hybrid:tp=2")(graph, topo)
    _falls_back(graph, strategy, topo, Replicas(count=2, size=2), "share a link")
    # nor does a replica simulator make delta proposals there, whatever they change
    dp = parse_baseline("dp")(graph, topo)
    sim = Simulator(graph, topo, replicas=Replicas(count=2, size=2))
    sim.full(dp)
    op = next(op for op in graph if op.kind == "linear")
    with pytest.raises(NotReplicable, match="share a link"):
        sim.propose(op.name, dp[op.name].replace(recompute=not dp[op.name].recompute))
