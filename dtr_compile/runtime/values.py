"""How the torch runtime maps plain tensors onto engine storages.

The runtime works on ordinary `torch.Tensor` objects: the tensors a program holds are the tensors PyTorch
made. What the engine calls a storage is a *version* of a torch storage (an `UntypedStorage`, shared by a
tensor and all its views): its bytes from one write to the next.

- Evicting a version that user tensors still view resizes their storage to 0 bytes: the memory is freed, and
  every tensor and view on it keeps its metadata (and, for TorchDynamo, its identity and guards).
- Rematerializing it recomputes the bytes into a fresh storage and swaps the fresh data pointer into the
  evicted storage (`UntypedStorage._swap_data_ptr_`, no copy): every tensor on it is valid again, unchanged.
  Where torch has no such swap (2.11; compat.py), the evicted storage itself is resized back to its bytes
  before the recompute (`Buffer.reopen`), and the recompute writes into it: through the op's `out=` overload,
  or as the argument an in-place op mutates, with no copy and no more memory than the value; what can only
  produce its result elsewhere (compiled code, ops without an `out=` kernel) is copied in (`Buffer.fill`),
  one output at a time, and the operation's workspace reserves that one extra copy (recipe.py).
- A version no user tensor views any more (the value before an in-place write, an intermediate a recompute
  chain brought back, a storage whose last handle died) lives in an engine-owned storage instead.

A `TensorValue` is an immutable view (dtype, size, stride, offset) into one version: operations record the
values they read, so a recompute sees exactly what the original call saw.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .. import compat
from ..engine import Storage


class WeakList:
    """Weak references in a list: cheaper than a WeakSet on the per-op hot path (no callback, no hashing).

    Dead references are pruned when the list doubles past what was alive at the last pruning, so a
    long-lived storage does not grow the list forever, at O(1) a call.
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
    """Payload of an engine Storage: where the bytes of that version live.

    `untyped` is the storage holding them while resident. `shared` means it is the storage user tensors
    view (evicted by resizing it to 0 bytes, refilled by swapping data pointers); otherwise it is an
    engine-owned storage that nobody else sees (evicted by dropping it). `cells` are the live handles.
    """

    __slots__ = ("_weak", "cells", "device", "key", "shared", "untyped")

    def __init__(self, untyped: torch.UntypedStorage | None, device: torch.device, *, shared: bool) -> None:
        self.untyped = untyped
        self.key = untyped._cdata if shared and untyped is not None else None  # identity of a shared storage
        self.device = device
        self.shared = shared
        self.cells = WeakList()  # handles.HandleCell of the live tensors and saved tensors on this version
        self._weak: int | None = None  # a C++ weak reference while loosened

    def evict(self) -> None:
        """Free the bytes. User tensors on a shared storage stay valid objects with 0 bytes behind them."""
        untyped = self.untyped
        if untyped is None:
            return
        if self.shared:
            untyped.resize_(0)
        else:
            self.untyped = None

    def detach(self) -> None:
        """Stop managing the storage without touching it (its user tensors keep their bytes)."""
        self.untyped = None
        self.shared = False

    def loosen(self) -> None:
        """Hold the shared storage weakly, so that whoever holds its tensors can free it (a compiled part
        frees each input after its last use); `tighten` takes it back if it survived."""
        if self.shared and self.untyped is not None:
            self._weak = self.untyped._weak_ref()
            self.untyped = None

    @property
    def loosened(self) -> bool:
        return self._weak is not None

    def tighten(self) -> bool:
        """Hold the storage strongly again; False if it was freed meanwhile (then it is detached)."""
        if self._weak is None:
            return True
        self.untyped = torch.UntypedStorage._new_with_weak_ptr(self._weak)
        torch.UntypedStorage._free_weak_ref(self._weak)
        self._weak = None
        if self.untyped is None:
            self.shared = False
            return False
        return True

    def reopen(self, nbytes: int) -> torch.UntypedStorage | None:
        """Where refills cannot swap data pointers: resize the evicted shared storage back to `nbytes` and
        return it, for the recompute to write the value into (the engine made room for it). None where the
        refill swaps, or there is no evicted shared storage (the recompute then makes its own)."""
        target = self.untyped
        if not self.shared or target is None or target.nbytes() != 0 or nbytes == 0 or compat.uses_storage_swap():
            return None
        target.resize_(nbytes)
        return target

    def fill(self, fresh: torch.UntypedStorage) -> None:
        """Make `fresh`'s bytes this version's (after a recompute)."""
        target = self.untyped
        if self.shared and target is not None:
            if fresh._cdata == target._cdata or fresh.nbytes() == 0:
                return  # the recompute wrote into the reopened storage itself
            if not compat.uses_storage_swap():  # one copy (the operation's workspace reserved it: refill.py)
                if target.nbytes() != fresh.nbytes():
                    target.resize_(fresh.nbytes())
                target.copy_(fresh)
            elif target.nbytes() == 0:
                compat.swap_storage_data(target, fresh)  # the user's tensors see the recomputed bytes; `fresh` is empty
            return
        self.untyped = fresh
        self.shared = False


class Layout:
    """Dtype, size, stride and offset of a result: what a refill's `out=` tensor must have so that the tensors
    the program holds read the recomputed bytes as they read the first ones (a `view_of` template)."""

    __slots__ = ("dtype", "offset", "size", "stride")

    def __init__(self, like: torch.Tensor) -> None:
        self.dtype = like.dtype
        self.size = tuple(like.shape)
        self.stride = like.stride()
        self.offset = like.storage_offset()


class TensorValue:
    """An immutable tensor value: a view (dtype, size, stride, offset) into one storage version."""

    __slots__ = ("dtype", "offset", "size", "storage", "stride")

    def __init__(self, storage: Storage, like: torch.Tensor) -> None:
        self.storage = storage
        self.dtype = like.dtype
        self.size = tuple(like.shape)
        self.stride = like.stride()
        self.offset = like.storage_offset()

    def get(self) -> torch.Tensor:
        """A plain tensor viewing the value; its storage must be resident (the engine made it so)."""
        return view_of(buffer(self.storage).untyped, self)


def buffer(storage: Storage) -> Buffer:
    return storage.payload


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of the torch storage a tensor views (stable while that storage is alive)."""
    return tensor.untyped_storage()._cdata


def view_of(untyped: torch.UntypedStorage | None, like: Any) -> torch.Tensor:
    """A tensor with `like`'s dtype/size/stride/offset over `untyped` (no copy)."""
    if untyped is None:
        raise AssertionError("dtr_compile internal error: reading an evicted storage")
    out = torch.empty(0, dtype=like.dtype, device=untyped.device)
    out.set_(untyped, like.offset, like.size, like.stride)
    return out


def held_by_program(storage: Storage) -> bool:
    """Does a live tensor of the program hold `storage` (not only a tensor autograd saved for the backward)?"""
    return any(cell.death is not None and cell.storage is storage for cell in buffer(storage).cells.items())
