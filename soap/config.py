"""`ParallelConfig`: how one op is split (a degree per iteration dim) and where its parts run, whether it
recomputes its activations and over how many replicas its parameters are sharded.

Parts are numbered row-major over the op's iteration dims in registry order (the last dim varies
fastest); part `i` runs on `devices[i]`. A device may appear more than once: its parts run one after
another and add their weight gradients locally (a sample split with repeated devices is micro-batching;
`soap.lowering` states the rules). Not with `recompute` or `shard` > 1, nor for ops with running
statistics (each part would update them). A split of a carried dim (`soap.opdef.DimSpec.carried`: the
time axis of an LSTM) makes chunks, each starting from the state of the chunk before it, on its device or
moved from another (`soap.lowering`'s rule "Carries"); not with `shard` > 1 (`carry_refusal`).

- `recompute`: the op keeps nothing for backward; its forward runs again on each of its devices before
  its backward (and before the recomputation of a consumer that reads it). What it reads from other
  devices is kept, so recomputation moves nothing (`soap.lowering` states the rule). Not for sources
  (they compute nothing) nor for ops with running statistics (a second forward would update them twice).
- `shard` (S >= 1): each parameter region the op's parts hold on R devices (R identical replicas) is
  sharded over groups of S of those devices (S divides R; S = R is FSDP / ZeRO-3, S < R hybrid sharding):
  each device keeps 1/S of the region with its gradient and optimizer state, the group all-gathers the
  region before the op's forward and again before its backward, and reduce-scatters its gradient. Only
  for ops with parameters that no other op shares and none of which is frozen.

Must not import torch, the simulator, the search or the runtime.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Container, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from soap.graph import Operator
from soap.opdef import Box, Region, carry_sources, split_range
from soap.registry import dims_of, op_def


class ConfigError(ValueError):
    """A config that does not fit its op or the topology; the message names the op and the reason."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    """A degree per dim name (dims left out have degree 1) and the devices of the parts."""

    degrees: Mapping[str, int]
    devices: tuple[int, ...]
    recompute: bool = False
    shard: int = 1
    _key: tuple = dataclasses.field(init=False, repr=False, compare=False)  # `key()`, made once
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)  # its hash, made once

    def __post_init__(self) -> None:
        if not isinstance(self.recompute, bool):
            raise ValueError(f"recompute must be true or false, got {self.recompute!r}")
        if isinstance(self.shard, bool) or not isinstance(self.shard, int) or self.shard < 1:
            raise ValueError(f"shard must be an integer >= 1, got {self.shard!r}")
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
        object.__setattr__(self, "_key", (tuple(sorted(self.degrees.items())), self.devices, self.recompute,
                                          self.shard))
        object.__setattr__(self, "_hash", hash(self._key))

    @property
    def num_parts(self) -> int:
        return math.prod(self.degrees.values())

    def degree(self, dim: str) -> int:
        return self.degrees.get(dim, 1)

    def key(self) -> tuple:
        """A hashable identity (the mapping is not hashable)."""
        return self._key

    def __hash__(self) -> int:
        return self._hash  # (configs key the plan caches: hashed millions of times in a search)

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, ParallelConfig) and self._key == other._key)

    def __reduce__(self) -> tuple:
        """Pickled by its fields and made anew where it is unpickled: a string's hash differs from one
        process to another, and so would the kept hash."""
        return _config_of, (dict(self.degrees), self.devices, self.recompute, self.shard)

    def to_dict(self) -> dict:
        return {"degrees": dict(self.degrees), "devices": list(self.devices), "recompute": self.recompute,
                "shard": self.shard}

    @classmethod
    def from_dict(cls, doc: Mapping) -> ParallelConfig:
        """The config of `to_dict`'s output (`recompute` and `shard` may be left out)."""
        return cls(degrees=doc.get("degrees", {}), devices=tuple(doc["devices"]),
                   recompute=doc.get("recompute", False), shard=doc.get("shard", 1))

    def replace(self, **changes) -> ParallelConfig:
        """This config with the given fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def single(cls, device: int) -> ParallelConfig:
        return cls(degrees={}, devices=(device,))


def _config_of(degrees: Mapping[str, int], devices: tuple[int, ...], recompute: bool, shard: int) -> ParallelConfig:
    """The `ParallelConfig` of these fields (unpickling)."""
    return ParallelConfig(degrees=degrees, devices=devices, recompute=recompute, shard=shard)


def validate(op: Operator, cfg: ParallelConfig, num_devices: int | None = None) -> None:
    """Raise `ConfigError` naming the op and the reason when `cfg` does not fit `op` (or the topology)."""
    dims = {d.name: d for d in dims_of(op)}
    for name, degree in cfg.degrees.items():
        if name not in dims:
            raise ConfigError(f"op {op.name!r} ({op.kind}) has no dim {name!r}; its dims: {', '.join(dims)}")
        if dims[name].size % degree:
            raise ConfigError(f"op {op.name!r}: degree {degree} does not divide dim {name!r} "
                              f"of size {dims[name].size}")
    entry = op_def(op.kind)
    reason = entry.check(op, cfg.degrees)
    if reason:
        raise ConfigError(f"op {op.name!r}: {reason}")
    if len(set(cfg.devices)) != len(cfg.devices):
        reason = repeat_refusal(op, cfg)
        if reason:
            raise ConfigError(f"op {op.name!r}: devices {list(cfg.devices)} repeat, but {reason}")
    reason = carry_refusal(op, cfg)
    if reason:
        raise ConfigError(f"op {op.name!r}: {reason}")
    if cfg.recompute:
        reason = recompute_refusal(op)
        if reason:
            raise ConfigError(f"op {op.name!r} cannot recompute: {reason}")
    if cfg.shard > 1:
        if not op.params:
            raise ConfigError(f"op {op.name!r} ({op.kind}) has no parameters to shard (shard {cfg.shard})")
        frozen = [p.fqn for p in op.params.values() if not p.trainable]
        if frozen:
            raise ConfigError(f"op {op.name!r}: frozen parameters ({', '.join(frozen)}) are not sharded "
                              f"(shard {cfg.shard}; not built yet)")
        replicas = param_replicas(op, cfg)
        if replicas % cfg.shard:
            raise ConfigError(f"op {op.name!r}: shard {cfg.shard} does not divide the {replicas} replica(s) "
                              f"of its parameters under degrees {dict(cfg.degrees) or '{}'}")
    if num_devices is not None:
        missing = [d for d in cfg.devices if not 0 <= d < num_devices]
        if missing:
            raise ConfigError(f"op {op.name!r}: device(s) {missing} not in the topology "
                              f"(it has devices 0..{num_devices - 1})")


def shardable(op: Operator, shared: Container[str]) -> bool:
    """Whether `op`'s parameters may be sharded: it has some, none of them frozen and none another op
    shares (`shared`: the `ParamSpec.key`s several ops use, `OperatorGraph.shared_params`)."""
    return bool(op.params) and not any(p.key in shared or not p.trainable for p in op.params.values())


def recompute_refusal(op: Operator) -> str | None:
    """Why `op` cannot recompute (None: it can)."""
    entry = op_def(op.kind)
    if entry.everywhere:
        return f"it is a source ({op.kind}) and computes nothing"
    if entry.buffer_regions(op, tuple((0, d.size) for d in dims_of(op))):
        return "it updates running statistics, which a second forward would update twice"
    return None


def repeat_refusal(op: Operator, cfg: ParallelConfig) -> str | None:
    """Why `op` cannot run several parts on one device under `cfg` (None: it can)."""
    if cfg.shard > 1:
        return "a sharded op runs one part per device (not built yet)"
    if op_def(op.kind).buffer_regions(op, tuple((0, d.size) for d in dims_of(op))):
        return "it updates running statistics, which each part on a device would update again"
    return None


def carry_refusal(op: Operator, cfg: ParallelConfig) -> str | None:
    """Why `cfg`'s chunks along the op's carried dim cannot run as it says (None: they can). Chunks run in
    successive rounds (`soap.lowering`), and a sharded op's parts gather their parameters together, in
    one round."""
    if cfg.shard > 1 and any(p is not None for p in carry_sources(dims_of(op), cfg.degrees)):
        return f"a sharded op (shard {cfg.shard}) cannot run in chunks along its carried dim (not built yet)"
    return None


def param_replicas(op: Operator, cfg: ParallelConfig) -> int:
    """How many of the op's parts hold each parameter region (the same for every region: parts are a
    grid), 1 for an op without parameters."""
    if not op.params:
        return 1
    counts: dict[tuple, int] = {}
    for box, _ in parts(op, cfg):
        key = param_keys(op, box)
        counts[key] = counts.get(key, 0) + 1
    return min(counts.values())


def param_pieces(op: Operator, box: Box) -> dict[str, tuple[str, Region]]:
    """Per parameter name, (fqn, region) a part of `op` with `box` holds, the region in the coordinates of
    the whole parameter (`ParamSpec.offset` added to what the registry names): the key under which the
    lowering, the runtime and checkpoints know the piece."""
    out = {}
    for name, region in op_def(op.kind).param_regions(op, box).items():
        spec = op.params[name]
        offset = spec.offset or (0,) * len(region)
        out[name] = (spec.fqn, tuple((int(lo) + o, int(hi) + o) for (lo, hi), o in zip(region, offset, strict=True)))
    return out


def param_keys(op: Operator, box: Box) -> tuple[tuple[str, Region], ...]:
    """(fqn, region) of every parameter a part of `op` with `box` holds, in the op's parameter order."""
    return tuple(param_pieces(op, box).values())


def parts(op: Operator, cfg: ParallelConfig, limit: int | None = None) -> list[tuple[Box, int]]:
    """(box, device) for every part, in part order (the first `limit` parts where given)."""
    dims = dims_of(op)
    degrees = [cfg.degree(d.name) for d in dims]
    out = []
    grid = itertools.product(*(range(g) for g in degrees))
    for idx, device in itertools.islice(zip(grid, cfg.devices, strict=True), limit):
        box = tuple(split_range(d.size, g, i) for d, g, i in zip(dims, degrees, idx, strict=True))
        out.append((box, device))
    return out
