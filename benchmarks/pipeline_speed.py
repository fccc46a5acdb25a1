"""Pipelining measured on this machine (cpu-2): a layer-wise placement with micro-batches against the same
placement without them.

For each model, the two-stage layout `hybrid:tp=1,pp=2` (the first half of the ops, by FLOPs, on process
0, the rest on process 1) runs with `microbatches` 1 (the stages one after the other) and with M > 1
(GPipe: process 1 works on micro-batch m while process 0 works on m + 1). `soapflow.optimize.compare`
trains each strategy `--repeats` times for `--steps` steps in two processes (gloo, one thread each), the
strategies interleaved round robin so that a slow spell of this shared machine hits them alike; a run's
figure is the median step time of its slowest rank, a strategy's the median over its runs. The speed-up
is judged run by run (run i of both strategies from the same round) with a one-sided Wilcoxon
signed-rank test of "micro-batches are not faster"; the simulated times are shown beside.

Target: the micro-batched layout measures faster than the same placement without micro-batches (median
paired ratio > 1, significant at 5%). Exit status non-zero when it misses.

Writes a table to stdout and to benchmarks/results/<name>.md, the raw figures to <name>.json.

Default run (a few minutes on a shared 2-core machine)::

    python benchmarks/pipeline_speed.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scipy import stats  # noqa: E402

from soapflow.optimize import compare  # noqa: E402
from soapflow.tables import frame, markdown_table  # noqa: E402

SIGNIFICANCE = 0.05


def run_model(model: str, batch: int, microbatches: list[int], *, steps: int, repeats: int) -> dict:
    refs = [f"hybrid:tp=1,pp=2,microbatches={m}" if m > 1 else "hybrid:tp=1,pp=2" for m in microbatches]
    load_before = os.getloadavg()[0]
    out = compare(model, "cpu-2", strategies=refs, batch=batch, measure=True, steps=steps, repeats=repeats,
                  baselines=False)
    rows = {r["strategy"]: r for r in out["rows"]}
    base = rows[refs[0]]
    result = []
    for m, ref in zip(microbatches, refs, strict=True):
        row = rows[ref]
        ratios = [b / x for b, x in zip(base["measured_runs_ms"], row["measured_runs_ms"], strict=True)]
        p = None
        if m > 1 and len(ratios) >= 2:
            p = float(stats.wilcoxon([r - 1.0 for r in ratios], alternative="greater").pvalue)
        result.append({"model": model, "batch": batch, "microbatches": m, "simulated_ms": row["simulated_ms"],
                       "measured_ms": row["measured_ms"], "runs_ms": row["measured_runs_ms"],
                       "simulated_speedup": base["simulated_ms"] / row["simulated_ms"],
                       "measured_speedup": statistics.median(ratios), "p_not_faster": p})
    return {"model": model, "rows": result, "load_average_1min": (load_before, os.getloadavg()[0])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp:128", "transformer:16"],
                        help="MODEL:BATCH items (zoo names)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--name", default="pipeline_speed")
    args = parser.parse_args(argv)
    if args.microbatches[0] != 1:
        args.microbatches = [1, *args.microbatches]
    models = []
    for item in args.models:
        name, _, batch = item.partition(":")
        models.append(run_model(name, int(batch), args.microbatches, steps=args.steps, repeats=args.repeats))
    rows = [r for m in models for r in m["rows"]]
    table = markdown_table(frame(rows, ["model", "batch", "microbatches", "simulated_ms", "measured_ms",
                                        "simulated_speedup", "measured_speedup", "p_not_faster"]),
                           {"simulated_ms": "{:.1f}".format, "measured_ms": "{:.1f}".format,
                            "simulated_speedup": "{:.2f}x".format, "measured_speedup": "{:.2f}x".format,
                            "p_not_faster": "{:.3f}".format})
    misses = [r for r in rows if r["microbatches"] > 1 and not (
        r["measured_speedup"] > 1 and r["p_not_faster"] is not None and r["p_not_faster"] < SIGNIFICANCE)]
    lines = ["# Pipelining on cpu-2", "",
             f"Two stages (`hybrid:tp=1,pp=2`) with and without micro-batches, {args.repeats} runs x "
             f"{args.steps} steps per strategy, interleaved; speed-up = the same placement without "
             "micro-batches over the row, median of the paired per-run ratios; p = one-sided Wilcoxon "
             "signed-rank test of \"not faster\". The machine has 2 cores shared with other work.", "",
             table, ""]
    for m in models:
        lines.append(f"- {m['model']}: 1-minute load average {m['load_average_1min'][0]:.1f} before, "
                     f"{m['load_average_1min'][1]:.1f} after.")
    lines.append("- " + ("every micro-batched row measures faster (significant at 5%)" if not misses else
                         "MISSES: " + ", ".join(f"{r['model']} M={r['microbatches']}" for r in misses)))
    text = "\n".join(lines) + "\n"
    print(text)
    results = ROOT / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    (results / f"{args.name}.md").write_text(text)
    (results / f"{args.name}.json").write_text(json.dumps({"models": models, "steps": args.steps,
                                                           "repeats": args.repeats}, indent=1))
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
