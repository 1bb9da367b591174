"""Refilling an evicted storage where torch cannot swap data pointers (compat.uses_storage_swap() is False).

The program's tensors view the evicted torch storage itself, so its bytes must come back into that storage.
With the swap (torch 2.13+), a recompute makes its result in a fresh storage and the pointers are swapped:
no copy. Without it, the cheapest way is for the recompute to write into the evicted storage, resized back
to its bytes first (values.Buffer.reopen): an aten op that has an `out=` overload with a kernel of its own
for the device (a structured kernel, not a generated "call the op, then copy" wrapper, which would allocate
the value twice) writes its results through `out=` into views of the reopened storages laid out as the
first results were. Every other recompute (compiled code, ops without such a kernel) makes its result
elsewhere and `Buffer.fill` copies it in: one extra copy of the largest such output at a time, which the
operation's workspace reserves (`copy_refill_bytes`), so the budget still holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .. import compat
from ..errors import ConfigError

_NO_OUT = object()
_OUT_OVERLOADS: dict[Any, Any] = {}  # func -> (out overload, names of its out arguments) or _NO_OUT


def _out_overload(func: Any) -> tuple[Any, tuple[str, ...]] | None:
    """The `out=` overload of an aten overload: same arguments, plus one keyword-only written tensor per result."""
    found = _OUT_OVERLOADS.get(func)
    if found is None:
        found = _OUT_OVERLOADS[func] = _find_out_overload(func) or _NO_OUT
    return None if found is _NO_OUT else found


def _find_out_overload(func: Any) -> tuple[Any, tuple[str, ...]] | None:
    if not isinstance(func, torch._ops.OpOverload):
        return None
    schema = func._schema
    if schema.is_mutable or not schema.returns or any(str(r.type) != "Tensor" for r in schema.returns):
        return None
    signature = [(a.name, str(a.type)) for a in schema.arguments]
    packet = func.overloadpacket
    for name in packet.overloads():
        overload = getattr(packet, name)
        arguments = overload._schema.arguments
        outs = [a for a in arguments if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write]
        rest = [(a.name, str(a.type)) for a in arguments if a not in outs]
        if rest == signature and len(outs) == len(schema.returns):
            return overload, tuple(a.name for a in outs)
    return None


def writes_in_place(func: Any, device: torch.device) -> bool:
    """Whether a recompute of `func` on `device` can write its results into reopened storages directly."""
    found = _out_overload(func)
    if found is None:
        return False
    key = "CUDA" if device.type == "cuda" else "CPU"
    return torch._C._dispatch_has_kernel_for_dispatch_key(found[0].name(), key)


def results_in_place(recipe: Any, device: torch.device) -> bool:
    """Whether a rerun of `recipe` can write its fresh results into reopened storages (`invoke_into`)."""
    layouts = [s.layout for s in recipe.sources if s.kind == "fresh"]
    return (
        not recipe.compiled
        and all(layout is not None for layout in layouts)
        and writes_in_place(recipe.func, device)
        and len(layouts) == len(_out_overload(recipe.func)[1])  # type: ignore[index]
    )


def copy_refill_bytes(recipe: Any, out_sizes: list[int], device: torch.device) -> int:
    """Bytes a refill without the storage swap copies at once beyond the value itself: the largest fresh
    output of a recompute that cannot write in place (0 when it can)."""
    fresh = [n for source, n in zip(recipe.sources, out_sizes) if source.kind == "fresh"]
    if not fresh or results_in_place(recipe, device):
        return 0
    return max(fresh)


def invoke_into(recipe: Any, flat: list[Any], targets: dict[int, torch.UntypedStorage]) -> list[Any] | None:
    """Run `recipe`'s aten call with its results written into `targets` (result index -> reopened storage)
    through `out=`; the others into new tensors laid out like the first results. None if that is not possible
    (the caller then runs the call as it is and copies)."""
    layouts = {s.index: s.layout for s in recipe.sources if s.kind == "fresh"}
    device = next(iter(targets.values())).device
    if not results_in_place(recipe, device):
        return None
    overload, out_names = _out_overload(recipe.func)  # type: ignore[misc]
    if sorted(layouts) != list(range(len(out_names))):
        return None  # a result that is not a fresh storage of its own (a view of an argument)
    from .calls import flatten_result, unflatten_call
    from .values import view_of

    outs = {}
    for k, name in enumerate(out_names):
        layout = layouts[k]
        target = targets.get(k)
        if target is not None:
            outs[name] = view_of(target, layout)
        else:  # a result whose first bytes are still resident: the rerun's copy is dropped
            outs[name] = torch.empty_strided(layout.size, layout.stride, dtype=layout.dtype, device=device)
    args, kwargs = unflatten_call(flat, recipe.spec)
    return flatten_result(overload(*args, **kwargs, **outs))[0]


@contextlib.contextmanager
def storage_swap(enabled: bool) -> Iterator[None]:
    """Within the block, refill evicted storages by swapping data pointers (`enabled`, where torch has the
    swap) or by the in-place path every release supports (`False`): tests use it to run this module's path on
    releases that have the swap."""
    if enabled and not compat.HAS_STORAGE_SWAP:
        raise ConfigError(
            f"torch {torch.__version__} has no UntypedStorage._swap_data_ptr_: refills here can only write in "
            "place; use storage_swap(False), or torch 2.13 or later for the swap"
        )
    previous = compat.set_storage_swap(enabled)
    try:
        yield
    finally:
        compat.set_storage_swap(previous)
