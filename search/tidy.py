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
at most `max_rounds`.

Every change goes through the caller's `Evaluator` (delta simulation), so the result's cost is the
simulator's, never an estimate. Must not import torch, the runtime or soapflow.
"""

from __future__ import annotations

from search.evaluate import Cost, Evaluator
from soap.config import ConfigError, ParallelConfig, param_replicas, validate
from soap.graph import OperatorGraph
from soap.registry import dims_of, op_def
from soap.strategy import Strategy


def _layout(cfg: ParallelConfig) -> tuple:
    return (tuple(sorted(cfg.degrees.items())), cfg.devices)


def _neighbours(graph: OperatorGraph) -> dict[str, list[str]]:
    """Per op, the ops that produce its inputs (in input order) then those that consume its outputs (in
    graph order), leaving out sources that exist everywhere (the batch, constants), each once."""
    near: dict[str, list[str]] = {op.name: [] for op in graph}
    for op in graph:
        for ref in op.inputs:
            if op_def(graph[ref.op].kind).everywhere:
                continue
            if ref.op not in near[op.name]:
                near[op.name].append(ref.op)
    for op in graph:
        for ref in op.inputs:
            if not op_def(graph[ref.op].kind).everywhere and op.name not in near[ref.op]:
                near[ref.op].append(op.name)
    return near


def _carried(graph: OperatorGraph, name: str, own: ParallelConfig, other: ParallelConfig,
             num_devices: int) -> ParallelConfig | None:
    """`other`'s layout carried over to op `name` (module docstring), or None where it does not fit."""
    op = graph[name]
    dims = {d.name for d in dims_of(op)}
    degrees = {d: g for d, g in other.degrees.items() if d in dims}
    try:
        cfg = ParallelConfig(degrees=degrees, devices=other.devices, recompute=own.recompute)
        if own.shard > 1 and param_replicas(op, cfg) % own.shard == 0:
            cfg = cfg.replace(shard=own.shard)
        validate(op, cfg, num_devices)
    except (ConfigError, ValueError):
        return None
    return cfg


def _apply(evaluator: Evaluator, current: dict[str, ParallelConfig], changes: dict[str, ParallelConfig],
           cost: Cost) -> Cost:
    """Make `changes` current one op at a time (each accepted); the cost after the last."""
    for name, cfg in changes.items():
        cost = evaluator.propose(name, cfg)
        evaluator.accept()
        current[name] = cfg
    return cost


def _no_worse(trial: Cost, cost: Cost) -> bool:
    return trial.feasible >= cost.feasible and trial.time_ms <= cost.time_ms


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
         max_rounds: int = 3) -> tuple[Strategy, Cost]:
    """`strategy` with its outliers given their neighbours' layouts where the predicted time does not grow
    and it still fits (module docstring), and its cost. `evaluator` is started on `strategy` here."""
    cost = evaluator.start(strategy)
    near = _neighbours(graph)
    current = dict(strategy.configs)

    def outliers() -> list[str]:
        return [op.name for op in graph if not op_def(op.kind).everywhere and near[op.name]
                and _layout(current[op.name]) not in [_layout(current[n]) for n in near[op.name]]]

    for _ in range(max_rounds):
        moved = False
        # one op at a time
        for name in outliers():
            own = current[name]
            for n in near[name]:
                cfg = _carried(graph, name, own, current[n], num_devices)
                if cfg is None or cfg == own:
                    continue
                trial = evaluator.propose(name, cfg)
                if _no_worse(trial, cost):
                    evaluator.accept()
                    current[name], cost, moved = cfg, trial, True
                    break
                evaluator.reject()
        # a run of neighbouring outliers together, to the layout of an op next to the run
        for group in _groups(outliers(), near):
            members = set(group)
            for n in dict.fromkeys(m for g in group for m in near[g] if m not in members):
                changes = {g: _carried(graph, g, current[g], current[n], num_devices) for g in group}
                changes = {g: cfg for g, cfg in changes.items() if cfg is not None and cfg != current[g]}
                if not changes:
                    continue
                undo = {g: current[g] for g in changes}
                trial = _apply(evaluator, current, changes, cost)
                if _no_worse(trial, cost):
                    cost, moved = trial, True
                    break
                _apply(evaluator, current, undo, trial)
        if not moved:
            break
    return Strategy(current), cost


__all__ = ["tidy"]
