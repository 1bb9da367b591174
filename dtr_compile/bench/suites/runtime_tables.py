"""The runtime-overhead suite's tables: the side-by-side overhead of the runtime, and its memory check."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..markdown import MiB, table


@dataclass
class WayResult:
    label: str
    budget_bytes: int | None
    median_s: float
    times: list[float]
    median_cpu_s: float  # process CPU time: steadier than wall time when other processes share the machine
    peak_bytes: int
    losses_equal: bool
    per_step: dict[str, float]  # runtime counters per timed step


OVERHEAD_HEADER = ("way", "median step", "x eager", "CPU time x eager", "measured peak", "peak / budget",
                   "evictions / step", "remats / step", "remat time / step", "search time / step", "GC time / step",
                   "losses = eager")  # fmt: skip


def overhead_table(peak: int, results: list[WayResult]) -> list[str]:
    eager = results[0]

    def cells(r: WayResult) -> list[str]:
        def counter(key: str, scale: float = 1.0, unit: str = "") -> str:
            return "-" if key not in r.per_step else f"{r.per_step[key] * scale:.{0 if not unit else 1}f}{unit}"

        ratio = "-" if r.budget_bytes is None else f"{r.peak_bytes / r.budget_bytes:.3f}"
        return [r.label, f"{r.median_s * 1e3:.0f} ms", f"{r.median_s / eager.median_s:.3f}",
                f"{r.median_cpu_s / eager.median_cpu_s:.3f}", f"{r.peak_bytes / MiB:.1f} MiB", ratio,
                counter("evictions"), counter("remats"), counter("remat_s", 1e3, " ms"),
                counter("search_s", 1e3, " ms"), counter("gc_s", 1e3, " ms"), "yes" if r.losses_equal else "NO"]  # fmt: skip

    every_round = "; ".join(f"{r.label}: " + ", ".join(f"{t * 1e3:.0f}" for t in r.times) for r in results)
    return table(OVERHEAD_HEADER, (cells(r) for r in results)) + [
        "",
        f"No-remat measured peak {peak / MiB:.1f} MiB. Step times of every round (ms): {every_round}",
    ]


MEMORY_HEADER = ("budget", "budget bytes", "measured peak", "peak / budget", "evictions", "remats", "remat time",
                 "step x eager")  # fmt: skip


def memory_table(name: str, peak: int, eager_s: float, rows: list[dict[str, Any]]) -> list[str]:
    def cells(row: dict[str, Any]) -> list[Any]:
        head = [row["fraction"], f"{row['budget'] / MiB:.1f} MiB"]
        if "error" in row:
            return [*head, row["error"], "", "", "", "", ""]
        return [*head, f"{row['peak'] / MiB:.1f} MiB", f"{row['peak'] / row['budget']:.3f}", row["evictions"],
                row["remats"], f"{row['remat_s'] * 1e3:.0f} ms", f"{row['time_ratio']:.2f}"]  # fmt: skip

    title = f"**{name}** — no-remat measured peak {peak / MiB:.1f} MiB, eager step {eager_s * 1e3:.0f} ms"
    return [title, "", *table(MEMORY_HEADER, (cells(r) for r in rows)), ""]
