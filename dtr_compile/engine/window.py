"""What a stretch of a step allocates, apart from what was allocated before it: a memory window.

The runtime opens one when a compiled region's forward returns and closes it when that region's backward
begins (runtime/tails.py): what the code in between (the loss, later regions, their backward) allocates is
the region's *tail*, which its plan must leave room for. The step's memory alone cannot tell it: under a
budget the engine evicts older storages (the region's own saved values) to make room for the tail, so the
step's memory can stay flat while the tail grows. A window therefore counts only storages born after it
opened (storage ids are increasing), and apart from those, the older storages the program *dropped* in it
(freed because nothing holds them any more: outputs the loss no longer needs), which an eviction is not.

Its peak is net of what was dropped before it: what the window's code holds above the window's start, as every
consumer of a tail reads it (the memory models add it to the forward's end, the outputs held; verify.py allocates
it there). Counted gross, a loss that lets the logits go after its log-softmax was charged them twice. Under torch
2.11 (the lent GPUs' release) GPT-2's first step showed its loss whole, log-softmax included, and every plan above
checkpointing's peak then measured one logits below the budget it was made for: 0.88-0.92 of it on an H200, 0.89
on the CPU stand-in, where torch 2.13 gave 0.95-0.98. A drop seen before any allocation is not credited: under torch
2.13 the first step begins inside TorchDynamo's frame and the loss's forward runs unseen, its log-softmax allocated
while the logits were alive, so that the drop of the logits is the first thing the window sees.
"""

from __future__ import annotations

from .records import Storage


class MemoryWindow:
    """Bytes of storages born since the window opened: now (`memory`), at most (`peak`), and the bytes of
    older storages freed as dead meanwhile (`dropped`)."""

    __slots__ = (
        "allocations",
        "credit_early_drops",
        "dead",
        "dropped",
        "evicted",
        "first_sid",
        "memory",
        "outputs",
        "peak",
        "released",
    )

    def __init__(self, first_sid: int, outputs: frozenset[int] = frozenset()) -> None:
        self.first_sid = first_sid
        # Ids of the storages of the outputs of the region whose tail this is: their drop is not counted in
        # `dropped`, as what it frees depends on the region's plan (it may save them), not on the code in the window
        # (runtime/tails.py notes which outputs the program let go).
        self.outputs = outputs
        self.memory = 0
        self.peak = 0  # of `memory - released`: what the window holds above its start, at most
        self.dropped = 0
        self.released = 0  # bytes of older storages dropped while resident, after the window's first allocation
        # Credit a drop seen before any allocation too: where the code that runs unseen has its births counted when
        # they are first seen (runtime/constants.py: a first step's loss, whose log-softmax is counted as the backward
        # reads it, after the logits' drop), so that nothing allocated unseen before the drop goes uncounted.
        self.credit_early_drops = False
        self.allocations = 0  # storages born in the window so far
        self.evicted: set[int] = set()  # older storages evicted in the window while still held (ids)
        # Older storages whose drop was counted, or that nothing held when the window saw them first (ids). A dead
        # storage comes back when a recompute needs it as an input, and is freed again after: that free is not the
        # program letting a value go. Counted each time, the GPT-2 step run op by op at 0.1 of torch.compile's peak
        # (CPU stand-in, many recomputes) measured a tail of -647 MiB at the backward's start on a 154 MiB model,
        # and the plan made with it measured 7.2x its model.
        self.dead: set[int] = set()

    def allocated(self, storage: Storage) -> None:
        if storage.sid >= self.first_sid:
            self.memory += storage.nbytes
            self.allocations += 1
            self.peak = max(self.peak, self.memory - self.released)
        elif storage.handles <= 0:  # an older storage nothing holds, back as a recompute's input
            self.dead.add(storage.sid)

    def freed(self, storage: Storage, *, dead: bool) -> None:
        if storage.sid >= self.first_sid:
            self.memory -= storage.nbytes
        elif dead:
            if storage.sid in self.dead:
                return
            self.dead.add(storage.sid)
            self.evicted.discard(storage.sid)
            if storage.sid not in self.outputs:
                self.dropped += storage.nbytes
            if self.allocations or self.credit_early_drops:
                self.released += storage.nbytes
        else:
            self.evicted.add(storage.sid)

    def died(self, storage: Storage) -> None:
        """The program let go of `storage` after it was evicted: an older one evicted in this window was dropped
        as well. A compiled backward frees the saved inputs it was handed (runtime/compiled_ops.py: consumed, an
        eviction); the logits a loss compiled in its own graph saved were dropped that way, and the tail of the
        model's region counted them held through its backward."""
        if storage.sid in self.evicted:
            self.evicted.discard(storage.sid)
            self.dead.add(storage.sid)
            if storage.sid not in self.outputs:
                self.dropped += storage.nbytes

    def running(self, transient_bytes: int) -> None:
        """An operation is about to run with `transient_bytes` allocated and freed inside it (its outputs and
        workspace, before they are recorded)."""
        self.peak = max(self.peak, self.memory - self.released + transient_bytes)
