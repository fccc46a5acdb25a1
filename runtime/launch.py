"""Process start: spawn N local worker processes (or join a torchrun job) and set up torch.distributed.

Owns `launch` (run a function on N local ranks, return each rank's result), `init_distributed` (the
process group, always with a timeout), `torchrun_env` (detect a torchrun/elastic environment),
`keep_freed_memory` and `threads_per_rank` (the allocator setting and the intra-op threads every rank
runs with) and `LaunchError`. Imports torch and the standard library only (no simulator, no search, no
soapflow).

Failure handling: a worker that raises writes its rank, the error (the executor's message names the op
it was executing) and the traceback to a file of the launcher's and exits non-zero, printing nothing; the
launcher then kills the other workers, which would otherwise wait in a receive until their timeout, and
raises `LaunchError` with the failing rank's message (one line; the traceback is its `detail`).
"""

from __future__ import annotations

import ctypes
import datetime
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "runtime.train")


class LaunchError(RuntimeError):
    """A worker failed (or timed out); the message (one line) names the rank and what it was doing.

    `rank` is the rank blamed (None: none, as when the whole run timed out), `signal` the name of the
    signal that killed it without a word (``"SIGKILL"``: the kernel's out-of-memory killer, most often;
    None when it raised or exited) and `detail` the traceback of a rank that raised ('' otherwise)."""

    def __init__(self, message: str, *, rank: int | None = None, signal: str | None = None,
                 detail: str = "") -> None:
        super().__init__(message)
        self.rank, self.signal, self.detail = rank, signal, detail


def one_line(message: str, limit: int = 400) -> str:
    """`message` on one line (newlines folded), at most `limit` characters."""
    text = " ".join(message.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _signal_name(exitcode: int | None) -> str | None:
    """The name of the signal that ended a process with `exitcode` (None when it exited)."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _exit_reason(rank: int, exitcode: int | None) -> str:
    name = _signal_name(exitcode)
    return f"rank {rank} exited with code {exitcode}" if name is None else f"rank {rank} was killed by {name}"


def torchrun_env() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun (or another env:// launcher)."""
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def rank_device(kind: str, rank: int) -> torch.device:
    """The device rank `rank` computes on: the CPU, or for `kind` "cuda" one GPU per local rank (torchrun's
    LOCAL_RANK, else the rank, modulo the GPUs visible), made the current CUDA device.

    On a GPU, float32 means IEEE float32, as on a CPU: TF32 tensor-core math is switched off for matrix
    products and cuDNN convolutions, so a float32 run computes what single-process training on a CPU does
    and the costs measured for float32 are those of float32 kernels (bf16 is the tensor-core precision)."""
    if kind == "cpu":
        return torch.device("cpu")
    if kind != "cuda":
        raise ValueError(f"unknown device kind {kind!r}; known: cpu, cuda")
    if not torch.cuda.is_available():
        raise ValueError("no CUDA GPU is visible to this process (the nccl backend computes on GPUs; use gloo "
                         "on CPUs)")
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(device)
    exact_float32()
    return device


def exact_float32() -> None:
    """No TF32 math on GPUs in this process: float32 matrix products and cuDNN convolutions compute in
    IEEE float32 (`rank_device`)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def init_distributed(*, rank: int, world_size: int, backend: str = "gloo", init_method: str = "env://",
                     timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Initialize the default process group with a timeout (every blocking call fails after it); under
    nccl each rank first takes its GPU (`rank_device`)."""
    if backend == "nccl":
        rank_device("cuda", rank)
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# glibc's mallopt parameters (malloc.h) and the values a training process runs with: buffers up to 32 MiB
# (glibc's largest mmap threshold on 64-bit) come from the heap, and up to 1 GiB of free heap stays mapped.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_BYTES, _TRIM_THRESHOLD_BYTES = 32 << 20, 1 << 30


def threads_per_rank(nproc: int) -> int:
    """Intra-op threads for each of `nproc` ranks on this machine: its cores (those this process may run
    on) shared out evenly, at least one each.

    torch's default gives every process all the cores, so N local ranks run N times as many compute
    threads as there are cores whenever they compute at once: each kernel then waits for the scheduler,
    and a strategy that keeps every rank busy (a pipeline) loses most to one that keeps one rank busy at
    a time, which gets the idle ranks' cores. Sharing the cores out gives every strategy the same
    threads per rank (torchrun sets one per process for the same reason).
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // nproc)


def keep_freed_memory() -> bool:
    """Keep freed memory mapped in this process (glibc only; returns whether the setting took).

    By default glibc hands large freed blocks back to the kernel, so the activations of every training
    step are page-faulted in afresh: on a CPU that costs a step 5-15% (memset-speed first touches of
    every new buffer), more for the SPMD interpreter, whose per-op buffers are freed in another order than
    autograd's. Jemalloc and tcmalloc avoid it the same way, by keeping freed memory.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES))


def _worker(rank: int, world_size: int, fn: Callable[..., Any], kwargs: dict[str, Any], *, backend: str,
            init_method: str, timeout_s: float, num_threads: int | None, result_dir: str,
            reports: multiprocessing.connection.Connection | None = None) -> None:
    keep_freed_memory()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    out = Path(result_dir) / f"rank{rank}"
    if reports is not None:
        kwargs = {**kwargs, "report": reports.send}
    try:
        init_distributed(rank=rank, world_size=world_size, backend=backend, init_method=init_method,
                         timeout_s=timeout_s)
        result = fn(rank, world_size, **kwargs)
        with open(f"{out}.tmp", "wb") as f:
            pickle.dump(result, f)
        os.replace(f"{out}.tmp", f"{out}.pkl")
    except BaseException as exc:
        # The message's first line is the error, the rest its traceback (`LaunchError.detail`); nothing
        # goes to the terminal, where the command's one-line error is the whole report.
        message = one_line(f"rank {rank}: {type(exc).__name__}: {exc}")
        Path(f"{out}.err").write_text(f"{message}\n{traceback.format_exc()}")
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _root_cause(failed: list[int], procs: list[Any], pending: dict[Any, tuple[int, Any]], result_dir: Path,
                grace_s: float = 1.0) -> LaunchError:
    """The error of the rank that failed first. A rank that dies makes its peers fail moments later
    (their receives see the closed connection), so wait up to `grace_s` for those, then blame a rank that
    died without a word (a signal) or else the rank that wrote its error first."""
    end = time.monotonic() + grace_s
    while pending and time.monotonic() < end:
        for sentinel in multiprocessing.connection.wait(list(pending), timeout=max(0.0, end - time.monotonic())):
            rank, p = pending.pop(sentinel)
            p.join()
            if p.exitcode != 0:
                failed.append(rank)
    errors = {rank: result_dir / f"rank{rank}.err" for rank in failed}
    silent = [rank for rank in failed if not errors[rank].exists()]
    if silent:
        rank = min(silent)
        exitcode = procs[rank].exitcode
        return LaunchError(one_line(f"{_exit_reason(rank, exitcode)} (no error message; the other ranks were "
                                    "stopped)"), rank=rank, signal=_signal_name(exitcode))
    rank = min(failed, key=lambda r: (errors[r].stat().st_mtime_ns, r))
    message, _, detail = errors[rank].read_text().partition("\n")
    return LaunchError(message, rank=rank, detail=detail)


def launch(fn: Callable[..., Any], nproc: int, *, kwargs: dict[str, Any] | None = None, backend: str = "gloo",
           timeout_s: float = DEFAULT_TIMEOUT_S, wall_timeout_s: float | None = None,
           num_threads: int | None = None, start_method: str = "forkserver",
           progress: Callable[[Any], None] | None = None) -> list[Any]:
    """Run `fn(rank, world_size, **kwargs)` in `nproc` local processes with torch.distributed initialized
    (loopback TCP rendezvous); returns the results in rank order.

    `fn` and `kwargs` must pickle (a module-level function; `functools.partial` of one). `timeout_s`
    bounds every collective and receive; `wall_timeout_s` (None: no bound) the whole run. When a worker
    fails the others are killed and `LaunchError` names the failing rank. Each rank computes with
    `num_threads` intra-op threads (None: `threads_per_rank(nproc)`). With `progress`, `fn` also gets
    the keyword argument `report`: what a rank passes to it (a picklable value) reaches `progress` here, in
    the calling process, as it arrives.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be positive, got {nproc}")
    if num_threads is None:
        num_threads = threads_per_rank(nproc)
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # The fork server imports these once; every worker forked from it starts with them loaded.
        # torch.optim imports torch._dynamo on first use, which takes seconds per process otherwise.
        ctx.set_forkserver_preload(list(PRELOAD))
    init_method = f"tcp://127.0.0.1:{free_port()}"
    reader, writer = ctx.Pipe(duplex=False) if progress is not None else (None, None)
    with tempfile.TemporaryDirectory(prefix="soapflow-run-") as result_dir:
        procs = [ctx.Process(target=_worker, args=(rank, nproc, fn, dict(kwargs or {})),
                             kwargs={"backend": backend, "init_method": init_method, "timeout_s": timeout_s,
                                     "num_threads": num_threads, "result_dir": result_dir, "reports": writer},
                             daemon=False)
                 for rank in range(nproc)]
        for p in procs:
            p.start()
        if writer is not None:
            writer.close()  # the workers hold the only writing ends: the reader sees the end when they exit
        deadline = None if wall_timeout_s is None else time.monotonic() + wall_timeout_s
        failure: LaunchError | None = None
        pending = {p.sentinel: (rank, p) for rank, p in enumerate(procs)}
        try:
            while pending and failure is None:
                wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready = multiprocessing.connection.wait(list(pending) + ([reader] if reader is not None else []),
                                                        timeout=wait_s)
                if not ready:
                    failure = LaunchError(f"the run exceeded {wall_timeout_s} s")
                    break
                if reader is not None and reader in ready:
                    ready.remove(reader)
                    try:
                        progress(reader.recv())
                    except EOFError:  # every worker has exited
                        reader.close()
                        reader = None
                failed = []
                for sentinel in ready:
                    rank, p = pending.pop(sentinel)
                    p.join()
                    if p.exitcode != 0:
                        failed.append(rank)
                if failed:
                    failure = _root_cause(failed, procs, pending, Path(result_dir))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join()
            if reader is not None:
                reader.close()
        if failure is not None:
            raise failure
        results = []
        for rank in range(nproc):
            with open(Path(result_dir) / f"rank{rank}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results
