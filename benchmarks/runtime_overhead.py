"""Runtime overhead: soapflow's SPMD interpreter against torch's own distributed training, side by side.

Two processes on gloo, one thread each, all variants in one launch and interleaved round by round, so
that load from elsewhere on the machine hits every variant alike: step k of every variant runs back to
back, and each comparison is the median (and quartiles) of the ratios of paired step times, plus the
ratio of the two variants' 25th-percentile step times (ratios, never single absolute times, carry the
result).

- soapflow dp vs `DistributedDataParallel`: MLP 1024-4096-1024 at batch 64 and 512, and a small CNN;
  target ratio <= 1.10.
- soapflow tp vs DTensor `ColwiseParallel` / `RowwiseParallel` (Megatron MLP) on the same MLP: target
  ratio <= 1.0.
- soapflow tp vs soapflow dp on the MLP at batch 64: reported.

Every variant runs the same optimizer (`runtime.train.make_optimizer` with one `TrainSetup`, the default:
SGD with momentum, single-tensor path; soapflow's gradient buckets are DDP's 25 MiB) on the same synthetic
batches; a step is forward, loss, backward (gradient synchronization included) and the
update, started after a barrier. The soapflow step is `runtime.train.train_step`, what `soapflow run`
times. The variants share the worker processes, so all run with the allocator setting of
`runtime.launch.keep_freed_memory`, as every rank of `soapflow run` does.
Writes benchmarks/results/runtime_overhead.md and .json.

    python benchmarks/runtime_overhead.py [--rounds 12] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime.executor import Executor  # noqa: E402
from runtime.launch import launch  # noqa: E402
from runtime.train import (  # noqa: E402
    make_optimizer,
    named_tensors,
    strategy_from_configs,
    synthetic_batch,
    train_step,
)
from search.baselines import BASELINES  # noqa: E402
from soap.capture import capture  # noqa: E402
from soap.graph import OperatorGraph  # noqa: E402
from soap.lowering import lower  # noqa: E402
from soap.setup import TrainSetup  # noqa: E402
from soap.topology import load_topology  # noqa: E402
from soapflow.zoo.mlp import MLP  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SIZES = (1024, 4096, 1024)


class SmallCNN(nn.Module):
    """conv(3->32) - relu - conv(32->64) - relu - maxpool 2 - flatten - linear(64*16*16 -> 10), on 32x32."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.relu2 = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(64 * 16 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.relu2(self.conv2(self.relu1(self.conv1(x))))), 1))


def build(model: str, batch: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], Any]:
    torch.manual_seed(0)
    if model == "mlp":
        return (MLP(SIZES), (torch.empty(batch, SIZES[0], device="meta"), torch.empty(batch, SIZES[-1], device="meta")),
                nn.functional.mse_loss)
    return (SmallCNN(), (torch.empty(batch, 3, 32, 32, device="meta"), torch.empty(batch, dtype=torch.long,
                                                                                   device="meta")),
            nn.functional.cross_entropy)


# ---------------------------------------------------------------------- variants (in the worker)


class Soapflow:
    def __init__(self, rank: int, world: int, model: str, batch: int, setup: TrainSetup, graph: dict,
                 strategy: dict):
        g = OperatorGraph.from_dict(graph)
        module, example, _ = build(model, batch)
        self.example = example
        plan = lower(g, strategy_from_configs(strategy), setup, world)
        self.executor = Executor(g, plan, rank=rank, tensors=named_tensors(module), module=module)
        self.optimizer = make_optimizer(self.executor.parameters(), setup)

    def step(self, batch: list[torch.Tensor], step: int) -> None:
        train_step(self.executor, self.optimizer, batch, step=step)


class DDP:
    def __init__(self, rank: int, world: int, model: str, batch: int, setup: TrainSetup):
        module, self.example, self.loss_fn = build(model, batch)
        self.model = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=setup.bucket_mb)
        self.optimizer = make_optimizer(list(self.model.parameters()), setup)
        self.rank, self.world = rank, world

    def step(self, batch: list[torch.Tensor], step: int) -> None:
        x, y = (t.chunk(self.world)[self.rank] for t in batch)
        self.loss_fn(self.model(x), y).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class DTensorTP:
    """Megatron MLP with DTensor: the first linear column-parallel, the second row-parallel; every rank
    reads the whole batch (the layout DTensor's tensor parallelism expects)."""

    def __init__(self, rank: int, world: int, model: str, batch: int, setup: TrainSetup):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        module, self.example, self.loss_fn = build(model, batch)
        mesh = init_device_mesh("cpu", (world,))
        self.model = parallelize_module(module, mesh, {"layers.0": ColwiseParallel(), "layers.2": RowwiseParallel()})
        self.optimizer = make_optimizer(list(self.model.parameters()), setup)

    def step(self, batch: list[torch.Tensor], step: int) -> None:
        x, y = batch
        self.loss_fn(self.model(x), y).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def bench_rank(rank: int, world: int, *, variants: list[dict], setup: TrainSetup, rounds: int, steps: int,
               warmup: int) -> dict[str, list[float]]:
    """Every variant's step times (ms, the slower rank's), interleaved step by step: step k of every
    variant runs back to back (in alternating order), so paired samples see the same machine load. Every
    variant trains with `setup`."""
    runners = {}
    for v in variants:
        if v["kind"] == "soapflow":
            runners[v["name"]] = Soapflow(rank, world, v["model"], v["batch"], setup, v["graph"], v["strategy"])
        elif v["kind"] == "ddp":
            runners[v["name"]] = DDP(rank, world, v["model"], v["batch"], setup)
        else:
            runners[v["name"]] = DTensorTP(rank, world, v["model"], v["batch"], setup)
    names = [v["name"] for v in variants]
    batches = {n: [synthetic_batch(runners[n].example, step=s, seed=0, highs={1: 10}) for s in range(steps)]
               for n in names}
    for n in names:
        for s in range(warmup):
            runners[n].step(batches[n][s % steps], s)
    times = torch.zeros(len(names), rounds * steps, dtype=torch.float64)
    for k in range(rounds * steps):
        order = range(len(names)) if k % 2 == 0 else reversed(range(len(names)))
        for i in order:
            dist.barrier()
            start = time.perf_counter()
            runners[names[i]].step(batches[names[i]][k % steps], k)
            times[i, k] = (time.perf_counter() - start) * 1e3
    # A step ends at different moments on the two ranks; the slower rank sets the pace.
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {n: times[i].tolist() for i, n in enumerate(names)}


# ---------------------------------------------------------------------- driver


def soapflow_variant(name: str, model: str, batch: int, baseline: str) -> dict:
    module, (x, y), loss_fn = build(model, batch)
    graph = capture(module, (x,), y, loss_fn, name=model, batch_size=batch)
    strategy = BASELINES[baseline](graph, load_topology("cpu-2"))
    return {"name": name, "kind": "soapflow", "model": model, "batch": batch, "graph": graph.to_dict(),
            "strategy": {op: cfg.to_dict() for op, cfg in strategy.items()}}


COMPARISONS = [
    # (label, numerator, denominator, target)
    ("soapflow dp / DDP, MLP batch 64", "sf-dp-mlp64", "ddp-mlp64", 1.10),
    ("soapflow dp / DDP, MLP batch 512", "sf-dp-mlp512", "ddp-mlp512", 1.10),
    ("soapflow dp / DDP, small CNN batch 64", "sf-dp-cnn64", "ddp-cnn64", 1.10),
    ("soapflow tp / DTensor TP, MLP batch 64", "sf-tp-mlp64", "dt-tp-mlp64", 1.0),
    ("soapflow tp / DTensor TP, MLP batch 512", "sf-tp-mlp512", "dt-tp-mlp512", 1.0),
    ("soapflow tp / soapflow dp, MLP batch 64", "sf-tp-mlp64", "sf-dp-mlp64", None),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    variants = []
    for batch in (64, 512):
        variants += [soapflow_variant(f"sf-dp-mlp{batch}", "mlp", batch, "dp"),
                     {"name": f"ddp-mlp{batch}", "kind": "ddp", "model": "mlp", "batch": batch},
                     soapflow_variant(f"sf-tp-mlp{batch}", "mlp", batch, "tp"),
                     {"name": f"dt-tp-mlp{batch}", "kind": "dtensor", "model": "mlp", "batch": batch}]
    variants += [soapflow_variant("sf-dp-cnn64", "cnn", 64, "dp"),
                 {"name": "ddp-cnn64", "kind": "ddp", "model": "cnn", "batch": 64}]
    train = TrainSetup()
    start = time.perf_counter()
    samples = launch(bench_rank, 2, kwargs={"variants": variants, "setup": train, "rounds": args.rounds,
                                              "steps": args.steps, "warmup": args.warmup},
                       timeout_s=300, num_threads=1)[0]
    elapsed = time.perf_counter() - start
    rows = []
    for label, num, den, target in COMPARISONS:
        ratios = sorted(a / b for a, b in zip(samples[num], samples[den], strict=True))
        ratio = statistics.median(ratios)
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        # The fastest quarter of each variant's steps: what it does when the machine leaves it alone.
        fast = statistics.quantiles(samples[num], n=4)[0] / statistics.quantiles(samples[den], n=4)[0]
        rows.append({"comparison": label, "ratio": ratio, "q1_ratio": q1, "q3_ratio": q3, "fast_ratio": fast,
                     "median_ms": [statistics.median(samples[num]), statistics.median(samples[den])],
                     "target": target, "met": None if target is None else ratio <= target})
    header = f"{'comparison':<42} {'median ratio':>12} {'quartiles':>15} {'fast ratio':>10} {'target':>7} {'met':>4}"
    lines = [header, "-" * len(header)]
    for r in rows:
        target = "-" if r["target"] is None else f"<={r['target']:.2f}"
        met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        lines.append(f"{r['comparison']:<42} {r['ratio']:>12.3f} {r['q1_ratio']:>7.3f}-{r['q3_ratio']:<7.3f} "
                     f"{r['fast_ratio']:>10.3f} {target:>7} {met:>4}")
    table = "\n".join(lines)
    print(table)
    print(f"({args.rounds * args.steps} paired steps per variant, 2 processes x 1 thread, gloo; {elapsed:.0f} s)")
    if args.no_write:
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    setup = {"processes": 2, "threads_per_process": 1, "backend": "gloo", "rounds": args.rounds,
             "steps_per_round": args.steps, "warmup_steps": args.warmup, "train_setup": train.to_dict(),
             "torch": torch.__version__,
             "python": platform.python_version(), "machine": platform.machine()}
    (RESULTS / "runtime_overhead.json").write_text(json.dumps(
        {"setup": setup, "comparisons": rows, "step_ms": samples}, indent=2) + "\n")
    (RESULTS / "runtime_overhead.md").write_text(
        "# Runtime overhead: soapflow vs DDP and DTensor tensor parallelism\n\n"
        "Written by `python benchmarks/runtime_overhead.py`. Ratios of paired step times (the slower rank's; "
        f"step k of every variant runs back to back, {args.rounds * args.steps} pairs after warm-up): median "
        "and quartiles; `fast ratio` is the ratio of the two variants' 25th-percentile step times (their "
        "fastest quarter, the least disturbed by other load on the machine); `met` judges the median ratio. "
        f"2 processes x 1 thread on gloo, {train.optimizer} (momentum {train.momentum}), float32, "
        f"{train.bucket_mb:g} MiB gradient buckets; MLP 1024-4096-1024 (mse), small CNN "
        "(2 convs + linear, 32x32, cross-entropy). Below 1 soapflow is faster. All variants share the worker "
        "processes, which run with `runtime.launch.keep_freed_memory` (freed memory stays mapped), as every "
        "rank of `soapflow run` does.\n\n"
        f"```\n{table}\n```\n\nSetup: torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}.\n")


if __name__ == "__main__":
    main()
