"""Moved into the package: `python -m dtr_compile.bench compiled` (dtr_compile/bench/suites/compiled.py); kept for old commands."""

import sys

from dtr_compile.bench.suites.compiled import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
