"""Invariants of the engine on hand-built operation sequences (no torch).

Every step goes through `Harness`, which checks after each reserve/record/drop that the accounted memory
equals the resident bytes and stays within the budget, and whose executor checks that recomputes see
resident, locked inputs and reproduce the original values, and that nothing pinned or locked is evicted.
"""

from __future__ import annotations

import random

import pytest
from engine_harness import UNIT, Harness

from dtr_compile.engine import HEURISTICS, Storage


def chain(h: Harness, n: int, start=None) -> list:
    """x -> f1 -> f2 -> ... -> fn, every output kept (one handle each)."""
    current = start if start is not None else h.constant()
    outputs = [current]
    for k in range(1, n + 1):
        (current,) = h.op(f"f{k}", [current])
        outputs.append(current)
    return outputs


# ------------------------------------------------------------------------------ budget and room-making


def training_step(h: Harness, rng: random.Random, layers: int = 40) -> Storage:
    """A random training-like program: a forward with skip connections and by-products, then a backward.

    Forward layer k reads the previous activation (and, sometimes, one of the three before it) and writes
    an activation of random size, sometimes with a small second output (like saved statistics). Every
    output is kept for the backward. Backward b_k reads the incoming gradient, the outputs of layer k-1
    and the by-products of layer k; then their handles die, as autograd frees saved tensors.
    Returns the input gradient (the only handle left).
    """
    x = h.constant(UNIT, counted=False)
    saved = [[x]]
    for k in range(1, layers + 1):
        inputs = [saved[-1][0]]
        if k > 3 and rng.random() < 0.3:
            inputs.append(rng.choice(saved[-4:-1])[0])
        sizes = [rng.choice([UNIT // 2, UNIT, 2 * UNIT])] + ([UNIT // 4] if rng.random() < 0.3 else [])
        saved.append(h.op(f"f{k}", inputs, sizes, cost=rng.uniform(0.5, 3.0)))
    (grad,) = h.op("loss", [saved[-1][0]])
    for k in range(layers, 0, -1):
        reads = [grad, *saved[k - 1], *saved[k][1:]] if k > 1 else [grad, *saved[k][1:]]
        (new_grad,) = h.op(f"b{k}", reads, cost=rng.uniform(0.5, 3.0))
        h.drop(grad, *saved[k])
        grad = new_grad
    return grad


@pytest.mark.parametrize("heuristic", sorted(HEURISTICS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_training_steps_stay_within_budget_and_recompute_exact_values(heuristic: str, seed: int) -> None:
    """Under 30% of the unbudgeted peak: the harness audits memory == resident bytes <= budget after every
    reserve, record and handle death, that nothing without handles or locks stays resident and that no lock
    leaks; the executor checks every recompute. The result equals the one computed without a budget."""
    reference = Harness(None)
    expected = reference.use(training_step(reference, random.Random(seed)))
    budget = int(0.3 * reference.engine.peak)
    h = Harness(budget, heuristic=heuristic, seed=seed)
    result = training_step(h, random.Random(seed))
    assert h.use(result) == expected
    assert h.engine.peak <= budget < reference.engine.peak
    assert h.engine.evictions > 0 and h.engine.remats > 0, "the budget was meant to force recomputation"
    h.engine.free_dead()  # what the runtime does at the end of a step (frees what retain_needed_dead kept)
    assert h.engine.memory == result.nbytes, "only the input gradient is left (the input is not counted)"


def test_room_is_made_before_the_allocation() -> None:
    h = Harness(3 * UNIT, heuristic="lru")
    _x, a, _b, c = chain(h, 3)
    assert h.engine.memory == 3 * UNIT and not a.resident  # x is counted and pinned: a made room for c
    h.engine.reserve([c], UNIT, "next")
    assert h.engine.memory + UNIT <= 3 * UNIT  # room exists before the caller allocates
    h.engine.abandon([c])


def test_locked_inputs_are_not_evicted_to_make_room_for_their_own_op() -> None:
    h = Harness(4 * UNIT, heuristic="size")
    x = h.constant(counted=False)
    (big,) = h.op("big", [x], [2 * UNIT])
    (_small,) = h.op("small", [x], [UNIT])
    # `big` would be h_size's choice, but it is an input of the running op: `small` must go instead.
    (out,) = h.op("use_big", [big], [2 * UNIT])
    assert h.executor.evicted == ["small"]
    assert big.resident and out.resident


def test_pinned_storages_survive_pressure() -> None:
    h = Harness(4 * UNIT, heuristic="lru")
    x = h.constant(counted=False)
    (kept,) = h.op("kept", [x], pinned_outputs=True)
    (later,) = h.op("later", [x])
    h.engine.pin(later)
    assert later.pool_index < 0, "a pinned storage is no eviction candidate"
    chain(h, 6, start=x)
    assert kept.resident and later.resident
    assert "kept" not in h.executor.evicted and "later" not in h.executor.evicted
    h.drop(kept)  # a pinned storage outlives its handles
    assert kept.resident


def test_pin_of_an_evicted_storage_brings_it_back() -> None:
    h = Harness(None)
    _x, _a, b = chain(h, 2)
    h.engine.evict(b)
    h.engine.pin(b)
    assert b.resident and b.pinned
    assert h.executor.recomputed == ["f2"]
    with pytest.raises(ValueError, match="cannot evict"):
        h.engine.evict(b)


def test_evict_refuses_locked_evicted_and_constant_storages() -> None:
    h = Harness(None)
    x, a = chain(h, 1)
    with pytest.raises(ValueError):
        h.engine.evict(x)  # constant
    h.engine.reserve([a], 0, "lock")
    with pytest.raises(ValueError):
        h.engine.evict(a)  # locked
    h.engine.abandon([a])
    h.engine.evict(a)
    with pytest.raises(ValueError):
        h.engine.evict(a)  # already evicted


# ------------------------------------------------------------------------------ rematerialization


def test_evicted_input_is_recomputed_by_its_producer() -> None:
    h = Harness(None)
    _x, _a, b, _c = chain(h, 3)
    h.engine.evict(b)
    assert not b.resident and h.engine.memory == 3 * UNIT  # x, a, c
    h.op("use_b", [b])
    assert h.executor.recomputed == ["f2"]
    assert h.engine.remats == 1 and h.engine.remat_cost == 1.0


def test_chains_of_evicted_inputs_are_recomputed_parents_first() -> None:
    h = Harness(None)
    _x, a, b, c, _d = chain(h, 4)
    for storage in (a, b, c):
        h.engine.evict(storage)
    h.op("use_c", [c])
    assert h.executor.recomputed == ["f1", "f2", "f3"]
    assert a.resident and b.resident and c.resident  # their handles live: they stay


def test_dead_intermediates_are_recomputed_then_freed_again() -> None:
    h = Harness(None)
    _x, a, b, c = chain(h, 3)
    h.drop(a, b)  # eager eviction: their records stay because c's producer needs them
    assert not a.resident and not b.resident
    assert h.engine.eager_evictions == 2 and h.engine.evictions == 0
    h.engine.evict(c)
    assert h.use(c) is not None
    assert h.executor.recomputed == ["f1", "f2", "f3"]
    assert not a.resident and not b.resident, "by-products without handles are freed after the recompute"
    assert h.engine.memory == 2 * UNIT  # x and c


def test_an_input_read_twice_is_recomputed_once_and_fully_unlocked() -> None:
    h = Harness(None)
    _x, a = chain(h, 1)
    h.engine.evict(a)
    h.op("square", [a, a])
    assert h.executor.recomputed == ["f1"] and a.locks == 0  # the harness also audits for leaked locks


def test_multi_output_ops_recompute_every_output_at_once() -> None:
    h = Harness(None)
    x = h.constant()
    left, right = h.op("split", [x], [UNIT, 2 * UNIT])
    h.engine.evict(left)
    h.engine.evict(right)
    h.op("use_left", [left])
    assert h.executor.recomputed == ["split"]
    assert left.resident and right.resident, "both outputs come back from one rerun"
    h.op("use_right", [right])
    assert h.executor.recomputed == ["split"], "the other output was already back: no second rerun"


def test_multi_output_recompute_frees_dead_sibling_again() -> None:
    h = Harness(None)
    x = h.constant()
    left, right = h.op("split", [x], [UNIT, 2 * UNIT])
    h.drop(right)
    h.engine.evict(left)
    h.use(left)
    assert h.executor.recomputed == ["split"]
    assert not right.resident and h.engine.memory == 2 * UNIT  # x and left


def test_multi_output_recompute_makes_room_for_all_outputs() -> None:
    h = Harness(5 * UNIT, heuristic="lru")
    x = h.constant()
    left, right = h.op("split", [x], [UNIT, UNIT])
    h.engine.evict(left)
    h.engine.evict(right)
    filler = chain(h, 3, start=x)[1:]  # memory: x + 3 fillers = 4 units
    h.use(left)  # needs 2 units of room for both outputs: one filler must go first
    assert left.resident and right.resident
    assert sum(not s.resident for s in filler) == 1


def test_view_outputs_share_their_base_storage() -> None:
    """A view is an op with no fresh storage: the caller adds a handle on the base for the view tensor."""
    h = Harness(None)
    _x, base = chain(h, 1)
    memory = h.engine.memory
    outputs = h.op("view", [base], [])
    assert outputs == [] and h.engine.memory == memory, "a view allocates nothing"
    h.engine.add_handle(base)  # the view tensor
    h.drop(base)  # the base tensor dies; the view keeps the storage
    assert base.resident
    h.drop(base)  # the view dies too
    assert not base.resident and h.engine.eager_evictions == 1


def test_views_are_evicted_and_recomputed_with_their_base() -> None:
    h = Harness(None)
    _x, base = chain(h, 1)
    h.op("view", [base], [])
    h.engine.add_handle(base)
    h.engine.evict(base)  # evicting the storage evicts base and view together
    assert h.use(base) is not None
    assert h.executor.recomputed == ["f1"]


def test_in_place_op_consumes_the_old_version_without_freeing() -> None:
    h = Harness(3 * UNIT, heuristic="lru")
    _x, old = chain(h, 1)
    evictions = (h.engine.evictions, h.engine.eager_evictions)
    (new,) = h.op("add_", [old], [old.nbytes], consumes=[old], reserve_bytes=0)
    assert not old.resident and new.resident
    assert h.engine.memory == 2 * UNIT, "the new version holds the old one's bytes: nothing allocated or freed"
    assert (h.engine.evictions, h.engine.eager_evictions) == evictions
    assert "f1" not in h.executor.evicted, "the executor must not free memory the new version now owns"
    h.drop(old)  # the caller moves its handles to the new version
    h.engine.evict(new)
    h.use(new)
    assert h.executor.recomputed == ["f1", "add_"], "recomputing the new version needs the old one first"
    assert not old.resident, "the old version is only a by-product of that recompute"


def test_constants_cannot_be_consumed_in_place() -> None:
    h = Harness(None)
    x = h.constant()
    with pytest.raises(ValueError, match="constant"):
        h.op("add_", [x], [x.nbytes], consumes=[x], reserve_bytes=0)


# ------------------------------------------------------------------------------ handles


def test_storage_is_freed_eagerly_when_its_last_handle_dies() -> None:
    h = Harness(None)
    _x, a = chain(h, 1)
    h.engine.add_handle(a)
    h.drop(a)
    assert a.resident, "one handle is still alive"
    h.drop(a)
    assert not a.resident and h.engine.eager_evictions == 1 and h.engine.memory == UNIT
    assert h.executor.evicted == ["f1"], "the executor frees the memory"


def test_handle_dying_during_an_op_frees_the_input_after_the_op() -> None:
    h = Harness(None)
    _x, a = chain(h, 1)
    h.engine.reserve([a], UNIT, "g")
    h.engine.drop_handle(a)
    assert a.resident, "a locked input stays until its op is recorded"
    h.engine.record("g", [a], [UNIT], 1.0)
    assert not a.resident and h.engine.eager_evictions == 1


def test_engine_holds_storages_with_handles_only() -> None:
    """Operations hold outputs weakly: a storage whose handles died and that no op needs is collected."""
    import gc
    import weakref

    h = Harness(None)
    x = h.constant()
    h.engine.reserve([x], UNIT, "f")
    out = h.engine.record("f", [x], [UNIT], 1.0).outputs[0]
    ref = weakref.ref(out)
    del out
    gc.collect()
    assert ref() is not None, "the engine keeps a storage with a live handle"
    h.engine.drop_handle(ref())
    gc.collect()
    assert ref() is None, "without handles and consumers the record is freed"


def test_stats_report_the_counters() -> None:
    h = Harness(3 * UNIT, heuristic="lru")
    _x, a, _b, _c = chain(h, 3)  # c's allocation evicts a (x is counted and pinned)
    h.use(a)  # a's recompute evicts b
    stats = h.engine.stats()
    assert (stats.evictions, stats.eager_evictions, stats.remats, stats.remat_cost) == (2, 0, 1, 1.0)
    assert h.executor.evicted == ["f1", "f2"]
    assert stats.budget_bytes == 3 * UNIT and stats.peak_bytes <= 3 * UNIT
    assert stats.memory_bytes == h.engine.memory
    assert stats.evictions == len(h.executor.evicted) - stats.eager_evictions
    assert stats.remats == len(h.executor.recomputed) and stats.compute_cost == 3.0
    assert stats.overhead == pytest.approx((3.0 + stats.remat_cost) / 3.0)
