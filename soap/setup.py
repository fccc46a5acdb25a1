"""`TrainSetup`: the training options one step depends on, as one frozen value.

The lowering (`soap.lowering`), the simulator and the runtime all read the same `TrainSetup`; none of
them keeps a default of its own for these options. The command line builds it (`--optimizer`, `--lr`,
`--momentum`, `--weight-decay`, `--bucket-mb`, `--precision`, `--schedule`), and a strategy file records the
setup it was found for.

- `optimizer`: ``sgd`` (torch.optim.SGD with `momentum`; one state tensor per parameter when momentum is
  non-zero, none otherwise) or ``adamw`` (torch.optim.AdamW: two state tensors per parameter, the first
  and second moments).
- `precision`: the compute dtype, ``fp32``, ``bf16`` or ``fp16`` (`compute_dtype`). Under ``bf16`` and
  ``fp16`` (mixed precision) the parameters stay float32 master weights; every op computes in the compute
  dtype on a copy of its parameters, its float activations (and the float batch and constants it reads)
  are in that dtype, and so are the tensors the exchanges move; the loss is computed in float32;
  parameter gradients arrive in float32 on the masters and are all-reduced and applied in float32
  (`soap.lowering.run_graph` states it for the lowering, the runtime executes it). ``fp16`` scales the
  loss dynamically (`loss_scaling`; the runtime's `LossScaler`): before any rank updates, every rank
  learns whether any rank's gradients overflowed, one small all-reduce over every rank, and the check
  and the division by the scale stream the gradients once more (`update_passes` counts them).
- `bucket_mb`: gradient all-reduce bucket size in MiB, counted over full-size parameters in backward
  order (the lowering's bucket rule, `soap.lowering.GradFlow`): DDP's 25 MiB by default.
- `schedule`: how the rounds of ops whose devices repeat (micro-batches) interleave forward and backward
  (the lowering's order rule, `soap.lowering.step_orders`): ``gpipe`` runs every forward before any
  backward (all micro-batches' activations in flight at once); ``1f1b`` lets a device run a new
  micro-batch's forward only while fewer than its number of pipeline stages to the loss are in flight,
  and at that cap one backward, then one forward (PipeDream-Flush / Megatron-LM's non-interleaved
  schedule).
  Without repeated devices both are the same step.

Pure Python: must not import torch, the simulator, the search or the runtime.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

OPTIMIZERS = ("sgd", "adamw")
PRECISIONS = ("fp32", "bf16", "fp16")
SCHEDULES = ("gpipe", "1f1b")
COMPUTE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# What one optimizer step streams, in passes over the parameter bytes (reads plus writes of parameter,
# gradient and state), per optimizer: SGD reads parameter and gradient and writes the parameter (3), with
# momentum it also reads and writes the momentum buffer (5); AdamW reads parameter, gradient and both
# moments and writes parameter and moments (7).
_NUMBERS = ("lr", "momentum", "weight_decay", "bucket_mb")  # the fields that hold numbers
_UPDATE_PASSES = {("sgd", False): 3, ("sgd", True): 5, ("adamw", False): 7, ("adamw", True): 7}
# the loss scaler's check and division of the gradients before the update: a read and a write of each
_UNSCALE_PASSES = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainSetup:
    """How every step trains (see the module docstring). Validated on construction."""

    optimizer: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    precision: str = "fp32"
    bucket_mb: float = 25.0
    schedule: str = "gpipe"

    def __post_init__(self) -> None:
        for name in _NUMBERS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; known: {', '.join(OPTIMIZERS)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; known: {', '.join(PRECISIONS)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; known: {', '.join(SCHEDULES)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be non-negative, got {self.weight_decay}")
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {self.bucket_mb}")

    @property
    def compute_dtype(self) -> str:
        """The dtype name ops compute in: float32, bfloat16 or float16."""
        return COMPUTE_DTYPES[self.precision]

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)

    @property
    def optimizer_state_copies(self) -> int:
        """Optimizer state tensors per parameter, each the parameter's size."""
        if self.optimizer == "adamw":
            return 2
        return 1 if self.momentum else 0

    @property
    def loss_scaling(self) -> bool:
        """Whether the loss is scaled (fp16): the step then skips its update when any rank's gradients
        overflow, which every rank learns before it updates anything."""
        return self.precision == "fp16"

    @property
    def update_passes(self) -> int:
        """Passes over the parameter bytes one optimizer step streams (module constants), counting under
        loss scaling the scaler's check and division of the gradients (`_UNSCALE_PASSES`)."""
        return _UPDATE_PASSES[(self.optimizer, bool(self.momentum))] + (_UNSCALE_PASSES if self.loss_scaling else 0)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> TrainSetup:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ValueError(f"unknown training setup key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**dict(doc))


__all__ = ["OPTIMIZERS", "PRECISIONS", "SCHEDULES", "TrainSetup"]
