"""`run`: train a model under a strategy in N processes and measure it; what `soapflow run` calls.

A thin composition: capture the model once here, resolve the strategy (a baseline or a strategy file)
against the `cpu-N` topology and the caller's training setup (`soap.setup.TrainSetup`), then start one
process per device (`runtime.launch`) that trains with that setup and the SPMD interpreter
(`runtime.train.train_rank`). Under torchrun (the env:// variables set) this process is
one rank of the job instead and trains in place. A failing rank surfaces as `runtime.launch.LaunchError`
(one line naming the rank and, when known, the op); a rank the operating system killed (SIGKILL, no
message) is reported as most likely out of memory, with the memory model's estimate of the step
(`soap.lowering`). docs/runtime.md describes checkpoints and failures.
"""

from __future__ import annotations

import functools
import os
import statistics
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runtime.checkpoint import check_resumable, checkpoint_path, checkpoint_step, find_checkpoints, read_info
from runtime.launch import (
    DEFAULT_TIMEOUT_S,
    LaunchError,
    init_distributed,
    keep_freed_memory,
    launch,
    one_line,
    torchrun_env,
)
from runtime.train import TrainOptions, Workload, train_rank
from soap.files import unwritable_reason
from soap.graph import OperatorGraph
from soap.lowering import lower
from soap.setup import TrainSetup
from soap.strategy import Strategy, read_strategy_doc, setup_differences
from soap.topology import load_topology
from soapflow.api import capture_model, resolve_strategy, strategy_batch
from soapflow.models import default_loss, load_model

BACKENDS = ("gloo", "nccl")
FAULT_ENV = "SOAPFLOW_TEST_FAULT"


def build_workload(ref: str, batch_size: int) -> Workload:
    """The model `ref` at `batch_size` as the runtime needs it (module-level, so that it pickles into
    the worker processes: each rebuilds the same weights from the model's seed)."""
    spec = load_model(ref, batch_size)
    return Workload(module=spec.module, inputs=spec.inputs, target=spec.target,
                    loss_fn=spec.loss_fn or default_loss)


def _num_devices(strategy_ref: str, nproc: int | None) -> int:
    if nproc is not None:
        if nproc < 1:
            raise ValueError(f"--nproc must be positive, got {nproc}")
        return nproc
    if Path(strategy_ref).is_file():
        found = read_strategy_doc(strategy_ref).get("num_devices")
        if isinstance(found, int) and found > 0:
            return found
    return 2


def _fault_hook() -> tuple[str, int, int] | None:
    """The test hook `SOAPFLOW_TEST_FAULT=KIND:RANK:STEP` (KIND: raise or kill), read here, in the caller,
    and passed to the ranks explicitly."""
    value = os.environ.get(FAULT_ENV)
    if not value:
        return None
    kind, _, rest = value.partition(":")
    rank, _, step = rest.partition(":")
    if not (rank.isdigit() and step.isdigit()):
        raise ValueError(f"{FAULT_ENV} must be KIND:RANK:STEP, got {value!r}")
    return kind, int(rank), int(step)


def run(model_ref: str, strategy_ref: str, *, nproc: int | None = None, steps: int = 10,
        backend: str = "gloo", verify: bool = False, batch: int | None = None, setup: TrainSetup | None = None,
        seed: int = 0, dtype: str = "float32", timeout_s: float = DEFAULT_TIMEOUT_S,
        num_threads: int | None = None, checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int = 0, resume: bool = False) -> dict[str, Any]:
    """Train `model_ref` under `strategy_ref` for `steps` steps in `nproc` processes (one per device), with
    the training `setup` (optimizer, learning rate, buckets; None: `TrainSetup()`).

    Returns `losses` (per step run), `first_step` (0, or the step a resumed run started at),
    `skipped_steps` (the steps whose update fp16's loss scaler skipped, a gradient being inf or NaN),
    `step_time_ms` (the median step time of each rank, in rank order), `step_times_ms` (every rank's
    list), `iteration_time_ms` (median over steps of the slowest rank's time), `collectives` (per rank,
    per kind, the count and bytes of the collectives its last step issued: `StepPlan.collectives`'
    shape), `verify` (against single-process training, `runtime.train.compare`: `passed`,
    `max_loss_rel_diff`, `max_param_rel_diff` (of each parameter's update), `max_param_abs_diff`, ...; None
    unless `verify`), `checkpoint` (the checkpoint directory this run wrote last, or resumed from when it
    ran no step; None without `checkpoint_dir`), `resumed_from` (the checkpoint it resumed from, or None),
    and the resolved `nproc`, `batch_size`, `steps`, `strategy`,
    `setup`. `nproc` defaults to the strategy file's device count, else 2; `batch` to the strategy file's
    batch size, else the model's (`soapflow.api.strategy_batch`).

    `checkpoint_dir` receives a checkpoint (a directory; each rank writes the pieces it holds) every
    `checkpoint_every` steps and after the last; `resume` continues from its newest complete checkpoint
    (saved under any strategy and process count; one saved for another model, optimizer or `seed` is refused,
    and so is a directory that holds checkpoints none of which is complete; an empty one starts from step 0
    with a warning). Every process group has the timeout `timeout_s`. Bad input raises `ValueError` (one
    line); a rank that fails or dies raises `LaunchError` (a RuntimeError, one line naming the rank and, when
    known, the op).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend nccl computes on CUDA GPUs and none is visible here; use gloo on CPUs")
    if checkpoint_dir is None and (checkpoint_every or resume):
        raise ValueError("checkpoint_every and resume need checkpoint_dir")
    if checkpoint_dir is not None and (reason := unwritable_reason(checkpoint_dir)) is not None:
        raise ValueError(f"cannot write checkpoints in {os.fspath(checkpoint_dir)!r}: {reason}")
    setup = setup if setup is not None else TrainSetup()
    resume_from = None
    if resume:
        found, broken = find_checkpoints(checkpoint_dir)
        if found is None and broken:
            raise ValueError(f"cannot resume: {checkpoint_dir} holds no complete checkpoint ("
                             + "; ".join(f"{path.name}: {problem}" for path, problem in broken) + ")")
        for path, problem in broken:
            warnings.warn(f"ignoring checkpoint {path.name}: {problem}", stacklevel=2)
        if found is None:
            warnings.warn(f"no checkpoint in {checkpoint_dir}: starting from step 0", stacklevel=2)
        elif checkpoint_step(found) > steps:
            raise ValueError(f"the newest checkpoint in {checkpoint_dir} is at step {checkpoint_step(found)}, "
                             f"past the {steps} steps asked for")
        else:
            resume_from = str(found)
    options = TrainOptions(steps=steps, setup=setup, seed=seed, dtype=dtype, verify=verify, timeout_s=timeout_s,
                           checkpoint_dir=None if checkpoint_dir is None else str(checkpoint_dir),
                           checkpoint_every=checkpoint_every, resume_from=resume_from, fault=_fault_hook(),
                           device="cuda" if backend == "nccl" else "cpu")
    env = torchrun_env()
    world = env[1] if env is not None else _num_devices(strategy_ref, nproc)
    if env is not None and nproc is not None and nproc != world:
        raise ValueError(f"--nproc {nproc} disagrees with torchrun's WORLD_SIZE {world}")
    if backend == "nccl" and env is None and world > torch.cuda.device_count():
        raise ValueError(f"backend nccl runs one process per GPU: {world} processes need {world} GPUs, this "
                         f"machine has {torch.cuda.device_count()}")
    spec, graph = capture_model(model_ref, batch_size=strategy_batch([strategy_ref], batch=batch))
    if resume_from is not None:
        info = read_info(resume_from)
        check_resumable(resume_from, info, graph=graph.name, fingerprint=graph.fingerprint,
                        optimizer=setup.optimizer, seed=seed)
        differ = setup_differences({**info.meta.get("setup", {}), "dtype": info.meta.get("dtype", dtype)},
                                   {**setup.to_dict(), "dtype": dtype}, where="there")
        if differ:  # a deliberate change (a new learning rate, say) is allowed, but said
            warnings.warn(f"resuming checkpoint {Path(resume_from).name}, saved with another training setup: "
                          + "; ".join(differ), stacklevel=2)
    topology = load_topology(f"cpu-{world}")
    strategy = resolve_strategy(strategy_ref, graph=graph, topology=topology, setup=setup, processes=True)
    kwargs = {"build": functools.partial(build_workload, model_ref, spec.batch_size),
              "graph": graph.to_dict(),
              "strategy": {name: cfg.to_dict() for name, cfg in strategy.items()},
              "options": options}
    if env is not None:
        results = [run_torchrun_rank(env[0], world, backend=backend, timeout_s=timeout_s,
                                     num_threads=num_threads, kwargs=kwargs)]
    else:
        try:
            results = launch(train_rank, world, kwargs=kwargs, backend=backend, timeout_s=timeout_s,
                             num_threads=num_threads)
        except LaunchError as exc:
            if exc.signal != "SIGKILL":
                raise
            raise LaunchError(killed_message(exc.rank, graph=graph, strategies=[strategy], setup=setup,
                                             world=world), rank=exc.rank, signal=exc.signal) from None
    first = results[0]
    per_rank = first["step_time_ms_per_rank"]
    # every step run ends in a checkpoint after the last (`runtime.train.train_rank`)
    newest = (checkpoint_path(checkpoint_dir, steps) if checkpoint_dir is not None and first["first_step"] < steps
              else resume_from)
    return {
        "model": model_ref,
        "strategy": strategy_ref,
        "nproc": world,
        "backend": backend,
        "batch_size": spec.batch_size,
        "steps": steps,
        "setup": setup.to_dict(),
        "first_step": first["first_step"],
        "losses": first["losses"],
        "skipped_steps": first["skipped_steps"],
        "step_time_ms": first["median_step_time_ms_per_rank"],
        "step_times_ms": per_rank,
        "collectives": first["collectives"],
        "verify": (None if "verify" not in first
                   else {k: v for k, v in first["verify"].items()}),
        "rank": env[0] if env is not None else None,
        "iteration_time_ms": (statistics.median(max(ts) for ts in zip(*per_rank, strict=True))
                              if first["losses"] else None),
        "checkpoint": None if newest is None else str(newest),
        "resumed_from": resume_from,
    }


def killed_message(rank: int | None, *, graph: OperatorGraph, strategies: Sequence[Strategy], setup: TrainSetup,
                   world: int) -> str:
    """What to say when rank `rank` of a `world`-process job training `graph` under `strategies` (a
    replica each, held at once) was killed by SIGKILL without a word: the kernel's out-of-memory killer
    sends it, so the memory model's estimate of the step (the lowering's `StepPlan.memory_bytes`, summed
    over the strategies, the largest device's) beside this machine's memory."""
    per_device = [sum(m) for m in zip(*(lower(graph, s, setup, world).memory_bytes() for s in strategies),
                                      strict=True)]
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    what = "this strategy" if len(strategies) == 1 else f"these {len(strategies)} strategies together"
    return (f"rank {rank} was killed by the operating system (SIGKILL), most likely out of memory: the memory "
            f"model estimates {_human_bytes(max(per_device))} per process for {what}, this machine has "
            f"{_human_bytes(have)} for {world} process{'es' if world > 1 else ''}; try a smaller --batch")


def _human_bytes(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError


def run_torchrun_rank(rank: int, world: int, *, backend: str, timeout_s: float, num_threads: int | None,
                      kwargs: dict[str, Any]) -> dict[str, Any]:
    """This process is rank `rank` of a torchrun job: train in place; failures become `LaunchError`."""
    keep_freed_memory()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    init_distributed(rank=rank, world_size=world, backend=backend, timeout_s=timeout_s)
    try:
        return train_rank(rank, world, **kwargs)
    except Exception as exc:
        raise LaunchError(one_line(f"rank {rank}: {type(exc).__name__}: {exc}")) from exc
    finally:
        dist.destroy_process_group()
