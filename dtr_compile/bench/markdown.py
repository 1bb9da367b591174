"""The one report writer of the suites: Markdown tables, sizes in MiB, and the fragment written to a file.

The grid's CSV and BENCHMARKS section live in report.py; the suites (runtime overhead, compiled, kernels,
handoff) print Markdown fragments that are pasted into BENCHMARKS.md, and they build them from these helpers so
that every table has the same shape (`| a | b |` rows under a `|---|---|` rule).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

MiB = 2**20


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A Markdown table: the header, the rule, one line per row (cells as given, `str()`-ed)."""
    return [row(header), "|" + "---|" * len(header)] + [row(cells) for cells in rows]


def row(cells: Sequence[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def mib_or_kib(n: float) -> str:
    """MiB from 10 MiB up, KiB below (the kernels' smoke sizes are kilobytes)."""
    return f"{n / MiB:.1f} MiB" if n >= 10 * MiB else f"{n / 2**10:.1f} KiB"


def write(path: str | None, text: str) -> None:
    """Write a fragment to `path` (nothing for None or '-') and say so on stderr."""
    if path in (None, "-"):
        return
    with open(path, "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")
    print(f"wrote {path}", file=sys.stderr)
