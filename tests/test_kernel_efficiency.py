"""Kernel-dependent efficiency of the GPU presets (`simulator.kernel_efficiency`, used by
`simulator.costmodel.AnalyticalCostModel`): size, wave quantization, bounds, bandwidth-bound ops, the CPU
kind untouched, and the fitted table against the kernel data it was fitted to."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from simulator.costmodel import DEFAULT_LAUNCH_US, AnalyticalCostModel
from simulator.kernel_efficiency import (
    KERNEL_FITS,
    Gemm,
    KernelDevice,
    efficiency,
    gemm_ms,
    load_kernel_table,
    predict_sample_ms,
    wave_ms,
)
from soap.devices import device_spec
from soap.graph import Operator, ParamSpec, TensorRef, TensorSpec
from soap.registry import op_def
from soap.topology import Device

DATA = Path(__file__).resolve().parent.parent / "benchmarks" / "data"
KINDS = ("p100", "v100", "k80")
KERNEL_TARGET = 0.15  # median |error| the fit must reach per kind (benchmarks/preset_fidelity.py)


def kdev(kind: str) -> KernelDevice:
    spec = device_spec(kind)
    peak_per_ms = spec.peak_tflops["float32"] * 1e9 * spec.sustained_fraction
    return KernelDevice(num_sms=spec.num_sms, sm_flops_per_ms=peak_per_ms / spec.num_sms,
                        bytes_per_ms=spec.memory_bandwidth_gbps * 0.8 * 1e6)


def linear_op(rows: int, features_in: int, features_out: int) -> Operator:
    return Operator(name="fc", kind="linear", inputs=(TensorRef(op="x"),),
                    outputs=(TensorSpec(shape=(rows, features_out)),),
                    params={"weight": ParamSpec(shape=(features_out, features_in), fqn="fc.weight")},
                    attrs={"input_shapes": [[rows, features_in]]},
                    fwd_flops=2.0 * rows * features_in * features_out,
                    bwd_flops=4.0 * rows * features_in * features_out,
                    fwd_bytes=4.0 * (rows * features_in + features_in * features_out + rows * features_out),
                    bwd_bytes=8.0 * (rows * features_in + features_in * features_out + rows * features_out))


def relu_op(numel: int) -> Operator:
    return Operator(name="relu", kind="elementwise", inputs=(TensorRef(op="x"),),
                    outputs=(TensorSpec(shape=(numel,)),), attrs={"input_shapes": [[numel]], "fn": "relu"},
                    fwd_flops=float(numel), bwd_flops=float(numel), fwd_bytes=8.0 * numel, bwd_bytes=12.0 * numel)


def whole(op: Operator):
    return tuple((0, d.size) for d in op_def(op.kind).dims(op))


@pytest.mark.parametrize("kind", KINDS)
def test_small_gemm_runs_below_a_large_one(kind):
    small = efficiency(Gemm(256, 64, 256), kdev(kind), KERNEL_FITS[kind])
    large = efficiency(Gemm(4096, 4096, 4096), kdev(kind), KERNEL_FITS[kind])
    assert small < 0.5 * large


@pytest.mark.parametrize("kind", KINDS)
def test_efficiency_never_exceeds_one(kind):
    dev, fit = kdev(kind), KERNEL_FITS[kind]
    shapes = [Gemm(m, n, k) for m in (1, 16, 128, 1000, 8192) for n in (1, 64, 1024, 9000) for k in (1, 64, 4096)]
    shapes += [Gemm(802816, 64, 27, conv=True), Gemm(128, 128, 128, batch=96)]
    values = [efficiency(g, dev, fit) for g in shapes]
    assert max(values) <= fit.eff_max <= 1.0
    assert min(values) > 0


@pytest.mark.parametrize("kind", KINDS)
def test_wave_quantization(kind):
    """One tile more than the SMs hold takes a second wave: it costs nearly as much as twice the SMs."""
    dev, fit = kdev(kind), KERNEL_FITS[kind]
    sms = dev.num_sms
    one = wave_ms(Gemm(128 * sms, 128, 2048), dev, fit, 128, 128)
    plus_one = wave_ms(Gemm(128 * (sms + 1), 128, 2048), dev, fit, 128, 128)
    double = wave_ms(Gemm(128 * 2 * sms, 128, 2048), dev, fit, 128, 128)
    assert plus_one > 1.9 * one
    assert plus_one == pytest.approx(double, rel=0.01)
    # cuBLAS's choice (the fastest tile and split) softens it, but the extra tile still costs far more
    # than its share of the work
    best_one = gemm_ms(Gemm(128 * sms, 128, 2048), dev, fit)
    best_plus = gemm_ms(Gemm(128 * (sms + 1), 128, 2048), dev, fit)
    assert best_plus > 1.2 * best_one * (sms + 1) / sms


def test_tile_quantization():
    """A dimension one past a tile multiple pays for a whole tile of padding: M = 129 costs what M = 256
    costs with 128 x 128 tiles, at about half the useful FLOP/s."""
    dev, fit = kdev("v100"), KERNEL_FITS["v100"]
    n = 128 * (dev.num_sms // 2)
    padded = wave_ms(Gemm(129, n, 1024), dev, fit, 128, 128)
    assert padded == pytest.approx(wave_ms(Gemm(256, n, 1024), dev, fit, 128, 128), rel=1e-12)
    assert Gemm(129, n, 1024).flops / padded < 0.55 * Gemm(256, n, 1024).flops / padded


def test_sustained_clock_slows_the_k80():
    spec = device_spec("k80")
    assert spec.sustained_clock_mhz < spec.boost_clock_mhz
    model = AnalyticalCostModel()
    dev = Device.of_kind("k80", id=0, node=0)
    op = linear_op(4096, 4096, 4096)
    fwd, _ = model.compute_ms(op, whole(op), dev)
    # never faster than the FLOPs at the sustained peak, which is below the datasheet's boost peak
    assert fwd > op.fwd_flops / (dev.peak_flops["float32"] * spec.sustained_fraction / 1e3)


def test_gpu_part_cost_follows_its_gemm():
    """A part of a linear op is priced by the GEMM restricted to its box: a quarter of the rows of a
    small GEMM costs more than a quarter of the whole (fewer tiles than SMs)."""
    model = AnalyticalCostModel()
    dev = Device.of_kind("v100", id=0, node=0)
    op = linear_op(512, 1024, 1024)
    box = whole(op)
    quarter = ((0, 128),) + box[1:]
    full_fwd, full_bwd = model.compute_ms(op, box, dev)
    part_fwd, part_bwd = model.compute_ms(op, quarter, dev)
    assert part_fwd > 0.3 * full_fwd and part_bwd > 0.3 * full_bwd


def test_memory_bound_elementwise_priced_by_bandwidth():
    model = AnalyticalCostModel()
    dev = Device.of_kind("p100", id=0, node=0)
    op = relu_op(64 * 1024 * 1024)
    fwd, _ = model.compute_ms(op, whole(op), dev)
    launch_ms = model.launch_us["*"] / 1e3
    by_bandwidth = 2 * op.output.nbytes / model.bandwidth_bytes_per_ms(dev)
    assert fwd == pytest.approx(by_bandwidth + launch_ms, rel=1e-9)


def test_cpu_keeps_the_flat_roofline():
    dev = Device.of_kind("cpu", id=0, node=0)
    op = linear_op(256, 512, 512)
    for model in (AnalyticalCostModel(), AnalyticalCostModel(kernel_fits={})):
        fwd, bwd = model.compute_ms(op, whole(op), dev)
        peak_per_ms = dev.peak_flops["float32"] * model.flop_efficiency("cpu", "linear") / 1e3
        launch_ms = DEFAULT_LAUNCH_US["cpu"] / 1e3
        assert fwd == pytest.approx(op.fwd_flops / peak_per_ms + launch_ms, rel=1e-12)
        assert bwd == pytest.approx(op.bwd_flops / peak_per_ms + 2 * launch_ms, rel=1e-12)


def test_calibrated_kind_keeps_the_flat_roofline():
    """Efficiencies given for a GPU kind (a calibrated machine profile) replace the kernel model there."""
    dev = Device.of_kind("p100", id=0, node=0)
    op = linear_op(2048, 2048, 2048)
    model = AnalyticalCostModel(efficiency={"p100": {"linear": 0.5}})
    fwd, _ = model.compute_ms(op, whole(op), dev)
    assert fwd == pytest.approx(op.fwd_flops / (dev.peak_flops["float32"] * 0.5 / 1e3) + 0.005, rel=1e-9)


@pytest.mark.parametrize("kind", KINDS)
def test_fitted_table_reproduces_the_kernel_data(kind):
    samples = load_kernel_table(DATA / f"kernels_{kind}.csv")
    assert samples and all(s.device_kind == kind for s in samples)
    launch_us = DEFAULT_LAUNCH_US["*"]
    errors = [abs(predict_sample_ms(s, KERNEL_FITS[kind], launch_us) - s.time_ms) / s.time_ms for s in samples]
    assert statistics.median(errors) <= KERNEL_TARGET


def test_recurrent_cells_are_priced_by_their_gate_gemms():
    """LSTM, GRU and plain RNN parts run the GEMMs of their gate blocks (4, 3, 1 per layer): their forward
    GEMM FLOPs are the registry's matmul FLOPs, in the gates' ratio, for a whole op and a time chunk."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import runtime_cases as rc

    from simulator.kernel_efficiency import op_gemms

    forward = {}
    for model in ("rnnlm", "grulm", "rnnlm_tanh"):
        graph = rc.graph_of(model)
        op = next(o for o in graph if op_def(o.kind).dims(o)[1].carried)
        box = whole(op)
        fwd, bwd = op_gemms(op, box)
        forward[op.kind] = sum(g.flops for g in fwd)
        assert bwd and forward[op.kind] == pytest.approx(op_def(op.kind).matmul_flops(op))
        half = ((box[0]), (0, box[1][1] // 2), box[2])  # the first half of the time steps
        assert sum(g.flops for g in op_gemms(op, half)[0]) == pytest.approx(forward[op.kind] / 2)
    assert forward["lstm"] / 4 == pytest.approx(forward["gru"] / 3) == pytest.approx(forward["rnn"])


def test_a_mixture_of_experts_runs_the_routed_pairs_products():
    """An experts op's GEMMs, per held expert its share of the routed (token, slot) pairs through the gate,
    up and down products, count the registry's product FLOPs, and a part holding half the experts and half
    their inner units a quarter of them."""
    from simulator.kernel_efficiency import op_gemms

    op = Operator(name="moe", kind="experts", inputs=(TensorRef(op="x"), TensorRef(op="i"), TensorRef(op="w")),
                  outputs=(TensorSpec(shape=(64, 16)),),
                  params={"w_gate": ParamSpec(shape=(8, 32, 16), fqn="m.g"),
                          "w_up": ParamSpec(shape=(8, 32, 16), fqn="m.u"),
                          "w_out": ParamSpec(shape=(8, 16, 32), fqn="m.o")},
                  attrs={"act": "silu", "transposed": False, "input_shapes": [[64, 16], [64, 2], [64, 2]]})
    box = whole(op)
    fwd, bwd = op_gemms(op, box, grads=[True, False, True])
    products = 64 * 2 * 2 * 3 * 32 * 16  # the pairs, 2 FLOPs a multiply-add, three products of 32 x 16
    assert sum(g.flops for g in fwd) == pytest.approx(products)
    assert products < op_def("experts").flops(op) < 1.1 * products
    assert sum(g.flops for g in bwd) == pytest.approx(2 * products)  # the data and the weight gradients
    quarter = (box[0], (0, 4), (0, 16))
    assert sum(g.flops for g in op_gemms(op, quarter)[0]) == pytest.approx(products / 4)
