"""`calibrate`: measure this machine and write a machine profile; what `soapflow calibrate` calls.

The stages, in order:

1. op parts: capture the calibration workloads (small and wide MLPs, a ResNet, a conv stack with large
   activations, LSTM and attention models of this module, NOT the models `soapflow validate` or the
   accuracy benchmark checks), take every distinct part of each op under the strategies of stage 4, and
   time them forward and backward alone and in N concurrent processes (`runtime.measure.measure_parts`;
   parts already in the cost database are not timed again);
2. communication: time point-to-point, all-reduce, all-gather and reduce-scatter between N local processes over a
   spread of sizes (`runtime.measure.time_comm`), and the runtime's optimizer step (the setup's) over
   parameters beyond the caches (`runtime.measure.time_update`);
3. fits (`simulator.calibration`): the analytical model's per-op-kind efficiency, bandwidth efficiency
   and launch cost from the op parts; link latency and bandwidth from the transfers, and what the
   backend's all-gather and reduce-scatter cost beyond their rings on those links; the factor on the
   optimizer step's ideal passes over the parameter bytes (`update_scale`, against the setup's
   `TrainSetup.update_passes`);
4. runtime overhead: train each calibration workload under `STEP_STRATEGIES`, interleaved in one job
   (`runtime.train.time_strategies`), and fit what the simulator (measured parts, fitted links) leaves
   unexplained: the step's factor on part times, the runtime's cost per op part pass, and its
   communication overhead (`simulator.comm.CommOverhead`);
5. write the profile (a topology file with a ``calibration`` key, loadable by `load_topology`) and report.

Every stage that trains or simulates a step uses the caller's training setup (`soap.setup.TrainSetup`).

Must not be imported by `runtime`, `simulator` or `search`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runtime.executor import recurrent_kinds
from runtime.launch import launch
from runtime.measure import measure_parts, part_jobs, time_comm, time_update
from runtime.train import TrainOptions, time_strategies
from search.baselines import BASELINES, BaselineNotApplicable
from search.space import ConfigSpace
from simulator.calibration import (
    STEP_COMM_TERMS,
    CommSample,
    MachineProfile,
    OpSample,
    StepSample,
    fit_collective_overhead,
    fit_comm,
    fit_compute,
    fit_overhead,
    fit_update_scale,
    profile_devices,
    write_profile,
)
from simulator.comm import CommOverhead
from simulator.engine import simulate
from soap.config import ParallelConfig
from soap.costdb import part_key
from soap.setup import TrainSetup
from soap.strategy import Strategy
from soap.topology import DeviceTopology, load_topology
from soapflow.api import capture_model
from soapflow.runner import build_workload
from soapflow.zoo.cnn import resnet18
from soapflow.zoo.mlp import mlp
from soapflow.zoo.rnn import rnnlm
from soapflow.zoo.transformer import transformer

# Sizes (bytes) of the transfers timed: 4 KiB to 16 MiB, a factor 4 apart.
COMM_SIZES = tuple(4096 * 4 ** i for i in range(7))
# Parameter bytes the optimizer step is timed over: beyond the cores' caches, as a model's are in a step.
UPDATE_SIZES = (32 << 20, 64 << 20, 128 << 20)


# -- calibration workloads (importable by reference, so that worker processes can rebuild them) -----------


def calib_mlp(batch_size: int = 48) -> tuple:
    return mlp(batch_size, sizes=(768, 1536, 384, 1536, 512))


def calib_wide_mlp(batch_size: int = 64) -> tuple:
    """Weights of 16 MiB each: a working set far beyond the cores' caches, which the small workloads keep
    within them (a training step slows parts down more when their operands come from memory)."""
    return mlp(batch_size, sizes=(2048, 2048, 2048, 1024))


def calib_cnn(batch_size: int = 12) -> tuple:
    return resnet18(batch_size, num_classes=40, image_size=40)


class _ConvStack(nn.Module):
    """Three conv-BN-ReLU layers of 16 channels on 64x64 images, no pooling until the classifier: few
    ops, each with activations of 2 MiB at batch 8 (the runtime's cost per byte exchanged shows beside
    its cost per exchange)."""

    def __init__(self, channels: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for c_in in (3, channels, channels):
            layers += [nn.Conv2d(c_in, channels, kernel_size=3, padding=1), nn.BatchNorm2d(channels), nn.ReLU()]
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1))
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def calib_wide_cnn(batch_size: int = 8) -> tuple:
    x = torch.empty(batch_size, 3, 64, 64, device="meta")
    labels = torch.empty(batch_size, dtype=torch.long, device="meta")
    return _ConvStack(), (x, labels)


def calib_lstm(batch_size: int = 12) -> tuple:
    return rnnlm(batch_size, hidden=192, embed=160, vocab=2500, steps=12, layers=1)


def calib_attention(batch_size: int = 6) -> tuple:
    return transformer(batch_size, layers=1, d_model=160, heads=4, seq=48, vocab=1500)


WORKLOADS = (f"{__name__}:calib_mlp", f"{__name__}:calib_wide_mlp", f"{__name__}:calib_cnn",
             f"{__name__}:calib_wide_cnn", f"{__name__}:calib_lstm", f"{__name__}:calib_attention")
TINY_WORKLOADS = (f"{__name__}:calib_mlp",)


def _step_samples(ref: str, graph, strategies: Mapping[str, Strategy], *, topology: DeviceTopology, db,
                  profile: MachineProfile, setup: TrainSetup, nproc: int, backend: str, steps: int, rounds: int,
                  timeout_s: float) -> list[StepSample]:
    """Train `ref` with `setup` under each of `strategies` in one job, interleaved (`runtime.train.time_strategies`:
    `rounds` rounds of 1 + `steps` steps per strategy); per strategy the measured iteration time (the
    median over the rounds of each round's median step, slowest rank) beside the simulated one and its
    slopes (see `StepSample`)."""
    kwargs = {"build": functools.partial(build_workload, ref, graph.batch_size), "graph": graph.to_dict(),
              "strategies": {name: {n: cfg.to_dict() for n, cfg in st.items()} for name, st in strategies.items()},
              "steps": steps, "rounds": rounds, "options": TrainOptions(setup=setup, timeout_s=timeout_s)}
    # `timeout_s` bounds each step (time_strategies), not the whole job
    measured = launch(time_strategies, nproc, kwargs=kwargs, backend=backend, timeout_s=timeout_s,
                      num_threads=1)[0]
    # per slope of the step fit: the profile's own communication overhead (the backend's collectives)
    # with one millisecond (per unit) more of that term
    have = profile.comm_overhead
    one = {slope: dataclasses.replace(have, **{field: getattr(have, field) + unit})
           for slope, field, unit in STEP_COMM_TERMS}
    out = []
    for name, strategy in strategies.items():
        def sim(strategy=strategy, **changes: Any) -> float:
            model = dataclasses.replace(profile, **changes).cost_model(db)
            return simulate(graph, strategy, topology, model, setup=setup).summary()["iteration_time_ms"]

        base = sim()
        # slopes of the simulated time: per unit of compute scale (every part twice as long), per ms of
        # overhead per pass, per ms per exchange and per sync, per ms per GB all-reduced and exchanged
        compute = max(0.0, sim(compute_scale=2.0 * profile.compute_scale) - base)
        passes = max(0.0, sim(overhead_us=profile.overhead_us + 1e3) - base)
        comm = {k: max(0.0, sim(comm_overhead=v) - base) for k, v in one.items()}
        out.append(StepSample(name=f"{ref.rpartition(':')[2]}/{name}", measured_ms=statistics.median(measured[name]),
                              base_ms=base, num_passes=passes, compute_ms=compute, **comm))
    return out


def _single(graph, device: int = 0) -> Strategy:
    return Strategy({op.name: ParallelConfig.single(device) for op in graph})


STEP_STRATEGIES = ("single", "dp", "tp", "mp", "expert", "fsdp", "mixed", "reshard", "alternate")


def _strategies(graph, topology: DeviceTopology) -> dict[str, Strategy]:
    """The strategies calibration times parts of and trains: one device, the baselines that apply (fsdp
    among them: the steps see the runtime gather and reduce-scatter sharded parameters), and
    `mixed`: dp with every other op (in graph order) given a config drawn at random (seed 0), so that the
    steps also see strategies with many small exchanges, as a search's candidates have."""
    out = {"single": _single(graph)}
    for name in ("dp", "tp", "mp", "expert", "fsdp"):
        try:
            out[name] = BASELINES[name](graph, topology)
        except BaselineNotApplicable:
            pass
    if "dp" in out:
        space = ConfigSpace(graph, topology)
        mixed = space.random_strategy(random.Random(0), out["dp"], ops=space.ops[::2])
        if all(mixed != other for other in out.values()):
            out["mixed"] = mixed
        reshard = _reshard(space, out["dp"])
        if all(reshard != other for other in out.values()):
            out["reshard"] = reshard
    alternate = _alternate(graph, topology)
    if all(alternate != other for other in out.values()):
        out["alternate"] = alternate
    return out


def _alternate(graph, topology: DeviceTopology) -> Strategy:
    """Every op whole on one device, the devices taking turns in graph order: each op's output moves to
    the next device, and only one device sends in each exchange (no two ranks arrive at it with compute
    of their own behind them), so the steps see the cost per exchange apart from the cost of waiting for
    the later rank."""
    configs = {}
    for k, op in enumerate(graph):
        configs[op.name] = ParallelConfig.single(k % topology.num_devices)
    return Strategy(configs)


def _reshard(space: ConfigSpace, dp: Strategy) -> Strategy:
    """`dp` with every other op (in graph order, those `mixed` leaves alone) split as many ways over the
    same devices along its first other dim that allows it: nearly every activation and gradient is
    exchanged whole between the two partitionings, so the steps see the runtime's cost per byte
    exchanged (packing, unpacking, accumulating) apart from its cost per exchange."""
    configs = dict(dp.configs)
    for name in space.ops[1::2]:
        base = dp[name]
        for degrees in space.degree_options(name):
            split = dict(degrees)
            if "sample" not in split and math.prod(split.values()) == base.num_parts:
                configs[name] = ParallelConfig(degrees=split, devices=base.devices)
                break
    return Strategy({op.name: configs[op.name] for op in space.graph})


class _Stages:
    """Progress reporting: `progress({"stage": ..., "elapsed_s": ..., ...})`."""

    def __init__(self, progress: Callable[[Mapping[str, Any]], None] | None):
        self.progress = progress
        self.start = time.monotonic()

    def __call__(self, stage: str, **info: Any) -> None:
        if self.progress is not None:
            self.progress({"stage": stage, "elapsed_s": time.monotonic() - self.start, **info})


def calibrate(nproc: int = 2, backend: str = "gloo", output: str | os.PathLike = "machine.json",
              costdb: str | os.PathLike | None = None, progress: Callable[[Mapping[str, Any]], None] | None = None,
              *, workloads: tuple[str, ...] = WORKLOADS, repeats: int = 5, comm_sizes: tuple[int, ...] = COMM_SIZES,
              comm_repeats: int = 5, overhead_steps: int = 4, overhead_rounds: int = 3,
              timeout_s: float = 300.0, setup: TrainSetup | None = None) -> dict[str, Any]:
    """Measure this machine with `nproc` local processes, training with `setup` (None: `TrainSetup()`),
    and write the machine profile `output`.

    The cost database (`costdb`; default ``<output stem>.costdb.jsonl`` beside the
    output) receives every part timed and is reused: parts already there are not timed again. Returns a
    JSON-able report (the fitted figures, the fits' errors, what was measured, elapsed time). Bad input
    raises `ValueError`.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r}; known: gloo, nccl")
    if backend == "nccl":
        raise ValueError("backend nccl is not supported yet: the runtime computes on CPU tensors (use gloo)")
    if nproc < 2:
        raise ValueError(f"--nproc must be at least 2 (transfers are measured between processes), got {nproc}")
    setup = setup if setup is not None else TrainSetup()
    stage = _Stages(progress)
    output = Path(output)
    db_path = Path(costdb) if costdb is not None else output.with_name(f"{output.stem}.costdb.jsonl")
    preset = load_topology(f"cpu-{nproc}")
    device = preset.devices[0]

    # 1. op parts
    captured = []
    jobs = []
    for ref in workloads:
        stage("capture", workload=ref.rpartition(":")[2])
        _, graph = capture_model(ref)
        strategies = _strategies(graph, preset)
        captured.append((ref, graph, strategies))
        jobs += part_jobs(graph, strategies.values(), device_kind=device.kind)
        recurrent = recurrent_kinds(graph) if setup.compute_dtype == "float16" else []
        if recurrent:  # the runtime would refuse its steps, after the minutes of timing before them
            raise ValueError(f"calibrate --precision fp16: the calibration workload {ref.rpartition(':')[2]} "
                             f"has a recurrent op ({', '.join(recurrent)}), whose CPU kernel has no float16 "
                             "form; calibrate with --precision bf16 or fp32")
    stage("op parts", parts=len(jobs))
    db, num_timed = measure_parts(jobs, os.fspath(db_path), device_kind=device.kind, nproc=nproc,
                                  repeats=repeats, timeout_s=timeout_s, source="calibrate")
    samples = []
    for job in jobs:
        op = job.operator()
        found = db.lookup(part_key(op, job.box, device.kind, job.needs_grad))
        if found is not None:
            samples.append(OpSample(op=op, box=job.box, fwd_ms=found.fwd_ms, bwd_ms=found.bwd_ms))

    # 2. communication
    stage("communication", sizes=len(comm_sizes))
    per_rank = launch(time_comm, nproc, kwargs={"sizes": comm_sizes, "repeats": comm_repeats},
                      backend=backend, timeout_s=timeout_s, wall_timeout_s=timeout_s, num_threads=1)
    comm_samples = [CommSample(kind=kind, nbytes=nbytes, world=nproc,
                               time_ms=max(1e-6, statistics.median(r[kind][i][1] for r in per_rank)))
                    for kind in per_rank[0] for i, (nbytes, _) in enumerate(per_rank[0][kind])]

    stage("optimizer step", sizes=len(UPDATE_SIZES))
    updates = launch(time_update, nproc, kwargs={"sizes": UPDATE_SIZES, "setup": setup, "repeats": comm_repeats},
                     backend=backend, timeout_s=timeout_s, wall_timeout_s=timeout_s, num_threads=1)
    update_samples = [(nbytes, max(r[i][1] for r in updates)) for i, (nbytes, _) in enumerate(updates[0])]

    # 3. fits
    stage("fit")
    compute = fit_compute(samples, device)
    comm = fit_comm(comm_samples, preset)
    fitted_links = DeviceTopology(name=output.stem, devices=preset.devices, links=tuple(
        type(link)(id=link.id, src=link.src, dst=link.dst, kind=link.kind, spec=link.spec,
                   bandwidth_gbps=comm.bandwidth_gbps, latency_us=comm.latency_us) for link in preset.links))
    topology, efficiency, bw_eff = profile_devices(fitted_links, compute)
    profile = MachineProfile(topology=topology, efficiency={device.kind: efficiency},
                             bandwidth_efficiency={device.kind: bw_eff}, launch_us={device.kind: compute.launch_us})
    update_scale = fit_update_scale(update_samples, profile.analytical(), topology.devices[0], setup.update_passes)
    # what the backend's all-gather and reduce-scatter cost beyond their rings on the fitted links
    collectives = fit_collective_overhead(comm_samples, fitted_links)
    profile = dataclasses.replace(profile, update_scale=update_scale, comm_overhead=CommOverhead(**collectives))

    # 4. the step's factor and the runtime's overheads (per op part pass, per exchange, per synchronizing
    # collective, per GB all-reduced), from training steps of the workloads
    steps: list[StepSample] = []
    for ref, graph, strategies in captured:
        chosen = {name: strategies[name] for name in STEP_STRATEGIES if name in strategies}
        stage("runtime overhead", workload=ref.rpartition(":")[2], strategies=list(chosen))
        steps += _step_samples(ref, graph, chosen, topology=topology, db=db, profile=profile, setup=setup,
                               nproc=nproc, backend=backend, steps=overhead_steps, rounds=overhead_rounds,
                               timeout_s=timeout_s)
    extra = fit_overhead(steps)
    extra = dataclasses.replace(extra, comm=dataclasses.replace(extra.comm, **collectives))
    overhead_ms = extra.overhead_ms

    try:
        costdb_ref = os.path.relpath(db_path, output.parent if output.parent != Path("") else Path("."))
    except ValueError:
        costdb_ref = os.fspath(db_path)
    report: dict[str, Any] = {
        "nproc": nproc, "backend": backend, "num_threads": 1,
        "comm": {"latency_us": comm.latency_us, "bandwidth_gbps": comm.bandwidth_gbps,
                 "alpha_beta": {k: {"alpha_us": a, "beta_gbps": b} for k, (a, b) in comm.alpha_beta.items()},
                 "median_abs_error": comm.median_abs_error, "max_abs_error": comm.max_abs_error,
                 "default_median_abs_error": comm.default_median_abs_error,
                 "samples": [{"kind": s.kind, "bytes": s.nbytes, "time_ms": s.time_ms} for s in comm_samples]},
        "update": {"scale": update_scale, "passes": setup.update_passes,
                   "samples": [{"bytes": b, "time_ms": t} for b, t in update_samples]},
        "compute": {"median_abs_error": compute.median_abs_error,
                    "default_median_abs_error": compute.default_median_abs_error,
                    "num_samples": compute.num_samples},
        "steps": [{"workload": s.name, "measured_ms": s.measured_ms, "simulated_ms": s.base_ms,
                   "compute_ms": s.compute_ms, "num_passes": s.num_passes,
                   **{slope: getattr(s, slope) for slope, _, _ in STEP_COMM_TERMS}}
                  for s in steps],
    }
    profile = MachineProfile(topology=topology, efficiency=profile.efficiency,
                             bandwidth_efficiency=profile.bandwidth_efficiency, launch_us=profile.launch_us,
                             overhead_us=overhead_ms * 1e3, compute_scale=extra.compute_scale,
                             comm_overhead=extra.comm, update_scale=update_scale, costdb=costdb_ref,
                             report={"fit": report})
    write_profile(output, profile)
    stage("done")
    dev = topology.devices[0]
    return {
        "output": os.fspath(output), "costdb": os.fspath(db_path), "nproc": nproc, "backend": backend,
        "elapsed_s": time.monotonic() - stage.start,
        "parts_measured": num_timed, "parts_total": len(samples),
        "peak_tflops": {k: v / 1e12 for k, v in dev.peak_flops.items()},
        "memory_bandwidth_gbps": dev.memory_bandwidth_gbps,
        "efficiency": dict(efficiency), "bandwidth_efficiency": bw_eff, "launch_us": compute.launch_us,
        "overhead_us": overhead_ms * 1e3, "compute_scale": extra.compute_scale,
        "comm_overhead": extra.comm.to_dict(), "update_scale": update_scale, "setup": setup.to_dict(),
        "latency_us": topology.links[0].latency_us,
        "bandwidth_gbps": topology.links[0].bandwidth_gbps,
        **{k: v for k, v in report.items() if k not in ("nproc", "backend")},
    }


def calibrate_text(report: Mapping[str, Any]) -> str:
    """The report for people: fitted figures, fit errors, where the profile went."""
    lines = [f"machine profile: {report['output']}  (cost database: {report['costdb']}, "
             f"{report['parts_measured']} new part(s) timed of {report['parts_total']})",
             f"processes: {report['nproc']} ({report['backend']}, 1 thread each), "
             f"elapsed {report['elapsed_s']:.1f} s", ""]
    peak = report["peak_tflops"].get("float32")
    lines.append(f"device: peak {peak * 1e3:.1f} GFLOP/s (float32), memory {report['memory_bandwidth_gbps']:.1f} "
                 f"GB/s x {report['bandwidth_efficiency']:.2f}, launch {report['launch_us']:.1f} us, "
                 f"runtime overhead {report['overhead_us']:.1f} us per op pass, parts {report['compute_scale']:.2f}x "
                 "slower in a training step than alone")
    if report.get("update_scale") is not None:
        setup = TrainSetup.from_dict(report["setup"])
        lines.append(f"optimizer step ({setup.optimizer}): {report['update_scale']:.2f}x the time of its "
                     f"{setup.update_passes} passes over the parameter bytes at that memory bandwidth")
    eff = report["efficiency"]
    lines.append("efficiency (fraction of peak) by op kind: "
                 + ", ".join(f"{k} {v:.2f}" for k, v in sorted(eff.items(), key=lambda kv: -kv[1])))
    c = report["compute"]
    lines.append(f"op part fit: median |error| {c['median_abs_error']:.1%} over {c['num_samples']} parts "
                 f"(default constants: {c['default_median_abs_error']:.1%})")
    comm = report["comm"]
    lines.append("")
    lines.append(f"links: latency {report['latency_us']:.1f} us per hop, bandwidth {report['bandwidth_gbps']:.3f} "
                 f"GB/s; transfer fit median |error| {comm['median_abs_error']:.1%} (max {comm['max_abs_error']:.1%}; "
                 f"preset figures: {comm['default_median_abs_error']:.1%})")
    ov = report["comm_overhead"]
    lines.append(f"runtime on top of the links: {ov['exchange_us']:.1f} us per exchange "
                 f"(+ {ov['sync_us']:.1f} us per all-reduce and per exchange where several processes send), "
                 f"{ov['allreduce_ms_per_gb']:.0f} ms per GB all-reduced, "
                 f"{ov['exchange_ms_per_gb']:.0f} ms per GB a process sends or receives in an exchange")
    lines.append(f"backend beyond the rings: all-gather {ov['allgather_us']:.1f} us + "
                 f"{ov['allgather_ms_per_gb']:.0f} ms per GB gathered, reduce-scatter "
                 f"{ov['reduce_scatter_us']:.1f} us + {ov['reduce_scatter_ms_per_gb']:.0f} ms "
                 f"per GB reduced; {ov['shard_us']:.1f} us + {ov['shard_ms_per_gb']:.0f} ms "
                 "per GB more for each inside a training step")
    for kind, ab in comm["alpha_beta"].items():
        lines.append(f"  {kind:<10} alpha {ab['alpha_us']:8.1f} us   beta {ab['beta_gbps']:.3f} GB/s")
    lines.append("")
    for s in report["steps"]:
        lines.append(f"step {s['workload']:<20} measured {s['measured_ms']:8.2f} ms   simulated without overhead "
                     f"{s['simulated_ms']:8.2f} ms   {s['num_passes']:.0f} op passes, "
                     f"{s['num_exchanges']:.0f} exchanges")
    return "\n".join(lines)


__all__ = ["COMM_SIZES", "TINY_WORKLOADS", "WORKLOADS", "calibrate", "calibrate_text"]
