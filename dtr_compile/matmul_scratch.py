"""Scratch memory of 16-bit matrix multiplies on CPU, measured once per call shape.

A bf16 or fp16 `mm`, `addmm`, `bmm` or `baddbmm` on CPU allocates buffers it frees before it returns: oneDNN
reorders an operand into its blocked (AMX, VNNI) layout, copies a transposed one, and where the CPU has no
16-bit arithmetic it converts to float32. How much depends on the instruction set, the thread count and the
library's blocking. On the development machine (AMX, 1-2 threads) a bf16 product took about its packed second
operand for small shapes, capped near 1 MB per thread for large ones, and more with a transposed first operand;
fp16 took float32 copies. No formula holds across machines, so each distinct call (op, shapes, strides, dtype,
threads) is run once, on zeros, under the profiler, and its scratch (peak less output) is remembered for the
process. A memory model that counted outputs only missed 141 KB at the peak of a tiny GPT-2's bf16 backward:
Trainer's bf16 recipe measured 1.04x its budget with no error.

Only one profiler session can run. While the program runs one of its own (measuring its step) a call seen for the
first time cannot be measured: `FALLBACK` stands in for it, a bound that covered every shape measured on the
development machine, and it is not remembered, so the call is measured when it is next seen with no profiler.

float32 products and every CUDA call report 0: they showed no per-call scratch (cuBLAS keeps its workspace
for the process, allocated before any step).

On the ground floor: the planner (passes/costs.py) and the runtime (runtime/workspace.py) both
ask it, so a compiled plan and an eager step count the same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from . import compat
from .planned_sizes import planned_value
from .profiled_allocations import measure_each_peak

_aten = torch.ops.aten
MATMULS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default})
SIXTEEN_BIT = (torch.bfloat16, torch.float16)

# A call's key: the op, (shape, strides, dtype) of each tensor argument and the scalar arguments, the thread count.
Key = tuple
_measured: dict[Key, int] = {}


def has_scratch(func: Any, args: tuple) -> bool:
    """Is this a 16-bit matmul on CPU, whose scratch must be measured?"""
    if func not in MATMULS:
        return False
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return bool(tensors) and tensors[-1].device.type == "cpu" and tensors[-1].dtype in SIXTEEN_BIT


def scratch_bytes(func: Any, args: tuple) -> int:
    """Temporary bytes of `func(*args)` (real or fake tensors), measured on first sight; 0 where none is made."""
    if not has_scratch(func, args):
        return 0
    key = _key(func, args)
    if key not in _measured:
        measure_missing([(func, args)])
    measured = _measured.get(key)
    return measured if measured is not None else _fallback(args)


def known(func: Any, args: tuple) -> bool:
    """Is the scratch of `func(*args)` settled: none, or measured (not the stand-in `FALLBACK` bound)? A caller that
    remembers a call's workspace remembers only a settled one."""
    return not has_scratch(func, args) or _key(func, args) in _measured


def measure_missing(calls: Iterable[tuple[Any, tuple]]) -> None:
    """Measure the scratch of every call not yet measured, in one profiler session (a session costs milliseconds;
    a graph has a few dozen matmul shapes). Nothing while another profiler runs: `scratch_bytes` then falls back."""
    missing: dict[Key, tuple[Any, tuple]] = {}
    for func, args in calls:
        if has_scratch(func, args):
            key = _key(func, args)
            if key not in _measured:
                missing.setdefault(key, (func, args))
    if not missing or torch._C._autograd._profiler_enabled():
        return
    # Outside every mode: a fake mode would make the zeros fake, the runtime's mode would count the probe's
    # allocations as the step's. No autograd: a product of leaves would save them.
    with _disable_current_modes(), torch.no_grad():
        runs = [_runner(func, args) for func, args in missing.values()]
        peaks = measure_each_peak(runs)
    if peaks is None:  # the profiler recorded nothing of this thread: the fallback stands in
        return
    for (key, (func, args)), run, peak in zip(missing.items(), runs, peaks, strict=True):
        _measured[key] = max(0, peak - run.output_bytes)


class _runner:
    """`func` on zero tensors shaped as `args`, made before the measurement so only the call's own bytes count."""

    def __init__(self, func: Any, args: tuple) -> None:
        self.func = func
        self.args = tuple(_zeros_like(a) for a in args)
        self.output_bytes = 0

    def __call__(self) -> None:
        out = self.func(*self.args)
        self.output_bytes = out.numel() * out.element_size()


# 2 x the float32 copies of both operands and the result, and 256 KiB a thread: above every call measured on the
# development machine (bf16 and fp16; mm, addmm, bmm, baddbmm; 16 to 3072 on each side; either operand
# transposed; 1 and 2 threads). The largest excess of a measured call over the float32 copies alone was 198 KB.
FALLBACK_PER_THREAD = 256 << 10


def _fallback(args: tuple) -> int:
    copies = sum(math.prod(_hints(a.shape)) * 4 for a in args if isinstance(a, torch.Tensor))
    return 2 * copies + FALLBACK_PER_THREAD * torch.get_num_threads()


def _key(func: Any, args: tuple) -> Key:
    return (func, tuple(_describe(a) for a in args), torch.get_num_threads())


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (_hints(value.shape), _hints(value.stride()), value.dtype)
    return value


def _hints(sizes: Iterable[Any]) -> tuple[int, ...]:
    """Concrete sizes: a symbolic one's value at the sizes a plan is made at, else its hint (as tensor_bytes.py,
    a floor above this module)."""
    return tuple(_hint(s) for s in sizes)


def _hint(size: Any) -> int:
    planned = planned_value(size)
    return planned if planned is not None else compat.size_hint(size, 4096)


def _zeros_like(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty_strided(_hints(value.shape), _hints(value.stride()), dtype=value.dtype, device="cpu").zero_()
