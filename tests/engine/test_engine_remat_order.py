"""The order of recomputes, what stays locked meanwhile, access times, ties, retention and eq-class liveness."""

from __future__ import annotations

import pytest
from engine_harness import UNIT, Harness

from dtr_compile.engine import Engine, heuristics
from dtr_compile.errors import ThrashError


def test_the_deep_missing_input_is_recomputed_before_the_shallow_one() -> None:
    # j = join(s, d): s = fs(x) is one rerun away, d = f3(f2(f1(x))) three. The deep branch goes first, so
    # that s (back in one step) is not held locked through it.
    h = Harness(None)
    x = h.constant()
    (s,) = h.op("fs", [x])
    (d1,) = h.op("f1", [x])
    (d2,) = h.op("f2", [d1])
    (d3,) = h.op("f3", [d2])
    for storage in (s, d1, d2, d3):
        h.engine.evict(storage)
    h.op("join", [s, d3])
    assert h.executor.recomputed == ["f1", "f2", "f3", "fs"]


def test_resident_inputs_are_not_held_while_a_missing_one_is_recomputed() -> None:
    # m = g(r, c3): r is resident, c3 needs a chain of three reruns. Budget: x (uncounted) + r + c1..c3 +
    # m = 5 units plus one for m. With r held through the chain, the chain could not get room; unlocked, r is
    # evicted during the chain (LRU: the stalest) and recomputed last, when the frame's inputs are all there.
    h = Harness(4 * UNIT, heuristic="lru")
    x = h.constant(counted=False)
    (r,) = h.op("fr", [x])
    (c1,) = h.op("f1", [x])
    (c2,) = h.op("f2", [c1])
    (c3,) = h.op("f3", [c2])
    h.drop(c1, c2)
    h.engine.evict(c3)
    h.op("g", [r, c3])
    # f1 needs room for c1 (r, c3 out: 2 units used, fits), f2 for c2 (3, fits), f3 for c3: 4 units resident
    # (r, c1, c2 + c3) fits only once c1, dead, is freed after f2; then g's output needs one more unit.
    assert h.executor.recomputed == ["f1", "f2", "f3"]
    assert r.resident and c3.resident


def test_inputs_are_accessed_when_the_op_is_requested_not_after_its_recomputes() -> None:
    engine = Engine(None)
    x = engine.constant(UNIT, counted=True)
    engine.reserve([x], UNIT)
    a = engine.record("fa", [x], [UNIT], 10.0).outputs[0]
    engine.reserve([x], UNIT)
    engine.record("fb", [x], [UNIT], 5.0)  # clock 15
    engine.evict(a)
    engine.reserve([a], 0)  # recomputes fa (clock 15 -> 25)
    engine.abandon([a])
    assert engine.clock == 25.0
    assert a.last_access == 15.0  # as in the DTR simulator: the recompute does not make `a` look fresh


def test_equal_scores_go_to_the_storage_that_became_evictable_last() -> None:
    # Three equal tensors from equal ops read at the same time have equal h_DTR scores; the simulator's
    # candidate list is in the order storages became evictable, and it keeps the last of the equal ones.
    h = Harness(4 * UNIT, heuristic="dtr_eq")
    x = h.constant(counted=False)
    h.op("f", [x], [UNIT, UNIT, UNIT], 3.0)
    h.op("later", [], [UNIT], 1.0)
    assert h.executor.evicted == []
    h.op("more", [], [UNIT], 1.0)  # later is fresher; a, b, c tie: c became evictable last
    assert h.executor.evicted == ["f.2"]


def test_eq_classes_count_their_held_members() -> None:
    h = Harness(None, heuristic="dtr_eq_retain")
    x = h.constant()
    (a,) = h.op("fa", [x])
    (b,) = h.op("fb", [a])
    h.engine.evict(b)
    assert b.eq is not None and b.eq.root().live == 1  # held and evicted
    h.drop(a)  # dead, but b needs it: retained under the default heuristic ...
    h.engine.evict(a)  # ... evicted by hand: joins b's class, which stays live through b
    assert a.eq is not None and a.eq.root() is b.eq.root() and b.eq.root().live == 1
    h.drop(b)  # b dies while evicted: the class has no held member any more
    assert a.eq.root().live == 0


def test_retention_can_be_turned_off_and_defaults_to_the_heuristic() -> None:
    assert Engine(None, heuristic="dtr_eq_retain").retain_needed_dead
    assert not Engine(None, heuristic="dtr_eq").retain_needed_dead
    assert not Engine(None, heuristic="dtr_eq_retain", retain_needed_dead=False).retain_needed_dead
    assert getattr(heuristics.h_future, "retains_needed_dead", False)


@pytest.mark.parametrize(("retain", "recomputed"), [(True, ["fb"]), (False, ["fa", "fb"])])
def test_a_retained_dead_parent_spares_its_own_recompute(retain: bool, recomputed: list[str]) -> None:
    h = Harness(None, heuristic="dtr_eq_retain", retain_needed_dead=retain)
    x = h.constant()
    (a,) = h.op("fa", [x])
    (b,) = h.op("fb", [a])
    h.engine.evict(b)
    h.drop(a)
    assert a.resident is retain
    h.op("use_b", [b])
    assert h.executor.recomputed == recomputed


def test_charge_recompute_advances_the_clock_and_can_thrash() -> None:
    engine = Engine(None, thrash_reference_cost=10.0)
    engine.charge_recompute(4.0, "view")
    assert (engine.clock, engine.remat_cost, engine.remats) == (4.0, 4.0, 1)
    with pytest.raises(ThrashError, match="view"):
        engine.charge_recompute(7.0, "view")


def test_a_kept_resident_storage_retained_after_death_becomes_evictable_and_is_freed_at_step_end() -> None:
    """A storage kept resident for its holders (the torch runtime's gradients) that dies while an evicted held
    storage still needs it is retained like any other dead parent: a candidate again, and freed by
    `free_dead` when the step ends (it had been left out of the pool, and its bytes counted forever)."""
    h = Harness(None, heuristic="dtr_eq_retain")
    x = h.constant()
    (a,) = h.op("fa", [x])
    h.engine.keep_resident(a)
    assert a not in h.engine.pool
    (b,) = h.op("fb", [a])
    h.engine.evict(b)
    h.drop(a)  # dead, but b (held, evicted) needs it: retained
    assert a.resident and a in h.engine.pool and not a.kept_resident
    memory = h.engine.memory
    h.drop(b)
    h.engine.free_dead()
    assert not a.resident and h.engine.memory == memory - a.nbytes
