"""Train a residual MLP under memory budgets with the eager DTR runtime (no compiler involved).

    python examples/01_eager_runtime.py [--device cuda|cpu]     # default: cuda when a CUDA device is present

The no-remat step is measured first; then the same model, from the same weights, trains a few SGD steps
under budgets of None, 0.7, 0.5 and 0.3 of that measured peak. For each budget it prints the measured
peak (`dtr_compile.measure`: the allocator's statistics on CUDA, profiler allocation events on CPU) against the budget, the median step time against
plain eager, whether the losses equal eager's, and the runtime's own counters. A budget below what the
step can run in raises `dtr_compile.BudgetError` (or `ThrashError` when recompute would exceed the original
compute), which names what to change; it is printed, not hidden. Runs on CPU in well under a minute.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import dtr_compile
from dtr_compile.measure import add_device_argument, device_from_args, measure_peak, synchronize

FRACTIONS = (None, 0.7, 0.5, 0.3)
STEPS = 3  # timed SGD steps per budget, after one warm-up step; the peak is measured on one more
MiB = 2**20


class Block(nn.Module):
    """Pre-norm residual MLP block: its four activations per layer are what the runtime may evict."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 128), *[Block(128) for _ in range(8)], nn.Linear(128, 10))


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, rt: dtr_compile.runtime.Runtime | None) -> dict:
    """Warm-up step, STEPS timed steps, one measured step, on the device of `x`. `rt=None` is plain eager."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def forward_backward() -> float:
        optimizer.zero_grad(set_to_none=True)  # gradients count in the step's peak
        if rt is None:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss.item()
        with rt:  # one Runtime reused across steps: its caches stay warm
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss.item()

    losses, times = [], []
    for i in range(STEPS + 1):
        synchronize(x.device)  # CUDA runs kernels asynchronously: time from and to an idle device
        start = time.perf_counter()
        losses.append(forward_backward())
        optimizer.step()
        synchronize(x.device)
        if i > 0:
            times.append(time.perf_counter() - start)
    loss, measured = measure_peak(forward_backward, x.device)
    optimizer.step()
    losses.append(loss)
    return {"losses": losses, "median_s": statistics.median(times), "peak": measured.peak_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    device = device_from_args(parser, parser.parse_args().device)
    # One thread: a model this small gains little from more, and the timings stay steady on a shared machine.
    torch.set_num_threads(1)
    initial = make_model().to(device)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2048, 128, generator=g).to(device), torch.randint(0, 10, (2048,), generator=g).to(device)
    eager = train(copy.deepcopy(initial), x, y, rt=None)
    print(f"device: {device}")
    print(f"plain eager: measured peak {eager['peak'] / MiB:.1f} MiB, median step {eager['median_s'] * 1e3:.0f} ms\n")
    print(f"{'budget':>16} {'measured peak':>14} {'peak/budget':>12} {'time x eager':>13} {'losses':>8}  runtime stats")
    for fraction in FRACTIONS:
        budget = None if fraction is None else int(fraction * eager["peak"])
        label = "none" if fraction is None else f"{fraction} ({budget / MiB:.1f} MiB)"
        rt = dtr_compile.runtime.enable(memory_budget=budget)
        try:
            result = train(copy.deepcopy(initial), x, y, rt)
        except dtr_compile.DTRError as exc:  # infeasible budget or thrashing: the message says what to change
            print(f"{label:>16} {type(exc).__name__}: {exc}")
            continue
        ratio = "-" if budget is None else f"{result['peak'] / budget:.2f}"
        same = "equal" if result["losses"] == eager["losses"] else "DIFFER"
        print(
            f"{label:>16} {result['peak'] / MiB:>10.1f} MiB {ratio:>12} {result['median_s'] / eager['median_s']:>13.2f}"
            f" {same:>8}  {rt.stats()}"
        )


if __name__ == "__main__":
    main()
