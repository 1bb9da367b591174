"""The operation log format: what the DTR authors' logs and our runtime's recorder write, line by line.

On the floor beside the engine: the runtime writes logs (runtime/recorder.py) and the replay reads them (sim/),
and neither imports the other.
"""

from .format import Call, Constant, Copy, CopyFrom, Mutate, Release, Trace, parse_lines, parse_log
from .writer import LogWriter

__all__ = [
    "Call",
    "Constant",
    "Copy",
    "CopyFrom",
    "LogWriter",
    "Mutate",
    "Release",
    "Trace",
    "parse_lines",
    "parse_log",
]
