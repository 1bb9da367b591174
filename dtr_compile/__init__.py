"""dtr_compile: train PyTorch models under a memory budget by tensor rematerialization.

    import torch, dtr_compile
    dtr_compile.config.memory_budget = "2GB"
    model = torch.compile(model, backend="dtr")

    with dtr_compile.runtime.enable(memory_budget="1GB") as rt:   # eager DTR, no compiler
        model(x).sum().backward()

The layers that need torch (`runtime`, `backend`, `measure`) are imported on first use, so the engine
and the log replay (`python -m dtr_compile.sim`) start without loading torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import config
from .errors import BudgetError, ConfigError, DeviceError, DTRError, LogFormatError, MeasurementError, ThrashError
from .explain import explain

__version__ = "0.1.0"

_LAZY_SUBMODULES = ("runtime", "backend", "measure", "passes", "bench", "sim", "kernels")

__all__ = [
    "BudgetError",
    "ConfigError",
    "DTRError",
    "DeviceError",
    "LogFormatError",
    "MeasurementError",
    "ThrashError",
    "backend",
    "bench",
    "config",
    "explain",
    "kernels",
    "measure",
    "passes",
    "runtime",
    "sim",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'dtr_compile' has no attribute {name!r}")
