"""Which storage the engine evicts, how h_DTR_eq's union-find approximates h_DTR, and the engine's errors."""

from __future__ import annotations

import random

import pytest
from engine_harness import UNIT, Harness

from dtr_compile.engine import EqClass, core, heuristics
from dtr_compile.errors import BudgetError, DTRError, ThrashError


def fan_out(h: Harness, sizes: list[int], costs: list[float] | None = None) -> list:
    """Independent ops t0, t1, ... each reading the same input constant."""
    x = h.constant(counted=False)
    costs = costs or [1.0] * len(sizes)
    return [h.op(f"t{i}", [x], [size], cost)[0] for i, (size, cost) in enumerate(zip(sizes, costs))]


# ------------------------------------------------------------------------------ exact victims


def test_lru_evicts_the_least_recently_used_not_the_oldest() -> None:
    h = Harness(3 * UNIT, heuristic="lru")
    a, _b, c = fan_out(h, [UNIT] * 3)  # last accesses 1, 2, 3
    h.op("read_a", [a])  # a is touched at clock 3: b is now the least recently used
    assert h.executor.evicted == ["t1"]
    h.op("read_c", [c])  # a (touched at 3) is older than read_a's output (written at 4)
    assert h.executor.evicted == ["t1", "t0"]


def test_size_evicts_the_largest_candidate_first() -> None:
    h = Harness(7 * UNIT, heuristic="size")
    fan_out(h, [UNIT, 4 * UNIT, 2 * UNIT])  # t0, t1, t2: 7 units, full
    h.op("three", [], [3 * UNIT])  # needs 3 units: the largest (t1, 4 units) goes
    assert h.executor.evicted == ["t1"]
    h.op("more", [], [UNIT * 5 // 2])  # 6 + 2.5 > 7: now "three" (3 units) is the largest
    assert h.executor.evicted == ["t1", "three"]


def test_eviction_repeats_until_the_allocation_fits() -> None:
    h = Harness(6 * UNIT, heuristic="size")
    fan_out(h, [UNIT, 2 * UNIT, 3 * UNIT])
    h.op("five", [], [5 * UNIT])  # needs 5 of 6 units: the two largest go, largest first
    assert h.executor.evicted == ["t2", "t1"]


def test_small_storages_are_skipped_while_larger_candidates_exist() -> None:
    sizes = [100, 2000]  # t0 is older, so LRU picks it, and evicting it alone makes room for 150 B
    plain = Harness(2200, heuristic="lru", min_evictable_fraction=0.0)
    fan_out(plain, sizes)
    plain.op("next", [], [150])
    assert plain.executor.evicted == ["t0"]
    skipping = Harness(2200, heuristic="lru", min_evictable_fraction=0.5)  # threshold: half the mean (1050 B)
    fan_out(skipping, sizes)
    skipping.op("next", [], [150])
    assert skipping.executor.evicted == ["t1"]


def test_small_storages_are_evicted_when_nothing_else_is_left() -> None:
    h = Harness(UNIT, heuristic="lru", min_evictable_bytes=UNIT)  # every tensor is "small"
    fan_out(h, [UNIT // 2, UNIT // 2])
    h.op("next", [], [UNIT // 2])
    assert h.executor.evicted == ["t0"]


def test_dtr_prefers_cheap_stale_storages() -> None:
    h = Harness(3 * UNIT, heuristic="dtr")
    fan_out(h, [UNIT] * 3, costs=[1.0, 50.0, 1.0])  # t0 stalest and cheap, t1 expensive
    h.op("next", [], [UNIT])
    h.op("again", [], [UNIT])
    assert h.executor.evicted == ["t0", "t2"], "the expensive t1 survives although it is staler than t2"


# ------------------------------------------------------------------------------ h_DTR vs h_DTR_eq


def split_graph(h: Harness) -> dict:
    """x -> m (cost 4); m -> s3 (cost 1); (m, u) -> s1 (cost 2), u from x (cost 8).

    m's children s1 and s3 are adjacent only through m: once m comes back, e* around u is {s1} alone, but
    the union-find class of s1 still holds s3 (classes never split).
    """
    x = h.constant(counted=False)
    (u,) = h.op("u", [x], cost=8.0)
    (m,) = h.op("m", [x], cost=4.0)
    (s1,) = h.op("s1", [m, u], cost=2.0)
    (s3,) = h.op("s3", [m], cost=1.0)
    return {"x": x, "u": u, "m": m, "s1": s1, "s3": s3}


def test_union_find_classes_merge_on_eviction_and_subtract_on_remat() -> None:
    h = Harness(None)
    g = split_graph(h)
    h.engine.evict(g["s1"])
    h.engine.evict(g["s3"])
    assert g["s1"].eq.root() is not g["s3"].eq.root(), "s1 and s3 are not adjacent while m is resident"
    h.engine.evict(g["m"])
    root = g["m"].eq.root()
    assert g["s1"].eq.root() is root and g["s3"].eq.root() is root
    assert root.cost == 2.0 + 1.0 + 4.0
    assert heuristics.evicted_neighbourhood_cost(g["u"]) == 7.0
    assert heuristics.eq_class_neighbourhood_cost(g["u"]) == 7.0, "exact and approximate agree before remat"

    h.use(g["m"])  # brings m back alone (its input x is resident)
    assert g["m"].eq is None
    assert g["s1"].eq.root() is g["s3"].eq.root(), "classes are never split"
    assert g["s1"].eq.root().cost == 3.0, "m's cost was subtracted from the class"
    assert heuristics.evicted_neighbourhood_cost(g["u"]) == 2.0, "exact e* of u is {s1}"
    assert heuristics.eq_class_neighbourhood_cost(g["u"]) == 3.0, "the class still counts s3"

    clock, rng = h.engine.clock, random.Random(0)
    dtr = heuristics.h_dtr(g["u"], clock, rng)
    dtr_eq = heuristics.h_dtr_eq(g["u"], clock, rng)
    assert dtr_eq / dtr == pytest.approx((8.0 + 3.0) / (8.0 + 2.0))


def test_exact_neighbourhood_follows_evicted_paths_both_ways() -> None:
    h = Harness(None)
    x = h.constant()
    a = h.op("a", [x], cost=1.0)[0]
    b = h.op("b", [a], cost=2.0)[0]
    c = h.op("c", [b], cost=4.0)[0]
    d = h.op("d", [c], cost=8.0)[0]
    e = h.op("e", [d], cost=16.0)[0]
    h.engine.evict(b)
    h.engine.evict(d)
    # c's e*: parent b (then a is resident: stop) and child d (then e is resident: stop).
    assert heuristics.evicted_neighbourhood_cost(c) == 2.0 + 8.0
    assert heuristics.eq_class_neighbourhood_cost(c) == 2.0 + 8.0
    assert heuristics.evicted_neighbourhood_cost(a) == 2.0 and heuristics.evicted_neighbourhood_cost(e) == 8.0
    h.engine.evict(c)  # b, c, d are now one class
    assert b.eq.root() is d.eq.root() and b.eq.root().cost == 14.0
    assert heuristics.evicted_neighbourhood_cost(a) == 14.0 == heuristics.eq_class_neighbourhood_cost(a)


def test_outputs_dying_next_to_one_class_join_it_once() -> None:
    # A backward's gradients: one op reads many activations, which are evicted (consumed) when it runs, and its
    # outputs die one by one next to all of them. Each death joins the class they form; nothing is counted twice.
    h = Harness(None)
    x = h.constant()
    acts = [h.op(f"f{k}", [x], cost=float(k + 1))[0] for k in range(4)]
    grads = h.op("backward", acts, sizes=[UNIT] * 3, cost=100.0)
    for act in acts:
        h.engine.evict(act)
    assert len({act.eq.root() for act in acts}) == 4, "siblings of one constant are not adjacent"
    h.drop(*acts)
    for k, grad in enumerate(grads):
        if k < 2:
            h.drop(grad)
        else:
            h.engine.evict(grad)  # still held: a live member
        root = grad.eq.root()
        assert all(s.eq.root() is root for s in [*acts, *grads[:k]])
        assert root.cost == 1 + 2 + 3 + 4 + 100.0 * (k + 1) and root.live == (1 if k == 2 else 0)


def test_an_operation_with_nothing_to_record_unlocks_and_advances_the_clock_only() -> None:
    h = Harness(None)
    x = h.constant()
    (a,) = h.op("a", [x], cost=2.0)
    clock, cost = h.engine.clock, h.engine.compute_cost
    h.engine.reserve([x, a], 0, "write_outside")
    h.engine.record_nothing([x, a], 3.0)
    assert x.locks == a.locks == 0 and a.consumers == []
    assert h.engine.clock == clock + 3.0 and h.engine.compute_cost == cost + 3.0
    h.drop(a)
    assert not a.resident, "a handle-less storage is freed once its last lock is gone"


def test_eq_class_union_find() -> None:
    a, b, c = EqClass(1.0), EqClass(2.0), EqClass(4.0)
    root = a.union(b)
    assert root is a and b.root() is a and root.cost == 3.0
    assert c.union(b).cost == 7.0 and a.root() is c.root() is b.root()
    assert a.union(c).cost == 7.0, "uniting a class with itself adds nothing"


# ------------------------------------------------------------------------------ errors


def budget_error_sequence(budget: int, name: str = "needs_room") -> Harness:
    h = Harness(budget)
    x = h.constant(60)  # pinned, counted
    (a,) = h.op("a", [x], [30])
    h.op(name, [a], [20])  # a is locked by its own op: nothing can be evicted
    return h


def test_budget_error_names_the_op_the_locked_bytes_and_the_budget() -> None:
    with pytest.raises(BudgetError) as info:
        budget_error_sequence(100)
    error = info.value
    assert isinstance(error, DTRError)
    message = str(error)
    assert "'needs_room'" in message
    assert "30 B are locked" in message and "60 B cannot be evicted" in message
    assert "memory budget 100 B" in message and "memory_budget" in message
    assert error.budget_bytes == 100
    assert error.smallest_feasible_bytes == 60 + 30 + 20 and error.is_lower_bound


def test_budget_error_bound_is_feasible_here() -> None:
    budget_error_sequence(110)  # the bound the error named is enough for this sequence


def test_budget_error_during_a_recompute() -> None:
    h = Harness(3 * UNIT)
    x = h.constant(counted=True)
    (a,) = h.op("a", [x])
    (b,) = h.op("b", [x])
    h.engine.evict(a)
    h.op("big", [], [UNIT], pinned_outputs=True)  # x, b, big: the budget is full
    with pytest.raises(BudgetError, match="'use_a_and_b'") as info:
        h.op("use_a_and_b", [b, a])  # b is locked by the op, x and big are pinned: a cannot come back
    # Known before anything is recomputed or evicted: x and big pinned, the inputs a and b, and the output.
    assert info.value.smallest_feasible_bytes == 5 * UNIT
    assert h.executor.recomputed == [] and a.resident is False and b.resident


def test_a_failed_reserve_releases_every_lock_it_took() -> None:
    """A reserve that raises (here in the middle of a nested recompute) leaves no lock behind, so the engine
    stays usable and callers need no cleanup (the torch runtime calls `reserve` outside its try block)."""
    h = Harness(4 * UNIT)
    x = h.constant()
    (a,) = h.op("a", [x])
    (b,) = h.op("b", [a])
    (c,) = h.op("c", [b])
    h.drop(a, b)
    h.engine.evict(c)
    h.op("big", [], [2 * UNIT], pinned_outputs=True)  # x and big: 3 of 4 units, unevictable
    with pytest.raises(BudgetError, match="'use_c'"):
        h.op("use_c", [c])  # a comes back (4 of 4), then b has no room: a is locked by b's frame
    assert [s for s in h.storages if s.locks] == []
    h.audit()
    h.op("next", [x])  # the engine still works


def test_recompute_beyond_the_reference_cost_is_thrashing() -> None:
    h = Harness(None, thrash_limit=1.0, thrash_reference_cost=10.0)
    x = h.constant()
    (big,) = h.op("expensive", [x], cost=6.0)
    h.engine.evict(big)
    h.use(big)  # 6 <= 10
    h.engine.evict(big)
    with pytest.raises(ThrashError) as info:
        h.use(big)  # 12 > 1.0 x 10
    message = str(info.value)
    assert "'expensive'" in message and "thrash_limit" in message and "memory_budget" in message
    assert isinstance(info.value, DTRError)


def test_thrash_error_leaves_no_lock_and_no_dead_storage_behind() -> None:
    h = Harness(None, thrash_limit=1.0, thrash_reference_cost=3.5)
    x = h.constant()
    (a,) = h.op("a", [x], cost=1.0)
    left, right = h.op("split", [a], [UNIT, UNIT], cost=3.0)
    h.drop(a, right)  # right is dead: a recompute of split brings it back only as a by-product
    h.engine.evict(left)
    with pytest.raises(ThrashError, match="'split'"):
        h.use(left)  # a (1) then split (3): 4 > 3.5
    assert [s for s in h.storages if s.locks] == []
    assert not right.resident and not a.resident, "storages without handles are freed even on the error path"
    h.audit()


def test_online_thrash_rule_compares_with_compute_so_far_after_a_grace() -> None:
    grace = core._THRASH_GRACE_REMATS
    h = Harness(None, thrash_limit=1.0)
    x = h.constant()
    (big,) = h.op("expensive", [x], cost=5.0)
    for _ in range(grace - 1):  # recompute is already far above the compute so far, but within the grace
        h.engine.evict(big)
        h.use(big)
    assert h.engine.remat_cost > h.engine.compute_cost
    h.engine.evict(big)
    with pytest.raises(ThrashError):
        h.use(big)
    assert h.engine.remats == grace


def test_online_thrash_rule_allows_recompute_below_the_limit() -> None:
    grace = core._THRASH_GRACE_REMATS
    h = Harness(None, thrash_limit=0.5)
    x = h.constant()
    (cheap,) = h.op("cheap", [x], cost=1.0)
    h.op("work", [x], cost=2.5 * grace)
    for _ in range(grace + 10):  # 1 per remat, against 0.5 x (2.5 grace + 1)
        h.engine.evict(cheap)
        h.use(cheap)
    assert h.engine.remats == grace + 10


def test_thrash_guard_can_be_disabled() -> None:
    h = Harness(None, thrash_limit=None, thrash_reference_cost=1.0)
    x = h.constant()
    (big,) = h.op("expensive", [x], cost=5.0)
    for _ in range(3 * core._THRASH_GRACE_REMATS):
        h.engine.evict(big)
        h.use(big)
    assert h.engine.remat_cost == 15.0 * core._THRASH_GRACE_REMATS
