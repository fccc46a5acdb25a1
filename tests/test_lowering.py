"""The lowering to a step plan (no processes): pieces and exchanges per edge, partial sums, gradient-sync
groups and buckets, tied parameters, the collectives a step issues; the gradient all-reduce of the runtime
on the plan's buckets; and the single-process interpreter against plain PyTorch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime.train import TrainOptions, Workload, integer_highs, synthetic_batch, train_rank
from soap.config import ParallelConfig
from soap.graph import Operator, OperatorGraph, ParamSpec, TensorRef, TensorSpec
from soap.lowering import (
    ALL_TO_ALL,
    BACKWARD,
    FORWARD,
    EdgeStep,
    StepPlan,
    carry_order,
    flight_savings,
    lower,
    part_rounds,
)
from soap.setup import TrainSetup
from soap.strategy import Strategy


def mlp_graph(batch: int = 8, sizes: tuple[int, ...] = (16, 32, 16)) -> OperatorGraph:
    """input0 -> fc0 -> relu0 -> fc1 -> loss(mse, target), built by hand (no capture)."""
    ops = [Operator(name="input0", kind="input", outputs=(TensorSpec(shape=(batch, sizes[0])),),
                    attrs={"position": 0, "role": "input", "input_shapes": []})]
    prev, shape = "input0", (batch, sizes[0])
    for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False)):
        ops.append(Operator(name=f"fc{i}", kind="linear", inputs=(TensorRef(op=prev),),
                            outputs=(TensorSpec(shape=(batch, b)),),
                            params={"weight": ParamSpec(shape=(b, a), fqn=f"fc{i}.weight"),
                                    "bias": ParamSpec(shape=(b,), fqn=f"fc{i}.bias")},
                            attrs={"input_shapes": [list(shape)]}))
        prev, shape = f"fc{i}", (batch, b)
        if i < len(sizes) - 2:
            ops.append(Operator(name=f"relu{i}", kind="elementwise", inputs=(TensorRef(op=prev),),
                                outputs=(TensorSpec(shape=shape),),
                                attrs={"fn": "relu", "input_shapes": [list(shape)]}))
            prev = f"relu{i}"
    ops.append(Operator(name="target", kind="input", outputs=(TensorSpec(shape=shape),),
                        attrs={"position": 1, "role": "target", "input_shapes": []}))
    ops.append(Operator(name="loss", kind="loss", inputs=(TensorRef(op=prev), TensorRef(op="target")),
                        outputs=(TensorSpec(shape=()),),
                        attrs={"fn": "mse", "reduction": "mean", "input_shapes": [list(shape)] * 2}))
    return OperatorGraph(ops, name="mlp", batch_size=batch)


class HandMLP(nn.Module):
    def __init__(self, sizes: tuple[int, ...] = (16, 32, 16)):
        super().__init__()
        for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False)):
            setattr(self, f"fc{i}", nn.Linear(a, b))
        self.num = len(sizes) - 1

    def forward(self, x):
        for i in range(self.num):
            x = getattr(self, f"fc{i}")(x)
            if i < self.num - 1:
                x = torch.relu(x)
        return x


def build_hand_mlp(batch: int = 8) -> Workload:
    torch.manual_seed(0)
    return Workload(module=HandMLP(), inputs=(torch.empty(batch, 16, device="meta"),),
                    target=torch.empty(batch, 16, device="meta"), loss_fn=nn.functional.mse_loss)


def cfg(devices, **degrees) -> ParallelConfig:
    return ParallelConfig(degrees=degrees, devices=tuple(devices))


def strategy(graph: OperatorGraph, default: ParallelConfig, **overrides: ParallelConfig) -> Strategy:
    return Strategy({op.name: overrides.get(op.name, default) for op in graph})


def lowered(graph: OperatorGraph, s: Strategy, num_devices: int, setup: TrainSetup | None = None) -> StepPlan:
    return lower(graph, s, setup or TrainSetup(), num_devices)


def edge_into(plan: StepPlan, consumer: str, slot: int = 0) -> EdgeStep:
    eid = plan.flow.slot_edges[plan.flow.index[consumer]][slot]
    assert eid is not None, f"{consumer} input {slot} is a source"
    return plan.edges[eid]


def remote(plan: StepPlan, step: EdgeStep) -> list[tuple[int, int]]:
    """(source device, destination device) of each piece of an edge that crosses devices."""
    e = plan.flow.edges[step.edge]
    src, dst = plan.ops[e.src].devices, plan.ops[e.dst].devices
    return [(src[step.pieces[k][0]], dst[step.pieces[k][1]]) for k in step.moving]


def entries(plan: StepPlan) -> list:
    return [e for p in plan.params for e in p.sync]


def test_data_parallel_plan_moves_nothing_and_syncs_every_parameter():
    g = mlp_graph()
    plan = lowered(g, strategy(g, cfg((0, 1), sample=2)), 2)
    assert all(not step.moving and not step.ranks for step in plan.edges)
    assert {(e.fqn, e.group) for e in entries(plan)} == {
        (f"fc{i}.{p}", (0, 1)) for i in range(2) for p in ("weight", "bias")}
    # Both layers fit one 25 MiB bucket: one all-reduce, issued after fc0's backward (the last to finish).
    (a,) = plan.all_reduces
    assert a.group == (0, 1) and a.after == g.position("fc0")
    assert a.nbytes == sum(p.nbytes for op in g for p in op.params.values())
    assert plan.process_groups() == [(0, 1)]
    assert plan.collectives() == [{"all_reduce": {"count": 1, "bytes": a.nbytes}}] * 2
    # Small buckets: one per op, the later layer's first (its gradients finish first).
    small = lowered(g, strategy(g, cfg((0, 1), sample=2)), 2, TrainSetup(bucket_mb=1e-4))
    assert [a.after for a in small.all_reduces] == [g.position("fc1"), g.position("fc0")]
    assert small.collectives()[0]["all_reduce"]["count"] == 2


def test_partial_sums_into_a_sample_split_consumer_are_a_reduce_scatter():
    """fc1 split on in_features (partial sums) feeding a sample-split loss: each loss part adds its rows
    from both fc1 parts, one local and one remote (and backward sends each half's gradient back)."""
    g = mlp_graph()
    s = strategy(g, cfg((0, 1), sample=2), fc0=cfg((0, 1), out_features=2), relu0=cfg((0, 1), d1=2),
                 fc1=cfg((0, 1), in_features=2))
    plan = lowered(g, s, 2)
    edge = edge_into(plan, "loss")
    assert edge.reduced and edge.grad
    assert sorted((p, c, region) for p, c, _, region in edge.pieces) == [
        (0, 0, ((0, 4), (0, 16))), (0, 1, ((4, 8), (0, 16))),
        (1, 0, ((0, 4), (0, 16))), (1, 1, ((4, 8), (0, 16)))]
    assert sorted(remote(plan, edge)) == [(0, 1), (1, 0)] and edge.ranks == (0, 1)
    assert [(c, k) for c, k, _ in edge.sums] == [(0, 2), (1, 2)]
    # Megatron's pair: the column-parallel output feeds the row-parallel input without moving.
    assert not edge_into(plan, "fc1").moving and not edge_into(plan, "relu0").moving
    # fc0 reads the batch, which every rank holds: no edge at all.
    assert plan.flow.slot_edges[g.position("fc0")] == [None]
    # Sharded weights are not synchronized; fc1's bias lives on the first in_features chunk only.
    assert entries(plan) == [] and plan.all_reduces == ()
    fc1 = plan.params[plan.flow.unit[g.position("fc1")]]
    assert fc1.shards[("fc1.bias", ((0, 16),))] == (0,)
    # one exchange each way on both ranks, of the 4x16 float32 rows each sends
    assert plan.collectives() == [{"all_to_all": {"count": 2, "bytes": 2 * 4 * 16 * 4}}] * 2


def test_partial_sums_into_a_consumer_of_the_same_layout_come_from_every_part():
    """fc0 split on in_features over (0, 1) holds partial sums of its whole output on both devices; fc1
    split on out_features over (0, 1) reads the whole input in both parts. Part k of fc0 covers exactly
    what part k of fc1 reads, on the same device, yet each fc1 part must add both partial sums."""
    shapes = {"input0": (8, 16), "fc0": (8, 32), "fc1": (8, 16)}
    ops = [Operator(name="input0", kind="input", outputs=(TensorSpec(shape=shapes["input0"]),),
                    attrs={"position": 0, "role": "input"})]
    for name, src, (a, b) in (("fc0", "input0", (16, 32)), ("fc1", "fc0", (32, 16))):
        ops.append(Operator(name=name, kind="linear", inputs=(TensorRef(op=src),),
                            outputs=(TensorSpec(shape=shapes[name]),),
                            params={"weight": ParamSpec(shape=(b, a), fqn=f"{name}.weight")}))
    ops.append(Operator(name="target", kind="input", outputs=(TensorSpec(shape=(8, 16)),),
                        attrs={"position": 1, "role": "target"}))
    ops.append(Operator(name="loss", kind="loss", inputs=(TensorRef(op="fc1"), TensorRef(op="target")),
                        outputs=(TensorSpec(shape=()),), attrs={"fn": "mse", "reduction": "mean"}))
    g = OperatorGraph(ops, name="chain", batch_size=8)
    plan = lowered(g, strategy(g, cfg((0, 1), sample=2), fc0=cfg((0, 1), in_features=2),
                               fc1=cfg((0, 1), out_features=2)), 2)
    edge = edge_into(plan, "fc1")
    assert edge.reduced and edge.grad
    assert sorted((p, c) for p, c, _, _ in edge.pieces) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [(c, k) for c, k, _ in edge.sums] == [(0, 2), (1, 2)]
    assert sorted(remote(plan, edge)) == [(0, 1), (1, 0)]
    # each fc0 part gets the gradients of both fc1 parts back, and adds them
    assert [(p, k) for p, k, _ in edge.grad_sums] == [(0, 2), (1, 2)]


def test_model_parallel_plan_sends_one_activation_and_no_gradient_to_inputs():
    g = mlp_graph()
    s = strategy(g, cfg((0,)), fc1=cfg((1,)), loss=cfg((1,)), target=cfg((1,)))
    plan = lowered(g, s, 2)
    moves = [(plan.flow.ops[plan.flow.edges[step.edge].dst].name, *pair)
             for step in plan.edges for pair in remote(plan, step)]
    assert moves == [("fc1", 0, 1)]
    assert plan.flow.grad_inputs[g.position("fc0")] == (False,)
    assert plan.flow.grad_inputs[g.position("fc1")] == (True,)
    assert entries(plan) == []
    # forward and backward of the one moving edge, 8x32 float32 each way
    assert plan.collectives() == [{"all_to_all": {"count": 2, "bytes": 8 * 32 * 4}}] * 2


def test_overlapping_shards_of_one_parameter_sync_as_full_tensors():
    """The same weight read whole by one part and row-split by another op's parts (tied weights): one
    parameter unit, one full-size all-reduce over the union of the holders."""
    g = mlp_graph(sizes=(16, 16, 16))
    tied = [Operator(name=op.name, kind=op.kind, inputs=op.inputs, outputs=op.outputs, attrs=op.attrs,
                     params={k: ParamSpec(shape=p.shape, fqn=p.fqn.replace("fc1", "fc0"))
                             for k, p in op.params.items()})
            for op in g]
    g = OperatorGraph(tied, name="tied", batch_size=8)
    plan = lowered(g, strategy(g, cfg((0,)), fc1=cfg((0, 1), out_features=2)), 2)
    assert plan.flow.unit[g.position("fc0")] == plan.flow.unit[g.position("fc1")]
    by_fqn = {e.fqn: e for e in entries(plan)}
    assert by_fqn["fc0.weight"].region is None and by_fqn["fc0.weight"].group == (0, 1)
    (a,) = plan.all_reduces
    assert a.after == g.position("fc0") and a.nbytes == (16 * 16 + 16) * 4
    # Device 0 holds the whole weight and its first half (two shards), device 1 the second half.
    unit = plan.params[plan.flow.unit[g.position("fc0")]]
    assert unit.update_bytes == {0: (16 * 16 + 16) * 4 * 3 // 2, 1: (16 * 16 + 16) * 4 // 2}


def test_integer_inputs_draw_below_the_smallest_table_they_feed():
    ops = [Operator(name="tokens", kind="input", outputs=(TensorSpec(shape=(4, 3), dtype="int64"),),
                    attrs={"position": 0, "role": "input", "input_shapes": []}),
           Operator(name="emb", kind="embedding", inputs=(TensorRef(op="tokens"),),
                    outputs=(TensorSpec(shape=(4, 3, 8)),),
                    params={"weight": ParamSpec(shape=(50, 8), fqn="emb.weight")},
                    attrs={"padding_idx": None, "input_shapes": [[4, 3]]}),
           Operator(name="labels", kind="input", outputs=(TensorSpec(shape=(12,), dtype="int64"),),
                    attrs={"position": 1, "role": "target", "input_shapes": []}),
           Operator(name="flat", kind="reshape", inputs=(TensorRef(op="emb"),),
                    outputs=(TensorSpec(shape=(12, 8)),), attrs={"shape": [12, 8], "input_shapes": [[4, 3, 8]]}),
           Operator(name="loss", kind="loss", inputs=(TensorRef(op="flat"), TensorRef(op="labels")),
                    outputs=(TensorSpec(shape=()),),
                    attrs={"fn": "cross_entropy", "reduction": "mean", "input_shapes": [[12, 8], [12]]})]
    g = OperatorGraph(ops, name="emb", batch_size=4)
    assert integer_highs(g) == {0: 50, 1: 8}
    example = (torch.empty(4, 3, dtype=torch.long, device="meta"), torch.empty(12, dtype=torch.long, device="meta"))
    a = synthetic_batch(example, step=1, seed=0, highs={0: 50, 1: 8})
    b = synthetic_batch(example, step=1, seed=0, highs={0: 50, 1: 8})
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert int(a[0].max()) < 50 and int(a[1].max()) < 8 and a[1].dtype == torch.long
    assert not torch.equal(a[0], synthetic_batch(example, step=2, seed=0, highs={0: 50, 1: 8})[0])


@pytest.mark.parametrize("setup", [TrainSetup(lr=0.05, momentum=0.0), TrainSetup(lr=0.05),
                                   TrainSetup(lr=0.05, optimizer="adamw", weight_decay=0.1)],
                         ids=["sgd", "momentum", "adamw"])
def test_single_process_interpreter_equals_plain_pytorch(setup):
    g = mlp_graph()
    s = {op.name: {"degrees": {}, "devices": [0]} for op in g}
    result = train_rank(0, 1, build=build_hand_mlp, graph=g.to_dict(), strategy=s,
                        options=TrainOptions(steps=3, setup=setup, verify=True))
    v = result["verify"]
    assert v["max_loss_rel_diff"] == 0.0 and v["max_param_rel_diff"] == 0.0, v
    assert len(result["losses"]) == 3
    assert result["collectives"] == [{}]


def test_gradient_sync_groups_are_exactly_the_holders():
    """On 4 devices: fc0 data parallel over (1, 2), fc1 over (3, 0): each weight is all-reduced within its
    own pair, and no group contains a rank that does not hold the parameter."""
    g = mlp_graph()
    s = strategy(g, cfg((0, 1, 2, 3), sample=4), fc0=cfg((1, 2), sample=2), relu0=cfg((1, 2), sample=2),
                 fc1=cfg((3, 0), sample=2))
    plan = lowered(g, s, 4)
    assert {e.fqn: e.group for e in entries(plan)} == {"fc0.weight": (1, 2), "fc0.bias": (1, 2),
                                                      "fc1.weight": (0, 3), "fc1.bias": (0, 3)}
    assert {a.group for a in plan.all_reduces} == {(0, 3), (1, 2)}
    assert (0, 3) in plan.process_groups() and (1, 2) in plan.process_groups()


def test_grad_sync_launches_all_reduces_after_their_last_op_and_writes_sums_back(monkeypatch):
    """An all-reduce is launched (asynchronously) once the backward of its `after` op is done, before
    `finish`; one of a single gradient is reduced in place, a larger one through a flat buffer; `finish`
    writes the sums back; every launch is logged with its bytes."""
    from runtime import collectives
    from soap.lowering import SyncEntry, all_reduces

    launched = []

    class Work:
        def __init__(self, t):
            self.t = t

        def wait(self):
            self.t.mul_(2)  # the "sum" over a group of two equal replicas

    def all_reduce(t, op=None, group=None, async_op=False):
        launched.append((t.numel(), group))
        return Work(t)

    monkeypatch.setattr(collectives.dist, "all_reduce", all_reduce)
    big = SyncEntry("big", ((0, 300),), (0, 1), 0, 300, 1200, ((5, 0),))
    a = SyncEntry("a", ((0, 10),), (0, 1), 1, 10, 40, ((3, 0),))
    b = SyncEntry("b", ((0, 20),), (0, 1), 1, 20, 80, ((2, 0),))
    plan = all_reduces([big, a, b])
    assert [(x.bucket, x.after) for x in plan] == [(0, 5), (1, 2)]
    grads = {e.fqn: torch.full((e.numel,), 1.0) for e in (big, a, b)}
    out = {}
    log = collectives.CollectiveLog()
    sync = collectives.GradSync(plan, rank=0, groups={(0, 1): "G"}, grad_of=lambda e: grads[e.fqn],
                                set_grad=lambda e, v: out.__setitem__(e.fqn, v), log=log)
    sync.ready(5)
    assert launched == [(300, "G")]  # launched at once, overlapping the rest of backward
    sync.ready(3)
    assert launched == [(300, "G")]  # its bucket ends at op 2
    sync.ready(2)
    sync.finish()
    assert launched == [(300, "G"), (30, "G")]
    assert out["big"] is grads["big"] and torch.equal(out["big"], torch.full((300,), 2.0))
    assert torch.equal(out["a"], torch.full((10,), 2.0)) and torch.equal(out["b"], torch.full((20,), 2.0))
    assert log.snapshot() == {"all_reduce": {"count": 2, "bytes": 1320}}
    # A rank outside the group takes no part.
    other = collectives.GradSync(plan, rank=2, groups={(0, 1): None}, grad_of=None, set_grad=None, log=log)
    for op in (5, 3, 2):
        other.ready(op)
    other.finish()
    assert len(launched) == 2


def test_the_simulators_memory_is_the_plans():
    """The simulator sums the plan's pieces as it builds and edits tasks; `StepPlan.memory_bytes` sums the
    same pieces at once (the killed-rank message uses it): they agree, tied weights and partial sums too."""
    from simulator.engine import Simulator
    from soap.topology import load_topology

    g = mlp_graph(sizes=(16, 16, 16))
    tied = OperatorGraph([Operator(name=op.name, kind=op.kind, inputs=op.inputs, outputs=op.outputs,
                                   attrs=op.attrs,
                                   params={k: ParamSpec(shape=p.shape, fqn=p.fqn.replace("fc1", "fc0"))
                                           for k, p in op.params.items()})
                          for op in g], name="tied", batch_size=8)
    strategies = [strategy(tied, cfg((0, 1), sample=2)),
                  strategy(tied, cfg((0,)), fc1=cfg((0, 1), out_features=2)),
                  strategy(tied, cfg((0, 1), sample=2), fc0=cfg((0, 1), in_features=2), relu0=cfg((1,)))]
    sim = Simulator(tied, load_topology("cpu-2"), setup=TrainSetup(optimizer="adamw"))
    for s in strategies:
        sim.full(s)
        assert list(sim.peak_memory_bytes) == lowered(tied, s, 2, TrainSetup(optimizer="adamw")).memory_bytes()


# ---------------------------------------------------------------------------- several parts on one device


def test_rounds_count_earlier_parts_on_the_same_device():
    from soap.lowering import part_rounds

    assert part_rounds((0, 1, 2)) == (0, 0, 0)
    assert part_rounds((0, 0, 1, 1)) == (0, 1, 0, 1)
    assert part_rounds((3, 1, 3, 3, 1)) == (0, 0, 1, 2, 1)


def _position_in(order) -> dict:
    return {node: k for k, node in enumerate(order)}


def test_a_two_stage_pipeline_exchanges_per_micro_batch_in_gpipe_order():
    g = mlp_graph()
    stage0, stage1 = cfg((0,) * 4, sample=4), cfg((1,) * 4, sample=4)
    plan = lowered(g, strategy(g, stage0, fc1=stage1, loss=stage1), 2)
    fc0, relu0, fc1, loss = (g.position(n) for n in ("fc0", "relu0", "fc1", "loss"))
    assert plan.ops[fc0].rounds == (0, 1, 2, 3) and plan.ops[fc1].num_rounds == 4
    edge = edge_into(plan, "fc1")
    # one exchange per micro-batch, each moving the one piece that micro-batch's part reads
    assert [(r, ranks, len(moving)) for r, ranks, moving in edge.exchanges] == [(r, (0, 1), 1) for r in range(4)]
    assert all(edge.pieces[k][1] == r for r, _, (k,) in edge.exchanges)
    assert not edge_into(plan, "relu0").exchanges  # same device: local
    # GPipe: micro-batch after micro-batch through the ops, the reverse in backward
    assert plan.forward_order == tuple((i, r) for r in range(4) for i in (fc0, relu0, fc1, loss))
    assert plan.backward_order == tuple(reversed(plan.forward_order))
    assert plan.done_at[fc0] == len(plan.order) - 1
    # every crossing is an all-to-all per micro-batch and pass; no parameter is held twice: no all-reduce
    batch_bytes = 8 * 32 * 4
    assert plan.collectives() == [{"all_to_all": {"count": 8, "bytes": batch_bytes}}] * 2
    assert plan.all_reduces == () and plan.process_groups() == [(0, 1)]


def test_micro_batches_on_one_device_hold_parameters_once_and_keep_every_activation():
    g = mlp_graph()
    whole = lowered(g, strategy(g, cfg((0,))), 1)
    micro = lowered(g, strategy(g, cfg((0, 0), sample=2)), 1)
    # GPipe keeps all micro-batches' activations; the largest transient is one part's, now half as large
    def peak_transient(plan):
        return max(t for step in plan.ops for t in step.transient_bytes)

    assert peak_transient(micro) < peak_transient(whole)
    kept = [(sum(a.activation_bytes), sum(b.activation_bytes))
            for a, b in zip(whole.ops[:-1], micro.ops[:-1], strict=True)]
    assert all(a == b for a, b in kept) and sum(a for a, _ in kept) > 0  # (the loss keeps a scalar per part)
    assert micro.memory_bytes()[0] < whole.memory_bytes()[0]
    assert [p.shards for p in micro.params] == [p.shards for p in whole.params]
    assert micro.all_reduces == () and micro.collectives() == [{}]


def test_data_parallel_micro_batches_all_reduce_once_after_the_last_round():
    g = mlp_graph()
    plan = lowered(g, strategy(g, cfg((0, 0, 1, 1), sample=4)), 2)
    assert {(e.fqn, e.group) for e in entries(plan)} == {
        (f"fc{i}.{p}", (0, 1)) for i in range(2) for p in ("weight", "bias")}
    (a,) = plan.all_reduces
    assert a.after == g.position("fc0")
    # fc0's last backward round is the last op round of the step
    assert plan.backward_order[-1] == (g.position("fc0"), 0)
    assert all(not step.exchanges for step in plan.edges)


def test_rounds_of_different_counts_wait_for_what_they_read():
    g = mlp_graph()
    plan = lowered(g, strategy(g, cfg((0,) * 4, sample=4), fc1=cfg((1, 1), sample=2), loss=cfg((1,))), 2)
    at = _position_in(plan.forward_order)
    fc0, fc1, loss = (g.position(n) for n in ("fc0", "fc1", "loss"))
    relu0 = g.position("relu0")
    # fc1's first half-batch needs relu0's first two quarter-batches, not the last two
    assert at[(relu0, 1)] < at[(fc1, 0)] < at[(relu0, 2)]
    assert at[(loss, 0)] > at[(fc1, 1)]
    # the exchange into fc1 of round 0 moves what its part 0 reads: two quarter-batch pieces
    edge = edge_into(plan, "fc1")
    assert [(r, len(moving)) for r, _, moving in edge.exchanges] == [(0, 2), (1, 2)]
    assert plan.ops[fc0].num_rounds == 4


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_random_repeated_devices_give_topological_orders(schedule):
    import random

    g = mlp_graph()
    rng = random.Random(0)
    for _ in range(40):
        configs = {}
        for op in g:
            parts = rng.choice((1, 2, 4, 8))
            degrees = {"sample": parts} if parts > 1 else {}
            configs[op.name] = cfg(tuple(rng.randrange(3) for _ in range(parts)), **degrees)
        plan = lowered(g, Strategy(configs), 3, TrainSetup(schedule=schedule))
        items = _position_in(plan.order)
        assert len(items) == len(plan.order)
        # a backward after its forward and after its consumers' backward, each op's rounds in turn
        for (phase, i, r), k in items.items():
            if phase == BACKWARD:
                assert items[(FORWARD, i, r)] < k
        for step in plan.edges:
            e = plan.flow.edges[step.edge]
            if plan.flow.needs_bwd[e.dst]:
                for p, c, _, _ in step.pieces:
                    assert items[(BACKWARD, e.dst, plan.ops[e.dst].rounds[c])] < items[
                        (BACKWARD, e.src, plan.ops[e.src].rounds[p])]
        assert plan.done_at == tuple(max((k for (ph, j, _), k in items.items() if ph == BACKWARD and j == i),
                                         default=-1) for i in range(len(g.ops)))
        at = _position_in(plan.forward_order)
        assert len(at) == sum(plan.ops[i].num_rounds for i in range(len(g.ops)) if not plan.flow.everywhere[i])
        for step in plan.edges:
            e = plan.flow.edges[step.edge]
            for p, c, _, _ in step.pieces:
                assert at[(e.src, plan.ops[e.src].rounds[p])] < at[(e.dst, plan.ops[e.dst].rounds[c])]
            for r, ranks, moving in step.exchanges:
                assert all(plan.ops[e.dst].rounds[step.pieces[k][1]] == r for k in moving)
                assert set(ranks) == {plan.ops[e.src].devices[step.pieces[k][0]] for k in moving} | {
                    plan.ops[e.dst].devices[step.pieces[k][1]] for k in moving}
            assert sorted(k for _, _, moving in step.exchanges for k in moving) == sorted(step.moving)
        for op in g:
            i = g.position(op.name)
            if not plan.flow.everywhere[i]:
                assert [at[(i, r)] for r in range(plan.ops[i].num_rounds)] == sorted(
                    at[(i, r)] for r in range(plan.ops[i].num_rounds))


def test_repeated_devices_are_refused_where_not_built():
    from soap.config import ConfigError, validate

    g = mlp_graph()
    bad = ParallelConfig(degrees={"sample": 4}, devices=(0, 0, 1, 1), shard=2)
    with pytest.raises(ConfigError, match="repeat, but .*sharded"):
        validate(g["fc0"], bad, 2)
    validate(g["fc0"], bad.replace(shard=1), 2)
    validate(g["fc0"], bad.replace(shard=1, recompute=True), 2)  # micro-batches recompute


def test_recomputation_per_part_is_the_op_rule_without_micro_batches_and_precedes_its_readers():
    from search.baselines import hybrid, recompute_full
    from soap.lowering import recompute_points
    from soap.topology import load_topology
    from soapflow.api import capture_model

    g = capture_model("transformer", batch_size=8)[1]
    topo = load_topology("cpu-2")
    plain = recompute_full(g, hybrid(g, topo, tp_size=2))
    plan = lowered(g, plain, 2)
    at = recompute_points(plan.flow, [s.recompute for s in plan.ops])
    expect = {}
    for j, point in enumerate(at):
        if point is not None:
            k = plan.order.index((BACKWARD, point, 0))
            expect.setdefault(k, []).extend((j, c) for c in range(plan.ops[j].num_parts))
    assert plan.recompute_before() == expect and expect
    # micro-batched
    micro = hybrid(g, topo, tp_size=1, pp=2, microbatches=2)
    micro = Strategy({name: cfg.replace(recompute=plain[name].recompute) for name, cfg in micro.configs.items()})
    plan = lowered(g, micro, 2)
    before = plan.recompute_before()
    at_fwd = {node: k for k, node in enumerate(plan.forward_order)}
    done = {}
    for k in sorted(before):
        for j, c in before[k]:
            done[(j, c)] = k
    for (j, c), k in done.items():
        step = plan.ops[j]
        if plan.flow.needs_bwd[j]:  # before its own backward
            assert k <= plan.order.index((BACKWARD, j, step.rounds[c]))
        for eid in plan.flow.in_edges[j]:  # after (or with) the recomputing producer parts it reads
            e = plan.flow.edges[eid]
            for p, cc, _, _ in plan.edges[eid].pieces:
                if cc == c and (e.src, p) in done:
                    assert done[(e.src, p)] < k or (done[(e.src, p)] == k and at_fwd[
                        (e.src, plan.ops[e.src].rounds[p])] < at_fwd[(j, step.rounds[c])])
    assert len(done) == sum(s.num_parts for s in plan.ops if s.recompute and plan.flow.needs_bwd[s.op]) > 0


def four_stage_pipeline(schedule: str, micro: int = 8) -> StepPlan:
    """A chain of 8 linears (with ReLUs) in 4 stages of 2 on devices 0..3, `micro` micro-batches each."""
    sizes = (16,) * 9
    g = mlp_graph(batch=32, sizes=sizes)
    configs = {}
    for op in g:
        layer = int(op.name[-1]) if op.kind in ("linear", "elementwise") else 7
        d = 0 if op.kind == "input" else layer // 2
        configs[op.name] = cfg((d,) * micro, sample=micro)
    return lowered(g, Strategy(configs), 4, TrainSetup(schedule=schedule))


def in_flight(plan: StepPlan, device: int) -> int:
    """The most micro-batches `device` holds at once in the plan's order (forward started, backward not done
    for some op of it)."""
    started, done, most = set(), {}, 0
    ops = [i for i, step in enumerate(plan.ops) if device in step.devices and plan.flow.needs_bwd[i]]
    for phase, i, r in plan.order:
        if i not in ops:
            continue
        if phase == FORWARD:
            started.add(r)
        else:
            done[r] = done.get(r, 0) + 1
        most = max(most, len([m for m in started if done.get(m, 0) < len(ops)]))
    return most


def test_one_f_one_b_holds_as_many_micro_batches_as_stages_after_it():
    """1F1B on 4 stages of 8 micro-batches: stage s holds at most 4 - s micro-batches (GPipe all 8), starts
    the first micro-batch's backward before its (4 - s + 1)-th forward, and keeps less memory for it."""
    gpipe, one = four_stage_pipeline("gpipe"), four_stage_pipeline("1f1b")
    assert [in_flight(gpipe, d) for d in range(4)] == [8] * 4
    assert [in_flight(one, d) for d in range(4)] == [4, 3, 2, 1]
    assert not flight_savings(gpipe.flow, gpipe.ops, gpipe.edges, gpipe.order)
    saved = flight_savings(one.flow, one.ops, one.edges, one.order)
    assert sorted(saved) == [0, 1, 2, 3] and saved[0] < saved[1] < saved[2] < saved[3]
    mem_g, mem_1 = gpipe.memory_bytes(), one.memory_bytes()
    assert all(mem_1[d] == mem_g[d] - saved[d] for d in range(4))
    for d in range(4):
        mine = [(phase, r) for phase, i, r in one.order if one.ops[i].devices[0] == d and one.ops[i].runs_bwd]
        assert mine.index((BACKWARD, 0)) < mine.index((FORWARD, 4 - d))
    # the same items, other order; the all-reduces issue in the order their gradients complete
    assert sorted(gpipe.order) == sorted(one.order)
    assert [a.after for a in one.all_reduces] == sorted((a.after for a in one.all_reduces),
                                                         key=lambda i: one.done_at[i])


def test_replicas_are_found_at_any_divisor_of_the_common_sample_degree():
    """Two replicas of 3 micro-batches each (sample degree 6) on 4 devices: 6 and 3 do not divide the
    devices, 2 does."""
    from soap.lowering import Replicas, find_replicas

    g = mlp_graph(batch=12)
    configs = {op.name: cfg((0, 0, 0, 2, 2, 2), sample=6) for op in g}
    assert find_replicas(g, Strategy(configs), 4) == Replicas(count=2, size=2)
    configs["fc1"] = cfg((0, 0, 0, 3, 3, 3), sample=6)  # not a shift of replica 0
    assert find_replicas(g, Strategy(configs), 4) is None
# ---------------------------------------------------------------- chunks of a recurrent op (rule "Carries")


def lstm_graph() -> OperatorGraph:
    """The test RNN LM (embedding, two LSTM layers of hidden 16 over 4 steps, batch 4, decoder, loss)."""
    import runtime_cases as rc
    return rc.graph_of("rnnlm")


def test_chunks_start_from_the_chunk_before_and_keep_its_state():
    """A chunk after the first starts from the one before it and keeps that state for backward
    (`OpDef.carry_bytes`: 2 x layers x samples x hidden floats); the unsplit op carries nothing."""
    graph = lstm_graph()
    whole = Strategy({op.name: ParallelConfig.single(0) for op in graph})
    chunks = whole.with_config("lstms.0", ParallelConfig(degrees={"sample": 2, "seq": 2}, devices=(0, 0, 1, 1)))
    plain, chunked = lower(graph, whole, TrainSetup(), 2), lower(graph, chunks, TrainSetup(), 2)
    i = plain.flow.index["lstms.0"]
    assert plain.ops[i].carry_from == (None,)
    step = chunked.ops[i]
    assert step.carry_from == (None, 0, None, 2) and step.rounds == (0, 1, 0, 1)
    state = 2 * 1 * 2 * 16 * 4
    whole_act = plain.ops[i].activation_bytes[0]
    assert sum(step.activation_bytes) == whole_act + 2 * state
    # the second chunk keeps its initial state, and holds h_n and c_n (as large) where the first holds none
    assert step.activation_bytes[1] - step.activation_bytes[0] == 2 * state


def test_the_order_runs_a_chunk_after_the_one_it_starts_from():
    """Every chunk comes after the chunk it starts from in forward and before it in backward, also when
    the rounds' own order would not say so (`carry_order` alone)."""
    graph = lstm_graph()
    strategy = Strategy({op.name: ParallelConfig.single(0) for op in graph}).with_config(
        "lstms.0", ParallelConfig(degrees={"seq": 4}, devices=(0,) * 4)).with_config(
        "lstms.1", ParallelConfig(degrees={"seq": 2}, devices=(1, 1)))
    plan = lower(graph, strategy, TrainSetup(), 2)
    a, b = plan.flow.index["lstms.0"], plan.flow.index["lstms.1"]
    fwd = plan.forward_order
    assert [n for n in fwd if n[0] in (a, b)] == [(a, 0), (a, 1), (a, 2), (a, 3), (b, 0), (b, 1)]
    after: dict = {}
    carry_order(plan.ops, [a, b], after)
    assert after == {(a, 0): {(a, 1)}, (a, 1): {(a, 2)}, (a, 2): {(a, 3)}, (b, 0): {(b, 1)}}
    assert [n for n in plan.backward_order if n[0] in (a, b)] == [n for n in reversed(fwd) if n[0] in (a, b)]


def test_a_chunk_runs_in_a_later_round_than_its_source_on_any_device():
    """Rule "Rounds": one more than the last round on the part's device and than its source chunk's round;
    the parts of a round on distinct devices; without chunks, the count of earlier parts on the device."""
    assert part_rounds((0, 1, 0, 1), (None, 0, 1, 2)) == (0, 1, 2, 3)
    assert part_rounds((0, 0, 1, 1), (None, 0, None, 2)) == (0, 1, 0, 1)
    assert part_rounds((0, 1, 1, 0), (None, 0, None, 2)) == (0, 1, 2, 3)
    assert part_rounds((0, 1, 1, 0)) == (0, 0, 1, 1)
    assert part_rounds((0, 1, 2, 2, 1, 0), (None, 0, 1, None, 3, 4)) == (0, 1, 2, 3, 4, 5)
    assert part_rounds((0, 1, 2, 1), (None, 0, None, 2)) == (0, 1, 0, 2)


def carry_plan(devices: tuple[int, ...], *, degrees=None, recompute: bool = False, schedule: str = "gpipe",
               num_devices: int = 3) -> StepPlan:
    """The test RNN LM on device `num_devices` - 1, its first LSTM split as `degrees` (4 time chunks) on
    `devices`."""
    graph = lstm_graph()
    strategy = Strategy({op.name: ParallelConfig.single(num_devices - 1) for op in graph}).with_config(
        "lstms.0", ParallelConfig(degrees=degrees or {"seq": 4}, devices=devices, recompute=recompute))
    return lower(graph, strategy, TrainSetup(schedule=schedule), num_devices)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_chunks_on_other_devices_move_their_state_in_order(schedule):
    """Chunks alternating devices 0, 1, 0, 1: rounds 0..3, one carry between devices per chunk after the
    first (the state's bytes, `OpDef.carry_bytes`), each chunk's forward after its source's and its
    backward before it, under both schedules."""
    plan = carry_plan((0, 1, 0, 1), schedule=schedule)
    i = plan.flow.index["lstms.0"]
    step = plan.ops[i]
    state = 2 * 1 * 4 * 16 * 4  # (h, c) x layers x samples x hidden x float32
    assert step.rounds == (0, 1, 2, 3) and step.num_rounds == 4
    assert step.carry_moves == ((1, 0, state), (2, 1, state), (3, 2, state))
    fwd = [r for j, r in plan.forward_order if j == i]
    bwd = [r for j, r in plan.backward_order if j == i]
    assert fwd == [0, 1, 2, 3] and bwd == [3, 2, 1, 0]
    # on one device nothing moves
    assert carry_plan((1, 1, 1, 1)).ops[i].carry_moves == ()
    # a sample range's chunks on one device, the other's handed over
    two = carry_plan((0, 0, 1, 0), degrees={"sample": 2, "seq": 2})
    assert two.ops[i].rounds == (0, 1, 0, 2) and two.ops[i].carry_moves == ((3, 2, state // 2),)


def test_a_carry_between_devices_is_a_collective_of_its_two_devices():
    """`StepPlan.collectives` counts one all-to-all per carry and pass on both devices (the sender's
    bytes: the state forward, its gradient backward), `process_groups` holds the pair, and a recomputing
    chunk keeps the state it received (its recomputation moves nothing)."""
    plan = carry_plan((0, 1, 0, 1))
    i = plan.flow.index["lstms.0"]
    step = plan.ops[i]
    state = step.carry_moves[0][2]
    with_moves, groups = plan.collectives(), plan.process_groups()
    step.carry_moves = ()
    without = plan.collectives()
    for d in (0, 1):
        # device 0 sends the state to chunks 1 and 3 and receives chunk 2's: 3 carries, 2 passes each
        sent = 2 * state if d == 0 else state  # forward: 0 -> 1 twice; backward: 1 -> 0 (chunk 2's source)
        sent += state if d == 0 else 2 * state
        assert with_moves[d][ALL_TO_ALL]["count"] == without[d][ALL_TO_ALL]["count"] + 6
        assert with_moves[d][ALL_TO_ALL]["bytes"] == without[d][ALL_TO_ALL]["bytes"] + sent
    assert with_moves[2] == without[2]
    assert (0, 1) in groups
    # the pair (0, 1) only carries: the parameters' all-reduce is over (0, 1, 2), the edges' exchanges
    # with device 2
    apart = carry_plan((0, 1, 0, 2))
    assert (0, 1) in apart.process_groups() and (0, 2) in apart.process_groups()
    apart.ops[i].carry_moves = ()
    assert (0, 1) not in apart.process_groups()
    kept = carry_plan((0, 1, 0, 1), recompute=True).ops[i]
    assert kept.activation_bytes == (0, state, state, state)
    local = carry_plan((0, 0, 0, 0), recompute=True).ops[i]
    assert local.activation_bytes == (0, 0, 0, 0)
    assert plan.ops[i].activation_bytes[1:] == carry_plan((0, 0, 0, 0)).ops[i].activation_bytes[1:]
