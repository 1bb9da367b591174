"""Eager DTR on torch tensors: `with dtr_compile.runtime.enable(memory_budget=...) as rt:`.

Every aten call inside the context goes through one generic dispatch path (dispatch.py) that drives
the torch-free engine (dtr_compile.engine). The program keeps its ordinary tensors; the runtime frees
the bytes of some of them under the budget and recomputes them on demand (values.py), replaying RNG
state for random ops. Compiled regions of `torch.compile(backend="dtr")` join the same runtime as
single operations (backend/region.py).
"""

from torch._dynamo import trace_rules as _trace_rules

from .implicit import finish_steps, implicit_runtime
from .runtime import Runtime, RuntimeStats, enable

# The runtime's code runs inside compiled frames too (saved-tensor hooks, handle deaths, compiled parts, the
# dispatch mode): TorchDynamo must never trace it. Skipping the package costs nothing per call, unlike a
# torch.compiler.disable wrapper on each entry point.
_trace_rules.add(__name__)
_trace_rules.add("dtr_compile.backend.region")

__all__ = ["Runtime", "RuntimeStats", "enable", "finish_steps", "implicit_runtime"]
