"""Suite `handoff`: one budget across graph breaks, the eager runtime alone, backend="dtr" and PyTorch's knob.

    python -m dtr_compile.bench handoff [--models treelstm lstm transformer_branch moe] [--size tiny]
                                        [--budgets 0.5 0.3] [--out benchmarks/handoff.md]

For each dynamic model (dtr_compile.bench.dynamic_models: recursion over random trees, varying sequence
lengths, a data-dependent branch per block, data-dependent expert routing) and budget (a fraction of plain
eager's measured peak over the same batches), each method runs in a fresh process, one thread:
  (a) the eager DTR runtime (`with dtr_compile.runtime.enable(budget):` around each step);
  (b) `torch.compile(model, backend="dtr")` with `config.memory_budget` (FX code generator: compiled regions
      run as operations of the runtime, the code between them under it);
  (c) PyTorch's `activation_memory_budget` (aot_eager, the knob set to the same fraction; it plans each
      compiled region alone and does not see the code between regions).
Warm-up steps go through every batch shape twice (compiles, then each region plans again with the loss tail its
first step measured, backend/region.py), then the measured steps cycle through the same
batches. Peak = the largest measured peak of the measured steps (profiler allocation events, DESIGN.md);
time = median process CPU time of a step (robust to other load on the machine), as a ratio to plain eager
on the same batches; correct = loss and gradients equal to plain eager's on every measured step.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ... import config
from ...measure import measure_peak
from .. import provenance, upstairs
from ..dynamic_models import DYNAMIC_MODELS, DYNAMIC_SIZES, build_dynamic
from ..markdown import table, write
from ..timing import median, timed
from .args import fraction

SUMMARY = 'one budget across graph breaks: eager runtime, backend="dtr" and the knob on dynamic models (CPU)'
BATCHES = 4  # the batches each run cycles through (each a different shape or tree)
MEASURED = 4
METHODS = {"eager runtime": "(a) eager runtime", "backend=dtr": '(b) backend="dtr"',
           "knob": "(c) activation_memory_budget"}  # fmt: skip
HEADER = ("method", "budget", "measured peak / budget", "step time / eager", "correct", "evictions (of region outputs)",
          "remats (reran compiled code)")  # fmt: skip


def _run(name: str, size: str, method: str, fraction: float | None, peak_ref: int | None, queue: Any) -> None:
    """One method on one model in a fresh process: its measured steps, or the error, put on `queue`."""
    torch.set_num_threads(1)
    runtime_room = upstairs.load("runtime")
    case = build_dynamic(name, size)
    model = case.model
    budget = None if fraction is None or peak_ref is None else int(fraction * peak_ref)
    runtime = runtime_room.enable(memory_budget=budget) if method == "eager runtime" else None
    step_model: Any = model
    if method == "backend=dtr":
        config.memory_budget, config.codegen = budget, "fx"  # for the process's lifetime, as methods.py sets them
        step_model = torch.compile(model, backend="dtr")
    elif method == "knob":
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = fraction
        step_model = torch.compile(model, backend="aot_eager")

    def one(step: int) -> tuple[float, list, int, float]:
        model.zero_grad(set_to_none=True)
        inputs, target = case.batch(step % BATCHES)

        def body() -> float:
            if runtime is not None:
                with runtime:
                    loss = case.loss_fn(step_model(*inputs), target)
                    loss.backward()
                    return loss.item()
            loss = case.loss_fn(step_model(*inputs), target)
            loss.backward()
            return loss.item()

        (loss, measured), sample = timed(lambda: measure_peak(body))  # timed under the profiler, as eager is
        # numpy arrays, not tensors: a tensor sent through a queue is shared by a file descriptor that dies
        # with this process
        grads = [None if p.grad is None else p.grad.detach().numpy().copy() for p in model.parameters()]
        return loss, grads, measured.peak_bytes, sample.cpu_s

    try:
        for step in range(2 * BATCHES):  # warm-up: every shape twice (compiles, then the plan with its measured tail)
            one(step)
        results = [one(step) for step in range(BATCHES, BATCHES + MEASURED)]
        stats = None
        if runtime is not None:
            stats = runtime.stats()
        elif method == "backend=dtr":
            stats = runtime_room.implicit_runtime().stats()
        counts = None if stats is None else (stats.evictions, stats.region_evictions, stats.rematerializations,
                                             stats.region_rematerializations)  # fmt: skip
        queue.put({"ok": True, "results": results, "budget": budget, "stats": counts})
    except Exception as error:  # noqa: BLE001 - reported in the table
        queue.put({"ok": False, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"})


def run(name: str, size: str, method: str, fraction: float | None = None, peak_ref: int | None = None) -> dict:
    context = mp.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_run, args=(name, size, method, fraction, peak_ref, queue))
    process.start()
    result = queue.get()
    process.join()
    return result


def _same(results: list, reference: list) -> bool:
    for (loss, grads, _, _), (ref_loss, ref_grads, _, _) in zip(results, reference, strict=True):
        if abs(loss - ref_loss) > 1e-4 * max(1.0, abs(ref_loss)):
            return False
        for g, r in zip(grads, ref_grads, strict=True):
            if (g is None) != (r is None) or (g is not None and not np.allclose(g, r, rtol=1e-3, atol=1e-5)):
                return False
    return True


def model_rows(name: str, size: str, budgets: Sequence[float]) -> list[str]:
    """Plain eager's peak and step, then one row per (budget, method), printed as each finishes."""
    eager = run(name, size, "eager")
    if not eager["ok"]:
        raise RuntimeError(f"plain eager failed on {name}: {eager['error']}")
    reference = eager["results"]
    peak = max(r[2] for r in reference)
    eager_time = median([r[3] for r in reference])
    rows = []
    for frac in budgets:
        for method, label in METHODS.items():
            result = run(name, size, method, frac, peak)
            if not result["ok"]:
                rows.append([label, frac, result["error"], "", "", "", ""])
            else:
                results, stats = result["results"], result["stats"]
                worst = max(r[2] for r in results) / int(frac * peak)
                ratio = median([r[3] for r in results]) / eager_time
                counts = ("-", "-") if stats is None else (f"{stats[0]} ({stats[1]})", f"{stats[2]} ({stats[3]})")
                correct = "yes" if _same(results, reference) else "NO"
                rows.append([label, frac, f"{worst:.3f}", f"{ratio:.2f}", correct, *counts])
            print(table(HEADER, rows)[-1], flush=True)
    title = f"### {name} ({size}): plain eager peak {peak / 2**20:.2f} MiB, step {eager_time * 1e3:.0f} ms"
    return [title, "", *table(HEADER, rows), ""]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dtr_compile.bench handoff", description=SUMMARY)
    p.add_argument("--models", nargs="+", default=list(DYNAMIC_MODELS), choices=DYNAMIC_MODELS)
    p.add_argument("--size", default="tiny", choices=DYNAMIC_SIZES, help="dynamic models' size (default tiny)")
    p.add_argument("--budgets", nargs="+", type=fraction, default=[0.5, 0.3],
                   help="fractions of plain eager's measured peak (default 0.5 0.3)")  # fmt: skip
    p.add_argument("--out", default="benchmarks/handoff.md", help="Markdown fragment to write ('-': stdout only)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    lines = [
        (
            f"Command: `{provenance.command('handoff', argv)}`, {provenance.utc_now():%Y-%m-%d %H:%M} UTC, "
            f"torch {torch.__version__}, 1 thread, CPU time per step."
        ),
        "",
    ]
    for name in args.models:
        lines += model_rows(name, args.size, args.budgets)
    text = "\n".join(lines)
    print(text)
    write(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
