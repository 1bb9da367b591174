"""`DTRTensor`: the handle a user holds for a runtime-managed tensor.

It is a wrapper subclass: metadata only, its bytes live in an engine storage that may be evicted and
recomputed behind it. Inside `runtime.enable()` every aten call goes through the runtime's dispatch
mode (mode.py). Outside it (a loss or a gradient that leaves the context) the class-level
`__torch_dispatch__` materializes the value and runs the op on plain tensors, so results leaving the
context behave as ordinary tensors.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Self

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

from .values import TensorValue, buffer

if TYPE_CHECKING:
    from .runtime import Runtime


class HandleCell:
    """The value a handle points at, shared with its death callback (which must not hold the handle)."""

    __slots__ = ("__weakref__", "death", "name", "value")

    def __init__(self, value: TensorValue, name: str | None = None) -> None:
        self.value = value
        self.name = name  # the handle's name in a recorded operation log, if the runtime records one
        self.death: weakref.ref | None = None  # the weak reference whose callback reports the handle's death


class DTRTensor(torch.Tensor):
    """A tensor whose storage the DTR runtime may evict and recompute transparently."""

    _cell: HandleCell
    _runtime: Runtime

    @staticmethod
    def __new__(cls, value: TensorValue, runtime: Runtime) -> Self:
        handle = torch.Tensor._make_wrapper_subclass(
            cls,
            value.size,
            strides=value.stride,
            storage_offset=value.offset,
            dtype=value.dtype,
            device=runtime.device_of(value),
            requires_grad=False,
        )
        recorder = runtime.recorder
        cell = HandleCell(value, recorder.new_name() if recorder is not None else None)
        handle._cell = cell
        handle._runtime = runtime
        runtime.engine.add_handle(value.storage)
        buffer(value.storage).cells.add(cell)
        # The death notice: a weak reference kept alive by the cell it reports on (cheaper than
        # weakref.finalize, whose global registry costs the hot path dearly once the heap is large).
        cell.death = weakref.ref(handle, runtime.death_callback(cell))
        return handle

    @property
    def dtr_value(self) -> TensorValue:
        return self._cell.value

    def materialize(self) -> torch.Tensor:
        """This tensor's value as a plain tensor (recomputed if it was evicted). Inside the runtime's
        context, ops on the result are tracked again as constants; use it to hand values to non-torch code."""
        with _disable_current_modes():
            return self._runtime.materialize(self._cell.value)

    # Methods that read a tensor's bytes without an aten call: answer from the materialized value.
    def tolist(self) -> Any:
        with _disable_current_modes():
            return self.materialize().tolist()

    def numpy(self, *, force: bool = False) -> Any:
        with _disable_current_modes():
            return self.materialize().detach().clone().numpy(force=force)

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        array = self.numpy()
        return array if dtype is None else array.astype(dtype, copy=False)

    def __reduce_ex__(self, protocol: int) -> Any:  # torch.save / pickle store the plain value
        with _disable_current_modes():
            return self.materialize().detach().clone().__reduce_ex__(protocol)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        state = "resident" if self._cell.value.storage.resident else "evicted, recomputed to print"
        with _disable_current_modes():
            return f"DTRTensor({self.materialize()!r}, {state})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        # Reached only when no runtime mode is active: the handle has left its context. Run plainly.
        def unwrap(x: Any) -> Any:
            return x.materialize() if isinstance(x, DTRTensor) else x

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
