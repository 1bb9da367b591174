"""What `backend="dtr"` needs to know of PyTorch's distributed wrappers (DDP, FSDP2) to keep a rank's budget.

A budget given as a fraction refers to the peak of a training step with no rematerialization, measured on the
model's first whole step (runtime/implicit.py). Under `DistributedDataParallel` that step is the wrong one:
DDP sizes its gradient buckets by declaration order at construction, records the order gradients become ready
in the first backward, and in the second forward (`_pre_forward`: `reducer._rebuild_buckets()`) allocates a new
set of buckets in that order. The new buckets are persistent state (like an optimizer's state, created lazily);
the step that allocates them measures more than every later step (an 8-layer MLP: 11.0 MB against 8.9 MB on
each rank), so a fraction of it let every later step run 1.18x over the fraction of their own peak. The step in
which DDP rebuilds its buckets therefore does not calibrate a fraction; the next whole step does.

FSDP2 (`fully_shard` on each block, then the root, then `torch.compile(model, backend="dtr")`) runs under a
budget with nothing to change but the backend name. FSDP2 gathers each block's parameters before its forward and
frees them after it (`reshard_after_forward=True`, the default), and gathers them again before its backward; it
frees and refills them by resizing their storages (`UntypedStorage.resize_`), which the runtime's dispatch mode
does not see. Three things follow, each handled here (`Fsdp2Params`, made for a model when its budgeted step
begins: `BucketWatch`) and in runtime/constants.py and runtime/recipe.py:
  - A recompute may read parameters FSDP2 has freed: the runtime evicts a block's output in the forward and the
    backward of the next block needs it back (before, that read freed memory: NaN gradients at 0.6 with the
    8-block MLP of tests/distributed on 2 gloo ranks). Before every recompute the runtime checks the storages of
    the outside tensors it reads; a freed FSDP2 parameter is brought back (`Fsdp2Params.regather`): if FSDP2's
    backward prefetch has already all-gathered its group, the copy-out is done early; otherwise the runtime
    all-gathers the group itself and reshards it after the recompute. That is a collective: it is safe because
    every rank's runtime makes the same decisions at the same point (same shapes, same ops, estimated costs, one
    seed); where they may not (`cost_mode="measure"`, `memory_budget="auto"`: `deterministic_runtime` in
    runtime/constants.py), it raises `UnsupportedWrapperError` saying so instead. A collective is never rerun (recipe.py), and FSDP2's refill of a
    parameter is no mutation (no snapshot of the freshly allocated bytes is taken: constants.py).
  - The gathered parameters are allocated outside any aten call: from the step's first refill to its end, the
    step counts what they can occupy at once (`Fsdp2Params.reserve_bytes`: the groups that stay gathered, the
    root's, whole; two of the others, one running and one prefetched or regathered). Regions are planned against
    what is left, and a fraction's calibration step counts them too.
  - gloo's all-gather and reduce-scatter stage their tensors in flat buffers: counted as the ops' workspace
    (runtime/workspace.py).
Measured with that MLP on 2 gloo ranks (tests/distributed/test_fsdp2.py), per rank: gradients equal the no-budget
run's (difference 0.0); at 0.6 the step measures 0.92-1.00x of 0.6 x 9.44 MB (the runtime's own budget 5.82 MB,
its peak 5.77 MB). It measured 1.067-1.113x while the runtime held the bytes of outside tensors that died during
the step (runtime/constants.py): gloo's reduce-scatter makes its buffer below the runtime's view, one per block,
and each stayed allocated, uncounted, until the step ended. At 0.5 the step raises BudgetError naming its floor
(0.54 of the reference; the single-rank MLP reaches 0.45).

Nothing here imports torch.distributed unless it is available and initialized.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .errors import UnsupportedWrapperError

__all__ = ["BucketWatch", "Fsdp2Params", "UnsupportedWrapperError", "ddp_module", "fsdp2_modules", "fsdp2_params"]


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


class Fsdp2Params:
    """The parameters FSDP2 gathers and frees behind the runtime's back, for one model (see the module docstring).

    `group_of(untyped)`: the FSDPParamGroup whose unsharded parameters live in that torch storage, or None.
    `regather(untyped)`: bring a freed parameter's bytes back without a collective of this rank's own: FSDP2's
    backward prefetch has already all-gathered the group (every rank issued it); its copy-out is done now instead of
    at the group's pre-backward, which then finds it done. `reserve_bytes`: what the gathered parameters can
    occupy at once, counted in the step."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        groups: list[Any] = []
        for module in modules:
            state = module._get_fsdp_state()  # type: ignore[operator]
            for group in getattr(state, "_fsdp_param_groups", ()):
                if group not in groups:
                    groups.append(group)
        self.groups = groups
        self.root = modules[0] if modules else None
        self._by_storage: dict[int, Any] = {}
        self.gathers = 0  # all-gathers the runtime ran itself (`regather`), for tests and reports
        self.early_copy_outs = 0  # prefetched all-gathers the runtime copied out before FSDP2 did (`regather`)
        self.reserve_bytes = self._reserve_bytes()

    @staticmethod
    def unsharded_bytes(group: Any) -> int:
        total = 0
        for param in group.fsdp_params:
            dtype = param.param_dtype or param.orig_dtype
            total += param._orig_size.numel() * dtype.itemsize
        return total

    def _reserve_bytes(self) -> int:
        """Groups that stay gathered from their forward to their backward (the root's, and any with
        `reshard_after_forward=False` or a post-forward mesh) count whole; of the others, two can be gathered at
        once (one running, the next one prefetched in the backward, or regathered early by a recompute)."""
        held, resharding = 0, []
        for group in self.groups:
            nbytes = self.unsharded_bytes(group)
            is_root = self.root is not None and any(m is self.root for m in group.modules)
            if is_root or not group._reshard_after_forward or group._use_post_forward_mesh:
                held += nbytes
            else:
                resharding.append(nbytes)
        return held + sum(sorted(resharding)[-2:])

    def group_of(self, untyped: torch.UntypedStorage) -> Any:
        key = untyped._cdata
        if key not in self._by_storage:
            self._refresh()
        return self._by_storage.get(key)

    def _refresh(self) -> None:
        """FSDP2 makes its unsharded tensors at a group's first all-gather and keeps them (resized to 0 bytes
        when freed): their storages are looked up again when an unknown one is asked about."""
        for group in self.groups:
            for param in group.fsdp_params:
                tensors = list(param.all_gather_outputs)
                if hasattr(param, "_unsharded_param"):
                    unsharded = param._unsharded_param
                    tensors.append(unsharded.to_local() if hasattr(unsharded, "to_local") else unsharded)
                for tensor in tensors:
                    self._by_storage[tensor.untyped_storage()._cdata] = group

    def regather(self, untyped: torch.UntypedStorage, *, gather: bool) -> Any:
        """Bring back the bytes of `untyped` (a freed unsharded parameter). Returns None if it cannot; else its
        group, or True if that group stays gathered for FSDP2's own use (nothing to undo).

        If FSDP2's backward prefetch has already issued the group's all-gather, its copy-out is done now instead
        of at the group's pre-backward (which then finds it done). Otherwise, with `gather`, the group is
        all-gathered here, a collective: every rank's runtime makes the same decisions at the same point (same
        shapes, same ops, estimated costs, the same seed: see `deterministic`), so every rank gathers with it."""
        group = self.group_of(untyped)
        if group is None:
            return None
        if group._all_gather_result is not None:
            group.wait_for_unshard()
            self.early_copy_outs += 1
            return True if untyped.nbytes() > 0 else None
        if not gather:
            return None
        group.unshard()
        group.wait_for_unshard()
        self.gathers += 1
        return group if untyped.nbytes() > 0 else None


def fsdp2_params(owner: Any) -> Fsdp2Params | None:
    """The `Fsdp2Params` of `owner`'s FSDP2 modules (made once per model), or None without FSDP2."""
    if owner in _NO_FSDP2:
        return None
    found = _FSDP2.get(owner) if isinstance(owner, torch.nn.Module) else None
    if found is None:
        modules = fsdp2_modules(owner)
        if not modules:
            if isinstance(owner, torch.nn.Module):
                _NO_FSDP2.add(owner)  # the check walks a model's modules once, not every step
            return None
        found = Fsdp2Params(modules)
        if isinstance(owner, torch.nn.Module):
            _FSDP2[owner] = found
    return found


_FSDP2: weakref.WeakKeyDictionary[Any, Fsdp2Params] = weakref.WeakKeyDictionary()
_NO_FSDP2: weakref.WeakSet[Any] = weakref.WeakSet()


class BucketWatch:
    """Watches one step of `owner`: `rebuilt()` says whether DDP rebuilt its gradient buckets during it.
    Made when a budgeted step begins (runtime/implicit.py), before the step's runtime begins it; tells that
    runtime which outside tensors FSDP2 frees and gathers behind its back (`Fsdp2Params`)."""

    def __init__(self, owner: Any, runtime: Any = None) -> None:
        if runtime is not None:  # the runtime of the step about to begin
            runtime.constants.owner = fsdp2_params(owner)
        self._ddp = ddp_module(owner)
        self._before = self._state()

    def _state(self) -> bool | None:
        return None if self._ddp is None else bool(getattr(self._ddp, "_has_rebuilt_buckets", True))

    def rebuilt(self) -> bool:
        return self._before is False and self._state() is True
