"""The simulator on a real GPU: measured op costs, step times and peak memory against the predictions.

Two phases, so that the GPU is needed only for the first (and a third that prepares it):

``graphs --out DIR`` (anywhere) captures the models with this machine's torch and writes them as
``DIR/MODEL.json``; ``measure --graphs DIR`` then times the parts of those graphs and trains them, so that
the parts' keys are those the report's own capture looks up, whatever torch the GPU machine has (torch
2.11 captures `nn.LSTM`'s hidden state with an extra axis, which soapflow, pinned to 2.13, does not read).

``measure`` (on a machine with one CUDA GPU) writes, under ``--out``:

- ``gpu_measurements.json``: the device, torch, CUDA and cuDNN versions; per model and precision the
  single-GPU training step time (median of ``--rounds`` rounds, each the median of ``--steps`` steps after
  a warm-up step; `runtime.train.time_strategies`) and the peak tensor memory of a step
  (`runtime.memory.measure_step`: the held state plus the growth of `torch.cuda.max_memory_allocated`);
  the kernel table (below); and what ``soapflow run ... --backend nccl --verify`` printed for the models
  of `RUN_MODELS`;
- ``<kind>.jsonl``: the cost database of every op part of those models under their single-GPU strategy
  and under data parallelism over 8 GPUs (the part shapes the presets' benchmarks simulate), forward and
  backward, float32 and bfloat16 (`runtime.measure.measure_parts` on the GPU);
- with ``--stages host``, the host's time to issue a training step beside the whole step (``host``);
- the kernel table: matrix products and convolutions of the shapes of `benchmarks/data/kernels_v100.csv`
  timed alone (CUDA events, median of 20 after 5 warm-ups), float32 and bfloat16.

float32 is IEEE float32 (the runtime switches TF32 off: `runtime.launch.exact_float32`); bf16 is the
mixed-precision setup (`TrainSetup(precision="bf16")`: bfloat16 compute, float32 master weights).

``report`` (anywhere, no GPU) reads the committed measurements and predicts every row on the matching
preset (``<kind>-1x1``) twice: with the analytical model alone and with the measured cost database
(`simulator.costmodel.MeasuredCostModel`, the analytical model for parts it lacks). It writes
``benchmarks/results/gpu_step_time.md``, ``gpu_memory.md``, ``gpu_runtime.md`` and ``gpu_kernels.md``
(+ ``.json``). Goals: median step-time error <= 10% with the cost database and <= 25% analytical; memory
error <= 10%.

    python benchmarks/gpu_accuracy.py graphs --out GRAPHS
    python benchmarks/gpu_accuracy.py measure --out DIR --graphs GRAPHS [--models ...] [--precisions fp32 bf16]
    python benchmarks/gpu_accuracy.py report [--measurements benchmarks/results/gpu_measurements.json]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DATA = ROOT / "benchmarks" / "data"
HERE = "benchmarks/gpu_accuracy.py"

# model reference -> batch size of the benchmark (the zoo's defaults; the Hugging Face decoder is GPT-2
# small as its config defines it, at 1024 tokens per sequence)
MODELS = {
    "resnet50": 64,
    "inception_v3": 64,
    "transformer": 8,
    f"{HERE}:hf_gpt2": 8,
    "rnnlm": 64,
}
PRECISIONS = ("fp32", "bf16")
RUN_MODELS = {"resnet50": 8, "transformer": 4, f"{HERE}:hf_gpt2": 2}  # `soapflow run --verify`, small batches
DP_DEVICES = 8


def hf_gpt2(batch_size: int = 8, *, seq: int = 1024) -> tuple:
    """Hugging Face GPT-2 small (124M parameters: 12 layers, width 768, 12 heads, vocabulary 50257) from
    its default config with random weights (nothing is downloaded), fused attention, no dropout."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from soapflow.zoo.losses import lm_cross_entropy

    config = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = AutoModelForCausalLM.from_config(config)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids).logits

    ids = torch.empty(batch_size, seq, dtype=torch.long, device="meta")
    target = torch.empty(batch_size, seq, dtype=torch.long, device="meta")
    return Logits(), (ids, target), lm_cross_entropy


def setup_of(precision: str):
    from soap.setup import TrainSetup

    return TrainSetup(optimizer="adamw", lr=1e-4, precision=precision)


def single_and_dp(graph, kind: str, setup):
    """The single-GPU strategy and data parallelism over `DP_DEVICES` of the preset's kind."""
    from soap.topology import load_topology
    from soapflow.api import resolve_strategy

    one = load_topology(f"{kind}-1x1")
    eight = load_topology(f"{kind}-1x{DP_DEVICES}")
    return (resolve_strategy("dp", graph=graph, topology=one, setup=setup),
            resolve_strategy("dp", graph=graph, topology=eight, setup=setup))


# -- measure (GPU) ---------------------------------------------------------------------------------------


def _kernel_rows() -> list[dict[str, str]]:
    lines = [line for line in (DATA / "kernels_v100.csv").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    return list(csv.DictReader(lines))


def time_kernels(dtype: torch.dtype, repeats: int = 20, warmup: int = 5) -> list[dict[str, Any]]:
    """Each GEMM and convolution of the kernel table's shapes, timed alone on the current GPU."""
    out = []
    for row in _kernel_rows():
        if row["family"] == "gemm":
            m, n, k = int(row["m"]), int(row["n"]), int(row["k"])
            a = torch.randn(m, k, device="cuda", dtype=dtype)
            b = torch.randn(k, n, device="cuda", dtype=dtype)

            def fn(a=a, b=b):
                return a @ b
        else:
            n, c, h, w = (int(row[x]) for x in ("n", "c", "h", "w"))
            k, r, s = int(row["k"]), int(row["r"]), int(row["s"])
            x = torch.randn(n, c, h, w, device="cuda", dtype=dtype)
            wt = torch.randn(k, c, r, s, device="cuda", dtype=dtype)
            pad = (int(row["pad_h"]), int(row["pad_w"]))
            stride = (int(row["stride_h"]), int(row["stride_w"]))

            def fn(x=x, wt=wt, pad=pad, stride=stride):
                return torch.nn.functional.conv2d(x, wt, padding=pad, stride=stride)
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        out.append({**{k: v for k, v in row.items() if k not in ("time_ms", "tflops")},
                    "time_ms": statistics.median(times)})
    return out


def load_graph(ref: str, batch: int, graphs: str | None):
    """The model's graph from `graphs` (``MODEL.json``, written by the ``graphs`` phase) where it is there,
    else captured here (another torch version's capture may differ: the module docstring)."""
    from soap.graph import OperatorGraph

    saved = Path(graphs or "") / f"{_file_name(ref)}.json"
    if graphs and saved.exists():
        return OperatorGraph.from_dict(json.loads(saved.read_text()))
    return captured(ref, batch)


@functools.cache
def captured(ref: str, batch: int):
    """The model captured here at `batch`, once per process (the report predicts and fits from the same
    graphs)."""
    from soapflow.api import capture_model

    return capture_model(ref, batch_size=batch)[1]


def _file_name(ref: str) -> str:
    return ref.rpartition(":")[2]


def measure_model(ref: str, batch: int, precision: str, *, kind: str, db_path: str, steps: int, rounds: int,
                  graphs: str | None = None, parts_only: bool = False) -> dict[str, Any]:
    from runtime.measure import measure_parts, part_jobs
    from runtime.memory import measure_step
    from runtime.train import (
        TrainOptions,
        build_executor,
        integer_highs,
        loss_scaler,
        synthetic_batch,
        time_strategies,
        train_step,
    )
    from soap.lowering import run_graph
    from soapflow.runner import build_workload

    row: dict[str, Any] = {"model": ref, "batch": batch, "precision": precision}
    t0 = time.perf_counter()
    graph = load_graph(ref, batch, graphs)
    setup = setup_of(precision)
    single, dp = single_and_dp(graph, kind, setup)
    jobs = part_jobs(run_graph(graph, setup), [single, dp], device_kind=kind)
    _, timed = measure_parts(jobs, db_path, device_kind=kind, device="cuda", source="gpu_accuracy")
    row["parts_timed"] = timed
    t1 = time.perf_counter()
    if parts_only:
        return row
    build = functools.partial(build_workload, ref, batch)
    configs = {name: cfg.to_dict() for name, cfg in single.items()}
    options = TrainOptions(setup=setup, device="cuda", timeout_s=600.0)
    torch.cuda.empty_cache()
    times = time_strategies(0, 1, build=build, graph=graph.to_dict(), strategies={"single": configs},
                            options=options, steps=steps, rounds=rounds)["single"]
    row["step_ms_rounds"] = times
    row["step_ms"] = statistics.median(times)
    t2 = time.perf_counter()
    torch.cuda.empty_cache()
    _, executor, optimizer, workload, _ = build_executor(0, 1, graph, configs, build, options)
    scaler = loss_scaler(setup)
    highs = integer_highs(graph, workload.module)
    for step in range(3):
        b = synthetic_batch(workload.example, step=step, seed=0, highs=highs, device=executor.device)
        if step < 2:
            train_step(executor, optimizer, b, step=step, scaler=scaler)
        else:
            peak = measure_step(executor, optimizer, b, step=step, scaler=scaler, device=executor.device)
    row["peak_bytes"] = peak.peak_bytes
    row["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    del executor, optimizer, workload, b
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    row["seconds"] = {"capture_and_parts": t1 - t0, "steps": t2 - t1, "memory": time.perf_counter() - t2}
    return row


def measure_host(ref: str, batch: int, precision: str, *, kind: str, graphs: str | None, steps: int = 5
                 ) -> dict[str, Any]:
    """How long the host takes to issue a training step (from a synchronized start until `train_step`
    returns, the device still working) beside the whole step (until the device is done): where the two
    are close, the host sets the step's pace."""
    from runtime.train import TrainOptions, build_executor, integer_highs, loss_scaler, synthetic_batch, train_step
    from soapflow.runner import build_workload

    graph = load_graph(ref, batch, graphs)
    setup = setup_of(precision)
    single, _ = single_and_dp(graph, kind, setup)
    options = TrainOptions(setup=setup, device="cuda", timeout_s=600.0)
    build = functools.partial(build_workload, ref, batch)
    _, executor, optimizer, workload, _ = build_executor(0, 1, graph, {n: c.to_dict() for n, c in single.items()},
                                                         build, options)
    scaler = loss_scaler(setup)
    highs = integer_highs(graph, workload.module)
    issued, whole = [], []
    for step in range(2 + steps):
        b = synthetic_batch(workload.example, step=step, seed=0, highs=highs, device=executor.device)
        torch.cuda.synchronize()
        start = time.perf_counter()
        train_step(executor, optimizer, b, step=step, scaler=scaler)
        mid = time.perf_counter()
        torch.cuda.synchronize()
        end = time.perf_counter()
        if step >= 2:
            issued.append((mid - start) * 1e3)
            whole.append((end - start) * 1e3)
    del executor, optimizer, workload, b
    torch.cuda.empty_cache()
    return {"model": ref, "precision": precision, "host_ms": statistics.median(issued),
            "step_ms": statistics.median(whole)}


def write_graphs(out: str) -> int:
    """Capture every model of `MODELS` at its batch and write it as ``out/MODEL.json``."""

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    for ref, batch in MODELS.items():
        graph = captured(ref, batch)
        (folder / f"{_file_name(ref)}.json").write_text(json.dumps(graph.to_dict()))
        print(f"{_file_name(ref)}: {len(graph.ops)} ops")
    return 0


def run_cli(ref: str, batch: int, dtype: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "soapflow", "run", ref, "-s", "dp", "--nproc", "1", "--backend", "nccl",
           "--verify", "--batch", str(batch), "--steps", "3", "--dtype", dtype]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    return {"model": ref, "batch": batch, "dtype": dtype, "command": " ".join(["soapflow", *cmd[3:]]),
            "rc": proc.returncode, "stdout": proc.stdout[-4000:], "stderr": proc.stderr[-4000:],
            "seconds": time.perf_counter() - start}


def measure(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("measure needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kind = args.kind
    report_path = out / "gpu_measurements.json"
    report: dict[str, Any] = json.loads(report_path.read_text()) if report_path.exists() else {}
    report.setdefault("rows", [])
    report.setdefault("runs", [])
    report["device"] = {"kind": kind, "name": torch.cuda.get_device_name(), "torch": torch.__version__,
                        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                        "sms": torch.cuda.get_device_properties(0).multi_processor_count}

    def save() -> None:
        report_path.write_text(json.dumps(report, indent=1) + "\n")

    from runtime.launch import exact_float32

    exact_float32()
    if "kernels" in args.stages:
        report["kernels"] = {p: time_kernels(torch.float32 if p == "fp32" else torch.bfloat16)
                             for p in args.precisions}
        save()
        print(f"kernels: {sum(len(v) for v in report['kernels'].values())}", flush=True)
    db_path = os.fspath(out / f"{kind}.jsonl")
    if "models" in args.stages or "parts" in args.stages:
        for ref in args.models:
            for precision in args.precisions:
                try:
                    row = measure_model(ref, MODELS[ref], precision, kind=kind, db_path=db_path, steps=args.steps,
                                        rounds=args.rounds, graphs=args.graphs,
                                        parts_only="models" not in args.stages)
                except Exception as exc:  # keep measuring the others; the report says what failed
                    row = {"model": ref, "batch": MODELS[ref], "precision": precision,
                           "error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-3000:]}
                report["rows"] = [r for r in report["rows"] if (r["model"], r["precision"]) != (ref, precision)]
                report["rows"].append(row)
                save()
                print(json.dumps({k: v for k, v in row.items() if k != "step_ms_rounds"}), flush=True)
    if "host" in args.stages:
        report["host"] = []
        for ref in args.models:
            for precision in args.precisions:
                report["host"].append(measure_host(ref, MODELS[ref], precision, kind=kind, graphs=args.graphs))
                save()
                print(json.dumps(report["host"][-1]), flush=True)
    if "run" in args.stages:
        for ref, batch in RUN_MODELS.items():
            for dtype in ("float32", "float64"):
                result = run_cli(ref, batch, dtype)
                report["runs"] = [r for r in report["runs"] if (r["model"], r["dtype"]) != (ref, dtype)] + [result]
                save()
            print(json.dumps({k: result[k] for k in ("model", "rc", "seconds")}), result["stdout"][-600:],
                  result["stderr"][-600:], flush=True)
    return 0


# -- report (anywhere) -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="phase", required=True)
    m = sub.add_parser("measure", help="measure on this machine's GPU")
    m.add_argument("--out", required=True)
    m.add_argument("--kind", default="h100", help="the device kind the measurements are filed under")
    m.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    m.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    m.add_argument("--stages", nargs="+", default=["kernels", "models", "run"],
                   choices=("kernels", "models", "parts", "host", "run"),
                   help="models: op parts, step times and memory; parts: op parts only; host: the host's time "
                        "to issue a step beside the step")
    m.add_argument("--graphs", help="a folder of captured graphs (MODEL.json, `OperatorGraph.to_dict`) to use in "
                                    "place of capturing here")
    m.add_argument("--steps", type=int, default=5)
    m.add_argument("--rounds", type=int, default=3)
    c = sub.add_parser("graphs", help="capture the models here for the measure phase's --graphs")
    c.add_argument("--out", required=True)
    r = sub.add_parser("report", help="predict the measured rows and write the tables")
    r.add_argument("--measurements", default=os.fspath(RESULTS / "gpu_measurements.json"))
    r.add_argument("--costdb", default=os.fspath(ROOT / "simulator" / "costdbs" / "h100.jsonl"))
    args = p.parse_args(argv)
    if args.phase == "measure":
        return measure(args)
    if args.phase == "graphs":
        return write_graphs(args.out)
    return report(args)


def _host(measured: dict[str, Any], model: str, precision: str) -> dict[str, float]:
    """The host's time to issue the step and the step, from the ``host`` stage's run (if measured)."""
    found = [h for h in measured.get("host", []) if (h["model"], h["precision"]) == (model, precision)]
    return {"host_ms": found[0]["host_ms"], "host_run_step_ms": found[0]["step_ms"]} if found else {}


def _step(measured: dict[str, Any], model: str, precision: str) -> float:
    return next(r["step_ms"] for r in measured["rows"] if _file_name(r["model"]) == model
                and r["precision"] == precision and "step_ms" in r)


def _err(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def predict_rows(measured: dict[str, Any], db_path: Path) -> list[dict[str, Any]]:
    """Each measured (model, precision) predicted on the preset ``<kind>-1x1``: analytical, and with the
    measured cost database (`MeasuredCostModel`, analytical for the parts it lacks)."""
    from simulator.costmodel import AnalyticalCostModel, MeasuredCostModel
    from simulator.engine import simulate
    from soap import costdb
    from soap.topology import load_topology

    kind = measured["device"]["kind"]
    topology = load_topology(f"{kind}-1x1")
    db = costdb.load(db_path)
    out = []
    for row in measured["rows"]:
        if "error" in row:
            out.append({"model": row["model"], "precision": row["precision"], "failed": row["error"]})
            continue
        graph = captured(row["model"], row["batch"])
        setup = setup_of(row["precision"])
        single, _ = single_and_dp(graph, kind, setup)
        analytical = simulate(graph, single, topology, AnalyticalCostModel(), setup=setup).summary()
        model = MeasuredCostModel(db)
        with_db = simulate(graph, single, topology, model, setup=setup).summary()
        views = view_parts_ms(graph, single, setup, db, kind)
        out.append({
            "model": _file_name(row["model"]), "precision": row["precision"], "batch": row["batch"],
            "measured_ms": row["step_ms"], "costdb_ms": with_db["iteration_time_ms"],
            "costdb_error": _err(with_db["iteration_time_ms"], row["step_ms"]),
            "analytical_ms": analytical["iteration_time_ms"],
            "analytical_error": _err(analytical["iteration_time_ms"], row["step_ms"]),
            "parts_found": model.hits, "parts_missing": model.misses, "view_parts_ms": views,
            "measured_peak_gib": row["peak_bytes"] / 2**30,
            "max_memory_allocated_gib": row["max_memory_allocated"] / 2**30,
            "predicted_peak_gib": max(with_db["peak_memory_bytes"]) / 2**30,
            "memory_error": _err(max(with_db["peak_memory_bytes"]), row["peak_bytes"]),
            **_host(measured, row["model"], row["precision"])})
    return out


def view_parts_ms(graph, strategy, setup, db, kind: str) -> float:
    """What the cost database charges a step for the parts of view ops (reshape, transpose, slice, split:
    no kernel of their own on a GPU, only the host's dispatch and autograd), forward and backward."""
    from runtime.measure import job_for
    from simulator.costmodel import VIEW_KINDS
    from soap.config import parts
    from soap.costdb import part_key
    from soap.lowering import GradFlow, run_graph

    run = run_graph(graph, setup)
    flow = GradFlow(run, setup)
    total = 0.0
    for op in run:
        if op.kind not in VIEW_KINDS:
            continue
        for box, _ in parts(op, strategy[op.name]):
            found = db.lookup(part_key(op, box, kind, job_for(run, op, box, flow).needs_grad))
            total += 0.0 if found is None else found.fwd_ms + found.bwd_ms
    return total


def kernel_samples(measured: dict[str, Any]) -> dict[str, list]:
    """The measured kernel table as `simulator.kernel_efficiency.KernelSample`s per dtype, on the device
    as the cost model sees it (`soap.devices`: SM count, the datasheet peak of the dtype at the sustained
    clock, the memory bandwidth)."""
    from simulator.kernel_efficiency import KernelDevice, KernelSample, table_gemm
    from soap.devices import DEVICE_SPECS

    kind = measured["device"]["kind"]
    spec = DEVICE_SPECS[kind]
    out = {}
    for precision, rows in measured.get("kernels", {}).items():
        dtype = "float32" if precision == "fp32" else "bfloat16"
        peak = spec.peak_tflops[dtype] * 1e12 * spec.sustained_fraction
        device = KernelDevice(num_sms=spec.num_sms, sm_flops_per_ms=peak / spec.num_sms / 1e3,
                              bytes_per_ms=spec.memory_bandwidth_gbps * 1e6)
        out[dtype] = [KernelSample(device_kind=kind, family=row["family"], label=row["label"], gemm=table_gemm(row),
                                   time_ms=float(row["time_ms"]), device=device) for row in rows]
    return out


KERNEL_COLUMNS = ["dtype", "part passes", "before: median / max |error|", "fitted: median / max |error|", "kernels",
                  "kernel table: median / max |error|", "fitted constants", "constants in KERNEL_FITS"]
RUN_COLUMNS = ["command", "exit", "median step ms", "verify"]
GEMM_KINDS = ("linear", "matmul", "conv2d", "attention", "lstm", "gru", "rnn")


def part_samples(measured: dict[str, Any], db) -> dict[str, list[tuple]]:
    """Per dtype, (op, box, grads, forward ms, backward ms) of every GEMM-like op part of the measured
    models (single GPU and data parallelism over 8) that the cost database holds."""
    from runtime.measure import part_jobs
    from soap.costdb import part_key
    from soap.lowering import run_graph

    kind = measured["device"]["kind"]
    out: dict[str, list[tuple]] = {}
    seen = set()
    for row in measured["rows"]:
        if "error" in row:
            continue
        graph = captured(row["model"], row["batch"])
        setup = setup_of(row["precision"])
        for job in part_jobs(run_graph(graph, setup), single_and_dp(graph, kind, setup), device_kind=kind):
            op = job.operator()
            key = part_key(op, job.box, kind, job.needs_grad)
            found = db.lookup(key)
            if op.kind in GEMM_KINDS and found is not None and key not in seen:
                seen.add(key)
                out.setdefault(found.dtype, []).append((op, job.box, job.needs_grad, found.fwd_ms, found.bwd_ms))
    return out


def fit_parts(by_dtype: dict[str, list[tuple]], device, start) -> tuple[dict[str, Any], float, dict, dict]:
    """The kernel constants per dtype (`eff_max`, `tile_c`, `k0`, `conv_scale`; `KERNEL_FITS` keys ``kind``
    for float32 and ``kind:dtype`` for others) and one cost of a kernel launch for the kind (us: with the
    framework's per-kernel overhead, which small kernels pay in full) fitted to measured op parts: scipy
    least squares on the log of the forward and backward times, soft-L1, as
    `benchmarks/fit_kernel_efficiency.py`. Returns the fits, the launch cost, and per dtype the errors per
    part pass with them and with `start` (the constants before, at the default launch cost)."""
    import math

    import numpy as np
    from scipy.optimize import least_squares

    from simulator.costmodel import DEFAULT_LAUNCH_US, AnalyticalCostModel
    from simulator.kernel_efficiency import KernelFit

    dtypes = sorted(by_dtype)
    keys = {dt: device.kind if dt == "float32" else f"{device.kind}:{dt}" for dt in dtypes}
    measured = {dt: [t for *_, f, b in by_dtype[dt] for t in (f, b)] for dt in dtypes}

    def times(fits: dict[str, KernelFit], launch_us: float | None) -> dict[str, list[float]]:
        model = AnalyticalCostModel(kernel_fits={keys[dt]: f for dt, f in fits.items()},
                                    launch_us={} if launch_us is None else {device.kind: launch_us})
        out = {}
        for dt in dtypes:
            out[dt] = []
            for op, box, grads, _, _ in by_dtype[dt]:
                out[dt] += list(model.compute_ms(op, box, device, grads))
        return out

    def fits_of(x: np.ndarray) -> dict[str, KernelFit]:
        return {dt: KernelFit(eff_max=float(x[4 * i]), tile_c=float(x[4 * i + 1]), k0=float(x[4 * i + 2]),
                              conv_scale=float(x[4 * i + 3]), dtype=dt) for i, dt in enumerate(dtypes)}

    def residuals(x: np.ndarray) -> np.ndarray:
        got = times(fits_of(x), float(x[-1]))
        return np.array([math.log(max(p, 1e-6) / max(m, 1e-6)) for dt in dtypes
                         for p, m in zip(got[dt], measured[dt], strict=True)])

    x0 = np.array([start.eff_max, start.tile_c, start.k0, start.conv_scale] * len(dtypes) + [20.0])
    lo = [0.05, 0.0, 0.0, 0.05] * len(dtypes) + [0.0]
    hi = [1.0, 512.0, 4096.0, 1.0] * len(dtypes) + [500.0]
    result = least_squares(residuals, x0, bounds=(lo, hi), loss="soft_l1", f_scale=0.2, diff_step=1e-3)
    fits, launch = fits_of(result.x), float(result.x[-1])

    def errors(got: dict[str, list[float]]) -> dict[str, list[float]]:
        return {dt: [(p - m) / m for p, m in zip(got[dt], measured[dt], strict=True) if m > 0] for dt in dtypes}

    before = times({dt: dataclasses.replace(start, dtype=dt) for dt in dtypes}, DEFAULT_LAUNCH_US["*"])
    return fits, launch, errors(times(fits, launch)), errors(before)


def kernels_report(measured: dict[str, Any], db_path: Path) -> tuple[str, dict[str, Any]]:
    """Refit the preset's kernel constants to the measured op parts (`fit_parts`) and compare them, part by
    part and on the separately timed kernel table, with what `KERNEL_FITS` holds."""
    from simulator.costmodel import DEFAULT_LAUNCH_US
    from simulator.kernel_efficiency import KERNEL_FITS, predict_sample_ms
    from soap import costdb
    from soap.topology import load_topology
    from soapflow.tables import frame, markdown_table

    kind = measured["device"]["kind"]
    device = load_topology(f"{kind}-1x1").devices[0]
    samples = part_samples(measured, costdb.load(db_path))
    fits, launch, after, before = fit_parts(samples, device, KERNEL_FITS["v100"])

    def stats(values: list[float]) -> str:
        values = [abs(v) for v in values]
        return f"{statistics.median(values):.1%} / {max(values):.0%}" if values else "-"

    shipped = {dt: KERNEL_FITS.get(kind if dt == "float32" else f"{kind}:{dt}") for dt in fits}
    rows = []
    table_errors = {}
    for dt, fit in fits.items():
        held = kernel_samples(measured).get(dt, [])
        table_errors[dt] = [(predict_sample_ms(k, fit, 0.0) - k.time_ms) / k.time_ms for k in held]
        rows.append([dt, len(samples[dt]) * 2, stats(before[dt]), stats(after[dt]), len(held),
                     stats(table_errors[dt]),
                     f"eff_max {fit.eff_max:.3f}, tile_c {fit.tile_c:.1f}, k0 {fit.k0:.1f}, "
                     f"conv_scale {fit.conv_scale:.3f}",
                     "-" if shipped[dt] is None else f"eff_max {shipped[dt].eff_max:.3f}, tile_c "
                     f"{shipped[dt].tile_c:.1f}, k0 {shipped[dt].k0:.1f}, conv_scale {shipped[dt].conv_scale:.3f}"])
    md = "\n".join([
        "# The analytical model's H100 constants, refitted from measurements", "",
        "Written by `python benchmarks/gpu_accuracy.py report`; measured on {where}. The constants of "
        "`simulator.kernel_efficiency` (tile model of GEMM-like op parts) are fitted per dtype, together "
        "with one launch cost per kernel for the kind, to the forward and backward times of every "
        "GEMM-like op part (linear, matmul, conv2d, attention, LSTM) of the measured models under one GPU "
        "and under data parallelism over 8 (the cost database), by scipy least squares on log time "
        "(soft-L1). Before: V100's constants and the default launch cost (what an H100 preset without a "
        "fit of its own would use). Check: the same constants on matrix products and convolutions of "
        "DeepBench's shapes timed alone (CUDA events, no launch cost), which the fit never saw.", "",
        markdown_table(frame([dict(zip(KERNEL_COLUMNS, r, strict=True)) for r in rows], KERNEL_COLUMNS)),
        "", f"Fitted launch cost per kernel: {launch:.1f} us (DEFAULT_LAUNCH_US[{kind!r}] holds "
        f"{DEFAULT_LAUNCH_US.get(kind, DEFAULT_LAUNCH_US['*']):.1f}). It is the host's cost per kernel of the "
        "eager runtime (Python, the dispatcher, autograd), which a small part pays in full; the bare CUDA "
        "launch is a few microseconds.", "",
        "Where the model misses: the tile model was written for the SGEMM kernels of Pascal and Volta "
        "(tiles up to 128 x 128). Hopper's bfloat16 kernels use larger tiles and asynchronous warpgroup "
        "instructions; the bfloat16 fit drives `tile_c` to its bound and still leaves a median part error "
        "near a quarter, where float32 (no tensor cores) fits better.", ""])
    data = {"launch_us": launch, "fits": {dt: dataclasses.asdict(f) for dt, f in fits.items()},
            "errors_before": before, "errors_after": after, "kernel_table_errors": table_errors}
    return md, data


def runtime_report(measured: dict[str, Any]) -> str:
    """The `soapflow run --backend nccl --verify` runs as a table."""
    from soapflow.tables import frame, markdown_table

    rows = []
    for run in measured.get("runs", []):
        verify = next((line for line in run["stdout"].splitlines() if line.startswith("verify")), "")
        step = next((line for line in run["stdout"].splitlines() if line.startswith("median step")), "")
        rows.append([f"`{run['command']}`", run["rc"], step.rpartition(":")[2].strip(),
                     verify.partition(":")[2].strip() or run["stderr"].strip()[-300:]])
    return "\n".join([
        "# The runtime on CUDA: `soapflow run --backend nccl --verify`", "",
        "Run by `python benchmarks/gpu_accuracy.py measure` on {where}. One process on the one GPU (the "
        "machine has one, so nccl runs a single rank; several ranks on several GPUs take the same code "
        "path, one GPU per local rank). The reference is single-process training of the same module on the "
        "same GPU (cuDNN in deterministic mode on both sides).", "",
        markdown_table(frame([dict(zip(RUN_COLUMNS, r, strict=True)) for r in rows], RUN_COLUMNS)),
        "",
        "ResNet-50 in float32 fails the check and passes it in float64 with no difference at all. This is not "
        "CUDA: the same float32 check fails on a CPU too (gloo, one process: loss off by 0.4%, `bn1.weight` "
        "by 1.3 of its update). At batch 8, with batch-norm statistics over 8 images, one-ulp differences "
        "between the two sides grow within two steps (the loss "
        "itself jumps from 7.25 to 7.99 at step 2). float64 shows that the runtime computes what "
        "single-process training computes; `--dtype float64` is the tight check, as on a CPU.", ""])


def report(args: argparse.Namespace) -> int:
    from soapflow.tables import frame, markdown_table

    measured = json.loads(Path(args.measurements).read_text())
    dev = measured["device"]
    where = (f"{dev['name']} ({dev['sms']} SMs), torch {dev['torch']}, CUDA {dev['cuda']}, cuDNN {dev['cudnn']}; "
             "one process, data parallelism over one GPU (every op whole)")
    db_path = Path(args.costdb)
    rows = predict_rows(measured, db_path)
    ok = [r for r in rows if "failed" not in r]
    summary = {}
    for name in ("costdb_error", "analytical_error", "memory_error"):
        values = [abs(r[name]) for r in ok]
        summary[name] = {"median": statistics.median(values), "max": max(values)} if values else None
    (RESULTS / "gpu_step_time.json").write_text(json.dumps({"device": dev, "rows": rows, "summary": summary},
                                                           indent=1) + "\n")
    pct = "{:+.1%}".format
    ms = "{:.1f}".format
    step_cols = ["model", "precision", "batch", "measured_ms", "costdb_ms", "costdb_error", "analytical_ms",
                 "analytical_error", "parts_found", "parts_missing", "view_parts_ms", "host_ms", "host_run_step_ms"]
    step = markdown_table(frame(ok, step_cols), {"measured_ms": ms, "costdb_ms": ms, "costdb_error": pct,
                                                 "analytical_ms": ms, "analytical_error": pct, "view_parts_ms": ms,
                                                 "host_ms": ms, "host_run_step_ms": ms},
                          headers=["model", "precision", "batch", "measured ms", "cost database ms", "error",
                                   "analytical ms", "error", "parts found", "parts missing",
                                   "view-op parts ms (in the cost database's time)",
                                   "host issues the step in ms", "that run's step ms"])
    mem_cols = ["model", "precision", "batch", "measured_peak_gib", "max_memory_allocated_gib", "predicted_peak_gib",
                "memory_error"]
    gib = "{:.2f}".format
    mem = markdown_table(frame(ok, mem_cols), {"measured_peak_gib": gib, "max_memory_allocated_gib": gib,
                                               "predicted_peak_gib": gib, "memory_error": pct},
                         headers=["model", "precision", "batch", "measured peak GiB", "max_memory_allocated GiB",
                                  "predicted GiB", "error"])

    def verdict(name: str, goal: float) -> str:
        m = summary[name]
        if m is None:
            return "no rows"
        met = "met" if m["median"] <= goal else f"missed by {m['median'] - goal:.1%}"
        return f"median |error| {m['median']:.1%} (max {m['max']:.1%}), goal <= {goal:.0%}: {met}"

    (RESULTS / "gpu_step_time.md").write_text("\n".join([
        "# Single-GPU step time: predicted against measured", "",
        f"Written by `python benchmarks/gpu_accuracy.py report` from measurements taken by its `measure` phase "
        f"on {where}. Measured: the median of 3 rounds of the median of 5 training steps after a warm-up "
        "(the runtime, `runtime.train.time_strategies`, AdamW). Predicted: the simulator on the "
        f"`{dev['kind']}-1x1` preset, with the measured cost database (`simulator/costdbs/{dev['kind']}.jsonl`, "
        "analytical for the parts it lacks) and with the analytical model alone. fp32 is IEEE float32 (no "
        "TF32); bf16 is mixed precision (bfloat16 compute, float32 master weights). The GPU machine had "
        "torch 2.11 (soapflow pins 2.13): its capture of `nn.LSTM` gives the hidden state an extra axis, so "
        "the op parts were timed on graphs captured with 2.13 (`measure --graphs`), and the RNN LM's steps "
        "too.", "", step, "",
        f"- Cost database: {verdict('costdb_error', 0.10)}.",
        f"- Analytical: {verdict('analytical_error', 0.25)}.", "",
        "The last two columns come from a separate run (`measure --stages host`): how long the host takes "
        "to issue a step, from a synchronized start until `train_step` returns with the device still "
        "working, beside that run's whole step. In every row but the RNN LM's the two agree within a few "
        "percent: on an H100 the runtime's interpreter, not the GPU, sets the step's pace. The executor "
        "itself does not hold the host back: it issues the RNN LM's step, whose LSTM kernels are long, well "
        "before the device is done (a kernel that waits for the device in the other models is not ruled "
        "out; no profile was taken).", "",
        "Why the cost database misses: the step is the host's time to issue it, while a part's time in the "
        "database is the larger of its kernels' time and the host time of the timing loop, which is not the "
        "executor's. The executor spends more on the host per part (its bookkeeping, exchanges, parameter "
        "casts under bf16, the optimizer's per-tensor kernels), so the sum under-predicts the bf16 rows and "
        "the transformer; the timing loop spends more on small parts (its own autograd call per pass: view "
        "ops, which run no kernel, carry "
        f"{next((r['view_parts_ms'] for r in ok if r['model'] == 'hf_gpt2' and r['precision'] == 'fp32'), 0):.0f} "
        "ms in GPT-2), so it over-predicts ResNet-50 and GPT-2 in float32. Predicting a GPU step within "
        "10% needs the host as a resource of its own in the simulator (the executor's host time per part, "
        "measured on the GPU, as a dispatch stage ahead of each device task); it does not exist yet. The "
        "analytical model's launch cost (`gpu_kernels.md`) is a per-kernel average of the same host time, "
        "which is why its errors, though within its goal, go both ways alike.", "",
        *[f"- {r['model']} {r['precision']}: not measured ({r['failed']})" for r in rows if "failed" in r],
        ""]))
    kernels_md, kernels_json = kernels_report(measured, db_path)
    (RESULTS / "gpu_kernels.json").write_text(json.dumps(kernels_json, indent=1) + "\n")
    (RESULTS / "gpu_kernels.md").write_text(kernels_md.replace("{where}", where))
    (RESULTS / "gpu_runtime.md").write_text(runtime_report(measured).replace("{where}", where))
    (RESULTS / "gpu_memory.md").write_text("\n".join([
        "# Single-GPU peak memory: predicted against measured", "",
        f"Written by `python benchmarks/gpu_accuracy.py report`; measured on {where}. Measured peak: the tensors "
        "a rank holds at the start of a step (parameters, optimizer state, batch) plus the growth of "
        "`torch.cuda.max_memory_allocated` over one training step after two warm-up steps "
        "(`runtime.memory.measure_step`); `max_memory_allocated` over the whole run is shown beside it. "
        "Predicted: the simulator's peak memory of the device.", "", mem, "",
        f"- {verdict('memory_error', 0.10)}.", ""]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
