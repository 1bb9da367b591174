"""Replay of operation logs through the eviction engine (`python -m dtr_compile.sim`).

    from dtr_compile.sim import LogWriter, parse_log, replay
    with LogWriter("step.log.gz") as log:       # what the torch runtime records
        ...
    result = replay(parse_log("step.log.gz"), ratio=0.3)

Modules: logformat (instructions, parser), logwriter (writer), replay (engine driver, baseline),
schedule (the trace as storages and ops), views (views re-run after their storage's eviction),
bounds (lower bounds: memory, and the least recompute of recompute_bound), future (next-use knowledge),
reference (the DTR authors' numbers), report (tables, JSON), cli (the command line).
"""

from .logformat import Trace, parse_lines, parse_log
from .logwriter import LogWriter
from .replay import Baseline, ReplayOptions, ReplayResult, baseline, drive, replay

__all__ = [
    "Baseline",
    "LogWriter",
    "ReplayOptions",
    "ReplayResult",
    "Trace",
    "baseline",
    "drive",
    "parse_lines",
    "parse_log",
    "replay",
]
