"""The dispatch mode that routes every aten call of a step through the engine.

One generic path serves every op (no list of wrappers), on the program's own plain tensors:
  1. Arguments: a tensor an operation of this step made is a handle on an engine storage version (found by
     its torch storage); any other tensor is an outside tensor (parameter, input), a pinned constant.
  2. `engine.reserve`: evicted inputs are recomputed into their own storages, inputs locked, room made for
     the predicted fresh output bytes (and the kernel's workspace), all before the op allocates.
  3. The op runs on the arguments as given (RNG state captured first when it is random).
  4. Results are classified by torch storage: a result sharing an argument's storage is a view (0 bytes,
     same engine storage); an argument the op wrote gets a new storage *version* (the old version stays
     recomputable; the new one holds the bytes and every handle); anything else is a fresh storage.
  5. `engine.record` registers the outputs with a Recipe that can rerun the call, and every result tensor
     becomes a handle.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..engine import Storage
from .calls import flatten_call, flatten_result, op_info, written_leaves
from .recipe import OutputSource, Recipe, RngState
from .values import Buffer, TensorValue, buffer, storage_key
from .workspace import workspace_bytes

if TYPE_CHECKING:
    from .runtime import Runtime


class DTRMode(TorchDispatchMode):
    """Interposes on every aten call while a Runtime is active."""

    def __init__(self, runtime: Runtime) -> None:
        super().__init__()
        self.runtime = runtime

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # TorchDynamo keeps compiling frames while this mode is active (a mode that does not say so makes it
        # fall back to eager for the whole step), and runs what it compiled with the mode active again: the
        # "dtr" backend's regions then join the runtime as single operations (regions.py).
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        return run_call(self.runtime, func, args, kwargs or {})


def run_call(rt: Runtime, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    engine = rt.engine
    index = rt.index
    info = op_info(func)
    flat, spec = flatten_call(args, kwargs)
    leaves: list[Any] = list(flat)  # what a rerun reads: a TensorValue per tensor argument
    keys: dict[int, Storage] = {}  # torch storage key -> engine storage of an argument
    inputs: dict[int, Storage] = {}  # id -> engine storage, in first-seen order
    for i, x in enumerate(flat):
        if not isinstance(x, torch.Tensor):
            continue
        key = storage_key(x)
        storage = keys.get(key)
        if storage is None:
            storage = index.lookup(x)
            if storage is None:
                storage = rt.constants.value_of(x).storage
            keys[key] = storage
        leaves[i] = TensorValue(storage, x)
        inputs.setdefault(id(storage), storage)
    storages = list(inputs.values())

    written = written_leaves(info, args, kwargs, flat)
    facts = rt.sizes.facts(func, flat, spec, info.only_views)
    fresh_expected = facts.fresh_bytes
    for i in written:
        storage = leaves[i].storage
        if storage.producer is None:  # an outside tensor (BatchNorm's running stats) written in place
            # A recompute of an op that read the old value reads a snapshot (the old record), this run
            # writes the live tensor (a new record).
            if rt.constants.before_mutation(storage, bool(fresh_expected)) is not None:
                keys[storage_key(flat[i])] = rt.constants.value_of(flat[i]).storage

    name = info.name
    workspace = facts.workspace
    if workspace is None:
        workspace = facts.workspace = workspace_bytes(func, args, fresh_expected or 0, _device_of_call(flat))
    engine.reserve(storages, (fresh_expected or 0) + workspace, name)
    try:
        rng = RngState.capture(_device_of_call(flat)) if info.random else None
        start = time.perf_counter()
        result = func(*args, **kwargs)
        cost = facts.observe(time.perf_counter() - start)
    except BaseException:
        engine.abandon(storages)
        raise
    return _record(rt, spec, func, flat, leaves, keys, storages, written, result, cost, rng, name, workspace,
                   unpredicted=fresh_expected is None)


def _record(rt, spec, func, flat, leaves, keys, storages, written, result, cost, rng, name, workspace, unpredicted):
    engine = rt.engine
    index = rt.index
    results, result_spec = flatten_result(result)

    # New versions for the non-constant storages the op wrote (in place or through out=).
    versioned: dict[int, tuple[Storage, torch.Tensor]] = {}  # id(old storage) -> (old storage, a written arg)
    for i in written:
        storage = leaves[i].storage
        if storage.producer is not None:
            versioned.setdefault(id(storage), (storage, flat[i]))
    written_ids = {id(flat[i]) for i in written}

    sources: list[OutputSource] = []
    out_sizes: list[int] = []
    for old, _ in versioned.values():
        leaf_index = next(i for i in written if leaves[i].storage is old)
        sources.append(OutputSource("mutated", leaf_index))
        out_sizes.append(old.nbytes)
    fresh: list[tuple[int, torch.Tensor]] = []  # (torch storage key, a result on it), one per fresh storage
    fresh_keys: set[int] = set()
    for k, r in enumerate(results):
        if not isinstance(r, torch.Tensor) or id(r) in written_ids:
            continue
        key = storage_key(r)
        if key in keys or key in fresh_keys:
            continue
        fresh_keys.add(key)
        fresh.append((key, r))
        sources.append(OutputSource("fresh", k))
        out_sizes.append(r.untyped_storage().nbytes())

    recipe = Recipe(func, spec, leaves, frozenset(written), sources, rng)
    op = engine.record(name, storages, out_sizes, cost, payload=recipe, consumes=[s for s, _ in versioned.values()],
                       workspace=workspace)
    for storage in storages:
        if storage.producer is None:
            rt.constants.note_consumer(storage, op)

    outputs = op.outputs  # all alive: each holds the engine's initial handle until the end of this call
    position = 0
    for old, arg in versioned.values():
        new = outputs[position]
        position += 1
        old_buffer = buffer(old)
        new.payload = Buffer(arg.untyped_storage(), arg.device, shared=True)
        old_buffer.detach()  # the old bytes are gone: a recompute of the old version gets its own storage
        key = storage_key(arg)
        index.set_current(key, new)
        keys[key] = new
        index.move_handles(old, new)
    for key, r in fresh:
        new = outputs[position]
        position += 1
        new.payload = Buffer(r.untyped_storage(), r.device, shared=True)
        index.set_current(key, new)
        keys[key] = new

    if unpredicted:  # the op's output size could not be known in advance: restore the budget now
        engine.reserve([], 0, name)

    recorder = rt.recorder
    for r in results:
        if isinstance(r, torch.Tensor) and id(r) not in written_ids:
            storage = keys[storage_key(r)]
            if storage.producer is not None:  # views of outside tensors stay outside tensors
                cell = index.track(r, storage)
                if recorder is not None:
                    rt.note_handle(r, cell)
    if recorder is not None:
        _log_call(rt, name, flat, leaves, written, results, written_ids, fresh, outputs[len(versioned):], cost)
    for storage in outputs:
        engine.drop_handle(storage)  # the engine's initial handle: from now on only the program's handles count
    return result


def _log_call(rt, name, flat, leaves, written, results, written_ids, fresh, fresh_outputs, cost) -> None:
    """Write this call to the runtime's operation log (see recorder.py)."""
    recorder = rt.recorder
    arg_names: list[str] = []
    arg_storages: list[Storage] = []
    mutated: list[int] = []
    for i, x in enumerate(flat):
        if not isinstance(leaves[i], TensorValue):
            continue
        storage = leaves[i].storage
        if i in written and storage.producer is not None:
            mutated.append(len(arg_names))
        arg_names.append(rt.log_name(x, storage))
        arg_storages.append(storage)
    fresh_by_key = {key: out for (key, _), out in zip(fresh, fresh_outputs)}
    names, sizes, aliases = [], [], []
    logged_fresh: set[int] = set()
    for r in results:
        if not isinstance(r, torch.Tensor) or id(r) in written_ids:
            continue
        cell = rt.cell_of(r)
        if cell is None:
            continue  # a view of an outside tensor: not a handle of the log
        names.append(cell.name)
        out = fresh_by_key.get(storage_key(r))
        if out is not None and id(out) not in logged_fresh:
            logged_fresh.add(id(out))
            sizes.append(out.nbytes)
            aliases.append(-1)
            continue
        storage = cell.storage
        sizes.append(0)
        aliases.append(next((j for j, s in enumerate(arg_storages) if s is storage), -1))
    recorder.call(name, arg_names, names, sizes, aliases, mutated, cost)


def _device_of_call(flat: list[Any]) -> torch.device:
    """The device whose generator a random op draws from: its first tensor's, or its device argument."""
    for x in flat:
        if isinstance(x, torch.Tensor):
            return x.device
    for x in flat:
        if isinstance(x, torch.device):
            return x
    return torch.device("cpu")
