"""Resolving a MODEL reference: a zoo name, `path/to/file.py:function` or `package.module:function`.

The function takes the batch size and returns `(module, (inputs, target))` or
`(module, (inputs, target), loss_fn)`; `inputs` is a tensor or a tuple of tensors (the forward args). The
first dim of every input and of the target is the batch (the sample dim of the op registry); the loss
(`soapflow.api.capture_model` checks it) is a scalar.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from soap.capture import default_loss as default_loss  # re-exported: the loss of a model given none
from soapflow import zoo


class ModelError(ValueError):
    """A model reference that cannot be resolved or a model function that returns the wrong thing."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A model ready to capture and run. `inputs` is always a tuple."""

    name: str
    module: nn.Module
    inputs: tuple[torch.Tensor, ...]
    target: torch.Tensor
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None
    batch_size: int
    reference: str


def _load_function(ref: str) -> Callable:
    location, _, func_name = ref.rpartition(":")
    if not location or not func_name:
        raise ModelError(f"model {ref!r} is neither a zoo model ({', '.join(zoo.ZOO)}) "
                         f"nor of the form path/to/file.py:function or package.module:function")
    if ":" in location:
        raise ModelError(f"model {ref!r} has {ref.count(':')} colons; expected one, as in path/to/file.py:function "
                         f"or package.module:function")
    if location.endswith(".py"):
        path = Path(location)
        if not path.is_file():
            raise ModelError(f"model file {location!r} does not exist"
                             + (": it is a directory" if path.is_dir() else ""))
        mod_name = f"soapflow_user_{path.stem}_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except (Exception, SystemExit) as exc:  # a script that calls sys.exit() on import, too
            raise ModelError(f"importing {location!r} failed: {type(exc).__name__}: {exc}") from None
    else:
        try:
            module = importlib.import_module(location)
        except Exception as exc:
            raise ModelError(f"cannot import module {location!r}: {type(exc).__name__}: {exc}") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ModelError(f"{location!r} has no function {func_name!r}")
    return func


def _default_batch(func: Callable) -> int | None:
    try:
        param = next(iter(inspect.signature(func).parameters.values()))
    except (StopIteration, TypeError, ValueError):
        return None
    return param.default if isinstance(param.default, int) else None


def load_model(ref: str, batch_size: int | None = None) -> ModelSpec:
    """Build the model named by `ref` at the global batch `batch_size` (the model's default when None)."""
    if batch_size is not None and batch_size < 1:
        raise ModelError(f"--batch must be positive, got {batch_size}")
    if ref in zoo.ZOO:
        entry = zoo.ZOO[ref]
        func, name = entry.build, ref
        batch = batch_size or entry.default_batch
    else:
        func = _load_function(ref)
        name = ref.rpartition(":")[2]
        batch = batch_size or _default_batch(func)
        if batch is None:
            raise ModelError(f"model {ref!r} has no default batch size; pass --batch N")
    torch.manual_seed(0)
    try:
        result = func(batch)
    except (Exception, SystemExit) as exc:
        raise ModelError(f"model function {ref!r} failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise ModelError(f"model function {ref!r} must return (module, (inputs, target)) "
                         f"or (module, (inputs, target), loss_fn)")
    module, example = result[0], result[1]
    loss_fn = result[2] if len(result) == 3 else None
    if not isinstance(module, nn.Module):
        raise ModelError(f"model function {ref!r} returned {type(module).__name__}, not an nn.Module")
    if not isinstance(example, tuple | list) or len(example) != 2:
        raise ModelError(f"model function {ref!r} must return the example batch as (inputs, target)")
    inputs, target = example
    inputs = tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)
    if not all(isinstance(t, torch.Tensor) for t in (*inputs, target)):
        raise ModelError(f"model function {ref!r}: inputs and target must be tensors")
    if loss_fn is not None and not callable(loss_fn):
        raise ModelError(f"model function {ref!r}: the loss must be callable")
    # The sample dim of every batch tensor is its first (docs/architecture.md, 4: the registry's dims).
    shapes = ["x".join(map(str, t.shape)) or "scalar" for t in (*inputs, target)
              if t.dim() == 0 or t.shape[0] != batch]
    if shapes:
        raise ModelError(f"model function {ref!r} was asked for batch {batch} but returned tensors of shape "
                         f"{', '.join(shapes)}; the first dim of every input and of the target must be the batch")
    return ModelSpec(name=name, module=module, inputs=inputs, target=target, loss_fn=loss_fn,
                     batch_size=batch, reference=ref)
