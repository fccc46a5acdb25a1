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
- soapflow fsdp vs torch FSDP2 (`fully_shard`) on the same three models as dp: target ratio <= 1.15.
- soapflow tp vs soapflow dp on the MLP at batch 64: reported.

Every variant runs the same optimizer (`runtime.train.make_optimizer` with one `TrainSetup`, the default:
SGD with momentum, single-tensor path; soapflow's gradient buckets are DDP's 25 MiB) on the same synthetic
batches; a step is forward, loss, backward (gradient synchronization included) and the
update, started after a barrier. The soapflow step is `runtime.train.train_step`, what `soapflow run`
times. The variants share the worker processes, so all run with the allocator setting of
`runtime.launch.keep_freed_memory`, as every rank of `soapflow run` does.

The fsdp pair: soapflow's `fsdp` baseline (`search.baselines.fsdp`, on cpu-2: every op with parameters
sample-split over both devices with `"shard": 2`) against `torch.distributed.fsdp.fully_shard` on a
DeviceMesh over "cpu", applied to every module holding parameters of its own (each Linear and conv) and
then to the root, each rank training on its half of the batch. How they differ: soapflow all-gathers an
op's parameter chunks before its forward and again before its backward, and reduce-scatters its
gradient right after, each synchronously, with no prefetch (docs/runtime.md, "How a step runs"); FSDP2
in backward prefetches the next layer (the one before in forward order) and on an accelerator runs its
all-gathers and reduce-scatters on side streams. On a CPU there are no streams and FSDP2's unshards are
not asynchronous (`unshard_async_op` is off by default), so its prefetch moves the next layer's
all-gather earlier but does not overlap it with compute: neither side overlaps communication with
computation here. FSDP2's parameters are DTensors, so its (single-tensor) optimizer step dispatches
through DTensor; soapflow's are plain tensors. Around the collectives soapflow copies more: per step
and per 4096x1024 Linear, `Executor._gather` (run twice) copies the gathered weight out twice (the
strided slice's reshape, then a clone) where FSDP2 copies it out once, and `Executor._scatter_grads`
zero-fills two gradient-sized buffers, copies the gradient twice and clones its reduced chunk where FSDP2
copies the gradient in once: 88 MiB more memory written per Linear and step.

Before timing, the warm-up steps of both fsdp variants are checked against single-process training of
the unsharded model on the same (whole) batches with the same optimizer: the parameters afterwards must
agree within the float32 tolerance `soapflow run --verify` uses (`runtime.train.compare`), else the
benchmark fails. Some torch versions sum FSDP2's gradients on gloo instead of averaging them (a doubled
update); the check would catch that. torch 2.13 averages them (`ReduceOp.AVG` on gloo), so no
correction is applied.

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
    VERIFY_TOLERANCES,
    _gather_params,
    compare,
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

    def full_params(self) -> dict[str, torch.Tensor] | None:
        """The whole parameters on rank 0 (None elsewhere), joined from every rank's shards, as
        `soapflow run --verify` joins them (collective)."""
        gathered = _gather_params(self.executor, self.executor.plan, self.executor.rank)
        return None if gathered is None else gathered[0]


class _SampleSplit:
    """A torch variant where every rank trains on its block of the batch."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    rank: int
    world: int

    def step(self, batch: list[torch.Tensor], step: int) -> None:
        x, y = (t.chunk(self.world)[self.rank] for t in batch)
        self.loss_fn(self.model(x), y).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class DDP(_SampleSplit):
    def __init__(self, rank: int, world: int, model: str, batch: int, setup: TrainSetup):
        module, self.example, self.loss_fn = build(model, batch)
        self.model = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=setup.bucket_mb)
        self.optimizer = make_optimizer(list(self.model.parameters()), setup)
        self.rank, self.world = rank, world


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


class FSDP2(_SampleSplit):
    """torch FSDP2: `fully_shard` on every module holding parameters of its own (each Linear and conv),
    then on the root, over a DeviceMesh on "cpu"; every rank trains on its half of the batch."""

    def __init__(self, rank: int, world: int, model: str, batch: int, setup: TrainSetup):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        module, self.example, self.loss_fn = build(model, batch)
        mesh = init_device_mesh("cpu", (world,))
        for sub in list(module.modules()):
            if sub is not module and any(True for _ in sub.parameters(recurse=False)):
                fully_shard(sub, mesh=mesh)
        self.model = fully_shard(module, mesh=mesh)
        self.optimizer = make_optimizer(list(self.model.parameters()), setup)
        self.rank, self.world = rank, world

    def full_params(self) -> dict[str, torch.Tensor] | None:
        """The whole parameters on rank 0 (None elsewhere) (collective)."""
        full = {name: p.full_tensor().detach().clone() for name, p in self.model.named_parameters()}
        return full if self.rank == 0 else None


def reference_params(model: str, batch: int, setup: TrainSetup, batches: list[list[torch.Tensor]]
                     ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Single-process training of the unsharded model on the whole `batches`, one step each: the
    parameters after it and before it."""
    module, _, loss_fn = build(model, batch)
    initial = {name: p.detach().clone() for name, p in module.named_parameters()}
    optimizer = make_optimizer(list(module.parameters()), setup)
    for x, y in batches:
        loss_fn(module(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {name: p.detach().clone() for name, p in module.named_parameters()}, initial


def check_against_reference(name: str, runner: Soapflow | FSDP2, variant: dict, setup: TrainSetup,
                            batches: list[list[torch.Tensor]]) -> dict[str, Any] | None:
    """`runner`'s parameters after training on `batches` against single-process training (on rank 0; the
    gather is collective). Raises when they differ by more than `runtime.train.compare`'s float32
    tolerance; returns the comparison on rank 0."""
    full = runner.full_params()
    if full is None:
        return None
    ref, initial = reference_params(variant["model"], variant["batch"], setup, batches)
    result = compare([], full, [], ref, initial, dtype="float32")
    if not result["passed"]:
        # A summed instead of averaged gradient shows as an update twice the reference's.
        update = {n: float((full[n] - initial[n]).norm() / (ref[n] - initial[n]).norm()) for n in ref}
        raise RuntimeError(f"{name}: parameters after {len(batches)} step(s) differ from single-process "
                           f"training: relative difference {result['max_param_rel_diff']:.3g} (tolerance "
                           f"{VERIFY_TOLERANCES['float32']['rtol']:g}); update norm / reference's: "
                           + ", ".join(f"{n} {u:.3f}" for n, u in update.items()))
    return {"steps": len(batches), "max_param_rel_diff": result["max_param_rel_diff"]}


def bench_rank(rank: int, world: int, *, variants: list[dict], setup: TrainSetup, rounds: int, steps: int,
               warmup: int) -> dict[str, Any]:
    """Every variant's step times (ms, the slower rank's), interleaved step by step: step k of every
    variant runs back to back (in alternating order), so paired samples see the same machine load. Every
    variant trains with `setup`. The variants marked `check` are checked against single-process training
    after their warm-up steps (`check_against_reference`); rank 0 returns what the checks found."""
    runners = {}
    for v in variants:
        if v["kind"] == "soapflow":
            runners[v["name"]] = Soapflow(rank, world, v["model"], v["batch"], setup, v["graph"], v["strategy"])
        elif v["kind"] == "ddp":
            runners[v["name"]] = DDP(rank, world, v["model"], v["batch"], setup)
        elif v["kind"] == "fsdp2":
            runners[v["name"]] = FSDP2(rank, world, v["model"], v["batch"], setup)
        else:
            runners[v["name"]] = DTensorTP(rank, world, v["model"], v["batch"], setup)
    names = [v["name"] for v in variants]
    batches = {n: [synthetic_batch(runners[n].example, step=s, seed=0, highs={1: 10}) for s in range(steps)]
               for n in names}
    checks = {}
    for v in variants:
        n = v["name"]
        for s in range(warmup):
            runners[n].step(batches[n][s % steps], s)
        if v.get("check"):
            checks[n] = check_against_reference(n, runners[n], v, setup,
                                                [batches[n][s % steps] for s in range(warmup)])
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
    return {"step_ms": {n: times[i].tolist() for i, n in enumerate(names)}, "checks": checks}


# ---------------------------------------------------------------------- driver


def soapflow_variant(name: str, model: str, batch: int, baseline: str, *, check: bool = False) -> dict:
    module, (x, y), loss_fn = build(model, batch)
    graph = capture(module, (x,), y, loss_fn, name=model, batch_size=batch)
    strategy = BASELINES[baseline](graph, load_topology("cpu-2"))
    return {"name": name, "kind": "soapflow", "model": model, "batch": batch, "graph": graph.to_dict(),
            "strategy": {op: cfg.to_dict() for op, cfg in strategy.items()}, "check": check}


COMPARISONS = [
    # (label, numerator, denominator, target)
    ("soapflow dp / DDP, MLP batch 64", "sf-dp-mlp64", "ddp-mlp64", 1.10),
    ("soapflow dp / DDP, MLP batch 512", "sf-dp-mlp512", "ddp-mlp512", 1.10),
    ("soapflow dp / DDP, small CNN batch 64", "sf-dp-cnn64", "ddp-cnn64", 1.10),
    ("soapflow tp / DTensor TP, MLP batch 64", "sf-tp-mlp64", "dt-tp-mlp64", 1.0),
    ("soapflow tp / DTensor TP, MLP batch 512", "sf-tp-mlp512", "dt-tp-mlp512", 1.0),
    ("soapflow fsdp / FSDP2, MLP batch 64", "sf-fsdp-mlp64", "fsdp2-mlp64", 1.15),
    ("soapflow fsdp / FSDP2, MLP batch 512", "sf-fsdp-mlp512", "fsdp2-mlp512", 1.15),
    ("soapflow fsdp / FSDP2, small CNN batch 64", "sf-fsdp-cnn64", "fsdp2-cnn64", 1.15),
    ("soapflow tp / soapflow dp, MLP batch 64", "sf-tp-mlp64", "sf-dp-mlp64", None),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps per variant; the fsdp pair is checked against single-process "
                             "training after them")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: the fsdp pair is checked after the warm-up steps")
    variants = []
    for batch in (64, 512):
        variants += [soapflow_variant(f"sf-dp-mlp{batch}", "mlp", batch, "dp"),
                     {"name": f"ddp-mlp{batch}", "kind": "ddp", "model": "mlp", "batch": batch},
                     soapflow_variant(f"sf-tp-mlp{batch}", "mlp", batch, "tp"),
                     {"name": f"dt-tp-mlp{batch}", "kind": "dtensor", "model": "mlp", "batch": batch},
                     soapflow_variant(f"sf-fsdp-mlp{batch}", "mlp", batch, "fsdp", check=True),
                     {"name": f"fsdp2-mlp{batch}", "kind": "fsdp2", "model": "mlp", "batch": batch, "check": True}]
    variants += [soapflow_variant("sf-dp-cnn64", "cnn", 64, "dp"),
                 {"name": "ddp-cnn64", "kind": "ddp", "model": "cnn", "batch": 64},
                 soapflow_variant("sf-fsdp-cnn64", "cnn", 64, "fsdp", check=True),
                 {"name": "fsdp2-cnn64", "kind": "fsdp2", "model": "cnn", "batch": 64, "check": True}]
    train = TrainSetup()
    start = time.perf_counter()
    out = launch(bench_rank, 2, kwargs={"variants": variants, "setup": train, "rounds": args.rounds,
                                          "steps": args.steps, "warmup": args.warmup},
                 timeout_s=300, num_threads=1)[0]
    elapsed = time.perf_counter() - start
    samples, checks = out["step_ms"], out["checks"]
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
    checked = "; ".join(f"{n} {c['max_param_rel_diff']:.1e}" for n, c in checks.items())
    tol = VERIFY_TOLERANCES["float32"]
    check_line = (f"Checked against single-process training after {args.warmup} step(s): largest parameter "
                  f"difference, over max(update, {tol['atol'] / tol['rtol']:g}) (`runtime.train.compare`, "
                  f"tolerance {tol['rtol']:g}): {checked}.")
    print(table)
    print(check_line)
    print(f"({args.rounds * args.steps} paired steps per variant, 2 processes x 1 thread, gloo; {elapsed:.0f} s)")
    if args.no_write:
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    setup = {"processes": 2, "threads_per_process": 1, "backend": "gloo", "rounds": args.rounds,
             "steps_per_round": args.steps, "warmup_steps": args.warmup, "train_setup": train.to_dict(),
             "torch": torch.__version__,
             "python": platform.python_version(), "machine": platform.machine()}
    (RESULTS / "runtime_overhead.json").write_text(json.dumps(
        {"setup": setup, "comparisons": rows, "checks": checks, "step_ms": samples}, indent=2) + "\n")
    (RESULTS / "runtime_overhead.md").write_text(
        "# Runtime overhead: soapflow vs DDP, DTensor tensor parallelism and FSDP2\n\n"
        "Written by `python benchmarks/runtime_overhead.py`. Ratios of paired step times (the slower rank's; "
        f"step k of every variant runs back to back, {args.rounds * args.steps} pairs after warm-up): median "
        "and quartiles; `fast ratio` is the ratio of the two variants' 25th-percentile step times (their "
        "fastest quarter, the least disturbed by other load on the machine); `met` judges the median ratio. "
        f"2 processes x 1 thread on gloo, {train.optimizer} (momentum {train.momentum}), float32, "
        f"{train.bucket_mb:g} MiB gradient buckets; MLP 1024-4096-1024 (mse), small CNN "
        "(2 convs + linear, 32x32, cross-entropy). Below 1 soapflow is faster. All variants share the worker "
        "processes, which run with `runtime.launch.keep_freed_memory` (freed memory stays mapped), as every "
        "rank of `soapflow run` does. fsdp: soapflow's `fsdp` baseline against `fully_shard` per Linear/conv "
        "plus the root (the module docstring says how they differ).\n\n"
        f"```\n{table}\n```\n\n{check_line}\n\nSetup: torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}.\n")


if __name__ == "__main__":
    main()
