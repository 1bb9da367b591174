"""Inputs whose sizes change between steps (dynamic padding): Dynamo compiles the graph once with symbolic sizes,
and backend="dtr" plans it at the largest sizes it has been called with (planned_sizes.py), so that the budget holds
at every size. Planned at the hints of the call that traced it (the second length seen), HF GPT-2 and Llama at 0.6
raised BudgetError when a longer batch came: the runtime made room for (128/96)^2 = 1.8x the region."""

from __future__ import annotations

import compiled_models as models
import pytest
import torch

import dtr_compile
from dtr_compile.measure import measure_peak

LENGTHS = (64, 48, 64, 32, 48, 64)


def _step(model, x, run=None):
    """Gradients of one step of `run` (the model itself unless given: its compiled form) on `x`."""
    model.zero_grad(set_to_none=True)
    (run or model)(x).square().mean().backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _at_lengths(lengths):
    """The test transformer, a batch per length, eager's gradients of each, and a budget of 0.6 of the peak of the
    first (the longest) batch's eager step."""
    model, _ = models.transformer(dropout=0.0)
    batches = [torch.randn(8, length, 64, generator=torch.Generator().manual_seed(length)) for length in lengths]
    eager = [_step(model, b) for b in batches]
    _, longest = measure_peak(lambda: _step(model, batches[0]))
    return model, batches, eager, int(0.6 * longest.peak_bytes)


def test_a_budget_holds_at_every_length_with_eager_gradients() -> None:
    model, batches, eager, budget = _at_lengths(LENGTHS)
    torch._dynamo.reset()
    with dtr_compile.config.patch(memory_budget=budget, codegen="fx"):
        compiled = torch.compile(model, backend="dtr")
        for i, batch in enumerate(batches):
            grads, measured = measure_peak(lambda batch=batch: _step(model, batch, compiled))
            assert measured.peak_bytes <= 1.05 * budget, (LENGTHS[i], measured.peak_bytes, budget)
            for name, want in eager[i].items():
                assert torch.allclose(grads[name], want, rtol=1e-4, atol=1e-6), (LENGTHS[i], name)
    # Every length ran the region's plan as compiled: planned at 48 tokens, each 64-token step ran its two parts op
    # by op under the runtime instead, evicting 15 tensors and recomputing 33 to hold the budget.
    stats = dtr_compile.runtime.implicit_runtime().stats()
    assert stats.parts_op_by_op == 0 and stats.evictions == 0, stats


def test_the_plan_is_made_again_only_for_a_larger_size() -> None:
    """One plan per new largest length (two here: the dynamic graph's first, at 48, then at 64); shorter lengths
    run the plan made for the longest."""
    from dtr_compile.backend import region as region_module

    model, _ = models.transformer(dropout=0.0)
    calls: list[dict] = []
    original = region_module.Region._compile_with_codegen

    def counting(self, *args, **kwargs):
        calls.append(dict(self._sizes.values))
        return original(self, *args, **kwargs)

    torch._dynamo.reset()
    with dtr_compile.config.patch(memory_budget=10**9, codegen="fx"), pytest.MonkeyPatch.context() as patch:
        patch.setattr(region_module.Region, "_compile_with_codegen", counting)
        compiled = torch.compile(model, backend="dtr")
        for length in LENGTHS:
            _step(model, torch.randn(8, length, 64), compiled)
    dynamic = [sorted(sizes.values()) for sizes in calls if sizes]
    assert dynamic == [[48], [64]], calls


def test_inductor_plans_of_a_dynamic_region_are_measured_before_they_run() -> None:
    """A plan made in the middle of a step, because the call brought a longer batch, runs that step as FX code (exact
    by the model) and compiles with Inductor when the step has ended, on stand-ins at the planned sizes, measured.
    Compiled with Inductor in the middle of the step, it ran on the model alone: HF Llama with varying lengths (CPU
    stand-in at 0.6) measured 1.071x the budget at its longest batch."""
    from dtr_compile.passes import running_plans

    lengths = (64, 48, 64, 32, 64)
    model, batches, eager, budget = _at_lengths(lengths)
    torch._dynamo.reset()
    earlier = set(running_plans.running())  # regions of earlier tests that something still holds
    with dtr_compile.config.patch(memory_budget=budget, codegen="inductor"):
        compiled = torch.compile(model, backend="dtr")
        for i, batch in enumerate(batches):
            grads = _step(model, batch, compiled)  # the steps that compile are not profiled: verify.py profiles them
            for name, want in eager[i].items():
                assert torch.allclose(grads[name], want, rtol=1e-4, atol=1e-5), (lengths[i], name)
            if i >= 3:  # the plan for 64 tokens, compiled with Inductor after the third step, measured
                _, measured = measure_peak(lambda batch=batch: _step(model, batch, compiled))
                assert measured.peak_bytes <= 1.05 * budget, (lengths[i], measured.peak_bytes, budget)
    plans = {region: report for region, report in running_plans.running().items() if region not in earlier}
    assert len(plans) == 2, plans  # the first call's static graph, and the dynamic one
    assert all(report.measured_peak_bytes is not None for report in plans.values()), plans
