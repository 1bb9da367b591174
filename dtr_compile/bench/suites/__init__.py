"""The suites of `python -m dtr_compile.bench <suite>`: each regenerates one section of BENCHMARKS.md.

A suite is a module here with `SUMMARY` (its line in `--help`), `build_parser()` and `main(argv) -> int`. They
share the bench's models (models.py, dynamic_models.py, block_models.py), its timing loop (timing.py), its peak
meter (`dtr_compile.measure.measure_peak`) and its report writer (markdown.py, provenance.py). The grid (the
default, `--quick`) and the frontier (`--frontier`) are the bench's own modes (cli.py, frontier.py).

Importing a suite loads torch and the bench, nothing more: what it measures upstairs (the runtime, the backend,
the passes) is loaded when it runs (upstairs.py), so the kernels suite can still choose Triton's interpreter.
"""

from __future__ import annotations

from types import ModuleType

from . import compiled, handoff, kernels, replay, runtime_overhead, simrd_reference

# name on the command line -> suite, in the order of BENCHMARKS.md's sections
SUITES: dict[str, ModuleType] = {
    "runtime-overhead": runtime_overhead,
    "replay": replay,
    "simrd-reference": simrd_reference,
    "compiled": compiled,
    "kernels": kernels,
    "handoff": handoff,
}


def listing() -> str:
    """One line per suite, for `python -m dtr_compile.bench --help`."""
    return "\n".join(f"  {name:<17} {suite.SUMMARY}" for name, suite in SUITES.items())
