"""Capture: a PyTorch module and an example batch become an `OperatorGraph`.

Owns the translation from torch programs to the op kinds of ``docs/op_kinds.md``: tracing, grouping into
operators, naming, shapes, FLOPs and bytes. The only package of `soap` that imports torch; it must not
import the simulator, the search, the runtime or soapflow.

`capture` checks its arguments, makes fake copies of the batch and runs the stages in order, one module
each:

1. `tracing`: the model and its loss, wrapped in one module, traced on fake tensors into training-IR aten
   ops (torch.export, or torch.fx with the standard leaf modules where export fails), with
   ``nn.MultiheadAttention`` computing in its inputs' layout (`attention`), stacked recurrences with dropout
   layer by layer (`recurrent`) and Hugging Face mixtures of experts as one call (`experts`);
2. `grouping`: the aten nodes grouped into operator calls by ``nn_module_stack``;
3. `mappers`: each call mapped to an op kind, or left opaque;
4. `builder`: the operators emitted with names, parameters, shapes, FLOPs and bytes; values neither the
   batch nor the parameters reach folded into constants;
5. `fused`: a fused projection whose output is split (q, k and v from one linear) becomes one linear per
   piece over its block of the fused weight.

`nodes` holds the helpers that read aten nodes, shared by stages 2 to 4; stage 5 reads operators only. Each
module's docstring gives the rules of its stage. Names with a leading underscore are private to this package;
its public names are `capture` and `LEAF_MODULES`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from soap.capture.attention import captured_attention
from soap.capture.builder import _Builder
from soap.capture.experts import experts_as_one_call
from soap.capture.fused import split_fused_linears
from soap.capture.nodes import _dtype_name
from soap.capture.recurrent import layered_recurrences
from soap.capture.tracing import (
    LEAF_MODULES,
    ModelOutputError,
    _default_loss,
    _quiet,
    _trace_export,
    _trace_fx,
    _WithLoss,
    default_loss,
)
from soap.capture.tracing import _is_leaf as _is_leaf  # re-exported: tests list leaf modules with it
from soap.graph import OperatorGraph

__all__ = ["LEAF_MODULES", "ModelOutputError", "capture", "default_loss"]


def capture(module: nn.Module, inputs: torch.Tensor | tuple[torch.Tensor, ...], target: torch.Tensor,
            loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None, *, name: str = "",
            batch_size: int | None = None) -> OperatorGraph:
    """The operator graph of one training step of `module` on `inputs` with loss `loss_fn(output, target)`.

    `inputs` (the forward's positional arguments) and `target` may live on the meta device; only their
    shapes and dtypes are read. `loss_fn` defaults to cross entropy over the last axis for integer
    targets and mean squared error otherwise. `batch_size` defaults to the first axis of the first input.
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"capture needs an nn.Module, got {type(module).__name__}")
    tensors = tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError(f"inputs must be a tensor or a non-empty tuple of tensors, got {_describe(inputs)}")
    if not isinstance(target, torch.Tensor):
        raise ValueError(f"target must be a tensor, got {type(target).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if batch_size is None:
        if tensors[0].dim() == 0:
            raise ValueError("the first input is a scalar; pass batch_size explicitly")
        batch_size = int(tensors[0].shape[0])
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    for t in (*tensors, target):
        _dtype_name(t.dtype)

    # `default_loss` picks its loss by the target's dtype and rank, which symbolic tracing cannot branch on:
    # pick it here, once, as for no loss given
    wrapper = _WithLoss(module, _default_loss(target) if loss_fn in (None, default_loss) else loss_fn)
    fake_mode = torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)
    device = _device_of(module, tensors[0])
    with fake_mode:
        fake_inputs = tuple(torch.empty(t.shape, dtype=t.dtype, device=device) for t in tensors)
        fake_target = torch.empty(target.shape, dtype=target.dtype, device=device)
    with _quiet(), torch.enable_grad(), captured_attention(), layered_recurrences(), experts_as_one_call(module):
        try:
            traced = _trace_export(wrapper, fake_inputs, fake_target)
        except ModelOutputError as error:
            raise ValueError(f"cannot capture {type(module).__name__}: {error}") from None
        except Exception as export_error:
            try:
                traced = _trace_fx(wrapper, fake_inputs, fake_target, fake_mode)
            except Exception as fx_error:
                raise ValueError(
                    f"cannot capture {type(module).__name__}: torch.export failed "
                    f"({type(export_error).__name__}: {_first_line(export_error)}) and torch.fx failed "
                    f"({type(fx_error).__name__}: {_first_line(fx_error)}){_hint(export_error)}") from fx_error
        ops = split_fused_linears(_Builder(traced, wrapper).build())
    return OperatorGraph(ops, name=name, batch_size=batch_size)


def _describe(value: Any) -> str:
    if isinstance(value, tuple | list):
        return f"{type(value).__name__} of ({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__


def _hint(error: Exception) -> str:
    """What to do about a trace that failed with `error`, where the cause is a known one."""
    if "data-dependent" in str(error) or "DataDependent" in type(error).__name__ + str(error)[:200]:
        return ("; the forward branches on a tensor's value (a Python if or loop on a tensor), which one "
                "graph cannot hold: write the branch with torch.where (or torch.cond)")
    return ""


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [""])[0][:300]


def _device_of(module: nn.Module, first: torch.Tensor) -> torch.device:
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu") if first.device.type == "meta" else first.device

