"""Who a step belongs to: fractions resolved per model, runtimes that do not nest, steps per thread, and the
errors of a compile reaching the user as dtr_compile errors. Tiny models and the FX code generator."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import dtr_compile
from dtr_compile.runtime.implicit import STEPS, implicit_runtime

from .process_state import assert_restored, snapshot


def _mlp(width: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))


def test_a_fraction_refers_to_each_models_own_peak() -> None:
    """Two models compiled in one process with memory_budget=1.0: each model's steps are budgeted at its own
    no-remat peak (the second model is four times the first: one process-wide calibration would give it the
    first model's bytes)."""
    torch._dynamo.reset()
    small, large = _mlp(64, 0), _mlp(256, 1)
    x = torch.randn(128, 32)
    with dtr_compile.config.patch(memory_budget=1.0, codegen="fx"):
        c_small, c_large = torch.compile(small, backend="dtr"), torch.compile(large, backend="dtr")
        budgets = {}
        for _ in range(2):  # compile, then calibrate (the first whole step of each model)
            for name, model in (("small", c_small), ("large", c_large)):
                model(x).sum().backward()
                budgets[name] = implicit_runtime().budget_bytes  # the budget its steps now run under
    assert budgets["small"] is not None and budgets["large"] is not None, budgets
    assert budgets["large"] > 2 * budgets["small"], budgets


class _ScalarLoss(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).sum()


def test_a_backward_on_another_thread_ends_its_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the autograd engine runs a backward on its device thread, where this process's per-thread
    steps hold no scope. The compiled backward part must still end the step it belongs to: otherwise a
    fraction never calibrates (found on an H200: still calibrating after three steps). Simulated here on CPU:
    while a backward runs, `STEPS.here` answers as another thread's steps would."""
    torch._dynamo.reset()
    elsewhere = type(STEPS.here)()  # a thread's steps with no scope, as the engine's device thread has
    real_here = type(STEPS).here

    def here(self):
        return elsewhere if torch._C._current_graph_task_id() != -1 else real_here.fget(self)

    monkeypatch.setattr(type(STEPS), "here", property(here))
    model, x = _ScalarLoss(_mlp(64, 0)), torch.randn(128, 32)
    with dtr_compile.config.patch(memory_budget=0.5, codegen="fx"):
        compiled = torch.compile(model, backend="dtr")
        for _ in range(2):  # compile, then calibrate
            compiled(x).backward()  # the compiled backward part is the backward's first op
    assert implicit_runtime().budget_bytes is not None, implicit_runtime().stats()


def test_runtimes_do_not_nest() -> None:
    model = _mlp(32, 0)
    before = snapshot()
    rt1, rt2 = dtr_compile.runtime.enable(memory_budget="10MB"), dtr_compile.runtime.enable(memory_budget="10MB")
    with pytest.raises(dtr_compile.DTRError, match="do not nest"), rt1, rt2:
        model(torch.randn(4, 32)).sum().backward()
    assert_restored(before, "after a refused nesting")
    with rt1:  # both still usable, one at a time
        model(torch.randn(4, 32)).sum().backward()
    with rt2:
        model(torch.randn(4, 32)).sum().backward()
    assert_restored(before, "after steps of each")


def test_steps_belong_to_their_thread() -> None:
    """Two threads, each compiling and training its own model with backend="dtr": gradients equal eager's,
    and each thread's implicit runtime counted its own steps."""
    torch._dynamo.reset()
    torch._dynamo.lookup_backend("dtr")  # torch's own registry resolves entry points without a lock
    results: dict[int, object] = {}

    def work(seed: int) -> None:
        try:
            model = _mlp(64, seed)
            reference = copy.deepcopy(model)
            x = torch.randn(64, 32, generator=torch.Generator().manual_seed(seed))
            reference(x).sum().backward()
            compiled = torch.compile(model, backend="dtr")
            for _ in range(3):
                model.zero_grad(set_to_none=True)
                compiled(x).sum().backward()
            for got, want in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(got.grad, want.grad)
            results[seed] = (implicit_runtime().stats().steps, STEPS.running())
        except BaseException as error:  # noqa: BLE001 (reported below, on the main thread)
            results[seed] = error

    with dtr_compile.config.patch(memory_budget="1MB", codegen="fx"):
        threads = [threading.Thread(target=work, args=(seed,)) for seed in (1, 2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    for seed, result in results.items():
        assert not isinstance(result, BaseException), f"thread {seed}: {result!r}"
        assert result == (3, False), (seed, result)


def test_a_budget_error_while_compiling_is_a_budget_error() -> None:
    """With compiled_steps="plan_only", an infeasible budget is found while Dynamo compiles; it still reaches
    `except dtr_compile.BudgetError`, with the feasible budget it names."""
    torch._dynamo.reset()
    model = _mlp(64, 0)
    with (
        dtr_compile.config.patch(memory_budget=100, codegen="fx", compiled_steps="plan_only"),
        pytest.raises(dtr_compile.BudgetError) as caught,
    ):
        torch.compile(model, backend="dtr")(torch.randn(128, 32)).sum().backward()
    assert caught.value.smallest_feasible_bytes is not None and caught.value.smallest_feasible_bytes > 100
    assert "Raise" in str(caught.value)


class _ScalarMidway(nn.Module):
    """A forward that reads a scalar off its first part and drops every tensor of the step before the rest:
    the step's tensors all die inside the compiled module's call, where its scope cannot come off the stack."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _mlp(64, 0), _mlp(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = float(self.a(x).sum().item())  # a graph break; the region's outputs die here
        return self.b(x * (1.0 + 1e-3 * scale))


def test_a_step_whose_tensors_die_midway_leaves_nothing() -> None:
    torch._dynamo.reset()
    model = _ScalarMidway()
    reference = copy.deepcopy(model)
    x = torch.randn(64, 32)
    reference(x).sum().backward()
    before = snapshot()
    with dtr_compile.config.patch(memory_budget="1MB", codegen="fx"):
        compiled = torch.compile(model, backend="dtr")
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            compiled(x).sum().backward()
            assert_restored(before, "after a step whose tensors died midway")
    for got, want in zip(model.parameters(), reference.parameters()):
        if want.grad is not None:
            torch.testing.assert_close(got.grad, want.grad)
