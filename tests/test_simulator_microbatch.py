"""Micro-batches and pipelines in the simulator: configs whose devices repeat, so that a device runs several
parts of one op one after another (`soap.lowering`'s rules "Rounds" and "Order").

- An edge's exchange tasks are one per consumer round and pass (`EdgeStep.exchanges`), each after only
  the parts that send its pieces; their count is the plan's all-to-alls, the memory per device the plan's.
- On every device the rounds follow the step's order (GPipe's), so a pipeline pipelines: a chain of
  linears in two stages, each op in M micro-batches, takes about (M + P - 1) times one stage's micro-batch
  time, faster than M = 1.
- Delta simulation equals the full simulation exactly over random proposals whose configs repeat devices,
  on builder graphs and captured zoo models, several topologies, with tied ready times and with tasks of
  zero duration (`Simulator._unsorted`).
- A data-parallel strategy with micro-batches is simulated by one replica exactly, or falls back to the
  plain simulation: the same figures either way.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import random

import pytest
import runtime_cases as rc
from test_simulator_delta import accept_or_reject, propose_and_check
from test_simulator_support import Net, chain, data_parallel, mlp, random_config, small_cnn

import simulator.taskgraph as taskgraph
from search.baselines import BaselineNotApplicable, parse_baseline
from simulator import AnalyticalCostModel, FixedCostModel, Simulator
from simulator.engine import simulate, simulator_of
from simulator.roundwalk import CHECKPOINT
from soap.config import ConfigError, ParallelConfig, validate
from soap.graph import Operator, OperatorGraph
from soap.lowering import lower
from soap.registry import dims_of, op_def
from soap.setup import TrainSetup
from soap.strategy import Strategy, StrategyError
from soap.topology import DeviceTopology, load_topology
from soapflow.cli import main

MS = 1_000_000


# -- random configs whose devices repeat -------------------------------------------------------------------


def _valid(op: Operator, cfg: ParallelConfig, num_devices: int) -> ParallelConfig | None:
    try:
        validate(op, cfg, num_devices)
    except ConfigError:
        return None  # (running statistics refuse repeated devices)
    return cfg


def repeated_config(op: Operator, num_devices: int, rng: random.Random) -> ParallelConfig | None:
    """A random config whose devices may repeat, None when the op refuses it: a sample split finer than the
    devices, devices drawn with replacement; any random split with its devices drawn with replacement; or a
    random valid config whose sample chunks are cut into micro-batches on the chunk's device (as
    ``hybrid:...,microbatches=M`` does)."""
    dims = dims_of(op)
    sample = next((d for d in dims if d.name == "sample" and d.splittable), None)
    mode = rng.randrange(3)
    if mode == 0 and sample is not None:
        options = [g for g in range(2, min(sample.size, 4 * num_devices) + 1) if sample.size % g == 0]
        if options:
            g = rng.choice(options)
            devices = tuple(rng.randrange(num_devices) for _ in range(g))
            return _valid(op, ParallelConfig(degrees={"sample": g}, devices=devices), num_devices)
    base = random_config(op, num_devices, rng)
    if mode == 1 or sample is None:
        devices = tuple(rng.randrange(num_devices) for _ in base.devices)
        return _valid(op, base.replace(devices=devices), num_devices)
    k = base.degree("sample")
    options = [m for m in (2, 3, 4) if sample.size % (k * m) == 0]
    if not options:
        return None
    m = rng.choice(options)
    names = [d.name for d in dims]
    s = names.index("sample")
    inner = [base.degree(name) for name in names]
    outer = list(inner)
    outer[s] = k * m
    device_of = dict(zip(itertools.product(*(range(g) for g in inner)), base.devices, strict=True))
    devices = []
    for idx in itertools.product(*(range(g) for g in outer)):  # part order; micro-batch outermost
        devices.append(device_of[idx[:s] + (idx[s] % k,) + idx[s + 1:]])
    degrees = {name: g for name, g in zip(names, outer, strict=True) if g > 1}
    if op_def(op.kind).check(op, degrees) is not None:
        return None
    return _valid(op, ParallelConfig(degrees=degrees, devices=tuple(devices)), num_devices)


def chunked_config(op: Operator, num_devices: int, rng: random.Random) -> ParallelConfig | None:
    """A random split of `op`'s carried dim into chunks (None without one): its sample dim split over
    random devices (repeats allowed), each sample range's chunks on its device half the time, else every
    chunk on a random device (states moving between devices)."""
    carried = next((d for d in dims_of(op) if d.carried), None)
    if carried is None:
        return None
    size = op.outputs[0].shape[0]
    samples = rng.choice([g for g in range(1, min(size, 2 * num_devices) + 1) if size % g == 0])
    chunks = rng.choice([g for g in range(2, carried.size + 1) if carried.size % g == 0])
    devices = tuple(d for d in (rng.randrange(num_devices) for _ in range(samples)) for _ in range(chunks))
    if rng.random() < 0.5:
        devices = tuple(rng.randrange(num_devices) for _ in devices)
    return _valid(op, ParallelConfig(degrees={"sample": samples, carried.name: chunks}, devices=devices),
                  num_devices)


def draw_config(op: Operator, num_devices: int, rng: random.Random, p_repeat: float) -> ParallelConfig:
    if any(d.carried for d in dims_of(op)) and rng.random() < 0.5:
        cfg = chunked_config(op, num_devices, rng)
        if cfg is not None:
            return cfg
    if rng.random() < p_repeat:
        cfg = repeated_config(op, num_devices, rng)
        if cfg is not None:
            return cfg
    return random_config(op, num_devices, rng)


def repeats(cfg: ParallelConfig) -> bool:
    return len(set(cfg.devices)) < len(cfg.devices)


def test_repeated_configs_are_valid_and_repeat():
    rng = random.Random(0)
    drawn = 0
    for graph in (mlp(), chain(), small_cnn()):
        for op in graph:
            for _ in range(10):
                cfg = repeated_config(op, 4, rng)
                if cfg is not None:
                    validate(op, cfg, 4)
                    drawn += repeats(cfg)
    assert drawn >= 100


# -- exchanges per round, collectives, memory ----------------------------------------------------------


def two_stages(graph: OperatorGraph, micro: int, stage_of) -> Strategy:
    """Every op whole per micro-batch: a sample split `micro` ways on its stage's device (`stage_of(op)`)."""
    configs = {}
    for op in graph:
        d = stage_of(op)
        configs[op.name] = (ParallelConfig(degrees={"sample": micro}, devices=(d,) * micro) if micro > 1
                            else ParallelConfig.single(d))
    return Strategy(configs)


def times(timeline) -> dict[str, tuple[int, int]]:
    return {r.name: (round(r.start_ms * MS), round(r.end_ms * MS)) for r in timeline.tasks()}


def test_an_edge_exchanges_once_per_consumer_round_after_only_the_parts_it_reads():
    """fc0 and relu0 on device 0, the rest on device 1, 4 micro-batches each: the edge relu0 -> fc1 crosses
    in 4 forward and 4 backward exchanges; round r's forward exchange waits for relu0's part r (and, as
    the runtime's all-to-all, for what each of its devices does before it in the step's order), never for
    relu0's later parts, and fc1's part r waits for it; device 0, which only sends in it, does not."""
    graph = mlp(batch=64, sizes=(32, 64, 64, 32))
    stage = {"x": 0, "fc0": 0, "relu0": 0, "fc1": 1, "relu1": 1, "fc2": 1, "y": 1, "loss": 1}
    strategy = two_stages(graph, 4, lambda op: stage[op.name])
    topo = load_topology("p100-1x2")
    sim = Simulator(graph, topo, FixedCostModel(fwd_each_ms=1.0, bwd_each_ms=2.0))
    timeline = sim.full(strategy)
    got = times(timeline)
    names = ["relu0 -> fc1"] + [f"relu0 -> fc1 round {r}" for r in range(1, 4)]
    grads = ["grad fc1 -> relu0"] + [f"grad fc1 -> relu0 round {r}" for r in range(1, 4)]
    assert set(names + grads) <= set(got)
    for r, (fwd, bwd) in enumerate(zip(names, grads, strict=True)):
        assert got[fwd][0] >= got[f"relu0 fwd[{r}]"][1]
        assert got[f"fc1 fwd[{r}]"][0] >= got[fwd][1]
        assert got[bwd][0] >= got[f"fc1 bwd[{r}]"][1]
        assert got[f"relu0 bwd[{r}]"][0] >= got[bwd][1]
        if r < 3:  # device 0 only sends: it goes on with the next micro-batch at once
            assert got[f"fc0 fwd[{r + 1}]"][0] == got[f"relu0 fwd[{r}]"][1]
    assert got[names[0]][0] == got["relu0 fwd[0]"][1]  # the first right after the part it reads
    # the last micro-batch's gradient goes back first, right after the backward that sends it
    assert got[grads[3]][0] == got["fc1 bwd[3]"][1]
    plan = sim.step_plan()
    exchanges = sum(len(step.exchanges) * (2 if step.grad else 1) for step in plan.edges)
    transfers = [r for r in timeline.tasks() if r.category == "transfer"]
    assert len(transfers) == exchanges == 8
    assert sum(d["all_to_all"]["count"] for d in plan.collectives()) == 2 * exchanges
    # keys are unique: every task has its own
    assert len(timeline.task_times()) == timeline.num_tasks


@pytest.mark.parametrize(("model", "topology", "spec"), [
    ("mlp", "cpu-2", "hybrid:tp=1,pp=2,microbatches=4"),
    ("transformer", "cpu-4", "hybrid:tp=2,pp=2,microbatches=2"),
    ("rnnlm", "p100-2x2", "hybrid:tp=1,pp=2,microbatches=2"),
    ("mlp", "p100-2x2", "hybrid:tp=1,microbatches=2"),
])
def test_collectives_memory_and_exchange_tasks_agree_with_the_step_plan(model, topology, spec):
    graph, topo = rc.graph_of(model), load_topology(topology)
    strategy = parse_baseline(spec)(graph, topo)
    assert any(repeats(strategy[op.name]) for op in graph)
    sim, timeline = simulator_of(graph, strategy, topo, symmetry=False)
    plan = lower(graph, strategy, TrainSetup(), topo.num_devices)
    assert sim.collectives() == plan.collectives()
    assert list(timeline.peak_memory_bytes) == plan.memory_bytes()
    transfers = [r for r in timeline.tasks() if r.category == "transfer"]
    assert len(transfers) == sum(len(step.exchanges) * (2 if step.grad else 1) for step in plan.edges)
    assert len(timeline.task_times()) == timeline.num_tasks
    # every part's forward and backward is a task on its device, each device one task at a time
    parts = sum(len(step.devices) * (1 + step.runs_bwd) for step, op in zip(plan.ops, graph, strict=True)
                if not op_def(op.kind).everywhere)
    assert sum(r.category in ("forward", "backward") for r in timeline.tasks()) == parts
    for d in range(topo.num_devices):
        mine = sorted((r.start_ms, r.end_ms) for r in timeline.tasks() if d in r.devices)
        assert all(a[1] <= b[0] + 1e-9 for a, b in itertools.pairwise(mine))
    busy = timeline.device_busy_ms
    assert all(b > 0 for b in busy)


def test_simulate_json_reports_the_plans_collectives_and_a_trace_of_every_round(capsys, tmp_path):
    trace = tmp_path / "trace.json"
    spec = "hybrid:tp=1,pp=2,microbatches=4"
    assert main(["simulate", "mlp", "--batch", "16", "-t", "cpu-2", "-s", spec, "--trace", str(trace),
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    from soapflow.api import capture_model

    _, graph = capture_model("mlp", batch_size=16)
    topo = load_topology("cpu-2")
    plan = lower(graph, parse_baseline(spec)(graph, topo), TrainSetup(), 2)
    assert doc["collectives"] == plan.collectives()
    assert doc["peak_memory_bytes"] == plan.memory_bytes()
    names = {e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"}
    assert {f"layers.2 fwd[{r}]" for r in range(4)} <= names
    assert {f"layers.1 -> layers.2 round {r}" for r in range(1, 4)} <= names


def test_an_op_with_more_rounds_than_keys_hold_is_refused(monkeypatch):
    graph = mlp(batch=8, sizes=(8, 8, 8))
    monkeypatch.setattr(taskgraph, "MAX_ROUNDS", 2)
    strategy = two_stages(graph, 4, lambda op: 0)
    with pytest.raises(StrategyError, match="runs in 4 rounds"):
        Simulator(graph, load_topology("cpu-2")).full(strategy)
    sim = Simulator(graph, load_topology("cpu-2"))
    before = sim.full(two_stages(graph, 2, lambda op: 0)).task_times()
    with pytest.raises(StrategyError, match="runs in 4 rounds"):
        sim.propose("fc0", strategy["fc0"])
    assert not sim.pending and sim.timeline().task_times() == before


# -- pipelines ----------------------------------------------------------------------------------------------


def linears(batch: int = 512, width: int = 1024, depth: int = 8) -> OperatorGraph:
    """input -> (linear -> relu) x depth -> mse: equal layers, so two stages of depth / 2 balance."""
    net = Net("linears", batch)
    x = net.input("x", (batch, width))
    for i in range(depth):
        x = net.relu(f"relu{i}", net.linear(f"fc{i}", x, width))
    y = net.input("y", (batch, width), role="target")
    net.mse("loss", x, y)
    return net.graph()


def pipeline(graph: OperatorGraph, micro: int, stages: int = 2) -> Strategy:
    """Consecutive layers in `stages` stages on devices 0, 1, ..; the target and the loss with the last."""
    per = sum(op.kind == "linear" for op in graph) // stages
    stage, seen = {}, 0
    for op in graph:
        seen += op.kind == "linear"
        stage[op.name] = min(max(seen - 1, 0) // per, stages - 1)
    stage["y"] = stage["loss"] = stages - 1
    return two_stages(graph, micro, lambda op: stage[op.name])


def stage_round_ms(timeline, num_devices: int) -> list[float]:
    """Per device, the forward and backward time of its parts of round 0 (one micro-batch through the
    stage), from the simulated tasks."""
    per = [0.0] * num_devices
    for r in timeline.tasks():
        if r.category in ("forward", "backward") and r.name.endswith("[0]"):
            per[r.devices[0]] += r.end_ms - r.start_ms
    return per


@pytest.mark.parametrize("micro", [2, 4, 8])
def test_a_pipeline_takes_about_m_plus_p_minus_1_stage_times(micro):
    """Two stages of four linears on cpu-2 (compute scales with the micro-batch there: one efficiency per
    op kind): M micro-batches take about (M + P - 1) x one stage's micro-batch time (GPipe's fill and
    drain), at least the busiest stage's M micro-batches and the other's one, at most the formula plus the
    optimizer updates and the exchanges on the path; and less than the same placement without
    micro-batches."""
    graph, topo = linears(), load_topology("cpu-2")
    whole = simulate(graph, pipeline(graph, 1), topo)
    timeline = simulate(graph, pipeline(graph, micro), topo)
    assert timeline.iteration_time_ms < whole.iteration_time_ms
    stage = stage_round_ms(timeline, 2)
    formula = (micro + 2 - 1) * max(stage)
    updates = sum(r.end_ms - r.start_ms for r in timeline.tasks() if r.category == "update")
    transfers = sum(r.end_ms - r.start_ms for r in timeline.tasks() if r.category == "transfer")
    assert min(stage) + micro * max(stage) <= timeline.iteration_time_ms <= formula + updates + transfers
    assert transfers < 0.02 * timeline.iteration_time_ms  # communication is small here
    assert timeline.iteration_time_ms == pytest.approx(formula, rel=0.06)


def test_more_micro_batches_shrink_the_pipeline_bubble():
    graph, topo = linears(), load_topology("cpu-2")
    t = {m: simulate(graph, pipeline(graph, m), topo).iteration_time_ms for m in (1, 2, 4, 8)}
    assert t[1] > t[2] > t[4] > t[8]


def test_each_device_runs_its_rounds_in_the_steps_order():
    """The rounds on each device follow `StepPlan.forward_order` and `backward_order`, filtered to the
    device: micro-batch after micro-batch through a stage in forward, the last one first in backward."""
    graph, topo = linears(batch=64, width=64), load_topology("cpu-2")
    strategy = pipeline(graph, 4)
    sim = Simulator(graph, topo)
    timeline = sim.full(strategy)
    plan = sim.step_plan()
    for d in range(2):
        for category, order in (("forward", plan.forward_order), ("backward", plan.backward_order)):
            ran = [r.name.split(" ")[0] + ":" + r.name.split("[")[1].rstrip("]")
                   for r in sorted(timeline.tasks(), key=lambda r: r.start_ms)
                   if r.category == category and r.devices == (d,)]
            want = [f"{graph.ops[i].name}:{c}" for i, r in order for c in plan.ops[i].round_parts(r)
                    if plan.ops[i].devices[c] == d]
            assert ran == want, (d, category)


def test_pipeline_memory_keeps_every_micro_batch():
    """GPipe keeps every micro-batch's activations until its backward: the simulated peak per device is
    the plan's (`StepPlan.memory_bytes`), whose kept activations add up to the whole batch's."""
    graph, topo = linears(batch=64, width=256), load_topology("cpu-2")
    for micro in (1, 2, 4):
        strategy = pipeline(graph, micro)
        timeline = simulate(graph, strategy, topo)
        plan = lower(graph, strategy, TrainSetup(), 2)
        assert list(timeline.peak_memory_bytes) == plan.memory_bytes()
        kept = [sum(step.activation_bytes) for step in plan.ops[:-1]]  # (each loss part has its scalar)
        if micro == 1:
            whole = kept
        assert kept == whole


@pytest.mark.parametrize("stages", [2, 4])
def test_one_f_one_b_keeps_fewer_micro_batches_at_about_gpipes_time(stages):
    """1F1B holds at most P - s micro-batches on stage s: the simulated peak is the plan's
    (`StepPlan.memory_bytes`, with `soap.lowering.flight_savings`), below GPipe's on every device with
    more micro-batches than that, while the step stays close to GPipe's (the same bubble; the blocking
    exchanges of the interleaved order cost a little) and well below the same placement without
    micro-batches."""
    graph, topo = linears(), load_topology(f"cpu-{stages}")
    whole = simulate(graph, pipeline(graph, 1, stages), topo).iteration_time_ms
    for micro in (4, 8):
        strategy = pipeline(graph, micro, stages)
        gpipe = simulate(graph, strategy, topo)
        setup = TrainSetup(schedule="1f1b")
        one = simulate(graph, strategy, topo, setup=setup)
        assert list(one.peak_memory_bytes) == lower(graph, strategy, setup, stages).memory_bytes()
        for d, (a, b) in enumerate(zip(one.peak_memory_bytes, gpipe.peak_memory_bytes, strict=True)):
            assert a < b if micro > stages - d else a == b, (micro, d)
        assert one.iteration_time_ms <= 1.1 * gpipe.iteration_time_ms
        assert one.iteration_time_ms < 0.8 * whole


def test_each_device_runs_its_items_in_the_one_f_one_b_order():
    """Under 1F1B each device's forward and backward tasks follow `StepPlan.order` filtered to the device:
    the interleaving of the plan is the simulated one."""
    graph, topo = linears(batch=64, width=64), load_topology("cpu-2")
    setup = TrainSetup(schedule="1f1b")
    sim = Simulator(graph, topo, setup=setup)
    timeline = sim.full(pipeline(graph, 4))
    plan = sim.step_plan()
    for d in range(2):
        ran = [(r.category, r.name.split(" ")[0] + ":" + r.name.split("[")[1].rstrip("]"))
               for r in sorted(timeline.tasks(), key=lambda r: r.start_ms)
               if r.category in ("forward", "backward") and r.devices == (d,)]
        want = [(("forward", "backward")[phase], f"{graph.ops[i].name}:{c}") for phase, i, r in plan.order
                for c in plan.ops[i].round_parts(r) if plan.ops[i].devices[c] == d]
        assert ran == want, d
        assert [c for c, _ in ran].index("backward") < len(ran) // 2  # interleaved, not GPipe's


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_simulator_that_timed_other_pipelines_times_each_as_a_fresh_one(schedule):
    """A simulator remembers step orders by what they read (`Simulator._step_order`); strategies that
    share their rounds but not their devices (the stages the other way round, which 1F1B's list
    schedule reads) or their rounds but not their stages, built one after the other on one simulator,
    each time exactly as on a simulator that never saw another."""
    graph, topo = linears(batch=64, width=64), load_topology("cpu-4")
    setup = TrainSetup(schedule=schedule)
    per = {op.name: i for i, op in enumerate(graph)}
    strategies = [pipeline(graph, 4, 2), pipeline(graph, 4, 4), pipeline(graph, 2, 2),
                  two_stages(graph, 4, lambda op: 1 - pipeline(graph, 1, 2)[op.name].devices[0]),
                  two_stages(graph, 4, lambda op: 3 * (per[op.name] % 2)), pipeline(graph, 4, 2)]
    sim = Simulator(graph, topo, setup=setup)
    times = []
    for strategy in strategies:
        sim.full(strategy)
        fresh = Simulator(graph, topo, setup=setup).full(strategy)
        assert sim.timeline().task_times() == fresh.task_times()
        assert sim.peak_memory_bytes == fresh.peak_memory_bytes
        times.append(fresh.iteration_time_ms)
    assert len(set(times)) >= 4  # the strategies differ in what they cost


# -- delta equals full -------------------------------------------------------------------------------------


def run_chain(graph: OperatorGraph, topology: DeviceTopology, *, proposals: int, seed: int, cost_model=None,
              p_repeat: float = 0.6, setup: TrainSetup | None = None) -> tuple[int, int, int]:
    """Random one-op proposals, most of them configs whose devices repeat, each checked against a full
    simulation (and its round order's walk against one from scratch); returns (proposals whose strategy
    repeats devices, those with round-order edges, those whose walk went again from the last one: the
    order unchanged)."""
    rng = random.Random(seed)
    cost_model = cost_model or AnalyticalCostModel()
    sim = Simulator(graph, topology, cost_model, setup=setup)
    ref = Simulator(graph, topology, cost_model, setup=setup)
    n = topology.num_devices
    current = data_parallel(graph, tuple(range(n)))
    for op in rng.sample(list(graph.ops), len(graph.ops) // 2):
        current = current.with_config(op.name, draw_config(op, n, rng, p_repeat))
    sim.full(current)
    names = [op.name for op in graph]
    repeated = ordered = walked_again = 0
    for k in range(proposals):
        name = rng.choice(names)
        cfg = draw_config(graph[name], n, rng, p_repeat)
        proposed = propose_and_check(sim, ref, current, name, cfg, k, every=5)
        repeated += any(repeats(proposed[op.name]) for op in graph)
        ordered += sim._walk is not None and bool(sim._walk.all_links())
        before = getattr(sim._journal, "walk", None)
        walked_again += sim._walk is not None and before is not None and sim._walk.order is before.order
        current = accept_or_reject(sim, ref, current, proposed, k, rng, every=5, check_times=True)
    fresh = Simulator(graph, topology, cost_model, setup=setup).full(current)
    assert sim.timeline().task_times() == fresh.task_times()
    return repeated, ordered, walked_again


BUILDER_CASES = [
    ("mlp", "cpu-2", 300),
    ("mlp", "p100-4x4", 150),
    ("chain", "p100-2x2", 200),
    ("chain", "k80-2x4", 80),
    ("small_cnn", "cpu-4", 150),
]
BUILDERS = {"mlp": lambda: mlp(batch=32), "chain": lambda: chain(batch=32, width=64, depth=6),
            "small_cnn": lambda: small_cnn(batch=8)}


@pytest.mark.parametrize(("graph_name", "topology", "proposals"), BUILDER_CASES)
def test_delta_equals_full_with_repeated_devices_on_builder_graphs(graph_name, topology, proposals):
    repeated, ordered, again = run_chain(BUILDERS[graph_name](), load_topology(topology), proposals=proposals,
                                  seed=proposals + len(topology))
    assert repeated >= proposals * 3 // 4 and ordered >= proposals // 4 and again >= proposals // 10


def test_delta_equals_full_with_repeated_devices_under_the_fixed_cost_model():
    """Equal durations make ready-time ties common; the static keys (rounds included) break them alike."""
    cost = FixedCostModel(fwd_each_ms=0.01, bwd_each_ms=0.02, update_each_ms=0.005, reduce_each_ms=0.001)
    repeated, ordered, again = run_chain(chain(batch=32, width=64, depth=6), load_topology("p100-2x2"), proposals=150,
                                  seed=5, cost_model=cost)
    assert repeated >= 110 and ordered >= 35 and again >= 15


def test_delta_equals_full_with_zero_duration_tasks_before_a_round_order_edge():
    """Forwards of zero duration: a round-order edge to a smaller key could then tie with its source, so
    the simulator replays such states whole (`Simulator._unsorted`), still equal to the full simulation."""
    graph = mlp(batch=32, sizes=(16, 32, 16))
    cost = FixedCostModel(fwd_each_ms=0.0, bwd_each_ms=0.01, update_each_ms=0.001)
    sim = Simulator(graph, load_topology("cpu-2"), cost)
    sim.full(pipeline_of_mlp(graph))
    assert sim._walk.all_links() and sim._unsorted
    run_chain(graph, load_topology("cpu-2"), proposals=100, seed=11, cost_model=cost)


def pipeline_of_mlp(graph: OperatorGraph) -> Strategy:
    stage = {"x": 0, "fc0": 0, "relu0": 0, "fc1": 1, "y": 1, "loss": 1}
    return two_stages(graph, 4, lambda op: stage[op.name])


@pytest.mark.parametrize(("graph_name", "topology", "proposals"), [("chain", "p100-2x2", 120), ("mlp", "cpu-4", 120)])
def test_delta_equals_full_with_repeated_devices_under_one_f_one_b(graph_name, topology, proposals):
    """The 1F1B order and its memory (`flight_savings`) change with every op's config: still exact."""
    repeated, ordered, again = run_chain(BUILDERS[graph_name](), load_topology(topology), proposals=proposals,
                                  seed=proposals + 7, setup=TrainSetup(schedule="1f1b"))
    assert repeated >= proposals * 3 // 4 and ordered >= proposals // 4 and again >= proposals // 10


def test_delta_equals_full_with_repeated_devices_and_tied_small_buckets():
    graph = chain(batch=32, width=64, depth=4)
    run_chain(graph, load_topology("cpu-4"), proposals=100, seed=2, setup=TrainSetup(optimizer="adamw", bucket_mb=0.01))


@pytest.fixture(scope="module")
def zoo_graphs() -> dict[str, OperatorGraph]:
    builds = {
        "mlp": functools.partial(rc.zoo_build, "mlp", 16, sizes=(32, 64, 32)),
        "transformer": functools.partial(rc.zoo_build, "transformer", 8, layers=2, d_model=16, heads=2, seq=8,
                                         context=None, vocab=32),
        "rnnlm": functools.partial(rc.zoo_build, "rnnlm", 8, hidden=16, embed=8, vocab=32, steps=4),
    }
    return {name: rc.capture_workload(build) for name, build in builds.items()}


ZOO_CASES = [("mlp", "p100-2x2", 150), ("transformer", "cpu-2", 100), ("transformer", "p100-2x2", 60),
             ("rnnlm", "cpu-2", 150), ("rnnlm", "p100-4x4", 60)]


def test_a_chunk_on_another_device_waits_for_the_transfer_of_its_state():
    """An LSTM in 4 chunks alternating devices 0, 1, 0, 1 (rounds 0..3): each chunk's forward starts after
    the transfer of the state (`OpDef.carry_bytes`, over the link between the two devices) that starts
    after the previous chunk's forward; in backward the state's gradient goes back the same way; the
    transfers count in the bytes moved and match the plan's collectives."""
    graph = rc.graph_of("rnnlm")
    strategy = Strategy({op.name: ParallelConfig.single(0) for op in graph}).with_config(
        "lstms.0", ParallelConfig(degrees={"seq": 4}, devices=(0, 1, 0, 1)))
    cost = FixedCostModel(fwd_each_ms=0.01, bwd_each_ms=0.02, update_each_ms=0.005, reduce_each_ms=0.001)
    sim = Simulator(graph, load_topology("p100-2x2"), cost)  # (transfers occupy links, not devices)
    timeline = sim.full(strategy)
    tasks = {t.name: t for t in timeline.tasks()}
    op = graph["lstms.0"]
    state = op_def("lstm").carry_bytes(op, ((0, 4), (0, 1), (0, 16)))
    plan = sim.step_plan()
    step = plan.ops[plan.flow.index["lstms.0"]]
    assert step.rounds == (0, 1, 2, 3) and step.carry_moves == ((1, 0, state), (2, 1, state), (3, 2, state))
    moves = [t for t in timeline.tasks() if "state" in t.name]
    assert len(moves) == 6 and all(t.category == "transfer" and t.nbytes == state and t.links for t in moves)
    for c in range(1, 4):
        fwd = tasks[f"lstms.0 state [{c - 1}] ->"]
        assert set(fwd.devices) <= {0, 1} and fwd.links
        assert tasks[f"lstms.0 fwd[{c - 1}]"].end_ms <= fwd.start_ms < fwd.end_ms <= tasks[f"lstms.0 fwd[{c}]"].start_ms
        bwd = tasks[f"grad lstms.0 state [{c}] ->"]
        assert tasks[f"lstms.0 bwd[{c}]"].end_ms <= bwd.start_ms < bwd.end_ms <= tasks[f"lstms.0 bwd[{c - 1}]"].start_ms
    assert timeline.bytes_moved == sum(t.nbytes for t in timeline.tasks() if t.category in ("transfer", "allreduce"))
    assert sim.collectives() == plan.collectives()
    assert plan.collectives()[0]["all_to_all"]["count"] >= 6


@pytest.mark.parametrize(("schedule", "cell"), [("gpipe", "lstm"), ("1f1b", "lstm"), ("gpipe", "gru")])
def test_delta_equals_full_with_lstm_chunks(schedule, cell):
    """The LSTMs (or GRUs, whose state is h alone) of the RNN LM in chunks half the time they are drawn (a
    chunk after the one it starts from, its backward before), half of those with chunks on different
    devices (the state's transfer between them), also under equal durations (ties broken by the chunks'
    keys), under both schedules."""
    graph = rc.capture_workload(functools.partial(rc.zoo_build, "rnnlm", 8, hidden=16, embed=8, vocab=32, steps=4,
                                                  cell=cell))
    lstms = [op.name for op in graph if op.kind == cell]
    assert len(lstms) == 2
    seen = moved = 0
    setup = TrainSetup(schedule=schedule)
    for topology, cost, seed in (("cpu-2", None, 3), ("p100-2x2", FixedCostModel(
            fwd_each_ms=0.01, bwd_each_ms=0.02, update_each_ms=0.005, reduce_each_ms=0.001), 4)):
        rng = random.Random(seed)
        sim = Simulator(graph, load_topology(topology), cost, setup=setup)
        ref = Simulator(graph, load_topology(topology), cost, setup=setup)
        n = load_topology(topology).num_devices
        current = data_parallel(graph, tuple(range(n)))
        sim.full(current)
        for k in range(120):
            name = rng.choice(lstms) if k % 2 else rng.choice([op.name for op in graph])
            cfg = draw_config(graph[name], n, rng, 0.6)
            proposed = propose_and_check(sim, ref, current, name, cfg, k, every=3)
            step = sim.planner.op_plan(graph.ops.index(graph[name]), cfg).step
            seen += any(p is not None for p in step.carry_from)
            moved += bool(step.carry_moves)
            current = accept_or_reject(sim, ref, current, proposed, k, rng, every=3, check_times=True)
        fresh = Simulator(graph, load_topology(topology), cost, setup=setup).full(current)
        assert sim.timeline().task_times() == fresh.task_times()
    assert seen >= 40 and moved >= 15


@pytest.mark.parametrize(("model", "topology", "proposals"), ZOO_CASES)
def test_delta_equals_full_with_repeated_devices_on_zoo_models(zoo_graphs, model, topology, proposals):
    repeated, ordered, again = run_chain(zoo_graphs[model], load_topology(topology), proposals=proposals,
                                  seed=proposals)
    assert repeated >= proposals * 3 // 4 and ordered >= 1 and again >= 1


@pytest.mark.parametrize(("model", "topology", "proposals"), [("rnnlm", "cpu-2", 150), ("transformer", "cpu-2", 60)])
def test_delta_equals_full_on_zoo_models_under_one_f_one_b(zoo_graphs, model, topology, proposals):
    """Under 1F1B a change re-orders rounds far from the changed op."""
    repeated, ordered, again = run_chain(zoo_graphs[model], load_topology(topology), proposals=proposals,
                                  seed=proposals + 3, setup=TrainSetup(schedule="1f1b"))
    assert repeated >= proposals * 3 // 4 and ordered >= 1 and again >= 1


def test_a_cut_order_edge_replays_from_where_its_target_now_comes(zoo_graphs):
    """Under 1F1B, giving the RNN LM's first LSTM 2 micro-batches on device 0 re-orders the step: an order
    edge into an exchange of the dropout before it is cut, so the exchange is ready earlier than where it
    stood in the old order, ahead of a dropout part that had gone before it on its device. The replay
    must start no later than the exchange's new place (it used to start at its old one: the dropout part
    kept its old, too early, start)."""
    graph = zoo_graphs["rnnlm"]
    two = {"degrees": {"sample": 2}, "devices": [0, 1]}
    layout = {"input0": two, "target": two, "embedding": two, "drops.1": two, "drops.2": two, "decoder": two,
              "loss.reshape_1": two, "loss": two,
              "drops.0": {"degrees": {"sample": 4}, "devices": [1, 0, 0, 1]},
              "lstms.0": {"degrees": {"sample": 8}, "devices": [0, 1] * 4},
              "lstms.1": {"degrees": {}, "devices": [1]},
              "loss.reshape": {"degrees": {"sample": 2}, "devices": [1, 1]}}
    current = Strategy({name: ParallelConfig.from_dict(doc) for name, doc in layout.items()})
    topo, setup = load_topology("cpu-2"), TrainSetup(schedule="1f1b")
    sim, ref = (Simulator(graph, topo, setup=setup) for _ in range(2))
    sim.full(current)
    propose_and_check(sim, ref, current, "lstms.0", ParallelConfig(degrees={"sample": 2}, devices=(0, 0)), 0,
                      every=1)


def test_delta_from_a_pipeline_to_other_micro_batch_counts():
    """Proposals that change one op's micro-batch count in a two-stage pipeline re-order the rounds of
    every op after it: the round-order edges that change are cut and added, the rest kept."""
    graph, topo = linears(batch=64, width=64), load_topology("cpu-2")
    sim, ref = Simulator(graph, topo), Simulator(graph, topo)
    current = pipeline(graph, 4)
    sim.full(current)
    for name, micro in (("fc2", 2), ("fc5", 8), ("relu3", 1), ("fc0", 2), ("loss", 4)):
        stage = current[name].devices[0]
        cfg = (ParallelConfig(degrees={"sample": micro}, devices=(stage,) * micro) if micro > 1
               else ParallelConfig.single(stage))
        proposed = current.with_config(name, cfg)
        assert sim.propose(name, cfg) == ref.full(proposed).iteration_time_ms
        assert sim.timeline().task_times() == ref.timeline().task_times()
        sim.accept()
        current = proposed


# -- replicas ----------------------------------------------------------------------------------------------


def micro_data_parallel(graph: OperatorGraph, num_devices: int, micro: int) -> Strategy:
    """Data parallelism with each device's share in `micro` micro-batches (its device repeated)."""
    configs = {}
    for op in graph:
        sample = next((d for d in dims_of(op) if d.name == "sample" and d.splittable), None)
        n = num_devices * micro
        if sample is not None and sample.size % n == 0:
            devices = tuple(d for d in range(num_devices) for _ in range(micro))
            configs[op.name] = ParallelConfig(degrees={"sample": n}, devices=devices)
        else:
            configs[op.name] = ParallelConfig.single(0)
    return Strategy(configs)


@pytest.mark.parametrize(("model", "topology", "spec"), [
    ("mlp", "cpu-2", "micro:2"), ("mlp", "p100-2x2", "micro:2"), ("transformer", "cpu-2", "micro:2"),
    ("rnnlm", "cpu-2", "hybrid:tp=1,microbatches=2"), ("transformer", "p100-2x2", "hybrid:tp=2,microbatches=2"),
    ("llama", "cpu-4", "hybrid:tp=2,microbatches=2"), ("mlp", "a100-2x4", "hybrid:tp=2,pp=2,microbatches=2"),
    ("mlp", "cpu-4", "hybrid:tp=1,pp=2,microbatches=2"),
])
def test_replicas_with_micro_batches_equal_the_plain_simulation(model, topology, spec):
    graph, topo = rc.graph_of(model), load_topology(topology)
    if spec.startswith("micro:"):
        strategy = micro_data_parallel(graph, topo.num_devices, int(spec.split(":")[1]))
    else:
        try:
            strategy = parse_baseline(spec)(graph, topo)
        except BaselineNotApplicable:
            pytest.skip(f"{spec} does not apply to {model}")
    assert any(repeats(strategy[op.name]) for op in graph)
    plain_sim, plain = simulator_of(graph, strategy, topo, symmetry=False)
    sim, timeline = simulator_of(graph, strategy, topo)
    assert timeline.iteration_time_ms == plain.iteration_time_ms
    assert timeline.peak_memory_bytes == plain.peak_memory_bytes
    assert timeline.bytes_moved == plain.bytes_moved
    assert sim.collectives() == plain_sim.collectives()
    if timeline.replicas > 1:
        assert timeline.num_tasks < plain.num_tasks


def test_data_parallel_micro_batches_are_simulated_by_one_replica():
    graph, topo = rc.graph_of("mlp"), load_topology("p100-2x2")
    strategy = micro_data_parallel(graph, 4, 2)
    timeline = simulate(graph, strategy, topo)
    assert timeline.replicas == 4
    plain = simulate(graph, strategy, topo, symmetry=False)
    assert (timeline.iteration_time_ms, timeline.peak_memory_bytes, timeline.bytes_moved) == (
        plain.iteration_time_ms, plain.peak_memory_bytes, plain.bytes_moved)


def test_lstm_chunks_run_as_a_wavefront():
    """Two LSTM layers on two devices in 4 chunks each (equal durations): each chunk's forward starts once
    the chunk it starts from has ended, its backward ends before that chunk's begins, and layer 2 runs
    chunk k while layer 1 runs chunk k + 1; at the paper's sizes the step is shorter than with whole
    layers."""
    graph = rc.graph_of("rnnlm")
    topology = load_topology("cpu-2")
    cost = FixedCostModel(fwd_each_ms=1.0, bwd_each_ms=2.0, update_each_ms=0.01)
    wave = simulate(graph, rc.wavefront_strategy(graph, 2, 4), topology, cost)
    by_name = {r.name: (r.start_ms, r.end_ms) for r in wave.tasks()}
    for layer in ("lstms.0", "lstms.1"):
        for k in range(1, 4):
            assert by_name[f"{layer} fwd[{k}]"][0] >= by_name[f"{layer} fwd[{k - 1}]"][1]
            assert by_name[f"{layer} bwd[{3 - k}]"][0] >= by_name[f"{layer} bwd[{3 - k + 1}]"][1]
    for k in range(3):
        second, first = by_name[f"lstms.1 fwd[{k}]"], by_name[f"lstms.0 fwd[{k + 1}]"]
        assert second[0] < first[1] and first[0] < second[1]  # they overlap
    # at the paper's sizes (analytical costs on two P100s) the wavefront beats whole layers
    big = rc.capture_workload(functools.partial(rc.zoo_build, "rnnlm", 64, hidden=1024, embed=1024, vocab=1024,
                                                steps=16))
    p100 = load_topology("p100-1x2")
    assert (simulate(big, rc.wavefront_strategy(big, 2, 4), p100).iteration_time_ms
            < 0.8 * simulate(big, rc.wavefront_strategy(big, 2, 1), p100).iteration_time_ms)


def test_a_proposal_that_keeps_the_order_walks_again_only_from_the_changed_ops():
    """A deep chain pipelined in 4 micro-batches over 2 devices: a proposal that keeps every op's rounds
    (the last linear layer of the first stage given full recomputation) leaves the step's order as it
    was, so the round order's walk goes again only from the checkpoint before each of that op's items
    (one per round and pass, spread over the order) until it is back on its old track; the items between
    keep the edges they had (the same lists), and the whole equals a walk from scratch. A change of rounds
    walks from scratch."""
    graph = chain(batch=32, width=16, depth=24)
    names = [op.name for op in graph]
    half = len(names) // 2
    strategy = two_stages(graph, 4, lambda op: 0 if names.index(op.name) < half else 1)
    sim = Simulator(graph, load_topology("p100-1x2"), FixedCostModel(fwd_each_ms=1.0, bwd_each_ms=2.0))
    ref = Simulator(graph, load_topology("p100-1x2"), FixedCostModel(fwd_each_ms=1.0, bwd_each_ms=2.0))
    sim.full(strategy)
    old = sim._walk
    assert len(old.order) > 8 * CHECKPOINT  # enough items for the walk to skip some
    target = next(n for n in reversed(names[:half]) if graph[n].kind == "linear")
    cfg = dataclasses.replace(strategy[target], recompute=True)
    propose_and_check(sim, ref, strategy, target, cfg, 0, every=1)
    new = sim._walk
    assert new.order is old.order
    kept = sum(a is b for a, b in zip(new.links, old.links, strict=True))
    changed = len(sim._walk.positions[names.index(target)])
    assert kept >= len(old.order) - 3 * CHECKPOINT * changed  # walked again near the changed op's items only
    assert any(a is not b for a, b in zip(new.links, old.links, strict=True))
    sim.reject()
    assert sim._walk is old
    fewer = ParallelConfig(degrees={"sample": 2}, devices=(0, 0))
    propose_and_check(sim, ref, strategy, target, fewer, 1, every=1)
    assert sim._walk.order != old.order and all(a is not b for a, b in zip(sim._walk.links, old.links, strict=False))
