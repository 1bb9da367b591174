"""Measured peak memory of a step, exactly as DESIGN.md defines it. Never our own accounting.

- CPU: the profiler's allocation events (they see eager, aot_eager and Inductor allocations alike),
  sorted by time; the peak of the running sum of allocated (positive) and freed (negative) bytes.
- CUDA: `torch.cuda.max_memory_allocated()` minus the bytes allocated when the step began.

Both report bytes allocated *above what was live when the step began*.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class PeakMeasurement:
    peak_bytes: int  # highest running total above the start of the step
    allocated_bytes: int  # sum of all allocations (traffic, not a peak)
    net_bytes: int  # bytes still allocated at the end of the step (e.g. gradients)
    events: int


def measure_peak(step: Callable[[], T], device: str | torch.device = "cpu") -> tuple[T, PeakMeasurement]:
    """Run `step()` once and measure its peak memory on `device`."""
    device = torch.device(device)
    if device.type == "cuda":
        return _measure_cuda(step, device)
    if device.type != "cpu":
        raise ValueError(f"measure_peak supports 'cpu' and 'cuda' devices, not {device}")
    return _measure_cpu(step)


def _measure_cpu(step: Callable[[], T]) -> tuple[T, PeakMeasurement]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = step()
    sizes = _allocation_sizes_in_time_order(prof)
    running = peak = allocated = 0
    for size in sizes:
        running += size
        if size > 0:
            allocated += size
        peak = max(peak, running)
    return result, PeakMeasurement(peak_bytes=peak, allocated_bytes=allocated, net_bytes=running, events=len(sizes))


def _allocation_sizes_in_time_order(prof: Any) -> list[int]:
    allocation = torch._C._profiler._EventType.Allocation
    events: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == allocation:
            # The sequence number keeps an allocation and a free with the same timestamp in order.
            events.append((node.start_time_ns, len(events), int(node.extra_fields.alloc_size)))
        stack.extend(node.children)
    events.sort()
    return [size for _, _, size in events]


def _measure_cuda(step: Callable[[], T], device: torch.device) -> tuple[T, PeakMeasurement]:
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - start
    end = torch.cuda.memory_allocated(device) - start
    return result, PeakMeasurement(peak_bytes=peak, allocated_bytes=-1, net_bytes=end, events=-1)
