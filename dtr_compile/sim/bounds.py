"""Lower bounds no eviction policy can beat: which budgets fail for every policy, and at what least recompute.

Memory. Constants are pinned from their creation to the end; each operation needs its inputs and its fresh
outputs resident at once; the outputs still alive at the end are pinned together. So no policy, online or
planned, can run under

    max( max over ops of (constants so far + the op's distinct non-constant inputs + its outputs),
         all constants + the distinct outputs alive at the end ).

Recompute. Above that, `recompute_bound.RecomputeBound` gives a certified lower bound on the recompute any
policy needs under a budget (a covering LP over the storages' live intervals, proof sketch there). A replay
fails as "thrash" when its recompute exceeds thrash_limit x the original compute, so a budget whose bound
exceeds that fails for every policy too.

`log_bounds` combines both for the ratios of a table: per ratio the least recompute (shown as the least
overhead) and whether the ratio is infeasible, and the ratio below which every budget is infeasible.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import accumulate

from .recompute_bound import RecomputeBound
from .schedule import Schedule

# The ratio below which every budget is infeasible is found to this fraction of the no-budget peak.
RATIO_TOLERANCE = 1e-4


def lower_bound_bytes(sched: Schedule) -> int:
    """The memory bound above, in bytes."""
    constant_prefix = [0, *accumulate(size if const else 0 for size, const in zip(sched.sizes, sched.constant))]
    bound = 0
    for op in sched.ops:
        inputs = sum(sched.sizes[k] for k in set(op.inputs) if not sched.constant[k])
        outputs = sum(sched.sizes[k] for k in op.outputs)
        bound = max(bound, constant_prefix[op.created_before] + inputs + outputs)
    live_end = sum(sched.sizes[k] for k in sched.final_live if not sched.constant[k])
    return max(bound, constant_prefix[-1] + live_end)


@dataclass(frozen=True)
class RatioBound:
    """What no policy can beat at one budget ratio."""

    ratio: float
    budget_bytes: int
    min_recompute: float  # ns, certified lower bound; math.inf below the memory bound
    infeasible: bool  # below the memory bound, or min_recompute above the thrash limit

    def min_overhead(self, compute: float) -> float:
        """(compute + least recompute) / compute: no policy that succeeds has a lower overhead."""
        return (compute + self.min_recompute) / compute if compute > 0 else 1.0


@dataclass(frozen=True)
class LogBounds:
    log: str
    peak_bytes: int
    compute: float  # ns, the original compute C
    memory_bytes: int  # the memory bound
    thrash_limit: float | None  # recompute above thrash_limit x C fails (None: no limit, memory bound only)
    infeasible_below: float  # every ratio below this fails for every policy (found to RATIO_TOLERANCE)
    ratios: dict[float, RatioBound]

    def json_fields(self, ratio: float) -> dict:
        """The bound of one table cell, for the JSON lines of the command line."""
        bound = self.ratios[ratio]
        return {
            "min_recompute": None if math.isinf(bound.min_recompute) else bound.min_recompute,
            "proven_infeasible": bound.infeasible,
            "infeasible_below": self.infeasible_below,
        }


def log_bounds(
    log: str,
    sched: Schedule,
    peak_bytes: int,
    compute: float,
    ratios: Iterable[float],
    thrash_limit: float | None = 1.0,
) -> LogBounds:
    """Both bounds at each ratio (budget int(ratio * peak_bytes), as the replay), and the ratio below which
    every budget is infeasible: the least recompute only grows as the budget shrinks, so a bisection finds it."""
    bound = RecomputeBound(sched)

    def infeasible(budget: int) -> bool:
        if budget < bound.memory_floor:
            return True
        if thrash_limit is None:
            return False
        return bound.min_recompute(budget) > thrash_limit * compute

    by_ratio = {}
    for ratio in ratios:
        budget = int(peak_bytes * ratio)
        least = bound.min_recompute(budget)
        out = math.isinf(least) or (thrash_limit is not None and least > thrash_limit * compute)
        by_ratio[ratio] = RatioBound(ratio, budget, least, out)

    # Budgets below `low` are proven infeasible; `high` is one that is not (the peak: nothing to evict there).
    low, high = bound.memory_floor, max(peak_bytes, bound.memory_floor)
    if infeasible(low):
        low += 1
        tolerance = max(1, int(peak_bytes * RATIO_TOLERANCE))
        while high - low >= tolerance:  # budgets below `low` are proven infeasible, `high` is not
            mid = (low + high) // 2
            if infeasible(mid):
                low = mid + 1
            else:
                high = mid
    infeasible_below = low / peak_bytes if peak_bytes else 0.0
    return LogBounds(log, peak_bytes, compute, bound.memory_floor, thrash_limit, infeasible_below, by_ratio)
