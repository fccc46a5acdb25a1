"""Simulator speed: full simulation of inception_v3 under data parallelism, and delta against full.

Cases (the FlexFlow paper's setting, batch 64 per GPU): inception_v3 on p100-4x4 (16 devices, batch
1024) and on k80-16x4 (64 devices, batch 4096), analytical cost model, strategy dp.

- full: `Simulator.full(dp)` repeated (`--repeats`), after one warm-up call that fills the plan caches:
  tasks, median ms per simulation, tasks per second;
- delta vs full: `--proposals` random single-op proposals from dp (`search.space.ConfigSpace`, seeded),
  each costed by delta simulation (`propose` then `reject`) and, for every `--full-every`-th one, by a
  full simulation of the proposed strategy on a second simulator, side by side in the same run. Both
  simulators have seen every config once before timing starts (plans cached, as in a search). The
  speed-up is the median over the paired proposals of full time / delta time; the two iteration times
  must be equal (checked).

Times are CPU seconds of this process (`time.process_time`: the machine may be shared; the simulator is
single-threaded) with wall-clock medians alongside. Targets: full inception_v3 on 16 devices < 100 ms;
delta >= 5x full on 64 devices.

Writes a table to stdout and to benchmarks/results/<name>.md, the raw figures to <name>.json::

    python benchmarks/simulator_speed.py                       # the reported run
    python benchmarks/simulator_speed.py --proposals 100 --name simulator_speed_quick
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from search.baselines import dp  # noqa: E402
from search.space import ConfigSpace  # noqa: E402
from simulator import AnalyticalCostModel, Simulator  # noqa: E402
from soap.topology import load_topology  # noqa: E402
from soapflow.api import capture_model  # noqa: E402

CASES = (("inception_v3", "p100-4x4"), ("inception_v3", "k80-16x4"))
PER_GPU_BATCH = 64
TARGET_FULL_MS_16 = 100.0
TARGET_DELTA_SPEEDUP_64 = 5.0


def _timed(fn) -> tuple[float, float]:
    """(CPU s, wall s) of one call."""
    c0, w0 = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c0, time.perf_counter() - w0


def run_case(model: str, topology_name: str, *, repeats: int, proposals: int, full_every: int, seed: int) -> dict:
    topology = load_topology(topology_name)
    batch = PER_GPU_BATCH * topology.num_devices
    _, graph = capture_model(model, batch_size=batch)
    cost_model = AnalyticalCostModel()
    base = dp(graph, topology)
    sim = Simulator(graph, topology, cost_model)
    timeline = sim.full(base)  # warm-up: fills the plan caches
    full_cpu, full_wall = [], []
    for _ in range(repeats):
        c, w = _timed(lambda: sim.full(base))
        full_cpu.append(c)
        full_wall.append(w)
    space = ConfigSpace(graph, topology)
    rng = random.Random(seed)
    props = [space.propose(rng) for _ in range(proposals)]
    ref = Simulator(graph, topology, cost_model)
    for op, cfg in props:  # warm both simulators' plan caches, as a search would have
        sim.propose(op, cfg)
        sim.reject()
    for op, cfg in props[::full_every]:
        ref.full(base.with_config(op, cfg))
    delta_cpu, delta_wall, ratios, ratios_wall = [], [], [], []
    for k, (op, cfg) in enumerate(props):
        got: list[float] = []

        def one_delta(op=op, cfg=cfg, got=got):
            got.append(sim.propose(op, cfg))
            sim.reject()

        c, w = _timed(one_delta)
        delta_cpu.append(c)
        delta_wall.append(w)
        if k % full_every == 0:
            fc, fw = _timed(lambda op=op, cfg=cfg: ref.full(base.with_config(op, cfg)))
            assert ref.iteration_time_ms == got[0], f"delta {got[0]} != full {ref.iteration_time_ms} for {op}"
            ratios.append(fc / c if c > 0 else float("inf"))
            ratios_wall.append(fw / w if w > 0 else float("inf"))
    full_ms = statistics.median(full_cpu) * 1e3
    return {
        "model": model, "topology": topology_name, "num_devices": topology.num_devices, "batch": batch,
        "strategy": "dp", "num_ops": len(graph), "num_tasks": timeline.num_tasks,
        "iteration_time_ms": timeline.iteration_time_ms,
        "full_repeats": repeats, "full_ms": full_ms, "full_wall_ms": statistics.median(full_wall) * 1e3,
        "tasks_per_s": timeline.num_tasks / (full_ms / 1e3),
        "proposals": proposals, "paired_proposals": len(ratios), "full_every": full_every,
        "delta_ms": statistics.median(delta_cpu) * 1e3, "delta_wall_ms": statistics.median(delta_wall) * 1e3,
        "delta_speedup": statistics.median(ratios), "delta_speedup_wall": statistics.median(ratios_wall),
        "delta_speedup_p10": statistics.quantiles(ratios, n=10)[0] if len(ratios) >= 2 else None,
        "delta_speedup_p90": statistics.quantiles(ratios, n=10)[-1] if len(ratios) >= 2 else None,
    }


def render(rows: list[dict], meta: dict) -> str:
    lines = [
        "# Simulator speed",
        "",
        f"inception_v3, strategy dp, batch {PER_GPU_BATCH} per GPU, analytical cost model; CPU time of one "
        f"process (wall clock in parentheses). Python {meta['python']}, {meta['machine']}.",
        "",
        "| topology | devices | tasks | full ms (median) | tasks/s | delta ms (median) | delta speed-up "
        "(median, p10-p90) | proposals (paired) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        spread = (f"{r['delta_speedup_p10']:.1f}-{r['delta_speedup_p90']:.1f}"
                  if r["delta_speedup_p10"] is not None else "-")
        lines.append(
            f"| {r['topology']} | {r['num_devices']} | {r['num_tasks']} | {r['full_ms']:.1f} ({r['full_wall_ms']:.1f})"
            f" | {r['tasks_per_s']:.0f} | {r['delta_ms']:.2f} ({r['delta_wall_ms']:.2f}) | "
            f"{r['delta_speedup']:.2f}x ({r['delta_speedup_wall']:.2f}x wall), {spread} | "
            f"{r['proposals']} ({r['paired_proposals']}) |")
    by = {r["num_devices"]: r for r in rows}
    lines += ["", "Targets:"]
    if 16 in by:
        ok = by[16]["full_ms"] < TARGET_FULL_MS_16
        lines.append(f"- full inception_v3 on 16 devices < {TARGET_FULL_MS_16:.0f} ms: "
                     f"{by[16]['full_ms']:.1f} ms, {'met' if ok else 'NOT met'}")
    if 64 in by:
        ok = by[64]["delta_speedup"] >= TARGET_DELTA_SPEEDUP_64
        lines.append(f"- delta >= {TARGET_DELTA_SPEEDUP_64:.0f}x full on 64 devices: "
                     f"{by[64]['delta_speedup']:.2f}x, {'met' if ok else 'NOT met'}")
    lines += ["", "Every delta result equalled the full simulation's iteration time (checked in the run).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=9, help="full simulations per case (median)")
    ap.add_argument("--proposals", type=int, default=1000, help="random single-op proposals per case")
    ap.add_argument("--full-every", type=int, default=4,
                    help="also time a full simulation of every N-th proposal (the paired ones)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", default=",".join(f"{m}:{t}" for m, t in CASES),
                    help="comma-separated MODEL:TOPOLOGY")
    ap.add_argument("--name", default="simulator_speed", help="results file stem")
    args = ap.parse_args(argv)
    rows = []
    for case in args.cases.split(","):
        model, topo = case.split(":")
        row = run_case(model, topo, repeats=args.repeats, proposals=args.proposals, full_every=args.full_every,
                       seed=args.seed)
        print(f"  {model} {topo}: full {row['full_ms']:.1f} ms, delta {row['delta_ms']:.2f} ms, "
              f"speed-up {row['delta_speedup']:.2f}x", file=sys.stderr, flush=True)
        rows.append(row)
    meta = {"python": platform.python_version(), "machine": platform.machine(), "argv": sys.argv[1:]}
    text = render(rows, meta)
    print(text)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.md").write_text(text)
    (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
