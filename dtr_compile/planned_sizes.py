"""The values a plan takes a graph's symbolic (dynamic) sizes at.

Dynamo compiles a graph once for every value of a size it has seen change (automatic dynamic shapes). Its
symbolic sizes carry hints: the values of the call that traced them. A plan made at the hints does not hold at
larger values, because a plan's memory grows with its sizes (attention's scores with the square of the sequence).
Fine-tuning with dynamic padding calls a model with a new sequence length every step: HF GPT-2 and Llama at 0.6,
lengths 128, 96, 128, 64, 96, planned at 96 and ran at 128, where the runtime made room for (128/96)^2 = 1.8x the
region and raised BudgetError. So a region plans at the largest value of each size it has been called with
(backend/region.py: `SizesSeen`), and everything that counts the bytes or FLOPs of a symbolic size (tensor_bytes.py,
roofline.py, the plan cache's key) reads it through `planned_value` here, which gives its value at those sizes while
`planned_at` is active (None otherwise: the caller takes the hint, compat.size_hint). On the ground floor: it imports
no other part of the package.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from typing import Any

import sympy
import torch

_PLANNED_AT: contextvars.ContextVar[Mapping[sympy.Symbol, int] | None] = contextvars.ContextVar(
    "dtr_planned_sizes", default=None
)


@contextlib.contextmanager
def planned_at(values: Mapping[sympy.Symbol, int]) -> Iterator[None]:
    """Within: a symbolic size whose symbols `values` all gives stands for its expression at them."""
    token = _PLANNED_AT.set(dict(values) or None)
    try:
        yield
    finally:
        _PLANNED_AT.reset(token)


def planned_value(size: Any) -> int | None:
    """The value a symbolic size takes at the planned values while `planned_at` gives all of its symbols; None
    otherwise (the caller takes its hint), and for a plain int."""
    values = _PLANNED_AT.get()
    if values is None or not isinstance(size, torch.SymInt):
        return None
    expr = size.node.expr
    free = expr.free_symbols
    if not free or not free <= values.keys():  # a symbol not planned for (or an unbacked one): its hint stands
        return None
    return int(expr.xreplace({symbol: sympy.Integer(values[symbol]) for symbol in free}))


class SizesSeen:
    """The largest value each symbolic size of a graph's inputs has been called with.

    `example_inputs` are the graph's fake inputs (Dynamo's): a tensor's size, or an integer input, that is a
    plain symbol is tracked; sizes that are expressions of symbols follow from those."""

    def __init__(self, example_inputs: list[Any]) -> None:
        self._where: list[tuple[int, int | None, sympy.Symbol]] = []  # (input, dim or None for an int input, symbol)
        self.values: dict[sympy.Symbol, int] = {}
        for i, value in enumerate(example_inputs):
            sizes = [(d, s) for d, s in enumerate(value.shape)] if isinstance(value, torch.Tensor) else [(None, value)]
            for dim, size in sizes:
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    symbol = size.node.expr
                    self._where.append((i, dim, symbol))
                    self.values.setdefault(symbol, int(size.node.hint))
        self.last: dict[sympy.Symbol, int] = dict(self.values)  # the sizes of the last call

    def grow(self, args: list[Any]) -> bool:
        """Note the sizes of a call on `args`; True when one is larger than any seen (the plan must be made again)."""
        grew = False
        for i, dim, symbol in self._where:
            value = args[i]
            size = value.shape[dim] if dim is not None else value
            if isinstance(size, int):
                self.last[symbol] = size
                if size > self.values[symbol]:
                    self.values[symbol] = size
                    grew = True
        return grew
