"""Implicit steps: `torch.compile(model, backend="dtr")` alone runs each training step under the runtime.

With a memory budget set, gradients enabled and `config.compiled_steps == "runtime"`, a call of a compiled
model outside any step starts one: the runtime's dispatch mode and saved-tensor hooks go on the stack, so the
eager code between compiled regions (graph breaks, data-dependent control flow, code Dynamo cannot trace) runs
under the same runtime as the regions, which join it as operations (compiled_ops.py). No call in the training
loop is needed, and none is needed to end a step either.

One owner of the process state. Everything a step installs on its thread (the dispatch mode, and with it
torch's Python dispatch key; the saved-tensor hooks; the gc freeze and the thread's current runtime, both in
`Runtime.begin_step`; the wrapper around `torch.autograd.backward`/`grad` that finds the end of the backward)
is installed by one `StepScope` and taken away by its `leave()`, which puts back exactly what it found. The
step finds its own end, at the first of:
  - the backward finishing: the first backward part queues a callback on the autograd engine that ends the
    runtime's step (tensors that outlive it are restored and released). The engine runs a backward on a copy of
    the thread's state and puts the original back when it returns, so the mode cannot be popped from inside
    it; the wrapped `torch.autograd.backward` leaves the scope as soon as the engine returns. A backward pass that
    keeps its graph (`retain_graph=True`: several losses of one forward, each backpropagated by a call of its own)
    does not end the step: the next pass runs under the same budget, and the step ends with the first pass that
    lets its graph go, or else at an optimizer step or at one of the points below;
  - an exception out of the compiled module's call (a BudgetError, the user's own, KeyboardInterrupt), or out
    of the backward;
  - the step's tensors all going out of scope before a backward (an exception in the loss, a forward whose
    result is dropped): the death of the last one ends the step;
  - the next compiled call, for whatever an earlier step could not take off the stack itself.
`finish_steps()` still exists, for code that wants the state back at a point of its choosing.

Where a step begins matters. TorchDynamo runs a compiled module's forward inside a guard that restores, on
return, the dispatch keys that were enabled when it was entered: a mode pushed or popped inside it gets out of
step with torch's Python dispatch key (popped inside, the key comes back with an empty mode stack and the next
eager op fails). So the first region of a step wraps the call of the compiled module it runs in
(`attach_to_calling_module`), and every later step begins and, on an exception, ends in that wrapper, outside
the guard: the whole step, loss and backward included, runs under the runtime. Only the very first step (the
one that compiles) begins inside; a scope begun outside a guard is never left from inside one.

Steps belong to their thread: each thread has its own implicit Runtime and scope. A fractional budget is
resolved per model: each compiled module (or, for a compiled function, its first region) keeps the no-remat
peak its own first whole step measured.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

import torch
import torch._dynamo.eval_frame
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import _get_current_dispatch_mode, _get_current_dispatch_mode_stack, _pop_mode

from .. import compat, config
from ..errors import BudgetError
from .backward_pass import backward_keeps_graph, in_backward_pass
from .runtime import Runtime, current_step

_PYTHON_KEYS = (torch._C.DispatchKey.Python, torch._C.DispatchKey.PythonTLSSnapshot)


_EVAL_FRAME_FILE = torch._dynamo.eval_frame.__file__
_GUARDING_FUNCTIONS = frozenset({"_fn", "compile_wrapper"})  # run a compiled frame inside a dispatch-key guard


def _inside_compiled_frame() -> bool:
    """Is a call of a TorchDynamo-compiled frame on the Python stack? Its guard restores, when it returns, the
    dispatch keys enabled when it began, so a mode pushed before it must not be popped inside it. (Dynamo's
    eval-frame callback cannot tell: it is unset while compiled code and graph-break code run.) Walks the
    stack: only on a step's rare exits, never per operation."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name in _GUARDING_FUNCTIONS and code.co_filename == _EVAL_FRAME_FILE:
            return True
        frame = frame.f_back
    return False


class StepScope:
    """Everything one implicit step installs on its thread; `leave()` restores what `enter()` found."""

    def __init__(self, steps: ThreadSteps, runtime: Runtime, owner: Any, *, outside: bool) -> None:
        self.steps = steps
        self.runtime = runtime
        self.owner = owner  # what the fractional budget refers to (a compiled module, or a region)
        self.outside = outside  # begun outside TorchDynamo's guard: the whole step is seen
        self.backward_began = False  # a backward pass that lets its graph go began: the step ends with it
        self.retained_backward = False  # a backward pass that keeps its graph ran (the step goes on)
        self.emptied = False  # the last tensor of the step died (before any backward)
        self.left = False
        self._mode: Any = None
        self._pack: Any = None
        self._depth = 0
        self._keys: tuple[bool, ...] = ()
        self._wrapped_backward = False  # this scope counts as a user of the backward wrapper
        self._buckets: Any = None  # DDP's bucket rebuild: a step that does it is no fraction's reference

    def enter(self) -> None:
        from ..distributed import BucketWatch

        runtime = self.runtime
        self._buckets = BucketWatch(self.owner, runtime)
        runtime.reference_peak_bytes = self.steps.calibrations.get(self.owner)
        self._depth = len(_get_current_dispatch_mode_stack())
        self._keys = tuple(torch._C._dispatch_tls_is_dispatch_key_included(k) for k in _PYTHON_KEYS)
        runtime.begin_step()
        # Begun inside TorchDynamo's frame, the step sees the code after the model only where the frame leaves the
        # dispatch keys as it found them (torch 2.11: compat.DYNAMO_RESTORES_DISPATCH_KEYS).
        runtime.tails.program_seen = self.outside or not compat.DYNAMO_RESTORES_DISPATCH_KEYS
        # A step the budget cannot hold runs to its end (engine overrun mode); the wrapped backward then raises a
        # BudgetError naming the budget the step needed (`ThreadSteps.budget_error`).
        runtime.engine.overrun = True
        assert runtime._mode is not None and runtime._hooks is not None
        try:
            self._mode = runtime._mode
            self._mode.__enter__()
            runtime._hooks.__enter__()
            self._pack = torch._C._autograd._top_saved_tensors_default_hooks(True)[0]
            runtime.index.on_empty = self._on_empty
            _BACKWARD_WRAPPER.install()
            self._wrapped_backward = True
        except BaseException:
            self.leave(failed=True)
            raise

    def stale(self) -> bool:
        """Can this step not continue (an operation raised, its backward ran, or nothing of it is left)?"""
        runtime = self.runtime
        return not runtime.active or runtime.failed or self.backward_began or (self.emptied and len(runtime.index) == 0)

    def over_unless_backward(self) -> bool:
        """Is this step over unless a backward pass is what runs next? After a pass that kept its graph, a compiled
        call or an optimizer step ends it: the losses of its forward have been backpropagated."""
        return self.retained_backward or self.stale()

    def end_runtime_step(self, *, failed: bool = False) -> None:
        """End the runtime's step (the mode and hooks stay, inert, until `leave`); record a calibration."""
        runtime = self.runtime
        if not runtime.active:
            return
        calibrating = runtime.calibrating
        failed = failed or runtime.failed
        runtime.index.on_empty = None
        try:
            runtime.end_step(failed=failed)  # its restores run under the budget, in overrun mode too
        finally:
            runtime.engine.overrun = False
        needed = runtime._overrun_bytes()
        if not failed:
            self.steps.ended_runtime = runtime  # its regions plan again when the backward returns
            if needed is not None:
                self.steps.budget_error = runtime._overrun_error(needed, replanned=True)
        whole = self.backward_began and (self.outside or not self.steps.attachable(self.owner))
        whole = whole and not (self._buckets is not None and self._buckets.rebuilt())  # see distributed.py
        if calibrating and not failed and whole:  # a step with its loss and backward seen: the fraction's reference
            self.steps.calibrations[self.owner] = runtime.reference_peak_bytes

    def can_leave(self) -> bool:
        """Is now a point where the scope's mode and hooks can come off this thread's stacks for good?"""
        return (
            not self.left
            and threading.get_ident() == self.steps.thread
            and not in_backward_pass()  # the engine would put them back when the pass ends
            and not (self.outside and _inside_compiled_frame())  # Dynamo's guard would restore the Python key
        )

    def leave(self, *, failed: bool = False) -> None:
        """End the step and take off the stacks what it put there (call only where `can_leave()`)."""
        if self.left:
            return
        try:
            self.end_runtime_step(failed=failed)
        finally:
            self.left = True
            if self.steps.scope is self:
                self.steps.scope = None
            self._pop()
            self._unwrap_backward()

    def abandon(self) -> None:
        """End the step where its scope cannot be left (inside Dynamo's guard): its mode and hooks, inert,
        are popped at the next point where they can be (`ThreadSteps.pop_leftovers`)."""
        if self.left:
            return
        try:
            self.end_runtime_step(failed=True)
        finally:
            self.left = True
            if self.steps.scope is self:
                self.steps.scope = None
            self.steps.leftover_modes.append(self._mode)
            self.steps.leftover_packs.append(self._pack)
            self._unwrap_backward()

    def _unwrap_backward(self) -> None:
        if self._wrapped_backward:
            self._wrapped_backward = False
            _BACKWARD_WRAPPER.uninstall()

    def _pop(self) -> None:
        top = torch._C._autograd._top_saved_tensors_default_hooks(True)
        if top is not None and top[0] is self._pack:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        else:
            self.steps.leftover_packs.append(self._pack)
        if _get_current_dispatch_mode() is self._mode:
            _pop_mode()
        elif self._mode is not None:
            self.steps.leftover_modes.append(self._mode)
        if len(_get_current_dispatch_mode_stack()) == self._depth:
            for key, included in zip(_PYTHON_KEYS, self._keys):
                torch._C._dispatch_tls_set_dispatch_key_included(key, included)

    def _on_empty(self) -> None:
        """The last tensor of the step died: before a backward, nothing of the step can be used any more."""
        if self.backward_began or in_backward_pass():
            return
        self.emptied = True
        if _get_current_dispatch_mode() is not self._mode:  # inside one of the step's own operations
            return
        if self.can_leave():
            # Never a backward: not a step a fraction can refer to (after one that kept its graph: a step that ran)
            self.leave(failed=not self.retained_backward)


class ThreadSteps:
    """One thread's implicit Runtime, its open scope, and the calibrations of fractional budgets per model."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.runtime: Runtime | None = None
        self._settings: tuple = ()
        self.scope: StepScope | None = None
        self.calibrations: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.leftover_modes: list[Any] = []  # modes of left scopes that were not on top when they left
        self.leftover_packs: list[Any] = []
        self.budget_error: BudgetError | None = None  # of a step that ran over its budget, raised by the backward
        self.ended_runtime: Runtime | None = None  # of the step that ended with the running backward

    def attachable(self, owner: Any) -> bool:
        return isinstance(owner, torch.nn.Module)

    def prospective_runtime(self) -> Runtime:
        settings = _runtime_settings()
        if self.runtime is None or (settings != self._settings and not self.running()):
            self.runtime = Runtime(config.memory_budget)
            self.runtime.on_backward = self.on_backward_part
            self._settings = settings
            self.calibrations = weakref.WeakKeyDictionary()
        return self.runtime

    def running(self) -> bool:
        return self.scope is not None and self.scope.runtime.active

    def close_stale(self) -> None:
        """Before a compiled call or an optimizer step: leave a step that cannot continue, and pop what ended steps
        left."""
        scope = self.scope
        if scope is not None and scope.over_unless_backward():
            failed = scope.stale()  # not: a step whose backward kept its graph, ending well
            if scope.can_leave():
                scope.leave(failed=failed)
            else:
                scope.end_runtime_step(failed=failed)
        self.pop_leftovers()

    def begin(self, owner: Any, *, outside: bool) -> Runtime:
        self.close_stale()
        if self.scope is not None:  # ended, but could not come off the stack here (inside Dynamo's guard)
            self.scope.abandon()
        runtime = self.prospective_runtime()
        scope = StepScope(self, runtime, owner, outside=outside)
        scope.enter()
        self.scope = scope
        return runtime

    def end(self) -> None:
        """A compiled call raised: end its step, and leave it if this is a point where it can be left."""
        scope = self.scope
        if scope is None:
            return
        if scope.can_leave():
            scope.leave(failed=True)
        else:
            scope.end_runtime_step(failed=True)

    def pop_leftovers(self) -> None:
        """Pop modes and hooks of left scopes that were not on top of the stacks when they left."""
        if not (self.leftover_modes or self.leftover_packs):
            return
        if in_backward_pass() or _inside_compiled_frame():
            return
        popped = False
        while self.leftover_modes and _get_current_dispatch_mode() in self.leftover_modes:
            self.leftover_modes.remove(_pop_mode())
            popped = True
        while self.leftover_packs:
            top = torch._C._autograd._top_saved_tensors_default_hooks(True)
            if top is None or top[0] not in self.leftover_packs:
                break
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self.leftover_packs.remove(top[0])
        if not _get_current_dispatch_mode_stack():
            self.leftover_modes.clear()
            if popped:  # an empty mode stack with the Python key on fails the next eager op
                for key in _PYTHON_KEYS:
                    torch._C._dispatch_tls_set_dispatch_key_included(key, False)

    def finish(self) -> None:
        scope = self.scope
        if scope is not None:
            scope.leave(failed=True)
        self.pop_leftovers()

    def after_backward_call(self) -> BudgetError | None:
        """`torch.autograd.backward` or `grad` returned (or raised) on this thread; returns the BudgetError of a
        step that ran over its budget and ended with this backward, for the caller to raise."""
        scope = self.scope
        if scope is not None and scope.stale() and scope.can_leave():
            scope.leave()
        if self.leftover_modes or self.leftover_packs:
            self.pop_leftovers()
        error, self.budget_error = self.budget_error, None
        runtime, self.ended_runtime = self.ended_runtime, None
        if runtime is not None and not runtime.active:  # a later step of that runtime plans in its own first call
            error = runtime.replan_regions(error)
        return error

    def on_backward_part(self, runtime: Runtime) -> None:
        """A backward pass runs inside a step (a compiled backward part, or the first op of the backward
        under the dispatch mode): end the step with that backward pass."""
        scope = self.scope
        if scope is None or runtime is not scope.runtime or scope.backward_began or not runtime.active:
            return
        if _tracing():  # a compile tracing a joint graph runs the autograd engine: not the step's backward
            return
        if backward_keeps_graph():
            # Another backward pass of the same graph is to come (another loss of the same forward): it runs in this
            # step, under its budget. Ended here, the step restored every saved value the graph keeps, and the next
            # pass ran unmanaged (a 4-block MLP at 0.5 of its peak, two backward calls: 1.24x the budget).
            scope.retained_backward = True
            return
        scope.backward_began = True
        torch.autograd.Variable._execution_engine.queue_callback(scope.end_runtime_step)


class ImplicitSteps:
    """The process's implicit steps: a `ThreadSteps` per thread, and the wrappers that begin steps."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._hooked: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # modules whose calls begin steps
        self._optimizer_hook: Any = None

    @property
    def here(self) -> ThreadSteps:
        steps = getattr(self._local, "steps", None)
        if steps is None:
            steps = self._local.steps = ThreadSteps()
        return steps

    @property
    def runtime(self) -> Runtime | None:
        return self.here.runtime

    def wanted(self) -> bool:
        """Would a compiled region called now start an implicit step?"""
        return (
            config.compiled_steps == "runtime"
            and config.memory_budget is not None
            and torch.is_grad_enabled()
            and current_step() is None
        )

    def prospective_runtime(self) -> Runtime:
        """The Runtime the next implicit step of this thread will use, following dtr_compile.config."""
        with self._lock:
            if self._optimizer_hook is None:
                # Also a safe point to pop what a step could not (see close_stale).
                self._optimizer_hook = register_optimizer_step_pre_hook(self._before_optimizer_step)
        return self.here.prospective_runtime()

    def running(self) -> bool:
        return self.here.running()

    def close_stale(self) -> None:
        self.here.close_stale()

    def begin(self, owner: Any = None) -> Runtime:
        """Begin a step from inside a compiled frame (the first call of a model)."""
        self.prospective_runtime()
        return self.here.begin(owner, outside=False)

    def end(self) -> None:
        self.here.end()

    def finish(self) -> None:
        self.here.finish()

    def on_backward_part(self, runtime: Runtime) -> None:
        # The runtime's own thread's steps, not this thread's: on CUDA the autograd engine runs a backward on
        # its device thread, whose ThreadSteps holds no scope (the step would never see its backward begin).
        if runtime.on_backward is not None:
            runtime.on_backward(runtime)

    def attach_to_calling_module(self) -> Any:
        """Find the compiled module whose forward is running (up the call stack) and make its later calls
        begin their steps outside TorchDynamo's guard; returns it, or None if the compiled code is not a
        module's."""
        from torch._dynamo.eval_frame import OptimizedModule

        frame = sys._getframe(1)
        while frame is not None:
            candidate = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
            if isinstance(candidate, OptimizedModule) or (
                isinstance(candidate, torch.nn.Module) and candidate._compiled_call_impl is not None
            ):
                with self._lock:
                    if candidate not in self._hooked:
                        _wrap_module_call(candidate, self)
                        self._hooked.add(candidate)
                return candidate
            frame = frame.f_back
        return None

    def before_module_call(self, module: torch.nn.Module) -> bool:
        """A wrapped module is called: close what is stale and begin a step if one is wanted."""
        steps = self.here
        steps.close_stale()
        if self.wanted() and steps.scope is None:
            self.prospective_runtime()
            steps.begin(module, outside=True)
            return True
        return False

    def after_failed_module_call(self, began: bool) -> None:
        steps = self.here
        scope = steps.scope
        if scope is not None and (began or scope.stale()) and scope.can_leave():
            scope.leave(failed=True)
        steps.pop_leftovers()

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.close_stale()
        runtime = self.here.runtime
        if runtime is not None:
            runtime.gradients_consumed()  # the accumulated gradients no longer count in the next step's budget


def _wrap_module_call(module: torch.nn.Module, steps: ImplicitSteps) -> None:
    """Make `module`'s calls begin (and, on an exception, end) their steps outside TorchDynamo's guard."""
    inner = module._compiled_call_impl if module._compiled_call_impl is not None else module._call_impl

    def call(*args: Any, **kwargs: Any) -> Any:
        began = steps.before_module_call(module)
        try:
            return inner(*args, **kwargs)
        except BaseException:
            steps.after_failed_module_call(began)
            raise

    module._compiled_call_impl = call


class _BackwardWrapper:
    """While an implicit step is open on any thread, `torch.autograd.backward` and `grad` tell the caller's
    thread when they return, so that a step ends with its backward pass, on the thread that ran it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._originals: dict[str, Any] = {}

    def install(self) -> None:
        with self._lock:
            self._users += 1
            if self._users > 1:
                return
            for name in ("backward", "grad"):
                original = getattr(torch.autograd, name)
                self._originals[name] = original
                setattr(torch.autograd, name, _reporting(original))

    def uninstall(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users > 0:
                return
            self._users = 0
            for name, original in self._originals.items():
                setattr(torch.autograd, name, original)
            self._originals.clear()

    def installed(self) -> bool:
        return bool(self._originals)


def _reporting(original: Any) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        returned = False
        try:
            result = original(*args, **kwargs)
            returned = True
            return result
        finally:
            if not in_backward_pass() and not _tracing():  # not a backward inside a backward
                error = STEPS.here.after_backward_call()
                if error is not None and returned:
                    raise error

    wrapped.__wrapped__ = original  # type: ignore[attr-defined]
    wrapped.__doc__ = original.__doc__
    wrapped.__name__ = original.__name__
    return wrapped


_BACKWARD_WRAPPER = _BackwardWrapper()


def _tracing() -> bool:
    """Is TorchDynamo compiling a frame on this thread? AOTAutograd traces a graph's backward by calling
    `torch.autograd.grad` on fake tensors: with a step open (a frame first seen in the middle of a step, such as
    the loss after a graph break under DDP), that call is no backward pass of the step; ending the step there
    popped the runtime's mode under Dynamo's own and left torch's Python key on over an empty mode stack."""
    return torch._guards.TracingContext.try_get() is not None


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


STEPS = ImplicitSteps()  # process-wide; the state is per thread


def finish_steps() -> None:
    """End this thread's running implicit step, if any, and take the runtime's dispatch mode and saved-tensor
    hooks off its stacks now. Steps end by themselves (see the module docstring); this is for code that wants
    the state back at a point of its choosing."""
    STEPS.finish()


def implicit_runtime() -> Runtime | None:
    """The Runtime that runs this thread's training steps of `torch.compile(backend="dtr")` models (None
    before the first one); its `stats()` count what happened across compiled regions and the code between."""
    return STEPS.runtime
