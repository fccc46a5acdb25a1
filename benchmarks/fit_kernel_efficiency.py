"""Fit the kernel-efficiency constants of the GPU presets to public kernel measurements.

Reads the kernel tables `benchmarks/data/kernels_<kind>.csv` (each cites its source: Baidu DeepBench for
v100 and p100, cuBLAS SGEMM on a Tesla K40 for k80) and fits the constants of
`simulator.kernel_efficiency` (module docstring): `eff_max` per device kind, `tile_c`, `k0` and
`conv_scale` shared by all kinds. Least squares (scipy.optimize.least_squares, soft-L1 loss with a
scale of 0.2) on log(predicted / measured time), so that a 10 us kernel weighs as much as a 100 ms one;
each kernel is priced at the device it ran on plus the cost model's launch overhead for GPUs.

Prints the fitted table in the form `simulator.kernel_efficiency.KERNEL_FITS` holds, and the median and
largest |error| per kind with the fitted and with the current constants. Fits only to kernels, never to
whole models (`benchmarks/preset_fidelity.py` reports those as a check).

    python benchmarks/fit_kernel_efficiency.py
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simulator.costmodel import DEFAULT_LAUNCH_US  # noqa: E402
from simulator.kernel_efficiency import KERNEL_FITS, KernelFit, KernelSample, load_kernel_table, predict_sample_ms  # noqa: E402

DATA = ROOT / "benchmarks" / "data"
KINDS = ("p100", "v100", "k80")
LAUNCH_US = DEFAULT_LAUNCH_US["*"]


def kernel_tables() -> dict[str, list[KernelSample]]:
    """The kernel tables of the GPU kinds that have one, by kind."""
    return {kind: load_kernel_table(DATA / f"kernels_{kind}.csv") for kind in KINDS
            if (DATA / f"kernels_{kind}.csv").exists()}


def errors(samples: list[KernelSample], fit: KernelFit) -> list[float]:
    """(predicted - measured) / measured per kernel."""
    return [(predict_sample_ms(s, fit, LAUNCH_US) - s.time_ms) / s.time_ms for s in samples]


def fit(tables: dict[str, list[KernelSample]]) -> dict[str, KernelFit]:
    kinds = sorted(tables)
    samples = [(kinds.index(kind), s) for kind in kinds for s in tables[kind]]

    def fits_of(x: np.ndarray) -> dict[str, KernelFit]:
        tile_c, k0, conv_scale = x[len(kinds):]
        return {kind: KernelFit(eff_max=float(x[i]), tile_c=float(tile_c), k0=float(k0),
                                conv_scale=float(conv_scale)) for i, kind in enumerate(kinds)}

    def residuals(x: np.ndarray) -> np.ndarray:
        fits = fits_of(x)
        return np.array([math.log(predict_sample_ms(s, fits[kinds[i]], LAUNCH_US) / s.time_ms)
                         for i, s in samples])

    x0 = np.array([0.8] * len(kinds) + [16.0, 64.0, 0.8])
    lo = [0.05] * len(kinds) + [0.0, 0.0, 0.05]
    hi = [1.0] * len(kinds) + [512.0, 4096.0, 1.0]
    result = least_squares(residuals, x0, bounds=(lo, hi), loss="soft_l1", f_scale=0.2, diff_step=1e-3)
    return fits_of(result.x)


def main() -> int:
    tables = kernel_tables()
    fitted = fit(tables)
    print("KERNEL_FITS = {")
    for kind, f in fitted.items():
        print(f'    "{kind}": KernelFit(eff_max={f.eff_max:.3f}, tile_c={f.tile_c:.1f}, k0={f.k0:.1f}, '
              f'conv_scale={f.conv_scale:.3f}),')
    print("}")
    print(f"\n{'kind':6} {'kernels':>7} {'fitted median':>14} {'fitted max':>11} {'current median':>15} "
          f"{'current max':>12}")
    for kind, samples in tables.items():
        new = [abs(e) for e in errors(samples, fitted[kind])]
        cur = [abs(e) for e in errors(samples, KERNEL_FITS[kind])] if kind in KERNEL_FITS else [math.nan]
        print(f"{kind:6} {len(samples):>7} {statistics.median(new):>14.1%} {max(new):>11.1%} "
              f"{statistics.median(cur):>15.1%} {max(cur):>12.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
