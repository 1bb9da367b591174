"""Entry point of `python -m dtr_compile.sim` (see cli.py)."""

import sys

from .cli import main

sys.exit(main())
