"""Cost models: how long a part of an op takes on a device, forward and backward, and an optimizer step.

Owns the `CostModel` protocol and its three implementations:

- `AnalyticalCostModel`: a roofline per part (Williams, Waterman, Patterson, "Roofline", CACM 2009):
  ``max(FLOPs / (peak x efficiency), bytes / (memory bandwidth x bandwidth efficiency)) + launch``;
- `MeasuredCostModel`: the cost database (`soap.costdb`) by part key, analytical where it has no entry;
- `FixedCostModel`: the null model for tests: every part costs a given constant (or a per-op value),
  which makes timelines computable by hand.

Communication is priced from the topology's links (`simulator.comm`); a cost model only carries what the
runtime adds to it (`comm_overhead`, a `simulator.comm.CommOverhead`: zero by default, fitted by
calibration), as it carries the runtime's overhead per op pass. Times are milliseconds. Must import only
`soap` and `simulator.comm` (no torch, runtime or search).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Protocol, runtime_checkable

from simulator.comm import NO_OVERHEAD, CommOverhead
from simulator.kernel_efficiency import KERNEL_FITS, KernelDevice, KernelFit, gemm_ms, op_gemms
from soap.costdb import CostDatabase, part_key
from soap.devices import DEVICE_SPECS
from soap.graph import DTYPE_BYTES, Operator
from soap.opdef import Box, region_numel
from soap.registry import op_def
from soap.topology import Device

# Op kinds with no compute of their own: batch tensors are already where their parts are, buffers are
# everywhere. The task graph gives them no tasks at all.
FREE_KINDS = frozenset({"input", "constant"})
# Op kinds that are views in torch (no data moves): only the launch overhead remains.
VIEW_KINDS = frozenset({"reshape", "transpose", "slice", "split"})


@runtime_checkable
class CostModel(Protocol):
    """Compute times of op parts and optimizer steps, in milliseconds. A model may also have a
    `comm_overhead` attribute (`simulator.comm.CommOverhead`); the simulator reads it with a zero default.
    And a `by_computation` attribute, true when it prices a part by the op's computation alone (kind,
    shapes, attributes, parameters, FLOPs; never its name), so that copies of an op share their priced
    plans (`simulator.taskgraph.Planner`); read with a false default."""

    def compute_ms(self, op: Operator, box: Box, device: Device,
                   grads: Sequence[bool] | None = None) -> tuple[float, float]:
        """(forward, backward) time of the part `box` of `op` on `device`; `grads` (one flag per input
        of the op, None: not known) says which inputs carry a gradient the backward computes."""
        ...

    def update_ms(self, param_bytes: int, device: Device, passes: float) -> float:
        """Time of the optimizer step over `param_bytes` bytes of parameters held on `device`, for an
        optimizer that streams `passes` times the parameter bytes (`TrainSetup.update_passes`)."""
        ...

    def reduce_ms(self, nbytes: int, num_inputs: int, device: Device) -> float:
        """Time to add up `num_inputs` partial results of `nbytes` bytes each into one on `device`."""
        ...


def part_share(op: Operator, box: Box) -> float:
    """The box's share of the op's iteration space (1.0 for the whole op)."""
    total = 1
    part = 1
    for d, (lo, hi) in zip(op_def(op.kind).dims(op), box, strict=True):
        total *= d.size
        part *= hi - lo
    return part / total if total else 1.0


def part_bytes(op: Operator, box: Box) -> int:
    """Bytes a forward pass of the part reads and writes: its input, output and parameter regions."""
    entry = op_def(op.kind)
    elem = DTYPE_BYTES[op.outputs[0].dtype]
    n = 0
    for region in entry.input_regions(op, box):
        if region is not None:
            n += region_numel(region) * elem
    for i, spec in enumerate(op.outputs):
        n += region_numel(entry.output_region(op, box, i)) * DTYPE_BYTES[spec.dtype]
    for name, region in entry.param_regions(op, box).items():
        n += region_numel(region) * DTYPE_BYTES[op.params[name].dtype]
    return n


def _frozen(table: Mapping[str, Mapping[str, float]]) -> Mapping[str, Mapping[str, float]]:
    return MappingProxyType({k: MappingProxyType(dict(v)) for k, v in table.items()})


# Fraction of the datasheet peak FLOP/s a part sustains, by device kind then op kind ('*' = any). Starting
# figures in the range cuDNN/cuBLAS reach on large shapes (convolutions ~50-60%, GEMMs ~70%, a mixture of
# experts' grouped GEMMs as GEMMs, recurrent cells ~35%); calibration fits them per machine. Memory-bound
# kinds are limited by the bandwidth term.
DEFAULT_EFFICIENCY: Mapping[str, Mapping[str, float]] = _frozen({
    "*": {"*": 0.5, "conv2d": 0.55, "conv1d": 0.55, "linear": 0.7, "matmul": 0.7, "experts": 0.7, "lstm": 0.35,
          "gru": 0.35, "rnn": 0.35, "attention": 0.45},
    "cpu": {"*": 0.6, "conv2d": 0.5, "conv1d": 0.5, "linear": 0.8, "matmul": 0.8, "experts": 0.8, "lstm": 0.5,
            "gru": 0.5, "rnn": 0.5, "attention": 0.5},
})
# Fraction of the datasheet memory bandwidth a streaming kernel reaches (STREAM-like), by device kind.
DEFAULT_BANDWIDTH_EFFICIENCY: Mapping[str, float] = MappingProxyType({"*": 0.8, "cpu": 0.7})
# Fixed cost per kernel launch and framework dispatch, microseconds, by device kind.
# Per kernel launched. On the H100 it is fitted with that kind's kernel constants to measured op parts
# (`simulator.kernel_efficiency.KERNEL_FITS`): what an eager framework spends on the host per kernel,
# which a small kernel pays in full; other GPU kinds keep the bare launch.
DEFAULT_LAUNCH_US: Mapping[str, float] = MappingProxyType({"*": 5.0, "cpu": 10.0, "h100": 66.0})


def _thawed(value):
    """`value` with every mapping in it a plain dict (a mappingproxy cannot be pickled)."""
    if isinstance(value, Mapping):
        return {k: _thawed(v) for k, v in value.items()}
    return value


def _remade(cls, kwargs: dict):
    return cls(**kwargs)


def _reduce_frozen(model) -> tuple:
    """How to pickle a frozen cost model whose fields its `__post_init__` freezes: made again from its
    fields as plain dicts (every such `__post_init__` takes its own output back unchanged). Search
    workers that start afresh rather than fork get their cost model so."""
    return _remade, (type(model), {f.name: _thawed(getattr(model, f.name)) for f in fields(model)})


def _merge(defaults: Mapping[str, Mapping[str, float]],
           overrides: Mapping[str, Mapping[str, float]]) -> Mapping[str, Mapping[str, float]]:
    out = {k: dict(v) for k, v in defaults.items()}
    for kind, table in overrides.items():
        out.setdefault(kind, {}).update(table)
    return _frozen(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class AnalyticalCostModel:
    """Roofline per part (see the module docstring).

    FLOPs of a part are the op's FLOPs times the part's share of the iteration space; bytes are the sizes
    of its input, output and parameter regions (backward: scaled by the op's bwd_bytes / fwd_bytes, 2x
    when capture recorded none). `efficiency[device kind][op kind]` (fraction of peak FLOP/s),
    `bandwidth_efficiency[device kind]` and `launch_us[device kind]` override the defaults entry by entry;
    '*' is the fallback kind. Backward launches two kernels for ops with parameters (input and weight
    gradients). The optimizer step streams its passes over the parameter bytes (`TrainSetup.update_passes`:
    SGD with momentum reads parameter, gradient and momentum and writes parameter and momentum, 5) times
    `update_scale` (1 by default; calibration fits it from timed optimizer steps).

    On a GPU kind with a row in `kernel_fits` (default `simulator.kernel_efficiency.KERNEL_FITS`: p100,
    v100, k80, h100; a row keyed ``kind:dtype`` holds that kind's fit for another dtype, h100's bfloat16)
    and ops of the fitted dtype, the efficiency depends on the kernel: the parts of linear, matmul, conv2d
    (conv1d), recurrent (lstm, gru, rnn), attention and experts ops are priced by the GEMMs they run
    (forward; data and weight gradients in backward), by waves of tiles over the SMs at the sustained
    clock, one launch per GEMM (per time step of a recurrence); other ops by the roofline at the sustained
    peak times the kind's fitted `eff_max`, or by bandwidth. A device kind named in `efficiency` keeps the
    flat roofline.
    """

    efficiency: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    bandwidth_efficiency: Mapping[str, float] = field(default_factory=dict)
    launch_us: Mapping[str, float] = field(default_factory=dict)
    update_scale: float = 1.0
    comm_overhead: CommOverhead = NO_OVERHEAD
    kernel_fits: Mapping[str, KernelFit] = field(default_factory=lambda: KERNEL_FITS)

    @property
    def by_computation(self) -> bool:
        """A part's price follows from its op's kind, shapes, FLOPs and bytes, never the op's name."""
        return True

    __reduce__ = _reduce_frozen

    def __post_init__(self) -> None:
        # a device kind given efficiencies of its own (a calibrated machine profile) keeps the flat roofline
        fits = {k: v for k, v in self.kernel_fits.items() if k.partition(":")[0] not in self.efficiency}
        object.__setattr__(self, "kernel_fits", MappingProxyType(fits))
        eff = _merge(DEFAULT_EFFICIENCY, self.efficiency)
        bad = {f"{d}/{o}": v for d, t in eff.items() for o, v in t.items() if not 0 < v <= 1}
        bw = {**DEFAULT_BANDWIDTH_EFFICIENCY, **self.bandwidth_efficiency}
        bad.update({f"bandwidth/{d}": v for d, v in bw.items() if not 0 < v <= 1})
        if bad:
            raise ValueError(f"efficiencies must be in (0, 1], got {bad}")
        launch = {**DEFAULT_LAUNCH_US, **self.launch_us}
        if any(v < 0 for v in launch.values()) or not self.update_scale > 0:
            raise ValueError(f"launch_us must be >= 0 and update_scale > 0, got {launch}, {self.update_scale}")
        object.__setattr__(self, "efficiency", eff)
        object.__setattr__(self, "bandwidth_efficiency", MappingProxyType(bw))
        object.__setattr__(self, "launch_us", MappingProxyType(launch))

    def flop_efficiency(self, device_kind: str, op_kind: str) -> float:
        for table in (self.efficiency.get(device_kind), self.efficiency["*"]):
            if table is not None and op_kind in table:
                return table[op_kind]
        table = self.efficiency.get(device_kind, self.efficiency["*"])
        return table.get("*", self.efficiency["*"]["*"])

    def _launch_ms(self, device: Device) -> float:
        return self.launch_us.get(device.kind, self.launch_us["*"]) / 1e3

    def bandwidth_bytes_per_ms(self, device: Device) -> float:
        eff = self.bandwidth_efficiency.get(device.kind, self.bandwidth_efficiency["*"])
        return device.memory_bandwidth_gbps * eff * 1e6  # GB/s = 1e6 bytes per ms

    def _peak_flops_per_ms(self, op: Operator, device: Device) -> float:
        dtype = op.outputs[0].dtype
        peak = device.peak_flops.get(dtype) or device.peak_flops.get("float32") or max(device.peak_flops.values())
        return peak * self.flop_efficiency(device.kind, op.kind) / 1e3

    def kernel_device(self, op: Operator, device: Device) -> tuple[KernelDevice, KernelFit] | None:
        """The device as the kernel model sees it, with its fitted constants, when its kind has a fit
        for the op's dtype and its SM count is known (`simulator.kernel_efficiency`); else None."""
        fit = self.kernel_fits.get(f"{device.kind}:{op.outputs[0].dtype}") or self.kernel_fits.get(device.kind)
        spec = DEVICE_SPECS.get(device.kind)
        peak = device.peak_flops.get(op.outputs[0].dtype)
        if fit is None or spec is None or spec.num_sms <= 0 or peak is None or op.outputs[0].dtype != fit.dtype:
            return None
        sm_flops_per_ms = peak * spec.sustained_fraction / spec.num_sms / 1e3
        return KernelDevice(num_sms=spec.num_sms, sm_flops_per_ms=sm_flops_per_ms,
                            bytes_per_ms=self.bandwidth_bytes_per_ms(device)), fit

    def compute_ms(self, op: Operator, box: Box, device: Device,
                   grads: Sequence[bool] | None = None) -> tuple[float, float]:
        if op.kind in FREE_KINDS:
            return (0.0, 0.0)
        launch = self._launch_ms(device)
        if op.kind in VIEW_KINDS:
            return (launch, launch)
        share = part_share(op, box)
        nbytes = part_bytes(op, box)
        bwd_scale = op.bwd_bytes / op.fwd_bytes if op.fwd_bytes > 0 else 2.0
        flops_per_ms = self._peak_flops_per_ms(op, device)
        bytes_per_ms = self.bandwidth_bytes_per_ms(device)
        kernel = self.kernel_device(op, device)
        if kernel is not None:
            kdev, fit = kernel
            gemms = op_gemms(op, box, grads)
            if gemms is not None:
                elem = DTYPE_BYTES[op.outputs[0].dtype]
                fwd_gemms, bwd_gemms = gemms
                fwd = sum(gemm_ms(g, kdev, fit, elem) + launch * g.repeat for g in fwd_gemms)
                bwd = sum(gemm_ms(g, kdev, fit, elem) + launch * g.repeat for g in bwd_gemms)
                return (fwd, max(bwd, launch))
            # not a GEMM: the roofline at the sustained peak and the fitted large-kernel efficiency
            flops_per_ms = kdev.sm_flops_per_ms * kdev.num_sms * fit.eff_max
        fwd = max(op.fwd_flops * share / flops_per_ms, nbytes / bytes_per_ms) + launch
        bwd = max(op.bwd_flops * share / flops_per_ms, nbytes * bwd_scale / bytes_per_ms)
        bwd += launch * (2 if op.params else 1)
        return (fwd, bwd)

    def update_ms(self, param_bytes: int, device: Device, passes: float) -> float:
        if param_bytes <= 0:
            return 0.0
        streamed = self.update_scale * passes * param_bytes
        return streamed / self.bandwidth_bytes_per_ms(device) + self._launch_ms(device)

    def reduce_ms(self, nbytes: int, num_inputs: int, device: Device) -> float:
        # reads every partial once and writes the sum once
        return (num_inputs + 1) * nbytes / self.bandwidth_bytes_per_ms(device) + self._launch_ms(device)


class MeasuredCostModel:
    """Times from a cost database, keyed by `soap.costdb.part_key`; `fallback` (analytical by default)
    prices parts the database lacks, optimizer steps and partial-sum reductions.

    A part that is a whole op (one device runs it while the others wait for it, as under model
    parallelism) is priced with the measurement's solo times where it has them; a part of a split op with
    its times measured while all devices run parts at once (`soap.costdb`). On devices that share
    hardware (local CPU processes) the two differ by the contention between the devices; `solo=False`
    always uses the concurrent times.
    Two corrections, both fitted by calibration (`simulator.calibration.fit_overhead`), cover what timing
    a part alone in a loop does not see: every time found in the database is multiplied by `scale` (in a
    training step an op finds its operands out of cache, evicted by the ops before it and by the other
    processes), and `overhead_ms` is added to the forward and to the backward time of every such part
    (the runtime's own cost per op part and pass: interpreter, redistribution bookkeeping, autograd call).
    A lookup with gradient flags (`grads`) that finds no measurement with them takes one written without
    them (a database from before the key had them). `hits` and `misses` count lookups (reporting only:
    they never change a result).
    """

    __slots__ = ("db", "fallback", "hits", "misses", "overhead_ms", "scale", "solo")

    @property
    def by_computation(self) -> bool:
        """The database is keyed by computation (`soap.costdb.part_key`): as the fallback."""
        return bool(getattr(self.fallback, "by_computation", False))

    def __init__(self, db: CostDatabase, fallback: CostModel | None = None, *, overhead_ms: float = 0.0,
                 scale: float = 1.0, solo: bool = True):
        if not (overhead_ms >= 0 and math.isfinite(overhead_ms)):
            raise ValueError(f"overhead_ms must be finite and >= 0, got {overhead_ms}")
        if not (scale > 0 and math.isfinite(scale)):
            raise ValueError(f"scale must be finite and > 0, got {scale}")
        self.db = db
        self.fallback: CostModel = fallback if fallback is not None else AnalyticalCostModel()
        self.overhead_ms = float(overhead_ms)
        self.scale = float(scale)
        self.solo = solo
        self.hits = 0
        self.misses = 0

    def compute_ms(self, op: Operator, box: Box, device: Device,
                   grads: Sequence[bool] | None = None) -> tuple[float, float]:
        if op.kind in FREE_KINDS:
            return (0.0, 0.0)
        key = part_key(op, box, device.kind, grads)
        found = self.db.lookup(key)
        if found is None and key[-1]:
            # a database written before keys said which inputs carry a gradient
            found = self.db.lookup((*key[:-1], ""))
        if found is None:
            self.misses += 1
            return self.fallback.compute_ms(op, box, device, grads)
        self.hits += 1
        if self.solo and found.solo_fwd_ms is not None and part_share(op, box) == 1.0:
            fwd_ms, bwd_ms = found.solo_fwd_ms, found.solo_bwd_ms
        else:
            fwd_ms, bwd_ms = found.fwd_ms, found.bwd_ms
        return (fwd_ms * self.scale + self.overhead_ms, bwd_ms * self.scale + self.overhead_ms)

    @property
    def comm_overhead(self) -> CommOverhead:
        """The fallback's (a machine profile's calibrated analytical model carries it)."""
        return getattr(self.fallback, "comm_overhead", NO_OVERHEAD)

    def update_ms(self, param_bytes: int, device: Device, passes: float) -> float:
        return self.fallback.update_ms(param_bytes, device, passes)

    def reduce_ms(self, nbytes: int, num_inputs: int, device: Device) -> float:
        return self.fallback.reduce_ms(nbytes, num_inputs, device)


@dataclass(frozen=True, slots=True, kw_only=True)
class FixedCostModel:
    """Every part of every op costs `fwd_each_ms` forward and `bwd_each_ms` backward (default: the
    forward figure), whatever its size or device; `per_op_ms` overrides by op name with a number (both
    passes) or a (forward, backward) pair. Optimizer steps cost `update_each_ms`, partial-sum reductions
    `reduce_each_ms`. Ops of the free kinds (input, constant) cost nothing. `comm_overhead` as in
    `AnalyticalCostModel`.
    """

    fwd_each_ms: float = 1.0
    bwd_each_ms: float | None = None
    per_op_ms: Mapping[str, float | tuple[float, float]] = field(default_factory=dict)
    update_each_ms: float = 0.0
    reduce_each_ms: float = 0.0
    comm_overhead: CommOverhead = NO_OVERHEAD

    @property
    def by_computation(self) -> bool:
        """Without per-op overrides (by name) every op costs the same."""
        return not self.per_op_ms

    __reduce__ = _reduce_frozen

    def __post_init__(self) -> None:
        table: dict[str, tuple[float, float]] = {}
        for name, value in dict(self.per_op_ms).items():
            pair = (float(value), float(value)) if isinstance(value, int | float) else tuple(map(float, value))
            if len(pair) != 2:
                raise ValueError(f"per_op_ms[{name!r}] must be a number or a (fwd, bwd) pair, got {value!r}")
            table[name] = pair
        object.__setattr__(self, "per_op_ms", MappingProxyType(table))
        values = [self.fwd_each_ms, self.update_each_ms, self.reduce_each_ms,
                  self.bwd_each_ms if self.bwd_each_ms is not None else 0.0]
        values += [v for pair in table.values() for v in pair]
        if any(not (v >= 0 and math.isfinite(v)) for v in values):
            raise ValueError(f"fixed costs must be finite and >= 0, got {values}")

    def compute_ms(self, op: Operator, box: Box, device: Device,
                   grads: Sequence[bool] | None = None) -> tuple[float, float]:
        if op.kind in FREE_KINDS:
            return (0.0, 0.0)
        hit = self.per_op_ms.get(op.name)
        if hit is not None:
            return hit
        return (self.fwd_each_ms, self.fwd_each_ms if self.bwd_each_ms is None else self.bwd_each_ms)

    def update_ms(self, param_bytes: int, device: Device, passes: float) -> float:
        return self.update_each_ms

    def reduce_ms(self, nbytes: int, num_inputs: int, device: Device) -> float:
        return self.reduce_each_ms


__all__ = ["AnalyticalCostModel", "CostModel", "FixedCostModel", "MeasuredCostModel", "part_bytes", "part_share"]
