"""Suite `simrd-reference`: the DTR authors' simulator (simrd) on the shared logs at any ratios, in
reference-simrd.md's format.

`../shared/dtr-logs/reference-simrd.md` gives the authors' simulator at ratios 0.1, 0.2, ..., 1.0. Between
0.1 and 0.2 is where online heuristics start to fail, so this suite runs the same simulator, the same way,
at other ratios; `python -m dtr_compile.sim ... --reference ../shared/dtr-logs/reference-simrd.md
--reference benchmarks/reference-simrd-fine.md` prints those cells beside ours.

simrd is not a dependency of dtr_compile and is not shipped here: pass the folder that holds the `simrd`
package of a checkout of uwsampl/dtr-prototype (and, with --deps, a folder holding `attrs`, which it needs).

    python -m dtr_compile.bench simrd-reference --simrd PATH ../shared/dtr-logs/*.log.gz \\
        --ratios 0.11,0.12,0.13,0.14,0.15,0.16,0.17,0.18,0.19 > benchmarks/reference-simrd-fine.md

The way of running matches reference-simrd.md (checked: at 0.1-0.9 this suite reproduces every published
DTREqClass cell): the eager-eviction runtime `RuntimeV2EagerOptimized`, a no-budget run for the peak and
the compute, then budget = int(ratio x peak) with the remat limit at the original compute (thrash beyond it).
"""

from __future__ import annotations

import argparse
import gzip
import math
import os
import sys
from collections.abc import Sequence

from .. import provenance, upstairs
from .args import fractions

SUMMARY = "the DTR authors' simulator (simrd, not shipped) on the operation logs at any ratios"


def run(path: str, budget: float, heuristic: object, remat_limit: float) -> tuple[object, str]:
    from simrd.parse import parse_file  # imported once --simrd is on the path
    from simrd.runtime import RematExceededError, RuntimeV2EagerOptimized

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        graph = parse_file(f)
    runtime = RuntimeV2EagerOptimized(budget, heuristic, remat_limit=remat_limit)
    try:
        graph.get_closure()(runtime)
    except MemoryError:
        return runtime, "OOM"
    except RematExceededError:
        return runtime, "thrash"
    return runtime, "ok"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dtr_compile.bench simrd-reference", description=SUMMARY)
    p.add_argument("logs", nargs="+", help="operation logs (.log or .log.gz)")
    p.add_argument("--simrd", required=True, help="folder holding the `simrd` package")
    p.add_argument("--deps", help="folder holding simrd's dependencies (attrs), if not installed")
    p.add_argument("--ratios", required=True, type=fractions, help="comma-separated fractions of the no-budget peak")
    p.add_argument("--heuristics", default="DTREqClass", help="comma-separated simrd heuristic classes")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    for folder in (args.deps, args.simrd):
        if folder is not None:
            if not os.path.isdir(folder):
                parser.error(f"{folder} is not a folder")
            sys.path.insert(0, folder)
    sys.setrecursionlimit(100_000)  # simrd recomputes recursively
    import simrd.heuristic

    names = args.heuristics.split(",")
    for name in names:
        if not hasattr(simrd.heuristic, name):
            parser.error(f"simrd.heuristic has no {name}")
    titles: dict[str, str] = {}
    for log in args.logs:
        titles.update(upstairs.load("sim.reference").manifest_beside(log))

    print("# The DTR authors' simulator at more ratios (python -m dtr_compile.bench simrd-reference)")
    print()
    print(f"Run {provenance.utc_now():%Y-%m-%d %H:%M} UTC with: {provenance.command('simrd-reference', argv)}")
    print()
    print("```")
    for log in args.logs:
        base, _ = run(log, math.inf, getattr(simrd.heuristic, names[0])(), math.inf)
        peak = base.telemetry.summary["max_memory"]
        compute = base.telemetry.summary["model_compute"]
        print(titles.get(os.path.basename(log), os.path.basename(log)))
        print("  heur          " + "".join(f"{r:>7}" for r in args.ratios))
        for name in names:
            cells = []
            for ratio in args.ratios:
                runtime, status = run(log, int(peak * ratio), getattr(simrd.heuristic, name)(), compute)
                cells.append(f"{runtime.clock / compute:.3f}" if status == "ok" else status)
            print(f"  {name:<12}" + "".join(f"{c:>7}" for c in cells), flush=True)
        print()
    print("```")
    return 0


if __name__ == "__main__":
    sys.exit(main())
