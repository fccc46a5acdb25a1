"""The public Python API: the stages in order, capture -> validate -> simulate -> search -> export -> run.

Each function is a thin, keyword-only composition of the packages below it; the `soapflow` command
is written on top of these and adds only formatting. The training setup (`soap.setup.TrainSetup`) is
built once by the caller (the command line) and passed to every stage that depends on it.
"""

from __future__ import annotations

import os
from pathlib import Path

from search.baselines import BASELINES, BaselineNotApplicable, BaselineSpecError, dp, parse_baseline
from soap.capture import capture
from soap.graph import OperatorGraph
from soap.setup import TrainSetup
from soap.strategy import Strategy, StrategyError, load_strategy, validate_strategy
from soap.topology import DeviceTopology, load_topology
from soapflow.models import ModelError, ModelSpec, default_loss, load_model

__all__ = [
    "BASELINES", "BaselineNotApplicable", "ModelSpec", "TrainSetup", "capture_model", "load_model",
    "load_topology", "resolve_strategy",
]


def capture_model(ref: str, *, batch_size: int | None = None) -> tuple[ModelSpec, OperatorGraph]:
    """Build the model `ref` and capture its operator graph (loss included) at the global batch."""
    spec = load_model(ref, batch_size)
    graph = capture(spec.module, spec.inputs, spec.target, spec.loss_fn or default_loss,
                    name=spec.name, batch_size=spec.batch_size)
    loss = graph.ops[-1].output
    if loss.numel != 1:
        raise ModelError(f"the loss of model {ref!r} must be a scalar, got a tensor of shape "
                         f"{'x'.join(map(str, loss.shape))}")
    return spec, graph


def resolve_strategy(ref: str, *, graph: OperatorGraph, topology: DeviceTopology,
                     setup: TrainSetup) -> Strategy:
    """A baseline name (dp, mp, tp, expert, fsdp, `search.baselines.parse_baseline`'s hybrid:...) or a
    strategy file, validated against graph and topology.

    Ops a file leaves out run data parallel (with a warning); where data parallelism is not defined
    for the graph, they run whole on device 0. A file found for another training setup than `setup`
    warns, naming the fields that differ.
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
                            "[,microbatches=M][,shard=S][,recompute=none|full]) nor an existing file")
    try:
        default = dp(graph, topology)
    except BaselineNotApplicable:
        default = BASELINES["mp"](graph, topology)
    return load_strategy(os.fspath(ref), graph, topology.num_devices, default=default, setup=setup)
