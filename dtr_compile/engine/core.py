"""The eviction engine: a pool of storages under a byte budget, a logical clock, and rematerialization.

One engine serves three callers: the torch runtime (live training), the operation-log replay (sim/),
and the compile-time planner (passes/). The protocol for every operation is the same:

    engine.reserve(inputs, out_bytes, name)   # before running: inputs resident and locked, room made
    ... the caller runs the operation ...
    op = engine.record(name, inputs, out_sizes, cost)   # after: outputs registered, inputs unlocked

Room is made *before* an allocation, never after, so the accounted memory never exceeds the budget
(the DTR prototype checked after each op and overshot by up to 60%). Rematerialization calls back into
the caller through an `Executor`, so the engine itself knows nothing of torch.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..errors import BudgetError, ThrashError, format_bytes
from .heuristics import Heuristic, get_heuristic
from .pool import CandidatePool
from .records import EqClass, Operation, Storage
from .window import MemoryWindow

# The thrash guard only trips after this many rematerializations, so that one early recompute of an
# expensive op (when little compute has run yet) does not count as thrashing.
_THRASH_GRACE_REMATS = 64

# Below this many candidates, "sqrt" sampling scores them all.
_MIN_SAMPLE = 32


class _Frame:
    """One pending recompute in `Engine._rematerialize`: the op and which of its inputs it has locked."""

    __slots__ = ("first_visit", "locked", "op")

    def __init__(self, op: Operation) -> None:
        self.op = op
        self.locked: set[int] = set()  # positions in op.inputs
        self.first_visit = True


def _next_missing(op: Operation, frame: _Frame) -> Storage | None:
    """The evicted input of `op` to recompute next, or None when all are resident or taken care of.

    The first one whose own recompute needs further recomputes (the deep branch first, as in Sethi-Ullman
    register allocation, so that what a shallow branch brings back is not held through the deep one), else
    the first evicted input."""
    first: Storage | None = None
    for position, storage in enumerate(op.inputs):
        if position in frame.locked or storage.resident:
            continue
        if _has_evicted_parent(storage):
            return storage
        if first is None:
            first = storage
    return first


def _has_evicted_parent(storage: Storage) -> bool:
    producer = storage.producer
    return producer is not None and any(not parent.resident for parent in producer.inputs)


def _needed_by_held(storage: Storage) -> bool:
    """Whether an evicted storage the caller still holds may need `storage` to be recomputed.

    True when an evicted child of `storage` belongs to an equivalence class with a held member (EqClass.live).
    Classes join evicted storages along evicted paths in both directions and never split, so this may say
    True for a storage that is no longer needed (it then stays until the heuristic evicts it), but it says
    False only when no evicted path leads from `storage` down to a held storage.
    """
    for op in storage.consumers:
        for child in op.outputs:
            if not child.resident and child.eq is not None and child.eq.root().live > 0:
                return True
    return False


def _class_joining_evicted_neighbours(storage: Storage) -> EqClass:
    """A new eviction class for `storage` (just evicted), joined with the classes of its evicted neighbours: the
    same classes, costs and live counts as `EqClass.union` with each of `heuristics.evicted_neighbours`.

    Every eviction and every death runs it, and a neighbour is most often in the class already (a backward's
    hundred gradients die next to the same hundred-odd consumed activations): the loops are inlined, and such a
    neighbour costs one `root()`. The new class stays the root, so each other root is hung under it directly."""
    eq = EqClass(storage.cost, live=1 if storage.handles > 0 else 0)
    parents = storage.producer.inputs if storage.producer is not None else ()
    children = [child for op in storage.consumers for child in op.outputs]
    for neighbour in (*parents, *children):
        if neighbour.resident or neighbour.eq is None:
            continue
        root = neighbour.eq.root()
        if root is not eq:
            eq.adopt(root)
    return eq


class Executor(Protocol):
    """What the engine asks of its caller."""

    def recompute(self, op: Operation) -> None:
        """Rerun `op` so that every output storage holds its value again (inputs are resident and locked)."""

    def evict(self, storage: Storage) -> None:
        """Free the memory of `storage` (the engine has already marked it evicted)."""


class NullExecutor:
    """For callers that only account (log replay, planning): nothing to run, nothing to free."""

    def recompute(self, op: Operation) -> None:
        pass

    def evict(self, storage: Storage) -> None:
        pass


@dataclass
class EngineStats:
    """Counters of one engine. Costs are in the caller's unit (ns in logs, seconds in the torch runtime)."""

    budget_bytes: int | None
    memory_bytes: int
    peak_bytes: int
    compute_cost: float
    remat_cost: float
    evictions: int
    eager_evictions: int
    remats: int
    search_seconds: float

    @property
    def overhead(self) -> float:
        """(original compute + recompute) / original compute."""
        return (self.compute_cost + self.remat_cost) / self.compute_cost if self.compute_cost > 0 else 1.0


class Engine:
    """Greedy online rematerialization over storages (DTR), driven by an Executor."""

    def __init__(
        self,
        budget_bytes: int | None,
        *,
        heuristic: str | Heuristic = "dtr_eq",
        candidate_sampling: str | int = "sqrt",
        min_evictable_fraction: float = 0.01,
        min_evictable_bytes: int = 0,
        thrash_limit: float | None = 1.0,
        thrash_reference_cost: float | None = None,
        seed: int = 0,
        executor: Executor | None = None,
        keep_dead_intermediates: bool = False,
        retain_needed_dead: bool | None = None,
    ) -> None:
        """`thrash_reference_cost`: when the total original compute is known in advance (log replay), the
        thrash guard compares recompute against it instead of against the compute seen so far.
        `keep_dead_intermediates`: storages without handles that a recompute chain brought back stay resident
        (evictable, first to go under dtr_eq_dead and dtr_eq_retain) instead of being freed once used, so the
        next recompute nearby can reuse them (the DTR simulator's behaviour; the log replay turns it on).
        `retain_needed_dead`: a storage whose last handle dies stays resident (evictable) instead of being freed
        at once while an evicted storage that the caller still holds may need it to be recomputed (see
        `_needed_by_held`); None (the default) follows the heuristic (`retains_needed_dead`)."""
        self.budget_bytes = budget_bytes
        self.heuristic: Heuristic = get_heuristic(heuristic) if isinstance(heuristic, str) else heuristic
        if retain_needed_dead is None:
            retain_needed_dead = bool(getattr(self.heuristic, "retains_needed_dead", False))
        self.retain_needed_dead = retain_needed_dead
        self.candidate_sampling = candidate_sampling
        self.min_evictable_fraction = min_evictable_fraction
        self.min_evictable_bytes = min_evictable_bytes
        self.thrash_limit = thrash_limit
        self.thrash_reference_cost = thrash_reference_cost
        self.executor: Executor = executor if executor is not None else NullExecutor()
        self.keep_dead_intermediates = keep_dead_intermediates
        self.rng = random.Random(seed)
        self.pool = CandidatePool()
        self.clock = 0.0
        self.memory = 0  # resident bytes of counted storages
        self.peak = 0
        # The most resident bytes plus the room an operation was given to run in (its outputs and transient peak, from
        # `reserve`): what the step reached with every operation's own allocations counted. `peak` counts storages
        # only, as the log replay's figures always have.
        self.room_peak = 0
        self.compute_cost = 0.0
        self.remat_cost = 0.0
        self.evictions = 0
        self.eager_evictions = 0
        self.remats = 0
        self.search_seconds = 0.0
        self._next_sid = 0
        # Storages with live handles. Operations hold their outputs weakly (records.py), so this is what keeps
        # a held storage's record alive; one without handles lives only as long as an op may need it.
        self._held: dict[int, Storage] = {}
        self._resident_count = 0  # counted resident storages, for the mean size of min_evictable_fraction
        self._current_op = ""  # name of the op being prepared, for error messages
        # Overrun mode (set by a caller that finds a feasible budget for a failed step, runtime.py): an operation
        # that cannot fit even after evicting every candidate raises the budget to what it needs instead of
        # raising BudgetError, and `overrun_need` keeps the most memory such an operation needed.
        self.overrun = False
        self.overrun_need: int | None = None
        self.overrun_at = ""  # the first operation that did not fit, and why
        # A strict reservation (see `reserve`) raises BudgetError where overrun mode would raise the budget; the
        # step stays in overrun mode for everything else (a recompute beyond thrash_limit raises the budget).
        self._strict = False
        self.budget_asked: int | None = None  # the budget before overrun mode raised it, for error messages
        self.windows: list[MemoryWindow] = []  # open memory windows (window.py), usually none or one or two
        self._ticks = 0  # for Storage.evictable_since

    # ------------------------------------------------------------------------------------ creation

    def constant(self, nbytes: int, *, counted: bool = False, payload: object = None) -> Storage:
        """A pinned storage that is never evicted: a parameter, an input, a buffer."""
        storage = self._new_storage(nbytes, None, pinned=True, counted=counted)
        storage.payload = payload
        self.add_handle(storage)
        self._allocate(storage)
        return storage

    def reserve(self, inputs: Sequence[Storage], out_bytes: int, name: str = "op", *, strict: bool = False) -> None:
        """Before running an operation: make its inputs resident (recomputing evicted ones), lock them,
        and evict until `out_bytes` more fit in the budget. Pair every call with `record` or `abandon`.
        If it raises (BudgetError, ThrashError, an executor's error), it has released its locks itself.
        `strict`: raise BudgetError when the operation cannot fit even in overrun mode (a caller that has
        another way to run it)."""
        self._current_op = name
        for storage in inputs:
            storage.locks += 1
            # Accessed when the operation is requested, before any recompute it triggers (as in the DTR
            # simulator): the recompute chain's own cost does not make the inputs look fresher.
            storage.last_access = self.clock
        was_strict = self._strict
        try:
            if strict:
                self._strict = True
            self._check_reachable(inputs, out_bytes)
            # The deep ones first (see `_next_missing`): what a shallow one brings back is held (locked) after.
            missing = [s for s in inputs if not s.resident]
            if len(missing) > 1:
                missing.sort(key=lambda s: not _has_evicted_parent(s))
            for storage in missing:
                if not storage.resident:  # a sibling's recompute may have brought it back
                    self._rematerialize(storage)
            self._make_room(out_bytes)
            self.room_peak = max(self.room_peak, self.memory + out_bytes)
            for window in self.windows:
                window.running(out_bytes)
        except BaseException:
            for storage in inputs:
                self._unlock(storage)
            raise
        finally:
            self._strict = was_strict

    def record(
        self,
        name: str,
        inputs: Sequence[Storage],
        out_sizes: Sequence[int],
        cost: float,
        *,
        payload: object = None,
        consumes: Iterable[Storage] = (),
        pinned_outputs: bool = False,
        workspace: int = 0,
    ) -> Operation:
        """After running an operation: register its fresh output storages (resident, one handle each) and
        unlock the inputs. `consumes` lists inputs whose memory an in-place operation took over: they
        become evicted (recomputable from their producer) without freeing anything. `workspace`: bytes
        the op allocates temporarily while running (the caller reserved them too); a recompute makes
        room for them again."""
        op = Operation(name, float(cost), tuple(inputs), payload, workspace)
        for storage in inputs:
            if storage.producer is not None:  # constants never need their children: keeps old steps collectable
                storage.add_consumer(op)
        for storage in consumes:
            if storage.producer is None:
                raise ValueError(f"{name}: a constant cannot be consumed in place (storage #{storage.sid})")
            self._mark_evicted(storage, dead=storage.handles <= 0)
        for nbytes in out_sizes:
            out = self._new_storage(nbytes, op, pinned=pinned_outputs, counted=True)
            self.add_handle(out)
            out.last_access = self.clock + op.cost  # written when the op ends: not stale yet (as in DTR)
            op.add_output(out)
            self._allocate(out)
        self._ran(inputs, op.cost)
        return op

    def record_nothing(self, inputs: Sequence[Storage], cost: float) -> None:
        """After running an operation with no output for the engine (it wrote only constants): unlock its inputs
        and advance the clock as `record` would. Nothing is recorded: without outputs, nothing can need it rerun."""
        self._ran(inputs, float(cost))

    def _ran(self, inputs: Sequence[Storage], cost: float) -> None:
        """An operation over `inputs` has run: unlock them and advance the clock by its cost."""
        for storage in inputs:
            self._unlock(storage)
        self.clock += cost
        self.compute_cost += cost

    def make_room(self, nbytes: int, keep: Sequence[Storage] = ()) -> None:
        """Evict until `nbytes` more fit the budget, or nothing is left to evict, for memory that code the engine
        cannot see may allocate; never `keep` (what that code may read: it cannot ask for it back). Room made ahead
        for a guess: nothing is recorded, no overrun is counted where it falls short (the code may need less), and no
        memory window counts the bytes (they are not allocated here)."""
        for storage in keep:
            storage.locks += 1
        try:
            self._evict_until_fits(nbytes)
        finally:
            for storage in keep:
                self._unlock(storage)

    def abandon(self, inputs: Sequence[Storage]) -> None:
        """Undo the locks of a `reserve` whose operation failed (or that only materialized its inputs)."""
        for storage in inputs:
            self._unlock(storage)

    # ------------------------------------------------------------------------------------ lifetime

    def add_handle(self, storage: Storage) -> None:
        if storage.handles <= 0:
            self._held[storage.sid] = storage
            if storage.handles == 0 and storage.eq is not None:  # an evicted storage is held again
                storage.eq.root().live += 1
        storage.handles += 1

    def drop_handle(self, storage: Storage) -> None:
        """A caller's reference died; at zero the memory is freed at once (its record stays for remat),
        unless `retain_needed_dead` keeps it for the recompute of an evicted storage that is still held."""
        storage.handles -= 1
        if storage.handles <= 0:
            self._held.pop(storage.sid, None)
            if storage.handles == 0 and storage.eq is not None:
                storage.eq.root().live -= 1
            if not storage.resident:
                for window in self.windows:
                    window.died(storage)
            if storage.locks == 0:
                self._free_if_dead(storage)

    def keep_resident(self, storage: Storage) -> None:
        """Never choose `storage` for eviction while a handle holds it; unlike `pin`, it is freed as usual when
        its last handle dies (or, if `retain_needed_dead` keeps it, it becomes an eviction candidate again)."""
        storage.kept_resident = True
        self.pool.discard(storage)

    def pin(self, storage: Storage) -> None:
        """Never evict `storage` again (e.g. an output that must survive the step)."""
        if not storage.resident:
            self.reserve([storage], 0, "pin")
            self.abandon([storage])
        storage.pinned = True
        self.pool.discard(storage)

    def free_dead(self) -> None:
        """Free every resident storage that no handle holds (intermediates kept after a recompute chain).

        The torch runtime calls this when a step ends, so that memory is returned between steps."""
        for storage in [s for s in self.pool if s.handles <= 0 and not s.locks]:
            self._evict(storage, eager=True)

    def open_window(self, outputs: frozenset[int] = frozenset()) -> MemoryWindow:
        """Start counting what is allocated from now on apart from what was before (window.py); `outputs`: ids of
        storages whose drop it does not count as dropped (a region's outputs)."""
        window = MemoryWindow(self._next_sid, outputs)
        self.windows.append(window)
        return window

    def close_window(self, window: MemoryWindow) -> None:
        if window in self.windows:
            self.windows.remove(window)

    def release(self, storage: Storage, *, step_over: bool = False) -> None:
        """The caller took this storage's bytes out of the engine's hands (e.g. a gradient handed to the
        user at the end of a step): stop counting them and its handles. The record stays, evicted, for
        recomputes, as long as an operation that may need it does.

        `step_over`: nothing of the step will be evicted or recomputed any more (its end, after what outlives it
        was restored): the storage joins no eviction class, which only the heuristics and the retention of dead
        storages read. A hundred released storages took 12 ms of a 0.9 s step on the CPU stand-in's GPT-2."""
        storage.pinned = False
        storage.handles = 0
        self._held.pop(storage.sid, None)
        if storage.resident:
            self._mark_evicted(storage, classed=not step_over)
            self.executor.evict(storage)

    def evict(self, storage: Storage) -> None:
        """Evict `storage` now (planned eviction); it must be resident, unpinned and unlocked."""
        if storage.pinned or storage.locks or not storage.resident or storage.producer is None:
            raise ValueError(f"cannot evict {storage!r}: pinned, locked, already evicted or a constant")
        self._evict(storage, eager=False)

    def charge_recompute(self, cost: float, name: str = "recompute") -> None:
        """Count a recompute the caller ran itself on resident storages (the log replay re-running a view op
        whose storage was evicted since the view was made): it advances the clock, adds to the recompute cost
        and can trip the thrash guard (ThrashError)."""
        self.clock += cost
        self.remat_cost += cost
        self.remats += 1
        self._check_thrash(name)

    def materialize(self, storage: Storage) -> None:
        """Make `storage` resident (recomputing it if needed) without running a new operation."""
        if not storage.resident:
            self.reserve([storage], 0, "materialize")
            self.abandon([storage])

    # ------------------------------------------------------------------------------------ queries

    def stats(self) -> EngineStats:
        return EngineStats(
            budget_bytes=self.budget_bytes,
            memory_bytes=self.memory,
            peak_bytes=self.peak,
            compute_cost=self.compute_cost,
            remat_cost=self.remat_cost,
            evictions=self.evictions,
            eager_evictions=self.eager_evictions,
            remats=self.remats,
            search_seconds=self.search_seconds,
        )

    # ------------------------------------------------------------------------------------ internals

    def _new_storage(self, nbytes: int, producer: Operation | None, *, pinned: bool, counted: bool) -> Storage:
        storage = Storage(self._next_sid, int(nbytes), producer, pinned=pinned, counted=counted)
        self._next_sid += 1
        return storage

    def _allocate(self, storage: Storage) -> None:
        storage.resident = True
        if storage.eq is not None:  # coming back from eviction: its class no longer pays for it
            root = storage.eq.root()
            root.cost -= storage.cost
            if storage.handles > 0:
                root.live -= 1
            storage.eq = None
        if storage.counted:
            self.memory += storage.nbytes
            self._resident_count += 1
            self.peak = max(self.peak, self.memory)
            for window in self.windows:
                window.allocated(storage)
        # Evicting an empty storage frees nothing (and every heuristic divides by its size): never a candidate.
        if not storage.pinned and storage.counted and storage.producer is not None and storage.nbytes > 0:
            self.pool.add(storage)
            self._became_evictable(storage)

    def _mark_evicted(self, storage: Storage, *, dead: bool = False, classed: bool = True) -> None:
        """Bookkeeping of an eviction (`dead`: of a storage nothing holds any more; `classed`: it joins an eviction
        class, see `release`); the caller of this decides whether memory is freed."""
        storage.resident = False
        self.pool.discard(storage)
        if storage.counted:
            self.memory -= storage.nbytes
            self._resident_count -= 1
            for window in self.windows:
                window.freed(storage, dead=dead)
        storage.eq = _class_joining_evicted_neighbours(storage) if classed else None

    def _evict(self, storage: Storage, *, eager: bool) -> None:
        self._mark_evicted(storage, dead=eager)
        if eager:
            self.eager_evictions += 1
        else:
            self.evictions += 1
        self.executor.evict(storage)

    def _make_room(self, nbytes: int) -> None:
        if self._evict_until_fits(nbytes):
            return
        if self.overrun and not self._strict:
            self._raise_budget_to(self.memory + nbytes)
            return
        self._raise_budget_error(nbytes)

    def _evict_until_fits(self, nbytes: int) -> bool:
        """Evict until `nbytes` more fit the budget; False where nothing is left to evict first."""
        if self.budget_bytes is None:
            return True
        while self.memory + nbytes > self.budget_bytes:
            victim = self._choose_victim()
            if victim is None:
                return False
            self._evict(victim, eager=False)
        return True

    def _choose_victim(self) -> Storage | None:
        start = time.perf_counter()
        try:
            threshold = self._min_evictable_size()
            candidates = [s for s in self._sample() if not s.locks and s.nbytes >= threshold]
            if not candidates:  # the sample was unlucky or everything is small: look at all of them
                candidates = [s for s in self.pool if not s.locks]
            if not candidates:
                return None
            clock, rng, score = self.clock, self.rng, self.heuristic
            best, best_score = candidates[0], math.inf
            for storage in candidates:
                value = score(storage, clock, rng)
                if value < best_score or (value == best_score and storage.evictable_since > best.evictable_since):
                    best, best_score = storage, value
                    if value <= 0.0:  # no heuristic scores below 0: nothing can beat a free eviction
                        break
            return best
        finally:
            self.search_seconds += time.perf_counter() - start

    def _sample(self) -> list[Storage]:
        n = len(self.pool)
        if self.candidate_sampling == "all":
            k = n
        elif self.candidate_sampling == "sqrt":
            # sqrt(n) keeps the search cheap for large pools; small pools are scored whole, since a sample of
            # 3 out of 10 too often holds only fresh tensors about to be used again.
            k = max(math.isqrt(n), min(n, _MIN_SAMPLE))
        else:
            k = int(self.candidate_sampling)
        return self.pool.sample(k, self.rng)

    def _min_evictable_size(self) -> float:
        mean = self.memory / self._resident_count if self._resident_count else 0.0
        return max(self.min_evictable_bytes, self.min_evictable_fraction * mean)

    def _rematerialize(self, target: Storage) -> None:
        """Recompute `target`, first recomputing whatever evicted inputs its producer needs.

        Iterative (an explicit stack) because chains of evicted storages can be thousands long. A frame
        recomputes its missing inputs one at a time, deepest first, keeping each locked once it is back, and
        locks its resident inputs only when none is missing: along a chain t0 -> t1 -> ... -> tk only a few
        storages are locked at any moment, instead of the whole chain (which would make tight budgets fail).
        """
        stack = [_Frame(self._producer_of(target))]
        try:
            self._run_frames(stack)
        except BaseException:  # release what the frames still waiting hold, or those storages stay locked forever
            for frame in stack:
                for position in frame.locked:
                    self._unlock(frame.op.inputs[position])
            raise

    def _run_frames(self, stack: list[_Frame]) -> None:
        while stack:
            frame = stack[-1]
            op = frame.op
            if frame.first_visit:
                frame.first_visit = False
                # Every storage a frame waits for is locked (by `reserve` or by the frame below): if none of
                # those is missing, another frame already recomputed this op (dead by-products stay evicted).
                if not any(out.locks and not out.resident for out in op.outputs):
                    stack.pop()
                    continue
                for storage in op.inputs:  # accessed when the recompute is requested, as in `reserve`
                    storage.last_access = self.clock
            missing = _next_missing(op, frame)
            if missing is not None:
                for position, storage in enumerate(op.inputs):
                    if position not in frame.locked and storage.producer is missing.producer and not storage.resident:
                        # Locked before it is back (an evicted storage holds no memory): otherwise a dead
                        # intermediate would be freed again as a by-product of its own recompute, and looped on.
                        # Siblings from the same producer too: one rerun brings them all back, and an unlocked
                        # dead sibling would be freed again and recomputed once more (2^depth reruns along a
                        # chain of multi-output ops that each read both outputs of the previous one).
                        storage.locks += 1
                        frame.locked.add(position)
                # The resident inputs stay unlocked while a missing one is recomputed: along a chain whose ops
                # also read a resident storage each (an LSTM step reads h[t-1] and the input projection of step
                # t), locking those at every level would hold the whole chain's worth at once. One evicted
                # meanwhile is simply missing at the next visit; every visit locks at least one more input for
                # good, so a frame is visited at most once per input.
                stack.append(_Frame(self._producer_of(missing)))
                continue
            for position, storage in enumerate(op.inputs):  # all resident now: lock them for the rerun
                if position not in frame.locked:
                    storage.locks += 1
                    frame.locked.add(position)
            stack.pop()
            try:
                self._rerun(op)
            finally:
                for position in frame.locked:
                    if self.keep_dead_intermediates:  # stays resident until the heuristic evicts it
                        storage = op.inputs[position]
                        storage.locks -= 1
                        if storage.locks == 0:
                            self._became_evictable(storage)
                    else:
                        self._unlock(op.inputs[position])

    def _rerun(self, op: Operation) -> None:
        missing = [out for out in op.outputs if not out.resident]
        # Lock what is already resident so that making room for the rest cannot evict it mid-recompute.
        resident = [out for out in op.outputs if out.resident]
        for out in resident:
            out.locks += 1
        try:
            self._make_room(sum(out.nbytes for out in missing if out.counted) + op.workspace)
            self.executor.recompute(op)
        finally:
            for out in resident:
                self._unlock(out)
        for out in missing:  # their last access stays when they were asked for (see `reserve`)
            self._allocate(out)
        self.clock += op.cost
        self.remat_cost += op.cost
        self.remats += 1
        # Outputs whose every handle died were recomputed only as by-products: free them again.
        for out in missing:
            if not out.locks:
                self._free_if_dead(out)
        self._check_thrash(op.name)  # last: a ThrashError must not leave freed-again by-products resident

    def _unlock(self, storage: Storage) -> None:
        storage.locks -= 1
        # A handle that died while its storage was locked (in use by a running op) frees it now.
        if storage.locks == 0:
            self._became_evictable(storage)
            self._free_if_dead(storage)

    def _became_evictable(self, storage: Storage) -> None:
        """Stamp the order in which storages become candidates: ties between equal scores go to the storage
        that became evictable last, as in the DTR simulator (whose candidate list is in that order)."""
        self._ticks += 1
        storage.evictable_since = self._ticks

    def _free_if_dead(self, storage: Storage) -> None:
        """Free an unlocked storage that no handle holds, unless it is pinned or retained (`retain_needed_dead`)."""
        if storage.handles > 0 or not storage.resident or storage.pinned:
            return
        if self.retain_needed_dead and _needed_by_held(storage):
            # Stays resident and evictable: the heuristic decides when its memory is worth more. A storage kept
            # resident for its holders has none left; out of the pool, it would outlive the step.
            if storage.kept_resident:
                storage.kept_resident = False
                if storage.counted and storage.producer is not None and storage.nbytes > 0:
                    self.pool.add(storage)
                    self._became_evictable(storage)
            return
        self._evict(storage, eager=True)

    def _producer_of(self, storage: Storage) -> Operation:
        if storage.producer is None:
            raise AssertionError(f"{storage!r} is a constant and cannot have been evicted")
        return storage.producer

    def _check_thrash(self, recomputed: str) -> None:
        if self.thrash_limit is None:
            return
        if self.thrash_reference_cost is not None:
            reference = self.thrash_reference_cost
        elif self.remats < _THRASH_GRACE_REMATS:
            return
        else:
            reference = self.compute_cost
        if self.remat_cost > self.thrash_limit * reference:
            if self.overrun:
                # Overrun mode: a budget this step thrashes at is not one to name. The step finishes evicting
                # nothing more, and its peak is the budget named: at it, the rerun evicts less than this run did.
                if self.budget_bytes is not None:
                    self._raise_budget_to(max(self.budget_bytes, self.memory), "recomputed beyond thrash_limit")
                    self.budget_bytes = None
                return
            budget = self.budget_bytes
            if budget is None and self.overrun_need is not None:  # overrun mode raised it, then lifted it
                budget = self.budget_asked
            if budget is None:  # the caller lifted the budget (restoring what outlives a failed step)
                where, change = "with the budget lifted", "Raise memory_budget"
            else:
                where = f"under a budget of {format_bytes(budget)} ({budget} bytes)"
                change = f"Raise memory_budget above {budget} bytes so that less is recomputed"
            raise ThrashError(
                f"thrashing while running {self._current_op!r} (recomputing {recomputed!r}): recompute cost "
                f"{self.remat_cost:.4g} exceeds {self.thrash_limit:g} x the original compute {reference:.4g} "
                f"{where}. {change}, or raise dtr_compile.config.thrash_limit (None disables the guard)."
            )

    def _check_reachable(self, inputs: Sequence[Storage], nbytes: int) -> None:
        """Raise BudgetError before evicting anything when even evicting every candidate but the inputs could
        not make room: evictions that cannot make an operation fit only cost their recomputes later (a caller
        may then run the operation another way, compiled_ops.py)."""
        if self.budget_bytes is None:
            return
        floor = self.memory - self.pool.nbytes + nbytes
        for storage in dict.fromkeys(inputs):  # the inputs stay (locked), or come back
            if storage.counted and (storage.pool_index >= 0 or not storage.resident):
                floor += storage.nbytes
        if floor > self.budget_bytes:
            if self.overrun and not self._strict:
                self._raise_budget_to(floor)
                return
            self._raise_budget_error(nbytes, floor=floor)

    def _raise_budget_to(self, needed: int, why: str = "did not fit with every evictable tensor evicted") -> None:
        """Overrun mode: the budget rises to what this operation needs (and stays there for the rest of the
        step, so later operations evict as they would under that budget instead of evicting everything)."""
        assert self.budget_bytes is not None
        if self.overrun_need is None:
            self.overrun_at = f"{self._current_op!r} {why}"
            self.budget_asked = self.budget_bytes
        self.overrun_need = max(self.overrun_need or 0, needed)
        self.budget_bytes = max(self.budget_bytes, needed)

    def _raise_budget_error(self, nbytes: int, *, floor: int | None = None) -> None:
        locked = sum(s.nbytes for s in self.pool if s.locks)
        unevictable = self.memory - self.pool.nbytes  # pinned or held outside the pool
        floor = max(floor or 0, locked + unevictable + nbytes)
        raise BudgetError(
            f"memory budget {format_bytes(self.budget_bytes)} cannot be met while running {self._current_op!r}: "
            f"it needs {format_bytes(nbytes)} more, {format_bytes(locked)} are locked by the running operations "
            f"and {format_bytes(unevictable)} cannot be evicted (pinned outputs, small tensors), so at least "
            f"{format_bytes(floor)} ({floor} bytes) are needed here. Raise memory_budget to at least that.",
            budget_bytes=self.budget_bytes,
            smallest_feasible_bytes=floor,
            is_lower_bound=True,
        )
