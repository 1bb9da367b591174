"""Future knowledge of a trace for the future-aware heuristics: when each storage is read next.

A compile-time planner knows every tensor's next use; the log replay knows it too, because the whole
trace is on disk. This annotates the replay's storages with their read times (in original compute ns,
the final pin of an output counting as a read at the end), and keeps the shared "now" that the replay
advances before each operation.
"""

from __future__ import annotations

from ..engine.heuristics import NextUses, ScheduleClock
from .schedule import Schedule


class FuturePlan:
    """`uses[k]` is the NextUses of storage key k; `clock.now` is set by the replay as it goes."""

    def __init__(self, sched: Schedule) -> None:
        self.clock = ScheduleClock()
        reads: list[list[float]] = [[] for _ in sched.sizes]
        for op in sched.ops:
            for key in set(op.inputs):
                reads[key].append(op.start)
        for key in sched.final_live:
            reads[key].append(sched.total_compute)
        self.uses = [NextUses(times, self.clock) for times in reads]
        self.op_start = {op.index: op.start for op in sched.ops}
        self.end = sched.total_compute
