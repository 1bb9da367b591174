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
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from .compat import size_hint

# Measured on one core of the development machine (thread CPU time): a 50 MFLOP addmm takes 0.47 ms
# (~1e11 FLOP/s), a 1 MB pointwise op (2 MB moved) 20-60 us. A GPU shifts both sides by a similar factor.
PEAK_FLOPS_PER_S = 1e11
BYTES_PER_S = 4e10
# Fixed cost of one call: an eager aten call pays the dispatcher (a few microseconds); ops that a code
# generator fuses into its neighbours' loops pay almost nothing.
OVERHEAD_S = 2e-6
FUSED_OVERHEAD_S = 1e-6


def has_symbolic_sizes(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in value.shape)


def tensor_bytes(value: Any) -> int:
    """Bytes of a tensor's data. Symbolic sizes count at their hints: converting them to numbers would make
    TorchDynamo specialize the graph to this one size (a guard), and recompile at every new size."""
    if not isinstance(value, torch.Tensor):
        return 0
    if has_symbolic_sizes(value):
        numel = 1
        for size in value.shape:
            numel *= size_hint(size)
        return numel * value.element_size()
    return value.numel() * value.element_size()


def at_hints(value: Any) -> Any:
    """A meta tensor with `value`'s sizes at their hints (a formula can compute on it without guards)."""
    if not has_symbolic_sizes(value):
        return value
    return torch.empty_strided([size_hint(s) for s in value.shape], [size_hint(s) for s in value.stride()],
                               dtype=value.dtype, device="meta")


def call_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of `func(*args, **kwargs) -> out` by PyTorch's formula; 0 for ops without one. Symbolic sizes
    count at their hints (see `tensor_bytes`)."""
    packet = getattr(func, "overloadpacket", None)
    formula = flop_registry.get(packet) if packet is not None else None
    if formula is None:
        return 0
    if any(has_symbolic_sizes(x) for x in tree_flatten((args, kwargs, out))[0]):
        args, kwargs, out = tree_map(at_hints, (args, kwargs, out))
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 - a formula that rejects these arguments: the op is costed by bytes
        return 0


def estimate_seconds(flops: int, bytes_moved: int, overhead_s: float = OVERHEAD_S) -> float:
    return max(flops / PEAK_FLOPS_PER_S, bytes_moved / BYTES_PER_S) + overhead_s


def estimate_call(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
    """Estimated seconds of one call, from its real (or fake) arguments and result."""
    read = sum(tensor_bytes(x) for x in tree_flatten((args, kwargs))[0])
    written = sum(tensor_bytes(x) for x in tree_flatten(out)[0])
    return estimate_seconds(call_flops(func, args, kwargs, out), read + written)
