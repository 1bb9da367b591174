"""Suite `compiled`: the compiled path on CPU, `backend="dtr"` against PyTorch's knob and per-block checkpointing.

    python -m dtr_compile.bench compiled [--models gpt cnn] [--rounds 5] [--out benchmarks/compiled.md]

For each model, in one process, every way is compiled once and then timed round by round, interleaved:
- no remat: `torch.compile` with Inductor's defaults (its min-cut partition) - the reference of every ratio;
- `backend="dtr"` (Inductor code generation) at budgets 1.0 / 0.7 / 0.5 / 0.35 / 0.25 of the no-remat peak,
  and with no budget;
- PyTorch's `torch._functorch.config.activation_memory_budget` (Inductor) swept over KNOB_SETTINGS: its
  setting is a fraction of saved bytes, not of the peak, so each dtr row is compared with the knob at equal
  *measured* peak (the knob's step time interpolated on its Pareto frontier between the settings whose
  peaks bracket ours, and the fastest setting at or below our peak);
- `torch.utils.checkpoint` on every block, compiled by Inductor.
Peaks: `dtr_compile.measure.measure_peak` of one step (profiler allocation events), gradients set to None
before it. Step time: process CPU time of one step on one thread (robust to the other jobs on a shared
machine), median over all rounds. `--planning` adds the planning time of a 12-block GPT (~2,000-node joint).
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from ...errors import BudgetError
from ...measure import measure_peak
from .. import provenance, upstairs
from ..block_models import COMPILED_MODELS, compiled_model
from ..markdown import write
from ..timing import interleaved, timed
from .args import positive
from .compiled_report import Way, report_model, summary

SUMMARY = 'backend="dtr" under Inductor against activation_memory_budget and per-block checkpointing (CPU)'
BUDGETS = (1.0, 0.7, 0.5, 0.35, 0.25)
KNOB_SETTINGS = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0.0)


def _inductor(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def _knob_backend(setting: float) -> Any:
    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        with torch._functorch.config.patch(activation_memory_budget=setting):
            return _inductor(gm, example_inputs)

    return backend


def build(name: str, way: Way) -> None:
    """Compile `way`, run a warm-up step, measure its peak (gradients cleared before the measured step)."""
    model, inputs = compiled_model(name, ckpt=way.kind == "ckpt")
    if way.kind == "dtr":
        backend = upstairs.load("backend").make_backend(way.setting, codegen="inductor")
    elif way.kind == "knob":
        backend = _knob_backend(way.setting)
    else:
        backend = _inductor  # a distinct callable per way, so that Dynamo compiles each way afresh
    compiled = torch.compile(model, backend=backend)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        compiled(*inputs).backward()

    try:
        compile_s = timed(step)[1].wall_s
    except Exception as error:  # noqa: BLE001 - an infeasible budget: keep the BudgetError's message
        cause = error
        while not isinstance(cause, BudgetError) and getattr(cause, "inner_exception", None) is not None:
            cause = cause.inner_exception
        way.error = str(cause).splitlines()[0]
        way.smallest = getattr(cause, "smallest_feasible_bytes", None)
        return
    step()
    model.zero_grad(set_to_none=True)
    gc.collect()  # garbage collected during the measured step would count as freed by it
    gc.disable()
    try:
        _, measured = measure_peak(lambda: compiled(*inputs).backward())
    finally:
        gc.enable()
    way.model, way.step, way.peak = model, step, measured.peak_bytes
    if way.kind == "dtr":
        report = backend.reports[-1]
        planned = report.planned_peak.peak_bytes
        way.note = (
            f"modelled {planned / 2**20:.2f} MiB, measured/modelled {measured.peak_bytes / planned:.2f}, "
            f"budget {'-' if report.budget_bytes is None else f'{report.budget_bytes / 2**20:.2f} MiB'}, "
            f"recompute {report.plan.recompute_s / report.plan.compute_s:.0%} of modelled compute, "
            f"planning {report.plan.planning_s:.2f} s, compile {compile_s:.0f} s"
        )


def run_model(name: str, rounds: int, per_round: int) -> dict[str, Any]:
    ways = [Way("no remat (Inductor defaults)", "base")]
    ways.append(Way("dtr, no budget", "dtr", None))
    ways += [Way(f"dtr {b}", "dtr", b) for b in BUDGETS]
    ways += [Way(f"activation_memory_budget {k}", "knob", k) for k in KNOB_SETTINGS]
    ways.append(Way("checkpoint every block", "ckpt"))
    for way in ways:
        build(name, way)
        status = way.error or f"peak {way.peak / 2**20:.2f} MiB {way.note}"
        print(f"[{name}] {way.label}: {status}", flush=True)
        if way.kind == "dtr" and way.smallest is not None and not any(w.label.startswith("dtr at") for w in ways):
            # The lowest measured peak our planner reaches, for the comparison at the low end.
            floor = Way(f"dtr at its smallest feasible budget ({way.smallest / 2**20:.2f} MiB)", "dtr", way.smallest)
            ways.insert(ways.index(way) + 1, floor)
    # Side by side, each step's process CPU time (one thread).
    for way in interleaved([w for w in ways if w.step is not None], rounds, per_round=per_round):
        way.times.append(timed(way.step)[1].cpu_s)
    return {"name": name, "ways": ways}


def planning_time(layers: int = 12, repeats: int = 3) -> list[str]:
    """Process CPU time of `plan_joint` on the joint graph of a `layers`-block GPT, as Inductor sees it."""
    passes, backend = upstairs.load("passes"), upstairs.load("backend")
    captured: dict[str, Any] = {}

    class Capture(upstairs.load("passes.partition").DTRPartitioner):
        def __call__(self, gm: Any, joint_inputs: Any, *, num_fwd_outputs: int, **kwargs: Any) -> Any:
            captured["joint"], captured["n"] = gm, num_fwd_outputs
            raise RuntimeError("captured")

    model, inputs = compiled_model("gpt", layers=layers)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(
            model, backend=lambda gm, ex: backend.compile_region(gm, ex, Capture(None), codegen="inductor")
        )
        compiled(*inputs)
    except Exception as error:  # the capture aborts the compile on purpose
        if "joint" not in captured:
            raise RuntimeError("could not capture the joint graph") from error
    joint, n = captured["joint"], captured["n"]
    lines = [
        (
            f"Planning time, `plan_joint` (cost pass, no-remat plan, search, emit, peak model) on the joint graph "
            f"of a {layers}-block GPT ({len(joint.graph.nodes)} nodes), Inductor memory model, process CPU time, best "
            f"of {repeats}:"
        ),
        "",
        "| budget | planning time | modelled peak / modelled no-remat |",
        "|---|---|---|",
    ]
    for budget in (0.7, 0.5, 0.35):
        best, cell = math.inf, "-"
        for _ in range(repeats):
            start = time.process_time()
            try:
                report = passes.plan_joint(joint, budget, num_fwd_outputs=n, codegen="inductor")
                cell = f"{report.planned_peak.peak_bytes / report.no_remat.peak_bytes:.2f}"
            except BudgetError as error:
                cell = f"infeasible: {str(error).split(':')[1].split(';')[0].strip()}"
            best = min(best, time.process_time() - start)
        lines.append(f"| {budget} | {best:.2f} s | {cell} |")
    lines.append("")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dtr_compile.bench compiled", description=SUMMARY)
    p.add_argument("--models", nargs="+", default=["gpt", "cnn"], choices=sorted(COMPILED_MODELS))
    p.add_argument("--rounds", type=positive, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--per-round", type=positive, default=3, help="steps of each way per round (default 3)")
    p.add_argument("--planning", action="store_true", help="also time planning on a ~2,000-node joint graph")
    p.add_argument("--out", default="benchmarks/compiled.md", help="Markdown fragment to write ('-': stdout only)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.accumulated_cache_size_limit = 1024
    started, load_start = provenance.utc_now(), provenance.load_text()
    sections, all_checks = [], {}
    for name in args.models:
        torch._dynamo.reset()
        lines, checks = report_model(run_model(name, args.rounds, args.per_round), COMPILED_MODELS[name])
        sections += lines
        all_checks[name] = checks
    planning = planning_time() if args.planning else []
    command = provenance.command(
        "compiled",
        ["--models", *args.models, "--rounds", str(args.rounds), "--per-round", str(args.per_round)]
        + (["--planning"] if args.planning else []),
    )
    header = [
        "## Compiled path (CPU, Inductor)",
        "",
        f"Command: `{command}`  ",
        (
            f"Run {started:%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, dtr_compile {provenance.version()} "
            f"({provenance.revision()}), "
            f"1 thread; load average (1/5/15 min) {load_start} at start, {provenance.load_text()} at the end. Step "
            f"time: process CPU time, median of {args.rounds} interleaved rounds x {args.per_round} steps. Ratios are "
            "to the no-remat row (Inductor's defaults) of the same model, measured in the same run."
        ),
        "",
    ]
    text = "\n".join(header + sections + planning + summary(all_checks))
    print(text)
    write(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
