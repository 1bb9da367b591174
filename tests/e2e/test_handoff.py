"""One budget across graph breaks: `torch.compile(model, backend="dtr")` on models whose control flow and
shapes depend on the data, with the eager code between compiled regions under the runtime.

For each model and budget (0.5 and 0.3 of plain eager's measured peak), several training steps on
different batches: values and gradients equal plain eager's, the measured peak of every step after the
first is at most 1.05 x the budget (the first step compiles, and begins inside TorchDynamo's frame, where
code after the model call is not yet managed: see runtime/implicit.py), and the runtime's counters show
what happened across region boundaries. The FX code generator keeps compiles cheap.
"""

from __future__ import annotations

import copy
import gc
import types

import pytest
import torch
from torch._dynamo.utils import counters

import dtr_compile
import dtr_compile.backend.region
from dtr_compile.bench.dynamic_models import build_dynamic
from dtr_compile.measure import measure_peak
from dtr_compile.runtime.compiled_ops import Footprint
from dtr_compile.runtime.implicit import implicit_runtime


def _steps(case, model, steps: int, *, measured: bool = True):
    """Run `steps` training steps of `model` on the case's batches: (loss, grads, measured peak) per step.
    `measured=False`: no profiler around the steps (peak None), as Inductor regions under a budget need on CPU when
    they compile (their own measurement is a profiler session: passes/verify.py)."""
    results = []
    for step in range(steps):
        case.model.zero_grad(set_to_none=True)
        inputs, target = case.batch(step)

        def body(inputs=inputs, target=target) -> float:
            loss = case.loss_fn(model(*inputs), target)
            loss.backward()
            return loss.item()

        if measured:
            loss, measurement = measure_peak(body)
            peak = measurement.peak_bytes
        else:
            loss, peak = body(), None
        grads = [None if p.grad is None else p.grad.clone() for p in case.model.parameters()]
        results.append((loss, grads, peak))
    return results


def _compiled_steps(case, initial: dict, budget: int, steps: int):
    case.model.load_state_dict(initial)
    torch._dynamo.reset()
    counters.clear()
    with dtr_compile.config.patch(memory_budget=budget, codegen="fx"):
        return _steps(case, torch.compile(case.model, backend="dtr"), steps)


def _assert_close(got, want, what: str) -> None:
    for (loss, grads, _), (ref_loss, ref_grads, _) in zip(got, want):
        assert abs(loss - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), (what, loss, ref_loss)
        for g, r in zip(grads, ref_grads):
            assert (g is None) == (r is None), what
            if g is not None:
                torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5, msg=what)


# (model, steps, fractions): steps long enough to cover the shapes each model changes between.
CASES = {
    "transformer_branch": 4,  # a graph break per block, a new sequence length every step
    "moe": 3,  # data-dependent routing (nonzero, index_add)
    "lstm": 3,  # the length changes between steps; Dynamo unrolls the time loop per length
    "treelstm": 2,  # recursion over a random tree per step
}
FRACTIONS = {"lstm": (0.5,)}  # at 0.3: test_lstm_first_step_at_0_3_names_a_budget_that_runs (slow: minutes)


# The compatibility stages of .ci/run run the cheapest case (regions moved by the runtime, data-dependent ops).
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.compat) if n == "moe" else n for n in sorted(CASES)]
)
def test_one_budget_across_graph_breaks(name: str) -> None:
    steps = CASES[name]
    case = build_dynamic(name, "test")
    initial = copy.deepcopy(case.model.state_dict())
    eager = _steps(case, case.model, steps)
    no_remat_peak = max(peak for _, _, peak in eager)
    for fraction in FRACTIONS.get(name, (0.5, 0.3)):
        budget = int(fraction * no_remat_peak)
        what = f"{name} at {fraction}"
        results = _compiled_steps(case, initial, budget, steps)
        _assert_close(results, eager, what)
        for step, (_, _, peak) in enumerate(results[1:], start=1):
            assert peak <= 1.05 * budget, f"{what}, step {step}: measured {peak} > 1.05 x budget {budget}"
        stats = implicit_runtime().stats()
        assert stats.steps == steps, (what, stats)  # every step began and ended under the runtime
        if name in ("transformer_branch", "moe"):  # several regions per step: the runtime moves their outputs
            assert stats.region_evictions > 0 and stats.region_rematerializations > 0, (what, stats)


@pytest.mark.slow
def test_lstm_first_step_at_0_3_names_a_budget_that_runs() -> None:
    """Hold or raise, and the named budget runs. The LSTM's first step at 0.3 begins inside TorchDynamo's frame. Its
    regions' tightest plans need more than the step's budget (region2: 1.09 MiB of 960 KiB); they run under the
    runtime, which evicts around and inside them, and the steps hold the budget (0.994 of it in the handoff bench).
    An xfail until 11-26: those regions raised BudgetError instead, and before that the first step's restore named
    1.10x, then 1.08x more. Measured on the 2-core CPU development machine, torch 2.13.0."""
    case = build_dynamic("lstm", "test")
    initial = copy.deepcopy(case.model.state_dict())
    eager = _steps(case, case.model, CASES["lstm"])
    budget = int(0.3 * max(peak for _, _, peak in eager))
    try:
        results = _compiled_steps(case, initial, budget, CASES["lstm"])
    except dtr_compile.BudgetError as error:
        named = error.smallest_feasible_bytes
        assert named is not None and budget < named and not error.is_lower_bound, error
        budget = named
        results = _compiled_steps(case, initial, budget, CASES["lstm"])
    _assert_close(results, eager, "lstm at 0.3")
    assert all(peak <= budget for _, _, peak in results), (budget, [peak for _, _, peak in results])


def test_a_backward_part_too_big_for_the_budget_runs_op_by_op(monkeypatch) -> None:
    """A region's backward that cannot fit the budget as one operation (here: told that it needs a terabyte
    of workspace) runs its FX code op by op under the runtime instead of failing the step; values, gradients
    and the budget hold."""
    original = dtr_compile.backend.region._footprint

    def huge_backward(report, phase, example_numels):
        footprint = original(report, phase, example_numels)
        return Footprint(footprint.new_bytes, 1 << 40, example_numels) if phase == "backward" else footprint

    monkeypatch.setattr(dtr_compile.backend.region, "_footprint", huge_backward)
    case = build_dynamic("transformer_branch", "test")
    initial = copy.deepcopy(case.model.state_dict())
    eager = _steps(case, case.model, 3)
    budget = int(0.5 * max(peak for _, _, peak in eager))
    case.model.load_state_dict(initial)
    torch._dynamo.reset()
    with dtr_compile.config.patch(memory_budget=budget, codegen="fx"):
        results = _steps(case, torch.compile(case.model, backend="dtr"), 3)
    _assert_close(results, eager, "op by op")
    assert max(peak for _, _, peak in results[1:]) <= 1.05 * budget
    stats = implicit_runtime().stats()
    assert stats.parts_op_by_op > 0 and stats.steps == 3, stats


def test_a_region_whose_plan_does_not_fit_the_step_runs_op_by_op_within_it(monkeypatch) -> None:
    """A region whose tightest plan needs more than the whole step's budget (here: its planner says so) is planned
    at that floor and runs under the runtime, which evicts around and inside it (op by op where a part does not fit
    as one operation) and holds the budget (the unrolled LSTM at 0.3 runs so), instead of refusing the step."""
    original = dtr_compile.backend.region.Region._compile_with
    floors: list[int] = []
    told: dict[int, int] = {}  # region -> the floor it was told (then it is planned at that floor)
    real: dict[int, set[int]] = {}  # region -> floors its real planner named (the region then plans at them)

    def floor_above_the_step(self, budget, example_inputs, tail=None, codegen=None, **kwargs):
        try:
            compiled = original(self, budget, example_inputs, tail, codegen, **kwargs)
        except dtr_compile.BudgetError as error:  # a real one goes to the region as it is
            real.setdefault(id(self), set()).add(error.smallest_feasible_bytes)
            raise
        if budget is None or budget in real.get(id(self), ()) or budget >= told.get(id(self), 2 * budget):
            return compiled
        floor = told.setdefault(id(self), 2 * budget)
        floors.append(floor)
        raise dtr_compile.BudgetError("planner floor", budget_bytes=budget, smallest_feasible_bytes=floor)

    monkeypatch.setattr(dtr_compile.backend.region.Region, "_compile_with", floor_above_the_step)
    case = build_dynamic("transformer_branch", "test")
    initial = copy.deepcopy(case.model.state_dict())
    eager = _steps(case, case.model, 3)
    budget = int(0.5 * max(peak for _, _, peak in eager))
    runtime = implicit_runtime()  # this thread's, if an earlier test made one: it counts on across tests
    before = runtime.stats() if runtime is not None else None
    results = _compiled_steps(case, initial, budget, 3)
    _assert_close(results, eager, "regions planned above the step's budget")
    assert any(floor > budget for floor in floors), (budget, floors)  # a plan that does not fit the step
    assert max(peak for _, _, peak in results[1:]) <= 1.05 * budget, (budget, [peak for _, _, peak in results])
    stats = implicit_runtime().stats()
    same = before is not None and implicit_runtime() is runtime
    steps, evictions = (before.steps, before.evictions) if same else (0, 0)
    assert stats.steps - steps == 3 and stats.evictions > evictions, (before, stats)


def test_the_first_steps_output_is_not_held_by_garbage_the_compile_left(monkeypatch) -> None:
    """A compile that catches an exception (here the planner's BudgetError, raised from a frame that holds it, as
    `passes/partition.py` does) leaves a cycle whose frames reach up to the compiled module's call; a frame keeps
    its locals after it returns, so the step's output looked held by the program (GPT-2's logits were restored at
    the first step's end by rerunning the forward). The region collects that garbage before its code runs."""
    from tests.e2e import compiled_models

    original = dtr_compile.backend.region.Region._compile_with
    raised: list[int] = []

    def too_tight_once(self, budget, example_inputs, tail=None, codegen=None, **kwargs):
        if not raised and budget is not None:
            raised.append(budget)
            error = dtr_compile.BudgetError("stand-in floor", budget_bytes=budget, smallest_feasible_bytes=budget)
            raise error
        # Inside the region's handler the error is alive: a full collection now (the compile-time measurement makes
        # one, passes/verify.py) moves the cycle to the oldest generation, which TorchDynamo's own collection after
        # a compile (generation 1) leaves alone.
        gc.collect()
        return original(self, budget, example_inputs, tail, codegen, **kwargs)

    monkeypatch.setattr(dtr_compile.backend.region.Region, "_compile_with", too_tight_once)
    model, (x,) = compiled_models.mlp()
    torch._dynamo.reset()
    collecting = gc.isenabled()
    gc.disable()  # only the region's own collection may free the cycle
    try:
        with dtr_compile.config.patch(memory_budget=10 * x.numel() * 4, codegen="fx"):
            compiled = torch.compile(model, backend="dtr")
            out = compiled(x)
            assert raised, "the stand-in floor was never raised: the test exercises nothing"
            holders = [type(r).__name__ for r in gc.get_referrers(out) if isinstance(r, types.FrameType)]
            out.sum().backward()
    finally:
        if collecting:
            gc.enable()
    assert not holders, holders


def test_forward_and_backward_parts_of_a_batchnorm_cnn_run_op_by_op(monkeypatch) -> None:
    """Forward parts too (which write BatchNorm's running statistics in place) fall back op by op: gradients and
    running statistics equal eager's, within the budget."""
    from tests.e2e.compiled_models import cnn

    original = dtr_compile.backend.region._footprint
    monkeypatch.setattr(
        dtr_compile.backend.region,
        "_footprint",
        lambda report, phase, numels: Footprint(original(report, phase, numels).new_bytes, 1 << 40, numels),
    )
    model, (x,) = cnn()
    reference = copy.deepcopy(model)

    def steps(run, owner):
        results = []
        for step in range(3):
            owner.zero_grad(set_to_none=True)
            _, measured = measure_peak(lambda step=step: run(x + step).sum().backward())
            results.append(
                (
                    [p.grad.clone() for p in owner.parameters()],
                    [b.clone() for b in owner.buffers()],
                    measured.peak_bytes,
                )
            )
        return results

    eager = steps(reference, reference)
    budget = int(0.7 * max(peak for _, _, peak in eager))
    torch._dynamo.reset()
    with dtr_compile.config.patch(memory_budget=budget, codegen="fx"):
        results = steps(torch.compile(model, backend="dtr"), model)
    for step, ((grads, buffers, peak), (ref_grads, ref_buffers, _)) in enumerate(zip(results, eager)):
        for got, want in zip(grads + buffers, ref_grads + ref_buffers):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert step == 0 or peak <= 1.05 * budget, (step, peak, budget)  # the first step compiles (see above)
    assert implicit_runtime().stats().parts_op_by_op >= 4  # forward and backward, in the steps after the first


def test_changing_sequence_length_does_not_recompile_every_step(monkeypatch) -> None:
    """The transformer's length changes at every step: Dynamo compiles each frame static once, then dynamic
    once (automatic dynamic shapes), and later lengths reuse the dynamic plans. (A branch taken for the first
    time still compiles its code once: that is a first compile of another frame, not a recompile.)"""
    recompiles = []
    original_init = dtr_compile.backend.region.Region.__init__

    def counting_init(self, gm, example_inputs):
        compile_id = torch._guards.CompileContext.current_compile_id()
        if compile_id is not None and compile_id.frame_compile_id > 0:  # the same frame compiled again
            recompiles.append(str(compile_id))
        original_init(self, gm, example_inputs)

    monkeypatch.setattr(dtr_compile.backend.region.Region, "__init__", counting_init)
    case = build_dynamic("transformer_branch", "test")
    budget = int(0.5 * _steps(case, case.model, 1)[0][2])
    torch._dynamo.reset()
    with dtr_compile.config.patch(memory_budget=budget, codegen="fx"):
        compiled = torch.compile(case.model, backend="dtr")
        _steps(case, compiled, 2)
        recompiles.clear()
        later = []
        for step in range(2, 6):  # four more steps, lengths not seen before
            case.model.zero_grad(set_to_none=True)
            inputs, target = case.batch(step)
            _, measured = measure_peak(lambda i=inputs, t=target: case.loss_fn(compiled(*i), t).backward())
            later.append(measured.peak_bytes)
    assert not recompiles, recompiles
    assert max(later) <= 1.05 * budget, (later, budget)


def test_gradients_summed_by_autograd_are_never_evicted_under_inductor() -> None:
    """The mixture of experts under Inductor at 0.3 once crashed the process: the runtime evicted a gradient
    waiting in the autograd engine's input buffer, which sums gradients outside any dispatch mode and read the
    freed memory. Gradients now stay resident (runtime/operations.py): at 0.3 the step must either run with
    the same results as the backend without a budget, or name the budget it needs."""
    case = build_dynamic("moe", "test")
    initial = copy.deepcopy(case.model.state_dict())
    eager_peak = max(peak for _, _, peak in _steps(case, case.model, 2))
    reference = None
    for budget in (None, int(0.3 * eager_peak)):
        case.model.load_state_dict(initial)
        torch._dynamo.reset()
        with dtr_compile.config.patch(memory_budget=budget, codegen="inductor"):
            compiled = torch.compile(case.model, backend="dtr")
            try:
                results = _steps(case, compiled, 2, measured=False)
            except dtr_compile.BudgetError as error:
                assert error.smallest_feasible_bytes is not None and error.smallest_feasible_bytes > budget
                continue
        if reference is None:
            reference = results
        else:
            _assert_close(results, reference, "moe under Inductor at 0.3")


def test_a_floor_that_moves_when_planned_at_is_planned_at_once_more(monkeypatch) -> None:
    """A region planned at the floor its first plan named may find that plan's floor higher (Inductor's code measured
    above it: verify.py names the measured one). The region plans at the new floor instead of failing the compile
    with the planner's error: GPT-2 at 45 MiB on the CPU stand-in (the slow test in test_loss_tail.py) raised
    "the smallest feasible budget is 53.35 MiB" for a region planned at 53.09 MiB."""
    from tests.e2e import compiled_models

    original = dtr_compile.backend.region.Region._compile_with
    asked: list[int | None] = []

    def moving_floor(self, budget, example_inputs, tail=None, codegen=None, **kwargs):
        asked.append(budget)
        if budget is not None and budget < 4 * asked[0]:  # the step's room, then the first floor: each names twice it
            raise dtr_compile.BudgetError("stand-in floor", budget_bytes=budget, smallest_feasible_bytes=2 * budget)
        return original(self, budget, example_inputs, tail, codegen, **kwargs)

    monkeypatch.setattr(dtr_compile.backend.region.Region, "_compile_with", moving_floor)
    model, (x,) = compiled_models.mlp()
    expected = compiled_models.eager_grads(model, (x,))
    torch._dynamo.reset()
    with dtr_compile.config.patch(memory_budget=10 * x.numel() * 4, codegen="fx"):
        compiled = torch.compile(model, backend="dtr")
        model.zero_grad(set_to_none=True)
        compiled(x).sum().backward()
    room = asked[0]  # then the least tail's plan at the same room, the first floor, and the floor that moved
    assert room is not None and asked == [room, room, 2 * room, 4 * room], asked
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name])


def test_a_forward_whose_code_saves_values_in_other_layouts_does_not_run_op_by_op() -> None:
    """Inductor's code of a convolution network saves its activations channels-last, and its backward asserts those
    strides: a forward run op by op (eager's layouts) under the runtime would stop that backward with an
    AssertionError. Such a forward has no op-by-op fallback (the step overruns and names its budget instead); a forward
    whose code keeps the graph's strides, or FX code, keeps it. Oracle: the decision on the output strides Inductor's
    CompiledFxGraph reports (as strings), against the graph's."""
    from types import SimpleNamespace

    from torch.fx.experimental.proxy_tensor import make_fx

    from dtr_compile.backend.region import _saves_in_other_layouts

    def forward(x, w):
        y = torch.nn.functional.conv2d(x, w)
        return y.sum(), y

    graph = make_fx(forward)(torch.randn(2, 4, 6, 6), torch.randn(4, 4, 3, 3))
    outputs = graph.graph.find_nodes(op="output")[0].args[0]
    assert [tuple(n.meta["val"].stride()) for n in outputs] == [(), (64, 16, 4, 1)]
    assert _saves_in_other_layouts(SimpleNamespace(output_strides=[(), ("64", "1", "16", "4")]), graph)
    assert not _saves_in_other_layouts(SimpleNamespace(output_strides=[(), ("64", "16", "4", "1")]), graph)
    assert not _saves_in_other_layouts(SimpleNamespace(output_strides=[None, None]), graph)
    assert not _saves_in_other_layouts(graph, graph)  # FX code: eager's layouts
