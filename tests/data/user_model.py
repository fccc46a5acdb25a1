"""A plain user model, as a user would hand it to soapflow (`tests/data/user_model.py:build`)."""

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        x = torch.relu(self.conv(x))
        x = torch.cumsum(x, dim=1)  # not in the op registry: captured as an opaque op
        return self.fc(x.flatten(1))


def build(batch_size: int = 4):
    return Net(), (torch.randn(batch_size, 3, 8, 8), torch.randint(0, 10, (batch_size,)))


def not_a_model(batch_size: int = 4):
    return 42
