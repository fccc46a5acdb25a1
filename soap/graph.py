"""The operator graph: what capture produces and every later stage consumes.

Owns `TensorSpec`, `TensorRef`, `Operator` and `OperatorGraph`. Plain data: no torch, no simulator.
An `OperatorGraph` lists its ops in topological order. Batch tensors enter through ops of kind
``input`` (one per example-batch tensor, the loss target last), so every tensor in the graph has a
producer and every op, inputs included, gets a `ParallelConfig` in a strategy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSpec:
    """Shape and dtype of one tensor; dtype is the torch name without the prefix (``float32``)."""

    shape: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if any(s < 0 for s in self.shape):
            raise ValueError(f"negative size in shape {self.shape}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; known: {', '.join(DTYPE_BYTES)}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorRef:
    """Output `index` of the op named `op`."""

    op: str
    index: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamSpec:
    """One parameter of an op: its shape and its fully qualified name in the model's state dict.

    An op may use a block of a parameter rather than all of it (capture splits a fused projection, one
    linear for q, k and v each over its block of the fused weight): `shape` is then the block's shape,
    `offset` its first index per axis in the parameter and `whole_shape` the parameter's shape. Regions
    the registry names are in the block's coordinates; `soap.config.param_pieces` moves them into the
    parameter's. Two ops share a parameter when they use the same block of it (`key`).

    `trainable` False: a frozen parameter (``requires_grad`` False in the model): training reads it and
    never changes it, so it gets no gradient, no synchronization, no update and no optimizer state.
    """

    shape: tuple[int, ...]
    fqn: str
    dtype: str = "float32"
    offset: tuple[int, ...] = ()
    whole_shape: tuple[int, ...] = ()
    trainable: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "offset", tuple(int(s) for s in self.offset))
        object.__setattr__(self, "whole_shape", tuple(int(s) for s in self.whole_shape))
        if bool(self.offset) != bool(self.whole_shape):
            raise ValueError(f"parameter {self.fqn!r}: a block needs both an offset and the whole shape")
        if self.offset and not (len(self.offset) == len(self.shape) == len(self.whole_shape) and all(
                0 <= o and o + s <= w for o, s, w in zip(self.offset, self.shape, self.whole_shape, strict=True))):
            raise ValueError(f"parameter {self.fqn!r}: block {self.shape} at {self.offset} does not lie "
                             f"inside its shape {self.whole_shape}")

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The parameter's shape in the model (the block's shape where the op uses all of it)."""
        return self.whole_shape or self.shape

    @property
    def box(self) -> tuple[tuple[int, int], ...]:
        """What the op holds as a region of the whole parameter: the block, or the whole parameter."""
        return tuple((o, o + n) for o, n in zip(self.offset or (0,) * len(self.shape), self.shape, strict=True))

    @property
    def key(self) -> str:
        """What the op holds: the fqn, with the block's offset where it uses a block."""
        return f"{self.fqn}@{','.join(map(str, self.offset))}" if self.offset else self.fqn

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class Operator:
    """One node of the graph.

    `params` maps the op's local parameter name (``weight``, ``bias``, ``weight_ih_l0``) to its spec;
    `attrs` holds the kind-specific attributes that the op registry documents per kind (JSON-able
    values: numbers, strings, bools, None, and lists/tuples of them). FLOPs and bytes are for the whole
    op at the captured batch size; bytes count memory traffic (inputs + outputs + parameters).
    """

    name: str
    kind: str
    inputs: tuple[TensorRef, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    params: Mapping[str, ParamSpec] = field(default_factory=dict)
    attrs: Mapping[str, Any] = field(default_factory=dict)
    module: str = ""
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_bytes: float = 0.0
    bwd_bytes: float = 0.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("an operator needs a non-empty name")
        if not self.outputs:
            raise ValueError(f"operator {self.name!r} has no outputs")
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        object.__setattr__(self, "attrs", _freeze(dict(self.attrs)))

    @property
    def output(self) -> TensorSpec:
        return self.outputs[0]

    @property
    def num_params(self) -> int:
        return sum(p.numel for p in self.params.values())

    @property
    def param_bytes(self) -> int:
        return sum(p.nbytes for p in self.params.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "inputs": [[r.op, r.index] for r in self.inputs],
            "outputs": [{"shape": list(t.shape), "dtype": t.dtype} for t in self.outputs],
            "params": {k: {"shape": list(p.shape), "fqn": p.fqn, "dtype": p.dtype,
                           **({"offset": list(p.offset), "whole_shape": list(p.whole_shape)} if p.offset else {}),
                           **({} if p.trainable else {"trainable": False})}
                       for k, p in self.params.items()},
            "attrs": _thaw(self.attrs),
            "module": self.module,
            "fwd_flops": self.fwd_flops,
            "bwd_flops": self.bwd_flops,
            "fwd_bytes": self.fwd_bytes,
            "bwd_bytes": self.bwd_bytes,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Operator:
        return cls(
            name=d["name"],
            kind=d["kind"],
            inputs=tuple(TensorRef(op=o, index=i) for o, i in d["inputs"]),
            outputs=tuple(TensorSpec(shape=tuple(t["shape"]), dtype=t["dtype"]) for t in d["outputs"]),
            params={k: ParamSpec(shape=tuple(p["shape"]), fqn=p["fqn"], dtype=p.get("dtype", "float32"),
                                 offset=tuple(p.get("offset", ())), whole_shape=tuple(p.get("whole_shape", ())),
                                 trainable=bool(p.get("trainable", True)))
                    for k, p in d["params"].items()},
            attrs=d["attrs"],
            module=d.get("module", ""),
            fwd_flops=d["fwd_flops"], bwd_flops=d["bwd_flops"],
            fwd_bytes=d["fwd_bytes"], bwd_bytes=d["bwd_bytes"],
        )


class OperatorGraph:
    """Ops in topological order, with lookup by name and consumer lists.

    Immutable after construction; checks that names are unique and every input refers to an output
    of an earlier op.
    """

    __slots__ = ("name", "batch_size", "ops", "_index", "_consumers", "_fingerprint", "_shared")

    def __init__(self, ops: list[Operator] | tuple[Operator, ...], *, name: str = "", batch_size: int = 0):
        self.name = name
        self.batch_size = int(batch_size)
        self.ops: tuple[Operator, ...] = tuple(ops)
        self._index: dict[str, int] = {}
        consumers: dict[str, list[tuple[str, int, int]]] = {}
        ops = list(self.ops)
        for i, op in enumerate(ops):
            if op.name in self._index:
                raise ValueError(f"duplicate operator name {op.name!r}")
            for slot, ref in enumerate(op.inputs):
                j = self._index.get(ref.op)
                if j is None:
                    raise ValueError(f"operator {op.name!r} reads {ref.op!r}, which is not an earlier op")
                if not 0 <= ref.index < len(self.ops[j].outputs):
                    raise ValueError(f"operator {op.name!r} reads output {ref.index} of {ref.op!r}, "
                                     f"which has {len(self.ops[j].outputs)}")
                consumers.setdefault(ref.op, []).append((op.name, slot, ref.index))
            if op.inputs and "input_shapes" not in op.attrs:
                # The registry clips input regions to the input tensors, so every op carries their shapes.
                shapes = [list(ops[self._index[r.op]].outputs[r.index].shape) for r in op.inputs]
                ops[i] = op = dataclasses.replace(op, attrs={**_thaw(op.attrs), "input_shapes": shapes})
            self._index[op.name] = i
        self.ops = tuple(ops)
        self._consumers = {k: tuple(v) for k, v in consumers.items()}
        self._fingerprint: str | None = None
        self._shared: dict[str, tuple[str, ...]] | None = None

    def __len__(self) -> int:
        return len(self.ops)

    def __iter__(self) -> Iterator[Operator]:
        return iter(self.ops)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __getitem__(self, name: str) -> Operator:
        try:
            return self.ops[self._index[name]]
        except KeyError:
            raise KeyError(f"no operator named {name!r}") from None

    def position(self, name: str) -> int:
        return self._index[name]

    def consumers(self, name: str) -> tuple[tuple[str, int, int], ...]:
        """(consumer op name, input slot, producer output index) for every use of `name`'s outputs."""
        return self._consumers.get(name, ())

    def tensor(self, ref: TensorRef) -> TensorSpec:
        return self[ref.op].outputs[ref.index]

    def shared_params(self) -> dict[str, tuple[str, ...]]:
        """`ParamSpec.key` -> the names of the ops that use it, for parameters (or blocks of one) used by
        two or more ops."""
        if self._shared is None:
            users: dict[str, list[str]] = {}
            for op in self.ops:
                for key in dict.fromkeys(p.key for p in op.params.values()):
                    users.setdefault(key, []).append(op.name)
            self._shared = {key: tuple(names) for key, names in users.items() if len(names) > 1}
        return self._shared

    @property
    def num_params(self) -> int:
        """Distinct parameters (by fully qualified name), so shared weights count once."""
        seen: dict[str, int] = {}
        for op in self.ops:
            for p in op.params.values():
                seen[p.fqn] = math.prod(p.full_shape)
        return sum(seen.values())

    @property
    def total_flops(self) -> float:
        return sum(op.fwd_flops + op.bwd_flops for op in self.ops)

    @property
    def fingerprint(self) -> str:
        """sha256 of the structure: names, kinds, edges, shapes, parameter shapes (and which are frozen) and
        attributes."""
        if self._fingerprint is None:
            structure = [
                [op.name, op.kind, [[r.op, r.index] for r in op.inputs],
                 [[list(t.shape), t.dtype] for t in op.outputs],
                 sorted([k, list(p.shape)] + ([list(p.offset)] if p.offset else []) + ([] if p.trainable else [False])
                        for k, p in op.params.items()),
                 _thaw(op.attrs)]
                for op in self.ops
            ]
            blob = json.dumps(structure, sort_keys=True, default=str).encode()
            self._fingerprint = hashlib.sha256(blob).hexdigest()
        return self._fingerprint

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "batch_size": self.batch_size, "ops": [op.to_dict() for op in self.ops]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OperatorGraph:
        return cls([Operator.from_dict(o) for o in d["ops"]], name=d.get("name", ""),
                   batch_size=d.get("batch_size", 0))
