"""A budget below the step's floor names the floor, and that floor runs: with the loss computed eagerly on the
compiled model's outputs (`loss = cross_entropy(compiled(x), y)`), as most training loops write it.

The loss is not in the compiled graph, yet it runs while the saved values are live and holds the logits'
log-softmax and then its gradient beside the tangent (passes/storage.loss_tail_bytes). On an H200 (GPT-2 124M
shape) the planner, blind to it, held a region to 1311.7 MiB that the step then overran by the loss's 768 MiB,
and the BudgetError named a floor (2.5 GiB) from running the backward op by op. FX code generator, tiny sizes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dtr_compile
from dtr_compile.measure import measure_peak

VOCAB, BATCH = 2048, 512  # logits of 4 MiB: the loss's tail dominates the step


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, VOCAB))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 64, generator=generator), torch.randint(0, VOCAB, (BATCH,), generator=generator)


def _train(model: nn.Module, budget: int | None, steps: int = 3) -> tuple[list[torch.Tensor], int]:
    """Steps of backend="dtr" at `budget` bytes; the gradients and measured peak of the last step."""
    torch._dynamo.reset()
    x, y = _batch()
    with dtr_compile.config.patch(memory_budget=budget, codegen="fx"):
        compiled = torch.compile(model, backend="dtr")

        def step() -> None:
            model.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(compiled(x), y).backward()

        for _ in range(steps - 1):
            step()
        _, measured = measure_peak(step)
    return [p.grad.clone() for p in model.parameters()], measured.peak_bytes


def test_a_budget_below_the_floor_names_a_floor_that_runs() -> None:
    model = _model()
    x, y = _batch()
    nn.functional.cross_entropy(model(x), y).backward()
    eager = [p.grad.clone() for p in model.parameters()]

    with pytest.raises(dtr_compile.BudgetError) as info:
        _train(model, 1 << 20)
    floor = info.value.smallest_feasible_bytes
    assert floor is not None and floor > 1 << 20, info.value
    assert f"at least {floor} bytes" in str(info.value)  # the message names the number to set

    grads, peak = _train(model, floor)
    assert peak <= floor, f"the named floor {floor} B did not hold: measured {peak} B"
    for got, want in zip(grads, eager):
        torch.testing.assert_close(got, want)
