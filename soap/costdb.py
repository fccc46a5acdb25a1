"""The cost database: measured forward and backward times of op parts, one JSON object per line.

Owns `Measurement` (one timed part), `CostDatabase` (lookup by key; `CostDatabase.load` and `.save` are
the file functions as methods) and the file functions `load`, `append` and `save`. The runtime writes
measurements, the simulator's `MeasuredCostModel` reads them; both build keys with `part_key`, so a part
the runtime timed is exactly the part the simulator looks up.

File layout (JSON lines, UTF-8; one measurement per line, later lines win over earlier ones)::

    {"device_kind": "p100", "op_kind": "conv2d", "dtype": "float32",
     "inputs": [[32, 64, 56, 56]], "outputs": [[32, 64, 56, 56]], "params": [[64, 64, 3, 3], [64]],
     "attrs": "{\\"dilation\\": [1, 1], \\"groups\\": 1, \\"padding\\": [1, 1], \\"stride\\": [1, 1]}",
     "grads": "1", "fwd_ms": 0.41, "bwd_ms": 0.87, "repeats": 20, "source": "runtime"}

The key is (device kind, op kind, dtype, part input shapes, part output shapes, part parameter shapes, attrs
signature, gradient inputs). Shapes are those of the part's regions (`soap.opdef`), halos included, so a
2-way height split of a convolution is keyed by the shapes its part really reads. Parameter shapes and the
attrs signature tell apart ops whose tensors have equal shapes but whose work differs (a 1x1 and a padded
3x3 convolution); the signature is canonical JSON of the attrs minus those that only name things
(`NAMING_ATTRS`). The gradient inputs (`grads`: "1" or "0" per input of the op, "" when not given) say which
inputs carry a gradient: a backward that also computes an input's gradient does about twice the work of one
that does not (the first layer of an MLP reads the batch, a later one of the same shapes does not), so the
two are timed apart; an op with frozen parameters (`ParamSpec.trainable` False) computes no gradient for
them, and its flags go on with "/" and "1" or "0" per parameter (by name) that gets one. `fwd_ms` and
`bwd_ms` are medians in milliseconds after warm-up, timed while every device of the machine runs a part at
once (as under a split); the optional `solo_fwd_ms` and `solo_bwd_ms` are the same part timed alone (as when
the part is a whole op and the other devices wait). They differ where devices share hardware - local
processes on the cores of one CPU - and are equal on separate GPUs. `repeats` and `source` are
informational; none of these is part of the key. A line that is not a valid measurement is skipped with a
warning (a crashed writer leaves at most one); `append` and `save` write a temporary file in the same folder
and rename it over the database, so readers never see a half-written file.

Must not import torch, the simulator, the search or the runtime.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from soap.files import write_atomic
from soap.graph import Operator
from soap.opdef import Box
from soap.registry import op_def

Shape = tuple[int, ...]
Key = tuple[str, str, str, tuple[Shape, ...], tuple[Shape, ...], tuple[Shape, ...], str, str]

# attrs that name things (buffers, batch positions, random seeds) or repeat the shapes: not part of a key
NAMING_ATTRS = frozenset({"input_shapes", "fqn", "running_mean", "running_var", "position", "role", "seed"})


class CostDatabaseError(ValueError):
    """A cost database file that cannot be read at all (missing folder, not UTF-8, ...)."""


def _shapes(value: Any, what: str) -> tuple[Shape, ...]:
    if not isinstance(value, list | tuple) or not all(
            isinstance(s, list | tuple) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                for n in s) for s in value):
        raise ValueError(f"{what} must be a list of shapes (lists of non-negative integers), got {value!r}")
    return tuple(tuple(int(n) for n in s) for s in value)


def _ms(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a non-negative number of milliseconds, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class Measurement:
    """Forward and backward time (ms) of one op part on one device kind."""

    device_kind: str
    op_kind: str
    inputs: tuple[Shape, ...]
    outputs: tuple[Shape, ...]
    params: tuple[Shape, ...] = ()
    attrs: str = ""
    grads: str = ""
    dtype: str = "float32"
    fwd_ms: float
    bwd_ms: float
    solo_fwd_ms: float | None = None
    solo_bwd_ms: float | None = None
    repeats: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("device_kind", "op_kind", "dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"measurement {name} must be a non-empty string, got {value!r}")
        if not isinstance(self.attrs, str):
            raise ValueError(f"measurement attrs must be a signature string, got {self.attrs!r}")
        if not isinstance(self.grads, str) or set(self.grads) - {"0", "1", "/"} or self.grads.count("/") > 1:
            raise ValueError(f"measurement grads must be a string of 0 and 1 (then / and 0 and 1 for the "
                             f"parameters), got {self.grads!r}")
        object.__setattr__(self, "inputs", _shapes(self.inputs, "inputs"))
        object.__setattr__(self, "outputs", _shapes(self.outputs, "outputs"))
        object.__setattr__(self, "params", _shapes(self.params, "params"))
        object.__setattr__(self, "fwd_ms", _ms(self.fwd_ms, "fwd_ms"))
        object.__setattr__(self, "bwd_ms", _ms(self.bwd_ms, "bwd_ms"))
        if (self.solo_fwd_ms is None) != (self.solo_bwd_ms is None):
            raise ValueError("solo_fwd_ms and solo_bwd_ms go together (both or neither)")
        if self.solo_fwd_ms is not None:
            object.__setattr__(self, "solo_fwd_ms", _ms(self.solo_fwd_ms, "solo_fwd_ms"))
            object.__setattr__(self, "solo_bwd_ms", _ms(self.solo_bwd_ms, "solo_bwd_ms"))
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 0:
            raise ValueError(f"repeats must be a non-negative integer, got {self.repeats!r}")

    @property
    def key(self) -> Key:
        return (self.device_kind, self.op_kind, self.dtype, self.inputs, self.outputs, self.params, self.attrs,
                self.grads)

    def to_dict(self) -> dict[str, Any]:
        out = {"device_kind": self.device_kind, "op_kind": self.op_kind, "dtype": self.dtype,
               "inputs": [list(s) for s in self.inputs], "outputs": [list(s) for s in self.outputs],
               "params": [list(s) for s in self.params], "attrs": self.attrs,
               "fwd_ms": self.fwd_ms, "bwd_ms": self.bwd_ms, "repeats": self.repeats, "source": self.source}
        if self.grads:
            out["grads"] = self.grads
        if self.solo_fwd_ms is not None:
            out |= {"solo_fwd_ms": self.solo_fwd_ms, "solo_bwd_ms": self.solo_bwd_ms}
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Measurement:
        if not isinstance(d, Mapping):
            raise ValueError(f"a measurement must be a JSON object, got {type(d).__name__}")
        missing = [k for k in ("device_kind", "op_kind", "inputs", "outputs", "fwd_ms", "bwd_ms") if k not in d]
        if missing:
            raise ValueError(f"measurement lacks {', '.join(missing)}")
        return cls(device_kind=d["device_kind"], op_kind=d["op_kind"], dtype=d.get("dtype", "float32"),
                   inputs=d["inputs"], outputs=d["outputs"], params=d.get("params", []),
                   attrs=d.get("attrs", ""), grads=d.get("grads", ""), fwd_ms=d["fwd_ms"], bwd_ms=d["bwd_ms"],
                   solo_fwd_ms=d.get("solo_fwd_ms"), solo_bwd_ms=d.get("solo_bwd_ms"),
                   repeats=d.get("repeats", 0), source=d.get("source", ""))


def attrs_signature(op: Operator) -> str:
    """Canonical JSON of the op's attrs that change its work (`NAMING_ATTRS` left out)."""
    def thaw(v: Any) -> Any:
        if isinstance(v, Mapping):
            return {str(k): thaw(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [thaw(x) for x in v]
        return v
    kept = {k: thaw(v) for k, v in op.attrs.items() if k not in NAMING_ATTRS}
    return json.dumps(kept, sort_keys=True, separators=(", ", ": "), default=str) if kept else ""


def part_key(op: Operator, box: Box, device_kind: str, grads: Sequence[bool] | None = None) -> Key:
    """The database key of the part `box` of `op` on a device of `device_kind`, whose inputs carry a
    gradient where `grads` (one flag per input of the op) says so (see the module docstring)."""
    entry = op_def(op.kind)

    def shape(region: Any) -> Shape:
        return tuple(hi - lo for lo, hi in region)

    inputs = tuple(shape(r) for r in entry.input_regions(op, box) if r is not None)
    outputs = tuple(shape(entry.output_region(op, box, i)) for i in range(len(op.outputs)))
    params = tuple(shape(r) for _, r in sorted(entry.param_regions(op, box).items()))
    flags = "" if grads is None else "".join("1" if g else "0" for g in grads)
    if any(not p.trainable for p in op.params.values()):  # frozen parameters: their gradients are not computed
        flags += "/" + "".join("1" if op.params[name].trainable else "0" for name in sorted(op.params))
    return (device_kind, op.kind, op.outputs[0].dtype, inputs, outputs, params, attrs_signature(op), flags)


class CostDatabase:
    """Measurements by key; adding a measurement with an existing key replaces the old one."""

    __slots__ = ("_by_key",)

    def __init__(self, measurements: Iterable[Measurement] = ()):
        self._by_key: dict[Key, Measurement] = {}
        for m in measurements:
            self.add(m)

    def add(self, measurement: Measurement) -> None:
        self._by_key[measurement.key] = measurement

    def lookup(self, key: Key) -> Measurement | None:
        return self._by_key.get(key)

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self) -> Iterator[Measurement]:
        return iter(self._by_key.values())

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    @classmethod
    def load(cls, path: str | os.PathLike, *, missing_ok: bool = False) -> CostDatabase:
        """The module function `load` (corrupt lines skipped with a warning)."""
        return load(path, missing_ok=missing_ok)

    def save(self, path: str | os.PathLike) -> None:
        """The module function `save`: the whole database, one line per key, atomically."""
        save(path, self)


def _lines(measurements: Iterable[Measurement]) -> str:
    return "".join(json.dumps(m.to_dict(), sort_keys=True) + "\n" for m in measurements)


def load(path: str | os.PathLike, *, missing_ok: bool = False) -> CostDatabase:
    """Read a cost database file; corrupt lines are skipped with one warning each.

    A missing file is an error (`CostDatabaseError`) unless `missing_ok`, which gives an empty database.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if missing_ok:
            return CostDatabase()
        raise CostDatabaseError(f"cost database {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CostDatabaseError(f"cannot read cost database {str(path)!r}: {exc}") from None
    db = CostDatabase()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            db.add(Measurement.from_dict(json.loads(line)))
        except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
            warnings.warn(f"cost database {str(path)!r} line {number} skipped: {exc}", stacklevel=2)
    return db


def append(path: str | os.PathLike, measurements: Iterable[Measurement]) -> None:
    """Add measurements at the end of the file (created if missing), atomically."""
    path = Path(path)
    try:
        old = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        old = ""
    if old and not old.endswith("\n"):
        old += "\n"  # a torn last line stays on its own line (and is skipped by `load`)
    write_atomic(path, old + _lines(measurements))


def save(path: str | os.PathLike, db: CostDatabase | Iterable[Measurement]) -> None:
    """Write the whole database (one line per key), atomically."""
    write_atomic(Path(path), _lines(db))
