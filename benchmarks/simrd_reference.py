"""Run the DTR authors' simulator (simrd) on the shared logs at any ratios, in reference-simrd.md's format.

`../shared/dtr-logs/reference-simrd.md` gives the authors' simulator at ratios 0.1, 0.2, ..., 1.0. Between
0.1 and 0.2 is where online heuristics start to fail, so this script runs the same simulator, the same way,
at other ratios; `python -m dtr_compile.sim ... --reference ../shared/dtr-logs/reference-simrd.md
--reference benchmarks/reference-simrd-fine.md` prints those cells beside ours.

simrd is not a dependency of dtr_compile and is not shipped here: pass the folder that holds the `simrd`
package of a checkout of uwsampl/dtr-prototype (and, with --deps, a folder holding `attrs`, which it needs).

    python benchmarks/simrd_reference.py --simrd PATH ../shared/dtr-logs/*.log.gz \\
        --ratios 0.11,0.12,0.13,0.14,0.15,0.16,0.17,0.18,0.19 > benchmarks/reference-simrd-fine.md

The way of running matches reference-simrd.md (checked: at 0.1-0.9 this script reproduces every published
DTREqClass cell): the eager-eviction runtime `RuntimeV2EagerOptimized`, a no-budget run for the peak and
the compute, then budget = int(ratio x peak) with the remat limit at the original compute (thrash beyond it).
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import math
import os
import sys

from dtr_compile.sim.reference import manifest_beside


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+")
    parser.add_argument("--simrd", required=True, help="folder holding the `simrd` package")
    parser.add_argument("--deps", help="folder holding simrd's dependencies (attrs), if not installed")
    parser.add_argument("--ratios", required=True, help="comma-separated fractions of the no-budget peak")
    parser.add_argument("--heuristics", default="DTREqClass", help="comma-separated simrd heuristic classes")
    args = parser.parse_args()
    for folder in (args.deps, args.simrd):
        if folder is not None:
            if not os.path.isdir(folder):
                parser.error(f"{folder} is not a folder")
            sys.path.insert(0, folder)
    sys.setrecursionlimit(100_000)  # simrd recomputes recursively
    import simrd.heuristic

    ratios = [float(r) for r in args.ratios.split(",")]
    names = args.heuristics.split(",")
    for name in names:
        if not hasattr(simrd.heuristic, name):
            parser.error(f"simrd.heuristic has no {name}")
    titles: dict[str, str] = {}
    for log in args.logs:
        titles.update(manifest_beside(log))

    print("# The DTR authors' simulator at more ratios (benchmarks/simrd_reference.py)")
    print()
    print(f"Run {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC with: python {' '.join(sys.argv)}")
    print()
    print("```")
    for log in args.logs:
        base, _ = run(log, math.inf, getattr(simrd.heuristic, names[0])(), math.inf)
        peak = base.telemetry.summary["max_memory"]
        compute = base.telemetry.summary["model_compute"]
        print(titles.get(os.path.basename(log), os.path.basename(log)))
        print("  heur          " + "".join(f"{r:>7}" for r in ratios))
        for name in names:
            cells = []
            for ratio in ratios:
                runtime, status = run(log, int(peak * ratio), getattr(simrd.heuristic, name)(), compute)
                cells.append(f"{runtime.clock / compute:.3f}" if status == "ok" else status)
            print(f"  {name:<12}" + "".join(f"{c:>7}" for c in cells), flush=True)
        print()
    print("```")


if __name__ == "__main__":
    main()
