"""Predict how many fresh bytes an aten call will allocate, before it runs.

The engine must make room *before* an allocation (the DTR prototype checked after each op and
overshot its budget by 60%). We run the op once on meta tensors of the same shapes and cache the
answer per call signature, so a training loop pays the meta run only in its first step.
"""

from __future__ import annotations

from typing import Any, Hashable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

_META = torch.device("meta")
_CACHE_LIMIT = 200_000  # signatures; a pathological dynamic model must not grow the cache forever


def returns_only_views(func: torch._ops.OpOverload) -> bool:
    """True when every tensor the op returns aliases an argument (views, in-place ops): no fresh bytes."""
    returns = func._schema.returns
    return all(r.alias_info is not None for r in returns)


class OutputSizer:
    """Caches the fresh output bytes of each call signature (op, argument shapes/strides/dtypes, scalars)."""

    def __init__(self) -> None:
        self._cache: dict[Hashable, int | None] = {}

    def fresh_bytes(self, func: torch._ops.OpOverload, flat: list[Any], spec: Any) -> int | None:
        """Bytes of the op's non-aliasing outputs, or None when they depend on data (e.g. nonzero)."""
        if returns_only_views(func):
            return 0
        key = _signature(func, flat)
        if key is None:
            return self._predict(func, flat, spec)
        try:
            return self._cache[key]
        except KeyError:
            pass
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.clear()
        result = self._cache[key] = self._predict(func, flat, spec)
        return result

    @staticmethod
    def _predict(func: torch._ops.OpOverload, flat: list[Any], spec: Any) -> int | None:
        meta_flat = [_to_meta(x) for x in flat]
        args, kwargs = tree_unflatten(meta_flat, spec)
        try:
            out = func(*args, **kwargs)
        except Exception:  # data-dependent output shapes or no meta kernel: measured after the call instead
            return None
        fresh = [r.alias_info is None for r in func._schema.returns]
        outs = out if isinstance(out, (tuple, list)) and len(func._schema.returns) > 1 else (out,)
        total = 0
        for is_fresh, o in zip(fresh, outs):
            if not is_fresh:
                continue
            for leaf in tree_flatten(o)[0]:
                if isinstance(leaf, torch.Tensor):
                    total += leaf.untyped_storage().nbytes()
        return total


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=_META)
    if isinstance(x, torch.device):
        return _META  # factory calls (zeros, empty, arange...) must not allocate for real
    return x


def _signature(func: torch._ops.OpOverload, flat: list[Any]) -> Hashable | None:
    parts: list[Hashable] = [func]
    for x in flat:
        if isinstance(x, torch.Tensor):
            parts.append((tuple(x.shape), x.stride(), x.dtype))
        elif isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                            torch.memory_format)):
            parts.append((type(x), x))  # the type too: 1, 1.0 and True hash alike
        else:
            return None  # unhashable or unusual argument: do not cache
    return tuple(parts)
