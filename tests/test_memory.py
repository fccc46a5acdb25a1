"""`runtime.memory`: the measured peak of live tensor bytes, on cases computed by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime.executor import Executor
from runtime.memory import measure_step, track_peak
from runtime.train import make_optimizer, named_tensors, synthetic_batch
from search.baselines import dp
from soap.capture import capture
from soap.lowering import lower
from soap.setup import TrainSetup
from soap.topology import load_topology

F32 = 4


def test_track_peak_counts_held_temporaries_and_frees():
    held = torch.zeros(1000)
    keep = [torch.ones(10)]
    with track_peak(iter([held, keep[0]])) as peak:
        a = torch.empty(2000)  # 8000 B, freed at once
        del a
        keep.pop()  # the last reference to a held tensor: it stops counting
        b = torch.zeros(1500)
        c = b + 1  # 6000 B each: the peak, 4000 + 6000 + 6000
    assert peak.peak_bytes == 1000 * F32 + 2 * 1500 * F32
    assert peak.by_kind == {"held": 1000 * F32, "forward": 2 * 1500 * F32}
    del b, c


def _linear_executor(setup: TrainSetup):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(256, 512))
    x = torch.empty(64, 256, device="meta")
    y = torch.empty(64, 512, device="meta")
    graph = capture(module, (x,), y, nn.functional.mse_loss, name="linear", batch_size=64)
    plan = lower(graph, dp(graph, load_topology("cpu-1")), setup, 1)
    executor = Executor(graph, plan, rank=0, tensors=named_tensors(module), module=module)
    return plan, executor, make_optimizer(executor.parameters(), setup), (x, y)


def test_measure_step_of_a_linear_under_sgd_by_hand():
    """Linear(256 -> 512) + mse at batch 64 on one process, SGD with momentum, a step after the first:
    the peak is in the backward of the linear, when its weight and bias gradients, its output (kept for
    the loss's backward) and that output's gradient are all live, next to the parameters, the momentum
    and the batch. The previous step's batch, which the executor holds until forward replaces it, is
    gone by then."""
    setup = TrainSetup(optimizer="sgd", momentum=0.9)
    plan, executor, optimizer, example = _linear_executor(setup)
    for step in range(2):
        batch = synthetic_batch(example, step=step, seed=0, highs={})
        peak = measure_step(executor, optimizer, batch, step=step)
    params = (256 * 512 + 512) * F32
    x, y, out = 64 * 256 * F32, 64 * 512 * F32, 64 * 512 * F32
    loss = F32
    assert peak.by_kind == {"held": params + x + y, "optimizer": params, "forward": out + loss,
                            "backward": params + out}
    assert peak.peak_bytes == sum(peak.by_kind.values())
    # The model counts the same terms, and as its transient the largest of one op's backward: the loss's,
    # the gradients of its scalar output and of its input (out), 4 bytes more than the peak measured in
    # the linear's backward, where the scalar's gradient is gone.
    assert plan.memory_bytes() == [3 * params + x + y + out + loss + (out + loss)]


def test_measure_step_of_a_linear_under_adamw_by_hand():
    """The same step under AdamW peaks in the update of the weight: torch's single-tensor AdamW computes
    its denominator sqrt(v) / c + eps in two weight-sized temporaries while the bias's denominator (updated
    first) is still referenced, next to the parameters, their gradients and both moments (and one float32
    step counter per parameter tensor)."""
    setup = TrainSetup(optimizer="adamw")
    plan, executor, optimizer, example = _linear_executor(setup)
    for step in range(2):
        batch = synthetic_batch(example, step=step, seed=0, highs={})
        peak = measure_step(executor, optimizer, batch, step=step)
    weight, bias, params = 256 * 512 * F32, 512 * F32, (256 * 512 + 512) * F32
    x, y, loss = 64 * 256 * F32, 64 * 512 * F32, F32
    assert peak.by_kind == {"held": params + x + y, "optimizer": 2 * params + 2 * F32 + 2 * weight + bias,
                            "forward": loss, "backward": params}
    assert peak.peak_bytes == sum(peak.by_kind.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_track_peak_on_cuda_uses_the_allocator():
    held = torch.zeros(1 << 20, device="cuda")  # 4 MiB: sizes the allocator does not round
    with track_peak([held], device="cuda") as peak:
        a = torch.empty(2 << 20, device="cuda")
        del a
        b = torch.empty(1 << 20, device="cuda")
    assert peak.peak_bytes == (1 << 20) * F32 + (2 << 20) * F32
    del b
