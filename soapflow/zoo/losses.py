"""Loss functions the zoo's builders return; module-level so that they pickle into worker processes."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of next-token logits `output[N, T, V]` against token ids `target[N, T]`."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
