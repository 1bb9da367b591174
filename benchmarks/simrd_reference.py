"""Moved into the package: `python -m dtr_compile.bench simrd-reference` (dtr_compile/bench/suites/simrd_reference.py); kept for old commands."""

import sys

from dtr_compile.bench.suites.simrd_reference import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
