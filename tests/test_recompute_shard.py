"""Recomputation and sharded parameters: configs and their files, the step plan's memory and collectives,
the fsdp and hybrid baselines, the simulator's figures, and one-line errors on bad input."""

from __future__ import annotations

import json

import pytest
from test_lowering import mlp_graph

from search.baselines import BaselineNotApplicable, BaselineSpecError, fsdp, hybrid, parse_baseline, recompute_full
from simulator.engine import Simulator
from soap.config import ConfigError, ParallelConfig, parts, validate
from soap.graph import Operator, OperatorGraph, ParamSpec, TensorRef, TensorSpec
from soap.lowering import lower
from soap.registry import dims_of
from soap.setup import TrainSetup
from soap.strategy import Strategy, StrategyError, strategy_from_dict, validate_strategy
from soap.topology import load_topology
from soapflow.api import capture_model
from soapflow.cli import main

DP2 = ParallelConfig(degrees={"sample": 2}, devices=(0, 1))


def dp(graph: OperatorGraph, num_devices: int = 2, **changes) -> Strategy:
    cfg = ParallelConfig(degrees={"sample": num_devices}, devices=tuple(range(num_devices)))
    return Strategy({op.name: cfg.replace(**changes.get(op.name, {})) for op in graph})


def test_config_fields_round_trip_and_default():
    cfg = DP2.replace(recompute=True, shard=2)
    assert ParallelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg != DP2 and hash(cfg) != hash(DP2)
    assert ParallelConfig.from_dict({"degrees": {"sample": 2}, "devices": [0, 1]}) == DP2
    with pytest.raises(ValueError, match="recompute must be"):
        ParallelConfig(degrees={}, devices=(0,), recompute="yes")
    with pytest.raises(ValueError, match="shard must be"):
        ParallelConfig(degrees={}, devices=(0,), shard=0)


def test_bad_recompute_and_shard_name_the_op_and_the_reason():
    graph = mlp_graph()
    with pytest.raises(ConfigError, match=r"'fc0'.*shard 3 does not divide the 2 replica"):
        validate(graph["fc0"], ParallelConfig(degrees={"sample": 2}, devices=(0, 1), shard=3), 2)
    # a parameter split leaves one replica of each region: nothing to shard over
    with pytest.raises(ConfigError, match="shard 2 does not divide the 1 replica"):
        validate(graph["fc0"], ParallelConfig(degrees={"out_features": 2}, devices=(0, 1), shard=2), 2)
    with pytest.raises(ConfigError, match=r"'relu0' \(elementwise\) has no parameters to shard"):
        validate(graph["relu0"], DP2.replace(shard=2), 2)
    with pytest.raises(ConfigError, match="'input0' cannot recompute: it is a source"):
        validate(graph["input0"], DP2.replace(recompute=True), 2)


def tied_graph() -> OperatorGraph:
    """input -> a -> b -> loss, with a and b sharing one weight."""
    x = (8, 4)
    shared = {"weight": ParamSpec(shape=(4, 4), fqn="w")}
    ops = [Operator(name="input0", kind="input", outputs=(TensorSpec(shape=x),), attrs={"position": 0}),
           Operator(name="a", kind="linear", inputs=(TensorRef(op="input0"),), outputs=(TensorSpec(shape=x),),
                    params=shared),
           Operator(name="b", kind="linear", inputs=(TensorRef(op="a"),), outputs=(TensorSpec(shape=x),),
                    params=shared),
           Operator(name="target", kind="input", outputs=(TensorSpec(shape=x),), attrs={"position": 1}),
           Operator(name="loss", kind="loss", inputs=(TensorRef(op="b"), TensorRef(op="target")),
                    outputs=(TensorSpec(shape=()),), attrs={"fn": "mse", "reduction": "mean"})]
    return OperatorGraph(ops, name="tied", batch_size=8)


def test_shared_parameters_do_not_shard():
    graph = tied_graph()
    with pytest.raises(StrategyError, match="op 'a' shares parameter 'w' with op 'b'"):
        validate_strategy(graph, dp(graph, a={"shard": 2}), 2)
    doc = {"ops": {op.name: dp(graph, b={"shard": 2})[op.name].to_dict() for op in graph}}
    with pytest.raises(StrategyError, match="op 'b' shares parameter 'w' with op 'a'"):
        strategy_from_dict(doc, graph, 2)
    # fsdp shards only what it may: the tied weight stays replicated
    assert {cfg.shard for cfg in fsdp(graph, load_topology("cpu-2")).configs.values()} == {1}


def test_recomputation_keeps_nothing_of_its_own_and_the_consumer_keeps_its_read():
    graph = mlp_graph()  # batch 8, features 16 -> 32 -> 16, float32: 4 rows of 32 per device = 512 bytes
    plan = lower(graph, dp(graph, fc0={"recompute": True}, relu0={"recompute": True}), TrainSetup(), 2)
    base = lower(graph, dp(graph), TrainSetup(), 2)
    pos = {op.name: i for i, op in enumerate(graph)}
    fc0, relu0 = plan.ops[pos["fc0"]], plan.ops[pos["relu0"]]
    # fc0 keeps only the batch rows it reads (4 x 16 floats), not its output
    assert fc0.activation_bytes == (256, 256) and base.ops[pos["fc0"]].activation_bytes == (256 + 512,) * 2
    # relu0's transient: its recomputed output, then in backward its output's and its input's gradients
    assert relu0.activation_bytes == (0, 0) and relu0.transient_bytes == (512 + 512 + 512,) * 2
    edges = {(plan.flow.edges[e.edge].src, plan.flow.edges[e.edge].dst): e for e in plan.edges}
    assert edges[(pos["fc0"], pos["relu0"])].kept_bytes == {}  # relu0 recomputes: it keeps nothing
    assert edges[(pos["relu0"], pos["fc1"])].kept_bytes == {0: 512, 1: 512}  # fc1 keeps what it reads
    # dropped: fc0's and relu0's outputs (1024); kept by fc1: 512; the largest transient, relu0's: 1536
    # (512 more than without recomputation, where it is relu0's backward, 1024)
    assert plan.memory_bytes() == base.memory_bytes()
    assert plan.collectives() == base.collectives()  # recomputation moves nothing


def test_sharded_parameters_memory_and_collectives():
    graph = mlp_graph()
    setup = TrainSetup()  # SGD with momentum: one state tensor per parameter
    plan = lower(graph, fsdp(graph, load_topology("cpu-2")), setup, 2)
    base = lower(graph, dp(graph), setup, 2)
    pos = {op.name: i for i, op in enumerate(graph)}
    fc0 = plan.ops[pos["fc0"]]
    assert fc0.shard_groups == ((0, 1), (0, 1))
    # fc0: weight 32 x 16 and bias 32 = 544 floats: each device keeps 272 of them, gradient and momentum too
    unit = plan.params[plan.flow.unit[pos["fc0"]]]
    assert unit.memory_bytes == {0: 272 * 4 * 3, 1: 272 * 4 * 3}
    assert base.params[base.flow.unit[pos["fc0"]]].memory_bytes == {0: 544 * 4 * 3, 1: 544 * 4 * 3}
    assert fc0.gather_bytes == (544 * 4,) * 2 and fc0.scatter_bytes == (544 * 4,) * 2
    # fc1: weight 16 x 32 and bias 16 = 528 floats
    per_device = {"all_gather": {"count": 4, "bytes": 2 * (544 + 528) * 4},
                  "reduce_scatter": {"count": 2, "bytes": (544 + 528) * 4}}
    assert plan.collectives() == [per_device, per_device]
    assert plan.all_reduces == ()


def test_hybrid_sharding_all_reduces_chunks_among_their_holders():
    graph = mlp_graph()
    plan = lower(graph, dp(graph, 4, fc0={"shard": 2}), TrainSetup(), 4)
    pos = {op.name: i for i, op in enumerate(graph)}
    assert plan.ops[pos["fc0"]].shard_groups == ((0, 1), (0, 1), (2, 3), (2, 3))
    fc0_syncs = [e for a in plan.all_reduces for e in a.entries if e.fqn.startswith("fc0")]
    assert sorted({e.group for e in fc0_syncs}) == [(0, 2), (1, 3)]
    assert {e.fqn: e.numel for e in fc0_syncs} == {"fc0.weight": 256, "fc0.bias": 16}


def test_the_simulator_charges_recomputation_and_gathers():
    graph = mlp_graph()
    topo = load_topology("cpu-2")
    sim = Simulator(graph, topo)
    plain = sim.full(dp(graph))
    again = Simulator(graph, topo).full(dp(graph, **{n: {"recompute": True} for n in ("fc0", "relu0", "fc1")}))
    assert again.compute_ms > plain.compute_ms
    sharded = Simulator(graph, topo).full(fsdp(graph, topo))
    assert sharded.iteration_time_ms > plain.iteration_time_ms  # gathers in every pass, nothing to hide them


@pytest.mark.parametrize("recompute", [False, True])
def test_sharded_collectives_count_as_bytes_moved_and_communication(recompute):
    """Under fsdp (and with recomputation, which gathers again) the bytes moved are the shard collectives'
    as rings move them, (n - 1) / n of each device's buffer per call, and the critical path carries their
    time as communication, not compute; the delta simulation agrees with the full one."""
    graph = mlp_graph()
    topo = load_topology("cpu-2")
    strategy = fsdp(graph, topo)
    if recompute:
        strategy = Strategy({n: c.replace(recompute=n in ("fc0", "relu0")) for n, c in strategy.configs.items()})
    sim = Simulator(graph, topo)
    timeline = sim.full(strategy)
    per_device = sim.step_plan().collectives()
    calls = sum(per_device[d][kind]["bytes"] for d in range(2) for kind in ("all_gather", "reduce_scatter"))
    assert timeline.bytes_moved == calls // 2 > 0  # groups of 2: each device sends half its buffer
    assert timeline.comm_ms > 0 and timeline.sync_ms == 0
    path = timeline.compute_ms + timeline.comm_ms + timeline.sync_ms
    assert path == pytest.approx(timeline.iteration_time_ms)
    # from dp, one op at a time, by the delta simulation
    delta = Simulator(graph, topo)
    delta.full(dp(graph))
    for name, cfg in strategy.configs.items():
        last = delta.delta(name, cfg)
    assert last.bytes_moved == timeline.bytes_moved
    assert last.comm_ms == pytest.approx(timeline.comm_ms)


def test_recompute_full_keeps_branch_points_and_the_loss():
    graph = mlp_graph()
    out = recompute_full(graph, dp(graph))
    assert not out["loss"].recompute and not out["input0"].recompute
    assert all(out[n].recompute for n in ("fc0", "relu0", "fc1"))


def test_recompute_full_keeps_only_branch_points_on_a_small_gpt():
    """The q, k and v projections (capture splits the fused qkv linear per piece) are each read once: not
    branch points, so they recompute; the residual stream (each block's input and the sum after its
    attention, read by a layer norm and the next residual add) is kept."""
    import runtime_cases as rc

    graph = rc.graph_of("transformer")  # 2 blocks, d_model 16
    topo = load_topology("cpu-2")
    strategy = hybrid(graph, topo, tp_size=2, recompute="full")
    pieces = [op.name for op in graph if op.name.rpartition(".")[0].endswith("attn.qkv")]
    assert len(pieces) == 6 and all(len(graph.consumers(p)) == 1 for p in pieces)
    assert all(strategy[p].recompute for p in pieces)
    assert all(strategy[op.name].recompute for op in graph if op.kind == "attention")
    kept = {op.name for op in graph if not strategy[op.name].recompute}
    sources = {op.name for op in graph if op.kind == "input"}
    assert kept == sources | {"drop", "blocks.0.add", "blocks.0.add_1", "blocks.1.add", "loss"}
    for name in kept - sources - {"loss"}:
        assert len({c for c, _, _ in graph.consumers(name)}) == 2, name
    # keeping q, k and v needs more memory for the same collectives
    keep = dict(strategy.configs) | {p: strategy[p].replace(recompute=False) for p in pieces}
    plan = lower(graph, strategy, TrainSetup(), 2)
    heavier = lower(graph, Strategy(keep), TrainSetup(), 2)
    assert max(plan.memory_bytes()) < max(heavier.memory_bytes())
    assert plan.collectives() == heavier.collectives()


@pytest.fixture(scope="module")
def transformer():
    return capture_model("transformer", batch_size=8)[1]


def test_hybrid_groups_are_consecutive_devices_holding_contiguous_batch_blocks(transformer):
    topo = load_topology("cpu-4")
    strategy = hybrid(transformer, topo, tp_size=2, shard=2, recompute="full")
    validate_strategy(transformer, strategy, 4)
    split = [op for op in transformer if strategy[op.name].num_parts == 4 and len(strategy[op.name].degrees) == 2]
    assert split, "no op is split both ways"
    for op in split:
        sample = next(d for d in strategy[op.name].degrees if d == "sample")
        index = [d.name for d in dims_of(op)].index(sample)
        for box, device in parts(op, strategy[op.name]):
            lo = box[index][0]
            assert lo // (op.outputs[0].shape[0] // 2) == device // 2, (op.name, box, device)
    assert any(cfg.shard == 2 for cfg in strategy.configs.values())
    assert any(cfg.recompute for cfg in strategy.configs.values())
    plan = lower(transformer, strategy, TrainSetup(), 4)
    plain = lower(transformer, hybrid(transformer, topo, tp_size=2), TrainSetup(), 4)
    assert max(plan.memory_bytes()) < max(plain.memory_bytes())


@pytest.mark.parametrize("spec, message", [
    ("hybrid:tp", "is not key=value"),
    ("hybrid:tp=0", "tp must be a positive integer"),
    ("hybrid:shard=2", "tp=T is required"),
    ("hybrid:tp=2,recompute=some", "recompute must be none or full"),
    ("hybrid:tp=2,zero=1", "unknown key"),
    ("hybrid:tp=2,pp=0", "pp must be a positive integer"),
    ("hybrid:tp=2,microbatches=x", "microbatches must be a positive integer"),
])
def test_malformed_hybrid_specs(spec, message):
    with pytest.raises(BaselineSpecError, match=message):
        parse_baseline(spec)


def test_hybrid_that_does_not_divide(transformer):
    with pytest.raises(BaselineNotApplicable, match="tp=3 does not divide the 4 devices"):
        parse_baseline("hybrid:tp=3")(transformer, load_topology("cpu-4"))
    with pytest.raises(BaselineNotApplicable, match="shard=3 does not divide the 2 data-parallel"):
        parse_baseline("hybrid:tp=2,shard=3")(transformer, load_topology("cpu-4"))


def test_hybrid_refuses_pipeline_stages_with_nothing_to_compute():
    """The mlp has 4 ops that compute (linears and activations): 16 stages would leave 12 idle devices
    under a name that promises a pipeline; 2 stages both compute."""
    _, graph = capture_model("mlp", batch_size=8)
    computing = sum(op.fwd_flops + op.bwd_flops > 0 for op in graph)
    assert computing < 16
    with pytest.raises(BaselineNotApplicable, match=rf"pp=16 leaves \d+ of the 16 stages with nothing to compute "
                                                    rf"\(the model has {computing} ops that compute\)"):
        parse_baseline("hybrid:tp=1,pp=16")(graph, load_topology("cpu-16"))
    strategy = parse_baseline("hybrid:tp=1,pp=2")(graph, load_topology("cpu-2"))
    assert {strategy[op.name].devices for op in graph if op.fwd_flops > 0} == {(0,), (1,)}


@pytest.mark.parametrize("argv, message", [
    (["simulate", "mlp", "-t", "cpu-4", "-s", "hybrid:tp=3"], "tp=3 does not divide"),
    (["simulate", "mlp", "-t", "cpu-2", "-s", "hybrid:tp=2,pp=2"], "tp=2 does not divide the 1 devices of a stage"),
    (["simulate", "mlp", "-t", "cpu-2", "-s", "hybrid:tp=1,pp=3"], "pp=3 does not divide the 2 devices"),
    (["simulate", "mlp", "-t", "cpu-2", "-s", "hybrid:tp=1,pp=2,microbatches=5"], "micro-batches"),
    (["simulate", "mlp", "-t", "cpu-4", "-s", "hybrid:tp=1,pp=2,microbatches=2,shard=2"], "not built yet"),
    (["simulate", "mlp", "-t", "cpu-2", "-s", "hybrid:tp=two"], "tp must be a positive integer"),
])
def test_cli_bad_baselines_are_one_line_errors(capsys, argv, message):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code != 0 and message in err and len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("op_name, fields, message", [
    ("layers.0", {"shard": 3}, "shard 3 does not divide"),
    ("layers.1", {"shard": 2}, "has no parameters to shard"),
    ("input0", {"recompute": True}, "cannot recompute"),
    ("layers.0", {"recompute": "yes"}, "recompute must be true or false"),
])
def test_cli_bad_strategy_files_are_one_line_errors(capsys, tmp_path, op_name, fields, message):
    graph = capture_model("mlp")[1]
    ops = {op.name: {"degrees": {"sample": 2}, "devices": [0, 1], **(fields if op.name == op_name else {})}
           for op in graph}
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"format": "soapflow.strategy/2", "ops": ops}))
    code = main(["simulate", "mlp", "-t", "cpu-2", "-s", str(path)])
    err = capsys.readouterr().err.strip()
    assert code != 0 and message in err and len(err.splitlines()) == 1 and "Traceback" not in err
