"""A fixed schedule's memory, counted by the engine: the planner's peak model runs on the runtime's accounting.

The planner's model of a plan is the memory of a schedule whose every allocation and free is decided in advance:
the graph the plan was emitted as (passes/peak.py `graph_peak`; the search's fast simulation, passes/schedule.py,
keeps flat loops and is tested equal to it byte for byte). The model decides *when* each storage comes and goes (an
op's outputs where it, or the fused kernel it runs in, starts; a value after its last reader; the values saved
for the backward across the forward's end). What those storages occupy while an op runs is the engine's to count,
as it counts the live step's (runtime/) and the operation-log replay's (sim/): a storage is counted from the
`record` that makes it to the drop of its last handle, and an op runs with its inputs, its fresh outputs and its
workspace allocated (`Engine.reserve`). No budget: a fixed schedule evicts nothing, so none of the engine's
eviction machinery runs here.

Keys are whatever the caller names a storage by (a node's storage key, with the version of the recompute that
made it). Bytes that no storage of the schedule holds (the code between forward and backward, a loss the region
cannot see) are the caller's `outside` bytes, counted beside the engine's.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator

from .core import Engine
from .records import Storage


class ScheduleLedger:
    """The storages a fixed schedule holds, by the caller's keys, on an `Engine` without a budget."""

    __slots__ = ("_storages", "engine", "outside")

    def __init__(self) -> None:
        self.engine = Engine(None, thrash_limit=None)
        self._storages: dict[Hashable, Storage] = {}
        self.outside = 0  # bytes held by code the schedule does not contain (may be negative: a tail's drops)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._storages

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._storages)

    @property
    def memory(self) -> int:
        """Bytes live now: the engine's resident storages and the outside bytes."""
        return self.engine.memory + self.outside

    def allocate(self, name: str, sized_keys: Iterable[tuple[Hashable, int]], workspace: int = 0) -> int:
        """Op `name` makes the storages among `sized_keys` ((key, bytes) pairs) that are not live yet; returns the
        bytes live while it runs (`workspace` included: temporaries it frees before it returns)."""
        storages = self._storages
        fresh = {key: nbytes for key, nbytes in sized_keys if key not in storages}
        if fresh:
            engine = self.engine
            sizes = list(fresh.values())
            engine.reserve((), sum(sizes) + workspace, name)
            op = engine.record(name, (), sizes, 0.0, workspace=workspace)
            storages.update(zip(fresh, op.outputs, strict=True))
        elif workspace:
            self.engine.reserve((), workspace, name)
            self.engine.record_nothing((), 0.0)
        return self.memory + workspace

    def free(self, key: Hashable) -> bool:
        """Drop the schedule's handle on `key`'s storage (the engine frees it); False when it was not live."""
        storage = self._storages.pop(key, None)
        if storage is None:
            return False
        self.engine.drop_handle(storage)
        return True
