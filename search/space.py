"""The proposal space: every valid `ParallelConfig` of every op, enumerated lazily and sampled uniformly.

Owns `ConfigSpace`. A config of an op is a pair (degrees, devices):

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

Ops whose output exists on every device for free (`OpDef.everywhere`: the batch, constants) and ops with a
single config (on one device: ops that cannot recompute) are not proposal targets. Must not import torch,
the runtime or soapflow.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Iterator, Sequence

from soap.config import ParallelConfig, param_replicas, recompute_refusal
from soap.graph import Operator, OperatorGraph
from soap.registry import dims_of, op_def
from soap.strategy import Strategy
from soap.topology import DeviceTopology

Degrees = tuple[tuple[str, int], ...]  # (dim name, degree > 1), in the op's dim order


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class ConfigSpace:
    """The valid configs of the ops of `graph` on `topology` (see the module docstring)."""

    def __init__(self, graph: OperatorGraph, topology: DeviceTopology):
        self.graph = graph
        self.topology = topology
        self.num_devices = topology.num_devices
        self._node_grid = _node_grid(topology)
        self._degrees: dict[str, tuple[Degrees, ...]] = {}
        self._cumulative: dict[str, list[int]] = {}
        self._device_sets: dict[int, tuple[tuple[int, ...], ...]] = {}
        self._recompute: dict[str, tuple[bool, ...]] = {}
        self._shards: dict[tuple[str, Degrees], tuple[int, ...]] = {}
        self._shared = graph.shared_params()
        # On one device an op's only choice is whether it recomputes.
        self.ops: tuple[str, ...] = tuple(op.name for op in graph if not op_def(op.kind).everywhere
                                          and (self.num_devices > 1 or len(self.recompute_options(op.name)) > 1))

    # -- enumeration ---------------------------------------------------------------------------------

    def degree_options(self, op_name: str) -> tuple[Degrees, ...]:
        """Every allowed degree combination of the op (the unsplit one first), in a fixed order."""
        found = self._degrees.get(op_name)
        if found is None:
            found = tuple(_enumerate_degrees(self.graph[op_name], self.num_devices))
            self._degrees[op_name] = found
        return found

    def device_sets(self, num_parts: int) -> tuple[tuple[int, ...], ...]:
        """The placements of `num_parts` parts: contiguous blocks, then node-aligned sets."""
        found = self._device_sets.get(num_parts)
        if found is None:
            found = tuple(_device_sets(num_parts, self.num_devices, self._node_grid))
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
        (only 1 for an op without parameters or with a parameter another op shares)."""
        found = self._shards.get((op_name, degrees))
        if found is None:
            op = self.graph[op_name]
            if not op.params or any(p.key in self._shared for p in op.params.values()):
                found = (1,)
            else:
                n = math.prod(g for _, g in degrees)
                found = tuple(_divisors(param_replicas(op, ParallelConfig(degrees=dict(degrees),
                                                                          devices=tuple(range(n))))))
            self._shards[(op_name, degrees)] = found
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

    def contains(self, op_name: str, cfg: ParallelConfig) -> bool:
        """Whether `cfg` is one of the op's configs in this space."""
        dims = [d.name for d in dims_of(self.graph[op_name])]
        if any(name not in dims for name in cfg.degrees):
            return False
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
        """A uniformly drawn config of the op; given the `current` strategy, half the proposals for an op
        with recompute or shard choices keep its layout and redraw only those (uniformly), so that a chain
        can trade time for memory one op at a time. Both kinds of move are symmetric, and so is their fixed
        mixture (the Metropolis rule stays exact)."""
        if current is not None and rng.random() < 0.5:
            cfg = current[op_name]
            dims = [d.name for d in dims_of(self.graph[op_name])]
            degrees = tuple(sorted(cfg.degrees.items(), key=lambda kv: dims.index(kv[0])))
            recomputes, shards = self.recompute_options(op_name), self.shard_options(op_name, degrees)
            if len(recomputes) * len(shards) > 1:
                return cfg.replace(recompute=rng.choice(recomputes), shard=rng.choice(shards))
        return self.sample(op_name, rng)

    def random_strategy(self, rng: random.Random, base: Strategy, ops: Sequence[str] | None = None) -> Strategy:
        """`base` with every proposal target (or every op of `ops`, in that order) given a uniformly drawn
        config (a random starting point)."""
        configs = dict(base.configs)
        for name in self.ops if ops is None else ops:
            configs[name] = self.sample(name, rng)
        return Strategy({op.name: configs[op.name] for op in self.graph})

    def _weights(self, op_name: str) -> list[int]:
        """Cumulative config counts over the op's degree options (the last entry is the total)."""
        found = self._cumulative.get(op_name)
        if found is None:
            total, found = 0, []
            variants = len(self.recompute_options(op_name))
            for degrees in self.degree_options(op_name):
                total += (len(self.device_sets(math.prod(g for _, g in degrees))) * variants
                          * len(self.shard_options(op_name, degrees)))
                found.append(total)
            self._cumulative[op_name] = found
        return found


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
