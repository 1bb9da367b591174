"""Printing replay results: JSON lines, or one table per log (plain text or Markdown).

A table has one row per heuristic (ours, then the reference simulator's if given) and one column per
budget ratio. A cell is the overhead, `oom` or `thrash`. The `bound` row (bounds.py) marks with `infeasible`
the ratios where no policy can succeed (below the memory bound, or least recompute above the thrash limit),
and elsewhere gives the least overhead any policy needs there, `>=1.171`; without `bounds`, only the memory
bound is known and marked.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence

from ..errors import format_bytes
from .bounds import LogBounds
from .reference import REFERENCE_NAMES, ReferenceTable
from .replay import ReplayResult


def json_lines(results: Iterable[ReplayResult]) -> str:
    """One JSON object per result, one per line."""
    return "\n".join(json.dumps(r.to_json(), sort_keys=True) for r in results)


def cell(result: ReplayResult) -> str:
    return f"{result.overhead:.3f}" if result.status == "ok" else result.status


def _bound_cell(bounds: LogBounds, ratio: float) -> str:
    if ratio not in bounds.ratios:
        return ""
    bound = bounds.ratios[ratio]
    return "infeasible" if bound.infeasible else f">={bound.min_overhead(bounds.compute):.3f}"


def tables(
    results: Sequence[ReplayResult],
    *,
    reference: ReferenceTable | None = None,
    markdown: bool = False,
    bounds: Mapping[str, LogBounds] | None = None,
) -> str:
    """One table per log, in the order the logs first appear in `results`; `bounds` by log name."""
    by_log: dict[str, list[ReplayResult]] = {}
    for r in results:
        by_log.setdefault(r.log, []).append(r)
    return "\n\n".join(_table(log, rows, reference, markdown, (bounds or {}).get(log)) for log, rows in by_log.items())


def _table(
    log: str,
    results: list[ReplayResult],
    reference: ReferenceTable | None,
    markdown: bool,
    bounds: LogBounds | None,
) -> str:
    ratios = sorted({r.ratio for r in results})
    first = results[0]
    rows: list[tuple[str, list[str]]] = []
    by_heuristic: dict[str, dict[float, ReplayResult]] = {}
    for r in results:
        by_heuristic.setdefault(r.heuristic, {})[r.ratio] = r
    for name, cells in by_heuristic.items():
        rows.append((name, [cell(cells[x]) if x in cells else "" for x in ratios]))
    if reference is not None:
        for ref_name, ours in REFERENCE_NAMES.items():
            if ours not in by_heuristic and ours not in ("dtr", "dtr_eq"):
                continue  # only the reference rows that have a counterpart in this table, plus DTR's own two
            row = reference.row(log, ref_name)
            if row is not None and any(x in row for x in ratios):  # none of its cells at these ratios: no row
                rows.append((f"reference {ref_name}", [row.get(x, "") for x in ratios]))
    peak, bound = first.baseline_peak_bytes, first.lower_bound_bytes
    title = (
        f"{log}: no-budget peak {format_bytes(peak)}, compute {first.baseline_compute / 1e6:.4g} ms, "
        f"memory lower bound {format_bytes(bound)} = {bound / peak:.3f} x peak"
    )
    if bounds is None:
        rows.append(("bound", ["infeasible" if int(peak * x) < bound else "" for x in ratios]))
    else:
        rows.append(("bound", [_bound_cell(bounds, x) for x in ratios]))
        below = math.floor(bounds.infeasible_below * 1e4) / 1e4  # rounded down: never claims more than proven
        title += f"; memory and recompute bounds: every ratio below {below:.4f} is infeasible"
    header = ["heuristic", *[f"{x:g}" for x in ratios]]
    if markdown:
        lines = [f"**{title}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join([name, *cells]) + " |" for name, cells in rows]
        return "\n".join(lines)
    width = max(len(header[0]), *(len(name) for name, _ in rows))
    cell_width = max(7, *(len(c) for _, cells in rows for c in cells))
    lines = [title, "  " + header[0].ljust(width) + "".join(h.rjust(cell_width + 1) for h in header[1:])]
    lines += ["  " + name.ljust(width) + "".join(c.rjust(cell_width + 1) for c in cells) for name, cells in rows]
    return "\n".join(lines)
