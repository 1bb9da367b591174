"""What `backend="dtr"` needs to know of PyTorch's distributed wrappers (DDP, FSDP2) to keep a rank's budget.

A budget given as a fraction refers to the peak of a training step with no rematerialization, measured on the
model's first whole step (runtime/implicit.py). Under `DistributedDataParallel` that step is the wrong one:
DDP sizes its gradient buckets by declaration order at construction, records the order gradients become ready
in the first backward, and in the second forward (`_pre_forward`: `reducer._rebuild_buckets()`) allocates a new
set of buckets in that order. The new buckets are persistent state (like an optimizer's state, created lazily);
the step that allocates them measures more than every later step (an 8-layer MLP: 11.0 MB against 8.9 MB on
each rank), so a fraction of it let every later step run 1.18x over the fraction of their own peak. The step in
which DDP rebuilds its buckets therefore does not calibrate a fraction; the next whole step does.

FSDP2 (`fully_shard`) is refused under a budget, with `UnsupportedWrapperError`, because it gives wrong
gradients. FSDP2 gathers each block's parameters before its forward and frees them after it
(`reshard_after_forward=True`, the default), and it does both by resizing the parameters' storages
(`UntypedStorage.resize_`). The runtime's dispatch mode does not see those resizes. A recompute of a block's
forward during the backward of a later block then reads parameters FSDP2 has already freed. Measured with the
8-block MLP of tests/distributed at 0.6 on 2 gloo ranks: NaN gradients. With `reshard_after_forward=False` the
gradients are right, but the gathered parameters (2.0 MB there) are still allocated inside the step where the
runtime cannot see them, so the step measured 7.35 MB against a runtime budget of 5.35 MB (1.11x the
fraction). With no budget, FSDP2 under `backend="dtr"` runs as under torch.compile.

Nothing here imports torch.distributed unless it is available and initialized.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .errors import DTRError

__all__ = ["BucketWatch", "UnsupportedWrapperError", "ddp_module", "fsdp2_modules"]


class UnsupportedWrapperError(DTRError):
    """A distributed wrapper that `backend="dtr"` cannot yet keep under a memory budget."""


def ddp_module(owner: Any) -> Any:
    """The `DistributedDataParallel` module a step's owner runs (the owner itself, or the module compiled by
    `torch.compile(DDP(model))`), or None."""
    if not isinstance(owner, torch.nn.Module) or not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    for candidate in (owner, getattr(owner, "_orig_mod", None)):
        if isinstance(candidate, DistributedDataParallel):
            return candidate
    return None


def fsdp2_modules(owner: Any) -> list[torch.nn.Module]:
    """The modules of `owner` (or of the module it compiles) that `fully_shard` wrapped."""
    if not isinstance(owner, torch.nn.Module) or not torch.distributed.is_available():
        return []
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return []
    return [m for m in owner.modules() if isinstance(m, FSDPModule)]


def refuse_fsdp2(owner: Any) -> None:
    """Raise `UnsupportedWrapperError` if a budgeted step of `owner` would run FSDP2 (see the module docstring)."""
    if owner in _FSDP2_CHECKED:
        return
    if fsdp2_modules(owner):
        raise UnsupportedWrapperError(
            "FSDP2 (torch.distributed.fsdp.fully_shard) is not supported under a memory budget yet: FSDP2 "
            "gathers and frees each block's parameters by resizing their storages, which the runtime cannot "
            "see, and a rematerialized block would read freed parameters (wrong gradients). Set "
            "dtr_compile.config.memory_budget = None for FSDP2 models (backend='dtr' then compiles as "
            "torch.compile does), or use DistributedDataParallel, which is supported under a budget."
        )
    if isinstance(owner, torch.nn.Module):
        _FSDP2_CHECKED.add(owner)  # the check walks a model's modules once, not every step


_FSDP2_CHECKED: weakref.WeakSet[Any] = weakref.WeakSet()


class BucketWatch:
    """Watches one step of `owner`: `rebuilt()` says whether DDP rebuilt its gradient buckets during it.
    Made when a budgeted step begins; refuses FSDP2 there (`refuse_fsdp2`)."""

    def __init__(self, owner: Any) -> None:
        refuse_fsdp2(owner)
        self._ddp = ddp_module(owner)
        self._before = self._state()

    def _state(self) -> bool | None:
        return None if self._ddp is None else bool(getattr(self._ddp, "_has_rebuilt_buckets", True))

    def rebuilt(self) -> bool:
        return self._before is False and self._state() is True
