"""With no budget, `backend="dtr"` runs torch.compile's own step: the same measured peak and gradients.

The cause this guards against: the planner used to start from saving every value the backward reads, where
torch.compile's min-cut partitioner recomputes cheap pointwise ops (GELU, the layer norm's normalization) in
the backward from fewer saved values; that measured 1.37x torch.compile's peak on a small GPT-2. The model
here has the same ingredients (layer norm, GPT-2's pointwise GELU, residual adds), small enough for CI.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

import dtr_compile
from dtr_compile.backend import make_backend
from dtr_compile.measure import measure_peak


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(_gelu_new(self.up(self.norm(x))))


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU, written out as pointwise ops (as `transformers` does): saving each of their values for
    the backward is what made the save-everything partition cost more than torch.compile's."""
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * torch.pow(x, 3.0))))


def _model(width: int = 32, depth: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[_Block(width) for _ in range(depth)], nn.LayerNorm(width))


def _measured(model: nn.Module, backend: object, x: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    """Measured peak of one training step (after a warm-up step that compiles), and the gradients."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        compiled(x).square().mean().backward()

    step()
    model.zero_grad(set_to_none=True)
    gc.collect()
    _, measurement = measure_peak(step)
    return measurement.peak_bytes, [p.grad.clone() for p in model.parameters()]


def _eager_grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_fx_no_budget_peak_is_aot_eagers() -> None:
    """codegen="fx" with no budget measures aot_eager's peak (min-cut partition, plain FX execution)."""
    x = torch.randn(64, 32, 32)
    base = _model()
    reference, _ = _measured(copy.deepcopy(base), "aot_eager", x)
    with dtr_compile.config.patch(memory_budget=None, codegen="fx"):
        ours, grads = _measured(copy.deepcopy(base), "dtr", x)
    save_all, _ = _measured(copy.deepcopy(base), make_backend(None, codegen="fx", start_from_min_cut=False), x)
    assert ours <= 1.02 * reference, f"no budget: {ours} bytes measured, aot_eager {reference}"
    # The model is one where the partition matters: saving every value the backward reads costs more.
    assert save_all > 1.1 * reference, (save_all, reference)
    for got, want in zip(grads, _eager_grads(copy.deepcopy(base), x), strict=True):
        torch.testing.assert_close(got, want)


def test_a_budget_the_min_cut_partition_meets_runs_it_as_it_is() -> None:
    """A budget at the no-remat peak plans nothing: the region runs torch.compile's partition itself."""
    x = torch.randn(16, 8, 32)
    backend = make_backend(1.0, codegen="fx")
    torch._dynamo.reset()
    torch.compile(_model(), backend=backend)(x).sum().backward()
    report = backend.reports[-1]
    assert report.partition == "min_cut" and report.planned_peak is report.no_remat
    tighter = make_backend(0.6, codegen="fx")
    torch._dynamo.reset()
    torch.compile(_model(), backend=tighter)(x).sum().backward()
    assert tighter.reports[-1].partition == "planned"
    assert tighter.reports[-1].planned_peak.peak_bytes <= 0.6 * tighter.reports[-1].no_remat.peak_bytes


@pytest.mark.slow  # two Inductor compiles: ~30 s on two cores
def test_inductor_no_budget_peak_is_torch_compiles() -> None:
    """Under Inductor (one tiny model: two compiles), no budget measures torch.compile's own peak."""
    x = torch.randn(64, 32, 32)
    base = _model(depth=2)
    reference, _ = _measured(copy.deepcopy(base), "inductor", x)
    with dtr_compile.config.patch(memory_budget=None, codegen="inductor"):
        ours, grads = _measured(copy.deepcopy(base), "dtr", x)
    assert ours <= 1.02 * reference, f"no budget: {ours} bytes measured, torch.compile {reference}"
    for got, want in zip(grads, _eager_grads(copy.deepcopy(base), x), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
