"""A training step is a transaction: an exception at any stage of a step leaves the process as it found it.

For the eager runtime and both code generators of `backend="dtr"` (Inductor: one small model, compiled
once), an exception is injected at each stage of a step (the forward, a compiled region, the loss, a backward
hook, the optimizer step, the calibration step of a fractional budget); each case checks that the exception
propagates unchanged, that the process state (tests/runtime/process_state.py) is restored, and that the next
step's gradients equal eager's with its measured peak within the budget. Steps end by themselves: no test
calls `finish_steps()` or an optimizer to close one.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import dtr_compile
import dtr_compile.runtime.compiled_ops
from dtr_compile import compat
from dtr_compile.measure import measure_peak

from .process_state import assert_restored, snapshot


class Injected(Exception):
    """The exception a test raises inside a step."""


class Net(nn.Module):
    """A small MLP with a graph break in the middle (two compiled regions and eager code between them)."""

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(32, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh())
        self.b = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))
        self.fail_in: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.fail_in == "forward":
            raise Injected("forward")
        torch._dynamo.graph_break()
        h = torch.tanh(h) * 1.5  # eager code between the two regions
        return self.b(h)


def _data() -> torch.Tensor:
    return torch.randn(256, 32, generator=torch.Generator().manual_seed(0))


def _reference() -> tuple[Net, list[torch.Tensor], int]:
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    x = _data()
    ref(x).sum().backward()  # warm-up
    ref.zero_grad(set_to_none=True)
    _, measured = measure_peak(lambda: ref(x).sum().backward())
    return model, [p.grad.clone() for p in ref.parameters()], measured.peak_bytes


def _check_next_step(run, model: Net, grads: list[torch.Tensor], budget: int | None, what: str) -> None:
    """One more step (and a second, which is measured): gradients equal eager's, measured peak <= budget."""
    x = _data()
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        _, measured = measure_peak(lambda: run(x))
    for got, want in zip([p.grad for p in model.parameters()], grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=what)
    if budget is None:  # a fraction: resolved against the no-remat peak the step itself measured
        budget = dtr_compile.runtime.implicit_runtime().budget_bytes
        assert budget is not None, f"{what}: the fraction was never calibrated"
    assert measured.peak_bytes <= budget, f"{what}: measured {measured.peak_bytes} > budget {budget}"


COMPILED_FRACTION = 0.8  # of eager's peak: the compiled parts' floor on this small model is above 0.7
STAGES = ("forward", "region", "loss", "backward_hook", "optimizer", "keyboard_interrupt")


def _inject(stage: str, model: Net, call, x: torch.Tensor, context=contextlib.nullcontext, monkeypatch=None) -> None:
    """Run one step (`call(x)` inside `context()`) with an exception injected at `stage`; it must propagate."""
    handles = []
    if stage == "forward":  # the model's own code, between regions
        model.fail_in = "forward"
    elif stage == "region":  # inside a compiled part, while the runtime runs it as an operation

        def failing_part(*args, **kwargs):
            raise Injected("region")

        monkeypatch.setattr(dtr_compile.runtime.compiled_ops, "run_part", failing_part)
    elif stage == "backward_hook":
        handles.append(model.a[0].weight.register_hook(lambda g: (_ for _ in ()).throw(Injected("backward_hook"))))
    expected = KeyboardInterrupt if stage == "keyboard_interrupt" else Injected
    try:
        with pytest.raises(expected, match=None if stage == "keyboard_interrupt" else stage):
            with context():
                out = call(x)
                if stage == "keyboard_interrupt":
                    raise KeyboardInterrupt
                loss = out.sum()
                if stage == "loss":
                    raise Injected("loss")
                loss.backward()
            if stage == "optimizer":
                optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
                optimizer.register_step_pre_hook(lambda *_: (_ for _ in ()).throw(Injected("optimizer")))
                optimizer.step()
    finally:
        model.fail_in = None
        for handle in handles:
            handle.remove()
        if monkeypatch is not None:
            monkeypatch.undo()


@pytest.mark.parametrize("stage", [s for s in STAGES if s != "region"])
def test_runtime_fault_restores_the_process(stage: str) -> None:
    model, grads, peak = _reference()
    budget = int(0.6 * peak)
    rt = dtr_compile.runtime.enable(memory_budget=budget)
    before = snapshot()
    _inject(stage, model, model, _data(), context=lambda: rt)
    assert_restored(before, f"after a {stage} fault under the runtime")

    def step(x):
        with rt:
            model(x).sum().backward()

    _check_next_step(step, model, grads, budget, f"runtime after {stage}")
    assert_restored(before, "after the next steps")


def _check_next_step_or_the_budget_named(run, model: Net, grads: list[torch.Tensor], what: str) -> None:
    """The calibration case runs at a fraction of 1.0, where region0's backward runs op by op with a recompute.
    On torch 2.11 (no boxed backward gradients: compat.FREES_BACKWARD_GRADS) the incoming gradient of that backward
    stays resident while it runs, and the step needs about 1.1 of the calibrated peak (705 vs 641 KiB): there the
    step must raise a BudgetError naming a budget in bytes (not a bound) at which the next steps run."""
    if compat.FREES_BACKWARD_GRADS:
        _check_next_step(run, model, grads, None, what)
        return
    calibrated = dtr_compile.runtime.implicit_runtime().budget_bytes
    with pytest.raises(dtr_compile.BudgetError) as info:
        _check_next_step(run, model, grads, None, what)
    named = info.value.smallest_feasible_bytes
    assert named is not None and not info.value.is_lower_bound, f"{what}: {info.value}"
    assert calibrated < named <= 1.5 * calibrated, f"{what}: named {named} for a budget of {calibrated}"
    with dtr_compile.config.patch(memory_budget=named):
        _check_next_step(run, model, grads, named, f"{what}, at the {named} bytes its BudgetError named")


@pytest.mark.parametrize("stage", (*STAGES, "calibration"))
def test_compiled_fx_fault_restores_the_process(stage: str, monkeypatch) -> None:
    model, grads, peak = _reference()
    budget = int(COMPILED_FRACTION * peak)
    torch._dynamo.reset()
    before = snapshot()
    fraction = stage == "calibration"
    with dtr_compile.config.patch(memory_budget=1.0 if fraction else budget, codegen="fx"):
        compiled = torch.compile(model, backend="dtr")

        def step(x):
            # Each step starts with no gradients, as a training loop's after its optimizer step: gradients a step left
            # with no optimizer step since count in the next one's budget (Runtime._count_carried_gradients)
            model.zero_grad(set_to_none=True)
            compiled(x).sum().backward()

        step(_data())  # the first step compiles (and begins inside Dynamo's frame)
        assert_restored(before, "after the first step")
        if not fraction:
            step(_data())  # later steps begin outside the frame, in the module's call
            assert_restored(before, "after the second step")
        # The calibration step of a fraction is the first whole one (the first began inside Dynamo's frame).
        model.zero_grad(set_to_none=True)
        _inject("loss" if fraction else stage, model, compiled, _data(), monkeypatch=monkeypatch)
        assert_restored(before, f"after a {stage} fault under backend='dtr' (fx)")
        if fraction:
            assert dtr_compile.runtime.implicit_runtime().budget_bytes is None, "a failed step calibrated"
            step(_data())  # calibrates
            _check_next_step_or_the_budget_named(step, model, grads, f"fx after {stage}")
        else:
            _check_next_step(step, model, grads, budget, f"fx after {stage}")
    assert_restored(before, "after the next steps")


def test_compiled_inductor_faults_restore_the_process(monkeypatch) -> None:
    """Inductor: one model compiled once, every stage injected in turn."""
    model, grads, peak = _reference()
    budget = int(COMPILED_FRACTION * peak)
    torch._dynamo.reset()
    before = snapshot()
    with dtr_compile.config.patch(memory_budget=budget, codegen="inductor"):
        compiled = torch.compile(model, backend="dtr")

        def step(x):
            model.zero_grad(set_to_none=True)  # (as above)
            compiled(x).sum().backward()

        step(_data())
        step(_data())
        # The forward stage last: the model's flag changes Dynamo's guards, and the frame is compiled again.
        for stage in sorted(STAGES, key=lambda s: s == "forward"):
            model.zero_grad(set_to_none=True)
            _inject(stage, model, compiled, _data(), monkeypatch=monkeypatch)
            assert_restored(before, f"after a {stage} fault under backend='dtr' (inductor)")
        model.zero_grad(set_to_none=True)
        x = _data()
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            _, measured = measure_peak(lambda: step(x))
        for got, want in zip([p.grad for p in model.parameters()], grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert measured.peak_bytes <= budget, (measured.peak_bytes, budget)
    assert_restored(before, "after the next steps")


def test_no_grad_evaluation_and_a_forward_without_backward_leave_nothing() -> None:
    model, grads, peak = _reference()
    budget = int(COMPILED_FRACTION * peak)
    torch._dynamo.reset()
    before = snapshot()
    with dtr_compile.config.patch(memory_budget=budget, codegen="fx"):
        compiled = torch.compile(model, backend="dtr")
        compiled(_data()).sum().backward()
        with torch.no_grad():
            compiled(_data())
        assert_restored(before, "after no_grad evaluation")
        out = compiled(_data())  # a forward whose result is dropped: the step ends when its tensors die
        del out
        assert_restored(before, "after a forward without backward")

        def step(x):
            compiled(x).sum().backward()

        _check_next_step(step, model, grads, budget, "after a forward without backward")
