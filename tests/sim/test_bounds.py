"""The lower bounds of sim/bounds.py and sim/recompute_bound.py: hand-computed optima on small logs, tightness
where a policy can reach them, and soundness against every heuristic's replays (random logs, the ResNet log)."""

from __future__ import annotations

import os
import random

import pytest
from sim_logs import trace_of

from dtr_compile.engine.heuristics import HEURISTICS
from dtr_compile.oplog.format import parse_log
from dtr_compile.sim.bounds import log_bounds, lower_bound_bytes
from dtr_compile.sim.recompute_bound import RecomputeBound
from dtr_compile.sim.replay import ReplayOptions, baseline, replay
from dtr_compile.sim.schedule import build_schedule

LOGS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "dtr-logs")
RESNET = os.path.join(LOGS, "resnet32-56-9000000000.0-2020-10-1-13-3-30-default.log.gz")
# `dtr` walks the graph per candidate (slow on long logs, exact on these); `future` needs the replay's plan.
FAST_HEURISTICS = sorted(HEURISTICS)


def at_budget(trace, budget, heuristic, base):
    """Replay under exactly `budget` bytes (the ratio is chosen so that int(ratio * peak) == budget)."""
    result = replay(trace, (budget + 0.5) / base.peak_bytes, ReplayOptions(heuristic), base)
    assert result.budget_bytes == budget
    return result


def two_then_pressure(log):
    """w (10 B); b (cost 1) and a (cost 100), 100 B each; c (100 B) makes room short; then e = fe(a, b), 0 B."""
    log.constant("w", 10)
    log.call("fb", ["w"], ["b"], [100], [-1], 1)
    log.call("fa", ["w"], ["a"], [100], [-1], 100)
    log.call("fc", ["w"], ["c"], [100], [-1], 100)
    log.release("c")
    log.call("fe", ["a", "b"], ["e"], [0], [-1], 10)
    for name in ("a", "b", "e", "w"):
        log.release(name)


def test_the_cheapest_storage_evicted_once_is_the_optimum_and_a_policy_reaches_it():
    trace = trace_of(two_then_pressure)
    sched = build_schedule(trace)
    bound = RecomputeBound(sched)
    # Memory: fe needs w + a + b = 210; peak w + a + b + c = 310.
    assert bound.memory_floor == lower_bound_bytes(sched) == 210
    assert bound.min_recompute(209) == float("inf")
    # At 210, fc needs 100 B more than fits: a (cost 100) or b (cost 1) must go and come back: optimum 1.
    assert bound.min_recompute(210) == pytest.approx(1.0, rel=1e-6)
    # At 260 only 50 B must go: the LP evicts half of b (0.5); a real policy evicts all of it (1).
    assert bound.min_recompute(260) == pytest.approx(0.5, rel=1e-6)
    assert bound.min_recompute(310) == 0.0
    base = baseline(trace)
    for budget in (210, 260):
        result = at_budget(trace, budget, "dtr_eq", base)
        assert result.status == "ok" and result.remat_compute == 1.0  # b, the stalest and cheapest: tight at 210
        assert bound.min_recompute(budget) <= result.remat_compute


def reread_under_pressure(log, rounds=3):
    """a (100 B, cost 100) is read after each of `rounds` ops that need its room (c_j, 100 B, cost 1)."""
    log.constant("w", 10)
    log.call("fa", ["w"], ["a"], [100], [-1], 100)
    for j in range(rounds):
        log.call("g", ["w"], [f"c{j}"], [100], [-1], 1)
        log.release(f"c{j}")
        log.call("h", ["a"], [f"d{j}"], [0], [-1], 1)
        log.release(f"d{j}")
    log.release("a")
    log.release("w")


def test_a_budget_the_memory_bound_allows_is_proven_to_thrash():
    trace = trace_of(reread_under_pressure)
    base = baseline(trace)
    assert (base.peak_bytes, base.compute, base.lower_bound_bytes) == (210, 106, 110)
    bound = RecomputeBound(build_schedule(trace))
    # Under B < 210, each g must push out 210 - B bytes of a, three times: LP optimum 3 * (210 - B) * 100 / 100.
    for budget in (110, 150, 174, 175, 209):
        assert bound.min_recompute(budget) == pytest.approx(3 * (210 - budget), rel=1e-6)
    bounds = log_bounds(trace.name, build_schedule(trace), base.peak_bytes, base.compute, [0.5, 174.5 / 210, 1.0])
    assert bounds.ratios[0.5].infeasible and bounds.ratios[0.5].min_recompute == float("inf")  # memory
    assert bounds.ratios[174.5 / 210].infeasible  # 3 * 36 = 108 > C = 106; the memory bound (110) allows 174
    assert not bounds.ratios[1.0].infeasible and bounds.ratios[1.0].min_recompute == 0.0
    assert bounds.infeasible_below == pytest.approx(175 / 210)  # 3 * 35 = 105 <= 106 is not ruled out
    for heuristic in FAST_HEURISTICS:
        assert at_budget(trace, 174, heuristic, base).status == "thrash"  # a real policy pays 300 there
        assert at_budget(trace, 210, heuristic, base).status == "ok"


def one_op_two_outputs(log):
    """(u1, u2) = f(w), 50 B each, cost 100; c (100 B) needs their room; then h(u1, u2)."""
    log.constant("w", 10)
    log.call("f", ["w"], ["u1", "u2"], [50, 50], [-1, -1], 100)
    log.call("g", ["w"], ["c"], [100], [-1], 1)
    log.release("c")
    log.call("h", ["u1", "u2"], ["e"], [0], [-1], 1)
    for name in ("u1", "u2", "e", "w"):
        log.release(name)


def test_one_rerun_restores_every_output_of_an_op():
    trace = trace_of(one_op_two_outputs)
    base = baseline(trace)
    bound = RecomputeBound(build_schedule(trace))
    assert bound.memory_floor == 110
    assert bound.min_recompute(110) == pytest.approx(100.0, rel=1e-6)  # both outputs go, one rerun (not two)
    result = at_budget(trace, 110, "dtr_eq", base)
    assert result.status == "ok" and result.remat_compute == 100.0  # tight


def random_log(seed: int):
    """A random training-like step: a forward pass whose activations (some multi-output, some views, skips)
    stay alive for a backward pass that reads them in reverse, with in-place updates and copies."""
    rng = random.Random(seed)

    def build(log):
        log.constant("x", rng.randint(10, 100))
        log.constant("p", rng.randint(1, 20))
        acts = ["x"]
        for j in range(rng.randint(6, 20)):
            args = [acts[-1], "p"] + ([rng.choice(acts)] if rng.random() < 0.3 else [])
            if rng.random() < 0.15:
                log.call("view", [acts[-1]], [f"v{j}"], [0], [0], rng.randint(0, 3))
                args.append(f"v{j}")
            outs = [f"a{j}"] + ([f"s{j}"] if rng.random() < 0.3 else [])
            sizes = [rng.randint(50, 200)] + [rng.randint(1, 20)] * (len(outs) - 1)
            log.call("fwd", list(dict.fromkeys(args)), outs, sizes, [-1] * len(outs), rng.randint(1, 100))
            acts.append(f"a{j}")
        log.annotate_backward()
        log.call("loss", [acts[-1]], ["g"], [rng.randint(50, 200)], [-1], rng.randint(1, 20))
        for j in reversed(range(len(acts) - 1)):
            log.call("bwd", ["g", acts[j + 1], acts[j]], [f"g{j}"], [rng.randint(50, 200)], [-1], rng.randint(1, 100))
            if rng.random() < 0.2:
                log.mutate("scale_", [f"g{j}", "p"], [0], rng.randint(1, 10))
            log.copy_from("g", f"g{j}")
            log.release(f"g{j}")
            if acts[j + 1] != "x" and rng.random() < 0.8:
                log.release(acts[j + 1])

    return trace_of(build)


@pytest.mark.parametrize("seed", range(12))
def test_the_bound_never_exceeds_what_a_replay_needs(seed):
    trace = random_log(seed)
    base = baseline(trace)
    sched = build_schedule(trace)
    ratios = [0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    bounds = log_bounds(trace.name, sched, base.peak_bytes, base.compute, ratios)
    for ratio in ratios:
        least = bounds.ratios[ratio]
        for heuristic in FAST_HEURISTICS:
            result = replay(trace, ratio, ReplayOptions(heuristic, thrash_limit=None), base)
            if result.status == "ok":  # no thrash limit here: compare the recompute itself
                assert least.min_recompute <= result.remat_compute * (1 + 1e-9) + 1e-6, (ratio, heuristic)
                if result.remat_compute <= base.compute:
                    assert not least.infeasible and ratio >= bounds.infeasible_below


@pytest.mark.skipif(not os.path.exists(RESNET), reason="the shared DTR logs are not checked out beside the repo")
def test_resnet_bound_is_below_every_successful_replay():
    trace = parse_log(RESNET)
    base = baseline(trace)
    ratios = [0.1, 0.2, 0.3, 0.5, 0.8, 1.0]
    bounds = log_bounds(trace.name, build_schedule(trace), base.peak_bytes, base.compute, ratios)
    assert bounds.infeasible_below == pytest.approx(bounds.memory_bytes / base.peak_bytes, abs=1e-4)
    for ratio in ratios:
        result = replay(trace, ratio, ReplayOptions("dtr_eq_retain"), base)
        if result.status == "ok":
            assert bounds.ratios[ratio].min_recompute <= result.remat_compute
            assert not bounds.ratios[ratio].infeasible
    # What the LP proves at 0.1 (a fifth of C) is far from the thrash limit: it cannot rule 0.1 out.
    assert 0.15 < bounds.ratios[0.1].min_recompute / base.compute < 0.3
