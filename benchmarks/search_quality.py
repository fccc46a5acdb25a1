"""Search quality in the FlexFlow paper's setting (SysML 2019, section 8): found strategy vs dp and expert.

For each case (model x topology; batch 64 per GPU, 256 per GPU for AlexNet) the search runs with
`--seeds` seeds under a time budget, and reports the predicted (simulated) speed-up of the best strategy
found over data parallelism and over the expert strategy, the spread of the best over the seeds, and the
search rate with delta simulation against full simulation per proposal (a shorter run each, same seed).
The found strategy is never worse than the best baseline: the baselines seed the search.

Writes a table to stdout and to benchmarks/results/<name>.md, the raw figures to <name>.json.

Full run (12 cases x 5 seeds x 120 s, about 2.5 hours)::

    python benchmarks/search_quality.py

Quick check::

    python benchmarks/search_quality.py --cases alexnet:p100-4x4,rnnlm:p100-4x4 --budget 10 --seeds 2 \
        --rate-budget 5 --name search_quality_quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from search.evaluate import SimulatorEvaluators  # noqa: E402
from search.mcmc import search  # noqa: E402
from soap.topology import load_topology  # noqa: E402
from soapflow.api import capture_model  # noqa: E402

MODELS = ("alexnet", "inception_v3", "resnet101", "rnntc", "rnnlm", "nmt")
TOPOLOGIES = ("p100-4x4", "k80-16x4")
PER_GPU_BATCH = {"alexnet": 256}  # every other model: 64 (the paper's setting)


def run_case(model: str, topology_name: str, *, budget_s: float, seeds: int, rate_budget_s: float,
             jobs: int) -> dict:
    topology = load_topology(topology_name)
    batch = PER_GPU_BATCH.get(model, 64) * topology.num_devices
    t0 = time.monotonic()
    _, graph = capture_model(model, batch_size=batch)
    capture_s = time.monotonic() - t0
    runs = []
    for seed in range(seeds):
        r = search(graph, topology, evaluators=SimulatorEvaluators(), budget_s=budget_s, seed=seed, jobs=jobs)
        runs.append({"seed": seed, "best_ms": r.best_cost.time_ms, "source": r.best_source,
                     "num_proposals": r.num_proposals, "proposals_per_s": r.proposals_per_s,
                     "elapsed_s": r.elapsed_s, "history": [list(h) for h in r.history]})
        baselines = r.baseline_ms()
        print(f"  {model} {topology_name} seed {seed}: {r.best_cost.time_ms:.4g} ms ({r.best_source}), "
              f"{r.num_proposals} proposals, {r.proposals_per_s:.0f}/s", file=sys.stderr, flush=True)
    rates = {}
    for label, delta in (("delta", True), ("full", False)):
        r = search(graph, topology, evaluators=SimulatorEvaluators(delta=delta), budget_s=rate_budget_s, seed=0,
                   random_chains=0)
        rates[label] = r.proposals_per_s
    found = [x["best_ms"] for x in runs]
    best_baseline = min((v for v in baselines.values() if v is not None), default=None)
    median = statistics.median(found)
    return {
        "model": model, "topology": topology_name, "num_devices": topology.num_devices, "batch": batch,
        "num_ops": len(graph), "capture_s": capture_s, "baselines_ms": baselines,
        "best_baseline_ms": best_baseline,
        "found_ms": {"min": min(found), "median": median, "max": max(found)},
        "spread": (max(found) - min(found)) / min(found),
        "speedup_vs_dp": baselines["dp"] / median if baselines.get("dp") else None,
        "speedup_vs_expert": baselines["expert"] / median if baselines.get("expert") else None,
        "never_worse_than_best_baseline": best_baseline is None or max(found) <= best_baseline,
        "proposals_per_s_delta": rates["delta"], "proposals_per_s_full": rates["full"],
        "delta_speedup": rates["delta"] / rates["full"] if rates["full"] else None,
        "runs": runs,
    }


def _fmt(v, pattern="{:.3g}") -> str:
    return "-" if v is None else pattern.format(v)


def table(rows: list[dict]) -> str:
    head = ("| model | topology | batch | dp ms | expert ms | found ms (median) | spread over seeds | "
            "vs dp | vs expert | ≤ best baseline | proposals/s delta | proposals/s full | delta speed-up |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        b = r["baselines_ms"]
        lines.append(
            f"| {r['model']} | {r['topology']} | {r['batch']} | {_fmt(b.get('dp'))} | {_fmt(b.get('expert'))} | "
            f"{_fmt(r['found_ms']['median'])} | {_fmt(r['spread'], '{:.1%}')} | "
            f"{_fmt(r['speedup_vs_dp'], '{:.2f}x')} | {_fmt(r['speedup_vs_expert'], '{:.2f}x')} | "
            f"{'yes' if r['never_worse_than_best_baseline'] else 'NO'} | "
            f"{_fmt(r['proposals_per_s_delta'], '{:.0f}')} | {_fmt(r['proposals_per_s_full'], '{:.0f}')} | "
            f"{_fmt(r['delta_speedup'], '{:.1f}x')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", help="comma-separated MODEL:TOPOLOGY pairs (default: every model on both "
                   "clusters)")
    p.add_argument("--budget", type=float, default=120.0, help="search budget per seed, seconds (<= 120)")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--rate-budget", type=float, default=20.0,
                   help="seconds of search with and without delta simulation for the rate comparison")
    p.add_argument("--jobs", type=int, default=1, help="worker processes per search")
    p.add_argument("--name", default="search_quality", help="results file name (without extension)")
    args = p.parse_args(argv)
    if args.cases:
        cases = [tuple(c.split(":")) for c in args.cases.split(",")]
    else:
        cases = [(m, t) for t in TOPOLOGIES for m in MODELS]
    rows = []
    for model, topo in cases:
        print(f"{model} on {topo} ...", file=sys.stderr, flush=True)
        rows.append(run_case(model, topo, budget_s=args.budget, seeds=args.seeds,
                             rate_budget_s=args.rate_budget, jobs=args.jobs))
    text = table(rows)
    print(text)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    settings = (f"budget {args.budget:g} s per seed, {args.seeds} seed(s), rate runs {args.rate_budget:g} s, "
                f"jobs {args.jobs}; times are simulated iteration times (analytical cost model)")
    (out / f"{args.name}.md").write_text(f"# Search quality\n\n{settings}\n\n{text}\n")
    (out / f"{args.name}.json").write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=1) + "\n")
    return 0 if all(r["never_worse_than_best_baseline"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
