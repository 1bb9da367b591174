"""The Pareto plot: measured peak ÷ eager peak (x) against step time ÷ eager step time (y).

One panel per model, one line per method through its budgets. Lower-left is better; plain eager sits at
(1, 1). Only runs with status "ok" are drawn; a wrong-gradient run is drawn hollow so it cannot pass for a
good point.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .methods import METHODS

_MARKERS = "o^sDvP*Xh"


def pareto_plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Write the plot of `rows` (results.csv rows) to `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on benchmark machines
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    clock = "CPU " if any(r.get("clock") == "cpu" for r in rows) else ""
    cols = min(3, max(1, len(models)))
    nrows = math.ceil(len(models) / cols) if models else 1
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 4 * nrows), squeeze=False)
    for ax in axes.flat[len(models) :]:
        ax.set_visible(False)
    for ax, model in zip(axes.flat, models):
        for i, method in enumerate(METHODS):  # index in METHODS: the same colour and marker in every panel
            points = [
                r for r in rows
                if r["model"] == model and r["method"] == method and r["status"] == "ok" and r.get("peak_ratio")
            ]  # fmt: skip
            if not points:
                continue
            points.sort(key=lambda r: -(r.get("budget") or 1.0))
            xs = [r["peak_ratio"] for r in points]
            ys = [r["time_ratio"] for r in points]
            ax.plot(xs, ys, marker=_MARKERS[i % len(_MARKERS)], color=f"C{i}", label=METHODS[method].label)
            wrong = [(x, y) for x, y, r in zip(xs, ys, points) if r.get("correct") is False]
            if wrong:
                ax.scatter(*zip(*wrong), s=120, facecolors="none", edgecolors="red", zorder=3)
        size = next(r["size"] for r in rows if r["model"] == model)
        ax.set_title(f"{model} ({size})")
        ax.set_xlabel("measured peak ÷ eager peak")
        ax.set_ylabel(f"step {clock}time ÷ eager's")
        ax.axvline(1.0, color="grey", linewidth=0.5)
        ax.axhline(1.0, color="grey", linewidth=0.5)
        ax.set_xlim(0, max(1.1, ax.get_xlim()[1]))  # from zero: the reduction reads at its true size
        ax.set_ylim(0, max(1.5, ax.get_ylim()[1]))
        ax.grid(True, alpha=0.3)
    handles, labels = {}, {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
            labels[lab] = lab
    device = rows[0].get("device_name", "") if rows else ""
    fig.suptitle(f"Memory against time, one line per method (red ring: wrong gradients)\n{device}", fontsize=10)
    fig.legend(list(handles.values()), list(labels), loc="lower center", ncol=min(4, len(labels) or 1), fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
