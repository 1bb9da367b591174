"""The held-out GPT-2 of issue 16 (class 3) under `backend="dtr"` with Inductor: hold the budget or raise.

A `transformers` GPT2LMHeadModel from a small config, with its dropout (0.1). At 0.3 of the no-budget peak the
compile died inside Inductor ("Backend not supported for None": Inductor's random lowering,
`prims.inductor_seeds(count, device)`, wrapped for replay without its device; passes/rewrite.py). Now each budget
either raises a `dtr_compile.BudgetError` or the measured peak of the steps after the first is within it.
Three Inductor compiles per budget on 2 cores: slow.
"""

from __future__ import annotations

import copy

import pytest
import torch

import dtr_compile
from dtr_compile.measure import measure_peak

pytest.importorskip("transformers")


def _peaks(model: torch.nn.Module, ids: torch.Tensor, budget, steps: int = 3) -> list[int]:
    """Measured peaks of `steps - 1` steps after a first, unmeasured one (it compiles and measures the regions)."""
    torch._dynamo.reset()
    peaks = []
    with dtr_compile.config.patch(memory_budget=budget):
        compiled = torch.compile(model, backend="dtr")
        for i in range(steps):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1)

            def body() -> None:
                compiled(input_ids=ids, labels=ids).loss.backward()

            if i == 0:
                body()
                continue
            peaks.append(measure_peak(body)[1].peak_bytes)
    return peaks


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.5, 0.3])
def test_gpt2_with_dropout_holds_the_budget_or_raises(fraction: float) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=64))
    ids = torch.randint(0, 256, (4, 64))
    reference = max(_peaks(copy.deepcopy(base), ids, None))
    budget = int(fraction * reference)
    try:
        peaks = _peaks(copy.deepcopy(base), ids, budget)
    except dtr_compile.BudgetError as error:
        assert "memory_budget" in str(error)  # it says what to change
        return
    assert max(peaks) <= budget, (peaks, budget)
