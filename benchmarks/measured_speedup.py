"""Measured speed-up of the found strategy on this machine (cpu-2): optimize, then run it and the baselines.

For each model: `soapflow.optimize.optimize` on ``cpu-2`` (simulated), then `soapflow.optimize.compare`
with `measure` trains with the found strategy and with every baseline (dp, mp, tp, expert) in two
processes (`soapflow.runner.run`, gloo): `--steps` steps per run, `--repeats` runs per strategy, the
strategies interleaved round robin so that a slow spell of this shared machine hits them alike; the
measured iteration time of a strategy is the median over its runs (each run's own figure is the median
step time of the slowest rank).

Targets: the found strategy measures no slower than the best baseline (where the search returns a
baseline itself, the two are the same strategy and differ by noise only, which is said so); on the MLP
(1024 -> 4096 -> 1024, batch 64) it is at least 1.5x faster than dp measured.

Verdicts against the best baseline: "meets" when the found strategy's median is no higher (or it is that
baseline); otherwise the runs are compared in pairs (run i of both strategies comes from the same
interleaved round, so they saw the same state of the machine) with a one-sided Wilcoxon signed-rank test
of "the found strategy is slower": "within noise" when that is not significant at 5%, "MISSES" when it
is. With `--profile`, the targets are judged on the calibrated search, the recommended flow (calibrate,
then optimize with --measure-rounds and --confirm-runs); the plain analytical search is reported beside it. The
exit status is non-zero on a MISSES or on the MLP's 1.5x target of the judged rows.

The simulator's cost model for cpu devices is analytical unless `--costdb` names a cost database
(`soapflow calibrate`); the results say how far the simulated times are from the measured ones and
whether the simulated ranking of the strategies holds when measured.

Models: the zoo's ``mlp``, and two small models defined here (a CNN on 32x32 images and an LSTM language
model), referenced as ``<this file>:<function>`` so the runtime's worker processes can rebuild them.

Writes a table to stdout and to benchmarks/results/<name>.md, the raw figures to <name>.json.

Default run (about 15 minutes on a shared 2-core machine)::

    python benchmarks/measured_speedup.py

Quick check::

    python benchmarks/measured_speedup.py --budget 5 --steps 3 --repeats 1 --models mlp \
        --name measured_speedup_quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from search.baselines import BASELINES, BaselineNotApplicable  # noqa: E402
from soap.strategy import load_strategy  # noqa: E402
from soap.topology import load_topology  # noqa: E402
from soapflow.api import capture_model  # noqa: E402
from soapflow.optimize import compare, optimize  # noqa: E402
from soapflow.tables import frame, markdown_table  # noqa: E402

MLP_TARGET_VS_DP = 1.5
SIGNIFICANCE = 0.05


def small_cnn(batch_size: int = 64) -> tuple:
    """Two conv-relu-pool blocks (3 -> 32 -> 64 channels) on 32x32 images, a 512-wide hidden layer,
    10 classes."""
    torch.manual_seed(0)
    module = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 512), nn.ReLU(), nn.Linear(512, 10))
    x = torch.empty(batch_size, 3, 32, 32, device="meta")
    labels = torch.empty(batch_size, dtype=torch.long, device="meta")
    return module, (x, labels)


def small_lm(batch_size: int = 32) -> tuple:
    """The zoo's RNNLM at a size this machine trains in well under a second per step."""
    from soapflow.zoo.rnn import rnnlm

    return rnnlm(batch_size, hidden=256, embed=256, vocab=4096, steps=16)


MODELS = {
    "mlp": ("mlp", 64),
    "small_cnn": (f"{Path(__file__).resolve()}:small_cnn", 64),
    "small_lm": (f"{Path(__file__).resolve()}:small_lm", 32),
}
BASELINE_NAMES = tuple(BASELINES)
MEASURE_ROUNDS = 3
CONFIRM_RUNS = 3


def _same_as_baseline(ref: str, batch: int, found_file: Path, topology_ref: str) -> str | None:
    """The name of the baseline the found strategy equals, if any."""
    _, graph = capture_model(ref, batch_size=batch)
    topology = load_topology(topology_ref)
    found = load_strategy(found_file, graph, topology.num_devices)
    for name, make in BASELINES.items():
        try:
            if make(graph, topology) == found:
                return name
        except BaselineNotApplicable:
            continue
    return None


def run_model(name: str, *, budget_s: float, steps: int, repeats: int, seed: int, folder: Path,
              topology: str, costdb: str | None, profile: str | None) -> dict:
    """Search with the analytical model (or `costdb`) on `topology`, and with the machine `profile` when
    given; measure both found strategies and every baseline, interleaved, in one `compare`."""
    ref, batch = MODELS[name]
    searches = {"found": (topology, costdb)}
    if profile is not None:
        searches["found (calibrated)"] = (profile, None)
    files, found_info = {}, {}
    for label, (topo, db) in searches.items():
        path = folder / f"{name}.{len(files)}.strategy.json"
        t0 = time.monotonic()
        # the calibrated search is the recommended flow: it prices what it recommends from measurements of
        # this machine (up to 3 rounds of timing the best's and the baselines' missing parts into the
        # profile's database, then searching again) and trains the best and the baselines before writing
        # the fastest (optimize --confirm-runs); the analytical one is the plain search
        calibrated = label == "found (calibrated)"
        opt = optimize(ref, topo, batch=batch, budget_s=budget_s, seed=seed, out_path=path, cost_model=db,
                       measure_rounds=MEASURE_ROUNDS if calibrated else 0,
                       confirm_runs=CONFIRM_RUNS if calibrated else 0)
        files[label] = str(path)
        found_info[label] = {
            "same_as": _same_as_baseline(ref, batch, path, "cpu-2"),
            "layout": opt["strategy"]["groups"], "description": opt["strategy"]["description"],
            "search": {k: opt[k] for k in ("num_proposals", "proposals_per_s", "elapsed_s", "speedup_vs_dp")},
            "search_wall_s": time.monotonic() - t0, "simulated_ms": opt["best"]["iteration_time_ms"],
            "measured_parts": opt["measured"], "confirmed": opt["confirmed"]}
    load_before = os.getloadavg()[0]
    cmp = compare(ref, topology, strategies=[*files.values(), *BASELINE_NAMES], batch=batch, measure=True,
                  steps=steps, repeats=repeats, cost_model=costdb)
    load = (load_before, os.getloadavg()[0])
    calibrated = {}
    if profile is not None:
        sim = compare(ref, profile, strategies=[*files.values(), *BASELINE_NAMES], batch=batch)
        calibrated = {r["strategy"]: r["simulated_ms"] for r in sim["rows"]}
    label_of = {v: k for k, v in files.items()}
    rows = []
    for r in cmp["rows"]:
        runs = r["measured_runs_ms"]
        spread = (max(runs) - min(runs)) / statistics.median(runs) if len(runs) > 1 else None
        cal = calibrated.get(r["strategy"])
        rows.append({**r, "strategy": label_of.get(r["strategy"], r["strategy"]), "spread": spread,
                     "measured_min_ms": min(runs) if runs else None,
                     "simulated_calibrated_ms": cal,
                     "error_calibrated": (cal - r["measured_ms"]) / r["measured_ms"] if cal and r["measured_ms"]
                     else None})
    measured = {r["strategy"]: r["measured_ms"] for r in rows if r["measured_ms"] is not None}
    baselines = {k: v for k, v in measured.items() if k in BASELINE_NAMES}
    best_name = min(baselines, key=baselines.get)
    out = {"model": name, "reference": ref.replace(str(ROOT) + "/", ""), "batch": batch, "rows": rows,
           "load_average_1min": load,
           "best_baseline": best_name, "best_baseline_measured_ms": baselines[best_name], "found": {}}
    for label in files:
        info = found_info[label]
        found = measured[label]
        simulated = {r["strategy"]: r["simulated_calibrated_ms" if "calibrated" in label else "simulated_ms"]
                     for r in rows if r["strategy"] in (label, *BASELINE_NAMES) and r["measured_ms"] is not None}
        sim_order = sorted(simulated, key=simulated.get)
        meas_order = sorted(simulated, key=measured.get)
        mins = {r["strategy"]: r["measured_min_ms"] for r in rows if r["measured_min_ms"] is not None}
        best_min = min((v for k, v in mins.items() if k in BASELINE_NAMES))
        runs = {r["strategy"]: r["measured_runs_ms"] for r in rows}
        entry = {**info, "measured_ms": found, **paired(runs[label], runs[best_name]),
                 "vs_best_baseline": baselines[best_name] / found,
                 "vs_best_baseline_by_min": best_min / mins[label],
                 "vs_dp_by_min": mins["dp"] / mins[label] if mins.get("dp") else None,
                 "vs_dp": measured["dp"] / found if measured.get("dp") else None,
                 "simulated_order": sim_order, "measured_order": meas_order,
                 "meets_baseline_target": found <= baselines[best_name] or info["same_as"] == best_name}
        entry["verdict"] = ("meets" if entry["meets_baseline_target"]
                            else "MISSES" if entry["p_slower"] is not None and entry["p_slower"] < SIGNIFICANCE
                            else "within noise")
        if name == "mlp":
            entry["meets_mlp_target"] = entry["vs_dp"] is not None and entry["vs_dp"] >= MLP_TARGET_VS_DP
        out["found"][label] = entry
    return out


def paired(found_runs: list[float], base_runs: list[float]) -> dict:
    """Run-by-run comparison of two strategies measured in the same interleaved rounds: the median of the
    per-round ratios baseline / found, and the one-sided Wilcoxon signed-rank p-value of "found is slower"
    (None with fewer than 2 pairs, or when every pair ties)."""
    from scipy.stats import wilcoxon

    pairs = list(zip(found_runs, base_runs, strict=True))
    ratio = statistics.median(b / f for f, b in pairs) if pairs else None
    diffs = [f - b for f, b in pairs]
    p = None
    if len(pairs) >= 2 and any(diffs):
        p = float(wilcoxon(diffs, alternative="greater").pvalue)
    return {"paired_ratio_median": ratio, "p_slower": p}


def _fmt(v, pattern="{:.3g}") -> str:
    return "-" if v is None else pattern.format(v)


def table(results: list[dict]) -> str:
    calibrated = any(r["simulated_calibrated_ms"] is not None for res in results for r in res["rows"])
    columns = {"simulated_ms": "simulated ms", "error": "error",
               **({"simulated_calibrated_ms": "simulated ms (calibrated)", "error_calibrated": "error (calibrated)"}
                  if calibrated else {}),
               "measured_ms": "measured ms (median)", "measured_min_ms": "measured ms (min)",
               "spread": "spread of runs", "speedup_vs_dp": "measured vs dp"}
    rows = []
    for res in results:
        for r in res["rows"]:
            same = res["found"].get(r["strategy"], {}).get("same_as")
            rows.append({"model": res["model"], "strategy": r["strategy"] + (f" (= {same})" if same else ""),
                         **{name: r[key] for key, name in columns.items()}})
    error = partial(_fmt, pattern="{:+.0%}")
    lines = [markdown_table(frame(rows, ["model", "strategy", *columns.values()]), {
        "simulated ms": _fmt, "error": error, "simulated ms (calibrated)": _fmt, "error (calibrated)": error,
        "measured ms (median)": _fmt, "measured ms (min)": _fmt, "spread of runs": partial(_fmt, pattern="{:.0%}"),
        "measured vs dp": partial(_fmt, pattern="{:.2f}x")}), ""]
    for res in results:
        lines.append(f"- {res['model']}: 1-minute load average {res['load_average_1min'][0]:.1f} before the "
                     f"measurements, {res['load_average_1min'][1]:.1f} after (2 cores).")
        for label, f in res["found"].items():
            line = (f"- {res['model']}, {label}: {f['measured_ms']:.3g} ms measured vs best baseline "
                    f"{res['best_baseline']} {res['best_baseline_measured_ms']:.3g} ms "
                    f"({f['vs_best_baseline']:.2f}x; run by run {_fmt(f['paired_ratio_median'], '{:.2f}x')}, "
                    f"p(found slower) {_fmt(f['p_slower'], '{:.2f}')}): {f['verdict']}")
            if f["same_as"]:
                line += f" (the found strategy is the {f['same_as']} baseline itself)"
            if "meets_mlp_target" in f:
                line += (f"; vs dp {_fmt(f['vs_dp'], '{:.2f}x')} measured "
                         f"({'meets' if f['meets_mlp_target'] else 'MISSES'} the {MLP_TARGET_VS_DP}x target)")
            line += (f". By the fastest run instead of the median: {f['vs_best_baseline_by_min']:.2f}x the best "
                     f"baseline, {_fmt(f['vs_dp_by_min'], '{:.2f}x')} dp.")
            line += (f" Simulated order {' < '.join(f['simulated_order'])}; measured order "
                     f"{' < '.join(f['measured_order'])}.")
            lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--budget", type=float, default=20.0, help="search budget per model, seconds")
    p.add_argument("--steps", type=int, default=10, help="training steps per measured run")
    p.add_argument("--repeats", type=int, default=3, help="measured runs per strategy (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--topology", default="cpu-2", help="cpu-2, or a topology file of this machine's 2 devices")
    p.add_argument("--costdb", help="cost database (JSON lines) for the simulator's measured cost model")
    p.add_argument("--profile", help="machine profile (soapflow calibrate): also search with its calibrated "
                   "cost model and measure that strategy too")
    p.add_argument("--name", default="measured_speedup", help="results file name (without extension)")
    args = p.parse_args(argv)
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}")
    results = []
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    cost = f"measured cost model over {Path(args.costdb).name}" if args.costdb else "analytical cost model"
    if args.profile:
        cost += (f"; a second search per model uses the calibrated cost model of the machine profile "
                 f"{Path(args.profile).name} (soapflow calibrate) with up to {MEASURE_ROUNDS} rounds of timing "
                 f"the op parts of its best strategy and the baselines that the profile's database lacks and "
                 f"searching again (optimize --measure-rounds), then {CONFIRM_RUNS} training runs of its best "
                 f"and of each baseline before writing the fastest (optimize --confirm-runs): the recommended flow, "
                 f"which the targets are judged on; its strategy is measured alongside, afresh")
    settings = (f"{Path(args.topology).name} (two processes on this machine, gloo, one thread each); search "
                f"budget {args.budget:g} s, seed {args.seed}; simulated with the {cost}; each strategy measured "
                f"{args.repeats} time(s) x {args.steps} steps, interleaved, median reported. The machine has 2 "
                f"cores shared with other work, so measured times are noisy: the spread column is "
                f"(max - min) / median of runs.")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            print(f"{name} ...", file=sys.stderr, flush=True)
            results.append(run_model(name, budget_s=args.budget, steps=args.steps, repeats=args.repeats,
                                     seed=args.seed, folder=Path(tmp), topology=args.topology,
                                     costdb=args.costdb, profile=args.profile))
            text = table(results)
            (out / f"{args.name}.md").write_text(
                f"# Measured speed-up\n\n{settings}\n\n{text}\n\n{time.monotonic() - t0:.0f} s in all.\n")
            (out / f"{args.name}.json").write_text(json.dumps(
                {"settings": {**vars(args), "profile": args.profile and Path(args.profile).name,
                              "costdb": args.costdb and Path(args.costdb).name,
                              "topology": Path(args.topology).name},
                 "total_s": time.monotonic() - t0, "results": results}, indent=1) + "\n")
    print(table(results))
    judged = "found (calibrated)" if args.profile else "found"
    ok = all(f["verdict"] != "MISSES" and f.get("meets_mlp_target", True)
             for r in results for label, f in r["found"].items() if label == judged)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
