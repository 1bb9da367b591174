"""Measured peak memory of a step, exactly as DESIGN.md defines it. Never our own accounting.

- CPU: the profiler's allocation events (they see eager, aot_eager and Inductor allocations alike),
  sorted by time; the peak of the running sum of allocated (positive) and freed (negative) bytes. A profile
  that lacks the meter's own probe allocation recorded nothing: a `MeasurementError`, never a peak of 0.
- CUDA: `torch.cuda.max_memory_allocated()` minus the bytes allocated when the step began.

Both report bytes allocated *above what was live when the step began*. A step may `mark()` points inside itself
(verify.py marks where a region's backward begins): each `Mark` says the bytes live there and the peak from there on.

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
from .profiled_allocations import (
    PROBE_BYTES,
    allocate_and_free_probe,
    allocation_events_in_time_order,
    peak_from,
    probe_span,
)

T = TypeVar("T")


@dataclass(frozen=True)
class PeakMeasurement:
    peak_bytes: int  # highest running total above the start of the step
    allocated_bytes: int  # sum of all allocations (traffic, not a peak)
    net_bytes: int  # bytes still allocated at the end of the step (e.g. gradients)
    events: int
    marks: tuple[Mark, ...] = ()  # one per `mark()` the step called, in order


@dataclass(frozen=True)
class Mark:
    """A point inside a measured step (`mark()`), both figures above the step's start."""

    live_bytes: int  # bytes allocated at the mark
    peak_after_bytes: int  # the highest running total from the mark to the step's end


class _Marks:
    """The marks of the measurement running now: CPU keeps the address of each mark's probe allocation (found again
    among the profiler's events), CUDA reads the allocator at once."""

    def __init__(self, device: torch.device, start: int = 0) -> None:
        self.device = device
        self.start = start
        self.addresses: list[int] = []
        self.cuda: list[tuple[int, int]] = []  # (allocated, peak so far), both above `start`


# Module-wide, not per thread: on CUDA the autograd engine runs a backward (and its hooks, where verify.py marks
# the backward's start) on a device thread of its own.
_marks: _Marks | None = None


def mark() -> None:
    """Note this point of the step `measure_peak` is measuring (nothing when none is)."""
    marks = _marks
    if marks is None:
        return
    if marks.device.type == "cuda":
        allocated = torch.cuda.memory_allocated(marks.device) - marks.start
        marks.cuda.append((allocated, torch.cuda.max_memory_allocated(marks.device) - marks.start))
        torch.cuda.reset_peak_memory_stats(marks.device)  # the peak from here on, read at the next mark or the end
        return
    marks.addresses.append(allocate_and_free_probe(MARK_BYTES))


def measure_peak(step: Callable[[], T], device: str | torch.device = "cpu") -> tuple[T, PeakMeasurement]:
    """Run `step()` once and measure its peak memory on `device`: the allocator's statistics on CUDA,
    the profiler's allocation events on CPU. Measurements do not nest (`mark()` notes the innermost)."""
    global _marks
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"measure_peak on {device}: {NO_CUDA}")
    if device.type not in ("cpu", "cuda"):
        raise DeviceError(f"measure_peak supports 'cpu' and 'cuda' devices, not {device}")
    outer, _marks = _marks, _Marks(device)
    try:
        return _measure_cuda(step, device, _marks) if device.type == "cuda" else _measure_cpu(step, _marks)
    finally:
        _marks = outer


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


# A mark is a probe (profiled_allocations.py) of its own size, allocated and freed inside the step; its two events
# cancel.
MARK_BYTES = 48


def _measure_cpu(step: Callable[[], T], marks: _Marks) -> tuple[T, PeakMeasurement]:
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            probe_address = allocate_and_free_probe(PROBE_BYTES)
            result = step()
    except RuntimeError as error:
        # torch 2.11 refuses to end a session another one inside the step already ended (later releases return an
        # empty profile, which `_after_probe` refuses): the same fault, named the same way.
        if "not running" not in str(error):
            raise
        raise MeasurementError(
            f"measure_peak on cpu: the profiler's session ended inside the step. {_ANOTHER}"
        ) from error
    events, at_marks = _without_marks(_after_probe(allocation_events_in_time_order(prof), probe_address), marks)
    running = peak = allocated = 0
    live_at: dict[int, int] = {}  # event index -> running total before it
    for i, (_, size) in enumerate(events):
        live_at[i] = running
        running += size
        if size > 0:
            allocated += size
        peak = max(peak, running)
    live_at[len(events)] = running
    found = tuple(Mark(live_at[i], peak_from(events, i, live_at[i])) for i in at_marks)
    return result, PeakMeasurement(
        peak_bytes=peak, allocated_bytes=allocated, net_bytes=running, events=len(events), marks=found
    )


def _without_marks(events: list[tuple[int, int]], marks: _Marks) -> tuple[list[tuple[int, int]], list[int]]:
    """The step's events less the marks' own, and where each mark sat among those left (an event index)."""
    pending = list(marks.addresses)
    kept: list[tuple[int, int]] = []
    at_marks: list[int] = []
    i = 0
    while i < len(events):
        address, size = events[i]
        # A mark's allocation is followed at once by its free (a real 48-byte buffer at that address seldom is).
        if pending and (address, size) == (pending[0], MARK_BYTES) and events[i + 1 : i + 2] == [(address, -size)]:
            pending.pop(0)
            at_marks.append(len(kept))
            i += 2
            continue
        kept.append(events[i])
        i += 1
    if pending:
        raise MeasurementError(f"measure_peak on cpu: {len(pending)} of the step's marks are missing from the profile")
    return kept, at_marks


_ANOTHER = (
    "Another torch.profiler session started or stopped during the step, or the profiler failed to start: run the "
    "step with no other profiler active, or measure it again in a fresh process."
)


def _after_probe(events: list[tuple[int, int]], probe_address: int) -> list[tuple[int, int]]:
    """The events after the probe's free: the step's. A `MeasurementError` if the probe's events are missing,
    since then the profiler recorded nothing of this thread and a peak of 0 would be silently wrong."""
    span = probe_span(events, probe_address)
    if span is None:
        raise MeasurementError(
            f"measure_peak on cpu: the profiler recorded no memory events for this step (not even the meter's own "
            f"{PROBE_BYTES}-byte probe allocated just before it; {len(events)} allocation events in all), so its "
            f"peak is unknown. {_ANOTHER}"
        )
    return events[span[1] + 1 :]


def _measure_cuda(step: Callable[[], T], device: torch.device, marks: _Marks) -> tuple[T, PeakMeasurement]:
    torch.cuda.synchronize(device)
    start = marks.start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = step()
    torch.cuda.synchronize(device)
    last = torch.cuda.max_memory_allocated(device) - start  # the peak since the last mark (or the start)
    end = torch.cuda.memory_allocated(device) - start
    # Each mark reset the allocator's peak: the peak after mark i is the highest of the spans that follow it.
    spans = [peak_before for _, peak_before in marks.cuda[1:]] + [last]
    found = tuple(Mark(live, max(spans[i:])) for i, (live, _) in enumerate(marks.cuda))
    peak = max([peak_before for _, peak_before in marks.cuda[:1]] + spans)
    return result, PeakMeasurement(peak_bytes=peak, allocated_bytes=-1, net_bytes=end, events=-1, marks=found)
