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

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ..errors import BudgetError, format_bytes
from ..measure import measure_peak
from .partition import DTRPartitioner

log = logging.getLogger(__name__)

MAX_REPLANS = 2
SAFETY = 0.99  # a re-plan aims this much below the budget, since the model/measured ratio moves a little


def measure_region(compiled: Callable[..., Any], example_inputs: Sequence[Any]) -> int | None:
    """Peak bytes of one forward + backward of `compiled` above what was live before it; None when the
    inputs cannot be stood in for (symbolic sizes, opaque objects)."""
    inputs: list[Any] = []
    params: list[torch.nn.Parameter] = []
    device = torch.device("cpu")
    for value in example_inputs:
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
    grads = [param.grad for param in params]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else None

    def step() -> None:
        for param in params:
            param.grad = None
        outputs = [o for o in tree_flatten(compiled(*inputs))[0] if isinstance(o, torch.Tensor) and o.requires_grad]
        if outputs:
            torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    try:
        with unset_fake_temporarily(), torch.enable_grad():
            step()  # warm-up: first-call costs (allocator, lazily initialized kernels) stay out of the measurement
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
    """Run `compile_once()` (which plans through `partitioner`), measure the result, and re-plan with a
    tighter model target while the measured peak exceeds the budget.

    A budget below what the planner can reach raises BudgetError naming the smallest feasible budget for
    the compiled code: the planner's lowest plan is compiled and measured to find it (one more compile)."""
    compiled = _compile_or_measured_floor(compile_once, example_inputs, partitioner)
    for attempt in range(MAX_REPLANS + 1):
        if not partitioner.reports:
            return compiled
        report = partitioner.reports[-1]
        if report.budget_bytes is None:
            return compiled
        measured = measure_region(compiled, example_inputs)
        report.measured_peak_bytes = measured
        if measured is None or measured <= report.budget_bytes or attempt == MAX_REPLANS:
            if measured is not None and measured > report.budget_bytes:
                log.warning(
                    "dtr: the compiled region peaks at %d bytes, above the %d-byte budget, after %d re-plans",
                    measured,
                    report.budget_bytes,
                    attempt,
                )
            return compiled
        # The model underestimated Inductor's memory by measured / modelled: hold the model that much lower.
        partitioner.model_scale = SAFETY * report.planned_peak.peak_bytes / measured
        partitioner.reports.remove(report)
        log.info("dtr: measured %d bytes over a %d-byte budget; re-planning", measured, report.budget_bytes)
        compiled = _compile_or_measured_floor(compile_once, example_inputs, partitioner)
    return compiled


def _compile_or_measured_floor(
    compile_once: Callable[[], Callable[..., Any]], example_inputs: Sequence[Any], partitioner: DTRPartitioner
) -> Callable[..., Any]:
    try:
        return compile_once()
    except BudgetError as error:
        if error.budget_bytes is None or error.smallest_feasible_bytes is None:
            raise
        floor_error = error
    # The planner's lowest plan, in the model's terms, and what the compiled code of that plan measures.
    modelled_floor = getattr(floor_error, "modelled_floor_bytes", None)
    if modelled_floor is None:
        raise floor_error
    partitioner.model_scale = modelled_floor / floor_error.budget_bytes
    try:
        compiled = compile_once()
    except BudgetError:
        raise floor_error from None
    report = partitioner.reports.pop()
    measured = measure_region(compiled, example_inputs)
    if measured is None:
        raise floor_error
    # A budget of max(measured, modelled floor) plans (the model reaches it) and meets it (this plan does).
    smallest = max(measured, report.planned_peak.peak_bytes)
    raise BudgetError(
        f"memory budget {format_bytes(floor_error.budget_bytes)} ({floor_error.budget_bytes} bytes) is below what "
        f"this graph can run in: the smallest feasible budget is {format_bytes(smallest)} ({smallest} bytes), "
        f"measured for the code Inductor generates; the modelled peak without rematerialization is "
        f"{format_bytes(report.no_remat.peak_bytes)}. Raise dtr_compile.config.memory_budget.",
        budget_bytes=floor_error.budget_bytes,
        smallest_feasible_bytes=smallest,
    ) from None
