"""The execution simulator: cost models, task graph, full and delta simulation, memory, traces.

Stages, in order: a `CostModel` prices op parts (`simulator.costmodel`), `simulator.comm` prices
transfers and collectives on the topology's links, `simulator.taskgraph` plans the tasks of a strategy,
`simulator.engine` instantiates and times them (full, or delta after a one-op change), and
`simulator.timeline` holds and exports the result. Imports only `soap` (never torch, the runtime or the
search).
"""

from simulator.costmodel import AnalyticalCostModel, CostModel, FixedCostModel, MeasuredCostModel
from simulator.engine import Simulator, simulate
from simulator.timeline import OutOfMemory, TaskRecord, Timeline

__all__ = ["AnalyticalCostModel", "CostModel", "FixedCostModel", "MeasuredCostModel", "OutOfMemory",
           "Simulator", "TaskRecord", "Timeline", "simulate"]
