"""Replay of operation logs through the eviction engine (`python -m dtr_compile.sim`).

    from dtr_compile.sim import LogWriter, parse_log, replay
    with LogWriter("step.log.gz") as log:       # what the torch runtime records
        ...
    result = replay(parse_log("step.log.gz"), ratio=0.3)

The log format itself (instructions, parser, writer) is `dtr_compile.oplog`, shared with the runtime's recorder.
Modules: replay (engine driver, baseline),
schedule (the trace as storages and ops), views (views re-run after their storage's eviction),
bounds (lower bounds: memory, and the least recompute of recompute_bound), future (next-use knowledge),
reference (the DTR authors' numbers), report (tables, JSON), cli (the command line).
"""

from ..oplog import LogWriter, Trace, parse_lines, parse_log
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
