"""Small models the planner tests share (imported by module name, as pytest puts this folder on sys.path)."""

from __future__ import annotations

import torch
from torch import nn


class Residual(nn.Module):
    """Two residual blocks, each an MLP with a pointwise nonlinearity. torch.compile's min-cut partition recomputes
    their tanh and sigmoid, which the planner's fill saves again under a budget that has room for them."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.c, self.d = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.b(torch.tanh(self.a(x)))
        x = x + self.d(torch.sigmoid(self.c(x)))
        return x.square()
