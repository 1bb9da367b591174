"""Gradients summed in place under the runtime, as the autograd engine sums them without a dispatch mode.

Where two gradients flow into one input, the autograd engine sums them in its input buffer: in place
(`old.add_(new)`) when it holds the only reference to `old`, out of place otherwise. Under any dispatch mode
torch takes every tensor for a subclass (`at::isTensorSubclassLike`) and always sums out of place, so each
accumulation needs one more gradient-sized buffer than plain eager. On the TreeLSTM (issue 16), whose leaves
select slices of one embedding output, every select's backward is a gradient of the whole embedding output:
summing them out of place put the backward of an 18-leaf tree above a budget of 0.3 x eager's peak, with
every evictable tensor already evicted.

The runtime takes the in-place path back. An `aten.add.Tensor` of a backward pass is computed into its first
argument's bytes, which then move to the result's own storage (a data-pointer swap, no copy), and the first
argument's version is recorded as consumed: evicted, recomputable from its producer. That keeps the values
right whoever holds the argument: a reader that still had it (a backward formula reusing a temporary, a
gradient handed to two inputs) reads its old value, recomputed. Which sums take this path is a matter of cost
only: those whose first argument shows no more owners than the gradient being added, nor than the engine's own
accumulation shows when its buffer holds the gradient alone (tensor and storage use counts, learnt once a
process from the engine itself), so that what is consumed is almost always about to die. Releases whose storages cannot swap data pointers
(compat.uses_storage_swap) keep the out-of-place sum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from .. import compat
from .backward_pass import in_backward_pass
from .values import TensorValue, storage_key

if TYPE_CHECKING:
    from ..engine import Storage

_ADD = torch.ops.aten.add.Tensor

# (tensor use count, storage use count) that the first argument of the engine's accumulation shows inside a
# dispatch mode when the engine's buffer is its only owner; None: not calibrated yet; False: no usable answer.
_unique_counts: tuple[int, int] | None | bool = None


def _counts(t: torch.Tensor) -> tuple[int, int]:
    return t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class _Probe(TorchDispatchMode):
    """Records the counts of the first argument of every `add.Tensor` of a backward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func is _ADD and in_backward_pass():
            self.seen.append(_counts(args[0]))
        return func(*args, **(kwargs or {}))


def _probe(shared: bool) -> list[tuple[int, int]]:
    backward = getattr(torch.autograd.backward, "__wrapped__", torch.autograd.backward)  # implicit.py wraps it
    w = torch.ones(4, requires_grad=True)
    if shared:  # add's backward hands the same gradient to both inputs: summed with itself, two owners
        v = w * 1
        loss = (v + v).sum()
    else:  # each product's backward makes a fresh gradient: the engine's buffer holds the first alone
        loss = (w * 2).sum() + (w * 3).sum()
    probe = _Probe()
    with probe:
        backward([loss])
    return probe.seen


def calibrate() -> None:
    """Learn, once a process, the counts that tell an argument one owner holds alone. Call it outside any
    backward pass (a step's start); it leaves the in-place path off where the probe gives no clear answer."""
    global _unique_counts
    if _unique_counts is not None or in_backward_pass() or torch.is_inference_mode_enabled():
        return
    try:
        with _disable_current_modes(), torch.enable_grad():
            unique, shared = _probe(shared=False), _probe(shared=True)
    except (RuntimeError, TypeError, AttributeError):  # a release whose engine behaves otherwise: keep the sum
        _unique_counts = False
        return
    ok = len(unique) == 1 and len(shared) == 1 and unique[0][0] < shared[0][0]
    _unique_counts = unique[0] if ok else False


def accumulation_target(func: Any, args: tuple, kwargs: dict, leaves: list[Any], *, recording: bool) -> Storage | None:
    """The storage version of `args[0]` if this call is a backward's sum that can run in place into it.
    `recording`: the runtime records an operation log (a logged step keeps the out-of-place sum)."""
    if func is not _ADD or not _unique_counts or recording or kwargs.keys() - {"alpha"}:
        return None
    if not compat.uses_storage_swap():  # a release without the swap, or a test of the in-place refill path
        return None
    if not in_backward_pass() or torch.is_grad_enabled() or len(args) != 2:
        return None
    a, b = args
    value = leaves[0]
    if not (isinstance(b, torch.Tensor) and isinstance(value, TensorValue)):
        return None
    storage = value.storage
    if (
        storage.producer is None  # an outside tensor (parameter, input): never written
        or storage.handles != 1
        or storage.locks
        or not storage.resident
        or a.shape != b.shape
        or a.dtype != b.dtype
        or a.device != b.device
        or a.requires_grad
        or a.numel() == 0
        or a.storage_offset() != 0
        or not a.is_contiguous()
        or a.untyped_storage().nbytes() != a.numel() * a.element_size()
        or storage_key(a) == storage_key(b)
    ):
        return None
    # The counts of a tensor one owner holds differ with the calling context (one less inside an implicit step
    # than under `with rt:`, for both arguments alike): the first argument may show no more owners than the
    # second (the gradient the node just made) and than the calibration's lone buffer.
    uses, storage_uses = _counts(a)
    unique_uses, unique_storage_uses = _unique_counts  # type: ignore[misc]
    if uses > min(unique_uses, b._use_count()) or storage_uses > unique_storage_uses:
        return None
    return storage


def add_in_place(args: tuple, kwargs: dict) -> torch.Tensor:
    """`a + b` computed into `a`'s bytes, which move to the result's own storage; `a` keeps an empty storage
    (the runtime records its version as consumed: it reads as its old value again once recomputed)."""
    a, b = args
    torch.ops.aten.add_.Tensor(a, b, **kwargs)
    bytes_of_a = a.untyped_storage()
    moved = torch.UntypedStorage(0, device=a.device)
    compat.swap_storage_data(moved, bytes_of_a)
    return torch.empty((0,), dtype=a.dtype, device=a.device).set_(moved, 0, a.shape, a.stride())
