"""Shared oracle for the runtime tests: the same training step in plain eager and under the runtime.

The step is the forward, the loss and the backward. Both runs start from the same weights and the
same RNG state, so dropout draws the same masks; gradients are set to None *before* the measured
step, so the measured peak is what the step allocates (DESIGN.md's definition).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

import dtr_compile
from dtr_compile.measure import measure_peak

StepFn = Callable[[torch.nn.Module], torch.Tensor]  # runs forward and returns the scalar loss


@dataclass
class StepResult:
    loss: float
    grads: list[torch.Tensor]
    buffers: list[torch.Tensor]
    peak_bytes: int


def run_step(model: torch.nn.Module, step: StepFn, seed: int, runtime=None) -> StepResult:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)

    def body() -> float:
        if runtime is None:
            loss = step(model)
            loss.backward()
            return loss.item()
        with runtime:
            loss = step(model)
            loss.backward()
            value = loss.item()
        return value

    loss, measurement = measure_peak(body)
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    buffers = [b.detach().clone() for b in model.buffers()]
    return StepResult(loss, grads, buffers, measurement.peak_bytes)


def eager_reference(make_model: Callable[[], torch.nn.Module], step: StepFn, seed: int = 0) -> StepResult:
    """Plain eager result; a warm-up step first so one-time allocations do not count in the peak."""
    torch.manual_seed(1234)
    model = make_model()
    run_step(copy.deepcopy(model), step, seed)  # warm-up (allocator, lazy init)
    return run_step(model, step, seed)


def under_runtime(make_model: Callable[[], torch.nn.Module], step: StepFn, budget, seed: int = 0, **options):
    torch.manual_seed(1234)
    model = make_model()
    runtime = dtr_compile.runtime.enable(memory_budget=budget, **options)
    return run_step(model, step, seed, runtime), runtime


def assert_same(result: StepResult, reference: StepResult, *, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert abs(result.loss - reference.loss) <= atol + rtol * abs(reference.loss), (result.loss, reference.loss)
    assert len(result.grads) == len(reference.grads)
    for got, want in zip(result.grads, reference.grads):
        assert type(got) is torch.Tensor, f"gradient left the runtime as {type(got).__name__}"
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    for got, want in zip(result.buffers, reference.buffers):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def check_budgets(make_model, step, fractions, *, seed: int = 0, expect_evictions_below: float = 0.75):
    """Values and gradients equal to eager, and measured peak <= 1.05 x budget, at each fraction."""
    reference = eager_reference(make_model, step, seed)
    report = []
    for fraction in fractions:
        budget = int(fraction * reference.peak_bytes)
        result, runtime = under_runtime(make_model, step, budget, seed)
        assert_same(result, reference)
        stats = runtime.stats()
        assert result.peak_bytes <= 1.05 * budget, (
            f"measured peak {result.peak_bytes} exceeds 1.05 x budget {budget} at {fraction}: {stats}"
        )
        if fraction <= expect_evictions_below:
            assert stats.evictions > 0, f"a budget of {fraction} x the peak should force evictions: {stats}"
        report.append((fraction, result.peak_bytes / budget, stats))
    return reference, report
