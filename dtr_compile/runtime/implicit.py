"""Implicit steps: `torch.compile(model, backend="dtr")` alone runs each training step under the runtime.

With a memory budget set, gradients enabled and `config.compiled_steps == "runtime"`, the first compiled
region called outside any step starts one: the runtime's dispatch mode and saved-tensor hooks go on the
stack, so the eager code between compiled regions (graph breaks, data-dependent control flow, code Dynamo
cannot trace) runs under the same runtime as the regions, which join it as operations (compiled_ops.py).
No call in the training loop is needed.

The step ends when the backward pass it belongs to has finished: the first backward part of a region queues
a callback on the autograd engine, which ends the step there (tensors that outlive it are restored and
released, gradients included). The autograd engine runs a backward pass on a copy of the calling thread's
state and puts the original back when it returns, so the mode and hooks cannot be taken off the stack from
inside it: they stay there, inert (an inert mode runs every op as it is; inert hooks save tensors as they
are), and are popped at the next optimizer step (a global optimizer pre-hook) or compiled call, whichever
comes first; `finish_steps()` pops them at once. A forward that raises ends its step at once.

Where a step begins matters. TorchDynamo runs a compiled module's forward inside a guard that restores, on
return, the dispatch keys that were enabled when it was entered: a mode pushed inside (by the first compiled
region) stays on the stack but stops seeing the ops that follow the module call (a loss computed outside the
model). So the first region of a step also registers a forward pre-hook on the compiled module it runs in
(`attach_to_calling_module`), and every later step begins there, before the guard: the whole step, loss and
backward included, runs under the runtime. Only the very first step (the one that compiles) begins inside.

One Runtime serves all implicit steps of the process (its output-size cache and the calibration of a
fractional budget carry over between steps); `implicit_runtime()` returns it for its statistics. A program
that runs a compiled model with gradients enabled but never calls backward keeps its step open until the
next backward; wrap such code in `torch.no_grad()`.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode

from .. import config
from .dispatch import DTRMode
from .runtime import Runtime, current_step


class ImplicitSteps:
    """The process's implicit Runtime, and the modes and hooks its steps left on the stack."""

    def __init__(self) -> None:
        self.runtime: Runtime | None = None
        self._settings: tuple = ()  # the config the Runtime was made from
        self._modes: list[DTRMode] = []  # modes our steps pushed and that may still be on the stack
        self._packs: list[object] = []  # their pack hooks
        self._end_queued = False  # this step's end is queued on the autograd engine (its backward began)
        self._hooked: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # modules whose calls begin steps

    def wanted(self) -> bool:
        """Would a compiled region called now start an implicit step?"""
        return (
            config.compiled_steps == "runtime"
            and config.memory_budget is not None
            and torch.is_grad_enabled()
            and current_step() is None
        )

    def prospective_runtime(self) -> Runtime:
        """The Runtime the next implicit step will use, following dtr_compile.config."""
        settings = _runtime_settings()
        if self.runtime is None:
            # The optimizer step that follows a backward pass is the first moment, on the training loop's
            # thread and outside any compiled frame or backward pass, to take an ended step's mode off the stack.
            register_optimizer_step_pre_hook(self._before_optimizer_step)
        if self.runtime is None or (settings != self._settings and not self.running()):
            self.runtime = Runtime(config.memory_budget)
            self.runtime.on_backward = self.on_backward_part
            self._settings = settings
        return self.runtime

    def running(self) -> bool:
        runtime = self.runtime
        return runtime is not None and runtime.active

    def close_stale(self) -> None:
        """Before a compiled forward: end a step that cannot continue (an operation of it raised, or its
        backward already ran and failed before the end of the pass), and pop what ended steps left."""
        runtime = self.runtime
        if runtime is not None and runtime.active and (runtime.failed or self._end_queued):
            runtime.end_step(failed=True)
        self.pop_inert()

    def begin(self) -> Runtime:
        self.pop_inert()
        runtime = self.prospective_runtime()
        runtime.begin_step()
        assert runtime._mode is not None and runtime._hooks is not None
        runtime._mode.__enter__()
        runtime._hooks.__enter__()
        self._modes.append(runtime._mode)
        self._packs.append(torch._C._autograd._top_saved_tensors_default_hooks(True)[0])
        self._end_queued = False
        return runtime

    def end(self) -> None:
        """End the running step now (on its thread, outside a backward pass), and pop its mode and hooks."""
        runtime = self.runtime
        if runtime is not None and runtime.active:
            runtime.end_step()
        self.pop_inert()

    def pop_inert(self) -> None:
        """Pop the modes and hooks of ended steps from the top of this thread's stacks."""
        while self._modes:
            mode = _get_current_dispatch_mode()
            if mode not in self._modes or mode.runtime._mode is mode:  # not ours, or its step still runs
                break
            _pop_mode()
            self._modes.remove(mode)
        while self._packs:
            top = torch._C._autograd._top_saved_tensors_default_hooks(True)
            if top is None or top[0] not in self._packs or self.running():
                break
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self._packs.remove(top[0])

    def attach_to_calling_module(self) -> bool:
        """Find the compiled module whose forward is running (up the call stack) and make its later calls
        begin their steps before TorchDynamo's guard; False if the compiled code is not a module's."""
        from torch._dynamo.eval_frame import OptimizedModule

        frame = sys._getframe(1)
        while frame is not None:
            candidate = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
            if isinstance(candidate, OptimizedModule):
                if candidate not in self._hooked:
                    candidate.register_forward_pre_hook(self._before_forward)
                    self._hooked.add(candidate)
                return True
            frame = frame.f_back
        return False

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.close_stale()

    def finish(self) -> None:
        """End a running step (if any) and pop every mode and hook the implicit steps left on this thread."""
        if self.running():
            self.runtime.end_step(failed=True)  # type: ignore[union-attr]
        self.pop_inert()

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        self.close_stale()
        if self.wanted():
            self.begin()

    def on_backward_part(self, runtime: Runtime) -> None:
        """A backward pass runs inside a step (a compiled backward part, or the first op of the backward
        under the dispatch mode): end the step with that backward pass."""
        if runtime is not self.runtime or self._end_queued or not runtime.active:
            return
        self._end_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        runtime = self.runtime
        if runtime is not None and runtime.active:
            runtime.end_step()  # the mode and hooks stay on the stack, inert, until `pop_inert`


def _runtime_settings() -> tuple:
    return (
        config.memory_budget,
        config.heuristic,
        config.candidate_sampling,
        config.min_evictable_fraction,
        config.min_evictable_bytes,
        config.thrash_limit,
        config.random_seed,
        config.cost_mode,
    )


STEPS = ImplicitSteps()  # process-wide, like the dispatch mode stack it manages


def finish_steps() -> None:
    """End the running implicit step, if any, and take the runtime's dispatch mode and saved-tensor hooks off
    this thread's stacks (otherwise done at the next optimizer step or compiled call): for code that trains a
    compiled model without an optimizer and then runs other code."""
    STEPS.finish()


def implicit_runtime() -> Runtime | None:
    """The Runtime that runs the training steps of `torch.compile(backend="dtr")` models (None before the
    first one); its `stats()` count what happened across compiled regions and the code between them."""
    return STEPS.runtime
