"""Suite `runtime-overhead`: the eager DTR runtime's overhead and budget adherence on CPU, against plain eager.

    python -m dtr_compile.bench runtime-overhead [--steps 7] [--out benchmarks/runtime.md] [--profile 3]

1. Overhead, on a 12-layer GPT-2 (transformers, random weights, dropout off): median step time
   (forward + backward) of plain eager, of the runtime at a budget that never binds (10x the measured peak)
   and of the runtime at 0.5x plain eager's measured peak. The three are measured side by side, one step
   of each per round in a rotating order, so that drift of a shared machine hits all three alike.
   Targets (issue 2): non-binding <= 1.10x eager, 0.5 budget <= 1.35x eager, measured peak <= 1.05x budget.
2. Memory check on larger models at budgets 0.7 / 0.5 / 0.35 of the measured no-remat peak: measured peak
   over budget, evictions, rematerializations, step time over eager (one step each: indicative only).
3. With --profile N: cProfile of N runtime steps at the 0.5 budget, the dtr_compile functions that dominate.

Peaks always come from `dtr_compile.measure.measure_peak` (profiler allocation events), never from the
runtime's own accounting. Results go to a Markdown fragment (default benchmarks/runtime.md).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import pstats
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import BudgetError, DTRError, ThrashError
from ...measure import measure_peak
from .. import provenance, upstairs
from ..markdown import MiB, write
from ..models import SIZES, BenchCase, build_model, build_model_shaped
from ..timing import interleaved, median, timed
from .args import fractions, non_negative, positive
from .runtime_tables import WayResult, memory_table, overhead_table

SUMMARY = "the eager runtime's overhead on a 12-layer GPT-2 and its budget adherence on larger models (CPU)"


@dataclass(frozen=True)
class Case:
    """A benchmark model, its batch, and a step that starts with fresh gradients (they count in its peak)."""

    name: str
    bench: BenchCase
    inputs: tuple[torch.Tensor, ...]
    target: torch.Tensor

    def step(self) -> float:
        for p in self.bench.model.parameters():
            p.grad = None
        loss = self.bench.loss_fn(self.bench.model(*self.inputs), self.target)
        loss.backward()
        return loss.detach().item()


def gpt2(layers: int, width: int, heads: int, seq: int, batch: int, vocab: int) -> Case:
    """GPT-2 from transformers with random weights and no dropout (so eager is the oracle)."""
    bench = build_model_shaped("gpt2", batch=batch, seq=seq, width=width, layers=layers, heads=heads, vocab=vocab)
    inputs, target = bench.make_batch("cpu")
    name = f"GPT-2 {layers}L, n_embd {width}, {heads} heads, seq {seq}, batch {batch}, vocab {vocab}"
    return Case(name, bench, inputs, target)


def bench_case(model: str, size: str) -> Case:
    """A model of dtr_compile.bench.models (MLP, ResNet, ...) at one of its sizes."""
    bench = build_model(model, size)
    inputs, target = bench.make_batch("cpu")
    return Case(f"{model} ({bench.description})", bench, inputs, target)


# ------------------------------------------------------------------------------------------ running


def enable(budget: int) -> Any:
    return upstairs.load("runtime").enable(memory_budget=budget)


def runtime_step(case: Case, rt: Any) -> Callable[[], float]:
    def step() -> float:
        with rt:
            return case.step()

    return step


@contextlib.contextmanager
def gc_clock() -> Iterator[list[float]]:
    """Wall time spent in Python's cyclic garbage collector (the runtime allocates Python objects per op)."""
    spent, start = [0.0], [0.0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            start[0] = time.perf_counter()
        else:
            spent[0] += time.perf_counter() - start[0]

    gc.callbacks.append(callback)
    try:
        yield spent
    finally:
        gc.callbacks.remove(callback)


@dataclass
class Way:
    label: str
    step: Callable[[], float]
    runtime: Any = None  # dtr_compile Runtime, or None for plain eager
    budget_bytes: int | None = None


def side_by_side(ways: Sequence[Way], steps: int) -> list[WayResult]:
    """Warm up each way, then `steps` rounds of one step per way in a rotating order, then measure peaks."""
    losses: dict[str, list[float]] = {w.label: [w.step()] for w in ways}  # warm-up: allocator, oneDNN, caches
    before = {w.label: _counters(w.runtime) for w in ways}
    wall: dict[str, list[float]] = {w.label: [] for w in ways}
    cpu: dict[str, list[float]] = {w.label: [] for w in ways}
    gc_seconds = {w.label: 0.0 for w in ways}
    for way in interleaved(ways, steps, rotate=True):
        with gc_clock() as spent:
            loss, sample = timed(way.step)
        gc_seconds[way.label] += spent[0]
        wall[way.label].append(sample.wall_s)
        cpu[way.label].append(sample.cpu_s)
        losses[way.label].append(loss)
    after = {w.label: _counters(w.runtime) for w in ways}
    results = []
    for way in ways:
        loss, measured = measure_peak(way.step, "cpu")
        losses[way.label].append(loss)
        per_step = {k: (after[way.label][k] - before[way.label][k]) / steps for k in after[way.label]}
        per_step["gc_s"] = gc_seconds[way.label] / steps
        equal = losses[way.label] == losses[ways[0].label]
        results.append(WayResult(way.label, way.budget_bytes, median(wall[way.label]), wall[way.label],
                                 median(cpu[way.label]), measured.peak_bytes, equal, per_step))  # fmt: skip
    return results


def _counters(rt: Any) -> dict[str, float]:
    if rt is None:
        return {}
    s = rt.stats()
    return {"evictions": s.evictions, "remats": s.rematerializations, "remat_s": s.remat_seconds,
            "search_s": s.search_seconds}  # fmt: skip


def overhead(case: Case, steps: int) -> tuple[int, list[WayResult]]:
    _, base = measure_peak(case.step, "cpu")
    peak = base.peak_bytes
    free_rt, half_rt = enable(10 * peak), enable(int(0.5 * peak))
    ways = [
        Way("plain eager", case.step),
        Way("runtime, budget 10x peak (never binds)", runtime_step(case, free_rt), free_rt, 10 * peak),
        Way("runtime, budget 0.5x peak", runtime_step(case, half_rt), half_rt, int(0.5 * peak)),
    ]
    return peak, side_by_side(ways, steps)


def memory_check(case: Case, fractions: Sequence[float]) -> tuple[int, float, list[dict[str, Any]]]:
    """Measured peak of one step at each budget (after a warm-up step with the same Runtime)."""
    case.step()  # warm-up
    eager_s = timed(case.step)[1].wall_s
    _, base = measure_peak(case.step, "cpu")
    rows = []
    for fraction in fractions:
        budget = int(fraction * base.peak_bytes)
        rt = enable(budget)
        step = runtime_step(case, rt)
        row: dict[str, Any] = {"fraction": fraction, "budget": budget}
        try:
            step()
            seconds = timed(step)[1].wall_s
            before = _counters(rt)
            _, measured = measure_peak(step, "cpu")
            after = _counters(rt)
            row.update(
                peak=measured.peak_bytes, time_ratio=seconds / eager_s, **{k: after[k] - before[k] for k in after}
            )
        except DTRError as exc:
            row["error"] = _short_error(exc)
        rows.append(row)
    return base.peak_bytes, eager_s, rows


def _short_error(exc: Exception) -> str:
    """A table cell for a budget the runtime refused: the error type and the budget it says would work."""
    needed = getattr(exc, "smallest_feasible_bytes", None)
    if isinstance(exc, BudgetError) and needed is not None:
        return f"BudgetError: infeasible, needs at least {needed / MiB:.1f} MiB here"
    if isinstance(exc, ThrashError):
        return "ThrashError: recompute exceeded the original compute (thrash_limit)"
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


def profile_runtime(case: Case, peak: int, steps: int, top: int = 25) -> str:
    """cProfile of `steps` runtime steps at 0.5x peak; the top functions by own time and by cumulative time."""
    step = runtime_step(case, enable(int(0.5 * peak)))
    step()  # warm-up outside the profile
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats("dtr_compile", top)
    return out.getvalue()


# ------------------------------------------------------------------------------------------- command


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dtr_compile.bench runtime-overhead", description=SUMMARY)
    p.add_argument("--steps", type=positive, default=7, help="timed rounds after one warm-up round (default 7)")
    p.add_argument("--layers", type=positive, default=12, help="GPT-2 layers of the overhead model (default 12)")
    p.add_argument("--width", type=positive, default=384, help="GPT-2 n_embd of the overhead model (default 384)")
    p.add_argument("--heads", type=positive, default=6, help="GPT-2 heads (default 6)")
    p.add_argument("--seq", type=positive, default=256, help="sequence length (default 256)")
    p.add_argument("--batch", type=positive, default=4, help="batch size (default 4)")
    p.add_argument("--vocab", type=positive, default=8192, help="vocabulary (default 8192)")
    p.add_argument("--threads", type=positive, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--fractions", type=fractions, default=[0.7, 0.5, 0.35],
                   help="budgets of the memory check (default 0.7,0.5,0.35)")  # fmt: skip
    p.add_argument("--memory-size", choices=SIZES, default="full",
                   help="size of the memory check's MLP and ResNet (dtr_compile.bench.models; default full)")  # fmt: skip
    p.add_argument("--skip-overhead", action="store_true", help="only the memory check")
    p.add_argument("--skip-memory", action="store_true", help="only the overhead measurement")
    p.add_argument("--profile", type=non_negative, default=0, metavar="N",
                   help="also cProfile N runtime steps at the 0.5 budget (default 0: no profile)")  # fmt: skip
    p.add_argument("--out", default="benchmarks/runtime.md", help="Markdown fragment to write ('-': stdout only)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.width % args.heads:
        parser.error(f"--width {args.width} must be a multiple of --heads {args.heads}")
    torch.set_num_threads(args.threads)
    started = provenance.utc_now()
    out = [
        "## Eager runtime: overhead and budget adherence (CPU)",
        "",
        f"Command: `{provenance.command('runtime-overhead', argv)}`  ",
        (
            f"Run {started:%Y-%m-%d %H:%M} UTC on {provenance.machine()} (at start). The machine is shared: other "
            "processes may run beside the benchmark, which is why the ways are interleaved round by round."
        ),
        f"Code: {provenance.revision()}.",
        "",
    ]
    overhead_case = gpt2(args.layers, args.width, args.heads, args.seq, args.batch, args.vocab)
    peak = None
    if not args.skip_overhead:
        print(f"overhead: {overhead_case.name}", flush=True)
        peak, results = overhead(overhead_case, args.steps)
        table = overhead_table(peak, results)
        out += [f"### Overhead: {overhead_case.name}, median of {args.steps} interleaved steps after 1 warm-up", ""]
        out += table + [""]
        print("\n".join(table), flush=True)
    if not args.skip_memory:
        out += ["### Memory check: measured peak against the budget (one step per budget)", ""]
        cases = [
            lambda: gpt2(args.layers, args.width, args.heads, 2 * args.seq, args.batch, args.vocab),
            lambda: bench_case("mlp", args.memory_size),
            lambda: bench_case("resnet", args.memory_size),
        ]
        for make in cases:
            case = make()
            print(f"memory check: {case.name}", flush=True)
            table = memory_table(case.name, *memory_check(case, args.fractions))
            print("\n".join(table), flush=True)
            out += table
            del case
    if args.profile:
        if peak is None:
            peak = measure_peak(overhead_case.step, "cpu")[1].peak_bytes
        text = profile_runtime(overhead_case, peak, args.profile)
        print(text)
        out += [f"### cProfile of {args.profile} runtime steps at 0.5x peak", "", "```", text.strip(), "```", ""]
    out += [f"Finished {provenance.utc_now():%H:%M} UTC; load average then: {provenance.load_text()}", ""]
    write(args.out, "\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
