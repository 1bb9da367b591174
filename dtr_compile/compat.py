"""The private torch APIs whose presence or signature varies across the supported releases (2.11 to 2.15).

Everything else in the package imports torch's public names, or private names that every supported release
has in the same form; what differs is chosen here, by FEATURE (does the attribute exist, does the call take
the argument), never by comparing version strings, so that a patch release or a backport is handled by what
it actually offers.

What we depend on, and why:

- `torch.UntypedStorage._swap_data_ptr_` (2.13+, missing in 2.11): the eager runtime refills an evicted
  storage behind the same tensor objects. Evicting resizes the torch storage that the program's tensors view
  to 0 bytes; a recompute makes the bytes in a fresh storage and swaps its data pointer in, without a copy.
  Without it, `refill_in_place` says so and the runtime resizes the evicted storage back and has the
  recompute write into it (runtime/values.py, runtime/recipe.py): no copy for ops with an `out=` overload,
  one copy for the rest. `storage_swap(False)` forces that path on releases that have the swap, so CI tests
  both paths on every release.
- `torch.fx.experimental.symbolic_shapes.optimization_hint(expr, fallback=)` (2.13+; 2.11 names it
  `size_hint(expr, fallback=)`): the number a symbolic size stands for, without a guard, when the passes and
  the roofline model count bytes of tensors with dynamic shapes (`size_hint` below).

- `torch.autograd.Function.boxed_grads_call` (2.13+, missing in 2.11): AOTAutograd's compiled backward takes
  its incoming gradients as a list it empties as it goes, so each is freed after its last use. torch 2.11
  passes them as a tuple the autograd engine holds until the backward returns: a compiled backward that runs
  op by op under a tight budget keeps its incoming gradients resident throughout (`FREES_BACKWARD_GRADS`).
  Nothing the runtime may do frees them (the engine can hand the same tensor to another node), so on 2.11
  such a step can need more than the no-remat peak the calibration measured (tests/runtime/test_fault_matrix.py
  names the case). A compiled region's plan holds them through the backward once a step has seen one outlive it
  (passes/storage.HELD_META_KEY; tests/e2e/test_held_gradients.py): freed after their last read in every memory
  model, a cross-entropy's logits gradient put a 5-layer MLP at 1.10x its budget.

- `torch._C._ForceDispatchKeyGuard` around a TorchDynamo-compiled frame's call (2.13+; 2.11 calls the frame
  without it): when the call returns, the dispatch keys enabled when it began are put back. A compiled model's first
  step begins inside that call (runtime/implicit.py), so on 2.13+ the runtime's dispatch mode, pushed there, sees
  nothing of the code after the model (the loss), and the runtime makes room for it instead; on 2.11 it sees it
  all (`DYNAMO_RESTORES_DISPATCH_KEYS`, read off the source of `torch._dynamo.eval_frame`: the guard is a local
  of the call, with no attribute to test).

Every other private torch name the package uses (about 160 references: dispatch modes, AOTAutograd, Inductor's
partitioner hooks, the profiler's event tree, storage weak references) is the same on 2.11, 2.13 and 2.15;
tests/compat/test_private_names.py checks that each resolves, on every release CI runs.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch._dynamo.eval_frame
import torch.fx.experimental.symbolic_shapes as _symbolic_shapes

__all__ = [
    "DYNAMO_RESTORES_DISPATCH_KEYS",
    "FREES_BACKWARD_GRADS",
    "HAS_STORAGE_SWAP",
    "set_storage_swap",
    "size_hint",
    "swap_storage_data",
    "uses_storage_swap",
]

HAS_STORAGE_SWAP: bool = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
# Whether a compiled backward frees each incoming gradient after its last use (see the module docstring).
FREES_BACKWARD_GRADS: bool = hasattr(torch.autograd.Function, "boxed_grads_call")
# Whether a compiled frame's call restores the dispatch keys when it returns (see the module docstring).
DYNAMO_RESTORES_DISPATCH_KEYS: bool = "_ForceDispatchKeyGuard" in inspect.getsource(torch._dynamo.eval_frame)
_use_swap = HAS_STORAGE_SWAP


def uses_storage_swap() -> bool:
    """Whether refills swap data pointers (True) or write into the evicted storage resized back (False)."""
    return _use_swap


def set_storage_swap(enabled: bool) -> bool:
    """Refill by swapping data pointers (`enabled`) or in place; returns the previous setting. Tests run the
    in-place path on releases that have the swap through `runtime.refill.storage_swap`, which checks the value."""
    global _use_swap
    previous, _use_swap = _use_swap, enabled
    return previous


def swap_storage_data(target: torch.UntypedStorage, fresh: torch.UntypedStorage) -> None:
    """Give `target` the bytes of `fresh` (which is left empty) without a copy. Only where `uses_storage_swap()`."""
    target._swap_data_ptr_(fresh)


_optimization_hint = getattr(_symbolic_shapes, "optimization_hint", None) or _symbolic_shapes.size_hint


def size_hint(size: Any, fallback: int = 4096) -> int:
    """The concrete value a (possibly symbolic) size stands for, without adding a guard; `fallback` when it
    has no hint (an unbacked size)."""
    return int(_optimization_hint(size, fallback=fallback))
