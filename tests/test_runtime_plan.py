"""The runtime's execution plan (no processes): transfers per edge, partial sums, gradient-sync groups,
and the single-process interpreter against plain PyTorch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime.plan import build_plan
from runtime.train import TrainOptions, Workload, integer_highs, synthetic_batch, train_rank
from soap.config import ParallelConfig
from soap.graph import Operator, OperatorGraph, ParamSpec, TensorRef, TensorSpec
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


def remote(edge) -> list:
    return [t for t in edge.transfers if t.src != t.dst]


def test_data_parallel_plan_moves_nothing_and_syncs_every_parameter():
    g = mlp_graph()
    plan = build_plan(g, strategy(g, cfg((0, 1), sample=2)), 2)
    assert all(not remote(e) for edges in plan.edges.values() for e in edges)
    assert {(e.fqn, e.group) for e in plan.sync} == {
        (f"fc{i}.{p}", (0, 1)) for i in range(2) for p in ("weight", "bias")}
    # Gradients finish in reverse order: fc1's parameters are ready before fc0's.
    assert [e.ready_after for e in plan.sync] == ["fc1", "fc1", "fc0", "fc0"]
    assert plan.groups == ((0, 1),)
    loss_edges = plan.edges["loss"]
    assert not loss_edges[0].reduced and plan.loss_op == "loss"


def test_partial_sums_into_a_sample_split_consumer_are_a_reduce_scatter():
    """fc1 split on in_features (partial sums) feeding a sample-split loss: each loss part adds its rows
    from both fc1 parts, one local and one remote (and backward sends each half's gradient back)."""
    g = mlp_graph()
    s = strategy(g, cfg((0, 1), sample=2), fc0=cfg((0, 1), out_features=2), relu0=cfg((0, 1), d1=2),
                 fc1=cfg((0, 1), in_features=2))
    plan = build_plan(g, s, 2)
    edge = plan.edges["loss"][0]
    assert edge.reduced and edge.needs_grad
    assert sorted((t.src, t.dst, t.region) for t in edge.transfers) == [
        (0, 0, ((0, 4), (0, 16))), (0, 1, ((4, 8), (0, 16))),
        (1, 0, ((0, 4), (0, 16))), (1, 1, ((4, 8), (0, 16)))]
    # Megatron's pair: the column-parallel output feeds the row-parallel input without moving.
    assert not remote(plan.edges["fc1"][0]) and not remote(plan.edges["relu0"][0])
    # fc0 needs all rows of the input on both ranks: each rank reads them from the batch it holds.
    assert plan.edges["fc0"][0].local and not remote(plan.edges["fc0"][0])
    # Sharded weights are not synchronized; fc1's bias lives on the first in_features chunk only.
    assert plan.sync == ()
    assert plan.shards["fc1.bias"] == {((0, 16),): (0,)}


def test_model_parallel_plan_sends_one_activation_and_no_gradient_to_inputs():
    g = mlp_graph()
    s = strategy(g, cfg((0,)), fc1=cfg((1,)), loss=cfg((1,)), target=cfg((1,)))
    plan = build_plan(g, s, 2)
    moves = [(e.op, t.src, t.dst) for edges in plan.edges.values() for e in edges for t in remote(e)]
    assert moves == [("fc1", 0, 1)]
    assert not plan.edges["fc0"][0].needs_grad and plan.edges["fc1"][0].needs_grad
    assert plan.sync == ()


def test_overlapping_shards_of_one_parameter_sync_as_full_tensors():
    """The same weight read whole by one part and row-split by another op's parts (tied weights)."""
    g = mlp_graph(sizes=(16, 16, 16))
    tied = [Operator(name=op.name, kind=op.kind, inputs=op.inputs, outputs=op.outputs, attrs=op.attrs,
                     params={k: ParamSpec(shape=p.shape, fqn=p.fqn.replace("fc1", "fc0"))
                             for k, p in op.params.items()})
            for op in g]
    g = OperatorGraph(tied, name="tied", batch_size=8)
    s = strategy(g, cfg((0,)), fc1=cfg((0, 1), out_features=2))
    plan = build_plan(g, s, 2)
    entries = {e.fqn: e for e in plan.sync}
    assert entries["fc0.weight"].region is None and entries["fc0.weight"].group == (0, 1)
    assert entries["fc0.weight"].ready_after == "fc0"


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


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_single_process_interpreter_equals_plain_pytorch(optimizer):
    g = mlp_graph()
    s = {op.name: {"degrees": {}, "devices": [0]} for op in g}
    result = train_rank(0, 1, build=build_hand_mlp, graph=g.to_dict(), strategy=s,
                        options=TrainOptions(steps=3, lr=0.05, optimizer=optimizer, verify=True))
    v = result["verify"]
    assert v["max_loss_rel_diff"] == 0.0 and v["max_param_rel_diff"] == 0.0, v
    assert len(result["losses"]) == 3


def test_gradient_sync_groups_are_exactly_the_holders():
    """On 4 devices: fc0 data parallel over (1, 2), fc1 over (3, 0): each weight is all-reduced within its
    own pair, and no group contains a rank that does not hold the parameter."""
    g = mlp_graph()
    s = strategy(g, cfg((0, 1, 2, 3), sample=4), fc0=cfg((1, 2), sample=2), relu0=cfg((1, 2), sample=2),
                 fc1=cfg((3, 0), sample=2))
    plan = build_plan(g, s, 4)
    assert {e.fqn: e.group for e in plan.sync} == {"fc0.weight": (1, 2), "fc0.bias": (1, 2),
                                                   "fc1.weight": (0, 3), "fc1.bias": (0, 3)}
    assert plan.groups == ((0, 3), (1, 2))


def test_grad_sync_launches_buckets_during_backward_and_writes_sums_back(monkeypatch):
    """A bucket is launched (asynchronously) as soon as it is full, before `finish`; a bucket of one
    gradient is reduced in place, a larger one through a flat buffer; `finish` writes the sums back."""
    from runtime import collectives
    from runtime.plan import SyncEntry

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
    entries = [SyncEntry(fqn=f, region=((0, n),), group=(0, 1), ready_after=op, numel=n, dtype="float32")
               for f, n, op in [("big", 300, "fc1"), ("a", 10, "fc0"), ("b", 20, "fc0")]]
    grads = {e.fqn: torch.full((e.numel,), 1.0) for e in entries}
    out = {}
    sync = collectives.GradSync(entries, rank=0, groups={(0, 1): "G"}, bucket_bytes=1000,
                                grad_of=lambda e: grads[e.fqn], set_grad=lambda e, v: out.__setitem__(e.fqn, v))
    sync.ready("fc1")
    assert launched == [(300, "G")]  # 1200 bytes: launched at once, overlapping the rest of backward
    sync.ready("fc0")
    assert launched == [(300, "G")]  # 120 bytes: waits for more
    sync.finish()
    assert launched == [(300, "G"), (30, "G")]
    assert out["big"] is grads["big"] and torch.equal(out["big"], torch.full((300,), 2.0))
    assert torch.equal(out["a"], torch.full((10,), 2.0)) and torch.equal(out["b"], torch.full((20,), 2.0))
    # A rank outside the group takes no part.
    other = collectives.GradSync(entries, rank=2, groups={(0, 1): None}, bucket_bytes=1, grad_of=None,
                                 set_grad=None)
    other.ready("fc1")
    other.ready("fc0")
    other.finish()
    assert len(launched) == 2
