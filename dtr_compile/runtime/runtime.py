"""`Runtime`: one eager DTR session over ordinary PyTorch code, used as a context manager per step.

    rt = dtr_compile.runtime.enable(memory_budget="1GB")
    for x, y in data:
        with rt:
            loss = loss_fn(model(x), y)
            loss.backward()
        optimizer.step()
    print(rt.stats())

Inside the context every aten call goes through the runtime (dispatch.py) and every tensor autograd saves
is a handle (saved.py); the program keeps working on plain tensors, whose bytes the runtime may free and
recompute behind them (values.py). When the step ends, every tensor that outlives it is resident again and
stops being managed: what the program holds after the context is ordinary memory.

All state belongs to the Runtime object (no module globals). Reusing one Runtime across steps keeps
the output-size cache warm and lets a fractional budget calibrate once (see `_resolved_budget`).
"""

from __future__ import annotations

import gc
import math
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any, Self

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .. import auto_budget, config
from ..config import check_positive_bytes, parse_budget
from ..engine import Engine, Storage
from ..errors import BudgetError, ConfigError, DTRError, format_bytes
from .constants import ConstantRegistry
from .dispatch import DTRMode
from .handles import HandleCell, StorageIndex
from .recipe import TorchExecutor
from .recorder import TraceRecorder
from .saved import saved_tensor_hooks
from .sizes import OutputSizer
from .tails import TailMeter
from .values import buffer, held_by_program

_FROM_CONFIG: Any = object()  # default budget: dtr_compile.config.memory_budget at construction

# The Runtime whose step runs on this thread. The compiled path reads it while TorchDynamo compiles a
# region, when Dynamo has lifted the dispatch modes off the stack (so the mode stack cannot tell).
_CURRENT = threading.local()


def current_step() -> Runtime | None:
    """The Runtime whose step is running on this thread, or None."""
    runtime = getattr(_CURRENT, "runtime", None)
    return runtime if runtime is not None and runtime.active else None  # a step may end on another thread


@dataclass(frozen=True)
class RuntimeStats:
    """Counters of the last step (`peak_bytes`) and of the runtime's life (the rest)."""

    budget_bytes: int | None  # None while calibrating a fractional budget or with no budget
    peak_bytes: int  # peak the runtime accounted in the last step, above what was live at its start
    evictions: int
    eager_evictions: int  # storages freed because their last handle died
    rematerializations: int
    region_evictions: int  # of those, outputs of compiled regions (compiled_ops.py)
    region_rematerializations: int  # of those, reruns of compiled code
    kernel_rematerializations: int  # of those, as one Triton kernel (config.recompute_kernels)
    parts_op_by_op: int  # compiled parts run op by op: too big for the budget as one operation
    remat_seconds: float  # wall time spent recomputing
    search_seconds: float  # wall time spent choosing what to evict
    compute_seconds: float  # wall time of the original ops
    steps: int
    calibrating: bool

    def __str__(self) -> str:
        budget = "none" if self.budget_bytes is None else format_bytes(self.budget_bytes)
        return (
            f"DTR runtime: budget {budget}, peak {format_bytes(self.peak_bytes)}, {self.evictions} evictions "
            f"({self.region_evictions} of compiled-region outputs), {self.rematerializations} rematerializations "
            f"({self.region_rematerializations} reran compiled code, {self.kernel_rematerializations} as Triton kernels; {self.remat_seconds * 1e3:.1f} ms recompute, "
            f"{self.search_seconds * 1e3:.1f} ms eviction search, {self.compute_seconds * 1e3:.1f} ms compute), "
            f"{self.parts_op_by_op} compiled parts run op by op, {self.steps} steps"
        )


class Runtime:
    """Eager DTR over torch tensors. Enter it (`with rt:`) around a forward and backward."""

    def __init__(
        self,
        memory_budget: Any = _FROM_CONFIG,
        *,
        heuristic: str | None = None,
        reference_peak_bytes: int | None = None,
        log: str | os.PathLike | IO[str] | None = None,
    ) -> None:
        """`memory_budget`: as `dtr_compile.config.memory_budget` (the default). A fraction needs the
        step's no-remat peak: pass `reference_peak_bytes`, or the first step runs without a budget to
        measure it (with a warning) and later steps of this Runtime use the fraction of it.
        `log`: a path (".gz" compresses) or text stream to record every step as an operation log that
        `python -m dtr_compile.sim` replays offline under other budgets and heuristics."""
        budget = config.memory_budget if memory_budget is _FROM_CONFIG else parse_budget(memory_budget)
        if budget == "auto":
            auto_budget.check_available()  # on CPU: a DeviceError asking for a number
        self._auto_bytes: int | None = None  # what "auto" stood for at the last step start
        if reference_peak_bytes is not None:
            reference_peak_bytes = check_positive_bytes("reference_peak_bytes", reference_peak_bytes)
        if heuristic is not None:
            heuristic = config.validate("heuristic", heuristic)
        self.memory_budget = budget
        self.reference_peak_bytes = reference_peak_bytes
        # Op costs for the eviction policy: the roofline estimate (reproducible) or measured time.
        self.measure_costs = config.cost_mode == "measure"
        self.compute_seconds = 0.0  # wall time of the original ops (the engine's costs may be estimates)
        self.executor = TorchExecutor()
        self.engine = Engine(
            None,
            heuristic=heuristic if heuristic is not None else config.heuristic,
            candidate_sampling=config.candidate_sampling,
            min_evictable_fraction=config.min_evictable_fraction,
            min_evictable_bytes=config.min_evictable_bytes,
            thrash_limit=config.thrash_limit,
            seed=config.random_seed,
            executor=self.executor,
        )
        self.constants = ConstantRegistry(self.engine, self.pin)
        # The leaves earlier steps accumulated gradients into that no optimizer step has consumed yet, weakly
        # (`_count_carried_gradients`)
        self.carried_gradients: list[weakref.ref] = []
        self.carried_bytes = 0  # of those, what the current step counts
        self.sizes = OutputSizer()
        self.recorder = TraceRecorder(log) if log is not None else None
        if self.recorder is not None:
            weakref.finalize(self, self.recorder.close)
        self.index = StorageIndex(self.engine, self.recorder)
        self.tails = TailMeter(self.engine, self.index.viewed)  # what each region's loss and later code hold (tails.py)
        self.constants.counts_unseen_births = lambda: not self.tails.program_seen
        self._log_cells: dict[int, HandleCell] = {}  # id(tensor) -> its handle, only while recording a log
        self._mode: DTRMode | None = None
        self._froze_gc = False  # whether begin_step froze the older objects (end_step unfreezes them)
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._step_start_memory = 0
        self._steps = 0
        self._calibrating = False
        self.failed = False  # an operation of the current step raised
        # Compiled regions of this step whose planner could not fit them in the step's budget even alone, and run
        # op by op under it instead: name -> (the step's floor by the planner's plan, the sentence that says so).
        self.region_floors: dict[str, tuple[int, str]] = {}
        self.region_replans: dict[str, Callable[[], tuple[int, str] | None]] = {}
        self.on_backward: Callable[[Runtime], None] | None = None  # told when a backward pass runs in a step
        self.in_backward = False  # a backward pass has run in this step (`backward_began`)

    def close(self) -> None:
        """Finish the operation log, if one is recorded (also done when the Runtime is collected)."""
        if self.recorder is not None:
            self.recorder.close()

    # -------------------------------------------------------------------------------- the step

    @property
    def active(self) -> bool:
        return self._mode is not None

    def __enter__(self) -> Self:
        self.begin_step()
        # A step the budget cannot hold runs to its end above it, then `__exit__` raises a BudgetError naming
        # the budget it needed (a number that runs, not a bound at the first op that did not fit: issue 16).
        self.engine.overrun = True
        assert self._mode is not None and self._hooks is not None
        self._mode.__enter__()
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        mode, hooks = self._mode, self._hooks
        assert mode is not None and hooks is not None
        hooks.__exit__(*exc)
        mode.__exit__(*exc)
        try:
            self.end_step(failed=exc[0] is not None)  # its restores run under the budget, in overrun mode too
        finally:
            self.engine.overrun = False
        needed = self._overrun_bytes()
        if needed is not None and exc[0] is None:
            raise self._overrun_error(needed)

    def begin_step(self) -> None:
        """Start a step: resolve the budget and make the dispatch mode and saved-tensor hooks (the caller
        installs them: `__enter__`, or the compiled path's implicit steps)."""
        if self._mode is not None:
            raise DTRError("this dtr_compile Runtime is already active; runtimes do not nest")
        running = current_step()
        if running is not None:
            raise DTRError(
                "another dtr_compile Runtime's step is running on this thread; runtimes do not nest: one budget "
                "spans the whole step. Use one Runtime (compiled models called inside `with rt:` join its step)."
            )
        self._calibrating = False
        self.failed = False
        self.in_backward = False
        self.region_floors = {}
        self.region_replans = {}
        self.engine.overrun_need = None
        budget = self._resolved_budget()
        # The budget bounds what the step allocates above what was live when it began.
        self._step_start_memory = self.engine.memory
        self.engine.peak = self.engine.room_peak = self.engine.memory
        self.tails.begin_step(budget)
        self.engine.budget_bytes = None if budget is None else budget + self._step_start_memory
        self._count_carried_gradients(budget)
        if self.recorder is not None:
            self.recorder.begin_step()
        self._mode = DTRMode(self)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(*saved_tensor_hooks(self))
        _CURRENT.runtime = self
        # The step creates a few Python objects per op (handles, values, records), which makes the cyclic
        # garbage collector run often; its full collections would scan everything the program built before
        # (a model library's heap: hundreds of milliseconds a step). Objects older than the step are set
        # aside until it ends, so collections during the step scan only what the step made. A program that
        # froze objects itself keeps its own arrangement: unfreezing at the end would undo it.
        self._froze_gc = gc.get_freeze_count() == 0
        if self._froze_gc:
            gc.freeze()

    def end_step(self, *, failed: bool = False) -> None:
        """End the step (the mode and hooks are already removed). Everything that outlives it (outputs,
        gradients, a graph kept for later) leaves it resident and unmanaged: afterwards the program holds
        ordinary tensors, outside the next step's budget."""
        self._mode = self._hooks = None
        if self._froze_gc:
            gc.unfreeze()
            self._froze_gc = False
        if getattr(_CURRENT, "runtime", None) is self:
            _CURRENT.runtime = None
        self._steps += 1
        engine = self.engine
        if self._calibrating and not failed:
            # With the room each operation ran in: a compiled backward's transient peak is the step's peak where the
            # forward saves little (a model checkpointing its blocks itself: 3.47 MiB of storages, 17.10 measured)
            self.reference_peak_bytes = max(1, max(engine.peak, engine.room_peak) - self._step_start_memory)
        if not failed:
            self.carried_gradients.extend(self.constants.gradients)
        self.constants.gradients.clear()
        self.constants.end_step()
        engine.free_dead()
        try:
            self._restore_outliving(failed)
        except Exception:
            if not failed:
                raise
            warnings.warn("dtr_compile: after a failed step, some freed tensors could not be restored", stacklevel=3)
        engine.budget_bytes = None
        for storage in self.index.close():
            buffer(storage).detach()
            engine.release(storage, step_over=True)
        self._log_cells.clear()

    def gradients_consumed(self) -> None:
        """An optimizer step (or the program) has used the gradients earlier steps accumulated: the next step's budget
        no longer counts them (`_count_carried_gradients`)."""
        self.carried_gradients.clear()

    def _count_carried_gradients(self, budget: int | None) -> None:
        """Count against this step's budget the gradients earlier steps accumulated into that are still held, where no
        optimizer step came between (gradient accumulation: one optimizer step for several forwards and backwards).
        The budget bounds what a training step allocates, and the gradients the first micro-batch allocated are part
        of it: counted live at each later micro-batch's start, as DESIGN.md's "live when the step began", they were
        not, and a 5-layer MLP accumulating two micro-batches measured 1.12x its budget over the optimizer step's
        span (at 0.7 of its no-budget peak: tests/e2e/test_gradient_accumulation.py). Gradients zeroed in place and
        kept (`zero_grad(set_to_none=False)`) count from the first step after an optimizer step, as they did."""
        self.carried_bytes = 0
        # A leaf's gradient, as it is now: gone when the program set it to None (`zero_grad()`), whoever else holds
        # the tensor that was its gradient (a test comparing gradients across steps)
        leaves = {id(leaf): leaf for leaf in (ref() for ref in self.carried_gradients) if leaf is not None}
        leaves = {key: leaf for key, leaf in leaves.items() if leaf.grad is not None}
        self.carried_gradients = [weakref.ref(leaf) for leaf in leaves.values()]
        if budget is None or not leaves:
            return
        storages = {s.data_ptr(): s.nbytes() for s in (leaf.grad.untyped_storage() for leaf in leaves.values())}
        self.carried_bytes = sum(storages.values())
        if self.carried_bytes > 0:  # compiled regions plan for the room left (backend/region.py)
            self.constants.hold_to_end(self.carried_bytes, "accumulated gradients", make_room=False)

    def backward_began(self) -> None:
        """The step's first backward op or compiled backward part is about to run. A small tensor the program
        holds now outlives the backward: it is kept resident from here on (until it dies). Evicting it frees
        next to nothing (below the engine's smallest evictable size, it is picked only when every larger
        candidate is locked, often by a reservation that then fails), yet the step's end must restore it, and by
        then its inputs are gone: a 4-byte loss evicted in the backward took a rerun of the whole compiled
        forward at the end (1.39 MiB for a budget of 1.07 MiB, GPT-2 under bf16 autocast; issue 16)."""
        self.in_backward = True
        engine = self.engine
        threshold = engine._min_evictable_size()
        for storage in self.index.versions():
            small = storage.resident and storage.nbytes < threshold and storage.producer is not None
            if small and held_by_program(storage):
                engine.keep_resident(storage)

    def _restore_outliving(self, failed: bool) -> None:
        """Recompute the freed tensors that outlive the step (the program still holds them), as the step's last
        operations: under its budget, each kept once back so that restoring one cannot free another.

        Bringing back a 4-byte loss can rerun the whole chain behind it (a compiled forward part, with every
        output and RNG state it allocates): unbounded, that measured 1.09x the budget on a fuzz case and 1.16x
        under bf16 autocast (issue 16, class 3). A chain that does not fit raises the budget in overrun mode,
        and the step then ends with a BudgetError naming what it needed. Two cases restore unbounded, as
        before: after a failed step (nothing is promised but the restore), and where the values the program
        holds cannot fit the budget even with everything else freed (no budget could make room for them)."""
        engine = self.engine
        outliving = [s for s in self.index.versions() if s.handles > 0]
        missing = [s for s in outliving if not s.resident]
        if missing:
            # A handle may be held only by cyclic garbage, not by the program: a frame kept by an exception's
            # traceback holds its callers' frames, and the first step's compile (exceptions caught inside TorchDynamo
            # and the planner) left the compiled module's call frame, output included, in such a cycle. A
            # collection costs a few hundred milliseconds with a model library loaded; a restore reruns the chain
            # behind the tensor. (gc is no longer frozen here: end_step.)
            gc.collect()
            outliving = [s for s in self.index.versions() if s.handles > 0]
            missing = [s for s in outliving if not s.resident]
        if not missing:
            return
        for storage in outliving:
            if storage.resident and storage.producer is not None:
                engine.pin(storage)  # released with the index at the end of the step
        budget = engine.budget_bytes
        unfit = budget is not None and engine.memory - engine.pool.nbytes + sum(s.nbytes for s in missing) > budget
        if failed or unfit:
            engine.budget_bytes = None
        with _disable_current_modes():
            for storage in missing:
                if not storage.resident:  # a sibling's rerun may have brought it back
                    engine.reserve([storage], 0, "restoring a tensor that outlives the step")
                    engine.abandon([storage])
                engine.pin(storage)

    def _overrun_bytes(self) -> int | None:
        """The budget this step needed, if it ran above its own: its peak, or the most an operation that did
        not fit needed (outputs and workspace) if more."""
        engine = self.engine
        if engine.overrun_need is None:
            return None
        return max(engine.peak, engine.overrun_need) - self._step_start_memory

    def note_region_floor(self, region: str, floor_bytes: int, why: str) -> None:
        """A compiled region runs in this step although its planner's tightest plan needs `floor_bytes` of the
        step's budget (`why` says so), and runs op by op under it; if the step then overruns, its BudgetError names
        that floor (`_overrun_error`)."""
        self.region_floors[region] = (floor_bytes, why)

    def note_region_replan(self, region: str, replan: Callable[[], tuple[int, str] | None]) -> None:
        """A compiled region runs in this step with a plan made for a loss tail no step had measured (the assumed
        one, or the least one: backend/region.py). `replan()` plans it for the tail this step measures, once the
        step has ended (`replan_regions`), and returns its floor and why if that plan does not fit the budget."""
        self.region_replans[region] = replan

    def replan_regions(self, error: BudgetError | None) -> BudgetError | None:
        """After this step ended, with no step running: plan again the regions whose plan was made for an unmeasured
        tail (`note_region_replan`), for the tail the step measured. Made here, outside any step, the new plan is
        measured as it compiles (passes/verify.py): compiled by the next step's first call instead, in the middle of
        that step, it ran on its model alone, and Llama at 0.3 (CPU stand-in) measured 58.0 MiB for a budget of 56.2
        where the model said 53.1. The next step finds the plan made (a compile either way).

        `error`: this step's overrun, if it ran over its budget; where a replanned region's plan does not fit, the
        error names that plan's floor, the budget the next step runs at (GPT-2 at 45 MiB, planned with the least
        tail, named 67.2 MiB from the op by op path; the measured tail's plan runs at 46.4)."""
        replans, self.region_replans = self.region_replans, {}
        for region, replan in replans.items():
            note = replan()
            if note is not None:
                self.region_floors[region] = note
        if error is None or not self.region_floors or error.smallest_feasible_bytes is None:
            return error
        return self._overrun_error(error.smallest_feasible_bytes)

    def _overrun_error(self, needed: int, *, replanned: bool = False) -> BudgetError:
        """`replanned`: compiled regions are planned for the budget, so at another budget the step is not quite
        the same program (its regions save and recompute other values) and may need a little more.

        Where a region ran op by op because its planner's plan did not fit the budget (`note_region_floor`), the
        step's overrun is that path's number, and at that budget the step is another program: the region runs its
        plan as one compiled part, and the eager code around it evicts otherwise (a loss step needed 8 MiB op by op
        under 1 MiB, then 12 MiB under 8 MiB). The planner's floor for the region is named instead, the budget at
        which its plan runs (an H200 named 2.50 GiB from the op by op path where the plan's floor ran)."""
        budget = self.budget_bytes
        floor = max(self.region_floors.values(), default=None, key=lambda entry: entry[0])
        if floor is not None:
            return BudgetError(
                f"memory budget {format_bytes(budget)} ({budget} bytes) is below what this step needs: {floor[1]}. "
                f"Set memory_budget to at least {floor[0]} bytes{self._fraction_hint(floor[0])} (the region's plan "
                f"runs there; run op by op under this budget, the step needed {format_bytes(needed)})."
                + self._carried_note(),
                budget_bytes=budget,
                smallest_feasible_bytes=floor[0],
                is_lower_bound=False,
            )
        return BudgetError(
            f"memory budget {format_bytes(budget)} ({budget} bytes) is below what this step needs: "
            f"{self.engine.overrun_at}, and the step, finished "
            f"under the smallest budget that let each operation run, needed {format_bytes(needed)} above its start. "
            f"Set memory_budget to at least {needed} bytes{self._fraction_hint(needed)} "
            + (
                "(its compiled regions are planned anew for that budget: the step may need a little more)."
                if replanned
                else "(this step runs at that budget)."
            )
            + self._carried_note(),
            budget_bytes=budget,
            smallest_feasible_bytes=needed,
            is_lower_bound=False,
        )

    def _carried_note(self) -> str:
        """What a BudgetError adds where the step counted gradients earlier steps accumulated (`_count_carried_gradients`):
        a loop that never zeroes its gradients nor steps an optimizer (a benchmark's loop) accumulates by accident, and
        its second step needed the gradients' bytes more than its first, with nothing in the message to say why."""
        if self.carried_bytes <= 0:
            return ""
        return (
            f" {format_bytes(self.carried_bytes)} of what it needs are gradients that earlier steps accumulated into and "
            "no optimizer step has consumed yet (a training step counts from one optimizer step to the next). If they "
            "are not meant to accumulate, set them to None between steps (`model.zero_grad(set_to_none=True)`) or step "
            "the optimizer."
        )

    def _fraction_hint(self, needed: int) -> str:
        """The text ', or the fraction f' for a fractional budget (rounded up: it must cover `needed`). A need above
        the no-remat peak the fraction is of names no fraction (config takes none above 1), and says so: under
        Inductor a plan's code can hold more than the step with no budget (HF BLOOM at 0.6, CPU: its lowest plan
        measured 9.09 MiB, the no-budget step 7.77 MiB, and the error named "the fraction 1.17"; at 1.0 it ran at 6.36
        MiB, as a budget the no-budget step meets plans no recompute it cannot afford)."""
        if not isinstance(self.memory_budget, float) or not self.reference_peak_bytes:
            return ""
        fraction = math.ceil(1000 * needed / self.reference_peak_bytes) / 1000
        if fraction <= 1:
            return f", or the fraction {fraction:g}"
        return (
            f" (more than the no-remat peak the fraction is of, {format_bytes(self.reference_peak_bytes)}, so no "
            "fraction names it: the fraction 1.0 runs the step as with no budget)"
        )

    def _resolved_budget(self) -> int | None:
        budget = self.memory_budget
        if budget is None or isinstance(budget, int):
            return budget
        if budget == "auto":  # re-resolved at every step's start: it shrinks when the device has less
            self._auto_bytes = auto_budget.resolve(self._auto_bytes)
            return self._auto_bytes
        if self.reference_peak_bytes is None:
            warnings.warn(
                f"memory_budget={budget} is a fraction of the no-remat peak, which this Runtime has not seen yet: "
                "this step runs without a budget to measure it, and later steps of the same Runtime use "
                f"{budget} of it (a model compiled with backend='dtr' measures it on its first step seen whole, "
                "loss and backward included: its second, as the first begins inside the compile). Reuse the "
                "Runtime across steps, or pass reference_peak_bytes=.",
                stacklevel=4,
            )
            self._calibrating = True
            return None
        return max(1, int(budget * self.reference_peak_bytes))

    # -------------------------------------------------------------------------------- services

    def materialize(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` with its bytes resident (recomputed if the runtime freed them); returns it.

        For code that reads a tensor's memory without an aten call (`.numpy()`, a C extension) inside a step."""
        storage = self.index.lookup(tensor)
        if storage is not None and not storage.resident:
            self.ensure_resident([storage])
        return tensor

    def ensure_resident(self, storages: Iterable[Storage]) -> None:
        """Recompute the evicted `storages` (as plain ops: a recompute is not a new operation of the step)."""
        with _disable_current_modes():
            for storage in storages:
                self.engine.materialize(storage)

    def pin(self, tensor: torch.Tensor) -> None:
        """Never evict `tensor`'s storage again in this step (an accumulated gradient)."""
        storage = self.index.lookup(tensor)
        if storage is not None:
            self.engine.pin(storage)

    # -------------------------------------------------------------------------------- operation log

    def note_handle(self, tensor: torch.Tensor, cell: HandleCell) -> None:
        """Remember the handle of a tensor, to name it in the operation log."""
        self._log_cells[id(tensor)] = cell
        weakref.finalize(tensor, self._log_cells.pop, id(tensor), None)

    def cell_of(self, tensor: torch.Tensor) -> HandleCell | None:
        return self._log_cells.get(id(tensor))

    def log_name(self, tensor: torch.Tensor, storage: Storage) -> str:
        """The operation log's name of an argument: its own handle's, another handle's on the same storage,
        or the constant's."""
        cell = self._log_cells.get(id(tensor))
        if cell is not None and cell.name is not None and cell.storage is storage:
            return cell.name
        for other in buffer(storage).cells.items():
            if other.name is not None and other.storage is storage:
                return other.name
        assert self.recorder is not None
        return self.recorder.constant_name(storage)

    # -------------------------------------------------------------------------------- reporting

    @property
    def calibrating(self) -> bool:
        """This step runs without a budget to measure the no-remat peak a fractional budget refers to."""
        return self._calibrating

    @property
    def step_bytes(self) -> int:
        """Bytes the current step has allocated and still holds (0 outside a step)."""
        return self.engine.memory - self._step_start_memory if self.active else 0

    @property
    def budget_bytes(self) -> int | None:
        """The budget in bytes this Runtime applies (None: none, or a fraction not calibrated yet)."""
        budget = self.memory_budget
        if isinstance(budget, float):
            return None if self.reference_peak_bytes is None else max(1, int(budget * self.reference_peak_bytes))
        if budget == "auto":
            if self._auto_bytes is None:  # before the first step: what the device has now
                self._auto_bytes = auto_budget.resolve()
            return self._auto_bytes
        return budget

    @property
    def steps_ended(self) -> int:
        """How many steps this Runtime has run to their end (what `stats().steps` reports), cheaply."""
        return self._steps

    def stats(self) -> RuntimeStats:
        engine = self.engine
        return RuntimeStats(
            budget_bytes=None if self._calibrating else self.budget_bytes,
            peak_bytes=engine.peak - self._step_start_memory,
            evictions=engine.evictions,
            eager_evictions=engine.eager_evictions,
            rematerializations=engine.remats,
            region_evictions=self.executor.region_evictions,
            region_rematerializations=self.executor.region_remats,
            kernel_rematerializations=self.executor.kernel_remats,
            parts_op_by_op=self.executor.parts_op_by_op,
            remat_seconds=self.executor.recompute_seconds,
            search_seconds=engine.search_seconds,
            compute_seconds=self.compute_seconds,
            steps=self._steps,
            calibrating=self._calibrating,
        )


def enable(memory_budget: Any = _FROM_CONFIG, **options: Any) -> Runtime:
    """A Runtime to use as `with dtr_compile.runtime.enable(memory_budget="1GB") as rt:`.

    `memory_budget` defaults to `dtr_compile.config.memory_budget`; see `Runtime` for the options.
    """
    unknown = sorted(set(options) - {"heuristic", "reference_peak_bytes", "log"})
    if unknown:
        raise ConfigError(
            f"dtr_compile.runtime.enable() got unknown option(s) {unknown}; the options are memory_budget, "
            "heuristic, reference_peak_bytes and log (other flags: dtr_compile.config.patch(...))"
        )
    return Runtime(memory_budget, **options)
