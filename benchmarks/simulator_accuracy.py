"""Simulator accuracy on this machine: predicted against measured iteration times, calibrated and not.

Calibrates the machine (`soapflow.calibrate`: its own workloads, never the models below), then validates
(`soapflow.validate`) four small models - an MLP, a small CNN, an LSTM language model and a Transformer,
sized so that a training step takes well under 2 s on one core - with 8 strategies each on ``cpu-2``
(2 processes, 1 thread each): the baselines, the search's best, random valid strategies. Every row is
predicted twice: with the calibrated machine profile (measured op parts + fitted overhead, links and
constants) and with the uncalibrated ``cpu-2`` preset (analytical model, default constants).

Targets (per model): median |error| <= 10%, max |error| <= 25%, Spearman >= 0.9.

Writes ``benchmarks/results/simulator_accuracy.{json,md,png}`` and the profile it used
(``simulator_accuracy.machine.json`` with its cost database ``simulator_accuracy.costdb.jsonl``).

    python benchmarks/simulator_accuracy.py [--strategies 8] [--steps 5] [--rounds 6] [--reuse-profile]
                                            [--models mlp small_cnn small_rnnlm small_transformer]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from soapflow.plot import require_matplotlib
from soapflow.tables import frame, markdown_table

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TARGETS = {"median_abs_error": 0.10, "max_abs_error": 0.25, "spearman": 0.9}


# -- models under test (module-level builders: worker processes import this file to rebuild them) --------


class SmallCNN(nn.Module):
    """Two conv-BN-ReLU-pool stages and a linear classifier on 32x32 RGB images."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, kernel_size=3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, kernel_size=3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(64 * 8 * 8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def small_cnn(batch_size: int = 32) -> tuple:
    x = torch.empty(batch_size, 3, 32, 32, device="meta")
    labels = torch.empty(batch_size, dtype=torch.long, device="meta")
    return SmallCNN(), (x, labels)


def small_rnnlm(batch_size: int = 16) -> tuple:
    from soapflow.zoo.rnn import rnnlm

    return rnnlm(batch_size, hidden=256, embed=256, vocab=4000, steps=16, layers=2)


def small_transformer(batch_size: int = 8) -> tuple:
    from soapflow.zoo.transformer import transformer

    return transformer(batch_size, layers=2, d_model=128, heads=4, seq=64, vocab=2000)


def model_refs() -> dict[str, str]:
    here = os.path.relpath(Path(__file__).resolve(), Path.cwd())
    return {"mlp": "mlp", "small_cnn": f"{here}:small_cnn", "small_rnnlm": f"{here}:small_rnnlm",
            "small_transformer": f"{here}:small_transformer"}


# -- the benchmark -------------------------------------------------------------------------------------


def table(report: dict) -> str:
    headers = {"model": "model", "strategy": "strategy", "measured_ms": "measured ms",
               "predicted_ms": "calibrated ms", "error": "error", "refit_only_ms": "refit only ms",
               "refit_only_error": "error", "uncalibrated_ms": "uncalibrated ms", "uncalibrated_error": "error"}
    numbers = {key: ("{:+.1%}" if key.endswith("error") else "{:.1f}").format for key in list(headers)[2:]}
    lines = [markdown_table(frame(report["rows"], list(headers)), numbers, right=list(numbers),
                            headers=list(headers.values()))]

    def fmt(m: dict) -> str:
        rho = m["spearman"]
        return f"{m['median_abs_error']:.1%} / {m['max_abs_error']:.1%}, {'-' if rho is None else f'{rho:.2f}'}"

    extra = report["extra"]
    per_model = [(model, m, extra["refit_only"]["per_model"][model], extra["uncalibrated"]["per_model"][model])
                 for model, m in report["per_model"].items()]
    per_model.append(("overall", report, extra["refit_only"], extra["uncalibrated"]))
    summary = frame([{"model": model, "calibrated (measured parts + refit)": fmt(m), "refit analytical only": fmt(a),
                      "uncalibrated (cpu-2 preset, defaults)": fmt(u),
                      "targets met (calibrated)": ", ".join(met(m)) or "none"} for model, m, a, u in per_model])
    lines += ["", "Median / max absolute error and Spearman per model:", "", markdown_table(summary)]
    return "\n".join(lines)


def met(m: dict) -> list[str]:
    out = []
    if m["median_abs_error"] is not None and m["median_abs_error"] <= TARGETS["median_abs_error"]:
        out.append("median")
    if m["max_abs_error"] is not None and m["max_abs_error"] <= TARGETS["max_abs_error"]:
        out.append("max")
    if m["spearman"] is not None and m["spearman"] >= TARGETS["spearman"]:
        out.append("spearman")
    return out


def main(argv: list[str] | None = None) -> int:
    from soapflow.calibrate import calibrate, calibrate_text
    from soapflow.validate import validate, validate_text

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategies", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--models", nargs="+", default=list(model_refs()))
    p.add_argument("--reuse-profile", action="store_true",
                   help="keep the existing machine profile and cost database (default: measure afresh, so that "
                        "op parts, transfers and steps are all timed under the machine's current load)")
    p.add_argument("--search-budget", type=float, default=5.0)
    args = p.parse_args(argv)
    require_matplotlib()  # for the scatter plot, before the minutes of measuring
    torch.set_num_threads(1)
    RESULTS.mkdir(parents=True, exist_ok=True)
    profile = RESULTS / "simulator_accuracy.machine.json"
    db = RESULTS / "simulator_accuracy.costdb.jsonl"
    start = time.monotonic()
    calibration = None
    if not (args.reuse_profile and profile.is_file()):
        db.unlink(missing_ok=True)
        calibration = calibrate(2, "gloo", os.path.relpath(profile), os.path.relpath(db),
                                progress=lambda info: print(f"  calibrate: {info['stage']}", file=sys.stderr))
        print(calibrate_text(calibration))
        print()
    # the same profile without its cost database: the refitted analytical model alone
    doc = json.loads(profile.read_text())
    doc["calibration"]["costdb"] = None
    analytical = RESULTS / "simulator_accuracy.analytical.json"
    analytical.write_text(json.dumps(doc, indent=1) + "\n")
    refs = model_refs()
    report = validate([refs[m] for m in args.models], os.path.relpath(profile), strategies=args.strategies,
                      seed=args.seed, steps=args.steps, rounds=args.rounds, plot=RESULTS / "simulator_accuracy.png",
                      extra={"uncalibrated": "cpu-2", "refit_only": os.path.relpath(analytical)},
                      search_budget_s=args.search_budget,
                      progress=lambda info: print(f"  validate: {info}", file=sys.stderr))
    print(validate_text(report))
    report["plot"] = "simulator_accuracy.png"
    report["topology_ref"] = profile.name
    report["extra_refs"] = {"uncalibrated": "cpu-2", "refit_only": analytical.name}
    report["targets"] = TARGETS
    report["elapsed_s"] = time.monotonic() - start
    report["machine"] = {"cpus": os.cpu_count(), "torch": torch.__version__, "load_avg": os.getloadavg()}
    if calibration is not None:
        report["calibration"] = {k: v for k, v in calibration.items() if k not in ("output", "costdb")}
    (RESULTS / "simulator_accuracy.json").write_text(json.dumps(report, indent=1) + "\n")
    md = ["# Simulator accuracy (cpu-2: 2 processes, 1 thread each, gloo)", "",
          f"{len(report['rows'])} strategies, each the median over {args.rounds} rounds of a round's median of "
          f"{args.steps} steps (a model's strategies train in one job, interleaved round by round, the first "
          "step of each round dropped); "
          f"targets per model: median |error| <= 10%, max <= 25%, Spearman >= 0.9. "
          f"Load average during the run: {', '.join(f'{x:.1f}' for x in os.getloadavg())} on "
          f"{os.cpu_count()} cores (shared machine).", "", table(report), "",
          "![predicted vs measured](simulator_accuracy.png)", ""]
    (RESULTS / "simulator_accuracy.md").write_text("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
