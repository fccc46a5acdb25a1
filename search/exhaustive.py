"""Exhaustive search over every strategy of a small graph: the optimum the MCMC search should reach.

Owns `exhaustive` and `space_size`. Every op the search proposes for (`search.space.ConfigSpace.ops`)
takes every config `ConfigSpace.configs` enumerates, depth first, each change costed by the caller's
`Evaluator` (delta simulation: one op re-timed per step), and the best that fits is the optimum of that
space under the simulator: the chains' space without its micro-batched and chunked configs (repeated
devices), which the chains reach only through their own moves (`search.space`), or with `rounds` the
whole space: each config also in every micro-batch count and then every chunk count its moves offer
(`ConfigSpace.microbatch_options`, `chunk_options`). The count is the product of the ops' config counts:
`space_size` says it before anything runs, and `exhaustive` refuses more than `limit` strategies. Meant
for tests and benchmarks on graphs of a few ops on a few devices. Must not import torch, the runtime or
soapflow.
"""

from __future__ import annotations

import math

from search.evaluate import Cost, Evaluator
from search.space import ConfigSpace
from soap.config import ParallelConfig
from soap.graph import OperatorGraph
from soap.strategy import Strategy
from soap.topology import DeviceTopology


def space_size(graph: OperatorGraph, topology: DeviceTopology, *, rounds: bool = False) -> int:
    """How many strategies the search's space holds for `graph` on `topology` (`rounds`: module docstring)."""
    space = ConfigSpace(graph, topology)
    if not rounds:
        return math.prod(space.num_configs(name) for name in space.ops)
    return math.prod(len(_options(space, name, rounds)) for name in space.ops)


def _options(space: ConfigSpace, name: str, rounds: bool) -> list[ParallelConfig]:
    """The configs of op `name` the exhaustive search goes through (module docstring)."""
    configs = list(space.configs(name))
    if not rounds:
        return configs
    with_microbatches = configs + [o for c in configs for o in space.microbatch_options(name, c)
                                   if space.microbatch_count(name, o) != 1]
    chunked = [o for c in with_microbatches for o in space.chunk_options(name, c)
               if space.split_chunks(name, o).count != 1]
    return list(dict.fromkeys(with_microbatches + chunked))


def exhaustive(graph: OperatorGraph, topology: DeviceTopology, start: Strategy, evaluator: Evaluator, *,
               limit: int = 200_000, rounds: bool = False) -> tuple[Strategy, Cost, int]:
    """The fastest strategy that fits among all of the search's space (module docstring; `rounds`: with
    its micro-batched and chunked configs), its cost and the number of strategies costed. `start` gives
    the configs of the ops the space does not propose for (sources). `ValueError` when the space holds
    more than `limit` strategies or none fits."""
    space = ConfigSpace(graph, topology)
    names = list(space.ops)
    options = [_options(space, name, rounds) for name in names]  # (per op: a few hundred configs at most)
    size = math.prod(len(o) for o in options)
    if size > limit:
        raise ValueError(f"{size} strategies is more than the limit of {limit}")
    current = dict(start.configs)
    cost = evaluator.start(start)
    best: tuple[Cost, dict[str, ParallelConfig]] | None = None
    seen = 0

    def visit(k: int) -> None:
        nonlocal cost, best, seen
        if k == len(names):
            seen += 1
            if cost.feasible and (best is None or cost.time_ms < best[0].time_ms):
                best = (cost, dict(current))
            return
        name = names[k]
        for cfg in options[k]:
            if cfg != current[name]:
                cost = evaluator.propose(name, cfg)
                evaluator.accept()
                current[name] = cfg
            visit(k + 1)

    visit(0)
    if best is None:
        raise ValueError(f"none of the {seen} strategies fits in memory")
    return Strategy(best[1]), best[0], seen


__all__ = ["exhaustive", "space_size"]
