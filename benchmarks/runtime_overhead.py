"""Moved into the package: `python -m dtr_compile.bench runtime-overhead` (dtr_compile/bench/suites/runtime_overhead.py); kept for old commands."""

import sys

from dtr_compile.bench.suites.runtime_overhead import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
