"""The `soapflow` command: argument parsing, tables and JSON output over `soapflow.api`.

Every command takes `--json` (one JSON object on stdout instead of tables) and exits non-zero with a
one-line `soapflow: error: ...` on bad input, never a traceback. Warnings print as one line each on stderr.
Every command that simulates, searches, runs, validates or calibrates takes the training setup flags
(`--optimizer`, `--lr`, `--momentum`, `--weight-decay`, `--bucket-mb`, `--precision`, `--schedule`, defaults those of
`soap.setup.TrainSetup`), built once into one `TrainSetup` (`train_setup`) and passed down. Every command that
simulates on a preset (simulate, optimize, compare) takes `--no-shipped-costs`, passed down as
`shipped_costs=False` (`simulator.shipped`). Every command that takes a strategy file (simulate, compare, run)
captures the model at the batch size the file records unless `--batch` says otherwise, which warns
(`soapflow.api.strategy_batch`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from soap.setup import OPTIMIZERS, PRECISIONS, SCHEDULES, TrainSetup

EXIT_USAGE = 2


class CommandError(Exception):
    """Bad input found by a command; printed as one line."""


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    """A plain left/right aligned text table (numbers right-aligned)."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(isinstance(row[i], int | float) or row[i] is None for row in rows) if rows else False
               for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        parts = [c.rjust(w) if numeric[i] else c.ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:,.1f}"
        return f"{value:.3g}" if abs(value) < 0.01 else f"{value:.3f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def collectives_table(per_rank: Sequence[Mapping[str, Mapping[str, int]]]) -> str:
    """One row per (rank, collective kind): how many one step issues and their bytes."""
    rows = [[rank, kind, slot["count"], slot["bytes"]]
            for rank, kinds in enumerate(per_rank) for kind, slot in sorted(kinds.items())]
    return table(rows, ["rank", "collective", "count", "bytes"]) if rows else "no collectives"


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


# ---------------------------------------------------------------- commands


def cmd_models(args: argparse.Namespace) -> tuple[dict, str]:
    from soapflow import zoo

    rows = [{"name": m.name, "default_batch": m.default_batch, "description": m.description}
            for m in zoo.ZOO.values()]
    text = table([[r["name"], r["default_batch"], r["description"]] for r in rows],
                 ["model", "batch", "description"])
    return {"models": rows}, text


def _dims_text(op) -> str:
    from soap.registry import dims_of

    return " ".join(f"{d.name}:{d.kind.value[0].upper()}" for d in dims_of(op) if d.splittable)


def cmd_capture(args: argparse.Namespace) -> tuple[dict, str]:
    from soap.registry import dims_of
    from soapflow.api import capture_model

    spec, graph = capture_model(args.model, batch_size=args.batch)
    ops = [{
        "name": op.name, "kind": op.kind, "output_shape": list(op.output.shape), "num_params": op.num_params,
        "gflops": (op.fwd_flops + op.bwd_flops) / 1e9,
        "dims": [{"name": d.name, "kind": d.kind.value, "size": d.size} for d in dims_of(op) if d.splittable],
    } for op in graph]
    out = {"model": spec.name, "batch_size": graph.batch_size, "fingerprint": graph.fingerprint,
           "num_params": graph.num_params, "module_params": sum(p.numel() for p in spec.module.parameters()),
           "total_gflops": graph.total_flops / 1e9, "num_ops": len(graph), "ops": ops}
    rows = [[o["name"], o["kind"], "x".join(map(str, o["output_shape"])) or "scalar", o["num_params"],
             round(o["gflops"], 3), _dims_text(op)] for o, op in zip(ops, graph, strict=True)]
    text = "\n".join([
        table(rows, ["op", "kind", "output", "params", "GFLOPs", "splittable dims (S/A/P/R)"]),
        "",
        f"{spec.name}: {len(graph)} ops, {graph.num_params:,} parameters, batch {graph.batch_size}, "
        f"{graph.total_flops / 1e9:,.2f} GFLOPs per iteration (forward + backward), "
        f"fingerprint {graph.fingerprint[:12]}",
    ])
    return out, text


def cmd_topology(args: argparse.Namespace) -> tuple[dict, str]:
    from soap.topology import load_topology

    topo = load_topology(args.topology)
    doc = topo.to_dict()
    rows = topo.describe()
    text = f"{topo.name}: {topo.num_devices} devices on {topo.num_nodes} node(s), {len(topo.links)} links\n"
    text += table([list(r.values()) for r in rows], list(rows[0].keys())) if rows else ""
    return {"name": topo.name, "num_devices": topo.num_devices, "num_nodes": topo.num_nodes,
            "summary": rows, "topology": doc}, text


def cmd_simulate(args: argparse.Namespace) -> tuple[dict, str]:
    from simulator.engine import simulator_of
    from simulator.shipped import shipped_report
    from soapflow.api import capture_model, resolve_strategy, strategy_batch
    from soapflow.optimize import topology_and_cost_model
    from soapflow.report import shipped_costs_text

    setup = train_setup(args)
    topo, cost_model = topology_and_cost_model(args.topology, args.costdb, shipped_costs=not args.no_shipped_costs)
    spec, graph = capture_model(args.model, batch_size=strategy_batch([args.strategy], batch=args.batch))
    strategy = resolve_strategy(args.strategy, graph=graph, topology=topo, setup=setup)
    # a trace shows every device's tasks: no simulation by one replica then
    sim, timeline = simulator_of(graph, strategy, topo, cost_model, setup=setup, symmetry=not args.trace)
    out = {"model": spec.name, "batch_size": graph.batch_size, "topology": topo.name, "strategy": args.strategy,
           "setup": setup.to_dict(), **timeline.summary(), "collectives": sim.collectives(),
           "shipped_costs": shipped_report(cost_model)}
    if args.trace:
        timeline.write_chrome_trace(args.trace)
        out["trace"] = args.trace
    peak = out["peak_memory_bytes"]
    lines = [
        f"{spec.name} (batch {graph.batch_size}) on {topo.name} with {args.strategy}: "
        f"{out['iteration_time_ms']:.3f} ms per iteration"
        + ("" if out["feasible"] else "  (INFEASIBLE: out of memory)"),
        "",
        table([
            ["compute (critical path)", out["compute_ms"]],
            ["communication (critical path)", out["comm_ms"]],
            ["gradient sync (critical path)", out["sync_ms"]],
            ["bytes moved", _human_bytes(out["bytes_moved"])],
            ["peak memory per device (max)", _human_bytes(max(peak))],
            ["peak memory per device (min)", _human_bytes(min(peak))],
            ["tasks", out["num_tasks"] if timeline.replicas == 1 else
             f"{out['num_tasks']} (one of {timeline.replicas} identical replicas, simulated for all)"],
        ], ["", "value"]),
    ]
    costs = shipped_costs_text(out["shipped_costs"])
    if costs:
        lines.append(costs)
    for o in out.get("oom") or []:
        lines.append(f"device {o['device']} needs {_human_bytes(o['need_bytes'])} but holds "
                     f"{_human_bytes(o['capacity_bytes'])}")
    if args.trace:
        lines.append(f"trace written to {args.trace} (open it in Perfetto or chrome://tracing)")
    return out, "\n".join(lines)


class Progress:
    """Progress of a long command on stderr. On a terminal: one line redrawn at most 5 times a second. Else
    (a log file, a pipe): once the job has run `LINE_AFTER_S` (so a quick job or an early error stays one
    line), a plain line whenever the stage changes (the fields named in `LINE_KEYS`) and at most one a minute
    between, so a job in a log shows where it is. `enabled=False` (the commands' `--json`) silences it."""

    LINE_KEYS = ("stage", "model", "strategy", "round")
    LINE_AFTER_S = 5.0
    LINE_EVERY_S = 60.0

    def __init__(self, label: str, *, total_s: float | None = None, enabled: bool | None = None) -> None:
        self.label, self.total_s = label, total_s
        self.enabled = True if enabled is None else enabled
        self.terminal = sys.stderr.isatty()
        self._last = 0.0
        self._shown = False
        self._key: tuple | None = None

    def __call__(self, info: dict) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        elapsed = float(info.get("elapsed_s") or 0.0)
        key = tuple(info.get(k) for k in self.LINE_KEYS)
        if self.terminal and now - self._last < 0.2:
            return
        if not self.terminal and (elapsed < self.LINE_AFTER_S
                                  or key == self._key and now - self._last < self.LINE_EVERY_S):
            return
        self._last, self._key = now, key
        bar = ""
        if self.total_s:
            done = min(elapsed / self.total_s, 1.0)
            bar = "[" + "#" * int(done * 24) + "." * (24 - int(done * 24)) + "] "
        fields = " ".join(f"{k.removesuffix('_ms').replace('_per_s', '/s')}={_fmt(v)}"
                          + (" ms" if k.endswith("_ms") else "")
                          for k, v in info.items() if k != "elapsed_s")
        if self.terminal:
            print(f"\r{self.label} {bar}{elapsed:5.1f}s {fields}\033[K", end="", file=sys.stderr, flush=True)
            self._shown = True
        else:
            print(f"{self.label} {elapsed:7.1f}s {fields}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._shown:
            print(file=sys.stderr)


def cmd_optimize(args: argparse.Namespace) -> tuple[dict, str]:
    from soapflow.optimize import optimize
    from soapflow.report import optimize_text

    if args.budget is not None and not args.budget > 0:
        raise CommandError(f"--budget must be > 0 seconds, got {args.budget}")
    if args.jobs < 1:
        raise CommandError(f"--jobs must be at least 1, got {args.jobs}")
    if args.measure_rounds < 0:
        raise CommandError(f"--measure-rounds must be >= 0, got {args.measure_rounds}")
    if args.confirm_runs < 0:
        raise CommandError(f"--confirm-runs must be >= 0, got {args.confirm_runs}")
    setup = train_setup(args)
    bar = Progress("searching", total_s=args.budget, enabled=None if not args.json else False)
    try:
        out = optimize(args.model, args.topology, batch=args.batch, budget_s=args.budget, seed=args.seed,
                       jobs=args.jobs, max_proposals=args.proposals, out_path=args.output, progress=bar,
                       plot=args.plot, cost_model=args.costdb, measure_rounds=args.measure_rounds,
                       confirm_runs=args.confirm_runs, setup=setup, shipped_costs=not args.no_shipped_costs,
                       replicas=args.replicas, replica_phase=not args.no_replica_phase)
    finally:
        bar.close()
    text = optimize_text(out)
    if args.plot:
        text += f"\nconvergence plot written to {args.plot}"
    return out, text


def cmd_compare(args: argparse.Namespace) -> tuple[dict, str]:
    from soapflow.api import strategy_batch
    from soapflow.optimize import compare
    from soapflow.report import compare_text
    from soapflow.tables import write_csv

    if args.repeats < 1:
        raise CommandError(f"--repeats must be at least 1, got {args.repeats}")
    setup = train_setup(args)
    batch = strategy_batch(args.strategy or [], batch=args.batch)
    out = compare(args.model, args.topology, strategies=args.strategy, batch=batch, measure=args.measure,
                  steps=args.steps, repeats=args.repeats, plot=args.plot, cost_model=args.costdb, setup=setup,
                  shipped_costs=not args.no_shipped_costs)
    text = compare_text(out)
    if args.plot:
        text += f"\nbar chart written to {args.plot}"
    if args.csv:
        write_csv(args.csv, out["rows"])
        text += f"\nrows written to {args.csv}"
    return out, text


def cmd_run(args: argparse.Namespace) -> tuple[dict, str]:
    from soapflow.runner import run

    if args.steps < 1:
        raise CommandError(f"--steps must be at least 1, got {args.steps}")
    setup = train_setup(args)
    extra: dict[str, Any] = {}
    if args.checkpoint_dir is not None:
        extra.update(checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every)
    elif args.checkpoint_every:
        raise CommandError("--checkpoint-every needs --checkpoint-dir")
    if args.resume:
        if args.checkpoint_dir is None:
            raise CommandError("--resume needs --checkpoint-dir")
        extra["resume"] = True
    out = run(args.model, args.strategy, nproc=args.nproc, steps=args.steps, backend=args.backend,
              verify=args.verify, batch=args.batch, setup=setup, seed=args.seed, dtype=args.dtype, **extra)
    lines = [f"{out['model']} (batch {out['batch_size']}) with {out['strategy']} on {out['nproc']} "
             f"process(es), {out['backend']}: {out['steps']} steps"]
    first = out.get("first_step", 0)
    if first:
        lines.append(f"resumed from {out['resumed_from']}: {first} steps done before")
    if out["losses"]:
        rows = [[i, f"{loss:.6f}"] for i, loss in enumerate(out["losses"], start=first)]
        lines.append(table(rows, ["step", "loss"]))
        if out.get("skipped_steps"):
            lines.append(f"fp16 loss scaling skipped the update of step(s) "
                         f"{', '.join(map(str, out['skipped_steps']))}: a gradient overflowed, and the scale was "
                         f"halved each time")
        lines.append("median step time per rank (ms): " + " ".join(f"{t:.2f}" for t in out["step_time_ms"]))
        lines += ["collectives of the last step:", collectives_table(out["collectives"])]
    else:
        lines.append(f"nothing left to run: the checkpoint holds all {out['steps']} steps asked for (--steps "
                     f"above {out['steps']} trains further)")
    v = out.get("verify")
    if v:
        tol = v["tolerance"]
        params = (f"largest parameter difference {v['max_param_rel_diff']:.3g} of its update (allowed "
                  f"{tol['rtol']:.0e}, floor {tol['atol']:.0e} absolute; worst {v['worst_param']}, "
                  f"{v['max_param_abs_diff']:.3g} absolute)")
        if not v.get("params_checked", True):
            params = (f"parameters not checked (AdamW amplifies rounding: {v['max_param_rel_diff']:.3g} of an "
                      f"update at most, worst {v['worst_param']}; --dtype float64 checks them)")
        grads = ("" if v.get("max_grad_rel_diff") is None else
                 f", first step's gradients {v['max_grad_rel_diff']:.3g} (allowed {tol['rtol']:.0e}; worst "
                 f"{v['worst_grad']})")
        if v.get("max_grad_rel_diff") is None and v.get("gradients_step") != v.get("reference_gradients_step"):
            def when(step: int | None) -> str:
                return "at no step" if step is None else f"at step {step}"
            grads = (f", gradients not compared (the loss scaler skipped other steps: the run first updated "
                     f"{when(v.get('gradients_step'))}, the reference {when(v.get('reference_gradients_step'))})")
        lines.append(f"verify against single-process training: {'passed' if v['passed'] else 'FAILED'}; "
                     f"largest loss difference {v['max_loss_rel_diff']:.3g} (relative; allowed "
                     f"{tol['loss_rtol']:.0e}){grads}, {params}")
        if v["nan_params"] or v["params_not_held"]:
            lines.append(f"  NaN parameters: {v['nan_params']}; parameters no rank holds: {v['params_not_held']}")
    return out, "\n".join(lines)


def cmd_calibrate(args: argparse.Namespace) -> tuple[dict, str]:
    from soapflow.calibrate import calibrate, calibrate_text

    setup = train_setup(args)
    bar = Progress("calibrating", enabled=None if not args.json else False)
    try:
        out = calibrate(nproc=args.nproc, backend=args.backend, output=args.output, costdb=args.costdb,
                        progress=bar, setup=setup)
    finally:
        bar.close()
    return out, calibrate_text(out)


def cmd_validate(args: argparse.Namespace) -> tuple[dict, str]:
    from soapflow.tables import write_csv
    from soapflow.validate import validate, validate_text

    setup = train_setup(args)
    bar = Progress("validating", enabled=None if not args.json else False)
    try:
        out = validate(args.model, args.topology, strategies=args.strategies, seed=args.seed, steps=args.steps,
                       batch=args.batch, plot=args.plot, progress=bar, costdb=args.costdb, setup=setup,
                       **({} if args.timeout is None else {"timeout_s": args.timeout}))
    finally:
        bar.close()
    text = validate_text(out)
    if args.plot:
        text += f"\nscatter plot written to {args.plot}"
    if args.csv:
        write_csv(args.csv, out["rows"])
        text += f"\nrows written to {args.csv}"
    return out, text


COMMANDS: dict[str, Callable[[argparse.Namespace], tuple[dict, str]]] = {
    "simulate": cmd_simulate,
    "models": cmd_models,
    "capture": cmd_capture,
    "topology": cmd_topology,
    "optimize": cmd_optimize,
    "compare": cmd_compare,
    "run": cmd_run,
    "calibrate": cmd_calibrate,
    "validate": cmd_validate,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="soapflow",
        description="Find, simulate and run SOAP parallelization strategies for PyTorch models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
        # the command's own parser, for errors argparse leaves to the caller (`main`)
        p.set_defaults(command_parser=p)
        return p

    add("models", "list the model zoo")
    p = add("capture", "capture a model into an operator graph and print its ops")
    _model_args(p)
    p = add("topology", "describe a topology preset (KIND-NxM, cpu-N) or topology file")
    p.add_argument("topology", metavar="PRESET|FILE")
    p = add("simulate", "simulate one training iteration of a model under a strategy")
    _model_args(p, strategy_file=True)
    _topology_arg(p)
    p.add_argument("-s", "--strategy", required=True, metavar="STRATEGY", help=_STRATEGY_HELP)
    p.add_argument("--trace", metavar="FILE", help="write a Chrome trace JSON of the simulated iteration")
    _costdb_arg(p)
    _shipped_costs_arg(p)
    _setup_args(p)

    p = add("optimize", "search the fastest strategy that fits in memory (MCMC over per-op configs)")
    _model_args(p)
    _topology_arg(p)
    p.add_argument("--budget", type=float, default=60.0, metavar="SECONDS",
                   help="wall-clock search budget (default: 60); tidying the best strategy may take up to a "
                        "tenth more")
    p.add_argument("--proposals", type=int, metavar="N",
                   help="also stop after N proposals (with a fixed N the result depends on --seed alone)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--jobs", type=int, default=1, metavar="N", help="run the chains in N processes")
    p.add_argument("--replicas", type=int, metavar="R",
                   help="search only strategies made of R identical replicas (R divides the devices; say, one "
                        "per node), each simulated by one replica: faster proposals in a smaller space")
    p.add_argument("--no-replica-phase", action="store_true",
                   help="where no baseline fits, do not search strategies of one replica per device first "
                        "(half the budget) before searching every strategy")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="strategy file to write (default: strategy-MODEL-TOPOLOGY.json)")
    p.add_argument("--plot", metavar="FILE.png", help="draw the convergence curve (needs matplotlib)")
    p.add_argument("--measure-rounds", type=int, default=0, metavar="N",
                   help="with -t a machine profile of this machine: time the op parts of the best strategy and "
                        "the baselines that its cost database lacks, then search again; up to N rounds")
    p.add_argument("--confirm-runs", type=int, default=0, metavar="N",
                   help="with -t cpu-N or a machine profile of this machine: train the best and every baseline N "
                        "times each (interleaved) and write the one that measured fastest")
    _costdb_arg(p)
    _shipped_costs_arg(p)
    _setup_args(p)

    p = add("compare", "simulate the baselines and given strategies side by side (and measure them)")
    _model_args(p, strategy_file=True)
    _topology_arg(p)
    p.add_argument("-s", "--strategy", action="append", metavar="STRATEGY",
                   help="strategy file to show beside the baselines; repeat for several")
    p.add_argument("--measure", action="store_true",
                   help="also run each strategy with the runtime here (topology cpu-N) and time it")
    p.add_argument("--steps", type=int, default=10, help="steps per measured run (default: 10)")
    p.add_argument("--repeats", type=int, default=1,
                   help="measured runs per strategy, interleaved; the median is shown (default: 1)")
    p.add_argument("--plot", metavar="FILE.png", help="draw a bar chart of the strategies (needs matplotlib)")
    p.add_argument("--csv", metavar="FILE", help="also write the rows (those of --json) as CSV")
    _costdb_arg(p)
    _shipped_costs_arg(p)
    _setup_args(p)

    p = add("run", "train a model under a strategy on real processes (torch.distributed)")
    _model_args(p, strategy_file=True)
    p.add_argument("-s", "--strategy", required=True, metavar="STRATEGY", help=_STRATEGY_HELP)
    p.add_argument("--nproc", type=int, metavar="N",
                   help="processes to start, one per device (default: the strategy file's, else 2)")
    p.add_argument("--steps", type=int, default=10, help="training steps (default: 10)")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"), help="default: gloo")
    p.add_argument("--verify", action="store_true",
                   help="also train the unpartitioned model in one process and compare the losses, the first "
                        "step's gradients and the final parameters (under AdamW: in float64 only)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"),
                   help="dtype of the weights and of float32 computation (default: float32; float64 makes "
                        "--verify tight where float32 rounding grows over the steps)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and synthetic batches")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="save checkpoints here")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="K", help="save every K steps")
    p.add_argument("--resume", action="store_true", help="continue from the last complete checkpoint")
    _setup_args(p)

    p = add("calibrate", "measure this machine and write a machine profile (a topology file) for -t")
    p.add_argument("--nproc", type=int, default=2, metavar="N", help="local processes (default: 2)")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"), help="default: gloo")
    p.add_argument("-o", "--output", default="machine.json", metavar="FILE",
                   help="machine profile to write (default: machine.json)")
    p.add_argument("--costdb", metavar="FILE",
                   help="cost database to fill and reuse (default: beside the profile)")
    _setup_args(p)

    p = add("validate", "predict and measure strategies here; report the simulator's error")
    p.add_argument("model", nargs="+", metavar="MODEL", help="zoo names or path/to/file.py:function")
    p.add_argument("--batch", type=int, help="global batch size (default: each model's)")
    _topology_arg(p)
    p.add_argument("--strategies", type=int, default=8, metavar="K", help="strategies per model (default: 8)")
    p.add_argument("--steps", type=int, default=5, help="measured steps per round (default: 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random strategies")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="fail a training step (or a wait for another process) that takes longer; the whole run "
                        "has no limit (default: 600)")
    p.add_argument("--plot", metavar="FILE.png", help="scatter plot of predicted against measured (needs matplotlib)")
    p.add_argument("--csv", metavar="FILE", help="also write the rows (those of --json) as CSV")
    _costdb_arg(p)
    _setup_args(p)
    return parser


# The help of each `TrainSetup` field's flag; the defaults are read from the dataclass.
_SETUP_HELP = {
    "optimizer": f"optimizer: {' or '.join(OPTIMIZERS)}",
    "lr": "learning rate",
    "momentum": "SGD momentum (0: plain SGD, no optimizer state)",
    "weight_decay": "weight decay",
    "precision": f"compute precision: {', '.join(PRECISIONS)}",
    "bucket_mb": "gradient all-reduce bucket size in MiB",
    "schedule": f"pipeline schedule of micro-batches: {' or '.join(SCHEDULES)}",
}


def _setup_args(p: argparse.ArgumentParser) -> None:
    """The training setup flags, one per `TrainSetup` field (`--weight-decay` for `weight_decay`).

    Values are checked by `TrainSetup` itself (`train_setup`), so that a bad one is the command's one-line
    error rather than argparse's usage message."""
    group = p.add_argument_group("training setup (one value for simulation, search and runtime)")
    for f in dataclasses.fields(TrainSetup):
        kind = str if isinstance(f.default, str) else float
        group.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=kind, default=None,
                           metavar="NAME" if kind is str else "X",
                           help=f"{_SETUP_HELP[f.name]} (default: {f.default})")


def train_setup(args: argparse.Namespace) -> TrainSetup:
    """The `TrainSetup` of the command's flags, the dataclass's defaults for those not given (`ValueError`,
    one line, naming a bad value). A flag the chosen optimizer does not read (`--momentum` under AdamW)
    warns."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainSetup) if getattr(args, f.name) is not None}
    setup = TrainSetup(**given)
    if "momentum" in given and setup.optimizer != "sgd":
        warnings.warn(f"--momentum is SGD's: {setup.optimizer} does not use it", stacklevel=2)
    return setup


def _costdb_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--costdb", metavar="FILE", help="cost database (JSON lines) of measured op costs")


def _shipped_costs_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-shipped-costs", action="store_true",
                   help="price op parts analytically only, ignoring the cost database measured on this preset's "
                        "GPU kind and shipped with soapflow (presets only: a topology file never uses it)")


# What -s takes: `soapflow.api.resolve_strategy`'s references (README.md's STRATEGY says what each is).
_STRATEGY_HELP = ("strategy file or baseline: dp, mp, tp, expert, fsdp, mp:chunks=K,microbatches=M, expert:chunks=K "
                  "or hybrid:tp=T[,pp=P][,microbatches=M][,shard=S][,ep=E][,recompute=none|full]")


def _model_args(p: argparse.ArgumentParser, *, strategy_file: bool = False) -> None:
    """MODEL and --batch; `strategy_file`: the command takes strategy files, whose batch size is the default."""
    p.add_argument("model", metavar="MODEL",
                   help="zoo name, path/to/file.py:function or package.module:function")
    p.add_argument("--batch", type=int,
                   help="global batch size (default: the strategy file's, else the model's)" if strategy_file
                   else "global batch size (default: the model's)")


def _topology_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("-t", "--topology", required=True, metavar="TOPOLOGY",
                   help="preset (KIND-NxM, cpu-N) or topology JSON file")


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"soapflow: warning: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # argparse's own check would print the top-level usage, not the command's
        args.command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    warnings.showwarning = _show_warning
    try:
        _check_output_paths(args)
        out, text = COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("soapflow: interrupted", file=sys.stderr)
        return 130
    except (ValueError, CommandError, OSError) as exc:
        return _error(exc)
    except RuntimeError as exc:
        launch = sys.modules.get("runtime.launch")  # loaded only by commands that start processes
        if launch is not None and isinstance(exc, launch.LaunchError):
            return _error(exc)
        raise
    if out.get("rank") not in (None, 0):
        return 0  # under torchrun every rank runs the command; rank 0 speaks for the job
    try:
        print(json.dumps(out, default=_json_default) if args.json else text, flush=True)
    except BrokenPipeError:  # the reader left (`soapflow ... | head`): no more output, as other tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush cannot fail
        return 141  # 128 + SIGPIPE, the shell's code for a writer whose reader left
    verify = out.get("verify")
    if verify and not verify["passed"]:  # a check that failed fails the command, so that scripts see it
        print("soapflow: error: --verify failed: the run differs from single-process training beyond the "
              "tolerance (differences above)", file=sys.stderr)
        return 1
    return 0


# The flags that name a file to write, checked before a command spends minutes and then cannot write it.
_OUTPUT_FLAGS = {"output": "-o/--output", "trace": "--trace", "plot": "--plot", "csv": "--csv"}


def _check_output_paths(args: argparse.Namespace) -> None:
    from soap.files import unwritable_reason

    for dest, flag in _OUTPUT_FLAGS.items():
        path = getattr(args, dest, None)
        if path is None:
            continue
        if os.path.isdir(path):
            raise CommandError(f"{flag} {path!r} is a directory; give a file name")
        reason = unwritable_reason(os.path.dirname(path) or ".")
        if reason is not None:
            raise CommandError(f"{flag} {path!r} cannot be written: {reason}")


def _error(exc: BaseException) -> int:
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    print(f"soapflow: error: {message}", file=sys.stderr)
    return 1


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, set | tuple):
        return list(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


if __name__ == "__main__":
    sys.exit(main())
