"""Memory model against measurement: predicted peak memory per device vs the measured peak of each rank.

Five zoo models, sized so that both parameters (with their gradients and optimizer state) and
activations weigh, three strategies each on ``cpu-2``. Each row is one (model, strategy, rank).

- Predicted: the simulator's peak memory of the device (`simulator.engine.Simulator.peak_memory_bytes`,
  what ``soapflow simulate`` reports), under the same `TrainSetup` (optimizer, precision) as the run.
- Measured: the model trains `--steps` steps on 2 gloo processes (one thread each) with the runtime's own
  step (`runtime.train.train_step`); the last step runs under `runtime.memory.measure_step`, after the
  warm-up steps, so that the optimizer state exists as in every later step. The peak is the most tensor
  bytes live at once on the rank (torch's `MemTracker` on the CPU), counting from the start what the rank
  holds for the step (parameter shards, optimizer state, buffers, constants, the batch).
- Error: (predicted - measured) / measured; the target is a median |error| <= 15% over all rows.

What the model counts (`soap.lowering`, module docstring, "Memory of a device"): an upper bound without
liveness of what a device keeps over the step (each part's outputs, but none of view ops, what its
kernel saves for backward besides (`OpDef.saved_bytes`: log-probabilities, pooling indices, masks), the
batch regions it reads, received pieces and partial-sum buffers, what it keeps of a recomputing
producer's output, the parameters, gradients and optimizer state of its shards) plus the largest
transient of one part (its recomputed outputs; the gathered parameters of a sharded part and their
gradient; in backward, the gradients of its outputs and of the inputs it reads).

Where prediction and measurement differ by construction (the model has no term, or another rule):

- Liveness. The runtime frees each op's activations during backward (`Executor.backward`) while the
  gradients appear, so the two never peak together; the model adds them (an overestimate, largest where
  activations and gradients are alike).
- What the model leaves out: the flat copy a gradient bucket of several gradients makes when it is
  launched (`runtime.collectives.GradSync`: for a moment the gradients and the bucket both live; AlexNet's
  fc6 weight and bias are one bucket of 144 MiB), the sharded parts' padding and staging buffers around
  their all-gathers and reduce-scatters, the exchanges' send buffers and assembled inputs (the model
  counts the received pieces), the optimizer's temporaries (AdamW's denominator: two of a parameter's
  size), normalization statistics, and kernels' workspaces beyond what the equations need (torch's CPU
  LSTM keeps about 2.5 times the gates and states the model counts).
- Recomputation. The runtime recomputes a chain of recomputing ops at one point before backward, so all
  their outputs are live together; the model's transient is the largest single part's.
- Every rank holds the whole global batch (the synthetic loader gives every rank all of it); the model
  counts only the regions a device's parts read.
- Not measured: kernels' scratch memory without a tensor, the allocator's slack, and the full model this
  benchmark builds before taking the shards (outside the step; reported as `module_bytes`, not counted).

Result (benchmarks/results/memory_model.md): the target is met, median |error| 5.5% over 30 rows, max
16.8%. The largest misses are the rows the exclusions above name: the LSTM language model under `tp`
and `fsdp` (-17%, -15%: the CPU kernel's workspace and the exchange buffers), AlexNet under `dp` (-15%:
the bucket copy of fc6) and the transformer under `dp` (+15%: parameter gradients and activations never
peak together). `--explain` attributes each row's miss to the terms of the model (its last table).

With `--explain`, each strategy runs one more step under a tracker that also remembers which runtime
function allocated each storage, and the results add, per row, what is live at that peak by category
(parameters, their gradients, optimizer state and temporaries, batch, kept op outputs, other kernel
allocations, activation gradients, exchange buffers, gradient buckets, sharded parts' buffers): the
evidence for which term of the prediction misses.

Writes benchmarks/results/memory_model.md and .json.

    python benchmarks/memory_model.py [--steps 3] [--models mlp resnet18 ...] [--explain] [--no-write]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import MemTracker

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime.executor import Executor  # noqa: E402
from runtime.launch import launch  # noqa: E402
from runtime.memory import measure_step  # noqa: E402
from runtime.train import (  # noqa: E402
    integer_highs,
    loss_scaler,
    make_optimizer,
    named_tensors,
    strategy_from_configs,
    synthetic_batch,
    train_step,
)
from search.baselines import parse_baseline  # noqa: E402
from simulator.engine import simulate  # noqa: E402
from soap.graph import OperatorGraph  # noqa: E402
from soap.lowering import StepPlan, lower  # noqa: E402
from soap.setup import TrainSetup  # noqa: E402
from soap.topology import load_topology  # noqa: E402
from soapflow.api import capture_model  # noqa: E402
from soapflow.runner import build_workload  # noqa: E402
from soapflow.tables import frame, markdown_table, text_table  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TOPOLOGY = "cpu-2"
TARGET_MEDIAN_ABS_ERROR = 0.15


# -- models under test (module-level builders: the worker processes load them by reference) -----------


def mlp(batch_size: int = 2048) -> tuple:
    from soapflow.zoo.mlp import mlp as build

    return build(batch_size, sizes=(512, 2048, 512))


def resnet18(batch_size: int = 48) -> tuple:
    from soapflow.zoo.cnn import resnet18 as build

    return build(batch_size, num_classes=100, image_size=64)


def alexnet(batch_size: int = 32) -> tuple:
    from soapflow.zoo.cnn import alexnet as build

    return build(batch_size, num_classes=100, image_size=224)


def rnnlm(batch_size: int = 64) -> tuple:
    from soapflow.zoo.rnn import rnnlm as build

    return build(batch_size, hidden=512, embed=512, vocab=4000, steps=32, layers=2)


def transformer(batch_size: int = 8) -> tuple:
    from soapflow.zoo.transformer import transformer as build

    return build(batch_size, layers=4, d_model=256, heads=4, seq=128, context=None, vocab=8000)


# name -> (training setup, strategies)
MODELS: dict[str, tuple[TrainSetup, tuple[str, ...]]] = {
    "mlp": (TrainSetup(), ("dp", "tp", "fsdp")),
    "resnet18": (TrainSetup(), ("dp", "fsdp", "hybrid:tp=1,recompute=full")),
    "alexnet": (TrainSetup(), ("dp", "tp", "fsdp")),
    "rnnlm": (TrainSetup(), ("dp", "tp", "fsdp")),
    "transformer": (TrainSetup(optimizer="adamw", weight_decay=0.01), ("dp", "tp", "hybrid:tp=2,recompute=full")),
}


def model_ref(name: str) -> str:
    return f"{os.path.relpath(Path(__file__).resolve(), Path.cwd())}:{name}"


# -- the measurement (in the worker processes) ----------------------------------------------------------


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


# Where a measured peak goes: the storages live at the peak, each put in one category by what holds it
# (the executor's parameters, gradients, outputs) or by the runtime function that allocated it (the
# innermost frame in runtime/ or torch/optim/). Diagnostic only: it names runtime internals.
CATEGORIES = ("params", "param grads", "optimizer state", "optimizer temporaries", "batch, constants",
              "op outputs", "kernel extras", "activation grads", "exchange buffers", "grad buckets",
              "fsdp buffers")
_FSDP_SITES = frozenset({"_gather", "_gather_into", "_scatter_grads", "_release"})
_BUCKET_SITES = frozenset({"ready", "finish", "_grad_of", "_set_grad"})


def _site() -> tuple[str, str]:
    """(file stem, function) of the innermost frame of the runtime or of torch.optim calling in."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if f"{os.sep}runtime{os.sep}" in path or f"{os.sep}optim{os.sep}" in path:
            return Path(path).stem, frame.f_code.co_name
        frame = frame.f_back
    return "", ""


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Explainer(MemTracker):
    """`MemTracker` that also remembers where each storage was allocated and sorts the storages live at
    the peak into `CATEGORIES` (`by_category`)."""

    def __init__(self, executor: Executor) -> None:
        super().__init__()
        self.executor = executor
        self.sites: dict[int, tuple[str, str]] = {}
        self.best = -1
        self.by_category: dict[str, int] = {}

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        for st in get_untyped_storages(t):
            if st not in self._WINFO:
                self.sites[id(st)] = _site()
        super()._track(reftype, t)

    def _update_peak_stats(self, peak_state: Any) -> None:
        super()._update_peak_stats(peak_state)
        total = sum(snap["Total"] for snap in self._curr_mem_snap.values())
        if total > self.best:
            self.best = total
            self.by_category = self._categorize()

    def _categorize(self) -> dict[str, int]:
        ex = self.executor
        params = {_ptr(p) for p in ex.parameters()}
        grads = {_ptr(p.grad) for p in ex.parameters() if p.grad is not None}
        # a sharded part's gathered parameters' gradients: part of its transient, as in the model
        gathered = {_ptr(w.grad) for ws in ex.op_params.values() for w in ws.values() if w.grad is not None} - grads
        outputs = {_ptr(v) for vs in ex.values.values() for v in vs}
        outputs |= {_ptr(v) for _, vs in ex.saved.values() for v in vs}
        out = dict.fromkeys(CATEGORIES, 0)
        for st, (winfo, ref) in list(self._WINFO.items()):
            if ref() is None:
                continue
            p, kind = st.data_ptr(), winfo.reftype.value
            where, func = self.sites.get(id(st), ("", ""))
            if kind in ("Other", "Parameter", "Buffer"):
                category = "params" if p in params else "batch, constants"
            elif kind == "Optstate":
                category = "optimizer temporaries" if where else "optimizer state"
            elif p in grads:
                category = "param grads"
            elif p in gathered or func in _FSDP_SITES:
                category = "fsdp buffers"
            elif func in _BUCKET_SITES:
                category = "grad buckets"
            elif where == "collectives":
                category = "exchange buffers"
            elif p in outputs:
                category = "op outputs"
            elif kind in ("Temp", "Gradient") or func in ("_accumulate", "backward"):
                category = "activation grads"
            else:
                category = "kernel extras"
            out[category] += winfo.mem_consumed
        return out


def explain_step(executor: Executor, optimizer: torch.optim.Optimizer | None, batch: list[torch.Tensor], *,
                 step: int, scaler: Any) -> tuple[int, dict[str, int]]:
    """One more step under `_Explainer`: its peak and the categories of what is live at it."""
    tracker = _Explainer(executor)
    tracker.track_external(*executor.parameters(), *executor.buffers.values(), *executor.sources.values(),
                           *batch, *([optimizer] if optimizer is not None else []))
    with tracker:
        train_step(executor, optimizer, batch, step=step, scaler=scaler)
    return tracker.best, tracker.by_category


def measure_rank(rank: int, world: int, *, ref: str, batch: int, graph: dict[str, Any],
                 strategies: dict[str, dict[str, Any]], setup: TrainSetup, steps: int,
                 timeout_s: float, explain: bool = False) -> dict[str, dict[str, Any]]:
    """Per strategy, this rank's measured peak over the last of `steps` steps (`runtime.memory`), its
    breakdown by phase, and what it holds: parameter shards, optimizer state, the full model. With
    `explain`, one more step under `_Explainer`: `explained_peak_bytes` and `by_category`."""
    g = OperatorGraph.from_dict(graph)
    out = {}
    for name, configs in strategies.items():
        torch.manual_seed(0)
        workload = build_workload(ref, batch)
        module = workload.module
        plan = lower(g, strategy_from_configs(configs), setup, world)
        executor = Executor(g, plan, rank=rank, tensors=named_tensors(module), module=module, timeout_s=timeout_s)
        optimizer = make_optimizer(executor.parameters(), setup) if executor.parameters() else None
        scaler = loss_scaler(setup)
        highs = integer_highs(g, module)
        start = time.perf_counter()
        for step in range(steps):
            batch_ = synthetic_batch(workload.example, step=step, seed=0, highs=highs)
            dist.barrier()
            if step < steps - 1:
                train_step(executor, optimizer, batch_, step=step, scaler=scaler)
            else:
                peak = measure_step(executor, optimizer, batch_, step=step, scaler=scaler)
        state = [v for s in (optimizer.state.values() if optimizer else ()) for v in s.values()
                 if isinstance(v, torch.Tensor)]
        out[name] = {"peak_bytes": peak.peak_bytes, "by_kind": dict(peak.by_kind),
                     "param_bytes": _storage_bytes(executor.parameters()),
                     "optimizer_state_bytes": _storage_bytes(state),
                     "module_bytes": _storage_bytes([*module.parameters(), *module.buffers()]),
                     "seconds": time.perf_counter() - start}
        if explain:
            batch_ = synthetic_batch(workload.example, step=steps, seed=0, highs=highs)
            dist.barrier()
            out[name]["explained_peak_bytes"], out[name]["by_category"] = explain_step(
                executor, optimizer, batch_, step=steps, scaler=scaler)
        del workload, module, plan, executor, optimizer, scaler, batch_, state, peak
        gc.collect()
    return out


# -- the prediction --------------------------------------------------------------------------------------


def predicted_terms(plan: StepPlan) -> list[dict[str, int]]:
    """Per device, the terms of `StepPlan.memory_bytes` (`soap.lowering`): `state` (parameters, gradients,
    optimizer state), `activations` (kept outputs and batch regions read), `received` (received pieces,
    partial sums, kept pieces of recomputing producers) and `transient` (the largest of one part)."""
    terms = [{"state": 0, "activations": 0, "received": 0, "transient": 0} for _ in range(plan.num_devices)]
    for step in plan.ops:
        for d, kept, extra in zip(step.devices, step.activation_bytes, step.transient_bytes, strict=True):
            terms[d]["activations"] += kept
            terms[d]["transient"] = max(terms[d]["transient"], extra)
    for step in plan.edges:
        for d, nbytes in step.mem_bytes.items():
            terms[d]["received"] += nbytes
    for step in plan.params:
        for d, nbytes in step.memory_bytes.items():
            terms[d]["state"] += nbytes
    return terms


# -- the driver -------------------------------------------------------------------------------------------


def run_model(name: str, *, steps: int, timeout_s: float, explain: bool) -> list[dict[str, Any]]:
    setup, strategy_names = MODELS[name]
    topology = load_topology(TOPOLOGY)
    spec, graph = capture_model(model_ref(name), batch_size=None)
    strategies = {s: parse_baseline(s)(graph, topology) for s in strategy_names}
    predicted = {}
    for s, strategy in strategies.items():
        peak = simulate(graph, strategy, topology, setup=setup).summary()["peak_memory_bytes"]
        terms = predicted_terms(lower(graph, strategy, setup, topology.num_devices))
        assert [sum(t.values()) for t in terms] == peak, "the terms add up to the simulator's peak"
        predicted[s] = (peak, terms)
    measured = launch(measure_rank, topology.num_devices, kwargs={
        "ref": model_ref(name), "batch": spec.batch_size, "graph": graph.to_dict(),
        "strategies": {s: {op: cfg.to_dict() for op, cfg in st.items()} for s, st in strategies.items()},
        "setup": setup, "steps": steps, "timeout_s": timeout_s, "explain": explain},
        timeout_s=timeout_s, num_threads=1)
    rows = []
    for s in strategies:
        peak, terms = predicted[s]
        for rank, per_rank in enumerate(measured):
            m = per_rank[s]
            rows.append({"model": name, "strategy": s, "rank": rank, "predicted_bytes": peak[rank],
                         "measured_bytes": m["peak_bytes"],
                         "error": (peak[rank] - m["peak_bytes"]) / m["peak_bytes"],
                         "predicted_terms": terms[rank], "measured_by_kind": m["by_kind"],
                         "param_bytes": m["param_bytes"], "optimizer_state_bytes": m["optimizer_state_bytes"],
                         "module_bytes": m["module_bytes"], "seconds": m["seconds"],
                         "optimizer": setup.optimizer, "precision": setup.precision, "batch": spec.batch_size,
                         **{k: m[k] for k in ("explained_peak_bytes", "by_category") if k in m}})
    return rows


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def _predicted_columns(row: dict[str, Any]) -> dict[str, int]:
    terms = row["predicted_terms"]
    return {"pred state": terms["state"], "pred act": terms["activations"], "pred recv": terms["received"],
            "pred transient": terms["transient"]}


def tables(rows: list[dict[str, Any]], *, markdown: bool) -> list[str]:
    """The result table, the breakdown by phase and, for rows explained, by category (MiB)."""
    show = markdown_table if markdown else text_table
    main = frame([{"model": r["model"], "strategy": r["strategy"], "rank": r["rank"],
                   "predicted MiB": r["predicted_bytes"], "measured MiB": r["measured_bytes"],
                   "error": r["error"]} for r in rows])
    out = [show(main, {"predicted MiB": _mb, "measured MiB": _mb, "error": "{:+.1%}".format})]
    breakdown = frame([{
        "model": r["model"], "strategy": r["strategy"], "rank": r["rank"], **_predicted_columns(r),
        "held": r["measured_by_kind"].get("held", 0), "of it params": r["param_bytes"],
        "optimizer": r["measured_by_kind"].get("optimizer", 0), "of it state": r["optimizer_state_bytes"],
        "forward": r["measured_by_kind"].get("forward", 0), "backward": r["measured_by_kind"].get("backward", 0),
    } for r in rows])
    out.append(show(breakdown, {c: _mb for c in breakdown.columns[3:]}))
    explained = [r for r in rows if "by_category" in r]
    if explained:
        cats = frame([{"model": r["model"], "strategy": r["strategy"], "rank": r["rank"], **_predicted_columns(r),
                       "peak": r["explained_peak_bytes"], **r["by_category"]} for r in explained])
        out.append(show(cats, {c: _mb for c in cats.columns[3:]}))
        misses = frame([{"model": r["model"], "strategy": r["strategy"], "rank": r["rank"],
                         "measured - predicted": r["explained_peak_bytes"] - r["predicted_bytes"], **misses_by_term(r)}
                        for r in explained])
        out.append(show(misses, {c: _signed_mb for c in misses.columns[3:]}))
    return out


def misses_by_term(row: dict[str, Any]) -> dict[str, int]:
    """Measured minus predicted bytes per term of the model (`predicted_terms`), from the categories of
    what is live at the peak; they add up to the explained peak minus the prediction."""
    c, t = row["by_category"], row["predicted_terms"]
    return {
        "state": (c["params"] + c["param grads"] + c["grad buckets"] + c["optimizer state"]
                  + c["optimizer temporaries"] - t["state"]),
        "activations": c["batch, constants"] + c["op outputs"] + c["kernel extras"] - t["activations"],
        "exchanges": c["exchange buffers"] - t["received"],
        "transient": c["fsdp buffers"] + c["activation grads"] - t["transient"],
    }


def _signed_mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:+.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per strategy; the last is measured")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds any collective may wait")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--explain", action="store_true",
                        help="one more step per strategy, sorting what is live at its peak into categories")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (a warm-up step, then the measured one)")
    start = time.perf_counter()
    rows = []
    for name in args.models:
        rows += run_model(name, steps=args.steps, timeout_s=args.timeout, explain=args.explain)
        print(f"{name}: done ({time.perf_counter() - start:.0f} s)", flush=True)
    errors = [abs(r["error"]) for r in rows]
    median = statistics.median(errors)
    text = tables(rows, markdown=False)
    print(text[0])
    print()
    print("Breakdown at the peak, MiB (predicted terms; measured: held at the start, then by the phase that "
          "allocated it):")
    print(text[1])
    if args.explain:
        print()
        print("What is live at the peak of one more step, MiB, by category (`_Explainer`):")
        print(text[2])
        print()
        print("Measured minus predicted, MiB, per term of the model (`misses_by_term`):")
        print(text[3])
    verdict = "met" if median <= TARGET_MEDIAN_ABS_ERROR else "NOT met"
    summary = (f"median |error| {median:.1%} over {len(rows)} rows (target <= {TARGET_MEDIAN_ABS_ERROR:.0%}: "
               f"{verdict}); max |error| {max(errors):.1%}")
    print(summary)
    if args.no_write:
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    setup = {"topology": TOPOLOGY, "processes": 2, "threads_per_process": 1, "backend": "gloo",
             "steps": args.steps, "measured_step": args.steps - 1, "explain": args.explain,
             "models": {name: {"train_setup": MODELS[name][0].to_dict(), "strategies": list(MODELS[name][1])}
                        for name in args.models},
             "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
             "seconds": time.perf_counter() - start}
    (RESULTS / "memory_model.json").write_text(json.dumps(
        {"setup": setup, "median_abs_error": median, "max_abs_error": max(errors),
         "target_median_abs_error": TARGET_MEDIAN_ABS_ERROR, "rows": rows}, indent=2) + "\n")
    md = tables(rows, markdown=True)
    explained = ("" if not args.explain else
                 "What is live at the peak of one more step (`--explain`: a `MemTracker` that remembers where each "
                 "storage was allocated), by category: `params`, `param grads` (of the shards), "
                 "`optimizer state`, `optimizer temporaries`, `batch, constants` (held "
                 "at the start), `op outputs` (the outputs the executor keeps for backward), `kernel extras` (what "
                 "else the kernels allocated in forward and autograd saves: log-softmax, LSTM workspaces, pooling "
                 "indices, and the outputs of the op whose backward is running), `activation grads`, `exchange "
                 "buffers` (allocated by `runtime.collectives`' exchanges: send and receive buffers, assembled "
                 f"inputs), `grad buckets` (the all-reduce buckets, which shards' gradients are views of once "
                 "launched), `fsdp buffers` (gathers and reduce-scatters of sharded parts, and the gradients of "
                 "their gathered parameters).\n\n"
                 f"{md[2]}\n\nMeasured minus predicted per term of the model (MiB): `state` (parameters, their "
                 "gradients and buckets, optimizer state and temporaries against the model's parameters, "
                 "gradients and optimizer state), `activations` (batch, constants, op outputs and kernel extras "
                 "against the kept outputs, what kernels save and batch regions read), `exchanges` (exchange "
                 "buffers against received pieces and partial sums), `transient` (sharded parts' buffers and "
                 "activation gradients against the largest transient of one part).\n\n"
                 f"{md[3]}\n\n")
    (RESULTS / "memory_model.md").write_text(
        "# Memory model: predicted vs measured peak memory per device\n\n"
        "Written by `python benchmarks/memory_model.py`. Predicted: the simulator's peak memory of the device "
        "(what `soapflow simulate` reports). Measured: the peak of live tensor bytes on that rank over the last "
        f"of {args.steps} training steps (`runtime.memory.measure_step`, torch's `MemTracker`), on {TOPOLOGY}: "
        "2 gloo processes, 1 thread each. Error = (predicted - measured) / measured. The module docstring of "
        "`benchmarks/memory_model.py` says what each side counts and where they must differ.\n\n"
        f"**{summary}.**\n\n{md[0]}\n\n"
        "Breakdown at the peak (MiB). Predicted: `state` (parameters, gradients, optimizer state), `act` "
        "(kept outputs and batch regions read), `recv` (received pieces and partial sums), `transient` (the "
        "largest of one part). Measured: `held` (at the start of the step: parameter shards, batch, "
        "constants; `of it params` the shards alone), `optimizer` (its state and its temporaries; `of it "
        "state` the state alone), `forward` and `backward` (what those phases allocated that is still "
        f"live at the peak).\n\n{md[1]}\n\n{explained}"
        f"Setup: torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}.\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
