"""The reports of `soapflow optimize` and `soapflow compare` for people: text and plots.

Owns `strategy_summary` (what a strategy does: its ops grouped by layout, a few sentences in words, and
the simulator's summary of one iteration with the caller's training setup) and the helpers that put a
split in words (`split_words`, `split_text`, `devices_text`, `describe`), the text renderers of the
reports `soapflow.optimize` builds (`optimize_text`, `compare_text`: tables built as pandas DataFrames,
`compare_table`, and rendered by `soapflow.tables`; `shipped_costs_text`, their line on a shipped cost
database), and the plot writers (`write_convergence_plot`,
`write_compare_plot`, drawn with matplotlib by `soapflow.plot`). It reads reports and simulates one
strategy; it computes nothing the reports depend on.

Must not import `soapflow.optimize` (which imports this module), the search or the runtime.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from simulator.engine import simulate
from soap.config import ParallelConfig
from soap.graph import Operator, OperatorGraph
from soap.opdef import DimKind
from soap.registry import dims_of, op_def
from soap.setup import TrainSetup
from soap.strategy import Strategy
from soap.topology import DeviceTopology
from soapflow.plot import bar_chart, line_chart
from soapflow.tables import frame, text_table

# Up to this many devices the text lists each one's peak memory; beyond, the range and the median.
MAX_LISTED_DEVICES = 16

# ------------------------------------------------------------------------------------- strategy summary


def strategy_summary(graph: OperatorGraph, strategy: Strategy, topology: DeviceTopology, *,
                     setup: TrainSetup, cost_model: Any = None) -> dict[str, Any]:
    """What the strategy does: `groups` (consecutive ops with one layout, each with `split`, `devices` and
    `what`, the split in words), `description` (a few sentences over the whole graph), and the simulator's
    summary of one iteration with `setup` (`iteration_time_ms`, `peak_memory_bytes` per device, ...)."""
    groups: list[dict[str, Any]] = []
    for op in graph:
        if op_def(op.kind).everywhere:
            continue  # the batch and buffers: on every device whatever their config says
        cfg = strategy[op.name]
        split, devices = split_text(op, cfg), devices_text(cfg.devices)
        if groups and groups[-1]["split"] == split and groups[-1]["devices"] == devices:
            groups[-1]["last"] = op.name
            groups[-1]["num_ops"] += 1
        else:
            groups.append({"first": op.name, "last": op.name, "num_ops": 1, "kind": op.kind,
                           "split": split, "devices": devices, "what": split_words(op, cfg)})
    timeline = simulate(graph, strategy, topology, cost_model, setup=setup).summary()
    return {"groups": groups, "description": describe(graph, strategy, topology), **timeline}


def split_words(op: Operator, cfg: ParallelConfig) -> str:
    """The split of one op in words: ``data parallel x4``, ``weights sharded x2 (out_features)``, ..."""
    if cfg.num_parts == 1:
        return f"whole on device {cfg.devices[0]}"
    kinds = {d.name: d.kind for d in dims_of(op)}
    words = []
    for name, g in cfg.degrees.items():
        kind = kinds[name]
        if kind is DimKind.SAMPLE:
            words.append(f"data parallel x{g}")
        elif kind is DimKind.PARAMETER:
            words.append(f"weights sharded x{g} ({name})" if op.params else f"split x{g} on {name}")
        elif kind is DimKind.REDUCTION:
            words.append(f"reduction split x{g} ({name}, partial sums reduced)")
        else:
            words.append(f"split x{g} on {name}")
    return ", ".join(words)


def describe(graph: OperatorGraph, strategy: Strategy, topology: DeviceTopology) -> list[str]:
    """A few sentences on the strategy: how many ops run data parallel on all devices, which ops with
    weights are sharded or placed elsewhere, how many devices are used."""
    n = topology.num_devices
    ops = [op for op in graph if not op_def(op.kind).everywhere]
    dp_all, sharded, whole, follow, other = [], [], [], [], []
    for op in ops:
        cfg = strategy[op.name]
        kinds = {d.name: d.kind for d in dims_of(op)}
        split_kinds = {kinds[k] for k in cfg.degrees}
        if cfg.num_parts == n and split_kinds == {DimKind.SAMPLE}:
            dp_all.append(op)
        elif split_kinds & {DimKind.PARAMETER, DimKind.REDUCTION} and op.params:
            sharded.append(op)
        elif cfg.num_parts == 1:
            whole.append(op)
        elif not op.params and split_kinds & {DimKind.PARAMETER, DimKind.REDUCTION}:
            follow.append(op)
        else:
            other.append(op)
    used = sorted({d for op in ops for d in strategy[op.name].devices})
    lines = [f"{len(dp_all)} of {len(ops)} ops run data parallel over all {n} devices; "
             f"{len(used)} of {n} devices hold work."]
    if sharded:
        names = ", ".join(op.name for op in sharded[:6]) + (", ..." if len(sharded) > 6 else "")
        lines.append(f"{len(sharded)} op(s) shard their weights (tensor/model parallel): {names}.")
    if whole:
        with_params = [op.name for op in whole if op.params]
        lines.append(f"{len(whole)} op(s) run whole on one device"
                     + (f", {len(with_params)} of them with weights (model parallel placement)" if with_params
                        else "") + ".")
    if follow:
        lines.append(f"{len(follow)} op(s) without weights split on feature dims (keeping a sharded layout "
                     f"between ops instead of gathering it).")
    if other:
        lines.append(f"{len(other)} op(s) use other splits (fewer devices, or spatial/sequence dims).")
    return lines


def split_text(op: Operator, cfg: ParallelConfig) -> str:
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


def optimize_text(out: Mapping[str, Any]) -> str:
    """The text `soapflow optimize` prints: the table of the best and the baselines (simulated iteration
    time, speed-up over dp, peak memory), the search's figures, and what the best strategy does."""
    best = out["best"]
    lines = [f"best strategy: {best['iteration_time_ms']:.4g} ms per iteration (simulated; found by "
             f"{best['source']}), written to {best['strategy_file']}", ""]
    df = frame([{"strategy": r["strategy"], "iteration ms": r["iteration_time_ms"], "vs dp": r["speedup_vs_dp"],
                 "peak memory": r["peak_memory_bytes"],
                 "note": f"[{r['note']}]" if r["note"] and r["strategy"] != "best" else ""} for r in out["table"]])
    formats = {"iteration ms": "{:.4g}".format, "vs dp": "{:.2f}x".format,
               "peak memory": lambda b: f"{b / 1e9:.3g} GB"}
    lines.append(text_table(df if df["note"].any() else df.drop(columns="note"), formats, right=list(formats)))
    lines.append("")
    costs = shipped_costs_text(out.get("shipped_costs"))
    if costs:
        lines.append(costs)
    among = f" among strategies of {out['replicas']} replicas" if out.get("replicas", 1) > 1 else ""
    if out.get("replica_phase"):
        among = (f" ({out['replica_phase_proposals']:,} of them first among strategies of {out['replica_phase']} "
                 f"replicas, one per device, as no baseline fits)")
    costed = f", {out['costed_per_s']:.0f}/s that changed the strategy" if "costed_per_s" in out else ""
    noun = "proposal" if out["num_proposals"] == 1 else "proposals"
    lines.append(f"search: {out['num_proposals']:,} {noun}{among} in {out['search_s']:.1f} s "
                 f"({out['proposals_per_s']:.0f}/s{costed}), {out['elapsed_s']:.1f} s in all")
    budget = out.get("budget_s")
    if budget and out.get("max_proposals") is None and out["search_s"] < budget / 2:
        lines.append(f"  (simulating the baselines and starting the chains took most of the "
                     f"{budget:g} s budget, so the chains ran {out['search_s']:.1f} s: a larger --budget "
                     f"searches more)")
    b = out.get("lower_bound")
    if b:
        lines.append(f"no strategy can beat {b['time_ms']:.4g} ms per iteration (lower bound: the least compute "
                     f"spread over every device, {b['work_ms']:.4g} ms, or along the longest chain of ops, "
                     f"{b['path_ms']:.4g} ms); the best is {100 * b['gap']:.0f}% above it"
                     + (f" (the bound took {b['elapsed_s']:.1f} s, after the search's budget)"
                        if b.get("elapsed_s", 0.0) >= 1.0 else ""))
    m = out.get("measured") or {}
    if "best_parts_unmeasured" in m:
        lines.append(f"measured on this machine: {m['parts_timed']} op part(s) timed, {m['rounds']} search(es) "
                     f"again; {m['best_parts_unmeasured']} part(s) of the best still priced without a measurement")
    v = out.get("confirmed")
    if v:
        lines.append(f"confirmed on this machine ({v['rounds']} run(s) of {v['steps']} steps each, median): "
                     + ", ".join(f"{k} {ms:.3g} ms" for k, ms in sorted(v["measured_ms"].items(), key=lambda kv: kv[1]))
                     + f"; written: {v['chosen'] if v['chosen'] != 'search' else 'the search best'}")
    lines.append("what the best strategy does:")
    lines += [f"  {line}" for line in out["strategy"]["description"]]
    lines.append("layout (consecutive ops with the same layout grouped):")
    for g in out["strategy"]["groups"]:
        ops = g["first"] if g["num_ops"] == 1 else f"{g['first']} .. {g['last']} ({g['num_ops']} ops)"
        lines.append(f"  {ops:<44} {g['split']:<28} on {g['devices']:<10} {g['what']}")
    peaks = out["strategy"].get("peak_memory_bytes") or []
    if len(peaks) > MAX_LISTED_DEVICES:  # (every device's in --json)
        lines.append(f"peak memory per device (GB): {min(peaks) / 1e9:.3g} to {max(peaks) / 1e9:.3g} over "
                     f"{len(peaks)} devices, median {statistics.median(peaks) / 1e9:.3g}")
    elif peaks:
        lines.append("peak memory per device (GB): " + " ".join(f"{p / 1e9:.3g}" for p in peaks))
    return "\n".join(lines)


def compare_table(out: Mapping[str, Any]) -> pd.DataFrame:
    """The table `soapflow compare` prints, one row per strategy: its file name (or baseline), simulated
    and measured ms, the error, the speed-up over dp (measured when measuring) and notes."""
    vs = "vs dp (measured)" if out["measured"] else "vs dp"

    def notes(r: Mapping[str, Any]) -> str:
        return " ".join([f"[{r['note']}]"] * bool(r["note"]) + ["[out of memory]"] * (r["feasible"] is False))

    return frame([{"strategy": Path(r["strategy"]).name, "simulated ms": r["simulated_ms"],
                   "measured ms": r["measured_ms"], "error": r["error"], vs: r["speedup_vs_dp"], "note": notes(r)}
                  for r in out["rows"]])


def compare_text(out: Mapping[str, Any]) -> str:
    """The text `soapflow compare` prints: one row per strategy, simulated and measured side by side."""
    title = (f"{out['model']} (batch {out['batch_size']}) on {out['topology']}"
             + (f": measured {out['steps']} steps x {out['repeats']} run(s) each, median" if out["measured"] else
                ": simulated"))
    df = compare_table(out)
    if not df["note"].any():
        df = df.drop(columns="note")
    ms, speedup = "{:.4g}".format, "{:.2f}x".format
    formats = {"simulated ms": ms, "measured ms": ms, "error": "{:+.1%}".format, "vs dp": speedup,
               "vs dp (measured)": speedup}
    costs = shipped_costs_text(out.get("shipped_costs"))
    return title + "\n" + text_table(df, formats, right=list(formats)) + (f"\n{costs}" if costs else "")


def shipped_costs_text(shipped: Mapping[str, Any] | None) -> str | None:
    """The line that says a cost database shipped with soapflow priced op parts (a report's
    `shipped_costs`, `simulator.shipped.shipped_report`), or None when none did."""
    if not shipped:
        return None
    return (f"op costs: measured on {', '.join(shipped['device_kinds'])} (shipped database, "
            f"{shipped['num_parts']:,} parts; analytical for the rest)")


# -------------------------------------------------------------------------------------------------- plots


def write_convergence_plot(path: str | os.PathLike, report: Mapping[str, Any], *, title: str) -> None:
    """The best simulated iteration time against elapsed seconds, with dp's time as a dashed line."""
    history = report["history"]
    if not history:
        raise ValueError("nothing to plot: the search recorded no history")
    dp_ms = report["baselines"].get("dp")
    line_chart(path, [("best found", [h[1] for h in history], [h[2] for h in history])],
               x_end=report["elapsed_s"], references=[("dp", dp_ms)] if dp_ms is not None else [], title=title,
               x_label="elapsed s", y_label="iteration ms (simulated)")


def write_compare_plot(path: str | os.PathLike, report: Mapping[str, Any]) -> None:
    """Simulated (and measured) iteration time per strategy, side by side; a strategy that does not fit
    in memory is marked under its name."""
    rows = report["rows"]
    groups = [("simulated", [r["simulated_ms"] for r in rows])]
    if report["measured"]:
        groups.append(("measured", [r["measured_ms"] for r in rows]))
    names = [Path(r["strategy"]).stem[:16] + ("\n(out of memory)" if r["feasible"] is False else "")
             for r in rows]
    bar_chart(path, names, groups, title=f"{report['model']} (batch {report['batch_size']}) on "
              f"{report['topology']}", y_label="iteration ms")


__all__ = ["compare_table", "compare_text", "describe", "devices_text", "optimize_text", "shipped_costs_text",
           "split_text", "split_words", "strategy_summary", "write_compare_plot", "write_convergence_plot"]
