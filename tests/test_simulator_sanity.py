"""Sanity of simulated figures, bad input, and the Chrome trace.

- one device: the iteration is the sum of every task's cost (nothing overlaps, nothing waits);
- data parallelism on more devices is faster for a compute-bound model, and its synchronization share
  grows with the device count (weak scaling, p100 and k80 clusters);
- a transfer over InfiniBand instead of NVLink is slower by the ratio of the routes' narrowest links;
- a strategy that does not fit in memory is infeasible, naming the device and the bytes;
- strategies for another graph or with missing ops (the strategy file rules of `soap/strategy.py`);
- the Chrome trace: valid JSON, one row per device and per link, every event inside the iteration.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
from test_simulator_support import Net, data_parallel, mlp, small_cnn

from search.baselines import dp
from simulator import AnalyticalCostModel, FixedCostModel, OutOfMemory, Simulator, simulate
from simulator.comm import ms_to_ns
from soap.config import ParallelConfig
from soap.lowering import GradFlow
from soap.registry import dims_of
from soap.setup import TrainSetup
from soap.strategy import Strategy, StrategyError, save_strategy
from soap.topology import load_topology
from soapflow.api import resolve_strategy


def on(*devices: int, **degrees: int) -> ParallelConfig:
    return ParallelConfig(degrees=degrees, devices=devices)


def wide_mlp(batch: int):
    """Four big linear layers (1024 <-> 4096): 25 MB of parameters per replica."""
    net = Net("wide_mlp", batch)
    x = net.input("x", (batch, 1024))
    for i in range(4):
        x = net.relu(f"relu{i}", net.linear(f"fc{i}", x, 4096 if i % 2 == 0 else 1024))
    net.mse("loss", x, net.input("y", (batch, 1024), role="target"))
    return net.graph()


def convnet(batch: int):
    """Three 64-channel 3x3 convolutions on 32 x 32 images: compute-bound."""
    net = Net("convnet", batch)
    x = net.input("x", (batch, 3, 32, 32))
    for i in range(3):
        x = net.relu(f"relu{i}", net.conv(f"conv{i}", x, 64))
    x = net.linear("fc", net.flatten("flat", net.pool("pool", x)), 10)
    net.cross_entropy("loss", x, net.input("y", (batch,), role="target", dtype="int64"))
    return net.graph()


# -- one device ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cost_model", [FixedCostModel(fwd_each_ms=0.25, bwd_each_ms=0.5, update_each_ms=0.125),
                                        AnalyticalCostModel()], ids=["fixed", "analytical"])
@pytest.mark.parametrize("build", [mlp, small_cnn, lambda: convnet(16)], ids=["mlp", "small_cnn", "convnet"])
def test_data_parallel_on_one_device_is_the_sum_of_the_op_costs(build, cost_model):
    graph = build()
    topo = load_topology("p100-1x1")
    device = topo.devices[0]
    tl = simulate(graph, dp(graph, topo), topo, cost_model)
    grads = GradFlow(graph, TrainSetup()).grad_inputs  # which inputs' gradients each backward computes
    expected = 0
    for i, op in enumerate(graph):
        if op.kind in ("input", "constant"):
            continue
        box = tuple((0, d.size) for d in dims_of(op))
        fwd_ms, bwd_ms = cost_model.compute_ms(op, box, device, grads[i])
        expected += ms_to_ns(fwd_ms) + ms_to_ns(bwd_ms)  # every op here gets a gradient
        if op.params:
            expected += ms_to_ns(cost_model.update_ms(op.param_bytes, device, TrainSetup().update_passes))
    assert tl.iteration_time_ns == expected
    assert tl.device_busy_ms[0] == pytest.approx(tl.iteration_time_ms, rel=1e-12)
    assert tl.comm_ms == tl.sync_ms == 0 and tl.bytes_moved == 0


# -- scaling ---------------------------------------------------------------------------------------------


def test_more_devices_make_a_compute_bound_model_faster():
    # batch 256: a quarter of it still fills the P100's SMs (a smaller part runs its kernels below peak)
    graph = convnet(256)
    times = [simulate(graph, dp(graph, load_topology(t)), load_topology(t)).iteration_time_ms
             for t in ("p100-1x1", "p100-1x2", "p100-1x4", "p100-2x4")]
    assert times == sorted(times, reverse=True) and len(set(times)) == 4
    assert times[0] / times[2] > 3  # 4 GPUs in one NVLink node: close to linear


@pytest.mark.parametrize("kind", ["p100", "k80"])
def test_synchronization_share_grows_with_the_device_count(kind):
    """Weak scaling (64 samples per GPU) of a parameter-heavy model: compute per GPU stays, the gradient
    all-reduce grows (more ring steps, then the slower network between nodes)."""
    shares = []
    for shape in ("1x1", "1x4", "2x4", "4x4", "16x4"):
        topo = load_topology(f"{kind}-{shape}")
        graph = wide_mlp(64 * topo.num_devices)
        tl = simulate(graph, dp(graph, topo), topo)
        shares.append(tl.sync_ms / tl.iteration_time_ms)
    assert shares[0] == 0
    assert all(a < b for a, b in zip(shares, shares[1:], strict=False)), shares


def test_infiniband_route_is_slower_than_nvlink_by_the_bandwidth_ratio():
    """fc on GPU 0 sends 64 MiB to the loss on GPU 1 (NVLink, same node) or GPU 4 (PCIe to the NIC,
    InfiniBand, PCIe: the narrowest link sets the rate)."""
    batch, width = 4096, 4096
    net = Net("one_transfer", batch)
    h = net.linear("fc", net.input("x", (batch, width)), width)
    net.mse("loss", h, net.input("y", (batch, width), role="target"))
    graph = net.graph()
    topo = load_topology("p100-4x4")
    nbytes = batch * width * 4
    durations = {}
    for dst in (1, 4):
        strategy = Strategy({"x": on(0), "fc": on(0), "y": on(dst), "loss": on(dst)})
        tl = simulate(graph, strategy, topo, FixedCostModel())
        (xfer,) = [r for r in tl.tasks() if r.name == "fc -> loss"]
        assert xfer.nbytes == nbytes and xfer.links == topo.route(0, dst)
        durations[dst] = round((xfer.end_ms - xfer.start_ms) * 1e6)
    kinds = [topo.links[i].kind for i in topo.route(0, 4)]
    assert kinds == ["nic", "network", "network", "nic"] and [topo.links[i].kind for i in topo.route(0, 1)] == [
        "nvlink"]
    bw_nvlink, bw_ib = topo.route_bandwidth_gbps(0, 1), topo.route_bandwidth_gbps(0, 4)
    assert bw_ib < bw_nvlink
    # without the latencies the ratio is exactly the bandwidth ratio (up to rounding to whole ns)
    payload = {d: durations[d] - topo.route_latency_us(0, d) * 1e3 for d in durations}
    assert payload[1] == pytest.approx(nbytes / bw_nvlink, abs=1)
    assert payload[4] == pytest.approx(nbytes / bw_ib, abs=1)
    assert durations[4] / durations[1] == pytest.approx(bw_nvlink / bw_ib, rel=3e-3)  # latencies: 12 vs 3 us


# -- memory ----------------------------------------------------------------------------------------------


def test_a_strategy_that_needs_more_memory_than_a_device_holds_is_infeasible():
    """A 32768 x 32768 float32 weight is 4.3 GB; with its gradient and momentum 12.9 GB, plus activations:
    too much for a 12 GB K80 die whole, fine split 4 ways."""
    net = Net("huge", 8)
    h = net.linear("fc", net.input("x", (8, 32768)), 32768, bias=False)
    net.mse("loss", h, net.input("y", (8, 32768), role="target"))
    graph = net.graph()
    topo = load_topology("k80-1x4")
    whole = Strategy({"x": on(0), "fc": on(1), "y": on(0), "loss": on(0)})
    tl = simulate(graph, whole, topo, FixedCostModel())
    capacity = topo.devices[1].memory_bytes
    weight = 32768 * 32768 * 4
    # weight, gradient, momentum; the input it receives, its output; in backward its output's gradient
    need = 3 * weight + 8 * 32768 * 4 * 3
    assert not tl.feasible
    assert tl.oom == (OutOfMemory(device=1, need_bytes=need, capacity_bytes=capacity),)
    summary = tl.summary()
    assert summary["feasible"] is False
    assert summary["oom"] == [{"device": 1, "need_bytes": need, "capacity_bytes": capacity}]
    assert summary["peak_memory_bytes"][1] == need
    sim = Simulator(graph, topo, FixedCostModel())
    sim.full(whole)
    assert not sim.feasible and sim.memory_excess_bytes == need - capacity
    # split 4 ways on out_features: a quarter each, feasible; the delta path agrees
    sim.propose("fc", on(0, 1, 2, 3, out_features=4))
    assert sim.feasible and sim.memory_excess_bytes == 0
    assert max(sim.peak_memory_bytes) < capacity
    sim.reject()
    assert not sim.feasible


# -- bad input -------------------------------------------------------------------------------------------


def test_the_simulator_refuses_incomplete_or_invalid_strategies():
    graph = mlp()
    topo = load_topology("cpu-2")
    strategy = data_parallel(graph, (0, 1))
    sim = Simulator(graph, topo, FixedCostModel())
    missing = Strategy({k: v for k, v in strategy.items() if k != "fc1"})
    with pytest.raises(StrategyError, match="fc1"):
        sim.full(missing)
    with pytest.raises(StrategyError, match="fc1.*does not divide"):
        sim.full(strategy.with_config("fc1", _bad_degree(graph)))
    with pytest.raises(StrategyError, match="not in the topology"):
        sim.full(strategy.with_config("fc1", on(0, 5, sample=2)))
    with pytest.raises(RuntimeError, match="full"):
        sim.propose("fc1", on(0))
    sim.full(strategy)
    with pytest.raises(ValueError, match="no operator named 'nope'"):
        sim.propose("nope", on(0))
    with pytest.raises(StrategyError, match="does not divide"):
        sim.propose("fc1", _bad_degree(graph))
    assert not sim.pending  # a refused proposal leaves nothing pending
    sim.propose("fc1", on(1))
    with pytest.raises(RuntimeError, match="pending"):
        sim.propose("fc1", on(0))
    sim.reject()
    with pytest.raises(RuntimeError, match="no pending"):
        sim.accept()


def _bad_degree(graph) -> ParallelConfig:
    """A config of fc1 whose degree does not divide its dim (fc1's output has 512 features)."""
    size = graph["fc1"].outputs[0].shape[-1]
    bad = next(g for g in (3, 5, 7) if size % g)
    return ParallelConfig(degrees={"out_features": bad}, devices=tuple(range(bad)))


def test_a_strategy_file_for_another_graph_warns_and_applies_by_op_name(tmp_path):
    """Same op names, other shapes (another batch): fingerprint mismatch is a warning, the file applies."""
    topo = load_topology("cpu-2")
    old, new = mlp(batch=32), mlp(batch=64)
    assert old.fingerprint != new.fingerprint
    strategy = data_parallel(old, (0, 1)).with_config("fc1", on(1))
    path = tmp_path / "mlp.json"
    save_strategy(path, strategy, old, topology="cpu-2", num_devices=2, setup=TrainSetup())
    with pytest.warns(UserWarning, match="fingerprint mismatch"):
        loaded = resolve_strategy(str(path), graph=new, topology=topo, setup=TrainSetup())
    assert loaded["fc1"] == on(1) and loaded == strategy
    tl = simulate(new, loaded, topo, FixedCostModel())
    assert tl.iteration_time_ms > 0


def test_ops_missing_from_a_strategy_file_run_data_parallel_with_a_warning(tmp_path):
    graph = mlp(batch=64)
    topo = load_topology("cpu-2")
    path = tmp_path / "partial.json"
    save_strategy(path, Strategy({"fc1": on(1)}), graph, topology="cpu-2", num_devices=2, setup=TrainSetup())
    with pytest.warns(UserWarning, match="run data parallel"):
        loaded = resolve_strategy(str(path), graph=graph, topology=topo, setup=TrainSetup())
    default = dp(graph, topo)
    assert loaded["fc1"] == on(1)
    assert all(loaded[op.name] == default[op.name] for op in graph if op.name != "fc1")
    simulate(graph, loaded, topo, FixedCostModel())


def test_an_op_the_graph_lacks_or_a_config_that_does_not_fit_is_an_error(tmp_path):
    graph = mlp(batch=64)
    topo = load_topology("cpu-2")
    path = tmp_path / "bad.json"
    doc = {"format": "soapflow.strategy/1", "model": "mlp", "fingerprint": graph.fingerprint,
           "ops": {"fc9": {"degrees": {}, "devices": [0]}}}
    path.write_text(json.dumps(doc))
    with pytest.raises(StrategyError, match="'fc9' does not exist"):
        resolve_strategy(str(path), graph=graph, topology=topo, setup=TrainSetup())
    doc["ops"] = {"fc1": {"degrees": {"out_features": 3}, "devices": [0, 1, 2]}}
    path.write_text(json.dumps(doc))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(StrategyError, match="fc1"):
            resolve_strategy(str(path), graph=graph, topology=topo, setup=TrainSetup())


# -- Chrome trace ----------------------------------------------------------------------------------------


def test_chrome_trace_has_a_row_per_device_and_link_and_events_inside_the_iteration(tmp_path):
    graph = small_cnn(batch=16)
    topo = load_topology("p100-4x4")
    strategy = data_parallel(graph, tuple(range(8))).with_config("fc", on(3)).with_config("conv_b", on(
        4, 5, height=2))
    tl = simulate(graph, strategy, topo)
    path = tmp_path / "trace" / "t.json"
    tl.write_chrome_trace(path)
    doc = json.loads(path.read_text())
    assert doc == json.loads(json.dumps(tl.to_chrome_trace()))
    events = doc["traceEvents"]
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {k for k in rows if k[0] == 0} == {(0, d) for d in range(topo.num_devices)}
    assert {k for k in rows if k[0] == 1} == {(1, link.id) for link in topo.links}
    assert len(set(rows.values())) == len(rows)  # distinct labels
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and all((e["pid"], e["tid"]) in rows for e in spans)
    end_us = tl.iteration_time_ms * 1e3
    assert all(e["ts"] >= 0 and e["dur"] >= 0 and e["ts"] + e["dur"] <= end_us * (1 + 1e-12) for e in spans)
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(end_us, rel=1e-12)
    # a task appears once per resource: transfers and all-reduces on every link they occupy
    tasks = tl.tasks()
    assert len(spans) == sum(len(r.devices) + len(r.links) for r in tasks)
    assert any(len(r.links) > 1 for r in tasks)
    # rows never overlap: a resource runs one task at a time
    by_row: dict = {}
    for e in spans:
        by_row.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for row in by_row.values():
        row.sort()
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(row, row[1:], strict=False))
    assert doc["otherData"]["iteration_time_ms"] == tl.iteration_time_ms
    assert math.isfinite(sum(e["dur"] for e in spans))
