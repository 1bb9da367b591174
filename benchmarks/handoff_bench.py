"""Moved into the package: `python -m dtr_compile.bench handoff` (dtr_compile/bench/suites/handoff.py); kept for old commands."""

import sys

from dtr_compile.bench.suites.handoff import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
