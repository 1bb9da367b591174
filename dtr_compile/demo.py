"""`python -m dtr_compile.demo`: train a small built-in model with and without a memory budget.

    python -m dtr_compile.demo                       # GPT-2-style model (random weights), budget 0.5
    python -m dtr_compile.demo --budget 300MB --model mlp --steps 5
    python -m dtr_compile.demo --device cpu         # the default is CUDA when a CUDA device is present

The same model, from the same initial weights, trains a few optimizer steps three ways:
  1. plain eager PyTorch (no budget): its measured peak is the reference;
  2. the eager DTR runtime, `with dtr_compile.runtime.enable(memory_budget=...)`;
  3. `torch.compile(model, backend="dtr")` under `dtr_compile.config.patch(memory_budget=..., codegen="fx")`.
A fractional `--budget` is a fraction of plain eager's measured peak, turned into bytes once so that both
DTR paths get the same absolute budget. Peaks are measured with `dtr_compile.measure.measure_peak` (on CUDA
the allocator's `max_memory_allocated`, on CPU the profiler's allocation events: bytes allocated above what
was live when the step began), never with the runtime's own accounting. Each way runs one warm-up step (the
compile, for torch.compile), `--steps` timed steps (synchronized on CUDA), and one last step under the meter
for the peak; the losses of all steps are compared.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import config
from .errors import ConfigError, format_bytes
from .measure import add_device_argument, device_from_args, device_name, synchronize

MODEL_CHOICES = ("gpt2", "mlp", "resnet")
SIZE_CHOICES = ("quick", "tiny")  # dtr_compile.bench.models sizes: "tiny" is for tests
LR = 1e-3


@dataclass
class Run:
    """What one way of training measured."""

    label: str
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)  # timed steps only
    warmup_seconds: float = 0.0  # first step (includes the compile for torch.compile)
    peak_bytes: int | None = None  # measured on the last step
    evictions: int | None = None
    remats: int | None = None
    error: str | None = None  # why this way did not run (the table says so instead of crashing)

    @property
    def median_seconds(self) -> float | None:
        return statistics.median(self.step_seconds) if self.step_seconds else None


# ----------------------------------------------------------------------------------------- training


def _train(
    run: Run,
    model: torch.nn.Module,
    forward: Callable[..., Any],
    case: Any,
    steps: int,
    device: torch.device,
    wrap: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> None:
    """Warm-up step, `steps` timed steps, then one measured step for the peak (all on `device`)."""
    from .measure import measure_peak

    inputs, target = case.make_batch(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def forward_backward() -> float:
        with wrap():
            loss = case.loss_fn(forward(*inputs), target)
            loss.backward()
            return loss.detach().item()

    def train_step() -> float:
        optimizer.zero_grad(set_to_none=True)  # gradients are part of the step's peak
        loss = forward_backward()
        optimizer.step()
        synchronize(device)  # CUDA runs the optimizer's kernels asynchronously: the step ends when they do
        return loss

    synchronize(device)
    start = time.perf_counter()
    run.losses.append(train_step())
    run.warmup_seconds = time.perf_counter() - start
    for _ in range(steps):
        start = time.perf_counter()
        run.losses.append(train_step())
        run.step_seconds.append(time.perf_counter() - start)
    optimizer.zero_grad(set_to_none=True)
    with _quiet_native_stderr():
        loss, measured = measure_peak(forward_backward, device)
    optimizer.step()
    run.losses.append(loss)
    run.peak_bytes = measured.peak_bytes


def run_eager(case: Any, initial: torch.nn.Module, steps: int, device: torch.device) -> Run:
    run = Run("plain eager (no budget)")
    model = copy.deepcopy(initial)
    _train(run, model, model, case, steps, device)
    return run


def run_runtime(case: Any, initial: torch.nn.Module, steps: int, budget_bytes: int, device: torch.device) -> Run:
    run = Run("eager DTR runtime")
    try:
        from . import runtime

        model = copy.deepcopy(initial)
        rt = runtime.enable(memory_budget=budget_bytes)  # one Runtime for every step, as intended
        _train(run, model, model, case, steps, device, wrap=lambda: rt)
        stats = rt.stats()
        run.evictions, run.remats = stats.evictions, stats.rematerializations
    except Exception as exc:  # noqa: BLE001 - the demo reports any failure in its table
        run.error = _describe(exc)
    return run


def run_compiled(case: Any, initial: torch.nn.Module, steps: int, budget_bytes: int, device: torch.device) -> Run:
    run = Run('torch.compile(backend="dtr"), fx')
    try:
        from .backend import dtr_backend
    except Exception as exc:  # noqa: BLE001 - an unfinished or broken backend must not stop the demo
        run.error = f"compiled path not available: cannot import dtr_compile.backend ({type(exc).__name__}: {exc})"
        return run
    try:
        import torch._dynamo

        torch._dynamo.reset()  # a fresh compile, whatever ran before in this process
        model = copy.deepcopy(initial)
        # The flags must be set while the model compiles (on the first call) and runs.
        with config.patch(memory_budget=budget_bytes, codegen="fx"):
            compiled = torch.compile(model, backend=_backend_name_or(dtr_backend))
            _train(run, model, compiled, case, steps, device)
    except Exception as exc:  # noqa: BLE001
        run.error = _describe(exc)
    return run


def _backend_name_or(fallback: Callable[..., Any]) -> str | Callable[..., Any]:
    # `backend="dtr"` resolves through the package's entry point once it is pip-installed; from a source
    # checkout that was never installed, the same function is passed directly.
    try:
        torch._dynamo.lookup_backend("dtr")
    except Exception:  # noqa: BLE001
        return fallback
    return "dtr"


@contextlib.contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """Silence the profiler's native log lines ("USDT ... profiler_start") that would clutter the table.

    They are written by C++ straight to file descriptor 2, so sys.stderr cannot catch them; exceptions
    still propagate and print after the descriptor is restored.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _describe(exc: BaseException) -> str:
    """One line naming the error; Dynamo's BackendCompilerFailed is unwrapped to the backend's own error."""
    inner = getattr(exc, "inner_exception", None)
    if isinstance(inner, BaseException):
        exc = inner
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


# -------------------------------------------------------------------------------------------- report


def format_table(runs: Sequence[Run], budget_bytes: int) -> str:
    """The comparison table: measured peak, peak / budget, median step time, time ratio, losses, DTR counters."""
    eager = runs[0]
    headers = ("", "peak MiB", "peak/budget", "median step", "time x eager", "loss vs eager", "evictions", "remats")
    rows = []
    for run in runs:
        if run.error is not None:
            rows.append((run.label, "not run", "", "", "", "", "", ""))
            continue
        ratio = run.peak_bytes / budget_bytes
        median, base = run.median_seconds, eager.median_seconds
        rows.append(
            (
                run.label,
                f"{run.peak_bytes / 2**20:.2f}",
                f"{ratio:.2f}" + ("" if run is eager else (" ok" if ratio <= 1.0 else " OVER")),
                "-" if median is None else f"{median * 1e3:.0f} ms",
                "-" if median is None or not base else f"{median / base:.2f}",
                _loss_agreement(eager.losses, run.losses),
                "-" if run.evictions is None else str(run.evictions),
                "-" if run.remats is None else str(run.remats),
            )
        )
    widths = [max(len(str(r[i])) for r in (headers, *rows)) for i in range(len(headers))]
    lines = ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip() for row in (headers, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _loss_agreement(reference: Sequence[float], losses: Sequence[float]) -> str:
    if list(losses) == list(reference):
        return "equal" if losses is not reference else "(reference)"
    if len(losses) != len(reference):
        return "n/a"
    worst = max(abs(a - b) for a, b in zip(reference, losses))
    return f"max diff {worst:.1e}"


# ------------------------------------------------------------------------------------------- command


def parse_budget_arg(text: str) -> int | float:
    """`--budget`: a fraction in (0, 1] of plain eager's measured peak, or bytes with a unit ("300MB", "1.5GiB")."""
    try:
        number: float | None = float(text)
    except ValueError:
        number = None
    if number is not None and math.isfinite(number) and number > 1:
        # "--budget 3" is more likely a slip than a 3-byte budget: bytes must name their unit.
        raise argparse.ArgumentTypeError(
            f"{text!r} is ambiguous: give a fraction in (0, 1] of the no-remat peak, or bytes with a unit "
            f"such as {text}B, 300MB or 1.5GiB"
        )
    try:
        budget = config.parse_budget(number if number is not None else text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if budget is None:
        raise argparse.ArgumentTypeError("the demo needs a budget")
    return budget


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dtr_compile.demo",
        description="Train a small built-in model with no budget, with the eager DTR runtime, and with "
        'torch.compile(backend="dtr"), and print measured peak memory and step time side by side.',
    )
    parser.add_argument(
        "--budget",
        type=parse_budget_arg,
        default=0.5,
        help="fraction in (0, 1] of plain eager's measured peak, or bytes such as 300MB (default 0.5)",
    )
    parser.add_argument(
        "--steps",
        type=_positive_int,
        default=3,
        help="timed optimizer steps per way, after one warm-up step and before one profiled step (default 3)",
    )
    parser.add_argument(
        "--model",
        choices=MODEL_CHOICES,
        default=None,
        help="gpt2 (transformers GPT-2, random weights; the default when transformers is installed), "
        "mlp (the default otherwise) or resnet",
    )
    parser.add_argument(
        "--size",
        choices=SIZE_CHOICES,
        default="quick",
        help="quick (default; a step in tens of ms) or tiny (seconds in all, for tests)",
    )
    parser.add_argument(
        "--threads",
        type=_positive_int,
        default=1,
        help="torch threads (default 1, as python -m dtr_compile.bench: small models gain little from more, and "
        "one thread keeps the timings steady when other processes share the machine)",
    )
    add_device_argument(parser)
    parser.add_argument("--no-compile", action="store_true", help='skip the torch.compile(backend="dtr") run')
    return parser


def _choose_model(requested: str | None, parser: argparse.ArgumentParser) -> str:
    try:
        import transformers  # noqa: F401
    except ImportError:
        if requested == "gpt2":
            parser.error('--model gpt2 needs transformers: pip install -e ".[bench]" (or choose --model mlp)')
        if requested is None:
            print("transformers is not installed: using the MLP (pip install transformers for the GPT-2 demo)")
            return "mlp"
    return requested or "gpt2"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    device = device_from_args(parser, args.device)
    name = _choose_model(args.model, parser)
    torch.set_num_threads(args.threads)
    from .bench.models import build_model

    case = build_model(name, args.size)
    initial = copy.deepcopy(case.model).to(device)  # every way starts from these weights
    threads = f"{args.threads} thread{'s' if args.threads > 1 else ''}"
    where = device_name(device) if device.type == "cuda" else threads
    print(
        f"dtr_compile demo: {name} ({case.description}), torch {torch.__version__}, {device} ({where}), "
        f"{args.steps} timed steps per way"
    )

    eager = run_eager(case, initial, args.steps, device)
    budget = args.budget
    budget_bytes = max(1, int(budget * eager.peak_bytes)) if isinstance(budget, float) else budget
    how = f"{budget} x plain eager's measured peak" if isinstance(budget, float) else "as given"
    print(f"budget: {format_bytes(budget_bytes)} ({budget_bytes} bytes, {how}); measuring...")

    runs = [eager, run_runtime(case, initial, args.steps, budget_bytes, device)]
    if not args.no_compile:
        runs.append(run_compiled(case, initial, args.steps, budget_bytes, device))
    print()
    print(format_table(runs, budget_bytes))
    print()
    meter = "the allocator's max_memory_allocated" if device.type == "cuda" else "the profiler's allocation events"
    print(
        f"peak: measured by {meter} above what was live when the step began "
        "(dtr_compile.measure); median step: forward + backward + SGD update."
    )
    for run in runs:
        if run.error is not None:
            print(f"{run.label}: not run: {run.error}")
        elif run is runs[-1] and len(runs) == 3:
            print(
                f"{run.label}: first step (compile included) {run.warmup_seconds:.1f} s; "
                "its recomputation is planned at compile time, so there are no runtime counters."
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
