"""`python -m dtr_compile.sim LOG [LOG ...] --ratios 0.2,0.3 --heuristic NAME [--json]`.

Replays each log once with no budget (the baseline: peak memory and compute), then at each ratio of
that peak, with each heuristic given, and prints one table per log or, with --json, one JSON object per
(log, ratio, heuristic) line. Per log it also computes the lower bounds of bounds.py (memory, and the least
recompute any policy needs), shown in the table's `bound` row and in the JSON fields min_recompute,
proven_infeasible and infeasible_below.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import NoReturn

from .. import config
from ..engine.heuristics import HEURISTICS
from ..errors import DTRError
from ..oplog.format import parse_log
from .bounds import LogBounds, log_bounds
from .reference import load_reference
from .replay import ReplayOptions, ReplayResult, baseline, replay
from .report import json_lines, tables
from .schedule import build_schedule

DEFAULT_RATIOS = "0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0"


class _Parser(argparse.ArgumentParser):
    """argparse with the command's own error shape: one line on stderr, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see python -m dtr_compile.sim --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m dtr_compile.sim",
        description="Replay operation logs (.log or .log.gz) through the eviction engine under memory budgets.",
    )
    parser.add_argument("logs", nargs="+", metavar="LOG", help="operation log files (.log or .log.gz)")
    parser.add_argument(
        "--ratios",
        default=DEFAULT_RATIOS,
        help=f"budgets as fractions of the no-budget peak (default {DEFAULT_RATIOS})",
    )
    parser.add_argument(
        "--heuristic",
        default=config.heuristic,
        help=f"comma-separated heuristics, from {', '.join(sorted(HEURISTICS))} (default {config.heuristic})",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per line instead of tables")
    parser.add_argument("--markdown", action="store_true", help="Markdown tables (for BENCHMARKS.md)")
    parser.add_argument(
        "--reference",
        metavar="MD",
        action="append",
        help="reference-simrd.md of the DTR authors' simulator, printed beside ours (needs manifest.json beside "
        "it); give it again for more files of the same format, e.g. benchmarks/reference-simrd-fine.md",
    )
    parser.add_argument(
        "--sampling", default="all", help="candidates scored per eviction: all (default, as the reference), sqrt, or N"
    )
    parser.add_argument(
        "--min-evictable-fraction",
        default="0",
        help="never evict storages below this fraction of the mean resident size (default 0, as the reference)",
    )
    parser.add_argument(
        "--views",
        choices=("rerun", "free"),
        default="rerun",
        help="rerun (default, as the reference): a view used after its storage's eviction is re-run, at its "
        "logged time; free: a view is only a handle on its storage",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of candidate sampling and the random heuristic")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="parallel processes")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        ratios = _ratios(args.ratios)
        heuristics = _heuristics(args.heuristic)
        sampling = args.sampling if args.sampling in ("all", "sqrt") else _positive_int(args.sampling, "--sampling")
        min_fraction = _flag("--min-evictable-fraction", "min_evictable_fraction", _number(args.min_evictable_fraction))
        seed = _flag("--seed", "random_seed", args.seed)
        reference = load_reference(args.reference) if args.reference else None
        jobs = [
            (
                log,
                ratios,
                ReplayOptions(h, sampling, min_fraction, seed=seed, charge_views=args.views == "rerun"),
            )
            for log in args.logs
            for h in heuristics
        ]
        bound_jobs = [(log, ratios, ReplayOptions().thrash_limit) for log in args.logs]
        results, bounds = _run(jobs, bound_jobs, args.jobs)
    except (DTRError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json_lines(replace(r, **bounds[r.log].json_fields(r.ratio)) for r in results))
    else:
        print(tables(results, reference=reference, markdown=args.markdown, bounds=bounds))
    return 0


def run_job(job: tuple[str, list[float], ReplayOptions]) -> list[ReplayResult]:
    """Parse one log, take its baseline, and replay it at every ratio with one heuristic."""
    path, ratios, options = job
    trace = parse_log(path)
    base = baseline(trace)
    return [replay(trace, ratio, options, base) for ratio in ratios]


def bound_job(job: tuple[str, list[float], float | None]) -> LogBounds:
    """Parse one log, take its baseline, and compute its lower bounds at every ratio (bounds.py)."""
    path, ratios, thrash_limit = job
    trace = parse_log(path)
    base = baseline(trace)
    return log_bounds(trace.name, build_schedule(trace), base.peak_bytes, base.compute, ratios, thrash_limit)


def _run(jobs: list, bound_jobs: list, processes: int) -> tuple[list[ReplayResult], dict[str, LogBounds]]:
    if processes <= 1 or len(jobs) + len(bound_jobs) <= 1:
        bounds = [bound_job(job) for job in bound_jobs]
        results = [r for job in jobs for r in run_job(job)]
    else:
        with ProcessPoolExecutor(min(processes, len(jobs) + len(bound_jobs))) as pool:
            pending = [pool.submit(bound_job, job) for job in bound_jobs]
            results = [r for rows in pool.map(run_job, jobs) for r in rows]
            bounds = [future.result() for future in pending]
    return results, {b.log: b for b in bounds}


def _ratios(text: str) -> list[float]:
    try:
        ratios = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise config.ConfigError(f"--ratios {text!r}: expected comma-separated numbers such as 0.2,0.5,1.0") from None
    if not ratios or any(not 0 < r <= 1 for r in ratios):
        raise config.ConfigError(f"--ratios {text!r}: every ratio must be in (0, 1]")
    return ratios


def _heuristics(text: str) -> list[str]:
    names = [h.strip() for h in text.split(",") if h.strip()]
    for name in names:
        if name not in HEURISTICS:
            raise config.ConfigError(
                f"--heuristic {name!r} is unknown; expected one of {', '.join(sorted(HEURISTICS))}"
            )
    return names


def _number(text: str) -> float | str:
    """`text` as a float when it reads as one (the config validator then judges it), else `text` itself."""
    try:
        return float(text)
    except ValueError:
        return text


def _flag(flag: str, name: str, value: object):
    """`value` checked by the config validator of the flag `name` (one rule for the library and the command)."""
    try:
        return config.validate(name, value)
    except config.ConfigError as exc:
        raise config.ConfigError(f"{flag}: {exc}") from None


def _positive_int(text: str, flag: str) -> int:
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise config.ConfigError(f"{flag} {text!r}: expected 'all', 'sqrt' or a positive integer")
