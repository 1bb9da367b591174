"""The compiled suite's comparison and tables: each dtr row against PyTorch's knob at equal measured peak.

The knob (`activation_memory_budget`) is a fraction of saved bytes, not of the peak, so a dtr row at budget b is
compared with what the knob does at the same *measured* peak: its step time interpolated on its Pareto frontier
(the fastest setting at each peak) between the settings whose peaks bracket ours, and the fastest setting whose
peak is at or below ours (what a user of the knob can actually get within that memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..timing import median

PEAK_TOLERANCE = 1.001  # peaks within 0.1% count as equal (a few KiB of bookkeeping tensors)
# A knob point this close to no-remat's step time pays nothing measurable for its recomputation: two identical
# configurations (no remat, and the knob at 1.0) differ by up to 4% in one run on the 2-core dev machine.
# Beating the knob by 5% there would mean beating no rematerialization, so the summary reports those points apart.
KNOB_AT_NO_REMAT_SPEED = 1.05


@dataclass
class Way:
    label: str
    kind: str  # "base" | "dtr" | "knob" | "ckpt"
    setting: float | None = None
    model: nn.Module | None = None
    step: Any = None
    peak: int = 0
    times: list[float] = field(default_factory=list)
    note: str = ""
    error: str | None = None
    smallest: int | None = None  # for an infeasible budget: the smallest feasible one, in bytes

    @property
    def time(self) -> float:
        return median(self.times)


def knob_at(peak: int, knobs: list[Way]) -> tuple[float, Way | None]:
    """The knob's step time at a measured `peak`, on its Pareto frontier: interpolated between the frontier
    points that bracket `peak` (generous to the knob: a setting between two of ours does not exist), NaN where
    no setting reaches `peak`; and the fastest setting whose measured peak is at or below `peak`."""
    points = sorted((w.peak, w.time, i) for i, w in enumerate(knobs) if w.step is not None)
    frontier: list[tuple[int, float, int]] = []
    for point in points:  # by increasing peak; keep a point only if it is faster than every smaller one
        if not frontier or point[1] < frontier[-1][1]:
            frontier.append(point)
    below = [p for p in frontier if p[0] <= peak * PEAK_TOLERANCE]
    if not below:
        return math.nan, None
    low, best_below = below[-1], knobs[below[-1][2]]
    above = [p for p in frontier if p[0] > peak * PEAK_TOLERANCE]
    if not above:
        return low[1], best_below
    high = above[0]
    share = (peak - low[0]) / (high[0] - low[0])
    return low[1] + share * (high[1] - low[1]), best_below


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


HEADER = (
    "| way | measured peak / no-remat | step time / no-remat | knob at equal peak: time / no-remat "
    "(interpolated on its Pareto frontier) | ours / knob | fastest knob setting at or below our peak | note |"
)


def report_model(result: dict[str, Any], description: str) -> tuple[list[str], dict[str, Any]]:
    """The model's table, and what the summary checks (peaks monotone, ours / knob, the step at 0.5)."""
    ways: list[Way] = result["ways"]
    base = ways[0]
    knobs = [w for w in ways if w.kind == "knob"]
    lines = [
        f"### {result['name']}: {description}",
        "",
        f"No-remat (Inductor defaults): measured peak {base.peak / 2**20:.2f} MiB, step {base.time * 1e3:.1f} ms CPU.",
        "",
        HEADER,
        "|---|---|---|---|---|---|---|",
    ]
    checks: dict[str, Any] = {"monotone": True, "vs_knob": [], "at_half": None}
    previous = math.inf
    for way in ways:
        if way.error is not None:
            lines.append(f"| {way.label} | - | - | - | - | - | {way.error} |")
            continue
        peak, step = way.peak / base.peak, way.time / base.time
        budgeted = way.kind == "dtr" and way.setting is not None
        knob_time, nearest = knob_at(way.peak, knobs) if budgeted else (math.nan, None)
        if budgeted:
            ratio = step / (knob_time / base.time) if not math.isnan(knob_time) else math.nan
            checks["vs_knob"].append((way.setting, peak, ratio, knob_time / base.time))
            checks["monotone"] &= way.peak <= previous
            previous = way.peak
            if way.setting == 0.5:
                checks["at_half"] = step
        knob_cell = _fmt(knob_time / base.time) if budgeted else ""
        ratio_cell = knob_cell
        if knob_cell not in ("", "-") and nearest is not None:
            ratio_cell = f"{step / (knob_time / base.time):.2f} (vs that setting: {way.time / nearest.time:.2f})"
        if budgeted and knob_cell == "-":
            ratio_cell = "the knob does not reach this peak"
        nearest_cell = ""
        if budgeted:
            nearest_cell = (
                "none"
                if nearest is None
                else f"{nearest.setting}: peak {nearest.peak / base.peak:.2f}, time {nearest.time / base.time:.2f}"
            )
        lines.append(
            f"| {way.label} | {peak:.2f} | {step:.2f} | {knob_cell} | {ratio_cell} | {nearest_cell} | {way.note} |"
        )
    lines.append("")
    return lines, checks


def summary(all_checks: dict[str, dict[str, Any]]) -> list[str]:
    """The targets of issue 5, met or not, per model."""
    lines = ["Targets:", ""]
    for name, checks in all_checks.items():
        compared = [(b, r, k) for b, _, r, k in checks["vs_knob"] if not math.isnan(r)]
        paying = [(b, r) for b, r, k in compared if k > KNOB_AT_NO_REMAT_SPEED]
        at_speed = [b for b, _, k in compared if k <= KNOB_AT_NO_REMAT_SPEED]
        verdict = "met" if paying and max(r for _, r in paying) <= 0.95 else "NOT met" if paying else "no such point"
        lines.append(
            f"- {name}: measured peak never rises as the budget tightens: "
            f"{'met' if checks['monotone'] else 'NOT met'}; ours / knob at equal measured peak (where the knob "
            f"reaches our peak): {', '.join(f'{b}: {r:.2f} (knob {k:.2f} x no-remat)' for b, r, k in compared)}"
            f" -> where the knob pays for its recomputation (its time > {KNOB_AT_NO_REMAT_SPEED} x no-remat): "
            f"{verdict} (target <= 0.95)"
            + (
                f"; where it runs at no-remat speed ({', '.join(str(b) for b in at_speed)}), 0.95 x the knob would "
                "mean beating no rematerialization"
                if at_speed
                else ""
            )
            + f"; step time at budget 0.5: {_fmt(checks['at_half'])} -> "
            f"{'met' if checks['at_half'] is not None and checks['at_half'] <= 1.10 else 'NOT met'} (target <= 1.10)"
        )
    lines.append("")
    return lines
