"""Predict how many fresh bytes an aten call will allocate, before it runs.

The engine must make room *before* an allocation (the DTR prototype checked after each op and
overshot its budget by 60%). We run the op once on meta tensors of the same shapes and cache the
answer per call signature, so a training loop pays the meta run only in its first step.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .calls import unflatten_call

_META = torch.device("meta")
_CACHE_LIMIT = 200_000  # signatures; a pathological dynamic model must not grow the cache forever


class CallFacts:
    """What the runtime learned about one call signature: fresh output bytes and compute cost."""

    __slots__ = ("cost", "fresh_bytes", "workspace")

    def __init__(self, fresh_bytes: int | None) -> None:
        self.fresh_bytes = fresh_bytes  # None when the outputs' size depends on data (e.g. nonzero)
        self.cost: float | None = None  # the engine's cost of the call, set after its first run
        self.workspace: int | None = None  # temporary bytes while the op runs (workspace.py), set on first use

    def observe(self, seconds: float, estimate: Callable[[], float], measure: bool) -> float:
        """The cost to charge for a call that took `seconds`: the roofline estimate (computed once per
        signature; the same on every run), or with `measure` the fastest time seen, since on a shared
        machine a slow run measures the neighbours, and a noisy cost makes the eviction choices noisy."""
        if measure:
            self.cost = seconds if self.cost is None else min(self.cost, seconds)
        elif self.cost is None:
            self.cost = estimate()
        return self.cost


class OutputSizer:
    """Caches `CallFacts` per call signature (op, argument shapes/strides/dtypes, scalars)."""

    def __init__(self) -> None:
        self._cache: dict[Hashable, CallFacts] = {}

    def facts(self, func: torch._ops.OpOverload, flat: list[Any], spec: Any, only_views: bool) -> CallFacts:
        key = _signature(func, flat)
        if key is not None:
            found = self._cache.get(key)
            if found is not None:
                return found
        facts = CallFacts(0 if only_views else self._predict(func, flat, spec))
        if key is not None:
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            self._cache[key] = facts
        return facts

    @staticmethod
    def _predict(func: torch._ops.OpOverload, flat: list[Any], spec: Any) -> int | None:
        meta_flat = [_to_meta(x) for x in flat]
        args, kwargs = unflatten_call(meta_flat, spec)
        try:
            out = func(*args, **kwargs)
        except Exception:  # noqa: BLE001 -- data-dependent shapes or no meta kernel: measured after the call
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
