"""The public Python API: the stages in order, capture -> validate -> simulate -> search -> export -> run.

Each function is a thin, keyword-only composition of the packages below it; the `soapflow` command
is written on top of these and adds only formatting. The training setup (`soap.setup.TrainSetup`) is
built once by the caller (the command line) and passed to every stage that depends on it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from search.baselines import BASELINES, BaselineNotApplicable, BaselineSpecError, dp, parse_baseline
from soap.capture import capture
from soap.graph import OperatorGraph
from soap.setup import TrainSetup
from soap.strategy import Strategy, StrategyError, read_strategy_doc, strategy_from_dict, validate_strategy
from soap.topology import DeviceTopology, load_topology
from soapflow.models import ModelError, ModelSpec, load_model

__all__ = [
    "BASELINES", "BaselineNotApplicable", "ModelSpec", "TrainSetup", "capture_model", "load_model",
    "load_topology", "recorded_batch", "resolve_strategy", "strategy_batch",
]


def capture_model(ref: str, *, batch_size: int | None = None) -> tuple[ModelSpec, OperatorGraph]:
    """Build the model `ref` and capture its operator graph (loss included) at the global batch."""
    spec = load_model(ref, batch_size)
    graph = capture(spec.module, spec.inputs, spec.target, spec.loss_fn,
                    name=spec.name, batch_size=spec.batch_size)
    loss = graph.ops[-1].output
    if loss.numel != 1:
        raise ModelError(f"the loss of model {ref!r} must be a scalar, got a tensor of shape "
                         f"{'x'.join(map(str, loss.shape))}")
    return spec, graph


def _is_strategy_file(ref: str) -> bool:
    """Whether `resolve_strategy` reads `ref` as a strategy file (a baseline name comes first)."""
    try:
        return parse_baseline(ref) is None and Path(ref).is_file()
    except BaselineSpecError:
        return False


def recorded_batch(ref: str) -> int | None:
    """The global batch size the strategy file `ref` was made for (None: `ref` is a baseline, or a file that
    records none)."""
    return _batch_of(read_strategy_doc(ref), ref) if _is_strategy_file(ref) else None


def _batch_of(doc: Mapping[str, Any], ref: str) -> int | None:
    found = doc.get("batch_size")
    if found is not None and (not isinstance(found, int) or isinstance(found, bool) or found < 1):
        raise StrategyError(f"strategy file {ref!r} has batch_size {found!r}; expected a positive integer")
    return found


def strategy_batch(refs: Sequence[str], *, batch: int | None) -> int | None:
    """The global batch to capture a model at for the strategies `refs`: `batch` when given, else the one
    batch size the strategy files among them record (files that record different ones are an error), else
    None (the model's default). `resolve_strategy` warns where a file meets another batch."""
    if batch is not None:
        return batch
    found = {ref: size for ref in refs if (size := recorded_batch(ref)) is not None}
    if len(set(found.values())) > 1:
        raise StrategyError("the strategy files were made for different batch sizes ("
                            + ", ".join(f"{ref!r}: {size}" for ref, size in found.items()) + "); pass --batch")
    return next(iter(found.values()), None)


def resolve_strategy(ref: str, *, graph: OperatorGraph, topology: DeviceTopology, setup: TrainSetup,
                     processes: bool = False) -> Strategy:
    """A baseline name (dp, mp, tp, expert, fsdp, `search.baselines.parse_baseline`'s hybrid:...) or a
    strategy file, validated against graph and topology.

    Ops a file leaves out run data parallel (with a warning); where data parallelism is not defined
    for the graph, they run whole on device 0. A file found for another training setup than `setup`
    warns, naming the fields that differ; so does one made for another batch size (naming both) or
    device count. `processes`: the topology's devices are the processes of a run
    (`soapflow.runner.run`), and the device-count warning says so.
    """
    try:
        make = parse_baseline(ref)
    except BaselineSpecError as exc:
        raise StrategyError(str(exc)) from None
    if make is not None:
        strategy = make(graph, topology)
        validate_strategy(graph, strategy, topology.num_devices)
        return strategy
    if not Path(ref).exists():
        raise StrategyError(f"strategy {ref!r} is neither a baseline ({', '.join(BASELINES)}, hybrid:tp=T[,pp=P]"
                            "[,microbatches=M][,shard=S][,ep=E][,recompute=none|full]) nor an existing file")
    doc = read_strategy_doc(ref)
    _batch_of(doc, ref)  # (a bad batch_size is an error)
    try:
        default = dp(graph, topology)
    except BaselineNotApplicable:
        default = BASELINES["mp"](graph, topology)
    return strategy_from_dict(doc, graph, topology.num_devices, default=default, setup=setup,
                              source=f"strategy file {os.fspath(ref)!r}", processes=processes)
