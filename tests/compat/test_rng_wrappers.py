"""Dropout recomputed by a compiled region whose parts run op by op under the runtime (`backend="dtr"`).

The plan wraps a recomputed random op in torch's RNG higher-order ops (`run_and_save_rng_state` in the forward,
`run_with_rng_state` in the backward: passes/rewrite.py). When a compiled part runs its FX code op by op under
the runtime's dispatch mode (a part that does not fit the budget as one operation), torch hands those wrappers
to the mode, which must have a rule for them (runtime/dispatch.py); without one, every supported release raised
"no rule registered for HigherOrderOperator run_with_rng_state and mode DTRMode" in the backward (first seen on
torch 2.11 under Inductor, where the backward fell back op by op). Oracle: the same backend with no budget and
the same seed, so both draw the same masks; the budget must hold, measured.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._prims import rng_prims

import dtr_compile
import dtr_compile.backend.region
from dtr_compile.measure import measure_peak
from dtr_compile.runtime.compiled_ops import Footprint
from dtr_compile.runtime.dispatch import DTRMode
from dtr_compile.runtime.implicit import implicit_runtime

pytestmark = pytest.mark.compat


def _steps(model: nn.Module, x: torch.Tensor, budget: int | None, steps: int) -> tuple[dict, list[int]]:
    """`steps` training steps of `torch.compile(model, backend="dtr")` (codegen="fx"), each seeded alike:
    the last step's gradients and every step's measured peak."""
    torch._dynamo.reset()
    peaks = []
    with dtr_compile.config.patch(memory_budget=budget, codegen="fx"):
        compiled = torch.compile(model, backend="dtr")
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(3)
            _, measured = measure_peak(lambda: compiled(x).square().mean().backward())
            peaks.append(measured.peak_bytes)
    return {name: p.grad.clone() for name, p in model.named_parameters()}, peaks


def test_dropout_wrappers_run_op_by_op_under_the_runtime(monkeypatch) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.Tanh(), nn.Dropout(0.3))]).train()
    x = torch.randn(1024, 64)
    reference, reference_peaks = _steps(model, x, None, steps=2)

    # Every backward part is told it needs a terabyte of room, so it runs op by op under the mode (test_handoff).
    original = dtr_compile.backend.region._footprint

    def huge_backward(report, phase, numels):
        footprint = original(report, phase, numels)
        return Footprint(footprint.new_bytes, 1 << 40, numels) if phase == "backward" else footprint

    monkeypatch.setattr(dtr_compile.backend.region, "_footprint", huge_backward)
    calls = []  # what reaches the mode's rule for the backward's wrapper
    rule = rng_prims.run_with_rng_state.python_key_table[DTRMode]

    def counting(mode, *args, **kwargs):
        calls.append(mode)
        return rule(mode, *args, **kwargs)

    monkeypatch.setitem(rng_prims.run_with_rng_state.python_key_table, DTRMode, counting)

    budget = int(0.6 * max(reference_peaks))  # evicts compiled outputs, which their recomputes bring back
    grads, peaks = _steps(model, x, budget, steps=2)
    stats = implicit_runtime().stats()
    assert stats.parts_op_by_op > 0 and stats.region_rematerializations > 0, stats
    assert calls, "no run_with_rng_state reached the mode: the test no longer covers the wrapper"
    for name, want in reference.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-6, msg=name)
    assert peaks[-1] <= 1.05 * budget, f"measured {peaks[-1]} B > 1.05 x budget {budget} B: {stats}"


def test_wrapped_dropout_is_an_operation_that_replays_its_mask() -> None:
    """Both wrappers called under a runtime as the op-by-op code calls them: the dropout inside is a random
    operation of the runtime, so once evicted its recompute draws the mask it drew first; `run_with_rng_state`
    on the saved state draws it again, and the global generator moves on as it does without the runtime."""
    x = torch.randn(512, 256)
    dropout = torch.ops.aten.native_dropout.default
    torch.manual_seed(5)
    _, (want, want_mask) = rng_prims.run_and_save_rng_state(dropout, x, 0.5, True)
    after = torch.rand(3)
    runtime = dtr_compile.runtime.enable(memory_budget=3 * x.nbytes)
    with runtime:
        torch.manual_seed(5)
        state, (out, mask) = rng_prims.run_and_save_rng_state(dropout, x, 0.5, True)
        later = [x * (i + 2) for i in range(4)]  # four younger values under a budget of three evict the oldest
        assert out.untyped_storage().nbytes() == 0, "the dropout's output should have been evicted"
        runtime.materialize(out)
        again, again_mask = rng_prims.run_with_rng_state(state, dropout, x, 0.5, True)
        got = [out.clone(), mask.clone(), again.clone(), again_mask.clone(), torch.rand(3)]
        assert len(later) == 4
    assert runtime.stats().rematerializations > 0, runtime.stats()
    for value, reference in zip(got, [want, want_mask, want, want_mask, after]):
        torch.testing.assert_close(value, reference, rtol=0, atol=0)
