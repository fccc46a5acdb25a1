"""`validate`: how well the simulator predicts this machine; what `soapflow validate` calls.

For each model: capture it, pick K diverse strategies (the baselines, the search's best under a short
budget, and random valid strategies: data or model parallelism with a random share of the ops given a
random config), predict each with the simulator on the given topology and cost model, run each with the
runtime on this machine (one process per device, one thread each, several steps in rounds interleaved
over the strategies, the median iteration time), and compare. With a machine profile (`soapflow
calibrate`) the prediction uses its calibrated model: op parts are timed on this machine first
(`runtime.measure`, once per distinct part, cached in the profile's cost database) and priced from
those measurements plus the fitted runtime overhead; the analytical model with the fitted constants
prices the rest. Validation never feeds back into the fit. The training setup (`soap.setup.TrainSetup`)
is the caller's: the predictions, the search and the measured runs all use it.

The report: `rows` ({model, strategy, predicted_ms, measured_ms, error}, error = (predicted - measured)
/ measured), `median_abs_error`, `max_abs_error`, `spearman` (rank correlation of predicted and measured
times, overall: over all rows of all models), and `per_model` ({median_abs_error, max_abs_error,
spearman} per model). `extra` predictors (name -> topology reference) add a prediction per row from
another topology/cost model (e.g. the uncalibrated ``cpu-2`` preset) with the same metrics under
``extra[name]``, for the accuracy benchmark.
"""

from __future__ import annotations

import functools
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from runtime.launch import LaunchError, launch
from runtime.measure import measure_parts, part_jobs
from runtime.train import TrainOptions, time_strategies
from search.baselines import BASELINES, BaselineNotApplicable
from search.evaluate import SimulatorEvaluators
from search.mcmc import search
from search.space import ConfigSpace
from simulator.calibration import cost_model_for, read_profile
from simulator.engine import simulate
from soap.graph import OperatorGraph
from soap.setup import TrainSetup
from soap.strategy import Strategy, validate_strategy
from soap.topology import DeviceTopology
from soapflow.api import capture_model
from soapflow.plot import require_matplotlib, scatter_chart
from soapflow.runner import build_workload, killed_message
from soapflow.tables import frame, text_table

DEFAULT_STEPS = 5
DEFAULT_SEARCH_BUDGET_S = 5.0
DEFAULT_STEP_TIMEOUT_S = 600.0  # per training step and per wait for another process; none on the whole job


# ------------------------------------------------------------------------------------------------ metrics


def ranks(values: Sequence[float]) -> list[float]:
    """Ranks 1..n of the values, ties given their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation (Pearson on the ranks); None for fewer than 2 points or no variation."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman needs as many xs as ys, got {len(xs)} and {len(ys)}")
    if len(xs) < 2:
        return None
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    return cov / math.sqrt(vx * vy) if vx > 0 and vy > 0 else None


def metrics(predicted: Sequence[float], measured: Sequence[float]) -> dict[str, Any]:
    """`median_abs_error`, `max_abs_error` (relative to measured) and `spearman` of paired times."""
    errors = [abs(p - m) / m for p, m in zip(predicted, measured, strict=True)]
    return {"median_abs_error": statistics.median(errors) if errors else None,
            "max_abs_error": max(errors) if errors else None,
            "spearman": spearman(predicted, measured), "num_strategies": len(errors)}


# --------------------------------------------------------------------------------------------- strategies


def pick_strategies(graph: OperatorGraph, topology: DeviceTopology, *, count: int, setup: TrainSetup,
                    seed: int = 0, cost_model: Any = None,
                    search_budget_s: float | None = DEFAULT_SEARCH_BUDGET_S) -> list[tuple[str, Strategy]]:
    """`count` distinct strategies that fit in memory with `setup`: the baselines that apply, the search's
    best (when `search_budget_s`), then random ones (seeded): dp or mp with a random share of the ops
    re-drawn."""
    picked: list[tuple[str, Strategy]] = []

    def add(name: str, strategy: Strategy) -> None:
        if len(picked) >= count or any(strategy == s for _, s in picked):
            return
        validate_strategy(graph, strategy, topology.num_devices)
        if simulate(graph, strategy, topology, cost_model, setup=setup).summary().get("feasible", True):
            picked.append((name, strategy))

    bases: list[Strategy] = []
    for name, make in BASELINES.items():
        try:
            strategy = make(graph, topology)
        except BaselineNotApplicable:
            continue
        bases.append(strategy)
        add(name, strategy)
    if search_budget_s and len(picked) < count:
        result = search(graph, topology, evaluators=SimulatorEvaluators(cost_model=cost_model, setup=setup),
                        budget_s=search_budget_s, seed=seed)
        add("search", result.best)
    space = ConfigSpace(graph, topology)
    rng = random.Random(seed)
    shares = (0.25, 0.5, 1.0)
    for attempt in range(20 * count):
        if len(picked) >= count:
            break
        base = bases[attempt % len(bases)] if bases else space.random_strategy(rng, Strategy({}))
        share = shares[attempt % len(shares)]
        configs = dict(base.items())
        for name in space.ops:
            if rng.random() < share:
                configs[name] = space.sample(name, rng)
        add(f"random{attempt}", Strategy({op.name: configs[op.name] for op in graph if op.name in configs}))
    return picked


# ---------------------------------------------------------------------------------------------- measuring


def measure_steps(model_ref: str, graph: OperatorGraph, strategies: Mapping[str, Strategy], *, nproc: int,
                  steps: int, rounds: int, setup: TrainSetup, timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
                  progress: Callable[[Mapping[str, Any]], None] | None = None) -> dict[str, float]:
    """The runtime's iteration time (ms) of each strategy, training with `setup`: one job of `nproc`
    processes (one thread each) trains the model under all of them, interleaved
    (`runtime.train.time_strategies`: `rounds` rounds of 1 + `steps` steps per strategy, the first step of
    each dropped); per strategy the median over the rounds of each round's median step (slowest rank).
    What a long training run sees: the allocator's and the caches' warm-up of a fresh process is behind it
    after the first round. Every strategy keeps its own replica in the job, so it needs the memory of all
    of them at once. No limit on the whole job: a step over `timeout_s` seconds fails naming its strategy
    (also every process group's timeout); `progress` receives each strategy's turn as it ends
    (`time_strategies`' report: strategy, round, rounds, step_ms)."""
    kwargs = {"build": functools.partial(build_workload, model_ref, graph.batch_size), "graph": graph.to_dict(),
              "strategies": {name: {n: cfg.to_dict() for n, cfg in st.items()} for name, st in strategies.items()},
              "steps": steps, "rounds": rounds, "options": TrainOptions(setup=setup, timeout_s=timeout_s)}
    try:
        per_round = launch(time_strategies, nproc, kwargs=kwargs, timeout_s=timeout_s, num_threads=1,
                           progress=progress)[0]
    except LaunchError as exc:
        if exc.signal != "SIGKILL":
            raise
        raise LaunchError(killed_message(exc.rank, graph=graph, strategies=list(strategies.values()), setup=setup,
                                         world=nproc), rank=exc.rank, signal=exc.signal) from None
    return {name: statistics.median(per_round[name]) for name in strategies}


# ----------------------------------------------------------------------------------------------- validate


def validate(models: Sequence[str], topology_ref: str, *, strategies: int = 8, seed: int = 0,
             steps: int = DEFAULT_STEPS, batch: int | None = None, plot: str | os.PathLike | None = None,
             progress: Callable[[Mapping[str, Any]], None] | None = None, costdb: str | None = None,
             search_budget_s: float | None = DEFAULT_SEARCH_BUDGET_S, extra: Mapping[str, str] | None = None,
             rounds: int = 3, timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
             setup: TrainSetup | None = None) -> dict[str, Any]:
    """Predict and measure `strategies` strategies per model on `topology_ref` (a ``cpu-N`` preset or a
    machine profile of this machine; see the module docstring), training with `setup` (None:
    `TrainSetup()`). The strategies train in one job per model,
    interleaved: `rounds` rounds of 1 + `steps` steps each (`measure_steps`); the measured time is the
    median over the rounds of each round's median after its first step. `costdb` overrides the profile's
    cost database. There is no limit on the whole job: `timeout_s` bounds each training step (and every
    wait for another process), and a step over it fails with a `LaunchError` naming the strategy.
    `progress` receives a dict per stage of each model (capture, strategies, op parts, run) and per
    strategy's turn in the runs. Bad input raises `ValueError`."""
    if not models:
        raise ValueError("validate needs at least one model")
    if strategies < 1 or steps < 1 or rounds < 1:
        raise ValueError(f"--strategies, --steps and rounds must be positive, got {strategies}, {steps}, {rounds}")
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"--timeout must be a positive number of seconds, got {timeout_s}")
    if plot is not None:
        require_matplotlib()  # before the runs, not after them
    setup = setup if setup is not None else TrainSetup()
    start = time.monotonic()
    db_path = costdb
    profile = read_profile(topology_ref) if os.path.isfile(topology_ref) else None
    if db_path is None and profile is not None:
        db_path = profile.costdb
    topology, _ = cost_model_for(topology_ref)
    if any(d.kind != "cpu" for d in topology.devices):
        raise ValueError(f"validate runs the strategies on this machine: {topology.name!r} must be a cpu-N "
                         f"preset or a machine profile of this machine (it has {topology.devices[0].kind} "
                         "devices)")
    nproc = topology.num_devices
    others = {name: cost_model_for(ref) for name, ref in (extra or {}).items()}
    rows: list[dict[str, Any]] = []

    def report(stage: str, **info: Any) -> None:
        if progress is not None:
            progress({"stage": stage, "elapsed_s": time.monotonic() - start, **info})

    for model_ref in models:
        report("capture", model=model_ref)
        spec, graph = capture_model(model_ref, batch_size=batch)
        _, cost_model = cost_model_for(topology_ref, db=db_path) if db_path else cost_model_for(topology_ref)
        report("strategies", model=model_ref, count=strategies)
        picked = pick_strategies(graph, topology, count=strategies, setup=setup, seed=seed, cost_model=cost_model,
                                 search_budget_s=search_budget_s)
        if db_path is not None or profile is not None:
            report("op parts", model=model_ref)
            db, _ = measure_parts(part_jobs(graph, [s for _, s in picked]), db_path, nproc=nproc,
                                  timeout_s=timeout_s, source="validate",
                                  progress=lambda done, total, m=model_ref: report("op parts", model=m,
                                                                                  done=done, total=total))
            _, cost_model = cost_model_for(topology_ref, db=db)
        # Rounds over all strategies rather than all steps of one strategy at once: a change of the
        # machine's load during the runs then spreads over the strategies instead of favouring some.
        report("run", model=model_ref, strategies=len(picked), rounds=rounds)
        times = measure_steps(model_ref, graph, dict(picked), nproc=nproc, steps=steps, rounds=rounds,
                              setup=setup, timeout_s=timeout_s,
                              progress=lambda turn, m=model_ref: report("run", model=m, **turn))
        for name, strategy in picked:
            predicted = simulate(graph, strategy, topology, cost_model, setup=setup).summary()["iteration_time_ms"]
            measured = times[name]
            row = {"model": spec.name, "strategy": name, "predicted_ms": predicted, "measured_ms": measured,
                   "error": (predicted - measured) / measured}
            for other, (topo, model) in others.items():
                ms = simulate(graph, strategy, topo, model, setup=setup).summary()["iteration_time_ms"]
                row[f"{other}_ms"] = ms
                row[f"{other}_error"] = (ms - measured) / measured
            rows.append(row)
    out: dict[str, Any] = {"topology": topology.name, "topology_ref": os.fspath(topology_ref),
                           "calibrated": profile is not None, "nproc": nproc, "steps": steps, "rounds": rounds,
                           "seed": seed, "setup": setup.to_dict(),
                           "rows": rows, **_summary(rows, "predicted_ms")}
    if extra:
        out["extra"] = {name: _summary(rows, f"{name}_ms") for name in extra}
    out["elapsed_s"] = time.monotonic() - start
    if plot is not None:
        write_scatter_plot(plot, out)
        out["plot"] = os.fspath(plot)
    return out


def _summary(rows: Sequence[Mapping[str, Any]], key: str) -> dict[str, Any]:
    overall = metrics([r[key] for r in rows], [r["measured_ms"] for r in rows])
    per_model = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        per_model[model] = metrics([r[key] for r in mine], [r["measured_ms"] for r in mine])
    return {"median_abs_error": overall["median_abs_error"], "max_abs_error": overall["max_abs_error"],
            "spearman": overall["spearman"], "per_model": per_model}


def validate_text(report: Mapping[str, Any]) -> str:
    """The report for people: one line per strategy, then the metrics per model and overall."""
    extra = list(report.get("extra", {}))
    columns = {"model": "model", "strategy": "strategy", "predicted_ms": "predicted ms",
               "measured_ms": "measured ms", "error": "error"}
    for n in extra:
        columns |= {f"{n}_ms": f"{n} ms", f"{n}_error": f"{n} error"}
    df = frame(report["rows"], list(columns)).rename(columns=columns)
    formats = {name: ("{:+.1%}" if key.endswith("error") else "{:.2f}").format
               for key, name in columns.items() if key not in ("model", "strategy")}
    lines = [f"simulator vs runtime on {report['topology']} ({report['nproc']} processes, "
             f"{'calibrated' if report.get('calibrated') else 'uncalibrated'}), median of "
             f"{report.get('rounds', 1)} x {report['steps']} steps",
             "", text_table(df, formats, right=list(formats)), ""]

    def fmt(m: Mapping[str, Any]) -> str:
        rho = m["spearman"]
        return (f"median |error| {m['median_abs_error']:.1%}, max {m['max_abs_error']:.1%}, "
                f"spearman {'-' if rho is None else f'{rho:.2f}'}")

    for model, m in report["per_model"].items():
        lines.append(f"{model:<14} {fmt(m)}")
        for n in extra:
            lines.append(f"{'':<14} {n}: {fmt(report['extra'][n]['per_model'][model])}")
    lines.append(f"{'overall':<14} {fmt(report)}")
    for n in extra:
        lines.append(f"{'':<14} {n}: {fmt(report['extra'][n])}")
    return "\n".join(lines)


def write_scatter_plot(path: str | os.PathLike, report: Mapping[str, Any], *, key: str = "predicted_ms") -> None:
    """Predicted (`key`) against measured iteration time, one colour per model, with the line y = x, a
    ±10% band around it and the median and largest absolute errors."""
    rows = report["rows"]
    if not rows:
        raise ValueError("a scatter plot needs at least one row")
    m = report if key == "predicted_ms" else report["extra"][key.removesuffix("_ms")]
    rho = m["spearman"]
    note = (f"median |error| {m['median_abs_error']:.1%}, max {m['max_abs_error']:.1%}\n"
            f"spearman {'-' if rho is None else f'{rho:.2f}'}; {len(rows)} strategies")
    scatter_chart(path, [(r["model"], r["measured_ms"], r[key]) for r in rows], note=note,
                  title=f"simulated vs measured on {report['topology']}", x_label="measured ms per iteration",
                  y_label="predicted ms per iteration")


__all__ = ["measure_steps", "metrics", "pick_strategies", "ranks", "spearman", "validate", "validate_text",
           "write_scatter_plot"]
