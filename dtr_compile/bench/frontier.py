"""`python -m dtr_compile.bench --frontier`: issue 17's memory/time frontier against torch.compile, in one command.

    python -m dtr_compile.bench --frontier --size small --models gpt2 --dtypes fp32   # the CPU stand-in
    python -m dtr_compile.bench --frontier                                           # CUDA: GPT-2 124M shape

Every method runs on the same model, batch and dtype, each in a fresh child process of the harness
(runner.py), with warm-up steps excluded and the median of the timed steps reported. The reference point
of every ratio, byte budget and gradient comparison is `torch.compile(model)` (Inductor, no
rematerialization), because that is what a user runs when memory is not the problem. Compared with it:
HF per-block checkpointing + compile, selective activation checkpointing (save matmuls) + compile,
PyTorch's knob `activation_memory_budget` under Inductor, `backend="dtr"` (Inductor) with no budget and at
absolute byte budgets (fractions of torch.compile's measured peak), and the eager DTR runtime.

Writes into --out: frontier.csv (one row per model x dtype x method x budget), frontier.md (the tables),
frontier.png (the Pareto plot: measured peak against step time, every method), run.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..measure import add_device_argument, device_from_args
from .grid import Grid
from .methods import METHODS
from .report import read_csv, write_csv
from .runner import run_grid

BASELINE = "compile"
FRONTIER_METHODS = ("compile", "hf_ckpt_compile", "sac_compile", "amb_inductor", "dtr_inductor", "dtr_eager")
MODELS = ("gpt2", "llama")  # the default
# Llama fine-tuned with LoRA adapters on every block's linear layers (bench/models.with_lora), its weights frozen
OPTIONAL_MODELS = ("llama_lora",)
DTYPES = ("fp32", "bf16")
# --size -> the models' size key: "small" is the CPU stand-in (8 x 256, seq 256, vocab 2048, batch 4), "full"
# GPT-2 124M's shape (12 x 768, seq 1024, vocab 8192, batch 8), "tiny" is for tests.
SIZES = {"tiny": "tiny", "small": "small", "full": "124m"}
KNOB = (0.5, 0.3, 0.1, 0.0)  # activation_memory_budget values (its own meaning: a fraction of saved bytes)
# backend="dtr" budgets as fractions of torch.compile's measured peak, from 1.0 to below per-block
# checkpointing's measured peak (0.28 on the CPU stand-in, 0.12 at 124M on an H100: issue 17).
DTR_BUDGETS = (1.0, 0.75, 0.5, 0.35, 0.25, 0.15, 0.1)
EAGER_BUDGETS = (0.5, 0.3)
# Equal-memory comparisons: backend="dtr" runs again at each peer's measured peak (x these multiples), in one
# process with the peer (steps interleaved), and issue 17's targets for its step time over the peer's there.
MATCH_PEERS = {"hf_ckpt_compile": (1.0, 2.0), "sac_compile": (1.0,), "amb_inductor": (1.0,)}
TARGETS = {("hf_ckpt_compile", 1.0): 1.00, ("hf_ckpt_compile", 2.0): 0.92, ("sac_compile", 1.0): 1.00,
           ("amb_inductor", 1.0): 0.95}  # fmt: skip

# The CSV's columns. Ratios are against torch.compile's row of the same model and dtype.
#   budget: fraction of torch.compile's measured peak (DTR methods; given to them as budget_bytes) or the
#     knob's own value (amb_inductor; budget_bytes empty); empty for budget-free methods and "no budget"
#   floor_bytes: the smallest feasible budget a BudgetError named (status "infeasible"); the frontier then runs
#     that method once more at the named floor (at_named_floor: True), to show that the floor it names runs
#   measured_over_budget: peak_bytes / budget_bytes; first_call_s: wall time of the first step (compiles)
#   grads_equal: loss and gradients equal to torch.compile's (fp32 rounding; bf16 rounding under autocast)
#   matched_to, matched_budget, matched_multiple: a backend="dtr" run at that peer run's measured peak x multiple,
#     the peer running in the same process, steps interleaved; peer_step_s, peer_peak_bytes: the peer's there;
#     peer_time_ratio, peer_peak_ratio: the matched run's step time and peak over the peer's; target_time_ratio:
#     issue 17's bound on peer_time_ratio
#   plan: backend="dtr"'s plan per compiled region (passes/running_plans.summary): block options, modelled recompute
#     time, planned and measured peaks, the ops it recomputes most
COLUMNS = (
    "model", "dtype", "size", "description", "method", "label", "budget", "budget_bytes", "status", "reason",
    "floor_bytes", "peak_bytes", "peak_ratio", "step_s", "time_ratio", "clock", "first_call_s",
    "measured_over_budget", "grads_equal", "grad_err", "loss_err", "device", "device_name", "torch_version",
    "threads", "warmup", "steps", "at_named_floor", "matched_to", "matched_budget", "matched_multiple",
    "peer_step_s", "peer_peak_bytes", "peer_time_ratio", "peer_peak_ratio", "target_time_ratio", "plan",
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dtr_compile.bench --frontier",
        description="Issue 17's frontier: every memory-saving method against torch.compile, side by side.",
    )
    p.add_argument("--frontier", action="store_true", help="this mode (accepted for the command line's sake)")
    p.add_argument("--size", choices=tuple(SIZES), help="tiny (tests), small (CPU stand-in), full (GPU; GPT-2 "
                   "124M shape); default: full on CUDA, small on CPU")  # fmt: skip
    p.add_argument("--models", nargs="+", choices=MODELS + OPTIONAL_MODELS, default=list(MODELS))
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES),
                   help="fp32, and/or bf16 under torch.autocast (on CPU too)")  # fmt: skip
    p.add_argument("--methods", nargs="+", choices=FRONTIER_METHODS, default=list(FRONTIER_METHODS),
                   help="torch.compile always runs: it is the reference of every ratio")  # fmt: skip
    p.add_argument("--knob", nargs="+", type=float, default=list(KNOB), help="activation_memory_budget values")
    p.add_argument("--dtr-budgets", nargs="*", type=float, default=list(DTR_BUDGETS),
                   help='backend="dtr" budgets, fractions of torch.compile\'s measured peak (no budget always runs; '
                   "none given: only no budget and the equal-memory runs)")  # fmt: skip
    p.add_argument("--eager-budgets", nargs="+", type=float, default=list(EAGER_BUDGETS),
                   help="eager DTR runtime budgets, fractions of torch.compile's measured peak")  # fmt: skip
    add_device_argument(p)
    p.add_argument("--threads", type=int, default=1, help="torch threads in every run (default: 1)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps, the first compiles (default: 2)")
    p.add_argument("--steps", type=int, default=5, help="timed steps, >= 3; the median is reported (default: 5)")
    p.add_argument("--clock", choices=("wall", "cpu"),
                   help="step time: wall, or process CPU time (steady on a shared CPU; needs --threads 1); "
                   "default: cpu on CPU with one thread, else wall")  # fmt: skip
    p.add_argument("--no-match", action="store_true",
                   help='skip the equal-memory runs (backend="dtr" at each peer\'s measured peak, in one process '
                   "with the peer)")  # fmt: skip
    p.add_argument("--jobs", type=int, default=1, help="runs at once (default: 1)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before a run is killed (default: 1800)")
    p.add_argument("--fresh-cache", action="store_true", help="empty Inductor caches in every run (cold compiles)")
    p.add_argument("--out", type=Path, default=Path("bench-frontier"), help="output directory")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rewrite frontier.md and frontier.png from --out's frontier.csv (e.g. the "
                   "rows an interrupted run saved)")  # fmt: skip
    return p


def parse(argv: Sequence[str] | None = None) -> tuple[Grid, argparse.Namespace]:
    """The frontier's grid from the command line; bad input exits with what to change."""
    parser = build_parser()
    args = parser.parse_args(argv)
    device = device_from_args(parser, args.device)
    args.device = str(device)
    size = args.size or ("full" if args.device.startswith("cuda") else "small")
    for flag, values, low in (("--knob", args.knob, 0.0), ("--dtr-budgets", args.dtr_budgets, 1e-9),
                              ("--eager-budgets", args.eager_budgets, 1e-9)):  # fmt: skip
        bad = [v for v in values if not low <= v <= 1.0]
        if bad:
            parser.error(f"{flag}: {bad[0]:g} is outside [{low:g}, 1]; give fractions")
    if args.threads < 1 or args.jobs < 1 or args.warmup < 1 or args.steps < 3:
        parser.error("--threads, --jobs and --warmup must be >= 1 and --steps >= 3")
    clock = args.clock or ("cpu" if args.device == "cpu" and args.threads == 1 else "wall")
    if clock == "cpu" and (args.threads != 1 or args.device != "cpu"):
        parser.error("--clock cpu: needs --device cpu and --threads 1 (CPU time sums threads, misses GPU work)")
    methods = tuple(dict.fromkeys((BASELINE, *args.methods)))
    keys = [m if d == "fp32" else f"{m}+{d}" for m in args.models for d in args.dtypes]
    down = sorted(set(args.dtr_budgets), reverse=True)
    grid = Grid(
        models=keys, methods=methods, budgets=(), size=SIZES[size], device=args.device, threads=args.threads,
        warmup=args.warmup, steps=args.steps, timeout_s=args.timeout, jobs=args.jobs, clock=clock,
        fresh_cache=args.fresh_cache, baseline=BASELINE, retry_at_floor=("dtr_inductor", "dtr_eager"),
        match_method=None if args.no_match or "dtr_inductor" not in methods else "dtr_inductor",
        match_peers={peer: multiples for peer, multiples in MATCH_PEERS.items() if peer in methods},
        only_budgets={
            "amb_inductor": sorted(set(args.knob), reverse=True),
            "dtr_inductor": [None, *down],  # None: backend="dtr" with no budget
            "dtr_eager": sorted(set(args.eager_budgets), reverse=True),
        },
    )  # fmt: skip
    return grid, args


def frontier_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The harness's rows in the frontier's columns (knob rows carry no byte budget: the knob has its own)."""
    out = []
    for r in rows:
        row = {k: r.get(k) for k in COLUMNS}
        row["label"] = METHODS[r["method"]].label
        row["first_call_s"] = r.get("first_step_s")
        row["grads_equal"] = r.get("correct")
        if r["method"] == BASELINE and r.get("status") == "ok":
            row["peak_ratio"], row["time_ratio"] = 1.0, 1.0
        if r["method"] == "amb_inductor":
            row["budget_bytes"] = None
        elif row.get("budget_bytes") and r.get("status") == "ok" and r.get("peak_bytes") is not None:
            row["measured_over_budget"] = r["peak_bytes"] / row["budget_bytes"]
        if r.get("clock") == "cpu" and r.get("step_cpu_s") is not None:
            row["step_s"] = r["step_cpu_s"]
        if r.get("matched_to"):
            row["target_time_ratio"] = TARGETS.get((r["matched_to"], r["matched_multiple"]))
        out.append(row)
    return out


def _num(value: Any, fmt: str, scale: float = 1.0) -> str:
    return "" if value is None else fmt.format(value * scale)


def _peer_text(r: dict[str, Any]) -> str:
    """ "checkpointing's peak x2", "knob 0.5's peak": which memory level a matched run was planned for."""
    short = {"hf_ckpt_compile": "checkpointing", "sac_compile": "selective checkpointing", "amb_inductor": "knob"}
    peer = short.get(r["matched_to"], r["matched_to"])
    peer += f" {r['matched_budget']:g}" if r["matched_to"] == "amb_inductor" else ""
    multiple = float(r["matched_multiple"])
    return f"{peer}'s peak" + ("" if multiple == 1.0 else f" x{multiple:g}")


def _budget_text(r: dict[str, Any]) -> str:
    if r.get("matched_to"):
        return f"{r['budget_bytes'] / 2**20:.1f} MiB = {_peer_text(r)}"
    if r["method"] == "amb_inductor":
        return f"knob {r['budget']:g}"
    if r["budget"] is None:
        return "no budget" if r["method"] in ("dtr_inductor", "dtr_eager") else "—"
    text = f"{r['budget']:.3g} ({r['budget_bytes'] / 2**20:.1f} MiB)" if r.get("budget_bytes") else f"{r['budget']:g}"
    return text + (", the named floor" if r.get("at_named_floor") in (True, "True") else "")


_HEADER = "| method | budget | peak ÷ compile | time ÷ compile | peak MiB | first call s | peak ÷ budget | grads equal | status |"


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """One table per (model, dtype): peak and step time against torch.compile's, first call, budget use."""
    out: list[str] = []
    for model, dtype in dict.fromkeys((r["model"], r["dtype"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["dtype"]) == (model, dtype)]
        ref = next((r for r in mine if r["method"] == BASELINE and r["status"] == "ok"), None)
        shape = next((r["description"] for r in mine if r.get("description")), "")
        head = f"**{model}, {dtype}** ({shape})"
        if ref:
            head += f": torch.compile {ref['peak_bytes'] / 2**20:.1f} MiB, {ref['step_s'] * 1e3:.1f} ms a step"
        out += [head, "", _HEADER, "|---|---|---:|---:|---:|---:|---:|---|---|"]
        for r in mine:
            ok = r["status"] == "ok"
            status = "ok" if ok else f"{r['status']}: {' '.join(str(r.get('reason') or '').split())[:90]}"
            if r.get("floor_bytes"):
                status += f" (floor {r['floor_bytes'] / 2**20:.1f} MiB)"
            cells = [
                r["label"], _budget_text(r), _num(r.get("peak_ratio"), "{:.3f}"), _num(r.get("time_ratio"), "{:.3f}"),
                _num(r.get("peak_bytes"), "{:.1f}", 2**-20), _num(r.get("first_call_s"), "{:.1f}"),
                _num(r.get("measured_over_budget"), "{:.3f}"),
                "" if r.get("grads_equal") is None else ("yes" if r["grads_equal"] else "**NO**"),
                status.replace("|", "\\|"),
            ]  # fmt: skip
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
        out += _matched_table(mine)
    return "\n".join(out)


_MATCHED_HEADER = (
    "| memory level | budget MiB | peak MiB | peer's peak MiB | peak ÷ peer's | peer's step | time ÷ peer's | target | met |"
)


def _matched_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """backend="dtr" at each peer's measured peak: its step time over the peer's, measured beside it."""
    matched = [r for r in rows if r.get("matched_to")]
    if not matched:
        return []
    intro = ("Equal memory: backend=\"dtr\" planned for each peer's measured peak, run in one process with the peer "
             "(steps interleaved); both peaks and step times from that process.")
    out = [intro, "", _MATCHED_HEADER, "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in matched:
        ratio, target = r.get("peer_time_ratio"), r.get("target_time_ratio")
        met = "" if ratio is None or target is None else ("yes" if ratio <= target else "**no**")
        if r["status"] != "ok":
            met = r["status"]
        cells = [
            _peer_text(r), _num(r.get("budget_bytes"), "{:.1f}", 2**-20), _num(r.get("peak_bytes"), "{:.1f}", 2**-20),
            _num(r.get("peer_peak_bytes"), "{:.1f}", 2**-20), _num(r.get("peer_peak_ratio"), "{:.3f}"),
            _num(r.get("peer_step_s"), "{:.1f} ms", 1e3),
            _num(ratio, "{:.3f}"), _num(target, "≤ {:.2f}"), met,
        ]  # fmt: skip
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    return out


def pareto_plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Peak ÷ torch.compile's (x) against step time ÷ torch.compile's (y), a panel per (model, dtype)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["model"], r["dtype"]) for r in rows)) or [("", "")]
    cols = min(2, len(panels))
    fig, axes = plt.subplots((len(panels) + cols - 1) // cols, cols, figsize=(6.5 * cols, 5.5), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (model, dtype) in zip(axes.flat, panels):
        for i, method in enumerate(FRONTIER_METHODS):
            pts = [r for r in rows if (r["model"], r["dtype"], r["method"]) == (model, dtype, method)
                   and r["status"] == "ok" and r.get("peak_ratio") is not None]  # fmt: skip
            if not pts:
                continue
            pts.sort(key=lambda r: -(1.5 if r["budget"] is None else r["budget"]))
            xs, ys = [r["peak_ratio"] for r in pts], [r["time_ratio"] for r in pts]
            ax.plot(xs, ys, marker="o^sDvP"[i], color=f"C{i}", label=METHODS[method].label)
            wrong = [(x, y) for x, y, r in zip(xs, ys, pts) if r.get("grads_equal") is False]
            if wrong:
                ax.scatter(*zip(*wrong), s=120, facecolors="none", edgecolors="red", zorder=3)
        ax.set_title(f"{model}, {dtype}")
        ax.set_xlabel("measured peak ÷ torch.compile's")
        ax.set_ylabel("step time ÷ torch.compile's")
        ax.axvline(1.0, color="grey", linewidth=0.5)
        ax.axhline(1.0, color="grey", linewidth=0.5)
        ax.set_xlim(0, max(1.1, ax.get_xlim()[1]))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)  # below: never on a point
    device = rows[0].get("device_name", "") if rows else ""
    fig.suptitle(f"Frontier (issue 17): lower-left is better; red ring = gradients differ\n{device}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report_only(out: Path) -> str:
    """Rewrite frontier.md and frontier.png from out/frontier.csv; returns the table."""
    if not (out / "frontier.csv").exists():
        raise SystemExit(f"{out}/frontier.csv does not exist; run `python -m dtr_compile.bench --frontier --out {out}`")
    rows = read_csv(out / "frontier.csv")
    for r in rows:  # read_csv parses "0" as a number; model and dtype stay text
        r["dtype"] = str(r["dtype"])
    table = markdown_table(rows)
    (out / "frontier.md").write_text(table)
    pareto_plot(rows, out / "frontier.png")
    return table


def main(argv: Sequence[str] | None = None) -> int:
    grid, args = parse(argv)
    out: Path = args.out
    if args.report_only:
        print(report_only(out))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m dtr_compile.bench " + shlex.join(sys.argv[1:] if argv is None else ["--frontier", *argv])
    print(f"dtr_compile.bench --frontier: {len(grid.plan())} runs, size {grid.size}, {grid.device} -> {out}/",
          file=sys.stderr)  # fmt: skip
    start = time.perf_counter()

    def save(partial: list[dict]) -> None:  # after every run: an interrupted frontier keeps its rows
        rows = frontier_rows(partial)
        write_csv(rows, out / "frontier.csv", COLUMNS)
        (out / "frontier.md").write_text(markdown_table(rows))

    with tempfile.TemporaryDirectory(prefix="dtr-frontier-") as workdir:
        rows = frontier_rows(run_grid(grid, Path(workdir), on_row=save))
    info = {
        "command": command, "wall_s": round(time.perf_counter() - start, 1),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "clock": grid.clock,
    }  # fmt: skip
    (out / "run.json").write_text(json.dumps(info, indent=2))
    write_csv(rows, out / "frontier.csv", COLUMNS)
    table = markdown_table(rows)
    (out / "frontier.md").write_text(table)
    pareto_plot(rows, out / "frontier.png")
    print("\n" + table)
    print(f"wrote {out}/frontier.csv, frontier.md, frontier.png ({info['wall_s'] / 60:.1f} min)", file=sys.stderr)
    return 0
