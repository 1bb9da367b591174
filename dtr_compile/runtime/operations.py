"""An operation of a step as the engine sees it: the storages it reads, and what it produced.

Shared by the two kinds of operations of a step: aten calls (dispatch.py) and compiled parts of a region
(compiled_ops.py).
- Inputs: a tensor an operation of this step made is a handle on an engine storage version (found by its
  torch storage); any other tensor is an outside tensor (parameter, input), a pinned constant.
- Outputs are classified by torch storage: a result sharing an argument's storage is a view (0 bytes,
  same engine storage); an argument the op wrote gets a new storage *version* (the old version stays
  recomputable; the new one holds the bytes and every handle); anything else is a fresh storage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..compat import uses_storage_swap
from ..engine import Storage
from .backward_pass import in_backward_pass
from .interface import RuntimeInterface
from .recipe import OutputSource
from .refill import copy_refill_bytes
from .values import Buffer, Layout, TensorValue, buffer, storage_key


class Inputs:
    """The tensor arguments of one call: what a rerun reads, and the engine storages to lock."""

    __slots__ = ("keys", "leaves", "storages")

    def __init__(self, rt: RuntimeInterface, flat: Sequence[Any]) -> None:
        leaves: list[Any] = list(flat)  # a TensorValue per tensor argument, the argument itself otherwise
        keys: dict[int, Storage] = {}  # torch storage key -> engine storage of an argument
        inputs: dict[int, Storage] = {}  # id -> engine storage, in first-seen order
        index, constants = rt.index, rt.constants
        for i, x in enumerate(flat):
            if not isinstance(x, torch.Tensor):
                continue
            key = storage_key(x)  # once per argument: a compiled part has a few hundred
            storage = keys.get(key) or index.lookup_key(key)
            if storage is None:
                value = constants.value_of(x, key)  # the registry's value of an outside tensor, the one leaf it needs
                storage = value.storage
            else:
                value = TensorValue(storage, x)
            keys[key] = storage
            leaves[i] = value
            inputs.setdefault(id(storage), storage)
        self.leaves = leaves
        self.keys = keys
        self.storages = list(inputs.values())

    def before_writes(
        self, rt: RuntimeInterface, flat: Sequence[Any], written: Sequence[int], fresh_outputs: bool
    ) -> None:
        """Outside tensors the op writes in place (BatchNorm's running statistics): a recompute of an op that
        read the old value reads a snapshot (the old record), this run writes the live tensor (a new record)."""
        for i in written:
            storage = self.leaves[i].storage
            if storage.producer is None and rt.constants.before_mutation(storage, fresh_outputs) is not None:
                self.keys[storage_key(flat[i])] = rt.constants.value_of(flat[i]).storage


def record_outputs(
    rt: RuntimeInterface,
    name: str,
    flat: Sequence[Any],
    inputs: Inputs,
    written: Sequence[int],
    results: Sequence[Any],
    cost: float,
    workspace: int,
    make_recipe: Callable[[list[OutputSource]], Any],
    *,
    unpredicted: bool = False,
    consumed: Sequence[Storage] = (),
) -> None:
    """After an operation ran on `flat` (`written`: the indices of the arguments it wrote): record it in the
    engine with the recipe `make_recipe(sources)` and make every result tensor a handle. `consumed`: inputs
    whose bytes the operation freed (they become evicted, recomputable from their producers)."""
    engine = rt.engine
    index = rt.index
    leaves, keys, storages = inputs.leaves, inputs.keys, inputs.storages

    # New versions for the non-constant storages the op wrote (in place or through out=).
    versioned: dict[int, tuple[Storage, torch.Tensor]] = {}  # id(old storage) -> (old storage, a written arg)
    for i in written:
        storage = leaves[i].storage
        if storage.producer is not None:
            versioned.setdefault(id(storage), (storage, flat[i]))
    written_ids = {id(flat[i]) for i in written} if written else ()

    sources: list[OutputSource] = []
    out_sizes: list[int] = []
    for old, _ in versioned.values():
        leaf_index = next(i for i in written if leaves[i].storage is old)
        sources.append(OutputSource("mutated", leaf_index))
        out_sizes.append(old.nbytes)
    fresh: list[tuple[int, torch.Tensor]] = []  # (torch storage key, a result on it), one per fresh storage
    fresh_keys: set[int] = set()
    result_keys: list[int | None] = []  # torch storage key of each result (None: not a handle to make)
    for k, r in enumerate(results):
        if not isinstance(r, torch.Tensor) or id(r) in written_ids:
            result_keys.append(None)
            continue
        untyped = r.untyped_storage()
        key = untyped._cdata
        result_keys.append(key)
        if key in keys or key in fresh_keys:
            continue
        fresh_keys.add(key)
        fresh.append((key, r))
        sources.append(OutputSource("fresh", k, None if uses_storage_swap() else Layout(r)))
        out_sizes.append(untyped.nbytes())

    if not sources and not consumed and rt.recorder is None and not _any_handle_to_make(result_keys, keys):
        # It only wrote outside tensors (a backward accumulating each parameter's gradient into `.grad`): with no
        # output, nothing can ever need it rerun, so no record is kept.
        engine.record_nothing(storages, cost)
        if unpredicted:
            engine.reserve([], 0, name)
        return
    recipe = make_recipe(sources)
    if fresh and not uses_storage_swap():  # a refill that copies needs room for the copy (runtime/refill.py)
        workspace = max(workspace, copy_refill_bytes(recipe, out_sizes, fresh[0][1].device))
    op = engine.record(name, storages, out_sizes, cost, payload=recipe,
                       consumes=[*(s for s, _ in versioned.values()), *consumed], workspace=workspace)
    in_backward = in_backward_pass()
    rt.constants.note_readers(op, in_backward=in_backward)

    outputs = op.outputs  # all alive: each holds the engine's initial handle until the end of this call
    position = 0
    for old, arg in versioned.values():
        new = outputs[position]
        position += 1
        new.payload = Buffer(arg.untyped_storage(), arg.device, shared=True)
        buffer(old).detach()  # the old bytes are gone: a recompute of the old version gets its own storage
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
    for r, key in zip(results, result_keys):
        if key is not None:
            storage = keys[key]
            if storage.producer is not None:  # views of outside tensors stay outside tensors
                cell = index.track(r, storage)
                if recorder is not None:
                    rt.note_handle(r, cell)
    if recorder is not None:
        _log_call(rt, name, flat, leaves, written, results, written_ids, fresh, outputs[len(versioned):], cost)
    if in_backward:
        # Made by the backward pass: gradients, which the autograd engine holds and sums outside any dispatch
        # mode (its input buffers), where an evicted one would be read as freed memory. They stay resident
        # until they die; the forward's activations are what the runtime evicts.
        for storage in outputs:
            engine.keep_resident(storage)
    for storage in outputs:
        engine.drop_handle(storage)  # the engine's initial handle: from now on only the program's handles count


def _any_handle_to_make(result_keys: Sequence[int | None], keys: dict[int, Storage]) -> bool:
    """Is a result on a storage of the step (a view of a managed argument), which becomes a handle on it?"""
    return any(key is not None and keys[key].producer is not None for key in result_keys)


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
