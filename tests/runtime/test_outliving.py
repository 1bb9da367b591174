"""What outlives a step is restored within the step's budget (issue 16, class 3: hold the budget or raise).

A tensor the program still holds when the step ends must be resident then; if the runtime freed it, the end of the
step recomputes it, and by then its inputs may be gone too (dead, freed at once): the restore reruns the chain
behind it. Unbounded, that chain measured 1.09x the budget on a compiled fuzz case (a 4-byte loss rerunning a
whole compiled forward part) and 1.16x under Trainer's bf16 autocast. Oracle: the measured peak (DESIGN.md) and
the values of plain eager PyTorch; the eviction of the held value is forced (`Engine.evict`), standing for the
heuristic's choice, so that the case is deterministic.
"""

from __future__ import annotations

import pytest
import torch

import dtr_compile
from dtr_compile.measure import measure_peak

N, D, DEPTH = 256, 128, 8
ACTIVATION = N * D * 4


def _chain(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """A scalar behind DEPTH layers; only the scalar is held at the end (every layer's output dies)."""
    h = x
    for w in weights:
        h = torch.tanh(h @ w)
    return h.sum()


def _inputs() -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    return torch.randn(N, D), [torch.randn(D, D) / D**0.5 for _ in range(DEPTH)]


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_a_held_value_whose_inputs_died_is_restored_within_the_budget(autocast: bool) -> None:
    x, weights = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        expected = _chain(x, weights)
    budget = 4 * ACTIVATION
    runtime = dtr_compile.runtime.enable(memory_budget=budget)

    def step() -> torch.Tensor:
        with runtime:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                total = _chain(x, weights)
            storage = runtime.index.lookup(total)
            runtime.engine.evict(storage)  # as the heuristic may: its restore now reruns all DEPTH layers
            assert total.untyped_storage().nbytes() == 0
        return total

    # Unmeasured: the first sight of a bf16 matmul's shape measures its scratch (dtr_compile/matmul_scratch.py), which
    # it cannot inside the meter's own profiler, where a bound far above this budget stands in.
    step()
    total, measured = measure_peak(step)
    assert total.untyped_storage().nbytes() > 0
    torch.testing.assert_close(total, expected)
    assert runtime.stats().rematerializations >= DEPTH, runtime.stats()
    # Unbounded, the restore kept every recomputed layer (the engine retains what an evicted held value needs).
    assert measured.peak_bytes <= budget, (measured.peak_bytes, budget)


def test_a_restore_that_cannot_fit_raises_a_budget_error_naming_a_budget_that_runs() -> None:
    """Four held activations and a held scalar whose chain died: at 5 activations the step runs, but the restore
    (a layer's product and its tanh at once, next to the four) needs 6. Before, it ran unbounded: 1.2x, no error."""
    x, weights = _inputs()

    def step(budget: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        runtime = dtr_compile.runtime.enable(memory_budget=budget)
        with runtime:
            total = _chain(x, weights)
            runtime.engine.evict(runtime.index.lookup(total))
            held = [torch.tanh(x @ w) for w in weights[:4]]
        return total, held

    with pytest.raises(dtr_compile.BudgetError) as caught:
        measure_peak(lambda: step(5 * ACTIVATION))
    needed = caught.value.smallest_feasible_bytes
    assert 5 * ACTIVATION < needed <= 7 * ACTIVATION, needed
    (total, held), measured = measure_peak(lambda: step(needed))
    torch.testing.assert_close(total, _chain(x, weights))
    torch.testing.assert_close(held, [torch.tanh(x @ w) for w in weights[:4]])
    assert measured.peak_bytes <= needed, (measured.peak_bytes, needed)


def test_a_value_held_only_by_cyclic_garbage_is_not_restored() -> None:
    """A handle kept by a garbage cycle is not the program's: the step's end collects before restoring. The cycle
    stands for the first step's compile, whose caught exceptions' tracebacks held the compiled module's call frame
    and its output (GPT-2's logits), which the step's end restored by rerunning the whole forward."""
    x, weights = _inputs()
    runtime = dtr_compile.runtime.enable(memory_budget=4 * ACTIVATION)
    with runtime:
        total = _chain(x, weights)
        runtime.engine.evict(runtime.index.lookup(total))
        before = runtime.stats().rematerializations
        cycle: list = [total]
        cycle.append(cycle)
        del total, cycle
    assert runtime.stats().rematerializations == before
