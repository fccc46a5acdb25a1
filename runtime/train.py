"""The training loop of one rank, synthetic batches, optimizers, and verification against one process.

Owns `Workload` (what a model builder returns to the runtime), `TrainOptions`, `build_executor` (a rank's
plan, executor and optimizer on its device), `train_rank` (the function every rank runs: build, shard,
optionally resume from a checkpoint, train K steps, time them, save checkpoints, optionally gather and
verify), `train_step` (one step, what is timed), `device_clock`, `synthetic_batch`, `integer_highs`,
`reference_train` and `compare`. Imports `soap`, torch and the other `runtime` modules
only (no simulator, no search, no soapflow: the caller passes a picklable `build` function instead).

Checkpoints (`runtime.checkpoint`, through torch.distributed.checkpoint): every rank saves the pieces it
holds (parameters, buffers, the optimizer state shaped like them) as boxes of the full tensors, and on
resume loads straight into the executor's pieces and a pre-created optimizer state whatever strategy and
process count wrote them; no rank gathers or holds a full tensor.

Synthetic data: step `s` draws every example tensor from a generator seeded by (seed, s, position), the
same on every rank and in the reference. Floating tensors are standard normal (drawn in float32, then
cast to the run's dtype); integer tensors are uniform in [0, high) where `high` comes from the graph: the
rows of the embedding tables the input feeds and the class count of the cross-entropy losses it is the
target of (following reshape, transpose and slice ops), the smallest if several; without such a consumer,
the smallest `nn.Embedding` of the model, else 2. Boolean tensors are fair coin flips.

Verification: the reference trains `build()`'s module in one process with `torch.optim` on the same
batches, optimizer and learning rate; `compare` checks the losses, the gradients of the first step whose
update is applied (`FirstGradients`, allowing their measured rounding error) and the final parameters
(under AdamW in float64 only: `VERIFY_TOLERANCES`). BatchNorm under a sample split normalizes each part with its own
batch statistics, as DDP does (docs/architecture.md, "The runtime"); the reference reproduces that by
running such a BatchNorm module on the same sample chunks (its input split along the batch into the op's sample degree,
each chunk normalized alone, the results concatenated). With the chunks of DDP (one per rank) this is
exactly DDP's computation, which the tests check against `DistributedDataParallel` itself.
"""

from __future__ import annotations

import copy
import math
import os
import signal
import statistics
import time
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from runtime.checkpoint import (
    CheckpointInfo,
    boxes_of,
    buffer_key,
    check_resumable,
    load_checkpoint,
    optimizer_key,
    param_key,
    read_info,
    save_checkpoint,
    saved_tensors,
)
from runtime.executor import TORCH_DTYPES, ExecutionError, Executor, as_slices, pieces_needed
from runtime.kernels import dropped, normal_draws, uniform_draws
from runtime.launch import rank_device
from runtime.materialize import MaterializeError, install_buffers, record, replay
from soap.capture.attention import captured_attention
from soap.capture.experts import experts_as_one_call
from soap.capture.recurrent import layered_recurrences
from soap.config import ParallelConfig
from soap.graph import OperatorGraph
from soap.lowering import StepPlan, lower
from soap.setup import TrainSetup
from soap.strategy import Strategy

FAULTS = ("raise", "kill")
# Ops that move elements without changing what they mean: an integer input keeps its range through them.
_SHAPE_OPS = frozenset({"reshape", "transpose", "slice", "split", "concat"})


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A model as the runtime needs it: the module (real weights), the example batch (`inputs` then
    `target`; shapes and dtypes only, meta tensors are fine) and the loss `loss_fn(output, target)`."""

    module: nn.Module
    inputs: tuple[torch.Tensor, ...]
    target: torch.Tensor
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]

    @property
    def example(self) -> tuple[torch.Tensor, ...]:
        return (*self.inputs, self.target)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainOptions:
    """How to run: `steps` optimizer steps of the training `setup` (optimizer, learning rate, buckets:
    what the step plan depends on, shared with the simulator).

    `dtype` is the dtype floating tensors compute in (float64 makes verification tight); `verify` gathers
    the parameters on rank 0 and compares losses and parameters with single-process training.
    `checkpoint_dir` receives a checkpoint every `checkpoint_every` steps (0: only after the last step);
    `resume_from` is a checkpoint directory to continue from (its step count is the first step run).
    `device` is where every rank computes: "cpu", or "cuda" for one GPU per local rank
    (`runtime.launch.rank_device`; the backend is then nccl).
    `fault` = (kind, rank, step) is a test hook: at the start of that step that rank raises inside its first
    op's forward (`"raise"`) or SIGKILLs itself (`"kill"`).
    """

    steps: int = 3
    setup: TrainSetup = TrainSetup()
    seed: int = 0
    dtype: str = "float32"
    verify: bool = False
    timeout_s: float = 60.0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume_from: str | None = None
    fault: tuple[str, int, int] | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be non-negative, got {self.checkpoint_every}")
        if self.fault is not None and self.fault[0] not in FAULTS:
            raise ValueError(f"unknown fault {self.fault[0]!r}; known: {', '.join(FAULTS)}")
        if self.steps < 1:
            raise ValueError(f"steps must be positive, got {self.steps}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype!r}")


def make_optimizer(params: Sequence[torch.Tensor], setup: TrainSetup) -> torch.optim.Optimizer:
    """The setup's optimizer over `params`."""
    # foreach=False on both sides: the single-tensor code path, so sharded and reference updates are
    # the same elementwise arithmetic.
    if setup.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=setup.lr, weight_decay=setup.weight_decay, foreach=False)
    return torch.optim.SGD(params, lr=setup.lr, momentum=setup.momentum, weight_decay=setup.weight_decay,
                           foreach=False)


# ---------------------------------------------------------------------- synthetic data


def integer_highs(graph: OperatorGraph, module: nn.Module | None = None) -> dict[int, int]:
    """Exclusive upper bound of the values of each integer input, by example-batch position."""
    out: dict[int, int] = {}
    for op in graph:
        if op.kind != "input" or op.outputs[0].dtype not in ("int64", "int32", "int16", "int8", "uint8"):
            continue
        bounds: list[int] = []
        frontier = [op.name]
        while frontier:
            name = frontier.pop()
            for consumer, slot, _ in graph.consumers(name):
                c = graph[consumer]
                if c.kind in _SHAPE_OPS:
                    frontier.append(consumer)
                elif c.kind == "embedding" and slot == 0:
                    bounds.append(c.params["weight"].shape[0])
                elif c.kind == "loss" and slot == 1 and c.attrs.get("fn") == "cross_entropy":
                    bounds.append(graph.tensor(c.inputs[0]).shape[1])
        if not bounds and module is not None:
            bounds = [m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)]
        out[int(op.attrs["position"])] = min(bounds) if bounds else 2
    return out


def synthetic_batch(example: Sequence[torch.Tensor], *, step: int, seed: int, highs: Mapping[int, int],
                    dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> list[torch.Tensor]:
    """The full global batch of `step`: one real tensor per example tensor (same shape and dtype), drawn
    on the CPU (the same values everywhere) and placed on `device` when given."""
    out = []
    for position, t in enumerate(example):
        g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + position)
        shape = tuple(t.shape)
        if t.dtype.is_floating_point:
            out.append(torch.randn(shape, generator=g).to(dtype if t.dtype == torch.float32 else t.dtype))
        elif t.dtype == torch.bool:
            out.append(torch.randint(0, 2, shape, generator=g).bool())
        else:
            out.append(torch.randint(0, highs.get(position, 2), shape, generator=g, dtype=t.dtype))
    return out if device is None else [t.to(device) for t in out]


def device_clock(device: torch.device) -> Callable[[], float]:
    """A clock for timing steps on `device` (seconds): on a GPU it first waits for the kernels queued so
    far, so that a step's time is its kernels' and not their launch's."""
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return clock


# ---------------------------------------------------------------------- distributed training


def strategy_from_configs(configs: Mapping[str, Mapping[str, Any]]) -> Strategy:
    """A Strategy from `{op: {"degrees": {...}, "devices": [...], ...}}` (the strategy file's `ops`)."""
    return Strategy({name: ParallelConfig.from_dict(c) for name, c in configs.items()})


def named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by fully qualified name, shared ones under each of their names."""
    out = {name: p.detach() for name, p in module.named_parameters(remove_duplicate=False)}
    out.update({name: b.detach() for name, b in module.named_buffers(remove_duplicate=False)})
    return out


def merge_chunks(items: Sequence[tuple]) -> list[tuple]:
    """`items` (fqn, region, tensor, chunk, *rest) from every rank with the chunks of each sharded region
    joined into the region's tensor: (fqn, region, tensor, *rest) per region and replica of it. The
    `rest` of a merged region (optimizer state) is merged alike where its tensors are chunk-shaped."""
    out, parts = [], {}
    for fqn, region, t, chunk, *rest in items:
        if chunk is None:
            out.append((fqn, region, t, *rest))
        else:
            parts.setdefault((fqn, region, chunk[1]), {}).setdefault(chunk[0], []).append((t, rest))
    for (fqn, region, size), by_index in parts.items():
        shape = tuple(hi - lo for lo, hi in region)
        numel = math.prod(shape)

        def join(pieces: list[torch.Tensor], numel: int = numel, shape: tuple[int, ...] = shape) -> torch.Tensor:
            return torch.cat([p.reshape(-1) for p in pieces])[:numel].reshape(shape)

        for r in range(min(len(v) for v in by_index.values())):  # one region per replica of its chunks
            chunks = [by_index[j][r] for j in range(size)]
            rest = []
            for k, first in enumerate(chunks[0][1]):
                if isinstance(first, dict):
                    rest.append({key: join([c[1][k][key] for c in chunks])
                                 if isinstance(v, torch.Tensor) and v.shape == chunks[0][0].shape and v.dim() else v
                                 for key, v in first.items()})
                else:
                    rest.append(first)
            out.append((fqn, region, join([c[0] for c in chunks]), *rest))
    return out


def _gather_params(executor: Executor, plan: StepPlan, rank: int, items: list | None = None
                   ) -> tuple[dict[str, torch.Tensor], float] | None:
    """Full parameters on rank 0 from every rank's shards (or from `items`, shaped as
    `Executor.shard_items`: their gradients, say), and the largest difference between replicas."""
    if items is None:
        items = [(fqn, region, t.detach().to("cpu", copy=True), chunk)
                 for fqn, region, t, chunk in executor.shard_items()]
    gathered: list[Any] = [None] * plan.num_devices if rank == 0 else None
    if plan.num_devices > 1:
        dist.gather_object(items, gathered, dst=0)
    else:
        gathered = [items]
    if rank != 0:
        return None
    full: dict[str, torch.Tensor] = {}
    seen: dict[tuple[str, Any], torch.Tensor] = {}
    replica_diff = 0.0
    merged = merge_chunks([item for rank_items in gathered for item in rank_items])
    for fqn, region, t in merged:
        if (fqn, region) in seen:
            replica_diff = max(replica_diff, float((seen[(fqn, region)] - t).abs().max()))
            continue
        seen[(fqn, region)] = t
        if fqn not in full:
            full[fqn] = torch.full(executor.param_shapes[fqn], float("nan"), dtype=t.dtype)
        full[fqn][as_slices(region)] = t
    return full, replica_diff


class LossScaler:
    """Dynamic loss scaling, for fp16 (the rule of torch.amp.GradScaler): backward runs on the loss times
    `scale`; a step whose gradients hold an inf or NaN on any rank is skipped and halves the scale, and
    `growth_interval` good steps in a row double it; otherwise the gradients are divided by the scale
    before the update. With `across_ranks`, every rank must call `unscale` each step (the found flag is
    all-reduced, so that all ranks skip together)."""

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 2000, *, across_ranks: bool = True) -> None:
        self.scale = scale
        self.across_ranks = across_ranks
        self.growth_interval = growth_interval
        self._good = 0
        self.skipped: list[int] = []  # the calls (from 0) that skipped their step
        self._calls = 0

    def state(self) -> dict[str, float]:
        """What a checkpoint keeps of the scaler (`load_state`): the scale and the good steps in a row."""
        return {"scale": self.scale, "good": self._good}

    def load_state(self, state: Mapping[str, float]) -> None:
        self.scale, self._good = float(state["scale"]), int(state["good"])

    def unscale(self, params: Sequence[torch.Tensor]) -> bool:
        """Divide the gradients of `params` by the scale and return True, or return False (the step is to
        be skipped; the gradients are divided all the same) when any rank found a non-finite gradient;
        updates the scale. The check and the division are one pass that reads and writes each gradient
        (torch.amp.GradScaler's fused kernel): the update's passes count it (`TrainSetup.update_passes`)."""
        grads = [p.grad for p in params if p.grad is not None]
        device = grads[0].device if grads else None
        bad = torch.zeros(1, device=device)
        if grads:
            inv_scale = torch.full((1,), 1.0 / self.scale, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, bad, inv_scale)
        if self.across_ranks and dist.is_available() and dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        self._calls += 1
        if bad.item():
            self.scale /= 2.0
            self._good = 0
            self.skipped.append(self._calls - 1)
            return False
        self._good += 1
        if self._good == self.growth_interval:
            self.scale *= 2.0
            self._good = 0
        return True


def loss_scaler(setup: TrainSetup, *, across_ranks: bool = True) -> LossScaler | None:
    """The setup's loss scaler: one under fp16, none otherwise."""
    return LossScaler(across_ranks=across_ranks) if setup.loss_scaling else None


def _gradient_copies(executor: Executor) -> list[tuple[str, Any, Any, tuple[int, int] | None]]:
    """A copy of this rank's gradients, shaped as `Executor.shard_items` (trainable shards only; zeros
    where a shard has none) but as numpy arrays: verification's copy, kept outside torch's tensors so that
    the training's memory (`runtime.memory`) does not count it."""
    return [(fqn, region, (t.grad if t.grad is not None else torch.zeros_like(t)).detach().to("cpu").numpy().copy(),
             chunk) for fqn, region, t, chunk in executor.shard_items() if t.requires_grad]


def train_step(executor: Executor, optimizer: torch.optim.Optimizer | None, batch: Sequence[torch.Tensor], *,
               step: int, fail: bool = False, scaler: LossScaler | None = None,
               keep_grads: bool = False) -> torch.Tensor:
    """One training step (forward, backward with gradient synchronization, optimizer update; under fp16,
    `scaler`'s loss scaling) on the full global `batch`; returns this rank's share of the loss. Errors
    become `ExecutionError` naming the op. With `keep_grads` the gradients stay (unscaled; the optimizer
    only reads them) for the caller to read and then clear (`Executor.zero_grad`) before the next step."""
    try:
        local = executor.run_step(batch, step=step, fail=fail, loss_scale=scaler.scale if scaler is not None else 1.0)
        executor.where = "optimizer step"
        if scaler is None or scaler.unscale(executor.parameters()):
            if optimizer is not None:
                optimizer.step()
        if not keep_grads:
            executor.zero_grad()
    except Exception as exc:
        raise ExecutionError(f"step {step}, {executor.where}: {type(exc).__name__}: {exc}") from exc
    return local


def _checkpoint_state(executor: Executor, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """This rank's part of a checkpoint (`runtime.checkpoint`), views of its own tensors: its parameter
    pieces, the optimizer state shaped like them (as `Boxes`) and the optimizer's scalars (AdamW's step,
    the first piece's tensor of each parameter, as every piece steps alike), and its buffers."""
    by_fqn: dict[str, list[tuple[Any, torch.Tensor, tuple[int, int] | None]]] = {}
    for fqn, region, shard, chunk in executor.shard_items():
        by_fqn.setdefault(fqn, []).append((region, shard, chunk))
    state: dict[str, Any] = {}
    for fqn, pieces in by_fqn.items():
        shape = executor.param_shapes[fqn]
        state[param_key(fqn)] = boxes_of(shape, pieces)
        held = [optimizer.state.get(shard, {}) for _, shard, _ in pieces] if optimizer is not None else []
        for name, first in (held[0] if held else {}).items():
            state[optimizer_key(fqn, name)] = first if first.dim() == 0 else boxes_of(
                shape, [(region, h[name], chunk) for (region, _, chunk), h in zip(pieces, held, strict=True)])
    buffer_shapes = {name: tuple(t.shape) for name, t in named_tensors(executor.module).items()}
    by_buffer: dict[str, list[tuple[Any, torch.Tensor, None]]] = {}
    for (fqn, region), t in sorted(executor.buffers.items()):
        by_buffer.setdefault(fqn, []).append((region, t, None))
    for fqn, pieces in by_buffer.items():
        state[buffer_key(fqn)] = boxes_of(buffer_shapes[fqn], pieces)
    return {key: value for key, value in state.items() if value is not None}


def _restore(executor: Executor, optimizer: torch.optim.Optimizer | None, path: str, *, options: TrainOptions,
             meta: Mapping[str, Any]) -> CheckpointInfo:
    """Load checkpoint `path` straight into this rank's pieces, buffers and optimizer state (each rank
    reads what it holds, whatever strategy and process count wrote it); returns its info."""
    info = read_info(path)
    check_resumable(path, info, graph=meta["graph"], fingerprint=meta["fingerprint"],
                    optimizer=options.setup.optimizer)
    if optimizer is not None:
        # The state the checkpoint holds, created here for the load to fill (the optimizer creates it
        # lazily, in its first step, and then keeps what it finds): by key prefix, (name, shape, dtype).
        saved: dict[str, list[tuple[str, tuple[int, ...], torch.dtype]]] = {}
        for key, (shape, dtype) in saved_tensors(path).items():
            prefix, _, name = key.rpartition("/")
            saved.setdefault(f"{prefix}/", []).append((name, shape, dtype))
        for fqn, _, shard, _ in executor.shard_items():
            for name, shape, dtype in saved.get(optimizer_key(fqn, ""), []):
                optimizer.state[shard][name] = torch.zeros_like(shard) if shape else torch.zeros((), dtype=dtype)
    state = _checkpoint_state(executor, optimizer)
    load_checkpoint(path, state)
    if optimizer is not None:
        with torch.no_grad():
            for fqn, _, shard, _ in executor.shard_items():
                for name, value in optimizer.state[shard].items():
                    if value.dim() == 0:  # a scalar the state loaded into one piece's tensor
                        value.copy_(state[optimizer_key(fqn, name)])
    return info


def _save(executor: Executor, optimizer: torch.optim.Optimizer | None, *, step: int, losses: Sequence[float],
          options: TrainOptions, meta: Mapping[str, Any]) -> None:
    """Write checkpoint `step` (`runtime.checkpoint`): every rank its own pieces, nothing gathered; returns
    once it is in place (a barrier), so a rank that dies afterwards cannot spoil it."""
    save_checkpoint(options.checkpoint_dir, _checkpoint_state(executor, optimizer),
                    CheckpointInfo(step=step, optimizer=options.setup.optimizer, losses=tuple(losses), meta=meta))


def build_rank(build: Callable[[], Workload], plan: StepPlan, rank: int, *, seed: int
               ) -> tuple[Workload, Mapping[str, torch.Tensor], str | None]:
    """Build the model for `rank` from `seed` without holding it (`runtime.materialize`): the workload,
    whose module lives on the meta device but for its buffers, and the parameter pieces the rank's
    parts hold, equal to the eager build's. A build that cannot run on the meta device is built whole;
    the third item then says why (None otherwise)."""
    torch.manual_seed(seed)
    try:
        construction = record(build)
        workload = construction.value
        if not isinstance(workload, Workload):
            raise MaterializeError(f"the build returned {type(workload).__name__}, not a Workload")
        pieces = replay(construction, workload.module, pieces_needed(plan, rank))
    except MaterializeError as exc:
        torch.manual_seed(seed)
        workload = build()
        return workload, named_tensors(workload.module), str(exc)
    install_buffers(workload.module, pieces)
    return workload, pieces, None


def build_executor(rank: int, world_size: int, g: OperatorGraph, strategy: Mapping[str, Mapping[str, Any]],
                   build: Callable[[], Workload], options: TrainOptions
                   ) -> tuple[StepPlan, Executor, torch.optim.Optimizer | None, Workload, str | None]:
    """This rank's plan, executor over the pieces of the model it holds, optimizer (None where the rank
    holds no parameter: every op with weights placed elsewhere), workload (its module on the meta device
    unless built whole) and why it was built whole (None: it was not)."""
    plan = lower(g, strategy_from_configs(strategy), options.setup, world_size)
    device = rank_device(options.device, rank)
    workload, tensors, whole = build_rank(build, plan, rank, seed=options.seed)
    module = workload.module.to(TORCH_DTYPES[options.dtype])
    if device.type != "cpu":  # the real tensors opaque ops read (buffers; all of a model built whole)
        module._apply(lambda t: t if t.is_meta else t.to(device))
    executor = Executor(g, plan, rank=rank, tensors=tensors, module=module,
                        float_dtype=TORCH_DTYPES[options.dtype], timeout_s=options.timeout_s, device=device)
    optimizer = make_optimizer(executor.parameters(), options.setup) if executor.parameters() else None
    return plan, executor, optimizer, workload, whole


class StrategyFailed(RuntimeError):
    """A strategy of `time_strategies` failed or took too long; the message names it and the step."""


def time_strategies(rank: int, world_size: int, *, build: Callable[[], Workload], graph: Mapping[str, Any],
                    strategies: Mapping[str, Mapping[str, Mapping[str, Any]]], options: TrainOptions,
                    steps: int = 4, rounds: int = 3,
                    report: Callable[[Mapping[str, Any]], None] | None = None) -> dict[str, list[float]]:
    """Train one model under several strategies in one job, interleaved: `rounds` times, each strategy
    in turn for 1 + `steps` steps (its own model replica, executor and optimizer, built once). Returns,
    per strategy, each round's median over its steps after the first (the first runs on caches the
    other strategies left) of the slowest rank's step time (ms). Interleaving spreads a drift of the
    machine's load over all strategies instead of pinning it on the one that ran at the time.

    There is no limit on the whole job, only on each step: a step over `options.timeout_s` seconds (also
    every process group's timeout, so a rank that waits for a slow peer gives up as late) raises
    `StrategyFailed` naming the strategy, as does any error of a strategy's step. Rank 0 passes
    `{"strategy", "round", "rounds", "step_ms"}` to `report` (`runtime.launch.launch`'s `progress`) after
    each strategy's turn."""
    if steps < 1 or rounds < 1:
        raise ValueError(f"steps and rounds must be positive, got {steps} and {rounds}")
    g = OperatorGraph.from_dict(graph)
    runs = {}
    for name, configs in strategies.items():
        _, executor, optimizer, workload, _ = build_executor(rank, world_size, g, configs, build, options)
        runs[name] = (workload, executor, optimizer, loss_scaler(options.setup))
    highs = integer_highs(g, next(iter(runs.values()))[0].module) if runs else {}
    mine: dict[str, list[list[float]]] = {name: [] for name in runs}
    step = 0
    for k in range(rounds):
        for name, (workload, executor, optimizer, scaler) in runs.items():
            times_ms = []
            for _ in range(steps + 1):
                batch = synthetic_batch(workload.example, step=step, seed=options.seed, highs=highs,
                                        dtype=TORCH_DTYPES[options.dtype], device=executor.device)
                clock = device_clock(executor.device)
                try:
                    if world_size > 1:
                        dist.barrier()
                    start = clock()
                    local = train_step(executor, optimizer, batch, step=step, scaler=scaler)
                    times_ms.append((clock() - start) * 1e3)
                    executor.all_reduce_loss(local)
                except Exception as exc:  # named by strategy: the runs of all of them interleave in one job
                    raise StrategyFailed(f"strategy {name!r}, step {step}: {type(exc).__name__}: {exc}") from exc
                if times_ms[-1] > options.timeout_s * 1e3:
                    raise StrategyFailed(f"strategy {name!r}, step {step}: the step took {times_ms[-1] / 1e3:.3g} s, "
                                         f"more than the per-step timeout of {options.timeout_s:g} s")
                step += 1
            mine[name].append(times_ms[1:])
            if report is not None and rank == 0:
                report({"strategy": name, "round": k + 1, "rounds": rounds,
                        "step_ms": statistics.median(times_ms[1:])})
    per_rank = [mine]
    if world_size > 1:
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, mine)
    return {name: [statistics.median(max(ts) for ts in zip(*(r[name][k] for r in per_rank), strict=True))
                   for k in range(rounds)] for name in runs}


def _with_ties(params: Mapping[str, torch.Tensor], module: nn.Module) -> dict[str, torch.Tensor]:
    """`params` with every tied parameter also under the names of its ties: capture names a weight two
    modules share by one of its names (GPT-2's token embedding and LM head), the reference by all."""
    ties: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        ties.setdefault(id(p), []).append(name)
    out = dict(params)
    for names in ties.values():
        held = next((n for n in names if n in params), None)
        if held is not None:
            out.update({n: params[held] for n in names})
    return out


def train_rank(rank: int, world_size: int, *, build: Callable[[], Workload], graph: Mapping[str, Any],
               strategy: Mapping[str, Mapping[str, Any]], options: TrainOptions) -> dict[str, Any]:
    """Train on this rank (torch.distributed initialized when world_size > 1); the launcher's target.

    `graph` is `OperatorGraph.to_dict()` and `strategy` the per-op configs, so every rank runs exactly
    the plan the caller validated. Returns `rank`, `first_step` (0, or the resumed checkpoint's step),
    `losses` and `step_time_ms` (per step run), `step_time_ms_per_rank` (every rank's list), `collectives`
    (per rank, the collectives its last step issued: `Executor.collectives`) and, on rank 0 with
    `options.verify`, `verify` (`max_loss_rel_diff`, `max_param_rel_diff`, ...).
    """
    g = OperatorGraph.from_dict(graph)
    if options.verify and options.device == "cuda":
        # the same convolution algorithms on both sides of the comparison, run after run
        torch.backends.cudnn.deterministic = True
    plan, executor, optimizer, workload, built_whole = build_executor(rank, world_size, g, strategy, build, options)
    module = executor.module
    meta = {"graph": g.name, "fingerprint": g.fingerprint, "seed": options.seed, "num_devices": world_size,
            "setup": options.setup.to_dict(), "dtype": options.dtype}
    first_step, history = 0, []  # history: the losses of the steps before the first (the checkpoint's)
    if options.resume_from is not None:
        resumed = _restore(executor, optimizer, options.resume_from, options=options, meta=meta)
        first_step, history = resumed.step, list(resumed.losses)
    scaler = loss_scaler(options.setup)
    if scaler is not None and options.resume_from is not None and "loss_scale" in resumed.meta:
        scaler.load_state(resumed.meta["loss_scale"])  # where the uninterrupted run's scale would be
    dtype = TORCH_DTYPES[options.dtype]
    highs = integer_highs(g, module)
    losses: list[float] = []
    times_ms: list[float] = []
    clock = device_clock(executor.device)
    grads_items: list = []  # under verify, the gradients of the first step applied (`train_step`)
    grads_step: int | None = None
    for step in range(first_step, options.steps):
        batch = synthetic_batch(workload.example, step=step, seed=options.seed, highs=highs, dtype=dtype,
                                device=executor.device)
        fault = options.fault is not None and options.fault[1:] == (rank, step)
        if fault and options.fault[0] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if world_size > 1:
            dist.barrier()
        start = clock()
        capture = options.verify and grads_step is None
        local = train_step(executor, optimizer, batch, step=step, fail=fault, scaler=scaler, keep_grads=capture)
        times_ms.append((clock() - start) * 1e3)
        if capture:  # (the scaler skips on every rank alike, so every rank captures at the same step)
            if scaler is None or not scaler.skipped or scaler.skipped[-1] != step - first_step:
                grads_step, grads_items = step, _gradient_copies(executor)
            executor.zero_grad()
        losses.append(executor.all_reduce_loss(local))
        done = step + 1
        if options.checkpoint_dir is not None and (
                done == options.steps or (options.checkpoint_every and done % options.checkpoint_every == 0)):
            _save(executor, optimizer, step=done, losses=history + losses, options=options,
                  meta=meta | ({"loss_scale": scaler.state()} if scaler is not None else {}))
    per_rank: list[Any] = [times_ms]
    if world_size > 1:
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, times_ms)
    median_ms = statistics.median(times_ms) if times_ms else float("nan")
    collectives: list[Any] = [executor.collectives]
    if world_size > 1:
        collectives = [None] * world_size
        dist.all_gather_object(collectives, executor.collectives)
    result: dict[str, Any] = {
        "rank": rank, "first_step": first_step, "losses": losses, "step_time_ms": times_ms,
        "built_whole": built_whole,
        "collectives": collectives,
        "median_step_time_ms": median_ms, "step_time_ms_per_rank": per_rank,
        "median_step_time_ms_per_rank": [statistics.median(t) if t else float("nan") for t in per_rank],
        "skipped_steps": [first_step + c for c in scaler.skipped] if scaler is not None else []}
    if options.verify:
        gathered = _gather_params(executor, plan, rank)
        grads_items = [(fqn, region, torch.from_numpy(a), chunk) for fqn, region, a, chunk in grads_items]
        gathered_grads = _gather_params(executor, plan, rank, grads_items) if grads_step is not None else None
        if gathered is not None:
            params, replica_diff = gathered
            params = _with_ties(params, module)
            first = FirstGradients(after=first_step)
            ref_losses, ref_params, initial = reference_train(build, g, strategy, options, device=executor.device,
                                                              first_gradients=first)
            dtype = verify_dtype(options)
            same_step = gathered_grads is not None and first.step == grads_step
            result["verify"] = compare(losses, params, ref_losses[first_step:], ref_params, initial, dtype=dtype,
                                       grads=_with_ties(gathered_grads[0], module) if same_step else None,
                                       ref_grads=first.grads, rounding=first.rounding,
                                       check_params=options.setup.optimizer != "adamw" or dtype == "float64",
                                       ) | {"max_replica_abs_diff": replica_diff, "gradients_step": grads_step,
                                            "reference_gradients_step": first.step}
    return result


# ---------------------------------------------------------------------- reference and comparison


def _chunked_batchnorm(module: nn.Module, chunks: int) -> None:
    """Make a BatchNorm module normalize `chunks` equal sample chunks separately (DDP's local stats)."""
    forward = type(module).forward

    def chunked(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([forward(self, part) for part in x.chunk(chunks, dim=0)], dim=0)

    module.forward = types.MethodType(chunked, module)


def _batchnorm_module(graph: OperatorGraph, name: str) -> str:
    op = graph[name]
    for fqn in [p.fqn for p in op.params.values()] + [op.attrs.get("running_mean") or ""]:
        if fqn:
            return fqn.rpartition(".")[0]
    return op.module


class _RuntimeDropout:
    """One forward of the reference in which `torch.nn.functional.dropout` (what `nn.Dropout` and Hugging
    Face models call) and aten's feature dropout (`nn.Dropout1d`/`2d`/`3d`) draw the runtime's masks, so
    that the reference trains on the masks the ``dropout`` ops draw. The forward's n-th call (from 0,
    whatever its p and training flag: capture numbers the ops so, the op's ``seed``) keeps
    `runtime.kernels.dropout_keep` of the whole tensor (of its (sample, channel) index, for a feature
    dropout) with seed n and `step`, scaled by 1/(1-p); with p = 0 or outside training it is the identity.
    A dropout of a parameter is no ``dropout`` op (capture leaves it opaque): it keeps torch's. Likewise the
    n-th draw (``torch.rand``, ``torch.randn``, their ``_like`` forms, ``Tensor.bernoulli_`` with a float p)
    draws the values of the ``random`` op of seed n (`uniform_draws`, `normal_draws`: stochastic depth, a
    VAE's noise), and a count of draws other than `num_draws` is a `ValueError` on leaving. On leaving,
    the original is back; where some mask mattered (a call of this forward drew one, or `masked`: a graph
    ``dropout`` op has p > 0), a count of calls other than `num_ops` (the graph's ``dropout`` ops) is a
    `ValueError`: the masks could not be matched, and comparing would report a false mismatch."""

    def __init__(self, *, num_ops: int, masked: bool, step: int, num_draws: int = 0) -> None:
        self.num_ops = num_ops
        self.masked = masked
        self.step = step
        self.calls = 0
        self.num_draws = num_draws
        self.draws = 0

    def __enter__(self) -> None:
        self.original = torch.nn.functional.dropout
        torch.nn.functional.dropout = self.dropout
        # `nn.Dropout1d`/`2d`/`3d` reach aten's feature dropout through torch's `_VF` module (whose attributes
        # resolve on lookup: set here, they are taken away again on leaving)
        torch._VF.feature_dropout = self.feature_dropout
        torch._VF.feature_dropout_ = self.feature_dropout_
        self.original_draws = (torch.rand, torch.randn, torch.rand_like, torch.randn_like)
        torch.rand, torch.randn = self.rand, self.randn
        torch.rand_like, torch.randn_like = self.rand_like, self.randn_like
        self.original_bernoulli_ = torch.Tensor.bernoulli_
        torch.Tensor.bernoulli_ = self.bernoulli_function()

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        torch.nn.functional.dropout = self.original
        del torch._VF.feature_dropout, torch._VF.feature_dropout_
        torch.rand, torch.randn, torch.rand_like, torch.randn_like = self.original_draws
        torch.Tensor.bernoulli_ = self.original_bernoulli_
        if exc_type is None and self.draws != self.num_draws:
            raise ValueError(
                f"verification cannot reproduce the random draws: the reference's forward drew {self.draws} times "
                f"(torch.rand, torch.randn and their _like forms, Tensor.bernoulli_) where the graph has "
                f"{self.num_draws} random ops (a draw capture left opaque, or one made another way); verify "
                f"without the draws (a drop path rate of 0, say)")
        if exc_type is None and self.masked and self.calls != self.num_ops:
            raise ValueError(
                f"verification cannot reproduce the dropout masks: the reference's forward called "
                f"torch.nn.functional.dropout {self.calls} times where the graph has {self.num_ops} dropout "
                f"ops (a dropout called another way, or one capture left opaque); verify with dropout p=0")

    def dropout(self, input: torch.Tensor, p: float = 0.5, training: bool = True,
                inplace: bool = False, *, feature: bool = False) -> torch.Tensor:
        if isinstance(input, nn.Parameter):
            if feature:
                return torch._C._VariableFunctions.feature_dropout(input, p, training)
            return self.original(input, p, training, inplace)
        seed = self.calls
        self.calls += 1
        if not training or p == 0.0:
            return input
        self.masked = True
        out = dropped(input, tuple((0, n) for n in input.shape), tuple(input.shape), p=p, seed=seed, step=self.step,
                      feature=feature)
        return input.copy_(out) if inplace else out

    def rand(self, *size: Any, dtype: torch.dtype | None = None, device: Any = None, normal: bool = False,
             **kwargs: Any) -> torch.Tensor:
        """``torch.rand`` (``torch.randn`` with `normal`): the n-th draw's values are the ``random`` op of
        seed n's (`uniform_draws`, `normal_draws`)."""
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], tuple | list | torch.Size) else size
        seed = self.draws
        self.draws += 1
        draw = normal_draws if normal else uniform_draws
        return draw(tuple((0, int(n)) for n in shape), [int(n) for n in shape], seed=seed, step=self.step,
                    dtype=dtype or torch.get_default_dtype(), device=device or "cpu")

    def randn(self, *size: Any, **kwargs: Any) -> torch.Tensor:
        return self.rand(*size, normal=True, **kwargs)

    def rand_like(self, like: torch.Tensor, *, dtype: torch.dtype | None = None, **kwargs: Any) -> torch.Tensor:
        return self.rand(tuple(like.shape), dtype=dtype or like.dtype, device=like.device)

    def randn_like(self, like: torch.Tensor, *, dtype: torch.dtype | None = None, **kwargs: Any) -> torch.Tensor:
        return self.rand(tuple(like.shape), dtype=dtype or like.dtype, device=like.device, normal=True)

    def bernoulli_function(self) -> Callable[..., torch.Tensor]:
        """``Tensor.bernoulli_`` with a float p (timm's drop path): floor(u + p) of the next draw u, as capture
        writes it (`soap.capture.tracing`); a tensor of probabilities keeps torch's."""
        original = self.original_bernoulli_

        def bernoulli_(tensor: torch.Tensor, p: Any = 0.5, *, generator: Any = None) -> torch.Tensor:
            if isinstance(p, torch.Tensor):
                return original(tensor, p, generator=generator)
            drawn = self.rand(tuple(tensor.shape), dtype=tensor.dtype, device=tensor.device)
            with torch.no_grad():
                return tensor.copy_(torch.floor(drawn + float(p)))

        return bernoulli_

    def feature_dropout(self, input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
        return self.dropout(input, p, train, feature=True)

    def feature_dropout_(self, input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
        return self.dropout(input, p, train, True, feature=True)


def _reference_module(build: Callable[[], Workload], graph: OperatorGraph,
                      strategy: Mapping[str, Mapping[str, Any]], options: TrainOptions, dtype: torch.dtype,
                      device: torch.device) -> tuple[Workload, nn.Module]:
    """`build()`'s workload with its module in `dtype` on `device`, seeded and initialized as the run's,
    in training mode, its BatchNorms normalizing the chunks the strategy's sample splits make."""
    torch.manual_seed(options.seed)
    workload = build()
    module = workload.module.to(dtype=dtype, device=device)
    module.train()
    for op in graph:
        if op.kind == "batchnorm":
            degree = int(strategy[op.name]["degrees"].get("sample", 1))
            if degree > 1:
                _chunked_batchnorm(module.get_submodule(_batchnorm_module(graph, op.name)), degree)
    return workload, module


def _reference_loss(workload: Workload, module: nn.Module, graph: OperatorGraph, options: TrainOptions, step: int,
                    dtype: torch.dtype, device: torch.device, highs: Mapping[int, int], *,
                    autocast: bool = True) -> torch.Tensor:
    """The reference's loss of `step` (in `dtype`): the step's synthetic batch (integer inputs below
    `highs`, `integer_highs`) through the module, its dropouts drawing the runtime's masks (attention's
    included: attention computes as capture traced it, `soap.capture.attention`), under torch.autocast to
    the compute dtype unless the run computes in float32 or not `autocast`."""
    batch = synthetic_batch(workload.example, step=step, seed=options.seed, highs=highs, dtype=dtype,
                            device=device)
    dropouts = [op for op in graph if op.kind == "dropout"]
    compute = options.setup.compute_dtype
    n_inputs = len(workload.inputs)
    draws = sum(op.kind == "random" for op in graph)
    with (_RuntimeDropout(num_ops=len(dropouts), masked=any(op.attrs.get("p") for op in dropouts), step=step,
                          num_draws=draws),
          captured_attention(), layered_recurrences(), experts_as_one_call(module, traced=False),
          torch.autocast(device.type, dtype=TORCH_DTYPES[compute], enabled=autocast and compute != "float32")):
        return workload.loss_fn(module(*batch[:n_inputs]), batch[n_inputs]).to(dtype)


@dataclass
class FirstGradients:
    """What the reference records of its first step from `after` on whose update it applies (the loss
    scaler skips none before it): the step, its gradients before the update (unscaled; `_gradients`), and
    per parameter their rounding error at the run's precision (`_rounding`)."""

    after: int = 0
    step: int | None = None
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    rounding: dict[str, float] = field(default_factory=dict)


def _gradients(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's trainable parameters' gradients by fully qualified name, float64 on the CPU (zeros
    where a parameter has none)."""
    return {name: _cpu64(p.grad if p.grad is not None else torch.zeros_like(p))
            for name, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}


def _gradients_in(dtype: torch.dtype, workload: Workload, module: nn.Module, graph: OperatorGraph,
                  options: TrainOptions, step: int, device: torch.device, highs: Mapping[int, int],
                  scale: float = 1.0) -> dict[str, torch.Tensor]:
    """The gradients of `step` from a copy of `module` (its current parameters and buffers) wholly in
    `dtype` (no autocast; backward on the loss times `scale`, the gradients divided by it: `_gradients`);
    empty when the model cannot run so (an op without a kernel for the dtype on the device, a forward that
    casts to a fixed dtype and then mixes it)."""
    try:
        twin = copy.deepcopy(module).to(dtype)
        twin.zero_grad(set_to_none=True)  # (a deep copy keeps the gradients)
        loss = _reference_loss(workload, twin, graph, options, step, dtype, device, highs, autocast=False)
        (loss.float() * scale).backward()
    except (RuntimeError, TypeError, ValueError):
        return {}
    return {name: g / scale for name, g in _gradients(twin).items()}


def _rounding(workload: Workload, module: nn.Module, graph: OperatorGraph, options: TrainOptions, step: int,
              device: torch.device, highs: Mapping[int, int], scale: float = 1.0) -> dict[str, float]:
    """Per parameter, the largest difference between the gradients of `step` computed wholly in the run's
    compute dtype (at the loss scale `scale`) and in float64 (`_gradients_in`); none where either cannot
    be computed or is not finite."""
    low = _gradients_in(TORCH_DTYPES[verify_dtype(options)], workload, module, graph, options, step, device, highs,
                        scale)
    exact = _gradients_in(torch.float64, workload, module, graph, options, step, device, highs) if low else {}
    out = {name: _max_abs(g - exact[name]) for name, g in low.items() if name in exact}
    return {name: d for name, d in out.items() if math.isfinite(d)}


def reference_train(build: Callable[[], Workload], graph: OperatorGraph,
                    strategy: Mapping[str, Mapping[str, Any]], options: TrainOptions,
                    device: torch.device | None = None, *, first_gradients: FirstGradients | None = None,
                    ) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Single-process training of `build()`'s module on the same batches (under mixed precision with
    torch.autocast to the compute dtype, and fp16's loss scaling) on `device` (the CPU when None; the
    verifying rank's GPU on GPUs, so that both sides run the same kernels), its dropouts drawing the
    runtime's masks (`_RuntimeDropout`); returns the losses, the final parameters and the initial ones (by
    fully qualified name, on the CPU). `first_gradients`, when given, is filled in (`FirstGradients`)."""
    dtype = TORCH_DTYPES[options.dtype]
    device = device if device is not None else torch.device("cpu")
    workload, module = _reference_module(build, graph, strategy, options, dtype, device)
    params = [p for p in module.parameters() if p.requires_grad]
    initial = {name: p.detach().to("cpu", copy=True) for name, p in module.named_parameters(remove_duplicate=False)}
    optimizer = make_optimizer(params, options.setup) if params else None  # None: nothing to train, as a rank
    highs = integer_highs(graph, module)
    losses = []
    scaler = loss_scaler(options.setup, across_ranks=False)
    for step in range(options.steps):
        loss = _reference_loss(workload, module, graph, options, step, dtype, device, highs)
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
            (loss * (scaler.scale if scaler is not None else 1.0)).backward()
            applied = scaler is None or scaler.unscale(params)
            first = first_gradients
            if first is not None and first.step is None and step >= first.after and applied:
                first.step, first.grads = step, _gradients(module)
                first.rounding = _rounding(workload, module, graph, options, step, device, highs,
                                           scaler.scale if scaler is not None else 1.0)
            if applied:
                optimizer.step()
        losses.append(float(loss.detach()))
    final = {name: p.detach().to("cpu", copy=True) for name, p in module.named_parameters(remove_duplicate=False)}
    return losses, final, initial


# What verification allows, by the dtype a run computes in. Losses: `loss_rtol` relative. Parameters: like
# numpy's allclose, but relative to the parameter's update (the largest change training made to it, which
# is what the distributed run computes) rather than to its value, with an absolute floor: a parameter may
# differ from the reference by max(rtol x update, atol). A parameter whose gradient is zero in exact
# arithmetic (an attention key's bias, say) moves only by rounding noise on both sides; the floor keeps
# that noise from failing the check, while a wrong gradient moves it by a step's size and fails.
# Under mixed precision the reference is torch.autocast, which keeps more ops in float32 (sums, exponentials,
# powers) than the run does (norms, softmax and the loss), so the two round differently:
# about 2^-8 (bfloat16) or 2^-11 (float16) relative per op. The tolerances allow a few percent of a
# parameter's update and of the loss, far below what a wrong gradient or a missed exchange does (a whole
# update, or a loss off by the model's output scale).
# AdamW divides each gradient element by its own running RMS, so an element whose gradient is rounding
# noise (zero in exact arithmetic: an attention key's bias, any sum that cancels) moves by about the
# learning rate in a direction the summation order decides, and from the second step on every gradient
# depends on those moves. Measured at 3 steps, lr 0.01: in float32 up to 3.1e-2 of an update over the mlp,
# small GPTs, Llama and BERT, 0.46-0.62 on BART's cross-attention key bias under fsdp and pipelines, and
# under bf16 and fp16 up to 2.6 updates, with the losses matching and the same run under SGD within its
# row. No tolerance tells that from an error, so under AdamW below float64 the final parameters are
# reported, not checked; what is checked instead is the computation itself: the first applied step's
# gradients, within the row with their measured rounding error allowed besides (`compare`), and every
# loss. In float64 the rounding AdamW amplifies stays far below the row, and the parameters are checked
# as well.
VERIFY_TOLERANCES: Mapping[str, Mapping[str, float]] = {
    "float32": {"loss_rtol": 1e-5, "rtol": 1e-4, "atol": 1e-6},
    "float64": {"loss_rtol": 1e-10, "rtol": 1e-9, "atol": 1e-12},
    "bfloat16": {"loss_rtol": 2e-2, "rtol": 1e-1, "atol": 1e-4},
    "float16": {"loss_rtol": 5e-3, "rtol": 5e-2, "atol": 1e-5},
}


def verify_dtype(options: TrainOptions) -> str:
    """The dtype a run computes in, its `VERIFY_TOLERANCES` row: the compute dtype under mixed precision,
    else its dtype."""
    return options.setup.compute_dtype if options.setup.precision != "fp32" else options.dtype


def _max_abs(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def _cpu64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64, copy=True)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a - b)


# How many times the reference's own rounding error in a gradient (its distance from the float64 one) the
# run's gradient may differ by besides the row's tolerance: the run rounds differently (another summation
# order; under mixed precision ops the reference's autocast keeps in float32), by about as much.
ROUNDING_MARGIN = 10.0


def _relative_diffs(got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor],
                    scale: Callable[[str, torch.Tensor], float], floor: float) -> tuple[dict, dict]:
    """Per name of `ref` that `got` has: the largest absolute difference, and that over max(scale, floor)."""
    abs_diffs, rel_diffs = {}, {}
    for name, r in ref.items():
        if name in got:
            r64 = r.double()
            abs_diffs[name] = _max_abs(got[name].double() - r64)
            rel_diffs[name] = abs_diffs[name] / max(scale(name, r64), floor)
    return abs_diffs, rel_diffs


def compare(losses: Sequence[float], params: Mapping[str, torch.Tensor], ref_losses: Sequence[float],
            ref_params: Mapping[str, torch.Tensor], initial: Mapping[str, torch.Tensor], *,
            dtype: str = "float32", grads: Mapping[str, torch.Tensor] | None = None,
            ref_grads: Mapping[str, torch.Tensor] | None = None, rounding: Mapping[str, float] | None = None,
            check_params: bool = True) -> dict[str, Any]:
    """The run against the reference (`VERIFY_TOLERANCES` of `dtype`).

    Per step |loss - ref| / |ref|; per parameter the largest absolute difference and that over
    max(update, atol / rtol), where update = max|ref - initial|. With `grads` and `ref_grads` (the first
    applied step's gradients of both), per parameter the largest absolute difference of the gradients
    over max(max|ref gradient| + `ROUNDING_MARGIN` x its rounding error (`rounding`, per parameter) /
    rtol, atol / rtol x the largest reference gradient of the model): within rtol of its size plus the
    margin times its rounding error, floored at the row's share of the model's gradients (a gradient at
    rounding level, zero in exact arithmetic, is then no failure). `passed` when every loss, every
    gradient given and (with `check_params`) every parameter is within its tolerance, nothing is NaN, and
    every parameter is held by some rank (one no op reads is listed under `params_not_held`).
    """
    tol = VERIFY_TOLERANCES[dtype]
    loss_diffs = [_rel(a, b) for a, b in zip(losses, ref_losses, strict=True)]
    abs_diffs, rel_diffs = _relative_diffs(params, ref_params, lambda n, r: _max_abs(r - initial[n].double()),
                                           tol["atol"] / tol["rtol"])
    ref_grads, rounding = ref_grads or {}, rounding or {}
    largest = max((_max_abs(g.double()) for g in ref_grads.values()), default=0.0)

    def grad_scale(name: str, ref: torch.Tensor) -> float:
        return _max_abs(ref) + ROUNDING_MARGIN * rounding.get(name, 0.0) / tol["rtol"]

    grad_abs, grad_rel = _relative_diffs(grads or {}, ref_grads, grad_scale, tol["atol"] / tol["rtol"] * largest)
    worst = max(rel_diffs, key=rel_diffs.get) if rel_diffs else None
    worst_grad = max(grad_rel, key=grad_rel.get) if grad_rel else None
    nan = sorted(n for n, p in params.items() if not math.isfinite(float(p.double().sum())))
    not_held = sorted(set(ref_params) - set(params))
    max_loss = max(loss_diffs) if loss_diffs else 0.0
    max_param = max(rel_diffs.values()) if rel_diffs else 0.0
    max_grad = max(grad_rel.values()) if grad_rel else 0.0
    return {
        "passed": bool(max_loss <= tol["loss_rtol"] and (max_param <= tol["rtol"] or not check_params)
                       and max_grad <= tol["rtol"] and not nan and not not_held),
        "max_loss_rel_diff": max_loss,
        "max_param_rel_diff": max_param,
        "max_param_abs_diff": max(abs_diffs.values()) if abs_diffs else 0.0,
        "worst_param": worst,
        "params_checked": check_params,
        "max_grad_rel_diff": max_grad if grad_rel else None,
        "max_grad_abs_diff": grad_abs[worst_grad] if worst_grad is not None else None,
        "worst_grad": worst_grad,
        "tolerance": dict(tol),
        "tolerance_row": dtype,
        "reference_losses": list(ref_losses),
        "params_not_held": not_held,
        "nan_params": nan,
    }
