"""Errors a user can act on. Every one is a `DTRError`, and every message says what to change.

This module imports nothing from torch so that the engine and the log replay can use it.
"""

from __future__ import annotations


class DTRError(Exception):
    """Base class of every error dtr_compile raises on purpose."""


class ConfigError(DTRError, ValueError):
    """A configuration value (budget, heuristic, flag name) is invalid."""


class DeviceError(ConfigError):
    """A device was asked for that this machine does not have (e.g. `--device cuda` without CUDA)."""


class BudgetError(DTRError):
    """The memory budget cannot be met.

    `smallest_feasible_bytes` is the smallest budget known to be feasible when it can be known, otherwise
    a lower bound (`is_lower_bound` is then True) or None.
    """

    def __init__(
        self,
        message: str,
        *,
        budget_bytes: int | None = None,
        smallest_feasible_bytes: int | None = None,
        is_lower_bound: bool = False,
    ) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.smallest_feasible_bytes = smallest_feasible_bytes
        self.is_lower_bound = is_lower_bound


class ThrashError(DTRError):
    """Recomputation cost exceeded the thrash limit: the budget is too tight to make progress cheaply."""


class MeasurementError(DTRError, RuntimeError):
    """A peak could not be measured: the meter's evidence that its profiler recorded the step is missing."""


class UnsupportedWrapperError(DTRError):
    """A distributed wrapper (DDP, FSDP2) in a configuration `backend="dtr"` cannot keep under a memory budget
    (dtr_compile/distributed.py); the message says what to change."""


class LogFormatError(DTRError, ValueError):
    """An operation log is malformed or truncated."""


def format_bytes(n: float | None) -> str:
    """Human-readable bytes with IEC units, e.g. 1536 -> '1.50 KiB'."""
    if n is None:
        return "unknown"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
