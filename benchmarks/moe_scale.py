"""Mixtures of experts at scale: what capturing the experts as one splittable op changes, and what the
search finds against data, fully sharded, tensor and expert parallelism, on a Mixtral.

Two Hugging Face Mixtral configs (8 experts, each token routed to 2; grouped-query attention), built on
the meta device (shapes only) and captured at the global batch, trained in bf16 mixed precision with
AdamW on `a100-4x8` (4 DGX A100 nodes, 32 GPUs of 80 GB):

- mixtral-4.8b: 16 layers, hidden 2048, expert width 5632, 16 query heads over 8 kv heads, vocabulary
  32,000; sequence 1024, batch 256 (a Mixtral scaled down to 4.8B parameters);
- mixtral-8x7b: Mixtral 8x7B's shape (32 layers, hidden 4096, expert width 14,336, 32 query heads over 8
  kv heads, vocabulary 32,000; 46.7B parameters); sequence 4096, batch 64 (two sequences per GPU).

For each:

1. Capture two ways, side by side: as capture does (`soap/capture/experts.py`: each layer's routed
   experts one `experts` op that splits by token and by expert), and with Hugging Face's own forward, as
   capture did before (its sort, histogram and grouped products opaque: whole on one device, and the
   grouped products priced at no FLOPs). Per way: ops, opaque ops, the forward FLOPs the graph counts,
   and data parallelism simulated (its step and whether it fits), which shows how far the old capture
   mispriced the model.
2. The references, simulated in full: dp, fsdp, `hybrid:tp=T` (T = 2, 8; and 8 with parameters
   sharded over the 4 groups and full recomputation), and expert parallelism `hybrid:tp=T,ep=E`
   (Megatron-LM's expert-model-parallel size: the experts split E ways over consecutive GPUs of a node,
   their parameters sharded over S of their replicas, with full recomputation, where that is needed to
   fit).
3. The search over every strategy (`search.mcmc.search`, seed 0, `--budget` seconds, one process): its
   best at 60 s and at the budget against the best reference that fits, and the lower bound on any
   strategy (`search.bound`) with the gap.

Where the simulation misses: the `experts` op gathers each token slice to the devices holding its experts
and reduces their partial sums afterwards (an all-gather and a reduce-scatter within the expert group),
where Megatron-LM and DeepSpeed exchange only the routed tokens (an all-to-all, about k / E of those
bytes); its FLOPs and activations assume the router spreads the tokens evenly over the experts (a real
router does not, and an expert-parallel step waits for its busiest expert). Expert parallelism is
therefore priced higher here than in those systems.

Needs the optional extra `hf` (transformers). Times are simulated (the analytical cost model); the
machine running the search is a shared 2-core CPU machine. Writes a table to stdout and to
benchmarks/results/moe_scale.md, the raw figures to .json::

    python benchmarks/moe_scale.py [--budget 120] [--models mixtral-4.8b mixtral-8x7b]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import soap.capture  # noqa: E402
from search.baselines import BaselineNotApplicable, parse_baseline  # noqa: E402
from search.bound import lower_bound  # noqa: E402
from search.evaluate import SimulatorEvaluators  # noqa: E402
from search.mcmc import NoFeasibleStrategy, search  # noqa: E402
from simulator.engine import simulate  # noqa: E402
from soap.capture import capture  # noqa: E402
from soap.graph import OperatorGraph  # noqa: E402
from soap.setup import TrainSetup  # noqa: E402
from soap.topology import load_topology  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TOPOLOGY = "a100-4x8"
SETUP = TrainSetup(precision="bf16", optimizer="adamw")
REFERENCES = ("dp", "fsdp", "hybrid:tp=2", "hybrid:tp=8", "hybrid:tp=8,shard=4,recompute=full", "hybrid:tp=1,ep=8",
              "hybrid:tp=1,ep=8,shard=4", "hybrid:tp=2,ep=8,shard=2", "hybrid:tp=1,ep=8,shard=4,recompute=full")


@dataclass(frozen=True)
class Case:
    name: str
    layers: int
    hidden: int
    width: int
    heads: int
    seq: int
    batch: int


CASES = {
    "mixtral-4.8b": Case("mixtral-4.8b", layers=16, hidden=2048, width=5632, heads=16, seq=1024, batch=256),
    "mixtral-8x7b": Case("mixtral-8x7b", layers=32, hidden=4096, width=14336, heads=32, seq=4096, batch=64),
}


def _graph(case: Case, *, experts_as_one_op: bool) -> tuple[OperatorGraph, float]:
    """The captured graph of `case` and the capture's seconds; without `experts_as_one_op`, capture runs
    Hugging Face's own experts forward (what it did before `soap/capture/experts.py`)."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from hf_models import LogitsOf, lm_cross_entropy

    config = MixtralConfig(hidden_size=case.hidden, intermediate_size=case.width, num_hidden_layers=case.layers,
                           num_attention_heads=case.heads, num_key_value_heads=8, num_local_experts=8,
                           num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=case.seq,
                           router_jitter_noise=0.0, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LogitsOf(AutoModelForCausalLM.from_config(config))
    ids = torch.empty(case.batch, case.seq, dtype=torch.long, device="meta")
    original = soap.capture.experts_as_one_call
    if not experts_as_one_op:
        soap.capture.experts_as_one_call = lambda module: contextlib.nullcontext()
    try:
        t0 = time.perf_counter()
        graph = capture(model, ids, ids, lm_cross_entropy, name=case.name)
        return graph, time.perf_counter() - t0
    finally:
        soap.capture.experts_as_one_call = original


def _simulated(graph: OperatorGraph, name: str, topology) -> dict:
    try:
        strategy = parse_baseline(name)(graph, topology)
    except BaselineNotApplicable as exc:
        return {"error": str(exc)}
    t0 = time.perf_counter()
    timeline = simulate(graph, strategy, topology, setup=SETUP)
    return {"time_ms": timeline.iteration_time_ms, "feasible": timeline.feasible,
            "peak_memory_gb": max(timeline.peak_memory_bytes) / 1e9, "simulate_s": time.perf_counter() - t0}


def run_case(case: Case, budget_s: float) -> dict:
    topology = load_topology(TOPOLOGY)
    captures = {}
    graph = None
    for one_op in (True, False):
        g, seconds = _graph(case, experts_as_one_op=one_op)
        opaque = [op for op in g if op.kind == "opaque"]
        captures["experts op" if one_op else "HF forward (before)"] = {
            "ops": len(g), "opaque_ops": len(opaque), "capture_s": seconds,
            "forward_tflops": sum(op.fwd_flops for op in g) / 1e12,
            "params_b": g.num_params / 1e9, "dp": _simulated(g, "dp", topology)}
        graph = graph or g
        print(f"  {case.name}: captured ({'experts op' if one_op else 'HF forward'})", file=sys.stderr, flush=True)
    references = {}
    for name in REFERENCES:
        references[name] = _simulated(graph, name, topology)
        print(f"  {case.name} {name}: {references[name]}", file=sys.stderr, flush=True)
    fitting = {n: r["time_ms"] for n, r in references.items() if r.get("feasible")}
    best_reference = min(fitting, key=fitting.get) if fitting else None
    bound = lower_bound(graph, topology, setup=SETUP)
    out = {"model": case.name, "case": case.__dict__, "captures": captures, "references": references,
           "best_reference": best_reference, "best_reference_ms": fitting.get(best_reference),
           "lower_bound_ms": bound.time_ms}
    print(f"  {case.name}: searching ...", file=sys.stderr, flush=True)
    try:
        result = search(graph, topology, evaluators=SimulatorEvaluators(setup=SETUP), budget_s=budget_s, seed=0)
    except NoFeasibleStrategy as exc:
        return out | {"found": False, "error": str(exc)}
    at_60 = min((ms for _, t, ms in result.history if t <= 60.0), default=math.inf)
    experts = [op.name for op in graph if op.kind == "experts"]
    layouts = sorted({str(dict(result.best[n].degrees)) for n in experts})
    return out | {"found": True, "best_ms": result.best_cost.time_ms, "best_at_60_ms": at_60,
                  "num_proposals": result.num_proposals, "proposals_per_s": result.proposals_per_s,
                  "gap": bound.gap(result.best_cost.time_ms), "experts_layouts": layouts,
                  "history": [list(h) for h in result.history]}


def _ms(v) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.1f}"


def render(rows: list[dict], meta: dict) -> str:
    lines = ["# Mixtures of experts at scale: Mixtral on a100-4x8", "",
             f"bf16 mixed precision, AdamW; torch {meta['torch']}, Python {meta['python']}, a shared 2-core CPU "
             "machine. Simulated times in ms per step (analytical cost model); how the comparison is made and "
             "where it misses: the docstring of benchmarks/moe_scale.py.", "",
             "Capture, side by side (dp: data parallelism simulated on the graph each way captures):", "",
             "| model | params | captured with | ops | opaque ops | forward TFLOPs counted | dp ms | dp fits |",
             "|---|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        for way, c in r["captures"].items():
            dp = c["dp"]
            lines.append(f"| {r['model']} | {c['params_b']:.1f}B | {way} | {c['ops']} | {c['opaque_ops']} | "
                         f"{c['forward_tflops']:.0f} | {_ms(dp.get('time_ms'))} | "
                         f"{'yes' if dp.get('feasible') else 'NO'} |")
    lines += ["", "References (simulated in full):", "", "| model | strategy | ms | fits | peak GB |",
              "|---|---|---:|---|---:|"]
    for r in rows:
        for name, ref in r["references"].items():
            if "error" in ref:
                lines.append(f"| {r['model']} | {name} | - | {ref['error']} | - |")
            else:
                lines.append(f"| {r['model']} | {name} | {ref['time_ms']:.1f} | {'yes' if ref['feasible'] else 'NO'} "
                             f"| {ref['peak_memory_gb']:.1f} |")
    lines += ["", f"Search over every strategy, budget {meta['budget_s']:g} s:", "",
              "| model | proposals/s | best at 60 s | at the budget | best reference (fits) | as fast | lower bound | "
              "gap | experts ops' layouts |", "|---|---:|---:|---:|---|---|---:|---:|---|"]
    for r in rows:
        ref = f"{r['best_reference']} {_ms(r['best_reference_ms'])}" if r["best_reference"] else "none fits"
        if not r.get("found"):
            lines.append(f"| {r['model']} | - | - | - | {ref} | no | {_ms(r['lower_bound_ms'])} | - | - |")
            continue
        fast = r["best_reference_ms"] is None or r["best_ms"] <= r["best_reference_ms"]
        lines.append(f"| {r['model']} | {r['proposals_per_s']:.1f} | {_ms(r['best_at_60_ms'])} | {_ms(r['best_ms'])} | "
                     f"{ref} | {'yes' if fast else 'NO'} | {_ms(r['lower_bound_ms'])} | {100 * r['gap']:.0f}% | "
                     f"{'; '.join(r['experts_layouts'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=120.0, help="search budget, wall-clock seconds")
    ap.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    rows = []
    for name in args.models:
        print(f"{name} ...", file=sys.stderr, flush=True)
        rows.append(run_case(CASES[name], args.budget))
    meta = {"budget_s": args.budget, "topology": TOPOLOGY, "torch": torch.__version__,
            "python": platform.python_version(), "machine": platform.machine()}
    text = render(rows, meta)
    print(text)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "moe_scale.md").write_text(text)
        (RESULTS / "moe_scale.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
