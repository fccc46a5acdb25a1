"""The runtime's devices: a rank's device, batches placed on it, part timing of mixed-precision parts;
and the kernel fits of a second dtype (the H100's bfloat16). The CUDA tests run where a GPU is visible and
say why they skip elsewhere (the CPU paths are checked on every machine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.launch import rank_device
from runtime.measure import part_jobs, time_part
from runtime.train import TrainOptions, synthetic_batch
from search.baselines import dp
from simulator.costmodel import AnalyticalCostModel
from simulator.kernel_efficiency import KERNEL_FITS, KernelFit
from soap.lowering import run_graph
from soap.setup import TrainSetup
from soap.topology import load_topology
from soapflow.api import capture_model

CASES = Path(__file__).parent / "runtime_cases.py"
SMALL_MLP = f"{CASES}:small_mlp"
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_rank_device_names_the_cpu_and_refuses_what_it_cannot_give():
    assert rank_device("cpu", 3) == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device kind 'tpu'"):
        rank_device("tpu", 0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU is visible"):
            rank_device("cuda", 0)
    with pytest.raises(ValueError, match="device must be cpu or cuda"):
        TrainOptions(device="gpu")


def test_a_batch_placed_on_a_device_holds_the_values_drawn_on_the_cpu():
    example = (torch.empty(4, 3, device="meta"), torch.empty(4, dtype=torch.long, device="meta"))
    here = synthetic_batch(example, step=2, seed=5, highs={1: 7})
    placed = synthetic_batch(example, step=2, seed=5, highs={1: 7}, device=torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(here, placed, strict=True))
    assert placed[1].dtype == torch.long and int(placed[1].max()) < 7


def test_a_mixed_precision_linear_part_is_timed_with_weights_in_its_compute_dtype():
    # the run graph's linear computes in bfloat16 from float32 master weights: timing it with float32
    # weights against a bfloat16 input would fail in the kernel
    _, graph = capture_model("mlp", batch_size=8)
    setup = TrainSetup(precision="bf16")
    strategy = dp(graph, load_topology("cpu-1"))
    jobs = [j for j in part_jobs(run_graph(graph, setup), [strategy]) if j.op["kind"] == "linear"]
    assert jobs and all(j.input_dtypes[0] == "bfloat16" for j in jobs)
    fwd, bwd, repeats = time_part(jobs[0], warmup=1, repeats=3)
    assert fwd > 0 and bwd > 0 and repeats == 3


def test_a_kernel_fit_keyed_by_kind_and_dtype_prices_that_dtype_only():
    _, graph = capture_model("mlp", batch_size=64)
    op = next(o for o in run_graph(graph, TrainSetup(precision="bf16")) if o.kind == "linear")
    box = tuple((0, n) for n in (*op.outputs[0].shape, op.params["weight"].shape[1]))
    device = load_topology("h100-1x1").devices[0]
    slow = KernelFit(eff_max=0.05, tile_c=14.7, k0=24.9, conv_scale=1.0, dtype="bfloat16")
    fits = {"h100": KERNEL_FITS["h100"], "h100:bfloat16": slow}
    with_slow = AnalyticalCostModel(kernel_fits=fits).compute_ms(op, box, device)
    shipped = AnalyticalCostModel().compute_ms(op, box, device)
    assert with_slow[0] > shipped[0] and with_slow[1] > shipped[1]
    # a kind given efficiencies of its own (a calibrated profile) keeps the flat roofline for every dtype
    flat = AnalyticalCostModel(kernel_fits=fits, efficiency={"h100": {"*": 0.5}})
    assert "h100:bfloat16" not in flat.kernel_fits and flat.kernel_device(op, device) is None


@CUDA
def test_nccl_training_on_one_gpu_verifies_and_parts_time_on_it():
    from soapflow.runner import run

    out = run(SMALL_MLP, "dp", nproc=1, steps=3, backend="nccl", verify=True, dtype="float64")
    assert out["verify"]["passed"] and out["verify"]["max_param_rel_diff"] <= 1e-9
    _, graph = capture_model("mlp", batch_size=8)
    job = part_jobs(graph, [dp(graph, load_topology("cpu-1"))])[0]
    fwd, bwd, repeats = time_part(job, warmup=1, repeats=3, device="cuda")
    assert fwd > 0 and bwd >= 0 and repeats == 3
