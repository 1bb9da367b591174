"""Tensors autograd saves for the backward, seen through `saved_tensors_hooks`.

Autograd keeps what a backward formula needs (an op's inputs, or its own result for exp, tanh, softmax...)
inside its graph. For a result, it keeps a shallow copy, not the tensor object the program held, so without
these hooks the runtime would see the program's last handle die and free a storage the backward still reads.
The pack hook turns every saved runtime tensor into a handle (`SavedTensor`), alive exactly as long as
autograd keeps it; the unpack hook makes it resident again (recomputing it if it was evicted) before the
backward formula reads it. Outside tensors (parameters, inputs) are saved as they are.

The same hooks see the activations a compiled region saves (AOTAutograd saves them with
`save_for_backward`), so they share the step's budget like any eager tensor.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .handles import HandleCell
from .interface import RuntimeInterface


class SavedTensor:
    """A handle held by autograd's graph: the saved tensor (a detached alias) and its handle cell."""

    __slots__ = ("cell", "runtime", "tensor")

    def __init__(self, tensor: torch.Tensor, cell: HandleCell, runtime: RuntimeInterface) -> None:
        self.tensor = tensor
        self.cell = cell
        self.runtime = runtime

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # a finalizer must not raise (interpreter shutdown)
            self.runtime.index.drop(self.cell)


def saved_tensor_hooks(runtime: RuntimeInterface) -> tuple[Any, Any]:
    """The (pack, unpack) pair for `torch.autograd.graph.saved_tensors_hooks` while `runtime` is active."""
    index = runtime.index

    def pack(tensor: torch.Tensor) -> Any:
        if not runtime.active:  # left on the stack after its step ended (see implicit.py)
            return tensor
        storage = index.lookup(tensor)
        if storage is None:
            return tensor  # an outside tensor: pinned anyway
        source = runtime.log_name(tensor, storage) if runtime.recorder is not None else None
        cell = index.new_cell(storage)
        if source is not None and cell.name is not None:
            runtime.recorder.copy(cell.name, source)
        # `.data` is an alias without autograd history, made without an aten call: holding the tensor
        # itself would tie a result to its own grad_fn in a cycle the garbage collector cannot see.
        return SavedTensor(tensor.data, cell, runtime)

    def unpack(packed: Any) -> torch.Tensor:
        if not isinstance(packed, SavedTensor):
            return packed
        storage = packed.cell.storage
        if storage is not None and not storage.resident:
            runtime.ensure_resident([storage])
        return packed.tensor

    return pack, unpack
