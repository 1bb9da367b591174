"""Eager DTR on torch tensors: `with dtr_compile.runtime.enable(memory_budget=...) as rt:`.

Every aten call inside the context goes through one generic dispatch path (dispatch.py) that drives
the torch-free engine (dtr_compile.engine): tensors are handles (`DTRTensor`) whose storages may be
evicted under the budget and recomputed on demand, replaying RNG state for random ops.
"""

from .runtime import Runtime, RuntimeStats, enable
from .tensor import DTRTensor

__all__ = ["DTRTensor", "Runtime", "RuntimeStats", "enable"]
