"""The default heuristic's retention of needed dead storages, the future-aware heuristic's reading of held
children, and views charged as the DTR simulator charges them: hand-written logs, exact evictions."""

from __future__ import annotations

import pytest
from sim_logs import trace_of
from test_replay import run

from dtr_compile.sim.future import FuturePlan
from dtr_compile.sim.replay import ReplayOptions, baseline, replay
from dtr_compile.sim.schedule import build_schedule


def held_child_of_a_dying_parent(log):
    """s = fs(d) is cheap and gets evicted; then d's last handle dies while s still needs it to come back.

    ids: w0 d1 s2 q3 y4 u5 (q is a 1-byte op that lets time pass)."""
    log.constant("w", 10)
    log.call("fd", ["w"], ["d"], [100], [-1], 1000)
    log.call("fs", ["d"], ["s"], [100], [-1], 1)
    log.call("fq", ["w"], ["q"], [1], [-1], 100)
    log.release("q")
    log.call("fy", ["w"], ["y"], [100], [-1], 10)  # budget 220: s (1 / (100 * 100)) goes, not d (1000 / (100 * 101))
    log.release("d")
    log.call("fu", ["s"], ["u"], [100], [-1], 5)
    for name in ("s", "y", "u", "w"):
        log.release(name)


def test_a_dead_parent_an_evicted_held_storage_needs_is_retained():
    # dtr_eq_retain keeps d when its last handle dies (s, evicted and held, is recomputed from it). fu brings s
    # back from d with one rerun of fs (cost 1), evicting y for it (d is locked by the recompute); then d, dead
    # and no longer needed by an evicted storage, scores 0 and makes room for u.
    engine, recorder = run(trace_of(held_child_of_a_dying_parent), 220, "dtr_eq_retain")
    assert recorder.evicted == [3, 2, 4, 1, 2, 5]
    assert recorder.recomputed == ["fs"]
    assert (engine.stats().evictions, engine.stats().remat_cost) == (3, 1)


def test_without_retention_the_dead_parent_is_freed_and_recomputed():
    # dtr_eq_dead frees d at its release, so bringing s back reruns fd (cost 1000) before fs.
    engine, recorder = run(trace_of(held_child_of_a_dying_parent), 220, "dtr_eq_dead")
    assert recorder.evicted == [3, 2, 1, 4, 1, 2, 5]
    assert recorder.recomputed == ["fd", "fs"]
    assert (engine.stats().evictions, engine.stats().remat_cost) == (3, 1001)


def test_retention_needs_a_held_storage_downstream():
    # The same program without fu's read of s: s is released before d dies, so nothing evicted and held
    # depends on d any more and its release frees it at once.
    def log(w):
        w.constant("w", 10)
        w.call("fd", ["w"], ["d"], [100], [-1], 1000)
        w.call("fs", ["d"], ["s"], [100], [-1], 1)
        w.call("fq", ["w"], ["q"], [1], [-1], 100)
        w.release("q")
        w.call("fy", ["w"], ["y"], [100], [-1], 10)
        w.release("s")
        w.release("d")
        for name in ("y", "w"):
            w.release(name)

    engine, recorder = run(trace_of(log), 220, "dtr_eq_retain")
    assert recorder.evicted == [3, 2, 1, 4]  # q; s for y; d freed at its release; y at its release
    assert engine.memory == 10


def test_retention_follows_chains_of_dead_evicted_storages():
    # s needs c (dead, evicted), which needs d: when d's last handle dies, the held storage is two steps down
    # an evicted path, and d stays. k is too expensive to evict. ids: w0 d1 c2 s3 k4 q5 y6 q7 u8.
    def log(w):
        w.constant("w", 10)
        w.call("fd", ["w"], ["d"], [100], [-1], 1000)
        w.call("fc", ["d"], ["c"], [100], [-1], 1)
        w.call("fs", ["c"], ["s"], [100], [-1], 1)
        w.release("c")  # freed at once: s is resident
        w.call("fk", ["w"], ["k"], [100], [-1], 10**6)
        w.call("fq", ["w"], ["q"], [1], [-1], 100)
        w.release("q")
        w.call("fy", ["w"], ["y"], [100], [-1], 1)  # budget 320: s ((1 + c(c)) / (100 * s)) goes, not d or k
        w.release("d")  # kept: s -> c -> d
        w.call("fq2", ["w"], ["q2"], [1], [-1], 100)
        w.release("q2")
        w.call("fu", ["s"], ["u"], [100], [-1], 5)
        for name in ("s", "y", "u", "k", "w"):
            w.release(name)

    engine, recorder = run(trace_of(log), 320, "dtr_eq_retain")
    # c, q free at their releases; s goes for y; q2 at its release. fu: y goes for c (d is locked), then d
    # (dead, and c is back: 0) for s, then c (dead) for u. The releases free s, u and k.
    assert recorder.evicted == [2, 5, 3, 7, 6, 1, 2, 3, 8, 4]
    assert recorder.recomputed == ["fc", "fs"]  # not fd
    assert engine.stats().remat_cost == 2


def test_future_heuristic_keeps_a_parent_an_evicted_held_storage_reads_soon():
    # p = fp(b) is evicted first (cheap); later a or b must go. The program reads b itself only much later,
    # but p (evicted, held) is read at gp, and its recompute reads b: b's distance is p's, so a goes.
    # Times: fa 0-10, fb 10-110, fp 110-111, fy 111-121, gy 121-131, fz 131-141, gp 141, ga 142, wait, gb 1143.
    def log(w):
        w.constant("w", 10)
        w.call("fa", ["w"], ["a"], [100], [-1], 10)
        w.call("fb", ["w"], ["b"], [100], [-1], 100)
        w.call("fp", ["b"], ["p"], [100], [-1], 1)
        w.call("fy", ["w"], ["y"], [100], [-1], 10)  # budget 320: p 1 / (100 * 30) < b 100 / (100 * 1032) < a
        w.call("gy", ["y"], ["e"], [0], [-1], 10)
        # a: 10 / (100 * 11); b: (100 + 1) / (100 * 10) with p's read, 101 / (100 * 1012) without -> a goes
        w.call("fz", ["y"], ["z"], [100], [-1], 10)
        w.call("gp", ["p"], ["f"], [0], [-1], 1)
        w.call("ga", ["a"], ["g"], [0], [-1], 1)
        w.call("wait", ["w"], ["q"], [0], [-1], 1000)
        w.call("gb", ["b"], ["h"], [0], [-1], 1)
        for name in ("a", "b", "p", "y", "z", "e", "f", "g", "q", "h", "w"):
            w.release(name)

    trace = trace_of(log)
    _, recorder = run(trace, 320, "future", FuturePlan(build_schedule(trace)))
    assert recorder.evicted[:2] == [3, 1]  # p, then a (ids: w0 a1 b2 p3)
    assert recorder.recomputed == ["fp", "fa"]  # p from the resident b; no rerun of fb


def test_views_are_rerun_after_their_storage_is_evicted_and_cost_their_storage():
    # v = view(b) costs 7. ids: w0 a1 b2 y3. Before fy, b's cost counts its view: (2 + 7) / (100 * s) vs a's
    # 5 / (100 * s'). b goes only if its view is ignored.
    def log(w):
        w.constant("w", 10)
        w.call("fa", ["w"], ["a"], [100], [-1], 5)
        w.call("fb", ["w"], ["b"], [100], [-1], 2)
        w.call("view", ["b"], ["v"], [0], [0], 7)
        w.call("fy", ["w"], ["y"], [100], [-1], 1)  # budget 220: a or b must go
        w.call("gv", ["v"], ["e"], [0], [-1], 1)
        w.call("ga", ["a"], ["f"], [0], [-1], 1)
        for name in ("a", "b", "v", "y", "e", "f", "w"):
            w.release(name)

    trace = trace_of(log)
    base = baseline(trace)
    assert base.compute == 17
    charged = replay(trace, 220 / base.peak_bytes, ReplayOptions("dtr_eq"), base)
    free = replay(trace, 220 / base.peak_bytes, ReplayOptions("dtr_eq", charge_views=False), base)
    # Charged: a (5 / (100 * 9)) goes rather than b ((2 + 7) / (100 * 7)); ga brings a back (5), evicting y.
    assert (charged.status, charged.evictions, charged.remats, charged.remat_compute) == ("ok", 2, 1, 5)
    # Free views: b (2 / (100 * 7)) goes; gv brings b back (2), evicting a; ga brings a back (5), evicting y.
    assert (free.status, free.evictions, free.remats, free.remat_compute) == ("ok", 3, 2, 7)


def test_a_view_used_after_its_storage_came_back_is_rerun_once_with_its_source_view():
    # v2 = view(v1), v1 = view(b). b is evicted; gv2 brings b back and re-runs view1 then view2 (3 + 4).
    # A second read of v2 re-runs nothing.
    def log(w):
        w.constant("w", 10)
        w.call("fb", ["w"], ["b"], [100], [-1], 2)
        w.call("view1", ["b"], ["v1"], [0], [0], 3)
        w.call("view2", ["v1"], ["v2"], [0], [0], 4)
        w.release("v1")
        w.call("fa", ["w"], ["a"], [100], [-1], 1000)
        w.call("fy", ["w"], ["y"], [100], [-1], 1)  # budget 220: b ((2 + 7) / ...) goes, not a (1000 / ...)
        w.release("y")
        w.call("gv2", ["v2"], ["e"], [0], [-1], 1)
        w.call("hv2", ["v2"], ["f"], [0], [-1], 1)
        for name in ("a", "b", "v2", "e", "f", "w"):
            w.release(name)

    trace = trace_of(log)
    base = baseline(trace)
    result = replay(trace, 220 / base.peak_bytes, ReplayOptions("dtr_eq"), base)
    assert (result.status, result.evictions, result.remats) == ("ok", 1, 3)  # fb, view1, view2
    assert result.remat_compute == 2 + 3 + 4


def test_an_op_recomputed_from_a_view_reruns_the_view():
    # g = gv(v) with v = view(b). Both b and g are evicted; bringing g back recomputes b (fb), re-runs the
    # view (5) and then gv.
    def log(w):
        w.constant("w", 10)
        w.call("fb", ["w"], ["b"], [100], [-1], 1)
        w.call("view", ["b"], ["v"], [0], [0], 5)
        w.call("gv", ["v"], ["g"], [100], [-1], 1)
        w.release("v")
        w.release("b")  # b is dead: freed at once (g is resident)
        w.call("fq", ["w"], ["q"], [1], [-1], 100)
        w.release("q")
        w.call("fa", ["w"], ["a"], [100], [-1], 1000)
        w.call("fy", ["w"], ["y"], [100], [-1], 1)  # budget 220: g goes
        w.call("hg", ["g"], ["e"], [0], [-1], 1)
        for name in ("a", "g", "y", "e", "w"):
            w.release(name)

    trace = trace_of(log)
    base = baseline(trace)
    result = replay(trace, 220 / base.peak_bytes, ReplayOptions("dtr_eq"), base)
    assert result.status == "ok"
    assert result.remat_compute == pytest.approx(1 + 5 + 1)
