"""Views in the log replay, charged as the DTR authors' simulator charges them.

A view (a CALL result with ALIAS k) owns no memory: it is a handle on the storage of its argument. The
simulator still treats it as a tensor of its own: evicting the storage also discards every view of it, and a
view used after that is made again by re-running its view op (a recompute, charged at the op's logged time),
once its storage is back. The view ops' costs also count in the cost of their storage (its eviction makes
them run again), so the heuristics see a storage with many views as costlier to evict.

`ViewTracker` is the replay's Executor: it counts the evictions of every storage (a view made at eviction
count g is valid while the count is still g) and, when the engine recomputes an operation that read views,
re-runs the views that were discarded since.
"""

from __future__ import annotations

from ..engine import Engine, Operation, Storage


class View:
    """One view op's result(s) on one storage. `source` is the view it was made from, for views of views."""

    __slots__ = ("cost", "made_at", "name", "source", "storage")

    def __init__(self, name: str, cost: float, storage: Storage, source: View | None, made_at: int) -> None:
        self.name = name
        self.cost = cost
        self.storage = storage
        self.source = source
        self.made_at = made_at  # the storage's eviction count when this view was last made


class ViewTracker:
    """The replay's Executor: nothing to run or free, but views to invalidate and re-run."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self._evictions: dict[int, int] = {}  # storage sid -> times evicted

    def new_view(self, name: str, cost: float, storage: Storage, source: View | None) -> View:
        """A view op just ran on `storage`: its cost now counts in the storage's cost."""
        storage.alias_cost += cost
        return View(name, cost, storage, source, self._evictions.get(storage.sid, 0))

    def make_valid(self, view: View) -> None:
        """Re-run `view` (and the views it was made from) if its storage was evicted since it was made.
        The storage must be resident (the caller reserved it)."""
        count = self._evictions.get(view.storage.sid, 0)
        if view.made_at == count:
            return
        if view.source is not None:
            self.make_valid(view.source)
        assert self.engine is not None
        self.engine.charge_recompute(view.cost, view.name)
        view.made_at = count

    # ---------------------------------------------------------------------------------- Executor

    def recompute(self, op: Operation) -> None:
        """`op.payload` lists the views among the op's inputs (the replay records them)."""
        for view in op.payload or ():
            self.make_valid(view)

    def evict(self, storage: Storage) -> None:
        self._evictions[storage.sid] = self._evictions.get(storage.sid, 0) + 1
