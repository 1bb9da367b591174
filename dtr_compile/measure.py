"""Measured peak memory of a step, exactly as DESIGN.md defines it. Never our own accounting.

- CPU: the profiler's allocation events (they see eager, aot_eager and Inductor allocations alike),
  sorted by time; the peak of the running sum of allocated (positive) and freed (negative) bytes. A profile
  that lacks the meter's own probe allocation recorded nothing: a `MeasurementError`, never a peak of 0.
- CUDA: `torch.cuda.max_memory_allocated()` minus the bytes allocated when the step began.

Both report bytes allocated *above what was live when the step began*.

Every command and example (the demo, the bench, examples/, explain) picks its device here too:
`add_device_argument` gives a parser `--device cuda|cpu` defaulting to CUDA when one is present, and
`resolve_device` turns the choice into a torch.device, or a `DeviceError` saying what to change. Step times
on CUDA are taken between `synchronize(device)` calls, since kernels run asynchronously to the host.
"""

from __future__ import annotations

import argparse
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .errors import DeviceError, MeasurementError

T = TypeVar("T")


@dataclass(frozen=True)
class PeakMeasurement:
    peak_bytes: int  # highest running total above the start of the step
    allocated_bytes: int  # sum of all allocations (traffic, not a peak)
    net_bytes: int  # bytes still allocated at the end of the step (e.g. gradients)
    events: int


def measure_peak(step: Callable[[], T], device: str | torch.device = "cpu") -> tuple[T, PeakMeasurement]:
    """Run `step()` once and measure its peak memory on `device`: the allocator's statistics on CUDA,
    the profiler's allocation events on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"measure_peak on {device}: {NO_CUDA}")
        return _measure_cuda(step, device)
    if device.type != "cpu":
        raise DeviceError(f"measure_peak supports 'cpu' and 'cuda' devices, not {device}")
    return _measure_cpu(step)


# ------------------------------------------------------------------------------------------ devices

NO_CUDA = "no CUDA device is available here (torch.cuda.is_available() is False); use --device cpu"


def default_device() -> str:
    """The default of every command's --device: "cuda" when a CUDA device is present, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(requested: str | torch.device | None = None) -> torch.device:
    """`requested` as a torch.device (None: `default_device()`); a `DeviceError` that says what to change
    for anything but cpu, cuda or cuda:N, and for CUDA on a machine without it."""
    if requested is None:
        return torch.device(default_device())
    try:
        device = torch.device(requested)
    except (RuntimeError, TypeError):
        raise DeviceError(f"device {requested!r}: expected cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise DeviceError(f"device {requested!r}: expected cpu, cuda or cuda:N (dtr_compile measures peaks there)")
    if not torch.cuda.is_available():
        raise DeviceError(f"device {requested!r}: {NO_CUDA}")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise DeviceError(
            f"device {requested!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
            f"cuda:0 to cuda:{torch.cuda.device_count() - 1}"
        )
    return device


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """`--device cuda|cpu|cuda:N`, defaulting to CUDA when one is present; read it with `device_from_args`."""
    parser.add_argument(
        "--device",
        default=None,
        help=f"cuda, cuda:N or cpu (default: cuda when a CUDA device is present, else cpu; here: {default_device()})",
    )


def device_from_args(parser: argparse.ArgumentParser, requested: str | None) -> torch.device:
    """`resolve_device(requested)`; a bad choice exits through `parser.error` (status 2) with its message."""
    try:
        return resolve_device(requested)
    except DeviceError as exc:
        parser.error(f"--device: {exc}")
        raise  # parser.error exits; this line is for type checkers


def synchronize(device: str | torch.device) -> None:
    """Wait for `device`'s queued kernels (CUDA runs them asynchronously): call it before reading a clock."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: str | torch.device) -> str:
    """The processor or GPU a figure was taken on, in words."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} cores)"


def move_to(value: Any, device: str | torch.device) -> Any:
    """`value` with every tensor in it (nested tuples, lists, dicts) moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(move_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: move_to(v, device) for k, v in value.items()}
    return value


# The meter's own probe, allocated and freed inside the profiled region just before the step: its two events
# prove that the profiler recorded this thread's allocations, so an empty profile is refused (MeasurementError)
# instead of read as a step that allocated nothing. It is freed before the step, so it adds nothing to the peak.
PROBE_BYTES = 64


def _measure_cpu(step: Callable[[], T]) -> tuple[T, PeakMeasurement]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        probe_address = _allocate_and_free_probe()
        result = step()
    sizes = [size for _, size in _after_probe(_allocation_events_in_time_order(prof), probe_address)]
    running = peak = allocated = 0
    for size in sizes:
        running += size
        if size > 0:
            allocated += size
        peak = max(peak, running)
    return result, PeakMeasurement(peak_bytes=peak, allocated_bytes=allocated, net_bytes=running, events=len(sizes))


def _allocate_and_free_probe() -> int:
    """Allocate PROBE_BYTES and free them at once; the address the profiler's two events will carry."""
    probe = torch.empty(PROBE_BYTES, dtype=torch.uint8)
    address = probe.data_ptr()
    del probe  # the only reference: the storage is freed here, before the step
    return address


def _allocation_events_in_time_order(prof: Any) -> list[tuple[int, int]]:
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


def _after_probe(events: list[tuple[int, int]], probe_address: int) -> list[tuple[int, int]]:
    """The events after the probe's free: the step's. A `MeasurementError` if the probe's events are missing,
    since then the profiler recorded nothing of this thread and a peak of 0 would be silently wrong."""
    try:
        allocated = events.index((probe_address, PROBE_BYTES))
        freed = events.index((probe_address, -PROBE_BYTES), allocated)
    except ValueError:
        raise MeasurementError(
            f"measure_peak on cpu: the profiler recorded no memory events for this step (not even the meter's own "
            f"{PROBE_BYTES}-byte probe allocated just before it; {len(events)} allocation events in all), so its "
            "peak is unknown. Another torch.profiler session started or stopped during the step, or the profiler "
            "failed to start: run the step with no other profiler active, or measure it again in a fresh process."
        ) from None
    return events[freed + 1 :]


def _measure_cuda(step: Callable[[], T], device: torch.device) -> tuple[T, PeakMeasurement]:
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - start
    end = torch.cuda.memory_allocated(device) - start
    return result, PeakMeasurement(peak_bytes=peak, allocated_bytes=-1, net_bytes=end, events=-1)
