"""Kernel-dependent GPU efficiency: what fraction of its peak a GPU sustains on one kernel.

The analytical cost model (`simulator.costmodel`) prices the parts of GEMM-like ops (linear, matmul,
conv2d, LSTM, fused attention) on a GPU kind with a fitted table (`KERNEL_FITS`) by the GEMMs they run,
as NVIDIA's *Matrix Multiplication Background User's Guide* (DU-09799-001, "Dimension Quantization
Effects"; https://docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication/) describes
cuBLAS running them: the output C[M, N] is cut into tiles of tm x tn, one thread block per tile; the
blocks run in *waves* of as many as the SMs hold at once, and the last wave may be nearly empty (wave
quantization); a tile that sticks out of C computes its padding too (tile quantization). For one
candidate tile shape and split of K into `s` slices (split-K, as cuBLAS does for small M x N):

    tiles  = ceil(M / tm) * ceil(N / tn) * batch * s
    slots  = num_sms * max(1, 128 * 128 / (tm * tn))          # blocks resident at once
    time   = ceil(tiles / slots) * 2 tm tn (ceil(K / s) + k0) * (slots / num_sms) / (sm_flops * eff(tile))
    eff(tile) = eff_max * [I / (I + c)] / [64 / (64 + c)],   I = tm tn / (tm + tn)

`sm_flops` is one SM's peak at the *sustained* clock (`soap.devices`: the datasheet peak scaled by
sustained / boost clock); `I` is the tile's arithmetic intensity (FMAs per element it loads per step of
K), so small tiles run further below the peak than the 128 x 128 one, which runs at `eff_max`; `k0` is a
tile's fixed prologue and epilogue in units of K. A kernel is the fastest candidate (cuBLAS's heuristics
pick among its tile shapes), never faster than its bytes at the sustained bandwidth, and a convolution's
implicit GEMM (M = images x output pixels, N = output channels, K = input channels x kernel window) runs
at `conv_scale` times the GEMM rate. Backward prices the data-gradient and weight-gradient GEMMs with
their own shapes; an LSTM runs its input projection as one GEMM and its recurrent GEMM once per time step,
one after the other.

The efficiency of a kernel, FLOPs / (time x sustained peak), never exceeds `eff_max` <= 1. `eff_max`
is fitted per device kind, `c`, `k0` and `conv_scale` once over all kinds, by
`benchmarks/fit_kernel_efficiency.py` (scipy least squares on log time) to the public kernel
measurements in `benchmarks/data/kernels_*.csv` (each file cites its source); `benchmarks/preset_fidelity.py`
reports the fit's error per kind and the whole-model throughput it predicts against published figures.
A device kind without a row in `KERNEL_FITS` (or a dtype other than the one fitted) keeps the flat
roofline of `simulator.costmodel`. A row keyed ``kind:dtype`` is a kind's fit for a second dtype (the
H100's bfloat16 beside its float32); the H100's rows come from this project's own measurements of op parts
on that GPU (`benchmarks/gpu_accuracy.py`), not from a public kernel table.

Imports only `soap`.
"""

from __future__ import annotations

import csv
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from soap.graph import DTYPE_BYTES, Operator
from soap.opdef import Box, input_shape
from soap.registry import op_def

# Candidate thread-block tiles (tm, tn): the shapes cuBLAS's SGEMM kernels use, large to skinny.
TILES = ((128, 128), (128, 64), (64, 128), (64, 64), (128, 32), (32, 128), (64, 32), (32, 64), (32, 32),
         (128, 16), (16, 128))
SPLITS = tuple(2 ** i for i in range(11))  # split-K factors 1..1024; a slice keeps at least MIN_SLICE of K
MIN_SLICE = 64
_REF_INTENSITY = 64.0  # the 128 x 128 tile's


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelFit:
    """Fitted constants of one device kind (see the module docstring): `eff_max` (fraction of the
    sustained SM peak a 128 x 128 tile reaches), `tile_c` (tile intensity penalty), `k0` (per-tile fixed
    work in units of K), `conv_scale` (convolution rate over the GEMM rate), and the dtype they were
    fitted for."""

    eff_max: float
    tile_c: float
    k0: float
    conv_scale: float
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not (0 < self.eff_max <= 1 and self.tile_c >= 0 and self.k0 >= 0 and 0 < self.conv_scale <= 1):
            raise ValueError(f"kernel fit out of range: eff_max={self.eff_max} in (0, 1], tile_c={self.tile_c} "
                             f">= 0, k0={self.k0} >= 0, conv_scale={self.conv_scale} in (0, 1]")


# Fitted by `python benchmarks/fit_kernel_efficiency.py` (scipy.optimize.least_squares on the log of the
# kernel times, soft-L1 loss) to benchmarks/data/kernels_v100.csv, kernels_p100.csv and kernels_k80.csv;
# `tile_c`, `k0` and `conv_scale` shared by all kinds, `eff_max` per kind. k80's rows are a Tesla K40's
# (same Kepler SMX; no K80 kernel table was found in text form), priced at the K40's own SM count and
# clock, so the fitted per-SM figure carries over to the K80's 13 SMX at its sustained clock.
KERNEL_FITS: Mapping[str, KernelFit] = MappingProxyType({
    "p100": KernelFit(eff_max=0.812, tile_c=14.7, k0=24.9, conv_scale=1.0),
    "v100": KernelFit(eff_max=0.956, tile_c=14.7, k0=24.9, conv_scale=1.0),
    "k80": KernelFit(eff_max=0.575, tile_c=14.7, k0=24.9, conv_scale=1.0),
    # Fitted by `python benchmarks/gpu_accuracy.py report` to the op parts (linear, matmul, conv2d,
    # attention, LSTM; forward and backward) this project timed on an H100 SXM with the runtime's own
    # kernels (benchmarks/results/gpu_measurements.json, simulator/costdbs/h100.jsonl), every constant
    # per dtype, with the launch cost `simulator.costmodel.DEFAULT_LAUNCH_US["h100"]` fitted beside them.
    "h100": KernelFit(eff_max=0.869, tile_c=34.0, k0=27.6, conv_scale=0.888),
    "h100:bfloat16": KernelFit(eff_max=0.648, tile_c=512.0, k0=339.0, conv_scale=1.0, dtype="bfloat16"),
})


@dataclass(frozen=True, slots=True)
class Gemm:
    """C[batch, M, N] = A[batch, M, K] @ B[batch, K, N], run `repeat` times one after the other;
    `conv`: the implicit GEMM of a convolution, whose A is never materialized (`nbytes` counts the
    convolution's own tensors)."""

    m: int
    n: int
    k: int
    batch: int = 1
    repeat: int = 1
    conv: bool = False
    nbytes: int = 0  # elements one run reads and writes (0: A, B and C; a convolution's are its tensors')

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.batch * self.repeat


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelDevice:
    """What the kernel model needs of a device: SM count, one SM's FLOP/ms at the sustained clock, the
    sustained memory bandwidth in bytes/ms."""

    num_sms: int
    sm_flops_per_ms: float
    bytes_per_ms: float


def tile_efficiency(fit: KernelFit, tm: int, tn: int) -> float:
    """Fraction of the SM peak a tm x tn tile sustains (`eff_max` for 128 x 128, less for smaller)."""
    intensity = tm * tn / (tm + tn)
    return fit.eff_max * (intensity / (intensity + fit.tile_c)) / (_REF_INTENSITY / (_REF_INTENSITY + fit.tile_c))


def wave_ms(g: Gemm, device: KernelDevice, fit: KernelFit, tm: int, tn: int, split: int = 1) -> float:
    """Compute time of one run of `g` with tm x tn tiles and K split `split` ways (module docstring)."""
    tiles = math.ceil(g.m / tm) * math.ceil(g.n / tn) * g.batch * split
    per_sm = max(1, (128 * 128) // (tm * tn))
    slots = device.num_sms * per_sm
    waves = math.ceil(tiles / slots)
    eff = tile_efficiency(fit, tm, tn) * (fit.conv_scale if g.conv else 1.0)
    wave = 2.0 * tm * tn * (math.ceil(g.k / split) + fit.k0) * per_sm / (device.sm_flops_per_ms * eff)
    return waves * wave


@functools.lru_cache(maxsize=65536)
def _gemm_ms(g: Gemm, device: KernelDevice, fit: KernelFit, elem_bytes: int) -> float:
    best = math.inf
    for tm, tn in TILES:
        for split in SPLITS:
            if split > 1 and math.ceil(g.k / split) < MIN_SLICE:
                break
            t = wave_ms(g, device, fit, tm, tn, split)
            if split > 1:  # the slices' partial sums are written and added up
                t += (split + 1) * g.m * g.n * g.batch * 4 / device.bytes_per_ms
            best = min(best, t)
    traffic = (g.nbytes or (g.m * g.k + g.k * g.n + g.m * g.n) * g.batch) * elem_bytes
    return max(best, traffic / device.bytes_per_ms) * g.repeat


def gemm_ms(g: Gemm, device: KernelDevice, fit: KernelFit, elem_bytes: int = 4) -> float:
    """Time of `g` (all its repeats) on `device`, in milliseconds, without launch overhead."""
    return _gemm_ms(g, device, fit, elem_bytes)


def efficiency(g: Gemm, device: KernelDevice, fit: KernelFit, elem_bytes: int = 4) -> float:
    """FLOPs / (time x the device's sustained peak): the fraction of peak the kernel reaches."""
    return g.flops / (gemm_ms(g, device, fit, elem_bytes) * device.sm_flops_per_ms * device.num_sms)


# ---------------------------------------------------------------- the GEMMs of an op part


def _span(r: tuple[int, int]) -> int:
    return r[1] - r[0]


def _prod(values: Sequence[int]) -> int:
    return math.prod(values) if values else 1


def _input_grad(op: Operator, grads: Sequence[bool] | None, index: int) -> bool:
    if grads is not None:
        return index < len(grads) and bool(grads[index])
    return op.bwd_flops > 1.5 * op.fwd_flops  # capture counted a data gradient besides the weight one


# gate blocks per recurrent cell kind: LSTM (i, f, g, o), GRU (r, z, n), a plain RNN (one)
_GATES = {"lstm": 4, "gru": 3, "rnn": 1}


def op_gemms(op: Operator, box: Box, grads: Sequence[bool] | None = None
             ) -> tuple[list[Gemm], list[Gemm]] | None:
    """(forward GEMMs, backward GEMMs) of the part `box` of `op`, or None for kinds that run no GEMM."""
    if op.kind == "linear":
        m = _prod([_span(r) for r in box[:-2]])
        n, k = _span(box[-2]), _span(box[-1])
        bwd = [Gemm(m, k, n)] if _input_grad(op, grads, 0) else []
        return [Gemm(m, n, k)], bwd + [Gemm(n, k, m)]
    if op.kind == "matmul":
        batch = _prod([_span(r) for r in box[:-3]])
        m, n, k = (_span(r) for r in box[-3:])
        bwd = ([Gemm(m, k, n, batch)] if _input_grad(op, grads, 0) else [])
        bwd += [Gemm(k, n, m, batch)] if _input_grad(op, grads, 1) else []
        return [Gemm(m, n, k, batch)], bwd
    if op.kind in ("conv2d", "conv1d"):  # a 1-D convolution as a 2-D one of height 1
        groups = int(op.attrs.get("groups", 1))
        flat = op.kind == "conv1d"
        kh, kw = (1, *op.params["weight"].shape[2:]) if flat else op.params["weight"].shape[2:]
        imgs, co, ho, wo, ci = (_span(r) for r in ((box[0], box[1], (0, 1), box[2], box[3]) if flat else box))
        batch = 1
        if groups > 1:  # one GEMM per group the part touches: its output over its input channels
            per_group = op.outputs[0].shape[1] // groups
            batch = max(1, co // per_group)
            co, ci = co // batch, op.params["weight"].shape[1]
        h, w = (1, *input_shape(op, 0)[2:]) if flat else input_shape(op, 0)[2:]
        stride = op.attrs.get("stride", 1)
        sh, sw = (1, stride) if flat else (stride, stride) if isinstance(stride, int) else tuple(stride)
        hin, win = min(h, ho * sh), min(w, wo * sw)  # the input pixels this part's windows cover
        x, y, w = imgs * ci * hin * win * batch, imgs * co * ho * wo * batch, co * ci * kh * kw * batch
        fwd = Gemm(imgs * ho * wo, co, ci * kh * kw, batch, conv=True, nbytes=x + y + w)
        bwd = ([Gemm(imgs * hin * win, ci, co * kh * kw, batch, conv=True, nbytes=x + y + w)]
               if _input_grad(op, grads, 0) else [])
        return [fwd], bwd + [Gemm(co, ci * kh * kw, imgs * ho * wo, batch, conv=True, nbytes=x + y + w)]
    if op.kind in _GATES:  # a recurrent cell: per layer, the input GEMM over every step, the hidden one per step
        b, t = _span(box[0]), _span(box[1])
        hidden, layers = int(op.attrs["hidden_size"]), int(op.attrs["num_layers"])
        features = input_shape(op, 0)[2]
        g = _GATES[op.kind] * hidden
        fwd: list[Gemm] = []
        bwd: list[Gemm] = []
        for layer in range(layers):
            i = features if layer == 0 else hidden
            fwd += [Gemm(b * t, g, i), Gemm(b, g, hidden, repeat=t)]
            bwd += [Gemm(b, hidden, g, repeat=t), Gemm(g, i + hidden, b * t)]
            if layer > 0 or _input_grad(op, grads, 0):
                bwd.append(Gemm(b * t, i, g))
        return fwd, bwd
    if op.kind == "experts":  # per held expert: its routed rows through the up (and gate) and down products
        entry = op_def(op.kind)
        hidden = entry.widths(op)[2]
        e, i, ins = _span(box[1]), _span(box[2]), entry.products(op) - 1
        rows = max(1, math.ceil(entry.routed_pairs(op, box) / e))  # even routing (the registry's)
        fwd = [Gemm(rows, i, hidden, e)] * ins + [Gemm(rows, hidden, i, e)]
        bwd = [Gemm(rows, i, hidden, e)] + [Gemm(rows, hidden, i, e)] * (ins if _input_grad(op, grads, 0) else 0)
        return fwd, bwd + [Gemm(i, hidden, rows, e)] * ins + [Gemm(hidden, i, rows, e)]
    if op.kind == "attention":
        n, heads, tq = (_span(r) for r in box[:3])
        tk, d, dv = input_shape(op, 1)[2], input_shape(op, 0)[3], input_shape(op, 2)[3]
        fwd = [Gemm(tq, tk, d, n * heads), Gemm(tq, dv, tk, n * heads)]
        return fwd, fwd + fwd  # the gradients of q, k and v: twice the two products
    return None


def element_bytes(op: Operator) -> int:
    return DTYPE_BYTES[op.outputs[0].dtype]


# ---------------------------------------------------------------- kernel tables (benchmarks/data)


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelSample:
    """One measured kernel: its GEMM, the measured time, and the device it ran on."""

    device_kind: str
    family: str  # gemm or conv
    label: str
    gemm: Gemm
    time_ms: float
    device: KernelDevice


def table_gemm(row: Mapping[str, str]) -> Gemm:
    """The GEMM of one kernel-table row: `family` gemm (columns m, n, k) or conv (columns n, c, h, w, k, r,
    s, pad_h, pad_w, stride_h, stride_w: a forward convolution, as its implicit GEMM)."""
    if row["family"] == "gemm":
        return Gemm(int(row["m"]), int(row["n"]), int(row["k"]))
    if row["family"] != "conv":
        raise ValueError(f"unknown kernel family {row['family']!r}")
    n, c, h, w = (int(row[x]) for x in ("n", "c", "h", "w"))
    k, r, s = int(row["k"]), int(row["r"]), int(row["s"])
    ph, pw, sh, sw = (int(row[x]) for x in ("pad_h", "pad_w", "stride_h", "stride_w"))
    ho, wo = (h + 2 * ph - r) // sh + 1, (w + 2 * pw - s) // sw + 1
    return Gemm(n * ho * wo, k, c * r * s, conv=True, nbytes=n * c * h * w + k * c * r * s + n * k * ho * wo)


def load_kernel_table(path: str | Path) -> list[KernelSample]:
    """Read a kernel table: comment lines start with '#'; one line `# device: kind=K num_sms=S
    clock_mhz=C flops_per_sm_per_clock=F bandwidth_gbps=B` says what the kernels ran on; then CSV rows
    with `family` gemm (columns m, n, k) or conv (columns n, c, h, w, k, r, s, pad_h, pad_w, stride_h,
    stride_w: a forward convolution, priced as its implicit GEMM), `label`, and the measurement: `tflops`
    (the time follows from the kernel's FLOPs) or, where that is blank, `time_ms`."""
    text = Path(path).read_text().splitlines()
    meta: dict[str, str] = {}
    rows = []
    for line in text:
        if line.startswith("# device:"):
            meta = dict(item.split("=", 1) for item in line.split(":", 1)[1].split())
        elif line.strip() and not line.startswith("#"):
            rows.append(line)
    if not meta or not rows:
        raise ValueError(f"{path}: a kernel table needs a '# device:' line and rows")
    device = KernelDevice(
        num_sms=int(meta["num_sms"]),
        sm_flops_per_ms=float(meta["flops_per_sm_per_clock"]) * float(meta["clock_mhz"]) * 1e3,
        bytes_per_ms=float(meta["bandwidth_gbps"]) * 1e6)
    out = []
    for row in csv.DictReader(rows):
        try:
            g = table_gemm(row)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        # the published TFLOP/s carry more digits than the published times: the time follows from them
        tflops = row.get("tflops") or ""
        time_ms = g.flops / (float(tflops) * 1e9) if tflops.strip() else float(row["time_ms"])
        out.append(KernelSample(device_kind=meta["kind"], family=row["family"], label=row["label"], gemm=g,
                                time_ms=time_ms, device=device))
    return out


def predict_sample_ms(sample: KernelSample, fit: KernelFit, launch_us: float) -> float:
    """The model's time for a measured kernel (its GEMM on its device, plus one launch)."""
    return gemm_ms(sample.gemm, sample.device, fit) + launch_us / 1e3


__all__ = ["KERNEL_FITS", "Gemm", "KernelDevice", "KernelFit", "KernelSample", "efficiency", "gemm_ms",
           "load_kernel_table", "op_gemms", "predict_sample_ms", "table_gemm", "tile_efficiency", "wave_ms"]
