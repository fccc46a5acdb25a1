"""`optimize` and `compare`: what `soapflow optimize` and `soapflow compare` call.

`optimize` is the stages in order: capture the model, load the topology, search (`search.mcmc`, with the
simulator's delta simulation costing proposals), export the best strategy file, then simulate the best once
more in full for its per-device summary. `compare` simulates a list of strategies (baselines or strategy
files) and, on a ``cpu-N`` topology with `measure`, runs each with the runtime (`soapflow.runner.run`) to
set measured times beside the simulated ones.

Both return plain JSON-able dicts whose keys DESIGN.md section 8 fixes (`optimize`: best
{iteration_time_ms, strategy_file}, baselines, speedup_vs_dp, num_proposals, proposals_per_s, elapsed_s,
history; `compare`: rows of {strategy, simulated_ms, measured_ms, error, speedup_vs_dp}), plus a `text`
summary for people. `plot` writes a PNG (`soapflow.plot`): the convergence of the best for `optimize`,
simulated against measured times for `compare`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from search.baselines import BASELINES, BaselineNotApplicable
from search.evaluate import SimulatorEvaluators
from search.mcmc import DEFAULT_BETA_SCALE, SearchResult, search
from soap.config import ParallelConfig
from soap.graph import OperatorGraph
from soap.registry import dims_of
from soap.strategy import Strategy, save_strategy
from soap.topology import DeviceTopology, load_topology
from soapflow.api import capture_model, resolve_strategy

DEFAULT_BUDGET_S = 60.0
_CPU_TOPOLOGY = re.compile(r"^cpu-(\d+)$")


def optimize(model_ref: str, topology_ref: str, *, batch: int | None = None,
             budget_s: float | None = DEFAULT_BUDGET_S, seed: int = 0, jobs: int = 1,
             max_proposals: int | None = None, out_path: str | os.PathLike | None = None,
             progress: Callable[[Mapping[str, Any]], None] | None = None,
             plot: str | os.PathLike | None = None, cost_model: Any = None, delta: bool = True,
             beta_scale: float = DEFAULT_BETA_SCALE, random_chains: int = 1) -> dict[str, Any]:
    """Search a strategy for `model_ref` on `topology_ref` and write it to `out_path`.

    `out_path` defaults to ``strategy-<model>-<topology>.json`` in the current folder. `budget_s` (wall
    clock, seconds) and `max_proposals` bound the search (either may be None, not both); only a proposal
    budget makes the result reproducible across machines. `delta=False` costs every proposal with a full
    simulation (for measuring what delta simulation buys). Bad input raises `ValueError` (one line).
    """
    spec, graph = capture_model(model_ref, batch_size=batch)
    topology = load_topology(topology_ref)
    evaluators = SimulatorEvaluators(cost_model=cost_model, delta=delta)
    result = search(graph, topology, evaluators=evaluators, budget_s=budget_s, max_proposals=max_proposals,
                    seed=seed, jobs=jobs, beta_scale=beta_scale, random_chains=random_chains,
                    progress=progress)
    path = Path(out_path) if out_path is not None else Path(f"strategy-{_slug(spec.name)}-{_slug(topology.name)}.json")
    save_strategy(path, result.best, graph, topology=topology.name, num_devices=topology.num_devices,
                  model=spec.name, predicted_ms=result.best_cost.time_ms)
    out = search_report(result, graph=graph, topology=topology, strategy_file=os.fspath(path),
                        cost_model=cost_model)
    out = {"model": spec.name, "topology": topology.name, "num_devices": topology.num_devices,
           "batch_size": graph.batch_size, "seed": seed, "budget_s": budget_s, "max_proposals": max_proposals,
           "jobs": jobs, "delta": delta, **out}
    if plot is not None:
        write_convergence_plot(plot, out, title=f"{spec.name} on {topology.name}")
        out["plot"] = os.fspath(plot)
    return out


def search_report(result: SearchResult, *, graph: OperatorGraph, topology: DeviceTopology,
                  strategy_file: str | None, cost_model: Any = None) -> dict[str, Any]:
    """The JSON-able report of a search (the keys of `optimize` without the run's settings)."""
    baselines = result.baseline_ms()
    notes = dict(result.baseline_errors)
    for name, cost in result.baselines.items():
        if cost is not None and not cost.feasible:
            notes[name] = (f"out of memory: needs {cost.peak_memory_bytes / 1e9:.3g} GB on one device, "
                           f"has {min(d.memory_bytes for d in topology.devices) / 1e9:.3g} GB")
    best_ms = result.best_cost.time_ms
    feasible = [ms for ms in baselines.values() if ms is not None]
    summary = strategy_summary(graph, result.best, topology, cost_model=cost_model)
    out = {
        "best": {"iteration_time_ms": best_ms, "strategy_file": strategy_file, "source": result.best_source,
                 "peak_memory_bytes": summary["peak_memory_bytes"]},
        "baselines": baselines,
        "baseline_notes": notes,
        "speedup_vs_dp": baselines["dp"] / best_ms if baselines.get("dp") else None,
        "speedup_vs_best_baseline": min(feasible) / best_ms if feasible else None,
        "num_proposals": result.num_proposals,
        "proposals_per_s": result.proposals_per_s,
        "elapsed_s": result.elapsed_s,
        "search_s": result.search_s,
        "beta_per_ms": result.beta_per_ms,
        "history": [[i, t, ms] for i, t, ms in result.history],
        "chains": [{"name": c.name, "start_ms": _finite(c.start_ms), "best_ms": _finite(c.best_ms),
                    "num_proposals": c.num_proposals, "num_accepted": c.num_accepted, "stop": c.stop}
                   for c in result.chains],
        "strategy": summary,
    }
    out["text"] = _optimize_text(out)
    return out


# ------------------------------------------------------------------------------------- strategy summary


def strategy_summary(graph: OperatorGraph, strategy: Strategy, topology: DeviceTopology, *,
                     cost_model: Any = None) -> dict[str, Any]:
    """Which ops are split how, on which devices (consecutive ops with one layout grouped), and the
    simulated peak memory per device."""
    from simulator.api import simulate_summary  # the simulator's full simulation of one strategy

    groups: list[dict[str, Any]] = []
    for op in graph:
        cfg = strategy[op.name]
        split, devices = split_text(op, cfg), devices_text(cfg.devices)
        if groups and groups[-1]["split"] == split and groups[-1]["devices"] == devices:
            groups[-1]["last"] = op.name
            groups[-1]["num_ops"] += 1
        else:
            groups.append({"first": op.name, "last": op.name, "num_ops": 1, "kind": op.kind,
                           "split": split, "devices": devices})
    timeline = simulate_summary(graph, strategy, topology, cost_model)
    return {"groups": groups, **timeline}


def split_text(op, cfg: ParallelConfig) -> str:
    """``sample=4 out_features=2`` (in the op's dim order), ``whole`` for an unsplit op."""
    order = [d.name for d in dims_of(op)]
    parts = sorted(cfg.degrees.items(), key=lambda kv: order.index(kv[0]))
    return " ".join(f"{k}={g}" for k, g in parts) or "whole"


def devices_text(devices: Sequence[int]) -> str:
    """Device ids compactly: ``0-15``, ``3``, ``0,4,..,60`` (a stride), or runs ``0-1,4-5,8-9``."""
    ds = list(devices)
    if len(ds) > 2:
        step = ds[1] - ds[0]
        if step > 1 and all(b - a == step for a, b in zip(ds, ds[1:], strict=False)):
            return f"{ds[0]},{ds[1]},..,{ds[-1]}"
    runs: list[list[int]] = []
    for d in ds:
        if runs and d == runs[-1][1] + 1:
            runs[-1][1] = d
        else:
            runs.append([d, d])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _optimize_text(out: Mapping[str, Any]) -> str:
    best = out["best"]
    lines = [f"best strategy: {best['iteration_time_ms']:.4g} ms per iteration (simulated; from "
             f"{best['source']}), written to {best['strategy_file']}"]
    for name, ms in out["baselines"].items():
        note = out["baseline_notes"].get(name)
        shown = f"{ms:.4g} ms" if ms is not None else "-"
        speed = f"  ({ms / best['iteration_time_ms']:.2f}x slower than the best)" if ms else ""
        lines.append(f"  {name:<7} {shown}{speed}{f'  [{note}]' if note else ''}")
    lines.append(f"search: {out['num_proposals']:,} proposals in {out['search_s']:.1f} s "
                 f"({out['proposals_per_s']:.0f}/s), {out['elapsed_s']:.1f} s in all")
    lines.append("layout of the best strategy (consecutive ops with the same layout grouped):")
    for g in out["strategy"]["groups"]:
        ops = g["first"] if g["num_ops"] == 1 else f"{g['first']} .. {g['last']} ({g['num_ops']} ops)"
        lines.append(f"  {ops:<48} {g['split']:<36} on {g['devices']}")
    peaks = out["strategy"].get("peak_memory_bytes") or []
    if peaks:
        lines.append("peak memory per device (GB): " + " ".join(f"{p / 1e9:.3g}" for p in peaks))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- compare


def compare(model_ref: str, topology_ref: str, *, strategies: Sequence[str] | None = None,
            batch: int | None = None, measure: bool = False, steps: int = 10,
            plot: str | os.PathLike | None = None, cost_model: Any = None) -> dict[str, Any]:
    """Simulate each strategy (baseline names or strategy files; all baselines by default) and, with
    `measure` on a ``cpu-N`` topology, run it for `steps` steps and put the measured time beside it.

    `error` is (simulated - measured) / measured; `speedup_vs_dp` is dp's time over the row's, measured
    times when measuring, simulated otherwise (None where dp is not defined or not listed).
    """
    from simulator.api import simulate_summary

    refs = list(strategies) if strategies else list(BASELINES)
    spec, graph = capture_model(model_ref, batch_size=batch)
    topology = load_topology(topology_ref)
    nproc = None
    if measure:
        m = _CPU_TOPOLOGY.match(topology.name)
        if m is None:
            raise ValueError(f"--measure runs on this machine: the topology must be cpu-N, got {topology.name!r}")
        nproc = int(m[1])
        if steps < 1:
            raise ValueError(f"--steps must be positive, got {steps}")
    rows: list[dict[str, Any]] = []
    for ref in refs:
        row: dict[str, Any] = {"strategy": ref, "simulated_ms": None, "measured_ms": None, "error": None,
                               "speedup_vs_dp": None, "feasible": None, "note": None}
        try:
            strategy = resolve_strategy(ref, graph=graph, topology=topology)
        except BaselineNotApplicable as exc:
            row["note"] = f"not applicable: {exc}"
            rows.append(row)
            continue
        sim = simulate_summary(graph, strategy, topology, cost_model)
        row["simulated_ms"], row["feasible"] = sim["iteration_time_ms"], sim["feasible"]
        if measure:
            from soapflow.runner import run

            measured = run(model_ref, ref, nproc=nproc, steps=steps, backend="gloo", batch=spec.batch_size)
            row["measured_ms"] = float(measured.get("iteration_time_ms") or max(measured["step_time_ms"]))
            row["error"] = (row["simulated_ms"] - row["measured_ms"]) / row["measured_ms"]
        rows.append(row)
    key = "measured_ms" if measure else "simulated_ms"
    dp_ms = next((r[key] for r in rows if r["strategy"] == "dp" and r[key]), None)
    for r in rows:
        if dp_ms and r[key]:
            r["speedup_vs_dp"] = dp_ms / r[key]
    out = {"model": spec.name, "topology": topology.name, "batch_size": graph.batch_size, "measured": measure,
           "rows": rows}
    out["text"] = _compare_text(out)
    if plot is not None:
        write_compare_plot(plot, out)
        out["plot"] = os.fspath(plot)
    return out


def _compare_text(out: Mapping[str, Any]) -> str:
    def fmt(v: float | None, pattern: str) -> str:
        return "-" if v is None else pattern.format(v)

    lines = [f"{'strategy':<28} {'simulated ms':>13} {'measured ms':>12} {'error':>8} {'vs dp':>7}"]
    for r in out["rows"]:
        lines.append(f"{Path(r['strategy']).name[:28]:<28} {fmt(r['simulated_ms'], '{:.4g}'):>13} "
                     f"{fmt(r['measured_ms'], '{:.4g}'):>12} {fmt(r['error'], '{:+.1%}'):>8} "
                     f"{fmt(r['speedup_vs_dp'], '{:.2f}x'):>7}"
                     + (f"  [{r['note']}]" if r["note"] else "")
                     + ("  [out of memory]" if r["feasible"] is False else ""))
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------- plots


def write_convergence_plot(path: str | os.PathLike, report: Mapping[str, Any], *, title: str) -> None:
    """The best simulated iteration time against elapsed seconds, with dp's time as a flat line."""
    from soapflow.plot import line_chart

    history = report["history"]
    if not history:
        raise ValueError("nothing to plot: the search recorded no history")
    end = max(report["elapsed_s"], history[-1][1])
    series = [("best found", [h[1] for h in history], [h[2] for h in history])]
    dp_ms = report["baselines"].get("dp")
    if dp_ms is not None:
        series.append(("dp", [0.0, end], [dp_ms, dp_ms]))
    line_chart(path, series, title=title, x_label="elapsed s", y_label="iteration ms (simulated)")


def write_compare_plot(path: str | os.PathLike, report: Mapping[str, Any]) -> None:
    from soapflow.plot import bar_chart

    rows = report["rows"]
    groups = [("simulated", [r["simulated_ms"] for r in rows])]
    if report["measured"]:
        groups.append(("measured", [r["measured_ms"] for r in rows]))
    bar_chart(path, [Path(r["strategy"]).stem[:12] for r in rows], groups,
              title=f"{report['model']} on {report['topology']}", y_label="iteration ms")


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "model"


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


__all__ = ["compare", "optimize", "search_report", "strategy_summary"]
