"""DeviceTopology: devices, links and the routes between devices; presets and the topology file.

A topology is a set of devices (ids 0..n-1, each on a node 0..k-1) and DIRECTED links between named
endpoints; a full-duplex connection is two links, one per direction, and each link is a shared resource
(transfers on it run one at a time). Endpoint names:

- ``gpu3`` / ``cpu3``: device 3 (``cpu`` for devices of kind ``cpu``, ``gpu`` for every other kind);
- ``node0.pcie``, ``node0.nvswitch``, ``node0.loopback``: a node's switches;
- ``node0.nic``: a node's one NIC, which all its devices share; ``node0.nic3``: in a node with one NIC
  per GPU, the NIC of its GPU with local index 3 (device ``k * M + 3`` on node k of M GPUs each);
- ``net``: the network switch between nodes.

Link kinds: ``nvlink`` (direct GPU <-> GPU NVLink; the bandwidth is all the bricks between the pair),
``nvswitch`` (GPU <-> the node's NVSwitch), ``pcie`` (device <-> the node's PCIe switch), ``nic`` (the hop
from inside a node into its NIC), ``network`` (NIC <-> network switch: InfiniBand), ``loopback`` (process
<-> the loopback hub of local processes). A route between two devices is the shortest path by hop count,
then by total latency (an exact integer weight; where paths still tie, networkx's bidirectional Dijkstra
over the whole graph picks one, the same every run), cached per pair. It is found block by block
(`_Router`): an endpoint whose removal splits the links apart (``net`` between nodes, a node's one NIC)
is on every route between the parts, so a route is the shortest path inside each part between such
endpoints, and a search inside one node's links replaces one over the whole machine; only where a part
has two equally short paths (a DGX-1 cube-mesh: GPU 0 to 5 through 1 or 4) is the whole graph searched.

Presets (``load_topology("KIND-NxM")``: N nodes x M devices per node, device ids node-major):

========  ===========================================  ==========================  ==========
kind      inside a node                                GPU -> NIC                  network
========  ===========================================  ==========================  ==========
p100      NVLink 1: M <= 4 all-to-all, 5..8 DGX-1      PCIe 3.0 (one NIC)          IB EDR
          hybrid cube-mesh
v100      NVLink 2: as p100, DGX-1V brick counts       PCIe 3.0 (one NIC)          IB EDR
k80       one PCIe 3.0 switch (``nodeK.pcie``)         via the PCIe switch         IB FDR
a100      NVSwitch (600 GB/s per GPU, both ways)       PCIe 4.0, one NIC per GPU   IB HDR per NIC
h100/200  NVSwitch (900 GB/s per GPU, both ways)       PCIe 5.0, one NIC per GPU   IB NDR per NIC
========  ===========================================  ==========================  ==========

In an all-to-all NVLink node each GPU's bricks (P100: 4, V100: 6) are spread evenly over its M-1 peers;
the 5..8-GPU nodes are the DGX-1 hybrid cube-mesh (quads 0-3 and 4-7 all-to-all, plus i <-> i+4)
restricted to GPUs 0..M-1. P100/V100/K80 nodes have one NIC (``nodeK.nic``), which a GPU reaches in one
``nic`` hop (K80: through ``nodeK.pcie``), and one InfiniBand port to ``net``, which all the node's
traffic to other nodes shares. NVSwitch nodes have one NIC per GPU, as a DGX A100/H100 has (eight 200 or
400 Gb/s ports, rail-optimized): local GPU i reaches ``nodeK.nici`` in one ``nic`` hop and that NIC has
its own port to ``net`` at the per-NIC rate, so a transfer between GPUs of different nodes goes through
the sender's own NIC and the receiver's own NIC (``gpuA -> nodeK.nici -> net -> nodeL.nicj -> gpuB``) and
never through another GPU's. A ring over GPU i of every node (the data-parallel ring of one
tensor-parallel rank) uses only rail i, so the rings of different ranks run at once, each at one NIC's
rate. ``net`` is one non-blocking switch (the leaf and spine switches of a rail-optimized fabric are not
modelled). ``cpu-N``: N local processes on node 0, each linked to ``node0.loopback``. A single node has no
NIC.
The FlexFlow paper's clusters are ``p100-4x4`` and ``k80-16x4``. Figures come from `soap.devices`. A
topology, preset or file, has at most `MAX_DEVICES` devices.

Topology file (JSON; a machine profile written by calibration is the same format)::

    {"format": "soapflow.topology/1", "name": "two-p100",
     "devices": [{"id": 0, "kind": "p100", "node": 0},
                 {"id": 1, "kind": "p100", "node": 0, "peak_tflops": {"float32": 9.3},
                  "memory_bandwidth_gbps": 700, "memory_gb": 16}],
     "links": [{"src": "gpu0", "dst": "gpu1", "kind": "nvlink", "spec": "nvlink1",
                "bandwidth_gbps": 20, "latency_us": 3, "bidirectional": true}]}

Units: ``peak_tflops`` in TFLOP/s per dtype, ``memory_bandwidth_gbps`` and ``bandwidth_gbps`` in GB/s
(1e9 bytes per second; link bandwidth per direction), ``memory_gb`` in GB (1e9 bytes), ``latency_us`` in
microseconds per hop. Device overrides are optional and replace the datasheet figures of the device's
kind (``peak_tflops`` per dtype; the other dtypes keep the datasheet value); a device of a kind not in
the table must give all three. ``bidirectional`` (default true) makes the entry two links, forward first.
``spec`` (optional) names the physical link; when it is a known spec (``nvlink2``, ``ib-edr``, ...)
``bandwidth_gbps`` and ``latency_us`` default to its figures. Other top-level keys are ignored.
Figures must be physical (`FILE_BOUNDS`): ``bandwidth_gbps`` and ``memory_bandwidth_gbps`` in [1e-6, 1e9]
GB/s, ``peak_tflops`` in [1e-6, 1e9] TFLOP/s, ``latency_us`` in [0, 1e9] us, all finite (no NaN, no
infinity). The bounds are many orders of magnitude beyond any real or calibrated machine (a link of 1 kB/s,
a device of 1 MFLOP/s, a hop of a quarter of an hour) and well inside what the simulator's integer
nanoseconds hold: a file outside them is a typo or a unit mistake, refused naming the field and its entry.
A file says how many NICs a node has by its links, nothing else: one NIC per GPU is the links
``gpuK <-> nodeN.nicI`` and ``nodeN.nicI <-> net`` per GPU, as the presets write them; one ``nodeN.nic``
with a single link to ``net`` (what soapflow wrote for a100/h100/h200 presets before they had rails: an
``ib-hdr x8`` uplink of 8 x 25 GB/s) still loads and means that: one uplink, on which transfers and
collectives of all the node's GPUs run one at a time.

Must not import torch, the simulator, the search or the runtime.
"""

from __future__ import annotations

import functools
import heapq
import math
import os
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from types import MappingProxyType
from typing import Any

import networkx as nx

from soap.devices import DEVICE_SPECS, DTYPES, LINK_SPECS, device_spec
from soap.files import read_json, write_json

FORMAT = "soapflow.topology/1"
# The most devices a topology (preset or file) may have. The simulator keeps state per device and the
# search enumerates device sets per op: far beyond this, a command spends minutes before it reports anything.
MAX_DEVICES = 16384
LINK_KINDS = ("nvlink", "nvswitch", "pcie", "nic", "network", "loopback")
# kinds whose two directions between the same endpoints share one capacity: a host's loopback between
# processes is memory copies by the same cores, so bytes going both ways at once take as long as their sum
# going one way (measured: an all-to-all of B bytes each way between two gloo processes takes about the
# time of 2B sent one way). Every other kind is full duplex: each direction is its own link.
HALF_DUPLEX_KINDS = frozenset({"loopback"})
_GB = 1e9  # bytes
_TERA = 1e12
# (lowest, highest) value a topology file may give for each figure, in the figure's unit (the module
# docstring says why these)
FILE_BOUNDS: Mapping[str, tuple[float, float]] = MappingProxyType({
    "bandwidth_gbps": (1e-6, 1e9), "memory_bandwidth_gbps": (1e-6, 1e9), "peak_tflops": (1e-6, 1e9),
    "latency_us": (0.0, 1e9)})
_UNITS = {"bandwidth_gbps": "GB/s", "memory_bandwidth_gbps": "GB/s", "peak_tflops": "TFLOP/s", "latency_us": "us"}


class TopologyError(ValueError):
    """A topology preset name or file that cannot be used; the message says why in one line."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Device:
    """One compute device. `peak_flops` maps dtype name ('float32', 'float16', 'bfloat16', 'float64',
    'tf32') to FLOP/s; a dtype the hardware does not support is absent."""

    id: int
    kind: str
    node: int
    peak_flops: Mapping[str, float]
    memory_bandwidth_gbps: float  # GB/s (gigabytes per second)
    memory_bytes: int

    def __post_init__(self) -> None:
        if self.id < 0 or self.node < 0:
            raise ValueError(f"device id={self.id} and node={self.node} must be >= 0")
        if not self.kind:
            raise ValueError(f"device {self.id}: kind must be a non-empty name")
        peaks = {str(k): float(v) for k, v in dict(self.peak_flops).items()}
        if not peaks or not all(v > 0 and math.isfinite(v) for v in peaks.values()):
            raise ValueError(f"device {self.id}: peak_flops must be non-empty, positive and finite, "
                             f"got {peaks}")
        object.__setattr__(self, "peak_flops", MappingProxyType(peaks))
        if not (self.memory_bandwidth_gbps > 0 and math.isfinite(self.memory_bandwidth_gbps)):
            raise ValueError(f"device {self.id}: memory_bandwidth_gbps must be > 0, "
                             f"got {self.memory_bandwidth_gbps}")
        object.__setattr__(self, "memory_bandwidth_gbps", float(self.memory_bandwidth_gbps))
        if self.memory_bytes <= 0:
            raise ValueError(f"device {self.id}: memory_bytes must be > 0, got {self.memory_bytes}")

    @classmethod
    def of_kind(cls, kind: str, *, id: int, node: int) -> Device:
        """A device with the datasheet figures of `kind` (`soap.devices`)."""
        spec = device_spec(kind)
        return cls(id=id, kind=kind, node=node,
                   peak_flops={k: v * _TERA for k, v in spec.peak_tflops.items()},
                   memory_bandwidth_gbps=spec.memory_bandwidth_gbps, memory_bytes=round(spec.memory_gb * _GB))

    @property
    def endpoint(self) -> str:
        """The device's endpoint name in links: 'cpu3' for kind cpu, 'gpu3' otherwise."""
        return f"{'cpu' if self.kind == 'cpu' else 'gpu'}{self.id}"

    def peak_flops_for(self, dtype: str) -> float:
        """Peak FLOP/s for `dtype`; `ValueError` naming the device and its dtypes when unsupported."""
        try:
            return self.peak_flops[dtype]
        except KeyError:
            raise ValueError(f"device {self.id} ({self.kind}) has no peak for dtype {dtype!r}; "
                             f"it has {', '.join(self.peak_flops)}") from None

    def _key(self) -> tuple:
        return (self.id, self.kind, self.node, tuple(sorted(self.peak_flops.items())),
                self.memory_bandwidth_gbps, self.memory_bytes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __reduce__(self) -> tuple:  # the mapping proxy does not pickle
        return (functools.partial(Device, id=self.id, kind=self.kind, node=self.node,
                                  peak_flops=dict(self.peak_flops),
                                  memory_bandwidth_gbps=self.memory_bandwidth_gbps,
                                  memory_bytes=self.memory_bytes), ())


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """One direction of a physical connection between two endpoints (device names like 'gpu3', or
    switch/NIC names). A link is a shared resource: transfers on it run one at a time."""

    id: int
    src: str
    dst: str
    kind: str  # nvlink, nvswitch, pcie, nic, network, loopback
    bandwidth_gbps: float  # GB/s
    latency_us: float
    spec: str = ""  # the physical link, e.g. 'nvlink2 x2', 'pcie3-x16', 'ib-edr' (soap.devices.LINK_SPECS)

    def __post_init__(self) -> None:
        if self.id < 0:
            raise ValueError(f"link id must be >= 0, got {self.id}")
        if not self.src or not self.dst or self.src == self.dst:
            raise ValueError(f"link {self.id}: endpoints must be two different names, got {self.src!r} -> "
                             f"{self.dst!r}")
        if self.kind not in LINK_KINDS:
            raise ValueError(f"link {self.id} ({self.src} -> {self.dst}): unknown kind {self.kind!r}; "
                             f"known: {', '.join(LINK_KINDS)}")
        if not (self.bandwidth_gbps > 0 and math.isfinite(self.bandwidth_gbps)):
            raise ValueError(f"link {self.id} ({self.src} -> {self.dst}): bandwidth_gbps must be > 0, "
                             f"got {self.bandwidth_gbps}")
        if not (self.latency_us >= 0 and math.isfinite(self.latency_us)):
            raise ValueError(f"link {self.id} ({self.src} -> {self.dst}): latency_us must be >= 0, "
                             f"got {self.latency_us}")
        object.__setattr__(self, "bandwidth_gbps", float(self.bandwidth_gbps))
        object.__setattr__(self, "latency_us", float(self.latency_us))


_DEVICE_ENDPOINT = re.compile(r"^(gpu|cpu)(\d+)$")


@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
class DeviceTopology:
    """Devices (ids 0..n-1, nodes 0..k-1) and directed links; checks itself (`TopologyError`)."""

    name: str
    devices: tuple[Device, ...]
    links: tuple[Link, ...]
    _graph: nx.DiGraph = field(init=False, compare=False)
    _link_ids: dict[tuple[str, str], int] = field(init=False, compare=False)
    _routes: dict[tuple[int, int], tuple[int, ...]] = field(init=False, compare=False)
    _router: _Router | None = field(init=False, compare=False)

    def __post_init__(self) -> None:
        devices = tuple(sorted(self.devices, key=lambda d: d.id))
        links = tuple(sorted(self.links, key=lambda link: link.id))
        object.__setattr__(self, "devices", devices)
        object.__setattr__(self, "links", links)
        _check_ids(self.name, devices, links)
        _check_endpoints(devices, links)
        graph = nx.DiGraph()
        graph.add_nodes_from(d.endpoint for d in devices)
        # Exact lexicographic weight (hops, then latency in ns): one hop outweighs any path's latency.
        latency_ns = [round(link.latency_us * 1000) for link in links]
        hop = sum(latency_ns) + 1
        for link, ns in zip(links, latency_ns, strict=True):
            graph.add_edge(link.src, link.dst, weight=hop + ns)
        _check_reachable(graph, devices)
        object.__setattr__(self, "_graph", graph)
        object.__setattr__(self, "_link_ids", {(link.src, link.dst): link.id for link in links})
        object.__setattr__(self, "_routes", {})
        object.__setattr__(self, "_router", None)  # built by the first route between two devices

    def __repr__(self) -> str:
        return (f"DeviceTopology(name={self.name!r}, num_devices={self.num_devices}, "
                f"num_nodes={self.num_nodes}, num_links={len(self.links)})")

    def __reduce__(self) -> tuple:  # rebuilt (and re-checked) from its fields; the route cache starts empty
        return (functools.partial(DeviceTopology, name=self.name, devices=self.devices, links=self.links), ())

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def num_nodes(self) -> int:
        return max(d.node for d in self.devices) + 1

    def device(self, i: int) -> Device:
        self._check_device(i)
        return self.devices[i]

    def link(self, i: int) -> Link:
        if not 0 <= i < len(self.links):
            raise ValueError(f"link {i} not in topology {self.name!r} (links 0..{len(self.links) - 1})")
        return self.links[i]

    def endpoint(self, i: int) -> str:
        """The endpoint name of device `i` ('gpu3', 'cpu0')."""
        return self.device(i).endpoint

    def devices_of_node(self, n: int) -> tuple[int, ...]:
        """Ids of the devices on node `n`, ascending."""
        if not 0 <= n < self.num_nodes:
            raise ValueError(f"node {n} not in topology {self.name!r} (nodes 0..{self.num_nodes - 1})")
        return tuple(d.id for d in self.devices if d.node == n)

    def route(self, src: int, dst: int) -> tuple[int, ...]:
        """Link ids from device `src` to device `dst` (shortest path; () when src == dst)."""
        hit = self._routes.get((src, dst))
        if hit is None:
            self._check_device(src)
            self._check_device(dst)
            if src == dst:
                hit = ()
            else:
                if self._router is None:
                    object.__setattr__(self, "_router", _Router(self._graph, self.links))
                a, b = self.devices[src].endpoint, self.devices[dst].endpoint
                hit = self._router.route(a, b)
                if hit is None:  # two equally short paths: networkx's choice over the whole graph
                    path = nx.shortest_path(self._graph, a, b, weight="weight")
                    hit = tuple(self._link_ids[pair] for pair in pairwise(path))
            self._routes[(src, dst)] = hit
        return hit

    def capacity(self, i: int) -> int:
        """The link whose capacity link `i` uses: `i` itself, or for a half-duplex kind
        (`HALF_DUPLEX_KINDS`) the lower id of `i` and its reverse (same endpoints swapped, same kind), so
        that both directions are one shared resource."""
        link = self.links[i]
        if link.kind not in HALF_DUPLEX_KINDS:
            return i
        j = self._link_ids.get((link.dst, link.src))
        return i if j is None or self.links[j].kind != link.kind else min(i, j)

    def path(self, src: int, dst: int) -> tuple[str, ...]:
        """Endpoint names along `route(src, dst)`, both devices included (('gpu0',) when src == dst)."""
        route = self.route(src, dst)
        return (self.devices[src].endpoint, *(self.links[i].dst for i in route))

    def route_latency_us(self, src: int, dst: int) -> float:
        """Sum of the latencies along the route (0 when src == dst)."""
        return sum(self.links[i].latency_us for i in self.route(src, dst))

    def route_bandwidth_gbps(self, src: int, dst: int) -> float:
        """The narrowest link's bandwidth along the route (inf when src == dst)."""
        return min((self.links[i].bandwidth_gbps for i in self.route(src, dst)), default=math.inf)

    def _check_device(self, i: int) -> None:
        if not 0 <= i < len(self.devices):
            raise ValueError(f"device {i} not in topology {self.name!r} (devices 0..{len(self.devices) - 1})")

    # -- the topology file -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The topology file's JSON object: datasheet figures are left out, only overrides are written;
        a link and its reverse with the same figures become one bidirectional entry."""
        devices = [_device_to_dict(d) for d in self.devices]
        links: list[dict[str, Any]] = []
        i = 0
        while i < len(self.links):
            link = self.links[i]
            nxt = self.links[i + 1] if i + 1 < len(self.links) else None
            both = nxt is not None and (nxt.src, nxt.dst, nxt.kind, nxt.bandwidth_gbps, nxt.latency_us,
                                        nxt.spec) == (link.dst, link.src, link.kind, link.bandwidth_gbps,
                                                      link.latency_us, link.spec)
            entry: dict[str, Any] = {"src": link.src, "dst": link.dst, "kind": link.kind}
            if link.spec:
                entry["spec"] = link.spec
            entry |= {"bandwidth_gbps": link.bandwidth_gbps, "latency_us": link.latency_us,
                      "bidirectional": both}
            links.append(entry)
            i += 2 if both else 1
        return {"format": FORMAT, "name": self.name, "devices": devices, "links": links}

    @classmethod
    def from_dict(cls, doc: Any, *, source: str = "topology") -> DeviceTopology:
        """Parse a topology file's JSON object; `TopologyError` (one line, prefixed by `source`) when bad."""
        try:
            return _from_dict(doc)
        except ValueError as exc:
            raise TopologyError(f"{source}: {exc}") from None

    def describe(self) -> list[dict[str, Any]]:
        """Summary rows for the CLI, all with the same keys: one per group of alike devices (count, where,
        memory bandwidth, peaks), then one per group of alike links (kind, spec, where, bandwidth,
        latency)."""
        rows: list[dict[str, Any]] = []
        groups: dict[tuple, list[int]] = {}
        per_node = {n: len(self.devices_of_node(n)) for n in range(self.num_nodes)}
        for d in self.devices:
            groups.setdefault((d.kind, per_node[d.node], d._key()[3:]), []).append(d.id)
        for (kind, m, _), ids in groups.items():
            d = self.devices[ids[0]]
            nodes = len({self.devices[i].node for i in ids})
            peaks = ", ".join(f"{k} {v / _TERA:g}" for k, v in sorted(d.peak_flops.items(),
                                                                       key=lambda kv: -kv[1]))
            custom = kind not in DEVICE_SPECS or _device_to_dict(d).keys() != {"id", "kind", "node"}
            rows.append({"what": "device", "kind": kind, "count": len(ids),
                         "where": f"{m} per node x {nodes} node{'s' if nodes > 1 else ''}",
                         "spec": "custom" if custom else "datasheet",
                         "bandwidth_gbps": d.memory_bandwidth_gbps, "latency_us": None,
                         "detail": f"peak TFLOP/s {peaks}; memory {d.memory_bytes / _GB:g} GB"})
        link_groups: dict[tuple, list[Link]] = {}
        for link in self.links:
            roles = tuple(sorted((_role(link.src), _role(link.dst))))
            link_groups.setdefault((link.kind, link.spec, roles, link.bandwidth_gbps, link.latency_us),
                                   []).append(link)
        for (kind, spec, roles, bandwidth, latency), members in link_groups.items():
            rows.append({"what": "link", "kind": kind, "count": len(members), "where": " <-> ".join(roles),
                         "spec": spec or None, "bandwidth_gbps": bandwidth, "latency_us": latency,
                         "detail": "bandwidth per direction, latency per hop"})
        return rows


class _Router:
    """Shortest paths between endpoints of a topology's graph (edge attribute ``weight``: positive
    integers), found block by block.

    The blocks are the biconnected components of the links taken as undirected (every link lies in one),
    the cut endpoints those in several (``net``, a one-NIC node's NIC, a PCIe switch). Blocks and cut
    endpoints form a tree, and every path from a to b passes the cut endpoints on the tree's path between
    them, in order, each piece between two of them staying inside one block (a simple path that left a
    block would have to come back through the same cut endpoint). So the shortest path from a to b is the
    shortest path inside each of those blocks between its two ends, and it is unique exactly where each
    piece is: one Dijkstra per (block, start), counting the shortest paths to every endpoint (up to two),
    cached. `route` answers None where a piece has two, so that the caller breaks the tie as before."""

    __slots__ = ("_adjacent", "_cut", "_depth", "_home", "_num_blocks", "_parent", "_searches", "_src")

    def __init__(self, graph: nx.DiGraph, links: tuple[Link, ...]):
        blocks = list(nx.biconnected_components(graph.to_undirected(as_view=True)))
        blocks_of: dict[str, list[int]] = {}
        for b, block in enumerate(blocks):
            for v in block:
                blocks_of.setdefault(v, []).append(b)
        # tree nodes: block b is b, the k-th cut endpoint is len(blocks) + k
        cuts = [v for v, bs in blocks_of.items() if len(bs) > 1]
        self._num_blocks = len(blocks)
        self._cut = cuts
        self._home = {v: bs[0] for v, bs in blocks_of.items()}
        self._home |= {v: len(blocks) + k for k, v in enumerate(cuts)}
        tree: dict[int, list[int]] = {}
        for k, v in enumerate(cuts):
            for b in blocks_of[v]:
                tree.setdefault(b, []).append(len(blocks) + k)
                tree.setdefault(len(blocks) + k, []).append(b)
        self._parent: dict[int, int] = {}
        self._depth: dict[int, int] = {}
        for root in range(len(blocks)):  # a forest where switches are linked apart from every device
            if root in self._depth:
                continue
            self._parent[root], self._depth[root] = -1, 0
            frontier = [root]
            while frontier:
                node = frontier.pop()
                for near in tree.get(node, ()):
                    if near not in self._depth:
                        self._parent[near], self._depth[near] = node, self._depth[node] + 1
                        frontier.append(near)
        # per block, endpoint -> [(next endpoint, weight, link id)], in link order
        self._adjacent: list[dict[str, list[tuple[str, int, int]]]] = [{} for _ in blocks]
        for link in links:
            (b,) = set(blocks_of[link.src]) & set(blocks_of[link.dst])
            self._adjacent[b].setdefault(link.src, []).append(
                (link.dst, graph[link.src][link.dst]["weight"], link.id))
        self._src = tuple(link.src for link in links)
        # (block, start) -> (endpoint -> number of shortest paths from start, capped at 2; -> last link)
        self._searches: dict[tuple[int, str], tuple[dict[str, int], dict[str, int]]] = {}

    def route(self, a: str, b: str) -> tuple[int, ...] | None:
        """Link ids of the shortest path from endpoint `a` to endpoint `b` (a != b), or None when there are
        two or more."""
        links: list[int] = []
        start = a
        path = self._tree_path(self._home[a], self._home[b])
        for k, node in enumerate(path):
            if node >= self._num_blocks:  # a cut endpoint: where the previous piece ended
                continue
            end = b if k == len(path) - 1 else self._cut[path[k + 1] - self._num_blocks]
            counts, last = self._search(node, start)
            if counts[end] != 1:
                return None
            piece = []
            v = end
            while v != start:
                piece.append(last[v])
                v = self._src[last[v]]
            links += reversed(piece)
            start = end
        return tuple(links)

    def _tree_path(self, x: int, y: int) -> list[int]:
        """The tree nodes from `x` to `y`, both included."""
        up, down = [x], [y]
        while self._depth[up[-1]] > self._depth[down[-1]]:
            up.append(self._parent[up[-1]])
        while self._depth[down[-1]] > self._depth[up[-1]]:
            down.append(self._parent[down[-1]])
        while up[-1] != down[-1]:
            up.append(self._parent[up[-1]])
            down.append(self._parent[down[-1]])
        return up + down[-2::-1]

    def _search(self, block: int, start: str) -> tuple[dict[str, int], dict[str, int]]:
        hit = self._searches.get((block, start))
        if hit is None:
            adjacent = self._adjacent[block]
            dist, counts, last = {start: 0}, {start: 1}, {}
            done = set()
            heap = [(0, start)]
            while heap:
                d, u = heapq.heappop(heap)
                if u in done:
                    continue
                done.add(u)  # its count is final: every shortest path to it comes from nearer endpoints
                for v, weight, link in adjacent.get(u, ()):
                    if v not in dist or d + weight < dist[v]:
                        dist[v], counts[v], last[v] = d + weight, counts[u], link
                        heapq.heappush(heap, (d + weight, v))
                    elif d + weight == dist[v]:
                        counts[v] = min(2, counts[v] + counts[u])
            hit = self._searches[(block, start)] = (counts, last)
        return hit


def _role(endpoint: str) -> str:
    m = _DEVICE_ENDPOINT.match(endpoint)
    if m:
        return m.group(1)
    # 'node3.pcie' -> 'node.pcie'; 'node3.nic5' -> 'node.nic': a node's per-GPU NICs are alike
    return re.sub(r"^node\.nic\d+$", "node.nic", re.sub(r"^node\d+\.", "node.", endpoint))


def _check_ids(name: str, devices: tuple[Device, ...], links: tuple[Link, ...]) -> None:
    if not name:
        raise TopologyError("a topology needs a non-empty name")
    if not devices:
        raise TopologyError(f"topology {name!r} has no devices")
    ids = [d.id for d in devices]
    dup = sorted(i for i, n in Counter(ids).items() if n > 1)
    if dup:
        raise TopologyError(f"duplicate device id(s) {dup}")
    if ids != list(range(len(ids))):
        raise TopologyError(f"device ids must be 0..{len(ids) - 1}, got {ids}")
    nodes = sorted({d.node for d in devices})
    if nodes != list(range(len(nodes))):
        raise TopologyError(f"device nodes must be numbered 0..{len(nodes) - 1} without gaps, got {nodes}")
    link_ids = [link.id for link in links]
    if link_ids != list(range(len(links))):
        raise TopologyError(f"link ids must be 0..{len(links) - 1} without duplicates, got {link_ids}")


def _check_endpoints(devices: tuple[Device, ...], links: tuple[Link, ...]) -> None:
    names = {d.endpoint for d in devices}
    seen: dict[tuple[str, str], int] = {}
    neighbours: dict[str, set[str]] = {}
    for link in links:
        for end in (link.src, link.dst):
            m = _DEVICE_ENDPOINT.match(end)
            if m and end not in names:
                i = int(m.group(2))
                found = (f"device {i} is {devices[i].endpoint!r}" if i < len(devices)
                         else f"devices are {devices[0].endpoint}..{devices[-1].endpoint}")
                raise TopologyError(f"link {link.id} ({link.src} -> {link.dst}) names a missing device "
                                    f"{end!r} ({found})")
        if (link.src, link.dst) in seen:
            raise TopologyError(f"links {seen[(link.src, link.dst)]} and {link.id} both go {link.src} -> "
                                f"{link.dst}; merge them into one link with the summed bandwidth")
        seen[(link.src, link.dst)] = link.id
        neighbours.setdefault(link.src, set()).add(link.dst)
        neighbours.setdefault(link.dst, set()).add(link.src)
    for end, near in neighbours.items():
        if end not in names and len(near) < 2:
            raise TopologyError(f"endpoint {end!r} is linked only with {next(iter(near))!r}: not a device, "
                                f"and a switch needs two neighbours (a misspelt name?)")


def _check_reachable(graph: nx.DiGraph, devices: tuple[Device, ...]) -> None:
    first = devices[0].endpoint
    forward = nx.descendants(graph, first)
    backward = nx.ancestors(graph, first)
    for d in devices[1:]:
        if d.endpoint not in forward:
            raise TopologyError(f"devices cannot reach each other: no route from {first} to {d.endpoint}")
        if d.endpoint not in backward:
            raise TopologyError(f"devices cannot reach each other: no route from {d.endpoint} to {first}")


# -- parsing the file --------------------------------------------------------------------------------------

_DEVICE_KEYS = ("id", "kind", "node", "peak_tflops", "memory_bandwidth_gbps", "memory_gb")
_LINK_KEYS = ("src", "dst", "kind", "spec", "bandwidth_gbps", "latency_us", "bidirectional")


def _number(value: Any, what: str, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value < 0 or (positive and value == 0):
        sign = "positive" if positive else "non-negative"
        raise ValueError(f"{what} must be a {sign} number, got {value!r}")
    return float(value)


def _figure(value: Any, what: str, field: str) -> float:
    """A number of the file within `FILE_BOUNDS[field]`; `what` names the field and its entry."""
    low, high = FILE_BOUNDS[field]
    number = _number(value, what, positive=low > 0)
    if not low <= number <= high:
        raise ValueError(f"{what} must be a physical figure, in [{low:g}, {high:g}] {_UNITS[field]}, "
                         f"got {number:g}")
    return number


def _integer(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _entry(value: Any, what: str, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object, got {value!r}")
    unknown = [k for k in value if k not in keys]
    if unknown:
        raise ValueError(f"{what}: unknown key {unknown[0]!r}; known keys: {', '.join(keys)}")
    return value


def _device_from_dict(entry: dict[str, Any], where: str) -> Device:
    for key in ("id", "kind", "node"):
        if key not in entry:
            raise ValueError(f"{where}: missing {key!r}")
    i = _integer(entry["id"], f"{where}: id")
    where = f"device {i}"
    node = _integer(entry["node"], f"{where}: node")
    kind = entry["kind"]
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"{where}: kind must be a name, got {kind!r}")
    overrides = [k for k in ("peak_tflops", "memory_bandwidth_gbps", "memory_gb") if k in entry]
    if kind in DEVICE_SPECS:
        base = Device.of_kind(kind, id=i, node=node)
        peak_flops = dict(base.peak_flops)
        memory_bandwidth_gbps, memory_bytes = base.memory_bandwidth_gbps, base.memory_bytes
    elif len(overrides) < 3:
        raise ValueError(f"{where}: unknown device kind {kind!r}; known kinds: {', '.join(DEVICE_SPECS)} "
                         "(a device of another kind must give peak_tflops, memory_bandwidth_gbps and "
                         "memory_gb)")
    else:
        peak_flops, memory_bandwidth_gbps, memory_bytes = {}, 0.0, 0
    if "peak_tflops" in entry:
        peaks = entry["peak_tflops"]
        if not isinstance(peaks, dict) or not peaks:
            raise ValueError(f"{where}: peak_tflops must map dtype names to TFLOP/s, got {peaks!r}")
        for dtype, value in peaks.items():
            if dtype not in DTYPES:
                raise ValueError(f"{where}: peak_tflops has unknown dtype {dtype!r}; "
                                 f"known: {', '.join(DTYPES)}")
            peak_flops[dtype] = _figure(value, f"{where}: peak_tflops[{dtype!r}]", "peak_tflops") * _TERA
    if "memory_bandwidth_gbps" in entry:
        memory_bandwidth_gbps = _figure(entry["memory_bandwidth_gbps"], f"{where}: memory_bandwidth_gbps",
                                        "memory_bandwidth_gbps")
    if "memory_gb" in entry:
        memory_bytes = round(_number(entry["memory_gb"], f"{where}: memory_gb") * _GB)
    return Device(id=i, kind=kind, node=node, peak_flops=peak_flops,
                  memory_bandwidth_gbps=memory_bandwidth_gbps, memory_bytes=memory_bytes)


def _device_to_dict(d: Device) -> dict[str, Any]:
    entry: dict[str, Any] = {"id": d.id, "kind": d.kind, "node": d.node}
    base = Device.of_kind(d.kind, id=d.id, node=d.node) if d.kind in DEVICE_SPECS else None
    peaks = {k: v / _TERA for k, v in d.peak_flops.items() if base is None or base.peak_flops.get(k) != v}
    if peaks:
        entry["peak_tflops"] = peaks
    if base is None or base.memory_bandwidth_gbps != d.memory_bandwidth_gbps:
        entry["memory_bandwidth_gbps"] = d.memory_bandwidth_gbps
    if base is None or base.memory_bytes != d.memory_bytes:
        entry["memory_gb"] = d.memory_bytes / _GB
    return entry


def _links_from_dict(entry: dict[str, Any], where: str, next_id: int) -> list[Link]:
    for key in ("src", "dst", "kind"):
        if key not in entry:
            raise ValueError(f"{where}: missing {key!r}")
    src, dst, kind = entry["src"], entry["dst"], entry["kind"]
    for key, value in (("src", src), ("dst", dst), ("kind", kind)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{where}: {key} must be a name, got {value!r}")
    where = f"{where} ({src} -> {dst})"
    spec = entry.get("spec", "")
    if not isinstance(spec, str):
        raise ValueError(f"{where}: spec must be a name, got {spec!r}")
    figures = {}
    for key in ("bandwidth_gbps", "latency_us"):
        if key in entry:
            figures[key] = _figure(entry[key], f"{where}: {key}", key)
        elif spec in LINK_SPECS:
            figures[key] = getattr(LINK_SPECS[spec], key)
        else:
            raise ValueError(f"{where}: missing {key!r} (give it, or a spec from: {', '.join(LINK_SPECS)})")
    bidirectional = entry.get("bidirectional", True)
    if not isinstance(bidirectional, bool):
        raise ValueError(f"{where}: bidirectional must be true or false, got {bidirectional!r}")
    ends = [(src, dst), (dst, src)] if bidirectional else [(src, dst)]
    return [Link(id=next_id + k, src=a, dst=b, kind=kind, spec=spec, **figures)
            for k, (a, b) in enumerate(ends)]


def _from_dict(doc: Any) -> DeviceTopology:
    if not isinstance(doc, dict):
        raise ValueError(f"a topology must be a JSON object, got {type(doc).__name__}")
    if doc.get("format") != FORMAT:
        raise ValueError(f"unknown format {doc.get('format')!r}; this soapflow reads {FORMAT!r}")
    name = doc.get("name", "custom")
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    raw_devices, raw_links = doc.get("devices"), doc.get("links", [])
    if not isinstance(raw_devices, list) or not raw_devices:
        raise ValueError("'devices' must be a non-empty list")
    if not isinstance(raw_links, list):
        raise ValueError("'links' must be a list")
    if len(raw_devices) > MAX_DEVICES:
        raise ValueError(f"{len(raw_devices):,} devices; soapflow models at most {MAX_DEVICES:,}")
    devices = [_device_from_dict(_entry(e, f"device entry {k}", _DEVICE_KEYS), f"device entry {k}")
               for k, e in enumerate(raw_devices)]
    links: list[Link] = []
    for k, e in enumerate(raw_links):
        links += _links_from_dict(_entry(e, f"link entry {k}", _LINK_KEYS), f"link entry {k}", len(links))
    return DeviceTopology(name=name, devices=tuple(devices), links=tuple(links))


# -- presets -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class _NodeWiring:
    """How the nodes of a preset kind are wired, as the real machines are."""

    fabric: str  # nvlink-mesh, pcie-switch, nvswitch
    intra_spec: str  # the link inside the node (soap.devices.LINK_SPECS)
    nic_spec: str  # the hop into the node's NIC
    network_spec: str  # NIC <-> network switch
    nic_per_gpu: bool  # one NIC and network port per GPU (DGX A100/H100: rails); else one NIC per node
    max_per_node: int
    machine: str

    def __post_init__(self) -> None:
        assert self.fabric in ("nvlink-mesh", "pcie-switch", "nvswitch"), self.fabric
        assert {self.intra_spec, self.nic_spec, self.network_spec} <= set(LINK_SPECS), self


_WIRING: Mapping[str, _NodeWiring] = MappingProxyType({
    "p100": _NodeWiring(fabric="nvlink-mesh", intra_spec="nvlink1", nic_spec="pcie3-x16",
                        network_spec="ib-edr", nic_per_gpu=False, max_per_node=8, machine="DGX-1 (P100)"),
    "k80": _NodeWiring(fabric="pcie-switch", intra_spec="pcie3-x16", nic_spec="pcie3-x16",
                       network_spec="ib-fdr", nic_per_gpu=False, max_per_node=16,
                       machine="8 K80 boards on one PCIe tree"),
    "v100": _NodeWiring(fabric="nvlink-mesh", intra_spec="nvlink2", nic_spec="pcie3-x16",
                        network_spec="ib-edr", nic_per_gpu=False, max_per_node=8, machine="DGX-1V"),
    "a100": _NodeWiring(fabric="nvswitch", intra_spec="nvswitch-a100", nic_spec="pcie4-x16",
                        network_spec="ib-hdr", nic_per_gpu=True, max_per_node=8, machine="DGX A100"),
    "h100": _NodeWiring(fabric="nvswitch", intra_spec="nvswitch-h100", nic_spec="pcie5-x16",
                        network_spec="ib-ndr", nic_per_gpu=True, max_per_node=8, machine="DGX H100"),
    "h200": _NodeWiring(fabric="nvswitch", intra_spec="nvswitch-h100", nic_spec="pcie5-x16",
                        network_spec="ib-ndr", nic_per_gpu=True, max_per_node=8, machine="DGX H200"),
})
PRESET_KINDS = (*_WIRING, "cpu")

# NVLink bricks between GPU pairs of a DGX-1V (nvidia-smi topo -m: NV1/NV2) - the hybrid cube-mesh: two
# all-to-all quads (0-3, 4-7) plus GPU i <-> i+4. The P100 DGX-1 has the same pairs with one brick each.
_DGX1V_BRICKS = {(0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 3): 1, (1, 5): 2, (2, 3): 2,
                 (2, 6): 1, (3, 7): 1, (4, 5): 1, (4, 6): 1, (4, 7): 2, (5, 6): 2, (5, 7): 1, (6, 7): 2}


def _nvlink_pairs(kind: str, m: int) -> dict[tuple[int, int], int]:
    """Bricks per GPU pair (local indices) of an m-GPU NVLink node: all-to-all for m <= 4, each GPU's bricks
    spread evenly over its peers; the DGX-1 cube-mesh restricted to GPUs 0..m-1 for 5 <= m <= 8."""
    if m <= 4:
        bricks = device_spec(kind).nvlink_links // (m - 1)
        return {(a, b): bricks for a in range(m) for b in range(a + 1, m)}
    table = _DGX1V_BRICKS if kind == "v100" else dict.fromkeys(_DGX1V_BRICKS, 1)
    return {(a, b): n for (a, b), n in table.items() if b < m}


def _check_size(name: str, num_devices: int) -> None:
    if num_devices > MAX_DEVICES:
        raise TopologyError(f"{name}: {num_devices:,} devices; soapflow models at most {MAX_DEVICES:,}")


def build_preset(kind: str, *, num_nodes: int, devices_per_node: int, name: str = "") -> DeviceTopology:
    """The preset `KIND-NxM` (or `cpu-M` with num_nodes=1); `TopologyError` for an impossible machine."""
    name = name or (f"cpu-{devices_per_node}" if kind == "cpu" else f"{kind}-{num_nodes}x{devices_per_node}")
    if num_nodes < 1 or devices_per_node < 1:
        raise TopologyError(f"{name}: need at least 1 node and 1 device per node")
    links: list[Link] = []

    def connect(a: str, b: str, link_kind: str, spec: str, times: int = 1) -> None:
        row = LINK_SPECS[spec]
        label = spec if times == 1 else f"{spec} x{times}"
        for src, dst in ((a, b), (b, a)):
            links.append(Link(id=len(links), src=src, dst=dst, kind=link_kind, spec=label,
                              bandwidth_gbps=row.bandwidth_gbps * times, latency_us=row.latency_us))

    m = devices_per_node
    if kind == "cpu":
        if num_nodes != 1:
            raise TopologyError(f"{name}: cpu presets are local processes on one node (cpu-N)")
        _check_size(name, m)
        devices = [Device.of_kind("cpu", id=i, node=0) for i in range(m)]
        for d in devices if m > 1 else ():
            connect(d.endpoint, "node0.loopback", "loopback", "loopback")
        return DeviceTopology(name=name, devices=tuple(devices), links=tuple(links))
    if kind not in _WIRING:
        raise TopologyError(f"{name}: unknown preset kind {kind!r}; known: {', '.join(PRESET_KINDS)}")
    wiring = _WIRING[kind]
    if m > wiring.max_per_node:
        raise TopologyError(f"{name}: a {kind} node holds at most {wiring.max_per_node} GPUs "
                            f"({wiring.machine})")
    _check_size(name, num_nodes * m)
    devices = [Device.of_kind(kind, id=n * m + i, node=n) for n in range(num_nodes) for i in range(m)]
    for n in range(num_nodes):
        gpus = [f"gpu{n * m + i}" for i in range(m)]
        hub = {"pcie-switch": f"node{n}.pcie", "nvswitch": f"node{n}.nvswitch"}.get(wiring.fabric)
        if wiring.fabric == "nvlink-mesh" and m > 1:
            for (a, b), bricks in _nvlink_pairs(kind, m).items():
                connect(gpus[a], gpus[b], "nvlink", wiring.intra_spec, bricks)
        elif wiring.fabric == "nvswitch" and m > 1:
            for g in gpus:
                connect(g, hub, "nvswitch", wiring.intra_spec)
        elif wiring.fabric == "pcie-switch" and (m > 1 or num_nodes > 1):
            for g in gpus:
                connect(g, hub, "pcie", wiring.intra_spec)
        if num_nodes > 1 and wiring.nic_per_gpu:
            # rails: local GPU i leaves and enters the node only through its own NIC i and port
            for i, g in enumerate(gpus):
                connect(g, f"node{n}.nic{i}", "nic", wiring.nic_spec)
                connect(f"node{n}.nic{i}", "net", "network", wiring.network_spec)
        elif num_nodes > 1:
            nic = f"node{n}.nic"
            for src in [hub] if wiring.fabric == "pcie-switch" else gpus:
                connect(src, nic, "nic", wiring.nic_spec)
            connect(nic, "net", "network", wiring.network_spec)
    return DeviceTopology(name=name, devices=tuple(devices), links=tuple(links))


# -- loading and saving ------------------------------------------------------------------------------------

_PRESET_NAME = re.compile(r"^(?P<kind>[a-z0-9]+)-(?P<nodes>\d+)x(?P<per>\d+)$")
_CPU_NAME = re.compile(r"^cpu-(?P<n>\d+)$")
_VALID_FORMS = (f"a preset KIND-NxM (N nodes x M devices per node; KIND one of {', '.join(_WIRING)}; "
                "e.g. p100-4x4, k80-16x4), cpu-N (N local processes, e.g. cpu-2), or a topology JSON file")


def load_topology(spec: str | os.PathLike) -> DeviceTopology:
    """A preset name ('p100-4x4', 'cpu-2', ...) or the path of a topology JSON file."""
    text = os.fspath(spec)
    m = _CPU_NAME.match(text)
    if m:
        return build_preset("cpu", num_nodes=1, devices_per_node=int(m["n"]))
    m = _PRESET_NAME.match(text)
    if m and m["kind"] in _WIRING:
        return build_preset(m["kind"], num_nodes=int(m["nodes"]), devices_per_node=int(m["per"]))
    path = Path(text)
    if path.is_file():
        return read_topology(path)
    if text.endswith(".json") or os.sep in text or "/" in text:
        raise TopologyError(f"topology file {text!r} not found")
    raise TopologyError(f"unknown topology {text!r}: expected {_VALID_FORMS}")


def read_topology(path: str | os.PathLike) -> DeviceTopology:
    """Read a topology JSON file (named by its `name`, or the file's stem when it has none); figures outside
    `FILE_BOUNDS` (the module docstring) are refused."""
    source = f"topology file {os.fspath(path)!r}"
    doc = read_json(path, source, TopologyError)
    if isinstance(doc, dict) and "name" not in doc:
        doc = {**doc, "name": Path(path).stem}
    return DeviceTopology.from_dict(doc, source=source)


def save_topology(path: str | os.PathLike, topology: DeviceTopology) -> None:
    """Write the topology file atomically (temporary file in the same folder, then rename)."""
    write_json(path, topology.to_dict())
