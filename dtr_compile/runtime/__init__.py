"""Eager DTR on torch tensors: `with dtr_compile.runtime.enable(memory_budget=...) as rt:`.

Every aten call inside the context goes through one generic dispatch path (dispatch.py) that drives
the torch-free engine (dtr_compile.engine). The program keeps its ordinary tensors; the runtime frees
the bytes of some of them under the budget and recomputes them on demand (values.py), replaying RNG
state for random ops. Compiled regions of `torch.compile(backend="dtr")` join the same runtime as
single operations (regions.py).
"""

from .runtime import Runtime, RuntimeStats, enable

__all__ = ["Runtime", "RuntimeStats", "enable"]
