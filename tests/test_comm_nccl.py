"""Collectives as NCCL runs them (`simulator.comm`): rings with one channel per NIC rail, double binary
trees for all-reduces over several nodes, and per call the faster of the two.

Every expected time is worked out here from the presets' link figures (bandwidth and latency per link
kind, read from the topology), never copied from what the code computes. The presets' routes: between
two GPUs of an a100 node, ``gpu -> nodeK.nvswitch -> gpu`` (two ``nvswitch`` links); between GPUs of two
a100 nodes, ``gpu -> nodeK.nicI -> net -> nodeL.nicJ -> gpu`` (``nic``, ``network``, ``network``, ``nic``:
the sender's own NIC and the receiver's own); a p100 node of 4 GPUs is NVLink all-to-all (one ``nvlink``
link per pair) and has one NIC, ``gpu -> nodeK.nic -> net``, which all its GPUs share.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

from simulator.comm import ALLGATHER, ALLREDUCE, REDUCE_SCATTER, RING, TREE, Comm, CommOverhead
from soap.topology import DeviceTopology, load_topology

GIB = 1 << 30


def figures(topo: DeviceTopology, kind: str) -> tuple[float, float]:
    """(bandwidth GB/s, latency ns) of the links of `kind`, which the presets give one figure each."""
    rows = {(link.bandwidth_gbps, link.latency_us * 1e3) for link in topo.links if link.kind == kind}
    assert len(rows) == 1, (kind, rows)
    return rows.pop()


def a100_hops(topo: DeviceTopology) -> tuple[float, float, float, float]:
    """(latency ns, bandwidth GB/s) of a hop inside an a100 node and of a hop between two nodes."""
    nv_bw, nv_lat = figures(topo, "nvswitch")
    nic_bw, nic_lat = figures(topo, "nic")
    net_bw, net_lat = figures(topo, "network")
    return 2 * nv_lat, nv_bw, 2 * nic_lat + 2 * net_lat, min(nic_bw, net_bw)


def one_ascending_ring_ns(topo: DeviceTopology, group: tuple[int, ...], nbytes: int, steps: int) -> int:
    """The single ring over `group` in ascending order, every hop on its route, chunks of B/n, a link that
    k hops cross carrying k chunks: the model for every group before channels and trees."""
    n = len(group)
    hops = [topo.route(group[i], group[(i + 1) % n]) for i in range(n)]
    load = Counter(topo.capacity(link) for hop in hops for link in hop)
    bandwidth: dict[int, float] = {}
    for link in topo.links:
        cap = topo.capacity(link.id)
        bandwidth[cap] = min(bandwidth.get(cap, math.inf), link.bandwidth_gbps)
    chunk = nbytes / n
    step = max(sum(topo.links[i].latency_us for i in hop) * 1e3
               + chunk * max(load[topo.capacity(i)] / bandwidth[topo.capacity(i)] for i in hop) for hop in hops)
    return round(steps * step)


def nics(topo: DeviceTopology, resources: tuple[int, ...]) -> set[str]:
    """The NIC endpoints among the links of `resources`."""
    ends = set()
    for r in resources:
        if r >= topo.num_devices:
            link = topo.links[r - topo.num_devices]
            ends |= {e for e in (link.src, link.dst) if ".nic" in e}
    return ends


# -- rings with channels ---------------------------------------------------------------------------------


def test_a_ring_over_two_a100_nodes_runs_one_channel_per_rail():
    """All 16 GPUs of a100-2x8: 8 rings, ring c entering each node at its GPU c and leaving from GPU c-1.
    Every NIC port carries one ring's crossing; every GPU sends across the NVSwitch in the other 7 rings.
    A step moves B/(8 x 16) per hop; the all-gather takes 15 steps."""
    topo = load_topology("a100-2x8")
    comm = Comm(topo)
    group = tuple(range(16))
    nbytes = GIB
    assert comm.channels(group) == 8
    intra_lat, nv_bw, inter_lat, net_bw = a100_hops(topo)
    chunk = nbytes / (8 * 16)
    step = max(inter_lat + chunk / net_bw, intra_lat + chunk * 7 / nv_bw)
    res, ns = comm.collective(group, nbytes, ALLGATHER)
    assert isinstance(ns, int) and ns == round(15 * step)
    # one ring would cross each node boundary once, on one rail, with chunks of B/16: 8 times the bytes
    # through one NIC per step
    one_ring = one_ascending_ring_ns(topo, group, nbytes, 15)
    assert one_ring == round(15 * (inter_lat + nbytes / 16 / net_bw))
    assert ns < one_ring / 7
    # each channel leaves and enters the nodes through NICs of its own: all 16 NICs carry the rings
    assert nics(topo, res) == {f"node{k}.nic{i}" for k in range(2) for i in range(8)}
    assert comm.collective(group, nbytes, REDUCE_SCATTER)[1] == ns


def test_channels_are_the_fewest_devices_of_the_group_on_any_node():
    topo = load_topology("a100-4x8")
    comm = Comm(topo)
    assert comm.channels(tuple(range(32))) == 8
    assert comm.channels(tuple(range(0, 32, 4))) == 2  # tp=4: GPUs r and r+4 of every node
    assert comm.channels((0, 1, 2, 3, 8, 9)) == 2
    assert comm.channels((0, 1, 2, 3, 8)) == 1  # node 1 holds one device of the group: one rail there
    assert comm.channels(tuple(range(0, 32, 8))) == 1
    assert comm.channels(tuple(range(8))) == 1  # one node: one ring
    # the tp=4 group's two rings leave and enter every node through the NICs of GPUs r and r+4 only
    res, _ = comm.collective(tuple(range(1, 32, 4)), 1 << 20, ALLGATHER)
    assert nics(topo, res) == {f"node{k}.nic{i}" for k in range(4) for i in (1, 5)}


def test_a100_channels_over_four_nodes_by_hand():
    """All 32 GPUs of a100-4x8, a large all-reduce: 8 rings of 32 hops, 62 steps of B/(8 x 32) per hop; the
    ring beats the tree on bandwidth (a NIC carries 2(n-1)/n B/8 for the rings, 2B/8 for the trees)."""
    topo = load_topology("a100-4x8")
    comm = Comm(topo)
    group = tuple(range(32))
    intra_lat, nv_bw, inter_lat, net_bw = a100_hops(topo)
    ring, tree = comm.algorithms(group)
    assert (ring.name, tree.name) == (RING, TREE)
    for nbytes in (1 << 20, 16 * GIB):
        chunk = nbytes / (8 * 32)
        expected = 62 * max(inter_lat + chunk / net_bw, intra_lat + chunk * 7 / nv_bw)
        assert round(ring.wire_ns(nbytes)) == round(expected)
    # per byte of B, the busiest NIC port: 62 chunks of B/256 for the rings, 4 tree shares of B/16
    assert 62 / 256 < 4 / 16
    assert comm.collective(group, 16 * GIB)[1] == round(ring.wire_ns(16 * GIB)) < round(tree.wire_ns(16 * GIB))


# -- one NIC per node: one channel -----------------------------------------------------------------------


def test_p100_nodes_share_one_nic_so_one_ring_crosses_it():
    topo = load_topology("p100-4x4")
    comm = Comm(topo)
    group = tuple(range(16))
    assert comm.channels(group) == 1
    for kind, steps in ((ALLGATHER, 15), (REDUCE_SCATTER, 15)):
        assert comm.collective(group, 1 << 24, kind)[1] == one_ascending_ring_ns(topo, group, 1 << 24, steps)
    ring = comm.algorithms(group)[0]
    assert round(ring.wire_ns(GIB)) == one_ascending_ring_ns(topo, group, GIB, 30)
    assert nics(topo, comm.collective(group, GIB)[0]) == {f"node{k}.nic" for k in range(4)}


def test_p100_tree_for_small_all_reduces_ring_for_large():
    """p100-4x4, all 16 GPUs, one channel. Ring: 30 steps of B/16 per hop, the slowest hop between nodes
    (PCIe into the NIC, InfiniBand). Tree: over the 4 nodes NCCL's trees 0 -> 2 -> {1, 3} and its mirror
    3 -> 1 -> {2, 0}, each carrying B/2, and below each node's head (its first GPU) the chain of the other
    three over NVLink. Nodes 1 and 2 forward in one tree and are a leaf of the other: their NIC port
    carries 4 tree shares each way. Fill: up and down 2 node hops and a chain of 3 NVLink hops."""
    topo = load_topology("p100-4x4")
    comm = Comm(topo)
    group = tuple(range(16))
    nv_bw, nv_lat = figures(topo, "nvlink")
    nic_bw, nic_lat = figures(topo, "nic")
    net_bw, net_lat = figures(topo, "network")
    inter_lat, slowest = 2 * nic_lat + 2 * net_lat, min(nic_bw, net_bw)
    assert 4 / slowest > 2 / nv_bw  # the NICs, not the chains (2 shares per NVLink direction), are the bottleneck

    def ring_ns(nbytes: int) -> float:
        return 30 * max(inter_lat + nbytes / 16 / slowest, nv_lat + nbytes / 16 / nv_bw)

    def tree_ns(nbytes: int) -> float:
        return 2 * (2 * inter_lat + 3 * nv_lat) + nbytes / 2 * 4 / slowest

    small, large = 8 << 10, GIB
    assert tree_ns(small) < ring_ns(small) and ring_ns(large) < tree_ns(large)
    ring, tree = comm.algorithms(group)
    for nbytes in (small, large):
        assert round(ring.wire_ns(nbytes)) == round(ring_ns(nbytes))
        assert round(tree.wire_ns(nbytes)) == round(tree_ns(nbytes))
    assert comm.collective(group, small)[1] == round(tree_ns(small))
    assert comm.collective(group, large)[1] == round(ring_ns(large))
    # one collective's resources, whichever algorithm its size picks
    assert comm.collective(group, small)[0] == comm.collective(group, large)[0]


# -- trees for latency -------------------------------------------------------------------------------------


@pytest.mark.parametrize("nodes", [3, 4, 5, 8, 16])
def test_tree_latency_grows_with_log2_of_the_nodes_and_the_ring_linearly(nodes):
    """GPU 0 of every a100 node (one rail, one channel, no chains), 8 bytes: the ring pays 2(N-1) hops
    between nodes, the tree up and down its depth, ceil(log2 N)."""
    topo = load_topology(f"a100-{nodes}x8")
    comm = Comm(topo)
    group = tuple(range(0, 8 * nodes, 8))
    _, _, inter_lat, _ = a100_hops(topo)
    ring, tree = comm.algorithms(group)
    assert ring.wire_ns(8) == pytest.approx(2 * (nodes - 1) * inter_lat, abs=1)
    assert tree.wire_ns(8) == pytest.approx(2 * math.ceil(math.log2(nodes)) * inter_lat, abs=1)
    assert comm.collective(group, 8)[1] == round(tree.wire_ns(8))


def test_tree_beats_ring_for_a_tiny_all_reduce_over_many_a100s():
    """All 32 GPUs of a100-4x8, 8 KiB: the ring's 62 steps each wait for a hop between nodes; the trees'
    fill is 2 node hops and a chain of 7 NVSwitch hops, up and down."""
    topo = load_topology("a100-4x8")
    comm = Comm(topo)
    intra_lat, _, inter_lat, _ = a100_hops(topo)
    group = tuple(range(32))
    _, ns = comm.collective(group, 8 << 10)
    fill = 2 * (2 * inter_lat + 7 * intra_lat)
    assert ns == pytest.approx(fill, abs=200)  # plus 8 KiB / 16 per tree over the busiest link: < 200 ns
    assert ns < 62 * inter_lat / 5


def test_trees_only_for_all_reduces_over_several_nodes():
    topo = load_topology("a100-2x8")
    comm = Comm(topo)
    assert [a.name for a in comm.algorithms(tuple(range(16)))] == [RING, TREE]
    assert [a.name for a in comm.algorithms(tuple(range(16)), ALLGATHER)] == [RING]
    assert [a.name for a in comm.algorithms(tuple(range(16)), REDUCE_SCATTER)] == [RING]
    assert [a.name for a in comm.algorithms(tuple(range(8)))] == [RING]


def test_overheads_ride_on_the_faster_algorithm():
    topo = load_topology("p100-4x4")
    overhead = CommOverhead(sync_us=7.0, allreduce_ms_per_gb=3.0)
    plain, charged = Comm(topo), Comm(topo, overhead)
    group = tuple(range(16))
    for nbytes in (8 << 10, GIB):
        wire = min(a.wire_ns(nbytes) for a in plain.algorithms(group))
        assert charged.collective(group, nbytes)[1] == round(wire + 7_000 + nbytes * 3.0 * 1e-3)
        assert charged.collective(group, nbytes, ALLGATHER)[1] == plain.collective(group, nbytes, ALLGATHER)[1] + 7_000


def test_the_backends_all_gather_and_reduce_scatter_cost_their_own_terms():
    """A backend whose all-gather and reduce-scatter are not the rings (gloo) pays each kind's fixed cost
    and cost per GB of its buffer on top of the ring, and both the extra cost of a sharded parameter's
    collective inside a step; the all-reduce pays none of them."""
    topo = load_topology("cpu-4")
    overhead = CommOverhead(sync_us=5.0, allgather_us=30.0, allgather_ms_per_gb=180.0, reduce_scatter_us=290.0,
                            reduce_scatter_ms_per_gb=580.0, shard_us=10.0, shard_ms_per_gb=20.0)
    plain, charged = Comm(topo), Comm(topo, overhead)
    group = (0, 1, 2, 3)
    for nbytes in (64 << 10, 16 << 20):
        ring = {k: min(a.wire_ns(nbytes) for a in plain.algorithms(group, k))
                for k in (ALLREDUCE, ALLGATHER, REDUCE_SCATTER)}
        assert charged.collective(group, nbytes, ALLGATHER)[1] == \
            round(ring[ALLGATHER] + 5_000 + 40_000 + nbytes * 200.0 * 1e-3)
        assert charged.collective(group, nbytes, REDUCE_SCATTER)[1] == \
            round(ring[REDUCE_SCATTER] + 5_000 + 300_000 + nbytes * 600.0 * 1e-3)
        assert charged.collective(group, nbytes, ALLREDUCE)[1] == round(ring[ALLREDUCE] + 5_000)


# -- single nodes: unchanged -------------------------------------------------------------------------------


@pytest.mark.parametrize("preset,group", [
    ("a100-1x8", tuple(range(8))), ("a100-2x8", (0, 2, 5)), ("h100-1x8", (1, 3, 4, 7)),
    ("p100-1x8", tuple(range(8))), ("v100-2x8", (8, 9, 12, 15)), ("k80-1x8", tuple(range(8))),
    ("cpu-4", (0, 1, 2, 3)),
])
def test_a_group_inside_one_node_keeps_its_one_ascending_ring(preset, group):
    topo = load_topology(preset)
    comm = Comm(topo)
    assert comm.channels(group) == 1 and [a.name for a in comm.algorithms(group)] == [RING]
    n = len(group)
    for kind, steps in ((ALLREDUCE, 2 * (n - 1)), (ALLGATHER, n - 1), (REDUCE_SCATTER, n - 1)):
        for nbytes in (8, 8 << 10, 1 << 26):
            assert comm.collective(group, nbytes, kind)[1] == one_ascending_ring_ns(topo, group, nbytes, steps)


# -- exact, cached, deterministic --------------------------------------------------------------------------


def test_results_are_integer_cached_and_deterministic():
    topo = load_topology("a100-4x8")
    groups = [tuple(range(32)), tuple(range(0, 32, 4)), (0, 1, 2, 3, 8, 9), tuple(range(8))]
    sizes = (8, 8 << 10, 1 << 20, GIB)
    comm = Comm(topo)
    first = {(g, b, k): comm.collective(g, b, k) for g in groups for b in sizes for k in (ALLREDUCE, ALLGATHER)}
    assert all(isinstance(ns, int) and ns > 0 for _, ns in first.values())
    assert comm.algorithms(groups[0]) is comm.algorithms(groups[0])
    # another Comm, pricing in the reverse order, gives the same figures
    other = Comm(load_topology("a100-4x8"))
    assert {key: other.collective(*key) for key in reversed(first)} == first
    assert {key: comm.collective(*key) for key in first} == first


def test_bad_groups_are_refused():
    comm = Comm(load_topology("a100-2x8"))
    for group in [(3,), (4, 2), (1, 1, 2)]:
        with pytest.raises(ValueError, match="ascending"):
            comm.collective(group, 8)
