"""The zoo's multilayer perceptron: Linear layers with ReLU between them, trained as a regression."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """`Linear(sizes[0], sizes[1]) → ReLU → … → Linear(sizes[-2], sizes[-1])`, no activation at the end."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        super().__init__()
        if len(sizes) < 2:
            raise ValueError(f"an MLP needs at least two sizes, got {sizes}")
        layers: list[nn.Module] = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            if i > 0:
                layers.append(nn.ReLU())
            layers.append(nn.Linear(fan_in, fan_out))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def mlp(batch_size: int = 64, *, sizes: tuple[int, ...] = (1024, 4096, 1024)) -> tuple:
    """MLP on `x[N, sizes[0]]` (float32) regressing `target[N, sizes[-1]]` (float32, mse loss)."""
    module = MLP(tuple(sizes))
    x = torch.empty(batch_size, sizes[0], device="meta")
    target = torch.empty(batch_size, sizes[-1], device="meta")
    return module, (x, target)
