"""The proposal space: every valid `ParallelConfig` of every op, enumerated lazily and sampled uniformly.

Owns `ConfigSpace`, `Microbatches` with the functions that cut a config into micro-batches and see one
as such (`microbatched`, `split_microbatches`), and `Chunks` with those for time chunks (`chunk_dim`,
`cut_chunks`, `split_chunks`; `search.baselines` lays out its chunked `mp` and `expert` with them).
A config of an op is a pair (degrees, devices):

- *degrees*: a degree per splittable iteration dim of the op (`soap.registry.dims_of`), each dividing its
  dim, their product dividing the device count, and the combination allowed by the op kind's
  `OpDef.check` (reshape refuses splits whose parts are not boxes of the input). Reduction dims are
  included: a reduction split is as valid as any other.
- *devices*: the part count's worth of distinct devices, in ascending order (part i on the i-th), taken
  from one of two families, as FlexFlow places ops:

  - contiguous: ``s, s+1, .., s+p-1`` for every start s (a block may straddle two nodes);
  - node-aligned: the same q consecutive local devices on each of k > 1 consecutive nodes
    (q < devices per node), e.g. one device per node. Only on regular topologies (every node holds M
    devices, ids node-major), where such sets are what data parallelism across nodes uses.

- *recompute*: true or false, where the op may recompute (`soap.config.recompute_refusal`);
- *shard*: every divisor of the replica count of the op's parameters under its degrees
  (`soap.config.param_replicas`), for ops with parameters no other op shares; 1 otherwise.

Nothing is materialized up front: an op's degree combinations are enumerated the first time the op is
touched (a few hundred at most even on 64 devices, since each degree divides the device count), and device
sets per part count are listed on first use (at most a few hundred tuples). A config is drawn uniformly
from the op's (degrees, devices, recompute, shard) combinations with an explicit `random.Random`:
degrees weighted by how many combinations they have, then one of them. The memo dicts are per instance
and only cache pure functions of (graph, topology), so they never change a result.

*Micro-batches* (`soap.lowering`'s rule "Rounds"): the space also holds each config above cut into M
micro-batches, M in `MICROBATCH_COUNTS` (at most the simulator's `MAX_ROUNDS` parts of an op on one
device): the degree of the op's first sample dim multiplied by M, each device's part cut into M
consecutive micro-batches that the device runs as its rounds 0..M-1 (`microbatched`). A config whose
sample split holds groups of `inner` consecutive parts on distinct devices and repeats each group M
times (micro-batch m of the batch spread over the devices, as ``hybrid:tp=T,microbatches=M`` lays out
a tensor-parallel op) is in the space too (`split_microbatches` finds M, `inner` and the config without
micro-batches, the *base*). Only counts that divide the sample dim and that `soap.config.validate`
accepts are in the space: none where `soap.config.repeat_refusal` refuses repeated devices (running
statistics, sharded parameters). Micro-batched configs are not drawn uniformly with the others (nor
enumerated by `configs`): given the current strategy, `MICROBATCH_SHARE` of `propose_for`'s proposals
change the op's micro-batch count (to 1, removing them, or to another count of the space), and its
recompute and shard redraw keeps them, as does the uniform draw wherever the drawn layout takes them
(`keeping_rounds`).

*Chunks* (`soap.lowering`'s rules "Rounds" and "Carries"): an op's *chunk dim* (`chunk_dim`) is its
carried dim (an LSTM's time steps), or, in a graph with one, for an op without parameters whose output is
(sample, time, ...), the dim of its output's axis 1 (a dropout between LSTMs). The space also holds each
config above that leaves the chunk dim whole (micro-batched ones included) cut into K chunks along it,
K a divisor of the dim from 2 to `MAX_CHUNKS` (so 8, the baselines' default, or the most that divide
fewer time steps): each part's K chunks on the part's device, which runs them one after another in time
order (`cut_chunks`, the layout of `search.baselines`' `mp` and `expert`), within `MAX_ROUNDS` rounds per
device with the micro-batches; only where `soap.config.validate` accepts them (not with sharded
parameters). Along a carried dim chunk k then starts from chunk k-1's state on the same device; a chunked
dropout runs chunk by chunk beside its LSTM. `split_chunks` recognizes them. Like micro-batches they are
not drawn uniformly: `CHUNK_SHARE` of an op's proposals (given the current strategy, for an op with a
chunk dim) change its chunk count (to 1, removing them, or another count), keeping its layout and
micro-batches; the micro-batch move, the recompute and shard redraw and (where it can) the uniform draw
keep the chunks, and
`search.moves`' propagation carries a chunked layout from an LSTM to a dropout and back.

*Replicas* (`ConfigSpace(..., replicas=Replicas(count=R, size=m))`, the search of replicas): only the configs
that lay an op out as R identical replicas of m devices (`soap.lowering.repeats`): the degrees of a config
on m devices (replica 0) with the op's first sample dim split R times more (it must come first among the
split dims and divide), the device sets replica 0's (contiguous or node-aligned within one replica)
repeated in every replica, the shards those whose every chunk all-reduce has a device in replica 0;
micro-batches and chunks where the result is still replicas. Every op that computes needs a sample dim
that splits R ways (`ValueError` otherwise, naming the op: a position table of batch 1, say).

Ops alike (same kind, attributes, tensors, parameters: the copies of a repeated block) share their
degree options, shard options and weights, found once (`ConfigSpace._kind`), and the answers of
`contains` and of the option lists for a config (`_per_kind`).

Ops whose output exists on every device for free (`OpDef.everywhere`: the batch, constants) and ops with a
single config (on one device: ops that cannot recompute) are not proposal targets. Must not import torch,
the runtime or soapflow.
"""

from __future__ import annotations

import bisect
import functools
import math
import random
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from simulator.taskgraph import MAX_ROUNDS
from soap.config import ConfigError, ParallelConfig, param_replicas, recompute_refusal, shardable, validate
from soap.graph import Operator, OperatorGraph
from soap.lowering import Replicas, repeats
from soap.opdef import DimKind
from soap.registry import dims_of, op_def
from soap.strategy import Strategy
from soap.topology import DeviceTopology

Degrees = tuple[tuple[str, int], ...]  # (dim name, degree > 1), in the op's dim order

# The micro-batch counts of the space (module docstring): M rounds per device, within what the simulator's
# task keys have room for.
MICROBATCH_COUNTS = tuple(m for m in (2, 4, 8) if m <= MAX_ROUNDS)
# The share of `propose_for`'s proposals (given the current strategy) that change an op's micro-batch count.
MICROBATCH_SHARE = 0.125
# The most chunks the space cuts an op's chunk dim into (module docstring): every divisor of the dim from 2 up
# to this, so that a baseline's default 8 time chunks (or the most that divide the time steps) are in it.
MAX_CHUNKS = 8
# The share of `propose_for`'s proposals (given the current strategy) that change an op's chunk count.
CHUNK_SHARE = 0.125


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


_MISSING = object()
MEMO_LIMIT = 200_000  # entries `_per_kind` keeps before it starts afresh


def _per_kind(method):
    """`method(self, op_name, cfg)` remembered per (the op's `ConfigSpace._kind`, cfg): it is a pure function
    of both, asked again and again by the moves (a stage move asks it of every op of a stage)."""
    name = method.__name__

    @functools.wraps(method)
    def remembered(self: ConfigSpace, op_name: str, cfg: ParallelConfig):
        key = (name, self._kind(op_name), cfg)
        found = self._memo.get(key, _MISSING)
        if found is _MISSING:
            if len(self._memo) >= MEMO_LIMIT:
                self._memo.clear()
            found = self._memo[key] = method(self, op_name, cfg)
        return found

    return remembered


class ConfigSpace:
    """The valid configs of the ops of `graph` on `topology` (see the module docstring)."""

    def __init__(self, graph: OperatorGraph, topology: DeviceTopology, replicas: Replicas | None = None):
        """`replicas`: only the configs that lay each op out as those replicas (module docstring)."""
        self.graph = graph
        self.topology = topology
        self.num_devices = topology.num_devices
        self.replicas = replicas
        self._node_grid = _node_grid(topology)
        if replicas is not None:
            if replicas.count * replicas.size != self.num_devices or replicas.count < 2:
                raise ValueError(f"{replicas.count} replicas of {replicas.size} devices do not make the topology's "
                                 f"{self.num_devices} devices")
            self._node_grid = _replica_grid(self._node_grid, replicas.size)
            bare = [op.name for op in graph if not op_def(op.kind).everywhere and sample_dim(op) is None]
            if bare:
                raise ValueError(f"no replicas of {graph.name or 'the model'}: op {bare[0]!r} has no sample dim "
                                 "to split among them")
        self._degrees: dict[str, tuple[Degrees, ...]] = {}
        self._cumulative: dict[str, list[int]] = {}
        self._device_sets: dict[int, tuple[tuple[int, ...], ...]] = {}
        self._recompute: dict[str, tuple[bool, ...]] = {}
        self._shards: dict[tuple[tuple, Degrees], tuple[int, ...]] = {}
        self._kinds: dict[str, tuple] = {}  # op name -> `_kind`
        self._memo: dict[tuple, object] = {}  # `_per_kind`
        self._shared = graph.shared_params()
        recurrent = any(d.carried for op in graph for d in dims_of(op))
        self._chunk_dims = {op.name: dim for op in graph if (dim := chunk_dim(op, recurrent=recurrent)) is not None}
        # On one device an op's only choice is whether it recomputes.
        self.ops: tuple[str, ...] = tuple(op.name for op in graph if not op_def(op.kind).everywhere
                                          and (self.num_devices > 1 or len(self.recompute_options(op.name)) > 1))
        if replicas is not None:
            stuck = next((name for name in self.ops if not self.degree_options(name)), None)
            if stuck is not None:
                op = self.graph[stuck]
                size = next(d.size for d in dims_of(op) if d.name == sample_dim(op))
                why = (f"its sample dim, of size {size}, does not divide into {replicas.count}" if size % replicas.count
                       else "an opaque op runs whole on one device" if op.kind == "opaque"
                       else f"{op.kind} does not split its sample dim {replicas.count} ways")
                raise ValueError(f"no replicas of {graph.name or 'the model'}: op {stuck!r} ({op.kind}) cannot be "
                                 f"laid out as {replicas.count} replicas ({why})")

    # -- enumeration ---------------------------------------------------------------------------------

    def degree_options(self, op_name: str) -> tuple[Degrees, ...]:
        """Every allowed degree combination of the op (the unsplit one first), in a fixed order."""
        kind = self._kind(op_name)
        found = self._degrees.get(kind)
        if found is None:
            op = self.graph[op_name]
            if self.replicas is None:
                found = tuple(_enumerate_degrees(op, self.num_devices))
            else:  # replica 0's degrees on its own devices, lifted to every replica where the op allows it
                lifted = (_lifted(op, d, self.replicas.count) for d in _enumerate_degrees(op, self.replicas.size))
                found = tuple(d for d in lifted if d is not None)
            self._degrees[kind] = found
        return found

    def device_sets(self, num_parts: int) -> tuple[tuple[int, ...], ...]:
        """The placements of `num_parts` parts: contiguous blocks, then node-aligned sets."""
        found = self._device_sets.get(num_parts)
        if found is None:
            rep = self.replicas
            if rep is None:
                found = tuple(_device_sets(num_parts, self.num_devices, self._node_grid))
            elif num_parts % rep.count:
                found = ()
            else:  # replica 0's placements, each repeated in every replica
                found = tuple(rep.expand(first) for first in
                              _device_sets(num_parts // rep.count, rep.size, self._node_grid))
            self._device_sets[num_parts] = found
        return found

    def recompute_options(self, op_name: str) -> tuple[bool, ...]:
        """(False,) or (False, True): whether the op may recompute."""
        found = self._recompute.get(op_name)
        if found is None:
            found = self._recompute[op_name] = (False,) if recompute_refusal(self.graph[op_name]) else (False, True)
        return found

    def shard_options(self, op_name: str, degrees: Degrees) -> tuple[int, ...]:
        """The shard degrees of the op under `degrees`: the divisors of its parameters' replica count
        (only 1 for an op without parameters, with a parameter another op shares or with a frozen one)."""
        kind = self._kind(op_name)
        found = self._shards.get((kind, degrees))
        if found is None:
            op = self.graph[op_name]
            if not shardable(op, self._shared):
                found = (1,)
            else:
                n = math.prod(g for _, g in degrees)
                found = tuple(_divisors(param_replicas(op, ParallelConfig(degrees=dict(degrees),
                                                                          devices=tuple(range(n))))))
                if self.replicas is not None:  # (which shards the replicas allow does not depend on the devices)
                    found = tuple(k for k in found if repeats(op, ParallelConfig(
                        degrees=dict(degrees), devices=self.device_sets(n)[0], shard=k), self.replicas))
            self._shards[(kind, degrees)] = found
        return found

    def num_configs(self, op_name: str) -> int:
        return self._weights(op_name)[-1]

    def configs(self, op_name: str) -> Iterator[ParallelConfig]:
        """Every config of the op, lazily, degrees-major."""
        for degrees in self.degree_options(op_name):
            for devices in self.device_sets(math.prod(g for _, g in degrees)):
                for recompute in self.recompute_options(op_name):
                    for shard in self.shard_options(op_name, degrees):
                        yield ParallelConfig(degrees=dict(degrees), devices=devices, recompute=recompute,
                                             shard=shard)

    @_per_kind
    def contains(self, op_name: str, cfg: ParallelConfig) -> bool:
        """Whether `cfg` is one of the op's configs in this space (micro-batched ones included)."""
        op = self.graph[op_name]
        dims = [d.name for d in dims_of(op)]
        if any(name not in dims for name in cfg.degrees) or not self._replicated(op, cfg):
            return False
        chunks = self.split_chunks(op_name, cfg)
        if chunks.count > 1:
            return (chunks.count in self.chunk_counts(op_name) and self.contains(op_name, chunks.rest)
                    and max(Counter(cfg.devices).values()) <= MAX_ROUNDS and _accepts(op, cfg, self.num_devices))
        if len(set(cfg.devices)) < cfg.num_parts:
            split = split_microbatches(op, cfg)
            return (split is not None and split.count in MICROBATCH_COUNTS and self.contains(op_name, split.base)
                    and _accepts(op, cfg, self.num_devices))
        degrees = tuple(sorted(cfg.degrees.items(), key=lambda kv: dims.index(kv[0])))
        return (degrees in self.degree_options(op_name) and cfg.devices in self.device_sets(cfg.num_parts)
                and cfg.recompute in self.recompute_options(op_name)
                and cfg.shard in self.shard_options(op_name, degrees))

    # -- sampling ------------------------------------------------------------------------------------

    def sample(self, op_name: str, rng: random.Random) -> ParallelConfig:
        """A config of the op drawn uniformly from all its configs."""
        cumulative = self._weights(op_name)
        r = rng.randrange(cumulative[-1])
        k = bisect.bisect_right(cumulative, r)
        degrees = self.degree_options(op_name)[k]
        sets = self.device_sets(math.prod(g for _, g in degrees))
        recomputes = self.recompute_options(op_name)
        shards = self.shard_options(op_name, degrees)
        offset, rest = divmod(r - (cumulative[k - 1] if k else 0), len(recomputes) * len(shards))
        return ParallelConfig(degrees=dict(degrees), devices=sets[offset], recompute=recomputes[rest // len(shards)],
                              shard=shards[rest % len(shards)])

    def propose(self, rng: random.Random, current: Strategy | None = None) -> tuple[str, ParallelConfig]:
        """A random proposal target (uniform over `ops`) with a config drawn by `propose_for`."""
        op_name = self.ops[rng.randrange(len(self.ops))]
        return op_name, self.propose_for(op_name, rng, current)

    def propose_for(self, op_name: str, rng: random.Random, current: Strategy | None = None) -> ParallelConfig:
        """A uniformly drawn config of the op; given the `current` strategy, `MICROBATCH_SHARE` of the
        proposals change the op's micro-batch count (uniformly among `microbatch_options`), half of the
        others, for an op with recompute or shard choices, keep its layout (micro-batches and chunks
        included) and redraw only those (uniformly among `memory_options`), so that a chain can trade time
        for memory one op at a time, and `CHUNK_SHARE` change its chunk count (uniformly among
        `chunk_options`, for an op with a chunk dim). Where the op has no such choice the proposal is a
        uniform draw, which keeps the op's micro-batch and chunk counts where the drawn layout takes them
        (`keeping_rounds`): where an op fits in memory only in micro-batches, a draw that dropped them
        would never be accepted, and the chain could not change that op's layout at all. The recompute and
        shard redraw, the micro-batch and chunk moves and the uniform draw among the configs of one
        micro-batch and chunk count are each symmetric, but not their mixture (a drawn layout that does not
        take the counts comes without them), so the chain is Metropolis-Hastings in its acceptance rule
        without being an exact sampler (as with `search.moves`'s structural moves; the search wants the
        best strategy it meets)."""
        if current is not None:
            cfg = current[op_name]
            r = rng.random()
            memory = MICROBATCH_SHARE + (1 - MICROBATCH_SHARE) / 2
            if r < MICROBATCH_SHARE:
                options = self.microbatch_options(op_name, cfg)
                if options:
                    return options[rng.randrange(len(options))]
            elif r < memory:
                options = self.memory_options(op_name, cfg)
                if len(options) > 1:
                    return options[rng.randrange(len(options))]
            elif r < memory + CHUNK_SHARE:
                options = self.chunk_options(op_name, cfg)
                if options:
                    return options[rng.randrange(len(options))]
            return self.keeping_rounds(op_name, cfg, self.sample(op_name, rng))
        return self.sample(op_name, rng)

    def keeping_rounds(self, op_name: str, cfg: ParallelConfig, drawn: ParallelConfig) -> ParallelConfig:
        """`drawn` (a config of the op without micro-batches or chunks) in `cfg`'s micro-batch count and chunk
        count, laid out as the micro-batch and chunk moves lay them out; `drawn` itself where `cfg` has
        neither or where the space does not hold `drawn` in those counts."""
        chunks = self.split_chunks(op_name, cfg)
        count = self.microbatch_count(op_name, cfg)
        if chunks.count == 1 and count in (1, None):
            return drawn
        kept = drawn if count in (1, None) else self.with_microbatches(op_name, drawn, count)
        if kept is not None and chunks.count > 1:
            kept = next((o for o in self.chunk_options(op_name, kept)
                         if self.split_chunks(op_name, o).count == chunks.count), None)
        return drawn if kept is None else kept

    @_per_kind
    def memory_options(self, op_name: str, cfg: ParallelConfig) -> tuple[ParallelConfig, ...]:
        """`cfg` with each of the op's (recompute, shard) choices under its degrees (those of its base,
        where it has micro-batches or chunks, keeping them: only the choices `soap.config.validate`
        accepts with them); empty where its devices repeat other than as micro-batches and chunks
        (`split_microbatches`, `split_chunks`)."""
        op = self.graph[op_name]
        chunks = self.split_chunks(op_name, cfg)
        split = split_microbatches(op, chunks.rest)
        if split is None:
            return ()
        dims = [d.name for d in dims_of(op)]
        degrees = tuple(sorted(split.base.degrees.items(), key=lambda kv: dims.index(kv[0])))
        options = [cfg.replace(recompute=recompute, shard=shard) for recompute in self.recompute_options(op_name)
                   for shard in self.shard_options(op_name, degrees)]
        plain = split.count == 1 and chunks.count == 1
        return tuple(o for o in options if plain or _accepts(op, o, self.num_devices) and self._replicated(op, o))

    @_per_kind
    def microbatch_options(self, op_name: str, cfg: ParallelConfig) -> tuple[ParallelConfig, ...]:
        """The configs a micro-batch move gives the op from `cfg`: its base without micro-batches (where
        `cfg` has them), then the base in each other count of `MICROBATCH_COUNTS` that `soap.config.validate`
        accepts, laid out as `cfg` is (its `inner`; 1 where it has no micro-batches), each in `cfg`'s chunks
        where it has them (within `MAX_ROUNDS` rounds per device). Empty where the op has no sample dim (a
        scalar loss term after the loss, say), or `cfg` is not a config of the space, or a micro-batched or
        chunked config of one."""
        op = self.graph[op_name]
        if sample_dim(op) is None:
            return ()
        chunks = self.split_chunks(op_name, cfg)
        split = split_microbatches(op, chunks.rest)
        if split is None or not self.contains(op_name, split.base):
            return ()

        def rechunked(c: ParallelConfig) -> ParallelConfig:
            return c if chunks.count == 1 else cut_chunks(op, c, chunks.dim, chunks.count)

        candidates = [] if split.count == 1 else [split.base]
        candidates += [microbatched(op, split.base, count, split.inner) for count in MICROBATCH_COUNTS
                       if count != split.count and count * chunks.count <= MAX_ROUNDS]
        options = []
        for candidate in map(rechunked, candidates):
            if (len(set(candidate.devices)) == candidate.num_parts or _accepts(op, candidate, self.num_devices)) \
                    and self._replicated(op, candidate):
                options.append(candidate)
        return tuple(options)

    @_per_kind
    def microbatch_count(self, op_name: str, cfg: ParallelConfig) -> int | None:
        """How many micro-batches `cfg` runs (1: none), its chunks aside; None where its devices repeat
        other than as micro-batches and chunks."""
        split = split_microbatches(self.graph[op_name], self.split_chunks(op_name, cfg).rest)
        return None if split is None else split.count

    def with_microbatches(self, op_name: str, cfg: ParallelConfig, count: int) -> ParallelConfig | None:
        """`cfg` in `count` micro-batches as the micro-batch move lays them out (`microbatch_options`):
        `cfg` itself where it has that count, None where the move does not offer it."""
        if self.microbatch_count(op_name, cfg) == count:
            return cfg
        return next((o for o in self.microbatch_options(op_name, cfg) if self.microbatch_count(op_name, o) == count),
                    None)

    # -- chunks --------------------------------------------------------------------------------------

    def chunk_dim(self, op_name: str) -> str | None:
        """The dim the space cuts the op's parts into chunks along (`chunk_dim`), None where it does not."""
        return self._chunk_dims.get(op_name)

    def chunk_counts(self, op_name: str) -> tuple[int, ...]:
        """The chunk counts of the op in the space: the divisors of its chunk dim from 2 to `MAX_CHUNKS`
        (empty where it has no chunk dim)."""
        dim = self.chunk_dim(op_name)
        if dim is None:
            return ()
        size = next(d.size for d in dims_of(self.graph[op_name]) if d.name == dim)
        return tuple(k for k in range(2, MAX_CHUNKS + 1) if size % k == 0)

    def split_chunks(self, op_name: str, cfg: ParallelConfig) -> Chunks:
        """`cfg` as chunks along the op's chunk dim (`split_chunks`; count 1 where it has none)."""
        dim = self.chunk_dim(op_name)
        return Chunks(rest=cfg, dim=None, count=1) if dim is None else split_chunks(self.graph[op_name], cfg, dim)

    @_per_kind
    def chunk_options(self, op_name: str, cfg: ParallelConfig) -> tuple[ParallelConfig, ...]:
        """The configs a chunk move gives the op from `cfg`: `cfg` without its chunks (where it has them),
        then in each other count of `chunk_counts` that `soap.config.validate` accepts, within `MAX_ROUNDS`
        rounds per device with its micro-batches (`cut_chunks`). Empty where the op has no chunk dim, or
        `cfg` is not a config of the space, or a chunked config of one, or splits the chunk dim over
        distinct devices."""
        chunks = self.split_chunks(op_name, cfg)
        if chunks.dim is None or chunks.rest.degree(chunks.dim) > 1 or not self.contains(op_name, chunks.rest):
            return ()
        op = self.graph[op_name]
        rounds = max(Counter(chunks.rest.devices).values())
        options = [] if chunks.count == 1 else [chunks.rest]
        for count in self.chunk_counts(op_name):
            if count != chunks.count and rounds * count <= MAX_ROUNDS:
                candidate = cut_chunks(op, chunks.rest, chunks.dim, count)
                if _accepts(op, candidate, self.num_devices) and self._replicated(op, candidate):
                    options.append(candidate)
        return tuple(options)

    def random_strategy(self, rng: random.Random, base: Strategy, ops: Sequence[str] | None = None) -> Strategy:
        """`base` with every proposal target (or every op of `ops`, in that order) given a uniformly drawn
        config (a random starting point)."""
        configs = dict(base.configs)
        for name in self.ops if ops is None else ops:
            configs[name] = self.sample(name, rng)
        return Strategy({op.name: configs[op.name] for op in self.graph})

    def _kind(self, op_name: str) -> tuple:
        """What the op's configs depend on: ops alike in it (the copies of a repeated block) have the same
        degree options, device sets and shard options, found once for all of them."""
        found = self._kinds.get(op_name)
        if found is None:
            op = self.graph[op_name]
            found = self._kinds[op_name] = (
                op.kind, repr(sorted(op.attrs.items())), tuple(op.outputs),
                tuple(self.graph.tensor(r) for r in op.inputs),
                tuple((k, p.shape, p.dtype, p.offset, p.whole_shape) for k, p in op.params.items()),
                any(p.key in self._shared for p in op.params.values()), recompute_refusal(op) is None)
        return found

    def holds(self, strategy: Strategy) -> bool:
        """Whether every op of `strategy` that computes is laid out as the space's replicas (always, without
        them): a chain of the space may start from it."""
        return self.replicas is None or all(self._replicated(op, strategy[op.name]) for op in self.graph
                                            if not op_def(op.kind).everywhere)

    def _replicated(self, op: Operator, cfg: ParallelConfig) -> bool:
        """Whether `cfg` lays `op` out as the space's replicas (always, without them)."""
        return self.replicas is None or repeats(op, cfg, self.replicas)

    def _weights(self, op_name: str) -> list[int]:
        """Cumulative config counts over the op's degree options (the last entry is the total)."""
        kind = self._kind(op_name)
        found = self._cumulative.get(kind)
        if found is None:
            total, found = 0, []
            variants = len(self.recompute_options(op_name))
            for degrees in self.degree_options(op_name):
                total += (len(self.device_sets(math.prod(g for _, g in degrees))) * variants
                          * len(self.shard_options(op_name, degrees)))
                found.append(total)
            self._cumulative[kind] = found
        return found


@dataclass(frozen=True, slots=True, kw_only=True)
class Microbatches:
    """A config seen as `count` micro-batches of `base`, a config whose devices do not repeat (module
    docstring): `base`'s sample split (degree s) cut into groups of `inner` consecutive parts (`inner`
    divides s), each group repeated `count` times in a row, so that the sample degree is s x `count` and
    each device runs `count` rounds. With `inner` 1 each device's part is cut into `count` consecutive
    micro-batches; with `inner` s, micro-batch m is the m-th slice of the batch spread over all of `base`'s
    devices. `count` 1: `base` itself."""

    base: ParallelConfig
    count: int
    inner: int = 1

    def __post_init__(self) -> None:
        if self.count < 1 or self.inner < 1:
            raise ValueError(f"count and inner must be >= 1, got count {self.count}, inner {self.inner}")
        if len(set(self.base.devices)) != self.base.num_parts:
            raise ValueError(f"a base config runs one part per device, got devices {list(self.base.devices)}")


def sample_dim(op: Operator) -> str | None:
    """The dim micro-batches cut: the op's first sample dim (None: it has none)."""
    return next((d.name for d in dims_of(op) if d.kind == DimKind.SAMPLE), None)


def microbatched(op: Operator, base: ParallelConfig, count: int, inner: int = 1) -> ParallelConfig:
    """`base` in `count` micro-batches laid out by `inner` (`Microbatches`), devices in part order, with
    `base`'s `recompute` and `shard`; not validated (the sample dim may not divide, the op or the config may
    refuse repeated devices)."""
    sample = sample_dim(op)
    assert sample is not None, f"op {op.name!r} has no sample dim to cut into micro-batches"
    names = [d.name for d in dims_of(op)]
    a = names.index(sample)
    shape = [base.degree(name) for name in names]
    s = shape[a]
    assert s % inner == 0, f"inner {inner} does not divide the sample degree {s}"
    grid = np.array(base.devices).reshape(shape[:a] + [s // inner, 1, inner] + shape[a + 1:])
    devices = np.repeat(grid, count, axis=a + 1).ravel()
    return ParallelConfig(degrees={**base.degrees, sample: s * count}, devices=tuple(int(d) for d in devices),
                          recompute=base.recompute, shard=base.shard)


def split_microbatches(op: Operator, cfg: ParallelConfig) -> Microbatches | None:
    """`cfg` as micro-batches of a config without repeated devices (`Microbatches`, the smallest `inner`
    that fits; count 1 where no device repeats), None where its devices repeat otherwise (unevenly, or
    not along the sample dim in groups as `microbatched` lays them out)."""
    if len(set(cfg.devices)) == cfg.num_parts:
        return Microbatches(base=cfg, count=1)
    sample = sample_dim(op)
    names = [d.name for d in dims_of(op)]
    if sample is None or any(name not in names for name in cfg.degrees):
        return None
    uses = Counter(cfg.devices)
    count = cfg.num_parts // len(uses)
    a = names.index(sample)
    shape = [cfg.degree(name) for name in names]
    if set(uses.values()) != {count} or shape[a] % count:
        return None
    s = shape[a] // count
    grid = np.array(cfg.devices)
    for inner in _divisors(s):
        groups = grid.reshape(shape[:a] + [s // inner, count, inner] + shape[a + 1:])
        first = groups.take([0], axis=a + 1)
        if (groups == first).all():
            base = ParallelConfig(degrees={**cfg.degrees, sample: s}, devices=tuple(int(d) for d in first.ravel()),
                                  recompute=cfg.recompute, shard=cfg.shard)
            return Microbatches(base=base, count=count, inner=inner)
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class Chunks:
    """A config seen as `count` chunks along dim `dim` of `rest`, a config that does not split `dim` (module
    docstring): each part of `rest` cut into `count` consecutive pieces along `dim`, all on the part's
    device, which runs them one after another. `count` 1: `rest` itself (`dim` None: the op has no chunk
    dim)."""

    rest: ParallelConfig
    dim: str | None
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or (self.count > 1 and (self.dim is None or self.rest.degree(self.dim) > 1)):
            raise ValueError(f"{self.count} chunks need a chunk dim that the rest does not split, got dim "
                             f"{self.dim!r} and degrees {dict(self.rest.degrees)}")


def chunk_dim(op: Operator, *, recurrent: bool) -> str | None:
    """The dim the space cuts `op`'s parts into chunks along: its carried dim (`soap.opdef.DimSpec.carried`);
    else, in a graph with a carried dim (`recurrent`) and for an op without parameters whose output is
    (sample, time, ...), the splittable attribute dim indexing output axis 1, so that an op between
    recurrent ops (a dropout) can run chunk by chunk beside them, as `search.baselines`' `mp` and `expert`
    lay it out. None otherwise."""
    dims = dims_of(op)
    carried = next((d.name for d in dims if d.carried), None)
    if carried is not None or not recurrent or op.params:
        return carried
    axes = {d.out_axis: d for d in dims if d.out_axis is not None}
    if 0 in axes and 1 in axes and axes[0].kind == DimKind.SAMPLE and axes[1].kind == DimKind.ATTRIBUTE \
            and axes[1].splittable:
        return axes[1].name
    return None


def cut_chunks(op: Operator, cfg: ParallelConfig, dim: str, count: int) -> ParallelConfig:
    """`cfg` with dim `dim` split `count` times finer, the new parts of each part of `cfg` on its device in
    part order (`soap.config.parts`), so that the device runs them one after another (as its next
    rounds); `cfg`'s `recompute` and `shard` kept. Not validated. Along a carried dim these are chunks
    (`soap.lowering`'s rule "Carries"): each starts from the state of the one before it, on the same
    device."""
    names = [d.name for d in dims_of(op)]
    k = names.index(dim)
    shape = [cfg.degree(name) for name in names]
    grid = np.array(cfg.devices).reshape(shape[:k] + [shape[k], 1] + shape[k + 1:])
    devices = np.repeat(grid, count, axis=k + 1).ravel()
    return cfg.replace(degrees={**cfg.degrees, dim: shape[k] * count}, devices=tuple(int(d) for d in devices))


def split_chunks(op: Operator, cfg: ParallelConfig, dim: str) -> Chunks:
    """`cfg` as chunks along `dim` (`Chunks`): its degree on `dim`, where every run of parts along `dim`
    lies on one device (the rest then leaves `dim` whole); count 1, `cfg` itself, where `cfg` leaves `dim`
    whole or splits it over several devices (an ordinary split, or one the space does not hold)."""
    count = cfg.degree(dim)
    if count == 1:
        return Chunks(rest=cfg, dim=dim, count=1)
    names = [d.name for d in dims_of(op)]
    k = names.index(dim)
    shape = [cfg.degree(name) for name in names]
    grid = np.array(cfg.devices).reshape(shape)
    first = grid.take([0], axis=k)
    if not (grid == first).all():
        return Chunks(rest=cfg, dim=dim, count=1)
    degrees = {name: g for name, g in cfg.degrees.items() if name != dim}
    return Chunks(rest=cfg.replace(degrees=degrees, devices=tuple(int(d) for d in first.ravel())), dim=dim,
                  count=count)


def _accepts(op: Operator, cfg: ParallelConfig, num_devices: int) -> bool:
    try:
        validate(op, cfg, num_devices)
    except ConfigError:
        return False
    return True


def _enumerate_degrees(op: Operator, num_devices: int) -> Iterator[Degrees]:
    """Degree combinations over the splittable dims: each divides its dim, the product divides the
    device count, and the op kind allows the combination."""
    dims = [d for d in dims_of(op) if d.splittable]
    entry = op_def(op.kind)

    def rec(i: int, budget: int, chosen: list[tuple[str, int]]) -> Iterator[Degrees]:
        if i == len(dims):
            degrees = tuple(chosen)
            if not degrees or entry.check(op, dict(degrees)) is None:
                yield degrees
            return
        for g in _divisors(math.gcd(budget, dims[i].size)) if dims[i].size else [1]:
            yield from rec(i + 1, budget // g, chosen + [(dims[i].name, g)] if g > 1 else chosen)

    yield from rec(0, num_devices, [])


def _lifted(op: Operator, degrees: Degrees, count: int) -> Degrees | None:
    """The degrees of replica 0's `degrees` (on its own devices) in `count` replicas: the op's first sample
    dim split `count` times more, which must come first among the split dims and divide; None where the
    op refuses that."""
    sample = sample_dim(op)
    names = [d.name for d in dims_of(op)]
    lifted = dict(degrees)
    lifted[sample] = lifted.get(sample, 1) * count
    out = tuple(sorted(lifted.items(), key=lambda kv: names.index(kv[0])))
    size = next(d.size for d in dims_of(op) if d.name == sample)
    if out[0][0] != sample or size % out[0][1] or op_def(op.kind).check(op, dict(out)) is not None:
        return None
    return out


def _replica_grid(grid: tuple[int, int] | None, size: int) -> tuple[int, int] | None:
    """The node grid (nodes, devices per node) of one replica of `size` devices, as `_node_grid` gives
    it (None: not regular)."""
    if grid is None:
        return None
    per_node = grid[1]
    if size % per_node == 0:
        return size // per_node, per_node
    return (1, size) if per_node % size == 0 else None


def _node_grid(topology: DeviceTopology) -> tuple[int, int] | None:
    """(nodes, devices per node) when every node holds the same number of devices with node-major ids."""
    per_node = [topology.devices_of_node(n) for n in range(topology.num_nodes)]
    m = len(per_node[0])
    if all(ids == tuple(range(n * m, (n + 1) * m)) for n, ids in enumerate(per_node)):
        return len(per_node), m
    return None


def _device_sets(p: int, n: int, grid: tuple[int, int] | None) -> Iterator[tuple[int, ...]]:
    for s in range(n - p + 1):
        yield tuple(range(s, s + p))
    if grid is None:
        return
    num_nodes, m = grid
    for q in range(1, m):
        k = p // q
        if p % q or not 1 < k <= num_nodes:
            continue
        for first_node in range(num_nodes - k + 1):
            for first_local in range(m - q + 1):
                yield tuple((first_node + i) * m + first_local + j for i in range(k) for j in range(q))
