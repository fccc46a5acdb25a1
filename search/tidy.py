"""Readable strategies: ops whose layout does not matter take their neighbours' before a strategy is shown.

Owns `tidy`. A chain's best strategy carries leftovers of its random walk: ops whose config changes
nothing in the predicted cost (a reshape on two devices of their own, while its neighbours run data
parallel on all of them), which make the strategy hard to read. `tidy` visits the *outliers*, ops whose
layout (degrees and devices) matches none of their neighbours' (the producers of their inputs, then
their consumers), and gives each the first neighbour's layout that keeps the strategy feasible and its
predicted time no longer than it was; then, for each run of neighbouring outliers left (a chain of ops
moved together, where moving one alone costs time), the first layout of an op next to the run that,
given to the whole run, does the same (a run that gains nothing is put back as it was).

A neighbour's layout carries over by dim name: the degrees of the dims the op also has, on the
neighbour's devices (skipped where the op has fewer parts that way, or the config is not valid for it);
the op keeps its own `recompute`, and its `shard` where still valid. Rounds repeat until nothing moves,
at most `max_rounds`, and no move is tried after `deadline` (a `time.monotonic()` value): on a large
graph with many outliers every try is a delta simulation, and the search gives tidying a share of its
time budget. What has moved by then stays (each move kept the strategy feasible and no slower).

Every change goes through the caller's `Evaluator` (delta simulation), so the result's cost is the
simulator's, never an estimate. Must not import torch, the runtime or soapflow.
"""

from __future__ import annotations

import math
import time

from search.evaluate import Cost, Evaluator, Move
from search.structure import carried, neighbours
from soap.config import ParallelConfig
from soap.graph import OperatorGraph
from soap.lowering import NotReplicable
from soap.registry import op_def
from soap.strategy import Strategy


class _OutOfTime(Exception):
    """`tidy`'s deadline has passed."""


def _layout(cfg: ParallelConfig) -> tuple:
    return (tuple(sorted(cfg.degrees.items())), cfg.devices)


def _groups(names: list[str], near: dict[str, list[str]]) -> list[list[str]]:
    """`names` in connected groups (neighbours in one group), each in graph order."""
    left, order, out = set(names), {n: i for i, n in enumerate(names)}, []
    for name in names:
        if name not in left:
            continue
        group, todo = [], [name]
        left.discard(name)
        while todo:
            n = todo.pop()
            group.append(n)
            for m in near[n]:
                if m in left:
                    left.discard(m)
                    todo.append(m)
        out.append(sorted(group, key=order.__getitem__))
    return out


def tidy(graph: OperatorGraph, strategy: Strategy, evaluator: Evaluator, *, num_devices: int,
         max_rounds: int = 3, deadline: float | None = None) -> tuple[Strategy, Cost]:
    """`strategy` with its outliers given their neighbours' layouts where the predicted time does not grow
    and it still fits (module docstring), and its cost. `evaluator` is started on `strategy` here; no move
    is tried once `time.monotonic()` passes `deadline` (None: no limit)."""
    cost = evaluator.start(strategy)
    near = neighbours(graph)
    current = strategy

    def outliers() -> list[str]:
        return [op.name for op in graph if not op_def(op.kind).everywhere and near[op.name]
                and _layout(current[op.name]) not in [_layout(current[n]) for n in near[op.name]]]

    def moved_to(changes: dict[str, ParallelConfig]) -> bool:
        """Make `changes` where the strategy stays feasible and its time does not grow."""
        nonlocal current, cost
        if deadline is not None and time.monotonic() >= deadline:
            raise _OutOfTime
        # what would be slower, or would not fit where the strategy fits, may be rejected untimed
        try:
            move = Move(evaluator, current, changes, cost.time_ms if cost.feasible else math.inf)
        except NotReplicable:
            return False  # (an evaluator of one replica: the change would leave the replicas)
        if not (move.cost.exact and move.cost.feasible >= cost.feasible and move.cost.time_ms <= cost.time_ms):
            move.reject()
            return False
        move.accept()
        current, cost = move.strategy, move.cost
        return True

    try:
        for _ in range(max_rounds):
            moved = False
            # one op at a time
            for name in outliers():
                for n in near[name]:
                    cfg = carried(graph, name, current[name], current[n], num_devices, other_op=n)
                    if cfg is not None and cfg != current[name] and moved_to({name: cfg}):
                        moved = True
                        break
            # a run of neighbouring outliers together, to the layout of an op next to the run
            for group in _groups(outliers(), near):
                members = set(group)
                for n in dict.fromkeys(m for g in group for m in near[g] if m not in members):
                    changes = {g: carried(graph, g, current[g], current[n], num_devices, other_op=n) for g in group}
                    changes = {g: cfg for g, cfg in changes.items() if cfg is not None and cfg != current[g]}
                    if changes and moved_to(changes):
                        moved = True
                        break
            if not moved:
                break
    except _OutOfTime:
        pass  # what moved stays
    return current, cost


__all__ = ["tidy"]
