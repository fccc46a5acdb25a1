"""Refit of the cost model's constants to calibration measurements, and the machine profile.

Owns the samples calibration collects (`OpSample`: a timed op part; `CommSample`: a timed transfer or
collective; `StepSample`: a timed training step of a calibration workload), the least-squares fits
(`fit_compute`, `fit_comm`, `fit_overhead`), the machine profile (`MachineProfile`, `write_profile`,
`read_profile`) and `cost_model_for`, which turns a topology reference into the cost model to simulate
with (for a preset, the cost databases shipped for its device kinds: `simulator.shipped`).

Every fit minimizes RELATIVE residuals (a 10 us op mispredicted by 10 us weighs as much as a 100 ms op
mispredicted by 100 ms), and every fit predicts with the simulator's own formulas - the analytical
roofline of `simulator.costmodel` and the alpha-beta/ring formulas of `simulator.comm` - so the fitted
constants are the ones that make the simulator reproduce the calibration measurements:

- `fit_compute`: per op kind the fraction of peak FLOP/s, one memory-bandwidth efficiency per device
  kind, and one launch overhead (scipy `least_squares` on log(predicted / measured) of the forward and
  backward times of every sample);
- `fit_comm`: link latency and bandwidth of a topology. Simulated transfer and collective times are
  linear in (latency, 1/bandwidth) for a fixed topology, so this is a weighted non-negative linear least
  squares (scipy `nnls`);
- `fit_overhead`: what a training step adds to the parts timed alone - a factor on every part's time
  (in a step an op finds its operands out of cache), the runtime's own cost per op part and pass (its
  interpreter, redistribution bookkeeping, autograd calls), per exchange, per synchronizing collective,
  per GB all-reduced and per GB exchanged (`simulator.comm.CommOverhead`: on top of the links, which stay
  the wire that `fit_comm` measured) - from whole training steps of calibration workloads: measured step
  time = simulated step time without them + (compute on the critical path) x (factor - 1) + (part passes
  on the critical path) x overhead + (exchanges) x cost per exchange + (synchronizing collectives) x cost
  per sync + (GB all-reduced) x cost per GB + (GB exchanged) x cost per GB, each on the critical path;
  non-negative linear least squares (scipy `nnls`, then a robust refinement), the slopes taken from the
  simulator itself.
- `fit_update_scale`: the factor on the optimizer step's ideal passes over the parameter bytes, from timed
  optimizer steps.

Fits use calibration measurements only, never validation runs (`soapflow.validate` measures strategies
of the models under test and compares; nothing here sees them).

The machine profile is a topology file (`soap.topology`: devices with fitted `peak_tflops` and
`memory_bandwidth_gbps`, links with fitted `bandwidth_gbps` and `latency_us`) with one more top-level key,
``"calibration"``, that the topology loader ignores::

    "calibration": {"format": "soapflow.calibration/1", "device_kind": "cpu",
                    "efficiency": {"cpu": {"linear": 0.41, "conv2d": 0.3, "*": 0.2}},
                    "bandwidth_efficiency": {"cpu": 1.0}, "launch_us": {"cpu": 12.0},
                    "overhead_us": 85.0, "compute_scale": 1.3,
                    "comm_overhead": {"exchange_us": 300.0, "sync_us": 500.0,
                                      "allreduce_ms_per_gb": 200.0, "exchange_ms_per_gb": 450.0},
                    "update_scale": 1.2, "costdb": "machine.costdb.jsonl", "fit": {...}}

Must import only `soap`, the other `simulator` modules, numpy and scipy (no torch, runtime or search).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from simulator.comm import ALLGATHER, ALLREDUCE, NO_OVERHEAD, REDUCE_SCATTER, Comm, CommOverhead
from simulator.costmodel import (
    FREE_KINDS,
    VIEW_KINDS,
    AnalyticalCostModel,
    CostModel,
    MeasuredCostModel,
    part_bytes,
    part_share,
)
from simulator.shipped import ShippedCostModel, shipped_costdb
from soap import costdb
from soap.graph import Operator
from soap.opdef import Box
from soap.topology import Device, DeviceTopology, Link, load_topology, read_topology

PROFILE_FORMAT = "soapflow.calibration/1"
P2P = "p2p"
_SCALE = 1e3


# ----------------------------------------------------------------------------------------------- samples


@dataclass(frozen=True, slots=True, kw_only=True)
class OpSample:
    """A timed op part: forward and backward medians in milliseconds."""

    op: Operator
    box: Box
    fwd_ms: float
    bwd_ms: float

    def __post_init__(self) -> None:
        if not (self.fwd_ms >= 0 and self.bwd_ms >= 0):
            raise ValueError(f"op sample {self.op.name}: times must be >= 0, got {self.fwd_ms}, {self.bwd_ms}")


COMM_SAMPLE_KINDS = (P2P, ALLREDUCE, ALLGATHER, REDUCE_SCATTER)


@dataclass(frozen=True, slots=True, kw_only=True)
class CommSample:
    """A timed transfer (`p2p`, device 0 to device 1) or collective (`allreduce`, `allgather`,
    `reduce_scatter` over devices 0..world-1) of `nbytes` (the whole tensor: an all-gather's result, a
    reduce-scatter's input) taking `time_ms`."""

    kind: str
    nbytes: int
    time_ms: float
    world: int = 2

    def __post_init__(self) -> None:
        if self.kind not in COMM_SAMPLE_KINDS:
            raise ValueError(f"unknown communication kind {self.kind!r}; known: {', '.join(COMM_SAMPLE_KINDS)}")
        if self.nbytes < 0 or not self.time_ms > 0 or self.world < 2:
            raise ValueError(f"comm sample needs nbytes >= 0, time_ms > 0, world >= 2; got {self}")


# The step fit's communication terms: the `StepSample` slope, the `CommOverhead` field it prices, and the
# field's unit in the slope's (a slope is per millisecond of the term: 1e3 for a field in us, 1 for ms/GB)
STEP_COMM_TERMS = (("num_exchanges", "exchange_us", 1e3), ("num_syncs", "sync_us", 1e3),
                   ("allreduce_gb", "allreduce_ms_per_gb", 1.0), ("exchange_gb", "exchange_ms_per_gb", 1.0),
                   ("num_shard_collectives", "shard_us", 1e3), ("shard_gb", "shard_ms_per_gb", 1.0))


@dataclass(frozen=True, slots=True, kw_only=True)
class StepSample:
    """A timed training step: `measured_ms`; the simulated time of the same step with no runtime overhead
    and the fitted links (`base_ms`); and how much the simulated time grows when every measured part
    takes twice as long (`compute_ms`: the compute on the critical path), per millisecond of overhead
    per op part pass (`num_passes`: the passes on the critical path), per millisecond per exchange
    (`num_exchanges`), per millisecond per synchronizing collective (`num_syncs`: all-reduces and the
    exchanges in which several devices send), per millisecond per GB all-reduced (`allreduce_gb`), per
    millisecond per GB an exchange's busiest process sends plus receives (`exchange_gb`) and per
    millisecond per all-gather or reduce-scatter of sharded parameters (`num_shard_collectives`) and per
    millisecond per GB they gather or reduce (`shard_gb`), each on the critical path."""

    name: str
    measured_ms: float
    base_ms: float
    num_passes: float
    num_exchanges: float = 0.0
    num_syncs: float = 0.0
    allreduce_gb: float = 0.0
    compute_ms: float = 0.0
    exchange_gb: float = 0.0
    num_shard_collectives: float = 0.0
    shard_gb: float = 0.0

    def slopes(self) -> tuple[float, ...]:
        """(compute_ms, num_passes, then the slopes of `STEP_COMM_TERMS` in order)."""
        return (self.compute_ms, self.num_passes, *(getattr(self, slope) for slope, _, _ in STEP_COMM_TERMS))

    def __post_init__(self) -> None:
        if not (self.measured_ms > 0 and self.base_ms >= 0 and all(v >= 0 for v in self.slopes())):
            raise ValueError(f"step sample {self.name}: bad figures {self}")


# ------------------------------------------------------------------------------------------- compute fit


@dataclass(frozen=True, slots=True, kw_only=True)
class ComputeFit:
    """Fitted analytical constants for one device kind and how well they reproduce the samples."""

    device_kind: str
    efficiency: Mapping[str, float]  # op kind -> fraction of the device's peak FLOP/s ('*': the rest)
    bandwidth_efficiency: float
    launch_us: float
    median_abs_error: float  # over the samples' forward and backward times, relative
    num_samples: int
    default_median_abs_error: float  # the same with the default constants

    def cost_model(self, base: AnalyticalCostModel | None = None, *, extra_launch_us: float = 0.0
                   ) -> AnalyticalCostModel:
        eff = {k: min(1.0, v) for k, v in self.efficiency.items()}
        return AnalyticalCostModel(efficiency={self.device_kind: eff},
                                   bandwidth_efficiency={self.device_kind: min(1.0, self.bandwidth_efficiency)},
                                   launch_us={self.device_kind: self.launch_us + extra_launch_us},
                                   update_scale=(base or AnalyticalCostModel()).update_scale)


def _times(model: CostModel, samples: Sequence[OpSample], device: Device) -> np.ndarray:
    out = []
    for s in samples:
        f, b = model.compute_ms(s.op, s.box, device)
        out += [f, b]
    return np.asarray(out)


def _rel_errors(pred: np.ndarray, measured: np.ndarray) -> np.ndarray:
    return np.abs(pred - measured) / measured


def fit_compute(samples: Sequence[OpSample], device: Device, *, min_ms: float = 1e-3) -> ComputeFit:
    """Least-squares fit of the roofline constants of `device.kind` to the samples (see the module
    docstring). Efficiencies may come out above 1 when the device's peak is set too low: `profile_devices`
    then raises the peak so that every efficiency is at most 1."""
    from scipy.optimize import least_squares

    kept = [s for s in samples if s.op.kind not in FREE_KINDS and s.fwd_ms >= min_ms and s.bwd_ms >= min_ms]
    if not kept:
        raise ValueError("fit_compute needs at least one op sample with a time above the resolution")
    measured = np.asarray([t for s in kept for t in (s.fwd_ms, s.bwd_ms)])
    kinds = sorted({s.op.kind for s in kept if s.op.kind not in VIEW_KINDS and s.op.fwd_flops > 0})
    default = AnalyticalCostModel()
    x0 = [math.log(default.flop_efficiency(device.kind, k)) for k in kinds]
    x0 += [math.log(default.bandwidth_efficiency.get(device.kind, default.bandwidth_efficiency["*"])),
           math.log(default.launch_us.get(device.kind, default.launch_us["*"]))]

    # The fit prices with AnalyticalCostModel itself on a copy of the device _SCALE times faster, so that
    # efficiencies above 1 (a datasheet peak set too low) stay inside the model's (0, 1] range.
    fast = Device(id=device.id, kind=device.kind, node=device.node,
                  peak_flops={k: v * _SCALE for k, v in device.peak_flops.items()},
                  memory_bandwidth_gbps=device.memory_bandwidth_gbps * _SCALE, memory_bytes=device.memory_bytes)

    def constants(x: np.ndarray) -> tuple[dict[str, float], float, float]:
        eff = {k: float(v) for k, v in zip(kinds, np.exp(x[:len(kinds)]), strict=True)}
        return eff, float(np.exp(x[len(kinds)])), float(np.exp(x[len(kinds) + 1]))

    def model_of(x: np.ndarray) -> AnalyticalCostModel:
        eff, bw_eff, launch_us = constants(x)
        rest = float(np.median(list(eff.values()))) if eff else 0.5
        table = {k: v / _SCALE for k, v in eff.items()} | {"*": rest / _SCALE}
        return AnalyticalCostModel(efficiency={device.kind: table},
                                   bandwidth_efficiency={device.kind: bw_eff / _SCALE},
                                   launch_us={device.kind: launch_us})

    def residuals(x: np.ndarray) -> np.ndarray:
        return np.log(_times(model_of(x), kept, fast) / measured)

    lo = [math.log(1e-4)] * len(kinds) + [math.log(1e-3), math.log(0.01)]
    hi = [math.log(_SCALE)] * len(kinds) + [math.log(_SCALE), math.log(1e5)]
    x0 = np.clip(x0, lo, hi)
    result = least_squares(residuals, x0, bounds=(lo, hi), loss="soft_l1", f_scale=0.3, diff_step=1e-4)
    eff, bw_eff, launch_us = constants(result.x)
    # A kind whose FLOP term never exceeds its bytes term in any sample is priced by the bandwidth: its
    # efficiency is not identifiable, so it gets the median of the identified kinds, as '*' (kinds not
    # sampled) does.
    peak = device.peak_flops.get("float32") or max(device.peak_flops.values())
    bytes_per_ms = device.memory_bandwidth_gbps * bw_eff * 1e6
    bound = {k for k in kinds for s in kept if s.op.kind == k and
             s.op.fwd_flops * part_share(s.op, s.box) / (peak * eff[k] / 1e3) > part_bytes(s.op, s.box) / bytes_per_ms}
    rest = float(np.median([eff[k] for k in bound])) if bound else default.flop_efficiency(device.kind, "*")
    eff = {k: (v if k in bound else rest) for k, v in eff.items()} | {"*": rest}
    fitted = _times(model_of(result.x), kept, fast)
    return ComputeFit(device_kind=device.kind, efficiency=eff, bandwidth_efficiency=bw_eff,
                      launch_us=launch_us,
                      median_abs_error=float(np.median(_rel_errors(fitted, measured))),
                      num_samples=len(kept),
                      default_median_abs_error=float(np.median(_rel_errors(_times(default, kept, device),
                                                                           measured))))


# ---------------------------------------------------------------------------------------------- comm fit


@dataclass(frozen=True, slots=True, kw_only=True)
class CommFit:
    """Fitted per-hop latency and bandwidth of a topology's links, alpha-beta per kind, and the error."""

    latency_us: float
    bandwidth_gbps: float
    alpha_beta: Mapping[str, tuple[float, float]]  # kind -> (alpha us, beta GB/s), a line through its samples
    median_abs_error: float
    max_abs_error: float
    default_median_abs_error: float


def _with_links(topology: DeviceTopology, *, latency_us: float, bandwidth_gbps: float) -> DeviceTopology:
    links = tuple(Link(id=link.id, src=link.src, dst=link.dst, kind=link.kind, spec=link.spec,
                       bandwidth_gbps=bandwidth_gbps, latency_us=latency_us) for link in topology.links)
    return DeviceTopology(name=topology.name, devices=topology.devices, links=links)


def simulated_comm_ms(topology: DeviceTopology, sample: CommSample) -> float:
    """What `simulator.comm` charges for the sample's transfer or collective on `topology`."""
    comm = Comm(topology)
    if sample.kind == P2P:
        return comm.transfer(0, 1, sample.nbytes)[1] / 1e6
    return comm.collective(tuple(range(sample.world)), sample.nbytes, sample.kind)[1] / 1e6


def alpha_beta(samples: Sequence[CommSample]) -> tuple[float, float]:
    """(alpha us, beta GB/s) of t = alpha + bytes / beta through the samples (relative least squares)."""
    from scipy.optimize import nnls

    t = np.asarray([s.time_ms * 1e3 for s in samples])  # us
    a = np.stack([np.ones(len(samples)), np.asarray([s.nbytes / 1e3 for s in samples])], axis=1)  # us per GB/s
    coef, _ = nnls(a / t[:, None], np.ones(len(samples)))
    alpha, inv_beta = coef
    return float(alpha), float(1.0 / inv_beta) if inv_beta > 0 else math.inf


def fit_comm(samples: Sequence[CommSample], topology: DeviceTopology, *,
             kinds: Sequence[str] = (P2P, ALLREDUCE)) -> CommFit:
    """One latency (us per hop) and one bandwidth (GB/s) for every link of `topology` that make the
    simulator's transfer and collective times fit the samples of `kinds` (relative least squares).

    The links are fitted to the point-to-point transfers (redistribution) and the all-reduces (gradient
    synchronization); what the backend's all-gather and reduce-scatter cost beyond their rings on those
    links is `fit_collective_overhead`'s. Every kind's line is reported (`alpha_beta`).
    """
    from scipy.optimize import nnls

    used = [s for s in samples if s.kind in kinds]
    if len(used) < 2:
        raise ValueError(f"fit_comm needs at least two samples of {', '.join(kinds)}")
    # simulated time = latency_us * A + (1 / bandwidth) * B: evaluate A and B on unit topologies
    lat_only = _with_links(topology, latency_us=1.0, bandwidth_gbps=1e12)
    bw_only = _with_links(topology, latency_us=0.0, bandwidth_gbps=1.0)
    a = np.asarray([[simulated_comm_ms(lat_only, s), simulated_comm_ms(bw_only, s)] for s in used])
    t = np.asarray([s.time_ms for s in used])
    coef, _ = nnls(a / t[:, None], np.ones(len(used)))
    latency_us = float(coef[0])
    bandwidth = float(1.0 / coef[1]) if coef[1] > 0 else 1e6
    fitted = _with_links(topology, latency_us=latency_us, bandwidth_gbps=bandwidth)
    errors = _rel_errors(np.asarray([simulated_comm_ms(fitted, s) for s in used]), t)
    default = _rel_errors(np.asarray([simulated_comm_ms(topology, s) for s in used]), t)
    by_kind = {k: alpha_beta([s for s in samples if s.kind == k]) for k in sorted({s.kind for s in samples})
               if sum(1 for s in samples if s.kind == k) >= 2}
    return CommFit(latency_us=latency_us, bandwidth_gbps=bandwidth, alpha_beta=by_kind,
                   median_abs_error=float(np.median(errors)), max_abs_error=float(errors.max()),
                   default_median_abs_error=float(np.median(default)))


# Each kind whose cost beyond the ring calibration fits, and the `CommOverhead` fields of that cost
COLLECTIVE_OVERHEAD_FIELDS = {ALLGATHER: ("allgather_us", "allgather_ms_per_gb"),
                              REDUCE_SCATTER: ("reduce_scatter_us", "reduce_scatter_ms_per_gb")}


def fit_collective_overhead(samples: Sequence[CommSample], topology: DeviceTopology) -> dict[str, float]:
    """What each collective of `COLLECTIVE_OVERHEAD_FIELDS` costs beyond the rings `simulator.comm`
    prices on `topology` (the fitted links): per kind with at least two samples, a fixed cost (us) and a
    cost per GB of its buffer, the robust non-negative least-squares fit of measured - ring in relative
    residuals. Returned as `CommOverhead` fields; a kind without samples is left out (it costs its ring)."""
    out: dict[str, float] = {}
    for kind, (fixed, per_gb) in COLLECTIVE_OVERHEAD_FIELDS.items():
        used = [s for s in samples if s.kind == kind]
        if len(used) < 2:
            continue
        t = np.asarray([s.time_ms for s in used])
        ring = np.asarray([simulated_comm_ms(topology, s) for s in used])
        a = np.stack([np.full(len(used), 1e-3), np.asarray([s.nbytes / 1e9 for s in used])], axis=1)
        coef = _robust_nnls(a / t[:, None], (t - ring) / t)
        out[fixed], out[per_gb] = float(coef[0]), float(coef[1])
    return out


def _robust_nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """x >= 0 minimizing |a x - b| with a robust loss (soft L1: one sample disturbed by another job on the
    machine must not set a constant), from the plain non-negative least-squares solution; the columns
    of `a` that are all zero (no sample exercises them) stay 0."""
    from scipy.optimize import least_squares, nnls

    coef = np.zeros(a.shape[1])
    used = [j for j in range(a.shape[1]) if a[:, j].any()]
    if used:
        x0 = nnls(a[:, used], b)[0]
        robust = least_squares(lambda x: a[:, used] @ x - b, x0, bounds=(0.0, np.inf), loss="soft_l1",
                               f_scale=0.1, x_scale=np.maximum(x0, 1e-6))
        coef[used] = robust.x
    return coef


# ------------------------------------------------------------------------------------------ overhead fit


@dataclass(frozen=True, slots=True, kw_only=True)
class OverheadFit:
    """What a training step adds to the simulated step: a factor on every measured part's time
    (`compute_scale`, at least 1), milliseconds per op part pass, and the runtime's communication
    overhead (per exchange, per synchronizing collective, per GB all-reduced, per GB exchanged)."""

    overhead_ms: float = 0.0
    compute_scale: float = 1.0
    comm: CommOverhead = NO_OVERHEAD


def fit_overhead(samples: Sequence[StepSample]) -> OverheadFit:
    """The non-negative least-squares solution, in relative residuals and with a robust loss (soft L1:
    one step disturbed by another job on the machine must not set a constant), of measured = base +
    compute_ms x (compute scale - 1) + num_passes x overhead + num_exchanges x cost per exchange +
    num_syncs x cost per synchronizing collective + allreduce_gb x cost per GB all-reduced + exchange_gb
    x cost per GB exchanged + num_shard_collectives x cost per sharded-parameter collective + shard_gb
    x cost per GB of them. The communication terms are what the runtime adds to the wire: per exchange,
    the collective call; per all-reduce and per exchange in which several ranks send, waiting for the
    later one (their arrival jitters with the load of the machine); per GB all-reduced, the buckets'
    copies; per GB a process sends and receives in an exchange, packing, unpacking and accumulating the
    pieces; per all-gather and reduce-scatter of sharded parameters and per GB of them, what they cost
    inside a step beyond their time alone (calibration's steps include fsdp). The per-exchange and
    per-GB-exchanged terms are told apart only by steps whose exchanges differ in size: calibration's
    workloads include one of few ops with large activations and a strategy that reshards every other op.
    A term no sample exercises stays 0 (a factor of 1)."""
    if not samples:
        return OverheadFit()
    a = np.asarray([s.slopes() for s in samples]) / \
        np.asarray([s.measured_ms for s in samples])[:, None]
    b = np.asarray([(s.measured_ms - s.base_ms) / s.measured_ms for s in samples])
    coef = _robust_nnls(a, b)
    return OverheadFit(compute_scale=1.0 + float(coef[0]), overhead_ms=float(coef[1]),
                       comm=CommOverhead(**{field: float(x) * unit
                                            for (_, field, unit), x in zip(STEP_COMM_TERMS, coef[2:], strict=True)}))


def fit_update_scale(samples: Sequence[tuple[int, float]], model: AnalyticalCostModel, device: Device,
                     passes: float) -> float | None:
    """The factor (`AnalyticalCostModel.update_scale`) on an optimizer's ideal `passes` over the parameter
    bytes (`TrainSetup.update_passes`) that makes the analytical model's update time match the timed steps
    `(bytes, ms)`: the median over the samples of time x the model's memory bandwidth / (passes x bytes)
    (None without samples). What a step measures (its operands out of cache) is what counts."""
    ratios = [ms * model.bandwidth_bytes_per_ms(device) / (passes * nbytes)
              for nbytes, ms in samples if nbytes > 0 and ms > 0]
    return statistics.median(ratios) if ratios else None


# --------------------------------------------------------------------------------------- machine profile


@dataclass(frozen=True, slots=True, kw_only=True)
class MachineProfile:
    """A fitted machine: its topology, the analytical constants, the runtime overhead per op part pass
    (microseconds), the factor a training step puts on the time of a part timed alone (`compute_scale`),
    the runtime's communication overhead (`comm_overhead`), the cost database of measured parts (a path,
    or None) and the fit's report."""

    topology: DeviceTopology
    efficiency: Mapping[str, Mapping[str, float]]
    bandwidth_efficiency: Mapping[str, float]
    launch_us: Mapping[str, float]
    overhead_us: float = 0.0
    compute_scale: float = 1.0
    comm_overhead: CommOverhead = NO_OVERHEAD
    update_scale: float | None = None
    costdb: str | None = None
    report: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (self.overhead_us >= 0 and math.isfinite(self.overhead_us)):
            raise ValueError(f"overhead_us must be finite and >= 0, got {self.overhead_us}")
        if not (self.compute_scale > 0 and math.isfinite(self.compute_scale)):
            raise ValueError(f"compute_scale must be finite and > 0, got {self.compute_scale}")
        if self.update_scale is not None and not (self.update_scale > 0 and math.isfinite(self.update_scale)):
            raise ValueError(f"update_scale must be finite and > 0, got {self.update_scale}")

    def analytical(self) -> AnalyticalCostModel:
        """The calibrated analytical model: its roofline times `compute_scale` (efficiencies divided by it,
        the launch cost multiplied), then the runtime overhead folded into the launch cost."""
        scale = self.compute_scale
        return AnalyticalCostModel(
            efficiency={d: {k: v / scale for k, v in eff.items()} for d, eff in self.efficiency.items()},
            bandwidth_efficiency={d: v / scale for d, v in self.bandwidth_efficiency.items()},
            launch_us={d: v * scale + self.overhead_us for d, v in self.launch_us.items()},
            comm_overhead=self.comm_overhead,
            **({} if self.update_scale is None else {"update_scale": self.update_scale}))

    def cost_model(self, db: costdb.CostDatabase | None = None) -> CostModel:
        """Measured times from `db` (or the profile's cost database) with the step's factor and the runtime
        overhead, the calibrated analytical model for the rest."""
        if db is None and self.costdb is not None:
            db = costdb.load(self.costdb, missing_ok=True)
        if db is None:
            return self.analytical()
        return MeasuredCostModel(db, fallback=self.analytical(), overhead_ms=self.overhead_us / 1e3,
                                 scale=self.compute_scale)

    def to_dict(self) -> dict[str, Any]:
        kind = self.topology.devices[0].kind
        doc = self.topology.to_dict()
        doc["calibration"] = {
            "format": PROFILE_FORMAT, "device_kind": kind,
            "efficiency": {k: dict(v) for k, v in self.efficiency.items()},
            "bandwidth_efficiency": dict(self.bandwidth_efficiency), "launch_us": dict(self.launch_us),
            "overhead_us": self.overhead_us, "compute_scale": self.compute_scale,
            "comm_overhead": self.comm_overhead.to_dict(), "update_scale": self.update_scale,
            "costdb": self.costdb,
            **dict(self.report)}
        return doc


def write_profile(path: str | os.PathLike, profile: MachineProfile) -> None:
    """Write the profile (a topology file with a ``calibration`` key) atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(profile.to_dict(), f, indent=1)
            f.write("\n")
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a profile is a file to ship
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_profile(path: str | os.PathLike) -> MachineProfile | None:
    """The machine profile at `path`, or None when the file is a plain topology (no ``calibration``).

    A relative `costdb` is relative to the profile's folder.
    """
    topology = read_topology(path)
    doc = json.loads(Path(path).read_text())
    cal = doc.get("calibration")
    if cal is None:
        return None
    if not isinstance(cal, dict):
        raise ValueError(f"{os.fspath(path)!r}: calibration must be an object, got {cal!r}")
    if cal.get("format") != PROFILE_FORMAT:
        raise ValueError(f"{os.fspath(path)!r}: unknown calibration format {cal.get('format')!r}; "
                         f"this soapflow reads {PROFILE_FORMAT!r}")
    db = cal.get("costdb")
    if isinstance(db, str) and not os.path.isabs(db):
        db = os.fspath(Path(path).parent / db)
    known = ("format", "device_kind", "efficiency", "bandwidth_efficiency", "launch_us", "overhead_us",
             "compute_scale", "comm_overhead", "update_scale", "update_passes", "costdb")
    comm = cal.get("comm_overhead", {})

    def number(value: Any, what: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{os.fspath(path)!r}: calibration.{what} must be a number, got {value!r}")
        return float(value)

    def numbers(value: Any, what: str, *, depth: int = 1) -> dict[str, Any]:
        """An object of numbers (`depth` 2: an object of objects of numbers)."""
        if not isinstance(value, dict):
            raise ValueError(f"{os.fspath(path)!r}: calibration.{what} must be an object, got {value!r}")
        return {k: numbers(v, f"{what}.{k}", depth=depth - 1) if depth > 1 else number(v, f"{what}.{k}")
                for k, v in value.items()}

    if not isinstance(comm, dict):
        raise ValueError(f"{os.fspath(path)!r}: calibration.comm_overhead must be an object, got {comm!r}")
    return MachineProfile(topology=topology, efficiency=numbers(cal.get("efficiency", {}), "efficiency", depth=2),
                          bandwidth_efficiency=numbers(cal.get("bandwidth_efficiency", {}), "bandwidth_efficiency"),
                          launch_us=numbers(cal.get("launch_us", {}), "launch_us"),
                          overhead_us=number(cal.get("overhead_us", 0.0), "overhead_us"),
                          compute_scale=number(cal.get("compute_scale", 1.0), "compute_scale"),
                          comm_overhead=CommOverhead(**{k: number(comm.get(k, 0.0), f"comm_overhead.{k}")
                                                        for k in CommOverhead.__slots__}),
                          update_scale=_update_scale(cal, number),
                          costdb=db if isinstance(db, str) else None,
                          report={k: v for k, v in cal.items() if k not in known})


def _update_scale(cal: Mapping[str, Any], number: Any) -> float | None:
    """A profile's `update_scale`; a profile written before it had one carries `update_passes`, fitted for
    the runtime's then default optimizer (SGD without momentum: 3 ideal passes)."""
    if cal.get("update_scale") is not None:
        return number(cal["update_scale"], "update_scale")
    if cal.get("update_passes") is not None:
        return number(cal["update_passes"], "update_passes") / 3
    return None


def cost_model_for(topology_ref: str | os.PathLike, *, db: costdb.CostDatabase | str | None = None,
                   shipped: bool = True) -> tuple[DeviceTopology, CostModel | None]:
    """The topology `topology_ref` names and the cost model to simulate on it.

    For a machine profile: its calibrated model (measured parts from `db` or the profile's cost database).
    For a preset (``h100-1x8``), with `shipped`, when its device kinds have shipped cost databases
    (`simulator.shipped`): the measured model over them and `db` (`db`'s measurement wins for a key both
    hold), analytical for the rest. Otherwise (a topology file, no shipped database, or not `shipped`):
    the measured model over `db` with the default analytical fallback, or None (the simulator's default)
    without `db`. Not `shipped` with a topology file changes nothing, and a warning says so."""
    if isinstance(db, str):
        db = costdb.load(db, missing_ok=True)
    text = os.fspath(topology_ref)
    is_file = Path(text).is_file()
    if is_file and not shipped:
        warnings.warn(f"shipped cost databases price presets only: leaving them out changes nothing for the "
                      f"topology file {Path(text).name}", stacklevel=2)
    profile = read_profile(text) if is_file else None
    if profile is not None:
        return profile.topology, profile.cost_model(db)
    topology = load_topology(text)
    ship = shipped_costdb(topology) if shipped and not is_file else None
    if ship is not None:
        union = costdb.CostDatabase([*ship, *(db if db is not None else ())])  # later measurements win
        return topology, ShippedCostModel(union, shipped=ship)
    return topology, (MeasuredCostModel(db) if db is not None else None)


def profile_devices(topology: DeviceTopology, fit: ComputeFit, *, dtype: str = "float32",
                    ) -> tuple[DeviceTopology, dict[str, float], float]:
    """The topology's devices of the fit's kind with peak and memory bandwidth raised where a fitted
    efficiency exceeds 1, and the efficiencies and bandwidth efficiency rescaled to match."""
    top = max(fit.efficiency.values(), default=1.0)
    scale = max(1.0, top)
    bw_scale = max(1.0, fit.bandwidth_efficiency)
    devices = []
    for d in topology.devices:
        if d.kind != fit.device_kind:
            devices.append(d)
            continue
        peaks = {k: v * scale for k, v in d.peak_flops.items()}
        devices.append(Device(id=d.id, kind=d.kind, node=d.node, peak_flops=peaks,
                              memory_bandwidth_gbps=d.memory_bandwidth_gbps * bw_scale,
                              memory_bytes=d.memory_bytes))
    eff = {k: v / scale for k, v in fit.efficiency.items()}
    topo = DeviceTopology(name=topology.name, devices=tuple(devices), links=topology.links)
    return topo, eff, fit.bandwidth_efficiency / bw_scale


__all__ = ["COLLECTIVE_OVERHEAD_FIELDS", "COMM_SAMPLE_KINDS", "P2P", "PROFILE_FORMAT", "STEP_COMM_TERMS", "CommFit",
           "CommSample", "ComputeFit", "MachineProfile", "OpSample", "OverheadFit", "StepSample", "alpha_beta",
           "cost_model_for", "fit_collective_overhead", "fit_comm", "fit_compute", "fit_overhead", "profile_devices",
           "read_profile", "simulated_comm_ms", "write_profile"]
