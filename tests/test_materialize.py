"""Building on the meta device and materializing only a rank's pieces (runtime/materialize.py): the pieces
equal the slices and chunks of the eager build from the same seed, bit for bit, for every test model; the
replay never holds the whole model; a build that reads tensor values is refused with the reason."""

from __future__ import annotations

import functools
import types

import pytest
import runtime_cases as rc
import torch
from torch import nn

from runtime.executor import pieces_needed
from runtime.materialize import MaterializeError, record
from search.baselines import BASELINES
from soap.lowering import lower
from soap.setup import TrainSetup
from soap.topology import load_topology
from soapflow.zoo.mlp import MLP


@pytest.mark.parametrize("model", sorted(rc.MODELS))
def test_every_test_model_materializes_as_the_eager_build(model):
    rc.same_as_eager(rc.MODELS[model], rc.whole_pieces)


class Initializers(nn.Module):
    """Initializers that read values (rejection sampling, QR), a tensor from Python data, a reseed inside
    the build and a parameter whose storage is swapped after its initialization (`.data = ...`)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.empty(6, 4))
        nn.init.orthogonal_(self.a)
        self.b = nn.Parameter(torch.empty(5, 3))
        nn.init.trunc_normal_(self.b, std=2.0)
        torch.manual_seed(11)
        self.c = nn.Linear(3, 7)
        self.c.bias.data = nn.functional.pad(self.c.bias.data * 2, (0, 1))
        self.register_buffer("table", torch.tensor([[1.0, 2.0], [3.0, 4.0]]))


def test_value_reading_initializers_reseeding_and_swapped_storage():
    rc.same_as_eager(lambda: types.SimpleNamespace(module=Initializers()), rc.whole_pieces)


class ReadsValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        if self.w.sum() > 100:  # Python control flow on a value: cannot run on the meta device
            self.w.data.zero_()


def test_a_build_that_reads_values_is_refused_with_the_reason():
    with pytest.raises(MaterializeError, match="cannot be built on the meta device"):
        record(lambda: types.SimpleNamespace(module=ReadsValues()))


def deep_mlp(batch: int = 4):
    return rc.Workload(module=MLP((64,) * 9), inputs=(torch.empty(batch, 64, device="meta"),),
                       target=torch.empty(batch, 64, device="meta"), loss_fn=nn.functional.mse_loss)


@pytest.mark.parametrize("baseline", ["fsdp", "tp", "dp"])
def test_rank_pieces_under_a_plan_and_the_replay_never_holds_the_model(baseline):
    """The pieces a rank's parts hold (regions under tp, chunks under fsdp) equal the eager build's; under
    fsdp the replay holds at most a few layers beyond the rank's half of the model."""
    graph = rc.capture_workload(deep_mlp)
    strategy = BASELINES[baseline](graph, load_topology("cpu-2"))
    plan = lower(graph, strategy, TrainSetup(), 2)
    model_bytes = sum(t.nbytes for t in deep_mlp().module.parameters())
    layer_bytes = max(t.nbytes for t in deep_mlp().module.parameters())
    for rank in range(2):
        wanted = pieces_needed(plan, rank)
        assert wanted, "the rank holds nothing"
        if baseline == "fsdp":
            assert all(chunk == (rank, 2) for _, _, chunk in wanted)
        pieces = rc.same_as_eager(deep_mlp, functools.partial(lambda m, w: w, w=wanted))
        if baseline == "fsdp":
            assert pieces.peak_bytes <= model_bytes / 2 + 3 * layer_bytes < model_bytes
