"""A graph TorchDynamo handed to `backend="dtr"`: its plan, its compiled parts, and its share of the budget.

How one budget is shared between the static plans of compiled regions and the online runtime
-------------------------------------------------------------------------------------------------
The runtime owns the step's budget. Everything the step allocates is accounted there: the tensors of eager
code, and the outputs and saved activations of every compiled part (compiled_ops.py), each made room for
before it runs, its transient peak included. A region's static plan only decides what happens *inside* its
compiled code: what its forward saves and what its backward recomputes, and where.

So a region is planned against the room the step leaves it: the step's budget minus the bytes the step
already holds when the region is compiled (the outputs of earlier regions, eager tensors, saved
activations). If even that is below what the region can run in, it is planned at its own smallest feasible
budget, and the runtime makes the rest of the room by evicting what is live outside the region (an evicted
output of an earlier region comes back by rerunning that region's compiled forward). A region is planned
once per step budget: with a budget in bytes, once; with a fraction, the runtime's first step runs without
a budget to measure the peak the fraction refers to (its regions are planned with no budget, which is what
"compiled the same way, with no budget" means), and each region is planned again, once, when the budget is
known. Regions compiled with no step around them (`config.compiled_steps = "plan_only"`, or no budget) are
planned alone against `config.memory_budget`, as fractions of their own no-remat peak.

The code after a region's forward (the loss, later regions) runs while the region's saved values are held, so
every plan leaves room for it: first an assumed tail (passes/storage.py), then the tail the first whole step
measured (runtime/tails.py), planned with once per region when it differs from the assumed one (`_measured_tail`).
Where the assumed tail leaves a budget no plan, the first step plans with the least tail instead (storage.LEAST_TAIL)
and the runtime holds the budget while the step measures the real one; a floor named before a step has run is the
least tail's, one named after it the measured tail's.

The first step's plan is made for a tail no step has measured, so with Inductor it was compiled twice: for that
step, then for the tail it measured (GPT-2 at the CPU stand-in's 0.363: two Inductor compiles, 76 s of a first
step where torch.compile's whole first call took 17 s). That first plan runs once, so its code is the FX code
generator's (`_codegen_for`: plain aten ops, compiled in the time it takes to plan), and Inductor compiles once,
when the step has ended, for the tail it measured (or the assumed one, when the two agree). A region whose first
step ends without that (no backward: an evaluation; or the step failed) is compiled with Inductor at its next call.
A region whose tail a step of an earlier process measured at the same sizes (plan_cache.dynamo_structure) skips the FX
step: its first plan is made with that tail and compiled with Inductor at once, from the caches when they hold it. So
does a region whose outputs are too small for any loss over them to change its plan (`_tail_cannot_matter`: an image
classifier's logits, not a language model's).

Dynamic shapes: Dynamo marks sizes that change between calls as symbolic and compiles once for all of them.
The plan is made at the largest value of each size the region has been called with (planned_sizes.py), and made
again when a call brings a larger one: a plan's memory grows with its sizes, so a plan made for the longest batch
holds the budget for every shorter one. The measured tail grows with the outputs to those sizes. The runtime makes
room for each call at the actual sizes (Footprint.scale).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import fx
from torch.utils._python_dispatch import _disable_current_modes

from .. import auto_budget, config
from ..compat import FREES_BACKWARD_GRADS
from ..config import Budget
from ..errors import BudgetError, MeasurementError, format_bytes
from ..passes import plan_cache, running_plans
from ..passes.costs import is_random
from ..passes.meta import cost_of
from ..passes.partition import DTRPartitioner, PlanReport
from ..passes.storage import (
    LEAST_TAIL,
    LOSS_TAIL_SCALAR_BYTES,
    TAIL_META_KEY,
    UNSEEN_LOSS_TANGENTS,
    Tail,
    loss_tail_bytes,
    tangent_bytes,
    tangent_placeholders,
)
from ..passes.verify import profiler_blocks_measuring
from ..planned_sizes import SizesSeen, planned_at
from ..runtime.compiled_ops import NO_FOOTPRINT, CompiledPart, Footprint, device_of
from ..runtime.implicit import STEPS
from ..runtime.runtime import current_step
from ..runtime.slice_kernels import kernels_wanted, with_kernels
from ..runtime.slices import output_slices
from ..tensor_bytes import size_hint, tensor_nbytes
from .aot import boxed_fx, compile_region

log = logging.getLogger(__name__)

_region_ids = itertools.count()

# A measured tail (runtime/tails.py) replaces the assumed one when they differ by more than this fraction of the
# step's budget: closer, a new plan (a compile) would change less than the memory model's own error.
TAIL_TOLERANCE = 0.02
TAIL_BAND = 0.90  # issue 17's band: a step whose peak is within [0.90, 1] of its budget needs no new plan
# The most values of the outputs' size, in fp32, a loss computed after the forward holds at once: a cross-entropy's
# saved log-softmax, the gradient of its nll and the gradient it hands back (measured: 3.00x the logits' fp32 bytes
# for GPT-2 and Llama, fp32 and bf16 autocast, F.cross_entropy and transformers' loss). `_tail_cannot_matter`
LOSS_FP32_VALUES = 3


_compiled_since_collection = False


def _collect_compile_garbage() -> None:
    """Collect the cyclic garbage a compile left, before the compiled code runs. Compiling catches exceptions (the
    planner's BudgetErrors, TorchDynamo's own), and a caught exception whose traceback's frame holds it is a cycle
    that holds, through each frame's caller, the frames of the compiled module's call. Such a frame keeps its
    locals after it returns: the first step's output (GPT-2's 8 MiB logits) looked held by the program until the
    step's end, which restored it by rerunning the whole forward (and named a budget 1.5x the one that runs).
    TorchDynamo's own collection after a compile reaches the young generations only, and the compile-time
    measurement's full collection (passes/verify.py) moves such a cycle, still alive inside the handler, to the oldest.
    A collection costs a few hundred milliseconds with a model library loaded, once per compile (seconds each)."""
    global _compiled_since_collection
    if _compiled_since_collection:
        _compiled_since_collection = False
        gc.collect()


class Region:
    """The callable `backend="dtr"` returns for one Dynamo graph."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        self.gm = gm
        self.name = f"region{next(_region_ids)}"
        # Fake tensors (from Dynamo's tracing) stand for the inputs when the region is planned again later:
        # holding the real example inputs would keep the first step's activations alive.
        fakes = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        self.example_inputs = (
            fakes if len(fakes) == len(example_inputs) and all(f is not None for f in fakes) else list(example_inputs)
        )
        # The parameters among them, weakly: a plan made after the first call is measured on them (`_stand_ins`).
        self._parameters = {
            i: weakref.ref(value) for i, value in enumerate(example_inputs) if isinstance(value, torch.nn.Parameter)
        }
        self.codegen = config.codegen
        self.cost_mode = config.cost_mode
        # Symbolic sizes (dynamic shapes) are planned at the largest value each has been called with: the plan is
        # made again when a call brings a larger one (planned_sizes.py).
        self._sizes = SizesSeen(self.example_inputs)
        # Dynamo traced the graph under the autocast state of this moment (and guards on it): a plan made after a
        # step's backward, outside the user's `torch.autocast`, must be traced under it too (`_autocast_as_traced`).
        self._autocast = _autocast_state()
        self.reports: list[PlanReport] = []  # one per compile, for explain and tests
        self._key: Hashable = None
        self._compiled: Callable[..., Any] | None = None
        self._owner: Callable[[], Any] | None = None  # weak: what this region's steps belong to
        self._tail: Tail | None = None  # the measured tail it plans with (`_measured_tail`), once decided
        self._tail_sizes: dict[Any, int] = {}  # the sizes the step that measured it ran at (dynamic shapes)
        self._grown_tail: tuple[Tail, dict[Any, int], Tail] | None = None  # (tail, sizes, it grown to them)
        self._tail_decided = False
        # Whether the step's incoming gradients outlive the compiled backward (storage.HELD_META_KEY): learned when a
        # step's backward sees one survive it (runtime/compiled_ops.py), then planned for.
        self._tangents_held = False
        # The most gradient bytes earlier micro-batches left counted in a step this region ran in (gradient
        # accumulation: Runtime._count_carried_gradients), and what the running plan was made for: every plan from
        # then on leaves room for them, so that the steps with and without them run one plan.
        self._carried_bytes = 0
        self._planned_carried = 0
        # The running code is the first step's FX code (`_codegen_for`), and the step it runs in; once the first
        # step is over (`_first_step_over`), every plan is compiled with the region's code generator. A compile at
        # a step's end that raised (`_replan_failed`: a MeasurementError, a profiler around it) is tried again at
        # the end of the next step, which runs the FX code too.
        self._provisional = False
        self._provisional_step: tuple[int, int] | None = None
        self._first_step_over = False
        self._replan_failed = False
        # (the step's floor by this region's tightest plan, why) when its plan does not fit the step's budget
        self._floor_note: tuple[int, str] | None = None
        # The joint graph's structure, once a plan asked for a tail an earlier process measured (`_recall_tail`)
        self._tail_structure: str | None = None
        # TorchDynamo's graph, the measured tail is kept under it too: a first step may skip FX code (`_codegen_for`)
        self._dynamo_structure = plan_cache.dynamo_structure(gm)
        self._remembered: tuple[tuple[str, ...], Tail | None] | None = None  # (keys, tail) kept for later processes
        key, budget = self._plan_budget()
        self._compile(key, budget, list(example_inputs))  # now: Dynamo reports compile errors as its own

    def __call__(self, *args: Any) -> Any:
        _collect_compile_garbage()
        STEPS.close_stale()
        if STEPS.wanted():
            STEPS.begin(self._step_owner())
        try:
            key, budget = self._plan_budget()  # (a tail decided here was measured at the last call's sizes)
            runtime = current_step()
            grew = self._sizes.grow(list(args))  # a size larger than the plan was made at: plan at it
            if grew:
                key, budget = self._plan_budget()
            # Gradients accumulated by earlier micro-batches hold part of the budget: plan for the room left, with FX
            # code for this step and Inductor's measured at its end, as for larger sizes
            carried = self._carried_bytes > self._planned_carried
            grew = grew or carried
            stale = self._provisional and _step_id(runtime) != self._provisional_step
            if stale and self._replan_failed and runtime is not None:
                self._provisional_step, self._replan_failed = _step_id(runtime), False  # planned when this one ends
                stale = False
            elif stale:
                self._first_step_over = True  # the first step ended without a backward to plan again after: now
            if key != self._key or stale or grew:
                # Stand-ins only where verify.py will run them: outside a step (inside one they would be memory the
                # step holds), under Inductor (FX code is exact by the model and not measured).
                measured = runtime is None and self.codegen == "inductor" and (self._provisional or grew)
                measure_on = self._stand_ins() if measured else None
                with _disable_current_modes():
                    self._compile(key, budget, self.example_inputs, measure_on, grew=grew)
                _collect_compile_garbage()
            compiled = self._compiled
            assert compiled is not None
            if self._floor_note is not None and runtime is not None:
                runtime.note_region_floor(self.name, *self._floor_note)
            unmeasured_tail = key[0] == "step" and len(key) > 2 and key[2] is None and not self._tail_decided
            if runtime is not None and (unmeasured_tail or self._provisional):
                # planned for an unmeasured tail: plan again for the one this step measures, when it has ended
                step_budget = key[1]  # type: ignore[index]
                runtime.note_region_replan(
                    self.name, lambda: self._replan_with_measured_tail(runtime, step_budget, budget)
                )
            elif runtime is not None and key[0] == "step" and len(key) > 2 and not self._tangents_held:
                # plan again if this step's backward shows its incoming gradients held through it (storage.py)
                step_budget = key[1]  # type: ignore[index]
                runtime.note_region_replan(
                    self.name, lambda: self._replan_if_tangents_held(runtime, step_budget, budget)
                )
            return compiled(*args)
        except BaseException:
            if STEPS.running() and current_step() is STEPS.runtime:
                STEPS.end()  # a failed forward ends its step: nothing of it will run backward
            raise

    def _step_owner(self) -> Any:
        """What a step begun by this region belongs to (a fractional budget is resolved per owner): the
        compiled module it runs in, whose later calls then begin their steps before Dynamo's frame (see
        implicit.py), or this region itself for a compiled function."""
        owner = self._owner() if self._owner is not None else None
        if owner is None:
            owner = STEPS.attach_to_calling_module()
            if owner is None:
                owner = self
            self._owner = weakref.ref(owner)
        return owner

    # ------------------------------------------------------------------------------ the budget share

    def _plan_budget(self) -> tuple[Hashable, Budget]:
        """(key, budget) of the plan this region should run under now; a new key means planning again."""
        runtime = current_step()
        held = runtime.step_bytes if runtime is not None else 0
        if runtime is None and config.compiled_steps == "runtime" and config.memory_budget is not None:
            runtime = STEPS.prospective_runtime()  # the step this region's first call will begin
            owner = self._owner() if self._owner is not None else None
            runtime.reference_peak_bytes = STEPS.here.calibrations.get(owner) if owner is not None else None
        if runtime is None:
            budget = auto_budget.concrete(config.memory_budget)  # "auto": the device's free memory now
            return ("alone", budget), budget
        calibrating = runtime.calibrating if runtime.active else runtime.budget_bytes is None
        if calibrating and runtime.memory_budget is not None:
            return ("calibrating",), None
        step_budget = runtime.budget_bytes
        if step_budget is None:
            return ("step", None), None
        self._carried_bytes = max(self._carried_bytes, runtime.carried_bytes)
        room = step_budget - max(held, self._carried_bytes)
        return ("step", step_budget, self._measured_tail(runtime, step_budget)), max(1, room)

    def _measured_tail(self, runtime: Any, step_budget: int, compiling: bool = False) -> Tail | None:
        """The tail to plan with: the one a step measured after this region's forward (runtime/tails.py), decided
        once, when the first is measured. None (the assumed tail, and no new plan: a compile) when the two differ
        by less than TAIL_TOLERANCE of the step's budget, or when the step that measured it already held its
        budget within the band the plans aim for (its peak in [TAIL_BAND, 1] x the budget) with a tail no larger
        than the assumed one and nothing evicted in it. A tail larger than assumed gets its plan, whatever that step's
        peak: the plan left it too little room, and every later step would hold the budget by evicting the region's
        saved values while the loss runs and bringing them back (GPT-2 under bf16 autocast, whose loss upcasts the
        logits to fp32: the assumed tail was half the measured one, each step evicted 13 MiB of saved activations in
        the loss, and the eighth could bring one back only by rerunning the whole forward, a BudgetError).
        `compiling`: the region plans again whatever the tail (its first step ran FX code): no compile is saved by
        keeping the assumed tail, so the measured one is taken. (Kept, the assumed tail's logits-sized loss put the
        frontier's GPT-2 at a budget of torch.compile's own measured peak 5% under its modelled no-remat peak,
        where 3% lets torch.compile's partition run: the plan recomputed instead, 1.19x torch.compile's step.)"""
        if self._tail_decided:
            return self._tail_at_planned_sizes()
        if not self.reports or not runtime.tails.decided(self.name):
            return None
        self._tail_decided = True
        self._tail_sizes = dict(self._sizes.last)  # the step that measured it called this region at these sizes
        measured = runtime.tails.learned.get(self.name)
        if measured is None:  # it shared its step with another region (tails.py): the assumed one stays
            return None
        measured_tail = Tail(measured.peak_bytes, measured.at_backward_bytes, measured.dropped_outputs)
        report = self.reports[-1]
        assumed = report.tail  # the assumed or recalled one, or the least where the assumed one left no plan
        # At the backward's start, outputs the program let go count as freed (at most: a plan may save one)
        at_backward = [tail.at_backward_bytes - _let_go_bytes(report, tail) for tail in (measured, assumed)]
        deltas = (measured.peak_bytes - assumed.peak_bytes, at_backward[0] - at_backward[1])
        off, grew = max(abs(d) for d in deltas), max(deltas)
        peak = runtime.stats().peak_bytes
        # A plan held at its floor (`_floor_note`: its tightest plan needed more than the step's room, so it recomputes
        # all it can) is not on target whatever the step measured: with room for a smaller tail it recomputes less
        # (the fit model's region with transformers' fused loss, CPU stand-in at batch 21: the assumed tail counted
        # two logits-sized values where the loss held one, and its plan recomputed 188 of 236 ms modelled).
        on_target = (
            runtime.budget_bytes == step_budget
            and TAIL_BAND * step_budget <= peak <= step_budget
            and measured.evictions == 0
            and grew <= TAIL_TOLERANCE * step_budget
            and self._floor_note is None
        )
        # A plan made with the least tail stands in for the measured one whatever the two differ by: the tail it
        # leaves (None) is the assumed one, which left the budget no plan (GPT-2 fit model, CPU stand-in, batch 15:
        # a measured tail within 4 bytes of the least one, and the assumed tail's floor plan recomputed 135 ms of it).
        if compiling or self.reports[-1].least_tail or (off > TAIL_TOLERANCE * step_budget and not on_target):
            self._tail = measured_tail
        if self._tail_structure is not None:  # for a later process's first step (`_recall_tail`)
            self._remember_tail(runtime, self._tail if self._tail is not None else _measured_tail_planned_with(report))
        return self._tail_at_planned_sizes()

    def _remember_tail(self, runtime: Any, tail: Tail | None) -> None:
        """Keep the tail this region's plans are made with from now on (None: the assumed one, which the step measured
        close enough to keep) for the first step of a later process. The tail, not the one the step measured: planned
        with a tail a few bytes off the one this process's plan was made with, the later process's plan missed the
        code Inductor cached for it."""
        sizes = _sizes_key(self._tail_sizes)
        keys = (
            plan_cache.tail_key(self._tail_structure, sizes),  # type: ignore[arg-type]
            plan_cache.tail_key(self._dynamo_structure, sizes),
        )
        self._remembered = (keys, tail)
        held = self._tangents_held or self.name in runtime.tails.held_tangents
        for key in keys:
            plan_cache.remember_tail(key, tail, tangents_held=held)

    def _recall_tail(self, structure: str) -> plan_cache.RememberedTail | None:
        """The tail a step of an earlier process measured after this graph's forward at these sizes, for a plan made
        before any step of this one measured it (the partitioner asks, with the joint graph's structure). The floor a
        BudgetError names is that of the measured tail: planned with the assumed one, the first step of a later
        process at that floor found no plan (the assumed tail needed more), planned with the least tail, evicted
        what the unseen loss needed room for, and raised a BudgetError naming 1.33x the floor (a 5-layer MLP with its
        cross-entropy outside the model, FX code). A different loss since is measured by that step and planned for
        from the next, as an assumed tail would be. So is whether that step's backward held the incoming gradients
        (torch 2.11): the plan holds them from the first step, as the one that named the floor did."""
        self._tail_structure = structure
        sizes = _sizes_key(self._sizes.values)
        recalled = plan_cache.remembered_tail(plan_cache.tail_key(structure, sizes))
        if recalled is None:  # kept by a step whose plan traced the graph for the other code generator
            recalled = plan_cache.remembered_tail(plan_cache.tail_key(self._dynamo_structure, sizes))
        if recalled is not None and recalled.tangents_held:
            self._tangents_held = True
        return recalled

    def _tail_at_planned_sizes(self) -> Tail | None:
        """The measured tail, grown with the region's outputs from the sizes of the step that measured it to those
        the plan is made at (planned_sizes.py): the tail is mostly the loss over the outputs. With dynamic padding,
        a tail measured at 96 tokens and planned with at 128 left the loss a quarter too little room."""
        tail = self._tail
        if tail is None or self._tail_sizes == self._sizes.values:
            return tail
        cached = self._grown_tail  # every call asks (`_plan_budget`); the answer changes only when the sizes grow
        if cached is not None and cached[0] is tail and cached[1] == self._sizes.values:
            return cached[2]
        with planned_at(self._tail_sizes):
            measured_at = self._output_bytes()
        with planned_at(self._sizes.values):
            planned_at_now = self._output_bytes()
        grown = tail
        if measured_at > 0 and planned_at_now != measured_at:
            growth = planned_at_now / measured_at
            grown = Tail(int(tail.peak_bytes * growth), int(tail.at_backward_bytes * growth), tail.dropped_outputs)
        self._grown_tail = (tail, dict(self._sizes.values), grown)
        return grown

    def _output_bytes(self) -> int:
        """Bytes of the graph's outputs at the sizes `planned_at` gives (their hints outside it)."""
        output = next(n for n in reversed(self.gm.graph.nodes) if n.op == "output")
        return sum(tensor_nbytes(node.meta.get("example_value")) for node in output.all_input_nodes)

    def _replan_with_measured_tail(self, runtime: Any, step_budget: int, budget: int) -> tuple[int, str] | None:
        """After a step planned for an unmeasured tail ended: this region's plan for the tail the step measured
        (the next step's plan, made now, with no step running), and its floor note if that plan does not fit. The
        first step's FX code (`_codegen_for`) is replaced by Inductor's even when the measured tail is the assumed one."""
        self._first_step_over = True
        newly_held = not self._tangents_held and self.name in runtime.tails.held_tangents
        self._tangents_held = self._tangents_held or newly_held
        if newly_held and self._remembered is not None:  # learned after the tail was kept: keep it with it
            keys, remembered = self._remembered
            for key in keys:
                plan_cache.remember_tail(key, remembered, tangents_held=True)
        tail = self._measured_tail(runtime, step_budget, compiling=self._provisional)
        if tail is None and not self._provisional and not newly_held:
            return None
        try:
            with _disable_current_modes(), _autocast_as_traced(self._autocast):
                self._compile(("step", step_budget, tail), budget, self.example_inputs, self._stand_ins())
        except BaseException:
            self._replan_failed = self._provisional
            raise
        return self._floor_note  # its garbage is collected at the region's next call

    def _replan_if_tangents_held(self, runtime: Any, step_budget: int, budget: int) -> tuple[int, str] | None:
        """After a step ended whose plan frees the incoming gradients after their last read: the plan holding them,
        if that step's backward saw one outlive it (runtime/tails.py)."""
        if self._tangents_held or self.name not in runtime.tails.held_tangents:
            return None
        try:
            return self._replan_with_measured_tail(runtime, step_budget, budget)
        except MeasurementError:
            # A profiler around this step (Inductor's plan is measured as it compiles): the running plan stays, the
            # runtime makes room for the held gradients when it calls its backward (compiled_ops.run_part), and the
            # end of the next step tries again. (The tail's own replan is made in the first step, and raises.)
            self._tangents_held = False
            return None

    def _stand_ins(self) -> list[Any]:
        """Inputs a plan made after the first call is compiled and measured on (passes/verify.py): the parameters
        themselves, a tensor of zeros (valid indices, finite values) of each other input's layout, and each integer
        input's value, with symbolic sizes at the values the plan is made at (planned_sizes.py). With only the fake
        tensors of `example_inputs`, the measurement had nothing to run, and the Inductor plan made after the first
        step (`_codegen_for`) ran as modelled: HF Llama with varying lengths (CPU stand-in, 0.6) measured 1.071x its
        budget at its longest batch."""
        inputs: list[Any] = []
        with planned_at(self._sizes.values):
            for i, value in enumerate(self.example_inputs):
                parameter = self._parameters[i]() if i in self._parameters else None
                if parameter is not None:
                    inputs.append(parameter)
                elif isinstance(value, torch.Tensor) and not value.is_sparse:
                    shape = [size_hint(size) for size in value.shape]
                    stride = [size_hint(step) for step in value.stride()]
                    with _disable_current_modes():
                        zeros = torch.empty_strided(shape, stride, dtype=value.dtype, device=value.device)
                        zeros.zero_()
                    inputs.append(zeros.requires_grad_(value.requires_grad))
                elif isinstance(value, torch.SymInt):
                    inputs.append(size_hint(value))
                else:
                    inputs.append(value)
        return inputs

    def _compile(
        self,
        key: Hashable,
        budget: Budget,
        example_inputs: Sequence[Any],
        measure_on: Sequence[Any] | None = None,
        *,
        grew: bool = False,
    ) -> None:
        """Compile the plan for `key` on `example_inputs` (after the first call: the fake tensors Dynamo traced,
        as every compile of the region), measured on `measure_on` when given (`_stand_ins`: real tensors)."""
        global _compiled_since_collection
        _compiled_since_collection = True
        tail = key[2] if key[0] == "step" and len(key) > 2 else None  # type: ignore[index]
        self._floor_note = None
        self._planned_carried = self._carried_bytes
        codegen = self._codegen_for(key, grew)
        if (
            codegen == "inductor"
            and key[0] == "step"  # type: ignore[index]
            and not self._first_step_over
            and not FREES_BACKWARD_GRADS
            and not self._first_step_measured_before()
        ):
            # The first step compiles with Inductor at once (`_tail_cannot_matter`): before any step has shown whether
            # the autograd engine holds the incoming gradients through the compiled backward (torch 2.11 does, unless
            # AOTAutograd copied one of other strides), the plan holds them, as the runtime assumes (compiled_ops.py).
            # A plan that freed them would be compiled again when the step ended (`_replan_if_tangents_held`).
            self._tangents_held = True
        try:
            # Before a step has measured the tail, a budget its assumed tail leaves no plan under is planned with the
            # least tail below, so Inductor's code of the floor plan is not compiled to name the floor (verify.py)
            unmeasured = key[0] == "step" and tail is None and not self._tail_decided  # type: ignore[index]
            self._compiled = self._compile_with(
                budget, example_inputs, tail, codegen, measure_on=measure_on, measure_floor=not unmeasured
            )
        except BudgetError as error:
            floor = error.smallest_feasible_bytes
            if key[0] != "step" or floor is None or budget is None:  # type: ignore[index]
                raise
            step_budget = key[1]  # type: ignore[index]
            held = max(0, step_budget - budget)
            least_floor = None  # the floor with the least tail, when that was tried and failed too
            if floor > step_budget and tail is None and not self._tail_decided:
                # The floor holds room for the assumed tail, which may be far more than this step's loss needs.
                # Before a step has measured it, plan with the least tail (storage.LEAST_TAIL) if that fits: the
                # step runs under the runtime, which holds its budget (evicting, or raising), measures the real
                # tail, and the next step plans with it (`_measured_tail`) or names the floor that one sets. That
                # step runs FX code where Inductor's would be compiled again when it ends (`_codegen_for`).
                least_codegen = self._codegen_for(key, grew, at_once=False)
                try:
                    self._compiled = self._compile_with(
                        budget, example_inputs, LEAST_TAIL, least_codegen, measure_on=measure_on
                    )
                except BudgetError as least:
                    least_floor = least.smallest_feasible_bytes
                else:
                    self._installed(key, least_codegen)
                    return
            # The room left in the step is too small for this region alone: plan it as tight as it goes,
            # and let the runtime evict what is live outside it.
            try:
                self._compiled = self._compile_with(floor, example_inputs, tail, codegen, measure_on=measure_on)
            except BudgetError as again:
                # The floor moved: the plan at the first floor measured above it and named its own (verify.py).
                if again.smallest_feasible_bytes is None or again.smallest_feasible_bytes <= floor:
                    raise
                floor = again.smallest_feasible_bytes
                self._compiled = self._compile_with(floor, example_inputs, tail, codegen, measure_on=measure_on)
            if floor > step_budget:
                # Not even a step holding nothing else runs this region's plan. Run it as tight as it goes under the
                # runtime, which can run its parts op by op and evict inside them (the eager DTR path: an unrolled
                # LSTM holds 0.3 of its peak that way). If the step still overruns, its BudgetError names the step's
                # floor by this plan (the region's own plus what the step holds when it begins), not the op by op
                # path's number (Runtime.note_region_floor): the bytes the runtime makes room for when it calls the
                # plan (`_footprint`), which a planner's floor scaled by a calibration (partition.py) can be below.
                # The GPU test model at 0.3 (CPU) named 60.1 MiB where the unmeasured plan's model said 64.0, and the
                # named floor did not run.
                needs = max(floor, _reserved_peak(self.reports[-1])) if self.reports else floor
                self._floor_note = (
                    needs + held,
                    f"its compiled region {self.name} alone needs {format_bytes(needs)}"
                    + (f", and the step holds {format_bytes(held)} when it begins" if held else "")
                    + _least_tail_note(least_floor, needs, held),
                )
        self._installed(key, codegen)

    def _installed(self, key: Hashable, codegen: str) -> None:
        """The plan for `key` is compiled (with `codegen`) and runs from now on. Until then the running code and
        its state stay: a compile that raised (a MeasurementError at the step's end) is tried again next call."""
        self._key = key
        if self.reports:
            running_plans.record(self.name, self.reports[-1])
        self._provisional = codegen == "fx" and self.codegen == "inductor"
        self._provisional_step = _step_id(current_step() or STEPS.here.runtime) if self._provisional else None

    def _codegen_for(self, key: Hashable, grew: bool = False, *, at_once: bool = True) -> str:
        """ "fx" for a plan only the first step under a budget runs, in a step that can have a backward, with Inductor
        asked for: the plan is made again when that step ends, for the tail it measured, and Inductor's code of it is
        measured as it compiles (`_replan_with_measured_tail`). Else the region's own.

        Not (`at_once`) where the first step compiles with Inductor at once, measured as it compiles, with no step
        running yet: when a step of an earlier process measured this region's tail at these sizes (kept under
        plan_cache.dynamo_structure: the plan is made with it, `_recall_tail`, and Inductor's own cache has the code),
        or when no tail the code after the forward may hold can change the plan (`_tail_cannot_matter`). Running the
        FX code first costs an AOTAutograd trace, a plan and an FX step: a warm process's first call took 27.5-30.0 s
        on the CPU stand-in's Llama at checkpointing's peak with it, 12.8-18.0 s without (torch.compile's own warm
        first call: 5.4 s). Where the tail can matter, guessing it costs more than measuring it: the first step of
        a language model's loop writes `cross_entropy(model(x), y)` (the logits let go: a tail of two logits' worth,
        fp32) or `out = model(x)` first (held: three), and Inductor's code of a plan for the wrong one is compiled
        again (Llama, CPU stand-in at checkpointing's peak: 106.5 s to the first call that way, 68.0 with FX first).
        Nor inside a CPU profiler session, which the measurement (a profiler session of its own) cannot run in
        (`_profiler_blocks_measuring`), nor for the least tail's plan (`at_once=False`: the assumed one left the budget
        no plan, so the tail will differ).

        Also FX code when the tail was measured before any budget was known (a fractional budget: the steps that
        calibrate it measure the tail too): the plan is made in a running step. Compiled at once with Inductor, that
        plan was never measured: HF T5 (4 x 128, CPU) at 0.6 ran Inductor's code, which holds more than the plan's
        model, as one operation the runtime made room for by the model, and the step measured 1.097x its budget.

        A region that returns only scalars (a loss computed in its own graph, as transformers computes a causal LM's
        after a graph break) has no tail to measure: the code after it holds the loss until its backward, which the
        assumed tail counts. Its first step runs Inductor's code, planned once: FX code would have run its
        cross-entropy's backward unfused, three logits-sized buffers where Inductor's code allocates one, and the
        step would have made room for those (evicting the model's saved values) and measured them as the tail of
        the region before it.

        Also for a plan made again in the middle of a step because a call brought larger sizes than the plan was made
        at (`grew`: dynamic shapes): Inductor's code compiled there could not be measured (the step is running), and
        that step ran on the model alone (HF Llama with varying lengths, CPU stand-in at 0.6: 1.071x the budget at
        the longest batch). FX code runs that step as modelled, and Inductor compiles, measured, when it has ended.
        (A region first seen inside a running step, after a graph break, keeps the FX first step: Inductor's code
        compiled there could not be measured.)"""
        first_step_plan = key[0] == "step" and len(key) > 2 and not self._first_step_over  # type: ignore[index]
        if (
            at_once
            and first_step_plan
            and not grew
            and current_step() is None
            and (
                self._first_step_measured_before()  # its plan is read from the plan cache with its measurement
                or (self._tail_cannot_matter(key[1]) and not self._profiler_blocks_measuring())  # type: ignore[index]
            )
        ):
            first_step_plan = False
        regrown = grew and key[0] == "step" and key[1] is not None and current_step() is not None  # type: ignore[index]
        if (
            self.codegen == "inductor"
            and (first_step_plan or regrown)
            and torch.is_grad_enabled()
            and self._standable_inputs()
            and not self._returns_only_scalars()
        ):
            return "fx"
        return self.codegen

    def _tail_cannot_matter(self, step_budget: int | None) -> bool:
        """Is every tail the code after the forward may hold within TAIL_TOLERANCE of the step's budget, so that no
        measurement of it plans again (`_measured_tail`)? The most a loss over the outputs holds is a cross-entropy's
        three values of their size in fp32, beside the outputs themselves (a loop may hold them or let them go): an
        image classifier's logits, not a language model's."""
        if step_budget is None:
            return False
        output = next(n for n in reversed(self.gm.graph.nodes) if n.op == "output")
        values = [n.meta.get("example_value") for n in output.all_input_nodes]
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        with planned_at(self._sizes.values):
            span = sum(
                tensor_nbytes(t) + LOSS_FP32_VALUES * tensor_nbytes(t) * max(1, 4 // t.element_size()) for t in tensors
            )
        return span <= TAIL_TOLERANCE * step_budget

    def _profiler_blocks_measuring(self) -> bool:
        """Would verify.py's measurement of Inductor's code of this region, as it compiles now, meet a CPU profiler
        session it cannot run in (verify.profiler_blocks_measuring)?"""
        on_cpu = all(v.device.type == "cpu" for v in self.example_inputs if isinstance(v, torch.Tensor))
        return on_cpu and profiler_blocks_measuring(torch.device("cpu"))

    def _first_step_measured_before(self) -> bool:
        """Did a step of an earlier process measure this region's tail at the sizes it is planned at now?"""
        key = plan_cache.tail_key(self._dynamo_structure, _sizes_key(self._sizes.values))
        return plan_cache.remembered_tail(key) is not None

    def _returns_only_scalars(self) -> bool:
        """Does the region's graph return tensors, all of one element (as Dynamo traced them), and nothing else?"""
        output = next(n for n in reversed(self.gm.graph.nodes) if n.op == "output")
        values = [n.meta.get("example_value") for n in output.all_input_nodes]
        return bool(values) and all(
            isinstance(v, torch.Tensor) and all(isinstance(d, int) and d == 1 for d in v.shape) for v in values
        )

    def _standable_inputs(self) -> bool:
        """Are the region's inputs all tensors, or sizes of them, that a stand-in can be made for (`_stand_ins`)? Only
        then is its Inductor plan compiled after the first step: a Python scalar Dynamo traced as a symbol made
        AOTAutograd ask Dynamo to restart its analysis (TensorifyScalarRestartAnalysis), which only Dynamo's own
        compile of the frame can do. A symbolic size passed on its own (Dynamo passes each dynamic size as an input)
        is stood in for at the value the plan is made at."""
        sizes = {
            size.node.expr
            for value in self.example_inputs
            if isinstance(value, torch.Tensor)
            for size in value.shape
            if isinstance(size, torch.SymInt)
        }
        return all(
            (isinstance(value, torch.Tensor) and not value.is_sparse)
            or (isinstance(value, torch.SymInt) and value.node.expr in sizes)
            for value in self.example_inputs
        )

    def _compile_with(
        self,
        budget: Budget,
        example_inputs: Sequence[Any],
        tail: Tail | None = None,
        codegen: str | None = None,
        *,
        measure_on: Sequence[Any] | None = None,
        measure_floor: bool = True,
    ) -> Callable[..., Any]:
        codegen = codegen or self.codegen
        once = codegen != self.codegen  # the first step's FX code runs once: no recompute kernels to compile for it
        with (
            config.patch(recompute_kernels="off") if once else contextlib.nullcontext(),
            planned_at(self._sizes.values),
        ):
            try:
                return self._compile_with_codegen(budget, example_inputs, tail, codegen, measure_on, measure_floor)
            except torch._dynamo.exc.RestartAnalysis:
                if self._compiled is None or codegen != "inductor":
                    raise  # the region's first compile is Dynamo's own: it restarts its analysis of the frame
                # Only Dynamo's compile of the frame can restart (a float it traced as a symbol meets a symbolic size:
                # TensorifyScalarRestartAnalysis, seen on a graph recompiled with dynamic batch sizes). Compiled
                # again outside it, the region runs FX code from now on: exact by the model, slower.
                log.warning(
                    "dtr: %s's graph can be compiled with Inductor only by TorchDynamo (it asked to restart its "
                    "analysis); its plans run as FX code from now on",
                    self.name,
                )
                self.codegen = "fx"
                return self._compile_with_codegen(budget, example_inputs, tail, "fx", None)

    def _compile_with_codegen(
        self,
        budget: Budget,
        example_inputs: Sequence[Any],
        tail: Tail | None,
        codegen: str,
        measure_on: Sequence[Any] | None = None,
        measure_floor: bool = True,
    ) -> Callable[..., Any]:
        partitioner = DTRPartitioner(
            budget,
            cost_mode=self.cost_mode,
            codegen=codegen,
            tail=tail,
            runs_once=codegen != self.codegen,
            tangents_held=self._tangents_held,
            recall_tail=self._recall_tail if tail is None and not self._tail_decided else None,
        )

        made: list[tuple[CompiledPart, PlanReport, str]] = []

        sizes = dict(self._sizes.values)  # what this plan is made at, also where AOTAutograd compiles a part later

        def wrap(graph: fx.GraphModule, phase: str) -> Callable[[Any], CompiledPart]:
            report = partitioner.reports[-1] if partitioner.reports and phase != "inference" else None
            if report is not None and (not self.reports or self.reports[-1] is not report):
                self.reports.append(report)
            with planned_at(sizes):
                finish = part_maker(graph, phase, report, self.name, tangents_held=partitioner.tangents_held)

            def finished(inner: Any) -> CompiledPart:
                part = finish(inner)
                if report is not None:
                    made.append((part, report, phase))
                return part

            return finished

        compiled = compile_region(
            self.gm,
            example_inputs,
            partitioner,
            codegen=codegen,
            wrap=wrap,
            measure_on=measure_on,
            measure_floor=measure_floor,
        )
        # verify.py may keep an earlier compile than the last (a second plan aimed higher measured over the budget):
        # the plan that runs is the partitioner's last report, and explain and running_plans must show that one, not
        # the one compiled last (HF BLOOM at 1.0, CPU: they showed "measured 8.28 MiB of 7.77" while the step ran
        # the first plan, measured 6.36 MiB).
        kept = partitioner.reports[-1] if partitioner.reports else None
        if kept is not None and self.reports and self.reports[-1] is not kept:
            earlier = [i for i, report in enumerate(self.reports) if report is kept]  # by identity: eq compares graphs
            if earlier:
                self.reports.append(self.reports.pop(earlier[-1]))
        # The parts were made before verify.py measured the region: read their footprints again, with the measurement
        # (as a plan read from the plan cache reads them). Made from the model alone, the backward of bf16 GPT-2 at
        # checkpointing's peak (CPU stand-in) was given 18.8 MiB of room where it measured 12.0, found none, and raised.
        for part, report, phase in made:
            part.footprint = _footprint(report, phase, part.footprint.example_numels)
        return compiled


def _autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """The device types autocast is on for now, with their dtypes."""
    return tuple(
        (device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda") if torch.is_autocast_enabled(device)
    )


@contextlib.contextmanager
def _autocast_as_traced(state: tuple[tuple[str, torch.dtype], ...]) -> Any:
    """Autocast as it was when Dynamo traced the region, and off elsewhere. A plan made at a step's end (after the
    backward, where users leave autocast) was traced without it: the graph of a bf16 model then ran its matmuls in
    fp32 (Inductor), or mixed bf16 activations with fp32 weights (FX code: a RuntimeError in the next step)."""
    dtypes = dict(state)
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            dtype = dtypes.get(device)
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=dtype is not None))
        yield


def _sizes_key(sizes: dict[Any, int]) -> str:
    """Symbolic sizes and their values as plain text (plan_cache.tail_key)."""
    return repr(sorted((str(symbol), value) for symbol, value in sizes.items()))


def _step_id(runtime: Any) -> tuple[int, int] | None:
    """Which step `runtime` is running (or will run next): one Runtime runs many, counted by its stats."""
    return None if runtime is None else (id(runtime), runtime.steps_ended)


def _measured_tail_planned_with(report: PlanReport) -> Tail | None:
    """The tail `report`'s plan was made with where a step measured it (this process's, or an earlier one's recalled by
    `_recall_tail`), else None (the assumed tail, or the least one)."""
    tangents = tangent_placeholders(report.joint.graph)
    if report.least_tail or not any(TAIL_META_KEY in t.meta for t in tangents):
        return None
    return report.tail


def _let_go_bytes(report: PlanReport, tail: Any) -> int:
    """Bytes of the region's outputs that `tail` says the program let go before the backward (storage.Tail)."""
    outputs = report.forward_outputs
    dropped = {outputs[p] for p in tail.dropped_outputs if p < len(outputs) and isinstance(outputs[p], fx.Node)}
    return sum(tensor_nbytes(node.meta.get("val")) for node in dropped)


def _unseen_tail_bytes(report: PlanReport) -> int:
    """The most the code after the region's forward may hold, for a step that cannot see it (compiled_ops.py): the
    plan's tail, or the assumed one where the plan was made with less (the least tail: backend/region.py), and no less
    than what a loss outside the region may hold (storage.UNSEEN_LOSS_TANGENTS)."""
    measured = _measured_tail_planned_with(report)
    if measured is not None:
        # Measured by a step (recalled from an earlier process: `_recall_tail`): the plan left room for it. Room for
        # the guess instead evicted the one value the plan saved, which only a rerun of the whole forward brings back.
        return measured.peak_bytes
    tangents = tangent_placeholders(report.joint.graph)
    gradients = tangent_bytes(tangents)
    # A loss outside the region: UNSEEN_LOSS_TANGENTS gradients' worth (above storage.default_tail's two). A region
    # that computes its loss itself: the incoming gradients alone, as default_tail has it.
    unseen = (
        UNSEEN_LOSS_TANGENTS * gradients + LOSS_TAIL_SCALAR_BYTES if loss_tail_bytes(tangents, gradients) else gradients
    )
    return max(report.tail.peak_bytes, unseen)


def part_maker(
    graph: fx.GraphModule, phase: str, report: PlanReport | None, region: str, *, tangents_held: bool = False
) -> Callable[[Any], CompiledPart]:
    """What the plan and the graph say of a forward/backward/inference part, read before it is compiled;
    returns how to make the compiled part a `CompiledPart`. `tangents_held`: the plan holds the incoming gradients
    through the backward (storage.HELD_META_KEY)."""
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    example_numels = tuple(
        int(tensor_nbytes(v) // max(v.element_size(), 1))
        for v in (n.meta.get("val") for n in placeholders)
        if isinstance(v, torch.Tensor)
    )
    footprint = _footprint(report, phase, example_numels) if report is not None else NO_FOOTPRINT
    unseen_tail = _unseen_tail_bytes(report) if report is not None and phase == "forward" else 0
    mutated = _mutated_inputs(graph, placeholders)
    # A forward's outputs can each be recomputed alone, from the region's inputs and its other outputs.
    slices = output_slices(graph) if phase != "backward" and not mutated else None
    if slices is not None and kernels_wanted(device_of([n.meta.get("val") for n in placeholders])):
        slices = with_kernels(slices)
    random = phase != "backward" and _draws_random_numbers(graph)
    estimated = _estimated_seconds(report, phase)
    # Run op by op when the part does not fit as one operation (compiled_ops.run_part): the FX code itself
    # (FX code generator), or a copy of the graph taken before Inductor's passes rewrite it. Not for a part
    # that draws random numbers: its RNG state is replayed for the part as a whole.
    fallback = None if random else _fx_copy(graph)

    def finish(inner: Any) -> CompiledPart:
        op_by_op = None if fallback is None else inner if inner is graph else fallback
        if op_by_op is fallback and phase == "forward" and _saves_in_other_layouts(inner, graph):
            op_by_op = None
        return CompiledPart(
            inner,
            name=f"{region}.{phase}",
            footprint=footprint,
            estimated_s=estimated,
            random=random,
            mutated_inputs=mutated,
            slices=slices,
            on_call=STEPS.on_backward_part if phase == "backward" else None,
            op_by_op=op_by_op,
            tail_of=(region, phase) if phase in ("forward", "backward") else None,
            tangents=[i for i, n in enumerate(placeholders) if phase == "backward" and n.name.startswith("tangents")],
            forward_outputs=report.num_fwd_outputs if report is not None and phase == "forward" else 0,
            tangents_held=tangents_held,
            unseen_tail_bytes=unseen_tail,
        )

    return finish


def _saves_in_other_layouts(compiled: Any, graph: fx.GraphModule) -> bool:
    """Does the compiled forward return a value in other strides than the graph's (Inductor's code runs a network's
    convolutions channels-last and saves their outputs so)? Its backward asserts those strides, so the forward cannot
    run op by op (eager's layouts) under the runtime: a ResNet whose forward did not fit its budget as one operation
    stopped in its backward with an AssertionError. Without the fallback the step overruns and its BudgetError names
    the budget it needs."""
    strides = getattr(compiled, "output_strides", None)  # Inductor's CompiledFxGraph, as strings
    if not isinstance(strides, (list, tuple)):
        return False
    output = next(n for n in reversed(graph.graph.nodes) if n.op == "output")
    for node, wanted in zip(output.args[0], strides, strict=False):
        value = node.meta.get("val") if isinstance(node, fx.Node) else None
        laid_out = tuple(str(stride) for stride in value.stride()) if isinstance(value, torch.Tensor) else None
        if laid_out is not None and wanted is not None and value.numel() > 1 and laid_out != tuple(map(str, wanted)):
            return True
    return False


def _fx_copy(graph: fx.GraphModule) -> fx.GraphModule:
    """A boxed FX module of `graph`'s code that shares its parameters and constants, not its nodes."""

    copied = fx.Graph()
    copied.output(copied.graph_copy(graph.graph, {}))
    return boxed_fx(fx.GraphModule(graph, copied), [])


def _reserved_peak(report: PlanReport) -> int:
    """The peak the runtime makes room for when it calls this plan's code (`_footprint`): its measurement at compile
    time, else its model."""
    measured = report.measured_peak_bytes
    return measured if measured is not None else report.planned_peak.peak_bytes


def _footprint(report: PlanReport, phase: str, example_numels: tuple[int, ...]) -> Footprint:
    """Read off the plan's modelled schedule (and its compile-time measurement): what the part leaves allocated,
    and its transient peak."""
    model = report.planned_peak
    points = [p.bytes_live for p in model.timeline if p.phase == phase]
    peak = max(points, default=0)
    # Where the compiled code was measured at compile time (verify.py), the measurement is the peak, in the phase of
    # the modelled one, and no phase reserves more. Above the model (Inductor's fused kernels, its buffers): read off
    # the model alone, the runtime made room for 2 MiB less than Llama's backward allocated at 0.3 (CPU stand-in: 58.1
    # MiB measured under a 56.2 MiB budget). Below it (Inductor reuses buffers the model counts apart): the runtime made
    # room for the model's 71.1 MiB where the plan measured 63.1, found no room under the 67.4 MiB floor that plan's
    # measurement had named, and the named floor did not run (GPU test model at 0.3, CPU and H100 alike).
    peak_phase = max(model.timeline, key=lambda p: p.bytes_live).phase if model.timeline else None
    measured = report.measured_peak_bytes
    if measured is not None:
        peak = measured if phase == peak_phase else min(peak, measured)
    saved = model.saved_bytes  # what the forward leaves alive: saved activations and outputs
    if phase == "forward":
        return Footprint(saved, max(0, peak - saved), example_numels)
    # The backward's inputs (saved activations, incoming gradients) are already held by the step, which has also
    # freed what the program dropped before the backward (a measured tail: storage.Tail). Its room above them is
    # measured where the region was (verify.RegionPeak): the model's start is not the real one.
    if report.measured_backward_room_bytes is not None:
        return Footprint(0, report.measured_backward_room_bytes, example_numels)
    return Footprint(0, max(0, peak - model.backward_start_bytes), example_numels)


def _estimated_seconds(report: PlanReport | None, phase: str) -> float | None:
    if report is None:
        return None
    tag = "is_backward" if phase == "backward" else "is_forward"
    nodes = [n for n in report.planned.graph.nodes if n.op == "call_function"]
    return sum(cost_of(n).time_s for n in nodes if n.meta.get("partitioner_tag") == tag and "dtr" in n.meta)


def _draws_random_numbers(graph: fx.GraphModule) -> bool:
    """Does the part draw from torch's generator (so that a rerun must replay its state)?"""
    from ..kernels.rng import draw_seed

    rng_prims = torch._prims.rng_prims
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in (rng_prims.run_and_save_rng_state, draw_seed) or is_random(node):
            return True
        if "inductor_seeds" in str(node.target):  # Inductor's random lowering, if it already ran
            return True
    return False


def _mutated_inputs(graph: fx.GraphModule, placeholders: list[fx.Node]) -> list[int]:
    """Positions of the inputs the graph writes in place (a BatchNorm's running statistics)."""
    position = {node: i for i, node in enumerate(placeholders)}
    mutated: set[int] = set()
    for node in graph.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
            continue
        for argument, value in zip(target._schema.arguments, node.args):
            if argument.alias_info is not None and argument.alias_info.is_write and value in position:
                mutated.add(position[value])
    return sorted(mutated)


def _least_tail_note(least_floor: int | None, floor: int, held: int) -> str:
    """What the BudgetError adds when the least tail's plan failed too: the floor it names holds room for the assumed
    loss tail (known to run); the step's real tail, measured by a step, may need less, down to the least tail's."""
    if least_floor is None or least_floor >= floor:
        return ""
    return (
        f" (that holds room for the loss's assumed tail; with the least a loss can hold between the forward and the "
        f"backward, the incoming gradients, it plans down to {least_floor + held} bytes: a budget between the two "
        f"runs a first step, which measures the loss, then either runs on or names the floor that loss sets)"
    )
