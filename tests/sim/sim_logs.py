"""Hand-written operation logs for the sim tests, built with the same writer the runtime uses."""

from __future__ import annotations

import io

from dtr_compile.oplog.format import Trace, parse_lines
from dtr_compile.oplog.writer import LogWriter


def write(build) -> str:
    """The text of a log whose instructions `build(writer)` writes."""
    stream = io.StringIO()
    writer = LogWriter(stream)
    build(writer)
    writer.close()
    return stream.getvalue()


def trace_of(build) -> Trace:
    return parse_lines(write(build).splitlines(), source="test.log")


def chain(log: LogWriter, n: int, nbytes: int = 100, time_ns: int = 10) -> None:
    """x0 (a constant) -> x1 -> ... -> xn, each op `f` of cost `time_ns` making `nbytes` bytes."""
    log.constant("x0", nbytes)
    for i in range(1, n + 1):
        log.call("f", [f"x{i - 1}"], [f"x{i}"], [nbytes], [-1], time_ns)
