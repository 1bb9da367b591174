"""planned_sizes.py: a symbolic size counts at the values a plan is made at, and a region's inputs report the
largest sizes they were called with."""

from __future__ import annotations

import torch
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from dtr_compile.planned_sizes import SizesSeen, planned_at, planned_value
from dtr_compile.tensor_bytes import size_hint


def _symbolic(hint: int, name: str):
    env = ShapeEnv()
    symbol = env.create_symbol(hint, ConstantSource(name))
    return env.create_symintnode(symbol, hint=hint), symbol


def test_a_symbolic_size_counts_at_the_planned_values_and_at_its_hint_outside() -> None:
    seq, symbol = _symbolic(96, "seq")
    scores = seq * seq * 4  # an expression of the symbol, as a derived size is
    assert planned_value(scores) is None and size_hint(scores) == 96 * 96 * 4
    with planned_at({symbol: 128}):
        assert planned_value(scores) == size_hint(scores) == 128 * 128 * 4
        assert size_hint(7) == 7
    assert size_hint(scores) == 96 * 96 * 4


def test_sizes_seen_grow_only_with_a_larger_call() -> None:
    seq, symbol = _symbolic(96, "seq")

    seen = SizesSeen([torch.empty(2), seq])  # an int input that is the symbol itself
    assert seen.values == {symbol: 96}
    assert not seen.grow([torch.empty(2), 64]) and seen.values == {symbol: 96} and seen.last == {symbol: 64}
    assert seen.grow([torch.empty(2), 128]) and seen.values == {symbol: 128}
    assert not seen.grow([torch.empty(2), 128])
