"""Communication costs on a topology's links: point-to-point transfers, exchanges and collectives.

Owns `Comm`, which prices a transfer or a collective and names the resources it occupies. Resources are
integers shared with the task graph: device i is resource i, link l is resource ``num_devices + l``. A
transfer or collective occupies its links and, where the device kind is busy while communicating
(`soap.devices.DeviceSpec.busy_while_communicating`: CPU processes, whose cores copy and reduce the data
and whose exchanges block both ends), its devices too: on such devices communication does not overlap
computation.

Alpha-beta per link along the route (Hockney 1994): a transfer of B bytes from a to b occupies every link
of ``route(a, b)`` at once, for ``sum(latency_us) + B / min(bandwidth_gbps)``.

An *exchange* is what the runtime does to move one tensor between two partitionings in one pass: all the
pieces at once, packed into one all-to-all over the ranks involved. It is one task occupying the union of
the pieces' routes, for the largest route latency plus the time of its busiest link::

    time = max over pieces of sum_{l in route} latency_l + max over links l of (bytes crossing l) / bandwidth_l

A single piece costs exactly its transfer; pieces on disjoint links (both directions between two GPUs,
say) overlap; pieces that share a link queue on it.

A link is one direction of a connection, a resource of its own, except for the half-duplex kinds of
`soap.topology.HALF_DUPLEX_KINDS` (a host's loopback between processes: both directions are copies by
the same cores), whose two directions are one resource (`DeviceTopology.capacity`): bytes going both ways
at once take as long as their sum going one way, in exchanges, in ring collectives (a 2-process ring
sends both ways in every step) and between tasks that overlap in time.

The links' figures are the wire. What the runtime adds on top (`CommOverhead`, fitted by calibration:
the collective call; waiting for the later rank where several send; packing, unpacking and accumulating
the pieces) is charged per exchange and per collective, per GB of every all-reduce, and per GB the
busiest process of an exchange sends plus receives; zero unless a machine profile's cost model carries
it.

Collectives are priced as NCCL runs them: rings for every kind, double binary trees besides for an
all-reduce over several nodes, and per call the faster of the two for its size, as NCCL's tuner picks
(`Comm.algorithms` lists what a group can run, `Comm.collective` prices one call). Not modelled: NCCL's
protocols (LL, LL128, Simple) and their overheads (NCCL moves about 80% of a link's line rate), NVLink
SHARP and CollNet, several rings inside one NVLink-mesh node (DGX-1), and the reduction arithmetic
(memory-bound, overlapped with the next step on real hardware).

*Rings with channels.* The group's devices, node by node (nodes ascending, devices ascending within a
node: L_k is node k's share of the group), form C rings, NCCL's channels, that run at once, each on B/C
of the bytes. C is 1 for a group inside one node, and for a group over several nodes the fewest of its
devices on any node, m = min_k |L_k|, when each of them leaves its node through a NIC of its own (the
first ``network`` link on its route to another node differs between the group's devices of a node: one
NIC per GPU, the rails of a DGX A100/H100 preset), else 1 (one NIC per node, as P100/V100/K80 presets:
all rings would cross it one after the other). Ring c visits the nodes in order and enters node k at
L_k[c], then L_k[c+1], ... around to L_k[c-1], from which it leaves for L_{k+1}[c]: so ring c enters
every node through rail c and leaves it through the rail before, and no NIC port carries two rings.
Inside one node there is one ring, in ascending order (an NVSwitch is not the bottleneck there, so more
rings would add nothing). Every hop g -> g' follows ``route(g, g')``; all-reduce is 2(n-1) steps
(reduce-scatter, then all-gather), all-gather and reduce-scatter n-1 steps (Patarasuk and Yuan 2009), and
in a step every hop of every ring sends one chunk of B/(C n) bytes at once, so a link that k hops cross
(of any ring) carries k chunks::

    step = max over hops h of all rings ( sum_{l in h} latency_l + B/(C n) * max_{l in h} (load_l / bandwidth_l) )
    ring = steps * step

where load_l is the number of hops whose route uses link l. On a100-2x8, all 16 GPUs: C = 8, each NIC
carries one ring's crossing, so the ring runs at 8 NICs' rate where one ring would run at one's.

*Double binary trees* (all-reduce over N >= 2 nodes). Per channel c, two trees, each carrying B/(2C): over
the nodes, NCCL's binary tree (rank r with lowest set bit b hangs below (r - b) | 2b, or below r - b where
that is past the last node; root 0 has one child) and its complement (mirrored for N even, shifted by one
for N odd), whose edges join the nodes' heads L_k[c] (rail c); below each head the chain of its node's
other devices in ring-c order. Pipelined, the reduction climbs and the broadcast descends at once, every
edge carrying the tree's bytes up and down::

    tree = max over trees (slowest route latency leaf -> root + slowest root -> leaf)
           + B/(2C) * max over links l (uses_l / bandwidth_l)

where uses_l is the number of tree edges, in either direction and over all 2C trees, whose route uses l:
the fill of the deepest path of NCCL's pipeline (2 ceil(log2 N) inter-node hops plus the chains, where a
ring pays 2(n-1) steps of its slowest hop), then the busiest link. A rank that forwards in one tree is a
leaf in the other, so the busiest NIC carries at most 2B/C per direction (B/C over two nodes) against the
ring's 2(n-1)/n B/C: the ring wins for large sizes over three nodes or more, the tree for small sizes over many
devices (latency) and over two nodes (NCCL's tuner picks it there too). A group inside one node has no
tree: NCCL's would be one chain, whose fill alone costs the ring's 2(n-1) hops.

The collective is ONE task (expanding every step would make 2(n-1) x n tasks: 8,000 per bucket on 64
devices) lasting the faster algorithm's time for its size, ``min(ring, tree)``, plus `CommOverhead`
(per call and per GB all-reduced, whichever algorithm). It occupies the union of all the algorithms'
links, whichever one its size picks: the resources of a group's collective do not depend on its size,
because the engine re-prices an all-reduce's duration when its buckets change, not its resources. Each
link carries what the hardware would: on a preset with one NIC per GPU (`soap.topology`: a100, h100,
h200 over several nodes) a hop between nodes leaves through the sender's own NIC and enters through the
receiver's, so the data-parallel ring over GPU i of every node occupies rail i only, and the rings of
the other tensor-parallel ranks, on other rails, run at the same time instead of queueing.

Times are integer nanoseconds (1 GB/s = 1 byte/ns), rounded once per task, so simulation arithmetic is
exact and the delta simulation can equal the full one bit for bit. Must import only `soap`.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from soap.devices import DEVICE_SPECS
from soap.topology import DeviceTopology

ALLREDUCE = "allreduce"
ALLGATHER = "allgather"
REDUCE_SCATTER = "reduce_scatter"
_STEPS = {ALLREDUCE: lambda n: 2 * (n - 1), ALLGATHER: lambda n: n - 1, REDUCE_SCATTER: lambda n: n - 1}
RING = "ring"
TREE = "tree"
# the rings of a group: (resources, envelope of (latency ns, ns per byte)), as `Algorithm` holds them
_RingShape = tuple[tuple[int, ...], tuple[tuple[float, float], ...]]


def ms_to_ns(ms: float) -> int:
    """A duration in milliseconds as integer nanoseconds (the simulator's time unit)."""
    return max(0, round(ms * 1e6))


@dataclass(frozen=True, slots=True, kw_only=True)
class CommOverhead:
    """The runtime's own cost of communicating, beyond the links: microseconds per exchange (the call,
    packing the pieces); microseconds per collective that synchronizes ranks which all computed up to it
    (`sync_us`: every all-reduce, and every exchange in which two or more devices send: each rank arrives
    when its own compute is done, which jitters with the load, and the collective waits for the later
    one; where one device sends, the receiver is usually the one waiting, for data the simulator already
    makes it wait for); milliseconds per GB an all-reduce reduces (its buffer's size); milliseconds per
    GB of an exchange's pieces that its busiest process sends plus receives (`exchange_ms_per_gb`: the
    copies that pack strided slices into the send buffer, assemble the received pieces into the
    consumer's input, and accumulate gradients: on CPU processes they cost about as much as the wire).

    The all-gather and reduce-scatter terms (`allgather_us`, `allgather_ms_per_gb`, `reduce_scatter_us`,
    `reduce_scatter_ms_per_gb`: a fixed cost and a cost per GB of the gathered or reduced buffer) are
    what the backend's own algorithm for that collective costs beyond the rings priced on the links: NCCL
    runs those rings (0 on the presets), gloo between CPU processes does not (a reduce-scatter of 16 MiB
    between two processes here takes as long as an all-reduce of it, twice the ring's time).
    `shard_us` and `shard_ms_per_gb` are what each of them costs more inside a training step than alone
    (a fixed cost, and per GB of its buffer), where the runtime gathers and reduce-scatters sharded
    parameters around every op's passes, on data the passes have pushed out of the caches (fitted from
    steps, as `sync_us` is)."""

    exchange_us: float = 0.0
    sync_us: float = 0.0
    allreduce_ms_per_gb: float = 0.0
    exchange_ms_per_gb: float = 0.0
    allgather_us: float = 0.0
    allgather_ms_per_gb: float = 0.0
    reduce_scatter_us: float = 0.0
    reduce_scatter_ms_per_gb: float = 0.0
    shard_us: float = 0.0
    shard_ms_per_gb: float = 0.0

    def __post_init__(self) -> None:
        bad = {k: getattr(self, k) for k in self.__slots__
               if not (getattr(self, k) >= 0 and math.isfinite(getattr(self, k)))}
        if bad:
            raise ValueError(f"communication overheads must be finite and >= 0, got {bad}")

    def to_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__slots__}

    def collective_ns(self, kind: str, nbytes: int) -> float:
        """What the runtime adds to the wire of one `kind` collective on `nbytes` (ns, not rounded): the
        wait for the later rank, and the kind's own cost (the all-reduce's bucket copies, the backend's
        all-gather and reduce-scatter beyond their rings)."""
        if kind == ALLREDUCE:
            return self.sync_us * 1e3 + nbytes * self.allreduce_ms_per_gb * 1e-3
        fixed_us, ms_per_gb = ((self.allgather_us, self.allgather_ms_per_gb) if kind == ALLGATHER
                               else (self.reduce_scatter_us, self.reduce_scatter_ms_per_gb))
        return (self.sync_us + fixed_us + self.shard_us) * 1e3 + nbytes * (ms_per_gb + self.shard_ms_per_gb) * 1e-3


NO_OVERHEAD = CommOverhead()


@dataclass(frozen=True, slots=True, kw_only=True)
class Algorithm:
    """One way of running a collective over a group (`name`: `RING` or `TREE`), priced for any size: it
    occupies `resources` (devices and links, numbered as `Comm.collective`'s) and moves B bytes in
    ``steps * max over (latency_ns, ns_per_byte) in envelope of (latency_ns + (B / divisor) * ns_per_byte)``
    nanoseconds (`wire_ns`), where B / divisor is what one ring step or one tree carries."""

    name: str
    resources: tuple[int, ...]
    steps: int
    divisor: int
    envelope: tuple[tuple[float, float], ...]

    def wire_ns(self, nbytes: int) -> float:
        """Duration in ns (not rounded) on `nbytes`, without the runtime's overheads."""
        piece = nbytes / self.divisor
        return self.steps * max(latency_ns + piece * ns_per_byte for latency_ns, ns_per_byte in self.envelope)


_EXCHANGE_CACHE = 50_000  # exchanges `Comm` remembers (each a few hundred pieces at most, typically)


class Comm:
    """Prices transfers, exchanges and collectives (rings and trees) on `topology` (plus the runtime's
    `overhead` for exchanges and all-reduces; a bare `transfer` is the wire only); caches per device pair,
    per (group, kind), per group's rings (the same for every kind but their number of steps) and per
    exchange (its pieces: many edges move the same pieces between the same devices).

    The caches hold pure functions of the topology, so they never change a result.
    """

    __slots__ = ("topology", "num_devices", "overhead", "_busy", "_cap", "_cap_gbps", "_pairs", "_plans",
                 "_ring_shapes", "_exchanges")

    def __init__(self, topology: DeviceTopology, overhead: CommOverhead = NO_OVERHEAD):
        self.topology = topology
        self.overhead = overhead
        self.num_devices = topology.num_devices
        # devices that cannot compute while they communicate (resource ids)
        self._busy = frozenset(d.id for d in topology.devices
                               if (spec := DEVICE_SPECS.get(d.kind)) is not None and spec.busy_while_communicating)
        # link id -> the link whose capacity it uses (`DeviceTopology.capacity`: a half-duplex link's
        # two directions are one resource), and the bandwidth of each such capacity (the narrower direction)
        self._cap = tuple(topology.capacity(link.id) for link in topology.links)
        self._cap_gbps: dict[int, float] = {}
        for link, cap in zip(topology.links, self._cap, strict=True):
            self._cap_gbps[cap] = min(self._cap_gbps.get(cap, math.inf), link.bandwidth_gbps)
        # (src, dst) -> (resources, latency_ns, min bandwidth GB/s)
        self._pairs: dict[tuple[int, int], tuple[tuple[int, ...], float, float]] = {}
        # (group, kind) -> (the resources of all its algorithms, the algorithms NCCL could run for it)
        self._plans: dict[tuple[tuple[int, ...], str], tuple[tuple[int, ...], tuple[Algorithm, ...]]] = {}
        # (a group's devices per node, channels) -> its rings' (resources, envelope), the same for all-reduce,
        # all-gather and reduce-scatter, which only their numbers of steps tell apart
        self._ring_shapes: dict[tuple[tuple[tuple[int, ...], ...], int], _RingShape] = {}
        # an exchange's pieces -> its (resources, ns); emptied when it reaches _EXCHANGE_CACHE entries
        self._exchanges: dict[tuple[tuple[int, int, int], ...], tuple[tuple[int, ...], int]] = {}

    def route(self, src: int, dst: int) -> tuple[tuple[int, ...], float, float]:
        """(resources, latency ns, narrowest bandwidth GB/s) of the route from `src` to `dst`."""
        hit = self._pairs.get((src, dst))
        if hit is None:
            links = [self.topology.links[i] for i in self.topology.route(src, dst)]
            ends = tuple(d for d in (src, dst) if d in self._busy)
            hit = (ends + tuple(self.num_devices + self._cap[link.id] for link in links),
                   sum(link.latency_us for link in links) * 1e3,
                   min((link.bandwidth_gbps for link in links), default=math.inf))
            self._pairs[(src, dst)] = hit
        return hit

    def link_gbps(self, resource: int) -> float:
        """The bandwidth (GB/s) of link resource `resource` (as `route` names it)."""
        return self._cap_gbps[resource - self.num_devices]

    def transfer(self, src: int, dst: int, nbytes: int) -> tuple[tuple[int, ...], int]:
        """(resources, duration ns) of sending `nbytes` from device `src` to device `dst` (src != dst)."""
        res, latency_ns, bandwidth = self.route(src, dst)
        return res, max(0, round(latency_ns + nbytes / bandwidth))

    def exchange(self, pieces: list[tuple[int, int, int]]) -> tuple[tuple[int, ...], int]:
        """(resources, duration ns) of moving every (src, dst, bytes) of `pieces` (src != dst) at once."""
        if not pieces:
            raise ValueError("an exchange needs at least one piece")
        key = tuple(pieces)
        hit = self._exchanges.get(key)
        if hit is None:
            if len(self._exchanges) >= _EXCHANGE_CACHE:
                self._exchanges.clear()
            hit = self._exchanges[key] = self._exchange(pieces)
        return hit

    def _exchange(self, pieces: list[tuple[int, int, int]]) -> tuple[tuple[int, ...], int]:
        extra = self.overhead.exchange_us * 1e3
        if len({src for src, _, _ in pieces}) >= 2:
            extra += self.overhead.sync_us * 1e3
        if self.overhead.exchange_ms_per_gb:
            handled: dict[int, int] = {}
            for src, dst, nbytes in pieces:
                handled[src] = handled.get(src, 0) + nbytes
                handled[dst] = handled.get(dst, 0) + nbytes
            extra += max(handled.values()) * self.overhead.exchange_ms_per_gb * 1e-3
        if len(pieces) == 1:
            res, ns = self.transfer(*pieces[0])
            return res, ns + round(extra)
        per_pair: dict[tuple[int, int], int] = {}
        for src, dst, nbytes in pieces:
            per_pair[(src, dst)] = per_pair.get((src, dst), 0) + nbytes
        load: dict[int, int] = {}
        busy: set[int] = set()
        latency_ns = 0.0
        for (src, dst), nbytes in per_pair.items():
            res, lat, _ = self.route(src, dst)
            latency_ns = max(latency_ns, lat)
            for r in res:
                if r < self.num_devices:
                    busy.add(r)
                else:
                    load[r] = load.get(r, 0) + nbytes
        slowest = max((nb / self._cap_gbps[r - self.num_devices] for r, nb in load.items()), default=0.0)
        return tuple(sorted(busy)) + tuple(sorted(load)), max(0, round(latency_ns + slowest + extra))

    def channels(self, group: tuple[int, ...]) -> int:
        """How many rings (NCCL's channels) a collective over `group` (sorted device ids, >= 2) runs at once:
        1 inside one node; over several nodes, the fewest of the group's devices on any one node when each
        of them leaves its node through a NIC no other device of the group on that node uses (rails), else
        1 (a NIC the group's devices share would carry every ring's crossing, one after the other)."""
        return self._channels(self._by_node(group))

    def algorithms(self, group: tuple[int, ...], kind: str = ALLREDUCE) -> tuple[Algorithm, ...]:
        """What NCCL could run for `kind` over `group` (sorted device ids, >= 2): the rings, then, for an
        all-reduce over several nodes, the double binary trees. Cached per (group, kind)."""
        return self._plan(group, kind)[1]

    def collective(self, group: tuple[int, ...], nbytes: int, kind: str = ALLREDUCE) -> tuple[tuple[int, ...], int]:
        """(resources, duration ns) of `kind` over `group` (sorted device ids, >= 2) on `nbytes`: the time of
        the faster of `algorithms` for this size (the rings where they tie), as NCCL's tuner picks per call;
        the resources of all of them, whichever is picked (the same for every size of the group's call)."""
        resources, algorithms = self._plan(group, kind)
        wire_ns = min(algorithm.wire_ns(nbytes) for algorithm in algorithms)
        return resources, max(0, round(wire_ns + self.overhead.collective_ns(kind, nbytes)))

    def _plan(self, group: tuple[int, ...], kind: str) -> tuple[tuple[int, ...], tuple[Algorithm, ...]]:
        hit = self._plans.get((group, kind))
        if hit is None:
            nodes = self._by_node(group)
            channels = self._channels(nodes)
            algorithms = (self._rings(nodes, channels, kind),)
            if kind == ALLREDUCE and len(nodes) >= 2:
                algorithms += (self._trees(nodes, channels),)
            devices = tuple(d for d in group if d in self._busy)
            links = sorted({r for algorithm in algorithms for r in algorithm.resources if r >= self.num_devices})
            hit = self._plans[(group, kind)] = (devices + tuple(links), algorithms)
        return hit

    def _by_node(self, group: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """The group's devices per node, nodes in ascending order, devices ascending within each."""
        if len(group) < 2 or list(group) != sorted(set(group)):
            raise ValueError(f"a collective needs >= 2 distinct devices in ascending order, got {group}")
        by_node: dict[int, list[int]] = {}
        for d in group:
            by_node.setdefault(self.topology.devices[d].node, []).append(d)
        return tuple(tuple(by_node[k]) for k in sorted(by_node))

    def _channels(self, nodes: tuple[tuple[int, ...], ...]) -> int:
        if len(nodes) < 2:
            return 1
        for k, local in enumerate(nodes):
            peer = nodes[(k + 1) % len(nodes)][0]
            nics = {self._nic(d, peer) for d in local}
            if None in nics or len(nics) < len(local):
                return 1
        return min(len(local) for local in nodes)

    def _nic(self, src: int, dst: int) -> int | None:
        """The id of the first network link (a NIC's port to the switch) on the route from `src` to `dst`
        on another node: the NIC through which `src` leaves its node; None when the route has none."""
        return next((i for i in self.topology.route(src, dst) if self.topology.links[i].kind == "network"), None)

    def _rings(self, nodes: tuple[tuple[int, ...], ...], channels: int, kind: str) -> Algorithm:
        shape = self._ring_shapes.get((nodes, channels))
        if shape is None:
            shape = self._ring_shapes[(nodes, channels)] = self._ring_shape(nodes, channels)
        n = sum(len(local) for local in nodes)
        return Algorithm(name=RING, resources=shape[0], steps=_STEPS[kind](n), divisor=channels * n,
                         envelope=shape[1])

    def _ring_shape(self, nodes: tuple[tuple[int, ...], ...],
                    channels: int) -> _RingShape:
        """(resources, envelope) of the `channels` rings over the group's devices `nodes`."""
        # ring c visits the nodes in order and enters each at its c-th device, so it leaves each node from
        # the device before that one (its (c-1)-th): every ring crosses each node boundary on other NICs.
        # Inside a node the rings share most hops (ring c runs c, c+1, ... around): each distinct hop is
        # routed once, and counted as often as the rings take it.
        hops: Counter[tuple[int, int]] = Counter()
        for c in range(channels):
            ring = [d for local in nodes for d in local[c:] + local[:c]]
            hops.update(zip(ring, ring[1:] + ring[:1], strict=True))
        routes = [self.topology.route(a, b) for a, b in hops]
        load: dict[int, int] = {}
        for route, times in zip(routes, hops.values(), strict=True):
            for link in route:
                load[self._cap[link]] = load.get(self._cap[link], 0) + times
        links = self.topology.links
        # per hop: (latency ns, ns per byte of one chunk on its most loaded link); a hop another one beats
        # on both counts never sets the step time, so only the upper envelope is kept: by latency from the
        # highest, a hop is kept when its ns per byte exceeds that of every hop as slow or slower.
        pairs = {(sum(links[i].latency_us for i in route) * 1e3,
                  max(load[self._cap[i]] / self._cap_gbps[self._cap[i]] for i in route)) for route in routes}
        envelope = []
        for latency_ns, ns_per_byte in sorted(pairs, reverse=True):
            if not envelope or ns_per_byte > envelope[-1][1]:
                envelope.append((latency_ns, ns_per_byte))
        return self._resources(nodes, load), tuple(reversed(envelope))

    def _trees(self, nodes: tuple[tuple[int, ...], ...], channels: int) -> Algorithm:
        # per channel c, two trees: NCCL's double binary tree over the nodes, whose edges join the nodes'
        # heads (each node's c-th device, on rail c), and below each head the chain of its node's other
        # devices in ring order; every tree carries 1/(2 channels) of the bytes, up and down every edge.
        edges: Counter[tuple[int, int]] = Counter()  # (child, parent) -> how many trees have that edge
        latency_ns = 0.0
        for c in range(channels):
            chains = [local[c:] + local[:c] for local in nodes]
            for parents in _double_binary_tree(len(nodes)):
                parent = {chains[k][0]: chains[p][0] for k, p in enumerate(parents) if p >= 0}
                for chain in chains:
                    parent.update(zip(chain[1:], chain[:-1], strict=True))
                latency_ns = max(latency_ns, self._fill_ns(parent))
                edges.update(parent.items())
        load: dict[int, int] = {}
        for (child, up), times in edges.items():
            for link in self.topology.route(child, up) + self.topology.route(up, child):
                load[self._cap[link]] = load.get(self._cap[link], 0) + times
        slowest = max(count / self._cap_gbps[cap] for cap, count in load.items())
        return Algorithm(name=TREE, resources=self._resources(nodes, load), steps=1, divisor=2 * channels,
                         envelope=((latency_ns, slowest),))

    def _fill_ns(self, parent: dict[int, int]) -> float:
        """A pipelined tree's fill latency: the slowest route latency from a device up to the root plus
        the slowest from the root down to a device (the first chunk's reduction, then its broadcast)."""
        up: dict[int, float] = {}
        down: dict[int, float] = {}
        for start in parent:
            path = []
            top = start
            while top in parent and top not in up:  # climb to the root or to a device already priced
                path.append(top)
                top = parent[top]
            up_ns, down_ns = up.get(top, 0.0), down.get(top, 0.0)
            for d in reversed(path):
                up_ns += self.route(d, parent[d])[1]
                down_ns += self.route(parent[d], d)[1]
                up[d], down[d] = up_ns, down_ns
        return max(up.values()) + max(down.values())

    def _resources(self, nodes: tuple[tuple[int, ...], ...], load: dict[int, int]) -> tuple[int, ...]:
        busy = tuple(sorted(d for local in nodes for d in local if d in self._busy))
        return busy + tuple(sorted(self.num_devices + cap for cap in load))


def _btree_parent(rank: int, n: int) -> int:
    """The parent of `rank` in NCCL's binary tree over ranks 0..n-1 (-1 for the root, rank 0, which has one
    child): rank r with lowest set bit b hangs below (r - b) | 2b, or below r - b where that is >= n."""
    if rank == 0:
        return -1
    bit = rank & -rank
    up = (rank ^ bit) | (bit << 1)
    return up if up < n else rank ^ bit


def _double_binary_tree(n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """NCCL's two complementary binary trees over ranks 0..n-1 (n >= 2) as parent lists (-1: the root): the
    binary tree, and the same tree mirrored (n even) or shifted by one rank (n odd), so that the ranks that
    forward in one tree are leaves of the other (but rank 0 for n odd, the first tree's root with one
    child): no rank receives (or sends) a tree's share more than four times over both trees, and no tree
    is deeper than ceil(log2 n)."""
    first = tuple(_btree_parent(r, n) for r in range(n))
    if n % 2:
        second = tuple(-1 if first[(r - 1) % n] < 0 else (first[(r - 1) % n] + 1) % n for r in range(n))
    else:
        second = tuple(-1 if first[n - 1 - r] < 0 else n - 1 - first[n - 1 - r] for r in range(n))
    return first, second
