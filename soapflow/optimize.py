"""`optimize` and `compare`: what `soapflow optimize` and `soapflow compare` call.

`optimize` is the stages in order: capture the model, load the topology, search (`search.mcmc`, with the
simulator's delta simulation costing proposals), export the best strategy file, then simulate the best once
more in full for its per-device summary. With `measure_rounds` on a machine profile of this machine, the
search is followed by up to that many rounds of: time the op parts of the best strategy and of the
baselines that the profile's cost database lacks (`runtime.measure`), then search again on the grown
database; a search favours the strategies its cost model is most optimistic about, and this prices the
one it recommends from measurements instead of the analytical fallback. With `confirm_runs` on a
``cpu-N`` topology (or a machine profile of this machine), the search's best and every feasible baseline
are then trained here (`compare` with `measure`: `confirm_runs` interleaved runs each) and the fastest
measured is the strategy written: the simulator's error on this machine (about 10%, docs/calibration.md)
is larger than the gap between close candidates, and a user asked to train with a strategy should get the
one that measured fastest. The report's `confirmed` says what each measured and which was chosen.

Both take the training setup (`soap.setup.TrainSetup`) of the command: every simulation, the search's
evaluators, the strategy file written (which records it) and every measured run use that one value.
On a preset whose GPU kind has a cost database shipped with soapflow (`simulator.shipped`), both price the
op parts it holds from it (`shipped_costs=False`: analytically only), and their reports' `shipped_costs`
({device_kinds, num_parts}, or None) says so.

`compare` simulates a list of strategies (baselines or strategy files) and, on a ``cpu-N`` topology (or a
machine profile of this machine) with `measure`, runs each with the runtime (`soapflow.runner.run`) to set
measured times beside the simulated ones.

Both return plain JSON-able dicts whose keys the README lists as stable (`optimize`: best
{iteration_time_ms, strategy_file}, baselines, speedup_vs_dp, num_proposals, proposals_per_s, elapsed_s,
history; `compare`: rows of {strategy, simulated_ms, measured_ms, error, speedup_vs_dp}).
`soapflow.report` turns them into the text the command prints and, with `plot`, into a PNG drawn with
matplotlib (the optional extra `plot`, checked for before any work): the convergence of the best for
`optimize`, simulated and measured times side by side for `compare`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from runtime.measure import measure_parts, part_jobs
from search.baselines import BASELINES, BaselineNotApplicable
from search.bound import lower_bound
from search.evaluate import SimulatorEvaluators
from search.mcmc import DEFAULT_BETA_SCALE, SearchResult, check_budgets, replica_layout, search
from simulator.calibration import MachineProfile, read_profile
from simulator.engine import simulate
from simulator.shipped import shipped_report
from soap import costdb
from soap.graph import OperatorGraph
from soap.setup import TrainSetup
from soap.strategy import save_strategy
from soap.topology import DeviceTopology, load_topology
from soapflow.api import capture_model, resolve_strategy
from soapflow.plot import require_matplotlib
from soapflow.report import strategy_summary, write_compare_plot, write_convergence_plot

DEFAULT_BUDGET_S = 60.0


def optimize(model_ref: str, topology_ref: str, *, batch: int | None = None,
             budget_s: float | None = DEFAULT_BUDGET_S, seed: int = 0, jobs: int = 1,
             max_proposals: int | None = None, out_path: str | os.PathLike | None = None,
             progress: Callable[[Mapping[str, Any]], None] | None = None,
             plot: str | os.PathLike | None = None, cost_model: Any = None, delta: bool = True,
             beta_scale: float = DEFAULT_BETA_SCALE, random_chains: int = 1,
             measure_rounds: int = 0, confirm_runs: int = 0, confirm_steps: int = 10,
             setup: TrainSetup | None = None, shipped_costs: bool = True,
             replicas: int | None = None, replica_phase: bool = True) -> dict[str, Any]:
    """Search a strategy for `model_ref` on `topology_ref` for the training `setup` (None: `TrainSetup()`)
    and write it to `out_path`.

    `out_path` defaults to ``strategy-<model>-<topology>.json`` in the current folder. `budget_s` (wall
    clock, seconds) and `max_proposals` bound the search (either may be None, not both); only a proposal
    budget makes the result reproducible across machines. `delta=False` costs every proposal with a full
    simulation (for measuring what delta simulation buys). `cost_model`: see `topology_and_cost_model`
    (a cost model, a cost database path, or None: a machine profile's calibration, else analytical);
    `shipped_costs=False` prices op parts on a preset analytically only, ignoring the cost database shipped
    for its GPU kind (`simulator.shipped`); the report's `shipped_costs` says what that database priced.
    `replicas`: the chains search only strategies made of that many identical replicas, each simulated by
    one replica (`search.mcmc.search`; faster proposals in a smaller space; the report's `replicas`).
    `replica_phase=False`: no replica phase first where no baseline fits (`search.mcmc.search`; the report's
    `replica_phase` is its replica count, 0 without one, and `replica_phase_proposals` its proposals).
    `progress` is called with {proposals, proposals_per_s, elapsed_s, best_ms} about twice a second.
    Bad input raises `ValueError` (one line): a budget <= 0, an unknown model or topology; a search in which
    nothing fits in memory raises `search.mcmc.NoFeasibleStrategy` (a `ValueError` naming the smallest
    memory need seen). Where data parallelism is not defined (the batch does not divide over the devices)
    the search runs without it and `baselines["dp"]` and `speedup_vs_dp` are None.
    `measure_rounds` (see the module docstring) needs `topology_ref` to be a machine profile of this
    machine's CPU processes with a cost database, and no `cost_model`; each round searches again with the
    same budget. The report's `measured` says how many rounds searched again, how many parts were timed
    and how many parts of the final best are still priced without a measurement. `confirm_runs` (see the
    module docstring) runs each candidate `confirm_runs` times for `confirm_steps` steps.
    """
    check_budgets(budget_s=budget_s, max_proposals=max_proposals, jobs=jobs)
    if plot is not None:
        require_matplotlib()  # before the search, not after it
    setup = setup if setup is not None else TrainSetup()
    if confirm_runs < 0 or confirm_steps < 1:
        raise ValueError(f"--confirm-runs must be >= 0 and its steps >= 1, got {confirm_runs}, {confirm_steps}")
    profile = _profile_to_measure(topology_ref, cost_model) if measure_rounds > 0 else None
    topology, cost_model = topology_and_cost_model(topology_ref, cost_model,  # fails fast, before capture
                                                   shipped_costs=shipped_costs)
    replica_layout(topology, replicas)  # (likewise)
    if confirm_runs > 0 and any(d.kind != "cpu" for d in topology.devices):
        raise ValueError(f"--confirm-runs trains the candidates on this machine: the topology must be cpu-N or a "
                         f"machine profile of this machine, got {topology.name!r}")
    spec, graph = capture_model(model_ref, batch_size=batch)

    def run_search(model: Any) -> SearchResult:
        return search(graph, topology, evaluators=SimulatorEvaluators(cost_model=model, delta=delta, setup=setup),
                      budget_s=budget_s, max_proposals=max_proposals, seed=seed, jobs=jobs,
                      beta_scale=beta_scale, random_chains=random_chains, replicas=replicas,
                      replica_phase=replica_phase, progress=progress)

    result = run_search(cost_model)
    measured = {"rounds": 0, "parts_timed": 0}
    if profile is not None:
        kind = topology.devices[0].kind
        for _ in range(measure_rounds):
            candidates = [result.best] + [BASELINES[name](graph, topology)
                                          for name, cost in result.baselines.items() if cost is not None]
            db, timed = measure_parts(part_jobs(graph, candidates, device_kind=kind), profile.costdb,
                                      device_kind=kind, nproc=topology.num_devices, source="optimize")
            measured["parts_timed"] += timed
            if timed == 0:
                break  # the best and the baselines are priced from measurements already
            measured["rounds"] += 1
            cost_model = profile.cost_model(db)
            result = run_search(cost_model)
        measured["best_parts_unmeasured"] = sum(
            1 for job in part_jobs(graph, [result.best], device_kind=kind)
            if db.lookup(costdb.part_key(job.operator(), job.box, kind, job.needs_grad)) is None)
    path = Path(out_path) if out_path is not None else Path(f"strategy-{_slug(spec.name)}-{_slug(topology.name)}.json")
    save_strategy(path, result.best, graph, topology=topology.name, num_devices=topology.num_devices,
                  setup=setup, model=spec.name, predicted_ms=result.best_cost.time_ms)
    confirmed = None
    if confirm_runs > 0:
        result, confirmed = _confirm(result, model_ref=model_ref, topology_ref=topology_ref, graph=graph,
                                     topology=topology, path=path, batch=batch, rounds=confirm_runs,
                                     steps=confirm_steps, cost_model=cost_model, setup=setup)
        if confirmed["chosen"] != "search":
            save_strategy(path, result.best, graph, topology=topology.name, num_devices=topology.num_devices,
                          setup=setup, model=spec.name, predicted_ms=result.best_cost.time_ms)
    out = search_report(result, graph=graph, topology=topology, strategy_file=os.fspath(path),
                        cost_model=cost_model, setup=setup)
    out = {"model": spec.name, "topology": topology.name, "num_devices": topology.num_devices,
           "batch_size": graph.batch_size, "setup": setup.to_dict(), "seed": seed, "budget_s": budget_s,
           "max_proposals": max_proposals, "jobs": jobs, "delta": delta, "replicas": result.replicas,
           "replica_phase": result.replica_phase, "replica_phase_proposals": result.replica_phase_proposals,
           "measured": measured,
           "confirmed": confirmed, "shipped_costs": shipped_report(cost_model), **out}
    if plot is not None:
        write_convergence_plot(plot, out, title=f"{spec.name} on {topology.name}")
        out["plot"] = os.fspath(plot)
    return out


def _confirm(result: SearchResult, *, model_ref: str, topology_ref: str | os.PathLike, graph: OperatorGraph,
             topology: DeviceTopology, path: Path, batch: int | None, rounds: int, steps: int,
             cost_model: Any, setup: TrainSetup) -> tuple[SearchResult, dict[str, Any]]:
    """Train the search's best (written at `path`) and every feasible baseline that differs from it,
    `rounds` interleaved runs each; the result with the fastest measured as its best, and the report."""
    names = []
    for name, cost in result.baselines.items():
        if cost is not None and cost.feasible and BASELINES[name](graph, topology) != result.best:
            names.append(name)
    table = compare(model_ref, os.fspath(topology_ref), strategies=[os.fspath(path), *names], batch=batch,
                    measure=True, steps=steps, repeats=rounds, cost_model=cost_model, baselines=False, setup=setup)
    label = {os.fspath(path): "search", **{n: n for n in names}}
    measured = [r for r in table["rows"] if r["measured_ms"] is not None]
    runs = {label[r["strategy"]]: r["measured_runs_ms"] for r in measured}
    medians = {label[r["strategy"]]: r["measured_ms"] for r in measured}  # compare's median of the runs
    chosen = min(medians, key=lambda k: (medians[k], k != "search"))  # a tie keeps the search's best
    report = {"rounds": rounds, "steps": steps, "measured_ms": medians, "runs_ms": runs, "chosen": chosen}
    if chosen == "search":
        return result, report
    best = BASELINES[chosen](graph, topology)
    source = (f"the {chosen} baseline (measured {medians['search'] / medians[chosen]:.2f}x faster than the "
              "search's best)")
    return dataclasses.replace(result, best=best, best_cost=result.baselines[chosen], best_source=source), report


def _profile_to_measure(topology_ref: str | os.PathLike, cost_model: Any) -> MachineProfile:
    """The machine profile whose cost database measurement rounds grow (bad input: `ValueError`)."""
    profile = read_profile(topology_ref) if Path(topology_ref).is_file() else None
    if profile is None or profile.costdb is None or cost_model is not None:
        raise ValueError("measuring op parts needs -t to be a machine profile of this machine (soapflow calibrate) "
                         "with its cost database, and no --costdb")
    if any(d.kind != "cpu" for d in profile.topology.devices):
        raise ValueError("measuring op parts times them in local CPU processes: the profile must describe "
                         "this machine's CPU processes")
    return profile


def search_report(result: SearchResult, *, graph: OperatorGraph, topology: DeviceTopology,
                  strategy_file: str | None, setup: TrainSetup, cost_model: Any = None) -> dict[str, Any]:
    """The JSON-able report of a search (the keys of `optimize` without the run's settings).

    `table` has one row per strategy (the best first, then every baseline): `strategy`,
    `iteration_time_ms` (simulated; None where not applicable), `speedup_vs_dp`, `peak_memory_bytes`
    (the largest per-device peak), `feasible` and `note`.
    """
    baselines = result.baseline_ms()
    capacity = min(d.memory_bytes for d in topology.devices)
    notes = dict(result.baseline_errors)
    for name, cost in result.baselines.items():
        if cost is not None and not cost.feasible:
            notes[name] = (f"out of memory: needs {cost.peak_memory_bytes / 1e9:.3g} GB on one device, "
                           f"has {capacity / 1e9:.3g} GB")
    best_ms = result.best_cost.time_ms
    dp_ms = baselines.get("dp")
    feasible = [ms for ms in baselines.values() if ms is not None]
    summary = strategy_summary(graph, result.best, topology, cost_model=cost_model, setup=setup)
    best_peak = max(summary["peak_memory_bytes"], default=0)
    bound_start = time.monotonic()
    bound = lower_bound(graph, topology, cost_model=cost_model, setup=setup)
    bound_s = time.monotonic() - bound_start
    table = [{"strategy": "best", "iteration_time_ms": best_ms, "speedup_vs_dp": dp_ms / best_ms if dp_ms else None,
              "peak_memory_bytes": best_peak, "feasible": True, "note": f"found by {result.best_source}"}]
    for name, cost in result.baselines.items():
        ms = baselines[name]
        table.append({"strategy": name, "iteration_time_ms": ms,
                      "speedup_vs_dp": dp_ms / ms if dp_ms and ms else None,
                      "peak_memory_bytes": cost.peak_memory_bytes if cost is not None else None,
                      "feasible": cost.feasible if cost is not None else None, "note": notes.get(name)})
    return {
        "best": {"iteration_time_ms": best_ms, "strategy_file": strategy_file, "source": result.best_source,
                 "peak_memory_bytes": summary["peak_memory_bytes"]},
        "baselines": baselines,
        "baseline_notes": notes,
        "speedup_vs_dp": dp_ms / best_ms if dp_ms else None,
        "speedup_vs_best_baseline": min(feasible) / best_ms if feasible else None,
        "lower_bound": {"time_ms": bound.time_ms, "work_ms": bound.work_ms, "path_ms": bound.path_ms,
                        "gap": bound.gap(best_ms), "elapsed_s": bound_s},
        "table": table,
        "num_proposals": result.num_proposals,
        "proposals_per_s": result.proposals_per_s,
        "costed_per_s": result.costed_per_s,
        "elapsed_s": result.elapsed_s + bound_s,  # (the bound is worked out after the search's budget)
        "search_s": result.search_s,
        "beta_per_ms": result.beta_per_ms,
        "history": [[i, t, ms] for i, t, ms in result.history],
        "chains": [{"name": c.name, "start_ms": _finite(c.start_ms), "best_ms": _finite(c.best_ms),
                    "num_proposals": c.num_proposals, "num_accepted": c.num_accepted, "num_null": c.num_null,
                    "stop": c.stop}
                   for c in result.chains],
        "strategy": summary,
    }


def topology_and_cost_model(topology_ref: str | os.PathLike, cost_model: Any = None, *,
                            shipped_costs: bool = True) -> tuple[DeviceTopology, Any]:
    """The topology `topology_ref` names and the cost model to simulate on it.

    `cost_model` may be a cost model (used as is), a cost database path (JSON lines: measured op parts,
    analytical fallback), or None. For a machine profile (`soapflow calibrate`'s topology file with a
    calibration) and no cost model object, the profile's calibrated model is used. For a preset whose GPU
    kind has a cost database shipped with soapflow (`simulator.shipped`), that database prices the parts
    it holds (under the given database's), unless `shipped_costs` is False. Otherwise None means the
    simulator's analytical default.
    """
    if cost_model is not None and not isinstance(cost_model, str | os.PathLike):
        return load_topology(topology_ref), cost_model
    from simulator.calibration import cost_model_for

    if cost_model is not None and not Path(cost_model).is_file():
        raise ValueError(f"cost database {os.fspath(cost_model)!r} not found")
    return cost_model_for(topology_ref, db=None if cost_model is None else os.fspath(cost_model),
                          shipped=shipped_costs)


# ----------------------------------------------------------------------------------------------- compare


def compare(model_ref: str, topology_ref: str, *, strategies: Sequence[str] | None = None,
            batch: int | None = None, measure: bool = False, steps: int = 10, repeats: int = 1,
            plot: str | os.PathLike | None = None, cost_model: Any = None, baselines: bool = True,
            setup: TrainSetup | None = None, shipped_costs: bool = True) -> dict[str, Any]:
    """Simulate the baselines (unless `baselines` is False) and each given strategy (baseline names or
    strategy files) with the training `setup` (None: `TrainSetup()`) and, with
    `measure` on a ``cpu-N`` topology, train with it for `steps` steps in N processes (`soapflow.runner`)
    and put the measured iteration time beside the simulated one.

    With `repeats` > 1 every strategy is measured that many times, the strategies interleaved (round
    robin, so that a slow spell of a shared machine hits them alike), and `measured_ms` is the median.
    Rows: `strategy`, `simulated_ms`, `measured_ms`, `error` ((simulated - measured) / measured),
    `speedup_vs_dp` (dp's time over the row's: measured when measuring, else simulated; None where dp is
    not defined or not listed), plus `simulated_speedup_vs_dp`, `measured_runs_ms`, `feasible`, `note`.
    `cost_model` and `shipped_costs`: as for `optimize`.
    """
    refs = list(dict.fromkeys([*(BASELINES if baselines else ()), *(strategies or ())]))  # each once
    if not refs:
        raise ValueError("compare needs at least one strategy")
    if plot is not None:
        require_matplotlib()
    setup = setup if setup is not None else TrainSetup()
    topology, cost_model = topology_and_cost_model(topology_ref, cost_model, shipped_costs=shipped_costs)
    nproc = None
    if measure:
        if any(d.kind != "cpu" for d in topology.devices):
            raise ValueError(f"--measure runs on this machine: the topology must be cpu-N or a machine profile "
                             f"of this machine, got {topology.name!r}")
        nproc = topology.num_devices
        if steps < 1:
            raise ValueError(f"--steps must be positive, got {steps}")
        if repeats < 1:
            raise ValueError(f"repeats must be positive, got {repeats}")
    spec, graph = capture_model(model_ref, batch_size=batch)
    rows: list[dict[str, Any]] = []
    for ref in refs:
        row: dict[str, Any] = {"strategy": ref, "simulated_ms": None, "measured_ms": None, "error": None,
                               "speedup_vs_dp": None, "simulated_speedup_vs_dp": None, "measured_runs_ms": [],
                               "feasible": None, "note": None}
        try:
            strategy = resolve_strategy(ref, graph=graph, topology=topology, setup=setup)
        except BaselineNotApplicable as exc:
            row["note"] = f"not applicable: {exc}"
            rows.append(row)
            continue
        sim = simulate(graph, strategy, topology, cost_model, setup=setup).summary()
        row["simulated_ms"], row["feasible"] = sim["iteration_time_ms"], sim["feasible"]
        rows.append(row)
    if measure:
        from soapflow.runner import run

        for _ in range(repeats):
            for row in rows:
                if row["simulated_ms"] is None:
                    continue
                # one thread per process: a cpu device of the topology is one core (as calibration measures)
                measured = run(model_ref, row["strategy"], nproc=nproc, steps=steps, backend="gloo",
                               batch=spec.batch_size, setup=setup, num_threads=1)
                row["measured_runs_ms"].append(
                    float(measured.get("iteration_time_ms") or max(measured["step_time_ms"])))
        for row in rows:
            if row["measured_runs_ms"]:
                row["measured_ms"] = statistics.median(row["measured_runs_ms"])
                row["error"] = (row["simulated_ms"] - row["measured_ms"]) / row["measured_ms"]
    for key, speedup in (("simulated_ms", "simulated_speedup_vs_dp"), ("measured_ms", "speedup_vs_dp")):
        dp_ms = next((r[key] for r in rows if r["strategy"] == "dp" and r[key]), None)
        for r in rows:
            if dp_ms and r[key]:
                r[speedup] = dp_ms / r[key]
    if not measure:
        for r in rows:
            r["speedup_vs_dp"] = r["simulated_speedup_vs_dp"]
    out = {"model": spec.name, "topology": topology.name, "batch_size": graph.batch_size, "setup": setup.to_dict(),
           "measured": measure, "shipped_costs": shipped_report(cost_model),
           "steps": steps if measure else None, "repeats": repeats if measure else None, "rows": rows}
    if plot is not None:
        write_compare_plot(plot, out)
        out["plot"] = os.fspath(plot)
    return out


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "model"


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


__all__ = ["compare", "optimize", "search_report", "topology_and_cost_model"]
