"""What a stretch of a step allocates, apart from what was allocated before it: a memory window.

The runtime opens one when a compiled region's forward returns and closes it when that region's backward
begins (runtime/tails.py): what the code in between (the loss, later regions, their backward) allocates is
the region's *tail*, which its plan must leave room for. The step's memory alone cannot tell it: under a
budget the engine evicts older storages (the region's own saved values) to make room for the tail, so the
step's memory can stay flat while the tail grows. A window therefore counts only storages born after it
opened (storage ids are increasing), and apart from those, the older storages the program *dropped* in it
(freed because nothing holds them any more: outputs the loss no longer needs), which an eviction is not.
"""

from __future__ import annotations

from .records import Storage


class MemoryWindow:
    """Bytes of storages born since the window opened: now (`memory`), at most (`peak`), and the bytes of
    older storages freed as dead meanwhile (`dropped`)."""

    __slots__ = ("dropped", "evicted", "first_sid", "memory", "peak")

    def __init__(self, first_sid: int) -> None:
        self.first_sid = first_sid
        self.memory = 0
        self.peak = 0
        self.dropped = 0
        self.evicted: set[int] = set()  # older storages evicted in the window while still held (ids)

    def allocated(self, storage: Storage) -> None:
        if storage.sid >= self.first_sid:
            self.memory += storage.nbytes
            self.peak = max(self.peak, self.memory)

    def freed(self, storage: Storage, *, dead: bool) -> None:
        if storage.sid >= self.first_sid:
            self.memory -= storage.nbytes
        elif dead:
            self.dropped += storage.nbytes
        else:
            self.evicted.add(storage.sid)

    def died(self, storage: Storage) -> None:
        """The program let go of `storage` after it was evicted: an older one evicted in this window was dropped
        as well. A compiled backward frees the saved inputs it was handed (runtime/compiled_ops.py: consumed, an
        eviction); the logits a loss compiled in its own graph saved were dropped that way, and the tail of the
        model's region counted them held through its backward."""
        if storage.sid in self.evicted:
            self.evicted.discard(storage.sid)
            self.dropped += storage.nbytes

    def running(self, transient_bytes: int) -> None:
        """An operation is about to run with `transient_bytes` allocated and freed inside it (its outputs and
        workspace, before they are recorded)."""
        self.peak = max(self.peak, self.memory + transient_bytes)
