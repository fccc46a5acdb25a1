"""Copies of an op share their plans: the planner's plan for a copy equals the one it makes for that op alone.

`GradFlow.op_class` and `edge_class` group the copies of a repeated block (the layers of the zoo's
transformer). The planner lowers (and, under a cost model that prices by computation, prices) a config
once per class; every other copy's plan is the first one with its own task keys. Each check below asks a
planner that has already planned a copy, and a fresh planner that plans the op alone, for the same op
(or edge) under the same config(s), and compares every field of the two plans.
"""

from __future__ import annotations

import random
from collections import defaultdict

import numpy as np
import pytest

from search.space import ConfigSpace
from simulator import AnalyticalCostModel, FixedCostModel, Simulator
from simulator.taskgraph import Planner
from soap.topology import load_topology

TOPO = load_topology("p100-4x4")


@pytest.fixture(scope="module")
def gpt():
    from soapflow.api import capture_model

    return capture_model("transformer", batch_size=8)[1]


def _plain(value):
    if isinstance(value, np.ndarray):
        return ("array", value.shape, value.tolist())
    if isinstance(value, list | tuple):
        return type(value).__name__, [_plain(v) for v in value]
    if isinstance(value, dict):
        return "dict", sorted((k, _plain(v)) for k, v in value.items())
    return value


def _fields(obj, skip=("_in_overlap", "_out_overlap")) -> dict:
    """Every slot of a plan or a lowering, nested lowerings included, as plain values."""
    out = {}
    for name in type(obj).__slots__:
        if name in skip:
            continue
        value = getattr(obj, name)
        out[name] = _fields(value) if hasattr(type(value), "__slots__") and not isinstance(value, tuple) \
            else _plain(value)
    return out


def _fresh(sim: Simulator) -> Planner:
    return Planner(sim.flow, sim.topology, sim.cost_model, sim.keys, sim.comm)


def _classes(members: list[int]) -> dict[int, list[int]]:
    by = defaultdict(list)
    for i, c in enumerate(members):
        by[c].append(i)
    return {c: m for c, m in by.items() if len(m) > 1}


def test_the_transformer_s_layers_are_copies(gpt):
    sim = Simulator(gpt, TOPO)
    ops = _classes(sim.flow.op_class)
    names = {gpt.ops[m[0]].name: [gpt.ops[i].name for i in m] for m in ops.values()}
    # most ops have copies, and the first layer's attention projection is one class with its copies
    assert sum(len(m) for m in ops.values()) >= len(gpt) // 2
    layers = 1 + max(int(op.name.split(".")[1]) for op in gpt if op.name.startswith("blocks."))
    assert layers >= 2
    assert [f"blocks.{k}.attn.proj" for k in range(layers)] in names.values()
    assert _classes(sim.flow.edge_class)


@pytest.mark.parametrize("cost_model", [AnalyticalCostModel(), FixedCostModel(fwd_each_ms=1.0)])
def test_a_copy_s_plans_equal_its_own(gpt, cost_model):
    sim = Simulator(gpt, TOPO, cost_model)
    flow, planner = sim.flow, sim.planner
    space = ConfigSpace(gpt, TOPO)
    rng = random.Random(0)
    targets = set(space.ops)
    classes = [m for m in _classes(flow.op_class).values() if flow.ops[m[0]].name in targets]
    checked_ops = checked_edges = 0
    for _ in range(40):
        members = rng.choice(classes)
        cfg = space.sample(flow.ops[members[0]].name, rng)
        for i in members:
            assert _fields(planner.op_plan(i, cfg)) == _fields(_fresh(sim).op_plan(i, cfg)), flow.ops[i].name
            checked_ops += 1
    edge_classes = [m for m in _classes(flow.edge_class).values()
                    if all(flow.ops[i].name in targets for i in (flow.edges[m[0]].src, flow.edges[m[0]].dst))]
    for _ in range(40):
        members = rng.choice(edge_classes)
        first = flow.edges[members[0]]
        pcfg = space.sample(flow.ops[first.src].name, rng)
        ccfg = space.sample(flow.ops[first.dst].name, rng)
        for e in members:
            got = planner.edge_plan(e, pcfg, ccfg)
            assert got.step.edge == e
            assert _fields(got) == _fields(_fresh(sim).edge_plan(e, pcfg, ccfg))
            checked_edges += 1
    assert checked_ops >= 80 and checked_edges >= 80


def test_a_cost_model_that_prices_by_name_does_not_share_prices(gpt):
    flow = Simulator(gpt, TOPO).flow
    members = next(m for m in _classes(flow.op_class).values() if flow.ops[m[0]].kind == "linear")
    a, b = (flow.ops[i].name for i in members[:2])
    costs = FixedCostModel(fwd_each_ms=1.0, per_op_ms={b: 7.0})
    assert not costs.by_computation and FixedCostModel().by_computation
    sim = Simulator(gpt, TOPO, costs)
    cfg = ConfigSpace(gpt, TOPO).sample(a, random.Random(1))
    first = sim.planner.op_plan(members[0], cfg)
    second = sim.planner.op_plan(members[1], cfg)
    assert set(first.fwd_ns) == {1_000_000} and set(second.fwd_ns) == {7_000_000}
    # the lowering itself is still shared (it never depends on the cost model)
    assert _fields(second.step) == _fields(_fresh(sim).op_plan(members[1], cfg).step)
