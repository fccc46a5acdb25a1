"""Fast routes and collective plans change no result (`soap.topology` routes, `simulator.comm.Comm`).

Routes are found per block of the topology (the parts that a single endpoint cuts apart: a node's own
links, ``net``) instead of one networkx search over the whole graph per device pair; the test checks them
against that search, pair by pair. Collectives over large groups are checked against figures the code
gave BEFORE routes were split into blocks (GOLDEN below, computed with the per-pair networkx search and
the original ring envelope): per case the channel count, every algorithm's name, steps and divisor, a
digest of the exact resources and envelopes, and the duration at four sizes.
"""

from __future__ import annotations

import hashlib
import random
from itertools import pairwise

import networkx as nx
import pytest

from simulator.comm import ALLGATHER, ALLREDUCE, REDUCE_SCATTER, Comm
from soap.topology import DeviceTopology, TopologyError, load_topology

SIZES = (1 << 10, 1 << 20, 25 << 20, 1 << 30)
KINDS = (ALLREDUCE, ALLGATHER, REDUCE_SCATTER)


def reference_route(topo: DeviceTopology, src: int, dst: int) -> tuple[int, ...]:
    """The route as `DeviceTopology.route` found it before blocks: networkx's shortest path over the whole
    graph on the exact (hops, latency) weight, one search per pair."""
    if src == dst:
        return ()
    path = nx.shortest_path(topo._graph, topo.devices[src].endpoint, topo.devices[dst].endpoint,
                            weight="weight")
    ids = {(link.src, link.dst): link.id for link in topo.links}
    return tuple(ids[pair] for pair in pairwise(path))


def groups(name: str) -> dict[str, tuple[int, ...]]:
    """Named device groups of the preset `name`: all, each node, each rail, two nodes, uneven and random
    subsets (a fixed seed, so that GOLDEN stays valid)."""
    topo = load_topology(name)
    n, per = topo.num_devices, len(topo.devices_of_node(0))
    out = {"all": tuple(range(n)), "node0": topo.devices_of_node(0)}
    if topo.num_nodes > 1:
        out["nodes01"] = topo.devices_of_node(0) + topo.devices_of_node(1)
        out |= {f"rail{r}": tuple(range(r, n, per)) for r in range(per)}
        out["uneven"] = tuple(sorted({0, 1, 2, per + 1, per + 2, n - 1}))
    rng = random.Random(7)
    for k in range(3):
        out[f"random{k}"] = tuple(sorted(rng.sample(range(n), rng.randint(2, n))))
    return {k: v for k, v in out.items() if len(v) >= 2}


PRESETS = ("cpu-2", "cpu-4", "p100-4x4", "p100-2x8", "v100-3x6", "k80-16x4", "a100-4x8", "a100-8x8",
           "h100-3x8", "a100-1x8")


def cases() -> list[tuple[str, str, str]]:
    return [(name, group, kind) for name in PRESETS for group in groups(name) for kind in KINDS]


def figures(comm: Comm, group: tuple[int, ...], kind: str) -> list:
    """[channels, [(name, steps, divisor) per algorithm], digest of resources and envelopes, durations]."""
    algorithms = comm.algorithms(group, kind)
    exact = repr((comm.collective(group, 1, kind)[0],
                  [(a.name, a.resources, a.steps, a.divisor, a.envelope) for a in algorithms]))
    return [comm.channels(group), [[a.name, a.steps, a.divisor] for a in algorithms],
            hashlib.sha256(exact.encode()).hexdigest()[:16],
            [comm.collective(group, nbytes, kind)[1] for nbytes in SIZES]]


# figures(...) per case, printed by `python tests/test_comm_speed_routes.py` with the code before fast routes
# (soap/topology.py searching networkx per pair, simulator/comm.py's original plans): never regenerate them
# from the code under test; a change that moves them on purpose must say why.
GOLDEN: dict[str, list] = {
    'cpu-2|all|allreduce': [1, [["ring", 2, 2]], "55f9567ba6ba6f98", [80410, 499430, 10565760, 429576730]],
    'cpu-2|all|allgather': [1, [["ring", 1, 2]], "8e43df12f1a1d6ea", [40205, 249715, 5282880, 214788365]],
    'cpu-2|all|reduce_scatter': [1, [["ring", 1, 2]], "8e43df12f1a1d6ea", [40205, 249715, 5282880, 214788365]],
    'cpu-2|node0|allreduce': [1, [["ring", 2, 2]], "55f9567ba6ba6f98", [80410, 499430, 10565760, 429576730]],
    'cpu-2|node0|allgather': [1, [["ring", 1, 2]], "8e43df12f1a1d6ea", [40205, 249715, 5282880, 214788365]],
    'cpu-2|node0|reduce_scatter': [1, [["ring", 1, 2]], "8e43df12f1a1d6ea", [40205, 249715, 5282880, 214788365]],
    'cpu-2|random0|allreduce': [1, [["ring", 2, 2]], "55f9567ba6ba6f98", [80410, 499430, 10565760, 429576730]],
    'cpu-2|random0|allgather': [1, [["ring", 1, 2]], "8e43df12f1a1d6ea", [40205, 249715, 5282880, 214788365]],
    'cpu-2|random0|reduce_scatter': [1, [["ring", 1, 2]], "8e43df12f1a1d6ea", [40205, 249715, 5282880, 214788365]],
    'cpu-2|random1|allreduce': [1, [["ring", 2, 2]], "55f9567ba6ba6f98", [80410, 499430, 10565760, 429576730]],
    'cpu-2|random1|allgather': [1, [["ring", 1, 2]], "8e43df12f1a1d6ea", [40205, 249715, 5282880, 214788365]],
    'cpu-2|random1|reduce_scatter': [1, [["ring", 1, 2]], "8e43df12f1a1d6ea", [40205, 249715, 5282880, 214788365]],
    'cpu-2|random2|allreduce': [1, [["ring", 2, 2]], "55f9567ba6ba6f98", [80410, 499430, 10565760, 429576730]],
    'cpu-2|random2|allgather': [1, [["ring", 1, 2]], "8e43df12f1a1d6ea", [40205, 249715, 5282880, 214788365]],
    'cpu-2|random2|reduce_scatter': [1, [["ring", 1, 2]], "8e43df12f1a1d6ea", [40205, 249715, 5282880, 214788365]],
    'cpu-4|all|allreduce': [1, [["ring", 6, 4]], "c14e7d225b4b584f", [240614, 869146, 15968640, 644485094]],
    'cpu-4|all|allgather': [1, [["ring", 3, 4]], "d472a7bcb1823671", [120307, 434573, 7984320, 322242547]],
    'cpu-4|all|reduce_scatter': [1, [["ring", 3, 4]], "d472a7bcb1823671", [120307, 434573, 7984320, 322242547]],
    'cpu-4|node0|allreduce': [1, [["ring", 6, 4]], "c14e7d225b4b584f", [240614, 869146, 15968640, 644485094]],
    'cpu-4|node0|allgather': [1, [["ring", 3, 4]], "d472a7bcb1823671", [120307, 434573, 7984320, 322242547]],
    'cpu-4|node0|reduce_scatter': [1, [["ring", 3, 4]], "d472a7bcb1823671", [120307, 434573, 7984320, 322242547]],
    'cpu-4|random0|allreduce': [1, [["ring", 4, 3]], "3a5648dbbe1e45df", [160546, 719241, 14141013, 572822306]],
    'cpu-4|random0|allgather': [1, [["ring", 2, 3]], "ea787df9143aa715", [80273, 359620, 7070507, 286411153]],
    'cpu-4|random0|reduce_scatter': [1, [["ring", 2, 3]], "ea787df9143aa715", [80273, 359620, 7070507, 286411153]],
    'cpu-4|random1|allreduce': [1, [["ring", 2, 2]], "538fed4cb485952a", [80410, 499430, 10565760, 429576730]],
    'cpu-4|random1|allgather': [1, [["ring", 1, 2]], "f883243e845904dc", [40205, 249715, 5282880, 214788365]],
    'cpu-4|random1|reduce_scatter': [1, [["ring", 1, 2]], "f883243e845904dc", [40205, 249715, 5282880, 214788365]],
    'cpu-4|random2|allreduce': [1, [["ring", 6, 4]], "c14e7d225b4b584f", [240614, 869146, 15968640, 644485094]],
    'cpu-4|random2|allgather': [1, [["ring", 3, 4]], "d472a7bcb1823671", [120307, 434573, 7984320, 322242547]],
    'cpu-4|random2|reduce_scatter': [1, [["ring", 3, 4]], "d472a7bcb1823671", [120307, 434573, 7984320, 322242547]],
    'p100-4x4|all|allreduce':
        [1, [["ring", 30, 16], ["tree", 1, 2]], "bc9f7584bed7a9df", [66171, 240763, 4435067, 168132160]],
    'p100-4x4|all|allgather': [1, [["ring", 15, 16]], "1f0728aaf8798771", [180080, 261920, 2228000, 84066080]],
    'p100-4x4|all|reduce_scatter': [1, [["ring", 15, 16]], "1f0728aaf8798771", [180080, 261920, 2228000, 84066080]],
    'p100-4x4|node0|allreduce': [1, [["ring", 6, 4]], "d85faea52d02a32e", [18077, 96643, 1984080, 80548637]],
    'p100-4x4|node0|allgather': [1, [["ring", 3, 4]], "ccede4073e686dec", [9038, 48322, 992040, 40274318]],
    'p100-4x4|node0|reduce_scatter': [1, [["ring", 3, 4]], "ccede4073e686dec", [9038, 48322, 992040, 40274318]],
    'p100-4x4|nodes01|allreduce':
        [1, [["ring", 14, 8], ["tree", 1, 2]], "0f0697d63d7e024d", [42085, 129381, 2226533, 89520485]],
    'p100-4x4|nodes01|allgather': [1, [["ring", 7, 8]], "61d290282ef124ee", [84075, 160459, 1995467, 78377675]],
    'p100-4x4|nodes01|reduce_scatter': [1, [["ring", 7, 8]], "61d290282ef124ee", [84075, 160459, 1995467, 78377675]],
    'p100-4x4|rail0|allreduce':
        [1, [["ring", 6, 4], ["tree", 1, 2]], "2c95697af2a82a58", [48171, 203072, 3348800, 134289728]],
    'p100-4x4|rail0|allgather': [1, [["ring", 3, 4]], "3f3fa3a1afc46e9d", [36064, 101536, 1674400, 67144864]],
    'p100-4x4|rail0|reduce_scatter': [1, [["ring", 3, 4]], "3f3fa3a1afc46e9d", [36064, 101536, 1674400, 67144864]],
    'p100-4x4|rail1|allreduce':
        [1, [["ring", 6, 4], ["tree", 1, 2]], "6a1244f5fb6c84f4", [48171, 203072, 3348800, 134289728]],
    'p100-4x4|rail1|allgather': [1, [["ring", 3, 4]], "cd5f0af0203f5d97", [36064, 101536, 1674400, 67144864]],
    'p100-4x4|rail1|reduce_scatter': [1, [["ring", 3, 4]], "cd5f0af0203f5d97", [36064, 101536, 1674400, 67144864]],
    'p100-4x4|rail2|allreduce':
        [1, [["ring", 6, 4], ["tree", 1, 2]], "d70cd340077983d9", [48171, 203072, 3348800, 134289728]],
    'p100-4x4|rail2|allgather': [1, [["ring", 3, 4]], "6635531b6be37610", [36064, 101536, 1674400, 67144864]],
    'p100-4x4|rail2|reduce_scatter': [1, [["ring", 3, 4]], "6635531b6be37610", [36064, 101536, 1674400, 67144864]],
    'p100-4x4|rail3|allreduce':
        [1, [["ring", 6, 4], ["tree", 1, 2]], "0621b6cb93c63815", [48171, 203072, 3348800, 134289728]],
    'p100-4x4|rail3|allgather': [1, [["ring", 3, 4]], "2d6e818092b57ab3", [36064, 101536, 1674400, 67144864]],
    'p100-4x4|rail3|reduce_scatter': [1, [["ring", 3, 4]], "2d6e818092b57ab3", [36064, 101536, 1674400, 67144864]],
    'p100-4x4|uneven|allreduce':
        [1, [["ring", 10, 6], ["tree", 1, 2]], "e402cd3a8a202bce", [54128, 185072, 3330800, 134271728]],
    'p100-4x4|uneven|allgather': [1, [["ring", 5, 6]], "d2079abe1d0a1c9c", [60071, 132818, 1880444, 74625404]],
    'p100-4x4|uneven|reduce_scatter': [1, [["ring", 5, 6]], "d2079abe1d0a1c9c", [60071, 132818, 1880444, 74625404]],
    'p100-4x4|random0|allreduce':
        [1, [["ring", 12, 7], ["tree", 1, 2]], "e681cc153098d256", [60128, 191072, 3336800, 134277728]],
    'p100-4x4|random0|allgather': [1, [["ring", 6, 7]], "ff9d9f54c231d6da", [72073, 146898, 1944457, 76767845]],
    'p100-4x4|random0|reduce_scatter': [1, [["ring", 6, 7]], "ff9d9f54c231d6da", [72073, 146898, 1944457, 76767845]],
    'p100-4x4|random1|allreduce':
        [1, [["ring", 12, 7], ["tree", 1, 2]], "effdd76294aeab2c", [60171, 234763, 3888914, 153535689]],
    'p100-4x4|random1|allgather': [1, [["ring", 6, 7]], "6cd50de3b281b3ec", [72073, 146898, 1944457, 76767845]],
    'p100-4x4|random1|reduce_scatter': [1, [["ring", 6, 7]], "6cd50de3b281b3ec", [72073, 146898, 1944457, 76767845]],
    'p100-4x4|random2|allreduce':
        [1, [["ring", 14, 8], ["tree", 1, 2]], "ab4651f4bdbf3480", [66171, 240763, 3990933, 156755349]],
    'p100-4x4|random2|allgather': [1, [["ring", 7, 8]], "217c7a53d9f1164f", [84075, 160459, 1995467, 78377675]],
    'p100-4x4|random2|reduce_scatter': [1, [["ring", 7, 8]], "217c7a53d9f1164f", [84075, 160459, 1995467, 78377675]],
    'p100-2x8|all|allreduce':
        [1, [["ring", 30, 16], ["tree", 1, 2]], "75a021af1fdab9f7", [72085, 159381, 2256533, 89550485]],
    'p100-2x8|all|allgather': [1, [["ring", 15, 16]], "c55031e27857fa46", [180080, 261920, 2228000, 84066080]],
    'p100-2x8|all|reduce_scatter': [1, [["ring", 15, 16]], "c55031e27857fa46", [180080, 261920, 2228000, 84066080]],
    'p100-2x8|node0|allreduce': [1, [["ring", 14, 8]], "726def1e37e19ddb", [84179, 267501, 4671520, 187988819]],
    'p100-2x8|node0|allgather': [1, [["ring", 7, 8]], "141487040d5ef67c", [42090, 133750, 2335760, 93994410]],
    'p100-2x8|node0|reduce_scatter': [1, [["ring", 7, 8]], "141487040d5ef67c", [42090, 133750, 2335760, 93994410]],
    'p100-2x8|nodes01|allreduce':
        [1, [["ring", 30, 16], ["tree", 1, 2]], "75a021af1fdab9f7", [72085, 159381, 2256533, 89550485]],
    'p100-2x8|nodes01|allgather': [1, [["ring", 15, 16]], "c55031e27857fa46", [180080, 261920, 2228000, 84066080]],
    'p100-2x8|nodes01|reduce_scatter': [1, [["ring", 15, 16]], "c55031e27857fa46", [180080, 261920, 2228000, 84066080]],
    'p100-2x8|rail0|allreduce':
        [1, [["ring", 2, 2], ["tree", 1, 2]], "66aba1852d8a424b", [24085, 111381, 2208533, 89502485]],
    'p100-2x8|rail0|allgather': [1, [["ring", 1, 2]], "c7df28261b8c877e", [12043, 55691, 1104267, 44751243]],
    'p100-2x8|rail0|reduce_scatter': [1, [["ring", 1, 2]], "c7df28261b8c877e", [12043, 55691, 1104267, 44751243]],
    'p100-2x8|rail1|allreduce':
        [1, [["ring", 2, 2], ["tree", 1, 2]], "9d3421f913d2a268", [24085, 111381, 2208533, 89502485]],
    'p100-2x8|rail1|allgather': [1, [["ring", 1, 2]], "24d6737961d00335", [12043, 55691, 1104267, 44751243]],
    'p100-2x8|rail1|reduce_scatter': [1, [["ring", 1, 2]], "24d6737961d00335", [12043, 55691, 1104267, 44751243]],
    'p100-2x8|rail2|allreduce':
        [1, [["ring", 2, 2], ["tree", 1, 2]], "bb754847b9a549a1", [24085, 111381, 2208533, 89502485]],
    'p100-2x8|rail2|allgather': [1, [["ring", 1, 2]], "fc39ea45d5198cd4", [12043, 55691, 1104267, 44751243]],
    'p100-2x8|rail2|reduce_scatter': [1, [["ring", 1, 2]], "fc39ea45d5198cd4", [12043, 55691, 1104267, 44751243]],
    'p100-2x8|rail3|allreduce':
        [1, [["ring", 2, 2], ["tree", 1, 2]], "f2264a7c473a6b03", [24085, 111381, 2208533, 89502485]],
    'p100-2x8|rail3|allgather': [1, [["ring", 1, 2]], "7b15348ff0a547a0", [12043, 55691, 1104267, 44751243]],
    'p100-2x8|rail3|reduce_scatter': [1, [["ring", 1, 2]], "7b15348ff0a547a0", [12043, 55691, 1104267, 44751243]],
    'p100-2x8|rail4|allreduce':
        [1, [["ring", 2, 2], ["tree", 1, 2]], "e069ec23dc7ff51f", [24085, 111381, 2208533, 89502485]],
    'p100-2x8|rail4|allgather': [1, [["ring", 1, 2]], "d89a4dd0d06e8f3b", [12043, 55691, 1104267, 44751243]],
    'p100-2x8|rail4|reduce_scatter': [1, [["ring", 1, 2]], "d89a4dd0d06e8f3b", [12043, 55691, 1104267, 44751243]],
    'p100-2x8|rail5|allreduce':
        [1, [["ring", 2, 2], ["tree", 1, 2]], "e6200a26927c8a1c", [24085, 111381, 2208533, 89502485]],
    'p100-2x8|rail5|allgather': [1, [["ring", 1, 2]], "781b6fea9e07e4b8", [12043, 55691, 1104267, 44751243]],
    'p100-2x8|rail5|reduce_scatter': [1, [["ring", 1, 2]], "781b6fea9e07e4b8", [12043, 55691, 1104267, 44751243]],
    'p100-2x8|rail6|allreduce':
        [1, [["ring", 2, 2], ["tree", 1, 2]], "0b56460bef0e2ff8", [24085, 111381, 2208533, 89502485]],
    'p100-2x8|rail6|allgather': [1, [["ring", 1, 2]], "aa0438d36f6bd95e", [12043, 55691, 1104267, 44751243]],
    'p100-2x8|rail6|reduce_scatter': [1, [["ring", 1, 2]], "aa0438d36f6bd95e", [12043, 55691, 1104267, 44751243]],
    'p100-2x8|rail7|allreduce':
        [1, [["ring", 2, 2], ["tree", 1, 2]], "e613f698dd18a07c", [24085, 111381, 2208533, 89502485]],
    'p100-2x8|rail7|allgather': [1, [["ring", 1, 2]], "c6c5940151f7eb5b", [12043, 55691, 1104267, 44751243]],
    'p100-2x8|rail7|reduce_scatter': [1, [["ring", 1, 2]], "c6c5940151f7eb5b", [12043, 55691, 1104267, 44751243]],
    'p100-2x8|uneven|allreduce':
        [1, [["ring", 10, 6], ["tree", 1, 2]], "775beda24529e7b1", [42085, 129381, 2226533, 89520485]],
    'p100-2x8|uneven|allgather': [1, [["ring", 5, 6]], "68c3fd87a176829b", [60071, 132818, 1880444, 74625404]],
    'p100-2x8|uneven|reduce_scatter': [1, [["ring", 5, 6]], "68c3fd87a176829b", [60071, 132818, 1880444, 74625404]],
    'p100-2x8|random0|allreduce':
        [1, [["ring", 12, 7], ["tree", 1, 2]], "302f5892661a677b", [48102, 152858, 2669440, 107422182]],
    'p100-2x8|random0|allgather': [1, [["ring", 6, 7]], "1d02dc0241836cd6", [72073, 146898, 1944457, 76767845]],
    'p100-2x8|random0|reduce_scatter': [1, [["ring", 6, 7]], "1d02dc0241836cd6", [72073, 146898, 1944457, 76767845]],
    'p100-2x8|random1|allreduce':
        [1, [["ring", 12, 7], ["tree", 1, 2]], "f5ac85682446e5f7", [48085, 135381, 2232533, 89526485]],
    'p100-2x8|random1|allgather': [1, [["ring", 6, 7]], "4648e01fb9ea0532", [72073, 146898, 1944457, 76767845]],
    'p100-2x8|random1|reduce_scatter': [1, [["ring", 6, 7]], "4648e01fb9ea0532", [72073, 146898, 1944457, 76767845]],
    'p100-2x8|random2|allreduce':
        [1, [["ring", 14, 8], ["tree", 1, 2]], "ff93ad4fac2c7903", [54102, 158858, 2675440, 107428182]],
    'p100-2x8|random2|allgather': [1, [["ring", 7, 8]], "5570ff93c3787d06", [84075, 160459, 1995467, 78377675]],
    'p100-2x8|random2|reduce_scatter': [1, [["ring", 7, 8]], "5570ff93c3787d06", [84075, 160459, 1995467, 78377675]],
    'v100-3x6|all|allreduce':
        [1, [["ring", 34, 18], ["tree", 1, 2]], "560be0ad91754325", [84128, 215072, 3360800, 134301728]],
    'v100-3x6|all|allgather': [1, [["ring", 17, 18]], "9e0feceb10a6bf58", [204081, 286527, 2267170, 84711458]],
    'v100-3x6|all|reduce_scatter': [1, [["ring", 17, 18]], "9e0feceb10a6bf58", [204081, 286527, 2267170, 84711458]],
    'v100-3x6|node0|allreduce': [1, [["ring", 10, 6]], "1cdf216b63b92006", [60068, 129905, 1807627, 71642788]],
    'v100-3x6|node0|allgather': [1, [["ring", 5, 6]], "eb45690178225d56", [30034, 64953, 903813, 35821394]],
    'v100-3x6|node0|reduce_scatter': [1, [["ring", 5, 6]], "eb45690178225d56", [30034, 64953, 903813, 35821394]],
    'v100-3x6|nodes01|allreduce':
        [1, [["ring", 22, 12], ["tree", 1, 2]], "47950573ec2e9bc9", [60085, 147381, 2244533, 89538485]],
    'v100-3x6|nodes01|allgather': [1, [["ring", 11, 12]], "55d0afbbe5395c16", [132078, 212100, 2134489, 82153945]],
    'v100-3x6|nodes01|reduce_scatter': [1, [["ring", 11, 12]], "55d0afbbe5395c16", [132078, 212100, 2134489, 82153945]],
    'v100-3x6|rail0|allreduce':
        [1, [["ring", 4, 3], ["tree", 1, 2]], "ae4ceb9319bc8887", [48114, 164508, 2960711, 119352647]],
    'v100-3x6|rail0|allgather': [1, [["ring", 2, 3]], "85f8fb5bb15e73bc", [24057, 82254, 1480356, 59676324]],
    'v100-3x6|rail0|reduce_scatter': [1, [["ring", 2, 3]], "85f8fb5bb15e73bc", [24057, 82254, 1480356, 59676324]],
    'v100-3x6|rail1|allreduce':
        [1, [["ring", 4, 3], ["tree", 1, 2]], "31357a9fde42ab37", [48114, 164508, 2960711, 119352647]],
    'v100-3x6|rail1|allgather': [1, [["ring", 2, 3]], "da55a8405a1c09af", [24057, 82254, 1480356, 59676324]],
    'v100-3x6|rail1|reduce_scatter': [1, [["ring", 2, 3]], "da55a8405a1c09af", [24057, 82254, 1480356, 59676324]],
    'v100-3x6|rail2|allreduce':
        [1, [["ring", 4, 3], ["tree", 1, 2]], "5ed22bdae365a331", [48114, 164508, 2960711, 119352647]],
    'v100-3x6|rail2|allgather': [1, [["ring", 2, 3]], "c66aaeaf7d61b3f1", [24057, 82254, 1480356, 59676324]],
    'v100-3x6|rail2|reduce_scatter': [1, [["ring", 2, 3]], "c66aaeaf7d61b3f1", [24057, 82254, 1480356, 59676324]],
    'v100-3x6|rail3|allreduce':
        [1, [["ring", 4, 3], ["tree", 1, 2]], "598dbd54af565905", [48114, 164508, 2960711, 119352647]],
    'v100-3x6|rail3|allgather': [1, [["ring", 2, 3]], "4990296c9deecbb5", [24057, 82254, 1480356, 59676324]],
    'v100-3x6|rail3|reduce_scatter': [1, [["ring", 2, 3]], "4990296c9deecbb5", [24057, 82254, 1480356, 59676324]],
    'v100-3x6|rail4|allreduce':
        [1, [["ring", 4, 3], ["tree", 1, 2]], "b7935522861863d0", [48114, 164508, 2960711, 119352647]],
    'v100-3x6|rail4|allgather': [1, [["ring", 2, 3]], "d8be2d2fcf61aac5", [24057, 82254, 1480356, 59676324]],
    'v100-3x6|rail4|reduce_scatter': [1, [["ring", 2, 3]], "d8be2d2fcf61aac5", [24057, 82254, 1480356, 59676324]],
    'v100-3x6|rail5|allreduce':
        [1, [["ring", 4, 3], ["tree", 1, 2]], "f978d206c9431e73", [48114, 164508, 2960711, 119352647]],
    'v100-3x6|rail5|allgather': [1, [["ring", 2, 3]], "b875caa50f1c1db7", [24057, 82254, 1480356, 59676324]],
    'v100-3x6|rail5|reduce_scatter': [1, [["ring", 2, 3]], "b875caa50f1c1db7", [24057, 82254, 1480356, 59676324]],
    'v100-3x6|uneven|allreduce':
        [1, [["ring", 10, 6], ["tree", 1, 2]], "73baa8cdf189d941", [54128, 185072, 3330800, 134271728]],
    'v100-3x6|uneven|allgather': [1, [["ring", 5, 6]], "d3d63cdf91d851e2", [60071, 132818, 1880444, 74625404]],
    'v100-3x6|uneven|reduce_scatter': [1, [["ring", 5, 6]], "d3d63cdf91d851e2", [60071, 132818, 1880444, 74625404]],
    'v100-3x6|random0|allreduce':
        [1, [["ring", 22, 12], ["tree", 1, 2]], "153a067017ec229d", [78128, 209072, 3354800, 134295728]],
    'v100-3x6|random0|allgather': [1, [["ring", 11, 12]], "204132095aab67d3", [132078, 212100, 2134489, 82153945]],
    'v100-3x6|random0|reduce_scatter': [1, [["ring", 11, 12]], "204132095aab67d3", [132078, 212100, 2134489, 82153945]],
    'v100-3x6|random1|allreduce':
        [1, [["ring", 6, 4], ["tree", 1, 2]], "500fca35c08d5e42", [30085, 117381, 2214533, 89508485]],
    'v100-3x6|random1|allgather': [1, [["ring", 3, 4]], "4017a8f56d230a56", [36064, 101536, 1674400, 67144864]],
    'v100-3x6|random1|reduce_scatter': [1, [["ring", 3, 4]], "4017a8f56d230a56", [36064, 101536, 1674400, 67144864]],
    'v100-3x6|random2|allreduce':
        [1, [["ring", 6, 4], ["tree", 1, 2]], "1d1356a256cf54b8", [42085, 129381, 2226533, 89520485]],
    'v100-3x6|random2|allgather': [1, [["ring", 3, 4]], "7dc69b6f2be6c709", [36064, 101536, 1674400, 67144864]],
    'v100-3x6|random2|reduce_scatter': [1, [["ring", 3, 4]], "7dc69b6f2be6c709", [36064, 101536, 1674400, 67144864]],
    'k80-16x4|all|allreduce':
        [1, [["ring", 126, 64], ["tree", 1, 2]], "703078bb2e1ce929", [236293, 535593, 7725829, 304761888]],
    'k80-16x4|all|allgather': [1, [["ring", 63, 64]], "a3eea7da376ee81a", [1386144, 1533456, 5072400, 152380944]],
    'k80-16x4|all|reduce_scatter': [1, [["ring", 63, 64]], "a3eea7da376ee81a", [1386144, 1533456, 5072400, 152380944]],
    'k80-16x4|node0|allreduce': [1, [["ring", 6, 4]], "3a17ee258a02542b", [60128, 191072, 3336800, 134277728]],
    'k80-16x4|node0|allgather': [1, [["ring", 3, 4]], "1a4a75abe6e24287", [30064, 95536, 1668400, 67138864]],
    'k80-16x4|node0|reduce_scatter': [1, [["ring", 3, 4]], "1a4a75abe6e24287", [30064, 95536, 1668400, 67138864]],
    'k80-16x4|nodes01|allreduce':
        [1, [["ring", 14, 8], ["tree", 1, 2]], "1c9532b5d63c5a2f", [104171, 278763, 4473067, 179060971]],
    'k80-16x4|nodes01|allgather': [1, [["ring", 7, 8]], "ad7d8c4500efbc26", [154128, 285072, 3430800, 134371728]],
    'k80-16x4|nodes01|reduce_scatter': [1, [["ring", 7, 8]], "ad7d8c4500efbc26", [154128, 285072, 3430800, 134371728]],
    'k80-16x4|rail0|allreduce':
        [1, [["ring", 30, 16], ["tree", 1, 2]], "592b271a4a60b189", [176293, 475593, 7665829, 288269417]],
    'k80-16x4|rail0|allgather': [1, [["ring", 15, 16]], "8913bc702db9eefd", [330137, 470434, 3840857, 144134709]],
    'k80-16x4|rail0|reduce_scatter': [1, [["ring", 15, 16]], "8913bc702db9eefd", [330137, 470434, 3840857, 144134709]],
    'k80-16x4|rail1|allreduce':
        [1, [["ring", 30, 16], ["tree", 1, 2]], "f7c16986e7a9e2e5", [176293, 475593, 7665829, 288269417]],
    'k80-16x4|rail1|allgather': [1, [["ring", 15, 16]], "1950bdc4bd9e2c84", [330137, 470434, 3840857, 144134709]],
    'k80-16x4|rail1|reduce_scatter': [1, [["ring", 15, 16]], "1950bdc4bd9e2c84", [330137, 470434, 3840857, 144134709]],
    'k80-16x4|rail2|allreduce':
        [1, [["ring", 30, 16], ["tree", 1, 2]], "cdf9b1fb4a9100cc", [176293, 475593, 7665829, 288269417]],
    'k80-16x4|rail2|allgather': [1, [["ring", 15, 16]], "e2e61bcd7fa96a9a", [330137, 470434, 3840857, 144134709]],
    'k80-16x4|rail2|reduce_scatter': [1, [["ring", 15, 16]], "e2e61bcd7fa96a9a", [330137, 470434, 3840857, 144134709]],
    'k80-16x4|rail3|allreduce':
        [1, [["ring", 30, 16], ["tree", 1, 2]], "5a94efc9060f3451", [176293, 475593, 7665829, 288269417]],
    'k80-16x4|rail3|allgather': [1, [["ring", 15, 16]], "3dd1a3bc51cec64f", [330137, 470434, 3840857, 144134709]],
    'k80-16x4|rail3|reduce_scatter': [1, [["ring", 15, 16]], "3dd1a3bc51cec64f", [330137, 470434, 3840857, 144134709]],
    'k80-16x4|uneven|allreduce':
        [1, [["ring", 10, 6], ["tree", 1, 2]], "f914755a9f4b85b3", [108219, 332695, 5725371, 230195534]],
    'k80-16x4|uneven|allgather': [1, [["ring", 5, 6]], "b4c72b3f9be518c7", [110122, 234830, 3230762, 127936408]],
    'k80-16x4|uneven|reduce_scatter': [1, [["ring", 5, 6]], "b4c72b3f9be518c7", [110122, 234830, 3230762, 127936408]],
    'k80-16x4|random0|allreduce':
        [1, [["ring", 42, 22], ["tree", 1, 2]], "9f1773ac9793f5f0", [216293, 515593, 7705829, 293762679]],
    'k80-16x4|random0|allgather': [1, [["ring", 21, 22]], "82b5e0d40bbad80a", [462140, 604988, 4036691, 146881340]],
    'k80-16x4|random0|reduce_scatter':
        [1, [["ring", 21, 22]], "82b5e0d40bbad80a", [462140, 604988, 4036691, 146881340]],
    'k80-16x4|random1|allreduce':
        [1, [["ring", 8, 5], ["tree", 1, 2]], "fa3b476f8e5e9daa", [108293, 407593, 6167863, 245602703]],
    'k80-16x4|random1|allgather': [1, [["ring", 4, 5]], "f4434af6a5ea1710", [88117, 207837, 3083931, 122801351]],
    'k80-16x4|random1|reduce_scatter': [1, [["ring", 4, 5]], "f4434af6a5ea1710", [88117, 207837, 3083931, 122801351]],
    'k80-16x4|random2|allreduce':
        [1, [["ring", 126, 64], ["tree", 1, 2]], "703078bb2e1ce929", [236293, 535593, 7725829, 304761888]],
    'k80-16x4|random2|allgather': [1, [["ring", 63, 64]], "a3eea7da376ee81a", [1386144, 1533456, 5072400, 152380944]],
    'k80-16x4|random2|reduce_scatter':
        [1, [["ring", 63, 64]], "a3eea7da376ee81a", [1386144, 1533456, 5072400, 152380944]],
    'a100-4x8|all|allreduce':
        [8, [["ring", 62, 256], ["tree", 1, 16]], "c8832a01e14343e5", [90011, 100923, 363067, 11274811]],
    'a100-4x8|all|allgather': [8, [["ring", 31, 256]], "8bbcac5805e72921", [372005, 377291, 504267, 5789643]],
    'a100-4x8|all|reduce_scatter': [8, [["ring", 31, 256]], "8bbcac5805e72921", [372005, 377291, 504267, 5789643]],
    'a100-4x8|node0|allreduce': [1, [["ring", 14, 8]], "b2af47a537bd7293", [42006, 48117, 194917, 6305494]],
    'a100-4x8|node0|allgather': [1, [["ring", 7, 8]], "a999b2a21f2abf15", [21003, 24058, 97459, 3152747]],
    'a100-4x8|node0|reduce_scatter': [1, [["ring", 7, 8]], "a999b2a21f2abf15", [21003, 24058, 97459, 3152747]],
    'a100-4x8|nodes01|allreduce':
        [8, [["ring", 30, 128], ["tree", 1, 16]], "93d4a3e2d9fbdec4", [66006, 72117, 218917, 6329494]],
    'a100-4x8|nodes01|allgather': [8, [["ring", 15, 128]], "b1e1b55ea2c989fc", [180005, 185120, 308000, 5422880]],
    'a100-4x8|nodes01|reduce_scatter': [8, [["ring", 15, 128]], "b1e1b55ea2c989fc", [180005, 185120, 308000, 5422880]],
    'a100-4x8|rail0|allreduce':
        [1, [["ring", 6, 4], ["tree", 1, 2]], "f89a374c6c9518b9", [48085, 135381, 1710400, 67180864]],
    'a100-4x8|rail0|allgather': [1, [["ring", 3, 4]], "ddd7d66aae341ff0", [36032, 68768, 855200, 33590432]],
    'a100-4x8|rail0|reduce_scatter': [1, [["ring", 3, 4]], "ddd7d66aae341ff0", [36032, 68768, 855200, 33590432]],
    'a100-4x8|rail1|allreduce':
        [1, [["ring", 6, 4], ["tree", 1, 2]], "cd60fcb09bd0ca86", [48085, 135381, 1710400, 67180864]],
    'a100-4x8|rail1|allgather': [1, [["ring", 3, 4]], "33b27f6dd26e8a9b", [36032, 68768, 855200, 33590432]],
    'a100-4x8|rail1|reduce_scatter': [1, [["ring", 3, 4]], "33b27f6dd26e8a9b", [36032, 68768, 855200, 33590432]],
    'a100-4x8|rail2|allreduce':
        [1, [["ring", 6, 4], ["tree", 1, 2]], "b586916c9b035e60", [48085, 135381, 1710400, 67180864]],
    'a100-4x8|rail2|allgather': [1, [["ring", 3, 4]], "8fce54fd7fc09070", [36032, 68768, 855200, 33590432]],
    'a100-4x8|rail2|reduce_scatter': [1, [["ring", 3, 4]], "8fce54fd7fc09070", [36032, 68768, 855200, 33590432]],
    'a100-4x8|rail3|allreduce':
        [1, [["ring", 6, 4], ["tree", 1, 2]], "8c97a4af95bc68f8", [48085, 135381, 1710400, 67180864]],
    'a100-4x8|rail3|allgather': [1, [["ring", 3, 4]], "20739337d6c7e214", [36032, 68768, 855200, 33590432]],
    'a100-4x8|rail3|reduce_scatter': [1, [["ring", 3, 4]], "20739337d6c7e214", [36032, 68768, 855200, 33590432]],
    'a100-4x8|rail4|allreduce':
        [1, [["ring", 6, 4], ["tree", 1, 2]], "4221dc93c0018c01", [48085, 135381, 1710400, 67180864]],
    'a100-4x8|rail4|allgather': [1, [["ring", 3, 4]], "aeac6d1a721e93af", [36032, 68768, 855200, 33590432]],
    'a100-4x8|rail4|reduce_scatter': [1, [["ring", 3, 4]], "aeac6d1a721e93af", [36032, 68768, 855200, 33590432]],
    'a100-4x8|rail5|allreduce':
        [1, [["ring", 6, 4], ["tree", 1, 2]], "987290ddd8e59856", [48085, 135381, 1710400, 67180864]],
    'a100-4x8|rail5|allgather': [1, [["ring", 3, 4]], "2bfa1918964933b9", [36032, 68768, 855200, 33590432]],
    'a100-4x8|rail5|reduce_scatter': [1, [["ring", 3, 4]], "2bfa1918964933b9", [36032, 68768, 855200, 33590432]],
    'a100-4x8|rail6|allreduce':
        [1, [["ring", 6, 4], ["tree", 1, 2]], "8cbea4c6bab45a7a", [48085, 135381, 1710400, 67180864]],
    'a100-4x8|rail6|allgather': [1, [["ring", 3, 4]], "c0970c5f63dc29d1", [36032, 68768, 855200, 33590432]],
    'a100-4x8|rail6|reduce_scatter': [1, [["ring", 3, 4]], "c0970c5f63dc29d1", [36032, 68768, 855200, 33590432]],
    'a100-4x8|rail7|allreduce':
        [1, [["ring", 6, 4], ["tree", 1, 2]], "af16bd5af98df849", [48085, 135381, 1710400, 67180864]],
    'a100-4x8|rail7|allgather': [1, [["ring", 3, 4]], "f8a050055aa7a471", [36032, 68768, 855200, 33590432]],
    'a100-4x8|rail7|reduce_scatter': [1, [["ring", 3, 4]], "f8a050055aa7a471", [36032, 68768, 855200, 33590432]],
    'a100-4x8|uneven|allreduce':
        [1, [["ring", 10, 6], ["tree", 1, 2]], "b2a07f0aa3f6d5c8", [54064, 119536, 1692400, 67162864]],
    'a100-4x8|uneven|allgather': [1, [["ring", 5, 6]], "f94389c11ad8697e", [60036, 96409, 970222, 37342702]],
    'a100-4x8|uneven|reduce_scatter': [1, [["ring", 5, 6]], "f94389c11ad8697e", [60036, 96409, 970222, 37342702]],
    'a100-4x8|random0|allreduce':
        [2, [["ring", 22, 24], ["tree", 1, 4]], "0f8b3d9761557c0a", [66043, 109691, 1158267, 41274972]],
    'a100-4x8|random0|allgather': [2, [["ring", 11, 24]], "3aa8f76b57259ba2", [132020, 152025, 632622, 20637486]],
    'a100-4x8|random0|reduce_scatter': [2, [["ring", 11, 24]], "3aa8f76b57259ba2", [132020, 152025, 632622, 20637486]],
    'a100-4x8|random1|allreduce':
        [1, [["ring", 14, 8], ["tree", 1, 2]], "d9d58756e0be1d13", [66085, 153381, 2079467, 78461675]],
    'a100-4x8|random1|allgather': [1, [["ring", 7, 8]], "3a5175515b0ee513", [84037, 122229, 1039733, 39230837]],
    'a100-4x8|random1|reduce_scatter': [1, [["ring", 7, 8]], "3a5175515b0ee513", [84037, 122229, 1039733, 39230837]],
    'a100-4x8|random2|allreduce':
        [1, [["ring", 28, 15], ["tree", 1, 2]], "72988c20b0b01277", [78085, 165381, 2262533, 83849253]],
    'a100-4x8|random2|allgather': [1, [["ring", 14, 15]], "98fcb2fcece9782e", [168040, 208778, 1187449, 41924626]],
    'a100-4x8|random2|reduce_scatter': [1, [["ring", 14, 15]], "98fcb2fcece9782e", [168040, 208778, 1187449, 41924626]],
    'a100-8x8|all|allreduce':
        [8, [["ring", 126, 512], ["tree", 1, 16]], "d3c23da1dd6b44fd", [114011, 124923, 387067, 11298811]],
    'a100-8x8|all|allgather': [8, [["ring", 63, 512]], "8bf60a590679018e", [756005, 761376, 890400, 6261024]],
    'a100-8x8|all|reduce_scatter': [8, [["ring", 63, 512]], "8bf60a590679018e", [756005, 761376, 890400, 6261024]],
    'a100-8x8|node0|allreduce': [1, [["ring", 14, 8]], "2daf18b6efb33303", [42006, 48117, 194917, 6305494]],
    'a100-8x8|node0|allgather': [1, [["ring", 7, 8]], "94167f75052b01a7", [21003, 24058, 97459, 3152747]],
    'a100-8x8|node0|reduce_scatter': [1, [["ring", 7, 8]], "94167f75052b01a7", [21003, 24058, 97459, 3152747]],
    'a100-8x8|nodes01|allreduce':
        [8, [["ring", 30, 128], ["tree", 1, 16]], "c210d4b1fed819cf", [66006, 72117, 218917, 6329494]],
    'a100-8x8|nodes01|allgather': [8, [["ring", 15, 128]], "fdd1eb7b3120bd87", [180005, 185120, 308000, 5422880]],
    'a100-8x8|nodes01|reduce_scatter': [8, [["ring", 15, 128]], "fdd1eb7b3120bd87", [180005, 185120, 308000, 5422880]],
    'a100-8x8|rail0|allreduce':
        [1, [["ring", 14, 8], ["tree", 1, 2]], "cb17822cd4657521", [72085, 159381, 2079467, 78461675]],
    'a100-8x8|rail0|allgather': [1, [["ring", 7, 8]], "649f64d8119ddeb9", [84037, 122229, 1039733, 39230837]],
    'a100-8x8|rail0|reduce_scatter': [1, [["ring", 7, 8]], "649f64d8119ddeb9", [84037, 122229, 1039733, 39230837]],
    'a100-8x8|rail1|allreduce':
        [1, [["ring", 14, 8], ["tree", 1, 2]], "640f2c9defb3adf0", [72085, 159381, 2079467, 78461675]],
    'a100-8x8|rail1|allgather': [1, [["ring", 7, 8]], "57f17ec0e21ac4f2", [84037, 122229, 1039733, 39230837]],
    'a100-8x8|rail1|reduce_scatter': [1, [["ring", 7, 8]], "57f17ec0e21ac4f2", [84037, 122229, 1039733, 39230837]],
    'a100-8x8|rail2|allreduce':
        [1, [["ring", 14, 8], ["tree", 1, 2]], "5ebe57a04cbdcb49", [72085, 159381, 2079467, 78461675]],
    'a100-8x8|rail2|allgather': [1, [["ring", 7, 8]], "c7b07b282294bb93", [84037, 122229, 1039733, 39230837]],
    'a100-8x8|rail2|reduce_scatter': [1, [["ring", 7, 8]], "c7b07b282294bb93", [84037, 122229, 1039733, 39230837]],
    'a100-8x8|rail3|allreduce':
        [1, [["ring", 14, 8], ["tree", 1, 2]], "98e8440b6b5ad1a9", [72085, 159381, 2079467, 78461675]],
    'a100-8x8|rail3|allgather': [1, [["ring", 7, 8]], "92a5fbbbae9e50c9", [84037, 122229, 1039733, 39230837]],
    'a100-8x8|rail3|reduce_scatter': [1, [["ring", 7, 8]], "92a5fbbbae9e50c9", [84037, 122229, 1039733, 39230837]],
    'a100-8x8|rail4|allreduce':
        [1, [["ring", 14, 8], ["tree", 1, 2]], "4126dff42bf9376d", [72085, 159381, 2079467, 78461675]],
    'a100-8x8|rail4|allgather': [1, [["ring", 7, 8]], "477dd2c983df32d8", [84037, 122229, 1039733, 39230837]],
    'a100-8x8|rail4|reduce_scatter': [1, [["ring", 7, 8]], "477dd2c983df32d8", [84037, 122229, 1039733, 39230837]],
    'a100-8x8|rail5|allreduce':
        [1, [["ring", 14, 8], ["tree", 1, 2]], "d7f60d144700c45d", [72085, 159381, 2079467, 78461675]],
    'a100-8x8|rail5|allgather': [1, [["ring", 7, 8]], "5bc2b9fb85fa9409", [84037, 122229, 1039733, 39230837]],
    'a100-8x8|rail5|reduce_scatter': [1, [["ring", 7, 8]], "5bc2b9fb85fa9409", [84037, 122229, 1039733, 39230837]],
    'a100-8x8|rail6|allreduce':
        [1, [["ring", 14, 8], ["tree", 1, 2]], "19b827de407608a2", [72085, 159381, 2079467, 78461675]],
    'a100-8x8|rail6|allgather': [1, [["ring", 7, 8]], "4db08dc264afd7aa", [84037, 122229, 1039733, 39230837]],
    'a100-8x8|rail6|reduce_scatter': [1, [["ring", 7, 8]], "4db08dc264afd7aa", [84037, 122229, 1039733, 39230837]],
    'a100-8x8|rail7|allreduce':
        [1, [["ring", 14, 8], ["tree", 1, 2]], "5b8f17d6db7ba20d", [72085, 159381, 2079467, 78461675]],
    'a100-8x8|rail7|allgather': [1, [["ring", 7, 8]], "f77ca51299887efa", [84037, 122229, 1039733, 39230837]],
    'a100-8x8|rail7|reduce_scatter': [1, [["ring", 7, 8]], "f77ca51299887efa", [84037, 122229, 1039733, 39230837]],
    'a100-8x8|uneven|allreduce':
        [1, [["ring", 10, 6], ["tree", 1, 2]], "5137229bb25f66d9", [54064, 119536, 1692400, 67162864]],
    'a100-8x8|uneven|allgather': [1, [["ring", 5, 6]], "2442e9fc5a74c27b", [60036, 96409, 970222, 37342702]],
    'a100-8x8|uneven|reduce_scatter': [1, [["ring", 5, 6]], "2442e9fc5a74c27b", [60036, 96409, 970222, 37342702]],
    'a100-8x8|random0|allreduce':
        [1, [["ring", 42, 22], ["tree", 1, 2]], "e54273174137f695", [96085, 183381, 2280533, 85915281]],
    'a100-8x8|random0|allgather': [1, [["ring", 21, 22]], "6e410e4dba5b97da", [252041, 293705, 1294618, 42957641]],
    'a100-8x8|random0|reduce_scatter': [1, [["ring", 21, 22]], "6e410e4dba5b97da", [252041, 293705, 1294618, 42957641]],
    'a100-8x8|random1|allreduce':
        [1, [["ring", 8, 5], ["tree", 1, 2]], "7b46ca21e6236064", [54085, 141381, 1843627, 71678788]],
    'a100-8x8|random1|allgather': [1, [["ring", 4, 5]], "2859a0e3b016db05", [48034, 82953, 921813, 35839394]],
    'a100-8x8|random1|reduce_scatter': [1, [["ring", 4, 5]], "2859a0e3b016db05", [48034, 82953, 921813, 35839394]],
    'a100-8x8|random2|allreduce':
        [8, [["ring", 126, 512], ["tree", 1, 16]], "d3c23da1dd6b44fd", [114011, 124923, 387067, 11298811]],
    'a100-8x8|random2|allgather': [8, [["ring", 63, 512]], "8bf60a590679018e", [756005, 761376, 890400, 6261024]],
    'a100-8x8|random2|reduce_scatter': [8, [["ring", 63, 512]], "8bf60a590679018e", [756005, 761376, 890400, 6261024]],
    'h100-3x8|all|allreduce':
        [8, [["ring", 46, 192], ["tree", 1, 16]], "601efee2e2ade3d4", [90004, 94096, 192400, 4284304]],
    'h100-3x8|all|allgather': [8, [["ring", 23, 192]], "e17588db60d5d7ce", [276003, 278617, 341422, 2955694]],
    'h100-3x8|all|reduce_scatter': [8, [["ring", 23, 192]], "e17588db60d5d7ce", [276003, 278617, 341422, 2955694]],
    'h100-3x8|node0|allreduce': [1, [["ring", 14, 8]], "a89c624c2736ec77", [42004, 46078, 143945, 4217663]],
    'h100-3x8|node0|allgather': [1, [["ring", 7, 8]], "6471a8e1e135acbb", [21002, 23039, 71972, 2108831]],
    'h100-3x8|node0|reduce_scatter': [1, [["ring", 7, 8]], "6471a8e1e135acbb", [21002, 23039, 71972, 2108831]],
    'h100-3x8|nodes01|allreduce':
        [8, [["ring", 30, 128], ["tree", 1, 16]], "1ec9bb5987154c45", [66004, 70078, 167945, 4241663]],
    'h100-3x8|nodes01|allgather': [8, [["ring", 15, 128]], "2c7d6d5662d7f47b", [180002, 182560, 244000, 2801440]],
    'h100-3x8|nodes01|reduce_scatter': [8, [["ring", 15, 128]], "2c7d6d5662d7f47b", [180002, 182560, 244000, 2801440]],
    'h100-3x8|rail0|allreduce':
        [1, [["ring", 4, 3], ["tree", 1, 2]], "462a919a8cd6550f", [48028, 77127, 776178, 29874162]],
    'h100-3x8|rail0|allgather': [1, [["ring", 2, 3]], "e5288d33ec8b2dd3", [24014, 38564, 388089, 14937081]],
    'h100-3x8|rail0|reduce_scatter': [1, [["ring", 2, 3]], "e5288d33ec8b2dd3", [24014, 38564, 388089, 14937081]],
    'h100-3x8|rail1|allreduce':
        [1, [["ring", 4, 3], ["tree", 1, 2]], "cff072811fa185c8", [48028, 77127, 776178, 29874162]],
    'h100-3x8|rail1|allgather': [1, [["ring", 2, 3]], "d9f76caea6685679", [24014, 38564, 388089, 14937081]],
    'h100-3x8|rail1|reduce_scatter': [1, [["ring", 2, 3]], "d9f76caea6685679", [24014, 38564, 388089, 14937081]],
    'h100-3x8|rail2|allreduce':
        [1, [["ring", 4, 3], ["tree", 1, 2]], "407a97167e4775c3", [48028, 77127, 776178, 29874162]],
    'h100-3x8|rail2|allgather': [1, [["ring", 2, 3]], "710fb1635bf5c7ce", [24014, 38564, 388089, 14937081]],
    'h100-3x8|rail2|reduce_scatter': [1, [["ring", 2, 3]], "710fb1635bf5c7ce", [24014, 38564, 388089, 14937081]],
    'h100-3x8|rail3|allreduce':
        [1, [["ring", 4, 3], ["tree", 1, 2]], "20607db90f579489", [48028, 77127, 776178, 29874162]],
    'h100-3x8|rail3|allgather': [1, [["ring", 2, 3]], "3f736acbd3cbb23f", [24014, 38564, 388089, 14937081]],
    'h100-3x8|rail3|reduce_scatter': [1, [["ring", 2, 3]], "3f736acbd3cbb23f", [24014, 38564, 388089, 14937081]],
    'h100-3x8|rail4|allreduce':
        [1, [["ring", 4, 3], ["tree", 1, 2]], "7a0660b0211d5c53", [48028, 77127, 776178, 29874162]],
    'h100-3x8|rail4|allgather': [1, [["ring", 2, 3]], "2943c1984d501cef", [24014, 38564, 388089, 14937081]],
    'h100-3x8|rail4|reduce_scatter': [1, [["ring", 2, 3]], "2943c1984d501cef", [24014, 38564, 388089, 14937081]],
    'h100-3x8|rail5|allreduce':
        [1, [["ring", 4, 3], ["tree", 1, 2]], "58ee9cd36ad3409b", [48028, 77127, 776178, 29874162]],
    'h100-3x8|rail5|allgather': [1, [["ring", 2, 3]], "8a3b2049270f1768", [24014, 38564, 388089, 14937081]],
    'h100-3x8|rail5|reduce_scatter': [1, [["ring", 2, 3]], "8a3b2049270f1768", [24014, 38564, 388089, 14937081]],
    'h100-3x8|rail6|allreduce':
        [1, [["ring", 4, 3], ["tree", 1, 2]], "33455b5e5555f4e1", [48028, 77127, 776178, 29874162]],
    'h100-3x8|rail6|allgather': [1, [["ring", 2, 3]], "f4e387d4398a65db", [24014, 38564, 388089, 14937081]],
    'h100-3x8|rail6|reduce_scatter': [1, [["ring", 2, 3]], "f4e387d4398a65db", [24014, 38564, 388089, 14937081]],
    'h100-3x8|rail7|allreduce':
        [1, [["ring", 4, 3], ["tree", 1, 2]], "787b4b6249d198ec", [48028, 77127, 776178, 29874162]],
    'h100-3x8|rail7|allgather': [1, [["ring", 2, 3]], "0a6bf4e9ea90fea5", [24014, 38564, 388089, 14937081]],
    'h100-3x8|rail7|reduce_scatter': [1, [["ring", 2, 3]], "0a6bf4e9ea90fea5", [24014, 38564, 388089, 14937081]],
    'h100-3x8|uneven|allreduce':
        [1, [["ring", 10, 6], ["tree", 1, 2]], "e2f8b3e02d009bb7", [54032, 86768, 873200, 33608432]],
    'h100-3x8|uneven|allgather': [1, [["ring", 5, 6]], "cd4dc2f182a87e81", [60018, 78204, 515111, 18701351]],
    'h100-3x8|uneven|reduce_scatter': [1, [["ring", 5, 6]], "cd4dc2f182a87e81", [60018, 78204, 515111, 18701351]],
    'h100-3x8|random0|allreduce':
        [4, [["ring", 22, 48], ["tree", 1, 8]], "e56d052dbc1452e4", [66008, 74192, 270800, 8454608]],
    'h100-3x8|random0|allgather': [4, [["ring", 11, 48]], "91c8f3ba9cfc92ea", [132005, 137006, 257156, 5258372]],
    'h100-3x8|random0|reduce_scatter': [4, [["ring", 11, 48]], "91c8f3ba9cfc92ea", [132005, 137006, 257156, 5258372]],
    'h100-3x8|random1|allreduce':
        [1, [["ring", 4, 3], ["tree", 1, 2]], "df0d3cd0cd6aaded", [30021, 51845, 576133, 22399621]],
    'h100-3x8|random1|allgather': [1, [["ring", 2, 3]], "5a44ce3bc99c3cc9", [24014, 38564, 388089, 14937081]],
    'h100-3x8|random1|reduce_scatter': [1, [["ring", 2, 3]], "5a44ce3bc99c3cc9", [24014, 38564, 388089, 14937081]],
    'h100-3x8|random2|allreduce':
        [1, [["ring", 6, 4], ["tree", 1, 2]], "b4ef53ce51ed868b", [54032, 86768, 873200, 33608432]],
    'h100-3x8|random2|allgather': [1, [["ring", 3, 4]], "b824350d22b85954", [36016, 52384, 445600, 16813216]],
    'h100-3x8|random2|reduce_scatter': [1, [["ring", 3, 4]], "b824350d22b85954", [36016, 52384, 445600, 16813216]],
    'a100-1x8|all|allreduce': [1, [["ring", 14, 8]], "fa0d9c6b7fccc9c4", [42006, 48117, 194917, 6305494]],
    'a100-1x8|all|allgather': [1, [["ring", 7, 8]], "9e0708d8df6d5b11", [21003, 24058, 97459, 3152747]],
    'a100-1x8|all|reduce_scatter': [1, [["ring", 7, 8]], "9e0708d8df6d5b11", [21003, 24058, 97459, 3152747]],
    'a100-1x8|node0|allreduce': [1, [["ring", 14, 8]], "fa0d9c6b7fccc9c4", [42006, 48117, 194917, 6305494]],
    'a100-1x8|node0|allgather': [1, [["ring", 7, 8]], "9e0708d8df6d5b11", [21003, 24058, 97459, 3152747]],
    'a100-1x8|node0|reduce_scatter': [1, [["ring", 7, 8]], "9e0708d8df6d5b11", [21003, 24058, 97459, 3152747]],
    'a100-1x8|random0|allreduce': [1, [["ring", 6, 4]], "8f14da5ae7048cfb", [18005, 23243, 149072, 5386709]],
    'a100-1x8|random0|allgather': [1, [["ring", 3, 4]], "d75b1ea49b450a41", [9003, 11621, 74536, 2693355]],
    'a100-1x8|random0|reduce_scatter': [1, [["ring", 3, 4]], "d75b1ea49b450a41", [9003, 11621, 74536, 2693355]],
    'a100-1x8|random1|allreduce': [1, [["ring", 2, 2]], "543c7b4d657ef1b3", [6003, 9495, 93381, 3585139]],
    'a100-1x8|random1|allgather': [1, [["ring", 1, 2]], "4b9acc5e1437fc45", [3002, 4748, 46691, 1792570]],
    'a100-1x8|random1|reduce_scatter': [1, [["ring", 1, 2]], "4b9acc5e1437fc45", [3002, 4748, 46691, 1792570]],
    'a100-1x8|random2|allreduce': [1, [["ring", 10, 6]], "876f94d769126646", [30006, 35825, 175636, 5995232]],
    'a100-1x8|random2|allgather': [1, [["ring", 5, 6]], "a450d5bd3032c2fb", [15003, 17913, 87818, 2997616]],
    'a100-1x8|random2|reduce_scatter': [1, [["ring", 5, 6]], "a450d5bd3032c2fb", [15003, 17913, 87818, 2997616]],
}


@pytest.mark.parametrize("name", PRESETS)
def test_routes_equal_one_networkx_search_per_pair(name):
    topo = load_topology(name)
    n = topo.num_devices
    pairs = [(a, b) for a in range(n) for b in range(n)] if n <= 32 else \
        random.Random(1).sample([(a, b) for a in range(n) for b in range(n)], 600)
    for a, b in pairs:
        assert topo.route(a, b) == reference_route(topo, a, b), (name, a, b)


def test_routes_with_ties_fall_back_to_the_whole_graph():
    """A DGX-1 cube-mesh node has two equally short routes between GPUs 0 and 5 (through 1 or 4): the route
    is networkx's choice on the whole graph, as before."""
    topo = load_topology("v100-4x8")
    for a, b in [(0, 5), (3, 4), (5, 0), (8 + 3, 8 + 4), (2, 31)]:
        assert topo.route(a, b) == reference_route(topo, a, b)


def test_routes_of_a_topology_file_with_one_way_links(tmp_path):
    """A file may give links one way only: a directed ring of four GPUs plus a shared switch."""
    doc = {"format": "soapflow.topology/1", "name": "oneway",
           "devices": [{"id": i, "kind": "v100", "node": 0} for i in range(4)],
           "links": [{"src": f"gpu{i}", "dst": f"gpu{(i + 1) % 4}", "kind": "nvlink", "bandwidth_gbps": 20,
                      "latency_us": 1 + i, "bidirectional": False} for i in range(4)]
           + [{"src": "gpu0", "dst": "sw", "kind": "pcie", "bandwidth_gbps": 10, "latency_us": 5},
              {"src": "gpu2", "dst": "sw", "kind": "pcie", "bandwidth_gbps": 10, "latency_us": 1}]}
    topo = DeviceTopology.from_dict(doc)
    for a in range(4):
        for b in range(4):
            assert topo.route(a, b) == reference_route(topo, a, b), (a, b)


def test_routes_of_random_topology_files():
    """Random small machines (devices, switches, some links one way, few distinct latencies so that paths
    tie, bridges and cycles alike): every route equals the networkx search over the whole graph."""
    rng = random.Random(3)
    built = 0
    for _ in range(200):
        n, num_switches = rng.randint(2, 7), rng.randint(0, 4)
        ends = [f"gpu{i}" for i in range(n)] + [f"sw{k}" for k in range(num_switches)]
        links = [{"src": a, "dst": b, "kind": "pcie", "bandwidth_gbps": 10, "latency_us": rng.choice((1, 2, 4)),
                  "bidirectional": rng.random() < 0.8}
                 for i, a in enumerate(ends) for b in ends[i + 1:] if rng.random() < 0.35]
        doc = {"format": "soapflow.topology/1", "name": "random",
               "devices": [{"id": i, "kind": "v100", "node": 0} for i in range(n)], "links": links}
        try:
            topo = DeviceTopology.from_dict(doc)
        except TopologyError:
            continue
        built += 1
        for a in range(n):
            for b in range(n):
                assert topo.route(a, b) == reference_route(topo, a, b), (doc, a, b)
    assert built >= 40


@pytest.mark.parametrize("name", PRESETS)
def test_collectives_equal_the_figures_before_fast_routes(name):
    comm = Comm(load_topology(name))
    for preset, group, kind in cases():
        if preset == name:
            assert figures(comm, groups(name)[group], kind) == GOLDEN[f"{preset}|{group}|{kind}"], \
                (preset, group, kind)


if __name__ == "__main__":  # print the figures the code gives now, to write GOLDEN
    print({f"{name}|{group}|{kind}": figures(Comm(load_topology(name)), groups(name)[group], kind)
           for name, group, kind in cases()})


def test_an_exchange_asked_again_costs_what_a_fresh_comm_says():
    """`Comm.exchange` remembers exchanges by their pieces: random exchanges on a two-node topology, each
    asked twice on one `Comm` (the second time remembered) and once on a fresh one, agree; pieces that
    differ only in their bytes or in their order of devices are priced apart."""
    topo = load_topology("p100-2x2")
    comm = Comm(topo)
    rng = random.Random(3)
    for _ in range(200):
        pieces = []
        for _ in range(rng.randint(1, 6)):
            src, dst = rng.sample(range(topo.num_devices), 2)
            pieces.append((src, dst, rng.choice([1, 1 << 10, 1 << 20, 3 << 24])))
        first = comm.exchange(pieces)
        assert comm.exchange(list(pieces)) == first == Comm(topo).exchange(pieces)
    a, b = comm.exchange([(0, 2, 1 << 24)]), comm.exchange([(0, 2, 1 << 26)])
    assert a[0] == b[0] and a[1] < b[1]
    assert comm.exchange([(0, 1, 1 << 24)]) != comm.exchange([(0, 2, 1 << 24)])
