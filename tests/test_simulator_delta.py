"""Reference equivalence: delta simulation equals full simulation exactly, over random one-op proposals.

Each case runs a chain of random proposals (a random op, a random valid config) on one `Simulator` and
checks every proposal against a fresh full simulation of the proposed strategy on a second one: the
iteration time and peak memory per device bit for bit (integer nanoseconds, bytes), plus bytes moved and
the task count; every `CHECK_TIMES_EVERY`-th proposal also every task's start and end and the summary.
Proposals are accepted or rejected at random, and after a reject the restored state is checked against
the strategy it came back to. The default run makes >= 1,000 proposals over builder graphs and two
captured zoo models on cpu-2, p100-4x4 and k80-16x4; `-m slow` runs a longer chain on inception_v3.
"""

from __future__ import annotations

import math
import random

import pytest
from test_simulator_support import chain, data_parallel, mlp, random_config, random_strategy, small_cnn

from search.space import ConfigSpace
from simulator import AnalyticalCostModel, FixedCostModel, Simulator
from soap.graph import Operator, OperatorGraph, ParamSpec
from soap.setup import TrainSetup
from soap.topology import DeviceTopology, load_topology

CHECK_TIMES_EVERY = 10


def _state(sim: Simulator) -> tuple:
    return (sim._iteration_ns, sim.peak_memory_bytes, sim._moved, sim.num_tasks)


def _walk_links(sim: Simulator) -> tuple[list, list]:
    """The round order's edges and remembered states as the simulator keeps them (walked again from an
    earlier walk where a proposal left the order as it was)."""
    walk = sim._walk
    return ([], []) if walk is None else (walk.all_links(), walk.states)


def _fresh_walk(sim: Simulator) -> tuple[list, list]:
    """The round order's edges and states of a walk from scratch over the simulator's tasks."""
    walk, cut, made = sim._walk_rounds()
    assert not cut
    return ([], []) if walk is None else (made, walk.states)


def _compute_ms(timeline) -> float:
    """The most forward, backward and update time any one device has, from the simulated tasks."""
    per: dict[int, float] = {}
    for task in timeline.tasks():
        if task.category in ("forward", "backward", "update"):
            for d in task.devices:
                per[d] = per.get(d, 0.0) + task.end_ms - task.start_ms
    return max(per.values(), default=0.0)


def propose_and_check(sim: Simulator, ref: Simulator, current, name: str, cfg, k: int,
                      every: int = CHECK_TIMES_EVERY):
    """Propose `cfg` for op `name` (proposal `k`) to `sim` and check it against `ref`'s full simulation of
    the proposed strategy (every `every`-th proposal, every task too); returns the proposed strategy."""
    proposed = current.with_config(name, cfg)
    peeked = sim.peek_peaks({name: cfg})  # the memory from the plans alone, changing nothing
    assert sim.strategy == current and sim.pending is False
    t_ms = sim.propose(name, cfg)
    full = ref.full(proposed)
    assert sim.strategy == proposed
    assert peeked == ref.peak_memory_bytes, f"proposal {k}: {name} -> {cfg}"
    assert t_ms == full.iteration_time_ms, f"proposal {k}: {name} -> {cfg}"
    assert _state(sim) == _state(ref), f"proposal {k}: {name} -> {cfg}"
    assert _walk_links(sim) == _fresh_walk(sim), f"proposal {k}: {name} -> {cfg}"
    if k % every == 0:
        delta = sim.timeline()
        assert delta.task_times() == full.task_times(), f"proposal {k}: {name} -> {cfg}"
        assert delta.summary() == full.summary()
    return proposed


def accept_or_reject(sim: Simulator, ref: Simulator, current, proposed, k: int, rng: random.Random,
                     every: int = CHECK_TIMES_EVERY, *, check_times: bool = False):
    """Accept or reject proposal `k` at random; after a rejection (every `every`-th) check `sim` against a
    full simulation of `current` (with `check_times`, every task too). Returns the chain's strategy."""
    if rng.random() < 0.5:
        sim.accept()
        return proposed
    sim.reject()
    assert sim.strategy == current
    if k % every == 1:
        ref.full(current)
        assert _state(sim) == _state(ref), f"after rejecting proposal {k}"
        if check_times:
            assert sim.timeline().task_times() == ref.timeline().task_times()
    return current


def run_chain(graph: OperatorGraph, topology: DeviceTopology, *, proposals: int, seed: int, cost_model=None,
              start: str = "dp", sampler: str = "support", setup: TrainSetup | None = None) -> int:
    """Run `proposals` random proposals; return how many changed the config (not no-ops)."""
    rng = random.Random(seed)
    cost_model = cost_model or AnalyticalCostModel()
    sim = Simulator(graph, topology, cost_model, setup=setup)
    ref = Simulator(graph, topology, cost_model, setup=setup)
    devices = tuple(range(topology.num_devices))
    current = random_strategy(graph, topology, rng) if start == "random" else data_parallel(graph, devices)
    sim.full(current)
    space = ConfigSpace(graph, topology)
    names = list(space.ops) or [op.name for op in graph]
    changed = 0
    for k in range(proposals):
        if sampler == "space":
            name, cfg = space.propose(rng)
        else:
            name = rng.choice(names)
            cfg = random_config(graph[name], topology.num_devices, rng)
        changed += cfg != current[name]
        proposed = propose_and_check(sim, ref, current, name, cfg, k)
        current = accept_or_reject(sim, ref, current, proposed, k, rng)
    # the final state, every task, against a fresh simulator
    fresh = Simulator(graph, topology, cost_model, setup=setup).full(current)
    assert sim.timeline().task_times() == fresh.task_times()
    return changed


BUILDER_CASES = [
    # (graph, topology, start, sampler, proposals): 64-device cases are the costly ones (a full reference
    # simulation per proposal), so they get fewer proposals
    ("mlp", "cpu-2", "dp", "support", 250),
    ("mlp", "p100-4x4", "random", "space", 150),
    ("chain", "p100-4x4", "dp", "space", 60),
    ("chain", "k80-16x4", "dp", "space", 25),
    ("small_cnn", "cpu-2", "random", "support", 200),
    ("small_cnn", "p100-4x4", "dp", "space", 80),
    ("small_cnn", "k80-16x4", "dp", "support", 15),
]
BUILDERS = {"mlp": lambda: mlp(batch=64), "chain": lambda: chain(batch=64, depth=6), "small_cnn": small_cnn}


@pytest.mark.parametrize(("graph_name", "topology", "start", "sampler", "proposals"), BUILDER_CASES)
def test_delta_equals_full_on_builder_graphs(graph_name, topology, start, sampler, proposals):
    graph = BUILDERS[graph_name]()
    changed = run_chain(graph, load_topology(topology), proposals=proposals, seed=len(graph_name) + proposals,
                        start=start, sampler=sampler)
    assert changed >= proposals // 2


def test_delta_equals_full_under_the_fixed_cost_model():
    """Equal durations everywhere make ready-time ties common: the static keys must break them alike."""
    graph = small_cnn()
    run_chain(graph, load_topology("p100-4x4"), proposals=60, seed=7,
              cost_model=FixedCostModel(fwd_each_ms=0.01, bwd_each_ms=0.02, update_each_ms=0.005,
                                        reduce_each_ms=0.001))


def tied_chain() -> OperatorGraph:
    """A chain whose layers 1, 3 and 5 share one weight (and layers 2 and 4 another): parameter units of
    several ops, whose shards overlap when their ops split differently."""
    graph = chain(batch=64, width=64, depth=6)
    share = {"fc3": "fc1", "fc5": "fc1", "fc4": "fc2"}
    ops = [Operator(name=op.name, kind=op.kind, inputs=op.inputs, outputs=op.outputs, attrs=op.attrs,
                    module=op.module, fwd_flops=op.fwd_flops, bwd_flops=op.bwd_flops, fwd_bytes=op.fwd_bytes,
                    bwd_bytes=op.bwd_bytes,
                    params={k: ParamSpec(shape=p.shape, dtype=p.dtype,
                                         fqn=p.fqn.replace(op.name, share.get(op.name, op.name), 1))
                            for k, p in op.params.items()})
           for op in graph]
    return OperatorGraph(ops, name="tied_chain", batch_size=graph.batch_size)


@pytest.mark.parametrize(("topology", "setup", "proposals"), [
    ("cpu-2", TrainSetup(bucket_mb=0.01), 150),
    ("p100-4x4", TrainSetup(optimizer="adamw", bucket_mb=0.02), 80),
])
def test_delta_equals_full_with_tied_parameters_and_small_buckets(topology, setup, proposals):
    """Tied weights make one change re-lower its whole parameter unit; small buckets make an op's
    all-reduces many and shared with other ops."""
    graph = tied_chain()
    assert any(len(members) > 1 for members in Simulator(graph, load_topology(topology)).flow.units)
    changed = run_chain(graph, load_topology(topology), proposals=proposals, seed=proposals, sampler="space",
                        setup=setup)
    assert changed >= proposals // 2


def test_the_default_run_makes_at_least_1000_proposals():
    assert sum(c[-1] for c in BUILDER_CASES) + 60 + sum(c[-1] for c in ZOO_CASES) >= 1000


@pytest.fixture(scope="module")
def zoo_graphs() -> dict[str, OperatorGraph]:
    from soapflow.api import capture_model

    return {name: capture_model(name, batch_size=batch)[1] for name, batch in (("resnet18", 16), ("rnnlm", 8))}


ZOO_CASES = [("resnet18", "p100-4x4", 40), ("rnnlm", "k80-16x4", 60), ("resnet18", "cpu-2", 200)]


@pytest.mark.parametrize(("model", "topology", "proposals"), ZOO_CASES)
def test_delta_equals_full_on_zoo_models(zoo_graphs, model, topology, proposals):
    changed = run_chain(zoo_graphs[model], load_topology(topology), proposals=proposals, seed=proposals,
                        sampler="space")
    assert changed >= proposals // 2


@pytest.mark.slow
def test_delta_equals_full_on_inception_v3_long_chain():
    from soapflow.api import capture_model

    _, graph = capture_model("inception_v3", batch_size=64)
    run_chain(graph, load_topology("p100-4x4"), proposals=200, seed=1, sampler="space")


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["p100-4x4", "k80-16x4"])
def test_delta_equals_full_from_random_strategies_long(topology):
    """Random starting strategies on many devices make all-to-all resharding: thousands of transfers."""
    run_chain(chain(batch=64, depth=6), load_topology(topology), proposals=60, seed=3, start="random")
    run_chain(small_cnn(), load_topology(topology), proposals=60, seed=4, start="random")


# --------------------------------------------------------------------------- several ops in one proposal


def run_many_chain(graph: OperatorGraph, topology: DeviceTopology, *, proposals: int, seed: int,
                   setup: TrainSetup | None = None, structural: bool = False) -> int:
    """Like `run_chain`, with proposals over several ops at once (`Simulator.propose_many`): the search's
    moves (`structural`: tied, copy, propagation, module, stage and single moves) or 2-6 ops drawn at
    random, half the time consecutive ones (so that changed ops share edges). Half the proposals are
    lazy, and half of those are rejected before anything is timed; the time bound and memory are checked
    before any replay. Half the lazy ones are first timed against a limit near their time
    (`time_within_ms`: exact, or a lower bound above the limit where the replay stopped early). Returns
    how many proposals changed two ops or more, and how many replays stopped early."""
    from search.moves import Moves

    rng = random.Random(seed)
    sim = Simulator(graph, topology, setup=setup)
    ref = Simulator(graph, topology, setup=setup)
    current = data_parallel(graph, tuple(range(topology.num_devices)))
    sim.full(current)
    space = ConfigSpace(graph, topology)
    moves = Moves(graph, space, [current])
    names = list(space.ops)
    several = stopped = 0
    for k in range(proposals):
        if structural:
            changes = moves.propose(rng, current)
        else:
            n = rng.randint(2, min(6, len(names)))
            if rng.random() < 0.5:
                first = rng.randrange(len(names) - n + 1)
                picked = names[first:first + n]
            else:
                picked = rng.sample(names, n)
            changes = {name: space.propose_for(name, rng, current) for name in picked}
        several += sum(cfg != current[name] for name, cfg in changes.items()) >= 2
        proposed = current.with_configs(changes)
        lazy = rng.random() < 0.5
        peeked, work = sim.peek_peaks(changes), sim.work_bound_ms(changes)
        t_ms = sim.propose_many(changes, lazy=lazy)
        full = ref.full(proposed)
        assert sim.strategy == proposed
        assert peeked == ref.peak_memory_bytes, f"proposal {k}: {changes}"
        assert work == pytest.approx(_compute_ms(full), rel=1e-9, abs=1e-9) and work <= full.iteration_time_ms
        # the bound and the memory are known before any replay, and equal a fresh build's
        assert sim.time_bound_ms == ref.time_bound_ms <= full.iteration_time_ms, f"proposal {k}: {changes}"
        assert sim.peak_memory_bytes == ref.peak_memory_bytes
        if lazy:
            assert t_ms is None
            if rng.random() < 0.5:  # timed against a limit: a replay may stop as soon as it shows the step longer
                limit = full.iteration_time_ms * rng.uniform(0.9, 1.02)
                got, exact = sim.time_within_ms(limit)
                if exact or full.iteration_time_ms <= limit:
                    assert exact and got == full.iteration_time_ms, f"proposal {k}: {changes}"
                else:
                    assert limit < got <= full.iteration_time_ms, f"proposal {k}: {changes}"
                    stopped += 1
                assert sim.time_bound_ms == ref.time_bound_ms and sim.peak_memory_bytes == ref.peak_memory_bytes
            if rng.random() < 0.5:  # rejected unreplayed: the state is the current one again
                sim.reject()
                assert sim.strategy == current
                ref.full(current)
                assert _state(sim) == _state(ref) and sim.time_bound_ms == ref.time_bound_ms
                if k % CHECK_TIMES_EVERY == 0:
                    assert sim.timeline().task_times() == ref.timeline().task_times()
                continue
            t_ms = sim.iteration_time_ms
        assert t_ms == full.iteration_time_ms, f"proposal {k}: {changes}"
        assert _state(sim) == _state(ref), f"proposal {k}: {changes}"
        if k % CHECK_TIMES_EVERY == 0:
            assert sim.timeline().task_times() == full.task_times(), f"proposal {k}: {changes}"
        current = accept_or_reject(sim, ref, current, proposed, k, rng, check_times=True)
    fresh = Simulator(graph, topology, setup=setup).full(current)
    assert sim.timeline().task_times() == fresh.task_times()
    return several, stopped


@pytest.mark.parametrize(("graph_name", "topology", "proposals"), [
    ("mlp", "cpu-2", 120), ("chain", "p100-4x4", 60), ("small_cnn", "p100-4x4", 40)])
def test_delta_over_several_ops_equals_full(graph_name, topology, proposals):
    several, stopped = run_many_chain(BUILDERS[graph_name](), load_topology(topology), proposals=proposals,
                                      seed=proposals)
    assert several >= proposals // 2 and stopped >= 3


def test_delta_over_several_ops_with_tied_parameters():
    """Two ops of one parameter unit changed in one proposal re-lower the unit twice."""
    several, stopped = run_many_chain(tied_chain(), load_topology("p100-4x4"), proposals=80, seed=5,
                                      setup=TrainSetup(optimizer="adamw", bucket_mb=0.02))
    assert several >= 40 and stopped >= 3


@pytest.mark.parametrize(("model", "topology", "proposals"), [("rnnlm", "p100-4x4", 60),
                                                             ("transformer", "cpu-2", 80)])
def test_delta_of_the_search_moves_equals_full(zoo_graphs, model, topology, proposals):
    """The search's moves (tied moves over every layer, stage moves into micro-batches, chunks)."""
    graph = zoo_graphs[model] if model in zoo_graphs else _zoo_graph(model)
    several, stopped = run_many_chain(graph, load_topology(topology), proposals=proposals, seed=proposals,
                                      structural=True)
    assert several >= proposals // 8 and stopped >= 3


def _zoo_graph(name: str) -> OperatorGraph:
    from soapflow.api import capture_model

    return capture_model(name, batch_size=8)[1]


def test_a_limit_in_ms_becomes_the_largest_ns_count_within_it():
    from simulator.engine import _NEW, _ns_limit
    rng = random.Random(0)
    for limit in [0.0, 1e-6, 0.1 + 0.2, 810.433034, 2367.333574, 1e7 / 3] + [rng.uniform(0, 5000) for _ in range(200)]:
        n = _ns_limit(limit)
        assert n / 1e6 <= limit < (n + 1) / 1e6, limit
    assert _ns_limit(math.inf) == _NEW


def test_a_config_checked_for_one_op_is_still_checked_for_another():
    """`Simulator.check_config` remembers the (op, config) pairs it passed, per op: a config that splits a
    linear's input features passes for that linear and is still refused for the elementwise op after it
    (which has no such dim), on the simulator and on its twin (which shares what was checked); a refused
    config stays refused when asked again."""
    from soap.config import ParallelConfig
    from soap.strategy import StrategyError
    graph = mlp(batch=32)
    sim = Simulator(graph, load_topology("cpu-2"))
    sim.full(data_parallel(graph, (0, 1)))
    split = ParallelConfig(degrees={"in_features": 2}, devices=(0, 1))
    assert sim.check_config("fc0", split) == 1
    for simulator in (sim, sim.twin(), sim):
        with pytest.raises(StrategyError):
            simulator.check_config("relu0", split)
    before = sim.iteration_time_ms
    with pytest.raises(StrategyError):
        sim.propose_many({"fc0": split, "relu0": split})
    assert not sim.pending and sim.iteration_time_ms == before
