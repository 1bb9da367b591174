"""The engine's plain records: storages (the unit of eviction) and operations (how to recompute them).

Callers attach their own data through `payload` (a torch buffer, a log entry); the engine never looks
inside it. Everything here is plain Python so the heuristics stay pure functions of these records.
"""

from __future__ import annotations

import weakref
from typing import Any


class EqClass:
    """A union-find node grouping adjacent evicted storages (h_DTR_eq's approximation of e*).

    Classes are merged when a storage is evicted next to evicted neighbours and their cost is reduced
    when a member is rematerialized; they are never split (the DTR paper's approximation).
    `live` counts the evicted members that the caller still holds (handles > 0): a class without any is a
    region of dead storages that nothing will ask for, unless a later eviction joins it to a live one.
    """

    __slots__ = ("cost", "live", "parent")

    def __init__(self, cost: float, live: int = 0) -> None:
        self.parent: EqClass = self
        self.cost = cost
        self.live = live

    def root(self) -> EqClass:
        node = self
        while node.parent is not node:
            node.parent = node.parent.parent  # path halving
            node = node.parent
        return node

    def union(self, other: EqClass) -> EqClass:
        a, b = self.root(), other.root()
        if a is not b:
            a.adopt(b)
        return a

    def adopt(self, root: EqClass) -> None:
        """Hang the other root `root` under this root, its cost and live members added."""
        root.parent = self
        self.cost += root.cost
        self.live += root.live


class Storage:
    """One buffer of memory: every tensor aliasing it lives and dies with it.

    `handles` counts the caller's live references (user-visible tensors); at zero the storage is freed
    at once ("eager eviction") but its record stays while an operation may need it to recompute another.
    `counted` is False for memory outside the budget (the torch runtime's parameters and inputs).
    """

    __slots__ = (
        "__weakref__",
        "_consumer_refs",
        "alias_cost",
        "counted",
        "eq",
        "evictable_since",
        "handles",
        "kept_resident",
        "last_access",
        "locks",
        "meta",
        "nbytes",
        "payload",
        "pinned",
        "pool_index",
        "producer",
        "resident",
        "sid",
    )

    def __init__(self, sid: int, nbytes: int, producer: Operation | None, *, pinned: bool, counted: bool) -> None:
        self.sid = sid
        self.nbytes = nbytes
        self.producer = producer
        # Weak, like Operation's outputs: an op (and its outputs) that nothing can need any more is freed by
        # reference counting at once instead of waiting for Python's cycle collector (which costs the runtime
        # a full heap scan every few thousand ops).
        self._consumer_refs: list[weakref.ref[Operation]] = []
        self.pinned = pinned
        self.counted = counted
        self.resident = True
        self.locks = 0
        self.handles = 0
        self.kept_resident = False  # Engine.keep_resident: out of the eviction pool while a handle holds it
        self.last_access = 0.0
        self.eq: EqClass | None = None
        self.pool_index = -1
        self.payload: Any = None
        self.meta: Any = None  # free for a caller or a heuristic (e.g. the next-use times of a planned schedule)
        # Cost of the view ops a caller ran on this storage, when it charges views as the DTR simulator does
        # (a view is re-run when used after its storage was evicted, so views make a storage costlier to evict).
        self.alias_cost = 0.0
        self.evictable_since = 0  # engine tick when it last became evictable (allocated, or its last lock released)

    @property
    def consumers(self) -> list[Operation]:
        """The live operations that read this storage."""
        return [op for ref in self._consumer_refs if (op := ref()) is not None]

    def add_consumer(self, op: Operation) -> None:
        refs = self._consumer_refs
        refs.append(weakref.ref(op))
        if len(refs) >= 32 and (len(refs) & (len(refs) - 1)) == 0:  # prune dead refs at powers of two
            refs[:] = [ref for ref in refs if ref() is not None]

    @property
    def cost(self) -> float:
        """Compute cost of recreating this storage alone: its producer's cost, plus `alias_cost` (0 for constants)."""
        return self.producer.cost + self.alias_cost if self.producer is not None else 0.0

    @property
    def evicted(self) -> bool:
        return not self.resident

    def __repr__(self) -> str:
        state = "pinned" if self.pinned else ("resident" if self.resident else "evicted")
        op = self.producer.name if self.producer is not None else "constant"
        return f"Storage(#{self.sid}, {self.nbytes} B, {state}, from {op})"


class Operation:
    """A call that produced fresh storages from input storages; rerunning it recreates all its outputs."""

    __slots__ = ("__weakref__", "cost", "inputs", "name", "output_refs", "payload", "workspace")

    def __init__(
        self, name: str, cost: float, inputs: tuple[Storage, ...], payload: Any = None, workspace: int = 0
    ) -> None:
        self.name = name
        self.cost = cost
        self.inputs = inputs
        self.workspace = workspace  # temporary bytes the op allocates and frees while it runs
        # Outputs point back at their producer strongly; this side is weak so that the pair forms no cycle.
        # An output that died can be needed by no one. Positions are stable (a dead output reads as None).
        self.output_refs: list[weakref.ref[Storage]] = []
        self.payload = payload

    @property
    def outputs(self) -> list[Storage]:
        """The live output storages."""
        return [s for ref in self.output_refs if (s := ref()) is not None]

    def add_output(self, storage: Storage) -> None:
        self.output_refs.append(weakref.ref(storage))

    def __repr__(self) -> str:
        return f"Operation({self.name}, cost={self.cost:g}, {len(self.inputs)} in, {len(self.outputs)} out)"
