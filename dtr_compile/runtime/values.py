"""How the torch runtime maps tensors onto engine storages.

A `Buffer` is the torch side of one engine `Storage` version: the untyped storage holding its bytes
while resident. A `TensorValue` is an immutable tensor value: a strided view (dtype, size, stride,
offset) into one storage version. Operations record the values they read, so a recompute sees exactly
what the original call saw even if a handle was later mutated in place (mutation creates a new storage
version; see mode.py). Evicting a storage drops the buffer and every cached view of it, so that the
memory is really freed.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..engine import Storage


class WeakList:
    """Weak references in a list: cheaper than a WeakSet on the per-op hot path (no callback, no hashing).

    Dead references are pruned when the list doubles past what was alive at the last pruning, so a
    long-lived storage (a parameter viewed once per step) does not grow the list forever, at O(1) a call.
    """

    __slots__ = ("_limit", "_refs")

    def __init__(self) -> None:
        self._refs: list[weakref.ref] = []
        self._limit = 64

    def add(self, item: Any) -> None:
        refs = self._refs
        refs.append(weakref.ref(item))
        if len(refs) >= self._limit:
            refs[:] = [r for r in refs if r() is not None]
            self._limit = max(64, 2 * len(refs))

    def items(self) -> list[Any]:
        return [x for r in self._refs if (x := r()) is not None]

    def clear(self) -> None:
        self._refs = []
        self._limit = 64


class Buffer:
    """Payload of an engine Storage: its untyped storage (None while evicted) and the values viewing it."""

    __slots__ = ("cells", "device", "untyped", "values")

    def __init__(self, untyped: torch.UntypedStorage | None, device: torch.device) -> None:
        self.untyped = untyped
        self.values = WeakList()  # every TensorValue viewing this version (their cached views pin the bytes)
        self.cells = WeakList()  # the live handles (tensor.HandleCell) on this version
        self.device = device

    def drop(self) -> None:
        """Free the memory: forget the storage and every cached view into it."""
        self.untyped = None
        for value in self.values.items():
            value.plain = None


class TensorValue:
    """An immutable tensor value: a view (dtype, size, stride, offset) into one storage version."""

    __slots__ = ("__weakref__", "dtype", "offset", "plain", "size", "storage", "stride")

    def __init__(self, storage: Storage, plain: torch.Tensor) -> None:
        self.storage = storage
        self.dtype = plain.dtype
        self.size = tuple(plain.shape)
        self.stride = tuple(plain.stride())
        self.offset = plain.storage_offset()
        self.plain: torch.Tensor | None = plain
        buffer(storage).values.add(self)

    def get(self) -> torch.Tensor:
        """The plain tensor; the storage must be resident (the engine made it so before the call)."""
        if self.plain is None:
            self.plain = view_of(buffer(self.storage).untyped, self)
        return self.plain

    def retarget(self, storage: Storage) -> TensorValue:
        """The same view into another storage version (after an in-place mutation)."""
        value = TensorValue.__new__(TensorValue)
        value.storage = storage
        value.dtype, value.size, value.stride, value.offset = self.dtype, self.size, self.stride, self.offset
        value.plain = None
        buffer(storage).values.add(value)
        return value


def buffer(storage: Storage) -> Buffer:
    return storage.payload


def view_of(untyped: torch.UntypedStorage | None, like: Any) -> torch.Tensor:
    """A tensor with `like`'s dtype/size/stride/offset over `untyped` (no copy)."""
    if untyped is None:
        raise AssertionError("dtr_compile internal error: reading an evicted storage")
    out = torch.empty(0, dtype=like.dtype, device=untyped.device)
    out.set_(untyped, like.offset, like.size, like.stride)
    return out
