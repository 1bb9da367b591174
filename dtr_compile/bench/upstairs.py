"""The rooms above the bench (the runtime, the passes, the backend, the log replay), reached by name at run time.

`dtr_compile.bench` sits on the third floor of the package (tests/test_architecture.py): it may import the
engine, config, measure and the other second-floor rooms, not the runtime or the passes beside it, nor the
backend above it, which imports the runtime and the passes. What it measures is those rooms, so a suite loads
them when it runs, by module name, here and nowhere else: the static import graph stays as the floors say (the
backend, the demo and fit are built on the bench's models, not the other way round), and a reader sees in one
file every place where the bench reaches upstairs.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def load(room: str) -> ModuleType:
    """`dtr_compile.<room>` (e.g. "runtime", "backend", "passes.fuse_recompute", "sim.reference")."""
    return importlib.import_module(f"dtr_compile.{room}")
