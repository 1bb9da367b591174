"""`Runtime`: one eager DTR session over ordinary PyTorch code, used as a context manager per step.

    rt = dtr_compile.runtime.enable(memory_budget="1GB")
    for x, y in data:
        with rt:
            loss = loss_fn(model(x), y)
            loss.backward()
        optimizer.step()
    print(rt.stats())

All state belongs to the Runtime object (no module globals). Reusing one Runtime across steps keeps
the output-size cache warm and lets a fractional budget calibrate once (see `__enter__`).
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any, Self

import torch

from .. import config
from ..config import parse_budget
from ..engine import Engine
from ..errors import ConfigError, DTRError, format_bytes
from .constants import ConstantRegistry
from .dispatch import DTRMode
from .recipe import TorchExecutor
from .recorder import TraceRecorder
from .sizes import OutputSizer
from .tensor import DTRTensor, HandleCell
from .values import TensorValue

_FROM_CONFIG: Any = object()  # default budget: dtr_compile.config.memory_budget at construction


@dataclass(frozen=True)
class RuntimeStats:
    """Counters of the last step (`peak_bytes`) and of the runtime's life (the rest)."""

    budget_bytes: int | None  # None while calibrating a fractional budget or with no budget
    peak_bytes: int  # peak the runtime accounted in the last step, above what was live at its start
    evictions: int
    eager_evictions: int  # storages freed because their last handle died
    rematerializations: int
    remat_seconds: float  # wall time spent recomputing
    search_seconds: float  # wall time spent choosing what to evict
    compute_seconds: float  # wall time of the original ops
    steps: int
    calibrating: bool

    def __str__(self) -> str:
        budget = "none" if self.budget_bytes is None else format_bytes(self.budget_bytes)
        return (
            f"DTR runtime: budget {budget}, peak {format_bytes(self.peak_bytes)}, {self.evictions} evictions, "
            f"{self.rematerializations} rematerializations ({self.remat_seconds * 1e3:.1f} ms recompute, "
            f"{self.search_seconds * 1e3:.1f} ms eviction search, {self.compute_seconds * 1e3:.1f} ms compute), "
            f"{self.steps} steps"
        )


class Runtime:
    """Eager DTR over torch tensors. Enter it (`with rt:`) around a forward and backward."""

    def __init__(
        self,
        memory_budget: Any = _FROM_CONFIG,
        *,
        heuristic: str | None = None,
        reference_peak_bytes: int | None = None,
        device: str | torch.device = "cpu",
        log: str | os.PathLike | IO[str] | None = None,
    ) -> None:
        """`memory_budget`: as `dtr_compile.config.memory_budget` (the default). A fraction needs the
        step's no-remat peak: pass `reference_peak_bytes`, or the first step runs without a budget to
        measure it (with a warning) and later steps of this Runtime use the fraction of it.
        `log`: a path (".gz" compresses) or text stream to record every step as an operation log that
        `python -m dtr_compile.sim` replays offline under other budgets and heuristics."""
        budget = config.memory_budget if memory_budget is _FROM_CONFIG else parse_budget(memory_budget)
        if reference_peak_bytes is not None and (not isinstance(reference_peak_bytes, int) or reference_peak_bytes <= 0):
            raise ConfigError(f"reference_peak_bytes={reference_peak_bytes!r}; expected a positive int")
        self.memory_budget = budget
        self.reference_peak_bytes = reference_peak_bytes
        self.device = torch.device(device)
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
        self.constants = ConstantRegistry(self.engine)
        self.sizes = OutputSizer()
        self._mode: DTRMode | None = None
        self._step_start_memory = 0
        self._steps = 0
        self._calibrating = False
        self.recorder = TraceRecorder(log) if log is not None else None
        if self.recorder is not None:
            weakref.finalize(self, self.recorder.close)

    def close(self) -> None:
        """Finish the operation log, if one is recorded (also done when the Runtime is collected)."""
        if self.recorder is not None:
            self.recorder.close()

    # -------------------------------------------------------------------------------- context

    def __enter__(self) -> Self:
        if self._mode is not None:
            raise DTRError("this dtr_compile Runtime is already active; runtimes do not nest")
        self._calibrating = False
        budget = self._resolved_budget()
        # The budget bounds what the step allocates above what was live when it began.
        self._step_start_memory = self.engine.memory
        self.engine.peak = self.engine.memory
        self.engine.budget_bytes = None if budget is None else budget + self._step_start_memory
        if self.recorder is not None:
            self.recorder.begin_step()
        self._mode = DTRMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        mode, self._mode = self._mode, None
        assert mode is not None
        mode.__exit__(*exc)
        self.constants.end_step()
        self.engine.free_dead()
        self._steps += 1
        if exc[0] is not None:
            return  # leave gradients as handles: materializing them could raise again and hide the error
        if self._calibrating:
            self.reference_peak_bytes = max(1, self.engine.peak - self._step_start_memory)
        self._release_gradients()

    def _resolved_budget(self) -> int | None:
        budget = self.memory_budget
        if budget is None or isinstance(budget, int):
            return budget
        if self.reference_peak_bytes is None:
            warnings.warn(
                f"memory_budget={budget} is a fraction of the no-remat peak, which this Runtime has not seen yet: "
                "this step runs without a budget to measure it, and later steps of the same Runtime use "
                f"{budget} of it. Reuse the Runtime across steps, or pass reference_peak_bytes=.",
                stacklevel=3,
            )
            self._calibrating = True
            return None
        return max(1, int(budget * self.reference_peak_bytes))

    def _release_gradients(self) -> None:
        """Gradients leave the context as plain tensors (they outlive the step and its budget)."""
        for tensor in self.constants.live_tensors():
            grad = tensor.grad
            if isinstance(grad, DTRTensor):
                tensor.grad = grad.materialize()
                # Its bytes now belong to the user (live at the next step's start, so outside its budget).
                self.engine.release(grad._cell.value.storage)

    # -------------------------------------------------------------------------------- services

    def materialize(self, value: TensorValue) -> torch.Tensor:
        """The plain tensor of `value`, recomputing its storage if it was evicted."""
        self.engine.materialize(value.storage)
        return value.get()

    def death_callback(self, cell: HandleCell) -> Callable[[object], None]:
        """The weakref callback that reports the death of the handle holding `cell`."""

        def on_death(_ref: object) -> None:
            cell.death = None  # break the cell -> ref -> callback -> cell cycle
            self.on_handle_death(cell)

        return on_death

    def on_handle_death(self, cell: HandleCell) -> None:
        self.engine.drop_handle(cell.value.storage)
        if self.recorder is not None and cell.name is not None:
            self.recorder.release(cell.name)

    def device_of(self, value: TensorValue) -> torch.device:
        payload = value.storage.payload
        return payload.device if payload is not None else self.device

    # -------------------------------------------------------------------------------- reporting

    @property
    def budget_bytes(self) -> int | None:
        """The budget in bytes this Runtime applies (None: none, or a fraction not calibrated yet)."""
        budget = self.memory_budget
        if isinstance(budget, float):
            return None if self.reference_peak_bytes is None else max(1, int(budget * self.reference_peak_bytes))
        return budget

    def stats(self) -> RuntimeStats:
        engine = self.engine
        return RuntimeStats(
            budget_bytes=None if self._calibrating else self.budget_bytes,
            peak_bytes=engine.peak - self._step_start_memory,
            evictions=engine.evictions,
            eager_evictions=engine.eager_evictions,
            rematerializations=engine.remats,
            remat_seconds=self.executor.recompute_seconds,
            search_seconds=engine.search_seconds,
            compute_seconds=engine.compute_cost,
            steps=self._steps,
            calibrating=self._calibrating,
        )


def enable(memory_budget: Any = _FROM_CONFIG, **options: Any) -> Runtime:
    """A Runtime to use as `with dtr_compile.runtime.enable(memory_budget="1GB") as rt:`.

    `memory_budget` defaults to `dtr_compile.config.memory_budget`; see `Runtime` for the options.
    """
    return Runtime(memory_budget, **options)
