"""What `backend="dtr"` needs to know of PyTorch's distributed wrappers (DDP, FSDP2) to keep a rank's budget.

A budget given as a fraction refers to the peak of a training step with no rematerialization, measured on the
model's first whole step (runtime/implicit.py). Under `DistributedDataParallel` that step is the wrong one:
DDP sizes its gradient buckets by declaration order at construction, records the order gradients become ready
in the first backward, and in the second forward (`_pre_forward`: `reducer._rebuild_buckets()`) allocates a new
set of buckets in that order. The new buckets are persistent state (like an optimizer's state, created lazily);
the step that allocates them measures more than every later step (an 8-layer MLP: 11.0 MB against 8.9 MB on
each rank), so a fraction of it let every later step run 1.18x over the fraction of their own peak. The step in
which DDP rebuilds its buckets therefore does not calibrate a fraction; the next whole step does.

Nothing here imports torch.distributed unless it is available and initialized.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BucketWatch", "ddp_module"]


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


class BucketWatch:
    """Watches one step of `owner`: `rebuilt()` says whether DDP rebuilt its gradient buckets during it."""

    def __init__(self, owner: Any) -> None:
        self._ddp = ddp_module(owner)
        self._before = self._state()

    def _state(self) -> bool | None:
        return None if self._ddp is None else bool(getattr(self._ddp, "_has_rebuilt_buckets", True))

    def rebuilt(self) -> bool:
        return self._before is False and self._state() is True
