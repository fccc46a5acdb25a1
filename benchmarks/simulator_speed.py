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

`--compare-with CHECKOUT` also runs this benchmark of another checkout of the project (an older commit,
say) in a subprocess, alternating with this one for `--rounds` rounds, and reports per case the ratios
this / that of the full and delta medians (the median over the rounds): a side-by-side comparison on one
machine at one time, which absolute times from different days are not.

Writes a table to stdout and to benchmarks/results/<name>.md, the raw figures to <name>.json::

    python benchmarks/simulator_speed.py                       # the reported run
    python benchmarks/simulator_speed.py --compare-with ../older-checkout --rounds 3
    python benchmarks/simulator_speed.py --proposals 100 --name simulator_speed_quick
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import tempfile
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


def other_checkout(path: Path, args: argparse.Namespace) -> list[dict]:
    """The rows of this benchmark run in the checkout at `path` (its own code), in a subprocess."""
    with tempfile.TemporaryDirectory() as tmp:
        name = f"speed_compare_{Path(tmp).name}"
        cmd = [sys.executable, str(path / "benchmarks" / "simulator_speed.py"), "--repeats", str(args.repeats),
               "--proposals", str(args.proposals), "--full-every", str(args.full_every), "--seed", str(args.seed),
               "--cases", args.cases, "--name", name]
        subprocess.run(cmd, cwd=path, check=True, stdout=subprocess.DEVNULL)
        out = path / "benchmarks" / "results"
        try:
            return json.loads((out / f"{name}.json").read_text())["rows"]
        finally:
            for suffix in (".json", ".md"):
                (out / f"{name}{suffix}").unlink(missing_ok=True)


def compare_rows(mine: list[list[dict]], theirs: list[list[dict]]) -> list[dict]:
    """Per case, the median over rounds of this / that for the full and delta medians."""
    out = []
    for k, row in enumerate(mine[0]):
        full = [m[k]["full_ms"] / t[k]["full_ms"] for m, t in zip(mine, theirs, strict=True)]
        delta = [m[k]["delta_ms"] / t[k]["delta_ms"] for m, t in zip(mine, theirs, strict=True)]
        out.append({"topology": row["topology"], "full_ratio": statistics.median(full),
                    "delta_ratio": statistics.median(delta), "full_ratios": full, "delta_ratios": delta,
                    "their_full_ms": statistics.median(t[k]["full_ms"] for t in theirs),
                    "their_delta_ms": statistics.median(t[k]["delta_ms"] for t in theirs),
                    "their_tasks": theirs[0][k]["num_tasks"]})
    return out


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
    if meta.get("compare"):
        c = meta["compare"]
        lines += [f"## Against {c['label']}", "",
                  f"The same benchmark of that checkout, alternating with this one for {c['rounds']} round(s) "
                  "(medians of this / that over the rounds; below 1 is faster here).", "",
                  "| topology | tasks there | full ms there | full ratio | delta ms there | delta ratio |",
                  "|---|---:|---:|---:|---:|---:|"]
        for r in c["rows"]:
            lines.append(f"| {r['topology']} | {r['their_tasks']} | {r['their_full_ms']:.1f} | {r['full_ratio']:.2f}"
                         f" | {r['their_delta_ms']:.2f} | {r['delta_ratio']:.2f} |")
        lines.append("")
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
    ap.add_argument("--compare-with", type=Path, default=None, metavar="CHECKOUT",
                    help="also run this benchmark of another checkout, alternating, and report the ratios")
    ap.add_argument("--label", default=None, help="how the table names the other checkout (default: its path)")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds with --compare-with")
    args = ap.parse_args(argv)
    mine: list[list[dict]] = []
    theirs: list[list[dict]] = []
    for _ in range(args.rounds if args.compare_with else 1):
        rows = []
        for case in args.cases.split(","):
            model, topo = case.split(":")
            row = run_case(model, topo, repeats=args.repeats, proposals=args.proposals,
                           full_every=args.full_every, seed=args.seed)
            print(f"  {model} {topo}: full {row['full_ms']:.1f} ms, delta {row['delta_ms']:.2f} ms, "
                  f"speed-up {row['delta_speedup']:.2f}x", file=sys.stderr, flush=True)
            rows.append(row)
        mine.append(rows)
        if args.compare_with:
            theirs.append(other_checkout(args.compare_with.resolve(), args))
    meta = {"python": platform.python_version(), "machine": platform.machine(), "argv": sys.argv[1:]}
    if args.compare_with:
        meta["compare"] = {"label": args.label or str(args.compare_with), "rounds": args.rounds,
                           "rows": compare_rows(mine, theirs)}
    rows = mine[-1]
    text = render(rows, meta)
    print(text)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.md").write_text(text)
    (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
