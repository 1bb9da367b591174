"""Gradients summed under the runtime take no more memory than plain eager's in-place sums (runtime/accumulate.py).

Under any dispatch mode the autograd engine sums the gradients flowing into one input out of place, one more
gradient-sized buffer per sum than plain eager. Many selects of one tensor (the TreeLSTM's leaves, issue 16)
make every sum a gradient of the whole tensor: at a budget of eager's own peak the runtime raised a BudgetError
before the sums ran in place. A consumed first argument that is read again is recomputed, never read stale.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dtr_compile
from dtr_compile import compat
from dtr_compile.runtime import accumulate
from tests.runtime.helpers import assert_same, eager_reference, under_runtime

LEAVES, BATCH, DIM = 12, 32, 64


class Selects(nn.Module):
    """One embedding output read by a select per position: the backward sums LEAVES whole-sized gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, DIM)
        self.bias = nn.Parameter(torch.randn(LEAVES, DIM))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (BATCH, LEAVES, DIM); nothing saves it, so it dies after the forward
        h = x[:, 0] + self.bias[0]
        for i in range(1, LEAVES):
            h = h + x[:, i] + self.bias[i]  # add saves nothing: the backward holds only gradients
        return h


TOKENS = torch.randint(0, 50, (BATCH, LEAVES), generator=torch.Generator().manual_seed(0))


def _step(model: nn.Module) -> torch.Tensor:
    return model(TOKENS).pow(2).mean()


needs_swap = pytest.mark.skipif(
    not compat.uses_storage_swap(),
    reason="this torch release cannot swap storage data pointers: sums stay out of place",
)


@needs_swap
def test_backward_sums_fit_in_eager_s_own_peak() -> None:
    reference = eager_reference(Selects, _step)
    budget = reference.peak_bytes  # eager sums in place: two whole gradients at once, not three
    result, runtime = under_runtime(Selects, _step, budget)
    assert_same(result, reference)
    assert result.peak_bytes <= budget, f"measured {result.peak_bytes} > budget {budget}: {runtime.stats()}"


@needs_swap
def test_a_consumed_argument_read_again_is_recomputed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sum of the backward runs in place, even one whose first argument the formula reads again."""

    class ReuseAfterSum(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:
            return x * 1

        @staticmethod
        def backward(ctx, g: torch.Tensor) -> torch.Tensor:
            t = g * 2
            s = t + g  # consumes t's bytes
            return s * t  # reads t again: recomputed as g * 2

    accumulate.calibrate()
    monkeypatch.setattr(accumulate, "_unique_counts", (1 << 30, 1 << 30))
    x = torch.randn(64, requires_grad=True)
    ReuseAfterSum.apply(x).pow(2).sum().backward()
    want, x.grad = x.grad, None
    with dtr_compile.runtime.enable(memory_budget=1 << 20) as rt:
        ReuseAfterSum.apply(x).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, want, rtol=0, atol=0)
    assert rt.stats().rematerializations >= 1, rt.stats()
