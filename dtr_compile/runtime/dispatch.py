"""The dispatch mode that routes every aten call inside `runtime.enable()` through the engine.

One generic path serves every op (no list of wrappers):
  1. Arguments: handles give their values, plain tensors become pinned constants.
  2. `engine.reserve`: evicted inputs are recomputed, inputs locked, room made for the predicted
     fresh output bytes, all before the op allocates.
  3. The op runs on plain tensors (RNG state captured first when it is random).
  4. Results are classified by storage address: a result sharing an argument's storage is a view
     (0 bytes, same engine storage); an argument the op wrote becomes a new storage *version*
     (copy-on-write in the engine's eyes: old version recomputable, new one holds the bytes, every
     handle on it re-pointed); anything else is a fresh storage.
  5. `engine.record` registers the outputs with a Recipe that can rerun the call.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..engine import Storage
from .calls import flatten_call, flatten_result, op_info, unflatten_call, unflatten_result, written_leaves
from .recipe import OutputSource, Recipe, RngState
from .tensor import DTRTensor
from .values import Buffer, TensorValue, buffer
from .workspace import workspace_bytes

if TYPE_CHECKING:
    from .runtime import Runtime

class DTRMode(TorchDispatchMode):
    """Interposes on every aten call while a Runtime is active."""

    def __init__(self, runtime: Runtime) -> None:
        super().__init__()
        self.runtime = runtime

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        return run_call(self.runtime, func, args, kwargs or {})


def run_call(rt: Runtime, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    engine = rt.engine
    info = op_info(func)
    flat, spec = flatten_call(args, kwargs)
    leaves: list[Any] = list(flat)
    inputs: dict[int, Storage] = {}  # id -> storage, in first-seen order
    for i, x in enumerate(flat):
        if isinstance(x, DTRTensor):
            value = x._cell.value
        elif isinstance(x, torch.Tensor):
            value = rt.constants.value_of(x)
        else:
            continue
        leaves[i] = value
        inputs.setdefault(id(value.storage), value.storage)
    storages = list(inputs.values())

    written = written_leaves(info, args, kwargs, flat)
    facts = rt.sizes.facts(func, flat, spec, info.only_views)
    fresh_expected = facts.fresh_bytes
    recipe_leaves = leaves
    for i in written:
        value = leaves[i]
        if value.storage.producer is None:  # an outside tensor (BatchNorm's running stats) written in place
            frozen = rt.constants.before_mutation(value.storage, bool(fresh_expected))
            if frozen is not None:  # a recompute of this op reads the value from before the write (now `value`)
                recipe_leaves = list(leaves) if recipe_leaves is leaves else recipe_leaves
                recipe_leaves[i] = value
                leaves[i] = rt.constants.value_of(flat[i])  # this run writes the live tensor

    name = info.name
    workspace = facts.workspace
    if workspace is None:
        workspace = facts.workspace = workspace_bytes(func, args, fresh_expected or 0, _device_of_call(flat))
    engine.reserve(storages, (fresh_expected or 0) + workspace, name)
    try:
        plain = [leaf.get() if isinstance(leaf, TensorValue) else leaf for leaf in leaves]
        rng = RngState.capture(_device_of_call(plain)) if info.random else None
        plain_args, plain_kwargs = unflatten_call(plain, spec)
        start = time.perf_counter()
        result = func(*plain_args, **plain_kwargs)
        cost = facts.observe(time.perf_counter() - start)
    except BaseException:
        engine.abandon(storages)
        raise
    return _record(rt, func, spec, flat, leaves, recipe_leaves, plain, storages, written, result, cost, rng, name,
                   workspace, unpredicted=fresh_expected is None)


def _record(rt, func, spec, flat, leaves, recipe_leaves, plain, storages, written, result, cost, rng, name,
            workspace, unpredicted):
    engine = rt.engine
    results, result_spec = flatten_result(result)
    address_of_input = {}  # storage address -> engine storage of an argument
    for leaf, p in zip(leaves, plain):
        if isinstance(leaf, TensorValue) and p.untyped_storage().nbytes() > 0:
            address_of_input.setdefault(p.untyped_storage().data_ptr(), leaf.storage)

    # New versions for the non-constant storages the op wrote (in place or through out=).
    versioned: dict[int, Storage] = {}  # id(old storage) -> old storage, in order
    for i in written:
        storage = leaves[i].storage
        if storage.producer is not None:
            versioned.setdefault(id(storage), storage)
    written_by_object = {id(plain[i]): i for i in written}

    sources: list[OutputSource] = []
    out_sizes: list[int] = []
    for old in versioned.values():
        leaf_index = next(i for i in written if leaves[i].storage is old)
        sources.append(OutputSource("mutated", leaf_index))
        out_sizes.append(old.nbytes)
    fresh_position: dict[int, int] = {}  # result index -> position among the engine outputs
    position_of_address: dict[int, int] = {}  # so results sharing one fresh storage share one record
    fresh_untyped: list[torch.UntypedStorage] = []
    for k, r in enumerate(results):
        if not isinstance(r, torch.Tensor) or id(r) in written_by_object:
            continue
        untyped = r.untyped_storage()
        address = untyped.data_ptr() if untyped.nbytes() > 0 else None
        if address is not None and address in address_of_input:
            continue
        if address is not None and address in position_of_address:
            fresh_position[k] = position_of_address[address]
            continue
        fresh_position[k] = len(out_sizes)
        if address is not None:
            position_of_address[address] = len(out_sizes)
        sources.append(OutputSource("fresh", k))
        out_sizes.append(untyped.nbytes())
        fresh_untyped.append(untyped)

    recipe = Recipe(func, spec, recipe_leaves, frozenset(written), sources, rng)
    op = engine.record(name, storages, out_sizes, cost, payload=recipe, consumes=list(versioned.values()),
                       workspace=workspace)
    for storage in storages:
        if storage.producer is None:
            rt.constants.note_consumer(storage, op)

    new_version: dict[int, Storage] = {}
    op_outputs = op.outputs  # all alive: each holds the engine's initial handle until the end of this call
    outputs = iter(op_outputs)
    for old in versioned.values():
        new = next(outputs)
        new_version[id(old)] = new
        _move_handles(engine, old, new)
    for untyped in fresh_untyped:
        next(outputs).payload = Buffer(untyped, untyped.device)

    if unpredicted:  # the op's output size could not be known in advance: restore the budget now
        engine.reserve([], 0, name)

    def wrap(k: int, r: Any) -> Any:
        if not isinstance(r, torch.Tensor):
            return r
        if id(r) in written_by_object:  # in-place / out=: hand back the caller's own tensor object
            return flat[written_by_object[id(r)]]
        if k in fresh_position:
            storage = op_outputs[fresh_position[k]]
        else:
            storage = address_of_input[r.untyped_storage().data_ptr()]
            storage = new_version.get(id(storage), storage)
        return DTRTensor(TensorValue(storage, r), rt)

    wrapped = [wrap(k, r) for k, r in enumerate(results)]
    if rt.recorder is not None:
        _log_call(rt, name, flat, leaves, written, results, wrapped, fresh_position, op_outputs, cost)
    for storage in op_outputs:
        engine.drop_handle(storage)  # the engine's initial handle: from now on only DTRTensors count
    return unflatten_result(wrapped, result_spec)


def _log_call(rt, name, flat, leaves, written, results, wrapped, fresh_position, op_outputs, cost) -> None:
    """Write this call to the runtime's operation log (see recorder.py)."""
    recorder = rt.recorder
    arg_names: list[str] = []
    arg_storages: list[Storage] = []
    mutated: list[int] = []
    for i, x in enumerate(flat):
        if not isinstance(leaves[i], TensorValue):
            continue
        if i in written and leaves[i].storage.producer is not None:
            mutated.append(len(arg_names))
        if isinstance(x, DTRTensor):
            arg_names.append(x._cell.name)
        else:
            arg_names.append(recorder.constant_name(leaves[i].storage))
        arg_storages.append(leaves[i].storage)
    names, sizes, aliases = [], [], []
    seen_fresh: set[int] = set()
    for k, w in enumerate(wrapped):
        if not isinstance(w, DTRTensor) or any(w is flat[i] for i in written):
            continue
        names.append(w._cell.name)
        if k in fresh_position and fresh_position[k] not in seen_fresh:
            seen_fresh.add(fresh_position[k])
            sizes.append(op_outputs[fresh_position[k]].nbytes)
            aliases.append(-1)
            continue
        storage = w._cell.value.storage
        alias = next((j for j, s in enumerate(arg_storages) if s is storage), -1)
        sizes.append(0)
        aliases.append(alias)
    recorder.call(name, arg_names, names, sizes, aliases, mutated, cost)


def _move_handles(engine, old: Storage, new: Storage) -> None:
    """After `old` was written in place: its bytes are now `new`'s and every handle points at `new`."""
    old_buffer = buffer(old)
    new.payload = Buffer(old_buffer.untyped, old_buffer.device)
    old_buffer.drop()  # cached views of the old version would now show the new contents
    for cell in old_buffer.cells.items():
        cell.value = cell.value.retarget(new)
        buffer(new).cells.add(cell)
        engine.add_handle(new)
        engine.drop_handle(old)
    old_buffer.cells.clear()


def _device_of_call(plain: list[Any]) -> torch.device:
    """The device whose generator a random op draws from: its first tensor's, or its device argument."""
    for x in plain:
        if isinstance(x, torch.Tensor):
            return x.device
    for x in plain:
        if isinstance(x, torch.device):
            return x
    return torch.device("cpu")
