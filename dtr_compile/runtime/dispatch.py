"""The dispatch mode that routes every aten call of a step through the engine.

One generic path serves every op (no list of wrappers), on the program's own plain tensors:
  1. Arguments become engine storages: handles of this step, or pinned outside tensors (operations.py).
  2. `engine.reserve`: evicted inputs are recomputed into their own storages, inputs locked, room made for
     the predicted fresh output bytes (and the kernel's workspace), all before the op allocates.
  3. The op runs on the arguments as given (RNG state captured first when it is random).
  4. `record_outputs` registers the results (fresh storages, views, new versions of written arguments)
     with a Recipe that can rerun the call, and every result tensor becomes a handle.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
from torch._C import DispatchKey
from torch._prims import rng_prims
from torch.utils._python_dispatch import TorchDispatchMode

from .. import matmul_scratch
from ..roofline import estimate_call
from .accumulate import accumulation_target, add_in_place, calibrate
from .backward_pass import in_backward_pass
from .calls import flatten_call, flatten_result, op_info, written_leaves
from .interface import RuntimeInterface
from .operations import Inputs, record_outputs
from .recipe import Recipe, RngState
from .rng_memory import hold_rng_state
from .values import storage_key
from .workspace import workspace_bytes


class DTRMode(TorchDispatchMode):
    """Interposes on every aten call while a Runtime is active."""

    def __init__(self, runtime: RuntimeInterface) -> None:
        super().__init__()
        self.runtime = runtime
        calibrate()  # once a process, at a step's start: backward sums in place (accumulate.py)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # PyTorch would wrap every __torch_dispatch__ call in torch._dynamo.disable (microseconds per op);
        # the whole runtime package is on Dynamo's skip list instead (runtime/__init__.py).
        return False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # TorchDynamo keeps compiling frames while this mode is active (a mode that does not say so makes it
        # fall back to eager for the whole step), and runs what it compiled with the mode active again: the
        # "dtr" backend's regions then join the runtime as single operations (backend/region.py).
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        runtime = self.runtime
        if runtime._mode is not self:  # its step has ended; left on a stack it could not be popped from
            return func(*args, **(kwargs or {}))
        if func in _ALIAS_OPS and runtime.recorder is None:
            return _alias(runtime, func, args, kwargs or {})
        if in_backward_pass():
            if not runtime.in_backward:
                runtime.backward_began()
            if runtime.on_backward is not None:
                runtime.on_backward(runtime)  # the first op of a backward pass (an implicit step ends with it)
            if func is _ADD_IN_PLACE and runtime.recorder is None and _sums_into_outside(runtime, args, kwargs):
                return func(*args, **(kwargs or {}))
        try:
            return run_call(runtime, func, args, kwargs or {})
        except BaseException:
            runtime.failed = True
            raise


# The RNG wrappers the compiled path puts around recomputed random ops (passes/rewrite.py) are higher-order ops:
# where compiled code runs op by op under the mode (a part that does not fit as one operation: compiled_ops.py),
# torch hands them to the mode on top of the stack, which needs a rule for each (torch raises otherwise, on every
# supported release). The rule runs the wrapper's own device kernel (save the generator state or set it, run
# the op, restore it) with the mode back on the stack, so the wrapped op is a random operation of the runtime
# like any other: its recipe captures the generator state the wrapper set, and a recompute replays it.
def _wrapper_under_mode(hop: Any, mode: DTRMode, *args: Any, **kwargs: Any) -> Any:
    with mode:
        if hop is rng_prims.run_with_rng_state:
            # The wrapper hands its state to the generator directly (no aten op the mode sees), and the state
            # is a storage of the step that may be evicted: a copy through the mode makes it resident first.
            args = (args[0].clone(), *args[1:])
        return hop.py_kernels[DispatchKey.BackendSelect](*args, **kwargs)


for _hop in (rng_prims.run_and_save_rng_state, rng_prims.run_with_rng_state):
    if DTRMode not in _hop.python_key_table:  # registered once per process (py_impl refuses a second rule)
        _hop.py_impl(DTRMode)(functools.partial(_wrapper_under_mode, _hop))


# Ops that return a new tensor on their argument's storage and touch no data. AOTAutograd and the autograd
# engine call `detach` several times per saved activation and per gradient (over 300 times a step on a small
# transformer with a graph break per block), so they take a short path: no room to make, no recipe (an alias
# shares its storage, which a rematerialization refills in place), only a handle on the storage. An operation
# log records every call, so with a recorder they take the generic path.
_ALIAS_OPS = frozenset({torch.ops.aten.detach.default, torch.ops.aten.alias.default})


# A backward summing a parameter's gradient into its `.grad` (a loop that does not set gradients to None between
# steps: the autograd engine adds in place, once per parameter per step). It writes only an outside tensor and
# allocates nothing, so the generic path would record nothing and make no room: it only spent 50-100 us a call on
# finding that out (about 10 ms a step for a 100-parameter model on CPU).
_ADD_IN_PLACE = torch.ops.aten.add_.Tensor


def _sums_into_outside(rt: RuntimeInterface, args: tuple, kwargs: dict | None) -> bool:
    """May `add_(target, gradient)` run with no bookkeeping? Its target is an outside tensor whose old value no
    recorded op may need (so no snapshot), and its other tensor argument, if of this step, is resident."""
    if kwargs and kwargs.keys() - {"alpha"}:
        return False
    if len(args) != 2 or not isinstance(args[0], torch.Tensor):
        return False
    target, other = args
    index = rt.index
    key = storage_key(target)
    if index.lookup_key(key) is not None or not rt.constants.mutation_needs_no_record(key):
        return False
    if isinstance(other, torch.Tensor):
        storage = index.lookup(other)
        if storage is not None and not storage.resident:
            return False
    return True


def _alias(rt: RuntimeInterface, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    result = func(*args, **kwargs)
    storage = rt.index.lookup(args[0])
    if storage is not None and storage.producer is not None:  # aliases of outside tensors stay outside
        rt.index.track(result, storage)
    return result


def run_call(rt: RuntimeInterface, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    engine = rt.engine
    info = op_info(func)
    flat, spec = flatten_call(args, kwargs)
    inputs = Inputs(rt, flat)
    written = written_leaves(info, args, kwargs, flat)
    facts = rt.sizes.facts(func, flat, spec, info.only_views)
    fresh_expected = facts.fresh_bytes
    if written:
        inputs.before_writes(rt, flat, written, bool(fresh_expected))

    name = info.name
    workspace = facts.workspace
    if workspace is None:
        workspace = workspace_bytes(func, args, fresh_expected or 0, _device_of_call(flat))
        if matmul_scratch.known(func, args):  # a bound that stood in for an unmeasured scratch is asked again
            facts.workspace = workspace
    storages = inputs.storages
    # A backward's sum of two gradients into the first one's bytes, as autograd does without a mode: no new room.
    summed_into = accumulation_target(func, args, kwargs, inputs.leaves, recording=rt.recorder is not None)
    engine.reserve(storages, (0 if summed_into is not None else fresh_expected or 0) + workspace, name)
    try:
        rng = RngState.capture(_device_of_call(flat), _generator_of(flat)) if info.random else None
        hold_rng_state(rt, rng)  # its bytes count against the budget (room made in workspace_bytes)
        start = time.perf_counter()
        result = func(*args, **kwargs) if summed_into is None else add_in_place(args, kwargs)
        elapsed = time.perf_counter() - start
        rt.compute_seconds += elapsed
        cost = facts.observe(elapsed, lambda: estimate_call(func, args, kwargs, result), rt.measure_costs)
    except BaseException:
        engine.abandon(storages)
        raise
    results, _ = flatten_result(result)
    record_outputs(rt, name, flat, inputs, written, results, cost, workspace,
                   lambda sources: Recipe(func, spec, inputs.leaves, frozenset(written), sources, rng),
                   unpredicted=fresh_expected is None, consumed=() if summed_into is None else (summed_into,))
    return result


def _generator_of(flat: list[Any]) -> torch.Generator | None:
    """The generator a random op was given (`generator=`), if any."""
    for x in flat:
        if isinstance(x, torch.Generator):
            return x
    return None


def _device_of_call(flat: list[Any]) -> torch.device:
    """The device whose generator a random op draws from: its first tensor's, or its device argument."""
    for x in flat:
        if isinstance(x, torch.Tensor):
            return x.device
    for x in flat:
        if isinstance(x, torch.device):
            return x
    return torch.device("cpu")
