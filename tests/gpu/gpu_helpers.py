"""Shared by the GPU tests (tests/gpu): the marks that skip them without CUDA, and steps measured on CUDA.

Every test module here sets `pytestmark = GPU`: marked `gpu` (deselected by default; run them with
`pytest -m gpu tests/gpu`) and skipped, saying why, where `torch.cuda.is_available()` is False. Nothing here
needs more than torch 2.11 (the lent GPU machines carry 2.11.0+cu130, Triton 3.6, transformers 5.x and no
network): models are built in code with random weights.

Peaks are `dtr_compile.measure.measure_peak(step, "cuda")`: `max_memory_allocated` above the bytes allocated
when the step began, after `reset_peak_memory_stats` (DESIGN.md). A warm-up step runs first everywhere, so
that one-time allocations (cuBLAS workspaces, the autograd engine's device thread) are live before the
measured step begins, as parameters are. Measured peaks may pass the budget by `SLACK`, as in the CPU suites:
the caching allocator rounds every block up to 512 bytes, which the budget's accounting does not model.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dtr_compile.bench.block_models import WrittenOutBlock
from dtr_compile.measure import measure_peak

# The models of the CPU kernel tests (tests/kernels/kernel_harness.py) are shared with these.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

CUDA = torch.device("cuda")
GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
    ),
]
SLACK = 1.05  # measured peak <= SLACK x budget, as tests/runtime and tests/e2e allow on CPU


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float = 1e-4) -> None:
    """Every parameter's gradient within `rtol` of the reference's largest entry (compiled code reorders float
    reductions, so "equal" is equal to fp32 rounding, not bitwise), and no gradient missing or extra."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for name, reference in want.items():
        scale = reference.abs().max().item() + 1e-6
        error = (got[name] - reference).abs().max().item() / scale
        assert error <= rtol, f"{name}: relative error {error:.2e} > {rtol:.0e}"


def measured_step(model: nn.Module, step: Callable[[], Any], seed: int = 0) -> tuple[dict[str, torch.Tensor], int]:
    """(gradients, measured CUDA peak) of `step()` (forward and backward), with the gradients set to None before
    it, so they count in the step's peak, and the generators seeded, so dropout draws the same masks."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    _, measured = measure_peak(step, CUDA)
    return grads_of(model), measured.peak_bytes


def warm_then_measure(
    model: nn.Module, step: Callable[[], Any], seed: int = 0, warmups: int = 1
) -> tuple[dict[str, torch.Tensor], int]:
    """`warmups` unmeasured steps, then `measured_step`. A compiled model needs one to compile. Under a fractional
    budget with `backend="dtr"` the first step calibrates (runs with no budget and measures the peak the fraction
    is of) and the second compiles the plan for the budget, measuring candidates itself (on CUDA that resets the
    allocator's peak, so it must not fall in the measured step); take three, so the measured step is a steady one."""
    for _ in range(warmups):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        step()
    return measured_step(model, step, seed)


class BreakingBlock(nn.Module):
    """A pre-norm MLP block with a data-dependent branch that always goes the same way (its condition holds for
    any input with a nonzero entry), so Dynamo breaks the graph in every block while eager and any code
    generator take the same path: no rounding difference can flip it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm(x))
        if h.abs().amax() > 0:  # a tensor's value decides: a graph break
            h = torch.nn.functional.gelu(h)
        return x + self.down(h)


def graph_break_model(blocks: int = 6, width: int = 256, tokens: int = 4096) -> tuple[nn.Module, torch.Tensor]:
    """`blocks` BreakingBlocks and a head on CUDA, the model returning the loss, and its input."""
    torch.manual_seed(0)

    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*[BreakingBlock(width) for _ in range(blocks)])
            self.head = nn.Linear(width, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(x)).square().mean()

    x = torch.randn(tokens, width, generator=torch.Generator().manual_seed(1))
    return WithLoss().to(CUDA).train(), x.to(CUDA)


def gpt2_style(
    layers: int = 4, dim: int = 256, batch: int = 8, seq: int = 256, dropout: float = 0.0
) -> tuple[nn.Module, torch.Tensor]:
    """A GPT-2-style stack on CUDA (the bench's WrittenOutBlock: pre-norm causal self-attention with attention and
    residual dropout, GELU MLP) and its input; the model returns the loss."""
    torch.manual_seed(0)

    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*[WrittenOutBlock(dim, 4, dropout) for _ in range(layers)])
            self.head = nn.Linear(dim, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(x)).square().mean()

    x = torch.randn(batch, seq, dim, generator=torch.Generator().manual_seed(1))
    return WithLoss().to(CUDA).train(), x.to(CUDA)
