"""Simulation at 512 GPUs: GPT-2 medium on a100-64x8, timed by one replica and checked against all devices.

Cases: GPT-2 medium (24 layers, hidden 1024, 16 heads, sequence 1024, vocabulary 50,257; the zoo
transformer with fused attention, built on the meta device) at batch 2048 (4 sequences per GPU) on the
`a100-64x8` preset (64 nodes of 8 A100s, NVSwitch, a NIC per GPU), analytical cost model, fp32, SGD,
under `dp` and `hybrid:tp=8` (tensor parallel in each node, data parallel across nodes).

- replica: `simulate(graph, strategy, topology)` from scratch (a fresh simulator: no plan or route cache),
  `--repeats` times: CPU seconds per call (median), capture excluded. Both strategies are R identical
  replicas (R = 512 and 64): the simulator times replica 0 alone where that is exact
  (`simulator.engine.simulate`, `soap.lowering.find_replicas`). Target: at most 1 s for dp;
- every device: the same with `symmetry=False` (once): every part of every op on every device. The
  iteration time, the per-device peak memory and the bytes moved must be equal (checked), which is the
  exactness of the replica simulation at this scale.

Times are CPU seconds of this process (`time.process_time`: the machine may be shared; the simulator is
single-threaded). Writes a table to stdout and to benchmarks/results/<name>.md, the raw figures to
<name>.json::

    python benchmarks/simulator_scale.py
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from search.baselines import parse_baseline  # noqa: E402
from simulator import simulate  # noqa: E402
from soap.topology import load_topology  # noqa: E402
from soapflow.api import capture_model  # noqa: E402
from soapflow.zoo import transformer  # noqa: E402

TOPOLOGY = "a100-64x8"
BATCH = 2048
STRATEGIES = ("dp", "hybrid:tp=8")
TARGET_S = 1.0


def gpt2_medium(batch_size: int = BATCH) -> tuple:
    with torch.device("meta"):
        return transformer(batch_size, layers=24, d_model=1024, heads=16, seq=1024, context=None, vocab=50257,
                           attention="sdpa")


def _cpu(fn):
    t0 = time.process_time()
    out = fn()
    return out, time.process_time() - t0


def run(repeats: int) -> list[dict]:
    _, graph = capture_model(f"{Path(__file__).resolve()}:gpt2_medium", batch_size=BATCH)
    topo = load_topology(TOPOLOGY)
    rows = []
    for name in STRATEGIES:
        strategy = parse_baseline(name)(graph, topo)
        times, timeline = [], None
        for _ in range(repeats):
            timeline, s = _cpu(lambda strategy=strategy: simulate(graph, strategy, topo))
            times.append(s)
        plain, plain_s = _cpu(lambda strategy=strategy: simulate(graph, strategy, topo, symmetry=False))
        equal = (timeline.iteration_time_ms == plain.iteration_time_ms
                 and timeline.peak_memory_bytes == plain.peak_memory_bytes
                 and timeline.bytes_moved == plain.bytes_moved)
        rows.append({"strategy": name, "num_ops": len(graph), "num_devices": topo.num_devices,
                     "replicas": timeline.replicas, "replica_tasks": timeline.num_tasks, "tasks": plain.num_tasks,
                     "replica_s": statistics.median(times), "replica_s_all": times, "plain_s": plain_s,
                     "iteration_ms": timeline.iteration_time_ms, "sync_ms": timeline.sync_ms,
                     "peak_gb": max(timeline.peak_memory_bytes) / 1e9, "equal": equal})
        print(f"  {name}: replica {rows[-1]['replica_s']:.2f} s, every device {plain_s:.1f} s, equal {equal}",
              file=sys.stderr)
    return rows


def render(rows: list[dict], meta: dict) -> str:
    dp = next(r for r in rows if r["strategy"] == "dp")
    met = dp["replica_s"] <= TARGET_S and all(r["equal"] for r in rows)
    lines = [
        "# Simulation at 512 GPUs (GPT-2 medium, a100-64x8, batch 2048)",
        "",
        f"Written by `python benchmarks/simulator_scale.py`; its module docstring says what is timed. "
        f"{meta['repeats']} fresh simulations per strategy (median CPU s), one of every device. "
        f"Machine: {meta['machine']}.",
        "",
        f"**dp simulated in {dp['replica_s']:.2f} s (target <= {TARGET_S:.0f} s: {'met' if met else 'NOT met'}); "
        f"replica and every-device simulations equal in {sum(r['equal'] for r in rows)} of {len(rows)} "
        f"strategies.**",
        "",
        "| strategy | ops | devices | replicas | tasks (one replica) | tasks (every device) | replica s | "
        "every device s | iteration ms | sync ms (critical path) | peak GB | equal |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['num_ops']} | {r['num_devices']} | {r['replicas']} | "
                     f"{r['replica_tasks']:,} | {r['tasks']:,} | {r['replica_s']:.2f} | {r['plain_s']:.1f} | "
                     f"{r['iteration_ms']:.1f} | {r['sync_ms']:.1f} | {r['peak_gb']:.1f} | "
                     f"{'yes' if r['equal'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="fresh replica simulations per strategy (median)")
    ap.add_argument("--name", default="simulator_scale", help="results file stem")
    args = ap.parse_args(argv)
    meta = {"repeats": args.repeats, "machine": f"{platform.machine()}, Python {platform.python_version()}"}
    rows = run(args.repeats)
    text = render(rows, meta)
    print(text)
    out = ROOT / "benchmarks" / "results"
    (out / f"{args.name}.md").write_text(text)
    (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
