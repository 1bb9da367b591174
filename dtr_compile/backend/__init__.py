"""The "dtr" torch.compile backend: AOTAutograd joint graph -> plan under the budget -> codegen.

    model = torch.compile(model, backend="dtr")   # found through the torch_dynamo_backends entry point

It reads `dtr_compile.config` when Dynamo hands it a graph: `memory_budget` (bytes, fraction of the
no-remat peak, or None), `codegen` ("inductor" or "fx") and `compiled_steps`. Each graph becomes a `Region`
(region.py): planned under its share of the budget, its compiled parts run as operations of the eager runtime
inside a training step. aot.py wires a region through AOTAutograd, our partitioner and the code generator.

Imports inside the room go one way: this entry point -> region.py (the handoff) -> aot.py (the wiring).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import fx

from .aot import compile_region, make_backend

__all__ = ["compile_region", "dtr_backend", "make_backend", "through_dynamo"]


def dtr_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
    """Dynamo backend entry point (`backend="dtr"`). Extra `options=` from torch.compile are refused."""
    if kwargs:
        raise TypeError(
            f"backend 'dtr' takes no options {sorted(kwargs)}; set dtr_compile.config.memory_budget / codegen instead"
        )
    from ..errors import DTRError
    from .region import Region

    try:
        return Region(gm, example_inputs)
    except DTRError as error:
        raise through_dynamo(error) from error


def through_dynamo(error: BaseException) -> BaseException:
    """`error` as an instance of a subclass of its own class that TorchDynamo lets pass unwrapped.

    Dynamo wraps what a backend raises in `BackendCompilerFailed`, except its `ShortenTraceback` family; so
    a BudgetError raised while compiling reaches `except dtr_compile.BudgetError` as a BudgetError (with its
    attributes), not as a Dynamo error the user cannot act on."""
    from torch._dynamo.exc import ShortenTraceback

    cls = type(error)
    if isinstance(error, ShortenTraceback):
        return error
    passing = _PASSING.get(cls)
    if passing is None:
        passing = _PASSING[cls] = type(cls.__name__, (cls, ShortenTraceback), {"__module__": cls.__module__})
    wrapped = passing.__new__(passing)
    wrapped.__dict__.update(error.__dict__)
    wrapped.args = error.args
    wrapped.first_useful_frame = None  # ShortenTraceback: keep the whole traceback
    return wrapped


_PASSING: dict[type, type] = {}
