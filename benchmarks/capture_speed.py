"""Capture time of every zoo model (fake tensors: no memory for the batch), medians over repeats.

Target (foundation issue): `resnet50` at batch 64 in under 10 s on this machine. Prints a table and
writes `benchmarks/results/capture_speed.md` and `.json`; also checks that every graph's parameter total
equals the module's `sum(p.numel())`.

    python benchmarks/capture_speed.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from soap.capture import capture
from soapflow import zoo
from soapflow.models import load_model
from soapflow.tables import frame, markdown_table

RESULTS = Path(__file__).parent / "results"
TARGET_S = 10.0


def time_capture(name: str, batch: int, repeats: int) -> dict:
    times, graph, spec = [], None, None
    for _ in range(repeats):
        spec = load_model(name, batch)  # building the module is not part of capture
        start = time.perf_counter()
        graph = capture(spec.module, spec.inputs, spec.target, spec.loss_fn,
                        name=name, batch_size=batch)
        times.append(time.perf_counter() - start)
    module_params = sum(p.numel() for p in spec.module.parameters())
    return {"model": name, "batch": batch, "ops": len(graph), "params": graph.num_params,
            "params_match": graph.num_params == module_params, "median_s": statistics.median(times),
            "repeats": repeats}


def table(rows: list[dict]) -> str:
    columns = {"model": "model", "batch": "batch", "ops": "ops", "params": "params",
               "params_match": "params match module", "median_s": "capture s (median)"}
    df = frame(rows, list(columns)).rename(columns=columns)
    return markdown_table(df, {"params": "{:,}".format, "capture s (median)": "{:.2f}".format},
                          right=("batch", "ops", "params", "capture s (median)"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [time_capture(name, 64, args.repeats) for name in zoo.ZOO]
    r50 = next(r for r in rows if r["model"] == "resnet50")
    verdict = (f"resnet50 at batch 64: {r50['median_s']:.2f} s (target < {TARGET_S:.0f} s: "
               f"{'met' if r50['median_s'] < TARGET_S else 'MISSED'}), one thread, median of {args.repeats}")
    text = "\n".join(["# Capture speed", "", table(rows), "", verdict, ""])
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "capture_speed.md").write_text(text)
    (RESULTS / "capture_speed.json").write_text(json.dumps({"rows": rows, "target_s": TARGET_S}, indent=1))


if __name__ == "__main__":
    main()
