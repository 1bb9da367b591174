"""`python -m dtr_compile.bench`: see dtr_compile/bench/cli.py."""

import sys

from .cli import main

sys.exit(main())
