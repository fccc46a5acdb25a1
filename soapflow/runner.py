"""`run`: train a model under a strategy in N processes and measure it; what `soapflow run` calls.

A thin composition: capture the model once here, resolve the strategy (a baseline or a strategy file)
against the `cpu-N` topology, then start one process per device (`runtime.launch`) that trains with the
SPMD interpreter (`runtime.train.train_rank`). Under torchrun (the env:// variables set) this process is
one rank of the job instead and trains in place.
"""

from __future__ import annotations

import functools
import statistics
from pathlib import Path
from typing import Any

import torch

from runtime.launch import DEFAULT_TIMEOUT_S, init_distributed, launch, torchrun_env
from runtime.train import TrainOptions, Workload, train_rank
from soap.strategy import read_strategy_doc
from soap.topology import load_topology
from soapflow.api import capture_model, resolve_strategy
from soapflow.models import default_loss, load_model

BACKENDS = ("gloo", "nccl")


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


def run(model_ref: str, strategy_ref: str, *, nproc: int | None = None, steps: int = 10,
        backend: str = "gloo", verify: bool = False, batch: int | None = None, lr: float = 0.01,
        optimizer: str = "sgd", seed: int = 0, momentum: float = 0.0, dtype: str = "float32",
        timeout_s: float = DEFAULT_TIMEOUT_S, num_threads: int | None = None) -> dict[str, Any]:
    """Train `model_ref` under `strategy_ref` for `steps` steps in `nproc` processes (one per device).

    Returns `losses` (per step), `step_time_ms` (the median step time of each rank, in rank order),
    `verify` (`max_loss_rel_diff`, `max_param_rel_diff` against single-process training; None unless
    `verify`), and the resolved `nproc`, `batch_size`, `steps`, `strategy`. `nproc` defaults to the
    strategy file's device count, else 2. Bad input raises `ValueError` (one line).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend nccl needs CUDA devices; this machine has none (use gloo)")
    if backend == "nccl":
        raise ValueError("backend nccl is not supported yet: the runtime computes on CPU tensors (use gloo)")
    options = TrainOptions(steps=steps, lr=lr, optimizer=optimizer, momentum=momentum, seed=seed,
                           dtype=dtype, verify=verify, timeout_s=timeout_s)
    env = torchrun_env()
    world = env[1] if env is not None else _num_devices(strategy_ref, nproc)
    if env is not None and nproc is not None and nproc != world:
        raise ValueError(f"--nproc {nproc} disagrees with torchrun's WORLD_SIZE {world}")
    spec, graph = capture_model(model_ref, batch_size=batch)
    topology = load_topology(f"cpu-{world}")
    strategy = resolve_strategy(strategy_ref, graph=graph, topology=topology)
    kwargs = {"build": functools.partial(build_workload, model_ref, spec.batch_size),
              "graph": graph.to_dict(),
              "strategy": {name: cfg.to_dict() for name, cfg in strategy.items()},
              "options": options}
    if env is not None:
        init_distributed(rank=env[0], world_size=world, backend=backend, timeout_s=timeout_s)
        results = [train_rank(env[0], world, **kwargs)]
    else:
        results = launch(train_rank, world, kwargs=kwargs, backend=backend, timeout_s=timeout_s,
                         num_threads=num_threads)
    first = results[0]
    return {
        "model": model_ref,
        "strategy": strategy_ref,
        "nproc": world,
        "backend": backend,
        "batch_size": spec.batch_size,
        "steps": steps,
        "losses": first["losses"],
        "step_time_ms": first["median_step_time_ms_per_rank"],
        "step_times_ms": [r["step_time_ms"] for r in results],
        "verify": (None if "verify" not in first
                   else {k: v for k, v in first["verify"].items()}),
        "rank": env[0] if env is not None else None,
        "iteration_time_ms": statistics.median(max(ts) for ts in zip(*[r["step_time_ms"] for r in results],
                                                                      strict=True)),
    }
