"""The allocation events of a CPU profile, read in one place (measure.py and matmul_scratch.py measure with them).

On CPU no allocator keeps statistics: the profiler's memory events (every allocation and free, with its address
and size) are the only measurement. A probe of a known size, allocated and freed inside the profiled region just
before what is measured, proves that the profiler recorded this thread's allocations (an empty profile is then
refused instead of read as nothing allocated) and marks where the measured code begins.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

import torch

PROBE_BYTES = 64


def allocate_and_free_probe(nbytes: int) -> int:
    """Allocate `nbytes` and free them at once; the address the profiler's two events will carry."""
    probe = torch.empty(nbytes, dtype=torch.uint8)
    address = probe.data_ptr()
    del probe  # the only reference: the storage is freed here
    return address


def allocation_events_in_time_order(prof: Any) -> list[tuple[int, int]]:
    """(address, bytes) of every allocation (positive) and free (negative) the profile holds, in time order."""
    allocation = torch._C._profiler._EventType.Allocation
    events: list[tuple[int, int, int, int]] = []
    stack = list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while stack:  # pre-order, children in the order they were recorded
        node = stack.pop()
        if node.tag == allocation:
            # The sequence number keeps an allocation and a free with the same timestamp in order.
            fields = node.extra_fields
            events.append((node.start_time_ns, len(events), int(fields.ptr), int(fields.alloc_size)))
        stack.extend(reversed(node.children))
    events.sort()
    return [(address, size) for _, _, address, size in events]


def peak_from(events: list[tuple[int, int]], first: int, running: int) -> int:
    """The highest running total from event `first` on, starting at `running`."""
    peak = running
    for _, size in events[first:]:
        running += size
        peak = max(peak, running)
    return peak


def probe_span(events: list[tuple[int, int]], address: int) -> tuple[int, int] | None:
    """Indices of a probe's allocation and free among `events`, or None if the profile lacks them."""
    try:
        allocated = events.index((address, PROBE_BYTES))
        return allocated, events.index((address, -PROBE_BYTES), allocated)
    except ValueError:
        return None


def measure_each_peak(steps: Sequence[Callable[[], object]]) -> list[int] | None:
    """The peak bytes each of `steps` allocates above its start, run one after another in one CPU profiler session
    (what each returns is dropped before the next runs): many small measurements, and a session costs milliseconds.
    None if the profile lacks the probes between them (the profiler recorded nothing of this thread)."""
    from torch.profiler import ProfilerActivity, profile

    addresses = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for step in steps:
            addresses.append(allocate_and_free_probe(PROBE_BYTES))
            step()
        addresses.append(allocate_and_free_probe(PROBE_BYTES))
    events = allocation_events_in_time_order(prof)
    peaks = []
    for address, following in pairwise(addresses):
        span = probe_span(events, address)
        if span is None:
            return None
        events = events[span[1] + 1 :]
        end = probe_span(events, following)
        if end is None:
            return None
        peaks.append(peak_from(events[: end[0]], 0, 0))
    return peaks
