"""Measure a compiled region once at compile time, and compile it once more if the measurement misses the budget.

The planner holds a *model* of the peak to the budget. For plain FX execution the model is exact; for
Inductor it is close but not exact (inlining.py models the pointwise ops Inductor inlines, not the
kernels it fuses or the buffers it writes in place), and it can be off in either direction by ~15%.
The budget is about measured memory, so under Inductor the backend measures the compiled region:

    compile (the model held to the device's aim x the budget (partition.AIMS) / the graph's calibrated measured-to-modelled ratio)
    run one training step of the region on stand-ins of its inputs, measure its peak (measure.py)
    if the measured peak is above the budget, or below BAND x the budget:
        plan once more, aimed with this plan's own ratio, and compile (keep the first if the second exceeds)
    neither meets it: compile the planner's lowest plan (when it is neither of them), and if that does not meet it
    either, BudgetError naming the lowest measured peak (a budget that plan is shown to meet)

At most MAX_COMPILES compiles per region (issue 17: one plan, not a search of compiled candidates; each Inductor
compile costs 15-100 s on CPU). The ratio measured / modelled is kept per graph (plan_cache.py), so later budgets
of the same graph aim their first plan with it, and the kept plan with its measured peak, so that a second process
neither plans nor measures. When the planner cannot reach the budget at all, its lowest plan is compiled and
measured (the model may be pessimistic) instead.

Cost: two steps of the region per measurement (a warm-up and the measured step; the backend compiles
the backward together with the forward for this), plus the second compile when there is one. The
step runs on copies of the buffers and user inputs (parameters are used as they are, their `.grad`
put back afterwards) and restores the random number generators, so the user's state is unchanged.
Where the time went is in `PlanReport.times` (`CompileTimes`, printed by explain).
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ..errors import BudgetError, MeasurementError, format_bytes
from ..measure import mark, measure_peak
from ..tensor_bytes import tensor_nbytes
from . import plan_cache
from .partition import DTRPartitioner, PlanReport, cache_entry, model_scale_for
from .planner import paused_gc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegionPeak:
    """One measured forward + backward of a compiled region."""

    peak_bytes: int  # above what was live before it
    # The backward's peak above what is live when it begins, its incoming gradients counted as held there (in a step
    # the loss made them; here a sum's backward hands in expanded scalars, which the region's code copies out whole).
    # None when the backward's start was not seen. The runtime makes this much room when it calls the backward: the
    # model's start is not the real one (bf16 GPT-2 at checkpointing's peak, CPU stand-in: 23.7 MiB live where 21.8
    # were modelled, so the room read off the model was 1.9 MiB short and the backward ran op by op, then failed).
    backward_room_bytes: int | None = None


def measure_region(
    compiled: Callable[..., Any],
    example_inputs: Sequence[Any],
    *,
    outputs_dropped: bool = False,
    tail_peak_bytes: int = 0,
    gradients_held: bool = False,
) -> RegionPeak | None:
    """One forward + backward of `compiled`, measured (RegionPeak); None when the inputs cannot be stood in for
    (symbolic sizes, opaque objects). `ProfilerRunning` on CPU while a profiler runs.
    `outputs_dropped`: the outputs are let go before the backward, as the training loop the plan was made for
    does (`PlanReport.loop_drops_outputs`); otherwise they are held through it. `tail_peak_bytes`: what the loss
    holds at its peak between the forward and the backward (storage.Tail.peak_bytes), allocated and freed there, as
    every memory model reserves it: without it the measurement missed a peak the model counts, read as a model
    that overestimates, and the next plan aimed above the budget (GPT-2 at the CPU stand-in, 44 MiB: modelled 46.1,
    measured 40.1 for the region alone, and the step overran)."""
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
            # With the input's own strides: a clone of a strided view (`x[::2]`, a micro-batch sliced out of a batch) is
            # contiguous, and Inductor's code, compiled for the strides traced, asserted on it (an AssertionError
            # from the plan made at a step's end).
            copy = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
            inputs.append(copy.copy_(value.detach()).requires_grad_(value.requires_grad))
            device = value.device
        elif value is None or isinstance(value, (bool, int, float)):
            inputs.append(value)
        else:
            return None
    if device.type not in ("cpu", "cuda"):
        return None
    if profiler_blocks_measuring(device):  # compile_within_budget decides what then holds
        raise ProfilerRunning
    grads = [param.grad for param in params]
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else None

    unheld: list[int] = []  # per backward start seen: bytes of incoming gradients not yet materialized there

    def step() -> None:
        outputs = [o for o in tree_flatten(compiled(*inputs))[0] if isinstance(o, torch.Tensor) and o.requires_grad]
        _mark_backward_start(outputs, unheld)
        if tail_peak_bytes > 0:
            torch.empty(tail_peak_bytes, dtype=torch.uint8, device=device)  # the loss's peak, freed at once
        if outputs:
            # The outputs' gradients are made by the autograd engine (each sum's backward), as a loss's backward
            # makes them in a training step, and handed to the region's backward, which frees them after their
            # last use. Gradients passed in here (`backward(outputs, [ones_like(o), ...])`) would be held by this
            # frame through the whole backward (on the CPU stand-in GPT-2 that is the logits' gradient, 8 MB).
            held: list[torch.Tensor] = []
            if gradients_held:
                # Each gradient made dense (a product's backward makes it, as a cross-entropy's does) and kept until the
                # backward returns. (Not in a loop variable of this frame: that would hold an output through it.)
                for hook_on in outputs:
                    hook_on.register_hook(held.append)
                del hook_on
                losses = [(o * o.new_ones(())).sum() for o in outputs]
            else:
                losses = [o.sum() for o in outputs]
            if outputs_dropped:
                outputs.clear()  # a sum's backward keeps no output alive
            torch.autograd.backward(losses)

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
            unheld.clear()
            with paused_gc():
                _, measurement = measure_peak(step, device)
    finally:
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    room = None
    if len(measurement.marks) == 1 and len(unheld) == 1:
        start = measurement.marks[0]
        room = max(0, start.peak_after_bytes - start.live_bytes - unheld[0])
    return RegionPeak(measurement.peak_bytes, room)


def _mark_backward_start(outputs: list[torch.Tensor], unheld: list[int]) -> None:
    """Mark (measure.mark) where the region's compiled backward begins: a pre-hook on its autograd node, which the
    outputs reach directly or through a view. Notes in `unheld` the bytes its incoming gradients still lack there."""
    nodes: dict[int, Any] = {}
    for output in outputs:
        node = output.grad_fn
        while node is not None and "CompiledFunction" not in type(node).__name__:
            parents = [n for n, _ in node.next_functions if n is not None]
            node = parents[0] if len(parents) == 1 else None  # a view's one parent; anything else is not the region
        if node is not None:
            nodes[id(node)] = node

    def at_start(grad_outputs: tuple[Any, ...]) -> None:
        if unheld:
            return
        unheld.append(sum(_unmaterialized_bytes(g) for g in grad_outputs if isinstance(g, torch.Tensor)))
        mark()

    if len(nodes) == 1:
        next(iter(nodes.values())).register_prehook(at_start)


def _unmaterialized_bytes(gradient: torch.Tensor) -> int:
    """Bytes a gradient would hold as a dense tensor less those its storage holds (an expanded scalar: nearly all)."""
    return max(0, tensor_nbytes(gradient) - gradient.untyped_storage().nbytes())


def compile_within_budget(
    compile_once: Callable[[], Callable[..., Any]],
    example_inputs: Sequence[Any],
    partitioner: DTRPartitioner,
    *,
    measure_floor: bool = True,
) -> Callable[..., Any]:
    """Compile the region (`compile_once()` plans through `partitioner`), measure it, and compile it once more
    when the measured peak is above the budget, or below AIM's band (then the first compile is kept if the second
    exceeds). At most MAX_COMPILES compiles where one of them meets the budget; where neither does, one aimed by the
    worse of their measured / modelled ratios, then the planner's lowest plan. A budget none meets raises BudgetError
    naming the smallest budget shown to be met (the lowest measured peak), and that budget's plan is kept in the plan
    cache, so that it runs.
    A plan read from the plan cache is not measured again. `measure_floor=False`: a budget the planner finds no plan
    under raises its BudgetError (the modelled floor) at once, with nothing compiled (the caller plans otherwise: a
    first step with the least tail, backend/region.py)."""
    run = _Attempts(compile_once, example_inputs, partitioner)
    try:
        compiled = run.compile()
    except BudgetError as error:
        if error.budget_bytes is None or getattr(error, "from_cache", False) or not measure_floor:
            raise
        run.first_key = partitioner.cache_key
        return run.floor_plan(error, [])
    run.first_key = partitioner.cache_key
    if not partitioner.reports:
        return compiled
    report = partitioner.reports[-1]
    if report.budget_bytes is None or report.from_cache and report.measured_peak_bytes is not None:
        return compiled
    measured = run.measure(compiled, report)
    budget = report.budget_bytes
    if measured is None:  # nothing to run it on: held by the model
        return compiled
    used = measured >= BAND * budget or report.planned_peak is report.no_remat
    if report.unpinned_baseline:
        partitioner.baseline_measured = (partitioner.structure, measured)  # decides for it when planning again
    if measured <= budget and used:
        return run.keep(compiled, report)
    # Aim again with this plan's own measured / modelled ratio (now also the graph's calibration).
    log.info("dtr: measured %d bytes against a %d-byte budget; planning once more", measured, budget)
    partitioner.reports.remove(report)
    partitioner.first = False
    if not report.unpinned_baseline:  # torch.compile's own partition, over the budget: plan at the same aim
        partitioner.model_scale = model_scale_for(measured / report.planned_peak.peak_bytes, partitioner.device_type)
    fits = (compiled, report) if measured <= budget else None
    try:
        second = run.compile()
    except BudgetError as error:
        if fits is not None:
            return run.keep(*fits)
        return run.floor_plan(error, [(compiled, report)])
    again = partitioner.reports.pop()
    measured_again = run.measure(second, again)
    if measured_again is None or measured_again <= budget:
        return run.keep(second, again)
    if fits is not None:
        return run.keep(*fits)
    tried = [(compiled, report), (second, again)]
    aimed = run.aimed_by_the_worse_ratio(budget, tried)
    if aimed is not None:
        return aimed
    return run.lowest_plan(budget, tried)


def profiler_blocks_measuring(device: torch.device) -> bool:
    """On CPU the measurement is a profiler session, and only one can run: a second would end the program's own
    (torch.profiler around the step that compiles)."""
    return device.type == "cpu" and torch._C._autograd._profiler_enabled()


class ProfilerRunning(Exception):
    """measure_region on CPU while a profiler session runs: it cannot open one of its own."""


def _check_unmeasured(report: PlanReport, partitioner: DTRPartitioner) -> None:
    """The region compiled inside a CPU profiler session, so it cannot be measured. A plan aimed by this graph's
    measured / modelled ratio (another plan of it was measured before: plan_cache.calibration) is kept, as a plan
    made inside a runtime step is. One aimed by the model alone is refused: on the CPU stand-in Llama at 70.2 MiB
    such a plan, modelled at 66.1 MiB, measured 76.2 MiB (1.085x the budget), and nothing said so."""
    if partitioner.calibration_key is not None and plan_cache.calibration(partitioner.calibration_key) is not None:
        log.warning("dtr: a profiler is running, so the compiled region is not measured; its plan is aimed by the "
                    "ratio measured on this graph before")  # fmt: skip
        return
    raise MeasurementError(
        f"a CPU profiler session is running while backend='dtr' compiles a region under a memory budget of "
        f"{format_bytes(report.budget_bytes or 0)} with Inductor. Inductor's memory is measured when the region "
        "compiles, and on CPU that measurement is a profiler session of its own, of which only one can run. Start the "
        "profiler after the steps that compile (the first one or two), or set dtr_compile.config.codegen = 'fx' "
        "(plain FX code, whose memory the plan models exactly)."
    )


# Plans measured below this fraction of the budget are planned once more, aimed higher (issue 17's band).
BAND = 0.90
MAX_COMPILES = 2  # compiles of one region at compile time: a plan, and one more aimed by the first's measurement
# (where both measure over the budget, one aimed by the worse ratio, then the planner's lowest plan:
# `_Attempts.aimed_by_the_worse_ratio`, `_Attempts.lowest_plan`)


class _Attempts:
    """The compiles and measurements of one region, timed into `partitioner.times` (explain shows them)."""

    def __init__(
        self, compile_once: Callable[[], Callable[..., Any]], example_inputs: Sequence[Any], partitioner: DTRPartitioner
    ) -> None:
        self.compile_once = compile_once
        self.example_inputs = example_inputs
        self.partitioner = partitioner
        self.times = partitioner.times
        self.first_key: str | None = None

    def compile(self) -> Callable[..., Any]:
        """compile_once(), timed; `times.compiles` counts the compiles that got past the planner."""
        partitioning = self.times.partition_s
        start = time.perf_counter()
        try:
            compiled = self.compile_once()
        finally:
            self.times.codegen_s += time.perf_counter() - start - (self.times.partition_s - partitioning)
        self.times.compiles += 1
        return compiled

    def measure(self, compiled: Callable[..., Any], report: PlanReport) -> int | None:
        start = time.perf_counter()
        try:
            region = measure_region(
                compiled,
                self.example_inputs,
                outputs_dropped=report.loop_drops_outputs,
                tail_peak_bytes=report.tail.peak_bytes,
                gradients_held=self.partitioner.tangents_held,
            )
        except ProfilerRunning:
            _check_unmeasured(report, self.partitioner)
            return None  # held by the calibrated model
        self.times.measure_s += time.perf_counter() - start
        self.times.measures += 1
        measured = None if region is None else region.peak_bytes
        report.measured_peak_bytes = measured
        report.measured_backward_room_bytes = None if region is None else region.backward_room_bytes
        report.replans = self.times.compiles - 1
        if measured is not None and self.partitioner.calibration_key is not None and not report.unpinned_baseline:
            plan_cache.calibrate(self.partitioner.calibration_key, measured / report.planned_peak.peak_bytes)
        return measured

    def keep(self, compiled: Callable[..., Any], report: PlanReport) -> Callable[..., Any]:
        if not self.partitioner.reports or self.partitioner.reports[-1] is not report:
            self.partitioner.reports.append(report)
        if self.first_key is not None and report.measured_peak_bytes is not None:
            plan_cache.store(self.first_key, cache_entry(report))
        return compiled

    def floor_plan(
        self, error: BudgetError, tried: list[tuple[Callable[..., Any], PlanReport]], limit: int = MAX_COMPILES
    ) -> Callable[..., Any]:
        """The planner cannot reach the budget: compile its lowest plan and measure it (the model may be
        pessimistic); it is kept if it meets the budget, else BudgetError names the lowest measured peak of it and
        of `tried` (compiled plans that measured above the budget). At most `limit` compiles in all."""
        budget = error.budget_bytes
        floor = getattr(error, "modelled_floor_bytes", None)
        if floor is None or budget is None or self.times.compiles >= limit:
            if tried and budget is not None:
                raise self.too_small(budget, tried)
            raise error
        self.partitioner.first = False
        self.partitioner.model_scale = floor / budget
        try:
            compiled = self.compile()
        except BudgetError:
            if tried:
                raise self.too_small(budget, tried) from None
            raise error from None
        report = self.partitioner.reports.pop()
        report.budget_bytes = budget
        measured = self.measure(compiled, report)
        if measured is None:
            raise error
        if measured <= budget:
            return self.keep(compiled, report)
        raise self.too_small(budget, [*tried, (compiled, report)])

    def aimed_by_the_worse_ratio(
        self, budget: int, tried: list[tuple[Callable[..., Any], PlanReport]]
    ) -> Callable[..., Any] | None:
        """Both aimed plans measured above the budget, the second because its own measured / modelled ratio was worse
        than the first's, which aimed it: plan once more, aimed by the worse of the two, when that plans below both.
        Kept if it meets the budget; else None (and it joins `tried`), for the lowest plan to be tried. Without it the
        lowest plan ran straight away: LoRA-adapted Llama (CPU stand-in) at 0.3 of torch.compile's peak measured its
        all-checkpoint plan 4% over the budget (1.16x its model), and the lowest plan it then ran recomputed 384 of a
        541 ms step, twice as much, using 0.75 of the budget."""
        # (torch.compile's own partition, modelled unpinned, says nothing of a pinned plan's ratio: not aimed by)
        ratios = [r.measured_peak_bytes / r.planned_peak.peak_bytes for _, r in tried
                  if r.measured_peak_bytes and not r.unpinned_baseline]  # fmt: skip
        if not ratios:
            return None
        scale = model_scale_for(max(ratios), self.partitioner.device_type)
        if scale * budget >= min(r.planned_peak.peak_bytes for _, r in tried):
            return None  # it would plan no lower than a plan that measured over the budget
        self.partitioner.model_scale = scale
        try:
            compiled = self.compile()
        except BudgetError:  # below the planner's reach: its lowest plan is next
            return None
        report = self.partitioner.reports.pop()
        measured = self.measure(compiled, report)
        if measured is None or measured <= budget:
            return self.keep(compiled, report)
        tried.append((compiled, report))
        return None

    def lowest_plan(self, budget: int, tried: list[tuple[Callable[..., Any], PlanReport]]) -> Callable[..., Any]:
        """Both plans aimed at the budget measured above it, but the planner's lowest plan may still meet it: its
        modelled peak is lower than theirs. Without this, a budget that an earlier BudgetError named (the lowest
        plan's measured peak) did not run in a process without that plan cached: aimed from a different
        calibration, both plans landed above it (Llama at the CPU stand-in named 76.5 MiB, then failed there
        naming 80.6). Planning to a 1-byte target finds the lowest plan's modelled peak, then that plan is
        compiled once: a third compile, on the way to a BudgetError only."""
        self.partitioner.first = False
        self.partitioner.model_scale = 1 / budget
        try:
            self.compile()
        except BudgetError as error:
            floor = getattr(error, "modelled_floor_bytes", None)
            if floor is not None and floor >= min(report.planned_peak.peak_bytes for _, report in tried):
                raise self.too_small(budget, tried) from None  # the lowest plan is one of those tried
            return self.floor_plan(error, tried, limit=self.times.compiles + 1)
        raise AssertionError("a plan held to a 1-byte target fitted")  # pragma: no cover - nothing fits 1 byte

    def too_small(self, budget: int, tried: list[tuple[Callable[..., Any], PlanReport]]) -> BudgetError:
        """BudgetError naming the lowest measured peak of the plans tried; that plan is kept in the plan cache
        under that budget, and the verdict under this one (a second process raises at once)."""
        best = min(tried, key=lambda attempt: attempt[1].measured_peak_bytes or math.inf)[1]
        smallest = best.measured_peak_bytes
        assert smallest is not None
        error = _too_small(budget, smallest)
        key = self.partitioner.key_for(smallest)
        if key is not None:
            entry = cache_entry(best)
            entry["budget_bytes"] = smallest
            plan_cache.store(key, entry)
        if self.first_key is not None:
            plan_cache.store(
                self.first_key,
                {"message": str(error), "budget_bytes": budget, "smallest_feasible_bytes": smallest},
            )
        return error


def _too_small(budget_bytes: int, smallest: int) -> BudgetError:
    return BudgetError(
        f"memory budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) is below what this graph can run in: "
        f"the smallest feasible budget is {format_bytes(smallest)} ({smallest} bytes), measured for the code "
        "Inductor generates. Raise dtr_compile.config.memory_budget.",
        budget_bytes=budget_bytes,
        smallest_feasible_bytes=smallest,
    )
