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
- *module* (an eighth, where the chain was given reference strategies, the baselines): a class of copies
  of a module drawn uniformly (`search.structure.modules_of`: the attention of every layer, say), a
  reference drawn uniformly, and the ops of one module of the class (half the time) or of all of them
  take the reference's configs: a baseline's layout of one part of the model grafted onto the current
  strategy (Megatron's attention beside another layout of the MLP), which one op at a time would need
  many proposals through worse strategies, each op's layout being only as good as its neighbours';
- *single* (the rest): `ConfigSpace.propose`, one op drawn uniformly with a config drawn uniformly.

Every config a move gives is one of the op's configs in the space (`ConfigSpace.contains`): ops for
which it is not (a copy whose parameters another op shares cannot shard) are left out of the move. The
single moves are symmetric; the tied, copy and propagation moves are not (their reverse is not as likely
as they are), so, as in FlexFlow, the chain is Metropolis-Hastings in its acceptance rule but not an
exact sampler of exp(-beta cost): the search wants the best strategy it meets, not the distribution.

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
MODULE_SHARE = 0.125


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
        module = propagation + (MODULE_SHARE if self.modules else 0.0)
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
            cfg = carried(self.graph, name, current[name], current[other], self.space.num_devices)
            changes = {} if cfg is None else {name: cfg}
        elif r < module:
            modules = self.modules[rng.randrange(len(self.modules))]
            reference = self.references[rng.randrange(len(self.references))]
            chosen = modules if rng.random() < 0.5 else [modules[rng.randrange(len(modules))]]
            changes = {m: reference[m] for names in chosen for m in names}
        else:
            # drawn from the op's own configs, or the current layout with other recompute and shard
            # choices, which the space holds unless the layout lies outside it (a baseline's time chunks)
            name, cfg = self.space.propose(rng, current)
            return {name: cfg} if cfg != current[name] and self.space.contains(name, cfg) else {}
        return {m: cfg for m, cfg in changes.items() if cfg != current[m] and self.space.contains(m, cfg)}


__all__ = ["Moves"]
