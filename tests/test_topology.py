"""DeviceTopology: preset wiring (one NIC per GPU on NVSwitch nodes: rails that simulated rings use
independently), routes (shape, determinism), the topology file (round trip, the old one-uplink form and
every bad-input case) and the datasheet table."""

from __future__ import annotations

import functools
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from test_simulator_support import Net

from simulator import FixedCostModel, simulate
from simulator.comm import Comm
from soap.config import ParallelConfig
from soap.devices import DEVICE_SPECS, LINK_SPECS
from soap.strategy import Strategy
from soap.topology import (
    FILE_BOUNDS,
    FORMAT,
    PRESET_KINDS,
    Device,
    DeviceTopology,
    Link,
    TopologyError,
    build_preset,
    load_topology,
    read_topology,
    save_topology,
)


def kinds_on_route(topo: DeviceTopology, src: int, dst: int) -> list[str]:
    return [topo.link(i).kind for i in topo.route(src, dst)]


@pytest.mark.parametrize(("name", "num_devices", "num_nodes", "link_kinds"), [
    ("p100-4x4", 16, 4, {"nvlink", "nic", "network"}),
    ("k80-16x4", 64, 16, {"pcie", "nic", "network"}),
    ("v100-1x8", 8, 1, {"nvlink"}),
    ("a100-2x8", 16, 2, {"nvswitch", "nic", "network"}),
    ("h100-1x8", 8, 1, {"nvswitch"}),
    ("h200-2x4", 8, 2, {"nvswitch", "nic", "network"}),
    ("p100-2x1", 2, 2, {"nic", "network"}),
    ("cpu-2", 2, 1, {"loopback"}),
    ("cpu-1", 1, 1, set()),
])
def test_preset_counts_and_link_kinds(name, num_devices, num_nodes, link_kinds):
    topo = load_topology(name)
    assert topo.name == name
    assert (topo.num_devices, topo.num_nodes) == (num_devices, num_nodes)
    assert {link.kind for link in topo.links} == link_kinds
    kind = name.split("-")[0]
    assert {d.kind for d in topo.devices} == {kind}
    per_node = num_devices // num_nodes
    for n in range(num_nodes):
        assert topo.devices_of_node(n) == tuple(range(n * per_node, (n + 1) * per_node))
    # Every connection is full duplex: each link has its reverse with the same figures.
    pairs = {(link.src, link.dst): (link.kind, link.bandwidth_gbps, link.latency_us) for link in topo.links}
    assert all(pairs[(b, a)] == figures for (a, b), figures in pairs.items())


def test_p100_node_is_all_to_all_nvlink_and_crosses_nodes_over_infiniband():
    topo = load_topology("p100-4x4")
    for node in range(4):
        ids = topo.devices_of_node(node)
        for a in ids:
            for b in ids:
                if a != b:
                    (link,) = (topo.link(i) for i in topo.route(a, b))
                    assert (link.kind, link.spec, link.bandwidth_gbps) == ("nvlink", "nvlink1", 20.0)
    assert topo.path(0, 5) == ("gpu0", "node0.nic", "net", "node1.nic", "gpu5")
    assert kinds_on_route(topo, 0, 5) == ["nic", "network", "network", "nic"]
    assert [topo.link(i).spec for i in topo.route(0, 5)] == ["pcie3-x16", "ib-edr", "ib-edr", "pcie3-x16"]
    assert topo.route_bandwidth_gbps(0, 5) == 12.0  # PCIe 3.0 effective, below EDR's 12.5
    assert topo.route(3, 3) == () and topo.path(3, 3) == ("gpu3",)


def test_dgx1_hybrid_cube_mesh():
    p100 = load_topology("p100-1x8")
    neighbours = {topo_link.dst for topo_link in p100.links if topo_link.src == "gpu0"}
    assert neighbours == {"gpu1", "gpu2", "gpu3", "gpu4"}
    assert all(link.bandwidth_gbps == 20.0 for link in p100.links)  # one NVLink 1 brick per pair
    assert kinds_on_route(p100, 0, 5) == ["nvlink", "nvlink"]  # no NVLink 0-5: two hops, not through a NIC
    v100 = load_topology("v100-1x8")
    bandwidth = {(link.src, link.dst): link.bandwidth_gbps for link in v100.links}
    assert bandwidth[("gpu0", "gpu3")] == bandwidth[("gpu0", "gpu4")] == 50.0  # NV2
    assert bandwidth[("gpu0", "gpu1")] == bandwidth[("gpu2", "gpu6")] == 25.0  # NV1
    assert all(sum(b for (s, _), b in bandwidth.items() if s == f"gpu{g}") == 150.0 for g in range(8))
    # a 4-GPU V100 node spreads each GPU's 6 bricks over its 3 peers
    assert {link.bandwidth_gbps for link in load_topology("v100-1x4").links} == {50.0}


def test_k80_goes_through_the_pcie_switch():
    topo = load_topology("k80-16x4")
    assert topo.path(0, 1) == ("gpu0", "node0.pcie", "gpu1")
    assert kinds_on_route(topo, 0, 1) == ["pcie", "pcie"]
    assert topo.path(0, 63) == ("gpu0", "node0.pcie", "node0.nic", "net", "node15.nic", "node15.pcie",
                                "gpu63")
    assert {topo.link(i).spec for i in topo.route(0, 63)} >= {"ib-fdr"}
    assert topo.route_bandwidth_gbps(0, 63) == 7.0  # FDR 56 Gb/s


def test_nvswitch_nodes_have_one_nic_per_gpu():
    """DESIGN section 10's DGX A100: 8 GPUs on an NVSwitch, 8 x 200 Gb/s HDR InfiniBand, one NIC per GPU;
    the DGX H100/H200 the same with 400 Gb/s NDR. Each GPU has its own PCIe hop into its own NIC, and
    each NIC its own port to the switch at the per-NIC rate (no aggregated node uplink)."""
    for name, nic_spec, port_spec, port_gbps in (("a100-2x8", "pcie4-x16", "ib-hdr", 200 / 8),
                                                  ("h100-2x8", "pcie5-x16", "ib-ndr", 400 / 8),
                                                  ("h200-3x4", "pcie5-x16", "ib-ndr", 400 / 8)):
        topo = load_topology(name)
        per_node = topo.num_devices // topo.num_nodes
        for d in topo.devices:
            nic = f"node{d.node}.nic{d.id % per_node}"
            (hop,) = [link for link in topo.links if link.src == d.endpoint and link.kind == "nic"]
            assert (hop.dst, hop.spec, hop.bandwidth_gbps) == (nic, nic_spec, LINK_SPECS[nic_spec].bandwidth_gbps)
            assert [link.dst for link in topo.links if link.src == nic] == [d.endpoint, "net"]
            assert [link.src for link in topo.links if link.dst == nic] == [d.endpoint, "net"]
            (port,) = [link for link in topo.links if link.src == nic and link.dst == "net"]
            assert (port.dst, port.kind, port.spec, port.bandwidth_gbps) == ("net", "network", port_spec, port_gbps)
        ports = [link for link in topo.links if link.kind == "network" and link.dst == "net"]
        assert len(ports) == topo.num_devices  # one port per GPU: M per node
    topo = load_topology("a100-2x8")
    assert topo.path(0, 7) == ("gpu0", "node0.nvswitch", "gpu7")  # inside a node: NVSwitch as before
    assert topo.route_bandwidth_gbps(0, 7) == 300.0  # 600 GB/s both directions
    # between nodes: the sender's own NIC, the switch, the receiver's own NIC
    assert topo.path(0, 8) == ("gpu0", "node0.nic0", "net", "node1.nic0", "gpu8")
    assert topo.path(3, 13) == ("gpu3", "node0.nic3", "net", "node1.nic5", "gpu13")
    assert kinds_on_route(topo, 3, 13) == ["nic", "network", "network", "nic"]
    assert topo.route_bandwidth_gbps(3, 13) == 24.0  # PCIe 4.0 effective, below HDR's 25
    assert load_topology("h200-1x8").route_bandwidth_gbps(0, 1) == 450.0
    # the summary groups a node's NICs together
    rows = {(r["kind"], r["where"]): (r["count"], r["spec"], r["bandwidth_gbps"]) for r in topo.describe()
            if r["what"] == "link"}
    assert rows == {("nvswitch", "gpu <-> node.nvswitch"): (32, "nvswitch-a100", 300.0),
                    ("nic", "gpu <-> node.nic"): (32, "pcie4-x16", 24.0),
                    ("network", "net <-> node.nic"): (32, "ib-hdr", 25.0)}


def test_one_nic_presets_and_single_nodes_are_unchanged():
    """Nodes with one NIC (P100, V100, K80) share it and its one port; a single node and cpu-N have none."""
    for name, port in (("p100-2x4", "ib-edr"), ("v100-2x8", "ib-edr"), ("k80-2x4", "ib-fdr")):
        topo = load_topology(name)
        ports = [link for link in topo.links if link.kind == "network"]
        assert [(link.src, link.dst) for link in ports] == [("node0.nic", "net"), ("net", "node0.nic"),
                                                           ("node1.nic", "net"), ("net", "node1.nic")]
        assert {link.spec for link in ports} == {port}
    for name in ("a100-1x8", "h100-1x4", "v100-1x8", "cpu-4"):
        assert not {"nic", "network"} & {link.kind for link in load_topology(name).links}


def _rails_graph():
    """x[4, 1024] feeds two linears fa and fb (4 MiB of weight each), added, against y: each linear's
    gradient all-reduce is over the devices of its own config."""
    net = Net("two_linears", 4)
    x = net.input("x", (4, 1024))
    a, b = net.linear("fa", x, 1024), net.linear("fb", x, 1024)
    net.mse("loss", net.add2("add", a, b), net.input("y", (4, 1024), role="target"))
    return net.graph()


def _two_syncs(topo: DeviceTopology, fb_devices: tuple[int, int]) -> list:
    """The all-reduce records of `_rails_graph` with fa data parallel over GPUs 0 and 8 and fb over
    `fb_devices`; compute costs about nothing, so the all-reduces are free to overlap."""
    on = functools.partial(ParallelConfig, degrees={"sample": 2})
    rails = on(devices=(0, 8))
    strategy = Strategy({"x": rails, "fa": rails, "fb": on(devices=fb_devices), "add": rails, "y": rails,
                         "loss": rails})
    costs = FixedCostModel(fwd_each_ms=0.001, bwd_each_ms=0.002, update_each_ms=0.001)
    timeline = simulate(_rails_graph(), strategy, topo, costs)
    return [r for r in timeline.tasks() if r.category == "allreduce"]


def _span_ns(records) -> int:
    return round((max(r.end_ms for r in records) - min(r.start_ms for r in records)) * 1e6)


SYNC_BYTES = (1024 * 1024 + 1024) * 4  # one linear's weight and bias, float32


def test_rings_on_different_rails_run_at_once_and_on_the_same_gpus_queue():
    topo = load_topology("a100-2x8")
    (_, one), (_, other) = Comm(topo).collective((0, 8), SYNC_BYTES), Comm(topo).collective((1, 9), SYNC_BYTES)
    assert one == other
    # GPU 0 of both nodes and GPU 1 of both nodes: rails 0 and 1, no link in common
    rails = _two_syncs(topo, (1, 9))
    assert len(rails) == 2 and not set(rails[0].links) & set(rails[1].links)
    assert [round((r.end_ms - r.start_ms) * 1e6) for r in rails] == [one, one]
    assert one <= _span_ns(rails) <= 1.05 * one  # both together take about as long as one alone
    # both on GPUs 0 and 8: the same links, one ring after the other
    same = _two_syncs(topo, (0, 8))
    assert len(same) == 2 and set(same[0].links) == set(same[1].links)
    assert _span_ns(same) >= 2 * one


def test_a_ring_over_gpu_i_of_every_node_uses_rail_i():
    topo = load_topology("a100-4x8")
    comm = Comm(topo)

    def rail(i: int) -> set[int]:
        ends = {f"gpu{8 * n + i}" for n in range(4)} | {f"node{n}.nic{i}" for n in range(4)}
        return {link.id for link in topo.links if {link.src, link.dst} <= ends | {"net"}
                and link.kind in ("nic", "network")}

    for i in range(8):
        res, _ = comm.collective(tuple(range(i, 32, 8)), SYNC_BYTES)
        assert {r - topo.num_devices for r in res} == rail(i)
    # tp=4: the data-parallel ring of rank r (GPUs r, r+4, r+8, ...) crosses nodes from GPU r+4's NIC into
    # the next node's GPU r's NIC: the four rings share no link
    rings = [set(comm.collective(tuple(range(r, 32, 4)), SYNC_BYTES)[0]) for r in range(4)]
    assert all(not rings[a] & rings[b] for a in range(4) for b in range(a + 1, 4))


def _aggregated_uplink_doc() -> dict:
    """a100-2x8 as soapflow saved it before presets had one NIC per GPU: every GPU's PCIe hop into one
    node NIC, and one uplink of 8 x 25 GB/s from each node's NIC to the switch."""
    figures = {"nvswitch": ("nvswitch-a100", 300.0, 1.5), "nic": ("pcie4-x16", 24.0, 5.0),
               "network": ("ib-hdr x8", 200.0, 1.0)}

    def link(src: str, dst: str, kind: str) -> dict:
        spec, bandwidth, latency = figures[kind]
        return {"src": src, "dst": dst, "kind": kind, "spec": spec, "bandwidth_gbps": bandwidth,
                "latency_us": latency, "bidirectional": True}

    links = []
    for n in range(2):
        links += [link(f"gpu{8 * n + i}", f"node{n}.nvswitch", "nvswitch") for i in range(8)]
        links += [link(f"gpu{8 * n + i}", f"node{n}.nic", "nic") for i in range(8)]
        links.append(link(f"node{n}.nic", "net", "network"))
    return {"format": FORMAT, "name": "a100-2x8",
            "devices": [{"id": i, "kind": "a100", "node": i // 8} for i in range(16)], "links": links}


def test_a_file_with_one_node_uplink_keeps_its_meaning(tmp_path):
    doc = _aggregated_uplink_doc()
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    topo = load_topology(str(path))
    assert topo.to_dict() == doc and topo != load_topology("a100-2x8")
    assert topo.path(0, 9) == ("gpu0", "node0.nic", "net", "node1.nic", "gpu9")
    uplink = topo.link(topo.route(0, 9)[1])
    assert (uplink.kind, uplink.spec, uplink.bandwidth_gbps) == ("network", "ib-hdr x8", 200.0)
    # one uplink per node, a shared resource: rings of GPUs 0 and 1 of both nodes still queue on it
    _, one = Comm(topo).collective((0, 8), SYNC_BYTES)
    rings = _two_syncs(topo, (1, 9))
    assert set(rings[0].links) & set(rings[1].links) and _span_ns(rings) >= 2 * one


def test_cpu_processes_share_the_loopback_hub():
    topo = load_topology("cpu-2")
    assert [d.endpoint for d in topo.devices] == ["cpu0", "cpu1"]
    assert topo.path(0, 1) == ("cpu0", "node0.loopback", "cpu1")
    assert kinds_on_route(topo, 1, 0) == ["loopback", "loopback"]
    assert 30 <= topo.route_latency_us(0, 1) <= 50
    assert topo.device(0).peak_flops_for("float32") == DEVICE_SPECS["cpu"].peak_tflops["float32"] * 1e12


def _all_routes(topo: DeviceTopology) -> dict[tuple[int, int], tuple[int, ...]]:
    return {(a, b): topo.route(a, b) for a in range(topo.num_devices) for b in range(topo.num_devices)}


def test_routes_are_deterministic():
    for name in ("p100-2x8", "v100-2x8", "k80-4x4"):
        assert _all_routes(load_topology(name)) == _all_routes(load_topology(name))
    # ... across processes too (different hash seeds)
    code = ("from soap.topology import load_topology; t = load_topology('v100-2x8'); "
            "print([t.route(a, b) for a in range(16) for b in range(16)])")
    root = Path(__file__).resolve().parents[1]
    outputs = {subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                              check=True, env={"PYTHONHASHSEED": seed, "PYTHONPATH": str(root)}).stdout
               for seed in ("1", "2")}
    assert len(outputs) == 1


def test_round_trip_keeps_routes(tmp_path):
    for name in ("p100-4x4", "k80-2x4", "v100-2x8", "a100-2x4", "h100-2x8", "cpu-3"):
        topo = load_topology(name)
        doc = json.loads(json.dumps(topo.to_dict()))
        assert doc["format"] == FORMAT
        back = DeviceTopology.from_dict(doc)
        assert back == topo and hash(back) == hash(topo)
        assert _all_routes(back) == _all_routes(topo)
    # a file with overrides and one-way links, through save/load
    topo = DeviceTopology.from_dict({
        "format": FORMAT, "name": "mixed",
        "devices": [{"id": 0, "kind": "p100", "node": 0, "peak_tflops": {"float32": 9.3}, "memory_gb": 15.5},
                    {"id": 1, "kind": "tpu", "node": 0, "peak_tflops": {"bfloat16": 100},
                     "memory_bandwidth_gbps": 600, "memory_gb": 32}],
        "links": [{"src": "gpu0", "dst": "gpu1", "kind": "pcie", "spec": "pcie3-x16", "bidirectional": False},
                  {"src": "gpu1", "dst": "gpu0", "kind": "pcie", "bandwidth_gbps": 10, "latency_us": 7,
                   "bidirectional": False}]})
    assert topo.device(0).peak_flops["float32"] == pytest.approx(9.3e12)
    assert topo.device(0).peak_flops["float16"] == pytest.approx(21.2e12)  # datasheet kept
    assert topo.device(0).memory_bytes == 15_500_000_000
    assert topo.link(0).bandwidth_gbps == 12.0 and topo.link(1).latency_us == 7.0
    path = tmp_path / "machine.json"
    save_topology(path, topo)
    assert load_topology(str(path)) == topo
    assert _all_routes(load_topology(path)) == _all_routes(topo)
    assert pickle.loads(pickle.dumps(topo)) == topo


def _file(tmp_path: Path, doc: object) -> str:
    path = tmp_path / "topo.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def _doc(devices=None, links=None, **top) -> dict:
    devices = devices if devices is not None else [{"id": 0, "kind": "p100", "node": 0},
                                                   {"id": 1, "kind": "p100", "node": 0}]
    links = links if links is not None else [{"src": "gpu0", "dst": "gpu1", "kind": "nvlink",
                                              "bandwidth_gbps": 20, "latency_us": 3}]
    return {"format": FORMAT, "name": "t", "devices": devices, "links": links, **top}


P100 = {"kind": "p100", "node": 0}
NVLINK = {"kind": "nvlink", "bandwidth_gbps": 20, "latency_us": 3}


@pytest.mark.parametrize(("doc", "message"), [
    ('{"format": "soapflow.topology/1", "devices": [', r"is not JSON: .*line 1"),
    (_doc(format="soapflow.topology/9"), r"unknown format 'soapflow.topology/9'"),
    ({"name": "t", "devices": []}, r"unknown format None"),
    (_doc(devices=[{"id": 0, "kind": "p100", "node": 0}, {"id": 1, "kind": "tpu", "node": 0}]),
     r"device 1: unknown device kind 'tpu'; known kinds: p100, k80, v100, a100, h100, h200, cpu"),
    (_doc(links=[{"src": "gpu0", "dst": "gpu7", **NVLINK}]), r"names a missing device 'gpu7'"),
    (_doc(links=[{"src": "cpu0", "dst": "gpu1", **NVLINK}]), r"missing device 'cpu0' \(device 0 is 'gpu0'\)"),
    (_doc(links=[{"src": "gpu0", "dst": "node0.pcie", **NVLINK},
                 {"src": "gpu1", "dst": "node0.pcei", **NVLINK}]),
     r"endpoint 'node0.pcie' is linked only with 'gpu0'"),
    (_doc(links=[]), r"devices cannot reach each other: no route from gpu0 to gpu1"),
    (_doc(links=[{"src": "gpu0", "dst": "gpu1", **NVLINK, "bidirectional": False}]),
     r"no route from gpu1 to gpu0"),
    (_doc(devices=[{"id": 0, **P100}, {"id": 0, **P100}]), r"duplicate device id\(s\) \[0\]"),
    (_doc(devices=[{"id": 0, **P100}, {"id": 2, **P100}]), r"device ids must be 0\.\.1, got \[0, 2\]"),
    (_doc(devices=[{"id": 0, **P100}, {"id": 1, "kind": "p100", "node": 2}]),
     r"numbered 0\.\.1 without gaps"),
    (_doc(links=[{"src": "gpu0", "dst": "gpu1", **NVLINK}, {"src": "gpu0", "dst": "gpu1", **NVLINK}]),
     r"both go gpu0 -> gpu1"),
    (_doc(links=[{"src": "gpu0", "dst": "gpu1", "kind": "nvlink", "bandwith_gbps": 20, "latency_us": 3}]),
     r"link entry 0: unknown key 'bandwith_gbps'"),
    (_doc(links=[{"src": "gpu0", "dst": "gpu1", "kind": "nvlink", "latency_us": 3}]),
     r"missing 'bandwidth_gbps' \(give it, or a spec from: nvlink1"),
    (_doc(links=[{"src": "gpu0", "dst": "gpu1", "kind": "nvlink", "bandwidth_gbps": -1, "latency_us": 3}]),
     r"bandwidth_gbps must be a positive number, got -1"),
    (_doc(links=[{"src": "gpu0", "dst": "gpu1", "kind": "ethernet", "bandwidth_gbps": 1, "latency_us": 3}]),
     r"unknown kind 'ethernet'; known: nvlink, nvswitch"),
    (_doc(devices=[{"id": 0, **P100, "peak_tflops": {"fp32": 1}}, {"id": 1, **P100}]),
     r"device 0: peak_tflops has unknown dtype 'fp32'"),
    (_doc(devices="all of them"), r"'devices' must be a non-empty list"),
])
def test_bad_files_raise_one_line(tmp_path, doc, message):
    with pytest.raises(TopologyError, match=message) as err:
        load_topology(_file(tmp_path, doc))
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("topology file ")


GPU_PAIR = {"src": "gpu0", "dst": "gpu1", "kind": "nvlink"}


@pytest.mark.parametrize(("doc", "message"), [
    (_doc(links=[{**GPU_PAIR, "bandwidth_gbps": 1e-150, "latency_us": 3}]),
     r"link entry 0 \(gpu0 -> gpu1\): bandwidth_gbps must be a physical figure, in \[1e-06, 1e\+09\] GB/s, "
     r"got 1e-150"),
    (_doc(links=[{**GPU_PAIR, "bandwidth_gbps": 1e-7, "latency_us": 3}]), r"bandwidth_gbps .* got 1e-07"),
    (_doc(links=[{**GPU_PAIR, "bandwidth_gbps": 1e12, "latency_us": 3}]), r"bandwidth_gbps .* got 1e\+12"),
    (_doc(links=[{**GPU_PAIR, "spec": "nvlink1", "latency_us": 1e300}]),
     r"link entry 0 \(gpu0 -> gpu1\): latency_us must be a physical figure, in \[0, 1e\+09\] us, got 1e\+300"),
    ('{"format": "soapflow.topology/1", "name": "t", "devices": [{"id": 0, "kind": "cpu", "node": 0}, '
     '{"id": 1, "kind": "cpu", "node": 0}], "links": [{"src": "cpu0", "dst": "cpu1", "kind": "loopback", '
     '"bandwidth_gbps": NaN, "latency_us": 3}]}', r"link entry 0 \(cpu0 -> cpu1\): bandwidth_gbps .* got nan"),
    ('{"format": "soapflow.topology/1", "name": "t", "devices": [{"id": 0, "kind": "cpu", "node": 0}, '
     '{"id": 1, "kind": "cpu", "node": 0}], "links": [{"src": "cpu0", "dst": "cpu1", "kind": "loopback", '
     '"bandwidth_gbps": 5, "latency_us": Infinity}]}', r"latency_us .* got inf"),
    (_doc(devices=[{"id": 0, **P100, "peak_tflops": {"float32": 1e-9}}, {"id": 1, **P100}]),
     r"device 0: peak_tflops\['float32'\] must be a physical figure, in \[1e-06, 1e\+09\] TFLOP/s"),
    (_doc(devices=[{"id": 0, **P100}, {"id": 1, **P100, "peak_tflops": {"float16": 1e300}}]),
     r"device 1: peak_tflops\['float16'\] .* got 1e\+300"),
    (_doc(devices=[{"id": 0, **P100, "memory_bandwidth_gbps": 1e-30}, {"id": 1, **P100}]),
     r"device 0: memory_bandwidth_gbps must be a physical figure, in \[1e-06, 1e\+09\] GB/s"),
    (_doc(devices=[{"id": 0, **P100, "memory_bandwidth_gbps": 1e10}, {"id": 1, **P100}]),
     r"device 0: memory_bandwidth_gbps .* got 1e\+10"),
])
def test_non_physical_figures_are_refused_naming_field_and_entry(tmp_path, doc, message):
    """Figures no machine has (a link of 1e-150 GB/s, a hop of 1e300 us: the simulator's integer
    nanoseconds overflow and it reports a plausible wrong time) are a one-line error, as are NaN and
    infinity; the bounds (`FILE_BOUNDS`) themselves load."""
    with pytest.raises(TopologyError, match=message) as err:
        load_topology(_file(tmp_path, doc))
    assert "\n" not in str(err.value)


def test_every_preset_and_the_calibrated_profiles_load_within_the_bounds(tmp_path):
    (low_bw, high_bw), (_, high_latency) = FILE_BOUNDS["bandwidth_gbps"], FILE_BOUNDS["latency_us"]
    low_peak, high_peak = FILE_BOUNDS["peak_tflops"]
    edges = _doc(devices=[{"id": 0, **P100, "peak_tflops": {"float32": low_peak}, "memory_bandwidth_gbps": low_bw},
                          {"id": 1, **P100, "peak_tflops": {"float32": high_peak},
                           "memory_bandwidth_gbps": high_bw}],
                 links=[{**GPU_PAIR, "bandwidth_gbps": low_bw, "latency_us": high_latency, "bidirectional": False},
                        {"src": "gpu1", "dst": "gpu0", "kind": "nvlink", "bandwidth_gbps": high_bw, "latency_us": 0,
                         "bidirectional": False}])
    assert load_topology(_file(tmp_path, edges)).link(0).bandwidth_gbps == low_bw
    for kind in PRESET_KINDS:
        name = "cpu-4" if kind == "cpu" else f"{kind}-2x4"
        topo = load_topology(name)
        assert DeviceTopology.from_dict(json.loads(json.dumps(topo.to_dict()))) == topo, name
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    profiles = [p for p in sorted(results.glob("*.json")) if '"soapflow.topology/1"' in p.read_text()]
    assert profiles
    for path in profiles:
        assert read_topology(path).num_devices >= 1, path


@pytest.mark.parametrize(("name", "message"), [
    ("p100-4", r"unknown topology 'p100-4': expected a preset KIND-NxM .*cpu-N"),
    ("t4-2x2", r"KIND one of p100, k80, v100, a100, h100, h200"),
    ("cpu-2x2", r"unknown topology 'cpu-2x2'"),
    ("p100-1x16", r"a p100 node holds at most 8 GPUs"),
    ("p100-0x4", r"need at least 1 node"),
    ("cpu-0", r"need at least 1 node and 1 device"),
    ("missing.json", r"topology file 'missing.json' not found"),
])
def test_bad_preset_names(name, message):
    with pytest.raises(TopologyError, match=message):
        load_topology(name)


def test_value_types_check_themselves():
    with pytest.raises(ValueError, match=r"memory_bandwidth_gbps must be > 0, got -3"):
        Device(id=0, kind="x", node=0, peak_flops={"float32": 1e12}, memory_bandwidth_gbps=-3, memory_bytes=1)
    with pytest.raises(ValueError, match=r"endpoints must be two different names, got 'gpu0' -> 'gpu0'"):
        Link(id=0, src="gpu0", dst="gpu0", kind="nvlink", bandwidth_gbps=1, latency_us=1)
    with pytest.raises(ValueError, match=r"device 0 \(p100\) has no peak for dtype 'bfloat16'"):
        load_topology("p100-1x1").device(0).peak_flops_for("bfloat16")
    with pytest.raises(ValueError, match=r"device 16 not in topology 'p100-4x4'"):
        load_topology("p100-4x4").route(0, 16)


def test_datasheet_table():
    k80 = DEVICE_SPECS["k80"]  # one GK210 of the board: the board's figures halved
    assert (k80.peak_tflops["float32"], k80.memory_bandwidth_gbps, k80.memory_gb) == (8.73 / 2, 240.0, 12.0)
    assert DEVICE_SPECS["p100"].peak_tflops["float16"] == 21.2
    assert DEVICE_SPECS["h100"].peak_tflops["bfloat16"] == pytest.approx(989, abs=1)
    assert DEVICE_SPECS["h200"].memory_bandwidth_gbps == 4800
    assert all(row.source for row in (*DEVICE_SPECS.values(), *LINK_SPECS.values()))
    assert LINK_SPECS["ib-edr"].bandwidth_gbps == 12.5 and LINK_SPECS["ib-fdr"].bandwidth_gbps == 7.0
    d = load_topology("a100-1x2").device(1)
    assert (d.peak_flops_for("tf32"), d.memory_bytes) == (156e12, 80_000_000_000)


def test_describe_rows_share_keys():
    for name in ("p100-4x4", "k80-16x4", "cpu-2", "cpu-1"):
        rows = load_topology(name).describe()
        assert len({tuple(r) for r in rows}) == 1
        assert rows[0]["what"] == "device" and rows[0]["count"] == load_topology(name).num_devices
    rows = load_topology("p100-4x4").describe()
    assert {(r["kind"], r["spec"], r["bandwidth_gbps"]) for r in rows if r["what"] == "link"} == {
        ("nvlink", "nvlink1", 20.0), ("nic", "pcie3-x16", 12.0), ("network", "ib-edr", 12.5)}


def test_build_preset_matches_load():
    assert build_preset("p100", num_nodes=4, devices_per_node=4) == load_topology("p100-4x4")
