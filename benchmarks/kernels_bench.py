"""Moved into the package: `python -m dtr_compile.bench kernels` (dtr_compile/bench/suites/kernels.py); kept for old commands."""

import sys

from dtr_compile.bench.suites.kernels import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
