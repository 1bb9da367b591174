"""The side-by-side benchmark: compiled DTR, eager DTR and the peers, on measured memory and step time.

    python -m dtr_compile.bench --quick
    python -m dtr_compile.bench --frontier --size small     # issue 17: every method against torch.compile
    python -m dtr_compile.bench runtime-overhead            # a suite: one section of BENCHMARKS.md (--help: all)

Layout: `models.py` (benchmark models, reused by examples and tests), `methods.py` (what is compared),
`grid.py` (what runs), `child.py` (one run in a fresh process), `runner.py` (the processes, progress), `report.py`
(CSV, markdown, BENCHMARKS section), `plot.py` (Pareto plot), `cli.py` (the command line), `frontier.py`
(`--frontier`: the same children with torch.compile as the reference, its own CSV, table and plot).
The suites (`suites/`: runtime-overhead, replay, simrd-reference, compiled, kernels, handoff) share with the grid
`timing.py` (the one timing loop), the models (plus `block_models.py`, `dynamic_models.py`), `markdown.py` and
`provenance.py` (their reports), and reach the runtime, backend and passes by name through `upstairs.py`.
"""

from .grid import Grid
from .methods import METHODS, Method, get_method
from .models import MODELS, SIZES, BenchCase, build_model
from .runner import run_grid

__all__ = ["METHODS", "MODELS", "SIZES", "BenchCase", "Grid", "Method", "build_model", "get_method", "run_grid"]
