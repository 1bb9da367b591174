"""Overhead and budget adherence of the eager DTR runtime on CPU, against plain eager PyTorch.

    python benchmarks/runtime_overhead.py [--steps 7] [--out benchmarks/runtime.md] [--profile 3]

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
import datetime
import gc
import io
import os
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import dtr_compile
from dtr_compile.measure import measure_peak

MiB = 2**20


# ------------------------------------------------------------------------------------------- models


@dataclass(frozen=True)
class Case:
    name: str
    model: torch.nn.Module
    inputs: tuple[torch.Tensor, ...]
    target: torch.Tensor
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]

    def step(self) -> float:
        """Forward and backward with fresh gradients (they count in the step's peak)."""
        for p in self.model.parameters():
            p.grad = None
        loss = self.loss_fn(self.model(*self.inputs), self.target)
        loss.backward()
        return loss.detach().item()


def _token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class _Logits(torch.nn.Module):
    def __init__(self, hf: torch.nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=ids).logits


def gpt2(layers: int, width: int, heads: int, seq: int, batch: int, vocab: int) -> Case:
    """GPT-2 from transformers with random weights and no dropout (so eager is the oracle)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=vocab, n_positions=seq, n_embd=width, n_layer=layers, n_head=heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = _Logits(GPT2LMHeadModel(config)).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    name = f"GPT-2 {layers}L, n_embd {width}, {heads} heads, seq {seq}, batch {batch}, vocab {vocab}"
    return Case(name, model, (ids,), labels, _token_loss)


def bench_case(model: str, size: str) -> Case:
    """A model of dtr_compile.bench.models (MLP, ResNet, ...) at one of its sizes."""
    from dtr_compile.bench.models import build_model

    case = build_model(model, size)
    inputs, target = case.make_batch("cpu")
    return Case(f"{model} ({case.description})", case.model, inputs, target, case.loss_fn)


# ------------------------------------------------------------------------------------------ running


def runtime_step(case: Case, rt: Any) -> Callable[[], float]:
    def step() -> float:
        with rt:
            return case.step()

    return step


def timed(step: Callable[[], float]) -> tuple[float, float]:
    start = time.perf_counter()
    loss = step()
    return time.perf_counter() - start, loss


class GcClock:
    """Wall time spent in Python's cyclic garbage collector (the runtime allocates Python objects per op)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


@contextlib.contextmanager
def gc_clock() -> Iterator[GcClock]:
    clock = GcClock()
    gc.callbacks.append(clock)
    try:
        yield clock
    finally:
        gc.callbacks.remove(clock)


@dataclass
class Way:
    label: str
    step: Callable[[], float]
    runtime: Any = None  # dtr_compile Runtime, or None for plain eager
    budget_bytes: int | None = None


@dataclass
class WayResult:
    label: str
    budget_bytes: int | None
    median_s: float
    times: list[float]
    median_cpu_s: float  # process CPU time: steadier than wall time when other processes share the machine
    peak_bytes: int
    losses_equal: bool
    per_step: dict[str, float]  # runtime counters per timed step


def side_by_side(ways: Sequence[Way], steps: int) -> list[WayResult]:
    """Warm up each way, then `steps` rounds of one step per way in a rotating order, then measure peaks."""
    reference_loss = None
    losses: dict[str, list[float]] = {w.label: [] for w in ways}
    for way in ways:  # warm-up: allocator, oneDNN primitives, the runtime's caches
        losses[way.label].append(way.step())
    before = {w.label: _counters(w.runtime) for w in ways}
    times: dict[str, list[float]] = {w.label: [] for w in ways}
    cpu_times: dict[str, list[float]] = {w.label: [] for w in ways}
    gc_seconds = {w.label: 0.0 for w in ways}
    for round_ in range(steps):
        order = [ways[(round_ + k) % len(ways)] for k in range(len(ways))]
        for way in order:
            cpu_start = time.process_time()
            with gc_clock() as clock:
                seconds, loss = timed(way.step)
            gc_seconds[way.label] += clock.seconds
            cpu_times[way.label].append(time.process_time() - cpu_start)
            times[way.label].append(seconds)
            losses[way.label].append(loss)
    after = {w.label: _counters(w.runtime) for w in ways}
    results = []
    for way in ways:
        loss, measured = measure_peak(way.step, "cpu")
        losses[way.label].append(loss)
        reference_loss = reference_loss or losses[ways[0].label]
        per_step = {k: (after[way.label][k] - before[way.label][k]) / steps for k in after[way.label]}
        per_step["gc_s"] = gc_seconds[way.label] / steps
        results.append(
            WayResult(
                way.label,
                way.budget_bytes,
                statistics.median(times[way.label]),
                times[way.label],
                statistics.median(cpu_times[way.label]),
                measured.peak_bytes,
                losses[way.label] == reference_loss,
                per_step,
            )
        )
    return results


def _counters(rt: Any) -> dict[str, float]:
    if rt is None:
        return {}
    s = rt.stats()
    return {
        "evictions": s.evictions,
        "remats": s.rematerializations,
        "remat_s": s.remat_seconds,
        "search_s": s.search_seconds,
    }


def overhead(case: Case, steps: int) -> tuple[int, list[WayResult]]:
    _, base = measure_peak(case.step, "cpu")
    peak = base.peak_bytes
    free_rt = dtr_compile.runtime.enable(memory_budget=10 * peak)
    half_rt = dtr_compile.runtime.enable(memory_budget=int(0.5 * peak))
    ways = [
        Way("plain eager", case.step),
        Way("runtime, budget 10x peak (never binds)", runtime_step(case, free_rt), free_rt, 10 * peak),
        Way("runtime, budget 0.5x peak", runtime_step(case, half_rt), half_rt, int(0.5 * peak)),
    ]
    return peak, side_by_side(ways, steps)


def memory_check(case: Case, fractions: Sequence[float]) -> tuple[int, float, list[dict[str, Any]]]:
    """Measured peak of one step at each budget (after a warm-up step with the same Runtime)."""
    case.step()  # warm-up
    eager_s, _ = timed(case.step)
    _, base = measure_peak(case.step, "cpu")
    rows = []
    for fraction in fractions:
        budget = int(fraction * base.peak_bytes)
        rt = dtr_compile.runtime.enable(memory_budget=budget)
        step = runtime_step(case, rt)
        row: dict[str, Any] = {"fraction": fraction, "budget": budget}
        try:
            step()
            seconds, _ = timed(step)
            before = _counters(rt)
            _, measured = measure_peak(step, "cpu")
            after = _counters(rt)
            row.update(
                peak=measured.peak_bytes, time_ratio=seconds / eager_s, **{k: after[k] - before[k] for k in after}
            )
        except dtr_compile.DTRError as exc:
            row["error"] = _short_error(exc)
        rows.append(row)
    return base.peak_bytes, eager_s, rows


def _short_error(exc: Exception) -> str:
    """A table cell for a budget the runtime refused: the error type and the budget it says would work."""
    needed = getattr(exc, "smallest_feasible_bytes", None)
    if isinstance(exc, dtr_compile.BudgetError) and needed is not None:
        return f"BudgetError: infeasible, needs at least {needed / MiB:.1f} MiB here"
    if isinstance(exc, dtr_compile.ThrashError):
        return "ThrashError: recompute exceeded the original compute (thrash_limit)"
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


def profile_runtime(case: Case, peak: int, steps: int, top: int = 25) -> str:
    """cProfile of `steps` runtime steps at 0.5x peak; the top functions by own time and by cumulative time."""
    rt = dtr_compile.runtime.enable(memory_budget=int(0.5 * peak))
    step = runtime_step(case, rt)
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


# ------------------------------------------------------------------------------------------ report


def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"Python {platform.python_version()}; load average (1/5/15 min) {load}"
    )


def revision() -> str:
    """The git commit the benchmark ran on, and whether the working tree had uncommitted changes."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "dtr_compile"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown revision"
    return head.stdout.strip() + (" + uncommitted changes in dtr_compile/" if dirty.stdout.strip() else "")


def overhead_table(peak: int, results: list[WayResult]) -> list[str]:
    eager = results[0]
    lines = [
        (
            "| way | median step | x eager | CPU time x eager | measured peak | peak / budget | evictions / step "
            "| remats / step | remat time / step | search time / step | GC time / step | losses = eager |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = "-" if r.budget_bytes is None else f"{r.peak_bytes / r.budget_bytes:.3f}"
        c = r.per_step

        def fmt(key: str, scale: float = 1.0, unit: str = "", c: dict = c) -> str:
            return "-" if key not in c else f"{c[key] * scale:.{0 if not unit else 1}f}{unit}"

        lines.append(
            f"| {r.label} | {r.median_s * 1e3:.0f} ms | {r.median_s / eager.median_s:.3f} | "
            f"{r.median_cpu_s / eager.median_cpu_s:.3f} | {r.peak_bytes / MiB:.1f} MiB | {ratio} | {fmt('evictions')} | {fmt('remats')} | "
            f"{fmt('remat_s', 1e3, ' ms')} | {fmt('search_s', 1e3, ' ms')} | {fmt('gc_s', 1e3, ' ms')} | {'yes' if r.losses_equal else 'NO'} |"
        )
    lines.append("")
    lines.append(
        f"No-remat measured peak {peak / MiB:.1f} MiB. Step times of every round (ms): "
        + "; ".join(f"{r.label}: " + ", ".join(f"{t * 1e3:.0f}" for t in r.times) for r in results)
    )
    return lines


def memory_table(name: str, peak: int, eager_s: float, rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"**{name}** — no-remat measured peak {peak / MiB:.1f} MiB, eager step {eager_s * 1e3:.0f} ms",
        "",
        "| budget | budget bytes | measured peak | peak / budget | evictions | remats | remat time | step x eager |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        head = f"| {row['fraction']} | {row['budget'] / MiB:.1f} MiB"
        if "error" in row:
            lines.append(f"{head} | {row['error']} | | | | | |")
            continue
        lines.append(
            f"{head} | {row['peak'] / MiB:.1f} MiB | {row['peak'] / row['budget']:.3f} | {row['evictions']} | "
            f"{row['remats']} | {row['remat_s'] * 1e3:.0f} ms | {row['time_ratio']:.2f} |"
        )
    return lines + [""]


# ------------------------------------------------------------------------------------------- command


def _fractions(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions such as 0.7,0.5, got {text!r}") from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"every fraction must be in (0, 1], got {text!r}")
    return values


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _non_negative(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=_positive, default=7, help="timed rounds after one warm-up round (default 7)")
    p.add_argument("--width", type=_positive, default=384, help="GPT-2 n_embd of the overhead model (default 384)")
    p.add_argument("--heads", type=_positive, default=6, help="GPT-2 heads (default 6)")
    p.add_argument("--seq", type=_positive, default=256, help="sequence length (default 256)")
    p.add_argument("--batch", type=_positive, default=4, help="batch size (default 4)")
    p.add_argument("--vocab", type=_positive, default=8192, help="vocabulary (default 8192)")
    p.add_argument("--threads", type=_positive, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument(
        "--fractions",
        type=_fractions,
        default=[0.7, 0.5, 0.35],
        help="budgets of the memory check (default 0.7,0.5,0.35)",
    )
    p.add_argument("--skip-overhead", action="store_true", help="only the memory check")
    p.add_argument("--skip-memory", action="store_true", help="only the overhead measurement")
    p.add_argument(
        "--profile",
        type=_non_negative,
        default=0,
        metavar="N",
        help="also cProfile N runtime steps at the 0.5 budget (default 0: no profile)",
    )
    p.add_argument("--out", default="benchmarks/runtime.md", help="Markdown fragment to write ('-': stdout only)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.width % args.heads:
        raise SystemExit(f"error: --width {args.width} must be a multiple of --heads {args.heads}")
    torch.set_num_threads(args.threads)
    command = "python benchmarks/runtime_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv)
    started = datetime.datetime.now(datetime.UTC)
    out = [
        "## Eager runtime: overhead and budget adherence (CPU)",
        "",
        f"Command: `{command.strip()}`  ",
        (
            f"Run {started:%Y-%m-%d %H:%M} UTC on {machine()} (at start). The machine is shared: other processes "
            "may run beside the benchmark, which is why the ways are interleaved round by round."
        ),
        f"Code: {revision()}.",
        "",
    ]
    overhead_case = gpt2(12, args.width, args.heads, args.seq, args.batch, args.vocab)
    peak = None
    if not args.skip_overhead:
        print(f"overhead: {overhead_case.name}", flush=True)
        peak, results = overhead(overhead_case, args.steps)
        out += [f"### Overhead: {overhead_case.name}, median of {args.steps} interleaved steps after 1 warm-up", ""]
        out += overhead_table(peak, results) + [""]
        print("\n".join(overhead_table(peak, results)), flush=True)
    if not args.skip_memory:
        out += ["### Memory check: measured peak against the budget (one step per budget)", ""]
        cases = [
            lambda: gpt2(12, args.width, args.heads, 2 * args.seq, args.batch, args.vocab),
            lambda: bench_case("mlp", "full"),
            lambda: bench_case("resnet", "full"),
        ]
        for make in cases:
            case = make()
            print(f"memory check: {case.name}", flush=True)
            base_peak, eager_s, rows = memory_check(case, args.fractions)
            table = memory_table(case.name, base_peak, eager_s, rows)
            print("\n".join(table), flush=True)
            out += table
            del case
    if args.profile:
        if peak is None:
            _, base = measure_peak(overhead_case.step, "cpu")
            peak = base.peak_bytes
        text = profile_runtime(overhead_case, peak, args.profile)
        print(text)
        out += [f"### cProfile of {args.profile} runtime steps at 0.5x peak", "", "```", text.strip(), "```", ""]
    out += [
        f"Finished {datetime.datetime.now(datetime.UTC):%H:%M} UTC; load average then: "
        + " / ".join(f"{x:.2f}" for x in os.getloadavg()),
        "",
    ]
    if args.out != "-":
        with open(args.out, "w") as f:
            f.write("\n".join(out))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
