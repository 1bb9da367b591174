"""Gradient accumulation: several forwards and backwards, then one optimizer step, under one budget.

Each backward ends an implicit step, so the gradients the first micro-batch allocated were live when the second's
step began, and by DESIGN.md's "above what was live when the step began" the second step did not count them: over
the optimizer step's span a 5-layer MLP accumulating two micro-batches measured 1.12x its budget at 0.7 of its
no-budget peak, with no error (1.18x at 0.85, its no-remat peak: nothing was recomputed). A training step is what one optimizer step consumes: now the gradients that
earlier steps accumulated into, and that no optimizer step has consumed yet, count against the next step's budget
(Runtime._count_carried_gradients), and a compiled region plans for the room they leave (backend/region.py).
FX code: the runtime's own accounting and the plan's model are what is tested.
"""

from __future__ import annotations

import pytest
import torch
from compiled_models import tanh_chain
from torch import nn

import dtr_compile
from dtr_compile import compat
from dtr_compile.measure import measure_peak

BATCH, WIDTH, VOCAB = 4096, 512, 512  # a layer's activations 4 MiB a micro-batch, the gradients 5.3 MiB


def _cycle(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """Two micro-batches' forwards and backwards into the same gradients."""
    for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True):
        nn.functional.cross_entropy(model(xs), ys).div(2).backward()


def _cycles(model: nn.Module, x: torch.Tensor, y: torch.Tensor, budget: int) -> tuple[list[int], list[torch.Tensor]]:
    """Three optimizer steps of two micro-batches each under `budget`: the measured peak of each but the first, over
    its whole span, and the last one's gradients."""
    torch._dynamo.reset()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # steps, and changes nothing: every cycle is alike
    peaks = []
    with dtr_compile.config.patch(memory_budget=budget, codegen="fx"):
        compiled = torch.compile(model, backend="dtr")
        for cycle in range(3):
            model.zero_grad(set_to_none=True)
            # The first cycle's first step compiles, inside TorchDynamo's frame, where the loss after the model call is
            # not managed (README, limitations): measured from the second cycle on
            peak = measure_peak(lambda: _cycle(compiled, x, y))[1].peak_bytes
            if cycle > 0:
                peaks.append(peak)
            grads = [p.grad.clone() for p in model.parameters()]
            optimizer.step()  # the accumulated gradients are consumed: the next cycle's first step starts afresh
    return peaks, grads


@pytest.mark.compat  # the optimizer's step hook and the gradients' accumulate hook, on every release
def test_the_budget_holds_over_the_micro_batches_of_one_optimizer_step() -> None:
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 64, generator=generator), torch.randint(0, VOCAB, (BATCH,), generator=generator)
    model = tanh_chain(WIDTH, VOCAB)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        reference = measure_peak(lambda: _cycle(model, x, y))[1].peak_bytes
    expected = [p.grad.clone() for p in model.parameters()]

    budget = int(0.7 * reference)
    try:
        peaks, grads = _cycles(model, x, y, budget)
    except dtr_compile.BudgetError as error:
        # torch 2.11 holds the loss's gradient through the compiled backward (storage.HELD_META_KEY), which raises the
        # region's floor above 0.7 here: the budget named runs
        assert not compat.FREES_BACKWARD_GRADS, error
        budget = error.smallest_feasible_bytes
        assert budget is not None and budget <= reference, error
        peaks, grads = _cycles(model, x, y, budget)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)
    assert max(peaks) <= budget, [p / budget for p in peaks]
    assert max(peaks) >= 0.85 * budget, [p / budget for p in peaks]  # the budget used, not left idle


def test_a_budget_error_names_gradients_accumulated_by_accident() -> None:
    """A loop that neither zeroes its gradients nor steps an optimizer accumulates them: its second step counts the
    first's gradients, and at a budget the first step needed whole, the second cannot run. The error says so, and
    what to change, instead of naming a floor the gradients' bytes above the first step's with no reason given."""
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 64, generator=generator), torch.randint(0, VOCAB, (BATCH,), generator=generator)
    model = tanh_chain(WIDTH, VOCAB)
    torch._dynamo.reset()
    with dtr_compile.config.patch(memory_budget=1 << 20, codegen="fx"):
        compiled = torch.compile(model, backend="dtr")
        with pytest.raises(dtr_compile.BudgetError) as far_below:
            for _ in range(3):  # the first step may run unseen code; a later one names the floor
                model.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(compiled(x), y).backward()
    floor = far_below.value.smallest_feasible_bytes
    assert floor is not None
    assert "accumulated" not in str(far_below.value)  # every step began with no gradients

    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    with dtr_compile.config.patch(memory_budget=floor, codegen="fx"):
        compiled = torch.compile(model, backend="dtr")
        with pytest.raises(dtr_compile.BudgetError) as accumulated:
            for _ in range(3):  # never zeroed, never stepped
                nn.functional.cross_entropy(compiled(x), y).backward()
    message = str(accumulated.value)
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert "earlier steps accumulated" in message and "zero_grad(set_to_none=True)" in message, message
    assert accumulated.value.smallest_feasible_bytes >= floor + 0.9 * gradient_bytes, message
