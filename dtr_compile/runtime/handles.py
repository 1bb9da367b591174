"""Which plain tensors a step's runtime manages, and when the last one on a storage version dies.

A *handle* is a reason for a storage version to stay: a live tensor object that an operation of the step
returned, or a tensor autograd saved for the backward (saved.py). Each has a `HandleCell`; its death (a
weak-reference callback, or the saved tensor's release) drops one handle in the engine. When a version has
no handle left, nothing can read it except a recompute, so the engine frees it at once ("eager eviction").

PyTorch keeps a tensor's Python object alive as long as C++ holds the tensor (autograd's graph, a
gradient), so a handle dies exactly when the tensor does. The `StorageIndex` finds the current version of
the storage a tensor views, by the storage's identity.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from ..engine import Engine, Storage
from .values import Buffer, buffer, storage_key

if TYPE_CHECKING:
    from .recorder import TraceRecorder


class HandleCell:
    """One handle on a storage version, shared with its death notice (which must not hold the tensor)."""

    __slots__ = ("__weakref__", "death", "name", "storage")

    def __init__(self, storage: Storage, name: str | None) -> None:
        self.storage: Storage | None = storage  # None once the step ended: the death is no news any more
        self.name = name  # the handle's name in a recorded operation log, if the runtime records one
        self.death: weakref.ref | None = None  # the weak reference whose callback reports the death


class StorageIndex:
    """The step's managed storages: torch storage identity -> current engine version, and their handles."""

    def __init__(self, engine: Engine, recorder: TraceRecorder | None) -> None:
        self.engine = engine
        self.recorder = recorder
        self._current: dict[int, Storage] = {}
        # id(weak reference) -> its cell, for the live tensors: this holds the cells and their weak references
        # (nothing else does: the tensors are plain), and lets one shared callback find the cell of a death.
        self._watched: dict[int, HandleCell] = {}
        self._on_death = self._make_death_callback()
        self.on_empty: Callable[[], None] | None = None  # told when the last handle of the step dies (implicit.py)

    def __len__(self) -> int:
        return len(self._current)

    def versions(self) -> Iterator[Storage]:
        return iter(list(self._current.values()))

    def lookup(self, tensor: torch.Tensor) -> Storage | None:
        return self._current.get(storage_key(tensor))

    def lookup_key(self, key: int) -> Storage | None:
        """`lookup` for a caller that has the tensor's `storage_key` already."""
        return self._current.get(key)

    def viewed(self, storage: Storage, besides: frozenset[int] = frozenset()) -> bool:
        """Does a live tensor of the program view `storage`, other than those whose ids are in `besides`? (A tensor
        autograd saved does not count: the program let go of a value it can no longer reach, whatever autograd
        keeps of it for the backward.)"""
        payload = storage.payload
        if not isinstance(payload, Buffer):
            return False
        for cell in payload.cells.items():
            tensor = cell.death() if cell.storage is storage and cell.death is not None else None
            if tensor is not None and id(tensor) not in besides:
                return True
        return False

    def set_current(self, key: int, storage: Storage) -> None:
        self._current[key] = storage

    def track(self, tensor: torch.Tensor, storage: Storage) -> HandleCell:
        """Make `tensor` a handle on `storage` until it dies."""
        cell = self.new_cell(storage)
        cell.death = ref = weakref.ref(tensor, self._on_death)
        self._watched[id(ref)] = cell
        return cell

    def new_cell(self, storage: Storage) -> HandleCell:
        """A handle whose owner reports its death itself with `drop(cell)` (a saved tensor)."""
        recorder = self.recorder
        cell = HandleCell(storage, recorder.new_name() if recorder is not None else None)
        self.engine.add_handle(storage)
        buffer(storage).cells.add(cell)
        return cell

    def drop(self, cell: HandleCell) -> None:
        storage = cell.storage
        if storage is None:
            return
        cell.storage = None
        if self.recorder is not None and cell.name is not None:
            self.recorder.release(cell.name)
        payload = buffer(storage)
        key = payload.key
        self.engine.drop_handle(storage)  # at zero the engine frees it (now, or when the running op unlocks it)
        if storage.handles <= 0:
            # Nothing of the program views this version any more: a later read of its torch storage (by a
            # holder the runtime does not see) finds an outside tensor, and a recompute gets its own storage.
            if key is not None and self._current.get(key) is storage:
                del self._current[key]
                if not self._current and self.on_empty is not None:
                    self.on_empty()
            if not storage.resident and payload.shared:
                payload.detach()

    def move_handles(self, old: Storage, new: Storage) -> None:
        """After an in-place write: every handle on `old` now holds `new` (same torch storage, new bytes)."""
        cells = buffer(old).cells
        for cell in cells.items():
            if cell.storage is old:
                cell.storage = new
                buffer(new).cells.add(cell)
                self.engine.add_handle(new)
                self.engine.drop_handle(old)
        cells.clear()

    def close(self) -> list[Storage]:
        """End of the step: detach every cell and forget the index; returns the versions it held."""
        versions = list(self._current.values())
        for storage in versions:
            for cell in buffer(storage).cells.items():
                cell.storage = None
        for cell in self._watched.values():
            cell.storage = None
            cell.death = None  # the weak reference and its callback go with it
        self._watched.clear()
        self._current.clear()
        return versions

    def _make_death_callback(self) -> Callable[[weakref.ref], None]:
        drop = self.drop
        watched = self._watched

        # Deaths happen anywhere, inside compiled code too: the notice is never traced by Dynamo.
        def on_death(ref: weakref.ref) -> None:
            cell = watched.pop(id(ref), None)
            if cell is not None:
                cell.death = None
                drop(cell)

        return on_death
