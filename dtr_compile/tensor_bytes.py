"""Bytes of a tensor's data, real, fake or with symbolic sizes (their hints).

On the ground floor, beside compat.py: the planner (passes/), the runtime's slices and the handoff all size
tensors this way, and none of them should have to import another to do it.
"""

from __future__ import annotations

import torch

from . import compat
from .planned_sizes import planned_value


def size_hint(size: object, fallback: int = 4096) -> int:
    """The number a (possibly symbolic) size stands for, without a guard: its value at the sizes a plan is made at
    (planned_sizes.py), else its hint."""
    planned = planned_value(size)
    return planned if planned is not None else compat.size_hint(size, fallback)


def tensor_nbytes(val: object) -> int:
    """Bytes of a (fake) tensor's data; 0 for non-tensors. Symbolic sizes use their hints."""
    if not isinstance(val, torch.Tensor):
        return 0
    numel = 1
    for size in val.shape:
        numel *= size_hint(size)
    return numel * val.element_size()
