"""`memory_budget="auto"`: the budget is what the CUDA device can give the step.

At each step's start: the bytes the device has free (`torch.cuda.mem_get_info`) plus the bytes PyTorch's
caching allocator holds reserved but unallocated (a step allocates from those first), less a margin:

    budget = available - max(AUTO_MARGIN_MIN_BYTES, AUTO_MARGIN_FRACTION * available)

Why a margin, and why this one. The budget bounds *allocated* bytes (`max_memory_allocated`), but a step runs out
of memory on *reserved* bytes, and the caching allocator reserves more than it hands out:
  - it rounds every request up (to 512 B), and serves requests above 1 MiB from segments of at least 20 MiB that
    it splits; a freed piece of a segment serves only requests that fit in it, so after a step of mixed sizes
    (activations, their recomputes and gradients, freed and refilled in a different order than an unbudgeted
    step) some reserved bytes cannot serve the next request: fragmentation, typically 5-10% of the reserved
    bytes in training (the reserved/allocated ratios that `torch.cuda.memory_summary` shows);
  - libraries allocate during the step outside what the budget sees: cuBLAS and cuDNN workspaces (cuBLAS's
    default is up to a few MiB per handle and stream, cuDNN's convolution workspaces are tens of MiB), NCCL's
    buffers under DDP.
10% of the available bytes covers the first, and a floor of 256 MiB covers the second on small devices and
small free amounts. The margin is a guess by design: `memory_budget="auto"` is for "use what is there"; a byte
budget is exact.

The resolved bytes shrink when the allocator reports less (another process, or a growing cache of the program's
own); they grow back only when the gain is at least `AUTO_STEP_BYTES` (so a few bytes of noise in the free
memory do not make compiled regions plan again every step), and are rounded down to a multiple of it.

On CPU there is no device memory to ask: "auto" raises `DeviceError` asking for a number.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import BudgetError, DeviceError

AUTO = "auto"
AUTO_MARGIN_FRACTION = 0.10
AUTO_MARGIN_MIN_BYTES = 256 * 2**20
AUTO_STEP_BYTES = 64 * 2**20

NEEDS_CUDA = (
    "memory_budget='auto' sizes the budget from the free memory of the CUDA device, and no CUDA device is available "
    "here (torch.cuda.is_available() is False); on CPU give a number: bytes ('2GB', '512MiB', 2_000_000_000) or a "
    "fraction in (0, 1] of the step's no-remat peak (0.5)"
)


def check_available() -> None:
    """Raise `DeviceError` if "auto" cannot be resolved here (no CUDA device)."""
    if not torch.cuda.is_available():
        raise DeviceError(NEEDS_CUDA)


def available_bytes(device: Any = None) -> int:
    """Free device bytes plus what the caching allocator holds reserved but unallocated."""
    check_available()
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free) + max(0, int(cached))


def margin_bytes(available: int) -> int:
    return max(AUTO_MARGIN_MIN_BYTES, int(AUTO_MARGIN_FRACTION * available))


def resolve(previous: int | None = None, device: Any = None) -> int:
    """The budget in bytes "auto" stands for now (see the module docstring); `previous`: what it stood for at the
    last step, kept unless the device now gives less, or at least AUTO_STEP_BYTES more."""
    available = available_bytes(device)
    room = available - margin_bytes(available)
    if room < AUTO_STEP_BYTES:
        raise BudgetError(
            f"memory_budget='auto': the CUDA device has {available:,} bytes available (free plus cached), which "
            f"leaves {max(room, 0):,} bytes after the {margin_bytes(available):,}-byte margin for the allocator's "
            "fragmentation; free device memory, or give memory_budget in bytes"
        )
    room -= room % AUTO_STEP_BYTES
    if previous is not None and previous <= room < previous + AUTO_STEP_BYTES * 2:
        return previous
    return room


def concrete(budget: Any, device: Any = None) -> Any:
    """`budget` with "auto" resolved to bytes now; any other budget as it is."""
    return resolve(device=device) if budget == AUTO else budget
