"""The plan each compiled region of this process runs now, by region name, and a one-line summary of them.

A benchmark row reports what `backend="dtr"` planned (bench/child.py) from here, without reaching up into the
backend that compiles the regions (backend/region.py records each plan it installs). Reports are held weakly: a
region that is gone leaves nothing behind.
"""

from __future__ import annotations

import operator
import re
import weakref
from collections import Counter

from torch import fx

from ..errors import format_bytes
from .inlining import is_view
from .partition import PlanReport
from .rewrite import RECOMPUTE_META_KEY

__all__ = ["record", "running", "summary"]

_RUNNING: dict[str, weakref.ref[PlanReport]] = {}


def record(region: str, report: PlanReport) -> None:
    """`region` runs `report`'s plan from now on."""
    _RUNNING[region] = weakref.ref(report)


def running() -> dict[str, PlanReport]:
    """The plans running now, by region name, in the order the regions were made."""
    live = {name: ref() for name, ref in _RUNNING.items()}
    return {name: report for name, report in live.items() if report is not None}


def summary(top: int = 6) -> str:
    """Per region: the chain's block options, the modelled recompute time over the step's compute, the planned and
    measured peaks against the budget (and what the model was held to: the device's aim over the graph's measured /
    modelled ratio), the ops recomputed most (by op name, counting each recomputation), and where the region's first call went."""
    parts = []
    for name, report in running().items():
        plan = report.plan
        options = Counter(plan.block_options or ())
        recomputed = Counter(
            re.sub(r"_\d+$", "", str(node.meta[RECOMPUTE_META_KEY]))
            for node in report.planned.graph.nodes
            if RECOMPUTE_META_KEY in node.meta and _computes(node)
        )
        measured = report.measured_peak_bytes
        parts.append(
            f"{name}: "
            + (", ".join(f"{o} x{n}" for o, n in options.items()) + "; " if options else "")
            + f"recompute {plan.recompute_s * 1e3:.1f} of {plan.compute_s * 1e3:.1f} ms modelled; "
            + f"planned {format_bytes(report.planned_peak.peak_bytes)}"
            + (f", measured {format_bytes(measured)}" if measured is not None else "")
            + (f" of {format_bytes(report.budget_bytes)} (model held to {report.model_scale:.3f} of it"
               f"{f', planned {report.replans + 1} times' if report.replans else ''})"
               if report.budget_bytes is not None else "")
            + (f"; recomputes {', '.join(f'{op} x{n}' for op, n in recomputed.most_common(top))}" if recomputed else "")
            + f"; {report.times}"
        )
    return " | ".join(parts)


def _computes(node: fx.Node) -> bool:
    """An op that computes something: not a view (re-derived for free) nor a getitem of a multi-output op (that op is
    counted)."""
    return node.op == "call_function" and node.target is not operator.getitem and not is_view(node)
