"""Keep Inductor's kernel fusion from undoing the plan's memory schedule.

The plan places every recompute right before its first use and frees it after its last; its peak
model assumes each value is allocated where the plan put the node that makes it. Inductor's scheduler
may fuse two nodes that lie far apart in that order (horizontal fusion of nodes that read the same
inputs, or a producer with a distant consumer), and the fused kernel runs at the position of the
earlier one: the later node's outputs are then allocated early and live across everything between.
With recomputation this happens often, because a recompute reads the same saved values as the
forward-time nodes and as other recomputes of the same value (measured on a 4-block GPT at budget
0.45: 1.20x the planned peak with Inductor's defaults, 0.98x with this guard).

`PlanOrderChoices` is an Inductor choices handler that refuses any fusion of two scheduler nodes more
than `max_gap` nodes apart in the scheduler's original order (Inductor itself refuses horizontal
fusions more than 64 apart, for the same reason). Fusions of neighbours, which make up the usual
pointwise chains and epilogues, are untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch._inductor.choices import InductorChoices

# How far apart (in Inductor scheduler nodes, original order) two nodes may be and still fuse.
DEFAULT_MAX_GAP = 1


def fusion_gap(node1: Any, node2: Any) -> int:
    """Scheduler nodes strictly between the two (fused groups count by their first and last member)."""
    if node1.max_order < node2.min_order:
        return node2.min_order - node1.max_order - 1
    if node2.max_order < node1.min_order:
        return node1.min_order - node2.max_order - 1
    return 0  # the groups interleave


class PlanOrderChoices(InductorChoices):
    """Inductor's default heuristics, except that fusions may not move a node far from its planned place."""

    def __init__(self, max_gap: int | None = None) -> None:
        super().__init__()
        self.max_gap = DEFAULT_MAX_GAP if max_gap is None else max_gap

    def can_fuse_vertical(self, scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        if fusion_gap(node1, node2) > self.max_gap:
            return False
        return super().can_fuse_vertical(scheduler, node1, node2, shared_data_score)

    def can_fuse_horizontal(self, scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        if fusion_gap(node1, node2) > self.max_gap:
            return False
        return super().can_fuse_horizontal(scheduler, node1, node2, shared_data_score)


def guarded_inner_compile(inner_compile: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap Inductor's `compile_fx_inner` so that each graph it compiles (forward, and the backward,
    which AOTAutograd may compile later) is scheduled with `PlanOrderChoices`."""
    from torch._inductor.virtualized import V

    def inner(gm: Any, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        with V.set_choices_handler(PlanOrderChoices()):
            return inner_compile(gm, example_inputs, **kwargs)

    return inner
