"""The proposal space: only valid configs, never a split the registry refuses, uniform, lazy."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import pytest
from test_search_fixtures import GRAPHS, GraphBuilder

from search.baselines import BASELINES, BaselineNotApplicable
from search.space import ConfigSpace
from soap.config import ParallelConfig, validate
from soap.registry import dims_of, op_def
from soap.topology import load_topology

TOPOLOGIES = ["cpu-2", "cpu-3", "p100-4x4", "k80-16x4"]


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("graph_name", sorted(GRAPHS))
def test_sampled_configs_are_valid(graph_name: str, topology: str):
    graph, topo = GRAPHS[graph_name](), load_topology(topology)
    space = ConfigSpace(graph, topo)
    rng = random.Random(0)
    for _ in range(3000):
        name, cfg = space.propose(rng)
        op = graph[name]
        validate(op, cfg, topo.num_devices)
        assert op_def(op.kind).check(op, cfg.degrees) is None
        assert topo.num_devices % cfg.num_parts == 0
        assert list(cfg.devices) == sorted(cfg.devices)
        assert space.contains(name, cfg)


def test_every_config_of_small_ops_is_valid_on_64_devices():
    graph, topo = GRAPHS["cnn"](), load_topology("k80-16x4")
    space = ConfigSpace(graph, topo)
    for name in ("pool0", "flatten", "fc1", "loss"):
        configs = list(space.configs(name))
        assert len(configs) == space.num_configs(name) == len(set(configs))
        for cfg in configs:
            validate(graph[name], cfg, topo.num_devices)


def _reshape_graph():
    """x[8, 3, 4] -> reshape [8, 12]: a 2-way split of the 12 cuts a row of 4 in half (not a box)."""
    b = GraphBuilder("reshape", 8)
    x = b.input("x", (8, 3, 4))
    y = b.add("flat", "reshape", [x], (8, 12), attrs={"shape": [8, 12]})
    t = b.input("target", (8, 12), role="target")
    b.loss(y, t, fn="mse")
    return b.build()


def test_never_proposes_a_split_the_registry_refuses():
    graph, topo = _reshape_graph(), load_topology("cpu-6")
    op = graph["flat"]
    # the test has teeth: the registry refuses a split that divides the dim and the device count
    assert op_def("reshape").check(op, {"d1": 2}) is not None
    space = ConfigSpace(graph, topo)
    options = {dict(d).get("d1", 1) for d in space.degree_options("flat")}
    assert options == {1, 3, 6}  # thirds are rows of [3, 4], sixths half rows: boxes; halves are not
    for degrees in space.degree_options("flat"):
        assert op_def("reshape").check(op, dict(degrees)) is None
    rng = random.Random(1)
    for _ in range(2000):
        cfg = space.sample("flat", rng)
        assert op_def("reshape").check(op, cfg.degrees) is None


def test_degree_options_are_exactly_the_allowed_combinations():
    graph, topo = GRAPHS["cnn"](), load_topology("p100-4x4")
    space = ConfigSpace(graph, topo)
    n = topo.num_devices
    for op in graph:
        dims = [d for d in dims_of(op) if d.splittable]
        expected = set()
        for combo in itertools.product(*[[g for g in range(1, n + 1) if n % g == 0 and d.size % g == 0]
                                         for d in dims]):
            if n % math.prod(combo):
                continue
            degrees = {d.name: g for d, g in zip(dims, combo, strict=True) if g > 1}
            if op_def(op.kind).check(op, degrees) is None:
                expected.add(tuple(degrees.items()))
        if op_def(op.kind).everywhere:
            continue
        assert set(space.degree_options(op.name)) == expected, op.name


def test_reduction_splits_are_in_the_space():
    graph, topo = GRAPHS["mlp"](), load_topology("p100-4x4")
    space = ConfigSpace(graph, topo)
    degrees = [dict(d) for d in space.degree_options("fc1")]
    assert {"in_features": 16} in degrees
    assert {"sample": 2, "out_features": 2, "in_features": 4} in degrees


def test_device_sets_are_contiguous_or_node_aligned():
    topo = load_topology("k80-16x4")
    space = ConfigSpace(GRAPHS["mlp"](), topo)
    sixteen = set(space.device_sets(16))
    assert tuple(range(16)) in sixteen and tuple(range(48, 64)) in sixteen
    assert tuple(range(0, 64, 4)) in sixteen and tuple(range(3, 64, 4)) in sixteen  # one per node
    assert tuple(d for n in range(8) for d in (4 * n, 4 * n + 1)) in sixteen  # two per node, 8 nodes
    assert len(sixteen) == len(space.device_sets(16))
    for devices in sixteen:
        contiguous = devices == tuple(range(devices[0], devices[0] + 16))
        nodes = sorted({d // 4 for d in devices})
        locals_ = {tuple(d % 4 for d in devices if d // 4 == n) for n in nodes}
        aligned = len(locals_) == 1 and nodes == list(range(nodes[0], nodes[-1] + 1))
        assert contiguous or aligned, devices
    assert space.device_sets(64) == (tuple(range(64)),)
    assert len(space.device_sets(1)) == 64
    # a single node has no node-aligned sets beyond the contiguous ones
    assert len(ConfigSpace(GRAPHS["mlp"](), load_topology("cpu-4")).device_sets(2)) == 3


def test_sampling_is_uniform():
    graph, topo = GRAPHS["mlp"](), load_topology("cpu-4")
    space = ConfigSpace(graph, topo)
    configs = list(space.configs("fc0"))
    rng = random.Random(7)
    draws = 200 * len(configs)
    counts = Counter(space.sample("fc0", rng) for _ in range(draws))
    assert set(counts) == set(configs)
    # each count is Binomial(draws, 1/k): mean 200, sd ~14; 6 sd either way
    assert all(110 < c < 290 for c in counts.values()), counts


def test_space_is_lazy():
    graph, topo = GRAPHS["cnn"](), load_topology("k80-16x4")
    space = ConfigSpace(graph, topo)
    assert space.ops and not space._degrees and not space._device_sets
    space.sample("fc1", random.Random(0))
    assert set(space._degrees) == {"fc1"}


@pytest.mark.parametrize("topology", ["cpu-2", "p100-4x4", "k80-16x4"])
@pytest.mark.parametrize("graph_name", sorted(GRAPHS))
def test_baselines_lie_in_the_space(graph_name: str, topology: str):
    """Chains start from baselines; their configs must be states the chain can return to."""
    graph, topo = GRAPHS[graph_name](), load_topology(topology)
    space = ConfigSpace(graph, topo)
    for name, make in BASELINES.items():
        try:
            strategy = make(graph, topo)
        except BaselineNotApplicable:
            continue
        for op in space.ops:
            assert space.contains(op, strategy[op]), (name, op, strategy[op])


def test_random_strategy_and_single_device():
    graph = GRAPHS["rnn"]()
    topo = load_topology("p100-4x4")
    space = ConfigSpace(graph, topo)
    base = BASELINES["expert"](graph, topo)
    strategy = space.random_strategy(random.Random(3), base)
    assert list(strategy) == [op.name for op in graph]
    for op in graph:
        validate(op, strategy[op.name], topo.num_devices)
    one = ConfigSpace(graph, load_topology("cpu-1"))
    # on one device the only choice left is recomputation
    assert set(one.ops) == {op.name for op in graph if op.kind not in ("input", "constant")}
    assert list(one.configs("embed")) == [ParallelConfig.single(0), ParallelConfig.single(0).replace(recompute=True)]


def test_random_strategy_redraws_only_the_ops_asked_for():
    graph = GRAPHS["rnn"]()
    topo = load_topology("p100-4x4")
    space = ConfigSpace(graph, topo)
    base = BASELINES["dp"](graph, topo)
    some = space.ops[::2]
    strategy = space.random_strategy(random.Random(5), base, ops=some)
    assert list(strategy) == [op.name for op in graph]
    assert all(strategy[name] == base[name] for name in strategy if name not in some)
    assert any(strategy[name] != base[name] for name in some)
    # the draws are the ones a full redraw makes for the same ops in the same order
    rng = random.Random(5)
    assert [strategy[name] for name in some] == [space.sample(name, rng) for name in some]
