"""A trace seen as storages and operations, without an engine: what the bounds and the planner read.

Storages are numbered in the order the replay creates them (constants, then the fresh outputs of each
CALL and the new version each MUTATE writes), so key k here is the k-th storage the replay's engine
creates; aliases resolve to the storage they view.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..oplog.format import Call, Constant, Copy, CopyFrom, Mutate, Release, Trace


@dataclass(frozen=True)
class ScheduledOp:
    index: int  # position in trace.instructions
    start: float  # original compute (ns) before this op runs
    created_before: int  # number of storages created before this op (keys below it exist)
    inputs: tuple[int, ...]  # storage keys read (with repeats, as logged)
    outputs: tuple[int, ...]  # storage keys created
    time: float = 0.0  # the op's logged compute time (ns): what one recompute of it costs


@dataclass
class Schedule:
    ops: list[ScheduledOp] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)  # bytes per storage key
    constant: list[bool] = field(default_factory=list)  # per storage key
    final_live: list[int] = field(default_factory=list)  # storage keys with a live handle at the end, in order
    total_compute: float = 0.0


def build_schedule(trace: Trace) -> Schedule:
    """Resolve names to storages and lay the trace out as a list of operations."""
    sched = Schedule()
    names: dict[str, int] = {}
    clock = 0.0

    def new_storage(nbytes: int, is_constant: bool) -> int:
        sched.sizes.append(nbytes)
        sched.constant.append(is_constant)
        return len(sched.sizes) - 1

    for index, ins in enumerate(trace.instructions):
        kind = type(ins)
        before = len(sched.sizes)
        if kind is Call:
            inputs = tuple(names[a] for a in ins.args)
            outputs = []
            for name, size, alias in zip(ins.results, ins.sizes, ins.aliases):
                if alias < 0:
                    key = new_storage(size, False)
                    outputs.append(key)
                else:
                    key = inputs[alias]
                names[name] = key
            sched.ops.append(ScheduledOp(index, clock, before, inputs, tuple(outputs), ins.time))
            clock += ins.time
        elif kind is Mutate:
            inputs = tuple(names[a] for a in ins.args)
            outputs = []
            for i in dict.fromkeys(ins.mutated):
                key = new_storage(sched.sizes[inputs[i]], False)
                outputs.append(key)
                names[ins.args[i]] = key
            sched.ops.append(ScheduledOp(index, clock, before, inputs, tuple(outputs), ins.time))
            clock += ins.time
        elif kind is Constant:
            names[ins.name] = new_storage(ins.nbytes, True)
        elif kind is Copy or kind is CopyFrom:
            names[ins.dst] = names[ins.src]
        elif kind is Release:
            del names[ins.name]
    sched.final_live = list(dict.fromkeys(names.values()))
    sched.total_compute = clock
    return sched
