"""Capture's fused-projection rule (`soap.capture.fused`): a linear whose output is split becomes one linear
per piece over its block of the fused weight; it computes and trains as the model does, and a head split of
attention then moves nothing into the attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_capture import meta_like
from torch import nn

from runtime.train import TrainOptions, Workload, train_rank
from search.baselines import tp
from soap.capture import capture
from soap.config import param_pieces
from soap.graph import OperatorGraph, ParamSpec
from soap.lowering import lower
from soap.setup import TrainSetup
from soap.strategy import Strategy
from soap.topology import load_topology


class FusedAttention(nn.Module):
    """q, k and v from one linear, split (or chunked) on the last axis, then SDPA over `heads`."""

    def __init__(self, d: int = 16, heads: int = 2, *, chunk: bool = False, tie: bool = False,
                 reuse: bool = False) -> None:
        super().__init__()
        self.heads, self.chunk, self.tie, self.reuse = heads, chunk, tie, reuse
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        h = self.qkv(x)
        q, k, v = h.chunk(3, dim=-1) if self.chunk else h.split(d, dim=2)
        q, k, v = (z.reshape(n, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(n, t, d)
        out = self.proj(y)
        if self.tie:  # the fused weight read by a second op
            out = out + F.linear(x, self.qkv.weight)[..., :d]
        if self.reuse:  # the fused output read beside the split
            out = out + h[..., :d]
        return out.mean(dim=1)


def _graph(**kwargs) -> tuple[nn.Module, OperatorGraph]:
    torch.manual_seed(0)
    model = FusedAttention(**kwargs)
    d = kwargs.get("d", 16)
    return model, capture(model, meta_like(torch.randn(2, 6, d)), meta_like(torch.randn(2, d)))


@pytest.mark.parametrize("chunk", [False, True], ids=["split", "chunk"])
def test_a_split_fused_linear_becomes_one_linear_per_block(chunk):
    _, graph = _graph(chunk=chunk)
    assert not [op for op in graph if op.kind == "split"] and "qkv" not in graph
    pieces = [graph[f"qkv.{c}"] for c in "abc"]
    for i, op in enumerate(pieces):
        weight, bias = op.params["weight"], op.params["bias"]
        assert (weight.fqn, weight.shape, weight.offset, weight.full_shape) == ("qkv.weight", (16, 16), (16 * i, 0),
                                                                                (48, 16))
        assert (bias.fqn, bias.shape, bias.offset, bias.full_shape) == ("qkv.bias", (16,), (16 * i,), (48,))
        # 2 FLOPs per multiply-add of the piece's own 16 output columns, over 12 rows of 16 inputs
        assert op.fwd_flops == 2 * 12 * 16 * 16
    # the parameter count is the model's, each fused parameter counted once
    assert graph.num_params == 48 * 16 + 48 + 16 * 16 + 16
    # pieces hold disjoint blocks: none shares a parameter with another
    assert not graph.shared_params()
    # the registry's regions (a piece's own coordinates) land in the fused weight's
    whole = tuple((0, s) for s in pieces[2].outputs[0].shape) + ((0, 16),)
    assert param_pieces(pieces[2], whole)["weight"] == ("qkv.weight", ((32, 48), (0, 16)))


@pytest.mark.parametrize("kwargs", [{"tie": True}, {"reuse": True}], ids=["weight-read-twice", "output-read-twice"])
def test_a_fused_linear_whose_weight_or_output_is_read_elsewhere_stays_fused(kwargs):
    _, graph = _graph(**kwargs)
    assert "qkv" in graph and [op for op in graph if op.kind == "split"]
    assert not [p for op in graph for p in op.params.values() if p.offset]


def test_the_graph_keeps_blocks_through_its_file_format():
    _, graph = _graph()
    again = OperatorGraph([type(op).from_dict(op.to_dict()) for op in graph], name=graph.name,
                          batch_size=graph.batch_size)
    assert again.fingerprint == graph.fingerprint
    assert again["qkv.b"].params["weight"] == graph["qkv.b"].params["weight"]


def test_a_block_must_lie_inside_its_parameter():
    with pytest.raises(ValueError, match="does not lie inside"):
        ParamSpec(shape=(16, 16), fqn="w", offset=(40, 0), whole_shape=(48, 16))
    with pytest.raises(ValueError, match="needs both"):
        ParamSpec(shape=(16, 16), fqn="w", offset=(16, 0))


def test_one_process_trains_as_pytorch_does():
    def build() -> Workload:
        torch.manual_seed(0)
        return Workload(module=FusedAttention(), inputs=(torch.empty(2, 6, 16, device="meta"),),
                        target=torch.empty(2, 16, device="meta"), loss_fn=nn.functional.mse_loss)

    graph = capture(build().module, (torch.empty(2, 6, 16, device="meta"),), torch.empty(2, 16, device="meta"),
                    nn.functional.mse_loss)
    single = {op.name: {"degrees": {}, "devices": [0]} for op in graph}
    result = train_rank(0, 1, build=build, graph=graph.to_dict(), strategy=single,
                        options=TrainOptions(steps=2, setup=TrainSetup(lr=0.05), verify=True))
    assert result["verify"]["passed"], result["verify"]


def test_heads_split_over_two_devices_move_nothing_into_the_attention():
    """Under tp (q, k, v column-parallel, attention on heads, proj row-parallel) each device computes the
    same heads of q, k and v: no edge into the attention moves data. The fused weight's blocks are
    sharded per device by rows, so no device holds another's rows."""
    _, graph = _graph(d=32, heads=4)
    topo = load_topology("cpu-2")
    strategy = tp(graph, topo)
    attention = next(op.name for op in graph if op.kind == "attention")
    assert dict(strategy[attention].degrees) == {"heads": 2}
    plan = lower(graph, Strategy(dict(strategy.configs)), TrainSetup(), 2)
    i = plan.flow.index[attention]
    for slot in range(3):
        eid = plan.flow.slot_edges[i][slot]
        assert eid is not None and not plan.edges[eid].moving, slot
    shards = {key: devices for p in plan.params for key, devices in p.shards.items() if key[0] == "qkv.weight"}
    assert sorted(shards) == [("qkv.weight", ((lo, lo + 16), (0, 32))) for lo in range(0, 96, 16)]
    assert sorted(shards.values()) == [(0,), (0,), (0,), (1,), (1,), (1,)]
