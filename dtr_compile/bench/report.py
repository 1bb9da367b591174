"""Results on disk: `results.csv` (one row per run), a markdown table, and a BENCHMARKS.md section.

Everything here reads rows or `results.csv`, never reruns anything, so the table, the plot and the section
can be regenerated from a results directory:

    python -m dtr_compile.bench.report bench-out/ [--section benchmarks/bench.md] [--into BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .methods import METHODS

# The CSV's columns, in order. Ratios are against plain eager on the same model, size and device.
#   budget: the grid's fraction (empty for eager/checkpoint); budget_bytes: fraction x eager's measured peak
#   status: one of spec.STATUSES, with `reason` when not "ok" (or when gradients differ)
#   peak_bytes: measured peak above the step's start (dtr_compile.measure); within_budget: peak <= budget_bytes
#   step_s / step_cpu_s: median wall / process-CPU seconds of the timed steps; clock: which one time_ratio uses
#   first_step_s: the first warm-up step (wall); compile_s: its excess over step_s, for compiled methods
#   loss_err, grad_err: relative errors against eager's loss and gradients; correct: both within tolerance
#   runtime_stats: the eager runtime's rt.stats() of the measured step, as JSON
COLUMNS = (
    "model", "size", "description", "method", "budget", "budget_bytes", "status", "reason",
    "peak_bytes", "baseline_peak_bytes", "peak_ratio", "within_budget",
    "step_s", "step_cpu_s", "baseline_step_s", "clock", "time_ratio", "first_step_s", "compile_s",
    "loss", "loss_err", "grad_err", "correct",
    "device", "device_name", "threads", "warmup", "steps", "torch_version", "wall_s", "runtime_stats",
)  # fmt: skip

RUN_INFO = "run.json"  # command line, wall time and date of the run that wrote a results directory


def write_csv(rows: Iterable[dict[str, Any]], path: Path, columns: Sequence[str] = COLUMNS) -> None:
    """The rows as a CSV of `columns` (the grid's results by default; the frontier names its own): floats to six
    significant digits, None as an empty cell, what `read_csv` parses back."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            flat = dict(row)
            if "runtime_stats" in flat and not isinstance(flat["runtime_stats"], str):
                flat["runtime_stats"] = json.dumps(flat["runtime_stats"], sort_keys=True)
            writer.writerow({k: _cell(flat.get(k)) for k in columns})


def read_csv(path: Path) -> list[dict[str, Any]]:
    """Rows of a results.csv with numbers, booleans and empty cells (None) parsed back."""
    with open(path, newline="") as f:
        return [{k: _parse(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


def _parse(text: str) -> Any:
    if text == "":
        return None
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


# ------------------------------------------------------------------------------------------ markdown


_HEADER = "| method | budget | status | peak MiB | peak ÷ eager | step ms | time ÷ eager | compile s | correct |"


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """One table per model: every run with its measured peak and step time against plain eager."""
    out: list[str] = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        shape = next((r["description"] for r in mine if r.get("description")), "")
        out.append(f"**{model}** ({mine[0]['size']}{': ' + shape if shape else ''})\n")
        out.append(_HEADER)
        out.append("|---|---|---|---:|---:|---:|---:|---:|---|")
        out.extend(_table_line(r) for r in mine)
        out.append("")
    return "\n".join(out)


def _table_line(r: dict[str, Any]) -> str:
    method = METHODS[r["method"]].label if r["method"] in METHODS else r["method"]
    ok = r["status"] == "ok"
    status = r["status"] if ok else f"{r['status']}: {_short(r.get('reason'))}"
    cells = [
        method,
        _budget_text(r),
        status,
        _num(r.get("peak_bytes"), 2**-20, "{:.1f}") if ok else "",
        _num(r.get("peak_ratio"), 1, "{:.2f}") if ok else "",
        _num(r.get("step_cpu_s" if r.get("clock") == "cpu" else "step_s"), 1e3, "{:.1f}") if ok else "",
        _num(r.get("time_ratio"), 1, "{:.2f}") if ok else "",
        _num(r.get("compile_s"), 1, "{:.1f}") if ok else "",
        _correct_text(r) if ok else "",
    ]
    return "| " + " | ".join(cells) + " |"


def _budget_text(r: dict[str, Any]) -> str:
    if r.get("budget") is None:
        return "—"
    if r["method"].startswith("amb_"):
        return f"knob {r['budget']:g}"
    text = f"{r['budget']:g}"
    if r.get("budget_bytes"):
        text += f" ({r['budget_bytes'] / 2**20:.1f} MiB"
        if r.get("within_budget") is not None:
            text += ", met" if r["within_budget"] else ", exceeded"
        text += ")"
    return text


def _correct_text(r: dict[str, Any]) -> str:
    if r.get("correct") is None:
        return "—"
    err = r.get("grad_err")
    suffix = f" ({err:.0e})" if isinstance(err, float) and err > 0 else ""
    return ("yes" if r["correct"] else "**NO**") + suffix


def _num(value: Any, scale: float, fmt: str) -> str:
    return "" if value is None else fmt.format(value * scale)


def _short(text: Any, limit: int = 90) -> str:
    text = " ".join(str(text or "").split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _clock_text(rows: Sequence[dict[str, Any]]) -> str:
    clock = next((r["clock"] for r in rows if r.get("clock")), "wall")
    return "CPU time of the process (one thread; robust to other load)" if clock == "cpu" else "wall time"


def _load_text(info: dict[str, Any]) -> str:
    loads = info.get("load_average") or []
    if len(loads) != 2 or None in loads:
        return ""
    return f", 1-min load average {loads[0]:.1f} at the start and {loads[1]:.1f} at the end"


def benchmarks_section(rows: Sequence[dict[str, Any]], info: dict[str, Any], plot: str | None = None) -> str:
    """A BENCHMARKS.md section: on which machine, with which command, then the table (and the plot)."""
    first = rows[0] if rows else {}
    device = str(first.get("device", "cpu")).upper()
    machine = f"{first.get('device_name', 'unknown machine')}, {first.get('threads')} thread(s)"
    cache = "cold" if info.get("fresh_cache") else "warm"
    sentences = [
        (
            f"Taken on {machine}, torch {first.get('torch_version', '?')}, {info.get('date', '?')}, with "
            f"`{info.get('command', 'python -m dtr_compile.bench')}` ({info.get('wall_s', 0) / 60:.1f} min wall time"
            f"{_load_text(info)})."
        ),
        (
            "Peak = measured peak above the step's start (profiler allocation events on CPU, "
            "`torch.cuda.max_memory_allocated` on CUDA)."
        ),
        (
            f"Step = median {_clock_text(rows)} of {first.get('steps', '?')} steps after {first.get('warmup', '?')} "
            f"warm-up steps, {info.get('jobs', 1)} run(s) at once; compile = first step's time minus the median "
            f"({cache} Inductor cache)."
        ),
        (
            "Budgets are fractions of plain eager's measured peak (DTR methods get them in bytes; "
            "`activation_memory_budget` gets the fraction as its own knob)."
        ),
        "Correct = loss and gradients equal to plain eager's (dropout off).",
    ]
    notes = " ".join(sentences)
    lines = [f"### {device}: {machine}", "", notes, "", markdown_table(rows)]
    if plot:
        lines += [f"![Pareto: peak against step time, {device}]({plot})", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ command line


def update_between_markers(path: Path, text: str, device: str) -> None:
    """Put `text` in `path` between `<!-- bench:DEVICE:start -->` and `<!-- bench:DEVICE:end -->`.

    The markers are appended when absent, so BENCHMARKS.md can hold a CPU and a CUDA section side by side and
    each is regenerated from its own results.csv without touching the rest of the file.
    """
    start, end = f"<!-- bench:{device}:start -->", f"<!-- bench:{device}:end -->"
    old = path.read_text() if path.exists() else ""
    block = f"{start}\n{text.rstrip()}\n{end}"
    if start in old and end in old and old.index(start) < old.index(end):
        new = old[: old.index(start)] + block + old[old.index(end) + len(end) :]
    else:
        new = (old.rstrip() + "\n\n" if old.strip() else "") + block + "\n"
    path.write_text(new)


def regenerate(
    out_dir: Path, section: Path | None = None, plot_link: str | None = None, into: Path | None = None
) -> None:
    """Rewrite results.md, pareto.png and section.md from `out_dir/results.csv`.

    `section`: also write the section to that file; `into`: also put it between this device's markers in
    that file (see `update_between_markers`).
    """
    from .plot import pareto_plot

    rows = read_csv(out_dir / "results.csv")
    info_path = out_dir / RUN_INFO
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    (out_dir / "results.md").write_text(markdown_table(rows))
    pareto_plot(rows, out_dir / "pareto.png")
    text = benchmarks_section(rows, info, plot=plot_link or "pareto.png")
    (out_dir / "section.md").write_text(text)
    if section is not None:
        section.write_text(text)
    if into is not None and rows:
        update_between_markers(into, text, str(rows[0].get("device", "cpu")).split(":")[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtr_compile.bench.report", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="a results directory written by `python -m dtr_compile.bench`")
    parser.add_argument("--section", type=Path, help="also write the BENCHMARKS.md section to this file")
    parser.add_argument("--into", type=Path,
                        help="also put the section into this file (e.g. BENCHMARKS.md) between "
                        "<!-- bench:cpu:start/end --> markers (cuda: bench:cuda), appended if absent")  # fmt: skip
    parser.add_argument("--plot-link", help="how the section links the plot (default: pareto.png)")
    args = parser.parse_args(argv)
    if not (args.out_dir / "results.csv").exists():
        parser.error(f"{args.out_dir}/results.csv does not exist; run `python -m dtr_compile.bench --out DIR` first")
    regenerate(args.out_dir, args.section, args.plot_link, args.into)
    return 0


if __name__ == "__main__":
    sys.exit(main())
