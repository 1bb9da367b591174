"""Small models and a step runner shared by the compiled-path tests (tests/e2e/test_compiled*.py)."""

from __future__ import annotations

import torch
from torch import nn

from dtr_compile.backend import make_backend
from dtr_compile.measure import measure_peak


def mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(6)]
    return nn.Sequential(*layers, nn.Linear(128, 1)), (torch.randn(256, 128),)


def tanh_chain(width: int, vocab: int) -> nn.Module:
    """Linear 64 -> width, four Linear width -> width, each with Tanh, then a Linear to `vocab` logits (seeded): a
    model whose activations, gradients and loss tail the e2e memory tests size against each other."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, width), nn.Tanh()]
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, vocab))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


def transformer(dropout: float = 0.1) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(64, 4, dropout) for _ in range(3)], nn.Linear(64, 1))
    return model, (torch.randn(8, 32, 64),)


def cnn() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    channels = 3
    for out in (16, 16, 32, 32):
        layers += [nn.Conv2d(channels, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU()]
        channels = out
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))
    return model, (torch.randn(8, 3, 32, 32),)


def gpt2() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=64)
    model = GPT2LMHeadModel(config)

    class LossOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.inner(input_ids=ids).logits

    return LossOnly(), (torch.randint(0, 256, (4, 32)),)


def run_step(model: nn.Module, inputs, budget, *, codegen: str = "fx", seed: int = 0, steps: int = 2):
    """Compile with a fresh backend (a first step, not measured: a profiler session around the compile would
    keep the backend from measuring the compiled region, verify.py), then run `steps` measured steps; returns
    (grads of the last step, its measured peak, backend reports)."""
    torch._dynamo.reset()
    backend = make_backend(budget, codegen=codegen)
    compiled = torch.compile(model, backend=backend)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    compiled(*inputs).sum().backward()
    peak = None
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        _, measurement = measure_peak(lambda: compiled(*inputs).sum().backward())
        peak = measurement.peak_bytes
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return grads, peak, backend.reports


def eager_grads(model: nn.Module, inputs, *, seed: int = 0) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    model(*inputs).sum().backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
