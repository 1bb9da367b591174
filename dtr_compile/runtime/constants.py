"""Plain tensors that enter the runtime from outside the step: parameters, buffers, inputs.

They are pinned engine storages outside the budget (DESIGN.md: what was live when the step began is
not counted). One record per underlying storage, so `W` and a view of it share one record.

When an op mutates such a tensor in place (BatchNorm's running statistics, an optimizer step inside
the context), a recorded op that read the old value may still need to be recomputed. Then the old
value is snapshotted first and those ops are pointed at the snapshot; otherwise the mutation is free.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

from ..engine import Engine, Operation, Storage
from .values import Buffer, TensorValue, buffer

# How far the liveness search below walks before it assumes the old value is needed (and snapshots).
_LIVENESS_SEARCH_LIMIT = 256


class ConstantEntry:
    __slots__ = ("consumers", "storage", "tensor", "values")

    def __init__(self, storage: Storage, tensor: torch.Tensor, on_death) -> None:
        self.storage = storage
        self.tensor = weakref.ref(tensor, on_death)
        self.consumers: weakref.WeakSet[Operation] = weakref.WeakSet()
        # id(tensor object) -> (weak tensor, its value): a parameter read by every step gets one value, not one
        # per op (values are immutable until a mutation snapshot moves them, which clears this cache).
        self.values: dict[int, tuple[weakref.ref, TensorValue]] = {}


class ConstantRegistry:
    """Maps outside tensors to pinned engine storages, keyed by the address of their storage."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._entries: dict[int, ConstantEntry] = {}
        self.snapshot_bytes = 0
        self._grad_hooks: dict[int, Any] = {}  # id(leaf) -> hook handle, removed when the step ends

    def watch_gradient(self, tensor: torch.Tensor) -> None:
        """Pin the gradient autograd accumulates into `tensor` (a parameter or an input leaf).

        A leaf's gradient outlives the step; evicting it would make the step end by recomputing a piece of
        the backward. The autograd engine assigns it without an aten call, so a hook is the only place to see it.
        """
        if id(tensor) in self._grad_hooks or not tensor.requires_grad or not tensor.is_leaf:
            return
        engine = self.engine

        def pin_gradient(leaf: torch.Tensor) -> None:
            grad = leaf.grad
            cell = getattr(grad, "_cell", None)
            if cell is not None:
                engine.pin(cell.value.storage)

        self._grad_hooks[id(tensor)] = tensor.register_post_accumulate_grad_hook(pin_gradient)

    def end_step(self) -> None:
        for handle in self._grad_hooks.values():
            handle.remove()
        self._grad_hooks.clear()

    def value_of(self, tensor: torch.Tensor) -> TensorValue:
        untyped = tensor.untyped_storage()
        entry = self._entries.get(untyped.data_ptr())
        if entry is None or entry.tensor() is None or entry.storage.nbytes != untyped.nbytes():
            entry = self._register(tensor, untyped)
        if tensor.requires_grad:
            self.watch_gradient(tensor)
        cached = entry.values.get(id(tensor))
        if cached is not None and cached[0]() is tensor:
            value = cached[1]
            if value.size == tensor.shape and value.stride == tensor.stride() and value.offset == tensor.storage_offset():
                return value
        value = TensorValue(entry.storage, tensor)
        entry.values[id(tensor)] = (weakref.ref(tensor), value)
        return value

    def entry_of(self, storage: Storage) -> ConstantEntry | None:
        entry = self._entries.get(_address(storage))
        return entry if entry is not None and entry.storage is storage else None

    def note_consumer(self, storage: Storage, op: Operation) -> None:
        entry = self.entry_of(storage)
        if entry is not None:
            entry.consumers.add(op)

    def live_tensors(self) -> Iterable[torch.Tensor]:
        for entry in list(self._entries.values()):
            tensor = entry.tensor()
            if tensor is not None:
                yield tensor

    def before_mutation(self, storage: Storage, op_has_fresh_outputs: bool) -> Storage | None:
        """`storage` (a constant) is about to be mutated in place: keep its old value where needed.

        `op_has_fresh_outputs`: the mutating op itself produces outputs it may have to recompute.
        Returns the snapshot's storage, or None when no recorded op can need the old value. With a
        snapshot, every value recorded so far reads it; ask `value_of` again for the live tensor.
        """
        entry = self.entry_of(storage)
        if entry is None:
            return None
        if not (op_has_fresh_outputs or any(_may_be_recomputed(op) for op in list(entry.consumers))):
            return None
        old = buffer(storage)
        snapshot = old.untyped.clone()  # type: ignore[union-attr]
        self.snapshot_bytes += snapshot.nbytes()
        # Recorded values now read the snapshot; live handles get fresh values on the mutated tensor.
        frozen = self._pinned(storage.nbytes, Buffer(snapshot, old.device))
        for value in old.values.items():
            value.storage = frozen
            value.plain = None
            buffer(frozen).values.add(value)
        old.values.clear()
        entry.values.clear()
        for cell in old.cells.items():
            cell.value = cell.value.retarget(storage)
        return frozen

    def _register(self, tensor: torch.Tensor, untyped: torch.UntypedStorage) -> ConstantEntry:
        storage = self._pinned(untyped.nbytes(), Buffer(untyped, tensor.device))
        address = untyped.data_ptr()
        entry = ConstantEntry(storage, tensor, lambda _: self._forget(address, entry))
        self._entries[address] = entry
        return entry

    def _forget(self, address: int, entry: ConstantEntry) -> None:
        """The outside tensor died (e.g. last step's batch): its record lives on only in recipes that need it."""
        if self._entries.get(address) is entry:
            del self._entries[address]

    def _pinned(self, nbytes: int, payload: Buffer) -> Storage:
        storage = self.engine.constant(nbytes, payload=payload)
        self.engine.drop_handle(storage)  # pinned, so never evicted; without a handle the engine does not hold it
        return storage


def _address(storage: Storage) -> int:
    untyped = buffer(storage).untyped
    return untyped.data_ptr() if untyped is not None else -1


def _may_be_recomputed(op: Operation) -> bool:
    """Could some live handle still need `op` rerun? Walks evicted, handle-less descendants."""
    frontier = [op]
    seen = 0
    while frontier:
        current = frontier.pop()
        for out in current.outputs:
            seen += 1
            if seen > _LIVENESS_SEARCH_LIMIT:
                return True
            if out.handles > 0:
                return True
            frontier.extend(out.consumers)
    return False
