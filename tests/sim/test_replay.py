"""Replay semantics on hand-written logs, with the exact evictions the heuristics must make."""

from __future__ import annotations

import pytest
from sim_logs import trace_of

from dtr_compile.engine import Engine, NullExecutor
from dtr_compile.sim.bounds import lower_bound_bytes
from dtr_compile.sim.future import FuturePlan
from dtr_compile.sim.replay import ReplayOptions, baseline, drive, replay
from dtr_compile.sim.schedule import build_schedule


class Recorder(NullExecutor):
    """Remembers the storage ids the engine frees, in order (storage id = creation order in the log)."""

    def __init__(self) -> None:
        self.evicted: list[int] = []
        self.recomputed: list[str] = []

    def evict(self, storage) -> None:
        self.evicted.append(storage.sid)

    def recompute(self, op) -> None:
        self.recomputed.append(op.name)


def run(trace, budget, heuristic, plan=None):
    recorder = Recorder()
    engine = Engine(
        budget,
        heuristic=heuristic,
        candidate_sampling="all",
        min_evictable_fraction=0.0,
        executor=recorder,
        keep_dead_intermediates=True,
    )  # the engine settings replay() uses
    drive(trace, engine, plan)
    return engine, recorder


def cheap_middle(log):
    """w (10 B) -> a (cost 100), b (cost 1), c (cost 100), d (cost 100), all 100 B; then e = f(b)."""
    log.constant("w", 10)
    log.call("fa", ["w"], ["a"], [100], [-1], 100)
    log.call("fb", ["w"], ["b"], [100], [-1], 1)
    log.call("fc", ["w"], ["c"], [100], [-1], 100)
    log.call("fd", ["w"], ["d"], [100], [-1], 100)
    log.release("d")
    log.call("fe", ["b"], ["e"], [100], [-1], 10)
    for name in ("a", "b", "c", "w"):
        log.release(name)


@pytest.mark.parametrize("heuristic", ["dtr_eq", "dtr_eq_dead", "dtr"])
def test_dtr_evicts_the_cheap_stale_storage_then_the_stalest(heuristic):
    # Before fd (clock 201): scores c/(m*s) are a 100/(100*101), b 1/(100*100), c fresh -> b goes.
    # fe brings b back (cost 1); then (clock 302) a 100/(100*202) < c 100/(100*101) -> a goes.
    # Eager frees: d at its release, then b and c at theirs (a is already out). Storage ids: w0 a1 b2 c3 d4 e5.
    engine, recorder = run(trace_of(cheap_middle), 320, heuristic)
    assert recorder.evicted == [2, 4, 1, 2, 3]
    assert recorder.recomputed == ["fb"]
    stats = engine.stats()
    assert (stats.evictions, stats.eager_evictions, stats.remats) == (2, 3, 1)
    assert stats.compute_cost == 311 and stats.remat_cost == 1
    assert stats.peak_bytes == 310


def test_lru_evicts_the_least_recently_used_instead():
    engine, recorder = run(trace_of(cheap_middle), 320, "lru")
    assert recorder.evicted[0] == 1  # a, untouched since clock 100
    assert engine.stats().remats == 0  # b stayed: fe needs no recompute


def dead_intermediate(log):
    """A chain w -> x1 -> x2 whose middle dies; recomputing x2 brings x1 back as a dead intermediate."""
    log.constant("w", 10)
    log.call("fl", ["w"], ["l"], [100], [-1], 100)
    log.call("f1", ["w"], ["x1"], [100], [-1], 10)
    log.call("f2", ["x1"], ["x2"], [100], [-1], 10)
    log.release("x1")
    log.call("fy", ["w"], ["y"], [100], [-1], 1000)
    log.call("fz", ["w"], ["z"], [100], [-1], 1)
    log.release("z")
    log.call("fm", ["w"], ["m"], [100], [-1], 1)
    log.release("m")
    log.call("fu", ["x2"], ["u"], [100], [-1], 1)
    for name in ("l", "x2", "y", "w"):
        log.release(name)


@pytest.mark.parametrize("heuristic", ["dtr_eq", "dtr_eq_dead"])
def test_a_dead_intermediate_stays_resident_until_room_is_needed(heuristic):
    # ids: w0 l1 x1=2 x2=3 y4 z5 m6 u7. x1 is freed at its release; fz evicts x2 ((10 + c(x1)) / (100 * 1000)
    # beats l 100 / (100 * 1020) and the fresh y); z and m are freed at theirs. fu recomputes x1 then x2,
    # evicting l while x1 is locked; x1, dead, is still resident afterwards and is the one evicted to make
    # room for u (by the heuristic, not eagerly). The releases at the end free x2 and y.
    engine, recorder = run(trace_of(dead_intermediate), 320, heuristic)
    assert recorder.evicted == [2, 3, 5, 6, 1, 2, 3, 4]
    assert recorder.recomputed == ["f1", "f2"]
    assert (engine.stats().evictions, engine.stats().eager_evictions) == (3, 5)


def test_dead_first_scores_dead_storages_zero_and_live_ones_like_dtr_eq():
    from dtr_compile.engine.heuristics import h_dtr_eq, h_dtr_eq_dead

    engine = Engine(None)
    w = engine.constant(10, counted=True)
    engine.reserve([w], 200)
    op = engine.record("f", [w], [100, 100], 50)
    live, dead = op.outputs
    dead.handles = 0  # the state a recompute chain leaves an intermediate in: resident, no handle
    assert dead.resident and dead.handles == 0
    clock = engine.clock + 25
    assert h_dtr_eq_dead(dead, clock, engine.rng) == 0.0
    assert h_dtr_eq(dead, clock, engine.rng) > 0.0
    assert (
        h_dtr_eq_dead(live, clock, engine.rng) == h_dtr_eq(live, clock, engine.rng) == 50 / (100 * 25)
    )  # written at clock 50, read at 75


def test_aliases_share_storage_and_mutation_is_copy_on_write():
    def log(w):
        w.constant("w", 8)
        w.call("view", ["w"], ["v"], [8], [0], 1)  # an alias: no memory of its own
        w.call("f", ["v"], ["y"], [16], [-1], 2)
        w.mutate("add_", ["y", "w"], [0], 3)  # new version of y (16 B) while the old one is alive
        w.copy("z", "y")
        w.copy_from("z", "w")  # z leaves y's storage for w's
        w.release("y")  # the last handle of y's new version: freed

    trace = trace_of(log)
    base = baseline(trace)
    assert base.peak_bytes == 8 + 16 + 16
    assert base.compute == 6
    assert base.constant_bytes == 8
    engine = Engine(None)
    drive(trace, engine)
    assert engine.memory == 8  # only the constant is left; v and z alias it


def test_outputs_alive_at_the_end_are_recomputed_and_pinned():
    def log(w):
        w.constant("x0", 100)
        w.call("f1", ["x0"], ["x1"], [100], [-1], 10)
        w.call("f2", ["x1"], ["x2"], [100], [-1], 10)
        w.call("f3", ["x2"], ["x3"], [100], [-1], 10)  # budget 300: x1 (stalest) goes
        w.release("x2")

    engine, recorder = run(trace_of(log), 300, "dtr_eq")
    assert recorder.evicted == [1, 2]  # x1 evicted for f3; x2 freed at its release
    assert recorder.recomputed == ["f1"]  # the end pins x1 and x3, so x1 comes back
    assert all(s.pinned for s in (engine._held.values() if hasattr(engine, "_held") else []))
    assert engine.memory == 300


def test_statuses_ok_oom_thrash_and_the_lower_bound():
    trace = trace_of(cheap_middle)
    base = baseline(trace)
    assert base.peak_bytes == 410
    # Constants 10 + the largest op (inputs + outputs): fe reads b and writes e -> 210; end: w + e -> 110.
    assert base.lower_bound_bytes == lower_bound_bytes(build_schedule(trace)) == 210
    ok = replay(trace, 320 / 410, ReplayOptions("dtr_eq"), base)
    assert (ok.status, ok.budget_bytes, ok.evictions, ok.remats) == ("ok", 320, 2, 1)
    assert ok.overhead == pytest.approx(312 / 311)
    assert replay(trace, 0.3, ReplayOptions("dtr_eq"), base).status == "oom"  # 123 B < the bound
    thrash = replay(trace, 320 / 410, ReplayOptions("dtr_eq", thrash_limit=0.001), base)
    assert thrash.status == "thrash" and thrash.overhead is None


def test_future_heuristic_evicts_the_storage_read_furthest_ahead():
    def log(w):
        w.constant("w", 10)
        w.call("fa", ["w"], ["a"], [100], [-1], 10)
        w.call("fb", ["w"], ["b"], [100], [-1], 10)
        w.call("fc", ["w"], ["c"], [100], [-1], 10)
        w.call("fd", ["w"], ["d"], [100], [-1], 10)  # budget 320: one of a, b, c must go
        w.call("gb", ["b"], ["e"], [100], [-1], 10)  # b is read next ...
        w.release("e")
        w.call("ga", ["a"], ["f"], [100], [-1], 10)  # ... then a; c only at the end
        w.call("gc", ["c"], ["g"], [0], [-1], 10)
        for name in ("a", "b", "c", "d", "f", "g"):
            w.release(name)

    trace = trace_of(log)
    _, recorder = run(trace, 320, "future", FuturePlan(build_schedule(trace)))
    assert recorder.evicted[0] == 3  # c: Belady's choice, though it is the freshest
    # dtr_eq evicts the stalest, a, and has to bring it back.
    _, online = run(trace, 320, "dtr_eq")
    assert online.evicted[0] == 1
