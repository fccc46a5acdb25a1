"""The search's worker processes: what a worker is given, how it runs, and the parent's side of it.

Owns `WorkerJob` (one worker's chains, as `ChainSpec`s with their starts as plain strategies, `to_plain` /
`from_plain`, plus the graph, topology, evaluator factory, budgets and temperature), `worker_main` (the
entry point of a worker process: run the job, post progress, the result or the traceback on a queue) and
`run_workers` (start one process per job, forward the workers' progress summed over them, collect their
results in job order, and raise `RuntimeError` when a worker fails or dies). A worker runs whatever chain
loop it is handed (`ChainLoop`; the search hands its own, `search.mcmc._run_chains`), so nothing here
knows the Metropolis-Hastings method.

Must not import `search.mcmc` (it imports this module), torch, the runtime or soapflow.
"""

from __future__ import annotations

import multiprocessing
import queue
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from search.evaluate import Cost, Evaluator, EvaluatorFactory
from soap.config import ParallelConfig
from soap.graph import OperatorGraph
from soap.lowering import Replicas
from soap.strategy import Strategy
from soap.topology import DeviceTopology

Progress = Callable[[Mapping[str, Any]], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class ChainSpec:
    """One chain as a worker receives it: its name, its start (a plain strategy), the seed of its random
    generator and its proposal budget (None: the time budget alone)."""

    name: str
    start: dict[str, Any]  # plain strategy (see `to_plain`)
    seed: str
    max_proposals: int | None


@dataclass(slots=True, kw_only=True)
class WorkerJob:
    """What one worker runs: the graph (`OperatorGraph.to_dict`), the topology, the evaluator factory (it
    must pickle: it carries the cost model and training setup to every simulator a worker builds), the
    chains, their budgets and the temperature."""

    graph: dict[str, Any]
    topology: DeviceTopology
    evaluators: EvaluatorFactory
    chains: list[ChainSpec]
    budget_s: float | None  # time left for this worker's chains
    stall_s: float | None
    offset_s: float  # the search's elapsed time when the worker starts
    beta_per_ms: float
    beta_scale: float
    best_ms: float  # the best baseline's time (inf if none fits): the best the worker starts from
    plain: bool = field(default=False)  # return strategies as plain dicts (to cross a process boundary)
    # strategies the module moves graft from (`search.moves`), as `to_plain` writes them
    references: list[dict[str, Any]] = field(default_factory=list)
    # the replicas every strategy of the chains is made of (`search.mcmc.search`'s `replicas`), or None
    replicas: Replicas | None = None
    # chain name -> (evaluator already started on the chain's start, its cost); in-process workers only
    started: dict[str, tuple[Evaluator, Cost]] = field(default_factory=dict)


def to_plain(strategy: Strategy) -> dict[str, Any]:
    """`strategy` as plain dicts and lists (op -> `ParallelConfig.to_dict`), to cross a process boundary."""
    return {op: cfg.to_dict() for op, cfg in strategy.items()}


def from_plain(doc: Mapping[str, Any]) -> Strategy:
    """The `Strategy` of `to_plain`'s output."""
    return Strategy({op: ParallelConfig.from_dict(cfg) for op, cfg in doc.items()})


# The loop a worker runs over its job's chains: (job, graph, progress or None) -> the worker's result.
ChainLoop = Callable[[WorkerJob, OperatorGraph, Progress | None], dict[str, Any]]


def worker_main(run: ChainLoop, job: WorkerJob, index: int, out: Any) -> None:
    """Entry point of a worker process: runs its chains with `run`, posts progress and the result on `out`."""
    try:
        graph = OperatorGraph.from_dict(job.graph)
        result = run(job, graph, lambda p: out.put(("progress", index, dict(p))))
        out.put(("done", index, result))
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the worker's traceback
        out.put(("error", index, traceback.format_exc()))


def run_workers(jobs: list[WorkerJob], run: ChainLoop, progress: Progress | None) -> list[dict[str, Any]]:
    """Run each job in its own process with the chain loop `run`; forward progress (totals over workers) to
    `progress`; the workers' results in job order."""
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker_main, args=(run, job, i, out), daemon=True) for i, job in enumerate(jobs)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    latest: dict[int, Mapping[str, Any]] = {}
    try:
        while len(results) < len(jobs):
            try:
                kind, index, payload = out.get(timeout=1.0)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in results]
                if dead and out.empty():
                    raise RuntimeError(f"search worker {dead[0]} died "
                                       f"(exit code {procs[dead[0]].exitcode})") from None
                continue
            if kind == "error":
                raise RuntimeError(f"search worker {index} failed:\n{payload}")
            if kind == "done":
                results[index] = payload
            elif progress is not None:
                latest[index] = payload
                progress({"proposals": sum(p["proposals"] for p in latest.values()),
                          "elapsed_s": max(p["elapsed_s"] for p in latest.values()),
                          "best_ms": min(p["best_ms"] for p in latest.values())})
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    return [results[i] for i in range(len(jobs))]


__all__ = ["ChainLoop", "ChainSpec", "Progress", "WorkerJob", "from_plain", "run_workers", "to_plain",
           "worker_main"]
