"""Search quality in the FlexFlow paper's setting (SysML 2019, section 8): found strategy vs dp and expert.

For each case (model x topology; batch 64 per GPU, 256 per GPU for AlexNet, so the global batch is that
times the device count):

- a main search (seed 0, `--budget` seconds) gives the found strategy and its predicted (simulated)
  speed-up over data parallelism and over the expert strategy; it is asserted never to be worse than the
  best baseline (the baselines seed the search); beside it, the lower bound on any strategy's step
  (`search.bound`) and the found strategy's gap to it, an upper bound on how far from optimal it is;
- repeat searches (seeds 0..`--seeds`-1, `--repeat-budget` seconds each) give the spread of the best found;
- a rate run makes the same fixed sequence of proposals from dp (`--rate-proposals`, or as many as
  `--rate-cap` seconds allow) with delta simulation and with a full simulation per proposal, side by side
  (each proposal costed by one, then the other, after one untimed pass that warms the caches), and
  reports proposals per second of each (and checks both cost every proposal identically).

The issue allows up to 120 s of search per case; the defaults are smaller so that the 12 cases finish in
about 40 minutes on a shared 2-core machine. The budgets used are written into the results.

Writes a table to stdout and to benchmarks/results/<name>.md, the raw figures to <name>.json.

Default run (about 40 minutes)::

    python benchmarks/search_quality.py

The paper's budget::

    python benchmarks/search_quality.py --budget 120 --repeat-budget 120

Quick check::

    python benchmarks/search_quality.py --cases alexnet:p100-4x4 --budget 5 --repeat-budget 3 --seeds 2 \
        --rate-proposals 20 --name search_quality_quick
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from search.baselines import BASELINES, BaselineNotApplicable, dp  # noqa: E402
from search.bound import lower_bound  # noqa: E402
from search.evaluate import SimulatorEvaluators  # noqa: E402
from search.mcmc import NoFeasibleStrategy, SearchResult, search  # noqa: E402
from search.space import ConfigSpace  # noqa: E402
from simulator.engine import simulate  # noqa: E402
from soap.graph import OperatorGraph  # noqa: E402
from soap.topology import DeviceTopology, load_topology  # noqa: E402
from soapflow.api import capture_model  # noqa: E402
from soapflow.tables import frame, markdown_table  # noqa: E402

MODELS = ("alexnet", "inception_v3", "resnet101", "rnntc", "rnnlm", "nmt")
TOPOLOGIES = ("p100-4x4", "k80-16x4")
PER_GPU_BATCH = {"alexnet": 256}  # every other model: 64 (the paper's setting)
MAX_BUDGET_S = 120.0  # the limit per case


def proposal_rates(graph: OperatorGraph, topology: DeviceTopology, *, num_proposals: int,
                   cap_s: float) -> dict:
    """Proposals per second with delta and with full simulation, over one fixed sequence from dp.

    The sequence is a greedy walk (accept when not slower) drawn from one seed. Both evaluators cost each
    proposal in turn, side by side (so a change in the machine's load reaches both alike), each timed on
    its own clock, until `num_proposals` or until one has spent `cap_s` seconds; their costs are checked
    to be equal. The walk is made twice and only the second is timed: the first fills the process-wide
    caches (kernel times, op dims) that whichever evaluator met a config first would otherwise pay for
    alone, so the rates are those of a search that has been running a while."""
    def walk(limit: int) -> tuple[int, dict[str, float], bool]:
        evaluators = {label: SimulatorEvaluators(delta=delta)(graph, topology)
                      for label, delta in (("delta", True), ("full", False))}
        space = ConfigSpace(graph, topology)
        rng = random.Random("search_quality/rates")
        elapsed = dict.fromkeys(evaluators, 0.0)
        current = None
        for label, evaluator in evaluators.items():
            t = time.perf_counter()
            current = evaluator.start(dp(graph, topology))
            elapsed[label] += time.perf_counter() - t
        count, same = 0, True
        while count < limit and max(elapsed.values()) < cap_s:
            op, cfg = space.propose(rng)
            costs = {}
            for label, evaluator in evaluators.items():
                t = time.perf_counter()
                costs[label] = evaluator.propose(op, cfg)
                elapsed[label] += time.perf_counter() - t
            same = same and costs["delta"].value == costs["full"].value
            keep = costs["delta"].value <= current.value
            for label, evaluator in evaluators.items():
                t = time.perf_counter()
                evaluator.accept() if keep else evaluator.reject()
                elapsed[label] += time.perf_counter() - t
            current = costs["delta"] if keep else current
            count += 1
        return count, elapsed, same

    warm, _, _ = walk(num_proposals)
    count, elapsed, same = walk(warm)
    out: dict = {"same_costs": same}
    for label, seconds in elapsed.items():
        out[f"{label}_proposals"] = count
        out[f"{label}_s"] = seconds
        out[f"proposals_per_s_{label}"] = count / seconds if seconds > 0 else None
    out["delta_speedup"] = (out["proposals_per_s_delta"] / out["proposals_per_s_full"]
                            if out["proposals_per_s_full"] else None)
    return out


def _run(result: SearchResult, seed: int, budget_s: float) -> dict:
    return {"seed": seed, "budget_s": budget_s, "best_ms": result.best_cost.time_ms, "source": result.best_source,
            "num_proposals": result.num_proposals, "proposals_per_s": result.proposals_per_s,
            "elapsed_s": result.elapsed_s, "history": [list(h) for h in result.history]}


def run_case(model: str, topology_name: str, *, budget_s: float, repeat_budget_s: float, seeds: int,
             rate_proposals: int, rate_cap_s: float, jobs: int) -> dict:
    topology = load_topology(topology_name)
    batch = PER_GPU_BATCH.get(model, 64) * topology.num_devices
    t0 = time.monotonic()
    _, graph = capture_model(model, batch_size=batch)
    capture_s = time.monotonic() - t0
    evaluators = SimulatorEvaluators()
    row = {"model": model, "topology": topology_name, "num_devices": topology.num_devices, "batch": batch,
           "num_ops": len(graph), "capture_s": capture_s}
    try:
        main = search(graph, topology, evaluators=evaluators, budget_s=budget_s, seed=0, jobs=jobs)
    except NoFeasibleStrategy as exc:
        print(f"  {model} {topology_name} main: {exc}", file=sys.stderr, flush=True)
        return {**row, "no_feasible": str(exc), "baselines_ms": _baselines_ms(graph, topology),
                "never_worse_than_best_baseline": True}
    baselines = main.baseline_ms()
    print(f"  {model} {topology_name} main: {main.best_cost.time_ms:.4g} ms ({main.best_source}), "
          f"{main.num_proposals} proposals in {main.elapsed_s:.1f} s", file=sys.stderr, flush=True)
    repeats = []
    for seed in range(seeds):
        try:
            r = search(graph, topology, evaluators=evaluators, budget_s=repeat_budget_s, seed=seed, jobs=jobs)
        except NoFeasibleStrategy as exc:  # only when no baseline fits and this chain found nothing either
            repeats.append({"seed": seed, "budget_s": repeat_budget_s, "best_ms": None, "no_feasible": str(exc),
                            "num_proposals": 0})
            continue
        repeats.append(_run(r, seed, repeat_budget_s))
        print(f"  {model} {topology_name} seed {seed}: {r.best_cost.time_ms:.4g} ms ({r.best_source}), "
              f"{r.num_proposals} proposals", file=sys.stderr, flush=True)
    rates = proposal_rates(graph, topology, num_proposals=rate_proposals, cap_s=rate_cap_s)
    found_ms = main.best_cost.time_ms
    bound = lower_bound(graph, topology)
    feasible = {k: v for k, v in baselines.items() if v is not None}
    best_baseline = min(feasible, key=feasible.get) if feasible else None
    best_baseline_ms = feasible[best_baseline] if best_baseline else None
    repeat_ms = [x["best_ms"] for x in repeats if x["best_ms"] is not None] or [math.inf]
    return {
        **row, "baselines_ms": baselines,
        "baseline_notes": dict(main.baseline_errors),
        "best_baseline": best_baseline, "best_baseline_ms": best_baseline_ms,
        "found_ms": found_ms, "found_source": main.best_source,
        "lower_bound_ms": bound.time_ms, "gap": bound.gap(found_ms),
        "speedup_vs_dp": baselines["dp"] / found_ms if baselines.get("dp") else None,
        "speedup_vs_expert": baselines["expert"] / found_ms if baselines.get("expert") else None,
        "speedup_vs_best_baseline": best_baseline_ms / found_ms if best_baseline_ms else None,
        "never_worse_than_best_baseline": (best_baseline_ms is None or found_ms <= best_baseline_ms) and all(
            best_baseline_ms is None or ms <= best_baseline_ms for ms in repeat_ms),
        "main": _run(main, 0, budget_s),
        "repeat_ms": {"min": min(repeat_ms), "median": statistics.median(repeat_ms), "max": max(repeat_ms)},
        "spread": (max(repeat_ms) - min(repeat_ms)) / min(repeat_ms),
        "repeats": repeats,
        **rates,
    }


def _baselines_ms(graph: OperatorGraph, topology: DeviceTopology) -> dict:
    """Each baseline's simulated time and peak memory, feasible or not (for a case where nothing fits)."""
    out = {}
    for name, make in BASELINES.items():
        try:
            timeline = simulate(graph, make(graph, topology), topology)
        except BaselineNotApplicable:
            out[name] = None
            continue
        out[name] = {"iteration_time_ms": timeline.iteration_time_ms, "feasible": timeline.feasible,
                     "peak_memory_bytes": max(timeline.peak_memory_bytes)}
    return out


def _fmt(v, pattern="{:.3g}") -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else pattern.format(v)


def table(rows: list[dict]) -> str:
    cells = []
    for r in rows:
        b = r["baselines_ms"]
        if "no_feasible" in r:
            cells.append({"model": r["model"], "topology": r["topology"], "batch": r["batch"],
                          "found ms": "no strategy fits in memory (see below)"})
            continue
        rep = r["repeat_ms"]
        cells.append({
            "model": r["model"], "topology": r["topology"], "batch": r["batch"], "dp ms": b.get("dp"),
            "expert ms": b.get("expert"),
            "best baseline": (f"{r['best_baseline']} {_fmt(r['best_baseline_ms'])}" if r["best_baseline"]
                              else "none fits"),
            "found ms": r["found_ms"], "bound ms": r["lower_bound_ms"], "gap": r["gap"],
            "vs dp": r["speedup_vs_dp"], "vs expert": r["speedup_vs_expert"],
            "≤ best baseline": "yes" if r["never_worse_than_best_baseline"] else "NO",
            "proposals (main run)": r["main"]["num_proposals"], "main run s": f"{r['main']['elapsed_s']:.0f}",
            "repeats: min / median / max ms": f"{_fmt(rep['min'])} / {_fmt(rep['median'])} / {_fmt(rep['max'])}",
            "spread": r["spread"],
            "proposals per repeat (median)": f"{statistics.median(x['num_proposals'] for x in r['repeats']):.0f}",
            "proposals/s delta": r["proposals_per_s_delta"], "proposals/s full": r["proposals_per_s_full"],
            "delta speed-up": r["delta_speedup"]})
    columns = ["model", "topology", "batch", "dp ms", "expert ms", "best baseline", "found ms", "bound ms", "gap",
               "vs dp", "vs expert",
               "≤ best baseline", "proposals (main run)", "main run s", "repeats: min / median / max ms", "spread",
               "proposals per repeat (median)", "proposals/s delta", "proposals/s full", "delta speed-up"]
    return markdown_table(frame(cells, columns), {
        "dp ms": _fmt, "expert ms": _fmt, "found ms": lambda v: v if isinstance(v, str) else _fmt(v),
        "bound ms": _fmt, "gap": partial(_fmt, pattern="{:.0%}"),
        "vs dp": partial(_fmt, pattern="{:.2f}x"), "vs expert": partial(_fmt, pattern="{:.2f}x"),
        "spread": partial(_fmt, pattern="{:.1%}"), "proposals/s delta": partial(_fmt, pattern="{:.1f}"),
        "proposals/s full": partial(_fmt, pattern="{:.1f}"), "delta speed-up": partial(_fmt, pattern="{:.1f}x")})


def _settings(args: argparse.Namespace) -> str:
    return (f"Budgets used: main search {args.budget:g} s (seed 0); {args.seeds} repeat searches of "
            f"{args.repeat_budget:g} s each (seeds 0..{args.seeds - 1}); the rate run makes up to "
            f"{args.rate_proposals} proposals from dp per evaluator (at most {args.rate_cap:g} s each); "
            f"jobs {args.jobs}. The issue allows up to {MAX_BUDGET_S:g} s of search per case; these budgets "
            f"are smaller so that all cases finish in about 40 minutes on a 2-core CPU machine shared with "
            f"other work (so rates are lower than on an idle machine). Every search budget counts the "
            f"baselines' and the chains' starting simulations, and a search stops early when its best has "
            f"not improved for half its budget. Times are simulated iteration times (analytical cost "
            f"model); speed-ups are predicted, not measured.")


def observations(rows: list[dict]) -> list[str]:
    """Facts read off the rows: where the search beat the baselines, the repeatability, delta's gain."""
    out = []
    for r in rows:
        if "no_feasible" in r:
            need = ", ".join(f"{k} {v['peak_memory_bytes'] / 1e9:.3g} GB" for k, v in r["baselines_ms"].items() if v)
            out.append(f"{r['model']} on {r['topology']} (batch {r['batch']}): {r['no_feasible']}. Baselines' "
                       f"peak memory per device: {need}.")
    rows = [r for r in rows if "no_feasible" not in r]
    for r in rows:
        if r["best_baseline"] is None:
            fits = [x for x in r["repeats"] if x["best_ms"] is not None]
            out.append(f"{r['model']} on {r['topology']} (batch {r['batch']}): no baseline fits in memory; the main "
                       f"search found a strategy that fits, {r['found_ms']:.4g} ms ({r['found_source']}); "
                       f"{len(fits)} of {len(r['repeats'])} repeat searches found one.")
    worse = [r for r in rows if not r["never_worse_than_best_baseline"]]
    out.append(f"Found strategy never worse than the best baseline: "
               f"{'yes, in every case' if not worse else 'NO in ' + ', '.join(r['model'] for r in worse)} "
               f"(asserted; the search is seeded with the baselines).")
    beat = [r for r in rows if r["speedup_vs_best_baseline"] and r["speedup_vs_best_baseline"] > 1.0 + 1e-9]
    if beat:
        out.append("Better than every baseline in " + ", ".join(
            f"{r['model']} on {r['topology']} ({r['speedup_vs_best_baseline']:.2f}x over {r['best_baseline']})"
            for r in beat) + ".")
    same = [f"{r['model']} on {r['topology']}" for r in rows if r not in beat and r["best_baseline"]]
    if same:
        out.append("Best baseline kept (nothing better found within the budget) in " + ", ".join(same) + ".")
    vs_dp = [r["speedup_vs_dp"] for r in rows if r["speedup_vs_dp"]]
    if vs_dp:
        out.append(f"Predicted speed-up over dp: {min(vs_dp):.2f}x to {max(vs_dp):.2f}x "
                   f"(median {statistics.median(vs_dp):.2f}x); the paper reports 1.3-3.3x for 5 of 6 models.")
    gains = [r["delta_speedup"] for r in rows if r["delta_speedup"]]
    if gains:
        out.append(f"Delta simulation vs full simulation per proposal: {min(gains):.1f}x to {max(gains):.1f}x "
                   f"(median {statistics.median(gains):.1f}x; the paper reports 2.2-6.9x); delta and full "
                   f"costed every common proposal identically in "
                   f"{sum(bool(r['same_costs']) for r in rows)} of {len(rows)} cases.")
    over = [f"{r['model']} on {r['topology']} ({r['main']['elapsed_s']:.0f} s)" for r in rows
            if r["main"]["elapsed_s"] > 1.1 * r["main"]["budget_s"]]
    if over:
        out.append("Main runs over their budget: " + ", ".join(over) + ". The baselines are simulated in full "
                   "before the first proposal, whatever the budget, and one proposal is not interrupted; on "
                   "these graphs single full simulations take seconds.")
    starved = [f"{r['model']} on {r['topology']}" for r in rows
               if statistics.median(x["num_proposals"] for x in r["repeats"]) < 50]
    if starved:
        out.append("Repeat searches made fewer than 50 proposals (median) in " + ", ".join(starved)
                   + ": there the simulator's time per proposal, not the search, bounds what the budget "
                   "explores, and a zero spread says little.")
    return out


def write_markdown(path: Path, rows: list[dict], *, settings: str, num_cases: int, total_s: float) -> None:
    notes = "\n".join(f"- {line}" for line in observations(rows))
    path.write_text(f"# Search quality (FlexFlow paper setting)\n\n{settings}\n\n{table(rows)}\n\n{notes}\n\n"
                    f"{len(rows)} of {num_cases} case(s), {total_s / 60:.1f} minutes in all.\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", help="comma-separated MODEL:TOPOLOGY pairs (default: every model on both "
                   "clusters)")
    p.add_argument("--budget", type=float, default=30.0, help=f"main search budget, seconds (<= {MAX_BUDGET_S:g})")
    p.add_argument("--repeat-budget", type=float, default=12.0, help="budget of each repeat search, seconds")
    p.add_argument("--seeds", type=int, default=5, help="repeat searches (seeds 0..N-1)")
    p.add_argument("--rate-proposals", type=int, default=200,
                   help="proposals of the delta-vs-full rate run (each evaluator)")
    p.add_argument("--rate-cap", type=float, default=8.0, help="seconds at most per evaluator in the rate run")
    p.add_argument("--jobs", type=int, default=1, help="worker processes per search")
    p.add_argument("--name", default="search_quality", help="results file name (without extension)")
    p.add_argument("--render", action="store_true", help="only rewrite the .md from the .json of an earlier run")
    p.add_argument("--resume", action="store_true",
                   help="keep the cases in the .json of an interrupted run (same settings) and run the rest")
    args = p.parse_args(argv)
    if not 0 < args.budget <= MAX_BUDGET_S or not 0 < args.repeat_budget <= MAX_BUDGET_S:
        p.error(f"budgets must be in (0, {MAX_BUDGET_S:g}] seconds")
    if args.cases:
        cases = [tuple(c.split(":")) for c in args.cases.split(",")]
    else:
        cases = [(m, t) for t in TOPOLOGIES for m in MODELS]
    rows = []
    t0 = time.monotonic()
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    settings = _settings(args)
    if args.render:
        doc = json.loads((out / f"{args.name}.json").read_text())
        order = {case: i for i, case in enumerate((m, t) for t in TOPOLOGIES for m in MODELS)}
        rows = sorted(doc["rows"], key=lambda r: order.get((r["model"], r["topology"]), len(order)))
        write_markdown(out / f"{args.name}.md", rows, settings=_settings(argparse.Namespace(**doc["settings"])),
                       num_cases=doc.get("num_cases", len(rows)), total_s=doc["total_s"])
        print(table(rows))
        return 0
    if args.resume:  # keep the cases an interrupted run finished (same settings), run the others
        doc = json.loads((out / f"{args.name}.json").read_text())
        rows = [r for r in doc["rows"] if (r["model"], r["topology"]) in set(cases)]
        t0 -= doc["total_s"]
    done = {(r["model"], r["topology"]) for r in rows}
    for model, topo in cases:
        if (model, topo) in done:
            continue
        print(f"{model} on {topo} ...", file=sys.stderr, flush=True)
        rows.append(run_case(model, topo, budget_s=args.budget, repeat_budget_s=args.repeat_budget,
                             seeds=args.seeds, rate_proposals=args.rate_proposals, rate_cap_s=args.rate_cap,
                             jobs=args.jobs))
        total = time.monotonic() - t0  # written after every case, so a partial run leaves its results
        write_markdown(out / f"{args.name}.md", rows, settings=settings, num_cases=len(cases), total_s=total)
        (out / f"{args.name}.json").write_text(json.dumps(
            {"settings": {**vars(args), "max_budget_s": MAX_BUDGET_S}, "num_cases": len(cases), "total_s": total,
             "rows": rows}, indent=1) + "\n")
    print(table(rows))
    worse = [f"{r['model']}:{r['topology']}" for r in rows if not r["never_worse_than_best_baseline"]]
    assert not worse, f"found strategy worse than the best baseline in {', '.join(worse)}"
    return 0


if __name__ == "__main__":
    sys.exit(main())
