"""One budget across graph breaks: the eager runtime alone, backend="dtr", and PyTorch's knob, side by side.

    python benchmarks/handoff_bench.py [--models treelstm lstm transformer_branch moe] [--size tiny]
                                       [--budgets 0.5 0.3] [--out benchmarks/handoff.md]

For each dynamic model (dtr_compile.bench.dynamic_models: recursion over random trees, varying sequence
lengths, a data-dependent branch per block, data-dependent expert routing) and budget (a fraction of plain
eager's measured peak over the same batches), each method runs in a fresh process, one thread:
  (a) the eager DTR runtime (`with dtr_compile.runtime.enable(budget):` around each step);
  (b) `torch.compile(model, backend="dtr")` with `config.memory_budget` (FX code generator: compiled regions
      run as operations of the runtime, the code between them under it);
  (c) PyTorch's `activation_memory_budget` (aot_eager, the knob set to the same fraction; it plans each
      compiled region alone and does not see the code between regions).
Warm-up steps go through every batch shape once (compiles), then the measured steps cycle through the same
batches. Peak = the largest measured peak of the measured steps (profiler allocation events, DESIGN.md);
time = median process CPU time of a step (robust to other load on the machine), as a ratio to plain eager
on the same batches; correct = loss and gradients equal to plain eager's on every measured step.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np
import torch

BATCHES = 4  # the batches each run cycles through (each a different shape or tree)
MEASURED = 4


def _run(name: str, size: str, method: str, fraction: float | None, peak_ref: int | None, queue: Any) -> None:
    torch.set_num_threads(1)
    import dtr_compile
    from dtr_compile.bench.dynamic_models import build_dynamic
    from dtr_compile.measure import measure_peak

    case = build_dynamic(name, size)
    model = case.model
    budget = None if fraction is None or peak_ref is None else int(fraction * peak_ref)
    runtime = dtr_compile.runtime.enable(memory_budget=budget) if method == "eager runtime" else None
    step_model: Any = model
    patch = dtr_compile.config.patch(memory_budget=budget, codegen="fx")
    if method == "backend=dtr":
        patch.__enter__()
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

        start = time.process_time()
        loss, measured = measure_peak(body)
        seconds = time.process_time() - start
        # numpy arrays, not tensors: a tensor sent through a queue is shared by a file descriptor that dies
        # with this process
        grads = [None if p.grad is None else p.grad.detach().numpy().copy() for p in model.parameters()]
        return loss, grads, measured.peak_bytes, seconds

    try:
        for step in range(BATCHES):  # warm-up: every shape once (compiles, calibration)
            one(step)
        results = [one(step) for step in range(BATCHES, BATCHES + MEASURED)]
        stats = None
        if runtime is not None:
            stats = runtime.stats()
        elif method == "backend=dtr":
            stats = dtr_compile.runtime.implicit_runtime().stats()
        queue.put({"ok": True, "results": results, "budget": budget,
                   "stats": None if stats is None else (stats.evictions, stats.region_evictions,
                                                        stats.rematerializations, stats.region_rematerializations)})
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
    for (loss, grads, _, _), (ref_loss, ref_grads, _, _) in zip(results, reference):
        if abs(loss - ref_loss) > 1e-4 * max(1.0, abs(ref_loss)):
            return False
        for g, r in zip(grads, ref_grads):
            if (g is None) != (r is None) or (g is not None and not np.allclose(g, r, rtol=1e-3, atol=1e-5)):
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["treelstm", "lstm", "transformer_branch", "moe"])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--budgets", nargs="+", type=float, default=[0.5, 0.3])
    parser.add_argument("--out", default="benchmarks/handoff.md")
    args = parser.parse_args()

    lines = [(f"Command: `python benchmarks/handoff_bench.py --size {args.size} --budgets "
             f"{' '.join(map(str, args.budgets))}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"torch {torch.__version__}, 1 thread, CPU time per step."), ""]
    for name in args.models:
        eager = run(name, args.size, "eager")
        assert eager["ok"], eager
        reference = eager["results"]
        peak = max(r[2] for r in reference)
        eager_time = statistics.median(r[3] for r in reference)
        lines += [f"### {name} ({args.size}): plain eager peak {peak / 2**20:.2f} MiB, step {eager_time * 1e3:.0f} ms", "",
                  ("| method | budget | measured peak / budget | step time / eager | correct | evictions (of region outputs) "
                  "| remats (reran compiled code) |"), "|---|---|---|---|---|---|---|"]
        for fraction in args.budgets:
            for method in ("eager runtime", "backend=dtr", "knob"):
                result = run(name, args.size, method, fraction, peak)
                label = {"eager runtime": "(a) eager runtime", "backend=dtr": '(b) backend="dtr"',
                         "knob": "(c) activation_memory_budget"}[method]
                if not result["ok"]:
                    lines.append(f"| {label} | {fraction} | {result['error']} | | | | |")
                    print(lines[-1], flush=True)
                    continue
                results = result["results"]
                budget = int(fraction * peak)
                worst = max(r[2] for r in results) / budget
                ratio = statistics.median(r[3] for r in results) / eager_time
                stats = result["stats"]
                counts = ("-", "-") if stats is None else (f"{stats[0]} ({stats[1]})", f"{stats[2]} ({stats[3]})")
                lines.append(f"| {label} | {fraction} | {worst:.3f} | {ratio:.2f} | {'yes' if _same(results, reference) else 'NO'} "
                             f"| {counts[0]} | {counts[1]} |")
                print(lines[-1], flush=True)
        lines.append("")
    text = "\n".join(lines)
    with open(args.out, "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
