"""A lower bound on the simulated step time of any strategy: how far from the optimum a result can be.

Owns `StepBound` and `lower_bound`. The simulator (`simulator.engine`) runs each op part's forward and
backward as tasks of the cost model's durations on its device, one task at a time per device, and a
part after the parts it reads; communication, partial-sum reductions, recomputation, gathers and
optimizer steps only add time. So for every strategy, with the op configs the search can propose (each
op's degree combinations, `search.space`):

- *work*: the devices together run every op's parts, at least, per op, the least total part time over
  its degree combinations and the topology's device kinds; the step is at least that sum over the
  device count;
- *path*: along any chain of ops that read each other's outputs, each op's forward follows its
  producer's and, in backward, precedes it; every part of an op costs at least the op's least part time
  over its combinations and device kinds, so the step is at least the longest chain's sum of those,
  forward and backward.

`lower_bound` is the larger of the two. It is a bound, not an estimate: the simulated time of every
strategy is at least it (tests check that on random strategies), and the gap between a found strategy
and the bound is an upper bound on how much faster any strategy could be. It does not count memory: a
strategy that fits may be slower than the bound allows for reasons the bound cannot see.

Must not import torch, the runtime or soapflow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from search.space import ConfigSpace
from simulator.costmodel import AnalyticalCostModel, CostModel
from soap.graph import OperatorGraph
from soap.lowering import GradFlow
from soap.opdef import part_boxes
from soap.registry import dims_of
from soap.setup import TrainSetup
from soap.topology import DeviceTopology


@dataclass(frozen=True, slots=True)
class StepBound:
    """`work_ms` and `path_ms` (module docstring); `time_ms`, the larger, bounds any strategy's step."""

    work_ms: float
    path_ms: float

    @property
    def time_ms(self) -> float:
        return max(self.work_ms, self.path_ms)

    def gap(self, time_ms: float) -> float:
        """How much slower `time_ms` is than the bound, as a fraction of the bound (0: optimal)."""
        return time_ms / self.time_ms - 1.0 if self.time_ms > 0 else 0.0


def lower_bound(graph: OperatorGraph, topology: DeviceTopology, *, cost_model: CostModel | None = None,
                setup: TrainSetup | None = None) -> StepBound:
    """The bound of `graph` on `topology` under `cost_model` and `setup` (the simulator's defaults when
    None), as the module docstring derives it."""
    cost_model = cost_model if cost_model is not None else AnalyticalCostModel()
    flow = GradFlow(graph, setup if setup is not None else TrainSetup())
    space = ConfigSpace(graph, topology)  # the ops of `flow.graph` by name, in the compute dtype
    kinds = {d.kind: d for d in topology.devices}.values()
    least_total: list[float] = []
    least_part: list[float] = []
    found: dict[int, tuple[float, float]] = {}  # by `GradFlow.op_class`: the copies of a block cost alike
    for i, op in enumerate(flow.ops):
        if flow.everywhere[i]:
            least_total.append(0.0)
            least_part.append(0.0)
            continue
        known = found.get(flow.op_class[i])
        if known is None:
            known = found[flow.op_class[i]] = _least_times(op, space.degree_options(op.name), kinds, cost_model,
                                                           flow.grad_inputs[i], flow.needs_bwd[i])
        least_total.append(known[0])
        least_part.append(known[1])
    work = sum(least_total) / topology.num_devices
    # the longest chain: ops in graph (topological) order, each after the producers of its inputs
    longest: list[float] = []
    for i, op in enumerate(flow.ops):
        before = max((longest[flow.index[ref.op]] for ref in op.inputs), default=0.0)
        longest.append(before + least_part[i])
    return StepBound(work_ms=work, path_ms=max(longest, default=0.0))


def _least_times(op, options, kinds, cost_model: CostModel, grads, bwd: bool) -> tuple[float, float]:
    """(the least total part time, the least part time) of `op` over its degree `options` and device
    `kinds`: forward, and backward where it runs one."""
    dims = dims_of(op)
    total, part = math.inf, math.inf
    for degrees in options:
        for device in kinds:
            times = []
            for box in part_boxes(dims, dict(degrees)):
                fwd_ms, bwd_ms = cost_model.compute_ms(op, box, device, grads)
                times.append(fwd_ms + (bwd_ms if bwd else 0.0))
            total, part = min(total, sum(times)), min(part, min(times))
    return total, part


__all__ = ["StepBound", "lower_bound"]
