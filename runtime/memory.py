"""Measured memory of one rank: the peak bytes of live tensors over a region of code (a training step).

Owns `PeakMemory`, `track_peak` and `measure_step`. Imports torch, `soap` and the other `runtime` modules
only (no simulator, no search, no soapflow).

What is counted: tensor bytes, not the process's resident memory. On a CPU, `track_peak` runs torch's
own tracker, `torch.distributed._tools.mem_tracker.MemTracker` (a private module of torch; a
`TorchDispatchMode` that keys every tensor storage it sees by a weak reference and subtracts it when the
storage is freed). Each distinct storage counts once, at its full size: a storage of `held` (tensors,
optimizers' state, modules' parameters and buffers) from the start, any other from the moment an op run
inside the context first returns a tensor on it, until it is freed. Every op that reaches torch's
dispatcher is seen: the forward's outputs and what autograd saves for backward, the gradients backward
allocates (of activations and of parameters), the optimizer's state and temporaries, the buffers the
collectives write into (the dispatcher runs the `c10d` ops too). Not seen: memory a kernel allocates for
itself without a tensor (scratch space of a convolution, gloo's own buffers), the allocator's slack and
fragmentation, and tensors that exist outside `held` and that no op in the context touches (the full
model a rank built its shards from, say).

With a CUDA `device`, the CUDA caching allocator's own statistics count instead: the held tensors' bytes
plus the growth of `torch.cuda.max_memory_allocated` over what was allocated at entry (sizes rounded as
the allocator rounds them).

`measure_step` is one training step of `runtime.train.train_step` under `track_peak`, with the rank's
state held: its parameter shards, optimizer state, buffers, sources and the batch. Run it after a warm-up
step, so that the optimizer state exists, as in every later step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from itertools import chain

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from runtime.executor import Executor
from runtime.train import LossScaler, train_step

HeldItem = torch.Tensor | torch.optim.Optimizer | torch.nn.Module
# MemTracker's reference types, by the phase of the step that created a storage: `held` (named at entry),
# `forward` (activations, forward temporaries, recomputation), `backward` (gradients of activations and
# of parameters, what backward allocates), `optimizer` (its state and temporaries).
_KINDS = {"Parameter": "held", "Buffer": "held", "Other": "held", "Activation": "forward",
          "Temp": "backward", "Gradient": "backward", "Optstate": "optimizer"}


@dataclass(slots=True)
class PeakMemory:
    """What `track_peak` measured: `peak_bytes`, the most tensor bytes live at once, and `by_kind`, at
    that moment, the bytes per phase that created them (`held`, `forward`, `backward`, `optimizer`; empty
    under CUDA, whose allocator does not tell)."""

    peak_bytes: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)


def _held_tensors(held: Iterable[HeldItem]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for item in held:
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, torch.optim.Optimizer):
            out += [v for state in item.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        else:
            out += [*item.parameters(), *item.buffers()]
    return out


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


class _PeakTracker:
    """The context manager of `track_peak`. It lets go of the held items on entry, so that one freed
    inside the block (the previous batch, replaced in forward) is subtracted when it is freed."""

    def __init__(self, held: list[HeldItem], device: torch.device) -> None:
        self._held: list[HeldItem] | None = held
        self._device = device
        self._result = PeakMemory()
        self._tracker: MemTracker | None = None
        self._base = self._entry = 0

    def __enter__(self) -> PeakMemory:
        held, self._held = self._held, None
        assert held is not None, "a track_peak context is entered once"
        device = self._device
        if device.type == "cuda":
            if device.index is None:  # "cuda": the current GPU, as tensors name it (cuda:N)
                device = self._device = torch.device("cuda", torch.cuda.current_device())
            self._base = _storage_bytes(t for t in _held_tensors(held) if t.device == device)
            del held
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self._entry = torch.cuda.memory_allocated(device)
            return self._result
        self._tracker = MemTracker()
        self._tracker.track_external(*held)
        del held
        self._tracker.__enter__()
        return self._result

    def __exit__(self, *exc: object) -> None:
        device, result = self._device, self._result
        if self._tracker is None:
            torch.cuda.synchronize(device)
            result.peak_bytes = self._base + torch.cuda.max_memory_allocated(device) - self._entry
            return
        self._tracker.__exit__(*exc)
        snap = self._tracker.get_tracker_snapshot("peak").get(device, {})
        result.peak_bytes = int(snap.get("Total", 0))
        for ref, nbytes in snap.items():
            kind = _KINDS.get(getattr(ref, "value", ref))
            if kind is not None and nbytes:
                result.by_kind[kind] = result.by_kind.get(kind, 0) + int(nbytes)


def track_peak(held: Iterable[HeldItem] = (), *, device: str | torch.device = "cpu"
               ) -> AbstractContextManager[PeakMemory]:
    """A context manager measuring the peak bytes of live tensors over its `with` block (module
    docstring), counting the tensors of `held` (tensors, optimizers' state, modules' parameters and
    buffers) from the start; the `PeakMemory` it yields is filled in when the block exits. A held tensor
    the block frees stops counting when it is freed, provided the caller keeps no other reference to it
    (pass an iterator, not a list kept in a variable)."""
    return _PeakTracker(list(held), torch.device(device))


def measure_step(executor: Executor, optimizer: torch.optim.Optimizer | None, batch: Sequence[torch.Tensor], *,
                 step: int, scaler: LossScaler | None = None, device: str | torch.device = "cpu") -> PeakMemory:
    """The peak tensor bytes of one training step on this rank (`runtime.train.train_step`), counting
    what the rank holds when the step starts: parameter shards, optimizer state, buffers, sources (the
    constants and the previous batch) and `batch`."""
    held = chain(executor.shards.values(), executor.buffers.values(), executor.sources.values(), batch,
                 [optimizer] if optimizer is not None else [])
    with track_peak(held, device=device) as peak:
        train_step(executor, optimizer, batch, step=step, scaler=scaler)
    return peak


__all__ = ["PeakMemory", "measure_step", "track_peak"]
