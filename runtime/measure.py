"""Measurement on the local device: op parts (forward, backward) and point-to-point and collective transfers.

Owns `PartJob` (one op part to time, self-contained so that it pickles into worker processes),
`part_jobs` (the distinct parts of a graph under one or more strategies), `time_part` (warm-up, then the
median of repeats), `measure_parts` (time what the cost database lacks and append it, atomically),
`time_comm` (alpha-beta samples of send/recv, all-reduce and all-gather between the ranks of a launched
job) and `time_update` (the optimizer step over parameters beyond the caches). Whole training steps are
timed by `runtime.train.time_strategies`.

Op parts run through `runtime.kernels.compute_part`, the very kernels the executor calls, on detached
leaf inputs and parameter shards exactly as the executor passes them, so a measured part is what a rank
computes. Keys come from `soap.costdb.part_key`: the simulator's `MeasuredCostModel` looks up the same
key for the same part. Imports `soap`, torch and the other `runtime` modules only (never the simulator
or the search): measured costs reach the simulator through the cost database file.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from runtime import kernels
from runtime.executor import TORCH_DTYPES
from runtime.launch import exact_float32, keep_freed_memory
from soap import costdb
from soap.config import parts
from soap.graph import Operator, OperatorGraph
from soap.lowering import GradFlow
from soap.opdef import Box
from soap.registry import op_def
from soap.setup import TrainSetup
from soap.strategy import Strategy

# Op kinds no kernel computes: the runtime feeds them (input, constant) or calls the model (opaque).
UNTIMED_KINDS = frozenset({"input", "constant", "opaque"})
_INT_DTYPES = frozenset({"int64", "int32", "int16", "int8", "uint8"})


@dataclass(frozen=True, slots=True, kw_only=True)
class PartJob:
    """One op part to time: the op (as `Operator.to_dict()`), its box, the dtypes of its inputs, for
    integer inputs the exclusive upper bound of their values (embedding rows, class count), and which
    inputs carry a gradient in the graph (the executor computes input gradients only for those)."""

    op: Mapping[str, Any]
    box: Box
    input_dtypes: tuple[str, ...]
    int_highs: tuple[int, ...]
    needs_grad: tuple[bool, ...]

    def __post_init__(self) -> None:
        if not len(self.input_dtypes) == len(self.int_highs) == len(self.needs_grad):
            raise ValueError(f"input_dtypes {self.input_dtypes}, int_highs {self.int_highs} and needs_grad "
                             f"{self.needs_grad} differ in length")

    def operator(self) -> Operator:
        return Operator.from_dict(self.op)


def _int_high(graph: OperatorGraph, op: Operator, slot: int) -> int:
    """Values an integer input of `op` may take: rows of the embedding it indexes, classes of the loss."""
    if op.kind == "embedding" and slot == 0 and "weight" in op.params:
        return int(op.params["weight"].shape[0])
    if op.kind == "loss" and slot == 1 and op.inputs:
        shape = graph.tensor(op.inputs[0]).shape
        return int(shape[1]) if len(shape) > 1 else 2
    return 2


def job_for(graph: OperatorGraph, op: Operator, box: Box, flow: GradFlow | None = None) -> PartJob:
    """The `PartJob` of part `box` of `op` in `graph` (`flow`: the graph's `GradFlow`, built when not
    given; which inputs carry a gradient does not depend on the training setup)."""
    flow = flow if flow is not None else GradFlow(graph, TrainSetup())
    dtypes = tuple(graph.tensor(ref).dtype for ref in op.inputs)
    highs = tuple(_int_high(graph, op, slot) for slot in range(len(op.inputs)))
    return PartJob(op=op.to_dict(), box=tuple(tuple(r) for r in box), input_dtypes=dtypes, int_highs=highs,
                   needs_grad=flow.grad_inputs[flow.index[op.name]])


def part_jobs(graph: OperatorGraph, strategies: Iterable[Strategy | Mapping[str, Any]], *,
              device_kind: str = "cpu") -> list[PartJob]:
    """Every distinct part (by cost-database key) of the timed kinds under the given strategies, once."""
    seen: set[costdb.Key] = set()
    out: list[PartJob] = []
    flow = GradFlow(graph, TrainSetup())
    for strategy in strategies:
        for op in graph:
            if op.kind in UNTIMED_KINDS or op.name not in strategy:
                continue
            for box, _ in parts(op, strategy[op.name]):
                job = job_for(graph, op, box, flow)
                key = costdb.part_key(op, box, device_kind, job.needs_grad)
                if key not in seen:
                    seen.add(key)
                    out.append(job)
    return out


def _inputs(job: PartJob, op: Operator, gen: torch.Generator) -> list[torch.Tensor | None]:
    entry = op_def(op.kind)
    out: list[torch.Tensor | None] = []
    for region, dtype, high, grad in zip(entry.input_regions(op, job.box), job.input_dtypes, job.int_highs,
                                         job.needs_grad, strict=True):
        if region is None:
            out.append(None)
            continue
        shape = tuple(hi - lo for lo, hi in region)
        if dtype in _INT_DTYPES:
            out.append(torch.randint(0, max(1, high), shape, generator=gen, dtype=TORCH_DTYPES[dtype],
                                     device=gen.device))
        elif dtype == "bool":
            out.append(torch.randint(0, 2, shape, generator=gen, device=gen.device).bool())
        else:
            x = torch.randn(shape, generator=gen, device=gen.device).to(TORCH_DTYPES[dtype])
            out.append(x.requires_grad_(grad))
    return out


def _params(op: Operator, box: Box, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Random parameters and buffers of the part. An op of a mixed-precision step (outputs in a 16-bit
    float dtype) computes with its float32 parameters cast to that dtype, as the executor runs it, unless
    it keeps running statistics (batch norm keeps float32 weights)."""
    entry = op_def(op.kind)
    params = {}
    buffer_regions = entry.buffer_regions(op, box)
    compute = op.outputs[0].dtype if op.outputs and op.outputs[0].dtype in ("bfloat16", "float16") else None
    for name, region in entry.param_regions(op, box).items():
        shape = tuple(hi - lo for lo, hi in region)
        dtype = TORCH_DTYPES[op.params[name].dtype]
        if compute is not None and not buffer_regions and dtype == torch.float32:
            dtype = TORCH_DTYPES[compute]
        params[name] = (torch.randn(shape, generator=gen, device=gen.device) * 0.1).to(dtype).requires_grad_(
            op.params[name].trainable)
    buffers = {}
    for name, region in buffer_regions.items():
        shape = tuple(hi - lo for lo, hi in region)
        buffers[name] = (torch.ones if "var" in name else torch.zeros)(shape, device=gen.device)
    return params, buffers


def _on(x: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    if x is None or x.device == device:
        return x
    return x.detach().to(device).requires_grad_(x.requires_grad)


def time_part(job: PartJob, *, warmup: int = 2, repeats: int = 7, max_s: float = 2.0,
              device: str | torch.device = "cpu") -> tuple[float, float, int]:
    """(forward ms, backward ms, repeats done) of one part on `device`: `warmup` untimed passes, then the
    medians of up to `repeats` timed ones (fewer when they would take longer than `max_s`, at least 3).

    On a CUDA device a time is that of `burst` passes queued back to back, as a step queues its ops, up to
    the device's end (`_time_queued`): what the part adds to a step whether its kernels or their launches
    set the pace, without an idle device between passes."""
    device = torch.device(device)
    if device.type == "cuda":
        exact_float32()  # as every rank computes
    op = job.operator()
    gen = torch.Generator(device=device).manual_seed(0)  # the part's tensors drawn where they are used
    inputs = [_on(x, device) for x in _inputs(job, op, gen)]
    params, buffers = _params(op, job.box, gen)
    params = {k: _on(v, device) for k, v in params.items()}
    buffers = {k: v.to(device) for k, v in buffers.items()}
    leaves = [x for x in (*inputs, *params.values()) if x is not None and x.requires_grad]
    if device.type == "cuda":
        return _time_queued(op, job.box, inputs, params, buffers, leaves, device, warmup=warmup, repeats=repeats,
                            max_s=max_s)
    fwd: list[float] = []
    bwd: list[float] = []
    start_all = time.perf_counter()
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        outs = kernels.compute_part(op, job.box, inputs, params, training=True, buffers=buffers, step=i)
        t1 = time.perf_counter()
        pairs = [(o, torch.ones_like(o)) for o in outs if o.requires_grad]
        t2 = time.perf_counter()
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        t3 = time.perf_counter()
        for x in leaves:
            x.grad = None
        if i >= warmup:
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t3 - t2) * 1e3)
            if len(fwd) >= 3 and time.perf_counter() - start_all > max_s:
                break
    return statistics.median(fwd), statistics.median(bwd), len(fwd)


def _time_queued(op: Operator, box: Box, inputs: list[torch.Tensor | None], params: dict[str, torch.Tensor],
                 buffers: dict[str, torch.Tensor], leaves: list[torch.Tensor], device: torch.device, *,
                 warmup: int, repeats: int, max_s: float, burst: int = 5) -> tuple[float, float, int]:
    """`time_part` on a GPU: each repeat times `burst` forwards queued back to back, then `burst` forward
    and backward pairs, from a synchronized start to the device's end; the backward is the difference."""
    def forward(i: int) -> tuple[torch.Tensor, ...]:
        return kernels.compute_part(op, box, inputs, params, training=True, buffers=buffers, step=i)

    def pair(i: int) -> None:
        outs = [o for o in forward(i) if o.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        for x in leaves:
            x.grad = None

    def queued_ms(fn: Callable[[int], Any]) -> float:
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for i in range(burst):
            fn(i)
        torch.cuda.synchronize(device)
        return (time.perf_counter() - start) * 1e3 / burst

    for i in range(warmup):
        pair(i)
    fwd: list[float] = []
    both: list[float] = []
    start_all = time.perf_counter()
    for _ in range(repeats):
        fwd.append(queued_ms(forward))
        both.append(queued_ms(pair))
        if len(fwd) >= 3 and time.perf_counter() - start_all > max_s:
            break
    f = statistics.median(fwd)
    return f, max(0.0, statistics.median(both) - f), len(fwd)


def measurement(job: PartJob, fwd_ms: float, bwd_ms: float, *, device_kind: str, repeats: int,
                source: str, solo: tuple[float, float] | None = None) -> costdb.Measurement:
    kind, op_kind, dtype, inputs, outputs, params, attrs, grads = costdb.part_key(
        job.operator(), job.box, device_kind, job.needs_grad)
    return costdb.Measurement(device_kind=kind, op_kind=op_kind, dtype=dtype, inputs=inputs, outputs=outputs,
                              params=params, attrs=attrs, grads=grads, fwd_ms=fwd_ms, bwd_ms=bwd_ms, repeats=repeats,
                              source=source, solo_fwd_ms=solo[0] if solo else None,
                              solo_bwd_ms=solo[1] if solo else None)


def time_jobs(jobs: Sequence[PartJob], *, warmup: int = 2, repeats: int = 7, max_s: float = 2.0,
              progress: Callable[[int, int], None] | None = None,
              device: str | torch.device = "cpu") -> list[tuple[float, float, int]]:
    """`time_part` of every job on `device`, in order (`progress(done, total)` after each)."""
    out = []
    for i, job in enumerate(jobs):
        out.append(time_part(job, warmup=warmup, repeats=repeats, max_s=max_s, device=device))
        if progress is not None:
            progress(i + 1, len(jobs))
    return out


def _rank_time_jobs(rank: int, world_size: int, *, jobs: Sequence[PartJob], warmup: int, repeats: int,
                    max_s: float) -> list[tuple[float, float, int]]:
    # Every rank times every part at the same time as the others, so each part runs while the other
    # processes compete for the cores and memory bandwidth as they do in a training run.
    return time_jobs(jobs, warmup=warmup, repeats=repeats, max_s=max_s)


def measure_parts(jobs: Sequence[PartJob], db_path: str | None, *, device_kind: str = "cpu", nproc: int = 1,
                  warmup: int = 2, repeats: int = 7, max_s: float = 2.0, timeout_s: float = 600.0,
                  progress: Callable[[int, int], None] | None = None, source: str = "runtime",
                  device: str | torch.device = "cpu") -> tuple[costdb.CostDatabase, int]:
    """Time the jobs whose keys the database at `db_path` lacks and append them (one atomic write).

    Every part is timed here alone (one thread); with `nproc` > 1 it is also timed in `nproc` concurrent
    processes (one thread each), whose median is stored as the part's time and the lone time as its solo
    time (`soap.costdb`); with 1 the lone time is the part's time.
    Returns the database with the new measurements and how many were timed. `db_path` None keeps the
    measurements in memory only. `timeout_s` is the concurrent job's process-group timeout; the job as a
    whole has no limit (each part's repeats stop after `max_s`), so many parts take as long as they take.
    """
    if nproc > 1 and torch.device(device).type != "cpu":
        raise ValueError(f"concurrent timing (nproc {nproc}) runs on CPU; time {device} parts with nproc 1")
    db = costdb.load(db_path, missing_ok=True) if db_path is not None else costdb.CostDatabase()
    todo: list[PartJob] = []
    keys: set[costdb.Key] = set()
    for job in jobs:
        key = costdb.part_key(job.operator(), job.box, device_kind, job.needs_grad)
        if key not in db and key not in keys:
            keys.add(key)
            todo.append(job)
    if not todo:
        return db, 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every rank of a run
    keep_freed_memory()  # as every rank of a run
    try:
        solo = time_jobs(todo, warmup=warmup, repeats=repeats, max_s=max_s, progress=progress, device=device)
    finally:
        torch.set_num_threads(threads)
    if nproc <= 1:
        new = [measurement(job, f, b, device_kind=device_kind, repeats=n, source=source)
               for job, (f, b, n) in zip(todo, solo, strict=True)]
    else:
        from runtime.launch import launch

        per_rank = launch(_rank_time_jobs, nproc, kwargs={"jobs": list(todo), "warmup": warmup,
                                                          "repeats": repeats, "max_s": max_s},
                          timeout_s=timeout_s, num_threads=1)
        new = [measurement(job, statistics.median(r[i][0] for r in per_rank),
                           statistics.median(r[i][1] for r in per_rank), device_kind=device_kind,
                           repeats=min(r[i][2] for r in per_rank), source=source, solo=solo[i][:2])
               for i, job in enumerate(todo)]
    for m in new:
        db.add(m)
    if db_path is not None:
        costdb.append(db_path, new)
    return db, len(new)


# ---------------------------------------------------------------------- communication


COMM_KINDS = ("p2p", "allreduce", "allgather", "reduce_scatter")


def time_comm(rank: int, world_size: int, *, sizes: Sequence[int], repeats: int = 5, warmup: int = 2,
              kinds: Sequence[str] = COMM_KINDS) -> dict[str, list[tuple[int, float]]]:
    """(bytes, median ms) per size of each kind between the ranks of a launched job (float32 tensors).

    `p2p`: rank 0 sends `bytes` to rank 1 and rank 1 sends them back; half the round trip is one
    transfer. `allreduce`: `bytes` on every rank, summed. `allgather`: `bytes` in all, `bytes / world`
    from each rank. `reduce_scatter`: `bytes` on every rank, summed, each rank keeping `bytes / world` of
    the sum. The collectives are the calls the executor makes (`all_reduce`, `all_gather_single`,
    `reduce_scatter_single`). A barrier starts every repeat, so the ranks start together.
    """
    out: dict[str, list[tuple[int, float]]] = {k: [] for k in kinds}
    # the first transfers of a fresh process group set up connections and buffers: not timed
    warm_chunk = max(1, (max(sizes) if sizes else 4) // 4 // world_size)
    warm, warm_piece = torch.ones(warm_chunk * world_size), torch.ones(warm_chunk)
    for _ in range(warmup):
        dist.all_reduce(warm)
        dist.all_gather_single(warm, warm_piece)
        dist.reduce_scatter_single(warm_piece, warm)
    for kind in kinds:
        for nbytes in sizes:
            numel = max(1, nbytes // 4)
            chunk = max(1, numel // world_size)
            numel = chunk * world_size if kind in ("allgather", "reduce_scatter") else numel
            x = torch.ones(numel)
            piece = torch.ones(chunk)
            times = []
            for i in range(warmup + repeats):
                dist.barrier()
                t0 = time.perf_counter()
                if kind == "p2p":
                    if rank == 0:
                        dist.send(x, 1)
                        dist.recv(x, 1)
                    elif rank == 1:
                        dist.recv(x, 0)
                        dist.send(x, 0)
                elif kind == "allreduce":
                    dist.all_reduce(x)
                elif kind == "allgather":
                    dist.all_gather_single(x, piece)
                elif kind == "reduce_scatter":
                    dist.reduce_scatter_single(piece, x)
                else:
                    raise ValueError(f"unknown communication kind {kind!r}; known: {', '.join(COMM_KINDS)}")
                elapsed = (time.perf_counter() - t0) * 1e3
                if i >= warmup:
                    times.append(elapsed / 2 if kind == "p2p" else elapsed)
            out[kind].append((numel * 4, statistics.median(times)))
    return out


def time_update(rank: int, world_size: int, *, sizes: Sequence[int], setup: TrainSetup, repeats: int = 5,
                warmup: int = 2, chunk_bytes: int = 4 << 20) -> list[tuple[int, float]]:
    """(bytes, median ms) of the runtime's optimizer step (`runtime.train.make_optimizer` with `setup`;
    under loss scaling, after the loss scaler's check and division of the gradients, as a training step
    runs them, with a scale of 1 so that repeats keep the same values) over `bytes` of float32 parameters
    in tensors of at most `chunk_bytes`, as a model's parameters are, with their gradients set; every
    rank at once (a barrier starts each repeat), as data-parallel replicas update together. Sizes beyond
    the caches show the memory-bound cost a training step sees."""
    from runtime.train import LossScaler, make_optimizer

    out = []
    for nbytes in sizes:
        numels = [chunk_bytes // 4] * (nbytes // chunk_bytes)
        if nbytes % chunk_bytes or not numels:
            numels.append(nbytes % chunk_bytes // 4)
        params = [torch.randn(max(1, n), requires_grad=True) for n in numels]
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer = make_optimizer(params, setup)
        scaler = LossScaler(scale=1.0, across_ranks=False) if setup.loss_scaling else None
        times = []
        for i in range(warmup + repeats):
            if world_size > 1:
                dist.barrier()
            t0 = time.perf_counter()
            if scaler is not None:
                scaler.unscale(params)
            optimizer.step()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        out.append((sum(p.numel() for p in params) * 4, statistics.median(times)))
    return out


__all__ = ["COMM_KINDS", "UNTIMED_KINDS", "PartJob", "job_for", "measure_parts", "measurement", "part_jobs",
           "time_comm", "time_jobs", "time_part", "time_update"]
