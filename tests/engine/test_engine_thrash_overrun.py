"""Thrashing in a step the budget cannot hold, and what a ThrashError says (issue 16, class 7).

A compiled part with an op-by-op fallback reserves strictly (a BudgetError tells its caller to run it op by op).
The strict reservation used to turn the engine's overrun mode off altogether, so a recompute beyond thrash_limit
inside it raised a ThrashError even in a step whose budget overrun mode had already lifted, and the message read
"under a budget of unknown" (GPT-2 at 0.3 under Inductor: 'region2.backward' recomputing 'prims.iota.default').
"""

from __future__ import annotations

import pytest

from dtr_compile.errors import BudgetError, ThrashError
from tests.engine.engine_harness import UNIT, Harness


def _thrashing_step(budget: int | None) -> tuple[Harness, object]:
    """An op of cost 6 against a reference compute of 10, evicted and used twice: 12 > 1.0 x 10."""
    h = Harness(budget, thrash_limit=1.0, thrash_reference_cost=10.0)
    x = h.constant(counted=False)
    (big,) = h.op("expensive", [x], cost=6.0)
    h.engine.evict(big)
    h.use(big)
    h.engine.evict(big)
    return h, big


def test_a_strict_reservation_in_an_overrun_step_raises_the_budget_instead_of_thrashing() -> None:
    h, big = _thrashing_step(4 * UNIT)
    h.engine.overrun = True
    h.use(big)  # beyond thrash_limit: overrun mode raises the budget, then lifts it for the rest of the step
    assert h.engine.budget_bytes is None and h.engine.overrun_need is not None
    h.engine.evict(big)
    h.engine.reserve([big], 0, "region2.backward", strict=True)  # recomputes once more: no ThrashError
    h.engine.abandon([big])
    assert big.resident
    assert "thrash_limit" in h.engine.overrun_at


def test_a_strict_reservation_still_refuses_what_does_not_fit() -> None:
    h = Harness(2 * UNIT)
    h.engine.overrun = True
    x = h.constant(counted=False)
    h.op("a", [x])
    with pytest.raises(BudgetError):
        h.engine.reserve([x], 3 * UNIT, "part", strict=True)
    assert h.engine.overrun_need is None, "a strict reservation that does not fit raises instead of overrunning"


@pytest.mark.parametrize(
    ("budget", "named"),
    [(4 * UNIT, f"under a budget of 3.91 KiB ({4 * UNIT} bytes)"), (None, "with the budget lifted")],
)
def test_a_thrash_error_names_the_budget_and_what_to_change(budget: int | None, named: str) -> None:
    h, big = _thrashing_step(budget)
    with pytest.raises(ThrashError) as info:
        h.use(big)
    message = str(info.value)
    assert "unknown" not in message
    assert named in message, message
    assert "Raise memory_budget" in message and "thrash_limit" in message, message
    if budget is not None:
        assert f"above {budget} bytes" in message, message
