"""The search's proposals: one op's new config, or a move over several ops that respects the model's
structure.

Owns `Moves`. A chain asks `propose(rng, current)` for its next move, a mapping op -> new config (empty:
the null move), and costs it as one proposal whatever its size. The mixture, fixed per graph:

- *tied* (a quarter of the moves, where the graph has copies, `search.structure.copies_of`): a class of
  copies drawn uniformly (the qkv projections of every transformer layer, say), a config drawn for its
  first op as a single move draws one (`ConfigSpace.propose_for`), and that config for every op of the
  class: the same change in every copy of the block, which one op at a time would need as many lucky
  proposals in a row as there are copies;
- *copy* (an eighth, where the graph has copies): an op of a class drawn uniformly, and every op that is
  a copy of an op of its block (the same copy index) takes that op's config: a layout the chain found
  for one block spreads to all of them at once;
- *propagation* (an eighth; FlexFlow's ``--enable-propagation``): an op drawn uniformly and one of its
  neighbours drawn uniformly; the op takes the neighbour's layout (`search.structure.carried`), so that
  a layout can travel along a chain of ops;
- *spread* (a sixteenth): an op drawn uniformly, a config drawn for it as a single move draws one, and
  every neighbour takes that config's layout (`search.structure.carried`: where a neighbour reads the
  op's output or the op its, along the axes of the tensor between them): a layout that pays only when the
  tensor between two ops stays in place (a linear split on its output features and its loss split on
  that axis of its input) is one proposal, where one op at a time would have to go through a worse
  strategy, each op's layout being the wrong one for the other's;
- *module* (an eighth, where the chain was given reference strategies, the baselines): a class of copies
  of a module drawn uniformly (`search.structure.modules_of`: the attention of every layer, say), a
  reference drawn uniformly, and the ops of one module of the class (half the time) or of all of them
  take the reference's configs: a baseline's layout of one part of the model grafted onto the current
  strategy (Megatron's attention beside another layout of the MLP), which one op at a time would need
  many proposals through worse strategies, each op's layout being only as good as its neighbours';
- *stage* (a sixteenth, on more than one device): an op drawn uniformly, a micro-batch count drawn as
  its micro-batch move draws one (uniformly among the counts of `ConfigSpace.microbatch_options`, 1
  included), and that count for every op of its pipeline stage (`stages_of`: the maximal run of
  consecutive proposal targets in graph order whose configs run on one set of devices), each keeping its
  layout (and chunks) as its own micro-batch move does; ops that cannot take the count (running
  statistics, a sample dim it does not divide) are left out. A lone micro-batched op in a stage without
  micro-batches is slower than without them (it waits for the whole of its producer and holds up its
  consumer), so the chain would seldom accept the single-op moves that lead to a pipeline one op at a
  time;
- *single* (the rest): `ConfigSpace.propose`, one op drawn uniformly with a config drawn uniformly (or,
  given the current strategy, its micro-batch count, chunk count or recompute and shard choices changed).

Every config a move gives is one of the op's configs in the space (`ConfigSpace.contains`): ops for
which it is not (a copy whose parameters another op shares cannot shard, a neighbour's layout the space
does not hold) are left out of the move. None of the mixture is exactly symmetric: a uniform draw
leaves a micro-batched or chunked config that only the micro-batch and chunk moves enter, and the tied,
copy, propagation, spread and stage moves are not as likely reversed as made; so, as in FlexFlow, the chain is
Metropolis-Hastings in its acceptance rule but not an exact sampler of exp(-beta cost): the search wants
the best strategy it meets, not the distribution.

Must not import torch, the runtime or soapflow.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from search.space import ConfigSpace
from search.structure import carried, copies_of, modules_of, neighbours
from soap.config import ParallelConfig
from soap.graph import OperatorGraph
from soap.strategy import Strategy

TIED_SHARE = 0.25
COPY_SHARE = 0.125
PROPAGATION_SHARE = 0.125
SPREAD_SHARE = 0.0625
MODULE_SHARE = 0.125
STAGE_SHARE = 0.0625


class Moves:
    """The moves of the search on `graph` over `space` (module docstring)."""

    def __init__(self, graph: OperatorGraph, space: ConfigSpace, references: Sequence[Strategy] = ()):
        self.graph, self.space = graph, space
        self.references = tuple(references)
        targets = set(space.ops)
        self.copies = copies_of(graph, targets)
        self.modules = modules_of(graph, targets) if self.references else []
        near = neighbours(graph)
        self.near = {name: [n for n in near[name] if n in targets] for name in space.ops}
        self.movable = [name for name in space.ops if self.near[name]]

    def propose(self, rng: random.Random, current: Strategy) -> dict[str, ParallelConfig]:
        """The next move from `current`: the ops it changes and their new configs (only those that change)."""
        r = rng.random()
        classes = self.copies.classes
        tied = TIED_SHARE if classes else 0.0
        copy = tied + (COPY_SHARE if classes else 0.0)
        propagation = copy + (PROPAGATION_SHARE if self.movable else 0.0)
        spread = propagation + (SPREAD_SHARE if self.movable else 0.0)
        module = spread + (MODULE_SHARE if self.modules else 0.0)
        stage = module + (STAGE_SHARE if self.space.num_devices > 1 else 0.0)
        if r < tied:
            members = classes[rng.randrange(len(classes))]
            cfg = self.space.propose_for(members[0], rng, current)
            changes = {m: cfg for m in members}
        elif r < copy:
            members = classes[rng.randrange(len(classes))]
            source = self.copies.same_copy(members[rng.randrange(len(members))])
            changes = {m: current[source[k]] for k, names in enumerate(classes) if k in source for m in names}
        elif r < propagation:
            name = self.movable[rng.randrange(len(self.movable))]
            other = self.near[name][rng.randrange(len(self.near[name]))]
            cfg = carried(self.graph, name, current[name], current[other], self.space.num_devices, other_op=other)
            changes = {} if cfg is None else {name: cfg}
        elif r < spread:
            name = self.movable[rng.randrange(len(self.movable))]
            cfg = self.space.propose_for(name, rng, current)
            changes = {name: cfg}
            for other in self.near[name]:
                mine = carried(self.graph, other, current[other], cfg, self.space.num_devices, other_op=name)
                if mine is not None:
                    changes[other] = mine
        elif r < module:
            modules = self.modules[rng.randrange(len(self.modules))]
            reference = self.references[rng.randrange(len(self.references))]
            chosen = modules if rng.random() < 0.5 else [modules[rng.randrange(len(modules))]]
            changes = {m: reference[m] for names in chosen for m in names}
        elif r < stage:
            changes = self._stage_move(rng, current)
        else:
            # drawn from the op's own configs, or the current layout with other recompute, shard, micro-batch
            # or chunk choices, which the space holds unless the layout lies outside it (a baseline's
            # chunks in more than `search.space.MAX_CHUNKS`)
            name, cfg = self.space.propose(rng, current)
            return {name: cfg} if cfg != current[name] and self.space.contains(name, cfg) else {}
        return {m: cfg for m, cfg in changes.items() if cfg != current[m] and self.space.contains(m, cfg)}

    def _stage_move(self, rng: random.Random, current: Strategy) -> dict[str, ParallelConfig]:
        """The stage move (module docstring): one micro-batch count for every op of a drawn op's stage."""
        ops = self.space.ops
        name = ops[rng.randrange(len(ops))]
        options = self.space.microbatch_options(name, current[name])
        if not options:
            return {}
        count = self.space.microbatch_count(name, options[rng.randrange(len(options))])
        members = next(members for members in stages_of(ops, current) if name in members)
        changes = {}
        for m in members:
            cfg = self.space.with_microbatches(m, current[m], count)
            if cfg is not None:
                changes[m] = cfg
        return changes


def stages_of(ops: Sequence[str], strategy: Strategy) -> list[tuple[str, ...]]:
    """The pipeline stages of `strategy` over `ops` (op names in graph order, the proposal targets): the
    maximal runs of consecutive ops whose configs run on the same set of devices (micro-batches and chunks
    do not change an op's set), in order."""
    out: list[list[str]] = []
    last: frozenset[int] | None = None
    for name in ops:
        devices = frozenset(strategy[name].devices)
        if devices != last:
            out.append([])
            last = devices
        out[-1].append(name)
    return [tuple(members) for members in out]


__all__ = ["Moves", "stages_of"]
