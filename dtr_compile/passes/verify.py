"""Measure a compiled region once at compile time, and plan it again, tighter, if it exceeds the budget.

The planner holds a *model* of the peak to the budget. For plain FX execution the model is exact; for
Inductor it is close but not exact (inlining.py models the pointwise ops Inductor inlines, not the
kernels it fuses or the buffers it writes in place), and it can be off in either direction by ~15%.
The budget is about measured memory, so under Inductor the backend measures the compiled region:

    compile (plan with the model held to the budget)
    run one training step of the region on stand-ins of its inputs, measure its peak (measure.py)
    while the measured peak is above the budget (at most MAX_REPLANS times):
        plan again with the model held to budget x (modelled peak / measured peak), and recompile

Cost: two steps of the region at compile time (a warm-up and the measured step; the backend compiles
the backward together with the forward for this), plus one full compile per re-plan. The
step runs on copies of the buffers and user inputs (parameters are used as they are, their `.grad`
put back afterwards) and restores the random number generators, so the user's state is unchanged.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ..errors import BudgetError, format_bytes
from ..measure import measure_peak
from .partition import DTRPartitioner, PlanReport
from .planner import paused_gc

log = logging.getLogger(__name__)

MAX_REPLANS = 2  # plans after the first: one held lower by the measured ratio, then the lowest plan
SAFETY = 0.99  # a re-plan aims this much below the budget, since the model/measured ratio moves a little


def measure_region(compiled: Callable[..., Any], example_inputs: Sequence[Any]) -> int | None:
    """Peak bytes of one forward + backward of `compiled` above what was live before it; None when the
    inputs cannot be stood in for (symbolic sizes, opaque objects), or on CPU while a profiler is running."""
    inputs: list[Any] = []
    params: list[torch.nn.Parameter] = []  # used as they are; their `.grad` is put back afterwards
    device = torch.device("cpu")
    from torch._subclasses.fake_tensor import FakeTensor

    for value in example_inputs:
        if isinstance(value, FakeTensor):  # a re-plan from the shapes alone (backend/region.py) has nothing to run
            return None
        if isinstance(value, torch.nn.Parameter):
            params.append(value)
            inputs.append(value)
            device = value.device
        elif isinstance(value, torch.Tensor):
            if any(not isinstance(size, int) for size in value.shape) or value.is_sparse:
                return None
            inputs.append(value.detach().clone().requires_grad_(value.requires_grad))
            device = value.device
        elif value is None or isinstance(value, (bool, int, float)):
            inputs.append(value)
        else:
            return None
    if device.type not in ("cpu", "cuda"):
        return None
    if device.type == "cpu" and torch._C._autograd._profiler_enabled():
        # On CPU the measurement is a profiler session, and only one can run: a second would end the program's
        # own (torch.profiler around the step that compiles). The plan is then used as the model made it.
        log.warning("dtr: a profiler is running, so the compiled region is not measured at compile time")
        return None
    grads = [param.grad for param in params]
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else None

    def step() -> None:
        outputs = [o for o in tree_flatten(compiled(*inputs))[0] if isinstance(o, torch.Tensor) and o.requires_grad]
        if outputs:
            torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])

    def clear_grads() -> None:  # before, not inside, the measured step: its gradients are allocated anew
        for leaf in leaves:
            leaf.grad = None

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    try:
        with unset_fake_temporarily(), torch.enable_grad():
            clear_grads()
            step()  # warm-up: first-call costs (allocator, lazily initialized kernels) stay out of the measurement
            clear_grads()
            # Garbage freed during the step (collected by the cyclic collector) would count as freed by it.
            gc.collect()
            with paused_gc():
                _, measurement = measure_peak(step, device)
    finally:
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    return measurement.peak_bytes


def compile_within_budget(
    compile_once: Callable[[], Callable[..., Any]], example_inputs: Sequence[Any], partitioner: DTRPartitioner
) -> Callable[..., Any]:
    """Run `compile_once()` (which plans through `partitioner`), measure the result, and plan again while
    the measured peak exceeds the budget: first with the model held lower by measured / modelled, then
    with the planner's lowest plan. If even that one exceeds the budget (or the planner cannot reach the
    budget in the first place), raise BudgetError naming the smallest budget known to be met: the measured
    peak of the compiled lowest plan."""
    try:
        compiled = compile_once()
    except BudgetError as error:
        if error.budget_bytes is None:
            raise
        compiled, floor, smallest = _lowest_plan(compile_once, example_inputs, partitioner, error)
        if floor.measured_peak_bytes is not None and floor.measured_peak_bytes <= error.budget_bytes:
            partitioner.reports.append(floor)  # the model thought it too low; the compiled code meets it
            return compiled
        raise _too_small(error.budget_bytes, smallest) from None
    for attempt in range(MAX_REPLANS + 1):
        if not partitioner.reports:
            return compiled
        report = partitioner.reports[-1]
        if report.budget_bytes is None:
            return compiled
        measured = measure_region(compiled, example_inputs)
        report.measured_peak_bytes = measured
        report.replans = attempt
        if measured is None or measured <= report.budget_bytes:
            return compiled
        log.info("dtr: measured %d bytes over a %d-byte budget; planning again", measured, report.budget_bytes)
        partitioner.reports.remove(report)
        if attempt + 1 < MAX_REPLANS:
            # The model underestimated Inductor's memory by measured / modelled: hold the model that much lower.
            partitioner.model_scale = SAFETY * report.planned_peak.peak_bytes / measured
            try:
                compiled = compile_once()
                continue
            except BudgetError:
                pass  # the planner cannot go that low: its lowest plan is the last resort
        compiled, floor, smallest = _lowest_plan(compile_once, example_inputs, partitioner, None, report.budget_bytes)
        if floor.measured_peak_bytes is not None and floor.measured_peak_bytes <= report.budget_bytes:
            floor.replans = attempt + 1
            partitioner.reports.append(floor)
            return compiled
        raise _too_small(report.budget_bytes, smallest)
    return compiled


# Model targets tried when the budget is not met otherwise, as multiples of the planner's lowest modelled peak.
# The lowest modelled plan is not always the lowest measured one: the deepest plans (many recomputes, the
# paging planner's) are where Inductor's memory strays furthest above the model, so a plan held a little higher
# can measure lower. Tried from the highest down (the first that fits recomputes least).
LOW_PLAN_TARGETS = (1.15, 1.1, 1.05, 1.0)
# Then plans held by the exact memory model (every value allocated: what Inductor's inlining may save is not
# counted on), at these fractions of the budget, from the highest down. Its plans can be deeper than the
# Inductor model allows: on a BatchNorm CNN whose Inductor-model floor was 0.50 of no-remat, an exact-model
# plan measured 0.42. Neither model ranks Inductor's measured peaks reliably at this depth (the same CNN's
# exact-model plan held to 0.45 measured 0.51, the one held to 0.40 measured 0.42), hence several targets.
EXACT_MODEL_SCALES = (1.0, 0.9, 0.8, 0.7)


def _lowest_plan(
    compile_once: Callable[[], Callable[..., Any]],
    example_inputs: Sequence[Any],
    partitioner: DTRPartitioner,
    error: BudgetError | None,
    budget_bytes: int | None = None,
) -> tuple[Callable[..., Any], PlanReport, int]:
    """Compile and measure low plans: those held to LOW_PLAN_TARGETS x the planner's lowest modelled peak, then
    those held by the exact memory model to EXACT_MODEL_SCALES x the budget. Returns the first that meets the
    budget, or else the one that shows the smallest budget feasible, as (compiled, its report, the smallest
    budget it shows to be feasible: its measured peak, or its modelled one where that is higher). A plan kept
    from the exact model leaves `partitioner.memory_model` set, so that compiling again plans the same way."""
    budget_bytes = error.budget_bytes if error is not None else budget_bytes
    assert budget_bytes is not None
    floor = getattr(error, "modelled_floor_bytes", None)
    if floor is None:  # plan for one byte: the planner then names its lowest peak
        partitioner.model_scale = 1 / budget_bytes
        try:
            compile_once()
        except BudgetError as lowest:
            floor = getattr(lowest, "modelled_floor_bytes", None)
            error = error or lowest
        if floor is None:
            raise error or BudgetError(f"no plan meets the budget of {budget_bytes} bytes", budget_bytes=budget_bytes)
    candidates = [(None, floor * factor / budget_bytes) for factor in LOW_PLAN_TARGETS]
    if partitioner.memory_model is None:
        candidates += [("exact", scale) for scale in EXACT_MODEL_SCALES]
    best: tuple[Callable[..., Any], PlanReport, int, str | None] | None = None
    exact_floor_tried = False
    while candidates:
        memory_model, scale = candidates.pop(0)
        partitioner.memory_model, partitioner.model_scale = memory_model, scale
        try:
            compiled = compile_once()
        except BudgetError as below:
            exact_floor = getattr(below, "modelled_floor_bytes", None)
            if memory_model == "exact" and exact_floor is not None and not exact_floor_tried:
                # Below the exact model's own floor: the remaining exact targets are lower still; try that floor.
                exact_floor_tried = True
                candidates = [c for c in candidates if c[0] != "exact"] + [("exact", exact_floor / budget_bytes)]
            continue
        report = partitioner.reports.pop()
        # The budget this plan is checked against. (A fractional budget resolves against the no-remat peak of
        # the memory model planning, so an exact-model plan's own report holds a slightly different one.)
        report.budget_bytes = budget_bytes
        measured = measure_region(compiled, example_inputs)
        report.measured_peak_bytes = measured
        # A budget of max(measured, modelled) plans (the model reaches it) and is met (this plan meets it).
        shown = report.planned_peak.peak_bytes if measured is None else max(measured, report.planned_peak.peak_bytes)
        if measured is None:  # nothing to compare plans by (see measure_region): the lowest modelled one
            lowest = (None, floor / budget_bytes)
            if (memory_model, scale) != lowest:
                candidates = [lowest]
                continue
            partitioner.memory_model = None
            if error is not None:
                raise error
            return compiled, report, shown
        if best is None or shown < best[2]:
            best = (compiled, report, shown, memory_model)
        if measured <= budget_bytes:
            return compiled, report, shown
    if best is None:
        partitioner.memory_model = None
        raise error or BudgetError(f"no plan meets the budget of {budget_bytes} bytes", budget_bytes=budget_bytes)
    partitioner.memory_model = best[3]
    return best[0], best[1], best[2]


def _too_small(budget_bytes: int, smallest: int) -> BudgetError:
    return BudgetError(
        f"memory budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) is below what this graph can run in: "
        f"the smallest feasible budget is {format_bytes(smallest)} ({smallest} bytes), measured for the code "
        "Inductor generates. Raise dtr_compile.config.memory_budget.",
        budget_bytes=budget_bytes,
        smallest_feasible_bytes=smallest,
    )
