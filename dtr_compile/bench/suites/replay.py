"""Suite `replay`: operation-log replay, our heuristics on the DTR authors' logs beside their simulator's numbers.

    python -m dtr_compile.bench replay ../shared/dtr-logs/*.log.gz --reference ../shared/dtr-logs/reference-simrd.md

The same command as `python -m dtr_compile.sim` (same flags, same tables), reached from the bench so that every
table of BENCHMARKS.md names a `python -m dtr_compile.bench` command. The replay lives in `dtr_compile.sim`, a
room beside the bench, so it is loaded by name when the suite runs (upstairs.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .. import upstairs

SUMMARY = "operation-log replay of the DTR authors' logs beside their simulator (= python -m dtr_compile.sim)"


def build_parser() -> argparse.ArgumentParser:
    parser = upstairs.load("sim.cli").build_parser()
    parser.prog = "python -m dtr_compile.bench replay"
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return upstairs.load("sim.cli").main(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
