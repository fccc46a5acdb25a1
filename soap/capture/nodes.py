"""Reading traced aten nodes: an op's name, its arguments by schema name, tensor shapes and dtypes.

Owns the small helpers that grouping, the mappers and the builder share, so that all of them name an aten
op (`_aten_name`) and read its arguments (`_bind`) the same way. Imports torch and soap.graph; must not
import the other capture modules, the simulator, the search, the runtime or soapflow.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from soap.graph import DTYPE_BYTES, TensorSpec


def _aten_name(node: fx.Node) -> str:
    """The aten op's overload-packet name without trailing underscores (``relu`` for ``relu_``), or a
    Python callable's name: the key of `_MAPPERS` and the names `OpDef.captured_from` lists."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._opname.rstrip("_") or target._opname
    return getattr(target, "__name__", "op").strip("_") or "op"


def _is_getitem(node: fx.Node) -> bool:
    return node.target is operator.getitem and isinstance(node.args[0], fx.Node)


def _bind(node: fx.Node) -> dict[str, Any] | None:
    """The node's arguments by schema name, defaults filled in; None for a non-aten target."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return None
    bound = {}
    positional = list(node.args)
    for arg in node.target._schema.arguments:
        if positional and not arg.kwarg_only:
            bound[arg.name] = positional.pop(0)
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        else:
            bound[arg.name] = arg.default_value if arg.has_default_value() else None
    return bound


def _tensors_of(value: Any) -> list[tuple[int, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        return [(0, value)]
    if isinstance(value, tuple | list):
        return [(i, v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    return []


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"tensors of dtype {name} are not supported; supported: {', '.join(DTYPE_BYTES)}")
    return name


def _spec(value: torch.Tensor) -> TensorSpec:
    return TensorSpec(shape=tuple(value.shape), dtype=_dtype_name(value.dtype))


def _shape(value: Any) -> tuple[int, ...] | None:
    val = value.meta.get("val") if isinstance(value, fx.Node) else value
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _axis(axis: int, ndim: int) -> int:
    return axis + ndim if axis < 0 else axis



def _qualname(target: Any) -> str:
    """A call target as a dotted name resolvable from its top-level package (``torch.ops.aten.cumsum.default``,
    ``_operator.getitem``): what an opaque op or a constant's recipe calls."""
    if isinstance(target, torch._ops.OpOverload):
        return f"torch.ops.{target.namespace}.{target._opname}.{target._overloadname}"
    module = getattr(target, "__module__", None) or "builtins"
    return f"{module}.{getattr(target, '__qualname__', target)}"


def _encode(value: Any, tensor: Callable[[fx.Node], Any]) -> Any:
    """A call argument as JSON in the encoding of opaque ops (soap/capture/builder.py); `tensor` encodes a
    node holding a tensor (an input, a parameter, a recipe's step)."""
    if isinstance(value, fx.Node):
        if isinstance(value.meta.get("val"), torch.Tensor):
            return tensor(value)
        return _encode(value.meta.get("val"), tensor)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple | list):
        return [_encode(v, tensor) for v in value]
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": None}
    if isinstance(value, torch.layout | torch.memory_format):
        return {"torch": str(value).removeprefix("torch.")}
    return {"repr": repr(value)}
