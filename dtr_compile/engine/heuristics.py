"""Eviction heuristics: pure functions of plain records. The engine evicts the candidate with the lowest score.

Notation of the DTR paper (Kirisame et al., ICLR 2021): c = compute cost of a storage's producer,
m = its bytes, s = staleness (engine clock - last access, the clock being cumulative compute),
e* = the evicted neighbourhood: evicted storages reachable through evicted-only paths towards parents
and children, i.e. what rematerializing the candidate would also have to recompute, and what its
eviction makes costlier to bring back.

Every heuristic has the signature `score(storage, clock, rng) -> float`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator

from .records import EqClass, Storage

Heuristic = Callable[[Storage, float, random.Random], float]

# Staleness of a storage touched at the current clock tick: keeps scores finite without favouring it.
_MIN_STALENESS = 1e-9


class ScheduleClock:
    """The position of a planned schedule, in its own time unit; shared by every `NextUses` of one run."""

    __slots__ = ("now",)

    def __init__(self, now: float = 0.0) -> None:
        self.now = now


class NextUses:
    """Future knowledge for one storage: the (sorted) times at which the schedule reads it.

    A planner or the log replay puts one in `storage.meta`; the future-aware heuristics read it.
    """

    __slots__ = ("clock", "pos", "times")

    def __init__(self, times: list[float], clock: ScheduleClock) -> None:
        self.times = times
        self.pos = 0
        self.clock = clock

    def distance(self) -> float:
        """Time from now to the next read (0 if it is read now, inf if never again)."""
        times, pos, now = self.times, self.pos, self.clock.now
        while pos < len(times) and times[pos] < now:
            pos += 1
        self.pos = pos
        return times[pos] - now if pos < len(times) else math.inf


def staleness(storage: Storage, clock: float) -> float:
    return max(clock - storage.last_access, _MIN_STALENESS)


def evicted_parents(storage: Storage) -> Iterator[Storage]:
    """Evicted inputs of the storage's producer: what its recompute would have to recompute first."""
    if storage.producer is not None:
        for parent in storage.producer.inputs:
            if not parent.resident:
                yield parent


def evicted_children(storage: Storage) -> Iterator[Storage]:
    """Evicted outputs of the storage's consumers: what its eviction makes costlier to bring back."""
    for op in storage.consumers:
        for child in op.outputs:
            if not child.resident:
                yield child


def evicted_neighbours(storage: Storage) -> Iterator[Storage]:
    """Evicted parents (inputs of the producer) and evicted children (outputs of the consumers)."""
    yield from evicted_parents(storage)
    yield from evicted_children(storage)


def _evicted_closure_cost(storage: Storage, step: Callable[[Storage], Iterator[Storage]]) -> float:
    seen: set[int] = {storage.sid}
    frontier = [storage]
    total = 0.0
    while frontier:
        node = frontier.pop()
        for neighbour in step(node):
            if neighbour.sid not in seen:
                seen.add(neighbour.sid)
                total += neighbour.cost
                frontier.append(neighbour)
    return total


def evicted_neighbourhood_cost(storage: Storage) -> float:
    """c(e*): total cost of the evicted storages reachable from `storage` through evicted-only paths."""
    return _evicted_closure_cost(storage, evicted_neighbours)


def evicted_regions_cost(storage: Storage) -> float:
    """c(e*) as the DTR simulator's h_DTR computes it: the evicted ancestors reachable through evicted parents
    only, plus the evicted descendants reachable through evicted children only (a path never turns around,
    so it does not wander through every dead storage of the step)."""
    return _evicted_closure_cost(storage, evicted_parents) + _evicted_closure_cost(storage, evicted_children)


def eq_class_neighbourhood_cost(storage: Storage) -> float:
    """c(e*) approximated by the union-find classes of the evicted neighbours (each class counted once).

    The hottest function of an eviction search (every candidate, every eviction): loops are inlined.
    """
    roots: list[EqClass] = []  # a handful at most: a list beats a dict here
    total = 0.0
    producer = storage.producer
    if producer is not None:
        for parent in producer.inputs:
            if not parent.resident and parent.eq is not None:
                root = parent.eq.root()
                if root not in roots:
                    roots.append(root)
                    total += root.cost
    for op in storage.consumers:
        for child in op.outputs:
            if not child.resident and child.eq is not None:
                root = child.eq.root()
                if root not in roots:
                    roots.append(root)
                    total += root.cost
    return total


def h_dtr(storage: Storage, clock: float, rng: random.Random) -> float:
    """(c(S) + c(e*)) / (m * s) with the exact evicted regions (a graph walk per candidate: slow)."""
    cost = storage.cost + evicted_regions_cost(storage)
    return cost / (storage.nbytes * staleness(storage, clock))


def h_dtr_eq(storage: Storage, clock: float, rng: random.Random) -> float:
    """(c(S) + c(e*)) / (m * s) with e* from union-find equivalence classes."""
    cost = storage.cost + eq_class_neighbourhood_cost(storage)
    return cost / (storage.nbytes * staleness(storage, clock))


def h_dtr_eq_dead(storage: Storage, clock: float, rng: random.Random) -> float:
    """h_dtr_eq, but a storage no handle refers to any more scores 0: it is kept only in case a recompute
    needs it, so it is the first to go when room is needed, before any storage the program still holds.

    Such storages are the intermediates a recompute brought back on its way to a live tensor (the engine
    leaves them resident) and by-products of multi-output ops. Keeping them until memory is short lets
    the next recompute along the same chain reuse them; h_dtr_eq instead weighs them like live tensors
    and evicts live tensors to keep dead ones.
    """
    if storage.handles <= 0:
        return 0.0
    return h_dtr_eq(storage, clock, rng)


def _has_evicted_held_child(storage: Storage) -> bool:
    """Whether an output of an op reading `storage` is evicted while the caller still holds it."""
    for op in storage.consumers:
        for child in op.outputs:
            if not child.resident and child.handles > 0:
                return True
    return False


def retains_needed_dead(heuristic: Heuristic) -> Heuristic:
    """Mark a heuristic whose engine keeps dead storages resident while an evicted held storage may need
    them (Engine's `retain_needed_dead`), instead of freeing every storage the moment its last handle dies."""
    heuristic.retains_needed_dead = True  # type: ignore[attr-defined]
    return heuristic


@retains_needed_dead
def h_dtr_eq_retain(storage: Storage, clock: float, rng: random.Random) -> float:
    """h_dtr_eq_dead, with dead storages kept while an evicted held storage may need them.

    Eager eviction frees a storage the moment its last handle dies. When an evicted storage S that the
    program still holds depends on it, that turns S's recompute from one op into a chain that can reach back
    through the whole step (on ResNet-32 at 0.2 x peak one such free cost 89% of the step's compute in
    recompute). With `retains_needed_dead`, the engine keeps such a dead storage resident and evictable; it
    scores 0 like every dead storage (first to go when room is needed), unless it is a direct input of an
    evicted held storage's producer: then it is scored as h_dtr_eq scores a live storage.
    """
    if storage.handles <= 0 and not _has_evicted_held_child(storage):
        return 0.0
    return h_dtr_eq(storage, clock, rng)


@retains_needed_dead
def h_future(storage: Storage, clock: float, rng: random.Random) -> float:
    """(c(S) + c(e*)) / (m * d): h_dtr_eq_retain with staleness replaced by d, the time until the next read.

    Reads `NextUses` in `storage.meta` (the log replay and the planner provide it): what a compile-time
    planner knows, a target for online policies. d is the time until the program next reads the storage or
    an evicted storage it holds whose recompute reads this one (an evicted child), so that a parent is not
    evicted just before a recompute needs it. Storages that nothing reads again score 0 (Belady: evict what
    is needed furthest in the future). Without NextUses it is h_dtr_eq_retain.
    """
    uses = storage.meta
    if not isinstance(uses, NextUses):  # no future knowledge (online): the best online guess
        return h_dtr_eq_retain(storage, clock, rng)
    distance = uses.distance() if storage.handles > 0 else math.inf
    for op in storage.consumers:
        for child in op.outputs:
            if not child.resident and child.handles > 0 and isinstance(child.meta, NextUses):
                distance = min(distance, child.meta.distance())
    if distance == math.inf:
        return 0.0
    cost = storage.cost + eq_class_neighbourhood_cost(storage)
    return cost / (storage.nbytes * max(distance, _MIN_STALENESS))


def h_dtr_local(storage: Storage, clock: float, rng: random.Random) -> float:
    """c / (m * s): ignores what has already been evicted around the candidate."""
    return storage.cost / (storage.nbytes * staleness(storage, clock))


def h_msps(storage: Storage, clock: float, rng: random.Random) -> float:
    """(c + c(evicted ancestors)) / m: Peng et al.'s memory-saving-per-second, no staleness."""
    seen: set[int] = {storage.sid}
    frontier = [storage]
    total = storage.cost
    while frontier:
        node = frontier.pop()
        if node.producer is None:
            continue
        for parent in node.producer.inputs:
            if not parent.resident and parent.sid not in seen:
                seen.add(parent.sid)
                total += parent.cost
                frontier.append(parent)
    return total / storage.nbytes


def h_lru(storage: Storage, clock: float, rng: random.Random) -> float:
    """Least recently used first."""
    return storage.last_access


def h_size(storage: Storage, clock: float, rng: random.Random) -> float:
    """Largest storage first."""
    return 1.0 / storage.nbytes


def h_random(storage: Storage, clock: float, rng: random.Random) -> float:
    """Uniformly random (the control every heuristic must beat)."""
    return rng.random()


HEURISTICS: dict[str, Heuristic] = {
    "dtr": h_dtr,
    "dtr_eq": h_dtr_eq,
    "dtr_eq_dead": h_dtr_eq_dead,
    "dtr_eq_retain": h_dtr_eq_retain,
    "future": h_future,
    "dtr_local": h_dtr_local,
    "msps": h_msps,
    "lru": h_lru,
    "size": h_size,
    "random": h_random,
}
"""Name -> heuristic. `dtr_compile.config.heuristic` and `--heuristic` accept these names."""


def get_heuristic(name: str) -> Heuristic:
    from ..errors import ConfigError

    try:
        return HEURISTICS[name]
    except KeyError:
        raise ConfigError(f"unknown eviction heuristic {name!r}; expected one of {sorted(HEURISTICS)}") from None
