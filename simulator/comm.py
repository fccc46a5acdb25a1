"""Communication costs on a topology's links: point-to-point transfers and ring collectives.

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

Ring collectives (Patarasuk and Yuan 2009; what NCCL runs) over a group g_0 < g_1 < .. < g_{n-1}: n hops
g_i -> g_{i+1 mod n}, each along its route; all-reduce is 2(n-1) steps (reduce-scatter, then all-gather),
all-gather and reduce-scatter n-1 steps. In a step every hop sends B/n bytes at once, so a link that k
hops cross carries k chunks. We model the whole collective as ONE task occupying the union of the hops'
links (expanding every step would make 2(n-1) x n tasks: 8,000 per bucket on 64 devices), with the exact
duration of the synchronous step formula::

    step = max over hops h of ( sum_{l in h} latency_l + (B/n) * max_{l in h} (load_l / bandwidth_l) )
    time = steps * step

where load_l is the number of hops whose route uses link l. The reduction arithmetic of an all-reduce is
not charged (it is memory-bound and overlapped with the next step on real hardware).

Each hop takes the topology's route between its two devices, so the links a ring occupies are those of
the hardware it crosses: on a preset with one NIC per GPU (`soap.topology`: a100, h100, h200 over several
nodes) a hop between nodes leaves through the sender's own NIC and enters through the receiver's, so the
data-parallel ring over GPU i of every node occupies rail i only (NIC i of each node and its port), and
the rings of the other tensor-parallel ranks, on other rails, run at the same time instead of queueing.
A ring over all the GPUs of several nodes crosses each node boundary once, on one rail (NCCL would run
several rings, one per NIC; not modelled).

Times are integer nanoseconds (1 GB/s = 1 byte/ns), rounded once per task, so simulation arithmetic is
exact and the delta simulation can equal the full one bit for bit. Must import only `soap`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from soap.devices import DEVICE_SPECS
from soap.topology import DeviceTopology

ALLREDUCE = "allreduce"
ALLGATHER = "allgather"
REDUCE_SCATTER = "reduce_scatter"
_STEPS = {ALLREDUCE: lambda n: 2 * (n - 1), ALLGATHER: lambda n: n - 1, REDUCE_SCATTER: lambda n: n - 1}


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
    consumer's input, and accumulate gradients: on CPU processes they cost about as much as the wire)."""

    exchange_us: float = 0.0
    sync_us: float = 0.0
    allreduce_ms_per_gb: float = 0.0
    exchange_ms_per_gb: float = 0.0

    def __post_init__(self) -> None:
        bad = {k: getattr(self, k) for k in self.__slots__
               if not (getattr(self, k) >= 0 and math.isfinite(getattr(self, k)))}
        if bad:
            raise ValueError(f"communication overheads must be finite and >= 0, got {bad}")

    def to_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__slots__}


NO_OVERHEAD = CommOverhead()


class Comm:
    """Prices transfers, exchanges and ring collectives on `topology` (plus the runtime's `overhead` for
    exchanges and all-reduces; a bare `transfer` is the wire only); caches per device pair and per group.

    The caches hold pure functions of the topology, so they never change a result.
    """

    __slots__ = ("topology", "num_devices", "overhead", "_busy", "_cap", "_cap_gbps", "_pairs", "_rings")

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
        # (group, kind) -> (resources, steps, upper envelope of the hops' (latency ns, ns per chunk byte))
        self._rings: dict[tuple[tuple[int, ...], str], tuple[tuple[int, ...], int, tuple]] = {}

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

    def transfer(self, src: int, dst: int, nbytes: int) -> tuple[tuple[int, ...], int]:
        """(resources, duration ns) of sending `nbytes` from device `src` to device `dst` (src != dst)."""
        res, latency_ns, bandwidth = self.route(src, dst)
        return res, max(0, round(latency_ns + nbytes / bandwidth))

    def exchange(self, pieces: list[tuple[int, int, int]]) -> tuple[tuple[int, ...], int]:
        """(resources, duration ns) of moving every (src, dst, bytes) of `pieces` (src != dst) at once."""
        if not pieces:
            raise ValueError("an exchange needs at least one piece")
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

    def collective(self, group: tuple[int, ...], nbytes: int, kind: str = ALLREDUCE) -> tuple[tuple[int, ...], int]:
        """(resources, duration ns) of a ring `kind` over `group` (sorted device ids, >= 2) on `nbytes`."""
        hit = self._rings.get((group, kind))
        if hit is None:
            hit = self._ring(group, kind)
            self._rings[(group, kind)] = hit
        res, steps, envelope = hit
        chunk = nbytes / len(group)
        extra = (nbytes * self.overhead.allreduce_ms_per_gb * 1e-3 if kind == ALLREDUCE else 0.0) \
            + self.overhead.sync_us * 1e3
        return res, max(0, round(steps * max(lat + chunk * slow for lat, slow in envelope) + extra))

    def _ring(self, group: tuple[int, ...], kind: str) -> tuple[tuple[int, ...], int, tuple[tuple[float, float], ...]]:
        n = len(group)
        if n < 2 or list(group) != sorted(set(group)):
            raise ValueError(f"a collective needs >= 2 distinct devices in ascending order, got {group}")
        hops = [self.topology.route(group[i], group[(i + 1) % n]) for i in range(n)]
        load: dict[int, int] = {}
        for hop in hops:
            for link in hop:
                load[self._cap[link]] = load.get(self._cap[link], 0) + 1
        links = self.topology.links
        # per hop: (latency ns, ns per byte of one chunk on its most loaded link); a hop another one beats
        # on both counts never sets the step time, so only the upper envelope is kept.
        pairs = {(sum(links[i].latency_us for i in hop) * 1e3,
                  max(load[self._cap[i]] / self._cap_gbps[self._cap[i]] for i in hop)) for hop in hops}
        envelope = tuple(sorted(p for p in pairs
                                if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in pairs)))
        res = tuple(d for d in group if d in self._busy) + tuple(sorted(self.num_devices + i for i in load))
        return res, _STEPS[kind](n), envelope
