"""`Strategy` (op name -> ParallelConfig) and the strategy file (format ``soapflow.strategy/2``).

File layout (JSON, human-editable)::

    {"format": "soapflow.strategy/2", "model": "mlp", "fingerprint": "<sha256>", "batch_size": 64,
     "topology": "cpu-2", "num_devices": 2, "predicted_iteration_time_ms": 1.23,
     "setup": {"optimizer": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 0.0, "precision": "fp32",
               "bucket_mb": 25.0},
     "ops": {"fc1": {"degrees": {"out_features": 2}, "devices": [0, 1], "recompute": false, "shard": 1},
             ...}}

`setup` is the training setup (`soap.setup.TrainSetup`) the strategy was found for: the step it was
timed on depends on it (optimizer state in memory, gradient buckets). Version 1 files (no `setup`) are
still read. An op missing from the file defaults to data parallel (with a warning); a fingerprint
mismatch warns and the file still applies by op name; a recorded setup that differs from the one the file
is used with warns (naming the fields) and the file still applies; a config that does not fit the graph
raises `StrategyError` naming the op and the reason. `recompute` and `shard` may be left out (false and 1;
`soap.config` states what they mean). Must not import torch, the simulator, the search or
the runtime.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from soap.config import ConfigError, ParallelConfig, validate
from soap.files import read_json, write_json
from soap.graph import OperatorGraph
from soap.setup import TrainSetup

FORMAT = "soapflow.strategy/2"
# The formats `read_strategy_doc` accepts: version 1 is version 2 without the `setup` key.
READABLE_FORMATS = ("soapflow.strategy/1", FORMAT)


class StrategyError(ValueError):
    """A strategy (or strategy file) that does not fit the graph or the topology."""


@dataclass(frozen=True, slots=True)
class Strategy:
    """Immutable mapping op name -> ParallelConfig."""

    configs: Mapping[str, ParallelConfig] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "configs", MappingProxyType(dict(self.configs)))

    def __getitem__(self, op: str) -> ParallelConfig:
        return self.configs[op]

    def __contains__(self, op: object) -> bool:
        return op in self.configs

    def __iter__(self) -> Iterator[str]:
        return iter(self.configs)

    def __len__(self) -> int:
        return len(self.configs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Strategy) and dict(self.configs) == dict(other.configs)

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, v.key()) for k, v in self.configs.items())))

    def items(self):
        return self.configs.items()

    def with_config(self, op: str, cfg: ParallelConfig) -> Strategy:
        return self.with_configs({op: cfg})

    def with_configs(self, changes: Mapping[str, ParallelConfig]) -> Strategy:
        """This strategy with the ops of `changes` given their configs there."""
        return Strategy({**self.configs, **changes})

    def devices_used(self) -> set[int]:
        return {d for cfg in self.configs.values() for d in cfg.devices}


def validate_strategy(graph: OperatorGraph, strategy: Strategy, num_devices: int) -> None:
    """Raise `StrategyError` for the first op whose config is missing or does not fit."""
    for op in graph:
        if op.name not in strategy:
            raise StrategyError(f"strategy has no config for op {op.name!r}")
        try:
            validate(op, strategy[op.name], num_devices)
        except ConfigError as exc:
            raise StrategyError(str(exc)) from None
    extra = [name for name in strategy if name not in graph]
    if extra:
        raise StrategyError(f"strategy names op(s) the graph lacks: {', '.join(extra[:5])}")
    check_shared_shards(graph, strategy)


def check_shared_shards(graph: OperatorGraph, strategy: Strategy | Mapping[str, ParallelConfig]) -> None:
    """Raise `StrategyError` when an op with `shard` > 1 shares a parameter with another op."""
    shared = graph.shared_params()
    for op in graph:
        cfg = strategy[op.name] if op.name in strategy else None
        if cfg is not None and cfg.shard > 1:
            for spec in op.params.values():
                others = [name for name in shared.get(spec.key, ()) if name != op.name]
                if others:
                    raise StrategyError(f"op {op.name!r} shares parameter {spec.fqn!r} with op {others[0]!r}; "
                                        f"shared parameters are not sharded (use shard 1)")


def strategy_to_dict(strategy: Strategy, graph: OperatorGraph, *, topology: str, num_devices: int,
                     setup: TrainSetup, model: str = "", predicted_ms: float | None = None) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "model": model or graph.name,
        "fingerprint": graph.fingerprint,
        "batch_size": graph.batch_size,
        "topology": topology,
        "num_devices": num_devices,
        "predicted_iteration_time_ms": predicted_ms,
        "setup": setup.to_dict(),
        "ops": {op.name: strategy[op.name].to_dict() for op in graph if op.name in strategy},
    }


def save_strategy(path: str | os.PathLike, strategy: Strategy, graph: OperatorGraph, *, topology: str,
                  num_devices: int, setup: TrainSetup, model: str = "", predicted_ms: float | None = None) -> None:
    """Write the strategy file atomically (temporary file in the same folder, then rename)."""
    doc = strategy_to_dict(strategy, graph, topology=topology, num_devices=num_devices, setup=setup, model=model,
                           predicted_ms=predicted_ms)
    write_json(path, doc)


def read_strategy_doc(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check the envelope of a strategy file (JSON, format, ops mapping)."""
    doc = read_json(path, f"strategy file {str(path)!r}", StrategyError)
    if not isinstance(doc, dict):
        raise StrategyError(f"strategy file {str(path)!r} must hold a JSON object")
    if doc.get("format") not in READABLE_FORMATS:
        raise StrategyError(f"strategy file {str(path)!r} has format {doc.get('format')!r}; "
                            f"this soapflow reads {' and '.join(map(repr, READABLE_FORMATS))}")
    if not isinstance(doc.get("ops"), dict):
        raise StrategyError(f"strategy file {str(path)!r} has no 'ops' object")
    return doc


def recorded_setup(doc: Mapping[str, Any], *, source: str = "strategy") -> TrainSetup | None:
    """The training setup a strategy document records (None for a version 1 document, which has none)."""
    found = doc.get("setup")
    if found is None:
        return None
    if not isinstance(found, dict):
        raise StrategyError(f"{source}: 'setup' must be an object, got {found!r}")
    try:
        return TrainSetup.from_dict(found)
    except (ValueError, TypeError) as exc:
        raise StrategyError(f"{source}: setup: {exc}") from None


def setup_differences(recorded: Mapping[str, Any] | TrainSetup, setup: Mapping[str, Any] | TrainSetup, *,
                      where: str = "in the file") -> list[str]:
    """``<field> <recorded value> <where>, <value> here`` for every field in which `recorded` (a file's) and
    `setup` (the one it is used with) differ, in `recorded`'s field order; either may be a `TrainSetup` or a
    mapping of fields (extra ones compared too, those only one has skipped)."""
    mine, theirs = (s.to_dict() if isinstance(s, TrainSetup) else s for s in (recorded, setup))
    return [f"{name} {mine[name]!r} {where}, {theirs[name]!r} here" for name in mine
            if name in theirs and mine[name] != theirs[name]]


def strategy_from_dict(doc: Mapping[str, Any], graph: OperatorGraph, num_devices: int, *,
                       default: Strategy | None = None, setup: TrainSetup | None = None,
                       source: str = "strategy", processes: bool = False) -> Strategy:
    """Build and validate a Strategy for `graph` from a strategy document.

    `default` supplies configs for ops the document leaves out (data parallel, normally), with a
    warning; without it a missing op is an error. `setup` is the training setup the strategy is used
    with: where the document records a different one, a warning names the fields that differ; so does one
    made for another graph (naming both batch sizes where they differ) or device count (`processes`: the
    devices are a run's processes, and the warning says so).
    """
    if doc.get("fingerprint") and doc["fingerprint"] != graph.fingerprint:
        made_for = doc.get("batch_size")
        what = (f"batch {made_for}, not {graph.batch_size}" if made_for not in (None, graph.batch_size)
                else "a different graph")
        warnings.warn(f"{source} was made for {what} (fingerprint mismatch); applying it by op name", stacklevel=2)
    if doc.get("num_devices") not in (None, num_devices):
        here = f"this run has {num_devices} processes (one per device)" if processes else \
            f"the topology has {num_devices}"
        warnings.warn(f"{source} was made for {doc['num_devices']} devices, {here}", stacklevel=2)
    recorded = recorded_setup(doc, source=source)
    if setup is not None and recorded is not None and recorded != setup:
        warnings.warn(f"{source} was found for a different training setup "
                      f"({'; '.join(setup_differences(recorded, setup))}); applying it anyway", stacklevel=2)
    configs: dict[str, ParallelConfig] = {}
    for name, entry in doc["ops"].items():
        if name not in graph:
            raise StrategyError(f"{source}: op {name!r} does not exist in model {graph.name!r}")
        if not isinstance(entry, dict) or not isinstance(entry.get("devices"), list):
            raise StrategyError(f"{source}: op {name!r} needs {{'degrees': {{...}}, 'devices': [...]}}")
        if "degrees" not in entry and len(entry["devices"]) > 1:  # (a whole op may leave them out)
            raise StrategyError(f"{source}: op {name!r} lists {len(entry['devices'])} devices but no degrees; "
                                f"it needs {{'degrees': {{...}}, 'devices': [...]}}")
        degrees = entry.get("degrees", {})
        if not isinstance(degrees, dict) or not all(_is_integer(v) for v in degrees.values()):
            raise StrategyError(f"{source}: op {name!r} has degrees {degrees!r}; expected {{dim: integer}}")
        if not all(_is_integer(d) for d in entry["devices"]):
            raise StrategyError(f"{source}: op {name!r} has devices {entry['devices']!r}; expected a list of "
                                "device ids (integers)")
        try:
            cfg = ParallelConfig.from_dict(entry)
        except (ValueError, TypeError) as exc:
            raise StrategyError(f"{source}: op {name!r}: {exc}") from None
        try:
            validate(graph[name], cfg, num_devices)
        except ConfigError as exc:
            raise StrategyError(f"{source}: {exc}") from None
        configs[name] = cfg
    missing = [op.name for op in graph if op.name not in configs]
    if missing:
        if default is None:
            raise StrategyError(f"{source} has no config for op(s): {', '.join(missing[:5])}")
        warnings.warn(f"{source} has no config for {len(missing)} op(s) ({', '.join(missing[:3])}"
                      f"{', ...' if len(missing) > 3 else ''}); they run data parallel", stacklevel=2)
        for name in missing:
            configs[name] = default[name]
    try:
        check_shared_shards(graph, configs)
    except StrategyError as exc:
        raise StrategyError(f"{source}: {exc}") from None
    return Strategy({op.name: configs[op.name] for op in graph})


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def load_strategy(path: str | os.PathLike, graph: OperatorGraph, num_devices: int, *,
                  default: Strategy | None = None, setup: TrainSetup | None = None) -> Strategy:
    """The strategy file at `path` for `graph` (see `strategy_from_dict`)."""
    return strategy_from_dict(read_strategy_doc(path), graph, num_devices, default=default, setup=setup,
                              source=f"strategy file {str(path)!r}")
