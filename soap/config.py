"""`ParallelConfig`: how one op is split (a degree per iteration dim) and where its parts run.

Parts are numbered row-major over the op's iteration dims in registry order (the last dim varies
fastest); part `i` runs on `devices[i]`. Must not import torch, the simulator, the search or the runtime.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from soap.graph import Operator
from soap.opdef import Box, split_range
from soap.registry import dims_of, op_def


class ConfigError(ValueError):
    """A config that does not fit its op or the topology; the message names the op and the reason."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    """A degree per dim name (dims left out have degree 1) and the devices of the parts."""

    degrees: Mapping[str, int]
    devices: tuple[int, ...]

    def __post_init__(self) -> None:
        degrees = {str(k): int(v) for k, v in dict(self.degrees).items()}
        bad = {k: v for k, v in degrees.items() if v < 1}
        if bad:
            raise ValueError(f"degrees must be >= 1, got {bad}")
        object.__setattr__(self, "degrees", MappingProxyType({k: v for k, v in degrees.items() if v > 1}))
        object.__setattr__(self, "devices", tuple(int(d) for d in self.devices))
        if not self.devices:
            raise ValueError("a config needs at least one device")
        if len(self.devices) != self.num_parts:
            raise ValueError(f"degrees {dict(self.degrees)} make {self.num_parts} parts "
                             f"but {len(self.devices)} devices are listed")
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"devices {list(self.devices)} are not distinct")

    @property
    def num_parts(self) -> int:
        return math.prod(self.degrees.values())

    def degree(self, dim: str) -> int:
        return self.degrees.get(dim, 1)

    def key(self) -> tuple:
        """A hashable identity (the mapping is not hashable)."""
        return (tuple(sorted(self.degrees.items())), self.devices)

    def __hash__(self) -> int:
        return hash(self.key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ParallelConfig) and self.key() == other.key()

    def to_dict(self) -> dict:
        return {"degrees": dict(self.degrees), "devices": list(self.devices)}

    @classmethod
    def single(cls, device: int) -> ParallelConfig:
        return cls(degrees={}, devices=(device,))


def validate(op: Operator, cfg: ParallelConfig, num_devices: int | None = None) -> None:
    """Raise `ConfigError` naming the op and the reason when `cfg` does not fit `op` (or the topology)."""
    dims = {d.name: d for d in dims_of(op)}
    for name, degree in cfg.degrees.items():
        if name not in dims:
            raise ConfigError(f"op {op.name!r} ({op.kind}) has no dim {name!r}; its dims: {', '.join(dims)}")
        if dims[name].size % degree:
            raise ConfigError(f"op {op.name!r}: degree {degree} does not divide dim {name!r} "
                              f"of size {dims[name].size}")
    reason = op_def(op.kind).check(op, cfg.degrees)
    if reason:
        raise ConfigError(f"op {op.name!r}: {reason}")
    if num_devices is not None:
        missing = [d for d in cfg.devices if not 0 <= d < num_devices]
        if missing:
            raise ConfigError(f"op {op.name!r}: device(s) {missing} not in the topology "
                              f"(it has devices 0..{num_devices - 1})")


def parts(op: Operator, cfg: ParallelConfig) -> list[tuple[Box, int]]:
    """(box, device) for every part, in part order."""
    dims = dims_of(op)
    degrees = [cfg.degree(d.name) for d in dims]
    out = []
    for idx, device in zip(itertools.product(*(range(g) for g in degrees)), cfg.devices, strict=True):
        box = tuple(split_range(d.size, g, i) for d, g, i in zip(dims, degrees, idx, strict=True))
        out.append((box, device))
    return out
