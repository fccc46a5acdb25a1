"""Calibration: the least-squares fits recover known constants from synthetic measurements, the machine
profile round-trips through `load_topology`, and (slow) a tiny `calibrate` run end to end."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from simulator.calibration import (
    CommSample,
    MachineProfile,
    OpSample,
    StepSample,
    alpha_beta,
    cost_model_for,
    fit_collective_overhead,
    fit_comm,
    fit_compute,
    fit_overhead,
    profile_devices,
    read_profile,
    simulated_comm_ms,
    write_profile,
)
from simulator.comm import Comm, CommOverhead
from simulator.costmodel import AnalyticalCostModel, MeasuredCostModel
from soap.config import ParallelConfig, parts
from soap.setup import TrainSetup
from soap.topology import DeviceTopology, Link, load_topology


@pytest.fixture(scope="module")
def graphs():
    from soap.capture import capture
    from soapflow.models import default_loss
    from soapflow.zoo.mlp import mlp

    out = []
    for batch, sizes in ((8, (64, 256, 32)), (32, (512, 1024, 128)), (64, (16, 2048, 8))):
        module, (x, target) = mlp(batch, sizes=sizes)
        out.append(capture(module, x, target, default_loss, name="m", batch_size=batch))
    return out


def synthetic_samples(graphs, model, device) -> list[OpSample]:
    samples = []
    for g in graphs:
        for op in g:
            if op.kind in ("input", "constant"):
                continue
            for degree in (1, 2, 4):
                cfg = ParallelConfig(degrees={"sample": degree}, devices=tuple(range(degree)))
                box = parts(op, cfg)[0][0]
                fwd, bwd = model.compute_ms(op, box, device)
                samples.append(OpSample(op=op, box=box, fwd_ms=fwd, bwd_ms=bwd))
    return samples


def test_fit_compute_recovers_known_constants(graphs) -> None:
    device = load_topology("cpu-2").devices[0]
    truth = AnalyticalCostModel(efficiency={"cpu": {"linear": 0.37}}, bandwidth_efficiency={"cpu": 0.45},
                                launch_us={"cpu": 23.0})
    fit = fit_compute(synthetic_samples(graphs, truth, device), device)
    assert fit.efficiency["linear"] == pytest.approx(0.37, rel=1e-3)
    assert fit.bandwidth_efficiency == pytest.approx(0.45, rel=1e-3)
    assert fit.launch_us == pytest.approx(23.0, rel=1e-3)
    assert fit.median_abs_error < 1e-4 < fit.default_median_abs_error


def test_fit_compute_above_the_datasheet_peak_raises_the_peak(graphs) -> None:
    topo = load_topology("cpu-2")
    device = topo.devices[0]
    fast = DeviceTopology(name="fast", devices=tuple(
        type(d)(id=d.id, kind=d.kind, node=d.node, peak_flops={k: 3 * v for k, v in d.peak_flops.items()},
                memory_bandwidth_gbps=d.memory_bandwidth_gbps, memory_bytes=d.memory_bytes)
        for d in topo.devices), links=topo.links)
    truth = AnalyticalCostModel(efficiency={"cpu": {"linear": 0.9}}, launch_us={"cpu": 5.0})
    fit = fit_compute(synthetic_samples(graphs, truth, fast.devices[0]), device)
    assert fit.efficiency["linear"] == pytest.approx(2.7, rel=1e-3)  # 0.9 of a 3x faster device
    topology, eff, _ = profile_devices(topo, fit)
    assert eff["linear"] == pytest.approx(1.0)
    assert topology.devices[0].peak_flops["float32"] == pytest.approx(2.7 * device.peak_flops["float32"], rel=1e-3)


def test_fit_comm_recovers_link_figures() -> None:
    preset = load_topology("cpu-2")
    truth = DeviceTopology(name="t", devices=preset.devices, links=tuple(
        Link(id=link.id, src=link.src, dst=link.dst, kind=link.kind, bandwidth_gbps=1.7, latency_us=33.0)
        for link in preset.links))
    samples = [CommSample(kind=k, nbytes=n, time_ms=simulated_comm_ms(truth, CommSample(kind=k, nbytes=n,
                                                                                          time_ms=1.0)))
               for k in ("p2p", "allreduce", "allgather") for n in (4096, 65536, 1 << 20, 1 << 24)]
    fit = fit_comm(samples, preset)
    assert fit.latency_us == pytest.approx(33.0, rel=1e-2)
    assert fit.bandwidth_gbps == pytest.approx(1.7, rel=1e-2)
    assert fit.median_abs_error < 1e-3 < fit.default_median_abs_error
    alpha, beta = fit.alpha_beta["p2p"]
    assert alpha == pytest.approx(66.0, rel=1e-2) and beta == pytest.approx(1.7, rel=1e-2)  # 2 hops


def test_fit_collective_overhead_recovers_the_backends_cost_beyond_the_ring() -> None:
    """Samples that cost their ring on the links plus a known fixed cost and cost per GB per kind: the fit
    returns those, one outlier (a sample disturbed by another job) does not move them much, and a kind
    without samples is left out."""
    topology = load_topology("cpu-2")
    truth = {"allgather": (80.0, 250.0), "reduce_scatter": (300.0, 560.0)}
    sizes = (4096, 65536, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
    samples = []
    for kind, (us, per_gb) in truth.items():
        for n in sizes:
            ring = simulated_comm_ms(topology, CommSample(kind=kind, nbytes=n, time_ms=1.0))
            samples.append(CommSample(kind=kind, nbytes=n, time_ms=ring + us * 1e-3 + n / 1e9 * per_gb))
    fit = fit_collective_overhead(samples, topology)
    assert (fit["allgather_us"], fit["allgather_ms_per_gb"]) == pytest.approx(truth["allgather"], rel=1e-3)
    assert (fit["reduce_scatter_us"], fit["reduce_scatter_ms_per_gb"]) == pytest.approx(truth["reduce_scatter"],
                                                                                          rel=1e-3)
    disturbed = [CommSample(kind=s.kind, nbytes=s.nbytes, time_ms=s.time_ms * (8.0 if s.nbytes == 1 << 18 else 1.0))
                 for s in samples]
    robust = fit_collective_overhead(disturbed, topology)
    assert robust["reduce_scatter_ms_per_gb"] == pytest.approx(560.0, rel=0.1)
    only = fit_collective_overhead([s for s in samples if s.kind == "allgather"], topology)
    assert set(only) == {"allgather_us", "allgather_ms_per_gb"}
    # the profile carries them to the simulator: a reduce-scatter then costs what was measured
    profiled = Comm(topology, CommOverhead(**fit))
    for s in samples:
        assert profiled.collective((0, 1), s.nbytes, s.kind)[1] / 1e6 == pytest.approx(s.time_ms, rel=1e-3)


def test_alpha_beta_line() -> None:
    samples = [CommSample(kind="p2p", nbytes=n, time_ms=(40 + n / 2e3) / 1e3) for n in (1e3, 1e5, 1e7)]
    alpha, beta = alpha_beta(samples)
    assert alpha == pytest.approx(40, rel=1e-6) and beta == pytest.approx(2.0, rel=1e-6)


def test_fit_overhead_recovers_known_overhead() -> None:
    samples = [StepSample(name=str(i), base_ms=b, num_passes=n, measured_ms=b + n * 0.08)
               for i, (b, n) in enumerate(((10.0, 20), (100.0, 300), (3.0, 10)))]
    fit = fit_overhead(samples)
    assert fit.overhead_ms == pytest.approx(0.08) and fit.comm == CommOverhead()
    # (base, passes, exchanges, of which several processes send, GB all-reduced, GB exchanged, sharded
    # parameters' all-gathers and reduce-scatters)
    rows = ((10.0, 20, 0, 0, 0.01, 0.0, 0), (100.0, 300, 40, 30, 0.0, 0.002, 0), (3.0, 10, 12, 2, 0.0, 0.001, 0),
            (50.0, 60, 100, 10, 0.02, 0.004, 0), (20.0, 5, 3, 3, 0.0, 0.02, 0), (40.0, 80, 0, 0, 0.03, 0.0, 0),
            (30.0, 40, 20, 0, 0.0, 0.0, 0), (60.0, 20, 0, 12, 0.0, 0.0, 12), (90.0, 70, 0, 30, 0.0, 0.0, 30))
    # GB gathered and reduce-scattered: few large collectives in one step, many small ones in the other
    shard_gb = (0.0,) * 7 + (0.15, 0.01)
    both = [StepSample(name=str(i), base_ms=b, num_passes=n, num_exchanges=x, num_syncs=sx, allreduce_gb=ar,
                       exchange_gb=xg, num_shard_collectives=sh, shard_gb=sg,
                       measured_ms=b + n * 0.08 + x * 0.03 + sx * 0.5 + ar * 250.0 + xg * 600.0 + sh * 0.7
                       + sg * 400.0)
            for i, ((b, n, x, sx, ar, xg, sh), sg) in enumerate(zip(rows, shard_gb, strict=True))]
    fit = fit_overhead(both)
    assert fit.overhead_ms == pytest.approx(0.08)
    assert (fit.comm.exchange_us, fit.comm.sync_us, fit.comm.allreduce_ms_per_gb, fit.comm.exchange_ms_per_gb,
            fit.comm.shard_us, fit.comm.shard_ms_per_gb) == pytest.approx((30.0, 500.0, 250.0, 600.0, 700.0, 400.0))
    assert fit_overhead([StepSample(name="x", base_ms=10.0, num_passes=5, measured_ms=8.0)]).overhead_ms < 1e-9
    assert fit.compute_scale == 1.0  # no sample exercises it


def test_profile_factor_scales_the_analytical_roofline_exactly(graphs) -> None:
    topology = load_topology("cpu-2")
    plain = MachineProfile(topology=topology, efficiency={"cpu": {"linear": 0.4, "*": 0.2}},
                           bandwidth_efficiency={"cpu": 0.5}, launch_us={"cpu": 15.0})
    slow = dataclasses.replace(plain, compute_scale=1.5)
    device = topology.devices[0]
    for op in graphs[1]:
        box = parts(op, ParallelConfig.single(0))[0][0]
        assert slow.analytical().compute_ms(op, box, device) == pytest.approx(
            tuple(1.5 * t for t in plain.analytical().compute_ms(op, box, device)))


def test_fit_overhead_recovers_the_step_factor_beside_the_overheads() -> None:
    # (base, compute on the critical path, passes, hops): parts 1.3x slower in a step, 50 us per pass,
    # 0.2 ms per hop
    rows = ((10.0, 8.0, 20, 0), (100.0, 90.0, 300, 40), (30.0, 5.0, 200, 12), (50.0, 45.0, 60, 100),
            (20.0, 2.0, 150, 3))
    samples = [StepSample(name=str(i), base_ms=b, compute_ms=c, num_passes=n, num_exchanges=h,
                          measured_ms=b + 0.3 * c + n * 0.05 + h * 0.2)
               for i, (b, c, n, h) in enumerate(rows)]
    fit = fit_overhead(samples)
    assert (fit.compute_scale, fit.overhead_ms, fit.comm.exchange_us) == pytest.approx((1.3, 0.05, 200.0))


def test_machine_profile_round_trips_through_load_topology(tmp_path: Path) -> None:
    preset = load_topology("cpu-2")
    links = tuple(Link(id=link.id, src=link.src, dst=link.dst, kind=link.kind, spec=link.spec,
                       bandwidth_gbps=1.25, latency_us=41.0) for link in preset.links)
    topology = DeviceTopology(name="machine", devices=preset.devices, links=links)
    profile = MachineProfile(topology=topology, efficiency={"cpu": {"linear": 0.4, "*": 0.2}},
                             bandwidth_efficiency={"cpu": 0.5}, launch_us={"cpu": 15.0}, overhead_us=70.0,
                             compute_scale=1.25, costdb="machine.costdb.jsonl", report={"fit": {"nproc": 2}},
                             comm_overhead=CommOverhead(exchange_us=120.0, sync_us=80.0,
                                                        allreduce_ms_per_gb=300.0, exchange_ms_per_gb=450.0),
                             update_scale=1.1)
    path = tmp_path / "machine.json"
    write_profile(path, profile)
    loaded = load_topology(str(path))
    assert loaded.devices == topology.devices and loaded.links == topology.links
    assert loaded.name == "machine"
    back = read_profile(path)
    assert back is not None and back.overhead_us == 70.0 and back.report == {"fit": {"nproc": 2}}
    assert back.comm_overhead == profile.comm_overhead and back.update_scale == 1.1
    assert back.cost_model().comm_overhead == profile.comm_overhead  # what the simulator reads
    assert back.costdb == str(tmp_path / "machine.costdb.jsonl")  # relative to the profile
    # the analytical model carries the step's factor: efficiencies divided by it
    assert back.compute_scale == 1.25
    assert back.analytical().flop_efficiency("cpu", "linear") == pytest.approx(0.4 / 1.25)
    topo, model = cost_model_for(str(path))
    assert topo == loaded
    assert isinstance(model, MeasuredCostModel) and model.overhead_ms == pytest.approx(0.07)
    assert model.scale == 1.25
    assert model.fallback.flop_efficiency("cpu", "linear") == pytest.approx(0.4 / 1.25)
    assert cost_model_for("cpu-2")[1] is None
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(topology.to_dict()))
    assert read_profile(plain) is None


@pytest.mark.slow
def test_calibrate_smoke(tmp_path: Path) -> None:
    from soapflow.calibrate import TINY_WORKLOADS, calibrate, calibrate_text

    out = tmp_path / "machine.json"
    stages = []
    report = calibrate(2, "gloo", out, progress=lambda info: stages.append(info["stage"]),
                       workloads=TINY_WORKLOADS, repeats=2, comm_sizes=(4096, 1 << 16, 1 << 20), comm_repeats=2,
                       overhead_steps=2, timeout_s=120)
    assert stages[0] == "capture" and stages[-1] == "done"
    topo = load_topology(str(out))
    assert topo.num_devices == 2 and topo.links[0].latency_us == pytest.approx(report["latency_us"])
    assert report["parts_measured"] > 0 and Path(report["costdb"]).is_file()
    from soap import costdb

    assert all(m.solo_fwd_ms is not None for m in costdb.load(report["costdb"]))  # timed alone and at once
    profile = read_profile(out)
    assert profile is not None and profile.overhead_us == pytest.approx(report["overhead_us"])
    assert "efficiency" in calibrate_text(report)
    again = calibrate(2, "gloo", out, workloads=TINY_WORKLOADS, repeats=2, comm_sizes=(4096, 1 << 16),
                      comm_repeats=2, overhead_steps=2, timeout_s=120)
    assert again["parts_measured"] == 0  # reused from the cost database
    with pytest.raises(ValueError, match="nccl"):
        calibrate(2, "nccl", out)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("compute_scale", {"linear": 2.0}, "calibration.compute_scale must be a number"),
    ("overhead_us", "fast", "calibration.overhead_us must be a number"),
    ("comm_overhead", {"sync_us": [1]}, "calibration.comm_overhead.sync_us must be a number"),
    ("comm_overhead", {"exchange_us": -5.0}, "finite and >= 0"),
    ("comm_overhead", 3, "calibration.comm_overhead must be an object"),
])
def test_a_bad_calibration_figure_is_a_clear_error(tmp_path: Path, key, value, message) -> None:
    path = tmp_path / "machine.json"
    write_profile(path, MachineProfile(topology=load_topology("cpu-2"), efficiency={}, bandwidth_efficiency={},
                                       launch_us={}))
    doc = json.loads(path.read_text())
    doc["calibration"][key] = value
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=message):
        read_profile(path)


def test_calibration_strategies_include_a_reshard_and_an_alternation() -> None:
    """`reshard` splits the ops `mixed` leaves alone along a dim other than the sample, as many ways as
    dp: the conv stack's activations are then exchanged whole, so the steps see the cost per byte;
    `alternate` puts every op whole on the devices in turn: exchanges with one sender only."""
    from search.space import ConfigSpace
    from soapflow.api import capture_model
    from soapflow.calibrate import STEP_STRATEGIES, WORKLOADS, _strategies

    assert "reshard" in STEP_STRATEGIES
    ref = next(w for w in WORKLOADS if w.endswith(":calib_wide_cnn"))
    _, graph = capture_model(ref)
    topo = load_topology("cpu-2")
    strategies = _strategies(graph, topo)
    dp, reshard = strategies["dp"], strategies["reshard"]
    space = ConfigSpace(graph, topo)
    changed = [n for n in space.ops if reshard[n] != dp[n]]
    assert changed and set(changed) <= set(space.ops[1::2])
    for name in changed:
        cfg = reshard[name]
        assert cfg.degree("sample") == 1 and cfg.num_parts == 2 and space.contains(name, cfg)
    # alternate: every op whole, the two devices taking turns in graph order
    alternate = strategies["alternate"]
    assert [alternate[op.name].devices for op in graph] == [(k % 2,) for k in range(len(graph.ops))]
    assert all(alternate[op.name].num_parts == 1 for op in graph)
    assert "alternate" in STEP_STRATEGIES
    values = list(strategies.values())
    assert all(a != b for i, a in enumerate(values) for b in values[i + 1:])  # all distinct


def test_time_strategies_runs_every_strategy_in_every_round() -> None:
    """One process (world size 1): two strategies, three rounds of 1 + 2 steps each; a median per round."""
    import functools

    from runtime.train import TrainOptions, time_strategies
    from soapflow.api import capture_model
    from soapflow.calibrate import TINY_WORKLOADS
    from soapflow.runner import build_workload

    ref = TINY_WORKLOADS[0]
    _, graph = capture_model(ref)
    single = {op.name: ParallelConfig.single(0).to_dict() for op in graph}
    build = functools.partial(build_workload, ref, graph.batch_size)
    options = TrainOptions(setup=TrainSetup())
    out = time_strategies(0, 1, build=build, graph=graph.to_dict(), strategies={"a": single, "b": single},
                          options=options, steps=2, rounds=3)
    assert list(out) == ["a", "b"]
    assert all(len(times) == 3 and all(t > 0 for t in times) for times in out.values())
    with pytest.raises(ValueError, match="positive"):
        time_strategies(0, 1, build=build, graph=graph.to_dict(), strategies={"a": single}, options=options,
                        steps=0)


def test_update_scale_is_fitted_from_timed_optimizer_steps_and_prices_the_update() -> None:
    """Timed optimizer steps that stream 3 passes over the parameter bytes at the model's bandwidth give
    a factor 1 on plain SGD's 3 ideal passes and 3/5 on momentum SGD's 5; a profile with the factor prices
    the update at it times the default."""
    from runtime.measure import time_update
    from simulator.calibration import fit_update_scale

    topology = load_topology("cpu-2")
    device = topology.devices[0]
    plain = MachineProfile(topology=topology, efficiency={"cpu": {"*": 0.2}}, bandwidth_efficiency={"cpu": 0.5},
                           launch_us={"cpu": 0.0})
    model = plain.analytical()
    per_ms = model.bandwidth_bytes_per_ms(device)
    samples = [(n, 3 * n / per_ms) for n in (1 << 25, 1 << 26, 1 << 27)]
    sgd, momentum = TrainSetup(momentum=0.0), TrainSetup(momentum=0.9)
    assert (sgd.update_passes, momentum.update_passes) == (3, 5)
    assert fit_update_scale(samples, model, device, sgd.update_passes) == pytest.approx(1.0)
    scale = fit_update_scale(samples, model, device, momentum.update_passes)
    assert scale == pytest.approx(0.6)
    assert fit_update_scale([], model, device, momentum.update_passes) is None
    fitted = dataclasses.replace(plain, update_scale=scale).analytical()
    passes = momentum.update_passes
    assert fitted.update_ms(1 << 20, device, passes) == pytest.approx(0.6 * model.update_ms(1 << 20, device, passes))
    assert fitted.update_ms(1 << 20, device, passes) == pytest.approx(3 * (1 << 20) / per_ms)  # what was timed
    with pytest.raises(ValueError, match="update_scale"):
        dataclasses.replace(plain, update_scale=0.0)
    # the runtime's timing of it (one process): one (bytes, ms) per size, the bytes in chunks
    timed = time_update(0, 1, sizes=(1 << 20, 3 << 20), setup=momentum, repeats=2, warmup=1, chunk_bytes=1 << 20)
    assert [b for b, _ in timed] == [1 << 20, 3 << 20] and all(ms > 0 for _, ms in timed)
