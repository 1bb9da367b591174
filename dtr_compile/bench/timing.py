"""The one timing loop of every benchmark: a timed call, warm-ups then timed steps, and side-by-side rounds.

Every suite of `python -m dtr_compile.bench` times steps with these helpers, so that "step time" means one
thing everywhere: the wall time and the process CPU time of one call, read from an idle device (CUDA queues
kernels asynchronously, so the device is synchronized before and after), reported as a median.

Side by side: ways compared in one process are timed in interleaved rounds (one step of each way per round,
optionally in a rotating order), so that drift of a shared machine (another job starting, the CPU clocking
down) hits every way alike instead of the one that happened to run last.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from ..measure import synchronize

T = TypeVar("T")
W = TypeVar("W")


@dataclass(frozen=True)
class Sample:
    """One timed call: wall seconds, and CPU seconds of this process (steady when other jobs share the machine,
    but it sums threads and misses GPU work: meaningful on CPU with one thread)."""

    wall_s: float
    cpu_s: float


def timed(fn: Callable[[], T], device: str | torch.device = "cpu") -> tuple[T, Sample]:
    """`fn()` and how long it took, timed from and to an idle `device`."""
    synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    synchronize(device)
    return result, Sample(time.perf_counter() - wall, time.process_time() - cpu)


def warm_then_time(
    step: Callable[[], object],
    warmup: int,
    steps: int,
    device: str | torch.device = "cpu",
    setup: Callable[[], object] | None = None,
) -> tuple[list[Sample], list[Sample]]:
    """`warmup` steps (the first includes any compile), then `steps` timed steps: the samples of each.

    `setup` runs before every step, outside the clock (clearing gradients, so they count in the step)."""

    def one() -> Sample:
        if setup is not None:
            setup()
        return timed(step, device)[1]

    return [one() for _ in range(warmup)], [one() for _ in range(steps)]


def interleaved(ways: Sequence[W], rounds: int, *, per_round: int = 1, rotate: bool = False) -> Iterator[W]:
    """The order in which to step `ways` side by side: `rounds` rounds, `per_round` steps of each way per round;
    with `rotate`, round r starts at way r (so that no way always follows the same one)."""
    for round_ in range(rounds):
        order = [ways[(round_ + k) % len(ways)] for k in range(len(ways))] if rotate else list(ways)
        for way in order:
            for _ in range(per_round):
                yield way


def median(values: Sequence[float]) -> float:
    """The median of `values`, NaN for none (a way that never ran)."""
    return statistics.median(values) if values else float("nan")
