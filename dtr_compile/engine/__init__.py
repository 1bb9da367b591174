"""The eviction engine: storages, operations, a clock and heuristics, in plain Python (no torch).

Its three callers are the torch runtime (`dtr_compile.runtime`), the log replay (`dtr_compile.sim`)
and the compile-time planner (`dtr_compile.passes`).
"""

from .core import Engine, EngineStats, Executor, NullExecutor
from .heuristics import HEURISTICS, Heuristic, get_heuristic
from .records import EqClass, Operation, Storage

__all__ = [
    "HEURISTICS",
    "Engine",
    "EngineStats",
    "EqClass",
    "Executor",
    "Heuristic",
    "NullExecutor",
    "Operation",
    "Storage",
    "get_heuristic",
]
