"""Small models for the runtime tests, each paired with a step function (forward + scalar loss)."""

from __future__ import annotations

import torch
from torch import nn


def mlp() -> nn.Module:
    # Wide batch, narrow layers: activations dominate the peak, as in the cases DTR is for.
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(64, 64), nn.ReLU()]
    return nn.Sequential(*layers)


def mlp_step(model: nn.Module) -> torch.Tensor:
    x = torch.randn(2048, 64)
    return model(x).square().mean()


def cnn() -> nn.Module:
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(*block(3, 16), *block(16, 16), *block(16, 16), *block(16, 16), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(16, 10))


def cnn_step(model: nn.Module) -> torch.Tensor:
    x = torch.randn(8, 3, 32, 32)
    target = torch.randint(0, 10, (8,))
    return nn.functional.cross_entropy(model(x), target)


class TransformerWithDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, dropout=0.1, batch_first=True)
            for _ in range(3)
        )
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def transformer_step(model: nn.Module) -> torch.Tensor:
    x = torch.randn(8, 64, 64)
    return model(x).square().mean()


class LSTMLoop(nn.Module):
    """An LSTM cell unrolled by a Python loop: a long chain of small ops, as in the DTR paper's LSTM."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(32, 64)
        self.out = nn.Linear(64, 1)

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(xs.shape[1], 64)
        c = torch.zeros(xs.shape[1], 64)
        for x in xs:
            h, c = self.cell(x, (h, c))
        return self.out(h)


def lstm_step(model: nn.Module) -> torch.Tensor:
    xs = torch.randn(24, 64, 32)
    return model(xs).square().mean()


class DataDependent(nn.Module):
    """Control flow on tensor values (`.item()` in the forward): the number of layers run depends on data."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            y = torch.tanh(layer(x))
            if y.mean().item() > 0:  # data-dependent branch
                x = x + y
            else:
                x = y * 0.5
            if x.abs().max().item() > 50:  # data-dependent early exit
                break
        return x


def data_dependent_step(model: nn.Module) -> torch.Tensor:
    x = torch.randn(1024, 64)
    return model(x).square().mean()


class ViewsAndInPlace(nn.Module):
    """Views, slicing, transposes and in-place updates of runtime tensors, including through a view."""

    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.a = nn.ModuleList(nn.Linear(64, 64) for _ in range(blocks))
        self.b = nn.ModuleList(nn.Linear(64, 64) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for a, b in zip(self.a, self.b):
            h = a(x)
            h = torch.relu_(h * 1.0)  # in place on a fresh tensor
            v = h.view(-1, 8, 8).transpose(1, 2)  # views of h
            u = v.reshape(-1, 64) + 1.0
            u[:, :8] = 0.0  # in-place write through a slice view
            u.mul_(0.5)
            w = b(u)
            w.add_(h)  # in place, reading another runtime tensor
            x = torch.tanh(w.t().contiguous().t())
        return x[:, ::2]


def views_step(model: nn.Module) -> torch.Tensor:
    x = torch.randn(1024, 64)
    return model(x).square().mean()


def gpt2() -> nn.Module:
    """A 3-layer GPT-2 from `transformers` with random weights (its real model code: attention, GELU, dropout)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    return GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=300, n_positions=64))


def gpt2_step(model: nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 300, (4, 64))
    return model(ids, labels=ids).loss
