"""`python -m dtr_compile.bench`: compiled DTR, eager DTR and the peers, side by side.

    python -m dtr_compile.bench --quick                      # a few minutes on 2 CPU cores
    python -m dtr_compile.bench --models gpt2 bert --budgets 0.7 0.5 --methods eager dtr_eager dtr_inductor
    python -m dtr_compile.bench --device cuda --out bench-cuda   # CUDA is the default where one is present

Each (model, method, budget) runs in a fresh process with a fixed thread count. Writes results.csv,
results.md, pareto.png, section.md (a BENCHMARKS.md section) and, if a run failed, errors.txt into --out.

The other sections of BENCHMARKS.md come from the suites, `python -m dtr_compile.bench SUITE [flags]`
(suites/: runtime-overhead, replay, simrd-reference, compiled, kernels, handoff); `--help` lists them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from ..measure import add_device_argument, device_from_args
from .grid import Grid
from .methods import FRONTIER_ONLY, METHODS
from .models import MODELS, SIZES
from .provenance import load_average
from .report import RUN_INFO, markdown_table, regenerate, write_csv
from .runner import run_grid
from .suites import SUITES, listing

DEFAULT_BUDGETS = (0.9, 0.7, 0.5, 0.35, 0.2)  # the budget columns of the DTR paper's table

# --quick: small models, three budgets, every method, two children at a time (one thread each on a 2-core
# machine). The Inductor methods (15-30 s per cold compile on 2 cores, one compile per budget) run once, on
# the MLP at the middle budget; on the TreeLSTM (graph breaks) the compiled methods that run are backend="dtr"
# with the FX code generator (its regions join the eager runtime) and not the knob, which does not see the code
# between graphs. The whole grid stays within five minutes on a quiet 2-core machine.
QUICK_MODELS = ("mlp", "resnet", "gpt2", "treelstm")
QUICK_BUDGETS = (0.8, 0.5, 0.3)
_STATIC = ("mlp", "resnet", "gpt2")
QUICK_ONLY_MODELS = {"amb_inductor": ("mlp",), "dtr_inductor": ("mlp",), "amb_aot_eager": _STATIC, "dtr_fx": (*_STATIC, "treelstm")}
QUICK_ONLY_BUDGETS = {"amb_inductor": (0.5,), "dtr_inductor": (0.5,)}
QUICK_JOBS = 2
QUICK_TIMEOUT_S = 300.0


def build_parser() -> argparse.ArgumentParser:
    methods = "\n".join(f"  {m.name:<14} {m.label}" for m in METHODS.values())
    suites = (
        "suites (python -m dtr_compile.bench SUITE [flags]; SUITE --help for its flags):\n"
        f"  {'(none)':<17} the grid: every method side by side against plain eager (these flags; --quick)\n"
        f"  {'--frontier':<17} issue 17's frontier: every method against torch.compile (--frontier --help)\n"
        f"{listing()}"
    )
    p = argparse.ArgumentParser(
        prog="python -m dtr_compile.bench",
        usage="python -m dtr_compile.bench [SUITE [flags] | --frontier [flags] | [--quick] [grid flags]]",
        description="Compare compiled DTR, eager DTR, torch.utils.checkpoint and activation_memory_budget "
        f"against plain eager: measured peak memory, step time and gradient correctness.\n\n{suites}",
        epilog=f"methods:\n{methods}\n\nBudgets are fractions of plain eager's measured peak. The DTR methods get "
        "them as bytes (fraction x that peak);\nactivation_memory_budget gets the fraction as its own knob (a "
        "fraction of saved bytes);\neager and checkpoint ignore budgets and run once.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--frontier", action="store_true",
                   help="issue 17's frontier against torch.compile (its own flags: python -m dtr_compile.bench "
                   "--frontier --help)")  # fmt: skip
    p.add_argument("--quick", action="store_true",
                   help=f"small grid: models {' '.join(QUICK_MODELS)}, budgets {' '.join(map(str, QUICK_BUDGETS))}, "
                   "quick sizes, Inductor methods on mlp at 0.5 only, on treelstm only backend=\"dtr\" (fx) of the compiled methods, 2 jobs on cpu, "
                   "CPU clock; explicit flags override")  # fmt: skip
    p.add_argument("--models", nargs="+", metavar="MODEL", help=f"any of: {', '.join(MODELS)} (default: all)")
    p.add_argument("--methods", nargs="+", metavar="METHOD", help=f"any of: {', '.join(METHODS)} (default: all)")
    p.add_argument("--budgets", nargs="+", metavar="FRACTION",
                   help="fractions in (0, 1] of plain eager's measured peak "
                   f"(default: {' '.join(map(str, DEFAULT_BUDGETS))})")  # fmt: skip
    p.add_argument("--size", choices=SIZES, help="model sizes (default: full; quick with --quick)")
    add_device_argument(p)
    p.add_argument("--threads", type=int, default=1, help="torch threads in every run (default: 1)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps before timing, >= 1 (default: 2)")
    p.add_argument("--steps", type=int, default=5, help="timed steps, >= 5; the median is reported (default: 5)")
    p.add_argument("--clock", choices=("wall", "cpu"),
                   help="step time for the ratios: wall, or the process's CPU time, steady when runs share the "
                   "machine (needs --threads 1 on cpu); default: cpu with --quick on cpu, else wall")  # fmt: skip
    p.add_argument("--fresh-cache", action="store_true",
                   help="compile every run with empty Inductor/Triton caches (cold compile times); default: the "
                   "on-disk caches, warm from earlier runs")  # fmt: skip
    p.add_argument("--jobs", type=int,
                   help="runs at once (default: 1; 2 with --quick); more make step times noisier")  # fmt: skip
    p.add_argument("--timeout", type=float, help="seconds before a run is killed (default: 600; 300 with --quick)")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory (default: bench-out)")
    p.add_argument("--section", type=Path, help="also write the BENCHMARKS.md section to this file")
    p.add_argument("--into", type=Path,
                   help="also put the section into this file (e.g. BENCHMARKS.md) between <!-- bench:DEVICE:start/end "
                   "--> markers, appended if absent")  # fmt: skip
    return p


def parse_grid(argv: Sequence[str] | None = None) -> tuple[Grid, argparse.Namespace]:
    """Parse and validate the command line; bad input exits with a message listing what is accepted."""
    parser = build_parser()
    args = parser.parse_args(argv)
    models = _names(parser, "--models", args.models, MODELS, QUICK_MODELS if args.quick else MODELS)
    default_methods = tuple(m for m in METHODS if m not in FRONTIER_ONLY)  # those run with --frontier
    methods = _names(parser, "--methods", args.methods, tuple(METHODS), default_methods)
    budgets = _budgets(parser, args.budgets, QUICK_BUDGETS if args.quick else DEFAULT_BUDGETS)
    args.device = str(device_from_args(parser, args.device))  # children get "cpu", "cuda" or "cuda:N"
    if args.threads < 1:
        parser.error(f"--threads {args.threads}: expected a positive number of threads")
    # Two children sharing one GPU would time each other's kernels: on CUDA, one run at a time unless told.
    jobs = args.jobs if args.jobs is not None else (QUICK_JOBS if args.quick and args.device == "cpu" else 1)
    if jobs < 1:
        parser.error(f"--jobs {args.jobs}: expected a positive number of runs at once")
    # --quick runs two children at once on two cores: wall-clock ratios would mostly measure the neighbour.
    clock = args.clock or ("cpu" if args.quick and args.device == "cpu" and args.threads == 1 else "wall")
    if clock == "cpu" and (args.threads != 1 or args.device != "cpu"):
        parser.error("--clock cpu: needs --device cpu and --threads 1 (CPU time sums threads, misses GPU work)")
    if args.warmup < 1:
        parser.error(f"--warmup {args.warmup}: expected >= 1 (the first step compiles and is never timed)")
    if args.steps < 5:
        parser.error(f"--steps {args.steps}: expected >= 5 (a median of fewer steps is noise)")
    timeout = args.timeout if args.timeout is not None else (QUICK_TIMEOUT_S if args.quick else 600.0)
    if not timeout > 0:
        parser.error(f"--timeout {args.timeout}: expected a positive number of seconds")
    grid = Grid(
        models=models, methods=methods, budgets=budgets,
        size=args.size or ("quick" if args.quick else "full"), device=args.device, threads=args.threads,
        warmup=args.warmup, steps=args.steps, timeout_s=timeout, jobs=jobs, clock=clock,
        fresh_cache=args.fresh_cache,
        # The --quick restrictions hold only where the user left the grid to --quick: explicit flags override.
        only_models=QUICK_ONLY_MODELS if args.quick and not args.models else {},
        only_budgets=QUICK_ONLY_BUDGETS if args.quick and not args.budgets else {},
    )  # fmt: skip
    return grid, args


def _names(parser: argparse.ArgumentParser, flag: str, given: list[str] | None, accepted: Sequence[str],
           default: Sequence[str]) -> tuple[str, ...]:  # fmt: skip
    if not given:
        return tuple(default)
    names = [n for item in given for n in item.split(",") if n]  # "a,b" and "a b" both work
    unknown = [n for n in names if n not in accepted]
    if unknown:
        parser.error(f"{flag}: unknown {', '.join(map(repr, unknown))}; accepted: {', '.join(accepted)}")
    return tuple(dict.fromkeys(names))


def _budgets(parser: argparse.ArgumentParser, given: list[str] | None, default: Sequence[float]) -> tuple[float, ...]:
    if not given:
        return tuple(default)
    budgets = []
    for item in (b for text in given for b in text.split(",") if b):
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not 0.0 < value <= 1.0:
            parser.error(f"--budgets: {item!r} is not a fraction in (0, 1] of plain eager's measured peak")
        budgets.append(value)
    return tuple(sorted(set(budgets), reverse=True))


def _load_average() -> float | None:
    load = load_average()
    return None if load is None else round(load[0], 2)


def _write_tracebacks(rows: Sequence[dict], path: Path) -> None:
    """The full traceback of every run with status "error" (the CSV keeps only the message)."""
    failed = [r for r in rows if r.get("traceback")]
    path.unlink(missing_ok=True)
    if failed:
        path.write_text("\n\n".join(f"== {r['model']}/{r['method']}@{r['budget']}\n{r['traceback']}" for r in failed))


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if given and given[0] in SUITES:  # a suite with its own flags (suites/)
        return SUITES[given[0]].main(given[1:])
    if "--frontier" in given:  # a mode with its own grid and flags (frontier.py)
        from .frontier import main as frontier_main

        return frontier_main([a for a in given if a != "--frontier"])
    grid, args = parse_grid(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m dtr_compile.bench " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    start = time.perf_counter()
    load_before = _load_average()
    if load_before is not None and load_before > (os.cpu_count() or 1):
        print(f"warning: load average {load_before:.1f} on {os.cpu_count()} cores: other processes are running, "
              "step times will be noisy", file=sys.stderr)  # fmt: skip
    print(f"dtr_compile.bench: {len(grid.plan())} runs ({len(grid.models)} models, size {grid.size}, "
          f"{grid.device}, {grid.threads} thread(s), {grid.jobs} at once) -> {out}/", file=sys.stderr)  # fmt: skip

    def save(partial: list[dict]) -> None:
        write_csv(partial, out / "results.csv")  # after every run, so an interrupted bench keeps its rows

    with tempfile.TemporaryDirectory(prefix="dtr-bench-") as workdir:
        rows = run_grid(grid, Path(workdir), on_row=save)
    wall = time.perf_counter() - start
    info = {
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "wall_s": round(wall, 1),
        "jobs": grid.jobs,
        "fresh_cache": grid.fresh_cache,
        "load_average": [load_before, _load_average()],  # 1-minute load at start and end: was the machine quiet?
    }
    (out / RUN_INFO).write_text(json.dumps(info, indent=2))
    write_csv(rows, out / "results.csv")
    _write_tracebacks(rows, out / "errors.txt")
    regenerate(out, args.section, into=args.into)
    print("\n" + markdown_table(rows))
    errors = " (tracebacks of failed runs: errors.txt)" if (out / "errors.txt").exists() else ""
    print(f"wall time {wall / 60:.1f} min; wrote {out}/results.csv, results.md, pareto.png, section.md{errors}",
          file=sys.stderr)  # fmt: skip
    return 0
