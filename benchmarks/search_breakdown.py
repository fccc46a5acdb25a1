"""Where a search's time goes: the share of each stage of a proposal, for the searches of search_scale.py.

The searches of `benchmarks/search_scale.py` (GPT-2 medium and GPT 1.7B on `a100-4x8`, over every strategy
and over 4 and 32 replicas; over every strategy without the replica phase, `search.mcmc`, so that each row
is one space's), each with a shorter budget, with every stage a proposal goes through timed:

- *moves*: drawing the proposal (`search.moves.Moves.propose`);
- *memory from plans*: `Simulator.peek_peaks`, which lowers and prices the plans of configs not seen
  before (a proposal that does not fit is decided here);
- *tasks and round order*: `Simulator.propose_many`, the changed ops' tasks replaced and the round
  order's edges walked again;
- *replay*: `Simulator.time_within_ms`, the delta simulation's replay (stopped at the chain's limit);
- *whole-strategy trials*: `DeltaEvaluator.trial`, a move over more than a quarter of the ops, decided
  from its plans or built in full on the spare simulator;
- *accept and reject*: `DeltaEvaluator.accept`, `reject` and `adopt` (an accepted proposal that was
  decided unbuilt is built here);
- *the rest*: the chains' own work (acceptance, bookkeeping) and what the stages above leave out.

Only the chains' time counts (`SearchResult.search_s`: not the baselines' simulations before them, nor the
tidying of the best after them); a stage called from inside another is counted in the outer one. The
shares tell which part of the simulator a speed-up has to reach: a stage at a third of the time bounds
what making only it faster can give at 1.5x. Shares, not absolute times, are what carries over to another
machine.

Writes a table to stdout and to benchmarks/results/search_breakdown.md, the raw figures to .json::

    python benchmarks/search_breakdown.py [--budget 100] [--models gpt2-medium gpt-1.7b] [--replicas none 4 32]
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from search_scale import CASES, TOPOLOGY, report, search_arguments  # noqa: E402

from search import mcmc  # noqa: E402
from search.evaluate import DeltaEvaluator, SimulatorEvaluators  # noqa: E402
from search.mcmc import NoFeasibleStrategy, search  # noqa: E402
from search.moves import Moves  # noqa: E402
from simulator.engine import Simulator  # noqa: E402
from soap.topology import load_topology  # noqa: E402
from soapflow.api import capture_model  # noqa: E402

STAGES = (
    ("moves", Moves, ("propose",)),
    ("memory from plans", Simulator, ("peek_peaks",)),
    ("tasks and round order", Simulator, ("propose_many",)),
    ("replay", Simulator, ("time_within_ms",)),
    ("whole-strategy trials", DeltaEvaluator, ("trial",)),
    ("accept and reject", DeltaEvaluator, ("accept", "reject", "adopt")),
)


class Stopwatch:
    """Seconds and calls per stage while the chains run (`running`); a call made inside another timed call
    counts in the outer one."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._depth = 0
        self.running = False

    def chains(self, run):
        """`search.mcmc._run_chains`, with the stages timed while it runs."""
        def timed(*args, **kwargs):
            self.running = True
            try:
                return run(*args, **kwargs)
            finally:
                self.running = False
        return timed

    def wrap(self, stage: str, method):
        def timed(*args, **kwargs):
            if self._depth or not self.running:
                return method(*args, **kwargs)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[stage] += time.perf_counter() - t0
                self.calls[stage] += 1
                self._depth -= 1
        return timed


@contextmanager
def timed_stages(watch: Stopwatch):
    """The methods of `STAGES` timed by `watch` while the block runs, the originals back after."""
    saved = [(mcmc, "_run_chains", mcmc._run_chains)]
    mcmc._run_chains = watch.chains(mcmc._run_chains)
    try:
        for stage, cls, names in STAGES:
            for name in names:
                method = cls.__dict__[name]
                saved.append((cls, name, method))
                setattr(cls, name, watch.wrap(stage, method))
        yield
    finally:
        for cls, name, method in reversed(saved):
            setattr(cls, name, method)


def run_search(graph, topology, case, budget_s: float, replicas: int | None) -> dict:
    watch = Stopwatch()
    with timed_stages(watch):
        try:
            result = search(graph, topology, evaluators=SimulatorEvaluators(setup=case.setup), budget_s=budget_s,
                            seed=0, replicas=replicas, replica_phase=False)
        except NoFeasibleStrategy as exc:
            return {"found": False, "error": str(exc)}
    total = result.search_s
    stages = {stage: {"seconds": watch.seconds[stage], "calls": watch.calls[stage],
                      "share": watch.seconds[stage] / total if total else 0.0}
              for stage, _, _ in STAGES}
    rest = total - sum(s["seconds"] for s in stages.values())
    stages["the rest"] = {"seconds": rest, "calls": 0, "share": rest / total if total else 0.0}
    return {"found": True, "proposals_per_s": result.proposals_per_s, "num_proposals": result.num_proposals,
            "search_s": total, "best_ms": result.best_cost.time_ms, "stages": stages}


def render(rows: list[dict], meta: dict) -> str:
    names = [stage for stage, _, _ in STAGES] + ["the rest"]
    lines = ["# Where a search's time goes: GPT-2 medium and GPT 1.7B on a100-4x8", "",
             f"Search budget {meta['budget_s']:g} s, seed 0, one process; torch {meta['torch']}, Python "
             f"{meta['python']}, {meta['machine']} (a shared 2-core CPU machine). Each cell: the stage's share of "
             "the search's time, and its milliseconds per call (stages in the module docstring of "
             "benchmarks/search_breakdown.py).", "",
             "| model | searched | proposals/s | " + " | ".join(names) + " |",
             "|---|---|---:|" + "---:|" * len(names)]
    for r in rows:
        space = "every strategy" if r["replicas"] is None else f"{r['replicas']} replicas"
        if not r.get("found"):
            lines.append(f"| {r['model']} | {space} | - |" + " - |" * len(names))
            continue
        cells = []
        for stage in names:
            s = r["stages"][stage]
            per = f" ({1e3 * s['seconds'] / s['calls']:.1f} ms)" if s["calls"] else ""
            cells.append(f"{100 * s['share']:.0f}%{per}")
        lines.append(f"| {r['model']} | {space} | {r['proposals_per_s']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = search_arguments(__doc__.splitlines()[0], 100.0).parse_args(argv)
    topology = load_topology(TOPOLOGY)
    rows = []
    for name in args.models:
        case = CASES[name]
        _, graph = capture_model(f"{Path(__file__).resolve().parent / 'search_scale.py'}:{case.builder}",
                                 batch_size=case.batch)
        for r in args.replicas:
            replicas = None if r == "none" else int(r)
            print(f"  {name}: searching {r} ...", file=sys.stderr, flush=True)
            rows.append({"model": name, "replicas": replicas}
                        | run_search(graph, topology, case, args.budget, replicas))
    report("search_breakdown", rows, args.budget, render, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
