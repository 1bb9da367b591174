"""Measured peak memory of a step, exactly as DESIGN.md defines it. Never our own accounting.

- CPU: the profiler's allocation events (they see eager, aot_eager and Inductor allocations alike),
  sorted by time; the peak of the running sum of allocated (positive) and freed (negative) bytes.
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

from .errors import DeviceError

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
