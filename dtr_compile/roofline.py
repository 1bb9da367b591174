"""The estimated time of one aten call: a roofline over its FLOPs and the bytes it moves.

FLOPs come from PyTorch's formulas (`torch.utils.flop_counter`: matmul, convolution, attention); every
other op is memory-bound and costed by the bytes it reads and writes. The estimate is
max(flops / peak flop rate, bytes / bandwidth) plus a fixed launch overhead. Only ratios between ops
matter to an eviction policy, so the constants are the order of magnitude of a few CPU cores (a GPU would
rescale both sides). Unlike a wall-clock timing, the estimate is the same on every run and under any load,
so eviction choices are reproducible.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

PEAK_FLOPS_PER_S = 5e10
BYTES_PER_S = 1e10
OVERHEAD_S = 2e-6


def tensor_bytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def call_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of `func(*args, **kwargs) -> out` by PyTorch's formula; 0 for ops without one."""
    packet = getattr(func, "overloadpacket", None)
    formula = flop_registry.get(packet) if packet is not None else None
    if formula is None:
        return 0
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 - a formula that rejects these arguments: the op is costed by bytes
        return 0


def estimate_seconds(flops: int, bytes_moved: int) -> float:
    return max(flops / PEAK_FLOPS_PER_S, bytes_moved / BYTES_PER_S) + OVERHEAD_S


def estimate_call(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
    """Estimated seconds of one call, from its real (or fake) arguments and result."""
    read = sum(tensor_bytes(x) for x in tree_flatten((args, kwargs))[0])
    written = sum(tensor_bytes(x) for x in tree_flatten(out)[0])
    return estimate_seconds(call_flops(func, args, kwargs, out), read + written)
