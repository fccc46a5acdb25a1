"""Golden results: simulated figures for fixed (graph, topology, strategy) triples, to guard refactors.

`tests/golden/simulator.json` holds, per case, the iteration time, its compute / communication /
synchronization split, the task count, bytes moved, the largest per-device memory peak and the step
plan's collectives (count and bytes per kind, summed over the devices), under the analytical cost model
with its default constants (and one fixed-cost case), with the default training setup and, for a few
cases, AdamW with 256 KiB buckets (more state per parameter, an all-reduce per layer). Times must match to a
relative 1e-9, counts exactly.

When a change moves these figures on purpose (the cost model, the task graph or the topology presets
change), regenerate the file and say why in the commit::

    python tests/test_simulator_golden.py --regenerate

and review the diff of tests/golden/simulator.json: every changed figure should be explained by the change.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import pytest
from test_simulator_support import chain, mlp, random_strategy, small_cnn

from search.baselines import BASELINES, BaselineNotApplicable
from simulator import AnalyticalCostModel, FixedCostModel, Simulator
from soap.setup import TrainSetup
from soap.topology import load_topology

GOLDEN = Path(__file__).parent / "golden" / "simulator.json"
REL = 1e-9
GRAPHS = {
    "mlp": lambda: mlp(batch=64),
    "chain8": lambda: chain(batch=64, width=128, depth=8),
    "small_cnn": lambda: small_cnn(batch=64),
}
TOPOLOGIES = ("cpu-2", "p100-4x4", "k80-16x4")
STRATEGIES = ("dp", "mp", "tp", "expert", "random0")
COST_MODELS = {"analytical": AnalyticalCostModel,
               "fixed": lambda: FixedCostModel(fwd_each_ms=0.1, bwd_each_ms=0.2, update_each_ms=0.05,
                                               reduce_each_ms=0.01)}
FIXED_CASES = (("small_cnn", "p100-4x4", "dp"), ("small_cnn", "p100-4x4", "random0"))
SETUPS = {"default": TrainSetup(), "adamw": TrainSetup(optimizer="adamw", bucket_mb=0.25)}


def cases() -> list[tuple[str, ...]]:
    out = [(g, t, s, "analytical") for g in GRAPHS for t in TOPOLOGIES for s in STRATEGIES]
    out += [(g, "p100-4x4", s, "analytical", "adamw") for g in GRAPHS for s in ("dp", "tp", "random0")]
    return out + [(g, t, s, "fixed") for g, t, s in FIXED_CASES]


def case_id(graph: str, topology: str, strategy: str, cost_model: str, setup: str = "default") -> str:
    return f"{graph}/{topology}/{strategy}/{cost_model}" + ("" if setup == "default" else f"/{setup}")


def figures(graph_name: str, topology_name: str, strategy_name: str, cost_model: str,
            setup: str = "default") -> dict | None:
    """The golden figures of one case (None when the baseline does not apply to the graph)."""
    graph = GRAPHS[graph_name]()
    topo = load_topology(topology_name)
    if strategy_name.startswith("random"):
        strategy = random_strategy(graph, topo, random.Random(int(strategy_name[len("random"):])))
    else:
        try:
            strategy = BASELINES[strategy_name](graph, topo)
        except BaselineNotApplicable:
            return None
    sim = Simulator(graph, topo, COST_MODELS[cost_model](), setup=SETUPS[setup])
    tl = sim.full(strategy)
    collectives: dict[str, list[int]] = {}
    for device in sim.collectives():
        for kind, v in device.items():
            total = collectives.setdefault(kind, [0, 0])
            total[0] += v["count"]
            total[1] += v["bytes"]
    return {"iteration_time_ms": tl.iteration_time_ms, "compute_ms": tl.compute_ms, "comm_ms": tl.comm_ms,
            "sync_ms": tl.sync_ms, "num_tasks": tl.num_tasks, "bytes_moved": tl.bytes_moved,
            "max_peak_memory_bytes": max(tl.peak_memory_bytes), "feasible": tl.feasible,
            "collectives": {k: v for k, v in sorted(collectives.items())}}


@pytest.fixture(scope="module")
def golden() -> dict:
    if not GOLDEN.exists():
        pytest.fail(f"{GOLDEN.name} is missing: run python tests/test_simulator_golden.py --regenerate")
    return json.loads(GOLDEN.read_text())["cases"]


@pytest.mark.parametrize("case", cases(), ids=lambda c: case_id(*c))
def test_golden_figures(golden, case):
    key = case_id(*case)
    assert key in golden, f"no golden entry for {key}: regenerate (see the module docstring)"
    want, got = golden[key], figures(*case)
    if want is None or got is None:
        assert want == got
        return
    assert set(got) == set(want)
    for name, value in want.items():
        if isinstance(value, float):
            assert got[name] == pytest.approx(value, rel=REL, abs=1e-12), f"{key}: {name}"
        else:
            assert got[name] == value, f"{key}: {name}"


def test_golden_file_lists_exactly_the_cases(golden):
    assert sorted(golden) == sorted(case_id(*c) for c in cases())


def regenerate() -> None:
    doc = {"about": "simulated figures per graph/topology/strategy/cost model; regenerate with "
                    "python tests/test_simulator_golden.py --regenerate",
           "cases": {case_id(*c): figures(*c) for c in cases()}}
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(doc['cases'])} cases to {GOLDEN.relative_to(GOLDEN.parent.parent.parent)}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    ap = argparse.ArgumentParser(description="Regenerate the simulator's golden figures.")
    ap.add_argument("--regenerate", action="store_true", help="rewrite tests/golden/simulator.json")
    if ap.parse_args().regenerate:
        regenerate()
    else:
        ap.print_help()
